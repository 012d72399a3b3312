//! Every fixture of the default plugins (`plugins/fixtures/`) converts to the ABI v2
//! (WIT) input of its kind and back unchanged (feature `v2`), but for absent params
//! (`null` in the SDK), which are `{}` in WIT.
#![cfg(feature = "v2")]

use gpuvisor_sdk::testing::load_input;
use gpuvisor_sdk::v2::wit;
use gpuvisor_sdk::{GraceInput, HypervisorInput, PlacementInput};
use std::path::Path;

fn absent_to_empty(params: &mut serde_json::Value) {
    if params.is_null() {
        *params = serde_json::json!({});
    }
}

#[test]
fn every_fixture_survives_the_round_trip_through_wit() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/fixtures");
    let mut seen = [0usize; 3];
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("placement-") {
            let mut input: PlacementInput = load_input(&path).unwrap();
            absent_to_empty(&mut input.params);
            let back = PlacementInput::try_from(wit::placement::PlacementInput::from(&input)).unwrap();
            assert_eq!(back, input, "{name}");
            seen[0] += 1;
        } else if name.starts_with("hypervisor-") {
            let mut input: HypervisorInput = load_input(&path).unwrap();
            absent_to_empty(&mut input.params);
            let back = HypervisorInput::try_from(wit::hypervisor::HypervisorInput::from(&input)).unwrap();
            assert_eq!(back, input, "{name}");
            seen[1] += 1;
        } else if name.starts_with("grace-") {
            let mut input: GraceInput = load_input(&path).unwrap();
            absent_to_empty(&mut input.params);
            let back = GraceInput::try_from(wit::grace::GraceInput::from(&input)).unwrap();
            assert_eq!(back, input, "{name}");
            seen[2] += 1;
        }
    }
    assert!(seen.iter().all(|&n| n > 0), "fixtures of every kind: {seen:?}");
}
