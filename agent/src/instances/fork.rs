//! `instance.fork`.
//!
//! A fork never inherits a claim or a VMM identity: it keeps the GPU *profile* and claims
//! its own device when it starts. A fork of an instance with a disk copies its overlay
//! (and UEFI variable store): the source must be stopped, so the copy is consistent — or
//! the fork is made from one of its snapshots (`saves`), whose disk state it copies.
//! `cleanup_pending` instances refuse all of these.

use super::request::check_instance_name;
use super::{now_rfc3339, Manager};
use crate::error::ApiError;
use crate::store::{InstanceDefinition, InstanceRecord, InstanceState, Listing, StoreError};
use crate::wire::InstanceView;
use uuid::Uuid;

impl Manager {
    /// `instance.fork`: a new stopped instance with the source's definition (image, vCPUs,
    /// memory, labels, hypervisor, GPU *profile*, boot mode, disk size) and a copy of its
    /// disk state. Errors: `invalid_state` when the source has a disk and is not stopped.
    pub fn fork(&self, r: &str, name: &str, snapshot: Option<&str>) -> Result<InstanceView, ApiError> {
        self.on_instance("fork", r, |src| self.fork_of(src, name, snapshot))
    }

    fn fork_of(&self, src: &InstanceRecord, name: &str, snapshot: Option<&str>) -> Result<InstanceView, ApiError> {
        if src.state() == InstanceState::CleanupPending {
            return Err(ApiError::instance_cleanup_pending(src.id, &src.name));
        }
        check_instance_name(name)?;
        let from_snapshot = snapshot.map(|s| self.snapshot_dir_of(src, s)).transpose()?;
        let has_disk = self.image_of(src).map(|i| i.disk.is_some()).unwrap_or(false)
            || !matches!(
                crate::own_file::inspect(&self.store.vmm_dir(src.id), super::disk::OVERLAY),
                Ok(crate::own_file::Entry::Missing) | Err(_)
            )
            || self.store.instance_dir(src.id).join(super::disk::OVERLAY).exists();
        if has_disk && from_snapshot.is_none() && src.state() != InstanceState::Stopped {
            return Err(ApiError::invalid_state(
                format!(
                    "instance {} is {}: stop it before forking it (its disk is copied, and a running VM \
                     is still writing it)",
                    src.name,
                    src.state().as_str()
                ),
                src.state().as_str(),
            ));
        }
        let rec = InstanceRecord::new(
            InstanceDefinition {
                id: Uuid::new_v4(),
                name: name.to_string(),
                image: src.image.clone(),
                hypervisor: src.hypervisor,
                vcpus: src.vcpus,
                memory_mib: src.memory_mib,
                labels: src.labels.clone(),
                gpu_profile: src.gpu_profile.clone(),
                gpu_passthrough: src.gpu_passthrough.clone(),
                gpu_resource_claim: src.gpu_resource_claim.clone(),
                restart: src.restart,
                autostart: src.autostart,
                gpu_framework: src.gpu_framework,
                created_at: now_rfc3339(),
                nics: src.nics.clone(),
                cloud_init: src.cloud_init.clone(),
                boot: src.boot,
                disk_gib: src.disk_gib,
            },
            InstanceState::Stopped,
        );
        {
            let _a = self.alloc();
            self.check_image_still_there(&rec.image)?;
            self.store.claim_name(name, rec.id).map_err(|e| match e {
                StoreError::NameTaken { .. } => ApiError::name_taken("an instance", name),
                e => e.into(),
            })?;
            if let Err(e) = self.store.write_instance(&rec) {
                let _ = self.store.remove_instance(rec.id);
                let _ = self.store.release_name(name, rec.id);
                return Err(e.into());
            }
        }
        // The record first, then the disk copy: a failure or a crash leaves nothing that
        // deleting the fork does not remove (its instance directory).
        if let Err(e) = self.copy_disk_state(src, from_snapshot.as_deref(), &rec) {
            let _a = self.alloc();
            let _ = self.store.remove_instance(rec.id);
            let _ = self.store.release_name(name, rec.id);
            return Err(e);
        }
        tracing::info!(instance.id = %rec.id, instance.name = %rec.name, source = %src.id, snapshot = ?snapshot,
            "instance forked");
        Ok(self.view(&rec, &Listing::default()))
    }
}
