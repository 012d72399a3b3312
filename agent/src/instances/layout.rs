//! # instances::layout — an instance's directory and its VMM directory
//!
//! ```text
//! instances/<id>/            root:root 0700   the agent's alone: instance.json, .gpuvisor-private/,
//!                                             the VMM log, serial.log.1, seed.inputs
//! instances/<id>/vmm/        root:<id> 01770  the VMM's whole writable world: serial.log,
//!                                             disk.qcow2, efivars.fd, seed.iso, its sockets
//! ```
//!
//! [`Manager::vmm_dir_ready`] makes both (the VMM directory's group is given at spawn, once
//! the instance's VMM id is known: [`crate::hypervisor::confine::prepare_run_dir`]) and moves
//! the files of an instance made before VMM directories existed (its overlay, UEFI variables
//! and serial log lay in the instance directory) into it, once, while no VMM runs. The old
//! seed is dropped: it is rebuilt from the record, and an old `seed.inputs` beside it is
//! never trusted (the old instance directory was writable by every VMM).

use super::Manager;
use crate::error::ApiError;
use crate::store::InstanceRecord;
use std::path::{Path, PathBuf};

/// Files of the old layout that move into the VMM directory.
const MOVED: &[&str] = &[super::disk::OVERLAY, super::disk::EFIVARS, crate::hypervisor::SERIAL_LOG];

impl Manager {
    /// The VMM directory of `rec`, made (with its instance directory, the agent's alone)
    /// when missing, an old layout moved into it. Call only while no VMM of `rec` runs.
    /// Errors: `internal` naming the directory or file.
    pub(crate) fn vmm_dir_ready(&self, rec: &InstanceRecord) -> Result<PathBuf, ApiError> {
        let (inst, vmm) = (self.store.instance_dir(rec.id), self.store.vmm_dir(rec.id));
        let moved = vmm_dir_ready(&inst, &vmm).map_err(ApiError::internal)?;
        for name in moved {
            tracing::info!(instance.id = %rec.id, instance.name = %rec.name, file = %name,
                "moved into the instance's VMM directory");
        }
        Ok(vmm)
    }
}

/// Makes `inst` (mode 0700 when made) and its VMM directory `vmm` when missing and moves
/// an old layout's files from `inst` into it (only the agent's own files; the old seed is
/// removed). Returns the names moved. Errors name the path.
fn vmm_dir_ready(inst: &Path, vmm: &Path) -> Result<Vec<&'static str>, String> {
    use std::os::unix::fs::DirBuilderExt;
    let fail = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(inst).map_err(|e| fail(inst, e))?;
    let vmm_name = vmm.file_name().and_then(|n| n.to_str()).unwrap_or(crate::hypervisor::confine::VMM_DIR);
    match std::fs::symlink_metadata(vmm) {
        Ok(m) if m.is_dir() => return Ok(Vec::new()),
        // Not a directory (never made by the agent): the old layout's instance directory was
        // every VMM's to write.
        Ok(_) => crate::own_file::remove(inst, vmm_name).map_err(|e| fail(vmm, e))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(vmm, e)),
    }
    std::fs::DirBuilder::new().mode(0o700).create(vmm).map_err(|e| fail(vmm, e))?;
    let mut moved = Vec::new();
    for name in MOVED {
        if crate::own_file::inspect(inst, name).map_err(|e| fail(inst, e))?.is_own() {
            std::fs::rename(inst.join(name), vmm.join(name)).map_err(|e| fail(&inst.join(name), e))?;
            moved.push(*name);
        }
    }
    for name in [super::seed::SEED_FILE, super::seed::SEED_INPUTS_FILE] {
        crate::own_file::remove(inst, name).map_err(|e| fail(&inst.join(name), e))?;
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::own_file;

    #[test]
    fn an_old_layout_moves_into_the_vmm_directory_and_its_seed_is_dropped() {
        let d = tempfile::tempdir().unwrap();
        let inst = d.path().join("i");
        let vmm = inst.join("vmm");
        std::fs::create_dir_all(&inst).unwrap();
        for f in ["disk.qcow2", "efivars.fd", "serial.log", "seed.iso", "seed.inputs"] {
            std::fs::write(inst.join(f), f).unwrap();
        }
        // A link the old layout let a VMM plant is not moved.
        std::fs::remove_file(inst.join("efivars.fd")).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", inst.join("efivars.fd")).unwrap();

        let moved = vmm_dir_ready(&inst, &vmm).unwrap();

        assert_eq!(moved, ["disk.qcow2", "serial.log"]);
        assert_eq!(std::fs::read(vmm.join("disk.qcow2")).unwrap(), b"disk.qcow2");
        assert_eq!(std::fs::read(vmm.join("serial.log")).unwrap(), b"serial.log");
        assert!(matches!(own_file::inspect(&vmm, "efivars.fd").unwrap(), own_file::Entry::Missing));
        for gone in ["disk.qcow2", "serial.log", "seed.iso", "seed.inputs"] {
            assert!(std::fs::symlink_metadata(inst.join(gone)).is_err(), "{gone}");
        }
        // Once made, the directory is left as it is.
        std::fs::write(inst.join("disk.qcow2"), b"new").unwrap();
        assert!(vmm_dir_ready(&inst, &vmm).unwrap().is_empty());
        assert_eq!(std::fs::read(vmm.join("disk.qcow2")).unwrap(), b"disk.qcow2");
    }
}
