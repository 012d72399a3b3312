//! # failpoints — named crash and pause points for the crash and race tests
//!
//! Built only with the `failpoints` cargo feature (the `fail` crate plus a pause registry);
//! in other builds every point compiles to nothing, and [`BUILD`] says which build this is
//! (`--version` and the first log line carry it, so a failpoint build is never mistaken
//! for a production one).
//!
//! - **Crash**: the `FAILPOINTS` environment variable, e.g.
//!   `FAILPOINTS=after_claim_commit=return`: a point configured `return` **aborts the agent**
//!   (like `kill -9`: no unwinding, no cleanup), `panic` panics, `sleep(ms)` pauses.
//! - **Pause** (at run time): the JSON-RPC method `debug.failpoint` (served only by
//!   failpoint builds) arms a point with `pause`; the next thread that reaches it (only that
//!   one) waits there, visible in `debug.failpoints` (`waiting`), until `release`. Tests
//!   synchronise on `waiting`, never on sleeps.
//!
//! Every persisted step of create, start, stop, delete, release and the reconciler has a
//! point before and after it ([`ALL`], the crash matrix), plus points where races matter
//! ([`RACE`]). In lifecycle order:
//!
//! | name | where |
//! |---|---|
//! | `create_after_record` | create: the `starting` record is durable, nothing claimed |
//! | `claim_before_create` | create/start: placement ranked the candidates, no claim written (race point) |
//! | `after_claim_commit` | create/start: the claim file is durable, the VF untouched |
//! | `configure_after_repair` | create/start: a dirty VF was cleared, its new type not written (race point) |
//! | `after_configure` | create/start: the type is set and verified, claim `configured` |
//! | `vmm_id_after_record` | create/start: the VMM id's record is durable, the instance record does not name it yet |
//! | `vmm_id_after_instance` | create/start: the instance record names its VMM id, no VMM spawned |
//! | `after_spawn` | create/start: QEMU runs, its identity is not persisted yet |
//! | `after_running` | create/start: the `running` record is durable |
//! | `rollback_before_release` | rollback: the VMM is dead, the device not released (race point) |
//! | `start_after_clear_identity` | start: the old VMM identity is cleared, nothing claimed |
//! | `stop_after_stopping_mark` | stop: `stopping` is durable, the VMM still runs |
//! | `stop_after_vmm_dead` | stop: the VMM is dead, the device not released |
//! | `stop_after_stopped` | stop: `stopped` is durable |
//! | `delete_after_deleting_mark` | delete: `deleting` is durable |
//! | `delete_after_vmm_dead` | delete: the VMM is dead, the device not released |
//! | `delete_after_release` | delete: the claim is gone, the record not yet |
//! | `delete_before_vmm_id_release` | delete: the instance directory and name are gone, its VMM id record not yet |
//! | `release_before_write` | release path: scan clean, nothing written |
//! | `release_after_write` | release path: the device reads clear, the claim file remains |
//! | `release_after_claim_remove` | release path: the claim file is gone |
//! | `reconcile_before_release` | reconciler: decisions made, nothing released |
//! | `reconcile_after_release` | reconciler: one item released |
//! | `retain_write` | rollback: the retention write fails (`return` = an I/O error) |
//! | `pt_bind_after_unbind` | passthrough configure: a function was unbound from its driver, not yet probed to vfio-pci |
//! | `pt_release_after_reset` | passthrough release: the GPU was reset, no function given back |
//! | `pt_release_after_unbind` | passthrough release: a function was unbound from vfio-pci, not yet probed to its driver |
//! | `boot_after_disk` | create/start: the disk overlay (and UEFI variable store) exist, nothing claimed |
//! | `save_after_memory` | snapshot/standby: the running VM's memory is saved (the VM paused), its disks not copied, nothing renamed ([`SAVES`]) |
//! | `save_after_rename` | snapshot/standby: the saved state is complete and renamed into place (a snapshot's VM resumed; a standby's still paused, the record `running`) |
//! | `standby_after_save` | standby: as `save_after_rename` |
//! | `standby_after_record` | standby: the `standby` record is durable, the paused VMM still runs |
//! | `restore_after_disks` | restore: the snapshot's disks replace the instance's, nothing started |
//! | `instance_dir_created` | create: the instance directory (and the name entry) exist, no record yet ([`LEFTOVERS`]) |
//! | `import_after_stage` | image import: the kernel and initrd are copied into the hidden staging directory, not renamed ([`LEFTOVERS`]) |

/// The crash-matrix points (every persisted step).
pub const ALL: &[&str] = &[
    "create_after_record",
    "after_claim_commit",
    "after_configure",
    "vmm_id_after_record",
    "vmm_id_after_instance",
    "after_spawn",
    "after_running",
    "start_after_clear_identity",
    "stop_after_stopping_mark",
    "stop_after_vmm_dead",
    "stop_after_stopped",
    "delete_after_deleting_mark",
    "delete_after_vmm_dead",
    "delete_after_release",
    "delete_before_vmm_id_release",
    "release_before_write",
    "release_after_write",
    "release_after_claim_remove",
    "reconcile_before_release",
    "reconcile_after_release",
];

/// The passthrough write sites (the crash tests of `tests/e2e/tests/passthrough.rs`).
pub const PASSTHROUGH: &[&str] = &["pt_bind_after_unbind", "pt_release_after_reset", "pt_release_after_unbind"];

/// The disk step of create/start (the crash test of `tests/e2e/tests/disks.rs`).
pub const DISK: &[&str] = &["boot_after_disk"];

/// The write sites of snapshots, standby and restore (the crash tests of
/// `tests/e2e/tests/snapshots.rs`).
pub const SAVES: &[&str] =
    &["save_after_memory", "save_after_rename", "standby_after_save", "standby_after_record", "restore_after_disks"];

/// Kills in the middle of an operation that leave something no record owns (an instance
/// directory before its first record, an import's staging copy): the start-up removes it.
pub const LEFTOVERS: &[&str] = &["instance_dir_created", "import_after_stage"];

/// Points where races matter, for pausing (they abort too when configured `return`).
pub const RACE: &[&str] =
    &["claim_before_create", "configure_after_repair", "rollback_before_release", "reconcile_records_before_lock"];

/// Which build this is: `"production"`, or `"failpoint build (not for production)"`.
pub const BUILD: &str =
    if cfg!(feature = "failpoints") { "failpoint build (not for production)" } else { "production" };

/// A crash (and pause) point: configured `return`, the agent aborts here; armed `pause`,
/// the calling thread waits here until released.
#[macro_export]
macro_rules! crash_point {
    ($name:literal) => {{
        fail::fail_point!($name, |_| {
            tracing::error!(failpoint = %$name, "failpoint hit: aborting");
            std::process::abort()
        });
        $crate::failpoints::pause_point($name);
    }};
}

/// One point's pause state (`debug.failpoints`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct PauseStatus {
    /// The failpoint's name, as the code spells it (e.g. `after_claim_commit`).
    pub name: String,
    /// The next thread that reaches the point is held there.
    pub armed: bool,
    /// Threads waiting at the point now.
    pub waiting: u32,
    /// Times the point was reached since the agent started.
    pub hits: u64,
}

#[cfg(feature = "failpoints")]
mod pause {
    use super::PauseStatus;
    use crate::sync::lock;
    use std::collections::BTreeMap;
    use std::sync::{Condvar, Mutex, OnceLock};

    #[derive(Default)]
    struct Point {
        /// The next thread that reaches the point is held there.
        armed: bool,
        waiting: u32,
        hits: u64,
        /// Bumped by every release: the held threads go on.
        released: u64,
    }

    fn registry() -> &'static (Mutex<BTreeMap<String, Point>>, Condvar) {
        static R: OnceLock<(Mutex<BTreeMap<String, Point>>, Condvar)> = OnceLock::new();
        R.get_or_init(|| {
            let names = super::ALL
                .iter()
                .chain(super::RACE)
                .chain(super::PASSTHROUGH)
                .chain(super::DISK)
                .chain(super::SAVES)
                .chain(super::LEFTOVERS)
                .map(|n| (n.to_string(), Point::default()))
                .collect();
            (Mutex::new(names), Condvar::new())
        })
    }

    pub fn pause_point(name: &str) {
        let (m, cv) = registry();
        let mut g = lock(m);
        let Some(p) = g.get_mut(name) else { return };
        p.hits += 1;
        if !p.armed {
            return;
        }
        // Only this thread is held: later ones pass until the point is armed again.
        p.armed = false;
        p.waiting += 1;
        let released = p.released;
        tracing::warn!(failpoint = %name, "failpoint paused: waiting for debug.failpoint release");
        while g.get(name).is_some_and(|p| p.released == released) {
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(p) = g.get_mut(name) {
            p.waiting -= 1;
        }
    }

    pub fn set(name: &str, armed: bool) -> Result<(), String> {
        let (m, cv) = registry();
        let mut g = lock(m);
        let Some(p) = g.get_mut(name) else {
            return Err(format!("{name:?} is not a failpoint (see agent/src/failpoints.rs)"));
        };
        if armed {
            p.armed = true;
        } else {
            p.armed = false;
            p.released += 1;
            cv.notify_all();
        }
        Ok(())
    }

    pub fn status() -> Vec<PauseStatus> {
        let (m, _) = registry();
        lock(m)
            .iter()
            .map(|(n, p)| PauseStatus { name: n.clone(), armed: p.armed, waiting: p.waiting, hits: p.hits })
            .collect()
    }
}

/// Waits here while `name` is armed (failpoint builds only).
#[cfg(feature = "failpoints")]
pub fn pause_point(name: &str) {
    pause::pause_point(name)
}

/// Nothing (production build).
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn pause_point(_name: &str) {}

/// Arms (`pause`) or releases a pause point. Errors: an unknown name, or a production build.
pub fn set_pause(name: &str, armed: bool) -> Result<(), String> {
    #[cfg(feature = "failpoints")]
    {
        pause::set(name, armed)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = (name, armed);
        Err("this is a production build: failpoints are compiled out".into())
    }
}

/// Every pause point's state (empty in a production build).
pub fn pause_status() -> Vec<PauseStatus> {
    #[cfg(feature = "failpoints")]
    {
        pause::status()
    }
    #[cfg(not(feature = "failpoints"))]
    {
        Vec::new()
    }
}
