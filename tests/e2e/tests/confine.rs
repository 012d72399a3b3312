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

fn vmm_ids() -> (u32, u32) {
    let out = std::process::Command::new("id").args(["-u", VMM_USER]).output().unwrap();
    let uid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("the VMM user exists (scripts/setup)");
    let out = std::process::Command::new("id").args(["-g", VMM_USER]).output().unwrap();
    (uid, String::from_utf8_lossy(&out.stdout).trim().parse().unwrap())
}

const VMM_USER: &str = "gpuvisor-vmm";

/// Runs `argv` as the VMM's user (util-linux `setpriv`); its exit status.
fn as_vmm_user(argv: &[&str]) -> std::process::ExitStatus {
    let (uid, gid) = vmm_ids();
    std::process::Command::new("setpriv")
        .args([format!("--reuid={uid}"), format!("--regid={gid}"), "--clear-groups".into()])
        .args(argv)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
}

/// QEMU runs as the unprivileged `gpuvisor-vmm` (every uid and gid), holds no capability,
/// has `no_new_privs`, and boots its guest; the instance directory lets it create its
/// sockets but never remove or replace the agent's records; the files it writes are root's.
#[test]
fn qemu_runs_as_the_vmm_user_without_capabilities_and_cannot_touch_the_records() {
    use std::os::unix::fs::MetadataExt;
    let (uid, gid) = vmm_ids();
    let a = Agent::start(HOST_V).unwrap();
    let v = a.create_gpu("u", "L40S-2Q").unwrap();
    let id = v["id"].as_str().unwrap().to_string();
    a.wait_serial(&v, "gpuvisor-guest: ready", std::time::Duration::from_secs(120)).unwrap();
    let q: Vec<LiveQemu> = a.live_qemus().into_iter().filter(|q| q.instance_id.as_deref() == Some(&id)).collect();
    assert_eq!(q.len(), 1);
    let pid = q[0].pid;
    assert_eq!(status_field(pid, "Uid"), Some(format!("{uid}\t{uid}\t{uid}\t{uid}")));
    assert_eq!(status_field(pid, "Gid"), Some(format!("{gid}\t{gid}\t{gid}\t{gid}")));
    for cap in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
        assert_eq!(status_field(pid, cap).as_deref(), Some("0000000000000000"), "{cap}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs").as_deref(), Some("1"));

    let dir = a.data_dir.join("instances").join(&id);
    let d = std::fs::metadata(&dir).unwrap();
    assert_eq!((d.uid(), d.gid(), d.mode() & 0o7777), (0, gid, 0o1770), "sticky, the VMM's group");
    let log = std::fs::metadata(dir.join("serial.log")).unwrap();
    assert_eq!((log.uid(), log.gid(), log.mode() & 0o7777), (0, gid, 0o660));
    let qmp = std::fs::symlink_metadata(dir.join("qmp.sock")).unwrap();
    assert_eq!(qmp.uid(), uid, "QEMU created its socket as its user");
    let record = dir.join("instance.json");
    let record_path = record.to_str().unwrap();
    assert!(!as_vmm_user(&["rm", "-f", record_path]).success(), "the VMM's user cannot remove a record");
    assert!(!as_vmm_user(&["mv", record_path, &format!("{record_path}.x")]).success());
    assert!(!as_vmm_user(&["sh", "-c", &format!("echo x >{record_path}")]).success(), "nor write one");
    assert!(record.is_file());

    let s = a.ok("instance.stop", json!({"ref": "u"}));
    assert_eq!(s["state"], "stopped", "{s}");
    assert!(a.claims().is_empty());
}

/// An agent whose `vmm_user` does not exist refuses to start and says how to create it.
#[test]
fn an_agent_whose_vmm_user_does_not_exist_refuses_to_start() {
    let dir = vmm_reachable_tempdir("gpuvisor-confine.").unwrap();
    let cfg = dir.path().join("gpuvisor.toml");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = {:?}\nsocket = {:?}\nvmm_user = \"gpuvisor-no-such-user\"\n",
            dir.path().join("data"),
            dir.path().join("s.sock")
        ),
    )
    .unwrap();
    let (status, out) = serve_expecting_exit(&cfg, std::time::Duration::from_secs(60)).unwrap();
    assert!(!status.success());
    assert!(out.contains("vmm_user \"gpuvisor-no-such-user\" does not exist") && out.contains("useradd"), "{out}");
    assert!(!dir.path().join("data").exists(), "nothing was created");
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
