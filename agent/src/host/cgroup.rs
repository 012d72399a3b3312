//! # host::cgroup — one cgroup v2 per VM, with the instance's memory limit
//!
//! Where the unified hierarchy (`/sys/fs/cgroup`, cgroup v2) has the `memory` controller
//! and is writable, every VMM runs in `/sys/fs/cgroup/gpuvisor/vm-<instance id>` with
//! `memory.max` = the guest memory plus `cgroup_memory_overhead_mib` (QEMU's own memory:
//! device emulation, the TCG translation cache, VFIO bookkeeping). The VMM joins it itself
//! between fork and exec ([`crate::hypervisor::confine`]), so no allocation escapes it.
//!
//! On a cgroup v1 or hybrid host (the unified hierarchy without controllers), or when it
//! is read-only, [`VmCgroups::detect`] answers `None` and VMMs run without one (the agent
//! says so once at start). Cgroups are the real host's, never the simulator's (like
//! `/proc`). A VM's cgroup is made again at each start (an existing one is reused) and
//! removed on delete; the reconcile pass removes those of instances that no longer exist.
//! A cgroup that still holds a process is never removed (`rmdir` refuses with `EBUSY`).

use std::io;
use std::path::{Path, PathBuf};
use uuid::Uuid;

/// The cgroup v2 mount.
pub const CGROUP2_ROOT: &str = "/sys/fs/cgroup";

/// The parent of the VMs' cgroups, under [`CGROUP2_ROOT`].
pub const PARENT: &str = "gpuvisor";

const VM_PREFIX: &str = "vm-";

/// The VMs' cgroups (`<root>/gpuvisor/vm-<id>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmCgroups {
    parent: PathBuf,
}

fn controllers(path: &Path) -> io::Result<Vec<String>> {
    Ok(std::fs::read_to_string(path)?.split_whitespace().map(str::to_string).collect())
}

impl VmCgroups {
    /// The VMs' cgroups under the cgroup v2 mount `root`, enabling the memory controller for
    /// them; `Ok(None)` when `root` is not a cgroup v2 hierarchy with the memory controller
    /// (`cgroup.controllers` missing or without `memory`). Errors: a v2 hierarchy with the
    /// controller that cannot be written.
    pub fn detect(root: &Path) -> io::Result<Option<VmCgroups>> {
        let available = match controllers(&root.join("cgroup.controllers")) {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if !available.iter().any(|c| c == "memory") {
            return Ok(None);
        }
        if !controllers(&root.join("cgroup.subtree_control"))?.iter().any(|c| c == "memory") {
            std::fs::write(root.join("cgroup.subtree_control"), "+memory")?;
        }
        let parent = root.join(PARENT);
        match std::fs::create_dir(&parent) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        if !controllers(&parent.join("cgroup.subtree_control"))?.iter().any(|c| c == "memory") {
            std::fs::write(parent.join("cgroup.subtree_control"), "+memory")?;
        }
        Ok(Some(VmCgroups { parent }))
    }

    fn dir(&self, id: Uuid) -> PathBuf {
        self.parent.join(format!("{VM_PREFIX}{id}"))
    }

    /// Makes (or reuses) the cgroup of instance `id` with `memory.max` = `limit_bytes`;
    /// answers its `cgroup.procs`, which the VMM joins.
    pub fn prepare(&self, id: Uuid, limit_bytes: u64) -> io::Result<PathBuf> {
        let dir = self.dir(id);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        std::fs::write(dir.join("memory.max"), limit_bytes.to_string())?;
        Ok(dir.join("cgroup.procs"))
    }

    /// Removes the cgroup of instance `id`: `Ok` when it is gone or never existed; `EBUSY`
    /// while a process is still in it.
    pub fn remove(&self, id: Uuid) -> io::Result<()> {
        match std::fs::remove_dir(self.dir(id)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Removes the empty cgroups of instances `exists` says are gone; answers how many.
    pub fn sweep(&self, exists: impl Fn(Uuid) -> bool) -> usize {
        let Ok(rd) = std::fs::read_dir(&self.parent) else { return 0 };
        rd.filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str()?.strip_prefix(VM_PREFIX).and_then(|s| Uuid::parse_str(s).ok()))
            .filter(|id| !exists(*id) && self.remove(*id).is_ok())
            .count()
    }
}

/// The controllers the cgroup v2 hierarchy at `root` offers (`cgroup.controllers`), read
/// only; `Ok(None)` when `root` is not a cgroup v2 hierarchy (v1 or hybrid: no
/// `cgroup.controllers`). Errors: the file exists but cannot be read.
pub fn v2_controllers(root: &Path) -> io::Result<Option<Vec<String>>> {
    match controllers(&root.join("cgroup.controllers")) {
        Ok(c) => Ok(Some(c)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `memory.max` of a VM: its guest memory plus the VMM's overhead, bytes.
pub fn memory_limit_bytes(memory_mib: u64, overhead_mib: u64) -> u64 {
    memory_mib.saturating_add(overhead_mib).saturating_mul(1024 * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hierarchy_without_the_memory_controller_gives_no_cgroups() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(VmCgroups::detect(d.path()).unwrap(), None, "no cgroup.controllers: v1 or hybrid");
        std::fs::write(d.path().join("cgroup.controllers"), "cpu io pids\n").unwrap();
        assert_eq!(VmCgroups::detect(d.path()).unwrap(), None);
    }

    #[test]
    fn the_limit_is_guest_memory_plus_overhead() {
        assert_eq!(memory_limit_bytes(256, 512), 768 * 1024 * 1024);
        assert_eq!(memory_limit_bytes(u64::MAX, 1), u64::MAX);
    }
}
