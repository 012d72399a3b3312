//! The agent, seen from the node component: a local JSON-RPC client (the agent crate's own
//! client, `gpuvisor::rpc::client`) and the few fields of its answers the component reads.
//! Every claim, configure and clear goes through the agent; this process never touches sysfs.

use gpuvisor::rpc::client::{self, ClientError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The owner kind the agent records for a Kubernetes ResourceClaim.
pub const OWNER_KIND: &str = "resource_claim";

/// A ResourceClaim as the agent's external owner of a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// Always [`OWNER_KIND`] (`resource_claim`).
    pub kind: String,
    /// The ResourceClaim's namespace.
    pub namespace: String,
    /// The ResourceClaim's name.
    pub name: String,
    /// The ResourceClaim's UID (a claim deleted and made again under the same name is
    /// another owner).
    pub uid: String,
}

impl Owner {
    /// The owner for the ResourceClaim `namespace/name` with UID `uid`.
    pub fn resource_claim(namespace: &str, name: &str, uid: &str) -> Owner {
        Owner { kind: OWNER_KIND.into(), namespace: namespace.into(), name: name.into(), uid: uid.into() }
    }
}

/// `gpu.list`, the fields the component reads (unknown ones are ignored).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GpuList {
    /// The agent's vGPU framework: `vendor_vfio`, `mdev`, `mixed`, `waiting_for_vfs`,
    /// `none` or `probe_error`.
    #[serde(default)]
    pub mode: String,
    /// Why the agent's framework probe failed; `None` when it succeeded.
    #[serde(default)]
    pub probe_error: Option<String>,
    /// The host's GPUs, managed or not.
    #[serde(default)]
    pub gpus: Vec<Gpu>,
}

/// One physical GPU (PF) of `gpu.list`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Gpu {
    /// The GPU's PCI address (BDF).
    pub address: String,
    /// The GPU's model name (e.g. `NVIDIA L40S`).
    #[serde(default)]
    pub model: Option<String>,
    /// The GPU's framebuffer, MiB; `None` when the agent could not read it.
    #[serde(default)]
    pub framebuffer_mib: Option<u64>,
    /// The agent may touch the GPU's devices (`managed_gpus`): only managed GPUs are
    /// published.
    #[serde(default)]
    pub managed: bool,
    /// A GPU-level mark (`gpu_fault`), else null.
    #[serde(default)]
    pub health: Option<Value>,
    /// Why the agent cannot use this GPU now.
    #[serde(default)]
    pub probe_error: Option<String>,
    /// The GPU's NUMA node; `None` when unknown.
    #[serde(default)]
    pub numa_node: Option<i64>,
    /// Its VFs or mdev parents, or the passthrough GPU itself.
    #[serde(default)]
    pub devices: Vec<GpuDevice>,
    /// Present for a passthrough GPU (`passthrough_gpus`).
    #[serde(default)]
    pub passthrough: Option<Value>,
}

impl Gpu {
    /// The GPU is a whole GPU for passthrough (`passthrough_gpus`), not a vGPU parent.
    pub fn is_passthrough(&self) -> bool {
        self.passthrough.is_some()
    }
}

/// A device of a GPU in `gpu.list`: a VF, an mdev parent, or the passthrough GPU itself.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GpuDevice {
    /// The device's PCI address (BDF).
    pub address: String,
    /// `free`, `claimed`, `dirty`, `quarantined` or `unreadable`.
    #[serde(default)]
    pub state: String,
    /// The VF's `current_vgpu_type` (`0` when clear, `"unknown"` when unreadable).
    #[serde(default)]
    pub current_type: Value,
    /// The vGPU profiles the device can create now.
    #[serde(default)]
    pub creatable: Vec<String>,
    /// The device's claim, if any.
    #[serde(default)]
    pub claim: Option<DeviceClaim>,
    /// Its health mark (suspect or quarantined), if any.
    #[serde(default)]
    pub quarantine: Option<Quarantine>,
    /// Why its state cannot be read.
    #[serde(default)]
    pub unreadable: Option<String>,
}

impl GpuDevice {
    /// A quarantine mark (not a suspect one).
    pub fn quarantined(&self) -> Option<&Quarantine> {
        self.quarantine.as_ref().filter(|q| q.quarantined)
    }
}

/// The claim of a device as `gpu.list` shows it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct DeviceClaim {
    /// The owning instance (`None` for an external owner such as a ResourceClaim).
    #[serde(default)]
    pub instance_id: Option<String>,
    /// The owning instance's name.
    #[serde(default)]
    pub instance_name: Option<String>,
    /// The profile claimed, or `passthrough`.
    #[serde(default)]
    pub profile: Option<String>,
    /// The claim's state: `claimed`, `configured` or `release_pending`.
    #[serde(default)]
    pub state: Option<String>,
    /// The claim's owner (`{"kind": "instance", …}` or `{"kind": "resource_claim", …}`).
    #[serde(default)]
    pub owner: Option<Value>,
    /// The claim file cannot be read (`path: error`): the device is blocked.
    #[serde(default)]
    pub unreadable: Option<String>,
}

impl DeviceClaim {
    /// The ResourceClaim UID when a ResourceClaim owns this claim.
    pub fn resource_claim_uid(&self) -> Option<&str> {
        let o = self.owner.as_ref()?;
        (o.get("kind")?.as_str()? == OWNER_KIND).then(|| o.get("uid")?.as_str()).flatten()
    }
}

/// A quarantine or suspect mark.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Quarantine {
    /// Why the device was marked (e.g. `reset_failed`).
    #[serde(default)]
    pub reason: String,
    /// What was seen, in words.
    #[serde(default)]
    pub detail: Option<String>,
    /// `true`: quarantined (never handed out); `false`: suspect only.
    #[serde(default)]
    pub quarantined: bool,
}

/// `resources.get`, the fields the component reads.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Resources {
    /// The agent's vGPU framework (as in `gpu.list`).
    #[serde(default)]
    pub mode: String,
    /// vGPU claims can be made now.
    #[serde(default)]
    pub ready: bool,
    /// Every vGPU profile the agent knows.
    #[serde(default)]
    pub profiles: Vec<Profile>,
}

/// A vGPU profile.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Profile {
    /// The profile's name (e.g. `L40S-2Q`).
    pub profile: String,
    /// Its vGPU type id (vendor VFIO); `None` when unknown.
    #[serde(default)]
    pub type_id: Option<u64>,
    /// The framebuffer of one vGPU of the profile, MiB (`0` when unknown).
    #[serde(default)]
    pub framebuffer_mib: u64,
}

/// The host as one observation: `gpu.list` and `resources.get`.
#[derive(Debug, Clone, Default)]
pub struct Host {
    /// The GPUs and their devices (`gpu.list`).
    pub gpus: GpuList,
    /// The vGPU profiles by name (`resources.get`).
    pub profiles: BTreeMap<String, Profile>,
    /// The agent's vGPU framework (`resources.get`'s `mode`).
    pub mode: String,
}

impl Host {
    /// The profile whose type id a VF holds.
    pub fn profile_of_type(&self, type_id: u64) -> Option<&Profile> {
        self.profiles.values().find(|p| p.type_id == Some(type_id))
    }
}

/// The answer of `claim.prepare`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Prepared {
    /// The device claimed and configured (BDF).
    pub device: String,
    /// `vendor_vfio`, `mdev` or `passthrough`.
    #[serde(default)]
    pub kind: String,
    /// The profile claimed (`None` for a whole GPU).
    #[serde(default)]
    pub profile: Option<String>,
    /// The type id written and read back (vendor VFIO), else `None`.
    #[serde(default)]
    pub type_id: Option<u64>,
    /// The mdev's UUID (mdev), else `None`.
    #[serde(default)]
    pub mdev_uuid: Option<String>,
    /// The IOMMU group (`null` when it cannot be read).
    #[serde(default)]
    pub vfio_group: Option<Value>,
    /// What a VMM needs: `/dev/vfio/<group>` and `/dev/vfio/vfio`.
    #[serde(default)]
    pub device_nodes: Vec<String>,
    /// The nodes where the agent finds them (under its host root).
    #[serde(default)]
    pub host_paths: Vec<String>,
    /// The PCI address a VMM is given (the VF or the GPU; `None` for an mdev).
    #[serde(default)]
    pub pci_address: Option<String>,
    /// The physical GPU (PF).
    #[serde(default)]
    pub parent_gpu: Option<String>,
    /// The claim's state (`configured` once prepared).
    #[serde(default)]
    pub state: Option<String>,
}

/// One entry of `claim.list`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ListedClaim {
    /// The claimed device (BDF).
    pub device: String,
    /// The claim's owner (`{"kind": "resource_claim", "namespace", "name", "uid"}` here).
    #[serde(default)]
    pub owner: Option<Value>,
    /// The profile claimed.
    #[serde(default)]
    pub profile: Option<String>,
    /// `vendor_vfio`, `mdev` or `passthrough`.
    #[serde(default)]
    pub kind: Option<String>,
    /// The claim's state: `claimed`, `configured` or `release_pending`.
    #[serde(default)]
    pub state: Option<String>,
}

impl ListedClaim {
    /// The ResourceClaim UID when a ResourceClaim owns this claim.
    pub fn resource_claim_uid(&self) -> Option<&str> {
        let o = self.owner.as_ref()?;
        (o.get("kind")?.as_str()? == OWNER_KIND).then(|| o.get("uid")?.as_str()).flatten()
    }
}

/// The `data.code` of a JSON-RPC error, if the agent answered one.
pub fn error_code(e: &ClientError) -> Option<&str> {
    match e {
        ClientError::Rpc { data, .. } => data.get("code").and_then(|c| c.as_str()),
        _ => None,
    }
}

/// The agent's socket and calls.
#[derive(Debug, Clone)]
pub struct Agent {
    socket: PathBuf,
}

impl Agent {
    /// A client of the agent at `socket`.
    pub fn new(socket: &Path) -> Agent {
        Agent { socket: socket.to_path_buf() }
    }

    /// The agent's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Calls `method` with `params` and returns the JSON-RPC result.
    pub async fn call(&self, method: &str, params: Value) -> Result<Value, ClientError> {
        client::call(&self.socket, method, params).await
    }

    async fn typed<T: serde::de::DeserializeOwned>(&self, method: &str, params: Value) -> Result<T, ClientError> {
        let v = self.call(method, params).await?;
        serde_json::from_value(v.clone()).map_err(|e| {
            ClientError::Protocol(format!("{method} answered something the node component cannot read ({e}): {v}"))
        })
    }

    /// One observation of the host.
    pub async fn host(&self) -> Result<Host, ClientError> {
        let gpus: GpuList = self.typed("gpu.list", json!({})).await?;
        let res: Resources = self.typed("resources.get", json!({})).await?;
        Ok(Host { gpus, profiles: res.profiles.into_iter().map(|p| (p.profile.clone(), p)).collect(), mode: res.mode })
    }

    /// `claim.prepare`: claims and configures `device` (of `kind`, with `profile` for a
    /// vGPU) for `owner`.
    pub async fn prepare(
        &self,
        owner: &Owner,
        device: &str,
        kind: &str,
        profile: Option<&str>,
    ) -> Result<Prepared, ClientError> {
        let mut params = json!({ "owner": owner, "device": device, "kind": kind });
        if let Some(p) = profile {
            params["profile"] = json!(p);
        }
        self.typed("claim.prepare", params).await
    }

    /// `claim.release`: gives `device` back through the agent's release path, when `owner`
    /// owns its claim.
    pub async fn release(&self, owner: &Owner, device: &str) -> Result<Value, ClientError> {
        self.call("claim.release", json!({ "owner": owner, "device": device })).await
    }

    /// Every claim owned by a ResourceClaim.
    pub async fn claims(&self) -> Result<Vec<ListedClaim>, ClientError> {
        let v = self.call("claim.list", json!({ "owner_kind": OWNER_KIND })).await?;
        let list = v.get("claims").cloned().unwrap_or(v);
        serde_json::from_value(list.clone()).map_err(|e| {
            ClientError::Protocol(format!("claim.list answered something the node component cannot read ({e}): {list}"))
        })
    }

    /// Tells the agent which ResourceClaims exist (a complete list).
    pub async fn owners(&self, live: &[String]) -> Result<Value, ClientError> {
        self.call("claim.owners", json!({ "kind": OWNER_KIND, "live": live, "complete": true })).await
    }
}
