//! Issue 19 at the plugin host: the sandbox holds in time as it holds in space. Hostile
//! guests — `tests/hostile-v2` (Rust: exact WASI calls) and `tests/hostile-py` (Python:
//! `time.sleep`, `print`, an uncaught exception, floods, huge reasons) — that wait on the
//! host, fill a slot, print, flood the log, lie in their names and answer huge reasons.
//!
//! The agent-level half (the placement lock, reload, `plugin test`, metrics) is in
//! `tests/e2e/tests/sandbox.rs`.

mod common;

use common::{fixture_json, hostile_py, hostile_v2, wat};
use gpuvisor_policy::{run_input, CallError, CallReport, Limits, LoadError, Plugin};
use gpuvisor_sdk::PolicyKind;
use serde_json::{json, Value};
use std::time::Duration;

/// Limits for the Python guest (an interpreter per call) with a deadline of `deadline`.
fn py_limits(deadline: Duration) -> Limits {
    Limits { fuel: 2_000_000_000, memory_bytes: 256 << 20, deadline, ..Limits::default() }
}

/// Loads a plugin; compiled plugins are kept in a cache of this test binary (the Python
/// guest compiles in seconds).
fn load(path: &std::path::Path, slot: PolicyKind, limits: Limits) -> Plugin {
    gpuvisor_policy::set_cache_dir(Some(common::target_dir().join("tmp/sandbox-holds-plugin-cache")));
    Plugin::load(path, slot, limits).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The placement fixture with `params`.
fn placement(params: Value) -> Value {
    let mut input = fixture_json("placement-empty-2q.json");
    input["params"] = params;
    input
}

/// A hypervisor fixture with `params`.
fn hypervisor(params: Value) -> Value {
    let mut input = fixture_json("hypervisor-gpu-requests-ch.json");
    input["params"] = params;
    input
}

fn call(p: &Plugin, input: &Value) -> (Result<Value, CallError>, CallReport) {
    run_input(p, input).unwrap_or_else(|e| panic!("{e}"))
}

// ---------------------------------------------------------------------------------------
// 1. The deadline is not escaped by a blocking WASI call.

#[test]
fn a_guest_waiting_on_the_clock_or_a_stream_gets_its_answer_within_its_deadline() {
    // Far above a call's own time on a busy machine, far below the 60 s the guests ask for.
    let deadline = Duration::from_secs(10);
    let rust = load(&hostile_v2(""), PolicyKind::Placement, Limits { deadline, ..Limits::default() });
    let py = load(&hostile_py(), PolicyKind::Placement, py_limits(deadline));
    // The Rust guest: a 60 s clock subscription (block), one to the end of time, a poll of
    // 60 s clocks, a blocking read of stdin. The Python guest: time.sleep(60), stdin.read().
    let cases = [
        (&rust, "sleep"),
        (&rust, "sleep-until"),
        (&rust, "poll"),
        (&rust, "stdin"),
        (&py, "sleep"),
        (&py, "stdin"),
        (&py, "sleep,stdin,sleep"),
    ];
    for (p, what) in cases {
        let (result, report) = call(p, &placement(json!({ "do": what })));
        let name = &p.manifest().name;
        let answer = result.unwrap_or_else(|e| panic!("{name} {what}: {e}"));
        assert_eq!(answer["ranked"].as_array().map(Vec::len), Some(32), "{name} {what}: {answer}");
        println!("{name} {what}: answered in {:?}", report.wall);
        assert!(report.wall < deadline, "{name} {what}: {:?} is past the {deadline:?} deadline", report.wall);
    }
}

#[test]
fn a_call_past_its_deadline_returns_at_its_deadline() {
    let deadline = Duration::from_millis(300);
    // Fuel without end: the deadline must be what stops them (with 2e9 units a spin on a
    // busy machine ran out of fuel first).
    let spin = load(&hostile_py(), PolicyKind::Placement, Limits { fuel: u64::MAX / 2, ..py_limits(deadline) });
    let wasm_loop =
        load(&wat("loop.wat"), PolicyKind::Placement, Limits { fuel: u64::MAX / 2, deadline, ..Limits::default() });
    for (p, input) in [(&spin, placement(json!({"do": "spin"}))), (&wasm_loop, placement(json!({})))] {
        let (result, report) = call(p, &input);
        let name = &p.manifest().name;
        let e = result.expect_err("it never ends");
        assert_eq!(e.reason(), "deadline", "{name}: {e}");
        let ratio = report.wall.as_secs_f64() / deadline.as_secs_f64();
        println!("{name}: deadline {deadline:?}, returned after {:?} (ratio {ratio:.2})", report.wall);
        assert!(report.wall >= deadline, "{name}: stopped early: {:?}", report.wall);
        // The goal (ratio <= 2) is scripts/bench's; a busy machine may delay the return,
        // never by the whole of a never-ending call.
        assert!(ratio <= 10.0, "{name}: returned after {:?}, ten times its {deadline:?} deadline", report.wall);
        // Report what happened: the fuel of a function stopped by its deadline is not known.
        assert_eq!(report.fuel_used, None, "{name}: {report:?}");
        assert_eq!(p.stats().fuel_consumed, 0, "{name}: nothing counted that was not measured");
    }
}

#[test]
fn fuel_is_counted_when_a_call_returns_traps_by_unreachable_or_runs_out() {
    let input = placement(json!({}));
    let ok = load(&wat("rank-fixed.wat"), PolicyKind::Placement, Limits::default());
    let (_, report) = call(&ok, &input);
    assert!(report.fuel_used.is_some_and(|f| f > 0), "{report:?}");
    let trap = load(&wat("trap.wat"), PolicyKind::Placement, Limits::default());
    let (r, report) = call(&trap, &input);
    assert_eq!(r.unwrap_err().reason(), "trap");
    assert!(report.fuel_used.is_some_and(|f| f > 0), "an `unreachable` trap saves the count: {report:?}");
    let fuel = 1_000_000;
    let out = load(
        &wat("loop.wat"),
        PolicyKind::Placement,
        Limits { fuel, deadline: Duration::from_secs(60), ..Limits::default() },
    );
    let (r, report) = call(&out, &input);
    assert_eq!(r.unwrap_err().reason(), "out_of_fuel");
    assert_eq!(report.fuel_used, Some(fuel));
}

#[test]
fn calls_that_wait_print_or_raise_work_from_inside_an_async_runtime() {
    // `gpuvisor plugin test` and the agent's start call plugins from async code; a host call
    // that entered a tokio runtime there panicked (the CLI exited 101).
    let rust = load(&hostile_v2(""), PolicyKind::Placement, Limits::default());
    let py = load(&hostile_py(), PolicyKind::Placement, py_limits(Duration::from_secs(10)));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        for what in ["sleep", "poll", "stdin", "stdout"] {
            let (r, _) = call(&rust, &placement(json!({ "do": what })));
            r.unwrap_or_else(|e| panic!("{what}: {e}"));
        }
        for what in ["sleep", "stdin", "print"] {
            let (r, _) = call(&py, &placement(json!({ "do": what })));
            r.unwrap_or_else(|e| panic!("python {what}: {e}"));
        }
        let (r, report) = call(&py, &placement(json!({"do": "raise"})));
        let e = r.unwrap_err();
        assert_eq!(e.reason(), "trap", "{e}");
        let lines: Vec<&str> = report.logs.iter().map(|l| l.line.as_str()).collect();
        assert!(lines.iter().any(|l| l.contains("nobody caught it")), "the traceback is in the log: {lines:?}");
    });
}

// ---------------------------------------------------------------------------------------
// 2. One slot cannot starve the others.

#[test]
fn a_slot_full_of_calls_leaves_the_other_slots_their_share_and_says_it_is_busy() {
    // The hypervisor slot: the Python guest spinning until its 10 s deadline (long enough
    // for all 40 calls to start on a busy machine), from 40 threads (before: 40 Python
    // instances, 14 core instances each, took the whole shared pool).
    let limits = Limits { fuel: u64::MAX / 2, ..py_limits(Duration::from_secs(10)) };
    let slow = std::sync::Arc::new(load(&hostile_py(), PolicyKind::Hypervisor, limits));
    let other = load(&hostile_py(), PolicyKind::Hypervisor, py_limits(Duration::from_millis(200)));
    let placement_plugin = load(&hostile_py(), PolicyKind::Placement, py_limits(Duration::from_secs(10)));
    let grace_plugin = load(&hostile_py(), PolicyKind::Grace, py_limits(Duration::from_secs(10)));
    let threads: Vec<_> = (0..40)
        .map(|_| {
            let slow = slow.clone();
            std::thread::spawn(move || call(&slow, &hypervisor(json!({"do": "spin"}))))
        })
        .collect();
    // Every call has started: running, waiting for a place, or already failed.
    let full = common::wait_until(Duration::from_secs(60), || {
        let s = slow.stats();
        let ended: u64 = s.calls_failed.values().sum();
        (s.calls_running >= u64::from(gpuvisor_policy::SLOT_CALLS) && s.calls_running + s.calls_waiting + ended == 40)
            .then_some(s)
    });
    println!("hypervisor slot: {full:?}");
    let full = full.expect("the slot fills up");

    // The placement and grace slots have their own share: they answer.
    let (r, _) = call(&placement_plugin, &placement(json!({})));
    r.unwrap_or_else(|e| panic!("placement starved by the hypervisor slot: {e}"));
    let (r, _) = call(&grace_plugin, &fixture_json("grace-mixed.json"));
    r.unwrap_or_else(|e| panic!("grace starved by the hypervisor slot: {e}"));

    // The hypervisor slot runs 8 calls at once; the others wait.
    assert_eq!((full.calls_running, full.calls_waiting), (u64::from(gpuvisor_policy::SLOT_CALLS), 32), "{full:?}");
    // Another plugin of the full slot does not run: it waits its deadline and says why.
    let (r, report) = call(&other, &hypervisor(json!({})));
    let e = r.expect_err("the hypervisor slot is full");
    assert_eq!(e.reason(), "busy", "{e}");
    let msg = e.to_string();
    assert!(msg.contains("hypervisor slot") && msg.contains("not run"), "{msg}");
    assert!(report.waited >= Duration::from_millis(200), "{report:?}");

    // Every slow call ended as what it was: its deadline, or no place within it.
    let mut reasons = std::collections::BTreeMap::new();
    for t in threads {
        let (r, _) = t.join().unwrap();
        *reasons.entry(r.expect_err("spins").reason()).or_insert(0) += 1;
    }
    println!("40 spinning calls: {reasons:?}");
    assert!(reasons.keys().all(|r| ["deadline", "busy"].contains(r)), "{reasons:?}");
    assert!(reasons.get("deadline").copied().unwrap_or(0) >= gpuvisor_policy::SLOT_CALLS as usize, "{reasons:?}");
    let stats = slow.stats();
    assert_eq!((stats.calls_running, stats.calls_waiting), (0, 0));
    assert_eq!(stats.calls_failed.values().sum::<u64>(), 40, "{stats:?}");
}

// ---------------------------------------------------------------------------------------
// 3. A plugin cannot flood or forge the agent's logs or an operator's terminal.

/// No control character (a newline, an escape code) in `s`.
fn one_printable_line(s: &str) -> bool {
    !s.chars().any(char::is_control)
}

#[test]
fn log_and_stdout_lines_with_newlines_and_escape_codes_stay_one_escaped_line_each() {
    let py = load(&hostile_py(), PolicyKind::Placement, py_limits(Duration::from_secs(10)));
    let (r, report) = call(&py, &placement(json!({"do": "flood"})));
    r.unwrap();
    assert_eq!(report.logs.len(), gpuvisor_policy::LOG_LINES_PER_CALL as usize, "{report:?}");
    // 100 log lines, 20 prints of two lines each.
    assert_eq!(report.logs_dropped, 140 - u64::from(gpuvisor_policy::LOG_LINES_PER_CALL));
    for l in &report.logs {
        assert!(one_printable_line(&l.line), "{:?}", l.line);
        assert!(l.line.contains("\\u{1b}[31mflood") && l.line.contains("\\n2026-01-01T"), "escaped, kept: {}", l.line);
    }
}

#[test]
fn printing_more_than_the_capture_loses_output_never_the_call() {
    let rust = load(&hostile_v2(""), PolicyKind::Placement, Limits::default());
    let (r, report) = call(&rust, &placement(json!({"do": "stdout"})));
    r.unwrap_or_else(|e| panic!("100 KiB of stdout failed the call: {e}"));
    assert_eq!(report.output_bytes_dropped, 25 * 4096 - gpuvisor_policy::STDIO_CAPTURE_BYTES as u64, "{report:?}");
    let py = load(&hostile_py(), PolicyKind::Placement, py_limits(Duration::from_secs(10)));
    let (r, report) = call(&py, &placement(json!({"do": "print"})));
    r.unwrap_or_else(|e| panic!("python's 100 KB of stdout failed the call: {e}"));
    assert!(report.output_bytes_dropped > 80_000, "{report:?}");
    assert!(report.logs.iter().any(|l| l.line.starts_with("hostile-py stdout line 0000")), "{report:?}");
    let stats = py.stats();
    assert_eq!(stats.output_bytes_dropped, report.output_bytes_dropped);
    assert!(stats.log_lines_dropped > 0, "{stats:?}");
}

#[test]
fn a_huge_reason_with_escape_codes_is_cut_and_escaped() {
    let max = gpuvisor_policy::MAX_TEXT_BYTES;
    let py = load(&hostile_py(), PolicyKind::Placement, py_limits(Duration::from_secs(10)));
    let (r, _) = call(&py, &placement(json!({"do": "reason"})));
    let why = r.unwrap()["reject"].as_str().unwrap().to_string();
    assert!(why.len() <= max + '…'.len_utf8(), "{} bytes", why.len());
    assert!(one_printable_line(&why) && why.starts_with("\\u{1b}[2J\\u{1b}[31mhostile reason\\n"), "{why}");
    let hv = load(&hostile_py(), PolicyKind::Hypervisor, py_limits(Duration::from_secs(10)));
    let (r, _) = call(&hv, &hypervisor(json!({"do": "reason"})));
    let why = r.unwrap()["reject"].as_str().unwrap().to_string();
    assert!(why.len() <= max + 3 && one_printable_line(&why), "{} bytes: {why:.80}", why.len());
    let grace = load(&hostile_py(), PolicyKind::Grace, py_limits(Duration::from_secs(10)));
    let mut input = fixture_json("grace-mixed.json");
    input["params"] = json!({"do": "reason"});
    // One item: ten reasons of 900 KB are over the reply's size limit.
    input["items"].as_array_mut().unwrap().truncate(1);
    let (r, _) = call(&grace, &input);
    for d in r.unwrap()["decisions"].as_array().unwrap() {
        let why = d["reason"].as_str().unwrap();
        assert!(why.len() <= max + 3 && one_printable_line(why), "{} bytes", why.len());
    }
    // The plugin's own error message, too.
    let (r, _) = call(&py, &placement(json!({"do": "fail"})));
    assert_eq!(
        r.unwrap_err().to_string(),
        "policy plugin hostile-py (placement) returned an error: hostile-py fails every call"
    );
}

#[test]
fn a_manifest_name_that_is_empty_long_forged_or_a_default_plugins_is_refused() {
    for (feature, problem) in [
        ("name-escape", "must be ASCII letters, digits"),
        ("name-empty", "is empty"),
        ("name-long", "is 200 bytes long (at most 64)"),
        ("name-default", "is the name of a plugin gpuvisor ships"),
    ] {
        let path = hostile_v2(feature);
        let e = Plugin::load(&path, PolicyKind::Placement, Limits::default()).expect_err(feature);
        assert!(matches!(e, LoadError::Name { .. }), "{feature}: {e}");
        let msg = e.to_string();
        assert!(msg.contains(problem) && one_printable_line(&msg), "{feature}: {msg}");
    }
    // A default plugin's name is accepted from the file of that name.
    let dir = tempfile::tempdir().unwrap();
    let named = dir.path().join("placement-spread.wasm");
    std::fs::copy(hostile_v2("name-default"), &named).unwrap();
    let p = load(&named, PolicyKind::Placement, Limits::default());
    assert_eq!(p.manifest().name, "placement-spread");
}
