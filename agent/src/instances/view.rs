//! The typed views the core returns: instances, GPUs, resources, dry runs, reconcile
//! reports, health, and the small results of the other methods. `rpc` serialises them; the
//! CLI decodes the same types; the OpenRPC result schemas are generated from them.
//!
//! Rule: a view never shows unknown as clear — a type that cannot be read is `"unknown"`
//! (never `0`), an unreadable record is listed as unreadable with its path and error, and
//! a VMM whose liveness cannot be decided is shown with `liveness: "unknown"` and why.

use super::inventory::{Observation, TypeReading};
use super::Manager;
use crate::devices::{vendor_vfio, HostMode};
use crate::error::ApiError;
use crate::host::proc::Liveness;
use crate::store::{Claim, ClaimState, Framework, HealthRecord, InstanceRecord, InstanceState, Labels, Listing};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// A type id as read now, or `"unknown"` when it cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum TypeValue {
    /// The id (`0`: no vGPU).
    Id(u32),
    /// Always the string `"unknown"`.
    Unknown(String),
}

impl TypeValue {
    fn of(r: &TypeReading) -> TypeValue {
        match r {
            TypeReading::Id(i) => TypeValue::Id(*i),
            TypeReading::Unknown(_) => TypeValue::Unknown("unknown".into()),
        }
    }
}

impl std::fmt::Display for TypeValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TypeValue::Id(i) => write!(f, "{i}"),
            TypeValue::Unknown(_) => f.write_str("unknown"),
        }
    }
}

/// The VMM of an instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct VmmView {
    pub pid: i32,
    pub start_time: u64,
    pub boot_id: String,
    /// The PID namespace the pid was recorded in.
    pub pid_namespace: Option<u64>,
    pub control_socket: String,
    /// `alive`, or `unknown` when it cannot be decided from here.
    pub liveness: String,
    /// Why the liveness is unknown.
    pub reason: Option<String>,
    /// `instance.get` only: the VM state as the VMM reports it now (QEMU `query-status`,
    /// e.g. `running`; Cloud Hypervisor `vm.info`, e.g. `Running`). Absent from lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_state: Option<String>,
    /// `instance.get` only: why the VMM could not be asked for its state (within 1 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_state_error: Option<String>,
}

/// The GPU of an instance: its profile, and what its claim says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuAssignment {
    /// The vGPU profile, or `passthrough` for a whole GPU.
    pub profile: Option<String>,
    /// The passthrough GPU the request named (kept across restarts), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passthrough_address: Option<String>,
    /// Passthrough: every function of the claimed group, its driver now and the one it
    /// goes back to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub functions: Vec<FunctionView>,
    pub framework: Option<Framework>,
    /// The claimed device (VF / mdev parent).
    pub device: Option<String>,
    /// Its GPU (PF).
    pub gpu: Option<String>,
    /// The sysfs path of the device (VF, or the mdev).
    pub device_path: Option<String>,
    pub mdev_uuid: Option<String>,
    /// The type id configured at claim time.
    pub type_id: Option<u32>,
    /// The VF's type now (vendor VFIO; `"unknown"` when unreadable).
    pub current_type: Option<TypeValue>,
    pub claimed_at: Option<String>,
    pub claim_state: Option<ClaimState>,
    pub release_pending: bool,
    pub last_error: Option<String>,
    /// The VF holds another type than the claim's (a foreign write under the VM).
    pub type_mismatch: Option<String>,
    /// A claim file that may be this instance's cannot be read (`path: error`).
    pub claim_unreadable: Option<String>,
}

/// One instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InstanceView {
    pub id: String,
    pub name: String,
    pub image: String,
    pub hypervisor: crate::hypervisor::HypervisorKind,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub labels: Labels,
    pub state: InstanceState,
    pub created_at: String,
    pub last_error: Option<String>,
    /// The VMM, when one is recorded and not provably dead.
    pub vmm: Option<VmmView>,
    pub serial_log: String,
    /// Where the console log's older part goes when `serial_log` is rotated
    /// (`console_log_max_bytes`): in the instance directory, which the VMM never sees.
    pub serial_log_rotated: String,
    /// The uid (and gid) the instance's VMM runs under, from `vmm_ids`; absent before its
    /// first start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm_id: Option<u32>,
    /// The serial console's Unix socket (`gpuvisor console`), for QEMU instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub console_socket: Option<String>,
    pub gpu: Option<GpuAssignment>,
    /// When the VMM dies without a stop: `no`, `on-failure`, `always`.
    pub restart: crate::store::RestartPolicy,
    /// Started again when the agent starts after a host reboot.
    pub autostart: bool,
    /// The restarts under the policy within `restart_window_s`.
    pub restarts: RestartView,
    /// Things the answer could not check (e.g. unreadable claim records).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// In the answer of the stop that gave its device back: the device was given back but
    /// quarantined by that release (e.g. a passthrough GPU whose reset failed) — it is not
    /// handed out again until an operator clears the mark.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_device_quarantined: Option<QuarantinedDevice>,
    /// The virtio-net NICs, in guest order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<NicView>,
    /// The cloud-init NoCloud seed attached to the VM (an instance with NICs or
    /// `cloud_init`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<SeedView>,
    /// How the VM boots: `direct`, `bios`, `uefi`.
    #[serde(default)]
    pub boot: crate::store::BootMode,
    /// The instance's disk overlay, when its image has a disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<InstanceDiskView>,
}

/// One NIC of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NicView {
    /// `user` or `bridge`.
    pub mode: String,
    /// `user` NICs: the host port forwards.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forwards: Vec<crate::network::Forward>,
    /// `bridge` NICs: the host bridge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// Its MAC, derived from the instance id and the NIC index (stable across restarts).
    pub mac: String,
    /// `bridge` NICs: the tap gpuvisor creates for it while the VM runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap: Option<String>,
}

/// The cloud-init seed of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SeedView {
    /// `<instance dir>/seed.iso` (built at start).
    pub path: String,
    /// Bytes of `cloud_init.user_data` (0: none given).
    pub user_data_bytes: u64,
    /// Bytes of `cloud_init.network_config` (0: none given).
    pub network_config_bytes: u64,
}

/// The disk of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct InstanceDiskView {
    /// `<instance dir>/disk.qcow2`: the instance's qcow2 overlay on its image's disk.
    pub overlay: String,
    /// The overlay exists (it is made at create, and again on start when missing).
    pub exists: bool,
    /// The size asked for at create, GiB; `None`: the image disk's size.
    pub disk_gib: Option<u64>,
}

/// A record that exists but cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UnreadableRecord {
    pub path: String,
    /// What the file name says it is about (an instance id, a device).
    pub key: String,
    pub error: String,
}

impl From<&crate::store::Unreadable> for UnreadableRecord {
    fn from(u: &crate::store::Unreadable) -> Self {
        UnreadableRecord { path: u.path.display().to_string(), key: u.key.clone(), error: u.error.clone() }
    }
}

/// `instance.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InstanceList {
    pub instances: Vec<InstanceView>,
    /// Instance records that cannot be read (listed, never hidden).
    pub unreadable: Vec<UnreadableRecord>,
}

/// A device an operation gave back and quarantined (`released_device_quarantined`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct QuarantinedDevice {
    pub device: String,
    /// The mark's reason, e.g. `reset_failed`.
    pub reason: String,
    pub detail: String,
}

/// A health mark.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HealthMark {
    pub reason: String,
    pub detail: String,
    pub at: String,
    /// `false`: suspect only.
    pub quarantined: bool,
}

impl From<&HealthRecord> for HealthMark {
    fn from(h: &HealthRecord) -> Self {
        HealthMark { reason: h.reason.clone(), detail: h.detail.clone(), at: h.at.clone(), quarantined: h.quarantined }
    }
}

/// The claim of a device, as `gpu.list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ClaimView {
    /// The owning instance (`null` for an external owner).
    pub instance_id: Option<String>,
    pub instance_name: Option<String>,
    /// The claim's owner: `{"kind": "instance", "id"}` or an external owner
    /// (`{"kind": "resource_claim", "namespace", "name", "uid"}`); `null` when unreadable.
    pub owner: Option<crate::store::Owner>,
    pub profile: Option<String>,
    pub type_id: Option<u32>,
    pub mdev_uuid: Option<String>,
    pub state: Option<ClaimState>,
    pub last_error: Option<String>,
    /// The claim file cannot be read (`path: error`): the device is blocked.
    pub unreadable: Option<String>,
}

/// The state of a device in `gpu.list` (the plugins' `DeviceState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeviceStateView {
    Free,
    Claimed,
    Dirty,
    Quarantined,
    Unreadable,
}

impl From<gpuvisor_sdk::DeviceState> for DeviceStateView {
    fn from(s: gpuvisor_sdk::DeviceState) -> Self {
        use gpuvisor_sdk::DeviceState::*;
        match s {
            Free => DeviceStateView::Free,
            Claimed => DeviceStateView::Claimed,
            Dirty => DeviceStateView::Dirty,
            Quarantined => DeviceStateView::Quarantined,
            Unreadable => DeviceStateView::Unreadable,
        }
    }
}

/// One VF or mdev parent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeviceEntry {
    pub address: String,
    pub state: DeviceStateView,
    /// `current_vgpu_type` now (`"unknown"` when it cannot be read).
    pub current_type: TypeValue,
    pub creatable: Vec<String>,
    pub claim: Option<ClaimView>,
    /// Its health mark (`suspect` or quarantined).
    pub quarantine: Option<HealthMark>,
    /// The grace plugin keeps this eligible item past `claim_grace` (its reason).
    pub held_by_policy: Option<String>,
    /// Why its state cannot be read.
    pub unreadable: Option<String>,
    /// The claim names another type than the VF holds now.
    pub type_mismatch: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub catalog_skipped_lines: Vec<String>,
}

/// One GPU (PF).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuEntry {
    pub address: String,
    pub model: String,
    pub framebuffer_mib: Option<u64>,
    /// The GPU's NUMA node (sysfs `numa_node`); `None` when unreadable or none (`-1`).
    pub numa_node: Option<i32>,
    pub claimed_framebuffer_mib: u64,
    /// gpuvisor may touch its devices (`managed_gpus`); unmanaged ones are only reported.
    pub managed: bool,
    /// A GPU-level mark (`gpu_fault`).
    pub health: Option<HealthMark>,
    /// The framework probe failed: this GPU is not usable now.
    pub probe_error: Option<String>,
    pub devices: Vec<DeviceEntry>,
    /// A whole GPU for passthrough (its one device is the GPU itself): its IOMMU group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passthrough: Option<PassthroughGroupView>,
}

/// The IOMMU group of a passthrough GPU as read now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PassthroughGroupView {
    /// `None` when the group cannot be read.
    pub group: Option<u32>,
    /// The GPU's own functions, the GPU first.
    pub functions: Vec<FunctionView>,
    /// PCI bridges in the group (never moved).
    pub bridges: Vec<String>,
    /// Other devices in the group: the GPU cannot be handed out while they are there.
    pub foreign: Vec<String>,
    /// Why a free GPU is not offered (a foreign group member, SR-IOV VFs enabled).
    pub problem: Option<String>,
}

/// The restarts of an instance under its restart policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RestartView {
    /// Restarts tried within `restart_window_s` (a start by hand resets them).
    pub attempts: u32,
    /// When the last one was tried (Unix ms).
    pub last_attempt_unix_ms: Option<u64>,
    /// When the next one is due (Unix ms); `None`: none pending.
    pub due_unix_ms: Option<u64>,
    /// `restart_limit` was reached: it stays stopped until started by hand.
    pub gave_up: bool,
}

/// One function of a passthrough GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FunctionView {
    pub bdf: String,
    /// The driver bound now (`None`: unbound).
    pub driver: Option<String>,
    /// The driver its claim recorded before gpuvisor moved it (claimed GPUs only).
    pub original_driver: Option<String>,
}

/// `gpu.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuList {
    /// `vendor_vfio`, `mdev`, `mixed`, `waiting_for_vfs`, `none`, or `probe_error`.
    pub mode: String,
    pub probe_error: Option<String>,
    pub gpus: Vec<GpuEntry>,
    /// Devices whose state cannot be read, named (those of the GPUs above are also marked
    /// there; others — an unreadable `physfn` link, an mdev whose `mdev_type` link cannot be
    /// read — only here).
    pub unreadable_devices: Vec<UnreadableDeviceView>,
    /// Claim and health records that cannot be read.
    pub unreadable_records: Vec<UnreadableRecord>,
}

/// A device whose state cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UnreadableDeviceView {
    pub address: String,
    pub gpu: Option<String>,
    pub reason: String,
}

/// Device counts of `resources.get` (managed GPUs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DeviceCounts {
    pub total: u64,
    pub claimed: u64,
    pub allocatable: u64,
    pub quarantined: u64,
    pub dirty: u64,
    /// Devices whose type (or catalog) cannot be read, claimed or not.
    pub unreadable: u64,
    /// `creatable_vgpu_types` lines skipped (malformed, or id 0).
    pub catalog_skipped_lines: u64,
}

/// How many more instances of a profile can be placed now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProfileCapacity {
    pub profile: String,
    pub type_id: Option<u32>,
    pub framebuffer_mib: Option<u64>,
    pub placeable: u64,
}

/// `resources.get`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Resources {
    pub mode: String,
    /// vGPU claims can be made now.
    pub ready: bool,
    pub error: Option<String>,
    /// vGPU devices (VFs, mdev parents) of the managed GPUs; `allocatable` counts only
    /// free devices that can take at least one profile now.
    pub devices: DeviceCounts,
    pub profiles: Vec<ProfileCapacity>,
    /// Whole GPUs (`passthrough_gpus`): `allocatable` is how many passthrough instances
    /// can be placed now.
    pub passthrough: PassthroughCounts,
}

/// The passthrough GPUs of `resources.get`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PassthroughCounts {
    pub total: u64,
    pub claimed: u64,
    /// Free, with a group that can be moved whole.
    pub allocatable: u64,
    pub quarantined: u64,
    /// On vfio-pci (or split between drivers) with no claim: not offered.
    pub dirty: u64,
    /// Free, but refused (a foreign device in its IOMMU group, VFs enabled).
    pub refused: u64,
    pub unreadable: u64,
}

/// One device a dry run would try.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RankedDevice {
    pub device: String,
    pub gpu: String,
    pub dirty: bool,
}

/// `placement.dry_run`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DryRun {
    pub profile: String,
    pub plugin: String,
    pub ranked: Vec<RankedDevice>,
    pub notes: Vec<String>,
}

/// `agent.health`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HealthView {
    pub live: bool,
    /// New claims are accepted.
    pub ready: bool,
    pub startup_reconcile_done: bool,
    /// The instance, claim, health and mdev directories can be listed.
    pub store_readable: bool,
    pub gpu_mode: String,
    pub plugins_loaded: bool,
    /// Something is wrong that does not stop the agent (unreadable records, a probe
    /// error, another PID namespace): see `problems`.
    pub degraded: bool,
    pub problems: Vec<String>,
    /// The PID namespace the agent runs in, and whether it is the host's.
    pub pid_namespace: Option<u64>,
    pub host_pid_namespace: bool,
    /// `production` or `failpoint build (not for production)`.
    pub build: String,
    /// Each hypervisor, probed at start: whether it can run instances here.
    pub hypervisors: Vec<HypervisorView>,
}

/// One hypervisor as probed at start (`agent.health`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HypervisorView {
    pub name: crate::hypervisor::HypervisorKind,
    /// The configured binary.
    pub binary: String,
    /// Its binary runs (QEMU: `--version`; Cloud Hypervisor: `vmm.ping` on a throw-away
    /// API socket).
    pub available: bool,
    /// What the probe said, e.g. `QEMU emulator version 7.2.x` or `cloud-hypervisor 53.0.0
    /// (v53.0)`.
    pub version: Option<String>,
    /// Why it is not available.
    pub problem: Option<String>,
    /// What it can carry (`vendor_vfio`, `mdev`, `passthrough`, `standby`, `snapshot`).
    pub capabilities: Vec<String>,
}

/// `instance.delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DeleteResult {
    pub id: String,
    pub deleted: bool,
    /// The device was given back but quarantined by the delete's release (as in
    /// `instance.stop`'s answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_device_quarantined: Option<QuarantinedDevice>,
}

/// `plugin.reload`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReloadResult {
    pub reloaded: bool,
    pub plugins: crate::policies::PluginNames,
    /// The trial calls made before the swap (`trial`), one per slot that had an input.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trial: Vec<crate::policies::TrialRun>,
}

/// `gpu.unquarantine`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UnquarantineResult {
    /// The device, when exactly one mark was cleared.
    pub device: Option<String>,
    /// Every device whose mark was cleared.
    pub devices: Vec<String>,
    pub quarantined: bool,
}

/// One loaded plugin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PluginView {
    pub slot: String,
    pub name: String,
    pub version: String,
    pub kinds: Vec<String>,
    pub path: String,
    /// The plugin ABI: 1 (a core module, JSON) or 2 (a component of
    /// `gpuvisor:policy@2.0.0`). Absent from older agents (= 1).
    #[serde(default = "abi_one")]
    pub abi: u32,
    /// How its load got the compiled code: `hit` (the compiled-plugin cache), `compiled`
    /// (and kept in the cache) or `uncached`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compiled: Option<String>,
    /// Calls of this plugin in this slot since the agent started (kept across reloads).
    pub calls_ok: u64,
    pub calls_failed: u64,
    /// Its log lines dropped by the rate limits (stdout/stderr lines included) since the
    /// agent started (kept across reloads).
    #[serde(default)]
    pub log_lines_dropped: u64,
    /// Its stdout/stderr bytes dropped past each call's 16 KiB capture since the agent
    /// started (kept across reloads).
    #[serde(default)]
    pub output_bytes_dropped: u64,
    /// Its calls running now, and waiting for a place in the slot's share of the sandbox
    /// pool (at most 8 calls of a slot run at once).
    #[serde(default)]
    pub calls_running: u64,
    #[serde(default)]
    pub calls_waiting: u64,
}

fn abi_one() -> u32 {
    1
}

/// `plugin.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PluginList {
    pub plugins: Vec<PluginView>,
}

/// `image.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ImageList {
    pub images: Vec<crate::images::Image>,
    /// Image directories that cannot be read (a broken or missing `image.toml`): listed with
    /// why, never hidden.
    #[serde(default)]
    pub unreadable: Vec<crate::images::UnreadableImage>,
}

/// `image.delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ImageDeleted {
    pub name: String,
    pub deleted: bool,
}

/// `debug.failpoints` (failpoint builds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FailpointList {
    pub build: String,
    pub failpoints: Vec<crate::failpoints::PauseStatus>,
}

/// A claim or orphan the pass kept, or an instance it left alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct KeptItem {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recheck_after_ms: Option<u64>,
}

/// A device the pass released (something was written, or a claim removed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ReleasedItem {
    pub device: String,
    /// `stale_claim`, `orphan_vf`, `orphan_mdev`.
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

/// A release the pass attempted that failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FailedItem {
    pub device: String,
    pub error: String,
}

/// A record the pass changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RecordChange {
    pub instance: String,
    pub name: String,
    pub from: InstanceState,
    pub to: InstanceState,
    pub reason: String,
}

/// What one reconcile pass observed, kept, released and failed (`reconcile.run`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PassReport {
    /// Every store directory could be listed (unreadable records are in `errors`).
    pub inventory_complete: bool,
    /// The host's devices were observed completely (no probe error).
    pub host_complete: bool,
    pub duration_ms: u64,
    pub kept: Vec<KeptItem>,
    pub released: Vec<ReleasedItem>,
    pub failed: Vec<FailedItem>,
    pub records: Vec<RecordChange>,
    /// Interrupted deletes this pass finished (the VMM dead, the device released).
    #[serde(default)]
    pub deleted: Vec<DeletedItem>,
    /// Problems that did not stop the pass.
    pub errors: Vec<String>,
    /// gpuvisor taps this pass removed (their instance had no live VMM).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taps_removed: Vec<String>,
    /// The stages that met a failure (each counted once per pass in
    /// `gpuvisor_vgpu_reconcile_failures_total{stage}`); their messages are in `errors`.
    #[serde(skip)]
    pub(crate) failed_stages: std::collections::BTreeSet<crate::metrics::PassStage>,
}

/// An instance whose interrupted delete a reconcile pass finished.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DeletedItem {
    pub instance: String,
    pub name: String,
}

impl PassReport {
    /// A problem that did not stop the pass: in `errors`, and its stage counted once for
    /// the pass (`gpuvisor_vgpu_reconcile_failures_total{stage}`).
    pub(crate) fn fail(&mut self, stage: crate::metrics::PassStage, message: impl Into<String>) {
        self.errors.push(message.into());
        self.failed_stages.insert(stage);
    }

    pub(crate) fn keep_device(&mut self, device: &str, reason: impl Into<String>) {
        self.kept.push(KeptItem {
            device: Some(device.to_string()),
            instance: None,
            reason: reason.into(),
            recheck_after_ms: None,
        });
    }

    pub(crate) fn keep_instance(&mut self, id: uuid::Uuid, reason: impl Into<String>) {
        self.kept.push(KeptItem {
            device: None,
            instance: Some(id.to_string()),
            reason: reason.into(),
            recheck_after_ms: None,
        });
    }
}

/// How long `instance.get` waits for the VMM to report its VM state.
const VM_STATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

impl Manager {
    /// The sysfs path of a claimed device (its backend's view): the VF or GPU, or the mdev.
    pub(crate) fn device_path(&self, c: &Claim) -> String {
        let held = crate::devices::Held::of(c);
        crate::devices::backend(&c.kind).view(&self.host, &held).sysfs_path.display().to_string()
    }

    fn vmm_view(&self, rec: &InstanceRecord) -> Option<VmmView> {
        let v = rec.vmm.as_ref()?;
        let (liveness, reason) = match self.identity_liveness(v) {
            Liveness::Alive { .. } => ("alive", None),
            // Only a recorded identity that matches a live process now is shown: a recycled
            // pid is never reported as the VMM (docs/design/invariants.md I7).
            Liveness::Dead => return None,
            Liveness::MaybeAlive { reason } => ("unknown", Some(reason)),
        };
        Some(VmmView {
            pid: v.identity.pid,
            start_time: v.identity.start_time,
            boot_id: v.identity.boot_id.clone(),
            pid_namespace: v.identity.pid_ns,
            control_socket: v.control_socket.display().to_string(),
            liveness: liveness.into(),
            reason,
            vm_state: None,
            vm_state_error: None,
        })
    }

    /// The API view of an instance: the record plus `gpu` derived from its claim (and the
    /// VF's type now).
    pub(crate) fn view(&self, rec: &InstanceRecord, claims: &Listing<Claim>) -> InstanceView {
        let claim = claims
            .records
            .iter()
            .find(|c| c.owned_by(rec.id) || rec.gpu_resource_claim.as_ref().is_some_and(|rc| rc.is(&c.owner)));
        let unreadable = claims
            .unreadable
            .iter()
            .find(|u| u.owner == Some(rec.id) || (claim.is_none() && u.owner.is_none() && rec.wants_gpu()))
            .map(|u| format!("{}: {}", u.path.display(), u.error));
        let gpu = match (rec.wants_gpu(), claim, &unreadable) {
            (false, None, None) => None,
            _ => {
                let current = claim.filter(|c| c.kind.framework() == Framework::VendorVfio).map(|c| {
                    match vendor_vfio::read_current_type(&self.host, &c.device) {
                        Ok(t) => TypeReading::Id(t),
                        Err(e) => TypeReading::Unknown(e.to_string()),
                    }
                });
                let type_mismatch = match (claim, current.as_ref().and_then(|t| t.id())) {
                    (Some(c), Some(now))
                        if c.state == ClaimState::Configured && c.kind.type_id().is_some_and(|t| t != now) =>
                    {
                        Some(format!(
                            "the VF reads type {now}, not the claimed {}: another writer changed it under the VM",
                            c.kind.type_id().unwrap_or(0)
                        ))
                    }
                    _ => None,
                };
                Some(GpuAssignment {
                    profile: rec
                        .gpu_profile
                        .clone()
                        .or_else(|| rec.gpu_passthrough.as_ref().map(|_| super::inventory::PASSTHROUGH.to_string()))
                        .or_else(|| claim.map(|c| c.profile.clone())),
                    passthrough_address: rec.gpu_passthrough.as_ref().and_then(|w| w.address.clone()),
                    functions: claim
                        .and_then(|c| c.kind.passthrough())
                        .map(|pc| {
                            pc.functions
                                .iter()
                                .map(|f| FunctionView {
                                    bdf: f.bdf.clone(),
                                    driver: crate::devices::passthrough::driver_of(&self.host, &f.bdf)
                                        .unwrap_or_else(|_| Some("unreadable".into())),
                                    original_driver: f.original_driver.clone(),
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                    framework: rec.gpu_framework.or(claim.map(|c| c.kind.framework())),
                    device: claim.map(|c| c.device.clone()),
                    gpu: claim.map(|c| c.gpu.clone()),
                    device_path: claim.map(|c| self.device_path(c)),
                    mdev_uuid: claim.and_then(|c| c.kind.mdev_uuid()).map(|u| u.to_string()),
                    type_id: claim.and_then(|c| c.kind.type_id()),
                    current_type: current.as_ref().map(TypeValue::of),
                    claimed_at: claim.map(|c| c.claimed_at.clone()),
                    claim_state: claim.map(|c| c.state),
                    release_pending: claim.is_some_and(|c| c.state == ClaimState::ReleasePending)
                        || unreadable.is_some(),
                    last_error: claim.and_then(|c| c.last_error.clone()),
                    type_mismatch,
                    claim_unreadable: unreadable,
                })
            }
        };
        InstanceView {
            id: rec.id.to_string(),
            name: rec.name.clone(),
            image: rec.image.clone(),
            hypervisor: rec.hypervisor,
            vcpus: rec.vcpus,
            memory_mib: rec.memory_mib,
            labels: rec.labels.clone(),
            state: rec.state(),
            created_at: rec.created_at.clone(),
            last_error: rec.last_error.clone(),
            vmm: self.vmm_view(rec),
            serial_log: self.store.vmm_dir(rec.id).join(crate::hypervisor::SERIAL_LOG).display().to_string(),
            serial_log_rotated: self.store.instance_dir(rec.id).join(crate::console::ROTATED_LOG).display().to_string(),
            vmm_id: rec.vmm_id,
            console_socket: Some(
                rec.hypervisor
                    .driver()
                    .serial_port()
                    .console_socket(&self.store.vmm_dir(rec.id), &self.store.instance_dir(rec.id))
                    .display()
                    .to_string(),
            ),
            gpu,
            restart: rec.restart,
            autostart: rec.autostart,
            restarts: RestartView {
                attempts: rec.restarts.attempts_ms.len() as u32,
                last_attempt_unix_ms: rec.restarts.attempts_ms.last().copied(),
                due_unix_ms: rec.restarts.due_ms,
                gave_up: rec.restarts.gave_up,
            },
            warnings: vec![],
            released_device_quarantined: None,
            nics: rec
                .nics
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let mac = crate::network::mac_address(rec.id, i);
                    match n {
                        crate::network::Nic::User { forwards } => {
                            NicView { mode: "user".into(), forwards: forwards.clone(), bridge: None, mac, tap: None }
                        }
                        crate::network::Nic::Bridge { bridge } => NicView {
                            mode: "bridge".into(),
                            forwards: vec![],
                            bridge: Some(bridge.clone()),
                            mac,
                            tap: Some(crate::network::tap_name(rec.id, i)),
                        },
                    }
                })
                .collect(),
            seed: rec.wants_seed().then(|| SeedView {
                path: self.store.vmm_dir(rec.id).join(super::seed::SEED_FILE).display().to_string(),
                user_data_bytes: rec
                    .cloud_init
                    .as_ref()
                    .and_then(|c| c.user_data.as_ref())
                    .map_or(0, |u| u.len() as u64),
                network_config_bytes: rec
                    .cloud_init
                    .as_ref()
                    .and_then(|c| c.network_config.as_ref())
                    .map_or(0, |u| u.len() as u64),
            }),
            boot: rec.boot,
            disk: self.disk_view(rec),
        }
    }

    /// The disk part of the view: the overlay of an instance whose image has a disk (or that
    /// has an overlay, when the image is unreadable).
    fn disk_view(&self, rec: &InstanceRecord) -> Option<InstanceDiskView> {
        let overlay = self.store.vmm_dir(rec.id).join(super::disk::OVERLAY);
        let has_disk = overlay.exists()
            || crate::images::load(&self.store.images_dir(), &rec.image).is_ok_and(|i| i.disk.is_some());
        has_disk.then(|| InstanceDiskView {
            overlay: overlay.display().to_string(),
            exists: overlay.exists(),
            disk_gib: rec.disk_gib,
        })
    }

    /// The view of an instance after an operation that succeeded: claim records that cannot
    /// be listed must not turn the success into an error (the work is done); the view then
    /// carries `warnings`.
    pub(crate) fn view_after(&self, rec: &InstanceRecord) -> InstanceView {
        match self.store.scan_claims() {
            Ok(claims) => {
                let mut v = self.view(rec, &claims);
                for u in &claims.unreadable {
                    v.warnings.push(format!("the claim record {} cannot be read ({})", u.path.display(), u.error));
                }
                v
            }
            Err(e) => {
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, error = %e, "claim records cannot be listed; answering without them");
                let mut v = self.view(rec, &Listing::default());
                v.warnings.push(format!("the claim records cannot be listed ({e}); gpu fields are incomplete"));
                v
            }
        }
    }

    /// `instance.get`.
    pub fn get(&self, r: &str) -> Result<InstanceView, ApiError> {
        let rec = self.find(r)?;
        let mut view = self.view_after(&rec);
        if let Some(v) = view.vmm.as_mut().filter(|v| v.liveness == "alive") {
            let socket = std::path::Path::new(&v.control_socket);
            match rec.hypervisor.driver().vm_state(socket, VM_STATE_TIMEOUT) {
                Ok(state) => v.vm_state = Some(state),
                Err(e) => v.vm_state_error = Some(e),
            }
        }
        Ok(view)
    }

    /// `instance.list`: every readable instance, and every record that cannot be read.
    pub fn list(&self) -> Result<InstanceList, ApiError> {
        let instances = self.store.scan_instances()?;
        let claims = self.store.scan_claims()?;
        Ok(InstanceList {
            instances: instances.records.iter().map(|r| self.view(r, &claims)).collect(),
            unreadable: instances.unreadable.iter().map(UnreadableRecord::from).collect(),
        })
    }

    /// A readable claim as `gpu.list` shows it (`names`: instance names the claims carry).
    fn claim_view(&self, c: &Claim, names: &HashMap<uuid::Uuid, String>) -> ClaimView {
        ClaimView {
            instance_id: c.owner.instance().map(|i| i.to_string()),
            instance_name: c.owner.instance().and_then(|id| {
                c.owner_name
                    .clone()
                    .or_else(|| names.get(&id).cloned())
                    .or_else(|| self.store.read_instance(id).ok().flatten().map(|r| r.name.clone()))
            }),
            owner: Some(c.owner.clone()),
            profile: Some(c.profile.clone()),
            type_id: c.kind.type_id(),
            mdev_uuid: c.kind.mdev_uuid().map(|u| u.to_string()),
            state: Some(c.state),
            last_error: c.last_error.clone(),
            unreadable: None,
        }
    }

    /// `gpu.list`: every GPU (managed or not) and device with its current type, claim
    /// owner, health mark and what could not be read.
    pub fn gpus(&self) -> Result<GpuList, ApiError> {
        let obs = self.observe(None)?;
        let names: HashMap<uuid::Uuid, String> =
            obs.claims.records.iter().filter_map(|c| Some((c.owner.instance()?, c.owner_name.clone()?))).collect();
        let held = self.held_by_policy();
        let probe_error = obs.mode.as_ref().err().cloned();
        let gpus = obs
            .gpus
            .iter()
            .map(|g| GpuEntry {
                address: g.address.clone(),
                model: g.model.clone(),
                framebuffer_mib: g.framebuffer_mib,
                numa_node: g.numa_node.filter(|n| *n >= 0),
                claimed_framebuffer_mib: g.claimed_framebuffer_mib,
                managed: g.managed,
                health: g.health.as_ref().map(HealthMark::from),
                probe_error: probe_error.clone(),
                devices: g
                    .devices
                    .iter()
                    .map(|d| DeviceEntry {
                        address: d.address.clone(),
                        state: d.state.into(),
                        current_type: TypeValue::of(&d.current_type),
                        creatable: d.creatable.clone(),
                        claim: match (&d.claim, &d.claim_unreadable) {
                            (Some(c), _) => Some(self.claim_view(c, &names)),
                            (None, Some(u)) => Some(ClaimView {
                                instance_id: None,
                                instance_name: None,
                                owner: None,
                                profile: None,
                                type_id: None,
                                mdev_uuid: None,
                                state: None,
                                last_error: None,
                                unreadable: Some(u.clone()),
                            }),
                            (None, None) => None,
                        },
                        quarantine: d.health.as_ref().map(HealthMark::from),
                        held_by_policy: held.get(&d.address).cloned(),
                        unreadable: d.unreadable.clone(),
                        type_mismatch: d.type_mismatch.clone(),
                        catalog_skipped_lines: d.catalog_skipped.clone(),
                    })
                    .collect(),
                passthrough: g.passthrough.as_ref().map(|pt| {
                    let recorded = g.devices.first().and_then(|d| d.claim.as_ref()).and_then(|c| c.kind.passthrough());
                    let original = |bdf: &str| {
                        recorded
                            .and_then(|r| r.functions.iter().find(|f| f.bdf == bdf))
                            .and_then(|f| f.original_driver.clone())
                    };
                    PassthroughGroupView {
                        group: pt.read.as_ref().map(|r| r.group),
                        functions: pt
                            .read
                            .iter()
                            .flat_map(|r| &r.functions)
                            .map(|f| FunctionView {
                                bdf: f.bdf.clone(),
                                driver: f.driver.clone(),
                                original_driver: original(&f.bdf),
                            })
                            .collect(),
                        bridges: pt.read.as_ref().map(|r| r.bridges.clone()).unwrap_or_default(),
                        foreign: pt.read.as_ref().map(|r| r.foreign.clone()).unwrap_or_default(),
                        problem: pt.problem.clone(),
                    }
                }),
            })
            .collect();
        let unreadable_records =
            obs.claims.unreadable.iter().chain(&obs.health.unreadable).map(UnreadableRecord::from).collect();
        let unreadable_devices = obs
            .unreadable
            .iter()
            .map(|u| UnreadableDeviceView { address: u.address.clone(), gpu: u.gpu.clone(), reason: u.reason.clone() })
            .collect();
        Ok(GpuList { mode: obs.mode_name().to_string(), probe_error, gpus, unreadable_devices, unreadable_records })
    }

    /// `resources.get`: GPU mode, device counts and per-profile placeable counts (honest
    /// under the equal-size rule), every profile from one observation.
    pub fn resources(&self) -> Result<Resources, ApiError> {
        let obs = match self.observe(None) {
            Ok(o) => o,
            Err(e) => {
                return Ok(Resources {
                    mode: "probe_error".into(),
                    ready: false,
                    error: Some(e.message),
                    devices: DeviceCounts::default(),
                    profiles: vec![],
                    passthrough: PassthroughCounts::default(),
                })
            }
        };
        Ok(self.resources_of(&obs))
    }

    /// How many vGPUs of `profile` GPU `g` can take now: its free devices listing the
    /// profile, capped by the slots left under the equal-size rule.
    fn placeable_on(&self, g: &super::inventory::ObservedGpu, profile: &str) -> u64 {
        let listing = g
            .devices
            .iter()
            .filter(|d| {
                d.state == gpuvisor_sdk::DeviceState::Free
                    && d.creatable.iter().any(|c| c.eq_ignore_ascii_case(profile))
            })
            .count() as u64;
        listing.min(self.gpu_slots(g, profile))
    }

    pub(crate) fn resources_of(&self, obs: &Observation) -> Resources {
        use gpuvisor_sdk::DeviceState as S;
        let mut c = DeviceCounts::default();
        // Unreadable: every device whose state cannot be read — those of the managed GPUs'
        // device lists, and those the scan could not place on a GPU at all.
        let mut unreadable: std::collections::BTreeSet<String> = obs
            .unreadable
            .iter()
            .filter(|u| u.gpu.as_deref().is_none_or(|g| self.cfg.manages(g)))
            // An unreadable mdev counts as its parent (the device placement uses).
            .map(|u| u.parent.as_ref().unwrap_or(&u.address).to_ascii_lowercase())
            .collect();
        for (g, d) in obs.devices() {
            c.total += 1;
            // A device can be claimed and quarantined, or claimed and unreadable, at once:
            // those counts come from the facts, not from the one state shown.
            if d.health.as_ref().is_some_and(|h| h.quarantined) {
                c.quarantined += 1;
            }
            if d.unreadable.is_some() {
                unreadable.insert(d.address.to_ascii_lowercase());
            }
            c.catalog_skipped_lines += d.catalog_skipped.len() as u64;
            match d.state {
                S::Claimed => c.claimed += 1,
                // Only a device that can take at least one profile now is allocatable.
                S::Free if d.creatable.iter().any(|p| self.gpu_slots(g, p) > 0) => c.allocatable += 1,
                S::Free => {}
                S::Dirty => c.dirty += 1,
                S::Quarantined | S::Unreadable => {}
            }
        }
        c.unreadable = unreadable.len() as u64;
        // Profiles: every name seen; placeable per GPU = free VFs listing it, capped by the
        // slots left under the equal-size rule.
        let mut profiles = Vec::new();
        for (name, fb) in self.book.all() {
            let placeable = obs
                .gpus
                .iter()
                .filter(|g| g.managed && g.passthrough.is_none())
                .map(|g| self.placeable_on(g, &name))
                .sum();
            let type_id = if obs.mode == Ok(HostMode::VendorVfio) { self.type_id_in(obs, &name) } else { None };
            profiles.push(ProfileCapacity { profile: name, type_id, framebuffer_mib: fb, placeable });
        }
        let mut pt = PassthroughCounts::default();
        for (_, d, p) in obs.passthrough() {
            pt.total += 1;
            if d.health.as_ref().is_some_and(|h| h.quarantined) {
                pt.quarantined += 1;
            }
            match d.state {
                S::Claimed => pt.claimed += 1,
                S::Free if p.problem.is_none() => pt.allocatable += 1,
                S::Free => pt.refused += 1,
                S::Dirty => pt.dirty += 1,
                S::Unreadable => pt.unreadable += 1,
                S::Quarantined => {}
            }
        }
        Resources {
            mode: obs.mode_name().to_string(),
            ready: matches!(obs.mode, Ok(HostMode::VendorVfio | HostMode::Mdev)),
            error: obs.mode.as_ref().err().cloned(),
            devices: c,
            profiles,
            passthrough: pt,
        }
    }

    /// How many more vGPUs of `profile` the GPU `g` can take under the equal-size rule
    /// (its framebuffer over the profile's, less its active vGPUs); the number of free
    /// devices listing it when a size is unknown.
    fn gpu_slots(&self, g: &super::inventory::ObservedGpu, profile: &str) -> u64 {
        use gpuvisor_sdk::DeviceState as S;
        let listing = g
            .devices
            .iter()
            .filter(|d| d.state == S::Free && d.creatable.iter().any(|c| c.eq_ignore_ascii_case(profile)))
            .count() as u64;
        if listing == 0 {
            return 0;
        }
        let active = g.devices.iter().filter(|d| matches!(d.state, S::Claimed | S::Dirty)).count() as u64;
        match (g.framebuffer_mib, self.book.profile_fb(profile)) {
            (Some(gfb), Some(pfb)) if pfb > 0 => (gfb / pfb).saturating_sub(active),
            _ => listing,
        }
    }

    /// `placement.dry_run`: what the placement plugin would pick for a profile now, after
    /// native validation. Claims nothing.
    pub fn dry_run(&self, p: super::request::DryRunParams) -> Result<DryRun, ApiError> {
        if let Some(n) = p.name.as_deref() {
            super::request::check_instance_name(n)?;
        }
        super::request::check_labels(&p.labels)?;
        let spec = super::request::GpuSpec {
            profile: p.profile.clone(),
            passthrough: p.passthrough,
            address: p.address,
            resource_claim: None,
        };
        let (profile, whole) = match super::request::GpuRequest::Spec(spec).want()? {
            super::request::GpuWant::Profile(x) => (self.known_profile(&x)?, None),
            super::request::GpuWant::Passthrough { address } => {
                self.check_passthrough_address(address.as_deref())?;
                (super::inventory::PASSTHROUGH.to_string(), Some(crate::store::PassthroughWant { address }))
            }
            super::request::GpuWant::ResourceClaim(_) => {
                return Err(ApiError::invalid_request("a resource claim's device is prepared, not placed"))
            }
        };
        let name = p.name.unwrap_or_else(|| "dry-run".into());
        let ask = super::policy_calls::PlacementAsk {
            instance_id: uuid::Uuid::nil(),
            name: &name,
            labels: &p.labels,
            profile: &profile,
        };
        let _a = self.alloc();
        let (obs, framework) = self.observe_candidates(&profile, whole.as_ref())?;
        let ranking = self.rank(&ask, framework, &obs)?;
        Ok(DryRun {
            profile,
            plugin: self.policies().placement.name().to_string(),
            ranked: ranking
                .candidates
                .iter()
                .map(|c| RankedDevice { device: c.device.clone(), gpu: c.gpu.clone(), dirty: c.dirty })
                .collect(),
            notes: ranking.notes.into_iter().chain(obs.notes).collect(),
        })
    }

    /// `agent.health`: liveness and readiness, and what is degraded.
    pub fn health(&self) -> HealthView {
        let mut problems = Vec::new();
        let mut store_readable = true;
        // Every record kind: an unreadable one blocks what it may own, so the agent is degraded
        // while any exists.
        for (what, listing) in [
            ("instance", self.store.scan_instances().map(|l| l.unreadable)),
            ("claim", self.store.scan_claims().map(|l| l.unreadable)),
            ("health", self.store.scan_health().map(|l| l.unreadable)),
            ("mdev", self.store.scan_mdevs().map(|l| l.unreadable)),
        ] {
            match listing {
                Ok(u) => problems.extend(
                    u.iter().map(|u| format!("{what} record {} cannot be read: {}", u.path.display(), u.error)),
                ),
                Err(e) => {
                    store_readable = false;
                    problems.push(format!("{what} records cannot be listed: {e}"));
                }
            }
        }
        let mode = crate::devices::scan(&self.host, &self.cfg.passthrough_gpus).mode;
        if let Err(e) = &mode {
            problems.push(format!("GPU framework probe failed: {e}"));
        }
        let ns = crate::host::proc::own_pid_namespace();
        let host_ns = ns == Some(crate::host::proc::INITIAL_PID_NS);
        if !host_ns {
            problems.push(format!(
                "the agent runs in PID namespace {}, not the host's: processes outside it are invisible to its scans",
                ns.map(|n| n.to_string()).unwrap_or_else(|| "unknown".into())
            ));
        }
        problems.extend(self.reconciler_problems());
        // The release guard's open-handle scan reads every process's fds and refuses every
        // release (`scan_incomplete`) while one cannot be read: say so before a release does.
        if let Err(e) = crate::host::proc::fd_tables_readable() {
            problems.push(format!(
                "the open-handle scan cannot read every process's fds ({e}): every device release is refused \
                 (scan_incomplete) until it can; see gpuvisor host check"
            ));
        }
        HealthView {
            live: true,
            ready: store_readable && mode.is_ok() && self.is_ready(),
            startup_reconcile_done: self.is_ready(),
            store_readable,
            gpu_mode: mode.map(|m| m.as_str().to_string()).unwrap_or_else(|_| "probe_error".into()),
            plugins_loaded: true,
            degraded: !problems.is_empty(),
            problems,
            pid_namespace: ns,
            host_pid_namespace: host_ns,
            build: crate::failpoints::BUILD.to_string(),
            hypervisors: self.hypervisor_views(),
        }
    }

    /// `plugin.list`.
    pub fn plugin_list(&self) -> PluginList {
        let p = self.policies();
        let mut plugins = Vec::new();
        for (slot, kind) in [
            ("placement", gpuvisor_sdk::PolicyKind::Placement),
            ("hypervisor", gpuvisor_sdk::PolicyKind::Hypervisor),
            ("grace", gpuvisor_sdk::PolicyKind::Grace),
        ] {
            if let Some(s) = p.slot(kind) {
                let (calls_ok, calls_failed) = self.metrics.policy_call_counts(s.name(), kind.as_str());
                let (log_lines_dropped, output_bytes_dropped) =
                    self.metrics.policy_dropped_counts(s.name(), kind.as_str());
                let stats = s.plugin.stats();
                let m = s.plugin.manifest();
                plugins.push(PluginView {
                    slot: slot.into(),
                    name: m.name.clone(),
                    version: m.version.clone(),
                    kinds: m.kinds.iter().map(|k| k.as_str().to_string()).collect(),
                    path: s.plugin.path().display().to_string(),
                    abi: s.plugin.abi_version(),
                    compiled: Some(s.plugin.cache_outcome().as_str().to_string()),
                    calls_ok,
                    calls_failed,
                    log_lines_dropped,
                    output_bytes_dropped,
                    calls_running: stats.calls_running,
                    calls_waiting: stats.calls_waiting,
                });
            }
        }
        PluginList { plugins }
    }

    /// Scrape-time gauges.
    pub fn gauges(&self) -> crate::metrics::Gauges {
        let mut g = crate::metrics::Gauges::default();
        let mut unreadable_records = 0;
        if let Ok(list) = self.store.scan_instances() {
            unreadable_records += list.unreadable.len() as i64;
            let mut by: BTreeMap<&'static str, i64> = InstanceState::ALL.iter().map(|s| (s.as_str(), 0)).collect();
            for i in &list.records {
                *by.entry(i.state().as_str()).or_default() += 1;
            }
            g.instances = by.into_iter().collect();
        }
        if let Ok(list) = self.store.scan_claims() {
            unreadable_records += list.unreadable.len() as i64;
            let mut by: BTreeMap<(&'static str, &'static str), i64> = BTreeMap::new();
            for fw in [Framework::VendorVfio, Framework::Mdev, Framework::Passthrough] {
                for st in ClaimState::ALL {
                    by.insert((fw.as_str(), st.as_str()), 0);
                }
            }
            for c in &list.records {
                *by.entry((c.kind.framework().as_str(), c.state.as_str())).or_default() += 1;
                if c.state == ClaimState::ReleasePending {
                    g.retained += 1;
                }
            }
            g.claims = by.into_iter().map(|((f, s), n)| (f, s, n)).collect();
        }
        if let Ok(h) = self.store.scan_health() {
            unreadable_records += h.unreadable.len() as i64;
            g.quarantined = h.records.iter().filter(|r| r.quarantined).count() as i64 + h.unreadable.len() as i64;
        }
        g.unreadable_records = unreadable_records;
        g.held_by_policy = self.held_by_policy().len() as i64;
        if let Ok(obs) = self.observe(None) {
            let counts = self.resources_of(&obs).devices;
            g.unreadable_devices = counts.unreadable as i64;
            g.catalog_skipped_lines = counts.catalog_skipped_lines as i64;
            g.type_mismatches = obs.devices().filter(|(_, d)| d.type_mismatch.is_some()).count() as i64;
            let claims = self.store.scan_claims().map(|c| c.records).unwrap_or_default();
            let book = self.book.all();
            for gpu in obs.gpus.iter().filter(|g| g.managed && g.passthrough.is_none()) {
                for (profile, _) in &book {
                    g.placeable.push((gpu.address.clone(), profile.clone(), self.placeable_on(gpu, profile) as i64));
                }
                let fb: u64 = claims
                    .iter()
                    .filter(|c| c.gpu.eq_ignore_ascii_case(&gpu.address))
                    .filter_map(|c| {
                        book.iter().find(|(p, _)| p.eq_ignore_ascii_case(&c.profile)).and_then(|(_, fb)| *fb)
                    })
                    .sum();
                g.claimed_framebuffer_mib.push((gpu.address.clone(), fb as i64));
            }
        }
        g
    }

    /// `agent.metrics`: the Prometheus text exposition.
    pub fn metrics_text(&self) -> String {
        self.metrics.render(&self.gauges())
    }

    /// `debug.failpoints`.
    pub fn failpoints(&self) -> FailpointList {
        FailpointList { build: crate::failpoints::BUILD.to_string(), failpoints: crate::failpoints::pause_status() }
    }
}
