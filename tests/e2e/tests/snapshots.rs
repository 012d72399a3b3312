//! Snapshots, standby and restore (docs/design/lifecycle.md "Snapshots, standby, restore"),
//! against the real agent and real QEMU (TCG): a marker the guest keeps in RAM (`/tmp`, in
//! its initramfs) shows a restored VM resumed where it was saved — a boot would have lost it
//! and printed `gpuvisor-guest: ready` again; the GPU rules with their codes; a stopped
//! snapshot of a GPU VM restored onto a fresh VF while another VM holds its old one; and a
//! crash of the agent at each new write site leaves the old state or the new one, no partial
//! files and no paused VM.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

const BOOT: Duration = Duration::from_secs(240);
const ANSWER: Duration = Duration::from_secs(60);
const READY: &str = "gpuvisor-guest: ready";

/// Creates a plain VM of the demo image and waits for its shell.
fn plain(a: &Agent, name: &str) -> Value {
    let v = a.ok("instance.create", json!({"name": name, "image": "demo"}));
    wait_serial_after(&v, 0, READY, BOOT);
    v
}

/// Writes `marker` to `/tmp/m` in the guest (RAM: a boot loses it).
fn mark(v: &Value, marker: &str) {
    console_run(v, &format!("echo {marker} >/tmp/m; echo \"W:$(cat /tmp/m):W\""), &format!("W:{marker}:W"), ANSWER);
}

/// Asserts the guest still has `marker` in `/tmp/m`.
fn has_mark(v: &Value, marker: &str) {
    console_run(v, "echo \"R:$(cat /tmp/m 2>/dev/null || echo none):R\"", &format!("R:{marker}:R"), ANSWER);
}

/// How many times the guest finished booting (its serial log is appended across VMMs).
fn boots(v: &Value) -> usize {
    serial_text(v).matches(READY).count()
}

fn instance_dir(a: &Agent, v: &Value) -> PathBuf {
    a.data_dir.join("instances").join(v["id"].as_str().unwrap())
}

/// Names in the instance's snapshot directory (`.partial-` ones included).
fn snapshot_entries(a: &Agent, v: &Value) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(instance_dir(a, v).join("snapshots"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Live QEMUs of instance `v`.
fn qemus_of(a: &Agent, v: &Value) -> usize {
    a.live_qemus().iter().filter(|q| q.instance_id.as_deref() == v["id"].as_str()).count()
}

fn get(a: &Agent, name: &str) -> Value {
    a.ok("instance.get", json!({"ref": name}))
}

/// The instance's state and its VM's state as QEMU reports it (`query-status`).
fn states(a: &Agent, name: &str) -> (String, String) {
    let v = get(a, name);
    let s = |x: &Value| x.as_str().unwrap_or("-").to_string();
    (s(&v["state"]), s(&v["vmm"]["vm_state"]))
}

fn running() -> (String, String) {
    ("running".into(), "running".into())
}

#[test]
fn a_running_snapshot_restores_the_vm_where_it_was_and_standby_resumes_it() {
    let a = Agent::start("l40s-2x16").unwrap();
    let v = plain(&a, "p");
    mark(&v, "before-snapshot");

    let s = a.ok("instance.snapshot", json!({"ref": "p", "snapshot": "s1"}));
    println!("instance.snapshot {{ref: p, snapshot: s1}} -> {s}");
    assert_eq!(s["name"], "s1", "{s}");
    assert_eq!(s["kind"], "running", "{s}");
    assert_eq!(s["files"], json!(["memory"]), "no disk on the demo image: {s}");
    assert!(s["bytes"].as_u64().unwrap() > 0, "{s}");
    // Paused for the save, then running on.
    assert_eq!(states(&a, "p"), running());
    mark(&v, "after-snapshot");
    let e = a.err("instance.snapshot", json!({"ref": "p", "snapshot": "s1"}));
    assert_eq!(e.data_code, "invalid_request", "a taken name: {e}");
    let e = a.err("instance.snapshot", json!({"ref": "p", "snapshot": "../x"}));
    assert_eq!(e.data_code, "invalid_request", "{e}");

    let list = a.ok("instance.snapshots", json!({"ref": "p"}));
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["bytes"], s["bytes"], "{list}");

    // A running instance is not restored over.
    let e = a.err("instance.restore", json!({"ref": "p", "snapshot": "s1"}));
    assert_eq!(e.data_code, "invalid_state", "{e}");
    assert_eq!(a.ok("instance.stop", json!({"ref": "p", "force": true}))["state"], "stopped");
    let booted = boots(&v);
    let r = a.ok("instance.restore", json!({"ref": "p", "snapshot": "s1"}));
    println!("instance.restore {{ref: p, snapshot: s1}} -> state {}", r["state"]);
    assert_eq!(r["state"], "running", "{r}");
    has_mark(&v, "before-snapshot");
    assert_eq!(boots(&v), booted, "resumed, not booted:\n{}", tail(&serial_text(&v), 20));
    println!("guest console after the restore (boots so far: {booted}):\n{}", tail(&serial_text(&v), 8));
    // A snapshot restores any number of times (its memory is loaded over its own disk).
    mark(&v, "scribbled");
    a.ok("instance.stop", json!({"ref": "p", "force": true}));
    a.ok("instance.restore", json!({"ref": "p", "snapshot": "s1"}));
    has_mark(&v, "before-snapshot");

    // Standby: saved, no VMM, no device; a start resumes it, and the saved state is used up.
    mark(&v, "before-standby");
    let sb = a.ok("instance.standby", json!({"ref": "p"}));
    assert_eq!(sb["state"], "standby", "{sb}");
    assert!(sb["vmm"].is_null(), "{sb}");
    assert_eq!(qemus_of(&a, &v), 0, "the standby's VMM is gone");
    assert!(instance_dir(&a, &v).join("standby/memory").is_file());
    let e = a.err("instance.standby", json!({"ref": "p"}));
    assert_eq!(e.data_code, "invalid_state", "{e}");
    let booted = boots(&v);
    let r = a.ok("instance.start", json!({"ref": "p"}));
    assert_eq!(r["state"], "running", "{r}");
    has_mark(&v, "before-standby");
    assert_eq!(boots(&v), booted, "resumed, not booted");
    assert!(!instance_dir(&a, &v).join("standby").exists(), "the standby state is used once");

    // instance.restore without a snapshot resumes a standby; stop discards one.
    a.ok("instance.standby", json!({"ref": "p"}));
    a.ok("instance.restore", json!({"ref": "p"}));
    has_mark(&v, "before-standby");
    a.ok("instance.standby", json!({"ref": "p"}));
    let st = a.ok("instance.stop", json!({"ref": "p"}));
    assert_eq!(st["state"], "stopped", "{st}");
    assert!(!instance_dir(&a, &v).join("standby").exists(), "stop discards the standby state");
    let e = a.err("instance.restore", json!({"ref": "p"}));
    assert_eq!(e.data_code, "invalid_request", "not in standby, no snapshot named: {e}");
    // A stopped VM without a disk has nothing to snapshot.
    let e = a.err("instance.snapshot", json!({"ref": "p"}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert!(e.message.contains("no disk"), "{e}");

    // A fork from the running snapshot: the snapshot holds no disk.
    let e = a.err("instance.fork", json!({"ref": "p", "name": "pf", "snapshot": "s1"}));
    assert_eq!(e.data_code, "invalid_request", "{e}");

    let d = a.ok("instance.snapshot_delete", json!({"ref": "p", "snapshot": "s1"}));
    assert_eq!(d["snapshot"], "s1", "{d}");
    assert_eq!(snapshot_entries(&a, &v), Vec::<String>::new());
    let e = a.err("instance.snapshot_delete", json!({"ref": "p", "snapshot": "s1"}));
    assert_eq!(e.data_code, "not_found", "{e}");
    let e = a.err("instance.snapshot_delete", json!({"ref": "p"}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    // Delete takes the snapshots with the instance.
    a.ok("instance.start", json!({"ref": "p"}));
    a.ok("instance.snapshot", json!({"ref": "p", "snapshot": "s2"}));
    a.ok("instance.delete", json!({"ref": "p"}));
    assert!(!instance_dir(&a, &v).exists());
}

#[test]
fn a_gpu_vm_refuses_standby_and_running_snapshots_and_a_stopped_one_restores_onto_a_fresh_vf() {
    let a = Agent::start("l40s-2x16").unwrap();
    a.ok("image.import", json!({"name": "demo-disk", "disk": demo_disk_image().join("disk.qcow2")}));
    let g = a.ok("instance.create", json!({"name": "g", "image": "demo-disk", "gpu": "L40S-2Q"}));
    let old_vf = g["gpu"]["device"].as_str().unwrap().to_string();
    wait_serial_after(&g, 0, READY, BOOT);
    console_run(&g, "echo snap >/data/f; sync; echo \"W:$(cat /data/f):W\"", "W:snap:W", ANSWER);

    for op in ["instance.standby", "instance.snapshot"] {
        let e = a.err(op, json!({"ref": "g"}));
        assert_eq!(e.data_code, "unsupported_with_gpu", "{op}: {e}");
        assert_eq!(e.code, 409, "{op}: {e}");
    }
    assert_eq!(states(&a, "g"), running(), "a refusal leaves the VM running");

    a.ok("instance.stop", json!({"ref": "g"}));
    let s = a.ok("instance.snapshot", json!({"ref": "g", "snapshot": "d1"}));
    assert_eq!(s["kind"], "stopped", "{s}");
    assert_eq!(s["files"], json!(["disk.qcow2"]), "{s}");

    // The disk moves on after the snapshot.
    let from = serial_len(&g);
    a.ok("instance.start", json!({"ref": "g"}));
    wait_serial_after(&g, from, READY, BOOT);
    console_run(&g, "echo later >/data/f; sync; echo \"W:$(cat /data/f):W\"", "W:later:W", ANSWER);
    a.ok("instance.stop", json!({"ref": "g"}));

    // Another VM takes the VF g had.
    let h = a.create_gpu("h", "L40S-2Q").unwrap();
    assert_eq!(h["gpu"]["device"], old_vf.as_str(), "placement hands out the released VF first: {h}");

    let from = serial_len(&g);
    let r = a.ok("instance.restore", json!({"ref": "g", "snapshot": "d1"}));
    assert_eq!(r["state"], "running", "{r}");
    let new_vf = r["gpu"]["device"].as_str().unwrap();
    assert_ne!(new_vf, old_vf, "a fresh claim, never the device of the snapshot's time: {r}");
    assert_eq!(a.claims().len(), 2, "one claim each: {:?}", a.claims());
    wait_serial_after(&g, from, READY, BOOT);
    console_run(&g, "echo \"R:$(cat /data/f):R\"", "R:snap:R", ANSWER);

    // A fork from the disk snapshot, while the source runs.
    let f = a.ok("instance.fork", json!({"ref": "g", "name": "gf", "snapshot": "d1"}));
    assert_eq!(f["state"], "stopped", "{f}");
    assert!(instance_dir(&a, &f).join("vmm/disk.qcow2").is_file());
    assert_eq!(f["gpu"]["device"], Value::Null, "{f}");
}

#[test]
fn a_crash_at_each_save_step_leaves_the_old_state_or_the_new_and_no_paused_vm() {
    assert_failpoints_built();
    let mut a = Agent::start("l40s-2x16").unwrap();
    let v = plain(&a, "c");
    mark(&v, "m1");

    // The memory is saved, the VM paused: the start-up resumes it, and nothing is listed.
    a.crash_at("save_after_memory", "instance.snapshot", json!({"ref": "c", "snapshot": "x1"}));
    assert_eq!(states(&a, "c"), running());
    assert_eq!(snapshot_entries(&a, &v), Vec::<String>::new(), "no partial snapshot is left");
    assert!(a.log().contains("resumed"), "the resume is logged");
    has_mark(&v, "m1");

    // Renamed into place: the new state, whole.
    a.crash_at("save_after_rename", "instance.snapshot", json!({"ref": "c", "snapshot": "x2"}));
    assert_eq!(states(&a, "c"), running());
    assert_eq!(snapshot_entries(&a, &v), vec!["x2".to_string()]);
    let list = a.ok("instance.snapshots", json!({"ref": "c"}));
    assert_eq!(list["snapshots"][0]["files"], json!(["memory"]), "{list}");

    // Standby saved but not recorded: still running (resumed), the standby state removed.
    a.crash_at("standby_after_save", "instance.standby", json!({"ref": "c"}));
    assert_eq!(states(&a, "c"), running());
    assert!(!instance_dir(&a, &v).join("standby").exists());
    has_mark(&v, "m1");

    // Standby recorded, the paused VMM not stopped yet: the reconciler stops it.
    a.crash_at("standby_after_record", "instance.standby", json!({"ref": "c"}));
    a.pass();
    let c = get(&a, "c");
    assert_eq!(c["state"], "standby", "{c}");
    assert!(c["vmm"].is_null(), "{c}");
    assert_eq!(qemus_of(&a, &v), 0, "the standby's VMM was stopped");
    let booted = boots(&v);
    a.ok("instance.start", json!({"ref": "c"}));
    has_mark(&v, "m1");
    assert_eq!(boots(&v), booted, "resumed, not booted");

    // A restore whose disks were replaced: stopped, and restored again at will.
    a.ok("instance.stop", json!({"ref": "c", "force": true}));
    a.crash_at("restore_after_disks", "instance.restore", json!({"ref": "c", "snapshot": "x2"}));
    assert_eq!(get(&a, "c")["state"], "stopped");
    assert_eq!(qemus_of(&a, &v), 0);
    a.ok("instance.restore", json!({"ref": "c", "snapshot": "x2"}));
    has_mark(&v, "m1");
    assert_eq!(snapshot_entries(&a, &v), vec!["x2".to_string()]);
}
