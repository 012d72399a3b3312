//! # policies — the agent's three plugin slots
//!
//! Loads the configured `placement`, `hypervisor` and `grace` plugins through the plugin
//! host (`gpuvisor-policy`), each with the `params` and limits its slot configures, and
//! offers them to the lifecycle. A reload replaces plugins, params and limits together. A
//! plugin only advises: every answer is validated by the caller (`instances::policy_calls`).

use crate::config::Config;
use gpuvisor_policy::{Limits, Plugin};
use gpuvisor_sdk::PolicyKind;
use serde_json::Value;
use std::sync::Arc;

/// One loaded slot: the plugin and the site's `params` for it.
pub struct Slot {
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
    pub placement: Slot,
    pub hypervisor: Slot,
    /// Always loaded by [`Policies::load`]; `None` only for embedders that run no reconciler
    /// (every eligible item is then kept).
    pub grace: Option<Slot>,
}

/// The names of the loaded plugins (`plugin.reload`'s answer).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct PluginNames {
    pub placement: String,
    pub hypervisor: String,
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
    /// refuses to start on any of them (PLUGINS.md "Load-time checks"). The plugin host
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
