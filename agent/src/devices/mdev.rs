//! mdev vGPUs (older hosts): a mediated device is created by writing a fresh UUID to
//! `mdev_supported_types/<type>/create` of a parent (on SR-IOV GPUs every VF is a parent)
//! and removed by writing `1` to `sys/bus/mdev/devices/<uuid>/remove`
//! (Linux `Documentation/driver-api/vfio-mediated-device.rst`, docs/design/host.md §6).
//! gpuvisor creates only transient mdevs and never removes one it did not create.
//!
//! The one primitive that removes an mdev is the private `remove`, reached only through
//! [`Mdev`]'s [`Backend::clear`], which only the release path (`instances::release`) calls.

use super::backend::{
    group_of, wrong_kind, Backend, ClaimedDevice, ClearError, ClearSteps, ConfigureSteps, Held, Refused, VfioDevice,
    WriteSite,
};
use super::observed::{load_of, Candidate, ObserveSteps, Observed, ObservedDevice, ObservedGpu};
use super::{link_basename, read_attr, write_attr, Cleared, DeviceError, UnreadableDevice, WriteError};
use super::{HostMode, HostScan};
use crate::domain::ClaimKind;
use crate::host::HostRoot;
use gpuvisor_sdk::DeviceState;
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// One mdev type of a parent.
#[derive(Debug, Clone, PartialEq)]
pub struct MdevType {
    /// Directory name, e.g. `nvidia-1148`.
    pub dir: String,
    /// `name`, e.g. `NVIDIA L40S-2Q`.
    pub name: String,
    /// `framebuffer=<N>M` from `description`, MiB.
    pub framebuffer_mib: Option<u64>,
    /// `available_instances` now (0 or 1 on SR-IOV parents).
    pub available: u32,
}

/// One mdev parent.
#[derive(Debug, Clone, PartialEq)]
pub struct MdevParent {
    /// The parent's BDF (a VF on SR-IOV GPUs).
    pub bdf: String,
    /// The physical GPU: basename of `physfn`, or the parent itself.
    pub pf: String,
    /// Its types; `Err` when `mdev_supported_types` (or a type's `name`) cannot be read.
    pub types: Result<Vec<MdevType>, DeviceError>,
}

impl MdevParent {
    /// The readable types (none when unreadable).
    pub fn types(&self) -> &[MdevType] {
        self.types.as_deref().unwrap_or(&[])
    }
}

/// One existing mdev.
#[derive(Debug, Clone, PartialEq)]
pub struct MdevDevice {
    /// The mdev's UUID (its directory name under `/sys/bus/mdev/devices`).
    pub uuid: String,
    /// The parent's BDF (the path component before `mdev_supported_types`).
    pub parent: String,
    /// The type directory name (basename of the `mdev_type` link).
    pub mdev_type: String,
    /// The IOMMU group the mdev is in; `None` when its `iommu_group` link cannot be read.
    pub iommu_group: Option<u32>,
}

/// True when at least one parent has a non-empty `mdev_supported_types` (docs/design/host.md §1
/// step 1; an unreadable one counts, so that it is reported rather than hidden).
pub fn probe(parents: &[MdevParent]) -> bool {
    parents.iter().any(|p| p.types.as_ref().map(|t| !t.is_empty()).unwrap_or(true))
}

/// Parses `framebuffer=<N>M` out of an mdev type's `description`.
pub fn framebuffer_from_description(desc: &str) -> Option<u64> {
    desc.split(',').map(str::trim).find_map(|kv| {
        let v = kv.strip_prefix("framebuffer=")?;
        let v = v.strip_suffix('M').or_else(|| v.strip_suffix('m'))?;
        v.parse().ok()
    })
}

/// Every mdev parent with its types, read now. A missing `mdev_bus` means none. Errors:
/// `mdev_bus` exists but cannot be listed (a probe error, never a fallback).
pub fn parents(host: &HostRoot) -> Result<Vec<MdevParent>, DeviceError> {
    let dir = host.mdev_bus_dir();
    let mut out = Vec::new();
    for bdf in super::list_dir(&dir)? {
        let pdir = dir.join(&bdf);
        let pf = link_basename(&pdir.join("physfn")).unwrap_or_else(|_| bdf.clone());
        let types = read_types(&pdir.join("mdev_supported_types"));
        out.push(MdevParent { bdf, pf, types });
    }
    out.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    Ok(out)
}

fn read_types(dir: &Path) -> Result<Vec<MdevType>, DeviceError> {
    let unlisted = |e: &io::Error| DeviceError::unlisted("mdev_supported_types", e);
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(unlisted(&e)),
    };
    let mut types = Vec::new();
    for e in rd {
        let e = e.map_err(|e| unlisted(&e))?;
        let d = e.path();
        let dir_name = e.file_name().to_string_lossy().into_owned();
        let name = read_attr(&d.join("name")).map_err(|e| DeviceError::unreadable(format!("{dir_name}/name"), &e))?;
        types.push(MdevType {
            dir: dir_name,
            framebuffer_mib: read_attr(&d.join("description")).ok().and_then(|s| framebuffer_from_description(&s)),
            available: read_attr(&d.join("available_instances")).ok().and_then(|s| s.parse().ok()).unwrap_or(0),
            name,
        });
    }
    types.sort_by(|a, b| a.dir.cmp(&b.dir));
    Ok(types)
}

/// Every mdev on the host, and those that could not be read (a directory whose name is not a
/// UUID, an `mdev_type` link that cannot be read): each is named, never skipped silently.
/// Errors: the devices directory exists but cannot be listed.
pub fn devices(host: &HostRoot) -> Result<(Vec<MdevDevice>, Vec<UnreadableDevice>), DeviceError> {
    let mut out = Vec::new();
    let mut unreadable = Vec::new();
    for uuid in super::list_dir(&host.mdev_devices_dir())? {
        if uuid::Uuid::parse_str(&uuid).is_err() {
            unreadable.push(UnreadableDevice {
                address: uuid.clone(),
                gpu: None,
                parent: parent_of(host, &uuid),
                reason: format!("mdev directory {uuid:?} is not named by a UUID"),
            });
            continue;
        }
        match read_device(host, &uuid) {
            Ok(Some(d)) => out.push(d),
            Ok(None) => {} // removed while listing
            Err(e) => unreadable.push(UnreadableDevice {
                address: uuid.clone(),
                gpu: None,
                parent: parent_of(host, &uuid),
                reason: e.to_string(),
            }),
        }
    }
    out.sort_by(|a, b| a.uuid.cmp(&b.uuid));
    Ok((out, unreadable))
}

/// The parent an mdev sits on, from where `sys/bus/mdev/devices/<uuid>` points
/// (`../../../devices/<pci path>/<parent>/<uuid>`): known even when its `mdev_type` link
/// cannot be read.
fn parent_of(host: &HostRoot, uuid: &str) -> Option<String> {
    let target = fs::read_link(host.mdev_device(uuid)).ok()?;
    Some(target.parent()?.file_name()?.to_string_lossy().into_owned())
}

/// Reads one mdev. `Ok(None)` only when its directory does not exist; an `mdev_type` link
/// that cannot be read or parsed is `Err` — unreadable is not absent.
pub fn read_device(host: &HostRoot, uuid: &str) -> Result<Option<MdevDevice>, DeviceError> {
    let d = host.mdev_device(uuid);
    let target = match fs::read_link(d.join("mdev_type")) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound && fs::symlink_metadata(&d).is_err() => return Ok(None),
        Err(e) => return Err(DeviceError::unreadable(format!("mdev {uuid}/mdev_type"), &e)),
    };
    let comps: Vec<String> = target.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let parsed = comps.iter().position(|c| c == "mdev_supported_types").and_then(|pos| {
        let parent = comps.get(pos.checked_sub(1)?)?.clone();
        Some((parent, comps.last()?.clone()))
    });
    let Some((parent, mdev_type)) = parsed else {
        return Err(DeviceError::MdevTypeLink { uuid: uuid.to_string(), target });
    };
    let iommu_group = link_basename(&d.join("iommu_group")).ok().and_then(|g| g.parse().ok());
    Ok(Some(MdevDevice { uuid: uuid.to_string(), parent, mdev_type, iommu_group }))
}

/// The device nodes of an mdev: its group node and its `vfio-dev` cdevs. Absent paths mean
/// fewer targets; any other read error is `Err` (the scan result is then unknown).
pub fn targets(host: &HostRoot, uuid: &str) -> Result<Vec<PathBuf>, DeviceError> {
    let d = host.mdev_device(uuid);
    let mut t = Vec::new();
    match link_basename(&d.join("iommu_group")) {
        Ok(g) => {
            if let Ok(g) = g.parse::<u32>() {
                t.push(host.vfio_group_node(g));
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(DeviceError::unreadable(format!("mdev {uuid}/iommu_group"), &e)),
    }
    let unlisted = |e: &io::Error| DeviceError::unlisted(format!("mdev {uuid}/vfio-dev"), e);
    match fs::read_dir(d.join("vfio-dev")) {
        Ok(rd) => {
            for e in rd {
                let e = e.map_err(|e| unlisted(&e))?;
                t.push(host.vfio_cdev_node(&e.file_name().to_string_lossy()));
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(unlisted(&e)),
    }
    Ok(t)
}

/// Creates an mdev of `type_dir` on `parent` with `uuid`, then verifies it exists with
/// that type. Errors: the create write failed (EEXIST, EINVAL, EUSERS, ... — all mean
/// "not creatable here") or the device did not appear as asked.
///
/// Private: the claim path reaches it through [`Mdev`]'s [`Backend::configure`].
fn create(host: &HostRoot, parent: &str, type_dir: &str, uuid: &str) -> Result<(), WriteError> {
    let path = host.mdev_bus_dir().join(parent).join("mdev_supported_types").join(type_dir).join("create");
    write_attr(&path, uuid).map_err(|e| WriteError::from_io(&format!("creating mdev {uuid} on {parent}"), &e))?;
    match read_device(host, uuid) {
        Ok(Some(d)) if d.mdev_type == type_dir && d.parent == parent => Ok(()),
        Ok(Some(d)) => Err(WriteError::other(format!("mdev {uuid} appeared as {} on {}", d.mdev_type, d.parent))),
        Ok(None) => Err(WriteError::other(format!("mdev {uuid} did not appear after create"))),
        Err(e) => Err(WriteError::other(format!("mdev {uuid} cannot be verified after create: {e}"))),
    }
}

/// Removes an mdev gpuvisor created: a missing device is already done
/// ([`Cleared::FoundClear`](super::Cleared); [`Cleared::Wrote`](super::Cleared) only when
/// this remove took effect). Errors: the remove write failed (EBUSY while held or during
/// teardown) and the device still exists.
///
/// Private: the release path reaches it only through [`Mdev`]'s [`Backend::clear`].
fn remove(host: &HostRoot, uuid: &str) -> Result<Cleared, WriteError> {
    let d = host.mdev_device(uuid);
    if fs::symlink_metadata(&d).is_err() {
        return Ok(Cleared::FoundClear);
    }
    let res = write_attr(&d.join("remove"), "1");
    let gone = fs::symlink_metadata(&d).is_err();
    match res {
        // Our write was accepted and the device is gone: our remove took effect.
        Ok(()) if gone => Ok(Cleared::Wrote),
        Ok(()) => Err(WriteError::other(format!("mdev {uuid} still exists after remove"))),
        // The write failed but the device is gone: someone else removed it.
        Err(_) if gone => Ok(Cleared::FoundClear),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Cleared::FoundClear),
        Err(e) => Err(WriteError::from_io(&format!("removing mdev {uuid}"), &e)),
    }
}

/// The mdev backend: a mediated device gpuvisor created on a parent (the claim's device).
#[derive(Debug, Clone, Copy)]
pub struct Mdev;

/// [`Backend::observe`] of mdev parents, grouped by GPU: a parent with an mdev and no
/// claim is occupied (dirty); candidates are free parents offering the profile now.
fn observe_gpus(host: &HostRoot, scan: &HostScan, profile: Option<&str>, steps: &dyn ObserveSteps, out: &mut Observed) {
    if !matches!(scan.mode, Ok(HostMode::Mdev)) {
        return;
    }
    let mut by_pf: BTreeMap<String, Vec<&MdevParent>> = BTreeMap::new();
    for p in &scan.parents {
        for t in p.types() {
            steps.learn(&t.name, t.framebuffer_mib);
            steps.learn_gpu_size(&p.pf, t.framebuffer_mib);
        }
        by_pf.entry(p.pf.clone()).or_default().push(p);
    }
    for (pf, parents) in by_pf {
        let managed = steps.manages(&pf);
        let mut devices = Vec::new();
        for p in parents {
            let mut recs = steps.records(&p.bdf);
            // An mdev on a parent without a claim is another tool's (or an orphan): the
            // parent is occupied (shown dirty), and only the sweep may remove our own.
            let occupied = scan.mdevs.iter().any(|d| d.parent == p.bdf);
            // An mdev on this parent that cannot be read: the parent is not known free.
            let unreadable = p.types.as_ref().err().map(ToString::to_string).or_else(|| {
                scan.unreadable
                    .iter()
                    .find(|u| u.parent.as_deref() == Some(p.bdf.as_str()))
                    .map(|u| format!("an mdev on it cannot be read: {}", u.reason))
            });
            let state = recs.state(unreadable.is_some(), occupied);
            let creatable: Vec<String> = if state == DeviceState::Free {
                p.types()
                    .iter()
                    .filter(|t| t.available > 0)
                    .map(|t| gpuvisor_sdk::canonical_profile(&t.name).to_string())
                    .collect()
            } else {
                vec![]
            };
            if let (true, Some(want), DeviceState::Free) = (managed, profile, state) {
                if let Some(t) =
                    p.types().iter().find(|t| t.available > 0 && gpuvisor_sdk::profile_matches(want, &t.name))
                {
                    let offer = ClaimKind::Mdev { uuid: uuid::Uuid::nil(), mdev_type: t.dir.clone(), type_id: None };
                    out.candidates.push(Candidate::new(&p.bdf, &pf, false, offer));
                }
            }
            devices.push(ObservedDevice::without_type(&p.bdf, state, creatable, recs, unreadable));
        }
        let device_id = super::read_attr(&host.pci_device(&pf).join("device")).unwrap_or_default();
        let (claimed_framebuffer_mib, load_known) = load_of(&devices, steps);
        out.gpus.push(ObservedGpu {
            model: super::model_by_device_id(&device_id).unwrap_or("NVIDIA GPU").to_string(),
            framebuffer_mib: steps.gpu_size(&pf, &device_id),
            numa_node: None,
            claimed_framebuffer_mib,
            load_known,
            managed,
            health: steps.gpu_mark(&pf),
            devices,
            address: pf,
            passthrough: None,
        });
    }
}

impl Backend for Mdev {
    /// The mdev's group node and iommufd cdev ([`targets`]).
    fn release_targets(&self, host: &HostRoot, held: &Held<'_>) -> Result<Vec<PathBuf>, DeviceError> {
        let ClaimKind::Mdev { uuid, .. } = held.kind else {
            return Err(wrong_kind("mdev", held));
        };
        targets(host, &uuid.to_string())
    }

    /// Writes the mdev's `remove`; its record goes once it is gone.
    fn clear(&self, host: &HostRoot, held: &Held<'_>, steps: &dyn ClearSteps) -> Result<Cleared, ClearError> {
        let ClaimKind::Mdev { uuid, .. } = held.kind else {
            return Err(ClearError::Failed(WriteError::other(wrong_kind("mdev", held).to_string())));
        };
        let res = remove(host, &uuid.to_string());
        steps.write_outcome(
            held.device,
            held.gpu,
            WriteSite::MdevRemove,
            &res.as_ref().map(|_| ()).map_err(Clone::clone),
        );
        let done = res.map_err(ClearError::Failed)?;
        steps.mdev_removed(*uuid);
        Ok(done)
    }

    /// Records the mdev first, then writes `create` on the claim's device and requires the
    /// mdev to appear with its type; an mdev that did not appear is forgotten (the device
    /// is untouched), one that exists in another state is left to the release path.
    fn configure(
        &self,
        host: &HostRoot,
        held: &Held<'_>,
        _profile: &str,
        steps: &dyn ConfigureSteps,
    ) -> Result<ClaimKind, Refused> {
        let ClaimKind::Mdev { uuid, mdev_type, .. } = held.kind else {
            return Err(Refused::untouched("claim lacks an mdev uuid"));
        };
        steps.mdev_creating(*uuid, held.device, mdev_type).map_err(|e| Refused::untouched(e.to_string()))?;
        let res = create(host, held.device, mdev_type, &uuid.to_string());
        let verdict = steps.write_outcome(held.device, held.gpu, WriteSite::MdevCreate, &res);
        match res {
            Ok(()) => Ok(held.kind.clone()),
            Err(w) => match read_device(host, &uuid.to_string()) {
                Ok(None) => {
                    steps.mdev_not_created(*uuid);
                    Err(Refused::write_failed(w.message, verdict, true))
                }
                // The mdev exists (or cannot be read): its state is unknown.
                _ => Err(Refused::write_failed(w.message, verdict, false)),
            },
        }
    }

    /// The mdev: its directory and group (no PCI address: the VM gets no host function).
    fn view(&self, host: &HostRoot, held: &Held<'_>) -> ClaimedDevice {
        let sysfs_path = match held.kind.mdev_uuid() {
            Some(u) => host.mdev_device(&u.to_string()),
            None => host.pci_device(held.device),
        };
        ClaimedDevice { group: group_of(&sysfs_path), sysfs_path, pci_address: None }
    }

    /// The mdev's sysfs directory and its group (read now; none when unreadable).
    fn vfio_device(&self, host: &HostRoot, held: &Held<'_>) -> VfioDevice {
        let Some(uuid) = held.kind.mdev_uuid().map(|u| u.to_string()) else {
            return VfioDevice { sysfs: vec![], group: None };
        };
        let d = read_device(host, &uuid).ok().flatten();
        VfioDevice { sysfs: vec![host.mdev_device(&uuid)], group: d.and_then(|d| d.iommu_group) }
    }

    fn observe(
        &self,
        host: &HostRoot,
        scan: &HostScan,
        profile: Option<&str>,
        steps: &dyn ObserveSteps,
        out: &mut Observed,
    ) {
        observe_gpus(host, scan, profile, steps, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::backend::testing::{exists, Recorder, Step, Tree};
    use crate::devices::backend::{backend, Held};

    const PARENT: &str = "0000:41:00.5";
    const PF: &str = "0000:41:00.0";
    const UUID: &str = "11111111-2222-4333-8444-555555555555";

    fn kind() -> ClaimKind {
        ClaimKind::Mdev { uuid: UUID.parse().unwrap(), mdev_type: "nvidia-1148".into(), type_id: None }
    }

    /// The mdev `UUID` of type `nvidia-1148` on `PARENT`, in group 40 with the cdev `vfio5`.
    fn mdev(t: &Tree) {
        let d = format!("sys/bus/mdev/devices/{UUID}");
        t.dir(&format!("sys/class/mdev_bus/{PARENT}/mdev_supported_types/nvidia-1148"));
        t.link(
            &format!("{d}/mdev_type"),
            &format!("../../../../class/mdev_bus/{PARENT}/mdev_supported_types/nvidia-1148"),
        );
        t.dir("sys/kernel/iommu_groups/40");
        t.link(&format!("{d}/iommu_group"), "../../../../kernel/iommu_groups/40");
        t.dir(&format!("{d}/vfio-dev/vfio5"));
        t.file(&format!("{d}/remove"), "");
    }

    #[test]
    fn observing_mdev_parents_tells_free_occupied_unreadable_and_quarantined_and_offers_a_free_type() {
        use crate::devices::backend::testing::{observe, scan, states, Records};
        let t = Tree::new();
        let l40s_2q = || MdevType {
            dir: "nvidia-1148".into(),
            name: "NVIDIA L40S-2Q".into(),
            framebuffer_mib: Some(2048),
            available: 1,
        };
        let parent =
            |bdf: &str, types: Result<Vec<MdevType>, DeviceError>| MdevParent { bdf: bdf.into(), pf: PF.into(), types };
        let mut host = scan(HostMode::Mdev);
        host.parents = vec![
            parent("0000:41:00.4", Ok(vec![l40s_2q()])),
            parent(PARENT, Ok(vec![l40s_2q()])),
            parent("0000:41:00.6", Err(DeviceError::Attr("EIO".into()))),
            parent("0000:41:00.7", Ok(vec![l40s_2q()])),
        ];
        // Another tool's mdev on PARENT (no claim): the parent is occupied.
        host.mdevs = vec![MdevDevice {
            uuid: UUID.into(),
            parent: PARENT.into(),
            mdev_type: "nvidia-1148".into(),
            iommu_group: Some(9),
        }];
        let records = Records { quarantined: vec!["0000:41:00.7".into()], ..Default::default() };
        let o = observe(&Mdev, &t.host, &host, Some("L40S-2Q"), &records);
        assert_eq!(
            states(&o),
            vec![
                ("0000:41:00.4".to_string(), DeviceState::Free),
                (PARENT.to_string(), DeviceState::Dirty),
                ("0000:41:00.6".to_string(), DeviceState::Unreadable),
                ("0000:41:00.7".to_string(), DeviceState::Quarantined),
            ]
        );
        let offered: Vec<(&str, &ClaimKind)> = o.candidates.iter().map(|c| (c.device.as_str(), c.offer())).collect();
        assert!(
            matches!(offered.as_slice(), [("0000:41:00.4", ClaimKind::Mdev { mdev_type, .. })] if mdev_type == "nvidia-1148"),
            "{offered:?}"
        );
        // Each claim of the candidate creates its own mdev.
        assert_ne!(o.candidates[0].claim_kind().mdev_uuid(), o.candidates[0].claim_kind().mdev_uuid());
        // A vendor-VFIO host's scan is not this kind's.
        assert!(observe(&Mdev, &t.host, &scan(HostMode::VendorVfio), None, &records).gpus.is_empty());
    }

    #[test]
    fn an_mdev_is_viewed_attached_and_held_through_its_group_node_and_its_cdevs() {
        let t = Tree::new();
        mdev(&t);
        let k = kind();
        let held = Held { device: PARENT, gpu: PF, kind: &k };
        assert_eq!(
            backend(&k).release_targets(&t.host, &held).unwrap(),
            vec![t.path("dev/vfio/40"), t.path("dev/vfio/devices/vfio5")]
        );
        assert_eq!(
            backend(&k).vfio_device(&t.host, &held),
            VfioDevice { sysfs: vec![t.host.mdev_device(UUID)], group: Some(40) }
        );
        assert_eq!(
            backend(&k).view(&t.host, &held),
            ClaimedDevice { sysfs_path: t.host.mdev_device(UUID), pci_address: None, group: Some(40) }
        );
    }

    #[test]
    fn an_mdev_that_does_not_appear_after_create_is_recorded_first_then_forgotten() {
        let t = Tree::new();
        t.file(&format!("sys/class/mdev_bus/{PARENT}/mdev_supported_types/nvidia-1148/create"), "");
        let k = kind();
        let steps = Recorder::new(true);
        let r = backend(&k).configure(&t.host, &Held { device: PARENT, gpu: PF, kind: &k }, "L40S-2Q", &steps);
        let r = r.unwrap_err();
        assert!(r.untouched && r.wrote && r.why.contains("did not appear"), "{r:?}");
        assert_eq!(t.read(&format!("sys/class/mdev_bus/{PARENT}/mdev_supported_types/nvidia-1148/create")), UUID);
        let uuid = UUID.parse().unwrap();
        assert_eq!(
            steps.taken(),
            vec![
                Step::MdevCreating { uuid, parent: PARENT.into(), mdev_type: "nvidia-1148".into() },
                Step::Write { device: PARENT.into(), gpu: PF.into(), site: WriteSite::MdevCreate, ok: false },
                Step::MdevNotCreated(uuid),
            ]
        );
    }

    #[test]
    fn an_mdev_that_appears_with_its_type_is_configured() {
        let t = Tree::new();
        mdev(&t);
        t.file(&format!("sys/class/mdev_bus/{PARENT}/mdev_supported_types/nvidia-1148/create"), "");
        let k = kind();
        let steps = Recorder::new(true);
        let r = backend(&k).configure(&t.host, &Held { device: PARENT, gpu: PF, kind: &k }, "L40S-2Q", &steps);
        assert_eq!(r.unwrap(), k);
        assert_eq!(
            steps.taken()[1],
            Step::Write { device: PARENT.into(), gpu: PF.into(), site: WriteSite::MdevCreate, ok: true }
        );
    }

    #[test]
    fn removing_an_mdev_that_is_gone_is_found_clear_and_forgets_its_record() {
        let t = Tree::new();
        let k = kind();
        let steps = Recorder::new(true);
        let r = backend(&k).clear(&t.host, &Held { device: PARENT, gpu: PF, kind: &k }, &steps);
        assert_eq!(r, Ok(Cleared::FoundClear));
        assert_eq!(
            steps.taken(),
            vec![
                Step::Write { device: PARENT.into(), gpu: PF.into(), site: WriteSite::MdevRemove, ok: true },
                Step::MdevRemoved(UUID.parse().unwrap()),
            ]
        );
    }

    #[test]
    fn an_mdev_still_there_after_its_remove_is_a_failed_clear_that_keeps_its_record() {
        let t = Tree::new();
        mdev(&t);
        let k = kind();
        let steps = Recorder::new(true);
        let r = backend(&k).clear(&t.host, &Held { device: PARENT, gpu: PF, kind: &k }, &steps);
        assert!(matches!(&r, Err(ClearError::Failed(w)) if w.message.contains("still exists")), "{r:?}");
        assert_eq!(t.read(&format!("sys/bus/mdev/devices/{UUID}/remove")), "1");
        assert!(exists(&t.host.mdev_device(UUID)));
        assert_eq!(
            steps.taken(),
            vec![Step::Write { device: PARENT.into(), gpu: PF.into(), site: WriteSite::MdevRemove, ok: false }]
        );
    }

    #[test]
    fn framebuffer_is_read_from_the_description() {
        let d = "num_heads=4, frl_config=60, framebuffer=1024M, max_resolution=5120x2880, max_instance=24";
        assert_eq!(framebuffer_from_description(d), Some(1024));
        assert_eq!(framebuffer_from_description("num_heads=4"), None);
        assert_eq!(framebuffer_from_description("framebuffer=xM"), None);
    }
}
