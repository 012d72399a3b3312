//! # hypervisor::qemu — the QEMU command line and process start
//!
//! [`qemu_command_line`] is pure; [`spawn`] starts QEMU in its own process group, records
//! its identity, reaps it from a thread, and returns once it answers on QMP.
//!
//! **Hold-fd (simulated host).** The VFIO group node is opened in the child between fork
//! and exec, so the handle belongs to QEMU's own pid from the start and QEMU is the only
//! holder for its whole life (NVIDIA-HOST.md §8 "Under the simulator"). The node is passed
//! as fd 3 in an fdset (`-add-fd fd=3,set=1`) **and** as fd 4, which QEMU never touches:
//! QEMU closes fdset fds that no device has dup'ed when the last QMP monitor disconnects
//! while the VM runs (`monitor_fdset_cleanup` in QEMU 7.2 `monitor/misc.c`:
//! `QLIST_EMPTY(&mon_fdset->dup_fds) && mon_refcount == 0 && runstate_is_running()`), so
//! fd 3 alone would be dropped after the first QMP session.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::qmp::QmpClient;
use super::HypervisorError;
use crate::host::proc::{self as hostproc, ProcessIdentity};

/// How long [`spawn`] waits for QEMU to answer QMP `query-status`.
pub const QMP_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// `oom_score_adj` given to QEMU (best effort): a kill from the OOM killer during vGPU
/// initialisation wedges the VF (NVIDIA-HOST.md §9).
pub const QEMU_OOM_SCORE_ADJ: i32 = -900;

/// The fd the VFIO node is passed on in QEMU's fdset (`-add-fd fd=3`).
pub const HOLD_FD_FDSET: i32 = 3;

/// A second inherited copy of the VFIO node that QEMU never closes (see the module docs).
pub const HOLD_FD_KEEP: i32 = 4;

/// How the VM gets its VFIO device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VfioAttach {
    /// Production: `-device vfio-pci,sysfsdev=<sysfsdev>`. For a VF:
    /// `<host_root>/sys/bus/pci/devices/<VF>`; for an mdev:
    /// `<host_root>/sys/bus/mdev/devices/<uuid>` (NVIDIA-HOST.md §8).
    Device {
        /// The device's sysfs directory.
        sysfsdev: PathBuf,
    },
    /// Simulated host: QEMU holds the VFIO group node `node` (`<host_root>/dev/vfio/<G>`)
    /// open for its whole life, opened in the child before exec.
    HoldFd {
        /// The group node to open `O_RDWR`.
        node: PathBuf,
    },
}

/// Everything needed to start one QEMU VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSpec {
    /// Instance id, passed as `-uuid` (the NVIDIA vGPU manager reads it, NVIDIA-HOST.md §8).
    pub id: uuid::Uuid,
    /// Instance name, passed as `-name`.
    pub name: String,
    /// Number of vCPUs (`-smp`).
    pub vcpus: u32,
    /// Guest memory in MiB (`-m`).
    pub memory_mib: u64,
    /// Direct-boot kernel (`-kernel`); `None` boots the firmware (used by tests).
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk (`-initrd`), only with a kernel.
    pub initrd: Option<PathBuf>,
    /// Kernel command line (`-append`), only with a kernel; empty = none.
    pub cmdline: String,
    /// Accelerator: `tcg` or `kvm`.
    pub accel: String,
    /// Start with the vCPUs stopped (`-S`); resume with QMP `cont`.
    pub paused: bool,
    /// The QEMU binary, e.g. `/usr/bin/qemu-system-x86_64`.
    pub qemu_binary: PathBuf,
    /// The instance directory: `serial.log`, `qmp.sock` and `qemu.log` live here.
    pub run_dir: PathBuf,
    /// The VFIO device, if any.
    pub vfio: Option<VfioAttach>,
}

impl VmSpec {
    /// `<run_dir>/qmp.sock`.
    pub fn qmp_socket(&self) -> PathBuf {
        self.run_dir.join("qmp.sock")
    }

    /// `<run_dir>/serial.log`.
    pub fn serial_log(&self) -> PathBuf {
        self.run_dir.join("serial.log")
    }

    /// `<run_dir>/qemu.log` (QEMU's stdout and stderr).
    pub fn qemu_log(&self) -> PathBuf {
        self.run_dir.join("qemu.log")
    }
}

/// Escapes a value for QEMU's option syntax (`key=value,key=value`): commas are doubled.
fn opt_escape(s: &str) -> String {
    s.replace(',', ",,")
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The fdset opaque string for a held node: `vfio-group-<basename>`.
fn hold_fd_opaque(node: &Path) -> String {
    let g = node.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    format!("vfio-group-{g}")
}

/// QEMU's arguments for `spec` (without the binary itself). Pure.
///
/// Shape: `-machine q35,accel=<accel> -cpu max|host -m <MiB> -smp <n> -nodefaults
/// -no-user-config -display none -uuid <id> -name <name> [-S] [-kernel .. [-initrd ..]
/// [-append ..]] -serial file:<run_dir>/serial.log -qmp unix:<run_dir>/qmp.sock,server=on,wait=off`
/// then the VFIO arguments: `-device vfio-pci,sysfsdev=<path>` or, for hold-fd,
/// `-add-fd fd=3,set=1,opaque=vfio-group-<G>`. `-cpu host` only with `kvm` (TCG cannot
/// emulate the host CPU).
pub fn qemu_command_line(spec: &VmSpec) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    push(&["-machine", &format!("q35,accel={}", opt_escape(&spec.accel))]);
    push(&["-cpu", if spec.accel == "kvm" { "host" } else { "max" }]);
    push(&["-m", &spec.memory_mib.to_string()]);
    push(&["-smp", &spec.vcpus.to_string()]);
    push(&["-nodefaults", "-no-user-config", "-display", "none"]);
    push(&["-uuid", &spec.id.to_string()]);
    push(&["-name", &opt_escape(&spec.name)]);
    if spec.paused {
        push(&["-S"]);
    }
    if let Some(kernel) = &spec.kernel {
        push(&["-kernel", &path_str(kernel)]);
        if let Some(initrd) = &spec.initrd {
            push(&["-initrd", &path_str(initrd)]);
        }
        if !spec.cmdline.is_empty() {
            push(&["-append", &spec.cmdline]);
        }
    }
    push(&["-serial", &format!("file:{}", path_str(&spec.serial_log()))]);
    push(&["-qmp", &format!("unix:{},server=on,wait=off", opt_escape(&path_str(&spec.qmp_socket())))]);
    match &spec.vfio {
        None => {}
        Some(VfioAttach::Device { sysfsdev }) => {
            push(&["-device", &format!("vfio-pci,sysfsdev={}", opt_escape(&path_str(sysfsdev)))])
        }
        Some(VfioAttach::HoldFd { node }) => {
            push(&["-add-fd", &format!("fd={HOLD_FD_FDSET},set=1,opaque={}", opt_escape(&hold_fd_opaque(node)))])
        }
    }
    a
}

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
    /// Its identity (pid, start time, the host root's boot id); persist it.
    pub identity: ProcessIdentity,
    /// Its QMP socket (`<run_dir>/qmp.sock`); persist it as the control socket.
    pub qmp_socket: PathBuf,
    /// Its exit status once reaped (only meaningful inside this agent process).
    pub exit: ExitWatch,
}

/// The last `max` bytes of `path` from byte `from` on, lossily decoded and trimmed.
fn log_tail(path: &Path, from: u64, max: u64) -> String {
    let Ok(mut f) = File::open(path) else {
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
    let cpath = CString::new(node.as_os_str().as_bytes()).map_err(|_| HypervisorError::StartFailed {
        reason: format!("the VFIO node path {} contains a NUL byte", node.display()),
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

/// Starts QEMU for `spec` and waits until it answers QMP `query-status`.
///
/// QEMU runs in its own process group with stdin from `/dev/null` and stdout/stderr
/// appended to `<run_dir>/qemu.log`; its `oom_score_adj` is set to [`QEMU_OOM_SCORE_ADJ`]
/// when permitted. Its identity is captured before the reaper thread can reap it, tagged
/// with `host_boot_id` (the host root's boot id).
///
/// Errors: [`HypervisorError::StartFailed`] when the spec is invalid, the control socket is
/// owned by a live process, the exec or the hold-fd open fails (e.g. ENODEV), QEMU exits
/// early (the tail of `qemu.log` is in the reason), or QMP is not up within
/// [`QMP_READY_TIMEOUT`]. A QEMU that started is stopped through the kill path before
/// returning; if that fails, its error ([`HypervisorError::KillFailed`] /
/// [`HypervisorError::LivenessUnknown`]) is returned instead, so that on `Err` either no
/// VMM is left or the caller is told one is.
pub fn spawn(spec: &VmSpec, host_boot_id: &str) -> Result<RunningVmm, HypervisorError> {
    spawn_with_timeout(spec, host_boot_id, QMP_READY_TIMEOUT)
}

fn start_failed(reason: impl Into<String>) -> HypervisorError {
    HypervisorError::StartFailed { reason: reason.into() }
}

/// [`spawn`] with an explicit QMP readiness timeout.
pub fn spawn_with_timeout(
    spec: &VmSpec,
    host_boot_id: &str,
    qmp_timeout: Duration,
) -> Result<RunningVmm, HypervisorError> {
    if spec.accel != "tcg" && spec.accel != "kvm" {
        return Err(start_failed(format!("accelerator `{}` is not tcg or kvm", spec.accel)));
    }
    std::fs::create_dir_all(&spec.run_dir)?;
    let qmp_socket = spec.qmp_socket();
    match hostproc::unix_listener_owners(&qmp_socket) {
        Ok(owners) if owners.is_empty() => {}
        Ok(owners) => {
            return Err(start_failed(format!(
                "control socket {} is still owned by process {}",
                qmp_socket.display(),
                owners[0]
            )))
        }
        Err(e) => {
            return Err(HypervisorError::LivenessUnknown {
                reason: format!("the owner of control socket {} could not be determined: {e}", qmp_socket.display()),
            })
        }
    }
    match std::fs::remove_file(&qmp_socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }

    let log_path = spec.qemu_log();
    let log = OpenOptions::new().create(true).append(true).open(&log_path)?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let log_err = log.try_clone()?;

    let args = qemu_command_line(spec);
    let mut cmd = Command::new(&spec.qemu_binary);
    cmd.args(&args).stdin(Stdio::null()).stdout(Stdio::from(log)).stderr(Stdio::from(log_err)).process_group(0);
    if let Some(VfioAttach::HoldFd { node }) = &spec.vfio {
        add_hold_fd(&mut cmd, node)?;
    }
    tracing::info!(instance.id = %spec.id, binary = %spec.qemu_binary.display(), args = %args.join(" "), "starting QEMU");
    let child = cmd.spawn().map_err(|e| match &spec.vfio {
        // The pre_exec open's errno comes back as the spawn error.
        Some(VfioAttach::HoldFd { node }) => start_failed(format!(
            "starting {} holding the VFIO node {} failed: {e}",
            spec.qemu_binary.display(),
            node.display()
        )),
        _ => start_failed(format!("starting {} failed: {e}", spec.qemu_binary.display())),
    })?;
    let pid = child.id() as i32;

    // The child is not reaped yet, so its /proc entry exists even if it already exited.
    let identity = match hostproc::identity_of(pid, host_boot_id) {
        Ok(Some(id)) => id,
        Ok(None) => return Err(start_failed(format!("process {pid} vanished before its identity was read"))),
        Err(e) => return Err(start_failed(format!("the identity of process {pid} could not be read: {e}"))),
    };
    if let Err(e) = hostproc::set_oom_score_adj(pid, QEMU_OOM_SCORE_ADJ) {
        tracing::debug!(pid, error = %e, "could not lower QEMU's oom_score_adj");
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

    let running = RunningVmm { identity, qmp_socket, exit };
    match wait_for_qmp(&running, qmp_timeout) {
        Ok(()) => Ok(running),
        Err(reason) => {
            let tail = log_tail(&log_path, log_start, 2048);
            let reason = if tail.is_empty() { reason } else { format!("{reason}; qemu.log: {tail}") };
            if running.exit.exited().is_none() {
                if let Err(e) = super::stop::kill(
                    &running.identity,
                    &running.qmp_socket,
                    super::stop::DEFAULT_TERM_GRACE,
                    host_boot_id,
                ) {
                    tracing::debug!(pid, start_error = %reason, "a VMM that failed to start could not be stopped");
                    return Err(e);
                }
            }
            Err(start_failed(reason))
        }
    }
}

/// Polls (backoff 5 ms doubling to 100 ms) until QMP answers `query-status`, which QEMU
/// dispatches from its main loop, i.e. only once the machine is initialised and its signal
/// handlers are installed. The socket alone is not enough: QEMU creates it before loading
/// the kernel and may still exit after accepting a connection. Fails fast when the process
/// exits. Returns the failure as one sentence.
fn wait_for_qmp(vmm: &RunningVmm, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut step = Duration::from_millis(5);
    loop {
        if let Some(status) = vmm.exit.exited() {
            return Err(format!("QEMU exited during start ({status})"));
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        let io_timeout = remaining.max(Duration::from_millis(100));
        let attempt = QmpClient::connect(&vmm.qmp_socket, io_timeout).and_then(|mut qmp| qmp.query_status());
        match attempt {
            Ok(status) => {
                tracing::debug!(pid = vmm.identity.pid, %status, "QMP is up");
                return Ok(());
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "QMP on {} did not answer within {} ms ({e})",
                    vmm.qmp_socket.display(),
                    timeout.as_millis()
                ))
            }
            Err(_) => {}
        }
        // Sleep on the exit watch so an early exit ends the wait at once.
        let _ = vmm.exit.wait_timeout(step);
        step = (step * 2).min(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(vfio: Option<VfioAttach>) -> VmSpec {
        VmSpec {
            id: uuid::Uuid::parse_str("6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d").unwrap(),
            name: "vm-a".into(),
            vcpus: 2,
            memory_mib: 512,
            kernel: Some("/images/vmlinuz".into()),
            initrd: Some("/images/initrd.img".into()),
            cmdline: "console=ttyS0".into(),
            accel: "tcg".into(),
            paused: false,
            qemu_binary: "/usr/bin/qemu-system-x86_64".into(),
            run_dir: "/var/lib/gpuvisor/instances/x".into(),
            vfio,
        }
    }

    fn has_pair(args: &[String], flag: &str, value: &str) -> bool {
        args.windows(2).any(|w| w[0] == flag && w[1] == value)
    }

    #[test]
    fn command_line_always_carries_uuid_and_name() {
        let args = qemu_command_line(&spec(None));

        assert!(has_pair(&args, "-uuid", "6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"));
        assert!(has_pair(&args, "-name", "vm-a"));
        assert!(has_pair(&args, "-machine", "q35,accel=tcg"));
        assert!(has_pair(&args, "-cpu", "max"));
        assert!(has_pair(&args, "-m", "512"));
        assert!(has_pair(&args, "-smp", "2"));
        assert!(has_pair(&args, "-display", "none"));
        assert!(args.contains(&"-nodefaults".to_string()));
        assert!(args.contains(&"-no-user-config".to_string()));
        assert!(has_pair(&args, "-kernel", "/images/vmlinuz"));
        assert!(has_pair(&args, "-initrd", "/images/initrd.img"));
        assert!(has_pair(&args, "-append", "console=ttyS0"));
        assert!(has_pair(&args, "-serial", "file:/var/lib/gpuvisor/instances/x/serial.log"));
        assert!(has_pair(&args, "-qmp", "unix:/var/lib/gpuvisor/instances/x/qmp.sock,server=on,wait=off"));
        assert!(!args.contains(&"-S".to_string()));
        assert!(!args.iter().any(|a| a == "-device" || a == "-add-fd"));
    }

    #[test]
    fn kvm_uses_the_host_cpu_and_paused_adds_dash_s() {
        let mut s = spec(None);
        s.accel = "kvm".into();
        s.paused = true;
        s.kernel = None;

        let args = qemu_command_line(&s);

        assert!(has_pair(&args, "-cpu", "host"));
        assert!(has_pair(&args, "-machine", "q35,accel=kvm"));
        assert!(args.contains(&"-S".to_string()));
        assert!(!args.iter().any(|a| a == "-kernel" || a == "-append" || a == "-initrd"));
    }

    #[test]
    fn device_attach_passes_sysfsdev() {
        let args =
            qemu_command_line(&spec(Some(VfioAttach::Device { sysfsdev: "/sys/bus/pci/devices/0001:81:00.4".into() })));

        assert!(has_pair(&args, "-device", "vfio-pci,sysfsdev=/sys/bus/pci/devices/0001:81:00.4"));
    }

    #[test]
    fn mdev_attach_passes_the_mdev_directory_and_escapes_commas() {
        let args =
            qemu_command_line(&spec(Some(VfioAttach::Device { sysfsdev: "/sim,1/sys/bus/mdev/devices/aa-bb".into() })));

        assert!(has_pair(&args, "-device", "vfio-pci,sysfsdev=/sim,,1/sys/bus/mdev/devices/aa-bb"));
    }

    #[test]
    fn hold_fd_attach_adds_fd_3_to_an_fdset() {
        let args = qemu_command_line(&spec(Some(VfioAttach::HoldFd { node: "/sim/dev/vfio/41".into() })));

        assert!(has_pair(&args, "-add-fd", "fd=3,set=1,opaque=vfio-group-41"));
        assert!(!args.contains(&"-device".to_string()));
    }
}
