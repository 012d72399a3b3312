//! ABI v2 plugins (components) in the one plugin host: the hostile suite run against a
//! component (`tests/hostile-v2`, misbehaving as `params.do` says; WAT components under
//! `tests/plugins/component-*.wat`), and WASI that grants nothing.

mod common;

use common::{hostile_v2, wat};
use gpuvisor_policy::{CallError, Limits, LoadError, Plugin};
use gpuvisor_sdk::{
    DeviceOwner, DeviceState, DeviceView, Framework, GpuView, Inventory, PlacementAnswer, PlacementInput,
    PlacementRequest, PolicyKind,
};
use std::time::Duration;

fn device(address: &str, state: DeviceState) -> DeviceView {
    DeviceView {
        address: address.into(),
        state,
        current_type: None,
        creatable: vec!["L40S-2Q".into()],
        owner: (state == DeviceState::Claimed).then(|| DeviceOwner {
            instance_id: "other".into(),
            profile: Some("L40S-2Q".into()),
            labels: Default::default(),
            labels_known: true,
        }),
    }
}

fn input(what: &str) -> PlacementInput {
    PlacementInput {
        request: PlacementRequest {
            instance_id: "5b0e7f5e-3f4c-4e4e-9d43-0c7a3c1f2a01".into(),
            name: "web-1".into(),
            labels: [("tenant".to_string(), "acme".to_string())].into(),
            framework: Framework::VendorVfio,
            profile: "L40S-2Q".into(),
            framebuffer_mib: Some(2048),
        },
        inventory: Inventory {
            gpus: vec![GpuView {
                address: "0000:41:00.0".into(),
                model: "NVIDIA L40S".into(),
                framebuffer_mib: Some(49152),
                numa_node: Some(0),
                claimed_framebuffer_mib: 2048,
                load_known: true,
                devices: vec![
                    device("0000:41:00.4", DeviceState::Free),
                    device("0000:41:00.5", DeviceState::Claimed),
                    device("0000:41:00.6", DeviceState::Free),
                ],
            }],
        },
        params: serde_json::json!({ "do": what }),
    }
}

fn load_with(limits: Limits) -> Plugin {
    Plugin::load(&hostile_v2(""), PolicyKind::Placement, limits)
        .unwrap_or_else(|e| panic!("hostile-v2 should load: {e}"))
}

fn load() -> Plugin {
    load_with(Limits::default())
}

fn failed(p: &Plugin, what: &str) -> CallError {
    let err = p.call_placement(&input(what)).expect_err("the call must fail");
    assert!(err.to_string().contains("hostile-v2"), "the message names the plugin: {err}");
    assert_eq!(p.stats().calls_failed.get(err.reason()), Some(&1), "counted once");
    err
}

fn refused(path: &std::path::Path) -> LoadError {
    match Plugin::load(path, PolicyKind::Placement, Limits::default()) {
        Ok(_) => panic!("{} was loaded", path.display()),
        Err(e) => {
            assert!(e.to_string().contains(&path.display().to_string()), "the message names the file: {e}");
            e
        }
    }
}

// --- loaded and called ------------------------------------------------------------------

#[test]
fn a_component_loads_beside_modules_and_answers_typed() {
    let p = load();
    assert_eq!(p.abi_version(), 2);
    assert_eq!(p.manifest().name, "hostile-v2");
    assert_eq!(p.manifest().kinds, vec![PolicyKind::Placement]);
    let answer = p.call_placement(&input("rank")).unwrap();
    assert_eq!(answer, PlacementAnswer::Ranked(vec!["0000:41:00.4".into(), "0000:41:00.6".into()]));
    // The same call through JSON (as `gpuvisor plugin test` makes it).
    let json = p.call_json(PolicyKind::Placement, &serde_json::to_value(input("rank")).unwrap()).unwrap();
    assert_eq!(json, serde_json::json!({"ranked": ["0000:41:00.4", "0000:41:00.6"]}));
    // Input JSON that is not a placement input is refused before the call.
    let err = p.call_json(PolicyKind::Placement, &serde_json::json!({"nope": 1})).unwrap_err();
    assert_eq!(err.reason(), "input_encode", "{err}");
    assert_eq!(p.stats().calls_ok, 2);
}

#[test]
fn a_component_ranking_claimed_devices_is_only_decoded_here() {
    // The host decodes; the agent's validation drops the claimed device (policy tests of
    // the agent). What matters here: the answer is passed on as given, in order.
    let answer = load().call_placement(&input("claimed")).unwrap();
    let PlacementAnswer::Ranked(r) = answer else { panic!("{answer:?}") };
    assert_eq!(r[0], "0000:41:00.5", "{r:?}");
}

#[test]
fn a_kind_the_component_does_not_export_is_not_called() {
    let p = load();
    let grace = gpuvisor_sdk::GraceInput {
        now_boottime_ms: 1,
        boot_id: "b".into(),
        items: vec![],
        params: serde_json::json!({}),
    };
    assert_eq!(p.call_grace(&grace).unwrap_err().reason(), "not_provided");
}

// --- fails closed -----------------------------------------------------------------------

#[test]
fn a_trap_in_a_component_fails_the_call() {
    assert!(matches!(failed(&load(), "trap"), CallError::Trap { .. }));
}

#[test]
fn an_infinite_loop_in_a_component_runs_out_of_fuel() {
    let p = load_with(Limits { fuel: 1_000_000, deadline: Duration::from_secs(60), ..Limits::default() });
    assert!(matches!(failed(&p, "loop"), CallError::OutOfFuel { fuel: 1_000_000, .. }));
}

#[test]
fn an_infinite_loop_in_a_component_passes_its_deadline() {
    let p = load_with(Limits { fuel: u64::MAX / 2, deadline: Duration::from_millis(50), ..Limits::default() });
    assert!(matches!(failed(&p, "loop"), CallError::Deadline { deadline_ms: 50, .. }));
}

#[test]
fn memory_growth_of_a_component_beyond_its_limit_fails_the_call() {
    let p = load_with(Limits { memory_bytes: 8 << 20, fuel: 1_000_000_000, ..Limits::default() });
    assert!(matches!(failed(&p, "grow"), CallError::MemoryLimit { limit_bytes, .. } if limit_bytes == 8 << 20));
}

#[test]
fn a_huge_answer_of_a_component_fails_the_call() {
    let p = load_with(Limits { fuel: 1_000_000_000, deadline: Duration::from_secs(10), ..Limits::default() });
    let err = failed(&p, "huge");
    assert!(matches!(err, CallError::OutputTooLarge { max, .. } if max == 1 << 20), "{err}");
}

#[test]
fn an_input_over_the_limit_is_not_sent_to_a_component() {
    let p = load_with(Limits { max_input_bytes: 100, ..Limits::default() });
    assert!(matches!(failed(&p, "rank"), CallError::InputTooLarge { max: 100, .. }));
}

#[test]
fn an_err_of_a_component_fails_the_call_with_its_message() {
    let err = failed(&load(), "error");
    assert!(matches!(&err, CallError::Plugin { message, .. } if message == "hostile error"), "{err}");
}

// --- WASI grants nothing ----------------------------------------------------------------

/// The `key=value` pairs of the WASI probe's answer.
fn probe(p: &Plugin) -> (std::collections::BTreeMap<String, String>, gpuvisor_policy::CallReport) {
    let (result, report) = p.call_json_report(PolicyKind::Placement, &serde_json::to_value(input("wasi")).unwrap());
    let answer = result.unwrap();
    let text = answer["reject"].as_str().unwrap_or_else(|| panic!("{answer}")).to_string();
    let pairs = text
        .split(' ')
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("{kv} in {text}"));
            (k.to_string(), v.to_string())
        })
        .collect();
    (pairs, report)
}

#[test]
fn a_wasi_guest_gets_no_files_sockets_environment_or_time_and_fixed_randomness() {
    let p = load();
    let (got, report) = probe(&p);
    assert_eq!(got["dirs"], "0", "no preopened directory: {got:?}");
    assert_eq!(got["socket"], "err:access-denied", "no socket: {got:?}");
    assert_eq!(got["wall"], "1704067200,0", "a fixed wall clock: {got:?}");
    assert_eq!(got["wall2"], got["wall"], "the clock does not move: {got:?}");
    assert_eq!(got["mono"], "0,0", "a monotonic clock that does not advance: {got:?}");
    assert_eq!((got["env"].as_str(), got["args"].as_str()), ("0", "0"), "{got:?}");
    let (r1, r2) = got["random"].split_once(',').unwrap();
    assert_ne!(r1, r2, "two draws in one call differ");
    // stdout goes to the plugin's log.
    assert_eq!(got["printed"], "true");
    assert!(
        report.logs.iter().any(|l| l.line == "hello from hostile-v2 stdout" && l.level == "info"),
        "{:?}",
        report.logs
    );
    // The same input gives the same answer, randomness included.
    let (again, _) = probe(&p);
    assert_eq!(again, got);
}

// --- refused at load --------------------------------------------------------------------

#[test]
fn a_component_importing_a_capability_the_host_does_not_grant_is_refused() {
    let e = refused(&wat("component-imports-http.wat"));
    assert!(matches!(&e, LoadError::WasiNotGranted { name, .. } if name.starts_with("wasi:http/")), "{e}");
    let e = refused(&wat("component-imports-unknown.wat"));
    assert!(matches!(&e, LoadError::ForbiddenImport { module, .. } if module == "evil:net/socket"), "{e}");
    assert!(e.to_string().contains("gpuvisor:policy/log@2.0.0"), "says what may be imported: {e}");
}

#[test]
fn a_component_of_another_wit_version_is_refused() {
    for file in ["component-log-v3.wat", "component-exports-v3.wat"] {
        let e = refused(&wat(file));
        assert!(matches!(&e, LoadError::WitVersion { name, .. } if name.ends_with("@3.0.0")), "{file}: {e}");
        assert!(e.to_string().contains("gpuvisor:policy@2.0.0"), "{e}");
    }
}

#[test]
fn a_component_exporting_no_policy_is_refused() {
    let e = refused(&wat("component-exports-nothing.wat"));
    assert!(matches!(e, LoadError::MissingExport { .. }), "{e}");
}

#[test]
fn a_component_whose_manifest_lists_other_kinds_than_it_exports_is_refused() {
    let path = hostile_v2("lying-manifest");
    let e = refused(&path);
    assert!(
        matches!(&e, LoadError::KindsMismatch { listed, exported, .. }
            if listed == &[PolicyKind::Grace] && exported == &[PolicyKind::Placement]),
        "{e}"
    );
}

#[test]
fn a_component_whose_manifest_says_another_abi_version_is_refused() {
    let e = refused(&hostile_v2("abi-one"));
    assert!(matches!(e, LoadError::AbiVersion { found: 1, expected: 2, .. }), "{e}");
}

#[test]
fn a_component_in_the_wrong_slot_is_refused() {
    let e = Plugin::load(&hostile_v2(""), PolicyKind::Grace, Limits::default()).unwrap_err();
    assert!(matches!(e, LoadError::WrongSlot { slot: PolicyKind::Grace, .. }), "{e}");
}

/// A load's calls (ABI version, manifest) have at least `LOAD_DEADLINE`, whatever the
/// slot's deadline: a component whose first instance takes longer than a short per-call
/// deadline to start (a JavaScript engine on a busy host failed `plugin test` at load with
/// a 50 ms deadline) still loads. With a deadline of 1 µs every load failed before.
#[test]
fn a_load_is_not_held_to_a_short_per_call_deadline() {
    let p = load_with(Limits { deadline: Duration::from_micros(1), ..Limits::default() });
    assert_eq!(p.manifest().name, "hostile-v2");
    assert!(gpuvisor_policy::LOAD_DEADLINE >= Duration::from_secs(1));
}
