//! The event stream (issue 12): JSON-RPC subscriptions over WebSocket on the agent's Unix
//! socket, read by a client that is not ours (Python `websockets`, tests/e2e/py) and by
//! `gpuvisor events --output json`; a VMM crash is published by the exit watcher before any
//! reconcile pass.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A subscriber process whose stdout lines arrive on a channel.
struct Follower {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Follower {
    fn spawn(mut cmd: Command) -> Follower {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn the subscriber");
        let out: ChildStdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Follower { child, lines }
    }

    fn line(&self) -> String {
        self.lines.recv_timeout(Duration::from_secs(120)).expect("a line from the subscriber")
    }

    /// The next events (JSON lines) up to and including the first that `until` accepts.
    fn until(&self, until: impl Fn(&Value) -> bool) -> Vec<Value> {
        let mut got = Vec::new();
        loop {
            let l = self.line();
            let v: Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            let done = until(&v);
            got.push(v);
            if done {
                return got;
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn python_client(a: &Agent) -> Follower {
    let script = repo_root().join("tests/e2e/py/events_client.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script).arg(&a.socket);
    let f = Follower::spawn(cmd);
    let first = f.line();
    assert!(first.starts_with("subscribed "), "{first}");
    f
}

/// Runs reconcile passes until a subscriber that connected on its own time has seen one
/// (`seen("reconcile_pass")` blocks until it does): from then on it misses nothing.
fn wait_subscribed(a: &Agent, seen: impl FnOnce(&str) -> usize) {
    let (tx, rx) = mpsc::channel::<()>();
    let sock = a.socket.clone();
    let runner = std::thread::spawn(move || {
        while rx.try_recv().is_err() {
            let _ = rpc_raw(&sock, r#"{"jsonrpc":"2.0","id":1,"method":"reconcile.run"}"#);
        }
    });
    seen("reconcile_pass");
    tx.send(()).unwrap();
    runner.join().unwrap();
}

fn types(evs: &[Value]) -> Vec<String> {
    evs.iter().map(|e| e["type"].as_str().unwrap().to_string()).collect()
}

fn is_state(e: &Value, name: &str, to: &str) -> bool {
    e["type"] == "instance_state" && e["name"] == name && e["to"] == to
}

/// Create, stop, start, a VMM crash and a reconcile pass, in order, with strictly
/// increasing sequence numbers; the crash is published before any pass; `gpuvisor events`
/// sees the same events as the Python client.
#[test]
fn a_vms_life_reaches_a_websocket_client_in_order_and_the_crash_before_any_pass() {
    // No periodic pass during the test: the only passes are the ones it runs.
    let a = Agent::start_tuned(
        AgentOptions { model: HOST_V, ..Default::default() },
        None,
        &[("reconcile_interval_s", "3600")],
    )
    .unwrap();
    let py = python_client(&a);
    let mut cli_cmd = Command::new(agent_binary());
    cli_cmd.arg("--socket").arg(&a.socket).args(["events", "--output", "json"]);
    let cli = Follower::spawn(cli_cmd);
    wait_subscribed(&a, |f| cli.until(|e| e["type"] == f).len());

    // create: a new record, a claim, running (after whatever passes ran above).
    let inst = a.create_gpu("vm-ev", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    let mut created = py.until(|e| is_state(e, "vm-ev", "running"));
    if let Some(p) = created.iter().rposition(|e| e["type"] == "reconcile_pass") {
        created.drain(..=p);
    }
    let ty = types(&created);
    let claimed = created.iter().find(|e| e["type"] == "claimed").expect("a claimed event");
    assert_eq!(claimed["instance_id"], id.as_str(), "{claimed}");
    assert_eq!(claimed["profile"], "L40S-2Q", "{claimed}");
    let starting = created.iter().position(|e| is_state(e, "vm-ev", "starting")).expect("starting");
    assert!(created[starting]["from"].is_null(), "a new record: {}", created[starting]);
    assert!(starting < ty.iter().position(|t| t == "claimed").unwrap(), "{ty:?}");

    // stop: stopping, the release, stopped.
    a.ok("instance.stop", json!({"ref": "vm-ev", "force": true}));
    let stopped = py.until(|e| is_state(e, "vm-ev", "stopped"));
    let stopping = stopped.iter().position(|e| is_state(e, "vm-ev", "stopping")).expect("stopping");
    let released = stopped
        .iter()
        .position(|e| e["type"] == "released" && e["instance_id"] == id.as_str())
        .expect("released before stopped");
    assert!(stopping < released, "{stopped:?}");

    // A crash: the exit watcher publishes it; no pass runs before it.
    a.ok("instance.start", json!({"ref": "vm-ev"}));
    let restarted = py.until(|e| is_state(e, "vm-ev", "running"));
    assert!(restarted.iter().any(|e| e["type"] == "claimed"), "{restarted:?}");
    for p in qemu_of(&id) {
        sigkill(p);
    }
    let died = py.until(|e| is_state(e, "vm-ev", "stopped"));
    assert!(!types(&died).contains(&"reconcile_pass".to_string()), "published before any pass: {died:?}");
    let death = died.last().unwrap();
    assert_eq!(death["from"], "running", "{death}");
    assert!(death["reason"].as_str().unwrap().contains("the VMM exited"), "{death}");
    // And `ps` says so at once, before any pass.
    assert_eq!(a.ok("instance.get", json!({"ref": "vm-ev"}))["state"], "stopped");

    // The passes release the dead VM's claim (EBUSY while the simulated driver tears the
    // vGPU down is retried by the next pass) and say what they did.
    let mut after = Vec::new();
    let mut passes = Vec::new();
    while !after.iter().any(|e: &Value| e["type"] == "released" && e["instance_id"] == id.as_str()) {
        assert!(passes.len() < 20, "the claim is never released: {after:?}");
        passes.push(a.ok("reconcile.run", json!({})));
        after.extend(py.until(|e| e["type"] == "reconcile_pass"));
    }
    let ends: Vec<&Value> = after.iter().filter(|e| e["type"] == "reconcile_pass").collect();
    assert_eq!(ends.len(), passes.len(), "one reconcile_pass event per pass: {after:?}");
    for (end, pass) in ends.iter().zip(&passes) {
        assert_eq!(end["released"], pass["released"].as_array().unwrap().len(), "{end} {pass}");
        assert_eq!(end["failed"], pass["failed"].as_array().unwrap().len(), "{end} {pass}");
        assert_eq!(end["complete"], true, "{end}");
    }

    // Sequence numbers strictly increase, times are RFC 3339; the CLI saw the same events.
    let all: Vec<Value> = [created, stopped, restarted, died, after].concat();
    let seqs: Vec<u64> = all.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "no gaps, in order: {seqs:?}");
    assert!(all.iter().all(|e| e["time"].as_str().unwrap().ends_with('Z')));
    let last = *seqs.last().unwrap();
    let mut cli_saw = cli.until(|e| e["seq"].as_u64() == Some(last));
    cli_saw.retain(|e| e["seq"].as_u64().unwrap() >= seqs[0]);
    assert_eq!(cli_saw.iter().map(|e| e["seq"].as_u64().unwrap()).collect::<Vec<_>>(), seqs);
    assert_eq!(cli_saw, all, "the CLI decodes the same events");

    // Counted per type.
    let m = a.metrics();
    assert!(metric(&m, "gpuvisor_events_total", &[("type", "instance_state")]).unwrap() >= 6.0, "{m}");
    assert!(metric(&m, "gpuvisor_events_total", &[("type", "claimed")]).unwrap() >= 2.0);
}

/// A filter by type; an unknown type is refused with the valid ones; the text form has
/// one line per event; HTTP callers cannot subscribe.
#[test]
fn subscribers_filter_by_type_and_bad_subscriptions_are_refused() {
    let a = Agent::start(HOST_V).unwrap();
    let mut cmd = Command::new(agent_binary());
    cmd.arg("--socket").arg(&a.socket).args(["events", "--type", "reconcile_pass", "--count", "2"]);
    let text = Follower::spawn(cmd);
    let mut lines = Vec::new();
    wait_subscribed(&a, |_| {
        lines.push(text.line());
        lines.push(text.line());
        2
    });
    let (l1, l2) = (&lines[0], &lines[1]);
    for l in [l1, l2] {
        assert!(l.contains("reconcile_pass") && l.contains("complete in"), "{l}");
    }
    let mut text = text;
    let st = text.child.wait().unwrap();
    assert!(st.success(), "--count 2 exits 0 after two events: {st}");

    let mut cmd = Command::new("python3");
    cmd.arg(repo_root().join("tests/e2e/py/events_client.py")).arg(&a.socket).arg("no_such_type");
    let bad = Follower::spawn(cmd);
    let l = bad.line();
    assert!(l.starts_with("error ") && l.contains("unknown event type") && l.contains("instance_state"), "{l}");

    let out = Command::new(agent_binary())
        .arg("--socket")
        .arg(&a.socket)
        .args(["events", "--type", "nope"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a bad --type is a usage error");

    // Over HTTP a subscription is refused (jsonrpsee), not hung.
    let v = rpc_raw(&a.socket, r#"{"jsonrpc":"2.0","id":1,"method":"events.subscribe"}"#).unwrap();
    assert!(v.get("error").is_some(), "{v}");
}
