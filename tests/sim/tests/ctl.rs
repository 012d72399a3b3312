//! Control channel commands (docs/design/host.md §10.5) and the state dump (§10.6).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use libc::{EACCES, EBUSY, EIO, ENODEV, ENOENT, EPERM};

const PF: &str = "0000:41:00.0";

#[test]
fn fail_write_times_and_always_change_nothing() {
    let sim = SimMount::start(V).unwrap();
    let glob = "sys/bus/pci/devices/*/nvidia/current_vgpu_type";
    sim.ctl(&["fail-write", glob, "EIO", "--times", "2"]).unwrap();
    assert_eq!(write(&ty(&sim, VF0), "1148"), Err(EIO));
    assert_eq!(write(&ty(&sim, VF1), "1148"), Err(EIO));
    assert_eq!(read(&ty(&sim, VF0)).unwrap(), "0\n");
    write(&ty(&sim, VF0), "1148").unwrap();
    sim.ctl(&["fail-write", &format!("sys/bus/pci/devices/{VF1}/nvidia/current_vgpu_type"), "EBUSY", "--always"])
        .unwrap();
    for _ in 0..3 {
        assert_eq!(write(&ty(&sim, VF1), "1148"), Err(EBUSY));
    }
    let st = sim.state().unwrap();
    assert_eq!(st["faults"][0]["remaining"], serde_json::Value::Null);
    let w = writes(&st);
    assert_eq!(w.len(), 6);
    assert_eq!(w[0].0, format!("sys/bus/pci/devices/{VF0}/nvidia/current_vgpu_type"));
    assert_eq!((w[0].1.as_str(), w[0].2.as_str()), ("1148", "EIO"));
    assert_eq!(w[2].2, "ok");
    assert_eq!(w[5].2, "EBUSY");
    // Bad errno names are refused.
    assert!(sim.ctl(&["fail-write", glob, "ENOPE"]).is_err());
}

#[test]
fn fail_read_covers_read_readdir_readlink() {
    let sim = SimMount::start(V).unwrap();
    sim.ctl(&["fail-read", &format!("sys/bus/pci/devices/{VF0}/nvidia/creatable_vgpu_types"), "EIO"]).unwrap();
    assert_eq!(read(&vf_file(&sim, VF0, "nvidia/creatable_vgpu_types")), Err(EIO));
    assert!(read(&vf_file(&sim, VF0, "nvidia/creatable_vgpu_types")).is_ok());
    sim.ctl(&["fail-read", "sys/bus/pci/devices", "EACCES"]).unwrap();
    let mut it = std::fs::read_dir(sim.path().join("sys/bus/pci/devices")).unwrap();
    let e = it.next().unwrap().unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EACCES));
    sim.ctl(&["fail-read", "sys/bus/pci/devices/*/physfn", "EIO"]).unwrap();
    let e = std::fs::read_link(vf_file(&sim, VF2, "physfn")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EIO));
    assert!(std::fs::read_link(vf_file(&sim, VF2, "physfn")).is_ok());
}

#[test]
fn fail_open_and_clear_faults() {
    let sim = SimMount::start(V).unwrap();
    write(&ty(&sim, VF0), "1148").unwrap();
    sim.ctl(&["fail-open", "dev/vfio/4*", "EPERM", "--always"]).unwrap();
    assert_eq!(open_rw(&sim.path().join("dev/vfio/41")).err(), Some(EPERM));
    assert_eq!(open_rw(&sim.path().join("dev/vfio/41")).err(), Some(EPERM));
    sim.ctl(&["clear-faults"]).unwrap();
    assert!(sim.state().unwrap()["faults"].as_array().unwrap().is_empty());
    let _f = open_rw(&sim.path().join("dev/vfio/41")).unwrap();
}

#[test]
fn delay_write_does_not_block_the_filesystem() {
    let sim = SimMount::start(V).unwrap();
    let path = format!("sys/bus/pci/devices/{VF0}/nvidia/current_vgpu_type");
    sim.ctl(&["delay-write", &path, "3000", "--times", "1"]).unwrap();
    let p = ty(&sim, VF0);
    let start = Instant::now();
    let writer = std::thread::spawn(move || write(&p, "1148"));
    // While the write is pending, a foreign tool sets the type.
    assert!(poll(Duration::from_secs(2), || { sim.state().unwrap()["faults"].as_array().unwrap().is_empty() }));
    sim.ctl(&["set-type", VF0, "1147"]).unwrap();
    assert!(start.elapsed() < Duration::from_millis(2900), "ctl was blocked");
    // The delayed write then proceeds and meets the rules: EPERM (a type is set).
    assert_eq!(writer.join().unwrap(), Err(EPERM));
    assert!(start.elapsed() >= Duration::from_millis(2900));
    assert_eq!(read(&ty(&sim, VF0)).unwrap(), "1147\n");
    let st = sim.state().unwrap();
    let ops: Vec<&str> = st["log"].as_array().unwrap().iter().map(|e| e["op"].as_str().unwrap()).collect();
    // The delayed write is logged when it begins and again when it completes.
    assert_eq!(ops, vec!["write-delayed", "set-type", "write"]);
}

#[test]
fn wedge_unwedge_only_flag() {
    let sim = SimMount::start(V).unwrap();
    sim.ctl(&["wedge", VF2]).unwrap();
    let st = sim.state().unwrap();
    assert_eq!(vf_state(&st, VF2)["wedged"], true);
    write(&ty(&sim, VF2), "1148").unwrap(); // a wedged VF accepts writes
    sim.ctl(&["unwedge", VF2]).unwrap();
    assert_eq!(vf_state(&sim.state().unwrap(), VF2)["wedged"], false);
    sim.ctl(&["wedge", VF2]).unwrap();
    sim.ctl(&["disable-vfs", PF]).unwrap();
    sim.ctl(&["enable-vfs", PF]).unwrap();
    assert_eq!(vf_state(&sim.state().unwrap(), VF2)["wedged"], false);
    assert!(sim.ctl(&["wedge", "0000:99:00.4"]).is_err());
}

#[test]
fn release_delay_per_device() {
    let sim = SimMount::start(V).unwrap();
    write(&ty(&sim, VF0), "1148").unwrap();
    write(&ty(&sim, VF1), "1148").unwrap();
    sim.ctl(&["release-delay", VF0, "0"]).unwrap();
    sim.ctl(&["release-delay", VF1, "3000"]).unwrap();
    drop(open_rw(&sim.path().join("dev/vfio/41")).unwrap());
    drop(open_rw(&sim.path().join("dev/vfio/42")).unwrap());
    write(&ty(&sim, VF0), "0").unwrap();
    assert_eq!(write(&ty(&sim, VF1), "0"), Err(EBUSY));
    let st = sim.state().unwrap();
    assert!(vf_state(&st, VF1)["busy_until_ms"].as_u64().is_some());
    assert_eq!(vf_state(&st, VF1)["release_delay_ms"], 3000);
}

#[test]
fn set_type_is_foreign_and_logged() {
    let sim = SimMount::start(V).unwrap();
    write(&ty(&sim, VF0), "1148").unwrap();
    // Skips the catalog check (1159 is not creatable next to a 2Q).
    sim.ctl(&["set-type", VF1, "1159"]).unwrap();
    assert_eq!(read(&ty(&sim, VF1)).unwrap(), "1159\n");
    assert!(sim.ctl(&["set-type", VF2, "4242"]).is_err());
    let st = sim.state().unwrap();
    let e = st["log"].as_array().unwrap().iter().find(|e| e["op"] == "set-type").unwrap();
    assert_eq!(e["path"], format!("sys/bus/pci/devices/{VF1}/nvidia/current_vgpu_type"));
    assert_eq!(e["value"], "1159");
    assert_eq!(e["pid"], std::process::id());
}

#[test]
fn enable_disable_vfs() {
    let sim = SimMount::start(
        r#"
vfs_at_boot = false
[[gpu]]
bdf = "0000:41:00.0"
vf_count = 4
iommu_group = 40
"#,
    )
    .unwrap();
    let pf = sim.path().join("sys/bus/pci/devices/0000:41:00.0");
    assert_eq!(read(&pf.join("sriov_numvfs")).unwrap(), "0\n");
    assert_eq!(read(&pf.join("sriov_totalvfs")).unwrap(), "4\n");
    sim.ctl(&["enable-vfs", PF, "--delay", "300"]).unwrap();
    assert_eq!(read(&pf.join("sriov_numvfs")).unwrap(), "0\n");
    assert!(poll(Duration::from_secs(3), || read(&pf.join("sriov_numvfs")).unwrap() == "4\n"));
    assert!(sim.path().join("dev/vfio/devices/vfio3").exists());
    write(&ty(&sim, VF0), "1148").unwrap();
    let h = open_rw(&sim.path().join("dev/vfio/41")).unwrap();
    let err = sim.ctl(&["disable-vfs", PF]).unwrap_err();
    assert!(format!("{err}").contains("EBUSY"), "{err}");
    drop(h);
    sim.ctl(&["disable-vfs", PF]).unwrap();
    assert_eq!(read(&ty(&sim, VF0)), Err(ENOENT));
    sim.ctl(&["enable-vfs", PF]).unwrap();
    // Types are gone and vfio numbers keep growing.
    assert_eq!(read(&ty(&sim, VF0)).unwrap(), "0\n");
    assert!(vf_file(&sim, VF0, "vfio-dev/vfio4").is_dir());
    assert!(!sim.path().join("dev/vfio/devices/vfio0").exists());
}

#[test]
fn reload_driver_shifts_ids_and_keeps_boot_id() {
    let sim = SimMount::start(V).unwrap();
    let boot = read(&sim.path().join("proc/sys/kernel/random/boot_id")).unwrap();
    write(&ty(&sim, VF0), "1148").unwrap();
    sim.ctl(&["reload-driver", "590.10.01", "--id-shift", "100"]).unwrap();
    assert_eq!(read(&sim.path().join("sys/module/nvidia/version")).unwrap(), "590.10.01\n");
    assert_eq!(read(&ty(&sim, VF0)).unwrap(), "0\n");
    assert_eq!(catalog_ids(&sim, VF0)[0], 1247);
    assert_eq!(write(&ty(&sim, VF0), "1148"), Err(libc::EINVAL));
    write(&ty(&sim, VF0), "1248").unwrap();
    assert_eq!(read(&sim.path().join("proc/sys/kernel/random/boot_id")).unwrap(), boot);
}

#[test]
fn override_content_absent_unoverride() {
    let sim = SimMount::start(V).unwrap();
    let cat = format!("sys/bus/pci/devices/{VF0}/nvidia/creatable_vgpu_types");
    sim.ctl(&["override", &cat, "garbage\r\n1147 NVIDIA L40S-1Q\n"]).unwrap();
    assert_eq!(read(&sim.path().join(&cat)).unwrap(), "garbage\r\n1147 NVIDIA L40S-1Q\n");
    sim.ctl(&["override", &format!("sys/bus/pci/devices/{VF1}/nvidia/current_vgpu_type"), "--absent"]).unwrap();
    assert_eq!(read(&ty(&sim, VF1)), Err(ENOENT));
    sim.ctl(&["override", &format!("sys/bus/pci/devices/{VF2}/vfio-dev"), "--absent"]).unwrap();
    assert!(!vf_file(&sim, VF2, "vfio-dev").exists());
    sim.ctl(&["unoverride", &cat]).unwrap();
    assert_eq!(catalog_ids(&sim, VF0).len(), 8);
    sim.ctl(&["unoverride", &format!("sys/bus/pci/devices/{VF1}/nvidia/current_vgpu_type")]).unwrap();
    assert_eq!(read(&ty(&sim, VF1)).unwrap(), "0\n");
    assert!(sim.ctl(&["unoverride", "nothing"]).is_err());
}

#[test]
fn reboot_resets_everything() {
    let sim = SimMount::start(V).unwrap();
    let boot_path = sim.path().join("proc/sys/kernel/random/boot_id");
    let boot = read(&boot_path).unwrap();
    write(&ty(&sim, VF0), "1148").unwrap();
    let mut held = open_rw(&sim.path().join("dev/vfio/41")).unwrap();
    sim.ctl(&["fail-write", "x", "EIO"]).unwrap();
    let ans = sim.ctl(&["reboot", "--vf-delay", "300"]).unwrap();
    let new = read(&boot_path).unwrap();
    assert_ne!(new, boot);
    assert_eq!(ans["boot_id"].as_str().unwrap(), new.trim());
    assert_eq!(read(&sim.path().join("sys/bus/pci/devices/0000:41:00.0/sriov_numvfs")).unwrap(), "0\n");
    use std::io::Read;
    let mut s = String::new();
    assert_eq!(held.read_to_string(&mut s).unwrap_err().raw_os_error(), Some(ENODEV));
    assert!(poll(Duration::from_secs(3), || read(&ty(&sim, VF0)).as_deref() == Ok("0\n")));
    let st = sim.state().unwrap();
    assert!(st["faults"].as_array().unwrap().is_empty());
    assert!(vf_state(&st, VF0)["handles"].as_array().unwrap().is_empty());
    assert_eq!(vf_state(&st, VF0)["cdev"], "vfio0");
}

#[test]
fn state_dump_file_and_cli() {
    let sim = SimMount::start(V).unwrap();
    write(&ty(&sim, VF0), "1150").unwrap();
    let text = read(&sim.path().join(".sim/state.json")).unwrap();
    // Stable key order, as documented.
    let keys = ["\"boot_id\"", "\"driver_version\"", "\"framework\"", "\"gpus\"", "\"mdevs\"", "\"log\""];
    let pos: Vec<usize> = keys.iter().map(|k| text.find(k).unwrap()).collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{pos:?}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["framework"], "vendor-vfio");
    assert_eq!(v["gpus"][0]["active_fb_mib"], 4096);
    assert_eq!(vf_state(&v, VF0)["name"], "NVIDIA L40S-4Q");
    assert_eq!(vf_state(&v, VF1)["creatable"], serde_json::json!([1150]));
    // The CLI prints the answer and exits non-zero on ok:false.
    let bin = env!("CARGO_BIN_EXE_gpuvisor-sim");
    let out = Command::new(bin).arg("ctl").arg(sim.path()).args(["set-type", VF1, "1150"]).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("{\"ok\":true"));
    let out = Command::new(bin).arg("ctl").arg(sim.path()).args(["set-type", "0000:00:00.0", "1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"ok\":false"));
    let out = Command::new(bin).arg("ctl").arg(sim.path()).args(["bogus-command"]).output().unwrap();
    assert!(!out.status.success());
}

/// `gpuvisor-sim ctl DIR help` lists every command of the one command table (`CtlCmd`), with
/// or without a mount; `help COMMAND` gives one command's arguments; the channel itself
/// answers `help` with `ok` too.
#[test]
fn help_lists_every_command_from_the_table() {
    use clap::CommandFactory;
    let bin = gpuvisor_sim::testing::sim_binary().unwrap();
    let names: Vec<String> =
        gpuvisor_sim::ctl::CtlLine::command().get_subcommands().map(|c| c.get_name().to_string()).collect();
    assert!(names.len() >= 20, "{names:?}");
    let out = Command::new(&bin).args(["ctl", "/nonexistent-dir", "help"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for n in &names {
        assert!(text.lines().any(|l| l.split_whitespace().next() == Some(n.as_str())), "{n} missing:\n{text}");
    }
    let out = Command::new(&bin).args(["ctl", "/nonexistent-dir", "help", "fail-write"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("<ERRNO>") && text.contains("--times"), "{text}");
    let out = Command::new(&bin).args(["ctl", "/nonexistent-dir", "help", "no-such"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown command \"no-such\""), "{out:?}");
    // The channel: a request of `help` answers ok with the same text.
    let sim = SimMount::start(V).unwrap();
    let v = sim.ctl(&["help"]).unwrap();
    let text = v["help"].as_str().unwrap();
    assert!(names.iter().all(|n| text.contains(n.as_str())), "{text}");
}
