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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Event;

    fn drain(rx: &mut tokio::sync::broadcast::Receiver<Event>) -> Vec<EventKind> {
        std::iter::from_fn(|| rx.try_recv().ok()).map(|e| e.kind).collect()
    }

    /// A state change is published once, after the write; the same state written again,
    /// and a write that fails, publish nothing.
    #[test]
    fn an_instance_state_is_published_once_when_durable_and_never_for_a_failed_write() {
        let d = tempfile::tempdir().unwrap();
        let r = Records::new(Store::open(d.path()).unwrap());
        let mut rx = r.events().subscribe();
        let mut rec = crate::store::tests::record("a");
        r.write_instance(&rec).unwrap();
        r.write_instance(&rec).unwrap();
        let got = drain(&mut rx);
        assert!(
            matches!(got.as_slice(), [EventKind::InstanceState { from: None, to: InstanceState::Stopped, .. }]),
            "{got:?}"
        );
        assert_eq!(r.read_instance(rec.id).unwrap().unwrap().state(), InstanceState::Stopped, "durable first");

        // The instance's directory replaced by a file: the write fails, nothing is published.
        let other = crate::store::tests::record("b");
        std::fs::write(r.instance_dir(other.id), b"not a directory").unwrap();
        assert!(r.write_instance(&other).is_err());
        rec.transition(InstanceState::Starting).unwrap();
        r.write_instance(&rec).unwrap();
        let got = drain(&mut rx);
        assert!(
            matches!(
                got.as_slice(),
                [EventKind::InstanceState { from: Some(InstanceState::Stopped), to: InstanceState::Starting, .. }]
            ),
            "only the durable change of a: {got:?}"
        );
    }

    /// A health mark cleared where there was none publishes nothing.
    #[test]
    fn health_cleared_is_published_only_for_a_mark_that_existed() {
        let d = tempfile::tempdir().unwrap();
        let r = Records::new(Store::open(d.path()).unwrap());
        let mut rx = r.events().subscribe();
        r.remove_health("0000:41:00.4").unwrap();
        assert!(drain(&mut rx).is_empty());
        let mark = HealthRecord {
            device: "0000:41:00.4".into(),
            reason: "eio".into(),
            quarantined: false,
            detail: "test".into(),
            at: "2026-01-01T00:00:00Z".into(),
            eio_in_a_row: 1,
        };
        r.write_health(&mark).unwrap();
        r.remove_health("0000:41:00.4").unwrap();
        let got = drain(&mut rx);
        assert!(matches!(got.as_slice(), [EventKind::HealthMark { .. }, EventKind::HealthCleared { .. }]), "{got:?}");
    }
}
