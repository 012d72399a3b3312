//! End to end: policy plugins through the agent. A plugin only advises: the agent drops
//! illegal answers (never double-claims), turns broken plugins into `policy_failed` with
//! nothing allocated, refuses a hypervisor choice that cannot carry a vGPU before anything
//! is allocated, and refuses to start with a plugin that imports WASI.

use gpuvisor_e2e::*;
use serde_json::json;
use std::time::Duration;

fn with_placement(file: &str) -> Agent {
    Agent::start_with(AgentOptions { placement: Some(fixture_plugin(file)), ..Default::default() }).unwrap()
}

fn rejected_answers(a: &Agent) -> f64 {
    let text = a.metrics();
    metric(&text, "gpuvisor_policy_rejected_answers", &[]).unwrap_or_else(|| panic!("no rejected counter:\n{text}"))
}

fn devices_claimed(a: &Agent) -> Vec<String> {
    let mut d: Vec<String> = a.claims().iter().map(|c| c["device"].as_str().unwrap().to_string()).collect();
    d.sort();
    d
}

#[test]
fn rank_fixed_drops_a_claimed_vf_and_lands_the_next_create_on_the_next_ranked() {
    let a = with_placement("rank-fixed.wat");
    assert_eq!(a.ok("plugin.list", json!({}))["plugins"][0]["name"], "rank-fixed");

    let one = a.create_gpu("one", "L40S-2Q").unwrap();
    assert_eq!(one["gpu"]["device"], "0000:41:00.4");
    assert_eq!(rejected_answers(&a), 0.0, "both ranked VFs were legal");

    // The plugin ranks .4 again: the agent drops it (claimed) and uses .5.
    let dry = a.ok("placement.dry_run", json!({"profile": "L40S-2Q"}));
    let ranked: Vec<&str> = dry["ranked"].as_array().unwrap().iter().map(|r| r["device"].as_str().unwrap()).collect();
    assert_eq!(ranked, vec!["0000:41:00.5"], "the claimed VF is not offered: {dry}");
    let two = a.create_gpu("two", "L40S-2Q").unwrap();
    assert_eq!(two["gpu"]["device"], "0000:41:00.5");
    assert_eq!(devices_claimed(&a), vec!["0000:41:00.4", "0000:41:00.5"], "one claim per VF, never doubled");
    let owners: Vec<&str> = vec![one["id"].as_str().unwrap(), two["id"].as_str().unwrap()];
    for c in a.claims() {
        let expect = if c["device"] == "0000:41:00.4" { owners[0] } else { owners[1] };
        assert_eq!(c["instance_id"], expect, "{c}");
    }
    assert!(rejected_answers(&a) > 0.0, "the dropped answer is counted");

    // Both ranked VFs are claimed: no_capacity, nothing else claimed or written.
    let writes_before = a.sim_writes();
    let e = a.create_gpu("three", "L40S-2Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "{e}");
    assert_eq!(devices_claimed(&a), vec!["0000:41:00.4", "0000:41:00.5"]);
    assert_eq!(a.sim_writes(), writes_before, "nothing written");
    let mut names = a.instance_names();
    names.sort();
    assert_eq!(names, vec!["one", "two"], "no third instance left");
    assert_eq!(set_vfs(&a.state()), vec![("0000:41:00.4".into(), 1148), ("0000:41:00.5".into(), 1148)]);
}

/// A placement plugin that fails (trap, endless loop, non-JSON reply) makes create answer
/// 500 `policy_failed` and leaves nothing.
fn broken_placement_fails_create_and_leaves_nothing(file: &str) {
    let a = with_placement(file);
    let e = a.create_gpu("vm", "L40S-2Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (500, "policy_failed"), "{file}: {e}");
    assert!(!e.message.is_empty());
    assert!(a.claims().is_empty(), "{file}: nothing claimed: {:?}", a.claims());
    assert!(a.sim_writes().is_empty(), "{file}: nothing written: {:?}", a.sim_writes());
    assert!(a.instance_names().is_empty(), "{file}: no instance left");
    assert!(a.data_files("instances").is_empty(), "{file}: no instance record: {:?}", a.data_files("instances"));
    assert!(a.qemu_pids().is_empty(), "{file}: no QEMU");
    let e = a.err("placement.dry_run", json!({"profile": "L40S-2Q"}));
    assert_eq!((e.code, e.data_code.as_str()), (500, "policy_failed"), "{file}: dry run: {e}");
    let p = &a.ok("plugin.list", json!({}))["plugins"][0];
    assert!(p["calls_failed"].as_u64().unwrap() >= 2, "{file}: failures counted: {p}");
    // The agent is still serving.
    a.ok("agent.health", json!({}));
}

#[test]
fn a_trapping_placement_plugin_fails_create_with_policy_failed_and_leaves_nothing() {
    broken_placement_fails_create_and_leaves_nothing("trap.wat");
}

#[test]
fn a_looping_placement_plugin_fails_create_with_policy_failed_and_leaves_nothing() {
    broken_placement_fails_create_and_leaves_nothing("loop.wat");
}

#[test]
fn a_placement_plugin_answering_garbage_fails_create_with_policy_failed_and_leaves_nothing() {
    broken_placement_fails_create_and_leaves_nothing("garbage.wat");
}

#[test]
fn a_hypervisor_choice_that_cannot_carry_a_vgpu_is_refused_before_anything_is_allocated() {
    let a = Agent::start_with(AgentOptions { hypervisor: Some(fixture_plugin("hv-cloud.wat")), ..Default::default() })
        .unwrap();
    let e = a.create_gpu("vm", "L40S-2Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (400, "hypervisor_unsupported"), "{e}");
    assert!(a.claims().is_empty(), "no claim: {:?}", a.claims());
    assert!(a.sim_writes().is_empty(), "no sysfs write: {:?}", a.sim_writes());
    assert!(a.instance_names().is_empty(), "no instance");
    assert!(a.data_files("instances").is_empty(), "no instance record: {:?}", a.data_files("instances"));
    assert!(a.qemu_pids().is_empty());
    assert!(set_vfs(&a.state()).is_empty());
}

#[test]
fn an_agent_with_a_wasi_importing_plugin_refuses_to_start_and_names_it() {
    let sim = SimMount::start("l40s-2x16").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gpuvisor.sock");
    let wasi = fixture_plugin("wasi.wat");
    let cfg = dir.path().join("gpuvisor.toml");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = {:?}\nsocket = {:?}\nhost_root = {:?}\naccel = \"tcg\"\nvfio_attach = \"hold-fd\"\n\
             [plugins.placement]\npath = {:?}\n[plugins.hypervisor]\npath = {:?}\n",
            dir.path().join("data"),
            socket,
            sim.path(),
            wasi,
            plugin("hypervisor-default"),
        ),
    )
    .unwrap();
    let (status, out) = serve_expecting_exit(&cfg, Duration::from_secs(30)).unwrap();
    assert!(!status.success(), "the agent must refuse to start: {status}\n{out}");
    assert!(out.contains("wasi.wat"), "the message names the plugin: {out}");
    assert!(!socket.exists(), "no socket was served");
    assert!(writes(&sim.state().unwrap()).is_empty(), "nothing written on the host");
}

#[test]
fn placement_dry_run_returns_the_ranked_list_without_claiming() {
    let a = Agent::start("l40s-2x16").unwrap();
    let dry = a.ok("placement.dry_run", json!({"profile": "L40S-2Q", "labels": {"tenant": "a"}}));
    assert_eq!(dry["plugin"], "placement-spread");
    assert_eq!(dry["profile"], "L40S-2Q");
    let ranked: Vec<&str> = dry["ranked"].as_array().unwrap().iter().map(|r| r["device"].as_str().unwrap()).collect();
    assert_eq!(ranked.len(), 32, "every free VF is a candidate: {ranked:?}");
    assert_eq!(ranked[0], "0000:41:00.4", "spread on an idle host: lowest address first");
    assert!(dry["ranked"].as_array().unwrap().iter().all(|r| r["dirty"] == false));
    // A lower-case profile resolves to the catalog's spelling.
    assert_eq!(a.ok("placement.dry_run", json!({"profile": "l40s-2q"}))["profile"], "L40S-2Q");

    // Nothing claimed, nothing written, and a real create lands on the top candidate.
    assert!(a.claims().is_empty());
    assert!(a.sim_writes().is_empty(), "{:?}", a.sim_writes());
    let vm = a.create_gpu("vm", "L40S-2Q").unwrap();
    assert_eq!(vm["gpu"]["device"], ranked[0]);
    // Now spread prefers the other GPU, and the claimed VF is gone from the list.
    let dry = a.ok("placement.dry_run", json!({"profile": "L40S-2Q"}));
    let ranked: Vec<&str> = dry["ranked"].as_array().unwrap().iter().map(|r| r["device"].as_str().unwrap()).collect();
    assert_eq!(ranked[0], "0001:81:00.4", "{ranked:?}");
    assert!(!ranked.contains(&"0000:41:00.4"), "{ranked:?}");
    assert_eq!(a.claims().len(), 1, "the dry runs claimed nothing");
}

#[test]
fn recorded_policy_inputs_replay_offline_with_plugin_test() {
    let rec_dir = tempfile::tempdir().unwrap();
    let extra = format!("record_policy_inputs = {:?}\n", rec_dir.path());
    let a = Agent::start_with(AgentOptions { extra: &extra, ..Default::default() }).unwrap();
    let inst = a.create_gpu("rec", "L40S-2Q").unwrap();
    let mut names: Vec<String> = std::fs::read_dir(rec_dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let placement = names.iter().find(|n| n.starts_with("placement-")).expect("a recorded placement input");
    assert!(names.iter().any(|n| n.starts_with("hypervisor-")), "{names:?}");
    // Each file holds the input and the answer the agent got.
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(rec_dir.path().join(placement)).unwrap()).unwrap();
    assert_eq!(rec["recorded"], "gpuvisor policy call", "{rec}");
    assert_eq!((&rec["kind"], &rec["plugin"]), (&json!("placement"), &json!("placement-spread")), "{rec}");
    assert_eq!(rec["input"]["request"]["profile"], "L40S-2Q", "{rec}");
    assert_eq!(rec["answer"]["ok"]["ranked"][0], inst["gpu"]["device"], "{rec}");
    let hyp = names.iter().find(|n| n.starts_with("hypervisor-")).unwrap();
    let hrec: serde_json::Value = serde_json::from_slice(&std::fs::read(rec_dir.path().join(hyp)).unwrap()).unwrap();
    assert_eq!(hrec["answer"]["ok"]["hypervisor"], "qemu", "{hrec}");

    // The recorded input, replayed offline, gives the answer the agent acted on.
    let out = a.cli(&[
        "-o",
        "json",
        "plugin",
        "test",
        plugin("placement-spread").to_str().unwrap(),
        "--input",
        rec_dir.path().join(placement).to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["answer"]["ranked"][0], inst["gpu"]["device"], "{v}");
    assert_eq!(v["same_as_recorded"], true, "{v}");

    // A second create, then the whole directory: every placement input replays to its
    // recorded answer; placement-pack answers the second one differently.
    a.create_gpu("rec2", "L40S-2Q").unwrap();
    let dir = rec_dir.path().to_str().unwrap();
    let out = a.cli(&["plugin", "test", plugin("placement-spread").to_str().unwrap(), "--input", dir]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("placement-")).collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines.iter().all(|l| l.trim_end().ends_with("same")), "{text}");
    assert!(text.contains("summary: 2 inputs, 0 failed, 0 of 2 recorded answers differ"), "{text}");
    let out = a.cli(&["plugin", "test", plugin("placement-pack").to_str().unwrap(), "--input", dir]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("1 of 2 recorded answers differ"), "{text}");
    assert!(text.contains("differs (recorded {\"ok\":{\"ranked\":[\"0001:81:00.4\""), "{text}");
}

#[test]
fn plugin_reload_swaps_a_plugin_and_a_bad_one_is_refused_keeping_the_old() {
    let a = Agent::start("l40s-2x16").unwrap();
    let slot_name = |a: &Agent| a.ok("plugin.list", json!({}))["plugins"][0]["name"].as_str().unwrap().to_string();
    assert_eq!(slot_name(&a), "placement-spread");
    let cfg = std::fs::read_to_string(&a.config_path).unwrap();
    let spread = plugin("placement-spread").display().to_string();
    // Point the placement slot at placement-pack and reload.
    std::fs::write(&a.config_path, cfg.replace(&spread, &plugin("placement-pack").display().to_string())).unwrap();
    assert_eq!(a.ok("plugin.reload", json!({}))["plugins"]["placement"], "placement-pack");
    assert_eq!(slot_name(&a), "placement-pack");
    let one = a.create_gpu("one", "L40S-2Q").unwrap();
    let two = a.create_gpu("two", "L40S-2Q").unwrap();
    assert_eq!(one["gpu"]["gpu"], two["gpu"]["gpu"], "the reloaded pack plugin places both on one GPU");
    // A plugin that imports WASI is refused; the old one stays.
    std::fs::write(&a.config_path, cfg.replace(&spread, &fixture_plugin("wasi.wat").display().to_string())).unwrap();
    let e = a.err("plugin.reload", json!({}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert!(e.message.contains("wasi.wat"), "{e}");
    assert_eq!(slot_name(&a), "placement-pack");
}
