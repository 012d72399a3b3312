//! The crash matrix (docs/design/invariants.md "How they are tested", 1): for a failpoint and an
//! operation on a vGPU instance of host V, arm the failpoint, run the operation (the agent
//! aborts, like `kill -9`), check the **safety** invariants at once (I1, I3, I4 — from the
//! store files, the simulator's state dump and the process table), crash the agent a second
//! time inside recovery (`release_after_write` or `reconcile_before_release` armed on the
//! restart), check safety again, restart it cleanly, run reconcile passes until the bounded
//! window (`claim_grace` + slack) is over, and check **liveness** (I2, I8) and the end state.
//!
//! A bystander instance runs on another VF throughout: no recovery step may touch it (I1).
//!
//! The CI subset runs as normal tests; the full matrix (every failpoint of
//! `agent/src/failpoints.rs` × the operations that reach it) is `#[ignore]`d — run it with
//! `scripts/crash-matrix`. Needs the agent built with `--features gpuvisor/failpoints`.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const GRACE_S: u64 = 2;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Create,
    Start,
    Stop,
    Delete,
    /// The reconciler's release of a dead owner's claim (the restart's startup pass and
    /// `reconcile.run`).
    Reconcile,
}

/// Every failpoint × the operations that reach it.
const MATRIX: &[(&str, Op)] = &[
    ("create_after_record", Op::Create),
    ("after_claim_commit", Op::Create),
    ("after_configure", Op::Create),
    ("vmm_id_after_record", Op::Create),
    ("vmm_id_after_instance", Op::Create),
    ("after_spawn", Op::Create),
    ("after_running", Op::Create),
    ("start_after_clear_identity", Op::Start),
    ("after_claim_commit", Op::Start),
    ("after_configure", Op::Start),
    ("after_spawn", Op::Start),
    ("after_running", Op::Start),
    ("stop_after_stopping_mark", Op::Stop),
    ("stop_after_vmm_dead", Op::Stop),
    ("release_before_write", Op::Stop),
    ("release_after_write", Op::Stop),
    ("release_after_claim_remove", Op::Stop),
    ("stop_after_stopped", Op::Stop),
    ("delete_after_deleting_mark", Op::Delete),
    ("delete_after_vmm_dead", Op::Delete),
    ("release_before_write", Op::Delete),
    ("release_after_write", Op::Delete),
    ("release_after_claim_remove", Op::Delete),
    ("delete_after_release", Op::Delete),
    ("delete_before_vmm_id_release", Op::Delete),
    ("reconcile_before_release", Op::Reconcile),
    ("reconcile_after_release", Op::Reconcile),
    ("release_before_write", Op::Reconcile),
    ("release_after_write", Op::Reconcile),
    ("release_after_claim_remove", Op::Reconcile),
];

fn wait_idle(a: &Agent, vf: &str) {
    wait_for(Duration::from_secs(10), || {
        let e = vf_entry(&a.state(), vf);
        (e["handles"].as_array().map(|h| h.is_empty()).unwrap_or(true) && e["busy_until_ms"].is_null()).then_some(())
    });
}

/// What one case saw.
#[derive(Debug, Default)]
struct CaseReport {
    /// The first failpoint was hit (the operation died with the agent).
    crashed: bool,
    /// The second failpoint (inside recovery) was hit.
    crashed_in_recovery: bool,
    /// Invariant violations, each prefixed with the phase.
    violations: Vec<String>,
    notes: Vec<String>,
}

fn safety(a: &Agent, phase: &str, out: &mut Vec<String>) {
    for v in World::observe(a).safety_violations(&[]) {
        out.push(format!("[{phase}] {v}"));
    }
}

fn run_op(a: &Agent, op: Op) -> Result<Value, RpcError> {
    match op {
        Op::Create => a.create_gpu("vm", "L40S-2Q"),
        Op::Start => a.call("instance.start", json!({"ref": "vm"})),
        Op::Stop => a.call("instance.stop", json!({"ref": "vm", "force": true})),
        Op::Delete => a.call("instance.delete", json!({"ref": "vm"})),
        Op::Reconcile => a.call("reconcile.run", json!({})),
    }
}

/// Restarts with `fp` armed and drives passes for the bounded window; true when the agent
/// died (the failpoint was hit, in the startup pass or in a `reconcile.run`).
fn recover_with_crash(a: &mut Agent, fp: &str) -> bool {
    if a.restart_with_failpoints(Some(&format!("{fp}=return"))).is_err() {
        a.wait_agent_gone(Duration::from_secs(10));
        return true;
    }
    let deadline = Instant::now() + Duration::from_secs(GRACE_S + 4);
    while Instant::now() < deadline {
        match a.call("agent.health", json!({})) {
            Err(_) => {
                if a.wait_agent_gone(Duration::from_secs(5)) {
                    return true;
                }
            }
            Ok(h) if h["ready"] == true => match a.call("reconcile.run", json!({})) {
                Err(e) if is_transport(&e) => {
                    assert!(a.wait_agent_gone(Duration::from_secs(10)), "agent did not die at {fp}");
                    return true;
                }
                _ => {}
            },
            Ok(_) => {}
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    false
}

/// One cell of the matrix. `Err` only for harness problems; invariant violations are in the
/// report.
fn run_case(fp: &str, op: Op, fp2: &str) -> CaseReport {
    assert_failpoints_built();
    let mut r = CaseReport::default();
    let mut a = Agent::start_with(AgentOptions {
        model: HOST_V,
        extra: &format!("claim_grace_s = {GRACE_S}\n"),
        ..Default::default()
    })
    .unwrap();
    // The bystander: a running instance no recovery may touch.
    let by = a.create_gpu("by", "L40S-2Q").unwrap();
    let by_vf = by["gpu"]["device"].as_str().unwrap().to_string();
    match op {
        Op::Create => {}
        Op::Start => {
            a.create_gpu("vm", "L40S-2Q").unwrap();
            a.ok("instance.stop", json!({"ref": "vm", "force": true}));
        }
        Op::Stop | Op::Delete => {
            a.create_gpu("vm", "L40S-2Q").unwrap();
        }
        Op::Reconcile => {
            let vm = a.create_gpu("vm", "L40S-2Q").unwrap();
            let id = vm["id"].as_str().unwrap().to_string();
            a.kill_agent();
            for q in a.live_qemus().into_iter().filter(|q| q.instance_id.as_deref() == Some(&id)) {
                sigkill(q.pid);
            }
            wait_for(Duration::from_secs(10), || (a.qemu_pids().len() == 1).then_some(()));
            wait_idle(&a, vm["gpu"]["device"].as_str().unwrap());
        }
    }
    safety(&a, "setup", &mut r.violations);

    // Crash 1.
    let armed = format!("{fp}=return");
    if op == Op::Reconcile {
        r.crashed = recover_with_crash(&mut a, fp);
    } else {
        a.restart_with_failpoints(Some(&armed)).unwrap();
        a.wait_ready().unwrap();
        match run_op(&a, op) {
            Err(e) if is_transport(&e) => {
                r.crashed = a.wait_agent_gone(Duration::from_secs(10));
                if !r.crashed {
                    r.notes.push("transport error but the agent lives".into());
                }
            }
            Ok(_) => r.notes.push(format!("{op:?} succeeded: {fp} not reached")),
            Err(e) => r.notes.push(format!("{op:?} failed without a crash: {e}")),
        }
    }
    if !r.crashed {
        return r;
    }
    safety(&a, "after crash 1", &mut r.violations);

    // Crash 2, inside recovery.
    r.crashed_in_recovery = recover_with_crash(&mut a, fp2);
    if r.crashed_in_recovery {
        safety(&a, &format!("after crash 2 at {fp2}"), &mut r.violations);
    }

    // Clean recovery: passes until the bounded window is over (or liveness holds).
    a.restart_clean();
    safety(&a, "after clean restart", &mut r.violations);
    let t0 = Instant::now();
    let window = Duration::from_secs(GRACE_S + 6);
    loop {
        match a.call("reconcile.run", json!({})) {
            Ok(rep) => {
                if rep["inventory_complete"] != true {
                    r.violations.push(format!("[recovery] incomplete inventory: {rep}"));
                }
            }
            Err(e) => r.violations.push(format!("[recovery] reconcile.run failed: {e}")),
        }
        safety(&a, "recovery pass", &mut r.violations);
        let w = World::observe(&a);
        if (w.liveness_violations().is_empty() && t0.elapsed() > Duration::from_millis(GRACE_S * 1000 + 500))
            || t0.elapsed() > window
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(400));
    }
    // Recovery alone must have settled an interrupted stop: a record that still says
    // `stopping` (or `running` without a VMM) after the window breaks I8. An interrupted
    // delete may stay `deleting` (nothing may restart it) until the client retries.
    if op != Op::Delete {
        for v in World::observe(&a).liveness_violations() {
            r.violations.push(format!("[end of window, before any retry] {v}"));
        }
    }
    // A client retries an interrupted stop/delete (the transport error told it nothing).
    let retried = match op {
        Op::Stop => Some(a.call("instance.stop", json!({"ref": "vm", "force": true}))),
        Op::Delete => Some(a.call("instance.delete", json!({"ref": "vm"}))),
        _ => None,
    };
    if let Some(Err(e)) = &retried {
        if !(op == Op::Delete && e.data_code == "not_found") {
            r.violations.push(format!("[retry] the retried {op:?} failed: {e}"));
        }
    }
    if retried.is_some() {
        a.call("reconcile.run", json!({})).ok();
        safety(&a, "after retry", &mut r.violations);
    }
    let w = World::observe(&a);
    for v in w.liveness_violations() {
        r.violations.push(format!("[end of window] {v}"));
    }
    // End state (I10: the same as an uninterrupted recovery).
    let vm = a.call("instance.get", json!({"ref": "vm"}));
    let vm_state = vm.as_ref().ok().map(|v| v["state"].as_str().unwrap_or("").to_string());
    let ok_end = match op {
        Op::Create | Op::Start => matches!(vm_state.as_deref(), None | Some("stopped") | Some("running")),
        Op::Stop | Op::Reconcile => vm_state.as_deref() == Some("stopped"),
        Op::Delete => vm_state.is_none(),
    };
    if !ok_end {
        r.violations.push(format!("[end state] vm is {vm_state:?} after an interrupted {op:?}"));
    }
    if vm_state.as_deref() == Some("running") {
        let dev = vm.as_ref().unwrap()["gpu"]["device"].as_str().map(String::from);
        if dev.is_none() {
            r.violations.push("[end state] vm running without a GPU".into());
        }
    } else if a.claims().iter().any(|c| c["device"] != by_vf.as_str()) {
        r.violations.push(format!("[end state] claims left besides the bystander's: {:?}", a.claims()));
    }
    // The bystander is untouched.
    let byv = a.ok("instance.get", json!({"ref": "by"}));
    if byv["state"] != "running" || a.vf_type(&by_vf) != 1148 || a.claim_file(&by_vf).is_none() {
        r.violations.push(format!("[I1] the bystander was disturbed: {byv}; vf type {}", a.vf_type(&by_vf)));
    }
    // I16 after recovery: a new instance gets a VMM id of its own (a crash around the id's
    // records never hands one id to two instances), and runs under it.
    match a.call("instance.create", json!({"name": "fresh", "image": "demo"})) {
        Ok(f) => {
            safety(&a, "with a fresh instance", &mut r.violations);
            let ids: Vec<u64> = ["by", "vm", "fresh"]
                .iter()
                .filter_map(|n| a.call("instance.get", json!({"ref": n})).ok())
                .filter_map(|v| v["vmm_id"].as_u64())
                .collect();
            let mut uniq = ids.clone();
            uniq.sort();
            uniq.dedup();
            if uniq.len() != ids.len() {
                r.violations.push(format!("[I16] VMM ids are shared after recovery: {ids:?}"));
            }
            a.call("instance.delete", json!({"ref": f["name"]})).ok();
        }
        Err(e) => r.violations.push(format!("[end state] a fresh instance cannot be created: {e}")),
    }
    r.notes.push(format!("end: vm {vm_state:?}, claims {}", a.claims().len()));
    r
}

fn second_failpoint(fp: &str) -> &'static str {
    if fp == "release_after_write" {
        "reconcile_before_release"
    } else {
        "release_after_write"
    }
}

fn check(fp: &str, op: Op, fp2: &str) {
    let r = run_case(fp, op, fp2);
    eprintln!("{fp} × {op:?} (then {fp2}): {r:?}");
    assert!(r.crashed, "{fp} was not reached by {op:?}: {:?}", r.notes);
    assert!(
        r.violations.is_empty(),
        "{fp} × {op:?}, second crash at {fp2}: invariant violations:\n{}",
        r.violations.join("\n")
    );
}

// ------------------------------------------------------------------------------------- CI subset

#[test]
fn crash_stop_after_stopping_mark() {
    // Regression: the interrupted stop left the record `stopping` (with its VMM alive) until
    // a client retried; recovery now moves it back to `running` by itself.
    check("stop_after_stopping_mark", Op::Stop, "release_after_write");
}

#[test]
fn crash_after_claim_commit_during_create() {
    check("after_claim_commit", Op::Create, "reconcile_before_release");
}

#[test]
fn crash_after_configure_during_start() {
    check("after_configure", Op::Start, "release_after_write");
}

#[test]
fn crash_after_spawn_during_create() {
    check("after_spawn", Op::Create, "release_after_write");
}

#[test]
fn crash_vmm_id_after_record_during_create() {
    check("vmm_id_after_record", Op::Create, "release_after_write");
}

#[test]
fn crash_vmm_id_after_instance_during_create() {
    check("vmm_id_after_instance", Op::Create, "reconcile_before_release");
}

#[test]
fn crash_delete_before_vmm_id_release() {
    check("delete_before_vmm_id_release", Op::Delete, "reconcile_before_release");
}

#[test]
fn crash_stop_after_vmm_dead() {
    check("stop_after_vmm_dead", Op::Stop, "reconcile_before_release");
}

#[test]
fn crash_release_after_write_during_delete() {
    check("release_after_write", Op::Delete, "reconcile_before_release");
}

#[test]
fn crash_delete_after_vmm_dead() {
    check("delete_after_vmm_dead", Op::Delete, "release_after_write");
}

// ------------------------------------------------------------------------------------- full matrix

#[test]
#[ignore = "the full crash matrix (minutes): scripts/crash-matrix"]
fn full_crash_matrix() {
    let all = all_failpoints();
    for name in &all {
        assert!(MATRIX.iter().any(|(f, _)| f == name), "failpoint {name} is not in the matrix");
    }
    let t0 = Instant::now();
    let (mut passed, mut failed, mut unreached) = (0, 0, 0);
    let mut failures = Vec::new();
    for (fp, op) in MATRIX {
        let fp2 = second_failpoint(fp);
        let started = Instant::now();
        let res = std::panic::catch_unwind(|| run_case(fp, *op, fp2));
        let crash2 = match &res {
            Ok(r) if r.crashed_in_recovery => "crash 2 hit",
            Ok(r) if r.crashed => "crash 2 not reached",
            _ => "",
        };
        let verdict = match res {
            Ok(r) if !r.crashed => {
                unreached += 1;
                failures.push(format!("{fp} × {op:?}: NOT REACHED {:?}", r.notes));
                "NOT REACHED"
            }
            Ok(r) if r.violations.is_empty() => {
                passed += 1;
                "PASS"
            }
            Ok(r) => {
                failed += 1;
                failures.push(format!("{fp} × {op:?} (second crash at {fp2}):\n    {}", r.violations.join("\n    ")));
                "FAIL"
            }
            Err(_) => {
                failed += 1;
                failures.push(format!("{fp} × {op:?}: harness panic"));
                "PANIC"
            }
        };
        eprintln!(
            "[matrix] {verdict:<11} {fp} × {op:?} (then {fp2}: {crash2}) in {:.1}s",
            started.elapsed().as_secs_f64()
        );
    }
    eprintln!("\n[matrix] failures:\n{}", failures.join("\n"));
    eprintln!(
        "[matrix] {passed} passed, {failed} failed, {unreached} not reached ({} cases, {} failpoints) in {:.0}s",
        MATRIX.len(),
        all.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(failed == 0 && unreached == 0, "{passed} passed, {failed} failed, {unreached} not reached");
}
