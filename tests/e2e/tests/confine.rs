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

/// Runs `argv` as uid/gid `id` (util-linux `setpriv`), in the host's view; its exit status.
fn as_id(id: u64, argv: &[&str]) -> std::process::ExitStatus {
    std::process::Command::new("setpriv")
        .args([format!("--reuid={id}"), format!("--regid={id}"), "--clear-groups".into()])
        .args(argv)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
}

/// QEMU runs under its instance's own id (every uid and gid the record's `vmm_id`), holds
/// no capability, has `no_new_privs`, and boots its guest; the instance directory is the
/// agent's alone; the VMM directory lets it create its sockets but never remove or replace
/// the agent's files; the files it writes are root's.
#[test]
fn qemu_runs_under_its_own_id_without_capabilities_and_cannot_touch_the_records() {
    use std::os::unix::fs::MetadataExt;
    let a = Agent::start(HOST_V).unwrap();
    let v = a.create_gpu("u", "L40S-2Q").unwrap();
    let id = v["id"].as_str().unwrap().to_string();
    let vmm_id = v["vmm_id"].as_u64().expect("the view names the VMM id");
    assert_eq!(a.record(&id)["vmm_id"].as_u64(), Some(vmm_id), "recorded with the instance");
    let idrec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(a.data_dir.join(format!("vmm-ids/{vmm_id}.json"))).expect("the id's own record"),
    )
    .unwrap();
    assert_eq!(idrec["instance_id"], id.as_str());
    a.wait_serial(&v, "gpuvisor-guest: ready", std::time::Duration::from_secs(120)).unwrap();
    let q: Vec<LiveQemu> = a.live_qemus().into_iter().filter(|q| q.instance_id.as_deref() == Some(&id)).collect();
    assert_eq!(q.len(), 1);
    let pid = q[0].pid;
    let want = vmm_id.to_string();
    assert_eq!(status_field(pid, "Uid"), Some([want.as_str(); 4].join("\t")));
    assert_eq!(status_field(pid, "Gid"), Some([want.as_str(); 4].join("\t")));
    for cap in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
        assert_eq!(status_field(pid, cap).as_deref(), Some("0000000000000000"), "{cap}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs").as_deref(), Some("1"));

    let dir = a.data_dir.join("instances").join(&id);
    let d = std::fs::metadata(&dir).unwrap();
    assert_eq!((d.uid(), d.gid(), d.mode() & 0o7777), (0, 0, 0o700), "the agent's alone");
    let vd = std::fs::metadata(dir.join("vmm")).unwrap();
    assert_eq!((vd.uid(), u64::from(vd.gid()), vd.mode() & 0o7777), (0, vmm_id, 0o1770), "sticky, the VMM's group");
    let log = std::fs::metadata(dir.join("vmm/serial.log")).unwrap();
    assert_eq!((log.uid(), u64::from(log.gid()), log.mode() & 0o7777), (0, vmm_id, 0o660));
    let qmp = std::fs::symlink_metadata(dir.join("vmm/qmp.sock")).unwrap();
    assert_eq!(u64::from(qmp.uid()), vmm_id, "QEMU created its socket as its own uid");
    let record = dir.join("instance.json");
    let record_path = record.to_str().unwrap();
    assert!(!as_id(vmm_id, &["rm", "-f", record_path]).success(), "the VMM's uid cannot remove a record");
    assert!(!as_id(vmm_id, &["mv", record_path, &format!("{record_path}.x")]).success());
    assert!(!as_id(vmm_id, &["sh", "-c", &format!("echo x >{record_path}")]).success(), "nor write one");
    let log_path = dir.join("vmm/serial.log");
    assert!(!as_id(vmm_id, &["rm", "-f", log_path.to_str().unwrap()]).success(), "nor remove the agent's files");
    assert!(record.is_file() && log_path.is_file());

    let s = a.ok("instance.stop", json!({"ref": "u"}));
    assert_eq!(s["state"], "stopped", "{s}");
    assert!(a.claims().is_empty());
}

/// An instance keeps its VMM id across stops and starts; another instance gets another;
/// when the range is used up a create says so; delete frees an id (its record goes last),
/// and a freed id is not handed out again while a process still runs under it (a zombie
/// does not count: it can do nothing).
#[test]
fn a_vmm_id_is_the_instances_for_its_life_and_never_reused_while_a_process_holds_it() {
    // Two ids of the reserved range (apart from other test agents'), so that reuse is forced.
    let first = 1_879_048_192 + 60_000 + 2 * (std::process::id() % 2_000);
    let ids = format!("{{ first = {first}, count = 2 }}");
    let a =
        Agent::start_tuned(AgentOptions { model: HOST_V, ..Default::default() }, None, &[("vmm_ids", &ids)]).unwrap();
    let v1 = a.ok("instance.create", json!({"name": "one", "image": "demo"}));
    let v2 = a.ok("instance.create", json!({"name": "two", "image": "demo"}));
    let (id1, id2) = (v1["vmm_id"].as_u64().unwrap(), v2["vmm_id"].as_u64().unwrap());
    assert_ne!(id1, id2);
    assert!([id1, id2].iter().all(|i| (u64::from(first)..u64::from(first) + 2).contains(i)));
    a.ok("instance.stop", json!({"ref": "one", "force": true}));
    let again = a.ok("instance.start", json!({"ref": "one"}));
    assert_eq!(again["vmm_id"].as_u64(), Some(id1), "kept across a restart");
    let e = a.err("instance.create", json!({"name": "three", "image": "demo"}));
    assert_eq!(e.data_code, "vmm_start_failed", "{e}");
    assert!(e.message.contains("no VMM id is free in vmm_ids"), "{e}");

    a.ok("instance.delete", json!({"ref": "one"}));
    assert!(!a.data_dir.join(format!("vmm-ids/{id1}.json")).exists(), "delete frees the id");
    // A straggler of the deleted instance runs on under its id (in the agent's namespace,
    // where the agent sees it).
    let (_holder, _) =
        a.ns_sh(&format!("echo ready; exec setpriv --reuid={id1} --regid={id1} --clear-groups sleep 3061"));
    let straggler = || pids_where(|c| c.contains("sleep 3061"));
    wait_for(std::time::Duration::from_secs(10), || {
        straggler().into_iter().find(|p| uid_of(*p).map(u64::from) == Some(id1))
    })
    .expect("the straggler runs under the freed id");
    let e = a.err("instance.create", json!({"name": "three", "image": "demo"}));
    assert!(e.message.contains("no VMM id is free"), "BUG: an id was handed out while a process runs under it: {e}");
    for p in straggler() {
        sigkill(p);
    }
    wait_for(std::time::Duration::from_secs(10), || straggler().into_iter().all(|p| !alive(p)).then_some(()))
        .expect("the straggler is gone");
    // Once nothing of its owner remains, the id is free again.
    let v3 = a.ok("instance.create", json!({"name": "three", "image": "demo"}));
    assert_eq!(v3["vmm_id"].as_u64(), Some(id1), "the freed id is given again once nothing holds it");
}

/// An agent refuses to start on a configuration that still names `vmm_user` (saying what
/// replaced it) and on a `vmm_ids` range that holds a user's id.
#[test]
fn an_agent_refuses_the_removed_vmm_user_and_a_range_holding_a_users_id() {
    for (extra, want) in [
        ("vmm_user = \"gpuvisor-vmm\"\n", "vmm_user was removed"),
        ("vmm_ids = { first = 65534, count = 1 }\n", "user nobody has id 65534"),
    ] {
        let dir = vmm_reachable_tempdir("gpuvisor-confine.").unwrap();
        let cfg = dir.path().join("gpuvisor.toml");
        std::fs::write(
            &cfg,
            format!("data_dir = {:?}\nsocket = {:?}\n{extra}", dir.path().join("data"), dir.path().join("s.sock")),
        )
        .unwrap();
        let (status, out) = serve_expecting_exit(&cfg, std::time::Duration::from_secs(60)).unwrap();
        assert!(!status.success());
        assert!(out.contains(want), "{extra}: {out}");
        assert!(!dir.path().join("data").exists(), "nothing was created");
    }
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
