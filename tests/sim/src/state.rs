//! The simulated host's state and the driver rules of docs/design/host.md §10.3–§10.6.
//!
//! All methods run under the one mutex that wraps [`State`], which serialises every rule
//! evaluation like the driver's lock. Time is milliseconds since the simulator started and
//! is evaluated lazily: [`State::tick`] runs at the start of every operation. Whole-GPU
//! passthrough (rules 9–10) lives in the `passthrough` submodule.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use clap::Parser;
use serde::Serialize;
use serde_json::{json, Value};

use crate::ctl::{errno_name, parse_errno, CtlCmd, CtlLine, CtlRequest, FaultArgs};
use crate::model::{parse_bdf, parse_pci_id, Framework, GpuModel, Model, TypeDef};
use crate::tree::{aliases, display, DevRef, FileKind, Node, Tree};

mod passthrough;

pub use passthrough::{FnDump, PciFn, PtDump, PtGpu, NVIDIA, VFIO_PCI};

/// An errno value (`libc::E*`).
pub type Errno = i32;

/// Header line of `creatable_vgpu_types` (§3.1).
pub const CATALOG_HEADER: &str = "ID    : vGPU Name";

/// How long after its last handle closes an mdev removes itself with `mdev_self_remove`.
const MDEV_SELF_REMOVE_MS: u64 = 2000;

/// One virtual function.
#[derive(Debug, Clone)]
pub struct Vf {
    /// Unique id of this incarnation of the VF (new after every SR-IOV cycle).
    pub uid: u64,
    /// Address.
    pub bdf: String,
    /// IOMMU group.
    pub group: u32,
    /// `vfio<N>` number (vendor VFIO only).
    pub cdev: Option<u32>,
    /// Current vGPU type id, 0 for none.
    pub type_id: u32,
    /// Slot index on the GPU while a type is set (`placement_id`).
    pub slot: Option<u32>,
    /// `vgpu_params` value.
    pub params: String,
    /// Test flag set by `wedge`.
    pub wedged: bool,
    /// Broken by an unbind or a `driver_override` write (rule 4).
    pub broken: bool,
    /// Unbound from `nvidia`.
    pub unbound: bool,
    /// Busy (teardown lag) until this time.
    pub busy_until: u64,
}

/// One physical GPU.
#[derive(Debug, Clone)]
pub struct Gpu {
    /// The model entry.
    pub model: GpuModel,
    /// `pci<dom>:<bus>` directory name under `sys/devices`.
    pub pci_dir: String,
    /// Current type table (ids shift on `reload-driver`).
    pub table: Vec<TypeDef>,
    /// Current VFs (empty while SR-IOV is off).
    pub vfs: Vec<Vf>,
    /// VFs appear at this time.
    pub vfs_at: Option<u64>,
}

/// One mdev.
#[derive(Debug, Clone)]
pub struct Mdev {
    /// Its UUID.
    pub uuid: String,
    /// Parent VF uid.
    pub parent: u64,
    /// Parent VF address.
    pub parent_bdf: String,
    /// Type id.
    pub type_id: u32,
    /// IOMMU group (`mdev_group_base + k`).
    pub group: u32,
    /// Created by `ctl create-mdev`.
    pub foreign: bool,
    /// `nvidia/vgpu_params`.
    pub params: String,
    /// Busy (teardown lag) until this time.
    pub busy_until: u64,
    /// Time its last handle was released.
    pub last_release: Option<u64>,
}

/// An open file handle.
#[derive(Debug, Clone)]
pub struct Handle {
    /// Real path of the file.
    pub path: String,
    /// What it was when opened.
    pub kind: FileKind,
    /// Opening pid.
    pub pid: u32,
    /// Open time.
    pub since: u64,
    /// Control request bytes received so far.
    pub ctl_in: Vec<u8>,
    /// Control answer, once computed.
    pub ctl_out: Option<Vec<u8>>,
    /// Read cursor into `ctl_out`.
    pub cursor: usize,
}

/// Fault kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// `fail-write`.
    FailWrite,
    /// `fail-read` (read, readdir, readlink).
    FailRead,
    /// `fail-open`.
    FailOpen,
    /// `delay-write`.
    DelayWrite,
}

/// An injected fault.
#[derive(Debug, Clone)]
pub struct Fault {
    /// Kind.
    pub kind: FaultKind,
    /// The glob as given.
    pub path: String,
    /// Compiled glob.
    pub pattern: glob::Pattern,
    /// Errno to fail with (0 for delays).
    pub errno: Errno,
    /// Remaining count; `None` is forever.
    pub remaining: Option<u32>,
    /// Delay in ms.
    pub ms: u64,
}

/// One log entry (§10.6).
#[derive(Debug, Clone, Serialize)]
pub struct LogEntry {
    /// Sequence number from 1.
    pub seq: u64,
    /// Time in ms since start.
    pub t_ms: u64,
    /// Requesting pid.
    pub pid: u32,
    /// `write`, `open`, `set-type`, `create-mdev`, or `write-delayed` (a `delay-write` fault
    /// matched: the writer is blocked in `write(2)` from this entry until its `write` entry).
    pub op: String,
    /// Display path (`sys/bus/pci/devices/<BDF>/...`).
    pub path: String,
    /// Written value (`null` for opens).
    pub value: Option<String>,
    /// `ok` or the errno name.
    pub result: String,
}

/// An `override` entry.
#[derive(Debug, Clone)]
pub struct Override {
    /// The glob as given.
    pub path: String,
    /// Compiled glob.
    pub pattern: glob::Pattern,
    /// Content, or `None` for absent.
    pub content: Option<String>,
}

/// The whole simulated host.
#[derive(Debug)]
pub struct State {
    /// The model booted from.
    pub model: Model,
    start: Instant,
    /// Current boot id.
    pub boot_id: String,
    /// Current driver version.
    pub driver_version: String,
    /// GPUs in model order.
    pub gpus: Vec<Gpu>,
    /// Mdevs in creation order.
    pub mdevs: Vec<Mdev>,
    /// Passthrough GPUs in model order (their index is the `dev/nvidia<N>` minor).
    pub pt: Vec<PtGpu>,
    /// PCI functions of the passthrough GPUs and their IOMMU groups.
    pub pcifns: Vec<PciFn>,
    /// Open handles by fh.
    pub handles: BTreeMap<u64, Handle>,
    next_fh: u64,
    next_uid: u64,
    next_cdev: u32,
    /// Active faults.
    pub faults: Vec<Fault>,
    /// Write/open log.
    pub log: Vec<LogEntry>,
    /// Active overrides.
    pub overrides: Vec<Override>,
    /// Per-device release delays (key: BDF or UUID).
    pub release_delays: HashMap<String, u64>,
    tree: Option<Tree>,
    inos: Vec<String>,
    ino_of: HashMap<String, u64>,
}

fn is_glob_meta(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

fn pattern(s: &str) -> Result<glob::Pattern, String> {
    glob::Pattern::new(s.trim_start_matches('/')).map_err(|e| format!("bad glob {s:?}: {e}"))
}

impl State {
    /// Boots a host from a validated model.
    pub fn new(model: Model) -> State {
        let mut st = State {
            driver_version: model.driver_version.clone(),
            model,
            start: Instant::now(),
            boot_id: uuid::Uuid::new_v4().to_string(),
            gpus: Vec::new(),
            mdevs: Vec::new(),
            pt: Vec::new(),
            pcifns: Vec::new(),
            handles: BTreeMap::new(),
            next_fh: 1,
            next_uid: 1,
            next_cdev: 0,
            faults: Vec::new(),
            log: Vec::new(),
            overrides: Vec::new(),
            release_delays: HashMap::new(),
            tree: None,
            inos: vec![String::new(), String::new()],
            ino_of: HashMap::new(),
        };
        st.ino_of.insert(String::new(), 1);
        let delay = st.model.vf_appear_delay_ms;
        st.boot(delay);
        st
    }

    /// Milliseconds since the simulator started.
    pub fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn boot(&mut self, vf_delay: u64) {
        let now = self.now();
        self.driver_version = self.model.driver_version.clone();
        self.gpus = self
            .model
            .gpu
            .iter()
            .filter(|g| !self.model.is_passthrough(g))
            .map(|g| {
                let bdf = parse_bdf(&g.bdf).map(|b| format!("pci{:04x}:{:02x}", b.domain, b.bus));
                Gpu {
                    model: g.clone(),
                    pci_dir: bdf.unwrap_or_else(|_| "pci0000:00".into()),
                    table: self.model.table(&g.type_table).map(|t| t.types).unwrap_or_default(),
                    vfs: Vec::new(),
                    vfs_at: self.model.vfs_at_boot.then_some(now + vf_delay),
                }
            })
            .collect();
        self.mdevs.clear();
        self.boot_pt();
        self.next_cdev = 0;
        self.faults.clear();
        self.release_delays.clear();
        self.handles.retain(|_, h| matches!(h.kind, FileKind::Ctl));
        self.tick();
        self.tree = None;
    }

    /// Applies time-based changes: VFs appearing, mdevs removing themselves.
    pub fn tick(&mut self) {
        let now = self.now();
        for g in 0..self.gpus.len() {
            if self.gpus[g].vfs.is_empty() && self.gpus[g].vfs_at.is_some_and(|t| now >= t) {
                self.gpus[g].vfs_at = None;
                self.make_vfs(g);
            }
        }
        if self.model.mdev_self_remove {
            let before = self.mdevs.len();
            let handles = &self.handles;
            self.mdevs.retain(|m| {
                let held = handles.values().any(|h| h.kind == FileKind::Node(DevRef::MdevGroup(m.uuid.clone())));
                held || m.last_release.is_none_or(|t| now < t + MDEV_SELF_REMOVE_MS)
            });
            if self.mdevs.len() != before {
                self.tree = None;
            }
        }
    }

    fn make_vfs(&mut self, g: usize) {
        let vendor = self.model.framework == Framework::VendorVfio;
        let gm = self.gpus[g].model.clone();
        let Ok(pf) = parse_bdf(&gm.bdf) else { return };
        let mut vfs = Vec::new();
        for i in 0..gm.vfs() {
            let cdev = vendor.then(|| {
                self.next_cdev += 1;
                self.next_cdev - 1
            });
            self.next_uid += 1;
            vfs.push(Vf {
                uid: self.next_uid,
                bdf: pf.with_rid(pf.rid() + gm.vf_offset + i).to_string(),
                group: gm.iommu_group + 1 + i,
                cdev,
                type_id: 0,
                slot: None,
                params: String::new(),
                wedged: false,
                broken: false,
                unbound: false,
                busy_until: 0,
            });
        }
        self.gpus[g].vfs = vfs;
        self.tree = None;
    }

    // ---- lookups -------------------------------------------------------------------------

    /// (gpu index, vf index) of the VF with this uid.
    pub fn vf_pos(&self, uid: u64) -> Option<(usize, usize)> {
        self.gpus.iter().enumerate().find_map(|(g, gpu)| gpu.vfs.iter().position(|v| v.uid == uid).map(|i| (g, i)))
    }

    fn vf(&self, uid: u64) -> Option<&Vf> {
        self.vf_pos(uid).map(|(g, i)| &self.gpus[g].vfs[i])
    }

    fn vf_mut(&mut self, uid: u64) -> Option<&mut Vf> {
        self.vf_pos(uid).map(|(g, i)| &mut self.gpus[g].vfs[i])
    }

    fn vf_by_bdf(&self, bdf: &str) -> Option<(usize, usize)> {
        self.gpus.iter().enumerate().find_map(|(g, gpu)| gpu.vfs.iter().position(|v| v.bdf == bdf).map(|i| (g, i)))
    }

    fn gpu_by_bdf(&self, bdf: &str) -> Option<usize> {
        self.gpus.iter().position(|g| g.model.bdf == bdf)
    }

    fn type_def(&self, g: usize, id: u32) -> Option<&TypeDef> {
        self.gpus[g].table.iter().find(|t| t.id == id)
    }

    /// Framebuffer sizes of the vGPUs (VF types and mdevs) on GPU `g`.
    fn active_fbs(&self, g: usize) -> Vec<u64> {
        let gpu = &self.gpus[g];
        let mut ids: Vec<u32> = gpu.vfs.iter().filter(|v| v.type_id != 0).map(|v| v.type_id).collect();
        ids.extend(self.mdevs.iter().filter(|m| gpu.vfs.iter().any(|v| v.uid == m.parent)).map(|m| m.type_id));
        ids.iter().map(|id| self.type_def(g, *id).map(|t| t.fb_mib).unwrap_or(0)).collect()
    }

    /// Rule 1: the types GPU `g` can create now on a free VF.
    pub fn free_catalog(&self, g: usize) -> Vec<TypeDef> {
        let fbs = self.active_fbs(g);
        let vf_count = self.gpus[g].model.vfs();
        self.gpus[g]
            .table
            .iter()
            .filter(|t| fbs.iter().all(|fb| *fb == t.fb_mib) && (fbs.len() as u32) < t.max.min(vf_count))
            .cloned()
            .collect()
    }

    fn vf_has_mdev(&self, uid: u64) -> bool {
        self.mdevs.iter().any(|m| m.parent == uid)
    }

    /// Rule 1 for one VF: empty if the VF holds a type (or an mdev).
    pub fn vf_catalog(&self, uid: u64) -> Vec<TypeDef> {
        match self.vf_pos(uid) {
            Some((g, i)) if self.gpus[g].vfs[i].type_id == 0 && !self.vf_has_mdev(uid) => self.free_catalog(g),
            _ => Vec::new(),
        }
    }

    fn catalog_text(types: &[TypeDef]) -> String {
        let mut s = format!("{CATALOG_HEADER}\n");
        for t in types {
            s.push_str(&format!("{:<5} : {}\n", t.id, t.name));
        }
        s
    }

    fn dev_handles<'a>(&'a self, dev: &'a DevRef) -> impl Iterator<Item = &'a Handle> + 'a {
        self.handles.values().filter(move |h| matches!(&h.kind, FileKind::Node(d) if d == dev))
    }

    fn vf_handle_count(&self, uid: u64) -> usize {
        self.dev_handles(&DevRef::VfGroup(uid)).count() + self.dev_handles(&DevRef::VfCdev(uid)).count()
    }

    fn vf_busy(&self, uid: u64) -> bool {
        self.vf_handle_count(uid) > 0 || self.vf(uid).is_some_and(|v| self.now() < v.busy_until)
    }

    fn mdev_busy(&self, m: &Mdev) -> bool {
        self.dev_handles(&DevRef::MdevGroup(m.uuid.clone())).next().is_some() || self.now() < m.busy_until
    }

    fn release_delay(&self, key: &str) -> u64 {
        self.release_delays.get(key).copied().unwrap_or(self.model.release_delay_ms)
    }

    // ---- tree ----------------------------------------------------------------------------

    /// The current tree, rebuilt if the state changed shape.
    pub fn tree(&mut self) -> &Tree {
        if self.tree.is_none() {
            self.tree = Some(self.build_tree());
        }
        self.tree.get_or_insert_with(Tree::new)
    }

    /// Marks the tree stale.
    pub fn invalidate(&mut self) {
        self.tree = None;
    }

    fn build_tree(&self) -> Tree {
        let mut t = Tree::new();
        let vendor = self.model.framework == Framework::VendorVfio;
        let mdev = self.model.framework == Framework::Mdev;
        t.file(".sim/ctl", FileKind::Ctl, 0o600);
        t.file(".sim/state.json", FileKind::StateJson, 0o444);
        t.text("proc/sys/kernel/random/boot_id", format!("{}\n", self.boot_id));
        t.text("sys/module/nvidia/version", format!("{}\n", self.driver_version));
        // What `gpuvisor host check` reads besides: the driver's banner, and the vGPU
        // manager's module on a vGPU host (docs/design/host.md §10.1 extra files).
        t.text(
            "proc/driver/nvidia/version",
            format!(
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {}  Release Build  (gpuvisor-sim)\n",
                self.driver_version
            ),
        );
        if vendor || mdev {
            t.text("sys/module/nvidia_vgpu_vfio/version", format!("{}\n", self.driver_version));
        }
        t.dir("sys/bus/pci/devices");
        t.dir("sys/kernel/iommu_groups");
        t.dir("sys/class/mdev_bus");
        t.file("sys/bus/pci/drivers/nvidia/bind", FileKind::DriverBind(NVIDIA.into()), 0o200);
        t.file("sys/bus/pci/drivers/nvidia/unbind", FileKind::DriverUnbind(NVIDIA.into()), 0o200);
        t.file("sys/bus/pci/drivers_probe", FileKind::DriversProbe, 0o200);
        t.file("dev/vfio/vfio", FileKind::Node(DevRef::Container), 0o666);
        t.dir("dev/vfio/devices");
        if mdev {
            t.dir("sys/bus/mdev/devices");
        }
        for (g, gpu) in self.gpus.iter().enumerate() {
            let gm = &gpu.model;
            let (vendor_id, device_id) = parse_pci_id(&gm.pci_id).unwrap_or((0x10de, 0));
            let pf = &gm.bdf;
            let pci = &gpu.pci_dir;
            let dev_dir = |bdf: &str| format!("sys/devices/{pci}/{bdf}");
            let pfd = dev_dir(pf);
            let common = |t: &mut Tree, dir: &str, group: u32| {
                t.text(&format!("{dir}/vendor"), format!("0x{vendor_id:04x}\n"));
                t.text(&format!("{dir}/device"), format!("0x{device_id:04x}\n"));
                t.text(&format!("{dir}/class"), format!("{}\n", gm.class));
                t.text(&format!("{dir}/numa_node"), format!("{}\n", gm.numa_node));
                t.link(&format!("{dir}/iommu_group"), format!("../../../kernel/iommu_groups/{group}"));
            };
            common(&mut t, &pfd, gm.iommu_group);
            t.link(&format!("{pfd}/driver"), "../../../bus/pci/drivers/nvidia");
            t.text(&format!("{pfd}/sriov_totalvfs"), format!("{}\n", gm.vfs()));
            t.file(&format!("{pfd}/sriov_numvfs"), FileKind::SriovNumvfs(g), 0o644);
            if self.model.pf_catalog {
                t.file(&format!("{pfd}/nvidia/creatable_vgpu_types"), FileKind::Catalog(u64::MAX - g as u64), 0o444);
            }
            t.link(&format!("sys/bus/pci/devices/{pf}"), format!("../../../devices/{pci}/{pf}"));
            t.link(&format!("sys/bus/pci/drivers/nvidia/{pf}"), format!("../../../../devices/{pci}/{pf}"));
            t.link(
                &format!("sys/kernel/iommu_groups/{}/devices/{pf}", gm.iommu_group),
                format!("../../../../devices/{pci}/{pf}"),
            );
            for (i, vf) in gpu.vfs.iter().enumerate() {
                let b = &vf.bdf;
                let d = dev_dir(b);
                t.link(&format!("{pfd}/virtfn{i}"), format!("../{b}"));
                common(&mut t, &d, vf.group);
                t.link(&format!("{d}/physfn"), format!("../{pf}"));
                if !vf.unbound {
                    t.link(&format!("{d}/driver"), "../../../bus/pci/drivers/nvidia");
                    t.link(&format!("sys/bus/pci/drivers/nvidia/{b}"), format!("../../../../devices/{pci}/{b}"));
                }
                t.file(&format!("{d}/driver_override"), FileKind::DriverOverride(vf.uid), 0o644);
                t.link(&format!("sys/bus/pci/devices/{b}"), format!("../../../devices/{pci}/{b}"));
                t.link(
                    &format!("sys/kernel/iommu_groups/{}/devices/{b}", vf.group),
                    format!("../../../../devices/{pci}/{b}"),
                );
                if vendor && !vf.broken {
                    let n = format!("{d}/nvidia");
                    let u = vf.uid;
                    t.file(&format!("{n}/creatable_vgpu_types"), FileKind::Catalog(u), 0o444);
                    t.file(&format!("{n}/current_vgpu_type"), FileKind::CurrentType(u), 0o644);
                    t.file(&format!("{n}/vgpu_params"), FileKind::Params(u), 0o644);
                    t.file(&format!("{n}/placement_id"), FileKind::PlacementId(u), 0o644);
                    t.file(&format!("{n}/gpu_instance_id"), FileKind::GpuInstanceId(u), 0o644);
                    t.file(&format!("{n}/warm_update"), FileKind::WarmUpdate(u), 0o644);
                    if let Some(c) = vf.cdev {
                        t.text(&format!("{d}/vfio-dev/vfio{c}/dev"), format!("511:{c}\n"));
                        t.file(&format!("dev/vfio/devices/vfio{c}"), FileKind::Node(DevRef::VfCdev(u)), 0o600);
                    }
                }
                if vendor {
                    t.file(&format!("dev/vfio/{}", vf.group), FileKind::Node(DevRef::VfGroup(vf.uid)), 0o600);
                }
                if mdev && !vf.broken {
                    t.link(&format!("sys/class/mdev_bus/{b}"), format!("../../devices/{pci}/{b}"));
                    for ty in &gpu.table {
                        let td = format!("{d}/mdev_supported_types/nvidia-{}", ty.id);
                        t.text(&format!("{td}/name"), format!("{}\n", ty.name));
                        t.text(
                            &format!("{td}/description"),
                            format!(
                                "num_heads=4, frl_config=60, framebuffer={}M, max_resolution=5120x2880, max_instance={}\n",
                                ty.fb_mib, ty.max
                            ),
                        );
                        t.text(&format!("{td}/device_api"), "vfio-pci\n");
                        t.file(&format!("{td}/available_instances"), FileKind::MdevAvailable(vf.uid, ty.id), 0o444);
                        t.file(&format!("{td}/create"), FileKind::MdevCreate(vf.uid, ty.id), 0o200);
                        t.dir(&format!("{td}/devices"));
                    }
                    for m in self.mdevs.iter().filter(|m| m.parent == vf.uid) {
                        let u = &m.uuid;
                        let md = format!("{d}/{u}");
                        t.link(
                            &format!("{md}/mdev_type"),
                            format!("../../{b}/mdev_supported_types/nvidia-{}", m.type_id),
                        );
                        t.link(&format!("{md}/iommu_group"), format!("../../../../kernel/iommu_groups/{}", m.group));
                        t.file(&format!("{md}/remove"), FileKind::MdevRemove(u.clone()), 0o200);
                        t.file(&format!("{md}/nvidia/vgpu_params"), FileKind::MdevParams(u.clone()), 0o644);
                        t.link(
                            &format!("{d}/mdev_supported_types/nvidia-{}/devices/{u}", m.type_id),
                            format!("../../../{u}"),
                        );
                        t.link(&format!("sys/bus/mdev/devices/{u}"), format!("../../../devices/{pci}/{b}/{u}"));
                        t.link(
                            &format!("sys/kernel/iommu_groups/{}/devices/{u}", m.group),
                            format!("../../../../devices/{pci}/{b}/{u}"),
                        );
                        t.file(&format!("dev/vfio/{}", m.group), FileKind::Node(DevRef::MdevGroup(u.clone())), 0o600);
                    }
                }
            }
        }
        self.build_pt_tree(&mut t);
        // Overrides: absent ones remove, content ones add missing literal paths.
        for o in &self.overrides {
            let matching: Vec<String> =
                t.nodes.keys().filter(|k| aliases(k).iter().any(|a| o.pattern.matches(a))).cloned().collect();
            match &o.content {
                None => matching.iter().for_each(|k| t.remove(k)),
                Some(c) if matching.is_empty() && !is_glob_meta(&o.path) => {
                    let p = o.path.trim_start_matches('/');
                    let (parent, name) = p.rsplit_once('/').unwrap_or(("", p));
                    if let Some(real) = t.resolve(parent) {
                        let full = if real.is_empty() { name.to_string() } else { format!("{real}/{name}") };
                        t.text(&full, c.clone());
                    }
                }
                Some(_) => {}
            }
        }
        t
    }

    /// The inode number of a real path (interned; stable for the life of the process).
    pub fn ino(&mut self, path: &str) -> u64 {
        if let Some(i) = self.ino_of.get(path) {
            return *i;
        }
        let i = self.inos.len() as u64;
        self.inos.push(path.to_string());
        self.ino_of.insert(path.to_string(), i);
        i
    }

    /// The real path of an inode.
    pub fn path_of(&self, ino: u64) -> Option<String> {
        self.inos.get(ino as usize).cloned()
    }

    // ---- faults and log ------------------------------------------------------------------

    /// Consumes a matching fault of `kind` for `path`; returns (errno, delay ms).
    pub fn take_fault(&mut self, kind: FaultKind, path: &str) -> Option<(Errno, u64)> {
        let names = aliases(path);
        let i = self.faults.iter().position(|f| f.kind == kind && names.iter().any(|n| f.pattern.matches(n)))?;
        let f = &mut self.faults[i];
        let out = (f.errno, f.ms);
        if let Some(r) = f.remaining.as_mut() {
            *r -= 1;
            if *r == 0 {
                self.faults.remove(i);
            }
        }
        Some(out)
    }

    /// Appends a log entry.
    pub fn log(&mut self, pid: u32, op: &str, path: &str, value: Option<&str>, res: Result<(), Errno>) {
        let seq = self.log.len() as u64 + 1;
        let t_ms = self.now();
        self.log.push(LogEntry {
            seq,
            t_ms,
            pid,
            op: op.into(),
            path: display(path),
            value: value.map(String::from),
            result: match res {
                Ok(()) => "ok".into(),
                Err(e) => errno_name(e),
            },
        });
    }

    fn override_for(&self, path: &str) -> Option<&Override> {
        let names = aliases(path);
        self.overrides.iter().rev().find(|o| names.iter().any(|n| o.pattern.matches(n)))
    }

    // ---- handles -------------------------------------------------------------------------

    /// The file kind at `path` now, if any.
    pub fn kind_at(&mut self, path: &str) -> Option<(FileKind, u16)> {
        match self.tree().nodes.get(path) {
            Some(Node::File(k, m)) => Some((k.clone(), *m)),
            _ => None,
        }
    }

    /// FUSE open of a regular file. `write`/`read` tell the access mode.
    pub fn open(&mut self, path: &str, pid: u32, read: bool, write: bool) -> Result<u64, Errno> {
        let (kind, mode) = self.kind_at(path).ok_or(libc::ENOENT)?;
        let is_node = matches!(kind, FileKind::Node(_));
        if let Some((e, _)) = self.take_fault(FaultKind::FailOpen, path) {
            if is_node {
                self.log(pid, "open", path, None, Err(e));
            }
            return Err(e);
        }
        if (write && mode & 0o222 == 0) || (read && mode & 0o444 == 0) {
            return Err(libc::EACCES);
        }
        if let FileKind::Node(dev) = &kind {
            let r = self.check_node_open(dev);
            self.log(pid, "open", path, None, r);
            r?;
        }
        let fh = self.next_fh;
        self.next_fh += 1;
        let since = self.now();
        self.handles.insert(
            fh,
            Handle { path: path.to_string(), kind, pid, since, ctl_in: Vec::new(), ctl_out: None, cursor: 0 },
        );
        Ok(fh)
    }

    /// Rule 5.
    fn check_node_open(&self, dev: &DevRef) -> Result<(), Errno> {
        match dev {
            DevRef::Container => Ok(()),
            DevRef::VfGroup(uid) | DevRef::VfCdev(uid) => {
                let vf = self.vf(*uid).ok_or(libc::ENODEV)?;
                if vf.type_id == 0 {
                    return Err(libc::ENODEV);
                }
                if matches!(dev, DevRef::VfGroup(_)) && self.dev_handles(dev).next().is_some() {
                    return Err(libc::EBUSY);
                }
                Ok(())
            }
            DevRef::MdevGroup(_) | DevRef::PtGroup(_) => {
                if self.dev_handles(dev).next().is_some() {
                    return Err(libc::EBUSY);
                }
                Ok(())
            }
            DevRef::Nvidia(_) => Ok(()),
        }
    }

    /// FUSE release: forgets the handle and starts the teardown lag after a device's last one.
    pub fn release(&mut self, fh: u64) {
        let Some(h) = self.handles.remove(&fh) else {
            return;
        };
        let now = self.now();
        match h.kind {
            FileKind::Node(DevRef::VfGroup(uid)) | FileKind::Node(DevRef::VfCdev(uid))
                if self.vf_handle_count(uid) == 0 =>
            {
                let delay = self.vf(uid).map(|v| self.release_delay(&v.bdf)).unwrap_or(0);
                if let Some(v) = self.vf_mut(uid) {
                    v.busy_until = now + delay;
                }
            }
            FileKind::Node(DevRef::MdevGroup(ref u)) => {
                let delay = self.release_delay(u);
                if let Some(m) = self.mdevs.iter_mut().find(|m| &m.uuid == u) {
                    m.busy_until = now + delay;
                    m.last_release = Some(now);
                }
            }
            FileKind::Node(DevRef::PtGroup(g)) => self.pt_released(g),
            _ => {}
        }
    }

    /// The handle `fh` if its file still exists as opened; ENODEV otherwise (rule 11).
    pub fn live_handle(&mut self, fh: u64) -> Result<Handle, Errno> {
        let h = self.handles.get(&fh).cloned().ok_or(libc::ENODEV)?;
        if matches!(h.kind, FileKind::Ctl | FileKind::StateJson) {
            return Ok(h);
        }
        match self.kind_at(&h.path) {
            Some((k, _)) if k == h.kind => Ok(h),
            _ => Err(libc::ENODEV),
        }
    }

    // ---- reads ---------------------------------------------------------------------------

    /// Reads a file's whole content now.
    pub fn read_file(&mut self, fh: u64) -> Result<Vec<u8>, Errno> {
        let h = self.live_handle(fh)?;
        if let Some((e, _)) = self.take_fault(FaultKind::FailRead, &h.path) {
            return Err(e);
        }
        if let Some(o) = self.override_for(&h.path) {
            if let Some(c) = &o.content {
                return Ok(c.clone().into_bytes());
            }
        }
        if let Some(data) = self.pt_read(&h.kind) {
            return Ok(data);
        }
        let s = match &h.kind {
            FileKind::Static(s) => s.clone(),
            FileKind::SriovNumvfs(g) => format!("{}\n", self.gpus[*g].vfs.len()),
            FileKind::Catalog(uid) => {
                let types = if *uid > u64::MAX - 1024 {
                    self.free_catalog((u64::MAX - uid) as usize)
                } else {
                    self.vf_catalog(*uid)
                };
                Self::catalog_text(&types)
            }
            FileKind::CurrentType(uid) => {
                format!("{}\n", self.vf(*uid).ok_or(libc::ENODEV)?.type_id)
            }
            FileKind::Params(uid) => {
                let p = &self.vf(*uid).ok_or(libc::ENODEV)?.params;
                if p.is_empty() {
                    String::new()
                } else {
                    format!("{p}\n")
                }
            }
            FileKind::PlacementId(uid) => {
                let vf = self.vf(*uid).ok_or(libc::ENODEV)?;
                match (vf.type_id, vf.slot) {
                    (0, _) | (_, None) => return Err(libc::ENXIO),
                    (_, Some(s)) => format!("{s}\n"),
                }
            }
            FileKind::GpuInstanceId(_) => return Err(libc::ENXIO),
            FileKind::WarmUpdate(_) => "0\n".into(),
            FileKind::DriverOverride(_) => "(null)\n".into(),
            FileKind::MdevAvailable(uid, id) => {
                let avail = !self.vf_has_mdev(*uid) && self.vf_catalog(*uid).iter().any(|t| t.id == *id);
                format!("{}\n", u8::from(avail))
            }
            FileKind::MdevParams(u) => {
                let m = self.mdevs.iter().find(|m| &m.uuid == u).ok_or(libc::ENODEV)?;
                if m.params.is_empty() {
                    String::new()
                } else {
                    format!("{}\n", m.params)
                }
            }
            FileKind::Node(_) => String::new(),
            FileKind::StateJson => {
                let mut s = serde_json::to_string_pretty(&self.dump()).map_err(|_| libc::EIO)?;
                s.push('\n');
                s
            }
            FileKind::Ctl => {
                let h = self.handles.get_mut(&fh).ok_or(libc::ENODEV)?;
                if h.ctl_out.is_none() {
                    let ans = json!({"ok": false, "error": "incomplete request"});
                    h.ctl_out = Some(ans.to_string().into_bytes());
                }
                let out = h.ctl_out.clone().unwrap_or_default();
                let start = h.cursor.min(out.len());
                return Ok(out[start..].to_vec());
            }
            FileKind::DriverBind(_)
            | FileKind::DriverUnbind(_)
            | FileKind::DriversProbe
            | FileKind::PtReset(_)
            | FileKind::MdevCreate(..)
            | FileKind::MdevRemove(_) => return Err(libc::EACCES),
            FileKind::PtOverride(_) | FileKind::PtPowerState(_) | FileKind::PtConfig(_) => return Err(libc::EIO),
        };
        Ok(s.into_bytes())
    }

    /// Advances the control handle's read cursor.
    pub fn advance_ctl(&mut self, fh: u64, n: usize) {
        if let Some(h) = self.handles.get_mut(&fh) {
            h.cursor += n;
        }
    }

    // ---- writes --------------------------------------------------------------------------

    /// Checks `fail-write`/`delay-write` faults for a write on `fh`.
    /// Returns `Err(errno)` for an injected failure (already logged), else the delay in ms.
    pub fn write_faults(&mut self, fh: u64, pid: u32, data: &[u8]) -> Result<u64, Errno> {
        let h = self.live_handle(fh)?;
        if matches!(h.kind, FileKind::Ctl) {
            return Ok(0);
        }
        let value = String::from_utf8_lossy(data).into_owned();
        if let Some((e, _)) = self.take_fault(FaultKind::FailWrite, &h.path) {
            self.log(pid, "write", &h.path, Some(&value), Err(e));
            return Err(e);
        }
        let delay = self.take_fault(FaultKind::DelayWrite, &h.path).map(|(_, ms)| ms).unwrap_or(0);
        if delay > 0 {
            // Lets a test see that the writer is inside the delayed write(2) right now.
            self.log(pid, "write-delayed", &h.path, Some(&value), Ok(()));
        }
        Ok(delay)
    }

    /// A `write(2)` on `fh`, after faults: runs the rules and logs the result.
    pub fn write(&mut self, fh: u64, pid: u32, data: &[u8]) -> Result<(), Errno> {
        let h = self.live_handle(fh)?;
        if matches!(h.kind, FileKind::Ctl) {
            return self.ctl_write(fh, pid, data);
        }
        let value = String::from_utf8_lossy(data).into_owned();
        let r = self.apply_write(&h.kind, &value);
        self.log(pid, "write", &h.path, Some(&value), r);
        if r.is_ok() {
            self.invalidate();
        }
        r
    }

    fn apply_write(&mut self, kind: &FileKind, value: &str) -> Result<(), Errno> {
        let v = value.trim_end_matches('\n');
        match kind {
            FileKind::CurrentType(uid) => self.write_type(*uid, v),
            FileKind::Params(uid) => {
                let uid = *uid;
                let vf = self.vf(uid).ok_or(libc::ENODEV)?;
                if vf.type_id == 0 {
                    return Err(libc::EPERM);
                }
                if self.vf_handle_count(uid) > 0 {
                    return Err(libc::EBUSY);
                }
                let vf = self.vf_mut(uid).ok_or(libc::ENODEV)?;
                vf.params = if v.trim().is_empty() { String::new() } else { v.to_string() };
                Ok(())
            }
            FileKind::PlacementId(_) | FileKind::GpuInstanceId(_) | FileKind::WarmUpdate(_) => Err(libc::EPERM),
            FileKind::SriovNumvfs(_) => Err(libc::EPERM),
            FileKind::DriverOverride(uid) => {
                let vf = self.vf_mut(*uid).ok_or(libc::ENODEV)?;
                vf.broken = true;
                Ok(())
            }
            FileKind::DriverUnbind(d) => {
                let b = v.trim();
                if let Some(i) = self.pt_fn(b) {
                    self.pt_unbind(d, i)
                } else if let Some((g, i)) = self.vf_by_bdf(b) {
                    let vf = &mut self.gpus[g].vfs[i];
                    if vf.unbound || d != NVIDIA {
                        return Err(libc::ENODEV);
                    }
                    vf.unbound = true;
                    vf.broken = true;
                    Ok(())
                } else if self.gpu_by_bdf(b).is_some() && d == NVIDIA {
                    Ok(())
                } else {
                    Err(libc::ENODEV)
                }
            }
            FileKind::DriverBind(d) => {
                let b = v.trim();
                if let Some(i) = self.pt_fn(b) {
                    self.pt_bind(d, i)
                } else if let Some((g, i)) = self.vf_by_bdf(b) {
                    let vf = &mut self.gpus[g].vfs[i];
                    if !vf.unbound {
                        Err(libc::EBUSY)
                    } else if d == NVIDIA {
                        vf.unbound = false;
                        Ok(())
                    } else if d == VFIO_PCI {
                        Err(libc::EINVAL) // vfio-pci cannot probe these VFs (§2)
                    } else {
                        Err(libc::ENODEV)
                    }
                } else if self.gpu_by_bdf(b).is_some() {
                    Err(libc::EBUSY)
                } else {
                    Err(libc::ENODEV)
                }
            }
            FileKind::DriversProbe => {
                let b = v.trim();
                if let Some(i) = self.pt_fn(b) {
                    self.pt_probe(i)
                } else if let Some((g, i)) = self.vf_by_bdf(b) {
                    self.gpus[g].vfs[i].unbound = false;
                    Ok(())
                } else if self.gpu_by_bdf(b).is_some() {
                    Ok(())
                } else {
                    Err(libc::ENODEV)
                }
            }
            FileKind::PtOverride(i) => self.pt_write_override(*i, value),
            FileKind::PtReset(i) => self.pt_reset(*i, v),
            FileKind::MdevCreate(uid, id) => self.mdev_create(*uid, *id, v.trim(), false),
            FileKind::MdevRemove(u) => {
                if v.trim() != "1" {
                    return Err(libc::EINVAL);
                }
                let m = self.mdevs.iter().find(|m| &m.uuid == u).ok_or(libc::ENODEV)?;
                if self.mdev_busy(m) {
                    return Err(libc::EBUSY);
                }
                self.mdevs.retain(|m| &m.uuid != u);
                Ok(())
            }
            FileKind::MdevParams(u) => {
                let busy = self.dev_handles(&DevRef::MdevGroup(u.clone())).next().is_some();
                if busy {
                    return Err(libc::EBUSY);
                }
                let m = self.mdevs.iter_mut().find(|m| &m.uuid == u).ok_or(libc::ENODEV)?;
                m.params = if v.trim().is_empty() { String::new() } else { v.to_string() };
                Ok(())
            }
            FileKind::Node(_) => Err(libc::EINVAL),
            _ => Err(libc::EACCES),
        }
    }

    /// Rule 2, in its exact errno order.
    fn write_type(&mut self, uid: u64, v: &str) -> Result<(), Errno> {
        let (g, i) = self.vf_pos(uid).ok_or(libc::ENODEV)?;
        let s = v.trim();
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(libc::EINVAL);
        }
        let id: u32 = s.parse().map_err(|_| libc::EINVAL)?;
        let cur = self.gpus[g].vfs[i].type_id;
        if id != 0 && cur != 0 {
            return Err(libc::EPERM);
        }
        if id == 0 && cur == 0 {
            return Err(libc::EPERM);
        }
        if id == 0 {
            if self.vf_busy(uid) {
                return Err(libc::EBUSY);
            }
            let vf = &mut self.gpus[g].vfs[i];
            vf.type_id = 0;
            vf.slot = None;
            vf.params.clear();
            return Ok(());
        }
        if self.type_def(g, id).is_none() {
            return Err(libc::EINVAL);
        }
        if !self.vf_catalog(uid).iter().any(|t| t.id == id) {
            return Err(libc::EIO);
        }
        self.set_type(g, i, id);
        Ok(())
    }

    fn set_type(&mut self, g: usize, i: usize, id: u32) {
        let used: Vec<u32> = self.gpus[g].vfs.iter().filter_map(|v| v.slot).collect();
        let slot = (0..).find(|s| !used.contains(s)).unwrap_or(0);
        let vf = &mut self.gpus[g].vfs[i];
        vf.type_id = id;
        vf.slot = (id != 0).then_some(slot);
        if id == 0 {
            vf.params.clear();
        }
    }

    /// Rule 7 (with `foreign`, the availability check is skipped).
    fn mdev_create(&mut self, uid: u64, id: u32, uuid: &str, foreign: bool) -> Result<(), Errno> {
        let parsed = uuid::Uuid::try_parse(uuid).map_err(|_| libc::EINVAL)?;
        if uuid.len() != 36 {
            return Err(libc::EINVAL);
        }
        let uuid = parsed.hyphenated().to_string();
        if self.mdevs.iter().any(|m| m.uuid == uuid) {
            return Err(libc::EEXIST);
        }
        let vf = self.vf(uid).ok_or(libc::ENODEV)?;
        let bdf = vf.bdf.clone();
        if !foreign && (self.vf_has_mdev(uid) || !self.vf_catalog(uid).iter().any(|t| t.id == id)) {
            return Err(libc::EUSERS);
        }
        let base = self.model.mdev_group_base;
        let used: Vec<u32> = self.mdevs.iter().map(|m| m.group).collect();
        let group = (base..).find(|g| !used.contains(g)).unwrap_or(base);
        self.mdevs.push(Mdev {
            uuid,
            parent: uid,
            parent_bdf: bdf,
            type_id: id,
            group,
            foreign,
            params: String::new(),
            busy_until: 0,
            last_release: None,
        });
        Ok(())
    }

    fn ctl_write(&mut self, fh: u64, pid: u32, data: &[u8]) -> Result<(), Errno> {
        let h = self.handles.get_mut(&fh).ok_or(libc::ENODEV)?;
        h.ctl_in.extend_from_slice(data);
        let parsed: Result<CtlRequest, _> = serde_json::from_slice(&h.ctl_in);
        let answer = match parsed {
            Err(e) if e.is_eof() => return Ok(()),
            Err(e) => json!({"ok": false, "error": format!("bad request: {e}")}).to_string(),
            Ok(req) => match self.ctl(&req.argv, pid) {
                Ok(v) => {
                    // Keep `ok` first and the dump's field order: compose the object by hand.
                    let mut s = String::from("{\"ok\":true");
                    for (k, v) in v {
                        s.push_str(&format!(",{}:{v}", Value::String(k)));
                    }
                    s.push('}');
                    s
                }
                Err(e) => json!({"ok": false, "error": e}).to_string(),
            },
        };
        self.invalidate();
        let h = self.handles.get_mut(&fh).ok_or(libc::ENODEV)?;
        h.ctl_out = Some(answer.into_bytes());
        h.cursor = 0;
        Ok(())
    }

    // ---- control -------------------------------------------------------------------------

    fn find_vf(&self, bdf: &str) -> Result<(usize, usize), String> {
        self.vf_by_bdf(bdf).ok_or_else(|| format!("no VF {bdf}"))
    }

    fn find_pf(&self, bdf: &str) -> Result<usize, String> {
        self.gpu_by_bdf(bdf).ok_or_else(|| format!("no PF {bdf}"))
    }

    fn add_fault(&mut self, kind: FaultKind, a: &FaultArgs) -> Result<Vec<(String, String)>, String> {
        let errno = parse_errno(&a.errno).ok_or_else(|| format!("unknown errno {:?}", a.errno))?;
        let remaining = if a.always { None } else { Some(a.times.unwrap_or(1)) };
        if remaining == Some(0) {
            return Err("--times must be at least 1".into());
        }
        self.faults.push(Fault { kind, path: a.path.clone(), pattern: pattern(&a.path)?, errno, remaining, ms: 0 });
        Ok(vec![])
    }

    fn gpu_busy(&self, g: usize) -> bool {
        self.gpus[g].vfs.iter().any(|v| {
            self.vf_handle_count(v.uid) > 0
                || self
                    .mdevs
                    .iter()
                    .any(|m| m.parent == v.uid && self.dev_handles(&DevRef::MdevGroup(m.uuid.clone())).next().is_some())
        })
    }

    fn disable_vfs(&mut self, g: usize) {
        let uids: Vec<u64> = self.gpus[g].vfs.iter().map(|v| v.uid).collect();
        self.mdevs.retain(|m| !uids.contains(&m.parent));
        self.gpus[g].vfs.clear();
        self.gpus[g].vfs_at = None;
    }

    /// Executes one control command; the answer's extra fields or an error message.
    /// The answer's fields come back as (key, JSON text) pairs, in order.
    pub fn ctl(&mut self, argv: &[String], pid: u32) -> Result<Vec<(String, String)>, String> {
        if let Some(h) = crate::ctl::help(argv) {
            return Ok(vec![("help".into(), Value::String(h?).to_string())]);
        }
        let line = CtlLine::try_parse_from(argv).map_err(|e| e.to_string().trim().to_string())?;
        let now = self.now();
        match line.cmd {
            CtlCmd::State => {
                let d = serde_json::to_string(&self.dump()).map_err(|e| e.to_string())?;
                Ok(vec![("state".into(), d)])
            }
            CtlCmd::FailWrite(a) => self.add_fault(FaultKind::FailWrite, &a),
            CtlCmd::FailRead(a) => self.add_fault(FaultKind::FailRead, &a),
            CtlCmd::FailOpen(a) => self.add_fault(FaultKind::FailOpen, &a),
            CtlCmd::DelayWrite { path, ms, times } => {
                if times == Some(0) {
                    return Err("--times must be at least 1".into());
                }
                self.faults.push(Fault {
                    kind: FaultKind::DelayWrite,
                    pattern: pattern(&path)?,
                    path,
                    errno: 0,
                    remaining: times,
                    ms,
                });
                Ok(vec![])
            }
            CtlCmd::ClearFaults => {
                self.faults.clear();
                Ok(vec![])
            }
            CtlCmd::Wedge { dev } | CtlCmd::Unwedge { dev } => {
                let wedge = argv.first().map(String::as_str) == Some("wedge");
                if self.pt_wedge(&dev, wedge) {
                    return Ok(vec![]);
                }
                let (g, i) = self.find_vf(&dev).map_err(|_| format!("no VF or passthrough GPU {dev}"))?;
                self.gpus[g].vfs[i].wedged = wedge;
                Ok(vec![])
            }
            CtlCmd::ReleaseDelay { dev, ms } => {
                let known = self.vf_by_bdf(&dev).is_some()
                    || self.gpu_by_bdf(&dev).is_some()
                    || self.pt_gpu(&dev).is_some()
                    || self.mdevs.iter().any(|m| m.uuid == dev);
                if !known {
                    return Err(format!("no device {dev}"));
                }
                self.release_delays.insert(dev, ms);
                Ok(vec![])
            }
            CtlCmd::SetType { vf, id } => {
                let (g, i) = self.find_vf(&vf)?;
                if id != 0 && self.type_def(g, id).is_none() {
                    return Err(format!("type {id} is not in the type table of {vf}"));
                }
                self.set_type(g, i, id);
                let path = format!("sys/devices/{}/{vf}/nvidia/current_vgpu_type", self.gpus[g].pci_dir);
                self.log(pid, "set-type", &path, Some(&id.to_string()), Ok(()));
                Ok(vec![])
            }
            CtlCmd::CreateMdev { parent, type_, uuid } => {
                if self.model.framework != Framework::Mdev {
                    return Err("create-mdev needs framework = \"mdev\"".into());
                }
                let (g, i) = self.find_vf(&parent)?;
                let id: u32 = type_.trim_start_matches("nvidia-").parse().map_err(|_| format!("bad type {type_:?}"))?;
                if self.type_def(g, id).is_none() {
                    return Err(format!("type {id} is not in the type table of {parent}"));
                }
                let uid = self.gpus[g].vfs[i].uid;
                let r = self.mdev_create(uid, id, &uuid, true);
                let path =
                    format!("sys/devices/{}/{parent}/mdev_supported_types/nvidia-{id}/create", self.gpus[g].pci_dir);
                self.log(pid, "create-mdev", &path, Some(&uuid), r);
                r.map_err(errno_name)?;
                Ok(vec![])
            }
            CtlCmd::StuckDriver { bdf } => self.pt_stuck(&bdf, true).map(|()| vec![]),
            CtlCmd::UnstuckDriver { bdf } => self.pt_stuck(&bdf, false).map(|()| vec![]),
            CtlCmd::BindHost { bdf, driver } => self.pt_bind_host(&bdf, &driver, pid).map(|()| vec![]),
            CtlCmd::UnbindHost { bdf } => self.pt_unbind_host(&bdf, pid).map(|()| vec![]),
            CtlCmd::EnableVfs { pf, delay } => {
                let g = self.find_pf(&pf)?;
                if !self.gpus[g].vfs.is_empty() || self.gpus[g].vfs_at.is_some() {
                    return Err(format!("VFs already enabled on {pf}"));
                }
                self.gpus[g].vfs_at = Some(now + delay.unwrap_or(self.model.vf_appear_delay_ms));
                self.tick();
                Ok(vec![])
            }
            CtlCmd::DisableVfs { pf } => {
                let g = self.find_pf(&pf)?;
                if self.gpu_busy(g) {
                    return Err("EBUSY: a VF of this PF has an open handle".into());
                }
                self.disable_vfs(g);
                Ok(vec![])
            }
            CtlCmd::ReloadDriver { version, id_shift } => {
                if (0..self.gpus.len()).any(|g| self.gpu_busy(g)) {
                    return Err("EBUSY: a VF has an open handle".into());
                }
                for g in 0..self.gpus.len() {
                    for t in &mut self.gpus[g].table {
                        let n = i64::from(t.id) + id_shift;
                        t.id = u32::try_from(n).map_err(|_| format!("type id {n} out of range"))?;
                    }
                    let had = !self.gpus[g].vfs.is_empty() || self.gpus[g].vfs_at.is_some();
                    self.disable_vfs(g);
                    if had {
                        self.gpus[g].vfs_at = Some(now + self.model.vf_appear_delay_ms);
                    }
                }
                self.driver_version = version;
                self.tick();
                Ok(vec![])
            }
            CtlCmd::Override { path, content, absent } => {
                let pattern = pattern(&path)?;
                self.overrides.retain(|o| o.path != path);
                self.overrides.push(Override { path, pattern, content: if absent { None } else { content } });
                Ok(vec![])
            }
            CtlCmd::Unoverride { path } => {
                let before = self.overrides.len();
                self.overrides.retain(|o| o.path != path);
                if before == self.overrides.len() {
                    return Err(format!("no override for {path}"));
                }
                Ok(vec![])
            }
            CtlCmd::Reboot { vf_delay } => {
                self.boot_id = uuid::Uuid::new_v4().to_string();
                self.overrides.clear();
                self.boot(vf_delay.unwrap_or(self.model.vf_appear_delay_ms));
                Ok(vec![("boot_id".into(), Value::String(self.boot_id.clone()).to_string())])
            }
        }
    }

    // ---- dump ----------------------------------------------------------------------------

    /// The state dump of §10.6.
    pub fn dump(&self) -> Dump {
        let now = self.now();
        let handles_of = |devs: &[DevRef]| -> Vec<HandleDump> {
            self.handles
                .values()
                .filter(|h| matches!(&h.kind, FileKind::Node(d) if devs.contains(d)))
                .map(|h| HandleDump { pid: h.pid, node: display(&h.path), since_ms: h.since })
                .collect()
        };
        let busy = |until: u64| (until > now).then_some(until);
        let gpus = self
            .gpus
            .iter()
            .enumerate()
            .map(|(g, gpu)| {
                let fbs = self.active_fbs(g);
                GpuDump {
                    bdf: gpu.model.bdf.clone(),
                    numvfs: gpu.vfs.len() as u32,
                    vfs_pending_until_ms: gpu.vfs_at,
                    active_fb_mib: fbs.first().copied(),
                    vfs: gpu
                        .vfs
                        .iter()
                        .map(|v| VfDump {
                            bdf: v.bdf.clone(),
                            group: v.group,
                            cdev: v.cdev.map(|c| format!("vfio{c}")),
                            type_id: v.type_id,
                            name: self.type_def(g, v.type_id).map(|t| t.name.clone()),
                            params: v.params.clone(),
                            wedged: v.wedged,
                            broken: v.broken,
                            busy_until_ms: busy(v.busy_until),
                            release_delay_ms: self.release_delay(&v.bdf),
                            handles: handles_of(&[DevRef::VfGroup(v.uid), DevRef::VfCdev(v.uid)]),
                            creatable: self.vf_catalog(v.uid).iter().map(|t| t.id).collect(),
                        })
                        .collect(),
                }
            })
            .collect();
        let mdevs = self
            .mdevs
            .iter()
            .map(|m| {
                let g = self.vf_pos(m.parent).map(|p| p.0);
                MdevDump {
                    uuid: m.uuid.clone(),
                    parent: m.parent_bdf.clone(),
                    type_id: m.type_id,
                    name: g.and_then(|g| self.type_def(g, m.type_id)).map(|t| t.name.clone()),
                    group: m.group,
                    foreign: m.foreign,
                    params: m.params.clone(),
                    busy_until_ms: busy(m.busy_until),
                    handles: handles_of(&[DevRef::MdevGroup(m.uuid.clone())]),
                }
            })
            .collect();
        let other_handles = handles_of(&[DevRef::Container]);
        let passthrough = self.pt_dump(&handles_of);
        Dump {
            boot_id: self.boot_id.clone(),
            driver_version: self.driver_version.clone(),
            framework: self.model.framework.as_str(),
            t_ms: now,
            gpus,
            mdevs,
            passthrough,
            container_handles: other_handles,
            faults: self
                .faults
                .iter()
                .map(|f| FaultDump {
                    kind: f.kind,
                    path: f.path.clone(),
                    errno: (f.errno != 0).then(|| errno_name(f.errno)),
                    remaining: f.remaining,
                    ms: (f.kind == FaultKind::DelayWrite).then_some(f.ms),
                })
                .collect(),
            overrides: self
                .overrides
                .iter()
                .map(|o| OverrideDump { path: o.path.clone(), content: o.content.clone(), absent: o.content.is_none() })
                .collect(),
            log: self.log.clone(),
        }
    }
}

/// State dump (§10.6); fields serialise in declaration order.
#[derive(Debug, Serialize)]
pub struct Dump {
    /// Current boot id.
    pub boot_id: String,
    /// Current driver version.
    pub driver_version: String,
    /// `vendor-vfio`, `mdev` or `passthrough`.
    pub framework: &'static str,
    /// Now, in ms since start.
    pub t_ms: u64,
    /// GPUs.
    pub gpus: Vec<GpuDump>,
    /// Mdevs.
    pub mdevs: Vec<MdevDump>,
    /// Passthrough GPUs.
    pub passthrough: Vec<PtDump>,
    /// Handles on `dev/vfio/vfio`.
    pub container_handles: Vec<HandleDump>,
    /// Pending faults.
    pub faults: Vec<FaultDump>,
    /// Active overrides.
    pub overrides: Vec<OverrideDump>,
    /// Every write and device-node open.
    pub log: Vec<LogEntry>,
}

/// One GPU in the dump.
#[derive(Debug, Serialize)]
pub struct GpuDump {
    /// PF address.
    pub bdf: String,
    /// Current number of VFs.
    pub numvfs: u32,
    /// VFs appear at this time (ms), if pending.
    pub vfs_pending_until_ms: Option<u64>,
    /// Framebuffer size of the GPU's vGPUs (equal-size mode), `null` if none.
    pub active_fb_mib: Option<u64>,
    /// VFs.
    pub vfs: Vec<VfDump>,
}

/// One VF in the dump.
#[derive(Debug, Serialize)]
pub struct VfDump {
    /// Address.
    pub bdf: String,
    /// IOMMU group.
    pub group: u32,
    /// `vfio<N>` or `null`.
    pub cdev: Option<String>,
    /// Type id, 0 for none.
    #[serde(rename = "type")]
    pub type_id: u32,
    /// Type name or `null`.
    pub name: Option<String>,
    /// `vgpu_params`.
    pub params: String,
    /// `wedge` flag.
    pub wedged: bool,
    /// Broken by a forbidden operation.
    pub broken: bool,
    /// End of the teardown lag (ms), or `null`.
    pub busy_until_ms: Option<u64>,
    /// Teardown lag used for this VF.
    pub release_delay_ms: u64,
    /// Open device-node handles.
    pub handles: Vec<HandleDump>,
    /// Ids in the VF's catalog now.
    pub creatable: Vec<u32>,
}

/// One mdev in the dump.
#[derive(Debug, Serialize)]
pub struct MdevDump {
    /// UUID.
    pub uuid: String,
    /// Parent VF.
    pub parent: String,
    /// Type id.
    #[serde(rename = "type")]
    pub type_id: u32,
    /// Type name.
    pub name: Option<String>,
    /// IOMMU group.
    pub group: u32,
    /// Created by `ctl create-mdev`.
    pub foreign: bool,
    /// `nvidia/vgpu_params`.
    pub params: String,
    /// End of the teardown lag (ms), or `null`.
    pub busy_until_ms: Option<u64>,
    /// Open handles.
    pub handles: Vec<HandleDump>,
}

/// One open device-node handle.
#[derive(Debug, Serialize)]
pub struct HandleDump {
    /// Pid from the FUSE open request.
    pub pid: u32,
    /// Node path, e.g. `dev/vfio/41`.
    pub node: String,
    /// Open time (ms since start).
    pub since_ms: u64,
}

/// One pending fault.
#[derive(Debug, Serialize)]
pub struct FaultDump {
    /// Kind.
    pub kind: FaultKind,
    /// Path or glob.
    pub path: String,
    /// Errno name, `null` for delays.
    pub errno: Option<String>,
    /// Remaining count, `null` for always.
    pub remaining: Option<u32>,
    /// Delay (ms) for `delay-write`.
    pub ms: Option<u64>,
}

/// One override.
#[derive(Debug, Serialize)]
pub struct OverrideDump {
    /// Path or glob.
    pub path: String,
    /// Content, `null` if absent.
    pub content: Option<String>,
    /// Whether the path vanishes.
    pub absent: bool,
}
