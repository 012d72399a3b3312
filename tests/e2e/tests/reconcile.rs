//! End to end: the reconciler (docs/design/lifecycle.md "Reconciler", "The release guard";
//! docs/design/scenarios.md §8, §9, §12 — S038–S042, S052, S053) against the real agent, gpuvisor-sim and
//! QEMU. Crashes use the agent's failpoints (`FAILPOINTS=<name>=return` aborts it), so the
//! agent binary must be built with `--features gpuvisor/failpoints`.
//!
//! Every assertion is on the pass reports, the store files, the simulator's state dump and
//! write log, and the process table — never on log lines.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const VF0: &str = "0000:41:00.4";
const VF1: &str = "0000:41:00.5";
const VF2: &str = "0000:41:00.6";
const VF3: &str = "0000:41:00.7";
const WF0: &str = "0001:81:00.4";
const FOREIGN: &str = "6a7d6a8c-2222-4c1b-a0c4-6f0d0e9b7b03";

fn agent(model: &str, extra: &str) -> Agent {
    Agent::start_with(AgentOptions { model, extra, ..Default::default() }).unwrap()
}

fn agent_with_grace(model: &str, extra: &str, grace: &str) -> Agent {
    Agent::start_with(AgentOptions { model, extra, grace: Some(fixture_plugin(grace)), ..Default::default() }).unwrap()
}

/// Restarts the agent with `failpoint` armed, runs `op` (which must die with the agent),
/// and waits until the agent process is gone.
fn crash_during(a: &mut Agent, failpoint: &str, op: impl FnOnce(&Agent) -> Result<Value, RpcError>) {
    assert_failpoints_built();
    a.restart_with_failpoints(Some(&format!("{failpoint}=return"))).unwrap();
    a.wait_ready().unwrap();
    match op(a) {
        Err(e) if is_transport(&e) => {}
        other => panic!("expected the agent to abort at {failpoint}, got {other:?}"),
    }
    assert!(a.wait_agent_gone(Duration::from_secs(10)), "the agent did not die at {failpoint}");
}

fn instance(a: &Agent, name: &str) -> Value {
    a.ok("instance.get", json!({"ref": name}))
}

/// SIGKILLs the instance's QEMU behind the agent's back (root-namespace pid) and waits until
/// it is gone and the simulator's teardown lag on `vf` has run out.
fn kill_qemu(a: &Agent, inst: &Value, vf: &str) {
    let id = inst["id"].as_str().unwrap();
    sigkill(a.qemu_pid(id));
    wait_for(Duration::from_secs(10), || {
        a.live_qemus().iter().all(|q| q.instance_id.as_deref() != Some(id)).then_some(())
    })
    .expect("QEMU gone");
    wait_idle(a, vf);
}

/// Waits until no handle is open on `vf` and its teardown lag is over.
fn wait_idle(a: &Agent, vf: &str) {
    wait_for(Duration::from_secs(10), || {
        let e = vf_entry(&a.state(), vf);
        (e["handles"].as_array().map(|h| h.is_empty()).unwrap_or(true) && e["busy_until_ms"].is_null()).then_some(())
    })
    .unwrap_or_else(|| panic!("{vf} never became idle: {}", vf_entry(&a.state(), vf)));
}

/// Stops `name` while writes to `vf`'s type fail with `errno`: the stop succeeds and the
/// claim is retained (`release_pending`). Faults are cleared afterwards.
fn stop_retained(a: &Agent, name: &str, vf: &str, errno: &str) {
    a.sim.ctl(&["fail-write", &type_path(vf), errno, "--always"]).unwrap();
    let st = a.ok("instance.stop", json!({"ref": name, "force": true}));
    assert_eq!(st["state"], "stopped", "{st}");
    a.sim.ctl(&["clear-faults"]).unwrap();
    let c = a.claim_file(vf).unwrap_or_else(|| panic!("{name}'s claim on {vf} is retained"));
    assert_eq!(c["state"], "release_pending", "{c}");
    assert_eq!(a.vf_type(vf), 1148);
}

fn writes_since(a: &Agent, n: usize) -> Vec<(String, String, String)> {
    a.sim_writes().into_iter().skip(n).collect()
}

fn metric_of(a: &Agent, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = a.metrics();
    metric(&text, name, labels).unwrap_or_else(|| panic!("no {name}{labels:?} in:\n{text}"))
}

/// A process in the agent's PID namespace holding a VF's group node open.
struct Holder {
    child: std::process::Child,
    node: String,
}
impl Holder {
    fn open(a: &Agent, vf: &str) -> Holder {
        let group = vf_entry(&a.state(), vf)["group"].as_u64().unwrap();
        let node = a.sim.path().join(format!("dev/vfio/{group}")).display().to_string();
        let child = a.ns.command("bash").args(["-c", &format!("exec 3<>{node} && exec sleep 600")]).spawn().unwrap();
        wait_for(Duration::from_secs(10), || {
            (!vf_entry(&a.state(), vf)["handles"].as_array().unwrap().is_empty()).then_some(())
        })
        .unwrap_or_else(|| panic!("the holder never opened {node}"));
        Holder { child, node }
    }
}
impl Drop for Holder {
    fn drop(&mut self) {
        for pid in pids_where(|c| c.starts_with("sleep 600")) {
            if fd_targets(pid).contains(&self.node) {
                sigkill(pid);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------------------------------- S038

/// S038: a crash right after the claim is durable (nothing in hardware changed) leaves a
/// claim of a `starting` owner without a VMM identity. After the restart the claim is kept
/// while it is younger than `claim_grace` (CLOCK_BOOTTIME), and released — with no sysfs
/// write, since the VF reads 0 — by the first pass after it. Never earlier.
#[test]
fn s038_a_claim_from_a_crash_before_spawn_is_kept_for_claim_grace_then_released_without_a_write() {
    const GRACE_MS: u64 = 5000;
    let mut a = agent(HOST_V, "claim_grace_s = 5\n");
    crash_during(&mut a, "after_claim_commit", |a| a.create_gpu("a", "L40S-2Q"));

    let claim = a.claim_file(VF0).expect("the claim is durable before the crash");
    assert_eq!(claim["state"], "claimed", "{claim}");
    assert_eq!(a.vf_type(VF0), 0, "nothing written before the crash");
    assert!(a.qemu_pids().is_empty(), "no QEMU was spawned");
    let recs = a.instance_records();
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].1.as_ref().unwrap()["state"], "starting");
    let claimed_bt = claim["claimed_boottime_ms"].as_u64().expect("claimed_boottime_ms");
    let writes_before = a.sim_writes().len();

    a.restart_clean();
    // Bounded by the grace plus generous slack; every assertion below is on the age each
    // pass measured, never on how many passes fit in a window (a slow machine may restart
    // the agent after the grace has already passed: then no pass can see a young claim).
    let deadline = Instant::now() + Duration::from_millis(GRACE_MS + 60_000);
    loop {
        let age_before = boottime_now_ms() - claimed_bt;
        let present = a.claim_file(VF0).is_some();
        if !present {
            assert!(
                age_before >= GRACE_MS,
                "BUG: the claim of a crash between claim and spawn was released at boottime age \
                 <= {age_before} ms, before claim_grace ({GRACE_MS} ms); records: {:?}",
                a.instance_records()
            );
            break;
        }
        let rep = a.pass();
        let age_after = boottime_now_ms() - claimed_bt;
        eprintln!("S038 pass at age {age_after} ms: {rep}");
        if devices_in(&rep, "released").contains(&VF0.to_string()) {
            assert!(age_after >= GRACE_MS, "released at age {age_after} ms < claim_grace: {rep}");
            break;
        }
        if age_after < GRACE_MS {
            assert!(devices_in(&rep, "kept").contains(&VF0.to_string()), "a young claim is reported kept: {rep}");
        }
        assert!(Instant::now() < deadline, "the claim was never released: {rep}");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(a.claim_file(VF0).is_none());
    assert_eq!(writes_since(&a, writes_before), vec![], "no sysfs write: vf0 already read 0");
    let st = a.instance_records().first().map(|(_, r)| r.as_ref().unwrap()["state"].clone());
    assert!(st.is_none() || st == Some(json!("stopped")), "A ends stopped or removed, not {st:?}");
    let res = a.ok("resources.get", json!({}));
    assert_eq!(res["devices"]["allocatable"], 4, "vf0 is allocatable again: {res}");
}

// ------------------------------------------------------------------------------------- S039

/// S039: only provably dead owners lose their claims.
#[test]
fn s039_only_provably_dead_owners_lose_their_claims() {
    let a = agent(HOST_V, "claim_grace_s = 5\n");
    let ia = a.create_gpu("a", "L40S-2Q").unwrap();
    let ib = a.create_gpu("b", "L40S-2Q").unwrap();
    let _ic = a.create_gpu("c", "L40S-2Q").unwrap();
    assert_eq!(ia["gpu"]["device"], VF0);
    assert_eq!(ib["gpu"]["device"], VF1);
    stop_retained(&a, "c", VF2, "EBUSY");
    kill_qemu(&a, &ia, VF0);
    assert_eq!(a.vf_type(VF0), 1148);

    let released_before = metric_of(&a, "gpuvisor_vgpu_stale_releases", &[("result", "released")]);
    let n = a.sim_writes().len();
    let rep = a.pass();
    let mut released = devices_in(&rep, "released");
    released.sort();
    assert_eq!(released, vec![VF0.to_string(), VF2.to_string()], "{rep}");
    assert!(devices_in(&rep, "kept").contains(&VF1.to_string()), "{rep}");
    let w = writes_since(&a, n);
    assert_eq!(
        w,
        vec![(type_path(VF0), "0".into(), "ok".into()), (type_path(VF2), "0".into(), "ok".into())],
        "exactly two writes"
    );
    assert!(a.claim_file(VF0).is_none() && a.claim_file(VF2).is_none());
    assert_eq!(instance(&a, "a")["state"], "stopped");
    assert_eq!(instance(&a, "b")["state"], "running");
    assert_eq!(a.vf_type(VF1), 1148, "B's VF untouched");
    assert_eq!(a.claim_file(VF1).unwrap()["instance_id"], ib["id"]);
    let after = metric_of(&a, "gpuvisor_vgpu_stale_releases", &[("result", "released")]);
    assert_eq!(after - released_before, 2.0);
    assert_eq!(World::observe(&a).safety_violations(&[]), Vec::<String>::new());
}

// ------------------------------------------------------------------------------------- S040

/// S040: the startup pass completes before `agent.health` says ready; until then new claims
/// answer `not_ready`. Afterwards a pass runs about once per interval.
#[test]
fn s040_the_startup_pass_completes_before_ready_then_one_pass_per_interval() {
    let mut a = agent(HOST_V, "claim_grace_s = 5\nreconcile_interval_s = 1\n");
    let x = a.create_gpu("x", "L40S-2Q").unwrap();
    a.create_gpu("z", "L40S-2Q").unwrap();
    a.ok("instance.stop", json!({"ref": "z", "force": true}));
    a.kill_agent();
    kill_qemu(&a, &x, VF0);
    // The startup pass will release vf0; make that write slow so the pass is observable.
    a.sim.ctl(&["delay-write", &type_path(VF0), "3000", "--times", "1"]).unwrap();
    a.restart_with_failpoints(None).unwrap();
    let h = a.ok("agent.health", json!({}));
    assert_eq!(h["ready"], false, "ready before the startup pass finished: {h}");
    // A new claim before the pass completed: `instance.start` reaches the claim step without
    // waiting on the allocation lock (held by the pass's release), and must be refused.
    let e = a.err("instance.start", json!({"ref": "z"}));
    assert_eq!((e.code, e.data_code.as_str()), (503, "not_ready"), "{e}");
    assert_eq!(a.ok("agent.health", json!({}))["ready"], false, "the pass is still running");
    wait_for(Duration::from_secs(30), || {
        a.call("agent.health", json!({})).ok().filter(|h| h["ready"] == true).map(|_| ())
    })
    .expect("ready");
    assert!(metric_of(&a, "gpuvisor_vgpu_reconcile_runs", &[("result", "complete")]) >= 1.0);
    assert!(a.claim_file(VF0).is_none(), "the startup pass released the dead owner's claim");
    assert_eq!(a.vf_type(VF0), 0);
    assert_eq!(instance(&a, "z")["state"], "stopped", "the refused start restored the stopped record");
    assert!(a.claims().is_empty(), "the refused start claimed nothing: {:?}", a.claims());

    // Periodic passes: about one per second.
    let r0 = metric_of(&a, "gpuvisor_vgpu_reconcile_runs", &[]);
    let t0 = Instant::now();
    wait_for(Duration::from_secs(10), || {
        (metric_of(&a, "gpuvisor_vgpu_reconcile_runs", &[]) >= r0 + 3.0).then_some(())
    })
    .expect("three periodic passes");
    let dt = t0.elapsed();
    assert!(dt >= Duration::from_millis(1900) && dt <= Duration::from_secs(30), "3 passes took {dt:?}");
}

/// S040 (no managed GPU): passes report nothing to do and plain instances run. (The simulator
/// refuses a model without any `[[gpu]]`, so the "GPU-less host" is host V with
/// `managed_gpus = []`.)
#[test]
fn s040_a_host_without_managed_gpus_reconciles_cleanly_and_runs_plain_instances() {
    let a = agent(HOST_V, "managed_gpus = []\n");
    let rep = a.pass();
    assert_eq!(rep["inventory_complete"], true, "{rep}");
    assert_eq!(rep["released"], json!([]));
    assert_eq!(rep["failed"], json!([]));
    assert_eq!(rep["errors"], json!([]), "no discovery error: {rep}");
    let i = a.ok("instance.create", json!({"name": "plain", "image": "demo"}));
    assert_eq!(i["state"], "running");
    assert!(i["gpu"].is_null(), "{i}");
}

// ------------------------------------------------------------------------------------- S041

/// S041: the vendor VF sweep clears a dirty, unclaimed, idle VF on a managed GPU after the
/// grace; it never touches a held VF, a VF on an unmanaged GPU, or a claimed VF.
#[test]
fn s041_the_sweep_clears_only_old_idle_unclaimed_vfs_on_managed_gpus() {
    const GRACE_MS: u128 = 3000;
    let a = agent(HOST_V2, "claim_grace_s = 3\nmanaged_gpus = [\"0000:41:00.0\"]\n");
    for vf in [VF0, VF2, WF0] {
        a.sim.ctl(&["set-type", vf, "1148"]).unwrap();
    }
    let holder = Holder::open(&a, VF2);
    let b = a.create_gpu("b", "L40S-2Q").unwrap();
    assert_eq!(b["gpu"]["device"], VF1, "clean VFs first");
    let orphans0 = metric_of(&a, "gpuvisor_vgpu_orphans_released", &[("framework", "vendor_vfio")]);
    let n = a.sim_writes().len();

    let first = Instant::now();
    let rep = a.pass();
    assert!(devices_in(&rep, "released").is_empty(), "nothing is old yet: {rep}");
    let kept = devices_in(&rep, "kept");
    assert!(kept.contains(&VF0.to_string()) && kept.contains(&VF2.to_string()), "{rep}");
    loop {
        let rep = a.pass();
        let released = devices_in(&rep, "released");
        if !released.is_empty() {
            assert_eq!(released, vec![VF0.to_string()], "{rep}");
            assert!(first.elapsed().as_millis() >= GRACE_MS, "swept after {:?} < claim_grace", first.elapsed());
            break;
        }
        assert!(first.elapsed() < Duration::from_secs(60), "vf0 never swept: {rep}");
        std::thread::sleep(Duration::from_millis(400));
    }
    assert_eq!(writes_since(&a, n), vec![(type_path(VF0), "0".into(), "ok".into())], "only vf0 is written");
    assert_eq!(a.vf_type(VF2), 1148, "held VF untouched");
    assert_eq!(a.vf_type(WF0), 1148, "unmanaged GPU untouched");
    assert_eq!(a.vf_type(VF1), 1148, "claimed VF untouched");
    assert!(a.claim_file(VF1).is_some());
    let orphans1 = metric_of(&a, "gpuvisor_vgpu_orphans_released", &[("framework", "vendor_vfio")]);
    assert_eq!(orphans1 - orphans0, 1.0);

    drop(holder);
}

/// S041: a VF that has been dirty for longer than `claim_grace` while held open is swept by
/// the first pass after its holder closes it ("eligible once dirty for claim_grace" — the
/// dirty age does not restart when the holder goes away).
#[test]
fn s041_a_vf_dirty_longer_than_the_grace_is_swept_once_its_holder_closes() {
    let a = agent(HOST_V2, "claim_grace_s = 3\nmanaged_gpus = [\"0000:41:00.0\"]\n");
    a.sim.ctl(&["set-type", VF2, "1148"]).unwrap();
    a.sim.ctl(&["set-type", WF0, "1148"]).unwrap();
    let holder = Holder::open(&a, VF2);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(3500) {
        let rep = a.pass();
        assert_eq!(rep["released"], json!([]), "held: never released: {rep}");
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(holder);
    wait_idle(&a, VF2);
    let rep = a.pass();
    assert_eq!(
        devices_in(&rep, "released"),
        vec![VF2.to_string()],
        "vf2 has been dirty for {:?} (> claim_grace 3 s); the first pass after its holder closed must sweep it: {rep}",
        t0.elapsed()
    );
    assert_eq!(a.vf_type(WF0), 1148, "the unmanaged GPU is never touched");
    assert!(!a.sim_writes().iter().any(|(p, _, _)| p.contains(WF0)), "no write on g1 ever");
}

/// S041 / I9 on an mdev host: an mdev gpuvisor did not create is never removed.
#[test]
fn s041_a_foreign_mdev_is_never_swept() {
    let a = agent("l40s-mdev", "claim_grace_s = 2\n");
    a.sim.ctl(&["create-mdev", VF0, "1148", FOREIGN]).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(3500) {
        let rep = a.pass();
        assert!(devices_in(&rep, "released").is_empty(), "{rep}");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(sim_mdevs(&a.state()).iter().any(|m| m["uuid"] == FOREIGN), "the foreign mdev survives");
    assert!(!a.sim_writes().iter().any(|(p, _, _)| p.contains(FOREIGN)), "{:?}", a.sim_writes());
    assert_eq!(metric_of(&a, "gpuvisor_vgpu_orphans_released", &[("framework", "mdev")]), 0.0);
}

// ------------------------------------------------------------------------------------- S042

/// S042: after a host reboot the hardware wins: records from the old boot are `stopped`,
/// their claims dropped with no sysfs write, and the instance starts again on a fresh VF.
#[test]
fn s042_after_a_reboot_records_are_reconciled_and_claims_dropped_without_writes() {
    let mut a = agent(HOST_V, "claim_grace_s = 5\n");
    let x = a.create_gpu("x", "L40S-2Q").unwrap();
    let _y = a.create_gpu("y", "L40S-2Q").unwrap();
    stop_retained(&a, "y", VF1, "EBUSY");
    let old_boot = a.state()["boot_id"].clone();

    // The reboot: the agent and every VM die, the simulator returns to its boot state.
    a.kill_agent();
    sigkill(a.qemu_pid(x["id"].as_str().unwrap()));
    wait_for(Duration::from_secs(10), || a.qemu_pids().is_empty().then_some(())).unwrap();
    // The VFs come back 15 s after the reboot (long enough for a loaded machine to restart
    // the agent and try a start before they exist).
    a.sim.ctl(&["reboot", "--vf-delay", "15000"]).unwrap();
    assert_ne!(a.state()["boot_id"], old_boot);
    let n = a.sim_writes().len();

    a.restart_with_failpoints(None).unwrap();
    // Before the VFs are back, starting X must not boot it without its GPU.
    match a.call("instance.start", json!({"ref": "x"})) {
        Err(e) => assert_eq!((e.code, e.data_code.as_str()), (503, "not_ready"), "{e}"),
        Ok(v) => panic!("X started while the VFs were absent: {v}"),
    }
    assert!(a.qemu_pids().is_empty(), "no GPU instance booted without its GPU");
    a.wait_ready().unwrap();
    wait_for(Duration::from_secs(40), || (a.state()["gpus"][0]["numvfs"].as_u64() == Some(4)).then_some(())).unwrap();
    let rep = a.pass();
    assert_eq!(rep["inventory_complete"], true, "{rep}");
    assert_eq!(instance(&a, "x")["state"], "stopped");
    assert_eq!(instance(&a, "y")["state"], "stopped");
    assert!(a.claims().is_empty(), "claims from the old boot are dropped: {:?}", a.claims());
    let w: Vec<_> = writes_since(&a, n).into_iter().filter(|(p, _, _)| p.contains("current_vgpu_type")).collect();
    assert_eq!(w, vec![], "no sysfs write: the hardware already reads 0");

    let again = a.ok("instance.start", json!({"ref": "x"}));
    assert_eq!(again["state"], "running");
    let dev = again["gpu"]["device"].as_str().unwrap().to_string();
    assert_eq!(a.claim_file(&dev).unwrap()["claim_boot_id"], a.state()["boot_id"]);
    assert_eq!(World::observe(&a).safety_violations(&[]), Vec::<String>::new());
}

// ------------------------------------------------------------------------------------- QEMU gone

/// A QEMU killed behind the agent's back: the next pass moves the instance to `stopped` and
/// its VF is released (EBUSY during the teardown lag is retried by the next pass).
#[test]
fn a_qemu_killed_behind_the_agents_back_is_stopped_and_its_vf_released() {
    let a = agent(HOST_V, "claim_grace_s = 5\n");
    let i = a.create_gpu("a", "L40S-2Q").unwrap();
    let keep = a.create_gpu("keep", "L40S-2Q").unwrap();
    sigkill(a.qemu_pid(i["id"].as_str().unwrap()));
    wait_for(Duration::from_secs(10), || (a.qemu_pids().len() == 1).then_some(())).unwrap();
    let mut moved = false;
    let t0 = Instant::now();
    loop {
        let rep = a.pass();
        moved |= rep["records"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "a" && r["from"] == "running" && r["to"] == "stopped");
        assert!(World::observe(&a).safety_violations(&[]).is_empty());
        if a.claim_file(VF0).is_none() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "vf0 never released: {rep}");
        std::thread::sleep(Duration::from_millis(300));
    }
    // The exit watcher may have recorded the death before any pass saw it.
    assert!(
        moved || a.log().lines().any(|l| l.contains("VM found dead") && l.contains("instance.name=a")),
        "a pass (or the exit watcher) recorded a: running → stopped"
    );
    assert_eq!(instance(&a, "a")["state"], "stopped");
    assert_eq!(a.vf_type(VF0), 0);
    assert_eq!(instance(&a, "keep")["state"], "running");
    assert_eq!(a.vf_type(keep["gpu"]["device"].as_str().unwrap()), 1148);
    assert_eq!(World::observe(&a).liveness_violations(), Vec::<String>::new());
}

/// Starting an instance whose QEMU died behind the agent's back needs no pass first: its
/// recorded VMM is provably dead, so start records it stopped, releases the leftover claim
/// and starts it again (it used to answer `invalid_state` "running, not stopped").
#[test]
fn start_after_the_vmm_died_behind_the_agents_back_needs_no_pass() {
    let a = agent(HOST_V, "claim_grace_s = 5\nreconcile_interval_s = 3600\n");
    let i = a.create_gpu("a", "L40S-2Q").unwrap();
    let old_pid = i["vmm"]["pid"].clone();
    let q = a.qemu_pid(i["id"].as_str().unwrap());
    sigkill(q);
    assert!(wait_reaped(q), "the QEMU is reaped");
    assert_eq!(instance(&a, "a")["state"], "running", "no pass has run: the record is stale");
    let s = a.ok("instance.start", json!({"ref": "a"}));
    assert_eq!(s["state"], "running", "{s}");
    assert_ne!(s["vmm"]["pid"], old_pid, "a new VMM");
    assert_eq!(a.claims().len(), 1, "one claim: {:?}", a.claims());
    assert!(World::observe(&a).safety_violations(&[]).is_empty());
    // A live VMM is still refused.
    let e = a.err("instance.start", json!({"ref": "a"}));
    assert_eq!(e.data_code, "invalid_state", "{e}");
}

// ------------------------------------------------------------------------------------- S043-ish / I6

/// I6, "fail closed for what the bad record might own": one undecodable instance record
/// blocks only the claims that may be its own. The pass still releases what a readable dead
/// owner held, names the record in its report, and the agent stays ready (degraded, saying
/// why); once the record is repaired it is listed again, untouched.
#[test]
fn an_undecodable_instance_record_blocks_only_what_it_may_own() {
    let a = agent(HOST_V, "claim_grace_s = 2\n");
    let _ia = a.create_gpu("a", "L40S-2Q").unwrap();
    let ib = a.create_gpu("b", "L40S-2Q").unwrap();
    let ic = a.create_gpu("c", "L40S-2Q").unwrap();
    assert_eq!(ic["gpu"]["device"], VF2);
    kill_qemu(&a, &ib, VF1);
    let path = a.instance_record_path(ic["id"].as_str().unwrap());
    let good = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, "{ this is not json").unwrap();

    let t0 = Instant::now();
    while a.claim_file(VF1).is_some() {
        let rep = a.pass();
        assert_eq!(rep["inventory_complete"], true, "{rep}");
        assert!(rep["errors"].to_string().contains(path.to_str().unwrap()), "the report names the record: {rep}");
        assert!(devices_in(&rep, "kept").contains(&VF2.to_string()), "c's claim is kept: {rep}");
        assert!(t0.elapsed() < Duration::from_secs(60), "b's claim was never released: {rep}");
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(a.vf_type(VF1), 0, "the readable dead owner's VF is released");
    assert_eq!(a.vf_type(VF2), 1148, "the unreadable owner's VF is never cleared");
    assert_eq!(a.claim_file(VF2).unwrap()["instance_id"], ic["id"]);
    let h = a.ok("agent.health", json!({}));
    assert_eq!(h["ready"], true, "{h}");
    assert_eq!(h["degraded"], true, "{h}");
    assert!(h["problems"].to_string().contains(path.to_str().unwrap()), "{h}");
    let list = a.ok("instance.list", json!({}));
    assert_eq!(list["unreadable"][0]["path"], path.to_str().unwrap(), "{list}");
    assert_eq!(list["instances"].as_array().unwrap().len(), 2, "{list}");

    std::fs::write(&path, good).unwrap();
    a.pass();
    assert_eq!(a.ok("instance.get", json!({"ref": "c"}))["state"], "running");
    assert_eq!(a.vf_type(VF2), 1148);
    assert_eq!(World::observe(&a).safety_violations(&[]), Vec::<String>::new());
}

/// I6/I13: a claims directory that cannot be listed makes the inventory incomplete: the
/// pass is counted as such and releases nothing; once it can be listed again, passes
/// release again.
#[test]
fn an_unlistable_claims_directory_fails_the_pass_closed() {
    let a = agent(HOST_V, "claim_grace_s = 2\n");
    let _ia = a.create_gpu("a", "L40S-2Q").unwrap();
    let ib = a.create_gpu("b", "L40S-2Q").unwrap();
    kill_qemu(&a, &ib, VF1);
    let claims = a.data_dir.join("claims");
    let hidden = a.data_dir.join("claims.hidden");
    // A regular file where the directory was: listing it fails with ENOTDIR.
    std::fs::rename(&claims, &hidden).unwrap();
    std::fs::write(&claims, "").unwrap();
    let fails0 = metric_of(&a, "gpuvisor_vgpu_reconcile_failures", &[("stage", "inventory")]);
    let n = a.sim_writes().len();
    for _ in 0..3 {
        let rep = a.pass();
        assert_eq!(rep["inventory_complete"], false, "{rep}");
        assert_eq!(rep["released"], json!([]), "{rep}");
    }
    let fails1 = metric_of(&a, "gpuvisor_vgpu_reconcile_failures", &[("stage", "inventory")]);
    assert!(fails1 - fails0 >= 3.0, "counted: {fails0} → {fails1}");
    assert_eq!(writes_since(&a, n), vec![], "nothing cleared");
    let h = a.ok("agent.health", json!({}));
    assert_eq!(h["store_readable"], false, "{h}");
    assert_eq!(h["ready"], false, "{h}");
    std::fs::remove_file(&claims).unwrap();
    std::fs::rename(&hidden, &claims).unwrap();
    let t0 = Instant::now();
    while a.claim_file(VF1).is_some() {
        let rep = a.pass();
        assert_eq!(rep["inventory_complete"], true, "{rep}");
        assert!(t0.elapsed() < Duration::from_secs(60), "b's claim never released: {rep}");
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(a.vf_type(VF1), 0);
}

// ------------------------------------------------------------------------------------- grace plugins (I14)

/// A grace plugin answering `release` for every VF: only eligible items (provably dead or
/// absent owners, idle orphans) are released; running instances keep their VFs and claims,
/// and a held dirty VF is never cleared.
#[test]
fn a_grace_plugin_releasing_everything_cannot_clear_live_or_held_devices() {
    let a = agent_with_grace(HOST_V, "claim_grace_s = 300\n", "grace-release-all.wat");
    let ia = a.create_gpu("a", "L40S-2Q").unwrap();
    let ib = a.create_gpu("b", "L40S-2Q").unwrap();
    let ic = a.create_gpu("c", "L40S-2Q").unwrap();
    assert_eq!(ic["gpu"]["device"], VF2);
    a.sim.ctl(&["set-type", VF3, "1148"]).unwrap();
    let holder = Holder::open(&a, VF3);
    kill_qemu(&a, &ic, VF2);
    for _ in 0..3 {
        let rep = a.pass();
        for d in devices_in(&rep, "released") {
            assert_eq!(d, VF2, "only the dead owner's VF may be released: {rep}");
        }
        assert!(World::observe(&a).safety_violations(&[VF3.to_string()]).is_empty());
        std::thread::sleep(Duration::from_millis(300));
    }
    for (inst, vf) in [(&ia, VF0), (&ib, VF1)] {
        assert_eq!(a.vf_type(vf), 1148, "a running instance keeps its VF");
        assert_eq!(a.claim_file(vf).unwrap()["instance_id"], inst["id"]);
    }
    assert_eq!(a.vf_type(VF3), 1148, "the held dirty VF is never cleared");
    assert_eq!(a.vf_type(VF2), 0, "the dead owner's VF was released");
    assert!(a.claim_file(VF2).is_none());
    drop(holder);
}

fn failing_grace_keeps_everything(plugin: &str) {
    let a = agent_with_grace(HOST_V, "claim_grace_s = 1\n", plugin);
    let _ia = a.create_gpu("a", "L40S-2Q").unwrap();
    let ib = a.create_gpu("b", "L40S-2Q").unwrap();
    a.sim.ctl(&["set-type", VF3, "1148"]).unwrap();
    kill_qemu(&a, &ib, VF1);
    let n = a.sim_writes().len();
    let t0 = Instant::now();
    let mut passes = 0;
    while t0.elapsed() < Duration::from_millis(2500) {
        let rep = a.pass();
        passes += 1;
        assert_eq!(rep["released"], json!([]), "{rep}");
        assert!(
            rep["errors"].as_array().unwrap().iter().any(|e| e.as_str().unwrap().contains("grace plugin failed")),
            "{rep}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(writes_since(&a, n), vec![], "a failing grace plugin keeps everything");
    assert_eq!(a.vf_type(VF0), 1148);
    assert_eq!(a.vf_type(VF1), 1148);
    assert_eq!(a.vf_type(VF3), 1148);
    assert!(a.claim_file(VF1).is_some(), "the dead owner's claim is kept too");
    let grace_fail = metric_of(&a, "gpuvisor_vgpu_reconcile_failures", &[("stage", "grace")]);
    assert!(grace_fail >= passes as f64, "{grace_fail} < {passes}");
    let calls = metric_of(&a, "gpuvisor_policy_calls", &[("kind", "grace"), ("result", "failed")]);
    assert!(calls >= passes as f64, "{calls}");
    assert_eq!(a.ok("agent.health", json!({}))["live"], true);
}

#[test]
fn a_trapping_grace_plugin_keeps_everything() {
    failing_grace_keeps_everything("grace-trap.wat");
}

#[test]
fn a_looping_grace_plugin_keeps_everything() {
    failing_grace_keeps_everything("grace-loop.wat");
}

// ------------------------------------------------------------------------------------- I12 clock

/// I12: the grace runs on CLOCK_BOOTTIME. Moving a claim's wall-clock `claimed_at` a day back
/// or forward changes nothing: the claim is kept while its boottime age is below the grace,
/// released once it passes (bounded: the loop fails a minute past the grace).
fn wall_clock_case(shift_s: i64) {
    const GRACE_MS: u64 = 5000;
    let mut a = agent(HOST_V, "claim_grace_s = 5\n");
    crash_during(&mut a, "after_claim_commit", |a| a.create_gpu("a", "L40S-2Q"));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let p = a.data_dir.join("claims").join(format!("{VF0}.json"));
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).expect("claim")).unwrap();
    c["claimed_at"] = json!(rfc3339(std::time::UNIX_EPOCH + Duration::from_secs((now + shift_s) as u64)));
    let bt = c["claimed_boottime_ms"].as_u64().unwrap();
    std::fs::write(&p, serde_json::to_string(&c).unwrap()).unwrap();
    a.restart_clean();
    // Every assertion is on the boottime age measured around each observation: a claim seen
    // gone while it was still younger than the grace was released too early; a pass that ran
    // while it was younger must keep it — however slow the machine is (bounded: generous
    // slack past the grace). On a machine so slow that the restart outlasts the grace, the
    // startup pass may release it before any measurement: that is accepted, not asserted on.
    let deadline = Instant::now() + Duration::from_millis(GRACE_MS + 60_000);
    loop {
        let age_before = boottime_now_ms() - bt;
        if a.claim_file(VF0).is_none() {
            assert!(
                age_before >= GRACE_MS,
                "BUG: the claim (claimed_at shifted by {shift_s} s) was gone at boottime age {age_before} ms < claim_grace"
            );
            break;
        }
        let rep = a.pass();
        let age_after = boottime_now_ms() - bt;
        if devices_in(&rep, "released").contains(&VF0.to_string()) {
            assert!(age_after >= GRACE_MS, "BUG: released at boottime age {age_after} ms < claim_grace: {rep}");
            break;
        }
        if age_after < GRACE_MS {
            assert!(devices_in(&rep, "kept").contains(&VF0.to_string()), "a young claim is kept: {rep}");
        }
        assert!(Instant::now() < deadline, "never released: {rep}");
        std::thread::sleep(Duration::from_millis(400));
    }
}

/// I12: moving `claimed_at` a day into the past must not shorten the protection.
#[test]
fn a_wall_clock_jump_forward_does_not_shorten_the_grace() {
    wall_clock_case(-86_400);
}

/// I12: moving `claimed_at` a day into the future must not stretch the release beyond I2.
#[test]
fn a_wall_clock_jump_backward_does_not_stretch_the_grace() {
    wall_clock_case(86_400);
}

fn rfc3339(t: std::time::SystemTime) -> String {
    // Seconds precision, UTC, without extra crates.
    let secs = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil from days (Howard Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

// ------------------------------------------------------------------------------------- S052 / S053

/// S052: release outcomes are counted per attempt; the retained gauges follow the store.
#[test]
fn s052_release_outcomes_are_counted_per_attempt() {
    let a = agent(HOST_V, "claim_grace_s = 5\n");
    a.create_gpu("a", "L40S-2Q").unwrap();
    stop_retained(&a, "a", VF0, "EBUSY");
    a.sim.ctl(&["fail-write", &type_path(VF0), "EIO", "--always"]).unwrap();
    let runs0 = metric_of(&a, "gpuvisor_vgpu_reconcile_runs", &[]);
    let rep = a.pass();
    assert_eq!(devices_in(&rep, "failed"), vec![VF0.to_string()], "{rep}");
    let text = a.metrics();
    assert_eq!(metric(&text, "gpuvisor_vgpu_stale_releases", &[("result", "failed")]), Some(1.0), "{text}");
    assert_eq!(metric(&text, "gpuvisor_vgpu_retained_assignments", &[]), Some(1.0));
    assert_eq!(
        metric(&text, "gpuvisor_vgpu_claims", &[("framework", "vendor_vfio"), ("state", "release_pending")]),
        Some(1.0)
    );
    assert_eq!(metric(&text, "gpuvisor_vgpu_reconcile_runs", &[]), Some(runs0 + 1.0));
    a.sim.ctl(&["clear-faults"]).unwrap();
    let rep = a.pass();
    assert_eq!(devices_in(&rep, "released"), vec![VF0.to_string()], "{rep}");
    let text = a.metrics();
    assert_eq!(metric(&text, "gpuvisor_vgpu_stale_releases", &[("result", "released")]), Some(1.0), "{text}");
    assert_eq!(metric(&text, "gpuvisor_vgpu_retained_assignments", &[]), Some(0.0));
    assert_eq!(
        metric(&text, "gpuvisor_vgpu_claims", &[("framework", "vendor_vfio"), ("state", "release_pending")]),
        Some(0.0)
    );
    assert_eq!(metric(&text, "gpuvisor_vgpu_reconcile_runs", &[]), Some(runs0 + 2.0));
    // The record no longer says the release is pending.
    let inst = a.ok("instance.get", json!({"ref": "a"}));
    assert!(inst["last_error"].is_null(), "{inst}");
}

/// S053: counts agree between `resources.get` and the metrics.
#[test]
fn s053_counts_agree_between_resources_and_metrics() {
    let a = agent(HOST_V, "claim_grace_s = 300\n");
    let quarantine = |vf: &str| {
        std::fs::create_dir_all(a.data_dir.join("health")).unwrap();
        let rec = json!({"device": vf, "reason": "test", "quarantined": true, "detail": "S053",
                         "at": "2026-01-01T00:00:00Z"});
        std::fs::write(a.data_dir.join("health").join(format!("{vf}.json")), rec.to_string()).unwrap();
    };
    let ia = a.create_gpu("a", "L40S-2Q").unwrap();
    assert_eq!(ia["gpu"]["device"], VF0);
    quarantine(VF0);
    quarantine(VF1);
    let ib = a.create_gpu("b", "L40S-2Q").unwrap();
    assert_eq!(ib["gpu"]["device"], VF2, "placement skips the quarantined vf1");
    let res = a.ok("resources.get", json!({}));
    let d = &res["devices"];
    let text = a.metrics();
    let got = json!({
        "resources.total": d["total"], "resources.claimed": d["claimed"],
        "resources.quarantined": d["quarantined"], "resources.allocatable": d["allocatable"],
        "metric.claims_configured":
            metric(&text, "gpuvisor_vgpu_claims", &[("framework", "vendor_vfio"), ("state", "configured")]),
        "metric.instances_running": metric(&text, "gpuvisor_instances", &[("state", "running")]),
        "metric.quarantined_devices": metric(&text, "gpuvisor_vgpu_quarantined_devices", &[]),
    });
    let want = json!({
        "resources.total": 4, "resources.claimed": 2, "resources.quarantined": 2, "resources.allocatable": 1,
        "metric.claims_configured": 2.0, "metric.instances_running": 2.0, "metric.quarantined_devices": 2.0,
    });
    assert_eq!(got, want, "S053: /resources and /metrics disagree with the store (vf0 is claimed AND quarantined)");
}
