//! # observed — what one observation makes of a device kind's GPUs
//!
//! Each backend's [`super::Backend::observe`] turns the host scan into these: every GPU of
//! its kind with its devices and their states, and the legal candidates of a request. The
//! records it needs (claims, health marks, what earlier observations taught about profiles)
//! come through [`ObserveSteps`], implemented by the observing sequence
//! (`instances::inventory`), which also assembles the whole observation.
//!
//! One rule every kind keeps, written once here ([`DeviceRecords::state`]): **unknown is
//! never clear** — a claim, or a claim file that cannot be read, makes a device claimed; a
//! quarantine mark quarantines it; unreadable state is `unreadable`, never free.

use super::passthrough;
use crate::domain::{Claim, ClaimKind, HealthRecord, Labels};
use gpuvisor_sdk::DeviceState;

/// What `current_vgpu_type` of a device reads: a type id (`0`: none), or unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TypeReading {
    /// The type id (`0`: no vGPU).
    Id(u32),
    /// The type cannot be read: why.
    Unknown(String),
}

impl TypeReading {
    /// The id, when known.
    pub fn id(&self) -> Option<u32> {
        match self {
            TypeReading::Id(i) => Some(*i),
            TypeReading::Unknown(_) => None,
        }
    }
}

/// One device (VF or mdev parent) as observed.
#[derive(Debug, Clone)]
pub struct ObservedDevice {
    /// The device's PCI address (BDF).
    pub address: String,
    /// Whether it can be handed out now (free, claimed, dirty, quarantined, unreadable).
    pub state: DeviceState,
    /// Vendor VFIO: `current_vgpu_type`. mdev parents: `Id(0)` (no type file).
    pub current_type: TypeReading,
    /// Canonical profile names the device can create now (free devices only).
    pub creatable: Vec<String>,
    /// Its claim, if one could be read.
    pub claim: Option<Claim>,
    /// A claim file for this device exists but cannot be read (`path: error`).
    pub claim_unreadable: Option<String>,
    /// The owner that unreadable claim file still names, if its JSON says.
    pub claim_unreadable_owner: Option<uuid::Uuid>,
    /// The owner's labels are unknown (a legacy claim whose owner record cannot be read).
    pub owner_labels: Option<Labels>,
    /// Its health mark, if any (an unreadable health file is a quarantine mark).
    pub health: Option<HealthRecord>,
    /// Why its state cannot be read, if it cannot.
    pub unreadable: Option<String>,
    /// `creatable_vgpu_types` lines skipped (malformed, or id 0).
    pub catalog_skipped: Vec<String>,
    /// Its claim names another type than the VF holds now (a foreign write under a VM).
    pub type_mismatch: Option<String>,
}

impl ObservedDevice {
    /// A device with no type file (an mdev parent, a passthrough GPU), from its records.
    pub fn without_type(
        address: &str,
        state: DeviceState,
        creatable: Vec<String>,
        r: DeviceRecords,
        unreadable: Option<String>,
    ) -> ObservedDevice {
        ObservedDevice {
            address: address.to_string(),
            state,
            current_type: TypeReading::Id(0),
            creatable,
            claim: r.claim,
            claim_unreadable: r.claim_unreadable,
            claim_unreadable_owner: r.claim_unreadable_owner,
            owner_labels: r.owner_labels,
            health: r.health,
            unreadable,
            catalog_skipped: vec![],
            type_mismatch: None,
        }
    }
}

/// One managed GPU (PF) as observed.
#[derive(Debug, Clone)]
pub struct ObservedGpu {
    /// The GPU's (PF's) PCI address.
    pub address: String,
    /// The GPU's model name.
    pub model: String,
    /// The GPU's framebuffer, MiB; `None` when it cannot be read.
    pub framebuffer_mib: Option<u64>,
    /// The GPU's NUMA node; `None` when unreadable or none.
    pub numa_node: Option<i32>,
    /// Framebuffer held by the claims on its devices, MiB (claims of unknown size count 0).
    pub claimed_framebuffer_mib: u64,
    /// Every claim on its devices has a known framebuffer size (`claimed_framebuffer_mib`
    /// is exact).
    pub load_known: bool,
    /// gpuvisor may touch its devices (`managed_gpus`).
    pub managed: bool,
    /// A GPU-level health mark (`health/<PF>.json`).
    pub health: Option<HealthRecord>,
    /// Its vGPU devices (VFs or mdev parents); a passthrough GPU's one device is itself.
    pub devices: Vec<ObservedDevice>,
    /// A passthrough GPU (its one device is the GPU itself); `None` for a vGPU parent.
    pub passthrough: Option<PassthroughObserved>,
}

/// What a passthrough GPU's group reads now.
#[derive(Debug, Clone)]
pub struct PassthroughObserved {
    /// The group and its members (`None` when they cannot be read: the GPU is unreadable).
    pub read: Option<passthrough::PtGpu>,
    /// Why it cannot be handed out even when free (a foreign group member, VFs enabled).
    pub problem: Option<String>,
}

/// What the store says about one device.
pub struct DeviceRecords {
    /// Its claim, if one could be read.
    pub claim: Option<Claim>,
    /// A claim file for it that cannot be read (`path: error`).
    pub claim_unreadable: Option<String>,
    /// The owner that unreadable claim file still names, if its JSON says.
    pub claim_unreadable_owner: Option<uuid::Uuid>,
    /// Its health mark (an unreadable health file is a quarantine mark).
    pub health: Option<HealthRecord>,
    /// What placement knows of the claim's owner (`None`: unknown).
    pub owner_labels: Option<Labels>,
    /// A claim file that cannot be read and whose name names no device: it may own this
    /// device if it is occupied (`Observation::unknown_claim` in `instances::inventory`).
    pub unknown_claim: Option<String>,
}

impl DeviceRecords {
    /// A device's state, in the one order of precedence every kind uses: a claim (or a
    /// claim file that cannot be read), then a quarantine mark, then unreadable state, then
    /// `dirty` (occupied without a claim), else free. Unknown is never free. An occupied
    /// device while a claim file whose device cannot be known exists is claimed by that
    /// file (shown as its unreadable claim): it may be its owner's, so it is never swept
    /// nor repaired (an owner that cannot be known blocks what it might own).
    pub fn state(&mut self, unreadable: bool, dirty: bool) -> DeviceState {
        if dirty && self.claim.is_none() && self.claim_unreadable.is_none() {
            self.claim_unreadable = self.unknown_claim.take();
        }
        if self.claim.is_some() || self.claim_unreadable.is_some() {
            DeviceState::Claimed
        } else if self.health.as_ref().is_some_and(|h| h.quarantined) {
            DeviceState::Quarantined
        } else if unreadable {
            DeviceState::Unreadable
        } else if dirty {
            DeviceState::Dirty
        } else {
            DeviceState::Free
        }
    }
}

/// A placeable device as the native side sees it (the legal-candidate check).
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The device's PCI address (BDF).
    pub device: String,
    /// Its GPU (PF BDF).
    pub gpu: String,
    /// A VF holding a type with no claim (repaired before configure).
    pub dirty: bool,
    /// What a claim of it will hold. Private: a claim's kind comes from
    /// [`Candidate::claim_kind`] only, so that each mdev claim gets its own UUID.
    offer: ClaimKind,
}

impl Candidate {
    /// A candidate whose claim will hold `offer` (a VF: no type yet; an mdev: its type
    /// directory, the UUID drawn per claim; a whole GPU: its group and every function's
    /// driver now, recorded as the original drivers before anything changes).
    pub fn new(device: &str, gpu: &str, dirty: bool, offer: ClaimKind) -> Candidate {
        Candidate { device: device.to_string(), gpu: gpu.to_string(), dirty, offer }
    }

    /// The per-kind part of a fresh claim of this candidate (an mdev gets a new UUID).
    pub fn claim_kind(&self) -> ClaimKind {
        self.offer.renewed()
    }

    /// What a claim of it will hold, to read (its mdev UUID is a placeholder).
    pub fn offer(&self) -> &ClaimKind {
        &self.offer
    }
}

/// What a backend's observation adds: its GPUs, the legal candidates for the request, and
/// notes on devices that are not candidates.
#[derive(Debug, Default)]
pub struct Observed {
    /// Every GPU of the kind seen (managed or not).
    pub gpus: Vec<ObservedGpu>,
    /// Legal candidates for the requested profile.
    pub candidates: Vec<Candidate>,
    /// Human notes on devices that are not candidates.
    pub notes: Vec<String>,
}

/// What a backend's observation reads besides the host: the records, the configuration,
/// and what earlier observations taught about profiles. Implemented by the observing
/// sequence only.
pub trait ObserveSteps {
    /// The records about `device` (a VF, an mdev parent, a passthrough GPU).
    fn records(&self, device: &str) -> DeviceRecords;
    /// The claims that could be read.
    fn claims(&self) -> &[Claim];
    /// gpuvisor may touch the GPU `gpu`'s devices (`managed_gpus`).
    fn manages(&self, gpu: &str) -> bool;
    /// The configured passthrough GPUs (`passthrough_gpus`).
    fn passthrough_gpus(&self) -> &[String];
    /// A GPU-level health mark on `gpu`.
    fn gpu_mark(&self, gpu: &str) -> Option<HealthRecord>;
    /// Remembers the profile `name` (of `fb` MiB) was seen.
    fn learn(&self, name: &str, fb: Option<u64>);
    /// Remembers the type id `id` is the profile `name` on the GPU `gpu` under `driver`.
    fn learn_type(&self, driver: &Option<String>, gpu: &str, id: u32, name: &str);
    /// Remembers the GPU `gpu` offers a profile of `fb` MiB (its size is the largest).
    fn learn_gpu_size(&self, gpu: &str, fb: Option<u64>);
    /// The profile name the type id `id` had on `gpu`, if learned.
    fn type_name(&self, gpu: &str, id: u32) -> Option<String>;
    /// The framebuffer of a profile, MiB (`None`: unknown).
    fn profile_fb(&self, profile: &str) -> Option<u64>;
    /// True when the profile name was seen in any catalog or claim.
    fn known(&self, profile: &str) -> bool;
    /// The framebuffer of the GPU `gpu` (of PCI device id `device_id`), MiB, if known.
    fn gpu_size(&self, gpu: &str, device_id: &str) -> Option<u64>;
}

/// The claimed framebuffer of a GPU's devices (from claims, not sysfs) and whether every
/// claimed size is known.
pub fn load_of(devices: &[ObservedDevice], steps: &dyn ObserveSteps) -> (u64, bool) {
    let sizes: Vec<Option<u64>> = devices
        .iter()
        .filter(|d| d.claim.is_some() || d.claim_unreadable.is_some())
        .map(|d| d.claim.as_ref().and_then(|c| steps.profile_fb(&c.profile)))
        .collect();
    (sizes.iter().flatten().sum(), sizes.iter().all(|s| s.is_some()))
}
