//! The virtual file tree: a map from mount-relative paths (no leading `/`, root is `""`)
//! to nodes, rebuilt from the host state whenever the state changes shape.

use std::collections::HashMap;

/// A device whose node can be opened and is tracked (§10.4).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DevRef {
    /// `dev/vfio/vfio`: shared, identifies no device.
    Container,
    /// The group node `dev/vfio/<G>` of the VF with this uid.
    VfGroup(u64),
    /// The cdev `dev/vfio/devices/vfio<N>` of the VF with this uid.
    VfCdev(u64),
    /// The group node of the mdev with this UUID.
    MdevGroup(String),
    /// The group node `dev/vfio/<G>` of the passthrough GPU with this index.
    PtGroup(usize),
    /// `dev/nvidia<N>` of the passthrough GPU with this index.
    Nvidia(usize),
}

/// What a regular file is; decides its read and write behaviour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileKind {
    /// Fixed content.
    Static(String),
    /// A PF's `sriov_numvfs` (GPU index).
    SriovNumvfs(usize),
    /// A VF's (uid) or, with `pf_catalog`, a PF's (`u64::MAX - gpu`) `creatable_vgpu_types`.
    Catalog(u64),
    /// `nvidia/current_vgpu_type` of a VF.
    CurrentType(u64),
    /// `nvidia/vgpu_params` of a VF.
    Params(u64),
    /// `nvidia/placement_id` of a VF.
    PlacementId(u64),
    /// `nvidia/gpu_instance_id` of a VF.
    GpuInstanceId(u64),
    /// `nvidia/warm_update` of a VF.
    WarmUpdate(u64),
    /// A VF's `driver_override`.
    DriverOverride(u64),
    /// `sys/bus/pci/drivers/<driver>/bind`.
    DriverBind(String),
    /// `sys/bus/pci/drivers/<driver>/unbind`.
    DriverUnbind(String),
    /// `driver_override` of a passthrough function or group member (index).
    PtOverride(usize),
    /// `reset` of a passthrough GPU function or companion (index into `State::pcifns`).
    PtReset(usize),
    /// `power_state` of a passthrough function or group member (index).
    PtPowerState(usize),
    /// `config` of a passthrough function or group member (index): 64 bytes.
    PtConfig(usize),
    /// `sys/bus/pci/drivers_probe`.
    DriversProbe,
    /// `mdev_supported_types/nvidia-<id>/available_instances` of a parent VF (uid, type id).
    MdevAvailable(u64, u32),
    /// `mdev_supported_types/nvidia-<id>/create` of a parent VF (uid, type id).
    MdevCreate(u64, u32),
    /// `sys/bus/mdev/devices/<uuid>/remove`.
    MdevRemove(String),
    /// `sys/bus/mdev/devices/<uuid>/nvidia/vgpu_params`.
    MdevParams(String),
    /// A device node under `dev/vfio`.
    Node(DevRef),
    /// `.sim/ctl`, the control channel.
    Ctl,
    /// `.sim/state.json`.
    StateJson,
}

/// A node of the tree.
#[derive(Debug, Clone)]
pub enum Node {
    /// A directory with its child names.
    Dir(Vec<String>),
    /// A regular file with its permission bits.
    File(FileKind, u16),
    /// A symlink with its (relative) target.
    Link(String),
}

/// The whole tree.
#[derive(Debug, Default)]
pub struct Tree {
    /// Path → node.
    pub nodes: HashMap<String, Node>,
}

fn split_parent(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

impl Tree {
    /// A tree holding only the root directory.
    pub fn new() -> Tree {
        let mut nodes = HashMap::new();
        nodes.insert(String::new(), Node::Dir(Vec::new()));
        Tree { nodes }
    }

    /// Ensures `path` is a directory, creating parents as needed.
    pub fn dir(&mut self, path: &str) {
        if path.is_empty() || self.nodes.contains_key(path) {
            return;
        }
        self.insert(path, Node::Dir(Vec::new()));
    }

    /// Adds a file with the given mode.
    pub fn file(&mut self, path: &str, kind: FileKind, mode: u16) {
        self.insert(path, Node::File(kind, mode));
    }

    /// Adds a read-only (0444) file with fixed content.
    pub fn text(&mut self, path: &str, content: impl Into<String>) {
        self.file(path, FileKind::Static(content.into()), 0o444);
    }

    /// Adds a symlink.
    pub fn link(&mut self, path: &str, target: impl Into<String>) {
        self.insert(path, Node::Link(target.into()));
    }

    /// Inserts a node, creating parent directories and registering the name in its parent.
    pub fn insert(&mut self, path: &str, node: Node) {
        let (parent, name) = split_parent(path);
        self.dir(parent);
        if let Some(Node::Dir(children)) = self.nodes.get_mut(parent) {
            if !children.iter().any(|c| c == name) {
                children.push(name.to_string());
            }
        }
        self.nodes.insert(path.to_string(), node);
    }

    /// Removes a node and everything below it.
    pub fn remove(&mut self, path: &str) {
        if path.is_empty() {
            return;
        }
        let (parent, name) = split_parent(path);
        if let Some(Node::Dir(children)) = self.nodes.get_mut(parent) {
            children.retain(|c| c != name);
        }
        let prefix = format!("{path}/");
        self.nodes.retain(|k, _| k.as_str() != path && !k.starts_with(&prefix));
    }

    /// Resolves symlinks in `path` (relative to the mount), following at most 40 links.
    /// Returns `None` if a component is missing.
    pub fn resolve(&self, path: &str) -> Option<String> {
        let mut todo: Vec<String> =
            path.split('/').filter(|c| !c.is_empty() && *c != ".").rev().map(String::from).collect();
        let mut cur: Vec<String> = Vec::new();
        let mut hops = 0;
        while let Some(c) = todo.pop() {
            if c == ".." {
                cur.pop();
                continue;
            }
            cur.push(c);
            let p = cur.join("/");
            if let Node::Link(target) = self.nodes.get(&p)? {
                hops += 1;
                if hops > 40 {
                    return None;
                }
                cur.pop();
                for t in target.split('/').rev() {
                    if !t.is_empty() && t != "." {
                        todo.push(t.to_string());
                    }
                }
            }
        }
        Some(cur.join("/"))
    }
}

/// Whether `s` looks like a hyphenated UUID (the name of an mdev directory).
pub fn is_uuid(s: &str) -> bool {
    s.len() == 36 && uuid::Uuid::try_parse(s).is_ok()
}

/// All names a real (canonical) path is known by, the display name first:
/// `sys/bus/mdev/devices/<uuid>/…` for mdev files, `sys/class/mdev_bus/<VF>/…` for parent
/// type files, `sys/bus/pci/devices/<BDF>/…` for other PCI device files, then the rest.
pub fn aliases(real: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(rest) = real.strip_prefix("sys/devices/") {
        let mut parts = rest.splitn(3, '/');
        let _pci = parts.next();
        if let Some(bdf) = parts.next() {
            let more = parts.next();
            let tail = more.map(|m| format!("/{m}")).unwrap_or_default();
            if let Some(m) = more {
                let (first, after) = match m.find('/') {
                    Some(i) => (&m[..i], &m[i..]),
                    None => (m, ""),
                };
                if is_uuid(first) {
                    out.push(format!("sys/bus/mdev/devices/{first}{after}"));
                }
            }
            let pci = format!("sys/bus/pci/devices/{bdf}{tail}");
            let class = format!("sys/class/mdev_bus/{bdf}{tail}");
            if tail.contains("/mdev_supported_types") {
                out.push(class);
                out.push(pci);
            } else {
                out.push(pci);
                out.push(class);
            }
        }
    }
    out.push(real.to_string());
    out
}

/// The name a real path is shown by in the log and in errors.
pub fn display(real: &str) -> String {
    aliases(real).swap_remove(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_follows_relative_links() {
        let mut t = Tree::new();
        t.dir("sys/devices/pci0000:41/0000:41:00.4/nvidia");
        t.link("sys/bus/pci/devices/0000:41:00.4", "../../../devices/pci0000:41/0000:41:00.4");
        assert_eq!(
            t.resolve("sys/bus/pci/devices/0000:41:00.4/nvidia").as_deref(),
            Some("sys/devices/pci0000:41/0000:41:00.4/nvidia")
        );
        assert_eq!(t.resolve("sys/bus/pci/devices/0000:41:00.5"), None);
    }

    #[test]
    fn display_names() {
        assert_eq!(
            display("sys/devices/pci0000:41/0000:41:00.4/nvidia/current_vgpu_type"),
            "sys/bus/pci/devices/0000:41:00.4/nvidia/current_vgpu_type"
        );
        let u = "8a3c5e1e-4b8e-4a54-9f3e-3b0b8c9d2a11";
        assert_eq!(
            display(&format!("sys/devices/pci0000:41/0000:41:00.4/{u}/remove")),
            format!("sys/bus/mdev/devices/{u}/remove")
        );
        assert_eq!(display("dev/vfio/41"), "dev/vfio/41");
    }
}
