//! Issue 20 part 2: claims whose owner is a Kubernetes ResourceClaim, prepared and released
//! by a local client (the DRA node component) through `claim.prepare`, `claim.release`,
//! `claim.list` and `claim.owners`, against the real agent and gpuvisor-sim: the same claim,
//! configure and release code as an instance's, the release guard refusing while a process
//! holds the VFIO node, and the reconciler releasing the claims of owners proven gone.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

const VF0: &str = "0000:41:00.4";
const VF1: &str = "0000:41:00.5";
const VF2: &str = "0000:41:00.6";

fn agent(set: &[(&str, &str)]) -> Agent {
    let mut keys = vec![("reconcile_interval_s", "3600")];
    keys.extend_from_slice(set);
    Agent::start_tuned(AgentOptions::default(), None, &keys).unwrap()
}

fn prepare(a: &Agent, owner: &Value, device: &str, profile: &str) -> Result<Value, RpcError> {
    a.call("claim.prepare", json!({"owner": owner, "device": device, "kind": "vendor_vfio", "profile": profile}))
}

/// The type writes to `vf` after `seq` that took effect (`all`: attempted).
fn writes_of(a: &Agent, vf: &str, seq: u64, all: bool) -> Vec<String> {
    log_after(&a.state(), seq)
        .into_iter()
        .filter(|e| e["op"] == "write" && e["path"] == type_path(vf) && (all || e["result"] == "ok"))
        .map(|e| e["value"].as_str().unwrap_or("").trim().to_string())
        .collect()
}

fn type_writes(a: &Agent, vf: &str, seq: u64) -> Vec<String> {
    writes_of(a, vf, seq, true)
}

fn kept_reason(report: &Value, device: &str) -> Option<String> {
    report["kept"].as_array()?.iter().find(|k| k["device"] == device).map(|k| k.to_string())
}

fn released(report: &Value, device: &str) -> bool {
    report["released"].as_array().is_some_and(|r| r.iter().any(|x| x["device"] == device))
}

#[test]
fn prepare_claims_and_configures_exactly_that_device_once_for_one_owner() {
    let a = agent(&[]);
    let owner = resource_claim("gpu-a", "uid-a");
    let seq = last_seq(&a.state());
    let p = prepare(&a, &owner, VF0, "L40S-2Q").unwrap();
    let group = vf_entry(&a.state(), VF0)["group"].as_u64().unwrap();
    assert_eq!(p["device"], VF0, "{p}");
    assert_eq!(p["kind"], "vendor_vfio");
    assert_eq!(p["state"], "configured");
    assert_eq!(p["owner"], owner);
    assert_eq!(p["parent_gpu"], "0000:41:00.0");
    assert_eq!(p["pci_address"], VF0);
    assert_eq!(p["vfio_group"], group);
    assert_eq!(p["device_nodes"], json!([format!("/dev/vfio/{group}"), "/dev/vfio/vfio"]));
    let type_id = p["type_id"].as_u64().unwrap();
    assert_eq!(a.vf_type(VF0), type_id, "the type was written and read back");
    assert_eq!(type_writes(&a, VF0, seq), [type_id.to_string()]);
    // The record names the external owner, not an instance.
    let rec = a.claim_file(VF0).unwrap();
    assert_eq!(rec["owner"], owner, "{rec}");
    assert!(rec.get("instance_id").is_none(), "{rec}");

    // Idempotent: the same answer, nothing written.
    let seq = last_seq(&a.state());
    let again = prepare(&a, &owner, VF0, "L40S-2Q").unwrap();
    assert_eq!(again, p);
    assert!(type_writes(&a, VF0, seq).is_empty());

    // Another owner: refused, the claim and the VF unchanged.
    let e = prepare(&a, &resource_claim("gpu-b", "uid-b"), VF0, "L40S-2Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "device_taken"), "{e}");
    assert_eq!(e.data["owner"]["uid"], "uid-a");
    let e = a.err("claim.release", json!({"owner": resource_claim("gpu-b", "uid-b"), "device": VF0}));
    assert_eq!(e.data_code, "device_taken", "{e}");
    assert_eq!(a.claim_file(VF0).unwrap()["owner"]["uid"], "uid-a");

    // The equal-size rule: another size on the same GPU is refused, saying why.
    let e = prepare(&a, &resource_claim("gpu-c", "uid-c"), VF1, "L40S-8Q").unwrap_err();
    assert_eq!((e.code, e.data_code.as_str()), (409, "no_capacity"), "{e}");
    assert!(e.message.contains("equal-size"), "{e}");
    assert!(a.claim_file(VF1).is_none());

    // A quarantined device is refused.
    let h =
        json!({"device": VF2, "reason": "eio", "quarantined": true, "detail": "test", "at": "2026-01-01T00:00:00Z"});
    std::fs::write(a.data_dir.join("health").join(format!("{VF2}.json")), h.to_string()).unwrap();
    let e = prepare(&a, &resource_claim("gpu-d", "uid-d"), VF2, "L40S-2Q").unwrap_err();
    assert_eq!(e.data_code, "device_unhealthy", "{e}");
    assert!(a.claim_file(VF2).is_none());

    // An instance's claim beside it: listed without a filter, not with one.
    let inst = a.create_gpu("vm", "L40S-2Q").unwrap();
    let vm_vf = a.claims().iter().find(|c| c["instance_id"] == inst["id"]).unwrap()["device"].clone();
    let all = a.ok("claim.list", json!({}));
    let devices: Vec<&Value> = all["claims"].as_array().unwrap().iter().map(|c| &c["device"]).collect();
    assert!(devices.contains(&&json!(VF0)) && devices.contains(&&vm_vf), "{all}");
    let vm = all["claims"].as_array().unwrap().iter().find(|c| c["device"] == vm_vf).unwrap();
    assert_eq!(vm["owner"], json!({"kind": "instance", "id": inst["id"]}));
    let mine = a.ok("claim.list", json!({"owner_kind": "resource_claim"}));
    assert_eq!(mine["claims"].as_array().unwrap().len(), 1, "{mine}");
    assert_eq!(mine["claims"][0]["owner"], owner);
    assert_eq!(mine["claims"][0]["profile"], "L40S-2Q");
    assert_eq!(mine["claims"][0]["state"], "configured");

    // gpu.list shows the owner.
    let gpus = a.ok("gpu.list", json!({}));
    let d = gpus["gpus"][0]["devices"].as_array().unwrap().iter().find(|d| d["address"] == VF0).unwrap().clone();
    assert_eq!(d["claim"]["owner"], owner, "{d}");
    assert!(d["claim"]["instance_id"].is_null());
    a.ok("instance.delete", json!({"ref": "vm"}));
}

#[test]
fn release_is_refused_while_the_vfio_node_is_held_and_clears_once_when_free() {
    let a = agent(&[]);
    let owner = resource_claim("gpu-a", "uid-a");
    let p = prepare(&a, &owner, VF0, "L40S-2Q").unwrap();
    let group = p["vfio_group"].as_u64().unwrap();
    let mut holder = a.hold_open(&a.sim.path().join(format!("dev/vfio/{group}")));
    let seq = last_seq(&a.state());

    let e = a.err("claim.release", json!({"owner": owner, "device": VF0}));
    assert_eq!((e.code, e.data_code.as_str()), (409, "in_use"), "{e}");
    assert!(!e.data["pids"].as_array().unwrap().is_empty(), "{e}");
    assert!(type_writes(&a, VF0, seq).is_empty(), "nothing written while held");
    assert_eq!(a.vf_type(VF0), p["type_id"].as_u64().unwrap());
    assert_eq!(a.claim_file(VF0).unwrap()["owner"], owner, "the claim stays");

    holder.let_go();
    let r = a.ok("claim.release", json!({"owner": owner, "device": VF0}));
    assert_eq!(r, json!({"device": VF0, "released": true}));
    // One clear that took effect (the simulated kernel may answer EBUSY while it tears the
    // last user down: retried within release_retry_s).
    assert_eq!(writes_of(&a, VF0, seq, false), ["0"], "one clear, once free");
    assert_eq!(a.vf_type(VF0), 0);
    assert!(a.claim_file(VF0).is_none());
    let r = a.ok("claim.release", json!({"owner": owner, "device": VF0}));
    assert_eq!(r["released"], false, "already gone: {r}");
    assert_eq!(writes_of(&a, VF0, seq, false), ["0"]);
}

#[test]
fn the_reconciler_releases_claims_of_owners_absent_from_a_complete_fresh_list_only() {
    let a = agent(&[]);
    let (live, gone) = (resource_claim("live", "uid-live"), resource_claim("gone", "uid-gone"));
    prepare(&a, &live, VF0, "L40S-2Q").unwrap();
    prepare(&a, &gone, VF1, "L40S-2Q").unwrap();

    // Never told which owners exist: every external owner is maybe alive.
    let r = a.pass();
    for vf in [VF0, VF1] {
        assert!(!released(&r, vf), "{r}");
        assert!(kept_reason(&r, vf).is_some_and(|k| k.contains("maybe alive")), "{vf}: {r}");
    }
    // An incomplete list changes nothing.
    let o = a.ok("claim.owners", json!({"kind": "resource_claim", "live": ["uid-live"], "complete": false}));
    assert_eq!(o["recorded"], false);
    assert!(!released(&a.pass(), VF1));

    let o = a.ok("claim.owners", json!({"kind": "resource_claim", "live": ["uid-live"], "complete": true}));
    assert_eq!((o["recorded"].clone(), o["live"].clone(), o["lease_s"].clone()), (json!(true), json!(1), json!(300)));
    let seq = last_seq(&a.state());
    let r = a.pass();
    assert!(released(&r, VF1), "{r}");
    assert!(!released(&r, VF0), "{r}");
    assert_eq!(type_writes(&a, VF1, seq), ["0"]);
    assert!(a.claim_file(VF1).is_none());
    assert_eq!(a.claim_file(VF0).unwrap()["owner"], live);
    assert!(type_writes(&a, VF0, seq).is_empty());

    // An owner that prepares after the list in force lives until a list says otherwise
    // (its ResourceClaim may be newer than the list).
    let late = resource_claim("late", "uid-late");
    prepare(&a, &late, VF1, "L40S-2Q").unwrap();
    let r = a.pass();
    assert!(!released(&r, VF1), "BUG: a claim prepared after the last list was released: {r}");
    a.ok("claim.owners", json!({"kind": "resource_claim", "live": ["uid-live"], "complete": true}));
    assert!(released(&a.pass(), VF1), "the next complete list without it proves it done");
}

#[test]
fn a_stale_list_proves_nothing() {
    let a = agent(&[("external_owner_lease_s", "1")]);
    let owner = resource_claim("gpu-a", "uid-a");
    prepare(&a, &owner, VF0, "L40S-2Q").unwrap();
    a.ok("claim.owners", json!({"kind": "resource_claim", "live": [], "complete": true}));
    // The lease is a time: let it pass (the list only gets older).
    std::thread::sleep(Duration::from_millis(1500));
    let r = a.pass();
    assert!(!released(&r, VF0), "{r}");
    assert!(kept_reason(&r, VF0).is_some_and(|k| k.contains("external_owner_lease_s")), "{r}");
    assert!(a.claim_file(VF0).is_some());
}

#[test]
fn a_crash_between_claim_and_configure_leaves_a_claim_the_restarted_agent_resolves() {
    assert_failpoints_built();
    let mut a = agent(&[]);
    let owner = resource_claim("gpu-a", "uid-a");
    a.restart_with_failpoints(Some("after_claim_commit=return")).unwrap();
    a.wait_ready().unwrap();
    let e = prepare(&a, &owner, VF0, "L40S-2Q").unwrap_err();
    assert!(is_transport(&e), "the agent aborted at the failpoint: {e}");
    assert!(a.wait_agent_gone(Duration::from_secs(30)));
    let rec = a.claim_file(VF0).expect("the claim is durable");
    assert_eq!((rec["state"].clone(), rec["owner"].clone()), (json!("claimed"), owner.clone()));
    assert_eq!(a.vf_type(VF0), 0, "not configured");

    a.restart_clean();
    // No list yet: the half-done claim is kept, not released behind the owner's back.
    let r = a.pass();
    assert!(!released(&r, VF0), "{r}");
    assert!(a.claim_file(VF0).is_some());
    // The owner's retry resolves it: released through the guard, claimed and configured.
    let p = prepare(&a, &owner, VF0, "L40S-2Q").unwrap();
    assert_eq!(p["state"], "configured", "{p}");
    assert_eq!(a.vf_type(VF0), p["type_id"].as_u64().unwrap());
    assert_eq!(a.claim_file(VF0).unwrap()["state"], "configured");
}

#[test]
fn a_vm_on_a_resource_claim_uses_its_device_and_never_releases_it() {
    let a = agent(&[]);
    let owner = resource_claim("gpu-a", "uid-a");
    let p = prepare(&a, &owner, VF0, "L40S-2Q").unwrap();
    let type_id = p["type_id"].as_u64().unwrap();
    let e =
        a.err("instance.create", json!({"name": "nope", "image": "demo", "gpu": {"resource_claim": "default/other"}}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    let vm =
        a.ok("instance.create", json!({"name": "vm", "image": "demo", "gpu": {"resource_claim": "default/gpu-a"}}));
    assert_eq!(vm["state"], "running", "{vm}");
    assert_eq!(vm["gpu"]["device"], VF0, "{vm}");
    // The claim stays the ResourceClaim's; the VM's QEMU holds the VF.
    assert_eq!(a.claim_file(VF0).unwrap()["owner"], owner);
    let qemu = a.qemu_pids();
    assert_eq!(qemu.len(), 1, "{qemu:?}");
    // One VM per prepared device.
    let e =
        a.err("instance.create", json!({"name": "vm2", "image": "demo", "gpu": {"resource_claim": "default/gpu-a"}}));
    assert_eq!(e.data_code, "invalid_state", "{e}");

    // The guard refuses the release while the VM runs, and so does the reconciler for an
    // owner that is gone.
    let seq = last_seq(&a.state());
    let e = a.err("claim.release", json!({"owner": owner, "device": VF0}));
    assert_eq!(e.data_code, "in_use", "{e}");
    a.ok("claim.owners", json!({"kind": "resource_claim", "live": [], "complete": true}));
    let r = a.pass();
    assert!(!released(&r, VF0), "{r}");
    assert!(type_writes(&a, VF0, seq).is_empty());
    assert_eq!(a.vf_type(VF0), type_id);

    // Deleting the VM leaves the device configured and claimed for the ResourceClaim.
    a.ok("claim.owners", json!({"kind": "resource_claim", "live": ["uid-a"], "complete": true}));
    a.ok("instance.delete", json!({"ref": "vm"}));
    assert!(type_writes(&a, VF0, seq).is_empty(), "the VM's delete cleared nothing");
    assert_eq!(a.vf_type(VF0), type_id);
    assert_eq!(a.claim_file(VF0).unwrap()["owner"], owner);
    let r = a.ok("claim.release", json!({"owner": owner, "device": VF0}));
    assert_eq!(r["released"], true, "{r}");
    assert_eq!(writes_of(&a, VF0, seq, false), ["0"]);
}

#[test]
fn an_mdev_is_prepared_and_removed_through_the_same_paths() {
    let a = Agent::start_tuned(
        AgentOptions { model: "l40s-mdev", ..Default::default() },
        None,
        &[("reconcile_interval_s", "3600")],
    )
    .unwrap();
    let owner = resource_claim("gpu-m", "uid-m");
    let e = prepare(&a, &owner, VF0, "L40S-2Q").unwrap_err();
    assert_eq!(e.data_code, "invalid_request", "vendor_vfio on an mdev host: {e}");
    let p = a.ok("claim.prepare", json!({"owner": owner, "device": VF0, "kind": "mdev", "profile": "L40S-2Q"}));
    let uuid = p["mdev_uuid"].as_str().expect("an mdev uuid").to_string();
    assert_eq!((p["kind"].clone(), p["pci_address"].clone()), (json!("mdev"), Value::Null), "{p}");
    let mdevs = sim_mdevs(&a.state());
    assert!(mdevs.iter().any(|m| m["uuid"] == uuid.as_str()), "{mdevs:?}");
    let group = p["vfio_group"].as_u64().expect("the mdev's group");
    assert_eq!(p["device_nodes"], json!([format!("/dev/vfio/{group}"), "/dev/vfio/vfio"]));
    assert_eq!(a.ok("claim.prepare", json!({"owner": owner, "device": VF0, "kind": "mdev", "profile": "L40S-2Q"})), p);
    let r = a.ok("claim.release", json!({"owner": owner, "device": VF0}));
    assert_eq!(r["released"], true);
    assert!(!sim_mdevs(&a.state()).iter().any(|m| m["uuid"] == uuid.as_str()), "the mdev is removed");
    assert!(a.claim_file(VF0).is_none());
}

#[test]
fn a_whole_gpu_is_bound_for_an_external_owner_and_given_back_on_release() {
    const P1: &str = "0000:83:00.0";
    const P1A: &str = "0000:83:00.1";
    let a = Agent::start_tuned(
        AgentOptions {
            model: "pt-2",
            extra: "passthrough_gpus = [\"0000:82:00.0\", \"0000:83:00.0\", \"0000:84:00.0\"]\n",
            ..Default::default()
        },
        None,
        &[("reconcile_interval_s", "3600")],
    )
    .unwrap();
    let owner = resource_claim("gpu-w", "uid-w");
    let before = bindings(&[(P1, "nvidia"), (P1A, "snd_hda_intel")]);
    assert_eq!(a.pt_drivers(P1), before);
    let p = a.ok("claim.prepare", json!({"owner": owner, "device": P1, "kind": "passthrough"}));
    assert_eq!(
        (p["kind"].clone(), p["profile"].clone(), p["pci_address"].clone()),
        (json!("passthrough"), json!("passthrough"), json!(P1)),
        "{p}"
    );
    let group = p["vfio_group"].as_u64().unwrap();
    assert_eq!(p["device_nodes"], json!([format!("/dev/vfio/{group}"), "/dev/vfio/vfio"]));
    assert_eq!(a.pt_drivers(P1), bindings(&[(P1, "vfio-pci"), (P1A, "vfio-pci")]));
    let e = a.err("claim.prepare", json!({"owner": owner, "device": P1, "kind": "passthrough", "profile": "L40S-2Q"}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    let r = a.ok("claim.release", json!({"owner": owner, "device": P1}));
    assert_eq!(r["released"], true);
    assert_eq!(a.pt_drivers(P1), before, "given back to the recorded drivers");
}

#[test]
fn claimed_and_released_events_name_the_external_owner() {
    use std::io::BufRead;
    let a = agent(&[]);
    let mut child = std::process::Command::new(agent_binary())
        .arg("--socket")
        .arg(&a.socket)
        .args(["events", "--output", "json", "--type", "claimed", "--type", "released", "--type", "reconcile_pass"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Value>();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(serde_json::from_str(&l).unwrap_or(Value::Null)).is_err() {
                break;
            }
        }
    });
    // Subscribed once a pass run after the subscription shows up.
    let subscribed = wait_for(Duration::from_secs(60), || {
        a.pass();
        rx.recv_timeout(Duration::from_millis(500)).ok().filter(|e| e["type"] == "reconcile_pass")
    });
    assert!(subscribed.is_some(), "the subscriber never saw a pass");
    let owner = resource_claim("gpu-e", "uid-e");
    prepare(&a, &owner, VF0, "L40S-2Q").unwrap();
    a.ok("claim.release", json!({"owner": owner, "device": VF0}));
    let mut seen = Vec::new();
    while !seen.iter().any(|e: &Value| e["type"] == "released") {
        seen.push(rx.recv_timeout(Duration::from_secs(60)).expect("an event"));
    }
    let _ = child.kill();
    let _ = child.wait();
    let claimed = seen.iter().find(|e| e["type"] == "claimed").expect("claimed");
    assert_eq!((claimed["device"].clone(), claimed["owner"].clone()), (json!(VF0), owner.clone()), "{claimed}");
    assert!(claimed["instance_id"].is_null(), "{claimed}");
    let released = seen.iter().find(|e| e["type"] == "released").unwrap();
    assert_eq!((released["device"].clone(), released["owner"].clone()), (json!(VF0), owner), "{released}");
}

#[test]
fn a_second_call_for_a_device_being_prepared_is_refused_and_the_reconciler_leaves_it_alone() {
    assert_failpoints_built();
    let a = agent(&[]);
    let owner = resource_claim("gpu-a", "uid-a");
    a.ok("debug.failpoint", json!({"name": "after_claim_commit", "action": "pause"}));
    let first = a.spawn_call(
        "claim.prepare",
        json!({"owner": owner, "device": VF0, "kind": "vendor_vfio", "profile": "L40S-2Q"}),
    );
    let waiting = || {
        let l = a.ok("debug.failpoints", json!({}));
        l["failpoints"].as_array().unwrap().iter().find(|p| p["name"] == "after_claim_commit").unwrap()["waiting"]
            .as_u64()
            .unwrap_or(0)
    };
    wait_for(Duration::from_secs(30), || (waiting() >= 1).then_some(())).expect("the prepare paused after its claim");
    assert_eq!(a.claim_file(VF0).unwrap()["state"], "claimed");
    // The same owner again, and its release: refused while the first call works on it.
    let e = prepare(&a, &owner, VF0, "L40S-2Q").unwrap_err();
    assert_eq!((e.data_code.as_str(), e.data["release_error"]["code"].clone()), ("in_use", json!("busy")), "{e}");
    let e = a.err("claim.release", json!({"owner": owner, "device": VF0}));
    assert_eq!(e.data_code, "in_use", "{e}");
    // The owner is gone from a complete list, yet the pass leaves the device alone.
    a.ok("claim.owners", json!({"kind": "resource_claim", "live": [], "complete": true}));
    let r = a.pass();
    assert!(!released(&r, VF0), "{r}");
    a.ok("debug.failpoint", json!({"name": "after_claim_commit", "action": "release"}));
    let answer = first.join().unwrap().unwrap();
    assert_eq!(answer["result"]["state"], "configured", "{answer}");
    assert_eq!(a.vf_type(VF0), answer["result"]["type_id"].as_u64().unwrap());
    assert_eq!(a.claim_file(VF0).unwrap()["state"], "configured");
}
