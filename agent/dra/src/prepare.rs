//! Prepare and unprepare of a ResourceClaim's devices, through the agent only.
//!
//! Prepare: the claim is read from the API server and its UID checked; the allocated devices
//! of this driver and pool are mapped to host devices (a whole GPU is itself; a vGPU slot is
//! the VF the agent already prepared for this claim on that GPU, or else the first free VF
//! there that can take the profile) and `claim.prepare` claims and configures each for the
//! ResourceClaim as the owner (idempotent: a repeat answers the same devices). Unprepare is
//! the release guard: `claim.release` of each device the claim owns, refused (`in_use`) while
//! any process holds the device's VFIO node, so the kubelet retries and the pod stays
//! terminating.

use crate::agent::{error_code, Host, Owner, Prepared};
use crate::cdi::{ClaimRef, PreparedDevice, POD_CLAIM_NAME_ANNOTATION};
use crate::model::{self, Slot, DRIVER};
use crate::sync::Node;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use std::collections::BTreeMap;

/// One allocated device of a claim in this node's pool.
#[derive(Debug, Clone)]
pub struct Allocated {
    /// The allocation result's request (`req` or `req/subrequest`).
    pub request: String,
    /// The published device's name.
    pub device: String,
}

/// This driver's results for `pool` in a claim's allocation.
pub fn allocated(claim: &ResourceClaim, pool: &str) -> Vec<Allocated> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .map(|d| {
            d.results
                .iter()
                .flatten()
                .filter(|r| r.driver == DRIVER && r.pool == pool)
                .map(|r| Allocated { request: r.request.clone(), device: r.device.clone() })
                .collect()
        })
        .unwrap_or_default()
}

/// Reads a claim from the API server and checks its UID.
pub async fn read_claim(node: &Node, namespace: &str, name: &str, uid: &str) -> Result<ResourceClaim, String> {
    let api: Api<ResourceClaim> = Api::namespaced(node.client.clone(), namespace);
    let claim = api
        .get_opt(name)
        .await
        .map_err(|e| format!("reading ResourceClaim {namespace}/{name}: {e}"))?
        .ok_or_else(|| format!("ResourceClaim {namespace}/{name} does not exist"))?;
    let got = claim.metadata.uid.as_deref().unwrap_or("");
    if got != uid {
        return Err(format!(
            "ResourceClaim {namespace}/{name} has UID {got}, not {uid}: it was deleted and created again"
        ));
    }
    Ok(claim)
}

/// The claim reference of the CDI and metadata files.
pub fn claim_ref(claim: &ResourceClaim) -> ClaimRef {
    ClaimRef {
        namespace: claim.metadata.namespace.clone().unwrap_or_default(),
        name: claim.metadata.name.clone().unwrap_or_default(),
        uid: claim.metadata.uid.clone().unwrap_or_default(),
        pod_claim_name: claim.metadata.annotations.as_ref().and_then(|a| a.get(POD_CLAIM_NAME_ANNOTATION).cloned()),
    }
}

/// The GPU a host device (VF, mdev parent or whole GPU) belongs to.
fn gpu_of<'a>(host: &'a Host, device: &str) -> Option<&'a str> {
    host.gpus.gpus.iter().find(|g| g.devices.iter().any(|d| d.address == device)).map(|g| g.address.as_str())
}

/// Claims and configures every allocated device of `owner` at the agent (idempotent). The
/// caller holds the node's host lock. Free VFs are looked for in the last pass's observation
/// (a full one costs as much as the prepare itself on a large host); when none of those can
/// be had, in a fresh one.
pub async fn host_prepare(node: &Node, owner: &Owner, devices: &[Allocated]) -> Result<Vec<PreparedDevice>, String> {
    let host = node.host(false).await.map_err(|e| format!("the gpuvisor agent: {e}"))?;
    let mine: Vec<String> = node
        .agent
        .claims()
        .await
        .map_err(|e| format!("the gpuvisor agent (claim.list): {e}"))?
        .into_iter()
        .filter(|c| c.resource_claim_uid() == Some(owner.uid.as_str()))
        .map(|c| c.device)
        .collect();
    // The allocated slots of each GPU and profile, and the devices already prepared there.
    let mut groups: BTreeMap<Slot, Vec<&Allocated>> = BTreeMap::new();
    for a in devices {
        let slot = model::parse_device(&a.device, &host)
            .ok_or_else(|| format!("device {} is not one this host publishes", a.device))?;
        groups.entry(slot).or_default().push(a);
    }
    let mut out = Vec::new();
    let mut used: Vec<String> = Vec::new();
    for (slot, allocs) in groups {
        match slot {
            Slot::Whole { gpu } => {
                for a in allocs {
                    let p = node
                        .agent
                        .prepare(owner, &gpu, "passthrough", None)
                        .await
                        .map_err(|e| format!("GPU {gpu}: {e}"))?;
                    out.push(PreparedDevice {
                        request: a.request.clone(),
                        pool: node.cfg.node.clone(),
                        device: a.device.clone(),
                        prepared: p,
                    });
                }
            }
            Slot::Status { device, .. } => {
                return Err(format!("device {device} is held or quarantined: it is never prepared"))
            }
            Slot::Vgpu { gpu, profile } => {
                let already: Vec<String> =
                    mine.iter().filter(|d| gpu_of(&host, d) == Some(gpu.as_str())).cloned().collect();
                let names: Vec<&str> = allocs.iter().map(|a| a.device.as_str()).collect();
                for (slot_name, vf) in model::assign(&names, &already) {
                    let Some(a) = allocs.iter().find(|a| a.device == slot_name) else { continue };
                    let p = match vf {
                        Some(vf) => node
                            .agent
                            .prepare(owner, &vf, &host.mode, Some(&profile))
                            .await
                            .map_err(|e| format!("{vf}: {e}"))?,
                        None => match pick_and_prepare(node, &host, owner, &gpu, &profile, &used).await {
                            Ok(p) => p,
                            Err(_) => {
                                let fresh = node.host(true).await.map_err(|e| format!("the gpuvisor agent: {e}"))?;
                                pick_and_prepare(node, &fresh, owner, &gpu, &profile, &used).await?
                            }
                        },
                    };
                    used.push(p.device.clone());
                    out.push(PreparedDevice {
                        request: a.request.clone(),
                        pool: node.cfg.node.clone(),
                        device: a.device.clone(),
                        prepared: p,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Prepares the first free VF of `gpu` that can take `profile`; another one when the agent
/// answers that a VF was taken or is held meanwhile.
async fn pick_and_prepare(
    node: &Node,
    host: &Host,
    owner: &Owner,
    gpu: &str,
    profile: &str,
    used: &[String],
) -> Result<Prepared, String> {
    let Some(g) = host.gpus.gpus.iter().find(|g| g.address == gpu) else {
        return Err(format!("GPU {gpu} is not on this host"));
    };
    let mut notes = Vec::new();
    for d in g.devices.iter().filter(|d| {
        d.state == "free"
            && d.claim.is_none()
            && d.quarantined().is_none()
            && d.creatable.iter().any(|c| c == profile)
            && !used.contains(&d.address)
    }) {
        match node.agent.prepare(owner, &d.address, &host.mode, Some(profile)).await {
            Ok(p) => return Ok(p),
            Err(e) if matches!(error_code(&e), Some("device_taken" | "in_use" | "device_unhealthy")) => {
                notes.push(format!("{}: {e}", d.address))
            }
            Err(e) => return Err(format!("{}: {e}", d.address)),
        }
    }
    notes.insert(0, format!("no VF of GPU {gpu} can take {profile} now"));
    Err(notes.join("; "))
}

/// Prepares a claim for the kubelet: the agent's devices, then the CDI and metadata files.
/// Answers the published devices with their CDI ids.
pub async fn prepare_claim(
    node: &Node,
    namespace: &str,
    name: &str,
    uid: &str,
) -> Result<Vec<(Allocated, Vec<String>)>, String> {
    let claim = read_claim(node, namespace, name, uid).await?;
    let devices = allocated(&claim, &node.cfg.node);
    if devices.is_empty() {
        return Ok(Vec::new());
    }
    let cref = claim_ref(&claim);
    let owner = Owner::resource_claim(namespace, name, uid);
    let _g = node.host_lock.lock().await;
    node.tell_owners(Some(uid)).await;
    let prepared = host_prepare(node, &owner, &devices).await?;
    gpuvisor::crash_point!("dra_after_agent_prepare");
    let ids =
        node.dirs.write(&cref, &prepared).map_err(|e| format!("writing the CDI spec and device metadata: {e}"))?;
    gpuvisor::crash_point!("dra_after_files");
    node.kick();
    Ok(prepared
        .into_iter()
        .zip(ids)
        .map(|(p, ids)| (Allocated { request: p.request, device: p.device }, ids))
        .collect())
}

/// Unprepares a claim: releases every device the claim owns through the agent's release
/// path, then removes the files. An error (a device still held) leaves everything as it is.
pub async fn unprepare_claim(node: &Node, namespace: &str, name: &str, uid: &str) -> Result<(), String> {
    let owner = Owner::resource_claim(namespace, name, uid);
    let _g = node.host_lock.lock().await;
    let mine = node.agent.claims().await.map_err(|e| format!("the gpuvisor agent (claim.list): {e}"))?;
    let mut errors = Vec::new();
    for c in mine.iter().filter(|c| c.resource_claim_uid() == Some(uid)) {
        if let Err(e) = node.agent.release(&owner, &c.device).await {
            errors.push(format!("{}: {e}", c.device));
        }
    }
    node.kick();
    gpuvisor::crash_point!("dra_after_release");
    if !errors.is_empty() {
        return Err(format!("not released: {}", errors.join("; ")));
    }
    let cref = ClaimRef { namespace: namespace.into(), name: name.into(), uid: uid.into(), pod_claim_name: None };
    node.dirs.remove(&cref).map_err(|e| format!("removing the CDI spec and device metadata: {e}"))
}
