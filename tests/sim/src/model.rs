//! Host models: the TOML format of NVIDIA-HOST.md §10.2 and the built-in presets of §10.7.
//!
//! A model is either a preset name (`l40s-2x16`, `h200-1x8`, `l40s-mdev`) or TOML text.
//! Type tables named `l40s` and `h200` are built in, so a small test model may omit
//! `[[type_table]]` and just say `type_table = "l40s"`; a table defined in the TOML replaces
//! the built-in one of the same name.

use anyhow::{anyhow, bail, Context};
use serde::{Deserialize, Serialize};

/// The vGPU framework a simulated host uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Framework {
    /// Vendor-specific VFIO: VFs bound to `nvidia` with a per-VF `nvidia/` directory.
    #[default]
    VendorVfio,
    /// Legacy mdev: every VF is an mdev parent.
    Mdev,
    /// Whole-GPU passthrough (not implemented by this simulator yet).
    Passthrough,
}

impl Framework {
    /// The name used in TOML and in the state dump.
    pub fn as_str(self) -> &'static str {
        match self {
            Framework::VendorVfio => "vendor-vfio",
            Framework::Mdev => "mdev",
            Framework::Passthrough => "passthrough",
        }
    }
}

/// A simulated host (§10.2). Every field but `gpu` has a default.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// Free-form model name.
    #[serde(default)]
    pub name: String,
    /// The framework the driver exposes.
    #[serde(default)]
    pub framework: Framework,
    /// Content of `sys/module/nvidia/version`.
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    /// Whether VFs exist at boot (else `sriov_numvfs` stays 0 until `enable-vfs`).
    #[serde(default = "default_true")]
    pub vfs_at_boot: bool,
    /// VFs appear this many milliseconds after boot or `enable-vfs`.
    #[serde(default)]
    pub vf_appear_delay_ms: u64,
    /// Teardown lag in milliseconds after a device's last handle closes.
    #[serde(default = "default_release_delay")]
    pub release_delay_ms: u64,
    /// PFs get an `nvidia/creatable_vgpu_types` too.
    #[serde(default)]
    pub pf_catalog: bool,
    /// First IOMMU group number used for new mdevs.
    #[serde(default = "default_mdev_group_base")]
    pub mdev_group_base: u32,
    /// The simulator removes an mdev itself 2 s after its last handle closes.
    #[serde(default)]
    pub mdev_self_remove: bool,
    /// The physical GPUs.
    #[serde(default)]
    pub gpu: Vec<GpuModel>,
    /// Type tables referenced by `gpu.type_table`.
    #[serde(default)]
    pub type_table: Vec<TypeTable>,
}

/// One physical GPU (PF) of a model.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuModel {
    /// PF address with domain, e.g. `0000:41:00.0`.
    pub bdf: String,
    /// Marketing name, e.g. `NVIDIA L40S`.
    #[serde(default = "default_gpu_model")]
    pub model: String,
    /// `vendor:device` in hex, e.g. `10de:26b9`.
    #[serde(default = "default_pci_id")]
    pub pci_id: String,
    /// PCI class, e.g. `0x030200`.
    #[serde(default = "default_class")]
    pub class: String,
    /// Total framebuffer in MiB.
    #[serde(default = "default_fb")]
    pub framebuffer_mib: u64,
    /// `sriov_totalvfs`; also the number of VFs `enable-vfs` creates.
    pub vf_count: u32,
    /// VF i has routing id `PF rid + vf_offset + i`.
    #[serde(default = "default_vf_offset")]
    pub vf_offset: u32,
    /// The PF's IOMMU group; VF i gets `iommu_group + 1 + i`.
    pub iommu_group: u32,
    /// Name of the `[[type_table]]` (or built-in table) this GPU uses.
    #[serde(default = "default_table")]
    pub type_table: String,
    /// Content of `numa_node`.
    #[serde(default)]
    pub numa_node: i32,
    /// Passthrough only; accepted and ignored.
    #[serde(default)]
    pub companions: Vec<toml::Value>,
    /// Passthrough only; accepted and ignored.
    #[serde(default)]
    pub group_extra: Vec<toml::Value>,
}

/// A named list of vGPU types.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TypeTable {
    /// Table name, referenced by `gpu.type_table`.
    pub name: String,
    /// Types in catalog order.
    pub types: Vec<TypeDef>,
}

/// One vGPU type.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TypeDef {
    /// Decimal type id as written to `current_vgpu_type`.
    pub id: u32,
    /// Full name, e.g. `NVIDIA L40S-2Q`.
    pub name: String,
    /// Framebuffer size in MiB.
    pub fb_mib: u64,
    /// Maximum instances per GPU.
    pub max: u32,
}

fn default_driver_version() -> String {
    "580.82.07".into()
}
fn default_true() -> bool {
    true
}
fn default_release_delay() -> u64 {
    1000
}
fn default_mdev_group_base() -> u32 {
    300
}
fn default_gpu_model() -> String {
    "NVIDIA L40S".into()
}
fn default_pci_id() -> String {
    "10de:26b9".into()
}
fn default_class() -> String {
    "0x030200".into()
}
fn default_fb() -> u64 {
    49152
}
fn default_vf_offset() -> u32 {
    4
}
fn default_table() -> String {
    "l40s".into()
}

fn t(id: u32, name: &str, fb_mib: u64, max: u32) -> TypeDef {
    TypeDef { id, name: name.into(), fb_mib, max }
}

/// The built-in type tables (`l40s`, `h200`) of §10.7.
pub fn builtin_tables() -> Vec<TypeTable> {
    vec![
        TypeTable {
            name: "l40s".into(),
            types: vec![
                t(1147, "NVIDIA L40S-1Q", 1024, 32),
                t(1148, "NVIDIA L40S-2Q", 2048, 24),
                t(1150, "NVIDIA L40S-4Q", 4096, 12),
                t(1152, "NVIDIA L40S-8Q", 8192, 6),
                t(1153, "NVIDIA L40S-12Q", 12288, 4),
                t(1154, "NVIDIA L40S-16Q", 16384, 3),
                t(1156, "NVIDIA L40S-24Q", 24576, 2),
                t(1159, "NVIDIA L40S-48Q", 49152, 1),
            ],
        },
        TypeTable {
            name: "h200".into(),
            types: vec![
                t(1428, "NVIDIA H200X-141C", 144384, 1),
                t(1427, "NVIDIA H200X-70C", 71680, 2),
                t(1426, "NVIDIA H200X-35C", 35840, 4),
                t(1424, "NVIDIA H200X-17C", 17408, 8),
                t(1420, "NVIDIA H200X-4C", 4096, 32),
            ],
        },
    ]
}

fn l40s_gpu(bdf: &str, group: u32, numa: i32) -> GpuModel {
    GpuModel {
        bdf: bdf.into(),
        model: "NVIDIA L40S".into(),
        pci_id: "10de:26b9".into(),
        class: "0x030200".into(),
        framebuffer_mib: 49152,
        vf_count: 16,
        vf_offset: 4,
        iommu_group: group,
        type_table: "l40s".into(),
        numa_node: numa,
        companions: vec![],
        group_extra: vec![],
    }
}

fn base(name: &str, framework: Framework, gpu: Vec<GpuModel>) -> Model {
    Model {
        name: name.into(),
        framework,
        driver_version: default_driver_version(),
        vfs_at_boot: true,
        vf_appear_delay_ms: 0,
        release_delay_ms: default_release_delay(),
        pf_catalog: false,
        mdev_group_base: default_mdev_group_base(),
        mdev_self_remove: false,
        gpu,
        type_table: vec![],
    }
}

/// Names of the presets [`Model::preset`] knows.
pub const PRESETS: &[&str] = &["l40s-2x16", "h200-1x8", "l40s-mdev"];

impl Model {
    /// A preset of §10.7, or `None` for an unknown name.
    pub fn preset(name: &str) -> Option<Model> {
        let l40s2 = || vec![l40s_gpu("0000:41:00.0", 40, 0), l40s_gpu("0001:81:00.0", 60, 1)];
        match name {
            "l40s-2x16" => Some(base(name, Framework::VendorVfio, l40s2())),
            "l40s-mdev" => Some(base(name, Framework::Mdev, l40s2())),
            "h200-1x8" => Some(base(
                name,
                Framework::VendorVfio,
                vec![GpuModel {
                    bdf: "0000:18:00.0".into(),
                    model: "NVIDIA H200".into(),
                    pci_id: "10de:2335".into(),
                    class: "0x030200".into(),
                    framebuffer_mib: 144384,
                    vf_count: 8,
                    vf_offset: 4,
                    iommu_group: 20,
                    type_table: "h200".into(),
                    numa_node: 0,
                    companions: vec![],
                    group_extra: vec![],
                }],
            )),
            _ => None,
        }
    }

    /// Parses TOML model text and validates it.
    pub fn from_toml(text: &str) -> anyhow::Result<Model> {
        let m: Model = toml::from_str(text).context("parsing model TOML")?;
        m.validate()?;
        Ok(m)
    }

    /// Resolves a `--model` argument: a preset name, or else a path to a TOML file.
    pub fn load(arg: &str) -> anyhow::Result<Model> {
        if let Some(m) = Model::preset(arg) {
            return Ok(m);
        }
        let text = std::fs::read_to_string(arg)
            .with_context(|| format!("{arg:?} is neither a preset ({PRESETS:?}) nor a readable model file"))?;
        Model::from_toml(&text)
    }

    /// Looks up a type table by name: the model's own first, then the built-ins.
    pub fn table(&self, name: &str) -> Option<TypeTable> {
        self.type_table
            .iter()
            .find(|t| t.name == name)
            .cloned()
            .or_else(|| builtin_tables().into_iter().find(|t| t.name == name))
    }

    /// Checks addresses, tables and the framework.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.framework == Framework::Passthrough {
            bail!("framework \"passthrough\" is not implemented by this simulator");
        }
        if self.gpu.is_empty() {
            bail!("model has no [[gpu]]");
        }
        for g in &self.gpu {
            parse_bdf(&g.bdf)?;
            parse_pci_id(&g.pci_id)?;
            self.table(&g.type_table).ok_or_else(|| anyhow!("gpu {}: unknown type_table {:?}", g.bdf, g.type_table))?;
        }
        Ok(())
    }
}

/// A parsed PCI address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bdf {
    /// PCI domain.
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number (0..32).
    pub dev: u8,
    /// Function number (0..8).
    pub func: u8,
}

impl Bdf {
    /// Routing id: `bus << 8 | dev << 3 | func`.
    pub fn rid(self) -> u32 {
        (u32::from(self.bus) << 8) | (u32::from(self.dev) << 3) | u32::from(self.func)
    }

    /// The address with the same domain and the given routing id.
    pub fn with_rid(self, rid: u32) -> Bdf {
        Bdf { domain: self.domain, bus: ((rid >> 8) & 0xff) as u8, dev: ((rid >> 3) & 31) as u8, func: (rid & 7) as u8 }
    }
}

impl std::fmt::Display for Bdf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.dev, self.func)
    }
}

/// Parses `dddd:bb:dd.f`.
pub fn parse_bdf(s: &str) -> anyhow::Result<Bdf> {
    let err = || anyhow!("bad PCI address {s:?} (want dddd:bb:dd.f)");
    let (dom, rest) = s.split_once(':').ok_or_else(err)?;
    let (bus, rest) = rest.split_once(':').ok_or_else(err)?;
    let (dev, func) = rest.split_once('.').ok_or_else(err)?;
    let p = |x: &str, radix| u32::from_str_radix(x, radix).map_err(|_| err());
    let (dom, bus, dev, func) = (p(dom, 16)?, p(bus, 16)?, p(dev, 16)?, p(func, 16)?);
    if bus > 255 || dev > 31 || func > 7 {
        return Err(err());
    }
    Ok(Bdf { domain: dom, bus: bus as u8, dev: dev as u8, func: func as u8 })
}

/// Parses `10de:26b9` into (vendor, device).
pub fn parse_pci_id(s: &str) -> anyhow::Result<(u16, u16)> {
    let (v, d) = s.split_once(':').ok_or_else(|| anyhow!("bad pci_id {s:?} (want vvvv:dddd)"))?;
    Ok((
        u16::from_str_radix(v, 16).with_context(|| format!("bad pci_id {s:?}"))?,
        u16::from_str_radix(d, 16).with_context(|| format!("bad pci_id {s:?}"))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vf_addresses_follow_routing_ids() {
        let pf = parse_bdf("0000:41:00.0").unwrap();
        assert_eq!(pf.with_rid(pf.rid() + 4).to_string(), "0000:41:00.4");
        assert_eq!(pf.with_rid(pf.rid() + 4 + 15).to_string(), "0000:41:02.3");
        let h = parse_bdf("0000:18:00.0").unwrap();
        assert_eq!(h.with_rid(h.rid() + 4 + 7).to_string(), "0000:18:01.3");
    }

    #[test]
    fn presets_validate() {
        for p in PRESETS {
            Model::preset(p).unwrap().validate().unwrap();
        }
    }
}
