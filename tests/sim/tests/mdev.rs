//! mdev framework rules (docs/design/host.md §10.3 rules 6–8) and the `create-mdev` command.

mod common;

use std::time::Duration;

use common::*;
use libc::{EBUSY, EEXIST, EINVAL, ENOENT, EUSERS};

const U1: &str = "8a3c5e1e-4b8e-4a54-9f3e-3b0b8c9d2a11";
const U2: &str = "0f4b1c2d-1111-4a54-9f3e-3b0b8c9d2a12";
const U3: &str = "5d6e7f80-2222-4a54-9f3e-3b0b8c9d2a13";

fn types_dir(sim: &SimMount, vf: &str, id: u32) -> std::path::PathBuf {
    sim.path().join(format!("sys/class/mdev_bus/{vf}/mdev_supported_types/nvidia-{id}"))
}

#[test]
fn rule6_parents() {
    let sim = SimMount::start("l40s-mdev").unwrap();
    let r = sim.path();
    assert_eq!(std::fs::read_dir(r.join("sys/class/mdev_bus")).unwrap().count(), 32);
    assert!(!vf_file(&sim, VF0, "nvidia").exists());
    assert!(!vf_file(&sim, VF0, "vfio-dev").exists());
    assert!(!r.join("dev/vfio/41").exists());
    let t = types_dir(&sim, VF0, 1147);
    assert_eq!(read(&t.join("name")).unwrap(), "NVIDIA L40S-1Q\n");
    let d = read(&t.join("description")).unwrap();
    assert!(d.contains("framebuffer=1024M") && d.contains("max_instance=32"), "{d}");
    assert_eq!(read(&t.join("device_api")).unwrap(), "vfio-pci\n");
    assert_eq!(read(&t.join("available_instances")).unwrap(), "1\n");
    assert_eq!(std::fs::read_dir(types_dir(&sim, VF0, 1147).parent().unwrap()).unwrap().count(), 8);
}

#[test]
fn rule7_create_errors_and_result() {
    let sim = SimMount::start(M).unwrap();
    let create = types_dir(&sim, VF0, 1148).join("create");
    assert_eq!(write(&create, "not-a-uuid"), Err(EINVAL));
    write(&create, U1).unwrap();
    let dev = sim.path().join(format!("sys/bus/mdev/devices/{U1}"));
    let mt = std::fs::read_link(dev.join("mdev_type")).unwrap();
    assert_eq!(mt.file_name().unwrap(), "nvidia-1148");
    assert!(mt.to_str().unwrap().contains(&format!("{VF0}/mdev_supported_types")));
    assert_eq!(
        std::fs::canonicalize(dev.join("mdev_type")).unwrap(),
        types_dir(&sim, VF0, 1148).canonicalize().unwrap()
    );
    assert_eq!(std::fs::read_link(dev.join("iommu_group")).unwrap().file_name().unwrap(), "300");
    assert!(sim.path().join("dev/vfio/300").is_file());
    assert!(types_dir(&sim, VF0, 1148).join(format!("devices/{U1}")).exists());
    assert_eq!(read(&dev.join("nvidia/vgpu_params")).unwrap(), "");
    // The same UUID again → EEXIST; the parent is used → EUSERS; a size clash → EUSERS.
    assert_eq!(write(&types_dir(&sim, VF1, 1148).join("create"), U1), Err(EEXIST));
    assert_eq!(write(&types_dir(&sim, VF0, 1148).join("create"), U2), Err(EUSERS));
    assert_eq!(read(&types_dir(&sim, VF1, 1147).join("available_instances")).unwrap(), "0\n");
    assert_eq!(write(&types_dir(&sim, VF1, 1147).join("create"), U2), Err(EUSERS));
    write(&types_dir(&sim, VF1, 1148).join("create"), U2).unwrap();
    assert!(sim.path().join("dev/vfio/301").is_file());
    let st = sim.state().unwrap();
    let m = &st["mdevs"][0];
    assert_eq!(m["uuid"], U1);
    assert_eq!(m["parent"], VF0);
    assert_eq!(m["type"], 1148);
    assert_eq!(m["group"], 300);
    assert_eq!(m["foreign"], false);
}

#[test]
fn rule8_remove() {
    let sim = SimMount::start(M).unwrap();
    write(&types_dir(&sim, VF0, 1148).join("create"), U1).unwrap();
    let dev = sim.path().join(format!("sys/bus/mdev/devices/{U1}"));
    assert_eq!(write(&dev.join("remove"), "0"), Err(EINVAL));
    let holder = Holder::spawn(&sim.path().join("dev/vfio/300"));
    assert_eq!(open_rw(&sim.path().join("dev/vfio/300")).err(), Some(EBUSY));
    let st = sim.state().unwrap();
    assert_eq!(st["mdevs"][0]["handles"][0]["pid"], holder.pid());
    assert_eq!(write(&dev.join("nvidia/vgpu_params"), "a=1"), Err(EBUSY));
    assert_eq!(write(&dev.join("remove"), "1"), Err(EBUSY));
    holder.kill();
    // Release delay (600 ms): EBUSY right after close, then success.
    assert_eq!(write(&dev.join("remove"), "1"), Err(EBUSY));
    assert!(poll(Duration::from_secs(3), || write(&dev.join("remove"), "1").is_ok()));
    assert!(!dev.exists());
    assert!(!sim.path().join("dev/vfio/300").exists());
    assert_eq!(read(&types_dir(&sim, VF0, 1148).join("available_instances")).unwrap(), "1\n");
    assert_eq!(write(&dev.join("remove"), "1"), Err(ENOENT));
}

#[test]
fn mdev_self_remove() {
    let model = M.replace("release_delay_ms = 600", "release_delay_ms = 0\nmdev_self_remove = true");
    let sim = SimMount::start(&model).unwrap();
    write(&types_dir(&sim, VF0, 1148).join("create"), U1).unwrap();
    let dev = sim.path().join(format!("sys/bus/mdev/devices/{U1}"));
    drop(open_rw(&sim.path().join("dev/vfio/300")).unwrap());
    assert!(dev.exists());
    assert!(poll(Duration::from_secs(5), || !dev.exists()));
}

#[test]
fn create_mdev_ctl_is_foreign() {
    let sim = SimMount::start(M).unwrap();
    sim.ctl(&["create-mdev", VF2, "nvidia-1159", U3]).unwrap();
    let dev = sim.path().join(format!("sys/bus/mdev/devices/{U3}"));
    assert!(dev.join("remove").exists());
    assert!(sim.ctl(&["create-mdev", VF1, "1148", U3]).is_err());
    let st = sim.state().unwrap();
    assert_eq!(st["mdevs"][0]["foreign"], true);
    assert_eq!(st["mdevs"][0]["name"], "NVIDIA L40S-48Q");
    // A 48Q blocks every sibling.
    assert_eq!(read(&types_dir(&sim, VF0, 1159).join("available_instances")).unwrap(), "0\n");
    // disable-vfs drops the mdevs.
    sim.ctl(&["disable-vfs", "0000:41:00.0"]).unwrap();
    assert!(!dev.exists());
    assert!(sim.state().unwrap()["mdevs"].as_array().unwrap().is_empty());
}
