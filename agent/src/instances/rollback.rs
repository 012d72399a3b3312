//! Rollback and retention after a failed create or start (docs/design/lifecycle.md Create step 6): stop
//! the VMM if one was spawned and prove it dead, release the claim through the release
//! path; when that fails, keep the claim and turn the instance into a delete-only
//! `cleanup_pending` record (one attempt at that write).

use super::release::Release;
use super::Manager;
use crate::error::{ApiError, CleanupPending, ErrorCode, ReleaseFailure};
use crate::store::{Claim, InstanceRecord, InstanceState, StoreError};
use std::time::Duration;

/// What a failed boot does to the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rollback {
    /// Create: remove the record.
    Remove,
    /// Start: restore `stopped`.
    Stopped,
}

impl Manager {
    /// Undoes the record of a boot that claimed nothing (or whose claim was released).
    pub(crate) fn undo_record(&self, rec: &mut InstanceRecord, mode: Rollback, cause: &ApiError) {
        match mode {
            Rollback::Remove => {
                if let Err(e) = self.store.remove_instance(rec.id) {
                    tracing::error!(instance.id = %rec.id, instance.name = %rec.name, error = %e,
                        "cannot remove the instance record after a failed create");
                }
                self.forget_instance_lock(rec.id);
            }
            Rollback::Stopped => {
                rec.vmm = None;
                rec.last_error = Some(cause.message.clone());
                let res = rec
                    .transition(InstanceState::Stopped)
                    .map_err(ApiError::from)
                    .and_then(|_| Ok(self.store.write_instance(rec)?));
                if let Err(e) = res {
                    tracing::error!(instance.id = %rec.id, instance.name = %rec.name, error = %e, "cannot restore the stopped record");
                }
            }
        }
    }

    /// Rollback after a claim or a spawn: stop the VMM, prove it dead, release through the
    /// release path; retain on failure. Returns the error to answer.
    pub(crate) fn rollback(
        &self,
        mut rec: InstanceRecord,
        claim: Option<Claim>,
        mode: Rollback,
        cause: ApiError,
    ) -> ApiError {
        tracing::info!(instance.id = %rec.id, instance.name = %rec.name, cause = %cause.message, "rolling back");
        // A VMM the spawn itself could not stop (or prove dead) is never proven dead here.
        let stopped = match cause.code {
            ErrorCode::VmmKillFailed | ErrorCode::VmmLivenessUnknown => Err(cause.clone()),
            _ => self.stop_vmm(&rec, false),
        };
        crate::crash_point!("rollback_before_release");
        let released = match (stopped, &claim) {
            (Err(e), _) => Err(ReleaseFailure {
                code: e.code.as_str().to_string(),
                message: format!("the VMM could not be stopped: {}", e.message),
            }),
            (Ok(dead), Some(c)) => self
                .release(Release::Claim(c, dead), Duration::from_secs(self.cfg.release_retry_s))
                .map(|_| ())
                .map_err(|e| e.failure()),
            (Ok(_), None) => Ok(()),
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
    fn retain(&self, mut rec: InstanceRecord, claim: Option<&Claim>, cause: ApiError, why: ReleaseFailure) -> ApiError {
        rec.last_error = Some(format!("{}; release: {}", cause.message, why.message));
        let retained = rec.transition(InstanceState::CleanupPending).is_ok() && self.write_retention(&rec).is_ok();
        ApiError::vgpu_cleanup_pending(CleanupPending {
            instance_id: rec.id,
            device_path: claim.map(|c| self.device_path(c)),
            retained,
            cause: Some(cause),
            release: why,
        })
    }

    /// The one attempt at the retention write (failpoint `retain_write`).
    fn write_retention(&self, rec: &InstanceRecord) -> Result<(), StoreError> {
        fail::fail_point!("retain_write", |_| Err(StoreError::Io {
            path: self.store.instance_dir(rec.id),
            source: std::io::Error::other("failpoint retain_write"),
        }));
        let res = self.store.write_instance(rec);
        if let Err(e) = &res {
            tracing::error!(instance.id = %rec.id, instance.name = %rec.name, error = %e,
                "the retention write failed; the claim stays for the reconciler");
        }
        res
    }
}
