//! # backend — what a device kind means, behind one trait
//!
//! Each device kind (vendor VFIO, mdev, passthrough) implements [`Backend`] in its own file
//! ([`super::vendor_vfio::VendorVfio`], [`super::mdev::Mdev`],
//! [`super::passthrough::Passthrough`]); [`backend`] picks the one a claim's
//! [`ClaimKind`] names. The *sequences* (claim, release, spawn) live in `instances/` and
//! call the backend; they never match on a kind for what the backend answers.
//!
//! A backend touches the host only (sysfs through [`HostRoot`]); what a write means for
//! the store and the health accounting it reports to the sequence through [`ClearSteps`].
//! **Only the release path (`instances::release`) calls [`Backend::clear`]**, after it
//! proved the owner done and scanned for holders under the device lock (a test there checks
//! that no other file calls it).

use super::observed::{ObserveSteps, Observed};
use super::{Cleared, DeviceError, HostScan, WriteError};
use crate::domain::{Claim, ClaimKind};
use crate::host::HostRoot;
use std::path::PathBuf;

/// A device as the release path and the VMM see it: the claimed (or orphan) device, its
/// GPU (PF), and what its claim — or, for an orphan, the sweep — knows about it.
#[derive(Debug, Clone, Copy)]
pub struct Held<'a> {
    /// The VF (vendor VFIO), the mdev's parent (mdev) or the GPU (passthrough).
    pub device: &'a str,
    /// The parent GPU's (PF's) address.
    pub gpu: &'a str,
    /// What the claim records: the type id gpuvisor wrote, the mdev, the group.
    pub kind: &'a ClaimKind,
}

impl<'a> Held<'a> {
    /// The device a claim holds.
    pub fn of(claim: &'a Claim) -> Held<'a> {
        Held { device: &claim.device, gpu: &claim.gpu, kind: &claim.kind }
    }
}

/// Which write a result comes from (the health accounting counts them,
/// docs/design/lifecycle.md "Device health").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteSite {
    /// A type id written to `current_vgpu_type` (configure).
    SetType,
    /// `0` written to `current_vgpu_type` (release).
    ClearType,
    /// An mdev `create` (configure).
    MdevCreate,
    /// An mdev `remove` (release).
    MdevRemove,
    /// A passthrough group moved to `vfio-pci` (configure).
    Bind,
    /// A passthrough group given back to its drivers, or its reset (release).
    Rebind,
}

/// What the release sequence does around a backend's clear: the health accounting of each
/// write and the records it keeps. Implemented by the release path only.
pub trait ClearSteps {
    /// A write's outcome for `device` on `gpu` (EIO strikes, GPU faults, the mark a write
    /// that took effect clears).
    fn write_outcome(&self, device: &str, gpu: &str, site: WriteSite, result: &Result<(), WriteError>);
    /// Quarantines `device` (`reason`, e.g. `reset_failed`).
    fn quarantine(&self, device: &str, reason: &str, detail: &str);
    /// True when the GPU `device` may be reset in this release: it was not found wedged
    /// before, and this release (a retried give-back) did not reset it already.
    fn may_reset(&self, device: &str) -> bool;
    /// Records durably that this release reset the GPU (before anything else is written).
    fn reset_done(&self);
    /// The mdev `uuid` is gone: its record may go.
    fn mdev_removed(&self, uuid: uuid::Uuid);
}

/// What the health accounting made of a failed write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No mark (not an EIO, or a first create-time EIO).
    None,
    /// A strike against the device.
    Strike,
    /// One GPU-level problem: the rest of this GPU's candidates are skipped by the caller.
    GpuFault {
        /// The GPU (PF) whose remaining candidates are skipped.
        gpu: String,
    },
}

/// The record of an mdev about to be created could not be written (why, from the store):
/// nothing is created.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotRecorded(pub String);

/// What the claim sequence does around a backend's configure (under the configure and
/// device locks): the health accounting of each write, the records and host services a
/// kind needs. Implemented by the claim path only.
pub trait ConfigureSteps {
    /// A write's outcome for `device` on `gpu`, and what the health accounting made of it.
    fn write_outcome(&self, device: &str, gpu: &str, site: WriteSite, result: &Result<(), WriteError>) -> Verdict;
    /// Quarantines `device` (`reason`, e.g. `foreign_write`).
    fn quarantine(&self, device: &str, reason: &str, detail: &str);
    /// Records the mdev `uuid` before it is created on `parent` (an error: nothing is
    /// created).
    fn mdev_creating(&self, uuid: uuid::Uuid, parent: &str, mdev_type: &str) -> Result<(), NotRecorded>;
    /// The mdev `uuid` was not created: its record may go.
    fn mdev_not_created(&self, uuid: uuid::Uuid);
    /// Makes sure no host process holds the GPU `gpu` through the host driver's `node`
    /// (stopping the configured host services if need be). `Ok(true)`: services were
    /// stopped, and [`ConfigureSteps::start_services`] must run once the bind is done.
    fn free_from_host_driver(&self, gpu: &str, node: &std::path::Path) -> Result<bool, Refused>;
    /// Starts the host services [`ConfigureSteps::free_from_host_driver`] stopped.
    fn start_services(&self);
}

/// A device the configure step refused.
#[derive(Debug)]
pub struct Refused {
    /// Why, one sentence.
    pub why: String,
    /// What the health accounting made of the failed write.
    pub verdict: Verdict,
    /// The device was left as it was found (or reads clear): the claim can simply be
    /// dropped. `false`: its state is unknown and the claim must go through the release path.
    pub untouched: bool,
    /// A sysfs write was attempted (counts against the claim's limit of failed writes).
    pub wrote: bool,
    /// The answer a request for this very device gets instead of `no_capacity`.
    pub answer: Option<Answer>,
}

impl Refused {
    /// Refused before any write.
    pub fn untouched(why: impl Into<String>) -> Refused {
        Refused { why: why.into(), verdict: Verdict::None, untouched: true, wrote: false, answer: None }
    }

    /// A write was refused.
    pub fn write_failed(why: impl Into<String>, verdict: Verdict, untouched: bool) -> Refused {
        Refused { why: why.into(), verdict, untouched, wrote: true, answer: None }
    }

    /// Refused before any write, with the answer a request for this very device gets.
    pub fn answer(why: impl Into<String>, answer: Answer) -> Refused {
        Refused { why: why.into(), verdict: Verdict::None, untouched: true, wrote: false, answer: Some(answer) }
    }
}

/// The answer to a request for this very device (the sequence turns it into the API's
/// error for the device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The GPU's IOMMU group holds `foreign` functions gpuvisor does not manage.
    GroupConflict {
        /// The GPU's IOMMU group number.
        group: u32,
        /// The other devices in the group (BDFs): neither functions of the GPU nor PCI
        /// bridges.
        foreign: Vec<String>,
    },
    /// Host processes (`holders`, described) hold the GPU through the host driver's `node`.
    GpuBusy {
        /// The host driver's device node, e.g. `/dev/nvidia0`.
        node: String,
        /// Each holding process, as `pid <N> (<comm>)`.
        holders: Vec<String>,
        /// The configured `passthrough_stop_services` were stopped (and started again) and
        /// the GPU was still held; `false`: none are configured.
        services_stopped: bool,
    },
    /// Moving the group to `vfio-pci` failed with `error`.
    BindFailed {
        /// The failed write or check, in one sentence.
        error: String,
    },
}

/// Why a clear did not complete.
#[derive(Debug, Clone, PartialEq)]
pub enum ClearError {
    /// The write failed and the device is still occupied (EBUSY during teardown, EIO, a
    /// binding write that did not return, ...).
    Failed(WriteError),
    /// A VF reads another non-zero type than the one gpuvisor recorded (a foreign writer):
    /// nothing was written.
    Foreign {
        /// The type id the VF reads now.
        value: u32,
    },
}

/// What a VMM needs to attach a claimed device through VFIO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VfioDevice {
    /// The device's sysfs directories (`sys/bus/pci/devices/<bdf>`, or the mdev's), one per
    /// function the VM gets.
    pub sysfs: Vec<PathBuf>,
    /// Its IOMMU group (`dev/vfio/<group>`), when it can be read.
    pub group: Option<u32>,
}

/// What a view shows of a claimed device (`instance.get`, `claim.prepare`, error details).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedDevice {
    /// Its sysfs directory: the VF's or GPU's, or the mdev's.
    pub sysfs_path: PathBuf,
    /// Its PCI address, when the VM gets a PCI function of the host (not for an mdev).
    pub pci_address: Option<String>,
    /// Its IOMMU group (read now; passthrough: as the claim recorded it).
    pub group: Option<u32>,
}

/// The IOMMU group a sysfs device directory links to (none when unreadable).
pub(crate) fn group_of(dir: &std::path::Path) -> Option<u32> {
    super::link_basename(&dir.join("iommu_group")).ok().and_then(|g| g.parse().ok())
}

/// One device kind.
pub trait Backend: Sync {
    /// The device nodes whose holders block a release of `held`: a process holding one
    /// keeps the device (docs/design/host.md §5). An error makes the scan unknown (fail
    /// closed).
    fn release_targets(&self, host: &HostRoot, held: &Held<'_>) -> Result<Vec<PathBuf>, DeviceError>;

    /// Clears `held` and reads it back, reporting each write to `steps`.
    /// [`Cleared::Wrote`] only when a write of this call took effect.
    ///
    /// **Only the release path calls this.**
    fn clear(&self, host: &HostRoot, held: &Held<'_>, steps: &dyn ClearSteps) -> Result<Cleared, ClearError>;

    /// The type a claimed device holds now that must be cleared (through the release path)
    /// before it is configured: a dirty VF. `None` for a kind that is created fresh. An
    /// error: its state cannot be read.
    fn dirty(&self, _host: &HostRoot, _held: &Held<'_>) -> Result<Option<u32>, DeviceError> {
        Ok(None)
    }

    /// Configures the claimed `held` for `profile` (the type write and its read-back, the
    /// mdev create, the passthrough bind), reporting each write to `steps`; the sequence
    /// holds the configure and device locks. Answers the claim's kind as configured (a VF
    /// records the type id it wrote).
    fn configure(
        &self,
        host: &HostRoot,
        held: &Held<'_>,
        profile: &str,
        steps: &dyn ConfigureSteps,
    ) -> Result<ClaimKind, Refused>;

    /// What a view shows of the claimed `held`.
    fn view(&self, host: &HostRoot, held: &Held<'_>) -> ClaimedDevice;

    /// What the VMM attaches for `held` (docs/design/host.md §5: the group node and the
    /// device's sysfs directory).
    fn vfio_device(&self, host: &HostRoot, held: &Held<'_>) -> VfioDevice;

    /// Adds this kind's GPUs in `scan` to `out` (none when the host does not run this kind),
    /// each device with its state from `steps`' records, and — for a vGPU `profile` — the
    /// legal candidates. Reads the host beyond the scan only for what the scan does not
    /// hold; writes nothing.
    fn observe(
        &self,
        host: &HostRoot,
        scan: &HostScan,
        profile: Option<&str>,
        steps: &dyn ObserveSteps,
        out: &mut Observed,
    );
}

/// The backend of a claim's kind.
pub fn backend(kind: &ClaimKind) -> &'static dyn Backend {
    match kind {
        ClaimKind::Vf { .. } => &super::vendor_vfio::VendorVfio,
        ClaimKind::Mdev { .. } => &super::mdev::Mdev,
        ClaimKind::Passthrough(_) => &super::passthrough::Passthrough,
    }
}

/// Every backend, in the order an observation lists their GPUs.
pub fn backends() -> [&'static dyn Backend; 3] {
    [&super::vendor_vfio::VendorVfio, &super::mdev::Mdev, &super::passthrough::Passthrough]
}

/// The error of a backend handed a claim of another kind (a bug: [`backend`] picks by kind).
pub(crate) fn wrong_kind(backend: &'static str, held: &Held<'_>) -> DeviceError {
    DeviceError::WrongKind { backend, framework: held.kind.framework().as_str(), device: held.device.to_string() }
}

/// A temp-dir host tree shaped like docs/design/host.md (plain files, directories and
/// symlinks: what a backend reads; no kernel behind the writes) and a [`ClearSteps`] that
/// records what a clear reported, for the backends' unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::{Answer, ClearSteps, ConfigureSteps, Refused, Verdict, WriteSite};
    use crate::devices::observed::{DeviceRecords, ObserveSteps, Observed};
    use crate::devices::{HostMode, HostScan, WriteError};
    use crate::domain::{Claim, HealthRecord};
    use crate::host::HostRoot;
    use gpuvisor_sdk::DeviceState;
    use std::cell::RefCell;
    use std::fs;
    use std::path::{Path, PathBuf};

    /// A host root in a temp dir.
    pub struct Tree {
        /// Removed when the tree is dropped.
        _dir: tempfile::TempDir,
        pub host: HostRoot,
    }

    impl Tree {
        pub fn new() -> Tree {
            let dir = tempfile::tempdir().unwrap();
            let host = HostRoot::new(dir.path());
            Tree { _dir: dir, host }
        }

        /// `rel` under the root.
        pub fn path(&self, rel: &str) -> PathBuf {
            self.host.root().join(rel)
        }

        /// Writes `text` to `rel` (parents created).
        pub fn file(&self, rel: &str, text: &str) -> PathBuf {
            let p = self.path(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, text).unwrap();
            p
        }

        /// A directory at `rel`.
        pub fn dir(&self, rel: &str) -> PathBuf {
            let p = self.path(rel);
            fs::create_dir_all(&p).unwrap();
            p
        }

        /// A symlink at `rel` pointing to `target` (as the kernel writes them: relative).
        pub fn link(&self, rel: &str, target: &str) {
            let p = self.path(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(target, p).unwrap();
        }

        /// The text of `rel`.
        pub fn read(&self, rel: &str) -> String {
            fs::read_to_string(self.path(rel)).unwrap()
        }

        /// A PCI function `sys/bus/pci/devices/<bdf>` in IOMMU group `group`, with the
        /// iommufd cdevs `cdevs` under `vfio-dev/`.
        pub fn pci_function(&self, bdf: &str, group: Option<u32>, cdevs: &[&str]) {
            self.dir(&format!("sys/bus/pci/devices/{bdf}"));
            if let Some(g) = group {
                self.dir(&format!("sys/kernel/iommu_groups/{g}/devices"));
                self.link(
                    &format!("sys/bus/pci/devices/{bdf}/iommu_group"),
                    &format!("../../../../kernel/iommu_groups/{g}"),
                );
            }
            for c in cdevs {
                self.dir(&format!("sys/bus/pci/devices/{bdf}/vfio-dev/{c}"));
            }
        }
    }

    /// One thing a clear reported.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Step {
        Write { device: String, gpu: String, site: WriteSite, ok: bool },
        Quarantine { device: String, reason: String },
        ResetDone,
        MdevRemoved(uuid::Uuid),
        MdevCreating { uuid: uuid::Uuid, parent: String, mdev_type: String },
        MdevNotCreated(uuid::Uuid),
        FreeFromHostDriver(PathBuf),
        StartServices,
    }

    /// Records every step; `may_reset` answers as set; the host driver's holders are
    /// `busy` (a `gpu_busy` answer) or none, after stopping services when `services`.
    pub struct Recorder {
        pub steps: RefCell<Vec<Step>>,
        pub may_reset: bool,
        pub busy: bool,
        pub services: bool,
    }

    impl Recorder {
        pub fn new(may_reset: bool) -> Recorder {
            Recorder { steps: RefCell::new(Vec::new()), may_reset, busy: false, services: false }
        }

        pub fn taken(&self) -> Vec<Step> {
            self.steps.borrow().clone()
        }
    }

    impl ClearSteps for Recorder {
        fn write_outcome(&self, device: &str, gpu: &str, site: WriteSite, result: &Result<(), WriteError>) {
            self.steps.borrow_mut().push(Step::Write {
                device: device.into(),
                gpu: gpu.into(),
                site,
                ok: result.is_ok(),
            });
        }
        fn quarantine(&self, device: &str, reason: &str, _detail: &str) {
            self.steps.borrow_mut().push(Step::Quarantine { device: device.into(), reason: reason.into() });
        }
        fn may_reset(&self, _device: &str) -> bool {
            self.may_reset
        }
        fn reset_done(&self) {
            self.steps.borrow_mut().push(Step::ResetDone);
        }
        fn mdev_removed(&self, uuid: uuid::Uuid) {
            self.steps.borrow_mut().push(Step::MdevRemoved(uuid));
        }
    }

    impl ConfigureSteps for Recorder {
        fn write_outcome(&self, device: &str, gpu: &str, site: WriteSite, result: &Result<(), WriteError>) -> Verdict {
            ClearSteps::write_outcome(self, device, gpu, site, result);
            Verdict::None
        }
        fn quarantine(&self, device: &str, reason: &str, detail: &str) {
            ClearSteps::quarantine(self, device, reason, detail);
        }
        fn mdev_creating(&self, uuid: uuid::Uuid, parent: &str, mdev_type: &str) -> Result<(), super::NotRecorded> {
            self.steps.borrow_mut().push(Step::MdevCreating {
                uuid,
                parent: parent.into(),
                mdev_type: mdev_type.into(),
            });
            Ok(())
        }
        fn mdev_not_created(&self, uuid: uuid::Uuid) {
            self.steps.borrow_mut().push(Step::MdevNotCreated(uuid));
        }
        fn free_from_host_driver(&self, _gpu: &str, node: &Path) -> Result<bool, Refused> {
            self.steps.borrow_mut().push(Step::FreeFromHostDriver(node.to_path_buf()));
            if self.busy {
                let answer = Answer::GpuBusy {
                    node: node.display().to_string(),
                    holders: vec!["7 (x)".into()],
                    services_stopped: false,
                };
                return Err(Refused::answer("busy", answer));
            }
            Ok(self.services)
        }
        fn start_services(&self) {
            self.steps.borrow_mut().push(Step::StartServices);
        }
    }

    /// True when `p` exists (a file, directory or link).
    pub fn exists(p: &Path) -> bool {
        fs::symlink_metadata(p).is_ok()
    }

    /// What an observation's records say, for the backends' observe tests: every GPU but
    /// the passthrough ones is managed; `claims` are the readable claims; `quarantined` devices have a quarantine
    /// mark; `unreadable_claims` have a claim file that cannot be read; every profile is
    /// known, of the framebuffer its name says.
    #[derive(Default)]
    pub struct Records {
        pub claims: Vec<Claim>,
        pub quarantined: Vec<String>,
        pub unreadable_claims: Vec<String>,
        pub passthrough_gpus: Vec<String>,
    }

    impl ObserveSteps for Records {
        fn records(&self, device: &str) -> DeviceRecords {
            DeviceRecords {
                claim: self.claims.iter().find(|c| c.device == device).cloned(),
                claim_unreadable: self
                    .unreadable_claims
                    .iter()
                    .find(|d| *d == device)
                    .map(|d| format!("claims/{d}.json: not JSON")),
                claim_unreadable_owner: None,
                health: self.quarantined.iter().find(|d| *d == device).map(|d| HealthRecord {
                    device: d.clone(),
                    reason: "eio".into(),
                    quarantined: true,
                    detail: "test".into(),
                    at: "2026-12-05T00:00:00Z".into(),
                    eio_in_a_row: 2,
                }),
                owner_labels: Some(Default::default()),
                unknown_claim: None,
            }
        }
        fn claims(&self) -> &[Claim] {
            &self.claims
        }
        fn manages(&self, gpu: &str) -> bool {
            // As the configuration says: a passthrough GPU is not a vGPU parent.
            !self.passthrough_gpus.iter().any(|g| g.eq_ignore_ascii_case(gpu))
        }
        fn passthrough_gpus(&self) -> &[String] {
            &self.passthrough_gpus
        }
        fn gpu_mark(&self, _gpu: &str) -> Option<HealthRecord> {
            None
        }
        fn learn(&self, _name: &str, _fb: Option<u64>) {}
        fn learn_type(&self, _driver: &Option<String>, _gpu: &str, _id: u32, _name: &str) {}
        fn learn_gpu_size(&self, _gpu: &str, _fb: Option<u64>) {}
        fn type_name(&self, _gpu: &str, _id: u32) -> Option<String> {
            None
        }
        fn profile_fb(&self, profile: &str) -> Option<u64> {
            gpuvisor_sdk::profile_framebuffer_mib(profile)
        }
        fn known(&self, _profile: &str) -> bool {
            true
        }
        fn gpu_size(&self, _gpu: &str, _device_id: &str) -> Option<u64> {
            None
        }
    }

    /// A host scan of `mode` with nothing in it (a test fills what its kind reads).
    pub fn scan(mode: HostMode) -> HostScan {
        HostScan {
            mode: Ok(mode),
            vendor: vec![],
            parents: vec![],
            mdevs: vec![],
            unreadable: vec![],
            driver_version: None,
        }
    }

    /// What `b` observes of `scan` for `profile` with `records`.
    pub fn observe(
        b: &dyn super::Backend,
        host: &HostRoot,
        scan: &HostScan,
        profile: Option<&str>,
        records: &Records,
    ) -> Observed {
        let mut out = Observed::default();
        b.observe(host, scan, profile, records, &mut out);
        out
    }

    /// The (device, state) pairs of an observation.
    pub fn states(o: &Observed) -> Vec<(String, DeviceState)> {
        o.gpus.iter().flat_map(|g| g.devices.iter().map(|d| (d.address.clone(), d.state))).collect()
    }
}
