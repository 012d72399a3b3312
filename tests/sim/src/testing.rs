//! [`SimMount`]: a simulator mount for tests.
//!
//! ```no_run
//! use gpuvisor_sim::SimMount;
//! let sim = SimMount::start("l40s-2x16")?;
//! let root = sim.path(); // use as the agent's host_root
//! sim.ctl(&["set-type", "0000:41:00.4", "1148"])?;
//! let state = sim.state()?;
//! assert_eq!(state["gpus"][0]["vfs"][0]["type"], 1148);
//! # anyhow::Ok(())
//! ```
//!
//! Each `SimMount` has its own temporary directory and `gpuvisor-sim` process, so tests in
//! many processes can run in parallel.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::READY_PREFIX;

/// How long [`SimMount::start`] waits for the ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `Drop` waits for the process after SIGTERM before SIGKILL.
const EXIT_TIMEOUT: Duration = Duration::from_secs(5);

/// A running `gpuvisor-sim mount` on a fresh temporary directory; dropped = unmounted.
pub struct SimMount {
    dir: tempfile::TempDir,
    root: PathBuf,
    child: Child,
}

/// Finds the `gpuvisor-sim` binary: `$GPUVISOR_SIM_BIN`, else next to the current executable
/// or one directory up (`target/<profile>/deps/<test>` → `target/<profile>/gpuvisor-sim`).
pub fn sim_binary() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("GPUVISOR_SIM_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("locating the current executable")?;
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let cand = d.join("gpuvisor-sim");
        if cand.is_file() {
            return Ok(cand);
        }
        dir = d.parent();
    }
    bail!(
        "gpuvisor-sim binary not found near {} (build it with `cargo build -p gpuvisor-sim` or set GPUVISOR_SIM_BIN)",
        exe.display()
    )
}

impl SimMount {
    /// Starts a simulator. `model` is a preset name (`l40s-2x16`, `h200-1x8`, `l40s-mdev`,
    /// `pt-2`, `l40s-pt`) or TOML model text (anything containing a newline or `=`), or a
    /// path to a model file.
    /// Returns once the mount has printed its ready line (or fails after 30 s).
    pub fn start(model: &str) -> anyhow::Result<SimMount> {
        let dir =
            tempfile::Builder::new().prefix("gpuvisor-sim.").tempdir().context("creating a temporary directory")?;
        let root = dir.path().join("root");
        std::fs::create_dir(&root)?;
        let model_arg = if model.contains('\n') || model.contains('=') {
            let p = dir.path().join("model.toml");
            std::fs::write(&p, model)?;
            p.to_string_lossy().into_owned()
        } else {
            model.to_string()
        };
        let bin = sim_binary()?;
        let mut child = Command::new(&bin)
            .arg("mount")
            .arg("--model")
            .arg(&model_arg)
            .arg(&root)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout pipe"))?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut ready = Some(tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with(READY_PREFIX) {
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(());
                    }
                }
            }
        });
        let mut mount = SimMount { dir, root, child };
        match rx.recv_timeout(READY_TIMEOUT) {
            Ok(()) => Ok(mount),
            Err(_) => {
                let status = mount.child.try_wait().ok().flatten();
                bail!("gpuvisor-sim did not become ready (exit status {status:?}; see its stderr)")
            }
        }
    }

    /// The mount directory: the agent's `host_root`.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The simulator's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a control command, e.g. `ctl(&["fail-write", "sys/...", "EIO", "--times", "2"])`.
    /// Returns the answer (`{"ok": true, ...}`); fails on `{"ok": false}`.
    pub fn ctl(&self, argv: &[&str]) -> anyhow::Result<serde_json::Value> {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        crate::ctl::request_ok(&self.root, &argv)
    }

    /// The state dump (§10.6).
    pub fn state(&self) -> anyhow::Result<serde_json::Value> {
        let mut v = self.ctl(&["state"])?;
        Ok(v["state"].take())
    }

    fn mounted(&self) -> bool {
        let Ok(m) = std::fs::read_to_string("/proc/self/mounts") else {
            return false;
        };
        let me = self.root.to_string_lossy();
        m.lines().any(|l| l.split_whitespace().nth(1) == Some(me.as_ref()))
    }
}

impl Drop for SimMount {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + EXIT_TIMEOUT;
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        if self.mounted() {
            let _ = Command::new("fusermount3").arg("-uz").arg(&self.root).stderr(Stdio::null()).status();
        }
        let _ = &self.dir;
    }
}
