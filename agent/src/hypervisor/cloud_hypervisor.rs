//! # hypervisor::cloud_hypervisor — the Cloud Hypervisor driver
//!
//! docs/design/cloud-hypervisor.md holds the facts. The process is started with only
//! `--api-socket path=<instance dir>/ch.sock` (it then waits for requests, with no VM);
//! everything else goes through its REST API ([`super::ch_api`]):
//!
//! 1. `GET vmm.ping` until it answers (the API socket's listener is the control socket,
//!    exactly like QEMU's QMP socket);
//! 2. `PUT vm.create` with [`vm_config`]: the payload (kernel, initramfs, cmdline), `cpus`,
//!    `memory` in **bytes**, the disks (the instance's qcow2 overlay with its backing file,
//!    the cloud-init seed read-only), the serial port on a socket in the VMM directory that
//!    the agent relays ([`super::SerialPort::Relayed`]), no virtio console,
//!    `platform.system_uuid` = the instance id, and VFIO devices by sysfs path;
//! 3. `PUT vm.add-net` for each `bridge` NIC, with the agent's tap fd passed alongside
//!    (`SCM_RIGHTS`; Cloud Hypervisor ignores fds named in a JSON body);
//! 4. `PUT vm.boot`, then `GET vm.info` must say `Running`.
//!
//! A saved VM ([`Driver::save`]: `vm.pause`, `vm.snapshot` into a directory of its view,
//! moved into the agent's) comes back in a new VMM with `vm.restore` from a copy of that
//! directory in the VMM's view (each NIC's new tap passed alongside, `net_fds`), then
//! `vm.resume`.
//!
//! The graceful stop is `vm.power-button` (a guest that powers off ends the VMM process),
//! then `vmm.shutdown`; the kill path is the shared one. Every refused request surfaces
//! with its error array verbatim ([`ApiFailure`]).
//!
//! What it does not do, refused before anything is claimed: vGPUs
//! ([`HypervisorKind::cannot_carry`]), `user` NICs (user-mode networking is QEMU's),
//! a legacy BIOS boot ([`NO_BIOS`]), and a UEFI boot on an agent without its firmware
//! ([`NO_UEFI_FIRMWARE`]: its own build, which no Debian package ships; with
//! `cloud_hypervisor_firmware` set, `payload.firmware` boots the disk, with no variable
//! store);
//! [`vm_config`] refuses a held VFIO fd, which it cannot pass.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::ch_api::{ApiFailure, ChApi};
use super::process::{wait_answering, RunningVmm};
use super::{Driver, HypervisorError, HypervisorKind, NicBackend, NicSpec, StartFailure, VfioAttach, VmSpec, VmmError};

/// The Cloud Hypervisor driver.
#[derive(Debug, Clone, Copy)]
pub struct CloudHypervisor;

/// The `VmConfig` gpuvisor sends to `vm.create` (the subset of docs/design/cloud-hypervisor.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmConfig {
    /// What to boot.
    pub payload: Payload,
    /// vCPUs.
    pub cpus: Cpus,
    /// Guest memory.
    pub memory: Memory,
    /// The serial port, on a socket the agent relays.
    pub serial: Console,
    /// The virtio console (off).
    pub console: Console,
    /// SMBIOS identity.
    pub platform: Platform,
    /// VFIO devices by sysfs path.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<Device>,
    /// Block devices: the disk overlay, then the seed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Disk>,
}

/// One `disks[]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Disk {
    /// The image file.
    pub path: String,
    /// Attached read-only (the seed).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub readonly: bool,
    /// `Qcow2` or `Raw`: said, never probed from the file's content.
    pub image_type: &'static str,
    /// Follow the qcow2 backing file (the overlay's image disk, opened read-only).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub backing_files: bool,
    /// The device id in the VM.
    pub id: String,
}

/// `payload`: direct kernel boot, or the UEFI firmware (which boots the disk).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Payload {
    /// The kernel image (direct boot).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// The firmware (`cloud_hypervisor_firmware`: a UEFI boot of the disk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub firmware: Option<String>,
    /// The initramfs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<String>,
    /// The kernel command line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
}

/// `cpus`: both fields are required when present.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cpus {
    /// vCPUs at boot.
    pub boot_vcpus: u8,
    /// The most vCPUs (no hot-plug: the same).
    pub max_vcpus: u8,
}

/// `memory`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Memory {
    /// In bytes, not MiB.
    pub size: u64,
}

/// `serial` / `console`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Console {
    /// `Off`, `Socket`, ...
    pub mode: &'static str,
    /// The socket the VMM listens on, with mode `Socket`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
}

/// `platform`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Platform {
    /// The instance id (SMBIOS system UUID).
    pub system_uuid: String,
}

/// One `devices[]` entry: a VFIO device by its sysfs directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    /// `/sys/bus/pci/devices/<BDF>/`.
    pub path: String,
    /// The device id in the VM.
    pub id: String,
}

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The `vm.create` body for `spec`. Pure.
///
/// Errors: [`HypervisorError::StartFailed`] for what Cloud Hypervisor cannot take: no
/// kernel and no firmware ([`NO_BIOS`]), a UEFI variable store, more than 255 vCPUs, a held VFIO fd.
pub fn vm_config(spec: &VmSpec) -> Result<VmConfig, HypervisorError> {
    // A UEFI boot gives the firmware alone (no variable store: its payload keeps none);
    // otherwise the kernel. Refused at create already; never expressed half-way here.
    let (kernel, firmware) = match (&spec.uefi, spec.kernel.as_deref()) {
        (Some(u), _) if u.vars.is_some() => {
            return Err(HypervisorError::start_failed(
                "cloud-hypervisor's firmware keeps no UEFI variable store; the spec carries one",
            ))
        }
        (Some(u), _) => (None, Some(path_string(&u.code))),
        (None, Some(k)) => (Some(path_string(k)), None),
        (None, None) => {
            return Err(HypervisorError::start_failed(format!(
                "cloud-hypervisor needs a kernel (or its UEFI firmware) to boot: {NO_BIOS}"
            )))
        }
    };
    let vcpus = u8::try_from(spec.vcpus).map_err(|_| {
        HypervisorError::start_failed(format!("cloud-hypervisor takes at most 255 vCPUs, not {}", spec.vcpus))
    })?;
    let mut devices = Vec::new();
    match &spec.vfio {
        None => {}
        Some(VfioAttach::Device { sysfsdevs }) => {
            for (i, dev) in sysfsdevs.iter().enumerate() {
                let mut path = path_string(dev);
                if !path.ends_with('/') {
                    path.push('/');
                }
                devices.push(Device { path, id: format!("gpu{i}") });
            }
        }
        Some(VfioAttach::HoldFd { node }) => {
            return Err(HypervisorError::start_failed(format!(
                "cloud-hypervisor cannot be given the held VFIO group {}: it takes devices by sysfs path only",
                node.display()
            )))
        }
    }
    Ok(VmConfig {
        payload: Payload {
            initramfs: spec.initrd.as_deref().filter(|_| kernel.is_some()).map(path_string),
            cmdline: (!spec.cmdline.is_empty() && kernel.is_some()).then(|| spec.cmdline.clone()),
            kernel,
            firmware,
        },
        cpus: Cpus { boot_vcpus: vcpus, max_vcpus: vcpus },
        memory: Memory { size: spec.memory_mib * 1024 * 1024 },
        serial: Console { mode: "Socket", socket: Some(path_string(&spec.serial_socket())) },
        console: Console { mode: "Off", socket: None },
        platform: Platform { system_uuid: spec.id.to_string() },
        devices,
        disks: spec
            .disk
            .iter()
            .map(|d| Disk {
                path: path_string(d),
                readonly: false,
                image_type: "Qcow2",
                backing_files: true,
                id: super::DISK_ID.into(),
            })
            .chain(spec.seed.iter().map(|s| Disk {
                path: path_string(s),
                readonly: true,
                image_type: "Raw",
                backing_files: false,
                id: super::SEED_ID.into(),
            }))
            .collect(),
    })
}

/// A copy of the saved state `saved` (a directory `vm.snapshot` wrote) in the VMM's view:
/// `<run_dir>/.vmstate-restore-<uuid>`, readable by the VMM's group. Only regular files are
/// copied, never through a link (the directory was written by a VMM). Errors name the path.
fn stage_saved_state(saved: &Path, run_dir: &Path) -> Result<std::path::PathBuf, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let io = |p: &Path, e: std::io::Error| format!("the saved state {}: {e}", p.display());
    let meta = std::fs::symlink_metadata(saved).map_err(|e| io(saved, e))?;
    if !meta.is_dir() {
        return Err(format!("the saved state {} is not a directory", saved.display()));
    }
    let gid = std::fs::metadata(run_dir).map_err(|e| io(run_dir, e))?.gid();
    let staged = run_dir.join(format!("{}restore-{}", super::VM_STATE_STAGING, uuid::Uuid::new_v4().simple()));
    super::confine::own_dir(&staged, gid, 0o750).map_err(|e| io(&staged, e))?;
    let copied = (|| {
        for e in std::fs::read_dir(saved).map_err(|e| io(saved, e))?.flatten() {
            let from = e.path();
            if !std::fs::symlink_metadata(&from).map_err(|e| io(&from, e))?.is_file() {
                return Err(format!("the saved state holds {}, which is not a regular file", from.display()));
            }
            let mut src = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&from)
                .map_err(|e| io(&from, e))?;
            let to = staged.join(e.file_name());
            let mut dst = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o640)
                .open(&to)
                .map_err(|e| io(&to, e))?;
            std::io::copy(&mut src, &mut dst).map_err(|e| io(&to, e))?;
            super::confine::give_to_group(&staged, &e.file_name().to_string_lossy(), gid, 0o640)
                .map_err(|e| io(&to, e))?;
        }
        Ok(())
    })();
    if let Err(e) = copied {
        let _ = std::fs::remove_dir_all(&staged);
        return Err(e);
    }
    Ok(staged)
}

/// The `vm.restore` body for the state staged at `staged`, and the fds that go with it:
/// each NIC's new tap, in order, counted by its id in `net_fds` (`num_fds`; the real v53.0
/// answers `["Bad Request"]` when the count and the fds passed differ).
fn restore_body<'a>(
    staged: &Path,
    taps: &[(usize, &NicSpec, std::os::fd::BorrowedFd<'a>)],
) -> (serde_json::Value, Vec<std::os::fd::BorrowedFd<'a>>) {
    let mut body = serde_json::json!({"source_url": format!("file://{}", path_string(staged))});
    if !taps.is_empty() {
        body["net_fds"] = taps
            .iter()
            .map(|(i, _, _)| serde_json::json!({"id": format!("net{i}"), "num_fds": 1}))
            .collect::<Vec<_>>()
            .into();
    }
    (body, taps.iter().map(|(_, _, fd)| *fd).collect())
}

/// `--api-socket path=<socket>`. Cloud Hypervisor splits its option values at commas, so a
/// socket path with a comma or `=` cannot be expressed.
fn api_socket_arg(socket: &Path) -> Result<String, HypervisorError> {
    let s = path_string(socket);
    if s.contains(',') || s.contains('=') {
        return Err(HypervisorError::start_failed(format!(
            "the API socket path {s} contains `,` or `=`, which cloud-hypervisor's option syntax cannot carry \
             (choose a data_dir without them)"
        )));
    }
    Ok(format!("path={s}"))
}

/// `vm.info`'s `state`.
fn state_of(api: &ChApi<'_>) -> Result<String, ApiFailure> {
    let body = api.get("vm.info")?;
    let info: serde_json::Value = serde_json::from_slice(&body).map_err(|e| ApiFailure {
        request: "GET vm.info".into(),
        status: Some(200),
        errors: vec![format!("the answer is not JSON: {e}")],
    })?;
    match info.get("state").and_then(|s| s.as_str()) {
        Some(s) => Ok(s.to_string()),
        None => Err(ApiFailure {
            request: "GET vm.info".into(),
            status: Some(200),
            errors: vec!["the answer has no `state`".into()],
        }),
    }
}

/// `PUT <endpoint>` without a body, its answer's body dropped.
fn put(socket: &Path, timeout: Duration, endpoint: &str) -> Result<(), VmmError> {
    ChApi::new(socket, timeout).put(endpoint, None)?;
    Ok(())
}

/// Why a Cloud Hypervisor instance cannot have a `user` NIC.
pub const NO_USER_NIC: &str = "cloud-hypervisor has no user-mode networking (a `user` NIC is QEMU's): \
    give the instance a `bridge` NIC, or use hypervisor qemu";

/// Why a Cloud Hypervisor instance cannot boot through a legacy BIOS.
pub const NO_BIOS: &str = "cloud-hypervisor has no legacy BIOS: boot \"direct\" (the image's kernel, its disk \
    attached) or \"uefi\" (with cloud_hypervisor_firmware), or use hypervisor qemu for boot \"bios\"";

/// Why a Cloud Hypervisor instance cannot boot UEFI on an agent without its firmware.
pub const NO_UEFI_FIRMWARE: &str = "cloud-hypervisor boots UEFI only from its own firmware build (CLOUDHV.fd, an \
    OVMF build for cloud-hypervisor, or rust-hypervisor-firmware), which no Debian package ships: set \
    cloud_hypervisor_firmware in the agent's configuration, or use hypervisor qemu for boot \"uefi\"";

/// The `vm.add-net` body of NIC `index` (its tap goes alongside as an fd).
pub fn add_net_body(index: usize, nic: &NicSpec) -> serde_json::Value {
    serde_json::json!({"mac": nic.mac, "id": format!("net{index}")})
}

impl Driver for CloudHypervisor {
    fn kind(&self) -> HypervisorKind {
        HypervisorKind::CloudHypervisor
    }

    fn control_socket_name(&self) -> &'static str {
        "ch.sock"
    }

    fn log_name(&self) -> &'static str {
        "cloud-hypervisor.log"
    }

    /// `serial.mode = Socket` (its file serial is not opened `O_APPEND`, so a log it wrote
    /// could not be capped).
    fn serial_port(&self) -> super::SerialPort {
        super::SerialPort::Relayed
    }

    /// Taps go with `vm.add-net` ([`Driver::bring_up`]).
    fn taps_at_exec(&self) -> bool {
        false
    }

    fn command_line(&self, spec: &VmSpec) -> Result<Vec<String>, HypervisorError> {
        // Refused at create already (instances::create); never started half-configured.
        if spec.nics.iter().any(|n| !matches!(n.backend, NicBackend::Tap { .. })) {
            return Err(HypervisorError::start_failed(NO_USER_NIC));
        }
        vm_config(spec)?;
        Ok(vec!["--api-socket".into(), api_socket_arg(&spec.control_socket())?])
    }

    fn bring_up(&self, vmm: &RunningVmm, spec: &VmSpec, timeout: Duration) -> Result<(), StartFailure> {
        let socket = &vmm.control_socket;
        let what = format!("the cloud-hypervisor API on {}", socket.display());
        wait_answering(vmm, &what, timeout, |io| ChApi::new(socket, io).get("vmm.ping"))?;
        let config = vm_config(spec).map_err(|e| StartFailure::from(e.to_string()))?;
        let api = ChApi::new(socket, timeout);
        let taps: Vec<(usize, &NicSpec, std::os::fd::BorrowedFd<'_>)> = spec
            .nics
            .iter()
            .enumerate()
            .filter_map(|(i, nic)| match &nic.backend {
                NicBackend::Tap { agent_fd, .. } => {
                    // SAFETY: the agent holds each tap open for the whole spawn
                    // (instances::nics), of which this is a part; the VMM gets its own copies.
                    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(*agent_fd) };
                    Some((i, nic, fd))
                }
                NicBackend::User { .. } => None,
            })
            .collect();
        let last = match &spec.incoming {
            None => {
                let body = serde_json::to_value(&config).map_err(|e| StartFailure::from(e.to_string()))?;
                api.put("vm.create", Some(&body))?;
                for (i, nic, tap) in &taps {
                    api.put_with_fds("vm.add-net", &add_net_body(*i, nic), &[*tap])?;
                }
                api.put("vm.boot", None)?;
                "vm.boot"
            }
            Some(saved) => {
                let staged = stage_saved_state(saved, &spec.run_dir).map_err(StartFailure::from)?;
                let (body, fds) = restore_body(&staged, &taps);
                let restored = api.put_with_fds("vm.restore", &body, &fds).and_then(|_| api.put("vm.resume", None));
                let _ = std::fs::remove_dir_all(&staged);
                restored.map_err(StartFailure::from)?;
                "vm.restore"
            }
        };
        let state = state_of(&api)?;
        if state != "Running" {
            return Err(StartFailure::from(format!(
                "cloud-hypervisor reports the VM {state} after {last}, not Running"
            )));
        }
        tracing::debug!(pid = vmm.identity.pid, "cloud-hypervisor VM running");
        Ok(())
    }

    fn power_button(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError> {
        put(socket, io_timeout, "vm.power-button")
    }

    fn quit(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError> {
        // Answered 200 by v53.0 (its API description says 204); either is success.
        put(socket, io_timeout, "vmm.shutdown")
    }

    fn vm_state(&self, socket: &Path, io_timeout: Duration) -> Result<String, VmmError> {
        Ok(state_of(&ChApi::new(socket, io_timeout))?)
    }

    /// `vm.pause`, then `vm.snapshot` into a fresh directory of its own view
    /// (`<run_dir>/.vmstate-save-<uuid>`, the VMM's group's to write), moved to `memory`
    /// when it is still a directory (never a link the VMM put in its place).
    fn save(&self, socket: &Path, run_dir: &Path, memory: &Path, timeout: Duration) -> Result<(), VmmError> {
        let api = ChApi::new(socket, timeout);
        api.put("vm.pause", None)?;
        let saving = run_dir.join(format!("{}save-{}", super::VM_STATE_STAGING, uuid::Uuid::new_v4().simple()));
        let gid =
            std::os::unix::fs::MetadataExt::gid(&std::fs::metadata(run_dir).map_err(|e| VmmError::io(run_dir, e))?);
        super::confine::own_dir(&saving, gid, super::confine::RUN_DIR_MODE).map_err(|e| VmmError::io(&saving, e))?;
        let snapshot = serde_json::json!({"destination_url": format!("file://{}", path_string(&saving))});
        let moved = api.put("vm.snapshot", Some(&snapshot)).map_err(VmmError::from).and_then(|_| {
            let m = std::fs::symlink_metadata(&saving).map_err(|e| VmmError::io(&saving, e))?;
            if !m.is_dir() {
                return Err(VmmError::SnapshotReplaced { path: saving.clone() });
            }
            std::fs::rename(&saving, memory).map_err(|e| VmmError::io(memory, e))
        });
        if moved.is_err() {
            let _ = crate::own_file::remove(run_dir, &saving.file_name().unwrap_or_default().to_string_lossy());
        }
        moved
    }

    /// `Paused` (`vm.pause` before `vm.snapshot`).
    fn paused_by_save(&self, vm_state: &str) -> bool {
        vm_state == "Paused"
    }

    fn reset(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError> {
        put(socket, io_timeout, "vm.reboot")
    }

    /// `GET vm.counters`: the entries of the disk and the seed (`read_bytes`, `write_bytes`,
    /// `read_ops`, `write_ops`; the real v53.0 answers them, with latencies gpuvisor leaves).
    fn disk_counters(&self, socket: &Path, io_timeout: Duration) -> Result<Vec<super::DiskCounters>, VmmError> {
        let body = ChApi::new(socket, io_timeout).get("vm.counters")?;
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|source| VmmError::NotJson { request: "vm.counters", source })?;
        let mut out = Vec::new();
        for id in [super::DISK_ID, super::SEED_ID] {
            let Some(e) = v.get(id) else { continue };
            let n = |k: &str| {
                e[k].as_u64().ok_or_else(|| VmmError::Missing {
                    request: "vm.counters",
                    id,
                    field: k.to_string(),
                    entry: e.to_string(),
                })
            };
            out.push(super::DiskCounters {
                id: id.to_string(),
                read_bytes: n("read_bytes")?,
                write_bytes: n("write_bytes")?,
                read_ops: n("read_ops")?,
                write_ops: n("write_ops")?,
            });
        }
        Ok(out)
    }

    fn resume(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError> {
        put(socket, io_timeout, "vm.resume")
    }

    /// Starts `binary --api-socket` on a temporary socket, asks `vmm.ping` for its version,
    /// and shuts it down again (`vmm.shutdown`, then the kill path).
    fn probe(&self, binary: &Path) -> Result<String, VmmError> {
        let dir = tempfile::Builder::new().prefix("gpuvisor-ch-probe").tempdir().map_err(VmmError::ProbeDir)?;
        let socket = dir.path().join("ch.sock");
        // Killed and reaped on every way out (a panic too): the probe never leaves its
        // throw-away VMM running.
        struct ProbeVmm(std::process::Child);
        impl Drop for ProbeVmm {
            fn drop(&mut self) {
                if self.0.try_wait().ok().flatten().is_none() {
                    // Our own child, not yet reaped: its pid cannot have been reused.
                    let _ = self.0.kill();
                    let _ = self.0.wait();
                }
            }
        }
        let mut child = std::process::Command::new(binary)
            .arg("--api-socket")
            .arg(api_socket_arg(&socket)?)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .map(ProbeVmm)
            .map_err(|source| VmmError::NotRunnable { binary: binary.to_path_buf(), source })?;
        let deadline = std::time::Instant::now() + super::process::PROBE_TIMEOUT;
        let answer = loop {
            match ChApi::new(&socket, Duration::from_secs(2)).get("vmm.ping") {
                Ok(body) => break Ok(body),
                Err(e) => {
                    if let Ok(Some(status)) = child.0.try_wait() {
                        let mut err = String::new();
                        if let Some(mut s) = child.0.stderr.take() {
                            let _ = std::io::Read::read_to_string(&mut s, &mut err);
                        }
                        break Err(VmmError::ProbeExited {
                            binary: binary.to_path_buf(),
                            status,
                            stderr: err.trim().to_string(),
                        });
                    }
                    if std::time::Instant::now() >= deadline {
                        break Err(VmmError::ProbeUnanswered { binary: binary.to_path_buf(), source: e });
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        let _ = ChApi::new(&socket, Duration::from_secs(2)).put("vmm.shutdown", None);
        let stop_deadline = std::time::Instant::now() + Duration::from_secs(5);
        while child.0.try_wait().ok().flatten().is_none() && std::time::Instant::now() < stop_deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(child);
        let body = answer?;
        let ping: serde_json::Value =
            serde_json::from_slice(&body).map_err(|source| VmmError::NotJson { request: "vmm.ping", source })?;
        let version = ping.get("version").and_then(|v| v.as_str()).unwrap_or("unknown version");
        Ok(match ping.get("build_version").and_then(|v| v.as_str()) {
            Some(b) => format!("cloud-hypervisor {version} ({b})"),
            None => format!("cloud-hypervisor {version}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec() -> VmSpec {
        VmSpec {
            hypervisor: HypervisorKind::CloudHypervisor,
            id: uuid::Uuid::parse_str("6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d").unwrap(),
            name: "vm-a".into(),
            vcpus: 2,
            memory_mib: 512,
            kernel: Some("/images/vmlinuz".into()),
            initrd: Some("/images/initrd.img".into()),
            cmdline: "console=ttyS0".into(),
            accel: "kvm".into(),
            paused: false,
            binary: "cloud-hypervisor".into(),
            run_dir: "/var/lib/gpuvisor/instances/x".into(),
            vfio: None,
            sandbox: false,
            ..VmSpec::test_base()
        }
    }

    #[test]
    fn a_user_nic_and_a_firmware_boot_are_refused_not_dropped() {
        let mut s = spec();
        s.nics = vec![super::super::NicSpec {
            mac: "52:54:00:00:00:01".into(),
            backend: super::super::NicBackend::User { restrict: true, forwards: vec![] },
        }];
        let e = CloudHypervisor.command_line(&s).unwrap_err().to_string();
        assert!(e.contains("no user-mode networking"), "{e}");
        let mut s = spec();
        s.uefi = Some(super::super::UefiPflash { code: "/fw".into(), vars: Some("/x/efivars.fd".into()) });
        let e = CloudHypervisor.command_line(&s).unwrap_err().to_string();
        assert!(e.contains("no UEFI variable store"), "{e}");
        let mut s = spec();
        s.kernel = None;
        let e = CloudHypervisor.command_line(&s).unwrap_err().to_string();
        assert!(e.contains("no legacy BIOS"), "{e}");
        assert!(CloudHypervisor.command_line(&spec()).is_ok());
    }

    /// With `cloud_hypervisor_firmware`: the firmware is the payload (no kernel, initramfs
    /// or cmdline), and the disk is what it boots.
    #[test]
    fn a_uefi_boot_gives_the_firmware_as_payload_and_the_disk() {
        let mut s = spec();
        s.kernel = None;
        s.uefi = Some(super::super::UefiPflash { code: "/fw/CLOUDHV.fd".into(), vars: None });
        s.disk = Some("/var/lib/gpuvisor/instances/x/disk.qcow2".into());
        let v = serde_json::to_value(vm_config(&s).unwrap()).unwrap();
        assert_eq!(v["payload"], json!({"firmware": "/fw/CLOUDHV.fd"}));
        assert_eq!(v["disks"][0]["id"], "disk0");
    }

    #[test]
    fn the_config_has_memory_in_bytes_the_serial_socket_and_the_instance_uuid() {
        let v = serde_json::to_value(vm_config(&spec()).unwrap()).unwrap();
        assert_eq!(
            v,
            json!({
                "payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initrd.img", "cmdline": "console=ttyS0"},
                "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
                "memory": {"size": 536870912u64},
                "serial": {"mode": "Socket", "socket": "/var/lib/gpuvisor/instances/x/serial.sock"},
                "console": {"mode": "Off"},
                "platform": {"system_uuid": "6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"}
            })
        );
    }

    /// The shapes the real v53.0 binary took (docs/design/cloud-hypervisor.md): it then held
    /// the overlay read-write and its backing file read-only.
    #[test]
    fn the_overlay_follows_its_backing_file_and_the_seed_is_read_only() {
        let mut s = spec();
        s.disk = Some("/var/lib/gpuvisor/instances/x/disk.qcow2".into());
        s.seed = Some("/var/lib/gpuvisor/instances/x/seed.iso".into());
        let v = serde_json::to_value(vm_config(&s).unwrap()).unwrap();
        assert_eq!(
            v["disks"],
            json!([
                {"path": "/var/lib/gpuvisor/instances/x/disk.qcow2", "image_type": "Qcow2", "backing_files": true, "id": "disk0"},
                {"path": "/var/lib/gpuvisor/instances/x/seed.iso", "readonly": true, "image_type": "Raw", "id": "seed"}
            ])
        );
        let nic = super::super::NicSpec {
            mac: "52:54:00:00:00:07".into(),
            backend: super::super::NicBackend::Tap { ifname: "gvabc0".into(), agent_fd: 9 },
        };
        assert_eq!(add_net_body(1, &nic), json!({"mac": "52:54:00:00:00:07", "id": "net1"}));
        s.nics = vec![nic];
        assert!(CloudHypervisor.command_line(&s).is_ok(), "a tap NIC is taken");
    }

    #[test]
    fn a_vfio_device_goes_by_its_sysfs_path_and_a_held_fd_is_refused() {
        let mut s = spec();
        s.vfio = Some(VfioAttach::Device { sysfsdevs: vec!["/sys/bus/pci/devices/0000:41:00.0".into()] });
        let v = serde_json::to_value(vm_config(&s).unwrap()).unwrap();
        assert_eq!(v["devices"], json!([{"path": "/sys/bus/pci/devices/0000:41:00.0/", "id": "gpu0"}]));
        // A passthrough group: one device per function.
        s.vfio = Some(VfioAttach::Device {
            sysfsdevs: vec!["/sys/bus/pci/devices/0000:82:00.0".into(), "/sys/bus/pci/devices/0000:82:00.1".into()],
        });
        let v = serde_json::to_value(vm_config(&s).unwrap()).unwrap();
        assert_eq!(
            v["devices"],
            json!([
                {"path": "/sys/bus/pci/devices/0000:82:00.0/", "id": "gpu0"},
                {"path": "/sys/bus/pci/devices/0000:82:00.1/", "id": "gpu1"}
            ])
        );
        s.vfio = Some(VfioAttach::HoldFd { node: "/sim/dev/vfio/41".into() });
        assert!(vm_config(&s).unwrap_err().to_string().contains("sysfs path only"));
    }

    #[test]
    fn the_command_line_is_only_the_api_socket() {
        let args = CloudHypervisor.command_line(&spec()).unwrap();
        assert_eq!(args, vec!["--api-socket", "path=/var/lib/gpuvisor/instances/x/ch.sock"]);
        let mut s = spec();
        s.run_dir = "/data,1/x".into();
        assert!(CloudHypervisor.command_line(&s).unwrap_err().to_string().contains("`,` or `=`"));
        let mut s = spec();
        s.vcpus = 300;
        assert!(CloudHypervisor.command_line(&s).unwrap_err().to_string().contains("255"));
        let mut s = spec();
        s.kernel = None;
        assert!(CloudHypervisor.command_line(&s).unwrap_err().to_string().contains("needs a kernel"));
    }
}
