//! `placement-spread`, the default `placement` plugin (docs/plugins.md): spread instances over
//! the GPUs so each gets as much headroom as possible.
//!
//! Order:
//! 1. GPUs whose load is known (`load_known`) before those whose load is only a lower
//!    bound (a claim of a profile without a size in its name): an unknown load puts a GPU
//!    last but does not exclude it (docs/design/scenarios.md S005). Then by least
//!    `claimed_framebuffer_mib`, then by PF address.
//! 2. Within a GPU: `free` devices before `dirty` ones (a dirty VF needs a repair first),
//!    then by address.
//!
//! Candidates: `free` devices whose `creatable` lists the requested profile (canonical
//! name, ASCII case-insensitive), any `dirty` device (vendor VFIO: the agent checks
//! whether it can take the profile once repaired), and for passthrough every `free`
//! device. `claimed`, `quarantined` and `unreadable` devices are never ranked. No
//! candidate → `{"reject": "..."}`.
//!
//! The plugin reads no `params`.

use gpuvisor_sdk::{
    profile_matches, DeviceState, DeviceView, Framework, GpuView, PlacementAnswer, PlacementInput, PlacementRequest,
};

/// Ranks the candidate devices for `input.request`, best first; see the crate docs.
pub fn place(input: &PlacementInput) -> PlacementAnswer {
    let mut gpus: Vec<&GpuView> = input.inventory.gpus.iter().collect();
    gpus.sort_by(|a, b| {
        b.load_known
            .cmp(&a.load_known)
            .then_with(|| a.claimed_framebuffer_mib.cmp(&b.claimed_framebuffer_mib))
            .then_with(|| address_key(&a.address).cmp(&address_key(&b.address)))
    });
    let ranked: Vec<String> = gpus.into_iter().flat_map(|gpu| ranked_devices(gpu, &input.request)).collect();
    if ranked.is_empty() {
        PlacementAnswer::Reject(if input.request.framework == Framework::Passthrough {
            "no free passthrough GPU".to_string()
        } else {
            format!("no free or dirty device can take profile {}", input.request.profile)
        })
    } else {
        PlacementAnswer::Ranked(ranked)
    }
}

/// The candidate devices of one GPU, free before dirty, then by address.
fn ranked_devices(gpu: &GpuView, request: &PlacementRequest) -> Vec<String> {
    let mut devices: Vec<&DeviceView> = gpu.devices.iter().filter(|d| is_candidate(d, request)).collect();
    devices.sort_by(|a, b| {
        (a.state == DeviceState::Dirty)
            .cmp(&(b.state == DeviceState::Dirty))
            .then_with(|| address_key(&a.address).cmp(&address_key(&b.address)))
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

/// BDFs compare as lower-case text: `dddd:bb:dd.f` is fixed-width hex.
fn address_key(address: &str) -> String {
    address.to_ascii_lowercase()
}

#[cfg(not(feature = "v2"))]
gpuvisor_sdk::export_plugin! {
    name: "placement-spread",
    version: env!("CARGO_PKG_VERSION"),
    placement: crate::place,
}

#[cfg(feature = "v2")]
gpuvisor_sdk::export_plugin_v2! {
    name: "placement-spread",
    version: env!("CARGO_PKG_VERSION"),
    placement: crate::place,
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvisor_sdk::testing::{load_input, run_native_placement};

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/");

    #[test]
    fn second_instance_goes_to_the_other_gpu() {
        let reply = run_native_placement(format!("{FIXTURES}placement-second-2q.json"), place).unwrap();
        assert_eq!(reply["ok"]["ranked"][0], "0001:81:00.4");
        assert_eq!(reply["ok"]["ranked"][16], "0000:41:00.5");
    }

    #[test]
    fn known_load_ranks_before_unknown_load_of_the_same_size() {
        let mut input: PlacementInput = load_input(format!("{FIXTURES}placement-empty-2q.json")).unwrap();
        input.inventory.gpus[0].load_known = false;
        let PlacementAnswer::Ranked(r) = place(&input) else { panic!("rejected") };
        assert_eq!(r[0], "0001:81:00.4");
    }

    #[test]
    fn an_unknown_load_ranks_last_even_when_its_lower_bound_is_smaller() {
        // S005: g0's claims include a profile of unknown size (lower bound 0 MiB), g1 holds
        // 1 GiB of known load: g1 first; g0 still ranked, after it.
        let mut input: PlacementInput = load_input(format!("{FIXTURES}placement-empty-2q.json")).unwrap();
        input.inventory.gpus[0].load_known = false;
        input.inventory.gpus[0].claimed_framebuffer_mib = 0;
        input.inventory.gpus[1].claimed_framebuffer_mib = 1024;
        let PlacementAnswer::Ranked(r) = place(&input) else { panic!("rejected") };
        assert!(r[0].starts_with("0001:81:"), "{r:?}");
        assert!(r.iter().any(|d| d.starts_with("0000:41:")), "g0 is not excluded: {r:?}");
    }

    #[test]
    fn nothing_to_rank_is_a_reject_with_the_profile() {
        let mut input: PlacementInput = load_input(format!("{FIXTURES}placement-empty-2q.json")).unwrap();
        input.request.profile = "L40S-3Q".into();
        assert!(matches!(place(&input), PlacementAnswer::Reject(why) if why.contains("L40S-3Q")));
    }
}
