//! # instances — the lifecycle (docs/design/lifecycle.md is the contract)
//!
//! Create, start, stop and delete are ordered lists of steps, each durable before the next
//! side effect. One file per concern:
//!
//! | file | what |
//! |---|---|
//! | [`request`] | the API's request types and their validation (names, labels, limits) |
//! | [`inventory`] | the observing sequence (room `Observer`): the records read once, each device kind's observation (its backend's) assembled, what is known about profiles and GPU sizes |
//! | [`policy_calls`] | every plugin call: record → time → call → count → validate |
//! | [`claim`] | claim selection and creation, configure through the device's backend |
//! | [`release`] | **the** release path: every clear of every device kind |
//! | [`owners`] | claims of external owners (`claim.prepare/release/list/owners`) and their liveness rule |
//! | [`health`] | suspect and quarantine marks, strike accounting (room `Marks`), unquarantine |
//! | [`vmm`] | VMM liveness, spawn, stop and the kill-path accounting |
//! | [`vmm_ids`] | the uid/gid of its own every instance's VMM runs under |
//! | [`create`], [`start`], [`stop`], [`delete`], [`fork`], [`update`] | one operation each |
//! | [`power`] | reset in place and reboot (a stop, then a start) of a running VM |
//! | [`saves`] | saved VM states: snapshots (taken, listed, deleted, restored), standby and its resume |
//! | [`rollback`] | rollback and retention after a failed create or start |
//! | [`supervise`] | the restart policy and autostart: a VMM that died without a stop started again through start |
//! | [`layout`] | the instance directory (the agent's) and its VMM directory (the VMM's), and the move from the old layout |
//! | [`disk`] | boot modes, the disk overlay and UEFI variable store, image import and delete |
//! | [`seed`] | the cloud-init NoCloud seed (`seed.iso`) of an instance |
//! | [`nics`] | an instance's NICs on the host: bridges checked, taps opened right before the spawn |
//! | [`console_logs`] | the serial consoles (room `Consoles`): `serial.log` rotation, the serial relays of VMMs that serve their port on a socket |
//! | [`stats`] | `instance.stats`: a running VM's CPU, memory, disk and NIC counters |
//! | [`view`] | the read side: the operations that build the views ([`crate::wire`]) of get, list, gpus, resources, dry run, health, plugins |
//! | [`reconcile`] | observe → plan → act, through [`release`] for every clear |
//! | [`records`] | the store as the lifecycle writes it: the one place its durable changes (instance states, deletes, claims, health marks) are published as events |
//!
//! A **room** is what one concern needs of the manager and nothing else: `Observer`
//! (configuration, host, records read-only, the profile book), `Marks` (records, the
//! in-memory strike state) and `Consoles` (records, the relays) are reached through
//! `Manager::observer()`, `Manager::marks()` and `Manager::consoles()`, so their files'
//! `self` cannot touch a lock, a plugin or a VMM. The operations (create, start, stop,
//! delete, claim, release, reconcile, ...) still take the whole `Manager`.
//!
//! Locks, always taken in this order (a later one may be taken while an earlier one is
//! held, never the reverse): one lock **per instance** (held for a whole operation, so the
//! reconciler never acts on an instance mid-operation); the **allocation lock** (claim
//! selection + claim creation, the release path's claim re-read + removal; never held across
//! a sysfs write or a VM boot); the **configure lock** (the host-wide catalog read → type
//! write → read-back of docs/design/host.md §9, so two creates cannot both take the last slot);
//! one lock **per device** (the open-handle scan and the hardware write under the same
//! lock).
//!
//! Invariants kept here:
//! - **claim before use**: a device is configured, and a VMM referencing it spawned, only
//!   after the claim naming the instance is durable;
//! - **one owner**: claims are exclusive files (`store`);
//! - **never cleared under a live VM**: [`release`] is the only code that clears a device;
//!   it runs only once the owner is provably dead, re-reads the claim, and scans
//!   `/proc/*/fd` under the device lock right before the write;
//! - **never lose the only record**: a failed release keeps the claim (`release_pending`);
//! - **unknown is never clear**: an unreadable record or device blocks what it may own.

pub mod claim;
pub mod console_logs;
pub mod create;
pub mod delete;
pub mod disk;
pub mod fork;
pub mod health;
pub mod inventory;
pub mod layout;
pub mod nics;
pub mod owners;
pub mod policy_calls;
pub mod power;
pub mod reconcile;
pub mod records;
pub mod release;
pub mod request;
pub mod rollback;
pub mod saves;
pub mod seed;
pub mod start;
pub mod stats;
pub mod stop;
pub mod supervise;
pub mod update;
pub mod view;
pub mod vmm;
pub mod vmm_ids;

use crate::config::Config;
use crate::error::ApiError;
use crate::host::HostRoot;
use crate::metrics::Metrics;
use crate::policies::Policies;
use crate::store::{InstanceRecord, Store};
use crate::sync::lock;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use uuid::Uuid;

pub use request::CreateRequest;

/// Wall time now, RFC 3339 (seconds).
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// The lifecycle manager. All methods block (sysfs, /proc, QMP); the rpc layer calls them
/// from blocking threads.
pub struct Manager {
    cfg: Config,
    host: HostRoot,
    store: records::Records,
    /// The loaded plugins with their params and limits; swapped whole by `plugin.reload`.
    policies: RwLock<Arc<Policies>>,
    /// The config file the agent was started with (re-read by `plugin.reload`).
    config_path: Option<PathBuf>,
    alloc: Mutex<()>,
    configure: Mutex<()>,
    instance_locks: Mutex<HashMap<Uuid, Arc<Mutex<()>>>>,
    device_locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// What observations taught: profile names, type ids, GPU sizes; and what they found
    /// unreadable.
    book: inventory::ProfileBook,
    health: health::HealthState,
    reconciler: reconcile::ReconcileState,
    /// The last complete live list of each external owner kind (`claim.owners`).
    owners: owners::OwnersState,
    /// The startup reconcile pass had a complete observation (docs/design/invariants.md I13): until
    /// then new claims answer `not_ready` and nothing is released.
    ready: AtomicBool,
    metrics: Metrics,
    /// Each hypervisor as probed at start ([`Manager::probe_hypervisors`]); `None` before.
    hypervisor_probes: Mutex<Option<Vec<crate::wire::HypervisorView>>>,
    /// The console logs' rotation and the serial relays ([`console_logs`]).
    consoles: console_logs::Consoles,
    /// The restart supervisor's watches and due restarts.
    supervise: supervise::SuperviseState,
    /// The VMs' cgroups, once detected (`None` inside: none on this host).
    vm_cgroups: std::sync::OnceLock<Option<crate::host::cgroup::VmCgroups>>,
    /// The last input sent to each plugin slot (`plugin.reload`'s trial calls).
    last_policy_inputs: crate::policies::LastInputs,
}

impl Manager {
    /// Builds the manager: opens nothing on the host yet.
    pub fn new(cfg: Config, store: Store, policies: Policies) -> Manager {
        Manager::with_config_path(cfg, None, store, policies)
    }

    /// [`Manager::new`], remembering the config file for `plugin.reload`.
    pub fn with_config_path(cfg: Config, config_path: Option<PathBuf>, store: Store, policies: Policies) -> Manager {
        let host = HostRoot::new(&cfg.host_root);
        let book = inventory::ProfileBook::load(&store);
        let reconciler = reconcile::ReconcileState::load(&store, &host);
        let metrics = Metrics::new();
        let consoles = console_logs::Consoles::new(store.clone(), cfg.console_log_max_bytes);
        let store = records::Records::new(store);
        store.events().count_with(metrics.event_counter());
        policies.announce(&metrics);
        Manager {
            cfg,
            host,
            store,
            policies: RwLock::new(Arc::new(policies)),
            config_path,
            alloc: Mutex::new(()),
            configure: Mutex::new(()),
            instance_locks: Mutex::new(HashMap::new()),
            device_locks: Mutex::new(HashMap::new()),
            book,
            health: health::HealthState::default(),
            reconciler,
            owners: Default::default(),
            ready: AtomicBool::new(false),
            metrics,
            hypervisor_probes: Mutex::new(None),
            consoles,
            supervise: Default::default(),
            vm_cgroups: Default::default(),
            last_policy_inputs: Default::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The consoles: log rotation and serial relays.
    pub fn consoles(&self) -> &console_logs::Consoles {
        &self.consoles
    }

    /// The store, publishing what it makes durable ([`records`]).
    pub fn store(&self) -> &records::Records {
        &self.store
    }

    /// The host root.
    pub fn host(&self) -> &HostRoot {
        &self.host
    }

    /// Every counter and histogram.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The loaded plugins.
    pub fn policies(&self) -> Arc<Policies> {
        self.policies.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// `plugin.reload`: re-reads the config file (when the agent was started with one) and
    /// loads every slot again with its path, limits and params; all or nothing — any error
    /// refuses the reload and keeps the old plugins and params. With `trial`, each new
    /// plugin is first called on an input of its slot ([`crate::policies::ReloadParams`]);
    /// a failed call refuses the reload too. Calls in flight finish on the old ones (a
    /// reload never waits for them). Counters are keyed by plugin name and survive the
    /// reload.
    pub fn reload_plugins(
        &self,
        params: &crate::policies::ReloadParams,
    ) -> Result<crate::wire::ReloadResult, ApiError> {
        let mut cfg = self.cfg.clone();
        if let Some(path) = &self.config_path {
            let fresh = Config::load(path)
                .map_err(|e| ApiError::invalid_request(format!("plugin.reload refused, old plugins kept: {e:#}")))?;
            cfg.plugins = fresh.plugins;
            cfg.plugin_dir = fresh.plugin_dir;
        }
        let new = Policies::load(&cfg, self.cfg.claim_grace_s)
            .map_err(|e| ApiError::invalid_request(format!("plugin.reload refused, old plugins kept: {e:#}")))?;
        let trial = if params.trial || !params.inputs.is_empty() {
            new.trial(params, &self.last_policy_inputs)
                .map_err(|e| ApiError::invalid_request(format!("plugin.reload refused, old plugins kept: {e}")))?
        } else {
            Vec::new()
        };
        new.announce(&self.metrics);
        let result = crate::wire::ReloadResult { reloaded: true, plugins: new.names(), trial };
        *self.policies.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(new);
        tracing::info!(
            placement = %result.plugins.placement,
            hypervisor = %result.plugins.hypervisor,
            grace = %result.plugins.grace.as_deref().unwrap_or("-"),
            "plugins reloaded"
        );
        Ok(result)
    }

    fn instance_lock(&self, id: Uuid) -> Arc<Mutex<()>> {
        lock(&self.instance_locks).entry(id).or_default().clone()
    }

    fn forget_instance_lock(&self, id: Uuid) {
        lock(&self.instance_locks).remove(&id);
    }

    fn device_lock(&self, device: &str) -> Arc<Mutex<()>> {
        lock(&self.device_locks).entry(device.to_string()).or_default().clone()
    }

    /// The allocation lock (claim selection + creation; the release path's re-read and
    /// removal). Never held across a sysfs write or a VM boot.
    fn alloc(&self) -> MutexGuard<'_, ()> {
        lock(&self.alloc)
    }

    /// The host-wide configure lock: catalog read → type write / mdev create → read-back.
    fn configure_lock(&self) -> MutexGuard<'_, ()> {
        lock(&self.configure)
    }

    fn boot_id(&self) -> Result<String, ApiError> {
        self.host.boot_id().map_err(|e| ApiError::not_ready(format!("cannot read the host boot id: {e}")))
    }

    /// Resolves an instance by id or name (O(1): the name index, then one record).
    /// Errors: `invalid_request` for an empty or blank reference (it names nothing);
    /// `not_found`; an unreadable record answers `internal` with its path.
    pub fn find(&self, r: &str) -> Result<InstanceRecord, ApiError> {
        if r.trim().is_empty() {
            return Err(ApiError::invalid_request(
                "ref is empty: name an instance by its id or its name (gpuvisor ps lists them)",
            ));
        }
        let id = match Uuid::parse_str(r) {
            Ok(id) => id,
            // Only a valid name can name a file of the name index.
            Err(_) if request::check_instance_name(r).is_err() => return Err(ApiError::not_found(r)),
            Err(_) => self.store.name_owner(r)?.ok_or_else(|| ApiError::not_found(r))?,
        };
        match self.store.read_instance(id)? {
            Some(rec) if Uuid::parse_str(r).is_ok() || rec.name == r => Ok(rec),
            _ => Err(ApiError::not_found(r)),
        }
    }

    /// True once a reconcile pass had a complete observation.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// A reconcile pass had a complete observation: new claims are accepted from now on.
    fn mark_ready(&self) {
        if !self.ready.swap(true, Ordering::SeqCst) {
            tracing::info!("startup reconcile pass complete: accepting new claims");
        }
    }

    /// Refuses new claims until the startup pass is done (docs/design/invariants.md I13).
    fn require_ready(&self) -> Result<(), ApiError> {
        if self.is_ready() {
            Ok(())
        } else {
            Err(ApiError::not_ready("the agent has not finished its startup reconcile pass; retry shortly"))
        }
    }

    /// Runs an operation on the instance `r` names (id or name): finds it, runs `f`, and
    /// logs a failure once with the instance's id and name.
    fn on_instance<T>(
        &self,
        op: &str,
        r: &str,
        f: impl FnOnce(&InstanceRecord) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let rec = self.logged(op, Who::named(r), self.find(r))?;
        let res = f(&rec);
        self.logged(op, Who::of(&rec), res)
    }

    /// Logs a failed operation once, at WARN (or ERROR for server-side failures), with the
    /// instance's id and name when known, and passes the result on. Every public operation
    /// ends here (docs/design/lifecycle.md "Logs are part of the interface").
    fn logged<T>(&self, op: &str, who: Who<'_>, r: Result<T, ApiError>) -> Result<T, ApiError> {
        if let Err(e) = &r {
            let id = who.id.map(|i| i.to_string()).unwrap_or_else(|| "-".into());
            let name = who.name.unwrap_or("-");
            if e.code.class() >= 500 {
                tracing::error!(op = %op, instance.id = %id, instance.name = %name, code = %e.code.as_str(), error = %e.message, "operation failed");
            } else {
                tracing::warn!(op = %op, instance.id = %id, instance.name = %name, code = %e.code.as_str(), error = %e.message, "operation failed");
            }
        }
        r
    }
}

/// Which instance an operation is about, for its log line.
#[derive(Debug, Clone, Copy, Default)]
struct Who<'a> {
    id: Option<Uuid>,
    name: Option<&'a str>,
}

impl<'a> Who<'a> {
    fn of(rec: &'a InstanceRecord) -> Who<'a> {
        Who { id: Some(rec.id), name: Some(&rec.name) }
    }

    fn named(r: &'a str) -> Who<'a> {
        match Uuid::parse_str(r) {
            Ok(id) => Who { id: Some(id), name: None },
            Err(_) => Who { id: None, name: Some(r) },
        }
    }
}
