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
//! count and the last error. The clear itself (step 4) is the device kind's
//! [`devices::Backend::clear`]; nothing else in the tree calls it (the primitives behind it
//! are private to `devices/`, and a test checks that no other file calls a backend's clear).

use super::vmm::Dead;
use super::Manager;
use crate::devices::{self, ClearError, ClearSteps, Cleared, DeviceError, Held, WriteError, WriteSite};
use crate::error::ReleaseFailure;
use crate::events::EventKind;
use crate::host::proc::{self, HandleScan};
use crate::store::{Claim, ClaimKind, ClaimState, MdevRecord};
use crate::sync::lock;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use crate::devices::passthrough::RESET_FAILED;

/// What to release.
#[derive(Debug, Clone, Copy)]
pub enum Release<'a> {
    /// A claim whose owner is provably dead (or absent).
    Claim(&'a Claim, Dead),
    /// A dirty VF with no claim that the sweep may clear (`type_id`: what it read).
    OrphanVf {
        /// The VF's address.
        vf: &'a str,
        /// Its GPU (PF).
        gpu: &'a str,
        /// The type id it read.
        type_id: u32,
    },
    /// One of gpuvisor's own mdevs that no claim names.
    OrphanMdev(&'a MdevRecord),
    /// A dirty VF that `claim` (ours, durable) picked: cleared before its type is written.
    Repair {
        /// The claim that picked the VF.
        claim: &'a Claim,
        /// The type id it read.
        type_id: u32,
    },
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
pub(crate) fn scan(targets: Result<Vec<PathBuf>, DeviceError>) -> HandleScan {
    match targets {
        Ok(t) => proc::scan_open_handles(&t),
        Err(e) => HandleScan::Unknown { reason: e.to_string() },
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

    /// The device the release acts on, as its backend sees it: a claim's own record; a
    /// dirty VF (orphan or repair) with the type it read; an orphan mdev on its parent.
    fn with_held<T>(&self, r: &Release<'_>, f: impl FnOnce(&Held<'_>) -> T) -> T {
        match r {
            Release::Claim(c, _) => f(&Held::of(c)),
            Release::Repair { claim, type_id } => {
                f(&Held { device: &claim.device, gpu: &claim.gpu, kind: &ClaimKind::Vf { type_id: Some(*type_id) } })
            }
            Release::OrphanVf { vf, gpu, type_id } => {
                f(&Held { device: vf, gpu, kind: &ClaimKind::Vf { type_id: Some(*type_id) } })
            }
            Release::OrphanMdev(m) => f(&Held {
                device: &m.parent,
                gpu: &pf_of(self, &m.parent),
                kind: &ClaimKind::Mdev { uuid: m.uuid, mdev_type: m.mdev_type.clone(), type_id: None },
            }),
        }
    }

    /// The device nodes whose holders block the release (the backend's).
    fn release_targets(&self, r: &Release<'_>) -> Result<Vec<PathBuf>, DeviceError> {
        self.with_held(r, |h| devices::backend(h.kind).release_targets(&self.host, h))
    }

    /// Steps 4 and 5: the write, its read-back (the backend's clear), and its health
    /// accounting. Says whether the write of this release took effect or the device was
    /// found clear. A VF reading a type gpuvisor did not write is quarantined, untouched.
    fn clear_device(&self, r: &Release<'_>) -> Result<Cleared, ReleaseError> {
        let steps = Steps { m: self, claim: r.owner().filter(|_| matches!(r, Release::Claim(..))) };
        self.with_held(r, |h| match devices::backend(h.kind).clear(&self.host, h, &steps) {
            Ok(done) => Ok(done),
            Err(ClearError::Failed(w)) => Err(ReleaseError::Failed(w)),
            Err(ClearError::Foreign { value }) => {
                let detail = format!(
                    "reads type {value}, but gpuvisor {} {}",
                    if matches!(r, Release::Claim(..)) { "recorded" } else { "saw" },
                    h.kind.type_id().map(|t| t.to_string()).unwrap_or_else(|| "no type".into())
                );
                self.marks().quarantine(h.device, "foreign_write", &detail);
                Err(ReleaseError::Foreign(detail))
            }
        })
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

/// The release path's side of a backend's clear: each write goes to the health
/// accounting, a passthrough reset is recorded in the claim, a removed mdev's record goes.
struct Steps<'a> {
    m: &'a Manager,
    /// The claim being released (none for an orphan or a repair).
    claim: Option<&'a Claim>,
}

impl ClearSteps for Steps<'_> {
    fn write_outcome(&self, device: &str, gpu: &str, site: WriteSite, result: &Result<(), WriteError>) {
        self.m.marks().write_outcome(device, gpu, site, result);
    }

    fn quarantine(&self, device: &str, reason: &str, detail: &str) {
        self.m.marks().quarantine(device, reason, detail);
    }

    fn may_reset(&self, device: &str) -> bool {
        let wedged_before = self.m.store.read_health(device).ok().flatten().is_some_and(|h| h.reason == RESET_FAILED);
        let reset_done = self
            .m
            .store
            .read_claim(device)
            .ok()
            .flatten()
            .is_some_and(|cur| cur.kind.passthrough().is_some_and(|p| p.reset_done));
        !wedged_before && !reset_done
    }

    fn reset_done(&self) {
        if let Some(c) = self.claim {
            self.m.mark_reset_done(c);
        }
    }

    fn mdev_removed(&self, uuid: uuid::Uuid) {
        if let Err(e) = self.m.store.remove_mdev(uuid) {
            // The sweep forgets a record whose mdev is gone.
            tracing::warn!(mdev = %uuid, error = %e, "cannot remove the mdev record");
        }
    }
}

/// The PF of an mdev parent (basename of `physfn`, or the parent itself).
pub(crate) fn pf_of(m: &Manager, parent: &str) -> String {
    devices::link_basename(&m.host.pci_device(parent).join("physfn")).unwrap_or_else(|_| parent.to_string())
}

#[cfg(test)]
mod tests {
    /// Nothing outside this module clears a device. The clearing primitives (type `0`, mdev
    /// remove, passthrough reset and give-back) are private to their kind's file in
    /// `devices/` (the compiler keeps them there); the one way to them is
    /// `Backend::clear`, which takes the release path's `ClearSteps`. So: no other file
    /// calls a backend's `clear` (a `.clear(` call given the host), implements or names
    /// `ClearSteps` (outside `devices/`, which defines the trait), or writes `"0"` to a type
    /// file. A file's test module (`#[cfg(test)] mod tests` / `mod testing`, at its end) is
    /// not shipped and not checked: the backends' unit tests clear temp-dir trees.
    #[test]
    fn only_the_release_module_clears_devices() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let offenders = offenders_under(&root);
        assert!(offenders.is_empty(), "devices cleared outside instances/release.rs:\n{}", offenders.join("\n"));
    }

    /// The check above finds a backend clear called from another file (a copy of this
    /// tree's `instances/` with one added call).
    #[test]
    fn the_clear_check_finds_a_clear_called_from_another_file() {
        let dir = tempfile::tempdir().unwrap();
        let inst = dir.path().join("instances");
        std::fs::create_dir_all(&inst).unwrap();
        std::fs::write(
            inst.join("stop.rs"),
            "fn f(m: &Manager, c: &Claim) {\n    let _ = devices::backend(&c.kind).clear(&m.host, &Held::of(c), &steps);\n}\n",
        )
        .unwrap();
        std::fs::write(inst.join("reconcile.rs"), "struct S;\nimpl ClearSteps for S {}\n").unwrap();
        std::fs::write(inst.join("release.rs"), "fn g() { backend(k).clear(&self.host, h, &steps); }\n").unwrap();
        // A test module at the end of a file may clear a temp tree; the code above it may not.
        std::fs::write(
            inst.join("health.rs"),
            "fn h() {}\n#[cfg(test)]\nfn x() { b.clear(&t.host, h, &s); }\n#[cfg(test)]\nmod tests {\n    fn t() { b.clear(&t.host, h, &s); }\n}\n",
        )
        .unwrap();
        let found = offenders_under(dir.path());
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found.iter().any(|o| o.contains("health.rs:3")), "{found:?}");
        assert!(found.iter().any(|o| o.contains("stop.rs:2")), "{found:?}");
        assert!(found.iter().any(|o| o.contains("reconcile.rs:2")), "{found:?}");
    }

    fn offenders_under(root: &std::path::Path) -> Vec<String> {
        let mut offenders = Vec::new();
        let mut stack = vec![root.to_path_buf()];
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
                let in_devices = p.parent().is_some_and(|d| d.ends_with("devices"));
                let text = std::fs::read_to_string(&p).unwrap();
                // Test code (a file's test module, at its end) may clear a temp tree.
                let lines: Vec<&str> = text.lines().collect();
                let shipped = lines
                    .windows(2)
                    .position(|w| {
                        w[0] == "#[cfg(test)]" && (w[1].ends_with("mod tests {") || w[1].ends_with("mod testing {"))
                    })
                    .unwrap_or(lines.len());
                for (i, line) in lines[..shipped].iter().enumerate() {
                    let code = line.split("//").next().unwrap_or("");
                    let backend_clear = code.contains(".clear(") && code.contains("host");
                    let names_steps = !in_devices && code.contains("ClearSteps");
                    // The only write of "0" to a type file is in devices/vendor_vfio.rs.
                    let zero_type = code.contains("current_vgpu_type")
                        && code.contains("\"0")
                        && !p.ends_with("devices/vendor_vfio.rs");
                    if backend_clear || names_steps || zero_type {
                        offenders.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                    }
                }
            }
        }
        offenders
    }
}
