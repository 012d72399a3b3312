//! # hypervisor — the VMM interface and its two drivers
//!
//! The lifecycle never knows which hypervisor runs an instance: it builds a [`VmSpec`],
//! calls [`spawn`], [`stop`] or [`kill`], and reads the [`Driver`] of the instance's
//! [`HypervisorKind`] for the rest (control socket, VM state, graceful steps, probe).
//!
//! | file | what |
//! |---|---|
//! | [`process`] | what every VMM process gets: its own process group, the log file, the hold-fd, the identity captured before it can be reaped, the reaper thread, the rollback of a start that failed |
//! | [`qemu`], [`qmp`] | QEMU: the command line, QMP readiness, `system_powerdown`, `quit` |
//! | [`cloud_hypervisor`], [`ch_api`] | Cloud Hypervisor: `--api-socket`, its REST API (`vm.create`, `vm.boot`, `vm.info`, `vm.power-button`, `vmm.shutdown`) |
//! | [`stop`] | the graceful steps of the driver, then the shared SIGTERM-first kill path |
//! | [`confine`] | what a VMM process may do and see: its cgroup, its own view, its own uid/gid, `no_new_privs` |
//! | `vmm_tests`, `ch_tests` | the drivers against the real QEMU and Cloud Hypervisor binaries |
//!
//! Invariants kept here:
//! - a VMM runs in its own process group and is never left a zombie by the agent (a reaper
//!   thread waits for it);
//! - a signal is only ever sent to a process confirmed, just before the signal, to be the
//!   recorded VMM identity or the owner of its control socket listener — a recycled pid is
//!   never signalled (docs/design/lifecycle.md "Stop");
//! - the kill path is SIGTERM → grace → SIGKILL → 2 s → SIGKILL to the process group → 2 s,
//!   and a VMM still alive after that is an error ([`HypervisorError::KillFailed`]), never
//!   "dead" (docs/design/host.md §9);
//! - a start that fails after the process exists stops it through the kill path before it
//!   answers, or says that it could not ([`HypervisorError::KillFailed`]).
//!
//! The code is synchronous (std threads, blocking I/O); the RPC layer calls it through
//! `spawn_blocking`. The Cloud Hypervisor client runs each request on its own
//! current-thread runtime, so it must not be called from an async task.

pub mod ch_api;
pub mod cloud_hypervisor;
pub mod confine;
pub mod process;
pub mod qemu;
pub mod qmp;
pub mod stop;

#[cfg(test)]
mod ch_tests;
#[cfg(test)]
mod vmm_tests;

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvisor_sdk::{Capability, Framework};

pub use ch_api::ApiFailure;
pub use process::{spawn, ExitWatch, RunningVmm};
pub use qemu::qemu_command_line;
pub use qmp::{QmpClient, QmpError};
pub use stop::{kill, stop, StopOptions, StopReport};

/// The hypervisors gpuvisor knows. Serialised (records, views) as `qemu` and
/// `cloud-hypervisor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum HypervisorKind {
    /// QEMU (`qemu-system-x86_64`).
    Qemu,
    /// Cloud Hypervisor.
    CloudHypervisor,
}

impl HypervisorKind {
    /// Every kind, in a stable order.
    pub const ALL: [HypervisorKind; 2] = [HypervisorKind::Qemu, HypervisorKind::CloudHypervisor];

    /// The wire name: `qemu` or `cloud-hypervisor`.
    pub fn name(self) -> &'static str {
        match self {
            HypervisorKind::Qemu => "qemu",
            HypervisorKind::CloudHypervisor => "cloud-hypervisor",
        }
    }

    /// The kind for a wire name (`qemu`, `cloud-hypervisor`), `None` otherwise.
    pub fn from_name(name: &str) -> Option<HypervisorKind> {
        HypervisorKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// This kind's driver.
    pub fn driver(self) -> &'static dyn Driver {
        match self {
            HypervisorKind::Qemu => &qemu::Qemu,
            HypervisorKind::CloudHypervisor => &cloud_hypervisor::CloudHypervisor,
        }
    }

    /// What this hypervisor can carry (docs/design/host.md §8).
    ///
    /// Cloud Hypervisor never carries vGPUs (vendor VFIO or mdev): VFIO region reads fail
    /// and the guest driver never initialises (cloud-hypervisor#7572), and it has no
    /// QEMU-style `-uuid`, which the vGPU manager needs (cloud-hypervisor#5319).
    pub fn capabilities(self) -> &'static [Capability] {
        match self {
            HypervisorKind::Qemu => &[
                Capability::VendorVfio,
                Capability::Mdev,
                Capability::Passthrough,
                Capability::Standby,
                Capability::Snapshot,
            ],
            // Saved states are QEMU's in this version (cloud_hypervisor::NO_SAVED_STATE).
            HypervisorKind::CloudHypervisor => &[Capability::Passthrough],
        }
    }

    /// This kind's binary as configured (`qemu_binary`, `cloud_hypervisor_binary`).
    pub fn binary(self, cfg: &crate::config::Config) -> &Path {
        match self {
            HypervisorKind::Qemu => &cfg.qemu_binary,
            HypervisorKind::CloudHypervisor => &cfg.cloud_hypervisor_binary,
        }
    }

    /// Why this kind cannot boot an instance with a disk or through its firmware (`bios`,
    /// `uefi`), or `None` when it can.
    pub fn cannot_boot(self, disk: bool, firmware: bool) -> Option<&'static str> {
        match self {
            HypervisorKind::CloudHypervisor if disk || firmware => {
                Some("cloud-hypervisor instances boot their kernel directly and get no disk in this version")
            }
            _ => None,
        }
    }

    /// Why this kind cannot save a running VM's memory and device state (snapshots,
    /// standby), or `None`. The kinds that can list [`Capability::Snapshot`].
    pub fn cannot_save(self) -> Option<&'static str> {
        match self {
            HypervisorKind::Qemu => None,
            HypervisorKind::CloudHypervisor => Some(cloud_hypervisor::NO_SAVED_STATE),
        }
    }

    /// Why this kind cannot give an instance NICs or a cloud-init seed, or `None`.
    pub fn cannot_connect(self, nics: bool, seed: bool) -> Option<&'static str> {
        match self {
            HypervisorKind::CloudHypervisor if nics || seed => Some(cloud_hypervisor::NO_NICS_OR_SEED),
            _ => None,
        }
    }

    /// Why this kind cannot be handed a device the way this agent attaches VFIO devices
    /// (`vfio_attach`), or `None` when it can: Cloud Hypervisor takes a device by its sysfs
    /// path only (`vm.create` `devices[].path`, docs/design/cloud-hypervisor.md), never the VFIO group fd
    /// that `hold-fd` hands a VMM. Checked before anything is allocated, so such a create
    /// changes no driver binding.
    pub fn cannot_attach(self, framework: Option<Framework>, attach: crate::config::VfioAttach) -> Option<String> {
        match (self, framework, attach) {
            (HypervisorKind::CloudHypervisor, Some(_), crate::config::VfioAttach::HoldFd) => Some(
                "cloud-hypervisor takes a VFIO device by its sysfs path only, and this agent attaches devices with \
                 vfio_attach = \"hold-fd\" (a VFIO group fd handed to the VMM), which it cannot take"
                    .to_string(),
            ),
            _ => None,
        }
    }

    /// What this kind can carry on an agent that attaches VFIO devices with `attach`: the
    /// [`capabilities`](HypervisorKind::capabilities) table without the device kinds
    /// [`cannot_attach`](HypervisorKind::cannot_attach) refuses.
    pub fn capabilities_under(self, attach: crate::config::VfioAttach) -> Vec<Capability> {
        let devices = self.cannot_attach(Some(Framework::Passthrough), attach).is_none();
        self.capabilities()
            .iter()
            .copied()
            .filter(|c| devices || !matches!(c, Capability::VendorVfio | Capability::Mdev | Capability::Passthrough))
            .collect()
    }

    /// Why this kind cannot carry a device of `framework` (one sentence citing the reason),
    /// or `None` when it can ([`can_carry`]).
    pub fn cannot_carry(self, framework: Option<Framework>) -> Option<String> {
        if can_carry(self, framework) {
            return None;
        }
        let f = framework.map(|f| f.as_str()).unwrap_or("plain");
        Some(match (self, framework) {
            (HypervisorKind::CloudHypervisor, Some(Framework::VendorVfio)) => format!(
                "cloud-hypervisor cannot carry a {f} vGPU: vendor-specific VFIO VFs fail under it \
                 (cloud-hypervisor#7572), and the NVIDIA vGPU manager needs the VM UUID QEMU passes with \
                 -uuid (cloud-hypervisor#5319)"
            ),
            (HypervisorKind::CloudHypervisor, Some(Framework::Mdev)) => format!(
                "cloud-hypervisor cannot carry an {f} vGPU: the NVIDIA vGPU manager needs the VM UUID QEMU \
                 passes with -uuid (cloud-hypervisor#5319)"
            ),
            _ => format!("{} cannot carry a {f} device", self.name()),
        })
    }
}

impl std::fmt::Display for HypervisorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the lifecycle needs from a VMM driver beyond the shared process handling
/// ([`process`]) and kill path ([`stop`]). One implementation per [`HypervisorKind`].
///
/// Every method blocks; none is called from an async task.
pub trait Driver: Sync {
    /// Which hypervisor this is.
    fn kind(&self) -> HypervisorKind;

    /// The file name, in the instance directory, of the control socket whose listener
    /// proves which process is the VMM (QEMU's QMP socket, Cloud Hypervisor's API socket).
    fn control_socket_name(&self) -> &'static str;

    /// The file name, in the instance directory, that takes the VMM's stdout and stderr.
    fn log_name(&self) -> &'static str;

    /// The serial console's socket in the VMM directory, which `gpuvisor console` attaches
    /// to ([`CONSOLE_SOCKET`]), or `None` when this driver gives the console no socket.
    fn console_socket_name(&self) -> Option<&'static str>;

    /// Whether the VMM writes its serial log ([`SERIAL_LOG`]) appending (`O_APPEND`), so the
    /// agent may rotate it under the running VMM; a writer at its own offset would go on
    /// writing past a truncated file's end.
    fn serial_log_appends(&self) -> bool;

    /// The arguments (without the binary) that start the VMM for `spec`. Pure.
    ///
    /// Errors: [`HypervisorError::StartFailed`] for a spec this hypervisor cannot express.
    fn command_line(&self, spec: &VmSpec) -> Result<Vec<String>, HypervisorError>;

    /// Waits until the launched VMM answers on its control socket and brings the VM up
    /// (QEMU: `query-status` answers; Cloud Hypervisor: `vmm.ping`, `vm.create`, `vm.boot`,
    /// `vm.info` says `Running`), within `timeout` per step. Fails fast when the process
    /// exits. On `Err` the caller stops the process.
    fn bring_up(&self, vmm: &RunningVmm, spec: &VmSpec, timeout: Duration) -> Result<(), StartFailure>;

    /// Presses the guest's ACPI power button (QMP `system_powerdown`; `vm.power-button`).
    fn power_button(&self, socket: &Path, io_timeout: Duration) -> Result<(), String>;

    /// Asks the VMM process to exit (QMP `quit`; `vmm.shutdown`).
    fn quit(&self, socket: &Path, io_timeout: Duration) -> Result<(), String>;

    /// The VM state as the VMM reports it (QMP `query-status`'s `status`; `vm.info`'s
    /// `state`).
    fn vm_state(&self, socket: &Path, io_timeout: Duration) -> Result<String, String>;

    /// Pauses the VM and saves its memory and device state into `out` (QEMU: `stop`, then
    /// its migration stream to the fd), within `timeout`. The disks are flushed and
    /// consistent with the saved state once this returns; the VM stays paused until
    /// [`Driver::resume`] (or the VMM is stopped). On `Err` the VM may be paused: the caller
    /// resumes it.
    fn save(&self, socket: &Path, out: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> Result<(), String>;

    /// Resumes a VM paused by [`Driver::save`] (QMP `cont`).
    fn resume(&self, socket: &Path, io_timeout: Duration) -> Result<(), String>;

    /// Whether `binary` exists and runs: its version, or why not. Takes at most a few
    /// seconds; starts and stops a throw-away process where the hypervisor needs one
    /// (Cloud Hypervisor: `vmm.ping` on a temporary API socket).
    fn probe(&self, binary: &Path) -> Result<String, String>;
}

/// Why [`Driver::bring_up`] failed: one sentence, and the API's answer when there was one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartFailure {
    /// What went wrong.
    pub reason: String,
    /// The refused (or unanswered) API request, verbatim.
    pub api: Option<ApiFailure>,
}

impl From<String> for StartFailure {
    fn from(reason: String) -> StartFailure {
        StartFailure { reason, api: None }
    }
}

impl From<ApiFailure> for StartFailure {
    fn from(api: ApiFailure) -> StartFailure {
        StartFailure { reason: api.to_string(), api: Some(api) }
    }
}

/// The serial log's file name in the instance directory.
pub const SERIAL_LOG: &str = "serial.log";
/// The console socket's file name in the instance directory (QEMU).
pub const CONSOLE_SOCKET: &str = "console.sock";

/// How the VM gets its VFIO device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VfioAttach {
    /// Production: the device's sysfs directories. For a VF:
    /// `<host_root>/sys/bus/pci/devices/<VF>`; for an mdev:
    /// `<host_root>/sys/bus/mdev/devices/<uuid>`; for a passthrough GPU, every function of
    /// its IOMMU group, the GPU first (docs/design/host.md §8).
    Device {
        /// The sysfs directories, one per VFIO device.
        sysfsdevs: Vec<PathBuf>,
    },
    /// Simulated host: the VMM holds the VFIO group node `node` (`<host_root>/dev/vfio/<G>`)
    /// open for its whole life, opened in the child before exec.
    HoldFd {
        /// The group node to open `O_RDWR`.
        node: PathBuf,
    },
}

/// Everything needed to start one VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSpec {
    /// Which hypervisor runs it.
    pub hypervisor: HypervisorKind,
    /// Instance id: QEMU's `-uuid` (the NVIDIA vGPU manager reads it, docs/design/host.md §8),
    /// Cloud Hypervisor's `platform.system_uuid`.
    pub id: uuid::Uuid,
    /// Instance name (QEMU `-name`).
    pub name: String,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// Direct-boot kernel; `None` boots the firmware (QEMU only; used by tests).
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk, only with a kernel.
    pub initrd: Option<PathBuf>,
    /// Kernel command line, only with a kernel; empty = none.
    pub cmdline: String,
    /// QEMU's accelerator: `tcg` or `kvm` (Cloud Hypervisor always uses KVM).
    pub accel: String,
    /// Start with the vCPUs stopped (QEMU `-S`; resume with QMP `cont`).
    pub paused: bool,
    /// The VMM binary, e.g. `/usr/bin/qemu-system-x86_64` or `cloud-hypervisor`.
    pub binary: PathBuf,
    /// The VMM's directory (`<instance dir>/vmm`, its whole writable world): the serial
    /// log, the control and console sockets, the disk overlay, the UEFI variables, the seed.
    pub run_dir: PathBuf,
    /// The agent's instance directory, where the VMM log is written (the VMM never sees
    /// it: it writes the log through the inherited stdout and stderr).
    pub log_dir: PathBuf,
    /// The VFIO device, if any.
    pub vfio: Option<VfioAttach>,
    /// QEMU: run under its seccomp sandbox (`-sandbox on,…=deny`).
    pub sandbox: bool,
    /// The VMM's own identity and view ([`confine`]); `None` only in the drivers' unit
    /// tests (the VMM then runs as the agent, in the agent's view).
    pub confine: Option<confine::Confinement>,
    /// The `cgroup.procs` of the VM's cgroup, joined before exec; `None`: no cgroup.
    pub cgroup_procs: Option<PathBuf>,
    /// Device nodes the VMM opens itself (VFIO groups with `vfio_attach = "device"`): given
    /// to the VMM user's group before the spawn.
    pub device_nodes: Vec<PathBuf>,
    /// The virtio-net NICs, in guest order (empty: none).
    pub nics: Vec<NicSpec>,
    /// The cloud-init NoCloud seed (`cidata` ISO 9660 image), attached read-only.
    pub seed: Option<PathBuf>,
    /// The instance's disk: its qcow2 overlay (`<run_dir>/disk.qcow2`), if its image has a
    /// disk. QEMU only. Booted by the firmware when there is no `kernel`.
    pub disk: Option<PathBuf>,
    /// Boot through UEFI (OVMF) instead of SeaBIOS. QEMU only.
    pub uefi: Option<UefiPflash>,
    /// Resume a saved VM instead of booting it: the file (agent side, never in the VMM's
    /// view) that [`Driver::save`] wrote. The VMM waits for it (QEMU `-incoming defer`),
    /// [`Driver::bring_up`] hands it over and the VM runs on from where it was saved.
    pub incoming: Option<PathBuf>,
}

/// One virtio-net NIC of a [`VmSpec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicSpec {
    /// Its MAC, `52:54:00:xx:xx:xx` ([`crate::network::mac_address`]).
    pub mac: String,
    /// Where its packets go.
    pub backend: NicBackend,
}

/// The host side of a NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NicBackend {
    /// QEMU user-mode networking; `restrict`: the guest reaches only its forwards.
    User {
        /// `restrict=on`.
        restrict: bool,
        /// Host port forwards.
        forwards: Vec<crate::network::Forward>,
    },
    /// A tap the agent opened ([`crate::host::net::open_tap`]) and holds on fd `agent_fd`
    /// during the spawn; the VMM gets it on fd [`tap_fd`] of the NIC's index.
    Tap {
        /// The tap's interface name.
        ifname: String,
        /// The agent's fd of the tap (close-on-exec).
        agent_fd: i32,
    },
}

/// The first fd a VMM gets a tap on: NIC `i`'s tap is fd `TAP_FD_BASE + i` (after the
/// hold-fd's 3 and 4).
pub const TAP_FD_BASE: i32 = 5;

/// The fd in the VMM of the tap of NIC `index`.
pub fn tap_fd(index: usize) -> i32 {
    TAP_FD_BASE + index as i32
}

/// The two pflash units of a UEFI boot (OVMF's split firmware).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UefiPflash {
    /// The firmware code, read-only (`ovmf_code`, e.g. `/usr/share/OVMF/OVMF_CODE_4M.fd`).
    pub code: PathBuf,
    /// The instance's own writable variable store (`<run_dir>/efivars.fd`, a copy of
    /// `ovmf_vars`).
    pub vars: PathBuf,
}

#[cfg(test)]
impl VmSpec {
    /// A spec for unit tests (tests override fields with `..VmSpec::test_base()`): QEMU,
    /// 1 vCPU, 64 MiB, TCG, no kernel, device, NIC, seed, disk or confinement.
    pub(crate) fn test_base() -> VmSpec {
        VmSpec {
            hypervisor: HypervisorKind::Qemu,
            id: uuid::Uuid::nil(),
            name: "test".into(),
            vcpus: 1,
            memory_mib: 64,
            kernel: None,
            initrd: None,
            cmdline: String::new(),
            accel: "tcg".into(),
            paused: false,
            binary: PathBuf::from("qemu-system-x86_64"),
            run_dir: PathBuf::from("/nonexistent"),
            log_dir: PathBuf::from("/nonexistent"),
            vfio: None,
            sandbox: false,
            confine: None,
            cgroup_procs: None,
            device_nodes: Vec::new(),
            nics: vec![],
            seed: None,
            disk: None,
            uefi: None,
            incoming: None,
        }
    }
}

impl VmSpec {
    /// The control socket: `<run_dir>/qmp.sock` (QEMU) or `<run_dir>/ch.sock` (Cloud
    /// Hypervisor).
    pub fn control_socket(&self) -> PathBuf {
        self.run_dir.join(self.hypervisor.driver().control_socket_name())
    }

    /// `<run_dir>/serial.log`: everything the guest wrote on its serial console, appended
    /// across boots (capped by the agent's console log rotation).
    pub fn serial_log(&self) -> PathBuf {
        self.run_dir.join(SERIAL_LOG)
    }

    /// `<run_dir>/console.sock`: the serial console as a Unix socket (QEMU), for
    /// `gpuvisor console`.
    pub fn console_socket(&self) -> PathBuf {
        self.run_dir.join(CONSOLE_SOCKET)
    }

    /// The VMM's stdout and stderr: `<log_dir>/qemu.log` or `<log_dir>/cloud-hypervisor.log`.
    pub fn vmm_log(&self) -> PathBuf {
        self.log_dir.join(self.hypervisor.driver().log_name())
    }

    /// The files of `run_dir` the VMM itself writes (their names), each with whether it is
    /// created when missing: made root-owned and writable for its group before the spawn
    /// ([`confine::prepare_run_dir`]): the serial log (created), the disk overlay and the UEFI
    /// variable store.
    pub fn vmm_files(&self) -> Vec<(String, bool)> {
        let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let mut files = vec![(SERIAL_LOG.to_string(), true)];
        files.extend(self.disk.iter().map(|d| (name(d), false)));
        files.extend(self.uefi.iter().map(|u| (name(&u.vars), false)));
        files
    }
}

/// `true` if `kind` can carry an instance whose GPU uses `framework` (`None`: no GPU).
///
/// The single place the "which hypervisor carries which device" rule lives; request
/// validation rejects `false` with `hypervisor_unsupported` before anything is allocated.
pub fn can_carry(kind: HypervisorKind, framework: Option<Framework>) -> bool {
    match framework {
        None => true,
        Some(f) => kind.capabilities().contains(&Capability::for_framework(f)),
    }
}

/// Errors of the hypervisor drivers. Messages are one sentence; causes are in `source`.
#[derive(Debug, thiserror::Error)]
pub enum HypervisorError {
    /// The VMM could not be started (spawn failed, it exited early, its control socket
    /// never came up, or its API refused the VM). `reason` includes the tail of the VMM's
    /// log when there is one.
    #[error("the VMM failed to start: {reason}")]
    StartFailed {
        /// What went wrong.
        reason: String,
        /// The VMM API request that was refused or not answered, verbatim.
        api: Option<ApiFailure>,
    },
    /// The VMM outlived SIGTERM, SIGKILL and SIGKILL to its process group (stuck in the
    /// kernel); nothing may be torn down.
    #[error("VMM process {pid} is still alive after SIGKILL to it and its process group")]
    KillFailed {
        /// The live process.
        pid: i32,
    },
    /// Whether the VMM is alive could not be decided (docs/design/lifecycle.md "provably dead").
    #[error("VMM liveness cannot be decided: {reason}")]
    LivenessUnknown {
        /// Why.
        reason: String,
    },
    /// A Cloud Hypervisor API request failed.
    #[error("{0}")]
    Api(ApiFailure),
    /// A QMP exchange failed.
    #[error("QMP exchange failed")]
    Qmp(#[from] QmpError),
    /// An I/O error outside QMP (run directory, log file).
    #[error("VMM I/O failed")]
    Io(#[from] std::io::Error),
}

impl HypervisorError {
    /// [`HypervisorError::StartFailed`] without an API answer.
    pub fn start_failed(reason: impl Into<String>) -> HypervisorError {
        HypervisorError::StartFailed { reason: reason.into(), api: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 20 part 4: what differs between hypervisors lives in `hypervisor/`. Outside it,
    /// no code branches on a particular kind (`== HypervisorKind::Qemu`, a `match` arm on
    /// one): it asks the kind or its driver. Test code and test fixtures may name one.
    #[test]
    fn no_code_outside_hypervisor_branches_on_a_particular_hypervisor() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut found = Vec::new();
        let mut stack = vec![src.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    if p != src.join("hypervisor") {
                        stack.push(p);
                    }
                    continue;
                }
                let text = std::fs::read_to_string(&p).unwrap();
                // Unit tests sit at the end of a file.
                let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
                for (n, line) in code.lines().enumerate() {
                    let l = line.trim();
                    let kinds = ["HypervisorKind::Qemu", "HypervisorKind::CloudHypervisor"];
                    let branches = kinds.iter().any(|k| {
                        l.contains(&format!("== {k}"))
                            || l.contains(&format!("!= {k}"))
                            || l.contains(&format!("== crate::hypervisor::{k}"))
                            || l.contains(&format!("!= crate::hypervisor::{k}"))
                            || (l.contains(k) && l.contains("=>"))
                    });
                    if branches && !l.starts_with("//") {
                        found.push(format!("{}:{}: {l}", p.display(), n + 1));
                    }
                }
            }
        }
        assert!(found.is_empty(), "branches on a hypervisor outside hypervisor/:\n{}", found.join("\n"));
    }

    #[test]
    fn a_kind_saves_state_exactly_when_it_lists_the_snapshot_and_standby_capabilities() {
        for k in HypervisorKind::ALL {
            let listed = k.capabilities().contains(&Capability::Snapshot);
            assert_eq!(listed, k.capabilities().contains(&Capability::Standby), "{k}");
            assert_eq!(k.cannot_save().is_none(), listed, "{k}");
        }
    }

    #[test]
    fn only_a_kind_with_a_console_socket_and_an_appending_serial_log_is_attached_and_rotated() {
        assert_eq!(HypervisorKind::Qemu.driver().console_socket_name(), Some(CONSOLE_SOCKET));
        assert!(HypervisorKind::Qemu.driver().serial_log_appends());
        assert_eq!(HypervisorKind::CloudHypervisor.driver().console_socket_name(), None);
        assert!(!HypervisorKind::CloudHypervisor.driver().serial_log_appends());
    }

    #[test]
    fn qemu_carries_every_framework() {
        for f in [Framework::VendorVfio, Framework::Mdev, Framework::Passthrough] {
            assert!(can_carry(HypervisorKind::Qemu, Some(f)));
        }
        assert!(can_carry(HypervisorKind::Qemu, None));
    }

    #[test]
    fn cloud_hypervisor_never_carries_a_vgpu() {
        assert!(!can_carry(HypervisorKind::CloudHypervisor, Some(Framework::VendorVfio)));
        assert!(!can_carry(HypervisorKind::CloudHypervisor, Some(Framework::Mdev)));
        assert!(can_carry(HypervisorKind::CloudHypervisor, Some(Framework::Passthrough)));
        assert!(can_carry(HypervisorKind::CloudHypervisor, None));
    }

    #[test]
    fn the_refusal_cites_the_upstream_issues() {
        let v = HypervisorKind::CloudHypervisor.cannot_carry(Some(Framework::VendorVfio)).unwrap();
        assert!(v.contains("cloud-hypervisor#7572") && v.contains("cloud-hypervisor#5319"), "{v}");
        let m = HypervisorKind::CloudHypervisor.cannot_carry(Some(Framework::Mdev)).unwrap();
        assert!(m.contains("cloud-hypervisor#5319"), "{m}");
        assert_eq!(HypervisorKind::CloudHypervisor.cannot_carry(None), None);
        assert_eq!(HypervisorKind::Qemu.cannot_carry(Some(Framework::Mdev)), None);
    }

    #[test]
    fn kinds_serialise_as_their_wire_names() {
        for k in HypervisorKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::json!(k.name()));
            assert_eq!(k.driver().kind(), k);
        }
        assert_eq!(HypervisorKind::Qemu.driver().control_socket_name(), "qmp.sock");
        assert_eq!(HypervisorKind::CloudHypervisor.driver().control_socket_name(), "ch.sock");
    }

    #[test]
    fn names_round_trip() {
        for k in HypervisorKind::ALL {
            assert_eq!(HypervisorKind::from_name(k.name()), Some(k));
        }
        assert_eq!(HypervisorKind::Qemu.name(), "qemu");
        assert_eq!(HypervisorKind::CloudHypervisor.name(), "cloud-hypervisor");
        assert_eq!(HypervisorKind::from_name("xen"), None);
    }
}
