//! The restart policy and autostart (docs/api.md `restart`, `autostart`), against the real
//! agent, gpuvisor-sim and QEMU: a killed `on-failure` GPU instance runs again with a vGPU,
//! its old claim released before the new one is configured; `no` stays stopped; the
//! backoff and the limit hold; `autostart` instances start again after a simulated reboot.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

fn get(a: &Agent, name: &str) -> Value {
    a.ok("instance.get", json!({"ref": name}))
}

/// Waits until `name` runs a VMM other than `old` (root-namespace pid); returns the new pid.
fn wait_restarted(a: &Agent, id: &str, old: i32) -> i32 {
    wait_for(Duration::from_secs(90), || {
        let q: Vec<LiveQemu> = a.live_qemus().into_iter().filter(|q| q.instance_id.as_deref() == Some(id)).collect();
        (q.len() == 1 && q[0].pid != old && get(a, id)["state"] == "running").then(|| q[0].pid)
    })
    .unwrap_or_else(|| panic!("{id} was not restarted: {}\n{}", get(a, id), tail(&a.log(), 20)))
}

/// An `on-failure` GPU instance whose QEMU is SIGKILLed runs again with a vGPU, through the
/// start path: the old VF is cleared (written 0, read back) before any new type is written.
#[test]
fn an_on_failure_gpu_instance_runs_again_after_its_qemu_is_killed_old_claim_released_first() {
    let a = Agent::start(HOST_V).unwrap();
    let v = a
        .call("instance.create", json!({"name": "r", "image": "demo", "gpu": "L40S-2Q", "restart": "on-failure"}))
        .unwrap();
    assert_eq!((v["restart"].as_str(), v["restarts"]["attempts"].as_u64()), (Some("on-failure"), Some(0)), "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let old_vf = v["gpu"]["device"].as_str().unwrap().to_string();
    let old = a.qemu_pid(&id);
    let n = a.sim_writes().len();
    sigkill(old);
    let new = wait_restarted(&a, &id, old);
    assert_ne!(new, old);
    let r = get(&a, "r");
    assert_eq!(r["restarts"]["attempts"], 1, "{r}");
    assert!(r["gpu"]["device"].is_string(), "it runs with a vGPU again: {r}");
    // The old VF's clear comes before the new type write.
    let w: Vec<(String, String, String)> = a.sim_writes()[n..]
        .iter()
        .filter(|(p, _, res)| p.ends_with("current_vgpu_type") && res == "ok")
        .cloned()
        .collect();
    let clear = w.iter().position(|(p, v, _)| p.contains(&old_vf) && v.trim() == "0");
    let set = w.iter().position(|(_, v, _)| v.trim() != "0");
    assert!(matches!((clear, set), (Some(c), Some(s)) if c < s), "old claim released first: {w:?}");
    assert_eq!(metric(&a.metrics(), "gpuvisor_instance_restarts_total", &[("result", "ok")]), Some(1.0));
    assert_eq!(a.claims().len(), 1, "one claim: {:?}", a.claims());
}

/// `no` (the default) stays stopped after its VMM dies; `always` runs again.
#[test]
fn no_stays_stopped_and_always_runs_again() {
    let a = Agent::start(HOST_V).unwrap();
    let n = a.ok("instance.create", json!({"name": "n", "image": "demo"}));
    let w = a.ok("instance.create", json!({"name": "w", "image": "demo", "restart": "always"}));
    let (nid, wid) = (n["id"].as_str().unwrap().to_string(), w["id"].as_str().unwrap().to_string());
    let (npid, wpid) = (a.qemu_pid(&nid), a.qemu_pid(&wid));
    sigkill(npid);
    sigkill(wpid);
    wait_restarted(&a, &wid, wpid);
    a.pass();
    let n = get(&a, "n");
    assert_eq!(n["state"], "stopped", "{n}");
    assert_eq!(n["restarts"]["attempts"], 0, "{n}");
    assert!(a.live_qemus().iter().all(|q| q.instance_id.as_deref() != Some(nid.as_str())));
}

/// The backoff doubles and the limit holds: with every start failing ("QEMU" exits at once),
/// `restart_limit = 3` restarts are tried, at least 1 s then 2 s apart, then the instance
/// stays `stopped`, saying why; a start by hand resets the count.
#[test]
fn the_backoff_doubles_and_the_limit_stops_the_restarts() {
    let q = QemuWrapper::new();
    let a = Agent::start_with(AgentOptions {
        model: HOST_V,
        extra: &format!("{}restart_limit = 3\nrestart_backoff_s = 1\n", q.extra()),
        ..Default::default()
    })
    .unwrap();
    let v = a.ok("instance.create", json!({"name": "b", "image": "demo", "restart": "on-failure"}));
    let id = v["id"].as_str().unwrap().to_string();
    q.set_hook("exit 1\n");
    sigkill(a.qemu_pid(&id));
    let b = wait_for(Duration::from_secs(90), || Some(get(&a, "b")).filter(|b| b["restarts"]["gave_up"] == true))
        .unwrap_or_else(|| panic!("the limit was never reached: {}", get(&a, "b")));
    assert_eq!(b["state"], "stopped", "{b}");
    assert_eq!(b["restarts"]["attempts"], 3, "{b}");
    assert!(b["last_error"].as_str().unwrap().contains("restart limit reached: 3 restarts"), "{b}");
    let t: Vec<u64> =
        a.record(&id)["restarts"]["attempts_ms"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(t.len(), 3);
    assert!(t[1] - t[0] >= 2000, "the second restart waits 2 s: {t:?}");
    assert!(t[2] - t[1] >= 4000, "the third waits 4 s: {t:?}");
    assert!(t[2] - t[1] >= t[1] - t[0], "the backoff grows: {t:?}");
    assert_eq!(metric(&a.metrics(), "gpuvisor_instance_restarts_total", &[("result", "gave_up")]), Some(1.0));
    // The limit holds through passes.
    a.pass();
    a.pass();
    assert_eq!(get(&a, "b")["restarts"]["attempts"], 3);
    q.clear_hook();
    let s = a.ok("instance.start", json!({"ref": "b"}));
    assert_eq!(s["state"], "running", "{s}");
    assert_eq!(
        s["restarts"],
        json!({"attempts": 0, "last_attempt_unix_ms": null, "due_unix_ms": null, "gave_up": false})
    );
}

/// After a simulated host reboot (the agent and every VM killed, the simulator's boot id
/// changed), the agent starts the `autostart` instance again, and leaves the other stopped.
#[test]
fn autostart_instances_start_again_after_a_reboot() {
    let mut a = Agent::start(HOST_V).unwrap();
    let x = a.ok("instance.create", json!({"name": "x", "image": "demo", "autostart": true}));
    let y = a.ok("instance.create", json!({"name": "y", "image": "demo"}));
    a.kill_agent();
    for v in [&x, &y] {
        sigkill(a.qemu_pid(v["id"].as_str().unwrap()));
    }
    wait_for(Duration::from_secs(10), || a.qemu_pids().is_empty().then_some(())).unwrap();
    a.sim.ctl(&["reboot"]).unwrap();
    a.restart_with_failpoints(None).unwrap();
    // Running with a live VMM (the record from before the reboot says `running` too, with
    // a VMM that is provably dead).
    let xv = wait_for(Duration::from_secs(90), || {
        Some(get(&a, "x")).filter(|v| v["state"] == "running" && v["vmm"].is_object() && v["restarts"]["attempts"] == 1)
    })
    .unwrap_or_else(|| panic!("x was not started after the reboot: {}", get(&a, "x")));
    assert_eq!(xv["restarts"]["attempts"], 1, "{xv}");
    let yv = get(&a, "y");
    assert_eq!(yv["state"], "stopped", "{yv}");
    assert!(yv["last_error"].as_str().unwrap().contains("rebooted"), "{yv}");
}

/// Reboots the simulated host under `a` (agent and VMs killed first) with the VFs coming
/// back `vf_delay_ms` after the reboot, and starts the agent again.
fn reboot_with_late_vfs(a: &mut Agent, vf_delay_ms: u64) {
    a.kill_agent();
    for pid in a.qemu_pids() {
        sigkill(pid);
    }
    wait_for(Duration::from_secs(10), || a.qemu_pids().is_empty().then_some(())).unwrap();
    a.sim.ctl(&["reboot", "--vf-delay", &vf_delay_ms.to_string()]).unwrap();
    a.restart_with_failpoints(None).unwrap();
}

/// Issue 18 finding 5: after a reboot, an `autostart` vGPU instance whose first start is
/// refused because the host has no VFs yet (`not_ready`) is tried again with backoff until
/// the VFs appear, and runs with a vGPU; the tries that waited for the host do not count
/// as restarts, and the wait is logged once at WARN.
#[test]
fn autostart_waits_for_the_host_until_its_vfs_appear() {
    let mut a = Agent::start(HOST_V).unwrap();
    let x = a.ok("instance.create", json!({"name": "x", "image": "demo", "gpu": "L40S-2Q", "autostart": true}));
    let id = x["id"].as_str().unwrap().to_string();
    reboot_with_late_vfs(&mut a, 6000);
    // Started after the reboot: a live QEMU again (every VMM was killed with the host).
    let xv = wait_for(Duration::from_secs(120), || {
        Some(get(&a, "x")).filter(|v| {
            v["state"] == "running"
                && v["gpu"]["device"].is_string()
                && a.live_qemus().iter().any(|q| q.instance_id.as_deref() == Some(id.as_str()))
        })
    })
    .unwrap_or_else(|| panic!("BUG: x was not started once the host was ready: {}", get(&a, "x")));
    assert_eq!(xv["restarts"]["attempts"], 1, "the waits are not restarts: {xv}");
    let log = a.log();
    let waits = log.lines().filter(|l| l.contains(" WARN ") && l.contains("the restart waits")).count();
    assert_eq!(waits, 1, "the wait for the host is warned once");
}

/// Issue 18 finding 5: the wait for the host is bounded (`restart_host_wait_s`): past it
/// the instance stays `stopped`, `gave_up`, and `last_error` names the bound.
#[test]
fn autostart_gives_up_waiting_for_the_host_after_restart_host_wait_s() {
    let mut a =
        Agent::start_tuned(AgentOptions { model: HOST_V, ..Default::default() }, None, &[("restart_host_wait_s", "3")])
            .unwrap();
    a.ok("instance.create", json!({"name": "x", "image": "demo", "gpu": "L40S-2Q", "autostart": true}));
    reboot_with_late_vfs(&mut a, 600_000);
    let xv = wait_for(Duration::from_secs(60), || Some(get(&a, "x")).filter(|v| v["restarts"]["gave_up"] == true))
        .unwrap_or_else(|| panic!("never gave up: {}", get(&a, "x")));
    assert_eq!(xv["state"], "stopped", "{xv}");
    assert!(xv["last_error"].as_str().unwrap().contains("restart_host_wait_s"), "{xv}");
    assert_eq!(metric0(&a.metrics(), "gpuvisor_instance_restarts_total", &[("result", "gave_up")]), 1.0);
}
