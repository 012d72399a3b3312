//! Every plugin call goes through [`Manager::call_policy`]: time the call, record the input
//! and the answer (when `record_policy_inputs` is set), count it by plugin, kind and result, log
//! a failure once. The kind-specific callers then validate the answer natively
//! (docs/plugins.md "The rule that makes this safe"): a plugin advises, the agent decides.

use super::inventory::Observation;
use super::Manager;
use crate::devices::observed::Candidate;
use crate::error::ApiError;
use crate::events::EventKind;
use crate::hypervisor::HypervisorKind;
use crate::policies::LastInput;
use crate::policies::Slot;
use crate::store::{Framework, Labels};
use gpuvisor_policy::CallError;
use gpuvisor_sdk::{
    DeviceState, GraceAnswer, GraceDecision, GraceInput, GraceItem, HypervisorAnswer, HypervisorInfo, HypervisorInput,
    HypervisorRequest, PlacementAnswer, PlacementInput, PlacementRequest, PolicyKind,
};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A failed plugin call: the plugin, the failure's stable reason, the message.
#[derive(Debug, Clone)]
pub struct PolicyFailure {
    /// The plugin's name.
    pub plugin: String,
    /// The policy kind called.
    pub kind: PolicyKind,
    /// The failure's stable reason (e.g. `trap`, `fuel`, `deadline`, `busy`).
    pub reason: String,
    /// What went wrong, one sentence.
    pub message: String,
}

impl PolicyFailure {
    /// `policy_failed` (placement, hypervisor: nothing is allocated).
    pub fn to_api(&self) -> ApiError {
        ApiError::policy_failed(&self.plugin, self.kind.as_str(), &self.reason, &self.message)
    }
}

/// Rejected entries of one answer named in the log line (the rest are counted).
const LOGGED_ENTRIES: usize = 5;
/// Rejected entries of one placement answer named in `notes` (the rest are counted).
pub const NOTED_ENTRIES: usize = 8;

/// Notes on `items`, bounded: the first [`NOTED_ENTRIES`] each as `note` says, then one
/// `more(count)` for the rest.
pub(crate) fn bounded_notes<T>(
    items: &[T],
    note: impl Fn(&T) -> String,
    more: impl FnOnce(usize) -> String,
) -> Vec<String> {
    let mut notes: Vec<String> = items.iter().take(NOTED_ENTRIES).map(note).collect();
    if items.len() > NOTED_ENTRIES {
        notes.push(more(items.len() - NOTED_ENTRIES));
    }
    notes
}
/// The longest rejected entry shown, bytes (a plugin's entry is anything it wrote).
const ENTRY_SHOWN_BYTES: usize = 64;

/// A rejected entry as shown in the log and in notes: quoted, escaped and cut.
fn entry(e: &str) -> String {
    format!("\"{}\"", gpuvisor_policy::shown(e, ENTRY_SHOWN_BYTES))
}

/// Why `dev`, ranked by the placement plugin, is not a legal candidate, from the inventory
/// the plugin saw.
fn not_a_candidate(input: &PlacementInput, dev: &str, profile: &str) -> String {
    let found = input.inventory.gpus.iter().find_map(|g| g.devices.iter().find(|d| d.address == dev).map(|d| (g, d)));
    match found {
        None if input.inventory.gpus.iter().any(|g| g.address == dev) => {
            "it is a GPU, not one of its devices the request can take".into()
        }
        None => "it is not a device of a managed GPU the request can use".into(),
        Some((_, d)) => match d.state {
            DeviceState::Claimed => "it is claimed".into(),
            DeviceState::Quarantined => "it is quarantined".into(),
            DeviceState::Unreadable => "its state cannot be read".into(),
            DeviceState::Dirty => {
                format!("it is dirty and its GPU cannot take {profile} once it is repaired (the equal-size rule)")
            }
            DeviceState::Free => {
                format!("it cannot take {profile} now (not a type it can create, or the equal-size rule)")
            }
        },
    }
}

/// The placement plugin's answer, validated: the legal candidates in its order, and notes
/// on what was dropped (bounded).
pub struct Ranking {
    /// The legal candidates, in the plugin's order.
    pub candidates: Vec<Candidate>,
    /// What was dropped and why, and the plugin's own notes.
    pub notes: Vec<String>,
}

/// Who asks for a placement.
pub struct PlacementAsk<'a> {
    /// The instance to place (a fresh id for a create or a dry run).
    pub instance_id: uuid::Uuid,
    /// The instance's name.
    pub name: &'a str,
    /// The instance's labels.
    pub labels: &'a Labels,
    /// The vGPU profile asked for, or `passthrough`.
    pub profile: &'a str,
}

impl Manager {
    /// Writes a policy call to `record_policy_inputs` (if configured): the input and the
    /// answer the plugin gave (before the agent's validation), as a
    /// [`gpuvisor_policy::Recording`] that `gpuvisor plugin test` reads. Best effort: a
    /// failure is logged, never fails the operation.
    fn record_call<T: Serialize, A: Serialize>(
        &self,
        kind: PolicyKind,
        plugin: &str,
        input: &T,
        answer: &Result<A, CallError>,
    ) {
        let Some(dir) = &self.cfg.record_policy_inputs else { return };
        let recording = gpuvisor_policy::Recording {
            recorded: gpuvisor_policy::RECORDING_TAG,
            kind,
            plugin,
            input,
            answer: gpuvisor_policy::reply_json(answer),
        };
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
        let path = dir.join(format!("{}-{ms}-{}.json", kind.as_str(), SEQ.fetch_add(1, Ordering::Relaxed)));
        let res = std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::write(&path, serde_json::to_vec_pretty(&recording).map_err(std::io::Error::other)?));
        if let Err(e) = res {
            tracing::warn!(path = %path.display(), error = %e, "cannot record a policy input");
        }
    }

    /// The one sequence of a plugin call: time, call, remember the input (for a trial
    /// reload), record, count (the call, its dropped log lines and output), log a failure
    /// once.
    fn call_policy<I, A>(&self, kind: PolicyKind, slot: &Slot, input: &I) -> Result<A, PolicyFailure>
    where
        I: Serialize + Clone + Into<LastInput> + std::any::Any,
        A: Serialize + serde::de::DeserializeOwned + std::any::Any,
    {
        let started = Instant::now();
        let (answer, report) = slot.plugin.call_report::<I, A>(kind, input);
        let secs = started.elapsed().as_secs_f64();
        self.last_policy_inputs.remember(input.clone().into());
        self.record_call(kind, slot.name(), input, &answer);
        self.metrics.policy_call(slot.name(), kind.as_str(), answer.as_ref().err().map(|e| e.reason()), secs);
        self.metrics.policy_dropped(slot.name(), kind.as_str(), report.logs_dropped, report.output_bytes_dropped);
        answer.map_err(|e| {
            tracing::warn!(plugin.name = %slot.name(), kind = %kind.as_str(), reason = %e.reason(), error = %e, "policy plugin call failed");
            self.store.events().publish(EventKind::PolicyFailure {
                plugin: slot.name().to_string(),
                kind: kind.as_str().to_string(),
                reason: e.reason().to_string(),
                message: e.to_string(),
            });
            PolicyFailure { plugin: slot.name().to_string(), kind, reason: e.reason().to_string(), message: e.to_string() }
        })
    }

    /// Counts and logs, once per call, the parts of an answer the agent rejected: `dropped`
    /// holds each rejected entry (as the plugin wrote it) and why; the log line shows the
    /// first few, escaped and cut.
    fn reject(&self, slot: &Slot, kind: PolicyKind, reason: &str, dropped: &[(String, String)]) {
        if dropped.is_empty() {
            return;
        }
        self.metrics.policy_rejected(slot.name(), kind.as_str(), reason, dropped.len() as u64);
        let shown: Vec<String> =
            dropped.iter().take(LOGGED_ENTRIES).map(|(e, why)| format!("{}: {why}", entry(e))).collect();
        let more = dropped.len().saturating_sub(LOGGED_ENTRIES);
        tracing::warn!(plugin.name = %slot.name(), kind = %kind.as_str(), reason = %reason, rejected = dropped.len(),
            entries = %shown.join("; "), more = more, "policy answer rejected in part");
    }

    /// Asks the `placement` plugin and validates its answer: unknown, illegal and duplicate
    /// devices are dropped (counted, logged once per call, and said in the ranking's
    /// `notes`, at most [`NOTED_ENTRIES`] of them). A reject answers `no_capacity` with the
    /// policy's reason; a failed call `policy_failed`.
    pub(crate) fn rank(
        &self,
        ask: &PlacementAsk<'_>,
        framework: Framework,
        obs: &Observation,
    ) -> Result<Ranking, ApiError> {
        let policies = self.policies();
        let slot = &policies.placement;
        let input = PlacementInput {
            request: PlacementRequest {
                instance_id: ask.instance_id.to_string(),
                name: ask.name.to_string(),
                labels: ask.labels.clone(),
                framework: framework.into(),
                framebuffer_mib: self.book.profile_fb(ask.profile),
                profile: ask.profile.to_string(),
            },
            inventory: obs.inventory(framework),
            params: slot.params.clone(),
        };
        let answer: PlacementAnswer = self.call_policy(PolicyKind::Placement, slot, &input).map_err(|f| f.to_api())?;
        let ranked = match answer {
            PlacementAnswer::Ranked(r) => r,
            PlacementAnswer::Reject(reason) => {
                // What the agent knows about the devices it did not offer goes with it.
                let why = match obs.notes.len() {
                    0 => String::new(),
                    n if n <= 6 => format!(" ({})", obs.notes.join("; ")),
                    n => format!(" ({}; and {} more in data.notes)", obs.notes[..6].join("; "), n - 6),
                };
                return Err(ApiError::no_capacity(
                    format!("the placement policy rejected the request: {reason}{why}"),
                    ask.profile,
                    obs.notes.clone(),
                    Some(&reason),
                ));
            }
        };
        let mut out: Vec<Candidate> = Vec::new();
        let mut dropped: Vec<(String, String)> = Vec::new();
        for dev in ranked {
            match obs.candidates.iter().find(|c| c.device == dev) {
                Some(c) if !out.iter().any(|o| o.device == dev) => out.push(c.clone()),
                Some(_) => dropped.push((dev, "ranked twice".into())),
                None => {
                    let why = not_a_candidate(&input, &dev, ask.profile);
                    dropped.push((dev, why));
                }
            }
        }
        self.reject(slot, PolicyKind::Placement, "not_a_legal_candidate", &dropped);
        let notes = bounded_notes(
            &dropped,
            |(e, why)| format!("{}: ranked by the placement plugin, but {why}", entry(e)),
            |more| format!("and {more} more entries ranked by the placement plugin were dropped"),
        );
        Ok(Ranking { candidates: out, notes })
    }

    /// Probes every hypervisor's binary (blocking: a few seconds at most) and keeps the
    /// result for `agent.health` and the `hypervisor` plugin's input. Called once at start,
    /// before the startup reconcile pass; until then every hypervisor is unavailable.
    pub fn probe_hypervisors(&self) {
        let views = HypervisorKind::ALL
            .into_iter()
            .map(|k| {
                let binary = self.hypervisor_binary(k);
                let probe = k.driver().probe(binary).map_err(|e| e.to_string());
                match &probe {
                    Ok(v) => tracing::info!(hypervisor = %k, binary = %binary.display(), version = %v, "hypervisor available"),
                    Err(e) => tracing::info!(hypervisor = %k, binary = %binary.display(), problem = %e, "hypervisor not available"),
                }
                hypervisor_view(k, binary, probe, self.cfg.vfio_attach)
            })
            .collect();
        *crate::sync::lock(&self.hypervisor_probes) = Some(views);
    }

    /// The configured binary of `kind`.
    pub(crate) fn hypervisor_binary(&self, kind: HypervisorKind) -> &std::path::Path {
        kind.binary(&self.cfg)
    }

    /// Each hypervisor as probed (not yet probed: unavailable, saying so).
    pub(crate) fn hypervisor_views(&self) -> Vec<crate::wire::HypervisorView> {
        match &*crate::sync::lock(&self.hypervisor_probes) {
            Some(v) => v.clone(),
            None => HypervisorKind::ALL
                .into_iter()
                .map(|k| {
                    hypervisor_view(k, self.hypervisor_binary(k), Err("not probed yet".into()), self.cfg.vfio_attach)
                })
                .collect(),
        }
    }

    /// The hypervisors the agent has, with whether each can run here (the plugin's input).
    pub(crate) fn hypervisors(&self) -> Vec<HypervisorInfo> {
        self.hypervisor_views()
            .into_iter()
            .map(|v| HypervisorInfo {
                name: v.name.name().to_string(),
                available: v.available,
                capabilities: v.name.capabilities_under(self.cfg.vfio_attach),
            })
            .collect()
    }

    /// Asks the `hypervisor` plugin and validates the answer against the capability table
    /// (before anything is allocated). A request that names a hypervisor which cannot carry
    /// its device is refused before the plugin is asked: the plugin may choose for a
    /// request, never overrule what it asked for into something it did not.
    pub(crate) fn choose_hypervisor(
        &self,
        name: &str,
        labels: &Labels,
        requested: Option<&str>,
        framework: Option<Framework>,
        devices: &[String],
    ) -> Result<HypervisorKind, ApiError> {
        let sdk_framework = framework.map(Into::into);
        if let Some(kind) = requested.and_then(HypervisorKind::from_name) {
            if let Some(why) =
                kind.cannot_carry(sdk_framework).or_else(|| kind.cannot_attach(sdk_framework, self.cfg.vfio_attach))
            {
                return Err(ApiError::hypervisor_unsupported(why, Some(kind.name()), None));
            }
        }
        let policies = self.policies();
        let slot = &policies.hypervisor;
        let hypervisors = self.hypervisors();
        let input = HypervisorInput {
            request: HypervisorRequest {
                name: name.to_string(),
                labels: labels.clone(),
                requested_hypervisor: requested.map(str::to_string),
                framework: sdk_framework,
                devices: devices.to_vec(),
            },
            hypervisors: hypervisors.clone(),
            params: slot.params.clone(),
        };
        let answer: HypervisorAnswer =
            self.call_policy(PolicyKind::Hypervisor, slot, &input).map_err(|f| f.to_api())?;
        let chosen = match answer {
            HypervisorAnswer::Hypervisor(h) => h,
            HypervisorAnswer::Reject(reason) => {
                return Err(ApiError::hypervisor_unsupported(
                    format!("the hypervisor plugin found no hypervisor for this instance: {reason}"),
                    None,
                    Some(&reason),
                ))
            }
        };
        let (Some(info), Some(kind)) =
            (hypervisors.iter().find(|h| h.name == chosen), HypervisorKind::from_name(&chosen))
        else {
            self.reject(
                slot,
                PolicyKind::Hypervisor,
                "unknown_hypervisor",
                &[(chosen.clone(), "not a hypervisor gpuvisor knows".into())],
            );
            return Err(ApiError::hypervisor_unsupported(
                format!("the hypervisor plugin chose {chosen:?}, which gpuvisor does not know"),
                Some(&chosen),
                None,
            ));
        };
        if let Some(why) =
            kind.cannot_carry(sdk_framework).or_else(|| kind.cannot_attach(sdk_framework, self.cfg.vfio_attach))
        {
            self.reject(slot, PolicyKind::Hypervisor, "cannot_carry_device", &[(chosen.clone(), why.to_string())]);
            return Err(ApiError::hypervisor_unsupported(
                format!("the hypervisor plugin chose {chosen}, but {why}"),
                Some(&chosen),
                None,
            ));
        }
        if !info.available {
            let why = self
                .hypervisor_views()
                .into_iter()
                .find(|v| v.name == kind)
                .and_then(|v| v.problem)
                .unwrap_or_else(|| "not probed".into());
            return Err(ApiError::hypervisor_unsupported(
                format!("{chosen} is not available on this host: {why}"),
                Some(&chosen),
                None,
            ));
        }
        Ok(kind)
    }

    /// The grace plugin's decisions by device. `Err` (every item is kept this pass): no
    /// grace plugin, or the call failed. Decisions about devices not asked about are
    /// ignored and counted.
    pub(crate) fn grace_decisions(
        &self,
        items: Vec<GraceItem>,
        boot_id: &str,
    ) -> Result<HashMap<String, GraceDecision>, String> {
        let policies = self.policies();
        let Some(slot) = &policies.grace else {
            return Err("no grace plugin loaded: keeping every eligible item".into());
        };
        let asked: HashSet<String> = items.iter().map(|i| i.device.clone()).collect();
        let input = GraceInput {
            now_boottime_ms: crate::host::proc::boottime_ms(),
            boot_id: boot_id.to_string(),
            items,
            params: slot.params.clone(),
        };
        let answer: GraceAnswer = self
            .call_policy(PolicyKind::Grace, slot, &input)
            .map_err(|f| format!("grace plugin failed: {}; kept every eligible item", f.message))?;
        let mut out = HashMap::new();
        let mut unasked = Vec::new();
        for d in answer.decisions {
            if asked.contains(&d.device) {
                out.insert(d.device.clone(), d);
            } else {
                unasked.push((d.device, "not an item of the batch".to_string()));
            }
        }
        self.reject(slot, PolicyKind::Grace, "unasked_device", &unasked);
        Ok(out)
    }
}

fn hypervisor_view(
    kind: HypervisorKind,
    binary: &std::path::Path,
    probe: Result<String, String>,
    attach: crate::config::VfioAttach,
) -> crate::wire::HypervisorView {
    let (version, problem) = match probe {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    crate::wire::HypervisorView {
        name: kind,
        binary: binary.display().to_string(),
        available: version.is_some(),
        version,
        problem,
        capabilities: kind
            .capabilities_under(attach)
            .iter()
            .filter_map(|c| serde_json::to_value(c).ok().and_then(|v| v.as_str().map(str::to_string)))
            .collect(),
    }
}
