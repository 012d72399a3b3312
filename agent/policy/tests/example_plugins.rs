//! The example plugins (`plugins/examples/`) on their fixtures: natively and through
//! wasmtime (the release wasm32 builds), with identical answers and the expected ones.

mod common;

use common::{built_plugin, fixture, root};
use gpuvisor_policy::{run_plugin_file, CallError, Limits, Plugin, RunError};
use gpuvisor_sdk::testing::load_input;
use gpuvisor_sdk::{HypervisorAnswer, HypervisorInput, PolicyKind};
use std::sync::{Arc, Mutex};

// ---------------------------------------------------------------------------------------
// hypervisor-ch-plain

/// The fixtures of `hypervisor-ch-plain` (`plugins/fixtures/hypervisor-ch-plain-*.json`)
/// and the answer each must give: `Ok(answer)`, or `Err(message)` of `{"error": message}`.
fn ch_plain_expected() -> Vec<(&'static str, Result<HypervisorAnswer, String>)> {
    let hv = |name: &str| Ok(HypervisorAnswer::Hypervisor(name.to_string()));
    let reject = |why: &str| Ok(HypervisorAnswer::Reject(why.to_string()));
    vec![
        ("hypervisor-ch-plain-plain.json", hv("cloud-hypervisor")),
        ("hypervisor-ch-plain-plain-requests-qemu.json", hv("cloud-hypervisor")),
        ("hypervisor-ch-plain-gpu-requests-ch.json", hv("qemu")),
        ("hypervisor-ch-plain-passthrough-devices.json", hv("qemu")),
        (
            "hypervisor-ch-plain-mdev-no-qemu.json",
            reject(
                "no hypervisor for a GPU instance needing mdev: site policy runs GPU instances only on qemu, \
                 which is not available",
            ),
        ),
        ("hypervisor-ch-plain-ch-unavailable.json", hv("qemu")),
        (
            "hypervisor-ch-plain-ch-unavailable-no-fallback.json",
            reject("cloud-hypervisor is not available for a plain instance and params.fallback_to_qemu is false"),
        ),
        (
            "hypervisor-ch-plain-nothing-available.json",
            reject("cloud-hypervisor is not available for a plain instance, nor is its fallback qemu"),
        ),
        (
            "hypervisor-ch-plain-bad-fallback.json",
            Err(r#"params.fallback_to_qemu must be a boolean, found "yes""#.to_string()),
        ),
    ]
}

fn ch_plain_plugin() -> Plugin {
    Plugin::load(&built_plugin("hypervisor-ch-plain"), PolicyKind::Hypervisor, Limits::default()).unwrap()
}

/// Runs `hypervisor-ch-plain` on a fixture through wasmtime and natively, checks that both
/// agree, and returns the answer (`Err` = the plugin's `{"error": ..}` message).
fn ch_plain(plugin: &Plugin, name: &str) -> Result<HypervisorAnswer, String> {
    let input: HypervisorInput = load_input(fixture(name)).unwrap();
    let through_wasm = match plugin.call_hypervisor(&input) {
        Ok(answer) => Ok(answer),
        Err(CallError::Plugin { plugin, message, .. }) => {
            assert_eq!(plugin, "hypervisor-ch-plain");
            Err(message)
        }
        Err(other) => panic!("hypervisor-ch-plain on {name} failed: {other}"),
    };
    assert_eq!(through_wasm, hypervisor_ch_plain::choose(&input), "{name}: wasm and native differ");
    through_wasm
}

fn check_ch_plain(name: &str) {
    let expected = ch_plain_expected().into_iter().find(|(n, _)| *n == name).expect("a fixture of the table").1;
    let plugin = ch_plain_plugin();
    assert_eq!(ch_plain(&plugin, name), expected, "{name}");
    assert_eq!(plugin.stats().log_lines_dropped, 0);
}

#[test]
fn ch_plain_runs_a_plain_instance_on_cloud_hypervisor() {
    check_ch_plain("hypervisor-ch-plain-plain.json");
}

#[test]
fn ch_plain_overrides_a_plain_request_for_qemu() {
    check_ch_plain("hypervisor-ch-plain-plain-requests-qemu.json");
}

#[test]
fn ch_plain_runs_a_vgpu_instance_requesting_cloud_hypervisor_on_qemu() {
    check_ch_plain("hypervisor-ch-plain-gpu-requests-ch.json");
}

#[test]
fn ch_plain_runs_passthrough_devices_on_qemu() {
    check_ch_plain("hypervisor-ch-plain-passthrough-devices.json");
}

#[test]
fn ch_plain_rejects_a_gpu_instance_without_qemu() {
    check_ch_plain("hypervisor-ch-plain-mdev-no-qemu.json");
}

#[test]
fn ch_plain_falls_back_to_qemu_by_default() {
    check_ch_plain("hypervisor-ch-plain-ch-unavailable.json");
}

#[test]
fn ch_plain_rejects_a_plain_instance_when_the_fallback_is_off() {
    check_ch_plain("hypervisor-ch-plain-ch-unavailable-no-fallback.json");
}

#[test]
fn ch_plain_rejects_a_plain_instance_when_nothing_is_available() {
    check_ch_plain("hypervisor-ch-plain-nothing-available.json");
}

#[test]
fn ch_plain_fails_on_a_non_boolean_fallback() {
    check_ch_plain("hypervisor-ch-plain-bad-fallback.json");
}

#[test]
fn ch_plain_every_fixture_has_an_expected_answer() {
    let mut on_disk: Vec<String> = std::fs::read_dir(root().join("plugins/fixtures"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("hypervisor-ch-plain-") && n.ends_with(".json"))
        .collect();
    on_disk.sort();
    let expected = ch_plain_expected();
    let mut in_table: Vec<String> = expected.iter().map(|(n, _)| n.to_string()).collect();
    in_table.sort();
    assert_eq!(on_disk, in_table, "every hypervisor-ch-plain fixture needs an expected answer here");

    // One plugin for all fixtures, in order: no answer depends on an earlier call.
    let plugin = ch_plain_plugin();
    for (name, answer) in expected {
        assert_eq!(ch_plain(&plugin, name), answer, "{name}");
    }
    let stats = plugin.stats();
    assert_eq!(stats.calls_ok, 8);
    assert_eq!(stats.calls_failed.get("plugin_error"), Some(&1));
    assert_eq!(stats.log_lines_dropped, 0);
}

#[test]
fn ch_plain_manifest_names_the_plugin_and_its_kind() {
    let p = ch_plain_plugin();
    assert_eq!(p.manifest().name, "hypervisor-ch-plain");
    assert_eq!(p.manifest().kinds, vec![PolicyKind::Hypervisor]);
    // Refused in any other slot.
    for slot in [PolicyKind::Placement, PolicyKind::Grace] {
        assert!(Plugin::load(&built_plugin("hypervisor-ch-plain"), slot, Limits::default()).is_err(), "{slot:?}");
    }
}

#[test]
fn ch_plain_through_plugin_test() {
    // What `gpuvisor plugin test <wasm> --input <fixture>` runs.
    let wasm = built_plugin("hypervisor-ch-plain");
    let answer = run_plugin_file(&wasm, &fixture("hypervisor-ch-plain-plain-requests-qemu.json"), None).unwrap();
    assert_eq!(answer, serde_json::json!({"hypervisor": "cloud-hypervisor"}));
    let err = run_plugin_file(&wasm, &fixture("hypervisor-ch-plain-bad-fallback.json"), None).unwrap_err();
    assert!(matches!(err, RunError::Call(CallError::Plugin { .. })), "{err}");
}

#[test]
fn ch_plain_logs_why_it_overrides_a_request_at_info() {
    let plugin = ch_plain_plugin();
    let lines = |name: &str| {
        let (answer, lines) = logged(|| ch_plain(&plugin, name));
        assert_eq!(answer, ch_plain_expected().into_iter().find(|(n, _)| *n == name).unwrap().1, "{name}");
        lines
    };
    let info = |line: &str| vec![(tracing::Level::INFO, line.to_string())];
    assert_eq!(
        lines("hypervisor-ch-plain-plain-requests-qemu.json"),
        info("requested hypervisor qemu overridden: site policy runs plain instances on cloud-hypervisor")
    );
    assert_eq!(
        lines("hypervisor-ch-plain-gpu-requests-ch.json"),
        info("requested hypervisor cloud-hypervisor ignored: site policy runs GPU instances (needing vendor_vfio) on qemu")
    );
    assert_eq!(
        lines("hypervisor-ch-plain-ch-unavailable.json"),
        info("cloud-hypervisor is not available; plain instance falls back to qemu (fallback_to_qemu)")
    );
    // Nothing requested, nothing overridden: nothing to say.
    assert_eq!(lines("hypervisor-ch-plain-plain.json"), vec![]);
    assert_eq!(lines("hypervisor-ch-plain-passthrough-devices.json"), vec![]);
}

type Lines = Vec<(tracing::Level, String)>;

thread_local! {
    /// Where [`Capture`] puts this thread's lines while [`logged`] runs.
    static CAPTURED: std::cell::RefCell<Option<Arc<Mutex<Lines>>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` capturing the `gpuvisor.log` lines of hypervisor-ch-plain that this thread logs
/// (a plugin call runs on the caller's thread); returns what it returned and the lines.
///
/// The capturing subscriber is the process's global default, installed once, and keeps
/// the lines of the threads inside `logged` only. A per-test scoped subscriber
/// (`with_default`) lost lines when tests ran in parallel: a callsite first reached on a
/// thread with no subscriber could cache "never interested" after another test's scoped
/// subscriber had rebuilt the interest cache (seen once in CI on a busy machine).
fn logged<T>(f: impl FnOnce() -> T) -> (T, Lines) {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| tracing::subscriber::set_global_default(Capture).expect("no other global subscriber"));
    let lines = Arc::new(Mutex::new(Vec::new()));
    CAPTURED.with(|c| *c.borrow_mut() = Some(lines.clone()));
    let out = f();
    CAPTURED.with(|c| *c.borrow_mut() = None);
    let lines = lines.lock().unwrap().clone();
    (out, lines)
}

/// Keeps the message of every event whose `plugin` field is `hypervisor-ch-plain`, in the
/// lines of the thread's [`logged`] call.
struct Capture;

impl tracing::Subscriber for Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        #[derive(Default)]
        struct Fields {
            plugin: String,
            message: String,
        }
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                match field.name() {
                    "plugin" => self.plugin = format!("{value:?}"),
                    "message" => self.message = format!("{value:?}"),
                    _ => {}
                }
            }
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        if fields.plugin == "hypervisor-ch-plain" {
            CAPTURED.with(|c| {
                if let Some(lines) = &*c.borrow() {
                    lines.lock().unwrap().push((*event.metadata().level(), fields.message.clone()));
                }
            });
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}
