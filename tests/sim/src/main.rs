//! `gpuvisor-sim`: `mount --model <preset|model.toml> DIR` serves the simulated host in the
//! foreground until SIGTERM/SIGINT; `ctl DIR <command> [args]` talks to a running mount.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use nix::sys::signal::{SigSet, Signal};

use gpuvisor_sim::{ctl, fs, model::Model, state::State, READY_PREFIX};

#[derive(Parser)]
#[command(name = "gpuvisor-sim", about = "Simulated NVIDIA GPU host (FUSE)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Mount the simulated host on DIR and serve it until SIGTERM/SIGINT.
    Mount {
        /// Preset name (l40s-2x16, h200-1x8, l40s-mdev, pt-2, l40s-pt) or path to a model TOML file.
        #[arg(long)]
        model: String,
        /// Mount point (an existing directory).
        dir: PathBuf,
    },
    /// Send one control command to the simulator mounted at DIR; print the JSON answer.
    Ctl {
        /// Mount point.
        dir: PathBuf,
        /// Command and arguments, e.g. `fail-write 'sys/bus/pci/devices/*/nvidia/current_vgpu_type' EIO`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        argv: Vec<String>,
    },
}

fn mount(model: &str, dir: PathBuf) -> anyhow::Result<()> {
    let model = Model::load(model)?;
    model.validate()?;
    // Block the signals before any thread starts so that only `sigwait` below sees them.
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.thread_block().context("blocking signals")?;
    let session =
        fs::mount(fs::SimFs::new(State::new(model)), &dir).with_context(|| format!("mounting on {}", dir.display()))?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{READY_PREFIX}{}", dir.display())?;
        out.flush()?;
    }
    let _sig = set.wait().context("waiting for a signal")?;
    drop(session);
    // If the unmount failed (busy), detach lazily so the directory is usable again.
    let _ = nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH);
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Mount { model, dir } => match mount(&model, dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("gpuvisor-sim: {e:#}");
                ExitCode::FAILURE
            }
        },
        // Help needs no mount: it comes from the command table itself.
        Cmd::Ctl { argv, .. } if ctl::help(&argv).is_some() => match ctl::help(&argv) {
            Some(Ok(text)) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Some(Err(e)) => {
                eprintln!("gpuvisor-sim ctl: {e}");
                ExitCode::from(2)
            }
            None => ExitCode::FAILURE,
        },
        Cmd::Ctl { dir, argv } => match ctl::request(&dir, &argv) {
            Ok(v) => {
                println!("{v}");
                if v.get("ok").and_then(|o| o.as_bool()) == Some(true) {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                }
            }
            Err(e) => {
                eprintln!("gpuvisor-sim ctl: {e:#}");
                ExitCode::from(2)
            }
        },
    }
}
