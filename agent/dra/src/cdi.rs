//! The files a prepared claim leaves for the container runtime: a CDI spec per claim (the VFIO
//! nodes of each device) and the KEP-5304 device metadata (a `metadata.json` per request, with
//! the attributes known only at prepare time — the VF address, an mdev UUID — and a CDI spec
//! that bind-mounts it into the container where KubeVirt's virt-launcher reads it). The layout
//! and the document shape are Kubernetes' (k8s.io/dynamic-resource-allocation's kubeletplugin
//! and api/metadata, v0.37); a Rust plugin writes them itself.

use crate::agent::Prepared;
use crate::model::DRIVER;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// The in-container directory of device metadata files.
pub const METADATA_CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// The claim annotation naming the pod's claim entry of a template-generated claim.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
/// The CDI version written (hostPath on device nodes needs >= 0.5.0).
pub const CDI_VERSION: &str = "0.6.0";

/// One prepared device of a claim.
#[derive(Debug, Clone)]
pub struct PreparedDevice {
    /// The allocation result's request (`req` or `req/subrequest`).
    pub request: String,
    /// The pool and the published device name.
    pub pool: String,
    /// The published device's name in the pool.
    pub device: String,
    /// What the agent answered.
    pub prepared: Prepared,
}

/// The claim the files belong to.
#[derive(Debug, Clone)]
pub struct ClaimRef {
    /// The ResourceClaim's namespace.
    pub namespace: String,
    /// The ResourceClaim's name.
    pub name: String,
    /// The ResourceClaim's UID.
    pub uid: String,
    /// `pod.spec.resourceClaims[].name` for a claim made from a template.
    pub pod_claim_name: Option<String>,
}

/// Where the files go.
#[derive(Debug, Clone)]
pub struct Dirs {
    /// The CDI spec directory the runtime reads (`/var/run/cdi`).
    pub cdi: PathBuf,
    /// The plugin's data directory (`/var/lib/kubelet/plugins/gpu.gpuvisor.example`).
    pub plugin: PathBuf,
}

fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

/// The CDI device name of a prepared device.
pub fn cdi_device_name(uid: &str, device: &str) -> String {
    format!("{uid}-{device}")
}

/// The CDI spec of a claim's devices: each device gets its VFIO nodes (container path
/// `/dev/vfio/<group>` and `/dev/vfio/vfio`, host path where the agent finds them) and its
/// address in the environment.
pub fn device_spec(claim: &ClaimRef, devices: &[PreparedDevice]) -> Value {
    let devs: Vec<Value> = devices
        .iter()
        .map(|d| {
            let nodes: Vec<Value> = d
                .prepared
                .device_nodes
                .iter()
                .enumerate()
                .map(|(i, path)| {
                    let host = d.prepared.host_paths.get(i).unwrap_or(path);
                    json!({ "path": path, "hostPath": host })
                })
                .collect();
            let var = crate::model::slug(&d.device).replace('-', "_").to_uppercase();
            let mut env = vec![format!("GPUVISOR_{var}={}", d.prepared.pci_address.as_deref().unwrap_or(&d.prepared.device))];
            if let Some(u) = &d.prepared.mdev_uuid {
                env.push(format!("GPUVISOR_{var}_MDEV_UUID={u}"));
            }
            json!({ "name": cdi_device_name(&claim.uid, &d.device), "containerEdits": { "deviceNodes": nodes, "env": env } })
        })
        .collect();
    json!({ "cdiVersion": CDI_VERSION, "kind": format!("{DRIVER}/vgpu"), "devices": devs })
}

/// The attributes known only at prepare time.
fn metadata_attributes(d: &PreparedDevice) -> Value {
    let mut a = serde_json::Map::new();
    let addr = d.prepared.pci_address.clone().unwrap_or_else(|| d.prepared.device.clone());
    a.insert("resource.kubernetes.io/pciBusID".into(), json!({ "string": addr }));
    if let Some(u) = &d.prepared.mdev_uuid {
        a.insert(format!("{DRIVER}/mdevUUID"), json!({ "string": u }));
    }
    if let Some(p) = &d.prepared.profile {
        a.insert(format!("{DRIVER}/profile"), json!({ "string": p }));
    }
    if let Some(t) = d.prepared.type_id {
        a.insert(format!("{DRIVER}/typeId"), json!({ "int": t }));
    }
    if let Some(g) = &d.prepared.parent_gpu {
        a.insert(format!("{DRIVER}/parentPciBusID"), json!({ "string": g }));
    }
    Value::Object(a)
}

/// The metadata documents of one request (metadata.resource.k8s.io v1beta1, then v1alpha1,
/// one JSON document per line, as the Go helper writes a stream of versions).
pub fn metadata_stream(claim: &ClaimRef, request: &str, devices: &[&PreparedDevice]) -> String {
    let devs: Vec<Value> = devices
        .iter()
        .map(|d| json!({ "driver": DRIVER, "pool": d.pool, "name": d.device, "attributes": metadata_attributes(d) }))
        .collect();
    let mut out = String::new();
    for v in ["v1beta1", "v1alpha1"] {
        let mut doc = json!({
            "kind": "DeviceMetadata",
            "apiVersion": format!("metadata.resource.k8s.io/{v}"),
            "metadata": { "name": claim.name, "namespace": claim.namespace, "uid": claim.uid, "generation": 1 },
            "requests": [{ "name": request, "devices": devs }],
        });
        if let Some(p) = &claim.pod_claim_name {
            doc["podClaimName"] = json!(p);
        }
        out.push_str(&doc.to_string());
        out.push('\n');
    }
    out
}

impl Dirs {
    fn device_spec_path(&self, uid: &str) -> PathBuf {
        self.cdi.join(format!("{DRIVER}-{uid}.json"))
    }

    fn claim_metadata_dir(&self, claim: &ClaimRef) -> PathBuf {
        self.plugin.join("dra-device-metadata").join(format!("{}_{}", claim.namespace, claim.name))
    }

    fn metadata_path(&self, claim: &ClaimRef, base_request: &str) -> PathBuf {
        self.claim_metadata_dir(claim).join(base_request).join("metadata.json")
    }

    fn metadata_spec_path(&self, uid: &str, base_request: &str) -> PathBuf {
        self.cdi.join(format!("{DRIVER}_metadata_{uid}_{base_request}.json"))
    }

    /// Writes every file of a prepared claim and returns the CDI ids per published device
    /// (the device's own id, then its request's metadata id).
    pub fn write(&self, claim: &ClaimRef, devices: &[PreparedDevice]) -> std::io::Result<Vec<Vec<String>>> {
        write_atomic(&self.device_spec_path(&claim.uid), device_spec(claim, devices).to_string().as_bytes())?;
        let mut by_request: std::collections::BTreeMap<&str, Vec<&PreparedDevice>> = Default::default();
        for d in devices {
            by_request.entry(d.request.as_str()).or_default().push(d);
        }
        let mut metadata_ids = std::collections::BTreeMap::new();
        for (request, devs) in by_request {
            let base = request.split('/').next().unwrap_or(request);
            let host_path = self.metadata_path(claim, base);
            write_atomic(&host_path, metadata_stream(claim, request, &devs).as_bytes())?;
            let container_path = match &claim.pod_claim_name {
                Some(p) => format!("{METADATA_CONTAINER_DIR}/resourceclaimtemplates/{p}/{base}/{DRIVER}-metadata.json"),
                None => format!("{METADATA_CONTAINER_DIR}/resourceclaims/{}/{base}/{DRIVER}-metadata.json", claim.name),
            };
            let name = format!("{}_{base}", claim.uid);
            let spec = json!({
                "cdiVersion": CDI_VERSION,
                "kind": format!("{DRIVER}/metadata"),
                "devices": [{ "name": name, "containerEdits": { "mounts": [{
                    "hostPath": host_path, "containerPath": container_path, "options": ["ro", "bind"] }] } }],
            });
            write_atomic(&self.metadata_spec_path(&claim.uid, base), spec.to_string().as_bytes())?;
            metadata_ids.insert(base.to_string(), format!("{DRIVER}/metadata={name}"));
        }
        Ok(devices
            .iter()
            .map(|d| {
                let base = d.request.split('/').next().unwrap_or(&d.request);
                let mut ids = vec![format!("{DRIVER}/vgpu={}", cdi_device_name(&claim.uid, &d.device))];
                ids.extend(metadata_ids.get(base).cloned());
                ids
            })
            .collect())
    }

    /// Removes every file of a claim (idempotent).
    pub fn remove(&self, claim: &ClaimRef) -> std::io::Result<()> {
        let gone = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        gone(std::fs::remove_dir_all(self.claim_metadata_dir(claim)))?;
        gone(std::fs::remove_file(self.device_spec_path(&claim.uid)))?;
        let prefix = format!("{DRIVER}_metadata_{}_", claim.uid);
        match std::fs::read_dir(&self.cdi) {
            Ok(rd) => {
                for e in rd.flatten() {
                    if e.file_name().to_string_lossy().starts_with(&prefix) {
                        gone(std::fs::remove_file(e.path()))?;
                    }
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}
