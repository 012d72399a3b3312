//! End to end: whole-GPU passthrough (docs/design/host.md §7; docs/design/scenarios.md S054–S058) against
//! the real agent, gpuvisor-sim's `pt-2` host and real QEMU (hold-fd on the group node).
//!
//! `pt-2`: p0 `0000:82:00.0` (group 40: p0, its audio `.1`, a bridge `0000:80:01.0`), p1
//! `0000:83:00.0` (group 41: p1 and `.1`), p2 `0000:84:00.0` (group 42: p2, `.1` and an
//! unrelated NIC `0000:85:00.0`). Every assertion is on API answers, store files, the
//! simulator's state dump and write log, and the process table.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

const P0: &str = "0000:82:00.0";
const P0A: &str = "0000:82:00.1";
const BRIDGE: &str = "0000:80:01.0";
const P1: &str = "0000:83:00.0";
const P1A: &str = "0000:83:00.1";
const P2: &str = "0000:84:00.0";
const NIC: &str = "0000:85:00.0";

const PT: &str = "passthrough_gpus = [\"0000:82:00.0\", \"0000:83:00.0\", \"0000:84:00.0\"]\n";

fn agent(extra: &str) -> Agent {
    Agent::start_with(AgentOptions { model: "pt-2", extra: &format!("{PT}{extra}"), ..Default::default() }).unwrap()
}

fn create_pt(a: &Agent, name: &str, address: Option<&str>) -> Result<Value, RpcError> {
    let gpu = match address {
        Some(x) => json!({"passthrough": true, "address": x}),
        None => json!({"passthrough": true}),
    };
    a.call("instance.create", json!({"name": name, "image": "demo", "gpu": gpu}))
}

/// The simulator's passthrough entry of the GPU at `bdf`.
fn pt_entry(state: &Value, bdf: &str) -> Value {
    state["passthrough"]
        .as_array()
        .and_then(|a| a.iter().find(|g| g["bdf"] == bdf))
        .cloned()
        .unwrap_or_else(|| panic!("no passthrough GPU {bdf} in {state}"))
}

fn drivers(a: &Agent, gpu: &str) -> Vec<(String, String)> {
    a.pt_drivers(gpu)
}

fn pairs(x: &[(&str, &str)]) -> Vec<(String, String)> {
    bindings(x)
}

fn boot_p0() -> Vec<(String, String)> {
    pairs(&[(P0, "nvidia"), (P0A, "snd_hda_intel"), (BRIDGE, "pcieport")])
}

fn boot_p1() -> Vec<(String, String)> {
    pairs(&[(P1, "nvidia"), (P1A, "snd_hda_intel")])
}

/// Writes that changed a binding (driver_override, bind, unbind, drivers_probe, reset).
fn binding_writes(w: &[(String, String, String)]) -> Vec<(String, String, String)> {
    w.iter()
        .filter(|(p, _, _)| {
            p.ends_with("driver_override")
                || p.ends_with("/bind")
                || p.ends_with("/unbind")
                || p.ends_with("drivers_probe")
                || p.ends_with("/reset")
        })
        .cloned()
        .collect()
}

fn resources(a: &Agent) -> Value {
    a.ok("resources.get", json!({}))
}

// ----------------------------------------------------------------------------- lifecycle

/// S054 (main case) and the lifecycle: create moves the whole group (GPU and audio) to
/// vfio-pci — the bridge stays —, the claim records the original drivers before any
/// driver change, QEMU holds `dev/vfio/40`; stop gives every function back; start moves it
/// again; delete gives it back and leaves nothing.
#[test]
fn s054_create_stop_start_delete_moves_the_whole_group_and_gives_it_back() {
    let a = agent("");
    let n = a.sim_writes().len();
    let v = create_pt(&a, "a", Some(P0)).unwrap();
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["gpu"]["framework"], "passthrough", "{v}");
    assert_eq!(v["gpu"]["device"], P0, "{v}");
    assert_eq!(drivers(&a, P0), pairs(&[(P0, "vfio-pci"), (P0A, "vfio-pci"), (BRIDGE, "pcieport")]));
    // The claim names the GPU and records the original drivers.
    let c = a.claim(P0).expect("claim of p0");
    assert_eq!(c["framework"], "passthrough");
    assert_eq!(c["passthrough"]["group"], 40);
    assert_eq!(
        c["passthrough"]["functions"],
        json!([{"bdf": P0, "original_driver": "nvidia"}, {"bdf": P0A, "original_driver": "snd_hda_intel"}])
    );
    // The claim was durable before the first driver write: the first write of the create is
    // p0's override (nothing is written before the claim exists), and the bridge is never
    // written.
    let w = binding_writes(&a.sim_writes()[n..]);
    assert!(
        w.first().is_some_and(|(p, v, _)| p.contains(P0) && p.ends_with("driver_override") && v == "vfio-pci"),
        "{w:?}"
    );
    assert!(w.iter().all(|(p, v, _)| !p.contains(BRIDGE) && v != BRIDGE), "the bridge is untouched: {w:?}");
    // QEMU holds the group node.
    let pid = a.qemu_pid(v["id"].as_str().unwrap());
    assert!(fd_targets(pid).iter().any(|t| t.ends_with("/dev/vfio/40")), "{:?}", fd_targets(pid));
    // The instance view shows each function, its driver now and its original.
    assert_eq!(v["gpu"]["functions"][1], json!({"bdf": P0A, "driver": "vfio-pci", "original_driver": "snd_hda_intel"}));

    let s = a.ok("instance.stop", json!({"ref": "a"}));
    assert_eq!(s["state"], "stopped", "{s}");
    assert_eq!(drivers(&a, P0), boot_p0(), "stop gives every function back");
    assert!(a.claim(P0).is_none());
    assert_eq!(pt_entry(&a.state(), P0)["functions"][0]["driver_override"], Value::Null, "override cleared");

    let s = a.ok("instance.start", json!({"ref": "a"}));
    assert_eq!(s["state"], "running", "{s}");
    assert_eq!(drivers(&a, P0)[1..], pairs(&[(P0, "vfio-pci"), (P0A, "vfio-pci")])[..]);

    let d = a.ok("instance.delete", json!({"ref": "a"}));
    assert_eq!(d["deleted"], true, "{d}");
    assert_eq!(drivers(&a, P0), boot_p0(), "delete gives every function back");
    assert!(a.claims().is_empty());
    assert!(a.live_qemus().is_empty());
}

/// S054 (variant): a GPU whose group holds an unrelated device (p2: NIC `0000:85:00.0`) is
/// refused with `iommu_group_conflict` naming it — no driver change, no claim; asked for
/// "any GPU", it is never offered.
#[test]
fn s054_a_group_holding_a_foreign_device_is_refused_untouched() {
    let a = agent("");
    let n = a.sim_writes().len();
    let e = create_pt(&a, "a", Some(P2)).unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "iommu_group_conflict"), "{e}");
    assert!(e.message.contains(NIC), "{e}");
    assert_eq!(e.data["members"], json!([NIC]), "{e}");
    assert!(binding_writes(&a.sim_writes()[n..]).is_empty(), "no driver change");
    assert!(a.claims().is_empty(), "no claim row");
    assert!(a.instance_names().is_empty(), "no instance left");
    // The GPU list says why p2 is not offered; resources count it as refused.
    let g = a.ok("gpu.list", json!({}));
    let p2 = g["gpus"].as_array().unwrap().iter().find(|x| x["address"] == P2).cloned().unwrap();
    assert_eq!(p2["passthrough"]["foreign"], json!([NIC]), "{p2}");
    assert!(p2["passthrough"]["problem"].as_str().unwrap().contains(NIC), "{p2}");
    let r = resources(&a);
    assert_eq!(r["passthrough"]["refused"], 1, "{r}");
    assert_eq!(r["passthrough"]["allocatable"], 2, "{r}");
    // Any GPU: p0 and p1, never p2.
    let x = create_pt(&a, "x", None).unwrap();
    let y = create_pt(&a, "y", None).unwrap();
    let mut got =
        vec![x["gpu"]["device"].as_str().unwrap().to_string(), y["gpu"]["device"].as_str().unwrap().to_string()];
    got.sort();
    assert_eq!(got, vec![P0, P1]);
    let e = create_pt(&a, "z", None).unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert!(e.message.contains(P2), "the message says why p2 was not used: {e}");
    assert_eq!(drivers(&a, P2), pairs(&[(P2, "nvidia"), ("0000:84:00.1", "snd_hda_intel"), (NIC, "igb")]));
}

/// S055 (a): a host process holding p0 through the host driver (`dev/nvidia0`) makes the
/// create fail with `gpu_busy` naming it, before any driver change.
#[test]
fn s055_a_host_process_holding_the_gpu_is_gpu_busy() {
    let a = agent("");
    let node = a.sim.path().join("dev/nvidia0");
    let (_holder, line) = a.ns_sh(&format!("exec 3<{}; echo $$; exec sleep 3055", node.display()));
    let n = a.sim_writes().len();
    let e = create_pt(&a, "a", Some(P0)).unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "gpu_busy"), "{e}");
    assert!(e.message.contains(&format!("pid {line} (sleep)")), "names the holder: {e}");
    assert!(binding_writes(&a.sim_writes()[n..]).is_empty(), "no driver change");
    assert!(a.claims().is_empty());
    assert_eq!(drivers(&a, P0), boot_p0());
}

/// S055 (b): with host-service commands configured, the service is stopped before p0
/// leaves `nvidia`; a bind that fails (`driver_override` EINVAL) answers 500
/// `passthrough_bind_failed` with both functions back on their boot drivers, the service
/// running again and no claim row.
#[test]
fn s055_services_are_stopped_for_the_bind_and_started_again_when_it_fails() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    // The "service": a process holding dev/nvidia0, its pid in svc.pid; stop kills it,
    // start runs it again; both log to svc.log.
    let a = {
        let sim_dev = "__SIM__/dev/nvidia0";
        let start = format!("echo start >> {d}/svc.log; (exec 3<{sim_dev}; exec sleep 3056) & echo $! > {d}/svc.pid");
        // (An orphan stays a zombie in the test namespace: wait for its fd, not its pid.)
        let stop = format!(
            "echo stop >> {d}/svc.log; p=$(cat {d}/svc.pid); kill $p; while [ -e /proc/$p/fd/3 ]; do sleep 0.05; done"
        );
        std::fs::write(dir.path().join("start.sh"), &start).unwrap();
        std::fs::write(dir.path().join("stop.sh"), &stop).unwrap();
        agent(&format!(
            "passthrough_stop_services = [\"sh\", \"{d}/stop.sh\"]\npassthrough_start_services = [\"sh\", \"{d}/start.sh\"]\n"
        ))
    };
    let sim = a.sim.path().display().to_string();
    for f in ["start.sh", "stop.sh"] {
        let p = dir.path().join(f);
        std::fs::write(&p, std::fs::read_to_string(&p).unwrap().replace("__SIM__", &sim)).unwrap();
    }
    // The service runs (started inside the agent's namespace, as the agent would).
    let (mut st, _) = a.ns_sh(&format!("sh {d}/start.sh; echo started"));
    let _ = st.wait();
    let held = || pt_entry(&a.state(), P0)["handles"].as_array().unwrap().iter().any(|h| h["node"] == "dev/nvidia0");
    wait_for(Duration::from_secs(10), || held().then_some(())).expect("the service holds dev/nvidia0");

    a.sim.ctl(&["fail-write", &format!("sys/bus/pci/devices/{P0}/driver_override"), "EINVAL", "--always"]).unwrap();
    let e = create_pt(&a, "a", Some(P0)).unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (500, "passthrough_bind_failed"), "{e}");
    assert!(e.message.contains("EINVAL"), "{e}");
    assert_eq!(drivers(&a, P0), boot_p0(), "both functions on their boot drivers");
    assert!(a.claims().is_empty(), "no claim row");
    assert!(a.instance_names().is_empty());
    let log = std::fs::read_to_string(dir.path().join("svc.log")).unwrap();
    assert_eq!(log.lines().collect::<Vec<_>>(), vec!["start", "stop", "start"], "stopped for the bind, started again");
    wait_for(Duration::from_secs(10), || held().then_some(())).expect("the service runs again");
}

/// S056: a host driver that will not come back. R runs on p0; its stop with every
/// `drivers_probe` failing leaves R `stopped` and p0's claim `release_pending` with the
/// binding it observed and the original drivers; p0 is not offered. Once the fault clears,
/// one pass gives the whole group back and p0 returns to the pool. R2 on p1, whose "QEMU"
/// exits right after spawn, gets its error only after group 41 is back on its drivers.
#[test]
fn s056_a_driver_that_will_not_come_back_keeps_the_claim_until_a_pass_gives_it_back() {
    let w = QemuWrapper::new();
    let a = agent(&w.extra());
    create_pt(&a, "r", Some(P0)).unwrap();
    a.sim.ctl(&["fail-write", "sys/bus/pci/drivers_probe", "EINVAL", "--always"]).unwrap();
    let s = a.ok("instance.stop", json!({"ref": "r", "force": true}));
    assert_eq!(s["state"], "stopped", "{s}");
    assert_eq!(s["gpu"]["release_pending"], true, "{s}");
    let c = a.claim(P0).expect("p0's claim is kept");
    assert_eq!(c["state"], "release_pending", "{c}");
    let err = c["last_error"].as_str().unwrap();
    assert!(
        err.contains("bound now:") && err.contains("original: 0000:82:00.0=nvidia 0000:82:00.1=snd_hda_intel"),
        "{err}"
    );
    // Never a driverless GPU that looks free: p0 is claimed and not offered.
    let r = resources(&a);
    assert_eq!(
        (r["passthrough"]["claimed"].as_u64(), r["passthrough"]["allocatable"].as_u64()),
        (Some(1), Some(1)),
        "{r}"
    );
    let d = a.ok("placement.dry_run", json!({"passthrough": true}));
    assert_eq!(
        d["ranked"].as_array().unwrap().iter().map(|x| x["device"].clone()).collect::<Vec<_>>(),
        vec![json!(P1)],
        "{d}"
    );
    // The fault clears: one pass gives group 40 back.
    a.sim.ctl(&["clear-faults"]).unwrap();
    let rep = a.pass();
    assert!(a.claim(P0).is_none(), "the pass released p0: {rep}");
    assert_eq!(drivers(&a, P0), boot_p0());
    assert_eq!(resources(&a)["passthrough"]["allocatable"], 2);
    // R2's QEMU dies at once: the answer comes after group 41 is back.
    w.set_hook("exit 1\n");
    let e = create_pt(&a, "r2", Some(P1)).unwrap_err();
    assert_eq!(e.data_code, "vmm_start_failed", "{e}");
    assert_eq!(drivers(&a, P1), boot_p1(), "group 41 is back before the answer");
    assert!(a.claims().is_empty());
}

/// S057: a wedged GPU is marked unhealthy once, not reset forever. S runs on p1; its QEMU
/// is SIGKILLed behind the agent's back, with a 2 s teardown lag, and p1 is wedged. The
/// passes record S stopped, try one reset (never while the group is open), quarantine p1
/// (`reset_failed`) and still give its functions back; start S (pinned to p1) gets 409
/// `device_unhealthy`; T (any GPU) gets p0, never p1.
#[test]
fn s057_a_wedged_gpu_is_quarantined_after_one_reset() {
    let a = agent("");
    let s = create_pt(&a, "s", Some(P1)).unwrap();
    a.sim.ctl(&["release-delay", P1, "2000"]).unwrap();
    let n = a.sim_writes().len();
    sigkill(a.qemu_pid(s["id"].as_str().unwrap()));
    wait_for(Duration::from_secs(10), || a.live_qemus().is_empty().then_some(())).expect("QEMU gone");
    a.sim.ctl(&["wedge", P1]).unwrap();
    // Passes until the claim is gone (the first may meet the teardown lag).
    wait_for(Duration::from_secs(60), || {
        a.pass();
        a.claim(P1).is_none().then_some(())
    })
    .unwrap_or_else(|| panic!("p1's claim was never released: {:?}", a.claim(P1)));
    assert_eq!(a.ok("instance.get", json!({"ref": "s"}))["state"], "stopped");
    let resets: Vec<_> =
        a.sim_writes()[n..].iter().filter(|(p, _, _)| p.ends_with(&format!("{P1}/reset"))).cloned().collect();
    assert_eq!(resets.len(), 1, "one reset, no reset loop: {resets:?}");
    assert_ne!(resets[0].2, "EBUSY", "no reset while the group is open: {resets:?}");
    assert_eq!(drivers(&a, P1), boot_p1(), "its functions are given back");
    let g = a.ok("gpu.list", json!({}));
    let p1 = g["gpus"].as_array().unwrap().iter().find(|x| x["address"] == P1).cloned().unwrap();
    assert_eq!(p1["devices"][0]["state"], "quarantined", "{p1}");
    assert_eq!(p1["devices"][0]["quarantine"]["reason"], "reset_failed", "{p1}");
    assert_eq!(resources(&a)["passthrough"]["quarantined"], 1);
    let e = a.call("instance.start", json!({"ref": "s"})).unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "device_unhealthy"), "{e}");
    let t = create_pt(&a, "t", None).unwrap();
    assert_eq!(t["gpu"]["device"], P0, "{t}");
    // Another pass tries no reset on the quarantined GPU.
    a.pass();
    assert_eq!(a.sim_writes()[n..].iter().filter(|(p, _, _)| p.ends_with(&format!("{P1}/reset"))).count(), 1);
}

/// Issue 18 finding 11: a stop whose give-back quarantines the GPU (its reset fails: the
/// GPU is wedged) says so — the answer carries `released_device_quarantined`, `last_error`
/// names the mark, and `gpuvisor stop` prints it and exits 5 — never a plain success; and
/// so does a delete (`gpuvisor rm`, exit 5).
#[test]
fn a_stop_that_gives_back_a_quarantined_gpu_says_so_in_the_answer_the_table_and_the_exit_code() {
    let a = agent("");
    create_pt(&a, "s", Some(P1)).unwrap();
    create_pt(&a, "t", Some(P0)).unwrap();
    a.sim.ctl(&["wedge", P1]).unwrap();
    a.sim.ctl(&["wedge", P0]).unwrap();
    let v = a.ok("instance.stop", json!({"ref": "s", "force": true}));
    assert_eq!(v["state"], "stopped", "{v}");
    assert_eq!(v["released_device_quarantined"]["device"], P1, "BUG: a plain success: {v}");
    assert_eq!(v["released_device_quarantined"]["reason"], "reset_failed", "{v}");
    assert!(v["last_error"].as_str().is_some_and(|e| e.contains("quarantined")), "{v}");
    assert_eq!(drivers(&a, P1), boot_p1(), "its functions are given back");
    let o = a.cli(&["stop", "t", "--force"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(5), "the exit code says it: {o:?}");
    assert!(out.contains("QUARANTINED") && out.contains(P0) && out.contains("unquarantine"), "{out}");
    let got = a.ok("instance.get", json!({"ref": "t"}));
    assert!(got["last_error"].as_str().is_some_and(|e| e.contains("quarantined")), "{got}");
    // A delete that gives the GPU back quarantined says so too (exit 5).
    a.ok("gpu.unquarantine", json!({"device": P1}));
    a.ok("instance.start", json!({"ref": "s"}));
    let o = a.cli(&["rm", "s"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(5), "{o:?}");
    assert!(out.contains("deleted") && out.contains("QUARANTINED") && out.contains(P1), "{out}");
}

/// S058: the agent restarts with p0 on vfio-pci held by CC's QEMU and p1 on vfio-pci with
/// no holder (DD's delete crashed after its QEMU died). Resources never show zero GPUs nor
/// both as used by running instances; the pass finishes DD's delete (p1 back on its boot
/// drivers, DD's rows gone); EE gets p1; CC is untouched.
#[test]
fn s058_restart_with_passthrough_gpus_still_on_vfio_finishes_the_delete() {
    assert_failpoints_built();
    let mut a = agent("claim_grace_s = 2\n");
    let cc = create_pt(&a, "cc", Some(P0)).unwrap();
    let dd = create_pt(&a, "dd", Some(P1)).unwrap();
    let cc_pid = a.qemu_pid(cc["id"].as_str().unwrap());
    a.restart_with_failpoints(Some("delete_after_vmm_dead=return")).unwrap();
    a.wait_ready().unwrap();
    let r = a.call("instance.delete", json!({"ref": "dd"}));
    assert!(matches!(&r, Err(e) if is_transport(e)), "the agent aborts in the delete: {r:?}");
    assert!(a.wait_agent_gone(Duration::from_secs(10)));
    assert_eq!(drivers(&a, P1), pairs(&[(P1, "vfio-pci"), (P1A, "vfio-pci")]), "p1 still on vfio-pci");
    assert!(a.claim(P1).is_some());
    a.restart_with_failpoints(None).unwrap();
    let r = resources(&a);
    assert_eq!(r["passthrough"]["total"], 3, "{r}");
    let g = a.ok("gpu.list", json!({}));
    let owner = |bdf: &str| {
        g["gpus"].as_array().unwrap().iter().find(|x| x["address"] == bdf).map(|x| x["devices"][0].clone()).unwrap()
    };
    assert_eq!(owner(P0)["claim"]["instance_name"], "cc", "{g}");
    // p1 is either still pending DD's cleanup or already released by the startup pass —
    // never free while on vfio-pci, never shown as CC's.
    assert_ne!(owner(P1)["claim"]["instance_name"], "cc");
    let mut deleted = Vec::new();
    let mut last = Value::Null;
    wait_for(Duration::from_secs(30), || {
        last = a.pass();
        deleted.extend(last["deleted"].as_array().cloned().unwrap_or_default());
        (a.claim(P1).is_none() && !a.instance_names().contains(&"dd".to_string())).then_some(())
    })
    .unwrap_or_else(|| panic!("the pass finishes DD's delete: {last}"));
    // No client retried the delete: a pass finished it (the startup pass, or one of these,
    // depending on when DD's claim left its grace) and says so in its report.
    assert!(last["deleted"].is_array(), "{last}");
    assert!(deleted.is_empty() || deleted == vec![json!({"instance": dd["id"], "name": "dd"})], "{deleted:?}");
    assert!(!a.data_dir.join(format!("instances/{}", dd["id"].as_str().unwrap())).exists(), "DD's rows are gone");
    assert_eq!(drivers(&a, P1), boot_p1());
    let ee = create_pt(&a, "ee", None).unwrap_or_else(|e| panic!("EE: {e}\n{}", tail(&a.log(), 30)));
    assert_eq!(ee["gpu"]["device"], P1, "{ee}");
    assert_eq!(a.qemu_pid(cc["id"].as_str().unwrap()), cc_pid, "CC untouched");
    assert_eq!(drivers(&a, P0)[1..], pairs(&[(P0, "vfio-pci"), (P0A, "vfio-pci")])[..]);
}

// ------------------------------------------------------------------ faults and races

/// A failing `unbind` in the middle of the group (p0 moved, its audio function refused):
/// the create answers `passthrough_bind_failed` and every function is back on its boot
/// driver, with no claim.
#[test]
fn a_failing_unbind_mid_group_is_rolled_back() {
    let a = agent("");
    a.sim.ctl(&["fail-write", "sys/bus/pci/drivers/snd_hda_intel/unbind", "EIO", "--always"]).unwrap();
    let e = create_pt(&a, "a", Some(P0)).unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (500, "passthrough_bind_failed"), "{e}");
    assert_eq!(e.data["binding"], "0000:82:00.0=nvidia 0000:82:00.1=snd_hda_intel", "{e}");
    assert_eq!(drivers(&a, P0), boot_p0());
    assert!(a.claims().is_empty());
    assert!(a.instance_names().is_empty());
}

/// A failing `bind` (here: `drivers_probe`) after the GPU moved, whose give-back fails too
/// (vfio-pci's `unbind` refused): the claim is retained `release_pending`, the instance
/// `cleanup_pending` — never a half-bound group that looks free. Once the fault is gone,
/// the delete gives it back.
#[test]
fn a_bind_failure_whose_undo_fails_is_retained_never_free() {
    let a = agent("");
    a.sim.ctl(&["fail-write", "sys/bus/pci/drivers/snd_hda_intel/unbind", "EIO", "--always"]).unwrap();
    a.sim.ctl(&["fail-write", "sys/bus/pci/drivers/vfio-pci/unbind", "EIO", "--always"]).unwrap();
    let e = create_pt(&a, "a", Some(P0)).unwrap_err();
    assert_eq!(e.data_code, "vgpu_cleanup_pending", "{e}");
    assert_eq!(e.data["retained"], true, "{e}");
    let c = a.claim(P0).expect("the claim is retained");
    assert_eq!(c["state"], "release_pending", "{c}");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "cleanup_pending");
    let r = resources(&a);
    assert_eq!(
        (r["passthrough"]["claimed"].as_u64(), r["passthrough"]["allocatable"].as_u64()),
        (Some(1), Some(1)),
        "{r}"
    );
    let e = create_pt(&a, "b", Some(P0)).unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "p0 is not handed out: {e}");
    a.sim.ctl(&["clear-faults"]).unwrap();
    a.ok("instance.delete", json!({"ref": "a"}));
    assert_eq!(drivers(&a, P0), boot_p0());
    assert!(a.claims().is_empty());
}

/// Concurrent creates for the last GPUs: of four creates for two allocatable GPUs, exactly
/// two succeed, on different GPUs; the others answer `no_capacity`.
#[test]
fn concurrent_creates_for_the_last_gpus_never_double_claim() {
    let a = agent("");
    let calls: Vec<_> = (0..4)
        .map(|i| {
            a.spawn_call(
                "instance.create",
                json!({"name": format!("c{i}"), "image": "demo", "gpu": {"passthrough": true}}),
            )
        })
        .collect();
    let answers: Vec<Value> = calls.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    let mut ok: Vec<String> =
        answers.iter().filter_map(|v| v["result"]["gpu"]["device"].as_str().map(String::from)).collect();
    ok.sort();
    assert_eq!(ok, vec![P0.to_string(), P1.to_string()], "{answers:?}");
    let refused: Vec<&Value> = answers.iter().filter(|v| v.get("error").is_some()).collect();
    assert_eq!(refused.len(), 2, "{answers:?}");
    assert!(refused.iter().all(|v| v["error"]["data"]["code"] == "no_capacity"), "{refused:?}");
    assert_eq!(a.claims().len(), 2);
    assert_eq!(resources(&a)["passthrough"]["allocatable"], 0);
}

// ------------------------------------------------------------------------- capacity

/// `resources.get` on the passthrough host: `passthrough.allocatable` equals the number of
/// creates that still succeed, at every step of filling and emptying it.
#[test]
fn passthrough_capacity_equals_what_fits_while_filling_and_emptying() {
    let a = agent("");
    let mut names = Vec::new();
    loop {
        let allocatable = resources(&a)["passthrough"]["allocatable"].as_u64().unwrap();
        let name = format!("f{}", names.len());
        match create_pt(&a, &name, None) {
            Ok(_) => {
                assert!(allocatable > 0, "a create succeeded with allocatable 0");
                names.push(name);
            }
            Err(e) => {
                assert_eq!(allocatable, 0, "allocatable {allocatable}, yet the create failed: {e}");
                assert_eq!(e.data_code, "no_capacity");
                break;
            }
        }
        assert_eq!(resources(&a)["passthrough"]["allocatable"].as_u64().unwrap(), allocatable - 1);
    }
    assert_eq!(names.len(), 2);
    for (i, n) in names.iter().enumerate() {
        a.ok("instance.delete", json!({"ref": n}));
        assert_eq!(resources(&a)["passthrough"]["allocatable"].as_u64().unwrap(), i as u64 + 1);
    }
}

/// `resources.get` on a vGPU host of `model` (one L40S, 4 VFs or mdev parents) filled with
/// 16Q (3 fit under the equal-size rule): at every step a profile's `placeable` equals the
/// creates that still succeed, and `devices.allocatable` counts only free devices that can
/// take at least one profile now — after three, the fourth device is free but can take
/// nothing, and is not allocatable. Emptying gives the capacity back.
fn vgpu_capacity_equals_what_fits(model: &str) {
    let a = Agent::start_with(AgentOptions { model, ..Default::default() }).unwrap();
    let counts = |a: &Agent| {
        let r = resources(a);
        let p = r["profiles"].as_array().unwrap().iter().find(|p| p["profile"] == "L40S-16Q").cloned().unwrap();
        (p["placeable"].as_u64().unwrap(), r["devices"]["allocatable"].as_u64().unwrap())
    };
    assert_eq!(counts(&a), (3, 4), "three 16Q fit; every device can take some profile");
    let mut made = Vec::new();
    loop {
        let (placeable, allocatable) = counts(&a);
        assert_eq!(allocatable > 0, placeable > 0, "allocatable {allocatable} with placeable {placeable}");
        let name = format!("v{}", made.len());
        match a.create_gpu(&name, "L40S-16Q") {
            Ok(_) => {
                assert!(placeable > 0, "a create succeeded with placeable 0");
                made.push(name);
                assert_eq!(counts(&a).0, placeable - 1, "placeable drops by one per create");
            }
            Err(e) => {
                assert_eq!(placeable, 0, "placeable {placeable}, yet the create failed: {e}");
                assert_eq!(e.data_code, "no_capacity", "{e}");
                break;
            }
        }
    }
    assert_eq!(made.len(), 3);
    assert_eq!(counts(&a), (0, 0), "the fourth device is free but can take nothing");
    for (i, n) in made.iter().enumerate() {
        a.ok("instance.delete", json!({"ref": n}));
        let (placeable, allocatable) = counts(&a);
        assert_eq!(placeable, i as u64 + 1, "after {} deletes", i + 1);
        assert!(allocatable >= placeable);
    }
    assert_eq!(counts(&a), (3, 4));
}

#[test]
fn vendor_vfio_capacity_equals_what_fits_while_filling_and_emptying() {
    vgpu_capacity_equals_what_fits(HOST_V);
}

#[test]
fn mdev_capacity_equals_what_fits_while_filling_and_emptying() {
    vgpu_capacity_equals_what_fits(
        "framework = \"mdev\"\nrelease_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n",
    );
}

/// `placement.dry_run` answers for passthrough: the ranked free GPUs, and for a named GPU
/// the same error a create would get.
#[test]
fn dry_run_answers_for_passthrough() {
    let a = agent("");
    let d = a.ok("placement.dry_run", json!({"passthrough": true}));
    let ranked: Vec<&str> = d["ranked"].as_array().unwrap().iter().map(|x| x["device"].as_str().unwrap()).collect();
    assert_eq!(ranked, vec![P0, P1], "{d}");
    assert_eq!(d["profile"], "passthrough");
    let e = a.call("placement.dry_run", json!({"passthrough": true, "address": P2})).unwrap_err();
    assert_eq!(e.data_code, "iommu_group_conflict", "{e}");
    let e = a.call("placement.dry_run", json!({"passthrough": true, "address": "0000:99:00.0"})).unwrap_err();
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert!(a.claims().is_empty(), "a dry run claims nothing");
}

// ------------------------------------------------------------------------ crashes

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Create,
    Stop,
    Delete,
}

/// Safety right after a crash and at every later look: a GPU with no claim has every
/// function on its boot driver (never a half-bound group that looks free), and the
/// bystander on p1 keeps its QEMU and its whole group on vfio-pci.
fn pt_safety(a: &Agent, bystander_pid: i32, phase: &str) -> Vec<String> {
    let mut v = Vec::new();
    if a.claim(P0).is_none() && drivers(a, P0) != boot_p0() {
        v.push(format!("[{phase}] p0 has no claim but is bound {:?}", drivers(a, P0)));
    }
    if drivers(a, P1) != pairs(&[(P1, "vfio-pci"), (P1A, "vfio-pci")]) {
        v.push(format!("[{phase}] the bystander's group changed: {:?}", drivers(a, P1)));
    }
    if !a.live_qemus().iter().any(|q| q.pid == bystander_pid) {
        v.push(format!("[{phase}] the bystander's QEMU {bystander_pid} is gone"));
    }
    v
}

/// One crash case: arm `fp`, run `op` on `vm` (p0; the agent aborts), check safety, restart
/// cleanly, run passes until the end state (retrying an interrupted stop/delete as a client
/// would), and check it: `vm` stopped or gone with group 40 on its boot drivers and no
/// claim of p0, the bystander untouched.
fn crash_case(fp: &str, op: Op) {
    assert_failpoints_built();
    let mut a = agent("claim_grace_s = 2\n");
    let by = create_pt(&a, "by", Some(P1)).unwrap();
    let by_pid = a.qemu_pid(by["id"].as_str().unwrap());
    if op != Op::Create {
        create_pt(&a, "vm", Some(P0)).unwrap();
    }
    a.restart_with_failpoints(Some(&format!("{fp}=return"))).unwrap();
    a.wait_ready().unwrap();
    let r = match op {
        Op::Create => create_pt(&a, "vm", Some(P0)),
        Op::Stop => a.call("instance.stop", json!({"ref": "vm", "force": true})),
        Op::Delete => a.call("instance.delete", json!({"ref": "vm"})),
    };
    assert!(matches!(&r, Err(e) if is_transport(e)), "{fp}/{op:?}: expected the agent to abort, got {r:?}");
    assert!(a.wait_agent_gone(Duration::from_secs(10)), "{fp}/{op:?}: the agent did not die");
    let mut violations = pt_safety(&a, by_pid, "after the crash");
    a.restart_with_failpoints(None).unwrap();
    violations.extend(pt_safety(&a, by_pid, "after the restart"));
    let settled = wait_for(Duration::from_secs(40), || {
        a.pass();
        let state = a.call("instance.get", json!({"ref": "vm"})).ok().map(|v| v["state"].clone());
        match state.as_ref().and_then(|s| s.as_str()) {
            Some("running") if op == Op::Create => {
                // A create recovered as running keeps its group (it is not a leak).
                (a.claim(P0).is_some()).then_some(())
            }
            Some("stopped") | None => (a.claim(P0).is_none()).then_some(()),
            _ => None,
        }
    });
    violations.extend(pt_safety(&a, by_pid, "end of window"));
    if settled.is_none() {
        violations.push(format!(
            "[end of window] not settled: vm {:?}, claim {:?}",
            a.call("instance.get", json!({"ref": "vm"})).map(|v| v["state"].clone()),
            a.claim(P0)
        ));
    }
    // A client retries an interrupted stop/delete; then group 40 is on its boot drivers.
    match op {
        Op::Stop => {
            a.call("instance.stop", json!({"ref": "vm", "force": true})).ok();
        }
        Op::Delete => {
            a.call("instance.delete", json!({"ref": "vm"})).ok();
        }
        Op::Create => {
            a.call("instance.stop", json!({"ref": "vm", "force": true})).ok();
        }
    }
    if drivers(&a, P0) != boot_p0() || a.claim(P0).is_some() {
        violations.push(format!("[end state] group 40 {:?}, claim {:?}", drivers(&a, P0), a.claim(P0)));
    }
    violations.extend(pt_safety(&a, by_pid, "end state"));
    assert!(violations.is_empty(), "{fp}/{op:?}:\n{}\n{}", violations.join("\n"), tail(&a.log(), 30));
}

/// The passthrough write sites of the crash matrix: mid-bind (a function unbound, not yet
/// on vfio-pci), after the reset, mid-give-back (a function unbound from vfio-pci, not yet
/// on its driver), and the release path's own points for a passthrough claim.
#[test]
fn crash_mid_bind_during_create() {
    crash_case("pt_bind_after_unbind", Op::Create);
}

#[test]
fn crash_after_claim_commit_during_a_passthrough_create() {
    crash_case("after_claim_commit", Op::Create);
}

#[test]
fn crash_after_the_reset_during_stop() {
    crash_case("pt_release_after_reset", Op::Stop);
}

#[test]
fn crash_mid_give_back_during_stop() {
    crash_case("pt_release_after_unbind", Op::Stop);
}

#[test]
fn crash_mid_give_back_during_delete() {
    crash_case("pt_release_after_unbind", Op::Delete);
}

#[test]
fn crash_after_configure_during_a_passthrough_create() {
    crash_case("after_configure", Op::Create);
}

#[test]
fn crash_release_before_write_during_a_passthrough_delete() {
    crash_case("release_before_write", Op::Delete);
}

// ------------------------------------------------------------ Cloud Hypervisor, CLI

/// Cloud Hypervisor carries a passthrough GPU: `vm.create` gets one `devices[]` entry per
/// function of the group (by sysfs path, `vfio_attach = "device"`), the GPU first; stop
/// gives the group back.
#[test]
fn cloud_hypervisor_gets_one_device_per_function() {
    let ch = ChWrapper::fake();
    let (k, v) = ch.setting();
    let a = Agent::start_tuned(
        AgentOptions { model: "pt-2", extra: PT, ..Default::default() },
        None,
        &[(k, v.as_str()), ("vfio_attach", "\"device\"")],
    )
    .unwrap();
    let v = a
        .call(
            "instance.create",
            json!({"name": "c", "image": "demo", "hypervisor": "cloud-hypervisor",
                   "gpu": {"passthrough": true, "address": P0}}),
        )
        .unwrap();
    assert_eq!((v["hypervisor"].as_str(), v["state"].as_str()), (Some("cloud-hypervisor"), Some("running")), "{v}");
    let create = ch.requests().into_iter().find(|r| r["path"] == "/api/v1/vm.create").expect("vm.create");
    let root = a.sim.path().display().to_string();
    assert_eq!(
        create["body"]["devices"],
        json!([
            {"path": format!("{root}/sys/bus/pci/devices/{P0}/"), "id": "gpu0"},
            {"path": format!("{root}/sys/bus/pci/devices/{P0A}/"), "id": "gpu1"}
        ]),
        "{create}"
    );
    assert_eq!(drivers(&a, P0), pairs(&[(P0, "vfio-pci"), (P0A, "vfio-pci"), (BRIDGE, "pcieport")]));
    // A running VM with a whole GPU saves no memory under Cloud Hypervisor either: the VFIO
    // device's state cannot be saved; nothing is paused.
    for m in ["instance.standby", "instance.snapshot"] {
        let e = a.err(m, json!({"ref": "c"}));
        assert_eq!((e.code, e.data_code.as_str()), (409, "unsupported_with_gpu"), "{m}: {e}");
    }
    assert!(!ch.requests().iter().any(|r| r["path"] == "/api/v1/vm.pause"), "nothing paused");
    a.ok("instance.stop", json!({"ref": "c", "force": true}));
    assert_eq!(drivers(&a, P0), boot_p0());
    assert!(a.claims().is_empty());
}

/// Issue 18 finding 6: Cloud Hypervisor on an agent with `vfio_attach = "hold-fd"` cannot
/// be handed a passthrough GPU (it takes devices by sysfs path only): the create is refused
/// `hypervisor_unsupported` before any driver change — no binding write, no claim, no
/// record — and `agent.health` does not list `passthrough` among its capabilities there.
#[test]
fn a_cloud_hypervisor_passthrough_create_under_hold_fd_is_refused_before_any_driver_change() {
    let ch = ChWrapper::fake();
    let (k, v) = ch.setting();
    let a =
        Agent::start_tuned(AgentOptions { model: "pt-2", extra: PT, ..Default::default() }, None, &[(k, v.as_str())])
            .unwrap();
    let before = a.sim_writes().len();
    let e = a.err(
        "instance.create",
        json!({"name": "c", "image": "demo", "hypervisor": "cloud-hypervisor", "gpu": {"passthrough": true, "address": P0}}),
    );
    assert_eq!((e.code, e.data_code.as_str()), (400, "hypervisor_unsupported"), "{e}");
    assert!(e.message.contains("hold-fd"), "says why: {}", e.message);
    assert_eq!(binding_writes(&a.sim_writes()[before..]), vec![], "BUG: the group was rebound");
    assert_eq!(drivers(&a, P0), boot_p0());
    assert!(a.claims().is_empty() && a.instance_records().is_empty(), "nothing left");
    let h = a.ok("agent.health", json!({}));
    let chv = h["hypervisors"].as_array().unwrap().iter().find(|x| x["name"] == "cloud-hypervisor").unwrap().clone();
    assert!(!chv["capabilities"].to_string().contains("passthrough"), "{chv}");
}

/// Issue 18 finding 6: a placement plugin that ranks none of the free passthrough GPUs
/// gets `no_capacity` that says so — never "no passthrough GPU is free" — and names the
/// free GPUs it left out.
#[test]
fn no_capacity_says_the_placement_plugin_ranked_no_free_passthrough_gpu() {
    let a = Agent::start_with(AgentOptions {
        model: "pt-2",
        extra: PT,
        placement: Some(fixture_plugin("rank-fixed.wat")),
        ..Default::default()
    })
    .unwrap();
    let e = create_pt(&a, "x", None).unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert!(!e.message.contains("is free"), "BUG: says no GPU is free: {}", e.message);
    assert!(e.message.contains("rank-fixed") && e.message.contains("ranked none"), "{}", e.message);
    assert!(e.message.contains(P0) && e.message.contains(P1), "names the free GPUs it left out: {}", e.message);
    assert!(a.claims().is_empty());
}

/// The CLI: `create --gpu passthrough=<BDF>`, `gpus` (the group, each function's driver
/// and original), `profiles` (passthrough counts), `dry-run passthrough`.
#[test]
fn the_cli_creates_lists_and_counts_passthrough_gpus() {
    let a = agent("");
    let text = |o: std::process::Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let p = text(a.cli(&["profiles"]));
    assert!(p.contains("passthrough GPUs: total 3 claimed 0 allocatable 2 quarantined 0 dirty 0 refused 1"), "{p}");
    let c = text(a.cli(&["create", "x", "--image", "demo", "--gpu", &format!("passthrough={P1}")]));
    assert!(c.contains(P1), "{c}");
    let g = text(a.cli(&["gpus"]));
    assert!(g.contains(&format!("GPU {P1}")) && g.contains("passthrough, IOMMU group 41"), "{g}");
    let row = g.lines().find(|l| l.starts_with(P1A)).unwrap_or_else(|| panic!("{g}"));
    assert_eq!(row.split_whitespace().collect::<Vec<_>>(), vec![P1A, "vfio-pci", "snd_hda_intel"], "{g}");
    assert!(g.contains(NIC) && g.contains("not offered: its IOMMU group 42 also holds 0000:85:00.0"), "{g}");
    let p = text(a.cli(&["profiles"]));
    assert!(p.contains("passthrough GPUs: total 3 claimed 1 allocatable 1"), "{p}");
    let d: Value = serde_json::from_str(&text(a.cli(&["dry-run", "passthrough"]))).unwrap();
    assert_eq!(d["ranked"], json!([{"device": P0, "gpu": P0, "dirty": false}]), "{d}");
    let e = a.cli(&["create", "y", "--image", "demo", "--gpu", &format!("passthrough={P1}")]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("no_capacity"), "{}", String::from_utf8_lossy(&e.stderr));
}

/// A mixed host (`l40s-pt`: an L40S with 16 VFs and two passthrough GPUs): vGPUs and
/// whole GPUs side by side, each counted in its own kind; a passthrough GPU is never a
/// vGPU parent, and `managed_gpus` naming one is refused at start.
#[test]
fn a_mixed_host_runs_vgpus_and_whole_gpus_side_by_side() {
    let a = Agent::start_with(AgentOptions {
        model: "l40s-pt",
        extra: "passthrough_gpus = [\"0000:82:00.0\", \"0000:83:00.0\"]\n",
        ..Default::default()
    })
    .unwrap();
    let r = resources(&a);
    assert_eq!(r["mode"], "vendor_vfio", "{r}");
    assert_eq!((r["devices"]["total"].as_u64(), r["devices"]["allocatable"].as_u64()), (Some(16), Some(16)), "{r}");
    assert_eq!(
        (r["passthrough"]["total"].as_u64(), r["passthrough"]["allocatable"].as_u64()),
        (Some(2), Some(2)),
        "{r}"
    );
    let v = a.create_gpu("v", "L40S-2Q").unwrap();
    assert_eq!(v["gpu"]["gpu"], "0000:41:00.0", "{v}");
    let p = create_pt(&a, "p", None).unwrap();
    assert_eq!(p["gpu"]["device"], P0, "{p}");
    let r = resources(&a);
    assert_eq!(r["devices"]["claimed"], 1, "{r}");
    assert_eq!(
        (r["passthrough"]["claimed"].as_u64(), r["passthrough"]["allocatable"].as_u64()),
        (Some(1), Some(1)),
        "{r}"
    );
    let g = a.ok("gpu.list", json!({}));
    let kinds: Vec<(String, bool)> = g["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["address"].as_str().unwrap().to_string(), x["passthrough"].is_object()))
        .collect();
    assert_eq!(kinds, vec![("0000:41:00.0".into(), false), (P0.into(), true), (P1.into(), true)], "{g}");
    // A GPU is a vGPU parent or a passthrough GPU, never both.
    let cfg = a.dir.path().join("both.toml");
    std::fs::write(
        &cfg,
        format!(
            "host_root = {:?}\ndata_dir = {:?}\nsocket = {:?}\nmanaged_gpus = [\"{P0}\"]\npassthrough_gpus = [\"{P0}\"]\n",
            a.sim.path(),
            a.dir.path().join("d2"),
            a.dir.path().join("s2.sock")
        ),
    )
    .unwrap();
    let (st, out) = serve_expecting_exit(&cfg, Duration::from_secs(30)).unwrap();
    assert!(!st.success() && out.contains("never both"), "{st}: {out}");
}

// ------------------------------------------------------- regressions (outside review)

/// A bind write that outlives its timeout (the kernel's unbind can block): the claim is
/// kept until the write has returned and the group can be given back — never a GPU with no
/// claim that is not on its boot drivers (which a late unbind would leave behind).
#[test]
fn a_bind_write_that_times_out_keeps_the_claim_until_it_returns() {
    let a = agent("");
    a.sim.ctl(&["delay-write", "sys/bus/pci/drivers/nvidia/unbind", "13000", "--times", "1"]).unwrap();
    let e = create_pt(&a, "t", Some(P0)).unwrap_err();
    assert!(matches!(e.data_code.as_str(), "passthrough_bind_failed" | "vgpu_cleanup_pending"), "{e}");
    assert!(e.message.contains("did not return within 10 s"), "{e}");
    wait_for(Duration::from_secs(60), || {
        let (claim, d) = (a.claim(P0), drivers(&a, P0));
        assert!(claim.is_some() || d == boot_p0(), "no claim, yet bound {d:?}");
        if claim.is_some() {
            a.pass();
            if a.instance_names().contains(&"t".to_string()) {
                let _ = a.call("instance.delete", json!({"ref": "t"}));
            }
        }
        (a.claim(P0).is_none() && drivers(&a, P0) == boot_p0()).then_some(())
    })
    .unwrap_or_else(|| panic!("never given back: claim {:?}, {:?}", a.claim(P0), drivers(&a, P0)));
    assert_eq!(pt_entry(&a.state(), P0)["functions"][0]["driver_override"], Value::Null);
    create_pt(&a, "t2", Some(P0)).unwrap();
}

/// `passthrough_gpus` naming a function that is not a GPU (the audio function `.1`): it is
/// never handed out, and says why.
#[test]
fn a_configured_function_that_is_not_a_gpu_is_never_handed_out() {
    let a = Agent::start_with(AgentOptions {
        model: "pt-2",
        extra: "passthrough_gpus = [\"0000:82:00.0\", \"0000:82:00.1\"]\n",
        ..Default::default()
    })
    .unwrap();
    let e = create_pt(&a, "x", Some(P0A)).unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert!(e.message.contains("not a GPU"), "{e}");
    assert_eq!(resources(&a)["passthrough"]["allocatable"], 1);
    assert!(a.claims().is_empty());
}

/// A function rebound to a host driver under a live VM is reported (in `gpu.list`), never
/// repaired.
#[test]
fn a_group_rebound_under_a_live_vm_is_reported() {
    let a = agent("");
    create_pt(&a, "v", Some(P0)).unwrap();
    a.sim.ctl(&["bind-host", P0A, "snd_hda_intel"]).unwrap();
    let g = a.ok("gpu.list", json!({}));
    let d = g["gpus"].as_array().unwrap().iter().find(|x| x["address"] == P0).map(|x| x["devices"][0].clone()).unwrap();
    assert!(d["type_mismatch"].as_str().is_some_and(|m| m.contains("rebound it under the VM")), "{d}");
    assert_eq!(d["state"], "claimed");
    assert!(a.claim(P0).is_some());
}

/// Create-time EIO on a bind twice in a row makes the GPU `suspect` (`create_eio`), as on a
/// VF — the give-back that follows each failure does not wipe the strike.
#[test]
fn two_bind_eios_in_a_row_make_the_gpu_suspect() {
    let a = agent("");
    for name in ["s1", "s2"] {
        a.sim
            .ctl(&["fail-write", &format!("sys/bus/pci/devices/{P1A}/driver_override"), "EIO", "--times", "1"])
            .unwrap();
        let e = create_pt(&a, name, Some(P1)).unwrap_err();
        assert_eq!(e.data_code, "passthrough_bind_failed", "{e}");
    }
    let g = a.ok("gpu.list", json!({}));
    let d = g["gpus"].as_array().unwrap().iter().find(|x| x["address"] == P1).map(|x| x["devices"][0].clone()).unwrap();
    assert_eq!(d["quarantine"]["reason"], "create_eio", "{d}");
    assert_eq!(d["quarantine"]["quarantined"], false, "suspect, not quarantined: {d}");
}
