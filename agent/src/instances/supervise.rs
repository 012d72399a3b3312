//! The restart policy and autostart (`restart = "no" | "on-failure" | "always"`,
//! `autostart`): a VMM that dies without a stop is started again through the normal start
//! path — the earlier claim released first, a new claim, placement, the whole contract —
//! after a backoff (`restart_backoff_s`, doubled per restart within `restart_window_s`, at
//! most [`MAX_BACKOFF`]) and at most `restart_limit` times within the window.
//!
//! Deaths come from two places: the VMM's reaper while the agent runs ([`Manager::watch_exit`];
//! every instance; its exit status decides "failure"), and the reconciler for deaths the agent did not see
//! (a restart of the agent, a host reboot: always a failure; after a reboot `autostart`
//! restarts whatever the policy). Both record the death with [`Manager::record_death`], the
//! one place that decides whether and when a restart is due. The agent's supervisor thread
//! calls [`Manager::supervise`] twice a second: it records the deaths the reapers saw, and
//! runs the restarts that are due. A restart that fails because the host is not ready yet
//! (`not_ready`: after a reboot, the VFs or the driver not there yet) is retried with the
//! same backoff for up to `restart_host_wait_s`, without counting against `restart_limit`.

use super::Manager;
use crate::hypervisor::ExitWatch;
use crate::store::{InstanceRecord, InstanceState, RestartPolicy};
use crate::sync::lock;
use std::process::ExitStatus;
use std::time::Duration;
use uuid::Uuid;

/// The longest wait between two restarts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// How the VMM died.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Death {
    /// The reaper saw it exit with status 0 (e.g. the guest powered off).
    Clean,
    /// A non-zero exit, a signal, or an exit nobody saw (the agent was not running).
    Failed,
    /// The host rebooted under it.
    Reboot,
}

impl Death {
    fn of(status: &ExitStatus) -> Death {
        if status.success() {
            Death::Clean
        } else {
            Death::Failed
        }
    }
}

/// The supervisor's memory: the VMMs whose reapers it watches, and the restarts due.
#[derive(Default)]
pub(crate) struct SuperviseState {
    /// Instance → (the VMM's pid, its reaper's exit watch).
    watches: std::sync::Mutex<std::collections::HashMap<Uuid, (i32, ExitWatch)>>,
    /// Instances with a restart due (the record says when).
    due: std::sync::Mutex<std::collections::BTreeSet<Uuid>>,
}

impl Manager {
    /// Remembers the reaper of the VMM `pid` of instance `id` (called once it runs).
    pub(crate) fn watch_exit(&self, id: Uuid, pid: i32, exit: ExitWatch) {
        lock(&self.supervise.watches).insert(id, (pid, exit));
    }

    /// Decides, for a record that has just been marked `stopped` because its VMM died,
    /// whether and when it is started again (in memory; the caller persists the record).
    pub(crate) fn record_death(&self, rec: &mut InstanceRecord, death: Death) {
        let want = match rec.restart {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => death != Death::Clean,
            RestartPolicy::No => false,
        } || (death == Death::Reboot && rec.autostart);
        if !want {
            return;
        }
        let now = now_ms();
        let window = self.cfg.restart_window_s.saturating_mul(1000);
        rec.restarts.attempts_ms.retain(|t| now.saturating_sub(*t) < window);
        let n = rec.restarts.attempts_ms.len() as u32;
        if n >= self.cfg.restart_limit {
            rec.restarts.due_ms = None;
            rec.restarts.gave_up = true;
            let why =
                format!("restart limit reached: {n} restarts within {} s; start it by hand", self.cfg.restart_window_s);
            tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, reason = %why, "not restarted");
            self.metrics.restart("gave_up");
            rec.last_error = Some(match rec.last_error.take() {
                Some(e) => format!("{e}; {why}"),
                None => why,
            });
            return;
        }
        let backoff = Duration::from_secs(self.cfg.restart_backoff_s)
            .saturating_mul(1u32.checked_shl(n).unwrap_or(u32::MAX))
            .min(MAX_BACKOFF);
        rec.restarts.due_ms = Some(now + backoff.as_millis() as u64);
        rec.restarts.gave_up = false;
        lock(&self.supervise.due).insert(rec.id);
        tracing::info!(instance.id = %rec.id, instance.name = %rec.name, policy = ?rec.restart,
            in_ms = backoff.as_millis() as u64, "restart scheduled");
    }

    /// One supervisor tick (see the module docs).
    pub fn supervise(&self) {
        self.reap_watched();
        self.run_due_restarts();
    }

    /// Records the deaths the reapers saw: a `running` record whose VMM is the watched
    /// process moves to `stopped` at once, with the exit status — `ps` and event
    /// subscribers see the death without waiting for the reconciler's next pass (which
    /// then releases the claim of the dead owner).
    fn reap_watched(&self) {
        let exited: Vec<(Uuid, i32, ExitStatus)> = lock(&self.supervise.watches)
            .iter()
            .filter_map(|(id, (pid, w))| w.exited().map(|s| (*id, *pid, s)))
            .collect();
        for (id, pid, status) in exited {
            let ilock = self.instance_lock(id);
            // An operation holds it (a stop that killed it, a start): look again next tick.
            let Ok(_i) = ilock.try_lock() else { continue };
            lock(&self.supervise.watches).remove(&id);
            let Ok(Some(mut rec)) = self.store.read_instance(id) else { continue };
            if rec.state() != InstanceState::Running || rec.vmm.as_ref().map(|v| v.identity.pid) != Some(pid) {
                continue;
            }
            if let Err(e) = self.record_vmm_death(&mut rec, format!("the VMM exited ({status})"), Death::of(&status)) {
                tracing::error!(instance.id = %rec.id, instance.name = %rec.name, error = %e, "cannot record the VM's death");
            }
        }
    }

    /// Records that the VMM of `rec` died (the caller holds the instance lock and saw it
    /// dead): `stopped`, no VMM, `reason` in `last_error`, the restart policy consulted;
    /// persisted — which publishes the `instance_state` event — counted, and logged once at
    /// WARN. The one sequence for the reaper and the reconciler. Errors: the transition or
    /// the write failed (the record on disk is unchanged).
    pub(crate) fn record_vmm_death(
        &self,
        rec: &mut InstanceRecord,
        reason: String,
        death: Death,
    ) -> Result<(), String> {
        let from = rec.state();
        rec.transition(InstanceState::Stopped).map_err(|e| e.to_string())?;
        rec.vmm = None;
        rec.last_error = Some(reason.clone());
        self.record_death(rec, death);
        self.store.write_instance(rec).map_err(|e| format!("cannot mark {} stopped: {e}", rec.name))?;
        self.metrics.vm_died();
        tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, from = %from, reason = %reason,
            "VM found dead: recorded stopped");
        Ok(())
    }

    /// A restart failed because the host is not ready yet (`not_ready`: no SR-IOV VFs yet
    /// after a reboot, the driver still loading): it is tried again after a backoff
    /// (`restart_backoff_s`, doubled per try, at most [`MAX_BACKOFF`]) for up to
    /// `restart_host_wait_s` from the first such try; these tries do not count against
    /// `restart_limit`. Past the bound the instance stays `stopped` (logged at WARN, counted
    /// `gave_up`).
    fn wait_for_host(&self, id: Uuid, why: &str) {
        self.metrics.restart("failed");
        let ilock = self.instance_lock(id);
        let _i = lock(&ilock);
        let Ok(Some(mut rec)) = self.store.read_instance(id) else { return };
        if rec.state() != InstanceState::Stopped {
            return;
        }
        let now = now_ms();
        // This try does not count against restart_limit.
        rec.restarts.attempts_ms.pop();
        let since = *rec.restarts.host_wait_since_ms.get_or_insert(now);
        let bound_ms = self.cfg.restart_host_wait_s.saturating_mul(1000);
        if now.saturating_sub(since) >= bound_ms {
            let msg = format!(
                "the host was not ready within restart_host_wait_s ({} s): {why}; start it by hand",
                self.cfg.restart_host_wait_s
            );
            tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, reason = %msg, "not restarted");
            self.metrics.restart("gave_up");
            rec.restarts.due_ms = None;
            rec.restarts.gave_up = true;
            rec.restarts.host_wait_since_ms = None;
            rec.restarts.host_waits = 0;
            rec.last_error = Some(msg);
        } else {
            let backoff = Duration::from_secs(self.cfg.restart_backoff_s)
                .saturating_mul(1u32.checked_shl(rec.restarts.host_waits).unwrap_or(u32::MAX))
                .min(MAX_BACKOFF);
            rec.restarts.host_waits = rec.restarts.host_waits.saturating_add(1);
            rec.restarts.due_ms = Some(now + backoff.as_millis() as u64);
            rec.last_error = Some(format!(
                "waiting for the host (try {} failed: {why}); next try in {} s, for at most restart_host_wait_s = {} s",
                rec.restarts.host_waits,
                backoff.as_secs(),
                self.cfg.restart_host_wait_s
            ));
            if rec.restarts.host_waits == 1 {
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, reason = %why,
                    bound_s = self.cfg.restart_host_wait_s, "the host is not ready: the restart waits for it");
            } else {
                tracing::info!(instance.id = %rec.id, instance.name = %rec.name, reason = %why,
                    in_ms = backoff.as_millis() as u64, "the host is still not ready: restart rescheduled");
            }
            lock(&self.supervise.due).insert(rec.id);
        }
        if let Err(e) = self.store.write_instance(&rec) {
            tracing::error!(instance.id = %rec.id, instance.name = %rec.name, error = %e, "cannot record the wait for the host");
        }
    }

    /// A restart succeeded: the host wait (if any) is over.
    fn host_ready_again(&self, id: Uuid) {
        let ilock = self.instance_lock(id);
        let _i = lock(&ilock);
        if let Ok(Some(mut rec)) = self.store.read_instance(id) {
            if rec.restarts.host_wait_since_ms.is_some() {
                rec.restarts.host_wait_since_ms = None;
                rec.restarts.host_waits = 0;
                if let Err(e) = self.store.write_instance(&rec) {
                    tracing::error!(instance.id = %rec.id, instance.name = %rec.name, error = %e, "cannot record the end of the wait for the host");
                }
            }
        }
    }

    /// Runs the restarts that are due, each through the start path.
    fn run_due_restarts(&self) {
        if !self.is_ready() {
            return;
        }
        let now = now_ms();
        let ids: Vec<Uuid> = lock(&self.supervise.due).iter().copied().collect();
        for id in ids {
            let attempt = {
                let ilock = self.instance_lock(id);
                let Ok(_i) = ilock.try_lock() else { continue };
                let Ok(Some(mut rec)) = self.store.read_instance(id) else {
                    lock(&self.supervise.due).remove(&id);
                    continue;
                };
                match rec.restarts.due_ms {
                    Some(t) if rec.state() == InstanceState::Stopped && t <= now => {}
                    Some(_) if rec.state() == InstanceState::Stopped => continue,
                    // Started, stopped or deleted by hand meanwhile.
                    _ => {
                        lock(&self.supervise.due).remove(&id);
                        continue;
                    }
                }
                rec.restarts.due_ms = None;
                rec.restarts.attempts_ms.push(now);
                if let Err(e) = self.store.write_instance(&rec) {
                    tracing::error!(instance.id = %rec.id, instance.name = %rec.name, error = %e,
                        "cannot record a restart attempt; not restarting");
                    continue;
                }
                lock(&self.supervise.due).remove(&id);
                (rec.name.clone(), rec.restarts.attempts_ms.len())
            };
            let (name, n) = attempt;
            match self.start_restarting(id) {
                Ok(_) => {
                    self.metrics.restart("ok");
                    tracing::warn!(instance.id = %id, instance.name = %name, attempt = n, "instance restarted");
                    self.host_ready_again(id);
                }
                Err(e) if e.code == crate::error::ErrorCode::NotReady => self.wait_for_host(id, &e.message),
                Err(e) => {
                    self.metrics.restart("failed");
                    // The start failed (logged by the start path): the next attempt, or
                    // the limit.
                    let ilock = self.instance_lock(id);
                    let _i = lock(&ilock);
                    if let Ok(Some(mut rec)) = self.store.read_instance(id) {
                        if rec.state() == InstanceState::Stopped {
                            rec.last_error = Some(format!("restart {n} failed: {}", e.message));
                            self.record_death(&mut rec, Death::Failed);
                            if let Err(e) = self.store.write_instance(&rec) {
                                tracing::error!(instance.id = %id, instance.name = %name, error = %e,
                                    "cannot record a failed restart");
                            }
                        }
                    }
                }
            }
        }
    }
}
