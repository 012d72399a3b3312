//! # host — the only module that spells `/sys`, `/dev` and `/proc`
//!
//! [`net`]: taps (`/dev/net/tun`) and host bridges, for `bridge` NICs. [`lock`]: one agent
//! per GPU (a `flock` on each managed GPU's sysfs directory). [`vmm_view`]: each VMM's own
//! view of the filesystem (a mount namespace).
//!
//! [`HostRoot`] builds every sysfs/devfs path (and the boot-id file) under a configurable
//! root: `/` on a real host, a `gpuvisor-sim` mount in tests. Processes are always the
//! real `/proc`, read through the `procfs` crate ([`proc`]).

pub mod cgroup;
pub mod lock;
pub mod net;
pub mod proc;
pub mod vmm_view;

use std::path::{Path, PathBuf};

/// The KVM device. Always the real host's (the VMM opens it, whatever `host_root` is).
pub const KVM_DEVICE: &str = "/dev/kvm";

/// Root of the host's sysfs/devfs tree (`/` in production, the simulator's mount in tests).
///
/// Every path gpuvisor reads or writes on the host is built here. Paths follow the Linux
/// sysfs ABI (`Documentation/ABI/testing/sysfs-bus-pci`) and docs/design/host.md §§2–6.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRoot {
    root: PathBuf,
}

impl HostRoot {
    /// A host root at `root` (absolute; canonicalised when possible so that `/proc/<pid>/fd`
    /// links, which the kernel prints canonical, compare equal).
    pub fn new(root: impl Into<PathBuf>) -> HostRoot {
        let root: PathBuf = root.into();
        let root = std::fs::canonicalize(&root).unwrap_or(root);
        HostRoot { root }
    }

    /// The root directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn join(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// `sys/bus/pci/devices` — one link per PCI function, named by BDF.
    pub fn pci_devices_dir(&self) -> PathBuf {
        self.join("sys/bus/pci/devices")
    }

    /// `sys/bus/pci/devices/<bdf>`.
    pub fn pci_device(&self, bdf: &str) -> PathBuf {
        self.pci_devices_dir().join(bdf)
    }

    /// `sys/class/mdev_bus` — one link per mdev parent (docs/design/host.md §6).
    pub fn mdev_bus_dir(&self) -> PathBuf {
        self.join("sys/class/mdev_bus")
    }

    /// `sys/bus/mdev/devices` — one directory per mdev, named by UUID.
    pub fn mdev_devices_dir(&self) -> PathBuf {
        self.join("sys/bus/mdev/devices")
    }

    /// `sys/bus/mdev/devices/<uuid>`.
    pub fn mdev_device(&self, uuid: &str) -> PathBuf {
        self.mdev_devices_dir().join(uuid)
    }

    /// `sys/kernel/iommu_groups/<group>`.
    pub fn iommu_group_dir(&self, group: u32) -> PathBuf {
        self.join("sys/kernel/iommu_groups").join(group.to_string())
    }

    /// `dev/vfio` — the VFIO group nodes (and the container node `vfio`).
    pub fn vfio_dir(&self) -> PathBuf {
        self.join("dev/vfio")
    }

    /// `dev/vfio/<group>` — the VFIO group node.
    pub fn vfio_group_node(&self, group: u32) -> PathBuf {
        self.join("dev/vfio").join(group.to_string())
    }

    /// `dev/vfio/devices/<name>` — the iommufd cdev (`vfio<N>`; N is dynamic, never stored).
    pub fn vfio_cdev_node(&self, name: &str) -> PathBuf {
        self.join("dev/vfio/devices").join(name)
    }

    /// `proc/sys/kernel/random/boot_id` under the host root (the simulator serves its own).
    pub fn boot_id_path(&self) -> PathBuf {
        self.join("proc/sys/kernel/random/boot_id")
    }

    /// `sys/module/nvidia/version` — the loaded NVIDIA driver version.
    pub fn nvidia_version_path(&self) -> PathBuf {
        self.join("sys/module/nvidia/version")
    }

    /// `sys/kernel/iommu_groups` — one directory per IOMMU group (empty without an IOMMU).
    pub fn iommu_groups_dir(&self) -> PathBuf {
        self.join("sys/kernel/iommu_groups")
    }

    /// `sys/class/iommu` — one entry per IOMMU unit (`dmar0`, `ivhd0`, …).
    pub fn iommu_class_dir(&self) -> PathBuf {
        self.join("sys/class/iommu")
    }

    /// `sys/bus/pci/drivers/<name>` — present while the PCI driver is registered.
    pub fn pci_driver_dir(&self, name: &str) -> PathBuf {
        self.join("sys/bus/pci/drivers").join(name)
    }

    /// `sys/module/<name>` — present while the kernel module is loaded (or built in).
    pub fn module_dir(&self, name: &str) -> PathBuf {
        self.join("sys/module").join(name)
    }

    /// `proc/driver/nvidia/version` — the NVIDIA driver's banner (`NVRM version: …`).
    pub fn nvidia_proc_version_path(&self) -> PathBuf {
        self.join("proc/driver/nvidia/version")
    }

    /// Reads the boot id under the host root (a UUID string, trimmed).
    ///
    /// Errors: any I/O error reading the file, or an empty file (`InvalidData`).
    pub fn boot_id(&self) -> std::io::Result<String> {
        let s = std::fs::read_to_string(self.boot_id_path())?;
        let s = s.trim().to_string();
        if s.is_empty() {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "empty boot_id"));
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_hang_off_the_root() {
        let h = HostRoot { root: PathBuf::from("/x") };
        assert_eq!(h.pci_device("0001:81:00.4"), PathBuf::from("/x/sys/bus/pci/devices/0001:81:00.4"));
        assert_eq!(h.vfio_group_node(41), PathBuf::from("/x/dev/vfio/41"));
        assert_eq!(h.boot_id_path(), PathBuf::from("/x/proc/sys/kernel/random/boot_id"));
    }
}
