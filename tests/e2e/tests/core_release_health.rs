//! Issue 7, findings 1 and 3–6 (and the `stop` half of 7): the one release path and device
//! health, end to end against the real agent, gpuvisor-sim and QEMU (guests paused through
//! a wrapper where a VM only has to hold its VF).
//!
//! - the orphan sweep quarantines a VF whose type changed under it, like the release path;
//! - the dirty-VF repair before configure counts EIO strikes like every release;
//! - a driver-wide EIO (mdev create, vendor-VFIO type writes) is one GPU-level mark per GPU,
//!   costs a few writes, and leaves no capacity lost once it ends;
//! - `gpu.unquarantine` / `gpuvisor gpus unquarantine` take several devices or a whole GPU;
//! - a type changed under a running VM is reported, never repaired;
//! - an unreadable VF is `unknown` in every view;
//! - `stop` whose release fails says so (exit code 4).
//!
//! The failpoint test needs the agent built with `--features gpuvisor/failpoints`.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

const PF0: &str = "0000:41:00.0";
const PF1: &str = "0001:81:00.0";
const VF0: &str = "0000:41:00.4";
const VF1: &str = "0000:41:00.5";
const VF2: &str = "0000:41:00.6";
const VF3: &str = "0000:41:00.7";
/// The VFs of HOST_V2 with their GPU.
const V2_VFS: [(&str, &str); 8] = [
    ("0000:41:00.4", PF0),
    ("0000:41:00.5", PF0),
    ("0000:41:00.6", PF0),
    ("0000:41:00.7", PF0),
    ("0001:81:00.4", PF1),
    ("0001:81:00.5", PF1),
    ("0001:81:00.6", PF1),
    ("0001:81:00.7", PF1),
];
/// One L40S with a single VF (`0000:41:00.4`): a create has exactly one candidate.
const HOST_1VF: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 1\niommu_group = 40\n";
const ALL_TYPE_FILES: &str = "sys/bus/pci/devices/*/nvidia/current_vgpu_type";
const ALL_MDEV_CREATES: &str = "sys/class/mdev_bus/*/mdev_supported_types/*/create";

/// An agent with a short release retry; `wrap`: QEMU runs through the wrapper (paused guest).
fn agent(model: &str, wrap: Option<&QemuWrapper>, extra: &str) -> Agent {
    let extra = wrap.map(|w| w.extra()).unwrap_or_default() + extra;
    Agent::start_tuned(AgentOptions { model, extra: &extra, ..Default::default() }, None, &[("release_retry_s", "1")])
        .unwrap()
}

/// The `gpu.list` entry of a device.
fn device(gpus: &Value, addr: &str) -> Value {
    gpus["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["devices"].as_array().unwrap().iter())
        .find(|d| d["address"] == addr)
        .cloned()
        .unwrap_or_else(|| panic!("{addr} not listed: {gpus}"))
}

/// The `gpu.list` entry of a GPU.
fn gpu(gpus: &Value, pf: &str) -> Value {
    gpus["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["address"] == pf)
        .cloned()
        .unwrap_or_else(|| panic!("GPU {pf} not listed: {gpus}"))
}

/// The devices that have a health record file (`health/<device>.json`), sorted.
fn marked(a: &Agent) -> Vec<String> {
    a.data_files("health").iter().filter_map(|f| f.strip_suffix(".json").map(String::from)).collect()
}

/// A device's health record as stored.
fn health_record(a: &Agent, dev: &str) -> Value {
    let p = a.data_dir.join("health").join(format!("{dev}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn released_devices(rep: &Value) -> Vec<String> {
    rep["released"].as_array().unwrap().iter().map(|r| r["device"].as_str().unwrap().to_string()).collect()
}

fn waiting_at(a: &Agent, point: &str) -> u64 {
    let l = a.ok("debug.failpoints", json!({}));
    l["failpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == point)
        .map(|p| p["waiting"].as_u64().unwrap())
        .unwrap_or(0)
}

fn orphans_released(a: &Agent) -> f64 {
    metric0(&a.metrics(), "gpuvisor_vgpu_orphans_released", &[("framework", "vendor_vfio")])
}

// ------------------------------------------------------------------- finding 1: the sweep

#[test]
fn a_plain_orphan_sweep_clears_a_dirty_idle_vf_and_counts_it() {
    let a = agent(HOST_V, None, "claim_grace_s = 2\nreconcile_interval_s = 3600\n");
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let seq = last_seq(&a.state());
    let before = orphans_released(&a);
    // Passes until the orphan's dirty age has reached claim_grace.
    let rep = wait_for(Duration::from_secs(30), || {
        let rep = a.pass();
        if released_devices(&rep).is_empty() {
            std::thread::sleep(Duration::from_millis(200));
            return None;
        }
        Some(rep)
    })
    .expect("the orphan is swept once claim_grace has passed");
    assert_eq!(rep["released"], json!([{"device": VF0, "kind": "orphan_vf"}]), "{rep}");
    assert_eq!(a.vf_type(VF0), 0);
    assert_eq!(writes_after(&a, seq), vec![(type_path(VF0), "0".into(), "ok".into())]);
    assert_eq!(orphans_released(&a) - before, 1.0);
    let d = device(&a.ok("gpu.list", json!({})), VF0);
    assert_eq!((d["state"].as_str(), &d["quarantine"]), (Some("free"), &Value::Null), "{d}");
}

#[test]
fn the_orphan_sweep_quarantines_a_vf_whose_type_changed_before_its_write_and_clears_nothing() {
    assert_failpoints_built();
    const POINT: &str = "reconcile_before_release";
    let a = agent(HOST_V, None, "claim_grace_s = 2\nreconcile_interval_s = 3600\n");
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let before = orphans_released(&a);
    a.ok("debug.failpoint", json!({"name": POINT, "action": "pause"}));
    // Passes until one decides to release the orphan (dirty age >= claim_grace): it pauses
    // between its observation and its write.
    let pass = wait_for(Duration::from_secs(30), || {
        let call = a.spawn_call("reconcile.run", json!({}));
        let paused = wait_for(Duration::from_secs(30), || {
            if waiting_at(&a, POINT) >= 1 {
                Some(true)
            } else {
                call.is_finished().then_some(false)
            }
        })
        .expect("the pass pauses or answers");
        if paused {
            return Some(call);
        }
        let rep = call.join().unwrap().unwrap();
        assert_eq!(rep["result"]["released"], json!([]), "{rep}");
        std::thread::sleep(Duration::from_millis(200));
        None
    })
    .expect("a pass decides to sweep the orphan");
    a.sim.ctl(&["set-type", VF0, "1150"]).unwrap();
    let seq = last_seq(&a.state());
    a.ok("debug.failpoint", json!({"name": POINT, "action": "release"}));
    let answer = pass.join().unwrap().unwrap();
    let rep = &answer["result"];

    assert_eq!(rep["released"], json!([]), "nothing counted as released: {answer}");
    let failed = rep["failed"].as_array().unwrap();
    assert_eq!(failed.len(), 1, "{answer}");
    assert_eq!(failed[0]["device"], VF0);
    assert!(failed[0]["error"].as_str().unwrap().starts_with("foreign_write"), "{answer}");
    assert_eq!(a.vf_type(VF0), 1150, "never cleared");
    assert_eq!(writes_after(&a, seq), vec![], "no write after the foreign one");
    let d = device(&a.ok("gpu.list", json!({})), VF0);
    assert_eq!(d["state"], "quarantined", "{d}");
    assert_eq!(d["quarantine"]["reason"], "foreign_write", "{d}");
    assert_eq!(d["quarantine"]["quarantined"], true, "{d}");
    assert_eq!(orphans_released(&a), before);
    // Later passes keep it.
    let rep = a.pass();
    assert_eq!(rep["released"], json!([]), "{rep}");
    assert_eq!(writes_after(&a, seq), vec![]);
}

// ------------------------------------------------------ finding 1: the dirty-VF repair

#[test]
fn the_dirty_vf_repair_counts_eio_strikes_suspect_then_quarantined() {
    let a = agent(HOST_1VF, None, "");
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    for (round, quarantined) in [(1, false), (2, true)] {
        let seq = last_seq(&a.state());
        a.sim.ctl(&["fail-write", &type_path(VF0), "EIO", "--times", "1"]).unwrap();
        let e = a.create_gpu(&format!("r{round}"), "L40S-2Q").unwrap_err();
        assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "round {round}: {e}");
        assert!(e.message.contains(VF0), "round {round}: names the VF: {}", e.message);
        assert_eq!(writes_after(&a, seq), vec![(type_path(VF0), "0".into(), "EIO".into())], "round {round}");
        let h = health_record(&a, VF0);
        assert_eq!(h["quarantined"], quarantined, "round {round}: {h}");
        if round == 1 {
            assert_eq!(h["eio_in_a_row"], 1, "suspect after the first EIO: {h}");
        }
        let d = device(&a.ok("gpu.list", json!({})), VF0);
        assert_eq!(d["quarantine"]["quarantined"], quarantined, "round {round}: {d}");
        assert!(a.claims().is_empty(), "round {round}: {:?}", a.claims());
    }
    assert_eq!(a.vf_type(VF0), 1148);
    assert_eq!(device(&a.ok("gpu.list", json!({})), VF0)["state"], "quarantined");
    // Quarantined: the next create does not touch it.
    let seq = last_seq(&a.state());
    assert_eq!(a.create_gpu("r3", "L40S-2Q").unwrap_err().data_code, "no_capacity");
    assert_eq!(writes_after(&a, seq), vec![]);
}

// ----------------------------------------------------- finding 3: driver-wide faults

/// The GPU of the VF a sysfs path names (HOST_V2), if any.
fn gpu_of_path(path: &str) -> Option<&'static str> {
    V2_VFS.iter().find(|(vf, _)| path.contains(&format!("/{vf}/"))).map(|(_, g)| *g)
}

/// One create under a driver-wide EIO on `HOST_V2`: a few failed writes per GPU, a short
/// message naming a GPU-level fault, a `gpu_fault` mark per GPU and no per-VF record.
fn create_meets_a_gpu_level_fault(a: &Agent, name: &str) {
    let seq = last_seq(&a.state());
    let e = a.create_gpu(name, "L40S-2Q").unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert!(e.message.len() < 1000, "a short message ({} bytes): {}", e.message.len(), e.message);
    assert!(e.message.contains("GPU- or driver-level fault"), "names a GPU-level fault: {}", e.message);
    let w = writes_after(a, seq);
    assert!(w.iter().all(|(_, _, r)| r == "EIO"), "{w:?}");
    for pf in [PF0, PF1] {
        let n = w.iter().filter(|(p, _, _)| gpu_of_path(p) == Some(pf)).count();
        assert!((1..=2).contains(&n), "{name}: {n} failed writes on GPU {pf}: {w:?}");
    }
    assert_eq!(marked(a), vec![PF0.to_string(), PF1.to_string()], "{name}: no per-VF health record");
    let gpus = a.ok("gpu.list", json!({}));
    for pf in [PF0, PF1] {
        assert_eq!(gpu(&gpus, pf)["health"]["reason"], "gpu_fault", "{name}: {gpus}");
    }
    for (vf, _) in V2_VFS {
        assert_eq!(device(&gpus, vf)["quarantine"], Value::Null, "{name}: {vf} has no mark");
    }
    assert!(a.claims().is_empty(), "{:?}", a.claims());
}

/// Both creates meet the fault; after `clear-faults` a create succeeds, clears its GPU's
/// mark, and once it is deleted the profile is as placeable as before the fault.
fn a_driver_wide_eio_costs_no_capacity(model: &str, fault_glob: &str) {
    let w = QemuWrapper::new();
    let a = agent(model, Some(&w), "");
    let placeable_before = placeable(&a.ok("resources.get", json!({})), "L40S-2Q");
    assert!(placeable_before >= 2, "{placeable_before}");
    a.sim.ctl(&["fail-write", fault_glob, "EIO", "--always"]).unwrap();
    create_meets_a_gpu_level_fault(&a, "a");
    create_meets_a_gpu_level_fault(&a, "b");

    a.sim.ctl(&["clear-faults"]).unwrap();
    let inst = a.create_gpu("c", "L40S-2Q").unwrap();
    let pf = inst["gpu"]["gpu"].as_str().unwrap().to_string();
    assert_eq!(gpu(&a.ok("gpu.list", json!({})), &pf)["health"], Value::Null, "GPU {pf}'s mark cleared itself");
    assert!(!marked(&a).contains(&pf), "{:?}", marked(&a));
    assert!(marked(&a).iter().all(|d| d == PF0 || d == PF1), "still no per-VF record: {:?}", marked(&a));
    a.ok("instance.delete", json!({"ref": "c"}));
    assert_eq!(placeable(&a.ok("resources.get", json!({})), "L40S-2Q"), placeable_before, "no capacity lost");
}

#[test]
fn a_driver_wide_eio_on_mdev_create_is_one_gpu_mark_per_gpu_and_recovers() {
    a_driver_wide_eio_costs_no_capacity(&format!("framework = \"mdev\"\n{HOST_V2}"), ALL_MDEV_CREATES);
}

#[test]
fn a_driver_wide_eio_on_type_writes_is_one_gpu_mark_per_gpu_and_recovers() {
    a_driver_wide_eio_costs_no_capacity(HOST_V2, ALL_TYPE_FILES);
}

// ---------------------------------------------------------- finding 3: bulk unquarantine

/// A pass finds VF0 and VF1 (claimed by running VMs) holding a foreign type: both are
/// quarantined.
fn quarantine_vf0_vf1(a: &Agent) {
    a.pass();
    let gpus = a.ok("gpu.list", json!({}));
    for vf in [VF0, VF1] {
        let d = device(&gpus, vf);
        assert_eq!(
            (&d["quarantine"]["reason"], &d["quarantine"]["quarantined"]),
            (&json!("foreign_write"), &json!(true)),
            "{d}"
        );
    }
}

/// A create of L40S-1Q whose type writes all fail with EIO: GPU 0 gets its `gpu_fault` mark.
fn gpu_fault_on_pf0(a: &Agent) {
    a.sim.ctl(&["fail-write", ALL_TYPE_FILES, "EIO", "--always"]).unwrap();
    assert_eq!(a.create_gpu("x", "L40S-1Q").unwrap_err().data_code, "no_capacity");
    a.sim.ctl(&["clear-faults"]).unwrap();
    assert_eq!(gpu(&a.ok("gpu.list", json!({})), PF0)["health"]["reason"], "gpu_fault");
}

#[test]
fn gpu_unquarantine_clears_several_devices_or_a_whole_gpu_in_one_call() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, Some(&w), "reconcile_interval_s = 3600\n");
    for name in ["a", "b"] {
        a.create_gpu(name, "L40S-2Q").unwrap();
    }
    // Foreign writes under both VMs (1Q: the free VFs then list L40S-1Q only).
    for vf in [VF0, VF1] {
        a.sim.ctl(&["set-type", vf, "1147"]).unwrap();
    }
    let both = vec![VF0.to_string(), VF1.to_string()];

    quarantine_vf0_vf1(&a);
    let r = a.ok("gpu.unquarantine", json!({"devices": [VF0, VF1]}));
    assert_eq!(r["devices"], json!(both), "{r}");
    assert_eq!(marked(&a), Vec::<String>::new());

    quarantine_vf0_vf1(&a);
    let out = a.cli(&["gpus", "unquarantine", VF0, VF1]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(marked(&a), Vec::<String>::new());

    quarantine_vf0_vf1(&a);
    gpu_fault_on_pf0(&a);
    assert_eq!(marked(&a), vec![PF0, VF0, VF1]);
    let r = a.ok("gpu.unquarantine", json!({"gpu": PF0}));
    assert_eq!(r["devices"], json!([PF0, VF0, VF1]), "{r}");
    assert_eq!(marked(&a), Vec::<String>::new());
    assert_eq!(gpu(&a.ok("gpu.list", json!({})), PF0)["health"], Value::Null);

    quarantine_vf0_vf1(&a);
    gpu_fault_on_pf0(&a);
    let out = a.cli(&["gpus", "unquarantine", "--gpu", PF0]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(marked(&a), Vec::<String>::new());

    let e = a.err("gpu.unquarantine", json!({"devices": [VF2, VF3]}));
    assert_eq!((e.code, e.data_code.as_str()), (404, "not_found"), "{e}");
}

// ------------------------------------------------- finding 4: a type changed under a VM

#[test]
fn a_type_changed_under_a_running_vm_is_reported_and_never_repaired() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, Some(&w), "reconcile_interval_s = 3600\n");
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    assert_eq!(inst["gpu"]["device"], VF0);
    let id = inst["id"].as_str().unwrap();
    let log_before = a.log().len();
    a.sim.ctl(&["set-type", VF0, "1150"]).unwrap();
    let seq = last_seq(&a.state());

    let rep = a.pass();
    let d = device(&a.ok("gpu.list", json!({})), VF0);
    assert_eq!(d["quarantine"]["reason"], "foreign_write", "{d}\n{rep}");
    assert!(d["type_mismatch"].is_string(), "{d}");
    assert_eq!(d["current_type"], 1150, "{d}");
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!((&got["gpu"]["type_id"], &got["gpu"]["current_type"]), (&json!(1148), &json!(1150)), "{got}");
    assert!(got["gpu"]["type_mismatch"].is_string(), "{got}");
    assert_eq!(metric(&a.metrics(), "gpuvisor_vgpu_claim_type_mismatches", &[]), Some(1.0));
    let log = a.log()[log_before..].to_string();
    let warns: Vec<&str> = log.lines().filter(|l| l.contains("WARN") && l.contains(VF0)).collect();
    assert_eq!(warns.len(), 1, "one WARN naming {VF0}: {warns:#?}");
    assert_eq!(writes_after(&a, seq), vec![], "nothing written");
    assert_eq!(got["state"], "running");
    assert_eq!(qemu_of(id).len(), 1, "the VM keeps running");

    // The stop's release refuses the foreign type and keeps the claim.
    let st = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    assert_eq!((&st["state"], &st["gpu"]["release_pending"]), (&json!("stopped"), &json!(true)), "{st}");
    let c = a.claim(VF0).expect("the claim is kept");
    assert_eq!(c["state"], "release_pending", "{c}");
    assert!(c["last_error"].as_str().unwrap_or("").contains("foreign_write"), "{c}");
    assert_eq!(writes_after(&a, seq), vec![], "the VF is never written");
    assert_eq!(a.vf_type(VF0), 1150);
}

// ------------------------------------------------------ finding 5: an unreadable VF

#[test]
fn an_unreadable_vf_is_unknown_in_every_view_claimed_or_not() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, Some(&w), "");
    a.sim.ctl(&["fail-read", &type_path(VF3), "EIO", "--always"]).unwrap();
    let d = device(&a.ok("gpu.list", json!({})), VF3);
    assert_eq!((&d["current_type"], &d["state"]), (&json!("unknown"), &json!("unreadable")), "{d}");
    assert!(d["unreadable"].is_string(), "{d}");
    let res = a.ok("resources.get", json!({}));
    assert_eq!((&res["devices"]["unreadable"], &res["devices"]["allocatable"]), (&json!(1), &json!(3)), "{res}");

    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    assert_eq!(inst["gpu"]["device"], VF0);
    a.sim.ctl(&["fail-read", &type_path(VF0), "EIO", "--always"]).unwrap();
    let d = device(&a.ok("gpu.list", json!({})), VF0);
    assert_eq!((&d["current_type"], &d["state"]), (&json!("unknown"), &json!("claimed")), "{d}");
    assert!(d["unreadable"].is_string(), "{d}");
    let res = a.ok("resources.get", json!({}))["devices"].clone();
    assert_eq!((&res["unreadable"], &res["claimed"], &res["allocatable"]), (&json!(2), &json!(1), &json!(2)), "{res}");
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["gpu"]["current_type"], "unknown", "{got}");
    let out = a.cli(&["gpus"]);
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    for vf in [VF0, VF3] {
        let row: Vec<&str> = table
            .lines()
            .find(|l| l.starts_with(vf))
            .unwrap_or_else(|| panic!("no row for {vf}:\n{table}"))
            .split_whitespace()
            .collect();
        assert_eq!(row[2], "unknown", "TYPE of {vf}:\n{table}");
    }
}

// ------------------------------------------------- finding 6: stop with a failing clear

#[test]
fn stop_whose_release_fails_exits_4_and_says_release_pending() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, Some(&w), "");
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    assert_eq!(inst["gpu"]["device"], VF0);
    a.sim.ctl(&["fail-write", &type_path(VF0), "EBUSY", "--always"]).unwrap();

    let out = a.cli(&["stop", "a", "--force"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(4), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.lines().any(|l| l.contains("release pending") && l.contains(VF0)), "{text}");

    // Stopping the stopped instance retries the release, which fails again.
    let out = a.cli(&["--output", "json", "stop", "a", "--force"]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((&v["state"], &v["gpu"]["release_pending"]), (&json!("stopped"), &json!(true)), "{v}");
    assert_eq!(a.vf_type(VF0), 1148);
}

/// Create-time EIO is weaker evidence (docs/design/lifecycle.md "Device health"): a first EIO on a VF's
/// type write leaves no mark; a second in a row on the same VF makes it `suspect`
/// (`create_eio`), and further ones never quarantine it. Each create moves on to the next VF.
#[test]
fn create_time_eio_twice_on_one_vf_makes_it_suspect_and_never_quarantines_it() {
    let a = agent(HOST_V, None, "");
    a.sim.ctl(&["fail-write", &type_path(VF0), "EIO", "--times", "3"]).unwrap();
    for (round, name) in ["x", "y", "z"].iter().enumerate() {
        let inst = a.create_gpu(name, "L40S-1Q").unwrap();
        assert_eq!(inst["gpu"]["device"], VF1, "round {round}: the refused VF is skipped: {inst}");
        a.ok("instance.delete", json!({"ref": name}));
        let marks = marked(&a);
        match round {
            0 => assert!(marks.is_empty(), "a first create-time EIO is no mark: {marks:?}"),
            _ => {
                assert_eq!(marks, vec![VF0.to_string()], "round {round}");
                let h = health_record(&a, VF0);
                assert_eq!(
                    (h["reason"].as_str(), h["quarantined"].as_bool()),
                    (Some("create_eio"), Some(false)),
                    "{h}"
                );
            }
        }
    }
    // Suspect is no quarantine: with the fault gone, vf0 is placed on again.
    let inst = a.create_gpu("w", "L40S-1Q").unwrap();
    assert_eq!(inst["gpu"]["device"], VF0, "{inst}");
}
