//! docs/design/scenarios.md §2 "Claim & configure" (S011–S015) and the failing type write, against the
//! real agent, gpuvisor-sim and QEMU.

use gpuvisor_e2e::*;
use serde_json::json;
use std::time::Duration;

/// Host V: one L40S (`0000:41:00.0`) with 4 VFs `.4`–`.7`, IOMMU groups 41–44.
const HOST_V: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
/// Host V2: V plus a second L40S `0001:81:00.0` (VFs `0001:81:00.4`–`.7`).
const HOST_V2: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n\
                       [[gpu]]\nbdf = \"0001:81:00.0\"\nvf_count = 4\niommu_group = 60\n";

const VF0: &str = "0000:41:00.4";
const VF1: &str = "0000:41:00.5";

/// The `(value, result)` of every write to a VF's type file, in order.
fn type_writes(a: &Agent, vf: &str) -> Vec<(String, String)> {
    writes(&a.state()).into_iter().filter(|(p, _, _)| *p == type_path(vf)).map(|(_, v, r)| (v, r)).collect()
}

#[test]
fn s011_the_claim_row_describes_the_assignment_and_goes_away_on_release() {
    let a = Agent::start(HOST_V).unwrap();
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let claims = a.claims();
    assert_eq!(claims.len(), 1);
    let c = &claims[0];
    assert!(c["device"].as_str().unwrap().starts_with("0000:41:00."));
    assert_eq!(c["framework"], "vendor_vfio");
    assert_eq!(c["instance_id"], inst["id"]);
    assert_eq!(c["profile"], "L40S-2Q");
    assert_eq!(c["type_id"], 1148);
    assert_eq!(c["state"], "configured");
    assert_eq!(c["claim_boot_id"], a.state()["boot_id"], "the simulator's boot id");
    assert!(c["claimed_boottime_ms"].as_u64().unwrap() > 0);
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["gpu"]["device"], c["device"]);
    assert_eq!(got["gpu"]["type_id"], 1148);
    assert_eq!(got["gpu"]["claimed_at"], c["claimed_at"]);
    assert_eq!(got["gpu"]["profile"], "L40S-2Q");
    assert!(got["gpu"]["device_path"]
        .as_str()
        .unwrap()
        .ends_with(&format!("sys/bus/pci/devices/{}", c["device"].as_str().unwrap())));
    // The instance record itself never stores a device path.
    let rec =
        std::fs::read_to_string(a.data_dir.join(format!("instances/{}/instance.json", inst["id"].as_str().unwrap())))
            .unwrap();
    assert!(!rec.contains("0000:41:00."), "instance.json names no device: {rec}");

    let stopped = a.ok("instance.stop", json!({"ref": "a"}));
    assert!(a.claims().is_empty());
    assert_eq!(a.vf_type(c["device"].as_str().unwrap()), 0);
    assert_eq!(stopped["gpu"]["profile"], "L40S-2Q", "A keeps its profile");
}

#[test]
fn s012_a_leftover_type_that_hides_the_profile_is_repaired() {
    let a = Agent::start(HOST_V).unwrap();
    a.sim.ctl(&["set-type", VF0, "1156"]).unwrap();
    // vf1..vf3 now list only 24Q-sized types.
    let cat = vf_entry(&a.state(), VF1)["creatable"].clone();
    assert_eq!(cat, json!([1156]), "{cat}");
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    assert_eq!(inst["gpu"]["device"], VF0);
    assert_eq!(type_writes(&a, VF0), vec![("0".into(), "ok".into()), ("1148".into(), "ok".into())]);
    assert_eq!(a.vf_type(VF0), 1148);
    let other_writes: Vec<_> = writes(&a.state()).into_iter().filter(|(p, _, _)| *p != type_path(VF0)).collect();
    assert!(other_writes.is_empty(), "no other VF written: {other_writes:?}");
}

#[test]
fn s013_a_dirty_vf_that_is_in_use_is_never_claimed() {
    let a = Agent::start(HOST_V).unwrap();
    for name in ["w", "b", "c", "d"] {
        a.create_gpu(name, "L40S-2Q").unwrap();
    }
    a.ok("instance.delete", json!({"ref": "w"}));
    // vf0 is free; make it dirty and held open by an unrelated process (in the agent's
    // PID namespace, so the agent's /proc scan can see it).
    assert!(a.claims().iter().all(|c| c["device"] != VF0));
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let cdev = vf_entry(&a.state(), VF0)["cdev"].as_str().unwrap().to_string();
    let node = a.sim.path().join(format!("dev/vfio/devices/{cdev}"));
    let (mut holder, line) = a.ns_sh(&format!("exec 3<>{}; echo held; exec sleep 300", node.display()));
    assert_eq!(line, "held");
    let before = type_writes(&a, VF0);

    let e = a.create_gpu("a", "L40S-2Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "{e}");
    assert!(
        e.message.contains(VF0) && e.message.contains("in use"),
        "the message names the dirty VF in use: {}",
        e.message
    );
    assert!(a.claims().iter().all(|c| c["device"] != VF0));
    assert_eq!(a.vf_type(VF0), 1148);
    assert_eq!(type_writes(&a, VF0), before, "vf0 was not written");
    assert!(holder.try_wait().unwrap().is_none(), "the holder got no signal");
    assert_eq!(a.call("instance.get", json!({"ref": "a"})).unwrap_err().data_code, "not_found");
    let _ = holder.kill();
}

#[test]
fn s014a_a_refused_type_write_moves_on_to_the_next_vf() {
    let a = Agent::start(HOST_V).unwrap();
    a.sim.ctl(&["fail-write", &type_path(VF0), "EIO", "--times", "1"]).unwrap();
    let inst = a.create_gpu("a", "L40S-1Q").unwrap();
    assert_eq!(inst["gpu"]["device"], VF1);
    assert!(a.claims().iter().all(|c| c["device"] != VF0), "vf0 has no claim row");
    assert_eq!(a.vf_type(VF0), 0);
}

#[test]
fn s014b_a_type_write_failing_everywhere_leaves_nothing_behind() {
    let a = Agent::start(HOST_V).unwrap();
    a.sim.ctl(&["fail-write", "sys/bus/pci/devices/*/nvidia/current_vgpu_type", "EIO", "--always"]).unwrap();
    let e = a.create_gpu("b", "L40S-1Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "{e}");
    assert!(a.claims().is_empty(), "no claim rows");
    assert!(set_vfs(&a.state()).is_empty(), "every VF reads 0");
    assert_eq!(a.call("instance.get", json!({"ref": "b"})).unwrap_err().data_code, "not_found", "B does not exist");
    // Once the fault is gone the same create succeeds.
    a.sim.ctl(&["clear-faults"]).unwrap();
    a.create_gpu("b", "L40S-1Q").unwrap();
}

#[test]
fn s014c_a_foreign_write_during_ours_quarantines_the_vf_and_never_clears_it() {
    let a = Agent::start(HOST_V2).unwrap();
    a.sim.ctl(&["delay-write", &type_path(VF0), "1500", "--times", "1"]).unwrap();
    let create = a.spawn_call("instance.create", json!({"name": "c", "image": "demo", "gpu": "L40S-1Q"}));
    // Wait until the agent is inside its (delayed) type write, then write as a foreign tool.
    // Waiting only for the claim file raced: a foreign write landing before the agent's own
    // catalog check makes the agent skip the VF instead of writing it.
    wait_for(Duration::from_secs(20), || {
        let st = a.state();
        let begun = st["log"].as_array()?.iter().any(|e| e["op"] == "write-delayed" && e["path"] == type_path(VF0));
        begun.then_some(())
    })
    .expect("the agent's type write on vf0 begins");
    assert!(a.data_dir.join(format!("claims/{VF0}.json")).exists(), "the claim is durable before the write");
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let answer = create.join().unwrap().unwrap();
    let inst = &answer["result"];
    assert!(inst["gpu"]["device"].as_str().unwrap().starts_with("0001:81:"), "C lands on g1: {answer}");
    assert_eq!(type_writes(&a, VF0).last().unwrap(), &("1147".to_string(), "EPERM".to_string()));
    assert_eq!(a.vf_type(VF0), 1148, "never cleared");
    assert!(a.claims().iter().all(|c| c["device"] != VF0));
    let gpus = a.ok("gpu.list", json!({}));
    let dev = gpus["gpus"][0]["devices"].as_array().unwrap().iter().find(|d| d["address"] == VF0).unwrap().clone();
    assert_eq!(dev["state"], "quarantined");
    assert_eq!(dev["quarantine"]["reason"], "foreign_write");
    // Later creates never touch vf0.
    let n = type_writes(&a, VF0).len();
    a.create_gpu("d", "L40S-2Q").unwrap();
    assert_eq!(type_writes(&a, VF0).len(), n);
}

#[test]
fn s015_a_claim_row_blocks_its_vf_even_when_sysfs_reads_free() {
    let a = Agent::start(HOST_V).unwrap();
    for name in ["a", "x", "y", "z"] {
        a.create_gpu(name, "L40S-1Q").unwrap();
    }
    let a_rec = a.ok("instance.get", json!({"ref": "a"}));
    let vf = a_rec["gpu"]["device"].as_str().unwrap().to_string();
    let claim_text = std::fs::read_to_string(a.data_dir.join(format!("claims/{vf}.json"))).unwrap();
    a.ok("instance.stop", json!({"ref": "a"}));
    assert_eq!(a.vf_type(&vf), 0);
    // A release whose row delete failed leaves the row behind (release_pending).
    let mut claim: serde_json::Value = serde_json::from_str(&claim_text).unwrap();
    claim["state"] = json!("release_pending");
    claim["last_error"] = json!("claim removal failed");
    std::fs::write(a.data_dir.join(format!("claims/{vf}.json")), claim.to_string()).unwrap();
    let n = type_writes(&a, &vf).len();

    let e = a.create_gpu("b", "L40S-1Q").unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    assert_eq!(type_writes(&a, &vf).len(), n, "no write to the blocked VF");
    // Stopping the stopped owner retries the pending release: the VF reads 0 already, so
    // the row goes without any write.
    a.ok("instance.stop", json!({"ref": "a"}));
    assert!(!a.data_dir.join(format!("claims/{vf}.json")).exists());
    assert_eq!(type_writes(&a, &vf).len(), n, "the row went without a write");
    let b = a.create_gpu("b", "L40S-1Q").unwrap();
    assert_eq!(b["gpu"]["device"], vf.as_str());
    assert_eq!(a.claims().iter().filter(|c| c["device"] == vf.as_str()).count(), 1);
}
