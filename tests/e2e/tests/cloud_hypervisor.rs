//! Cloud Hypervisor beyond the shared lifecycle suite (`hypervisors.rs`): which instances
//! it may carry and who chooses it, whether it is available, and what happens when its
//! API refuses, hangs or its process dies during a start — against the test server
//! (`tests/ch-fake`), which can be told to do each of those.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

fn agent_with(
    ch: &ChWrapper,
    model: &str,
    hypervisor_plugin: Option<std::path::PathBuf>,
    set: &[(&str, &str)],
) -> Agent {
    let (k, v) = ch.setting();
    let mut all = vec![(k, v.as_str()), ("reconcile_interval_s", "3600")];
    all.extend_from_slice(set);
    Agent::start_tuned(AgentOptions { model, hypervisor: hypervisor_plugin, ..Default::default() }, None, &all).unwrap()
}

fn agent(ch: &ChWrapper, set: &[(&str, &str)]) -> Agent {
    agent_with(ch, "l40s-2x16", None, set)
}

fn plain_ch(name: &str) -> Value {
    json!({"name": name, "image": "demo", "hypervisor": "cloud-hypervisor"})
}

fn not_found(a: &Agent, name: &str) -> bool {
    a.call("instance.get", json!({"ref": name})).err().is_some_and(|e| e.data_code == "not_found")
}

/// Every VMM process of any instance of this agent.
fn vmms(a: &Agent) -> Vec<i32> {
    let dir = a.data_dir.join("instances");
    pids_where(|c| c.contains(dir.to_str().unwrap()) && c.contains("cloud-hypervisor"))
}

// ================================================================ selection and capability

#[test]
fn a_vgpu_instance_that_asks_for_cloud_hypervisor_is_refused_before_anything_is_claimed() {
    let ch = ChWrapper::fake();
    for (model, profile, issue) in
        [("l40s-2x16", "L40S-2Q", "cloud-hypervisor#7572"), ("l40s-mdev", "L40S-2Q", "cloud-hypervisor#5319")]
    {
        let a = agent_with(&ch, model, None, &[]);
        let before = a.sim_writes().len();

        let e = a.err(
            "instance.create",
            json!({"name": "g", "image": "demo", "gpu": profile, "hypervisor": "cloud-hypervisor"}),
        );

        assert_eq!(e.data_code, "hypervisor_unsupported", "{e}");
        assert!(e.message.contains(issue) && e.message.contains("cloud-hypervisor#5319"), "{model}: {}", e.message);
        assert!(a.claims().is_empty(), "nothing claimed");
        assert_eq!(a.sim_writes().len(), before, "nothing written");
        assert!(not_found(&a, "g") && a.instance_records().is_empty(), "no record");
        let started: Vec<Value> =
            ch.requests().into_iter().filter(|r| !r["socket"].as_str().unwrap_or("").contains("ch-probe")).collect();
        assert!(started.is_empty(), "no VMM was started (only the start-up probe ran): {started:?}");
        // The same GPU instance without the request runs on QEMU.
        let g = a.ok("instance.create", json!({"name": "g", "image": "demo", "gpu": profile}));
        assert_eq!(g["hypervisor"], "qemu");
        a.ok("instance.delete", json!({"ref": "g"}));
    }
}

#[test]
fn the_example_site_plugin_puts_plain_instances_on_cloud_hypervisor_and_gpu_instances_on_qemu() {
    let ch = ChWrapper::fake();
    let a = agent_with(&ch, "l40s-2x16", Some(plugin("hypervisor-ch-plain")), &[]);

    let plain = a.ok("instance.create", json!({"name": "p", "image": "demo"}));
    let asked_qemu = a.ok("instance.create", json!({"name": "q", "image": "demo", "hypervisor": "qemu"}));
    let gpu = a.ok("instance.create", json!({"name": "g", "image": "demo", "gpu": "L40S-2Q"}));

    assert_eq!(plain["hypervisor"], "cloud-hypervisor", "{plain}");
    assert_eq!(asked_qemu["hypervisor"], "cloud-hypervisor", "site policy overrides a plain request: {asked_qemu}");
    assert_eq!(gpu["hypervisor"], "qemu", "{gpu}");
    assert_eq!(gpu["state"], "running");
    let ps = String::from_utf8_lossy(&a.cli(&["ps"]).stdout).into_owned();
    for (name, hv) in [("p", "cloud-hypervisor"), ("q", "cloud-hypervisor"), ("g", "qemu")] {
        assert!(ps.lines().any(|l| l.starts_with(&format!("{name} ")) && l.contains(hv)), "{ps}");
    }
    for n in ["p", "q", "g"] {
        a.ok("instance.delete", json!({"ref": n}));
    }
}

#[test]
fn availability_comes_from_running_the_binary() {
    // Nothing at the configured path: unavailable, and said why; a request for it is
    // refused by hypervisor-default's fallback... to QEMU for a plain instance.
    let missing = ChWrapper::fake();
    std::fs::remove_file(&missing.binary).unwrap();
    let a = agent(&missing, &[]);
    let h = a.ok("agent.health", json!({}));
    let ch = h["hypervisors"].as_array().unwrap().iter().find(|x| x["name"] == "cloud-hypervisor").unwrap().clone();
    assert_eq!(ch["available"], false, "{h}");
    assert!(ch["problem"].as_str().unwrap().contains("cannot be run"), "{ch}");
    let qemu = h["hypervisors"].as_array().unwrap().iter().find(|x| x["name"] == "qemu").unwrap().clone();
    assert_eq!(qemu["available"], true, "{qemu}");
    assert!(qemu["version"].as_str().unwrap().contains("QEMU"), "{qemu}");
    let p = a.ok("instance.create", plain_ch("p"));
    assert_eq!(p["hypervisor"], "qemu", "hypervisor-default falls back when the request cannot run here");
    a.ok("instance.delete", json!({"ref": "p"}));

    // A binary that exits at once: unavailable (it never answered vmm.ping).
    let broken = ChWrapper::fake();
    std::fs::write(&broken.binary, "#!/bin/sh\necho 'no KVM here' >&2\nexit 3\n").unwrap();
    let b = agent(&broken, &[]);
    let h = b.ok("agent.health", json!({}));
    let ch = h["hypervisors"].as_array().unwrap().iter().find(|x| x["name"] == "cloud-hypervisor").unwrap().clone();
    assert_eq!(ch["available"], false);
    assert!(ch["problem"].as_str().unwrap().contains("no KVM here"), "{ch}");

    // The test server answers vmm.ping: available, with its version.
    let fake = ChWrapper::fake();
    let c = agent(&fake, &[]);
    let h = c.ok("agent.health", json!({}));
    let ch = h["hypervisors"].as_array().unwrap().iter().find(|x| x["name"] == "cloud-hypervisor").unwrap().clone();
    assert_eq!(ch["available"], true, "{ch}");
    assert!(ch["version"].as_str().unwrap().starts_with("cloud-hypervisor 53."), "{ch}");
    // Under the harness's vfio_attach = "hold-fd" it cannot be handed a device, and it
    // saves no VM state in this version (snapshots and standby are QEMU's).
    assert_eq!(ch["capabilities"], json!([]));
    // The probe's throw-away VMM is gone.
    assert!(fake.requests().iter().any(|r| r["path"].as_str().unwrap_or("").ends_with("vmm.shutdown")));
}

// ================================================================ failures of the API

/// A create whose start fails at `endpoint` answering `status` with `errors`: the error
/// carries the array verbatim, the VMM is stopped, nothing is left.
fn assert_refused_create(a: &Agent, ch: &ChWrapper, endpoint: &str, status: u16, errors: &[&str]) {
    ch.control(json!({"fail": {endpoint: {"status": status, "errors": errors}}}));
    let e = a.err("instance.create", plain_ch("x"));
    assert_eq!(e.data_code, "vmm_start_failed", "{e}");
    assert_eq!(e.data["vmm_api"]["request"], format!("PUT {endpoint}"), "{}", e.data);
    assert_eq!(e.data["vmm_api"]["status"], status);
    assert_eq!(e.data["vmm_api"]["errors"], json!(errors));
    let verbatim = serde_json::to_string(errors).unwrap();
    assert!(e.message.contains(&verbatim), "the message carries the array verbatim: {}", e.message);
    assert!(not_found(a, "x"), "the create was rolled back");
    assert!(
        wait_for(Duration::from_secs(15), || vmms(a).is_empty().then_some(())).is_some(),
        "the refused VMM was stopped: {:?}",
        vmms(a)
    );
    ch.control(json!({}));
}

#[test]
fn refusals_of_create_and_boot_surface_verbatim_and_roll_back() {
    let ch = ChWrapper::fake();
    let a = agent(&ch, &[]);
    assert_refused_create(&a, &ch, "vm.create", 400, &["Failed to deserialize JSON", "missing field `x`"]);
    assert_refused_create(&a, &ch, "vm.boot", 404, &["Error from API", "The VM could not boot", "VM is not created"]);
    assert_refused_create(
        &a,
        &ch,
        "vm.boot",
        500,
        &["Error from API", "The VM could not boot", "Cannot open kernel file"],
    );
    // A VM that exists and fails to boot on start: the start fails with the same shape and
    // the instance keeps the error, verbatim, as its last_error.
    let x = a.ok("instance.create", plain_ch("x"));
    assert_eq!(x["state"], "running");
    a.ok("instance.stop", json!({"ref": "x", "force": true}));
    let errors = ["Error from API", "The VM could not boot", "Memory manager error"];
    ch.control(json!({"fail": {"vm.boot": {"status": 500, "errors": errors}}}));
    let e = a.err("instance.start", json!({"ref": "x"}));
    assert_eq!(e.data_code, "vmm_start_failed");
    assert_eq!(e.data["vmm_api"]["errors"], json!(errors));
    let got = a.ok("instance.get", json!({"ref": "x"}));
    assert_eq!(got["state"], "stopped");
    assert!(got["last_error"].as_str().unwrap().contains(&serde_json::to_string(&errors).unwrap()), "{got}");
    assert!(wait_for(Duration::from_secs(15), || vmms(&a).is_empty().then_some(())).is_some());
    // One ERROR/WARN line for each failed operation, with the instance.
    let failed = a.log().lines().filter(|l| l.contains("operation failed") && l.contains("vmm_start_failed")).count();
    assert_eq!(failed, 4, "{}", tail(&a.log(), 30));
}

#[test]
fn a_vmm_that_hangs_past_the_timeout_is_killed_and_the_create_fails_clearly() {
    let ch = ChWrapper::fake();
    let a = agent(&ch, &[("vmm_ready_timeout_s", "2")]);
    ch.control(json!({"hang": ["vm.boot"]}));

    let e = a.err("instance.create", plain_ch("h"));

    assert_eq!(e.data_code, "vmm_start_failed", "{e}");
    assert!(
        e.message.contains("did not answer PUT vm.boot") && e.message.contains("no answer within 2000 ms"),
        "{}",
        e.message
    );
    assert_eq!(e.data["vmm_api"]["status"], Value::Null);
    assert!(not_found(&a, "h"));
    assert!(wait_for(Duration::from_secs(15), || vmms(&a).is_empty().then_some(())).is_some(), "{:?}", vmms(&a));
}

#[test]
fn a_vmm_that_dies_during_start_fails_the_create_with_its_exit_status() {
    let ch = ChWrapper::fake();
    let a = agent(&ch, &[]);
    ch.control(json!({"exit_on": ["vm.boot"]}));

    let e = a.err("instance.create", plain_ch("d"));

    assert_eq!(e.data_code, "vmm_start_failed", "{e}");
    assert!(e.message.contains("PUT vm.boot"), "{}", e.message);
    assert!(not_found(&a, "d"));
    assert!(vmms(&a).is_empty());
}

#[test]
fn a_guest_that_ignores_the_power_button_is_asked_to_exit_and_one_that_ignores_sigterm_gets_sigkill() {
    let ch = ChWrapper::fake();
    let a = agent(&ch, &[("stop_timeout_s", "1")]);
    let i = a.ok("instance.create", plain_ch("i"));
    let id = i["id"].as_str().unwrap().to_string();
    ch.control(json!({"ignore_power_button": true}));
    assert_eq!(a.ok("instance.stop", json!({"ref": "i"}))["state"], "stopped");
    assert!(a.log().contains("the guest did not power off in time; asking the VMM to exit"));
    assert!(vmm_of(&id).is_empty());
    let shutdowns = ch.requests().iter().filter(|r| r["path"].as_str().unwrap_or("").ends_with("vmm.shutdown")).count();
    assert!(shutdowns >= 2, "the probe's and this stop's vmm.shutdown");

    // SIGTERM ignored (a wedged VMM): the kill path escalates.
    a.ok("instance.start", json!({"ref": "i"}));
    ch.control(json!({"ignore_sigterm": true}));
    let pid = vmm_of(&id)[0];
    assert_eq!(a.ok("instance.stop", json!({"ref": "i", "force": true}))["state"], "stopped");
    assert!(wait_reaped(pid) || !alive(pid));
    assert_eq!(metric0(&a.metrics(), "gpuvisor_vmm_kill_escalations_total", &[("signal", "SIGKILL")]), 1.0);
}

/// Snapshots and standby save QEMU VMs only in this version: a Cloud Hypervisor VM refuses
/// them (`hypervisor_unsupported`, naming the reason), runs on, and its API never sees a
/// pause; a stopped one without a disk has nothing to snapshot.
#[test]
fn a_cloud_hypervisor_vm_refuses_standby_and_a_running_snapshot() {
    let ch = ChWrapper::fake();
    let a = agent(&ch, &[]);
    a.ok("instance.create", plain_ch("s"));
    for m in ["instance.standby", "instance.snapshot"] {
        let e = a.err(m, json!({"ref": "s"}));
        assert_eq!((e.code, e.data_code.as_str()), (400, "hypervisor_unsupported"), "{m}: {e}");
        assert!(e.message.contains("snapshots and standby are QEMU's"), "{m}: {e}");
    }
    assert_eq!(a.ok("instance.get", json!({"ref": "s"}))["state"], "running");
    assert!(!ch.requests().iter().any(|r| r["path"].as_str().unwrap_or("").contains("vm.pause")));
    a.ok("instance.stop", json!({"ref": "s", "force": true}));
    let e = a.err("instance.snapshot", json!({"ref": "s"}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
}

/// `instance.stop {timeout_s}` bounds this stop's wait for the guest's power-off, whatever
/// the agent's `stop_timeout_s` (here 600 s: a stop that ignored the parameter would not
/// answer within the test's RPC timeout); out of range is refused.
#[test]
fn a_stop_waits_for_the_power_off_as_long_as_it_asks() {
    let ch = ChWrapper::fake();
    let a = agent(&ch, &[("stop_timeout_s", "600")]);
    a.ok("instance.create", plain_ch("t"));
    for bad in [0, 3601] {
        let e = a.err("instance.stop", json!({"ref": "t", "timeout_s": bad}));
        assert_eq!(e.data_code, "invalid_request", "{e}");
    }
    ch.control(json!({"ignore_power_button": true}));
    assert_eq!(a.ok("instance.stop", json!({"ref": "t", "timeout_s": 1}))["state"], "stopped");
    let log = a.log();
    assert!(
        log.lines().any(|l| l.contains("did not power off in time")
            && l.split_whitespace().any(|w| w.trim_matches('"') == "stop_timeout_s=1")),
        "the wait was the stop's own:\n{}",
        tail(&log, 20)
    );
    let out = a.cli(&["stop", "t", "--timeout", "5", "--force"]);
    assert!(!out.status.success(), "--timeout and --force conflict");
}
