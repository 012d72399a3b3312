//! # hypervisor::process — what every VMM process gets
//!
//! [`spawn`] is the one start sequence for both drivers: refuse a control socket that a
//! live process still owns, start the binary in its own process group with stdin from
//! `/dev/null` and stdout/stderr appended to the VMM log, capture its identity before the
//! reaper thread can reap it, lower its `oom_score_adj`, then hand it to the driver's
//! [`Driver::bring_up`](super::Driver::bring_up). A start that fails once the process
//! exists stops it through the kill path before answering.
//!
//! **Hold-fd (simulated host).** The VFIO group node is opened in the child between fork
//! and exec, so the handle belongs to the VMM's own pid from the start and the VMM is the
//! only holder for its whole life (docs/design/host.md §8 "Under the simulator"). The node is
//! placed on fd [`HOLD_FD_FDSET`] (QEMU: `-add-fd fd=3,set=1`) **and** on
//! [`HOLD_FD_KEEP`], which the VMM never touches (see [`super::qemu`] for why QEMU needs
//! the second copy).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::{HypervisorError, NicBackend, StartFailure, VfioAttach, VmSpec, VmmError};
use crate::host::proc::{self as hostproc, ProcessIdentity};

/// `oom_score_adj` given to every VMM (best effort): a kill from the OOM killer during vGPU
/// initialisation wedges the VF (docs/design/host.md §9).
pub const VMM_OOM_SCORE_ADJ: i32 = -900;

/// The fd the VFIO node is passed on (QEMU's fdset: `-add-fd fd=3`).
pub const HOLD_FD_FDSET: i32 = 3;

/// A second inherited copy of the VFIO node that the VMM never closes.
pub const HOLD_FD_KEEP: i32 = 4;

/// The exit status of a spawned VMM, filled in by its reaper thread.
#[derive(Debug, Clone, Default)]
pub struct ExitWatch {
    inner: Arc<(Mutex<Option<ExitStatus>>, Condvar)>,
}

impl ExitWatch {
    /// The exit status, once the VMM has exited and been reaped.
    pub fn exited(&self) -> Option<ExitStatus> {
        match self.inner.0.lock() {
            Ok(g) => *g,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// Waits up to `timeout` for the exit; returns the status if it came.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<ExitStatus> {
        let (lock, cvar) = &*self.inner;
        let guard = match lock.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let result = cvar.wait_timeout_while(guard, timeout, |s| s.is_none());
        match result {
            Ok((g, _)) => *g,
            Err(p) => *p.into_inner().0,
        }
    }

    fn set(&self, status: ExitStatus) {
        let (lock, cvar) = &*self.inner;
        match lock.lock() {
            Ok(mut g) => *g = Some(status),
            Err(p) => *p.into_inner() = Some(status),
        }
        cvar.notify_all();
    }
}

/// A started VMM.
#[derive(Debug, Clone)]
pub struct RunningVmm {
    /// Its identity (pid, start time, the host root's boot id, PID namespace); persist it.
    pub identity: ProcessIdentity,
    /// Its control socket (QMP or the Cloud Hypervisor API); persist it.
    pub control_socket: PathBuf,
    /// Its exit status once reaped (only meaningful inside this agent process).
    pub exit: ExitWatch,
}

/// The last `max` bytes of the VMM log `path` from byte `from` on, lossily decoded and
/// trimmed; empty when it is not the agent's own file ([`crate::own_file`]).
pub fn log_tail(path: &Path, from: u64, max: u64) -> String {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return String::new();
    };
    let Ok(Ok(mut f)) = crate::own_file::open(dir, name, false) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = from.max(len.saturating_sub(max));
    if f.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim().to_string()
}

/// Adds the hold-fd `pre_exec` hook: open `node` O_RDWR in the child and place it on fds
/// [`HOLD_FD_FDSET`] and [`HOLD_FD_KEEP`] (both inherited across exec).
fn add_hold_fd(cmd: &mut Command, node: &Path) -> Result<(), HypervisorError> {
    let cpath = CString::new(node.as_os_str().as_bytes()).map_err(|_| {
        HypervisorError::start_failed(format!("the VFIO node path {} contains a NUL byte", node.display()))
    })?;
    // SAFETY: the closure runs in the child between fork and exec and only calls
    // async-signal-safe functions (open, fcntl, dup2, close) on data prepared before fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(cpath.as_ptr(), libc::O_RDWR);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Move it above the target fds first, so dup2 never clobbers it.
            let high = libc::fcntl(fd, libc::F_DUPFD, 10);
            if high < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(fd);
            for target in [HOLD_FD_FDSET, HOLD_FD_KEEP] {
                if libc::dup2(high, target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            libc::close(high);
            Ok(())
        });
    }
    Ok(())
}

/// Adds the tap `pre_exec` hook: the agent's tap fd of NIC `i` is placed on fd
/// [`super::tap_fd`]`(i)` in the child (inherited across exec). Registered before the
/// hold-fd hook, which only uses fds 3 and 4 (below every tap fd) and temporaries it picks
/// free. The sources are first copied above every target (close-on-exec), so placing one
/// tap never clobbers the source of another.
fn add_tap_fds(cmd: &mut Command, spec: &VmSpec) {
    let taps: Vec<(i32, i32)> = spec
        .nics
        .iter()
        .enumerate()
        .filter_map(|(i, n)| match &n.backend {
            NicBackend::Tap { agent_fd, .. } => Some((*agent_fd, super::tap_fd(i))),
            NicBackend::User { .. } => None,
        })
        .collect();
    if taps.is_empty() {
        return;
    }
    // SAFETY: the closure runs in the child between fork and exec and only calls
    // async-signal-safe functions (fcntl, dup2) on data prepared before fork; it allocates
    // nothing (a fixed array holds the copies).
    unsafe {
        cmd.pre_exec(move || {
            let mut high = [-1i32; crate::network::MAX_NICS];
            for (k, (src, _)) in taps.iter().enumerate().take(high.len()) {
                high[k] = libc::fcntl(*src, libc::F_DUPFD_CLOEXEC, 64);
                if high[k] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (k, (_, target)) in taps.iter().enumerate().take(high.len()) {
                // dup2 clears close-on-exec on the target.
                if libc::dup2(high[k], *target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// The VMM log `dir/name` opened for appending: the agent's own file, made when missing; a
/// file that is not the agent's own there is replaced ([`crate::own_file`]).
fn open_vmm_log(dir: &Path, name: &str) -> Result<File, HypervisorError> {
    match crate::own_file::open(dir, name, true)? {
        Ok(f) => return Ok(f),
        Err(crate::own_file::Entry::Missing) => {}
        Err(other) => {
            tracing::warn!(file = %dir.join(name).display(), found = %other.describe(), "the VMM log was not the agent's own file; replaced");
            crate::own_file::remove(dir, name)?;
        }
    }
    Ok(OpenOptions::new().append(true).create_new(true).read(true).open(dir.join(name))?)
}

/// Refuses a control socket that a live process still listens on, then removes a stale
/// socket file.
fn take_control_socket(socket: &Path) -> Result<(), HypervisorError> {
    match hostproc::unix_listener_owners(socket) {
        Ok(owners) if owners.is_empty() => {}
        Ok(owners) => {
            return Err(HypervisorError::start_failed(format!(
                "control socket {} is still owned by process {}",
                socket.display(),
                owners[0]
            )))
        }
        Err(e) => {
            return Err(HypervisorError::LivenessUnknown {
                reason: format!("the owner of control socket {} could not be determined: {e}", socket.display()),
            })
        }
    }
    // Whatever is at the name (a stale socket; a directory or link the VMM may have left).
    remove_name(socket)
}

/// Removes whatever sits at `path` in the VMM directory ([`crate::own_file::remove`]: a
/// directory whole, a link never followed).
fn remove_name(path: &Path) -> Result<(), HypervisorError> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Err(HypervisorError::start_failed(format!("{} is not a file in a directory", path.display())));
    };
    crate::own_file::remove(dir, name).map_err(HypervisorError::from)
}

/// Starts the VMM for `spec` and brings its VM up (see the module docs); `ready_timeout`
/// bounds each readiness step ([`Driver::bring_up`](super::Driver::bring_up)). The identity
/// is tagged with `host_boot_id` (the host root's boot id).
///
/// Errors: [`HypervisorError::StartFailed`] when the spec is invalid, the control socket
/// is owned by a live process, the exec or the hold-fd open fails (e.g. ENODEV), the VMM
/// exits early, does not answer within the timeout, or its API refuses the VM (the tail of
/// the VMM log is in the reason, the refused request in `api`). A VMM that started is
/// stopped through the kill path before returning; if that fails, its error
/// ([`HypervisorError::KillFailed`] / [`HypervisorError::LivenessUnknown`]) is returned
/// instead, so that on `Err` either no VMM is left or the caller is told one is.
pub fn spawn(spec: &VmSpec, host_boot_id: &str, ready_timeout: Duration) -> Result<RunningVmm, HypervisorError> {
    let driver = spec.hypervisor.driver();
    let args = driver.command_line(spec)?;
    std::fs::create_dir_all(&spec.log_dir)?;
    let confine = spec.confine.as_ref();
    let identity = confine.map(|c| &c.identity);
    let vmm_files = spec.vmm_files();
    let view = match confine {
        Some(c) => {
            let names: Vec<(&str, bool)> = vmm_files.iter().map(|(n, c)| (n.as_str(), *c)).collect();
            let replaced =
                super::confine::prepare_run_dir(&c.identity, &spec.log_dir, &spec.run_dir, &names).map_err(|e| {
                    HypervisorError::start_failed(format!("the VMM directory cannot be given to the VMM: {e}"))
                })?;
            for (file, what) in replaced {
                tracing::warn!(instance.id = %spec.id, instance.name = %spec.name, file = %file.display(), found = %what,
                    "a file that was not the agent's own (a VMM may have planted it) was replaced");
            }
            for node in &spec.device_nodes {
                super::confine::grant_device(&c.identity, node).map_err(|e| {
                    HypervisorError::start_failed(format!("{} cannot be given to the VMM: {e}", node.display()))
                })?;
            }
            let mut v = c.view.clone();
            v.writable.push(spec.run_dir.clone());
            std::fs::create_dir_all(&v.root)?;
            Some(crate::host::vmm_view::VmmView::plan(&v).map_err(|e| {
                HypervisorError::start_failed(format!("the VMM's view of the filesystem cannot be planned: {e}"))
            })?)
        }
        None => {
            std::fs::create_dir_all(&spec.run_dir)?;
            None
        }
    };
    let control_socket = spec.control_socket();
    take_control_socket(&control_socket)?;
    // The console sockets of an earlier boot (the control socket's check proved its VMM gone).
    match driver.serial_port() {
        super::SerialPort::Served => remove_name(&spec.console_socket())?,
        super::SerialPort::Relayed => remove_name(&spec.serial_socket())?,
    }

    let log_path = spec.vmm_log();
    let log = open_vmm_log(&spec.log_dir, driver.log_name())?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let log_err = log.try_clone()?;

    let mut cmd = Command::new(&spec.binary);
    cmd.args(&args).stdin(Stdio::null()).stdout(Stdio::from(log)).stderr(Stdio::from(log_err)).process_group(0);
    if driver.taps_at_exec() {
        add_tap_fds(&mut cmd, spec);
    }
    if let Some(VfioAttach::HoldFd { node }) = &spec.vfio {
        add_hold_fd(&mut cmd, node)?;
    }
    // After the hold-fd open (it needs root and the host's view): the cgroup, the view, the
    // identity, no_new_privs.
    super::confine::add_pre_exec(&mut cmd, identity, view, spec.cgroup_procs.as_deref())
        .map_err(HypervisorError::start_failed)?;
    let run_as = identity.map(|u| u.uid.to_string()).unwrap_or_else(|| "the agent's".into());
    tracing::info!(instance.id = %spec.id, hypervisor = %spec.hypervisor, binary = %spec.binary.display(),
        uid = %run_as, args = %args.join(" "), "starting the VMM");
    let child = cmd.spawn().map_err(|e| {
        // The pre_exec steps' errno comes back as the spawn error; the view's step is in the log.
        let tail = log_tail(&log_path, log_start, 1024);
        let tail = if tail.is_empty() { String::new() } else { format!(" ({}: {tail})", driver.log_name()) };
        match &spec.vfio {
            Some(VfioAttach::HoldFd { node }) => HypervisorError::start_failed(format!(
                "starting {} holding the VFIO node {} failed: {e}{tail}",
                spec.binary.display(),
                node.display()
            )),
            _ => HypervisorError::start_failed(format!(
                "starting {} as uid {run_as} failed: {e}{tail}",
                spec.binary.display()
            )),
        }
    })?;
    let pid = child.id() as i32;

    // The child is not reaped yet, so its /proc entry exists even if it already exited.
    let identity = match hostproc::identity_of(pid, host_boot_id) {
        Ok(Some(id)) => id,
        Ok(None) => {
            return Err(HypervisorError::start_failed(format!("process {pid} vanished before its identity was read")))
        }
        Err(e) => {
            return Err(HypervisorError::start_failed(format!("the identity of process {pid} could not be read: {e}")))
        }
    };
    if let Err(e) = hostproc::set_oom_score_adj(pid, VMM_OOM_SCORE_ADJ) {
        tracing::debug!(pid, error = %e, "could not lower the VMM's oom_score_adj");
    }

    let exit = ExitWatch::default();
    {
        let exit = exit.clone();
        let mut child = child;
        std::thread::Builder::new().name(format!("vmm-reaper-{pid}")).spawn(move || match child.wait() {
            Ok(status) => {
                tracing::info!(pid, %status, "VMM exited");
                exit.set(status);
            }
            Err(e) => tracing::error!(pid, error = %e, "waiting for the VMM failed"),
        })?;
    }

    let running = RunningVmm { identity, control_socket, exit };
    match driver.bring_up(&running, spec, ready_timeout) {
        Ok(()) => Ok(running),
        Err(StartFailure { reason, api }) => {
            let tail = log_tail(&log_path, log_start, 2048);
            let reason = if tail.is_empty() { reason } else { format!("{reason}; {}: {tail}", driver.log_name()) };
            if running.exit.exited().is_none() {
                if let Err(e) = super::stop::kill(
                    &running.identity,
                    &running.control_socket,
                    super::stop::DEFAULT_TERM_GRACE,
                    host_boot_id,
                ) {
                    tracing::debug!(pid, start_error = %reason, "a VMM that failed to start could not be stopped");
                    return Err(e);
                }
            }
            Err(HypervisorError::StartFailed { reason, api })
        }
    }
}

/// Polls `attempt` (backoff 5 ms doubling to 100 ms) until it answers `Ok`, the VMM exits
/// (fails at once, naming the exit status) or `timeout` passes (fails with the last error).
/// `what` names the wait in the error ("QMP on <socket>").
pub fn wait_answering<T, E: std::fmt::Display>(
    vmm: &RunningVmm,
    what: &str,
    timeout: Duration,
    mut attempt: impl FnMut(Duration) -> Result<T, E>,
) -> Result<T, StartFailure> {
    let deadline = std::time::Instant::now() + timeout;
    let mut step = Duration::from_millis(5);
    loop {
        if let Some(status) = vmm.exit.exited() {
            return Err(format!("the VMM exited during start ({status})").into());
        }
        let remaining = deadline.saturating_duration_since(std::time::Instant::now());
        match attempt(remaining.max(Duration::from_millis(100))) {
            Ok(v) => return Ok(v),
            Err(e) if std::time::Instant::now() >= deadline => {
                return Err(format!("{what} did not answer within {} ms ({e})", timeout.as_millis()).into())
            }
            Err(_) => {}
        }
        // Sleep on the exit watch so an early exit ends the wait at once.
        let _ = vmm.exit.wait_timeout(step);
        step = (step * 2).min(Duration::from_millis(100));
    }
}

/// How long a probe of a VMM binary may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `binary args` (stdin from `/dev/null`) and answers the first line of its output, or
/// why it did not run: not found, not executable, a failing exit status, or no exit within
/// [`PROBE_TIMEOUT`] (it is then killed).
pub fn version_of(binary: &Path, args: &[&str]) -> Result<String, VmmError> {
    let command = || format!("{} {}", binary.display(), args.join(" "));
    let mut child = Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| VmmError::NotRunnable { binary: binary.to_path_buf(), source })?;
    let deadline = std::time::Instant::now() + PROBE_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(VmmError::ProbeTimeout { command: command() });
            }
            Err(source) => return Err(VmmError::ProbeWait { binary: binary.to_path_buf(), source }),
        }
    };
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    if !status.success() {
        return Err(VmmError::ProbeFailed { command: command(), status, stderr: err.trim().to_string() });
    }
    Ok(out.lines().next().unwrap_or("").trim().to_string())
}
