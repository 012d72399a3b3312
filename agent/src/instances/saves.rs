//! Saved VM states (docs/design/lifecycle.md "Snapshots, standby, restore"): `instance.snapshot`,
//! `instance.snapshots`, `instance.snapshot_delete`, `instance.standby`, `instance.restore`,
//! and the resume of a `standby` instance by `instance.start`.
//!
//! A saved state is a directory of the agent's, beside the instance's VMM directory (never in
//! a VMM's view): `<instance dir>/snapshots/<name>/` for a snapshot, `<instance dir>/standby/`
//! for the state of a `standby` instance. It holds `state.json` (what was saved, when, and
//! the definition it needs), the disk files of the VMM directory that exist (the qcow2
//! overlay, the UEFI variable store) and, for a state saved while the VM ran, `memory`
//! (QEMU's migration stream, written through an fd the agent opened).
//!
//! **Crash safety.** A state is written under a `.partial-` name beside its final one and
//! renamed into place last, after every file and the directory are synced: a listed snapshot
//! is always whole. A `.partial-` directory is never read and the start-up removes it, with a
//! standby state whose record is no longer `standby`. A running VM is paused for the save;
//! an agent killed while it is paused leaves it paused, and the start-up pass resumes it
//! ([`Manager::resume_interrupted_saves`]). `standby` records the new state (the paused VMM
//! still named) before the kill path; the reconciler finishes a kill it finds undone.
//!
//! **The GPU rules.** A VM whose definition has a GPU, or that holds a claim, refuses standby
//! and a running snapshot (`unsupported_with_gpu`: device state cannot be saved); a stopped
//! (disk) snapshot of it is taken, and its restore starts it like a start: a fresh claim,
//! never the device or VMM identity of the time of the snapshot (neither is saved).
//! `cleanup_pending` refuses everything.
//!
//! **One use of a saved memory state.** The guest's memory is only consistent with the disk
//! it was saved with. Resuming a standby consumes its state (`standby` → `starting` is
//! recorded before the VMM loads it); a failed or interrupted resume leaves the instance
//! `stopped` with its disk, never a second resume of the same memory over a disk the first
//! one may have written. A snapshot's memory is resumed over a fresh copy of the snapshot's
//! own disk, so a snapshot can be restored any number of times.

use super::disk::{EFIVARS, OVERLAY};
use super::{now_rfc3339, Manager};
use crate::error::ApiError;
use crate::hypervisor::HypervisorKind;
use crate::store::{InstanceRecord, InstanceState};
use crate::sync::lock;
use crate::wire::InstanceView;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The snapshots of an instance: `<instance dir>/snapshots/<name>/`.
pub(crate) const SNAPSHOTS: &str = "snapshots";
/// The saved state of a `standby` instance: `<instance dir>/standby/`.
pub(crate) const STANDBY: &str = "standby";
/// A saved state's description, in its directory.
const STATE_FILE: &str = "state.json";
/// The memory and device state of a VM saved while it ran.
const MEMORY: &str = "memory";
/// The prefix of a state being written (or removed): never read, removed at start-up.
const PARTIAL: &str = ".partial-";
/// The disk files of a VMM directory a saved state keeps.
const DISK_FILES: [&str; 2] = [OVERLAY, EFIVARS];

/// What a saved state holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SavedKind {
    /// Saved while the VM ran: memory, device state and disks. A restore resumes the VM
    /// where it was (no boot).
    Running,
    /// Saved while the VM was stopped: its disks. A restore boots it.
    Stopped,
}

/// A saved state (`state.json`; a snapshot's entry in `instance.snapshots`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SavedState {
    /// The snapshot's name (`standby` for a standby state).
    pub name: String,
    /// When it was taken (RFC 3339, UTC).
    pub created_at: String,
    /// Memory and disks (`running`) or disks only (`stopped`).
    pub kind: SavedKind,
    /// The hypervisor that saved it (a memory state only loads into the same one).
    pub hypervisor: HypervisorKind,
    /// The vCPUs and memory the VM had (a memory state only loads into the same shape).
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// The NICs and whether a seed disk was attached (a memory state only loads into the
    /// same devices); absent from states saved before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<crate::store::Machine>,
    /// The files it holds, besides `state.json` (`memory`, `disk.qcow2`, `efivars.fd`).
    pub files: Vec<String>,
    /// Bytes on disk (every file; measured when listed, not stored).
    #[serde(default)]
    pub bytes: u64,
}

/// `instance.snapshots`: an instance's snapshots, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SnapshotList {
    /// The instance's id.
    pub instance_id: String,
    /// The instance's name.
    pub name: String,
    /// Its snapshots, oldest first (then by name).
    pub snapshots: Vec<SavedState>,
    /// Bytes every snapshot takes together.
    pub bytes: u64,
}

/// `instance.snapshot_delete`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SnapshotDeleted {
    /// The instance's name.
    pub name: String,
    /// The snapshot removed.
    pub snapshot: String,
}

/// What becomes of a VM paused for a save once its state is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterSave {
    /// It runs on (a snapshot).
    Resume,
    /// It stays paused: its VMM is stopped next (standby).
    StayPaused,
}

/// A snapshot name: 1–63 of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub(crate) fn check_snapshot_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(['.', '-'])
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_request(format!(
            "snapshot name {name:?} is not 1-63 characters of letters, digits, '.', '_' and '-' \
             (not starting with '.' or '-')"
        )))
    }
}

/// Bytes of the regular files in `dir` and its directories (not following links).
fn bytes_in(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok().map(|m| (e.path(), m)))
                .map(|(p, m)| {
                    if m.is_dir() {
                        bytes_in(&p)
                    } else if m.is_file() {
                        m.len()
                    } else {
                        0
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Syncs a saved memory state: a file, or a directory's regular files and the directory.
fn sync_tree(path: &Path) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        for e in std::fs::read_dir(path)?.flatten() {
            if e.file_type().is_ok_and(|t| t.is_file()) {
                std::fs::File::open(e.path())?.sync_all()?;
            }
        }
        return sync_dir(path);
    }
    std::fs::File::open(path)?.sync_all()
}

/// Whether a memory state saved with `saved` loads into a VM made of `now`: the same NICs
/// (their kinds, in order: a tap's bridge may differ) and the same seed disk.
fn same_devices(saved: &crate::store::Machine, now: &crate::store::Machine) -> bool {
    nic_kinds(saved) == nic_kinds(now) && saved.seed == now.seed
}

/// The kinds of a machine's NICs, in guest order.
fn nic_kinds(m: &crate::store::Machine) -> Vec<&'static str> {
    m.nics.iter().map(|n| if matches!(n, crate::network::Nic::User { .. }) { "user" } else { "bridge" }).collect()
}

/// `NICs [user, bridge] and a seed disk`, for a refusal.
fn describe_devices(m: &crate::store::Machine) -> String {
    format!("NICs [{}] and {}", nic_kinds(m).join(", "), if m.seed { "a seed disk" } else { "no seed disk" })
}

/// Syncs a directory (its entries are durable).
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Reads a saved state's description. Errors name the file.
fn read_state(dir: &Path) -> Result<SavedState, String> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut s: SavedState = serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    s.bytes = bytes_in(dir);
    Ok(s)
}

/// Removes a saved-state directory: renamed to a `.partial-` name first (so a crash in the
/// middle of the removal never leaves a listed, half-removed state), then removed.
fn remove_state(dir: &Path) -> std::io::Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let base = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let doomed = parent.join(format!("{PARTIAL}removed-{base}-{}", uuid::Uuid::new_v4().simple()));
    match std::fs::rename(dir, &doomed) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    sync_dir(parent)?;
    std::fs::remove_dir_all(&doomed)
}

impl Manager {
    fn snapshots_dir(&self, rec: &InstanceRecord) -> PathBuf {
        self.store.instance_dir(rec.id).join(SNAPSHOTS)
    }

    fn standby_dir(&self, rec: &InstanceRecord) -> PathBuf {
        self.store.instance_dir(rec.id).join(STANDBY)
    }

    /// Refusals shared by every saved-state operation: `cleanup_pending`, `deleting`, and a
    /// hypervisor that saves no state when `memory` is needed.
    fn check_saveable(&self, rec: &InstanceRecord, op: &str, memory: bool) -> Result<(), ApiError> {
        match rec.state() {
            InstanceState::CleanupPending => return Err(ApiError::instance_cleanup_pending(rec.id, &rec.name)),
            InstanceState::Deleting => {
                return Err(ApiError::invalid_state(format!("instance {} is being deleted", rec.name), "deleting"))
            }
            _ => {}
        }
        if let Some(why) = rec.hypervisor.cannot_save().filter(|_| memory) {
            return Err(ApiError::hypervisor_unsupported(
                format!("{op} of {}: {why}", rec.name),
                Some(rec.hypervisor.name()),
                None,
            ));
        }
        Ok(())
    }

    /// A running VM with a GPU (in its definition, or a claim it holds) saves no memory.
    fn refuse_running_gpu(&self, rec: &InstanceRecord, op: &str) -> Result<(), ApiError> {
        let has_gpu = rec.wants_gpu() || !matches!(self.claim_of(rec)?, super::vmm::OwnedClaim::None);
        if has_gpu {
            return Err(ApiError::unsupported_with_gpu(op, &rec.name));
        }
        Ok(())
    }

    /// `instance.snapshot`: a named snapshot (`name`, or `snap-<UTC time>`). A running VM is
    /// paused, its memory, device state and disks saved, and resumed; a stopped VM's disks
    /// are copied. Errors: `unsupported_with_gpu` (running with a GPU), `invalid_state`
    /// (starting, stopping, standby), `invalid_request` (a bad or taken name, a stopped VM
    /// without a disk: nothing to save), `hypervisor_unsupported`, `internal` (the save or a
    /// copy failed: nothing is left of it, and a running VM runs on).
    pub fn snapshot(&self, r: &str, name: Option<&str>) -> Result<SavedState, ApiError> {
        self.on_instance("snapshot", r, |found| {
            let ilock = self.instance_lock(found.id);
            let _i = lock(&ilock);
            let rec = self.store.read_instance(found.id)?.ok_or_else(|| ApiError::not_found(r))?;
            let name = match name {
                Some(n) => n.to_string(),
                // e.g. snap-20261204T101010.123Z (RFC 3339 in millis without the colons).
                None => format!(
                    "snap-{}",
                    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string().replace([':', '-'], "")
                ),
            };
            check_snapshot_name(&name)?;
            let running = rec.state() == InstanceState::Running;
            self.check_saveable(&rec, "snapshot", running)?;
            match rec.state() {
                InstanceState::Running => self.refuse_running_gpu(&rec, "snapshot")?,
                InstanceState::Stopped => {}
                s => {
                    return Err(ApiError::invalid_state(
                        format!("instance {} is {s}: a snapshot is taken of a running or a stopped VM", rec.name),
                        s.as_str(),
                    ))
                }
            }
            let dir = self.snapshots_dir(&rec).join(&name);
            if dir.exists() {
                return Err(ApiError::invalid_request(format!(
                    "instance {} already has a snapshot {name:?} (instance.snapshot_delete removes it)",
                    rec.name
                )));
            }
            let saved = self.save_state(&rec, &dir, &name, running, AfterSave::Resume)?;
            tracing::info!(instance.id = %rec.id, instance.name = %rec.name, snapshot = %name,
                kind = ?saved.kind, bytes = saved.bytes, "snapshot taken");
            Ok(saved)
        })
    }

    /// `instance.snapshots`: the instance's snapshots, oldest first. A snapshot whose
    /// description cannot be read is an error naming it (never left out).
    pub fn snapshots(&self, r: &str) -> Result<SnapshotList, ApiError> {
        self.on_instance("snapshots", r, |rec| {
            let dir = self.snapshots_dir(rec);
            let mut snapshots = Vec::new();
            let entries = match std::fs::read_dir(&dir) {
                Ok(rd) => rd
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ApiError::internal(format!("{}: {e}", dir.display())))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(ApiError::internal(format!("{}: {e}", dir.display()))),
            };
            for e in entries {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with(PARTIAL) {
                    continue;
                }
                snapshots.push(read_state(&e.path()).map_err(|why| {
                    ApiError::internal(format!("snapshot {n:?} of {} cannot be read: {why}", rec.name))
                })?);
            }
            snapshots.sort_by(|a, b| (&a.created_at, &a.name).cmp(&(&b.created_at, &b.name)));
            let bytes = snapshots.iter().map(|s| s.bytes).sum();
            Ok(SnapshotList { instance_id: rec.id.to_string(), name: rec.name.clone(), snapshots, bytes })
        })
    }

    /// `instance.snapshot_delete`. Errors: `not_found` (no such snapshot).
    pub fn delete_snapshot(&self, r: &str, snapshot: &str) -> Result<SnapshotDeleted, ApiError> {
        self.on_instance("snapshot_delete", r, |found| {
            check_snapshot_name(snapshot)?;
            let ilock = self.instance_lock(found.id);
            let _i = lock(&ilock);
            let rec = self.store.read_instance(found.id)?.ok_or_else(|| ApiError::not_found(r))?;
            let dir = self.snapshots_dir(&rec).join(snapshot);
            if !dir.is_dir() {
                return Err(ApiError::not_found(&format!("snapshot {snapshot} of {}", rec.name)));
            }
            remove_state(&dir).map_err(|e| ApiError::internal(format!("{}: {e}", dir.display())))?;
            tracing::info!(instance.id = %rec.id, instance.name = %rec.name, snapshot, "snapshot deleted");
            Ok(SnapshotDeleted { name: rec.name.clone(), snapshot: snapshot.to_string() })
        })
    }

    /// `instance.standby`: saves a running VM (memory, device state; its disks stay where
    /// they are, flushed) and stops its VMM: state `standby`, no VMM, no device. A start (or
    /// a restore without a snapshot) resumes it. Errors: `unsupported_with_gpu`,
    /// `invalid_state` (not running), `hypervisor_unsupported`, `internal` (the save failed:
    /// the VM runs on), `vmm_kill_failed`.
    pub fn standby(&self, r: &str) -> Result<InstanceView, ApiError> {
        self.on_instance("standby", r, |found| {
            let ilock = self.instance_lock(found.id);
            let _i = lock(&ilock);
            let mut rec = self.store.read_instance(found.id)?.ok_or_else(|| ApiError::not_found(r))?;
            self.check_saveable(&rec, "standby", true)?;
            if rec.state() != InstanceState::Running {
                return Err(ApiError::invalid_state(
                    format!("instance {} is {}: only a running VM goes to standby", rec.name, rec.state()),
                    rec.state().as_str(),
                ));
            }
            self.refuse_running_gpu(&rec, "standby")?;
            let dir = self.standby_dir(&rec);
            // A stale standby state (a record that is not `standby` has none).
            remove_state(&dir).map_err(|e| ApiError::internal(format!("{}: {e}", dir.display())))?;
            self.save_state(&rec, &dir, STANDBY, true, AfterSave::StayPaused)?;
            crate::crash_point!("standby_after_save");
            // The new state first, the paused VMM still named: a crash from here on leaves a
            // `standby` record whose VMM the reconciler stops.
            rec.transition(InstanceState::Standby)?;
            rec.last_error = None;
            self.store.write_instance(&rec)?;
            crate::crash_point!("standby_after_record");
            self.stop_vmm(&rec, false)?;
            self.remove_taps(&rec);
            rec.vmm = None;
            self.store.write_instance(&rec)?;
            tracing::info!(instance.id = %rec.id, instance.name = %rec.name, "instance in standby");
            Ok(self.view_after(&rec))
        })
    }

    /// `instance.restore`: with `snapshot`, the VM goes back to it — its disks are replaced by
    /// the snapshot's, then it starts: resumed where it was for a running snapshot, booted for
    /// a stopped one (a GPU instance claims a fresh device, like a start). Without, a
    /// `standby` instance is resumed (as `instance.start` does). The instance must be stopped
    /// or in standby (a standby state is discarded by a snapshot's restore).
    pub fn restore(&self, r: &str, snapshot: Option<&str>) -> Result<InstanceView, ApiError> {
        let Some(snapshot) = snapshot else {
            return self.on_instance("restore", r, |found| {
                self.check_saveable(found, "restore", false)?;
                if found.state() != InstanceState::Standby {
                    return Err(ApiError::invalid_request(format!(
                        "instance {} is {}, not in standby: name the snapshot to restore (instance.snapshots lists them)",
                        found.name,
                        found.state()
                    )));
                }
                self.start_found(found.id, r, false)
            });
        };
        self.on_instance("restore", r, |found| {
            check_snapshot_name(snapshot)?;
            let ilock = self.instance_lock(found.id);
            let _i = lock(&ilock);
            let mut rec = self.store.read_instance(found.id)?.ok_or_else(|| ApiError::not_found(r))?;
            self.check_saveable(&rec, "restore", false)?;
            let dir = self.snapshots_dir(&rec).join(snapshot);
            if !dir.is_dir() {
                return Err(ApiError::not_found(&format!("snapshot {snapshot} of {}", rec.name)));
            }
            let saved = read_state(&dir)
                .map_err(|why| ApiError::internal(format!("snapshot {snapshot} of {} cannot be read: {why}", rec.name)))?;
            let memory = saved.kind == SavedKind::Running;
            self.check_saveable(&rec, "restore", memory)?;
            match rec.state() {
                InstanceState::Stopped | InstanceState::Standby => {}
                s => {
                    return Err(ApiError::invalid_state(
                        format!("instance {} is {s}: stop it before restoring a snapshot", rec.name),
                        s.as_str(),
                    ))
                }
            }
            if memory {
                self.refuse_running_gpu(&rec, "restore of a running snapshot")?;
                if (saved.hypervisor, saved.vcpus, saved.memory_mib) != (rec.hypervisor, rec.vcpus, rec.memory_mib) {
                    return Err(ApiError::invalid_request(format!(
                        "snapshot {snapshot} was saved from {} with {} vCPUs and {} MiB; instance {} is now {} with {} \
                         vCPUs and {} MiB: its memory cannot be loaded",
                        saved.hypervisor, saved.vcpus, saved.memory_mib, rec.name, rec.hypervisor, rec.vcpus, rec.memory_mib
                    )));
                }
                if let Some(m) = saved.machine.as_ref().filter(|m| !same_devices(m, &rec.machine())) {
                    return Err(ApiError::invalid_request(format!(
                        "snapshot {snapshot} was saved with {}; instance {} now has {}: its memory cannot be loaded \
                         (instance.update it back, or restore a stopped snapshot)",
                        describe_devices(m),
                        rec.name,
                        describe_devices(&rec.machine())
                    )));
                }
            }
            if rec.state() == InstanceState::Standby {
                self.discard_standby(&mut rec, "a snapshot was restored over it")?;
            }
            self.restore_disks(&rec, &dir, &saved)?;
            crate::crash_point!("restore_after_disks");
            tracing::info!(instance.id = %rec.id, instance.name = %rec.name, snapshot, kind = ?saved.kind,
                "snapshot disks restored; starting");
            self.start_locked(rec, false, memory.then(|| dir.join(MEMORY)))
        })
    }

    /// `standby` → `stopped`, the saved state removed (after the record).
    pub(crate) fn discard_standby(&self, rec: &mut InstanceRecord, why: &str) -> Result<(), ApiError> {
        rec.transition(InstanceState::Stopped)?;
        rec.vmm = None;
        self.store.write_instance(rec)?;
        tracing::info!(instance.id = %rec.id, instance.name = %rec.name, why, "standby state discarded");
        self.drop_standby_state(rec.id, &rec.name);
        Ok(())
    }

    /// The memory file of a `standby` instance's saved state, checked readable.
    pub(crate) fn standby_memory(&self, rec: &InstanceRecord) -> Result<PathBuf, ApiError> {
        let dir = self.standby_dir(rec);
        let saved = read_state(&dir).map_err(|why| {
            ApiError::internal(format!(
                "the standby state of {} cannot be read ({why}): stop it to discard it",
                rec.name
            ))
        })?;
        if saved.kind != SavedKind::Running || !saved.files.iter().any(|f| f == MEMORY) {
            return Err(ApiError::internal(format!(
                "the standby state of {} holds no memory: stop it to discard it",
                rec.name
            )));
        }
        Ok(dir.join(MEMORY))
    }

    /// Removes the standby state of instance `id` once it is resumed or discarded (best
    /// effort: the start-up removes what is left, the record being no longer `standby`).
    pub(crate) fn drop_standby_state(&self, id: uuid::Uuid, name: &str) {
        let dir = self.store.instance_dir(id).join(STANDBY);
        if let Err(e) = remove_state(&dir) {
            tracing::warn!(instance.id = %id, instance.name = %name, path = %dir.display(), error = %e,
                "the used or discarded standby state cannot be removed");
        }
    }

    /// Writes a saved state of `rec` at `dir` (under a `.partial-` name, renamed last).
    /// `memory`: the running VM's memory too, the VM paused for the save and the disk copy
    /// and resumed after — unless `then` is [`AfterSave::StayPaused`] (standby: the caller
    /// stops the VMM); after a failure it is always resumed.
    fn save_state(
        &self,
        rec: &InstanceRecord,
        dir: &Path,
        name: &str,
        memory: bool,
        then: AfterSave,
    ) -> Result<SavedState, ApiError> {
        let parent = dir.parent().expect("a saved state's directory has a parent");
        std::fs::create_dir_all(parent).map_err(|e| ApiError::internal(format!("{}: {e}", parent.display())))?;
        let partial = parent.join(format!("{PARTIAL}{name}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&partial).map_err(|e| ApiError::internal(format!("{}: {e}", partial.display())))?;
        let resume = then == AfterSave::Resume;
        let written = self.write_state(rec, &partial, name, memory);
        // A running VM runs on whatever happened (for standby only after a failure).
        if memory && (resume || written.is_err()) {
            if let Err(e) = self.resume_vm(rec) {
                tracing::error!(instance.id = %rec.id, instance.name = %rec.name, error = %e,
                    "the VM paused for a save could not be resumed");
            }
        }
        let saved = written
            .and_then(|saved| {
                std::fs::rename(&partial, dir).and_then(|()| sync_dir(parent)).map(|()| saved).map_err(|e| {
                    ApiError::internal(format!("cannot rename {} to {}: {e}", partial.display(), dir.display()))
                })
            })
            .inspect_err(|_| {
                let _ = std::fs::remove_dir_all(&partial);
            })?;
        crate::crash_point!("save_after_rename");
        Ok(SavedState { bytes: bytes_in(dir), ..saved })
    }

    /// The files of a saved state, into `partial`: the memory (the VM left paused), the
    /// disk files, then `state.json`; each synced, then the directory.
    fn write_state(
        &self,
        rec: &InstanceRecord,
        partial: &Path,
        name: &str,
        memory: bool,
    ) -> Result<SavedState, ApiError> {
        let io = |p: &Path, e: std::io::Error| ApiError::internal(format!("{}: {e}", p.display()));
        let mut files = Vec::new();
        if memory {
            let path = partial.join(MEMORY);
            let vmm =
                rec.vmm.as_ref().ok_or_else(|| ApiError::internal(format!("instance {} has no VMM", rec.name)))?;
            let timeout = Duration::from_secs(self.cfg.vmm_ready_timeout_s);
            rec.hypervisor
                .driver()
                .save(&vmm.control_socket, &self.store.vmm_dir(rec.id), &path, timeout)
                .map_err(|e| ApiError::internal(format!("the state of {} was not saved: {e}", rec.name)))?;
            sync_tree(&path).map_err(|e| io(&path, e))?;
            files.push(MEMORY.to_string());
            crate::crash_point!("save_after_memory");
        }
        let from = self.store.vmm_dir(rec.id);
        for f in DISK_FILES {
            let mut file = match crate::own_file::open(&from, f, false) {
                Ok(Ok(file)) => file,
                Ok(Err(crate::own_file::Entry::Missing)) => continue,
                Ok(Err(other)) => {
                    return Err(ApiError::internal(format!(
                        "{} is not the agent's own file ({}): not saved",
                        from.join(f).display(),
                        other.describe()
                    )))
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(&from.join(f), e)),
            };
            let path = partial.join(f);
            let mut out = std::fs::File::create_new(&path).map_err(|e| io(&path, e))?;
            std::io::copy(&mut file, &mut out).and_then(|_| out.sync_all()).map_err(|e| io(&path, e))?;
            files.push(f.to_string());
        }
        if !memory && files.is_empty() {
            return Err(ApiError::invalid_request(format!(
                "instance {} has no disk: a snapshot of it stopped would hold nothing (snapshot it running)",
                rec.name
            )));
        }
        // What the running VM was started with (an update since is not in its memory).
        let machine = rec.running_machine();
        let saved = SavedState {
            name: name.to_string(),
            created_at: now_rfc3339(),
            kind: if memory { SavedKind::Running } else { SavedKind::Stopped },
            hypervisor: rec.hypervisor,
            vcpus: machine.vcpus,
            memory_mib: machine.memory_mib,
            machine: Some(machine),
            files,
            bytes: 0,
        };
        let path = partial.join(STATE_FILE);
        let mut out = std::fs::File::create_new(&path).map_err(|e| io(&path, e))?;
        let text = serde_json::to_vec_pretty(&saved).map_err(ApiError::internal)?;
        out.write_all(&text).and_then(|()| out.sync_all()).map_err(|e| io(&path, e))?;
        sync_dir(partial).map_err(|e| io(partial, e))?;
        Ok(saved)
    }

    /// Resumes the VM of `rec` (paused for a save).
    fn resume_vm(&self, rec: &InstanceRecord) -> Result<(), String> {
        let vmm = rec.vmm.as_ref().ok_or("no VMM recorded")?;
        rec.hypervisor
            .driver()
            .resume(&vmm.control_socket, crate::hypervisor::qmp::DEFAULT_IO_TIMEOUT)
            .map_err(|e| e.to_string())
    }

    /// Replaces the VMM directory's disk files by the snapshot's (each copied under a
    /// temporary name and renamed over the old one).
    fn restore_disks(&self, rec: &InstanceRecord, dir: &Path, saved: &SavedState) -> Result<(), ApiError> {
        let to = self.vmm_dir_ready(rec)?;
        for f in DISK_FILES.iter().filter(|f| saved.files.iter().any(|s| s == *f)) {
            let src = dir.join(f);
            let mut file =
                std::fs::File::open(&src).map_err(|e| ApiError::internal(format!("{}: {e}", src.display())))?;
            crate::disks::copy_open(&mut file, &src, &to.join(f)).map_err(|e| ApiError::internal(e.to_string()))?;
        }
        Ok(())
    }

    /// The source of a fork from a snapshot: the snapshot's directory (its disk files).
    pub(crate) fn snapshot_dir_of(&self, rec: &InstanceRecord, snapshot: &str) -> Result<PathBuf, ApiError> {
        check_snapshot_name(snapshot)?;
        let dir = self.snapshots_dir(rec).join(snapshot);
        let saved =
            read_state(&dir).map_err(|_| ApiError::not_found(&format!("snapshot {snapshot} of {}", rec.name)))?;
        if !saved.files.iter().any(|f| DISK_FILES.contains(&f.as_str())) {
            return Err(ApiError::invalid_request(format!(
                "snapshot {snapshot} of {} holds no disk: a fork from it would start from nothing of it",
                rec.name
            )));
        }
        Ok(dir)
    }

    /// Start-up: removes what interrupted saves left (`.partial-` directories; a standby
    /// state whose record is not `standby`), for every instance record. Failures are logged.
    pub(crate) fn sweep_saved_states(&self, records: &[InstanceRecord]) {
        for rec in records {
            let inst = self.store.instance_dir(rec.id);
            let mut doomed: Vec<PathBuf> = std::fs::read_dir(inst.join(SNAPSHOTS))
                .into_iter()
                .flatten()
                .chain(std::fs::read_dir(&inst).into_iter().flatten())
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(PARTIAL))
                .map(|e| e.path())
                .collect();
            // What a VMM saved into or restored from in its own directory (never a link:
            // `remove_dir_all` does not follow one, and only directories are taken).
            doomed.extend(
                std::fs::read_dir(self.store.vmm_dir(rec.id))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(crate::hypervisor::VM_STATE_STAGING))
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
            if rec.state() != InstanceState::Standby && self.standby_dir(rec).exists() {
                doomed.push(self.standby_dir(rec));
            }
            for p in doomed {
                match std::fs::remove_dir_all(&p) {
                    Ok(()) => tracing::info!(instance.id = %rec.id, instance.name = %rec.name, path = %p.display(),
                        "removed a saved state an interrupted operation left"),
                    Err(e) => tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, path = %p.display(),
                        error = %e, "cannot remove a saved state an interrupted operation left"),
                }
            }
        }
    }

    /// Start-up: a `running` VM whose VMM reports it paused by a save
    /// ([`crate::hypervisor::Driver::paused_by_save`]) was left so by an agent killed during a snapshot or
    /// a standby: it is resumed (WARN). Nothing else pauses a VM.
    pub(crate) fn resume_interrupted_saves(&self, records: &[InstanceRecord]) {
        // Only a hypervisor that saves states pauses for one; each is asked within 1 s, so a
        // wedged VMM delays the start-up by that at most.
        let running =
            records.iter().filter(|r| r.state() == InstanceState::Running && r.hypervisor.cannot_save().is_none());
        for rec in running {
            let Some(vmm) = &rec.vmm else { continue };
            let driver = rec.hypervisor.driver();
            let io = crate::hypervisor::qmp::DEFAULT_IO_TIMEOUT;
            let Ok(state) = driver.vm_state(&vmm.control_socket, std::time::Duration::from_secs(1)) else { continue };
            if !driver.paused_by_save(&state) {
                continue;
            }
            match driver.resume(&vmm.control_socket, io) {
                Ok(()) => tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, vm_state = %state,
                    "the VM was left paused by a save the agent did not finish: resumed"),
                Err(e) => tracing::error!(instance.id = %rec.id, instance.name = %rec.name, vm_state = %state,
                    error = %e, "the VM was left paused by an unfinished save and cannot be resumed"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_are_checked() {
        for ok in ["a", "snap-20261204T101010.123Z", "before_upgrade.1", &"x".repeat(63)] {
            assert!(check_snapshot_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".hidden", "-x", "a/b", "..", "a b", &"x".repeat(64), "ü"] {
            assert!(check_snapshot_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_removed_state_goes_through_a_partial_name_and_a_missing_one_is_no_error() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path().join("s1");
        std::fs::create_dir(&s).unwrap();
        std::fs::write(s.join(STATE_FILE), b"{}").unwrap();
        remove_state(&s).unwrap();
        assert!(std::fs::read_dir(d.path()).unwrap().next().is_none(), "nothing left");
        remove_state(&s).unwrap();
    }

    #[test]
    fn a_state_reads_back_with_its_size_and_a_broken_one_names_its_file() {
        let d = tempfile::tempdir().unwrap();
        let saved = SavedState {
            name: "s".into(),
            created_at: "2026-12-04T00:00:00Z".into(),
            kind: SavedKind::Running,
            hypervisor: HypervisorKind::Qemu,
            vcpus: 1,
            memory_mib: 64,
            machine: None,
            files: vec![MEMORY.into()],
            bytes: 0,
        };
        std::fs::write(d.path().join(STATE_FILE), serde_json::to_vec(&saved).unwrap()).unwrap();
        std::fs::write(d.path().join(MEMORY), vec![0u8; 1000]).unwrap();
        let back = read_state(d.path()).unwrap();
        assert_eq!(back.bytes, 1000 + std::fs::metadata(d.path().join(STATE_FILE)).unwrap().len());
        assert_eq!(SavedState { bytes: 0, ..back }, saved);
        std::fs::write(d.path().join(STATE_FILE), b"{not json").unwrap();
        let e = read_state(d.path()).unwrap_err();
        assert!(e.contains(STATE_FILE), "{e}");
    }

    #[test]
    fn a_memory_state_loads_only_into_the_same_nic_kinds_and_seed() {
        use crate::network::Nic;
        let m = |nics: Vec<Nic>, seed| crate::store::Machine { vcpus: 1, memory_mib: 64, nics, seed };
        let user = || Nic::User { forwards: vec![] };
        let bridge = |b: &str| Nic::Bridge { bridge: b.into() };
        assert!(same_devices(&m(vec![user(), bridge("br0")], true), &m(vec![user(), bridge("br1")], true)));
        assert!(!same_devices(&m(vec![user()], true), &m(vec![bridge("br0")], true)));
        assert!(!same_devices(&m(vec![], false), &m(vec![user()], true)));
        assert!(!same_devices(&m(vec![], true), &m(vec![], false)));
        assert_eq!(describe_devices(&m(vec![user(), bridge("b")], true)), "NICs [user, bridge] and a seed disk");
    }
}
