//! # store — durable JSON records under the data directory
//!
//! Layout (ARCHITECTURE.md "Files on a host"):
//! ```text
//! <data-dir>/lock                          flock: one agent per data directory
//! <data-dir>/instances/<id>/instance.json  the instance record
//! <data-dir>/claims/<device>.json          one exclusive claim per device
//! <data-dir>/mdevs/<uuid>.json             mdevs gpuvisor created (only these are swept)
//! <data-dir>/health/<device>.json          quarantine marks
//! <data-dir>/images/<name>/                boot artifacts
//! ```
//!
//! Invariants this module keeps:
//! - every record is written atomically: temp file in the same directory, `fsync`,
//!   `rename`, `fsync` of the directory — a reader sees the old or the new record, never a
//!   torn one written by us;
//! - a claim is created with `renameat2(RENAME_NOREPLACE)`, so a second claim of the same
//!   device fails with [`StoreError::ClaimExists`]: two owners are impossible by
//!   construction; releasing a claim is an unlink (it needs no free space);
//! - listings are strict: one record that cannot be read or decoded fails the listing
//!   ([`StoreError::Corrupt`]); callers decide what fails closed.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use uuid::Uuid;

use crate::host::proc::ProcessIdentity;
use gpuvisor_sdk::Framework;

/// Errors of the store. Messages are one sentence and name the file.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot access {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("record {path} cannot be decoded: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("device {device} is already claimed")]
    ClaimExists { device: String },
    #[error("another gpuvisor agent holds {path}")]
    Locked { path: PathBuf },
}

impl StoreError {
    fn io(path: &Path, source: io::Error) -> StoreError {
        StoreError::Io { path: path.to_path_buf(), source }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// Lifecycle state of an instance record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
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
    /// A delete is in progress; nothing may restart it.
    Deleting,
    /// A release failed during rollback or delete: only `instance.delete` is allowed.
    CleanupPending,
}

impl InstanceState {
    /// The wire name (`starting`, `running`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Starting => "starting",
            InstanceState::Running => "running",
            InstanceState::Stopping => "stopping",
            InstanceState::Stopped => "stopped",
            InstanceState::Deleting => "deleting",
            InstanceState::CleanupPending => "cleanup_pending",
        }
    }
}

/// The VMM of a running instance: identity plus control socket (QMP for QEMU).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmmRecord {
    pub identity: ProcessIdentity,
    pub control_socket: PathBuf,
}

/// `instances/<id>/instance.json`. Never stores a device path: GPU ownership lives in
/// claims only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceRecord {
    pub id: Uuid,
    pub name: String,
    pub image: String,
    /// As chosen by the `hypervisor` plugin at create (`qemu`, `cloud-hypervisor`).
    pub hypervisor: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The requested vGPU profile (canonical name, e.g. `L40S-2Q`), if any.
    pub gpu_profile: Option<String>,
    /// The GPU framework the profile was placed with, if any.
    pub gpu_framework: Option<Framework>,
    pub state: InstanceState,
    pub vmm: Option<VmmRecord>,
    /// Wall time, RFC 3339.
    pub created_at: String,
    pub last_error: Option<String>,
}

/// State of a claim record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
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
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimState::Claimed => "claimed",
            ClaimState::Configured => "configured",
            ClaimState::ReleasePending => "release_pending",
        }
    }
}

/// `claims/<device>.json` — the only record of who owns a device (LIFECYCLE.md, Words).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    /// The thing that can have one owner: the VF address (vendor VFIO, and mdev on a VF).
    pub device: String,
    pub framework: Framework,
    pub instance_id: Uuid,
    /// The parent GPU's (PF's) address.
    pub gpu: String,
    pub profile: String,
    /// The type id looked up in the fresh catalog at claim time (diagnostics only; never
    /// written again without a new lookup).
    pub type_id: Option<u32>,
    /// The mdev's UUID (mdev framework).
    pub mdev_uuid: Option<Uuid>,
    /// The mdev type directory name, e.g. `nvidia-1148` (mdev framework).
    pub mdev_type: Option<String>,
    /// Wall time, RFC 3339.
    pub claimed_at: String,
    pub claim_boot_id: String,
    /// CLOCK_BOOTTIME at claim, ms.
    pub claimed_boottime_ms: u64,
    /// The driver version at claim time (diagnostics).
    pub driver_version: Option<String>,
    pub state: ClaimState,
    #[serde(default)]
    pub release_attempts: u32,
    pub last_error: Option<String>,
}

/// `mdevs/<uuid>.json` — written before gpuvisor creates an mdev, removed after it is gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MdevRecord {
    pub uuid: Uuid,
    pub parent: String,
    pub mdev_type: String,
    pub instance_id: Uuid,
    pub created_at: String,
    pub boot_id: String,
    pub created_boottime_ms: u64,
}

/// `health/<device>.json` — a quarantine mark (LIFECYCLE.md, Device health).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthRecord {
    pub device: String,
    /// e.g. `foreign_write`, `kill_escalation`.
    pub reason: String,
    /// `false`: the device is only `suspect` (one strike); placement still uses it. A second
    /// strike quarantines it.
    #[serde(default = "yes")]
    pub quarantined: bool,
    pub detail: String,
    pub at: String,
    /// EIO strikes in a row on this device (type write, mdev create/remove, clear); reset
    /// by a write that takes effect. Two quarantine the device.
    #[serde(default)]
    pub eio_in_a_row: u32,
}

fn yes() -> bool {
    true
}

/// The data directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    /// Opens (and creates, mode 0700) the data directory and its subdirectories.
    pub fn open(root: impl Into<PathBuf>) -> Result<Store> {
        let root = root.into();
        for sub in ["", "instances", "claims", "mdevs", "health", "images"] {
            let p = root.join(sub);
            fs::create_dir_all(&p).map_err(|e| StoreError::io(&p, e))?;
        }
        Ok(Store { root })
    }

    /// The data directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Takes the exclusive `flock` on `<data-dir>/lock` (non-blocking). Hold the returned
    /// file for the agent's lifetime. Errors: [`StoreError::Locked`] if another agent has it.
    pub fn lock_exclusive(&self) -> Result<nix::fcntl::Flock<File>> {
        let path = self.root.join("lock");
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| StoreError::io(&path, e))?;
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|_| StoreError::Locked { path })
    }

    // ----- instances

    /// `instances/<id>/` — also holds the VMM socket, serial log and run files.
    pub fn instance_dir(&self, id: Uuid) -> PathBuf {
        self.root.join("instances").join(id.to_string())
    }

    fn instance_path(&self, id: Uuid) -> PathBuf {
        self.instance_dir(id).join("instance.json")
    }

    /// Writes an instance record atomically (creating its directory).
    pub fn write_instance(&self, rec: &InstanceRecord) -> Result<()> {
        let dir = self.instance_dir(rec.id);
        if !dir.exists() {
            fs::create_dir_all(&dir).map_err(|e| StoreError::io(&dir, e))?;
            fsync_dir(&self.root.join("instances"))?;
        }
        write_json_atomic(&self.instance_path(rec.id), rec)
    }

    /// Reads one instance record; `Ok(None)` if it does not exist.
    pub fn read_instance(&self, id: Uuid) -> Result<Option<InstanceRecord>> {
        read_json_opt(&self.instance_path(id))
    }

    /// Every instance record, strictly: any unreadable or undecodable record fails the
    /// listing. A directory without `instance.json` (a create that crashed before its first
    /// write, or a delete that crashed after removing it) is skipped.
    pub fn list_instances(&self) -> Result<Vec<InstanceRecord>> {
        let dir = self.root.join("instances");
        let mut out = Vec::new();
        for name in list_names(&dir)? {
            let p = dir.join(&name).join("instance.json");
            if let Some(rec) = read_json_opt::<InstanceRecord>(&p)? {
                out.push(rec);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Removes the instance directory: every other file first (VMM socket, serial log,
    /// overlays), then the record itself (durably), then the directory — so a crash midway
    /// leaves a recognisable record, never an orphan directory without one.
    pub fn remove_instance(&self, id: Uuid) -> Result<()> {
        let dir = self.instance_dir(id);
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(StoreError::io(&dir, e)),
        };
        for ent in rd {
            let ent = ent.map_err(|e| StoreError::io(&dir, e))?;
            if ent.file_name() == "instance.json" {
                continue;
            }
            let p = ent.path();
            let res = if ent.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
            match res {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(StoreError::io(&p, e)),
            }
        }
        let p = self.instance_path(id);
        match fs::remove_file(&p) {
            Ok(()) => fsync_dir(&dir)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io(&p, e)),
        }
        match fs::remove_dir(&dir) {
            Ok(()) => fsync_dir(&self.root.join("instances")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(&dir, e)),
        }
    }

    // ----- claims

    fn claim_path(&self, device: &str) -> PathBuf {
        self.root.join("claims").join(format!("{device}.json"))
    }

    /// Creates the claim file exclusively (`renameat2(RENAME_NOREPLACE)`).
    /// Errors: [`StoreError::ClaimExists`] when the device already has a claim.
    pub fn create_claim(&self, claim: &Claim) -> Result<()> {
        let path = self.claim_path(&claim.device);
        let tmp = write_temp(&path, claim)?;
        let dir = self.root.join("claims");
        let res = nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            &tmp,
            nix::fcntl::AT_FDCWD,
            &path,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        );
        match res {
            Ok(()) => fsync_dir(&dir),
            Err(errno) => {
                let _ = fs::remove_file(&tmp);
                if errno == nix::errno::Errno::EEXIST {
                    Err(StoreError::ClaimExists { device: claim.device.clone() })
                } else {
                    Err(StoreError::io(&path, io::Error::from(errno)))
                }
            }
        }
    }

    /// Replaces an existing claim atomically (state changes, release attempts).
    pub fn update_claim(&self, claim: &Claim) -> Result<()> {
        write_json_atomic(&self.claim_path(&claim.device), claim)
    }

    /// Reads the claim of a device; `Ok(None)` if there is none.
    pub fn read_claim(&self, device: &str) -> Result<Option<Claim>> {
        read_json_opt(&self.claim_path(device))
    }

    /// Removes a claim (unlink + directory fsync). A missing claim is not an error.
    pub fn remove_claim(&self, device: &str) -> Result<()> {
        remove_file_durable(&self.claim_path(device), &self.root.join("claims"))
    }

    /// Every claim, strictly.
    pub fn list_claims(&self) -> Result<Vec<Claim>> {
        list_records(&self.root.join("claims"))
    }

    // ----- mdev records

    fn mdev_path(&self, uuid: Uuid) -> PathBuf {
        self.root.join("mdevs").join(format!("{uuid}.json"))
    }

    /// Records an mdev gpuvisor is about to create.
    pub fn write_mdev(&self, rec: &MdevRecord) -> Result<()> {
        write_json_atomic(&self.mdev_path(rec.uuid), rec)
    }

    /// Forgets an mdev after it is gone.
    pub fn remove_mdev(&self, uuid: Uuid) -> Result<()> {
        remove_file_durable(&self.mdev_path(uuid), &self.root.join("mdevs"))
    }

    /// Every mdev record, strictly.
    pub fn list_mdevs(&self) -> Result<Vec<MdevRecord>> {
        list_records(&self.root.join("mdevs"))
    }

    // ----- health

    fn health_path(&self, device: &str) -> PathBuf {
        self.root.join("health").join(format!("{device}.json"))
    }

    /// Writes a quarantine mark.
    pub fn write_health(&self, rec: &HealthRecord) -> Result<()> {
        write_json_atomic(&self.health_path(&rec.device), rec)
    }

    /// The health record of `device`, if any (an undecodable one is an error).
    pub fn read_health(&self, device: &str) -> Result<Option<HealthRecord>> {
        read_json_opt(&self.health_path(device))
    }

    /// Every quarantine mark, strictly (an unreadable one makes placement fail closed).
    pub fn list_health(&self) -> Result<Vec<HealthRecord>> {
        list_records(&self.root.join("health"))
    }

    /// Clears a quarantine mark.
    pub fn remove_health(&self, device: &str) -> Result<()> {
        remove_file_durable(&self.health_path(device), &self.root.join("health"))
    }

    /// `images/`.
    pub fn images_dir(&self) -> PathBuf {
        self.root.join("images")
    }
}

/// Lists the record names of a directory, skipping hidden files (our temp files start
/// with `.`).
fn list_names(dir: &Path) -> Result<Vec<String>> {
    let rd = fs::read_dir(dir).map_err(|e| StoreError::io(dir, e))?;
    let mut names = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| StoreError::io(dir, e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

fn list_records<T: DeserializeOwned>(dir: &Path) -> Result<Vec<T>> {
    let mut out = Vec::new();
    for name in list_names(dir)? {
        let p = dir.join(&name);
        if !name.ends_with(".json") {
            return Err(StoreError::Corrupt { path: p, reason: "unexpected file name".into() });
        }
        match read_json_opt(&p)? {
            Some(r) => out.push(r),
            None => continue, // removed while listing
        }
    }
    Ok(out)
}

fn read_json_opt<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::io(path, e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| StoreError::Corrupt { path: path.to_path_buf(), reason: e.to_string() })
}

/// Writes `value` as JSON to a fresh temp file beside `path` and fsyncs it; returns the
/// temp path.
fn write_temp<T: Serialize>(path: &Path, value: &T) -> Result<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let base = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{base}.{}.{}.tmp", std::process::id(), Uuid::new_v4().simple()));
    let mut bytes = serde_json::to_vec_pretty(value)
        .map_err(|e| StoreError::Corrupt { path: path.to_path_buf(), reason: e.to_string() })?;
    bytes.push(b'\n');
    let res = (|| -> io::Result<()> {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(&tmp);
        return Err(StoreError::io(path, e));
    }
    Ok(tmp)
}

/// Atomic replace: temp file, fsync, rename, fsync directory.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let tmp = write_temp(path, value)?;
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(StoreError::io(path, e));
    }
    fsync_dir(path.parent().unwrap_or(Path::new(".")))
}

fn remove_file_durable(path: &Path, dir: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => fsync_dir(dir),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io(path, e)),
    }
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| StoreError::io(dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(device: &str) -> Claim {
        Claim {
            device: device.into(),
            framework: Framework::VendorVfio,
            instance_id: Uuid::new_v4(),
            gpu: "0000:41:00.0".into(),
            profile: "L40S-2Q".into(),
            type_id: Some(1148),
            mdev_uuid: None,
            mdev_type: None,
            claimed_at: "2026-01-01T00:00:00Z".into(),
            claim_boot_id: "b".into(),
            claimed_boottime_ms: 1,
            driver_version: None,
            state: ClaimState::Claimed,
            release_attempts: 0,
            last_error: None,
        }
    }

    #[test]
    fn a_second_exclusive_claim_of_a_device_fails() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        s.create_claim(&claim("0000:41:00.4")).unwrap();
        let err = s.create_claim(&claim("0000:41:00.4")).unwrap_err();
        assert!(matches!(err, StoreError::ClaimExists { .. }), "{err}");
        assert_eq!(s.list_claims().unwrap().len(), 1);
        // no temp files left behind
        let names: Vec<_> = fs::read_dir(d.path().join("claims")).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn removing_a_claim_frees_the_device() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        s.create_claim(&claim("0000:41:00.4")).unwrap();
        s.remove_claim("0000:41:00.4").unwrap();
        s.remove_claim("0000:41:00.4").unwrap();
        s.create_claim(&claim("0000:41:00.4")).unwrap();
    }

    #[test]
    fn a_torn_record_fails_the_strict_listing_at_every_offset() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        let c = claim("0000:41:00.5");
        let full = serde_json::to_vec_pretty(&c).unwrap();
        for cut in 0..full.len() - 1 {
            fs::write(d.path().join("claims/0000:41:00.5.json"), &full[..cut]).unwrap();
            assert!(matches!(s.list_claims(), Err(StoreError::Corrupt { .. })), "cut at {cut} was accepted");
        }
    }

    #[test]
    fn stray_temp_files_are_ignored() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        fs::write(d.path().join("claims/.x.json.1.abc.tmp"), b"{").unwrap();
        assert!(s.list_claims().unwrap().is_empty());
    }

    #[test]
    fn the_data_directory_lock_is_exclusive() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        let _held = s.lock_exclusive().unwrap();
        assert!(matches!(s.lock_exclusive(), Err(StoreError::Locked { .. })));
    }
}
