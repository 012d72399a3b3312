//! `instance.start` (docs/design/lifecycle.md Start): release a claim left from an earlier failed
//! release first (persisted), clear the previous VMM identity (persisted) before the new
//! claim is written, then claim, configure and spawn as create does.

use super::rollback::Rollback;
use super::vmm::OwnedClaim;
use super::Manager;
use crate::error::{ApiError, ReleaseFailure};
use crate::host::proc::Liveness;
use crate::store::InstanceState;
use crate::sync::lock;
use crate::wire::InstanceView;
use std::time::Duration;

impl Manager {
    /// `instance.start`.
    pub fn start(&self, r: &str) -> Result<InstanceView, ApiError> {
        self.on_instance("start", r, |rec| self.start_found(rec.id, r, false))
    }

    /// A restart under the restart policy (`supervise`): the start path, keeping the count
    /// of restarts (a start by hand resets it).
    pub(crate) fn start_restarting(&self, id: uuid::Uuid) -> Result<InstanceView, ApiError> {
        let r = id.to_string();
        self.on_instance("restart", &r, |rec| self.start_found(rec.id, &r, true))
    }

    pub(crate) fn start_found(&self, id: uuid::Uuid, r: &str, restarting: bool) -> Result<InstanceView, ApiError> {
        let ilock = self.instance_lock(id);
        let _i = lock(&ilock);
        let rec = self.store.read_instance(id)?.ok_or_else(|| ApiError::not_found(r))?;
        self.start_locked(rec, restarting, None)
    }

    /// The start path under the instance lock. `incoming`: a saved memory state to resume
    /// (a running snapshot's restore); a `standby` instance resumes its own, which this
    /// start consumes (`standby` → `starting`: a failed or interrupted resume leaves the
    /// instance `stopped`, never resumed twice from the same memory, `saves`).
    pub(crate) fn start_locked(
        &self,
        mut rec: crate::store::InstanceRecord,
        restarting: bool,
        mut incoming: Option<std::path::PathBuf>,
    ) -> Result<InstanceView, ApiError> {
        let mut resuming_standby = false;
        match rec.state() {
            InstanceState::CleanupPending => return Err(ApiError::instance_cleanup_pending(rec.id, &rec.name)),
            InstanceState::Stopped => {}
            InstanceState::Standby => {
                incoming = Some(self.standby_memory(&rec)?);
                resuming_standby = true;
            }
            // A VMM that exited behind the agent's back (the next reconcile pass would record
            // it): with its recorded identity provably dead and the instance lock ours, the
            // record is stale — record it stopped and start.
            InstanceState::Running if rec.vmm.is_some() && matches!(self.liveness(&rec)?, Liveness::Dead) => {
                rec.transition(InstanceState::Stopped)?;
                rec.vmm = None;
                rec.last_error = Some("the VMM exited".into());
                self.store.write_instance(&rec)?;
                self.metrics.vm_died();
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, "the recorded VMM had exited; starting again");
            }
            s => {
                return Err(ApiError::invalid_state(
                    format!("instance {} is {}, not stopped", rec.name, s.as_str()),
                    s.as_str(),
                ))
            }
        }
        // What the host can give (before anything is released or claimed).
        self.check_host_room(rec.vcpus, rec.memory_mib)?;
        let framework = rec.gpu_framework.map(Into::into);
        if let Some(why) = rec.hypervisor.cannot_attach(framework, self.cfg.vfio_attach) {
            return Err(ApiError::hypervisor_unsupported(why, Some(rec.hypervisor.name()), None));
        }
        // A claim left from an earlier failed release goes first, persisted.
        match self.claim_of(&rec)? {
            OwnedClaim::Claim(old) => {
                // Nothing is released before the startup pass has a complete observation
                // (I13): say `not_ready`, which is retryable, not `gpu_release_pending`.
                self.require_ready()?;
                let boot_id = self.boot_id()?;
                let dead = self.prove_dead(rec.id, Some(&rec), &boot_id).map_err(|l| {
                    ApiError::vmm_liveness_unknown(&rec.name, &format!("its VMM is not provably dead ({l})"))
                })?;
                self.release(super::release::Release::Claim(&old, dead), Duration::from_secs(self.cfg.release_retry_s))
                    .map_err(|e| ApiError::gpu_release_pending(&rec.name, &old.device, &e.failure()))?;
            }
            OwnedClaim::Unreadable(u) => {
                return Err(ApiError::gpu_release_pending(
                    &rec.name,
                    &u.key,
                    &ReleaseFailure {
                        code: "store".into(),
                        message: format!("the claim record {} cannot be read: {}", u.path.display(), u.error),
                    },
                ))
            }
            OwnedClaim::None => {}
        }
        let id = rec.id;
        rec.vmm = None;
        rec.transition(InstanceState::Starting)?;
        rec.last_error = None;
        if !restarting {
            rec.restarts = Default::default();
        }
        self.store.write_instance(&rec)?;
        crate::crash_point!("start_after_clear_identity");
        let name = rec.name.clone();
        let booted = self.boot(rec, Rollback::Stopped, incoming);
        if resuming_standby {
            self.drop_standby_state(id, &name);
        }
        Ok(self.view_after(&booted?))
    }
}
