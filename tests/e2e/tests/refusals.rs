//! docs/design/scenarios.md §10–11: S046 (standby/snapshot refused with a vGPU), S047 (a fork never
//! takes the source's assignment), S049 (no capacity vs unknown profile), S051 (a vGPU
//! needs a hypervisor that can carry it, and a stable UUID), against the real agent,
//! gpuvisor-sim and QEMU (guests paused through a `qemu_binary` wrapper).

use gpuvisor_e2e::*;
use serde_json::{json, Value};

const HOST_V: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
const VF0: &str = "0000:41:00.4";

fn agent(model: &str, w: &QemuWrapper) -> Agent {
    let extra = w.extra() + "reconcile_interval_s = 3600\n";
    Agent::start_tuned(AgentOptions { model, extra: &extra, ..Default::default() }, None, &[("release_retry_s", "1")])
        .unwrap()
}

fn qemu_args(id: &str) -> Vec<String> {
    let pid = qemu_of(id);
    assert_eq!(pid.len(), 1, "one QEMU for {id}");
    let cmd = std::fs::read(format!("/proc/{}/cmdline", pid[0])).unwrap();
    cmd.split(|b| *b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect()
}

fn arg_after(args: &[String], flag: &str) -> String {
    let pos = args.iter().position(|x| x == flag).unwrap_or_else(|| panic!("{flag} in {args:?}"));
    args[pos + 1].clone()
}

#[test]
fn s046_standby_and_snapshot_are_refused_while_a_vgpu_is_attached() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, &w);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let claims = a.claims();
    for m in ["instance.standby", "instance.snapshot"] {
        let e = a.err(m, json!({"ref": "a"}));
        assert_eq!((e.code, e.data_code.as_str()), (409, "unsupported_with_gpu"), "{m}: {e}");
    }
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "running");
    assert_eq!(a.claims(), claims);
    assert_eq!(a.vf_type(VF0), 1148);
    assert_eq!(qemu_of(inst["id"].as_str().unwrap()).len(), 1);

    let m = agent("l40s-mdev", &w);
    let b = m.create_gpu("b", "L40S-2Q").unwrap();
    assert_eq!(b["gpu"]["framework"], "mdev");
    let claims = m.claims();
    let mdevs = sim_mdevs(&m.state());
    let e = m.err("instance.standby", json!({"ref": "b"}));
    assert_eq!((e.code, e.data_code.as_str()), (409, "unsupported_with_gpu"), "{e}");
    assert_eq!(m.ok("instance.get", json!({"ref": "b"}))["state"], "running");
    assert_eq!(m.claims(), claims);
    assert_eq!(sim_mdevs(&m.state()).len(), mdevs.len());
}

fn assert_clean_fork(k: &Value, profile: &str) {
    assert_eq!(k["state"], "stopped", "{k}");
    assert_eq!(k["gpu"]["profile"], profile, "{k}");
    for f in ["device", "mdev_uuid", "claimed_at", "device_path", "type_id"] {
        assert!(k["gpu"][f].is_null(), "the fork has no {f}: {k}");
    }
    assert!(k["vmm"].is_null(), "the fork has no VMM identity: {k}");
}

#[test]
fn s047_a_fork_never_takes_the_sources_assignment() {
    let w = QemuWrapper::new();
    let a = agent("l40s-mdev", &w);
    let j = a.create_gpu("j", "L40S-2Q").unwrap();
    let u5 = j["gpu"]["mdev_uuid"].as_str().unwrap().to_string();
    a.sim.ctl(&["fail-write", "sys/bus/mdev/devices/*/remove", "EBUSY", "--always"]).unwrap();
    let stopped = a.ok("instance.stop", json!({"ref": "j", "force": true}));
    assert_eq!(stopped["gpu"]["release_pending"], true, "{stopped}");
    assert_eq!(stopped["gpu"]["mdev_uuid"], u5.as_str(), "J keeps U5: {stopped}");

    let k = a.ok("instance.fork", json!({"ref": "j", "name": "k"}));
    assert_clean_fork(&k, "L40S-2Q");
    assert_clean_fork(&a.ok("instance.get", json!({"ref": "k"})), "L40S-2Q");
    assert!(a.claims().iter().all(|c| c["instance_id"] != k["id"]), "no claim row for K");

    let started = a.ok("instance.start", json!({"ref": "k"}));
    let u6 = started["gpu"]["mdev_uuid"].as_str().unwrap().to_string();
    assert_ne!(u6, u5, "a fresh mdev");
    let ck: Vec<Value> = a.claims().into_iter().filter(|c| c["instance_id"] == k["id"]).collect();
    assert_eq!(ck.len(), 1);
    assert_eq!(ck[0]["mdev_uuid"], u6.as_str());

    a.sim.ctl(&["clear-faults"]).unwrap();
    assert_eq!(a.ok("instance.delete", json!({"ref": "j"}))["deleted"], true);
    let uuids: Vec<Value> = sim_mdevs(&a.state()).iter().map(|m| m["uuid"].clone()).collect();
    assert_eq!(uuids, vec![json!(u6)], "delete J removed U5 only");
    let claims = a.claims();
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert_eq!(claims[0]["instance_id"], k["id"]);

    // Also, on host V: the fork of a stopped instance with a retained claim on vf0 claims
    // another VF, and vf0 is never written on its behalf.
    let v = agent(HOST_V, &w);
    let (_, vf) = v.retained_stopped("a", "L40S-2Q");
    assert_eq!(vf, VF0);
    let before = type_writes_of(&v.state(), VF0).len();
    let f = v.ok("instance.fork", json!({"ref": "a", "name": "f"}));
    assert_clean_fork(&f, "L40S-2Q");
    let fs = v.ok("instance.start", json!({"ref": "f"}));
    assert_ne!(fs["gpu"]["device"], VF0, "{fs}");
    assert_eq!(type_writes_of(&v.state(), VF0).len(), before, "vf0 never written for the fork");
    assert_eq!(v.claim(VF0).unwrap()["instance_id"], v.ok("instance.get", json!({"ref": "a"}))["id"]);
}

#[test]
fn s049_no_capacity_and_unknown_profile_are_told_apart() {
    let w = QemuWrapper::new();
    let a = agent(HOST_V, &w);
    let res = a.ok("resources.get", json!({}));
    assert!(res["profiles"].as_array().unwrap().iter().any(|p| p["profile"] == "L40S-48Q"), "{res}");
    for (i, vf) in ["0000:41:00.4", "0000:41:00.5", "0000:41:00.6"].iter().enumerate() {
        let c = a.create_gpu(&format!("c{i}"), "L40S-2Q").unwrap();
        assert_eq!(c["gpu"]["device"], *vf);
    }
    let seq = last_seq(&a.state());
    let e = a.create_gpu("big", "L40S-48Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "{e}");
    let e = a.create_gpu("odd", "L40S-3Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (400, "unknown_profile"), "{e}");
    let w_after: Vec<Value> = log_after(&a.state(), seq).into_iter().filter(|e| e["op"] == "write").collect();
    assert!(w_after.is_empty(), "the failures wrote nothing: {w_after:?}");
    assert_eq!(a.claims().len(), 3);
    let mut names = a.instance_names();
    names.sort();
    assert_eq!(names, ["c0", "c1", "c2"], "the failures left no row");

    let d = a.create_gpu("d", "l40s-2q").unwrap();
    assert_eq!(d["gpu"]["profile"], "L40S-2Q");
    assert_eq!(d["gpu"]["device"], "0000:41:00.7");
}

#[test]
fn s051_a_vgpu_needs_a_hypervisor_that_can_carry_it_and_a_stable_uuid() {
    // docs/plugins.md: `hypervisor-default` answers QEMU for a GPU instance whose requested
    // hypervisor cannot carry it (so under it FF would run on QEMU). The native capability
    // gate S051 is about is exercised with a hypervisor plugin that does choose the incapable
    // hypervisor (fixture `hv-cloud.wat`).
    let w = QemuWrapper::new();
    let extra = w.extra();
    let hv = Agent::start_tuned(
        AgentOptions {
            model: HOST_V,
            extra: &extra,
            hypervisor: Some(fixture_plugin("hv-cloud.wat")),
            ..Default::default()
        },
        None,
        &[],
    )
    .unwrap();
    let seq = last_seq(&hv.state());
    let e = hv
        .call(
            "instance.create",
            json!({"name": "ff", "image": "demo", "gpu": "L40S-1Q", "hypervisor": "cloud-hypervisor"}),
        )
        .unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (400, "hypervisor_unsupported"), "{e}");
    assert!(hv.instance_names().is_empty(), "no row");
    assert!(hv.claims().is_empty());
    assert!(hv.data_files("instances").is_empty());
    let after = log_after(&hv.state(), seq);
    assert!(after.iter().all(|e| e["op"] != "write" && e["op"] != "open"), "no sysfs access: {after:?}");
    drop(hv);

    let a = agent(HOST_V, &w);

    let gg = a.ok("instance.create", json!({"name": "gg", "image": "demo", "gpu": "L40S-1Q", "hypervisor": "qemu"}));
    let id = gg["id"].as_str().unwrap().to_string();
    let args = qemu_args(&id);
    assert_eq!(arg_after(&args, "-uuid"), id);
    assert!(arg_after(&args, "-name").starts_with("gg"), "{args:?}");
    let add_fd = arg_after(&args, "-add-fd");
    assert!(add_fd.contains("fd=") && add_fd.contains("set="), "the VF by -add-fd: {add_fd}");
    a.ok("instance.stop", json!({"ref": "gg", "force": true}));
    a.ok("instance.start", json!({"ref": "gg"}));
    assert_eq!(arg_after(&qemu_args(&id), "-uuid"), id, "same -uuid after the restart");
}
