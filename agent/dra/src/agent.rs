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
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl Owner {
    pub fn resource_claim(namespace: &str, name: &str, uid: &str) -> Owner {
        Owner { kind: OWNER_KIND.into(), namespace: namespace.into(), name: name.into(), uid: uid.into() }
    }
}

/// `gpu.list`, the fields the component reads (unknown ones are ignored).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GpuList {
    #[serde(default)]
    pub mode: String,
    #[serde(default)]
    pub probe_error: Option<String>,
    #[serde(default)]
    pub gpus: Vec<Gpu>,
}

/// One physical GPU (PF) of `gpu.list`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Gpu {
    pub address: String,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub framebuffer_mib: Option<u64>,
    #[serde(default)]
    pub managed: bool,
    /// A GPU-level mark (`gpu_fault`), else null.
    #[serde(default)]
    pub health: Option<Value>,
    #[serde(default)]
    pub probe_error: Option<String>,
    #[serde(default)]
    pub numa_node: Option<i64>,
    #[serde(default)]
    pub devices: Vec<GpuDevice>,
    /// Present for a passthrough GPU (`passthrough_gpus`).
    #[serde(default)]
    pub passthrough: Option<Value>,
}

impl Gpu {
    pub fn is_passthrough(&self) -> bool {
        self.passthrough.is_some()
    }
}

/// A device of a GPU in `gpu.list`: a VF, an mdev parent, or the passthrough GPU itself.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GpuDevice {
    pub address: String,
    /// `free`, `claimed`, `dirty`, `quarantined` or `unreadable`.
    #[serde(default)]
    pub state: String,
    /// The VF's `current_vgpu_type` (`0` when clear, `"unknown"` when unreadable).
    #[serde(default)]
    pub current_type: Value,
    #[serde(default)]
    pub creatable: Vec<String>,
    #[serde(default)]
    pub claim: Option<DeviceClaim>,
    #[serde(default)]
    pub quarantine: Option<Quarantine>,
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
    #[serde(default)]
    pub instance_id: Option<String>,
    #[serde(default)]
    pub instance_name: Option<String>,
    #[serde(default)]
    pub profile: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
    /// The claim's owner (`{"kind": "instance", …}` or `{"kind": "resource_claim", …}`).
    #[serde(default)]
    pub owner: Option<Value>,
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
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub detail: Option<String>,
    #[serde(default)]
    pub quarantined: bool,
}

/// `resources.get`, the fields the component reads.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Resources {
    #[serde(default)]
    pub mode: String,
    #[serde(default)]
    pub ready: bool,
    #[serde(default)]
    pub profiles: Vec<Profile>,
}

/// A vGPU profile.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Profile {
    pub profile: String,
    #[serde(default)]
    pub type_id: Option<u64>,
    #[serde(default)]
    pub framebuffer_mib: u64,
}

/// The host as one observation: `gpu.list` and `resources.get`.
#[derive(Debug, Clone, Default)]
pub struct Host {
    pub gpus: GpuList,
    pub profiles: BTreeMap<String, Profile>,
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
    pub device: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub profile: Option<String>,
    #[serde(default)]
    pub type_id: Option<u64>,
    #[serde(default)]
    pub mdev_uuid: Option<String>,
    #[serde(default)]
    pub vfio_group: Option<Value>,
    #[serde(default)]
    pub device_nodes: Vec<String>,
    /// The nodes where the agent finds them (under its host root).
    #[serde(default)]
    pub host_paths: Vec<String>,
    #[serde(default)]
    pub pci_address: Option<String>,
    #[serde(default)]
    pub parent_gpu: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
}

/// One entry of `claim.list`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ListedClaim {
    pub device: String,
    #[serde(default)]
    pub owner: Option<Value>,
    #[serde(default)]
    pub profile: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
}

impl ListedClaim {
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
    pub fn new(socket: &Path) -> Agent {
        Agent { socket: socket.to_path_buf() }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

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
