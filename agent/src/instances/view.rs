//! The read side: the operations that build the views the core returns (`instance.get`,
//! `instance.list`, `gpu.list`, `resources.get`, `placement.dry_run`, `agent.health`,
//! `plugin.list`, metrics); the view types themselves are in [`crate::wire`].
//!
//! Rule: a view never shows unknown as clear — a type that cannot be read is `"unknown"`
//! (never `0`), an unreadable record is listed as unreadable with its path and error, and
//! a VMM whose liveness cannot be decided is shown with `liveness: "unknown"` and why.

use super::inventory::Observation;
use super::Manager;
use crate::devices::observed::TypeReading;
use crate::devices::{vendor_vfio, HostMode};
use crate::error::ApiError;
use crate::host::proc::Liveness;
use crate::store::{Claim, ClaimState, Framework, InstanceRecord, InstanceState, Listing};
use crate::wire::*;
use std::collections::{BTreeMap, HashMap};

impl TypeValue {
    fn of(r: &TypeReading) -> TypeValue {
        match r {
            TypeReading::Id(i) => TypeValue::Id(*i),
            TypeReading::Unknown(_) => TypeValue::Unknown("unknown".into()),
        }
    }
}

/// How long `instance.get` waits for the VMM to report its VM state.
const VM_STATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

impl Manager {
    /// The sysfs path of a claimed device (its backend's view): the VF or GPU, or the mdev.
    pub(crate) fn device_path(&self, c: &Claim) -> String {
        let held = crate::devices::Held::of(c);
        crate::devices::backend(&c.kind).view(&self.host, &held).sysfs_path.display().to_string()
    }

    fn vmm_view(&self, rec: &InstanceRecord) -> Option<VmmView> {
        let v = rec.vmm.as_ref()?;
        let (liveness, reason) = match self.identity_liveness(v) {
            Liveness::Alive { .. } => ("alive", None),
            // Only a recorded identity that matches a live process now is shown: a recycled
            // pid is never reported as the VMM (docs/design/invariants.md I7).
            Liveness::Dead => return None,
            Liveness::MaybeAlive { reason } => ("unknown", Some(reason)),
        };
        Some(VmmView {
            pid: v.identity.pid,
            start_time: v.identity.start_time,
            boot_id: v.identity.boot_id.clone(),
            pid_namespace: v.identity.pid_ns,
            control_socket: v.control_socket.display().to_string(),
            liveness: liveness.into(),
            reason,
            vm_state: None,
            vm_state_error: None,
        })
    }

    /// The API view of an instance: the record plus `gpu` derived from its claim (and the
    /// VF's type now).
    pub(crate) fn view(&self, rec: &InstanceRecord, claims: &Listing<Claim>) -> InstanceView {
        let claim = claims
            .records
            .iter()
            .find(|c| c.owned_by(rec.id) || rec.gpu_resource_claim.as_ref().is_some_and(|rc| rc.is(&c.owner)));
        let unreadable = claims
            .unreadable
            .iter()
            .find(|u| u.owner == Some(rec.id) || (claim.is_none() && u.owner.is_none() && rec.wants_gpu()))
            .map(|u| format!("{}: {}", u.path.display(), u.error));
        let gpu = match (rec.wants_gpu(), claim, &unreadable) {
            (false, None, None) => None,
            _ => {
                let current = claim.filter(|c| c.kind.framework() == Framework::VendorVfio).map(|c| {
                    match vendor_vfio::read_current_type(&self.host, &c.device) {
                        Ok(t) => TypeReading::Id(t),
                        Err(e) => TypeReading::Unknown(e.to_string()),
                    }
                });
                let type_mismatch = match (claim, current.as_ref().and_then(|t| t.id())) {
                    (Some(c), Some(now))
                        if c.state == ClaimState::Configured && c.kind.type_id().is_some_and(|t| t != now) =>
                    {
                        Some(format!(
                            "the VF reads type {now}, not the claimed {}: another writer changed it under the VM",
                            c.kind.type_id().unwrap_or(0)
                        ))
                    }
                    _ => None,
                };
                Some(GpuAssignment {
                    profile: rec
                        .gpu_profile
                        .clone()
                        .or_else(|| rec.gpu_passthrough.as_ref().map(|_| super::inventory::PASSTHROUGH.to_string()))
                        .or_else(|| claim.map(|c| c.profile.clone())),
                    passthrough_address: rec.gpu_passthrough.as_ref().and_then(|w| w.address.clone()),
                    functions: claim
                        .and_then(|c| c.kind.passthrough())
                        .map(|pc| {
                            pc.functions
                                .iter()
                                .map(|f| FunctionView {
                                    bdf: f.bdf.clone(),
                                    driver: crate::devices::passthrough::driver_of(&self.host, &f.bdf)
                                        .unwrap_or_else(|_| Some("unreadable".into())),
                                    original_driver: f.original_driver.clone(),
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                    framework: rec.gpu_framework.or(claim.map(|c| c.kind.framework())),
                    device: claim.map(|c| c.device.clone()),
                    gpu: claim.map(|c| c.gpu.clone()),
                    device_path: claim.map(|c| self.device_path(c)),
                    mdev_uuid: claim.and_then(|c| c.kind.mdev_uuid()).map(|u| u.to_string()),
                    type_id: claim.and_then(|c| c.kind.type_id()),
                    current_type: current.as_ref().map(TypeValue::of),
                    claimed_at: claim.map(|c| c.claimed_at.clone()),
                    claim_state: claim.map(|c| c.state),
                    release_pending: claim.is_some_and(|c| c.state == ClaimState::ReleasePending)
                        || unreadable.is_some(),
                    last_error: claim.and_then(|c| c.last_error.clone()),
                    type_mismatch,
                    claim_unreadable: unreadable,
                })
            }
        };
        InstanceView {
            id: rec.id.to_string(),
            name: rec.name.clone(),
            image: rec.image.clone(),
            hypervisor: rec.hypervisor,
            vcpus: rec.vcpus,
            memory_mib: rec.memory_mib,
            labels: rec.labels.clone(),
            state: rec.state(),
            created_at: rec.created_at.clone(),
            last_error: rec.last_error.clone(),
            vmm: self.vmm_view(rec),
            serial_log: self.store.vmm_dir(rec.id).join(crate::hypervisor::SERIAL_LOG).display().to_string(),
            serial_log_rotated: self.store.instance_dir(rec.id).join(crate::console::ROTATED_LOG).display().to_string(),
            vmm_id: rec.vmm_id,
            console_socket: Some(
                rec.hypervisor
                    .driver()
                    .serial_port()
                    .console_socket(&self.store.vmm_dir(rec.id), &self.store.instance_dir(rec.id))
                    .display()
                    .to_string(),
            ),
            gpu,
            restart: rec.restart,
            autostart: rec.autostart,
            restarts: RestartView {
                attempts: rec.restarts.attempts_ms.len() as u32,
                last_attempt_unix_ms: rec.restarts.attempts_ms.last().copied(),
                due_unix_ms: rec.restarts.due_ms,
                gave_up: rec.restarts.gave_up,
            },
            warnings: vec![],
            released_device_quarantined: None,
            nics: rec
                .nics
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let mac = crate::network::mac_address(rec.id, i);
                    match n {
                        crate::network::Nic::User { forwards } => {
                            NicView { mode: "user".into(), forwards: forwards.clone(), bridge: None, mac, tap: None }
                        }
                        crate::network::Nic::Bridge { bridge } => NicView {
                            mode: "bridge".into(),
                            forwards: vec![],
                            bridge: Some(bridge.clone()),
                            mac,
                            tap: Some(crate::network::tap_name(rec.id, i)),
                        },
                    }
                })
                .collect(),
            seed: rec.wants_seed().then(|| SeedView {
                path: self.store.vmm_dir(rec.id).join(super::seed::SEED_FILE).display().to_string(),
                user_data_bytes: rec
                    .cloud_init
                    .as_ref()
                    .and_then(|c| c.user_data.as_ref())
                    .map_or(0, |u| u.len() as u64),
                network_config_bytes: rec
                    .cloud_init
                    .as_ref()
                    .and_then(|c| c.network_config.as_ref())
                    .map_or(0, |u| u.len() as u64),
            }),
            boot: rec.boot,
            disk: self.disk_view(rec),
        }
    }

    /// The disk part of the view: the overlay of an instance whose image has a disk (or that
    /// has an overlay, when the image is unreadable).
    fn disk_view(&self, rec: &InstanceRecord) -> Option<InstanceDiskView> {
        let overlay = self.store.vmm_dir(rec.id).join(super::disk::OVERLAY);
        let has_disk = overlay.exists()
            || crate::images::load(&self.store.images_dir(), &rec.image).is_ok_and(|i| i.disk.is_some());
        has_disk.then(|| InstanceDiskView {
            overlay: overlay.display().to_string(),
            exists: overlay.exists(),
            disk_gib: rec.disk_gib,
        })
    }

    /// The view of an instance after an operation that succeeded: claim records that cannot
    /// be listed must not turn the success into an error (the work is done); the view then
    /// carries `warnings`.
    pub(crate) fn view_after(&self, rec: &InstanceRecord) -> InstanceView {
        match self.store.scan_claims() {
            Ok(claims) => {
                let mut v = self.view(rec, &claims);
                for u in &claims.unreadable {
                    v.warnings.push(format!("the claim record {} cannot be read ({})", u.path.display(), u.error));
                }
                v
            }
            Err(e) => {
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, error = %e, "claim records cannot be listed; answering without them");
                let mut v = self.view(rec, &Listing::default());
                v.warnings.push(format!("the claim records cannot be listed ({e}); gpu fields are incomplete"));
                v
            }
        }
    }

    /// `instance.get`.
    pub fn get(&self, r: &str) -> Result<InstanceView, ApiError> {
        let rec = self.find(r)?;
        let mut view = self.view_after(&rec);
        if let Some(v) = view.vmm.as_mut().filter(|v| v.liveness == "alive") {
            let socket = std::path::Path::new(&v.control_socket);
            match rec.hypervisor.driver().vm_state(socket, VM_STATE_TIMEOUT) {
                Ok(state) => v.vm_state = Some(state),
                Err(e) => v.vm_state_error = Some(e.to_string()),
            }
        }
        Ok(view)
    }

    /// `instance.list`: every readable instance, and every record that cannot be read.
    pub fn list(&self) -> Result<InstanceList, ApiError> {
        let instances = self.store.scan_instances()?;
        let claims = self.store.scan_claims()?;
        Ok(InstanceList {
            instances: instances.records.iter().map(|r| self.view(r, &claims)).collect(),
            unreadable: instances.unreadable.iter().map(UnreadableRecord::from).collect(),
        })
    }

    /// A readable claim as `gpu.list` shows it (`names`: instance names the claims carry).
    fn claim_view(&self, c: &Claim, names: &HashMap<uuid::Uuid, String>) -> ClaimView {
        ClaimView {
            instance_id: c.owner.instance().map(|i| i.to_string()),
            instance_name: c.owner.instance().and_then(|id| {
                c.owner_name
                    .clone()
                    .or_else(|| names.get(&id).cloned())
                    .or_else(|| self.store.read_instance(id).ok().flatten().map(|r| r.name.clone()))
            }),
            owner: Some(c.owner.clone()),
            profile: Some(c.profile.clone()),
            type_id: c.kind.type_id(),
            mdev_uuid: c.kind.mdev_uuid().map(|u| u.to_string()),
            state: Some(c.state),
            last_error: c.last_error.clone(),
            unreadable: None,
        }
    }

    /// `gpu.list`: every GPU (managed or not) and device with its current type, claim
    /// owner, health mark and what could not be read.
    pub fn gpus(&self) -> Result<GpuList, ApiError> {
        let obs = self.observer().observe(None)?;
        let names: HashMap<uuid::Uuid, String> =
            obs.claims.records.iter().filter_map(|c| Some((c.owner.instance()?, c.owner_name.clone()?))).collect();
        let held = self.held_by_policy();
        let probe_error = obs.mode.as_ref().err().map(ToString::to_string);
        let gpus = obs
            .gpus
            .iter()
            .map(|g| GpuEntry {
                address: g.address.clone(),
                model: g.model.clone(),
                framebuffer_mib: g.framebuffer_mib,
                numa_node: g.numa_node.filter(|n| *n >= 0),
                claimed_framebuffer_mib: g.claimed_framebuffer_mib,
                managed: g.managed,
                health: g.health.as_ref().map(HealthMark::from),
                probe_error: probe_error.clone(),
                devices: g
                    .devices
                    .iter()
                    .map(|d| DeviceEntry {
                        address: d.address.clone(),
                        state: d.state.into(),
                        current_type: TypeValue::of(&d.current_type),
                        creatable: d.creatable.clone(),
                        claim: match (&d.claim, &d.claim_unreadable) {
                            (Some(c), _) => Some(self.claim_view(c, &names)),
                            (None, Some(u)) => Some(ClaimView {
                                instance_id: None,
                                instance_name: None,
                                owner: None,
                                profile: None,
                                type_id: None,
                                mdev_uuid: None,
                                state: None,
                                last_error: None,
                                unreadable: Some(u.clone()),
                            }),
                            (None, None) => None,
                        },
                        quarantine: d.health.as_ref().map(HealthMark::from),
                        held_by_policy: held.get(&d.address).cloned(),
                        unreadable: d.unreadable.clone(),
                        type_mismatch: d.type_mismatch.clone(),
                        catalog_skipped_lines: d.catalog_skipped.clone(),
                    })
                    .collect(),
                passthrough: g.passthrough.as_ref().map(|pt| {
                    let recorded = g.devices.first().and_then(|d| d.claim.as_ref()).and_then(|c| c.kind.passthrough());
                    let original = |bdf: &str| {
                        recorded
                            .and_then(|r| r.functions.iter().find(|f| f.bdf == bdf))
                            .and_then(|f| f.original_driver.clone())
                    };
                    PassthroughGroupView {
                        group: pt.read.as_ref().map(|r| r.group),
                        functions: pt
                            .read
                            .iter()
                            .flat_map(|r| &r.functions)
                            .map(|f| FunctionView {
                                bdf: f.bdf.clone(),
                                driver: f.driver.clone(),
                                original_driver: original(&f.bdf),
                            })
                            .collect(),
                        bridges: pt.read.as_ref().map(|r| r.bridges.clone()).unwrap_or_default(),
                        foreign: pt.read.as_ref().map(|r| r.foreign.clone()).unwrap_or_default(),
                        problem: pt.problem.clone(),
                    }
                }),
            })
            .collect();
        let unreadable_records =
            obs.claims.unreadable.iter().chain(&obs.health.unreadable).map(UnreadableRecord::from).collect();
        let unreadable_devices = obs
            .unreadable
            .iter()
            .map(|u| UnreadableDeviceView { address: u.address.clone(), gpu: u.gpu.clone(), reason: u.reason.clone() })
            .collect();
        Ok(GpuList { mode: obs.mode_name().to_string(), probe_error, gpus, unreadable_devices, unreadable_records })
    }

    /// `resources.get`: GPU mode, device counts and per-profile placeable counts (honest
    /// under the equal-size rule), every profile from one observation.
    pub fn resources(&self) -> Result<Resources, ApiError> {
        let obs = match self.observer().observe(None) {
            Ok(o) => o,
            Err(e) => {
                return Ok(Resources {
                    mode: "probe_error".into(),
                    ready: false,
                    error: Some(e.message),
                    devices: DeviceCounts::default(),
                    profiles: vec![],
                    passthrough: PassthroughCounts::default(),
                })
            }
        };
        Ok(self.resources_of(&obs))
    }

    /// How many vGPUs of `profile` GPU `g` can take now: its free devices listing the
    /// profile, capped by the slots left under the equal-size rule.
    fn placeable_on(&self, g: &crate::devices::observed::ObservedGpu, profile: &str) -> u64 {
        let listing = g
            .devices
            .iter()
            .filter(|d| {
                d.state == gpuvisor_sdk::DeviceState::Free
                    && d.creatable.iter().any(|c| c.eq_ignore_ascii_case(profile))
            })
            .count() as u64;
        listing.min(self.gpu_slots(g, profile))
    }

    pub(crate) fn resources_of(&self, obs: &Observation) -> Resources {
        use gpuvisor_sdk::DeviceState as S;
        let mut c = DeviceCounts::default();
        // Unreadable: every device whose state cannot be read — those of the managed GPUs'
        // device lists, and those the scan could not place on a GPU at all.
        let mut unreadable: std::collections::BTreeSet<String> = obs
            .unreadable
            .iter()
            .filter(|u| u.gpu.as_deref().is_none_or(|g| self.cfg.manages(g)))
            // An unreadable mdev counts as its parent (the device placement uses).
            .map(|u| u.parent.as_ref().unwrap_or(&u.address).to_ascii_lowercase())
            .collect();
        for (g, d) in obs.devices() {
            c.total += 1;
            // A device can be claimed and quarantined, or claimed and unreadable, at once:
            // those counts come from the facts, not from the one state shown.
            if d.health.as_ref().is_some_and(|h| h.quarantined) {
                c.quarantined += 1;
            }
            if d.unreadable.is_some() {
                unreadable.insert(d.address.to_ascii_lowercase());
            }
            c.catalog_skipped_lines += d.catalog_skipped.len() as u64;
            match d.state {
                S::Claimed => c.claimed += 1,
                // Only a device that can take at least one profile now is allocatable.
                S::Free if d.creatable.iter().any(|p| self.gpu_slots(g, p) > 0) => c.allocatable += 1,
                S::Free => {}
                S::Dirty => c.dirty += 1,
                S::Quarantined | S::Unreadable => {}
            }
        }
        c.unreadable = unreadable.len() as u64;
        // Profiles: every name seen; placeable per GPU = free VFs listing it, capped by the
        // slots left under the equal-size rule.
        let mut profiles = Vec::new();
        for (name, fb) in self.book.all() {
            let placeable = obs
                .gpus
                .iter()
                .filter(|g| g.managed && g.passthrough.is_none())
                .map(|g| self.placeable_on(g, &name))
                .sum();
            let type_id =
                if obs.mode == Ok(HostMode::VendorVfio) { self.observer().type_id_in(obs, &name) } else { None };
            profiles.push(ProfileCapacity { profile: name, type_id, framebuffer_mib: fb, placeable });
        }
        let mut pt = PassthroughCounts::default();
        for (_, d, p) in obs.passthrough() {
            pt.total += 1;
            if d.health.as_ref().is_some_and(|h| h.quarantined) {
                pt.quarantined += 1;
            }
            match d.state {
                S::Claimed => pt.claimed += 1,
                S::Free if p.problem.is_none() => pt.allocatable += 1,
                S::Free => pt.refused += 1,
                S::Dirty => pt.dirty += 1,
                S::Unreadable => pt.unreadable += 1,
                S::Quarantined => {}
            }
        }
        Resources {
            mode: obs.mode_name().to_string(),
            ready: matches!(obs.mode, Ok(HostMode::VendorVfio | HostMode::Mdev)),
            error: obs.mode.as_ref().err().map(ToString::to_string),
            devices: c,
            profiles,
            passthrough: pt,
        }
    }

    /// How many more vGPUs of `profile` the GPU `g` can take under the equal-size rule
    /// (its framebuffer over the profile's, less its active vGPUs); the number of free
    /// devices listing it when a size is unknown.
    fn gpu_slots(&self, g: &crate::devices::observed::ObservedGpu, profile: &str) -> u64 {
        use gpuvisor_sdk::DeviceState as S;
        let listing = g
            .devices
            .iter()
            .filter(|d| d.state == S::Free && d.creatable.iter().any(|c| c.eq_ignore_ascii_case(profile)))
            .count() as u64;
        if listing == 0 {
            return 0;
        }
        let active = g.devices.iter().filter(|d| matches!(d.state, S::Claimed | S::Dirty)).count() as u64;
        match (g.framebuffer_mib, self.book.profile_fb(profile)) {
            (Some(gfb), Some(pfb)) if pfb > 0 => (gfb / pfb).saturating_sub(active),
            _ => listing,
        }
    }

    /// `placement.dry_run`: what the placement plugin would pick for a profile now, after
    /// native validation. Claims nothing.
    pub fn dry_run(&self, p: super::request::DryRunParams) -> Result<DryRun, ApiError> {
        if let Some(n) = p.name.as_deref() {
            super::request::check_instance_name(n)?;
        }
        super::request::check_labels(&p.labels)?;
        let spec = super::request::GpuSpec {
            profile: p.profile.clone(),
            passthrough: p.passthrough,
            address: p.address,
            resource_claim: None,
        };
        let (profile, whole) = match super::request::GpuRequest::Spec(spec).want()? {
            super::request::GpuWant::Profile(x) => (self.observer().known_profile(&x)?, None),
            super::request::GpuWant::Passthrough { address } => {
                self.check_passthrough_address(address.as_deref())?;
                (super::inventory::PASSTHROUGH.to_string(), Some(crate::store::PassthroughWant { address }))
            }
            super::request::GpuWant::ResourceClaim(_) => {
                return Err(ApiError::invalid_request("a resource claim's device is prepared, not placed"))
            }
        };
        let name = p.name.unwrap_or_else(|| "dry-run".into());
        let ask = super::policy_calls::PlacementAsk {
            instance_id: uuid::Uuid::nil(),
            name: &name,
            labels: &p.labels,
            profile: &profile,
        };
        let _a = self.alloc();
        let (obs, framework) = self.observer().observe_candidates(&profile, whole.as_ref())?;
        let ranking = self.rank(&ask, framework, &obs)?;
        Ok(DryRun {
            profile,
            plugin: self.policies().placement.name().to_string(),
            ranked: ranking
                .candidates
                .iter()
                .map(|c| RankedDevice { device: c.device.clone(), gpu: c.gpu.clone(), dirty: c.dirty })
                .collect(),
            notes: ranking.notes.into_iter().chain(obs.notes).collect(),
        })
    }

    /// `agent.health`: liveness and readiness, and what is degraded.
    pub fn health(&self) -> HealthView {
        let mut problems = Vec::new();
        let mut store_readable = true;
        // Every record kind: an unreadable one blocks what it may own, so the agent is degraded
        // while any exists.
        for (what, listing) in [
            ("instance", self.store.scan_instances().map(|l| l.unreadable)),
            ("claim", self.store.scan_claims().map(|l| l.unreadable)),
            ("health", self.store.scan_health().map(|l| l.unreadable)),
            ("mdev", self.store.scan_mdevs().map(|l| l.unreadable)),
        ] {
            match listing {
                Ok(u) => problems.extend(
                    u.iter().map(|u| format!("{what} record {} cannot be read: {}", u.path.display(), u.error)),
                ),
                Err(e) => {
                    store_readable = false;
                    problems.push(format!("{what} records cannot be listed: {e}"));
                }
            }
        }
        let mode = crate::devices::scan(&self.host, &self.cfg.passthrough_gpus).mode;
        if let Err(e) = &mode {
            problems.push(format!("GPU framework probe failed: {e}"));
        }
        let ns = crate::host::proc::own_pid_namespace();
        let host_ns = ns == Some(crate::host::proc::INITIAL_PID_NS);
        if !host_ns {
            problems.push(format!(
                "the agent runs in PID namespace {}, not the host's: processes outside it are invisible to its scans",
                ns.map(|n| n.to_string()).unwrap_or_else(|| "unknown".into())
            ));
        }
        problems.extend(self.reconciler_problems());
        // The release guard's open-handle scan reads every process's fds and refuses every
        // release (`scan_incomplete`) while one cannot be read: say so before a release does.
        if let Err(e) = crate::host::proc::fd_tables_readable() {
            problems.push(format!(
                "the open-handle scan cannot read every process's fds ({e}): every device release is refused \
                 (scan_incomplete) until it can; see gpuvisor host check"
            ));
        }
        HealthView {
            live: true,
            ready: store_readable && mode.is_ok() && self.is_ready(),
            startup_reconcile_done: self.is_ready(),
            store_readable,
            gpu_mode: mode.map(|m| m.as_str().to_string()).unwrap_or_else(|_| "probe_error".into()),
            plugins_loaded: true,
            degraded: !problems.is_empty(),
            problems,
            pid_namespace: ns,
            host_pid_namespace: host_ns,
            build: crate::failpoints::BUILD.to_string(),
            hypervisors: self.hypervisor_views(),
        }
    }

    /// `plugin.list`.
    pub fn plugin_list(&self) -> PluginList {
        let p = self.policies();
        let mut plugins = Vec::new();
        for (slot, kind) in [
            ("placement", gpuvisor_sdk::PolicyKind::Placement),
            ("hypervisor", gpuvisor_sdk::PolicyKind::Hypervisor),
            ("grace", gpuvisor_sdk::PolicyKind::Grace),
        ] {
            if let Some(s) = p.slot(kind) {
                let (calls_ok, calls_failed) = self.metrics.policy_call_counts(s.name(), kind.as_str());
                let (log_lines_dropped, output_bytes_dropped) =
                    self.metrics.policy_dropped_counts(s.name(), kind.as_str());
                let stats = s.plugin.stats();
                let m = s.plugin.manifest();
                plugins.push(PluginView {
                    slot: slot.into(),
                    name: m.name.clone(),
                    version: m.version.clone(),
                    kinds: m.kinds.iter().map(|k| k.as_str().to_string()).collect(),
                    path: s.plugin.path().display().to_string(),
                    abi: s.plugin.abi_version(),
                    compiled: Some(s.plugin.cache_outcome().as_str().to_string()),
                    calls_ok,
                    calls_failed,
                    log_lines_dropped,
                    output_bytes_dropped,
                    calls_running: stats.calls_running,
                    calls_waiting: stats.calls_waiting,
                });
            }
        }
        PluginList { plugins }
    }

    /// Scrape-time gauges.
    pub fn gauges(&self) -> crate::metrics::Gauges {
        let mut g = crate::metrics::Gauges::default();
        let mut unreadable_records = 0;
        if let Ok(list) = self.store.scan_instances() {
            unreadable_records += list.unreadable.len() as i64;
            let mut by: BTreeMap<&'static str, i64> = InstanceState::ALL.iter().map(|s| (s.as_str(), 0)).collect();
            for i in &list.records {
                *by.entry(i.state().as_str()).or_default() += 1;
            }
            g.instances = by.into_iter().collect();
        }
        if let Ok(list) = self.store.scan_claims() {
            unreadable_records += list.unreadable.len() as i64;
            let mut by: BTreeMap<(&'static str, &'static str), i64> = BTreeMap::new();
            for fw in [Framework::VendorVfio, Framework::Mdev, Framework::Passthrough] {
                for st in ClaimState::ALL {
                    by.insert((fw.as_str(), st.as_str()), 0);
                }
            }
            for c in &list.records {
                *by.entry((c.kind.framework().as_str(), c.state.as_str())).or_default() += 1;
                if c.state == ClaimState::ReleasePending {
                    g.retained += 1;
                }
            }
            g.claims = by.into_iter().map(|((f, s), n)| (f, s, n)).collect();
        }
        if let Ok(h) = self.store.scan_health() {
            unreadable_records += h.unreadable.len() as i64;
            g.quarantined = h.records.iter().filter(|r| r.quarantined).count() as i64 + h.unreadable.len() as i64;
        }
        g.unreadable_records = unreadable_records;
        g.held_by_policy = self.held_by_policy().len() as i64;
        if let Ok(obs) = self.observer().observe(None) {
            let counts = self.resources_of(&obs).devices;
            g.unreadable_devices = counts.unreadable as i64;
            g.catalog_skipped_lines = counts.catalog_skipped_lines as i64;
            g.type_mismatches = obs.devices().filter(|(_, d)| d.type_mismatch.is_some()).count() as i64;
            let claims = self.store.scan_claims().map(|c| c.records).unwrap_or_default();
            let book = self.book.all();
            for gpu in obs.gpus.iter().filter(|g| g.managed && g.passthrough.is_none()) {
                for (profile, _) in &book {
                    g.placeable.push((gpu.address.clone(), profile.clone(), self.placeable_on(gpu, profile) as i64));
                }
                let fb: u64 = claims
                    .iter()
                    .filter(|c| c.gpu.eq_ignore_ascii_case(&gpu.address))
                    .filter_map(|c| {
                        book.iter().find(|(p, _)| p.eq_ignore_ascii_case(&c.profile)).and_then(|(_, fb)| *fb)
                    })
                    .sum();
                g.claimed_framebuffer_mib.push((gpu.address.clone(), fb as i64));
            }
        }
        g
    }

    /// `agent.metrics`: the Prometheus text exposition.
    pub fn metrics_text(&self) -> String {
        self.metrics.render(&self.gauges())
    }

    /// `debug.failpoints`.
    pub fn failpoints(&self) -> FailpointList {
        FailpointList { build: crate::failpoints::BUILD.to_string(), failpoints: crate::failpoints::pause_status() }
    }
}

// The wire's view of a record the store could not read (here: `wire` names no store type).
impl From<&crate::store::Unreadable> for UnreadableRecord {
    fn from(u: &crate::store::Unreadable) -> Self {
        UnreadableRecord { path: u.path.display().to_string(), key: u.key.clone(), error: u.error.clone() }
    }
}
