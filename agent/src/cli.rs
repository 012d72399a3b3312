//! # cli — the `gpuvisor` command line
//!
//! `gpuvisor serve` runs the agent; every other subcommand is a JSON-RPC client of a
//! running agent (tables for people, `--output json` for scripts), except
//! `plugin test`, which runs a plugin locally.

use crate::config::{Config, VfioAttach};
use crate::instances::request::{
    CreateRequest, DryRunParams, ForkParams, GpuRequest, ImportParams, NameParams, RefParams, SaveStateParams,
    StopParams, UnquarantineParams,
};
use crate::rpc::api::{method, ApiMethod, MetricsText, NoParams};
use crate::rpc::client::{self, ClientError};
use crate::wire::{DeleteResult, InstanceView};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::path::PathBuf;

mod plugin_test;
mod print;

use print::{
    print_gpus, print_images, print_instance, print_json, print_plugins, print_ps, print_resources, print_snapshots,
    print_stats, print_update, table,
};

/// The exit codes of client commands.
pub mod exit {
    /// Done.
    pub const OK: i32 = 0;
    /// The agent answered an error.
    pub const ERROR: i32 = 1;
    /// Bad command-line usage.
    pub const USAGE: i32 = 2;
    /// No agent answers on the socket.
    pub const UNREACHABLE: i32 = 3;
    /// The operation is done, but a GPU release is pending (`release_pending`,
    /// `vgpu_cleanup_pending`): the device is still blocked and the agent retries.
    pub const RELEASE_PENDING: i32 = 4;
    /// The operation is done, but the device it gave back was quarantined
    /// (`released_device_quarantined`): it is not handed out again until an operator clears it.
    pub const DEVICE_QUARANTINED: i32 = 5;
}

/// The version line: the crate version and the build kind (a failpoint build says so).
pub const VERSION: &str = if cfg!(feature = "failpoints") {
    concat!(env!("CARGO_PKG_VERSION"), " (failpoint build: not for production)")
} else {
    env!("CARGO_PKG_VERSION")
};

/// gpuvisor — GPU VMs on Linux hosts (QEMU, NVIDIA vGPU), driven over JSON-RPC.
#[derive(Debug, Parser)]
#[command(name = "gpuvisor", version = VERSION, about)]
pub struct Cli {
    /// The agent's JSON-RPC socket.
    #[arg(long, global = true, env = "GPUVISOR_SOCKET", default_value = "/run/gpuvisor/gpuvisor.sock")]
    pub socket: PathBuf,
    /// Output format of client commands.
    #[arg(long, short = 'o', global = true, value_enum, default_value = "table")]
    pub output: Output,
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands whose output `-o/--output` does not change: they print no result
/// (`serve`), or always the same form (`completions`, `manpages`, `console`).
/// The flag is left out of their help, man page and completions, and refused on their
/// command line (before or after the subcommand).
const WITHOUT_OUTPUT: &[&[&str]] = &[&["serve"], &["completions"], &["manpages"], &["console"]];

/// The subcommands that talk to no agent, so `--socket` does nothing: left out of their
/// help, man page and completions, and refused after them on the command line.
const WITHOUT_SOCKET: &[&[&str]] = &[&["plugin", "test"]];

impl Cli {
    /// The command-line definition: the derive's, with `-o/--output` taken off the
    /// [`WITHOUT_OUTPUT`] subcommands. `--help`, the man pages and the completions all use it.
    pub fn definition() -> clap::Command {
        /// A hidden argument of a global's id: it keeps the global one from being propagated
        /// into `cmd` (clap skips a global whose id the subcommand already has).
        fn shadow(arg: &clap::Arg, path: &[&str], cmd: clap::Command) -> clap::Command {
            match path {
                [] => cmd.arg(arg.clone()),
                [first, rest @ ..] => cmd.mut_subcommand(first, |s| shadow(arg, rest, s)),
            }
        }
        let output =
            clap::Arg::new("output").long("output").short('o').hide(true).value_parser(clap::value_parser!(Output));
        let socket = clap::Arg::new("socket").long("socket").hide(true).value_parser(clap::value_parser!(PathBuf));
        let cmd = WITHOUT_OUTPUT.iter().fold(<Cli as clap::CommandFactory>::command(), |c, p| shadow(&output, p, c));
        WITHOUT_SOCKET.iter().fold(cmd, |c, p| shadow(&socket, p, c))
    }

    /// Parses a command line (the first item is the program name). Errors are clap's, ready
    /// to print: a bad flag, or `-o/--output` given to a [`WITHOUT_OUTPUT`] subcommand.
    pub fn try_parse_args_from<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::FromArgMatches;
        let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        let mut cmd = Cli::definition();
        let m = cmd.try_get_matches_from_mut(args.clone())?;
        let mut path = Vec::new();
        let mut sub = &m;
        while let Some((name, next)) = sub.subcommand() {
            path.push(name);
            sub = next;
        }
        // Global values reach every level, so the top level tells whether it was given.
        if m.value_source("output") == Some(clap::parser::ValueSource::CommandLine)
            && WITHOUT_OUTPUT.contains(&path.as_slice())
        {
            return Err(cmd.error(
                clap::error::ErrorKind::ArgumentConflict,
                format!(
                    "-o/--output does not apply to `gpuvisor {}`: it changes only how client commands print their results",
                    path.join(" ")
                ),
            ));
        }
        // Given after the subcommand (before it, it is the program's global option, which
        // clap hands down to every subcommand).
        let after_subcommand = || {
            let words: Vec<&str> = args.iter().map(|a| a.to_str().unwrap_or_default()).collect();
            let at = words.windows(path.len().max(1)).position(|w| w == path.as_slice());
            at.is_some_and(|at| words[at..].iter().any(|w| *w == "--socket" || w.starts_with("--socket=")))
        };
        if WITHOUT_SOCKET.contains(&path.as_slice()) && after_subcommand() {
            return Err(cmd.error(
                clap::error::ErrorKind::ArgumentConflict,
                format!(
                    "--socket does not apply to `gpuvisor {}`: it runs locally and talks to no agent",
                    path.join(" ")
                ),
            ));
        }
        Cli::from_arg_matches(&m).map_err(|e| e.format(&mut cmd))
    }

    /// Parses the process's command line; prints the error (or the help) and exits as clap
    /// does otherwise.
    pub fn parse_args() -> Cli {
        Cli::try_parse_args_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }
}

/// Output format of client commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    Table,
    /// The agent's JSON answer, as is.
    Json,
}

// The subcommands of `gpuvisor`. No doc comment: clap would make it the `about` of the command above,
// replacing that command's own.
#[allow(missing_docs)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent (JSON-RPC server).
    Serve(ServeArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) on stdout.
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the man pages (gpuvisor.1 and one per subcommand) into a directory.
    #[command(hide = true)]
    Manpages {
        /// The directory the pages are written into (created if missing).
        dir: PathBuf,
    },
    /// Create and boot an instance.
    Create {
        /// The new instance's name: [a-z0-9][a-z0-9-]{0,62}, unique on this agent.
        name: String,
        /// The image to boot (`gpuvisor image ls`).
        #[arg(long)]
        image: String,
        /// A vGPU profile (e.g. L40S-2Q), or a whole GPU: `passthrough` (any free one) or
        /// `passthrough=<BDF>` (that one).
        #[arg(long)]
        gpu: Option<String>,
        /// key=value (repeatable).
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// vCPUs, 1..=64 (default 1).
        #[arg(long)]
        vcpus: Option<u32>,
        /// Guest memory, MiB, 64..=1048576 (default 256).
        #[arg(long)]
        memory_mib: Option<u64>,
        /// qemu or cloud-hypervisor (default: what the hypervisor plugin chooses).
        #[arg(long)]
        hypervisor: Option<String>,
        /// When the VMM dies without a stop: no (default), on-failure, always.
        #[arg(long, value_enum)]
        restart: Option<RestartArg>,
        /// Start it again when the agent starts after a host reboot.
        #[arg(long)]
        autostart: bool,
        /// A virtio-net NIC (repeatable, in guest order): `user`,
        /// `user,fwd=[tcp|udp:][ADDR:]HOSTPORT-:GUESTPORT` (more `,fwd=` allowed; ADDR
        /// defaults to 127.0.0.1), or `bridge=BRIDGE` (a tap on that existing bridge).
        #[arg(long = "nic", value_parser = crate::network::parse_nic_flag)]
        nics: Vec<crate::network::Nic>,
        /// A file whose content is the cloud-init `user-data` (at most 64 KiB).
        #[arg(long)]
        user_data: Option<std::path::PathBuf>,
        /// A file whose content is the cloud-init `network-config` (at most 64 KiB).
        #[arg(long)]
        network_config: Option<std::path::PathBuf>,
        /// direct (the image's kernel), bios or uefi (the image's disk through the firmware).
        #[arg(long, value_enum)]
        boot: Option<BootArg>,
        /// Size of the disk overlay, GiB (at least the image disk's size).
        #[arg(long)]
        disk_gib: Option<u64>,
        /// Define the instance only: checked and recorded stopped, nothing claimed or started
        /// (`gpuvisor start` boots it).
        #[arg(long)]
        no_start: bool,
    },
    /// List instances.
    Ps,
    /// Show one instance (JSON).
    Show {
        /// Instance name or id.
        name: String,
    },
    /// Attach to an instance's serial console (raw terminal; `^]` detaches), or print its
    /// log with `--log`.
    Console {
        /// Instance name or id.
        name: String,
        /// Print the console log (the rotated part first) instead of attaching.
        #[arg(long)]
        log: bool,
        /// Detach the `gpuvisor console` session attached to it now, and take over.
        #[arg(long, conflicts_with = "log")]
        force: bool,
    },
    /// Start a stopped instance.
    Start {
        /// Instance name or id.
        name: String,
    },
    /// Stop an instance (guest power-off, then the kill path).
    Stop {
        /// Instance name or id.
        name: String,
        /// Skip the guest power-off.
        #[arg(long)]
        force: bool,
        /// Seconds to wait for the guest to power off before the kill path (1-3600; default:
        /// the agent's stop_timeout_s).
        #[arg(long, value_name = "SECONDS", conflicts_with = "force")]
        timeout: Option<u64>,
    },
    /// Change an instance: labels, restart and autostart at once; vCPUs, memory, NICs and
    /// cloud-init inputs at its next start (`gpuvisor reboot` applies them).
    Update {
        /// Instance name or id.
        name: String,
        /// vCPUs, 1..=64.
        #[arg(long)]
        vcpus: Option<u32>,
        /// Guest memory, MiB, 64..=1048576.
        #[arg(long)]
        memory_mib: Option<u64>,
        /// key=value (repeatable): the labels, all of them (the old set is replaced).
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Remove every label.
        #[arg(long, conflicts_with = "labels")]
        no_labels: bool,
        /// When the VMM dies without a stop: no, on-failure, always.
        #[arg(long, value_enum)]
        restart: Option<RestartArg>,
        /// Start it again when the agent starts after a host reboot: true or false.
        #[arg(long, value_name = "BOOL")]
        autostart: Option<bool>,
        /// A virtio-net NIC (repeatable, in guest order; as `create --nic`): the NICs, all of
        /// them (the old ones are replaced).
        #[arg(long = "nic", value_parser = crate::network::parse_nic_flag)]
        nics: Vec<crate::network::Nic>,
        /// Remove every NIC.
        #[arg(long, conflicts_with = "nics")]
        no_nics: bool,
        /// A file whose content is the cloud-init `user-data` (with --network-config: the
        /// cloud-init inputs, all of them).
        #[arg(long)]
        user_data: Option<std::path::PathBuf>,
        /// A file whose content is the cloud-init `network-config`.
        #[arg(long)]
        network_config: Option<std::path::PathBuf>,
        /// Remove the cloud-init inputs.
        #[arg(long, conflicts_with_all = ["user_data", "network_config"])]
        no_cloud_init: bool,
    },
    /// Stop a running instance (the guest powers off; its GPU device is released) and start
    /// it again: the definition as it is now applies.
    Reboot {
        /// Instance name or id.
        name: String,
        /// Skip the guest power-off.
        #[arg(long)]
        force: bool,
        /// Seconds to wait for the guest to power off before the kill path (1-3600; default:
        /// the agent's stop_timeout_s).
        #[arg(long, value_name = "SECONDS", conflicts_with = "force")]
        timeout: Option<u64>,
    },
    /// Reset a running VM in place, like its reset button: the guest starts over without
    /// shutting down; the VMM and its GPU device stay.
    Reset {
        /// Instance name or id.
        name: String,
    },
    /// What a running VM uses now: CPU time, memory, disk and NIC counters.
    Stats {
        /// Instance name or id.
        name: String,
    },
    /// Delete an instance.
    Rm {
        /// Instance name or id.
        name: String,
    },
    /// Fork an instance: a new stopped instance with the same definition and GPU profile.
    Fork {
        /// The instance to fork (name or id).
        name: String,
        /// The new instance's name.
        new_name: String,
        /// Copy the disk of this snapshot of it (the source may run) instead of its own.
        #[arg(long)]
        snapshot: Option<String>,
    },
    /// Save a running VM without a GPU and stop its VMM (`start` resumes it).
    Standby {
        /// Instance name or id.
        name: String,
    },
    /// Take a snapshot: memory, device state and disk of a running VM without a GPU (paused
    /// for the save), or the disk of a stopped VM.
    Snapshot {
        /// Instance name or id.
        name: String,
        /// The snapshot's name (default snap-<UTC time>).
        snapshot: Option<String>,
    },
    /// An instance's snapshots, or `--delete <snapshot>` to remove one.
    Snapshots {
        /// Instance name or id.
        name: String,
        /// Remove this snapshot.
        #[arg(long)]
        delete: Option<String>,
    },
    /// Go back to a snapshot (its disk, and its memory when taken running), then start; or,
    /// without one, resume a standby instance.
    Restore {
        /// Instance name or id.
        name: String,
        /// The snapshot to restore.
        snapshot: Option<String>,
    },
    /// GPUs and their devices (type, claim owner).
    Gpus {
        /// The `gpus` subcommand; none lists the GPUs.
        #[command(subcommand)]
        action: Option<GpusAction>,
    },
    /// Placeable count per vGPU profile.
    Profiles,
    /// resources.get (device counts and profiles).
    Resources,
    /// What the placement plugin would choose for a profile, or for `passthrough` /
    /// `passthrough=<BDF>` (claims nothing).
    DryRun {
        /// A vGPU profile (e.g. L40S-2Q), `passthrough` or `passthrough=<BDF>`.
        profile: String,
        /// key=value (repeatable): the labels the placement plugin sees.
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// Images.
    Image {
        /// The `image` subcommand.
        #[command(subcommand)]
        action: ImageAction,
    },
    /// Policy plugins.
    Plugin {
        /// The `plugin` subcommand.
        #[command(subcommand)]
        action: PluginAction,
    },
    /// Run one reconcile pass now and print its report.
    Reconcile,
    /// Follow the agent's events as they happen (like `incus monitor`): instance state
    /// changes, claims, releases, health marks, reconcile passes, policy failures; one line
    /// each, or one JSON object per line with `--output json`.
    Events {
        /// Only events of this type (repeatable).
        #[arg(long = "type", value_name = "TYPE", value_parser = clap::builder::PossibleValuesParser::new(crate::events::EventKind::TYPES))]
        types: Vec<String>,
        /// Exit after this many events (default: follow until the agent stops).
        #[arg(long)]
        count: Option<u64>,
    },
    /// agent.health.
    Health,
    /// agent.metrics (Prometheus text).
    Metrics,
    /// Call any JSON-RPC method with JSON params.
    Call {
        /// The method, e.g. instance.get (`gpuvisor call rpc.discover` lists them).
        method: String,
        /// Its params as a JSON object (default {}).
        params: Option<String>,
    },
    /// This host, read directly (no agent needed).
    Host {
        /// The `host` subcommand.
        #[command(subcommand)]
        action: HostAction,
    },
}

// The subcommands of `gpuvisor host`. No doc comment: clap would make it the `about` of the command above,
// replacing that command's own.
#[allow(missing_docs)]
#[derive(Debug, Subcommand)]
pub enum HostAction {
    /// Check what gpuvisor needs from this host (IOMMU, VFIO, NVIDIA driver and vGPU manager,
    /// VFs and types per GPU, passthrough GPUs, KVM, QEMU and Cloud Hypervisor, /proc, the
    /// VMM user, cgroup v2). Reads only; exits 1 when a check fails.
    Check(HostCheckArgs),
}

/// `gpuvisor host check` flags.
#[derive(Debug, Args)]
pub struct HostCheckArgs {
    /// TOML config file (the agent's; default: the built-in defaults, like `serve`).
    #[arg(long, env = "GPUVISOR_CONFIG")]
    pub config: Option<PathBuf>,
    /// Read this host root instead of the config's `host_root` (a simulator mount).
    #[arg(long)]
    pub host_root: Option<PathBuf>,
}

// The subcommands of `gpuvisor gpus`. No doc comment: clap would make it the `about` of the command above,
// replacing that command's own.
#[allow(missing_docs)]
#[derive(Debug, Subcommand)]
pub enum GpusAction {
    /// Clear health marks: of the devices named, or with --gpu of a whole GPU.
    Unquarantine {
        /// Devices (VF or mdev parent addresses).
        devices: Vec<String>,
        /// A GPU (PF address): its own mark and those of all its devices.
        #[arg(long)]
        gpu: Option<String>,
    },
}

// The subcommands of `gpuvisor image`. No doc comment: clap would make it the `about` of the command above,
// replacing that command's own.
#[allow(missing_docs)]
#[derive(Debug, Subcommand)]
pub enum ImageAction {
    /// Copy a kernel (and initrd) and/or a disk (qcow2, or raw with an MBR/GPT) into the
    /// agent's images directory.
    Import {
        /// The image's name: [a-z0-9][a-z0-9._-]{0,62}.
        name: String,
        /// A kernel for direct boot (copied).
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// A disk image: qcow2, or a raw disk with a partition table.
        #[arg(long)]
        disk: Option<PathBuf>,
        /// An initrd for the kernel (copied).
        #[arg(long)]
        initrd: Option<PathBuf>,
        /// The kernel command line (default: the agent's default_cmdline).
        #[arg(long)]
        cmdline: Option<String>,
    },
    /// List images.
    Ls,
    /// Delete an image.
    Rm {
        /// The image's name.
        name: String,
    },
}

// The subcommands of `gpuvisor plugin`. No doc comment: clap would make it the `about` of the command above,
// replacing that command's own.
#[allow(missing_docs)]
#[derive(Debug, Subcommand)]
pub enum PluginAction {
    /// Run a plugin locally (no agent needed) on a JSON input or a directory of recorded
    /// inputs: its log lines, fuel, time and answer. Exit 1 when a plugin or a call fails.
    Test {
        /// The plugin to run: a `.wasm` file (an ABI v1 core module or an ABI v2 component)
        /// or a `.wat` text module.
        plugin: PathBuf,
        /// An input file (a fixture, or a file `record_policy_inputs` wrote), or a directory
        /// of them (each `*.json` of the plugin's kind, sorted).
        #[arg(long)]
        input: PathBuf,
        /// placement | hypervisor | grace (default: the plugin's only kind).
        #[arg(long)]
        kind: Option<String>,
        /// Site params (TOML or JSON: the params table, or an agent config file's
        /// [plugins.<kind>.params]); they replace every input's params.
        #[arg(long)]
        params: Option<PathBuf>,
        /// An agent config file: the slot's fuel, memory_mib, deadline_ms (and its params
        /// unless --params is given). Default: the agent's default limits.
        #[arg(long)]
        config: Option<PathBuf>,
        /// A second plugin of the same kind: run both on each input and show where their
        /// answers differ.
        #[arg(long)]
        against: Option<PathBuf>,
        /// Exit 1 also when an answer differs (from --against's, else from the recorded one).
        #[arg(long)]
        fail_on_diff: bool,
    },
    /// The loaded plugins: slot, name, version, ABI (v1 module or v2 component), calls.
    #[command(visible_alias = "list")]
    Ls,
    /// Re-read the config's [plugins] and load them again (all or nothing).
    Reload {
        /// Before the swap, call each new plugin on the last input the agent sent to its slot
        /// (a slot not asked yet is not tried); a failed call refuses the reload.
        #[arg(long)]
        trial: bool,
        /// SLOT=FILE: the trial input of a slot instead of its last one (an input, or a file
        /// `record_policy_inputs` wrote); implies --trial. Repeatable.
        #[arg(long, value_name = "SLOT=FILE")]
        trial_input: Vec<String>,
    },
}

/// `gpuvisor serve` flags; each overrides the config file's key of the same name. Their
/// help lines are the keys' descriptions and defaults in [`config::KEYS`](crate::config::KEYS)
/// (filled in by [`describe_key_flag`]), so the fields carry no doc comments.
// The fields' docs are the keys' in `config::KEYS`: a doc comment here would be added to
// the flag's help line.
#[allow(missing_docs)]
#[derive(Debug, Args)]
#[command(mut_args(describe_key_flag))]
pub struct ServeArgs {
    /// TOML config file [default: none: every key has its default]
    #[arg(long, env = "GPUVISOR_CONFIG")]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[arg(long)]
    pub host_root: Option<PathBuf>,
    #[arg(long)]
    pub accel: Option<String>,
    #[arg(long, value_enum)]
    pub vfio_attach: Option<VfioAttach>,
    #[arg(long)]
    pub qemu_binary: Option<PathBuf>,
    #[arg(long)]
    pub cloud_hypervisor_binary: Option<PathBuf>,
    #[arg(long)]
    pub plugin_dir: Option<PathBuf>,
    #[arg(long)]
    pub vfio_term_grace_s: Option<u64>,
    #[arg(long)]
    pub stop_timeout_s: Option<u64>,
    #[arg(long)]
    pub release_retry_s: Option<u64>,
    #[arg(long, alias = "qmp-ready-timeout-s")]
    pub vmm_ready_timeout_s: Option<u64>,
    #[arg(long)]
    pub log_format: Option<String>,
    #[arg(long)]
    pub record_policy_inputs: Option<PathBuf>,
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// (comma-separated; replaces the file's list)
    #[arg(long, value_delimiter = ',')]
    pub passthrough_gpus: Option<Vec<String>>,
}

/// The help line of a `serve` flag named like a config key: the key's description and
/// default from [`config::KEYS`](crate::config::KEYS). A flag's own doc comment, if any,
/// follows it. Other arguments are left as they are.
fn describe_key_flag(a: clap::Arg) -> clap::Arg {
    match crate::config::key_doc(a.get_id().as_str()) {
        Some(k) => {
            let help = match a.get_help() {
                Some(own) => format!("{} {own} [default: {}]", k.help, k.shown_default()),
                None => k.flag_help(),
            };
            a.help(help)
        }
        None => a,
    }
}

/// `--restart` values.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RestartArg {
    /// The instance stays stopped.
    No,
    /// Started again when its VMM failed (a non-zero exit, a signal, an exit the agent did
    /// not see).
    OnFailure,
    /// Started again whenever its VMM exits, also after the guest powered off.
    Always,
}

impl RestartArg {
    fn policy(self) -> crate::store::RestartPolicy {
        match self {
            RestartArg::No => crate::store::RestartPolicy::No,
            RestartArg::OnFailure => crate::store::RestartPolicy::OnFailure,
            RestartArg::Always => crate::store::RestartPolicy::Always,
        }
    }
}

/// `--boot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BootArg {
    /// The VMM loads the image's kernel and initrd itself.
    Direct,
    /// The firmware (SeaBIOS) boots the disk overlay's boot loader.
    Bios,
    /// UEFI firmware (OVMF) boots the disk overlay.
    Uefi,
}

impl BootArg {
    fn mode(self) -> crate::store::BootMode {
        match self {
            BootArg::Direct => crate::store::BootMode::Direct,
            BootArg::Bios => crate::store::BootMode::Bios,
            BootArg::Uefi => crate::store::BootMode::Uefi,
        }
    }
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("label {s:?} is not key=value"))
}

impl ServeArgs {
    /// The effective configuration: file (if any), then flags (the socket comes from the
    /// global `--socket` when given explicitly).
    pub fn config(&self, socket: Option<PathBuf>) -> anyhow::Result<Config> {
        let mut c = match &self.config {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        if let Some(s) = socket {
            c.socket = s;
        }
        macro_rules! over {
            ($($f:ident),*) => { $( if let Some(v) = &self.$f { c.$f = v.clone(); } )* };
        }
        over!(data_dir, host_root, accel, qemu_binary, cloud_hypervisor_binary, plugin_dir, log_format);
        if let Some(v) = self.vfio_attach {
            c.vfio_attach = v;
        }
        if let Some(v) = self.vfio_term_grace_s {
            c.vfio_term_grace_s = v;
        }
        if let Some(v) = self.stop_timeout_s {
            c.stop_timeout_s = v;
        }
        if let Some(v) = self.release_retry_s {
            c.release_retry_s = v;
        }
        if let Some(v) = self.vmm_ready_timeout_s {
            c.vmm_ready_timeout_s = v;
        }
        if let Some(v) = self.metrics_listen {
            c.metrics_listen = Some(v);
        }
        if let Some(v) = &self.passthrough_gpus {
            c.passthrough_gpus = v.iter().map(|g| g.to_ascii_lowercase()).collect();
        }
        if let Some(v) = &self.record_policy_inputs {
            c.record_policy_inputs = Some(v.clone());
        }
        c.validate()?;
        Ok(c)
    }
}

/// The first label key given more than once (`--label a=1 --label a=2` is ambiguous).
fn duplicate_label(labels: &[(String, String)]) -> Option<&str> {
    labels
        .iter()
        .enumerate()
        .find(|(i, (k, _))| labels[..*i].iter().any(|(k2, _)| k2 == k))
        .map(|(_, (k, _))| k.as_str())
}

/// `gpuvisor manpages DIR`: `gpuvisor.1` and `gpuvisor-<subcommand>.1` (nested ones as
/// `gpuvisor-<a>-<b>.1`), generated from this CLI definition; hidden subcommands are left out.
/// The EXIT STATUS section of the man page `name` (`gpuvisor`, `gpuvisor-serve`, …), in roff.
fn exit_status_section(name: &str) -> String {
    let codes: &[(i32, &str)] = match name {
        "gpuvisor-serve" => &[
            (exit::OK, "stopped by SIGTERM or SIGINT (running VMs keep running)"),
            (exit::ERROR, "the agent cannot start: its data directory or one of its GPUs is held by another agent, a plugin is refused, the socket cannot be served"),
            (exit::USAGE, "an invalid configuration or flag value"),
        ],
        "gpuvisor-host" | "gpuvisor-host-check" => &[
            (exit::OK, "no check failed"),
            (exit::ERROR, "a check failed"),
            (exit::USAGE, "the configuration cannot be read, or bad usage"),
        ],
        _ => &[
            (exit::OK, "done"),
            (exit::ERROR, "the agent answered an error (printed as `error: <message> [<data.code>]`)"),
            (exit::USAGE, "bad command-line usage"),
            (exit::UNREACHABLE, "no agent answers on the socket"),
            (exit::RELEASE_PENDING, "done, but a GPU release is pending (`gpu.release_pending`, `vgpu_cleanup_pending`): the device stays blocked and the agent retries it"),
            (exit::DEVICE_QUARANTINED, "done, but the device the operation gave back was quarantined by that release (`released_device_quarantined`)"),
        ],
    };
    let mut s = String::from(".SH \"EXIT STATUS\"\n");
    for (code, what) in codes {
        s.push_str(&format!(".TP\n{code}\n{}\n", what.replace('\\', "\\\\").replace('-', "\\-")));
    }
    s
}

/// `gpuvisor manpages DIR`: `gpuvisor.1` and one page per subcommand, each with its EXIT
/// STATUS.
pub fn manpages(dir: &std::path::Path) -> i32 {
    fn write(cmd: &clap::Command, name: &str, dir: &std::path::Path) -> std::io::Result<()> {
        let cmd = cmd.clone().name(name.to_string());
        let mut out = Vec::new();
        clap_mangen::Man::new(cmd.clone()).render(&mut out)?;
        out.extend_from_slice(exit_status_section(name).as_bytes());
        std::fs::write(dir.join(format!("{name}.1")), out)?;
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
            write(sub, &format!("{name}-{}", sub.get_name()), dir)?;
        }
        Ok(())
    }
    let mut cli = Cli::definition();
    cli.build();
    match std::fs::create_dir_all(dir).and_then(|()| write(&cli, "gpuvisor", dir)) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("error: cannot write the man pages to {}: {e}", dir.display());
            exit::ERROR
        }
    }
}

/// Runs a client subcommand; returns the process exit code. Each command is one typed call
/// of the method table ([`crate::rpc::api`]) and how its answer is shown.
pub async fn run_client(cli: &Cli) -> i32 {
    if let Command::Create { labels, .. } | Command::DryRun { labels, .. } | Command::Update { labels, .. } =
        &cli.command
    {
        if let Some(k) = duplicate_label(labels) {
            eprintln!("error: label {k:?} is given more than once");
            return exit::USAGE;
        }
    }
    let by_ref = |name: &String| RefParams { reference: name.clone() };
    match &cli.command {
        Command::Serve(_) => {
            // `main` runs `serve` itself; reaching this is a wiring error, not user input.
            eprintln!("error: `serve` is not a client command");
            exit::USAGE
        }
        Command::Completions { shell } => {
            clap_complete::generate(*shell, &mut Cli::definition(), "gpuvisor", &mut std::io::stdout());
            exit::OK
        }
        Command::Manpages { dir } => manpages(dir),
        Command::Create {
            name,
            image,
            gpu,
            labels,
            vcpus,
            memory_mib,
            hypervisor,
            restart,
            autostart,
            nics,
            user_data,
            network_config,
            boot,
            disk_gib,
            no_start,
        } => {
            let cloud_init = match read_cloud_init(user_data, network_config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return exit::USAGE;
                }
            };
            let req = CreateRequest {
                name: name.clone(),
                image: image.clone(),
                gpu: gpu.as_deref().map(GpuRequest::from_flag),
                labels: labels.iter().cloned().collect(),
                vcpus: *vcpus,
                memory_mib: *memory_mib,
                hypervisor: hypervisor.clone(),
                restart: restart.map(RestartArg::policy),
                autostart: autostart.then_some(true),
                nics: nics.clone(),
                cloud_init,
                boot: boot.map(BootArg::mode),
                disk_gib: *disk_gib,
                start: no_start.then_some(false),
            };
            run::<method::InstanceCreate>(cli, &req, print_instance, instance_outcome).await
        }
        Command::Ps => run::<method::InstanceList>(cli, &NoParams {}, print_ps, done).await,
        Command::Show { name } => run::<method::InstanceGet>(cli, &by_ref(name), print_json, done).await,
        Command::Start { name } => {
            run::<method::InstanceStart>(cli, &by_ref(name), print_instance, instance_outcome).await
        }
        Command::Stop { name, force, timeout } => {
            announce(
                cli,
                format!("stopping {name} (guest power-off, then the kill path; then its GPU device is released)..."),
            );
            let p = StopParams { reference: name.clone(), force: *force, timeout_s: *timeout };
            run::<method::InstanceStop>(cli, &p, print_instance, instance_outcome).await
        }
        Command::Update {
            name,
            vcpus,
            memory_mib,
            labels,
            no_labels,
            restart,
            autostart,
            nics,
            no_nics,
            user_data,
            network_config,
            no_cloud_init,
        } => {
            let cloud_init = match read_cloud_init(user_data, network_config) {
                Ok(c) => c.or_else(|| no_cloud_init.then(crate::network::CloudInit::default)),
                Err(e) => {
                    eprintln!("error: {e}");
                    return exit::USAGE;
                }
            };
            let req = crate::instances::update::UpdateRequest {
                reference: name.clone(),
                vcpus: *vcpus,
                memory_mib: *memory_mib,
                labels: (!labels.is_empty() || *no_labels).then(|| labels.iter().cloned().collect()),
                restart: restart.map(RestartArg::policy),
                autostart: *autostart,
                nics: (!nics.is_empty() || *no_nics).then(|| nics.clone()),
                cloud_init,
            };
            run::<method::InstanceUpdate>(cli, &req, print_update, done).await
        }
        Command::Reboot { name, force, timeout } => {
            let p = StopParams { reference: name.clone(), force: *force, timeout_s: *timeout };
            run::<method::InstanceReboot>(cli, &p, print_instance, instance_outcome).await
        }
        Command::Reset { name } => {
            run::<method::InstanceReset>(cli, &by_ref(name), print_instance, instance_outcome).await
        }
        Command::Stats { name } => run::<method::InstanceStats>(cli, &by_ref(name), print_stats, done).await,
        Command::Rm { name } => {
            announce(cli, format!("deleting {name} (the kill path, then its GPU device is released)..."));
            let deleted = |d: &DeleteResult| {
                match &d.released_device_quarantined {
                Some(q) => println!(
                    "{name} deleted; GPU {} was given back QUARANTINED ({}: {}); clear it once repaired: gpuvisor gpus unquarantine {}",
                    q.device, q.reason, q.detail, q.device
                ),
                None => print_json(d),
            }
            };
            run::<method::InstanceDelete>(cli, &by_ref(name), deleted, delete_outcome).await
        }
        Command::Fork { name, new_name, snapshot } => {
            let p = ForkParams { reference: name.clone(), name: new_name.clone(), snapshot: snapshot.clone() };
            run::<method::InstanceFork>(cli, &p, print_json, done).await
        }
        Command::Standby { name } => {
            run::<method::InstanceStandby>(cli, &by_ref(name), print_instance, instance_outcome).await
        }
        Command::Snapshot { name, snapshot } => {
            let p = SaveStateParams { reference: name.clone(), snapshot: snapshot.clone() };
            let taken = |s: &crate::instances::saves::SavedState| {
                println!("snapshot {} taken ({:?}: {}, {} bytes)", s.name, s.kind, s.files.join(", "), s.bytes)
            };
            run::<method::InstanceSnapshot>(cli, &p, taken, done).await
        }
        Command::Snapshots { name, delete: None } => {
            run::<method::InstanceSnapshots>(cli, &by_ref(name), print_snapshots, done).await
        }
        Command::Snapshots { name, delete: Some(d) } => {
            let p = SaveStateParams { reference: name.clone(), snapshot: Some(d.clone()) };
            let deleted = |d: &crate::instances::saves::SnapshotDeleted| {
                println!("snapshot {} of {} deleted", d.snapshot, d.name)
            };
            run::<method::InstanceSnapshotDelete>(cli, &p, deleted, done).await
        }
        Command::Restore { name, snapshot } => {
            let p = SaveStateParams { reference: name.clone(), snapshot: snapshot.clone() };
            run::<method::InstanceRestore>(cli, &p, print_instance, instance_outcome).await
        }
        Command::Gpus { action: None } => run::<method::GpuList>(cli, &NoParams {}, print_gpus, done).await,
        Command::Gpus { action: Some(GpusAction::Unquarantine { devices, gpu }) } => {
            if devices.is_empty() && gpu.is_none() {
                eprintln!("error: name the devices to unquarantine, or --gpu <PF>");
                return exit::USAGE;
            }
            let p = UnquarantineParams { device: None, devices: devices.clone(), gpu: gpu.clone() };
            run::<method::GpuUnquarantine>(cli, &p, print_json, done).await
        }
        Command::Profiles | Command::Resources => {
            run::<method::ResourcesGet>(cli, &NoParams {}, print_resources, done).await
        }
        Command::DryRun { profile, labels } => {
            let labels = labels.iter().cloned().collect();
            let p = match GpuRequest::from_flag(profile) {
                GpuRequest::Spec(s) => {
                    DryRunParams { profile: None, passthrough: true, address: s.address, name: None, labels }
                }
                GpuRequest::Profile(p) => {
                    DryRunParams { profile: Some(p), passthrough: false, address: None, name: None, labels }
                }
            };
            run::<method::PlacementDryRun>(cli, &p, print_json, done).await
        }
        Command::Image { action: ImageAction::Import { name, kernel, disk, initrd, cmdline } } => {
            let abs = |p: &PathBuf| {
                std::fs::canonicalize(p).or_else(|_| std::path::absolute(p)).unwrap_or_else(|_| p.clone())
            };
            let p = ImportParams {
                name: name.clone(),
                kernel: kernel.as_ref().map(abs),
                initrd: initrd.as_ref().map(abs),
                cmdline: cmdline.clone(),
                disk: disk.as_ref().map(abs),
            };
            run::<method::ImageImport>(cli, &p, print_json, done).await
        }
        Command::Image { action: ImageAction::Ls } => {
            run::<method::ImageList>(cli, &NoParams {}, print_images, done).await
        }
        Command::Image { action: ImageAction::Rm { name } } => {
            run::<method::ImageDelete>(cli, &NameParams { name: name.clone() }, print_json, done).await
        }
        Command::Plugin { action: PluginAction::Ls } => {
            run::<method::PluginList>(cli, &NoParams {}, print_plugins, done).await
        }
        Command::Plugin { action: PluginAction::Reload { trial, trial_input } } => {
            let mut inputs = std::collections::BTreeMap::new();
            for item in trial_input {
                let read = item.split_once('=').ok_or_else(|| format!("{item:?} is not SLOT=FILE")).and_then(
                    |(slot, file)| {
                        let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
                        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{file}: not JSON: {e}"))?;
                        Ok((slot.to_string(), v))
                    },
                );
                match read {
                    Ok((slot, v)) => {
                        inputs.insert(slot, v);
                    }
                    Err(e) => {
                        eprintln!("error: --trial-input {e}");
                        return exit::USAGE;
                    }
                }
            }
            let p = crate::policies::ReloadParams { trial: *trial || !inputs.is_empty(), inputs };
            run::<method::PluginReload>(cli, &p, print_json, done).await
        }
        Command::Plugin {
            action: PluginAction::Test { plugin, input, kind, params, config, against, fail_on_diff },
        } => {
            let args = plugin_test::TestArgs {
                plugin,
                input,
                kind: kind.as_deref(),
                params: params.as_deref(),
                config: config.as_deref(),
                against: against.as_deref(),
                fail_on_diff: *fail_on_diff,
            };
            plugin_test::run(cli.output, &args)
        }
        Command::Console { name, log, force } => console(cli, name, *log, *force).await,
        Command::Host { action: HostAction::Check(args) } => host_check(cli, args),
        Command::Events { types, count } => events(cli, types, *count).await,
        Command::Reconcile => run::<method::ReconcileRun>(cli, &NoParams {}, print_json, done).await,
        Command::Health => run::<method::AgentHealth>(cli, &NoParams {}, print_json, done).await,
        Command::Metrics => {
            run::<method::AgentMetrics>(cli, &NoParams {}, |t: &MetricsText| print!("{}", t.0), done).await
        }
        Command::Call { method, params } => {
            let p = match params.as_deref().map(serde_json::from_str::<Value>) {
                None => json!({}),
                Some(Ok(v)) => v,
                Some(Err(e)) => {
                    eprintln!("error: params are not JSON: {e}");
                    return exit::USAGE;
                }
            };
            match client::call(&cli.socket, method, p).await {
                Ok(v) => {
                    println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
                    exit::OK
                }
                Err(e) => failed(cli, e),
            }
        }
    }
}

/// Says on a terminal what a long command is doing (table output only).
fn announce(cli: &Cli, what: String) {
    if cli.output == Output::Table && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("{what}");
    }
}

/// Calls the method `M` with `params` and shows the answer: as the agent sent it with
/// `--output json`, through `table` otherwise (an answer that does not decode as `M`'s
/// result, from an agent of another version, is printed as JSON with a warning). The exit
/// code is `outcome` of the answer in both.
async fn run<M: ApiMethod>(
    cli: &Cli,
    params: &M::Params,
    table: impl FnOnce(&M::Result),
    outcome: fn(&M::Result) -> i32,
) -> i32
where
    M::Result: DeserializeOwned,
{
    let answer = match client::request::<M>(&cli.socket, params).await {
        Ok(a) => a,
        Err(e) => return failed(cli, e),
    };
    match (cli.output, answer.typed) {
        (Output::Json, typed) => {
            println!("{}", serde_json::to_string_pretty(&answer.raw).unwrap_or_default());
            typed.map_or(exit::OK, |r| outcome(&r))
        }
        (Output::Table, Ok(r)) => {
            table(&r);
            outcome(&r)
        }
        (Output::Table, Err(e)) => {
            eprintln!("warning: the answer does not decode as expected ({e}); printing it as JSON");
            println!("{}", serde_json::to_string_pretty(&answer.raw).unwrap_or_default());
            exit::OK
        }
    }
}

/// A failed call: says why (as JSON with `--output json`); its exit code.
fn failed(cli: &Cli, e: ClientError) -> i32 {
    match e {
        e @ ClientError::Unreachable { .. } => {
            eprintln!("error: {e}");
            exit::UNREACHABLE
        }
        ClientError::Rpc { code, message, data } => {
            if cli.output == Output::Json {
                let err = json!({ "error": { "code": code, "message": message, "data": data } });
                println!("{}", serde_json::to_string_pretty(&err).unwrap_or_default());
            } else {
                match (data.get("code").and_then(|c| c.as_str()), data.as_str()) {
                    (Some(code), _) => eprintln!("error: {message} [{code}]"),
                    // A protocol error (-32602 invalid params) says what was wrong in `data`.
                    (None, Some(detail)) => eprintln!("error: {message}: {detail}"),
                    (None, None) => eprintln!("error: {message} [error]"),
                }
            }
            if data.get("code").and_then(|c| c.as_str()) == Some("vgpu_cleanup_pending") {
                exit::RELEASE_PENDING
            } else {
                exit::ERROR
            }
        }
        e => {
            eprintln!("error: {e}");
            exit::ERROR
        }
    }
}

/// The exit code of an answer that is only done.
fn done<T>(_: &T) -> i32 {
    exit::OK
}

/// The exit code of an operation answering an instance: its device given back quarantined,
/// its GPU release pending, or done.
fn instance_outcome(i: &InstanceView) -> i32 {
    if i.released_device_quarantined.is_some() {
        exit::DEVICE_QUARANTINED
    } else if i.gpu.as_ref().is_some_and(|g| g.release_pending) {
        exit::RELEASE_PENDING
    } else {
        exit::OK
    }
}

/// The exit code of a delete: its device given back quarantined, or done.
fn delete_outcome(d: &DeleteResult) -> i32 {
    if d.released_device_quarantined.is_some() {
        exit::DEVICE_QUARANTINED
    } else {
        exit::OK
    }
}

/// `gpuvisor host check`: reads the host directly (the config's `host_root`, or
/// `--host-root`); a table or, with `-o json`, the [`HostReport`](crate::doctor::HostReport).
/// Exit code 0 when no check fails, 1 otherwise, 2 for a config that cannot be read.
fn host_check(cli: &Cli, args: &HostCheckArgs) -> i32 {
    let mut cfg = match &args.config {
        Some(p) => match Config::load(p) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e:#}");
                return exit::USAGE;
            }
        },
        None => Config::default(),
    };
    if let Some(r) = &args.host_root {
        cfg.host_root = r.clone();
    }
    let report = crate::doctor::check_host(&cfg);
    if cli.output == Output::Json {
        println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    } else {
        println!("host root: {}", report.host_root);
        let rows = report
            .checks
            .iter()
            .map(|c| vec![c.verdict.as_str().to_string(), c.check.clone(), c.detail.clone()])
            .collect();
        table(&["VERDICT", "CHECK", "DETAIL"], rows);
    }
    if report.failed {
        exit::ERROR
    } else {
        exit::OK
    }
}

/// `gpuvisor events`: follows the stream until `count` events were printed, or the agent
/// closes it (exit 3: no agent any more).
async fn events(cli: &Cli, types: &[String], count: Option<u64>) -> i32 {
    use std::io::Write;
    let mut printed = 0u64;
    let res = client::follow_events(&cli.socket, types, |ev| {
        let line = match cli.output {
            Output::Json => serde_json::to_string(&ev).unwrap_or_default(),
            Output::Table => event_line(&ev),
        };
        let mut out = std::io::stdout().lock();
        // A closed stdout (`| head`) ends the follow.
        if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
            return false;
        }
        printed += 1;
        count.is_none_or(|n| printed < n)
    })
    .await;
    match res {
        Ok(()) if count.is_some_and(|n| printed >= n) => exit::OK,
        Ok(()) => {
            eprintln!("error: the agent closed the event stream");
            exit::UNREACHABLE
        }
        Err(e @ ClientError::Unreachable { .. }) => {
            eprintln!("error: {e}");
            exit::UNREACHABLE
        }
        Err(e) => {
            eprintln!("error: {e}");
            exit::ERROR
        }
    }
}

/// One event as a line for people: time, sequence number, type, what happened.
pub fn event_line(ev: &crate::events::Event) -> String {
    use crate::events::EventKind as K;
    let who = |name: &Option<String>, id: &Option<String>| match (name, id) {
        (Some(n), _) => n.clone(),
        (None, Some(id)) => id.clone(),
        (None, None) => "-".to_string(),
    };
    let what = match &ev.kind {
        K::InstanceState { instance_id, name, from, to, reason } => {
            let from = from.map(|f| f.as_str()).unwrap_or("new");
            let why = reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default();
            format!("{name} ({instance_id}) {from} -> {}{why}", to.as_str())
        }
        K::InstanceDeleted { instance_id, name } => format!("{} ({instance_id}) deleted", who(name, &None)),
        K::Claimed { device, framework, profile, instance_id, owner, name, .. } => {
            let id = instance_id.clone().or_else(|| Some(owner.to_string()));
            format!("{device} claimed by {} ({framework} {profile})", who(name, &id))
        }
        K::Released { device, what, instance_id, owner, name } => {
            let instance_id = &instance_id.clone().or_else(|| owner.as_ref().map(|o| o.to_string()));
            let by = if instance_id.is_some() || name.is_some() {
                format!(" from {}", who(name, instance_id))
            } else {
                String::new()
            };
            format!("{device} released ({what}){by}")
        }
        K::ReleaseFailed { device, what, instance_id, owner, name, code, error } => {
            let instance_id = &instance_id.clone().or_else(|| owner.as_ref().map(|o| o.to_string()));
            let of = if instance_id.is_some() || name.is_some() {
                format!(" of {}", who(name, instance_id))
            } else {
                String::new()
            };
            format!("{device} not released ({what}){of}: {error} [{code}]")
        }
        K::HealthMark { device, reason, quarantined, detail } => {
            let mark = if *quarantined { "quarantined" } else { "suspect" };
            format!("{device} {mark} ({reason}): {detail}")
        }
        K::HealthCleared { device } => format!("{device} health marks cleared"),
        K::ReconcilePass { complete, duration_ms, released, kept, failed, records, errors } => format!(
            "{} in {duration_ms} ms: {released} released, {kept} kept, {failed} failed, {records} records changed, {errors} errors",
            if *complete { "complete" } else { "incomplete" }
        ),
        K::PolicyFailure { plugin, kind, reason, message } => format!("{kind} plugin {plugin}: {reason}: {message}"),
        K::Lagged { missed } => format!("this client fell behind: {missed} events missed"),
    };
    format!("{} #{:<5} {:<16} {what}", ev.time, ev.seq, ev.kind.type_name())
}

/// `gpuvisor console NAME [--log]`: the paths come from `instance.get`; the console socket
/// and the logs are read directly (the CLI runs on the agent's host, as root).
async fn console(cli: &Cli, name: &str, log: bool, force: bool) -> i32 {
    let i = match client::request::<method::InstanceGet>(&cli.socket, &RefParams { reference: name.to_string() }).await
    {
        Ok(client::Answer { typed: Ok(i), .. }) => i,
        Ok(client::Answer { typed: Err(e), .. }) => {
            eprintln!("error: the agent's answer to instance.get does not decode: {e}");
            return exit::ERROR;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return if matches!(e, ClientError::Unreachable { .. }) { exit::UNREACHABLE } else { exit::ERROR };
        }
    };
    if log {
        // Only the agent's own files: a link, a FIFO or a file a VMM made at either name is
        // refused, never followed or waited on (crate::own_file).
        let mut out = std::io::stdout();
        for p in [PathBuf::from(&i.serial_log_rotated), PathBuf::from(&i.serial_log)] {
            let (Some(dir), Some(file)) = (p.parent(), p.file_name().and_then(|f| f.to_str())) else { continue };
            match crate::own_file::read(dir, file) {
                Ok(Some(b)) => {
                    let _ = std::io::Write::write_all(&mut out, &b);
                }
                Ok(None) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    eprintln!("error: cannot read the console log of {name}: {e}");
                    return exit::ERROR;
                }
            }
        }
        return exit::OK;
    }
    let Some(sock) = i.console_socket.as_deref() else {
        eprintln!("error: {name} runs under {}: it has no interactive console; use --log", i.hypervisor);
        return exit::ERROR;
    };
    if i.state != crate::store::InstanceState::Running {
        eprintln!("error: {name} is {}, not running", i.state.as_str());
        return exit::ERROR;
    }
    let sock = PathBuf::from(sock);
    let session = match console_session(name, &i.id, &sock, force).await {
        Ok(s) => s,
        Err(msg) => {
            eprintln!("error: {msg}");
            return exit::ERROR;
        }
    };
    // A `--force` of another client detaches this one: it restores the terminal and says so.
    crate::console::serve_takeovers(
        session,
        format!("Detached: another `gpuvisor console --force` took over the console of {name}."),
    );
    eprint!("Connected to the console of {name} (escape character is ^])\r\n");
    match tokio::task::spawn_blocking(move || crate::console::attach(&sock)).await {
        Ok(Ok(d)) => {
            eprint!("\r\n{}\r\n", if d == crate::console::Detach::Closed { "Console closed." } else { "Detached." });
            exit::OK
        }
        Ok(Err(e)) => {
            eprintln!("error: cannot attach to the console of {name}: {e}");
            exit::ERROR
        }
        Err(e) => {
            eprintln!("error: {e}");
            exit::ERROR
        }
    }
}

/// Takes the console session of instance `id` (one per console, as `virsh console`): a
/// second `gpuvisor console` is refused naming the first's pid, or — `force` — the first
/// is asked to detach and this one takes over. Refused too while a client that is not a
/// `gpuvisor console` is connected to `sock` (QEMU serves one client; another would sit in
/// its backlog, a dead session). Holds the session as long as the returned listener lives.
async fn console_session(
    name: &str,
    id: &str,
    sock: &std::path::Path,
    force: bool,
) -> Result<std::os::unix::net::UnixListener, String> {
    use crate::console::SessionError;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut asked = false;
    let session = loop {
        match crate::console::take_session(id) {
            Ok(l) => break l,
            Err(SessionError::Held { pid }) => {
                let who = pid.map(|p| format!("pid {p}")).unwrap_or_else(|| "another process".into());
                if !force {
                    return Err(format!(
                        "another `gpuvisor console` session ({who}) is attached to the console of {name}: detach it \
                         (^]) or take over with `gpuvisor console --force {name}`"
                    ));
                }
                if !asked {
                    asked = crate::console::ask_to_detach(id).is_ok();
                }
                if std::time::Instant::now() > deadline {
                    return Err(format!("the console session of {name} ({who}) did not let go within 10 s"));
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(SessionError::Io(e)) => return Err(format!("cannot take the console session of {name}: {e}")),
        }
    };
    // What a detached session held goes away with it (QEMU closes it a moment later);
    // anything else is another client.
    let settle = if force { deadline } else { std::time::Instant::now() + std::time::Duration::from_secs(1) };
    loop {
        match crate::host::proc::unix_connections_at(sock) {
            Ok(0) => return Ok(session),
            Ok(_) if std::time::Instant::now() < settle => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Ok(n) => {
                return Err(format!(
                    "another client ({n} connection(s), not a `gpuvisor console`) is connected to the console of \
                     {name}: the VMM serves one client; disconnect it first"
                ))
            }
            Err(e) => return Err(format!("cannot tell whether the console of {name} is free: {e}")),
        }
    }
}

/// The cloud-init inputs of `--user-data` and `--network-config` (files), `None` when neither
/// is given. Errors: a file that cannot be read.
fn read_cloud_init(
    user_data: &Option<std::path::PathBuf>,
    network_config: &Option<std::path::PathBuf>,
) -> Result<Option<crate::network::CloudInit>, String> {
    let read = |p: &Option<std::path::PathBuf>| -> Result<Option<String>, String> {
        p.as_ref()
            .map(|p| std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display())))
            .transpose()
    };
    let (user_data, network_config) = (read(user_data)?, read(network_config)?);
    Ok((user_data.is_some() || network_config.is_some())
        .then_some(crate::network::CloudInit { user_data, network_config }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KEYS;

    /// The CLI calls methods through the table's types (`method::X`), so it never spells a
    /// method's name: a renamed or removed method fails to compile here instead of failing
    /// at run time.
    #[test]
    fn the_cli_spells_no_method_name() {
        let src = [include_str!("cli.rs"), include_str!("cli/plugin_test.rs"), include_str!("rpc/client.rs")];
        for m in crate::rpc::api::methods() {
            for s in src {
                assert!(!s.contains(&format!("\"{}\"", m.name)), "{} is spelled as a string in the CLI", m.name);
            }
        }
    }

    /// The built `serve` subcommand (globals propagated, as `--help` shows it).
    fn serve_command() -> clap::Command {
        let mut cmd = Cli::definition();
        cmd.build();
        cmd.find_subcommand("serve").expect("serve exists").clone()
    }

    #[test]
    fn serve_help_shows_a_description_with_the_default_for_every_flag() {
        let help = serve_command().render_long_help().to_string();
        // One block per option: its `-x, --name <V>` line, then its description.
        let options = help.split("Options:").nth(1).unwrap_or_else(|| panic!("no options in {help}"));
        let mut blocks: Vec<String> = Vec::new();
        for line in options.lines() {
            if line.trim_start().starts_with('-') && line.starts_with("  ") && !line.starts_with("          ") {
                blocks.push(String::new());
            }
            if let Some(b) = blocks.last_mut() {
                b.push_str(line);
                b.push('\n');
            }
        }
        let flags: Vec<&str> =
            blocks.iter().filter_map(|b| b.split_whitespace().find(|w| w.starts_with("--"))).collect();
        for k in KEYS.iter().filter(|k| k.serve_flag) {
            assert!(flags.contains(&k.flag().as_str()), "{} is not in serve --help:\n{help}", k.flag());
        }
        for b in blocks.iter().filter(|b| !b.contains("--help")) {
            let description = b.lines().nth(1).map(str::trim).unwrap_or_default();
            assert!(!description.is_empty(), "no description:\n{b}");
            assert!(b.contains("[default: "), "no default:\n{b}");
        }
        // The default is the key's, with its unit.
        assert!(help.contains("How long a graceful stop waits for the guest to power off [default: 30 s]"), "{help}");
    }

    #[test]
    fn the_serve_man_page_has_every_flag_s_description_and_default() {
        let mut page = Vec::new();
        clap_mangen::Man::new(serve_command().name("gpuvisor-serve")).render(&mut page).unwrap();
        let page = String::from_utf8(page).unwrap();
        // roff escapes `-` and `'`.
        let serve = serve_command();
        for k in KEYS.iter().filter(|k| k.serve_flag && k.key != "socket") {
            let help = serve.get_arguments().find(|a| a.get_id() == k.key).and_then(|a| a.get_help()).unwrap();
            let help = help.to_string();
            assert!(help.starts_with(k.help) && help.ends_with(&format!("[default: {}]", k.shown_default())), "{help}");
            let line = help.replace('-', "\\-").replace('\'', "\\*(Aq");
            assert!(page.contains(&line), "{}: no {line:?} in\n{page}", k.key);
        }
        assert!(!page.contains("\\-\\-output"), "{page}");
    }

    #[test]
    fn the_serve_flags_are_the_keys_marked_serve_flag() {
        let mut flags: Vec<String> = serve_command()
            .get_arguments()
            .filter(|a| !a.is_hide_set())
            .map(|a| a.get_id().to_string())
            .filter(|id| id != "help" && id != "config")
            .collect();
        flags.sort();
        let mut keys: Vec<String> = KEYS.iter().filter(|k| k.serve_flag).map(|k| k.key.to_string()).collect();
        keys.sort();
        assert_eq!(flags, keys);
    }

    #[test]
    fn output_is_refused_where_it_does_nothing() {
        for args in [
            &["gpuvisor", "serve", "-o", "json"][..],
            &["gpuvisor", "-o", "json", "serve"],
            &["gpuvisor", "serve", "--output=table"],
            &["gpuvisor", "completions", "bash", "-o", "json"],
            &["gpuvisor", "console", "vm", "--output", "json"],
        ] {
            let e = Cli::try_parse_args_from(args).expect_err(&format!("{args:?} must be refused"));
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{args:?}: {e}");
            assert!(e.to_string().contains("-o/--output does not apply to `gpuvisor "), "{args:?}: {e}");
        }
        let serve = serve_command().render_long_help().to_string();
        assert!(!serve.contains("--output"), "{serve}");
    }

    #[test]
    fn plugin_test_has_no_socket_and_describes_its_plugin() {
        let mut cmd = Cli::definition();
        cmd.build();
        let test = cmd.find_subcommand("plugin").and_then(|p| p.find_subcommand("test")).unwrap().clone();
        let help = test.clone().render_long_help().to_string();
        assert!(!help.contains("--socket"), "{help}");
        assert!(help.contains("<PLUGIN>") && help.contains("ABI v1 core module or an ABI v2 component"), "{help}");
        let e = Cli::try_parse_args_from(["gpuvisor", "plugin", "test", "p.wasm", "--input", "i", "--socket", "/s"])
            .expect_err("refused");
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
        assert!(e.to_string().contains("--socket does not apply to `gpuvisor plugin test`"), "{e}");
        // Before the subcommand it is the program's option (e.g. an alias), as for any command.
        Cli::try_parse_args_from(["gpuvisor", "--socket", "/s", "plugin", "test", "p.wasm", "--input", "i"]).unwrap();
        Cli::try_parse_args_from(["gpuvisor", "plugin", "ls", "--socket", "/s"]).unwrap();
    }

    #[test]
    fn output_is_taken_before_or_after_a_client_command() {
        for args in [
            &["gpuvisor", "-o", "json", "ps"][..],
            &["gpuvisor", "ps", "-o", "json"],
            &["gpuvisor", "--output", "json", "stop", "a", "--force"],
            &["gpuvisor", "host", "check", "-o", "json"],
            &["gpuvisor", "plugin", "ls", "--output", "json"],
            &["gpuvisor", "plugin", "test", "p.wasm", "--input", "i.json", "-o", "json"],
        ] {
            let cli = Cli::try_parse_args_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(cli.output, Output::Json, "{args:?}");
        }
        let cli = Cli::try_parse_args_from(["gpuvisor", "serve", "--data-dir", "/d"]).unwrap();
        assert_eq!(cli.output, Output::Table);
    }
}
