//! # events — what happened, in order, for subscribers
//!
//! Every event has a sequence number (from 1, per agent run, no gaps in what the agent
//! published) and a wall time. Each kind has one publishing place:
//!
//! | type | published by |
//! |---|---|
//! | `instance_state`, `instance_deleted` | the lifecycle's records, once the record is durable ([`crate::instances::records::Records::write_instance`], [`crate::instances::records::Records::remove_instance`]) |
//! | `claimed` | the lifecycle's records, once the claim file exists ([`crate::instances::records::Records::create_claim`]) |
//! | `released`, `release_failed` | the release path (`instances/release.rs`) |
//! | `health_mark`, `health_cleared` | the lifecycle's records ([`crate::instances::records::Records::write_health`], [`crate::instances::records::Records::remove_health`]) |
//! | `reconcile_pass` | the end of every pass |
//! | `policy_failure` | the one sequence of a plugin call (`instances/policy_calls.rs`) |
//!
//! Subscribers (`events.subscribe` over WebSocket, `gpuvisor events`) get them through a
//! bounded broadcast channel: a subscriber too slow to keep up gets a `lagged` event saying
//! how many it missed, never a silent gap. Counted per type in `gpuvisor_events_total`.

use crate::domain::{InstanceState, Labels, Owner};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};
use tokio::sync::broadcast;

/// How many events a subscriber may fall behind before it is told it lagged.
pub const BUFFER: usize = 4096;

/// One event as subscribers see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Event {
    /// 1, 2, 3, … in the order the agent published them (per agent run).
    pub seq: u64,
    /// Wall time, RFC 3339 (UTC, milliseconds).
    pub time: String,
    /// What happened (its `type` and fields, flattened into the event).
    #[serde(flatten)]
    pub kind: EventKind,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    /// An instance record was written in a new state (`from` is absent for a new record).
    InstanceState {
        /// The instance's id (a UUID).
        instance_id: String,
        /// The instance's name.
        name: String,
        /// The state before (absent for a new record).
        from: Option<InstanceState>,
        /// The state written.
        to: InstanceState,
        /// The record's `last_error` when it moved to `stopped` or `cleanup_pending` (e.g.
        /// "the VMM exited (signal: 9 (SIGKILL))").
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// An instance record and its directory are gone.
    InstanceDeleted {
        /// The deleted instance's id (a UUID).
        instance_id: String,
        /// Its name (`null` when its record could not be read).
        name: Option<String>,
    },
    /// A device was claimed for an instance or an external owner (the claim file exists).
    Claimed {
        /// The device claimed (VF or mdev parent BDF, or the passthrough GPU's).
        device: String,
        /// Its GPU (PF BDF).
        gpu: String,
        /// How it is handed out: `vendor_vfio`, `mdev` or `passthrough`.
        framework: String,
        /// The vGPU profile claimed, or `passthrough`.
        profile: String,
        /// The owning instance (`null` for an external owner).
        instance_id: Option<String>,
        /// The claim's owner.
        owner: Owner,
        /// The owner's name (an instance's name; `null` when unknown).
        name: Option<String>,
        /// The owning instance's labels (absent when none).
        #[serde(default, skip_serializing_if = "Labels::is_empty")]
        labels: Labels,
    },
    /// A device was cleared through the release path and its claim (if any) removed.
    Released {
        /// The device released (BDF).
        device: String,
        /// `claim`, `orphan_vf`, `orphan_mdev` or `dirty_vf_repair`.
        what: String,
        /// The instance whose claim was released (`null` for an orphan or an external
        /// owner).
        instance_id: Option<String>,
        /// The claim's owner (`null` for an orphan).
        owner: Option<Owner>,
        /// The owner's name (`null` when unknown).
        name: Option<String>,
    },
    /// A release did not complete: a claim stays `release_pending`, an orphan stays.
    ReleaseFailed {
        /// The device whose release failed (BDF).
        device: String,
        /// What was being released: `claim`, `orphan_vf`, `orphan_mdev` or
        /// `dirty_vf_repair`.
        what: String,
        /// The instance whose claim it is (`null` for an orphan or an external owner).
        instance_id: Option<String>,
        /// The claim's owner (`null` for an orphan).
        owner: Option<Owner>,
        /// The owner's name (`null` when unknown).
        name: Option<String>,
        /// The failure's stable code (`in_use`, `write_failed`, …).
        code: String,
        /// Why it failed, one sentence.
        error: String,
    },
    /// A health mark was written (suspect, or quarantined).
    HealthMark {
        /// The device (VF or mdev parent BDF) or GPU (PF BDF) marked.
        device: String,
        /// Why, e.g. `foreign_write`, `eio`, `reset_failed`, `gpu_fault`.
        reason: String,
        /// `true`: quarantined (never handed out); `false`: suspect only.
        quarantined: bool,
        /// What was seen, in words.
        detail: String,
    },
    /// A health mark was cleared.
    HealthCleared {
        /// The device or GPU whose mark was cleared.
        device: String,
    },
    /// A reconcile pass ended.
    ReconcilePass {
        /// Every store directory could be listed and the host observed without a probe
        /// error.
        complete: bool,
        /// How long the pass took, ms.
        duration_ms: u64,
        /// Devices released.
        released: usize,
        /// Claims, orphans and instances kept or left alone.
        kept: usize,
        /// Releases that failed.
        failed: usize,
        /// Instance records the pass changed.
        records: usize,
        /// Problems that did not stop the pass.
        errors: usize,
    },
    /// A policy plugin call failed (the operation failed closed).
    PolicyFailure {
        /// The plugin's name.
        plugin: String,
        /// The policy kind called: `placement`, `hypervisor` or `grace`.
        kind: String,
        /// The failure's stable reason (e.g. `trap`, `fuel`, `deadline`, `busy`).
        reason: String,
        /// What went wrong, one sentence.
        message: String,
    },
    /// This subscriber fell behind and missed `missed` events (never published by the
    /// agent itself; sequence numbers show the gap).
    Lagged {
        /// How many events this subscriber missed.
        missed: u64,
    },
}

impl Event {
    /// The notice to a subscriber that fell behind and missed `missed` events (`seq` 0:
    /// not an event the agent published).
    pub fn lagged(missed: u64) -> Event {
        Event { seq: 0, time: now(), kind: EventKind::Lagged { missed } }
    }
}

impl EventKind {
    /// The `type` tag (the label of `gpuvisor_events_total`).
    pub fn type_name(&self) -> &'static str {
        match self {
            EventKind::InstanceState { .. } => "instance_state",
            EventKind::InstanceDeleted { .. } => "instance_deleted",
            EventKind::Claimed { .. } => "claimed",
            EventKind::Released { .. } => "released",
            EventKind::ReleaseFailed { .. } => "release_failed",
            EventKind::HealthMark { .. } => "health_mark",
            EventKind::HealthCleared { .. } => "health_cleared",
            EventKind::ReconcilePass { .. } => "reconcile_pass",
            EventKind::PolicyFailure { .. } => "policy_failure",
            EventKind::Lagged { .. } => "lagged",
        }
    }

    /// Every type a subscriber may filter on.
    pub const TYPES: [&'static str; 9] = [
        "instance_state",
        "instance_deleted",
        "claimed",
        "released",
        "release_failed",
        "health_mark",
        "health_cleared",
        "reconcile_pass",
        "policy_failure",
    ];
}

/// The agent's event bus; cheap to clone (one bus per store).
#[derive(Clone)]
pub struct Events {
    inner: Arc<Inner>,
}

struct Inner {
    tx: broadcast::Sender<Event>,
    /// The last sequence number; held while sending, so subscribers see seq in order.
    seq: std::sync::Mutex<u64>,
    /// Called with each published event's type (the metrics counter), once set.
    count: OnceLock<Box<dyn Fn(&'static str) + Send + Sync>>,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").field("published", &self.published()).finish()
    }
}

impl Default for Events {
    fn default() -> Events {
        let (tx, _) = broadcast::channel(BUFFER);
        Events { inner: Arc::new(Inner { tx, seq: std::sync::Mutex::new(0), count: OnceLock::new() }) }
    }
}

impl Events {
    /// Publishes one event: numbered, timed, counted, sent to every subscriber.
    pub fn publish(&self, kind: EventKind) {
        let ty = kind.type_name();
        {
            let mut seq = crate::sync::lock(&self.inner.seq);
            *seq += 1;
            let ev = Event { seq: *seq, time: now(), kind };
            // No subscriber is not an error.
            let _ = self.inner.tx.send(ev);
        }
        if let Some(count) = self.inner.count.get() {
            count(ty);
        }
    }

    /// A new subscriber: sees every event published from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.inner.tx.subscribe()
    }

    /// Events published so far (the last sequence number).
    pub fn published(&self) -> u64 {
        *crate::sync::lock(&self.inner.seq)
    }

    /// Sets the counter called per published event (once; later calls are ignored).
    pub fn count_with(&self, f: impl Fn(&'static str) + Send + Sync + 'static) {
        let _ = self.inner.count.set(Box::new(f));
    }
}

fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_numbered_in_order_and_counted() {
        let ev = Events::default();
        let counted = Arc::new(std::sync::Mutex::new(Vec::new()));
        let c = counted.clone();
        ev.count_with(move |t| c.lock().unwrap().push(t));
        let mut rx = ev.subscribe();
        ev.publish(EventKind::HealthCleared { device: "0000:41:00.4".into() });
        ev.publish(EventKind::PolicyFailure {
            plugin: "p".into(),
            kind: "placement".into(),
            reason: "trap".into(),
            message: "m".into(),
        });
        let a = rx.try_recv().unwrap();
        let b = rx.try_recv().unwrap();
        assert_eq!((a.seq, b.seq), (1, 2));
        assert_eq!(*counted.lock().unwrap(), vec!["health_cleared", "policy_failure"]);
        let j = serde_json::to_value(&a).unwrap();
        assert_eq!(j["type"], "health_cleared");
        assert_eq!(j["device"], "0000:41:00.4");
        assert!(j["time"].as_str().unwrap().ends_with('Z'), "{j}");
        let back: Event = serde_json::from_value(j).unwrap();
        assert_eq!(back, a);
    }

    #[test]
    fn a_slow_subscriber_is_told_it_lagged() {
        let ev = Events::default();
        let mut rx = ev.subscribe();
        for _ in 0..BUFFER + 3 {
            ev.publish(EventKind::HealthCleared { device: "x".into() });
        }
        assert!(matches!(rx.try_recv(), Err(broadcast::error::TryRecvError::Lagged(3))));
    }

    #[test]
    fn every_filterable_type_is_a_type_name() {
        let all = [
            EventKind::InstanceDeleted { instance_id: String::new(), name: None },
            EventKind::HealthCleared { device: String::new() },
        ];
        for k in all {
            assert!(EventKind::TYPES.contains(&k.type_name()));
        }
    }

    #[test]
    fn times_are_rfc3339() {
        let t = now();
        assert_eq!(t.len(), "2026-12-02T11:31:01.000Z".len(), "{t}");
        assert!(t.starts_with("20"), "{t}");
    }
}
