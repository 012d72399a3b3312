//! Host models: the TOML format of docs/design/host.md §10.2 and the built-in presets of §10.7.
//!
//! A model is either a preset name (see [`PRESETS`]) or TOML text.
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
    /// Whole-GPU passthrough: every GPU is a whole GPU (no VFs), moved to `vfio-pci` on demand.
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
    /// PCI class, e.g. `0x030200`. Default (filled in by [`Model::from_toml`]): `0x030200`
    /// for a GPU with VFs, `0x030000` for a passthrough GPU.
    #[serde(default)]
    pub class: String,
    /// Total framebuffer in MiB.
    #[serde(default = "default_fb")]
    pub framebuffer_mib: u64,
    /// `sriov_totalvfs`; also the number of VFs `enable-vfs` creates. Required for a GPU
    /// with VFs; absent or 0 for a passthrough GPU (see [`GpuModel::vfs`]).
    #[serde(default)]
    pub vf_count: Option<u32>,
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
    /// In a vendor-vfio or mdev model: this GPU is a whole GPU for passthrough (no VFs).
    /// Every GPU of a `framework = "passthrough"` model is one (see [`Model::is_passthrough`]).
    #[serde(default)]
    pub passthrough: bool,
    /// Passthrough GPUs: the driver the GPU function boots on (default `nvidia`).
    #[serde(default)]
    pub boot_driver: Option<String>,
    /// Passthrough GPUs: other functions of the card (same bus and device), in its IOMMU group.
    #[serde(default)]
    pub companions: Vec<Companion>,
    /// Passthrough GPUs: other devices in the GPU's IOMMU group (a bridge, an unrelated NIC).
    #[serde(default)]
    pub group_extra: Vec<GroupExtra>,
}

impl GpuModel {
    /// The number of VFs (`vf_count`, 0 when absent).
    pub fn vfs(&self) -> u32 {
        self.vf_count.unwrap_or(0)
    }
}

/// Another function of a passthrough GPU's card, e.g. its HDMI audio function `.1`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Companion {
    /// PCI function number (0..8), on the GPU's bus and device.
    #[serde(rename = "fn")]
    pub func: u8,
    /// PCI class, e.g. `0x040300`.
    pub class: String,
    /// `vendor:device`; default `10de:0000`.
    #[serde(default)]
    pub pci_id: Option<String>,
    /// Boot driver; default `pcieport` for a bridge (class `0x0604xx`), none otherwise.
    #[serde(default)]
    pub driver: Option<String>,
}

/// A device in a passthrough GPU's IOMMU group that is not a function of the GPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GroupExtra {
    /// Address with domain.
    pub bdf: String,
    /// PCI class, e.g. `0x060400` (a bridge) or `0x020000` (a NIC).
    pub class: String,
    /// `vendor:device`; default `8086:0000`.
    #[serde(default)]
    pub pci_id: Option<String>,
    /// Boot driver; default `pcieport` for a bridge (class `0x0604xx`), none otherwise.
    #[serde(default)]
    pub driver: Option<String>,
}

/// Whether a class (`0x060400`) is a PCI-to-PCI bridge (`0x0604xx`).
pub fn is_bridge_class(class: u32) -> bool {
    class >> 8 == 0x0604
}

/// The boot driver of a companion or group member: the given one, else `pcieport` for a
/// bridge, else none.
pub fn member_boot_driver(class: u32, driver: &Option<String>) -> Option<String> {
    driver.clone().or_else(|| is_bridge_class(class).then(|| "pcieport".to_string()))
}

/// Parses a PCI class `0x030000` (or `030000`) into its 24-bit value.
pub fn parse_class(s: &str) -> anyhow::Result<u32> {
    let h = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    match u32::from_str_radix(h, 16) {
        Ok(v) if !h.is_empty() && v <= 0xff_ffff => Ok(v),
        _ => bail!("bad PCI class {s:?} (want 0xccsspp)"),
    }
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
        vf_count: Some(16),
        vf_offset: 4,
        iommu_group: group,
        type_table: "l40s".into(),
        numa_node: numa,
        passthrough: false,
        boot_driver: None,
        companions: vec![],
        group_extra: vec![],
    }
}

/// An RTX 6000 Ada Generation for passthrough with its HDMI audio function `.1`.
fn pt_gpu(bdf: &str, group: u32, numa: i32, group_extra: Vec<GroupExtra>) -> GpuModel {
    GpuModel {
        bdf: bdf.into(),
        model: "NVIDIA RTX 6000 Ada Generation".into(),
        pci_id: "10de:26b1".into(),
        class: "0x030000".into(),
        framebuffer_mib: 49152,
        vf_count: None,
        vf_offset: default_vf_offset(),
        iommu_group: group,
        type_table: default_table(),
        numa_node: numa,
        passthrough: true,
        boot_driver: None,
        companions: vec![Companion {
            func: 1,
            class: "0x040300".into(),
            pci_id: Some("10de:22ba".into()),
            driver: Some("snd_hda_intel".into()),
        }],
        group_extra,
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
pub const PRESETS: &[&str] = &["l40s-2x16", "h200-1x8", "l40s-mdev", "pt-2", "l40s-pt"];

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
                    vf_count: Some(8),
                    vf_offset: 4,
                    iommu_group: 20,
                    type_table: "h200".into(),
                    numa_node: 0,
                    passthrough: false,
                    boot_driver: None,
                    companions: vec![],
                    group_extra: vec![],
                }],
            )),
            "pt-2" => Some(Model {
                release_delay_ms: 300,
                ..base(
                    name,
                    Framework::Passthrough,
                    vec![
                        pt_gpu(
                            "0000:82:00.0",
                            40,
                            0,
                            vec![GroupExtra {
                                bdf: "0000:80:01.0".into(),
                                class: "0x060400".into(),
                                pci_id: None,
                                driver: Some("pcieport".into()),
                            }],
                        ),
                        pt_gpu("0000:83:00.0", 41, 0, vec![]),
                        pt_gpu(
                            "0000:84:00.0",
                            42,
                            1,
                            vec![GroupExtra {
                                bdf: "0000:85:00.0".into(),
                                class: "0x020000".into(),
                                pci_id: Some("8086:1533".into()),
                                driver: Some("igb".into()),
                            }],
                        ),
                    ],
                )
            }),
            "l40s-pt" => Some(base(
                name,
                Framework::VendorVfio,
                vec![
                    l40s_gpu("0000:41:00.0", 40, 0),
                    pt_gpu("0000:82:00.0", 80, 1, vec![]),
                    pt_gpu("0000:83:00.0", 81, 1, vec![]),
                ],
            )),
            _ => None,
        }
    }

    /// Parses TOML model text and validates it.
    pub fn from_toml(text: &str) -> anyhow::Result<Model> {
        let mut m: Model = toml::from_str(text).context("parsing model TOML")?;
        for i in 0..m.gpu.len() {
            if m.gpu[i].class.is_empty() {
                let pt = m.is_passthrough(&m.gpu[i]);
                m.gpu[i].class = if pt { "0x030000" } else { "0x030200" }.into();
            }
        }
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

    /// Whether `g` is a whole GPU for passthrough: every GPU of a passthrough model, and a
    /// GPU with `passthrough = true` in the others.
    pub fn is_passthrough(&self, g: &GpuModel) -> bool {
        self.framework == Framework::Passthrough || g.passthrough
    }

    /// Checks addresses, tables, classes and the passthrough keys.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.gpu.is_empty() {
            bail!("model has no [[gpu]]");
        }
        for g in &self.gpu {
            parse_bdf(&g.bdf)?;
            parse_pci_id(&g.pci_id)?;
            if self.is_passthrough(g) {
                self.validate_passthrough(g)?;
                continue;
            }
            if g.vf_count.is_none() {
                bail!("gpu {}: missing field `vf_count`", g.bdf);
            }
            if !g.companions.is_empty() || !g.group_extra.is_empty() {
                bail!("gpu {}: companions and group_extra need a passthrough GPU (passthrough = true)", g.bdf);
            }
            if g.boot_driver.as_deref().is_some_and(|d| d != "nvidia") {
                bail!("gpu {}: boot_driver needs a passthrough GPU (a GPU with VFs boots on nvidia)", g.bdf);
            }
            self.table(&g.type_table).ok_or_else(|| anyhow!("gpu {}: unknown type_table {:?}", g.bdf, g.type_table))?;
        }
        self.validate_unique()
    }

    fn validate_passthrough(&self, g: &GpuModel) -> anyhow::Result<()> {
        let b = &g.bdf;
        if g.vfs() != 0 {
            bail!("gpu {b}: a passthrough GPU has no VFs (vf_count must be 0 or absent)");
        }
        parse_class(&g.class).with_context(|| format!("gpu {b}"))?;
        let driver_ok = |d: &str| !d.is_empty() && d != "(null)" && !d.contains(['/', ' ', '\n']);
        if let Some(d) = &g.boot_driver {
            if !driver_ok(d) {
                bail!("gpu {b}: bad boot_driver {d:?}");
            }
        }
        let gpu = parse_bdf(b)?;
        for c in &g.companions {
            if c.func > 7 || c.func == gpu.func {
                bail!("gpu {b}: companion fn {} must be 0..7 and differ from the GPU's function", c.func);
            }
            parse_class(&c.class).with_context(|| format!("gpu {b}: companion fn {}", c.func))?;
            parse_pci_id(c.pci_id.as_deref().unwrap_or("10de:0000"))?;
            if c.driver.as_deref().is_some_and(|d| !driver_ok(d)) {
                bail!("gpu {b}: companion fn {}: bad driver {:?}", c.func, c.driver);
            }
        }
        for e in &g.group_extra {
            parse_bdf(&e.bdf).with_context(|| format!("gpu {b}: group_extra"))?;
            parse_class(&e.class).with_context(|| format!("gpu {b}: group_extra {}", e.bdf))?;
            parse_pci_id(e.pci_id.as_deref().unwrap_or("8086:0000"))?;
            if e.driver.as_deref().is_some_and(|d| !driver_ok(d)) {
                bail!("gpu {b}: group_extra {}: bad driver {:?}", e.bdf, e.driver);
            }
        }
        Ok(())
    }

    /// Passthrough addresses and groups must not collide with any other device or group.
    fn validate_unique(&self) -> anyhow::Result<()> {
        let mut bdfs: Vec<(String, bool)> = Vec::new();
        let mut groups: Vec<(u32, bool)> = Vec::new();
        for g in &self.gpu {
            let pf = parse_bdf(&g.bdf)?;
            let pt = self.is_passthrough(g);
            bdfs.push((pf.to_string(), pt));
            groups.push((g.iommu_group, pt));
            if pt {
                for c in &g.companions {
                    bdfs.push((Bdf { func: c.func, ..pf }.to_string(), true));
                }
                for e in &g.group_extra {
                    bdfs.push((parse_bdf(&e.bdf)?.to_string(), true));
                }
            } else {
                for i in 0..g.vfs() {
                    bdfs.push((pf.with_rid(pf.rid() + g.vf_offset + i).to_string(), false));
                    groups.push((g.iommu_group + 1 + i, false));
                }
            }
        }
        for (i, (b, pt)) in bdfs.iter().enumerate() {
            if bdfs[..i].iter().any(|(o, opt)| o == b && (*pt || *opt)) {
                bail!("PCI address {b} is used twice");
            }
        }
        for (i, (gr, pt)) in groups.iter().enumerate() {
            if groups[..i].iter().any(|(o, opt)| o == gr && (*pt || *opt)) {
                bail!("IOMMU group {gr} of a passthrough GPU is used twice");
            }
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

    #[test]
    fn passthrough_keys_parse_and_validate() {
        let m = Model::from_toml(
            r#"
framework = "passthrough"
[[gpu]]
bdf = "0000:82:00.0"
class = "0x030000"
iommu_group = 40
vf_count = 0
boot_driver = "nouveau"
companions = [{ fn = 1, class = "0x040300", pci_id = "10de:22ba", driver = "snd_hda_intel" }, { fn = 2, class = "0x0c0330" }]
group_extra = [{ bdf = "0000:80:01.0", class = "0x060400" }, { bdf = "0000:85:00.0", class = "0x020000", driver = "igb" }]
"#,
        )
        .unwrap();
        let g = &m.gpu[0];
        assert!(m.is_passthrough(g));
        assert_eq!(g.companions[1], Companion { func: 2, class: "0x0c0330".into(), pci_id: None, driver: None });
        assert_eq!(
            member_boot_driver(parse_class(&g.group_extra[0].class).unwrap(), &None).as_deref(),
            Some("pcieport")
        );
        assert_eq!(member_boot_driver(0x020000, &None), None);
        // Mixed host: passthrough = true next to a GPU with VFs.
        let mixed = "[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n\
                     [[gpu]]\nbdf = \"0000:82:00.0\"\npassthrough = true\niommu_group = 80\n";
        let m = Model::from_toml(mixed).unwrap();
        assert!(!m.is_passthrough(&m.gpu[0]) && m.is_passthrough(&m.gpu[1]));
    }

    #[test]
    fn passthrough_validation_errors() {
        let bad = |text: &str, want: &str| {
            let e = format!("{:#}", Model::from_toml(text).unwrap_err());
            assert!(e.contains(want), "{e:?} does not contain {want:?}");
        };
        bad("[[gpu]]\nbdf = \"0000:41:00.0\"\niommu_group = 40\n", "missing field `vf_count`");
        bad(
            "framework = \"passthrough\"\n[[gpu]]\nbdf = \"0000:82:00.0\"\nvf_count = 2\niommu_group = 40\n",
            "has no VFs",
        );
        bad(
            "[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\ncompanions = [{ fn = 1, class = \"0x040300\" }]\n",
            "need a passthrough GPU",
        );
        bad(
            "framework = \"passthrough\"\n[[gpu]]\nbdf = \"0000:82:00.0\"\niommu_group = 40\ncompanions = [{ fn = 0, class = \"0x040300\" }]\n",
            "differ from the GPU",
        );
        bad(
            "framework = \"passthrough\"\n[[gpu]]\nbdf = \"0000:82:00.0\"\niommu_group = 40\ngroup_extra = [{ bdf = \"0000:80:01.0\", class = \"bridge\" }]\n",
            "bad PCI class",
        );
        bad(
            "[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n[[gpu]]\nbdf = \"0000:82:00.0\"\npassthrough = true\niommu_group = 42\n",
            "IOMMU group 42",
        );
        bad(
            "framework = \"passthrough\"\n[[gpu]]\nbdf = \"0000:82:00.0\"\niommu_group = 40\n[[gpu]]\nbdf = \"0000:82:00.0\"\niommu_group = 41\n",
            "used twice",
        );
    }
}
