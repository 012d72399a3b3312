//! `instance.delete` (docs/design/lifecycle.md Delete): decide liveness first, mark `deleting`, the kill
//! path, release the device **before** any other teardown; a failed release (or a claim
//! that cannot be read) turns the instance into `cleanup_pending` with its claim retained;
//! success removes the record, its directory and its name.

use super::vmm::OwnedClaim;
use super::Manager;
use crate::error::{ApiError, CleanupPending, ReleaseFailure};
use crate::host::proc::Liveness;
use crate::store::{Claim, InstanceRecord, InstanceState};
use crate::sync::lock;
use crate::wire::DeleteResult;

impl Manager {
    /// `instance.delete`.
    pub fn delete(&self, r: &str) -> Result<DeleteResult, ApiError> {
        self.on_instance("delete", r, |rec| self.delete_found(rec.id, r))
    }

    fn delete_found(&self, id: uuid::Uuid, r: &str) -> Result<DeleteResult, ApiError> {
        let ilock = self.instance_lock(id);
        let _i = lock(&ilock);
        let mut rec = self.store.read_instance(id)?.ok_or_else(|| ApiError::not_found(r))?;
        if let Liveness::MaybeAlive { reason } = self.liveness(&rec)? {
            return Err(ApiError::vmm_liveness_unknown(&rec.name, &reason));
        }
        let owned = self.claim_of(&rec)?;
        if rec.state() != InstanceState::Deleting {
            rec.transition(InstanceState::Deleting)?;
            match self.store.write_instance(&rec) {
                Ok(()) => {}
                // Nothing to protect without a device: an instance must stay deletable on a
                // full disk.
                Err(e) if matches!(owned, OwnedClaim::None) => {
                    tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, error = %e,
                        "cannot mark deleting; continuing (no device)")
                }
                Err(e) => return Err(e.into()),
            }
        }
        crate::crash_point!("delete_after_deleting_mark");
        let dead = self.stop_vmm(&rec, false)?;
        crate::crash_point!("delete_after_vmm_dead");
        self.remove_taps(&rec);
        let mut quarantined = None;
        match &owned {
            OwnedClaim::Claim(c) => match self.release_noting_quarantine(&rec, c, dead) {
                Ok(q) => quarantined = q,
                Err(e) => return Err(self.retain_on_delete(rec, Some(c), e.failure())),
            },
            OwnedClaim::Unreadable(u) => {
                let why = ReleaseFailure {
                    code: "store".into(),
                    message: format!(
                        "the claim record {} cannot be read ({}); repair or remove it, then delete again",
                        u.path.display(),
                        u.error
                    ),
                };
                return Err(self.retain_on_delete(rec, None, why));
            }
            OwnedClaim::None => {}
        }
        crate::crash_point!("delete_after_release");
        self.store.remove_instance(rec.id)?;
        self.remove_vm_cgroup(rec.id);
        self.forget_instance_lock(rec.id);
        tracing::info!(instance.id = %rec.id, instance.name = %rec.name, "instance deleted");
        Ok(DeleteResult { id: rec.id.to_string(), deleted: true, released_device_quarantined: quarantined })
    }

    /// A delete whose release failed: the instance becomes `cleanup_pending`, its claim
    /// retained; a later delete (or the reconciler) retries.
    fn retain_on_delete(&self, mut rec: InstanceRecord, claim: Option<&Claim>, why: ReleaseFailure) -> ApiError {
        rec.vmm = None;
        rec.last_error = Some(format!("GPU release failed: {}", why.message));
        let retained = rec.transition(InstanceState::CleanupPending).is_ok() && self.store.write_instance(&rec).is_ok();
        ApiError::vgpu_cleanup_pending(CleanupPending {
            instance_id: rec.id,
            device_path: claim.map(|c| self.device_path(c)),
            retained,
            cause: None,
            release: why,
        })
    }
}
