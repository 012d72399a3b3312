//! `instance.stats`: what a running VM uses now, from three places — its VMM process
//! (`/proc`: CPU time of all its threads, vCPUs and device emulation alike, and resident
//! memory), its VMM (each disk's I/O counters, [`crate::hypervisor::Driver::disk_counters`])
//! and the host (each `bridge` NIC's tap counters, [`crate::host::net::link_counters`],
//! turned to the guest's side). Counters run from the VMM's start. A source that cannot be
//! read is named in `unavailable` and its part is `null`, never zeros; a `user` NIC has no
//! counters gpuvisor can read (QEMU keeps them inside its user-mode stack).

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Manager;
use crate::error::ApiError;
use crate::hypervisor::DiskCounters;
use crate::store::InstanceState;

/// The answer of `instance.stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InstanceStats {
    /// The instance id.
    pub id: String,
    /// The instance name.
    pub name: String,
    /// When the counters were read (RFC 3339, UTC).
    pub at: String,
    /// The VMM's pid.
    pub vmm_pid: i32,
    /// Guest vCPUs the running VM was started with.
    pub vcpus: u32,
    /// Guest memory, MiB, the running VM was started with.
    pub memory_mib: u64,
    /// CPU time the VMM process used since it started (user + system, all threads), ms.
    pub cpu_ms: Option<u64>,
    /// The VMM process's resident memory, bytes (guest memory it touched, plus its own).
    pub rss_bytes: Option<u64>,
    /// Each disk's I/O counters, as the VMM reports them.
    pub disks: Option<Vec<DiskCounters>>,
    /// Each NIC the running VM was started with, in guest order.
    pub nics: Vec<NicStats>,
    /// What could not be read, one line each (its part above is `null`).
    pub unavailable: Vec<String>,
}

/// One NIC's traffic, from the guest's side, since its tap was opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NicStats {
    /// `user` or `bridge`.
    pub mode: String,
    /// The tap (`bridge`).
    pub tap: Option<String>,
    /// Bytes the guest received; `null` when unknown (`user`, or unreadable).
    pub rx_bytes: Option<u64>,
    /// Bytes the guest sent.
    pub tx_bytes: Option<u64>,
    /// Packets the guest received.
    pub rx_packets: Option<u64>,
    /// Packets the guest sent.
    pub tx_packets: Option<u64>,
}

impl Manager {
    /// `instance.stats`. Errors: `not_found`, `invalid_state` (not running).
    pub fn stats(&self, r: &str) -> Result<InstanceStats, ApiError> {
        self.on_instance("stats", r, |rec| self.stats_of(rec))
    }

    fn stats_of(&self, rec: &crate::store::InstanceRecord) -> Result<InstanceStats, ApiError> {
        let vmm = match (rec.state(), &rec.vmm) {
            (InstanceState::Running, Some(v)) => v,
            (state, _) => {
                return Err(ApiError::invalid_state(
                    format!("instance {} is {state}: only a running VM has statistics", rec.name),
                    state.as_str(),
                ))
            }
        };
        let mut unavailable = Vec::new();
        let usage = match crate::host::proc::usage_of(&vmm.identity) {
            Ok(Some(u)) => Some(u),
            Ok(None) => {
                unavailable.push(format!("the VMM process {} is gone", vmm.identity.pid));
                None
            }
            Err(e) => {
                unavailable.push(format!("the VMM process: {e}"));
                None
            }
        };
        let io = Duration::from_secs(1);
        let disks = match rec.hypervisor.driver().disk_counters(&vmm.control_socket, io) {
            Ok(d) => Some(d),
            Err(e) => {
                unavailable.push(format!("the disks' counters: {e}"));
                None
            }
        };
        // What the running VM was started with (an update since applies at its next start).
        let machine = rec.running_machine();
        let nics = machine
            .nics
            .iter()
            .enumerate()
            .map(|(i, n)| match n {
                crate::network::Nic::User { .. } => NicStats {
                    mode: "user".into(),
                    tap: None,
                    rx_bytes: None,
                    tx_bytes: None,
                    rx_packets: None,
                    tx_packets: None,
                },
                crate::network::Nic::Bridge { .. } => {
                    let tap = crate::network::tap_name(rec.id, i);
                    let c = crate::host::net::link_counters(&tap)
                        .inspect_err(|e| unavailable.push(format!("nics[{i}] ({tap}): {e}")))
                        .ok();
                    // The host's rx on the tap is what the guest sent.
                    NicStats {
                        mode: "bridge".into(),
                        rx_bytes: c.map(|c| c.tx_bytes),
                        tx_bytes: c.map(|c| c.rx_bytes),
                        rx_packets: c.map(|c| c.tx_packets),
                        tx_packets: c.map(|c| c.rx_packets),
                        tap: Some(tap),
                    }
                }
            })
            .collect();
        Ok(InstanceStats {
            id: rec.id.to_string(),
            name: rec.name.clone(),
            at: super::now_rfc3339(),
            vmm_pid: vmm.identity.pid,
            vcpus: machine.vcpus,
            memory_mib: machine.memory_mib,
            cpu_ms: usage.map(|u| u.cpu_ms),
            rss_bytes: usage.map(|u| u.rss_bytes),
            disks,
            nics,
            unavailable,
        })
    }
}
