//! End to end: vendor-VFIO vGPU instances through create / stop / start / delete, with the
//! real agent, gpuvisor-sim and QEMU guests booting the demo image.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

const READY: &str = "gpuvisor-guest: ready";
const BOOT: Duration = Duration::from_secs(90);

fn devices(res: &Value) -> (u64, u64, u64) {
    let d = &res["devices"];
    (d["total"].as_u64().unwrap(), d["claimed"].as_u64().unwrap(), d["allocatable"].as_u64().unwrap())
}

/// Asserts QEMU (a root-namespace pid whose command line names the instance id) holds the
/// VF's `dev/vfio/<group>` node, as the simulator also records.
fn assert_qemu_holds(a: &Agent, inst: &Value) {
    let id = inst["id"].as_str().unwrap();
    let vf = inst["gpu"]["device"].as_str().unwrap();
    let qemu = qemu_of(id);
    assert_eq!(qemu.len(), 1, "one QEMU for {id}");
    let entry = vf_entry(&a.state(), vf);
    let group = entry["group"].as_u64().unwrap();
    let node = a.sim.path().join(format!("dev/vfio/{group}"));
    assert!(
        fd_targets(qemu[0]).iter().any(|t| t == &node.display().to_string()),
        "QEMU {} does not hold {}: {:?}",
        qemu[0],
        node.display(),
        fd_targets(qemu[0])
    );
    let handles = entry["handles"].as_array().unwrap();
    assert_eq!(handles.len(), 1, "the simulator sees one handle on {vf}: {entry}");
    assert_eq!(handles[0]["pid"].as_i64().unwrap() as i32, qemu[0], "the handle is QEMU's own");
}

#[test]
fn spread_puts_two_2q_instances_on_different_gpus_and_everything_is_released() {
    let a = Agent::start("l40s-2x16").unwrap();
    let res = a.ok("resources.get", json!({}));
    assert_eq!(devices(&res), (32, 0, 32));
    assert_eq!(placeable(&res, "L40S-2Q"), 32);
    assert_eq!(placeable(&res, "L40S-48Q"), 2);

    let one = a.create_gpu("one", "L40S-2Q").unwrap();
    let two = a.create_gpu("two", "L40S-2Q").unwrap();
    assert_eq!(one["state"], "running");
    assert_eq!(one["gpu"]["framework"], "vendor_vfio");
    assert_eq!(one["gpu"]["type_id"], 1148);
    assert_eq!(one["gpu"]["device"], "0000:41:00.4");
    assert_eq!(two["gpu"]["device"], "0001:81:00.4", "spread: the second goes to the idle GPU");
    assert!(one["gpu"]["device_path"].as_str().unwrap().ends_with("sys/bus/pci/devices/0000:41:00.4"));
    assert!(one["gpu"]["claimed_at"].is_string());

    // The simulator shows both types set, QEMU holding each VF's group node.
    let st = a.state();
    assert_eq!(set_vfs(&st), vec![("0000:41:00.4".into(), 1148), ("0001:81:00.4".into(), 1148)]);
    assert_qemu_holds(&a, &one);
    assert_qemu_holds(&a, &two);
    for inst in [&one, &two] {
        let log = a.wait_serial(inst, READY, BOOT).unwrap();
        assert!(log.contains("pci: "), "guest lists its PCI devices");
    }
    let res = a.ok("resources.get", json!({}));
    assert_eq!(devices(&res), (32, 2, 30));
    assert_eq!(placeable(&res, "L40S-2Q"), 30);
    assert_eq!(placeable(&res, "L40S-4Q"), 0, "equal-size rule: both GPUs run 2Q");

    // Stop one: its VF reads 0 and its claim is gone; the profile is kept.
    let stopped = a.ok("instance.stop", json!({"ref": "one"}));
    assert_eq!(stopped["state"], "stopped");
    assert_eq!(stopped["gpu"]["profile"], "L40S-2Q");
    assert!(stopped["gpu"]["device"].is_null());
    assert_eq!(a.vf_type("0000:41:00.4"), 0);
    assert_eq!(a.claims().len(), 1);
    assert_eq!(devices(&a.ok("resources.get", json!({}))), (32, 1, 31));
    assert_eq!(set_vfs(&a.state()), vec![("0001:81:00.4".into(), 1148)]);

    // Start again: a VF is claimed again (spread: GPU 0 is idle again).
    let again = a.ok("instance.start", json!({"ref": "one"}));
    assert_eq!(again["state"], "running");
    assert_eq!(again["gpu"]["device"], "0000:41:00.4");
    a.wait_serial(&again, READY, BOOT).unwrap();
    assert_eq!(devices(&a.ok("resources.get", json!({}))), (32, 2, 30));

    // Delete both: every VF 0, no claims, no QEMU left.
    a.ok("instance.delete", json!({"ref": "one"}));
    a.ok("instance.delete", json!({"ref": "two"}));
    assert!(set_vfs(&a.state()).is_empty());
    assert!(a.claims().is_empty());
    assert!(a.qemu_pids().is_empty(), "no QEMU left");
    assert_eq!(a.ok("instance.list", json!({}))["instances"], json!([]));
    let res = a.ok("resources.get", json!({}));
    assert_eq!(devices(&res), (32, 0, 32));
    assert_eq!(placeable(&res, "L40S-48Q"), 2);
}

#[test]
fn pack_puts_two_2q_instances_on_one_gpu() {
    let a =
        Agent::start_with(AgentOptions { placement: Some(plugin("placement-pack")), ..Default::default() }).unwrap();
    let one = a.create_gpu("one", "L40S-2Q").unwrap();
    let two = a.create_gpu("two", "L40S-2Q").unwrap();
    let g1 = one["gpu"]["gpu"].as_str().unwrap();
    let g2 = two["gpu"]["gpu"].as_str().unwrap();
    assert_eq!(g1, g2, "pack keeps the same size on one GPU");
    assert_ne!(one["gpu"]["device"], two["gpu"]["device"]);
    let res = a.ok("resources.get", json!({}));
    assert_eq!(placeable(&res, "L40S-48Q"), 1, "the other GPU stays empty for large profiles");
    assert_eq!(a.ok("plugin.list", json!({}))["plugins"][0]["name"], "placement-pack");
    a.ok("instance.delete", json!({"ref": "one"}));
    a.ok("instance.delete", json!({"ref": "two"}));
    assert!(set_vfs(&a.state()).is_empty());
}

#[test]
fn every_instance_gets_its_uuid_and_name_on_the_qemu_command_line() {
    let a = Agent::start("l40s-2x16").unwrap();
    let inst = a.create_gpu("named-vm", "L40S-1Q").unwrap();
    let id = inst["id"].as_str().unwrap();
    let pid = qemu_of(id);
    let cmd = std::fs::read(format!("/proc/{}/cmdline", pid[0])).unwrap();
    let args: Vec<String> = cmd.split(|b| *b == 0).map(|s| String::from_utf8_lossy(s).into_owned()).collect();
    let pos = args.iter().position(|x| x == "-uuid").expect("-uuid");
    assert_eq!(args[pos + 1], id);
    let pos = args.iter().position(|x| x == "-name").expect("-name");
    assert!(args[pos + 1].starts_with("named-vm"), "{:?}", args[pos + 1]);
    assert!(
        args.iter().any(|x| x.starts_with("fd=") || x.contains("add-fd") || x == "-add-fd"),
        "hold-fd passes the group fd"
    );
    a.ok("instance.delete", json!({"ref": id}));
}

#[test]
fn a_graceful_stop_powers_the_guest_off_through_acpi() {
    // stop_timeout_s is 10 in the harness: a guest that ignored the power button would make
    // the stop fall through to QMP quit; the serial log proves the guest powered itself off.
    let a = Agent::start("l40s-2x16").unwrap();
    let inst = a.create_gpu("acpi", "L40S-1Q").unwrap();
    a.wait_serial(&inst, READY, BOOT).unwrap();
    let stopped = a.ok("instance.stop", json!({"ref": "acpi"}));
    assert_eq!(stopped["state"], "stopped");
    a.wait_serial(&inst, "gpuvisor-guest: poweroff", Duration::from_secs(5)).unwrap();
    assert!(set_vfs(&a.state()).is_empty());
}

/// A reset keeps the VMM and its vGPU (the claim is not touched, the VF's type stays); a
/// reboot releases the device through the release guard and claims one again, like a stop
/// and a start.
#[test]
fn a_reset_keeps_the_vmm_and_its_vgpu_and_a_reboot_claims_again() {
    let a = Agent::start(HOST_V).unwrap();
    let v = a.create_gpu("g", "L40S-2Q").unwrap();
    let vf = v["gpu"]["device"].as_str().unwrap().to_string();
    let claim = a.claim_file(&vf).expect("claimed");
    let pid = v["vmm"]["pid"].as_i64().unwrap();
    let writes = a.sim_writes().len();

    let r = a.ok("instance.reset", json!({"ref": "g"}));

    assert_eq!(r["vmm"]["pid"].as_i64(), Some(pid), "the same VMM: {r}");
    assert_eq!(a.claim_file(&vf), Some(claim), "the claim untouched");
    assert_eq!(a.sim_writes().len(), writes, "nothing written to sysfs");

    let b = a.ok("instance.reboot", json!({"ref": "g", "timeout_s": 5}));

    assert_eq!(b["state"], "running", "{b}");
    assert_ne!(b["vmm"]["pid"].as_i64(), Some(pid), "a new VMM: {b}");
    let now = b["gpu"]["device"].as_str().unwrap().to_string();
    assert!(a.claim_file(&now).is_some(), "claimed again");
    assert!(a.sim_writes().len() > writes, "the device was cleared and configured again");
    assert_eq!(a.claims().len(), 1, "one claim: {:?}", a.claims());
    a.ok("instance.delete", json!({"ref": "g"}));
}
