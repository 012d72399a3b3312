//! End to end: the JSON-RPC surface — discovery, standard JSON-RPC errors, the lifecycle's
//! error classes and `data.code`s (docs/design/lifecycle.md "Errors"), the socket's mode and metrics.
//! Every refused request must leave nothing behind: no claim, no sysfs write, no instance.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

/// One small L40S (4 VFs) with a short teardown lag.
const ONE_GPU: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";

/// The method names of the table (`agent/src/rpc/api.rs`'s `api! { … }`), read from the
/// agent's source: each `name:` and the subscription's `unsubscribe:`.
fn methods_in_source() -> BTreeSet<String> {
    let src = std::fs::read_to_string(repo_root().join("agent/src/rpc/api.rs")).unwrap();
    let body = &src[src.rfind("\napi! {").expect("the table in api.rs")..];
    let names = |sep: &str| body.split(sep).skip(1).map(|s| s[..s.find('"').unwrap()].to_string()).collect::<Vec<_>>();
    names("name: \"").into_iter().chain(names("unsubscribe: \"")).collect()
}

/// Asserts the error is class `class` with `data.code == code` and one clear message.
fn assert_api_error(e: &RpcError, class: i64, code: &str) {
    assert_eq!((e.code, e.data_code.as_str()), (class, code), "{e} data={}", e.data);
    assert_eq!(e.data["code"], code, "data.code: {}", e.data);
    assert!(!e.message.trim().is_empty() && !e.message.contains('\n'), "one clear sentence: {:?}", e.message);
}

/// Asserts nothing is held: no claim, no instance, no record.
fn assert_nothing_left(a: &Agent) {
    assert!(a.claims().is_empty(), "no claim: {:?}", a.claims());
    assert!(a.instance_names().is_empty(), "no instance: {:?}", a.instance_names());
    assert!(a.data_files("instances").is_empty(), "no instance record: {:?}", a.data_files("instances"));
    assert!(a.qemu_pids().is_empty(), "no QEMU");
}

#[test]
fn rpc_discover_lists_exactly_the_declared_methods_and_every_one_is_registered() {
    let a = Agent::start(ONE_GPU).unwrap();
    let doc = a.ok("rpc.discover", json!({}));
    assert!(doc["openrpc"].is_string(), "{doc}");
    let listed: BTreeSet<String> =
        doc["methods"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap().to_string()).collect();
    let mut declared = methods_in_source();
    assert!(declared.len() >= 17, "parsed methods(): {declared:?}");
    // The debug.* methods exist only in failpoint builds.
    if !listed.contains("debug.failpoints") {
        declared.retain(|m| !m.starts_with("debug."));
    }
    assert_eq!(listed, declared, "rpc.discover lists the table of rpc/api.rs");

    // Every listed method is served (a call may fail on its params, never as unknown).
    for m in &listed {
        if let Err(e) = a.call(m, json!({})) {
            assert_ne!(e.code, -32601, "{m} is listed but not registered: {e}");
            assert_ne!(e.code, 0, "{m}: transport failure: {e}");
        }
    }
    // Every documented error carries its docs/design/lifecycle.md class and data.code.
    for m in doc["methods"].as_array().unwrap() {
        for err in m["errors"].as_array().unwrap() {
            let code = err["data"]["code"].as_str().unwrap();
            let class = match code {
                "invalid_request" | "unknown_profile" | "hypervisor_unsupported" => 400,
                "not_found" => 404,
                "name_taken"
                | "invalid_state"
                | "no_capacity"
                | "instance_cleanup_pending"
                | "unsupported_with_gpu"
                | "gpu_release_pending"
                | "device_unhealthy"
                | "iommu_group_conflict"
                | "gpu_busy"
                // Beyond docs/design/lifecycle.md's table (docs/api.md "Errors"): image.delete of an image
                // that instances use.
                | "image_in_use"
                // claim.prepare/claim.release of another owner's device, or of a held one.
                | "device_taken"
                | "in_use" => 409,
                "vgpu_cleanup_pending"
                | "vmm_start_failed"
                | "vmm_kill_failed"
                | "passthrough_bind_failed"
                | "policy_failed"
                | "internal" => 500,
                "not_ready" | "vmm_liveness_unknown" => 503,
                other => panic!("{} documents an error code not in docs/design/lifecycle.md: {other}", m["name"]),
            };
            assert_eq!(err["code"], class, "{}: {err}", m["name"]);
        }
    }
    // Nothing was created by probing every method.
    assert_nothing_left(&a);
}

#[test]
fn reconcile_run_is_served_and_returns_a_pass_report() {
    // docs/design/lifecycle.md Reconciler: "`reconcile.run` and `gpuvisor reconcile` run one pass now and
    // return its report."
    let a = Agent::start(ONE_GPU).unwrap();
    let report = a.call("reconcile.run", json!({}));
    match report {
        Ok(v) => assert!(v.is_object(), "a pass report: {v}"),
        Err(e) => panic!("reconcile.run is not served: {e}"),
    }
}

#[test]
fn protocol_errors_use_the_standard_jsonrpc_codes() {
    let a = Agent::start(ONE_GPU).unwrap();

    // Unknown method → -32601.
    let e = a.err("instance.explode", json!({}));
    assert_eq!(e.code, -32601, "{e}");

    // Malformed JSON → -32700.
    let v = rpc_raw(&a.socket, "{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": ").unwrap();
    assert_eq!(v["error"]["code"], -32700, "{v}");

    // Wrong parameter types and unknown fields → -32602.
    for (method, params) in [
        ("instance.create", json!({"name": 5, "image": "demo"})),
        ("instance.create", json!({"name": "a", "image": "demo", "vcpus": "two"})),
        ("instance.create", json!({"name": "a", "image": "demo", "gpus": "L40S-2Q"})),
        ("instance.create", json!({"image": "demo"})),
        ("instance.get", json!({"ref": "a", "bogus": true})),
        ("instance.get", json!({"ref": 7})),
        ("instance.stop", json!({"ref": "a", "force": "yes"})),
        ("placement.dry_run", json!({"profile": "L40S-2Q", "count": 2})),
        ("image.delete", json!({"name": ["demo"]})),
    ] {
        let e = a.err(method, params.clone());
        assert_eq!(e.code, -32602, "{method} {params}: {e}");
    }
    assert_nothing_left(&a);
    assert!(a.sim_writes().is_empty(), "{:?}", a.sim_writes());
    assert_eq!(a.ok("image.list", json!({}))["images"].as_array().unwrap().len(), 1, "demo still there");
}

#[test]
fn invalid_names_and_unknown_images_are_400_invalid_request_and_leave_nothing() {
    let a = Agent::start(ONE_GPU).unwrap();
    let long = "a".repeat(64);
    for name in ["Upper", "-lead", "", "under_score", "sp ace", "dot.ted", long.as_str()] {
        let e = a.err("instance.create", json!({"name": name, "image": "demo", "gpu": "L40S-2Q"}));
        assert_api_error(&e, 400, "invalid_request");
    }
    // Regression: a UUID-shaped name could equal another instance's id, and a ref is looked
    // up as an id first, so `delete <that name>` deleted the other instance.
    for name in ["6a7d6a8c-1111-4c1b-a0c4-6f0d0e9b7b02", "6a7d6a8c11114c1ba0c46f0d0e9b7b02"] {
        let e = a.err("instance.create", json!({"name": name, "image": "demo"}));
        assert_api_error(&e, 400, "invalid_request");
        assert!(e.message.contains("not a UUID"), "{e}");
    }
    // Labels are bounded (every policy input carries them).
    let labels: serde_json::Map<String, Value> = (0..65).map(|i| (format!("k{i}"), json!("v"))).collect();
    let e = a.err("instance.create", json!({"name": "l", "image": "demo", "labels": labels}));
    assert_api_error(&e, 400, "invalid_request");
    let ok63 = "a".repeat(63);
    for image in ["nope", "../demo", "/etc"] {
        let e = a.err("instance.create", json!({"name": ok63, "image": image, "gpu": "L40S-2Q"}));
        assert_api_error(&e, 400, "invalid_request");
    }
    assert_nothing_left(&a);
    assert!(a.sim_writes().is_empty(), "no sysfs write: {:?}", a.sim_writes());
}

#[test]
fn unknown_profile_is_400_unknown_profile_with_nothing_claimed_or_written() {
    let a = Agent::start(ONE_GPU).unwrap();
    let e = a.err("instance.create", json!({"name": "x", "image": "demo", "gpu": "L40S-7Q"}));
    assert_api_error(&e, 400, "unknown_profile");
    assert_eq!(e.data["profile"], "L40S-7Q", "{}", e.data);
    let e = a.err("placement.dry_run", json!({"profile": "L40S-7Q"}));
    assert_api_error(&e, 400, "unknown_profile");
    assert_eq!(e.data["profile"], "L40S-7Q", "{}", e.data);
    assert_nothing_left(&a);
    assert!(a.sim_writes().is_empty(), "no sysfs write: {:?}", a.sim_writes());
    assert!(set_vfs(&a.state()).is_empty());
}

#[test]
fn a_profile_that_does_not_fit_is_409_no_capacity_and_leaves_nothing() {
    let a = Agent::start(ONE_GPU).unwrap();
    let big = a.create_gpu("big", "L40S-48Q").unwrap();
    assert_eq!(big["gpu"]["device"], "0000:41:00.4");
    let writes_before = a.sim_writes();
    let claims_before = a.claims();
    assert_eq!(claims_before.len(), 1);

    // The GPU is full: neither another 48Q nor a smaller profile fits (equal-size rule).
    for (name, profile) in [("small", "L40S-2Q"), ("other-big", "L40S-48Q"), ("lower", "l40s-1q")] {
        let e = a.err("instance.create", json!({"name": name, "image": "demo", "gpu": profile}));
        assert_api_error(&e, 409, "no_capacity");
        assert_eq!(a.instance_names(), vec!["big"], "no instance left by {name}");
        // Another size: the answer explains the equal-size rule; the same size: the GPU is
        // simply full.
        let explained = e.message.contains("GPU 0000:41:00.0: it runs 1 vGPU of 49152 MiB each")
            && e.message.contains("equal-size rule")
            && e.message.contains("fits there once those are released");
        assert_eq!(explained, profile != "L40S-48Q", "{profile}: {}", e.message);
    }
    assert_eq!(a.claims(), claims_before, "nothing claimed");
    assert_eq!(a.sim_writes(), writes_before, "nothing written");
    assert_eq!(set_vfs(&a.state()), vec![("0000:41:00.4".into(), 1159)]);
    assert_eq!(a.data_files("instances").len(), 1, "{:?}", a.data_files("instances"));
    let res = a.ok("resources.get", json!({}));
    for p in res["profiles"].as_array().unwrap() {
        assert_eq!(p["placeable"], 0, "a full GPU places nothing: {p}");
    }
    a.ok("instance.delete", json!({"ref": "big"}));
    assert_nothing_left(&a);
}

#[test]
fn conflicts_answer_409_name_taken_and_invalid_state_and_missing_instances_404() {
    let a = Agent::start(ONE_GPU).unwrap();
    let vm = a.create_gpu("vm", "L40S-2Q").unwrap();
    let writes_before = a.sim_writes();

    let e = a.err("instance.create", json!({"name": "vm", "image": "demo", "gpu": "L40S-2Q"}));
    assert_api_error(&e, 409, "name_taken");
    assert_eq!(a.claims().len(), 1, "the duplicate claimed nothing: {:?}", a.claims());
    assert_eq!(a.sim_writes(), writes_before, "the duplicate wrote nothing");
    assert_eq!(a.instance_names(), vec!["vm"]);

    for r in ["vm", vm["id"].as_str().unwrap()] {
        let e = a.err("instance.start", json!({"ref": r}));
        assert_api_error(&e, 409, "invalid_state");
    }
    assert_eq!(a.ok("instance.get", json!({"ref": "vm"}))["state"], "running", "still running");

    for method in ["instance.get", "instance.start", "instance.stop", "instance.delete"] {
        let e = a.err(method, json!({"ref": "ghost"}));
        assert_api_error(&e, 404, "not_found");
    }
    let e = a.err("instance.get", json!({"ref": "00000000-0000-4000-8000-000000000000"}));
    assert_api_error(&e, 404, "not_found");
    a.ok("instance.delete", json!({"ref": "vm"}));
    assert_nothing_left(&a);
}

/// Define only (`start: false`, `gpuvisor create --no-start`): every check of a create, a
/// `stopped` record, nothing claimed, written or started until `instance.start`.
#[test]
fn a_create_that_does_not_start_checks_everything_and_claims_nothing() {
    let a = Agent::start(ONE_GPU).unwrap();
    let e = a.err("instance.create", json!({"name": "d", "image": "demo", "gpu": "L40S-7Q", "start": false}));
    assert_api_error(&e, 400, "unknown_profile");
    let v = a.ok("instance.create", json!({"name": "d", "image": "demo", "gpu": "L40S-2Q", "start": false}));
    assert_eq!(v["state"], "stopped", "{v}");
    assert!(v["vmm"].is_null(), "{v}");
    assert_eq!(v["gpu"]["profile"], "L40S-2Q", "{v}");
    assert!(a.claims().is_empty(), "nothing claimed: {:?}", a.claims());
    assert!(a.sim_writes().is_empty(), "nothing written: {:?}", a.sim_writes());
    assert!(a.qemu_pids().is_empty(), "nothing started");
    let out = a.cli(&["create", "e", "--image", "demo", "--no-start"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(a.ok("instance.get", json!({"ref": "e"}))["state"], "stopped");

    let v = a.ok("instance.start", json!({"ref": "d"}));
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["gpu"]["device"], "0000:41:00.4", "{v}");
    for n in ["d", "e"] {
        a.ok("instance.delete", json!({"ref": n}));
    }
    assert_nothing_left(&a);
}

#[test]
fn the_socket_is_mode_0600() {
    let a = Agent::start(ONE_GPU).unwrap();
    let meta = std::fs::metadata(&a.socket).unwrap();
    use std::os::unix::fs::FileTypeExt;
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "socket mode {:o}", meta.permissions().mode());
}

#[test]
fn agent_metrics_is_prometheus_text_with_instance_and_claim_gauges() {
    let a = Agent::start(ONE_GPU).unwrap();
    a.create_gpu("vm", "L40S-2Q").unwrap();
    let text = a.metrics();
    // Prometheus text format 0.0.4: no OpenMetrics `# EOF`, counters named `_total` in
    // their TYPE line, and `promtool check metrics` (when installed) finds no problem.
    assert!(!text.contains("# EOF"), "Prometheus text, not OpenMetrics: {text}");
    assert!(text.contains("# TYPE gpuvisor_policy_calls_total counter"), "{text}");
    if let Some(problems) = promtool_check(&text) {
        assert!(problems.is_empty(), "promtool check metrics: {problems}\n{text}");
    }
    assert!(text.contains("# TYPE gpuvisor_instances gauge"), "{text}");
    assert!(text.contains("# TYPE gpuvisor_vgpu_claims gauge"), "{text}");
    assert_eq!(metric(&text, "gpuvisor_instances", &[("state", "running")]), Some(1.0), "{text}");
    assert_eq!(
        metric(&text, "gpuvisor_vgpu_claims", &[("framework", "vendor_vfio"), ("state", "configured")]),
        Some(1.0),
        "{text}"
    );
    // The CLI prints the same text.
    let out = a.cli(&["metrics"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("gpuvisor_vgpu_claims"));

    a.ok("instance.stop", json!({"ref": "vm", "force": true}));
    let text = a.metrics();
    assert_eq!(metric(&text, "gpuvisor_instances", &[("state", "stopped")]), Some(1.0), "{text}");
    assert_eq!(metric(&text, "gpuvisor_vgpu_claims", &[]).unwrap_or(0.0), 0.0, "no claim once stopped: {text}");
}

#[test]
fn an_idle_agent_exports_the_instance_and_claim_gauges_at_zero() {
    // Gauges with no instances/claims must still be exported (S052: "both gauges read 0"),
    // or dashboards and alerts cannot tell "zero" from "agent not reporting".
    let a = Agent::start(ONE_GPU).unwrap();
    let idle = a.metrics();
    assert!(idle.contains("gpuvisor_instances"), "gpuvisor_instances missing on an idle agent:\n{idle}");
    assert!(idle.contains("gpuvisor_vgpu_claims"), "gpuvisor_vgpu_claims missing on an idle agent:\n{idle}");
    assert_eq!(metric(&idle, "gpuvisor_instances", &[]), Some(0.0), "{idle}");
    assert_eq!(metric(&idle, "gpuvisor_vgpu_claims", &[]), Some(0.0), "{idle}");
}

/// Errors are JSON-RPC error objects: numeric class, one-sentence message, `data.code`.
#[test]
fn error_objects_carry_the_class_message_and_data_code() {
    let a = Agent::start(ONE_GPU).unwrap();
    let body = json!({"jsonrpc": "2.0", "id": 42, "method": "instance.get", "params": {"ref": "ghost"}}).to_string();
    let v: Value = rpc_raw(&a.socket, &body).unwrap();
    assert_eq!(v["jsonrpc"], "2.0");
    assert_eq!(v["id"], 42);
    assert!(v.get("result").is_none(), "{v}");
    assert_eq!(v["error"]["code"], 404, "{v}");
    assert_eq!(v["error"]["data"]["code"], "not_found", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("ghost"), "{v}");
}

#[test]
fn the_loopback_metrics_listener_serves_prometheus_text_and_agrees_with_agent_metrics() {
    use std::io::{Read, Write};
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let extra = format!("metrics_listen = \"127.0.0.1:{port}\"\n");
    let a = Agent::start_with(AgentOptions { extra: &extra, ..Default::default() }).unwrap();
    a.create_gpu("m1", "L40S-1Q").unwrap();
    let get = |path: &str| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let page = get("/metrics");
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("gpuvisor_instances{state=\"running\"} 1"), "{page}");
    assert!(page.contains("gpuvisor_vgpu_claims{framework=\"vendor_vfio\",state=\"configured\"} 1"), "{page}");
    let rpc_text = a.ok("agent.metrics", serde_json::json!({}));
    assert!(rpc_text.as_str().unwrap().contains("gpuvisor_instances{state=\"running\"} 1"));
    assert!(get("/nope").starts_with("HTTP/1.1 404"));
}

#[test]
fn policy_and_claim_latencies_and_rejections_are_exported_with_their_labels() {
    let a = Agent::start("l40s-2x16").unwrap();
    a.create_gpu("lat", "L40S-1Q").unwrap();
    let text = a.ok("agent.metrics", serde_json::json!({}));
    let text = text.as_str().unwrap();
    let count = |name: &str, labels: &[(&str, &str)]| metric(text, name, labels);
    assert_eq!(
        count("gpuvisor_policy_call_duration_seconds_count", &[("plugin", "placement-spread"), ("kind", "placement")]),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        count(
            "gpuvisor_policy_call_duration_seconds_count",
            &[("plugin", "hypervisor-default"), ("kind", "hypervisor")]
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(count("gpuvisor_vgpu_claim_duration_seconds_count", &[]), Some(1.0), "{text}");
    assert_eq!(
        count(
            "gpuvisor_policy_rejected_answers",
            &[("plugin", "placement-spread"), ("kind", "placement"), ("reason", "not_a_legal_candidate")]
        ),
        Some(0.0),
        "{text}"
    );
    assert_eq!(count("gpuvisor_rpc_calls", &[("method", "instance.create"), ("result", "ok")]), Some(1.0), "{text}");
}

/// `promtool check metrics` on `text`: `Some(problems)` (empty when clean), `None` when
/// promtool is not installed.
fn promtool_check(text: &str) -> Option<String> {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(text.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let problems = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Some(if out.status.success() { String::new() } else { problems })
}

/// Issue 18 finding 12: the edges of the interface answer clearly — `events.subscribe` over
/// plain HTTP says to use WebSocket; a body over 4 MiB gets an answer saying the limit (not
/// a closed connection); an empty `ref` says it names nothing (not `" was not found"`);
/// `"restart": true` lists the allowed values.
#[test]
fn the_edges_of_the_interface_answer_clearly() {
    let a = Agent::start(ONE_GPU).unwrap();
    let e = a.err("events.subscribe", json!({}));
    assert_api_error(&e, 400, "invalid_request");
    assert!(e.message.contains("WebSocket"), "{e}");

    let big = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"agent.health\",\"params\":{{\"pad\":\"{}\"}}}}",
        "x".repeat(5 * 1024 * 1024)
    );
    let answer = rpc_raw(&a.socket, &big).unwrap_or_else(|e| panic!("BUG: no answer to a 5 MiB body: {e}"));
    assert_eq!(answer["error"]["code"], -32600, "{answer}");
    assert!(answer["error"]["message"].as_str().unwrap().contains("4 MiB"), "{answer}");
    a.ok("agent.health", json!({}));

    for method in ["instance.get", "instance.start", "instance.stop", "instance.delete"] {
        let e = a.err(method, json!({"ref": ""}));
        assert_api_error(&e, 400, "invalid_request");
        assert!(e.message.contains("ref is empty"), "{method}: {e}");
    }

    let e = a.err("instance.create", json!({"name": "r", "image": "demo", "restart": true}));
    assert_eq!(e.code, -32602, "{e}");
    let said = format!("{} {}", e.message, e.data);
    for v in ["no", "on-failure", "always"] {
        assert!(said.contains(&format!("\\\"{v}\\\"")) || said.contains(&format!("\"{v}\"")), "lists {v}: {said}");
    }
    assert_nothing_left(&a);
}

/// Issue 22 part 5: `instance.update` changes labels and the restart policy at once and the
/// machine (vCPUs, memory, cloud-init) at the next start — the running QEMU keeps its
/// command line until `instance.reboot`, which applies them; bad fields are refused, naming
/// them, with the record unchanged; the same values again change nothing.
#[test]
fn an_update_applies_labels_now_and_the_machine_at_the_next_start() {
    let a = Agent::start(ONE_GPU).unwrap();
    let v = a.ok("instance.create", json!({"name": "u", "image": "demo", "labels": {"team": "a"}}));
    let id = v["id"].as_str().unwrap().to_string();
    let before = a.record(&id);
    for (params, says) in [
        (json!({"vcpus": 0}), "vcpus"),
        (json!({"memory_mib": 10}), "memory_mib"),
        (json!({"vcpus": 64000}), "vcpus"),
        (json!({"labels": {"-bad": "x"}}), "label"),
        (json!({"nics": [{"mode": "bridge", "bridge": "gvt-missing"}]}), "does not exist"),
        (json!({"cloud_init": {"user_data": "x".repeat(70_000)}}), "user_data"),
    ] {
        let mut p = params.clone();
        p["ref"] = json!("u");
        let e = a.err("instance.update", p);
        assert!(e.data_code == "invalid_request" || e.code == -32602, "{params}: {e}");
        assert!(e.message.contains(says) || e.data.to_string().contains(says), "{params}: {e}");
    }
    let e = a.err("instance.update", json!({"ref": "u", "gpu": "L40S-2Q"}));
    assert_eq!(e.code, -32602, "an unknown field: {e}");
    assert_eq!(a.record(&id), before, "nothing written");
    assert!(a.qemu_cmdline(&id).contains("-smp 1 "), "{}", a.qemu_cmdline(&id));

    let r = a.ok(
        "instance.update",
        json!({"ref": "u", "vcpus": 2, "memory_mib": 320, "labels": {"team": "b"}, "restart": "always",
               "cloud_init": {"user_data": "#cloud-config\ngpuvisor-marker: updated\n"}}),
    );

    assert_eq!(r["changed"], json!(["vcpus", "memory_mib", "labels", "restart", "cloud_init"]), "{r}");
    assert_eq!(r["at_next_start"], json!(["vcpus", "memory_mib", "cloud_init"]), "{r}");
    assert_eq!(r["instance"]["labels"], json!({"team": "b"}));
    assert_eq!(r["instance"]["restart"], "always");
    let rec = a.record(&id);
    assert_eq!((rec["vcpus"].as_u64(), rec["memory_mib"].as_u64()), (Some(2), Some(320)), "{rec}");
    let cmd = a.qemu_cmdline(&id);
    assert!(cmd.contains("-smp 1 ") && cmd.contains("-m 256 "), "the running VM is unchanged: {cmd}");
    let st = a.ok("instance.stats", json!({"ref": "u"}));
    assert_eq!((st["vcpus"].as_u64(), st["memory_mib"].as_u64()), (Some(1), Some(256)), "what runs: {st}");

    let again = a.ok("instance.update", json!({"ref": "u", "vcpus": 2, "labels": {"team": "b"}}));
    assert_eq!(again["changed"], json!([]), "{again}");

    let b = a.ok("instance.reboot", json!({"ref": "u", "force": true}));
    assert_eq!(b["state"], "running", "{b}");
    let cmd = a.qemu_cmdline(&id);
    assert!(cmd.contains("-smp 2 ") && cmd.contains("-m 320 "), "applied by the reboot: {cmd}");
    a.wait_serial(&b, "gpuvisor-guest: marker updated", Duration::from_secs(120)).unwrap();

    // The CLI: labels replaced by none, autostart on; a stopped instance has nothing pending.
    a.ok("instance.stop", json!({"ref": "u", "force": true}));
    let out = a.cli(&["update", "u", "--no-labels", "--autostart", "true", "--memory-mib", "384"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("changed memory_mib, labels, autostart") && !text.contains("next start"), "{text}");
    let rec = a.record(&id);
    assert_eq!((rec["labels"].clone(), rec["autostart"].clone()), (json!({}), json!(true)), "{rec}");
    a.ok("instance.delete", json!({"ref": "u"}));
}
