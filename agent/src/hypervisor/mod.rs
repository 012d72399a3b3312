//! # hypervisor — VMM drivers (QEMU)
//!
//! What each hypervisor can carry ([`HypervisorKind::capabilities`]), how a QEMU VMM is
//! started ([`spawn`], [`qemu_command_line`]), talked to ([`qmp::QmpClient`]) and stopped
//! ([`stop`], [`kill`]).
//!
//! Invariants kept here:
//! - a VMM runs in its own process group and is never left a zombie by the agent (a reaper
//!   thread waits for it);
//! - a signal is only ever sent to a process confirmed, just before the signal, to be the
//!   recorded VMM identity or the owner of its control socket listener — a recycled pid is
//!   never signalled (LIFECYCLE.md "Stop");
//! - the kill path is SIGTERM → grace → SIGKILL → 2 s → SIGKILL to the process group → 2 s,
//!   and a VMM still alive after that is an error ([`HypervisorError::KillFailed`]), never
//!   "dead" (NVIDIA-HOST.md §9).
//!
//! The code is synchronous (std threads, blocking I/O); the RPC layer calls it through
//! `spawn_blocking`.

pub mod qemu;
pub mod qmp;
pub mod stop;

#[cfg(test)]
mod vmm_tests;

use gpuvisor_sdk::{Capability, Framework};

pub use qemu::{qemu_command_line, spawn, ExitWatch, RunningVmm, VfioAttach, VmSpec};
pub use qmp::{QmpClient, QmpError};
pub use stop::{kill, stop, StopOptions, StopReport};

/// The hypervisors gpuvisor knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HypervisorKind {
    /// QEMU (`qemu-system-x86_64`).
    Qemu,
    /// Cloud Hypervisor.
    CloudHypervisor,
}

impl HypervisorKind {
    /// Every kind, in a stable order.
    pub const ALL: [HypervisorKind; 2] = [HypervisorKind::Qemu, HypervisorKind::CloudHypervisor];

    /// The wire name: `qemu` or `cloud-hypervisor`.
    pub fn name(self) -> &'static str {
        match self {
            HypervisorKind::Qemu => "qemu",
            HypervisorKind::CloudHypervisor => "cloud-hypervisor",
        }
    }

    /// The kind for a wire name (`qemu`, `cloud-hypervisor`), `None` otherwise.
    pub fn from_name(name: &str) -> Option<HypervisorKind> {
        HypervisorKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// What this hypervisor can carry (NVIDIA-HOST.md §8).
    ///
    /// Cloud Hypervisor never carries vGPUs (vendor VFIO or mdev): VFIO region reads fail
    /// and the guest driver never initialises (cloud-hypervisor#7572), and it has no
    /// QEMU-style `-uuid`, which the vGPU manager needs (cloud-hypervisor#5319).
    pub fn capabilities(self) -> &'static [Capability] {
        match self {
            HypervisorKind::Qemu => &[
                Capability::VendorVfio,
                Capability::Mdev,
                Capability::Passthrough,
                Capability::Standby,
                Capability::Snapshot,
            ],
            HypervisorKind::CloudHypervisor => &[Capability::Passthrough, Capability::Standby, Capability::Snapshot],
        }
    }
}

/// `true` if `kind` can carry an instance whose GPU uses `framework` (`None`: no GPU).
///
/// The single place the "which hypervisor carries which device" rule lives; request
/// validation rejects `false` with `hypervisor_unsupported` before anything is allocated.
pub fn can_carry(kind: HypervisorKind, framework: Option<Framework>) -> bool {
    match framework {
        None => true,
        Some(f) => kind.capabilities().contains(&Capability::for_framework(f)),
    }
}

/// Errors of the hypervisor drivers. Messages are one sentence; causes are in `source`.
#[derive(Debug, thiserror::Error)]
pub enum HypervisorError {
    /// The VMM could not be started (spawn failed, it exited early, or its control socket
    /// never came up). `reason` includes the tail of `qemu.log` when there is one.
    #[error("the VMM failed to start: {reason}")]
    StartFailed {
        /// What went wrong.
        reason: String,
    },
    /// The VMM outlived SIGTERM, SIGKILL and SIGKILL to its process group (stuck in the
    /// kernel); nothing may be torn down.
    #[error("VMM process {pid} is still alive after SIGKILL to it and its process group")]
    KillFailed {
        /// The live process.
        pid: i32,
    },
    /// Whether the VMM is alive could not be decided (LIFECYCLE.md "provably dead").
    #[error("VMM liveness cannot be decided: {reason}")]
    LivenessUnknown {
        /// Why.
        reason: String,
    },
    /// A QMP exchange failed.
    #[error("QMP exchange failed")]
    Qmp(#[from] QmpError),
    /// An I/O error outside QMP (run directory, log file).
    #[error("VMM I/O failed")]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_carries_every_framework() {
        for f in [Framework::VendorVfio, Framework::Mdev, Framework::Passthrough] {
            assert!(can_carry(HypervisorKind::Qemu, Some(f)));
        }
        assert!(can_carry(HypervisorKind::Qemu, None));
    }

    #[test]
    fn cloud_hypervisor_never_carries_a_vgpu() {
        assert!(!can_carry(HypervisorKind::CloudHypervisor, Some(Framework::VendorVfio)));
        assert!(!can_carry(HypervisorKind::CloudHypervisor, Some(Framework::Mdev)));
        assert!(can_carry(HypervisorKind::CloudHypervisor, Some(Framework::Passthrough)));
        assert!(can_carry(HypervisorKind::CloudHypervisor, None));
    }

    #[test]
    fn names_round_trip() {
        for k in HypervisorKind::ALL {
            assert_eq!(HypervisorKind::from_name(k.name()), Some(k));
        }
        assert_eq!(HypervisorKind::Qemu.name(), "qemu");
        assert_eq!(HypervisorKind::CloudHypervisor.name(), "cloud-hypervisor");
        assert_eq!(HypervisorKind::from_name("xen"), None);
    }
}
