//! `gpuvisor host check` (issue 12 item 4): the verdicts on each simulator preset, on a
//! host without GPUs and on this machine; that it never writes (the simulator logs every
//! write and device-node open); and the same report over JSON-RPC (`host.check`).

use gpuvisor_e2e::*;
use gpuvisor_sim::SimMount;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

/// Runs `gpuvisor host check -o json` with `args`; answers (exit code, report).
fn host_check(args: &[&str]) -> (i32, Value) {
    let out = Command::new(agent_binary()).args(["host", "check", "-o", "json"]).args(args).output().unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out:?}"));
    (out.status.code().unwrap_or(-1), report)
}

/// The check named `name`: (verdict, detail).
fn line(report: &Value, name: &str) -> (String, String) {
    let c = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == name)
        .unwrap_or_else(|| panic!("no check {name:?} in {report:#}"));
    (c["verdict"].as_str().unwrap().to_string(), c["detail"].as_str().unwrap().to_string())
}

fn names(report: &Value) -> Vec<String> {
    report["checks"].as_array().unwrap().iter().map(|c| c["check"].as_str().unwrap().to_string()).collect()
}

/// Runs the check against `sim` (with `config` TOML, if any) and proves it wrote and opened
/// nothing there.
fn check_sim(sim: &SimMount, config: Option<&str>) -> (i32, Value) {
    let dir = tempfile::tempdir().unwrap();
    let root = sim.path().to_str().unwrap().to_string();
    let before = last_seq(&sim.state().unwrap());
    let (code, report) = match config {
        Some(c) => {
            let p = dir.path().join("gpuvisor.toml");
            std::fs::write(&p, format!("host_root = {root:?}\n{c}")).unwrap();
            host_check(&["--config", p.to_str().unwrap()])
        }
        None => host_check(&["--host-root", &root]),
    };
    let after = log_after(&sim.state().unwrap(), before);
    assert!(after.is_empty(), "host check wrote to or opened simulated host files: {after:#?}");
    (code, report)
}

#[test]
fn vendor_vfio_presets_count_vfs_and_list_types() {
    let sim = SimMount::start("l40s-2x16").unwrap();
    let (code, r) = check_sim(&sim, None);
    assert_eq!(line(&r, "iommu").0, "ok");
    assert_eq!(line(&r, "vgpu-framework").0, "ok");
    assert!(line(&r, "vgpu-framework").1.contains("vendor-specific VFIO"));
    let (v, d) = line(&r, "nvidia-driver");
    assert_eq!(v, "ok", "{d}");
    assert!(d.contains("580.82.07"), "{d}");
    assert_eq!(line(&r, "vgpu-manager").0, "ok");
    assert_eq!(line(&r, "vfio-pci").0, "skip", "no passthrough GPUs configured: vfio-pci is not needed");
    for pf in ["0000:41:00.0", "0001:81:00.0"] {
        let (v, d) = line(&r, &format!("gpu {pf}"));
        assert_eq!(v, "ok", "{d}");
        assert!(d.contains("16 of 16 SR-IOV VFs enabled") && d.contains("16 vGPU devices, 16 free"), "{d}");
        assert!(d.contains("L40S-1Q, L40S-2Q, L40S-4Q") && d.contains("L40S-48Q"), "{d}");
    }
    // The verdicts that depend on this machine, not the preset, are reported too.
    for n in ["kvm", "qemu", "cloud-hypervisor", "pid-namespace", "proc", "vmm-ids", "cgroup"] {
        assert!(names(&r).contains(&n.to_string()), "{n} missing: {r:#}");
    }
    // The default vmm_ids range is free on this machine and reserved by scripts/setup.
    let (v, d) = line(&r, "vmm-ids");
    assert_eq!(v, "ok", "{d}");
    assert!(d.contains("1879048192…1879113727") && d.contains("reserved for gpuvisor-vmm"), "{d}");
    let failed = r["checks"].as_array().unwrap().iter().any(|c| c["verdict"] == "fail");
    assert_eq!(code, if failed { 1 } else { 0 }, "exit code follows the verdicts: {r:#}");
    assert_eq!(r["failed"], failed);

    // One 2Q on GPU 0 (a foreign tool's write): that GPU now offers only 2Q, on 15 free VFs.
    sim.ctl(&["set-type", "0000:41:00.4", "1148"]).unwrap();
    let (_, r) = check_sim(&sim, None);
    let (v, d) = line(&r, "gpu 0000:41:00.0");
    assert_eq!(v, "ok");
    assert!(d.contains("16 vGPU devices, 15 free; creatable now: L40S-2Q"), "{d}");

    let sim = SimMount::start("h200-1x8").unwrap();
    let (_, r) = check_sim(&sim, None);
    let (v, d) = line(&r, "gpu 0000:18:00.0");
    assert_eq!(v, "ok", "{d}");
    assert!(d.contains("NVIDIA H200: 8 of 8 SR-IOV VFs enabled") && d.contains("H200X-141C"), "{d}");
}

#[test]
fn the_mdev_preset_lists_its_types() {
    let sim = SimMount::start("l40s-mdev").unwrap();
    let (_, r) = check_sim(&sim, None);
    let (v, d) = line(&r, "vgpu-framework");
    assert_eq!(v, "ok");
    assert!(d.starts_with("mdev"), "{d}");
    let (v, d) = line(&r, "gpu 0000:41:00.0");
    assert_eq!(v, "ok", "{d}");
    assert!(d.contains("16 vGPU devices, 16 free") && d.contains("L40S-2Q"), "{d}");
}

#[test]
fn vfs_not_enabled_is_a_warning_naming_sriov_manage() {
    let model = "vfs_at_boot = false\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
    let sim = SimMount::start(model).unwrap();
    let (_, r) = check_sim(&sim, None);
    let (v, d) = line(&r, "vgpu-framework");
    assert_eq!(v, "warn", "{d}");
    let (v, d) = line(&r, "gpu 0000:41:00.0");
    assert_eq!(v, "warn", "{d}");
    assert!(d.contains("sriov_numvfs 0 of 4") && d.contains("sriov-manage -e 0000:41:00.0"), "{d}");
    sim.ctl(&["enable-vfs", "0000:41:00.0", "--delay", "0"]).unwrap();
    let (_, r) = check_sim(&sim, None);
    assert_eq!(line(&r, "gpu 0000:41:00.0").0, "ok", "{r:#}");
}

#[test]
fn passthrough_gpus_show_their_groups() {
    // l40s-pt: one vGPU L40S and two whole GPUs, as configured.
    let sim = SimMount::start("l40s-pt").unwrap();
    let (_, r) = check_sim(&sim, Some("passthrough_gpus = [\"0000:82:00.0\", \"0000:83:00.0\"]\n"));
    assert_eq!(line(&r, "vfio-pci").0, "ok");
    assert_eq!(line(&r, "gpu 0000:41:00.0").0, "ok");
    for (bdf, group) in [("0000:82:00.0", 80), ("0000:83:00.0", 81)] {
        let (v, d) = line(&r, &format!("passthrough {bdf}"));
        assert_eq!(v, "ok", "{d}");
        assert!(d.starts_with(&format!("IOMMU group {group}: {bdf} (nvidia)")), "{d}");
        assert!(!names(&r).contains(&format!("gpu {bdf}")), "a whole GPU is not a vGPU parent: {r:#}");
    }

    // pt-2: a group with a bridge (stays) is fine; one with a NIC cannot be handed out; a
    // GPU that is not there fails; the exit code is 1.
    let sim = SimMount::start("pt-2").unwrap();
    let cfg = "passthrough_gpus = [\"0000:82:00.0\", \"0000:84:00.0\", \"0000:99:00.0\"]\n";
    let (code, r) = check_sim(&sim, Some(cfg));
    assert_eq!(code, 1, "{r:#}");
    let (v, d) = line(&r, "passthrough 0000:82:00.0");
    assert_eq!(v, "ok", "{d}");
    assert!(d.contains("0000:82:00.1 (snd_hda_intel)") && d.contains("bridges (stay): 0000:80:01.0"), "{d}");
    let (v, d) = line(&r, "passthrough 0000:84:00.0");
    assert_eq!(v, "fail", "{d}");
    assert!(d.contains("0000:85:00.0"), "{d}");
    assert_eq!(line(&r, "passthrough 0000:99:00.0").0, "fail");
    assert_eq!(line(&r, "vgpu-framework").0, "skip", "whole GPUs only: {r:#}");
}

#[test]
fn a_host_without_gpus_says_so() {
    let empty = tempfile::tempdir().unwrap();
    let (code, r) = host_check(&["--host-root", empty.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(line(&r, "iommu").0, "fail");
    let (v, d) = line(&r, "vgpu-framework");
    assert_eq!(v, "warn");
    assert!(d.contains("no NVIDIA GPU"), "{d}");
    assert_eq!(line(&r, "nvidia-driver").0, "warn");
    assert!(!names(&r).iter().any(|n| n.starts_with("gpu ")), "{r:#}");
    // managed_gpus naming a GPU that is not there fails.
    let cfg = empty.path().join("c.toml");
    std::fs::write(&cfg, format!("host_root = {:?}\nmanaged_gpus = [\"0000:41:00.0\"]\n", empty.path())).unwrap();
    let (_, r) = host_check(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(line(&r, "gpu 0000:41:00.0").0, "fail", "{r:#}");
}

#[test]
fn this_machine_has_no_nvidia_gpu_but_kvm_and_qemu() {
    let (code, r) = host_check(&["--host-root", "/"]);
    assert_eq!(r["host_root"], "/");
    assert!(!names(&r).iter().any(|n| n.starts_with("gpu ")), "{r:#}");
    assert_eq!(line(&r, "vgpu-framework").0, "warn", "{r:#}");
    if Path::new("/dev/kvm").exists() {
        let (v, d) = line(&r, "kvm");
        assert_eq!(v, "ok", "{d}");
        assert!(d.contains("KVM API version 12"), "{d}");
    }
    let (v, d) = line(&r, "qemu");
    assert_eq!(v, "ok", "{d}");
    assert!(d.contains("QEMU emulator version"), "{d}");
    assert!(line(&r, "cgroup").1.contains("/sys/fs/cgroup"));
    assert_eq!(code, if r["failed"] == true { 1 } else { 0 });
    // The table form: one line per check with its verdict first.
    let out = Command::new(agent_binary()).args(["host", "check", "--host-root", "/"]).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(code));
    for n in names(&r) {
        assert!(
            text.lines().any(|l| {
                let mut w = l.split_whitespace();
                matches!(w.next(), Some("ok" | "warn" | "fail" | "skip")) && l.contains(&format!(" {n} "))
            }),
            "{n}:\n{text}"
        );
    }
}

#[test]
fn host_check_over_json_rpc_is_the_same_report() {
    let a = Agent::start("l40s-2x16").unwrap();
    let before = last_seq(&a.state());
    let r = a.ok("host.check", json!({}));
    assert_eq!(line(&r, "gpu 0000:41:00.0").0, "ok", "{r:#}");
    assert_eq!(line(&r, "vgpu-framework").0, "ok");
    // The agent runs in its own PID namespace in the tests: the check says so.
    assert_eq!(line(&r, "pid-namespace").0, "warn", "{r:#}");
    let after: Vec<Value> = log_after(&a.state(), before);
    assert!(after.is_empty(), "host.check wrote to or opened simulated host files: {after:#?}");
}

/// Issue 18 finding 9: `host check` with a working Cloud Hypervisor configured (the real
/// binary) answers — no "Cannot start a runtime from within a runtime" panic — with the
/// probe's version, and leaves no `cloud-hypervisor` process behind (it runs in a PID
/// namespace of its own here, so whatever it left is found there).
#[test]
fn host_check_probes_a_real_cloud_hypervisor_without_panicking_or_leaving_it_running() {
    let Some(ch) = real_cloud_hypervisor() else { return };
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("gpuvisor.toml");
    std::fs::write(&cfg, format!("cloud_hypervisor_binary = {ch:?}\n")).unwrap();
    let ns = PidNs::new().unwrap();
    let out = ns.command(agent_binary()).args(["host", "check", "-o", "json", "--config"]).arg(&cfg).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "BUG: host check panicked: {stderr}");
    assert!(matches!(out.status.code(), Some(0 | 1)), "{out:?}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out:?}"));
    let (v, d) = line(&r, "cloud-hypervisor");
    assert_eq!(v, "ok", "{d}");
    assert!(d.contains("cloud-hypervisor 53."), "{d}");
    let ns_link = std::fs::read_link(format!("/proc/{}/ns/pid", ns.init_pid)).unwrap();
    let left = pids_where(|c| c.contains("cloud-hypervisor") && c.contains("--api-socket"))
        .into_iter()
        .filter(|p| std::fs::read_link(format!("/proc/{p}/ns/pid")).ok().as_ref() == Some(&ns_link))
        .collect::<Vec<_>>();
    assert!(left.is_empty(), "BUG: the probe's cloud-hypervisor still runs: {left:?}");
}
