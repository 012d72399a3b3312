//! `instance.create` (LIFECYCLE.md Create): validate, choose the hypervisor, write the
//! record, claim, configure, spawn; roll back on failure. [`Manager::boot`] is the claim →
//! configure → spawn sequence that `start` shares.

use super::claim::ClaimFailure;
use super::request::CreateRequest;
use super::rollback::Rollback;
use super::view::InstanceView;
use super::{now_rfc3339, Manager, Who};
use crate::error::{ApiError, ErrorCode};
use crate::images;
use crate::store::{InstanceDefinition, InstanceRecord, InstanceState, StoreError};
use crate::sync::lock;
use uuid::Uuid;

impl Manager {
    /// `instance.create`.
    pub fn create(&self, req: CreateRequest) -> Result<InstanceView, ApiError> {
        let id = Uuid::new_v4();
        let r = self.create_with_id(id, &req);
        self.logged("create", Who { id: Some(id), name: Some(&req.name) }, r)
    }

    fn create_with_id(&self, id: Uuid, req: &CreateRequest) -> Result<InstanceView, ApiError> {
        let (vcpus, memory_mib) = req.validate()?;
        images::load(&self.store.images_dir(), &req.image).map_err(|e| {
            if e.code == ErrorCode::NotFound {
                ApiError::invalid_request(e.message)
            } else {
                e
            }
        })?;
        let framework = match &req.gpu {
            Some(_) => Some(self.current_framework()?),
            None => None,
        };
        // The capability gate runs before anything is allocated.
        let hypervisor = self.choose_hypervisor(&req.name, &req.labels, req.hypervisor.as_deref(), framework)?;
        let profile = req.gpu.as_deref().map(|p| self.known_profile(p)).transpose()?;
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
                created_at: now_rfc3339(),
            },
            InstanceState::Starting,
        );
        // The instance lock is taken before the record exists, so the reconciler never sees
        // a `starting` record whose operation is not holding it (lock order: instance, then
        // allocation).
        let ilock = self.instance_lock(id);
        let _i = lock(&ilock);
        {
            // Names are unique: the name index entry and the record under the allocation lock.
            let _a = self.alloc();
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
        tracing::info!(instance.id = %id, instance.name = %rec.name,
            profile = %rec.gpu_profile.as_deref().unwrap_or("-"), "creating instance");
        let rec = self.boot(rec, Rollback::Remove)?;
        Ok(self.view_after(&rec))
    }

    /// Claim, configure, spawn for a `starting` record; on failure roll back as `mode` says.
    pub(crate) fn boot(&self, mut rec: InstanceRecord, mode: Rollback) -> Result<InstanceRecord, ApiError> {
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
        match self.spawn(&mut rec, claim.as_ref()) {
            Ok(()) => Ok(rec),
            Err(e) => Err(self.rollback(rec, claim, mode, e)),
        }
    }
}
