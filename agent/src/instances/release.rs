//! # release — **the** release path: the only code that clears a device
//!
//! Every clear of every device kind comes here: a claimed VF or mdev (stop, delete,
//! rollback, start's earlier claim, the reconciler's stale claims), an orphan VF or mdev
//! (the sweep), and the repair of a dirty VF before configure. One sequence for all of them
//! (docs/design/lifecycle.md "The release guard"):
//!
//! 1. the owner is provably dead — a [`Dead`] proof for claims; "no claim" for orphans;
//! 2. under the allocation lock, the device is still ours to clear: the claim is still
//!    exactly this claim / the orphan still has no claim;
//! 3. under the device lock (the allocation lock released — a slow sysfs write never blocks
//!    other placements): ownership checked again, then a fresh scan of every
//!    `/proc/<pid>/fd` for the device's nodes; a holder → `in_use`, an incomplete scan →
//!    `scan_incomplete`;
//! 4. write (`0`, the mdev `remove`, or — passthrough — the reset and every function given
//!    back to its recorded driver) and read back; a type gpuvisor did not write →
//!    quarantined (`foreign_write`), never cleared;
//! 5. the write's outcome goes to the health accounting;
//! 6. the claim is removed (re-read under the allocation lock first).
//!
//! Nothing is released until the startup pass had a complete observation (docs/design/invariants.md
//! I13). A failed release of a claim keeps the claim, `release_pending`, with the attempt
//! count and the last error. Nothing else in the tree calls [`vendor_vfio::clear`],
//! [`mdev::remove`], [`passthrough::reset`] or [`passthrough::give_back`] (a test checks
//! it).

use super::health::WriteSite;
use super::vmm::Dead;
use super::Manager;
use crate::devices::{self, mdev, passthrough, vendor_vfio, Cleared, WriteError};
use crate::error::ReleaseFailure;
use crate::events::EventKind;
use crate::host::proc::{self, HandleScan};
use crate::store::{Claim, ClaimKind, ClaimState, MdevRecord, PassthroughClaim};
use crate::sync::lock;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The health reason of a passthrough GPU whose reset failed (docs/design/host.md §7): it is
/// never reset again until an operator clears the mark.
pub const RESET_FAILED: &str = "reset_failed";

/// What to release.
#[derive(Debug, Clone, Copy)]
pub enum Release<'a> {
    /// A claim whose owner is provably dead (or absent).
    Claim(&'a Claim, Dead),
    /// A dirty VF with no claim that the sweep may clear (`type_id`: what it read).
    OrphanVf { vf: &'a str, gpu: &'a str, type_id: u32 },
    /// One of gpuvisor's own mdevs that no claim names.
    OrphanMdev(&'a MdevRecord),
    /// A dirty VF that `claim` (ours, durable) picked: cleared before its type is written.
    Repair { claim: &'a Claim, type_id: u32 },
}

impl Release<'_> {
    /// The device the lock and the reports name (the VF, or the mdev's parent).
    fn device(&self) -> &str {
        match self {
            Release::Claim(c, _) | Release::Repair { claim: c, .. } => &c.device,
            Release::OrphanVf { vf, .. } => vf,
            Release::OrphanMdev(m) => &m.parent,
        }
    }

    /// The claim being released or repaired, if any.
    fn owner(&self) -> Option<&Claim> {
        match self {
            Release::Claim(c, _) | Release::Repair { claim: c, .. } => Some(c),
            Release::OrphanVf { .. } | Release::OrphanMdev(_) => None,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Release::Claim(..) => "claim",
            Release::OrphanVf { .. } => "orphan_vf",
            Release::OrphanMdev(_) => "orphan_mdev",
            Release::Repair { .. } => "dirty_vf_repair",
        }
    }
}

/// What a successful release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The device was cleared (or, for a claim, found clear) and its claim removed.
    Cleared,
    /// Nothing was done: the device was no longer ours to clear (another instance claimed
    /// it meanwhile, the claim changed, or it is gone). Counted as nothing.
    NotOurs,
    /// An orphan was found clear when the sweep came to write: another writer cleared it
    /// (or removed the mdev). Nothing was written; counted as nothing.
    FoundClear,
}

/// Why a release did not complete.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReleaseError {
    /// A process holds the device open.
    #[error("in_use: held open by pid {0:?}")]
    InUse(Vec<i32>),
    /// The open-handle scan could not be completed.
    #[error("scan_incomplete: {0}")]
    ScanIncomplete(String),
    /// The clear/remove write failed.
    #[error("failed: {0}")]
    Failed(WriteError),
    /// The device reads a type gpuvisor did not write; quarantined, never cleared.
    #[error("foreign_write: {0}")]
    Foreign(String),
    /// The store could not be read or updated.
    #[error("store: {0}")]
    Store(String),
    /// The startup reconcile pass has not observed the host completely yet.
    #[error("not_ready: nothing is released before the startup reconcile pass has a complete observation")]
    NotReady,
}

impl ReleaseError {
    fn retryable(&self) -> bool {
        matches!(self, ReleaseError::InUse(_) | ReleaseError::ScanIncomplete(_) | ReleaseError::Failed(_))
    }

    /// The stable code (`in_use`, `scan_incomplete`, `failed`, `foreign_write`, `store`,
    /// `not_ready`).
    pub fn code(&self) -> &'static str {
        match self {
            ReleaseError::InUse(_) => "in_use",
            ReleaseError::ScanIncomplete(_) => "scan_incomplete",
            ReleaseError::Failed(_) => "failed",
            ReleaseError::Foreign(_) => "foreign_write",
            ReleaseError::Store(_) => "store",
            ReleaseError::NotReady => "not_ready",
        }
    }

    /// For error details.
    pub fn failure(&self) -> ReleaseFailure {
        ReleaseFailure { code: self.code().to_string(), message: self.to_string() }
    }
}

/// A fresh open-handle scan of a device's nodes; targets that could not be read make the
/// result unknown (fail closed, docs/design/host.md §5).
pub(crate) fn scan(targets: Result<Vec<PathBuf>, String>) -> HandleScan {
    match targets {
        Ok(t) => proc::scan_open_handles(&t),
        Err(reason) => HandleScan::Unknown { reason },
    }
}

impl Manager {
    /// Releases through the one sequence, retrying transient failures (EBUSY during kernel
    /// teardown, a holder going away) with backoff 250 ms → 2 s within `budget`, never
    /// holding a lock across a sleep (zero: one attempt — the reconciler's next pass is its
    /// retry). On failure a claim stays, `release_pending`, with the attempt count and the
    /// last error; the failure is logged once, here.
    pub(crate) fn release(&self, r: Release<'_>, budget: Duration) -> Result<Released, ReleaseError> {
        let deadline = Instant::now() + budget;
        let mut backoff = Duration::from_millis(250);
        loop {
            match self.release_once(&r) {
                Ok(done) => {
                    if done == Released::Cleared {
                        self.metrics.release(true);
                        self.store.events().publish(EventKind::Released {
                            device: r.device().to_string(),
                            what: r.kind().to_string(),
                            instance_id: r.owner().and_then(|c| c.owner.instance()).map(|i| i.to_string()),
                            owner: r.owner().map(|c| c.owner.clone()),
                            name: r.owner().and_then(|c| c.owner_name.clone()),
                        });
                        match r {
                            Release::Claim(c, _) => {
                                tracing::info!(gpu.device = %c.device, instance.id = %c.owner.instance_label(), owner = %c.owner,
                                instance.name = %c.owner_name.as_deref().unwrap_or("-"), "device released")
                            }
                            _ => tracing::info!(gpu.device = %r.device(), kind = %r.kind(), "device cleared"),
                        }
                    }
                    return Ok(done);
                }
                Err(e) if e.retryable() && Instant::now() + backoff < deadline => {
                    tracing::debug!(gpu.device = %r.device(), error = %e, "release will be retried");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    self.metrics.release(false);
                    self.store.events().publish(EventKind::ReleaseFailed {
                        device: r.device().to_string(),
                        what: r.kind().to_string(),
                        instance_id: r.owner().and_then(|c| c.owner.instance()).map(|i| i.to_string()),
                        owner: r.owner().map(|c| c.owner.clone()),
                        name: r.owner().and_then(|c| c.owner_name.clone()),
                        code: e.code().to_string(),
                        error: e.to_string(),
                    });
                    if let Release::Claim(c, _) = r {
                        self.mark_release_pending(c, &e);
                    } else {
                        tracing::warn!(gpu.device = %r.device(), kind = %r.kind(), error = %e, "device not cleared");
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Keeps a claim whose release failed, `release_pending`, with the attempt count and the
    /// error; logged at WARN when the error is new (a retry failing the same way is DEBUG).
    fn mark_release_pending(&self, claim: &Claim, e: &ReleaseError) {
        let _a = self.alloc();
        if let Ok(Some(mut cur)) = self.store.read_claim(&claim.device) {
            if cur.same_claim(claim) {
                let error = e.to_string();
                let name = claim.owner_name.as_deref().unwrap_or("-");
                if cur.last_error.as_deref() == Some(error.as_str()) {
                    tracing::debug!(gpu.device = %claim.device, instance.id = %claim.owner.instance_label(), owner = %claim.owner, instance.name = %name,
                        error = %e, "release failed again; claim kept release_pending");
                } else {
                    tracing::warn!(gpu.device = %claim.device, instance.id = %claim.owner.instance_label(), owner = %claim.owner, instance.name = %name,
                        error = %e, "release failed; claim kept release_pending");
                }
                cur.state = ClaimState::ReleasePending;
                cur.release_attempts += 1;
                cur.last_error = Some(error);
                if let Err(se) = self.store.update_claim(&cur) {
                    tracing::error!(gpu.device = %claim.device, error = %se, "cannot mark the claim release_pending");
                }
            }
        }
    }

    /// Step 2 (and the re-check of step 3): the device is still ours to clear.
    fn still_ours(&self, r: &Release<'_>) -> Result<bool, ReleaseError> {
        let store_err = |e: crate::store::StoreError| ReleaseError::Store(e.to_string());
        match r {
            Release::Claim(c, _) | Release::Repair { claim: c, .. } => match self.store.read_claim(&c.device) {
                Ok(Some(cur)) if cur.same_claim(c) => Ok(true),
                Ok(Some(_)) => {
                    tracing::warn!(gpu.device = %c.device, "the claim changed since it was read; touching nothing");
                    Ok(false)
                }
                Ok(None) => Ok(false),
                Err(e) => Err(store_err(e)),
            },
            Release::OrphanVf { vf, .. } => {
                if self.store.read_claim(vf).map_err(store_err)?.is_some() {
                    return Ok(false);
                }
                // The sweep never clears a quarantined device.
                Ok(!self.store.read_health(vf).map_err(store_err)?.is_some_and(|h| h.quarantined))
            }
            Release::OrphanMdev(m) => {
                let claimed = self
                    .store
                    .read_claim(&m.parent)
                    .map_err(store_err)?
                    .is_some_and(|c| c.kind.mdev_uuid() == Some(m.uuid));
                let recorded = self.store.scan_mdevs().map_err(store_err)?.records.iter().any(|x| x.uuid == m.uuid);
                Ok(!claimed && recorded)
            }
        }
    }

    /// The device nodes whose holders block the release.
    fn release_targets(&self, r: &Release<'_>) -> Result<Vec<PathBuf>, String> {
        let vf = |bdf: &str, gpu: &str| {
            let info = vendor_vfio::read_vf(&self.host, bdf, gpu.to_string());
            vendor_vfio::vf_targets(&self.host, &info)
        };
        match r {
            Release::Claim(c, _) => match &c.kind {
                ClaimKind::Mdev { uuid, .. } => mdev::targets(&self.host, &uuid.to_string()),
                // The group node, and every function's iommufd cdev.
                ClaimKind::Passthrough(pc) => {
                    let mut t = vec![self.host.vfio_group_node(pc.group)];
                    for f in &pc.functions {
                        t.extend(vendor_vfio::function_targets(&self.host, &f.bdf)?);
                    }
                    t.sort();
                    t.dedup();
                    Ok(t)
                }
                ClaimKind::Vf { .. } => vf(&c.device, &c.gpu),
            },
            Release::Repair { claim, .. } => vf(&claim.device, &claim.gpu),
            Release::OrphanVf { vf: bdf, gpu, .. } => vf(bdf, gpu),
            Release::OrphanMdev(m) => mdev::targets(&self.host, &m.uuid.to_string()),
        }
    }

    /// Steps 4 and 5: the write, its read-back, and its health accounting. Says whether
    /// the write of this release took effect or the device was found clear.
    fn clear_device(&self, r: &Release<'_>) -> Result<Cleared, ReleaseError> {
        let mdev_remove = |uuid: uuid::Uuid, parent: &str, gpu: &str| {
            let res = mdev::remove(&self.host, &uuid.to_string());
            self.write_outcome(parent, gpu, WriteSite::MdevRemove, &res.as_ref().map(|_| ()).map_err(Clone::clone));
            let done = res.map_err(ReleaseError::Failed)?;
            if let Err(e) = self.store.remove_mdev(uuid) {
                // The sweep forgets a record whose mdev is gone.
                tracing::warn!(mdev = %uuid, error = %e, "cannot remove the mdev record");
            }
            Ok(done)
        };
        let (vf, gpu, expected) = match r {
            Release::Claim(c, _) => match &c.kind {
                ClaimKind::Mdev { uuid, .. } => return mdev_remove(*uuid, &c.device, &c.gpu),
                ClaimKind::Passthrough(pc) => return self.give_back_group(c, pc).map(|()| Cleared::Wrote),
                ClaimKind::Vf { type_id } => (c.device.as_str(), c.gpu.as_str(), *type_id),
            },
            Release::OrphanMdev(m) => return mdev_remove(m.uuid, &m.parent, &pf_of(self, &m.parent)),
            Release::OrphanVf { vf, gpu, type_id } => (*vf, *gpu, Some(*type_id)),
            Release::Repair { claim, type_id } => (claim.device.as_str(), claim.gpu.as_str(), Some(*type_id)),
        };
        match vendor_vfio::clear(&self.host, vf, expected) {
            Ok(done) => {
                if done == Cleared::Wrote {
                    self.write_outcome(vf, gpu, WriteSite::ClearType, &Ok(()));
                }
                Ok(done)
            }
            Err(vendor_vfio::ClearError::Foreign { value }) => {
                let detail = format!(
                    "reads type {value}, but gpuvisor {} {}",
                    if matches!(r, Release::Claim(..)) { "recorded" } else { "saw" },
                    expected.map(|t| t.to_string()).unwrap_or_else(|| "no type".into())
                );
                self.quarantine(vf, "foreign_write", &detail);
                Err(ReleaseError::Foreign(detail))
            }
            Err(vendor_vfio::ClearError::Failed(w)) => {
                self.write_outcome(vf, gpu, WriteSite::ClearType, &Err(w.clone()));
                Err(ReleaseError::Failed(w))
            }
        }
    }

    /// Passthrough (docs/design/host.md §7 Give back): the optional reset of the GPU while it is
    /// still on `vfio-pci` (a wedged GPU is quarantined — `reset_failed` — and never reset
    /// again; its functions are still given back), then every function back to the driver
    /// the claim recorded, companions first. A failure names the binding observed.
    fn give_back_group(&self, c: &crate::store::Claim, pc: &PassthroughClaim) -> Result<(), ReleaseError> {
        let observed = || {
            let fns: Vec<passthrough::Function> = pc
                .functions
                .iter()
                .map(|f| passthrough::Function {
                    bdf: f.bdf.clone(),
                    driver: passthrough::driver_of(&self.host, &f.bdf).unwrap_or(Some("unreadable".into())),
                })
                .collect();
            passthrough::binding_line(&fns)
        };
        let failed = |w: WriteError| {
            self.write_outcome(&c.device, &c.device, WriteSite::Rebind, &Err(w.clone()));
            let original: Vec<String> = pc
                .functions
                .iter()
                .map(|f| format!("{}={}", f.bdf, f.original_driver.as_deref().unwrap_or("none")))
                .collect();
            ReleaseError::Failed(WriteError {
                message: format!("{}; bound now: {}; original: {}", w.message, observed(), original.join(" ")),
                errno: w.errno,
            })
        };
        // A binding write that outlived its timeout may still change the group: wait for it.
        if let Some(f) = pc.functions.iter().find(|f| passthrough::write_in_flight(&f.bdf)) {
            return Err(ReleaseError::Failed(WriteError::other(format!(
                "a binding write to {} has not returned yet; its binding is unknown until it does",
                f.bdf
            ))));
        }
        let wedged_before = self.store.read_health(&c.device).ok().flatten().is_some_and(|h| h.reason == RESET_FAILED);
        // Reset once per release: a give-back retried (EBUSY in the teardown lag) does not
        // reset again.
        let reset_done = self
            .store
            .read_claim(&c.device)
            .ok()
            .flatten()
            .is_some_and(|cur| cur.kind.passthrough().is_some_and(|p| p.reset_done));
        let gpu_fn = pc.functions.first().map(|f| f.bdf.as_str()).unwrap_or(c.device.as_str());
        let on_vfio =
            passthrough::driver_of(&self.host, gpu_fn).ok().flatten().as_deref() == Some(passthrough::VFIO_PCI);
        if on_vfio && !wedged_before && !reset_done {
            match passthrough::reset(&self.host, gpu_fn) {
                passthrough::ResetOutcome::Done => self.mark_reset_done(c),
                passthrough::ResetOutcome::Wedged(why) => self.quarantine(&c.device, RESET_FAILED, &why),
                passthrough::ResetOutcome::Failed(w) => return Err(failed(w)),
            }
            crate::crash_point!("pt_release_after_reset");
        }
        for f in pc.functions.iter().rev() {
            passthrough::give_back(&self.host, &f.bdf, f.original_driver.as_deref()).map_err(failed)?;
        }
        self.write_outcome(&c.device, &c.device, WriteSite::Rebind, &Ok(()));
        Ok(())
    }

    /// Records in the claim that its GPU was reset (under the allocation lock; a claim that
    /// changed meanwhile is left alone).
    fn mark_reset_done(&self, c: &crate::store::Claim) {
        let _a = self.alloc();
        if let Ok(Some(mut cur)) = self.store.read_claim(&c.device) {
            if cur.same_claim(c) {
                if let ClaimKind::Passthrough(p) = &mut cur.kind {
                    p.reset_done = true;
                }
                if let Err(e) = self.store.update_claim(&cur) {
                    tracing::warn!(gpu.device = %c.device, error = %e, "cannot record the reset in the claim");
                }
            }
        }
    }

    /// One attempt of the sequence (see the module docs).
    fn release_once(&self, r: &Release<'_>) -> Result<Released, ReleaseError> {
        if !self.startup_observed() {
            return Err(ReleaseError::NotReady);
        }
        {
            let _a = self.alloc();
            if !self.still_ours(r)? {
                return Ok(Released::NotOurs);
            }
        }
        {
            let dev_lock = self.device_lock(r.device());
            let _d = lock(&dev_lock);
            // A concurrent release or claim may have changed things meanwhile.
            if !self.still_ours(r)? {
                return Ok(Released::NotOurs);
            }
            match scan(self.release_targets(r)) {
                HandleScan::Clean => {}
                HandleScan::Held { pids } => return Err(ReleaseError::InUse(pids)),
                HandleScan::Unknown { reason } => return Err(ReleaseError::ScanIncomplete(reason)),
            }
            crate::crash_point!("release_before_write");
            let done = self.clear_device(r)?;
            // An orphan another writer cleared meanwhile: the sweep did nothing.
            if done == Cleared::FoundClear && matches!(r, Release::OrphanVf { .. } | Release::OrphanMdev(_)) {
                return Ok(Released::FoundClear);
            }
        }
        crate::crash_point!("release_after_write");
        if let Release::Claim(c, _) = r {
            let _a = self.alloc();
            if self.still_ours(r)? {
                self.store.remove_claim(&c.device).map_err(|e| ReleaseError::Store(e.to_string()))?;
            }
            crate::crash_point!("release_after_claim_remove");
        }
        Ok(Released::Cleared)
    }
}

/// The PF of an mdev parent (basename of `physfn`, or the parent itself).
pub(crate) fn pf_of(m: &Manager, parent: &str) -> String {
    devices::link_basename(&m.host.pci_device(parent).join("physfn")).unwrap_or_else(|_| parent.to_string())
}

#[cfg(test)]
mod tests {
    /// Nothing outside this module clears a device: the clearing primitives (type `0`, mdev
    /// remove, passthrough reset and give-back) are called here only (their definitions live in `devices`).
    #[test]
    fn only_the_release_module_clears_devices() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut offenders = Vec::new();
        let mut stack = vec![root.clone()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                    continue;
                }
                if p.extension().and_then(|x| x.to_str()) != Some("rs") || p.ends_with("instances/release.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&p).unwrap();
                for (i, line) in text.lines().enumerate() {
                    let code = line.split("//").next().unwrap_or("");
                    if code.contains("vendor_vfio::clear(")
                        || code.contains("mdev::remove(")
                        || code.contains("passthrough::give_back(")
                        || code.contains("passthrough::reset(")
                    {
                        offenders.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                    }
                    // The only write of "0" to a type file is in vendor_vfio::clear.
                    if code.contains("current_vgpu_type")
                        && code.contains("\"0")
                        && !p.ends_with("devices/vendor_vfio.rs")
                    {
                        offenders.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                    }
                }
            }
        }
        assert!(offenders.is_empty(), "devices cleared outside instances/release.rs:\n{}", offenders.join("\n"));
    }
}
