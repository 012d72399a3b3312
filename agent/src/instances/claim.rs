//! Claim and configure (docs/design/lifecycle.md Create steps 3–4): observe the host under the
//! allocation lock, ask the placement plugin, create the claim file of the first candidate
//! still free, then configure the device through its kind's backend
//! ([`crate::devices::Backend::configure`]; a dirty device is repaired first through the
//! release path) under the configure and device locks.
//!
//! A create gives up after [`MAX_CONFIGURE_FAILURES`] refused candidates, and skips the
//! rest of a GPU whose failures are one GPU-level problem (`health`), so a driver-wide
//! fault costs a few writes and one clear message, not a write on every VF.

use super::inventory::PASSTHROUGH;
use super::policy_calls::PlacementAsk;
use super::release::{Release, ReleaseError, Released};
use super::{now_rfc3339, Manager};
use crate::devices::observed::Candidate;
use crate::devices::{
    self, passthrough, Answer, ConfigureSteps, Held, NotRecorded, Refused, Verdict, WriteError, WriteSite,
};
use crate::error::{ApiError, ErrorCode};
use crate::host::proc;
use crate::store::{Claim, ClaimState, Framework, InstanceRecord, MdevRecord, Owner, PassthroughWant, StoreError};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// A create (or start) gives up after this many candidates whose configure *write* failed
/// (a refusal that wrote nothing — the fresh catalog no longer lists the type, a dirty VF
/// in use — does not count) and answers `no_capacity`.
pub const MAX_CONFIGURE_FAILURES: usize = 4;

/// How long a `passthrough_*_services` command may run.
const SERVICE_COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// At most this many notes (devices tried or skipped) are spelled out in a `no_capacity`
/// message.
const MESSAGE_NOTES: usize = 6;

/// Why a claim and configure did not end with a configured device.
#[derive(Debug)]
pub(crate) enum ClaimFailure {
    /// Nothing of this instance is left claimed.
    Nothing(ApiError),
    /// A claim of this instance exists (configured, or in an unknown state) and must be
    /// released through the rollback.
    Held(Box<Claim>, ApiError),
}

/// A candidate the configure step refused.
struct Refusal {
    why: String,
    verdict: Verdict,
    /// The device was left as it was found (or reads 0): the claim can simply be dropped.
    /// `false`: its state is unknown and the claim must go through the release path.
    untouched: bool,
    /// A sysfs write was attempted (counts against [`MAX_CONFIGURE_FAILURES`]).
    wrote: bool,
    /// The error to answer with instead of `no_capacity` (passthrough: the named GPU is
    /// refused, or its bind failed).
    error: Option<ApiError>,
}

impl Refusal {
    /// Refused before any write.
    fn untouched(why: impl Into<String>) -> Refusal {
        Refusal { why: why.into(), verdict: Verdict::None, untouched: true, wrote: false, error: None }
    }

    /// A write was refused.
    fn write_failed(why: impl Into<String>, verdict: Verdict, untouched: bool) -> Refusal {
        Refusal { why: why.into(), verdict, untouched, wrote: true, error: None }
    }

    /// A backend's refusal of `device`, its answer as the API's error for that device (a
    /// refusal before any write says the error's message).
    fn from_refused(r: Refused, device: &str) -> Refusal {
        let error = r.answer.map(|a| match a {
            Answer::GroupConflict { group, foreign } => ApiError::iommu_group_conflict(device, group, &foreign),
            Answer::GpuBusy { node, holders, services_stopped } => {
                ApiError::gpu_busy(device, &node, &holders, services_stopped)
            }
            Answer::BindFailed { error } => ApiError::passthrough_bind_failed(device, &error, ""),
        });
        let why = match &error {
            Some(e) if !r.wrote => e.message.clone(),
            _ => r.why,
        };
        Refusal { why, verdict: r.verdict, untouched: r.untouched, wrote: r.wrote, error }
    }
}

/// The claim path's side of a backend's configure: the health accounting, the mdev
/// records, the host services of a passthrough bind.
struct Steps<'a> {
    m: &'a Manager,
    claim: &'a Claim,
}

impl ConfigureSteps for Steps<'_> {
    fn write_outcome(&self, device: &str, gpu: &str, site: WriteSite, result: &Result<(), WriteError>) -> Verdict {
        self.m.marks().write_outcome(device, gpu, site, result)
    }

    fn quarantine(&self, device: &str, reason: &str, detail: &str) {
        self.m.marks().quarantine(device, reason, detail);
    }

    fn mdev_creating(&self, uuid: uuid::Uuid, parent: &str, mdev_type: &str) -> Result<(), NotRecorded> {
        let rec = MdevRecord {
            uuid,
            parent: parent.to_string(),
            mdev_type: mdev_type.to_string(),
            instance_id: self.claim.owner.instance(),
            created_at: now_rfc3339(),
            boot_id: self.claim.claim_boot_id.clone(),
            created_boottime_ms: proc::boottime_ms(),
        };
        self.m.store.write_mdev(&rec).map_err(|e| NotRecorded(e.to_string()))
    }

    fn mdev_not_created(&self, uuid: uuid::Uuid) {
        let _ = self.m.store.remove_mdev(uuid);
    }

    fn free_from_host_driver(&self, _gpu: &str, node: &std::path::Path) -> Result<bool, Refused> {
        self.m.free_from_host_driver(node)
    }

    fn start_services(&self) {
        self.m.host_services("start", &self.m.cfg.passthrough_start_services);
    }
}

impl Manager {
    fn new_claim(
        &self,
        rec: &InstanceRecord,
        c: &Candidate,
        profile: &str,
        boot_id: &str,
        driver: &Option<String>,
    ) -> Claim {
        Claim {
            device: c.device.clone(),
            owner: Owner::Instance(rec.id),
            owner_name: Some(rec.name.clone()),
            owner_labels: Some(rec.labels.clone()),
            gpu: c.gpu.clone(),
            profile: profile.to_string(),
            kind: c.claim_kind(),
            claimed_at: now_rfc3339(),
            claim_boot_id: boot_id.to_string(),
            claimed_boottime_ms: proc::boottime_ms(),
            driver_version: driver.clone(),
            state: ClaimState::Claimed,
            release_attempts: 0,
            last_error: None,
        }
    }

    /// Claims and configures a device for `rec`. On success the claim is durable and
    /// `configured`. On [`ClaimFailure::Nothing`] no claim of the instance is left.
    pub(crate) fn claim_and_configure(&self, rec: &InstanceRecord) -> Result<Claim, ClaimFailure> {
        let fail = ClaimFailure::Nothing;
        self.require_ready().map_err(fail)?;
        let whole = rec.gpu_passthrough.as_ref();
        let profile = match whole {
            Some(_) => PASSTHROUGH.to_string(),
            None => rec.gpu_profile.clone().unwrap_or_default(),
        };
        let boot_id = self.boot_id().map_err(fail)?;
        let started = Instant::now();
        let ask = PlacementAsk { instance_id: rec.id, name: &rec.name, labels: &rec.labels, profile: &profile };
        let (obs, ranking) = {
            let _a = self.alloc();
            let (obs, framework) = self.observer().observe_candidates(&profile, whole).map_err(fail)?;
            let ranking = self.rank(&ask, framework, &obs).map_err(fail)?;
            (obs, ranking)
        };
        crate::crash_point!("claim_before_create");
        // What the placement plugin ranked and the agent dropped first: often the cause.
        let (ranked, mut notes) = (ranking.candidates, ranking.notes);
        notes.extend(obs.notes.iter().cloned());
        // Legal candidates the placement plugin left out: the answer must not say none was
        // free.
        let plugin = self.policies().placement.name().to_string();
        let unranked: Vec<String> = obs
            .candidates
            .iter()
            .filter(|c| !ranked.iter().any(|r| r.device == c.device))
            .map(|c| c.device.clone())
            .collect();
        let ranked_count = ranked.len();
        // Bounded as the dropped entries are: a host has hundreds of free VFs.
        notes.extend(super::policy_calls::bounded_notes(
            &unranked,
            |d| format!("{d}: free, but the placement plugin {plugin} did not rank it"),
            |more| format!("and {more} more free devices the placement plugin {plugin} did not rank"),
        ));
        let mut failures = 0;
        let mut faulty_gpus = BTreeSet::new();
        for cand in ranked {
            if faulty_gpus.contains(&cand.gpu) {
                continue;
            }
            if failures >= MAX_CONFIGURE_FAILURES {
                notes.push(format!("gave up after {failures} refused candidates"));
                break;
            }
            let mut claim = self.new_claim(rec, &cand, &profile, &boot_id, &obs.driver_version);
            {
                let _a = self.alloc();
                match self.store.create_claim(&claim) {
                    Ok(()) => {}
                    Err(StoreError::ClaimExists { .. }) => continue,
                    Err(e) => return Err(fail(e.into())),
                }
            }
            match self.configure_claimed(&mut claim, &cand) {
                Ok(Err(e)) => return Err(ClaimFailure::Held(Box::new(claim), e.into())),
                Ok(Ok(())) => {
                    self.metrics.claim_duration(started.elapsed().as_secs_f64());
                    tracing::info!(instance.id = %rec.id, instance.name = %rec.name, gpu.device = %claim.device,
                        type_id = %claim.kind.type_id().map(|t| t.to_string()).unwrap_or_else(|| "-".into()),
                        duration_ms = started.elapsed().as_millis() as u64, "device claimed and configured");
                    return Ok(claim);
                }
                Err(r) => {
                    failures += usize::from(r.wrote);
                    tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, gpu.device = %cand.device,
                        reason = %r.why, "candidate refused");
                    notes.push(format!("{}: {}", cand.device, r.why));
                    if let Verdict::GpuFault { gpu } = &r.verdict {
                        notes.push(format!("GPU {gpu}: the same error on several of its devices: a GPU- or driver-level fault; its other devices were not tried"));
                        faulty_gpus.insert(gpu.clone());
                    }
                    let error = r.error.clone();
                    // A failed bind whose one-shot undo failed goes on to the rollback with its
                    // own error (not the undo's), so the answer names the bind.
                    let bind_failed = error.clone().filter(|e| e.code == ErrorCode::PassthroughBindFailed);
                    self.drop_refused_claim(rec, claim, r)
                        .map_err(|(c, e)| ClaimFailure::Held(c, bind_failed.unwrap_or(e)))?;
                    // A named GPU, or a bind that failed (a host problem, not this GPU's
                    // luck): the answer is that error, once the group is given back.
                    if let Some(e) = error {
                        let named = whole.is_some_and(|w| w.address.is_some());
                        if named || e.code == ErrorCode::PassthroughBindFailed {
                            return Err(fail(self.with_binding_now(e, &cand)));
                        }
                    }
                }
            }
        }
        // The message stays one readable sentence on any host: the first notes, then a count
        // (every note is in `data.notes`).
        let (noun, suffix) = match whole {
            Some(_) => ("passthrough GPU", String::new()),
            None => ("device", format!(" for profile {profile}")),
        };
        let plural = |n: usize| if n == 1 { noun.to_string() } else { format!("{noun}s") };
        let mut msg = match whole {
            Some(w) if w.address.is_some() => {
                format!("the passthrough GPU {} cannot be given now", w.address.as_deref().unwrap_or_default())
            }
            _ if !unranked.is_empty() && ranked_count == 0 => format!(
                "the placement plugin {plugin} ranked none of the {} free {}{suffix}",
                unranked.len(),
                plural(unranked.len())
            ),
            _ if !unranked.is_empty() => {
                format!("no {noun}{suffix} the placement plugin {plugin} ranked could be given now")
            }
            Some(_) => "no passthrough GPU is free now".to_string(),
            None => format!("no device can take profile {profile} now"),
        };
        if !notes.is_empty() {
            let shown: Vec<&str> = notes.iter().take(MESSAGE_NOTES).map(String::as_str).collect();
            let more = notes.len().saturating_sub(MESSAGE_NOTES);
            let more = if more > 0 { format!("; and {more} more in data.notes") } else { String::new() };
            msg = format!("{msg} ({}{more})", shown.join("; "));
        }
        Err(fail(ApiError::no_capacity(msg, &profile, notes, None)))
    }

    /// Forgets the claim of a refused candidate: dropped when the device was left as found,
    /// released through the release path when its state is unknown. Errors: the release
    /// failed — the claim stays (`release_pending`) and the caller must roll back.
    fn drop_refused_claim(&self, rec: &InstanceRecord, claim: Claim, r: Refusal) -> Result<(), (Box<Claim>, ApiError)> {
        let held = |c: &Claim, e: ApiError| (Box::new(c.clone()), e);
        if r.untouched {
            let _a = self.alloc();
            match self.store.read_claim(&claim.device) {
                Ok(Some(cur)) if cur.same_claim(&claim) => {
                    self.store.remove_claim(&claim.device).map_err(|e| held(&claim, e.into()))?
                }
                Ok(_) => {}
                Err(e) => return Err(held(&claim, e.into())),
            }
            if let Some(u) = claim.kind.mdev_uuid() {
                let _ = self.store.remove_mdev(u);
            }
            return Ok(());
        }
        let boot_id = self.boot_id().map_err(|e| held(&claim, e))?;
        let dead = match self.prove_dead(rec.id, Some(rec), &boot_id) {
            Ok(d) => d,
            Err(l) => return Err(held(&claim, ApiError::internal(format!("the VMM of a starting instance is {l}")))),
        };
        match self.release(Release::Claim(&claim, dead), Duration::ZERO) {
            Ok(_) => Ok(()),
            Err(e) => Err(held(&claim, ApiError::internal(format!("a refused candidate could not be released: {e}")))),
        }
    }

    /// The claim is durable: configures the device and records the claim `configured`
    /// (the same steps for every owner). `Err`: the configure refused; `Ok(Err)`: the
    /// device is configured but the claim could not be recorded so (it reads `claimed`: the
    /// caller releases it).
    fn configure_claimed(&self, claim: &mut Claim, cand: &Candidate) -> Result<Result<(), StoreError>, Refusal> {
        crate::crash_point!("after_claim_commit");
        self.configure(claim, cand)?;
        claim.state = ClaimState::Configured;
        if let Err(e) = self.store.update_claim(claim) {
            claim.state = ClaimState::Claimed;
            return Ok(Err(e));
        }
        crate::crash_point!("after_configure");
        Ok(Ok(()))
    }

    /// Configures a claimed device through its kind's backend (the same step for every
    /// owner): a dirty device is repaired first (through the release path), then, under
    /// the configure and device locks, the backend configures it.
    fn configure(&self, claim: &mut Claim, cand: &Candidate) -> Result<(), Refusal> {
        let backend = devices::backend(&claim.kind);
        let dirty = backend.dirty(&self.host, &Held::of(claim)).map_err(|e| Refusal::untouched(e.to_string()))?;
        if let Some(cur) = dirty {
            self.repair(claim, cand, cur)?;
        }
        // The repair (through the release path: allocation lock, then device lock) is done
        // before the configure lock is taken, so the locks are always taken in one order.
        let _c = self.configure_lock();
        let dev_lock = self.device_lock(&claim.device);
        let _d = crate::sync::lock(&dev_lock);
        let steps = Steps { m: self, claim };
        match backend.configure(&self.host, &Held::of(claim), &claim.profile, &steps) {
            Ok(kind) => {
                claim.kind = kind;
                Ok(())
            }
            Err(r) => Err(Refusal::from_refused(r, &claim.device)),
        }
    }

    /// Repairs a dirty claimed device (it reads type `cur`) through the release path, when
    /// the observation saw it dirty (one found dirty since it was seen free is refused).
    fn repair(&self, claim: &Claim, cand: &Candidate, cur: u32) -> Result<(), Refusal> {
        let vf = &claim.device;
        if !cand.dirty {
            return Err(Refusal::untouched(format!("reads type {cur} since it was observed free")));
        }
        match self.release(Release::Repair { claim, type_id: cur }, Duration::ZERO) {
            Ok(Released::Cleared | Released::FoundClear) => {
                tracing::info!(gpu.device = %vf, old_type = %cur, "dirty VF repaired")
            }
            Ok(Released::NotOurs) => return Err(Refusal::untouched("the claim changed during the repair")),
            Err(ReleaseError::InUse(pids)) => {
                return Err(Refusal::untouched(format!("dirty (type {cur}) and in use by pid {pids:?}")))
            }
            Err(ReleaseError::ScanIncomplete(reason)) => {
                return Err(Refusal::untouched(format!(
                    "dirty (type {cur}) and its holders cannot be verified: {reason}"
                )))
            }
            Err(e @ (ReleaseError::Failed(_) | ReleaseError::Foreign(_))) => {
                return Err(Refusal::write_failed(
                    format!("dirty (type {cur}) and not repaired: {e}"),
                    Verdict::None,
                    true,
                ))
            }
            Err(e) => return Err(Refusal::untouched(format!("dirty (type {cur}) and not repaired: {e}"))),
        }
        crate::crash_point!("configure_after_repair");
        Ok(())
    }

    /// Makes sure no host process holds the GPU through the host driver's `node`. A holder
    /// with no `passthrough_stop_services` configured is `gpu_busy`; with them, the services
    /// are stopped first (`Ok(true)`: they must be started again).
    fn free_from_host_driver(&self, node: &std::path::Path) -> Result<bool, Refused> {
        let holders = || match proc::scan_open_handles(&[node.to_path_buf()]) {
            proc::HandleScan::Clean => Ok(vec![]),
            proc::HandleScan::Held { pids } => Ok(pids),
            proc::HandleScan::Unknown { reason } => {
                Err(Refused::untouched(format!("the holders of {} cannot be verified: {reason}", node.display())))
            }
        };
        let mut pids = holders()?;
        if pids.is_empty() {
            return Ok(false);
        }
        let services = &self.cfg.passthrough_stop_services;
        let stopped = !services.is_empty();
        if stopped {
            self.host_services("stop", services);
            pids = holders()?;
        }
        if pids.is_empty() {
            return Ok(stopped);
        }
        if stopped {
            self.host_services("start", &self.cfg.passthrough_start_services);
        }
        let holders: Vec<String> = pids.iter().map(|p| proc::describe_pid(*p)).collect();
        let answer = Answer::GpuBusy { node: node.display().to_string(), holders, services_stopped: stopped };
        Err(Refused::answer("held through the host driver", answer))
    }

    /// Runs a `passthrough_*_services` command, killed after [`SERVICE_COMMAND_TIMEOUT`]
    /// (it runs under the configure lock); a failure is logged (the bind's own checks decide
    /// what happens next).
    fn host_services(&self, what: &str, argv: &[String]) {
        let Some((bin, args)) = argv.split_first() else { return };
        let command = argv.join(" ");
        let mut child = match std::process::Command::new(bin).args(args).stdin(std::process::Stdio::null()).spawn() {
            Ok(c) => c,
            Err(e) => {
                return tracing::warn!(command = %command, error = %e, "the host services {what} command cannot run")
            }
        };
        let deadline = Instant::now() + SERVICE_COMMAND_TIMEOUT;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Ok(s),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break Err(format!("killed after {} s", SERVICE_COMMAND_TIMEOUT.as_secs()));
                }
                Err(e) => break Err(e.to_string()),
            }
        };
        match status {
            Ok(s) if s.success() => {
                tracing::info!(command = %command, step = %what, "host services command done for passthrough")
            }
            Ok(s) => tracing::warn!(command = %command, status = %s, "the host services {what} command failed"),
            Err(e) => tracing::warn!(command = %command, error = %e, "the host services {what} command did not finish"),
        }
    }

    /// A `passthrough_bind_failed` answer carries the binding read after the release path
    /// gave the group back.
    fn with_binding_now(&self, e: ApiError, cand: &Candidate) -> ApiError {
        if e.code != ErrorCode::PassthroughBindFailed {
            return e;
        }
        let binding = match passthrough::read_gpu(&self.host, &cand.device) {
            Ok(Some(g)) => g.binding(),
            Ok(None) => "the GPU is gone".into(),
            Err(x) => format!("cannot be read: {x}"),
        };
        let error = e.details().get("error").and_then(|v| v.as_str()).unwrap_or_default().to_string();
        ApiError::passthrough_bind_failed(&cand.device, &error, &binding)
    }

    /// Claims exactly `device` for the external `owner` and configures it through the same
    /// steps as an instance's claim (type write + read-back, mdev create, passthrough bind),
    /// `owners.rs`'s `claim.prepare`. The device must be a legal candidate for `profile` now.
    /// A refused configure drops the claim when the device was left as found, else releases
    /// it through the release guard (the owner's own prepare failed: it is done with it); a
    /// release that fails keeps the claim `release_pending` for the owner or the reconciler.
    pub(super) fn claim_external(
        &self,
        owner: &Owner,
        device: &str,
        kind: Framework,
        profile: &str,
    ) -> Result<Claim, ApiError> {
        let boot_id = self.boot_id()?;
        let started = Instant::now();
        let whole = (kind == Framework::Passthrough).then(|| PassthroughWant { address: Some(device.to_string()) });
        let (mut claim, cand) = {
            let _a = self.alloc();
            let (obs, framework) = self.observer().observe_candidates(profile, whole.as_ref())?;
            if framework != kind {
                return Err(ApiError::invalid_request(format!(
                    "kind {} does not match this host, which gives vGPUs as {}",
                    kind.as_str(),
                    framework.as_str()
                )));
            }
            let Some(cand) = obs.candidates.iter().find(|c| c.device.eq_ignore_ascii_case(device)).cloned() else {
                return Err(not_a_candidate(&obs, device, profile));
            };
            let claim = Claim {
                device: cand.device.clone(),
                owner: owner.clone(),
                owner_name: None,
                owner_labels: Some(Default::default()),
                gpu: cand.gpu.clone(),
                profile: profile.to_string(),
                kind: cand.claim_kind(),
                claimed_at: now_rfc3339(),
                claim_boot_id: boot_id.clone(),
                claimed_boottime_ms: proc::boottime_ms(),
                driver_version: obs.driver_version.clone(),
                state: ClaimState::Claimed,
                release_attempts: 0,
                last_error: None,
            };
            match self.store.create_claim(&claim) {
                Ok(()) => {}
                Err(StoreError::ClaimExists { .. }) => {
                    return Err(match self.store.read_claim(device) {
                        Ok(Some(c)) if c.owner != *owner => ApiError::device_taken(device, &c.owner),
                        _ => ApiError::internal(format!("{device} was claimed concurrently by this owner; retry")),
                    })
                }
                Err(e) => return Err(e.into()),
            }
            (claim, cand)
        };
        match self.configure_claimed(&mut claim, &cand) {
            Ok(Err(e)) => {
                let _ = self.release_for(&claim, owner);
                Err(e.into())
            }
            Ok(Ok(())) => {
                self.metrics.claim_duration(started.elapsed().as_secs_f64());
                Ok(claim)
            }
            Err(r) => {
                tracing::warn!(owner = %owner, gpu.device = %claim.device, reason = %r.why, "device refused for an external owner");
                if r.untouched {
                    let _a = self.alloc();
                    if let Ok(Some(cur)) = self.store.read_claim(&claim.device) {
                        if cur.same_claim(&claim) {
                            self.store.remove_claim(&claim.device)?;
                        }
                    }
                    if let Some(u) = claim.kind.mdev_uuid() {
                        let _ = self.store.remove_mdev(u);
                    }
                } else {
                    self.release_for(&claim, owner)?;
                }
                Err(r.error.unwrap_or_else(|| {
                    let notes = vec![format!("{}: {}", claim.device, r.why)];
                    ApiError::no_capacity(
                        format!("{} cannot take {profile} now: {}", claim.device, r.why),
                        profile,
                        notes,
                        None,
                    )
                }))
            }
        }
    }
}

/// Why `device` is not a legal candidate for `profile` now, as the error `claim.prepare`
/// answers: `not_found`, `device_taken`, `device_unhealthy`, `in_use` (a dirty VF held
/// open), or `no_capacity` — naming the equal-size rule when the GPU holds vGPUs of another
/// size.
fn not_a_candidate(obs: &super::inventory::Observation, device: &str, profile: &str) -> ApiError {
    use gpuvisor_sdk::DeviceState;
    let found = obs
        .gpus
        .iter()
        .flat_map(|g| g.devices.iter().map(move |d| (g, d)))
        .find(|(_, d)| d.address.eq_ignore_ascii_case(device));
    let Some((g, d)) = found else {
        return ApiError::not_found(&format!("device {device}"));
    };
    let notes: Vec<String> = obs.notes.iter().filter(|n| n.contains(device)).cloned().collect();
    if !g.managed {
        return ApiError::invalid_request(format!("{device} is on GPU {}, which gpuvisor does not manage", g.address));
    }
    match d.state {
        DeviceState::Quarantined => {
            let h = d.health.as_ref();
            return ApiError::device_unhealthy(
                device,
                h.map(|h| h.reason.as_str()).unwrap_or("-"),
                h.map(|h| h.detail.as_str()).unwrap_or("-"),
            );
        }
        DeviceState::Claimed => {
            if let Some(c) = &d.claim {
                return ApiError::device_taken(device, &c.owner);
            }
        }
        DeviceState::Dirty if !notes.is_empty() => {
            let f = crate::error::ReleaseFailure { code: "in_use".into(), message: notes.join("; ") };
            return ApiError::in_use(device, &[], &f);
        }
        _ => {}
    }
    if let Some(why) = d.claim_unreadable.as_ref().or(d.unreadable.as_ref()) {
        return ApiError::internal(format!("{device} cannot be given: its state cannot be read ({why})"));
    }
    // Other vGPUs on the GPU: the driver runs each GPU in equal-size mode.
    let others: BTreeSet<&str> = g
        .devices
        .iter()
        .filter(|o| o.address != d.address)
        .filter_map(|o| o.claim.as_ref())
        .filter(|c| !c.profile.eq_ignore_ascii_case(profile))
        .map(|c| c.profile.as_str())
        .collect();
    let msg = if !others.is_empty() {
        format!(
            "{device} cannot take {profile} now: its GPU {} holds {} vGPU(s), and the driver puts only vGPUs of              one framebuffer size on a GPU at a time (equal-size rule); {profile} fits there once those are released",
            g.address,
            others.into_iter().collect::<Vec<_>>().join(", ")
        )
    } else if d.state == DeviceState::Free && !d.creatable.iter().any(|c| c.eq_ignore_ascii_case(profile)) {
        format!(
            "{device} cannot take {profile} now: the driver does not list it as creatable there (it lists {});              vGPUs on one GPU must all have the same framebuffer size (equal-size rule) and fit its framebuffer",
            if d.creatable.is_empty() { "nothing".to_string() } else { d.creatable.join(", ") }
        )
    } else {
        format!(
            "{device} cannot take {profile} now ({})",
            if notes.is_empty() { "not free".into() } else { notes.join("; ") }
        )
    };
    ApiError::no_capacity(msg, profile, notes, None)
}
