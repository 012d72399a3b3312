//! # policies — the agent's three plugin slots
//!
//! Loads the configured `placement`, `hypervisor` and `grace` plugins through the plugin
//! host (`gpuvisor-policy`), each with the `params` and limits its slot configures, and
//! offers them to the lifecycle. A reload replaces plugins, params and limits together. A
//! plugin only advises: every answer is validated by the caller (`instances::policy_calls`).

use crate::config::Config;
use gpuvisor_policy::{CallError, Limits, Plugin};
use gpuvisor_sdk::{
    GraceAnswer, GraceInput, HypervisorAnswer, HypervisorInput, PlacementAnswer, PlacementInput, PolicyKind,
};
use serde_json::Value;
use std::sync::{Arc, Mutex};

/// One loaded slot: the plugin and the site's `params` for it.
pub struct Slot {
    /// The loaded plugin.
    pub plugin: Arc<Plugin>,
    /// `[plugins.<kind>.params]` as a JSON object (`{}` when absent).
    pub params: Value,
}

impl Slot {
    /// The plugin's manifest name.
    pub fn name(&self) -> &str {
        &self.plugin.manifest().name
    }
}

/// The directory under `data_dir` where compiled plugins are kept
/// (`gpuvisor_policy::set_cache_dir`).
pub const PLUGIN_CACHE_DIR: &str = "plugin-cache";

/// The loaded plugins.
pub struct Policies {
    /// Chooses the device a request gets.
    pub placement: Slot,
    /// Chooses the hypervisor an instance runs under.
    pub hypervisor: Slot,
    /// Always loaded by [`Policies::load`]; `None` only for embedders that run no reconciler
    /// (every eligible item is then kept).
    pub grace: Option<Slot>,
}

/// The names of the loaded plugins (`plugin.reload`'s answer).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct PluginNames {
    /// The placement plugin's name.
    pub placement: String,
    /// The hypervisor plugin's name.
    pub hypervisor: String,
    /// The grace plugin's name (`null` when none is loaded).
    pub grace: Option<String>,
}

/// The reasons the agent can reject part of each kind's answer (exported at 0).
pub const REJECTION_REASONS: [(PolicyKind, &[&str]); 3] = [
    (PolicyKind::Placement, &["not_a_legal_candidate"]),
    (PolicyKind::Hypervisor, &["unknown_hypervisor", "cannot_carry_device"]),
    (PolicyKind::Grace, &["unasked_device"]),
];

/// The limits of a slot: the config's values over the plugin host's defaults.
pub fn limits_for(cfg: &Config, kind: PolicyKind) -> Limits {
    let mut l = Limits::default();
    if let Some(slot) = cfg.slot(kind).0 {
        if let Some(f) = slot.fuel {
            l.fuel = f;
        }
        if let Some(m) = slot.memory_mib {
            l.memory_bytes = (m as usize).saturating_mul(1024 * 1024);
        }
        if let Some(d) = slot.deadline_ms {
            l.deadline = std::time::Duration::from_millis(d);
        }
    }
    l
}

impl Policies {
    /// Loads every slot with its params (the grace slot's `claim_grace_s` defaults to the
    /// agent's `claim_grace_s`). Errors name the plugin path and the problem; the agent
    /// refuses to start on any of them (docs/plugins.md "Load-time checks"). The plugin host
    /// logs each load once.
    pub fn load(cfg: &Config, claim_grace_s: u64) -> anyhow::Result<Policies> {
        let load = |kind: PolicyKind| -> anyhow::Result<Slot> {
            let path = cfg.plugin_path(kind);
            // The load error names the plugin and the problem; the slot is the context.
            let plugin = Plugin::load(&path, kind, limits_for(cfg, kind))
                .map_err(|e| anyhow::Error::new(e).context(format!("the {} slot", kind.as_str())))?;
            Ok(Slot { plugin: Arc::new(plugin), params: cfg.plugin_params(kind) })
        };
        let placement = load(PolicyKind::Placement)?;
        let hypervisor = load(PolicyKind::Hypervisor)?;
        let mut grace = load(PolicyKind::Grace)?;
        if let Value::Object(m) = &mut grace.params {
            m.entry("claim_grace_s").or_insert(Value::from(claim_grace_s));
        }
        Ok(Policies { placement, hypervisor, grace: Some(grace) })
    }

    /// The slot of a kind.
    pub fn slot(&self, kind: PolicyKind) -> Option<&Slot> {
        match kind {
            PolicyKind::Placement => Some(&self.placement),
            PolicyKind::Hypervisor => Some(&self.hypervisor),
            PolicyKind::Grace => self.grace.as_ref(),
        }
    }

    /// The names of the loaded plugins.
    pub fn names(&self) -> PluginNames {
        PluginNames {
            placement: self.placement.name().to_string(),
            hypervisor: self.hypervisor.name().to_string(),
            grace: self.grace.as_ref().map(|g| g.name().to_string()),
        }
    }

    /// Exports every series of the loaded plugins at 0.
    pub fn announce(&self, metrics: &crate::metrics::Metrics) {
        for (kind, reasons) in REJECTION_REASONS {
            if let Some(s) = self.slot(kind) {
                metrics.announce_plugin(s.name(), kind.as_str(), reasons);
            }
        }
    }
}

/// An input the agent sent to a slot's plugin, kept for a trial reload.
#[derive(Debug, Clone)]
pub enum LastInput {
    /// The last placement input.
    Placement(PlacementInput),
    /// The last hypervisor input.
    Hypervisor(HypervisorInput),
    /// The last grace input.
    Grace(GraceInput),
}

impl From<PlacementInput> for LastInput {
    fn from(i: PlacementInput) -> Self {
        LastInput::Placement(i)
    }
}

impl From<HypervisorInput> for LastInput {
    fn from(i: HypervisorInput) -> Self {
        LastInput::Hypervisor(i)
    }
}

impl From<GraceInput> for LastInput {
    fn from(i: GraceInput) -> Self {
        LastInput::Grace(i)
    }
}

impl LastInput {
    /// The slot it was sent to.
    pub fn kind(&self) -> PolicyKind {
        match self {
            LastInput::Placement(_) => PolicyKind::Placement,
            LastInput::Hypervisor(_) => PolicyKind::Hypervisor,
            LastInput::Grace(_) => PolicyKind::Grace,
        }
    }

    /// An input of `kind` from JSON: the input itself, or a recording of
    /// `record_policy_inputs` (its `input`). Errors: not an input of the kind (why).
    pub fn from_json(kind: PolicyKind, mut v: Value) -> Result<LastInput, String> {
        if v.get("recorded").and_then(Value::as_str) == Some(gpuvisor_policy::RECORDING_TAG) {
            v = v.get_mut("input").map(Value::take).ok_or("a recording without an input")?;
        }
        let bad = |e: serde_json::Error| format!("not a {} input: {e}", kind.as_str());
        Ok(match kind {
            PolicyKind::Placement => LastInput::Placement(serde_json::from_value(v).map_err(bad)?),
            PolicyKind::Hypervisor => LastInput::Hypervisor(serde_json::from_value(v).map_err(bad)?),
            PolicyKind::Grace => LastInput::Grace(serde_json::from_value(v).map_err(bad)?),
        })
    }

    /// Calls `plugin` on this input with `params` instead of the recorded ones, as the
    /// agent would (not counted in the agent's metrics).
    fn try_on(&self, plugin: &Plugin, params: &Value) -> Result<Value, CallError> {
        fn go<
            I: serde::Serialize + Clone + std::any::Any,
            A: serde::Serialize + serde::de::DeserializeOwned + std::any::Any,
        >(
            p: &Plugin,
            kind: PolicyKind,
            i: &I,
        ) -> Result<Value, CallError> {
            p.call_report::<I, A>(kind, i).0.map(|a| serde_json::to_value(a).unwrap_or(Value::Null))
        }
        match self {
            LastInput::Placement(i) => go::<_, PlacementAnswer>(
                plugin,
                PolicyKind::Placement,
                &PlacementInput { params: params.clone(), ..i.clone() },
            ),
            LastInput::Hypervisor(i) => go::<_, HypervisorAnswer>(
                plugin,
                PolicyKind::Hypervisor,
                &HypervisorInput { params: params.clone(), ..i.clone() },
            ),
            LastInput::Grace(i) => {
                go::<_, GraceAnswer>(plugin, PolicyKind::Grace, &GraceInput { params: params.clone(), ..i.clone() })
            }
        }
    }
}

/// The last input the agent sent to each slot (since it started), for `plugin.reload`'s
/// trial calls.
#[derive(Default)]
pub struct LastInputs(Mutex<[Option<LastInput>; 3]>);

fn slot_index(kind: PolicyKind) -> usize {
    match kind {
        PolicyKind::Placement => 0,
        PolicyKind::Hypervisor => 1,
        PolicyKind::Grace => 2,
    }
}

impl LastInputs {
    /// Keeps `input` as its slot's last.
    pub fn remember(&self, input: LastInput) {
        let i = slot_index(input.kind());
        self.0.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(input);
    }

    /// The slot's last input, if any was sent.
    pub fn get(&self, kind: PolicyKind) -> Option<LastInput> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())[slot_index(kind)].clone()
    }
}

/// `plugin.reload` parameters.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReloadParams {
    /// Before the swap, call each new plugin once on an input of its slot — the one in
    /// `inputs`, else the last one the agent sent to the slot (a slot not asked yet is not
    /// tried) — with the slot's new params; a call that fails refuses the reload (the old
    /// plugins stay).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub trial: bool,
    /// Inputs for the trial calls by slot (`placement`, `hypervisor`, `grace`): an input of
    /// the kind, or a file `record_policy_inputs` wrote. Implies `trial`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub inputs: std::collections::BTreeMap<String, Value>,
}

/// One trial call of a reload.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct TrialRun {
    /// The slot called: `placement`, `hypervisor` or `grace`.
    pub slot: String,
    /// The new plugin's name.
    pub plugin: String,
    /// `last` (the slot's last input) or `given` (from the request).
    pub input: String,
    /// The answer (the kind's answer as JSON).
    pub answer: Value,
}

impl Policies {
    /// The trial calls of a reload (see [`ReloadParams`]) on these (new) plugins. Errors:
    /// the first failure, as one sentence (the slot, the plugin, the input, the error).
    pub fn trial(&self, p: &ReloadParams, last: &LastInputs) -> Result<Vec<TrialRun>, String> {
        let mut given = std::collections::BTreeMap::new();
        for (slot, v) in &p.inputs {
            let kind = match slot.as_str() {
                "placement" => PolicyKind::Placement,
                "hypervisor" => PolicyKind::Hypervisor,
                "grace" => PolicyKind::Grace,
                other => return Err(format!("inputs: {other:?} is not a slot (placement, hypervisor, grace)")),
            };
            let input = LastInput::from_json(kind, v.clone()).map_err(|e| format!("inputs.{slot}: {e}"))?;
            given.insert(slot_index(kind), input);
        }
        let mut runs = Vec::new();
        for kind in [PolicyKind::Placement, PolicyKind::Hypervisor, PolicyKind::Grace] {
            let Some(slot) = self.slot(kind) else { continue };
            let (input, from) = match given.remove(&slot_index(kind)) {
                Some(i) => (i, "given"),
                None => match last.get(kind) {
                    Some(i) => (i, "last"),
                    None => continue,
                },
            };
            let answer = input.try_on(&slot.plugin, &slot.params).map_err(|e| {
                format!("the trial call of the new {} plugin on the slot's {from} input failed: {e}", kind.as_str())
            })?;
            runs.push(TrialRun { slot: kind.as_str().into(), plugin: slot.name().into(), input: from.into(), answer });
        }
        Ok(runs)
    }
}
