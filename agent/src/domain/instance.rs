//! An instance: what defines it (fixed at create or fork) and its runtime record.

use super::claim::{External, Framework, Owner};
use super::state::{IllegalTransition, InstanceState};
use crate::host::proc::ProcessIdentity;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use uuid::Uuid;

/// The VMM of a running instance: identity plus control socket (QMP for QEMU).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmmRecord {
    /// Who the VMM process is (pid, start time, boot id, PID namespace): never mistaken for
    /// a later process with its pid.
    pub identity: ProcessIdentity,
    /// The VMM's control socket: QEMU's QMP socket or Cloud Hypervisor's API socket.
    pub control_socket: PathBuf,
    /// What the VM was started with (an update since applies at the next start); `None`
    /// for a VMM recorded before this was kept, or found without a record of its spawn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub booted: Option<Machine>,
}

/// The devices a VM is made of: what a saved memory state needs again to load, and what a
/// running VMM was started with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Machine {
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// The NICs, in guest order.
    #[serde(default)]
    pub nics: Vec<crate::network::Nic>,
    /// Whether a cloud-init seed disk is attached.
    #[serde(default)]
    pub seed: bool,
}

/// Labels as a sorted map (records, claims, requests).
pub type Labels = BTreeMap<String, String>;

/// What defines an instance (fixed at create or fork): identity, image, hypervisor, size,
/// labels and GPU profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceDefinition {
    /// The instance's id (a random UUID, fixed at create).
    pub id: Uuid,
    /// The instance's name (`[a-z0-9][a-z0-9-]{0,62}`, unique on this agent).
    pub name: String,
    /// The name of the image it boots.
    pub image: String,
    /// As chosen by the `hypervisor` plugin at create (`qemu`, `cloud-hypervisor`).
    pub hypervisor: crate::hypervisor::HypervisorKind,
    /// Virtual CPUs of the VM.
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// The labels given at create (seen by the policy plugins).
    #[serde(default)]
    pub labels: Labels,
    /// The requested vGPU profile (canonical name, e.g. `L40S-2Q`), if any.
    pub gpu_profile: Option<String>,
    /// The GPU framework the profile was placed with, if any.
    pub gpu_framework: Option<Framework>,
    /// A whole GPU (passthrough), if asked for: any free passthrough GPU, or the one named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_passthrough: Option<PassthroughWant>,
    /// The device prepared for a Kubernetes ResourceClaim (`claim.prepare`), if the VM uses
    /// one: the claim stays the ResourceClaim's; stop and delete never release it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_resource_claim: Option<ResourceClaimRef>,
    /// What happens when the VMM dies without a stop.
    #[serde(default)]
    pub restart: RestartPolicy,
    /// Started again when the agent starts after a host reboot (whatever `restart` says).
    #[serde(default)]
    pub autostart: bool,
    /// Wall time, RFC 3339.
    pub created_at: String,
    /// The virtio-net NICs, in guest order (`network.rs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<crate::network::Nic>,
    /// The cloud-init inputs given at create; the seed carries them with its meta-data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<crate::network::CloudInit>,
    /// How the VM boots (records written before boot modes existed boot `direct`).
    #[serde(default)]
    pub boot: BootMode,
    /// The size of the instance's disk overlay, GiB; `None`: the image disk's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_gib: Option<u64>,
}

/// How an instance boots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BootMode {
    /// QEMU loads the image's kernel and initrd itself (`-kernel`); a disk, if the image
    /// has one, is attached as a data disk.
    #[default]
    Direct,
    /// The firmware (SeaBIOS) boots the disk overlay's MBR boot loader.
    Bios,
    /// UEFI firmware (OVMF) boots the disk overlay's `EFI/BOOT/BOOTX64.EFI`; the instance
    /// keeps its own variable store (`efivars.fd`).
    Uefi,
}

crate::deserialize_by_name!(
    BootMode,
    [("direct", BootMode::Direct), ("bios", BootMode::Bios), ("uefi", BootMode::Uefi)]
);

impl BootMode {
    /// `direct`, `bios` or `uefi`.
    pub fn as_str(self) -> &'static str {
        match self {
            BootMode::Direct => "direct",
            BootMode::Bios => "bios",
            BootMode::Uefi => "uefi",
        }
    }
}

/// What happens when an instance's VMM dies without a stop (`instance.stop` or delete).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RestartPolicy {
    /// It stays `stopped`.
    #[default]
    No,
    /// Started again when the VMM failed: a non-zero exit, a signal, or an exit the agent
    /// did not see (it was not running, or the host rebooted).
    OnFailure,
    /// Started again whenever the VMM exits, also after the guest powered off.
    Always,
}

crate::deserialize_by_name!(
    RestartPolicy,
    [("no", RestartPolicy::No), ("on-failure", RestartPolicy::OnFailure), ("always", RestartPolicy::Always)]
);

/// The restarts of an instance: when they were tried, the next one, and whether the limit
/// stopped them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartState {
    /// Unix times (ms) of the restarts tried within `restart_window_s`.
    #[serde(default)]
    pub attempts_ms: Vec<u64>,
    /// Unix time (ms) the next restart is due; `None`: none pending.
    #[serde(default)]
    pub due_ms: Option<u64>,
    /// The limit was reached: no more restarts until the instance is started by hand.
    #[serde(default)]
    pub gave_up: bool,
    /// Unix time (ms) the first restart that failed because the host was not ready
    /// (`not_ready`) was tried; `None` while the host is not being waited for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_wait_since_ms: Option<u64>,
    /// Tries that failed `not_ready` since `host_wait_since_ms` (the backoff doubles per try).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_waits: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl RestartState {
    fn is_idle(&self) -> bool {
        *self == RestartState::default()
    }
}

/// What a passthrough instance asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassthroughWant {
    /// The GPU's address, when the request named one (kept across restarts); `None`: any.
    pub address: Option<String>,
}

/// A Kubernetes ResourceClaim by namespace and name (`instance.create`'s
/// `gpu.resource_claim`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ResourceClaimRef {
    /// The ResourceClaim's Kubernetes namespace.
    pub namespace: String,
    /// The ResourceClaim's name in its namespace.
    pub name: String,
}

impl ResourceClaimRef {
    /// True when `owner` is this ResourceClaim (any UID).
    pub fn is(&self, owner: &Owner) -> bool {
        matches!(owner, Owner::External(External::ResourceClaim { namespace, name, .. })
            if *namespace == self.namespace && *name == self.name)
    }
}

impl std::fmt::Display for ResourceClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `instances/<id>/instance.json`: the definition (flattened: the file is one JSON object)
/// plus the runtime fields. Never stores a device path: GPU ownership lives in claims only.
/// The state is private: it changes only through [`InstanceRecord::transition`]. The
/// definition's fields read through `Deref` (`rec.name`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceRecord {
    #[serde(flatten)]
    def: InstanceDefinition,
    state: InstanceState,
    /// The running VMM; `None` while no VMM is recorded.
    pub vmm: Option<VmmRecord>,
    /// The uid (and gid) the instance's VMM runs under, from `vmm_ids`: recorded (with its
    /// `vmm-ids/<uid>.json`) before the first spawn, kept for the instance's life. `None`
    /// before its first start (and in records written before VMMs had ids of their own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm_id: Option<u32>,
    /// Why the last operation on the instance failed; `None` after one that succeeded.
    pub last_error: Option<String>,
    /// Restarts under the restart policy (absent while idle).
    #[serde(default, skip_serializing_if = "RestartState::is_idle")]
    pub restarts: RestartState,
}

impl std::ops::Deref for InstanceRecord {
    type Target = InstanceDefinition;

    fn deref(&self) -> &InstanceDefinition {
        &self.def
    }
}

impl InstanceRecord {
    /// A new record in `state` (`starting` for a create, `stopped` for a fork), with no VMM.
    pub fn new(def: InstanceDefinition, state: InstanceState) -> InstanceRecord {
        InstanceRecord { def, state, vmm: None, vmm_id: None, last_error: None, restarts: RestartState::default() }
    }

    /// The definition, to change (`instance.update`); the state stays behind
    /// [`InstanceRecord::transition`].
    pub fn definition_mut(&mut self) -> &mut InstanceDefinition {
        &mut self.def
    }

    /// The lifecycle state.
    pub fn state(&self) -> InstanceState {
        self.state
    }

    /// Moves the record to `to` (in memory; the caller persists it). Errors: the
    /// transition table does not allow it ([`InstanceState::can_move_to`]).
    pub fn transition(&mut self, to: InstanceState) -> std::result::Result<(), IllegalTransition> {
        if !self.state.can_move_to(to) {
            return Err(IllegalTransition { id: self.id, from: self.state, to });
        }
        self.state = to;
        Ok(())
    }

    /// The devices the VM is made of by its definition now.
    pub fn machine(&self) -> Machine {
        Machine { vcpus: self.vcpus, memory_mib: self.memory_mib, nics: self.nics.clone(), seed: self.wants_seed() }
    }

    /// The devices the running VM was started with ([`VmmRecord::booted`]); the definition's
    /// for a VMM recorded without them (or none).
    pub fn running_machine(&self) -> Machine {
        self.vmm.as_ref().and_then(|v| v.booted.clone()).unwrap_or_else(|| self.machine())
    }

    /// True when the VM gets a cloud-init seed disk (it has NICs or cloud-init inputs).
    pub fn wants_seed(&self) -> bool {
        !self.nics.is_empty() || self.cloud_init.is_some()
    }

    /// True when the record asks for a GPU.
    pub fn wants_gpu(&self) -> bool {
        self.gpu_profile.is_some() || self.gpu_passthrough.is_some()
    }
}
