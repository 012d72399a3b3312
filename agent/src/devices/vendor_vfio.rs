//! Vendor-specific VFIO (Linux >= 6.8, vGPU 17+/R580): a vGPU is created by writing a type
//! id into an SR-IOV VF's `nvidia/current_vgpu_type`, and destroyed by writing `0`
//! (NVIDIA-HOST.md §§2–3). gpuvisor never binds/unbinds VFs, never writes a PF and never
//! writes `sriov_numvfs`.

use super::catalog::{parse_creatable_vgpu_types, Catalog};
use super::{errno_name, link_basename, read_attr, write_attr, WriteError, NVIDIA_VENDOR};
use crate::host::HostRoot;
use std::fs;
use std::io;
use std::path::PathBuf;

/// One VF as read now.
#[derive(Debug, Clone)]
pub struct VfInfo {
    /// The VF's BDF.
    pub bdf: String,
    /// The parent PF's BDF (basename of `physfn`).
    pub pf: String,
    /// IOMMU group number (basename of `iommu_group`), if the link exists.
    pub iommu_group: Option<u32>,
    /// Names under `vfio-dev/` (`vfio<N>`; dynamic — never store them).
    pub cdevs: Vec<String>,
    /// Set when the VFIO paths (`iommu_group`, `vfio-dev/`) could not be read for a reason
    /// other than "absent": the open-handle targets are then unknown (fail closed).
    pub targets_error: Option<String>,
    /// `current_vgpu_type`: `Ok(0)` = no vGPU; `Err` = unreadable/unparseable (skip, never
    /// write).
    pub current_type: Result<u32, String>,
    /// `creatable_vgpu_types`, `Err` when unreadable.
    pub catalog: Result<Catalog, String>,
}

impl VfInfo {
    /// Readable and usable for placement decisions.
    pub fn readable(&self) -> bool {
        self.current_type.is_ok() && self.catalog.is_ok()
    }
}

/// One physical GPU with its VFs.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub bdf: String,
    /// PCI device id, e.g. `0x26b9`.
    pub device_id: String,
    pub numa_node: Option<i32>,
    pub vfs: Vec<VfInfo>,
}

fn nvidia_dir(host: &HostRoot, vf: &str) -> PathBuf {
    host.pci_device(vf).join("nvidia")
}

/// True when at least one vendor-VFIO VF is readable. Errors only when the devices
/// directory itself is unreadable (a missing directory means none).
pub fn probe(host: &HostRoot) -> Result<bool, String> {
    let bdfs = list_pci(host)?;
    Ok(bdfs.iter().any(|b| is_vendor_vf(host, b) && read_current_type(host, b).is_ok()))
}

/// An NVIDIA PF bound to `nvidia` with `sriov_totalvfs > 0` and `sriov_numvfs = 0`.
pub fn waiting_for_vfs(host: &HostRoot) -> bool {
    let Ok(bdfs) = list_pci(host) else { return false };
    bdfs.iter().any(|b| {
        let d = host.pci_device(b);
        read_attr(&d.join("vendor")).ok().as_deref() == Some(NVIDIA_VENDOR)
            && link_basename(&d.join("driver")).ok().as_deref() == Some("nvidia")
            && read_attr(&d.join("sriov_totalvfs")).ok().and_then(|s| s.parse::<u32>().ok()).unwrap_or(0) > 0
            && read_attr(&d.join("sriov_numvfs")).ok().and_then(|s| s.parse::<u32>().ok()) == Some(0)
    })
}

fn list_pci(host: &HostRoot) -> Result<Vec<String>, String> {
    let dir = host.pci_devices_dir();
    let rd = match fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot list {}: {}", dir.display(), errno_name(&e))),
    };
    // An error while listing is a probe error, never "fewer devices".
    let mut out = Vec::new();
    for e in rd {
        let e = e.map_err(|e| format!("cannot list {}: {}", dir.display(), errno_name(&e)))?;
        out.push(e.file_name().to_string_lossy().into_owned());
    }
    out.sort();
    Ok(out)
}

fn is_vendor_vf(host: &HostRoot, bdf: &str) -> bool {
    let d = host.pci_device(bdf);
    read_attr(&d.join("vendor")).ok().as_deref() == Some(NVIDIA_VENDOR)
        && fs::symlink_metadata(d.join("physfn")).is_ok()
        && d.join("nvidia/current_vgpu_type").exists()
}

/// Reads `current_vgpu_type` (a decimal id and a newline; `0` = none).
pub fn read_current_type(host: &HostRoot, vf: &str) -> io::Result<u32> {
    let s = read_attr(&nvidia_dir(host, vf).join("current_vgpu_type"))?;
    s.parse::<u32>().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("current_vgpu_type reads {s:?}")))
}

/// Reads and parses `creatable_vgpu_types`.
pub fn read_catalog(host: &HostRoot, vf: &str) -> io::Result<Catalog> {
    let text = fs::read_to_string(nvidia_dir(host, vf).join("creatable_vgpu_types"))?;
    Ok(parse_creatable_vgpu_types(&text))
}

/// Writes a type id (or `0`) to `current_vgpu_type` in one write on a fresh fd.
pub fn write_type(host: &HostRoot, vf: &str, id: u32) -> io::Result<()> {
    write_attr(&nvidia_dir(host, vf).join("current_vgpu_type"), &format!("{id}\n"))
}

/// Reads one VF.
pub fn read_vf(host: &HostRoot, bdf: &str, pf: String) -> VfInfo {
    let d = host.pci_device(bdf);
    let mut targets_error = None;
    let iommu_group = match link_basename(&d.join("iommu_group")) {
        Ok(g) => g.parse().ok(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            targets_error = Some(format!("{bdf}/iommu_group: {}", errno_or_msg(&e)));
            None
        }
    };
    let mut cdevs: Vec<String> = Vec::new();
    match fs::read_dir(d.join("vfio-dev")) {
        Ok(rd) => {
            for e in rd {
                match e {
                    Ok(e) => cdevs.push(e.file_name().to_string_lossy().into_owned()),
                    Err(e) => targets_error = Some(format!("{bdf}/vfio-dev: {}", errno_or_msg(&e))),
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => targets_error = Some(format!("{bdf}/vfio-dev: {}", errno_or_msg(&e))),
    }
    cdevs.sort();
    let current_type = read_current_type(host, bdf).map_err(|e| errno_or_msg(&e));
    let catalog = read_catalog(host, bdf).map_err(|e| errno_or_msg(&e));
    if let Err(e) = &current_type {
        tracing::warn!(gpu.device = %bdf, error = %e, "skipping unreadable VF");
    }
    VfInfo { bdf: bdf.to_string(), pf, iommu_group, cdevs, targets_error, current_type, catalog }
}

fn errno_or_msg(e: &io::Error) -> String {
    if e.raw_os_error().is_some() {
        errno_name(e)
    } else {
        e.to_string()
    }
}

/// The device nodes that identify a VF's holders: `dev/vfio/<group>` and every
/// `dev/vfio/devices/<vfio-dev entry>` (NVIDIA-HOST.md §5). A missing `iommu_group` link or
/// `vfio-dev/` directory means fewer targets; any other read error is `Err` (the scan's
/// result is then unknown).
pub fn vf_targets(host: &HostRoot, vf: &VfInfo) -> Result<Vec<PathBuf>, String> {
    if let Some(e) = &vf.targets_error {
        return Err(format!("the VFIO paths of {} cannot be read: {e}", vf.bdf));
    }
    let mut t = Vec::new();
    if let Some(g) = vf.iommu_group {
        t.push(host.vfio_group_node(g));
    }
    for c in &vf.cdevs {
        t.push(host.vfio_cdev_node(c));
    }
    Ok(t)
}

/// Every vendor-VFIO GPU and its VFs, read now. One unreadable VF is kept (marked
/// unreadable), never hiding the rest. Errors: the PCI devices directory is unreadable.
pub fn inventory(host: &HostRoot) -> Result<Vec<GpuInfo>, String> {
    let bdfs = list_pci(host)?;
    let mut gpus: Vec<GpuInfo> = Vec::new();
    for bdf in &bdfs {
        if !is_vendor_vf(host, bdf) {
            continue;
        }
        let Ok(pf) = link_basename(&host.pci_device(bdf).join("physfn")) else { continue };
        let vf = read_vf(host, bdf, pf.clone());
        match gpus.iter_mut().find(|g| g.bdf == pf) {
            Some(g) => g.vfs.push(vf),
            None => {
                let pd = host.pci_device(&pf);
                gpus.push(GpuInfo {
                    device_id: read_attr(&pd.join("device")).unwrap_or_default(),
                    numa_node: read_attr(&pd.join("numa_node")).ok().and_then(|s| s.parse().ok()),
                    bdf: pf,
                    vfs: vec![vf],
                })
            }
        }
    }
    gpus.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    for g in &mut gpus {
        g.vfs.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    }
    Ok(gpus)
}

/// Why a configure step did not set the type.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigureError {
    /// The driver refused the type here now (EINVAL/EIO/not in the fresh catalog): try the
    /// next candidate. Never branch on which errno came back for placement (NVIDIA-HOST.md
    /// §4); `eio` only feeds the device's health strikes.
    NotCreatable(WriteError),
    /// The read-back shows a value gpuvisor did not write: another writer is on the VF.
    Foreign { value: u32 },
    /// Unexpected I/O error (the VF vanished, unreadable file).
    Io(String),
}

impl std::fmt::Display for ConfigureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigureError::NotCreatable(w) => write!(f, "not creatable here now: {w}"),
            ConfigureError::Foreign { value } => write!(f, "another writer set type {value} on the VF"),
            ConfigureError::Io(m) => write!(f, "{m}"),
        }
    }
}

/// Sets the profile's type on a VF that reads `0`: looks the name up in the VF's fresh
/// catalog, writes the id, reads back. Returns the type id written.
/// The caller holds the allocation and device locks and the claim is durable.
pub fn set_type(host: &HostRoot, vf: &str, profile: &str) -> Result<u32, ConfigureError> {
    let catalog = read_catalog(host, vf).map_err(|e| ConfigureError::Io(format!("catalog: {}", errno_name(&e))))?;
    let Some(entry) = catalog.find(profile) else {
        return Err(ConfigureError::NotCreatable(WriteError::other(format!(
            "{profile} is not in the catalog of {vf}"
        ))));
    };
    let id = entry.id;
    let write = write_type(host, vf, id);
    let back =
        read_current_type(host, vf).map_err(|e| ConfigureError::Io(format!("read-back: {}", errno_or_msg(&e))))?;
    tracing::debug!(gpu.device = %vf, type_id = id, read_back = back, write = ?write.as_ref().err().map(errno_name), "type write");
    match back {
        v if v == id => Ok(id),
        0 => Err(ConfigureError::NotCreatable(match write {
            Err(e) => WriteError::from_io(&format!("writing {id}"), &e),
            Ok(()) => WriteError::other(format!("{id} was accepted but reads back 0")),
        })),
        v => Err(ConfigureError::Foreign { value: v }),
    }
}

/// Outcome of a clear (`0`) write.
#[derive(Debug, Clone, PartialEq)]
pub enum ClearError {
    /// The write failed and the VF still holds a type (EBUSY during teardown, EIO, ...).
    Failed(WriteError),
    /// The read-back shows another non-zero type than the one expected (a foreign writer).
    Foreign { value: u32 },
}

impl std::fmt::Display for ClearError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClearError::Failed(m) => write!(f, "{m}"),
            ClearError::Foreign { value } => write!(f, "VF reads type {value}, which gpuvisor did not write"),
        }
    }
}

/// Clears a VF: a missing file (VF gone) or `0` is already done; otherwise write `0` and
/// read back — `0` is success whatever the write returned (EPERM on an already-clear VF is
/// the normal "already clear", NVIDIA-HOST.md §3.2).
/// `expected`: the type gpuvisor believes is set (None: any).
/// The caller has proven the owner dead and scanned for holders under the device lock.
pub fn clear(host: &HostRoot, vf: &str, expected: Option<u32>) -> Result<(), ClearError> {
    let cur = match read_current_type(host, vf) {
        Ok(v) => v,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(ClearError::Failed(WriteError::other(format!(
                "cannot read current_vgpu_type: {}",
                errno_or_msg(&e)
            ))))
        }
    };
    if cur == 0 {
        return Ok(());
    }
    if let Some(exp) = expected {
        if exp != cur {
            return Err(ClearError::Foreign { value: cur });
        }
    }
    let write = write_type(host, vf, 0);
    match read_current_type(host, vf) {
        Ok(0) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Ok(v) => Err(ClearError::Failed(match write {
            Err(e) => {
                let w = WriteError::from_io("writing 0", &e);
                WriteError { message: format!("{} (still reads {v})", w.message), ..w }
            }
            Ok(()) => WriteError::other(format!("0 was accepted but the VF still reads {v}")),
        })),
        Err(e) => Err(ClearError::Failed(WriteError::other(format!("read-back after clear: {}", errno_or_msg(&e))))),
    }
}
