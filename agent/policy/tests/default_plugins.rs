//! The default plugins on recorded inputs of the `l40s-2x16` host: natively and through
//! wasmtime (the release wasm32 builds), with identical answers and the expected order.

mod common;

use common::{built_plugin, fixture};
use gpuvisor_policy::{run_plugin_file, Limits, Plugin};
use gpuvisor_sdk::testing::load_input;
use gpuvisor_sdk::{
    GraceAction, GraceAnswer, GraceInput, HypervisorAnswer, HypervisorInput, PlacementAnswer, PlacementInput,
    PolicyKind,
};

fn vfs(domain_bus: &str) -> Vec<String> {
    (4..20).map(|n| format!("{domain_bus}:{:02x}.{}", n / 8, n % 8)).collect()
}

fn gpu0() -> Vec<String> {
    vfs("0000:41")
}

fn gpu1() -> Vec<String> {
    vfs("0001:81")
}

fn placement(plugin: &str, native: fn(&PlacementInput) -> PlacementAnswer, name: &str) -> Vec<String> {
    let input: PlacementInput = load_input(fixture(name)).unwrap();
    let wasm = Plugin::load(&built_plugin(plugin), PolicyKind::Placement, Limits::default()).unwrap();
    let through_wasm = wasm.call_placement(&input).unwrap();
    assert_eq!(through_wasm, native(&input), "{plugin} on {name}: wasm and native differ");
    match through_wasm {
        PlacementAnswer::Ranked(r) => r,
        PlacementAnswer::Reject(why) => panic!("{plugin} rejected {name}: {why}"),
    }
}

#[test]
fn the_vf_helper_matches_the_host_layout() {
    assert_eq!(gpu0()[0], "0000:41:00.4");
    assert_eq!(gpu0()[4], "0000:41:01.0");
    assert_eq!(gpu0()[15], "0000:41:02.3");
}

#[test]
fn spread_and_pack_start_an_empty_host_on_the_first_vf() {
    let all: Vec<String> = gpu0().into_iter().chain(gpu1()).collect();
    assert_eq!(placement("placement-spread", placement_spread::place, "placement-empty-2q.json"), all);
    assert_eq!(placement("placement-pack", placement_pack::place, "placement-empty-2q.json"), all);
}

#[test]
fn spread_puts_the_second_instance_on_the_other_gpu() {
    let ranked = placement("placement-spread", placement_spread::place, "placement-second-2q.json");
    let expected: Vec<String> = gpu1().into_iter().chain(gpu0().into_iter().skip(1)).collect();
    assert_eq!(ranked, expected);
}

#[test]
fn pack_keeps_the_second_instance_on_the_same_gpu() {
    let ranked = placement("placement-pack", placement_pack::place, "placement-second-2q.json");
    let expected: Vec<String> = gpu0().into_iter().skip(1).chain(gpu1()).collect();
    assert_eq!(ranked, expected);
}

#[test]
fn placement_skips_claimed_quarantined_unreadable_and_incapable_devices_and_ranks_dirty_last() {
    let (g0, g1) = (gpu0(), gpu1());
    // Equal load: GPU 0 by address first (the inventory lists GPU 1 first on purpose).
    let mut expected: Vec<String> = g0[3..].to_vec();
    expected.extend_from_slice(&g1[2..15]);
    expected.push(g1[0].clone()); // dirty
    for plugin in ["placement-spread", "placement-pack"] {
        let native = if plugin == "placement-spread" { placement_spread::place } else { placement_pack::place };
        let ranked = placement(plugin, native, "placement-mixed-states.json");
        assert_eq!(ranked, expected, "{plugin}");
    }
}

fn hypervisor(name: &str) -> HypervisorAnswer {
    let input: HypervisorInput = load_input(fixture(name)).unwrap();
    let wasm = Plugin::load(&built_plugin("hypervisor-default"), PolicyKind::Hypervisor, Limits::default()).unwrap();
    let answer = wasm.call_hypervisor(&input).unwrap();
    assert_eq!(Ok(answer.clone()), hypervisor_default::choose(&input), "{name}: wasm and native differ");
    answer
}

#[test]
fn hypervisor_default_replaces_a_requested_vmm_that_cannot_carry_the_gpu_by_qemu() {
    assert_eq!(hypervisor("hypervisor-gpu-requests-ch.json"), HypervisorAnswer::Hypervisor("qemu".into()));
}

#[test]
fn hypervisor_default_honours_a_capable_request() {
    assert_eq!(
        hypervisor("hypervisor-plain-requests-ch.json"),
        HypervisorAnswer::Hypervisor("cloud-hypervisor".into())
    );
}

#[test]
fn hypervisor_default_uses_the_site_default_for_plain_instances() {
    assert_eq!(
        hypervisor("hypervisor-plain-site-default.json"),
        HypervisorAnswer::Hypervisor("cloud-hypervisor".into())
    );
}

#[test]
fn hypervisor_default_rejects_when_nothing_fits() {
    assert!(matches!(hypervisor("hypervisor-no-fit.json"), HypervisorAnswer::Reject(_)));
}

fn grace(name: &str) -> GraceAnswer {
    let input: GraceInput = load_input(fixture(name)).unwrap();
    let wasm = Plugin::load(&built_plugin("grace-default"), PolicyKind::Grace, Limits::default()).unwrap();
    let answer = wasm.call_grace(&input).unwrap();
    assert_eq!(Ok(answer.clone()), grace_default::decide(&input), "{name}: wasm and native differ");
    assert_eq!(answer.decisions.len(), input.items.len());
    for (d, item) in answer.decisions.iter().zip(&input.items) {
        assert_eq!(d.device, item.device);
        assert!(!d.reason.is_empty());
    }
    answer
}

#[test]
fn grace_default_releases_dead_owners_at_once_and_holds_young_claims_and_orphans() {
    use GraceAction::{Keep, Release};
    let got: Vec<(GraceAction, Option<u64>)> =
        grace("grace-mixed.json").decisions.into_iter().map(|d| (d.action, d.recheck_after_ms)).collect();
    assert_eq!(
        got,
        vec![
            (Release, None),       // owner stopped
            (Release, None),       // owner cleanup_pending
            (Release, None),       // recorded VMM provably dead
            (Keep, Some(180_000)), // starting, no identity, 120 s old
            (Release, None),       // starting, no identity, 301 s old
            (Release, None),       // earlier boot
            (Release, None),       // owner absent
            (Keep, Some(270_000)), // orphan VF 30 s
            (Release, None),       // orphan VF 300 s
            (Keep, Some(200_000)), // orphan mdev 100 s
        ]
    );
}

#[test]
fn grace_default_reads_claim_grace_from_params() {
    let got: Vec<Option<u64>> =
        grace("grace-short-grace.json").decisions.into_iter().map(|d| d.recheck_after_ms).collect();
    assert_eq!(got, vec![Some(15_000), Some(1_000)]);
}

#[test]
fn plugin_test_runs_a_file_with_the_kind_from_the_manifest() {
    let answer =
        run_plugin_file(&built_plugin("placement-spread"), &fixture("placement-second-2q.json"), None).unwrap();
    assert_eq!(answer["ranked"][0], "0001:81:00.4");
}

#[test]
fn manifests_name_the_plugin_and_its_kind() {
    for (name, kind) in [
        ("placement-spread", PolicyKind::Placement),
        ("placement-pack", PolicyKind::Placement),
        ("hypervisor-default", PolicyKind::Hypervisor),
        ("grace-default", PolicyKind::Grace),
    ] {
        let p = Plugin::load(&built_plugin(name), kind, Limits::default()).unwrap();
        assert_eq!(p.manifest().name, name);
        assert_eq!(p.manifest().kinds, vec![kind]);
    }
}

#[test]
fn undecodable_input_is_the_plugins_error_not_a_crash() {
    let p = Plugin::load(&built_plugin("placement-spread"), PolicyKind::Placement, Limits::default()).unwrap();
    let err = p.call_json(PolicyKind::Placement, &serde_json::json!({"request": 1})).unwrap_err();
    assert_eq!(err.reason(), "plugin_error", "{err}");
    assert!(err.to_string().contains("placement-spread"), "{err}");
}

/// Prints the per-call cost (not a timed assertion): `cargo test -p gpuvisor-policy --release
/// --test default_plugins -- --nocapture per_call_cost`.
#[test]
fn per_call_cost() {
    let input: PlacementInput = load_input(fixture("placement-second-2q.json")).unwrap();
    let p = Plugin::load(&built_plugin("placement-spread"), PolicyKind::Placement, Limits::default()).unwrap();
    let n = 200;
    let started = std::time::Instant::now();
    for _ in 0..n {
        p.call_placement(&input).unwrap();
    }
    let per_call = started.elapsed() / n;
    let stats = p.stats();
    assert_eq!(stats.calls_ok, u64::from(n));
    println!(
        "placement-spread on a 2x16 inventory: {per_call:?} per call (fresh instance each), {} fuel per call",
        stats.fuel_consumed / u64::from(n)
    );
}
