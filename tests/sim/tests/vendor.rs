//! Vendor-VFIO driver rules (docs/design/host.md §10.3 rules 1–5, 11) and handle tracking (§10.4),
//! on real FUSE mounts.

mod common;

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use common::*;
use libc::{EACCES, EBUSY, EINVAL, EIO, ENODEV, ENOENT, ENXIO, EPERM};

#[test]
fn tree_shape_links_modes_and_sizes() {
    let sim = SimMount::start("l40s-2x16").unwrap();
    let r = sim.path();
    let ready = std::fs::read_link(r.join("sys/bus/pci/devices/0001:81:00.4")).unwrap();
    assert_eq!(ready.to_str().unwrap(), "../../../devices/pci0001:81/0001:81:00.4");
    let pf = r.join("sys/bus/pci/devices/0000:41:00.0");
    assert_eq!(read(&pf.join("vendor")).unwrap(), "0x10de\n");
    assert_eq!(read(&pf.join("device")).unwrap(), "0x26b9\n");
    assert_eq!(read(&pf.join("class")).unwrap(), "0x030200\n");
    assert_eq!(read(&pf.join("sriov_totalvfs")).unwrap(), "16\n");
    assert_eq!(read(&pf.join("sriov_numvfs")).unwrap(), "16\n");
    assert_eq!(std::fs::read_link(pf.join("virtfn15")).unwrap().to_str(), Some("../0000:41:02.3"));
    assert_eq!(std::fs::read_link(pf.join("driver")).unwrap().to_str(), Some("../../../bus/pci/drivers/nvidia"));
    let vf = r.join("sys/bus/pci/devices/0001:81:02.3");
    assert_eq!(std::fs::read_link(vf.join("physfn")).unwrap().to_str(), Some("../0001:81:00.0"));
    assert_eq!(std::fs::read_link(vf.join("iommu_group")).unwrap().to_str(), Some("../../../kernel/iommu_groups/76"));
    // Links resolve inside the mount.
    assert_eq!(std::fs::canonicalize(vf.join("driver")).unwrap(), r.join("sys/bus/pci/drivers/nvidia"));
    assert!(r.join("sys/kernel/iommu_groups/76/devices/0001:81:02.3/nvidia").is_dir());
    assert!(vf.join("vfio-dev/vfio31").is_dir());
    assert!(r.join("dev/vfio/devices/vfio31").is_file());
    assert!(r.join("dev/vfio/76").is_file());
    assert!(r.join("dev/vfio/vfio").is_file());
    assert_eq!(read(&r.join("sys/module/nvidia/version")).unwrap(), "580.82.07\n");
    let boot = read(&r.join("proc/sys/kernel/random/boot_id")).unwrap();
    assert_eq!(boot.trim().len(), 36);
    assert_eq!(std::fs::read_dir(r.join("sys/class/mdev_bus")).unwrap().count(), 0);
    let mode = |p: &str| vf.join(p).metadata().unwrap().mode() & 0o7777;
    assert_eq!(mode("nvidia/creatable_vgpu_types"), 0o444);
    assert_eq!(mode("nvidia/current_vgpu_type"), 0o644);
    assert_eq!(vf.join("nvidia/current_vgpu_type").metadata().unwrap().len(), 4096);
    assert_eq!(r.join("sys/bus/pci/drivers/nvidia/unbind").metadata().unwrap().mode() & 0o7777, 0o200);
    // Read-only files refuse a write open.
    assert_eq!(write(&vf.join("nvidia/creatable_vgpu_types"), "1"), Err(EACCES));
    // h200 preset addresses.
    drop(sim);
    let h = SimMount::start("h200-1x8").unwrap();
    let vf = h.path().join("sys/bus/pci/devices/0000:18:01.3");
    assert_eq!(read(&vf.join("device")).unwrap(), "0x2335\n");
    assert_eq!(std::fs::read_link(vf.join("iommu_group")).unwrap().to_str(), Some("../../../kernel/iommu_groups/28"));
    assert_eq!(catalog_ids(&h, "0000:18:01.3"), vec![1428, 1427, 1426, 1424, 1420]);
}

#[test]
fn rule1_equal_size_catalogs() {
    let sim = SimMount::start("l40s-2x16").unwrap();
    let all = vec![1147, 1148, 1150, 1152, 1153, 1154, 1156, 1159];
    assert_eq!(catalog_ids(&sim, VF0), all);
    let text = read(&vf_file(&sim, VF0, "nvidia/creatable_vgpu_types")).unwrap();
    assert!(text.starts_with("ID    : vGPU Name\n1147  : NVIDIA L40S-1Q\n1148  : NVIDIA L40S-2Q\n"));
    write(&ty(&sim, VF0), "1148\n").unwrap();
    assert_eq!(read(&ty(&sim, VF0)).unwrap(), "1148\n");
    assert_eq!(catalog_ids(&sim, VF1), vec![1148]);
    assert_eq!(
        read(&vf_file(&sim, VF1, "nvidia/creatable_vgpu_types")).unwrap(),
        "ID    : vGPU Name\n1148  : NVIDIA L40S-2Q\n"
    );
    // The holder shows only the header; GPU 1 is untouched.
    assert_eq!(catalog_ids(&sim, VF0), Vec::<u32>::new());
    assert_eq!(catalog_ids(&sim, "0001:81:00.4"), all);
    // 16 × 2Q fill GPU 0 (the VF count caps max 24).
    for vf in 1..16u32 {
        let rid = 0x4104 + vf;
        let bdf = format!("0000:41:{:02x}.{:x}", (rid >> 3) & 31, rid & 7);
        write(&ty(&sim, &bdf), "1148").unwrap();
    }
    // A 48Q on GPU 1 blocks all its siblings.
    write(&ty(&sim, "0001:81:00.4"), "1159").unwrap();
    assert_eq!(catalog_ids(&sim, "0001:81:00.5"), Vec::<u32>::new());
}

#[test]
fn rule1_max_per_gpu() {
    let sim = SimMount::start(V).unwrap();
    write(&ty(&sim, VF0), "1156").unwrap(); // 24Q, max 2
    assert_eq!(catalog_ids(&sim, VF1), vec![1156]);
    write(&ty(&sim, VF1), "1156").unwrap();
    assert_eq!(catalog_ids(&sim, VF2), Vec::<u32>::new());
    assert_eq!(write(&ty(&sim, VF2), "1156"), Err(EIO));
    write(&ty(&sim, VF0), "0").unwrap();
    write(&ty(&sim, VF1), "0").unwrap();
    assert_eq!(catalog_ids(&sim, VF2).len(), 8);
}

#[test]
fn rule2_errno_order() {
    let sim = SimMount::start(V).unwrap();
    let t0 = ty(&sim, VF0);
    assert_eq!(write(&t0, "abc"), Err(EINVAL));
    assert_eq!(write(&t0, "-1"), Err(EINVAL));
    assert_eq!(write(&t0, "0"), Err(EPERM)); // 0 while 0
    assert_eq!(write(&t0, "9999"), Err(EINVAL)); // not in the table
    write(&t0, "1148").unwrap();
    assert_eq!(write(&t0, "1148"), Err(EPERM)); // same id while set
    assert_eq!(write(&t0, "9999"), Err(EPERM)); // EPERM comes before the table check
    assert_eq!(write(&t0, "x"), Err(EINVAL)); // parse comes first of all
    assert_eq!(write(&ty(&sim, VF1), "1147"), Err(EIO)); // in the table, not creatable
                                                         // 0 while a handle is open → EBUSY.
    let f = open_rw(&sim.path().join("dev/vfio/41")).unwrap();
    assert_eq!(write(&t0, "0"), Err(EBUSY));
    write(&vf_file(&sim, VF1, "nvidia/current_vgpu_type"), "1148").unwrap();
    drop(f);
    sim.ctl(&["release-delay", VF0, "0"]).unwrap();
    // The default lag (600 ms) already started; wait it out by polling.
    assert!(poll(Duration::from_secs(3), || write(&t0, "0").is_ok()));
    assert_eq!(read(&t0).unwrap(), "0\n");
    let st = sim.state().unwrap();
    let w = writes(&st);
    let results: Vec<&str> = w.iter().map(|(_, _, r)| r.as_str()).collect();
    assert_eq!(&results[..9], &["EINVAL", "EINVAL", "EPERM", "EINVAL", "ok", "EPERM", "EPERM", "EINVAL", "EIO"]);
}

#[test]
fn rule3_params_placement_and_other_files() {
    let sim = SimMount::start(V).unwrap();
    let p = |f: &str| vf_file(&sim, VF0, &format!("nvidia/{f}"));
    assert_eq!(read(&p("placement_id")), Err(ENXIO));
    assert_eq!(read(&p("gpu_instance_id")), Err(ENXIO));
    assert_eq!(read(&p("vgpu_params")).unwrap(), "");
    assert_eq!(write(&p("vgpu_params"), "frame_rate_limiter=0"), Err(EPERM));
    assert_eq!(read(&p("warm_update")).unwrap(), "0\n");
    assert_eq!(write(&p("warm_update"), "1"), Err(EPERM));
    write(&ty(&sim, VF1), "1148").unwrap();
    write(&p("current_vgpu_type"), "1148").unwrap();
    assert_eq!(read(&vf_file(&sim, VF1, "nvidia/placement_id")).unwrap(), "0\n");
    assert_eq!(read(&p("placement_id")).unwrap(), "1\n");
    assert_eq!(read(&p("gpu_instance_id")), Err(ENXIO));
    assert_eq!(write(&p("placement_id"), "3"), Err(EPERM));
    assert_eq!(write(&p("gpu_instance_id"), "3"), Err(EPERM));
    write(&p("vgpu_params"), "frame_rate_limiter=0,disable_vnc=1\n").unwrap();
    assert_eq!(read(&p("vgpu_params")).unwrap(), "frame_rate_limiter=0,disable_vnc=1\n");
    write(&p("vgpu_params"), " ").unwrap();
    assert_eq!(read(&p("vgpu_params")).unwrap(), "");
    write(&p("vgpu_params"), "a=1").unwrap();
    {
        let _h = open_rw(&sim.path().join("dev/vfio/devices/vfio0")).unwrap();
        assert_eq!(write(&p("vgpu_params"), "a=2"), Err(EBUSY));
    }
    sim.ctl(&["release-delay", VF0, "0"]).unwrap();
    assert!(poll(Duration::from_secs(3), || write(&p("current_vgpu_type"), "0").is_ok()));
    // Clearing the type empties the params.
    assert_eq!(read(&p("vgpu_params")).unwrap(), "");
}

#[test]
fn rule4_forbidden_operations_break_the_vf() {
    let sim = SimMount::start(V).unwrap();
    let pf = sim.path().join("sys/bus/pci/devices/0000:41:00.0");
    assert_eq!(write(&pf.join("sriov_numvfs"), "0"), Err(EPERM));
    write(&vf_file(&sim, VF0, "driver_override"), "vfio-pci").unwrap();
    assert!(!vf_file(&sim, VF0, "nvidia").exists());
    assert!(!vf_file(&sim, VF0, "vfio-dev").exists());
    assert!(!sim.path().join("dev/vfio/devices/vfio0").exists());
    let unbind = sim.path().join("sys/bus/pci/drivers/nvidia/unbind");
    write(&unbind, VF1).unwrap();
    assert!(!vf_file(&sim, VF1, "nvidia").exists());
    assert!(!vf_file(&sim, VF1, "driver").exists());
    assert_eq!(write(&unbind, VF1), Err(ENODEV));
    let st = sim.state().unwrap();
    assert_eq!(vf_state(&st, VF0)["broken"], true);
    assert_eq!(vf_state(&st, VF1)["broken"], true);
    sim.ctl(&["disable-vfs", "0000:41:00.0"]).unwrap();
    sim.ctl(&["enable-vfs", "0000:41:00.0"]).unwrap();
    assert!(vf_file(&sim, VF0, "nvidia/current_vgpu_type").exists());
    assert!(vf_file(&sim, VF1, "nvidia/current_vgpu_type").exists());
}

#[test]
fn rule5_node_opens() {
    let sim = SimMount::start(V).unwrap();
    let g = sim.path().join("dev/vfio/41");
    let c = sim.path().join("dev/vfio/devices/vfio0");
    assert_eq!(open_rw(&g).err(), Some(ENODEV));
    assert_eq!(open_rw(&c).err(), Some(ENODEV));
    let _container = open_rw(&sim.path().join("dev/vfio/vfio")).unwrap();
    write(&ty(&sim, VF0), "1148").unwrap();
    let a = open_rw(&g).unwrap();
    assert_eq!(open_rw(&g).err(), Some(EBUSY));
    let c1 = open_rw(&c).unwrap();
    let c2 = open_rw(&c).unwrap();
    let st = sim.state().unwrap();
    let opens: Vec<&str> = st["log"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["op"] == "open")
        .map(|e| e["result"].as_str().unwrap())
        .collect();
    assert_eq!(opens, vec!["ENODEV", "ENODEV", "ok", "ok", "EBUSY", "ok", "ok"]);
    assert_eq!(vf_state(&st, VF0)["handles"].as_array().unwrap().len(), 3);
    drop((a, c1, c2));
    // The group can be opened again once released.
    let _again = open_rw(&g).unwrap();
}

#[test]
fn handles_real_pids_and_release_delay() {
    let sim = SimMount::start(V).unwrap();
    write(&ty(&sim, VF0), "1148").unwrap();
    let node = sim.path().join("dev/vfio/41");
    let holder = Holder::spawn(&node);
    // The holder's fd names the node in /proc, as the agent's scan expects.
    let link = std::fs::read_link(format!("/proc/{}/fd/3", holder.pid())).unwrap();
    assert_eq!(link, node);
    let st = sim.state().unwrap();
    let h = &vf_state(&st, VF0)["handles"][0];
    assert_eq!(h["pid"], holder.pid());
    assert_eq!(h["node"], "dev/vfio/41");
    assert_eq!(write(&ty(&sim, VF0), "0"), Err(EBUSY));
    sim.ctl(&["release-delay", VF0, "800"]).unwrap();
    holder.kill();
    let closed = Instant::now();
    // The release arrives asynchronously after the kill; until the lag ends, EBUSY.
    assert_eq!(write(&ty(&sim, VF0), "0"), Err(EBUSY));
    assert!(poll(Duration::from_secs(5), || write(&ty(&sim, VF0), "0").is_ok()));
    let took = closed.elapsed();
    assert!(took >= Duration::from_millis(700), "cleared after {took:?}");
    let st = sim.state().unwrap();
    assert!(vf_state(&st, VF0)["handles"].as_array().unwrap().is_empty());
}

#[test]
fn flush_does_not_release() {
    let sim = SimMount::start(V).unwrap();
    write(&ty(&sim, VF0), "1148").unwrap();
    sim.ctl(&["release-delay", VF0, "0"]).unwrap();
    let f = open_rw(&sim.path().join("dev/vfio/41")).unwrap();
    // A dup'd fd closed → flush, not release: the handle stays.
    let dup = f.try_clone().unwrap();
    drop(dup);
    assert_eq!(write(&ty(&sim, VF0), "0"), Err(EBUSY));
    drop(f);
    assert!(poll(Duration::from_secs(3), || write(&ty(&sim, VF0), "0").is_ok()));
}

#[test]
fn rule11_missing_paths_and_vanished_fds() {
    let sim = SimMount::start(V).unwrap();
    assert_eq!(read(&vf_file(&sim, "0000:41:01.0", "vendor")), Err(ENOENT));
    assert_eq!(write(&vf_file(&sim, VF0, "reset"), "1"), Err(ENOENT));
    let mut f = open_rw(&ty(&sim, VF0)).unwrap();
    sim.ctl(&["disable-vfs", "0000:41:00.0"]).unwrap();
    assert_eq!(read(&ty(&sim, VF0)), Err(ENOENT));
    use std::io::Read;
    let mut s = String::new();
    assert_eq!(f.read_to_string(&mut s).unwrap_err().raw_os_error(), Some(ENODEV));
    // Even after the VF comes back, the old fd stays dead.
    sim.ctl(&["enable-vfs", "0000:41:00.0"]).unwrap();
    assert_eq!(f.read_to_string(&mut s).unwrap_err().raw_os_error(), Some(ENODEV));
    assert_eq!(read(&ty(&sim, VF0)).unwrap(), "0\n");
}
