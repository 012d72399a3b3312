//! docs/design/scenarios.md §6 "Release guards" (S027–S029): releasing retained claims through the
//! guard — idle VFs, VFs with nothing to write, open handles, VFs without VFIO paths —
//! against the real agent, gpuvisor-sim and QEMU (guests paused through a wrapper).

use gpuvisor_e2e::*;
use serde_json::{json, Value};

const HOST_V: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
const HOST_V2: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n\
                       [[gpu]]\nbdf = \"0001:81:00.0\"\nvf_count = 4\niommu_group = 60\n";
const VF0: &str = "0000:41:00.4";
const VF1: &str = "0000:41:00.5";
const WF0: &str = "0001:81:00.4";

fn agent(model: &str, w: &QemuWrapper) -> Agent {
    let extra = w.extra() + "reconcile_interval_s = 3600\n";
    Agent::start_tuned(AgentOptions { model, extra: &extra, ..Default::default() }, None, &[("release_retry_s", "1")])
        .unwrap()
}

fn sim_writes_after(a: &Agent, seq: u64) -> Vec<Value> {
    log_after(&a.state(), seq).into_iter().filter(|e| e["op"] == "write").collect()
}

#[test]
fn s027_releasing_an_idle_vf_and_the_cases_with_nothing_to_write() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V2, &w);
    let mut by_vf = std::collections::HashMap::new();
    for name in ["a", "b", "c"] {
        let (_, vf) = a.retained_stopped(name, "L40S-2Q");
        by_vf.insert(vf, name);
    }
    let mut vfs: Vec<&String> = by_vf.keys().collect();
    vfs.sort();
    assert_eq!(vfs, [VF0, VF1, WF0], "spread: {by_vf:?}");
    // vf1 already reads 0 (cleared by someone else); wf0 disappears with its PF's VFs.
    a.sim.ctl(&["set-type", VF1, "0"]).unwrap();
    assert_eq!(a.vf_type(VF1), 0);
    a.sim.ctl(&["disable-vfs", "0001:81:00.0"]).unwrap();
    assert!(vf_entry(&a.state(), WF0).is_null(), "wf0 is gone");
    assert_eq!(a.vf_type(VF0), 1148);
    let seq = last_seq(&a.state());

    for vf in [VF0, VF1, WF0] {
        let del = a.ok("instance.delete", json!({"ref": by_vf[vf]}));
        assert_eq!(del["deleted"], true, "{vf}: {del}");
    }
    let w = sim_writes_after(&a, seq);
    assert_eq!(w.len(), 1, "exactly one write: {w:?}");
    assert_eq!(w[0]["path"], type_path(VF0));
    assert_eq!(w[0]["value"].as_str().unwrap().trim(), "0");
    assert_eq!(w[0]["result"], "ok");
    assert_eq!(a.vf_type(VF0), 0);
    assert!(a.claims().is_empty(), "{:?}", a.claims());
    assert!(a.instance_names().is_empty(), "{:?}", a.instance_names());
}

#[test]
fn s028_an_open_handle_blocks_the_release() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, &w);
    let (_, vf) = a.retained_stopped("a", "L40S-2Q");
    assert_eq!(vf, VF0);
    let entry = vf_entry(&a.state(), VF0);
    let cdev = entry["cdev"].as_str().unwrap().to_string();
    let group = entry["group"].as_u64().unwrap();
    let nodes = [format!("dev/vfio/devices/{cdev}"), format!("dev/vfio/{group}")];

    for node in &nodes {
        let path = a.sim.path().join(node);
        let (_child, nspid) = a.ns_sh(&format!("exec 3<>{}; echo $$; exec sleep 300", path.display()));
        let nspid: i32 = nspid.parse().unwrap_or_else(|_| panic!("holder of {node}: {nspid:?}"));
        let holder = wait_for(std::time::Duration::from_secs(5), || root_pid_of(nspid, |c| c.contains("sleep 300")))
            .expect("holder pid");
        assert!(fd_targets(holder).contains(&path.display().to_string()), "holder holds {node}");
        let seq = last_seq(&a.state());

        let e = a.err("instance.delete", json!({"ref": "a"}));
        assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{node}: {e}");
        assert_eq!(e.data["retained"], true, "{node}: {}", e.data);
        let w = sim_writes_after(&a, seq);
        assert!(w.is_empty(), "{node}: vf0 is not written: {w:?}");
        assert_eq!(a.vf_type(VF0), 1148);
        let c = a.claim(VF0).expect("claim stays");
        assert_eq!(c["state"], "release_pending", "{c}");
        let le = c["last_error"].as_str().unwrap_or("");
        assert!(le.contains("in use") || le.contains("in_use"), "{node}: last_error {le:?}");
        assert!(le.contains(&nspid.to_string()), "{node}: names the holder {nspid}: {le:?}");
        assert!(alive(holder), "{node}: the holder got no signal");
        assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "cleanup_pending");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(holder), nix::sys::signal::Signal::SIGKILL).unwrap();
        wait_for(std::time::Duration::from_secs(5), || (!alive(holder)).then_some(())).unwrap();
    }
    // Without the holder the retried delete goes through.
    let del = a.ok("instance.delete", json!({"ref": "a"}));
    assert_eq!(del["deleted"], true);
    assert_eq!(a.vf_type(VF0), 0);
    assert!(a.claims().is_empty());
}

#[test]
fn s029_a_vf_without_vfio_paths_and_without_a_holder_is_released() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, &w);
    let (_, vf_a) = a.retained_stopped("a", "L40S-2Q");
    let (_, vf_b) = a.retained_stopped("b", "L40S-2Q");
    assert_eq!((vf_a.as_str(), vf_b.as_str()), (VF0, VF1));

    // (a) no vfio-dev/ directory.
    let p = format!("sys/bus/pci/devices/{VF0}/vfio-dev");
    a.sim.ctl(&["override", &p, "--absent"]).unwrap();
    assert!(!a.sim.path().join(&p).exists(), "{p} is absent");
    assert_eq!(a.ok("instance.delete", json!({"ref": "a"}))["deleted"], true);
    assert_eq!(a.vf_type(VF0), 0);
    assert!(a.claim(VF0).is_none());

    // (b) no iommu_group link.
    let p = format!("sys/bus/pci/devices/{VF1}/iommu_group");
    a.sim.ctl(&["override", &p, "--absent"]).unwrap();
    assert!(std::fs::symlink_metadata(a.sim.path().join(&p)).is_err(), "{p} is absent");
    assert_eq!(a.ok("instance.delete", json!({"ref": "b"}))["deleted"], true);
    assert_eq!(a.vf_type(VF1), 0);
    assert!(a.claims().is_empty());
    assert!(a.instance_names().is_empty());
}
