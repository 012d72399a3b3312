//! Issue 18 finding 4: no instance is ever stuck. A VMM spawned but not yet recorded when
//! the agent died — slow to come up, it only listens on its control socket after the
//! restarted agent recorded the instance `stopped` — is found through that socket and
//! stopped through the kill path: by the next reconcile pass, or by a delete (never
//! `vmm_liveness_unknown` forever). Real agent, simulator and QEMU (paused, `-S`); the
//! VMM's start is gated on a file the test creates, never on a sleep.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

const HOST_V1: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 1\niommu_group = 40\n";
const VF0: &str = "0000:41:00.4";

/// An agent whose create of `s` spawned a VMM that waits for the gate file, killed before
/// it recorded the VMM, restarted, and passed until the instance is recorded `stopped`;
/// then the gate opens and the VMM (QEMU) listens on its control socket. Returns the
/// agent, the wrapper (kept alive), the instance id and QEMU's root-namespace pid.
fn stuck_instance() -> (Agent, QemuWrapper, String, i32) {
    assert_failpoints_built();
    let w = QemuWrapper::new();
    let gate = w.dir.path().join("go");
    // The probe (`--version`) passes; a VMM waits at the gate.
    w.set_hook(&format!("if [ \"$1\" != --version ]; then while [ ! -e {gate:?} ]; do sleep 0.05; done; fi\n"));
    let extra = format!("{}reconcile_interval_s = 3600\nclaim_grace_s = 1\nvmm_ready_timeout_s = 600\n", w.extra());
    let mut a =
        Agent::start_tuned(AgentOptions { model: HOST_V1, extra: &extra, ..Default::default() }, None, &[]).unwrap();
    let call = a.spawn_call("instance.create", json!({"name": "s", "image": "demo", "gpu": "L40S-2Q"}));
    // The VMM (the wrapper, waiting at the gate) was spawned: its command line names the data dir.
    let data = a.data_dir.to_string_lossy().into_owned();
    wait_for(Duration::from_secs(60), || {
        (!pids_where(|c| c.contains("qemu-wrapper") && c.contains(&data)).is_empty()).then_some(())
    })
    .expect("the VMM was spawned");
    a.kill_agent();
    assert!(call.join().unwrap().is_err(), "the create never answered");
    a.restart_clean();
    let rec = |a: &Agent| a.instance_records().into_iter().find_map(|(id, r)| r.ok().map(|r| (id, r)));
    let t0 = std::time::Instant::now();
    let id = loop {
        let rep = a.pass();
        let (id, r) = rec(&a).expect("the record");
        if r["state"] == "stopped" {
            break id;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "never recorded stopped: {r} {rep}");
        std::thread::sleep(Duration::from_millis(300));
    };
    assert_eq!(a.claim(VF0).map(|c| c["instance_id"].clone()), Some(Value::from(id.clone())), "its claim is kept");
    // The gate opens: QEMU comes up and listens on its control socket.
    std::fs::write(&gate, "").unwrap();
    let qmp = a.data_dir.join(format!("instances/{id}/vmm/qmp.sock"));
    let pid = wait_for(Duration::from_secs(60), || {
        let q = qemu_of(&id);
        (qmp.exists() && q.len() == 1).then(|| q[0])
    })
    .expect("QEMU listens");
    let got = a.ok("instance.get", json!({"ref": "s"}));
    assert_eq!(got["state"], "stopped", "{got}");
    (a, w, id, pid)
}

#[test]
fn a_vmm_found_on_the_control_socket_of_a_stopped_instance_is_stopped_by_the_next_pass() {
    let (a, _w, id, pid) = stuck_instance();
    let rep = a.pass();
    let change = rep["records"].as_array().unwrap().iter().find(|r| r["instance"] == id.as_str()).cloned();
    assert!(
        change.as_ref().is_some_and(|c| c["reason"].as_str().unwrap_or("").contains("kill path")),
        "BUG: the pass left the unrecorded VMM running: {rep}"
    );
    // Orphaned by the killed agent, QEMU is reparented to the namespace's init, which does
    // not reap: dead is a zombie here.
    assert!(wait_for(Duration::from_secs(10), || (!alive(pid)).then_some(())).is_some(), "QEMU was stopped");
    // Its claim goes at the next pass, and the instance can be deleted.
    let t0 = std::time::Instant::now();
    while a.claim(VF0).is_some() {
        assert!(t0.elapsed() < Duration::from_secs(60), "the claim stays: {}", a.pass());
        a.pass();
    }
    assert_eq!(a.vf_type(VF0), 0);
    a.ok("instance.delete", json!({"ref": "s"}));
    assert!(World::observe(&a).safety_violations(&[]).is_empty());
}

#[test]
fn a_delete_stops_an_unrecorded_vmm_through_the_kill_path_never_vmm_liveness_unknown() {
    let (a, _w, _id, pid) = stuck_instance();
    let r = a.call("instance.delete", json!({"ref": "s"}));
    assert!(r.is_ok(), "BUG: the delete is refused: {r:?}");
    // Orphaned by the killed agent, QEMU is reparented to the namespace's init, which does
    // not reap: dead is a zombie here.
    assert!(wait_for(Duration::from_secs(10), || (!alive(pid)).then_some(())).is_some(), "QEMU was stopped");
    assert_eq!(a.vf_type(VF0), 0, "the VF was released");
    assert!(a.claims().is_empty() && a.instance_records().is_empty(), "nothing left");
}
