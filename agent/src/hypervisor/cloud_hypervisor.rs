//! # hypervisor::cloud_hypervisor — the Cloud Hypervisor driver
//!
//! docs/design/cloud-hypervisor.md holds the facts. The process is started with only
//! `--api-socket path=<instance dir>/ch.sock` (it then waits for requests, with no VM);
//! everything else goes through its REST API ([`super::ch_api`]):
//!
//! 1. `GET vmm.ping` until it answers (the API socket's listener is the control socket,
//!    exactly like QEMU's QMP socket);
//! 2. `PUT vm.create` with [`vm_config`]: the payload (kernel, initramfs, cmdline), `cpus`,
//!    `memory` in **bytes**, the serial port to the instance's `serial.log`, no virtio
//!    console, `platform.system_uuid` = the instance id, and VFIO devices by sysfs path;
//! 3. `PUT vm.boot`, then `GET vm.info` must say `Running`.
//!
//! The graceful stop is `vm.power-button` (a guest that powers off ends the VMM process),
//! then `vmm.shutdown`; the kill path is the shared one. Every refused request surfaces
//! with its error array verbatim ([`ApiFailure`]).
//!
//! Cloud Hypervisor never carries vGPUs ([`HypervisorKind::cannot_carry`]); request
//! validation refuses that before anything is claimed, and [`vm_config`] refuses a held
//! VFIO fd, which it cannot pass.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::ch_api::{ApiFailure, ChApi};
use super::process::{wait_answering, RunningVmm};
use super::{Driver, HypervisorError, HypervisorKind, StartFailure, VfioAttach, VmSpec};

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
    /// The serial port (to the instance's `serial.log`).
    pub serial: Console,
    /// The virtio console (off).
    pub console: Console,
    /// SMBIOS identity.
    pub platform: Platform,
    /// VFIO devices by sysfs path.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<Device>,
}

/// `payload`: direct kernel boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Payload {
    /// The kernel image.
    pub kernel: String,
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
    /// `Off`, `File`, ...
    pub mode: &'static str,
    /// The file, with mode `File`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
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
/// kernel (firmware boot needs the disk work), more than 255 vCPUs, a held VFIO fd.
pub fn vm_config(spec: &VmSpec) -> Result<VmConfig, HypervisorError> {
    let kernel = spec.kernel.as_deref().ok_or_else(|| {
        HypervisorError::start_failed("cloud-hypervisor needs a kernel to boot (the image names none)")
    })?;
    // Disks and firmware boots are QEMU's only (refused at create; never expressed here).
    if spec.disk.is_some() || spec.uefi.is_some() {
        return Err(HypervisorError::start_failed(
            "gpuvisor gives cloud-hypervisor instances no disk and no firmware boot",
        ));
    }
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
            kernel: path_string(kernel),
            initramfs: spec.initrd.as_deref().map(path_string),
            cmdline: (!spec.cmdline.is_empty()).then(|| spec.cmdline.clone()),
        },
        cpus: Cpus { boot_vcpus: vcpus, max_vcpus: vcpus },
        memory: Memory { size: spec.memory_mib * 1024 * 1024 },
        serial: Console { mode: "File", file: Some(path_string(&spec.serial_log())) },
        console: Console { mode: "Off", file: None },
        platform: Platform { system_uuid: spec.id.to_string() },
        devices,
    })
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

/// Why a Cloud Hypervisor instance cannot have NICs or a cloud-init seed (yet).
pub const NO_NICS_OR_SEED: &str = "gpuvisor does not give cloud-hypervisor instances NICs or a cloud-init seed \
    (it cannot be tested on this project's hosts); use hypervisor qemu";

/// Why a Cloud Hypervisor VM cannot be saved or resumed from a saved state (yet).
pub const NO_SAVED_STATE: &str = "gpuvisor does not save or restore cloud-hypervisor VMs in this version \
    (snapshots and standby are QEMU's); use hypervisor qemu";

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

    /// Its serial goes to a file (`serial.mode = File`), no socket.
    fn console_socket_name(&self) -> Option<&'static str> {
        None
    }

    /// Cloud Hypervisor opens its serial file without `O_APPEND`.
    fn serial_log_appends(&self) -> bool {
        false
    }

    fn command_line(&self, spec: &VmSpec) -> Result<Vec<String>, HypervisorError> {
        // Refused at create already (instances::create); never started half-configured.
        if !spec.nics.is_empty() || spec.seed.is_some() {
            return Err(HypervisorError::start_failed(NO_NICS_OR_SEED));
        }
        if spec.incoming.is_some() {
            return Err(HypervisorError::start_failed(NO_SAVED_STATE));
        }
        vm_config(spec)?;
        Ok(vec!["--api-socket".into(), api_socket_arg(&spec.control_socket())?])
    }

    fn bring_up(&self, vmm: &RunningVmm, spec: &VmSpec, timeout: Duration) -> Result<(), StartFailure> {
        let socket = &vmm.control_socket;
        let what = format!("the cloud-hypervisor API on {}", socket.display());
        wait_answering(vmm, &what, timeout, |io| ChApi::new(socket, io).get("vmm.ping").map_err(|e| e.to_string()))?;
        let config = vm_config(spec).map_err(|e| StartFailure::from(e.to_string()))?;
        let body = serde_json::to_value(&config).map_err(|e| StartFailure::from(e.to_string()))?;
        let api = ChApi::new(socket, timeout);
        api.put("vm.create", Some(&body))?;
        api.put("vm.boot", None)?;
        let state = state_of(&api)?;
        if state != "Running" {
            return Err(StartFailure::from(format!(
                "cloud-hypervisor reports the VM {state} after vm.boot, not Running"
            )));
        }
        tracing::debug!(pid = vmm.identity.pid, "cloud-hypervisor VM running");
        Ok(())
    }

    fn power_button(&self, socket: &Path, io_timeout: Duration) -> Result<(), String> {
        ChApi::new(socket, io_timeout).put("vm.power-button", None).map(|_| ()).map_err(|e| e.to_string())
    }

    fn quit(&self, socket: &Path, io_timeout: Duration) -> Result<(), String> {
        // Answered 200 by v53.0 (its API description says 204); either is success.
        ChApi::new(socket, io_timeout).put("vmm.shutdown", None).map(|_| ()).map_err(|e| e.to_string())
    }

    fn vm_state(&self, socket: &Path, io_timeout: Duration) -> Result<String, String> {
        state_of(&ChApi::new(socket, io_timeout)).map_err(|e| e.to_string())
    }

    fn save(&self, _socket: &Path, _out: std::os::fd::BorrowedFd<'_>, _timeout: Duration) -> Result<(), String> {
        Err(NO_SAVED_STATE.to_string())
    }

    fn resume(&self, socket: &Path, io_timeout: Duration) -> Result<(), String> {
        ChApi::new(socket, io_timeout).put("vm.resume", None).map(|_| ()).map_err(|e| e.to_string())
    }

    /// Starts `binary --api-socket` on a temporary socket, asks `vmm.ping` for its version,
    /// and shuts it down again (`vmm.shutdown`, then the kill path).
    fn probe(&self, binary: &Path) -> Result<String, String> {
        let dir = tempfile::Builder::new()
            .prefix("gpuvisor-ch-probe")
            .tempdir()
            .map_err(|e| format!("cannot make a directory for the probe: {e}"))?;
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
            .arg(api_socket_arg(&socket).map_err(|e| e.to_string())?)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .map(ProbeVmm)
            .map_err(|e| format!("{} cannot be run: {e}", binary.display()))?;
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
                        break Err(format!(
                            "{} exited before answering vmm.ping ({status}): {}",
                            binary.display(),
                            err.trim()
                        ));
                    }
                    if std::time::Instant::now() >= deadline {
                        break Err(format!("{} did not answer vmm.ping: {e}", binary.display()));
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
            serde_json::from_slice(&body).map_err(|e| format!("vmm.ping answered something that is not JSON: {e}"))?;
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
    fn nics_and_a_seed_are_refused_not_dropped() {
        let mut s = spec();
        s.seed = Some("/x/seed.iso".into());
        let e = CloudHypervisor.command_line(&s).unwrap_err().to_string();
        assert!(e.contains("use hypervisor qemu"), "{e}");
        let mut s = spec();
        s.nics = vec![super::super::NicSpec {
            mac: "52:54:00:00:00:01".into(),
            backend: super::super::NicBackend::User { restrict: true, forwards: vec![] },
        }];
        assert!(CloudHypervisor.command_line(&s).is_err());
        assert!(CloudHypervisor.command_line(&spec()).is_ok());
    }

    #[test]
    fn the_config_has_memory_in_bytes_the_serial_file_and_the_instance_uuid() {
        let v = serde_json::to_value(vm_config(&spec()).unwrap()).unwrap();
        assert_eq!(
            v,
            json!({
                "payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initrd.img", "cmdline": "console=ttyS0"},
                "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
                "memory": {"size": 536870912u64},
                "serial": {"mode": "File", "file": "/var/lib/gpuvisor/instances/x/serial.log"},
                "console": {"mode": "Off"},
                "platform": {"system_uuid": "6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"}
            })
        );
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
