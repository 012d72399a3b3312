//! The confined VMM (part of docs/configuration.md `qemu_sandbox`, `memory_overcommit`,
//! `vcpu_overcommit`), against the real agent, gpuvisor-sim and QEMU: QEMU runs under its
//! seccomp sandbox (`/proc/<pid>/status` shows `Seccomp: 2`) with the GPU lifecycle
//! unchanged, and an instance larger than the host can give is refused before anything is
//! written or claimed.

use gpuvisor_e2e::*;
use serde_json::json;

fn status_field(pid: i32, key: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")).map(|v| v.trim().to_string()))
}

/// A vGPU instance's QEMU runs in seccomp filter mode; stop releases its VF as before.
#[test]
fn qemu_runs_under_its_seccomp_sandbox_and_the_gpu_lifecycle_is_unchanged() {
    let a = Agent::start(HOST_V).unwrap();
    let v = a.create_gpu("s", "L40S-2Q").unwrap();
    let id = v["id"].as_str().unwrap();
    let q: Vec<LiveQemu> = a.live_qemus().into_iter().filter(|q| q.instance_id.as_deref() == Some(id)).collect();
    assert_eq!(q.len(), 1);
    assert_eq!(status_field(q[0].pid, "Seccomp").as_deref(), Some("2"), "seccomp filter mode");
    let cmd = std::fs::read_to_string(format!("/proc/{}/cmdline", q[0].pid)).unwrap().replace('\0', " ");
    assert!(cmd.contains("-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"), "{cmd}");
    let s = a.ok("instance.stop", json!({"ref": "s"}));
    assert_eq!(s["state"], "stopped", "{s}");
    assert!(a.claims().is_empty(), "the VF was released: {:?}", a.claims());
}

/// An instance with more memory than the host has (or more vCPUs than `vcpu_overcommit`
/// allows) is refused with `invalid_request` before anything is written or claimed.
#[test]
fn an_oversized_instance_is_refused_before_anything_is_claimed() {
    let a = Agent::start(HOST_V).unwrap();
    let n = a.sim_writes().len();
    let e = a
        .call("instance.create", json!({"name": "big", "image": "demo", "gpu": "L40S-2Q", "memory_mib": 1048576}))
        .unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (400, "invalid_request"), "{e}");
    assert!(e.message.contains("do not fit this host") && e.message.contains("memory_overcommit"), "{e}");
    let e = a.call("instance.create", json!({"name": "wide", "image": "demo", "vcpus": 64})).unwrap_err();
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert!(e.message.contains("vCPUs do not fit"), "{e}");
    assert!(a.claims().is_empty());
    assert!(a.instance_names().is_empty());
    assert_eq!(a.sim_writes().len(), n, "no sysfs write");
}
