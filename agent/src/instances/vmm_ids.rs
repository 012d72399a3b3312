//! # instances::vmm_ids — a uid/gid of its own for every instance's VMM
//!
//! Every instance's VMM runs under an id of `vmm_ids` that no other instance has
//! (ARCHITECTURE.md "Isolation between VMs"): uid = gid = the id. The id is recorded
//! **before** the first spawn, durably and in this order — `vmm-ids/<uid>.json` created
//! exclusively (`renameat2(RENAME_NOREPLACE)`, like a claim), then the instance record's
//! `vmm_id` — and kept for the instance's whole life, so its files and sockets keep one
//! owner across restarts.
//!
//! An id is **in use** while anything of an owner remains: its record (readable or not), a
//! process holding it as any uid or gid (`/proc/*/status`), an entry of an instance's VMM
//! directory owned by it (or the directory's group), a VFIO group node given to its group.
//! A new id is the lowest one not in use. A crash between the two writes leaves an id
//! record naming the instance, which its next spawn adopts; the record of a deleted
//! instance is removed with its directory ([`crate::store::Store::remove_instance`]); one
//! left by a crash in between is removed by the next allocation once nothing of its owner
//! remains. An unreadable record keeps its id taken (unknown is not free).
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
    /// the two writes), else a new one. `rec.vmm_id` is set and the record written.
    ///
    /// Errors: `vmm_start_failed` when every id of `vmm_ids` is in use or the id the record
    /// names belongs to another instance; `not_ready` when `/proc` cannot be read (who holds
    /// an id cannot be known); store errors.
    pub(crate) fn vmm_id(&self, rec: &mut InstanceRecord) -> Result<u32, ApiError> {
        let _a = self.alloc();
        if let Some(uid) = rec.vmm_id {
            match self.store.read_vmm_id(uid)? {
                Some(r) if r.instance_id == rec.id => return Ok(uid),
                Some(r) => {
                    return Err(ApiError::vmm_start_failed(
                        format!(
                            "instance {} names VMM id {uid}, which vmm-ids/{uid}.json gives to instance {} ({}); \
                             the VMM is not started",
                            rec.name, r.name, r.instance_id
                        ),
                        None,
                    ))
                }
                None => {}
            }
        }
        let ids = self.store.scan_vmm_ids()?;
        if let Some(r) = ids.records.iter().find(|r| r.instance_id == rec.id) {
            let uid = r.uid;
            return self.record_vmm_id(rec, uid);
        }
        let in_use = self.ids_in_use(&ids, rec)?;
        let range = self.cfg.vmm_ids;
        let mut taken = in_use;
        // A record named in the instance (its id file lost): keep that id if it is free.
        let preferred = rec.vmm_id.filter(|u| range.contains(*u) && !taken.contains_key(u));
        let mut candidate = preferred.or_else(|| lowest_free(range.first, range.last(), &taken));
        while let Some(uid) = candidate {
            let r = VmmIdRecord { uid, instance_id: rec.id, name: rec.name.clone(), assigned_at: now_rfc3339() };
            match self.store.create_vmm_id(&r) {
                Ok(()) => {
                    crate::crash_point!("vmm_id_after_record");
                    return self.record_vmm_id(rec, uid);
                }
                Err(StoreError::ClaimExists { .. }) => {
                    taken.insert(uid, "a record created meanwhile".into());
                    candidate = lowest_free(range.first, range.last(), &taken);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::vmm_start_failed(
            format!(
                "no VMM id is free in vmm_ids ({}…{}: {} in use); widen vmm_ids or delete instances",
                range.first,
                range.last(),
                taken.len()
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

    /// Every id of `vmm_ids` in use and what holds it (see the module docs; the files of
    /// `rec`'s own VMM directory under the id its record names do not count). Removes, as
    /// it goes, the records of instances that are gone and of which nothing else remains.
    fn ids_in_use(
        &self,
        ids: &crate::store::Listing<VmmIdRecord>,
        rec: &InstanceRecord,
    ) -> Result<BTreeMap<u32, String>, ApiError> {
        use std::os::unix::fs::MetadataExt;
        let range = self.cfg.vmm_ids;
        let own_dir = self.store.vmm_dir(rec.id);
        let mut used: BTreeMap<u32, String> = BTreeMap::new();
        let procs = crate::host::proc::ids_held(range.first, range.last())
            .map_err(|e| ApiError::not_ready(format!("which VMM ids are held by processes cannot be read: {e}")))?;
        for (id, pid) in &procs {
            used.insert(*id, format!("process {pid}"));
        }
        // Owners of what the VMM directories hold (a VMM creates only there).
        let instances = self.store.root().join("instances");
        for inst in std::fs::read_dir(&instances).map_err(ApiError::internal)?.flatten() {
            let vmm = inst.path().join(crate::hypervisor::confine::VMM_DIR);
            let Ok(rd) = std::fs::read_dir(&vmm) else { continue };
            let mut paths = vec![vmm.clone()];
            paths.extend(rd.flatten().map(|e| e.path()));
            for p in paths {
                if let Ok(m) = std::fs::symlink_metadata(&p) {
                    for id in [m.uid(), m.gid()].into_iter().filter(|i| range.contains(*i)) {
                        if p.starts_with(&own_dir) && rec.vmm_id == Some(id) {
                            continue;
                        }
                        used.entry(id).or_insert_with(|| format!("file {}", p.display()));
                    }
                }
            }
        }
        // VFIO group nodes given to a VMM's group.
        if let Ok(rd) = std::fs::read_dir(self.host.vfio_dir()) {
            for e in rd.flatten() {
                if let Ok(m) = std::fs::symlink_metadata(e.path()) {
                    if range.contains(m.gid()) {
                        used.entry(m.gid()).or_insert_with(|| format!("device node {}", e.path().display()));
                    }
                }
            }
        }
        for u in &ids.unreadable {
            if let Ok(id) = u.key.parse::<u32>() {
                used.insert(id, format!("unreadable record {}: {}", u.path.display(), u.error));
            }
        }
        for r in &ids.records {
            let gone = !self.store.instance_dir(r.instance_id).exists();
            if gone && !used.contains_key(&r.uid) {
                // Nothing of its owner remains: a delete that crashed before freeing it.
                match self.store.remove_vmm_id(r.uid) {
                    Ok(()) => {
                        tracing::info!(vmm_id = r.uid, instance.id = %r.instance_id, instance.name = %r.name,
                            "VMM id of a deleted instance freed");
                        continue;
                    }
                    Err(e) => tracing::warn!(vmm_id = r.uid, error = %e, "a stale VMM id record cannot be removed"),
                }
            }
            used.entry(r.uid).or_insert_with(|| format!("instance {} ({})", r.name, r.instance_id));
        }
        tracing::debug!(in_use = used.len(), first = ?used.iter().next(), "VMM ids in use");
        Ok(used)
    }
}

/// The lowest id of `first..=last` not in `taken`.
fn lowest_free<T>(first: u32, last: u32, taken: &BTreeMap<u32, T>) -> Option<u32> {
    let mut next = first;
    for (&id, _) in taken.range(first..=last) {
        if id > next {
            return Some(next);
        }
        next = id.checked_add(1)?;
    }
    (next <= last).then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_free_id_skips_every_taken_one() {
        let taken: BTreeMap<u32, ()> = [(10, ()), (11, ()), (13, ()), (99, ())].into_iter().collect();
        assert_eq!(lowest_free(10, 20, &taken), Some(12));
        assert_eq!(lowest_free(5, 20, &taken), Some(5));
        let full: BTreeMap<u32, ()> = (10..=12).map(|i| (i, ())).collect();
        assert_eq!(lowest_free(10, 12, &full), None);
        assert_eq!(lowest_free(10, 13, &full), Some(13));
        assert_eq!(lowest_free(u32::MAX - 1, u32::MAX - 1, &BTreeMap::<u32, ()>::new()), Some(u32::MAX - 1));
    }
}
