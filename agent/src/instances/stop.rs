//! `instance.stop` (docs/design/lifecycle.md Stop): decide liveness first (unknown → change nothing),
//! mark `stopping`, guest power-off or the kill path until the VMM is provably dead, release
//! the device (a failed release keeps the claim `release_pending`; the stop still
//! succeeds and says so), then `stopped`. Stopping a stopped instance retries a pending
//! release; stopping a `standby` instance discards its saved state.

use super::release::Release;
use super::vmm::OwnedClaim;
use super::Manager;
use crate::error::ApiError;
use crate::host::proc::Liveness;
use crate::store::InstanceState;
use crate::sync::lock;
use crate::wire::{InstanceView, QuarantinedDevice};
use std::time::Duration;

impl Manager {
    /// `instance.stop`. `force` skips the guest power-off; `timeout` bounds the wait for it
    /// (default `stop_timeout_s`).
    pub fn stop(&self, r: &str, force: bool, timeout: Option<Duration>) -> Result<InstanceView, ApiError> {
        self.on_instance("stop", r, |rec| self.stop_found(rec.id, r, force, timeout))
    }

    fn stop_found(
        &self,
        id: uuid::Uuid,
        r: &str,
        force: bool,
        timeout: Option<Duration>,
    ) -> Result<InstanceView, ApiError> {
        let ilock = self.instance_lock(id);
        let _i = lock(&ilock);
        let mut rec = self.store.read_instance(id)?.ok_or_else(|| ApiError::not_found(r))?;
        let was_standby = rec.state() == InstanceState::Standby;
        // A stopped or standby instance has no VMM to stop: it must be provably dead.
        let proven_dead = |rec: &crate::store::InstanceRecord| {
            let boot_id = self.boot_id()?;
            self.prove_dead(rec.id, Some(rec), &boot_id).map_err(|l| {
                ApiError::vmm_liveness_unknown(
                    &rec.name,
                    &format!("a {} instance's VMM is not provably dead ({l})", rec.state()),
                )
            })
        };
        let dead = match rec.state() {
            InstanceState::CleanupPending => return Err(ApiError::instance_cleanup_pending(rec.id, &rec.name)),
            // A standby's VMM is stopped already (unless the agent died before its kill
            // path, which this finishes); its saved state is discarded below.
            InstanceState::Standby if rec.vmm.is_some() => self.stop_vmm(&rec, false)?,
            InstanceState::Standby => proven_dead(&rec)?,
            InstanceState::Deleting => {
                return Err(ApiError::invalid_state(
                    format!("instance {} is being deleted; retry the delete", rec.name),
                    "deleting",
                ))
            }
            InstanceState::Stopped => {
                // A stop cancels a pending restart.
                if rec.restarts.due_ms.is_some() {
                    rec.restarts.due_ms = None;
                    self.store.write_instance(&rec)?;
                }
                proven_dead(&rec)?
            }
            _ => {
                if let Liveness::MaybeAlive { reason } = self.liveness(&rec)? {
                    return Err(ApiError::vmm_liveness_unknown(&rec.name, &reason));
                }
                rec.transition(InstanceState::Stopping)?;
                self.store.write_instance(&rec)?;
                crate::crash_point!("stop_after_stopping_mark");
                let dead = self.stop_vmm_within(&rec, !force, timeout)?;
                crate::crash_point!("stop_after_vmm_dead");
                dead
            }
        };
        // The VMM is provably dead: release (a failed release keeps the claim). A claim that
        // cannot be read is left alone (fail closed); the stop itself is done.
        let mut quarantined = None;
        match self.claim_of(&rec) {
            Ok(OwnedClaim::Claim(c)) => match self.release_noting_quarantine(&rec, &c, dead) {
                Err(e) => rec.last_error = Some(format!("GPU release pending: {e}")),
                Ok(Some(q)) => {
                    rec.last_error = Some(quarantine_note(&q));
                    quarantined = Some(q);
                }
                Ok(None) => {}
            },
            Ok(OwnedClaim::None) => {}
            Ok(OwnedClaim::Unreadable(u)) => {
                rec.last_error = Some(format!(
                    "GPU release pending: the claim record {} cannot be read: {}",
                    u.path.display(),
                    u.error
                ));
            }
            Err(e) => {
                rec.last_error = Some(format!("GPU release pending: the claim records cannot be read: {}", e.message));
            }
        }
        self.remove_taps(&rec);
        rec.vmm = None;
        rec.transition(InstanceState::Stopped)?;
        self.store.write_instance(&rec)?;
        crate::crash_point!("stop_after_stopped");
        if was_standby {
            self.drop_standby_state(rec.id, &rec.name);
        }
        let mut view = self.view_after(&rec);
        view.released_device_quarantined = quarantined;
        Ok(view)
    }

    /// Releases `c` (the claim of `rec`, whose VMM is `dead`) for a stop or delete, retrying
    /// within `release_retry_s`. `Ok(Some(_))`: the device was given back but this release
    /// quarantined it (a passthrough GPU whose reset failed) — a success that must not read
    /// as plain success (logged at ERROR here, once).
    pub(crate) fn release_noting_quarantine(
        &self,
        rec: &crate::store::InstanceRecord,
        c: &crate::store::Claim,
        dead: super::vmm::Dead,
    ) -> Result<Option<QuarantinedDevice>, super::release::ReleaseError> {
        let marked = |d: &str| self.store.read_health(d).ok().flatten().filter(|h| h.quarantined);
        let before = marked(&c.device).is_some();
        self.release(Release::Claim(c, dead), Duration::from_secs(self.cfg.release_retry_s))?;
        let Some(h) = marked(&c.device).filter(|_| !before) else { return Ok(None) };
        tracing::error!(instance.id = %rec.id, instance.name = %rec.name, gpu.device = %c.device,
            reason = %h.reason, "the GPU was given back quarantined");
        Ok(Some(QuarantinedDevice { device: c.device.clone(), reason: h.reason, detail: h.detail }))
    }
}

/// What `last_error` says of a device given back quarantined.
fn quarantine_note(q: &QuarantinedDevice) -> String {
    format!(
        "GPU {} was given back but quarantined ({}: {}): it is not handed out again until an operator repairs it \
         and clears the mark (gpuvisor gpus unquarantine {})",
        q.device, q.reason, q.detail, q.device
    )
}
