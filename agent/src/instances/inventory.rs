//! Observation of the host: one [`devices::scan`] plus the claim and health records, turned
//! into what every caller needs — the placement inventory (the plugins' view), the legal
//! candidates for a profile, and the facts the views show (current types, unreadable
//! devices, claim/type mismatches). What each device kind makes of the scan is its
//! backend's [`devices::Backend::observe`]; this file is the sequence around it (read the
//! records once, hand each backend what it needs through [`devices::observed::ObserveSteps`],
//! assemble, report problems once) and what observations teach about profiles (names, type
//! ids, framebuffer sizes), kept in the [`ProfileBook`].
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
use crate::devices::observed::{
    Candidate, DeviceRecords, ObserveSteps, Observed, ObservedDevice, ObservedGpu, PassthroughObserved,
};
use crate::devices::{self, mdev, vendor_vfio, DeviceError, HostMode, UnreadableDevice};
use crate::error::ApiError;
use crate::store::{Claim, Framework, HealthRecord, Listing, Store};
use crate::sync::lock;
use gpuvisor_sdk::{profile_framebuffer_mib, DeviceOwner, DeviceState, DeviceView, GpuView, Inventory};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;

/// The claim file that cannot be read and whose name names no device ([`Observation::unknown_claim`]).
fn unknown_claim(claims: &Listing<Claim>) -> Option<&crate::store::Unreadable> {
    claims.unreadable.iter().find(|u| !names_a_device(&u.key))
}

/// True when a claim file's key (its name without `.json`) names a device: a PCI address
/// (a VF, an mdev parent, a passthrough GPU) or an mdev UUID.
fn names_a_device(key: &str) -> bool {
    crate::config::is_bdf(&key.to_ascii_lowercase()) || uuid::Uuid::parse_str(key).is_ok()
}

/// The profile name requests, claims and plugins use for a whole GPU.
pub const PASSTHROUGH: &str = "passthrough";

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
        unknown_claim(&self.claims)
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

/// The inventory room: what observing needs of the manager — the configuration, the host,
/// the records (read only) and the profile book — and nothing else.
pub(crate) struct Observer<'a> {
    cfg: &'a crate::config::Config,
    host: &'a crate::host::HostRoot,
    store: &'a Store,
    book: &'a ProfileBook,
}

impl Manager {
    /// The inventory room ([`Observer`]).
    pub(crate) fn observer(&self) -> Observer<'_> {
        Observer { cfg: &self.cfg, host: &self.host, store: &self.store, book: &self.book }
    }

    /// Warns once at start for each `managed_gpus` entry the host does not show.
    pub fn check_managed_gpus(&self) {
        match self.observer().observe(None) {
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

impl Observer<'_> {
    /// Reads the host and the claim and health records once and builds the observation,
    /// with the legal candidates for `profile` (None: inventory only). Errors: `not_ready`
    /// when the claim or health directories cannot be listed at all (an unreadable record
    /// only blocks what it names).
    pub(crate) fn observe(&self, profile: Option<&str>) -> Result<Observation, ApiError> {
        let scan = devices::scan(self.host, &self.cfg.passthrough_gpus);
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
        let mut observed = Observed::default();
        let steps = Observing { m: self, claims: &claims, health: &health };
        for b in devices::backends() {
            b.observe(self.host, &scan, profile, &steps, &mut observed);
        }
        let mut obs = Observation {
            mode: scan.mode.clone(),
            gpus: observed.gpus,
            candidates: observed.candidates,
            notes: observed.notes,
            unreadable: scan.unreadable.clone(),
            driver_version: driver.clone(),
            mdevs: scan.mdevs.clone(),
            vendor: scan.vendor.clone(),
            claims,
            health,
        };
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
    fn device_records(&self, claims: &Listing<Claim>, health: &Listing<HealthRecord>, device: &str) -> DeviceRecords {
        let claim = claims.records.iter().find(|c| c.device == device).cloned();
        let bad = claims.unreadable.iter().find(|u| u.key.eq_ignore_ascii_case(device));
        let mark = health.records.iter().find(|h| h.device == device).cloned().or_else(|| {
            health.unreadable.iter().find(|u| u.key.eq_ignore_ascii_case(device)).map(|u| HealthRecord {
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
            health: mark,
            unknown_claim: unknown_claim(claims).map(|u| {
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

    /// The legal passthrough candidates ([`devices::passthrough::candidates`]): free GPUs
    /// without a problem, or only the one at `address`. A named GPU that cannot be given
    /// now is an error that says why (`iommu_group_conflict`, `device_unhealthy`,
    /// `no_capacity`, `invalid_request`); for "any GPU" the others are notes.
    pub(crate) fn passthrough_candidates(
        &self,
        obs: &mut Observation,
        address: Option<&str>,
    ) -> Result<Vec<Candidate>, ApiError> {
        use devices::passthrough::WholeRefused;
        let configured = &self.cfg.passthrough_gpus;
        let (out, notes) = devices::passthrough::candidates(&obs.gpus, address, configured).map_err(|r| match r {
            WholeRefused::GroupConflict { gpu, group, foreign } => ApiError::iommu_group_conflict(&gpu, group, &foreign),
            WholeRefused::Unhealthy { gpu, reason, detail } => ApiError::device_unhealthy(&gpu, &reason, &detail),
            WholeRefused::NotShown { gpu } => ApiError::no_capacity(
                format!("the passthrough GPU {gpu} is configured but this host does not show it (sys/bus/pci/devices/{gpu})"),
                PASSTHROUGH,
                vec![],
                None,
            ),
            WholeRefused::NotPassthrough { gpu } => ApiError::invalid_request(format!(
                "{gpu} is not a passthrough GPU of this host (passthrough_gpus: {})",
                if configured.is_empty() { "none".into() } else { configured.join(", ") }
            )),
            WholeRefused::Unavailable { notes } => {
                ApiError::no_capacity(format!("the passthrough GPU {}", notes.join("; ")), PASSTHROUGH, notes, None)
            }
        })?;
        obs.notes.extend(notes);
        Ok(out)
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
}

/// What a backend's observation reads besides the host, for one observation: this
/// observation's claim and health listings, the configuration, the profile book.
struct Observing<'a> {
    m: &'a Observer<'a>,
    claims: &'a Listing<Claim>,
    health: &'a Listing<HealthRecord>,
}

impl ObserveSteps for Observing<'_> {
    fn records(&self, device: &str) -> DeviceRecords {
        self.m.device_records(self.claims, self.health, device)
    }
    fn claims(&self) -> &[Claim] {
        &self.claims.records
    }
    fn manages(&self, gpu: &str) -> bool {
        self.m.cfg.manages(gpu)
    }
    fn passthrough_gpus(&self) -> &[String] {
        &self.m.cfg.passthrough_gpus
    }
    fn gpu_mark(&self, gpu: &str) -> Option<HealthRecord> {
        self.health.records.iter().find(|h| h.device.eq_ignore_ascii_case(gpu)).cloned()
    }
    fn learn(&self, name: &str, fb: Option<u64>) {
        self.m.book.learn(name, fb)
    }
    fn learn_type(&self, driver: &Option<String>, gpu: &str, id: u32, name: &str) {
        self.m.book.learn_type(driver, gpu, id, name)
    }
    fn learn_gpu_size(&self, gpu: &str, fb: Option<u64>) {
        self.m.book.learn_gpu_size(gpu, fb)
    }
    fn type_name(&self, gpu: &str, id: u32) -> Option<String> {
        self.m.book.type_name(gpu, id)
    }
    fn profile_fb(&self, profile: &str) -> Option<u64> {
        self.m.book.profile_fb(profile)
    }
    fn known(&self, profile: &str) -> bool {
        self.m.book.known(profile)
    }
    fn gpu_size(&self, gpu: &str, device_id: &str) -> Option<u64> {
        self.m.book.gpu_size(gpu, device_id)
    }
}
