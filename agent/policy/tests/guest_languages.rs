//! The tutorial's `tenant-isolation` placement rule in three languages, through the plugin
//! host: the Rust reference (`target/plugins/tenant-isolation.wasm`, ABI v1) and its ABI v2
//! components in Python (`tenant-isolation-py.wasm`, componentize-py) and JavaScript
//! (`tenant-isolation-js.wasm`, componentize-js), all built by `scripts/build-plugins` (the
//! guest toolchains come from `scripts/setup`). For every placement fixture
//! (`plugins/fixtures/placement-*.json`) and the shared cases
//! (`plugins/examples/tenant-isolation/tests/cases.json`: a third tenant, bad params,
//! reserved GPUs, ...) all three must give the same result JSON, the same log lines, and
//! the Rust reference's recorded answer.
//!
//! The interpreted guests get generous limits (a CPython or SpiderMonkey instance per call);
//! the fuel each guest used is printed (`cargo test -p gpuvisor-policy --test
//! guest_languages -- --nocapture`).

mod common;

use common::{fixture, root};
use gpuvisor_policy::{run_input, CallError, Limits, Plugin};
use gpuvisor_sdk::PolicyKind;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

/// The three builds of the rule: (file in target/plugins, manifest name).
const GUESTS: [(&str, &str); 3] = [
    ("tenant-isolation.wasm", "tenant-isolation"),
    ("tenant-isolation-py.wasm", "tenant-isolation-py"),
    ("tenant-isolation-js.wasm", "tenant-isolation-js"),
];

/// Limits for the interpreted guests (and, to compare like with like, the reference).
fn limits() -> Limits {
    Limits { fuel: 2_000_000_000, memory_bytes: 256 << 20, deadline: Duration::from_secs(10), ..Limits::default() }
}

fn built(file: &str) -> PathBuf {
    common::built(&format!("plugins/{file}"))
}

/// The three plugins, loaded once (compiling the interpreters takes a while).
fn load_guests() -> Vec<(&'static str, Plugin)> {
    GUESTS
        .iter()
        .map(|(file, name)| {
            let path = built(file);
            let plugin = Plugin::load(&path, PolicyKind::Placement, limits())
                .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
            assert_eq!(plugin.manifest().name, *name, "{}", path.display());
            assert_eq!(plugin.manifest().version, "0.1.0", "{}", path.display());
            assert_eq!(plugin.manifest().kinds, vec![PolicyKind::Placement], "{}", path.display());
            (*name, plugin)
        })
        .collect()
}

/// What one guest made of one input: the reply in the v1 shape (`{"ok": answer}` or
/// `{"error": message}`), its log lines, and the fuel it used.
struct Outcome {
    reply: Value,
    logs: Vec<(String, String)>,
    fuel: u64,
}

fn run(name: &str, plugin: &Plugin, input: &Value, what: &str) -> Outcome {
    let (result, report) = run_input(plugin, input).unwrap_or_else(|e| panic!("{what}: {name}: {e}"));
    let reply = match result {
        Ok(answer) => json!({ "ok": answer }),
        Err(CallError::Plugin { plugin, message, .. }) => {
            assert_eq!(plugin, name, "{what}");
            json!({ "error": message })
        }
        Err(other) => panic!("{what}: {name} failed: {other}"),
    };
    let logs = report.logs.iter().map(|l| (l.level.to_string(), l.line.clone())).collect();
    assert_eq!(report.logs_dropped, 0, "{what}: {name}");
    Outcome { reply, logs, fuel: report.fuel_used.unwrap_or(0) }
}

/// Runs `input` through every guest, checks that they agree (answer, error message, log
/// lines) and returns the common reply.
fn same_in_all(guests: &[(&'static str, Plugin)], input: &Value, what: &str) -> Value {
    let outcomes: Vec<(&str, Outcome)> =
        guests.iter().map(|(name, plugin)| (*name, run(name, plugin, input, what))).collect();
    let fuel: Vec<String> = outcomes.iter().map(|(name, o)| format!("{name} {}", o.fuel)).collect();
    println!("{what}: fuel {}", fuel.join(", "));
    let (reference, first) = &outcomes[0];
    for (name, o) in &outcomes[1..] {
        assert_eq!(o.reply, first.reply, "{what}: {name} and {reference} answer differently");
        assert_eq!(o.logs, first.logs, "{what}: {name} and {reference} log differently");
    }
    first.reply.clone()
}

fn read_json(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The v1 input of a shared case: its fixture, its `set` replacements ([JSON pointer,
/// value]; a missing last key is added), its `params` (JSON text).
fn case_input(case: &Value) -> Value {
    let mut input = read_json(&fixture(case["fixture"].as_str().unwrap()));
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

fn placement_fixtures() -> Vec<(String, Value)> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("plugins/fixtures"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("placement-") && n.ends_with(".json"))
        .collect();
    names.sort();
    assert!(!names.is_empty());
    names.into_iter().map(|n| (n.clone(), read_json(&fixture(&n)))).collect()
}

// One test: the interpreted guests are compiled once, not once per test.
#[test]
fn rust_python_and_javascript_guests_answer_alike() {
    let guests = load_guests();

    // Every placement fixture as it is.
    for (name, input) in placement_fixtures() {
        let reply = same_in_all(&guests, &input, &name);
        assert!(reply.get("ok").is_some(), "{name}: {reply}");
    }

    let mixed = read_json(&fixture("placement-mixed-states.json"));

    // A third tenant: every GPU runs another one.
    let mut input = mixed.clone();
    input["request"]["labels"]["tenant"] = json!("initech");
    assert_eq!(
        same_in_all(&guests, &input, "a third tenant"),
        json!({"ok": {"reject": "no GPU without other tenants can take profile l40s-4q for tenant initech"}})
    );

    // Bad params: the same error message from all three.
    let mut input = mixed.clone();
    input["params"] = json!({"tenant_label": 7});
    assert_eq!(
        same_in_all(&guests, &input, "tenant_label 7"),
        json!({"error": "params.tenant_label must be a non-empty string, found 7"})
    );

    // reserved_gpus: keyed on a label nobody sets (every instance is "no tenant"), so
    // both GPUs are usable, but 0000:41:00.0 is reserved.
    let mut input = mixed.clone();
    input["params"] = json!({"tenant_label": "team", "reserved_gpus": ["0000:41:00.0"]});
    let reply = same_in_all(&guests, &input, "reserved_gpus");
    let ranked = reply["ok"]["ranked"].as_array().unwrap_or_else(|| panic!("reserved_gpus: {reply}"));
    assert!(!ranked.is_empty() && ranked.iter().all(|d| d.as_str().unwrap().starts_with("0001:81:")), "{reply}");

    // The shared cases, with the reference's recorded answers.
    let cases = read_json(&root().join("plugins/examples/tenant-isolation/tests/cases.json"));
    for case in cases["cases"].as_array().unwrap() {
        let what = format!("case {:?}", case["name"].as_str().unwrap());
        assert_eq!(same_in_all(&guests, &case_input(case), &what), case["expect"], "{what}");
    }
}
