//! The host as Kubernetes sees it: one pool per node, one counter set per physical GPU,
//! devices that consume it, cut into ResourceSlices within the API's limits. A pure function
//! of one observation of the agent ([`Host`]) and of the ResourceClaims allocated on this
//! node ([`ApiView`]); `docs/kubernetes.md` explains the model.
//!
//! - A vGPU GPU's counter set `gpu-<bdf>` holds `framebuffer` (MiB) and `vfs` (vGPU devices:
//!   VFs or mdev parents), less what the agent holds for others (a gpuvisor instance's claim, a
//!   claim whose ResourceClaim is gone or no longer allocated here — "held"), less unusable
//!   devices. Its devices are *slots* `gpu-<bdf>-<profile>-<i>`, `i < min(VFs, FB / size)`, each
//!   consuming `{framebuffer: size, vfs: 1}`: the node component picks the VF at prepare.
//! - Equal-size rule (no two sizes on one GPU; counters cannot say it): a GPU that holds a vGPU
//!   or has a slot allocated is published with that size only; a GPU with no size yet carries
//!   binding conditions on its slots, so an allocation the host refuses is allocated again.
//! - A passthrough GPU's one device `gpu-<bdf>-whole` consumes all of its counter set.
//! - Held and quarantined devices carry `NoSchedule` taints (a held or quarantined VF as a
//!   status device `gpu-<bdf>-vf-<vf>` with no counters).

use crate::agent::{Gpu, GpuDevice, Host};
use k8s_openapi::api::resource::v1 as rv1;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::collections::{BTreeMap, BTreeSet};

/// The driver name (a DNS subdomain) and the domain of its attributes.
pub const DRIVER: &str = "gpu.gpuvisor.example";
/// The binding condition the node component sets once the host prepared a fresh GPU's slot.
pub const BC_ACCEPTED: &str = "gpu.gpuvisor.example/host-accepted";
/// The binding failure condition it sets when the host refused it (the scheduler allocates again).
pub const BC_REFUSED: &str = "gpu.gpuvisor.example/host-refused";
/// Taint of a device the agent holds for a ResourceClaim that is gone (a process still has it open).
pub const TAINT_HELD: &str = "gpu.gpuvisor.example/held";
/// Taint of a quarantined device.
pub const TAINT_QUARANTINED: &str = "gpu.gpuvisor.example/quarantined";
/// Taint of a device whose state the agent cannot read, or that is dirty.
pub const TAINT_UNAVAILABLE: &str = "gpu.gpuvisor.example/unavailable";
/// Counter sets per slice (API limit).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// Devices per slice when any device consumes counters or has taints (API limit).
pub const MAX_DEVICES_PER_SLICE: usize = 64;

/// A ResourceClaim as the node component sees it in the API server.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ApiClaim {
    /// The ResourceClaim's UID.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The devices of this driver and this node's pool in its allocation (`status.allocation`).
    pub devices: Vec<String>,
}

/// Every ResourceClaim that exists (by UID), as far as the watch has seen them.
#[derive(Debug, Clone, Default)]
pub struct ApiView {
    /// The claims by UID.
    pub claims: BTreeMap<String, ApiClaim>,
}

impl ApiView {
    /// The UIDs of the claims allocated a device of this pool.
    fn allocated_here(&self) -> BTreeSet<&str> {
        self.claims.values().filter(|c| !c.devices.is_empty()).map(|c| c.uid.as_str()).collect()
    }
}

/// What a published device stands for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Slot {
    /// A vGPU of `profile` on the GPU `gpu` (PF address); the VF is picked at prepare.
    Vgpu {
        /// The GPU's (PF's) address.
        gpu: String,
        /// The vGPU profile.
        profile: String,
    },
    /// A whole (passthrough) GPU.
    Whole {
        /// The GPU's address.
        gpu: String,
    },
    /// A held or quarantined VF, shown with its taint (never allocatable).
    Status {
        /// The GPU's (PF's) address.
        gpu: String,
        /// The VF's address.
        device: String,
    },
}

/// Health of a published device for the kubelet (KEP-4680).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// The device can be used.
    Healthy,
    /// The device cannot be used (quarantined, unreadable, or its GPU faulted).
    Unhealthy,
    /// Health cannot be told (KEP-4680's `Unknown`).
    Unknown,
}

/// The pool to publish.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pool {
    /// The counter sets of the pool: per GPU, its framebuffer and its VFs, which its
    /// published devices consume.
    pub counter_sets: Vec<rv1::CounterSet>,
    /// The devices to publish in the ResourceSlices.
    pub devices: Vec<rv1::Device>,
    /// Each published device's meaning, health and why.
    pub index: BTreeMap<String, (Slot, Health, String)>,
}

/// `0000:41:00.0` → `gpu-0000-41-00-0` (a DNS label).
pub fn gpu_id(address: &str) -> String {
    format!("gpu-{}", slug(address))
}

/// A DNS-label fragment: lower case, every other character `-`.
pub fn slug(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect()
}

fn vgpu_name(gpu: &str, profile: &str, i: u64) -> String {
    format!("{}-{}-{i}", gpu_id(gpu), slug(profile))
}

/// What a device name of this driver means, from the host's GPUs and profiles (names stay
/// parseable after the device is no longer published, e.g. for an allocation made earlier).
pub fn parse_device(name: &str, host: &Host) -> Option<Slot> {
    for g in &host.gpus.gpus {
        let Some(rest) = name.strip_prefix(&gpu_id(&g.address)).and_then(|r| r.strip_prefix('-')) else {
            continue;
        };
        if rest == "whole" && g.is_passthrough() {
            return Some(Slot::Whole { gpu: g.address.clone() });
        }
        let (p, idx) = rest.rsplit_once('-')?;
        idx.parse::<u64>().ok()?;
        let profile = host.profiles.keys().find(|k| slug(k) == p)?;
        return Some(Slot::Vgpu { gpu: g.address.clone(), profile: profile.clone() });
    }
    None
}

fn q(v: u64, unit: &str) -> Quantity {
    Quantity(format!("{v}{unit}"))
}

fn counters(fb_mib: u64, vfs: u64) -> BTreeMap<String, rv1::Counter> {
    BTreeMap::from([
        ("framebuffer".to_string(), rv1::Counter { value: q(fb_mib, "Mi") }),
        ("vfs".to_string(), rv1::Counter { value: q(vfs, "") }),
    ])
}

fn attr_s(v: &str) -> rv1::DeviceAttribute {
    rv1::DeviceAttribute { string: Some(v.to_string()), ..Default::default() }
}

fn attr_i(v: i64) -> rv1::DeviceAttribute {
    rv1::DeviceAttribute { int: Some(v), ..Default::default() }
}

fn taint(key: &str, value: &str) -> rv1::DeviceTaint {
    rv1::DeviceTaint { key: key.into(), value: Some(slug(value)), effect: "NoSchedule".into(), time_added: None }
}

/// The framebuffer of a profile, if the host knows the profile.
fn fb_of(host: &Host, profile: &str) -> Option<u64> {
    host.profiles.get(profile).map(|p| p.framebuffer_mib).filter(|f| *f > 0)
}

/// The pool for one observation of the host and the API's allocations on this node.
pub fn pool(host: &Host, api: &ApiView) -> Pool {
    let mut out = Pool::default();
    let allocated = api.allocated_here();
    // Allocations in the API, by the GPU and profile their device names.
    let mut api_sizes: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for c in api.claims.values() {
        for d in &c.devices {
            if let Some(Slot::Vgpu { gpu, profile }) = parse_device(d, host) {
                api_sizes.entry(gpu).or_default().insert(profile);
            }
        }
    }
    let vgpu_ready = matches!(host.mode.as_str(), "vendor_vfio" | "mdev");
    for g in host.gpus.gpus.iter().filter(|g| g.managed && g.probe_error.is_none()) {
        if g.is_passthrough() {
            whole_gpu(&mut out, host, g, &allocated);
        } else if vgpu_ready {
            vgpu_gpu(&mut out, host, g, &allocated, api_sizes.get(&g.address));
        }
    }
    out
}

/// Who holds a claimed device, for the counters and taints.
enum Holder {
    /// A ResourceClaim allocated here: its allocation already consumes the counters.
    Ours,
    /// A ResourceClaim that is gone or no longer allocated here: held.
    Held(String),
    /// A gpuvisor instance (or an owner the component cannot read).
    Other,
}

fn holder(d: &GpuDevice, allocated: &BTreeSet<&str>) -> Option<Holder> {
    let c = d.claim.as_ref()?;
    Some(match c.resource_claim_uid() {
        Some(uid) if allocated.contains(uid) => Holder::Ours,
        Some(uid) => Holder::Held(uid.to_string()),
        None => Holder::Other,
    })
}

fn common_attrs(g: &Gpu, host: &Host) -> BTreeMap<String, rv1::DeviceAttribute> {
    let mut a = BTreeMap::new();
    a.insert("parentPciBusID".into(), attr_s(&g.address));
    if let Some(m) = &g.model {
        a.insert("gpuModel".into(), attr_s(m));
    }
    if let Some(n) = g.numa_node {
        a.insert("numaNode".into(), attr_i(n));
    }
    let framework = if g.is_passthrough() { "passthrough" } else { host.mode.as_str() };
    a.insert("framework".into(), attr_s(framework));
    a
}

fn whole_gpu(out: &mut Pool, host: &Host, g: &Gpu, allocated: &BTreeSet<&str>) {
    let fb = g.framebuffer_mib.unwrap_or(0).max(1);
    let set = gpu_id(&g.address);
    let Some(dev) = g.devices.iter().find(|d| d.address == g.address).or(g.devices.first()) else {
        return;
    };
    let mut taints = Vec::new();
    let mut health = (Health::Healthy, String::new());
    let mut cap = (fb, 1);
    match holder(dev, allocated) {
        Some(Holder::Ours) | None => {}
        Some(Holder::Held(uid)) => {
            taints.push(taint(TAINT_HELD, &uid));
            cap = (0, 0);
        }
        Some(Holder::Other) => cap = (0, 0),
    }
    // A GPU that cannot be given is out of its counters too, not only tainted: the
    // scheduler cannot allocate it even where device taints are not enforced.
    if let Some(qm) = dev.quarantined() {
        taints.push(taint(TAINT_QUARANTINED, &qm.reason));
        health = (Health::Unhealthy, format!("quarantined: {}", qm.detail.as_deref().unwrap_or(&qm.reason)));
        cap = (0, 0);
    } else if dev.state == "unreadable" || dev.state == "dirty" {
        taints.push(taint(TAINT_UNAVAILABLE, &dev.state));
        health = (Health::Unhealthy, dev.unreadable.clone().unwrap_or_else(|| dev.state.clone()));
        cap = (0, 0);
    } else if let Some(h) = &g.health {
        health = (Health::Unhealthy, format!("GPU {} has a health mark: {h}", g.address));
    }
    out.counter_sets.push(rv1::CounterSet { name: set.clone(), counters: counters(cap.0, cap.1) });
    let mut attributes = common_attrs(g, host);
    attributes.insert("kind".into(), attr_s("passthrough"));
    attributes.insert("resource.kubernetes.io/pciBusID".into(), attr_s(&g.address));
    attributes.insert("framebufferMiB".into(), attr_i(fb as i64));
    let name = format!("{set}-whole");
    out.devices.push(rv1::Device {
        name: name.clone(),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([(
            "framebuffer".to_string(),
            rv1::DeviceCapacity { value: q(fb, "Mi"), request_policy: None },
        )])),
        consumes_counters: Some(vec![rv1::DeviceCounterConsumption {
            counter_set: set,
            counters: counters(fb, 1),
            compatibility_groups: None,
        }]),
        taints: (!taints.is_empty()).then_some(taints),
        ..Default::default()
    });
    out.index.insert(name, (Slot::Whole { gpu: g.address.clone() }, health.0, health.1));
}

fn vgpu_gpu(out: &mut Pool, host: &Host, g: &Gpu, allocated: &BTreeSet<&str>, api_sizes: Option<&BTreeSet<String>>) {
    let Some(fb_total) = g.framebuffer_mib.filter(|f| *f > 0) else { return };
    let set = gpu_id(&g.address);
    let slots_total = g.devices.len() as u64;
    let mut fb_cap = fb_total;
    let mut vfs_cap = 0u64;
    let mut sizes: BTreeSet<String> = api_sizes.cloned().unwrap_or_default();
    let mut creatable: BTreeSet<String> = BTreeSet::new();
    let gpu_health = g.health.as_ref().map(|h| h.to_string());
    for d in &g.devices {
        if let Some(p) = d.claim.as_ref().and_then(|c| c.profile.clone()) {
            sizes.insert(p);
        }
        let claimed_fb = d.claim.as_ref().and_then(|c| c.profile.as_deref()).and_then(|p| fb_of(host, p)).unwrap_or(0);
        let status_taint = match (holder(d, allocated), d.quarantined()) {
            (Some(Holder::Ours), _) => {
                vfs_cap += 1;
                None
            }
            (Some(Holder::Held(uid)), _) => {
                fb_cap = fb_cap.saturating_sub(claimed_fb);
                Some((
                    taint(TAINT_HELD, &uid),
                    format!("held for ResourceClaim {uid}, which is gone or no longer allocated here"),
                ))
            }
            (Some(Holder::Other), _) => {
                fb_cap = fb_cap.saturating_sub(claimed_fb);
                None
            }
            (None, Some(qm)) => Some((
                taint(TAINT_QUARANTINED, &qm.reason),
                format!("quarantined: {}", qm.detail.as_deref().unwrap_or(&qm.reason)),
            )),
            (None, None) if d.state == "free" => {
                vfs_cap += 1;
                creatable.extend(d.creatable.iter().cloned());
                None
            }
            (None, None) => {
                // A dirty VF's type takes framebuffer and sets the GPU's size all the same.
                if let Some(p) = d.current_type.as_u64().filter(|t| *t != 0).and_then(|t| host.profile_of_type(t)) {
                    fb_cap = fb_cap.saturating_sub(p.framebuffer_mib);
                    sizes.insert(p.profile.clone());
                }
                Some((taint(TAINT_UNAVAILABLE, &d.state), d.unreadable.clone().unwrap_or_else(|| d.state.clone())))
            }
        };
        if let Some((t, why)) = status_taint {
            let name = format!("{set}-vf-{}", slug(&d.address));
            let mut attributes = common_attrs(g, host);
            attributes.insert("kind".into(), attr_s("vf-status"));
            attributes.insert("resource.kubernetes.io/pciBusID".into(), attr_s(&d.address));
            out.devices.push(rv1::Device {
                name: name.clone(),
                attributes: Some(attributes),
                taints: Some(vec![t]),
                ..Default::default()
            });
            out.index.insert(
                name,
                (Slot::Status { gpu: g.address.clone(), device: d.address.clone() }, Health::Unhealthy, why),
            );
        }
    }
    out.counter_sets.push(rv1::CounterSet { name: set.clone(), counters: counters(fb_cap, vfs_cap) });
    let offered = if sizes.is_empty() { creatable } else { sizes.clone() };
    // A GPU with no size yet (or, after a race, more than one) confirms each allocation on
    // the host before the pod binds.
    let confirm = sizes.len() != 1;
    for p in &offered {
        let Some(size) = fb_of(host, p) else { continue };
        let n = slots_total.min(fb_total / size);
        for i in 0..n {
            let name = vgpu_name(&g.address, p, i);
            let mut attributes = common_attrs(g, host);
            attributes.insert("kind".into(), attr_s("vgpu"));
            attributes.insert("profile".into(), attr_s(p));
            attributes.insert("framebufferMiB".into(), attr_i(size as i64));
            if let Some(t) = host.profiles.get(p).and_then(|p| p.type_id) {
                attributes.insert("typeId".into(), attr_i(t as i64));
            }
            out.devices.push(rv1::Device {
                name: name.clone(),
                attributes: Some(attributes),
                capacity: Some(BTreeMap::from([(
                    "framebuffer".to_string(),
                    rv1::DeviceCapacity { value: q(size, "Mi"), request_policy: None },
                )])),
                consumes_counters: Some(vec![rv1::DeviceCounterConsumption {
                    counter_set: set.clone(),
                    counters: counters(size, 1),
                    compatibility_groups: None,
                }]),
                binding_conditions: confirm.then(|| vec![BC_ACCEPTED.to_string()]),
                binding_failure_conditions: confirm.then(|| vec![BC_REFUSED.to_string()]),
                ..Default::default()
            });
            let health = match &gpu_health {
                Some(h) => (Health::Unhealthy, format!("GPU {} has a health mark: {h}", g.address)),
                None => (Health::Healthy, String::new()),
            };
            out.index.insert(name, (Slot::Vgpu { gpu: g.address.clone(), profile: p.clone() }, health.0, health.1));
        }
    }
}

/// What one slice carries: counter sets or devices (never both).
type SlicePart = (Option<Vec<rv1::CounterSet>>, Option<Vec<rv1::Device>>);

/// The pool cut into slices: counter sets first (at most 8 per slice), then devices (at most
/// 64 per slice). Names are `<node>-gpuvisor-<k>`; every slice carries the same generation and
/// the count of all of them.
pub fn slices(pool: &Pool, node: &str, generation: i64) -> Vec<(String, rv1::ResourceSliceSpec)> {
    let mut parts: Vec<SlicePart> = Vec::new();
    for c in pool.counter_sets.chunks(MAX_COUNTER_SETS_PER_SLICE) {
        parts.push((Some(c.to_vec()), None));
    }
    for d in pool.devices.chunks(MAX_DEVICES_PER_SLICE) {
        parts.push((None, Some(d.to_vec())));
    }
    if parts.is_empty() {
        parts.push((None, Some(Vec::new())));
    }
    let count = parts.len() as i64;
    parts
        .into_iter()
        .enumerate()
        .map(|(k, (shared_counters, devices))| {
            (
                slice_name(node, k),
                rv1::ResourceSliceSpec {
                    driver: DRIVER.into(),
                    node_name: Some(node.into()),
                    pool: rv1::ResourcePool { name: node.into(), generation, resource_slice_count: count },
                    shared_counters,
                    devices,
                    ..Default::default()
                },
            )
        })
        .collect()
}

/// The name of slice `k` of a node's pool.
pub fn slice_name(node: &str, k: usize) -> String {
    format!("{node}-gpuvisor-{k}")
}

/// Pairs a claim's allocated devices of one GPU and profile with the devices the agent already
/// prepared for that claim there (both sorted), so repeating a prepare maps each allocated slot
/// to the same VF; slots beyond the prepared devices get `None` (a VF is picked for them).
pub fn assign<'a>(slots: &[&'a str], prepared: &[String]) -> Vec<(&'a str, Option<String>)> {
    let mut slots = slots.to_vec();
    slots.sort();
    let mut prepared = prepared.to_vec();
    prepared.sort();
    slots.into_iter().enumerate().map(|(i, s)| (s, prepared.get(i).cloned())).collect()
}

#[cfg(test)]
mod tests;
