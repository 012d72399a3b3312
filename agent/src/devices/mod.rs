//! # devices — native device backends
//!
//! One backend per framework: [`vendor_vfio`] (type ids written to SR-IOV VFs) and
//! [`mdev`] (mediated devices). Each discovers GPUs and devices (inventory), configures a
//! claimed device, and clears one. Framework detection follows NVIDIA-HOST.md §1. Nothing
//! here is cached: every call reads sysfs again (catalogs shrink as GPUs fill).
//!
//! The functions here are primitives; the **release guard** in `instances` is the only
//! caller that clears a device, always after a fresh open-handle scan under the device
//! lock.

pub mod catalog;
pub mod mdev;
pub mod vendor_vfio;

use crate::host::HostRoot;
use std::fs;
use std::io;
use std::path::Path;

/// NVIDIA's PCI vendor id as sysfs prints it.
pub const NVIDIA_VENDOR: &str = "0x10de";

/// What the host's driver offers (NVIDIA-HOST.md §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostMode {
    /// VFs bound to `nvidia` with `nvidia/current_vgpu_type`.
    VendorVfio,
    /// `sys/class/mdev_bus` entries with non-empty `mdev_supported_types`.
    Mdev,
    /// Both probes found devices: vGPU claims are refused.
    Mixed,
    /// An NVIDIA PF has `sriov_totalvfs > 0` and `sriov_numvfs = 0`: not ready yet.
    WaitingForVfs,
    /// No vGPU-capable device.
    None,
}

impl HostMode {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            HostMode::VendorVfio => "vendor_vfio",
            HostMode::Mdev => "mdev",
            HostMode::Mixed => "mixed",
            HostMode::WaitingForVfs => "waiting_for_vfs",
            HostMode::None => "none",
        }
    }
}

/// Detects the vGPU framework. Errors: a probe error (e.g. `mdev_bus` unreadable) — the
/// caller reports "not ready" and never falls through to another framework.
pub fn detect(host: &HostRoot) -> Result<HostMode, String> {
    let mdev = mdev::probe(host)?;
    let vendor = vendor_vfio::probe(host)?;
    Ok(match (mdev, vendor) {
        (true, true) => HostMode::Mixed,
        (true, false) => HostMode::Mdev,
        (false, true) => HostMode::VendorVfio,
        (false, false) => {
            if vendor_vfio::waiting_for_vfs(host) {
                HostMode::WaitingForVfs
            } else {
                HostMode::None
            }
        }
    })
}

/// Reads a small sysfs attribute, trimmed.
pub fn read_attr(path: &Path) -> io::Result<String> {
    Ok(fs::read_to_string(path)?.trim().to_string())
}

/// The basename of a symlink's target (sysfs links are relative; never match prefixes).
pub fn link_basename(path: &Path) -> io::Result<String> {
    let target = fs::read_link(path)?;
    target
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "link without basename"))
}

/// Writes `value` with one `write(2)` on a freshly opened fd (sysfs store semantics).
pub(crate) fn write_attr(path: &Path, value: &str) -> io::Result<()> {
    use std::io::Write;
    let mut f = fs::OpenOptions::new().write(true).open(path)?;
    let n = f.write(value.as_bytes())?;
    if n != value.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short sysfs write"));
    }
    Ok(())
}

/// A sysfs write that did not take effect: the message for people, and whether the kernel
/// answered EIO. LIFECYCLE.md "Device health" counts EIO strikes (the first makes a device
/// `suspect`, a second in a row quarantines it). NVIDIA-HOST.md §4: on a type write, EIO is
/// the resource manager refusing a type the VF's catalog listed (`NVRM: Failed to add vgpu
/// create request`), not the transient EBUSY of a teardown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteError {
    pub message: String,
    pub eio: bool,
}

impl WriteError {
    /// A failure that is not an errno of the write itself (read-back mismatch, a device
    /// that did not appear, an unreadable file).
    pub fn other(message: impl Into<String>) -> WriteError {
        WriteError { message: message.into(), eio: false }
    }

    /// `what` failed with the errno of `e` (`"<what> failed with EIO"`).
    pub fn from_io(what: &str, e: &io::Error) -> WriteError {
        WriteError {
            message: format!("{what} failed with {}", errno_name(e)),
            eio: e.raw_os_error() == Some(libc::EIO),
        }
    }
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The errno name of an I/O error (`EBUSY`, `EIO`, ...) for messages and records.
pub fn errno_name(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => format!("{:?}", nix::errno::Errno::from_raw(n)),
        None => e.to_string(),
    }
}

/// The model name of a GPU by PCI device id, for the models the presets and docs use;
/// `None` when unknown (the caller then derives it from profile names).
pub fn model_by_device_id(device_id: &str) -> Option<&'static str> {
    match device_id.trim_start_matches("0x") {
        "26b9" => Some("NVIDIA L40S"),
        "26b5" => Some("NVIDIA L40"),
        "2335" => Some("NVIDIA H200"),
        "2330" => Some("NVIDIA H100 SXM"),
        "26b1" => Some("NVIDIA RTX 6000 Ada"),
        "20b5" => Some("NVIDIA A100 80GB"),
        _ => None,
    }
}
