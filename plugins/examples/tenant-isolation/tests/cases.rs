//! The shared cases (tests/cases.json) against the Rust reference: every placement fixture
//! has a case, and each case's `expect` is this crate's answer. The Python and JavaScript
//! ports check themselves against the same file. `TENANT_ISOLATION_BLESS=1 cargo test -p
//! tenant-isolation` rewrites the `expect`s.

use gpuvisor_sdk::testing::run_native_str;
use gpuvisor_sdk::PlacementInput;
use serde_json::Value;
use std::path::{Path, PathBuf};
use tenant_isolation::place;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// The v1 input of a case: its fixture, the `set` replacements, the `params` text.
pub fn case_input(case: &Value) -> Value {
    let fixture = dir().join("../../fixtures").join(case["fixture"].as_str().unwrap());
    let mut input: Value = serde_json::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    for op in case["set"].as_array().into_iter().flatten() {
        let (path, value) = (op[0].as_str().unwrap(), op[1].clone());
        let (parent, key) = path.rsplit_once('/').unwrap();
        match input.pointer_mut(parent).unwrap_or_else(|| panic!("{path}: no {parent}")) {
            Value::Object(o) => {
                o.insert(key.to_string(), value);
            }
            Value::Array(a) => a[key.parse::<usize>().unwrap()] = value,
            other => panic!("{path}: {other} is not a container"),
        }
    }
    if let Some(text) = case["params"].as_str() {
        input["params"] = serde_json::from_str(text).unwrap();
    }
    input
}

#[test]
fn the_shared_cases_are_the_reference_answers() {
    let path = dir().join("tests/cases.json");
    let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let bless = std::env::var_os("TENANT_ISOLATION_BLESS").is_some();
    let mut wrong = Vec::new();
    for case in doc["cases"].as_array_mut().unwrap() {
        let input = case_input(case);
        let reply = run_native_str::<PlacementInput, _, _>(&input.to_string(), place);
        if case["expect"] != reply {
            wrong.push(format!("{}: expected {}, the reference answers {reply}", case["name"], case["expect"]));
            case["expect"] = reply;
        }
    }
    if bless {
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
    } else {
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }
}

#[test]
fn every_placement_fixture_has_an_unchanged_case() {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(dir().join("tests/cases.json")).unwrap()).unwrap();
    let plain: Vec<&str> = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("set").is_none() && c.get("params").is_none())
        .map(|c| c["fixture"].as_str().unwrap())
        .collect();
    for entry in std::fs::read_dir(dir().join("../../fixtures")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.starts_with("placement-") && name.ends_with(".json") {
            assert!(plain.contains(&name.as_str()), "tests/cases.json has no plain case of {name}");
        }
    }
}
