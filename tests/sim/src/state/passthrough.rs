//! Whole-GPU passthrough (docs/design/host.md §7, §10.3 rules 9–10): the PCI functions of
//! passthrough GPUs and of their IOMMU groups, their drivers, `driver_override`, `reset`,
//! `power_state`, `config`, the group node `dev/vfio/<G>` and `dev/nvidia<N>`.
//!
//! Everything here runs under the state mutex, like the rest of [`State`].

use serde::Serialize;

use super::{Errno, HandleDump, State};
use crate::model::{is_bridge_class, member_boot_driver, parse_bdf, parse_class, parse_pci_id, Bdf};
use crate::tree::{DevRef, FileKind, Tree};

/// The driver passthrough functions are moved to.
pub const VFIO_PCI: &str = "vfio-pci";
/// The GPU's default boot driver.
pub const NVIDIA: &str = "nvidia";

/// One passthrough GPU.
#[derive(Debug, Clone)]
pub struct PtGpu {
    /// The GPU function's address.
    pub bdf: String,
    /// Marketing name (`Model:` of the procfs `information` file).
    pub model: String,
    /// The IOMMU group.
    pub group: u32,
    /// `N` of `dev/nvidia<N>`: the index among the model's passthrough GPUs.
    pub minor: u32,
    /// Rule 10 (`wedge`).
    pub wedged: bool,
    /// The group stays busy (teardown lag) until this time.
    pub busy_until: u64,
    /// Successful `reset` writes on the GPU function.
    pub resets: u64,
    /// Indexes (into `State::pcifns`) of the card's functions, the GPU function first.
    pub fns: Vec<usize>,
    /// Indexes of every member of the IOMMU group: the card's functions, then `group_extra`.
    pub members: Vec<usize>,
}

/// One PCI function handled by the passthrough rules: a GPU function, a companion or a
/// `group_extra` device.
#[derive(Debug, Clone)]
pub struct PciFn {
    /// Address.
    pub bdf: String,
    /// `pci<dom>:<bus>` directory under `sys/devices`.
    pub pci_dir: String,
    /// Class as in the model, e.g. `0x030000`.
    pub class: String,
    /// Class value.
    pub class_code: u32,
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// IOMMU group.
    pub group: u32,
    /// `numa_node`.
    pub numa_node: i32,
    /// The driver it boots on, if any.
    pub boot_driver: Option<String>,
    /// The driver it is bound to now, if any.
    pub driver: Option<String>,
    /// `driver_override`, if set.
    pub driver_override: Option<String>,
    /// `stuck-driver`: a probe to the boot driver does nothing.
    pub stuck: bool,
    /// Index of its passthrough GPU (`State::pt`).
    pub gpu: usize,
    /// A function of the GPU's card (the GPU or a companion), not a `group_extra` device.
    pub own: bool,
    /// The card has more than one function (header type bit 7 in `config`).
    pub multifunction: bool,
}

impl PciFn {
    /// Whether this is a PCI-to-PCI bridge (class `0x0604xx`).
    pub fn is_bridge(&self) -> bool {
        is_bridge_class(self.class_code)
    }

    /// The real directory, `sys/devices/pci<dom>:<bus>/<BDF>`.
    pub fn dir(&self) -> String {
        format!("sys/devices/{}/{}", self.pci_dir, self.bdf)
    }
}

fn pci_dir(b: Bdf) -> String {
    format!("pci{:04x}:{:02x}", b.domain, b.bus)
}

/// A stable fake GPU UUID derived from the address (FNV-1a).
fn gpu_uuid(bdf: &str) -> String {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for b in bdf.bytes() {
        h ^= u128::from(b);
        h = h.wrapping_mul(0x0000000001000000000000000000013B);
    }
    let x = format!("{h:032x}");
    format!("GPU-{}-{}-{}-{}-{}", &x[0..8], &x[8..12], &x[12..16], &x[16..20], &x[20..32])
}

impl State {
    /// Builds the passthrough GPUs and functions from the model, all on their boot drivers.
    pub(super) fn boot_pt(&mut self) {
        self.pt.clear();
        self.pcifns.clear();
        let gms: Vec<_> = self.model.gpu.iter().filter(|g| self.model.is_passthrough(g)).cloned().collect();
        for (gi, gm) in gms.iter().enumerate() {
            let Ok(b) = parse_bdf(&gm.bdf) else { continue };
            let mut fns = Vec::new();
            let multifunction = !gm.companions.is_empty();
            let push = |st: &mut State, bdf: Bdf, class: &str, pci_id: &str, boot: Option<String>, own| {
                let (vendor, device) = parse_pci_id(pci_id).unwrap_or((0x10de, 0));
                let boot = boot.or_else(|| member_boot_driver(parse_class(class).unwrap_or(0), &None));
                st.pcifns.push(PciFn {
                    bdf: bdf.to_string(),
                    pci_dir: pci_dir(bdf),
                    class: class.to_string(),
                    class_code: parse_class(class).unwrap_or(0),
                    vendor,
                    device,
                    group: gm.iommu_group,
                    numa_node: gm.numa_node,
                    driver: boot.clone(),
                    boot_driver: boot,
                    driver_override: None,
                    stuck: false,
                    gpu: gi,
                    own,
                    multifunction: own && multifunction,
                });
                st.pcifns.len() - 1
            };
            let boot = Some(gm.boot_driver.clone().unwrap_or_else(|| NVIDIA.to_string()));
            fns.push(push(self, b, &gm.class, &gm.pci_id, boot, true));
            for c in &gm.companions {
                let pci_id = c.pci_id.as_deref().unwrap_or("10de:0000");
                fns.push(push(self, Bdf { func: c.func, ..b }, &c.class, pci_id, c.driver.clone(), true));
            }
            let mut members = fns.clone();
            for e in &gm.group_extra {
                let Ok(eb) = parse_bdf(&e.bdf) else { continue };
                let pci_id = e.pci_id.as_deref().unwrap_or("8086:0000");
                members.push(push(self, eb, &e.class, pci_id, e.driver.clone(), false));
            }
            self.pt.push(PtGpu {
                bdf: b.to_string(),
                model: gm.model.clone(),
                group: gm.iommu_group,
                minor: gi as u32,
                wedged: false,
                busy_until: 0,
                resets: 0,
                fns,
                members,
            });
        }
    }

    // ---- lookups -------------------------------------------------------------------------

    /// The passthrough function or group member with this address.
    pub(super) fn pt_fn(&self, bdf: &str) -> Option<usize> {
        self.pcifns.iter().position(|f| f.bdf == bdf)
    }

    /// The passthrough GPU whose GPU function has this address.
    pub(super) fn pt_gpu(&self, bdf: &str) -> Option<usize> {
        self.pt.iter().position(|p| p.bdf == bdf)
    }

    /// Drivers that exist: `nvidia`, `vfio-pci`, every boot driver and every bound driver.
    pub(super) fn pt_drivers(&self) -> Vec<String> {
        let mut out = vec![NVIDIA.to_string(), VFIO_PCI.to_string()];
        for f in &self.pcifns {
            for d in [&f.boot_driver, &f.driver].into_iter().flatten() {
                if !out.contains(d) {
                    out.push(d.clone());
                }
            }
        }
        out
    }

    fn pt_group_open(&self, g: usize) -> bool {
        self.dev_handles(&DevRef::PtGroup(g)).next().is_some()
    }

    fn pt_group_busy(&self, g: usize) -> bool {
        self.pt_group_open(g) || self.now() < self.pt[g].busy_until
    }

    /// `dev/vfio/<G>` exists: every non-bridge member of the group is on `vfio-pci`.
    pub(super) fn pt_node_present(&self, g: usize) -> bool {
        self.pt[g]
            .members
            .iter()
            .map(|&i| &self.pcifns[i])
            .all(|f| f.is_bridge() || f.driver.as_deref() == Some(VFIO_PCI))
    }

    /// `dev/nvidia<N>` exists: the GPU function is on `nvidia`.
    fn pt_on_nvidia(&self, g: usize) -> bool {
        self.pcifns[self.pt[g].fns[0]].driver.as_deref() == Some(NVIDIA)
    }

    fn fn_wedged(&self, i: usize) -> bool {
        let f = &self.pcifns[i];
        f.own && self.pt[f.gpu].wedged
    }

    // ---- tree ----------------------------------------------------------------------------

    /// Adds the passthrough part of the tree (nothing on a host without passthrough GPUs).
    pub(super) fn build_pt_tree(&self, t: &mut Tree) {
        if self.pt.is_empty() {
            return;
        }
        for d in self.pt_drivers().iter().filter(|d| *d != NVIDIA) {
            t.file(&format!("sys/bus/pci/drivers/{d}/bind"), FileKind::DriverBind(d.clone()), 0o200);
            t.file(&format!("sys/bus/pci/drivers/{d}/unbind"), FileKind::DriverUnbind(d.clone()), 0o200);
        }
        t.dir("proc/driver/nvidia/gpus");
        for (i, f) in self.pcifns.iter().enumerate() {
            let (b, pci, dir) = (&f.bdf, &f.pci_dir, f.dir());
            t.text(&format!("{dir}/vendor"), format!("0x{:04x}\n", f.vendor));
            t.text(&format!("{dir}/device"), format!("0x{:04x}\n", f.device));
            t.text(&format!("{dir}/class"), format!("{}\n", f.class));
            t.text(&format!("{dir}/numa_node"), format!("{}\n", f.numa_node));
            t.link(&format!("{dir}/iommu_group"), format!("../../../kernel/iommu_groups/{}", f.group));
            if let Some(d) = &f.driver {
                t.link(&format!("{dir}/driver"), format!("../../../bus/pci/drivers/{d}"));
                t.link(&format!("sys/bus/pci/drivers/{d}/{b}"), format!("../../../../devices/{pci}/{b}"));
            }
            t.file(&format!("{dir}/driver_override"), FileKind::PtOverride(i), 0o644);
            if f.own {
                t.file(&format!("{dir}/reset"), FileKind::PtReset(i), 0o200);
            }
            t.file(&format!("{dir}/power_state"), FileKind::PtPowerState(i), 0o444);
            t.file(&format!("{dir}/config"), FileKind::PtConfig(i), 0o444);
            t.link(&format!("sys/bus/pci/devices/{b}"), format!("../../../devices/{pci}/{b}"));
            t.link(
                &format!("sys/kernel/iommu_groups/{}/devices/{b}", f.group),
                format!("../../../../devices/{pci}/{b}"),
            );
        }
        for (g, p) in self.pt.iter().enumerate() {
            if self.pt_node_present(g) {
                t.file(&format!("dev/vfio/{}", p.group), FileKind::Node(DevRef::PtGroup(g)), 0o600);
            }
            if self.pt_on_nvidia(g) {
                t.file(&format!("dev/nvidia{}", p.minor), FileKind::Node(DevRef::Nvidia(g)), 0o666);
                t.text(&format!("proc/driver/nvidia/gpus/{}/information", p.bdf), self.pt_information(g));
            }
        }
    }

    /// `proc/driver/nvidia/gpus/<BDF>/information`, in the driver's format.
    fn pt_information(&self, g: usize) -> String {
        let p = &self.pt[g];
        format!(
            "Model: \t\t {}\nIRQ:   \t\t {}\nGPU UUID: \t {}\nVideo BIOS: \t 95.02.18.80.01\nBus Type: \t PCIe\n\
             DMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {}\nDevice Minor: \t {}\n\
             GPU Firmware: \t {}\nGPU Excluded:\t No\n",
            p.model,
            160 + p.minor,
            gpu_uuid(&p.bdf),
            p.bdf,
            p.minor,
            self.driver_version
        )
    }

    // ---- reads ---------------------------------------------------------------------------

    /// Content of a passthrough file, or `None` if `kind` is not one.
    pub(super) fn pt_read(&self, kind: &FileKind) -> Option<Vec<u8>> {
        Some(match kind {
            FileKind::PtOverride(i) => {
                format!("{}\n", self.pcifns[*i].driver_override.as_deref().unwrap_or("(null)")).into_bytes()
            }
            FileKind::PtPowerState(i) => (if self.fn_wedged(*i) { "D3cold\n" } else { "D0\n" }).as_bytes().to_vec(),
            FileKind::PtConfig(i) => self.pt_config(*i),
            _ => return None,
        })
    }

    /// 64 bytes of config space: a type 0 (or bridge type 1) header, or all-ones when wedged.
    fn pt_config(&self, i: usize) -> Vec<u8> {
        if self.fn_wedged(i) {
            return vec![0xff; 64];
        }
        let f = &self.pcifns[i];
        let mut c = vec![0u8; 64];
        c[0..2].copy_from_slice(&f.vendor.to_le_bytes());
        c[2..4].copy_from_slice(&f.device.to_le_bytes());
        c[4..6].copy_from_slice(&0x0006u16.to_le_bytes()); // command: memory + bus master
        c[8] = 0xa1; // revision
        c[9..12].copy_from_slice(&f.class_code.to_le_bytes()[0..3]);
        c[0x0e] = if f.is_bridge() { 0x01 } else { 0x00 } | if f.multifunction { 0x80 } else { 0x00 };
        if !f.is_bridge() {
            c[0x2c..0x2e].copy_from_slice(&f.vendor.to_le_bytes());
            c[0x2e..0x30].copy_from_slice(&f.device.to_le_bytes());
        }
        c[0x3d] = 0x01; // interrupt pin A
        c
    }

    // ---- writes (rules 9 and 10) ---------------------------------------------------------

    /// `drivers/<d>/unbind` of passthrough function `i`.
    pub(super) fn pt_unbind(&mut self, d: &str, i: usize) -> Result<(), Errno> {
        let f = &self.pcifns[i];
        if f.driver.as_deref() != Some(d) {
            return Err(libc::ENODEV);
        }
        if d == VFIO_PCI && self.pt_group_busy(f.gpu) {
            return Err(libc::EBUSY);
        }
        let g = f.gpu;
        if d == NVIDIA && self.pt[g].fns[0] == i && self.dev_handles(&DevRef::Nvidia(g)).next().is_some() {
            return Err(libc::EBUSY);
        }
        self.pcifns[i].driver = None;
        Ok(())
    }

    /// `drivers/<d>/bind` of passthrough function `i`: an explicit bind ignores
    /// `driver_override`. Besides EBUSY for a bound device, the probe itself can fail:
    /// vfio-pci refuses a bridge (EINVAL), and a `stuck-driver` function's boot driver
    /// does not come back (ENODEV).
    pub(super) fn pt_bind(&mut self, d: &str, i: usize) -> Result<(), Errno> {
        let f = &self.pcifns[i];
        if f.driver.is_some() {
            return Err(libc::EBUSY);
        }
        if d == VFIO_PCI && f.is_bridge() {
            return Err(libc::EINVAL);
        }
        if f.stuck && f.boot_driver.as_deref() == Some(d) {
            return Err(libc::ENODEV);
        }
        self.pcifns[i].driver = Some(d.to_string());
        Ok(())
    }

    /// `drivers_probe` of passthrough function `i`.
    pub(super) fn pt_probe(&mut self, i: usize) -> Result<(), Errno> {
        let f = &self.pcifns[i];
        if f.driver.is_some() {
            return Ok(());
        }
        let Some(target) = f.driver_override.clone().or_else(|| f.boot_driver.clone()) else {
            return Ok(());
        };
        let fails = !self.pt_drivers().contains(&target)
            || (target == VFIO_PCI && f.is_bridge())
            || (f.stuck && f.boot_driver.as_deref() == Some(target.as_str()));
        if !fails {
            self.pcifns[i].driver = Some(target);
        }
        Ok(())
    }

    /// `driver_override` of passthrough function `i`: one trailing newline is dropped, an
    /// empty value clears it, and a value with whitespace or longer than 63 bytes is EINVAL.
    pub(super) fn pt_write_override(&mut self, i: usize, value: &str) -> Result<(), Errno> {
        let v = value.strip_suffix('\n').unwrap_or(value);
        if v.len() > 63 || v.chars().any(char::is_whitespace) {
            return Err(libc::EINVAL);
        }
        self.pcifns[i].driver_override = (!v.is_empty()).then(|| v.to_string());
        Ok(())
    }

    /// `reset` of passthrough function `i` (rule 10).
    pub(super) fn pt_reset(&mut self, i: usize, value: &str) -> Result<(), Errno> {
        if value.trim() != "1" {
            return Err(libc::EINVAL);
        }
        let g = self.pcifns[i].gpu;
        if self.fn_wedged(i) {
            return Err(libc::EIO);
        }
        if self.pt_group_open(g) {
            return Err(libc::EBUSY);
        }
        if self.pt[g].fns[0] == i {
            self.pt[g].resets += 1;
        }
        Ok(())
    }

    /// Starts the teardown lag of a passthrough group after its last handle closed.
    pub(super) fn pt_released(&mut self, g: usize) {
        if g < self.pt.len() && !self.pt_group_open(g) {
            let delay = self.release_delay(&self.pt[g].bdf);
            self.pt[g].busy_until = self.now() + delay;
        }
    }

    // ---- control -------------------------------------------------------------------------

    fn find_pt_fn(&self, bdf: &str) -> Result<usize, String> {
        self.pt_fn(bdf).ok_or_else(|| format!("no passthrough function or group member {bdf}"))
    }

    /// `wedge`/`unwedge` of a passthrough GPU; `false` if `dev` is not one.
    pub(super) fn pt_wedge(&mut self, dev: &str, wedge: bool) -> bool {
        match self.pt_gpu(dev) {
            Some(g) => {
                self.pt[g].wedged = wedge;
                true
            }
            None => false,
        }
    }

    /// `stuck-driver` / `unstuck-driver`.
    pub(super) fn pt_stuck(&mut self, bdf: &str, stuck: bool) -> Result<(), String> {
        let i = self.find_pt_fn(bdf)?;
        self.pcifns[i].stuck = stuck;
        Ok(())
    }

    /// `bind-host BDF DRIVER`: a foreign tool binds a function, bypassing the rules.
    pub(super) fn pt_bind_host(&mut self, bdf: &str, driver: &str, pid: u32) -> Result<(), String> {
        let i = self.find_pt_fn(bdf)?;
        if driver.is_empty() || driver.contains(['/', ' ', '\n']) || driver == "(null)" {
            return Err(format!("bad driver name {driver:?}"));
        }
        self.pcifns[i].driver = Some(driver.to_string());
        self.log(pid, "bind-host", &format!("sys/bus/pci/drivers/{driver}/bind"), Some(bdf), Ok(()));
        Ok(())
    }

    /// `unbind-host BDF`: a foreign tool unbinds a function, bypassing the rules.
    pub(super) fn pt_unbind_host(&mut self, bdf: &str, pid: u32) -> Result<(), String> {
        let i = self.find_pt_fn(bdf)?;
        let d = self.pcifns[i].driver.take().ok_or_else(|| format!("{bdf} is not bound to a driver"))?;
        self.log(pid, "unbind-host", &format!("sys/bus/pci/drivers/{d}/unbind"), Some(bdf), Ok(()));
        Ok(())
    }

    // ---- dump ----------------------------------------------------------------------------

    /// The `passthrough` part of the state dump.
    pub(super) fn pt_dump(&self, handles_of: &dyn Fn(&[DevRef]) -> Vec<HandleDump>) -> Vec<PtDump> {
        let now = self.now();
        self.pt
            .iter()
            .enumerate()
            .map(|(g, p)| PtDump {
                bdf: p.bdf.clone(),
                group: p.group,
                model: p.model.clone(),
                minor: p.minor,
                wedged: p.wedged,
                resets: p.resets,
                busy_until_ms: (p.busy_until > now).then_some(p.busy_until),
                handles: handles_of(&[DevRef::PtGroup(g), DevRef::Nvidia(g)]),
                functions: p
                    .members
                    .iter()
                    .map(|&i| {
                        let f = &self.pcifns[i];
                        FnDump {
                            bdf: f.bdf.clone(),
                            class: f.class.clone(),
                            driver: f.driver.clone(),
                            driver_override: f.driver_override.clone(),
                            boot_driver: f.boot_driver.clone(),
                            own: f.own,
                            stuck: f.stuck,
                        }
                    })
                    .collect(),
            })
            .collect()
    }
}

/// One passthrough GPU in the dump; fields serialise in declaration order.
#[derive(Debug, Serialize)]
pub struct PtDump {
    /// The GPU function's address.
    pub bdf: String,
    /// IOMMU group.
    pub group: u32,
    /// Marketing name.
    pub model: String,
    /// `N` of `dev/nvidia<N>`.
    pub minor: u32,
    /// Rule 10 flag.
    pub wedged: bool,
    /// Successful `reset` writes on the GPU function.
    pub resets: u64,
    /// End of the group's teardown lag (ms), or `null`.
    pub busy_until_ms: Option<u64>,
    /// Open handles of `dev/vfio/<group>` and `dev/nvidia<N>`.
    pub handles: Vec<HandleDump>,
    /// Every member of the IOMMU group: the card's functions (the GPU first), then the
    /// `group_extra` devices (`own: false`).
    pub functions: Vec<FnDump>,
}

/// One PCI function in the dump.
#[derive(Debug, Serialize)]
pub struct FnDump {
    /// Address.
    pub bdf: String,
    /// Class, e.g. `0x030000`.
    pub class: String,
    /// Bound driver, `null` when driverless.
    pub driver: Option<String>,
    /// `driver_override`, `null` when unset.
    pub driver_override: Option<String>,
    /// Boot driver, `null` if none.
    pub boot_driver: Option<String>,
    /// A function of the GPU's card (false for `group_extra` devices).
    pub own: bool,
    /// `stuck-driver` flag.
    pub stuck: bool,
}
