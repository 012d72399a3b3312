//! The serial consoles: every [`crate::console::ROTATE_EVERY`] the agent checks each
//! instance's `serial.log` (in its VMM directory) and rotates the ones larger than
//! `console_log_max_bytes` into its instance directory ([`crate::console::rotate`]), and
//! keeps a serial relay ([`crate::serial_relay`]) on every running VMM that serves its
//! serial port on a socket ([`crate::hypervisor::SerialPort::Relayed`]) — started right
//! after the VMM, and again after an agent restart. A failure is logged once per instance
//! until it succeeds again.

use crate::domain::InstanceState;
use crate::hypervisor::{SerialPort, SERIAL_LOG, SERIAL_SOCKET};
use crate::store::{InstanceRecord, Store};
use crate::sync::lock;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use uuid::Uuid;

/// The consoles of every instance: what this room owns, and all it needs (the store to find
/// the instances' directories and records, the log cap). [`super::Manager`] holds one.
pub struct Consoles {
    store: Store,
    /// `console_log_max_bytes`.
    max_bytes: u64,
    /// Instances whose console log rotation failed (logged once until it works again).
    rotation_failures: Mutex<HashSet<Uuid>>,
    /// The serial relays of running VMMs that serve their serial port on a socket.
    relays: Mutex<HashMap<Uuid, crate::serial_relay::Relay>>,
    /// Instances whose serial relay failed to start (logged once until it starts).
    relay_failures: Mutex<HashSet<Uuid>>,
}

impl Consoles {
    /// The consoles of the instances in `store`, logs capped at `max_bytes`.
    pub fn new(store: Store, max_bytes: u64) -> Consoles {
        Consoles {
            store,
            max_bytes,
            rotation_failures: Mutex::default(),
            relays: Mutex::default(),
            relay_failures: Mutex::default(),
        }
    }

    /// One check of every instance's console log (see the module docs).
    pub fn rotate_logs(&self) {
        let max = self.max_bytes;
        let Ok(entries) = std::fs::read_dir(self.store.root().join("instances")) else { return };
        for e in entries.flatten() {
            let vmm = e.path().join(crate::hypervisor::confine::VMM_DIR);
            // Cheap first: only a log over the cap costs a record read (a link is not followed
            // here; `rotate` refuses anything that is not the agent's own file).
            if std::fs::symlink_metadata(vmm.join(SERIAL_LOG)).map(|m| m.len() <= max).unwrap_or(true) {
                continue;
            }
            let id = e.file_name().to_string_lossy().into_owned();
            let Some(rec) = uuid::Uuid::parse_str(&id).ok().and_then(|u| self.store.read_instance(u).ok().flatten())
            else {
                continue;
            };
            let mut failing = lock(&self.rotation_failures);
            match crate::console::rotate(&vmm, &e.path(), max) {
                Ok(true) => {
                    failing.remove(&rec.id);
                    tracing::info!(instance.id = %rec.id, instance.name = %rec.name, max_bytes = max,
                        "console log rotated to serial.log.1")
                }
                Ok(false) => {}
                Err(err) => {
                    if failing.insert(rec.id) {
                        tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, error = %err,
                            "the console log cannot be rotated");
                    }
                }
            }
        }
    }

    /// One check of the serial relays: a running instance whose VMM serves its serial port
    /// on a socket and has no live relay gets one. Cheap for the others: only a VMM
    /// directory with a serial socket costs a record read.
    pub fn relay_all(&self) {
        let Ok(entries) = std::fs::read_dir(self.store.root().join("instances")) else { return };
        for e in entries.flatten() {
            let vmm = e.path().join(crate::hypervisor::confine::VMM_DIR);
            if std::fs::symlink_metadata(vmm.join(SERIAL_SOCKET)).is_err() {
                continue;
            }
            let Some(id) = uuid::Uuid::parse_str(&e.file_name().to_string_lossy()).ok() else { continue };
            if lock(&self.relays).get(&id).is_some_and(|r| !r.is_done()) {
                continue;
            }
            if let Ok(Some(rec)) = self.store.read_instance(id) {
                self.relay(&rec);
            }
        }
    }

    /// Starts the serial relay of `rec` when its VMM runs, serves its serial port on a
    /// socket and has no live relay yet. A failure is logged (once until a relay starts).
    pub fn relay(&self, rec: &InstanceRecord) {
        if rec.state() != InstanceState::Running || rec.hypervisor.driver().serial_port() != SerialPort::Relayed {
            return;
        }
        let mut relays = lock(&self.relays);
        relays.retain(|_, r| !r.is_done());
        if relays.contains_key(&rec.id) {
            return;
        }
        let who = format!("{} ({})", rec.name, rec.id);
        match crate::serial_relay::start(
            &self.store.vmm_dir(rec.id),
            &self.store.instance_dir(rec.id),
            self.max_bytes,
            &who,
        ) {
            Ok(relay) => {
                relays.insert(rec.id, relay);
                if lock(&self.relay_failures).remove(&rec.id) {
                    tracing::info!(instance.id = %rec.id, instance.name = %rec.name, "the serial console is relayed again");
                }
            }
            Err(err) => {
                if lock(&self.relay_failures).insert(rec.id) {
                    tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, error = %err,
                        "the VMM's serial port cannot be relayed: no console log and no console until it can");
                }
            }
        }
    }
}
