//! End to end: ABI v1 and v2 plugins side by side in the real agent. The placement slot
//! holds the tutorial's tenant rule as a Python component, then (swapped in by
//! `plugin.reload`) as a JavaScript component; the hypervisor slot a v1 module; the grace
//! slot the v2 default. `plugin list` shows both ABIs; placements follow the rule.
//!
//! The components are built by `scripts/build-plugins` (`target/plugins/`).

use gpuvisor_e2e::*;
use serde_json::json;

fn built(name: &str) -> std::path::PathBuf {
    let p = target_dir().join("plugins").join(name);
    assert!(p.is_file(), "{} is missing: run scripts/build-plugins", p.display());
    p
}

fn create(a: &Agent, name: &str, tenant: &str) -> Result<serde_json::Value, RpcError> {
    a.call("instance.create", json!({"name": name, "image": "demo", "gpu": "L40S-2Q", "labels": {"tenant": tenant}}))
}

#[test]
fn v1_and_v2_plugins_run_side_by_side_and_a_python_then_a_javascript_rule_places() {
    let a = Agent::start_with(AgentOptions {
        placement: Some(built("tenant-isolation-py.wasm")),
        hypervisor: Some(plugin("hypervisor-default")),
        grace: Some(built("grace-default.wasm")),
        ..Default::default()
    })
    .unwrap();
    let list = a.ok("plugin.list", json!({}));
    let abis: Vec<(String, u64)> = list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_string(), p["abi"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        abis,
        vec![("tenant-isolation-py".into(), 2), ("hypervisor-default".into(), 1), ("grace-default".into(), 2)],
        "{list}"
    );
    let out = a.cli(&["plugin", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    println!("gpuvisor plugin list:\n{text}");
    assert!(out.status.success() && text.contains("ABI") && text.contains("v1") && text.contains("v2"), "{text}");

    // acme lands on an empty GPU; globex then gets the other one; a third tenant has none.
    let one = create(&a, "acme-1", "acme").unwrap();
    let two = create(&a, "globex-1", "globex").unwrap();
    assert_ne!(one["gpu"]["gpu"], two["gpu"]["gpu"], "two tenants never share a GPU: {one} {two}");
    let e = create(&a, "initech-1", "initech").unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert!(e.message.contains("initech"), "the plugin's reason reaches the caller: {e}");
    let same = create(&a, "acme-2", "acme").unwrap();
    assert_eq!(same["gpu"]["gpu"], one["gpu"]["gpu"], "a tenant stays packed on its GPU");

    // Swap in the JavaScript build of the same rule (it needs more fuel than the default).
    let cfg = std::fs::read_to_string(&a.config_path).unwrap();
    let py = built("tenant-isolation-py.wasm").display().to_string();
    let js = built("tenant-isolation-js.wasm").display().to_string();
    let swapped = cfg.replace(&format!("path = {py:?}"), &format!("path = {js:?}\nfuel = 100000000"));
    assert_ne!(swapped, cfg, "the placement slot was found in the config");
    std::fs::write(&a.config_path, swapped).unwrap();
    assert_eq!(a.ok("plugin.reload", json!({}))["plugins"]["placement"], "tenant-isolation-js");
    let three = create(&a, "globex-2", "globex").unwrap();
    assert_eq!(three["gpu"]["gpu"], two["gpu"]["gpu"], "the JS rule keeps globex on its GPU: {three}");
    let e = create(&a, "initech-2", "initech").unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
}
