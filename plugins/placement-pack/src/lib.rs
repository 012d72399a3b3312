//! `placement-pack`, the shipped alternative `placement` plugin (docs/plugins.md): fill GPUs
//! one after the other, keeping empty GPUs free for other vGPU sizes and for passthrough.
//!
//! Under the equal-size rule (docs/design/host.md §3.4) a GPU that holds vGPUs of size S can
//! only take more of size S, so the order of GPUs is:
//! 1. GPUs already running vGPUs of the requested framebuffer size (a claimed device whose
//!    owner's profile has that size);
//! 2. other non-empty GPUs (claimed or dirty devices, or claimed framebuffer) — e.g. in
//!    mixed-size mode;
//! 3. empty GPUs last.
//!
//! Within each class: best fit first — the GPU with the least remaining framebuffer
//! (`framebuffer_mib - claimed_framebuffer_mib`) that still fits the request; GPUs whose
//! remaining capacity is unknown (unknown size or `load_known: false`) next, GPUs known to
//! be too small last; then by PF address. Within a GPU: `free` before `dirty`, then
//! address. Candidates are those of `placement-spread`: `free` devices listing the profile
//! in `creatable`, `dirty` devices, every `free` device for passthrough; never `claimed`,
//! `quarantined` or `unreadable`. No candidate → `{"reject": "..."}`.
//!
//! The plugin reads no `params`.

use gpuvisor_sdk::{
    profile_framebuffer_mib, profile_matches, DeviceState, DeviceView, Framework, GpuView, PlacementAnswer,
    PlacementInput, PlacementRequest,
};

/// Ranks the candidate devices for `input.request`, best first; see the crate docs.
pub fn place(input: &PlacementInput) -> PlacementAnswer {
    let request = &input.request;
    let need_mib = request.framebuffer_mib.or_else(|| profile_framebuffer_mib(&request.profile));
    let mut gpus: Vec<(GpuKey, Vec<String>)> = input
        .inventory
        .gpus
        .iter()
        .map(|gpu| (gpu_key(gpu, need_mib), ranked_devices(gpu, request)))
        .filter(|(_, devices)| !devices.is_empty())
        .collect();
    gpus.sort_by(|a, b| a.0.cmp(&b.0));
    let ranked: Vec<String> = gpus.into_iter().flat_map(|(_, devices)| devices).collect();
    if ranked.is_empty() {
        PlacementAnswer::Reject(if request.framework == Framework::Passthrough {
            "no free passthrough GPU".to_string()
        } else {
            format!("no free or dirty device can take profile {}", request.profile)
        })
    } else {
        PlacementAnswer::Ranked(ranked)
    }
}

/// Sort key of a GPU: smaller is better.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct GpuKey {
    /// 0 same size running, 1 other non-empty, 2 empty.
    class: u8,
    /// 0 known to fit, 1 unknown, 2 known too small.
    fit: u8,
    /// Remaining framebuffer in MiB (0 when unknown).
    remaining_mib: u64,
    address: String,
}

fn gpu_key(gpu: &GpuView, need_mib: Option<u64>) -> GpuKey {
    let same_size = need_mib.is_some()
        && gpu.devices.iter().any(|d| {
            d.state == DeviceState::Claimed
                && d.owner.as_ref().and_then(|o| o.profile.as_deref()).and_then(profile_framebuffer_mib) == need_mib
        });
    let occupied = gpu.claimed_framebuffer_mib > 0
        || !gpu.load_known
        || gpu.devices.iter().any(|d| matches!(d.state, DeviceState::Claimed | DeviceState::Dirty));
    let class = if same_size {
        0
    } else if occupied {
        1
    } else {
        2
    };
    let remaining = match (gpu.framebuffer_mib, gpu.load_known) {
        (Some(total), true) => Some(total.saturating_sub(gpu.claimed_framebuffer_mib)),
        _ => None,
    };
    let fit = match (remaining, need_mib) {
        (Some(r), Some(n)) if r >= n => 0,
        (Some(_), None) => 0,
        (None, _) => 1,
        (Some(_), Some(_)) => 2,
    };
    GpuKey { class, fit, remaining_mib: remaining.unwrap_or(0), address: gpu.address.to_ascii_lowercase() }
}

/// The candidate devices of one GPU, free before dirty, then by address.
fn ranked_devices(gpu: &GpuView, request: &PlacementRequest) -> Vec<String> {
    let mut devices: Vec<&DeviceView> = gpu.devices.iter().filter(|d| is_candidate(d, request)).collect();
    devices.sort_by(|a, b| {
        (a.state == DeviceState::Dirty)
            .cmp(&(b.state == DeviceState::Dirty))
            .then_with(|| a.address.to_ascii_lowercase().cmp(&b.address.to_ascii_lowercase()))
    });
    devices.into_iter().map(|d| d.address.clone()).collect()
}

/// True for a device the agent could give this request (before its own validation).
fn is_candidate(device: &DeviceView, request: &PlacementRequest) -> bool {
    match device.state {
        DeviceState::Free => {
            request.framework == Framework::Passthrough
                || device.creatable.iter().any(|p| profile_matches(&request.profile, p))
        }
        DeviceState::Dirty => request.framework != Framework::Passthrough,
        DeviceState::Claimed | DeviceState::Quarantined | DeviceState::Unreadable => false,
    }
}

#[cfg(not(feature = "v2"))]
gpuvisor_sdk::export_plugin! {
    name: "placement-pack",
    version: env!("CARGO_PKG_VERSION"),
    placement: crate::place,
}

#[cfg(feature = "v2")]
gpuvisor_sdk::export_plugin_v2! {
    name: "placement-pack",
    version: env!("CARGO_PKG_VERSION"),
    placement: crate::place,
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvisor_sdk::testing::{load_input, run_native_placement};

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/");

    #[test]
    fn second_instance_stays_on_the_same_gpu() {
        let reply = run_native_placement(format!("{FIXTURES}placement-second-2q.json"), place).unwrap();
        assert_eq!(reply["ok"]["ranked"][0], "0000:41:00.5");
        assert_eq!(reply["ok"]["ranked"][15], "0001:81:00.4");
    }

    #[test]
    fn a_different_size_goes_to_the_empty_gpu_only_after_busy_ones() {
        // A 4Q request: GPU 0 runs 2Q (other size, non-empty), GPU 1 is empty. Neither lists
        // 4Q on GPU 0 (equal-size rule), so only GPU 1's VFs are ranked.
        let mut input: PlacementInput = load_input(format!("{FIXTURES}placement-second-2q.json")).unwrap();
        input.request.profile = "L40S-4Q".into();
        input.request.framebuffer_mib = Some(4096);
        let PlacementAnswer::Ranked(r) = place(&input) else { panic!("rejected") };
        assert_eq!(r.len(), 16);
        assert!(r.iter().all(|a| a.starts_with("0001:81:")));
    }

    #[test]
    fn best_fit_prefers_the_fuller_gpu_among_non_empty_ones() {
        let mut input: PlacementInput = load_input(format!("{FIXTURES}placement-empty-2q.json")).unwrap();
        // Mixed-size mode: both GPUs list every profile but GPU 1 carries more load.
        input.inventory.gpus[0].claimed_framebuffer_mib = 8192;
        input.inventory.gpus[1].claimed_framebuffer_mib = 24576;
        input.request.profile = "L40S-1Q".into();
        input.request.framebuffer_mib = Some(1024);
        let PlacementAnswer::Ranked(r) = place(&input) else { panic!("rejected") };
        assert_eq!(r[0], "0001:81:00.4");
    }
}
