//! Issue 7, "What to build" items 7 and 8: races made reproducible by pausable failpoints,
//! the configurable QMP readiness timeout, `plugin.reload` (params, refusals, counters) and
//! the JSON-RPC edge (bad ids, unknown parameters) — against the real agent, gpuvisor-sim
//! and QEMU (guests stay paused through a `qemu_binary` wrapper: a VM only has to hold its
//! VF and QMP socket).
//!
//! Race tests pause a point with `debug.failpoint {"name", "action": "pause"}`, start the
//! operation in a thread, and synchronise on `waiting >= 1` of that point in
//! `debug.failpoints` — never on sleeps. Every paused point is released again, also when an
//! assertion fails (a guard releases it on drop).
//!
//! Needs the agent built with `--features gpuvisor/failpoints`.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::thread::JoinHandle;
use std::time::Duration;

/// One L40S with a single VF (`0000:41:00.4`): a create has exactly one candidate.
const HOST_1VF: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 1\niommu_group = 40\n";
const VF0: &str = "0000:41:00.4";
const VF1: &str = "0000:41:00.5";
/// How long an operation may take to reach a point, or a call to answer, on a busy box.
const BOUND: Duration = Duration::from_secs(120);

/// An agent whose QEMUs run through `w` (paused guests) and whose periodic passes never
/// run during a test (passes are driven with `reconcile.run`).
fn agent(model: &str, w: &QemuWrapper, extra: &str) -> Agent {
    let extra = w.extra() + "reconcile_interval_s = 3600\n" + extra;
    Agent::start_tuned(AgentOptions { model, extra: &extra, ..Default::default() }, None, &[("release_retry_s", "1")])
        .unwrap()
}

// ------------------------------------------------------------------------------ failpoints

/// The `debug.failpoints` entry of a point.
fn point(a: &Agent, name: &str) -> Value {
    let list = a.ok("debug.failpoints", json!({}));
    list["failpoints"]
        .as_array()
        .and_then(|l| l.iter().find(|p| p["name"] == name).cloned())
        .unwrap_or_else(|| panic!("{name} is not listed by debug.failpoints: {list}"))
}

fn waiting(a: &Agent, name: &str) -> u64 {
    point(a, name)["waiting"].as_u64().unwrap_or(0)
}

/// A paused point, released when dropped (also on a failed assertion, so that no agent
/// thread stays parked).
struct Paused<'a> {
    a: &'a Agent,
    name: &'static str,
}

impl<'a> Paused<'a> {
    fn new(a: &'a Agent, name: &'static str) -> Paused<'a> {
        assert_failpoints_built();
        let list = a.ok("debug.failpoint", json!({"name": name, "action": "pause"}));
        let p = list["failpoints"].as_array().and_then(|l| l.iter().find(|p| p["name"] == name).cloned());
        assert_eq!(p.as_ref().map(|p| p["armed"].clone()), Some(json!(true)), "{name} armed: {list}");
        Paused { a, name }
    }

    /// Waits until a thread waits at the point; fails if `call` answered without pausing.
    fn wait_hit(&self, call: &JoinHandle<anyhow::Result<Value>>) {
        let paused = wait_for(BOUND, || {
            if waiting(self.a, self.name) >= 1 {
                Some(true)
            } else {
                call.is_finished().then_some(false)
            }
        });
        match paused {
            Some(true) => {}
            Some(false) => panic!("the call answered without pausing at {}", self.name),
            None => panic!("nothing reached {} within {BOUND:?}: {}", self.name, point(self.a, self.name)),
        }
    }

    fn release(&self) {
        let list = self.a.ok("debug.failpoint", json!({"name": self.name, "action": "release"}));
        let p = list["failpoints"].as_array().and_then(|l| l.iter().find(|p| p["name"] == self.name).cloned());
        assert_eq!(p.map(|p| p["armed"].clone()), Some(json!(false)), "{} disarmed: {list}", self.name);
    }
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        let _ = self.a.call("debug.failpoint", json!({"name": self.name, "action": "release"}));
    }
}

/// Joins a call made with `spawn_call` (bounded: it must answer once nothing pauses it).
fn answer(call: JoinHandle<anyhow::Result<Value>>) -> Value {
    wait_for(BOUND, || call.is_finished().then_some(())).expect("the call answers");
    call.join().expect("call thread").expect("an HTTP answer")
}

fn create_call(a: &Agent, name: &str, profile: &str) -> JoinHandle<anyhow::Result<Value>> {
    a.spawn_call("instance.create", json!({"name": name, "image": "demo", "gpu": profile}))
}

/// `(error.code, error.data.code)` of a JSON-RPC answer, `None` for a result.
fn error_of(ans: &Value) -> Option<(i64, String)> {
    let e = ans.get("error")?;
    Some((e["code"].as_i64().unwrap_or(0), e["data"]["code"].as_str().unwrap_or("").to_string()))
}

/// The string constant list `pub const <name>: &[&str] = &[...]` of agent/src/failpoints.rs.
fn failpoint_list(name: &str) -> Vec<String> {
    let src = std::fs::read_to_string(repo_root().join("agent/src/failpoints.rs")).expect("agent/src/failpoints.rs");
    let start = src.find(&format!("pub const {name}: &[&str]")).unwrap_or_else(|| panic!("{name} in failpoints.rs"));
    let body = &src[start..];
    // `= &[` or, when rustfmt breaks a long list, `=\n    &[`.
    let body = &body[body.find('=').expect("list start")..];
    let body = &body[body.find("&[").expect("list start")..];
    let body = &body[..body.find("];").expect("list end")];
    body.split('"').skip(1).step_by(2).map(String::from).collect()
}

// ------------------------------------------------------------------------------ passes

fn kept_for<'v>(pass: &'v Value, key: &str, value: &str) -> Vec<&'v Value> {
    pass["kept"].as_array().map(|k| k.iter().filter(|i| i[key] == value).collect()).unwrap_or_default()
}

fn released_devices(pass: &Value) -> Vec<String> {
    pass["released"]
        .as_array()
        .map(|r| r.iter().map(|i| i["device"].as_str().unwrap_or("").to_string()).collect())
        .unwrap_or_default()
}

/// The id of the stored instance record named `name`.
fn record_id(a: &Agent, name: &str) -> Option<String> {
    a.instance_records().into_iter().find_map(|(id, r)| r.ok().filter(|r| r["name"] == name).map(|_| id))
}

// ================================================================ 1. placement vs. claim

#[test]
fn a_create_paused_between_placement_and_claim_loses_the_last_vf_to_a_create_that_ran_meanwhile() {
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "");
    let fp = Paused::new(&a, "claim_before_create");
    let create_a = create_call(&a, "a", "L40S-1Q");
    fp.wait_hit(&create_a);
    assert!(a.claims().is_empty(), "A ranked VF0 but claimed nothing yet: {:?}", a.claims());

    // B runs while A waits after placement: it must not wait for A (A holds no allocation
    // lock there) and takes the only VF.
    let create_b = create_call(&a, "b", "L40S-1Q");
    let b_done = wait_for(BOUND, || {
        if create_b.is_finished() {
            Some(true)
        } else {
            (waiting(&a, "claim_before_create") >= 2).then_some(false)
        }
    });
    assert_eq!(
        b_done,
        Some(true),
        "create B was held at claim_before_create while A waited there ({}): a paused point must hold \
         only the thread it caught, else B cannot run between A's placement and A's claim",
        point(&a, "claim_before_create")
    );
    let b = answer(create_b);
    assert!(b.get("error").is_none(), "B succeeds: {b}");
    let b_id = b["result"]["id"].as_str().unwrap().to_string();
    assert_eq!(b["result"]["gpu"]["device"], VF0, "{b}");
    assert_eq!(waiting(&a, "claim_before_create"), 1, "A still waits");

    fp.release();
    let ans = answer(create_a);
    assert_eq!(error_of(&ans), Some((409, "no_capacity".to_string())), "A lost the VF to B: {ans}");

    // B keeps its VF; exactly one claim; A left nothing.
    let claims = a.claims();
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert_eq!((claims[0]["device"].as_str(), claims[0]["instance_id"].as_str()), (Some(VF0), Some(b_id.as_str())));
    assert_eq!(a.vf_type(VF0), 1147);
    let got = a.ok("instance.get", json!({"ref": "b"}));
    assert_eq!((got["state"].as_str(), got["gpu"]["device"].as_str()), (Some("running"), Some(VF0)), "{got}");
    assert!(!qemu_of(&b_id).is_empty(), "B's QEMU runs");
    assert_eq!(record_id(&a, "a"), None, "A left no record");
    assert_eq!(a.instance_names(), vec!["b".to_string()]);
    let v = World::observe(&a).safety_violations(&[]);
    assert!(v.is_empty(), "{v:#?}");

    // Disarmed, a later create runs normally.
    fp.release();
    assert_eq!(point(&a, "claim_before_create")["armed"], false);
    a.ok("instance.delete", json!({"ref": "b"}));
    let create_c = create_call(&a, "c", "L40S-1Q");
    let c = answer(create_c);
    assert!(c.get("error").is_none(), "C succeeds: {c}");
    assert_eq!(c["result"]["gpu"]["device"], VF0, "{c}");
    assert_eq!(waiting(&a, "claim_before_create"), 0);
    let v = World::observe(&a).safety_violations(&[]);
    assert!(v.is_empty(), "{v:#?}");
}

// ================================================================ 2. repair vs. type write

#[test]
fn a_dirty_vf_paused_between_repair_and_type_write_belongs_to_its_create_and_the_reconciler_leaves_it() {
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "");
    // VF0 (the only VF) is dirty: a type nobody claimed.
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    assert!(a.claims().is_empty());
    let seq0 = last_seq(&a.state());

    let fp = Paused::new(&a, "configure_after_repair");
    let create = create_call(&a, "a", "L40S-1Q");
    fp.wait_hit(&create);

    // Repaired, not yet configured; the claim names the new instance.
    assert_eq!(a.vf_type(VF0), 0, "the repair cleared VF0");
    assert_eq!(writes_after(&a, seq0), vec![(type_path(VF0), "0".to_string(), "ok".to_string())]);
    let id = record_id(&a, "a").expect("A's record exists");
    let c = a.claim(VF0).expect("VF0 is claimed during the pause");
    assert_eq!(c["instance_id"], id.as_str(), "{c}");
    assert_ne!(c["state"], "configured", "{c}");

    // A pass meanwhile leaves the device alone.
    let seq = last_seq(&a.state());
    let pass = a.pass();
    assert!(!released_devices(&pass).contains(&VF0.to_string()), "the pass did not release VF0: {pass}");
    assert!(
        kept_for(&pass, "device", VF0).iter().any(|k| k["reason"].as_str().unwrap_or("").contains("in progress")),
        "the pass keeps VF0 because its owner's operation is in progress: {pass}"
    );
    assert!(writes_after(&a, seq).is_empty(), "the pass wrote nothing: {:?}", writes_after(&a, seq));
    assert_eq!(a.claim(VF0).map(|c| c["instance_id"].clone()), Some(json!(id)), "the claim stays A's");
    let v = World::observe(&a).safety_violations(&[]);
    assert!(v.is_empty(), "{v:#?}");

    fp.release();
    let ans = answer(create);
    assert!(ans.get("error").is_none(), "the create succeeds: {ans}");
    let inst = &ans["result"];
    assert_eq!(inst["id"], id.as_str());
    assert_eq!((inst["gpu"]["device"].as_str(), inst["gpu"]["type_id"].as_u64()), (Some(VF0), Some(1147)), "{ans}");
    assert_eq!(a.vf_type(VF0), 1147);
    assert_eq!(
        writes_after(&a, seq0),
        vec![
            (type_path(VF0), "0".to_string(), "ok".to_string()),
            (type_path(VF0), "1147".to_string(), "ok".to_string())
        ],
        "repair, then the new type; nothing else"
    );
    let c = a.claim(VF0).unwrap();
    assert_eq!((c["instance_id"].as_str(), c["state"].as_str()), (Some(id.as_str()), Some("configured")), "{c}");
    assert!(!qemu_of(&id).is_empty(), "A's QEMU runs");
    let v = World::observe(&a).safety_violations(&[]);
    assert!(v.is_empty(), "{v:#?}");
}

// ================================================================ 3. rollback vs. reconciler

#[test]
fn a_rollback_paused_before_its_release_keeps_its_claim_from_the_reconciler_and_then_leaves_nothing() {
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "");
    // "QEMU" exits with status 1 right after it is spawned.
    w.set_hook("exit 1\n");
    let fp = Paused::new(&a, "rollback_before_release");
    let create = create_call(&a, "a", "L40S-1Q");
    fp.wait_hit(&create);

    let id = record_id(&a, "a").expect("A's record exists during the rollback");
    let c = a.claim(VF0).expect("the claim exists before the rollback's release");
    assert_eq!(c["instance_id"], id.as_str());
    assert_eq!(a.vf_type(VF0), 1147, "VF0 still holds A's type");

    let seq = last_seq(&a.state());
    let pass = a.pass();
    assert!(released_devices(&pass).is_empty(), "the pass released nothing: {pass}");
    let kept = kept_for(&pass, "device", VF0);
    assert!(
        kept.iter().any(|k| k["reason"].as_str().unwrap_or("").contains("operation in progress")),
        "the pass keeps A's claim: an operation is in progress: {pass}"
    );
    assert!(writes_after(&a, seq).is_empty(), "the pass wrote nothing: {:?}", writes_after(&a, seq));
    assert!(a.claim(VF0).is_some(), "the claim stays");
    assert!(
        !pass["records"].as_array().unwrap().iter().any(|r| r["instance"] == id.as_str()),
        "the pass changed no record of A: {pass}"
    );

    fp.release();
    let ans = answer(create);
    assert_eq!(error_of(&ans), Some((500, "vmm_start_failed".to_string())), "{ans}");
    assert!(a.claims().is_empty(), "no claim left: {:?}", a.claims());
    assert!(a.instance_records().is_empty(), "no record left: {:?}", a.instance_records());
    assert_eq!(a.vf_type(VF0), 0, "VF0 is clear");
    assert_eq!(a.call("instance.get", json!({"ref": "a"})).unwrap_err().data_code, "not_found");
    let v = World::observe(&a).safety_violations(&[]);
    assert!(v.is_empty(), "{v:#?}");
}

// ================================================================ 4. spawn vs. identity

#[test]
fn a_create_paused_after_spawn_is_left_alone_by_the_reconciler_and_records_the_live_qemu() {
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "");
    let fp = Paused::new(&a, "after_spawn");
    let create = create_call(&a, "a", "L40S-1Q");
    fp.wait_hit(&create);

    let id = record_id(&a, "a").expect("A's record exists");
    let qemus = qemu_of(&id);
    assert_eq!(qemus.len(), 1, "A's QEMU runs during the pause: {qemus:?}");
    let qemu = qemus[0];
    let rec = a.record(&id);
    assert_eq!(rec["state"], "starting", "{rec}");

    let seq = last_seq(&a.state());
    let pass = a.pass();
    assert!(
        kept_for(&pass, "instance", &id)
            .iter()
            .any(|k| k["reason"].as_str().unwrap_or("").contains("operation in progress")),
        "the pass leaves A alone: an operation is in progress: {pass}"
    );
    assert!(
        !pass["records"].as_array().unwrap().iter().any(|r| r["instance"] == id.as_str()),
        "the pass changed no record of A: {pass}"
    );
    assert!(released_devices(&pass).is_empty(), "nothing released: {pass}");
    assert!(writes_after(&a, seq).is_empty(), "the pass wrote nothing: {:?}", writes_after(&a, seq));
    assert!(alive(qemu), "QEMU is alive after the pass");
    assert_eq!(a.record(&id)["state"], "starting", "the record is untouched");
    assert!(a.claim(VF0).is_some(), "A's claim stays");

    fp.release();
    let ans = answer(create);
    assert!(ans.get("error").is_none(), "the create succeeds: {ans}");
    assert_eq!(ans["result"]["state"], "running", "{ans}");
    let rec = a.record(&id);
    assert_eq!(rec["state"], "running", "{rec}");
    let ident = &rec["vmm"]["identity"];
    assert_eq!(ident["pid"].as_i64(), ns_pid(qemu).map(i64::from), "the record holds the live QEMU's pid: {rec}");
    assert_eq!(ident["start_time"].as_u64(), proc_start_time(qemu), "and its start time: {rec}");
    assert!(alive(qemu), "QEMU still runs");
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["vmm"]["pid"], ident["pid"], "{got}");
    assert_eq!(got["vmm"]["liveness"], "alive", "{got}");
    let v = World::observe(&a).safety_violations(&[]);
    assert!(v.is_empty(), "{v:#?}");
}

/// The exit watcher records a death while a pass, which saw the VM running in its
/// snapshot, waits before the instance lock: the pass finds the record stopped and leaves
/// it — one death, logged once, with the VMM's exit status as the reason.
#[test]
fn a_death_the_exit_watcher_records_while_a_pass_waits_is_recorded_once() {
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "");
    let inst = a.ok("instance.create", json!({"name": "p", "image": "demo"}));
    let id = inst["id"].as_str().unwrap().to_string();
    let qemus = qemu_of(&id);
    assert_eq!(qemus.len(), 1, "{qemus:?}");

    let fp = Paused::new(&a, "reconcile_records_before_lock");
    let pass = a.spawn_call("reconcile.run", json!({}));
    fp.wait_hit(&pass);
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(qemus[0]), nix::sys::signal::Signal::SIGKILL);
    wait_for(BOUND, || (a.ok("instance.get", json!({"ref": "p"}))["state"] == "stopped").then_some(()))
        .expect("the exit watcher records the death while the pass waits");
    fp.release();
    let ans = answer(pass);
    assert!(ans.get("error").is_none(), "{ans}");
    let records = ans["result"]["records"].as_array().cloned().unwrap_or_default();
    assert!(!records.iter().any(|r| r["instance"] == id.as_str()), "the pass changed nothing of p: {ans}");
    let got = a.ok("instance.get", json!({"ref": "p"}));
    assert!(got["last_error"].as_str().unwrap_or("").contains("the VMM exited"), "the exit status stays: {got}");
    let dead: Vec<String> = a.log().lines().filter(|l| l.contains("VM found dead")).map(String::from).collect();
    assert_eq!(dead.len(), 1, "one death, logged once: {dead:?}");
}

// ================================================================ 5. the failpoint API

#[test]
fn debug_failpoint_refuses_an_unknown_name_and_debug_failpoints_lists_every_point_idle() {
    assert_failpoints_built();
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "");
    for action in ["pause", "release"] {
        let e = a.err("debug.failpoint", json!({"name": "no_such_point", "action": action}));
        assert_eq!(e.data_code, "invalid_request", "{action}: {e}");
        assert!(e.message.contains("no_such_point"), "the refusal names the point: {e}");
    }
    let e = a.err("debug.failpoint", json!({"name": "after_spawn", "action": "explode"}));
    assert!(e.code == -32602 || e.data_code == "invalid_request", "an unknown action is refused: {e}");

    let list = a.ok("debug.failpoints", json!({}));
    assert!(list["build"].as_str().unwrap_or("").contains("failpoint"), "{list}");
    let listed = list["failpoints"].as_array().expect("failpoints");
    let all = failpoint_list("ALL");
    let race = failpoint_list("RACE");
    assert!(race.iter().any(|r| r == "claim_before_create"), "RACE read from the source: {race:?}");
    assert!(all.iter().any(|r| r == "after_spawn"), "ALL read from the source: {all:?}");
    for name in all.iter().chain(&race) {
        let p = listed.iter().find(|p| p["name"] == name.as_str());
        let p = p.unwrap_or_else(|| panic!("{name} is not listed: {list}"));
        assert_eq!((&p["armed"], &p["waiting"]), (&json!(false), &json!(0)), "{name} idle: {p}");
    }
    // Nothing was left armed by the refusals.
    assert!(listed.iter().all(|p| p["armed"] == false), "{list}");
}

// ================================================================ 6. QMP readiness timeout

/// The inode of a process's PID namespace.
fn pid_ns_of(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok().map(|p| p.to_string_lossy().into_owned())
}

#[test]
fn a_qemu_that_never_answers_qmp_fails_after_the_configured_timeout_and_is_killed() {
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "qmp_ready_timeout_s = 2\n");
    let pidfile = w.dir.path().join("vmm.pid");
    // "QEMU" is a process that never opens its QMP socket.
    w.set_hook(&format!("echo $$ > {pidfile:?}\nexec sleep 300\n"));
    let ns = pid_ns_of(a.ns.init_pid).expect("the agent's PID namespace");
    let sleepers = || -> Vec<i32> {
        pids_where(|c| c.trim() == "sleep 300").into_iter().filter(|p| pid_ns_of(*p).as_ref() == Some(&ns)).collect()
    };
    let create = create_call(&a, "a", "L40S-1Q");
    // The spawned process, seen from here (best effort: it may be gone already).
    let spawned: Option<i32> = wait_for(Duration::from_secs(60), || {
        if create.is_finished() {
            return Some(None);
        }
        let nspid: i32 = std::fs::read_to_string(&pidfile).ok()?.trim().parse().ok()?;
        root_pid_of(nspid, |c| c.contains("sleep 300")).map(Some)
    })
    .flatten();
    let ans = answer(create);
    assert_eq!(error_of(&ans), Some((500, "vmm_start_failed".to_string())), "{ans}");
    let msg = ans["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("2000 ms"), "the message states the configured 2000 ms QMP timeout: {msg}");
    assert!(pidfile.exists(), "the hook ran (the VMM was spawned)");
    if let Some(pid) = spawned {
        assert!(!alive(pid), "the process that never answered QMP ({pid}) was stopped");
    }
    let left: Vec<i32> = sleepers();
    assert!(left.is_empty(), "no never-answering VMM is left in the agent's namespace: {left:?}");
    assert!(a.claims().is_empty(), "no claim left: {:?}", a.claims());
    assert!(a.instance_records().is_empty(), "no record left: {:?}", a.instance_records());
    assert_eq!(a.vf_type(VF0), 0, "VF0 is clear");
    let v = World::observe(&a).safety_violations(&[]);
    assert!(v.is_empty(), "{v:#?}");

    // The real QEMU answers QMP within the timeout: the next create succeeds.
    w.clear_hook();
    let b = a.create_gpu("b", "L40S-1Q").unwrap_or_else(|e| panic!("create b: {e}"));
    assert_eq!(b["state"], "running");
}

// ================================================================ 7. plugin.reload params

fn grace_kept_reason(pass: &Value, vf: &str) -> Option<String> {
    kept_for(pass, "device", vf)
        .iter()
        .map(|k| k["reason"].as_str().unwrap_or("").to_string())
        .find(|r| r.starts_with("grace:"))
}

fn released_orphan(pass: &Value, vf: &str) -> bool {
    pass["released"].as_array().unwrap().iter().any(|r| r["device"] == vf && r["kind"] == "orphan_vf")
}

fn plugin_names(a: &Agent) -> Vec<(String, String)> {
    a.ok("plugin.list", json!({}))["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["slot"].as_str().unwrap_or("").to_string(), p["name"].as_str().unwrap_or("").to_string()))
        .collect()
}

#[test]
fn plugin_reload_applies_new_grace_params_and_a_broken_config_keeps_the_old_ones() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, &w, "[plugins.grace.params]\nclaim_grace_s = 100000\n");
    let cfg = std::fs::read_to_string(&a.config_path).unwrap();
    assert!(cfg.contains("claim_grace_s = 100000"), "{cfg}");
    let plugins = plugin_names(&a);

    // An idle dirty VF: the grace plugin keeps it under the start-up params.
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let pass = a.pass();
    let why = grace_kept_reason(&pass, VF0).unwrap_or_else(|| panic!("the orphan is kept by grace: {pass}"));
    assert!(why.contains("100000"), "the start-up params are in force: {why}");
    assert!(!released_orphan(&pass, VF0), "{pass}");

    // A broken config is refused; the old plugins and params stay.
    std::fs::write(&a.config_path, format!("{cfg}\n[[[ this is not TOML\n")).unwrap();
    let e = a.err("plugin.reload", json!({}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert_eq!(plugin_names(&a), plugins);
    let pass = a.pass();
    let why = grace_kept_reason(&pass, VF0).unwrap_or_else(|| panic!("the orphan is still kept: {pass}"));
    assert!(why.contains("100000"), "the old params are still in force: {why}");
    assert_eq!(a.vf_type(VF0), 1148);

    // The new params apply on reload: the next pass releases the orphan.
    let zero = cfg.replace("claim_grace_s = 100000", "claim_grace_s = 0");
    std::fs::write(&a.config_path, &zero).unwrap();
    let r = a.ok("plugin.reload", json!({}));
    assert_eq!(r["reloaded"], true, "{r}");
    assert_eq!(plugin_names(&a), plugins);
    let seq = last_seq(&a.state());
    let pass = a.pass();
    assert!(released_orphan(&pass, VF0), "the reloaded claim_grace_s = 0 releases the orphan: {pass}");
    assert_eq!(a.vf_type(VF0), 0);
    assert_eq!(writes_after(&a, seq), vec![(type_path(VF0), "0".to_string(), "ok".to_string())]);

    // A broken reload now keeps the reloaded params (0), not the start-up ones.
    a.sim.ctl(&["set-type", VF1, "1148"]).unwrap();
    std::fs::write(&a.config_path, format!("{zero}\n[[[ this is not TOML\n")).unwrap();
    let e = a.err("plugin.reload", json!({}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert_eq!(plugin_names(&a), plugins);
    let pass = a.pass();
    assert!(released_orphan(&pass, VF1), "the params in force (claim_grace_s = 0) still release: {pass}");
    assert_eq!(a.vf_type(VF1), 0);
    let v = World::observe(&a).safety_violations(&[]);
    assert!(v.is_empty(), "{v:#?}");
}

// ================================================================ 8. policy call counters

fn placement_calls(a: &Agent, plugin: &str) -> Option<f64> {
    metric(&a.metrics(), "gpuvisor_policy_calls", &[("plugin", plugin), ("kind", "placement"), ("result", "ok")])
}

fn placement_slot(a: &Agent) -> Value {
    let list = a.ok("plugin.list", json!({}));
    list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["slot"] == "placement")
        .cloned()
        .unwrap_or_else(|| panic!("no placement slot: {list}"))
}

fn dry_run(a: &Agent) {
    let d = a.ok("placement.dry_run", json!({"profile": "L40S-1Q"}));
    assert!(!d["ranked"].as_array().unwrap().is_empty(), "{d}");
}

#[test]
fn policy_call_counters_survive_reloads_and_keep_each_plugins_series() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, &w, "");
    let base = placement_calls(&a, "placement-spread").expect("the spread series is exported");
    for _ in 0..3 {
        dry_run(&a);
    }
    let before = placement_calls(&a, "placement-spread").unwrap();
    assert!(before >= base + 3.0 && before >= 3.0, "3 placement calls counted: {base} -> {before}");

    // Reload of the same plugin: the series keeps its count and grows from there.
    a.ok("plugin.reload", json!({}));
    let after = placement_calls(&a, "placement-spread");
    assert_eq!(after, Some(before), "the counter survives the reload:\n{}", a.metrics());
    dry_run(&a);
    let spread = placement_calls(&a, "placement-spread").unwrap();
    assert_eq!(spread, before + 1.0, "and grows from there");
    let slot = placement_slot(&a);
    assert_eq!(slot["name"], "placement-spread");
    assert_eq!(slot["calls_ok"].as_f64(), Some(spread), "plugin.list shows the loaded plugin's calls: {slot}");

    // Switch the slot to placement-pack: spread's series stays with its count, pack's
    // starts at 0 and counts.
    let cfg = std::fs::read_to_string(&a.config_path).unwrap();
    let spread_path = plugin("placement-spread").display().to_string();
    assert!(cfg.contains(&spread_path), "{cfg}");
    std::fs::write(&a.config_path, cfg.replace(&spread_path, &plugin("placement-pack").display().to_string())).unwrap();
    assert_eq!(a.ok("plugin.reload", json!({}))["plugins"]["placement"], "placement-pack");
    let text = a.metrics();
    assert_eq!(placement_calls(&a, "placement-spread"), Some(spread), "the old plugin's series stays:\n{text}");
    assert_eq!(placement_calls(&a, "placement-pack"), Some(0.0), "the new plugin's series starts at 0:\n{text}");
    let slot = placement_slot(&a);
    assert_eq!((slot["name"].as_str(), slot["calls_ok"].as_f64()), (Some("placement-pack"), Some(0.0)), "{slot}");
    dry_run(&a);
    dry_run(&a);
    assert_eq!(placement_calls(&a, "placement-pack"), Some(2.0));
    assert_eq!(placement_calls(&a, "placement-spread"), Some(spread), "spread no longer counts");
    let slot = placement_slot(&a);
    assert_eq!((slot["name"].as_str(), slot["calls_ok"].as_f64()), (Some("placement-pack"), Some(2.0)), "{slot}");

    // Back to spread: its series continues from its count.
    std::fs::write(&a.config_path, &cfg).unwrap();
    assert_eq!(a.ok("plugin.reload", json!({}))["plugins"]["placement"], "placement-spread");
    dry_run(&a);
    assert_eq!(placement_calls(&a, "placement-spread"), Some(spread + 1.0));
    assert_eq!(placement_calls(&a, "placement-pack"), Some(2.0), "pack's series stays");
    assert_eq!(placement_slot(&a)["calls_ok"].as_f64(), Some(spread + 1.0));
}

// ================================================================ 9. the JSON-RPC edge

#[test]
fn requests_with_a_negative_or_fractional_id_are_answered_with_invalid_request() {
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "");
    for id in ["-1", "1.5"] {
        let body = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"agent.health","params":{{}}}}"#);
        let v = rpc_raw(&a.socket, &body).unwrap_or_else(|e| panic!("id {id}: the request was not answered: {e}"));
        assert_eq!(v["error"]["code"], -32600, "id {id}: {v}");
        assert!(v.get("id").is_some() && v["id"].is_null(), "id {id}: the answer's id is null: {v}");
        assert!(v.get("result").is_none(), "id {id}: {v}");
    }
    // The same agent still answers a normal request.
    let v = rpc_raw(&a.socket, r#"{"jsonrpc":"2.0","id":7,"method":"agent.health","params":{}}"#).unwrap();
    assert_eq!(v["id"], 7, "{v}");
    assert_eq!(v["result"]["live"], true, "{v}");
}

#[test]
fn instance_get_start_and_delete_refuse_an_unknown_parameter_and_stop_still_takes_force() {
    let w = QemuWrapper::new();
    let a = agent(HOST_1VF, &w, "");
    let inst = a.ok("instance.create", json!({"name": "p", "image": "demo"}));
    let id = inst["id"].as_str().unwrap().to_string();
    assert_eq!(inst["state"], "running");
    let qemu = qemu_of(&id);
    assert_eq!(qemu.len(), 1, "{qemu:?}");

    for m in ["instance.get", "instance.start", "instance.delete"] {
        let e = a.err(m, json!({"ref": "p", "force": true}));
        assert_eq!(e.code, -32602, "{m} refuses `force` as an unknown parameter: {e}");
        let got = a.ok("instance.get", json!({"ref": "p"}));
        assert_eq!(got["state"], "running", "{m} changed nothing: {got}");
        assert!(alive(qemu[0]), "{m}: the VM still runs");
    }
    assert_eq!(a.instance_names(), vec!["p".to_string()]);

    let stopped = a.ok("instance.stop", json!({"ref": "p", "force": true}));
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert!(wait_reaped(qemu[0]) || !alive(qemu[0]), "the forced stop ended the VM");
    a.ok("instance.delete", json!({"ref": "p"}));
    assert!(a.instance_names().is_empty());
}

/// A delete holds the instance's lock for its whole operation: an update, a reset, a reboot
/// or stats of that instance answer `invalid_state` at once, instead of waiting behind it
/// (found by a fresh user: update and reset waited).
#[test]
fn update_reset_reboot_and_stats_of_an_instance_being_deleted_answer_at_once() {
    let a = Agent::start("l40s-2x16").unwrap();
    a.ok("instance.create", json!({"name": "d", "image": "demo"}));
    let p = Paused::new(&a, "delete_after_deleting_mark");
    let del = a.spawn_call("instance.delete", json!({"ref": "d"}));
    p.wait_hit(&del);

    for (method, params) in [
        ("instance.update", json!({"ref": "d", "labels": {"x": "y"}})),
        ("instance.reset", json!({"ref": "d"})),
        ("instance.reboot", json!({"ref": "d"})),
        ("instance.stats", json!({"ref": "d"})),
    ] {
        // Answered while the delete is still paused (an answer that waited for the lock
        // would come only after the release below).
        let ans = answer(a.spawn_call(method, params));
        assert_eq!(error_of(&ans), Some((409, "invalid_state".to_string())), "{method}: {ans}");
        assert_eq!(waiting(&a, "delete_after_deleting_mark"), 1, "{method}: the delete still waits");
    }

    p.release();
    let ans = answer(del);
    assert!(error_of(&ans).is_none(), "{ans}");
    assert!(a.instance_records().is_empty());
}
