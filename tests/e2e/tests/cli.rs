//! End to end: the `gpuvisor` command line against a real agent — tables for people,
//! `--output json` for scripts, one clear error line with the code and a non-zero exit on
//! failure, and the local commands (`plugin test`, `serve` config checks).

use gpuvisor_e2e::*;
use serde_json::Value;
use std::process::Output;
use std::time::Duration;

const ONE_GPU: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts the command succeeded; returns stdout.
fn ok(o: Output) -> String {
    assert!(o.status.success(), "exit {:?}\nstdout: {}\nstderr: {}", o.status, stdout(&o), stderr(&o));
    stdout(&o)
}

/// The table row (whitespace-split cells) whose first cell is `first`.
fn row<'a>(table: &'a str, first: &str) -> Option<Vec<&'a str>> {
    table.lines().map(|l| l.split_whitespace().collect::<Vec<_>>()).find(|c| c.first() == Some(&first))
}

#[test]
fn an_instance_goes_through_create_ps_show_stop_start_and_rm() {
    let a = Agent::start(ONE_GPU).unwrap();

    let out = ok(a.cli(&["create", "web-1", "--image", "demo", "--gpu", "L40S-1Q", "--label", "tenant=a"]));
    assert!(out.contains("web-1") && out.contains("running"), "{out}");
    assert!(out.contains("gpu L40S-1Q on 0000:41:00.4"), "{out}");

    // ps: a table with the name and state.
    let ps = ok(a.cli(&["ps"]));
    assert!(ps.lines().next().unwrap().starts_with("NAME"), "{ps}");
    let r = row(&ps, "web-1").unwrap_or_else(|| panic!("no web-1 row: {ps}"));
    assert_eq!(r[1], "running", "{ps}");
    assert_eq!(r[2], "qemu", "{ps}");
    assert_eq!(r[3], "L40S-1Q", "{ps}");
    assert_eq!(r[4], "0000:41:00.4", "{ps}");

    // ps --output json parses and carries the labels.
    let v: Value = serde_json::from_str(&ok(a.cli(&["ps", "--output", "json"]))).expect("ps --output json is JSON");
    let inst = &v["instances"][0];
    assert_eq!(inst["name"], "web-1");
    assert_eq!(inst["labels"]["tenant"], "a");
    let id = inst["id"].as_str().unwrap().to_string();

    // show: the instance as JSON (by name and by id).
    for r in ["web-1", id.as_str()] {
        let shown: Value = serde_json::from_str(&ok(a.cli(&["show", r]))).expect("show prints JSON");
        assert_eq!(shown["id"], id.as_str());
        assert_eq!(shown["gpu"]["profile"], "L40S-1Q");
    }

    // gpus: the VF row names its owner.
    let gpus = ok(a.cli(&["gpus"]));
    assert!(gpus.contains("GPU 0000:41:00.0"), "{gpus}");
    let r = row(&gpus, "0000:41:00.4").unwrap_or_else(|| panic!("no VF row: {gpus}"));
    assert_eq!(r[1], "claimed", "{gpus}");
    assert!(r.contains(&"web-1"), "the owner's name is shown: {gpus}");
    let free = row(&gpus, "0000:41:00.5").unwrap();
    assert!(!free.contains(&"web-1"), "{gpus}");

    // stop / start.
    let out = ok(a.cli(&["stop", "web-1", "--force"]));
    assert!(out.contains("stopped"), "{out}");
    assert_eq!(row(&ok(a.cli(&["ps"])), "web-1").unwrap()[1], "stopped");
    assert!(a.claims().is_empty());
    let out = ok(a.cli(&["start", "web-1"]));
    assert!(out.contains("running") && out.contains("L40S-1Q"), "{out}");
    assert_eq!(a.claims().len(), 1);

    // rm: gone from ps, no claim, no VF set.
    ok(a.cli(&["rm", "web-1"]));
    let ps = ok(a.cli(&["ps"]));
    assert!(row(&ps, "web-1").is_none(), "{ps}");
    assert!(a.claims().is_empty());
    assert!(set_vfs(&a.state()).is_empty());
}

#[test]
fn profiles_images_and_plugins_are_listed() {
    let a = Agent::start(ONE_GPU).unwrap();
    let profiles = ok(a.cli(&["profiles"]));
    assert!(profiles.contains("PLACEABLE"), "{profiles}");
    let r = row(&profiles, "L40S-2Q").unwrap_or_else(|| panic!("no L40S-2Q row: {profiles}"));
    assert_eq!(r[1], "1148", "{profiles}");
    assert_eq!(r.last().unwrap(), &"4", "4 VFs → 4 placeable 2Q: {profiles}");
    assert_eq!(row(&profiles, "L40S-48Q").unwrap().last().unwrap(), &"1", "{profiles}");

    let images = ok(a.cli(&["image", "ls"]));
    assert!(row(&images, "demo").is_some(), "{images}");

    let plugins = ok(a.cli(&["plugin", "ls"]));
    let p = row(&plugins, "placement").unwrap_or_else(|| panic!("{plugins}"));
    assert_eq!(p[1], "placement-spread", "{plugins}");
    let h = row(&plugins, "hypervisor").unwrap_or_else(|| panic!("{plugins}"));
    assert_eq!(h[1], "hypervisor-default", "{plugins}");
}

#[test]
fn errors_print_one_line_with_the_code_and_exit_nonzero() {
    let a = Agent::start(ONE_GPU).unwrap();
    for (args, code) in [
        (vec!["show", "ghost"], "not_found"),
        (vec!["rm", "ghost"], "not_found"),
        (vec!["create", "x", "--image", "demo", "--gpu", "L40S-7Q"], "unknown_profile"),
        (vec!["create", "Bad_Name", "--image", "demo"], "invalid_request"),
    ] {
        let o = a.cli(&args);
        assert!(!o.status.success(), "{args:?} must fail");
        let err = stderr(&o);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line on stderr: {err:?}");
        assert!(lines[0].starts_with("error: "), "{args:?}: {err}");
        assert!(lines[0].contains(code), "{args:?}: the code {code} is named: {err}");
        assert!(stdout(&o).trim().is_empty(), "{args:?}: nothing on stdout: {}", stdout(&o));
    }
    assert!(a.instance_names().is_empty());
    assert!(a.claims().is_empty());
}

#[test]
fn without_an_agent_the_cli_says_it_cannot_reach_it() {
    let o = cli_alone(&["ps"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("cannot reach the gpuvisor agent"), "{err}");
    assert!(err.contains("/nonexistent/gpuvisor-e2e/gpuvisor.sock"), "names the socket: {err}");
    assert!(err.contains("is `gpuvisor serve` running?"), "{err}");
    assert_eq!(err.lines().filter(|l| !l.trim().is_empty()).count(), 1, "one line: {err}");
}

#[test]
fn plugin_test_prints_the_plugins_answer_without_an_agent() {
    let wasm = plugin("placement-spread");
    let input = repo_root().join("plugins/fixtures/placement-second-2q.json");
    let o = cli_alone(&["-o", "json", "plugin", "test", wasm.to_str().unwrap(), "--input", input.to_str().unwrap()]);
    let v: Value = serde_json::from_str(&ok(o)).expect("plugin test -o json prints JSON");
    let ranked: Vec<&str> = v["answer"]["ranked"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()).collect();
    // GPU 0 already holds a 2Q: spread ranks the idle GPU first, and never the claimed VF.
    assert_eq!(ranked.first(), Some(&"0001:81:00.4"), "{ranked:?}");
    assert!(!ranked.contains(&"0000:41:00.4"), "{ranked:?}");
    let split = ranked.iter().position(|d| d.starts_with("0000:41")).unwrap();
    assert!(ranked[..split].iter().all(|d| d.starts_with("0001:81")), "{ranked:?}");

    // A missing input file is one clear error, non-zero.
    let o = cli_alone(&["plugin", "test", wasm.to_str().unwrap(), "--input", "/nonexistent/input.json"]);
    assert!(!o.status.success());
    assert!(stderr(&o).starts_with("error: "), "{}", stderr(&o));
    // So is an unknown kind.
    let o = cli_alone(&["plugin", "test", wasm.to_str().unwrap(), "--input", input.to_str().unwrap(), "--kind", "x"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("unknown kind"), "{}", stderr(&o));
}

fn fixture(name: &str) -> String {
    repo_root().join("plugins/fixtures").join(name).display().to_string()
}

fn wasm(name: &str) -> String {
    plugin(name).display().to_string()
}

#[test]
fn plugin_test_shows_the_log_lines_fuel_time_and_answer() {
    // hypervisor-default logs (info) when the requested hypervisor cannot run a GPU.
    let args = ["plugin", "test", &wasm("hypervisor-default"), "--input", &fixture("hypervisor-gpu-requests-ch.json")];
    let out = ok(cli_alone(&args));
    assert!(out.contains("plugin:  hypervisor-default"), "{out}");
    assert!(out.contains("limits:  fuel 10000000, memory 64 MiB, deadline 100 ms"), "default limits: {out}");
    assert!(
        out.contains("log:     info   requested hypervisor cloud-hypervisor is unavailable or lacks vendor_vfio"),
        "{out}"
    );
    let fuel = row(&out, "fuel:").expect("a fuel line")[1].parse::<u64>().unwrap();
    assert!(fuel > 1000, "{out}");
    assert!(row(&out, "time:").is_some_and(|r| r[2] == "ms"), "{out}");
    assert!(out.contains("\"hypervisor\": \"qemu\""), "{out}");

    // -o json: one object with the same facts.
    let mut json_args = vec!["-o", "json"];
    json_args.extend(args);
    let v: Value = serde_json::from_str(&ok(cli_alone(&json_args))).unwrap();
    assert_eq!(v["plugin"], "hypervisor-default");
    assert_eq!(v["answer"]["hypervisor"], "qemu", "{v}");
    assert_eq!(v["logs"][0]["level"], "info", "{v}");
    assert!(v["logs"][0]["line"].as_str().unwrap().starts_with("requested hypervisor cloud-hypervisor"), "{v}");
    assert_eq!(v["fuel_used"].as_u64(), Some(fuel));
    assert!(v["wall_ms"].as_f64().unwrap() > 0.0, "{v}");
}

#[test]
fn plugin_test_params_and_config_change_the_answer_and_the_limits() {
    let grace = wasm("grace-default");
    let input = fixture("grace-mixed.json");
    let action = |v: &Value, dev: &str| -> String {
        let d = v["answer"]["decisions"].as_array().unwrap().iter().find(|d| d["device"] == dev).unwrap();
        d["action"].as_str().unwrap().to_string()
    };
    let run = |extra: &[&str]| -> Value {
        let mut args = vec!["-o", "json", "plugin", "test", &grace, "--input", &input];
        args.extend(extra);
        serde_json::from_str(&ok(cli_alone(&args))).unwrap()
    };
    // The fixture's params: the default 300 s grace keeps a 120 s old claim.
    let v = run(&[]);
    assert_eq!(action(&v, "0000:41:00.7"), "keep", "{v}");
    assert_eq!(v["params"], Value::Null);

    let dir = tempfile::tempdir().unwrap();
    // A params table (TOML) with a 5 s grace releases it.
    let toml = dir.path().join("params.toml");
    std::fs::write(&toml, "claim_grace_s = 5\n").unwrap();
    let v = run(&["--params", toml.to_str().unwrap()]);
    assert_eq!(action(&v, "0000:41:00.7"), "release", "{v}");
    assert_eq!(v["params"]["value"]["claim_grace_s"], 5);
    // The same as JSON.
    let json = dir.path().join("params.json");
    std::fs::write(&json, r#"{"claim_grace_s": 5}"#).unwrap();
    assert_eq!(action(&run(&["--params", json.to_str().unwrap()]), "0000:41:00.7"), "release");
    // The table output says the params replace the input's.
    let out = ok(cli_alone(&["plugin", "test", &grace, "--input", &input, "--params", toml.to_str().unwrap()]));
    assert!(out.contains("params:  {\"claim_grace_s\":5} (from "), "{out}");
    assert!(out.contains("replaces the input's params"), "{out}");

    // An agent config: its [plugins.grace.params] (via --params or --config) and, with
    // --config, its limits.
    let cfg = dir.path().join("gpuvisor.toml");
    std::fs::write(
        &cfg,
        format!(
            "[plugins.grace]\npath = {:?}\nfuel = 5000000\nmemory_mib = 32\ndeadline_ms = 250\n[plugins.grace.params]\nclaim_grace_s = 5\n",
            grace
        ),
    )
    .unwrap();
    assert_eq!(action(&run(&["--params", cfg.to_str().unwrap()]), "0000:41:00.7"), "release");
    let v = run(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(action(&v, "0000:41:00.7"), "release", "{v}");
    assert_eq!(v["limits"], serde_json::json!({"fuel": 5000000, "memory_bytes": 32 << 20, "deadline_ms": 250}));
    // --params wins over the config's params.
    std::fs::write(&toml, "claim_grace_s = 1000\n").unwrap();
    let v = run(&["--config", cfg.to_str().unwrap(), "--params", toml.to_str().unwrap()]);
    assert_eq!(action(&v, "0000:41:01.0"), "keep", "a 301 s claim within 1000 s: {v}");
    // A config's fuel too small for the call: the call fails, exit 1.
    std::fs::write(&cfg, format!("[plugins.grace]\npath = {grace:?}\nfuel = 150000\n")).unwrap();
    let o = cli_alone(&["plugin", "test", &grace, "--input", &input, "--config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).contains("ran out of fuel (150000 units)"), "{}", stdout(&o));
}

/// A directory of placement inputs: the fixtures, as bare inputs (an older recording).
fn placement_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for name in ["placement-empty-2q.json", "placement-mixed-states.json", "placement-second-2q.json"] {
        std::fs::copy(fixture(name), dir.path().join(name)).unwrap();
    }
    // Another kind's input in the same directory is skipped.
    std::fs::copy(fixture("grace-mixed.json"), dir.path().join("grace-mixed.json")).unwrap();
    dir
}

#[test]
fn plugin_test_replays_a_directory_and_compares_two_plugins() {
    let dir = placement_dir();
    let d = dir.path().to_str().unwrap();
    let spread = wasm("placement-spread");
    let pack = wasm("placement-pack");

    // Replay: one line per input, sorted, and a summary.
    let out = ok(cli_alone(&["plugin", "test", &spread, "--input", d]));
    let names: Vec<&str> = out.lines().skip(1).filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(
        names,
        ["placement-empty-2q.json", "placement-mixed-states.json", "placement-second-2q.json", "summary:"],
        "{out}"
    );
    let second = row(&out, "placement-second-2q.json").unwrap();
    assert_eq!(&second[1..4], ["ranked", "31:", "0001:81:00.4,"], "spread prefers the idle GPU: {out}");
    assert!(out.contains("summary: 3 inputs, 0 failed"), "{out}");

    // Against pack: the same on an idle host and on mixed states (one GPU usable), but on
    // a host where GPU 0 holds a 2Q, spread picks the idle GPU and pack fills GPU 0.
    let out = ok(cli_alone(&["plugin", "test", &spread, "--input", d, "--against", &pack]));
    assert!(out.contains("placement-empty-2q.json  same: ranked 32: 0000:41:00.4"), "{out}");
    assert!(out.contains("placement-mixed-states.json  same: "), "{out}");
    assert!(out.contains("placement-second-2q.json  differs\n"), "{out}");
    assert!(out.contains("  A placement-spread: ranked 31: 0001:81:00.4"), "{out}");
    assert!(out.contains("  B placement-pack: ranked 31: 0000:41:00.5"), "{out}");
    assert!(out.trim_end().ends_with("summary: 3 inputs, 0 failed, 1 differ"), "{out}");

    let v: Value = serde_json::from_str(&ok(cli_alone(&[
        "-o",
        "json",
        "plugin",
        "test",
        &spread,
        "--input",
        d,
        "--against",
        &pack,
    ])))
    .unwrap();
    assert_eq!(v["summary"]["inputs"], 3);
    assert_eq!(v["summary"]["differ"], 1);
    let same: Vec<bool> =
        v["inputs"].as_array().unwrap().iter().map(|i| i["same_as_against"].as_bool().unwrap()).collect();
    assert_eq!(same, [true, true, false]);

    // --fail-on-diff turns a difference into exit 1; the same plugin twice differs nowhere.
    let o = cli_alone(&["plugin", "test", &spread, "--input", d, "--against", &pack, "--fail-on-diff"]);
    assert_eq!(o.status.code(), Some(1));
    ok(cli_alone(&["plugin", "test", &spread, "--input", d, "--against", &spread, "--fail-on-diff"]));
}

#[test]
fn bad_flags_are_refused_with_a_clear_error() {
    for (args, needle) in [
        (vec!["ps", "--bogus"], "--bogus"),
        (vec!["create", "x"], "--image"),
        (vec!["create", "x", "--image", "demo", "--label", "notkv"], "not key=value"),
        (vec!["create", "x", "--image", "demo", "--label", "a=1", "--label", "a=2"], "\"a\" is given more than once"),
        (vec!["create", "x", "--image", "demo", "--vcpus", "many"], "many"),
        (vec!["--output", "yaml", "ps"], "yaml"),
        // -o/--output changes only how client commands print: serve refuses it.
        (vec!["serve", "-o", "json"], "-o/--output does not apply to `gpuvisor serve`"),
        (vec!["-o", "json", "serve"], "-o/--output does not apply to `gpuvisor serve`"),
        (vec!["frobnicate"], "frobnicate"),
    ] {
        let o = cli_alone(&args);
        assert!(!o.status.success(), "{args:?} must be refused");
        let err = stderr(&o);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: names {needle}: {err}");
        assert!(!err.contains("cannot reach"), "{args:?}: refused before any call: {err}");
    }
}

#[test]
fn serve_refuses_a_config_with_an_unknown_key_and_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("gpuvisor.toml");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = {:?}\nsocket = {:?}\nreconcile_intreval_s = 5\n",
            dir.path().join("data"),
            dir.path().join("s.sock")
        ),
    )
    .unwrap();
    let (status, out) = serve_expecting_exit(&cfg, Duration::from_secs(30)).unwrap();
    assert!(!status.success(), "{status}: {out}");
    assert!(out.contains("reconcile_intreval_s"), "names the key: {out}");
    assert!(!dir.path().join("s.sock").exists(), "no socket was created");
}

#[test]
fn serve_refuses_a_record_policy_inputs_path_it_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    // A regular file where the directory should be.
    let not_a_dir = dir.path().join("inputs");
    std::fs::write(&not_a_dir, "").unwrap();
    let cfg = dir.path().join("gpuvisor.toml");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = {:?}\nsocket = {:?}\nrecord_policy_inputs = {:?}\n",
            dir.path().join("data"),
            dir.path().join("s.sock"),
            not_a_dir
        ),
    )
    .unwrap();
    let (status, out) = serve_expecting_exit(&cfg, Duration::from_secs(30)).unwrap();
    assert!(!status.success(), "{status}: {out}");
    assert!(out.contains("record_policy_inputs") && out.contains("not a writable directory"), "{out}");
    assert!(!dir.path().join("s.sock").exists(), "no socket was created");
}

#[test]
fn serve_refuses_out_of_range_durations_and_a_missing_host_root_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let base = format!("data_dir = {:?}\nsocket = {:?}\n", dir.path().join("data"), dir.path().join("s.sock"));
    for (extra, needle) in [
        ("stop_timeout_s = 18446744073709551615\n", "stop_timeout_s"),
        ("vfio_term_grace_s = 100000000000\n", "vfio_term_grace_s"),
        ("host_root = \"/nonexistent/gpuvisor-host\"\n", "host_root"),
    ] {
        let cfg = dir.path().join("gpuvisor.toml");
        std::fs::write(&cfg, format!("{base}{extra}")).unwrap();
        let (status, out) = serve_expecting_exit(&cfg, Duration::from_secs(30)).unwrap();
        assert!(!status.success(), "{extra}: {status}: {out}");
        assert!(out.contains(needle), "{extra}: names {needle}: {out}");
        assert!(!dir.path().join("s.sock").exists(), "no socket was created");
    }
}

#[test]
fn the_gpus_table_shows_suspect_and_quarantine_marks() {
    let a = Agent::start(HOST_V).unwrap();
    let inst = a.create_gpu("x", "L40S-1Q").unwrap();
    let vf0 = inst["gpu"]["device"].as_str().unwrap().to_string();
    // One EIO on the release's clear (retried inline, then clear): a release-time strike.
    a.sim.ctl(&["fail-write", &type_path(&vf0), "EIO", "--times", "1"]).unwrap();
    a.ok("instance.stop", serde_json::json!({"ref": "x", "force": true}));
    let gpus = ok(a.cli(&["gpus"]));
    assert!(gpus.contains("HEALTH"), "{gpus}");
    let r = row(&gpus, &vf0).unwrap_or_else(|| panic!("no row: {gpus}"));
    assert!(r.contains(&"suspect:eio"), "one EIO on a release makes the VF suspect: {gpus}");
    let other = row(&gpus, "0000:41:00.7").unwrap();
    assert_eq!(other.last(), Some(&"-"), "{gpus}");
}

#[test]
fn serve_names_a_socket_path_it_cannot_listen_on() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("gpuvisor.toml");
    // The parent of the socket is a regular file: nothing can listen there.
    std::fs::write(dir.path().join("not-a-dir"), "").unwrap();
    let sock = dir.path().join("not-a-dir/s.sock");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = {:?}\nsocket = {:?}\n[plugins.placement]\npath = {:?}\n[plugins.hypervisor]\npath = {:?}\n\
             [plugins.grace]\npath = {:?}\n",
            dir.path().join("data"),
            sock,
            plugin("placement-spread"),
            plugin("hypervisor-default"),
            plugin("grace-default")
        ),
    )
    .unwrap();
    let (status, out) = serve_expecting_exit(&cfg, Duration::from_secs(30)).unwrap();
    assert!(!status.success(), "{status}: {out}");
    assert!(out.contains(&sock.display().to_string()), "names the socket path: {out}");
}

/// Issue 18 finding 12: `GPUVISOR_SOCKET`, exported for the CLI, does not move `serve` off
/// its config file's `socket` (only `--socket` does).
#[test]
fn gpuvisor_socket_in_the_environment_does_not_override_the_config_files_socket_for_serve() {
    let mut a = Agent::start(HOST_V).unwrap();
    let elsewhere = a.dir.path().join("from-env.sock");
    a.env.push(("GPUVISOR_SOCKET".into(), elsewhere.display().to_string()));
    // The harness waits on the config file's socket: it answers there.
    a.restart().unwrap_or_else(|e| panic!("BUG: the agent did not serve its config's socket: {e}"));
    assert!(!elsewhere.exists(), "nothing listens where GPUVISOR_SOCKET points");
    a.ok("agent.health", serde_json::json!({}));
}

/// A protocol error (`-32602` invalid params) prints what serde said was wrong, not only
/// "Invalid params" (found by a fresh user).
#[test]
fn call_prints_what_was_wrong_with_the_params() {
    let a = Agent::start("l40s-2x16").unwrap();
    a.ok("instance.create", serde_json::json!({"name": "p", "image": "demo", "start": false}));
    let o = a.cli(&["call", "instance.update", r#"{"ref": "p", "restart": "sometimes"}"#]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = stderr(&o);
    assert!(err.contains("Invalid params") && err.contains("sometimes") && err.contains("on-failure"), "{err}");
}
