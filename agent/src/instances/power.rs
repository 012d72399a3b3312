//! `instance.reset` and `instance.reboot`: the two ways to start a running guest over.
//!
//! - **Reset** is the VM's reset button, in place: the hypervisor resets the machine (QMP
//!   `system_reset`; Cloud Hypervisor `vm.reboot`), the VMM process, its identity, its claim
//!   and its devices stay, and the guest starts over without shutting down (like a host
//!   reset, what it had not written to its disk is lost). Nothing is recorded: the instance
//!   stays `running`.
//! - **Reboot** is a stop and a start, as Proxmox's `qm reboot`: the guest is asked to power
//!   off (or killed with `force`), its device released through the release guard, then the
//!   start path runs — so a definition changed since the last start applies, and a GPU
//!   instance claims a device again like any start. A stop that fails answers that error and
//!   starts nothing; a start that fails leaves the instance `stopped` and answers why.

use super::Manager;
use crate::error::ApiError;
use crate::store::InstanceState;
use crate::sync::lock;
use crate::wire::InstanceView;
use std::time::Duration;

impl Manager {
    /// `instance.reset`. Errors: `not_found`, `invalid_state` (not running),
    /// `instance_cleanup_pending`, `internal` (the VMM refused or did not answer).
    pub fn reset(&self, r: &str) -> Result<InstanceView, ApiError> {
        self.on_instance("reset", r, |found| {
            // Answered at once, not after a delete that holds the lock.
            if found.state() == InstanceState::Deleting {
                return Err(ApiError::invalid_state(format!("instance {} is being deleted", found.name), "deleting"));
            }
            let ilock = self.instance_lock(found.id);
            let _i = lock(&ilock);
            let rec = self.store.read_instance(found.id)?.ok_or_else(|| ApiError::not_found(r))?;
            match (rec.state(), &rec.vmm) {
                (InstanceState::CleanupPending, _) => Err(ApiError::instance_cleanup_pending(rec.id, &rec.name)),
                (InstanceState::Running, Some(vmm)) => {
                    let io = Duration::from_secs(self.cfg.vmm_ready_timeout_s);
                    rec.hypervisor.driver().reset(&vmm.control_socket, io).map_err(|e| {
                        ApiError::internal(format!("the {} VMM of {} did not reset: {e}", rec.hypervisor, rec.name))
                    })?;
                    tracing::info!(instance.id = %rec.id, instance.name = %rec.name, pid = vmm.identity.pid,
                        "VM reset in place");
                    Ok(self.view_after(&rec))
                }
                (state, _) => Err(ApiError::invalid_state(
                    format!("instance {} is {state}: only a running VM is reset", rec.name),
                    state.as_str(),
                )),
            }
        })
    }

    /// `instance.reboot`: [`Manager::stop`] (`force`, `timeout` as there), then
    /// [`Manager::start`]. Errors: those of the stop (`invalid_state` when it is not
    /// running), then those of the start.
    pub fn reboot(&self, r: &str, force: bool, timeout: Option<Duration>) -> Result<InstanceView, ApiError> {
        self.on_instance("reboot", r, |found| {
            let state = self.store.read_instance(found.id)?.ok_or_else(|| ApiError::not_found(r))?.state();
            if state != InstanceState::Running {
                let hint = if state == InstanceState::Stopped { " (start it)" } else { "" };
                return Err(ApiError::invalid_state(
                    format!("instance {} is {state}: only a running VM is rebooted{hint}", found.name),
                    state.as_str(),
                ));
            }
            let id = found.id.to_string();
            self.stop(&id, force, timeout)?;
            tracing::info!(instance.id = %found.id, instance.name = %found.name, "rebooting: stopped, starting again");
            // The start's own error, saying that the VM is now stopped.
            self.start(&id).map_err(|mut e| {
                e.message = format!("{} was stopped for the reboot but did not start again: {}", found.name, e.message);
                e
            })
        })
    }
}
