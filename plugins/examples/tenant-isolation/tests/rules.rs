//! The tutorial's unit tests (docs/plugins.md, "Unit-test it natively"), on the fixture in
//! plugins/fixtures/ instead of a copy next to the tests.

use gpuvisor_sdk::testing::{load_input, run_native_placement};
use gpuvisor_sdk::{PlacementAnswer, PlacementInput};
use tenant_isolation::place;

// A recorded input: GPU 0000:41:00.0 runs a vGPU of tenant "acme", GPU 0001:81:00.0 one of
// tenant "globex"; the request is for tenant "globex".
const INPUT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/placement-mixed-states.json");

#[test]
fn a_tenant_only_goes_where_it_already_is_or_to_empty_gpus() {
    let reply = run_native_placement(INPUT, place).unwrap();
    let ranked = reply["ok"]["ranked"].as_array().unwrap();
    assert_eq!(ranked[0], "0001:81:00.6"); // globex's GPU, free VFs first
    assert_eq!(ranked.last().unwrap(), "0001:81:00.4"); // its dirty VF last
    assert!(ranked.iter().all(|d| d.as_str().unwrap().starts_with("0001:81:")), "{ranked:?}");
}

#[test]
fn a_new_tenant_is_rejected_when_every_gpu_has_another_one() {
    let mut input: PlacementInput = load_input(INPUT).unwrap();
    input.request.labels.insert("tenant".into(), "initech".into());
    assert!(matches!(place(&input), Ok(PlacementAnswer::Reject(why)) if why.contains("initech")));
}

#[test]
fn the_label_key_and_reserved_gpus_come_from_params() {
    let mut input: PlacementInput = load_input(INPUT).unwrap();
    // Keyed on "team", which nobody sets: every instance is "no tenant", so both GPUs are
    // usable, but GPU 0000:41:00.0 is reserved.
    input.params = serde_json::json!({"tenant_label": "team", "reserved_gpus": ["0000:41:00.0"]});
    let Ok(PlacementAnswer::Ranked(r)) = place(&input) else { panic!("rejected") };
    assert!(r.iter().all(|d| d.starts_with("0001:81:")));
}

#[test]
fn bad_params_are_an_error_so_the_agent_fails_closed() {
    let mut input: PlacementInput = load_input(INPUT).unwrap();
    input.params = serde_json::json!({"tenant_label": 7});
    let reply =
        gpuvisor_sdk::testing::run_native_str::<PlacementInput, _, _>(&serde_json::to_string(&input).unwrap(), place);
    assert!(reply["error"].as_str().unwrap().contains("tenant_label"));
}
