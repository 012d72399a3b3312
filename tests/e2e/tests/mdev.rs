//! End to end on an mdev host (`l40s-mdev`: every VF is an mdev parent): create makes a
//! fresh transient mdev under the claimed parent, QEMU holds its group node, delete and
//! stop remove it, a restart makes a new one, and foreign mdevs are never touched.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

const READY: &str = "gpuvisor-guest: ready";
const BOOT: Duration = Duration::from_secs(90);
const FOREIGN: &str = "6a7d6a8c-1111-4c1b-a0c4-6f0d0e9b7b02";

/// The simulator's mdev with this UUID (panics if absent).
fn sim_mdev(a: &Agent, uuid: &str) -> Value {
    sim_mdevs(&a.state())
        .into_iter()
        .find(|m| m["uuid"] == uuid)
        .unwrap_or_else(|| panic!("no mdev {uuid} in the simulator: {:?}", sim_mdevs(&a.state())))
}

/// The claim record naming this mdev UUID (panics unless exactly one).
fn claim_of_mdev(a: &Agent, uuid: &str) -> Value {
    let claims: Vec<Value> = a.claims().into_iter().filter(|c| c["mdev_uuid"] == uuid).collect();
    assert_eq!(claims.len(), 1, "one claim holds mdev {uuid}: {:?}", a.claims());
    claims[0].clone()
}

/// Asserts `inst` runs on a fresh gpuvisor-made mdev whose claim, record and simulator entry
/// agree; returns (uuid, parent VF).
fn assert_on_own_mdev(a: &Agent, inst: &Value, profile_type: u64) -> (String, String) {
    assert_eq!(inst["state"], "running", "{inst}");
    let gpu = &inst["gpu"];
    assert_eq!(gpu["framework"], "mdev", "{inst}");
    let uuid = gpu["mdev_uuid"].as_str().unwrap_or_else(|| panic!("no gpu.mdev_uuid: {inst}")).to_string();
    assert!(is_uuid(&uuid), "mdev_uuid {uuid:?} is not a UUID");
    assert_ne!(uuid, inst["id"].as_str().unwrap(), "the mdev UUID is fresh, not the instance id");
    let parent = gpu["device"].as_str().unwrap_or_else(|| panic!("no gpu.device: {inst}")).to_string();
    assert!(
        gpu["device_path"].as_str().unwrap().ends_with(&format!("sys/bus/mdev/devices/{uuid}")),
        "device_path names the mdev: {gpu}"
    );

    // The simulator has that mdev under that parent, made by gpuvisor (not foreign).
    let m = sim_mdev(a, &uuid);
    assert_eq!(m["parent"], parent.as_str(), "the mdev sits under the claimed parent VF: {m}");
    assert_eq!(m["type"].as_u64(), Some(profile_type), "{m}");
    assert_eq!(m["foreign"], false, "{m}");

    // The claim is for the parent VF, holds the UUID, names the instance.
    let c = claim_of_mdev(a, &uuid);
    assert_eq!(c["framework"], "mdev", "{c}");
    assert_eq!(c["device"], parent.as_str(), "mdev on a VF: the claim's device is the parent VF: {c}");
    assert_eq!(c["instance_id"], inst["id"], "{c}");

    // gpuvisor recorded the mdev as its own.
    let rec: Value = serde_json::from_str(
        &std::fs::read_to_string(a.data_dir.join("mdevs").join(format!("{uuid}.json"))).expect("mdevs/<uuid>.json"),
    )
    .unwrap();
    assert_eq!(rec["parent"], parent.as_str(), "{rec}");
    assert_eq!(rec["instance_id"], inst["id"], "{rec}");
    (uuid, parent)
}

/// Asserts QEMU of `inst` holds the mdev's `dev/vfio/<group>` node and is the simulator's
/// only handle on it.
fn assert_qemu_holds_mdev(a: &Agent, inst: &Value, uuid: &str) {
    let id = inst["id"].as_str().unwrap();
    let qemu = qemu_of(id);
    assert_eq!(qemu.len(), 1, "one QEMU for {id}");
    let m = sim_mdev(a, uuid);
    let group = m["group"].as_u64().expect("mdev group");
    let node = a.sim.path().join(format!("dev/vfio/{group}")).display().to_string();
    assert!(fd_targets(qemu[0]).contains(&node), "QEMU {} does not hold {node}: {:?}", qemu[0], fd_targets(qemu[0]));
    let handles = m["handles"].as_array().unwrap();
    assert_eq!(handles.len(), 1, "one handle on mdev {uuid}: {m}");
    assert_eq!(handles[0]["pid"].as_i64().unwrap() as i32, qemu[0], "the handle is QEMU's own");
}

#[test]
fn create_makes_a_fresh_mdev_per_instance_and_delete_removes_every_trace() {
    let a = Agent::start("l40s-mdev").unwrap();

    let one = a.create_gpu("one", "L40S-2Q").unwrap();
    let (u1, p1) = assert_on_own_mdev(&a, &one, 1148);
    assert_eq!(p1, "0000:41:00.4", "spread on an idle host: first GPU, first parent");
    assert_qemu_holds_mdev(&a, &one, &u1);
    let log = a.wait_serial(&one, READY, BOOT).unwrap();
    assert!(log.contains("pci: "), "the guest lists its PCI devices");

    let two = a.create_gpu("two", "L40S-2Q").unwrap();
    let (u2, p2) = assert_on_own_mdev(&a, &two, 1148);
    assert_ne!(u1, u2, "each instance gets its own mdev UUID");
    assert_eq!(p2, "0001:81:00.4", "spread: the second mdev goes under the idle GPU");
    assert_qemu_holds_mdev(&a, &two, &u2);
    assert_eq!(sim_mdevs(&a.state()).len(), 2);
    assert_eq!(a.data_files("mdevs"), {
        let mut v = vec![format!("{u1}.json"), format!("{u2}.json")];
        v.sort();
        v
    });

    // Delete both: the mdevs are gone from the host and from gpuvisor's records.
    a.ok("instance.delete", json!({"ref": "one"}));
    let st = a.state();
    assert!(sim_mdevs(&st).iter().all(|m| m["uuid"] != u1.as_str()), "one's mdev removed: {:?}", sim_mdevs(&st));
    assert!(sim_mdevs(&st).iter().any(|m| m["uuid"] == u2.as_str()), "two's mdev untouched");
    a.ok("instance.delete", json!({"ref": "two"}));
    let st = a.state();
    assert!(sim_mdevs(&st).is_empty(), "no mdev left: {:?}", sim_mdevs(&st));
    assert!(a.data_files("mdevs").is_empty(), "no mdev record left: {:?}", a.data_files("mdevs"));
    assert!(a.claims().is_empty(), "no claim left: {:?}", a.claims());
    assert!(a.qemu_pids().is_empty(), "no QEMU left");
    assert!(a.instance_names().is_empty());
    // The removals were writes of `1` to each mdev's own `remove` (retried while the
    // simulator's teardown lag answers EBUSY), one success each.
    let removes: Vec<_> = a.sim_writes().into_iter().filter(|(p, _, _)| p.ends_with("/remove")).collect();
    assert!(removes.iter().all(|(_, v, _)| v == "1"), "{removes:?}");
    for u in [&u1, &u2] {
        let ok = removes.iter().filter(|(p, _, r)| p == &format!("sys/bus/mdev/devices/{u}/remove") && r == "ok");
        assert_eq!(ok.count(), 1, "one successful remove of {u}: {removes:?}");
    }
    assert_eq!(removes.iter().filter(|(_, _, r)| r == "ok").count(), 2, "{removes:?}");
}

#[test]
fn stop_removes_the_mdev_and_start_makes_a_new_uuid() {
    let a = Agent::start("l40s-mdev").unwrap();
    let inst = a.create_gpu("vm", "L40S-4Q").unwrap();
    let (old, _) = assert_on_own_mdev(&a, &inst, 1150);

    let stopped = a.ok("instance.stop", json!({"ref": "vm", "force": true}));
    assert_eq!(stopped["state"], "stopped");
    assert_eq!(stopped["gpu"]["profile"], "L40S-4Q", "the profile is kept");
    assert!(stopped["gpu"]["mdev_uuid"].is_null(), "no mdev while stopped: {}", stopped["gpu"]);
    assert!(sim_mdevs(&a.state()).is_empty(), "stop removed the mdev: {:?}", sim_mdevs(&a.state()));
    assert!(a.data_files("mdevs").is_empty(), "{:?}", a.data_files("mdevs"));
    assert!(a.claims().is_empty(), "{:?}", a.claims());

    let again = a.ok("instance.start", json!({"ref": "vm"}));
    let (new, _) = assert_on_own_mdev(&a, &again, 1150);
    assert_ne!(new, old, "a restart makes a new mdev, never reuses the old UUID");
    assert_eq!(again["id"], inst["id"], "the instance UUID is stable across restarts");
    assert_eq!(sim_mdevs(&a.state()).len(), 1, "only the new mdev exists");
    assert_qemu_holds_mdev(&a, &again, &new);

    a.ok("instance.delete", json!({"ref": "vm"}));
    assert!(sim_mdevs(&a.state()).is_empty());
    assert!(a.claims().is_empty());
}

#[test]
fn a_foreign_mdev_is_never_removed_and_its_parent_is_never_placed_on() {
    let a = Agent::start("l40s-mdev").unwrap();
    a.sim.ctl(&["create-mdev", "0000:41:00.4", "1148", FOREIGN]).unwrap();

    // Placement skips the foreign mdev's parent, in a dry run and in a real create.
    let dry = a.ok("placement.dry_run", json!({"profile": "L40S-2Q"}));
    let ranked: Vec<&str> = dry["ranked"].as_array().unwrap().iter().map(|r| r["device"].as_str().unwrap()).collect();
    assert!(!ranked.is_empty(), "{dry}");
    assert!(!ranked.contains(&"0000:41:00.4"), "the foreign mdev's parent is not a candidate: {ranked:?}");
    let inst = a.create_gpu("mine", "L40S-2Q").unwrap();
    let (mine, parent) = assert_on_own_mdev(&a, &inst, 1148);
    assert_ne!(parent, "0000:41:00.4", "never placed on the foreign mdev's parent");
    assert_eq!(a.claims().len(), 1);
    assert!(a.claims().iter().all(|c| c["device"] != "0000:41:00.4"));

    // Deleting gpuvisor's own instance removes only its own mdev.
    a.ok("instance.delete", json!({"ref": "mine"}));
    let st = a.state();
    let left: Vec<String> = sim_mdevs(&st).iter().map(|m| m["uuid"].as_str().unwrap().to_string()).collect();
    assert_eq!(left, vec![FOREIGN], "only the foreign mdev remains (ours {mine} removed)");

    // An agent restart (its startup pass) leaves the foreign mdev alone too.
    let mut a = a;
    a.kill_agent();
    a.spawn().unwrap();
    a.ok("resources.get", json!({}));
    let st = a.state();
    let foreign = sim_mdevs(&st).into_iter().find(|m| m["uuid"] == FOREIGN);
    assert!(foreign.is_some(), "the foreign mdev survived the restart: {:?}", sim_mdevs(&st));
    assert!(
        !a.sim_writes().iter().any(|(p, _, _)| p.contains(FOREIGN)),
        "gpuvisor never wrote to the foreign mdev: {:?}",
        a.sim_writes()
    );
    assert!(a.data_files("mdevs").is_empty(), "gpuvisor has no record of the foreign mdev");
}

#[test]
fn a_foreign_mdev_parent_is_listed_as_unavailable_not_free() {
    let a = Agent::start("l40s-mdev").unwrap();
    let before = a.ok("resources.get", json!({}));
    assert_eq!(before["devices"]["allocatable"], 32, "{before}");
    a.sim.ctl(&["create-mdev", "0000:41:00.4", "1148", FOREIGN]).unwrap();

    // docs/design/scenarios.md S061: a foreign mdev's parent "is shown as foreign and unavailable, not free".
    let gpus = a.ok("gpu.list", json!({}));
    let dev = gpus["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["devices"].as_array().unwrap().iter())
        .find(|d| d["address"] == "0000:41:00.4")
        .cloned()
        .expect("0000:41:00.4 in gpu.list");
    assert_eq!(dev["creatable"], json!([]), "{dev}");
    let after = a.ok("resources.get", json!({}));
    assert_eq!(after["devices"]["allocatable"], 31, "the foreign parent is not allocatable: {}", after["devices"]);
    assert_ne!(dev["state"], "free", "the foreign mdev's parent is not free: {dev}");
}

// ------------------------------------------------------------------------------------- S060

/// S060: the mdev sweep removes only its own old, idle, unclaimed mdevs. On host M (two
/// GPUs, every VF an mdev parent) gpuvisor made five mdevs; then the agent is stopped and the
/// store edited so that: Ua is unclaimed and old but held open through its group node; Ub is
/// unclaimed and young; Uc is unclaimed, old and idle; Ud is unclaimed, old and idle but on g1,
/// which the new config no longer manages; Ue is claimed by running E. The restart's pass
/// (and one more) removes Uc only.
#[test]
fn s060_the_mdev_sweep_removes_only_its_own_old_idle_unclaimed_mdevs() {
    const G0: &str = "0000:41:";
    // Paused QEMUs: the sweep needs VMMs holding their mdevs, not seven booting guests.
    let wrap = QemuWrapper::new();
    let extra = format!("claim_grace_s = 60\nreconcile_interval_s = 3600\n{}", wrap.extra());
    let mut a = Agent::start_with(AgentOptions { model: "l40s-mdev", extra: &extra, ..Default::default() }).unwrap();
    // Spread alternates the GPUs: four mdevs on g0 (roles a, b, c, e) and three on g1 (d, and
    // two that are deleted normally).
    let mut g0 = Vec::new();
    let mut g1 = Vec::new();
    for i in 0..7 {
        let inst = a.create_gpu(&format!("i{i}"), "L40S-1Q").unwrap();
        let dev = inst["gpu"]["device"].as_str().unwrap().to_string();
        if dev.starts_with(G0) {
            g0.push(inst)
        } else {
            g1.push(inst)
        }
    }
    assert_eq!((g0.len(), g1.len()), (4, 3), "spread alternates the two GPUs");
    for extra in &g1[1..] {
        a.ok("instance.delete", json!({"ref": extra["id"]}));
    }
    let role = |i: &Value| {
        (
            i["id"].as_str().unwrap().to_string(),
            i["gpu"]["mdev_uuid"].as_str().unwrap().to_string(),
            i["gpu"]["device"].as_str().unwrap().to_string(),
        )
    };
    let (ua, ub, uc, ue, ud) = (role(&g0[0]), role(&g0[1]), role(&g0[2]), role(&g0[3]), role(&g1[0]));

    // The agent goes away; the VMs of a, b, c and d die; a, b, c, d lose record and claim.
    a.kill_agent();
    let ids = [&ua.0, &ub.0, &uc.0, &ud.0];
    for q in a.live_qemus() {
        if q.instance_id.as_ref().is_some_and(|id| ids.contains(&id)) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(q.pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
    wait_for(Duration::from_secs(10), || (a.qemu_pids().len() == 1).then_some(())).expect("only E's QEMU left");
    for (id, uuid, parent) in [&ua, &ub, &uc, &ud] {
        std::fs::remove_dir_all(a.data_dir.join("instances").join(id)).unwrap();
        std::fs::remove_file(a.data_dir.join("claims").join(format!("{parent}.json"))).unwrap();
        // Old (made long before claim_grace) except Ub.
        if uuid != &ub.1 {
            let p = a.data_dir.join("mdevs").join(format!("{uuid}.json"));
            let mut rec: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            rec["created_boottime_ms"] = json!(boottime_now_ms().saturating_sub(600_000));
            std::fs::write(&p, serde_json::to_vec(&rec).unwrap()).unwrap();
        }
    }
    // Ua is held open through its group node by another process.
    let group = sim_mdev(&a, &ua.1)["group"].as_u64().unwrap();
    let node = a.sim.path().join(format!("dev/vfio/{group}"));
    let mut holder =
        a.ns.command(helper_binary()).arg("hold").arg(&node).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("holding"), "the holder opened {}: {line:?}", node.display());
    // g1 is no longer managed.
    let cfg = std::fs::read_to_string(&a.config_path).unwrap();
    std::fs::write(&a.config_path, format!("managed_gpus = [\"0000:41:00.0\"]\n{cfg}")).unwrap();

    let seq = last_seq(&a.state());
    a.restart().unwrap(); // its startup pass is the pass of the scenario
    let present = |a: &Agent| -> Vec<String> {
        sim_mdevs(&a.state()).iter().map(|m| m["uuid"].as_str().unwrap().to_string()).collect()
    };
    // One more pass, or a few when Uc was still busy (a retry; see below).
    let mut rep = a.pass();
    for _ in 0..10 {
        if !present(&a).contains(&uc.1) {
            break;
        }
        rep = a.pass();
    }
    let present = present(&a);
    assert!(!present.contains(&uc.1), "Uc (old, idle, unclaimed, managed) is removed: {present:?}; pass {rep}");
    for (what, u) in
        [("Ua (held)", &ua.1), ("Ub (young)", &ub.1), ("Ud (unmanaged GPU)", &ud.1), ("Ue (claimed)", &ue.1)]
    {
        assert!(present.contains(u), "{what} {u} survives: {present:?}; pass {rep}");
    }
    let removes: Vec<_> = log_after(&a.state(), seq)
        .into_iter()
        .filter(|e| e["op"] == "write" && e["path"].as_str().unwrap_or("").ends_with("/remove"))
        .collect();
    // Every remove write is Uc's, and exactly one succeeded. A first write may find Uc busy
    // (the simulator's teardown lag after its QEMU's SIGKILL, which a busy machine can
    // stretch past the restart) and be retried by the next pass.
    let uc_remove = format!("sys/bus/mdev/devices/{}/remove", uc.1);
    assert!(removes.iter().all(|w| w["path"] == uc_remove.as_str()), "only Uc's remove is written: {removes:?}");
    let done: Vec<_> = removes.iter().filter(|w| w["result"] == "ok").collect();
    assert_eq!(done.len(), 1, "one remove write succeeded, Uc's: {removes:?}");
    assert!(removes.iter().all(|w| w["result"] == "ok" || w["result"] == "EBUSY"), "{removes:?}");
    assert_eq!(metric(&a.metrics(), "gpuvisor_vgpu_orphans_released_total", &[("framework", "mdev")]), Some(1.0));
    assert!(!a.data_files("mdevs").contains(&format!("{}.json", uc.1)), "Uc's record is gone");
    assert_eq!(a.ok("instance.get", json!({"ref": ue.0}))["state"], "running", "E runs on");
    let _ = holder.kill();
    let _ = holder.wait();
}

// ------------------------------------------------------------------------------------- S062

/// S062: mdev placement follows parent load. Two of g0's VFs hold 1Q mdevs of running
/// instances and g1 has none: a new 1Q mdev goes under a g1 VF, and its claim (for that VF,
/// holding the new UUID) is durable before the UUID is written to `create` — checked while
/// the simulator holds that write (`delay-write`, logged as `write-delayed`).
#[test]
fn s062_mdev_placement_follows_parent_load_and_claims_before_create() {
    let wrap = QemuWrapper::new();
    let a = Agent::start_with(AgentOptions { model: "l40s-mdev", extra: &wrap.extra(), ..Default::default() }).unwrap();
    // Spread: g0, g1, g0; then the g1 one goes, leaving two on g0 and none on g1.
    for n in ["x0", "x1", "x2"] {
        a.create_gpu(n, "L40S-1Q").unwrap();
    }
    let x1 = a.ok("instance.get", json!({"ref": "x1"}));
    assert!(x1["gpu"]["device"].as_str().unwrap().starts_with("0001:81:"), "{x1}");
    a.ok("instance.delete", json!({"ref": "x1"}));

    a.sim.ctl(&["delay-write", "sys/class/mdev_bus/*/mdev_supported_types/*/create", "1000", "--times", "1"]).unwrap();
    let create = a.spawn_call("instance.create", json!({"name": "a", "image": "demo", "gpu": "L40S-1Q"}));
    let begun = wait_for(Duration::from_secs(20), || {
        let st = a.state();
        st["log"].as_array()?.iter().find(|e| e["op"] == "write-delayed").cloned()
    })
    .expect("the mdev create write begins");
    let path = begun["path"].as_str().unwrap().to_string();
    let parent = path.split('/').nth(3).unwrap().to_string();
    let uuid = begun["value"].as_str().unwrap().trim().to_string();
    // The claim is already on disk, for the parent VF, holding the UUID being written.
    let claim = a.claim(&parent).unwrap_or_else(|| panic!("no claim for {parent} during the create write"));
    assert_eq!(claim["mdev_uuid"], uuid.as_str(), "{claim}");
    assert!(parent.starts_with("0001:81:"), "the idle g1 is chosen, not g0 with two mdevs: {parent}");

    let answer = create.join().unwrap().unwrap();
    let inst = &answer["result"];
    assert_eq!(inst["gpu"]["device"], parent.as_str(), "{answer}");
    assert_eq!(inst["gpu"]["mdev_uuid"], uuid.as_str(), "{answer}");
    assert_on_own_mdev(&a, inst, 1147);
}

// ------------------------------------------------------------------------------------- S063

/// S063: an mdev the driver will not let go. On a one-GPU mdev host, vf0, vf1 and vf3 hold
/// mdevs of running instances, so vf2 is the only parent left; U7 on vf2 belongs to V. The
/// driver keeps U7 busy for 8 s after V's QEMU dies (`release-delay`). Then V is started
/// again and W is created while U7 still exists: V never reuses U7 and never gets a second
/// mdev on vf2 while U7 exists (it waits within a bound or gets a retryable error, then runs
/// on a fresh mdev), W never gets vf2 before U7's removal is confirmed, and the removal is
/// retried with backoff.
#[test]
fn s063_an_mdev_the_driver_will_not_let_go() {
    const VF2: &str = "0000:41:00.6";
    let wrap = QemuWrapper::new();
    let model = "framework = \"mdev\"\nrelease_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
    let a = Agent::start_with(AgentOptions { model, extra: &wrap.extra(), ..Default::default() }).unwrap();
    let mut v = Value::Null;
    for n in ["a", "b", "v", "d"] {
        let i = a.create_gpu(n, "L40S-1Q").unwrap();
        if n == "v" {
            v = i;
        }
    }
    assert_eq!(v["gpu"]["device"], VF2, "spread on one GPU: address order");
    let u7 = v["gpu"]["mdev_uuid"].as_str().unwrap().to_string();
    a.sim.ctl(&["release-delay", &u7, "8000"]).unwrap();
    let seq0 = last_seq(&a.state());

    // V's QEMU dies; a pass records it (V → stopped; its claim's one release attempt meets
    // EBUSY), then V is started again and W is created while U7 is still busy.
    let qemu = qemu_of(v["id"].as_str().unwrap());
    sigkill(qemu[0]);
    // Gone means reaped: a zombie whose threads are still exiting counts as alive.
    assert!(wait_reaped(qemu[0]), "V's QEMU is reaped");
    let rep = a.pass();
    assert_eq!(a.ok("instance.get", json!({"ref": "v"}))["state"], "stopped", "{rep}");
    assert!(sim_mdevs(&a.state()).iter().any(|m| m["uuid"] == u7.as_str()), "U7 is still there");
    let start_v = a.spawn_call("instance.start", json!({"ref": "v"}));
    let create_w = a.spawn_call("instance.create", json!({"name": "w", "image": "demo", "gpu": "L40S-1Q"}));
    // Watch the host until both answered: never two mdevs under vf2.
    while !(start_v.is_finished() && create_w.is_finished()) {
        let on_vf2: Vec<String> = sim_mdevs(&a.state())
            .iter()
            .filter(|m| m["parent"] == VF2)
            .map(|m| m["uuid"].as_str().unwrap().to_string())
            .collect();
        assert!(on_vf2.len() <= 1, "two mdevs under vf2 at once: {on_vf2:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let sv = start_v.join().unwrap().unwrap();
    let cw = create_w.join().unwrap().unwrap();
    eprintln!("start V: {sv}\ncreate W: {cw}");
    if let Some(e) = sv.get("error") {
        let code = e["data"]["code"].as_str().unwrap_or("");
        assert!(matches!(code, "gpu_release_pending" | "no_capacity"), "a retryable error: {sv}");
    }
    if let Some(e) = cw.get("error") {
        assert_eq!(e["data"]["code"], "no_capacity", "{cw}");
    }
    // Passes until U7 is gone (bounded).
    wait_for(Duration::from_secs(20), || {
        let _ = a.call("reconcile.run", json!({}));
        (!sim_mdevs(&a.state()).iter().any(|m| m["uuid"] == u7.as_str())).then_some(())
    })
    .expect("U7 is removed once the driver lets go");
    // V runs on a fresh mdev (starting it again if the first start was refused).
    let vr = match a.call("instance.get", json!({"ref": "v"})).unwrap() {
        r if r["state"] == "running" => r,
        _ => a.ok("instance.start", json!({"ref": "v"})),
    };
    assert_eq!(vr["state"], "running", "{vr}");
    assert_ne!(vr["gpu"]["mdev_uuid"], u7.as_str(), "V never reuses U7: {vr}");
    // W got vf2 only after U7's removal was confirmed.
    let log = log_after(&a.state(), seq0);
    let u7_removed = log
        .iter()
        .find(|e| e["op"] == "write" && e["path"] == format!("sys/bus/mdev/devices/{u7}/remove") && e["result"] == "ok")
        .and_then(|e| e["seq"].as_u64())
        .expect("U7's remove succeeded");
    for e in log.iter().filter(|e| {
        e["op"] == "write" && e["path"].as_str().unwrap_or("").starts_with(&format!("sys/class/mdev_bus/{VF2}/"))
    }) {
        assert!(e["seq"].as_u64().unwrap() > u7_removed, "a create on vf2 before U7 was gone: {e}");
    }
    // The removal was retried: EBUSY answers, then one success.
    let removes: Vec<&Value> =
        log.iter().filter(|e| e["op"] == "write" && e["path"] == format!("sys/bus/mdev/devices/{u7}/remove")).collect();
    assert!(removes.iter().filter(|e| e["result"] == "EBUSY").count() >= 2, "retried: {removes:?}");
    assert_eq!(removes.iter().filter(|e| e["result"] == "ok").count(), 1, "{removes:?}");
}
