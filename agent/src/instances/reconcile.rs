//! # The reconciler (LIFECYCLE.md "Reconciler")
//!
//! One pass: observe → plan → act.
//! 1. **Inventory**: every instance and claim record, strictly. If the store cannot be read
//!    completely, the pass counts `reconcile_failures_total{stage="inventory"}`, skips the
//!    stale-claim release and the vendor-VFIO sweep, and still runs the mdev sweep limited to
//!    gpuvisor's own old, idle mdevs.
//! 2. **Records**: an instance recorded `starting`/`running`/`stopping` whose VMM is provably
//!    dead and which no operation holds moves to `stopped` (`last_error` says why); a live
//!    control-socket owner of an instance without a recorded identity has its identity
//!    recorded.
//! 3. **Stale claims**: under the instance lock (instances mid-operation are skipped), maybe
//!    alive → kept, no question asked; provably dead or absent owner → *eligible*; the
//!    `grace` plugin decides which eligible claims are released now; each release goes
//!    through the release guard. A failed grace call keeps the whole batch.
//! 4. **Orphan sweep** (managed GPUs only): dirty VFs with no claim, and mdevs gpuvisor
//!    recorded but no claim names, that are not held open, are eligible; the `grace` plugin
//!    says when. Unmanaged GPUs and mdevs of other tools are never touched.
//!
//! Nothing here clears a device except through the guard's scan-then-write under the
//! device lock; "maybe alive" is never "dead".

use super::*;
use gpuvisor_sdk::{GraceAction, GraceDecision, GraceInput, GraceItem, GraceItemKind, GraceOwner};
use std::collections::HashSet;

/// What one pass observed, kept, released and failed (the `reconcile.run` result).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PassReport {
    /// Every instance and claim record could be read.
    pub inventory_complete: bool,
    pub duration_ms: u64,
    /// `{device, reason}` of every claim or orphan kept this pass.
    pub kept: Vec<Value>,
    /// `{device, kind}` of every device released.
    pub released: Vec<Value>,
    /// `{device, error}` of every release that failed.
    pub failed: Vec<Value>,
    /// `{instance, name, from, to, reason}` of every record changed.
    pub records: Vec<Value>,
    /// Problems that did not stop the pass.
    pub errors: Vec<String>,
}

/// An eligible item with what the release needs.
enum Eligible {
    Claim(Claim),
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
    /// Writes the orphan first-seen times (`<data-dir>/orphans.json`, with the boot id).
    fn persist_orphan_seen(&self) {
        let Ok(boot_id) = self.host.boot_id() else { return };
        let seen = lock(&self.orphan_seen).clone();
        let doc = json!({ "boot_id": boot_id, "seen_boottime_ms": seen });
        if let Err(e) = crate::store::write_json_atomic(&self.store.root().join("orphans.json"), &doc) {
            tracing::warn!(error = %e, "cannot persist orphan first-seen times");
        }
    }

    /// Runs one reconcile pass now. Never fails: problems are in the report and counted.
    /// The first pass with a complete inventory makes the agent ready (I13). Passes never
    /// overlap: a `reconcile.run` during the periodic pass waits for it.
    pub fn reconcile(&self) -> PassReport {
        let _pass = lock(&self.pass_lock);
        let started = Instant::now();
        let mut report = PassReport::default();
        let boot_id = match self.host.boot_id() {
            Ok(b) => b,
            Err(e) => {
                report.errors.push(format!("cannot read the host boot id: {e}"));
                self.counters.reconcile_inventory_failures.fetch_add(1, Ordering::Relaxed);
                self.counters.reconcile_incomplete.fetch_add(1, Ordering::Relaxed);
                return report;
            }
        };
        let inventory = self.store.list_instances().and_then(|i| Ok((i, self.store.list_claims()?)));
        match inventory {
            Ok((instances, claims)) => {
                report.inventory_complete = true;
                self.reconcile_records(&instances, &boot_id, &mut report);
                let mut eligible = self.stale_claims(&claims, &boot_id, &mut report);
                eligible.extend(self.orphan_vfs(&claims, &mut report));
                eligible.extend(self.orphan_mdevs(&claims, false, &boot_id, &mut report));
                self.decide_and_release(eligible, &boot_id, &mut report);
            }
            Err(e) => {
                tracing::error!(error = %e, "reconcile: the store cannot be read completely; releasing nothing on its behalf");
                report.errors.push(format!("inventory incomplete: {e}"));
                self.counters.reconcile_inventory_failures.fetch_add(1, Ordering::Relaxed);
                // Only gpuvisor's own, old, idle mdevs, with the claims we can still read.
                let claims: Vec<Claim> = Vec::new();
                let eligible = self.orphan_mdevs(&claims, true, &boot_id, &mut report);
                self.decide_and_release(eligible, &boot_id, &mut report);
            }
        }
        if report.inventory_complete {
            self.counters.reconcile_complete.fetch_add(1, Ordering::Relaxed);
            if !self.ready.swap(true, Ordering::SeqCst) {
                tracing::info!("startup reconcile pass complete: accepting new claims");
            }
        } else {
            self.counters.reconcile_incomplete.fetch_add(1, Ordering::Relaxed);
        }
        report.duration_ms = started.elapsed().as_millis() as u64;
        tracing::info!(
            duration_ms = report.duration_ms,
            released = report.released.len(),
            kept = report.kept.len(),
            failed = report.failed.len(),
            complete = report.inventory_complete,
            "reconcile pass done"
        );
        report
    }

    /// Step 2: records whose VMM is provably dead move to `stopped`; a `stopping` record
    /// whose VMM still runs (a stop interrupted by an agent restart) moves back to `running`.
    fn reconcile_records(&self, instances: &[InstanceRecord], boot_id: &str, report: &mut PassReport) {
        for rec in instances {
            if !matches!(rec.state, InstanceState::Starting | InstanceState::Running | InstanceState::Stopping) {
                continue;
            }
            let ilock = self.instance_lock(rec.id);
            let Ok(_i) = ilock.try_lock() else {
                report.kept.push(json!({"instance": rec.id.to_string(), "reason": "operation in progress"}));
                continue;
            };
            let Ok(Some(mut rec)) = self.store.read_instance(rec.id) else { continue };
            let sock = self.control_socket(&rec);
            match self.liveness_at(&rec, boot_id) {
                Liveness::Dead if rec.vmm.is_none() && self.young_claim(rec.id, boot_id) => {
                    // A crash between claim and spawn (or before the identity was
                    // persisted): protected while its claim is younger than claim_grace in
                    // this boot; the grace plugin decides about the claim.
                    report.kept.push(json!({"instance": rec.id.to_string(),
                        "reason": "starting without a recorded VMM; claim younger than claim_grace"}));
                }
                Liveness::Dead => {
                    let from = rec.state;
                    let reason = if rec.vmm.is_some() {
                        "the VMM exited".to_string()
                    } else {
                        format!("the agent restarted while the instance was {}", from.as_str())
                    };
                    rec.state = InstanceState::Stopped;
                    rec.vmm = None;
                    rec.last_error = Some(reason.clone());
                    match self.store.write_instance(&rec) {
                        Ok(()) => report.records.push(json!({"instance": rec.id.to_string(), "name": rec.name,
                            "from": from.as_str(), "to": "stopped", "reason": reason})),
                        Err(e) => report.errors.push(format!("cannot mark {} stopped: {e}", rec.name)),
                    }
                }
                Liveness::Alive { pid } if rec.vmm.is_none() => {
                    // A live control-socket owner without a recorded identity (a crash
                    // between spawn and persisting it): record it; the VM is running.
                    if let Ok(Some(identity)) = proc::identity_of(pid, boot_id) {
                        rec.vmm = Some(VmmRecord { identity, control_socket: sock });
                        rec.state = InstanceState::Running;
                        if self.store.write_instance(&rec).is_ok() {
                            report.records.push(json!({"instance": rec.id.to_string(), "name": rec.name,
                                "from": rec.state.as_str(), "to": rec.state.as_str(),
                                "reason": format!("recorded the identity of the control socket owner {pid}")}));
                        }
                    }
                }
                Liveness::Alive { pid } if rec.state == InstanceState::Stopping => {
                    // A stop interrupted by an agent restart (no operation holds the
                    // instance: its lock is ours). The stop was never acknowledged and the
                    // VMM still runs: say so, instead of a `stopping` that never ends (I8).
                    rec.state = InstanceState::Running;
                    let reason = format!("the agent restarted during a stop; the VMM {pid} still runs: stop again");
                    rec.last_error = Some(reason.clone());
                    match self.store.write_instance(&rec) {
                        Ok(()) => report.records.push(json!({"instance": rec.id.to_string(), "name": rec.name,
                            "from": "stopping", "to": "running", "reason": reason})),
                        Err(e) => report.errors.push(format!("cannot mark {} running: {e}", rec.name)),
                    }
                }
                Liveness::Alive { .. } => {}
                Liveness::MaybeAlive { reason } => report
                    .kept
                    .push(json!({"instance": rec.id.to_string(), "reason": format!("maybe alive: {reason}")})),
            }
        }
    }

    /// After the reconciler released an instance's retained claim, its record no longer
    /// says "vGPU release pending" (the owner's instance lock is held by the caller).
    fn clear_release_pending_note(&self, id: Uuid) {
        if let Ok(Some(mut rec)) = self.store.read_instance(id) {
            if rec.last_error.as_deref().is_some_and(|e| e.starts_with("vGPU release pending")) {
                rec.last_error = None;
                if let Err(e) = self.store.write_instance(&rec) {
                    tracing::warn!(instance.id = %id, error = %e, "cannot clear the release-pending note");
                }
            }
        }
    }

    /// True when the instance has a claim made in this boot that is younger than
    /// `claim_grace_s` (measured on CLOCK_BOOTTIME).
    fn young_claim(&self, id: Uuid, boot_id: &str) -> bool {
        let now = proc::boottime_ms();
        self.store.list_claims().unwrap_or_default().iter().any(|c| {
            c.instance_id == id
                && c.claim_boot_id == boot_id
                && now.saturating_sub(c.claimed_boottime_ms) < self.cfg.claim_grace_s.saturating_mul(1000)
        })
    }

    /// Step 3: claims whose owner is provably dead or absent are eligible.
    fn stale_claims(&self, claims: &[Claim], boot_id: &str, report: &mut PassReport) -> Vec<(Eligible, GraceItem)> {
        let mut out = Vec::new();
        let now = proc::boottime_ms();
        for claim in claims {
            let owner = match self.store.read_instance(claim.instance_id) {
                Ok(o) => o,
                Err(e) => {
                    report
                        .kept
                        .push(json!({"device": claim.device, "reason": format!("owner record unreadable: {e}")}));
                    continue;
                }
            };
            let ilock = self.instance_lock(claim.instance_id);
            let Ok(_i) = ilock.try_lock() else {
                report.kept.push(json!({"device": claim.device, "reason": "owner operation in progress"}));
                continue;
            };
            // Re-read under the instance lock.
            let owner = match self.store.read_instance(claim.instance_id) {
                Ok(o) => o.or(owner),
                Err(_) => continue,
            };
            let same_boot = claim.claim_boot_id == boot_id;
            if let Some(o) = &owner {
                match self.liveness_at(o, boot_id) {
                    Liveness::Dead => {}
                    Liveness::Alive { pid } => {
                        report
                            .kept
                            .push(json!({"device": claim.device, "reason": format!("owner VMM {pid} is alive")}));
                        continue;
                    }
                    Liveness::MaybeAlive { reason } => {
                        report
                            .kept
                            .push(json!({"device": claim.device, "reason": format!("owner maybe alive: {reason}")}));
                        continue;
                    }
                }
                // A running record is handled by step 2 first; one still `running` here was
                // changed concurrently: leave it to the next pass.
                if matches!(o.state, InstanceState::Running) {
                    report.kept.push(json!({"device": claim.device, "reason": "owner recorded running"}));
                    continue;
                }
            }
            let item = GraceItem {
                kind: GraceItemKind::StaleClaim,
                device: claim.device.clone(),
                framework: claim.framework,
                owner: owner.as_ref().map(|o| GraceOwner {
                    instance_id: o.id.to_string(),
                    state: o.state.as_str().to_string(),
                    labels: o.labels.clone(),
                    vmm_identity_recorded: o.vmm.is_some(),
                }),
                claimed_age_ms: same_boot.then(|| now.saturating_sub(claim.claimed_boottime_ms)),
                dirty_age_ms: None,
                same_boot,
                release_attempts: claim.release_attempts,
                last_error: claim.last_error.clone(),
            };
            out.push((Eligible::Claim(claim.clone()), item));
        }
        out
    }

    /// Step 4a: dirty VFs without a claim on managed GPUs that no process holds.
    fn orphan_vfs(&self, claims: &[Claim], report: &mut PassReport) -> Vec<(Eligible, GraceItem)> {
        let mut out = Vec::new();
        let gpus = match vendor_vfio::inventory(&self.host) {
            Ok(g) => g,
            Err(e) => {
                report.errors.push(format!("VF inventory failed; no orphan sweep this pass: {e}"));
                return out;
            }
        };
        let health = match self.store.list_health() {
            Ok(h) => h,
            Err(e) => {
                report.errors.push(format!("health records unreadable; no orphan sweep this pass: {e}"));
                return out;
            }
        };
        let now = proc::boottime_ms();
        let seen_before = lock(&self.orphan_seen).clone();
        let mut seen_now = HashSet::new();
        for g in gpus {
            if !self.cfg.manages(&g.bdf) {
                continue;
            }
            for vf in &g.vfs {
                let Ok(t) = vf.current_type else { continue };
                if t == 0 || claims.iter().any(|c| c.device == vf.bdf) {
                    continue;
                }
                if health.iter().any(|h| h.device == vf.bdf && h.quarantined) {
                    report.kept.push(json!({"device": vf.bdf, "reason": "quarantined"}));
                    continue;
                }
                // The dirty age runs from the first pass that saw the VF dirty and unclaimed,
                // held open or not (persisted, so an agent restart does not reset it).
                seen_now.insert(vf.bdf.clone());
                let since = *lock(&self.orphan_seen).entry(vf.bdf.clone()).or_insert(now);
                if !idle(&vf.bdf, vendor_vfio::vf_targets(&self.host, vf), report) {
                    continue;
                }
                out.push((
                    Eligible::OrphanVf { vf: vf.bdf.clone(), gpu: g.bdf.clone(), type_id: t },
                    GraceItem {
                        kind: GraceItemKind::OrphanVf,
                        device: vf.bdf.clone(),
                        framework: Framework::VendorVfio,
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
            let mut seen = lock(&self.orphan_seen);
            seen.retain(|k, _| seen_now.contains(k));
            *seen != seen_before
        };
        if changed {
            self.persist_orphan_seen();
        }
        out
    }

    /// Step 4b: gpuvisor's own mdevs (recorded in `mdevs/`) that no claim names and no
    /// process holds. `limited`: the inventory was unreadable, so only records older than
    /// `claim_grace` in this boot are considered (the grace plugin still decides).
    fn orphan_mdevs(
        &self,
        claims: &[Claim],
        limited: bool,
        boot_id: &str,
        report: &mut PassReport,
    ) -> Vec<(Eligible, GraceItem)> {
        let mut out = Vec::new();
        let records = match self.store.list_mdevs() {
            Ok(r) => r,
            Err(e) => {
                report.errors.push(format!("mdev records unreadable: {e}"));
                return out;
            }
        };
        let now = proc::boottime_ms();
        for rec in records {
            let uuid = rec.uuid.to_string();
            if claims.iter().any(|c| c.mdev_uuid == Some(rec.uuid)) {
                continue;
            }
            if limited {
                // Without claims we cannot tell a live owner from a stale one: only mdevs
                // older than claim_grace in this boot and idle are touched.
                let old = rec.boot_id == boot_id
                    && now.saturating_sub(rec.created_boottime_ms) >= self.cfg.claim_grace_s * 1000;
                if !old {
                    report
                        .kept
                        .push(json!({"device": uuid, "reason": "inventory incomplete; mdev younger than claim_grace"}));
                    continue;
                }
            }
            let Some(dev) = mdev::read_device(&self.host, &uuid) else {
                // Already gone: forget the record.
                let _ = self.store.remove_mdev(rec.uuid);
                continue;
            };
            if !self.cfg.manages(&pf_of(&self.host, &dev.parent)) {
                continue;
            }
            if !idle(&uuid, mdev::targets(&self.host, &uuid), report) {
                continue;
            }
            let same_boot = rec.boot_id == boot_id;
            let age = if same_boot { now.saturating_sub(rec.created_boottime_ms) } else { u64::MAX / 2 };
            let item = GraceItem {
                kind: GraceItemKind::OrphanMdev,
                device: uuid,
                framework: Framework::Mdev,
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

    /// Asks the `grace` plugin about the eligible items and releases those it allows.
    fn decide_and_release(&self, eligible: Vec<(Eligible, GraceItem)>, boot_id: &str, report: &mut PassReport) {
        if eligible.is_empty() {
            lock(&self.held_by_policy).clear();
            return;
        }
        let decisions = self.grace_decisions(&eligible, boot_id, report);
        let limit_ms = (self.cfg.claim_grace_s + self.cfg.reconcile_interval_s).saturating_mul(1000);
        let mut held = BTreeMap::new();
        for (e, item) in eligible {
            let device = e.device();
            match decisions.get(&device) {
                Some(d) if d.action == GraceAction::Release => {}
                Some(d) => {
                    report.kept.push(json!({"device": device, "reason": format!("grace: {}", d.reason),
                        "recheck_after_ms": d.recheck_after_ms}));
                    let age = item.claimed_age_ms.or(item.dirty_age_ms).unwrap_or(0);
                    if age > limit_ms || !item.same_boot {
                        tracing::warn!(gpu.device = %device, reason = %d.reason, "held_by_policy: the grace plugin keeps an eligible item past claim_grace");
                        held.insert(device, d.reason.clone());
                    }
                    continue;
                }
                None => {
                    report.kept.push(json!({"device": device, "reason": "grace: no decision"}));
                    continue;
                }
            }
            crate::crash_point!("reconcile_before_release");
            match e {
                Eligible::Claim(c) => {
                    // Hold the owner's instance lock again across the release (an operation
                    // started since the observation makes the pass skip it).
                    let ilock = self.instance_lock(c.instance_id);
                    let Ok(_i) = ilock.try_lock() else {
                        report.kept.push(json!({"device": device, "reason": "owner operation in progress"}));
                        continue;
                    };
                    match self.release_within(&c, Duration::ZERO) {
                        Ok(()) => {
                            self.counters.stale_released.fetch_add(1, Ordering::Relaxed);
                            crate::crash_point!("reconcile_after_release");
                            self.clear_release_pending_note(c.instance_id);
                            report.released.push(json!({"device": device, "kind": "stale_claim",
                            "instance": c.instance_id.to_string()}));
                        }
                        Err(err) => {
                            let ctr = match err {
                                ReleaseError::InUse(_) => &self.counters.stale_in_use,
                                ReleaseError::ScanIncomplete(_) => &self.counters.stale_scan_incomplete,
                                _ => &self.counters.stale_failed,
                            };
                            ctr.fetch_add(1, Ordering::Relaxed);
                            report.failed.push(json!({"device": device, "error": err.to_string()}));
                        }
                    }
                }
                Eligible::OrphanVf { vf, gpu, type_id } => match self.release_orphan_vf(&vf, &gpu, type_id) {
                    Ok(()) => {
                        self.counters.orphans_released_vendor_vfio.fetch_add(1, Ordering::Relaxed);
                        lock(&self.orphan_seen).remove(&vf);
                        report.released.push(json!({"device": device, "kind": "orphan_vf"}));
                    }
                    Err(err) => report.failed.push(json!({"device": device, "error": err.to_string()})),
                },
                Eligible::OrphanMdev(rec) => match self.release_orphan_mdev(&rec) {
                    Ok(()) => {
                        self.counters.orphans_released_mdev.fetch_add(1, Ordering::Relaxed);
                        report.released.push(json!({"device": device, "kind": "orphan_mdev"}));
                    }
                    Err(err) => report.failed.push(json!({"device": device, "error": err.to_string()})),
                },
            }
        }
        *lock(&self.held_by_policy) = held;
    }

    /// The grace plugin's decisions by device. A failed call, or an answer that does not
    /// decode, keeps everything (empty map).
    fn grace_decisions(
        &self,
        eligible: &[(Eligible, GraceItem)],
        boot_id: &str,
        report: &mut PassReport,
    ) -> HashMap<String, GraceDecision> {
        let policies = self.policies();
        let Some(plugin) = &policies.grace else {
            report.errors.push("no grace plugin loaded: keeping every eligible item".into());
            return HashMap::new();
        };
        let mut params = self.cfg.plugin_params(gpuvisor_sdk::PolicyKind::Grace);
        if let Value::Object(m) = &mut params {
            m.entry("claim_grace_s").or_insert(json!(self.cfg.claim_grace_s));
        }
        let input = GraceInput {
            now_boottime_ms: proc::boottime_ms(),
            boot_id: boot_id.to_string(),
            items: eligible.iter().map(|(_, i)| i.clone()).collect(),
            params,
        };
        self.record_input("grace", &input);
        let t = Instant::now();
        let answer = plugin.call_grace(&input);
        self.counters.observe_policy_call(&plugin.manifest().name, "grace", t);
        match answer {
            Ok(answer) => {
                let asked: HashSet<String> = eligible.iter().map(|(e, _)| e.device()).collect();
                let mut out = HashMap::new();
                for d in answer.decisions {
                    if asked.contains(&d.device) {
                        out.insert(d.device.clone(), d);
                    } else {
                        // A decision about a device that was not asked about is ignored.
                        self.counters.reject(&plugin.manifest().name, "grace", "unasked_device");
                    }
                }
                out
            }
            Err(e) => {
                tracing::warn!(plugin.name = %plugin.manifest().name, error = %e, "grace plugin failed: keeping every eligible item");
                self.counters.reconcile_grace_failures.fetch_add(1, Ordering::Relaxed);
                report.errors.push(format!("grace plugin failed: {e}; kept every eligible item"));
                HashMap::new()
            }
        }
    }

    /// Clears a dirty VF that has no claim: under the allocation lock the VF must still be
    /// unclaimed; under the device lock a fresh scan, then write `0` and read back.
    fn release_orphan_vf(&self, vf: &str, gpu: &str, type_id: u32) -> Result<(), ReleaseError> {
        let _a = lock(&self.alloc);
        match self.store.read_claim(vf) {
            Ok(None) => {}
            Ok(Some(_)) => return Ok(()), // claimed meanwhile: not an orphan any more
            Err(e) => return Err(ReleaseError::Store(e.to_string())),
        }
        let dev_lock = self.device_lock(vf);
        let _d = lock(&dev_lock);
        let info = vendor_vfio::read_vf(&self.host, vf, gpu.to_string());
        match scan(vendor_vfio::vf_targets(&self.host, &info)) {
            HandleScan::Clean => {}
            HandleScan::Held { pids } => return Err(ReleaseError::InUse(pids)),
            HandleScan::Unknown { reason } => return Err(ReleaseError::ScanIncomplete(reason)),
        }
        vendor_vfio::clear(&self.host, vf, Some(type_id)).map_err(|e| match e {
            vendor_vfio::ClearError::Foreign { value } => {
                ReleaseError::Foreign(format!("type changed to {value} during the sweep"))
            }
            vendor_vfio::ClearError::Failed(w) => {
                self.write_failed(vf, &w);
                ReleaseError::Failed(w)
            }
        })?;
        self.write_succeeded(vf);
        tracing::info!(gpu.device = %vf, type_id, "orphan VF cleared");
        Ok(())
    }

    /// Removes one of gpuvisor's own mdevs that no claim names.
    fn release_orphan_mdev(&self, rec: &MdevRecord) -> Result<(), ReleaseError> {
        let _a = lock(&self.alloc);
        if let Ok(claims) = self.store.list_claims() {
            if claims.iter().any(|c| c.mdev_uuid == Some(rec.uuid)) {
                return Ok(());
            }
        }
        let dev_lock = self.device_lock(&rec.parent);
        let _d = lock(&dev_lock);
        let uuid = rec.uuid.to_string();
        match scan(mdev::targets(&self.host, &uuid)) {
            HandleScan::Clean => {}
            HandleScan::Held { pids } => return Err(ReleaseError::InUse(pids)),
            HandleScan::Unknown { reason } => return Err(ReleaseError::ScanIncomplete(reason)),
        }
        self.checked_write(&rec.parent, mdev::remove(&self.host, &uuid)).map_err(ReleaseError::Failed)?;
        self.store.remove_mdev(rec.uuid).map_err(|e| ReleaseError::Store(e.to_string()))?;
        tracing::info!(mdev = %uuid, "orphan mdev removed");
        Ok(())
    }
}

/// True when a fresh scan finds no holder of the device; otherwise records why it is kept.
fn idle(device: &str, targets: Result<Vec<std::path::PathBuf>, String>, report: &mut PassReport) -> bool {
    match scan(targets) {
        HandleScan::Clean => true,
        HandleScan::Held { pids } => {
            report.kept.push(json!({"device": device, "reason": format!("held open by {pids:?}")}));
            false
        }
        HandleScan::Unknown { reason } => {
            report.kept.push(json!({"device": device, "reason": format!("scan incomplete: {reason}")}));
            false
        }
    }
}

/// The PF of an mdev parent (basename of `physfn`, or the parent itself).
fn pf_of(host: &HostRoot, parent: &str) -> String {
    devices::link_basename(&host.pci_device(parent).join("physfn")).unwrap_or_else(|_| parent.to_string())
}
