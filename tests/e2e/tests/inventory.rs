//! docs/design/scenarios.md §9 "Fail-closed inventory" (S043–S045), S010 (concurrent creates) and the
//! single-writer rule (docs/design/invariants.md I11).

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

fn device<'a>(gpus: &'a Value, addr: &str) -> &'a Value {
    gpus["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["devices"].as_array().unwrap().iter())
        .find(|d| d["address"] == addr)
        .unwrap_or_else(|| panic!("{addr} not listed: {gpus}"))
}

fn type_writes_to(a: &Agent, vf: &str) -> usize {
    let path = format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type");
    writes(&a.state()).iter().filter(|(p, _, _)| *p == path).count()
}

#[test]
fn s010_nine_concurrent_creates_on_eight_vfs_never_share_a_device() {
    let a = Agent::start(HOST_V2).unwrap();
    let socket = a.socket.clone();
    let threads: Vec<_> = (0..9)
        .map(|i| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let body = json!({"jsonrpc": "2.0", "id": i, "method": "instance.create",
                    "params": {"name": format!("c{i}"), "image": "demo", "gpu": "L40S-1Q"}})
                .to_string();
                rpc_raw(&socket, &body).unwrap()
            })
        })
        .collect();
    let answers: Vec<Value> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let ok: Vec<&Value> = answers.iter().filter(|v| v.get("result").is_some()).collect();
    let failed: Vec<&Value> = answers.iter().filter(|v| v.get("error").is_some()).collect();
    assert_eq!(ok.len(), 8, "{answers:?}");
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["error"]["data"]["code"], "no_capacity");
    let mut devices: Vec<&str> = ok.iter().map(|v| v["result"]["gpu"]["device"].as_str().unwrap()).collect();
    devices.sort();
    devices.dedup();
    assert_eq!(devices.len(), 8, "eight distinct VFs");
    assert_eq!(a.claims().len(), 8);
    // No VF was written twice (one set per VF, no clears).
    let w = writes(&a.state());
    let sets: Vec<_> = w.iter().filter(|(p, v, r)| p.ends_with("current_vgpu_type") && v != "0" && r == "ok").collect();
    assert_eq!(sets.len(), 8, "{w:?}");
}

#[test]
fn s043_one_unreadable_vf_is_skipped_not_guessed() {
    let a =
        Agent::start_with(AgentOptions { model: HOST_V, extra: "claim_grace_s = 1\n", ..Default::default() }).unwrap();
    let vf2 = "0000:41:00.6";
    let vf3 = "0000:41:00.7";
    a.sim
        .ctl(&["fail-read", &format!("sys/bus/pci/devices/{vf2}/nvidia/current_vgpu_type"), "EIO", "--always"])
        .unwrap();
    a.sim.ctl(&["set-type", vf3, "1147"]).unwrap();
    let res = a.ok("resources.get", json!({}));
    assert_eq!(res["devices"]["unreadable"], 1, "{res}");
    assert_eq!(res["devices"]["allocatable"], 2, "vf2 is neither allocatable nor free: {res}");
    let gpus = a.ok("gpu.list", json!({}));
    assert_eq!(device(&gpus, vf2)["state"], "unreadable");
    let addrs: Vec<&str> =
        gpus["gpus"][0]["devices"].as_array().unwrap().iter().map(|d| d["address"].as_str().unwrap()).collect();
    assert_eq!(addrs, vec!["0000:41:00.4", "0000:41:00.5", vf2, vf3], "address order");
    let inst = a.create_gpu("a", "L40S-1Q").unwrap();
    let dev = inst["gpu"]["device"].as_str().unwrap();
    assert!(dev == "0000:41:00.4" || dev == "0000:41:00.5", "A lands on vf0 or vf1, got {dev}");
    // Passes until the orphan vf3 is older than claim_grace: it is swept, vf2 never written.
    let swept = wait_for(Duration::from_secs(20), || {
        let r = a.ok("reconcile.run", json!({}));
        r["released"].as_array().unwrap().iter().any(|x| x["device"] == vf3).then_some(())
    });
    assert!(swept.is_some(), "vf3 was swept");
    assert_eq!(a.vf_type(vf3), 0);
    assert_eq!(type_writes_to(&a, vf2), 0, "vf2 was never written");
}

#[test]
fn s044a_an_mdev_bus_probe_error_means_not_ready_never_a_fallback() {
    let a = Agent::start("l40s-mdev").unwrap();
    a.sim.ctl(&["fail-read", "sys/class/mdev_bus", "EIO", "--always"]).unwrap();
    let res = a.ok("resources.get", json!({}));
    assert_eq!(res["mode"], "probe_error", "{res}");
    assert_eq!(a.ok("agent.health", json!({}))["ready"], false);
    let e = a.create_gpu("a", "L40S-1Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (503, "not_ready"), "{e}");
    assert!(writes(&a.state()).is_empty(), "no sysfs writes");
    a.sim.ctl(&["clear-faults"]).unwrap();
    assert_eq!(a.ok("agent.health", json!({}))["ready"], true);
    a.create_gpu("a", "L40S-1Q").unwrap();
}

#[test]
fn s044b_a_pci_devices_probe_error_means_not_ready() {
    let a = Agent::start(HOST_V).unwrap();
    a.sim.ctl(&["fail-read", "sys/bus/pci/devices", "EIO", "--always"]).unwrap();
    assert_eq!(a.ok("resources.get", json!({}))["mode"], "probe_error");
    assert_eq!(a.ok("agent.health", json!({}))["ready"], false);
    let e = a.create_gpu("a", "L40S-1Q").unwrap_err();
    assert_eq!(e.data_code, "not_ready", "{e}");
    assert!(writes(&a.state()).is_empty());
}

#[test]
fn s045_starting_before_the_vfs_exist_and_catalogs_are_never_cached() {
    let model = "vfs_at_boot = false\nrelease_delay_ms = 200\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
    let a = Agent::start(model).unwrap();
    let res = a.ok("resources.get", json!({}));
    assert_eq!(res["mode"], "waiting_for_vfs", "{res}");
    let e = a.create_gpu("early", "L40S-1Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (503, "not_ready"), "{e}");
    a.sim.ctl(&["enable-vfs", "0000:41:00.0", "--delay", "1500"]).unwrap();
    wait_for(Duration::from_secs(20), || (a.ok("resources.get", json!({}))["mode"] == "vendor_vfio").then_some(()))
        .expect("the VFs appear");
    a.ok("reconcile.run", json!({}));
    let res = a.ok("resources.get", json!({}));
    assert!(
        res["profiles"].as_array().unwrap().iter().any(|p| p["profile"] == "L40S-1Q" && p["placeable"] == 4),
        "{res}"
    );
    let inst = a.create_gpu("a", "L40S-1Q").unwrap();
    assert_eq!(inst["gpu"]["type_id"], 1147);
    a.ok("instance.delete", json!({"ref": "a"}));
    // A driver reload shifts every type id; the next claim looks the name up afresh.
    a.sim.ctl(&["reload-driver", "580.99.01", "--id-shift", "13"]).unwrap();
    let b = a.create_gpu("b", "L40S-1Q").unwrap();
    assert_eq!(b["gpu"]["type_id"], 1160);
    let vf = b["gpu"]["device"].as_str().unwrap();
    let path = format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type");
    let last = writes(&a.state()).into_iter().rfind(|(p, _, _)| *p == path).unwrap();
    assert_eq!((last.1.as_str(), last.2.as_str()), ("1160", "ok"));
}

#[test]
fn i11_a_second_agent_on_the_same_data_directory_exits_without_touching_anything() {
    let a = Agent::start(HOST_V).unwrap();
    a.create_gpu("a", "L40S-1Q").unwrap();
    let before_claims = a.claims();
    let before_writes = writes(&a.state()).len();
    // The same config (same data dir), another socket so the first agent's is not replaced.
    let cfg = std::fs::read_to_string(&a.config_path).unwrap();
    let second = a.dir.path().join("second.toml");
    let other_sock = a.dir.path().join("second.sock");
    std::fs::write(&second, cfg.replace(&format!("{:?}", a.socket), &format!("{other_sock:?}"))).unwrap();
    let (status, out) = serve_expecting_exit(&second, Duration::from_secs(30)).unwrap();
    assert!(!status.success(), "{out}");
    assert!(out.contains("another gpuvisor agent"), "{out}");
    assert!(!other_sock.exists());
    assert_eq!(a.claims(), before_claims);
    assert_eq!(writes(&a.state()).len(), before_writes, "no sysfs write");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "running", "the first agent still serves");
}

/// Issue 18 finding 7 (I17): a second agent with another data directory and another
/// socket, on the same host (the same simulator mount), refuses to start and names the
/// first (its pid and data directory): nothing is written to the host, no socket is
/// served, and the first agent keeps its VM. Agents on two different hosts (mounts) run
/// side by side, as every test does.
#[test]
fn i17_a_second_agent_on_the_same_gpus_refuses_to_start_and_names_the_first() {
    let a = Agent::start(HOST_V).unwrap();
    a.create_gpu("a", "L40S-1Q").unwrap();
    let before = writes(&a.state()).len();
    let first_pid = a.agent_pids();
    assert_eq!(first_pid.len(), 1);
    let cfg = std::fs::read_to_string(&a.config_path).unwrap();
    let other_data = a.dir.path().join("second-data");
    let other_sock = a.dir.path().join("second.sock");
    let second = a.dir.path().join("second.toml");
    let cfg = cfg
        .replace(&format!("{:?}", a.data_dir), &format!("{other_data:?}"))
        .replace(&format!("{:?}", a.socket), &format!("{other_sock:?}"));
    std::fs::write(&second, cfg).unwrap();
    let (status, out) = serve_expecting_exit(&second, Duration::from_secs(30)).unwrap();
    assert!(!status.success(), "BUG: a second agent started on the same GPUs: {out}");
    assert!(out.contains("another gpuvisor agent manages GPU 0000:41:00.0"), "{out}");
    assert!(out.contains(&a.data_dir.display().to_string()), "names the first agent's data dir: {out}");
    let ns_pid = ns_pid(first_pid[0]).unwrap();
    assert!(out.contains(&format!("pid {ns_pid}")), "names the first agent's pid: {out}");
    assert!(!other_sock.exists(), "no socket");
    assert_eq!(writes(&a.state()).len(), before, "no sysfs write");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "running");
    // Another host (another mount): both run.
    let b = Agent::start(HOST_V).unwrap();
    b.create_gpu("b", "L40S-1Q").unwrap();
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "running");
}

/// Regression: an unreadable `vfio-dev/` listing used to mean "no cdev targets" (a scan
/// that could miss a holder); it must make the scan unknown and refuse the release.
#[test]
fn unreadable_vfio_paths_make_the_release_scan_incomplete_never_fewer_targets() {
    let a = Agent::start(HOST_V).unwrap();
    let inst = a.create_gpu("a", "L40S-1Q").unwrap();
    let vf = inst["gpu"]["device"].as_str().unwrap().to_string();
    a.sim.ctl(&["fail-read", &format!("sys/bus/pci/devices/{vf}/vfio-dev"), "EIO", "--always"]).unwrap();
    let stopped = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    assert_eq!(stopped["gpu"]["release_pending"], true, "{stopped}");
    assert!(stopped["gpu"]["last_error"].as_str().unwrap().contains("scan_incomplete"), "{stopped}");
    assert_eq!(a.vf_type(&vf), 1147, "not cleared");
    a.sim.ctl(&["clear-faults"]).unwrap();
    a.ok("instance.stop", json!({"ref": "a"}));
    assert_eq!(a.vf_type(&vf), 0);
    assert!(a.claims().is_empty());
}

/// S031: processes that exit during the scan are skipped, not "unknown": a release under a
/// storm of short-lived processes (in the agent's PID namespace) still succeeds.
#[test]
fn s031_processes_that_exit_during_the_scan_are_skipped() {
    let a = Agent::start(HOST_V).unwrap();
    let inst = a.create_gpu("a", "L40S-1Q").unwrap();
    let vf = inst["gpu"]["device"].as_str().unwrap().to_string();
    let mut churn =
        a.ns.command("sh")
            .arg("-c")
            .arg("for w in 1 2 3 4; do (while :; do /bin/true; /bin/true & wait; done) & done; wait")
            .spawn()
            .unwrap();
    let stopped = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    assert_eq!(stopped["gpu"]["release_pending"], false, "{stopped}");
    assert_eq!(a.vf_type(&vf), 0);
    assert!(a.claims().is_empty());
    let _ = churn.kill();
    let _ = churn.wait();
}

/// Regression: a second agent (another data dir, another host) pointed at a live agent's
/// socket used to unlink it and take the first agent's clients.
#[test]
fn a_second_agent_never_replaces_a_live_agents_socket() {
    let a = Agent::start(HOST_V).unwrap();
    a.create_gpu("a", "L40S-1Q").unwrap();
    let other_host = SimMount::start(HOST_V).unwrap();
    let cfg = std::fs::read_to_string(&a.config_path).unwrap();
    let other_data = a.dir.path().join("other-data");
    let second = a.dir.path().join("second.toml");
    let cfg = cfg
        .replace(&format!("{:?}", a.data_dir), &format!("{other_data:?}"))
        .replace(&format!("{:?}", a.sim.path()), &format!("{:?}", other_host.path()));
    std::fs::write(&second, cfg).unwrap();
    let (status, out) = serve_expecting_exit(&second, Duration::from_secs(30)).unwrap();
    assert!(!status.success(), "{out}");
    assert!(out.contains("another process is serving"), "{out}");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "running", "the first agent still answers");
}

#[test]
fn gpu_list_gives_each_gpus_numa_node_and_null_when_it_cannot_be_read() {
    let a = Agent::start("l40s-2x16").unwrap();
    let gpus = a.ok("gpu.list", json!({}));
    let numa = |gpus: &Value, addr: &str| {
        gpus["gpus"].as_array().unwrap().iter().find(|g| g["address"] == addr).unwrap()["numa_node"].clone()
    };
    assert_eq!(numa(&gpus, "0000:41:00.0"), 0, "{gpus}");
    assert_eq!(numa(&gpus, "0001:81:00.0"), 1, "{gpus}");
    a.sim.ctl(&["fail-read", "sys/bus/pci/devices/0001:81:00.0/numa_node", "EIO", "--always"]).unwrap();
    let gpus = a.ok("gpu.list", json!({}));
    assert_eq!(numa(&gpus, "0001:81:00.0"), Value::Null, "unreadable is unknown, never node 0: {gpus}");
}
