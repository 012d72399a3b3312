//! End to end: the fail-closed rules of issue 7 finding 8 (the held-back acceptance suite),
//! one test (or a few) per rule, against the real agent, gpuvisor-sim and QEMU (paused
//! through a `qemu_binary` wrapper: the tests need a real VMM holding its VF, not a booted
//! guest). The agent binary must be built with `--features gpuvisor/failpoints`.
//!
//! - I13/I6: nothing is released or swept while the host's PCI devices cannot be listed
//!   (at startup, in a periodic pass, and after a stop).
//! - docs/design/host.md §3.1: a catalog row with type id 0 is never a type.
//! - docs/design/host.md §1: a host where no VF's type can be read is a probe error, never a host
//!   without GPUs.
//! - I6: an undecodable instance or claim record blocks only what it may own.
//! - docs/design/lifecycle.md Reconciler 2: a live control-socket owner is recorded as the VMM when the
//!   recorded pid belongs to another process.
//! - A pass counts a device as released only when it wrote something.
//! - Devices skipped for unreadable state are named (once) and counted.
//! - A rollback whose VMM would not die says so in its structured cause.
//! - mdev: unreadable is not absent (the sweep never forgets an mdev it cannot read).
//!
//! Synchronisation is on events (answers, files, the simulator's write log, the failpoint
//! registry's `waiting`), with bounded waits; no assertion depends on how much work fits in
//! a time window.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Host V reduced to one VF.
const HOST_V1: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 1\niommu_group = 40\n";
/// One L40S with 2 VFs as mdev parents.
const HOST_M: &str =
    "framework = \"mdev\"\nrelease_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 2\niommu_group = 40\n";
const VF0: &str = "0000:41:00.4";
const VF1: &str = "0000:41:00.5";
const VF2: &str = "0000:41:00.6";
const PCI_DEVICES: &str = "sys/bus/pci/devices";
const ALL_TYPES: &str = "sys/bus/pci/devices/*/nvidia/current_vgpu_type";
const ORPHANS: &str = "gpuvisor_vgpu_orphans_released_total";
const STALE: &str = "gpuvisor_vgpu_stale_releases_total";
const FOREIGN_MDEV: &str = "6a7d6a8c-7777-4c1b-a0c4-6f0d0e9b7b07";

// ------------------------------------------------------------------------------ helpers

/// An agent on `model` whose QEMUs are paused (`-S`); periodic passes every hour unless
/// `extra` says otherwise. The wrapper must outlive the agent (tuple order drops the agent
/// first).
fn start(model: &str, extra: &str) -> (Agent, QemuWrapper) {
    start_set(model, extra, &[])
}

fn start_set(model: &str, extra: &str, set: &[(&str, &str)]) -> (Agent, QemuWrapper) {
    assert_failpoints_built();
    let w = QemuWrapper::new();
    let mut extra = format!("{}{extra}", w.extra());
    if !extra.contains("reconcile_interval_s") {
        extra.push_str("reconcile_interval_s = 3600\n");
    }
    let a = Agent::start_tuned(AgentOptions { model, extra: &extra, ..Default::default() }, None, set).unwrap();
    (a, w)
}

/// The `kept` reasons of a pass report for `device`.
fn kept_reasons(report: &Value, device: &str) -> Vec<String> {
    report["kept"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|k| k["device"] == device)
        .map(|k| k["reason"].as_str().unwrap_or("").to_string())
        .collect()
}

/// The device entry of `gpu.list` for `addr` (`Null` when not listed).
fn gpu_device(gpus: &Value, addr: &str) -> Value {
    gpus["gpus"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .flat_map(|g| g["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["address"] == addr)
        .unwrap_or(Value::Null)
}

/// Lines of the agent's log at WARN containing every needle.
fn warn_lines(a: &Agent, needles: &[&str]) -> Vec<String> {
    a.log()
        .lines()
        .filter(|l| l.contains(" WARN ") && needles.iter().all(|n| l.contains(n)))
        .map(String::from)
        .collect()
}

fn metric_now(a: &Agent, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric0(&a.metrics(), name, labels)
}

fn health(a: &Agent) -> Value {
    a.ok("agent.health", json!({}))
}

fn failpoint(a: &Agent, name: &str, action: &str) {
    a.ok("debug.failpoint", json!({"name": name, "action": action}));
}

/// Threads waiting at pause point `name` now.
fn waiting_at(a: &Agent, name: &str) -> u64 {
    let list = a.ok("debug.failpoints", json!({}));
    list["failpoints"]
        .as_array()
        .and_then(|l| l.iter().find(|p| p["name"] == name))
        .and_then(|p| p["waiting"].as_u64())
        .unwrap_or(0)
}

/// Polls passes (each must answer) until `done` holds for the device state, bounded.
fn pass_until(a: &Agent, what: &str, timeout: Duration, mut done: impl FnMut(&Agent, &Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let rep = a.pass();
        if done(a, &rep) {
            return rep;
        }
        assert!(t0.elapsed() < timeout, "{what}: not reached after {:?}; last pass: {rep}", t0.elapsed());
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Arms `reconcile_before_release` and runs passes until one has decided to release
/// something (an orphan older than claim_grace) and waits at the point, before releasing
/// it. Returns that pass's call (answered once the point is released).
fn pass_paused_before_release(a: &Agent) -> std::thread::JoinHandle<anyhow::Result<Value>> {
    const FP: &str = "reconcile_before_release";
    failpoint(a, FP, "pause");
    let t0 = Instant::now();
    loop {
        let h = a.spawn_call("reconcile.run", json!({}));
        wait_for(Duration::from_secs(60), || (waiting_at(a, FP) >= 1 || h.is_finished()).then_some(()))
            .expect("the pass either pauses or answers");
        if waiting_at(a, FP) >= 1 {
            return h;
        }
        let rep = h.join().unwrap().unwrap();
        assert!(rep["result"]["released"].as_array().unwrap().is_empty(), "released without pausing: {rep}");
        assert!(t0.elapsed() < Duration::from_secs(60), "no pass decided to release anything: {rep}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Waits until no handle is open on `vf` and its teardown lag is over.
fn wait_idle(a: &Agent, vf: &str) {
    wait_for(Duration::from_secs(15), || {
        let e = vf_entry(&a.state(), vf);
        (e["handles"].as_array().map(|h| h.is_empty()).unwrap_or(true) && e["busy_until_ms"].is_null()).then_some(())
    })
    .unwrap_or_else(|| panic!("{vf} never became idle: {}", vf_entry(&a.state(), vf)));
}

// ====================================================================== 1. I13 / I6: PCI listing

/// I13/I6 at startup: an agent restarted while `sys/bus/pci/devices` cannot be listed never
/// becomes ready, and no pass releases anything — not the retained claim of a stopped
/// instance, and not the claim a stop (of a running instance) leaves behind while no pass
/// has had a complete observation. Once the listing works, the next passes release both.
#[test]
fn nothing_is_released_at_startup_while_the_pci_devices_cannot_be_listed() {
    let (mut a, _w) = start(HOST_V, "claim_grace_s = 2\n");
    let (b_id, b_vf) = a.retained_stopped("b", "L40S-2Q");
    let r = a.create_gpu("r", "L40S-2Q").unwrap();
    let r_vf = r["gpu"]["device"].as_str().unwrap().to_string();
    assert_ne!(r_vf, b_vf);
    a.kill_agent();
    a.sim.ctl(&["fail-read", PCI_DEVICES, "EIO", "--always"]).unwrap();
    let seq = last_seq(&a.state());
    a.restart_with_failpoints(None).unwrap();

    for _ in 0..2 {
        let rep = a.pass();
        assert_eq!(rep["released"], json!([]), "{rep}");
        assert_eq!(writes_after(&a, seq), vec![], "BUG: a sysfs write while the PCI devices cannot be listed: {rep}");
        assert_eq!(rep["failed"], json!([]), "nothing was even tried: {rep}");
        assert_eq!(rep["inventory_complete"], true, "the store is readable: {rep}");
        assert_eq!(rep["host_complete"], false, "{rep}");
    }
    let h = health(&a);
    assert_eq!(h["ready"], false, "ready without a complete observation: {h}");
    assert_eq!(h["gpu_mode"], "probe_error", "{h}");
    // A stop while no pass has observed the host completely: the VMM dies, the claim stays.
    let st = a.ok("instance.stop", json!({"ref": "r", "force": true}));
    assert_eq!(st["state"], "stopped", "{st}");
    assert_eq!(st["gpu"]["release_pending"], true, "the stop could not release (not ready): {st}");
    assert!(qemu_of(r["id"].as_str().unwrap()).is_empty(), "r's QEMU is gone");
    wait_idle(&a, &r_vf);
    for _ in 0..2 {
        let rep = a.pass();
        assert_eq!(rep["host_complete"], false, "{rep}");
        assert_eq!(rep["released"], json!([]), "{rep}");
    }
    assert_eq!(writes_after(&a, seq), vec![], "BUG: a sysfs write while the PCI devices cannot be listed");
    assert_eq!(a.claim(&b_vf).unwrap()["instance_id"], b_id.as_str());
    assert_eq!(a.claim(&r_vf).unwrap()["state"], "release_pending");
    assert_eq!(a.vf_type(&b_vf), 1148);
    assert_eq!(a.vf_type(&r_vf), 1148);
    let e = a.create_gpu("n", "L40S-2Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (503, "not_ready"), "{e}");

    a.sim.ctl(&["clear-faults"]).unwrap();
    let rep = pass_until(&a, "both retained claims released", Duration::from_secs(30), |a, _| {
        a.claim(&b_vf).is_none() && a.claim(&r_vf).is_none()
    });
    assert_eq!(rep["host_complete"], true, "{rep}");
    assert_eq!(a.vf_type(&b_vf), 0);
    assert_eq!(a.vf_type(&r_vf), 0);
    let w = writes_after(&a, seq);
    assert!(w.iter().all(|(p, v, _)| (*p == type_path(&b_vf) || *p == type_path(&r_vf)) && v == "0"), "{w:?}");
    a.wait_ready().unwrap();
}

/// I13/I6 on a running agent: periodic passes while `sys/bus/pci/devices` cannot be listed
/// release nothing — neither the retained claim of an instance stopped during the fault
/// (its clear failed with EBUSY) nor that of a second one stopped later — and the agent is
/// not ready; after `clear-faults` a periodic pass releases both.
#[test]
fn periodic_passes_release_nothing_while_the_pci_devices_cannot_be_listed() {
    let (a, _w) = start(HOST_V, "claim_grace_s = 2\nreconcile_interval_s = 1\n");
    let b = a.create_gpu("b", "L40S-2Q").unwrap();
    let r = a.create_gpu("r", "L40S-2Q").unwrap();
    let b_vf = b["gpu"]["device"].as_str().unwrap().to_string();
    let r_vf = r["gpu"]["device"].as_str().unwrap().to_string();
    // Faults stay armed until the end: the listing fails, and so would any clear of the two
    // VFs (a pass that tried one would show in the write log as an EBUSY write).
    a.sim.ctl(&["fail-read", PCI_DEVICES, "EIO", "--always"]).unwrap();
    for vf in [&b_vf, &r_vf] {
        a.sim.ctl(&["fail-write", &type_path(vf), "EBUSY", "--always"]).unwrap();
    }
    let passes = |a: &Agent| metric_now(a, "gpuvisor_vgpu_reconcile_runs", &[]);
    let stop_retained = |name: &str, vf: &str| {
        let st = a.ok("instance.stop", json!({"ref": name, "force": true}));
        assert_eq!(st["state"], "stopped", "{st}");
        assert_eq!(st["gpu"]["release_pending"], true, "{st}");
        wait_idle(&a, vf);
        let seq = last_seq(&a.state());
        let n = passes(&a);
        wait_for(Duration::from_secs(60), || (passes(&a) >= n + 2.0).then_some(()))
            .expect("two periodic passes ran with the host unlistable");
        assert_eq!(writes_after(&a, seq), vec![], "BUG: a pass wrote while the PCI devices cannot be listed");
    };
    let complete = |a: &Agent| metric_now(a, "gpuvisor_vgpu_reconcile_runs", &[("result", "complete")]);
    // A pass that was already past its observation when the faults were armed ends first.
    let n = passes(&a);
    wait_for(Duration::from_secs(60), || (passes(&a) >= n + 1.0).then_some(())).expect("a periodic pass");
    let complete0 = complete(&a);
    stop_retained("b", &b_vf);
    stop_retained("r", &r_vf);
    assert_eq!(complete(&a), complete0, "no pass had a complete observation while the listing failed");
    assert_eq!(a.claim(&b_vf).unwrap()["state"], "release_pending", "b's retained claim is kept");
    assert_eq!(a.claim(&r_vf).unwrap()["state"], "release_pending", "r's retained claim is kept");
    assert_eq!(a.vf_type(&b_vf), 1148);
    assert_eq!(a.vf_type(&r_vf), 1148);
    let h = health(&a);
    assert_eq!(h["ready"], false, "{h}");

    a.sim.ctl(&["clear-faults"]).unwrap();
    wait_for(Duration::from_secs(60), || (a.claim(&b_vf).is_none() && a.claim(&r_vf).is_none()).then_some(()))
        .unwrap_or_else(|| panic!("a periodic pass after clear-faults releases both: {:?}", a.claims()));
    assert_eq!(a.vf_type(&b_vf), 0);
    assert_eq!(a.vf_type(&r_vf), 0);
    assert_eq!(health(&a)["ready"], true);
}

// ====================================================================== 2. docs/design/host.md §3.1: id 0

const ZERO_ROW: &str = "0    : NVIDIA L40S-2Q";
const GARBAGE_ROW: &str = "this is not a catalog row";

fn catalog_path(vf: &str) -> String {
    format!("sys/bus/pci/devices/{vf}/nvidia/creatable_vgpu_types")
}

/// docs/design/host.md §3.1: a catalog row whose id is `0` is never a type. With only that row, a
/// create of its profile writes nothing (`no_capacity`); with the real row after it, the
/// create writes the real id — never `0` "as a create". The skipped rows are listed per
/// device in `gpu.list`, counted in `resources.get` and the gauge, and warned once per VF
/// and row (not once per observation).
#[test]
fn a_catalog_row_with_type_id_0_is_skipped_counted_and_warned_once_never_written() {
    let (a, _w) = start(HOST_V, "");
    let seq = last_seq(&a.state());
    let only_zero = format!("ID    : vGPU Name\n{ZERO_ROW}\n{GARBAGE_ROW}\n");
    for vf in V_VFS {
        a.sim.ctl(&["override", &catalog_path(vf), &only_zero]).unwrap();
    }
    let e = a.create_gpu("z", "L40S-2Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "{e}");
    assert_eq!(writes_after(&a, seq), vec![], "BUG: a type-0 row was used for a create");

    let with_real = format!("ID    : vGPU Name\n{ZERO_ROW}\n{GARBAGE_ROW}\n1148  : NVIDIA L40S-2Q\n");
    for vf in V_VFS {
        a.sim.ctl(&["override", &catalog_path(vf), &with_real]).unwrap();
    }
    let y = a.create_gpu("y", "L40S-2Q").unwrap();
    assert_eq!(y["gpu"]["type_id"], 1148, "{y}");
    let dev = y["gpu"]["device"].as_str().unwrap().to_string();
    assert_eq!(writes_after(&a, seq), vec![(type_path(&dev), "1148".into(), "ok".into())], "one write: the real id");

    let gpus = a.ok("gpu.list", json!({}));
    for vf in V_VFS {
        let d = gpu_device(&gpus, vf);
        let skipped: Vec<&str> =
            d["catalog_skipped_lines"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect();
        assert_eq!(skipped, vec![ZERO_ROW, GARBAGE_ROW], "{vf}: {d}");
        assert!(!d["creatable"].to_string().contains("\"0"), "{d}");
    }
    for _ in 0..3 {
        let res = a.ok("resources.get", json!({}));
        assert_eq!(res["devices"]["catalog_skipped_lines"], 8, "4 VFs × 2 rows: {res}");
    }
    assert_eq!(metric_now(&a, "gpuvisor_vgpu_catalog_skipped_lines", &[]), 8.0);
    a.ok("gpu.list", json!({}));
    for vf in V_VFS {
        let zero = warn_lines(&a, &[vf, "skipped", "NVIDIA L40S-2Q"]);
        assert_eq!(zero.len(), 1, "one WARN naming {vf} and the id-0 row: {zero:?}");
        let garbage = warn_lines(&a, &[vf, "skipped", GARBAGE_ROW]);
        assert_eq!(garbage.len(), 1, "one WARN naming {vf} and the garbage row: {garbage:?}");
    }
}

// ====================================================================== 3. docs/design/host.md §1: no readable VF

fn assert_probe_error(a: &Agent, gpus_expected: usize) {
    let gpus = a.ok("gpu.list", json!({}));
    assert_eq!(gpus["mode"], "probe_error", "never `none`: {gpus}");
    assert!(gpus["probe_error"].as_str().is_some_and(|s| !s.is_empty()), "{gpus}");
    let list = gpus["gpus"].as_array().unwrap();
    assert_eq!(list.len(), gpus_expected, "every GPU is shown, never an empty host: {gpus}");
    for g in list {
        assert!(g["probe_error"].as_str().is_some_and(|s| !s.is_empty()), "probe_error on each GPU: {g}");
        for d in g["devices"].as_array().unwrap() {
            assert_eq!(d["state"], "unreadable", "{d}");
            assert_eq!(d["current_type"], "unknown", "{d}");
        }
    }
    let res = a.ok("resources.get", json!({}));
    assert_eq!(res["ready"], false, "{res}");
    assert_eq!(res["mode"], "probe_error", "{res}");
    assert_eq!(res["devices"]["allocatable"], 0, "{res}");
    let h = health(a);
    assert_eq!(h["ready"], false, "{h}");
    assert_eq!(h["gpu_mode"], "probe_error", "{h}");
    let e = a.create_gpu("p", "L40S-2Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (503, "not_ready"), "{e}");
}

/// docs/design/host.md §1, I13: when no VF's `current_vgpu_type` can be read the host is a probe
/// error — not ready, every GPU shown with its probe error — never "no GPUs and ready";
/// the same after a restart; ready again once the types can be read.
#[test]
fn a_host_where_no_vf_type_can_be_read_is_a_probe_error_never_a_host_without_gpus() {
    let (mut a, _w) = start(HOST_V2, "");
    let seq = last_seq(&a.state());
    a.sim.ctl(&["fail-read", ALL_TYPES, "EIO", "--always"]).unwrap();
    assert_probe_error(&a, 2);
    let rep = a.pass();
    assert_eq!(rep["host_complete"], false, "{rep}");
    // The same at startup.
    a.kill_agent();
    a.restart_with_failpoints(None).unwrap();
    assert_probe_error(&a, 2);
    assert_eq!(health(&a)["startup_reconcile_done"], false);
    assert_eq!(writes_after(&a, seq), vec![]);
    assert!(a.claims().is_empty());
    assert!(a.instance_names().is_empty(), "the refused creates left nothing");

    a.sim.ctl(&["clear-faults"]).unwrap();
    a.wait_ready().unwrap();
    let gpus = a.ok("gpu.list", json!({}));
    assert_eq!(gpus["mode"], "vendor_vfio", "{gpus}");
    a.create_gpu("p", "L40S-2Q").unwrap();
}

// ====================================================================== 4. I6: unreadable records

/// I6: an undecodable instance record breaks nothing but itself: `instance.list` lists the
/// others and names it as unreadable, `instance.get` of another instance, plain and GPU
/// creates and `gpu.list` work; the agent is ready and degraded, naming the path.
#[test]
fn an_undecodable_instance_record_leaves_the_rest_of_the_api_working() {
    let (a, _w) = start(HOST_V, "");
    let x = a.ok("instance.create", json!({"name": "x", "image": "demo"}));
    a.ok("instance.stop", json!({"ref": "x", "force": true}));
    let other = a.create_gpu("other", "L40S-2Q").unwrap();
    let xid = x["id"].as_str().unwrap();
    let path = a.instance_record_path(xid);
    std::fs::write(&path, "{ \"id\": garbage").unwrap();
    let p = path.to_str().unwrap();

    let list = a.ok("instance.list", json!({}));
    let names: Vec<&str> = list["instances"].as_array().unwrap().iter().map(|i| i["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["other"], "{list}");
    let unreadable = list["unreadable"].as_array().unwrap();
    assert_eq!(unreadable.len(), 1, "{list}");
    assert_eq!(unreadable[0]["path"], p, "{list}");
    assert!(unreadable[0]["error"].as_str().is_some_and(|e| !e.is_empty()), "{list}");
    let got = a.ok("instance.get", json!({"ref": "other"}));
    assert_eq!(got["state"], "running", "{got}");
    assert_eq!(got["gpu"]["device"], other["gpu"]["device"]);
    let plain = a.ok("instance.create", json!({"name": "plain", "image": "demo"}));
    assert_eq!(plain["state"], "running", "{plain}");
    let g2 = a.create_gpu("g2", "L40S-2Q").unwrap();
    assert_eq!(g2["state"], "running", "{g2}");
    let gpus = a.ok("gpu.list", json!({}));
    assert_eq!(gpus["mode"], "vendor_vfio", "{gpus}");
    let h = health(&a);
    assert_eq!(h["ready"], true, "{h}");
    assert_eq!(h["degraded"], true, "{h}");
    assert!(h["problems"].to_string().contains(p), "the problem names the path: {h}");
    let rep = a.pass();
    assert_eq!(rep["inventory_complete"], true, "{rep}");
    assert!(rep["errors"].to_string().contains(p), "{rep}");
}

/// I6: a claim file that does not decode (its `framework` is unknown) blocks its device:
/// the owner's delete answers `vgpu_cleanup_pending` with `retained: true` (the instance
/// becomes `cleanup_pending`), nothing is written to the VF, and no later create is placed
/// on it.
#[test]
fn a_claim_naming_an_unknown_framework_blocks_its_device_and_its_owners_delete_is_retained() {
    let (a, _w) = start(HOST_V, "claim_grace_s = 1\n");
    let (id, vf) = a.retained_stopped("q", "L40S-2Q");
    let cpath = a.data_dir.join(format!("claims/{vf}.json"));
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
    c["framework"] = json!("quantum");
    std::fs::write(&cpath, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    let seq = last_seq(&a.state());

    let e = a.err("instance.delete", json!({"ref": "q"}));
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "never `internal`: {e} {}", e.data);
    assert_eq!(e.data["retained"], true, "{}", e.data);
    assert_eq!(e.data["instance_id"], id.as_str(), "{}", e.data);
    let got = a.ok("instance.get", json!({"ref": "q"}));
    assert_eq!(got["state"], "cleanup_pending", "{got}");
    // The rest of the API works around the bad file.
    let plain = a.ok("instance.create", json!({"name": "plain", "image": "demo"}));
    assert_eq!(plain["state"], "running", "{plain}");
    assert_eq!(a.ok("instance.get", json!({"ref": "plain"}))["state"], "running");
    let mut names = a.instance_names();
    names.sort();
    assert_eq!(names, vec!["plain", "q"]);
    // Passes and creates: the blocked VF is never written nor placed on.
    for _ in 0..2 {
        let rep = a.pass();
        assert!(!devices_in(&rep, "released").contains(&vf), "{rep}");
    }
    for n in ["c1", "c2", "c3"] {
        let i = a.create_gpu(n, "L40S-2Q").unwrap();
        assert_ne!(i["gpu"]["device"], vf.as_str(), "{i}");
    }
    let e = a.create_gpu("c4", "L40S-2Q").unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "the blocked VF is not offered: {e}");
    let w: Vec<_> = writes_after(&a, seq).into_iter().filter(|(p, _, _)| *p == type_path(&vf)).collect();
    assert_eq!(w, vec![], "nothing written to the blocked VF");
    assert_eq!(a.vf_type(&vf), 1148);
    assert!(cpath.exists(), "the claim file stays");
    let dev = gpu_device(&a.ok("gpu.list", json!({})), &vf);
    assert_eq!(dev["state"], "claimed", "{dev}");
    assert!(dev["claim"]["unreadable"].is_string(), "{dev}");
}

/// I6 / O(1) placement: placement plugins see a claimed device's owner labels from the
/// claim, also when the owner's instance record cannot be read — a tenant-isolation rule
/// keeps working (recorded policy inputs).
#[test]
fn placement_sees_owner_labels_from_claims_when_the_owner_record_is_unreadable() {
    let rec_dir = tempfile::tempdir().unwrap();
    let extra = format!("record_policy_inputs = {:?}\n", rec_dir.path());
    let (a, _w) = start(HOST_V, &extra);
    let t1 =
        a.ok("instance.create", json!({"name": "t1", "image": "demo", "gpu": "L40S-2Q", "labels": {"tenant": "acme"}}));
    let t1_vf = t1["gpu"]["device"].as_str().unwrap().to_string();
    std::fs::write(a.instance_record_path(t1["id"].as_str().unwrap()), "not json at all").unwrap();
    let t2 = a.ok(
        "instance.create",
        json!({"name": "t2", "image": "demo", "gpu": "L40S-2Q", "labels": {"tenant": "globex"}}),
    );
    assert_ne!(t2["gpu"]["device"], t1_vf.as_str());
    a.ok("placement.dry_run", json!({"profile": "L40S-2Q", "name": "t3", "labels": {"tenant": "acme"}}));

    let mut seen = Vec::new();
    for e in std::fs::read_dir(rec_dir.path()).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("placement-") {
            continue;
        }
        // A recording: the input and the answer the agent got.
        let recording: Value = serde_json::from_str(&std::fs::read_to_string(e.path()).unwrap()).unwrap();
        let input = &recording["input"];
        if input["request"]["name"] == "t1" {
            continue;
        }
        seen.push(input["request"]["name"].as_str().unwrap_or("").to_string());
        let dev = input["inventory"]["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["devices"].as_array().unwrap().iter())
            .find(|d| d["address"] == t1_vf.as_str())
            .cloned()
            .unwrap_or_else(|| panic!("{t1_vf} not in the placement input: {input}"));
        assert_eq!(dev["state"], "claimed", "{dev}");
        assert_eq!(dev["owner"]["instance_id"], t1["id"], "{dev}");
        assert_eq!(dev["owner"]["labels"], json!({"tenant": "acme"}), "BUG: owner labels lost: {dev}");
    }
    seen.sort();
    assert_eq!(seen, vec!["t2", "t3"], "recorded placement inputs");
}

// ====================================================================== 5. Reconciler 2

/// A bystander in the agent's PID namespace that logs every catchable signal it gets.
fn bystander(a: &Agent, dir: &std::path::Path) -> (std::process::Child, i32, i32, PathBuf) {
    let siglog = dir.join("bystander-signals.log");
    let script = dir.join("bystander.py");
    std::fs::write(
        &script,
        format!(
            "import os,signal,time\nlog={l:?}\n\
             def h(n,f):\n    open(log,'a').write('%d\\n'%n)\n\
             for s in (signal.SIGTERM,signal.SIGINT,signal.SIGHUP,signal.SIGUSR1,signal.SIGQUIT,signal.SIGCONT):\n    signal.signal(s,h)\n\
             print(os.getpid(),flush=True)\n\
             while True:\n    time.sleep(1)\n",
            l = siglog.display().to_string()
        ),
    )
    .unwrap();
    let (child, line) = a.ns_sh(&format!("exec /usr/bin/python3 {} bystander-5", script.display()));
    let nspid: i32 = line.parse().unwrap_or_else(|_| panic!("bystander pid: {line:?}"));
    let root = wait_for(Duration::from_secs(5), || root_pid_of(nspid, |c| c.contains("bystander-5"))).unwrap();
    (child, nspid, root, siglog)
}

/// docs/design/lifecycle.md Reconciler 2: a VM whose record names a pid that now belongs to another live
/// process, and whose control socket is owned by the real QEMU: the pass records QEMU as
/// the instance's VMM (reported in `records`), `instance.get` shows QEMU's pid, and a later
/// stop stops QEMU and never signals the other process.
#[test]
fn a_live_control_socket_owner_is_recorded_when_the_recorded_pid_is_another_process() {
    let (a, _w) = start(HOST_V, "");
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    let vf = inst["gpu"]["device"].as_str().unwrap().to_string();
    let q = qemu_of(&id);
    assert_eq!(q.len(), 1);
    let q_root = q[0];
    let q_ns = ns_pid(q_root).unwrap();
    let q_start = proc_start_time(q_root).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (_by, by_ns, by_root, siglog) = bystander(&a, tmp.path());
    let mut rec = a.record(&id);
    assert_eq!(rec["vmm"]["identity"]["pid"], q_ns, "{rec}");
    rec["vmm"]["identity"]["pid"] = json!(by_ns);
    a.write_record(&id, &rec);

    let rep = a.pass();
    let changes: Vec<&Value> =
        rep["records"].as_array().unwrap().iter().filter(|r| r["instance"] == id.as_str()).collect();
    assert_eq!(changes.len(), 1, "the pass reports the change: {rep}");
    assert_eq!(changes[0]["to"], "running", "{rep}");
    assert!(changes[0]["reason"].as_str().unwrap().contains(&q_ns.to_string()), "names QEMU's pid: {rep}");
    let rec = a.record(&id);
    assert_eq!(rec["vmm"]["identity"]["pid"], q_ns, "QEMU is recorded as the VMM: {rec}");
    assert_eq!(rec["vmm"]["identity"]["start_time"], q_start, "{rec}");
    assert_eq!(rec["state"], "running");
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["vmm"]["pid"], q_ns, "{got}");
    assert_eq!(got["vmm"]["start_time"], q_start, "{got}");
    assert_eq!(got["vmm"]["liveness"], "alive", "{got}");
    // A second pass has nothing more to change.
    let rep2 = a.pass();
    assert!(!rep2["records"].to_string().contains(&id), "{rep2}");

    let st = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    assert_eq!(st["state"], "stopped", "{st}");
    assert!(wait_reaped(q_root), "the real QEMU was stopped");
    assert!(alive(by_root), "the bystander is alive");
    assert_eq!(std::fs::read_to_string(&siglog).unwrap_or_default(), "", "the bystander got no signal");
    assert_eq!(a.vf_type(&vf), 0, "the VF is released after the real VMM died");
    assert!(a.claim(&vf).is_none());
}

// ====================================================================== 6. counting what a pass did

/// A pass decided to sweep a dirty orphan VF; before it acts, a create repairs and claims
/// that very VF. The pass writes nothing, does not report the VF `released`, does not count
/// it (`orphans_released_total`), and the new instance keeps its VF.
#[test]
fn a_pass_counts_an_orphan_as_released_only_when_it_wrote_something() {
    const FP: &str = "reconcile_before_release";
    let (a, _w) = start(HOST_V1, "claim_grace_s = 1\n");
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let m = a.metrics();
    let orphans0 = metric0(&m, ORPHANS, &[("framework", "vendor_vfio")]);
    let stale0 = metric0(&m, STALE, &[("result", "released")]);
    let paused_pass = pass_paused_before_release(&a);
    let seq = last_seq(&a.state());
    // The create runs while the pass waits (no lock held across the pause) and takes vf0.
    let b = a.create_gpu("b", "L40S-2Q").expect("a create completes while the pass is paused");
    assert_eq!(b["gpu"]["device"], VF0, "{b}");
    assert_eq!(
        writes_after(&a, seq),
        vec![(type_path(VF0), "0".into(), "ok".into()), (type_path(VF0), "1148".into(), "ok".into())],
        "the create repaired vf0 and set its type"
    );
    assert_eq!(waiting_at(&a, FP), 1, "the pass still waits");
    let seq = last_seq(&a.state());
    failpoint(&a, FP, "release");
    let rep = paused_pass.join().unwrap().unwrap();
    let rep = &rep["result"];
    assert!(!devices_in(rep, "released").contains(&VF0.to_string()), "BUG: counted as released: {rep}");
    assert!(!kept_reasons(rep, VF0).is_empty(), "the report says vf0 was left alone: {rep}");
    assert_eq!(writes_after(&a, seq), vec![], "the pass wrote nothing");
    let m = a.metrics();
    assert_eq!(metric0(&m, ORPHANS, &[("framework", "vendor_vfio")]), orphans0, "orphans_released_total unchanged");
    assert_eq!(metric0(&m, STALE, &[("result", "released")]), stale0, "stale_releases_total unchanged");
    assert_eq!(a.vf_type(VF0), 1148, "b keeps its type");
    assert_eq!(a.claim(VF0).unwrap()["instance_id"], b["id"], "b keeps its claim");
    assert_eq!(a.ok("instance.get", json!({"ref": "b"}))["state"], "running");
    assert!(World::observe(&a).safety_violations(&[]).is_empty());
}

// ====================================================================== 7. unreadable devices

/// Counts of unreadable devices: `resources.get` and the gauge.
fn unreadable_counts(a: &Agent) -> (u64, f64) {
    let res = a.ok("resources.get", json!({}));
    (res["devices"]["unreadable"].as_u64().unwrap_or(u64::MAX), metric_now(a, "gpuvisor_vgpu_unreadable_devices", &[]))
}

/// A VF whose `physfn` link cannot be read is named in one WARN and counted as unreadable
/// in `resources.get` and `gpuvisor_vgpu_unreadable_devices`.
#[test]
fn a_vf_with_an_unreadable_physfn_link_is_named_and_counted() {
    let (a, _w) = start(HOST_V, "");
    assert_eq!(unreadable_counts(&a), (0, 0.0));
    a.sim.ctl(&["fail-read", &format!("sys/bus/pci/devices/{VF2}/physfn"), "EIO", "--always"]).unwrap();
    // Several observations; the WARN is logged once, the counts hold at each.
    let counts: Vec<(u64, f64)> = (0..3).map(|_| unreadable_counts(&a)).collect();
    a.ok("gpu.list", json!({}));
    let w = warn_lines(&a, &[VF2, "physfn"]);
    assert_eq!(w.len(), 1, "one WARN naming {VF2}: {w:?}");
    assert_eq!(counts, vec![(1, 1.0); 3], "vf2 counted as unreadable in resources.get and the gauge");
    // It is never placed on.
    for n in ["a", "b", "c"] {
        let i = a.create_gpu(n, "L40S-2Q").unwrap();
        assert_ne!(i["gpu"]["device"], VF2, "{i}");
    }
    assert!(type_writes_of(&a.state(), VF2).is_empty());
}

/// On an mdev host, an mdev whose `mdev_type` link cannot be read is named in one WARN and
/// counted as unreadable.
#[test]
fn an_mdev_whose_type_link_cannot_be_read_is_named_and_counted() {
    let (a, _w) = start(HOST_M, "");
    a.sim.ctl(&["create-mdev", VF0, "1148", FOREIGN_MDEV]).unwrap();
    assert_eq!(unreadable_counts(&a), (0, 0.0));
    a.sim.ctl(&["fail-read", &format!("sys/bus/mdev/devices/{FOREIGN_MDEV}/mdev_type"), "EIO", "--always"]).unwrap();
    // Several observations; the WARN is logged once, the counts hold at each.
    let counts: Vec<(u64, f64)> = (0..3).map(|_| unreadable_counts(&a)).collect();
    a.ok("gpu.list", json!({}));
    let w = warn_lines(&a, &[FOREIGN_MDEV, "mdev_type"]);
    assert_eq!(w.len(), 1, "one WARN naming the mdev: {w:?}");
    assert_eq!(counts, vec![(1, 1.0); 3], "the mdev is counted as unreadable in resources.get and the gauge");
    // Its parent is not offered (it carries an mdev).
    let i = a.create_gpu("a", "L40S-2Q").unwrap();
    assert_eq!(i["gpu"]["device"], VF1, "{i}");
    assert!(sim_mdevs(&a.state()).iter().any(|m| m["uuid"] == FOREIGN_MDEV));
}

/// "Unknown is never clear": the parent of an mdev whose `mdev_type` link cannot be read
/// carries an mdev (the simulator's `sys/bus/mdev/devices/<uuid>` link resolves under it),
/// so it is never shown `free` nor counted allocatable.
#[test]
fn the_parent_of_an_unreadable_mdev_is_never_shown_free() {
    let (a, _w) = start(HOST_M, "");
    a.sim.ctl(&["create-mdev", VF0, "1148", FOREIGN_MDEV]).unwrap();
    let before = gpu_device(&a.ok("gpu.list", json!({})), VF0);
    assert_eq!(before["state"], "dirty", "a parent carrying a foreign mdev: {before}");
    a.sim.ctl(&["fail-read", &format!("sys/bus/mdev/devices/{FOREIGN_MDEV}/mdev_type"), "EIO", "--always"]).unwrap();
    let resolved = std::fs::canonicalize(a.sim.path().join(format!("sys/bus/mdev/devices/{FOREIGN_MDEV}"))).unwrap();
    assert!(resolved.to_string_lossy().contains(VF0), "the mdev lives under {VF0}: {}", resolved.display());
    let after = gpu_device(&a.ok("gpu.list", json!({})), VF0);
    let res = a.ok("resources.get", json!({}));
    assert_ne!(after["state"], "free", "BUG: a parent carrying an unreadable mdev is shown free: {after}");
    assert_eq!(res["devices"]["allocatable"], 1, "BUG: it is counted allocatable: {res}");
}

/// On an mdev host, an entry of `sys/bus/mdev/devices` whose name is not a UUID is named in
/// one WARN and counted as unreadable. (The simulator makes such an entry with `override`
/// of a path that does not exist: a file, not a directory — the agent looks at the name
/// first.)
#[test]
fn an_mdev_entry_whose_name_is_not_a_uuid_is_named_and_counted() {
    let (a, _w) = start(HOST_M, "");
    assert_eq!(unreadable_counts(&a), (0, 0.0));
    a.sim.ctl(&["override", "sys/bus/mdev/devices/not-a-uuid", "x"]).unwrap();
    let listed = std::fs::read_dir(a.sim.path().join("sys/bus/mdev/devices"))
        .unwrap()
        .flatten()
        .any(|e| e.file_name() == "not-a-uuid");
    assert!(listed, "the simulator lists the entry");
    // Several observations; the WARN is logged once, the counts hold at each.
    let counts: Vec<(u64, f64)> = (0..3).map(|_| unreadable_counts(&a)).collect();
    a.ok("gpu.list", json!({}));
    let w = warn_lines(&a, &["not-a-uuid"]);
    assert_eq!(w.len(), 1, "one WARN naming the entry: {w:?}");
    assert_eq!(counts, vec![(1, 1.0); 3], "the entry is counted as unreadable in resources.get and the gauge");
}

// ====================================================================== 8. rollback kill failure

/// A stand-in VMM that never opens its QMP socket (the start times out) and, on SIGTERM,
/// writes to a simulator file whose writes are delayed: SIGKILL cannot end it until the
/// write returns (FUSE `request_wait_answer`), like a QEMU stuck in the kernel.
const STUCK_VMM: &str = r#"#!/usr/bin/env python3
import sys
if sys.argv[1:] == ["--version"]:
    # The agent probes its QEMU at start.
    print("QEMU emulator version 7.2.0 (test stand-in)")
    sys.exit(0)
import os, signal, time
stuck = open(STUCK_PATH_FILE).read().strip()
def on_term(signum, frame):
    with open(stuck, "w") as f:
        f.write("frame_rate_limiter=0")
signal.signal(signal.SIGTERM, on_term)
while True:
    time.sleep(1)
"#;

/// A create whose VMM does not come up and then survives SIGKILL: the answer is
/// `vgpu_cleanup_pending` (retained, the instance `cleanup_pending`, the VF untouched while
/// the VMM lives) whose structured cause says the kill failed (`vmm_kill_failed`, with the
/// pid) — not only the message.
#[test]
fn a_rollback_whose_vmm_would_not_die_names_vmm_kill_failed_in_the_cause() {
    let tools = vmm_writable_tempdir("gpuvisor-fake-vmm.").unwrap();
    let fake = tools.path().join("stuck-vmm");
    let stuck_file = tools.path().join("stuck-path");
    let script = STUCK_VMM.replace("STUCK_PATH_FILE", &format!("{:?}", stuck_file.display().to_string()));
    std::fs::write(&fake, script).unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let qemu_binary = format!("{fake:?}");
    let a = Agent::start_tuned(
        AgentOptions { model: HOST_V1, extra: "reconcile_interval_s = 3600\n", ..Default::default() },
        None,
        &[
            ("vfio_term_grace_s", "1"),
            ("qemu_binary", &qemu_binary),
            ("qmp_ready_timeout_s", "2"),
            ("release_retry_s", "1"),
        ],
    )
    .unwrap();
    // The stand-in writes this VF's vgpu_params on SIGTERM; that write is delayed 40 s
    // (longer than the kill path's SIGTERM grace and SIGKILL waits).
    let params = format!("sys/bus/pci/devices/{VF0}/nvidia/vgpu_params");
    std::fs::write(&stuck_file, a.sim.path().join(&params).display().to_string()).unwrap();
    a.sim.ctl(&["delay-write", &params, "40000", "--times", "1"]).unwrap();
    let e = a.create_gpu("k", "L40S-1Q").unwrap_err();
    let d = &e.data;
    eprintln!("rollback answer: {e} {d}");
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{e} {d}");
    // The kill failed inside the start (the VMM never answered QMP): that is the cause.
    assert_eq!(d["cause"]["code"], "vmm_kill_failed", "BUG: the structured cause does not say the kill failed: {d}");
    assert!(d["cause"]["pid"].is_number(), "the cause names the pid: {d}");
    // A VMM the spawn could not stop is never proven dead by the rollback: no release is
    // even attempted (with `vfio_attach = "device"` no open-handle scan could stand in).
    assert_eq!(d["cause"]["release_error"]["code"], "vmm_kill_failed", "{d}");
    assert_eq!(d["retained"], true, "{d}");
    let got = a.ok("instance.get", json!({"ref": "k"}));
    assert_eq!(got["state"], "cleanup_pending", "{got}");
    assert_eq!(a.claim(VF0).unwrap()["instance_id"], got["id"]);
    assert_eq!(a.vf_type(VF0), 1147, "the VF is not cleared under the live VMM");
}

/// A QMP-speaking stand-in VMM: at start it fills the data directory's filesystem (so the
/// agent cannot persist the `running` record right after QMP answers), then serves QMP;
/// on SIGTERM it frees the space and writes to a simulator file whose writes are delayed,
/// where SIGKILL cannot reach it until the write returns.
const FILLING_VMM: &str = r#"#!/usr/bin/env python3
import sys
if sys.argv[1:] == ["--version"]:
    # The agent probes its QEMU at start.
    print("QEMU emulator version 7.2.0 (test stand-in)")
    sys.exit(0)
import json, os, signal, socket, sys, threading, time
args = sys.argv[1:]
qmp = args[args.index("-qmp") + 1].split("unix:", 1)[1].split(",", 1)[0]
# The VMM's own directory: on the data directory's filesystem, and the only place it may write.
fill = os.path.join(os.path.dirname(qmp), "fill")
stuck = open(STUCK_PATH_FILE).read().strip()
def on_term(signum, frame):
    try:
        os.unlink(fill)
    except OSError:
        pass
    with open(stuck, "w") as f:
        f.write("frame_rate_limiter=0")
signal.signal(signal.SIGTERM, on_term)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(qmp)
srv.listen(4)
try:
    with open(fill, "ab", buffering=0) as f:
        for n in (65536, 1):
            while True:
                try:
                    f.write(b"\0" * n)
                except OSError:
                    break
except OSError:
    pass
def serve(c):
    f = c.makefile("rw")
    f.write(json.dumps({"QMP": {"version": {}, "capabilities": []}}) + "\n"); f.flush()
    for line in f:
        cmd = json.loads(line).get("execute")
        ret = {"status": "running", "running": True} if cmd == "query-status" else {}
        f.write(json.dumps({"return": ret}) + "\n"); f.flush()
def accept():
    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
# The main thread (where Python runs signal handlers) only sleeps.
while True:
    time.sleep(1)
"#;

/// The rollback's own stop of the VMM fails: the VMM came up (its identity is known) but the
/// `running` record could not be written (full disk), and the VMM then survives SIGKILL.
/// The answer is `vgpu_cleanup_pending` whose `cause.release_error.code` is
/// `vmm_kill_failed`; the claim is retained and the VF untouched.
#[test]
fn a_rollback_whose_own_stop_cannot_kill_the_vmm_has_release_error_vmm_kill_failed() {
    let mnt = Tmpfs::mount("24m");
    let data = mnt.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let tools = vmm_writable_tempdir("gpuvisor-fake-vmm.").unwrap();
    let stuck_file = tools.path().join("stuck-path");
    let script = FILLING_VMM.replace("STUCK_PATH_FILE", &format!("{:?}", stuck_file.display().to_string()));
    let fake = tools.path().join("filling-vmm");
    std::fs::write(&fake, script).unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let qemu_binary = format!("{fake:?}");
    let a = Agent::start_tuned(
        AgentOptions { model: HOST_V1, extra: "reconcile_interval_s = 3600\n", ..Default::default() },
        Some(data),
        &[("vfio_term_grace_s", "1"), ("qemu_binary", &qemu_binary), ("release_retry_s", "1")],
    )
    .unwrap();
    let params = format!("sys/bus/pci/devices/{VF0}/nvidia/vgpu_params");
    std::fs::write(&stuck_file, a.sim.path().join(&params).display().to_string()).unwrap();
    a.sim.ctl(&["delay-write", &params, "40000", "--times", "1"]).unwrap();

    let e = a.create_gpu("k", "L40S-1Q").unwrap_err();
    let d = &e.data;
    eprintln!("rollback answer: {e} {d}");
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{e} {d}");
    assert_eq!(
        d["cause"]["release_error"]["code"], "vmm_kill_failed",
        "BUG: the kill failure is not in the cause: {d}"
    );
    assert_eq!(d["cause"]["code"], "internal", "the original cause (ENOSPC) stays the cause: {d}");
    let claim = a.claim(VF0).expect("the claim is kept");
    assert_eq!(claim["instance_id"], d["instance_id"], "{claim}");
    assert_eq!(a.vf_type(VF0), 1147, "the VF is not cleared under the live VMM");
    // The retention (one attempt, docs/design/lifecycle.md Create step 6): the space is free again by
    // now (the stand-in freed it on SIGTERM), so the instance becomes delete-only.
    let got = a.ok("instance.get", json!({"ref": "k"}));
    assert!(
        d["retained"] == true && got["state"] == "cleanup_pending",
        "BUG: the rollback did not retain the instance (retained {}, state {}): {d} {got}",
        d["retained"],
        got["state"]
    );
}

// ====================================================================== 9. mdev: unreadable is not absent

/// mdev: an EIO reading an mdev's `mdev_type` link does not make the sweep forget an mdev
/// gpuvisor made: while the link cannot be read, passes keep `mdevs/<uuid>.json` and the
/// mdev; once it can, the sweep removes both (the orphan is older than claim_grace).
///
/// The orphan (an mdev record no claim names): an instance stopped while its mdev's
/// `remove` fails keeps its claim `release_pending`; then its claim file is lost (removed
/// by hand, as after a store mishap).
#[test]
fn an_unreadable_mdev_type_link_never_makes_the_sweep_forget_an_mdev_it_made() {
    let (a, _w) = start(HOST_M, "claim_grace_s = 1\n");
    let inst = a.create_gpu("m", "L40S-2Q").unwrap();
    let uuid = inst["gpu"]["mdev_uuid"].as_str().unwrap().to_string();
    let parent = inst["gpu"]["device"].as_str().unwrap().to_string();
    a.sim.ctl(&["fail-write", "sys/bus/mdev/devices/*/remove", "EBUSY", "--always"]).unwrap();
    let st = a.ok("instance.stop", json!({"ref": "m", "force": true}));
    assert_eq!(st["gpu"]["release_pending"], true, "{st}");
    a.sim.ctl(&["clear-faults"]).unwrap();
    let record = format!("{uuid}.json");
    assert!(a.data_files("mdevs").contains(&record));
    std::fs::remove_file(a.data_dir.join(format!("claims/{parent}.json"))).unwrap();
    let created = boottime_now_ms();
    a.sim.ctl(&["fail-read", &format!("sys/bus/mdev/devices/{uuid}/mdev_type"), "EIO", "--always"]).unwrap();
    // Wait (on the clock the grace uses) until the orphan is older than claim_grace.
    wait_for(Duration::from_secs(10), || (boottime_now_ms() > created + 1500).then_some(())).unwrap();
    let seq = last_seq(&a.state());
    for _ in 0..3 {
        let rep = a.pass();
        assert!(devices_in(&rep, "released").is_empty(), "{rep}");
        assert!(
            a.data_files("mdevs").contains(&record),
            "BUG: the sweep forgot its own mdev {uuid} after one EIO on mdev_type: {rep}"
        );
        assert!(sim_mdevs(&a.state()).iter().any(|m| m["uuid"] == uuid.as_str()), "the mdev exists");
        assert!(
            kept_reasons(&rep, &uuid).iter().any(|r| r.contains("unreadable")),
            "the pass reports the mdev kept as unreadable: {rep}"
        );
    }
    assert_eq!(writes_after(&a, seq), vec![], "nothing removed while unreadable");
    a.sim.ctl(&["clear-faults"]).unwrap();
    pass_until(&a, "the orphan mdev is swept", Duration::from_secs(30), |a, _| {
        !sim_mdevs(&a.state()).iter().any(|m| m["uuid"] == uuid.as_str())
    });
    assert!(!a.data_files("mdevs").contains(&record), "its record is removed with it");
    assert!(metric_now(&a, ORPHANS, &[("framework", "mdev")]) >= 1.0);
}

// ====================================================================== 10. issue 18 finding 3: an owner that cannot be known

/// Issue 18 finding 3: a claim record that cannot be read and whose file names no device
/// (neither a PCI address nor an mdev UUID) may own any occupied device. While it exists no
/// pass sweeps a dirty VF — however old — and no create repairs one (`no_capacity`, nothing
/// written); `agent.health` names the record, and every pass counts
/// `reconcile_failures_total{stage="inventory"}`. Once the record is gone, the sweep clears
/// the VF.
#[test]
fn a_claim_record_whose_device_cannot_be_known_blocks_every_sweep_and_repair() {
    const FAILURES: &str = "gpuvisor_vgpu_reconcile_failures_total";
    let (a, _w) = start(HOST_V1, "claim_grace_s = 1\n");
    let bad = a.data_dir.join("claims/lost+found.json");
    std::fs::write(&bad, "{\"device\": ").unwrap();
    let inventory0 = metric_now(&a, FAILURES, &[("stage", "inventory")]);
    let seq = last_seq(&a.state());
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let dirty_since = Instant::now();
    // Passes until the orphan is well past claim_grace (1 s, measured from before the first
    // pass saw it): none of them sweeps it, each says why.
    let mut passes = 0.0;
    let rep = loop {
        let rep = a.pass();
        passes += 1.0;
        assert!(!devices_in(&rep, "released").contains(&VF0.to_string()), "BUG: swept under an unknown owner: {rep}");
        if dirty_since.elapsed() > Duration::from_secs(3) {
            break rep;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        kept_reasons(&rep, VF0).iter().any(|r| r.contains("cannot be read") && r.contains("lost+found.json")),
        "the pass says which record keeps it: {rep}"
    );
    assert!(rep["errors"].to_string().contains("lost+found.json"), "{rep}");
    // The only VF is dirty: a create does not repair it.
    let e = a.create_gpu("c", "L40S-2Q").unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert_eq!(writes_after(&a, seq), vec![], "nothing written while the owner cannot be known");
    assert_eq!(a.vf_type(VF0), 1148);
    let dev = gpu_device(&a.ok("gpu.list", json!({})), VF0);
    assert_eq!(dev["state"], "claimed", "shown as possibly owned by the record: {dev}");
    let h = health(&a);
    assert_eq!(h["degraded"], true, "{h}");
    assert!(h["problems"].to_string().contains("lost+found.json"), "health names the record: {h}");
    assert!(
        metric_now(&a, FAILURES, &[("stage", "inventory")]) >= inventory0 + passes,
        "every pass that met the record counts stage=\"inventory\""
    );
    // Gone: the sweep clears the orphan.
    std::fs::remove_file(&bad).unwrap();
    pass_until(&a, "the orphan is swept", Duration::from_secs(60), |_, rep| {
        devices_in(rep, "released").contains(&VF0.to_string())
    });
    assert_eq!(a.vf_type(VF0), 0);
}

/// Issue 18 finding 3: every record kind that cannot be read (instance, claim, health,
/// mdev) is named in `agent.health` (`degraded`) and counted by the pass that meets it.
#[test]
fn every_unreadable_record_kind_is_named_in_health_and_counted_by_the_pass() {
    const FAILURES: &str = "gpuvisor_vgpu_reconcile_failures_total";
    let (a, _w) = start(HOST_V, "");
    let plain = a.ok("instance.create", json!({"name": "p", "image": "demo"}));
    let files = [
        a.instance_record_path(plain["id"].as_str().unwrap()),
        a.data_dir.join(format!("claims/{VF1}.json")),
        a.data_dir.join(format!("health/{VF2}.json")),
        a.data_dir.join(format!("mdevs/{FOREIGN_MDEV}.json")),
    ];
    for f in &files {
        std::fs::write(f, "not json").unwrap();
    }
    let before = metric_now(&a, FAILURES, &[("stage", "inventory")]);
    let rep = a.pass();
    assert_eq!(metric_now(&a, FAILURES, &[("stage", "inventory")]), before + 1.0, "the pass counts once: {rep}");
    let h = health(&a);
    assert_eq!(h["degraded"], true, "{h}");
    let problems = h["problems"].to_string();
    for f in &files {
        assert!(problems.contains(&f.display().to_string()), "health names {}: {h}", f.display());
        assert!(rep["errors"].to_string().contains(&f.display().to_string()), "the pass names {}: {rep}", f.display());
    }
}

// ====================================================================== 11. issue 18 finding 6: answers and counters

/// Issue 18 finding 6: a pass decided to sweep a dirty orphan VF; before it writes,
/// another tool clears the VF. The pass writes nothing, neither reports nor counts the VF
/// as released (`orphans_released_total` unchanged), and says it found it clear.
#[test]
fn an_orphan_another_writer_cleared_before_the_sweep_wrote_is_not_counted() {
    const FP: &str = "reconcile_before_release";
    let (a, _w) = start(HOST_V1, "claim_grace_s = 1\n");
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let orphans0 = metric_now(&a, ORPHANS, &[("framework", "vendor_vfio")]);
    let paused_pass = pass_paused_before_release(&a);
    a.sim.ctl(&["set-type", VF0, "0"]).unwrap();
    let seq = last_seq(&a.state());
    failpoint(&a, FP, "release");
    let rep = paused_pass.join().unwrap().unwrap();
    let rep = &rep["result"];
    assert!(!devices_in(rep, "released").contains(&VF0.to_string()), "BUG: counted as released: {rep}");
    assert!(kept_reasons(rep, VF0).iter().any(|r| r.contains("found clear")), "the report says why: {rep}");
    assert_eq!(writes_after(&a, seq), vec![], "the pass wrote nothing");
    assert_eq!(metric_now(&a, ORPHANS, &[("framework", "vendor_vfio")]), orphans0, "orphans_released_total unchanged");
    assert_eq!(a.vf_type(VF0), 0);
}

/// Issue 18 finding 6: a catalog line whose name is the vendor word alone (`1148 :
/// NVIDIA`, no profile) is skipped like other malformed lines — listed in `gpu.list`,
/// warned once naming its VF — and never offered as a profile called `NVIDIA`.
#[test]
fn a_catalog_line_naming_only_the_vendor_is_skipped_and_warned_naming_its_vf() {
    let (a, _w) = start(HOST_V1, "");
    a.sim
        .ctl(&["override", &catalog_path(VF0), "ID    : vGPU Name\n1148  : NVIDIA\n1147  : NVIDIA L40S-1Q\n"])
        .unwrap();
    let gpus = a.ok("gpu.list", json!({}));
    let d = gpu_device(&gpus, VF0);
    assert_eq!(d["catalog_skipped_lines"], json!(["1148  : NVIDIA"]), "{d}");
    assert!(!d["creatable"].to_string().contains("\"NVIDIA\""), "{d}");
    let e = a.create_gpu("n", "NVIDIA").unwrap_err();
    assert_eq!(e.data_code, "unknown_profile", "{e}");
    a.ok("resources.get", json!({}));
    let w = warn_lines(&a, &[VF0, "skipped", "1148  : NVIDIA"]);
    assert_eq!(w.len(), 1, "one WARN naming the VF and the line: {w:?}");
}
