//! The cloud-init NoCloud seed of an instance: `<VMM dir>/seed.iso`, an ISO 9660 image
//! with volume label `cidata` holding `meta-data` (`instance-id: <id>`,
//! `local-hostname: <name>`), `user-data` (the instance's, or an empty `#cloud-config`) and,
//! when given, `network-config`. Built with `genisoimage` (Debian `genisoimage`; the
//! NoCloud layout is cloud-init's `doc/rtd/reference/datasources/nocloud.rst`).
//!
//! An instance gets a seed when it has a NIC or `cloud_init` inputs; others get none. The
//! seed is checked on every start: `seed.inputs` (in the instance directory, which the VMM
//! never sees, so it cannot forge it) holds a hash of the inputs it was built from, and a
//! seed whose hash differs, that is missing, or that is not the agent's own file
//! ([`crate::own_file`]: a link, a FIFO, a file the VMM made where the seed belongs) is
//! built again, into a temporary file renamed over the old one, so a crash leaves the old
//! seed or the new one. The seed is `root:<VMM id>` mode `0440`: the VMM reads it, nothing
//! more.

use super::Manager;
use crate::error::ApiError;
use crate::store::InstanceRecord;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The seed's file name in the instance directory.
pub const SEED_FILE: &str = "seed.iso";
/// The hash of the inputs the seed was built from (16 hex digits).
pub const SEED_INPUTS_FILE: &str = "seed.inputs";

/// The files of the seed, in a stable order: `(file name, content)`.
pub fn seed_files(rec: &InstanceRecord) -> Vec<(&'static str, String)> {
    let mut files = vec![
        ("meta-data", format!("instance-id: {}\nlocal-hostname: {}\n", rec.id, rec.name)),
        (
            "user-data",
            rec.cloud_init.as_ref().and_then(|c| c.user_data.clone()).unwrap_or_else(|| "#cloud-config\n".into()),
        ),
    ];
    if let Some(n) = rec.cloud_init.as_ref().and_then(|c| c.network_config.clone()) {
        files.push(("network-config", n));
    }
    files
}

/// The hash of the seed's inputs: FNV-1a 64 over the file names and contents, hex.
pub fn seed_hash(files: &[(&'static str, String)]) -> String {
    let mut bytes = b"gpuvisor-seed-v1\0".to_vec();
    for (name, content) in files {
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(&(content.len() as u64).to_le_bytes());
        bytes.extend_from_slice(content.as_bytes());
    }
    format!("{:016x}", crate::network::fnv1a64(&bytes))
}

fn seed_error(rec: &InstanceRecord, what: impl std::fmt::Display) -> ApiError {
    ApiError::vmm_start_failed(format!("the cloud-init seed of instance {} cannot be built: {what}", rec.name), None)
}

impl Manager {
    /// The seed of `rec` for its next boot, built or rebuilt when its inputs changed; `None`
    /// for an instance with neither NICs nor `cloud_init`.
    ///
    /// Errors: `vmm_start_failed` naming the cause (the instance directory cannot be written,
    /// `genisoimage` is missing or fails).
    pub(crate) fn ensure_seed(&self, rec: &InstanceRecord, vmm_id: u32) -> Result<Option<PathBuf>, ApiError> {
        if !rec.wants_seed() {
            return Ok(None);
        }
        let dir = self.store.instance_dir(rec.id);
        let vmm = self.vmm_dir_ready(rec)?;
        let seed = vmm.join(SEED_FILE);
        let files = seed_files(rec);
        let hash = seed_hash(&files);
        let recorded = match crate::own_file::read(&dir, SEED_INPUTS_FILE) {
            Ok(b) => b.map(|b| String::from_utf8_lossy(&b).trim().to_string()),
            Err(_) => None,
        };
        let found = crate::own_file::inspect(&vmm, SEED_FILE).map_err(|e| seed_error(rec, e))?;
        if !(found.is_own() && recorded.as_deref() == Some(hash.as_str())) {
            // A plant goes first (a directory would stop the rename); the agent's own old
            // seed stays until the new one replaces it (a crash leaves one or the other).
            if let crate::own_file::Entry::Foreign(what) = &found {
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, file = %seed.display(), found = %what,
                    "the seed was not the agent's own file (a VMM may have planted it): built again");
                crate::own_file::remove(&vmm, SEED_FILE).map_err(|e| seed_error(rec, e))?;
            }
            build_seed(&dir, &vmm, &files).map_err(|e| seed_error(rec, e))?;
            write_atomic(&dir.join(SEED_INPUTS_FILE), format!("{hash}\n").as_bytes())
                .map_err(|e| seed_error(rec, e))?;
            tracing::info!(instance.id = %rec.id, instance.name = %rec.name, seed = %seed.display(), inputs = %hash,
                "cloud-init seed built");
        }
        crate::hypervisor::confine::give_to_group(&vmm, SEED_FILE, vmm_id, crate::hypervisor::confine::VMM_READ_MODE)
            .map_err(|e| seed_error(rec, e))?;
        Ok(Some(seed))
    }
}

/// Writes through a fresh name in the agent's private directory
/// ([`crate::hypervisor::confine::staging_path`]), then renames.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = crate::hypervisor::confine::staging_path(path)?;
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Writes the files into the instance directory's private directory (`seed.d/`), runs
/// `genisoimage` into a fresh name there, renames it to `<vmm>/seed.iso`.
fn build_seed(dir: &Path, vmm: &Path, files: &[(&'static str, String)]) -> Result<(), String> {
    let private = crate::hypervisor::confine::private_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = private.join("seed.d");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).map_err(|e| format!("{}: {e}", src.display()))?;
    for (name, content) in files {
        std::fs::write(src.join(name), content).map_err(|e| format!("{}: {e}", src.join(name).display()))?;
    }
    let tmp = crate::hypervisor::confine::staging_path(&vmm.join(SEED_FILE)).map_err(|e| e.to_string())?;
    let out = Command::new("genisoimage")
        .arg("-quiet")
        .arg("-output")
        .arg(&tmp)
        .args(["-volid", "cidata", "-joliet", "-rock"])
        .args(files.iter().map(|(n, _)| src.join(n)))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("genisoimage cannot be run (Debian package genisoimage): {e}"))?;
    let _ = std::fs::remove_dir_all(&src);
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("genisoimage failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    std::fs::rename(&tmp, vmm.join(SEED_FILE)).map_err(|e| format!("{}: {e}", tmp.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::CloudInit;
    use crate::store::{InstanceDefinition, InstanceState};

    fn rec(cloud_init: Option<CloudInit>) -> InstanceRecord {
        named("vm-a", cloud_init)
    }

    fn named(name: &str, cloud_init: Option<CloudInit>) -> InstanceRecord {
        InstanceRecord::new(
            InstanceDefinition {
                id: uuid::Uuid::parse_str("6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d").unwrap(),
                name: name.into(),
                image: "demo".into(),
                hypervisor: crate::hypervisor::HypervisorKind::Qemu,
                vcpus: 1,
                memory_mib: 256,
                labels: Default::default(),
                gpu_profile: None,
                gpu_framework: None,
                gpu_passthrough: None,
                gpu_resource_claim: None,
                restart: Default::default(),
                autostart: false,
                created_at: "2026-01-01T00:00:00Z".into(),
                nics: vec![],
                cloud_init,
                boot: Default::default(),
                disk_gib: None,
            },
            InstanceState::Stopped,
        )
    }

    #[test]
    fn meta_data_names_the_instance_and_user_data_defaults_to_empty_cloud_config() {
        let f = seed_files(&rec(None));
        assert_eq!(
            f[0],
            ("meta-data", "instance-id: 6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d\nlocal-hostname: vm-a\n".into())
        );
        assert_eq!(f[1], ("user-data", "#cloud-config\n".into()));
        assert_eq!(f.len(), 2, "no network-config unless given");
        let f = seed_files(&rec(Some(CloudInit { user_data: Some("u".into()), network_config: Some("n".into()) })));
        assert_eq!(f[1].1, "u");
        assert_eq!(f[2], ("network-config", "n".into()));
    }

    #[test]
    fn the_hash_changes_with_every_input_and_only_then() {
        let a = seed_hash(&seed_files(&rec(None)));
        assert_eq!(a, seed_hash(&seed_files(&rec(None))));
        let with_user = rec(Some(CloudInit { user_data: Some("x".into()), network_config: None }));
        assert_ne!(a, seed_hash(&seed_files(&with_user)));
        assert_ne!(a, seed_hash(&seed_files(&named("vm-b", None))));
    }
}
