//! # instances::vmm_ids — a uid/gid of its own for every instance's VMM
//!
//! Every instance's VMM runs under an id of `vmm_ids` that no other instance has
//! (docs/design/architecture.md "Isolation between VMs"): uid = gid = the id. The id is recorded
//! **before** the first spawn, durably and in this order — `vmm-ids/<uid>.json` created
//! exclusively (`renameat2(RENAME_NOREPLACE)`, like a claim), then the instance record's
//! `vmm_id` — and kept for the instance's whole life, so its files and sockets keep one
//! owner across restarts.
//!
//! **Never reused while anything of its owner remains.** An id is taken while its record
//! exists (readable or not: unknown is not free) and while any visible process holds it as
//! a uid or gid (`/proc/*/status`, zombies aside) or a VFIO group node is given to its
//! group. Files: a VMM can create files only in its instance's VMM directory (its view holds
//! nothing else writable, besides `vmm_shared_paths`), and delete removes that directory
//! before the id's record ([`crate::store::Store::remove_instance`]): while any file of an
//! owner remains, so does its record. A record whose instance directory is gone (a delete
//! that crashed between the two) is removed by the next allocation that meets it, once no
//! process holds the id.
//!
//! **Which id.** An instance's candidates start at a point of the range given by a hash of
//! its id and go on in order, so a new id costs O(1) lookups however many instances exist
//! (a create stays O(1) in the number of records), and a crash between the two writes is
//! recovered without a scan: the instance's next spawn meets the record naming it at its
//! first candidate and adopts it.
//!
//! Allocation runs under the allocation lock (two allocations, or an allocation and the
//! removal of a stale record, never interleave).

use std::collections::BTreeMap;

use super::{now_rfc3339, Manager};
use crate::error::ApiError;
use crate::store::{InstanceRecord, StoreError, VmmIdRecord};

impl Manager {
    /// The id `rec`'s VMM runs under, recorded before it is returned (see the module docs):
    /// the one the record names, else one an id record gives this instance (a crash between
    /// the two writes), else a free one. `rec.vmm_id` is set and the record written.
    ///
    /// Errors: `vmm_start_failed` when every id of `vmm_ids` is taken or the id the record
    /// names belongs to another instance; `not_ready` when `/proc` cannot be read (who
    /// holds an id cannot be known); store errors.
    pub(crate) fn vmm_id(&self, rec: &mut InstanceRecord) -> Result<u32, ApiError> {
        let _a = self.alloc();
        let range = self.cfg.vmm_ids;
        if let Some(uid) = rec.vmm_id {
            if let Some(r) = self.store.read_vmm_id(uid)? {
                if r.instance_id == rec.id {
                    return Ok(uid);
                }
                return Err(ApiError::vmm_start_failed(
                    format!(
                        "instance {} names VMM id {uid}, which vmm-ids/{uid}.json gives to instance {} ({}); \
                         the VMM is not started",
                        rec.name, r.name, r.instance_id
                    ),
                    None,
                ));
            }
        }
        let held = self.ids_held()?;
        // The id the record names (its id record lost) first, then the instance's own
        // sequence of candidates.
        let (first, count) = (u64::from(range.first), u64::from(range.count));
        let start = crate::network::fnv1a64(rec.id.as_bytes()) % count;
        let sequence = (0..count).map(|k| (first + (start + k) % count) as u32);
        for uid in rec.vmm_id.filter(|u| range.contains(*u)).into_iter().chain(sequence) {
            match self.store.read_vmm_id(uid) {
                Ok(Some(r)) if r.instance_id == rec.id => return self.record_vmm_id(rec, uid),
                Ok(Some(r)) => {
                    // A record of a deleted instance (its directory gone) frees its id once
                    // no process holds it.
                    if self.store.instance_dir(r.instance_id).exists() || held.contains_key(&uid) {
                        continue;
                    }
                    self.store.remove_vmm_id(uid)?;
                    tracing::info!(vmm_id = uid, instance.id = %r.instance_id, instance.name = %r.name,
                        "VMM id of a deleted instance freed");
                }
                Ok(None) => {}
                // Unreadable: its owner cannot be known, the id is taken.
                Err(e) => {
                    tracing::debug!(vmm_id = uid, error = %e, "VMM id record unreadable: skipped");
                    continue;
                }
            }
            if let Some(by) = held.get(&uid) {
                tracing::debug!(vmm_id = uid, held_by = %by, "VMM id held: skipped");
                continue;
            }
            let r = VmmIdRecord { uid, instance_id: rec.id, name: rec.name.clone(), assigned_at: now_rfc3339() };
            match self.store.create_vmm_id(&r) {
                Ok(()) => {
                    crate::crash_point!("vmm_id_after_record");
                    return self.record_vmm_id(rec, uid);
                }
                Err(StoreError::ClaimExists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::vmm_start_failed(
            format!(
                "no VMM id is free in vmm_ids ({}…{}, {} ids): each is recorded for an instance or held by a \
                 process; widen vmm_ids or delete instances",
                range.first,
                range.last(),
                range.count
            ),
            None,
        ))
    }

    /// Writes `uid` into the instance record (durable before the spawn).
    fn record_vmm_id(&self, rec: &mut InstanceRecord, uid: u32) -> Result<u32, ApiError> {
        if rec.vmm_id != Some(uid) {
            rec.vmm_id = Some(uid);
            self.store.write_instance(rec)?;
            tracing::info!(instance.id = %rec.id, instance.name = %rec.name, vmm_id = uid, "VMM id recorded");
        }
        crate::crash_point!("vmm_id_after_instance");
        Ok(uid)
    }

    /// The ids of `vmm_ids` a process or a VFIO group node holds, and what holds each.
    fn ids_held(&self) -> Result<BTreeMap<u32, String>, ApiError> {
        use std::os::unix::fs::MetadataExt;
        let range = self.cfg.vmm_ids;
        let procs = crate::host::proc::ids_held(range.first, range.last())
            .map_err(|e| ApiError::not_ready(format!("which VMM ids are held by processes cannot be read: {e}")))?;
        let mut held: BTreeMap<u32, String> =
            procs.into_iter().map(|(id, pid)| (id, format!("process {pid}"))).collect();
        if let Ok(rd) = std::fs::read_dir(self.host.vfio_dir()) {
            for e in rd.flatten() {
                if let Ok(m) = std::fs::symlink_metadata(e.path()) {
                    if range.contains(m.gid()) {
                        held.entry(m.gid()).or_insert_with(|| format!("device node {}", e.path().display()));
                    }
                }
            }
        }
        Ok(held)
    }
}
