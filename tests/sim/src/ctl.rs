//! The control channel (§10.5): command syntax and the client side.
//!
//! A request is one JSON object `{"argv": ["fail-write", "PATH", "EBUSY", "--times", "2"]}`
//! written to `DIR/.sim/ctl`; the answer is read back from the same fd. It is
//! `{"ok": true, ...}` or `{"ok": false, "error": "..."}`. The `state` command answers
//! `{"ok": true, "state": {<dump>}}`.

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use serde::{Deserialize, Serialize};

/// One control request as sent over `.sim/ctl`.
#[derive(Debug, Serialize, Deserialize)]
pub struct CtlRequest {
    /// The command and its arguments, exactly as given to `gpuvisor-sim ctl DIR ...`.
    pub argv: Vec<String>,
}

/// Parser wrapper so the server can parse `argv` with clap; its help (from [`CtlCmd`]'s doc
/// comments, the one table of commands) is what `gpuvisor-sim ctl DIR help` prints.
#[derive(Debug, Parser)]
#[command(
    name = "ctl",
    no_binary_name = true,
    disable_help_flag = true,
    disable_help_subcommand = true,
    about = "Control commands of a running gpuvisor-sim mount (docs/design/host.md §10.5).",
    override_usage = "gpuvisor-sim ctl DIR <COMMAND> [ARGS]...",
    after_help = "`gpuvisor-sim ctl DIR help COMMAND` shows one command's arguments."
)]
pub struct CtlLine {
    /// The command.
    #[command(subcommand)]
    pub cmd: CtlCmd,
}

/// A fault's target and errno.
#[derive(Debug, Args, Clone)]
pub struct FaultArgs {
    /// Path relative to DIR; `*`, `?` and `[...]` globs are allowed. Any name of the file
    /// matches (`sys/bus/pci/devices/<BDF>/...`, `sys/devices/...`, `sys/class/mdev_bus/...`).
    pub path: String,
    /// Errno name (`EBUSY`, `EIO`, ...) or number.
    pub errno: String,
    /// Fail the next N matching operations (default 1).
    #[arg(long, conflicts_with = "always")]
    pub times: Option<u32>,
    /// Fail every matching operation until `clear-faults`.
    #[arg(long)]
    pub always: bool,
}

/// Control commands (§10.5). DEV is a VF/PF BDF, a passthrough GPU's BDF or an mdev UUID.
#[derive(Debug, Subcommand, Clone)]
pub enum CtlCmd {
    /// Answer with the state dump (§10.6) under `state`.
    State,
    /// The next N writes to PATH fail with ERRNO before any rule runs.
    FailWrite(FaultArgs),
    /// The next N reads (also readdir and readlink) of PATH fail with ERRNO.
    FailRead(FaultArgs),
    /// The next N opens of PATH fail with ERRNO.
    FailOpen(FaultArgs),
    /// Matching writes block for MS milliseconds, then proceed (every write unless --times).
    /// The log shows `write-delayed` when such a write begins, `write` when it completes.
    DelayWrite {
        /// Path or glob.
        path: String,
        /// Delay in milliseconds.
        ms: u64,
        /// Only the next N writes.
        #[arg(long)]
        times: Option<u32>,
    },
    /// Remove every pending fault and delay.
    ClearFaults,
    /// Wedge a VF (a flag only) or a passthrough GPU (`reset` EIO, `power_state` D3cold,
    /// `config` all-ones).
    Wedge {
        /// VF or passthrough GPU BDF.
        dev: String,
    },
    /// Undo `wedge`.
    Unwedge {
        /// VF or passthrough GPU BDF.
        dev: String,
    },
    /// Set the teardown lag of one device (VF BDF, passthrough GPU BDF or mdev UUID).
    ReleaseDelay {
        /// VF BDF, passthrough GPU BDF or mdev UUID.
        dev: String,
        /// Lag in milliseconds.
        ms: u64,
    },
    /// A foreign tool sets a VF's type (no catalog check; `0` clears). Logged as `set-type`.
    SetType {
        /// VF BDF.
        vf: String,
        /// Type id (decimal), 0 to clear.
        id: u32,
    },
    /// A foreign tool creates an mdev (no availability check).
    CreateMdev {
        /// Parent VF BDF.
        parent: String,
        /// Type id or `nvidia-<id>`.
        #[arg(name = "TYPE")]
        type_: String,
        /// Hyphenated UUID.
        uuid: String,
    },
    /// The function's driver will not come back: `drivers_probe` (and `bind`) of its boot
    /// driver leave it unbound.
    StuckDriver {
        /// Passthrough function or group member BDF.
        bdf: String,
    },
    /// Undo `stuck-driver`.
    UnstuckDriver {
        /// Passthrough function or group member BDF.
        bdf: String,
    },
    /// A foreign tool binds a passthrough function to DRIVER (replacing any binding, no
    /// rule checks). Logged as `bind-host`.
    BindHost {
        /// Passthrough function or group member BDF.
        bdf: String,
        /// Driver name, e.g. `vfio-pci` or `nvidia`.
        driver: String,
    },
    /// A foreign tool unbinds a passthrough function (no rule checks). Logged as `unbind-host`.
    UnbindHost {
        /// Passthrough function or group member BDF.
        bdf: String,
    },
    /// Like `sriov-manage -e PF`: VFs appear after the delay (default: the model's).
    EnableVfs {
        /// PF BDF.
        pf: String,
        /// Appearance delay in milliseconds.
        #[arg(long)]
        delay: Option<u64>,
    },
    /// Like `sriov-manage -d PF`: EBUSY while any VF has an open handle.
    DisableVfs {
        /// PF BDF.
        pf: String,
    },
    /// New driver version; every type id shifts by K; all VFs are recreated.
    ReloadDriver {
        /// New version string.
        version: String,
        /// Added to every type id.
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        id_shift: i64,
    },
    /// Make PATH read CONTENT, or vanish with --absent, until `unoverride`.
    Override {
        /// Path or glob.
        path: String,
        /// Content to read.
        #[arg(allow_hyphen_values = true, required_unless_present = "absent")]
        content: Option<String>,
        /// Make the path vanish.
        #[arg(long, conflicts_with = "content")]
        absent: bool,
    },
    /// Undo `override` for exactly this PATH (as given).
    Unoverride {
        /// Path or glob, as given to `override`.
        path: String,
    },
    /// Back to the boot state with a new boot id; VFs appear after --vf-delay.
    Reboot {
        /// VF appearance delay in milliseconds (default: the model's).
        #[arg(long)]
        vf_delay: Option<u64>,
    },
}

/// The help text when `argv` asks for it (`help`, `help COMMAND`, `--help`, `-h`), from the
/// clap definition of [`CtlCmd`]; `None` for any other command. `Err` names an unknown
/// COMMAND.
pub fn help(argv: &[String]) -> Option<Result<String, String>> {
    use clap::CommandFactory;
    let first = argv.first()?.as_str();
    if !matches!(first, "help" | "--help" | "-h") {
        return None;
    }
    let mut cmd = CtlLine::command();
    Some(match argv.get(1) {
        None => Ok(cmd.render_help().to_string()),
        Some(topic) => match cmd.find_subcommand_mut(topic) {
            Some(sub) => {
                let mut sub = sub.clone().override_usage(format!("gpuvisor-sim ctl DIR {topic} [ARGS]"));
                Ok(sub.render_help().to_string())
            }
            None => Err(format!("unknown command {topic:?}; `gpuvisor-sim ctl DIR help` lists them")),
        },
    })
}

/// Sends one request to the simulator mounted at `dir` and returns its answer,
/// whatever `ok` says. Errors are I/O or JSON errors only.
pub fn request(dir: &Path, argv: &[String]) -> anyhow::Result<serde_json::Value> {
    let path = dir.join(".sim/ctl");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let req = serde_json::to_vec(&CtlRequest { argv: argv.to_vec() })?;
    f.write_all(&req).with_context(|| format!("writing {}", path.display()))?;
    let mut out = Vec::new();
    f.read_to_end(&mut out).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&out)
        .with_context(|| format!("bad answer from {}: {:?}", path.display(), String::from_utf8_lossy(&out)))
}

/// Like [`request`] but fails on `{"ok": false}`.
pub fn request_ok(dir: &Path, argv: &[String]) -> anyhow::Result<serde_json::Value> {
    let v = request(dir, argv)?;
    if v.get("ok").and_then(|o| o.as_bool()) != Some(true) {
        bail!("gpuvisor-sim ctl {}: {}", argv.join(" "), v.get("error").and_then(|e| e.as_str()).unwrap_or("failed"));
    }
    Ok(v)
}

/// Errno names the control channel accepts.
const ERRNOS: &[(&str, i32)] = &[
    ("EPERM", libc::EPERM),
    ("ENOENT", libc::ENOENT),
    ("ESRCH", libc::ESRCH),
    ("EINTR", libc::EINTR),
    ("EIO", libc::EIO),
    ("ENXIO", libc::ENXIO),
    ("EAGAIN", libc::EAGAIN),
    ("ENOMEM", libc::ENOMEM),
    ("EACCES", libc::EACCES),
    ("EFAULT", libc::EFAULT),
    ("EBUSY", libc::EBUSY),
    ("EEXIST", libc::EEXIST),
    ("ENODEV", libc::ENODEV),
    ("EINVAL", libc::EINVAL),
    ("ENOSPC", libc::ENOSPC),
    ("EROFS", libc::EROFS),
    ("ENOTSUP", libc::ENOTSUP),
    ("EOPNOTSUPP", libc::EOPNOTSUPP),
    ("ETIMEDOUT", libc::ETIMEDOUT),
    ("EUSERS", libc::EUSERS),
    ("ENOTCONN", libc::ENOTCONN),
];

/// Parses an errno name (case-insensitive) or a positive number.
pub fn parse_errno(s: &str) -> Option<i32> {
    if let Ok(n) = s.parse::<i32>() {
        return (n > 0).then_some(n);
    }
    ERRNOS.iter().find(|(n, _)| n.eq_ignore_ascii_case(s)).map(|(_, v)| *v)
}

/// The symbolic name of an errno (`EBUSY`), as used in the log.
pub fn errno_name(e: i32) -> String {
    format!("{:?}", nix::errno::Errno::from_raw(e))
}
