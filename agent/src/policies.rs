//! # policies — the agent's three plugin slots
//!
//! Loads the configured `placement`, `hypervisor` and `grace` plugins through the plugin
//! host (`gpuvisor-policy`) and offers them to the lifecycle. A plugin only advises: every
//! answer is validated by the caller (`instances`).

use crate::config::Config;
use gpuvisor_policy::{Limits, Plugin};
use gpuvisor_sdk::PolicyKind;
use std::sync::Arc;

/// The loaded plugins.
pub struct Policies {
    pub placement: Arc<Plugin>,
    pub hypervisor: Arc<Plugin>,
    /// Always loaded by [`Policies::load`]; `None` only for embedders that run no reconciler
    /// (every eligible item is then kept).
    pub grace: Option<Arc<Plugin>>,
}

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
    /// Loads every slot. Errors name the plugin path and the problem; the agent refuses to
    /// start on any of them (PLUGINS.md "Load-time checks").
    pub fn load(cfg: &Config) -> anyhow::Result<Policies> {
        let load = |kind: PolicyKind| -> anyhow::Result<Arc<Plugin>> {
            let path = cfg.plugin_path(kind);
            let p = Plugin::load(&path, kind, limits_for(cfg, kind))
                .map_err(|e| anyhow::anyhow!("{} plugin {}: {e}", kind.as_str(), path.display()))?;
            tracing::info!(plugin.name = %p.manifest().name, kind = kind.as_str(), path = %path.display(), "plugin loaded");
            Ok(Arc::new(p))
        };
        let placement = load(PolicyKind::Placement)?;
        let hypervisor = load(PolicyKind::Hypervisor)?;
        let grace = Some(load(PolicyKind::Grace)?);
        Ok(Policies { placement, hypervisor, grace })
    }
}
