//! docs/design/scenarios.md §7 "Liveness & kill path": S032(a), S034, S035(a)(b), S037, against the real
//! agent, gpuvisor-sim and QEMU (guests paused through a `qemu_binary` wrapper; the kill
//! path does not need a booted guest). Pids written into records are pids of the agent's
//! PID namespace (the agent sees only that namespace's /proc).

use gpuvisor_e2e::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const HOST_V: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
const VF0: &str = "0000:41:00.4";
const ESC: &str = "gpuvisor_vmm_kill_escalations_total";

fn agent(w: &QemuWrapper) -> Agent {
    let extra = w.extra() + "reconcile_interval_s = 3600\n";
    Agent::start_tuned(AgentOptions { model: HOST_V, extra: &extra, ..Default::default() }, None, &[]).unwrap()
}

/// An unrelated `sleep` in the agent's namespace: (namespace pid, root pid).
fn ns_sleep(a: &Agent, tag: &str) -> (i32, i32) {
    let (_c, line) = a.ns_sh(&format!("echo $$; exec sleep {tag}"));
    let nspid: i32 = line.parse().unwrap();
    let root =
        wait_for(Duration::from_secs(5), || root_pid_of(nspid, |c| c.contains(&format!("sleep {tag}")))).unwrap();
    (nspid, root)
}

/// Polls (bounded) until `pid` is gone; returns when it was first seen gone.
fn watch_exit(pid: i32) -> std::thread::JoinHandle<Option<Instant>> {
    std::thread::spawn(move || wait_for(Duration::from_secs(60), || (!alive(pid)).then(Instant::now)))
}

#[test]
fn s032a_liveness_across_a_host_reboot_and_an_agent_restart() {
    let w = QemuWrapper::new();
    let mut a = agent(&w);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    assert_eq!(inst["gpu"]["device"], VF0);
    let qemu = qemu_of(&id)[0];

    // The host reboots: the agent and every VM die, the simulator returns to its boot state
    // with a new boot id.
    let old_boot = a.state()["boot_id"].clone();
    a.kill_agent();
    kill(Pid::from_raw(qemu), Signal::SIGKILL).unwrap();
    wait_for(Duration::from_secs(10), || (!alive(qemu)).then_some(())).expect("QEMU died");
    a.sim.ctl(&["reboot"]).unwrap();
    let st = a.state();
    assert_ne!(st["boot_id"], old_boot);
    assert_eq!(a.vf_type(VF0), 0, "vf0 reads 0 after the reboot");
    // The recorded pid is now an unrelated process of the new boot.
    let (nspid, sleep_root) = ns_sleep(&a, "3032");
    let mut rec = a.record(&id);
    assert_eq!(rec["state"], "running");
    rec["vmm"]["identity"]["pid"] = json!(nspid);
    a.write_record(&id, &rec);
    let n_writes = writes(&a.state()).len();

    a.spawn().unwrap();
    a.wait_ready().unwrap();
    a.ok("reconcile.run", json!({}));
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["state"], "stopped", "{got}");
    assert!(a.claim(VF0).is_none(), "the claim row is dropped: {:?}", a.claims());
    assert_eq!(writes(&a.state()).len(), n_writes, "no sysfs write: {:?}", writes(&a.state()));
    assert!(alive(sleep_root), "the unrelated process received nothing");

    assert_eq!(a.ok("instance.stop", json!({"ref": "a"}))["state"], "stopped");
    assert_eq!(a.ok("instance.delete", json!({"ref": "a"}))["deleted"], true);
    assert_eq!(writes(&a.state()).len(), n_writes, "still no sysfs write");
    assert!(alive(sleep_root), "the unrelated process received nothing");
}

#[test]
fn s034_the_kill_path_spares_a_recycled_pid_and_stops_the_qmp_owner() {
    let w = QemuWrapper::new();
    let a = agent(&w);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    assert_eq!(inst["gpu"]["device"], VF0);
    let qemu = qemu_of(&id)[0];
    let qemu_ns = ns_pid(qemu).unwrap();
    let qmp = PathBuf::from(inst["vmm"]["control_socket"].as_str().unwrap());
    let group = vf_entry(&a.state(), VF0)["group"].as_u64().unwrap();
    let node = a.sim.path().join(format!("dev/vfio/{group}")).display().to_string();
    assert!(fd_targets(qemu).contains(&node), "QEMU holds {node}");

    // The recorded pid has been recycled into an unrelated sleep (same boot, other start time).
    let (nspid, sleep_root) = ns_sleep(&a, "3034");
    let mut rec = a.record(&id);
    assert_eq!(rec["vmm"]["identity"]["pid"], qemu_ns);
    rec["vmm"]["identity"]["pid"] = json!(nspid);
    a.write_record(&id, &rec);

    let mut problems = Vec::new();
    let got = a.ok("instance.get", json!({"ref": "a"}));
    if got["vmm"]["pid"] == nspid {
        problems.push(format!("GET reports the recycled pid {nspid} as A's VMM: vmm = {}", got["vmm"]));
    }

    let exit = watch_exit(qemu);
    let stopped = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert!(exit.join().unwrap().is_some(), "QEMU (the QMP owner) was stopped");
    assert!(alive(sleep_root), "the recycled pid received no signal and survives");
    assert!(!qmp.exists(), "A's QMP socket file is removed");
    assert_eq!(a.vf_type(VF0), 0, "vf0 is released");
    assert!(a.claims().is_empty());
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn s035b_sigkill_follows_sigterm_after_the_grace() {
    let w = QemuWrapper::new();
    let a = agent(&w);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    let qemu = qemu_of(&id)[0];
    let esc0 = metric0(&a.metrics(), ESC, &[("signal", "SIGKILL")]);
    // The VMM does not react to SIGTERM.
    kill(Pid::from_raw(qemu), Signal::SIGSTOP).unwrap();

    let exit = watch_exit(qemu);
    let t0 = Instant::now();
    let stopped = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    let took = t0.elapsed();
    assert_eq!(stopped["state"], "stopped");
    let died = exit.join().unwrap().expect("QEMU died").duration_since(t0);
    // The harness's vfio_term_grace_s is 2 (the scenario's 5 s is the production default).
    assert!(
        died >= Duration::from_millis(1900) && died <= Duration::from_secs(20),
        "SIGKILL after the 2 s grace: QEMU died after {died:?}"
    );
    assert!(took >= died, "stop answered after the exit");
    assert_eq!(metric0(&a.metrics(), ESC, &[("signal", "SIGKILL")]), esc0 + 1.0);
    let log = a.log();
    assert!(
        log.lines().any(|l| l.contains("SIGKILL") && l.contains(VF0) && l.contains("WARN")),
        "a warning names the device: {}",
        tail(&log, 30)
    );
    let gpus = a.ok("gpu.list", json!({}));
    let dev = gpus["gpus"][0]["devices"].as_array().unwrap().iter().find(|d| d["address"] == VF0).unwrap().clone();
    assert_eq!(dev["quarantine"]["reason"], "kill_escalation", "the VF is marked suspect: {dev}");
    assert_eq!(a.vf_type(VF0), 0, "released after the exit");
    assert!(a.claims().is_empty());
}

#[test]
fn s035a_s037_a_vmm_exiting_on_sigterm_gets_no_sigkill_and_one_clear() {
    // S035(a) "QEMU exits 2 s after SIGTERM" cannot be staged (QEMU installs its own SIGTERM
    // handler and exits at once); the closest real test: a VMM that exits on SIGTERM within
    // the grace gets no SIGKILL and no suspect mark. S037: the agent's exit watcher (reaper
    // thread) already waits on QEMU, its own child; the stop neither hangs nor reports a
    // false kill error, and the VF is cleared exactly once.
    let w = QemuWrapper::new();
    let a = agent(&w);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    let qemu = qemu_of(&id)[0];
    let esc0 = metric0(&a.metrics(), ESC, &[]);
    let exit = watch_exit(qemu);
    let t0 = Instant::now();
    let stopped = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    let took = t0.elapsed();
    assert_eq!(stopped["state"], "stopped");
    let died = exit.join().unwrap().expect("QEMU died").duration_since(t0);
    assert!(died < Duration::from_secs(2), "exited within the grace: {died:?}");
    assert!(took < Duration::from_secs(8), "no hang: {took:?}");
    assert_eq!(metric0(&a.metrics(), ESC, &[]), esc0, "no SIGKILL escalation");
    let gpus = a.ok("gpu.list", json!({}));
    let dev = gpus["gpus"][0]["devices"].as_array().unwrap().iter().find(|d| d["address"] == VF0).unwrap().clone();
    assert!(dev["quarantine"].is_null(), "no suspect mark: {dev}");
    let clears: Vec<_> = type_writes_of(&a.state(), VF0).into_iter().filter(|(v, r)| v == "0" && r == "ok").collect();
    assert_eq!(clears.len(), 1, "exactly one clear of A's VF: {:?}", type_writes_of(&a.state(), VF0));
    assert_eq!(a.vf_type(VF0), 0);
}
