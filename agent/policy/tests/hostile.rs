//! Hostile and odd plugins (WAT files under `tests/plugins/`): each is refused at load or
//! fails closed with the documented [`CallError`], and no state survives between calls.

mod common;

use common::wat;
use gpuvisor_policy::{CallError, Limits, LoadError, Plugin};
use gpuvisor_sdk::{
    Framework, HypervisorAnswer, HypervisorInput, HypervisorRequest, Inventory, PlacementAnswer, PlacementInput,
    PlacementRequest, PolicyKind,
};
use std::time::{Duration, Instant};

fn input() -> PlacementInput {
    PlacementInput {
        request: PlacementRequest {
            instance_id: "5b0e7f5e-3f4c-4e4e-9d43-0c7a3c1f2a01".into(),
            name: "web-1".into(),
            labels: Default::default(),
            framework: Framework::VendorVfio,
            profile: "L40S-2Q".into(),
            framebuffer_mib: Some(2048),
        },
        inventory: Inventory::default(),
        params: serde_json::json!({}),
    }
}

fn load(name: &str) -> Plugin {
    load_with(name, Limits::default())
}

fn load_with(name: &str, limits: Limits) -> Plugin {
    Plugin::load(&wat(name), PolicyKind::Placement, limits).unwrap_or_else(|e| panic!("{name} should load: {e}"))
}

fn refused(name: &str, slot: PolicyKind) -> LoadError {
    match Plugin::load(&wat(name), slot, Limits::default()) {
        Ok(_) => panic!("{name} was loaded"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(name), "the message names the plugin file: {msg}");
            e
        }
    }
}

fn failed(p: &Plugin) -> CallError {
    let err = p.call_placement(&input()).expect_err("the call must fail");
    assert!(err.to_string().contains(&p.manifest().name), "{err}");
    assert_eq!(p.stats().calls_failed.get(err.reason()), Some(&1), "counted once");
    err
}

// --- refused at load -------------------------------------------------------------------

#[test]
fn a_wasi_import_is_refused_at_load() {
    let e = refused("wasi.wat", PolicyKind::Placement);
    assert!(matches!(e, LoadError::WasiImport { .. }), "{e}");
}

#[test]
fn an_unknown_import_is_refused_at_load() {
    let e = refused("unknown-import.wat", PolicyKind::Placement);
    assert!(
        matches!(e, LoadError::ForbiddenImport { ref module, ref name, .. } if module == "env" && name == "now_ms"),
        "{e}"
    );
}

#[test]
fn a_log_import_with_the_wrong_signature_is_refused_at_load() {
    let e = refused("log-wrong-signature.wat", PolicyKind::Placement);
    assert!(matches!(e, LoadError::ForbiddenImport { .. }), "{e}");
}

#[test]
fn a_wrong_abi_version_is_refused_at_load() {
    let e = refused("abi-v2.wat", PolicyKind::Placement);
    assert!(matches!(e, LoadError::AbiVersion { found: 2, expected: 1, .. }), "{e}");
}

#[test]
fn missing_exports_are_refused_at_load() {
    let e = refused("missing-exports.wat", PolicyKind::Placement);
    assert!(matches!(e, LoadError::MissingExport { export: "gpuvisor_alloc", .. }), "{e}");
}

#[test]
fn a_manifest_kind_that_does_not_match_the_slot_is_refused_at_load() {
    let e = refused("hv-cloud.wat", PolicyKind::Placement);
    assert!(matches!(e, LoadError::WrongSlot { slot: PolicyKind::Placement, .. }), "{e}");
    let e = refused("rank-fixed.wat", PolicyKind::Grace);
    assert!(matches!(e, LoadError::WrongSlot { .. }), "{e}");
}

#[test]
fn a_slot_without_its_entry_point_is_refused_at_load() {
    // The manifest says grace, the module has no gpuvisor_grace.
    let e = refused("manifest-lies.wat", PolicyKind::Placement);
    assert!(matches!(e, LoadError::MissingExport { export: "gpuvisor_grace", .. }), "{e}");
}

#[test]
fn an_undecodable_manifest_is_refused_at_load() {
    let e = refused("manifest-garbage.wat", PolicyKind::Placement);
    assert!(matches!(e, LoadError::Manifest { .. }), "{e}");
}

#[test]
fn a_file_that_is_not_wasm_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("junk.wasm");
    std::fs::write(&path, b"\0asm\x07junk").unwrap();
    let e = Plugin::load(&path, PolicyKind::Placement, Limits::default()).unwrap_err();
    assert!(matches!(e, LoadError::Compile { .. }), "{e}");
    let e = Plugin::load(&dir.path().join("absent.wasm"), PolicyKind::Placement, Limits::default()).unwrap_err();
    assert!(matches!(e, LoadError::Read { .. }), "{e}");
}

#[test]
fn limits_above_the_host_maximum_are_refused_at_load() {
    let limits = Limits { memory_bytes: gpuvisor_policy::MAX_MEMORY_BYTES + 1, ..Limits::default() };
    let e = Plugin::load(&wat("rank-fixed.wat"), PolicyKind::Placement, limits).unwrap_err();
    assert!(matches!(e, LoadError::Limits { .. }), "{e}");
}

// --- failing closed at call time --------------------------------------------------------

#[test]
fn a_trap_fails_the_call() {
    let e = failed(&load("trap.wat"));
    assert!(matches!(e, CallError::Trap { .. }), "{e}");
}

#[test]
fn an_infinite_loop_runs_out_of_fuel() {
    let p = load_with("loop.wat", Limits { fuel: 1_000_000, deadline: Duration::from_secs(60), ..Limits::default() });
    let e = failed(&p);
    assert!(matches!(e, CallError::OutOfFuel { fuel: 1_000_000, .. }), "{e}");
}

#[test]
fn an_infinite_loop_passes_its_deadline() {
    let p = load_with("loop.wat", Limits { fuel: u64::MAX, deadline: Duration::from_millis(50), ..Limits::default() });
    let started = Instant::now();
    let e = failed(&p);
    assert!(matches!(e, CallError::Deadline { deadline_ms: 50, .. }), "{e}");
    // Generous bound: only that the deadline stops it, on a loaded 2-core machine.
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

#[test]
fn the_default_limits_stop_an_infinite_loop() {
    let e = failed(&load("loop.wat"));
    assert!(matches!(e, CallError::OutOfFuel { .. } | CallError::Deadline { .. }), "{e}");
}

#[test]
fn memory_growth_beyond_the_limit_fails_the_call() {
    let e = failed(&load("grow.wat"));
    assert!(matches!(e, CallError::MemoryLimit { limit_bytes, .. } if limit_bytes == 64 << 20), "{e}");
}

#[test]
fn memory_growth_within_a_raised_limit_succeeds() {
    let p = load_with("grow.wat", Limits { memory_bytes: 256 << 20, ..Limits::default() });
    assert_eq!(p.call_placement(&input()).unwrap(), PlacementAnswer::Ranked(vec![]));
}

#[test]
fn garbage_output_fails_the_call() {
    let e = failed(&load("garbage.wat"));
    assert!(matches!(e, CallError::UndecodableReply { .. }), "{e}");
}

#[test]
fn json_of_the_wrong_shape_fails_the_call() {
    let e = failed(&load("wrong-shape.wat"));
    assert!(matches!(e, CallError::UndecodableReply { .. }), "{e}");
}

#[test]
fn an_error_reply_fails_the_call_with_the_plugins_message() {
    let e = failed(&load("error.wat"));
    assert!(matches!(e, CallError::Plugin { ref message, .. } if message == "no idea where to put it"), "{e}");
}

#[test]
fn a_huge_output_fails_the_call() {
    let e = failed(&load("huge.wat"));
    assert!(matches!(e, CallError::OutputTooLarge { len, max, .. } if len == 2 << 20 && max == 1 << 20), "{e}");
}

#[test]
fn an_out_of_bounds_reply_pointer_fails_the_call() {
    let e = failed(&load("oob.wat"));
    assert!(matches!(e, CallError::BadPointer { ptr: 0xffff_0000, .. }), "{e}");
}

#[test]
fn an_input_over_the_limit_is_not_sent() {
    let p = load_with("rank-fixed.wat", Limits { max_input_bytes: 64, ..Limits::default() });
    let e = failed(&p);
    assert!(matches!(e, CallError::InputTooLarge { max: 64, .. }), "{e}");
}

#[test]
fn a_kind_the_plugin_does_not_implement_is_not_called() {
    let p = load("rank-fixed.wat");
    let e = p.call_json(PolicyKind::Grace, &serde_json::json!({})).unwrap_err();
    assert!(matches!(e, CallError::NotProvided { kind: PolicyKind::Grace, .. }), "{e}");
}

// --- fresh instances, fixed answers, logs ----------------------------------------------

#[test]
fn state_in_a_global_or_in_memory_does_not_survive_between_calls() {
    let p = load("stateful.wat");
    for _ in 0..3 {
        assert_eq!(p.call_placement(&input()).unwrap(), PlacementAnswer::Ranked(vec!["first-call".into()]));
    }
}

#[test]
fn rank_fixed_always_ranks_the_same_two_vfs() {
    let p = load("rank-fixed.wat");
    assert_eq!(
        p.call_placement(&input()).unwrap(),
        PlacementAnswer::Ranked(vec!["0000:41:00.4".into(), "0000:41:00.5".into()])
    );
    assert_eq!(p.stats().calls_ok, 1);
}

#[test]
fn hv_cloud_always_answers_cloud_hypervisor() {
    let p = Plugin::load(&wat("hv-cloud.wat"), PolicyKind::Hypervisor, Limits::default()).unwrap();
    let input = HypervisorInput {
        request: HypervisorRequest {
            name: "web-1".into(),
            labels: Default::default(),
            requested_hypervisor: None,
            framework: Some(Framework::VendorVfio),
            devices: vec![],
        },
        hypervisors: vec![],
        params: serde_json::json!({}),
    };
    assert_eq!(p.call_hypervisor(&input).unwrap(), HypervisorAnswer::Hypervisor("cloud-hypervisor".into()));
}

#[test]
fn a_chatty_plugin_is_rate_limited_not_failed() {
    let p = load("chatty.wat");
    assert_eq!(p.call_placement(&input()).unwrap(), PlacementAnswer::Ranked(vec![]));
    let dropped = p.stats().log_lines_dropped;
    assert!(dropped >= u64::from(100 - gpuvisor_policy::LOG_LINES_PER_CALL), "dropped {dropped}");
}

#[test]
fn a_call_report_holds_the_calls_log_lines_fuel_and_time() {
    let p = load("chatty.wat");
    let input = serde_json::to_value(input()).unwrap();
    let (answer, report) = p.call_json_report(PolicyKind::Placement, &input);
    assert_eq!(answer.unwrap(), serde_json::json!({"ranked": []}));
    // The per-call budget admits the first lines; the rest of the 100 are counted dropped.
    assert_eq!(report.logs.len(), gpuvisor_policy::LOG_LINES_PER_CALL as usize, "{report:?}");
    assert!(report.logs.iter().all(|l| l.level == "info" && l.line == "hello from a chatty plugin"), "{report:?}");
    assert_eq!(report.logs_dropped, 100 - u64::from(gpuvisor_policy::LOG_LINES_PER_CALL));
    assert!(report.fuel_used > Some(100), "{report:?}");
    assert!(!report.wall.is_zero());
    // The same call path as the typed calls: the stats count it.
    let stats = p.stats();
    assert_eq!((stats.calls_ok, Some(stats.fuel_consumed)), (1, report.fuel_used));
    // A failed call reports too.
    let p = load_with("loop.wat", Limits { fuel: 1_000_000, deadline: Duration::from_secs(60), ..Limits::default() });
    let (answer, report) = p.call_json_report(PolicyKind::Placement, &input);
    assert_eq!(answer.unwrap_err().reason(), "out_of_fuel");
    assert_eq!(report.fuel_used, Some(p.limits().fuel), "out of fuel: counted");
}

#[test]
fn concurrent_calls_from_many_threads_each_get_their_own_instance() {
    let p = std::sync::Arc::new(load("stateful.wat"));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let p = p.clone();
            std::thread::spawn(move || {
                for _ in 0..20 {
                    assert_eq!(p.call_placement(&input()).unwrap(), PlacementAnswer::Ranked(vec!["first-call".into()]));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(p.stats().calls_ok, 160);
}
