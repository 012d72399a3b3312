//! `instance.update`: change an instance after create, as `virsh setvcpus/setmem --config`,
//! `incus config set` and `qm set` do.
//!
//! What the agent alone uses applies at once: `labels` (the next placement sees them),
//! `restart`, `autostart`. What the VM is made of — `vcpus`, `memory_mib`, `nics`,
//! `cloud_init` — is recorded now and applies at the next start (`instance.reboot` applies
//! it at once; the seed is rebuilt then because its inputs changed): the answer lists those
//! under `at_next_start` while the VM runs. Nothing is changed live in the running VM.
//! Every field is checked as `instance.create` checks it, and nothing is written unless all
//! of them pass. A `standby` instance keeps its vCPUs and memory (its saved state needs the
//! same machine to resume: stop it first, which discards that state) — and its NICs and
//! cloud-init inputs (the seed disk), for the same reason.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Manager;
use crate::error::ApiError;
use crate::store::{InstanceState, Labels, RestartPolicy};
use crate::sync::lock;
use crate::wire::InstanceView;

/// `instance.update` parameters: the instance, and only the fields that change.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateRequest {
    /// Instance id or name.
    #[serde(alias = "id", alias = "name", rename = "ref")]
    pub reference: String,
    /// vCPUs (next start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = super::request::VCPUS_MIN, max = super::request::VCPUS_MAX))]
    pub vcpus: Option<u32>,
    /// Guest memory, MiB (next start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = super::request::MEMORY_MIB_MIN, max = super::request::MEMORY_MIB_MAX))]
    pub memory_mib: Option<u64>,
    /// The labels, all of them (replaces the old set; now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<Labels>,
    /// The restart policy (now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<RestartPolicy>,
    /// Start it after a host reboot (now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autostart: Option<bool>,
    /// The NICs, all of them, in guest order (next start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = crate::network::MAX_NICS))]
    pub nics: Option<Vec<crate::network::Nic>>,
    /// The cloud-init inputs, all of them (`{}` removes them; next start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<crate::network::CloudInit>,
}

/// The answer of `instance.update`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct UpdateResult {
    /// The instance as it is now recorded.
    pub instance: InstanceView,
    /// The fields whose value changed.
    pub changed: Vec<String>,
    /// Of those, the ones the running VM does not have yet: they apply at its next start
    /// (`instance.reboot`). Empty when it is not running.
    pub at_next_start: Vec<String>,
}

impl Manager {
    /// `instance.update`. Errors: `not_found`, `invalid_request` (a field, named),
    /// `invalid_state` (`deleting`; vCPUs or memory of a `standby` instance),
    /// `instance_cleanup_pending`.
    pub fn update(&self, req: UpdateRequest) -> Result<UpdateResult, ApiError> {
        self.on_instance("update", &req.reference, |found| {
            // Answered at once, not after a delete that holds the lock.
            if found.state() == InstanceState::Deleting {
                return Err(ApiError::invalid_state(format!("instance {} is being deleted", found.name), "deleting"));
            }
            let ilock = self.instance_lock(found.id);
            let _i = lock(&ilock);
            let mut rec = self.store.read_instance(found.id)?.ok_or_else(|| ApiError::not_found(&req.reference))?;
            match rec.state() {
                InstanceState::CleanupPending => return Err(ApiError::instance_cleanup_pending(rec.id, &rec.name)),
                InstanceState::Deleting => {
                    return Err(ApiError::invalid_state(format!("instance {} is being deleted", rec.name), "deleting"))
                }
                _ => {}
            }
            self.check_update(&req, &rec)?;
            let mut changed = Vec::new();
            let def = rec.definition_mut();
            let mut set = |name: &str, differs: bool| {
                if differs {
                    changed.push(name.to_string());
                }
                differs
            };
            if let Some(v) = req.vcpus.filter(|v| set("vcpus", *v != def.vcpus)) {
                def.vcpus = v;
            }
            if let Some(m) = req.memory_mib.filter(|m| set("memory_mib", *m != def.memory_mib)) {
                def.memory_mib = m;
            }
            if let Some(l) = req.labels.clone().filter(|l| set("labels", *l != def.labels)) {
                def.labels = l;
            }
            if let Some(r) = req.restart.filter(|r| set("restart", *r != def.restart)) {
                def.restart = r;
            }
            if let Some(a) = req.autostart.filter(|a| set("autostart", *a != def.autostart)) {
                def.autostart = a;
            }
            if let Some(n) = req.nics.clone().filter(|n| set("nics", *n != def.nics)) {
                def.nics = n;
            }
            let cloud_init =
                req.cloud_init.clone().map(|c| Some(c).filter(|c| c.user_data.is_some() || c.network_config.is_some()));
            if let Some(c) = cloud_init.filter(|c| set("cloud_init", *c != def.cloud_init)) {
                def.cloud_init = c;
            }
            if !changed.is_empty() {
                self.store.write_instance(&rec)?;
            }
            let live = matches!(rec.state(), InstanceState::Running | InstanceState::Starting | InstanceState::Standby);
            let at_next_start: Vec<String> = changed
                .iter()
                .filter(|f| live && matches!(f.as_str(), "vcpus" | "memory_mib" | "nics" | "cloud_init"))
                .cloned()
                .collect();
            tracing::info!(instance.id = %rec.id, instance.name = %rec.name, changed = ?changed,
                at_next_start = ?at_next_start, "instance updated");
            Ok(UpdateResult { instance: self.view_after(&rec), changed, at_next_start })
        })
    }

    /// Every field of `req` as `instance.create` checks it, against `rec`.
    fn check_update(&self, req: &UpdateRequest, rec: &crate::store::InstanceRecord) -> Result<(), ApiError> {
        use super::request::{MEMORY_MIB_MAX, MEMORY_MIB_MIN, VCPUS_MAX, VCPUS_MIN};
        if let Some(v) = req.vcpus.filter(|v| !(VCPUS_MIN..=VCPUS_MAX).contains(v)) {
            return Err(ApiError::invalid_request(format!("vcpus must be {VCPUS_MIN}..={VCPUS_MAX}, not {v}")));
        }
        if let Some(m) = req.memory_mib.filter(|m| !(MEMORY_MIB_MIN..=MEMORY_MIB_MAX).contains(m)) {
            return Err(ApiError::invalid_request(format!(
                "memory_mib must be {MEMORY_MIB_MIN}..={MEMORY_MIB_MAX}, not {m}"
            )));
        }
        let machine = req.vcpus.is_some_and(|v| v != rec.vcpus) || req.memory_mib.is_some_and(|m| m != rec.memory_mib);
        let devices = req.nics.as_ref().is_some_and(|n| *n != rec.nics)
            || req.cloud_init.as_ref().is_some_and(|c| Some(c) != rec.cloud_init.as_ref());
        if (machine || devices) && rec.state() == InstanceState::Standby {
            return Err(ApiError::invalid_state(
                format!(
                    "instance {} is in standby: its saved state resumes only into the machine it was saved from \
                     (vCPUs, memory, NICs, seed); stop it, which discards that state, then update it",
                    rec.name
                ),
                "standby",
            ));
        }
        if machine {
            self.check_host_room(req.vcpus.unwrap_or(rec.vcpus), req.memory_mib.unwrap_or(rec.memory_mib))?;
        }
        if let Some(l) = &req.labels {
            super::request::check_labels(l)?;
        }
        if let Some(n) = &req.nics {
            crate::network::check_nics(n)?;
            self.check_nics_on_host(n)?;
            let user_nic = n.iter().any(|n| matches!(n, crate::network::Nic::User { .. }));
            if let Some(why) = rec.hypervisor.cannot_connect(user_nic) {
                return Err(ApiError::hypervisor_unsupported(why, Some(rec.hypervisor.name()), None));
            }
        }
        if let Some(c) = &req.cloud_init {
            crate::network::check_cloud_init(c)?;
        }
        Ok(())
    }
}
