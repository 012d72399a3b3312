//! # store — durable JSON records under the data directory
//!
//! Layout (docs/design/architecture.md "Files on a host"):
//! ```text
//! <data-dir>/lock                          flock: one agent per data directory
//! <data-dir>/instances/<id>/instance.json  the instance record (the directory is the agent's alone)
//! <data-dir>/instances/<id>/vmm/           the instance's VMM directory (its sockets, logs, disk)
//! <data-dir>/names/<name>                  the name index: the id owning an instance name
//! <data-dir>/claims/<device>.json          one exclusive claim per device
//! <data-dir>/vmm-ids/<uid>.json            one exclusive record per VMM uid/gid in use
//! <data-dir>/vmm-root/                     empty: each VMM's view is mounted here (in its namespace)
//! <data-dir>/mdevs/<uuid>.json             mdevs gpuvisor created (only these are swept)
//! <data-dir>/health/<device>.json          health marks (suspect / quarantined)
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
//! - listings are **tolerant and honest**: a record that cannot be read or decoded is
//!   returned as [`Unreadable`] (its path, the key its file name gives, the error) beside the
//!   records that could be read; only a directory that cannot be listed fails the listing.
//!   Callers fail closed for what an unreadable record may own (docs/design/lifecycle.md, docs/design/invariants.md
//!   I6), and nothing else;
//! - an instance's state changes only through [`InstanceRecord::transition`], which checks
//!   its transition table ([`InstanceState::can_move_to`]); a claim record moves only along
//!   its own ([`ClaimState::can_move_to`], checked by [`Store::update_claim`]);
//! - the record formats are the domain's types ([`crate::domain`], re-exported here): they
//!   depend on no type of the plugin SDK.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use uuid::Uuid;

pub use crate::domain::*;

/// Errors of the store. Messages are one sentence and name the file.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file or directory of the store could not be read, written or listed.
    #[error("cannot access {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A record exists but does not decode (an unreadable record: listed, never taken as
    /// absent).
    #[error("record {path} cannot be decoded: {reason}")]
    Corrupt {
        /// The record's file.
        path: PathBuf,
        /// Why it does not decode.
        reason: String,
    },
    /// A claim of the device already exists (one claim per device).
    #[error("device {device} is already claimed")]
    ClaimExists {
        /// The device (BDF).
        device: String,
    },
    /// Another instance has the name.
    #[error("the name {name} belongs to instance {owner}")]
    NameTaken {
        /// The instance name asked for.
        name: String,
        /// The instance that has it.
        owner: Uuid,
    },
    /// Another agent holds the store's lock: two agents never share a data directory.
    #[error("another gpuvisor agent holds {path}")]
    Locked {
        /// The store's lock file.
        path: PathBuf,
    },
    /// An update of a claim the table of [`ClaimState::can_move_to`] does not allow, or of a
    /// claim whose record is gone or is another claim now (a bug in the caller: nothing is
    /// written).
    #[error("claim of {device}: {from} → {to} is not a legal claim update")]
    IllegalClaimUpdate {
        /// The claim's device.
        device: String,
        /// The claim's state as found (or why there is none to update).
        from: String,
        /// The state asked for.
        to: ClaimState,
    },
}

impl StoreError {
    fn io(path: &Path, source: io::Error) -> StoreError {
        StoreError::Io { path: path.to_path_buf(), source }
    }

    /// True when the error is the disk being full (ENOSPC/EDQUOT).
    pub fn is_disk_full(&self) -> bool {
        matches!(self, StoreError::Io { source, .. } if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }
}

/// The store's result.
pub type Result<T> = std::result::Result<T, StoreError>;

/// A store error at the API: an undecodable record is `unreadable_record`, anything else
/// `internal`.
impl From<StoreError> for crate::error::ApiError {
    fn from(e: StoreError) -> crate::error::ApiError {
        match e {
            StoreError::Corrupt { path, reason } => crate::error::ApiError::unreadable_record(&path, &reason),
            e => crate::error::ApiError::internal(format!("store: {e}")),
        }
    }
}

/// `mdevs/<uuid>.json` — written before gpuvisor creates an mdev, removed after it is gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MdevRecord {
    /// The mdev's UUID.
    pub uuid: Uuid,
    /// The parent device's address (the VF or GPU it is created on).
    pub parent: String,
    /// The type directory name, e.g. `nvidia-1148`.
    pub mdev_type: String,
    /// The owning instance (`None`: an external owner).
    #[serde(default)]
    pub instance_id: Option<Uuid>,
    /// When the record was written (RFC 3339, UTC).
    pub created_at: String,
    /// The host's boot id then (an mdev does not outlive a reboot).
    pub boot_id: String,
    /// CLOCK_BOOTTIME when the record was written, ms.
    pub created_boottime_ms: u64,
}

/// A record that exists but could not be read or decoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unreadable {
    /// The file.
    pub path: PathBuf,
    /// What the file name says the record is about: the device of a claim or health mark,
    /// the instance id of an instance record, the uuid of an mdev record.
    pub key: String,
    /// Why it could not be read (one sentence).
    pub error: String,
    /// The instance the record names, when its JSON still says (`instance_id`): a claim
    /// that does not decode may still tell whose it is.
    #[serde(default)]
    pub owner: Option<Uuid>,
}

/// A tolerant listing: the records that could be read, and those that could not.
#[derive(Debug, Clone, PartialEq)]
pub struct Listing<T> {
    /// The records that could be read.
    pub records: Vec<T>,
    /// The records that exist but could not be read, each with why.
    pub unreadable: Vec<Unreadable>,
}

impl<T> Default for Listing<T> {
    fn default() -> Self {
        Listing { records: Vec::new(), unreadable: Vec::new() }
    }
}

impl<T> Listing<T> {
    /// True when every record could be read.
    pub fn complete(&self) -> bool {
        self.unreadable.is_empty()
    }

    /// True when an unreadable record's key is `key` (it may concern that device or id).
    pub fn unreadable_key(&self, key: &str) -> bool {
        self.unreadable.iter().any(|u| u.key.eq_ignore_ascii_case(key))
    }

    /// The records, or the first unreadable one as [`StoreError::Corrupt`].
    pub fn strict(self) -> Result<Vec<T>> {
        match self.unreadable.into_iter().next() {
            None => Ok(self.records),
            Some(u) => Err(StoreError::Corrupt { path: u.path, reason: u.error }),
        }
    }
}

/// The data directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

const SUBDIRS: [&str; 9] = ["", "instances", "names", "claims", "mdevs", "health", "images", "vmm-ids", "vmm-root"];

impl Store {
    /// Opens (and creates, mode 0700) the data directory and its subdirectories. A data
    /// directory from before the name index gets one, built from the readable records.
    pub fn open(root: impl Into<PathBuf>) -> Result<Store> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let root = root.into();
        let had_names = root.join("names").is_dir();
        for sub in SUBDIRS {
            let p = root.join(sub);
            fs::DirBuilder::new().recursive(true).mode(0o700).create(&p).map_err(|e| StoreError::io(&p, e))?;
        }
        // The agent's alone: no VMM (nor any other user) needs to reach into it — each VMM
        // sees its own files through its view (crate::host::vmm_view).
        let m = fs::metadata(&root).map_err(|e| StoreError::io(&root, e))?;
        if m.permissions().mode() & 0o077 != 0 {
            if let Err(e) = fs::set_permissions(&root, fs::Permissions::from_mode(0o700)) {
                tracing::warn!(data_dir = %root.display(), error = %e, "the data directory cannot be made mode 0700");
            }
        }
        let store = Store { root };
        if !had_names {
            for rec in store.scan_instances()?.records {
                if let Err(e) = store.claim_name(&rec.name, rec.id) {
                    tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, error = %e, "name index: cannot index the instance");
                }
            }
        }
        Ok(store)
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

    /// `instances/<id>/` — the agent's alone: the record, the VMM log, the rotated console
    /// log; its VMM's files are in [`Store::vmm_dir`].
    pub fn instance_dir(&self, id: Uuid) -> PathBuf {
        self.root.join("instances").join(id.to_string())
    }

    /// `instances/<id>/vmm/` — the VMM's directory: its sockets, serial log, disk overlay,
    /// UEFI variables and seed; the only writable part of its view.
    pub fn vmm_dir(&self, id: Uuid) -> PathBuf {
        self.instance_dir(id).join(crate::hypervisor::confine::VMM_DIR)
    }

    /// `vmm-root/`: the empty directory each VMM's view is mounted on, in its own mount
    /// namespace ([`crate::host::vmm_view`]).
    pub fn view_root(&self) -> PathBuf {
        self.root.join("vmm-root")
    }

    /// `instances/<id>/instance.json`.
    pub fn instance_path(&self, id: Uuid) -> PathBuf {
        self.instance_dir(id).join("instance.json")
    }

    /// Writes an instance record atomically (creating its directory). Answers the state the
    /// record had on disk before (`None`: no record, or one that cannot be read), for the
    /// caller that publishes the change (`instances::records`).
    pub fn persist_instance(&self, rec: &InstanceRecord) -> Result<Option<InstanceState>> {
        let dir = self.instance_dir(rec.id);
        if !dir.exists() {
            fs::create_dir_all(&dir).map_err(|e| StoreError::io(&dir, e))?;
            fsync_dir(&self.root.join("instances"))?;
            crate::crash_point!("instance_dir_created");
        }
        let before = read_json_opt::<InstanceRecord>(&self.instance_path(rec.id)).ok().flatten().map(|r| r.state());
        write_json_atomic(&self.instance_path(rec.id), rec)?;
        Ok(before)
    }

    /// Reads one instance record; `Ok(None)` if it does not exist.
    pub fn read_instance(&self, id: Uuid) -> Result<Option<InstanceRecord>> {
        read_json_opt(&self.instance_path(id))
    }

    /// Every instance record, tolerantly: unreadable records are listed as such (key: the
    /// instance id). A directory without `instance.json` (a create that crashed before its
    /// first write, or a delete that crashed after removing it) is skipped. Errors: the
    /// instances directory cannot be listed.
    pub fn scan_instances(&self) -> Result<Listing<InstanceRecord>> {
        let dir = self.root.join("instances");
        let mut out = Listing::default();
        for name in list_names(&dir)? {
            let p = dir.join(&name).join("instance.json");
            match read_json_opt::<InstanceRecord>(&p) {
                Ok(Some(rec)) => out.records.push(rec),
                Ok(None) => {}
                Err(e) => {
                    let owner = Uuid::parse_str(&name).ok();
                    out.unreadable.push(Unreadable { path: p, key: name, error: e.to_string(), owner })
                }
            }
        }
        out.records.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Every instance record, strictly (the first unreadable one is an error).
    pub fn list_instances(&self) -> Result<Vec<InstanceRecord>> {
        self.scan_instances()?.strict()
    }

    /// Removes the instance directory and its name: every other file first (VMM socket,
    /// serial log, overlays), then the record itself (durably), then the directory, then the
    /// name index entry, then its VMM id record — so a crash midway leaves a recognisable
    /// record, or a stale name entry that the next [`Store::claim_name`] replaces, or a VMM id
    /// record of a gone instance that the next allocation frees, never an orphan directory
    /// without a record. Answers the instance's name (`None`: its record could not be read).
    pub fn erase_instance(&self, id: Uuid) -> Result<Option<String>> {
        let dir = self.instance_dir(id);
        let rec = self.read_instance(id).ok().flatten();
        let name = rec.as_ref().map(|r| r.name.clone());
        let vmm_id = rec.as_ref().and_then(|r| r.vmm_id);
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => Some(rd),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(StoreError::io(&dir, e)),
        };
        if let Some(rd) = rd {
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
                Ok(()) => fsync_dir(&self.root.join("instances"))?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(StoreError::io(&dir, e)),
            }
        }
        if let Some(name) = &name {
            self.release_name(name, id)?;
        }
        // Last: the VMM id (nothing of the instance is left that its VMM could own).
        crate::crash_point!("delete_before_vmm_id_release");
        if let Some(uid) = vmm_id {
            if self.read_vmm_id(uid).ok().flatten().is_some_and(|r| r.instance_id == id) {
                self.remove_vmm_id(uid)?;
            }
        }
        Ok(name)
    }

    // ----- leftovers of interrupted operations

    /// What an operation killed midway left that no record owns (docs/design/invariants.md I10):
    /// an instance directory without `instance.json` (a create killed before its first
    /// record was written, a delete killed after removing it), a name index entry whose
    /// instance has no record, a temp file of an atomic write (`.<file>.<pid>.<n>.tmp`) in
    /// any store directory, and the hidden staging directory of an image import
    /// (`images/.<name>.<n>`). Only meaningful while no operation runs (at start, before the
    /// first pass). Errors: a store directory cannot be listed.
    pub fn leftovers(&self) -> Result<Vec<Leftover>> {
        let mut out = Vec::new();
        let instances = self.root.join("instances");
        for name in list_all(&instances)? {
            let dir = instances.join(&name);
            let Ok(id) = Uuid::parse_str(&name) else { continue };
            if !dir.is_dir() {
                continue;
            }
            if self.instance_path(id).exists() {
                out.extend(temp_files(&dir)?.into_iter().map(Leftover::TempFile));
            } else {
                out.push(Leftover::InstanceDir(id));
            }
        }
        for name in list_names(&self.root.join("names"))? {
            match self.name_owner(&name) {
                // Listed after the instance directories: removed once its directory is gone.
                Ok(Some(id)) if !self.instance_path(id).exists() => out.push(Leftover::Name(name)),
                _ => {}
            }
        }
        for sub in ["", "claims", "health", "mdevs", "names", "vmm-ids"] {
            out.extend(temp_files(&self.root.join(sub))?.into_iter().map(Leftover::TempFile));
        }
        let images = self.images_dir();
        for name in list_all(&images)? {
            if name.starts_with('.') && images.join(&name).is_dir() {
                out.push(Leftover::ImageStage(images.join(name)));
            }
        }
        Ok(out)
    }

    /// Removes one [`Leftover`] (an instance directory only while it still has no record;
    /// a name entry only while it still names no record).
    pub fn remove_leftover(&self, l: &Leftover) -> Result<()> {
        let gone = |p: &Path, r: io::Result<()>| match r {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(p, e)),
        };
        match l {
            Leftover::InstanceDir(id) => {
                if self.instance_path(*id).exists() {
                    return Ok(());
                }
                let dir = self.instance_dir(*id);
                gone(&dir, fs::remove_dir_all(&dir))?;
                fsync_dir(&self.root.join("instances"))
            }
            Leftover::Name(name) => match self.name_owner(name)? {
                Some(id) if !self.instance_path(id).exists() && !self.instance_dir(id).exists() => {
                    remove_file_durable(&self.name_path(name), &self.root.join("names"))
                }
                _ => Ok(()),
            },
            Leftover::TempFile(p) => gone(p, fs::remove_file(p)),
            Leftover::ImageStage(p) => gone(p, fs::remove_dir_all(p)),
        }
    }

    // ----- names

    fn name_path(&self, name: &str) -> PathBuf {
        self.root.join("names").join(name)
    }

    /// A name that can be a file of the index (callers validate instance names; this keeps
    /// the index inside its directory whatever they pass).
    fn indexable(name: &str) -> bool {
        !name.is_empty() && name.len() <= 255 && name != "." && name != ".." && !name.contains(['/', '\0'])
    }

    /// The instance id the name index gives for `name` (`Ok(None)`: no entry). The entry
    /// may be stale (its instance gone); callers read the record.
    pub fn name_owner(&self, name: &str) -> Result<Option<Uuid>> {
        #[derive(Deserialize)]
        struct Entry {
            id: Uuid,
        }
        if !Store::indexable(name) {
            return Ok(None);
        }
        Ok(read_json_opt::<Entry>(&self.name_path(name))?.map(|e| e.id))
    }

    /// Gives `name` to `id` in the name index (O(1): one exclusive file). An entry whose
    /// instance has no record directory any more is stale and replaced. Callers hold the
    /// allocation lock (two callers could otherwise both replace one stale entry). Errors:
    /// [`StoreError::NameTaken`] when a live (or unreadable) instance owns the name.
    pub fn claim_name(&self, name: &str, id: Uuid) -> Result<()> {
        if !Store::indexable(name) {
            let e = io::Error::new(io::ErrorKind::InvalidInput, "not a valid instance name");
            return Err(StoreError::io(&self.root.join("names"), e));
        }
        let path = self.name_path(name);
        let entry = serde_json::json!({ "id": id });
        match create_exclusive(&path, &entry) {
            Ok(()) => Ok(()),
            Err(StoreError::ClaimExists { .. }) => match self.name_owner(name) {
                Ok(Some(owner)) if owner == id => Ok(()),
                Ok(Some(owner)) if self.instance_path(owner).exists() => {
                    Err(StoreError::NameTaken { name: name.to_string(), owner })
                }
                // No record: a create or delete that crashed midway left the entry.
                Ok(_) | Err(StoreError::Corrupt { .. }) => write_json_atomic(&path, &entry),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        }
    }

    /// Removes `name` from the index if it names `id` (a missing entry is not an error).
    pub fn release_name(&self, name: &str, id: Uuid) -> Result<()> {
        match self.name_owner(name) {
            Ok(Some(owner)) if owner != id => Ok(()),
            Ok(None) => Ok(()),
            _ => remove_file_durable(&self.name_path(name), &self.root.join("names")),
        }
    }

    // ----- claims

    fn claim_path(&self, device: &str) -> PathBuf {
        self.root.join("claims").join(format!("{device}.json"))
    }

    /// Creates the claim file exclusively (`renameat2(RENAME_NOREPLACE)`).
    /// Errors: [`StoreError::ClaimExists`] when the device already has a claim.
    pub fn persist_new_claim(&self, claim: &Claim) -> Result<()> {
        create_exclusive(&self.claim_path(&claim.device), claim).map_err(|e| match e {
            StoreError::ClaimExists { .. } => StoreError::ClaimExists { device: claim.device.clone() },
            e => e,
        })
    }

    /// Replaces an existing claim atomically (state changes, release attempts).
    ///
    /// Only an existing record of the same claim is updated, and only along the claim
    /// transition table ([`ClaimState::can_move_to`]): an update of a record that is gone
    /// (released meanwhile) or is another claim now, or an illegal move, writes nothing
    /// ([`StoreError::IllegalClaimUpdate`]).
    pub fn update_claim(&self, claim: &Claim) -> Result<()> {
        let refuse = |from: &str| StoreError::IllegalClaimUpdate {
            device: claim.device.clone(),
            from: from.to_string(),
            to: claim.state,
        };
        match self.read_claim(&claim.device)? {
            None => return Err(refuse("no record")),
            Some(cur) if !cur.same_claim(claim) => return Err(refuse("another claim")),
            Some(cur) if !cur.state.can_move_to(claim.state) => return Err(refuse(cur.state.as_str())),
            Some(_) => {}
        }
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

    /// Every claim, tolerantly (key: the device named by the file).
    pub fn scan_claims(&self) -> Result<Listing<Claim>> {
        scan_records(&self.root.join("claims"))
    }

    /// Every claim, strictly.
    pub fn list_claims(&self) -> Result<Vec<Claim>> {
        self.scan_claims()?.strict()
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

    /// Every mdev record, tolerantly (key: the uuid named by the file).
    pub fn scan_mdevs(&self) -> Result<Listing<MdevRecord>> {
        scan_records(&self.root.join("mdevs"))
    }

    // ----- health

    fn health_path(&self, device: &str) -> PathBuf {
        self.root.join("health").join(format!("{device}.json"))
    }

    /// Writes a health mark.
    pub fn persist_health(&self, rec: &HealthRecord) -> Result<()> {
        write_json_atomic(&self.health_path(&rec.device), rec)
    }

    /// The health record of `device`, if any (an undecodable one is an error).
    pub fn read_health(&self, device: &str) -> Result<Option<HealthRecord>> {
        read_json_opt(&self.health_path(device))
    }

    /// Every health mark, tolerantly (key: the device named by the file).
    pub fn scan_health(&self) -> Result<Listing<HealthRecord>> {
        scan_records(&self.root.join("health"))
    }

    /// Clears a health mark; answers whether there was one.
    pub fn erase_health(&self, device: &str) -> Result<bool> {
        let path = self.health_path(device);
        let had = path.exists();
        remove_file_durable(&path, &self.root.join("health"))?;
        Ok(had)
    }

    /// `images/`.
    pub fn images_dir(&self) -> PathBuf {
        self.root.join("images")
    }

    // ----- VMM ids

    fn vmm_id_path(&self, uid: u32) -> PathBuf {
        self.root.join("vmm-ids").join(format!("{uid}.json"))
    }

    /// Records that `rec.uid` is taken, exclusively (`renameat2(RENAME_NOREPLACE)`).
    /// Errors: [`StoreError::ClaimExists`] when the id already has a record.
    pub fn create_vmm_id(&self, rec: &VmmIdRecord) -> Result<()> {
        create_exclusive(&self.vmm_id_path(rec.uid), rec)
    }

    /// The record of id `uid`; `Ok(None)` when there is none.
    pub fn read_vmm_id(&self, uid: u32) -> Result<Option<VmmIdRecord>> {
        read_json_opt(&self.vmm_id_path(uid))
    }

    /// Frees id `uid` (unlink + directory fsync). A missing record is not an error.
    pub fn remove_vmm_id(&self, uid: u32) -> Result<()> {
        remove_file_durable(&self.vmm_id_path(uid), &self.root.join("vmm-ids"))
    }

    /// Every VMM id record, tolerantly (key: the uid named by the file).
    pub fn scan_vmm_ids(&self) -> Result<Listing<VmmIdRecord>> {
        scan_records(&self.root.join("vmm-ids"))
    }
}

/// `vmm-ids/<uid>.json` — the uid (and gid) `uid` belongs to instance `instance_id`'s VMM.
/// Exclusive: one record per id; removed only once nothing of the instance remains.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmmIdRecord {
    /// The uid (and gid) of the VMM.
    pub uid: u32,
    /// The instance whose VMM runs under it.
    pub instance_id: Uuid,
    /// The instance's name (for people reading the file).
    pub name: String,
    /// Wall time, RFC 3339.
    pub assigned_at: String,
}

/// Something an interrupted operation left that no record owns ([`Store::leftovers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leftover {
    /// `instances/<id>/` without `instance.json`.
    InstanceDir(Uuid),
    /// `names/<name>` whose instance has no record.
    Name(String),
    /// A temp file of an atomic write.
    TempFile(PathBuf),
    /// `images/.<name>.<n>/`, the staging copy of an import.
    ImageStage(PathBuf),
}

impl std::fmt::Display for Leftover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leftover::InstanceDir(id) => write!(f, "instance directory {id} without a record"),
            Leftover::Name(n) => write!(f, "name index entry {n:?} whose instance has no record"),
            Leftover::TempFile(p) => write!(f, "temp file {}", p.display()),
            Leftover::ImageStage(p) => write!(f, "staging copy of an image import {}", p.display()),
        }
    }
}

/// Every entry of a directory (hidden ones too), sorted; a missing directory has none.
fn list_all(dir: &Path) -> Result<Vec<String>> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StoreError::io(dir, e)),
    };
    let mut names = Vec::new();
    for ent in rd {
        names.push(ent.map_err(|e| StoreError::io(dir, e))?.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

/// The temp files of atomic writes in `dir` (`.<file>.<pid>.<n>.tmp`, see `write_temp`).
fn temp_files(dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(list_all(dir)?
        .into_iter()
        .filter(|n| n.starts_with('.') && n.ends_with(".tmp"))
        .map(|n| dir.join(n))
        .filter(|p| p.is_file())
        .collect())
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

fn scan_records<T: DeserializeOwned>(dir: &Path) -> Result<Listing<T>> {
    let mut out = Listing::default();
    for name in list_names(dir)? {
        let p = dir.join(&name);
        let Some(key) = name.strip_suffix(".json") else {
            out.unreadable.push(Unreadable {
                path: p,
                key: name,
                error: "not a record file (no .json suffix)".into(),
                owner: None,
            });
            continue;
        };
        match read_json_opt(&p) {
            Ok(Some(r)) => out.records.push(r),
            Ok(None) => continue, // removed while listing
            Err(e) => {
                let owner = best_effort_owner(&p);
                out.unreadable.push(Unreadable { path: p, key: key.to_string(), error: e.to_string(), owner })
            }
        }
    }
    Ok(out)
}

/// The `instance_id` of a record that does not decode as its type, when it is still JSON.
fn best_effort_owner(path: &Path) -> Option<Uuid> {
    let v: serde_json::Value = serde_json::from_slice(&fs::read(path).ok()?).ok()?;
    Uuid::parse_str(v.get("instance_id")?.as_str()?).ok()
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

/// Exclusive create: temp file, fsync, `renameat2(RENAME_NOREPLACE)`, fsync directory.
/// Errors: [`StoreError::ClaimExists`] (with the path as `device`) when `path` exists.
fn create_exclusive<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let tmp = write_temp(path, value)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let res = nix::fcntl::renameat2(
        nix::fcntl::AT_FDCWD,
        &tmp,
        nix::fcntl::AT_FDCWD,
        path,
        nix::fcntl::RenameFlags::RENAME_NOREPLACE,
    );
    match res {
        Ok(()) => fsync_dir(dir),
        Err(errno) => {
            let _ = fs::remove_file(&tmp);
            if errno == nix::errno::Errno::EEXIST {
                Err(StoreError::ClaimExists { device: path.display().to_string() })
            } else {
                Err(StoreError::io(path, io::Error::from(errno)))
            }
        }
    }
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
pub(crate) mod tests {
    use super::*;

    fn claim(device: &str) -> Claim {
        Claim {
            device: device.into(),
            owner: Owner::Instance(Uuid::new_v4()),
            owner_name: Some("a".into()),
            owner_labels: Some(Labels::new()),
            gpu: "0000:41:00.0".into(),
            profile: "L40S-2Q".into(),
            kind: ClaimKind::Vf { type_id: Some(1148) },
            claimed_at: "2026-01-01T00:00:00Z".into(),
            claim_boot_id: "b".into(),
            claimed_boottime_ms: 1,
            driver_version: None,
            state: ClaimState::Claimed,
            release_attempts: 0,
            last_error: None,
        }
    }

    /// Claim records as every version before owners wrote them (`instance_id` only), one
    /// per kind: they read as instance-owned, and are written back in the same form.
    #[test]
    fn claims_written_before_owners_read_as_instance_owned() {
        let id = "6f1c2a8e-3b4d-4e5f-8a9b-0c1d2e3f4a5b";
        let vf = r#"{"device":"0000:41:00.4","framework":"vendor_vfio","instance_id":"6f1c2a8e-3b4d-4e5f-8a9b-0c1d2e3f4a5b",
            "owner_name":"a","owner_labels":{},"gpu":"0000:41:00.0","profile":"L40S-2Q","type_id":1148,"mdev_uuid":null,
            "mdev_type":null,"claimed_at":"2026-01-01T00:00:00Z","claim_boot_id":"b","claimed_boottime_ms":1,
            "driver_version":"550.90","state":"configured","release_attempts":0,"last_error":null}"#;
        let mdev = r#"{"device":"0000:41:00.5","framework":"mdev","instance_id":"6f1c2a8e-3b4d-4e5f-8a9b-0c1d2e3f4a5b",
            "owner_name":"m","gpu":"0000:41:00.0","profile":"L40S-2Q","type_id":null,
            "mdev_uuid":"11111111-2222-4333-8444-555555555555","mdev_type":"nvidia-1148",
            "claimed_at":"2026-01-01T00:00:00Z","claim_boot_id":"b","claimed_boottime_ms":1,"driver_version":null,
            "state":"release_pending","release_attempts":2,"last_error":"in_use: held open by pid [7]"}"#;
        let pt = r#"{"device":"0000:82:00.0","framework":"passthrough","instance_id":"6f1c2a8e-3b4d-4e5f-8a9b-0c1d2e3f4a5b",
            "owner_name":"p","owner_labels":{"t":"x"},"gpu":"0000:82:00.0","profile":"passthrough","type_id":null,
            "mdev_uuid":null,"mdev_type":null,"claimed_at":"2026-01-01T00:00:00Z","claim_boot_id":"b",
            "claimed_boottime_ms":1,"driver_version":null,"state":"claimed","release_attempts":0,"last_error":null,
            "passthrough":{"group":42,"functions":[{"bdf":"0000:82:00.0","original_driver":"nvidia"},
            {"bdf":"0000:82:00.1","original_driver":"snd_hda_intel"}]}}"#;
        for (json, kind) in [(vf, Framework::VendorVfio), (mdev, Framework::Mdev), (pt, Framework::Passthrough)] {
            let c: Claim = serde_json::from_str(json).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
            assert_eq!(c.kind.framework(), kind);
            assert_eq!(c.owner, Owner::Instance(Uuid::parse_str(id).unwrap()));
            assert!(c.owned_by(Uuid::parse_str(id).unwrap()));
            let back = serde_json::to_value(&c).unwrap();
            assert_eq!(back["instance_id"], id, "{kind:?}: written back as before");
            assert!(back.get("owner").is_none(), "{kind:?}: {back}");
            assert_eq!(serde_json::from_value::<Claim>(back).unwrap(), c);
        }
        let c: Claim = serde_json::from_str(pt).unwrap();
        assert_eq!(c.kind.passthrough().unwrap().functions.len(), 2);
    }

    /// Claim records written by the code before [`ClaimKind`] existed (one per kind, an
    /// external owner, a passthrough release that reset the GPU already: files the store
    /// wrote, kept in `agent/tests/fixtures/claims/`) decode to the typed kind and are
    /// written back byte for byte.
    #[test]
    fn claim_records_written_before_the_typed_kind_read_and_write_back_byte_for_byte() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/claims");
        let owner = Owner::Instance(Uuid::parse_str("6f1c2a8e-3b4d-4e5f-8a9b-0c1d2e3f4a5b").unwrap());
        let pt = PassthroughClaim {
            group: 42,
            functions: vec![
                FunctionRecord { bdf: "0000:82:00.0".into(), original_driver: Some("nvidia".into()) },
                FunctionRecord { bdf: "0000:82:00.1".into(), original_driver: None },
            ],
            reset_done: false,
        };
        let cases = [
            ("vendor_vfio", ClaimKind::Vf { type_id: Some(1148) }, owner.clone()),
            (
                "vendor_vfio_external",
                ClaimKind::Vf { type_id: None },
                Owner::External(External::ResourceClaim {
                    namespace: "default".into(),
                    name: "gpu-claim".into(),
                    uid: "0b6c3d1e-7f8a-4b9c-8d0e-1f2a3b4c5d6e".into(),
                }),
            ),
            (
                "mdev",
                ClaimKind::Mdev {
                    uuid: Uuid::parse_str("11111111-2222-4333-8444-555555555555").unwrap(),
                    mdev_type: "nvidia-1148".into(),
                    type_id: Some(1148),
                },
                owner.clone(),
            ),
            ("passthrough", ClaimKind::Passthrough(pt.clone()), owner.clone()),
            ("passthrough_reset_done", ClaimKind::Passthrough(PassthroughClaim { reset_done: true, ..pt }), owner),
        ];
        for (name, kind, owner) in cases {
            let d = tempfile::tempdir().unwrap();
            let s = Store::open(d.path()).unwrap();
            let old = fs::read(dir.join(format!("{name}.json"))).unwrap();
            let c: Claim = serde_json::from_slice(&old).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(c.kind, kind, "{name}");
            assert_eq!(c.owner, owner, "{name}");
            s.persist_new_claim(&c).unwrap();
            let new = fs::read(s.claim_path(&c.device)).unwrap();
            assert_eq!(String::from_utf8_lossy(&new), String::from_utf8_lossy(&old), "{name}: written back as before");
            assert_eq!(s.read_claim(&c.device).unwrap().as_ref(), Some(&c), "{name}");
        }
    }

    /// A record whose per-kind fields contradict its framework (an mdev without its UUID,
    /// a VF with a passthrough record, passthrough without its group) does not decode: it
    /// is listed as unreadable and its device stays blocked.
    #[test]
    fn a_claim_whose_kind_fields_contradict_its_framework_does_not_decode() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/claims");
        let read = |name: &str| -> serde_json::Value {
            serde_json::from_slice(&fs::read(dir.join(format!("{name}.json"))).unwrap()).unwrap()
        };
        let mut mdev = read("mdev");
        mdev["mdev_uuid"] = serde_json::Value::Null;
        let mut vf = read("vendor_vfio");
        vf["passthrough"] = read("passthrough")["passthrough"].clone();
        let mut pt = read("passthrough");
        pt.as_object_mut().unwrap().remove("passthrough");
        let mut vf_as_mdev = read("vendor_vfio");
        vf_as_mdev["framework"] = "mdev".into();
        for (name, v) in [("mdev", mdev), ("vf", vf), ("pt", pt), ("vf_as_mdev", vf_as_mdev)] {
            let e = serde_json::from_value::<Claim>(v).expect_err(name);
            assert!(e.to_string().contains("do not match its framework"), "{name}: {e}");
        }
    }

    /// An external owner is stored as `owner` (no `instance_id`: a version without owners
    /// cannot read the record and blocks the device); a record naming no owner, or two
    /// different ones, does not decode.
    #[test]
    fn an_external_owner_round_trips_and_a_claim_needs_exactly_one_owner() {
        let mut c = claim("0000:41:00.4");
        c.owner = Owner::External(External::ResourceClaim {
            namespace: "default".into(),
            name: "gpu".into(),
            uid: "0b6c3d1e".into(),
        });
        let v = serde_json::to_value(&c).unwrap();
        assert!(v.get("instance_id").is_none(), "{v}");
        assert_eq!(
            v["owner"],
            serde_json::json!({"kind": "resource_claim", "namespace": "default", "name": "gpu", "uid": "0b6c3d1e"})
        );
        assert_eq!(serde_json::from_value::<Claim>(v.clone()).unwrap(), c);
        let mut none = v.clone();
        none.as_object_mut().unwrap().remove("owner");
        assert!(serde_json::from_value::<Claim>(none).is_err());
        let mut two = v;
        two["instance_id"] = serde_json::json!(Uuid::new_v4());
        assert!(serde_json::from_value::<Claim>(two).is_err());
        let unknown = serde_json::json!({"kind": "pod", "uid": "x"});
        assert!(serde_json::from_value::<Owner>(unknown).is_err());
    }

    #[test]
    fn a_second_exclusive_claim_of_a_device_fails() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        s.persist_new_claim(&claim("0000:41:00.4")).unwrap();
        let err = s.persist_new_claim(&claim("0000:41:00.4")).unwrap_err();
        assert!(matches!(err, StoreError::ClaimExists { .. }), "{err}");
        assert_eq!(s.list_claims().unwrap().len(), 1);
        // no temp files left behind
        let names: Vec<_> = fs::read_dir(d.path().join("claims")).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn the_claim_transition_table_allows_exactly_the_documented_moves() {
        use ClaimState::*;
        let legal = [
            (Claimed, Claimed),
            (Configured, Configured),
            (ReleasePending, ReleasePending),
            (Claimed, Configured),
            (Claimed, ReleasePending),
            (Configured, ReleasePending),
        ];
        for from in ClaimState::ALL {
            for to in ClaimState::ALL {
                assert_eq!(from.can_move_to(to), legal.contains(&(from, to)), "{from} -> {to}");
            }
        }
    }

    /// An update moves an existing record of the same claim along the table, and writes
    /// nothing otherwise: not over a released (gone) claim, not over another claim of the
    /// device, not back from `release_pending`.
    #[test]
    fn a_claim_update_moves_only_its_own_record_and_only_along_the_table() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        let dev = "0000:41:00.4";
        let mut c = claim(dev);
        let illegal = |r: Result<()>| assert!(matches!(r, Err(StoreError::IllegalClaimUpdate { .. })), "{r:?}");
        // Gone: an update never recreates a released claim.
        c.state = ClaimState::Configured;
        illegal(s.update_claim(&c));
        assert!(s.read_claim(dev).unwrap().is_none());
        c.state = ClaimState::Claimed;
        s.persist_new_claim(&c).unwrap();
        c.state = ClaimState::Configured;
        s.update_claim(&c).unwrap();
        c.state = ClaimState::ReleasePending;
        c.release_attempts = 1;
        s.update_claim(&c).unwrap();
        // Back from release_pending: refused, the record stays as it was.
        let mut back = c.clone();
        back.state = ClaimState::Configured;
        illegal(s.update_claim(&back));
        assert_eq!(s.read_claim(dev).unwrap(), Some(c.clone()));
        // Another claim of the device (released and claimed again meanwhile): refused.
        s.remove_claim(dev).unwrap();
        let other = claim(dev);
        s.persist_new_claim(&other).unwrap();
        illegal(s.update_claim(&c));
        assert_eq!(s.read_claim(dev).unwrap(), Some(other));
    }

    #[test]
    fn removing_a_claim_frees_the_device() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        s.persist_new_claim(&claim("0000:41:00.4")).unwrap();
        s.remove_claim("0000:41:00.4").unwrap();
        s.remove_claim("0000:41:00.4").unwrap();
        s.persist_new_claim(&claim("0000:41:00.4")).unwrap();
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
            let l = s.scan_claims().unwrap();
            assert!(l.records.is_empty(), "cut at {cut} was decoded");
            assert_eq!(l.unreadable.len(), 1);
            assert_eq!(l.unreadable[0].key, "0000:41:00.5", "the unreadable claim names its device");
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

    /// A stopped plain instance record named `name`.
    pub(crate) fn record(name: &str) -> InstanceRecord {
        InstanceRecord::new(
            InstanceDefinition {
                id: Uuid::new_v4(),
                name: name.into(),
                image: "demo".into(),
                hypervisor: crate::hypervisor::HypervisorKind::Qemu,
                vcpus: 1,
                memory_mib: 256,
                labels: Labels::new(),
                gpu_profile: None,
                gpu_framework: None,
                gpu_passthrough: None,
                gpu_resource_claim: None,
                restart: RestartPolicy::No,
                autostart: false,
                created_at: "2026-01-01T00:00:00Z".into(),
                nics: vec![],
                cloud_init: None,
                boot: Default::default(),
                disk_gib: None,
            },
            InstanceState::Stopped,
        )
    }

    #[test]
    fn an_undecodable_record_is_listed_as_unreadable_beside_the_others() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        let a = record("a");
        s.persist_instance(&a).unwrap();
        let bad = Uuid::new_v4();
        fs::create_dir_all(s.instance_dir(bad)).unwrap();
        fs::write(s.instance_path(bad), b"{not json").unwrap();
        let l = s.scan_instances().unwrap();
        assert_eq!(l.records, vec![a]);
        assert_eq!(l.unreadable.len(), 1);
        assert_eq!(l.unreadable[0].key, bad.to_string());
        assert!(s.list_instances().is_err(), "the strict listing still refuses");
    }

    #[test]
    fn a_name_belongs_to_one_instance_and_a_stale_entry_is_replaced() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        let a = record("a");
        s.claim_name("a", a.id).unwrap();
        s.persist_instance(&a).unwrap();
        let other = Uuid::new_v4();
        assert!(matches!(s.claim_name("a", other), Err(StoreError::NameTaken { owner, .. }) if owner == a.id));
        assert_eq!(s.name_owner("a").unwrap(), Some(a.id));
        s.erase_instance(a.id).unwrap();
        assert_eq!(s.name_owner("a").unwrap(), None, "delete removes the name");
        // A create that crashed after its name entry, before its record: the entry is stale.
        s.claim_name("b", Uuid::new_v4()).unwrap();
        s.claim_name("b", other).unwrap();
        assert_eq!(s.name_owner("b").unwrap(), Some(other));
    }

    #[test]
    fn a_data_directory_without_a_name_index_gets_one() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        let a = record("a");
        s.persist_instance(&a).unwrap();
        fs::remove_dir_all(d.path().join("names")).unwrap();
        let s = Store::open(d.path()).unwrap();
        assert_eq!(s.name_owner("a").unwrap(), Some(a.id));
    }

    #[test]
    fn the_transition_table_allows_exactly_the_documented_moves() {
        use InstanceState::*;
        let legal = [
            (Starting, Running),
            (Starting, Stopped),
            (Starting, CleanupPending),
            (Starting, Deleting),
            (Starting, Stopping),
            (Running, Stopping),
            (Running, Stopped),
            (Running, Deleting),
            (Stopping, Stopped),
            (Stopping, Running),
            (Stopping, Deleting),
            (Stopped, Starting),
            (Stopped, Deleting),
            (Deleting, CleanupPending),
            (CleanupPending, Deleting),
            (Running, Standby),
            (Standby, Starting),
            (Standby, Stopped),
            (Standby, Deleting),
        ];
        for from in InstanceState::ALL {
            for to in InstanceState::ALL {
                let expected = from == to || legal.contains(&(from, to));
                assert_eq!(from.can_move_to(to), expected, "{from} -> {to}");
            }
        }
    }

    #[test]
    fn an_illegal_transition_is_refused_and_changes_nothing() {
        let mut r = record("a");
        assert_eq!(r.state(), InstanceState::Stopped);
        let e = r.transition(InstanceState::Running).unwrap_err();
        assert_eq!((e.from, e.to), (InstanceState::Stopped, InstanceState::Running));
        assert_eq!(r.state(), InstanceState::Stopped);
        r.transition(InstanceState::Starting).unwrap();
        assert_eq!(r.state(), InstanceState::Starting);
    }

    #[test]
    fn a_cleanup_pending_instance_can_only_be_deleted() {
        for to in InstanceState::ALL {
            let ok = InstanceState::CleanupPending.can_move_to(to);
            assert_eq!(ok, matches!(to, InstanceState::CleanupPending | InstanceState::Deleting), "{to}");
        }
    }
}
