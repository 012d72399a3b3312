//! # hypervisor::stop — graceful stop and the kill path
//!
//! docs/design/lifecycle.md "Stop" and docs/design/host.md §9: the driver's graceful steps — the guest's
//! power button (QMP `system_powerdown`; Cloud Hypervisor `vm.power-button`), then asking
//! the VMM to exit (QMP `quit`; `vmm.shutdown`) — then the one kill path for every driver:
//! SIGTERM → term grace (default 5 s) → SIGKILL → 2 s → SIGKILL to the
//! process group → 2 s → still alive is [`HypervisorError::KillFailed`].
//!
//! Before **every** signal the target is confirmed: a pidfd is opened on the recorded pid
//! and its start time compared with the record, or the pid is confirmed (after opening its
//! pidfd) to hold the control socket listener. Signals go through the pidfd, so a recycled
//! pid is never signalled. "Exited" always means [`vmm_liveness`] says `Dead`.

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use super::{Driver, HypervisorError};
use crate::host::proc::{self as hostproc, vmm_liveness, Liveness, ProcessIdentity};

/// Default wait between SIGTERM and SIGKILL for a VMM holding VFIO devices (docs/design/host.md §9:
/// at least 5 s).
pub const DEFAULT_TERM_GRACE: Duration = Duration::from_secs(5);

/// Wait after SIGKILL, and after SIGKILL to the process group (docs/design/host.md §9).
pub const KILL_WAIT: Duration = Duration::from_secs(2);

/// Wait for the VMM to exit after it was asked to (QMP `quit`, `vmm.shutdown`).
pub const QUIT_WAIT: Duration = Duration::from_secs(5);

/// Longest step between two liveness polls.
const POLL_MAX_STEP: Duration = Duration::from_millis(50);

/// How to stop a VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopOptions {
    /// Press the guest's power button and ask the VMM to exit before any signal.
    pub graceful: bool,
    /// How long to wait for the guest to power off (graceful only).
    pub stop_timeout: Duration,
    /// Wait between SIGTERM and SIGKILL (default [`DEFAULT_TERM_GRACE`]).
    pub term_grace: Duration,
}

impl Default for StopOptions {
    fn default() -> Self {
        StopOptions { graceful: true, stop_timeout: Duration::from_secs(30), term_grace: DEFAULT_TERM_GRACE }
    }
}

/// What a stop did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopReport {
    /// Escalations past SIGTERM, in order: `"SIGKILL"`, `"SIGKILL_GROUP"`. Each marks the
    /// device `suspect` (docs/design/lifecycle.md "Device health") and counts in
    /// `gpuvisor_vmm_kill_escalations_total{signal}`.
    pub escalations: Vec<&'static str>,
    /// The VMM exited without any signal (guest power-off, or it was asked to exit).
    pub graceful_exit: bool,
    /// The VMM was already provably dead when the stop began; nothing was sent.
    pub already_dead: bool,
}

/// Stops the VMM `identity` (control socket `control_socket`, driven by `driver`), then
/// proves it dead.
///
/// Order: if `opts.graceful`, the driver's power button and up to `opts.stop_timeout`, then
/// the driver's quit and up to [`QUIT_WAIT`]; then the kill path (see [`kill`]). A failed
/// graceful step only moves on to the next step.
///
/// Errors: [`HypervisorError::LivenessUnknown`] when liveness cannot be decided at the start
/// (nothing is sent) or at the end; [`HypervisorError::KillFailed`] when the VMM outlives
/// the whole kill path. In both cases the caller must tear nothing down.
pub fn stop(
    driver: &dyn Driver,
    identity: &ProcessIdentity,
    control_socket: &Path,
    opts: StopOptions,
    current_boot_id: &str,
) -> Result<StopReport, HypervisorError> {
    let mut report = StopReport::default();
    if already_dead(identity, control_socket, current_boot_id)? {
        report.already_dead = true;
        return Ok(report);
    }
    if opts.graceful {
        let hv = driver.kind();
        let io_timeout = opts.stop_timeout.clamp(Duration::from_millis(500), super::qmp::DEFAULT_IO_TIMEOUT);
        match driver.power_button(control_socket, io_timeout) {
            Ok(()) => {
                if wait_dead(identity, control_socket, current_boot_id, opts.stop_timeout) == Liveness::Dead {
                    report.graceful_exit = true;
                    return Ok(report);
                }
                tracing::info!(pid = identity.pid, hypervisor = %hv, stop_timeout_s = opts.stop_timeout.as_secs(),
                    "the guest did not power off in time; asking the VMM to exit");
            }
            Err(e) => {
                tracing::info!(pid = identity.pid, hypervisor = %hv, error = %e, "the power button failed; asking the VMM to exit")
            }
        }
        match driver.quit(control_socket, io_timeout) {
            Ok(()) => {
                if wait_dead(identity, control_socket, current_boot_id, QUIT_WAIT) == Liveness::Dead {
                    report.graceful_exit = true;
                    return Ok(report);
                }
                tracing::info!(pid = identity.pid, hypervisor = %hv, "the VMM did not exit in time; sending SIGTERM");
            }
            Err(e) => {
                tracing::info!(pid = identity.pid, hypervisor = %hv, error = %e, "asking the VMM to exit failed; sending SIGTERM")
            }
        }
    }
    kill_path(identity, control_socket, opts.term_grace, current_boot_id, &mut report)?;
    Ok(report)
}

/// The kill path alone, the same for every driver (no power button, no request to exit):
/// SIGTERM → `term_grace` → SIGKILL → [`KILL_WAIT`] → SIGKILL to the process group →
/// [`KILL_WAIT`].
///
/// Errors: as [`stop`].
pub fn kill(
    identity: &ProcessIdentity,
    control_socket: &Path,
    term_grace: Duration,
    current_boot_id: &str,
) -> Result<StopReport, HypervisorError> {
    let mut report = StopReport::default();
    if already_dead(identity, control_socket, current_boot_id)? {
        report.already_dead = true;
        return Ok(report);
    }
    kill_path(identity, control_socket, term_grace, current_boot_id, &mut report)?;
    Ok(report)
}

/// `true` when the VMM is provably dead before anything is sent; an undecidable liveness is
/// an error (nothing may be sent).
fn already_dead(identity: &ProcessIdentity, control_socket: &Path, boot_id: &str) -> Result<bool, HypervisorError> {
    match vmm_liveness(Some(identity), Some(control_socket), boot_id) {
        Liveness::Dead => Ok(true),
        Liveness::MaybeAlive { reason } => Err(HypervisorError::LivenessUnknown { reason }),
        Liveness::Alive { .. } => Ok(false),
    }
}

fn kill_path(
    identity: &ProcessIdentity,
    control_socket: &Path,
    term_grace: Duration,
    boot_id: &str,
    report: &mut StopReport,
) -> Result<(), HypervisorError> {
    signal_vmm(identity, control_socket, boot_id, Signal::SIGTERM, false);
    if wait_dead(identity, control_socket, boot_id, term_grace) == Liveness::Dead {
        return Ok(());
    }

    tracing::debug!(pid = identity.pid, signal = %"SIGKILL", "VMM outlived SIGTERM; escalating to SIGKILL");
    report.escalations.push("SIGKILL");
    signal_vmm(identity, control_socket, boot_id, Signal::SIGKILL, false);
    if wait_dead(identity, control_socket, boot_id, KILL_WAIT) == Liveness::Dead {
        return Ok(());
    }

    tracing::debug!(pid = identity.pid, signal = %"SIGKILL_GROUP", "VMM outlived SIGKILL; killing its process group");
    report.escalations.push("SIGKILL_GROUP");
    signal_vmm(identity, control_socket, boot_id, Signal::SIGKILL, true);
    match wait_dead(identity, control_socket, boot_id, KILL_WAIT) {
        Liveness::Dead => Ok(()),
        Liveness::Alive { pid } => {
            // The caller logs the failed operation once, with the instance.
            Err(HypervisorError::KillFailed { pid })
        }
        Liveness::MaybeAlive { reason } => Err(HypervisorError::LivenessUnknown { reason }),
    }
}

/// Sends `signal` to every confirmed target: the recorded identity (pidfd + start time) and
/// any other confirmed owner of the control socket listener. With `group`, also SIGKILLs the
/// process group led by the confirmed recorded process. Unconfirmed pids are never
/// signalled. Returns the pids signalled.
fn signal_vmm(
    identity: &ProcessIdentity,
    control_socket: &Path,
    boot_id: &str,
    signal: Signal,
    group: bool,
) -> Vec<i32> {
    let mut sent = Vec::new();
    let mut exclude = Vec::new();
    match hostproc::confirm_identity(identity, boot_id) {
        Ok(Some(confirmed)) => {
            exclude.push(identity.pid);
            match confirmed.pidfd.send_signal(signal) {
                Ok(true) => sent.push(identity.pid),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(pid = identity.pid, signal = %signal.as_str(), error = %e, "signalling the VMM failed")
                }
            }
            // The group is only signalled while its leader is held by a confirmed pidfd:
            // the process group id cannot be reused while the leader lives.
            if group && confirmed.pgrp == identity.pid {
                match nix::sys::signal::killpg(Pid::from_raw(confirmed.pgrp), signal) {
                    Ok(()) => {}
                    Err(nix::errno::Errno::ESRCH) => {}
                    Err(e) => {
                        tracing::warn!(pgrp = confirmed.pgrp, signal = %signal.as_str(), error = %e, "signalling the VMM's process group failed")
                    }
                }
            } else if group {
                tracing::warn!(
                    pid = identity.pid,
                    pgrp = confirmed.pgrp,
                    "the VMM left its own process group; signalling the process only"
                );
            }
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(pid = identity.pid, error = %e, "the VMM identity could not be confirmed; not signalling it")
        }
    }
    match hostproc::confirm_listener_owners(control_socket, &exclude) {
        Ok(owners) => {
            for owner in owners {
                match owner.send_signal(signal) {
                    Ok(true) => sent.push(owner.pid()),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(pid = owner.pid(), signal = %signal.as_str(), error = %e, "signalling the control socket owner failed")
                    }
                }
            }
        }
        Err(e) => {
            tracing::warn!(socket = %control_socket.display(), error = %e, "the control socket owner could not be confirmed; not signalling it")
        }
    }
    tracing::debug!(signal = %signal.as_str(), pids = %sent.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(","), "signalled VMM");
    sent
}

/// Polls [`vmm_liveness`] (steps 5 ms doubling to 50 ms) until `Dead` or `timeout`; returns
/// the last answer.
fn wait_dead(identity: &ProcessIdentity, control_socket: &Path, boot_id: &str, timeout: Duration) -> Liveness {
    let deadline = Instant::now() + timeout;
    let mut step = Duration::from_millis(5);
    loop {
        let l = vmm_liveness(Some(identity), Some(control_socket), boot_id);
        if l == Liveness::Dead {
            return l;
        }
        let now = Instant::now();
        if now >= deadline {
            return l;
        }
        std::thread::sleep(step.min(deadline - now));
        step = (step * 2).min(POLL_MAX_STEP);
    }
}
