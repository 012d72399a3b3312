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
            HypervisorKind::CloudHypervisor => &[Capability::Passthrough, Capability::Standby, Capability::Snapshot],
        }
    }

    /// This kind's binary as configured (`qemu_binary`, `cloud_hypervisor_binary`).
    pub fn binary(self, cfg: &crate::config::Config) -> &Path {
        match self {
            HypervisorKind::Qemu => &cfg.qemu_binary,
            HypervisorKind::CloudHypervisor => &cfg.cloud_hypervisor_binary,
        }
    }

    /// Why this kind cannot boot an instance through its firmware the way `firmware` asks
    /// (on an agent configured as `cfg`), or `None` when it can. A disk is attached under
    /// every kind.
    pub fn cannot_boot(self, firmware: Option<FirmwareBoot>, cfg: &crate::config::Config) -> Option<&'static str> {
        match (self, firmware) {
            (HypervisorKind::CloudHypervisor, Some(FirmwareBoot::Bios)) => Some(cloud_hypervisor::NO_BIOS),
            (HypervisorKind::CloudHypervisor, Some(FirmwareBoot::Uefi)) if cfg.cloud_hypervisor_firmware.is_none() => {
                Some(cloud_hypervisor::NO_UEFI_FIRMWARE)
            }
            _ => None,
        }
    }

    /// The UEFI firmware this kind boots (`boot = "uefi"`): its code, read-only, and the
    /// template of the instance's own variable store when the firmware keeps one (QEMU's
    /// OVMF pflash pair; Cloud Hypervisor's firmware payload has none), each with its config
    /// key. `None`: not configured ([`HypervisorKind::cannot_boot`] refuses it).
    pub fn uefi_firmware(self, cfg: &crate::config::Config) -> Option<UefiFirmware<'_>> {
        match self {
            HypervisorKind::Qemu => {
                Some(UefiFirmware { code: ("ovmf_code", &cfg.ovmf_code), vars: Some(("ovmf_vars", &cfg.ovmf_vars)) })
            }
            HypervisorKind::CloudHypervisor => cfg
                .cloud_hypervisor_firmware
                .as_deref()
                .map(|f| UefiFirmware { code: ("cloud_hypervisor_firmware", f), vars: None }),
        }
    }

    /// Why this kind cannot save a running VM's memory and device state (snapshots,
    /// standby), or `None`: the kinds that can list [`Capability::Snapshot`].
    pub fn cannot_save(self) -> Option<String> {
        (!self.capabilities().contains(&Capability::Snapshot))
            .then(|| format!("{self} VMs cannot be saved (snapshots and standby) by this version of gpuvisor"))
    }

    /// Why this kind cannot give an instance a `user` NIC (user-mode networking), or `None`.
    pub fn cannot_connect(self, user_nic: bool) -> Option<&'static str> {
        match self {
            HypervisorKind::CloudHypervisor if user_nic => Some(cloud_hypervisor::NO_USER_NIC),
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

    /// How the guest's serial console reaches its log and `gpuvisor console`.
    fn serial_port(&self) -> SerialPort;

    /// Whether the VMM inherits the taps of its NICs across exec (on [`tap_fd`]`(i)`); when
    /// not, [`Driver::bring_up`] hands them over through its API.
    fn taps_at_exec(&self) -> bool;

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
    ///
    /// Errors (as every request below): [`VmmError::Qmp`] or [`VmmError::Api`] when the
    /// control socket cannot be reached, times out, or the VMM refuses the request.
    fn power_button(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError>;

    /// Asks the VMM process to exit (QMP `quit`; `vmm.shutdown`).
    fn quit(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError>;

    /// The VM state as the VMM reports it (QMP `query-status`'s `status`; `vm.info`'s
    /// `state`).
    fn vm_state(&self, socket: &Path, io_timeout: Duration) -> Result<String, VmmError>;

    /// Pauses the VM and saves its memory and device state at `memory`, a path of the
    /// agent's that does not exist yet, on the filesystem of the VMM directory `run_dir`
    /// (QEMU: a file, its migration stream through an fd the agent opened; Cloud Hypervisor:
    /// the directory `vm.snapshot` writes inside `run_dir`, its view, moved to `memory`),
    /// within `timeout`. The disks are flushed and consistent with the saved state once this
    /// returns; the VM stays paused until [`Driver::resume`] (or the VMM is stopped). On
    /// `Err` the VM may be paused: the caller resumes it, and removes whatever is at
    /// `memory`. Errors: also [`VmmError::Io`] for the files of the save, and
    /// [`VmmError::SnapshotReplaced`].
    fn save(&self, socket: &Path, run_dir: &Path, memory: &Path, timeout: Duration) -> Result<(), VmmError>;

    /// Whether `vm_state` (as [`Driver::vm_state`] reports it) is a VM left paused by a
    /// [`Driver::save`] (the agent died before resuming it).
    fn paused_by_save(&self, vm_state: &str) -> bool;

    /// Resets the VM in place, like its reset button (QMP `system_reset`; `vm.reboot`): the
    /// VMM process and its devices stay, the guest starts over without shutting down.
    fn reset(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError>;

    /// The I/O counters of the VM's disks ([`DISK_ID`], [`SEED_ID`]) as the VMM reports them
    /// (QMP `query-blockstats`; `vm.counters`), in that order, those it has. Errors: also
    /// [`VmmError::NotJson`] and [`VmmError::Missing`] for an answer without the counters.
    fn disk_counters(&self, socket: &Path, io_timeout: Duration) -> Result<Vec<DiskCounters>, VmmError>;

    /// Resumes a VM paused by [`Driver::save`] (QMP `cont`).
    fn resume(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError>;

    /// Whether `binary` exists and runs: its version, or why not (the `VmmError::Probe*`
    /// variants, [`VmmError::NotRunnable`], and the request errors of a throw-away VMM).
    /// Takes at most a few seconds; starts and stops a throw-away process where the
    /// hypervisor needs one (Cloud Hypervisor: `vmm.ping` on a temporary API socket).
    fn probe(&self, binary: &Path) -> Result<String, VmmError>;
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

/// The serial log's file name in the VMM directory.
pub const SERIAL_LOG: &str = "serial.log";
/// The console socket's file name `gpuvisor console` connects to ([`SerialPort::console_socket`]).
pub const CONSOLE_SOCKET: &str = "console.sock";
/// The socket in the VMM directory on which a [`SerialPort::Relayed`] VMM serves the serial
/// port to the agent.
pub const SERIAL_SOCKET: &str = "serial.sock";

/// The id, in the VM, of the instance's disk (its overlay).
pub const DISK_ID: &str = "disk0";
/// The id, in the VM, of the cloud-init seed's disk.
pub const SEED_ID: &str = "seed";

/// One disk's I/O counters since the VMM started, as the VMM reports them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct DiskCounters {
    /// [`DISK_ID`] or [`SEED_ID`].
    pub id: String,
    /// Bytes the guest read.
    pub read_bytes: u64,
    /// Bytes the guest wrote.
    pub write_bytes: u64,
    /// Read requests.
    pub read_ops: u64,
    /// Write requests.
    pub write_ops: u64,
}

/// A boot through the firmware from the instance's disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirmwareBoot {
    /// Legacy BIOS (QEMU's SeaBIOS).
    Bios,
    /// UEFI.
    Uefi,
}

/// A kind's UEFI firmware files ([`HypervisorKind::uefi_firmware`]): `(config key, path)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UefiFirmware<'a> {
    /// The firmware code.
    pub code: (&'static str, &'a Path),
    /// The template of the instance's variable store, when the firmware keeps one.
    pub vars: Option<(&'static str, &'a Path)>,
}

/// The name prefix, in the VMM directory, of the directories a VMM saves a state into or
/// restores one from (Cloud Hypervisor's `vm.snapshot`/`vm.restore`); an agent start-up
/// removes those an interrupted operation left.
pub const VM_STATE_STAGING: &str = ".vmstate-";

/// How a driver serves the guest's serial console: its log (appended, so that the agent can
/// cap it, [`crate::console::rotate`]) and the socket `gpuvisor console` attaches to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SerialPort {
    /// The VMM serves the console on `<run_dir>/`[`CONSOLE_SOCKET`] and appends everything
    /// to `<run_dir>/`[`SERIAL_LOG`] itself (QEMU's socket chardev with `logappend=on`).
    Served,
    /// The VMM serves the serial port to one client on `<run_dir>/`[`SERIAL_SOCKET`] and the
    /// agent relays it ([`crate::serial_relay`]): it appends the output to
    /// `<run_dir>/`[`SERIAL_LOG`] and serves `<instance dir>/`[`CONSOLE_SOCKET`] (Cloud
    /// Hypervisor, whose file serial is not opened `O_APPEND` and so could not be capped).
    Relayed,
}

impl SerialPort {
    /// The socket `gpuvisor console` connects to, for an instance whose VMM directory is
    /// `run_dir` and whose (agent-only) instance directory is `instance_dir`.
    pub fn console_socket(self, run_dir: &Path, instance_dir: &Path) -> PathBuf {
        match self {
            SerialPort::Served => run_dir.join(CONSOLE_SOCKET),
            SerialPort::Relayed => instance_dir.join(CONSOLE_SOCKET),
        }
    }
}

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
    /// Resume a saved VM instead of booting it: the memory state (agent side, never in the
    /// VMM's view) that [`Driver::save`] wrote. [`Driver::bring_up`] hands it over (QEMU:
    /// `-incoming defer`, then an fd; Cloud Hypervisor: a copy in the VMM directory and
    /// `vm.restore`) and the VM runs on from where it was saved.
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

/// The firmware of a UEFI boot ([`HypervisorKind::uefi_firmware`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UefiPflash {
    /// The firmware code, read-only (QEMU: `ovmf_code`, e.g.
    /// `/usr/share/OVMF/OVMF_CODE_4M.fd`, pflash unit 0; Cloud Hypervisor:
    /// `cloud_hypervisor_firmware`, its `payload.firmware`).
    pub code: PathBuf,
    /// The instance's own writable variable store (`<run_dir>/efivars.fd`, a copy of
    /// `ovmf_vars`; QEMU's pflash unit 1), when the firmware keeps one.
    pub vars: Option<PathBuf>,
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

    /// The socket `gpuvisor console` connects to ([`SerialPort::console_socket`]).
    pub fn console_socket(&self) -> PathBuf {
        self.hypervisor.driver().serial_port().console_socket(&self.run_dir, &self.log_dir)
    }

    /// `<run_dir>/serial.sock`: where a [`SerialPort::Relayed`] VMM serves its serial port.
    pub fn serial_socket(&self) -> PathBuf {
        self.run_dir.join(SERIAL_SOCKET)
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
        files.extend(self.uefi.iter().filter_map(|u| u.vars.as_deref()).map(|v| (name(v), false)));
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

/// Why a [`Driver`] request to a running VMM (over its control socket), or the probe of a
/// VMM binary, failed. Callers show the message alone (an API error's message, a view's
/// `vm_state_error`, `agent.health`'s `problem`), so it carries what the VMM answered.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// A QMP exchange failed: QEMU's socket could not be reached or timed out, QEMU closed
    /// it, answered something that is not QMP, or refused the command (its class and text).
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// A Cloud Hypervisor API request was not answered (connect failure, timeout) or was
    /// refused (its status and error array, verbatim).
    #[error(transparent)]
    Api(#[from] ApiFailure),
    /// The VMM answered `request` with something that is not JSON.
    #[error("{request} answered something that is not JSON: {source}")]
    NotJson {
        /// The request, e.g. `vm.counters`.
        request: &'static str,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The VMM's answer to `request` lacks a field of one of its entries.
    #[error("{request} gave {id} no {field}: {entry}")]
    Missing {
        /// The request, e.g. `query-blockstats`.
        request: &'static str,
        /// The entry, e.g. [`DISK_ID`].
        id: &'static str,
        /// The field that is missing or not a number, e.g. `stats.rd_bytes`.
        field: String,
        /// The entry as answered.
        entry: String,
    },
    /// A file or directory of a save (the memory state, the VMM directory) could not be
    /// created, read, synced or moved.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The directory `vm.snapshot` wrote into is not a directory any more (the VMM put
    /// something else in its place): it is not taken.
    #[error("{} is no longer a directory after vm.snapshot", path.display())]
    SnapshotReplaced {
        /// The directory.
        path: PathBuf,
    },
    /// The VMM binary cannot be run (not found, not executable).
    #[error("{} cannot be run: {source}", binary.display())]
    NotRunnable {
        /// The binary.
        binary: PathBuf,
        /// The spawn error.
        source: std::io::Error,
    },
    /// The probe's command did not exit within [`process::PROBE_TIMEOUT`] (it was killed).
    #[error("`{command}` did not exit within {} s", process::PROBE_TIMEOUT.as_secs())]
    ProbeTimeout {
        /// The command line, e.g. `qemu-system-x86_64 --version`.
        command: String,
    },
    /// Waiting for the probe's process failed.
    #[error("waiting for {} failed: {source}", binary.display())]
    ProbeWait {
        /// The binary.
        binary: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The probe's command exited with a failing status.
    #[error("`{command}` failed ({status}): {stderr}")]
    ProbeFailed {
        /// The command line.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// The probe's scratch directory (for a throw-away VMM's socket) could not be made.
    #[error("cannot make a directory for the probe: {0}")]
    ProbeDir(std::io::Error),
    /// The probe's throw-away VMM exited before it answered `vmm.ping`.
    #[error("{} exited before answering vmm.ping ({status}): {stderr}", binary.display())]
    ProbeExited {
        /// The binary.
        binary: PathBuf,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// The probe's throw-away VMM did not answer `vmm.ping` within
    /// [`process::PROBE_TIMEOUT`]: the last failure.
    #[error("{} did not answer vmm.ping: {source}", binary.display())]
    ProbeUnanswered {
        /// The binary.
        binary: PathBuf,
        /// The last request's failure.
        source: ApiFailure,
    },
    /// The probe's throw-away VMM cannot be started as asked (its socket path).
    #[error(transparent)]
    ProbeStart(#[from] HypervisorError),
}

impl VmmError {
    /// [`VmmError::Io`] of `path`.
    pub fn io(path: &Path, source: std::io::Error) -> VmmError {
        VmmError::Io { path: path.to_path_buf(), source }
    }
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
    fn qemu_serves_its_console_and_cloud_hypervisor_s_is_relayed_from_the_instance_directory() {
        let (run, inst) = (Path::new("/i/vmm"), Path::new("/i"));
        assert_eq!(HypervisorKind::Qemu.driver().serial_port(), SerialPort::Served);
        assert_eq!(SerialPort::Served.console_socket(run, inst), run.join(CONSOLE_SOCKET));
        assert_eq!(HypervisorKind::CloudHypervisor.driver().serial_port(), SerialPort::Relayed);
        assert_eq!(SerialPort::Relayed.console_socket(run, inst), inst.join(CONSOLE_SOCKET));
    }

    #[test]
    fn cloud_hypervisor_refuses_bios_uefi_without_its_firmware_and_user_nics() {
        let ch = HypervisorKind::CloudHypervisor;
        let mut cfg = crate::config::Config::default();
        assert!(ch.cannot_boot(Some(FirmwareBoot::Bios), &cfg).unwrap().contains("no legacy BIOS"));
        assert!(ch.cannot_boot(Some(FirmwareBoot::Uefi), &cfg).unwrap().contains("cloud_hypervisor_firmware"));
        assert_eq!(ch.uefi_firmware(&cfg), None);
        assert_eq!(ch.cannot_boot(None, &cfg), None);
        cfg.cloud_hypervisor_firmware = Some("/fw/CLOUDHV.fd".into());
        assert_eq!(ch.cannot_boot(Some(FirmwareBoot::Uefi), &cfg), None);
        let fw = ch.uefi_firmware(&cfg).unwrap();
        assert_eq!((fw.code.1, fw.vars), (Path::new("/fw/CLOUDHV.fd"), None), "no variable store");
        assert!(ch.cannot_connect(true).unwrap().contains("bridge"));
        assert_eq!(ch.cannot_connect(false), None);
        let q = HypervisorKind::Qemu;
        assert_eq!(q.cannot_boot(Some(FirmwareBoot::Bios), &cfg), None);
        assert_eq!(q.uefi_firmware(&cfg).unwrap().vars.map(|v| v.0), Some("ovmf_vars"));
        assert_eq!(q.cannot_connect(true), None);
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
