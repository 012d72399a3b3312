//! docs/design/invariants.md "How they are tested", item 2, for whole-GPU passthrough: the sysfs fault
//! matrix of the passthrough write sites — `driver_override`, a driver's `unbind`,
//! `drivers_probe` (the bind), vfio-pci's `unbind` and `reset` (the give-back) — × errno
//! (EBUSY, EINVAL, EIO, ENODEV, EPERM) × (once, forever), against the real agent,
//! gpuvisor-sim's `pt-2` and (paused) QEMU.
//!
//! For each cell: arm the fault, run the operation that reaches the site (create for the
//! bind sites, stop for the give-back sites), check the answer (a code of docs/design/lifecycle.md's
//! table, never `internal`, never a dead agent), check the invariant after every step — a
//! GPU with no claim has every function on its boot driver: never a half-bound group that
//! looks free —, then `clear-faults`, recover as docs/design/lifecycle.md says (delete the instance, or
//! one reconcile pass) and check the baseline: no claim, group 40 on its boot drivers, and a
//! create that succeeds.
//!
//! Expectations: a failed bind write fails the create at once (a bind is not retried) and
//! the release path gives the group back — `passthrough_bind_failed` — unless the give-back
//! needs the same write and it fails forever (`drivers_probe`), when the claim is retained
//! (`vgpu_cleanup_pending`, `retained: true`). A failed give-back write is retried inline
//! for `release_retry_s`: once → the stop releases; forever → the stop succeeds with the
//! claim `release_pending`. A reset that fails with EIO is a wedged GPU: quarantined
//! (`reset_failed`) at once and its functions still given back.

use gpuvisor_e2e::*;
use serde_json::{json, Value};

const P0: &str = "0000:82:00.0";
const P0A: &str = "0000:82:00.1";
const BRIDGE: &str = "0000:80:01.0";
const ERRNOS: [&str; 5] = ["EBUSY", "EINVAL", "EIO", "ENODEV", "EPERM"];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Once,
    Forever,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Site {
    /// p0's `driver_override` (bind: `vfio-pci`; give-back: cleared).
    Override,
    /// `drivers/nvidia/unbind` (bind: p0 leaves nvidia).
    HostUnbind,
    /// `drivers/snd_hda_intel/unbind` (bind, mid-group: p0 moved, its audio refused).
    CompanionUnbind,
    /// `drivers_probe` (bind and give-back).
    Probe,
    /// `drivers/vfio-pci/unbind` (give-back).
    VfioUnbind,
    /// p0's `reset` (give-back).
    Reset,
}

impl Site {
    fn path(self) -> String {
        match self {
            Site::Override => format!("sys/bus/pci/devices/{P0}/driver_override"),
            Site::HostUnbind => "sys/bus/pci/drivers/nvidia/unbind".into(),
            Site::CompanionUnbind => "sys/bus/pci/drivers/snd_hda_intel/unbind".into(),
            Site::Probe => "sys/bus/pci/drivers_probe".into(),
            Site::VfioUnbind => "sys/bus/pci/drivers/vfio-pci/unbind".into(),
            Site::Reset => format!("sys/bus/pci/devices/{P0}/reset"),
        }
    }

    fn at_bind(self) -> bool {
        matches!(self, Site::Override | Site::HostUnbind | Site::CompanionUnbind | Site::Probe)
    }
}

fn boot_p0() -> Vec<(String, String)> {
    bindings(&[(P0, "nvidia"), (P0A, "snd_hda_intel"), (BRIDGE, "pcieport")])
}

fn drivers(a: &Agent) -> Vec<(String, String)> {
    a.pt_drivers(P0)
}

/// The invariant: no claim ⇒ every function on its boot driver; the agent answers.
fn invariant(a: &Agent, cell: &str, step: &str, out: &mut Vec<String>) {
    if a.call("agent.health", json!({})).is_err() {
        out.push(format!("{cell} [{step}] the agent does not answer"));
        return;
    }
    if a.claim(P0).is_none() && drivers(a) != boot_p0() {
        out.push(format!("{cell} [{step}] p0 has no claim but is bound {:?}", drivers(a)));
    }
}

fn create(a: &Agent, name: &str) -> Result<Value, RpcError> {
    a.call("instance.create", json!({"name": name, "image": "demo", "gpu": {"passthrough": true, "address": P0}}))
}

/// Back to baseline after a cell: faults cleared, the instance deleted, the health mark
/// cleared, one pass; then checked (no claim, boot drivers, a create and delete succeed).
fn recover(a: &Agent, cell: &str, out: &mut Vec<String>) {
    a.sim.ctl(&["clear-faults"]).unwrap();
    if a.instance_names().contains(&"c".to_string()) {
        if let Err(e) = a.call("instance.delete", json!({"ref": "c"})) {
            out.push(format!("{cell} [recovery] delete failed: {e}"));
        }
    }
    let _ = a.call("gpu.unquarantine", json!({"device": P0}));
    a.pass();
    if a.claim(P0).is_some() || drivers(a) != boot_p0() {
        out.push(format!("{cell} [recovery] claim {:?}, drivers {:?}", a.claim(P0), drivers(a)));
    }
    match create(a, "base") {
        Ok(_) => {
            a.ok("instance.delete", json!({"ref": "base"}));
        }
        Err(e) => out.push(format!("{cell} [recovery] a create after the fault failed: {e}")),
    }
}

fn bind_cell(a: &Agent, site: Site, errno: &str, mode: Mode, out: &mut Vec<String>) {
    let cell = format!("{site:?}/{errno}/{mode:?}");
    let times: &[&str] = if mode == Mode::Once { &["--times", "1"] } else { &["--always"] };
    let path = site.path();
    let mut args = vec!["fail-write", path.as_str(), errno];
    args.extend_from_slice(times);
    a.sim.ctl(&args).unwrap();
    let r = create(a, "c");
    invariant(a, &cell, "after create", out);
    let retained = site == Site::Probe && mode == Mode::Forever;
    let want = if retained { "vgpu_cleanup_pending" } else { "passthrough_bind_failed" };
    match &r {
        Err(e) if e.data_code == want => {
            if retained && (e.data["retained"] != true || a.claim(P0).is_none()) {
                out.push(format!("{cell} the claim must be retained: {e}; claim {:?}", a.claim(P0)));
            }
            if !retained && (a.claim(P0).is_some() || drivers(a) != boot_p0()) {
                out.push(format!("{cell} not given back: claim {:?}, drivers {:?}", a.claim(P0), drivers(a)));
            }
        }
        other => out.push(format!("{cell} expected {want}, got {other:?}")),
    }
    recover(a, &cell, out);
}

fn release_cell(a: &Agent, site: Site, errno: &str, mode: Mode, out: &mut Vec<String>) {
    let cell = format!("{site:?}/{errno}/{mode:?}");
    if let Err(e) = create(a, "c") {
        out.push(format!("{cell} the create without a fault failed: {e}"));
        return recover(a, &cell, out);
    }
    let times: &[&str] = if mode == Mode::Once { &["--times", "1"] } else { &["--always"] };
    let path = site.path();
    let mut args = vec!["fail-write", path.as_str(), errno];
    args.extend_from_slice(times);
    a.sim.ctl(&args).unwrap();
    let r = a.call("instance.stop", json!({"ref": "c", "force": true}));
    invariant(a, &cell, "after stop", out);
    match &r {
        Ok(v) if v["state"] == "stopped" => {}
        other => out.push(format!("{cell} the stop must succeed: {other:?}")),
    }
    let wedged = site == Site::Reset && errno == "EIO";
    let released = mode == Mode::Once || wedged;
    let claim = a.claim(P0);
    if released && (claim.is_some() || drivers(a) != boot_p0()) {
        out.push(format!("{cell} expected the release: claim {claim:?}, drivers {:?}", drivers(a)));
    }
    if !released && claim.as_ref().map(|c| c["state"].clone()) != Some(json!("release_pending")) {
        out.push(format!("{cell} expected the claim release_pending: {claim:?}"));
    }
    let mark = a.ok("gpu.list", json!({}))["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["address"] == P0)
        .map(|g| g["devices"][0]["quarantine"]["reason"].clone())
        .unwrap_or(Value::Null);
    if wedged != (mark == "reset_failed") {
        out.push(format!("{cell} quarantine mark {mark} (a reset EIO, and only it, quarantines at once)"));
    }
    recover(a, &cell, out);
}

fn run(site: Site) {
    let w = QemuWrapper::new();
    let a = Agent::start_tuned(
        AgentOptions {
            model: "pt-2",
            extra: &format!("passthrough_gpus = [\"{P0}\"]\n{}", w.extra()),
            ..Default::default()
        },
        None,
        &[("release_retry_s", "2")],
    )
    .unwrap();
    let mut out = Vec::new();
    let mut cells = 0;
    for errno in ERRNOS {
        for mode in [Mode::Once, Mode::Forever] {
            cells += 1;
            if site.at_bind() {
                bind_cell(&a, site, errno, mode, &mut out);
            } else {
                release_cell(&a, site, errno, mode, &mut out);
            }
        }
    }
    println!("{site:?}: {} cells passed, {} failed", cells - out.len().min(cells), out.len());
    assert!(out.is_empty(), "{site:?}:\n{}\n{}", out.join("\n"), tail(&a.log(), 30));
}

#[test]
fn passthrough_faults_driver_override() {
    run(Site::Override);
}

#[test]
fn passthrough_faults_host_driver_unbind() {
    run(Site::HostUnbind);
}

#[test]
fn passthrough_faults_companion_unbind() {
    run(Site::CompanionUnbind);
}

#[test]
fn passthrough_faults_drivers_probe() {
    run(Site::Probe);
}

#[test]
fn passthrough_faults_vfio_unbind() {
    run(Site::VfioUnbind);
}

#[test]
fn passthrough_faults_reset() {
    run(Site::Reset);
}
