//! `instance.create` (docs/design/lifecycle.md Create): validate, choose the hypervisor, write the
//! record, claim, configure, spawn; roll back on failure. [`Manager::boot`] is the claim →
//! configure → spawn sequence that `start` shares.

use super::claim::ClaimFailure;
use super::request::{CreateRequest, GpuWant};
use super::rollback::Rollback;
use super::{now_rfc3339, Manager, Who};
use crate::error::{ApiError, ErrorCode};
use crate::images;
use crate::store::{Framework, InstanceDefinition, InstanceRecord, InstanceState, PassthroughWant, StoreError};
use crate::sync::lock;
use crate::wire::InstanceView;
use uuid::Uuid;

impl Manager {
    /// `instance.create`.
    pub fn create(&self, req: CreateRequest) -> Result<InstanceView, ApiError> {
        let id = Uuid::new_v4();
        let r = self.create_with_id(id, &req);
        self.logged("create", Who { id: Some(id), name: Some(&req.name) }, r)
    }

    fn create_with_id(&self, id: Uuid, req: &CreateRequest) -> Result<InstanceView, ApiError> {
        let (vcpus, memory_mib, gpu) = req.validate()?;
        let image = images::load(&self.store.images_dir(), &req.image).map_err(|e| {
            if e.code == ErrorCode::NotFound {
                ApiError::invalid_request(e.message)
            } else {
                e
            }
        })?;
        let (framework, whole) = match &gpu {
            None => (None, None),
            Some(GpuWant::Profile(_)) => (Some(self.observer().current_framework()?), None),
            Some(GpuWant::Passthrough { address }) => {
                self.check_passthrough_address(address.as_deref())?;
                (Some(Framework::Passthrough), Some(PassthroughWant { address: address.clone() }))
            }
            Some(GpuWant::ResourceClaim(rc)) => (Some(self.prepared_claim_of(rc)?.kind.framework()), None),
        };
        // What the host can give, and the capability gate, before anything is allocated.
        self.check_host_room(vcpus, memory_mib)?;
        self.check_nics_on_host(&req.nics)?;
        let devices: Vec<String> = whole.iter().filter_map(|w| w.address.clone()).collect();
        let hypervisor =
            self.choose_hypervisor(&req.name, &req.labels, req.hypervisor.as_deref(), framework, &devices)?;
        let user_nic = req.nics.iter().any(|n| matches!(n, crate::network::Nic::User { .. }));
        if let Some(why) = hypervisor.cannot_connect(user_nic) {
            return Err(ApiError::hypervisor_unsupported(why, Some(hypervisor.name()), None));
        }
        let boot = self.check_disk_request(&image, hypervisor, req.boot, req.disk_gib)?;
        let profile = match &gpu {
            Some(GpuWant::Profile(p)) => Some(self.observer().known_profile(p)?),
            _ => None,
        };
        let define_only = req.start == Some(false);
        let rec = InstanceRecord::new(
            InstanceDefinition {
                id,
                name: req.name.clone(),
                image: req.image.clone(),
                hypervisor,
                vcpus,
                memory_mib,
                labels: req.labels.clone(),
                gpu_profile: profile,
                gpu_framework: framework,
                gpu_passthrough: whole,
                gpu_resource_claim: match &gpu {
                    Some(GpuWant::ResourceClaim(rc)) => Some(rc.clone()),
                    _ => None,
                },
                restart: req.restart.unwrap_or_default(),
                autostart: req.autostart.unwrap_or(false),
                created_at: now_rfc3339(),
                nics: req.nics.clone(),
                cloud_init: req.cloud_init.clone(),
                boot,
                disk_gib: req.disk_gib,
            },
            if define_only { InstanceState::Stopped } else { InstanceState::Starting },
        );
        // The instance lock is taken before the record exists, so the reconciler never sees
        // a `starting` record whose operation is not holding it (lock order: instance, then
        // allocation).
        let ilock = self.instance_lock(id);
        let _i = lock(&ilock);
        {
            // Names are unique: the name index entry and the record under the allocation lock.
            let _a = self.alloc();
            if let Err(e) = self.check_image_still_there(&req.image) {
                self.forget_instance_lock(id);
                return Err(e);
            }
            if let Err(e) = self.store.claim_name(&req.name, id) {
                self.forget_instance_lock(id);
                return Err(match e {
                    StoreError::NameTaken { .. } => ApiError::name_taken("an instance", &req.name),
                    e => e.into(),
                });
            }
            if let Err(e) = self.store.write_instance(&rec) {
                // E.g. a full disk: leave no empty instance directory and no name behind.
                let _ = self.store.remove_instance(id);
                let _ = self.store.release_name(&req.name, id);
                self.forget_instance_lock(id);
                return Err(e.into());
            }
        }
        crate::crash_point!("create_after_record");
        let gpu = match (&rec.gpu_profile, &rec.gpu_passthrough, &rec.gpu_resource_claim) {
            (Some(p), _, _) => p.clone(),
            (None, Some(w), _) => format!("passthrough {}", w.address.as_deref().unwrap_or("(any)")),
            (None, None, Some(rc)) => format!("resource claim {rc}"),
            (None, None, None) => "-".into(),
        };
        if define_only {
            tracing::info!(instance.id = %id, instance.name = %rec.name, profile = %gpu, "instance defined (not started)");
            return Ok(self.view_after(&rec));
        }
        tracing::info!(instance.id = %id, instance.name = %rec.name, profile = %gpu, "creating instance");
        let rec = self.boot(rec, Rollback::Remove, None)?;
        Ok(self.view_after(&rec))
    }

    /// Refuses an instance the host cannot give its memory or vCPUs: more memory than
    /// `memory_overcommit` × the host's `MemTotal`, or more vCPUs than `vcpu_overcommit` × its
    /// CPUs (`invalid_request`, before anything is written or claimed). Each instance is
    /// checked alone (the running instances' sum is not tracked: a create stays O(1) in the
    /// number of records). An unreadable `/proc/meminfo` refuses nothing (logged).
    pub(crate) fn check_host_room(&self, vcpus: u32, memory_mib: u64) -> Result<(), ApiError> {
        let cpus = std::thread::available_parallelism().map(|n| n.get() as u64).unwrap_or(1);
        let cpu_cap = (cpus as f64 * self.cfg.vcpu_overcommit) as u64;
        if u64::from(vcpus) > cpu_cap {
            return Err(ApiError::invalid_request(format!(
                "{vcpus} vCPUs do not fit this host: it gives at most {cpu_cap} (vcpu_overcommit {} × {cpus} CPUs)",
                self.cfg.vcpu_overcommit
            )));
        }
        let host_mib = match procfs::Current::current() {
            Ok(procfs::Meminfo { mem_total, .. }) => mem_total / (1024 * 1024),
            Err(e) => {
                tracing::warn!(error = %e, "/proc/meminfo cannot be read: the memory of an instance is not checked");
                return Ok(());
            }
        };
        let mem_cap = (host_mib as f64 * self.cfg.memory_overcommit) as u64;
        if memory_mib > mem_cap {
            return Err(ApiError::invalid_request(format!(
                "{memory_mib} MiB of memory do not fit this host: it gives at most {mem_cap} MiB \
                 (memory_overcommit {} × {host_mib} MiB)",
                self.cfg.memory_overcommit
            )));
        }
        Ok(())
    }

    /// A named passthrough GPU must be one of `passthrough_gpus` (`invalid_request`); with
    /// none configured, no whole GPU can be asked for.
    pub(crate) fn check_passthrough_address(&self, address: Option<&str>) -> Result<(), ApiError> {
        let configured = &self.cfg.passthrough_gpus;
        let listed = || if configured.is_empty() { "none".to_string() } else { configured.join(", ") };
        match address {
            _ if configured.is_empty() => Err(ApiError::invalid_request(
                "this agent hands out no whole GPUs (passthrough_gpus is empty in its configuration)",
            )),
            Some(a) if !self.cfg.is_passthrough_gpu(a) => Err(ApiError::invalid_request(format!(
                "{a} is not one of this agent's passthrough GPUs (passthrough_gpus: {})",
                listed()
            ))),
            _ => Ok(()),
        }
    }

    /// Disk, claim, configure, spawn for a `starting` record; on failure roll back as `mode`
    /// says. The disk step (overlay, UEFI variable store: [`Manager::prepare_disk`]) comes
    /// first, so a failing `qemu-img` never touches a GPU.
    pub(crate) fn boot(
        &self,
        mut rec: InstanceRecord,
        mode: Rollback,
        incoming: Option<std::path::PathBuf>,
    ) -> Result<InstanceRecord, ApiError> {
        if let Err(e) = self.prepare_disk(&rec) {
            self.undo_record(&mut rec, mode, &e);
            return Err(e);
        }
        // A device prepared for a ResourceClaim is used, never claimed or released here: the
        // claim stays the ResourceClaim's (its release goes through the guard, which refuses
        // while this VM holds the device).
        if let Some(rc) = rec.gpu_resource_claim.clone() {
            let borrowed = match self.borrowed_claim(&rec, &rc) {
                Ok(c) => c,
                Err(e) => {
                    self.undo_record(&mut rec, mode, &e);
                    return Err(e);
                }
            };
            return match self.spawn(&mut rec, Some(&borrowed), None) {
                Ok(()) => Ok(rec),
                Err(e) => Err(self.rollback(rec, None, mode, e)),
            };
        }
        let claim = if rec.wants_gpu() {
            match self.claim_and_configure(&rec) {
                Ok(c) => Some(c),
                // A claim of this instance exists (configured, or its state unknown): roll
                // back through the release path, retaining on failure.
                Err(ClaimFailure::Held(c, e)) => return Err(self.rollback(rec, Some(*c), mode, e)),
                Err(ClaimFailure::Nothing(e)) => {
                    self.undo_record(&mut rec, mode, &e);
                    return Err(e);
                }
            }
        } else {
            None
        };
        match self.spawn(&mut rec, claim.as_ref(), incoming) {
            Ok(()) => Ok(rec),
            Err(e) => Err(self.rollback(rec, claim, mode, e)),
        }
    }
}
