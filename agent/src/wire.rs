//! # wire — what the JSON-RPC methods answer
//!
//! The typed views the core returns: instances, GPUs, resources, dry runs, reconcile
//! reports, health, and the small results of the other methods. Pure data: the read-side
//! operations that build them live in `instances/view.rs`; `rpc` serialises them, the CLI
//! decodes the same types, and the OpenRPC result schemas are generated from them (the
//! method table, `rpc/api.rs`, names each method's result type).
//!
//! Rule: a view never shows unknown as clear — a type that cannot be read is `"unknown"`
//! (never `0`), an unreadable record is listed as unreadable with its path and error, and
//! a VMM whose liveness cannot be decided is shown with `liveness: "unknown"` and why.

use crate::domain::{ClaimState, Framework, HealthRecord, InstanceState, Labels};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A type id as read now, or `"unknown"` when it cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum TypeValue {
    /// The id (`0`: no vGPU).
    Id(u32),
    /// Always the string `"unknown"`.
    Unknown(String),
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
    /// The VMM's process id, as seen in the PID namespace `pid_namespace`.
    pub pid: i32,
    /// The VMM's start time in clock ticks since boot (`/proc/<pid>/stat` field 22): with
    /// `pid` and `boot_id`, tells the VMM from a later process that reuses its pid.
    pub start_time: u64,
    /// The boot id of the host the VMM was started on (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    /// The PID namespace the pid was recorded in.
    pub pid_namespace: Option<u64>,
    /// The VMM's control socket: QEMU's QMP socket or Cloud Hypervisor's API socket.
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
    /// How the GPU is handed to the VM: `vendor_vfio`, `mdev` or `passthrough`.
    pub framework: Option<Framework>,
    /// The claimed device (VF / mdev parent).
    pub device: Option<String>,
    /// Its GPU (PF).
    pub gpu: Option<String>,
    /// The sysfs path of the device (VF, or the mdev).
    pub device_path: Option<String>,
    /// The mdev's UUID (mdev hosts only).
    pub mdev_uuid: Option<String>,
    /// The type id configured at claim time.
    pub type_id: Option<u32>,
    /// The VF's type now (vendor VFIO; `"unknown"` when unreadable).
    pub current_type: Option<TypeValue>,
    /// When the device was claimed (RFC 3339, UTC).
    pub claimed_at: Option<String>,
    /// The claim's state: `claimed`, `configured` or `release_pending`.
    pub claim_state: Option<ClaimState>,
    /// The device's release failed and is retried by the agent: the device stays blocked
    /// until it succeeds.
    pub release_pending: bool,
    /// The last error met on the claim (configure or release), if any.
    pub last_error: Option<String>,
    /// The VF holds another type than the claim's (a foreign write under the VM).
    pub type_mismatch: Option<String>,
    /// A claim file that may be this instance's cannot be read (`path: error`).
    pub claim_unreadable: Option<String>,
}

/// One instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InstanceView {
    /// The instance's id (a UUID, fixed at create).
    pub id: String,
    /// The instance's name (`[a-z0-9][a-z0-9-]{0,62}`, unique on this agent).
    pub name: String,
    /// The name of the image the instance was created from.
    pub image: String,
    /// The hypervisor that runs the instance's VMM.
    pub hypervisor: crate::hypervisor::HypervisorKind,
    /// Virtual CPUs of the VM.
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// The labels given at create (e.g. `{"tenant": "acme"}`), seen by the policy
    /// plugins.
    pub labels: Labels,
    /// The instance's lifecycle state.
    pub state: InstanceState,
    /// When the instance was created (RFC 3339, UTC).
    pub created_at: String,
    /// Why the last operation on the instance failed (e.g. a start whose VMM did not come
    /// up); `None` when the last one succeeded.
    pub last_error: Option<String>,
    /// The VMM, when one is recorded and not provably dead.
    pub vmm: Option<VmmView>,
    /// The guest's serial console output (in the instance's VMM directory), appended across
    /// boots.
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
    /// The instance's GPU: its profile and its claim; `None` for an instance without a GPU.
    pub gpu: Option<GpuAssignment>,
    /// When the VMM dies without a stop: `no`, `on-failure`, `always`.
    pub restart: crate::domain::RestartPolicy,
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
    pub boot: crate::domain::BootMode,
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
    /// The record's file.
    pub path: String,
    /// What the file name says it is about (an instance id, a device).
    pub key: String,
    /// Why it cannot be read.
    pub error: String,
}

/// `instance.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InstanceList {
    /// The readable instances.
    pub instances: Vec<InstanceView>,
    /// Instance records that cannot be read (listed, never hidden).
    pub unreadable: Vec<UnreadableRecord>,
}

/// A device an operation gave back and quarantined (`released_device_quarantined`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct QuarantinedDevice {
    /// The device's address (BDF).
    pub device: String,
    /// The mark's reason, e.g. `reset_failed`.
    pub reason: String,
    /// What the mark says happened (e.g. the reset's error).
    pub detail: String,
}

/// A health mark.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HealthMark {
    /// Why the device was marked, e.g. `reset_failed`, `gpu_fault`.
    pub reason: String,
    /// What was seen, in words (e.g. the error of the failed reset).
    pub detail: String,
    /// When the mark was set (RFC 3339, UTC).
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
    /// The owning instance's name (`null` for an external owner or when the instance record
    /// cannot be read).
    pub instance_name: Option<String>,
    /// The claim's owner: `{"kind": "instance", "id"}` or an external owner
    /// (`{"kind": "resource_claim", "namespace", "name", "uid"}`); `null` when unreadable.
    pub owner: Option<crate::domain::Owner>,
    /// The vGPU profile claimed (e.g. `L40S-2Q`), or `passthrough`.
    pub profile: Option<String>,
    /// The vGPU type id the claim configures (`null` for passthrough).
    pub type_id: Option<u32>,
    /// The mdev's UUID (mdev hosts only).
    pub mdev_uuid: Option<String>,
    /// The claim's state: `claimed`, `configured` or `release_pending`.
    pub state: Option<ClaimState>,
    /// The last error met on the claim (configure or release), if any.
    pub last_error: Option<String>,
    /// The claim file cannot be read (`path: error`): the device is blocked.
    pub unreadable: Option<String>,
}

/// The state of a device in `gpu.list` (the plugins' `DeviceState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeviceStateView {
    /// No claim, and clean: it can be claimed.
    Free,
    /// Held by a claim.
    Claimed,
    /// No claim but not clean (a type set, or a function on `vfio-pci`): cleaned before it
    /// is handed out again.
    Dirty,
    /// Marked unhealthy: not handed out until an operator clears the mark
    /// (`gpu.unquarantine`).
    Quarantined,
    /// Its state cannot be read: not handed out, never shown as free.
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
    /// The device's PCI address (BDF).
    pub address: String,
    /// Whether the device can be handed out now.
    pub state: DeviceStateView,
    /// `current_vgpu_type` now (`"unknown"` when it cannot be read).
    pub current_type: TypeValue,
    /// The vGPU profiles the device can take now (`creatable_vgpu_types`); empty when none
    /// or unreadable.
    pub creatable: Vec<String>,
    /// The claim on this device, if any.
    pub claim: Option<ClaimView>,
    /// Its health mark (`suspect` or quarantined).
    pub quarantine: Option<HealthMark>,
    /// The grace plugin keeps this eligible item past `claim_grace` (its reason).
    pub held_by_policy: Option<String>,
    /// Why its state cannot be read.
    pub unreadable: Option<String>,
    /// The claim names another type than the VF holds now.
    pub type_mismatch: Option<String>,
    /// The `creatable_vgpu_types` lines skipped (malformed, or id 0); absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub catalog_skipped_lines: Vec<String>,
}

/// One GPU (PF).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuEntry {
    /// The GPU's PCI address (BDF).
    pub address: String,
    /// The GPU's model name (e.g. `NVIDIA L40S`).
    pub model: String,
    /// The GPU's framebuffer, MiB; `None` when it cannot be read.
    pub framebuffer_mib: Option<u64>,
    /// The GPU's NUMA node (sysfs `numa_node`); `None` when unreadable or none (`-1`).
    pub numa_node: Option<i32>,
    /// Framebuffer held by the claims on the GPU's devices, MiB.
    pub claimed_framebuffer_mib: u64,
    /// gpuvisor may touch its devices (`managed_gpus`); unmanaged ones are only reported.
    pub managed: bool,
    /// A GPU-level mark (`gpu_fault`).
    pub health: Option<HealthMark>,
    /// The framework probe failed: this GPU is not usable now.
    pub probe_error: Option<String>,
    /// The GPU's vGPU devices (VFs or mdev parents); a passthrough GPU lists itself.
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
    /// The function's PCI address (BDF).
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
    /// Why the framework probe failed; `None` when it succeeded.
    pub probe_error: Option<String>,
    /// The GPUs of the host, managed or not.
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
    /// The device's PCI address (BDF).
    pub address: String,
    /// Its GPU (PF), when known.
    pub gpu: Option<String>,
    /// Why its state cannot be read.
    pub reason: String,
}

/// Device counts of `resources.get` (managed GPUs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DeviceCounts {
    /// Devices of the managed GPUs.
    pub total: u64,
    /// Devices held by a claim.
    pub claimed: u64,
    /// Free devices that can take at least one profile now.
    pub allocatable: u64,
    /// Devices with a quarantine mark (claimed or not).
    pub quarantined: u64,
    /// Devices with no claim that are not clean (non-zero type): cleaned before reuse.
    pub dirty: u64,
    /// Devices whose type (or catalog) cannot be read, claimed or not.
    pub unreadable: u64,
    /// `creatable_vgpu_types` lines skipped (malformed, or id 0).
    pub catalog_skipped_lines: u64,
}

/// How many more instances of a profile can be placed now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProfileCapacity {
    /// The vGPU profile (e.g. `L40S-2Q`).
    pub profile: String,
    /// Its vGPU type id (vendor VFIO hosts; `None` on others, or when no VF lists it now).
    pub type_id: Option<u32>,
    /// The framebuffer of one instance of the profile, MiB; `None` when unknown.
    pub framebuffer_mib: Option<u64>,
    /// How many more instances of the profile can be placed now.
    pub placeable: u64,
}

/// `resources.get`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Resources {
    /// The vGPU framework found: `vendor_vfio`, `mdev`, `mixed`, `waiting_for_vfs`, `none`,
    /// or `probe_error`.
    pub mode: String,
    /// vGPU claims can be made now.
    pub ready: bool,
    /// Why vGPU claims cannot be made now; `None` when `ready`.
    pub error: Option<String>,
    /// vGPU devices (VFs, mdev parents) of the managed GPUs; `allocatable` counts only
    /// free devices that can take at least one profile now.
    pub devices: DeviceCounts,
    /// Per vGPU profile, how many more instances can be placed now.
    pub profiles: Vec<ProfileCapacity>,
    /// Whole GPUs (`passthrough_gpus`): `allocatable` is how many passthrough instances
    /// can be placed now.
    pub passthrough: PassthroughCounts,
}

/// The passthrough GPUs of `resources.get`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PassthroughCounts {
    /// Passthrough GPUs configured (`passthrough_gpus`).
    pub total: u64,
    /// Passthrough GPUs held by a claim.
    pub claimed: u64,
    /// Free, with a group that can be moved whole.
    pub allocatable: u64,
    /// Passthrough GPUs with a quarantine mark (claimed or not).
    pub quarantined: u64,
    /// On vfio-pci (or split between drivers) with no claim: not offered.
    pub dirty: u64,
    /// Free, but refused (a foreign device in its IOMMU group, VFs enabled).
    pub refused: u64,
    /// Passthrough GPUs whose state cannot be read.
    pub unreadable: u64,
}

/// One device a dry run would try.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RankedDevice {
    /// The device's PCI address (BDF).
    pub device: String,
    /// Its GPU (PF).
    pub gpu: String,
    /// The device is dirty: it is cleaned before it is configured.
    pub dirty: bool,
}

/// `placement.dry_run`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DryRun {
    /// The vGPU profile asked for (or `passthrough`).
    pub profile: String,
    /// The placement plugin that ranked the devices.
    pub plugin: String,
    /// The devices a create would try, in order.
    pub ranked: Vec<RankedDevice>,
    /// The plugin's notes, then one line per device skipped or refused.
    pub notes: Vec<String>,
}

/// `agent.health`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HealthView {
    /// The agent answers (always `true` in an answer).
    pub live: bool,
    /// New claims are accepted.
    pub ready: bool,
    /// The reconcile pass run at agent start has finished.
    pub startup_reconcile_done: bool,
    /// The instance, claim, health and mdev directories can be listed.
    pub store_readable: bool,
    /// The vGPU framework found: `vendor_vfio`, `mdev`, `mixed`, `waiting_for_vfs`, `none`,
    /// or `probe_error`.
    pub gpu_mode: String,
    /// The policy plugins are loaded (always `true` in an answer: the agent does not serve
    /// without them).
    pub plugins_loaded: bool,
    /// Something is wrong that does not stop the agent (unreadable records, a probe
    /// error, another PID namespace): see `problems`.
    pub degraded: bool,
    /// What makes the agent `degraded`, one line each; empty when it is not.
    pub problems: Vec<String>,
    /// The PID namespace the agent runs in, and whether it is the host's.
    pub pid_namespace: Option<u64>,
    /// The agent runs in the host's PID namespace (otherwise VMM liveness cannot always be
    /// decided).
    pub host_pid_namespace: bool,
    /// `production` or `failpoint build (not for production)`.
    pub build: String,
    /// Each hypervisor, probed at start: whether it can run instances here.
    pub hypervisors: Vec<HypervisorView>,
}

/// One hypervisor as probed at start (`agent.health`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HypervisorView {
    /// The hypervisor.
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
    /// The deleted instance's id (a UUID).
    pub id: String,
    /// The instance and its records are gone (always `true` in an answer).
    pub deleted: bool,
    /// The device was given back but quarantined by the delete's release (as in
    /// `instance.stop`'s answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_device_quarantined: Option<QuarantinedDevice>,
}

/// `plugin.reload`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReloadResult {
    /// The new plugins are in place (always `true` in an answer: a failed reload is an
    /// error and keeps the old ones).
    pub reloaded: bool,
    /// The plugin loaded in each slot now.
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
    /// The devices are still quarantined (always `false` in an answer).
    pub quarantined: bool,
}

/// One loaded plugin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PluginView {
    /// The slot the plugin fills: `placement`, `hypervisor` or `grace`.
    pub slot: String,
    /// The plugin's name, as it reports it.
    pub name: String,
    /// The plugin's version, as it reports it.
    pub version: String,
    /// The policy kinds the plugin implements.
    pub kinds: Vec<String>,
    /// The plugin's `.wasm` file.
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
    /// Calls of this plugin in this slot that failed since the agent started (kept across
    /// reloads).
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
    /// Its calls waiting for a place in the slot's share of the sandbox pool now.
    #[serde(default)]
    pub calls_waiting: u64,
}

fn abi_one() -> u32 {
    1
}

/// `plugin.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PluginList {
    /// The loaded plugins, one per slot.
    pub plugins: Vec<PluginView>,
}

/// `image.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ImageList {
    /// The readable images.
    pub images: Vec<crate::images::Image>,
    /// Image directories that cannot be read (a broken or missing `image.toml`): listed with
    /// why, never hidden.
    #[serde(default)]
    pub unreadable: Vec<crate::images::UnreadableImage>,
}

/// `image.delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ImageDeleted {
    /// The deleted image's name.
    pub name: String,
    /// The image is gone (always `true` in an answer).
    pub deleted: bool,
}

/// `debug.failpoints` (failpoint builds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FailpointList {
    /// `production` or `failpoint build (not for production)`.
    pub build: String,
    /// Each failpoint and whether a call is paused at it.
    pub failpoints: Vec<crate::failpoints::PauseStatus>,
}

/// A claim or orphan the pass kept, or an instance it left alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct KeptItem {
    /// The device kept (its BDF), when the item is a device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The instance left alone (its id), when the item is an instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Why it was kept (e.g. `grace: ...` with the grace plugin's reason, `maybe alive:
    /// ...`).
    pub reason: String,
    /// When the grace plugin would look at the device again, ms (advisory: the next pass
    /// runs on the agent's own schedule); `None` when it did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recheck_after_ms: Option<u64>,
}

/// A device the pass released (something was written, or a claim removed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ReleasedItem {
    /// The device released (its BDF).
    pub device: String,
    /// `stale_claim`, `orphan_vf`, `orphan_mdev`.
    pub kind: String,
    /// The instance the released claim belonged to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

/// A release the pass attempted that failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FailedItem {
    /// The device whose release failed (its BDF).
    pub device: String,
    /// Why it failed.
    pub error: String,
}

/// A record the pass changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RecordChange {
    /// The instance's id.
    pub instance: String,
    /// The instance's name.
    pub name: String,
    /// Its state before the pass.
    pub from: InstanceState,
    /// Its state after the pass.
    pub to: InstanceState,
    /// Why the pass changed it (e.g. the VMM is dead).
    pub reason: String,
}

/// What one reconcile pass observed, kept, released and failed (`reconcile.run`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PassReport {
    /// Every store directory could be listed (unreadable records are in `errors`).
    pub inventory_complete: bool,
    /// The host's devices were observed completely (no probe error).
    pub host_complete: bool,
    /// How long the pass took, ms.
    pub duration_ms: u64,
    /// Claims, orphans and instances the pass kept or left alone, with why.
    pub kept: Vec<KeptItem>,
    /// Devices the pass released.
    pub released: Vec<ReleasedItem>,
    /// Releases the pass tried that failed (retried on the next pass).
    pub failed: Vec<FailedItem>,
    /// Instance records the pass changed.
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
    /// The instance's id.
    pub instance: String,
    /// The instance's name.
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
