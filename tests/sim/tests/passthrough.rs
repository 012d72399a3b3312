//! Whole-GPU passthrough (docs/design/host.md §7, §10.3 rules 9–11): bindings, `driver_override`,
//! `drivers_probe`, the group node, `dev/nvidia<N>`, reset and wedge, faults, reboot, the mixed
//! preset and the dump, on real FUSE mounts.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use libc::{EBUSY, EINVAL, EIO, ENODEV, ENOENT, EPERM};
use serde_json::Value;

const P0: &str = "0000:82:00.0";
const P0A: &str = "0000:82:00.1";
const BRIDGE: &str = "0000:80:01.0";
const P1: &str = "0000:83:00.0";
const P2: &str = "0000:84:00.0";
const P2A: &str = "0000:84:00.1";
const NIC: &str = "0000:85:00.0";

fn dev(sim: &SimMount, bdf: &str, file: &str) -> PathBuf {
    sim.path().join(format!("sys/bus/pci/devices/{bdf}/{file}"))
}

fn root(sim: &SimMount, p: &str) -> PathBuf {
    sim.path().join(p)
}

/// The basename of `<BDF>/driver`, or `None` while unbound.
fn driver(sim: &SimMount, bdf: &str) -> Option<String> {
    let l = std::fs::read_link(dev(sim, bdf, "driver")).ok()?;
    Some(l.file_name().unwrap().to_string_lossy().into_owned())
}

fn read_bytes(p: &std::path::Path) -> Result<Vec<u8>, i32> {
    std::fs::read(p).map_err(|e| e.raw_os_error().unwrap_or(-1))
}

fn pt_state<'a>(st: &'a Value, bdf: &str) -> &'a Value {
    st["passthrough"].as_array().unwrap().iter().find(|p| p["bdf"] == bdf).unwrap_or_else(|| panic!("no {bdf}"))
}

fn fn_state<'a>(st: &'a Value, bdf: &str) -> &'a Value {
    st["passthrough"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["functions"].as_array().unwrap())
        .find(|f| f["bdf"] == bdf)
        .unwrap_or_else(|| panic!("no function {bdf}"))
}

/// The agent's move of one member (§7 bind step 4): override, unbind via the `driver` link,
/// probe.
fn move_to_vfio(sim: &SimMount, bdf: &str) {
    write(&dev(sim, bdf, "driver_override"), "vfio-pci").unwrap();
    write(&dev(sim, bdf, "driver/unbind"), bdf).unwrap();
    assert_eq!(driver(sim, bdf), None);
    write(&root(sim, "sys/bus/pci/drivers_probe"), bdf).unwrap();
    assert_eq!(driver(sim, bdf).as_deref(), Some("vfio-pci"));
}

/// The agent's give-back of one member (§7 give back step 2).
fn give_back(sim: &SimMount, bdf: &str) {
    write(&dev(sim, bdf, "driver_override"), "\n").unwrap();
    assert_eq!(read(&dev(sim, bdf, "driver_override")).unwrap(), "(null)\n");
    write(&dev(sim, bdf, "driver/unbind"), bdf).unwrap();
    write(&root(sim, "sys/bus/pci/drivers_probe"), bdf).unwrap();
}

#[test]
fn pt2_boot_state() {
    let sim = SimMount::start("pt-2").unwrap();
    let link = |p: PathBuf| std::fs::read_link(p).unwrap().to_string_lossy().into_owned();
    assert_eq!(link(root(&sim, &format!("sys/bus/pci/devices/{P0}"))), "../../../devices/pci0000:82/0000:82:00.0");
    assert_eq!(link(root(&sim, &format!("sys/bus/pci/devices/{BRIDGE}"))), "../../../devices/pci0000:80/0000:80:01.0");
    assert_eq!(link(dev(&sim, P0, "driver")), "../../../bus/pci/drivers/nvidia");
    assert_eq!(link(dev(&sim, P0, "iommu_group")), "../../../kernel/iommu_groups/40");
    assert_eq!(link(dev(&sim, P2A, "iommu_group")), "../../../kernel/iommu_groups/42");
    assert_eq!(
        std::fs::canonicalize(dev(&sim, P0A, "driver")).unwrap(),
        root(&sim, "sys/bus/pci/drivers/snd_hda_intel")
    );
    assert_eq!(driver(&sim, P0).as_deref(), Some("nvidia"));
    assert_eq!(driver(&sim, P0A).as_deref(), Some("snd_hda_intel"));
    assert_eq!(driver(&sim, BRIDGE).as_deref(), Some("pcieport"));
    assert_eq!(driver(&sim, NIC).as_deref(), Some("igb"));
    // Group membership.
    let mut members: Vec<String> = std::fs::read_dir(root(&sim, "sys/kernel/iommu_groups/40/devices"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    members.sort();
    assert_eq!(members, vec![BRIDGE, P0, P0A]);
    assert_eq!(std::fs::read_dir(root(&sim, "sys/kernel/iommu_groups/41/devices")).unwrap().count(), 2);
    assert!(root(&sim, &format!("sys/kernel/iommu_groups/42/devices/{NIC}/vendor")).is_file());
    // Attribute files.
    assert_eq!(read(&dev(&sim, P0, "vendor")).unwrap(), "0x10de\n");
    assert_eq!(read(&dev(&sim, P0, "device")).unwrap(), "0x26b1\n");
    assert_eq!(read(&dev(&sim, P0, "class")).unwrap(), "0x030000\n");
    assert_eq!(read(&dev(&sim, P0A, "device")).unwrap(), "0x22ba\n");
    assert_eq!(read(&dev(&sim, P0A, "class")).unwrap(), "0x040300\n");
    assert_eq!(read(&dev(&sim, NIC, "vendor")).unwrap(), "0x8086\n");
    assert_eq!(read(&dev(&sim, NIC, "device")).unwrap(), "0x1533\n");
    assert_eq!(read(&dev(&sim, P0, "numa_node")).unwrap(), "0\n");
    assert_eq!(read(&dev(&sim, P1, "numa_node")).unwrap(), "0\n");
    assert_eq!(read(&dev(&sim, P2, "numa_node")).unwrap(), "1\n");
    assert_eq!(read(&dev(&sim, P0, "driver_override")).unwrap(), "(null)\n");
    assert_eq!(read(&dev(&sim, BRIDGE, "driver_override")).unwrap(), "(null)\n");
    assert_eq!(read(&dev(&sim, P0, "power_state")).unwrap(), "D0\n");
    let cfg = read_bytes(&dev(&sim, P0, "config")).unwrap();
    assert_eq!(cfg.len(), 64);
    assert_eq!(&cfg[0..4], &[0xde, 0x10, 0xb1, 0x26]);
    assert_eq!(&cfg[9..12], &[0x00, 0x00, 0x03]);
    assert_eq!(cfg[0x0e], 0x80, "multifunction type 0 header");
    let bcfg = read_bytes(&dev(&sim, BRIDGE, "config")).unwrap();
    assert_eq!(&bcfg[9..12], &[0x00, 0x04, 0x06]);
    assert_eq!(bcfg[0x0e], 0x01, "single-function bridge (type 1) header");
    // Modes.
    let mode = |p: PathBuf| p.metadata().unwrap().mode() & 0o7777;
    assert_eq!(mode(dev(&sim, P0, "driver_override")), 0o644);
    assert_eq!(mode(dev(&sim, P0, "reset")), 0o200);
    assert_eq!(mode(dev(&sim, P0A, "reset")), 0o200);
    assert_eq!(mode(dev(&sim, P0, "config")), 0o444);
    assert_eq!(mode(dev(&sim, P0, "power_state")), 0o444);
    assert_eq!(mode(root(&sim, "sys/bus/pci/drivers_probe")), 0o200);
    for d in ["nvidia", "vfio-pci", "snd_hda_intel", "pcieport", "igb"] {
        assert_eq!(mode(root(&sim, &format!("sys/bus/pci/drivers/{d}/bind"))), 0o200, "{d}");
        assert_eq!(mode(root(&sim, &format!("sys/bus/pci/drivers/{d}/unbind"))), 0o200, "{d}");
    }
    assert_eq!(
        link(root(&sim, &format!("sys/bus/pci/drivers/snd_hda_intel/{P0A}"))),
        "../../../../devices/pci0000:82/0000:82:00.1"
    );
    assert!(root(&sim, &format!("sys/bus/pci/drivers/nvidia/{P2}/vendor")).is_file());
    assert_eq!(std::fs::read_dir(root(&sim, "sys/bus/pci/drivers/vfio-pci")).unwrap().count(), 2);
    // No reset on a group_extra device; no SR-IOV or nvidia/ on a passthrough GPU.
    assert!(!dev(&sim, BRIDGE, "reset").exists());
    assert!(!dev(&sim, NIC, "reset").exists());
    assert!(!dev(&sim, P0, "sriov_totalvfs").exists());
    assert!(!dev(&sim, P0, "sriov_numvfs").exists());
    assert!(!dev(&sim, P0, "nvidia").exists());
    // Device nodes: no group node until the group moves; dev/nvidia<N> for every GPU.
    for g in [40, 41, 42] {
        assert!(!root(&sim, &format!("dev/vfio/{g}")).exists());
    }
    for n in 0..3 {
        assert!(root(&sim, &format!("dev/nvidia{n}")).is_file());
    }
    assert!(!root(&sim, "dev/nvidia3").exists());
    let info = read(&root(&sim, &format!("proc/driver/nvidia/gpus/{P0}/information"))).unwrap();
    assert!(info.contains("Model: \t\t NVIDIA RTX 6000 Ada Generation\n"), "{info}");
    assert!(info.contains("Device Minor: \t 0\n"), "{info}");
    assert!(info.contains(&format!("Bus Location: \t {P0}\n")), "{info}");
    let info2 = read(&root(&sim, &format!("proc/driver/nvidia/gpus/{P2}/information"))).unwrap();
    assert!(info2.contains("Device Minor: \t 2\n"), "{info2}");
    assert!(info.lines().all(|l| l.contains(':')));
    let st = sim.state().unwrap();
    assert_eq!(st["framework"], "passthrough");
    assert!(st["gpus"].as_array().unwrap().is_empty());
    assert_eq!(st["passthrough"].as_array().unwrap().len(), 3);
}

#[test]
fn group_moves_to_vfio_pci_and_back() {
    let sim = SimMount::start("pt-2").unwrap();
    sim.ctl(&["release-delay", P0, "0"]).unwrap();
    let node = root(&sim, "dev/vfio/40");
    move_to_vfio(&sim, P0);
    // The GPU has left nvidia: its nvidia node and procfs entry are gone, the group is not
    // complete yet.
    assert!(!root(&sim, "dev/nvidia0").exists());
    assert!(!root(&sim, &format!("proc/driver/nvidia/gpus/{P0}")).exists());
    assert!(root(&sim, "dev/nvidia1").exists());
    assert!(!node.exists());
    move_to_vfio(&sim, P0A);
    assert!(node.is_file());
    assert_eq!(driver(&sim, BRIDGE).as_deref(), Some("pcieport"));
    assert_eq!(read(&dev(&sim, P0, "driver_override")).unwrap(), "vfio-pci\n");
    assert!(root(&sim, &format!("sys/bus/pci/drivers/vfio-pci/{P0A}")).exists());
    // The group node opens once.
    let f = open_rw(&node).unwrap();
    assert_eq!(open_rw(&node).err(), Some(EBUSY));
    drop(f);
    // Give back, in reverse order.
    assert!(poll(Duration::from_secs(3), || {
        write(&dev(&sim, P0A, "driver_override"), "\n").unwrap();
        write(&root(&sim, "sys/bus/pci/drivers/vfio-pci/unbind"), P0A).is_ok()
    }));
    assert!(!node.exists());
    write(&root(&sim, "sys/bus/pci/drivers_probe"), P0A).unwrap();
    assert_eq!(driver(&sim, P0A).as_deref(), Some("snd_hda_intel"));
    give_back(&sim, P0);
    assert_eq!(driver(&sim, P0).as_deref(), Some("nvidia"));
    assert!(root(&sim, "dev/nvidia0").is_file());
    assert!(root(&sim, &format!("proc/driver/nvidia/gpus/{P0}/information")).is_file());
    assert!(!node.exists());
    let st = sim.state().unwrap();
    let p = pt_state(&st, P0);
    for f in p["functions"].as_array().unwrap() {
        assert_eq!(f["driver"], f["boot_driver"]);
        assert_eq!(f["driver_override"], Value::Null);
    }
    // The log has every write, in order.
    let w = writes(&st);
    let ops: Vec<(&str, &str)> = w.iter().map(|(p, v, _)| (p.as_str(), v.as_str())).collect();
    assert_eq!(ops[0], (&*format!("sys/bus/pci/devices/{P0}/driver_override"), "vfio-pci"));
    assert_eq!(ops[1], ("sys/bus/pci/drivers/nvidia/unbind", P0));
    assert_eq!(ops[2], ("sys/bus/pci/drivers_probe", P0));
    assert!(w.iter().all(|(_, _, r)| r == "ok" || r == "EBUSY"));
    let opens: Vec<&str> = st["log"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["op"] == "open")
        .map(|e| e["result"].as_str().unwrap())
        .collect();
    assert_eq!(opens, vec!["ok", "EBUSY"]);
}

#[test]
fn a_group_with_an_unrelated_device_needs_it_moved_too() {
    let sim = SimMount::start("pt-2").unwrap();
    move_to_vfio(&sim, P2);
    move_to_vfio(&sim, P2A);
    assert!(!root(&sim, "dev/vfio/42").exists());
    move_to_vfio(&sim, NIC);
    assert!(root(&sim, "dev/vfio/42").is_file());
    let st = sim.state().unwrap();
    assert_eq!(fn_state(&st, NIC)["own"], false);
    assert_eq!(fn_state(&st, P2A)["own"], true);
}

#[test]
fn bind_unbind_probe_errnos() {
    let sim = SimMount::start("pt-2").unwrap();
    let drv = |d: &str, f: &str| root(&sim, &format!("sys/bus/pci/drivers/{d}/{f}"));
    let probe = root(&sim, "sys/bus/pci/drivers_probe");
    // Unbind from a driver the device is not bound to, or an unknown device.
    assert_eq!(write(&drv("vfio-pci", "unbind"), P0), Err(ENODEV));
    assert_eq!(write(&drv("snd_hda_intel", "unbind"), P0), Err(ENODEV));
    assert_eq!(write(&drv("nvidia", "unbind"), "0000:99:00.0"), Err(ENODEV));
    // Bind while bound (to anything), or an unknown device.
    assert_eq!(write(&drv("nvidia", "bind"), P0), Err(EBUSY));
    assert_eq!(write(&drv("vfio-pci", "bind"), P0), Err(EBUSY));
    assert_eq!(write(&drv("vfio-pci", "bind"), "0000:99:00.0"), Err(ENODEV));
    // Probe: unknown → ENODEV; bound → no change.
    assert_eq!(write(&probe, "0000:99:00.0"), Err(ENODEV));
    write(&probe, P0).unwrap();
    assert_eq!(driver(&sim, P0).as_deref(), Some("nvidia"));
    // driver_override: whitespace or > 63 bytes → EINVAL; any time otherwise.
    assert_eq!(write(&dev(&sim, P0, "driver_override"), "vfio pci"), Err(EINVAL));
    assert_eq!(write(&dev(&sim, P0, "driver_override"), &"x".repeat(64)), Err(EINVAL));
    write(&dev(&sim, P0, "driver_override"), &"x".repeat(63)).unwrap();
    assert_eq!(read(&dev(&sim, P0, "driver_override")).unwrap(), format!("{}\n", "x".repeat(63)));
    write(&dev(&sim, P0, "driver_override"), "\n").unwrap();
    assert_eq!(read(&dev(&sim, P0, "driver_override")).unwrap(), "(null)\n");
    // An NVML client holds dev/nvidia0: unbinding the GPU from nvidia is refused.
    let nv = root(&sim, "dev/nvidia0");
    let holder = Holder::spawn(&nv);
    let second = open_rw(&nv).unwrap(); // any number of opens
    let st = sim.state().unwrap();
    let hs = pt_state(&st, P0)["handles"].as_array().unwrap().clone();
    assert_eq!(hs.len(), 2);
    assert_eq!(hs[0]["pid"], holder.pid());
    assert_eq!(hs[0]["node"], "dev/nvidia0");
    assert_eq!(write(&drv("nvidia", "unbind"), P0), Err(EBUSY));
    // The audio function is independent of the nvidia node.
    write(&drv("snd_hda_intel", "unbind"), P0A).unwrap();
    holder.kill();
    drop(second);
    assert!(poll(Duration::from_secs(3), || write(&drv("nvidia", "unbind"), P0).is_ok()));
    // An explicit bind ignores driver_override.
    write(&dev(&sim, P0A, "driver_override"), "vfio-pci").unwrap();
    write(&drv("snd_hda_intel", "bind"), P0A).unwrap();
    assert_eq!(driver(&sim, P0A).as_deref(), Some("snd_hda_intel"));
    // vfio-pci cannot take a bridge.
    write(&drv("pcieport", "unbind"), BRIDGE).unwrap();
    assert_eq!(write(&drv("vfio-pci", "bind"), BRIDGE), Err(EINVAL));
    write(&drv("pcieport", "bind"), BRIDGE).unwrap();
}

#[test]
fn group_busy_while_open_and_during_the_lag() {
    let sim = SimMount::start("pt-2").unwrap();
    move_to_vfio(&sim, P0);
    move_to_vfio(&sim, P0A);
    let unbind = root(&sim, "sys/bus/pci/drivers/vfio-pci/unbind");
    let node = root(&sim, "dev/vfio/40");
    let holder = Holder::spawn(&node);
    let fd = std::fs::read_link(format!("/proc/{}/fd/3", holder.pid())).unwrap();
    assert_eq!(fd, node);
    assert_eq!(write(&unbind, P0), Err(EBUSY));
    assert_eq!(write(&unbind, P0A), Err(EBUSY));
    assert_eq!(write(&dev(&sim, P0, "reset"), "1"), Err(EBUSY));
    // Overrides can still be written.
    write(&dev(&sim, P0, "driver_override"), "\n").unwrap();
    let st = sim.state().unwrap();
    assert_eq!(pt_state(&st, P0)["handles"][0]["node"], "dev/vfio/40");
    assert_eq!(pt_state(&st, P0)["handles"][0]["pid"], holder.pid());
    sim.ctl(&["release-delay", P0, "800"]).unwrap();
    holder.kill();
    let closed = Instant::now();
    assert_eq!(write(&unbind, P0), Err(EBUSY));
    let st = sim.state().unwrap();
    assert!(st["passthrough"][0]["busy_until_ms"].is_u64());
    assert!(poll(Duration::from_secs(5), || write(&unbind, P0).is_ok()));
    let took = closed.elapsed();
    assert!(took >= Duration::from_millis(700), "unbound after {took:?}");
    assert!(!node.exists());
    // The reset is not refused by the lag, only by an open group.
    write(&dev(&sim, P0, "reset"), "1").unwrap();
}

#[test]
fn reset_counts_and_wedge() {
    let sim = SimMount::start("pt-2").unwrap();
    let reset = dev(&sim, P0, "reset");
    write(&reset, "1").unwrap();
    write(&reset, "1\n").unwrap();
    assert_eq!(write(&reset, "0"), Err(EINVAL));
    assert_eq!(write(&reset, "yes"), Err(EINVAL));
    write(&dev(&sim, P0A, "reset"), "1").unwrap(); // the audio function's reset is not counted
    assert_eq!(pt_state(&sim.state().unwrap(), P0)["resets"], 2);
    sim.ctl(&["wedge", P0]).unwrap();
    assert_eq!(write(&reset, "1"), Err(EIO));
    assert_eq!(read(&dev(&sim, P0, "power_state")).unwrap(), "D3cold\n");
    assert_eq!(read(&dev(&sim, P0A, "power_state")).unwrap(), "D3cold\n");
    assert_eq!(read_bytes(&dev(&sim, P0, "config")).unwrap(), vec![0xff; 64]);
    // Other GPUs and the bridge are unaffected.
    assert_eq!(read(&dev(&sim, P1, "power_state")).unwrap(), "D0\n");
    assert_eq!(read(&dev(&sim, BRIDGE, "power_state")).unwrap(), "D0\n");
    let st = sim.state().unwrap();
    assert_eq!(pt_state(&st, P0)["wedged"], true);
    assert_eq!(pt_state(&st, P0)["resets"], 2);
    sim.ctl(&["unwedge", P0]).unwrap();
    assert_eq!(read(&dev(&sim, P0, "power_state")).unwrap(), "D0\n");
    assert_eq!(&read_bytes(&dev(&sim, P0, "config")).unwrap()[0..2], &[0xde, 0x10]);
    write(&reset, "1").unwrap();
    assert_eq!(pt_state(&sim.state().unwrap(), P0)["resets"], 3);
    assert!(sim.ctl(&["wedge", "0000:99:00.0"]).is_err());
}

#[test]
fn stuck_driver_does_not_come_back() {
    let sim = SimMount::start("pt-2").unwrap();
    let probe = root(&sim, "sys/bus/pci/drivers_probe");
    sim.ctl(&["stuck-driver", P0]).unwrap();
    write(&root(&sim, "sys/bus/pci/drivers/nvidia/unbind"), P0).unwrap();
    // The probe succeeds, but nvidia does not take the GPU.
    write(&probe, P0).unwrap();
    assert_eq!(driver(&sim, P0), None);
    assert!(!root(&sim, "dev/nvidia0").exists());
    assert_eq!(write(&root(&sim, "sys/bus/pci/drivers/nvidia/bind"), P0), Err(ENODEV));
    let st = sim.state().unwrap();
    assert_eq!(fn_state(&st, P0)["stuck"], true);
    assert_eq!(fn_state(&st, P0)["driver"], Value::Null);
    // Another driver still binds.
    write(&dev(&sim, P0, "driver_override"), "vfio-pci").unwrap();
    write(&probe, P0).unwrap();
    assert_eq!(driver(&sim, P0).as_deref(), Some("vfio-pci"));
    write(&dev(&sim, P0, "driver_override"), "\n").unwrap();
    write(&root(&sim, "sys/bus/pci/drivers/vfio-pci/unbind"), P0).unwrap();
    write(&probe, P0).unwrap();
    assert_eq!(driver(&sim, P0), None);
    sim.ctl(&["unstuck-driver", P0]).unwrap();
    write(&probe, P0).unwrap();
    assert_eq!(driver(&sim, P0).as_deref(), Some("nvidia"));
    assert!(sim.ctl(&["stuck-driver", "0000:99:00.0"]).is_err());
}

#[test]
fn faults_on_passthrough_paths() {
    let sim = SimMount::start("pt-2").unwrap();
    let probe = root(&sim, "sys/bus/pci/drivers_probe");
    // driver_override, by the bus name and by a glob.
    sim.ctl(&["fail-write", &format!("sys/bus/pci/devices/{P0}/driver_override"), "EIO"]).unwrap();
    assert_eq!(write(&dev(&sim, P0, "driver_override"), "vfio-pci"), Err(EIO));
    assert_eq!(read(&dev(&sim, P0, "driver_override")).unwrap(), "(null)\n");
    sim.ctl(&["fail-write", "sys/devices/pci0000:82/*/driver_override", "EPERM"]).unwrap();
    assert_eq!(write(&dev(&sim, P0A, "driver_override"), "vfio-pci"), Err(EPERM));
    write(&dev(&sim, P0, "driver_override"), "vfio-pci").unwrap();
    // unbind (reached through the driver link) and drivers_probe.
    sim.ctl(&["fail-write", "sys/bus/pci/drivers/nvidia/unbind", "EBUSY", "--times", "2"]).unwrap();
    assert_eq!(write(&dev(&sim, P0, "driver/unbind"), P0), Err(EBUSY));
    assert_eq!(write(&root(&sim, "sys/bus/pci/drivers/nvidia/unbind"), P0), Err(EBUSY));
    assert_eq!(driver(&sim, P0).as_deref(), Some("nvidia"));
    write(&dev(&sim, P0, "driver/unbind"), P0).unwrap();
    sim.ctl(&["fail-write", "sys/bus/pci/drivers_probe", "EIO"]).unwrap();
    assert_eq!(write(&probe, P0), Err(EIO));
    assert_eq!(driver(&sim, P0), None);
    write(&probe, P0).unwrap();
    assert_eq!(driver(&sim, P0).as_deref(), Some("vfio-pci"));
    sim.ctl(&["fail-write", "sys/bus/pci/drivers/vfio-pci/bind", "ENOMEM"]).unwrap();
    write(&root(&sim, "sys/bus/pci/drivers/snd_hda_intel/unbind"), P0A).unwrap();
    assert_eq!(write(&root(&sim, "sys/bus/pci/drivers/vfio-pci/bind"), P0A), Err(libc::ENOMEM));
    write(&root(&sim, "sys/bus/pci/drivers/vfio-pci/bind"), P0A).unwrap();
    // reset, by the real path.
    sim.ctl(&["fail-write", "sys/devices/pci0000:83/0000:83:00.0/reset", "EIO"]).unwrap();
    assert_eq!(write(&dev(&sim, P1, "reset"), "1"), Err(EIO));
    write(&dev(&sim, P1, "reset"), "1").unwrap();
    assert_eq!(pt_state(&sim.state().unwrap(), P1)["resets"], 1);
    // Opens of the group node and of dev/nvidia<N>.
    sim.ctl(&["fail-open", "dev/vfio/40", "EACCES"]).unwrap();
    assert_eq!(open_rw(&root(&sim, "dev/vfio/40")).err(), Some(libc::EACCES));
    drop(open_rw(&root(&sim, "dev/vfio/40")).unwrap());
    sim.ctl(&["fail-open", "dev/nvidia*", "EIO"]).unwrap();
    assert_eq!(open_rw(&root(&sim, "dev/nvidia1")).err(), Some(EIO));
    // Reads: config, power_state, the driver link.
    sim.ctl(&["fail-read", &format!("sys/bus/pci/devices/{P1}/config"), "EIO"]).unwrap();
    assert_eq!(read_bytes(&dev(&sim, P1, "config")), Err(EIO));
    assert_eq!(read_bytes(&dev(&sim, P1, "config")).unwrap().len(), 64);
    sim.ctl(&["fail-read", "sys/bus/pci/devices/*/power_state", "EIO"]).unwrap();
    assert_eq!(read(&dev(&sim, P1, "power_state")), Err(EIO));
    sim.ctl(&["fail-read", &format!("sys/bus/pci/devices/{P1}/driver"), "EIO"]).unwrap();
    assert_eq!(std::fs::read_link(dev(&sim, P1, "driver")).unwrap_err().raw_os_error(), Some(EIO));
    assert_eq!(driver(&sim, P1).as_deref(), Some("nvidia"));
    // Overrides: a content and an absent driver link.
    sim.ctl(&["override", &format!("sys/bus/pci/devices/{P1}/power_state"), "D3hot\n"]).unwrap();
    assert_eq!(read(&dev(&sim, P1, "power_state")).unwrap(), "D3hot\n");
    sim.ctl(&["override", &format!("sys/bus/pci/devices/{P1}/driver"), "--absent"]).unwrap();
    assert_eq!(driver(&sim, P1), None);
    sim.ctl(&["unoverride", &format!("sys/bus/pci/devices/{P1}/driver")]).unwrap();
    assert_eq!(driver(&sim, P1).as_deref(), Some("nvidia"));
    // A delayed unbind blocks, then proceeds.
    sim.ctl(&["delay-write", "sys/bus/pci/drivers/nvidia/unbind", "300", "--times", "1"]).unwrap();
    let t = Instant::now();
    write(&root(&sim, "sys/bus/pci/drivers/nvidia/unbind"), P1).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(250));
    assert_eq!(driver(&sim, P1), None);
    let st = sim.state().unwrap();
    let failed: Vec<(String, String)> =
        writes(&st).into_iter().filter(|(_, _, r)| r != "ok").map(|(p, _, r)| (p, r)).collect();
    assert_eq!(failed[0], (format!("sys/bus/pci/devices/{P0}/driver_override"), "EIO".to_string()));
    assert!(failed.contains(&("sys/bus/pci/drivers_probe".to_string(), "EIO".to_string())));
    assert!(failed.contains(&(format!("sys/bus/pci/devices/{P1}/reset"), "EIO".to_string())));
}

#[test]
fn reboot_returns_every_function_to_its_boot_driver() {
    let sim = SimMount::start("pt-2").unwrap();
    move_to_vfio(&sim, P0);
    move_to_vfio(&sim, P0A);
    let mut held = open_rw(&root(&sim, "dev/vfio/40")).unwrap();
    let nv = open_rw(&root(&sim, "dev/nvidia1")).unwrap();
    sim.ctl(&["wedge", P1]).unwrap();
    sim.ctl(&["stuck-driver", P2]).unwrap();
    sim.ctl(&["unbind-host", NIC]).unwrap();
    write(&dev(&sim, P2A, "driver_override"), "vfio-pci").unwrap();
    sim.ctl(&["release-delay", P0, "5000"]).unwrap();
    sim.ctl(&["reboot"]).unwrap();
    for (b, d) in [(P0, "nvidia"), (P0A, "snd_hda_intel"), (BRIDGE, "pcieport"), (P2, "nvidia"), (NIC, "igb")] {
        assert_eq!(driver(&sim, b).as_deref(), Some(d), "{b}");
    }
    assert_eq!(read(&dev(&sim, P2A, "driver_override")).unwrap(), "(null)\n");
    assert_eq!(read(&dev(&sim, P1, "power_state")).unwrap(), "D0\n");
    assert!(!root(&sim, "dev/vfio/40").exists());
    assert!(root(&sim, "dev/nvidia0").exists());
    use std::io::Read;
    let mut s = String::new();
    assert_eq!(held.read_to_string(&mut s).unwrap_err().raw_os_error(), Some(ENODEV));
    let st = sim.state().unwrap();
    for p in st["passthrough"].as_array().unwrap() {
        assert_eq!(p["wedged"], false);
        assert_eq!(p["resets"], 0);
        assert_eq!(p["busy_until_ms"], Value::Null);
        assert!(p["handles"].as_array().unwrap().is_empty());
        for f in p["functions"].as_array().unwrap() {
            assert_eq!(f["stuck"], false);
            assert_eq!(f["driver"], f["boot_driver"]);
        }
    }
    drop(nv);
    // The old release delay is gone: the group's lag is the model's again.
    move_to_vfio(&sim, P0);
    move_to_vfio(&sim, P0A);
    drop(open_rw(&root(&sim, "dev/vfio/40")).unwrap());
    let t = Instant::now();
    assert!(poll(Duration::from_secs(3), || write(&root(&sim, "sys/bus/pci/drivers/vfio-pci/unbind"), P0).is_ok()));
    assert!(t.elapsed() < Duration::from_millis(2000));
}

#[test]
fn host_tools_bind_and_unbind() {
    let sim = SimMount::start("pt-2").unwrap();
    sim.ctl(&["bind-host", P1, "vfio-pci"]).unwrap();
    assert_eq!(driver(&sim, P1).as_deref(), Some("vfio-pci"));
    assert!(!root(&sim, "dev/nvidia1").exists());
    sim.ctl(&["unbind-host", P1]).unwrap();
    assert_eq!(driver(&sim, P1), None);
    assert!(sim.ctl(&["unbind-host", P1]).is_err());
    sim.ctl(&["bind-host", P1, "nouveau"]).unwrap();
    assert_eq!(driver(&sim, P1).as_deref(), Some("nouveau"));
    assert!(root(&sim, "sys/bus/pci/drivers/nouveau/unbind").exists());
    assert!(sim.ctl(&["bind-host", "0000:99:00.0", "vfio-pci"]).is_err());
    let st = sim.state().unwrap();
    let ops: Vec<(&str, &str, &str)> = st["log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["op"].as_str().unwrap(), e["path"].as_str().unwrap(), e["value"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        ops,
        vec![
            ("bind-host", "sys/bus/pci/drivers/vfio-pci/bind", P1),
            ("unbind-host", "sys/bus/pci/drivers/vfio-pci/unbind", P1),
            ("bind-host", "sys/bus/pci/drivers/nouveau/bind", P1),
        ]
    );
}

#[test]
fn dump_entries() {
    let sim = SimMount::start("pt-2").unwrap();
    let _nv = open_rw(&root(&sim, "dev/nvidia0")).unwrap();
    write(&dev(&sim, P0A, "driver_override"), "vfio-pci").unwrap();
    let text = read(&root(&sim, ".sim/state.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let p = &v["passthrough"][0];
    assert_eq!(p["bdf"], P0);
    assert_eq!(p["group"], 40);
    assert_eq!(p["model"], "NVIDIA RTX 6000 Ada Generation");
    assert_eq!(p["minor"], 0);
    assert_eq!(v["passthrough"][2]["minor"], 2);
    assert_eq!(p["wedged"], false);
    assert_eq!(p["resets"], 0);
    assert_eq!(p["busy_until_ms"], Value::Null);
    assert_eq!(p["handles"][0]["node"], "dev/nvidia0");
    assert!(p["handles"][0]["since_ms"].is_u64());
    let fns = p["functions"].as_array().unwrap();
    let bdfs: Vec<&str> = fns.iter().map(|f| f["bdf"].as_str().unwrap()).collect();
    assert_eq!(bdfs, vec![P0, P0A, BRIDGE]);
    assert_eq!(
        fns[1],
        serde_json::json!({"bdf": P0A, "class": "0x040300", "driver": "snd_hda_intel",
            "driver_override": "vfio-pci", "boot_driver": "snd_hda_intel", "own": true, "stuck": false})
    );
    assert_eq!(fns[2]["own"], false);
    assert_eq!(fns[2]["driver"], "pcieport");
    // Key order as documented.
    let obj = text.find("\"passthrough\": [").unwrap();
    let keys = [
        "\"bdf\"",
        "\"group\"",
        "\"model\"",
        "\"minor\"",
        "\"wedged\"",
        "\"resets\"",
        "\"busy_until_ms\"",
        "\"handles\"",
        "\"functions\"",
    ];
    let pos: Vec<usize> = keys.iter().map(|k| obj + text[obj..].find(k).unwrap()).collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{pos:?}");
    let top = ["\"gpus\"", "\"mdevs\"", "\"passthrough\": [", "\"faults\"", "\"log\""];
    let pos: Vec<usize> = top.iter().map(|k| text.find(k).unwrap()).collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{pos:?}");
    // release-delay works on a passthrough GPU, and only on known devices.
    sim.ctl(&["release-delay", P1, "100"]).unwrap();
    assert!(sim.ctl(&["release-delay", "0000:99:00.0", "100"]).is_err());
}

#[test]
fn mixed_l40s_pt_keeps_vf_behaviour() {
    let sim = SimMount::start("l40s-pt").unwrap();
    let vf = "0000:41:00.4";
    // The VFs behave as on l40s-2x16.
    assert_eq!(catalog_ids(&sim, vf).len(), 8);
    assert_eq!(open_rw(&root(&sim, "dev/vfio/41")).err(), Some(ENODEV));
    write(&ty(&sim, vf), "1148").unwrap();
    assert_eq!(catalog_ids(&sim, "0000:41:00.5"), vec![1148]);
    let _g = open_rw(&root(&sim, "dev/vfio/41")).unwrap();
    assert_eq!(write(&ty(&sim, vf), "0"), Err(EBUSY));
    assert!(root(&sim, "dev/vfio/devices/vfio15").is_file());
    // Two passthrough GPUs, no SR-IOV files, on nvidia.
    for (b, g, n) in [(P0, 80, 0), (P1, 81, 1)] {
        assert_eq!(driver(&sim, b).as_deref(), Some("nvidia"));
        assert_eq!(
            std::fs::read_link(dev(&sim, b, "iommu_group")).unwrap().to_string_lossy(),
            format!("../../../kernel/iommu_groups/{g}")
        );
        assert!(!dev(&sim, b, "sriov_totalvfs").exists());
        assert!(!dev(&sim, b, "physfn").exists());
        assert!(root(&sim, &format!("dev/nvidia{n}")).is_file());
    }
    assert_eq!(driver(&sim, "0000:83:00.1").as_deref(), Some("snd_hda_intel"));
    // drivers/nvidia holds the PF, its VFs and the passthrough GPUs.
    let nv = root(&sim, "sys/bus/pci/drivers/nvidia");
    assert!(nv.join("0000:41:00.0").exists() && nv.join(vf).exists() && nv.join(P0).exists());
    // The passthrough GPU moves; the VF rule (an unbind breaks the VF) still applies.
    move_to_vfio(&sim, P0);
    move_to_vfio(&sim, P0A);
    assert!(root(&sim, "dev/vfio/80").is_file());
    write(&root(&sim, "sys/bus/pci/drivers/nvidia/unbind"), "0000:41:00.6").unwrap();
    assert!(!dev(&sim, "0000:41:00.6", "nvidia").exists());
    assert_eq!(write(&root(&sim, "sys/bus/pci/drivers/vfio-pci/bind"), "0000:41:00.6"), Err(EINVAL));
    assert_eq!(write(&root(&sim, "sys/bus/pci/drivers/vfio-pci/unbind"), "0000:41:00.7"), Err(ENODEV));
    let st = sim.state().unwrap();
    assert_eq!(st["framework"], "vendor-vfio");
    assert_eq!(st["gpus"].as_array().unwrap().len(), 1);
    assert_eq!(st["gpus"][0]["numvfs"], 16);
    assert_eq!(vf_state(&st, "0000:41:00.6")["broken"], true);
    assert_eq!(st["passthrough"].as_array().unwrap().len(), 2);
    assert_eq!(pt_state(&st, P1)["group"], 81);
    // A PF-only command does not take a passthrough GPU.
    assert!(sim.ctl(&["disable-vfs", P0]).is_err());
}

#[test]
fn toml_passthrough_model_defaults() {
    let model = r#"
framework = "passthrough"
release_delay_ms = 0
[[gpu]]
bdf = "0001:05:00.0"
model = "NVIDIA A40"
pci_id = "10de:2235"
iommu_group = 7
boot_driver = "nouveau"
companions = [{ fn = 1, class = "0x040300" }]
group_extra = [{ bdf = "0001:04:00.0", class = "0x060400" }]
"#;
    let sim = SimMount::start(model).unwrap();
    let g = "0001:05:00.0";
    assert_eq!(read(&dev(&sim, g, "class")).unwrap(), "0x030000\n");
    assert_eq!(driver(&sim, g).as_deref(), Some("nouveau"));
    assert_eq!(driver(&sim, "0001:05:00.1"), None);
    assert_eq!(driver(&sim, "0001:04:00.0").as_deref(), Some("pcieport"));
    assert!(!root(&sim, "dev/nvidia0").exists());
    assert_eq!(
        std::fs::read_link(root(&sim, "sys/bus/pci/devices/0001:04:00.0")).unwrap().to_string_lossy(),
        "../../../devices/pci0001:04/0001:04:00.0"
    );
    // The unbound companion moves by override + probe alone.
    write(&dev(&sim, "0001:05:00.1", "driver_override"), "vfio-pci").unwrap();
    write(&root(&sim, "sys/bus/pci/drivers_probe"), "0001:05:00.1").unwrap();
    move_to_vfio(&sim, g);
    assert!(root(&sim, "dev/vfio/7").is_file());
    assert_eq!(read(&root(&sim, "sys/bus/pci/devices/0001:05:00.1/vendor")).unwrap(), "0x10de\n");
    // A bad model is refused at mount.
    let bad = "framework = \"passthrough\"\n[[gpu]]\nbdf = \"0000:82:00.0\"\niommu_group = 40\nvf_count = 2\n";
    assert!(SimMount::start(bad).is_err());
    assert_eq!(read(&root(&sim, "sys/bus/pci/devices/0000:82:00.0/vendor")), Err(ENOENT));
}
