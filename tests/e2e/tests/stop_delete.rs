//! docs/design/scenarios.md §4 "Stop" (S020–S022) and §5 "Delete" (S023–S026), against the real agent,
//! gpuvisor-sim and QEMU (through a `qemu_binary` wrapper that starts the guest paused: the
//! tests need a real VMM holding its VF and QMP socket, not a booted guest).

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Host V: one L40S with 4 VFs `.4`–`.7`.
const HOST_V: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
const VF0: &str = "0000:41:00.4";
const ORPHANS: &str = "gpuvisor_vgpu_orphans_released_total";
const STALE: &str = "gpuvisor_vgpu_stale_releases_total";

fn agent(w: &QemuWrapper, set: &[(&str, &str)]) -> Agent {
    let extra = w.extra() + "reconcile_interval_s = 3600\n";
    Agent::start_tuned(AgentOptions { model: HOST_V, extra: &extra, ..Default::default() }, None, set).unwrap()
}

fn not_found(a: &Agent, name: &str) -> bool {
    a.call("instance.get", json!({"ref": name})).err().map(|e| e.data_code == "not_found").unwrap_or(false)
}

#[test]
fn s020_a_failed_release_on_stop_keeps_the_claim_and_is_retried() {
    let w = QemuWrapper::new();
    let a = agent(&w, &[("release_retry_s", "1")]);
    let i = a.create_gpu("i", "L40S-1Q").unwrap();
    let vf = i["gpu"]["device"].as_str().unwrap().to_string();
    let old_claimed_at = i["gpu"]["claimed_at"].clone();
    let m = a.metrics();
    let orphans0 = metric0(&m, ORPHANS, &[]);
    let failed0 = metric0(&m, STALE, &[("result", "failed")]);
    let released0 = metric0(&m, STALE, &[("result", "released")]);

    a.sim.ctl(&["fail-write", &type_path(&vf), "EBUSY", "--always"]).unwrap();
    let stopped = a.ok("instance.stop", json!({"ref": "i", "force": true}));
    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert_eq!(stopped["gpu"]["release_pending"], true, "{stopped}");
    assert!(qemu_of(i["id"].as_str().unwrap()).is_empty());
    let c = a.claim(&vf).expect("claim stays");
    assert_eq!(c["state"], "release_pending", "{c}");
    let res = a.ok("resources.get", json!({}));
    assert_eq!(res["devices"]["claimed"], 1, "{res}");
    assert_eq!(res["devices"]["allocatable"], 3, "vf not allocatable: {res}");

    let pass1 = a.ok("reconcile.run", json!({}));
    assert!(pass1["failed"].as_array().unwrap().iter().any(|f| f["device"] == vf.as_str()), "{pass1}");
    let m = a.metrics();
    assert_eq!(metric0(&m, STALE, &[("result", "failed")]), failed0 + 1.0, "pass 1 fails again");
    assert_eq!(metric0(&m, ORPHANS, &[]), orphans0);
    assert_eq!(a.claim(&vf).unwrap()["state"], "release_pending");
    assert_ne!(a.vf_type(&vf), 0);

    a.sim.ctl(&["clear-faults"]).unwrap();
    let seq = last_seq(&a.state());
    let pass2 = a.ok("reconcile.run", json!({}));
    assert!(pass2["released"].as_array().unwrap().iter().any(|r| r["device"] == vf.as_str()), "{pass2}");
    assert!(a.claim(&vf).is_none(), "pass 2 deletes the row");
    assert_eq!(a.vf_type(&vf), 0);
    let after: Vec<Value> = log_after(&a.state(), seq).into_iter().filter(|e| e["op"] == "write").collect();
    assert_eq!(after.len(), 1, "one write of 0: {after:?}");
    assert_eq!(after[0]["path"], type_path(&vf));
    assert_eq!(after[0]["value"].as_str().unwrap().trim(), "0");
    assert_eq!(after[0]["result"], "ok");
    let m = a.metrics();
    assert_eq!(metric0(&m, STALE, &[("result", "released")]), released0 + 1.0);
    assert_eq!(metric0(&m, ORPHANS, &[]), orphans0);

    let started = a.ok("instance.start", json!({"ref": "i"}));
    assert_eq!(started["state"], "running");
    let nc = a.claims();
    assert_eq!(nc.len(), 1);
    assert_eq!(nc[0]["state"], "configured", "a fresh claim: {nc:?}");
    assert_ne!(started["gpu"]["claimed_at"], Value::Null);
    let _ = old_claimed_at;
    assert_eq!(metric0(&a.metrics(), ORPHANS, &[]), orphans0, "orphans_released_total never moves");
}

#[test]
fn s021_stopping_a_stopped_instance_retries_its_retained_release() {
    let w = QemuWrapper::new();
    let a = agent(&w, &[("release_retry_s", "1")]);
    // (a) no fault.
    let (_, vf) = a.retained_stopped("a", "L40S-2Q");
    assert_eq!(a.vf_type(&vf), 1148);
    let got = a.ok("instance.stop", json!({"ref": "a"}));
    assert_eq!(got["state"], "stopped");
    assert_eq!(a.vf_type(&vf), 0);
    assert!(a.claim(&vf).is_none(), "the row is gone");

    // (b) the clear fails with EIO.
    let (_, vf) = a.retained_stopped("b", "L40S-2Q");
    let before = a.claim(&vf).unwrap();
    a.sim.ctl(&["fail-write", &type_path(&vf), "EIO", "--always"]).unwrap();
    let got = a.ok("instance.stop", json!({"ref": "b"}));
    assert_eq!(got["state"], "stopped");
    let after = a.claim(&vf).expect("the row stays");
    assert_eq!(
        after["release_attempts"].as_u64().unwrap(),
        before["release_attempts"].as_u64().unwrap() + 1,
        "{before} → {after}"
    );
    assert!(after["last_error"].as_str().map(|e| !e.is_empty()).unwrap_or(false), "{after}");
    assert_ne!(after["last_error"], before["last_error"], "last_error is the new failure");
    assert_eq!(a.vf_type(&vf), 1148, "vf unchanged");
}

/// A process in the agent's namespace listening on a Unix socket at `path` (the file is
/// replaced); it logs any signal it receives to `siglog` and keeps running.
fn listener(a: &Agent, path: &Path, siglog: &Path) -> (std::process::Child, i32) {
    let py = format!(
        "import os,signal,socket,sys,time\n\
         p={p:?}\nlog={l:?}\n\
         def h(n,f):\n    open(log,'a').write('%d\\n'%n)\n\
         for s in (signal.SIGTERM,signal.SIGINT,signal.SIGHUP,signal.SIGUSR1,signal.SIGQUIT):\n    signal.signal(s,h)\n\
         try:\n    os.unlink(p)\nexcept FileNotFoundError:\n    pass\n\
         s=socket.socket(socket.AF_UNIX)\ns.bind(p)\ns.listen(4)\n\
         print(os.getpid(),flush=True)\n\
         while True:\n    time.sleep(1)\n",
        p = path.display().to_string(),
        l = siglog.display().to_string()
    );
    let script_path = siglog.with_extension("py");
    std::fs::write(&script_path, py).unwrap();
    let (child, line) = a.ns_sh(&format!("exec /usr/bin/python3 {}", script_path.display()));
    (child, line.parse().unwrap_or_else(|_| panic!("listener pid: {line:?}")))
}

#[test]
fn s022_stop_refuses_when_the_vmm_cannot_be_identified() {
    let w = QemuWrapper::new();
    let a = agent(&w, &[]);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    let vf = inst["gpu"]["device"].as_str().unwrap().to_string();
    let qemu = qemu_of(&id);
    assert_eq!(qemu.len(), 1);
    let qmp = PathBuf::from(inst["vmm"]["control_socket"].as_str().unwrap());

    // The recorded pid is alive but is an unrelated `sleep` with another start time.
    let (_sleep, nspid) = a.ns_sh("echo $$; exec sleep 3022");
    let nspid: i32 = nspid.parse().unwrap();
    let sleep_root = wait_for(Duration::from_secs(5), || root_pid_of(nspid, |c| c.contains("sleep 3022"))).unwrap();
    let mut rec = a.record(&id);
    assert_ne!(proc_start_time(sleep_root).unwrap(), rec["vmm"]["identity"]["start_time"].as_u64().unwrap());
    rec["vmm"]["identity"]["pid"] = json!(nspid);
    a.write_record(&id, &rec);
    // A second process listens at A's QMP path (QEMU's listener is still bound there too).
    let tmp = tempfile::tempdir().unwrap();
    let siglog = tmp.path().join("signals.log");
    let (_l, lpid) = listener(&a, &qmp, &siglog);
    let lroot = wait_for(Duration::from_secs(5), || root_pid_of(lpid, |c| c.contains("python3"))).unwrap();
    let claim = a.claim(&vf).unwrap();
    let seq = last_seq(&a.state());

    for (method, params) in
        [("instance.stop", json!({"ref": "a", "force": true})), ("instance.delete", json!({"ref": "a"}))]
    {
        let e = a.err(method, params);
        assert_eq!((e.code, e.data_code.as_str()), (503, "vmm_liveness_unknown"), "{method}: {e}");
    }
    std::thread::sleep(Duration::from_millis(300)); // let any stray signal land
    assert!(alive(qemu[0]), "QEMU got no signal");
    assert!(alive(sleep_root), "the sleep got no signal");
    assert!(alive(lroot), "the listener got no signal");
    assert_eq!(std::fs::read_to_string(&siglog).unwrap_or_default(), "", "the listener logged no signal");
    assert_eq!(a.record(&id), rec, "A's record is unchanged");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "running");
    assert_eq!(a.claim(&vf).unwrap(), claim, "the claim is untouched");
    assert_eq!(a.vf_type(&vf), 1148);
    let after: Vec<Value> = log_after(&a.state(), seq).into_iter().filter(|e| e["op"] == "write").collect();
    assert!(after.is_empty(), "no sysfs write: {after:?}");
}

/// A stopped instance with a retained claim whose delete failed (S023's end state).
fn failed_delete(a: &Agent) -> (String, String, RpcError) {
    let (id, vf) = a.retained_stopped("a", "L40S-2Q");
    a.sim.ctl(&["fail-write", &type_path(&vf), "EIO", "--always"]).unwrap();
    let e = a.err("instance.delete", json!({"ref": "a"}));
    (id, vf, e)
}

fn dir_files(a: &Agent, id: &str) -> Vec<String> {
    a.data_files(&format!("instances/{id}"))
}

#[test]
fn s023_delete_keeps_everything_when_the_vgpu_release_fails() {
    let w = QemuWrapper::new();
    let a = agent(&w, &[("release_retry_s", "1")]);
    let (id, vf) = a.retained_stopped("a", "L40S-2Q");
    let files = dir_files(&a, &id);
    assert!(files.contains(&"instance.json".to_string()), "{files:?}");
    a.sim.ctl(&["fail-write", &type_path(&vf), "EIO", "--always"]).unwrap();
    let e = a.err("instance.delete", json!({"ref": "a"}));
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{e}");
    assert_eq!(e.data["retained"], true, "{}", e.data);
    assert_eq!(e.data["instance_id"], id.as_str());
    let g = e.data["guidance"].as_str().unwrap_or("");
    assert!(g.contains("delete") && g.contains("retry"), "guidance: retry the delete: {g}");
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["state"], "cleanup_pending", "{got}");
    let c = a.claim(&vf).expect("A keeps its claim");
    assert_eq!(c["instance_id"], id.as_str());
    assert_eq!(c["state"], "release_pending");
    assert_eq!(a.vf_type(&vf), 1148);
    // This agent boots kernels directly (no disk overlay); every file of the instance
    // directory (record, serial log, QEMU log) is still there.
    assert_eq!(dir_files(&a, &id), files, "the instance directory is intact");
}

#[test]
fn s024_a_cleanup_pending_instance_accepts_only_delete() {
    let w = QemuWrapper::new();
    let mut a = agent(&w, &[("release_retry_s", "1")]);
    let (id, vf, e) = failed_delete(&a);
    assert_eq!(e.data_code, "vgpu_cleanup_pending", "{e}");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "cleanup_pending");
    for (m, p) in [
        ("instance.start", json!({"ref": "a"})),
        ("instance.fork", json!({"ref": "a", "name": "k"})),
        ("instance.snapshot", json!({"ref": "a"})),
        ("instance.standby", json!({"ref": "a"})),
        ("instance.restore", json!({"ref": "a"})),
        ("instance.restore", json!({"ref": "a", "snapshot": "s1"})),
    ] {
        let e = a.err(m, p);
        assert_eq!((e.code, e.data_code.as_str()), (409, "instance_cleanup_pending"), "{m}: {e}");
    }
    assert!(not_found(&a, "k"), "no fork was made");

    // Restart the agent (the fault is still on): A is still cleanup_pending, never started.
    let opens = a.state()["log"].as_array().unwrap().iter().filter(|e| e["op"] == "open").count();
    a.restart().unwrap();
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["state"], "cleanup_pending", "{got}");
    assert!(qemu_of(&id).is_empty(), "A was never started");
    assert_eq!(
        a.state()["log"].as_array().unwrap().iter().filter(|e| e["op"] == "open").count(),
        opens,
        "no VMM opened a device node"
    );
    assert!(a.claim(&vf).is_some());

    a.sim.ctl(&["clear-faults"]).unwrap();
    let del = a.ok("instance.delete", json!({"ref": "a"}));
    assert_eq!(del["deleted"], true);
    assert_eq!(a.vf_type(&vf), 0);
    assert!(a.claims().is_empty(), "{:?}", a.claims());
    assert!(!a.data_dir.join(format!("instances/{id}")).exists(), "no directory of A remains");
    assert!(not_found(&a, "a"));
}

#[test]
fn s025_the_vgpu_is_released_before_any_other_teardown() {
    let w = QemuWrapper::new();
    let a = agent(&w, &[]);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    assert_eq!(inst["gpu"]["device"], VF0);
    let qemu = qemu_of(&id)[0];
    let dir = a.data_dir.join(format!("instances/{id}"));
    let claim_file = a.data_dir.join(format!("claims/{VF0}.json"));
    let type_file = a.sim.path().join(type_path(VF0));
    assert!(dir.join("vmm/serial.log").exists() && dir.join("qemu.log").exists());
    let seq = last_seq(&a.state());

    #[derive(Debug)]
    struct Snap {
        state: Option<String>,
        qemu: bool,
        vf: String,
        claim: bool,
        others: usize,
    }
    let snap = || {
        let state = std::fs::read_to_string(dir.join("instance.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .map(|v| v["state"].as_str().unwrap_or("").to_string());
        let others = std::fs::read_dir(&dir)
            .map(|rd| rd.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with("instance.json")).count())
            .unwrap_or(0);
        Snap {
            state,
            qemu: alive(qemu),
            vf: std::fs::read_to_string(&type_file).unwrap_or_else(|_| "?".into()).trim().to_string(),
            claim: claim_file.exists(),
            others,
        }
    };
    let sock = a.socket.clone();
    let del = std::thread::spawn(move || {
        rpc_raw(&sock, &json!({"jsonrpc":"2.0","id":1,"method":"instance.delete","params":{"ref":"a"}}).to_string())
    });
    let mut snaps = Vec::new();
    while !del.is_finished() {
        snaps.push(snap());
    }
    let answer = del.join().unwrap().unwrap();
    assert_eq!(answer["result"]["deleted"], true, "{answer}");
    snaps.push(snap());

    for s in &snaps {
        if !s.qemu {
            assert!(s.state.is_none() || s.state.as_deref() == Some("deleting"), "QEMU died before the mark: {s:?}");
        }
        if s.vf == "0" {
            assert!(!s.qemu, "vf0 cleared while QEMU lived: {s:?}");
        }
        if !s.claim {
            assert_eq!(s.vf, "0", "claim row deleted before vf0 read 0: {s:?}");
        }
        if s.others < 2 {
            assert!(!s.claim, "instance files removed before the claim row: {s:?}");
        }
        if s.state.is_none() {
            assert_eq!(s.others, 0, "the record went before the rest of the directory: {s:?}");
        }
    }
    assert!(snaps.iter().any(|s| s.state.as_deref() == Some("deleting")), "A was marked deleting: {:?}", snaps.first());
    assert!(!dir.exists(), "the instance directory is gone");
    let w: Vec<Value> = log_after(&a.state(), seq).into_iter().filter(|e| e["op"] == "write").collect();
    assert!(w.iter().all(|e| e["path"] == type_path(VF0) && e["value"].as_str().unwrap().trim() == "0"), "{w:?}");
    assert_eq!(w.last().unwrap()["result"], "ok", "{w:?}");
}

/// Host V with the agent's data directory on a 24 MiB tmpfs (paused QEMUs). Fields drop in
/// order: the agent and its VMs, the QEMU wrapper, the mount.
struct SmallDisk {
    a: Agent,
    _w: QemuWrapper,
    mnt: Tmpfs,
}

impl SmallDisk {
    fn start() -> SmallDisk {
        let mnt = Tmpfs::mount("24m");
        let data = mnt.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let w = QemuWrapper::new();
        let extra = w.extra();
        let a =
            Agent::start_tuned(AgentOptions { model: HOST_V, extra: &extra, ..Default::default() }, Some(data), &[])
                .unwrap();
        SmallDisk { a, _w: w, mnt }
    }

    /// Fills the filesystem to the last byte.
    fn fill(&self) {
        self.mnt.fill();
    }
}

#[test]
fn s026_deleting_a_plain_instance_works_on_a_full_disk() {
    let host = SmallDisk::start();
    let (a, mnt) = (&host.a, host.mnt.path());
    let b = a.ok("instance.create", json!({"name": "b", "image": "demo"}));
    let id = b["id"].as_str().unwrap().to_string();
    assert_eq!(b["state"], "running");
    assert!(b["gpu"].is_null());
    assert_eq!(qemu_of(&id).len(), 1);

    // Fill the filesystem completely.
    host.fill();
    let probe = std::fs::write(mnt.join("probe"), b"x");
    assert!(probe.is_err(), "the disk is full");
    let seq = last_seq(&a.state());

    let del = a.ok("instance.delete", json!({"ref": "b"}));
    assert_eq!(del["deleted"], true, "{del}");
    assert!(not_found(a, "b"));
    assert!(qemu_of(&id).is_empty(), "B's QEMU is gone");
    assert!(!a.data_dir.join(format!("instances/{id}")).exists(), "B's directory is removed");
    assert!(a.claims().is_empty(), "no claim row");
    let w: Vec<Value> = log_after(&a.state(), seq).into_iter().filter(|e| e["op"] == "write").collect();
    assert!(w.is_empty(), "no sysfs write: {w:?}");
}

/// Regression: a full disk between configure and persisting the claim's `configured` state
/// left the VF configured and its claim behind with the instance record gone, and answered
/// without any release attempt. Create rollback (docs/design/lifecycle.md Create step 6) now releases
/// through the guard: the VF reads 0, no claim and no record are left, and the caller gets
/// the original error.
#[test]
fn a_full_disk_after_configure_rolls_the_create_back_through_the_release_guard() {
    let host = SmallDisk::start();
    let (a, mnt) = (&host.a, host.mnt.path());
    a.sim.ctl(&["delay-write", "sys/bus/pci/devices/*/nvidia/current_vgpu_type", "1500", "--times", "1"]).unwrap();
    let create = a.spawn_call("instance.create", json!({"name": "c", "image": "demo", "gpu": "L40S-2Q"}));
    // While the type write is held, fill the disk.
    wait_for(Duration::from_secs(20), || {
        a.state()["log"].as_array()?.iter().any(|e| e["op"] == "write-delayed").then_some(())
    })
    .expect("the type write begins");
    host.fill();
    let answer = create.join().unwrap().unwrap();
    assert!(answer["error"].is_object(), "the create fails: {answer}");
    // The failure (ENOSPC, `internal`) is logged once at ERROR with the instance's id and name.
    let failed: Vec<String> = a
        .log()
        .lines()
        .filter(|l| l.contains("operation failed") && l.contains("op=create"))
        .map(String::from)
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].contains(" ERROR ") && failed[0].contains("instance.name=c") && failed[0].contains("instance.id="),
        "{}",
        failed[0]
    );
    let st = a.state();
    assert!(set_vfs(&st).is_empty(), "the configured VF was released: {:?}", set_vfs(&st));
    assert!(a.claims().is_empty(), "no claim left: {:?}", a.claims());
    assert!(not_found(a, "c"), "no record left");
    assert!(a.qemu_pids().is_empty(), "no QEMU");
    // A create whose record cannot be written leaves no empty instance directory (the
    // rollback freed a few blocks: fill them again first).
    host.fill();
    assert!(a.call("instance.create", json!({"name": "p", "image": "demo"})).is_err(), "the disk is full");
    assert!(a.data_files("instances").is_empty(), "{:?}", a.data_files("instances"));
    // Space again: the same create succeeds.
    std::fs::remove_file(mnt.join("fill")).unwrap();
    a.ok("instance.create", json!({"name": "c", "image": "demo", "gpu": "L40S-2Q"}));
}

/// Regression: one undecodable claim file made successful calls answer `internal` after
/// their work was done (a plain create whose VM then ran; a stop that had killed the VMM
/// and left the record `stopping`). Now the calls succeed with a `warnings` entry, and the
/// bad file blocks only the device it names: another instance's stop releases its own VF,
/// and no create is placed on the blocked one.
#[test]
fn an_undecodable_claim_file_never_turns_a_done_operation_into_an_error() {
    let w = QemuWrapper::new();
    let a = Agent::start_with(AgentOptions { model: HOST_V, extra: &w.extra(), ..Default::default() }).unwrap();
    let g = a.create_gpu("g", "L40S-2Q").unwrap();
    let vf = g["gpu"]["device"].as_str().unwrap().to_string();
    let blocked = "0000:41:00.7";
    let bad = a.data_dir.join(format!("claims/{blocked}.json"));
    std::fs::write(&bad, "{").unwrap();

    let c = a.ok("instance.create", json!({"name": "c", "image": "demo"}));
    assert_eq!(c["state"], "running", "{c}");
    assert!(c["warnings"][0].as_str().unwrap().contains("cannot be read"), "{c}");

    let s = a.ok("instance.stop", json!({"ref": "g", "force": true}));
    assert_eq!(s["state"], "stopped", "{s}");
    assert!(qemu_of(g["id"].as_str().unwrap()).is_empty(), "g's QEMU is gone");
    assert_eq!(a.vf_type(&vf), 0, "g's own readable claim is released");
    assert!(a.claim(&vf).is_none());
    // Three more vGPUs fit on the four VFs; the blocked one is never placed on.
    for n in ["d", "e", "f"] {
        let i = a.create_gpu(n, "L40S-2Q").unwrap();
        assert_ne!(i["gpu"]["device"], blocked, "{i}");
    }
    let e = a.create_gpu("h", "L40S-2Q").unwrap_err();
    assert_eq!(e.data_code, "no_capacity", "{e}");
    let gpus = a.ok("gpu.list", json!({}));
    let dev = gpus["gpus"][0]["devices"].as_array().unwrap().iter().find(|d| d["address"] == blocked).unwrap().clone();
    assert_eq!(dev["state"], "claimed", "{dev}");
    assert!(dev["claim"]["unreadable"].as_str().unwrap().contains(bad.to_str().unwrap()), "{dev}");
    std::fs::remove_file(&bad).unwrap();
    a.create_gpu("h", "L40S-2Q").unwrap();
}
