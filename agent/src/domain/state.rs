//! The lifecycle states and their transition tables: an instance's
//! ([`InstanceState::can_move_to`], changed only through `InstanceRecord::transition`) and a
//! claim's ([`ClaimState::can_move_to`], enforced by `Store::update_claim`).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Lifecycle state of an instance record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum InstanceState {
    /// Create or start in progress (claim, configure, spawn).
    Starting,
    /// The VMM was spawned and its identity recorded.
    Running,
    /// A stop is in progress.
    Stopping,
    /// No VMM; no claim unless a release is pending.
    Stopped,
    /// Saved and put away (`instance.standby`): no VMM, no claim; its memory and device
    /// state wait in the instance's `standby` directory, and a start resumes it from there.
    Standby,
    /// A delete is in progress; nothing may restart it.
    Deleting,
    /// A release failed during rollback or delete: only `instance.delete` is allowed.
    CleanupPending,
}

impl InstanceState {
    /// Every state, in lifecycle order.
    pub const ALL: [InstanceState; 7] = [
        InstanceState::Starting,
        InstanceState::Running,
        InstanceState::Stopping,
        InstanceState::Stopped,
        InstanceState::Standby,
        InstanceState::Deleting,
        InstanceState::CleanupPending,
    ];

    /// The wire name (`starting`, `running`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Starting => "starting",
            InstanceState::Running => "running",
            InstanceState::Stopping => "stopping",
            InstanceState::Stopped => "stopped",
            InstanceState::Standby => "standby",
            InstanceState::Deleting => "deleting",
            InstanceState::CleanupPending => "cleanup_pending",
        }
    }

    /// **The transition table** (docs/design/lifecycle.md "Operations"). Staying in a state is always
    /// allowed (it is not a transition). Every other pair not listed is illegal.
    ///
    /// | from | to | by |
    /// |---|---|---|
    /// | starting | running | create/start: the VMM spawned, its identity recorded; reconcile: a live control-socket owner found |
    /// | starting | stopped | start rolled back; reconcile: the agent died during create/start |
    /// | starting | cleanup_pending | rollback could not release the device |
    /// | starting, running, stopping, stopped, standby | deleting | delete |
    /// | starting, running | stopping | stop |
    /// | running, stopping | stopped | stop; reconcile or start: the VMM is provably dead |
    /// | stopping | running | reconcile: a stop interrupted by an agent restart, the VMM still runs |
    /// | stopped | starting | start |
    /// | running | standby | standby: the state is saved (the paused VMM is recorded until the kill path proves it dead) |
    /// | standby | starting | start, restore: the saved state is resumed (and consumed) in a new VMM |
    /// | standby | stopped | stop, restore of a snapshot: the saved state is discarded |
    /// | deleting | cleanup_pending | delete: the release failed |
    /// | cleanup_pending | deleting | delete (a retry) |
    pub fn can_move_to(self, to: InstanceState) -> bool {
        use InstanceState::*;
        self == to
            || matches!(
                (self, to),
                (Starting, Running)
                    | (Starting, Stopped)
                    | (Starting, CleanupPending)
                    | (Starting | Running | Stopping | Stopped | Standby, Deleting)
                    | (Starting | Running, Stopping)
                    | (Running | Stopping, Stopped)
                    | (Stopping, Running)
                    | (Stopped, Starting)
                    | (Running, Standby)
                    | (Standby, Starting | Stopped)
                    | (Deleting, CleanupPending)
                    | (CleanupPending, Deleting)
            )
    }
}

impl std::fmt::Display for InstanceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state change the transition table does not allow: a bug in the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("instance {id}: {from} → {to} is not a legal state transition")]
pub struct IllegalTransition {
    /// The instance.
    pub id: Uuid,
    /// Its state now.
    pub from: InstanceState,
    /// The state asked for.
    pub to: InstanceState,
}

/// State of a claim record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClaimState {
    /// Written; the device is not configured yet.
    Claimed,
    /// The type is set / the mdev exists and was verified.
    Configured,
    /// A release failed; the device stays blocked and the release is retried.
    ReleasePending,
}

impl ClaimState {
    /// Every state.
    pub const ALL: [ClaimState; 3] = [ClaimState::Claimed, ClaimState::Configured, ClaimState::ReleasePending];

    /// The claim transition table: the only moves a claim record makes while it exists
    /// ([`Store::update_claim`] refuses any other). A claim is created `claimed`
    /// ([`Store::create_claim`]) and ends when the release path removes its record.
    ///
    /// | from | to | by |
    /// |---|---|---|
    /// | any | the same | an update of its details (an attempt count, an error, a reset record) |
    /// | claimed | configured | claim: the device configured and read back |
    /// | claimed, configured | release_pending | release: an attempt failed |
    pub fn can_move_to(self, to: ClaimState) -> bool {
        use ClaimState::*;
        self == to || matches!((self, to), (Claimed, Configured) | (Claimed | Configured, ReleasePending))
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimState::Claimed => "claimed",
            ClaimState::Configured => "configured",
            ClaimState::ReleasePending => "release_pending",
        }
    }
}

impl std::fmt::Display for ClaimState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
