//! `tenant-isolation`: a site `placement` plugin for gpuvisor.
//!
//! Rule: instances of different tenants never share a GPU. The tenant is the value of
//! one label (`params.tenant_label`, default `"tenant"`); an instance without that label
//! counts as its own tenant, "no tenant". A GPU is usable when every claimed device on it
//! belongs to the requesting tenant. GPUs listed in `params.reserved_gpus` (PF addresses)
//! are never used, e.g. to keep GPU 0 free for passthrough.
//!
//! Order: GPUs already running this tenant's vGPUs first (so tenants stay packed and other
//! GPUs stay empty for other tenants), then empty GPUs, then by PF address; within a GPU,
//! free devices before dirty ones, then by address.

use gpuvisor_sdk::abi::{log, LogLevel};
use gpuvisor_sdk::{profile_matches, DeviceState, DeviceView, GpuView, Labels, PlacementAnswer, PlacementInput};

/// The label that names the tenant when `params.tenant_label` is absent.
pub const DEFAULT_TENANT_LABEL: &str = "tenant";

/// The site parameters, read from `[plugins.placement.params]`.
struct Params {
    tenant_label: String,
    reserved_gpus: Vec<String>,
}

fn params(v: &serde_json::Value) -> Result<Params, String> {
    let tenant_label = match v.get("tenant_label") {
        None => DEFAULT_TENANT_LABEL.to_string(),
        Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
        Some(other) => return Err(format!("params.tenant_label must be a non-empty string, found {other}")),
    };
    let reserved_gpus = match v.get("reserved_gpus") {
        None => Vec::new(),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|g| {
                g.as_str()
                    .map(str::to_ascii_lowercase)
                    .ok_or_else(|| format!("params.reserved_gpus: {g} is not a string"))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("params.reserved_gpus must be a list of PF addresses, found {other}")),
    };
    Ok(Params { tenant_label, reserved_gpus })
}

/// Ranks the devices the request may use, best first.
pub fn place(input: &PlacementInput) -> Result<PlacementAnswer, String> {
    let p = params(&input.params)?;
    let tenant = tenant_of(&input.request.labels, &p.tenant_label);

    // (0 = already hosts this tenant, 1 = empty) and the GPU, for the GPUs we may use.
    let mut usable: Vec<(u8, &GpuView)> = Vec::new();
    for gpu in &input.inventory.gpus {
        if p.reserved_gpus.contains(&gpu.address.to_ascii_lowercase()) {
            continue;
        }
        let owners: Vec<Option<&str>> = gpu
            .devices
            .iter()
            .filter(|d| d.state == DeviceState::Claimed)
            .map(|d| match &d.owner {
                // An owner whose labels cannot be read may be another tenant.
                Some(o) if !o.labels_known => Some("(unknown owner)"),
                Some(o) => tenant_of(&o.labels, &p.tenant_label),
                None => None,
            })
            .collect();
        if owners.iter().any(|o| *o != tenant) {
            continue; // another tenant runs here
        }
        usable.push((if owners.is_empty() { 1 } else { 0 }, gpu));
    }
    usable.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.address.cmp(&b.1.address)));

    let ranked: Vec<String> = usable.iter().flat_map(|(_, gpu)| candidates(gpu, &input.request.profile)).collect();
    if ranked.is_empty() {
        let who = tenant.unwrap_or("no tenant");
        let profile = &input.request.profile;
        if usable.is_empty() {
            log(LogLevel::Info, &format!("no GPU free of other tenants for {who}"));
            return Ok(PlacementAnswer::Reject(format!(
                "no GPU without other tenants can take profile {profile} for tenant {who}"
            )));
        }
        // GPUs without other tenants exist, but none of their devices can take the profile.
        let gpus: Vec<&str> = usable.iter().map(|(_, gpu)| gpu.address.as_str()).collect();
        let gpus = gpus.join(", ");
        log(LogLevel::Info, &format!("no device of {gpus} can take {profile} for {who}"));
        return Ok(PlacementAnswer::Reject(format!(
            "the GPUs without other tenants ({gpus}) have no device that can take profile {profile} now \
             (in use, or running vGPUs of another size: a GPU runs one vGPU size at a time) for tenant {who}"
        )));
    }
    Ok(PlacementAnswer::Ranked(ranked))
}

fn tenant_of<'a>(labels: &'a Labels, key: &str) -> Option<&'a str> {
    labels.get(key).map(String::as_str)
}

/// Free devices that list the profile, then dirty ones (the agent decides whether a dirty
/// VF can take the profile once repaired), each by address.
fn candidates(gpu: &GpuView, profile: &str) -> Vec<String> {
    let mut devices: Vec<&DeviceView> = gpu
        .devices
        .iter()
        .filter(|d| match d.state {
            DeviceState::Free => d.creatable.iter().any(|c| profile_matches(profile, c)),
            DeviceState::Dirty => true,
            _ => false,
        })
        .collect();
    devices.sort_by_key(|d| (d.state == DeviceState::Dirty, d.address.to_ascii_lowercase()));
    devices.into_iter().map(|d| d.address.clone()).collect()
}

gpuvisor_sdk::export_plugin! {
    name: "tenant-isolation",
    version: env!("CARGO_PKG_VERSION"),
    placement: crate::place,
}
