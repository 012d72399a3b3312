//! # devices — native device backends
//!
//! One backend per framework: [`vendor_vfio`] (type ids written to SR-IOV VFs),
//! [`mdev`] (mediated devices) and [`passthrough`] (whole GPUs bound to `vfio-pci`). [`scan`] reads the whole host once — framework detection
//! (docs/design/host.md §1), every VF and its catalog, every mdev parent and mdev — reading each
//! sysfs file once; nothing here is cached (catalogs shrink as GPUs fill).
//!
//! What each kind means — observing its GPUs, configuring and clearing a claimed device,
//! attaching it — is its [`backend::Backend`] (one implementation per kind file;
//! [`backend::backend`] picks it by the claim's kind, [`backend::backends`] lists them for
//! an observation). The primitives that clear a device are private to their kind's file
//! and reached only through
//! [`backend::Backend::clear`], which only the release path (`instances::release`) calls,
//! always after a fresh open-handle scan under the device lock.
//!
//! Unreadable is never absent: a device whose state cannot be read is returned as an
//! [`UnreadableDevice`] naming it and why, and a listing that fails is an error, never
//! "fewer devices".

pub mod backend;
pub mod catalog;
pub mod mdev;
pub mod observed;
pub mod passthrough;
pub mod vendor_vfio;

pub use backend::{
    backend, backends, Answer, Backend, ClaimedDevice, ClearError, ClearSteps, ConfigureSteps, Held, NotRecorded,
    Refused, Verdict, VfioDevice, WriteSite,
};

use crate::host::HostRoot;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// NVIDIA's PCI vendor id as sysfs prints it.
pub const NVIDIA_VENDOR: &str = "0x10de";

/// What the host's driver offers (docs/design/host.md §1).
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

/// Errors of the device backends: what could not be read, listed or made sense of. An
/// error makes a device unreadable (never clear, never written) and a scan of its holders
/// unknown. `Clone` and comparable: a reading is kept with the device it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// A sysfs directory exists but cannot be listed: a probe error, never "no devices".
    #[error("cannot list {}: {errno}", path.display())]
    List {
        /// The directory.
        path: PathBuf,
        /// The errno name of the failed listing (e.g. `EACCES`).
        errno: String,
    },
    /// Vendor-VFIO VFs exist but none of their types can be read (docs/design/host.md §1: fail
    /// only if no VF at all is readable).
    #[error("no VF's current_vgpu_type can be read ({count} VFs)")]
    NoReadableVf {
        /// How many VFs were found.
        count: usize,
    },
    /// A VF attribute (`current_vgpu_type`, `creatable_vgpu_types`) cannot be read: the
    /// errno name (`EIO`), or what it reads when that is not what the driver writes.
    #[error("{0}")]
    Attr(String),
    /// `what` (a sysfs file or link, named as a sentence starts: `its class`, `mdev
    /// <uuid>/mdev_type`) cannot be read: the errno name, or what it reads.
    #[error("{what} cannot be read: {reason}")]
    Unreadable {
        /// The file or link, named as a sentence starts.
        what: String,
        /// The errno name, or what it reads.
        reason: String,
    },
    /// `what` (a sysfs directory, named as a sentence starts) cannot be listed: the errno
    /// name.
    #[error("{what} cannot be listed: {errno}")]
    Unlisted {
        /// The directory, named as a sentence starts.
        what: String,
        /// The errno name of the failed listing.
        errno: String,
    },
    /// A VF's `current_vgpu_type` cannot be read now (a dirty check: the device's state is
    /// unknown).
    #[error("current_vgpu_type unreadable: {0}")]
    TypeUnreadable(String),
    /// The VFIO nodes of the PCI function `bdf` (its `iommu_group` link, its `vfio-dev/`)
    /// cannot be read: its holders are unknown.
    #[error("the VFIO paths of {bdf} cannot be read: {reason}")]
    VfioPaths {
        /// The PCI function's address.
        bdf: String,
        /// Why they cannot be read.
        reason: String,
    },
    /// An mdev's `mdev_type` link does not point into a parent's `mdev_supported_types`.
    #[error("mdev {uuid}/mdev_type points to {}, not a parent's type", target.display())]
    MdevTypeLink {
        /// The mdev's UUID.
        uuid: String,
        /// Where its `mdev_type` link points.
        target: PathBuf,
    },
    /// A PCI function named as a passthrough GPU is not a display controller.
    #[error("it is not a GPU (PCI class {class}, not a display controller 0x03xxxx)")]
    NotAGpu {
        /// Its PCI class as read (e.g. `0x020000`).
        class: String,
    },
    /// A GPU's `iommu_group` link does not end in a group number.
    #[error("its iommu_group link does not name a group number")]
    GroupLink,
    /// A GPU's IOMMU group does not list the GPU itself.
    #[error("its IOMMU group {group} does not list it")]
    NotInGroup {
        /// The group the GPU's `iommu_group` link names.
        group: u32,
    },
    /// The NVIDIA driver's `information` file of a GPU has a `Device Minor` that is not a
    /// number.
    #[error("{}: Device Minor reads {value:?}", path.display())]
    DeviceMinor {
        /// The `information` file.
        path: PathBuf,
        /// What its `Device Minor` line reads.
        value: String,
    },
    /// A backend was handed a claim of another kind (a bug: [`backend::backend`] picks by
    /// kind).
    #[error("the {backend} backend was handed a {framework} claim of {device}")]
    WrongKind {
        /// The backend that was called (`vendor_vfio`, `mdev`, `passthrough`).
        backend: &'static str,
        /// The kind of the claim it was handed.
        framework: &'static str,
        /// The claimed device.
        device: String,
    },
}

impl DeviceError {
    /// [`DeviceError::Unreadable`] of `what`, with the errno name of `e`.
    pub(crate) fn unreadable(what: impl Into<String>, e: &io::Error) -> DeviceError {
        DeviceError::Unreadable { what: what.into(), reason: errno_name(e) }
    }

    /// [`DeviceError::Unlisted`] of `what`, with the errno name of `e`.
    pub(crate) fn unlisted(what: impl Into<String>, e: &io::Error) -> DeviceError {
        DeviceError::Unlisted { what: what.into(), errno: errno_name(e) }
    }
}

/// A device that exists but whose state cannot be read: counted as unreadable everywhere,
/// never shown as clear, never written to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UnreadableDevice {
    /// The device (VF BDF, PCI function, mdev directory name).
    pub address: String,
    /// The GPU (PF) it belongs to, when known.
    pub gpu: Option<String>,
    /// The mdev parent it sits on, for an mdev (from where its device link points).
    pub parent: Option<String>,
    /// Why (one sentence with the errno).
    pub reason: String,
}

/// One read of the host's GPU devices.
#[derive(Debug, Clone)]
pub struct HostScan {
    /// The framework, or the probe error (not ready; never a fallback).
    pub mode: Result<HostMode, DeviceError>,
    /// Vendor-VFIO GPUs and their VFs (readable or not).
    pub vendor: Vec<vendor_vfio::GpuInfo>,
    /// mdev parents and their types.
    pub parents: Vec<mdev::MdevParent>,
    /// Existing mdevs.
    pub mdevs: Vec<mdev::MdevDevice>,
    /// Devices skipped because their state cannot be read.
    pub unreadable: Vec<UnreadableDevice>,
    /// `sys/module/nvidia/version`.
    pub driver_version: Option<String>,
}

impl HostScan {
    /// True when every listing succeeded and the framework probe decided (the observation
    /// a reconcile pass needs before it may release or sweep anything, docs/design/invariants.md I13).
    pub fn complete(&self) -> bool {
        self.mode.is_ok()
    }
}

/// Reads the host once (docs/design/host.md §1: mdev probe, vendor-VFIO probe, decide; then the
/// inventory of the detected framework). Never fails: a probe error is in `mode`. The
/// passthrough GPUs (`whole`) and their VFs are not vGPU devices: skipped.
pub fn scan(host: &HostRoot, whole: &[String]) -> HostScan {
    let is_whole = |bdf: &str| whole.iter().any(|w| w.eq_ignore_ascii_case(bdf));
    let driver_version = read_attr(&host.nvidia_version_path()).ok();
    let mut unreadable = Vec::new();
    let out = |mode, vendor, parents, mdevs, unreadable| HostScan {
        mode,
        vendor,
        parents,
        mdevs,
        unreadable,
        driver_version: driver_version.clone(),
    };
    // 1. mdev probe.
    let parents = match mdev::parents(host) {
        Ok(p) => p,
        Err(e) => return out(Err(e), vec![], vec![], vec![], unreadable),
    };
    for p in &parents {
        if let Err(reason) = &p.types {
            unreadable.push(UnreadableDevice {
                address: p.bdf.clone(),
                gpu: Some(p.pf.clone()),
                parent: None,
                reason: reason.to_string(),
            });
        }
    }
    let mdev_found = mdev::probe(&parents);
    let mdevs = if mdev_found {
        match mdev::devices(host) {
            Ok((d, u)) => {
                unreadable.extend(u);
                d
            }
            Err(e) => return out(Err(e), vec![], parents, vec![], unreadable),
        }
    } else {
        Vec::new()
    };
    // 2. vendor-VFIO probe (one read of every PCI function).
    let pci = match list_dir(&host.pci_devices_dir()) {
        Ok(p) => p,
        Err(e) => return out(Err(e), vec![], parents, mdevs, unreadable),
    };
    let mut vendor: Vec<vendor_vfio::GpuInfo> = Vec::new();
    let mut vfs_seen = 0usize;
    let mut pfs = Vec::new();
    for bdf in pci.iter().filter(|b| !is_whole(b)) {
        let d = host.pci_device(bdf);
        match read_attr(&d.join("vendor")) {
            Ok(v) if v == NVIDIA_VENDOR => {}
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                unreadable.push(UnreadableDevice {
                    address: bdf.clone(),
                    gpu: None,
                    parent: None,
                    reason: format!("vendor cannot be read: {}", errno_name(&e)),
                });
                continue;
            }
        }
        let pf = match link_basename(&d.join("physfn")) {
            Ok(pf) => pf,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                pfs.push(bdf.clone());
                continue;
            }
            Err(e) => {
                unreadable.push(UnreadableDevice {
                    address: bdf.clone(),
                    gpu: None,
                    parent: None,
                    reason: format!("physfn cannot be read: {}", errno_name(&e)),
                });
                continue;
            }
        };
        if is_whole(&pf) {
            continue;
        }
        let current_type = match vendor_vfio::read_current_type(host, bdf) {
            // No nvidia/ directory: not a vendor-VFIO VF (e.g. an mdev parent).
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            r => r.map_err(|e| DeviceError::Attr(vendor_vfio::errno_or_msg(&e))),
        };
        vfs_seen += 1;
        let vf = vendor_vfio::read_vf_with_type(host, bdf, pf.clone(), current_type);
        if let Some(reason) = vf.unreadable_reason() {
            unreadable.push(UnreadableDevice { address: vf.bdf.clone(), gpu: Some(pf.clone()), parent: None, reason });
        }
        match vendor.iter_mut().find(|g| g.bdf == pf) {
            Some(g) => g.vfs.push(vf),
            None => {
                let pd = host.pci_device(&pf);
                vendor.push(vendor_vfio::GpuInfo {
                    device_id: read_attr(&pd.join("device")).unwrap_or_default(),
                    numa_node: read_attr(&pd.join("numa_node")).ok().and_then(|s| s.parse().ok()),
                    bdf: pf,
                    vfs: vec![vf],
                })
            }
        }
    }
    vendor.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    for g in &mut vendor {
        g.vfs.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    }
    let readable_vf = vendor.iter().flat_map(|g| &g.vfs).any(|v| v.current_type.is_ok());
    if vfs_seen > 0 && !readable_vf {
        return out(Err(DeviceError::NoReadableVf { count: vfs_seen }), vendor, parents, mdevs, unreadable);
    }
    // 3. decide; 4. not ready is not passthrough.
    let mode = match (mdev_found, readable_vf) {
        (true, true) => HostMode::Mixed,
        (true, false) => HostMode::Mdev,
        (false, true) => HostMode::VendorVfio,
        (false, false) if pfs.iter().any(|pf| waiting_for_vfs(host, pf)) => HostMode::WaitingForVfs,
        (false, false) => HostMode::None,
    };
    out(Ok(mode), vendor, parents, mdevs, unreadable)
}

/// An NVIDIA PF bound to `nvidia` with `sriov_totalvfs > 0` and `sriov_numvfs = 0`.
fn waiting_for_vfs(host: &HostRoot, pf: &str) -> bool {
    let d = host.pci_device(pf);
    link_basename(&d.join("driver")).ok().as_deref() == Some("nvidia")
        && read_attr(&d.join("sriov_totalvfs")).ok().and_then(|s| s.parse::<u32>().ok()).unwrap_or(0) > 0
        && read_attr(&d.join("sriov_numvfs")).ok().and_then(|s| s.parse::<u32>().ok()) == Some(0)
}

/// The NVIDIA GPUs of the host: PCI functions of vendor NVIDIA that are not SR-IOV VFs
/// (no `physfn`) and whose class is a display controller (`0x03xxxx`; a function whose
/// class cannot be read counts). What an agent without `managed_gpus` manages, and locks
/// ([`crate::host::lock`]). Errors: the PCI devices cannot be listed.
pub fn nvidia_gpus(host: &HostRoot) -> Result<Vec<String>, DeviceError> {
    let mut out = Vec::new();
    for bdf in list_dir(&host.pci_devices_dir())? {
        let d = host.pci_device(&bdf);
        if read_attr(&d.join("vendor")).ok().as_deref() != Some(NVIDIA_VENDOR) {
            continue;
        }
        if fs::symlink_metadata(d.join("physfn")).is_ok() {
            continue;
        }
        if read_attr(&d.join("class")).is_ok_and(|c| !c.starts_with("0x03")) {
            continue;
        }
        out.push(bdf);
    }
    Ok(out)
}

/// The entries of a sysfs directory, sorted. A missing directory means none; any other error
/// (also while iterating) is a [`DeviceError::List`], never "fewer entries".
pub(crate) fn list_dir(dir: &Path) -> Result<Vec<String>, DeviceError> {
    let err = |e: &io::Error| DeviceError::List { path: dir.to_path_buf(), errno: errno_name(e) };
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(err(&e)),
    };
    let mut out = Vec::new();
    for e in rd {
        out.push(e.map_err(|e| err(&e))?.file_name().to_string_lossy().into_owned());
    }
    out.sort();
    Ok(out)
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

/// A sysfs write that did not take effect: the message for people, and the errno the
/// kernel answered, if the write itself failed. docs/design/lifecycle.md "Device health" counts EIO
/// strikes; docs/design/host.md §4: on a type write, EIO is the resource manager refusing a type
/// the VF's catalog listed (`NVRM: Failed to add vgpu create request`), not the transient
/// EBUSY of a teardown.
/// What a clear (a VF's type `0`, an mdev `remove`) found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cleared {
    /// gpuvisor's own write took effect: the device was occupied and reads clear now.
    Wrote,
    /// The device was already clear (or gone) — no write of gpuvisor's cleared it: another
    /// writer did, or there was nothing to clear.
    FoundClear,
}

/// A sysfs write that failed: what was written where and what came back, with the errno
/// when the kernel gave one (it feeds the device's health accounting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteError {
    /// The failure in one sentence (the file, the value, the error).
    pub message: String,
    /// The errno the write failed with (`libc::EIO`, ...); `None` when it did not fail with
    /// one (e.g. a write that never returned).
    pub errno: Option<i32>,
}

impl WriteError {
    /// A failure that is not an errno of the write itself (read-back mismatch, a device
    /// that did not appear, an unreadable file).
    pub fn other(message: impl Into<String>) -> WriteError {
        WriteError { message: message.into(), errno: None }
    }

    /// `what` failed with the errno of `e` (`"<what> failed with EIO"`).
    pub fn from_io(what: &str, e: &io::Error) -> WriteError {
        WriteError { message: format!("{what} failed with {}", errno_name(e)), errno: e.raw_os_error() }
    }

    /// The kernel answered EIO.
    pub fn eio(&self) -> bool {
        self.errno == Some(libc::EIO)
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

/// The framebuffer of a GPU by PCI device id, MiB, for the models the presets use.
pub fn framebuffer_by_device_id(device_id: &str) -> Option<u64> {
    match device_id.trim_start_matches("0x") {
        "26b9" | "26b5" | "26b1" => Some(49152),
        "2335" => Some(144384),
        _ => None,
    }
}
