//! # The reconciler (docs/design/lifecycle.md "Reconciler")
//!
//! One pass: observe → plan → act.
//! 1. **Observe**: every instance, claim and health record (tolerantly: an unreadable
//!    record blocks what it may own and is reported) and the host's devices. A store
//!    directory that cannot be listed makes the inventory incomplete: the pass counts
//!    `reconcile_failures_total{stage="inventory"}`, skips stale-claim releases and the
//!    vendor-VFIO sweep, and still runs the mdev sweep limited to gpuvisor's own old, idle
//!    mdevs. A host that cannot be observed completely (a probe error) makes the pass
//!    release and sweep nothing (`stage="host"`). Nothing is released until a pass had a
//!    complete observation (docs/design/invariants.md I13).
//! 2. **Records**: an instance recorded `starting`/`running`/`stopping` whose VMM is provably
//!    dead and which no operation holds moves to `stopped` (`last_error` says why; logged at
//!    WARN); a live control-socket owner that is not the recorded identity is recorded as
//!    the instance's VMM; a VMM recorded in another PID namespace is *maybe alive* and
//!    reported.
//! 3. **Claims vs. hardware**: a claimed VF whose type differs from its claim under a live
//!    VM is quarantined (`foreign_write`) and reported, never repaired.
//! 4. **Stale claims**: under the instance lock (instances mid-operation are skipped),
//!    maybe alive → kept; provably dead or absent owner → *eligible*. An external owner's
//!    claim (`owners.rs`) is eligible when the owner is provably done (absent from a
//!    complete, fresh `claim.owners` list) and no `claim.prepare`/`claim.release` works on
//!    the device.
//! 5. **Orphan sweep** (managed GPUs only): dirty VFs with no claim, and mdevs gpuvisor
//!    recorded but no claim names, that are not held open, are eligible.
//! 6. The `grace` plugin decides which eligible items are released now; each release goes
//!    through the release path, and the report counts what was actually done.

use super::release::{scan, Release, Released};
use super::supervise::Death;
use super::vmm::Dead;
use super::Manager;
use crate::devices::{mdev, vendor_vfio, DeviceError};
use crate::events::EventKind;
use crate::host::proc::{self, HandleScan, Liveness};
use crate::host::HostRoot;
use crate::metrics::{PassStage, StaleResult};
use crate::store::{Claim, Framework, InstanceRecord, InstanceState, MdevRecord, Store, VmmRecord};
use crate::sync::lock;
use crate::wire::{DeletedItem, FailedItem, PassReport, RecordChange, ReleasedItem};
use gpuvisor_sdk::{GraceAction, GraceItem, GraceItemKind, GraceOwner};
use serde_json::json;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The reconciler's own state.
pub struct ReconcileState {
    /// Serialises passes.
    pass: Mutex<()>,
    /// Orphan device → CLOCK_BOOTTIME ms when a pass first saw it dirty/unclaimed
    /// (persisted with the boot id in `<data-dir>/orphans.json`).
    orphan_seen: Mutex<HashMap<String, u64>>,
    orphans_path: PathBuf,
    /// Devices an eligible item of which the grace plugin has kept longer than
    /// `claim_grace_s` + one reconcile interval, with the plugin's reason (docs/plugins.md
    /// "grace": reported as `held_by_policy`). Rebuilt by every pass.
    held_by_policy: Mutex<BTreeMap<String, String>>,
    /// A pass had a complete observation: releases are allowed from now on.
    observed: AtomicBool,
    /// Instances whose VMM was recorded in another PID namespace (reported once each).
    foreign_namespace: Mutex<BTreeMap<Uuid, String>>,
}

impl ReconcileState {
    /// Loads the orphan first-seen times (they survive a restart within the same boot).
    pub fn load(store: &Store, host: &HostRoot) -> ReconcileState {
        let orphans_path = store.root().join("orphans.json");
        let orphan_seen: HashMap<String, u64> = std::fs::read(&orphans_path)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .filter(|v| host.boot_id().ok().as_deref() == v["boot_id"].as_str())
            .and_then(|v| serde_json::from_value(v["seen_boottime_ms"].clone()).ok())
            .unwrap_or_default();
        ReconcileState {
            pass: Mutex::new(()),
            orphan_seen: Mutex::new(orphan_seen),
            orphans_path,
            held_by_policy: Mutex::new(BTreeMap::new()),
            observed: AtomicBool::new(false),
            foreign_namespace: Mutex::new(BTreeMap::new()),
        }
    }
}

/// An eligible item with what its release needs.
enum Eligible {
    Claim(Box<Claim>),
    OrphanVf { vf: String, gpu: String, type_id: u32 },
    OrphanMdev(MdevRecord),
}

impl Eligible {
    fn device(&self) -> String {
        match self {
            Eligible::Claim(c) => c.device.clone(),
            Eligible::OrphanVf { vf, .. } => vf.clone(),
            Eligible::OrphanMdev(m) => m.uuid.to_string(),
        }
    }
}

impl Manager {
    /// True once a pass had a complete observation (releases are allowed).
    pub(crate) fn startup_observed(&self) -> bool {
        self.reconciler.observed.load(Ordering::SeqCst)
    }

    /// Devices the grace plugin holds past `claim_grace_s` + one interval, with its reason.
    pub fn held_by_policy(&self) -> BTreeMap<String, String> {
        lock(&self.reconciler.held_by_policy).clone()
    }

    /// What the reconciler knows is degraded (for `agent.health`).
    pub(crate) fn reconciler_problems(&self) -> Vec<String> {
        lock(&self.reconciler.foreign_namespace).iter().map(|(id, why)| format!("instance {id}: {why}")).collect()
    }

    fn persist_orphan_seen(&self) {
        let Ok(boot_id) = self.host().boot_id() else { return };
        let seen = lock(&self.reconciler.orphan_seen).clone();
        let doc = json!({ "boot_id": boot_id, "seen_boottime_ms": seen });
        if let Err(e) = crate::store::write_json_atomic(&self.reconciler.orphans_path, &doc) {
            tracing::warn!(error = %e, "cannot persist orphan first-seen times");
        }
    }

    /// At start, before the first pass and before any call is served: removes what
    /// operations killed midway left that no record owns ([`crate::store::Leftover`]: an
    /// instance directory without a record, a stale name entry, temp files of atomic
    /// writes, the staging copy of an image import), each named in a WARN. An instance
    /// directory whose control socket a live process owns is kept (and said so). Returns
    /// what was removed.
    pub fn remove_leftovers(&self) -> Vec<String> {
        let leftovers = match self.store().leftovers() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for what interrupted operations left");
                return Vec::new();
            }
        };
        let boot_id = self.host().boot_id().ok();
        let mut removed = Vec::new();
        for l in leftovers {
            if let crate::store::Leftover::InstanceDir(id) = &l {
                let dead = boot_id.as_deref().is_some_and(|b| self.prove_dead(*id, None, b).is_ok());
                if !dead {
                    tracing::warn!(instance.id = %id, "kept an instance directory without a record: its VMM is not provably dead");
                    continue;
                }
            }
            match self.store().remove_leftover(&l) {
                Ok(()) => {
                    tracing::warn!(leftover = %l, "removed what an interrupted operation left (no record owns it)");
                    removed.push(l.to_string());
                }
                Err(e) => tracing::warn!(leftover = %l, error = %e, "cannot remove what an interrupted operation left"),
            }
        }
        // Saves a kill interrupted: their partial files, and a VM left paused by them.
        match self.store().list_instances() {
            Ok(records) => {
                self.sweep_saved_states(&records);
                self.resume_interrupted_saves(&records);
            }
            Err(e) => tracing::warn!(error = %e, "cannot look for what interrupted saves left"),
        }
        removed
    }

    /// Runs one reconcile pass now. Never fails: problems are in the report and counted.
    /// The first pass with a complete observation makes the agent ready (I13). Passes never
    /// overlap: a `reconcile.run` during the periodic pass waits for it.
    pub fn reconcile(&self) -> PassReport {
        let _pass = lock(&self.reconciler.pass);
        let started = Instant::now();
        let mut report = PassReport::default();
        let boot_id = match self.host().boot_id() {
            Ok(b) => b,
            Err(e) => {
                report.fail(PassStage::Host, format!("cannot read the host boot id: {e}"));
                return self.end_pass(report, started);
            }
        };
        let instances = self.store().scan_instances();
        let obs = self.observer().observe(None);
        match (&instances, &obs) {
            (Ok(instances), Ok(obs)) => {
                report.inventory_complete = true;
                report.host_complete = obs.mode.is_ok();
                for u in instances.unreadable.iter().chain(&obs.claims.unreadable).chain(&obs.health.unreadable) {
                    report.fail(
                        PassStage::Inventory,
                        format!("record {} cannot be read ({}): what it may own is kept", u.path.display(), u.error),
                    );
                }
                if report.host_complete && !self.reconciler.observed.swap(true, Ordering::SeqCst) {
                    tracing::info!("first complete observation: releases allowed");
                }
                self.reconcile_records(&instances.records, &obs.claims.records, &boot_id, &mut report);
                // The cgroups of instances that are gone (an interrupted delete); an unreadable
                // record keeps its cgroup.
                if let (Some(cg), true) = (self.vm_cgroups(), instances.unreadable.is_empty()) {
                    cg.sweep(|id| instances.records.iter().any(|r| r.id == id));
                }
                self.sweep_taps(&instances.records, instances.unreadable.is_empty(), &boot_id, &mut report);
                if report.host_complete {
                    self.check_claimed_types(obs, &boot_id, &mut report);
                    let mut eligible = self.stale_claims(&obs.claims.records, &boot_id, &mut report);
                    eligible.extend(self.orphan_vfs(obs, &mut report));
                    eligible.extend(self.orphan_mdevs(Some(obs), false, &boot_id, &mut report));
                    self.decide_and_release(eligible, &boot_id, &mut report);
                    self.finish_deletes(&boot_id, &mut report);
                } else {
                    let why = obs.mode.as_ref().err().map(ToString::to_string).unwrap_or_default();
                    report.fail(
                        PassStage::Host,
                        format!(
                            "the host cannot be observed completely ({why}): nothing is released or swept this pass"
                        ),
                    );
                }
            }
            _ => {
                let e = instances.err().map(|e| e.to_string()).or(obs.err().map(|e| e.message)).unwrap_or_default();
                tracing::error!(error = %e, "reconcile: the store cannot be listed completely; releasing nothing on its behalf");
                report.fail(PassStage::Inventory, format!("inventory incomplete: {e}"));
                // Only gpuvisor's own, old, idle mdevs (their holders protect live VMs).
                if self.startup_observed() && crate::devices::scan(self.host(), &self.cfg.passthrough_gpus).complete() {
                    let eligible = self.orphan_mdevs(None, true, &boot_id, &mut report);
                    self.decide_and_release(eligible, &boot_id, &mut report);
                }
            }
        }
        let complete = report.inventory_complete && report.host_complete;
        if complete {
            self.mark_ready();
        }
        self.end_pass(report, started)
    }

    fn end_pass(&self, mut report: PassReport, started: Instant) -> PassReport {
        let complete = report.inventory_complete && report.host_complete;
        self.metrics().reconcile_run(complete);
        for stage in &report.failed_stages {
            self.metrics().reconcile_failure(*stage);
        }
        report.duration_ms = started.elapsed().as_millis() as u64;
        self.store().events().publish(EventKind::ReconcilePass {
            complete,
            duration_ms: report.duration_ms,
            released: report.released.len(),
            kept: report.kept.len(),
            failed: report.failed.len(),
            records: report.records.len(),
            errors: report.errors.len(),
        });
        let msg = "reconcile pass done";
        if complete {
            tracing::info!(
                duration_ms = report.duration_ms,
                released = report.released.len(),
                kept = report.kept.len(),
                failed = report.failed.len(),
                complete,
                "{msg}"
            );
        } else {
            tracing::warn!(duration_ms = report.duration_ms, released = report.released.len(), kept = report.kept.len(),
                failed = report.failed.len(), complete, errors = %report.errors.join("; "), "{msg}");
        }
        report
    }

    /// Interrupted deletes (a `deleting` record no operation holds, its VMM provably dead,
    /// no claim naming it — its device was released, by this pass or an earlier one) are
    /// finished: the record and its directory are removed. Nothing is removed while any
    /// claim record cannot be read (it may be this instance's).
    fn finish_deletes(&self, boot_id: &str, report: &mut PassReport) {
        let (Ok(instances), Ok(claims)) = (self.store().scan_instances(), self.store().scan_claims()) else { return };
        if !claims.unreadable.is_empty() {
            return;
        }
        for rec in instances.records.iter().filter(|r| r.state() == InstanceState::Deleting) {
            let ilock = self.instance_lock(rec.id);
            let Ok(_i) = ilock.try_lock() else { continue };
            let Ok(Some(rec)) = self.store().read_instance(rec.id) else { continue };
            if rec.state() != InstanceState::Deleting
                || claims.records.iter().any(|c| c.owned_by(rec.id))
                || !matches!(self.liveness_at(&rec, boot_id), Liveness::Dead)
            {
                continue;
            }
            match self.store().remove_instance(rec.id) {
                Ok(()) => {
                    self.forget_instance_lock(rec.id);
                    tracing::info!(instance.id = %rec.id, instance.name = %rec.name,
                        "interrupted delete finished by the reconciler");
                    report.deleted.push(DeletedItem { instance: rec.id.to_string(), name: rec.name.clone() });
                }
                Err(e) => report.fail(PassStage::Records, format!("cannot finish the delete of {}: {e}", rec.name)),
            }
        }
    }

    /// Step 2: records whose VMM is provably dead move to `stopped`; a live control-socket
    /// owner that is not the recorded identity is recorded; a `stopping` record whose VMM
    /// still runs (a stop interrupted by an agent restart) moves back to `running`.
    fn reconcile_records(
        &self,
        instances: &[InstanceRecord],
        claims: &[Claim],
        boot_id: &str,
        report: &mut PassReport,
    ) {
        for rec in instances {
            if rec.state() == InstanceState::Stopped || (rec.state() == InstanceState::Standby && rec.vmm.is_none()) {
                self.stop_unrecorded_vmm(rec, boot_id, report);
                continue;
            }
            if rec.state() == InstanceState::Standby {
                self.finish_standby(rec, report);
                continue;
            }
            if !matches!(rec.state(), InstanceState::Starting | InstanceState::Running | InstanceState::Stopping) {
                continue;
            }
            // Between the pass's snapshot and the instance lock (a race test pauses here).
            crate::crash_point!("reconcile_records_before_lock");
            let ilock = self.instance_lock(rec.id);
            let Ok(_i) = ilock.try_lock() else {
                report.keep_instance(rec.id, "operation in progress");
                continue;
            };
            let Ok(Some(mut rec)) = self.store().read_instance(rec.id) else { continue };
            let from = rec.state();
            // Read again under the lock: the exit watcher may have recorded the death since
            // the pass's snapshot (recording it twice logged two deaths and overwrote the
            // exit status with a wrong reason).
            if !matches!(from, InstanceState::Starting | InstanceState::Running | InstanceState::Stopping) {
                continue;
            }
            match self.liveness_at(&rec, boot_id) {
                Liveness::Dead if rec.vmm.is_none() && self.young_claim(rec.id, claims, boot_id) => {
                    // A crash between claim and spawn (or before the identity was
                    // persisted): protected while its claim is younger than claim_grace in
                    // this boot; the grace plugin decides about the claim.
                    report.keep_instance(rec.id, "starting without a recorded VMM; claim younger than claim_grace");
                }
                Liveness::Dead => {
                    let rebooted = rec.vmm.as_ref().is_some_and(|v| v.identity.boot_id != boot_id);
                    let reason = match &rec.vmm {
                        Some(_) if rebooted => "the host rebooted".to_string(),
                        Some(_) => "the VMM exited".to_string(),
                        None => format!("the agent restarted while the instance was {from}"),
                    };
                    // The restart policy (and autostart after a reboot) decides what comes next.
                    let death = if rebooted { Death::Reboot } else { Death::Failed };
                    match self.record_vmm_death(&mut rec, reason.clone(), death) {
                        Ok(()) => report.records.push(RecordChange {
                            instance: rec.id.to_string(),
                            name: rec.name.clone(),
                            from,
                            to: InstanceState::Stopped,
                            reason,
                        }),
                        Err(e) => report.fail(PassStage::Records, e),
                    }
                }
                Liveness::Alive { pid } => self.record_live_vmm(rec, pid, boot_id, report),
                Liveness::MaybeAlive { reason } => {
                    if let Some(why) = rec.vmm.as_ref().and_then(|v| proc::foreign_namespace(&v.identity)) {
                        let mut seen = lock(&self.reconciler.foreign_namespace);
                        if seen.insert(rec.id, why.clone()).is_none() {
                            tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, reason = %why,
                                "the VM's process cannot be seen from this agent: nothing of it is signalled or released");
                        }
                    }
                    report.keep_instance(rec.id, format!("maybe alive: {reason}"));
                }
            }
        }
    }

    /// A `stopped` record whose control socket a live process owns: a VMM spawned but never
    /// recorded (the agent died in a create or start, and the VMM — slow to come up — only
    /// listened after the pass that recorded the instance stopped). Nothing acknowledged it,
    /// and it may hold a device its claim no longer protects: it is stopped through the kill
    /// path (confirmed by its ownership of the socket), so its claim can be released and the
    /// instance started or deleted again. Only records whose control socket file exists are
    /// looked at (a stat; the `/proc` scan only when a listener is bound there).
    fn stop_unrecorded_vmm(&self, rec: &InstanceRecord, boot_id: &str, report: &mut PassReport) {
        if rec.vmm.is_some() || !self.control_socket(rec).exists() {
            return;
        }
        let Liveness::Alive { pid } = self.liveness_at(rec, boot_id) else { return };
        let ilock = self.instance_lock(rec.id);
        let Ok(_i) = ilock.try_lock() else {
            report.keep_instance(rec.id, "operation in progress");
            return;
        };
        let Ok(Some(mut rec)) = self.store().read_instance(rec.id) else { return };
        let from = rec.state();
        if !matches!(from, InstanceState::Stopped | InstanceState::Standby) || rec.vmm.is_some() {
            return;
        }
        let reason = format!(
            "a VMM (pid {pid}) no record names owned its control socket (spawned before the agent restarted): \
             stopped through the kill path"
        );
        tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, pid, "{reason}");
        match self.stop_vmm(&rec, false) {
            Ok(_) => {
                rec.last_error = Some(reason.clone());
                if let Err(e) = self.store().write_instance(&rec) {
                    report.fail(PassStage::Records, format!("cannot record the stop of {}: {e}", rec.name));
                }
                report.records.push(RecordChange {
                    instance: rec.id.to_string(),
                    name: rec.name.clone(),
                    from,
                    to: from,
                    reason,
                });
            }
            Err(e) => {
                tracing::error!(instance.id = %rec.id, instance.name = %rec.name, pid, error = %e.message,
                    "the unrecorded VMM could not be stopped");
                report.keep_instance(rec.id, format!("an unrecorded VMM {pid} could not be stopped: {}", e.message));
            }
        }
    }

    /// A `standby` record that still names its VMM: the agent was killed between recording
    /// the standby and the kill path, or that kill path failed (the VM's state is saved; its
    /// VMM waits paused). The VMM is stopped through the kill path and forgotten; the standby
    /// stays.
    fn finish_standby(&self, rec: &InstanceRecord, report: &mut PassReport) {
        let ilock = self.instance_lock(rec.id);
        let Ok(_i) = ilock.try_lock() else {
            report.keep_instance(rec.id, "operation in progress");
            return;
        };
        let Ok(Some(mut rec)) = self.store().read_instance(rec.id) else { return };
        if rec.state() != InstanceState::Standby || rec.vmm.is_none() {
            return;
        }
        match self.stop_vmm(&rec, false) {
            Ok(_) => {
                self.remove_taps(&rec);
                rec.vmm = None;
                let reason = "the standby's VMM was still running (the agent restarted, or its kill path failed): \
                              stopped through the kill path";
                if let Err(e) = self.store().write_instance(&rec) {
                    report.fail(PassStage::Records, format!("cannot record the standby of {}: {e}", rec.name));
                    return;
                }
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, "{reason}");
                report.records.push(RecordChange {
                    instance: rec.id.to_string(),
                    name: rec.name.clone(),
                    from: InstanceState::Standby,
                    to: InstanceState::Standby,
                    reason: reason.to_string(),
                });
            }
            Err(e) => report.keep_instance(rec.id, format!("the standby's VMM could not be stopped: {}", e.message)),
        }
    }

    /// A live VMM (the recorded identity, or the control-socket owner `pid`): record the
    /// owner's identity when the recorded one is not it (a crash between spawn and
    /// persisting it, or a recorded pid now used by another process); `starting` and an
    /// interrupted `stopping` move to `running`.
    fn record_live_vmm(&self, mut rec: InstanceRecord, pid: i32, boot_id: &str, report: &mut PassReport) {
        let from = rec.state();
        let recorded_alive =
            rec.vmm.as_ref().is_some_and(|v| matches!(self.identity_liveness(v), Liveness::Alive { .. }));
        let mut reasons = Vec::new();
        if !recorded_alive {
            match proc::identity_of(pid, boot_id) {
                Ok(Some(identity)) => {
                    let control_socket = self.control_socket(&rec);
                    reasons.push(match &rec.vmm {
                        Some(v) => format!(
                            "the recorded VMM pid {} is not the VM's process; recorded the control socket owner {pid}",
                            v.identity.pid
                        ),
                        None => format!("recorded the identity of the control socket owner {pid}"),
                    });
                    rec.vmm = Some(VmmRecord { identity, control_socket, booted: None });
                }
                Ok(None) => return,
                Err(e) => {
                    report.keep_instance(rec.id, format!("the control socket owner {pid} cannot be read: {e}"));
                    return;
                }
            }
        }
        match from {
            InstanceState::Stopping => {
                // A stop interrupted by an agent restart (no operation holds the instance:
                // its lock is ours). The stop was never acknowledged and the VMM still runs:
                // say so, instead of a `stopping` that never ends (I8).
                let why = format!("the agent restarted during a stop; the VMM {pid} still runs: stop again");
                rec.last_error = Some(why.clone());
                reasons.push(why);
            }
            InstanceState::Starting => reasons.push(format!("the VMM {pid} runs")),
            _ => {}
        }
        if reasons.is_empty() {
            return;
        }
        if rec.transition(InstanceState::Running).is_err() {
            return;
        }
        let reason = reasons.join("; ");
        match self.store().write_instance(&rec) {
            Ok(()) => {
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, pid, reason = %reason, "recorded the live VMM");
                report.records.push(RecordChange {
                    instance: rec.id.to_string(),
                    name: rec.name.clone(),
                    from,
                    to: InstanceState::Running,
                    reason,
                })
            }
            Err(e) => report.fail(PassStage::Records, format!("cannot record the VMM of {}: {e}", rec.name)),
        }
    }

    /// After the reconciler released an instance's retained claim, its record no longer
    /// says "GPU release pending" (the owner's instance lock is held by the caller).
    fn clear_release_pending_note(&self, id: Uuid) {
        if let Ok(Some(mut rec)) = self.store().read_instance(id) {
            if rec.last_error.as_deref().is_some_and(|e| e.starts_with("GPU release pending")) {
                rec.last_error = None;
                if let Err(e) = self.store().write_instance(&rec) {
                    tracing::warn!(instance.id = %id, instance.name = %rec.name, error = %e, "cannot clear the release-pending note");
                }
            }
        }
    }

    /// True when the instance has a claim made in this boot that is younger than
    /// `claim_grace_s` (measured on CLOCK_BOOTTIME).
    fn young_claim(&self, id: Uuid, claims: &[Claim], boot_id: &str) -> bool {
        let now = proc::boottime_ms();
        claims.iter().any(|c| {
            c.owned_by(id)
                && c.claim_boot_id == boot_id
                && now.saturating_sub(c.claimed_boottime_ms) < self.config().claim_grace_s.saturating_mul(1000)
        })
    }

    /// Step 3: a claimed VF whose type differs from its claim while its owner lives is
    /// quarantined and reported — never repaired (the release path refuses it too).
    fn check_claimed_types(&self, obs: &super::inventory::Observation, boot_id: &str, report: &mut PassReport) {
        for (_, d) in obs.devices() {
            let (Some(m), Some(c)) = (&d.type_mismatch, &d.claim) else { continue };
            if self.prove_owner_done(c, boot_id).is_ok() {
                continue; // the release path handles a dead owner's foreign type
            }
            if !d.health.as_ref().is_some_and(|h| h.quarantined) {
                self.marks().quarantine(&d.address, "foreign_write", &format!("{m} (found under a live VM)"));
            }
            report.keep_device(&d.address, format!("type mismatch under a live VM: {m}"));
        }
    }

    /// Step 4: claims whose owner is provably dead or absent are eligible.
    fn stale_claims(&self, claims: &[Claim], boot_id: &str, report: &mut PassReport) -> Vec<(Eligible, GraceItem)> {
        let mut out = Vec::new();
        let now = proc::boottime_ms();
        for claim in claims {
            // An external owner: eligible when provably done (absent from a fresh,
            // complete live list); no instance lock or record is involved.
            let Some(owner_id) = claim.owner.instance() else {
                let Some(e) = claim.owner.external() else { continue };
                if let Err(l) = self.prove_external_done(e) {
                    report.keep_device(&claim.device, format!("owner {}: {l}", claim.owner));
                    continue;
                }
                out.push((Eligible::Claim(Box::new(claim.clone())), stale_item(claim, None, boot_id, now)));
                continue;
            };
            let ilock = self.instance_lock(owner_id);
            let Ok(_i) = ilock.try_lock() else {
                report.keep_device(&claim.device, "owner operation in progress");
                continue;
            };
            let owner = match self.store().read_instance(owner_id) {
                Ok(o) => o,
                Err(e) => {
                    report.keep_device(&claim.device, format!("owner record unreadable: {e}"));
                    continue;
                }
            };
            match self.prove_dead(owner_id, owner.as_ref(), boot_id) {
                Ok(_) => {}
                Err(Liveness::Alive { pid }) => {
                    report.keep_device(&claim.device, format!("owner VMM {pid} is alive"));
                    continue;
                }
                Err(l) => {
                    report.keep_device(&claim.device, format!("owner {l}"));
                    continue;
                }
            }
            // A running record is handled by step 2 first; one still `running` here was
            // changed concurrently: leave it to the next pass.
            if owner.as_ref().is_some_and(|o| o.state() == InstanceState::Running) {
                report.keep_device(&claim.device, "owner recorded running");
                continue;
            }
            let grace_owner = owner.as_ref().map(|o| GraceOwner {
                instance_id: o.id.to_string(),
                state: o.state().as_str().to_string(),
                labels: o.labels.clone(),
                vmm_identity_recorded: o.vmm.is_some(),
            });
            let item = stale_item(claim, grace_owner, boot_id, now);
            out.push((Eligible::Claim(Box::new(claim.clone())), item));
        }
        out
    }

    /// Step 5a: dirty VFs without a claim on managed GPUs that no process holds.
    fn orphan_vfs(&self, obs: &super::inventory::Observation, report: &mut PassReport) -> Vec<(Eligible, GraceItem)> {
        use gpuvisor_sdk::DeviceState;
        let mut out = Vec::new();
        let now = proc::boottime_ms();
        let seen_before = lock(&self.reconciler.orphan_seen).clone();
        let mut seen_now = HashSet::new();
        for g in obs.vendor.iter().filter(|g| self.config().manages(&g.bdf)) {
            for vf in &g.vfs {
                let Some(d) = obs.devices().find(|(_, d)| d.address == vf.bdf).map(|(_, d)| d) else { continue };
                if d.state == DeviceState::Quarantined
                    && d.current_type.id().is_some_and(|t| t != 0)
                    && d.claim.is_none()
                {
                    report.keep_device(&vf.bdf, "quarantined");
                    continue;
                }
                if let (None, Some(why), Some(t)) = (&d.claim, &d.claim_unreadable, d.current_type.id()) {
                    if t != 0 {
                        report.keep_device(&vf.bdf, format!("a claim record that cannot be read may own it ({why})"));
                        continue;
                    }
                }
                let (DeviceState::Dirty, Some(t)) = (d.state, d.current_type.id()) else { continue };
                // The dirty age runs from the first pass that saw the VF dirty and unclaimed,
                // held open or not (persisted, so an agent restart does not reset it).
                seen_now.insert(vf.bdf.clone());
                let since = *lock(&self.reconciler.orphan_seen).entry(vf.bdf.clone()).or_insert(now);
                if !idle(&vf.bdf, vendor_vfio::vf_targets(self.host(), vf), report) {
                    continue;
                }
                out.push((
                    Eligible::OrphanVf { vf: vf.bdf.clone(), gpu: g.bdf.clone(), type_id: t },
                    GraceItem {
                        kind: GraceItemKind::OrphanVf,
                        device: vf.bdf.clone(),
                        framework: gpuvisor_sdk::Framework::VendorVfio,
                        owner: None,
                        claimed_age_ms: None,
                        dirty_age_ms: Some(now.saturating_sub(since)),
                        same_boot: true,
                        release_attempts: 0,
                        last_error: None,
                    },
                ));
            }
        }
        let changed = {
            let mut seen = lock(&self.reconciler.orphan_seen);
            seen.retain(|k, _| seen_now.contains(k));
            *seen != seen_before
        };
        if changed {
            self.persist_orphan_seen();
        }
        out
    }

    /// Step 5b: gpuvisor's own mdevs (recorded in `mdevs/`) that no claim names and no
    /// process holds; a claim record that cannot be read and may own the mdev (its file
    /// names the mdev or its parent, or names no device) keeps it. `obs: None`: the
    /// inventory was incomplete, so only records older than `claim_grace` in this boot are
    /// considered (the grace plugin still decides).
    fn orphan_mdevs(
        &self,
        obs: Option<&super::inventory::Observation>,
        limited: bool,
        boot_id: &str,
        report: &mut PassReport,
    ) -> Vec<(Eligible, GraceItem)> {
        let mut out = Vec::new();
        let records = match self.store().scan_mdevs() {
            Ok(r) => r,
            Err(e) => {
                report.fail(PassStage::Inventory, format!("mdev records cannot be listed: {e}"));
                return out;
            }
        };
        for u in &records.unreadable {
            report.keep_device(&u.key, format!("mdev record unreadable: {}", u.error));
            report.fail(
                PassStage::Inventory,
                format!("record {} cannot be read ({}): what it may own is kept", u.path.display(), u.error),
            );
        }
        let now = proc::boottime_ms();
        for rec in records.records {
            let uuid = rec.uuid.to_string();
            let claims = obs.map(|o| &o.claims.records[..]).unwrap_or(&[]);
            if claims.iter().any(|c| c.kind.mdev_uuid() == Some(rec.uuid)) {
                continue;
            }
            if let Some(u) = obs.and_then(|o| o.unreadable_claim_over(&uuid, &[rec.parent.as_str()])) {
                report
                    .keep_device(&uuid, format!("the claim record {} cannot be read and may own it", u.path.display()));
                continue;
            }
            if limited {
                // Without claims we cannot tell a live owner from a stale one: only mdevs
                // older than claim_grace in this boot and idle are touched.
                let old = rec.boot_id == boot_id
                    && now.saturating_sub(rec.created_boottime_ms) >= self.config().claim_grace_s.saturating_mul(1000);
                if !old {
                    report.keep_device(&uuid, "inventory incomplete; mdev younger than claim_grace");
                    continue;
                }
            }
            let dev = match mdev::read_device(self.host(), &uuid) {
                Ok(Some(d)) => d,
                // Gone: forget the record (only ours, only when no claim names it).
                Ok(None) => {
                    if obs.is_some() {
                        let _ = self.store().remove_mdev(rec.uuid);
                    }
                    continue;
                }
                // Unreadable is not absent: keep the record and the mdev.
                Err(reason) => {
                    report.keep_device(&uuid, format!("mdev unreadable: {reason}"));
                    continue;
                }
            };
            if !self.config().manages(&super::release::pf_of(self, &dev.parent)) {
                continue;
            }
            if !idle(&uuid, mdev::targets(self.host(), &uuid), report) {
                continue;
            }
            let same_boot = rec.boot_id == boot_id;
            let age = if same_boot { now.saturating_sub(rec.created_boottime_ms) } else { u64::MAX / 2 };
            let item = GraceItem {
                kind: GraceItemKind::OrphanMdev,
                device: uuid,
                framework: gpuvisor_sdk::Framework::Mdev,
                owner: None,
                claimed_age_ms: None,
                dirty_age_ms: Some(age),
                same_boot,
                release_attempts: 0,
                last_error: None,
            };
            out.push((Eligible::OrphanMdev(rec), item));
        }
        out
    }

    /// Step 6: asks the `grace` plugin about the eligible items and releases those it
    /// allows, counting what was actually done.
    fn decide_and_release(&self, eligible: Vec<(Eligible, GraceItem)>, boot_id: &str, report: &mut PassReport) {
        if eligible.is_empty() {
            lock(&self.reconciler.held_by_policy).clear();
            return;
        }
        let decisions = match self.grace_decisions(eligible.iter().map(|(_, i)| i.clone()).collect(), boot_id) {
            Ok(d) => d,
            Err(msg) => {
                report.fail(PassStage::Grace, msg);
                HashMap::new()
            }
        };
        let limit_ms = (self.config().claim_grace_s + self.config().reconcile_interval_s).saturating_mul(1000);
        let mut held = BTreeMap::new();
        for (e, item) in eligible {
            let device = e.device();
            match decisions.get(&device) {
                Some(d) if d.action == GraceAction::Release => {}
                Some(d) => {
                    report.kept.push(crate::wire::KeptItem {
                        device: Some(device.clone()),
                        instance: None,
                        reason: format!("grace: {}", d.reason),
                        recheck_after_ms: d.recheck_after_ms,
                    });
                    let age = item.claimed_age_ms.or(item.dirty_age_ms).unwrap_or(0);
                    if age > limit_ms || !item.same_boot {
                        if !lock(&self.reconciler.held_by_policy).contains_key(&device) {
                            tracing::warn!(gpu.device = %device, reason = %d.reason,
                                "held_by_policy: the grace plugin keeps an eligible item past claim_grace");
                        }
                        held.insert(device, d.reason.clone());
                    }
                    continue;
                }
                None => {
                    report.keep_device(&device, "grace: no decision");
                    continue;
                }
            }
            crate::crash_point!("reconcile_before_release");
            match e {
                Eligible::Claim(c) => self.release_stale(&c, boot_id, report),
                Eligible::OrphanVf { vf, gpu, type_id } => {
                    let r = self.release(Release::OrphanVf { vf: &vf, gpu: &gpu, type_id }, Duration::ZERO);
                    if matches!(r, Ok(Released::Cleared)) {
                        self.metrics().orphan_released(Framework::VendorVfio.as_str());
                        lock(&self.reconciler.orphan_seen).remove(&vf);
                    }
                    record_release(report, &device, "orphan_vf", None, r);
                }
                Eligible::OrphanMdev(rec) => {
                    let r = self.release(Release::OrphanMdev(&rec), Duration::ZERO);
                    if matches!(r, Ok(Released::Cleared)) {
                        self.metrics().orphan_released(Framework::Mdev.as_str());
                    }
                    record_release(report, &device, "orphan_mdev", None, r);
                }
            }
        }
        *lock(&self.reconciler.held_by_policy) = held;
    }

    /// Releases a stale claim with its owner's instance lock held again (an operation
    /// started since the observation makes the pass skip it) and its death proven again.
    fn release_stale(&self, c: &Claim, boot_id: &str, report: &mut PassReport) {
        let Some(owner_id) = c.owner.instance() else {
            // An external owner: not while a claim.prepare/claim.release works on the
            // device; its death proven again now (a list may have come since).
            let Some(_busy) = self.external_busy(&c.device) else {
                report.keep_device(&c.device, "owner operation in progress");
                return;
            };
            match self.prove_owner_done(c, boot_id) {
                Ok(dead) => {
                    let r = self.release(Release::Claim(c, dead), Duration::ZERO);
                    self.count_stale(&r);
                    record_release(report, &c.device, "stale_claim", None, r);
                }
                Err(l) => report.keep_device(&c.device, format!("owner {}: {l}", c.owner)),
            }
            return;
        };
        let ilock = self.instance_lock(owner_id);
        let Ok(_i) = ilock.try_lock() else {
            report.keep_device(&c.device, "owner operation in progress");
            return;
        };
        let owner = match self.store().read_instance(owner_id) {
            Ok(o) => o,
            Err(e) => {
                report.keep_device(&c.device, format!("owner record unreadable: {e}"));
                return;
            }
        };
        let dead: Dead = match self.prove_dead(owner_id, owner.as_ref(), boot_id) {
            Ok(d) => d,
            Err(l) => {
                report.keep_device(&c.device, format!("owner {l}"));
                return;
            }
        };
        let r = self.release(Release::Claim(c, dead), Duration::ZERO);
        self.count_stale(&r);
        if matches!(r, Ok(Released::Cleared)) {
            crate::crash_point!("reconcile_after_release");
            self.clear_release_pending_note(owner_id);
        }
        record_release(report, &c.device, "stale_claim", Some(owner_id), r);
    }

    /// Counts a stale claim's release by its outcome.
    fn count_stale(&self, r: &Result<Released, super::release::ReleaseError>) {
        match r {
            Ok(Released::Cleared) => self.metrics().stale_release(StaleResult::Released),
            Ok(Released::NotOurs | Released::FoundClear) => {}
            Err(super::release::ReleaseError::InUse(_)) => self.metrics().stale_release(StaleResult::InUse),
            Err(super::release::ReleaseError::ScanIncomplete(_)) => {
                self.metrics().stale_release(StaleResult::ScanIncomplete)
            }
            Err(_) => self.metrics().stale_release(StaleResult::Failed),
        }
    }
}

/// The grace plugin's view of a stale claim (`owner`: its instance, `None` when absent or
/// external).
fn stale_item(claim: &Claim, owner: Option<GraceOwner>, boot_id: &str, now: u64) -> GraceItem {
    let same_boot = claim.claim_boot_id == boot_id;
    GraceItem {
        kind: GraceItemKind::StaleClaim,
        device: claim.device.clone(),
        framework: claim.kind.framework().into(),
        owner,
        claimed_age_ms: same_boot.then(|| now.saturating_sub(claim.claimed_boottime_ms)),
        dirty_age_ms: None,
        same_boot,
        release_attempts: claim.release_attempts,
        last_error: claim.last_error.clone(),
    }
}

/// Puts what a release did in the report: released only when something was done.
fn record_release(
    report: &mut PassReport,
    device: &str,
    kind: &str,
    instance: Option<Uuid>,
    r: Result<Released, super::release::ReleaseError>,
) {
    match r {
        Ok(Released::Cleared) => report.released.push(ReleasedItem {
            device: device.to_string(),
            kind: kind.to_string(),
            instance: instance.map(|i| i.to_string()),
        }),
        Ok(Released::NotOurs) => report.keep_device(device, "claimed or changed meanwhile: nothing was written"),
        Ok(Released::FoundClear) => report.keep_device(
            device,
            "found clear when the sweep came to write (another writer cleared it): nothing was written",
        ),
        Err(e) => report.failed.push(FailedItem { device: device.to_string(), error: e.to_string() }),
    }
}

/// True when a fresh scan finds no holder of the device; otherwise records why it is kept.
fn idle(device: &str, targets: Result<Vec<PathBuf>, DeviceError>, report: &mut PassReport) -> bool {
    match scan(targets) {
        HandleScan::Clean => true,
        HandleScan::Held { pids } => {
            report.keep_device(device, format!("held open by {pids:?}"));
            false
        }
        HandleScan::Unknown { reason } => {
            report.keep_device(device, format!("scan incomplete: {reason}"));
            false
        }
    }
}
