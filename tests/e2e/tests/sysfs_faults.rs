//! docs/design/invariants.md "How they are tested", item 2: the **sysfs fault matrix**, against the real
//! agent, gpuvisor-sim and (paused) QEMU.
//!
//! Every write site × errno (EBUSY, EINVAL, EIO, ENODEV, EPERM) × (once, N times, forever),
//! injected with the simulator's `fail-write` (a glob: every device of the site, `--times`
//! counting across all of them). Passthrough is not built, so the sites are the vendor-VFIO
//! type write (create), the vendor-VFIO clear (stop/delete release), mdev create and mdev
//! remove: 4 × 5 × 3 = 60 cells, one `#[test]` (and one agent) per site.
//!
//! For each cell: arm the fault, run the operation that reaches the site, check the precise
//! answer (success, or a JSON-RPC error whose `data.code` is in docs/design/lifecycle.md's Errors table —
//! never `internal`, never a dead agent), run the invariant checker after every step, then
//! `clear-faults`, retry as docs/design/lifecycle.md says and check recovery (the operation succeeds, the
//! device is back at baseline, no claim left). Between cells the host goes back to a clean
//! baseline, checked (safety and liveness) before the next cell.
//!
//! Every cell runs to its end and records its failures; the test prints one line per cell,
//! `N cells passed, N failed`, and fails with a table of every failing cell.
//!
//! Why the expectations do not depend on the errno (except for EIO, the one errno with health
//! accounting): the agent never branches on which errno a type write or an mdev create
//! returned — "treats it as 'not creatable here': re-reads, tries the next candidate, never
//! branches on which errno came back" (docs/design/host.md §4; docs/design/lifecycle.md Create step 4 "release
//! that claim through the guard, and try the next ranked candidate; when none is left, answer
//! `no_capacity`"); and a failed clear/remove is a failed release whatever the errno
//! (docs/design/lifecycle.md Stop step 3 "Failure keeps the claim as `release_pending`; stop still
//! succeeds"; Delete step 4), which the guard retries inline for `release_retry_s`
//! (docs/configuration.md, docs/gpu.md "The release guard"). An EINVAL on a clear is retried
//! like any other failed clear: docs/design/host.md §4's "treats it as a bug; does not retry" is
//! about the kernel parser refusing text, and `0` always parses; the release guard
//! (docs/design/lifecycle.md step 4) does not distinguish errnos.
//!
//! The errno-specific rules are docs/design/lifecycle.md "Device health" (implemented in
//! agent/src/instances/health.rs and claim.rs). A health record is `health/<device>.json`
//! (`reason`, `quarantined` — `false` is `suspect` —, `eio_in_a_row`):
//! - only EIO is a strike; every other errno leaves no health record;
//! - **release-time** EIO (type clear, mdev remove): the first makes the device `suspect`
//!   (`eio_in_a_row` 1), a second in a row quarantines it; a write that takes effect resets
//!   the count;
//! - **create-time** EIO (type write, mdev create) is weaker evidence: "two EIOs on a VF whose
//!   catalog listed the type make that VF suspect, never quarantined" — the first leaves no
//!   record, a second in a row on the same device writes `reason: "create_eio"`, suspect;
//! - **no cascade**: "when one operation, or several within a short window, see the same
//!   error on several devices of one GPU, that is one GPU-level problem — one mark on the GPU,
//!   one message, no strike against each VF — which clears by itself when a later write on
//!   that GPU succeeds". An EIO on a device while another device of the same GPU had an EIO
//!   within the last 60 s (`GPU_FAULT_WINDOW`), or while the GPU already has a `gpu_fault`
//!   mark, writes (or keeps) `health/<PF>.json` with `reason: "gpu_fault"`,
//!   `quarantined: false` (it never blocks placement), counts no strike against the device,
//!   and lifts the EIO strikes (`eio`, `create_eio` records) of the devices involved; the
//!   agent logs one "GPU-level fault" error per mark raised; the mark is removed by the next
//!   write on that GPU that succeeds;
//! - a create skips the rest of a GPU whose write failure was judged GPU-level (so on this
//!   single 4-VF GPU it answers 409 `no_capacity` naming "a GPU- or driver-level fault"), and
//!   independently gives up after `MAX_CONFIGURE_FAILURES` = 4 failed writes. So EIO "3x" on a
//!   create site fails the create after 2 devices and leaves the fault with 1 count left.
//!
//! The 60 s window spans operations and cells (the cells of a site share one agent), so an
//! EIO cell's outcome depends on the EIO cells before it. The test does not sleep the window
//! away: it keeps [`HealthModel`], the rules above applied to every write of the simulator's
//! log in order (timed by the log's `t_ms`), and derives the expectations
//! from it — which writes a create makes and where it stops (and so its answer and the fault
//! count left), where a start lands (quarantined devices are never placed), the exact set of
//! health records after every step, one "GPU-level fault" message per GPU mark raised, no
//! `gpu_fault` mark left once a later write on the GPU succeeded (the recovery after
//! `clear-faults`), and no device left quarantined by EIO strikes at the end of a cell whose
//! EIOs were judged GPU-level. Two EIOs within 1 s of the window's edge cannot be judged from
//! the log's times (the agent's clock reads a few ms later): such a cell fails as undecidable
//! (the EIO cells of a site run within seconds of each other, so it does not happen).

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// Host V (one L40S, VFs `.4`–`.7`) without the simulator's teardown lag: a clear or remove
/// right after QEMU exits would otherwise also fail with EBUSY for 300 ms, and the cells count
/// the failed writes exactly — with no lag, every failed write in the log is an injected one.
/// (The lag itself is covered by rollback_retention.rs and stop_delete.rs.)
const HOST_V0: &str = "release_delay_ms = 0\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
/// The same host with the mdev framework: every VF is an mdev parent.
const HOST_M0: &str =
    "framework = \"mdev\"\nrelease_delay_ms = 0\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
const PROFILE: &str = "L40S-1Q";
const ERRNOS: [&str; 5] = ["EBUSY", "EINVAL", "EIO", "ENODEV", "EPERM"];
/// "N times": fewer than the 4 candidates of a create (so the create still succeeds on the
/// 4th VF — except with EIO, where the second device's EIO is GPU-level and ends the create),
/// and fewer than the inline release attempts within `release_retry_s` (so the release still
/// succeeds inline).
const N: usize = 3;
/// Inline release budget. The guard backs off 250 ms → 500 ms → 1 s → 2 s: attempts at about
/// 0, 0.25, 0.75 and 1.75 s, so 4 attempts (N + 1), with over a second of slack for the 4th.
const RELEASE_RETRY_S: &str = "3";

/// Every `data.code` of docs/design/lifecycle.md's Errors table — except `internal`, which no sysfs
/// fault may produce (the brief: "never a panic or `internal` error").
const ERROR_TABLE: &[&str] = &[
    "invalid_request",
    "unknown_profile",
    "hypervisor_unsupported",
    "not_found",
    "name_taken",
    "invalid_state",
    "no_capacity",
    "instance_cleanup_pending",
    "unsupported_with_gpu",
    "gpu_release_pending",
    "device_unhealthy",
    "iommu_group_conflict",
    "gpu_busy",
    "vgpu_cleanup_pending",
    "vmm_start_failed",
    "vmm_kill_failed",
    "passthrough_bind_failed",
    "policy_failed",
    "not_ready",
    "vmm_liveness_unknown",
];

#[derive(Clone, Copy, PartialEq, Debug)]
enum Site {
    /// `nvidia/current_vgpu_type` ← type id (create's configure step).
    SetType,
    /// `nvidia/current_vgpu_type` ← 0 (the release guard: stop, delete, reconciler).
    ClearType,
    /// `mdev_supported_types/<type>/create` (create's configure step).
    MdevCreate,
    /// `sys/bus/mdev/devices/<uuid>/remove` (the release guard).
    MdevRemove,
}

impl Site {
    fn name(self) -> &'static str {
        match self {
            Site::SetType => "set-type",
            Site::ClearType => "clear-type",
            Site::MdevCreate => "mdev-create",
            Site::MdevRemove => "mdev-remove",
        }
    }
    fn pattern(self) -> &'static str {
        match self {
            Site::SetType | Site::ClearType => "sys/bus/pci/devices/*/nvidia/current_vgpu_type",
            Site::MdevCreate => "sys/class/mdev_bus/*/mdev_supported_types/*/create",
            Site::MdevRemove => "sys/bus/mdev/devices/*/remove",
        }
    }
    fn mdev(self) -> bool {
        matches!(self, Site::MdevCreate | Site::MdevRemove)
    }
    fn release(self) -> bool {
        matches!(self, Site::ClearType | Site::MdevRemove)
    }
    /// True when a logged write (display path) belongs to this site.
    fn matches(self, path: &str) -> bool {
        match self {
            Site::SetType | Site::ClearType => {
                path.starts_with("sys/bus/pci/devices/") && path.ends_with("/nvidia/current_vgpu_type")
            }
            Site::MdevCreate => path.contains("/mdev_supported_types/") && path.ends_with("/create"),
            Site::MdevRemove => path.starts_with("sys/bus/mdev/devices/") && path.ends_with("/remove"),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Once,
    Times,
    Forever,
}

const MODES: [Mode; 3] = [Mode::Once, Mode::Times, Mode::Forever];

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Once => "once",
            Mode::Times => "3x",
            Mode::Forever => "always",
        }
    }
    /// How many writes fail (`None`: every one).
    fn count(self) -> Option<usize> {
        match self {
            Mode::Once => Some(1),
            Mode::Times => Some(N),
            Mode::Forever => None,
        }
    }
}

/// How a retained release is retried once the fault stops (docs/design/lifecycle.md: "Stopping a stopped
/// instance retries a pending release"; Delete step 4 "A later `instance.delete` retries; the
/// reconciler retries too"), rotated over the errnos so each path is exercised.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Retry {
    StopAgain,
    DeleteAgain,
    Pass,
}

fn retry_for(errno: &str) -> Retry {
    match errno {
        "EBUSY" | "ENODEV" => Retry::StopAgain,
        "EINVAL" | "EPERM" => Retry::DeleteAgain,
        _ => Retry::Pass,
    }
}

/// The devices of the host, in placement order (spread on one idle GPU: by address).
fn devices() -> Vec<String> {
    V_VFS.iter().map(|s| s.to_string()).collect()
}

fn agent(site: Site, w: &QemuWrapper) -> Agent {
    let model = if site.mdev() { HOST_M0 } else { HOST_V0 };
    // No periodic pass: every release in a cell is one the test triggered.
    let extra = w.extra() + "reconcile_interval_s = 3600\n";
    Agent::start_tuned(
        AgentOptions { model, extra: &extra, ..Default::default() },
        None,
        &[("release_retry_s", RELEASE_RETRY_S)],
    )
    .unwrap()
}

// ------------------------------------------------------------------------------ health model

/// The GPU (PF) of every device of the test's host.
const PF: &str = "0000:41:00.0";
/// agent/src/instances/health.rs `GPU_FAULT_WINDOW`.
const GPU_FAULT_WINDOW_MS: u64 = 60_000;
/// Two EIOs this close to the window's edge cannot be judged from the log's times.
const WINDOW_MARGIN_MS: u64 = 1_000;
/// agent/src/instances/claim.rs `MAX_CONFIGURE_FAILURES`.
const MAX_CONFIGURE_FAILURES: usize = 4;
/// The reason of a GPU-level mark.
const GPU_FAULT: &str = "gpu_fault";
/// The error the agent logs once per GPU mark raised (the rules' "one message").
const GPU_FAULT_MESSAGE: &str = "GPU-level fault: one mark on the GPU";

/// A health record (`health/<device>.json`): the fields the rules set.
#[derive(Clone, Debug, PartialEq)]
struct Mark {
    reason: String,
    quarantined: bool,
    eio_in_a_row: u64,
}

impl Mark {
    fn new(reason: &str, quarantined: bool, eio_in_a_row: u64) -> Mark {
        Mark { reason: reason.to_string(), quarantined, eio_in_a_row }
    }

    /// An EIO strike (lifted when the EIO turns out to be GPU-level).
    fn eio_strike(&self) -> bool {
        matches!(self.reason.as_str(), "eio" | "create_eio")
    }
}

impl std::fmt::Display for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.quarantined { "quarantined" } else { "suspect" };
        write!(f, "{state}:{}/eio_in_a_row={}", self.reason, self.eio_in_a_row)
    }
}

fn marks_text(m: &BTreeMap<String, Mark>) -> String {
    let v: Vec<String> = m.iter().map(|(d, m)| format!("{d}={m}")).collect();
    format!("{{{}}}", v.join(", "))
}

/// What the rules make of one write.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Verdict {
    /// Success, not an EIO, or a first create-time EIO.
    None,
    /// A strike against the device.
    Strike,
    /// One GPU-level problem: a mark on the GPU, no strike.
    GpuLevel,
}

/// One logged write of a health-accounted site.
#[derive(Clone, Debug)]
struct Write {
    site: Site,
    /// The VF (mdev: the parent).
    dev: String,
    /// `ok` or the errno name.
    result: String,
    t_ms: u64,
}

/// The device-health rules (module docs) applied to the simulator's write log, in order:
/// what the agent's health records must be, computed from what the test observed.
#[derive(Clone, Debug, Default)]
struct HealthModel {
    /// The last log entry fed.
    seq: u64,
    /// The expected health records.
    marks: BTreeMap<String, Mark>,
    /// Create-time EIOs in a row per device (kept in the agent's memory only).
    streaks: BTreeMap<String, u32>,
    /// `(device, t_ms)` of every EIO write.
    eios: Vec<(String, u64)>,
    /// mdev UUID → parent, from the logged `create` writes.
    parents: BTreeMap<String, String>,
    /// GPU marks raised (no mark → mark): one "GPU-level fault" message each.
    raised: usize,
    /// Writes judged GPU-level.
    gpu_level: usize,
    /// Judgements the log's times cannot decide.
    undecidable: Vec<String>,
}

impl HealthModel {
    /// The health-accounted write of a log entry, if it is one.
    fn parse(&mut self, e: &Value) -> Option<Write> {
        if e["op"] != "write" {
            return None;
        }
        let path = e["path"].as_str()?;
        let value = e["value"].as_str().unwrap_or("").trim();
        let comp: Vec<&str> = path.split('/').collect();
        let (site, dev) = if Site::SetType.matches(path) {
            (if value == "0" { Site::ClearType } else { Site::SetType }, comp.get(4)?.to_string())
        } else if Site::MdevCreate.matches(path) {
            let parent = comp.get(3)?.to_string();
            self.parents.insert(value.to_string(), parent.clone());
            (Site::MdevCreate, parent)
        } else if Site::MdevRemove.matches(path) {
            let u = comp.get(4)?;
            (Site::MdevRemove, self.parents.get(*u).cloned().unwrap_or_else(|| u.to_string()))
        } else {
            return None;
        };
        let result = e["result"].as_str().unwrap_or("").to_string();
        Some(Write { site, dev, result, t_ms: e["t_ms"].as_u64().unwrap_or(0) })
    }

    /// Feeds every write logged since the last sync; returns them with their verdicts.
    fn sync(&mut self, a: &Agent) -> Vec<(Write, Verdict)> {
        let mut log = log_after(&a.state(), self.seq);
        log.sort_by_key(|e| e["seq"].as_u64().unwrap_or(0));
        let mut out = Vec::new();
        for e in log {
            self.seq = self.seq.max(e["seq"].as_u64().unwrap_or(0));
            if let Some(w) = self.parse(&e) {
                let v = self.feed(&w);
                out.push((w, v));
            }
        }
        out
    }

    fn feed(&mut self, w: &Write) -> Verdict {
        match w.result.as_str() {
            "ok" => {
                self.succeeded(&w.dev);
                Verdict::None
            }
            "EIO" => self.eio(w),
            _ => Verdict::None,
        }
    }

    /// A write that took effect: the device's EIO runs end, the GPU mark goes.
    fn succeeded(&mut self, dev: &str) {
        self.streaks.remove(dev);
        if let Some(m) = self.marks.get_mut(dev) {
            if !m.quarantined {
                m.eio_in_a_row = 0;
            }
        }
        if self.marks.get(PF).is_some_and(|m| m.reason == GPU_FAULT) {
            self.marks.remove(PF);
        }
    }

    fn eio(&mut self, w: &Write) -> Verdict {
        let mut involved = BTreeSet::new();
        for (d, t) in &self.eios {
            if *d == w.dev {
                continue;
            }
            let age = w.t_ms.saturating_sub(*t);
            if age.abs_diff(GPU_FAULT_WINDOW_MS) <= WINDOW_MARGIN_MS {
                self.undecidable.push(format!(
                    "the EIO on {} came {age} ms after one on {d}: too close to the {GPU_FAULT_WINDOW_MS} ms window \
                     to tell whether it is GPU-level",
                    w.dev
                ));
            }
            if age < GPU_FAULT_WINDOW_MS {
                involved.insert(d.clone());
            }
        }
        self.eios.push((w.dev.clone(), w.t_ms));
        let marked = self.marks.get(PF).is_some_and(|m| m.reason == GPU_FAULT);
        if marked || !involved.is_empty() {
            // No cascade: one mark on the GPU, no strike, the EIO strikes involved lifted.
            self.raised += usize::from(!marked);
            self.gpu_level += 1;
            self.marks.insert(PF.to_string(), Mark::new(GPU_FAULT, false, 0));
            involved.insert(w.dev.clone());
            for d in &involved {
                self.streaks.remove(d);
                if self.marks.get(d).is_some_and(Mark::eio_strike) {
                    self.marks.remove(d);
                }
            }
            return Verdict::GpuLevel;
        }
        if !w.site.release() {
            // Create-time: the first EIO is remembered only; a second in a row: suspect.
            let n = self.streaks.entry(w.dev.clone()).or_insert(0);
            *n += 1;
            if *n < 2 {
                return Verdict::None;
            }
            self.marks.entry(w.dev.clone()).or_insert_with(|| Mark::new("create_eio", false, 0));
            return Verdict::Strike;
        }
        // Release-time: suspect, then quarantined.
        match self.marks.get(&w.dev).cloned() {
            Some(m) if m.quarantined => {}
            Some(m) if m.eio_in_a_row >= 1 => {
                self.marks.insert(w.dev.clone(), Mark::new("eio", true, 0));
            }
            prior => {
                let reason = prior.map(|m| m.reason).unwrap_or_else(|| "eio".into());
                self.marks.insert(w.dev.clone(), Mark::new(&reason, false, 1));
            }
        }
        Verdict::Strike
    }

    /// `gpu.unquarantine` of `key`: its record and its create-time streak go.
    fn unquarantine(&mut self, key: &str) {
        self.marks.remove(key);
        self.streaks.remove(key);
    }

    /// The devices placement may use, in placement order (quarantined ones are never ranked).
    fn placeable(&self, devs: &[String]) -> Vec<String> {
        devs.iter().filter(|d| !self.marks.get(*d).is_some_and(|m| m.quarantined)).cloned().collect()
    }
}

/// How a create under the fault ends.
#[derive(Clone, Debug, PartialEq)]
enum CreateEnd {
    /// Configured on this device.
    Landed(String),
    /// 409 `no_capacity`; `gpu_level`: because a failure was judged GPU-level.
    NoCapacity { gpu_level: bool },
}

/// The writes a create makes and how it ends (docs/design/lifecycle.md Create step 4, claim.rs): each
/// candidate in turn takes the fault while it has counts left; a GPU-level verdict skips the
/// rest of the GPU (here: every other candidate); `MAX_CONFIGURE_FAILURES` failed writes end
/// it. `observed` gives the times the window is judged with.
fn expect_create(
    before: &HealthModel,
    cands: &[String],
    site: Site,
    errno: &str,
    count: Option<usize>,
    observed: &[Write],
) -> (Vec<(String, String)>, CreateEnd) {
    let mut m = before.clone();
    let mut left = count;
    let mut want = Vec::new();
    for (i, d) in cands.iter().enumerate() {
        if want.len() >= MAX_CONFIGURE_FAILURES {
            break;
        }
        let fails = left.is_none_or(|n| n > 0);
        let result = if fails { errno } else { "ok" };
        want.push((d.clone(), result.to_string()));
        if !fails {
            return (want, CreateEnd::Landed(d.clone()));
        }
        left = left.map(|n| n - 1);
        let t_ms = observed.get(i).or(observed.last()).map(|w| w.t_ms).unwrap_or(0);
        if m.feed(&Write { site, dev: d.clone(), result: result.to_string(), t_ms }) == Verdict::GpuLevel {
            return (want, CreateEnd::NoCapacity { gpu_level: true });
        }
    }
    (want, CreateEnd::NoCapacity { gpu_level: false })
}

// ------------------------------------------------------------------------------- observation

/// The harness checker (I1, I3, I4 on VFs) plus the same for mdevs, which the harness
/// checker does not map (a QEMU on an mdev holds the mdev's group node, not a VF's).
fn violations(a: &Agent) -> Vec<String> {
    let w = World::observe(a);
    let mut v = w.safety_violations(&[]);
    v.extend(mdev_violations(a, &w));
    v
}

fn mdev_violations(a: &Agent, w: &World) -> Vec<String> {
    let mut v = Vec::new();
    let root = a.sim.path().to_string_lossy().into_owned();
    let mdevs = sim_mdevs(&w.state);
    for m in mdevs.iter().filter(|m| m["foreign"] != true) {
        let uuid = m["uuid"].as_str().unwrap_or("?");
        let claims: Vec<&(String, Value)> = w.claims.iter().filter(|(_, c)| c["mdev_uuid"] == uuid).collect();
        match claims.as_slice() {
            [] => v.push(format!("I4: gpuvisor's mdev {uuid} exists with no claim")),
            [(d, _)] if m["parent"] != d.as_str() => {
                v.push(format!("claim {d} names mdev {uuid}, which sits under {}", m["parent"]))
            }
            [_] => {}
            _ => v.push(format!("I3: {} claims name mdev {uuid}", claims.len())),
        }
    }
    for q in &w.qemus {
        let targets = fd_targets(q.pid);
        for m in &mdevs {
            let node = format!("{root}/dev/vfio/{}", m["group"]);
            if !targets.contains(&node) {
                continue;
            }
            match w.claims.iter().find(|(_, c)| c["mdev_uuid"] == m["uuid"]) {
                None => v.push(format!(
                    "I1/I4: mdev {} held by live QEMU {} has no claim",
                    m["uuid"].as_str().unwrap_or("?"),
                    q.pid
                )),
                Some((_, c)) if c["instance_id"].as_str() != q.instance_id.as_deref() => v.push(format!(
                    "I3: mdev {} held by QEMU {} of {:?} is claimed by {}",
                    m["uuid"].as_str().unwrap_or("?"),
                    q.pid,
                    q.instance_id,
                    c["instance_id"]
                )),
                Some(_) => {}
            }
        }
    }
    for (d, c) in &w.claims {
        let Some(u) = c["mdev_uuid"].as_str() else { continue };
        let owner = c["instance_id"].as_str();
        let live = w.qemus.iter().any(|q| q.instance_id.as_deref() == owner);
        if live && !mdevs.iter().any(|m| m["uuid"] == u) {
            v.push(format!("I1: mdev {u} of claim {d} is gone while its owner's QEMU lives"));
        }
    }
    v
}

/// Health records (`health/<device>.json`): device → mark. An unreadable record reads as
/// an unknown reason, quarantined.
fn health(a: &Agent) -> BTreeMap<String, Mark> {
    let mut out = BTreeMap::new();
    for f in a.data_files("health") {
        let Some(dev) = f.strip_suffix(".json") else { continue };
        let text = std::fs::read_to_string(a.data_dir.join("health").join(&f)).unwrap_or_default();
        let rec: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let mark = Mark {
            reason: rec["reason"].as_str().unwrap_or("?").to_string(),
            quarantined: rec["quarantined"].as_bool().unwrap_or(true),
            eio_in_a_row: rec["eio_in_a_row"].as_u64().unwrap_or(0),
        };
        out.insert(dev.to_string(), mark);
    }
    out
}

/// The differences between the health records and the model's.
fn marks_diff(now: &BTreeMap<String, Mark>, want: &BTreeMap<String, Mark>) -> Vec<String> {
    let mut d = Vec::new();
    for (k, m) in now {
        match want.get(k) {
            None => d.push(format!("unexpected {k}={m}")),
            Some(w) if w != m => d.push(format!("{k}={m}, expected {w}")),
            Some(_) => {}
        }
    }
    d.extend(want.iter().filter(|(k, _)| !now.contains_key(*k)).map(|(k, w)| format!("missing {k}={w}")));
    d
}

fn not_found(a: &Agent, name: &str) -> bool {
    a.call("instance.get", json!({"ref": name})).err().map(|e| e.data_code == "not_found").unwrap_or(false)
}

/// Brings the host back to the clean baseline and checks it (the health records the deletes
/// leave must be the model's; `gpu.unquarantine` then clears them, in the model too).
/// Returns the problems.
fn reset(a: &Agent, h: &mut HealthModel) -> Vec<String> {
    let mut p = Vec::new();
    if let Err(e) = a.sim.ctl(&["clear-faults"]) {
        p.push(format!("clear-faults: {e}"));
    }
    let names: Vec<String> = match a.call("instance.list", json!({})) {
        Ok(l) => l["instances"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|i| i["name"].as_str().unwrap_or("").to_string())
            .collect(),
        Err(e) => {
            p.push(format!("instance.list: {e}"));
            Vec::new()
        }
    };
    for n in names {
        if let Err(e) = a.call("instance.delete", json!({"ref": n})) {
            p.push(format!("delete {n}: {e}"));
        }
    }
    if let Err(e) = a.call("reconcile.run", json!({})) {
        p.push(format!("reconcile.run: {e}"));
    }
    h.sync(a);
    p.extend(std::mem::take(&mut h.undecidable));
    let marks = health(a);
    let diff = marks_diff(&marks, &h.marks);
    if !diff.is_empty() {
        p.push(format!(
            "health records before unquarantine ≠ the rules' ({}): {}",
            marks_text(&h.marks),
            diff.join("; ")
        ));
    }
    for dev in marks.keys() {
        match a.call("gpu.unquarantine", json!({"device": dev})) {
            Ok(_) => h.unquarantine(dev),
            Err(e) => p.push(format!("gpu.unquarantine {dev}: {e}")),
        }
    }
    // Checked empty below; a divergence is reported once, not carried into the next cell.
    h.marks.clear();
    let st = a.state();
    let checks: [(bool, String); 8] = [
        (a.claims().is_empty(), format!("claims left: {:?}", a.claims())),
        (a.data_files("instances").is_empty(), format!("instances left: {:?}", a.data_files("instances"))),
        (set_vfs(&st).is_empty(), format!("VFs still set: {:?}", set_vfs(&st))),
        (sim_mdevs(&st).is_empty(), format!("mdevs left: {:?}", sim_mdevs(&st))),
        (a.data_files("mdevs").is_empty(), format!("mdev records left: {:?}", a.data_files("mdevs"))),
        (a.qemu_pids().is_empty(), format!("QEMUs left: {:?}", a.qemu_pids())),
        (st["faults"].as_array().map(|f| f.is_empty()).unwrap_or(false), format!("faults left: {}", st["faults"])),
        (health(a).is_empty(), format!("health records left: {}", marks_text(&health(a)))),
    ];
    for (ok, msg) in checks {
        if !ok {
            p.push(msg);
        }
    }
    let w = World::observe(a);
    p.extend(w.safety_violations(&[]).into_iter().map(|v| format!("safety: {v}")));
    p.extend(mdev_violations(a, &w).into_iter().map(|v| format!("safety: {v}")));
    p.extend(w.liveness_violations().into_iter().map(|v| format!("liveness: {v}")));
    if a.agent_pids().is_empty() {
        p.push("the agent is not running".into());
    }
    p
}

// -------------------------------------------------------------------------------------- cell

/// One cell's run: what the caller got, and every failed expectation.
struct Cell<'a> {
    a: &'a Agent,
    /// The site's health model (it spans the cells: they share the agent).
    h: &'a mut HealthModel,
    site: Site,
    errno: &'static str,
    mode: Mode,
    name: String,
    got: Vec<String>,
    fails: Vec<String>,
}

impl<'a> Cell<'a> {
    fn fail(&mut self, m: String) {
        self.fails.push(m);
    }

    fn ensure(&mut self, ok: bool, m: impl FnOnce() -> String) {
        if !ok {
            self.fail(m());
        }
    }

    /// Runs the invariant checker after a step.
    fn checked(&mut self, step: &str) {
        for v in violations(self.a) {
            self.fail(format!("after {step}: {v}"));
        }
    }

    /// Arms the cell's fault; returns the log position before it.
    fn arm(&mut self) -> u64 {
        let seq = last_seq(&self.a.state());
        let times = self.mode.count().map(|n| n.to_string());
        let mut args = vec!["fail-write", self.site.pattern(), self.errno];
        match &times {
            Some(n) => args.extend(["--times", n.as_str()]),
            None => args.push("--always"),
        }
        if let Err(e) = self.a.sim.ctl(&args) {
            self.fail(format!("arming {args:?}: {e}"));
        }
        seq
    }

    fn clear_faults(&mut self) {
        if let Err(e) = self.a.sim.ctl(&["clear-faults"]) {
            self.fail(format!("clear-faults: {e}"));
        }
    }

    fn faults_consumed(&mut self, step: &str) {
        self.fault_left(step, Some(0));
    }

    /// The armed fault has `left` counts left (`Some(0)`: used up, gone; `None`: still
    /// armed for every write).
    fn fault_left(&mut self, step: &str, left: Option<usize>) {
        let f = self.a.state()["faults"].clone();
        let list = f.as_array().cloned().unwrap_or_default();
        let ok = match left {
            Some(0) => f.as_array().is_some_and(|l| l.is_empty()),
            Some(k) => list.len() == 1 && list[0]["remaining"].as_u64() == Some(k as u64),
            None => list.len() == 1 && list[0]["remaining"].is_null(),
        };
        self.ensure(ok, || match left {
            Some(0) => format!("{step}: the fault was not used up: {f}"),
            Some(k) => format!("{step}: the fault should have {k} count(s) left: {f}"),
            None => format!("{step}: the always-fault should still be armed: {f}"),
        });
    }

    /// A JSON-RPC call; records the answer and checks it is a success or an error of the
    /// Errors table (never `internal`, never a broken connection).
    fn call(&mut self, step: &str, method: &str, params: Value) -> Result<Value, RpcError> {
        let r = self.a.call(method, params);
        match &r {
            Ok(v) => {
                let mut s = format!("{step}=ok");
                if let Some(st) = v["state"].as_str() {
                    s.push_str(&format!("({st}"));
                    if v["gpu"]["release_pending"] == true {
                        s.push_str(",release_pending");
                    }
                    s.push(')');
                }
                self.got.push(s);
            }
            Err(e) => {
                self.got.push(format!("{step}={}:{}", e.code, e.data_code));
                if !ERROR_TABLE.contains(&e.data_code.as_str()) {
                    self.fail(format!(
                        "{step}: {e} is not an error of docs/design/lifecycle.md's Errors table (data: {})",
                        e.data
                    ));
                }
            }
        }
        r
    }

    /// `(device, result)` of this site's writes logged after `since`. Devices are VFs (for
    /// mdev remove: the mdev's parent, from `parents`).
    fn site_writes(&self, since: u64, parents: &BTreeMap<String, String>) -> Vec<(String, String)> {
        log_after(&self.a.state(), since)
            .into_iter()
            .filter(|e| e["op"] == "write" && self.site.matches(e["path"].as_str().unwrap_or("")))
            .map(|e| {
                let path = e["path"].as_str().unwrap_or("");
                let comp: Vec<&str> = path.split('/').collect();
                let dev = match self.site {
                    Site::SetType | Site::ClearType => comp.get(4).copied().unwrap_or("?").to_string(),
                    Site::MdevCreate => comp.get(3).copied().unwrap_or("?").to_string(),
                    Site::MdevRemove => {
                        let u = comp.get(4).copied().unwrap_or("?");
                        parents.get(u).cloned().unwrap_or_else(|| u.to_string())
                    }
                };
                (dev, e["result"].as_str().unwrap_or("").to_string())
            })
            .collect()
    }

    /// The writes of the step failed by the injected fault.
    fn injected(&self, w: &[(String, String)]) -> Vec<String> {
        w.iter().filter(|(_, r)| r == self.errno).map(|(d, _)| d.clone()).collect()
    }

    /// docs/design/lifecycle.md "Device health" (module docs): after a step, the health records are
    /// exactly the model's, fed with every write logged so far; and once a write on the GPU
    /// succeeded after the step's last EIO, no `gpu_fault` mark is left.
    fn health_check(&mut self, step: &str) {
        let writes = self.h.sync(self.a);
        for u in std::mem::take(&mut self.h.undecidable) {
            self.fail(format!("{step}: {u}"));
        }
        let now = health(self.a);
        let shown: Vec<String> = writes
            .iter()
            .map(|(w, v)| {
                let v = match v {
                    Verdict::None => "",
                    Verdict::Strike => " strike",
                    Verdict::GpuLevel => " GPU-level",
                };
                format!("{} {} {}{v}", w.site.name(), w.dev, w.result)
            })
            .collect();
        let after_eio = writes.iter().rposition(|(w, _)| w.result == "EIO").map_or(0, |i| i + 1);
        let cleared = writes[after_eio..].iter().any(|(w, _)| w.result == "ok");
        if cleared {
            self.ensure(!now.contains_key(PF), || {
                format!(
                    "{step}: the {} mark of {PF} is left although a later write on that GPU succeeded \
                     (\"clears by itself when a later write on that GPU succeeds\"); writes: {shown:?}",
                    now[PF]
                )
            });
        }
        let diff = marks_diff(&now, &self.h.marks);
        if !diff.is_empty() {
            let msg = format!(
                "{step}: health records {} ≠ the rules' {} ({}): {}; writes of the step: {shown:?}",
                marks_text(&now),
                marks_text(&self.h.marks),
                if self.errno == "EIO" {
                    "release EIO: suspect then quarantined; create EIO: suspect on the 2nd in a row; \
                     EIO on a 2nd device of the GPU within 60 s or under a gpu_fault mark: GPU-level"
                } else {
                    "only EIO is a strike"
                },
                diff.join("; ")
            );
            self.fail(msg);
        }
    }

    /// The device is back at baseline: VF type 0 / the mdev and its record gone; no claim.
    fn baseline(&mut self, step: &str, dev: &str, uuid: Option<&str>) {
        let a = self.a;
        if let Some(u) = uuid {
            let st = a.state();
            self.ensure(!sim_mdevs(&st).iter().any(|m| m["uuid"] == u), || format!("{step}: mdev {u} still exists"));
            self.ensure(!a.data_files("mdevs").contains(&format!("{u}.json")), || {
                format!("{step}: the mdev record {u}.json is left")
            });
        } else {
            let t = a.vf_type(dev);
            self.ensure(t == 0, || format!("{step}: VF {dev} reads type {t}, not 0"));
        }
        self.ensure(a.claim(dev).is_none(), || format!("{step}: claim of {dev} left: {:?}", a.claim(dev)));
    }

    /// The device still holds the vGPU (the fault kept it): VF type set / mdev present.
    fn still_set(&mut self, step: &str, dev: &str, uuid: Option<&str>) {
        if let Some(u) = uuid {
            let st = self.a.state();
            self.ensure(sim_mdevs(&st).iter().any(|m| m["uuid"] == u), || {
                format!("{step}: mdev {u} is gone although every remove failed")
            });
        } else {
            let t = self.a.vf_type(dev);
            self.ensure(t != 0, || format!("{step}: VF {dev} reads 0 although every clear failed"));
        }
    }

    /// The claim of `dev` is `release_pending`, names `owner`, has `attempts` and a last error
    /// naming the errno.
    fn pending_claim(&mut self, step: &str, dev: &str, owner: &str, attempts: u64) {
        let Some(c) = self.a.claim(dev) else {
            self.fail(format!("{step}: the claim of {dev} is gone although the release failed"));
            return;
        };
        self.ensure(c["state"] == "release_pending" && c["instance_id"] == owner, || {
            format!("{step}: claim should be release_pending for {owner}: {c}")
        });
        self.ensure(c["release_attempts"].as_u64() == Some(attempts), || {
            format!("{step}: release_attempts {} ≠ {attempts}: {c}", c["release_attempts"])
        });
        let le = c["last_error"].as_str().unwrap_or("");
        let errno = self.errno;
        self.ensure(le.contains(errno), || format!("{step}: the claim's last_error does not name {errno}: {le:?}"));
    }
}

// ------------------------------------------------------------------------- create-side cells

/// Set type / mdev create: `instance.create` reaches the site once per candidate.
fn create_cell(c: &mut Cell) {
    let errno = c.errno;
    let a = c.a;
    let vfs = devices();
    let name = c.name.clone();
    c.health_check("before the create");
    let cands = c.h.placeable(&vfs);
    let before = c.h.clone();
    let seq = c.arm();
    let r = c.call("create", "instance.create", json!({"name": name, "image": "demo", "gpu": PROFILE}));
    c.checked("create under the fault");
    let w = c.site_writes(seq, &BTreeMap::new());
    let st = a.state();
    let observed: Vec<Write> = {
        let mut m = before.clone();
        log_after(&st, seq).iter().filter_map(|e| m.parse(e)).collect()
    };
    // docs/design/lifecycle.md Create step 4: a refused write releases that claim and tries the next
    // ranked candidate (placement order) — unless the failure was judged GPU-level, which
    // skips the rest of the GPU; a write that succeeds ends it.
    let (want, end) = expect_create(&before, &cands, c.site, errno, c.mode.count(), &observed);
    c.ensure(w == want, || format!("create: writes {w:?} expected, by the rules: {want:?}"));
    let failed = want.iter().filter(|(_, r)| r == errno).count();
    c.fault_left("create", c.mode.count().map(|n| n - failed));
    match (&end, &r) {
        (CreateEnd::Landed(dev), Ok(inst)) => {
            c.ensure(inst["state"] == "running", || format!("create: not running: {inst}"));
            c.ensure(inst["gpu"]["device"] == dev.as_str(), || {
                format!("create: should land on {dev} (after {failed} refused write(s)): {}", inst["gpu"])
            });
            let claims = a.claims();
            c.ensure(
                claims.len() == 1 && claims[0]["state"] == "configured" && claims[0]["device"] == dev.as_str(),
                || format!("create: one configured claim of {dev} expected: {claims:?}"),
            );
            if c.site.mdev() {
                let ms = sim_mdevs(&st);
                c.ensure(
                    ms.len() == 1 && ms[0]["parent"] == dev.as_str() && ms[0]["uuid"] == inst["gpu"]["mdev_uuid"],
                    || format!("create: exactly the instance's mdev under {dev} expected: {ms:?}"),
                );
                c.ensure(a.data_files("mdevs").len() == 1, || {
                    format!("create: mdev records {:?}", a.data_files("mdevs"))
                });
            } else {
                let set = set_vfs(&st);
                c.ensure(set.len() == 1 && set[0].0 == *dev, || {
                    format!("create: only {dev} should hold a type: {set:?}")
                });
            }
        }
        (CreateEnd::Landed(dev), Err(e)) => {
            c.fail(format!("create should succeed on {dev} after {failed} refused write(s): {e}"))
        }
        (CreateEnd::NoCapacity { gpu_level }, r) => {
            // Every candidate refused, or the rest of the GPU skipped: `no_capacity`, "nothing
            // left behind" (Create step 3/4).
            match r {
                Ok(v) => c.fail(format!("create succeeded although it should give up after {failed} write(s): {v}")),
                Err(e) => {
                    c.ensure(e.code == 409 && e.data_code == "no_capacity", || {
                        format!("create: expected 409 no_capacity, got {e}")
                    });
                    c.ensure(e.message.contains(errno), || {
                        format!("create: the message should name {}: {}", errno, e.message)
                    });
                    let says = e.message.contains("driver-level fault") && e.message.contains(PF);
                    c.ensure(says == *gpu_level, || {
                        if *gpu_level {
                            format!(
                                "create: the message should name a GPU- or driver-level fault of {PF}: {}",
                                e.message
                            )
                        } else {
                            format!("create: no failure was GPU-level, yet the message says so: {}", e.message)
                        }
                    });
                }
            }
            c.ensure(not_found(a, &name), || "create: the failed instance still exists".into());
            c.ensure(a.claims().is_empty(), || format!("create: claims left: {:?}", a.claims()));
            c.ensure(set_vfs(&st).is_empty(), || format!("create: VFs set: {:?}", set_vfs(&st)));
            c.ensure(sim_mdevs(&st).is_empty(), || format!("create: mdevs left: {:?}", sim_mdevs(&st)));
            c.ensure(a.data_files("mdevs").is_empty(), || {
                format!("create: mdev records left: {:?}", a.data_files("mdevs"))
            });
        }
    }
    c.health_check("create");

    // Recovery: with the fault gone the next create succeeds on the first placeable VF —
    // every refused VF was left clean and unclaimed — and its write clears a GPU mark.
    c.clear_faults();
    let first = c.h.placeable(&vfs).first().cloned().unwrap_or_default();
    let r2 =
        c.call("recreate", "instance.create", json!({"name": format!("{name}-r"), "image": "demo", "gpu": PROFILE}));
    c.checked("create after clear-faults");
    match r2 {
        Ok(inst) => c.ensure(inst["state"] == "running" && inst["gpu"]["device"] == first.as_str(), || {
            format!("recovery create: running on {first} expected: {}", inst["gpu"])
        }),
        Err(e) => c.fail(format!("recovery create failed: {e}")),
    }
    c.health_check("create after clear-faults");
}

// ------------------------------------------------------------------------ release-side cells

/// The instance's device and mdev UUID from an API answer.
fn device_of(inst: &Value) -> (String, Option<String>) {
    (inst["gpu"]["device"].as_str().unwrap_or("?").to_string(), inst["gpu"]["mdev_uuid"].as_str().map(str::to_string))
}

/// Clear type / mdev remove: stop and delete (and the reconciler) reach the site through the
/// release guard.
fn release_cell(c: &mut Cell) {
    let errno = c.errno;
    let a = c.a;
    let name = c.name.clone();
    let inst = match c.call("create", "instance.create", json!({"name": name, "image": "demo", "gpu": PROFILE})) {
        Ok(i) => i,
        Err(e) => return c.fail(format!("create (no fault yet) failed: {e}")),
    };
    c.checked("create");
    let id = inst["id"].as_str().unwrap_or("?").to_string();
    let (dev, uuid) = device_of(&inst);
    let parents: BTreeMap<String, String> = uuid.iter().map(|u| (u.clone(), dev.clone())).collect();

    c.health_check("create");

    // --- stop under the fault.
    let seq = c.arm();
    let r = c.call("stop", "instance.stop", json!({"ref": name, "force": true}));
    c.checked("stop under the fault");
    let w = c.site_writes(seq, &parents);
    let injected = c.injected(&w);
    // docs/design/lifecycle.md Stop step 3: the VMM is gone, so stop succeeds either way.
    let stopped = match r {
        Ok(v) => v,
        Err(e) => return c.fail(format!("stop must succeed (the VMM is gone) but answered {e}")),
    };
    c.ensure(stopped["state"] == "stopped", || format!("stop: state {}", stopped["state"]));
    c.ensure(a.qemu_pids().is_empty(), || format!("stop: QEMU still alive: {:?}", a.qemu_pids()));
    match c.mode.count() {
        Some(n) => {
            // The guard's inline retries (release_retry_s) outlast n failures: released.
            c.ensure(injected.len() == n && w.last().map(|(_, r)| r == "ok").unwrap_or(false), || {
                format!("stop: {n} injected failure(s) then one good write expected on {dev}: {w:?}")
            });
            c.faults_consumed("stop");
            c.ensure(stopped["gpu"]["release_pending"] == false, || {
                format!("stop: release_pending: {}", stopped["gpu"])
            });
            c.baseline("stop", &dev, uuid.as_deref());
        }
        None => {
            // Stop step 3: "Failure keeps the claim as release_pending; stop still succeeds
            // (the instance is stopped, gpu.release_pending: true)".
            c.ensure(injected.len() >= 2 && w.iter().all(|(_, r)| r == errno), || {
                format!("stop: the guard should retry inline, every write failing: {w:?}")
            });
            c.ensure(stopped["gpu"]["release_pending"] == true, || {
                format!("stop: release_pending should be true: {}", stopped["gpu"])
            });
            let le = stopped["gpu"]["last_error"].as_str().unwrap_or("");
            c.ensure(le.contains(errno), || format!("stop: gpu.last_error should name {}: {le:?}", errno));
            c.pending_claim("stop", &dev, &id, 1);
            c.still_set("stop", &dev, uuid.as_deref());
        }
    }
    c.health_check("stop");

    match c.mode.count() {
        Some(n) => {
            // --- start (no fault), then delete under the fault: absorbed inline too.
            c.clear_faults();
            // Placement never uses a quarantined device: the first other one, in order.
            let first = c.h.placeable(&devices()).first().cloned().unwrap_or_default();
            let started = match c.call("start", "instance.start", json!({"ref": name})) {
                Ok(v) => v,
                Err(e) => return c.fail(format!("start after the stop failed: {e}")),
            };
            c.checked("start");
            let (dev2, uuid2) = device_of(&started);
            let marks = marks_text(&c.h.marks);
            c.ensure(dev2 == first, || format!("start: should land on {first} (health {marks}): {}", started["gpu"]));
            c.health_check("start");
            let parents2: BTreeMap<String, String> = uuid2.iter().map(|u| (u.clone(), dev2.clone())).collect();
            let seq = c.arm();
            let r = c.call("delete", "instance.delete", json!({"ref": name}));
            c.checked("delete under the fault");
            let w = c.site_writes(seq, &parents2);
            match r {
                Ok(v) => c.ensure(v["deleted"] == true, || format!("delete: {v}")),
                Err(e) => c.fail(format!("delete should succeed after {n} failure(s) retried inline: {e}")),
            }
            c.ensure(c.injected(&w).len() == n && w.last().map(|(_, r)| r == "ok").unwrap_or(false), || {
                format!("delete: {n} injected failure(s) then one good write expected on {dev2}: {w:?}")
            });
            c.faults_consumed("delete");
            c.baseline("delete", &dev2, uuid2.as_deref());
            c.ensure(not_found(a, &name), || "delete: the instance still exists".into());
            c.health_check("delete");
        }
        None => forever_release(c, &name, &id, &dev, uuid.as_deref(), &parents),
    }
}

/// The rest of a "forever" release cell: a pass under the fault, then (unless the retry is
/// "stop again") a delete under the fault, then clear-faults and the retry.
fn forever_release(
    c: &mut Cell,
    name: &str,
    id: &str,
    dev: &str,
    uuid: Option<&str>,
    parents: &BTreeMap<String, String>,
) {
    let errno = c.errno;
    let a = c.a;
    // --- a reconcile pass under the fault: one attempt (the next pass is the retry).
    let seq = last_seq(&a.state());
    let pass = c.call("pass", "reconcile.run", json!({}));
    c.checked("pass under the fault");
    let w = c.site_writes(seq, parents);
    match pass {
        Ok(p) => {
            let failed = p["failed"].as_array().cloned().unwrap_or_default();
            c.ensure(failed.iter().any(|f| f["device"] == dev), || format!("pass: {dev} should be listed failed: {p}"));
        }
        Err(e) => c.fail(format!("reconcile.run failed: {e}")),
    }
    c.ensure(w.len() == 1 && c.injected(&w).len() == 1, || format!("pass: one failed attempt expected: {w:?}"));
    c.pending_claim("pass", dev, id, 2);
    c.still_set("pass", dev, uuid);
    // I2: "visibly release_pending with its last error in the API and metrics".
    let m = a.metrics();
    let pending = metric0(&m, "gpuvisor_vgpu_claims", &[("state", "release_pending")]);
    let retained = metric0(&m, "gpuvisor_vgpu_retained_assignments", &[]);
    let failed = metric0(&m, "gpuvisor_vgpu_stale_releases_total", &[("result", "failed")]);
    c.ensure(pending == 1.0 && retained == 1.0 && failed >= 1.0, || {
        format!("pass: metrics should show the release_pending claim: claims{{release_pending}}={pending} retained={retained} stale_failed={failed}")
    });
    c.health_check("pass");

    let retry = retry_for(errno);
    if retry == Retry::StopAgain {
        // docs/design/lifecycle.md Stop step 4: "Stopping a stopped instance retries a pending release".
        c.clear_faults();
        match c.call("stop-again", "instance.stop", json!({"ref": name})) {
            Ok(v) => {
                c.ensure(v["state"] == "stopped" && v["gpu"]["release_pending"] == false, || {
                    format!("stop again: stopped without release_pending expected: {v}")
                });
            }
            Err(e) => c.fail(format!("stop again after clear-faults failed: {e}")),
        }
        c.checked("stop again");
        c.baseline("stop again", dev, uuid);
        c.health_check("stop again");
        return;
    }

    // --- delete under the fault: Delete step 4, `vgpu_cleanup_pending` with retained: true.
    let seq = last_seq(&a.state());
    let r = c.call("delete", "instance.delete", json!({"ref": name}));
    c.checked("delete under the fault");
    let w = c.site_writes(seq, parents);
    match r {
        Ok(v) => c.fail(format!("delete succeeded although every {} write fails: {v}", c.site.name())),
        Err(e) => {
            c.ensure(e.code == 500 && e.data_code == "vgpu_cleanup_pending", || {
                format!("delete: 500 vgpu_cleanup_pending expected: {e}")
            });
            c.ensure(e.data["retained"] == true && e.data["instance_id"] == id, || {
                format!("delete: retained for {id} expected: {}", e.data)
            });
            let path = e.data["device_path"].as_str().unwrap_or("");
            let want = match uuid {
                Some(u) => format!("sys/bus/mdev/devices/{u}"),
                None => format!("sys/bus/pci/devices/{dev}"),
            };
            c.ensure(path.ends_with(&want), || format!("delete: device_path {path:?} should end with {want}"));
            c.ensure(e.message.contains(errno), || format!("delete: the message should name {}: {}", errno, e.message));
        }
    }
    c.ensure(c.injected(&w).len() >= 2 && w.iter().all(|(_, r)| r == errno), || {
        format!("delete: the guard should retry inline, every write failing: {w:?}")
    });
    match a.call("instance.get", json!({"ref": name})) {
        Ok(v) => c.ensure(v["state"] == "cleanup_pending", || {
            format!("delete: the instance should be cleanup_pending: {}", v["state"])
        }),
        Err(e) => c.fail(format!("delete: the instance should be kept (cleanup_pending): {e}")),
    }
    c.pending_claim("delete", dev, id, 3);
    c.still_set("delete", dev, uuid);
    c.health_check("delete");

    c.clear_faults();
    match retry {
        Retry::DeleteAgain => {
            // Delete step 4: "A later instance.delete retries".
            match c.call("delete-again", "instance.delete", json!({"ref": name})) {
                Ok(v) => c.ensure(v["deleted"] == true, || format!("delete again: {v}")),
                Err(e) => c.fail(format!("delete again after clear-faults failed: {e}")),
            }
            c.checked("delete again");
            c.health_check("delete again");
        }
        _ => {
            // Delete step 4: "the reconciler retries too"; then the delete-only record goes.
            match c.call("pass-again", "reconcile.run", json!({})) {
                Ok(p) => {
                    let rel = p["released"].as_array().cloned().unwrap_or_default();
                    c.ensure(rel.iter().any(|r| r["device"] == dev), || {
                        format!("pass after clear-faults should release {dev}: {p}")
                    });
                }
                Err(e) => c.fail(format!("reconcile.run after clear-faults failed: {e}")),
            }
            c.checked("pass after clear-faults");
            c.health_check("pass after clear-faults");
            c.baseline("pass after clear-faults", dev, uuid);
            match c.call("delete-again", "instance.delete", json!({"ref": name})) {
                Ok(v) => c.ensure(v["deleted"] == true, || format!("delete after the pass: {v}")),
                Err(e) => c.fail(format!("delete of the cleanup_pending record after the pass failed: {e}")),
            }
            c.checked("delete after the pass");
        }
    }
    c.baseline("recovery", dev, uuid);
    c.ensure(not_found(a, name), || "recovery: the instance still exists".into());
}

// ------------------------------------------------------------------------------------ runner

/// The agent log without terminal colour codes.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(ch) = it.next() {
        if ch == '\u{1b}' {
            for c in it.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "?".into())
}

fn run_site(site: Site) {
    assert_failpoints_built();
    let t0 = Instant::now();
    let w = QemuWrapper::new();
    let a = agent(site, &w);
    let mut h = HealthModel::default();
    let initial = reset(&a, &mut h);
    assert!(initial.is_empty(), "{}: the fresh host is not at baseline: {initial:?}", site.name());

    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut idx = 0;
    for errno in ERRNOS {
        for mode in MODES {
            idx += 1;
            let started = Instant::now();
            let log_from = strip_ansi(&a.log()).len();
            let (raised, gpu_level) = (h.raised, h.gpu_level);
            let mut c = Cell {
                a: &a,
                h: &mut h,
                site,
                errno,
                mode,
                name: format!("c{idx}"),
                got: Vec::new(),
                fails: Vec::new(),
            };
            let r =
                catch_unwind(AssertUnwindSafe(
                    || {
                        if site.release() {
                            release_cell(&mut c)
                        } else {
                            create_cell(&mut c)
                        }
                    },
                ));
            if let Err(p) = r {
                c.fail(format!("the cell panicked: {}", panic_text(p)));
            }
            let log = strip_ansi(&a.log());
            let cell_log = log.get(log_from..).unwrap_or("");
            if cell_log.contains("panicked") {
                c.fail("the agent log shows a panic".into());
            }
            // No cascade: "one mark on the GPU, one message, no strike against each VF".
            c.h.sync(&a);
            let messages = cell_log.matches(GPU_FAULT_MESSAGE).count();
            let marks_raised = c.h.raised - raised;
            c.ensure(messages == marks_raised, || {
                format!("the agent logged {messages} \"{GPU_FAULT_MESSAGE}\" error(s) for {marks_raised} GPU mark(s) raised")
            });
            if c.h.gpu_level > gpu_level {
                let left: Vec<String> = health(&a)
                    .into_iter()
                    .filter(|(_, m)| m.quarantined && m.eio_strike())
                    .map(|(d, m)| format!("{d}={m}"))
                    .collect();
                c.ensure(left.is_empty(), || {
                    format!("the cell's EIOs were judged GPU-level, yet {left:?} is left quarantined by EIO strikes")
                });
            }
            let problems = reset(&a, c.h);
            for p in problems {
                c.fail(format!("baseline after the cell: {p}"));
            }
            let cell = format!("{} {errno} {}", site.name(), mode.name());
            eprintln!(
                "{:<4} {cell:<26} {:>5.1}s  {}{}",
                if c.fails.is_empty() { "ok" } else { "FAIL" },
                started.elapsed().as_secs_f64(),
                c.got.join(" "),
                c.fails.first().map(|f| format!("  ← {f}")).unwrap_or_default()
            );
            if !c.fails.is_empty() {
                let excerpt: Vec<&str> =
                    cell_log.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).take(12).collect();
                let excerpt = if excerpt.is_empty() { "(none)".to_string() } else { excerpt.join("\n       ") };
                eprintln!("     agent log (WARN/ERROR of this cell):\n       {excerpt}");
            }
            rows.push((cell, c.fails));
        }
    }
    let failed: Vec<&(String, Vec<String>)> = rows.iter().filter(|(_, f)| !f.is_empty()).collect();
    eprintln!(
        "{}: {} cells passed, {} failed ({:.0} s)",
        site.name(),
        rows.len() - failed.len(),
        failed.len(),
        t0.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        let mut table = String::from("| cell | failures |\n|---|---|\n");
        for (cell, f) in &failed {
            table.push_str(&format!("| {cell} | {} |\n", f.join("; ")));
        }
        panic!("{} of {} cells failed:\n{table}", failed.len(), rows.len());
    }
}

#[test]
fn fault_matrix_vendor_vfio_set_type() {
    run_site(Site::SetType);
}

#[test]
fn fault_matrix_vendor_vfio_clear_type() {
    run_site(Site::ClearType);
}

#[test]
fn fault_matrix_mdev_create() {
    run_site(Site::MdevCreate);
}

#[test]
fn fault_matrix_mdev_remove() {
    run_site(Site::MdevRemove);
}
