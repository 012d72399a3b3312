//! docs/design/scenarios.md §3 "Create/start rollback & retention" (S016–S019) and S050 (the shape of
//! `vgpu_cleanup_pending`), against the real agent, gpuvisor-sim and QEMU.
//!
//! "QEMU exits with status 1 right after it is spawned" is a `qemu_binary` wrapper whose
//! hook runs `exit 1` (it is spawned exactly as QEMU would be, holding the VF's group node
//! from fork to exit). Faults that must hit the rollback's clear but not the configure
//! write (`fail-write vf0 type EBUSY --always` in the scenarios) are injected by that hook
//! with `gpuvisor-sim ctl`, i.e. after the type was set and before the VMM "exits".

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

/// Host V reduced to one VF, so "only vf0 is allocatable" holds literally.
const HOST_V1: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 1\niommu_group = 40\n";
/// Host V: one L40S with 4 VFs `.4`–`.7`.
const HOST_V: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
/// Host M reduced to one mdev parent (vf0), so only vf0 offers `nvidia-1147`.
const HOST_M1: &str =
    "framework = \"mdev\"\nrelease_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 1\niommu_group = 40\n";
const VF0: &str = "0000:41:00.4";
const ALL_TYPES: &str = "sys/bus/pci/devices/*/nvidia/current_vgpu_type";

fn agent(model: &str, w: &QemuWrapper, set: &[(&str, &str)]) -> Agent {
    let extra = w.extra() + "reconcile_interval_s = 3600\n";
    Agent::start_tuned(AgentOptions { model, extra: &extra, ..Default::default() }, None, set).unwrap()
}

fn not_found(a: &Agent, name: &str) -> bool {
    a.call("instance.get", json!({"ref": name})).err().map(|e| e.data_code == "not_found").unwrap_or(false)
}

fn allocatable(a: &Agent) -> u64 {
    a.ok("resources.get", json!({}))["devices"]["allocatable"].as_u64().unwrap()
}

#[test]
fn s016_create_rollback_releases_while_the_claim_still_exists() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V1, &w, &[]);
    w.set_hook("exit 1\n");
    let claim_file = a.data_dir.join(format!("claims/{VF0}.json"));
    let sock = a.socket.clone();
    let create = std::thread::spawn(move || {
        rpc_raw(
            &sock,
            &json!({"jsonrpc":"2.0","id":1,"method":"instance.create","params":{"name":"a","image":"demo","gpu":"L40S-1Q"}})
                .to_string(),
        )
    });
    // Watch the claim row and the VF together while the create runs: the row must never be
    // gone while vf0 still holds a type.
    let type_file = a.sim.path().join(type_path(VF0));
    let mut seen = Vec::new();
    while !create.is_finished() {
        let claim = claim_file.exists();
        let t = std::fs::read_to_string(&type_file).unwrap_or_default().trim().to_string();
        seen.push((claim, t));
        std::thread::sleep(Duration::from_millis(5));
    }
    let answer = create.join().unwrap().unwrap();
    let err = &answer["error"];
    assert_eq!(err["code"], 500, "{answer}");
    assert_eq!(err["data"]["code"], "vmm_start_failed", "{answer}");
    let bad: Vec<_> = seen.iter().filter(|(c, t)| !*c && t != "0" && !t.is_empty()).collect();
    assert!(bad.is_empty(), "the claim row vanished while vf0 still held a type: {bad:?}");
    assert!(seen.iter().any(|(c, t)| *c && t == "1147"), "the claim existed while vf0 was set: {seen:?}");

    let tw = type_writes_of(&a.state(), VF0);
    assert_eq!(tw.first(), Some(&("1147".to_string(), "ok".to_string())), "{tw:?}");
    assert_eq!(tw.last(), Some(&("0".to_string(), "ok".to_string())), "the clear succeeded last: {tw:?}");
    for (v, r) in &tw[1..tw.len() - 1] {
        assert_eq!((v.as_str(), r.as_str()), ("0", "EBUSY"), "only EBUSY clears are retried: {tw:?}");
    }
    assert_eq!(a.vf_type(VF0), 0);
    assert!(a.claims().is_empty(), "no claim row: {:?}", a.claims());
    assert!(not_found(&a, "a"), "A no longer exists");
    assert!(a.data_files("instances").is_empty(), "no instance directory: {:?}", a.data_files("instances"));
}

#[test]
fn s016_also_a_failed_rollback_release_retains_the_claim_and_a_delete_only_instance() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V1, &w, &[]);
    w.set_hook(&format!("{}\nexit 1\n", sim_ctl_sh(&a.sim, &["fail-write", &type_path(VF0), "EBUSY", "--always"])));
    let e = a.create_gpu("a", "L40S-1Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{e}");
    assert_eq!(e.data["retained"], true, "{}", e.data);
    w.clear_hook();

    let listed = a.ok("instance.list", json!({}));
    let inst = listed["instances"].as_array().unwrap().iter().find(|i| i["name"] == "a").cloned();
    let inst = inst.unwrap_or_else(|| panic!("A is listed: {listed}"));
    assert_eq!(inst["state"], "cleanup_pending", "{inst}");
    let c = a.claim(VF0).expect("the claim of vf0 stays");
    assert_eq!(c["state"], "release_pending", "{c}");
    assert_eq!(c["instance_id"], inst["id"]);
    assert_eq!(a.vf_type(VF0), 1147, "vf0 keeps its type");

    // Only DELETE is accepted.
    for m in ["instance.start", "instance.stop"] {
        let e = a.err(m, json!({"ref": "a"}));
        assert_eq!((e.code, e.data_code.as_str()), (409, "instance_cleanup_pending"), "{m}: {e}");
    }
    // vf0 is offered to nobody.
    assert_eq!(allocatable(&a), 0);
    let n = type_writes_of(&a.state(), VF0).len();
    let e = a.create_gpu("b", "L40S-1Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "{e}");
    assert_eq!(type_writes_of(&a.state(), VF0).len(), n, "vf0 was not written for B");

    a.sim.ctl(&["clear-faults"]).unwrap();
    a.ok("instance.delete", json!({"ref": "a"}));
    assert_eq!(a.vf_type(VF0), 0);
    assert!(a.claims().is_empty());
    assert!(not_found(&a, "a"));
}

#[test]
fn s017_start_rollback_keeps_the_claim_when_it_cannot_release() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V1, &w, &[("release_retry_s", "1")]);
    a.create_gpu("a", "L40S-1Q").unwrap();
    let stopped = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    assert_eq!(stopped["state"], "stopped");
    assert!(a.claims().is_empty(), "A stopped with no claim");
    assert_eq!(allocatable(&a), 1);

    w.set_hook(&format!("{}\nexit 1\n", sim_ctl_sh(&a.sim, &["fail-write", &type_path(VF0), "EIO", "--always"])));
    let e = a.err("instance.start", json!({"ref": "a"}));
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{e}");
    assert_eq!(e.data["retained"], true, "{}", e.data);
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["state"], "cleanup_pending", "{got}");
    let c = a.claim(VF0).expect("claim vf0→A");
    assert_eq!(c["instance_id"], got["id"]);
    assert_eq!(c["type_id"], 1147);
    assert_eq!(c["state"], "release_pending", "{c}");
    assert_eq!(allocatable(&a), 0, "vf0 dropped out of the allocatable count");

    let e = a.err("instance.start", json!({"ref": "a"}));
    assert_eq!((e.code, e.data_code.as_str()), (409, "instance_cleanup_pending"), "{e}");
}

#[test]
fn s018_start_stops_early_if_a_leftover_claim_cannot_be_released() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, &w, &[("release_retry_s", "1")]);
    let (id, vf) = a.retained_stopped("a", "L40S-2Q");
    assert_eq!(vf, VF0);
    assert_eq!(a.vf_type(VF0), 1148);
    a.sim.ctl(&["fail-write", &type_path(VF0), "EBUSY", "--always"]).unwrap();
    let seq = last_seq(&a.state());

    let e = a.err("instance.start", json!({"ref": "a"}));
    assert_eq!((e.code, e.data_code.as_str()), (409, "gpu_release_pending"), "{e}");
    assert!(e.data["device"] == VF0 || e.message.contains(VF0), "the error names vf0: {} {}", e.message, e.data);
    assert!(e.message.contains("EBUSY") || e.message.to_lowercase().contains("busy"), "names the error: {}", e.message);
    let after = log_after(&a.state(), seq);
    assert!(!after.iter().any(|x| x["op"] == "open"), "no QEMU opened a node: {after:?}");
    assert!(
        after
            .iter()
            .filter(|x| x["op"] == "write")
            .all(|x| x["path"] == type_path(VF0) && x["value"].as_str().unwrap().trim() == "0"),
        "only release attempts on vf0 were written: {after:?}"
    );
    let claims = a.claims();
    assert_eq!(claims.len(), 1, "no new claim row: {claims:?}");
    assert_eq!(claims[0]["device"], VF0);
    assert_eq!(claims[0]["instance_id"], id.as_str());
    assert!(a.qemu_pids().is_empty(), "no QEMU spawned");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "stopped");

    // Once the release works, a later start succeeds.
    a.sim.ctl(&["clear-faults"]).unwrap();
    let started = a.ok("instance.start", json!({"ref": "a"}));
    assert_eq!(started["state"], "running");
    assert_eq!(a.claims().len(), 1);
}

fn available(a: &Agent) -> String {
    std::fs::read_to_string(
        a.sim.path().join(format!("sys/class/mdev_bus/{VF0}/mdev_supported_types/nvidia-1147/available_instances")),
    )
    .unwrap_or_default()
    .trim()
    .to_string()
}

#[test]
fn s019_failed_mdev_starts_leak_nothing() {
    let w = QemuWrapper::new();
    let a = agent(HOST_M1, &w, &[("release_retry_s", "1")]);
    assert_eq!(available(&a), "1");
    w.set_hook("exit 1\n");
    for round in 0..3 {
        let e = a.create_gpu("p", "L40S-1Q").unwrap_err();
        assert_eq!((e.code, e.data_code.as_str()), (500, "vmm_start_failed"), "round {round}: {e}");
        assert!(sim_mdevs(&a.state()).is_empty(), "round {round}: no mdev under vf0: {:?}", sim_mdevs(&a.state()));
        assert_eq!(available(&a), "1", "round {round}");
        assert!(a.claims().is_empty(), "round {round}: {:?}", a.claims());
        assert!(not_found(&a, "p"), "round {round}: P is gone");
        assert!(a.data_files("mdevs").is_empty(), "round {round}: no mdev record: {:?}", a.data_files("mdevs"));
    }
    w.clear_hook();
    let q = a.create_gpu("q", "L40S-1Q").unwrap();
    assert_eq!(q["gpu"]["framework"], "mdev");
    assert_eq!(q["gpu"]["device"], VF0);

    // Also: the rollback's remove fails with EBUSY until the next pass.
    a.ok("instance.delete", json!({"ref": "q"}));
    assert!(sim_mdevs(&a.state()).is_empty());
    w.set_hook(&format!(
        "{}\nexit 1\n",
        sim_ctl_sh(&a.sim, &["fail-write", "sys/bus/mdev/devices/*/remove", "EBUSY", "--always"])
    ));
    let e = a.create_gpu("p", "L40S-1Q").unwrap_err();
    w.clear_hook();
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{e}");
    assert_eq!(e.data["retained"], true, "{}", e.data);
    assert_eq!(a.ok("instance.get", json!({"ref": "p"}))["state"], "cleanup_pending");
    assert_eq!(a.claims().len(), 1, "P keeps its claim");
    assert_eq!(sim_mdevs(&a.state()).len(), 1, "P's mdev is still there");
    let e = a.create_gpu("q", "L40S-1Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "{e}");

    a.sim.ctl(&["clear-faults"]).unwrap();
    let pass = a.ok("reconcile.run", json!({}));
    assert!(
        pass["released"].as_array().unwrap().iter().any(|r| r["device"] == VF0),
        "the pass releases P's claim: {pass}"
    );
    assert!(sim_mdevs(&a.state()).is_empty(), "the pass removed the mdev");
    assert!(a.claims().is_empty());
    let q = a.create_gpu("q", "L40S-1Q").unwrap();
    assert_eq!(q["state"], "running");
}

/// Checks the common shape of a `vgpu_cleanup_pending` answer; returns the VF it names.
fn check_cleanup_pending(a: &Agent, e: &RpcError, name: &str, retained: bool) -> String {
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{name}: {e}");
    let d = &e.data;
    let rec = a.data_dir.join("instances").read_dir().unwrap().flatten().find_map(|d| {
        let t = std::fs::read_to_string(d.path().join("instance.json")).ok()?;
        let v: Value = serde_json::from_str(&t).ok()?;
        (v["name"] == name).then_some(v)
    });
    let id = rec.as_ref().map(|r| r["id"].as_str().unwrap().to_string());
    assert_eq!(d["instance_id"].as_str(), id.as_deref(), "{name}: instance_id: {d}");
    let path = d["device_path"].as_str().unwrap_or_else(|| panic!("{name}: device_path: {d}"));
    let vf = path.rsplit('/').next().unwrap().to_string();
    assert!(path.ends_with(&format!("sys/bus/pci/devices/{vf}")), "{name}: {path}");
    assert_eq!(d["cause"]["code"], "vmm_start_failed", "{name}: the start failure is the cause: {d}");
    assert_eq!(d["retained"], retained, "{name}: {d}");
    let g = d["guidance"].as_str().unwrap_or_else(|| panic!("{name}: guidance: {d}"));
    if retained {
        assert!(g.contains("delete instance") && g.contains(id.as_deref().unwrap()), "{name}: {g}");
    } else {
        assert!(g.contains("released automatically"), "{name}: {g}");
        assert!(!g.contains("delete instance") && !g.contains("to retry"), "{name}: no advice to delete: {g}");
    }
    let c = a.claim(&vf).unwrap_or_else(|| panic!("{name}: the claim row of {vf} stays"));
    assert_eq!(c["instance_id"].as_str(), d["instance_id"].as_str(), "{c}");
    vf
}

#[test]
fn s050_the_shape_of_vgpu_cleanup_pending() {
    let w = QemuWrapper::new();
    // claim_grace_s = 2: in case (b) the record stays `starting` without a VMM identity, and
    // docs/design/lifecycle.md lets the reconciler release such a claim only "after the claim grace".
    let mut a = agent(HOST_V, &w, &[("release_retry_s", "1"), ("claim_grace_s", "2")]);
    let fault = format!("{}\nexit 1\n", sim_ctl_sh(&a.sim, &["fail-write", ALL_TYPES, "EBUSY", "--always"]));
    let pass_releases = |a: &Agent, vf: &str| {
        a.sim.ctl(&["clear-faults"]).unwrap();
        let pass = a.ok("reconcile.run", json!({}));
        assert!(a.claim(vf).is_none(), "a pass after clear-faults releases {vf}: {pass}");
        assert_eq!(a.vf_type(vf), 0, "{pass}");
    };

    // (a) create, retained.
    w.set_hook(&fault);
    let e = a.create_gpu("ca", "L40S-1Q").unwrap_err();
    w.clear_hook();
    let vf = check_cleanup_pending(&a, &e, "ca", true);
    pass_releases(&a, &vf);

    // (a) start of a stopped instance, retained.
    a.create_gpu("sa", "L40S-1Q").unwrap();
    a.ok("instance.stop", json!({"ref": "sa", "force": true}));
    w.set_hook(&fault);
    let e = a.err("instance.start", json!({"ref": "sa"}));
    w.clear_hook();
    let vf = check_cleanup_pending(&a, &e, "sa", true);
    pass_releases(&a, &vf);

    // (b) the retention write fails too.
    a.create_gpu("sb", "L40S-1Q").unwrap();
    a.ok("instance.stop", json!({"ref": "sb", "force": true}));
    a.env.push(("FAILPOINTS".into(), "retain_write=return".into()));
    a.restart().unwrap();
    w.set_hook(&fault);
    let e = a.create_gpu("cb", "L40S-1Q").unwrap_err();
    let vf_c = check_cleanup_pending(&a, &e, "cb", false);
    a.sim.ctl(&["clear-faults"]).unwrap(); // the hook injects it again for the start
    let e = a.err("instance.start", json!({"ref": "sb"}));
    w.clear_hook();
    let vf_s = check_cleanup_pending(&a, &e, "sb", false);
    a.sim.ctl(&["clear-faults"]).unwrap();
    // Bounded poll over passes: released once the (2 s) claim grace has passed.
    let released = wait_for(Duration::from_secs(20), || {
        let pass = a.ok("reconcile.run", json!({}));
        (a.claim(&vf_c).is_none() && a.claim(&vf_s).is_none()).then_some(pass)
    });
    assert!(released.is_some(), "passes after clear-faults release both claims: {:?}", a.claims());
    assert_eq!(a.vf_type(&vf_c), 0);
    assert_eq!(a.vf_type(&vf_s), 0);
}
