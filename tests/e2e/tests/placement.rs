//! SCENARIOS.md §1 "Placement & capacity" (S002–S009), with the default placement-spread.

use gpuvisor_e2e::*;
use serde_json::{json, Value};

const VF0: &str = "0000:41:00.4";
const VF1: &str = "0000:41:00.5";
const VF2: &str = "0000:41:00.6";
const VF3: &str = "0000:41:00.7";

fn type_writes(a: &Agent, vf: &str) -> Vec<(String, String)> {
    let path = format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type");
    writes(&a.state()).into_iter().filter(|(p, _, _)| *p == path).map(|(_, v, r)| (v, r)).collect()
}

/// Creates instances until the listed VFs are claimed, deleting the ones that landed
/// elsewhere; returns nothing (the names are `keep-<vf>`).
fn occupy(a: &Agent, profile: &str, vfs: &[&str]) {
    let mut n = 0;
    let mut extra = Vec::new();
    while !vfs.iter().all(|v| a.claims().iter().any(|c| c["device"] == *v)) {
        let inst = a.create_gpu(&format!("occ-{n}"), profile).unwrap();
        n += 1;
        if !vfs.contains(&inst["gpu"]["device"].as_str().unwrap()) {
            extra.push(inst["id"].as_str().unwrap().to_string());
        }
    }
    for id in extra {
        a.ok("instance.delete", json!({"ref": id}));
    }
}

#[test]
fn s002_a_full_gpus_header_only_catalogs_are_not_an_error() {
    let a = Agent::start(HOST_V2).unwrap();
    let big = a.create_gpu("a", "L40S-48Q").unwrap();
    assert!(big["gpu"]["device"].as_str().unwrap().starts_with("0000:41:"));
    let res = a.ok("resources.get", json!({}));
    assert_eq!(res["devices"]["unreadable"], 0, "{res}");
    let gpus = a.ok("gpu.list", json!({}));
    let g0: Vec<&Value> = gpus["gpus"][0]["devices"].as_array().unwrap().iter().collect();
    assert!(
        g0.iter().filter(|d| d["state"] == "free").all(|d| d["creatable"] == json!([])),
        "g0 offers nothing: {gpus}"
    );
    // g1 still offers every profile.
    assert_eq!(placeable(&res, "L40S-48Q"), 1);
    assert_eq!(placeable(&res, "L40S-1Q"), 4);
}

#[test]
fn s003_placeable_counts_skip_used_and_quarantined_vfs() {
    let a = Agent::start(HOST_V).unwrap();
    occupy(&a, "L40S-2Q", &[VF1, VF3]);
    std::fs::write(
        a.data_dir.join(format!("health/{VF2}.json")),
        json!({"device": VF2, "reason": "test", "quarantined": true, "detail": "", "at": "2026-01-01T00:00:00Z"})
            .to_string(),
    )
    .unwrap();
    let res = a.ok("resources.get", json!({}));
    assert_eq!(placeable(&res, "L40S-2Q"), 1, "{res}");
    assert_eq!(placeable(&res, "L40S-1Q"), 0, "equal-size rule");
    let d = &res["devices"];
    assert_eq!(
        (d["total"].as_u64(), d["claimed"].as_u64(), d["allocatable"].as_u64()),
        (Some(4), Some(2), Some(1)),
        "{res}"
    );
    assert_eq!(d["quarantined"], 1);
}

#[test]
fn s004_new_claims_go_to_the_least_loaded_gpu() {
    let a = Agent::start(HOST_V2).unwrap();
    a.create_gpu("a", "L40S-2Q").unwrap(); // lands on g0 (tie broken by address)
    let n = writes(&a.state()).len();
    let b = a.create_gpu("b", "L40S-2Q").unwrap();
    assert_eq!(b["gpu"]["device"], "0001:81:00.4");
    assert!(writes(&a.state())[n..].iter().all(|(p, _, _)| !p.contains("0000:41:")), "no write on g0");
}

#[test]
fn s006_clean_vfs_before_dirty_ones_then_address_order() {
    let a = Agent::start(HOST_V).unwrap();
    occupy(&a, "L40S-2Q", &[VF3]);
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    let n = type_writes(&a, VF0).len();
    let b = a.create_gpu("b", "L40S-2Q").unwrap();
    let c = a.create_gpu("c", "L40S-2Q").unwrap();
    assert_eq!((b["gpu"]["device"].as_str(), c["gpu"]["device"].as_str()), (Some(VF1), Some(VF2)));
    assert_eq!(type_writes(&a, VF0).len(), n, "no write to dirty vf0 while clean VFs are left");
    let d = a.create_gpu("d", "L40S-2Q").unwrap();
    assert_eq!(d["gpu"]["device"], VF0);
    assert_eq!(
        type_writes(&a, VF0)[n..],
        [("0".to_string(), "ok".to_string()), ("1148".to_string(), "ok".to_string())]
    );
}

#[test]
fn s007_a_dirty_vf_that_refuses_repair_is_skipped() {
    let a = Agent::start(HOST_V).unwrap();
    occupy(&a, "L40S-2Q", &[VF2, VF3]);
    a.sim.ctl(&["set-type", VF0, "1148"]).unwrap();
    a.sim.ctl(&["set-type", VF1, "1148"]).unwrap();
    let cdev = vf_entry(&a.state(), VF0)["cdev"].as_str().unwrap().to_string();
    let node = a.sim.path().join(format!("dev/vfio/devices/{cdev}"));
    let (mut holder, _) = a.ns_sh(&format!("exec 3<>{}; echo held; exec sleep 300", node.display()));
    let n = type_writes(&a, VF0).len();
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    assert_eq!(inst["gpu"]["device"], VF1);
    assert_eq!(a.vf_type(VF0), 1148);
    assert_eq!(type_writes(&a, VF0).len(), n, "vf0 was not written");
    assert!(a.claims().iter().all(|c| c["device"] != VF0));
    assert!(holder.try_wait().unwrap().is_none(), "the holder got no signal");
    let _ = holder.kill();
    let _ = holder.wait();
}

#[test]
fn s008_quarantined_vfs_are_never_placed_and_admission_counts_allocatable_vfs() {
    let a = Agent::start(HOST_V).unwrap();
    occupy(&a, "L40S-1Q", &[VF2, VF3]);
    std::fs::write(
        a.data_dir.join(format!("health/{VF0}.json")),
        json!({"device": VF0, "reason": "test", "quarantined": true, "detail": "", "at": "2026-01-01T00:00:00Z"})
            .to_string(),
    )
    .unwrap();
    let n = type_writes(&a, VF0).len();
    let inst = a.create_gpu("a", "L40S-1Q").unwrap();
    assert_eq!(inst["gpu"]["device"], VF1);
    let e = a.create_gpu("b", "L40S-1Q").unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    let d = a.ok("resources.get", json!({}))["devices"].clone();
    assert_eq!((d["total"].as_u64(), d["claimed"].as_u64(), d["allocatable"].as_u64()), (Some(4), Some(3), Some(0)));
    assert_eq!(type_writes(&a, VF0).len(), n, "vf0 was not written");
    assert!(a.claims().iter().all(|c| c["device"] != VF0));
}

#[test]
fn s009_the_catalog_shrinks_after_the_first_assignment() {
    let a = Agent::start(HOST_V).unwrap();
    assert_eq!(placeable(&a.ok("resources.get", json!({})), "L40S-48Q"), 1, "1, not 4");
    let sock = a.socket.clone();
    let creates: Vec<_> = [("n", "L40S-48Q"), ("o", "L40S-1Q")]
        .into_iter()
        .map(|(name, profile)| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                rpc_raw(
                    &sock,
                    &json!({"jsonrpc": "2.0", "id": 1, "method": "instance.create",
                    "params": {"name": name, "image": "demo", "gpu": profile}})
                    .to_string(),
                )
                .unwrap()
            })
        })
        .collect();
    let answers: Vec<Value> = creates.into_iter().map(|t| t.join().unwrap()).collect();
    let ok = answers.iter().filter(|v| v.get("result").is_some()).count();
    assert_eq!(ok, 1, "exactly one of N and O: {answers:?}");
    let loser = answers.iter().find(|v| v.get("error").is_some()).unwrap();
    assert_eq!(loser["error"]["data"]["code"], "no_capacity");
    assert_eq!(a.claims().len(), 1);
    assert_eq!(set_vfs(&a.state()).len(), 1, "the loser wrote no VF");
    // The second listing matches sysfs: the free VFs offer only the winner's size, if any.
    let res = a.ok("resources.get", json!({}));
    assert_eq!(res["devices"]["claimed"], 1);
}
