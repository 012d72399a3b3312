//! Every plugin call goes through [`Manager::call_policy`]: record the input (when
//! `record_policy_inputs` is set), time the call, count it by plugin, kind and result, log
//! a failure once. The kind-specific callers then validate the answer natively
//! (PLUGINS.md "The rule that makes this safe"): a plugin advises, the agent decides.

use super::inventory::{Candidate, Observation};
use super::Manager;
use crate::error::ApiError;
use crate::hypervisor::{self, HypervisorKind};
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
    /// Writes a policy input to `record_policy_inputs` (if configured). Best effort: a
    /// failure is logged, never fails the operation.
    fn record_input<T: Serialize>(&self, kind: PolicyKind, input: &T) {
        let Some(dir) = &self.cfg.record_policy_inputs else { return };
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
        let path = dir.join(format!("{}-{ms}-{}.json", kind.as_str(), SEQ.fetch_add(1, Ordering::Relaxed)));
        let res = std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::write(&path, serde_json::to_vec_pretty(input).map_err(std::io::Error::other)?));
        if let Err(e) = res {
            tracing::warn!(path = %path.display(), error = %e, "cannot record a policy input");
        }
    }

    /// The one sequence of a plugin call: record, time, call, count, log a failure once.
    fn call_policy<I: Serialize, A>(
        &self,
        kind: PolicyKind,
        slot: &Slot,
        input: &I,
        call: impl FnOnce(&Plugin) -> Result<A, CallError>,
    ) -> Result<A, PolicyFailure> {
        self.record_input(kind, input);
        let started = Instant::now();
        let answer = call(&slot.plugin);
        let secs = started.elapsed().as_secs_f64();
        self.metrics.policy_call(slot.name(), kind.as_str(), answer.as_ref().err().map(|e| e.reason()), secs);
        answer.map_err(|e| {
            tracing::warn!(plugin.name = %slot.name(), kind = %kind.as_str(), reason = %e.reason(), error = %e, "policy plugin call failed");
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
            inventory: obs.inventory(),
            params: slot.params.clone(),
        };
        let answer = self
            .call_policy(PolicyKind::Placement, slot, &input, |p| p.call_placement(&input))
            .map_err(|f| f.to_api())?;
        let ranked = match answer {
            PlacementAnswer::Ranked(r) => r,
            PlacementAnswer::Reject(reason) => {
                return Err(ApiError::no_capacity(
                    format!("the placement policy rejected the request: {reason}"),
                    ask.profile,
                    vec![],
                    Some(&reason),
                ))
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

    /// The hypervisors the agent has, with whether each can run here.
    pub(crate) fn hypervisors(&self) -> Vec<HypervisorInfo> {
        HypervisorKind::ALL
            .into_iter()
            .map(|k| {
                let bin = match k {
                    HypervisorKind::Qemu => &self.cfg.qemu_binary,
                    HypervisorKind::CloudHypervisor => &self.cfg.cloud_hypervisor_binary,
                };
                // The Cloud Hypervisor driver is not built yet: never offer it as available.
                let available = k == HypervisorKind::Qemu && binary_exists(bin);
                HypervisorInfo { name: k.name().to_string(), available, capabilities: k.capabilities().to_vec() }
            })
            .collect()
    }

    /// Asks the `hypervisor` plugin and validates the answer against the capability table
    /// (before anything is allocated).
    pub(crate) fn choose_hypervisor(
        &self,
        name: &str,
        labels: &Labels,
        requested: Option<&str>,
        framework: Option<Framework>,
    ) -> Result<String, ApiError> {
        let policies = self.policies();
        let slot = &policies.hypervisor;
        let hypervisors = self.hypervisors();
        let input = HypervisorInput {
            request: HypervisorRequest {
                name: name.to_string(),
                labels: labels.clone(),
                requested_hypervisor: requested.map(str::to_string),
                framework: framework.map(Into::into),
                devices: vec![],
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
        let Some(info) = hypervisors.iter().find(|h| h.name == chosen) else {
            self.reject(slot, PolicyKind::Hypervisor, "unknown_hypervisor", &chosen);
            return Err(ApiError::hypervisor_unsupported(
                format!("the hypervisor plugin chose {chosen:?}, which gpuvisor does not know"),
                Some(&chosen),
                None,
            ));
        };
        let kind = HypervisorKind::from_name(&chosen).ok_or_else(|| ApiError::internal("capability table"))?;
        if !hypervisor::can_carry(kind, framework.map(Into::into)) {
            self.reject(slot, PolicyKind::Hypervisor, "cannot_carry_device", &chosen);
            return Err(ApiError::hypervisor_unsupported(
                format!(
                    "{chosen} cannot carry a {} device (cloud-hypervisor cannot run NVIDIA vGPUs: cloud-hypervisor#7572, #5319)",
                    framework.map(|f| f.as_str()).unwrap_or("plain")
                ),
                Some(&chosen),
                None,
            ));
        }
        if !info.available {
            return Err(ApiError::hypervisor_unsupported(
                format!("{chosen} is not available on this host"),
                Some(&chosen),
                None,
            ));
        }
        Ok(chosen)
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

fn binary_exists(bin: &std::path::Path) -> bool {
    if bin.is_absolute() {
        return bin.exists();
    }
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file())).unwrap_or(false)
}
