//! End to end: identities and PID namespaces (issue "one release path", finding 2), and the
//! logs as an interface (finding 7).
//!
//! A pid, a start time and a boot id mean nothing in another PID namespace, and an
//! open-handle scan from inside a namespace cannot see the host's processes: an identity
//! recorded in another namespace is *maybe alive* — never signalled, never released on its
//! behalf — and the agent says so (docs/design/lifecycle.md "provably dead"; docs/gpu.md).

use gpuvisor_e2e::*;
use serde_json::json;
use std::time::Duration;

const VF0: &str = "0000:41:00.4";

/// A VM started by an agent in one PID namespace; the agent restarted in another on the
/// same data directory: nothing is signalled, nothing written, the instance is reported
/// maybe alive with a clear message, stop and delete refuse; back in the first namespace
/// everything works again.
#[test]
fn an_agent_in_another_pid_namespace_never_signals_or_releases_the_vm() {
    let mut a = Agent::start(HOST_V).unwrap();
    let inst = a.create_gpu("vm", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    let vf = inst["gpu"]["device"].as_str().unwrap().to_string();
    assert_eq!(vf, VF0);
    let qemu = qemu_of(&id);
    assert_eq!(qemu.len(), 1);
    let recorded_ns = a.record(&id)["vmm"]["identity"]["pid_ns"].as_u64().expect("pid_ns is recorded");

    // The agent restarts in a new PID namespace; the old one (and the VM in it) lives on.
    a.kill_agent();
    let first_ns = std::mem::replace(&mut a.ns, PidNs::new().unwrap());
    let seq = last_seq(&a.state());
    a.spawn().unwrap();
    a.wait_ready().unwrap();

    let rep = a.pass();
    let kept = rep["kept"].to_string();
    assert!(kept.contains("PID namespace"), "the pass keeps the instance, saying why: {rep}");
    assert_eq!(rep["released"], json!([]), "{rep}");
    assert!(rep["records"].as_array().unwrap().is_empty(), "the record is not changed: {rep}");
    let v = a.ok("instance.get", json!({"ref": "vm"}));
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["vmm"]["liveness"], "unknown", "{v}");
    assert_eq!(v["vmm"]["pid_namespace"], recorded_ns, "{v}");
    assert!(v["vmm"]["reason"].as_str().unwrap().contains(&recorded_ns.to_string()), "{v}");
    for (method, params) in
        [("instance.stop", json!({"ref": "vm", "force": true})), ("instance.delete", json!({"ref": "vm"}))]
    {
        let e = a.err(method, params);
        assert_eq!((e.code, e.data_code.as_str()), (503, "vmm_liveness_unknown"), "{method}: {e}");
        assert!(e.message.contains("PID namespace"), "{method}: {e}");
    }
    let h = a.ok("agent.health", json!({}));
    assert_eq!(h["degraded"], true, "{h}");
    assert!(h["problems"].to_string().contains(&id), "{h}");
    assert!(qemu.iter().all(|p| alive(*p)), "the VM got no signal");
    assert!(log_after(&a.state(), seq).iter().all(|e| e["op"] != "write"), "no sysfs write");
    assert_eq!(a.vf_type(&vf), 1148);
    assert_eq!(a.claim(&vf).unwrap()["instance_id"], id.as_str(), "the claim is untouched");
    let warns =
        a.log().lines().filter(|l| l.contains("WARN") && l.contains(&id) && l.contains("cannot be seen")).count();
    assert_eq!(warns, 1, "said once, at start:\n{}", a.log());

    // Back in the namespace the VM was started from, the VM is the agent's again.
    a.kill_agent();
    drop(std::mem::replace(&mut a.ns, first_ns));
    a.spawn().unwrap();
    a.wait_ready().unwrap();
    let v = a.ok("instance.get", json!({"ref": "vm"}));
    assert_eq!(v["vmm"]["liveness"], "alive", "{v}");
    let s = a.ok("instance.stop", json!({"ref": "vm", "force": true}));
    assert_eq!(s["state"], "stopped", "{s}");
    assert_eq!(a.vf_type(&vf), 0);
    assert!(a.claim(&vf).is_none());
}

/// A VM whose record has no recorded identity but whose control socket is held by a
/// process this agent cannot see is maybe alive, not dead: a plain listener in the first
/// namespace at the instance's QMP path keeps a starting record from being torn down.
#[test]
fn a_control_socket_held_from_another_pid_namespace_is_maybe_alive() {
    let mut a = Agent::start(HOST_V).unwrap();
    let inst = a.create_gpu("vm", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    let mut rec = a.record(&id);
    // Forget the identity (a crash between spawn and persisting it).
    rec["vmm"] = serde_json::Value::Null;
    rec["state"] = json!("starting");
    a.kill_agent();
    a.write_record(&id, &rec);
    let _first_ns = std::mem::replace(&mut a.ns, PidNs::new().unwrap());
    let seq = last_seq(&a.state());
    a.spawn().unwrap();
    a.wait_ready().unwrap();
    let rep = a.pass();
    assert!(rep["kept"].to_string().contains("no process visible to this agent"), "{rep}");
    assert_eq!(a.record(&id)["state"], "starting", "not recorded stopped");
    assert!(log_after(&a.state(), seq).iter().all(|e| e["op"] != "write"), "no sysfs write");
    assert!(a.claim(VF0).is_some());
    assert!(qemu_of(&id).iter().all(|p| alive(*p)));
}

/// Logs: a VM found dead is logged once at WARN with its id and name; a failed operation
/// is logged once with the instance's id and name; text logs carry no ANSI colour codes
/// when written to a file and no Rust `Debug` formatting; each plugin load is logged once.
#[test]
fn failures_and_vm_deaths_are_logged_once_with_the_instance_and_in_plain_text() {
    let a = Agent::start(HOST_V).unwrap();
    let inst = a.create_gpu("vm", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    for p in qemu_of(&id) {
        sigkill(p);
        assert!(wait_reaped(p) || !alive(p));
    }
    // Recorded by the exit watcher at once, or by a pass (whichever comes first).
    wait_for(Duration::from_secs(30), || {
        let rep = a.pass();
        let by_pass = rep["records"].as_array().unwrap().iter().any(|r| r["instance"] == id.as_str());
        (by_pass || a.ok("instance.get", json!({"ref": "vm"}))["state"] == "stopped").then_some(())
    })
    .expect("the dead VM is recorded");
    let e = a.err("instance.create", json!({"name": "vm", "image": "demo"}));
    assert_eq!(e.data_code, "name_taken");
    let e = a.err("instance.start", json!({"ref": "nope"}));
    assert_eq!(e.data_code, "not_found");

    let log = a.log();
    let dead: Vec<&str> = log.lines().filter(|l| l.contains("VM found dead")).collect();
    assert_eq!(dead.len(), 1, "one line for the death: {dead:?}");
    assert!(dead[0].contains(" WARN ") && dead[0].contains(&id) && dead[0].contains("instance.name=vm"), "{}", dead[0]);
    let taken: Vec<&str> = log.lines().filter(|l| l.contains("operation failed") && l.contains("name_taken")).collect();
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert!(taken[0].contains(" WARN ") && taken[0].contains("instance.name=vm"), "{}", taken[0]);
    assert!(log.lines().any(|l| l.contains("operation failed") && l.contains("not_found") && l.contains("nope")));
    assert!(!log.contains('\u{1b}'), "no ANSI escape codes in a log file");
    assert!(!log.contains("Some(") && !log.contains("None,"), "no Debug formatting in fields:\n{log}");
    let quoted: Vec<&str> = log.lines().filter(|l| has_quoted_field(l)).collect();
    assert!(quoted.is_empty(), "no field printed as a quoted (Debug) string: {quoted:#?}");
    let loads = log.lines().filter(|l| l.contains("plugin loaded")).count();
    assert_eq!(loads, 3, "each of the three plugins is logged once:\n{log}");
    assert!(log.lines().next().unwrap_or("").contains("failpoint build"), "the first line says what build this is");
}

/// `true` when a text log line has a field whose value is printed with `Debug` quotes
/// (` key="value"`): string fields are logged with `%`, as plain text.
fn has_quoted_field(line: &str) -> bool {
    line.match_indices("=\"").any(|(i, _)| {
        let key: String =
            line[..i].chars().rev().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '.').collect();
        !key.is_empty() && line[..i - key.len()].ends_with(' ')
    })
}

#[test]
fn a_quoted_field_is_told_from_a_plain_one() {
    assert!(has_quoted_field(r#"2026 WARN x: operation failed op="create" code=internal"#));
    assert!(!has_quoted_field("2026 WARN x: operation failed op=create error=name \"vm\" is taken"));
}

/// A start-up error is reported once (stderr is the log), naming the problem.
#[test]
fn a_start_up_error_is_logged_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("gpuvisor.toml");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = {:?}\nsocket = {:?}\n[plugins.placement]\npath = \"/nonexistent/p.wasm\"\n",
            dir.path().join("data"),
            dir.path().join("s.sock")
        ),
    )
    .unwrap();
    let (status, out) = serve_expecting_exit(&cfg, Duration::from_secs(60)).unwrap();
    assert!(!status.success());
    assert_eq!(out.matches("/nonexistent/p.wasm").count(), 1, "said once:\n{out}");
}

/// `--version` says when the binary is a failpoint build (the tests' build is one).
#[test]
fn a_failpoint_build_says_so_in_its_version() {
    let out = std::process::Command::new(agent_binary()).arg("--version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("failpoint build"), "{text}");
}
