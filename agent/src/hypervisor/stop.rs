//! # hypervisor::stop — graceful stop and the kill path
//!
//! LIFECYCLE.md "Stop" and NVIDIA-HOST.md §9: guest power-off (QMP `system_powerdown`),
//! QMP `quit`, then SIGTERM → term grace (default 5 s) → SIGKILL → 2 s → SIGKILL to the
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

use super::qmp::QmpClient;
use super::HypervisorError;
use crate::host::proc::{self as hostproc, vmm_liveness, Liveness, ProcessIdentity};

/// Default wait between SIGTERM and SIGKILL for a VMM holding VFIO devices (NVIDIA-HOST.md §9:
/// at least 5 s).
pub const DEFAULT_TERM_GRACE: Duration = Duration::from_secs(5);

/// Wait after SIGKILL, and after SIGKILL to the process group (NVIDIA-HOST.md §9).
pub const KILL_WAIT: Duration = Duration::from_secs(2);

/// Wait for QEMU to exit after QMP `quit`.
pub const QUIT_WAIT: Duration = Duration::from_secs(5);

/// Longest step between two liveness polls.
const POLL_MAX_STEP: Duration = Duration::from_millis(50);

/// How to stop a VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopOptions {
    /// Ask the guest to power off (QMP `system_powerdown`) and QEMU to quit before signals.
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
    /// device `suspect` (LIFECYCLE.md "Device health") and counts in
    /// `gpuvisor_vmm_kill_escalations_total{signal}`.
    pub escalations: Vec<&'static str>,
    /// The VMM exited without any signal (guest power-off or QMP `quit`).
    pub graceful_exit: bool,
    /// The VMM was already provably dead when the stop began; nothing was sent.
    pub already_dead: bool,
}

/// Stops the VMM `identity` (control socket `qmp_socket`), then proves it dead.
///
/// Order: if `opts.graceful`, QMP `system_powerdown` and up to `opts.stop_timeout`, then QMP
/// `quit` and up to [`QUIT_WAIT`]; then the kill path (see [`kill`]). QMP failures only
/// move on to the next step.
///
/// Errors: [`HypervisorError::LivenessUnknown`] when liveness cannot be decided at the start
/// (nothing is sent) or at the end; [`HypervisorError::KillFailed`] when the VMM outlives
/// the whole kill path. In both cases the caller must tear nothing down.
pub fn stop(
    identity: &ProcessIdentity,
    qmp_socket: &Path,
    opts: StopOptions,
    current_boot_id: &str,
) -> Result<StopReport, HypervisorError> {
    let mut report = StopReport::default();
    match vmm_liveness(Some(identity), Some(qmp_socket), current_boot_id) {
        Liveness::Dead => {
            report.already_dead = true;
            return Ok(report);
        }
        Liveness::MaybeAlive { reason } => return Err(HypervisorError::LivenessUnknown { reason }),
        Liveness::Alive { .. } => {}
    }
    if opts.graceful {
        let io_timeout = opts.stop_timeout.clamp(Duration::from_millis(500), super::qmp::DEFAULT_IO_TIMEOUT);
        match QmpClient::connect(qmp_socket, io_timeout).and_then(|mut c| c.system_powerdown()) {
            Ok(()) => {
                if wait_dead(identity, qmp_socket, current_boot_id, opts.stop_timeout) == Liveness::Dead {
                    report.graceful_exit = true;
                    return Ok(report);
                }
                tracing::info!(pid = identity.pid, "guest did not power off in time; asking QEMU to quit");
            }
            Err(e) => {
                tracing::info!(pid = identity.pid, error = %e, "system_powerdown failed; asking QEMU to quit")
            }
        }
        match QmpClient::connect(qmp_socket, io_timeout).and_then(|mut c| c.quit()) {
            Ok(()) => {
                if wait_dead(identity, qmp_socket, current_boot_id, QUIT_WAIT) == Liveness::Dead {
                    report.graceful_exit = true;
                    return Ok(report);
                }
                tracing::info!(pid = identity.pid, "QEMU did not quit in time; sending SIGTERM");
            }
            Err(e) => {
                tracing::info!(pid = identity.pid, error = %e, "QMP quit failed; sending SIGTERM")
            }
        }
    }
    kill_path(identity, qmp_socket, opts.term_grace, current_boot_id, &mut report)?;
    Ok(report)
}

/// The kill path alone (no guest power-off, no QMP `quit`): SIGTERM → `term_grace` →
/// SIGKILL → [`KILL_WAIT`] → SIGKILL to the process group → [`KILL_WAIT`].
///
/// Errors: as [`stop`].
pub fn kill(
    identity: &ProcessIdentity,
    qmp_socket: &Path,
    term_grace: Duration,
    current_boot_id: &str,
) -> Result<StopReport, HypervisorError> {
    stop(
        identity,
        qmp_socket,
        StopOptions { graceful: false, stop_timeout: Duration::ZERO, term_grace },
        current_boot_id,
    )
}

fn kill_path(
    identity: &ProcessIdentity,
    qmp_socket: &Path,
    term_grace: Duration,
    boot_id: &str,
    report: &mut StopReport,
) -> Result<(), HypervisorError> {
    signal_vmm(identity, qmp_socket, boot_id, Signal::SIGTERM, false);
    if wait_dead(identity, qmp_socket, boot_id, term_grace) == Liveness::Dead {
        return Ok(());
    }

    tracing::debug!(pid = identity.pid, signal = %"SIGKILL", "VMM outlived SIGTERM; escalating to SIGKILL");
    report.escalations.push("SIGKILL");
    signal_vmm(identity, qmp_socket, boot_id, Signal::SIGKILL, false);
    if wait_dead(identity, qmp_socket, boot_id, KILL_WAIT) == Liveness::Dead {
        return Ok(());
    }

    tracing::debug!(pid = identity.pid, signal = %"SIGKILL_GROUP", "VMM outlived SIGKILL; killing its process group");
    report.escalations.push("SIGKILL_GROUP");
    signal_vmm(identity, qmp_socket, boot_id, Signal::SIGKILL, true);
    match wait_dead(identity, qmp_socket, boot_id, KILL_WAIT) {
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
fn signal_vmm(identity: &ProcessIdentity, qmp_socket: &Path, boot_id: &str, signal: Signal, group: bool) -> Vec<i32> {
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
    match hostproc::confirm_listener_owners(qmp_socket, &exclude) {
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
            tracing::warn!(socket = %qmp_socket.display(), error = %e, "the control socket owner could not be confirmed; not signalling it")
        }
    }
    tracing::debug!(signal = %signal.as_str(), pids = %sent.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(","), "signalled VMM");
    sent
}

/// Polls [`vmm_liveness`] (steps 5 ms doubling to 50 ms) until `Dead` or `timeout`; returns
/// the last answer.
fn wait_dead(identity: &ProcessIdentity, qmp_socket: &Path, boot_id: &str, timeout: Duration) -> Liveness {
    let deadline = Instant::now() + timeout;
    let mut step = Duration::from_millis(5);
    loop {
        let l = vmm_liveness(Some(identity), Some(qmp_socket), boot_id);
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
