//! Observation of the host: one [`devices::scan`] plus the claim and health records, turned
//! into what every caller needs — the placement inventory (the plugins' view), the legal
//! candidates for a profile, and the facts the views show (current types, unreadable
//! devices, claim/type mismatches). What observations teach about profiles (names, type
//! ids, framebuffer sizes) is kept in the [`ProfileBook`].
//!
//! Rules kept here:
//! - **unknown is never clear**: a device whose type cannot be read is `unreadable`, never
//!   free or type 0; a claim or health record that cannot be decoded blocks the device its
//!   file names (claimed / quarantined); a claim file whose name names no device blocks
//!   every occupied device (an owner that cannot be known blocks what it might own);
//! - **O(1) store work per claim**: what placement needs about an owner (its labels) comes
//!   from the claim itself, not from the instance records;
//! - each problem is logged once, when it appears, naming the device (not at every
//!   observation).

use super::{now_rfc3339, Manager};
use crate::devices::{self, mdev, passthrough, vendor_vfio, DeviceError, HostMode, UnreadableDevice};
use crate::error::ApiError;
use crate::store::{
    Claim, ClaimKind, ClaimState, Framework, FunctionRecord, HealthRecord, Listing, PassthroughClaim, Store,
};
use crate::sync::lock;
use gpuvisor_sdk::{profile_framebuffer_mib, DeviceOwner, DeviceState, DeviceView, GpuView, Inventory};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;
use uuid::Uuid;

/// True when a claim file's key (its name without `.json`) names a device: a PCI address
/// (a VF, an mdev parent, a passthrough GPU) or an mdev UUID.
fn names_a_device(key: &str) -> bool {
    crate::config::is_bdf(&key.to_ascii_lowercase()) || uuid::Uuid::parse_str(key).is_ok()
}

/// The profile name requests, claims and plugins use for a whole GPU.
pub const PASSTHROUGH: &str = "passthrough";

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
    pub owner_labels: Option<crate::store::Labels>,
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
    fn without_type(
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
struct DeviceRecords {
    claim: Option<Claim>,
    claim_unreadable: Option<String>,
    claim_unreadable_owner: Option<uuid::Uuid>,
    health: Option<HealthRecord>,
    owner_labels: Option<crate::store::Labels>,
    /// A claim file that cannot be read and whose name names no device: it may own this
    /// device if it is occupied ([`Observation::unknown_claim`]).
    unknown_claim: Option<String>,
}

impl DeviceRecords {
    /// A device's state, in the one order of precedence every kind uses: a claim (or a
    /// claim file that cannot be read), then a quarantine mark, then unreadable state, then
    /// `dirty` (occupied without a claim), else free. Unknown is never free. An occupied
    /// device while a claim file whose device cannot be known exists is claimed by that
    /// file (shown as its unreadable claim): it may be its owner's, so it is never swept
    /// nor repaired (an owner that cannot be known blocks what it might own).
    fn state(&mut self, unreadable: bool, dirty: bool) -> DeviceState {
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
    /// What a claim of it will hold.
    pub offer: Offer,
}

/// What a claim of a candidate will hold, by device kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offer {
    /// A VF (its type is looked up in its fresh catalog at configure time).
    Vf,
    /// An mdev of the type directory `mdev_type` on the candidate.
    Mdev {
        /// The type directory name, e.g. `nvidia-1148`.
        mdev_type: String,
    },
    /// A whole GPU: its group and every function's driver now (recorded in the claim as the
    /// original drivers, before anything changes).
    Passthrough(PassthroughClaim),
}

impl Candidate {
    /// The per-kind part of a fresh claim of this candidate (an mdev gets a new UUID).
    pub fn claim_kind(&self) -> ClaimKind {
        match &self.offer {
            Offer::Vf => ClaimKind::Vf { type_id: None },
            Offer::Mdev { mdev_type } => {
                ClaimKind::Mdev { uuid: Uuid::new_v4(), mdev_type: mdev_type.clone(), type_id: None }
            }
            Offer::Passthrough(p) => ClaimKind::Passthrough(p.clone()),
        }
    }
}

/// The host and the store observed once.
#[derive(Debug, Clone)]
pub struct Observation {
    /// The framework, or the probe error.
    pub mode: Result<HostMode, DeviceError>,
    /// Every GPU seen (managed or not).
    pub gpus: Vec<ObservedGpu>,
    /// Legal candidates for the requested profile (empty without one).
    pub candidates: Vec<Candidate>,
    /// Human notes on devices that are not candidates (e.g. a dirty VF in use).
    pub notes: Vec<String>,
    /// Devices whose state cannot be read (managed or not).
    pub unreadable: Vec<UnreadableDevice>,
    /// The claims read, and those that could not be.
    pub claims: Listing<Claim>,
    /// The health marks read, and those that could not be.
    pub health: Listing<HealthRecord>,
    /// The driver version (`sys/module/nvidia/version`).
    pub driver_version: Option<String>,
    /// Existing mdevs (mdev hosts).
    pub mdevs: Vec<mdev::MdevDevice>,
    /// The raw vendor-VFIO GPUs (for the sweep).
    pub vendor: Vec<vendor_vfio::GpuInfo>,
}

impl Observation {
    /// A claim file that cannot be read and whose file name names no device (neither a PCI
    /// address nor an mdev UUID): its device cannot be known, so it may own any occupied
    /// device — every dirty device and every orphan mdev is kept while it exists.
    pub fn unknown_claim(&self) -> Option<&crate::store::Unreadable> {
        self.claims.unreadable.iter().find(|u| !names_a_device(&u.key))
    }

    /// The unreadable claim record that may own the device `device` (a VF, mdev parent,
    /// passthrough GPU or mdev UUID) or any of `related` (an mdev's parent): one whose file
    /// names one of them, or one whose device cannot be known ([`Observation::unknown_claim`]).
    pub fn unreadable_claim_over(&self, device: &str, related: &[&str]) -> Option<&crate::store::Unreadable> {
        self.claims
            .unreadable
            .iter()
            .find(|u| std::iter::once(device).chain(related.iter().copied()).any(|d| u.key.eq_ignore_ascii_case(d)))
            .or_else(|| self.unknown_claim())
    }

    /// The GPU framework claims use, or why vGPU claims are refused now (`not_ready`).
    pub fn framework(&self) -> Result<Framework, ApiError> {
        Observation::framework_of(&self.mode)
    }

    fn framework_of(mode: &Result<HostMode, DeviceError>) -> Result<Framework, ApiError> {
        match mode {
            Ok(HostMode::VendorVfio) => Ok(Framework::VendorVfio),
            Ok(HostMode::Mdev) => Ok(Framework::Mdev),
            Ok(HostMode::Mixed) => Err(ApiError::not_ready(
                "the host shows both vendor-VFIO VFs and mdev types (mixed); vGPU claims are refused",
            )),
            Ok(HostMode::WaitingForVfs) => Err(ApiError::not_ready(
                "the host's GPUs have no SR-IOV VFs yet (waiting for sriov-manage); retry later",
            )),
            Ok(HostMode::None) => Err(ApiError::not_ready("this host has no vGPU-capable NVIDIA device")),
            Err(e) => Err(ApiError::not_ready(format!("GPU framework probe failed: {e}"))),
        }
    }

    /// The wire name of the mode (`probe_error` for a probe error).
    pub fn mode_name(&self) -> &'static str {
        match &self.mode {
            Ok(m) => m.as_str(),
            Err(_) => "probe_error",
        }
    }

    /// The placement inventory the plugins see for a request of `framework`: the managed
    /// vGPU parents, or the passthrough GPUs.
    pub fn inventory(&self, framework: Framework) -> Inventory {
        let whole = framework == Framework::Passthrough;
        let gpus = self
            .gpus
            .iter()
            .filter(|g| g.managed && g.passthrough.is_some() == whole)
            // A whole GPU that can never be handed out (a foreign device in its group, VFs
            // enabled) is not shown to plugins: it is not a candidate in any state.
            .filter(|g| g.passthrough.as_ref().is_none_or(|p| p.problem.is_none()))
            .map(|g| GpuView {
                address: g.address.clone(),
                model: g.model.clone(),
                framebuffer_mib: g.framebuffer_mib,
                numa_node: g.numa_node,
                claimed_framebuffer_mib: g.claimed_framebuffer_mib,
                load_known: g.load_known,
                devices: g
                    .devices
                    .iter()
                    .map(|d| DeviceView {
                        address: d.address.clone(),
                        state: d.state,
                        current_type: d.current_type.id().filter(|t| *t != 0),
                        creatable: d.creatable.clone(),
                        owner: match (&d.claim, &d.claim_unreadable) {
                            (Some(c), _) => Some(DeviceOwner {
                                instance_id: c.owner.instance().map(|i| i.to_string()).unwrap_or_default(),
                                profile: Some(c.profile.clone()),
                                labels: d.owner_labels.clone().unwrap_or_default(),
                                labels_known: d.owner_labels.is_some(),
                            }),
                            // A claim that cannot be read: its owner is unknown, never "no one".
                            (None, Some(_)) => Some(DeviceOwner {
                                instance_id: d.claim_unreadable_owner.map(|u| u.to_string()).unwrap_or_default(),
                                profile: None,
                                labels: Default::default(),
                                labels_known: false,
                            }),
                            (None, None) => None,
                        },
                    })
                    .collect(),
            })
            .collect();
        Inventory { gpus }
    }

    /// Every observed vGPU device (VF, mdev parent) of managed GPUs.
    pub fn devices(&self) -> impl Iterator<Item = (&ObservedGpu, &ObservedDevice)> {
        self.gpus
            .iter()
            .filter(|g| g.managed && g.passthrough.is_none())
            .flat_map(|g| g.devices.iter().map(move |d| (g, d)))
    }

    /// Every passthrough GPU: the GPU, its one device, and its group.
    pub fn passthrough(&self) -> impl Iterator<Item = (&ObservedGpu, &ObservedDevice, &PassthroughObserved)> {
        self.gpus.iter().filter_map(|g| Some((g, g.devices.first()?, g.passthrough.as_ref()?)))
    }
}

/// The driver version type names were learned under, and (PF, type id) → profile name.
type TypeNames = (Option<String>, HashMap<(String, u32), String>);

/// What observations taught: profile names (persisted), type ids per GPU, GPU sizes; and
/// the problems last reported (so each is logged once).
pub struct ProfileBook {
    path: PathBuf,
    /// Canonical profile name (upper case) → (the catalog's spelling, framebuffer MiB), for
    /// every name seen in a catalog or a claim (docs/design/host.md §3.5: tells `unknown_profile`
    /// from `no_capacity`).
    known: Mutex<BTreeMap<String, (String, Option<u64>)>>,
    /// The driver version the names were learned under, and (PF, type id) → profile name:
    /// a VF holding a type shows an empty catalog, so a dirty VF's size is looked up here
    /// when no sibling lists its type any more. Reset when the driver version changes.
    type_names: Mutex<TypeNames>,
    /// PF → largest framebuffer seen in any of its catalogs (the GPU's size).
    gpu_framebuffer: Mutex<HashMap<String, u64>>,
    /// Problems reported by the last observation: `device: reason` lines.
    reported: Mutex<BTreeSet<String>>,
    /// The framework the last observation found (the capability gate's input; the claim
    /// re-checks it under the allocation lock).
    last_mode: Mutex<Option<Result<HostMode, DeviceError>>>,
}

impl ProfileBook {
    /// Loads the persisted profile names (`<data-dir>/profiles.json`).
    pub fn load(store: &Store) -> ProfileBook {
        let path = store.root().join("profiles.json");
        let known = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        ProfileBook {
            path,
            known: Mutex::new(known),
            type_names: Mutex::new((None, HashMap::new())),
            gpu_framebuffer: Mutex::new(HashMap::new()),
            reported: Mutex::new(BTreeSet::new()),
            last_mode: Mutex::new(None),
        }
    }

    /// Remembers a profile name; new names are persisted so that a full GPU after a restart
    /// still tells `no_capacity` from `unknown_profile`.
    fn learn(&self, name: &str, fb: Option<u64>) {
        let canon = gpuvisor_sdk::canonical_profile(name);
        if canon.is_empty() {
            return;
        }
        let mut known = lock(&self.known);
        let key = canon.to_ascii_uppercase();
        if known.contains_key(&key) {
            return;
        }
        known.insert(key, (canon.to_string(), fb));
        if let Err(e) = crate::store::write_json_atomic(&self.path, &*known) {
            tracing::warn!(error = %e, "cannot persist the known profile names");
        }
    }

    fn learn_type(&self, driver: &Option<String>, pf: &str, id: u32, name: &str) {
        let mut names = lock(&self.type_names);
        if names.0 != *driver {
            *names = (driver.clone(), HashMap::new());
        }
        names.1.insert((pf.to_string(), id), name.to_string());
    }

    fn type_name(&self, pf: &str, id: u32) -> Option<String> {
        lock(&self.type_names).1.get(&(pf.to_string(), id)).cloned()
    }

    fn learn_gpu_size(&self, pf: &str, fb: Option<u64>) {
        if let Some(fb) = fb {
            let mut m = lock(&self.gpu_framebuffer);
            let e = m.entry(pf.to_string()).or_insert(0);
            *e = (*e).max(fb);
        }
    }

    fn gpu_size(&self, pf: &str, device_id: &str) -> Option<u64> {
        devices::framebuffer_by_device_id(device_id).or_else(|| lock(&self.gpu_framebuffer).get(pf).copied())
    }

    /// The framebuffer of a profile: from the name, else from the mdev description or the
    /// known table; `None` = unknown.
    pub fn profile_fb(&self, profile: &str) -> Option<u64> {
        profile_framebuffer_mib(profile).or_else(|| {
            lock(&self.known)
                .get(&gpuvisor_sdk::canonical_profile(profile).to_ascii_uppercase())
                .and_then(|(_, fb)| *fb)
        })
    }

    /// True when a profile name was seen in any catalog or claim.
    pub fn known(&self, profile: &str) -> bool {
        lock(&self.known).contains_key(&gpuvisor_sdk::canonical_profile(profile).to_ascii_uppercase())
    }

    /// The catalog's spelling of a known profile (`l40s-2q` → `L40S-2Q`).
    pub fn spelling(&self, profile: &str) -> String {
        let canon = gpuvisor_sdk::canonical_profile(profile);
        lock(&self.known).get(&canon.to_ascii_uppercase()).map(|(n, _)| n.clone()).unwrap_or_else(|| canon.to_string())
    }

    /// Every known profile: (spelling, framebuffer MiB).
    pub fn all(&self) -> Vec<(String, Option<u64>)> {
        lock(&self.known).values().cloned().collect()
    }

    /// Logs the problems that appeared since the last observation (WARN, once each, naming
    /// the device) and those that went away (INFO).
    fn report(&self, now: BTreeSet<String>) {
        let mut last = lock(&self.reported);
        for p in now.difference(&last) {
            tracing::warn!(problem = %p, "device state cannot be used");
        }
        for p in last.difference(&now) {
            tracing::info!(problem = %p, "device problem gone");
        }
        *last = now;
    }
}

impl Manager {
    /// Reads the host and the claim and health records once and builds the observation,
    /// with the legal candidates for `profile` (None: inventory only). Errors: `not_ready`
    /// when the claim or health directories cannot be listed at all (an unreadable record
    /// only blocks what it names).
    pub(crate) fn observe(&self, profile: Option<&str>) -> Result<Observation, ApiError> {
        let scan = devices::scan(&self.host, &self.cfg.passthrough_gpus);
        let claims = self
            .store
            .scan_claims()
            .map_err(|e| ApiError::not_ready(format!("claim records cannot be listed: {e}")))?;
        let health = self
            .store
            .scan_health()
            .map_err(|e| ApiError::not_ready(format!("health records cannot be listed: {e}")))?;
        let driver = scan.driver_version.clone();
        for c in claims.records.iter().filter(|c| c.kind.framework() != Framework::Passthrough) {
            if let (Some(id), true) = (c.kind.type_id(), c.driver_version == driver) {
                self.book.learn_type(&driver, &c.gpu, id, &c.profile);
            }
            self.book.learn(&c.profile, profile_framebuffer_mib(&c.profile));
        }
        let mut obs = Observation {
            mode: scan.mode.clone(),
            gpus: Vec::new(),
            candidates: Vec::new(),
            notes: Vec::new(),
            unreadable: scan.unreadable.clone(),
            driver_version: driver.clone(),
            mdevs: scan.mdevs.clone(),
            vendor: scan.vendor.clone(),
            claims,
            health,
        };
        match scan.mode {
            Ok(HostMode::Mdev) => self.observe_mdev(&scan, profile, &mut obs),
            // A probe error still shows every VF that was found (each unreadable one named).
            _ => self.observe_vendor(&scan, profile, &mut obs),
        }
        self.observe_passthrough(&mut obs);
        if profile.is_some() {
            let dirty: Vec<String> = obs
                .devices()
                .filter(|(_, d)| d.state == DeviceState::Dirty)
                .map(|(_, d)| {
                    format!(
                        "{} is dirty (type {}, no claim)",
                        d.address,
                        d.current_type.id().map(|t| t.to_string()).unwrap_or_else(|| "unknown".into())
                    )
                })
                .collect();
            obs.notes.extend(dirty);
        }
        let mut problems: BTreeSet<String> =
            obs.unreadable.iter().map(|u| format!("{}: {}", u.address, u.reason)).collect();
        for (_, d, _) in obs.passthrough() {
            for p in d.unreadable.iter().chain(&d.type_mismatch) {
                problems.insert(format!("{}: {p}", d.address));
            }
        }
        for (_, d) in obs.devices() {
            for line in &d.catalog_skipped {
                problems.insert(format!("{}: creatable_vgpu_types line skipped: {line:?}", d.address));
            }
            if let Some(m) = &d.type_mismatch {
                problems.insert(format!("{}: {m}", d.address));
            }
        }
        for u in obs.claims.unreadable.iter().chain(&obs.health.unreadable) {
            problems.insert(format!("{}: record unreadable: {}", u.path.display(), u.error));
        }
        self.book.report(problems);
        *lock(&self.book.last_mode) = Some(obs.mode.clone());
        Ok(obs)
    }

    /// The records about `device`: its claim (or the claim file that cannot be read), its
    /// health mark, and what placement knows of the claim's owner.
    fn device_records(&self, obs: &Observation, device: &str) -> DeviceRecords {
        let claim = obs.claims.records.iter().find(|c| c.device == device).cloned();
        let bad = obs.claims.unreadable.iter().find(|u| u.key.eq_ignore_ascii_case(device));
        let health = obs.health.records.iter().find(|h| h.device == device).cloned().or_else(|| {
            obs.health.unreadable.iter().find(|u| u.key.eq_ignore_ascii_case(device)).map(|u| HealthRecord {
                device: device.to_string(),
                reason: "record_unreadable".into(),
                quarantined: true,
                detail: format!("the health record {} cannot be read: {}", u.path.display(), u.error),
                at: now_rfc3339(),
                eio_in_a_row: 0,
            })
        });
        DeviceRecords {
            owner_labels: claim.as_ref().and_then(|c| self.owner_labels(c)),
            claim,
            claim_unreadable: bad.map(|u| format!("{}: {}", u.path.display(), u.error)),
            claim_unreadable_owner: bad.and_then(|u| u.owner),
            health,
            unknown_claim: obs.unknown_claim().map(|u| {
                format!(
                    "{}: {}; its file names no device, so it may own any occupied device",
                    u.path.display(),
                    u.error
                )
            }),
        }
    }

    /// What placement sees of a claim's owner: the labels the claim carries; for a claim
    /// written before claims carried them, the owner's record (one read). `None` when
    /// unknown (the owner's record cannot be read).
    fn owner_labels(&self, c: &Claim) -> Option<crate::store::Labels> {
        if let Some(l) = &c.owner_labels {
            return Some(l.clone());
        }
        let Some(id) = c.owner.instance() else { return Some(Default::default()) };
        match self.store.read_instance(id) {
            Ok(Some(r)) => Some(r.labels.clone()),
            Ok(None) => Some(Default::default()),
            Err(_) => None,
        }
    }

    fn observe_vendor(&self, scan: &devices::HostScan, profile: Option<&str>, obs: &mut Observation) {
        let driver = &scan.driver_version;
        let want_fb = profile.and_then(|p| self.book.profile_fb(p));
        for g in &scan.vendor {
            let managed = self.cfg.manages(&g.bdf);
            for vf in &g.vfs {
                if let Ok(cat) = &vf.catalog {
                    for e in &cat.entries {
                        let fb = profile_framebuffer_mib(&e.name);
                        self.book.learn(&e.name, fb);
                        self.book.learn_type(driver, &g.bdf, e.id, &e.name);
                        self.book.learn_gpu_size(&g.bdf, fb);
                    }
                }
            }
            let mut devices = Vec::new();
            for vf in &g.vfs {
                let mut recs = self.device_records(obs, &vf.bdf);
                let current_type = match &vf.current_type {
                    Ok(t) => TypeReading::Id(*t),
                    Err(e) => TypeReading::Unknown(e.to_string()),
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
                    (Some(c), _) => Some((d.address.as_str(), self.book.profile_fb(&c.profile))),
                    (None, _) if d.claim_unreadable.is_some() => Some((d.address.as_str(), None)),
                    (None, Some(t)) if t != 0 => Some((d.address.as_str(), self.type_fb(g, t))),
                    _ => None,
                })
                .collect();
            if let (true, Some(p)) = (managed, profile) {
                let offered = obs.candidates.len();
                for d in &devices {
                    let legal = match d.state {
                        DeviceState::Free => d.creatable.iter().any(|c| gpuvisor_sdk::profile_matches(p, c)),
                        // Repairable: once this VF is cleared, every other active vGPU on the
                        // GPU has the requested size (equal-size rule).
                        DeviceState::Dirty => {
                            self.book.known(p)
                                && active
                                    .iter()
                                    .filter(|(b, _)| *b != d.address)
                                    .all(|(_, fb)| fb.is_some() && want_fb.is_some() && *fb == want_fb)
                        }
                        _ => false,
                    };
                    if legal {
                        obs.candidates.push(Candidate {
                            device: d.address.clone(),
                            gpu: g.bdf.clone(),
                            dirty: d.state == DeviceState::Dirty,
                            offer: Offer::Vf,
                        });
                    }
                }
                if obs.candidates.len() == offered {
                    if let Some(why) = equal_size_note(p, want_fb, &active) {
                        obs.notes.push(format!("GPU {}: {why}", g.bdf));
                    }
                }
            }
            let (claimed_framebuffer_mib, load_known) = self.load_of(&devices);
            obs.gpus.push(ObservedGpu {
                model: self.gpu_model(g),
                framebuffer_mib: self.book.gpu_size(&g.bdf, &g.device_id),
                numa_node: g.numa_node,
                claimed_framebuffer_mib,
                load_known,
                managed,
                health: self.gpu_mark(obs, &g.bdf),
                devices,
                address: g.bdf.clone(),
                passthrough: None,
            });
        }
    }

    fn observe_mdev(&self, scan: &devices::HostScan, profile: Option<&str>, obs: &mut Observation) {
        let mut by_pf: BTreeMap<String, Vec<&mdev::MdevParent>> = BTreeMap::new();
        for p in &scan.parents {
            for t in p.types() {
                self.book.learn(&t.name, t.framebuffer_mib);
                self.book.learn_gpu_size(&p.pf, t.framebuffer_mib);
            }
            by_pf.entry(p.pf.clone()).or_default().push(p);
        }
        for (pf, parents) in by_pf {
            let managed = self.cfg.manages(&pf);
            let mut devices = Vec::new();
            for p in parents {
                let mut recs = self.device_records(obs, &p.bdf);
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
                        obs.candidates.push(Candidate {
                            device: p.bdf.clone(),
                            gpu: pf.clone(),
                            dirty: false,
                            offer: Offer::Mdev { mdev_type: t.dir.clone() },
                        });
                    }
                }
                devices.push(ObservedDevice::without_type(&p.bdf, state, creatable, recs, unreadable));
            }
            let device_id = devices::read_attr(&self.host.pci_device(&pf).join("device")).unwrap_or_default();
            let (claimed_framebuffer_mib, load_known) = self.load_of(&devices);
            obs.gpus.push(ObservedGpu {
                model: devices::model_by_device_id(&device_id).unwrap_or("NVIDIA GPU").to_string(),
                framebuffer_mib: self.book.gpu_size(&pf, &device_id),
                numa_node: None,
                claimed_framebuffer_mib,
                load_known,
                managed,
                health: self.gpu_mark(obs, &pf),
                devices,
                address: pf,
                passthrough: None,
            });
        }
    }

    /// The configured passthrough GPUs (`passthrough_gpus`) the host has: each one GPU
    /// whose one device is the GPU itself. States: claimed; quarantined; unreadable (its
    /// group or a driver link cannot be read); dirty (a function on `vfio-pci`, or the
    /// functions split between drivers, with no claim: not gpuvisor's binding, never
    /// touched); free otherwise. A free GPU with a [`PassthroughObserved::problem`] is not
    /// a candidate.
    fn observe_passthrough(&self, obs: &mut Observation) {
        // A GPU taken out of passthrough_gpus while claimed stays visible (and is given back
        // through its claim) until the claim is gone; it is never offered again.
        let mut gpus: Vec<(String, bool)> = self.cfg.passthrough_gpus.iter().map(|g| (g.clone(), true)).collect();
        for c in obs.claims.records.iter().filter(|c| c.kind.framework() == Framework::Passthrough) {
            if !gpus.iter().any(|(g, _)| g.eq_ignore_ascii_case(&c.device)) {
                gpus.push((c.device.clone(), false));
            }
        }
        for (bdf, configured) in &gpus {
            let bdf = &bdf.clone();
            let (read, unreadable) = match passthrough::read_gpu(&self.host, bdf) {
                Ok(Some(g)) => (Some(g), None),
                Ok(None) => {
                    obs.notes.push(format!("passthrough_gpus names {bdf}, which this host does not have"));
                    continue;
                }
                Err(e) => (None, Some(e.to_string())),
            };
            let problem = read.as_ref().and_then(|g| {
                if !configured {
                    Some("it is no longer in passthrough_gpus (shown while its claim exists)".to_string())
                } else if !g.foreign.is_empty() {
                    Some(format!(
                        "its IOMMU group {} also holds {}, which is not a function of this GPU",
                        g.group,
                        g.foreign.join(", ")
                    ))
                } else if g.numvfs > 0 {
                    Some(format!("it has {} SR-IOV VFs enabled (a vGPU parent)", g.numvfs))
                } else {
                    None
                }
            });
            let mut recs = self.device_records(obs, bdf);
            // Dirty: on vfio-pci, split between drivers, or the GPU itself driverless — not a
            // binding gpuvisor made or can give back (a driverless GPU is never free).
            let dirty = read.as_ref().is_some_and(|g| !g.on_host_drivers() || g.functions[0].driver.is_none());
            let state = recs.state(unreadable.is_some(), dirty);
            let device_id = read.as_ref().map(|g| g.device_id.clone()).unwrap_or_default();
            let fb = devices::framebuffer_by_device_id(&device_id);
            obs.gpus.push(ObservedGpu {
                address: bdf.clone(),
                model: devices::model_by_device_id(&device_id).unwrap_or("NVIDIA GPU").to_string(),
                framebuffer_mib: fb,
                numa_node: read.as_ref().and_then(|g| g.numa_node),
                claimed_framebuffer_mib: if state == DeviceState::Claimed { fb.unwrap_or(0) } else { 0 },
                load_known: fb.is_some() || state != DeviceState::Claimed,
                managed: true,
                health: None,
                devices: vec![{
                    // A configured claim whose group is no longer all on vfio-pci: another
                    // tool rebound a function under the VM (reported, never repaired).
                    let moved = match (&recs.claim, &read) {
                        (Some(c), Some(g)) if c.state == ClaimState::Configured && !g.on_vfio() => Some(format!(
                            "its group is bound {}, not all vfio-pci, under the claim of {}: another tool \
                             rebound it under the VM",
                            g.binding(),
                            c.owner_label()
                        )),
                        _ => None,
                    };
                    let mut d = ObservedDevice::without_type(bdf, state, vec![], recs, unreadable);
                    d.type_mismatch = moved;
                    d
                }],
                passthrough: Some(PassthroughObserved { read, problem }),
            });
        }
    }

    /// The observation with the legal candidates of a request: a vGPU `profile`, or a
    /// whole GPU (`whole`), and the framework the claim uses.
    pub(crate) fn observe_candidates(
        &self,
        profile: &str,
        whole: Option<&crate::store::PassthroughWant>,
    ) -> Result<(Observation, Framework), ApiError> {
        match whole {
            Some(w) => {
                let mut obs = self.observe(None)?;
                obs.candidates = self.passthrough_candidates(&mut obs, w.address.as_deref())?;
                Ok((obs, Framework::Passthrough))
            }
            None => {
                let obs = self.observe(Some(profile))?;
                let framework = obs.framework()?;
                Ok((obs, framework))
            }
        }
    }

    /// The legal passthrough candidates: free GPUs without a problem, or only the one at
    /// `address`. A named GPU that cannot be given now is an error that says why
    /// (`iommu_group_conflict`, `device_unhealthy`, `no_capacity`); for "any GPU" the
    /// others are notes.
    pub(crate) fn passthrough_candidates(
        &self,
        obs: &mut Observation,
        address: Option<&str>,
    ) -> Result<Vec<Candidate>, ApiError> {
        let mut out = Vec::new();
        let mut notes = Vec::new();
        let mut found = false;
        for (g, d, pt) in obs.passthrough() {
            if address.is_some_and(|a| !a.eq_ignore_ascii_case(&g.address)) {
                continue;
            }
            found = true;
            let why = match (d.state, &pt.problem, &pt.read) {
                (DeviceState::Free, None, Some(r)) => {
                    out.push(Candidate {
                        device: g.address.clone(),
                        gpu: g.address.clone(),
                        dirty: false,
                        offer: Offer::Passthrough(PassthroughClaim {
                            group: r.group,
                            functions: r
                                .functions
                                .iter()
                                .map(|f| FunctionRecord { bdf: f.bdf.clone(), original_driver: f.driver.clone() })
                                .collect(),
                            reset_done: false,
                        }),
                    });
                    continue;
                }
                (DeviceState::Free, Some(p), Some(r)) => {
                    if address.is_some() && !r.foreign.is_empty() {
                        return Err(ApiError::iommu_group_conflict(&g.address, r.group, &r.foreign));
                    }
                    p.clone()
                }
                (DeviceState::Quarantined, _, _) => {
                    let h = d.health.as_ref();
                    if address.is_some() {
                        return Err(ApiError::device_unhealthy(
                            &g.address,
                            h.map(|h| h.reason.as_str()).unwrap_or("-"),
                            h.map(|h| h.detail.as_str()).unwrap_or("-"),
                        ));
                    }
                    format!("quarantined ({})", h.map(|h| h.reason.as_str()).unwrap_or("-"))
                }
                (DeviceState::Claimed, _, _) => match &d.claim {
                    Some(c) => format!("claimed by {}", c.owner_label()),
                    None => "its claim record cannot be read".into(),
                },
                (DeviceState::Dirty, _, Some(r)) => {
                    format!("bound to vfio-pci with no claim ({}): not gpuvisor's binding", r.binding())
                }
                (_, _, _) => format!("cannot be read: {}", d.unreadable.clone().unwrap_or_default()),
            };
            notes.push(format!("{}: {why}", g.address));
        }
        if let (Some(a), false, true) = (address, found, address.is_some_and(|a| self.cfg.is_passthrough_gpu(a))) {
            return Err(ApiError::no_capacity(
                format!(
                    "the passthrough GPU {a} is configured but this host does not show it (sys/bus/pci/devices/{a})"
                ),
                PASSTHROUGH,
                vec![],
                None,
            ));
        }
        if let (Some(a), false) = (address, found) {
            return Err(ApiError::invalid_request(format!(
                "{a} is not a passthrough GPU of this host (passthrough_gpus: {})",
                if self.cfg.passthrough_gpus.is_empty() { "none".into() } else { self.cfg.passthrough_gpus.join(", ") }
            )));
        }
        if let (Some(_), true) = (address, out.is_empty()) {
            return Err(ApiError::no_capacity(
                format!("the passthrough GPU {}", notes.join("; ")),
                PASSTHROUGH,
                notes,
                None,
            ));
        }
        obs.notes.extend(notes);
        Ok(out)
    }

    /// The claimed framebuffer of a GPU's devices (from claims, not sysfs) and whether every
    /// claimed size is known.
    fn load_of(&self, devices: &[ObservedDevice]) -> (u64, bool) {
        let sizes: Vec<Option<u64>> = devices
            .iter()
            .filter(|d| d.claim.is_some() || d.claim_unreadable.is_some())
            .map(|d| d.claim.as_ref().and_then(|c| self.book.profile_fb(&c.profile)))
            .collect();
        (sizes.iter().flatten().sum(), sizes.iter().all(|s| s.is_some()))
    }

    fn gpu_mark(&self, obs: &Observation, pf: &str) -> Option<HealthRecord> {
        obs.health.records.iter().find(|h| h.device.eq_ignore_ascii_case(pf)).cloned()
    }

    /// The framebuffer of a type id set on a VF of `g`, from any catalog of the GPU that
    /// lists it; `None` when no catalog does (a VF holding a type shows an empty catalog).
    fn type_fb(&self, g: &vendor_vfio::GpuInfo, type_id: u32) -> Option<u64> {
        g.vfs
            .iter()
            .filter_map(|v| v.catalog.as_ref().ok())
            .flat_map(|c| c.entries.iter())
            .find(|e| e.id == type_id)
            .map(|e| e.name.clone())
            .or_else(|| self.book.type_name(&g.bdf, type_id))
            .and_then(|name| profile_framebuffer_mib(&name))
    }

    fn gpu_model(&self, g: &vendor_vfio::GpuInfo) -> String {
        if let Some(m) = devices::model_by_device_id(&g.device_id) {
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

    /// The type id a profile has now, from any catalog of the observation.
    pub(crate) fn type_id_in(&self, obs: &Observation, profile: &str) -> Option<u32> {
        obs.vendor
            .iter()
            .flat_map(|g| g.vfs.iter())
            .filter_map(|v| v.catalog.as_ref().ok())
            .find_map(|c| c.find(profile).map(|e| e.id))
    }

    /// Makes sure the profile names are learned, then tells an unknown profile from a known
    /// one (docs/design/host.md §3.5); returns the catalog's spelling. Observes only when the
    /// profile is not known yet.
    pub(crate) fn known_profile(&self, profile: &str) -> Result<String, ApiError> {
        let canon = gpuvisor_sdk::canonical_profile(profile);
        if canon.is_empty() {
            return Err(ApiError::invalid_request("gpu profile is empty"));
        }
        if !self.book.known(canon) {
            let _ = self.observe(None);
            if !self.book.known(canon) {
                return Err(ApiError::unknown_profile(canon));
            }
        }
        Ok(self.book.spelling(canon))
    }

    /// The framework of the host as last observed (observing now when the last observation
    /// found none usable).
    pub(crate) fn current_framework(&self) -> Result<Framework, ApiError> {
        let last = lock(&self.book.last_mode).clone();
        let mode = match last {
            // Only a usable mode is reused: anything else is looked at again now.
            Some(m @ Ok(HostMode::VendorVfio | HostMode::Mdev)) => m,
            _ => self.observe(None)?.mode,
        };
        Observation::framework_of(&mode)
    }

    /// Warns once at start for each `managed_gpus` entry the host does not show.
    pub fn check_managed_gpus(&self) {
        match self.observe(None) {
            Ok(obs) => {
                for g in self.cfg.managed_gpus.iter().flatten() {
                    if !obs.gpus.iter().any(|v| v.address.eq_ignore_ascii_case(g)) {
                        tracing::warn!(gpu = %g, "managed_gpus names a GPU with no vGPU device on this host");
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e.message, "initial GPU inventory failed"),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::equal_size_note;

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
}
