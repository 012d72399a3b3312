//! Every plugin call goes through [`Manager::call_policy`]: time the call, record the input
//! and the answer (when `record_policy_inputs` is set), count it by plugin, kind and result, log
//! a failure once. The kind-specific callers then validate the answer natively
//! (PLUGINS.md "The rule that makes this safe"): a plugin advises, the agent decides.

use super::inventory::{Candidate, Observation};
use super::Manager;
use crate::error::ApiError;
use crate::events::EventKind;
use crate::hypervisor::HypervisorKind;
use crate::policies::Slot;
use crate::store::{Framework, Labels};
use gpuvisor_policy::{CallError, Plugin};
use gpuvisor_sdk::{
    GraceDecision, GraceInput, GraceItem, HypervisorAnswer, HypervisorInfo, HypervisorInput, HypervisorRequest,
    PlacementAnswer, PlacementInput, PlacementRequest, PolicyKind,
};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A failed plugin call: the plugin, the failure's stable reason, the message.
#[derive(Debug, Clone)]
pub struct PolicyFailure {
    pub plugin: String,
    pub kind: PolicyKind,
    pub reason: String,
    pub message: String,
}

impl PolicyFailure {
    /// `policy_failed` (placement, hypervisor: nothing is allocated).
    pub fn to_api(&self) -> ApiError {
        ApiError::policy_failed(&self.plugin, self.kind.as_str(), &self.reason, &self.message)
    }
}

/// Who asks for a placement.
pub struct PlacementAsk<'a> {
    pub instance_id: uuid::Uuid,
    pub name: &'a str,
    pub labels: &'a Labels,
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

    /// The one sequence of a plugin call: time, call, record, count, log a failure once.
    fn call_policy<I: Serialize, A: Serialize>(
        &self,
        kind: PolicyKind,
        slot: &Slot,
        input: &I,
        call: impl FnOnce(&Plugin) -> Result<A, CallError>,
    ) -> Result<A, PolicyFailure> {
        let started = Instant::now();
        let answer = call(&slot.plugin);
        let secs = started.elapsed().as_secs_f64();
        self.record_call(kind, slot.name(), input, &answer);
        self.metrics.policy_call(slot.name(), kind.as_str(), answer.as_ref().err().map(|e| e.reason()), secs);
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

    /// Counts (and logs once) a part of an answer the agent rejected.
    fn reject(&self, slot: &Slot, kind: PolicyKind, reason: &str, detail: &str) {
        self.metrics.policy_rejected(slot.name(), kind.as_str(), reason);
        tracing::warn!(plugin.name = %slot.name(), kind = %kind.as_str(), reason = %reason, detail = %detail, "policy answer rejected");
    }

    /// Asks the `placement` plugin and validates its answer: unknown, illegal and duplicate
    /// devices are dropped (and counted). A reject answers `no_capacity` with the policy's
    /// reason; a failed call `policy_failed`.
    pub(crate) fn rank(
        &self,
        ask: &PlacementAsk<'_>,
        framework: Framework,
        obs: &Observation,
    ) -> Result<Vec<Candidate>, ApiError> {
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
        let answer = self
            .call_policy(PolicyKind::Placement, slot, &input, |p| p.call_placement(&input))
            .map_err(|f| f.to_api())?;
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
        for dev in ranked {
            match obs.candidates.iter().find(|c| c.device == dev) {
                Some(c) if !out.iter().any(|o| o.device == dev) => out.push(c.clone()),
                _ => self.reject(slot, PolicyKind::Placement, "not_a_legal_candidate", &dev),
            }
        }
        Ok(out)
    }

    /// Probes every hypervisor's binary (blocking: a few seconds at most) and keeps the
    /// result for `agent.health` and the `hypervisor` plugin's input. Called once at start,
    /// before the startup reconcile pass; until then every hypervisor is unavailable.
    pub fn probe_hypervisors(&self) {
        let views = HypervisorKind::ALL
            .into_iter()
            .map(|k| {
                let binary = self.hypervisor_binary(k);
                let probe = k.driver().probe(binary);
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
        match kind {
            HypervisorKind::Qemu => &self.cfg.qemu_binary,
            HypervisorKind::CloudHypervisor => &self.cfg.cloud_hypervisor_binary,
        }
    }

    /// Each hypervisor as probed (not yet probed: unavailable, saying so).
    pub(crate) fn hypervisor_views(&self) -> Vec<super::view::HypervisorView> {
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
        let answer = self
            .call_policy(PolicyKind::Hypervisor, slot, &input, |p| p.call_hypervisor(&input))
            .map_err(|f| f.to_api())?;
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
            self.reject(slot, PolicyKind::Hypervisor, "unknown_hypervisor", &chosen);
            return Err(ApiError::hypervisor_unsupported(
                format!("the hypervisor plugin chose {chosen:?}, which gpuvisor does not know"),
                Some(&chosen),
                None,
            ));
        };
        if let Some(why) =
            kind.cannot_carry(sdk_framework).or_else(|| kind.cannot_attach(sdk_framework, self.cfg.vfio_attach))
        {
            self.reject(slot, PolicyKind::Hypervisor, "cannot_carry_device", &chosen);
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
        let answer = self
            .call_policy(PolicyKind::Grace, slot, &input, |p| p.call_grace(&input))
            .map_err(|f| format!("grace plugin failed: {}; kept every eligible item", f.message))?;
        let mut out = HashMap::new();
        for d in answer.decisions {
            if asked.contains(&d.device) {
                out.insert(d.device.clone(), d);
            } else {
                self.reject(slot, PolicyKind::Grace, "unasked_device", &d.device);
            }
        }
        Ok(out)
    }
}

fn hypervisor_view(
    kind: HypervisorKind,
    binary: &std::path::Path,
    probe: Result<String, String>,
    attach: crate::config::VfioAttach,
) -> super::view::HypervisorView {
    let (version, problem) = match probe {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    super::view::HypervisorView {
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
