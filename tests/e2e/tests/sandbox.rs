//! End to end, issue 19: the plugin sandbox holds in time as it holds in space, through the
//! real agent and `gpuvisor plugin test`. The hostile guests: `tests/hostile-py` (Python, all
//! three kinds; what it does comes from the request's label `do` or the slot's params) and
//! hand-written modules (`tests/plugins`). The plugin host's own tests of the same guests
//! are in `agent/policy/tests/sandbox_holds.rs`.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn dry_run(do_what: &str) -> Value {
    json!({"profile": "L40S-2Q", "labels": {"do": do_what}})
}

/// The `result` of a raw JSON-RPC answer, or its `error`.
fn answer(raw: anyhow::Result<Value>) -> Result<Value, Value> {
    let v = raw.expect("the agent answers");
    match v.get("result") {
        Some(r) => Ok(r.clone()),
        None => Err(v["error"].clone()),
    }
}

/// `(count, sum)` of the placement calls' durations the agent recorded for `plugin`, and the
/// count at or under `le` seconds.
fn durations(a: &Agent, plugin: &str, le: &str) -> (f64, f64, f64) {
    let text = a.metrics();
    let labels = [("plugin", plugin), ("kind", "placement")];
    let count = metric0(&text, "gpuvisor_policy_call_duration_seconds_count", &labels);
    let sum = metric0(&text, "gpuvisor_policy_call_duration_seconds_sum", &labels);
    let under = metric0(&text, "gpuvisor_policy_call_duration_seconds_bucket", &[labels[0], labels[1], ("le", le)]);
    (count, sum, under)
}

fn slot_view(a: &Agent, slot: &str) -> Value {
    let list = a.ok("plugin.list", json!({}));
    list["plugins"].as_array().unwrap().iter().find(|p| p["slot"] == slot).cloned().unwrap()
}

/// No control character: one line, no escape code.
fn printable(s: &str) -> bool {
    !s.chars().any(char::is_control)
}

#[test]
fn a_plugin_that_sleeps_blocks_no_one_a_call_past_its_deadline_returns_in_time_and_reload_waits_for_none() {
    let a = Agent::start_with(AgentOptions { placement: Some(hostile_py()), ..Default::default() }).unwrap();
    // A deadline far above a call's own time, even on a busy machine, and far below the
    // 60 s the guest asks to sleep.
    a.set_slot("placement", &hostile_py(), "deadline_ms = 5000\nfuel = 100000000000\nmemory_mib = 256");
    a.ok("plugin.reload", json!({}));

    // A placement that sleeps 60 s (time.sleep) under the allocation lock, and one beside it:
    // both answer, the sleeper at once (before: 60 s, and every other create waited).
    let sleeper = a.spawn_call("placement.dry_run", dry_run("sleep"));
    let beside = a.spawn_call("placement.dry_run", dry_run(""));
    let stdin = a.spawn_call("placement.dry_run", dry_run("stdin,sleep"));
    for (what, call) in [("sleep", sleeper), ("plain", beside), ("stdin,sleep", stdin)] {
        let r = answer(call.join().unwrap()).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(r["ranked"].as_array().map(Vec::len), Some(32), "{what}: {r}");
    }
    let (count, _, under) = durations(&a, "hostile-py", "5");
    assert_eq!((count, under), (3.0, 3.0), "every call took less than its 5 s deadline (as the agent measured)");
    a.set_slot("placement", &hostile_py(), "deadline_ms = 500\nfuel = 100000000000\nmemory_mib = 256");
    a.ok("plugin.reload", json!({}));

    // A call that never ends returns at its deadline: policy_failed, reason deadline, and the
    // agent's own measure of it is under twice the deadline.
    let (count0, sum0, _) = durations(&a, "hostile-py", "5");
    let e = a.err("placement.dry_run", dry_run("spin"));
    assert_eq!(
        (e.code, e.data_code.as_str(), e.data["reason"].as_str()),
        (500, "policy_failed", Some("deadline")),
        "{e}"
    );
    let (count1, sum1, under1) = durations(&a, "hostile-py", "5");
    assert_eq!(count1, count0 + 1.0);
    let took = sum1 - sum0;
    println!(
        "bench a call past its 500 ms deadline returned after {:.0} ms (ratio {:.2}, goal <= 2)",
        took * 1000.0,
        took / 0.5
    );
    // Returned at its deadline, not at the end of the work (a spin never ends); how close
    // to the deadline is the bench's ratio, not this test's (a busy machine delays it).
    assert!((0.5..=5.0).contains(&took), "the call took {took} s for a 0.5 s deadline");
    assert_eq!(under1, count1, "every call under 5 s");

    // A reload while a call spins (3 s deadline) returns at once: the stuck call finishes
    // on the old plugin, the reload never waits for it.
    a.set_slot("placement", &hostile_py(), "deadline_ms = 3000\nfuel = 100000000000\nmemory_mib = 256");
    a.ok("plugin.reload", json!({}));
    let stuck = a.spawn_call("placement.dry_run", dry_run("spin"));
    wait_for(Duration::from_secs(60), || (slot_view(&a, "placement")["calls_running"] == 1).then_some(()))
        .expect("the spinning call runs");
    a.set_slot("placement", &plugin("placement-spread"), "");
    assert_eq!(a.ok("plugin.reload", json!({}))["plugins"]["placement"], "placement-spread");
    assert!(!stuck.is_finished(), "the reload returned while the old plugin's call still ran");
    let e = answer(stuck.join().unwrap()).expect_err("it spins to its deadline");
    assert_eq!(e["data"]["reason"], "deadline", "{e}");
    assert_eq!(a.ok("placement.dry_run", dry_run(""))["plugin"], "placement-spread");
}

#[test]
fn a_slot_full_of_slow_calls_leaves_the_others_their_share_and_says_busy() {
    let a = Agent::start_with(AgentOptions { hypervisor: Some(hostile_py()), ..Default::default() }).unwrap();
    // 10 s: long enough for every create to reach the slot on a busy machine.
    a.set_slot("hypervisor", &hostile_py(), "deadline_ms = 10000\nfuel = 100000000000\nmemory_mib = 256");
    a.ok("plugin.reload", json!({}));
    // 40 creates whose hypervisor call spins until its deadline (before: they took the whole
    // pool all slots share, and the placement plugin failed with "maximum concurrent limit
    // ... for core instances", counted as its own trap).
    let creates: Vec<_> = (0..40)
        .map(|i| {
            a.spawn_call(
                "instance.create",
                json!({"name": format!("slow-{i}"), "image": "demo", "gpu": "L40S-2Q", "labels": {"do": "spin"}}),
            )
        })
        .collect();
    let full = wait_for(Duration::from_secs(60), || {
        let v = slot_view(&a, "hypervisor");
        (v["calls_running"] == 8 && v["calls_waiting"].as_u64().unwrap_or(0) > 0).then_some(v)
    })
    .expect("the hypervisor slot fills up");
    println!("hypervisor slot: {full}");
    let dry = a.ok("placement.dry_run", json!({"profile": "L40S-2Q"}));
    assert_eq!(dry["ranked"].as_array().map(Vec::len), Some(32), "placement keeps its share: {dry}");

    let mut reasons = std::collections::BTreeMap::new();
    for c in creates {
        let e = answer(c.join().unwrap()).expect_err("the hypervisor plugin spins");
        assert_eq!(e["data"]["code"], "policy_failed", "{e}");
        *reasons.entry(e["data"]["reason"].as_str().unwrap_or("?").to_string()).or_insert(0) += 1;
    }
    println!("40 creates: {reasons:?}");
    assert!(reasons.keys().all(|r| r == "deadline" || r == "busy"), "{reasons:?}");
    assert!(reasons.get("deadline").copied().unwrap_or(0) >= 8, "{reasons:?}");
    let text = a.metrics();
    let busy = metric0(&text, "gpuvisor_policy_call_failures_total", &[("plugin", "hostile-py"), ("reason", "busy")]);
    assert_eq!(busy, reasons.get("busy").copied().unwrap_or(0) as f64, "busy is counted as busy");
    let instantiate = metric0(&text, "gpuvisor_policy_call_failures_total", &[("reason", "instantiate")]);
    assert_eq!(instantiate, 0.0, "no plugin failed to get an instance");
    assert!(a.claims().is_empty() && a.instance_names().is_empty(), "nothing was allocated");
}

/// A copy of `tests/plugins/rank-fixed.wat` at `dir/file` whose manifest name is the JSON
/// string text `name_json`.
fn rank_fixed_named(dir: &Path, file: &str, name_json: &str) -> PathBuf {
    let text = std::fs::read_to_string(fixture_plugin("rank-fixed.wat")).unwrap();
    let manifest = format!("{{\"name\":\"{name_json}\",\"version\":\"0.1.0\",\"kinds\":[\"placement\"]}}");
    // The manifest's length in the packed pointer: the JSON text's bytes.
    let len = manifest.len() as i64;
    let text = text
        .replace(r#""name\":\"rank-fixed\""#, &format!(r#""name\":\"{}\""#, name_json.replace('\\', "\\\\")))
        .replace("(i64.const 4398046511165)", &format!("(i64.const {})", (1024i64 << 32) | len));
    let path = dir.join(file);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_plugin_cannot_flood_or_forge_the_log_or_a_terminal_and_says_what_it_dropped() {
    let a = Agent::start_with(AgentOptions { placement: Some(hostile_py()), ..Default::default() }).unwrap();
    a.set_slot("placement", &hostile_py(), "deadline_ms = 2000\nfuel = 1000000000\nmemory_mib = 256");
    a.ok("plugin.reload", json!({}));

    // Log lines with newlines and escape codes: one escaped line each; the rest counted.
    a.ok("placement.dry_run", dry_run("flood"));
    a.ok("placement.dry_run", dry_run("print"));
    let log = a.log();
    assert!(!log.contains('\u{1b}'), "an escape code reached the agent's log");
    assert!(
        !log.lines().any(|l| l.starts_with("2026-01-01T00:00:00.000000Z ERROR gpuvisor::instances: forged")),
        "a plugin forged a line of the agent's log"
    );
    assert!(log.contains("\\u{1b}[31mflood 0\\u{1b}[0m\\n2026-01-01T00:00:00.000000Z ERROR"), "escaped, not lost");
    let v = slot_view(&a, "placement");
    let text = a.metrics();
    let labels = [("plugin", "hostile-py"), ("kind", "placement")];
    let dropped = metric0(&text, "gpuvisor_policy_log_lines_dropped_total", &labels);
    assert!(dropped > 100.0 && v["log_lines_dropped"].as_f64() == Some(dropped), "{v} / {dropped}");
    let bytes = metric0(&text, "gpuvisor_policy_output_bytes_dropped_total", &labels);
    assert!(bytes > 80_000.0 && v["output_bytes_dropped"].as_f64() == Some(bytes), "{v} / {bytes}");
    let out = a.cli(&["plugin", "ls"]);
    let ls = String::from_utf8_lossy(&out.stdout);
    assert!(ls.contains("LOG DROPPED") && ls.contains(&format!(" {dropped} ")), "{ls}");

    // Only illegal entries: one WARN for the call (not one per entry), and the create says
    // which entries were dropped and why, in a bounded answer.
    let warns = |a: &Agent| a.log().matches("policy answer rejected in part").count();
    let before = (warns(&a), metric0(&a.metrics(), "gpuvisor_policy_rejected_answers_total", &labels));
    let dry = a.ok("placement.dry_run", dry_run("illegal"));
    assert_eq!(dry["ranked"], json!([]), "{dry}");
    assert_eq!(warns(&a), before.0 + 1, "one WARN per call");
    let rejected = metric0(&a.metrics(), "gpuvisor_policy_rejected_answers_total", &labels) - before.1;
    assert_eq!(rejected, 10.0, "every dropped entry counted (2 GPUs and 3 garbage entries, each twice)");
    let e = a
        .call(
            "instance.create",
            json!({"name": "illegal", "image": "demo", "gpu": "L40S-2Q", "labels": {"do": "illegal"}}),
        )
        .unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert!(e.message.contains("ranked by the placement plugin, but it is a GPU"), "{e}");
    assert!(printable(&e.message), "{e}");
    let notes = e.data["notes"].as_array().unwrap();
    // 8 dropped entries named, then a count; then the free devices it did not rank (8
    // named, then a count).
    assert_eq!(notes.len(), 18, "8 entries named, then a count, twice: {notes:?}");
    assert_eq!(notes[8], "and 2 more entries ranked by the placement plugin were dropped");
    assert!(
        notes[9].as_str().unwrap().ends_with("free, but the placement plugin hostile-py did not rank it"),
        "{notes:?}"
    );
    assert!(notes[17].as_str().unwrap().starts_with("and 24 more free devices"), "{notes:?}");
    assert!(notes.iter().any(|n| n.as_str().unwrap().contains(r#""\u{1b}[31mgarbage\n2026-"#)), "{notes:?}");

    // A 900 KB reject reason with escape codes: cut and escaped, in the answer and the CLI.
    let e = a
        .call(
            "instance.create",
            json!({"name": "reason", "image": "demo", "gpu": "L40S-2Q", "labels": {"do": "reason"}}),
        )
        .unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert!(e.message.len() < 2048 && printable(&e.message), "{} bytes: {:.200}", e.message.len(), e.message);
    let out = a.cli(&["create", "reason-cli", "--image", "demo", "--gpu", "L40S-2Q", "--label", "do=reason"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.len() < 4096 && !err.contains('\u{1b}'), "{} bytes: {err:.300}", err.len());
    assert!(a.claims().is_empty() && a.instance_names().is_empty());

    // A name that forges a log line, or a default plugin's name from another file: the
    // reload is refused with one printable line, the old plugin stays.
    let dir = tempfile::tempdir().unwrap();
    for (file, name, problem) in [
        ("forged.wat", r"r\u001b\nx", "must be ASCII letters"),
        ("mine.wat", "placement-spread", "is the name of a plugin gpuvisor ships"),
    ] {
        a.set_slot("placement", &rank_fixed_named(dir.path(), file, name), "");
        let e = a.err("plugin.reload", json!({}));
        assert_eq!(e.data_code, "invalid_request", "{e}");
        assert!(e.message.contains(problem) && printable(&e.message), "{e}");
        assert_eq!(slot_view(&a, "placement")["name"], "hostile-py");
    }
    a.set_slot("placement", &rank_fixed_named(dir.path(), "placement-spread.wat", "placement-spread"), "");
    assert_eq!(a.ok("plugin.reload", json!({}))["plugins"]["placement"], "placement-spread", "its own file");
}

#[test]
fn a_reload_with_a_trial_refuses_a_plugin_that_fails_on_the_slots_last_input() {
    let a = Agent::start("l40s-2x16").unwrap();
    // Nothing asked yet: a trial has nothing to try.
    let r = a.ok("plugin.reload", json!({"trial": true}));
    assert_eq!(r["trial"], Value::Null, "{r}");
    a.ok("placement.dry_run", dry_run(""));

    // A plugin that fails every call: a reload with a trial refuses it, the old one stays.
    let params = "[plugins.placement.params]\ndo = \"fail\"";
    a.set_slot(
        "placement",
        &hostile_py(),
        &format!("deadline_ms = 2000\nfuel = 1000000000\nmemory_mib = 256\n{params}"),
    );
    let e = a.err("plugin.reload", json!({"trial": true}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert!(e.message.contains("trial call of the new placement plugin on the slot's last input failed"), "{e}");
    assert!(e.message.contains("hostile-py fails every call"), "{e}");
    assert_eq!(slot_view(&a, "placement")["name"], "placement-spread");
    // The same through the CLI, with a given input.
    let fixture = repo_root().join("plugins/fixtures/placement-empty-2q.json");
    let out = a.cli(&["plugin", "reload", "--trial-input", &format!("placement={}", fixture.display())]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("on the slot's given input failed"), "{err}");
    assert_eq!(slot_view(&a, "placement")["name"], "placement-spread");

    // Without a trial it is taken, and fails every create: what the trial saved.
    a.ok("plugin.reload", json!({}));
    let e = a.err("placement.dry_run", dry_run(""));
    assert_eq!(e.data_code, "policy_failed", "{e}");
    // A plugin that answers passes the trial, which says what it answered.
    a.set_slot("placement", &hostile_py(), "deadline_ms = 2000\nfuel = 1000000000\nmemory_mib = 256");
    let r = a.ok("plugin.reload", json!({"trial": true}));
    assert_eq!(r["trial"][0]["slot"], "placement", "{r}");
    assert_eq!(r["trial"][0]["input"], "last", "{r}");
    assert_eq!(r["trial"][0]["answer"]["ranked"].as_array().map(Vec::len), Some(32), "{r}");
}

// ---------------------------------------------------------------------------------------
// `gpuvisor plugin test` (no agent)

/// Runs `gpuvisor plugin test` with `args` in `dir`.
fn plugin_test(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = cli_alone_command()
        .args(["plugin", "test"])
        .args(args)
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .current_dir(dir)
        .output()
        .expect("gpuvisor");
    let code = out.status.code().unwrap_or(-1);
    (code, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A params file `{"do": what}` in `dir`.
fn params(dir: &Path, what: &str) -> String {
    let p = dir.join(format!("do-{what}.json"));
    std::fs::write(&p, json!({ "do": what }).to_string()).unwrap();
    p.display().to_string()
}

#[test]
fn plugin_test_never_panics_and_says_what_happened() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let py = hostile_py().display().to_string();
    let input = repo_root().join("plugins/fixtures/placement-empty-2q.json").display().to_string();
    let cfg = d.join("site.toml");
    std::fs::write(
        &cfg,
        "[plugins.placement]\npath = \"x\"\nfuel = 1000000000\ndeadline_ms = 2000\nmemory_mib = 256\n",
    )
    .unwrap();
    let cfg = cfg.display().to_string();
    // A v2 plugin that prints, sleeps, reads stdin or raises: an answer or a failed call,
    // never a panic (before: exit 101 for all but stdin).
    for (what, code, says) in [
        ("print", 0, "bytes of stdout/stderr dropped past the 16 KiB capture"),
        ("sleep", 0, "\"ranked\""),
        ("stdin", 0, "\"ranked\""),
        ("raise", 1, "hostile-py raised and nobody caught it"),
    ] {
        let p = params(d, what);
        let (c, out, err) =
            plugin_test(d, &[&py, "--kind", "placement", "--config", &cfg, "--input", &input, "--params", &p]);
        assert_eq!(c, code, "{what}: {out}{err}");
        assert!(!err.contains("panicked") && (out.contains(says) || err.contains(says)), "{what}: {out}{err}");
    }

    // A call stopped by its deadline: its fuel is not counted, and says so.
    let fast = d.join("fast.toml");
    std::fs::write(&fast, "[plugins.placement]\npath = \"x\"\nfuel = 100000000000\ndeadline_ms = 300\n").unwrap();
    let (c, out, _) = plugin_test(
        d,
        &[fixture_plugin("loop.wat").to_str().unwrap(), "--config", fast.to_str().unwrap(), "--input", &input],
    );
    assert_eq!(c, 1, "{out}");
    assert!(out.contains("fuel:    not counted: the call was stopped inside a function"), "{out}");
    assert!(out.contains("passed its 300 ms deadline"), "{out}");

    // Directory mode: a failure shows its message.
    let inputs = d.join("inputs");
    std::fs::create_dir(&inputs).unwrap();
    std::fs::copy(&input, inputs.join("placement-empty-2q.json")).unwrap();
    let fail = params(d, "fail");
    let (c, out, _) =
        plugin_test(d, &[&py, "--kind", "placement", "--config", &cfg, "--input", "inputs", "--params", &fail]);
    assert_eq!(c, 1, "{out}");
    assert!(out.contains("error plugin_error: (placement) returned an error: hostile-p"), "{out}");
    assert!(
        out.contains("placement-empty-2q.json: policy plugin hostile-py (placement) returned an error: hostile-py fails every call"),
        "{out}"
    );

    // --against: two plugins failing the same way are the same; answers that differ past
    // what the summary shows say where.
    let loop_wat = fixture_plugin("loop.wat").display().to_string();
    let v2 = target_dir().join("plugins/placement-spread.wasm").display().to_string();
    let same_cfg = d.join("same.toml");
    std::fs::write(&same_cfg, "[plugins.placement]\npath = \"x\"\nfuel = 1000000\ndeadline_ms = 60000\n").unwrap();
    let spin = params(d, "spin");
    let (_, out, _) = plugin_test(
        d,
        &[&loop_wat, "--input", "inputs", "--config", same_cfg.to_str().unwrap(), "--params", &spin, "--against", &py],
    );
    assert!(out.contains("same: error out_of_fuel: (placement) ran out of fuel (1000000 units)"), "{out}");
    assert!(out.contains("summary: 1 inputs, 2 failed, 0 differ"), "{out}");
    let mut rev: Value = serde_json::from_str(&std::fs::read_to_string(&input).unwrap()).unwrap();
    // hostile-py ranks the free devices in the inventory's order: reverse the second GPU's
    // devices, so the first ranks agree and a later one does not.
    rev["inventory"]["gpus"][1]["devices"].as_array_mut().unwrap().reverse();
    std::fs::write(inputs.join("placement-reversed.json"), rev.to_string()).unwrap();
    std::fs::remove_file(inputs.join("placement-empty-2q.json")).unwrap();
    let (_, out, _) = plugin_test(d, &[&py, "--kind", "placement", "--input", "inputs", "--against", &v2]);
    assert!(out.contains("placement-reversed.json  differs"), "{out}");
    assert!(out.contains("first difference at rank 17: A \"0001:81:02.3\", B \"0001:81:00.4\""), "{out}");

    // A load error carries its cause, as `plugin reload` gives it.
    let bad = d.join("manifest-traps.wat");
    std::fs::write(
        &bad,
        "(module (memory (export \"memory\") 1) (func (export \"gpuvisor_abi_version\") (result i32) i32.const 1) \
         (func (export \"gpuvisor_alloc\") (param i32) (result i32) i32.const 0) (func (export \"gpuvisor_free\") (param i32 i32)) \
         (func (export \"gpuvisor_manifest\") (result i64) unreachable) \
         (func (export \"gpuvisor_placement\") (param i32 i32) (result i64) i64.const 0))",
    )
    .unwrap();
    let (c, _, err) = plugin_test(d, &[bad.to_str().unwrap(), "--kind", "placement", "--input", &input]);
    assert_eq!(c, 1);
    assert!(err.contains("failed at load: policy plugin") && err.contains("unreachable"), "{err}");
}
