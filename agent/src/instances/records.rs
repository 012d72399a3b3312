//! The store as the lifecycle writes it, and the one place its durable changes become events.
//!
//! [`Records`] wraps the [`Store`] (which only persists): a write of an instance record in a
//! new state (or for the first time), an instance removed, a claim created, a health mark
//! written or cleared is published on the event bus — once, after it is on disk, never for a
//! write that failed. Reads pass through to the store ([`std::ops::Deref`]); the store's own
//! writing methods have other names (`persist_*`, `erase_*`), so a write that skips the
//! publishing does not read like one that does.

use crate::events::{EventKind, Events};
use crate::store::{Claim, HealthRecord, InstanceRecord, InstanceState, Result, Store};

/// The store, publishing what it made durable.
#[derive(Debug, Clone)]
pub struct Records {
    store: Store,
    events: Events,
}

impl std::ops::Deref for Records {
    type Target = Store;
    fn deref(&self) -> &Store {
        &self.store
    }
}

impl Records {
    /// The lifecycle's records in `store`, with a new event bus.
    pub fn new(store: Store) -> Records {
        Records { store, events: Events::default() }
    }

    /// The event bus.
    pub fn events(&self) -> &Events {
        &self.events
    }

    /// Writes an instance record ([`Store::persist_instance`]); a record in a new state, or
    /// written for the first time, publishes `instance_state` (with the last error as the
    /// reason of a `stopped` or `cleanup_pending`).
    pub fn write_instance(&self, rec: &InstanceRecord) -> Result<()> {
        let before = self.store.persist_instance(rec)?;
        if before != Some(rec.state()) {
            let reason = matches!(rec.state(), InstanceState::Stopped | InstanceState::CleanupPending)
                .then(|| rec.last_error.clone())
                .flatten();
            self.events.publish(EventKind::InstanceState {
                instance_id: rec.id.to_string(),
                name: rec.name.clone(),
                from: before,
                to: rec.state(),
                reason,
            });
        }
        Ok(())
    }

    /// Removes an instance ([`Store::erase_instance`]) and publishes `instance_deleted`.
    pub fn remove_instance(&self, id: uuid::Uuid) -> Result<()> {
        let name = self.store.erase_instance(id)?;
        self.events.publish(EventKind::InstanceDeleted { instance_id: id.to_string(), name });
        Ok(())
    }

    /// Creates a claim exclusively ([`Store::persist_new_claim`]) and publishes `claimed`.
    pub fn create_claim(&self, claim: &Claim) -> Result<()> {
        self.store.persist_new_claim(claim)?;
        self.events.publish(EventKind::Claimed {
            device: claim.device.clone(),
            gpu: claim.gpu.clone(),
            framework: claim.kind.framework().as_str().to_string(),
            profile: claim.profile.clone(),
            instance_id: claim.owner.instance().map(|i| i.to_string()),
            owner: claim.owner.clone(),
            name: claim.owner_name.clone(),
            labels: claim.owner_labels.clone().unwrap_or_default(),
        });
        Ok(())
    }

    /// Writes a health mark ([`Store::persist_health`]) and publishes `health_mark`.
    pub fn write_health(&self, rec: &HealthRecord) -> Result<()> {
        self.store.persist_health(rec)?;
        self.events.publish(EventKind::HealthMark {
            device: rec.device.clone(),
            reason: rec.reason.clone(),
            quarantined: rec.quarantined,
            detail: rec.detail.clone(),
        });
        Ok(())
    }

    /// Clears a health mark ([`Store::erase_health`]); publishes `health_cleared` when there
    /// was one.
    pub fn remove_health(&self, device: &str) -> Result<()> {
        if self.store.erase_health(device)? {
            self.events.publish(EventKind::HealthCleared { device: device.to_string() });
        }
        Ok(())
    }
}
