//! # failpoints — named crash points for the crash tests
//!
//! Built only with the `failpoints` cargo feature (the `fail` crate); in other builds every
//! point compiles to nothing. Configure with the `FAILPOINTS` environment variable, e.g.
//! `FAILPOINTS=after_claim_commit=return`: a point configured `return` **aborts the agent**
//! (like `kill -9`: no unwinding, no cleanup), `panic` panics, `sleep(ms)` pauses.
//!
//! Every persisted step of create, start, stop, delete, release and the reconciler has a
//! point before and after it. The full list, in lifecycle order:
//!
//! | name | where |
//! |---|---|
//! | `create_after_record` | create: the `starting` record is durable, nothing claimed |
//! | `after_claim_commit` | create/start: the claim file is durable, the VF untouched |
//! | `after_configure` | create/start: the type is set and verified, claim `configured` |
//! | `after_spawn` | create/start: QEMU runs, its identity is not persisted yet |
//! | `after_running` | create/start: the `running` record is durable |
//! | `start_after_clear_identity` | start: the old VMM identity is cleared, nothing claimed |
//! | `stop_after_stopping_mark` | stop: `stopping` is durable, the VMM still runs |
//! | `stop_after_vmm_dead` | stop: the VMM is dead, the device not released |
//! | `stop_after_stopped` | stop: `stopped` is durable |
//! | `delete_after_deleting_mark` | delete: `deleting` is durable |
//! | `delete_after_vmm_dead` | delete: the VMM is dead, the device not released |
//! | `delete_after_release` | delete: the claim is gone, the record not yet |
//! | `release_before_write` | release guard: scan clean, nothing written |
//! | `release_after_write` | release guard: the device reads clear, the claim file remains |
//! | `release_after_claim_remove` | release guard: the claim file is gone |
//! | `reconcile_before_release` | reconciler: decisions made, nothing released |
//! | `reconcile_after_release` | reconciler: one item released |
//! | `retain_write` | rollback: the retention write fails (`return` = an I/O error) |

/// All failpoint names (for the crash-matrix harness).
pub const ALL: &[&str] = &[
    "create_after_record",
    "after_claim_commit",
    "after_configure",
    "after_spawn",
    "after_running",
    "start_after_clear_identity",
    "stop_after_stopping_mark",
    "stop_after_vmm_dead",
    "stop_after_stopped",
    "delete_after_deleting_mark",
    "delete_after_vmm_dead",
    "delete_after_release",
    "release_before_write",
    "release_after_write",
    "release_after_claim_remove",
    "reconcile_before_release",
    "reconcile_after_release",
];

/// A crash point: configured `return`, the agent aborts here.
#[macro_export]
macro_rules! crash_point {
    ($name:literal) => {
        fail::fail_point!($name, |_| {
            tracing::error!(failpoint = $name, "failpoint hit: aborting");
            std::process::abort()
        })
    };
}
