//! docs/design/scenarios.md §1 "Placement & capacity" (S002–S009), with the default placement-spread.

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

/// Host V whose type table adds `NVIDIA L40S-0Q` (512 MiB) and `NVIDIA L40S-Pro` (a name
/// without a size suffix; 1024 MiB in the table, which gpuvisor cannot read).
fn host_with_extra_types(gpus: &[(&str, u32)]) -> String {
    let mut m = String::from(
        "release_delay_ms = 300\n\
         [[type_table]]\nname = \"l40s-plus\"\ntypes = [\n\
         { id = 1146, name = \"NVIDIA L40S-0Q\", fb_mib = 512, max = 64 },\n\
         { id = 1147, name = \"NVIDIA L40S-1Q\", fb_mib = 1024, max = 32 },\n\
         { id = 1148, name = \"NVIDIA L40S-2Q\", fb_mib = 2048, max = 24 },\n\
         { id = 1159, name = \"NVIDIA L40S-48Q\", fb_mib = 49152, max = 1 },\n\
         { id = 1199, name = \"NVIDIA L40S-Pro\", fb_mib = 1024, max = 32 },\n]\n",
    );
    for (bdf, group) in gpus {
        m.push_str(&format!(
            "[[gpu]]\nbdf = \"{bdf}\"\nvf_count = 4\niommu_group = {group}\ntype_table = \"l40s-plus\"\n"
        ));
    }
    m
}

fn profile_row(res: &Value, profile: &str) -> Value {
    res["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["profile"] == profile)
        .cloned()
        .unwrap_or_else(|| panic!("{profile} is not listed: {res}"))
}

#[test]
fn s001_profiles_and_sizes_come_from_the_live_catalog() {
    let a = Agent::start(&host_with_extra_types(&[("0000:41:00.0", 40)])).unwrap();
    let res = a.ok("resources.get", json!({}));
    for (p, id, fb) in
        [("L40S-1Q", 1147, 1024), ("L40S-2Q", 1148, 2048), ("L40S-48Q", 1159, 49152), ("L40S-0Q", 1146, 512)]
    {
        let row = profile_row(&res, p);
        assert_eq!((row["type_id"].as_u64(), row["framebuffer_mib"].as_u64()), (Some(id), Some(fb)), "{row}");
    }
    // A name without a size suffix: the size is unknown (null), never 0.
    let pro = profile_row(&res, "L40S-Pro");
    assert_eq!(pro["type_id"], 1199, "{pro}");
    assert!(pro["framebuffer_mib"].is_null(), "unknown, not a number: {pro}");
    // The catalog header line is not a profile.
    assert!(
        res["profiles"].as_array().unwrap().iter().all(|p| !p["profile"].as_str().unwrap().contains("ID")),
        "{res}"
    );
    // The table for people says "unknown".
    let out = a.cli(&["profiles"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("L40S-Pro")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("unknown"), "{line}");
}

#[test]
fn s005_a_gpu_of_known_load_beats_one_of_unknown_load() {
    let a = Agent::start(&host_with_extra_types(&[("0000:41:00.0", 40), ("0001:81:00.0", 60)])).unwrap();
    let pro = a.create_gpu("a", "L40S-Pro").unwrap();
    assert_eq!(pro["gpu"]["device"], VF0, "both idle: address order");
    let b = a.create_gpu("b", "L40S-1Q").unwrap();
    assert_eq!(b["gpu"]["device"], "0001:81:00.4", "g1's load is known (0), g0's is not");
    // C: g1 holds 1 GiB (known), g0 holds a type of unknown size: g1 wins.
    let c = a.create_gpu("c", "L40S-1Q").unwrap();
    assert!(c["gpu"]["device"].as_str().unwrap().starts_with("0001:81:"), "{c}");
    // Fill g1; unknown load puts g0 last but does not exclude it.
    for n in ["e", "f"] {
        let i = a.create_gpu(n, "L40S-1Q").unwrap();
        assert!(i["gpu"]["device"].as_str().unwrap().starts_with("0001:81:"), "{i}");
    }
    let d = a.create_gpu("d", "L40S-Pro").unwrap();
    assert!(d["gpu"]["device"].as_str().unwrap().starts_with("0000:41:"), "{d}");
}
