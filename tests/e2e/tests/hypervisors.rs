//! The VMM interface, end to end: the same lifecycle suite for each driver the capability
//! table allows for plain instances — QEMU (real, TCG guests), Cloud Hypervisor against the
//! test server (`tests/ch-fake`: a guest that boots, powers off on the button, or hangs) and
//! Cloud Hypervisor for real (the v53.0 binary: its REST API works here, but this machine's
//! KVM runs no guest, so its console stays silent and its power button does nothing).
//!
//! Every test of the real binary skips with one line when no binary is found
//! (`CLOUD_HYPERVISOR_BIN`, `PATH`, `../shared/tools/cloud-hypervisor`).

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hv {
    Qemu,
    ChFake,
    ChReal,
}

impl Hv {
    fn name(self) -> &'static str {
        match self {
            Hv::Qemu => "qemu",
            Hv::ChFake | Hv::ChReal => "cloud-hypervisor",
        }
    }

    fn socket_name(self) -> &'static str {
        match self {
            Hv::Qemu => "qmp.sock",
            Hv::ChFake | Hv::ChReal => "ch.sock",
        }
    }

    /// The guest prints its ready line (not the real Cloud Hypervisor here: no guest runs).
    fn has_console(self) -> bool {
        self != Hv::ChReal
    }
}

/// An agent whose plain instances run on `hv`.
struct Rig {
    a: Agent,
    hv: Hv,
    ch: Option<ChWrapper>,
}

/// `None` (the test skips) when `hv` is the real Cloud Hypervisor and none is found.
fn rig(hv: Hv, set: &[(&str, &str)]) -> Option<Rig> {
    let ch = match hv {
        Hv::Qemu => None,
        Hv::ChFake => Some(ChWrapper::fake()),
        Hv::ChReal => Some(ChWrapper::real()?),
    };
    let mut all: Vec<(&str, String)> = vec![("reconcile_interval_s", "3600".into())];
    // The real binary ignores the power button here: keep the wait for it short.
    if hv == Hv::ChReal {
        all.push(("stop_timeout_s", "3".into()));
    }
    if let Some(c) = &ch {
        all.push(c.setting());
    }
    all.extend(set.iter().map(|(k, v)| (*k, v.to_string())));
    let set: Vec<(&str, &str)> = all.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let a = Agent::start_tuned(AgentOptions::default(), None, &set).unwrap();
    Some(Rig { a, hv, ch })
}

impl Rig {
    fn create(&self, name: &str) -> Value {
        let inst = self.a.ok("instance.create", json!({"name": name, "image": "demo", "hypervisor": self.hv.name()}));
        assert_eq!(inst["hypervisor"], self.hv.name(), "{inst}");
        inst
    }

    /// The one VMM process of `inst` (root-namespace pid).
    fn vmm(&self, inst: &Value) -> i32 {
        let id = inst["id"].as_str().unwrap();
        let pids = wait_for(Duration::from_secs(10), || {
            let p = vmm_of(id);
            (p.len() == 1).then_some(p)
        })
        .unwrap_or_else(|| panic!("one VMM for {id}: {:?}", vmm_of(id)));
        pids[0]
    }

    fn wait_console(&self, inst: &Value) {
        if self.hv.has_console() {
            self.a.wait_serial(inst, "gpuvisor-guest: ready", Duration::from_secs(120)).unwrap();
        }
    }

    fn get(&self, name: &str) -> Value {
        self.a.ok("instance.get", json!({"ref": name}))
    }
}

fn gone(pid: i32) -> bool {
    wait_reaped(pid) || !alive(pid)
}

macro_rules! each_driver {
    ($($test:ident),* $(,)?) => {
        mod qemu {
            $( #[test] fn $test() { super::$test(super::Hv::Qemu) } )*
        }
        mod ch_fake {
            $( #[test] fn $test() { super::$test(super::Hv::ChFake) } )*
        }
        mod ch_real {
            $( #[test] fn $test() { super::$test(super::Hv::ChReal) } )*
        }
    };
}

each_driver!(
    create_runs_the_vm_and_every_view_names_its_hypervisor,
    a_graceful_stop_then_start_then_delete,
    a_forced_stop_goes_through_the_sigterm_first_kill_path,
    a_crashed_vmm_is_found_dead_and_logged_once,
    an_agent_crash_between_spawn_and_identity_capture_finds_the_live_vmm,
    the_reconciler_leaves_a_live_vmm_running,
    a_recycled_pid_is_never_signalled,
    a_reset_starts_the_guest_over_in_the_same_vmm_and_a_reboot_in_a_new_one,
);

fn create_runs_the_vm_and_every_view_names_its_hypervisor(hv: Hv) {
    let Some(r) = rig(hv, &[]) else { return };
    let inst = r.create("vm");
    let id = inst["id"].as_str().unwrap();
    assert_eq!(inst["state"], "running");
    let socket = PathBuf::from(inst["vmm"]["control_socket"].as_str().unwrap());
    assert_eq!(socket, r.a.data_dir.join("instances").join(id).join("vmm").join(hv.socket_name()));
    let pid = r.vmm(&inst);
    assert_eq!(ns_pid(pid), inst["vmm"]["pid"].as_i64().map(|p| p as i32), "the recorded pid is the VMM");
    assert_eq!(inst["vmm"]["liveness"], "alive");
    // Under its instance's own id, in its own view: its VMM directory is there, the agent's
    // record beside it is not.
    assert_eq!(uid_of(pid).map(u64::from), inst["vmm_id"].as_u64(), "the VMM runs under its instance's id");
    let inside = |p: &std::path::Path| PathBuf::from(format!("/proc/{pid}/root")).join(p.strip_prefix("/").unwrap());
    let dir = r.a.data_dir.join("instances").join(id);
    assert!(inside(&dir.join("vmm")).is_dir(), "the VMM sees its directory");
    assert!(!inside(&dir.join("instance.json")).exists(), "the VMM does not see the agent's record");
    r.wait_console(&inst);

    let ps = r.a.cli(&["ps"]);
    let text = String::from_utf8_lossy(&ps.stdout);
    let header = text.lines().next().unwrap_or_default();
    assert!(header.contains("HYPERVISOR"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("vm ") && l.contains(hv.name())), "{text}");
    let show = r.a.cli(&["-o", "json", "show", "vm"]);
    let shown: Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(shown["hypervisor"], hv.name());
    // What the VMM itself says (QMP query-status; vm.info), in instance.get only.
    let state = if hv == Hv::Qemu { "running" } else { "Running" };
    assert_eq!(shown["vmm"]["vm_state"], state, "{shown}");
    let listed = r.a.ok("instance.list", json!({}));
    assert!(listed["instances"][0]["vmm"].get("vm_state").is_none(), "lists do not ask the VMMs: {listed}");

    if let Some(ch) = r.ch.as_ref().filter(|c| !c.real) {
        // Exactly what the driver sent: memory in bytes, the instance id as SMBIOS UUID (the
        // test server refuses unknown fields).
        let creates: Vec<Value> =
            ch.requests().into_iter().filter(|q| q["path"].as_str().unwrap_or("").ends_with("vm.create")).collect();
        assert_eq!(creates.len(), 1, "{creates:?}");
        let cfg = &creates[0]["body"];
        assert_eq!(cfg["memory"]["size"], inst["memory_mib"].as_u64().unwrap() * 1024 * 1024);
        assert_eq!(cfg["cpus"]["boot_vcpus"], inst["vcpus"]);
        assert_eq!(cfg["platform"]["system_uuid"], id);
        // The serial port on a socket the agent relays (into the log, and to the console).
        let serial = r.a.data_dir.join("instances").join(id).join("vmm/serial.sock");
        assert_eq!(cfg["serial"], json!({"mode": "Socket", "socket": serial}));
        let console = r.a.data_dir.join("instances").join(id).join("console.sock");
        assert_eq!(inst["console_socket"], console.display().to_string());
        assert_eq!(cfg["console"], json!({"mode": "Off"}));
        assert!(cfg["payload"]["kernel"].as_str().unwrap().ends_with("vmlinuz"), "{cfg}");
    }
}

fn a_graceful_stop_then_start_then_delete(hv: Hv) {
    let Some(r) = rig(hv, &[]) else { return };
    let inst = r.create("vm");
    let id = inst["id"].as_str().unwrap().to_string();
    let pid = r.vmm(&inst);
    r.wait_console(&inst);

    let stopped = r.a.ok("instance.stop", json!({"ref": "vm"}));

    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert!(gone(pid), "the VMM exited");
    let log = r.a.log();
    assert!(!log.contains("sending SIGTERM"), "a graceful stop needed no signal:\n{}", tail(&log, 20));
    match hv {
        // The guest powered off on the button.
        Hv::Qemu | Hv::ChFake => assert!(!log.contains("asking the VMM to exit"), "{}", tail(&log, 20)),
        // The button does nothing here: after the stop timeout, vmm.shutdown.
        Hv::ChReal => {
            assert!(log.contains("the guest did not power off in time; asking the VMM to exit"), "{}", tail(&log, 20))
        }
    }

    let started = r.a.ok("instance.start", json!({"ref": "vm"}));
    assert_eq!(started["state"], "running");
    assert_eq!(started["hypervisor"], hv.name());
    let pid2 = r.vmm(&started);
    assert_ne!(pid2, pid);
    r.wait_console(&started);

    assert_eq!(r.a.ok("instance.delete", json!({"ref": "vm"}))["deleted"], true);
    assert!(gone(pid2));
    assert!(vmm_of(&id).is_empty());
    assert!(!r.a.data_dir.join("instances").join(&id).exists(), "the instance directory is removed");
}

fn a_forced_stop_goes_through_the_sigterm_first_kill_path(hv: Hv) {
    let Some(r) = rig(hv, &[]) else { return };
    let inst = r.create("vm");
    let pid = r.vmm(&inst);

    let stopped = r.a.ok("instance.stop", json!({"ref": "vm", "force": true}));

    assert_eq!(stopped["state"], "stopped");
    assert!(gone(pid));
    let m = r.a.metrics();
    assert_eq!(metric0(&m, "gpuvisor_vmm_kill_escalations_total", &[("signal", "SIGKILL")]), 0.0, "SIGTERM sufficed");
    assert!(!r.a.log().contains("power button"), "a forced stop presses no button");
}

fn a_crashed_vmm_is_found_dead_and_logged_once(hv: Hv) {
    let Some(r) = rig(hv, &[]) else { return };
    let inst = r.create("vm");
    let id = inst["id"].as_str().unwrap().to_string();
    let pid = r.vmm(&inst);

    sigkill(pid);
    assert!(gone(pid));
    // The exit watcher records the death at once; a pass that comes first records it too
    // (whichever is first, the other finds it stopped).
    let rep = r.a.pass();
    let by_pass =
        rep["records"].as_array().unwrap().iter().any(|x| x["instance"] == id.as_str() && x["to"] == "stopped");
    wait_for(Duration::from_secs(30), || (by_pass || r.get("vm")["state"] == "stopped").then_some(()))
        .expect("the death is recorded");
    let got = r.get("vm");
    assert_eq!(got["state"], "stopped");
    assert!(got["last_error"].as_str().unwrap_or("").contains("exited"), "{got}");
    let dead: Vec<String> = r.a.log().lines().filter(|l| l.contains("VM found dead")).map(String::from).collect();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].contains(" WARN ") && dead[0].contains(&id), "{}", dead[0]);
}

fn an_agent_crash_between_spawn_and_identity_capture_finds_the_live_vmm(hv: Hv) {
    assert_failpoints_built();
    let Some(mut r) = rig(hv, &[]) else { return };
    r.a.restart_with_failpoints(Some("after_spawn=return")).unwrap();
    r.a.wait_ready().unwrap();
    let answer = r.a.call("instance.create", json!({"name": "vm", "image": "demo", "hypervisor": hv.name()}));
    assert!(answer.as_ref().is_err_and(is_transport), "the agent aborted inside the create: {answer:?}");
    let records = r.a.instance_records();
    assert_eq!(records.len(), 1);
    let id = records[0].0.clone();
    let rec = r.a.record(&id);
    assert_eq!(rec["state"], "starting");
    assert!(rec["vmm"].is_null(), "no identity was stored: {rec}");
    let pids = vmm_of(&id);
    assert_eq!(pids.len(), 1, "the VMM outlived the agent");

    r.a.restart_clean();
    r.a.pass();

    let got = r.get("vm");
    assert_eq!(got["state"], "running", "{got}");
    assert_eq!(ns_pid(pids[0]), got["vmm"]["pid"].as_i64().map(|p| p as i32), "the live VMM is recorded: {got}");
    assert!(got["vmm"]["control_socket"].as_str().unwrap().ends_with(hv.socket_name()));
    assert_eq!(r.a.ok("instance.stop", json!({"ref": "vm", "force": true}))["state"], "stopped");
    assert!(gone(pids[0]));
}

fn the_reconciler_leaves_a_live_vmm_running(hv: Hv) {
    let Some(r) = rig(hv, &[]) else { return };
    let inst = r.create("vm");
    let pid = r.vmm(&inst);

    let rep = r.a.pass();

    assert!(rep["records"].as_array().unwrap().is_empty(), "{rep}");
    let got = r.get("vm");
    assert_eq!(got["state"], "running");
    assert_eq!(got["vmm"]["pid"], inst["vmm"]["pid"]);
    assert!(alive(pid));
}

fn a_recycled_pid_is_never_signalled(hv: Hv) {
    let Some(r) = rig(hv, &[]) else { return };
    let inst = r.create("vm");
    let id = inst["id"].as_str().unwrap().to_string();
    let pid = r.vmm(&inst);
    // The recorded pid now names an unrelated process (same boot, another start time).
    let (_sleeper, line) = r.a.ns_sh("echo $$; exec sleep 3099");
    let nspid: i32 = line.parse().unwrap();
    let sleep_root =
        wait_for(Duration::from_secs(5), || root_pid_of(nspid, |c| c.contains("sleep 3099"))).expect("the sleep");
    let mut rec = r.a.record(&id);
    rec["vmm"]["identity"]["pid"] = json!(nspid);
    r.a.write_record(&id, &rec);

    let stopped = r.a.ok("instance.stop", json!({"ref": "vm", "force": true}));

    assert_eq!(stopped["state"], "stopped", "{stopped}");
    assert!(gone(pid), "the control socket's owner, the real VMM, was stopped");
    assert!(alive(sleep_root), "the recycled pid received no signal");
}

/// Issue 22 part 5: `instance.reset` is the reset button (QMP `system_reset`; `vm.reboot`):
/// the same VMM process, and the guest boots again; `instance.reboot` is a stop and a
/// start: a new VMM, booted. Neither applies to a stopped instance.
fn a_reset_starts_the_guest_over_in_the_same_vmm_and_a_reboot_in_a_new_one(hv: Hv) {
    let Some(r) = rig(hv, &[]) else { return };
    let inst = r.create("vm");
    let pid = r.vmm(&inst);
    r.wait_console(&inst);
    let boots = |v: &Value| serial_text(v).matches("gpuvisor-guest: ready").count();

    let reset = r.a.ok("instance.reset", json!({"ref": "vm"}));

    assert_eq!(reset["state"], "running", "{reset}");
    assert_eq!(r.vmm(&inst), pid, "the same VMM");
    if hv.has_console() {
        wait_for(Duration::from_secs(120), || (boots(&inst) >= 2).then_some(()))
            .unwrap_or_else(|| panic!("the guest booted again after the reset:\n{}", tail(&serial_text(&inst), 10)));
    }
    assert!(r.a.log().contains("VM reset in place"));

    let out = r.a.cli(&["reboot", "vm", "--force"]);
    assert!(out.status.success(), "{out:?}");
    let after = r.get("vm");
    assert_eq!(after["state"], "running", "{after}");
    assert!(gone(pid), "the old VMM is gone");
    assert_ne!(r.vmm(&after), pid, "a new VMM");
    if hv.has_console() {
        wait_for(Duration::from_secs(120), || (boots(&inst) >= 3).then_some(()))
            .unwrap_or_else(|| panic!("the guest booted in the new VMM:\n{}", tail(&serial_text(&inst), 10)));
    }

    r.a.ok("instance.stop", json!({"ref": "vm", "force": true}));
    for m in ["instance.reset", "instance.reboot"] {
        let e = r.a.err(m, json!({"ref": "vm"}));
        assert_eq!(e.data_code, "invalid_state", "{m}: {e}");
    }
}
