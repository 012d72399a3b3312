//! A device's health mark (docs/design/lifecycle.md, Device health): what the health
//! accounting found about a device or GPU, kept in `health/<device>.json` by the store.

use serde::{Deserialize, Serialize};

/// `health/<device>.json` — a health mark (docs/design/lifecycle.md, Device health). `device` is a VF
/// or mdev parent, or a GPU (PF) for a GPU-level mark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthRecord {
    /// The device (VF or mdev parent BDF) or GPU (PF BDF) the mark is on.
    pub device: String,
    /// e.g. `foreign_write`, `kill_escalation`, `eio`, `gpu_fault`.
    pub reason: String,
    /// `false`: the device is only `suspect`; placement still uses it. `true`: placement
    /// never uses it and the sweep never clears it.
    #[serde(default = "yes")]
    pub quarantined: bool,
    /// What was seen, in words (e.g. the failed write and its error).
    pub detail: String,
    /// When the mark was set (RFC 3339, UTC).
    pub at: String,
    /// EIO strikes in a row on this device's releases (type clear, mdev remove); reset by a
    /// write that takes effect. Two quarantine the device.
    #[serde(default)]
    pub eio_in_a_row: u32,
}

fn yes() -> bool {
    true
}
