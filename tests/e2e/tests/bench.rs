//! Benchmarks (run with `scripts/bench`; `#[ignore]`d in the normal suite): timings are
//! printed as ratios, never asserted — these machines are shared and noisy.
//!
//! - create → guest ready through the agent (vGPU claimed, configured, QEMU spawned with
//!   hold-fd) vs a bare QEMU launch of the same image and command line shape;
//! - one reconcile pass over many instance and claim records.

use gpuvisor_e2e::*;
use serde_json::json;
use std::process::Command;
use std::time::{Duration, Instant};

const RUNS: usize = 3;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn bare_qemu_to_ready(image: &std::path::Path) -> Duration {
    let dir = tempfile::tempdir().unwrap();
    let serial = dir.path().join("serial.log");
    let cmdline = std::fs::read_to_string(image.join("cmdline")).unwrap();
    let t0 = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-machine", "q35,accel=tcg", "-cpu", "max", "-m", "256", "-smp", "1", "-nodefaults", "-no-user-config"])
        .args(["-display", "none", "-uuid", &uuid_like(), "-name", "bare"])
        .arg("-kernel")
        .arg(image.join("vmlinuz"))
        .arg("-initrd")
        .arg(image.join("initrd.img"))
        .args(["-append", cmdline.trim()])
        .arg("-serial")
        .arg(format!("file:{}", serial.display()))
        .spawn()
        .unwrap();
    wait_for(Duration::from_secs(120), || {
        std::fs::read_to_string(&serial).ok().filter(|t| t.contains("gpuvisor-guest: ready")).map(|_| ())
    })
    .expect("bare guest ready");
    let d = t0.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    d
}

fn uuid_like() -> String {
    "6f1c2e3a-0000-4000-8000-000000000001".into()
}

#[test]
#[ignore]
fn bench_create_to_ready_vs_bare_qemu() {
    let image = demo_image();
    let a = Agent::start("l40s-2x16").unwrap();
    let mut agent_t = Vec::new();
    let mut bare_t = Vec::new();
    for i in 0..RUNS {
        bare_t.push(bare_qemu_to_ready(&image));
        let t0 = Instant::now();
        let inst = a.create_gpu(&format!("bench-{i}"), "L40S-2Q").unwrap();
        a.wait_serial(&inst, "gpuvisor-guest: ready", Duration::from_secs(120)).unwrap();
        agent_t.push(t0.elapsed());
        a.ok("instance.delete", json!({"ref": inst["id"]}));
    }
    let (ag, bare) = (median(agent_t.clone()), median(bare_t.clone()));
    println!("bench create->ready: agent median {ag:?} {agent_t:?}; bare QEMU median {bare:?} {bare_t:?}");
    println!("bench create->ready ratio agent/bare = {:.3} (target <= 1.10)", ag.as_secs_f64() / bare.as_secs_f64());
}

#[test]
#[ignore]
fn bench_reconcile_pass_over_many_records() {
    let a = Agent::start("l40s-2x16").unwrap();
    // Plain stopped instances written straight into the store (as a long-lived host has).
    let n = 2000;
    for i in 0..n {
        let id = format!("00000000-0000-4000-8000-{i:012}");
        let dir = a.data_dir.join("instances").join(&id);
        std::fs::create_dir_all(&dir).unwrap();
        let rec = json!({"id": id, "name": format!("r{i}"), "image": "demo", "hypervisor": "qemu", "vcpus": 1,
            "memory_mib": 256, "labels": {}, "gpu_profile": null, "gpu_framework": null, "state": "stopped",
            "vmm": null, "created_at": "2026-01-01T00:00:00Z", "last_error": null});
        std::fs::write(dir.join("instance.json"), rec.to_string()).unwrap();
    }
    let mut times = Vec::new();
    for _ in 0..RUNS {
        let t0 = Instant::now();
        let r = a.ok("reconcile.run", json!({}));
        times.push(t0.elapsed());
        assert_eq!(r["inventory_complete"], true);
    }
    println!(
        "bench reconcile pass over {n} instance records: median {:?} {times:?} (target well under 1 s at 10k)",
        median(times.clone())
    );
}
