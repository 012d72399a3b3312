//! The policy types: inputs the agent sends and answers a plugin returns, for the three
//! kinds `placement`, `hypervisor` and `grace`. Field names are the wire contract
//! (JSON, snake_case).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// Free-form key/values from the create request (e.g. `tenant = "a"`).
pub type Labels = BTreeMap<String, String>;

/// ABI version this SDK implements; `gpuvisor_abi_version()` returns it.
pub const ABI_VERSION: i32 = 1;

/// The policy kinds a plugin can implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Which device a new GPU instance gets (`gpuvisor_placement`).
    Placement,
    /// Which hypervisor runs an instance (`gpuvisor_hypervisor`).
    Hypervisor,
    /// When an eligible stale claim or orphan may be released (`gpuvisor_grace`).
    Grace,
}

impl PolicyKind {
    /// The kind's name as used in manifests and config sections.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Placement => "placement",
            PolicyKind::Hypervisor => "hypervisor",
            PolicyKind::Grace => "grace",
        }
    }

    /// The name of the kind's exported entry point.
    pub fn export_name(self) -> &'static str {
        match self {
            PolicyKind::Placement => "gpuvisor_placement",
            PolicyKind::Hypervisor => "gpuvisor_hypervisor",
            PolicyKind::Grace => "gpuvisor_grace",
        }
    }
}

/// The JSON object `gpuvisor_manifest()` points at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Manifest {
    /// The plugin's name, shown in `plugin.list`, logs and errors (a safe set of
    /// characters; not the name of one of gpuvisor's own plugins).
    pub name: String,
    /// The plugin's version, free-form (e.g. `1.2.0`).
    pub version: String,
    /// The policy kinds the plugin implements (the slot it is configured for must be one).
    pub kinds: Vec<PolicyKind>,
}

/// The reply envelope of every entry point: `{"ok": answer}` or `{"error": "message"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Reply<T> {
    /// The entry point's answer.
    Ok(T),
    /// The call failed: why, one sentence (the agent fails closed, as for a trap).
    Error(String),
}

/// How a GPU is given to an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Framework {
    /// A type id written to an SR-IOV VF's `nvidia/current_vgpu_type` (Linux >= 6.8, vGPU 17+).
    VendorVfio,
    /// A mediated device created from `mdev_supported_types/<type>/create`.
    Mdev,
    /// A whole GPU (and its IOMMU group) bound to `vfio-pci`.
    Passthrough,
}

impl Framework {
    /// The wire name (`vendor_vfio`, `mdev`, `passthrough`).
    pub fn as_str(self) -> &'static str {
        match self {
            Framework::VendorVfio => "vendor_vfio",
            Framework::Mdev => "mdev",
            Framework::Passthrough => "passthrough",
        }
    }
}

// ---------------------------------------------------------------------------------------
// placement

/// Input of `gpuvisor_placement`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PlacementInput {
    /// The instance asking for a device.
    pub request: PlacementRequest,
    /// The managed GPUs and their devices.
    pub inventory: Inventory,
    /// The site's `[plugins.placement.params]` table, `{}` when absent.
    #[serde(default)]
    pub params: Value,
}

/// The instance asking for a device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PlacementRequest {
    /// The instance's UUID (the nil UUID for `placement.dry_run`).
    pub instance_id: String,
    /// The instance's name.
    pub name: String,
    /// The create request's labels (e.g. `tenant`).
    #[serde(default)]
    pub labels: Labels,
    /// How the GPU is given: the host's mode, or `passthrough` for a whole GPU.
    pub framework: Framework,
    /// Canonical profile name, e.g. `L40S-2Q`.
    pub profile: String,
    /// The profile's framebuffer in MiB, `None` when the name does not tell.
    pub framebuffer_mib: Option<u64>,
}

/// Every managed GPU with its devices, as observed under the allocation lock.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Inventory {
    /// Every managed GPU (PF).
    pub gpus: Vec<GpuView>,
}

/// One physical GPU (PF).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GpuView {
    /// The PF's BDF, e.g. `0000:41:00.0`.
    pub address: String,
    /// e.g. `NVIDIA L40S`, `unknown` when not known.
    pub model: String,
    /// The GPU's framebuffer, MiB; `None` when unknown.
    pub framebuffer_mib: Option<u64>,
    /// The PF's NUMA node; `None` when unknown (always on mdev hosts).
    pub numa_node: Option<i32>,
    /// Sum of the framebuffers of the profiles claimed on this GPU (from claims, not sysfs).
    pub claimed_framebuffer_mib: u64,
    /// False when a claimed profile's size is unknown: the load is then a lower bound.
    pub load_known: bool,
    /// VFs (vendor VFIO), mdev parents (mdev), or the GPU itself (passthrough).
    pub devices: Vec<DeviceView>,
}

/// The state of one placeable device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    /// No claim, no type: it can be claimed.
    Free,
    /// Held by a claim (`owner` says whose).
    Claimed,
    /// A non-zero type with no claim (vendor VFIO).
    Dirty,
    /// Marked unhealthy by the agent: never a legal candidate.
    Quarantined,
    /// Its state cannot be read: never a legal candidate.
    Unreadable,
}

/// One VF, mdev parent or passthrough GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DeviceView {
    /// BDF of the VF / parent / GPU.
    pub address: String,
    /// Whether it can be handed out now.
    pub state: DeviceState,
    /// The type id it holds now (vendor VFIO `current_vgpu_type`), `None` for `0`/unknown.
    pub current_type: Option<u32>,
    /// Canonical profile names this device can create now.
    #[serde(default)]
    pub creatable: Vec<String>,
    /// The owner, for claimed devices.
    pub owner: Option<DeviceOwner>,
}

/// The instance that claims a device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DeviceOwner {
    /// Empty when even the owner's id is unknown (its claim record cannot be read).
    pub instance_id: String,
    /// The profile the owner claimed (`None` when its claim cannot be read).
    pub profile: Option<String>,
    /// The owner's labels, kept with the claim (empty when `labels_known` is `false`).
    #[serde(default)]
    pub labels: Labels,
    /// `false` when the owner's labels are unknown (its claim or instance record cannot be
    /// read): `labels` is then empty, and a rule that separates tenants should treat the
    /// owner as possibly another tenant. Absent in inputs from older agents (= `true`).
    #[serde(default = "yes")]
    pub labels_known: bool,
}

fn yes() -> bool {
    true
}

/// Answer of `gpuvisor_placement`: `{"ranked": [...]}` best first, or `{"reject": "reason"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum PlacementAnswer {
    /// Device addresses (BDFs), best first; the agent keeps only the legal candidates, in
    /// this order.
    Ranked(Vec<String>),
    /// No device should be given: the reason (the request fails with `no_capacity`).
    Reject(String),
}

// ---------------------------------------------------------------------------------------
// hypervisor

/// Input of `gpuvisor_hypervisor`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct HypervisorInput {
    /// The instance to run.
    pub request: HypervisorRequest,
    /// Every hypervisor the agent knows.
    pub hypervisors: Vec<HypervisorInfo>,
    /// The site's `[plugins.hypervisor.params]` table, `{}` when absent.
    #[serde(default)]
    pub params: Value,
}

/// The instance to place on a hypervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct HypervisorRequest {
    /// The instance's name.
    pub name: String,
    /// The create request's labels.
    #[serde(default)]
    pub labels: Labels,
    /// The hypervisor the create request names (`qemu`, `cloud-hypervisor`); `None` when it
    /// names none.
    pub requested_hypervisor: Option<String>,
    /// The GPU framework the instance needs, `None` for a plain instance.
    pub framework: Option<Framework>,
    /// Passthrough GPU addresses.
    #[serde(default)]
    pub devices: Vec<String>,
}

/// What a hypervisor can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Capability {
    /// A vendor-VFIO VF (vGPU).
    VendorVfio,
    /// An mdev (vGPU).
    Mdev,
    /// A whole GPU through VFIO.
    Passthrough,
    /// Standby: the running VM saved to disk and resumed later.
    Standby,
    /// Snapshots of a VM.
    Snapshot,
}

impl Capability {
    /// The capability a GPU framework needs.
    pub fn for_framework(f: Framework) -> Capability {
        match f {
            Framework::VendorVfio => Capability::VendorVfio,
            Framework::Mdev => Capability::Mdev,
            Framework::Passthrough => Capability::Passthrough,
        }
    }
}

/// One hypervisor the agent has.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct HypervisorInfo {
    /// `qemu` or `cloud-hypervisor`.
    pub name: String,
    /// Its binary was found.
    pub available: bool,
    /// What it can carry on this agent.
    pub capabilities: Vec<Capability>,
}

/// Answer of `gpuvisor_hypervisor`: `{"hypervisor": "qemu"}` or `{"reject": "reason"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum HypervisorAnswer {
    /// The hypervisor to run the instance (`qemu` or `cloud-hypervisor`): one the agent
    /// knows and that can carry its GPU.
    Hypervisor(String),
    /// No hypervisor should run it: the reason (the create fails with
    /// `hypervisor_unsupported`).
    Reject(String),
}

// ---------------------------------------------------------------------------------------
// grace

/// Input of `gpuvisor_grace`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GraceInput {
    /// CLOCK_BOOTTIME now, in milliseconds.
    pub now_boottime_ms: u64,
    /// The host's boot id.
    pub boot_id: String,
    /// The eligible items, one decision asked per item.
    pub items: Vec<GraceItem>,
    /// The site's `[plugins.grace.params]` table (e.g. `claim_grace_s`), `{}` when absent.
    #[serde(default)]
    pub params: Value,
}

/// What kind of eligible item is asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum GraceItemKind {
    /// A claim whose owner is provably dead or absent.
    StaleClaim,
    /// A VF holding a type with no claim.
    OrphanVf,
    /// One of gpuvisor's own mdevs that no claim names.
    OrphanMdev,
}

/// One item the native checks found eligible (owner provably dead or absent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GraceItem {
    /// What kind of item it is.
    pub kind: GraceItemKind,
    /// The VF or mdev parent BDF, or the mdev's UUID.
    pub device: String,
    /// How the device is handed out.
    pub framework: Framework,
    /// The owning instance, for a stale claim; `None` for an orphan.
    pub owner: Option<GraceOwner>,
    /// Age of the claim on CLOCK_BOOTTIME (same boot only), ms.
    pub claimed_age_ms: Option<u64>,
    /// How long the orphan has been seen dirty/unclaimed, ms.
    pub dirty_age_ms: Option<u64>,
    /// The claim was made in the current boot.
    pub same_boot: bool,
    /// Releases of this item that failed so far (0 when none).
    #[serde(default)]
    pub release_attempts: u32,
    /// The last release error, if any.
    pub last_error: Option<String>,
}

/// The owning instance of a stale claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GraceOwner {
    /// The instance's UUID.
    pub instance_id: String,
    /// The instance's state (`starting`, `running`, `stopped`, ...), `absent` when gone.
    pub state: String,
    /// The instance's labels.
    #[serde(default)]
    pub labels: Labels,
    /// The instance's record still names a VMM (one the agent found dead); `false`: it
    /// names none (e.g. a start that failed before its VMM was recorded).
    pub vmm_identity_recorded: bool,
}

/// Answer of `gpuvisor_grace`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GraceAnswer {
    /// One decision per item asked about (an item with none is kept).
    pub decisions: Vec<GraceDecision>,
}

/// Release now or keep one item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GraceDecision {
    /// The item's `device`, as in the input.
    pub device: String,
    /// Release now, or keep.
    pub action: GraceAction,
    /// When to look again, ms (advisory: shown in the pass report; the agent's next pass
    /// runs on its own schedule).
    pub recheck_after_ms: Option<u64>,
    /// Why (advisory: shown as `grace: <reason>` in the pass report's `kept` list).
    #[serde(default)]
    pub reason: String,
}

/// `release` or `keep`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum GraceAction {
    /// Release the item now (through the agent's native release path, one attempt per
    /// pass).
    Release,
    /// Keep it this pass.
    Keep,
}

// ---------------------------------------------------------------------------------------
// profile names

/// The canonical profile name: the last whitespace-separated token of a sysfs name
/// (`NVIDIA L40S-2Q` → `L40S-2Q`; `GRID P40-2Q` → `P40-2Q`). Source: docs/design/host.md §3.5.
pub fn canonical_profile(name: &str) -> &str {
    name.split_whitespace().last().unwrap_or("")
}

/// Framebuffer size in MiB parsed from a vendor-VFIO profile name of the form
/// `<board>-[<slices>-]<GiB><series>` with series A, B, C or Q; `0` GiB means 512 MiB.
/// Returns `None` when the name does not parse ("unknown", never 0).
/// Source: docs/design/host.md §3.5 and NVIDIA's vGPU type tables.
pub fn profile_framebuffer_mib(name: &str) -> Option<u64> {
    let canon = canonical_profile(name);
    let last = canon.rsplit('-').next()?;
    if canon.len() == last.len() {
        return None; // no '-' at all
    }
    let series = last.chars().last()?;
    if !matches!(series.to_ascii_uppercase(), 'A' | 'B' | 'C' | 'Q') {
        return None;
    }
    let digits = &last[..last.len() - 1];
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let gib: u64 = digits.parse().ok()?;
    Some(if gib == 0 { 512 } else { gib.checked_mul(1024)? })
}

/// True when a user's profile request names the given sysfs/canonical name: compared on
/// the canonical form, ASCII case-insensitively (`l40s-2q` matches `NVIDIA L40S-2Q`).
pub fn profile_matches(requested: &str, name: &str) -> bool {
    canonical_profile(requested).eq_ignore_ascii_case(canonical_profile(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framebuffer_sizes_follow_the_name() {
        assert_eq!(profile_framebuffer_mib("NVIDIA L40S-2Q"), Some(2048));
        assert_eq!(profile_framebuffer_mib("L40S-48Q"), Some(49152));
        assert_eq!(profile_framebuffer_mib("NVIDIA L40S-0Q"), Some(512));
        assert_eq!(profile_framebuffer_mib("NVIDIA H200X-141C"), Some(144384));
        assert_eq!(profile_framebuffer_mib("NVIDIA A100-1-5C"), Some(5120));
        assert_eq!(profile_framebuffer_mib("NVIDIA L40S-Pro"), None);
        assert_eq!(profile_framebuffer_mib("NVIDIA L40S"), None);
        assert_eq!(profile_framebuffer_mib(""), None);
    }

    #[test]
    fn profiles_match_with_or_without_prefix_in_any_case() {
        assert!(profile_matches("l40s-2q", "NVIDIA L40S-2Q"));
        assert!(profile_matches("NVIDIA L40S-2Q", "L40S-2Q"));
        assert!(!profile_matches("L40S-2", "NVIDIA L40S-2Q"));
    }

    #[test]
    fn answers_use_the_documented_wire_shape() {
        let a = PlacementAnswer::Ranked(vec!["0000:41:00.4".into()]);
        assert_eq!(serde_json::to_string(&a).unwrap(), r#"{"ranked":["0000:41:00.4"]}"#);
        let r: Reply<HypervisorAnswer> = Reply::Ok(HypervisorAnswer::Hypervisor("qemu".into()));
        assert_eq!(serde_json::to_string(&r).unwrap(), r#"{"ok":{"hypervisor":"qemu"}}"#);
    }
}
