//! # instances — the lifecycle (LIFECYCLE.md is the contract)
//!
//! Create, start, stop and delete are ordered lists of steps, each durable before the next
//! side effect. Locks: one allocation lock (claim selection + claim creation + the
//! configure write, and the release guard's re-read + removal), one lock per instance (held
//! for a whole operation), one lock per device (the open-handle scan and the hardware write
//! under the same lock). The allocation lock is never held across a VM boot or a sleep.
//!
//! Invariants kept here:
//! - **claim before use**: a device is configured, and a VMM referencing it spawned, only
//!   after the claim naming the instance is durable;
//! - **one owner**: claims are exclusive files (`store`);
//! - **never cleared under a live VM**: [`Manager::release`] (the release guard) is the only
//!   path that clears a device; it runs only once the owner is provably dead, re-reads the
//!   claim, and scans `/proc/*/fd` under the device lock right before the write;
//! - **never lose the only record**: a failed release keeps the claim (`release_pending`).

use crate::config::{Config, Labels, VfioAttach};
use crate::devices::{self, mdev, vendor_vfio, HostMode, WriteError};
use crate::error::{ApiError, ErrorCode};
use crate::host::proc::{self, HandleScan, Liveness};
use crate::host::HostRoot;
use crate::hypervisor::{self, HypervisorKind};
use crate::images;
use crate::policies::Policies;
use crate::store::{
    Claim, ClaimState, HealthRecord, InstanceRecord, InstanceState, MdevRecord, Store, StoreError, VmmRecord,
};
use gpuvisor_sdk::{
    profile_framebuffer_mib, DeviceOwner, DeviceState, DeviceView, Framework, GpuView, HypervisorAnswer,
    HypervisorInfo, HypervisorInput, HypervisorRequest, Inventory, PlacementAnswer, PlacementInput, PlacementRequest,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use uuid::Uuid;

mod reconcile;
pub use reconcile::PassReport;

/// `instance.create` parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    /// `[a-z0-9][a-z0-9-]{0,62}`, unique.
    pub name: String,
    /// An image under `<data-dir>/images/`.
    pub image: String,
    /// vGPU profile, e.g. `L40S-2Q` (with or without the `NVIDIA ` prefix).
    #[serde(default)]
    pub gpu: Option<String>,
    #[serde(default)]
    pub labels: Labels,
    /// 1..=64, default 1.
    #[serde(default)]
    pub vcpus: Option<u32>,
    /// 64..=1048576 MiB, default 256.
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// `qemu` or `cloud-hypervisor`; the `hypervisor` plugin decides when absent.
    #[serde(default)]
    pub hypervisor: Option<String>,
}

/// The driver version the names were learned under, and (PF, type id) → profile name.
type TypeNames = (Option<String>, HashMap<(String, u32), String>);

/// Latency histogram buckets for policy calls and claims, seconds.
fn latency_histogram() -> prometheus_client::metrics::histogram::Histogram {
    prometheus_client::metrics::histogram::Histogram::new([
        0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
    ])
}

/// A histogram family labelled `plugin`, `kind`.
pub type PolicyDurations = prometheus_client::metrics::family::Family<
    Vec<(String, String)>,
    prometheus_client::metrics::histogram::Histogram,
    fn() -> prometheus_client::metrics::histogram::Histogram,
>;

/// Counters the metrics endpoint reads.
#[derive(Debug)]
pub struct Counters {
    /// Total of [`Counters::rejected`].
    pub policy_rejected_answers: AtomicU64,
    /// Answers the agent rejected, by (plugin, kind, reason).
    pub rejected: Mutex<BTreeMap<(String, String, String), u64>>,
    /// `gpuvisor_policy_call_duration_seconds{plugin,kind}`.
    pub policy_duration: PolicyDurations,
    /// `gpuvisor_vgpu_claim_duration_seconds`: claim selection + creation + configure.
    pub claim_duration: prometheus_client::metrics::histogram::Histogram,
    pub kill_escalations: AtomicU64,
    /// `gpuvisor_vmm_kill_escalations_total{signal="SIGKILL"|"SIGKILL_GROUP"}`.
    pub kill_escalations_sigkill: AtomicU64,
    pub kill_escalations_group: AtomicU64,
    pub releases_ok: AtomicU64,
    pub releases_failed: AtomicU64,
    /// `gpuvisor_vgpu_reconcile_runs_total{result="complete|incomplete"}`.
    pub reconcile_complete: AtomicU64,
    pub reconcile_incomplete: AtomicU64,
    /// `gpuvisor_vgpu_reconcile_failures_total{stage="inventory|grace"}`.
    pub reconcile_inventory_failures: AtomicU64,
    pub reconcile_grace_failures: AtomicU64,
    /// `gpuvisor_vgpu_stale_releases_total{result}`.
    pub stale_released: AtomicU64,
    pub stale_in_use: AtomicU64,
    pub stale_scan_incomplete: AtomicU64,
    pub stale_failed: AtomicU64,
    /// `gpuvisor_vgpu_orphans_released_total{framework}`.
    pub orphans_released_vendor_vfio: AtomicU64,
    pub orphans_released_mdev: AtomicU64,
}

/// Why a release did not complete.
#[derive(Debug, Clone, PartialEq)]
pub enum ReleaseError {
    /// A process holds the device open (`in_use`).
    InUse(Vec<i32>),
    /// The open-handle scan could not be completed (`scan_incomplete`).
    ScanIncomplete(String),
    /// The clear/remove write failed.
    Failed(WriteError),
    /// The device reads a type gpuvisor did not write; quarantined, never cleared.
    Foreign(String),
    /// The store could not be updated.
    Store(String),
}

impl std::fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReleaseError::InUse(p) => write!(f, "in_use: held open by pid {p:?}"),
            ReleaseError::ScanIncomplete(r) => write!(f, "scan_incomplete: {r}"),
            ReleaseError::Failed(m) => write!(f, "failed: {m}"),
            ReleaseError::Foreign(m) => write!(f, "foreign_write: {m}"),
            ReleaseError::Store(m) => write!(f, "store: {m}"),
        }
    }
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            policy_rejected_answers: AtomicU64::new(0),
            rejected: Mutex::new(BTreeMap::new()),
            policy_duration: PolicyDurations::new_with_constructor(latency_histogram),
            claim_duration: latency_histogram(),
            kill_escalations: AtomicU64::new(0),
            kill_escalations_sigkill: AtomicU64::new(0),
            kill_escalations_group: AtomicU64::new(0),
            releases_ok: AtomicU64::new(0),
            releases_failed: AtomicU64::new(0),
            reconcile_complete: AtomicU64::new(0),
            reconcile_incomplete: AtomicU64::new(0),
            reconcile_inventory_failures: AtomicU64::new(0),
            reconcile_grace_failures: AtomicU64::new(0),
            stale_released: AtomicU64::new(0),
            stale_in_use: AtomicU64::new(0),
            stale_scan_incomplete: AtomicU64::new(0),
            stale_failed: AtomicU64::new(0),
            orphans_released_vendor_vfio: AtomicU64::new(0),
            orphans_released_mdev: AtomicU64::new(0),
        }
    }
}

impl Counters {
    /// Counts one plugin answer the agent rejected.
    pub fn reject(&self, plugin: &str, kind: &str, reason: &str) {
        self.policy_rejected_answers.fetch_add(1, Ordering::Relaxed);
        *lock(&self.rejected).entry((plugin.to_string(), kind.to_string(), reason.to_string())).or_insert(0) += 1;
    }

    /// Times one policy call.
    pub fn observe_policy_call(&self, plugin: &str, kind: &str, started: Instant) {
        self.policy_duration
            .get_or_create(&vec![("plugin".to_string(), plugin.to_string()), ("kind".to_string(), kind.to_string())])
            .observe(started.elapsed().as_secs_f64());
    }
}

impl ReleaseError {
    fn retryable(&self) -> bool {
        matches!(self, ReleaseError::InUse(_) | ReleaseError::ScanIncomplete(_) | ReleaseError::Failed(_))
    }
}

/// The lifecycle manager. All methods block (sysfs, /proc, QMP); the rpc layer calls them
/// from blocking threads.
pub struct Manager {
    cfg: Config,
    host: HostRoot,
    store: Store,
    /// The loaded plugins; swapped whole by [`Manager::reload_plugins`].
    policies: std::sync::RwLock<Arc<Policies>>,
    /// The config file the agent was started with (re-read by `plugin.reload`).
    config_path: Option<PathBuf>,
    alloc: Mutex<()>,
    instance_locks: Mutex<HashMap<Uuid, Arc<Mutex<()>>>>,
    device_locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Canonical profile name (upper case) → framebuffer MiB, for every name seen in a
    /// catalog or a claim (NVIDIA-HOST.md §3.5: tells `unknown_profile` from `no_capacity`).
    /// Value: (the name as the catalog spells it, framebuffer MiB).
    known_profiles: Mutex<BTreeMap<String, (String, Option<u64>)>>,
    /// (PF, type id) → profile name, from every catalog and claim seen under the current
    /// driver: a VF holding a type shows an empty catalog, so a dirty VF's size is looked up
    /// here when no sibling lists its type any more. Reset when the driver version changes.
    type_names: Mutex<TypeNames>,
    /// PF → largest framebuffer seen in any of its catalogs (the GPU's size).
    gpu_framebuffer: Mutex<HashMap<String, u64>>,
    /// Orphan device → CLOCK_BOOTTIME ms when the reconciler first saw it dirty/unclaimed.
    orphan_seen: Mutex<HashMap<String, u64>>,
    /// Devices an eligible item of which the grace plugin has kept longer than
    /// `claim_grace_s` + one reconcile interval, with the plugin's reason (PLUGINS.md
    /// "grace": reported as `held_by_policy`). Rebuilt by every pass.
    held_by_policy: Mutex<BTreeMap<String, String>>,
    /// Serialises reconcile passes.
    pass_lock: Mutex<()>,
    /// The startup reconcile pass had a complete observation (INVARIANTS.md I13): until
    /// then new claims answer `not_ready`.
    ready: std::sync::atomic::AtomicBool,
    pub counters: Counters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Wall time now, RFC 3339 (seconds).
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// At most this many labels per instance: every policy input carries them, and plugins run
/// under a fuel budget (PLUGINS.md), so an unbounded map would surface as `policy_failed`.
pub const MAX_LABELS: usize = 64;

/// Labels: at most [`MAX_LABELS`], keys 1–63 bytes, values up to 255. Errors:
/// `invalid_request`.
fn check_labels(labels: &Labels) -> Result<(), ApiError> {
    if labels.len() > MAX_LABELS {
        return Err(ApiError::invalid(format!("{} labels; at most {MAX_LABELS} are allowed", labels.len())));
    }
    match labels.iter().find(|(k, v)| k.is_empty() || k.len() > 63 || v.len() > 255) {
        Some((k, _)) => Err(ApiError::invalid(format!("label {k:?} is not valid (key 1..63, value ..255 bytes)"))),
        None => Ok(()),
    }
}

/// Instance names: `[a-z0-9][a-z0-9-]{0,62}`, and never UUID-shaped — a `ref` is first
/// looked up as an instance id, so a name equal to another instance's id would make
/// `delete <name>` act on that other instance. Errors: `invalid_request`.
fn check_instance_name(name: &str) -> Result<(), ApiError> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && Uuid::parse_str(name).is_err();
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "instance name {name:?} is not valid (use [a-z0-9][a-z0-9-]{{0,62}}, not a UUID)"
        )))
    }
}

/// A placeable device as the native side sees it (the legal-candidate check).
#[derive(Debug, Clone)]
struct Candidate {
    device: String,
    gpu: String,
    dirty: bool,
    /// mdev: the type directory to create.
    mdev_type: Option<String>,
}

/// The host observed under the allocation lock for one placement.
struct Observation {
    mode: HostMode,
    inventory: Inventory,
    candidates: Vec<Candidate>,
    /// Human notes on devices that are not candidates (e.g. a dirty VF in use).
    notes: Vec<String>,
}

impl Manager {
    /// Builds the manager: opens nothing on the host yet.
    pub fn new(cfg: Config, store: Store, policies: Policies) -> Manager {
        Manager::with_config_path(cfg, None, store, policies)
    }

    /// [`Manager::new`], remembering the config file for `plugin.reload`.
    pub fn with_config_path(cfg: Config, config_path: Option<PathBuf>, store: Store, policies: Policies) -> Manager {
        let host = HostRoot::new(&cfg.host_root);
        // Orphan first-seen times survive a restart within the same boot.
        let orphan_seen: HashMap<String, u64> = std::fs::read(store.root().join("orphans.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .filter(|v| host.boot_id().ok().as_deref() == v["boot_id"].as_str())
            .and_then(|v| serde_json::from_value(v["seen_boottime_ms"].clone()).ok())
            .unwrap_or_default();
        let known: BTreeMap<String, (String, Option<u64>)> = std::fs::read(store.root().join("profiles.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        Manager {
            cfg,
            host,
            store,
            policies: std::sync::RwLock::new(Arc::new(policies)),
            config_path,
            alloc: Mutex::new(()),
            instance_locks: Mutex::new(HashMap::new()),
            device_locks: Mutex::new(HashMap::new()),
            known_profiles: Mutex::new(known),
            gpu_framebuffer: Mutex::new(HashMap::new()),
            type_names: Mutex::new((None, HashMap::new())),
            orphan_seen: Mutex::new(orphan_seen),
            held_by_policy: Mutex::new(BTreeMap::new()),
            pass_lock: Mutex::new(()),
            ready: std::sync::atomic::AtomicBool::new(false),
            counters: Counters::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The host root.
    pub fn host(&self) -> &HostRoot {
        &self.host
    }

    /// The loaded plugins.
    pub fn policies(&self) -> Arc<Policies> {
        self.policies.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// `plugin.reload`: re-reads the `[plugins]` section of the config file (when the agent
    /// was started with one) and loads every slot again; all or nothing — any load error
    /// refuses the reload and keeps the old plugins. Calls in flight finish on the old ones.
    pub fn reload_plugins(&self) -> Result<Value, ApiError> {
        let mut cfg = self.cfg.clone();
        if let Some(path) = &self.config_path {
            let fresh = Config::load(path).map_err(|e| ApiError::invalid(format!("plugin.reload refused: {e:#}")))?;
            cfg.plugins = fresh.plugins;
            cfg.plugin_dir = fresh.plugin_dir;
        }
        let new = Policies::load(&cfg)
            .map_err(|e| ApiError::invalid(format!("plugin.reload refused, old plugins kept: {e:#}")))?;
        let names = json!({
            "placement": new.placement.manifest().name,
            "hypervisor": new.hypervisor.manifest().name,
            "grace": new.grace.as_ref().map(|g| g.manifest().name.clone()),
        });
        *self.policies.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(new);
        tracing::info!(plugins = %names, "plugins reloaded");
        Ok(json!({ "reloaded": true, "plugins": names }))
    }

    fn instance_lock(&self, id: Uuid) -> Arc<Mutex<()>> {
        lock(&self.instance_locks).entry(id).or_default().clone()
    }

    fn device_lock(&self, device: &str) -> Arc<Mutex<()>> {
        lock(&self.device_locks).entry(device.to_string()).or_default().clone()
    }

    fn boot_id(&self) -> Result<String, ApiError> {
        self.host
            .boot_id()
            .map_err(|e| ApiError::new(ErrorCode::NotReady, format!("cannot read the host boot id: {e}")))
    }

    // ------------------------------------------------------------------ lookup & views

    /// Resolves an instance by id or name.
    pub fn find(&self, r: &str) -> Result<InstanceRecord, ApiError> {
        if let Ok(id) = Uuid::parse_str(r) {
            if let Some(rec) = self.store.read_instance(id)? {
                return Ok(rec);
            }
        }
        self.store.list_instances()?.into_iter().find(|i| i.name == r).ok_or_else(|| ApiError::not_found(r))
    }

    /// The claim of an instance, if any (claims are the only record of ownership).
    fn claim_of(&self, id: Uuid) -> Result<Option<Claim>, ApiError> {
        Ok(self.store.list_claims()?.into_iter().find(|c| c.instance_id == id))
    }

    /// The API view of an instance: the record plus `gpu` derived from its claim.
    pub fn view(&self, rec: &InstanceRecord, claims: &[Claim]) -> Value {
        let claim = claims.iter().find(|c| c.instance_id == rec.id);
        let gpu = match (&rec.gpu_profile, claim) {
            (None, None) => Value::Null,
            (profile, claim) => {
                let device_path = claim.map(|c| self.device_path(c));
                json!({
                    "profile": profile.clone().or_else(|| claim.map(|c| c.profile.clone())),
                    "framework": rec.gpu_framework.or(claim.map(|c| c.framework)).map(|f| f.as_str()),
                    "device": claim.map(|c| c.device.clone()),
                    "gpu": claim.map(|c| c.gpu.clone()),
                    "device_path": device_path.map(|p| p.display().to_string()),
                    "mdev_uuid": claim.and_then(|c| c.mdev_uuid).map(|u| u.to_string()),
                    "type_id": claim.and_then(|c| c.type_id),
                    "claimed_at": claim.map(|c| c.claimed_at.clone()),
                    "claim_state": claim.map(|c| c.state.as_str()),
                    "release_pending": claim.map(|c| c.state == ClaimState::ReleasePending).unwrap_or(false),
                    "last_error": claim.and_then(|c| c.last_error.clone()),
                })
            }
        };
        let dir = self.store.instance_dir(rec.id);
        json!({
            "id": rec.id.to_string(),
            "name": rec.name,
            "image": rec.image,
            "hypervisor": rec.hypervisor,
            "vcpus": rec.vcpus,
            "memory_mib": rec.memory_mib,
            "labels": rec.labels,
            "state": rec.state.as_str(),
            "created_at": rec.created_at,
            "last_error": rec.last_error,
            // Only a recorded identity that matches a live process now is reported: a
            // recycled pid is never shown as the VMM (INVARIANTS.md I7).
            "vmm": rec.vmm.as_ref().filter(|v| self.identity_is_live(&v.identity)).map(|v| json!({
                "pid": v.identity.pid,
                "start_time": v.identity.start_time,
                "boot_id": v.identity.boot_id,
                "control_socket": v.control_socket.display().to_string(),
            })),
            "serial_log": dir.join("serial.log").display().to_string(),
            "gpu": gpu,
        })
    }

    /// Writes a policy input to `record_policy_inputs` (if configured). Best effort: a
    /// failure is logged, never fails the operation.
    fn record_input<T: Serialize>(&self, kind: &str, input: &T) {
        let Some(dir) = &self.cfg.record_policy_inputs else { return };
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
        let path = dir.join(format!("{kind}-{ms}-{}.json", SEQ.fetch_add(1, Ordering::Relaxed)));
        let res = std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::write(&path, serde_json::to_vec_pretty(input).map_err(std::io::Error::other)?));
        if let Err(e) = res {
            tracing::warn!(path = %path.display(), error = %e, "cannot record a policy input");
        }
    }

    /// True when the recorded identity (pid, start time, boot id) is a live process now.
    fn identity_is_live(&self, id: &proc::ProcessIdentity) -> bool {
        let Ok(boot) = self.host.boot_id() else { return false };
        matches!(proc::identity_of(id.pid, &boot), Ok(Some(now)) if now == *id)
    }

    /// The sysfs path of a claimed device: the VF, or the mdev.
    fn device_path(&self, c: &Claim) -> PathBuf {
        match c.mdev_uuid {
            Some(u) => self.host.mdev_device(&u.to_string()),
            None => self.host.pci_device(&c.device),
        }
    }

    /// The view of an instance after an operation that succeeded: an unreadable claim
    /// record elsewhere must not turn the success into an error (the work is done); the view
    /// then carries `warnings` and its `gpu` fields may be incomplete.
    fn view_after(&self, rec: &InstanceRecord) -> Value {
        match self.store.list_claims() {
            Ok(claims) => self.view(rec, &claims),
            Err(e) => {
                tracing::warn!(instance.id = %rec.id, error = %e, "claim records unreadable; answering without them");
                let mut v = self.view(rec, &[]);
                v["warnings"] = json!([format!("the claim records cannot be read ({e}); gpu fields are incomplete")]);
                v
            }
        }
    }

    /// `instance.get`.
    pub fn get(&self, r: &str) -> Result<Value, ApiError> {
        let rec = self.find(r)?;
        Ok(self.view(&rec, &self.store.list_claims()?))
    }

    /// `instance.list`.
    pub fn list(&self) -> Result<Value, ApiError> {
        let claims = self.store.list_claims()?;
        let items: Vec<Value> = self.store.list_instances()?.iter().map(|r| self.view(r, &claims)).collect();
        Ok(json!({ "instances": items }))
    }

    // ------------------------------------------------------------------ hypervisor choice

    fn hypervisors(&self) -> Vec<HypervisorInfo> {
        [HypervisorKind::Qemu, HypervisorKind::CloudHypervisor]
            .into_iter()
            .map(|k| {
                let bin = match k {
                    HypervisorKind::Qemu => &self.cfg.qemu_binary,
                    HypervisorKind::CloudHypervisor => &self.cfg.cloud_hypervisor_binary,
                };
                // The Cloud Hypervisor driver is not built yet: never offer it as available.
                let available = k == HypervisorKind::Qemu && binary_exists(bin);
                HypervisorInfo { name: k.name().to_string(), available, capabilities: k.capabilities().to_vec() }
            })
            .collect()
    }

    /// Asks the `hypervisor` plugin and validates the answer against the capability table
    /// (before anything is allocated).
    fn choose_hypervisor(&self, req: &CreateRequest, framework: Option<Framework>) -> Result<String, ApiError> {
        let hypervisors = self.hypervisors();
        let input = HypervisorInput {
            request: HypervisorRequest {
                name: req.name.clone(),
                labels: req.labels.clone(),
                requested_hypervisor: req.hypervisor.clone(),
                framework,
                devices: vec![],
            },
            hypervisors: hypervisors.clone(),
            params: self.cfg.plugin_params(gpuvisor_sdk::PolicyKind::Hypervisor),
        };
        self.record_input("hypervisor", &input);
        let t = Instant::now();
        let answer = self.policies().hypervisor.call_hypervisor(&input);
        self.counters.observe_policy_call(&self.policies().hypervisor.manifest().name, "hypervisor", t);
        let answer = answer.map_err(|e| {
            ApiError::new(ErrorCode::PolicyFailed, format!("the hypervisor plugin failed: {e}"))
                .with("plugin", self.policies().hypervisor.manifest().name.clone())
        })?;
        let chosen = match answer {
            HypervisorAnswer::Hypervisor(h) => h,
            HypervisorAnswer::Reject(reason) => {
                return Err(ApiError::new(
                    ErrorCode::HypervisorUnsupported,
                    format!("the hypervisor plugin found no hypervisor for this instance: {reason}"),
                )
                .with("policy_reason", reason))
            }
        };
        let hv_plugin = self.policies().hypervisor.manifest().name.clone();
        let Some(info) = hypervisors.iter().find(|h| h.name == chosen) else {
            self.counters.reject(&hv_plugin, "hypervisor", "unknown_hypervisor");
            return Err(ApiError::new(
                ErrorCode::HypervisorUnsupported,
                format!("the hypervisor plugin chose {chosen:?}, which gpuvisor does not know"),
            )
            .with("hypervisor", chosen));
        };
        let kind = HypervisorKind::from_name(&chosen).ok_or_else(|| ApiError::internal("capability table"))?;
        if !hypervisor::can_carry(kind, framework) {
            self.counters.reject(&hv_plugin, "hypervisor", "cannot_carry_device");
            return Err(ApiError::new(
                ErrorCode::HypervisorUnsupported,
                format!(
                    "{chosen} cannot carry a {} device (cloud-hypervisor cannot run NVIDIA vGPUs: cloud-hypervisor#7572, #5319)",
                    framework.map(|f| f.as_str()).unwrap_or("plain")
                ),
            )
            .with("hypervisor", chosen));
        }
        if !info.available {
            return Err(ApiError::new(
                ErrorCode::HypervisorUnsupported,
                format!("{chosen} is not available on this host"),
            )
            .with("hypervisor", chosen));
        }
        Ok(chosen)
    }

    // ------------------------------------------------------------------ observation

    fn mode(&self) -> Result<HostMode, ApiError> {
        devices::detect(&self.host)
            .map_err(|e| ApiError::new(ErrorCode::NotReady, format!("GPU framework probe failed: {e}")))
    }

    fn vgpu_framework(&self) -> Result<Framework, ApiError> {
        match self.mode()? {
            HostMode::VendorVfio => Ok(Framework::VendorVfio),
            HostMode::Mdev => Ok(Framework::Mdev),
            HostMode::Mixed => Err(ApiError::new(
                ErrorCode::NotReady,
                "the host shows both vendor-VFIO VFs and mdev types (mixed); vGPU claims are refused",
            )),
            HostMode::WaitingForVfs => Err(ApiError::new(
                ErrorCode::NotReady,
                "the host's GPUs have no SR-IOV VFs yet (waiting for sriov-manage); retry later",
            )),
            HostMode::None => Err(ApiError::new(ErrorCode::NotReady, "this host has no vGPU-capable NVIDIA device")),
        }
    }

    /// Remembers a profile name seen in a catalog or claim; new names are persisted to
    /// `<data-dir>/profiles.json` so that a full GPU after a restart still tells
    /// `no_capacity` from `unknown_profile` (NVIDIA-HOST.md §3.5).
    fn learn_profile(&self, name: &str, fb: Option<u64>) {
        let canon = gpuvisor_sdk::canonical_profile(name);
        if canon.is_empty() {
            return;
        }
        let mut known = lock(&self.known_profiles);
        let key = canon.to_ascii_uppercase();
        if known.contains_key(&key) {
            return;
        }
        known.insert(key, (canon.to_string(), fb));
        if let Err(e) = crate::store::write_json_atomic(&self.store.root().join("profiles.json"), &*known) {
            tracing::warn!(error = %e, "cannot persist the known profile names");
        }
    }

    /// Reads the host once to learn its profile names (called at startup).
    pub fn learn_inventory(&self) {
        match self.observe(None) {
            Ok(obs) => {
                for g in self.cfg.managed_gpus.iter().flatten() {
                    if !obs.inventory.gpus.iter().any(|v| v.address.eq_ignore_ascii_case(g)) {
                        tracing::warn!(gpu = %g, "managed_gpus names a GPU with no vGPU device on this host");
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "initial GPU inventory failed"),
        }
    }

    fn learn_gpu_size(&self, pf: &str, fb: Option<u64>) {
        if let Some(fb) = fb {
            let mut m = lock(&self.gpu_framebuffer);
            let e = m.entry(pf.to_string()).or_insert(0);
            *e = (*e).max(fb);
        }
    }

    /// The framebuffer size of a profile: from the name, else from the mdev description or
    /// the known table; `None` = unknown.
    fn profile_fb(&self, profile: &str) -> Option<u64> {
        profile_framebuffer_mib(profile).or_else(|| {
            lock(&self.known_profiles)
                .get(&gpuvisor_sdk::canonical_profile(profile).to_ascii_uppercase())
                .and_then(|(_, fb)| *fb)
        })
    }

    /// True when a profile name was seen in any catalog or claim.
    fn profile_known(&self, profile: &str) -> bool {
        lock(&self.known_profiles).contains_key(&gpuvisor_sdk::canonical_profile(profile).to_ascii_uppercase())
    }

    /// Reads the host and the store and builds the placement inventory plus the legal
    /// candidates for `profile` (None: inventory only). Fails closed (`not_ready`) when
    /// claims or health records cannot be read.
    fn observe(&self, profile: Option<&str>) -> Result<Observation, ApiError> {
        let mode = self.mode()?;
        let claims = self
            .store
            .list_claims()
            .map_err(|e| ApiError::new(ErrorCode::NotReady, format!("claim records cannot be read: {e}")))?;
        let health = self
            .store
            .list_health()
            .map_err(|e| ApiError::new(ErrorCode::NotReady, format!("health records cannot be read: {e}")))?;
        let labels_of: HashMap<Uuid, Labels> =
            self.store.list_instances().unwrap_or_default().into_iter().map(|i| (i.id, i.labels)).collect();
        let driver = devices::read_attr(&self.host.nvidia_version_path()).ok();
        {
            let mut names = lock(&self.type_names);
            if names.0 != driver {
                *names = (driver.clone(), HashMap::new());
            }
            for c in &claims {
                if let (Some(id), true) = (c.type_id, c.driver_version == driver) {
                    names.1.insert((c.gpu.clone(), id), c.profile.clone());
                }
            }
        }
        for c in &claims {
            self.learn_profile(&c.profile, profile_framebuffer_mib(&c.profile));
        }
        let claim_of = |dev: &str| claims.iter().find(|c| c.device == dev);
        let quarantined = |dev: &str| health.iter().any(|h| h.device == dev && h.quarantined);
        let owner_of = |c: &Claim| DeviceOwner {
            instance_id: c.instance_id.to_string(),
            profile: Some(c.profile.clone()),
            labels: labels_of.get(&c.instance_id).cloned().unwrap_or_default(),
        };
        let want_fb = profile.and_then(|p| self.profile_fb(p));
        let mut gpus = Vec::new();
        let mut candidates = Vec::new();
        let mut notes = Vec::new();
        match mode {
            HostMode::VendorVfio | HostMode::Mixed => {
                let inv = vendor_vfio::inventory(&self.host)
                    .map_err(|e| ApiError::new(ErrorCode::NotReady, format!("VF inventory failed: {e}")))?;
                for g in inv.into_iter().filter(|g| self.cfg.manages(&g.bdf)) {
                    for vf in &g.vfs {
                        if let Ok(cat) = &vf.catalog {
                            for e in &cat.entries {
                                let fb = profile_framebuffer_mib(&e.name);
                                self.learn_profile(&e.name, fb);
                                lock(&self.type_names).1.insert((g.bdf.clone(), e.id), e.name.clone());
                                self.learn_gpu_size(&g.bdf, fb);
                            }
                        }
                    }
                    // Framebuffer of every active vGPU on the GPU (claimed or dirty).
                    let active: Vec<(&str, Option<u64>)> = g
                        .vfs
                        .iter()
                        .filter_map(|vf| match (&vf.current_type, claim_of(&vf.bdf)) {
                            (_, Some(c)) => Some((vf.bdf.as_str(), self.profile_fb(&c.profile))),
                            (Ok(t), None) if *t != 0 => Some((vf.bdf.as_str(), self.type_fb(&g, *t))),
                            _ => None,
                        })
                        .collect();
                    let gpu_claims: Vec<&Claim> = claims.iter().filter(|c| c.gpu == g.bdf).collect();
                    let claimed_fb: u64 = gpu_claims.iter().filter_map(|c| self.profile_fb(&c.profile)).sum();
                    let load_known = gpu_claims.iter().all(|c| self.profile_fb(&c.profile).is_some());
                    let mut views = Vec::new();
                    for vf in &g.vfs {
                        let claim = claim_of(&vf.bdf);
                        let state = if claim.is_some() {
                            DeviceState::Claimed
                        } else if quarantined(&vf.bdf) {
                            DeviceState::Quarantined
                        } else if !vf.readable() {
                            DeviceState::Unreadable
                        } else if vf.current_type.as_ref().map(|t| *t != 0).unwrap_or(false) {
                            DeviceState::Dirty
                        } else {
                            DeviceState::Free
                        };
                        let creatable: Vec<String> = match (&vf.catalog, state) {
                            (Ok(c), DeviceState::Free) => {
                                c.entries.iter().map(|e| gpuvisor_sdk::canonical_profile(&e.name).to_string()).collect()
                            }
                            _ => vec![],
                        };
                        if let Some(p) = profile {
                            let legal = match state {
                                DeviceState::Free => creatable.iter().any(|c| gpuvisor_sdk::profile_matches(p, c)),
                                DeviceState::Dirty => {
                                    // Repairable: once this VF is cleared, every other active
                                    // vGPU on the GPU has the requested size (equal-size rule).
                                    self.profile_known(p)
                                        && active
                                            .iter()
                                            .filter(|(b, _)| *b != vf.bdf)
                                            .all(|(_, fb)| fb.is_some() && want_fb.is_some() && *fb == want_fb)
                                }
                                _ => false,
                            };
                            if legal {
                                candidates.push(Candidate {
                                    device: vf.bdf.clone(),
                                    gpu: g.bdf.clone(),
                                    dirty: state == DeviceState::Dirty,
                                    mdev_type: None,
                                });
                            }
                        }
                        views.push(DeviceView {
                            address: vf.bdf.clone(),
                            state,
                            current_type: vf.current_type.as_ref().ok().copied().filter(|t| *t != 0),
                            creatable,
                            owner: claim.map(owner_of),
                        });
                    }
                    gpus.push(GpuView {
                        model: self.gpu_model(&g),
                        framebuffer_mib: self.gpu_size(&g.bdf, &g.device_id),
                        numa_node: g.numa_node,
                        claimed_framebuffer_mib: claimed_fb,
                        load_known,
                        devices: views,
                        address: g.bdf,
                    });
                }
            }
            HostMode::Mdev => {
                let parents = mdev::parents(&self.host)
                    .map_err(|e| ApiError::new(ErrorCode::NotReady, format!("mdev inventory failed: {e}")))?;
                let existing = mdev::devices(&self.host)
                    .map_err(|e| ApiError::new(ErrorCode::NotReady, format!("mdev inventory failed: {e}")))?;
                let mut by_pf: BTreeMap<String, Vec<mdev::MdevParent>> = BTreeMap::new();
                for p in parents.into_iter().filter(|p| self.cfg.manages(&p.pf)) {
                    for t in &p.types {
                        self.learn_profile(&t.name, t.framebuffer_mib);
                        self.learn_gpu_size(&p.pf, t.framebuffer_mib);
                    }
                    by_pf.entry(p.pf.clone()).or_default().push(p);
                }
                for (pf, parents) in by_pf {
                    let gpu_claims: Vec<&Claim> = claims.iter().filter(|c| c.gpu == pf).collect();
                    let claimed_fb: u64 = gpu_claims.iter().filter_map(|c| self.profile_fb(&c.profile)).sum();
                    let load_known = gpu_claims.iter().all(|c| self.profile_fb(&c.profile).is_some());
                    let mut views = Vec::new();
                    for p in &parents {
                        let claim = claim_of(&p.bdf);
                        // An mdev on a parent without a claim is another tool's: the parent
                        // is occupied (shown dirty), and gpuvisor never removes that mdev.
                        let foreign = existing.iter().any(|d| d.parent == p.bdf);
                        let state = if claim.is_some() {
                            DeviceState::Claimed
                        } else if quarantined(&p.bdf) {
                            DeviceState::Quarantined
                        } else if foreign {
                            DeviceState::Dirty
                        } else {
                            DeviceState::Free
                        };
                        let creatable: Vec<String> = if state == DeviceState::Free {
                            p.types
                                .iter()
                                .filter(|t| t.available > 0)
                                .map(|t| gpuvisor_sdk::canonical_profile(&t.name).to_string())
                                .collect()
                        } else {
                            vec![]
                        };
                        if let Some(want) = profile {
                            if let Some(t) = p.types.iter().find(|t| {
                                state == DeviceState::Free
                                    && t.available > 0
                                    && gpuvisor_sdk::profile_matches(want, &t.name)
                            }) {
                                candidates.push(Candidate {
                                    device: p.bdf.clone(),
                                    gpu: pf.clone(),
                                    dirty: false,
                                    mdev_type: Some(t.dir.clone()),
                                });
                            }
                        }
                        views.push(DeviceView {
                            address: p.bdf.clone(),
                            state,
                            current_type: None,
                            creatable,
                            owner: claim.map(owner_of),
                        });
                    }
                    let device_id = devices::read_attr(&self.host.pci_device(&pf).join("device")).unwrap_or_default();
                    gpus.push(GpuView {
                        model: devices::model_by_device_id(&device_id).unwrap_or("NVIDIA GPU").to_string(),
                        framebuffer_mib: self.gpu_size(&pf, &device_id),
                        numa_node: None,
                        claimed_framebuffer_mib: claimed_fb,
                        load_known,
                        devices: views,
                        address: pf,
                    });
                }
            }
            HostMode::WaitingForVfs | HostMode::None => {}
        }
        if profile.is_some() {
            for g in &gpus {
                for d in &g.devices {
                    if d.state == DeviceState::Dirty {
                        notes.push(format!("{} is dirty (type {:?}, no claim)", d.address, d.current_type));
                    }
                }
            }
        }
        Ok(Observation { mode, inventory: Inventory { gpus }, candidates, notes })
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
            .or_else(|| lock(&self.type_names).1.get(&(g.bdf.clone(), type_id)).cloned())
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

    fn gpu_size(&self, pf: &str, device_id: &str) -> Option<u64> {
        let table = match device_id.trim_start_matches("0x") {
            "26b9" | "26b5" | "26b1" => Some(49152),
            "2335" => Some(144384),
            _ => None,
        };
        table.or_else(|| lock(&self.gpu_framebuffer).get(pf).copied())
    }

    /// Asks the `placement` plugin and validates its answer: unknown, illegal and duplicate
    /// devices are dropped (and counted).
    fn rank(&self, rec: &InstanceRecord, framework: Framework, obs: &Observation) -> Result<Vec<Candidate>, ApiError> {
        let profile = rec.gpu_profile.clone().unwrap_or_default();
        let input = PlacementInput {
            request: PlacementRequest {
                instance_id: rec.id.to_string(),
                name: rec.name.clone(),
                labels: rec.labels.clone(),
                framework,
                framebuffer_mib: self.profile_fb(&profile),
                profile,
            },
            inventory: obs.inventory.clone(),
            params: self.cfg.plugin_params(gpuvisor_sdk::PolicyKind::Placement),
        };
        self.record_input("placement", &input);
        let t = Instant::now();
        let answer = self.policies().placement.call_placement(&input);
        self.counters.observe_policy_call(&self.policies().placement.manifest().name, "placement", t);
        let answer = answer.map_err(|e| {
            ApiError::new(ErrorCode::PolicyFailed, format!("the placement plugin failed: {e}"))
                .with("plugin", self.policies().placement.manifest().name.clone())
        })?;
        let ranked = match answer {
            PlacementAnswer::Ranked(r) => r,
            PlacementAnswer::Reject(reason) => {
                return Err(ApiError::new(
                    ErrorCode::NoCapacity,
                    format!("the placement policy rejected the request: {reason}"),
                )
                .with("policy_reason", reason))
            }
        };
        let mut out: Vec<Candidate> = Vec::new();
        for dev in ranked {
            match obs.candidates.iter().find(|c| c.device == dev) {
                Some(c) if !out.iter().any(|o| o.device == dev) => out.push(c.clone()),
                _ => {
                    self.counters.reject(
                        &self.policies().placement.manifest().name,
                        "placement",
                        "not_a_legal_candidate",
                    );
                    tracing::warn!(plugin.name = %self.policies().placement.manifest().name, gpu.device = %dev,
                        "placement plugin ranked a device that is not a legal candidate; dropped");
                }
            }
        }
        Ok(out)
    }

    // ------------------------------------------------------------------ claim & configure

    fn new_claim(&self, rec: &InstanceRecord, c: &Candidate, framework: Framework, boot_id: &str) -> Claim {
        Claim {
            device: c.device.clone(),
            framework,
            instance_id: rec.id,
            gpu: c.gpu.clone(),
            profile: rec.gpu_profile.clone().unwrap_or_default(),
            type_id: None,
            mdev_uuid: c.mdev_type.as_ref().map(|_| Uuid::new_v4()),
            mdev_type: c.mdev_type.clone(),
            claimed_at: now_rfc3339(),
            claim_boot_id: boot_id.to_string(),
            claimed_boottime_ms: proc::boottime_ms(),
            driver_version: devices::read_attr(&self.host.nvidia_version_path()).ok(),
            state: ClaimState::Claimed,
            release_attempts: 0,
            last_error: None,
        }
    }

    fn quarantine(&self, device: &str, reason: &str, detail: &str) {
        let rec = HealthRecord {
            device: device.to_string(),
            reason: reason.to_string(),
            quarantined: true,
            detail: detail.to_string(),
            at: now_rfc3339(),
            eio_in_a_row: 0,
        };
        tracing::error!(gpu.device = %device, reason, detail, "device quarantined");
        if let Err(e) = self.store.write_health(&rec) {
            tracing::error!(gpu.device = %device, error = %e, "cannot write the quarantine record");
        }
    }

    /// One strike against a device (LIFECYCLE.md Device health): the first makes it
    /// `suspect`, a second quarantines it.
    fn mark_suspect(&self, device: &str, reason: &str, detail: &str) {
        let prior = self.store.list_health().ok().and_then(|h| h.into_iter().find(|r| r.device == device));
        match prior {
            Some(_) => self.quarantine(device, reason, &format!("second strike: {detail}")),
            None => {
                let rec = HealthRecord {
                    device: device.to_string(),
                    reason: reason.to_string(),
                    quarantined: false,
                    detail: detail.to_string(),
                    at: now_rfc3339(),
                    eio_in_a_row: 0,
                };
                tracing::warn!(gpu.device = %device, reason, detail, "device marked suspect");
                if let Err(e) = self.store.write_health(&rec) {
                    tracing::error!(gpu.device = %device, error = %e, "cannot write the suspect record");
                }
            }
        }
    }

    /// A type write, mdev create/remove or clear on `device` failed: an EIO is a strike
    /// (LIFECYCLE.md Device health: the first makes the device `suspect`, a second in a row
    /// quarantines it); other errnos are not.
    fn write_failed(&self, device: &str, w: &WriteError) {
        if !w.eio {
            return;
        }
        let prior = match self.store.read_health(device) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(gpu.device = %device, error = %e, "cannot read the health record; EIO strike not counted");
                return;
            }
        };
        match prior {
            Some(h) if h.quarantined => {}
            Some(h) if h.eio_in_a_row >= 1 => {
                self.quarantine(device, "eio", &format!("EIO twice in a row: {}", w.message));
            }
            prior => {
                let rec = HealthRecord {
                    device: device.to_string(),
                    reason: prior.as_ref().map(|h| h.reason.clone()).unwrap_or_else(|| "eio".into()),
                    quarantined: false,
                    detail: w.message.clone(),
                    at: now_rfc3339(),
                    eio_in_a_row: 1,
                };
                tracing::warn!(gpu.device = %device, detail = %w.message, "device marked suspect after EIO");
                if let Err(e) = self.store.write_health(&rec) {
                    tracing::error!(gpu.device = %device, error = %e, "cannot write the suspect record");
                }
            }
        }
    }

    /// A write on `device` took effect: an EIO streak ends (the `suspect` mark stays, for
    /// the operator to see).
    fn write_succeeded(&self, device: &str) {
        if let Ok(Some(mut h)) = self.store.read_health(device) {
            if !h.quarantined && h.eio_in_a_row > 0 {
                h.eio_in_a_row = 0;
                if let Err(e) = self.store.write_health(&h) {
                    tracing::error!(gpu.device = %device, error = %e, "cannot update the suspect record");
                }
            }
        }
    }

    /// Counts the outcome of a write on `device` for its health, and passes it on.
    pub(crate) fn checked_write(&self, device: &str, r: Result<(), WriteError>) -> Result<(), WriteError> {
        match &r {
            Ok(()) => self.write_succeeded(device),
            Err(w) => self.write_failed(device, w),
        }
        r
    }

    /// Claims and configures a device for `rec` (LIFECYCLE.md Create steps 3–4). On
    /// success the claim is durable and `configured`. On `no_capacity` nothing is left
    /// behind.
    /// `configured`: set when the device was configured and its claim is durable but a later
    /// step failed (e.g. the claim's state could not be persisted on a full disk): the caller
    /// must roll back through the release guard.
    fn claim_and_configure(&self, rec: &InstanceRecord, configured: &mut Option<Claim>) -> Result<Claim, ApiError> {
        if !self.is_ready() {
            return Err(ApiError::new(
                ErrorCode::NotReady,
                "the agent has not finished its startup reconcile pass; retry shortly",
            ));
        }
        let profile = rec.gpu_profile.clone().unwrap_or_default();
        let framework = self.vgpu_framework()?;
        let boot_id = self.boot_id()?;
        let started = Instant::now();
        let _alloc = lock(&self.alloc);
        let obs = self.observe(Some(&profile))?;
        let ranked = self.rank(rec, framework, &obs)?;
        let mut tried = Vec::new();
        for cand in ranked {
            let mut claim = self.new_claim(rec, &cand, framework, &boot_id);
            match self.store.create_claim(&claim) {
                Ok(()) => crate::crash_point!("after_claim_commit"),
                Err(StoreError::ClaimExists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
            let result = match framework {
                Framework::VendorVfio => self.configure_vf(&mut claim, &cand),
                Framework::Mdev => self.configure_mdev(&mut claim, rec),
                Framework::Passthrough => Err((true, "passthrough is not supported yet".to_string())),
            };
            match result {
                Ok(()) => {
                    claim.state = ClaimState::Configured;
                    if let Err(e) = self.store.update_claim(&claim) {
                        claim.state = ClaimState::Claimed;
                        *configured = Some(claim);
                        return Err(e.into());
                    }
                    crate::crash_point!("after_configure");
                    self.counters.claim_duration.observe(started.elapsed().as_secs_f64());
                    tracing::info!(instance.id = %rec.id, gpu.device = %claim.device, type_id = ?claim.type_id,
                        duration_ms = started.elapsed().as_millis() as u64, "device claimed and configured");
                    return Ok(claim);
                }
                Err((drop_claim, why)) => {
                    tracing::warn!(instance.id = %rec.id, gpu.device = %cand.device, reason = %why, "candidate refused");
                    tried.push(format!("{}: {why}", cand.device));
                    if drop_claim {
                        self.store.remove_claim(&claim.device)?;
                    } else {
                        claim.state = ClaimState::ReleasePending;
                        claim.last_error = Some(why);
                        self.store.update_claim(&claim)?;
                    }
                }
            }
        }
        let mut msg = format!("no device can take profile {profile} now");
        let mut notes = obs.notes.clone();
        notes.extend(tried);
        if !notes.is_empty() {
            msg.push_str(&format!(" ({})", notes.join("; ")));
        }
        Err(ApiError::new(ErrorCode::NoCapacity, msg).with("profile", profile).with("notes", notes))
    }

    /// Configures a claimed VF: repairs it if dirty (behind a fresh scan), then sets the
    /// type with read-back. `Err((drop_claim, why))`: whether the claim can simply be
    /// removed (the VF reads 0 or was never touched).
    fn configure_vf(&self, claim: &mut Claim, cand: &Candidate) -> Result<(), (bool, String)> {
        let dev_lock = self.device_lock(&claim.device);
        let _d = lock(&dev_lock);
        let vf = &claim.device;
        let cur = vendor_vfio::read_current_type(&self.host, vf).map_err(|e| (true, format!("unreadable: {e}")))?;
        if cur != 0 {
            let info = vendor_vfio::read_vf(&self.host, vf, cand.gpu.clone());
            match scan(vendor_vfio::vf_targets(&self.host, &info)) {
                HandleScan::Clean => {}
                HandleScan::Held { pids } => return Err((true, format!("dirty and in use by pid {pids:?}"))),
                HandleScan::Unknown { reason } => {
                    return Err((true, format!("dirty and cannot verify holders: {reason}")))
                }
            }
            vendor_vfio::clear(&self.host, vf, Some(cur)).map_err(|e| (true, format!("repair failed: {e}")))?;
            tracing::info!(gpu.device = %vf, old_type = cur, "dirty VF repaired");
        }
        match vendor_vfio::set_type(&self.host, vf, &claim.profile) {
            Ok(id) => {
                claim.type_id = Some(id);
                self.write_succeeded(vf);
                Ok(())
            }
            Err(vendor_vfio::ConfigureError::NotCreatable(w)) => {
                self.write_failed(vf, &w);
                Err((true, w.message))
            }
            Err(vendor_vfio::ConfigureError::Foreign { value }) => {
                self.quarantine(vf, "foreign_write", &format!("read back type {value} that gpuvisor did not write"));
                Err((true, format!("foreign write: reads {value}")))
            }
            Err(vendor_vfio::ConfigureError::Io(m)) => {
                // The VF's state is unknown: keep the claim so the VF stays blocked.
                let zero = vendor_vfio::read_current_type(&self.host, vf).ok() == Some(0);
                Err((zero, m))
            }
        }
    }

    /// Creates the claim's mdev: records it in `mdevs/` first, then writes `create`.
    fn configure_mdev(&self, claim: &mut Claim, rec: &InstanceRecord) -> Result<(), (bool, String)> {
        let dev_lock = self.device_lock(&claim.device);
        let _d = lock(&dev_lock);
        let (Some(uuid), Some(t)) = (claim.mdev_uuid, claim.mdev_type.clone()) else {
            return Err((true, "claim lacks an mdev uuid".into()));
        };
        let mrec = MdevRecord {
            uuid,
            parent: claim.device.clone(),
            mdev_type: t.clone(),
            instance_id: rec.id,
            created_at: now_rfc3339(),
            boot_id: claim.claim_boot_id.clone(),
            created_boottime_ms: proc::boottime_ms(),
        };
        self.store.write_mdev(&mrec).map_err(|e| (true, e.to_string()))?;
        match mdev::create(&self.host, &claim.device, &t, &uuid.to_string()) {
            Ok(()) => {
                self.write_succeeded(&claim.device);
                Ok(())
            }
            Err(w) => {
                self.write_failed(&claim.device, &w);
                if mdev::read_device(&self.host, &uuid.to_string()).is_none() {
                    let _ = self.store.remove_mdev(uuid);
                    Err((true, w.message))
                } else {
                    Err((false, w.message))
                }
            }
        }
    }

    // ------------------------------------------------------------------ the release guard

    /// The release guard: the only code path that clears a device. The caller has proven
    /// the owner's VMM dead. Retries transient failures (EBUSY during kernel teardown, a
    /// holder going away) with backoff 250 ms → 2 s for `release_retry_s`, never holding a
    /// lock across a sleep. On failure the claim stays, marked `release_pending` with the
    /// attempt count and last error.
    pub fn release(&self, claim: &Claim) -> Result<(), ReleaseError> {
        self.release_within(claim, Duration::from_secs(self.cfg.release_retry_s))
    }

    /// [`Manager::release`] with an explicit inline retry budget (zero: one attempt, as the
    /// reconciler does — its next pass is the retry).
    fn release_within(&self, claim: &Claim, budget: Duration) -> Result<(), ReleaseError> {
        let deadline = Instant::now() + budget;
        let mut backoff = Duration::from_millis(250);
        loop {
            match self.release_once(claim) {
                Ok(()) => {
                    self.counters.releases_ok.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) if e.retryable() && Instant::now() + backoff < deadline => {
                    tracing::debug!(gpu.device = %claim.device, error = %e, "release will be retried");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    self.counters.releases_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(gpu.device = %claim.device, instance.id = %claim.instance_id, error = %e, "release failed; claim kept");
                    let _a = lock(&self.alloc);
                    if let Ok(Some(mut cur)) = self.store.read_claim(&claim.device) {
                        if cur.instance_id == claim.instance_id {
                            cur.state = ClaimState::ReleasePending;
                            cur.release_attempts += 1;
                            cur.last_error = Some(e.to_string());
                            if let Err(se) = self.store.update_claim(&cur) {
                                tracing::error!(gpu.device = %claim.device, error = %se, "cannot mark the claim release_pending");
                            }
                        }
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Re-reads the claim of `claim.device`: `Ok(Some)` when it is still exactly this claim
    /// (same instance, boot, claim time and mdev), `Ok(None)` when it is gone or another
    /// claim took its place — then it is not ours to release and nothing is touched.
    fn reread_claim(&self, claim: &Claim) -> Result<Option<Claim>, ReleaseError> {
        match self.store.read_claim(&claim.device) {
            Ok(Some(cur))
                if cur.instance_id == claim.instance_id
                    && cur.claim_boot_id == claim.claim_boot_id
                    && cur.claimed_boottime_ms == claim.claimed_boottime_ms
                    && cur.mdev_uuid == claim.mdev_uuid =>
            {
                Ok(Some(cur))
            }
            Ok(Some(_)) => {
                tracing::warn!(gpu.device = %claim.device, "the claim changed since it was read; touching nothing");
                Ok(None)
            }
            Ok(None) => Ok(None),
            Err(e) => Err(ReleaseError::Store(e.to_string())),
        }
    }

    /// One attempt of the guard. Locks: the claim is re-read under the allocation lock; the
    /// scan, the write and the read-back happen under the device lock (not the allocation
    /// lock: while the claim file exists no one else can claim the device, so a slow sysfs
    /// write never blocks other placements); the removal re-reads the claim again under the
    /// allocation lock.
    fn release_once(&self, claim: &Claim) -> Result<(), ReleaseError> {
        let Some(_) = ({
            let _a = lock(&self.alloc);
            self.reread_claim(claim)?
        }) else {
            return Ok(());
        };
        {
            let dev_lock = self.device_lock(&claim.device);
            let _d = lock(&dev_lock);
            // A concurrent release of the same claim may have finished meanwhile.
            let Some(cur) = self.reread_claim(claim)? else { return Ok(()) };
            let targets = match (cur.framework, cur.mdev_uuid) {
                (Framework::Mdev, Some(u)) => mdev::targets(&self.host, &u.to_string()),
                _ => {
                    let info = vendor_vfio::read_vf(&self.host, &cur.device, cur.gpu.clone());
                    vendor_vfio::vf_targets(&self.host, &info)
                }
            };
            match scan(targets) {
                HandleScan::Clean => {}
                HandleScan::Held { pids } => return Err(ReleaseError::InUse(pids)),
                HandleScan::Unknown { reason } => return Err(ReleaseError::ScanIncomplete(reason)),
            }
            crate::crash_point!("release_before_write");
            match (cur.framework, cur.mdev_uuid) {
                (Framework::Mdev, Some(u)) => {
                    self.checked_write(&cur.device, mdev::remove(&self.host, &u.to_string()))
                        .map_err(ReleaseError::Failed)?;
                    let _ = self.store.remove_mdev(u);
                }
                _ => match vendor_vfio::clear(&self.host, &cur.device, cur.type_id) {
                    Ok(()) => self.write_succeeded(&cur.device),
                    Err(vendor_vfio::ClearError::Foreign { value }) => {
                        let detail = format!("reads type {value}, claim recorded {:?}", cur.type_id);
                        self.quarantine(&cur.device, "foreign_write", &detail);
                        return Err(ReleaseError::Foreign(detail));
                    }
                    Err(vendor_vfio::ClearError::Failed(w)) => {
                        self.write_failed(&cur.device, &w);
                        return Err(ReleaseError::Failed(w));
                    }
                },
            }
        }
        crate::crash_point!("release_after_write");
        let _a = lock(&self.alloc);
        if self.reread_claim(claim)?.is_some() {
            self.store.remove_claim(&claim.device).map_err(|e| ReleaseError::Store(e.to_string()))?;
        }
        crate::crash_point!("release_after_claim_remove");
        tracing::info!(gpu.device = %claim.device, instance.id = %claim.instance_id, "device released");
        Ok(())
    }

    // ------------------------------------------------------------------ VMM

    /// The VMM control socket of an instance: the recorded one, else where QEMU would put it.
    fn control_socket(&self, rec: &InstanceRecord) -> PathBuf {
        rec.vmm
            .as_ref()
            .map(|v| v.control_socket.clone())
            .unwrap_or_else(|| self.store.instance_dir(rec.id).join("qmp.sock"))
    }

    /// Liveness of an instance's VMM (recorded identity and control-socket owner).
    fn liveness_at(&self, rec: &InstanceRecord, boot_id: &str) -> Liveness {
        proc::vmm_liveness(rec.vmm.as_ref().map(|v| &v.identity), Some(&self.control_socket(rec)), boot_id)
    }

    fn liveness(&self, rec: &InstanceRecord) -> Result<Liveness, ApiError> {
        Ok(self.liveness_at(rec, &self.boot_id()?))
    }

    fn vm_spec(&self, rec: &InstanceRecord, claim: Option<&Claim>) -> Result<hypervisor::VmSpec, ApiError> {
        let image = images::load(&self.store.images_dir(), &rec.image).map_err(|e| {
            if e.code == ErrorCode::NotFound {
                ApiError::invalid(format!("image {} of instance {} no longer exists", rec.image, rec.name))
                    .with("image", rec.image.clone())
            } else {
                e
            }
        })?;
        let vfio = match claim {
            None => None,
            Some(c) => {
                let (sysfsdev, group) = match c.mdev_uuid {
                    Some(u) => {
                        let d = mdev::read_device(&self.host, &u.to_string());
                        (self.host.mdev_device(&u.to_string()), d.and_then(|d| d.iommu_group))
                    }
                    None => {
                        let info = vendor_vfio::read_vf(&self.host, &c.device, c.gpu.clone());
                        (self.host.pci_device(&c.device), info.iommu_group)
                    }
                };
                Some(match self.cfg.vfio_attach {
                    VfioAttach::Device => hypervisor::VfioAttach::Device { sysfsdev },
                    VfioAttach::HoldFd => {
                        let g = group.ok_or_else(|| {
                            ApiError::new(ErrorCode::VmmStartFailed, format!("{} has no IOMMU group", c.device))
                        })?;
                        hypervisor::VfioAttach::HoldFd { node: self.host.vfio_group_node(g) }
                    }
                })
            }
        };
        Ok(hypervisor::VmSpec {
            id: rec.id,
            name: rec.name.clone(),
            vcpus: rec.vcpus,
            memory_mib: rec.memory_mib,
            kernel: Some(image.kernel),
            initrd: image.initrd,
            paused: false,
            cmdline: image.cmdline.unwrap_or_else(|| self.cfg.default_cmdline.clone()),
            accel: self.cfg.accel.clone(),
            qemu_binary: self.cfg.qemu_binary.clone(),
            run_dir: self.store.instance_dir(rec.id),
            vfio,
        })
    }

    fn spawn(&self, rec: &mut InstanceRecord, claim: Option<&Claim>) -> Result<(), ApiError> {
        let spec = self.vm_spec(rec, claim)?;
        let boot_id = self.boot_id()?;
        let vmm = hypervisor::spawn(&spec, &boot_id)
            .map_err(|e| ApiError::new(ErrorCode::VmmStartFailed, format!("the VMM did not start: {e}")))?;
        crate::crash_point!("after_spawn");
        rec.vmm = Some(VmmRecord { identity: vmm.identity.clone(), control_socket: vmm.qmp_socket.clone() });
        rec.state = InstanceState::Running;
        rec.last_error = None;
        self.store.write_instance(rec)?;
        crate::crash_point!("after_running");
        tracing::info!(instance.id = %rec.id, pid = vmm.identity.pid, "VMM running");
        Ok(())
    }

    fn stop_options(&self, graceful: bool) -> hypervisor::StopOptions {
        hypervisor::StopOptions {
            graceful,
            stop_timeout: Duration::from_secs(self.cfg.stop_timeout_s),
            term_grace: Duration::from_secs(self.cfg.vfio_term_grace_s),
        }
    }

    /// Stops the VMM of `rec` (graceful or kill path) until it is provably dead.
    fn stop_vmm(&self, rec: &InstanceRecord, graceful: bool) -> Result<(), ApiError> {
        let Some(vmm) = &rec.vmm else {
            return match self.liveness(rec)? {
                Liveness::Dead => Ok(()),
                Liveness::Alive { pid } => Err(ApiError::new(
                    ErrorCode::VmmLivenessUnknown,
                    format!("pid {pid} owns the instance's control socket but no VMM identity is recorded"),
                )),
                Liveness::MaybeAlive { reason } => Err(ApiError::new(ErrorCode::VmmLivenessUnknown, reason)),
            };
        };
        let boot_id = self.boot_id()?;
        match hypervisor::stop(&vmm.identity, &vmm.control_socket, self.stop_options(graceful), &boot_id) {
            Ok(report) => {
                if !report.escalations.is_empty() {
                    // A SIGKILL during vGPU setup can wedge the VF (NVIDIA-HOST.md §9): name
                    // the device, count it, and mark the device suspect.
                    for sig in &report.escalations {
                        match *sig {
                            "SIGKILL" => self.counters.kill_escalations_sigkill.fetch_add(1, Ordering::Relaxed),
                            _ => self.counters.kill_escalations_group.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                    self.counters.kill_escalations.fetch_add(report.escalations.len() as u64, Ordering::Relaxed);
                    if let Ok(Some(c)) = self.claim_of(rec.id) {
                        tracing::warn!(instance.id = %rec.id, gpu.device = %c.device, pid = vmm.identity.pid,
                            escalations = ?report.escalations, "the VMM needed SIGKILL; its device may be wedged");
                        self.mark_suspect(
                            &c.device,
                            "kill_escalation",
                            &format!("VMM {} needed {:?}", vmm.identity.pid, report.escalations),
                        );
                    }
                }
                Ok(())
            }
            Err(hypervisor::HypervisorError::KillFailed { pid }) => Err(ApiError::new(
                ErrorCode::VmmKillFailed,
                format!("the VMM (pid {pid}) outlived SIGKILL; nothing was torn down"),
            )
            .with("pid", pid)),
            Err(hypervisor::HypervisorError::LivenessUnknown { reason }) => {
                Err(ApiError::new(ErrorCode::VmmLivenessUnknown, reason))
            }
            Err(e) => Err(ApiError::internal(format!("stopping the VMM failed: {e}"))),
        }
    }

    // ------------------------------------------------------------------ operations

    /// `instance.create`: validate, choose the hypervisor, write the record, claim,
    /// configure, spawn; roll back on failure (LIFECYCLE.md Create).
    pub fn create(&self, req: CreateRequest) -> Result<Value, ApiError> {
        check_instance_name(&req.name)?;
        let vcpus = req.vcpus.unwrap_or(1);
        let memory_mib = req.memory_mib.unwrap_or(256);
        if !(1..=64).contains(&vcpus) {
            return Err(ApiError::invalid(format!("vcpus must be 1..=64, not {vcpus}")));
        }
        if !(64..=1_048_576).contains(&memory_mib) {
            return Err(ApiError::invalid(format!("memory_mib must be 64..=1048576, not {memory_mib}")));
        }
        check_labels(&req.labels)?;
        if let Some(h) = &req.hypervisor {
            if HypervisorKind::from_name(h).is_none() {
                return Err(ApiError::invalid(format!(
                    "hypervisor {h:?} is not one of \"qemu\", \"cloud-hypervisor\""
                )));
            }
        }
        images::load(&self.store.images_dir(), &req.image).map_err(|e| {
            if e.code == ErrorCode::NotFound {
                ApiError::invalid(e.message)
            } else {
                e
            }
        })?;
        let framework = match &req.gpu {
            Some(_) => Some(self.vgpu_framework()?),
            None => None,
        };
        // The capability gate runs before anything is allocated.
        let hypervisor = self.choose_hypervisor(&req, framework)?;
        let profile = match &req.gpu {
            Some(p) => {
                let canon = gpuvisor_sdk::canonical_profile(p).to_string();
                if canon.is_empty() {
                    return Err(ApiError::invalid("gpu profile is empty"));
                }
                // Refresh what the catalogs list, then tell unknown from no capacity.
                let _ = self.observe(None);
                if !self.profile_known(&canon) {
                    return Err(ApiError::new(
                        ErrorCode::UnknownProfile,
                        format!("profile {canon} is not offered by any GPU on this host"),
                    )
                    .with("profile", canon));
                }
                Some(self.canonical_case(&canon))
            }
            None => None,
        };
        let id = Uuid::new_v4();
        let rec = InstanceRecord {
            id,
            name: req.name.clone(),
            image: req.image.clone(),
            hypervisor,
            vcpus,
            memory_mib,
            labels: req.labels.clone(),
            gpu_profile: profile,
            gpu_framework: framework,
            state: InstanceState::Starting,
            vmm: None,
            created_at: now_rfc3339(),
            last_error: None,
        };
        // The instance lock is taken before the record exists, so the reconciler never sees
        // a `starting` record whose operation is not holding it (lock order: instance, then
        // allocation).
        let ilock = self.instance_lock(id);
        let _i = lock(&ilock);
        {
            // Names are unique: check and write under the allocation lock.
            let _a = lock(&self.alloc);
            if self.store.list_instances()?.iter().any(|i| i.name == req.name) {
                lock(&self.instance_locks).remove(&id);
                return Err(ApiError::new(ErrorCode::NameTaken, format!("an instance named {} exists", req.name))
                    .with("name", req.name.clone()));
            }
            if let Err(e) = self.store.write_instance(&rec) {
                // E.g. a full disk: leave no empty instance directory behind.
                let _ = self.store.remove_instance(id);
                lock(&self.instance_locks).remove(&id);
                return Err(e.into());
            }
        }
        crate::crash_point!("create_after_record");
        tracing::info!(instance.id = %id, name = %rec.name, profile = ?rec.gpu_profile, "creating instance");
        match self.boot(rec, Rollback::Remove) {
            Ok(rec) => Ok(self.view_after(&rec)),
            Err(e) => Err(e),
        }
    }

    /// The catalog's spelling of a known profile (`l40s-2q` → `L40S-2Q`).
    fn canonical_case(&self, canon: &str) -> String {
        lock(&self.known_profiles)
            .get(&canon.to_ascii_uppercase())
            .map(|(n, _)| n.clone())
            .unwrap_or_else(|| canon.to_string())
    }

    /// Claim, configure, spawn for a `starting` record; on failure roll back as `mode` says.
    fn boot(&self, mut rec: InstanceRecord, mode: Rollback) -> Result<InstanceRecord, ApiError> {
        let mut configured = None;
        let claim = match &rec.gpu_profile {
            Some(_) => match self.claim_and_configure(&rec, &mut configured) {
                Ok(c) => Some(c),
                // A configured device whose claim could not be updated: roll back like a
                // failed spawn (release through the guard, retain on failure).
                Err(e) if configured.is_some() => return Err(self.rollback(rec, configured, mode, e)),
                Err(e) => {
                    // Nothing was claimed (every refused candidate's claim was dropped or kept
                    // as release_pending with the VF blocked).
                    self.undo_record(&mut rec, mode, &e);
                    return Err(e);
                }
            },
            None => None,
        };
        match self.spawn(&mut rec, claim.as_ref()) {
            Ok(()) => Ok(rec),
            Err(e) => Err(self.rollback(rec, claim, mode, e)),
        }
    }

    fn undo_record(&self, rec: &mut InstanceRecord, mode: Rollback, cause: &ApiError) {
        match mode {
            Rollback::Remove => {
                if let Err(e) = self.store.remove_instance(rec.id) {
                    tracing::error!(instance.id = %rec.id, error = %e, "cannot remove the instance record after a failed create");
                }
            }
            Rollback::Stopped => {
                rec.state = InstanceState::Stopped;
                rec.vmm = None;
                rec.last_error = Some(cause.message.clone());
                if let Err(e) = self.store.write_instance(rec) {
                    tracing::error!(instance.id = %rec.id, error = %e, "cannot restore the stopped record");
                }
            }
        }
    }

    /// Rollback after a claim (LIFECYCLE.md Create step 6): stop the VMM, prove it dead,
    /// release through the guard; retain on failure.
    fn rollback(&self, mut rec: InstanceRecord, claim: Option<Claim>, mode: Rollback, cause: ApiError) -> ApiError {
        tracing::warn!(instance.id = %rec.id, error = %cause, "rolling back");
        let stopped = if rec.vmm.is_some() { self.stop_vmm(&rec, false) } else { Ok(()) };
        let released = match (&stopped, &claim) {
            (Err(e), _) => Err(format!("the VMM could not be stopped: {e}")),
            (Ok(()), Some(c)) => self.release(c).map_err(|e| e.to_string()),
            (Ok(()), None) => Ok(()),
        };
        match released {
            Ok(()) => {
                rec.vmm = None;
                self.undo_record(&mut rec, mode, &cause);
                cause
            }
            Err(why) => self.retain(rec, claim.as_ref(), cause, why),
        }
    }

    /// Turns the instance into a delete-only `cleanup_pending` record (one attempt) and
    /// builds the `vgpu_cleanup_pending` error.
    fn retain(&self, mut rec: InstanceRecord, claim: Option<&Claim>, cause: ApiError, why: String) -> ApiError {
        rec.state = InstanceState::CleanupPending;
        rec.last_error = Some(format!("{}; release: {why}", cause.message));
        let retained = self.write_retention(&rec).is_ok();
        let device_path = claim.map(|c| self.device_path(c).display().to_string());
        let guidance = if retained {
            format!("delete instance {} to retry the release", rec.id)
        } else {
            "the device will be released automatically once it is proven free; do not delete".to_string()
        };
        ApiError::new(
            ErrorCode::VgpuCleanupPending,
            format!("{} and the vGPU could not be released ({why}); {guidance}", cause.message),
        )
        .with("instance_id", rec.id.to_string())
        .with("device_path", device_path)
        .with("retained", retained)
        .with("cause", cause.data())
        .with("guidance", guidance)
    }

    /// The one attempt at the retention write (failpoint `retain_write`).
    fn write_retention(&self, rec: &InstanceRecord) -> Result<(), StoreError> {
        fail::fail_point!("retain_write", |_| Err(StoreError::Io {
            path: self.store.instance_dir(rec.id),
            source: std::io::Error::other("failpoint retain_write"),
        }));
        let res = self.store.write_instance(rec);
        if let Err(e) = &res {
            tracing::error!(instance.id = %rec.id, error = %e, "the retention write failed; the claim stays for the reconciler");
        }
        res
    }

    /// `instance.start` (LIFECYCLE.md Start).
    pub fn start(&self, r: &str) -> Result<Value, ApiError> {
        let rec = self.find(r)?;
        let ilock = self.instance_lock(rec.id);
        let _i = lock(&ilock);
        let mut rec = self.store.read_instance(rec.id)?.ok_or_else(|| ApiError::not_found(r))?;
        match rec.state {
            InstanceState::CleanupPending => {
                return Err(ApiError::new(
                    ErrorCode::InstanceCleanupPending,
                    format!("instance {} awaits the release of its vGPU; only delete is allowed", rec.name),
                ))
            }
            InstanceState::Stopped => {}
            // A VMM that exited behind the agent's back (the next reconcile pass would record
            // it): with its recorded identity provably dead and the instance lock ours, the
            // record is stale — record it stopped and start.
            InstanceState::Running if rec.vmm.is_some() && matches!(self.liveness(&rec)?, Liveness::Dead) => {
                rec.state = InstanceState::Stopped;
                rec.vmm = None;
                rec.last_error = Some("the VMM exited".into());
                self.store.write_instance(&rec)?;
                tracing::info!(instance.id = %rec.id, "the recorded VMM had exited; starting again");
            }
            s => {
                return Err(ApiError::new(
                    ErrorCode::InvalidState,
                    format!("instance {} is {}, not stopped", rec.name, s.as_str()),
                ))
            }
        }
        // A claim left from an earlier failed release goes first, persisted.
        if let Some(old) = self.claim_of(rec.id)? {
            self.release(&old).map_err(|e| {
                ApiError::new(
                    ErrorCode::GpuReleasePending,
                    format!("the earlier vGPU of {} still cannot be released: {e}", rec.name),
                )
                .with("device", old.device.clone())
            })?;
        }
        rec.vmm = None;
        rec.state = InstanceState::Starting;
        rec.last_error = None;
        self.store.write_instance(&rec)?;
        crate::crash_point!("start_after_clear_identity");
        let rec = self.boot(rec, Rollback::Stopped)?;
        Ok(self.view_after(&rec))
    }

    /// `instance.stop` (LIFECYCLE.md Stop). `force` skips the guest power-off.
    pub fn stop(&self, r: &str, force: bool) -> Result<Value, ApiError> {
        let rec = self.find(r)?;
        let ilock = self.instance_lock(rec.id);
        let _i = lock(&ilock);
        let mut rec = self.store.read_instance(rec.id)?.ok_or_else(|| ApiError::not_found(r))?;
        match rec.state {
            InstanceState::CleanupPending => {
                return Err(ApiError::new(
                    ErrorCode::InstanceCleanupPending,
                    format!("instance {} awaits the release of its vGPU; only delete is allowed", rec.name),
                ))
            }
            InstanceState::Stopped => {}
            InstanceState::Deleting => {
                return Err(ApiError::new(
                    ErrorCode::InvalidState,
                    format!("instance {} is being deleted; retry the delete", rec.name),
                ))
            }
            _ => {
                if let Liveness::MaybeAlive { reason } = self.liveness(&rec)? {
                    return Err(ApiError::new(
                        ErrorCode::VmmLivenessUnknown,
                        format!("cannot tell whether the VMM of {} is alive: {reason}", rec.name),
                    ));
                }
                rec.state = InstanceState::Stopping;
                self.store.write_instance(&rec)?;
                crate::crash_point!("stop_after_stopping_mark");
                self.stop_vmm(&rec, !force)?;
                crate::crash_point!("stop_after_vmm_dead");
            }
        }
        // The VMM is provably dead: release (a failed release keeps the claim). Claims that
        // cannot be read are left alone (fail closed); the stop itself is done.
        match self.claim_of(rec.id) {
            Ok(Some(c)) => {
                if let Err(e) = self.release(&c) {
                    rec.last_error = Some(format!("vGPU release pending: {e}"));
                }
            }
            Ok(None) => {}
            Err(e) => {
                rec.last_error = Some(format!("vGPU release pending: the claim records cannot be read: {}", e.message));
            }
        }
        rec.vmm = None;
        rec.state = InstanceState::Stopped;
        self.store.write_instance(&rec)?;
        crate::crash_point!("stop_after_stopped");
        Ok(self.view_after(&rec))
    }

    /// `instance.delete` (LIFECYCLE.md Delete).
    pub fn delete(&self, r: &str) -> Result<Value, ApiError> {
        let rec = self.find(r)?;
        let ilock = self.instance_lock(rec.id);
        let _i = lock(&ilock);
        let mut rec = self.store.read_instance(rec.id)?.ok_or_else(|| ApiError::not_found(r))?;
        if let Liveness::MaybeAlive { reason } = self.liveness(&rec)? {
            return Err(ApiError::new(
                ErrorCode::VmmLivenessUnknown,
                format!("cannot tell whether the VMM of {} is alive: {reason}", rec.name),
            ));
        }
        let claim = self.claim_of(rec.id)?;
        let has_gpu = claim.is_some() || rec.gpu_profile.is_some();
        if rec.state != InstanceState::Deleting {
            rec.state = InstanceState::Deleting;
            match self.store.write_instance(&rec) {
                Ok(()) => {}
                // A plain instance must stay deletable on a full disk.
                Err(e) if !has_gpu || claim.is_none() => {
                    tracing::warn!(instance.id = %rec.id, error = %e, "cannot mark deleting; continuing (no device)")
                }
                Err(e) => return Err(e.into()),
            }
        }
        crate::crash_point!("delete_after_deleting_mark");
        self.stop_vmm(&rec, false)?;
        crate::crash_point!("delete_after_vmm_dead");
        if let Some(c) = &claim {
            if let Err(e) = self.release(c) {
                rec.state = InstanceState::CleanupPending;
                rec.vmm = None;
                rec.last_error = Some(format!("vGPU release failed: {e}"));
                let retained = self.store.write_instance(&rec).is_ok();
                return Err(ApiError::new(
                    ErrorCode::VgpuCleanupPending,
                    format!("the vGPU of {} could not be released ({e}); retry the delete", rec.name),
                )
                .with("instance_id", rec.id.to_string())
                .with("device_path", self.device_path(c).display().to_string())
                .with("retained", retained)
                .with("cause", json!({"code": "release_failed", "detail": e.to_string()}))
                .with("guidance", format!("delete instance {} to retry the release", rec.id)));
            }
        }
        crate::crash_point!("delete_after_release");
        self.store.remove_instance(rec.id)?;
        lock(&self.instance_locks).remove(&rec.id);
        tracing::info!(instance.id = %rec.id, name = %rec.name, "instance deleted");
        Ok(json!({ "id": rec.id.to_string(), "deleted": true }))
    }

    /// Refuses every operation but delete on a `cleanup_pending` instance.
    fn refuse_cleanup_pending(rec: &InstanceRecord) -> Result<(), ApiError> {
        if rec.state == InstanceState::CleanupPending {
            return Err(ApiError::new(
                ErrorCode::InstanceCleanupPending,
                format!("instance {} awaits the release of its vGPU; only delete is allowed", rec.name),
            )
            .with("instance_id", rec.id.to_string()));
        }
        Ok(())
    }

    /// `instance.fork`: a new stopped instance with the source's definition (image, vCPUs,
    /// memory, labels, hypervisor and GPU *profile*). It never inherits a claim or a VMM
    /// identity: it claims its own device when it starts. A `cleanup_pending` source is
    /// refused.
    pub fn fork(&self, r: &str, name: &str) -> Result<Value, ApiError> {
        let src = self.find(r)?;
        Self::refuse_cleanup_pending(&src)?;
        check_instance_name(name)?;
        let rec = InstanceRecord {
            id: Uuid::new_v4(),
            name: name.to_string(),
            image: src.image.clone(),
            hypervisor: src.hypervisor.clone(),
            vcpus: src.vcpus,
            memory_mib: src.memory_mib,
            labels: src.labels.clone(),
            gpu_profile: src.gpu_profile.clone(),
            gpu_framework: src.gpu_framework,
            state: InstanceState::Stopped,
            vmm: None,
            created_at: now_rfc3339(),
            last_error: None,
        };
        let _a = lock(&self.alloc);
        if self.store.list_instances()?.iter().any(|i| i.name == name) {
            return Err(
                ApiError::new(ErrorCode::NameTaken, format!("an instance named {name} exists")).with("name", name)
            );
        }
        self.store.write_instance(&rec)?;
        tracing::info!(instance.id = %rec.id, source = %src.id, "instance forked");
        Ok(self.view(&rec, &[]))
    }

    /// `instance.standby` / `instance.snapshot` / `instance.restore`: refused for
    /// `cleanup_pending` instances (`instance_cleanup_pending`) and, for standby and
    /// snapshot, for running instances with a VFIO device (`unsupported_with_gpu`: device
    /// state cannot be saved). Plain instances: not implemented in this version.
    pub fn save_state_op(&self, r: &str, op: &str) -> Result<Value, ApiError> {
        let rec = self.find(r)?;
        Self::refuse_cleanup_pending(&rec)?;
        let has_gpu = rec.gpu_profile.is_some() || self.claim_of(rec.id)?.is_some();
        if op != "restore" && has_gpu && rec.state == InstanceState::Running {
            return Err(ApiError::new(
                ErrorCode::UnsupportedWithGpu,
                format!("{op} of {} is refused while its vGPU is attached: device state cannot be saved", rec.name),
            ));
        }
        Err(ApiError::invalid(format!("instance.{op} is not implemented in this version")))
    }

    // ------------------------------------------------------------------ read-only views

    /// `resources.get`: GPU mode, device counts and per-profile placeable counts (honest
    /// under the equal-size rule).
    pub fn resources(&self) -> Result<Value, ApiError> {
        let mode = self.mode();
        let mode_name = mode.as_ref().map(|m| m.as_str()).unwrap_or("probe_error");
        let obs = match self.observe(None) {
            Ok(o) => o,
            Err(e) => {
                return Ok(json!({ "mode": mode_name, "ready": false, "error": e.message,
                    "devices": {"total": 0, "claimed": 0, "allocatable": 0}, "profiles": [] }))
            }
        };
        let mut total = 0;
        let mut claimed = 0;
        let mut allocatable = 0;
        let mut quarantined = 0;
        let mut dirty = 0;
        let mut unreadable = 0;
        // A device can be claimed and quarantined at once: the quarantine count comes from
        // the health records of devices present, not from the one state shown.
        let marks = self.store.list_health().unwrap_or_default();
        for g in &obs.inventory.gpus {
            for d in &g.devices {
                total += 1;
                if marks.iter().any(|h| h.quarantined && h.device == d.address) {
                    quarantined += 1;
                }
                match d.state {
                    DeviceState::Claimed => claimed += 1,
                    DeviceState::Free => allocatable += 1,
                    DeviceState::Quarantined => {}
                    DeviceState::Dirty => dirty += 1,
                    DeviceState::Unreadable => unreadable += 1,
                }
            }
        }
        // Profiles: every name seen; placeable per GPU = free VFs listing it, capped by the
        // slots left under the equal-size rule (GPU framebuffer / profile framebuffer).
        let known: Vec<(String, Option<u64>)> =
            lock(&self.known_profiles).values().map(|(n, fb)| (n.clone(), *fb)).collect();
        let mut profiles = Vec::new();
        for (name, fb) in known {
            let mut placeable = 0u64;
            let mut type_id = None;
            for g in &obs.inventory.gpus {
                let listing = g
                    .devices
                    .iter()
                    .filter(|d| {
                        d.state == DeviceState::Free && d.creatable.iter().any(|c| c.eq_ignore_ascii_case(&name))
                    })
                    .count() as u64;
                if listing == 0 {
                    continue;
                }
                let active =
                    g.devices.iter().filter(|d| matches!(d.state, DeviceState::Claimed | DeviceState::Dirty)).count()
                        as u64;
                let cap = match (g.framebuffer_mib, fb) {
                    (Some(gfb), Some(pfb)) if pfb > 0 => (gfb / pfb).saturating_sub(active),
                    _ => listing,
                };
                placeable += listing.min(cap);
            }
            if obs.mode == HostMode::VendorVfio {
                type_id = self.type_id_of(&name);
            }
            profiles
                .push(json!({ "profile": name, "type_id": type_id, "framebuffer_mib": fb, "placeable": placeable }));
        }
        Ok(json!({
            "mode": obs.mode.as_str(),
            "ready": matches!(obs.mode, HostMode::VendorVfio | HostMode::Mdev),
            "devices": { "total": total, "claimed": claimed, "allocatable": allocatable,
                         "quarantined": quarantined, "dirty": dirty, "unreadable": unreadable },
            "profiles": profiles,
        }))
    }

    fn type_id_of(&self, profile: &str) -> Option<u32> {
        let gpus = vendor_vfio::inventory(&self.host).ok()?;
        gpus.iter()
            .flat_map(|g| g.vfs.iter())
            .filter_map(|v| v.catalog.as_ref().ok())
            .find_map(|c| c.find(profile).map(|e| e.id))
    }

    /// `gpu.list`: every GPU and device with its current type and claim owner.
    pub fn gpus(&self) -> Result<Value, ApiError> {
        let obs = self.observe(None)?;
        let instances: HashMap<Uuid, String> =
            self.store.list_instances().unwrap_or_default().into_iter().map(|i| (i.id, i.name)).collect();
        let claims = self.store.list_claims()?;
        let health = self.store.list_health().unwrap_or_default();
        let held = lock(&self.held_by_policy).clone();
        let gpus: Vec<Value> = obs
            .inventory
            .gpus
            .iter()
            .map(|g| {
                let devs: Vec<Value> = g
                    .devices
                    .iter()
                    .map(|d| {
                        let claim = claims.iter().find(|c| c.device == d.address);
                        json!({
                            "address": d.address,
                            "state": d.state,
                            "current_type": d.current_type.unwrap_or(0),
                            "creatable": d.creatable,
                            "claim": claim.map(|c| json!({
                                "instance_id": c.instance_id.to_string(),
                                "instance_name": instances.get(&c.instance_id),
                                "profile": c.profile, "type_id": c.type_id,
                                "mdev_uuid": c.mdev_uuid.map(|u| u.to_string()),
                                "state": c.state.as_str(), "last_error": c.last_error,
                            })),
                            "quarantine": health.iter().find(|h| h.device == d.address).map(|h| json!({"reason": h.reason, "detail": h.detail, "at": h.at, "quarantined": h.quarantined})),
                            "held_by_policy": held.get(&d.address),
                        })
                    })
                    .collect();
                json!({
                    "address": g.address, "model": g.model, "framebuffer_mib": g.framebuffer_mib,
                    "claimed_framebuffer_mib": g.claimed_framebuffer_mib, "managed": true, "devices": devs,
                })
            })
            .collect();
        Ok(json!({ "mode": obs.mode.as_str(), "gpus": gpus }))
    }

    /// `placement.dry_run`: what the placement plugin would pick for a profile now, after
    /// native validation. Claims nothing.
    pub fn dry_run(&self, profile: &str, name: Option<String>, labels: Labels) -> Result<Value, ApiError> {
        if let Some(n) = name.as_deref() {
            check_instance_name(n)?;
        }
        check_labels(&labels)?;
        let framework = self.vgpu_framework()?;
        let _ = self.observe(None);
        if !self.profile_known(profile) {
            return Err(ApiError::new(
                ErrorCode::UnknownProfile,
                format!("profile {profile} is not offered by any GPU on this host"),
            )
            .with("profile", profile.to_string()));
        }
        let rec = InstanceRecord {
            id: Uuid::nil(),
            name: name.unwrap_or_else(|| "dry-run".into()),
            image: String::new(),
            hypervisor: "qemu".into(),
            vcpus: 1,
            memory_mib: 256,
            labels,
            gpu_profile: Some(self.canonical_case(gpuvisor_sdk::canonical_profile(profile))),
            gpu_framework: Some(framework),
            state: InstanceState::Starting,
            vmm: None,
            created_at: now_rfc3339(),
            last_error: None,
        };
        let _a = lock(&self.alloc);
        let obs = self.observe(rec.gpu_profile.as_deref())?;
        let ranked = self.rank(&rec, framework, &obs)?;
        Ok(json!({
            "profile": rec.gpu_profile,
            "plugin": self.policies().placement.manifest().name,
            "ranked": ranked.iter().map(|c| json!({"device": c.device, "gpu": c.gpu, "dirty": c.dirty})).collect::<Vec<_>>(),
            "notes": obs.notes,
        }))
    }

    /// Devices the grace plugin holds past `claim_grace_s` + one interval, with its reason.
    pub fn held_by_policy(&self) -> BTreeMap<String, String> {
        lock(&self.held_by_policy).clone()
    }

    /// True once a reconcile pass had a complete observation.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// `agent.health` details: readiness facts.
    pub fn health(&self) -> Value {
        let store_ok = self.store.list_instances().is_ok() && self.store.list_claims().is_ok();
        let mode = self.mode();
        json!({
            "live": true,
            "ready": store_ok && mode.is_ok() && self.is_ready(),
            "startup_reconcile_done": self.is_ready(),
            "store_readable": store_ok,
            "gpu_mode": mode.as_ref().map(|m| m.as_str()).unwrap_or("probe_error"),
            "plugins_loaded": true,
        })
    }

    /// `gpu.unquarantine`: clears a quarantine mark after an operator repaired the device.
    pub fn unquarantine(&self, device: &str) -> Result<Value, ApiError> {
        let had = self.store.list_health()?.iter().any(|h| h.device == device);
        if !had {
            return Err(ApiError::not_found(&format!("quarantine mark for {device}")));
        }
        self.store.remove_health(device)?;
        Ok(json!({ "device": device, "quarantined": false }))
    }
}

/// What a failed boot does to the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rollback {
    /// Create: remove the record.
    Remove,
    /// Start: restore `stopped`.
    Stopped,
}

/// A fresh open-handle scan of a device's nodes; targets that could not be read make the
/// result unknown (fail closed, NVIDIA-HOST.md §5).
fn scan(targets: Result<Vec<PathBuf>, String>) -> HandleScan {
    match targets {
        Ok(t) => proc::scan_open_handles(&t),
        Err(reason) => HandleScan::Unknown { reason },
    }
}

fn binary_exists(bin: &std::path::Path) -> bool {
    if bin.is_absolute() {
        return bin.exists();
    }
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file())).unwrap_or(false)
}

/// Serialisable summary used by `plugin.list`.
#[derive(Debug, Serialize)]
pub struct PluginSummary {
    pub kind: &'static str,
    pub name: String,
    pub version: String,
    pub path: PathBuf,
}
