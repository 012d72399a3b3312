//! # host::proc — processes, read from the real `/proc`
//!
//! Process identity, VMM liveness, open-handle scans and control-socket ownership.
//! Processes are always inspected through the real `/proc` (never under a host root): a
//! simulated host still runs real processes (docs/design/host.md conventions).
//!
//! Invariant kept here: **every answer fails closed.** A read error that is not "the process
//! or fd has gone" (ENOENT/ESRCH) never turns into "dead" or "clean"; it becomes
//! [`Liveness::MaybeAlive`], [`HandleScan::Unknown`] or an `Err`. A pid is only ever
//! signalled through a [`PidFd`] whose process was confirmed after the pidfd was opened, so
//! a recycled pid can never be hit (docs/design/lifecycle.md "Stop", kill path).
//!
//! Sources: `proc(5)` (`/proc/<pid>/stat` field 22 `starttime`, `/proc/<pid>/fd`,
//! `/proc/net/unix`), `pidfd_open(2)`, `pidfd_send_signal(2)`, `clock_gettime(2)`.

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// Root of the real procfs. Processes are never looked up under a host root.
const PROC: &str = "/proc";

/// `__SO_ACCEPTCON` in the `Flags` column of `/proc/net/unix`: the socket is listening
/// (`include/linux/net.h`; `net/unix/af_unix.c` `unix_seq_show`).
const SO_ACCEPTCON: u64 = 1 << 16;

/// Who a VMM process is: survives pid reuse, reboots and PID namespaces.
///
/// `start_time` is `/proc/<pid>/stat` field 22 (`starttime`, clock ticks since boot, parsed
/// after the last `)` of the `comm` field — the `procfs` crate does this). `boot_id` is the
/// host root's boot id when the identity was captured. `pid_ns` is the inode of the PID
/// namespace the pid was read in (`/proc/self/ns/pid` of the agent that recorded it): a pid
/// means nothing in another namespace. Stored in instance records.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProcessIdentity {
    /// Process id (thread-group id), as seen in PID namespace `pid_ns`.
    pub pid: i32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_time: u64,
    /// Boot id of the host the process ran on.
    pub boot_id: String,
    /// Inode of the PID namespace of the agent that recorded the identity. `None` in records
    /// written before namespaces were recorded: such an identity is never trusted as dead.
    #[serde(default)]
    pub pid_ns: Option<u64>,
}

/// The inode of the initial PID namespace (`PROC_PID_INIT_INO` in the kernel's
/// `include/linux/proc_ns.h`): the host's own namespace.
pub const INITIAL_PID_NS: u64 = 0xEFFF_FFFC;

/// The inode of this process's PID namespace (`/proc/self/ns/pid` reads `pid:[<inode>]`,
/// `namespaces(7)`), read once. `None` when it cannot be read (then every recorded
/// identity is "maybe alive").
pub fn own_pid_namespace() -> Option<u64> {
    static NS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *NS.get_or_init(|| {
        let link = std::fs::read_link(Path::new(PROC).join("self/ns/pid")).ok()?;
        let s = link.to_str()?;
        s.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
    })
}

/// Why `identity` cannot be judged from this agent's PID namespace, if it cannot: it was
/// recorded in another namespace (or in an unknown one). Such a VMM is *maybe alive*: never
/// signalled, never released on its behalf (docs/design/lifecycle.md "provably dead").
pub fn foreign_namespace(identity: &ProcessIdentity) -> Option<String> {
    foreign_namespace_from(identity, own_pid_namespace())
}

/// [`foreign_namespace`] for an agent in PID namespace `own`. An identity recorded before
/// namespaces were recorded (`pid_ns: None`, an older version) is judged in the host's PID
/// namespace: an agent running there ([`INITIAL_PID_NS`], which sees every process) decides
/// it as any other; elsewhere it stays maybe alive. The way out for such a record is to run
/// the agent in the host's PID namespace once, or a reboot (a new boot id ends every
/// identity).
fn foreign_namespace_from(identity: &ProcessIdentity, own: Option<u64>) -> Option<String> {
    match (identity.pid_ns, own) {
        (Some(rec), Some(own)) if rec == own => None,
        (None, Some(INITIAL_PID_NS)) => None,
        (Some(rec), Some(own)) => Some(format!(
            "its VMM (pid {}) was recorded in PID namespace {rec}, this agent runs in PID namespace {own} and cannot \
             see that process: run `gpuvisor serve` in the PID namespace the VM was started from (the host's)",
            identity.pid
        )),
        (None, _) => Some(format!(
            "its VMM (pid {}) was recorded without a PID namespace (by an older version), so the pid can only be \
             checked by an agent in the host's PID namespace: run `gpuvisor serve` there once (or reboot)",
            identity.pid
        )),
        (Some(_), None) => Some("this agent cannot read its own PID namespace (/proc/self/ns/pid)".to_string()),
    }
}

/// Errors reading `/proc`. Callers that must decide liveness treat any of these as
/// "maybe alive".
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// `/proc/<pid>` (or a file in it) exists but could not be read.
    // The cause is part of the message: operators read these in `last_error` and reports,
    // where the errno (EACCES, EIO, ...) is the useful part.
    #[error("process {pid} could not be inspected in /proc: {source}")]
    Process {
        /// The process id.
        pid: i32,
        /// The underlying procfs error.
        #[source]
        source: procfs::ProcError,
    },
    /// A `/proc` path could not be read for a reason other than the process having exited.
    #[error("{} could not be read: {source}", path.display())]
    Io {
        /// The path that failed.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A `/proc` file had unexpected content.
    #[error("{} is malformed: {detail}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        detail: String,
    },
}

/// Liveness of a VMM, per docs/design/lifecycle.md "provably dead".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    /// The recorded process (or the owner of the control socket listener) is alive.
    Alive {
        /// The live process (the recorded pid, or the socket owner's pid).
        pid: i32,
    },
    /// Provably dead: the recorded identity matches no live process **and** no live process
    /// owns the control socket listener.
    Dead,
    /// Could not be decided (scan error, permission error, unreadable `/proc/<pid>`).
    /// Callers treat this as alive and change nothing.
    MaybeAlive {
        /// One sentence saying why.
        reason: String,
    },
}

impl std::fmt::Display for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Liveness::Alive { pid } => write!(f, "alive (pid {pid})"),
            Liveness::Dead => f.write_str("provably dead"),
            Liveness::MaybeAlive { reason } => write!(f, "maybe alive: {reason}"),
        }
    }
}

/// Result of an open-handle scan (docs/design/host.md §5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandleScan {
    /// No process holds any target open.
    Clean,
    /// These processes (sorted, deduplicated) hold at least one target open.
    Held {
        /// Holder pids.
        pids: Vec<i32>,
    },
    /// The scan could not be completed; treat as in use ("cannot verify").
    Unknown {
        /// One sentence saying why.
        reason: String,
    },
}

/// `true` for errors that mean "the process or fd has gone" (ENOENT, ESRCH).
fn io_vanished(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH)) || e.kind() == std::io::ErrorKind::NotFound
}

/// `true` for procfs errors that mean "the process has gone".
fn proc_vanished(e: &procfs::ProcError) -> bool {
    match e {
        procfs::ProcError::NotFound(_) => true,
        procfs::ProcError::Io(io, _) => io_vanished(io),
        _ => false,
    }
}

/// Reads the identity of `pid` now, tagged with `boot_id` (the host root's boot id).
///
/// Returns `Ok(None)` when the pid does not exist. A zombie still has an identity.
/// Errors: `/proc/<pid>/stat` exists but cannot be read or parsed.
pub fn identity_of(pid: i32, boot_id: &str) -> Result<Option<ProcessIdentity>, ProcError> {
    if pid <= 0 {
        return Ok(None);
    }
    let stat = match procfs::process::Process::new(pid).and_then(|p| p.stat()) {
        Ok(s) => s,
        Err(e) if proc_vanished(&e) => return Ok(None),
        Err(source) => return Err(ProcError::Process { pid, source }),
    };
    Ok(Some(ProcessIdentity {
        pid,
        start_time: stat.starttime,
        boot_id: boot_id.to_string(),
        pid_ns: own_pid_namespace(),
    }))
}

/// What a process has used: CPU time (user + system, all its threads) and resident memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    /// User plus system CPU time, in milliseconds.
    pub cpu_ms: u64,
    /// Resident set size (`VmRSS`), in bytes.
    pub rss_bytes: u64,
}

/// What the process `identity` names has used, read from `/proc/<pid>/stat` and `status`:
/// `Ok(None)` when that pid is gone or is another process now (its start time differs).
/// Errors: the files exist but cannot be read or parsed.
pub fn usage_of(identity: &ProcessIdentity) -> Result<Option<ProcessUsage>, ProcError> {
    let pid = identity.pid;
    let process = match procfs::process::Process::new(pid) {
        Ok(p) => p,
        Err(e) if proc_vanished(&e) => return Ok(None),
        Err(source) => return Err(ProcError::Process { pid, source }),
    };
    let stat = match process.stat() {
        Ok(s) => s,
        Err(e) if proc_vanished(&e) => return Ok(None),
        Err(source) => return Err(ProcError::Process { pid, source }),
    };
    if stat.starttime != identity.start_time {
        return Ok(None);
    }
    let status = match process.status() {
        Ok(s) => s,
        Err(e) if proc_vanished(&e) => return Ok(None),
        Err(source) => return Err(ProcError::Process { pid, source }),
    };
    let ticks = procfs::ticks_per_second().max(1);
    Ok(Some(ProcessUsage {
        cpu_ms: (stat.utime + stat.stime).saturating_mul(1000) / ticks,
        rss_bytes: status.vmrss.unwrap_or(0).saturating_mul(1024),
    }))
}

/// Liveness of the recorded identity alone (the first half of "provably dead"): cheap (no
/// scan of `/proc`), used by views and to tell which process a live control socket belongs to.
pub fn identity_liveness(rec: &ProcessIdentity, current_boot_id: &str) -> Liveness {
    if rec.boot_id != current_boot_id {
        // A VMM of an earlier boot is dead (docs/design/host.md §9, reboot).
        return Liveness::Dead;
    }
    if let Some(reason) = foreign_namespace(rec) {
        return Liveness::MaybeAlive { reason };
    }
    if rec.pid <= 0 {
        return Liveness::MaybeAlive { reason: format!("the recorded VMM pid {} is not a process id", rec.pid) };
    }
    let pid = rec.pid;
    match nix::sys::signal::kill(Pid::from_raw(pid), None) {
        Err(Errno::ESRCH) => return Liveness::Dead,
        // EPERM: the pid exists but belongs to someone we may not signal: never "dead".
        Ok(()) | Err(Errno::EPERM) => {}
        Err(e) => return Liveness::MaybeAlive { reason: format!("kill({pid}, 0) failed: {e}") },
    }
    let process = match procfs::process::Process::new(pid) {
        Ok(p) => p,
        Err(e) if proc_vanished(&e) => return Liveness::Dead,
        Err(e) => return Liveness::MaybeAlive { reason: format!("/proc/{pid} could not be opened: {e}") },
    };
    let stat = match process.stat() {
        Ok(s) => s,
        Err(e) if proc_vanished(&e) => return Liveness::Dead,
        Err(e) => return Liveness::MaybeAlive { reason: format!("/proc/{pid}/stat could not be read: {e}") },
    };
    if stat.starttime != rec.start_time {
        // A recycled pid: not our VMM.
        return Liveness::Dead;
    }
    if matches!(stat.state, 'Z' | 'X') {
        return match thread_group_has_live_task(pid) {
            Ok(true) => Liveness::Alive { pid },
            Ok(false) => Liveness::Dead,
            Err(e) => {
                Liveness::MaybeAlive { reason: format!("the threads of zombie process {pid} could not be read: {e}") }
            }
        };
    }
    Liveness::Alive { pid }
}

/// `true` if any task of `pid`'s thread group is neither a zombie nor dead.
fn thread_group_has_live_task(pid: i32) -> Result<bool, ProcError> {
    let dir = Path::new(PROC).join(pid.to_string()).join("task");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if io_vanished(&e) => return Ok(false),
        Err(source) => return Err(ProcError::Io { path: dir, source }),
    };
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) if io_vanished(&e) => continue,
            Err(source) => return Err(ProcError::Io { path: dir, source }),
        };
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let stat = procfs::process::Process::new(pid).and_then(|p| p.task_from_tid(tid)).and_then(|t| t.stat());
        match stat {
            Ok(s) if !matches!(s.state, 'Z' | 'X') => return Ok(true),
            Ok(_) => {}
            Err(e) if proc_vanished(&e) => {}
            Err(source) => return Err(ProcError::Process { pid, source }),
        }
    }
    Ok(false)
}

/// Decides whether a VMM is alive, per docs/design/lifecycle.md "provably dead".
///
/// `recorded` is the stored VMM identity (if any), `control_socket` the VMM's control socket
/// (QEMU's QMP socket), `current_boot_id` the host root's boot id now.
///
/// - identity: same pid, same start time and same boot id as a live process → alive; EPERM
///   from `kill(pid, 0)` never counts as gone; a zombie leader with a live thread is alive,
///   a zombie with no live thread is not; another start time or boot id is not our VMM;
/// - control socket: any live process owning the listener bound at that path → alive;
/// - [`Liveness::Dead`] only when both checks prove it; any read error → `MaybeAlive`.
pub fn vmm_liveness(
    recorded: Option<&ProcessIdentity>,
    control_socket: Option<&Path>,
    current_boot_id: &str,
) -> Liveness {
    let mut maybe: Option<String> = None;
    if let Some(rec) = recorded {
        match identity_liveness(rec, current_boot_id) {
            Liveness::Alive { pid } => return Liveness::Alive { pid },
            Liveness::MaybeAlive { reason } => maybe = Some(reason),
            Liveness::Dead => {}
        }
    }
    if let Some(sock) = control_socket {
        let listener = unix_listener_inodes(sock).and_then(|inodes| Ok((owners_of(&inodes)?, inodes)));
        match listener {
            Ok((owners, inodes)) if owners.is_empty() && !inodes.is_empty() => {
                // A listener is bound at the control path, yet no process this agent can see
                // holds it: its owner lives where this agent cannot look (another PID
                // namespace). Never "dead".
                let reason = format!(
                    "a listener is bound at the control socket {} but no process visible to this agent holds it \
                     (it may be held from another PID namespace)",
                    sock.display()
                );
                maybe = Some(match maybe {
                    Some(m) => format!("{m}; {reason}"),
                    None => reason,
                });
            }
            Ok((owners, _)) if owners.len() > 1 => {
                // Several live processes listen at the VMM's control path and none is the
                // recorded identity: which one is the VMM cannot be decided.
                return Liveness::MaybeAlive {
                    reason: format!(
                        "{} processes ({owners:?}) own the control socket listener {}; the VMM cannot be identified",
                        owners.len(),
                        sock.display()
                    ),
                };
            }
            Ok((owners, _)) => {
                if let Some(&pid) = owners.first() {
                    return Liveness::Alive { pid };
                }
            }
            Err(e) => {
                let reason = format!("the owner of control socket {} could not be determined: {e}", sock.display());
                maybe = Some(match maybe {
                    Some(m) => format!("{m}; {reason}"),
                    None => reason,
                });
            }
        }
    }
    match maybe {
        Some(reason) => Liveness::MaybeAlive { reason },
        None => Liveness::Dead,
    }
}

/// Lists the numeric entries of `/proc` (all thread-group ids visible to us).
fn all_pids() -> Result<Vec<i32>, ProcError> {
    let entries = std::fs::read_dir(PROC).map_err(|source| ProcError::Io { path: PathBuf::from(PROC), source })?;
    let mut pids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| ProcError::Io { path: PathBuf::from(PROC), source })?;
        if let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
            pids.push(pid);
        }
    }
    Ok(pids)
}

/// Reads every fd link in `dir` (a `/proc/<pid>/fd` or `/proc/<pid>/task/<tid>/fd`).
///
/// Returns `Ok(None)` when the directory has gone (ENOENT/ESRCH); skips fds that vanish.
fn fd_links_in(dir: &Path) -> Result<Option<Vec<OsString>>, ProcError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if io_vanished(&e) => return Ok(None),
        Err(source) => return Err(ProcError::Io { path: dir.to_path_buf(), source }),
    };
    let mut links = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) if io_vanished(&e) => return Ok(None),
            Err(source) => return Err(ProcError::Io { path: dir.to_path_buf(), source }),
        };
        let path = entry.path();
        match std::fs::read_link(&path) {
            Ok(target) => links.push(target.into_os_string()),
            Err(e) if io_vanished(&e) => {}
            Err(source) => return Err(ProcError::Io { path, source }),
        }
    }
    Ok(Some(links))
}

/// Every fd link of process `pid`. An empty fd table (a zombie leader whose threads live
/// on, or a kernel thread) is completed from `/proc/<pid>/task/<tid>/fd` of the other
/// tasks. `Ok(vec![])` when the process has gone.
fn fd_links_of(pid: i32) -> Result<Vec<OsString>, ProcError> {
    let base = Path::new(PROC).join(pid.to_string());
    let links = match fd_links_in(&base.join("fd"))? {
        Some(l) => l,
        None => return Ok(Vec::new()),
    };
    if !links.is_empty() {
        return Ok(links);
    }
    let task_dir = base.join("task");
    let tasks = match std::fs::read_dir(&task_dir) {
        Ok(t) => t,
        Err(e) if io_vanished(&e) => return Ok(Vec::new()),
        Err(source) => return Err(ProcError::Io { path: task_dir, source }),
    };
    let mut all = Vec::new();
    for task in tasks {
        let task = match task {
            Ok(t) => t,
            Err(e) if io_vanished(&e) => continue,
            Err(source) => return Err(ProcError::Io { path: task_dir, source }),
        };
        if task.file_name().to_str() == Some(&pid.to_string()) {
            continue;
        }
        if let Some(l) = fd_links_in(&task.path().join("fd"))? {
            all.extend(l);
        }
    }
    Ok(all)
}

/// Strips the ` (deleted)` suffix the kernel appends to links of unlinked files.
fn strip_deleted(link: &OsStr) -> &OsStr {
    let b = link.as_bytes();
    OsStr::from_bytes(b.strip_suffix(b" (deleted)").unwrap_or(b))
}

/// The forms under which the kernel may print `target` in an fd link: the path as given,
/// fully canonicalised, and with its parent directory canonicalised.
fn canonical_forms(target: &Path) -> Vec<PathBuf> {
    let mut forms = vec![target.to_path_buf()];
    if let Ok(c) = std::fs::canonicalize(target) {
        forms.push(c);
    }
    if let (Some(parent), Some(name)) = (target.parent(), target.file_name()) {
        if let Ok(p) = std::fs::canonicalize(parent) {
            forms.push(p.join(name));
        }
    }
    forms
}

/// Scans every process's fds for any of `targets` (docs/design/host.md §5).
///
/// For each numeric `/proc` entry, reads `/proc/<pid>/fd` and `readlink`s each entry, strips
/// ` (deleted)`, and compares with the targets (canonicalised first: the kernel prints
/// canonical paths). ENOENT/ESRCH (process or fd gone) are skipped; any other error makes
/// the result [`HandleScan::Unknown`] (fail closed). The calling process is scanned too:
/// if the agent itself holds a node, it is in use.
pub fn scan_open_handles(targets: &[PathBuf]) -> HandleScan {
    let wanted: BTreeSet<Vec<u8>> =
        targets.iter().flat_map(|t| canonical_forms(t)).map(|p| p.into_os_string().into_vec_bytes()).collect();
    if wanted.is_empty() {
        return HandleScan::Clean;
    }
    let pids = match all_pids() {
        Ok(p) => p,
        Err(e) => return HandleScan::Unknown { reason: e.to_string() },
    };
    let mut holders = BTreeSet::new();
    for pid in pids {
        let links = match fd_links_of(pid) {
            Ok(l) => l,
            Err(e) => return HandleScan::Unknown { reason: e.to_string() },
        };
        if links.iter().any(|l| wanted.contains(strip_deleted(l).as_bytes())) {
            holders.insert(pid);
        }
    }
    if holders.is_empty() {
        HandleScan::Clean
    } else {
        HandleScan::Held { pids: holders.into_iter().collect() }
    }
}

/// Whether every process's fd table can be read, as [`scan_open_handles`] needs: the number
/// of processes read. Errors: the first unreadable `/proc` listing or fd table (EACCES
/// without root), one sentence.
pub fn fd_tables_readable() -> Result<usize, String> {
    let pids = all_pids().map_err(|e| e.to_string())?;
    for &pid in &pids {
        fd_links_of(pid).map_err(|e| e.to_string())?;
    }
    Ok(pids.len())
}

/// The paths process `pid` holds open (its `/proc/<pid>/fd` links, ` (deleted)` stripped;
/// sockets, pipes and anonymous inodes included as the kernel prints them).
///
/// `Ok(vec![])` when the process has gone. Errors: the fd table could not be read for a
/// reason other than the process having exited.
pub fn open_paths_of(pid: i32) -> Result<Vec<PathBuf>, ProcError> {
    Ok(fd_links_of(pid)?.iter().map(|l| PathBuf::from(strip_deleted(l))).collect())
}

/// Small helper: `OsString` → bytes without a lossy conversion.
trait IntoVecBytes {
    fn into_vec_bytes(self) -> Vec<u8>;
}

impl IntoVecBytes for OsString {
    fn into_vec_bytes(self) -> Vec<u8> {
        use std::os::unix::ffi::OsStringExt;
        self.into_vec()
    }
}

/// Inodes of the listening Unix sockets bound at `path`, from `/proc/net/unix`.
///
/// The file is parsed here rather than through `procfs::net::unix()`, which drops the
/// `Flags` column (the listening flag `__SO_ACCEPTCON`) and splits paths on whitespace.
/// Columns: `Num RefCount Protocol Flags Type St Inode Path` (`net/unix/af_unix.c`).
pub fn unix_listener_inodes(path: &Path) -> Result<BTreeSet<u64>, ProcError> {
    Ok(unix_sockets_at(path)?.into_iter().filter(|s| s.listening).map(|s| s.inode).collect())
}

/// `St` of a connected socket in `/proc/net/unix` (`SS_CONNECTED`, `include/uapi/linux/net.h`).
const SS_CONNECTED: u64 = 3;

/// How many connections a listener at `path` holds — accepted or still waiting in its
/// backlog: the server-side sockets bound at the path that are connected
/// (`/proc/net/unix`). E.g. a client attached to a VMM's serial console. Errors: as
/// [`unix_listener_inodes`].
pub fn unix_connections_at(path: &Path) -> Result<usize, ProcError> {
    Ok(unix_sockets_at(path)?.into_iter().filter(|s| !s.listening && s.state == SS_CONNECTED).count())
}

/// One row of `/proc/net/unix` bound at a path.
struct UnixRow {
    inode: u64,
    listening: bool,
    state: u64,
}

/// The sockets bound at `path` (any of its canonical forms; an abstract name as `@name`).
fn unix_sockets_at(path: &Path) -> Result<Vec<UnixRow>, ProcError> {
    let table = Path::new(PROC).join("net/unix");
    let text = std::fs::read(&table).map_err(|source| ProcError::Io { path: table.clone(), source })?;
    let wanted: BTreeSet<Vec<u8>> =
        canonical_forms(path).into_iter().map(|p| p.into_os_string().into_vec_bytes()).collect();
    let mut rows = Vec::new();
    for line in text.split(|&b| b == b'\n').skip(1) {
        if line.is_empty() {
            continue;
        }
        let mut rest = line;
        let mut fields: Vec<&[u8]> = Vec::with_capacity(7);
        while fields.len() < 7 {
            let start = rest.iter().position(|b| !b.is_ascii_whitespace());
            let Some(start) = start else { break };
            rest = &rest[start..];
            let end = rest.iter().position(|b| b.is_ascii_whitespace()).unwrap_or(rest.len());
            fields.push(&rest[..end]);
            rest = &rest[end..];
        }
        if fields.len() < 7 {
            return Err(ProcError::Malformed { path: table, detail: format!("a line has {} columns", fields.len()) });
        }
        // The path is the rest of the line after one space (it may itself contain spaces).
        let bound = rest.strip_prefix(b" ").unwrap_or(rest);
        if bound.is_empty() || !wanted.contains(bound) {
            continue;
        }
        let malformed = |what: &str| ProcError::Malformed { path: table.clone(), detail: format!("bad {what} column") };
        let flags = std::str::from_utf8(fields[3])
            .ok()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(|| malformed("Flags"))?;
        let inode = std::str::from_utf8(fields[6])
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| malformed("Inode"))?;
        let state = std::str::from_utf8(fields[5])
            .ok()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(|| malformed("St"))?;
        rows.push(UnixRow { inode, listening: flags & SO_ACCEPTCON != 0, state });
    }
    Ok(rows)
}

/// `true` if any of `links` is `socket:[<inode>]` for an inode in `inodes`.
fn links_hold_socket(links: &[OsString], inodes: &BTreeSet<u64>) -> bool {
    links.iter().any(|l| {
        l.to_str()
            .and_then(|s| s.strip_prefix("socket:["))
            .and_then(|s| s.strip_suffix(']'))
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|i| inodes.contains(&i))
    })
}

/// The pids (sorted) of the processes holding an fd on the listening Unix socket bound at
/// `path` (resolved through `/proc/net/unix`, then matched against `socket:[inode]` links in
/// every `/proc/<pid>/fd`).
///
/// `Ok(vec![])` when no listener is bound at `path` or nobody holds it. Errors: `/proc/net/unix`
/// unreadable or malformed, or a `/proc/<pid>/fd` unreadable for a reason other than the
/// process having exited.
pub fn unix_listener_owners(path: &Path) -> Result<Vec<i32>, ProcError> {
    owners_of(&unix_listener_inodes(path)?)
}

/// The pids (sorted) of the visible processes holding an fd on any socket inode in `inodes`.
fn owners_of(inodes: &BTreeSet<u64>) -> Result<Vec<i32>, ProcError> {
    if inodes.is_empty() {
        return Ok(Vec::new());
    }
    let mut owners = Vec::new();
    for pid in all_pids()? {
        if links_hold_socket(&fd_links_of(pid)?, inodes) {
            owners.push(pid);
        }
    }
    Ok(owners)
}

/// Milliseconds of `CLOCK_BOOTTIME` (monotonic, counts suspend; resets at boot).
///
/// Used for claim ages (`claimed_boottime_ms`, docs/design/lifecycle.md). Returns 0 only if the clock
/// cannot be read, which Linux >= 2.6.39 never does.
pub fn boottime_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_BOOTTIME exists since Linux 2.6.39.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1000).saturating_add(ts.tv_nsec as u64 / 1_000_000)
}

/// Sets `/proc/<pid>/oom_score_adj` (-1000..=1000; negative values need CAP_SYS_RESOURCE).
///
/// Errors: the write failed (e.g. EACCES without the capability, ESRCH when gone).
pub fn set_oom_score_adj(pid: i32, value: i32) -> std::io::Result<()> {
    std::fs::write(Path::new(PROC).join(pid.to_string()).join("oom_score_adj"), value.to_string())
}

/// A pidfd (`pidfd_open(2)`, Linux >= 5.3): a handle on one process that can never refer to
/// a recycled pid. Signals sent through it reach that process or fail with ESRCH.
#[derive(Debug)]
pub struct PidFd {
    fd: OwnedFd,
    pid: i32,
}

impl PidFd {
    /// Opens a pidfd for `pid`. `Ok(None)` when the process does not exist (ESRCH).
    ///
    /// Errors: any other `pidfd_open` failure (e.g. ENOSYS on kernels older than 5.3).
    pub fn open(pid: i32) -> std::io::Result<Option<PidFd>> {
        if pid <= 0 {
            return Ok(None);
        }
        // SAFETY: pidfd_open takes (pid_t, unsigned int) and returns a new fd or -1.
        let rc = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ESRCH) {
                return Ok(None);
            }
            return Err(e);
        }
        // SAFETY: rc is a fresh fd owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(rc as libc::c_int) };
        Ok(Some(PidFd { fd, pid }))
    }

    /// The pid this pidfd was opened for.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends `signal` through the pidfd (`pidfd_send_signal(2)`).
    ///
    /// `Ok(false)` when the process has already exited (ESRCH); errors otherwise.
    pub fn send_signal(&self, signal: Signal) -> std::io::Result<bool> {
        // SAFETY: (pidfd, sig, siginfo = NULL, flags = 0) is the documented simple form.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                signal as libc::c_int,
                std::ptr::null::<libc::siginfo_t>(),
                0u32,
            )
        };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ESRCH) {
                return Ok(false);
            }
            return Err(e);
        }
        Ok(true)
    }
}

/// A process confirmed to be a recorded identity, held by a pidfd.
#[derive(Debug)]
pub struct ConfirmedProcess {
    /// The pidfd, opened before the confirmation.
    pub pidfd: PidFd,
    /// Its process group id (`/proc/<pid>/stat` field 5), read in the same confirmation.
    pub pgrp: i32,
}

/// Opens a pidfd on the process `identity` names, **confirmed** after opening: same boot
/// id, and `/proc/<pid>/stat` start time equal to the recorded one (so the pidfd cannot
/// belong to a recycled pid). `Ok(None)` when the identity is not a live process now.
///
/// Errors: the pidfd or `/proc/<pid>/stat` could not be read (the target is then unconfirmed
/// and must not be signalled).
pub fn confirm_identity(
    identity: &ProcessIdentity,
    current_boot_id: &str,
) -> Result<Option<ConfirmedProcess>, ProcError> {
    if identity.boot_id != current_boot_id || identity.pid <= 0 {
        return Ok(None);
    }
    if let Some(reason) = foreign_namespace(identity) {
        return Err(ProcError::Malformed { path: Path::new(PROC).join("self/ns/pid"), detail: reason });
    }
    let pid = identity.pid;
    let pidfd = match PidFd::open(pid) {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(None),
        Err(source) => return Err(ProcError::Io { path: Path::new(PROC).join(pid.to_string()), source }),
    };
    let stat = match procfs::process::Process::new(pid).and_then(|p| p.stat()) {
        Ok(s) => s,
        Err(e) if proc_vanished(&e) => return Ok(None),
        Err(source) => return Err(ProcError::Process { pid, source }),
    };
    if stat.starttime != identity.start_time {
        return Ok(None);
    }
    Ok(Some(ConfirmedProcess { pidfd, pgrp: stat.pgrp }))
}

/// Opens pidfds on the current owners of the listening socket at `path`, each confirmed
/// (after opening the pidfd) to still hold the listener. Pids in `exclude` are skipped.
///
/// Errors: as [`unix_listener_owners`], or a pidfd could not be opened.
pub fn confirm_listener_owners(path: &Path, exclude: &[i32]) -> Result<Vec<PidFd>, ProcError> {
    let inodes = unix_listener_inodes(path)?;
    if inodes.is_empty() {
        return Ok(Vec::new());
    }
    let mut confirmed = Vec::new();
    for pid in unix_listener_owners(path)? {
        if exclude.contains(&pid) {
            continue;
        }
        let pidfd = match PidFd::open(pid) {
            Ok(Some(p)) => p,
            Ok(None) => continue,
            Err(source) => return Err(ProcError::Io { path: Path::new(PROC).join(pid.to_string()), source }),
        };
        if links_hold_socket(&fd_links_of(pid)?, &inodes) {
            confirmed.push(pidfd);
        }
    }
    Ok(confirmed)
}

/// Test support: run a test in a private PID namespace with its own `/proc`.
///
/// The open-handle scan fails closed on any unreadable `/proc/<pid>/fd`, so on a machine
/// where some process is unreadable (a sandbox's init, another user's process without
/// CAP_SYS_PTRACE) every scan is `Unknown`. docs/design/host.md §5: tests run as root or in their
/// own PID namespace with a private `/proc`. This re-runs the calling test under
/// `unshare --pid --fork --mount-proc`.
#[cfg(test)]
pub(crate) mod testutil {
    use std::process::Command;

    const INNER: &str = "GPUVISOR_TEST_PRIVATE_PROC";

    /// Returns `true` when the caller runs inside the private namespace and should run its
    /// body; otherwise re-runs `test` (`module::path::name` without the crate) there,
    /// asserts it passed, and returns `false`.
    pub(crate) fn in_private_proc(module: &str, name: &str) -> bool {
        if std::env::var_os(INNER).is_some() {
            return true;
        }
        let module = module.split_once("::").map(|(_, m)| m).unwrap_or(module);
        let test = format!("{module}::{name}");
        let exe = std::env::current_exe().expect("test binary path");
        let out = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "--kill-child", "--"])
            .arg(exe)
            .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
            .env(INNER, "1")
            .output()
            .expect("run unshare");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{test} failed in a private PID namespace: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        false
    }
}

/// The ids in `first..=last` that a visible process holds as a real, effective, saved or
/// filesystem uid or gid (`/proc/<pid>/status` `Uid:`/`Gid:` lines), with one pid holding
/// each: an id is never given to a new VMM while a process of its old owner lives. A zombie
/// (`State: Z`, waiting to be reaped) holds nothing: it runs no code and owns no file.
///
/// Errors: `/proc` cannot be listed, or a process's status cannot be read for another
/// reason than the process having exited (unknown is not free).
pub fn ids_held(first: u32, last: u32) -> Result<std::collections::BTreeMap<u32, i32>, ProcError> {
    let mut held = std::collections::BTreeMap::new();
    for pid in all_pids()? {
        let path = Path::new(PROC).join(pid.to_string()).join("status");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if io_vanished(&e) => continue,
            Err(source) => return Err(ProcError::Io { path, source }),
        };
        if text.lines().any(|l| l.starts_with("State:") && (l.contains("Z (zombie)") || l.contains("X (dead)"))) {
            continue;
        }
        for line in text.lines().filter(|l| l.starts_with("Uid:") || l.starts_with("Gid:")) {
            for id in line[4..].split_whitespace().filter_map(|v| v.parse::<u32>().ok()) {
                if id >= first && id <= last {
                    held.entry(id).or_insert(pid);
                }
            }
        }
    }
    Ok(held)
}

/// `pid <N> (<comm>)` for messages naming a holder (`pid <N>` when its name cannot be read).
pub fn describe_pid(pid: i32) -> String {
    match std::fs::read_to_string(format!("/proc/{pid}/comm")) {
        Ok(c) => format!("pid {pid} ({})", c.trim()),
        Err(_) => format!("pid {pid}"),
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::in_private_proc;
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    const BOOT: &str = "test-boot-id";

    fn sleep_child() -> Child {
        Command::new("sleep").arg("60").stdin(Stdio::null()).spawn().expect("spawn sleep")
    }

    fn kill_and_reap(mut c: Child) {
        let _ = c.kill();
        let _ = c.wait();
    }

    fn wait_until(mut f: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    #[test]
    fn identity_of_a_live_process_has_its_start_time() {
        let child = sleep_child();
        let pid = child.id() as i32;

        let id = identity_of(pid, BOOT).unwrap().expect("process exists");

        let stat = procfs::process::Process::new(pid).unwrap().stat().unwrap();
        assert_eq!(id.pid, pid);
        assert_eq!(id.start_time, stat.starttime);
        assert_eq!(id.boot_id, BOOT);
        assert_eq!(vmm_liveness(Some(&id), None, BOOT), Liveness::Alive { pid });
        kill_and_reap(child);
    }

    #[test]
    fn identity_of_a_missing_pid_is_none() {
        let mut child = sleep_child();
        let pid = child.id() as i32;
        child.kill().unwrap();
        child.wait().unwrap();

        assert_eq!(identity_of(pid, BOOT).unwrap(), None);
    }

    #[test]
    fn a_recycled_pid_is_not_our_vmm() {
        let child = sleep_child();
        let pid = child.id() as i32;
        let mut rec = identity_of(pid, BOOT).unwrap().unwrap();
        rec.start_time += 1;

        assert_eq!(vmm_liveness(Some(&rec), None, BOOT), Liveness::Dead);
        assert!(confirm_identity(&rec, BOOT).unwrap().is_none());
        // and it is still alive: nothing here signals anything.
        assert!(nix::sys::signal::kill(Pid::from_raw(pid), None).is_ok());
        kill_and_reap(child);
    }

    #[test]
    fn an_identity_from_another_boot_is_dead() {
        let child = sleep_child();
        let rec = identity_of(child.id() as i32, "old-boot").unwrap().unwrap();

        assert_eq!(vmm_liveness(Some(&rec), None, BOOT), Liveness::Dead);
        assert!(confirm_identity(&rec, BOOT).unwrap().is_none());
        kill_and_reap(child);
    }

    #[test]
    fn a_zombie_without_live_threads_is_dead() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let rec = identity_of(pid, BOOT).unwrap().unwrap();
        // let it exit without waiting: it stays a zombie.
        assert!(wait_until(|| {
            procfs::process::Process::new(pid).and_then(|p| p.stat()).map(|s| s.state == 'Z').unwrap_or(false)
        }));

        assert_eq!(vmm_liveness(Some(&rec), None, BOOT), Liveness::Dead);
        child.wait().unwrap();
    }

    #[test]
    fn a_zombie_leader_with_a_live_thread_is_alive() {
        // The main thread calls pthread_exit while another thread sleeps on.
        let script = "import threading,time,ctypes\n\
                      threading.Thread(target=time.sleep, args=(30,)).start()\n\
                      ctypes.CDLL(None).pthread_exit(None)\n";
        let Ok(mut child) = Command::new("python3").arg("-c").arg(script).spawn() else {
            eprintln!("python3 is not available; skipped");
            return;
        };
        let pid = child.id() as i32;
        let rec = identity_of(pid, BOOT).unwrap().unwrap();
        let leader_is_zombie =
            || procfs::process::Process::new(pid).and_then(|p| p.stat()).map(|s| s.state == 'Z').unwrap_or(false);
        assert!(wait_until(leader_is_zombie), "the leader never became a zombie");

        assert_eq!(vmm_liveness(Some(&rec), None, BOOT), Liveness::Alive { pid });

        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(vmm_liveness(Some(&rec), None, BOOT), Liveness::Dead);
    }

    #[test]
    fn confirm_identity_signals_only_the_recorded_process() {
        let mut child = sleep_child();
        let rec = identity_of(child.id() as i32, BOOT).unwrap().unwrap();

        let confirmed = confirm_identity(&rec, BOOT).unwrap().expect("confirmed");
        let pidfd = confirmed.pidfd;
        assert!(pidfd.send_signal(Signal::SIGKILL).unwrap());

        child.wait().unwrap();
        assert_eq!(vmm_liveness(Some(&rec), None, BOOT), Liveness::Dead);
        assert!(!pidfd.send_signal(Signal::SIGKILL).unwrap());
    }

    #[test]
    fn scan_finds_a_holder_of_a_file_and_not_after_it_exits() {
        if !in_private_proc(module_path!(), "scan_finds_a_holder_of_a_file_and_not_after_it_exits") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("node");
        std::fs::write(&node, b"x").unwrap();
        let mut child = Command::new("sh").arg("-c").arg("exec 7<\"$0\"; exec sleep 60").arg(&node).spawn().unwrap();
        let pid = child.id() as i32;
        let targets = vec![node.clone()];

        assert!(wait_until(|| matches!(
            scan_open_handles(&targets),
            HandleScan::Held { ref pids } if pids.contains(&pid)
        )));

        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(scan_open_handles(&targets), HandleScan::Clean);
    }

    #[test]
    fn scan_counts_the_calling_process_and_deleted_files() {
        if !in_private_proc(module_path!(), "scan_counts_the_calling_process_and_deleted_files") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("node");
        std::fs::write(&node, b"x").unwrap();
        let f = std::fs::File::open(&node).unwrap();
        std::fs::remove_file(&node).unwrap();

        let scan = scan_open_handles(std::slice::from_ref(&node));

        let me = std::process::id() as i32;
        assert!(matches!(scan, HandleScan::Held { ref pids } if pids.contains(&me)));
        drop(f);
    }

    #[test]
    fn listener_owner_is_found_by_socket_path() {
        if !in_private_proc(module_path!(), "listener_owner_is_found_by_socket_path") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("ctl.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let me = std::process::id() as i32;

        assert_eq!(unix_listener_owners(&sock).unwrap(), vec![me]);
        assert_eq!(vmm_liveness(None, Some(&sock), BOOT), Liveness::Alive { pid: me });

        drop(listener);
        assert!(unix_listener_owners(&sock).unwrap().is_empty());
        assert_eq!(vmm_liveness(None, Some(&sock), BOOT), Liveness::Dead);
    }

    #[test]
    fn a_child_owning_a_listener_is_found_and_keeps_a_dead_record_alive() {
        if !in_private_proc(module_path!(), "a_child_owning_a_listener_is_found_and_keeps_a_dead_record_alive") {
            return;
        }
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let fd = listener.as_raw_fd();
        let mut cmd = Command::new("sleep");
        cmd.arg("60");
        // SAFETY: dup2 is async-signal-safe; fd 5 becomes an inherited copy of the listener.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 5) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        drop(listener);
        let pid = child.id() as i32;

        assert_eq!(unix_listener_owners(&sock).unwrap(), vec![pid]);
        let stale = ProcessIdentity { pid: 1, start_time: u64::MAX, boot_id: BOOT.into(), pid_ns: own_pid_namespace() };
        assert_eq!(vmm_liveness(Some(&stale), Some(&sock), BOOT), Liveness::Alive { pid });
        let owners = confirm_listener_owners(&sock, &[]).unwrap();
        assert_eq!(owners.iter().map(PidFd::pid).collect::<Vec<_>>(), vec![pid]);

        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(vmm_liveness(Some(&stale), Some(&sock), BOOT), Liveness::Dead);
    }

    #[test]
    fn an_identity_recorded_in_another_pid_namespace_is_maybe_alive_never_dead() {
        let me = identity_of(std::process::id() as i32, BOOT).unwrap().unwrap();
        assert_eq!(me.pid_ns, own_pid_namespace());
        let elsewhere = ProcessIdentity { pid_ns: Some(me.pid_ns.unwrap() ^ 1), ..me.clone() };
        match identity_liveness(&elsewhere, BOOT) {
            Liveness::MaybeAlive { reason } => assert!(reason.contains("PID namespace"), "{reason}"),
            other => panic!("{other:?}"),
        }
        // Even a pid that does not exist here: it may exist there.
        let gone = ProcessIdentity { pid: i32::MAX - 7, ..elsewhere.clone() };
        assert!(matches!(vmm_liveness(Some(&gone), None, BOOT), Liveness::MaybeAlive { .. }));
        assert!(confirm_identity(&elsewhere, BOOT).is_err(), "never confirmed, so never signalled");
        // Another boot is dead whatever the namespace.
        let old_boot = ProcessIdentity { boot_id: "earlier".into(), ..elsewhere };
        assert_eq!(identity_liveness(&old_boot, BOOT), Liveness::Dead);
    }

    /// Issue 18 finding 4: an identity recorded before namespaces were recorded (an older
    /// version) is judged by an agent in the host's PID namespace — its way out — and stays
    /// maybe alive (with the way out in the reason) for an agent anywhere else.
    #[test]
    fn an_identity_without_a_recorded_namespace_is_judged_in_the_host_namespace_only() {
        let me = identity_of(std::process::id() as i32, BOOT).unwrap().unwrap();
        let legacy = ProcessIdentity { pid_ns: None, ..me };
        assert_eq!(foreign_namespace_from(&legacy, Some(INITIAL_PID_NS)), None, "the host's namespace judges it");
        let why = foreign_namespace_from(&legacy, Some(INITIAL_PID_NS + 5)).expect("maybe alive elsewhere");
        assert!(why.contains("host's PID namespace") && why.contains("reboot"), "names the way out: {why}");
        assert!(foreign_namespace_from(&legacy, None).is_some());
    }

    #[test]
    fn the_own_pid_namespace_is_read() {
        assert!(own_pid_namespace().is_some());
    }

    #[test]
    fn boottime_advances() {
        let a = boottime_ms();
        std::thread::sleep(Duration::from_millis(20));
        let b = boottime_ms();
        assert!(a > 0 && b >= a + 15, "{a} {b}");
    }
}
