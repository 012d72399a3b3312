//! Device health (docs/design/lifecycle.md "Device health"): suspect and quarantine marks, strike
//! accounting, and unquarantine. Every sysfs write outcome of the release path and of
//! configure is reported here, once, through [`Marks::write_outcome`].
//!
//! Rules:
//! - **release-time** EIO (type clear, mdev remove): the first makes the device `suspect`,
//!   a second in a row quarantines it;
//! - **create-time** EIO (type write, mdev create) is weaker evidence: two in a row on a VF
//!   make it `suspect`, never quarantined;
//! - **no cascade**: EIO on a second device of the same GPU within [`GPU_FAULT_WINDOW`] (one
//!   operation, or several close together) is one GPU- or driver-level problem: one
//!   `gpu_fault` mark on the GPU, one message, and no strike against its devices — the
//!   EIO strikes already counted on them are lifted. The GPU mark never blocks placement
//!   and clears by itself when a later write on that GPU succeeds, so a transient host-wide
//!   fault leaves no capacity lost once it has ended;
//! - a foreign write quarantines at once; a SIGKILL escalation is a strike (suspect, then
//!   quarantined).

use super::{now_rfc3339, Manager};
use crate::devices::WriteError;
use crate::error::ApiError;
use crate::instances::request::UnquarantineParams;
use crate::store::HealthRecord;
use crate::sync::lock;
use crate::wire::UnquarantineResult;
use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// EIO on two devices of one GPU within this window is one GPU-level problem.
pub const GPU_FAULT_WINDOW: Duration = Duration::from_secs(60);

/// The reason of a GPU-level mark.
pub const GPU_FAULT: &str = "gpu_fault";

pub use crate::devices::{Verdict, WriteSite};

/// True for a write that configures (a failure there refuses a candidate).
fn at_create(site: WriteSite) -> bool {
    matches!(site, WriteSite::SetType | WriteSite::MdevCreate | WriteSite::Bind)
}

#[derive(Debug, Clone)]
struct RecentFailure {
    gpu: String,
    device: String,
    errno: i32,
    at: Instant,
}

/// In-memory health state: create-time EIO streaks (weak evidence, not persisted) and the
/// recent failures the GPU-level rule looks at.
#[derive(Debug, Default)]
pub struct HealthState {
    create_streaks: Mutex<HashMap<String, u32>>,
    recent: Mutex<Vec<RecentFailure>>,
}

/// The health room: what the accounting needs of the manager — the records and the
/// in-memory streaks — and nothing else.
pub(crate) struct Marks<'a> {
    store: &'a super::records::Records,
    health: &'a HealthState,
}

impl Manager {
    /// The health room ([`Marks`]).
    pub(crate) fn marks(&self) -> Marks<'_> {
        Marks { store: &self.store, health: &self.health }
    }
}

impl Marks<'_> {
    /// Quarantines `device` at once (foreign write, failed reset). A device already
    /// quarantined for the same reason keeps its first mark (and is not logged again).
    pub(crate) fn quarantine(&self, device: &str, reason: &str, detail: &str) {
        if matches!(self.store.read_health(device), Ok(Some(h)) if h.quarantined && h.reason == reason) {
            return;
        }
        let rec = HealthRecord {
            device: device.to_string(),
            reason: reason.to_string(),
            quarantined: true,
            detail: detail.to_string(),
            at: now_rfc3339(),
            eio_in_a_row: 0,
        };
        tracing::error!(gpu.device = %device, reason = %reason, detail = %detail, "device quarantined");
        self.write_mark(&rec);
    }

    fn write_mark(&self, rec: &HealthRecord) {
        if let Err(e) = self.store.write_health(rec) {
            tracing::error!(gpu.device = %rec.device, error = %e, "cannot write the health record");
        }
    }

    /// One strike against a device (a SIGKILL escalation): the first makes it `suspect`, a
    /// second quarantines it.
    pub(crate) fn mark_suspect(&self, device: &str, reason: &str, detail: &str) {
        match self.store.read_health(device) {
            Ok(Some(h)) if h.quarantined => {}
            Ok(Some(_)) => self.quarantine(device, reason, &format!("second strike: {detail}")),
            Ok(None) => {
                tracing::warn!(gpu.device = %device, reason = %reason, detail = %detail, "device marked suspect");
                self.write_mark(&HealthRecord {
                    device: device.to_string(),
                    reason: reason.to_string(),
                    quarantined: false,
                    detail: detail.to_string(),
                    at: now_rfc3339(),
                    eio_in_a_row: 0,
                });
            }
            Err(e) => {
                tracing::error!(gpu.device = %device, error = %e, "cannot read the health record; strike not counted")
            }
        }
    }

    /// Reports the outcome of a write on `device` (of GPU `gpu`) to the health accounting.
    pub(crate) fn write_outcome(
        &self,
        device: &str,
        gpu: &str,
        site: WriteSite,
        r: &Result<(), WriteError>,
    ) -> Verdict {
        match r {
            // A passthrough give-back that worked says nothing about the bind that failed
            // before it: only the release-time strike count starts again.
            Ok(()) if matches!(site, WriteSite::Rebind) => {
                if let Ok(Some(mut h)) = self.store.read_health(device) {
                    if !h.quarantined && h.eio_in_a_row > 0 {
                        h.eio_in_a_row = 0;
                        self.write_mark(&h);
                    }
                }
                Verdict::None
            }
            Ok(()) => {
                self.write_succeeded(device, gpu);
                Verdict::None
            }
            Err(w) if w.eio() => self.eio(device, gpu, site, w),
            Err(_) => Verdict::None,
        }
    }

    fn write_succeeded(&self, device: &str, gpu: &str) {
        lock(&self.health.create_streaks).remove(device);
        if let Ok(Some(mut h)) = self.store.read_health(device) {
            if !h.quarantined && h.eio_in_a_row > 0 {
                h.eio_in_a_row = 0;
                self.write_mark(&h);
            }
        }
        if let Ok(Some(g)) = self.store.read_health(gpu) {
            if g.reason == GPU_FAULT {
                match self.store.remove_health(gpu) {
                    Ok(()) => {
                        tracing::info!(gpu = %gpu, gpu.device = %device, "GPU-level fault cleared: a write on the GPU succeeded")
                    }
                    Err(e) => tracing::error!(gpu = %gpu, error = %e, "cannot clear the GPU-level fault mark"),
                }
            }
        }
    }

    fn eio(&self, device: &str, gpu: &str, site: WriteSite, w: &WriteError) -> Verdict {
        let errno = w.errno.unwrap_or(0);
        let others: BTreeSet<String> = {
            let mut recent = lock(&self.health.recent);
            recent.retain(|f| f.at.elapsed() < GPU_FAULT_WINDOW);
            let others = recent.iter().filter(|f| f.gpu == gpu && f.device != device && f.errno == errno);
            let others = others.map(|f| f.device.clone()).collect();
            recent.push(RecentFailure { gpu: gpu.into(), device: device.into(), errno, at: Instant::now() });
            others
        };
        let gpu_mark = self.store.read_health(gpu).ok().flatten().filter(|g| g.reason == GPU_FAULT);
        if gpu_mark.is_some() || !others.is_empty() {
            let mut devices: BTreeSet<String> = others;
            devices.insert(device.to_string());
            let detail = format!(
                "{} on {} devices of GPU {gpu} within {} s ({}): a GPU- or driver-level fault, not a fault of one \
                 device; it clears when a write on the GPU succeeds",
                crate::devices::errno_name(&std::io::Error::from_raw_os_error(errno)),
                devices.len(),
                GPU_FAULT_WINDOW.as_secs(),
                devices.iter().cloned().collect::<Vec<_>>().join(", ")
            );
            if gpu_mark.is_none() {
                tracing::error!(gpu = %gpu, detail = %detail, "GPU-level fault: one mark on the GPU, no strike against its devices");
            }
            self.write_mark(&HealthRecord {
                device: gpu.to_string(),
                reason: GPU_FAULT.into(),
                quarantined: false,
                detail,
                at: gpu_mark.map(|g| g.at).unwrap_or_else(now_rfc3339),
                eio_in_a_row: 0,
            });
            // The strikes those EIOs already counted are lifted: they were the GPU's.
            for d in &devices {
                lock(&self.health.create_streaks).remove(d);
                if let Ok(Some(h)) = self.store.read_health(d) {
                    if matches!(h.reason.as_str(), "eio" | "create_eio") {
                        if let Err(e) = self.store.remove_health(d) {
                            tracing::error!(gpu.device = %d, error = %e, "cannot lift an EIO strike");
                        }
                    }
                }
            }
            return Verdict::GpuFault { gpu: gpu.to_string() };
        }
        if at_create(site) {
            let streak = {
                let mut s = lock(&self.health.create_streaks);
                let n = s.entry(device.to_string()).or_insert(0);
                *n += 1;
                *n
            };
            if streak >= 2 {
                match self.store.read_health(device) {
                    Ok(Some(_)) => {}
                    _ => {
                        tracing::warn!(gpu.device = %device, detail = %w.message, "device marked suspect after EIO twice in a row at create");
                        self.write_mark(&HealthRecord {
                            device: device.to_string(),
                            reason: "create_eio".into(),
                            quarantined: false,
                            detail: format!("EIO twice in a row at create: {}", w.message),
                            at: now_rfc3339(),
                            eio_in_a_row: 0,
                        });
                    }
                }
                return Verdict::Strike;
            }
            return Verdict::None;
        }
        match self.store.read_health(device) {
            Ok(Some(h)) if h.quarantined => {}
            Ok(Some(h)) if h.eio_in_a_row >= 1 => {
                self.quarantine(device, "eio", &format!("EIO twice in a row: {}", w.message));
            }
            Ok(prior) => {
                tracing::warn!(gpu.device = %device, detail = %w.message, "device marked suspect after EIO");
                self.write_mark(&HealthRecord {
                    device: device.to_string(),
                    reason: prior.as_ref().map(|h| h.reason.clone()).unwrap_or_else(|| "eio".into()),
                    quarantined: false,
                    detail: w.message.clone(),
                    at: now_rfc3339(),
                    eio_in_a_row: 1,
                });
            }
            Err(e) => {
                tracing::error!(gpu.device = %device, error = %e, "cannot read the health record; EIO strike not counted")
            }
        }
        Verdict::Strike
    }
}

impl Manager {
    /// `gpu.unquarantine`: clears the marks of one device, several, or a whole GPU (its own
    /// mark and every mark of its devices), after an operator repaired it. Errors:
    /// `invalid_request` when nothing is named, `not_found` when none of them has a mark.
    pub fn unquarantine(&self, p: UnquarantineParams) -> Result<UnquarantineResult, ApiError> {
        let mut wanted: BTreeSet<String> = p.devices.iter().cloned().collect();
        wanted.extend(p.device.iter().cloned());
        if let Some(gpu) = &p.gpu {
            wanted.insert(gpu.clone());
            if let Ok(obs) = self.observer().observe(None) {
                for g in obs.gpus.iter().filter(|g| g.address.eq_ignore_ascii_case(gpu)) {
                    wanted.extend(g.devices.iter().map(|d| d.address.clone()));
                }
            }
        }
        if wanted.is_empty() {
            return Err(ApiError::invalid_request("name a device, devices or a gpu to unquarantine"));
        }
        let marks = self.store.scan_health()?;
        let mut cleared = Vec::new();
        for key in marks.records.iter().map(|h| &h.device).chain(marks.unreadable.iter().map(|u| &u.key)) {
            if wanted.iter().any(|w| w.eq_ignore_ascii_case(key)) {
                self.store.remove_health(key)?;
                lock(&self.health.create_streaks).remove(key);
                tracing::info!(gpu.device = %key, "health mark cleared by gpu.unquarantine");
                cleared.push(key.clone());
            }
        }
        if cleared.is_empty() {
            let what = p.gpu.or(p.device).unwrap_or_else(|| wanted.into_iter().collect::<Vec<_>>().join(", "));
            return Err(ApiError::not_found(&format!("health mark for {what}")));
        }
        cleared.sort();
        Ok(UnquarantineResult {
            device: (cleared.len() == 1).then(|| cleared[0].clone()),
            devices: cleared,
            quarantined: false,
        })
    }
}
