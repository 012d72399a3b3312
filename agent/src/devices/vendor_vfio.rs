//! Vendor-specific VFIO (Linux >= 6.8, vGPU 17+/R580): a vGPU is created by writing a type
//! id into an SR-IOV VF's `nvidia/current_vgpu_type`, and destroyed by writing `0`
//! (docs/design/host.md §§2–3). gpuvisor never binds/unbinds VFs, never writes a PF and never
//! writes `sriov_numvfs`.
//!
//! [`set_type`] only ever writes a non-zero id; the one primitive that writes `0` is the
//! private `clear`, reached only through [`VendorVfio`]'s [`Backend::clear`], which only the
//! release path (`instances::release`) calls.

use super::backend::{
    group_of, wrong_kind, Backend, ClaimedDevice, ClearError, ClearSteps, ConfigureSteps, Held, Refused, Verdict,
    VfioDevice, WriteSite,
};
use super::catalog::{parse_creatable_vgpu_types, Catalog};
use super::observed::{
    load_of, Candidate, DeviceRecords, ObserveSteps, Observed, ObservedDevice, ObservedGpu, TypeReading as Reading,
};
use super::{errno_name, link_basename, read_attr, write_attr, Cleared, DeviceError, WriteError};
use super::{HostMode, HostScan};
use crate::domain::{ClaimKind, ClaimState};
use crate::host::HostRoot;
use gpuvisor_sdk::{profile_framebuffer_mib, DeviceState};
use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::num::NonZeroU32;
use std::path::PathBuf;

/// What `current_vgpu_type` reads: a type id, `0` (no vGPU), or unreadable
/// ([`DeviceError::Attr`]).
pub type TypeReading = Result<u32, DeviceError>;

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
    pub current_type: TypeReading,
    /// `creatable_vgpu_types`, `Err` when unreadable ([`DeviceError::Attr`]).
    pub catalog: Result<Catalog, DeviceError>,
}

impl VfInfo {
    /// Readable and usable for placement decisions.
    pub fn readable(&self) -> bool {
        self.current_type.is_ok() && self.catalog.is_ok()
    }

    /// Why the VF cannot be used, if it cannot (its type or catalog is unreadable).
    pub fn unreadable_reason(&self) -> Option<String> {
        match (&self.current_type, &self.catalog) {
            (Err(e), _) => Some(format!("current_vgpu_type cannot be read: {e}")),
            (_, Err(e)) => Some(format!("creatable_vgpu_types cannot be read: {e}")),
            _ => None,
        }
    }
}

/// One physical GPU with its VFs.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    /// The GPU's (PF's) PCI address.
    pub bdf: String,
    /// PCI device id, e.g. `0x26b9`.
    pub device_id: String,
    /// The GPU's NUMA node (sysfs `numa_node`); `None` when unreadable or none (`-1`).
    pub numa_node: Option<i32>,
    /// Its SR-IOV VFs, in `virtfn` order.
    pub vfs: Vec<VfInfo>,
}

fn nvidia_dir(host: &HostRoot, vf: &str) -> PathBuf {
    host.pci_device(vf).join("nvidia")
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

/// Writes a type id to `current_vgpu_type` in one write on a fresh fd. Never `0`: only
/// [`clear`] destroys a vGPU.
fn write_type(host: &HostRoot, vf: &str, id: NonZeroU32) -> io::Result<()> {
    write_attr(&nvidia_dir(host, vf).join("current_vgpu_type"), &format!("{id}\n"))
}

/// Reads one VF whose type has already been read (`current_type`): its VFIO paths and its
/// catalog.
pub(crate) fn read_vf_with_type(host: &HostRoot, bdf: &str, pf: String, current_type: TypeReading) -> VfInfo {
    let (iommu_group, cdevs, targets_error) = vfio_paths(host, bdf);
    let catalog = read_catalog(host, bdf).map_err(|e| DeviceError::Attr(errno_or_msg(&e)));
    VfInfo { bdf: bdf.to_string(), pf, iommu_group, cdevs, targets_error, current_type, catalog }
}

/// The VFIO nodes of any PCI function (a VF, a passthrough function): its IOMMU group
/// number and its `vfio-dev/` (iommufd cdev) entries, or why they cannot be read.
fn vfio_paths(host: &HostRoot, bdf: &str) -> (Option<u32>, Vec<String>, Option<String>) {
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
    (iommu_group, cdevs, targets_error)
}

/// The device nodes whose holders use the PCI function `bdf`: `dev/vfio/<group>` and its
/// `dev/vfio/devices/<vfio-dev entry>`s (docs/design/host.md §5). Errors as [`vf_targets`].
pub fn function_targets(host: &HostRoot, bdf: &str) -> Result<Vec<PathBuf>, DeviceError> {
    let (iommu_group, cdevs, error) = vfio_paths(host, bdf);
    if let Some(reason) = error {
        return Err(DeviceError::VfioPaths { bdf: bdf.to_string(), reason });
    }
    Ok(iommu_group
        .map(|g| host.vfio_group_node(g))
        .into_iter()
        .chain(cdevs.iter().map(|c| host.vfio_cdev_node(c)))
        .collect())
}

/// Reads one VF now (type, VFIO paths, catalog).
pub fn read_vf(host: &HostRoot, bdf: &str, pf: String) -> VfInfo {
    let current_type = read_current_type(host, bdf).map_err(|e| DeviceError::Attr(errno_or_msg(&e)));
    read_vf_with_type(host, bdf, pf, current_type)
}

pub(crate) fn errno_or_msg(e: &io::Error) -> String {
    if e.raw_os_error().is_some() {
        errno_name(e)
    } else {
        e.to_string()
    }
}

/// The device nodes that identify a VF's holders: `dev/vfio/<group>` and every
/// `dev/vfio/devices/<vfio-dev entry>` (docs/design/host.md §5). A missing `iommu_group` link or
/// `vfio-dev/` directory means fewer targets; any other read error is `Err` (the scan's
/// result is then unknown).
pub fn vf_targets(host: &HostRoot, vf: &VfInfo) -> Result<Vec<PathBuf>, DeviceError> {
    if let Some(reason) = &vf.targets_error {
        return Err(DeviceError::VfioPaths { bdf: vf.bdf.clone(), reason: reason.clone() });
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

/// Why a configure step did not set the type.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigureError {
    /// The VF's fresh catalog does not list the profile (the GPU filled up or changed size
    /// since the observation): nothing was written.
    NotListed(String),
    /// The driver refused the type here now (EINVAL/EIO/not in the fresh catalog): try the
    /// next candidate. Never branch on which errno came back for placement (docs/design/host.md
    /// §4); the errno only feeds the device's health accounting.
    NotCreatable(WriteError),
    /// The read-back shows a value gpuvisor did not write: another writer is on the VF.
    Foreign {
        /// The type id the VF reads back.
        value: u32,
    },
    /// Unexpected I/O error (the VF vanished, unreadable file).
    Io(String),
}

impl std::fmt::Display for ConfigureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigureError::NotListed(m) => write!(f, "{m}"),
            ConfigureError::NotCreatable(w) => write!(f, "not creatable here now: {w}"),
            ConfigureError::Foreign { value } => write!(f, "another writer set type {value} on the VF"),
            ConfigureError::Io(m) => write!(f, "{m}"),
        }
    }
}

/// Sets the profile's type on a VF that reads `0`: looks the name up in the VF's fresh
/// catalog, writes the id, reads back. Returns the type id written.
/// The caller holds the configure and device locks and the claim is durable.
///
/// Private: the claim path reaches it through [`VendorVfio`]'s [`Backend::configure`].
fn set_type(host: &HostRoot, vf: &str, profile: &str) -> Result<u32, ConfigureError> {
    let catalog = read_catalog(host, vf).map_err(|e| ConfigureError::Io(format!("catalog: {}", errno_name(&e))))?;
    let Some(entry) = catalog.find(profile) else {
        return Err(ConfigureError::NotListed(format!("{profile} is not in the catalog of {vf}")));
    };
    // The parser never yields id 0 (docs/design/host.md §3.1: 0 is "no vGPU").
    let Some(id) = NonZeroU32::new(entry.id) else {
        return Err(ConfigureError::Io(format!("the catalog of {vf} lists {profile} as id 0")));
    };
    let write = write_type(host, vf, id);
    let back =
        read_current_type(host, vf).map_err(|e| ConfigureError::Io(format!("read-back: {}", errno_or_msg(&e))))?;
    match back {
        v if v == id.get() => Ok(id.get()),
        0 => Err(ConfigureError::NotCreatable(match write {
            Err(e) => WriteError::from_io(&format!("writing {id}"), &e),
            Ok(()) => WriteError::other(format!("{id} was accepted but reads back 0")),
        })),
        v => Err(ConfigureError::Foreign { value: v }),
    }
}

/// Clears a VF: a missing file (VF gone) or `0` is already done; otherwise write `0` and
/// read back — `0` is success whatever the write returned (EPERM on an already-clear VF is
/// the normal "already clear", docs/design/host.md §3.2). [`Cleared::Wrote`](super::Cleared)
/// only when this write took effect; a VF found clear, or cleared by another writer
/// meanwhile, is [`Cleared::FoundClear`](super::Cleared).
/// `expected`: the type gpuvisor believes is set (None: any).
///
/// Private: the release path reaches it only through [`Backend::clear`].
fn clear(host: &HostRoot, vf: &str, expected: Option<u32>) -> Result<super::Cleared, ClearError> {
    let cur = match read_current_type(host, vf) {
        Ok(v) => v,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Cleared::FoundClear),
        Err(e) => {
            return Err(ClearError::Failed(WriteError::other(format!(
                "cannot read current_vgpu_type: {}",
                errno_or_msg(&e)
            ))))
        }
    };
    if cur == 0 {
        return Ok(Cleared::FoundClear);
    }
    if let Some(exp) = expected {
        if exp != cur {
            return Err(ClearError::Foreign { value: cur });
        }
    }
    let write = write_attr(&nvidia_dir(host, vf).join("current_vgpu_type"), "0\n");
    match read_current_type(host, vf) {
        // Our write was accepted: it took effect.
        Ok(0) if write.is_ok() => Ok(Cleared::Wrote),
        // Refused (EPERM on an already clear VF), yet clear: someone else cleared it.
        Ok(0) => Ok(Cleared::FoundClear),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Cleared::FoundClear),
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

/// [`Backend::observe`] of vendor-VFIO VFs: each managed GPU with its VFs; a VF's type
/// read now; candidates are free VFs whose catalog lists the profile, and dirty VFs whose
/// repair leaves every other vGPU on the GPU at the requested size (equal-size rule).
fn observe_gpus(scan: &HostScan, profile: Option<&str>, steps: &dyn ObserveSteps, out: &mut Observed) {
    // A probe error still shows every VF that was found (each unreadable one named).
    if matches!(scan.mode, Ok(HostMode::Mdev)) {
        return;
    }
    let driver = &scan.driver_version;
    let want_fb = profile.and_then(|p| steps.profile_fb(p));
    for g in &scan.vendor {
        let managed = steps.manages(&g.bdf);
        for vf in &g.vfs {
            if let Ok(cat) = &vf.catalog {
                for e in &cat.entries {
                    let fb = profile_framebuffer_mib(&e.name);
                    steps.learn(&e.name, fb);
                    steps.learn_type(driver, &g.bdf, e.id, &e.name);
                    steps.learn_gpu_size(&g.bdf, fb);
                }
            }
        }
        let mut devices = Vec::new();
        for vf in &g.vfs {
            let mut recs = steps.records(&vf.bdf);
            let current_type = match &vf.current_type {
                Ok(t) => Reading::Id(*t),
                Err(e) => Reading::Unknown(e.to_string()),
            };
            let unreadable = vf.unreadable_reason();
            let state = recs.state(unreadable.is_some(), current_type.id().is_some_and(|t| t != 0));
            let DeviceRecords { claim, claim_unreadable, claim_unreadable_owner, health, owner_labels, .. } = recs;
            let creatable = match (&vf.catalog, state) {
                (Ok(c), DeviceState::Free) => {
                    c.entries.iter().map(|e| gpuvisor_sdk::canonical_profile(&e.name).to_string()).collect()
                }
                _ => vec![],
            };
            let type_mismatch = claim.as_ref().and_then(|c| match (c.state, c.kind.type_id(), current_type.id()) {
                (ClaimState::Configured, Some(want), Some(now)) if now != want => Some(format!(
                    "reads type {now}, but its claim by {} recorded type {want}: another writer changed \
                     it under the VM",
                    c.owner
                )),
                _ => None,
            });
            devices.push(ObservedDevice {
                address: vf.bdf.clone(),
                state,
                current_type,
                creatable,
                claim,
                claim_unreadable,
                claim_unreadable_owner,
                owner_labels,
                health,
                unreadable,
                catalog_skipped: vf.catalog.as_ref().map(|c| c.skipped.clone()).unwrap_or_default(),
                type_mismatch,
            });
        }
        // Framebuffer of every active vGPU on the GPU (claimed or dirty).
        let active: Vec<(&str, Option<u64>)> = devices
            .iter()
            .filter_map(|d| match (&d.claim, d.current_type.id()) {
                (Some(c), _) => Some((d.address.as_str(), steps.profile_fb(&c.profile))),
                (None, _) if d.claim_unreadable.is_some() => Some((d.address.as_str(), None)),
                (None, Some(t)) if t != 0 => Some((d.address.as_str(), type_fb(g, t, steps))),
                _ => None,
            })
            .collect();
        if let (true, Some(p)) = (managed, profile) {
            let offered = out.candidates.len();
            for d in &devices {
                let legal = match d.state {
                    DeviceState::Free => d.creatable.iter().any(|c| gpuvisor_sdk::profile_matches(p, c)),
                    // Repairable: once this VF is cleared, every other active vGPU on the
                    // GPU has the requested size (equal-size rule).
                    DeviceState::Dirty => {
                        steps.known(p)
                            && active
                                .iter()
                                .filter(|(b, _)| *b != d.address)
                                .all(|(_, fb)| fb.is_some() && want_fb.is_some() && *fb == want_fb)
                    }
                    _ => false,
                };
                if legal {
                    let dirty = d.state == DeviceState::Dirty;
                    out.candidates.push(Candidate::new(&d.address, &g.bdf, dirty, ClaimKind::Vf { type_id: None }));
                }
            }
            if out.candidates.len() == offered {
                if let Some(why) = equal_size_note(p, want_fb, &active) {
                    out.notes.push(format!("GPU {}: {why}", g.bdf));
                }
            }
        }
        let (claimed_framebuffer_mib, load_known) = load_of(&devices, steps);
        out.gpus.push(ObservedGpu {
            model: gpu_model(g),
            framebuffer_mib: steps.gpu_size(&g.bdf, &g.device_id),
            numa_node: g.numa_node,
            claimed_framebuffer_mib,
            load_known,
            managed,
            health: steps.gpu_mark(&g.bdf),
            devices,
            address: g.bdf.clone(),
            passthrough: None,
        });
    }
}

/// The framebuffer of a type id set on a VF of `g`, from any catalog of the GPU that
/// lists it; `None` when no catalog does (a VF holding a type shows an empty catalog).
fn type_fb(g: &GpuInfo, type_id: u32, steps: &dyn ObserveSteps) -> Option<u64> {
    g.vfs
        .iter()
        .filter_map(|v| v.catalog.as_ref().ok())
        .flat_map(|c| c.entries.iter())
        .find(|e| e.id == type_id)
        .map(|e| e.name.clone())
        .or_else(|| steps.type_name(&g.bdf, type_id))
        .and_then(|name| profile_framebuffer_mib(&name))
}

/// The GPU's model: by its PCI device id, else from a profile name of its catalogs.
fn gpu_model(g: &GpuInfo) -> String {
    if let Some(m) = super::model_by_device_id(&g.device_id) {
        return m.to_string();
    }
    g.vfs
        .iter()
        .filter_map(|v| v.catalog.as_ref().ok())
        .flat_map(|c| c.entries.iter())
        .next()
        .and_then(|e| e.name.rsplit_once('-').map(|(a, _)| a.to_string()))
        .unwrap_or_else(|| "NVIDIA GPU".into())
}

/// Why a GPU offers no device for `profile` (of `want_fb` MiB) when the vGPUs it runs
/// (`active`: device, framebuffer) are of another size: the driver runs each GPU in
/// equal-size mode, so the answer says which size it runs and that the profile fits once
/// they are released. `None` when the sizes are not what stands in the way.
fn equal_size_note(profile: &str, want_fb: Option<u64>, active: &[(&str, Option<u64>)]) -> Option<String> {
    let want = want_fb?;
    let sizes: BTreeSet<u64> = active.iter().filter_map(|(_, fb)| *fb).collect();
    if active.is_empty() || sizes.iter().all(|fb| *fb == want) {
        return None;
    }
    let sizes: Vec<String> = sizes.iter().map(|fb| format!("{fb} MiB")).collect();
    Some(format!(
        "it runs {} of {} each, and the driver puts vGPUs of only one framebuffer size on a GPU \
         (equal-size rule): {profile} ({want} MiB) fits there once those are released",
        if active.len() == 1 { "1 vGPU".to_string() } else { format!("{} vGPUs", active.len()) },
        sizes.join(" / ")
    ))
}

/// The vendor-VFIO backend: a VF whose vGPU is its `current_vgpu_type`.
#[derive(Debug, Clone, Copy)]
pub struct VendorVfio;

impl Backend for VendorVfio {
    /// The VF's group node and iommufd cdev ([`vf_targets`]).
    fn release_targets(&self, host: &HostRoot, held: &Held<'_>) -> Result<Vec<PathBuf>, DeviceError> {
        vf_targets(host, &read_vf(host, held.device, held.gpu.to_string()))
    }

    /// Writes `0` and reads it back; the type expected is the one the claim recorded
    /// (none: any). A VF reading another type is [`ClearError::Foreign`], untouched.
    fn clear(&self, host: &HostRoot, held: &Held<'_>, steps: &dyn ClearSteps) -> Result<Cleared, ClearError> {
        let ClaimKind::Vf { type_id: expected } = held.kind else {
            return Err(ClearError::Failed(WriteError::other(wrong_kind("vendor_vfio", held).to_string())));
        };
        match clear(host, held.device, *expected) {
            Ok(done) => {
                if done == Cleared::Wrote {
                    steps.write_outcome(held.device, held.gpu, WriteSite::ClearType, &Ok(()));
                }
                Ok(done)
            }
            Err(ClearError::Failed(w)) => {
                steps.write_outcome(held.device, held.gpu, WriteSite::ClearType, &Err(w.clone()));
                Err(ClearError::Failed(w))
            }
            Err(e) => Err(e),
        }
    }

    /// A VF reading a non-zero type is dirty (repaired through the release path first).
    fn dirty(&self, host: &HostRoot, held: &Held<'_>) -> Result<Option<u32>, DeviceError> {
        match read_current_type(host, held.device) {
            Ok(0) => Ok(None),
            Ok(t) => Ok(Some(t)),
            Err(e) => Err(DeviceError::TypeUnreadable(e.to_string())),
        }
    }

    /// Sets the profile's type with read-back on a VF that reads `0` again under the locks;
    /// a read-back of a type gpuvisor did not write quarantines the VF (`foreign_write`).
    fn configure(
        &self,
        host: &HostRoot,
        held: &Held<'_>,
        profile: &str,
        steps: &dyn ConfigureSteps,
    ) -> Result<ClaimKind, Refused> {
        let vf = held.device;
        match read_current_type(host, vf) {
            Ok(0) => {}
            Ok(v) => return Err(Refused::untouched(format!("reads type {v} again before its type was written"))),
            Err(e) => return Err(Refused::untouched(format!("current_vgpu_type unreadable: {e}"))),
        }
        match set_type(host, vf, profile) {
            Ok(id) => {
                steps.write_outcome(vf, held.gpu, WriteSite::SetType, &Ok(()));
                Ok(ClaimKind::Vf { type_id: Some(id) })
            }
            // Not in the fresh catalog: nothing was written.
            Err(ConfigureError::NotListed(m)) => Err(Refused::untouched(m)),
            Err(ConfigureError::NotCreatable(w)) => {
                let verdict = steps.write_outcome(vf, held.gpu, WriteSite::SetType, &Err(w.clone()));
                Err(Refused::write_failed(w.message, verdict, true))
            }
            Err(ConfigureError::Foreign { value }) => {
                steps.quarantine(vf, "foreign_write", &format!("read back type {value} that gpuvisor did not write"));
                Err(Refused::write_failed(format!("foreign write: reads {value}"), Verdict::None, true))
            }
            Err(ConfigureError::Io(m)) => {
                let zero = read_current_type(host, vf).ok() == Some(0);
                Err(Refused::write_failed(m, Verdict::None, zero))
            }
        }
    }

    /// The VF: its directory, address and group.
    fn view(&self, host: &HostRoot, held: &Held<'_>) -> ClaimedDevice {
        let sysfs_path = host.pci_device(held.device);
        ClaimedDevice { group: group_of(&sysfs_path), sysfs_path, pci_address: Some(held.device.to_string()) }
    }

    /// The VF's own sysfs directory and group.
    fn vfio_device(&self, host: &HostRoot, held: &Held<'_>) -> VfioDevice {
        let info = read_vf(host, held.device, held.gpu.to_string());
        VfioDevice { sysfs: vec![host.pci_device(held.device)], group: info.iommu_group }
    }

    /// Everything a VF's observation reads is in the scan.
    fn observe(
        &self,
        _host: &HostRoot,
        scan: &HostScan,
        profile: Option<&str>,
        steps: &dyn ObserveSteps,
        out: &mut Observed,
    ) {
        observe_gpus(scan, profile, steps, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::backend::testing::{Recorder, Step, Tree};
    use crate::devices::backend::{backend, Held};
    use crate::devices::Refused;

    #[test]
    fn the_note_names_the_size_a_gpu_runs_only_when_it_differs() {
        let two = [("0000:41:00.4", Some(2048)), ("0000:41:00.5", Some(2048))];
        let n = equal_size_note("L40S-8Q", Some(8192), &two).unwrap();
        assert!(n.contains("2 vGPUs of 2048 MiB each") && n.contains("L40S-8Q (8192 MiB)"), "{n}");
        assert!(n.contains("equal-size rule"), "{n}");
        // The same size (the GPU is full), nothing running, or an unknown profile size: no note.
        assert_eq!(equal_size_note("L40S-2Q", Some(2048), &two), None);
        assert_eq!(equal_size_note("L40S-2Q", Some(2048), &[]), None);
        assert_eq!(equal_size_note("X", None, &two), None);
    }

    /// A GPU `PF` with the VFs `vfs` (BDF, `current_vgpu_type` text), each VF's catalog
    /// listing L40S-2Q while it holds no type.
    fn gpu_of(t: &Tree, vfs: &[(&str, &str)]) -> GpuInfo {
        let vfs = vfs
            .iter()
            .map(|(bdf, ty)| {
                t.pci_function(bdf, None, &[]);
                t.file(&format!("sys/bus/pci/devices/{bdf}/nvidia/current_vgpu_type"), ty);
                let cat = if *ty == "0\n" { "ID : vGPU Name\n1148 : NVIDIA L40S-2Q\n" } else { "" };
                t.file(&format!("sys/bus/pci/devices/{bdf}/nvidia/creatable_vgpu_types"), cat);
                let ty = read_current_type(&t.host, bdf).map_err(|e| DeviceError::Attr(errno_or_msg(&e)));
                read_vf_with_type(&t.host, bdf, PF.into(), ty)
            })
            .collect();
        GpuInfo { bdf: PF.into(), device_id: "0x26b9".into(), numa_node: None, vfs }
    }

    #[test]
    fn observing_vfs_tells_free_dirty_unreadable_claimed_and_quarantined_and_offers_the_legal_ones() {
        use crate::devices::backend::testing::{observe, scan, states, Records};
        use crate::devices::observed::Observed;
        let t = Tree::new();
        let vfs = [
            ("0000:41:00.4", "0\n"),
            ("0000:41:00.5", "1148\n"),
            ("0000:41:00.6", "garbage\n"),
            ("0000:41:00.7", "0\n"),
            ("0000:41:01.0", "0\n"),
        ];
        let mut host = scan(HostMode::VendorVfio);
        host.vendor = vec![gpu_of(&t, &vfs)];
        let records = Records {
            quarantined: vec!["0000:41:00.7".into()],
            unreadable_claims: vec!["0000:41:01.0".into()],
            ..Default::default()
        };
        let o = observe(&VendorVfio, &t.host, &host, Some("L40S-2Q"), &records);
        assert_eq!(
            states(&o),
            vec![
                ("0000:41:00.4".to_string(), DeviceState::Free),
                ("0000:41:00.5".to_string(), DeviceState::Dirty),
                ("0000:41:00.6".to_string(), DeviceState::Unreadable),
                ("0000:41:00.7".to_string(), DeviceState::Quarantined),
                // A claim file that cannot be read claims its device: unknown is never free.
                ("0000:41:01.0".to_string(), DeviceState::Claimed),
            ]
        );
        let offered =
            |o: &Observed| o.candidates.iter().map(|c| (c.device.clone(), c.dirty)).collect::<Vec<(String, bool)>>();
        // The free VF lists the profile; nothing unknown, quarantined or claimed is offered,
        // and the dirty VF is not either: the vGPU behind the unreadable claim is of
        // unknown size, so its repair is not provably within the equal-size rule.
        assert_eq!(offered(&o), vec![("0000:41:00.4".to_string(), false)]);
        assert!(o.candidates.iter().all(|c| *c.offer() == ClaimKind::Vf { type_id: None } && c.gpu == PF));
        // Without it, the dirty VF is repairable (no other vGPU of another size on the GPU),
        // and the VF it named is free.
        let known = Records { quarantined: vec!["0000:41:00.7".into()], ..Default::default() };
        let o = observe(&VendorVfio, &t.host, &host, Some("L40S-2Q"), &known);
        let want = [("0000:41:00.4", false), ("0000:41:00.5", true), ("0000:41:01.0", false)];
        assert_eq!(offered(&o), want.map(|(d, dirty)| (d.to_string(), dirty)));
        let unknown = &o.gpus[0].devices[2];
        assert!(unknown.current_type.id().is_none() && unknown.unreadable.is_some(), "{unknown:?}");
        // An mdev host's scan is not this kind's: nothing observed.
        let mdev_host = scan(HostMode::Mdev);
        assert!(observe(&VendorVfio, &t.host, &mdev_host, None, &records).gpus.is_empty());
    }

    const VF: &str = "0000:41:00.4";
    const PF: &str = "0000:41:00.0";

    /// A VF of `PF` in IOMMU group 17 with the iommufd cdev `vfio3`, reading `type_text`.
    fn vf(t: &Tree, type_text: &str) {
        t.pci_function(VF, Some(17), &["vfio3"]);
        t.link(&format!("sys/bus/pci/devices/{VF}/physfn"), &format!("../{PF}"));
        t.file(&format!("sys/bus/pci/devices/{VF}/nvidia/current_vgpu_type"), type_text);
        t.file(&format!("sys/bus/pci/devices/{VF}/nvidia/creatable_vgpu_types"), "");
    }

    fn type_file() -> String {
        format!("sys/bus/pci/devices/{VF}/nvidia/current_vgpu_type")
    }

    fn clear_vf(t: &Tree, recorded: Option<u32>) -> (Result<Cleared, ClearError>, Vec<Step>) {
        let kind = ClaimKind::Vf { type_id: recorded };
        let steps = Recorder::new(true);
        let r = backend(&kind).clear(&t.host, &Held { device: VF, gpu: PF, kind: &kind }, &steps);
        (r, steps.taken())
    }

    #[test]
    fn a_vf_is_viewed_attached_and_held_through_its_group_node_and_its_cdevs() {
        let t = Tree::new();
        vf(&t, "0\n");
        let kind = ClaimKind::Vf { type_id: None };
        let held = Held { device: VF, gpu: PF, kind: &kind };
        assert_eq!(
            backend(&kind).release_targets(&t.host, &held).unwrap(),
            vec![t.path("dev/vfio/17"), t.path("dev/vfio/devices/vfio3")]
        );
        assert_eq!(
            backend(&kind).vfio_device(&t.host, &held),
            VfioDevice { sysfs: vec![t.host.pci_device(VF)], group: Some(17) }
        );
        assert_eq!(
            backend(&kind).view(&t.host, &held),
            ClaimedDevice { sysfs_path: t.host.pci_device(VF), pci_address: Some(VF.into()), group: Some(17) }
        );
    }

    #[test]
    fn a_vf_whose_cdevs_cannot_be_listed_has_unknown_holders() {
        let t = Tree::new();
        vf(&t, "0\n");
        fs::remove_dir_all(t.path(&format!("sys/bus/pci/devices/{VF}/vfio-dev"))).unwrap();
        t.file(&format!("sys/bus/pci/devices/{VF}/vfio-dev"), "not a directory");
        let kind = ClaimKind::Vf { type_id: None };
        let e = backend(&kind).release_targets(&t.host, &Held { device: VF, gpu: PF, kind: &kind }).unwrap_err();
        assert!(matches!(&e, DeviceError::VfioPaths { bdf, .. } if bdf == VF), "{e}");
        assert!(e.to_string().contains("cannot be read") && e.to_string().contains("vfio-dev"), "{e}");
    }

    #[test]
    fn clearing_a_vf_writes_0_reads_it_back_and_reports_the_write() {
        let t = Tree::new();
        vf(&t, "7\n");
        let (r, steps) = clear_vf(&t, Some(7));
        assert_eq!(r, Ok(Cleared::Wrote));
        assert_eq!(t.read(&type_file()), "0\n");
        assert_eq!(
            steps,
            vec![Step::Write { device: VF.into(), gpu: PF.into(), site: WriteSite::ClearType, ok: true }]
        );
    }

    #[test]
    fn a_vf_found_clear_or_gone_is_not_written_and_reports_nothing() {
        let t = Tree::new();
        vf(&t, "0\n");
        assert_eq!(clear_vf(&t, Some(7)), (Ok(Cleared::FoundClear), vec![]));
        fs::remove_file(t.path(&type_file())).unwrap();
        assert_eq!(clear_vf(&t, Some(7)), (Ok(Cleared::FoundClear), vec![]));
    }

    #[test]
    fn a_vf_reading_a_type_gpuvisor_did_not_record_is_foreign_and_untouched() {
        let t = Tree::new();
        vf(&t, "9\n");
        assert_eq!(clear_vf(&t, Some(7)), (Err(ClearError::Foreign { value: 9 }), vec![]));
        assert_eq!(t.read(&type_file()), "9\n");
        // No recorded type (an orphan the sweep saw as any type): cleared.
        assert_eq!(clear_vf(&t, None).0, Ok(Cleared::Wrote));
    }

    fn configure_vf(t: &Tree, profile: &str) -> (Result<ClaimKind, Refused>, Vec<Step>) {
        let kind = ClaimKind::Vf { type_id: None };
        let steps = Recorder::new(true);
        let r = backend(&kind).configure(&t.host, &Held { device: VF, gpu: PF, kind: &kind }, profile, &steps);
        (r, steps.taken())
    }

    #[test]
    fn configuring_a_vf_writes_the_catalog_id_of_the_profile_and_records_it() {
        let t = Tree::new();
        vf(&t, "0\n");
        t.file(
            &format!("sys/bus/pci/devices/{VF}/nvidia/creatable_vgpu_types"),
            "ID    : vGPU Name\n1147  : NVIDIA L40S-1Q\n1148  : NVIDIA L40S-2Q\n",
        );
        let kind = ClaimKind::Vf { type_id: None };
        assert_eq!(backend(&kind).dirty(&t.host, &Held { device: VF, gpu: PF, kind: &kind }), Ok(None));
        let (r, steps) = configure_vf(&t, "L40S-2Q");
        assert_eq!(r.unwrap(), ClaimKind::Vf { type_id: Some(1148) });
        assert_eq!(t.read(&type_file()), "1148\n");
        assert_eq!(steps, vec![Step::Write { device: VF.into(), gpu: PF.into(), site: WriteSite::SetType, ok: true }]);
    }

    #[test]
    fn a_profile_missing_from_the_fresh_catalog_is_refused_before_any_write() {
        let t = Tree::new();
        vf(&t, "0\n");
        t.file(
            &format!("sys/bus/pci/devices/{VF}/nvidia/creatable_vgpu_types"),
            "ID    : vGPU Name\n1147  : NVIDIA L40S-1Q\n",
        );
        let (r, steps) = configure_vf(&t, "L40S-2Q");
        let r = r.unwrap_err();
        assert!(r.untouched && !r.wrote && r.why.contains("not in the catalog"), "{r:?}");
        assert_eq!((t.read(&type_file()), steps), ("0\n".to_string(), vec![]));
    }

    #[test]
    fn a_vf_reading_a_type_is_dirty_and_is_not_configured_over() {
        let t = Tree::new();
        vf(&t, "9\n");
        let kind = ClaimKind::Vf { type_id: None };
        assert_eq!(backend(&kind).dirty(&t.host, &Held { device: VF, gpu: PF, kind: &kind }), Ok(Some(9)));
        let (r, steps) = configure_vf(&t, "L40S-2Q");
        let r = r.unwrap_err();
        assert!(r.untouched && !r.wrote && r.why.contains("reads type 9 again"), "{r:?}");
        assert_eq!((t.read(&type_file()), steps), ("9\n".to_string(), vec![]));
    }

    #[test]
    fn an_unreadable_type_is_a_failed_clear_and_nothing_is_written() {
        let t = Tree::new();
        vf(&t, "garbage\n");
        let (r, steps) = clear_vf(&t, Some(7));
        assert!(
            matches!(&r, Err(ClearError::Failed(w)) if w.message.contains("cannot read current_vgpu_type")),
            "{r:?}"
        );
        assert_eq!(t.read(&type_file()), "garbage\n");
        assert_eq!(
            steps,
            vec![Step::Write { device: VF.into(), gpu: PF.into(), site: WriteSite::ClearType, ok: false }]
        );
    }
}
