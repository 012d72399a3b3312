//! # owners — claims whose owner is not a gpuvisor instance
//!
//! A local client (the Kubernetes DRA node component) prepares devices for an **external
//! owner** — a ResourceClaim, by namespace, name and UID — through the same claim, configure
//! and release code an instance uses:
//!
//! - `claim.prepare` claims exactly the named device for the owner (an exclusive claim file)
//!   and configures it (`claim.rs`: type write + read-back, mdev create, passthrough bind);
//!   the same owner and device again answer the same view; a failure after the claim rolls
//!   back through the release guard;
//! - `claim.release` releases it through the one release path (`release.rs`), refused
//!   (`in_use`) while any process holds the device;
//! - `claim.list` lists claims with their owners;
//! - `claim.owners` tells the agent which owners of a kind exist now.
//!
//! **Liveness of an external owner** ([`external_liveness`]): *done* when it is absent from
//! the last complete live list of its kind and that list is younger than
//! `external_owner_lease_s`; *live* when it is in that list; *maybe alive* when no complete
//! list was ever received by this agent run, or the last one is older than the lease. The
//! reconciler releases a done owner's claim through the grace plugin and the release guard
//! exactly like a dead instance's; a live or maybe-alive one's claim is never released on
//! its behalf. Lists live in memory only: after an agent restart every external owner is
//! maybe alive until the client sends a list again (fail closed).

use super::release::{Release, ReleaseError, Released};
use super::Manager;
use crate::error::{ApiError, ReleaseFailure};
use crate::store::{Claim, ClaimState, External, Framework, Owner, StoreError};
use crate::sync::lock;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The most owners one `claim.owners` list may name.
pub const MAX_LIVE: usize = 100_000;

/// The last complete live list of each external owner kind (in memory: a restart forgets
/// them, and every external owner is maybe alive until a new list comes).
#[derive(Debug, Default)]
pub struct OwnersState {
    lists: Mutex<BTreeMap<String, LiveList>>,
    /// Devices a `claim.prepare` or `claim.release` is working on (the external owners'
    /// counterpart of the instance lock: the reconciler and a second call leave them alone).
    busy: Mutex<BTreeSet<String>>,
}

/// A device marked busy for the length of one external-owner operation.
pub(crate) struct Busy<'a> {
    state: &'a OwnersState,
    device: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        lock(&self.state.busy).remove(&self.device);
    }
}

impl OwnersState {
    /// `owner` asked for a device now, so it lives: the list in force of its kind, received
    /// before, is not evidence that it is done (a claim prepared after the last list would
    /// otherwise be released by the next pass). The next complete list decides again.
    pub(crate) fn note_live(&self, owner: &External) {
        if let Some(l) = lock(&self.lists).get_mut(owner.kind()) {
            l.live.insert(owner.live_id().to_string());
        }
    }

    /// Marks `device` busy; `None` when another external-owner operation holds it.
    pub(crate) fn try_busy(&self, device: &str) -> Option<Busy<'_>> {
        lock(&self.busy).insert(device.to_string()).then(|| Busy { state: self, device: device.to_string() })
    }
}

/// The answer while another `claim.prepare`/`claim.release` of the device runs.
fn busy_error(device: &str) -> ApiError {
    let f = ReleaseFailure {
        code: "busy".into(),
        message: format!("a claim.prepare or claim.release of {device} is in progress; retry"),
    };
    ApiError::in_use(device, &[], &f)
}

/// A complete live list: the identities (ResourceClaim UIDs) and when it was received.
#[derive(Debug, Clone)]
pub struct LiveList {
    /// The ResourceClaim UIDs the list names as live.
    pub live: BTreeSet<String>,
    /// When it was received (monotonic).
    pub at: Instant,
    /// When it was received (RFC 3339, UTC), for reports.
    pub at_wall: String,
}

/// What is known of an external owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExternalLiveness {
    /// Absent from a complete, fresh live list: provably done.
    Done,
    /// In the last live list.
    Live,
    /// No list, or a stale one: maybe alive (why).
    Unknown(String),
}

/// The liveness rule of an external owner (see the module docs). `list`: the last complete
/// live list of the owner's kind, if any.
pub fn external_liveness(owner: &External, list: Option<&LiveList>, now: Instant, lease: Duration) -> ExternalLiveness {
    let Some(list) = list else {
        return ExternalLiveness::Unknown(format!(
            "no complete claim.owners list of kind {} since the agent started: its owners are maybe alive",
            owner.kind()
        ));
    };
    let age = now.saturating_duration_since(list.at);
    if age > lease {
        return ExternalLiveness::Unknown(format!(
            "the last complete claim.owners list of kind {} is {} s old, older than external_owner_lease_s ({} s): \
             its owners are maybe alive",
            owner.kind(),
            age.as_secs(),
            lease.as_secs()
        ));
    }
    if list.live.contains(owner.live_id()) {
        ExternalLiveness::Live
    } else {
        ExternalLiveness::Done
    }
}

/// The owner of a `claim.prepare` / `claim.release` (an external owner only).
fn external_owner(o: &Owner) -> Result<&External, ApiError> {
    let e = o.external().ok_or_else(|| {
        ApiError::invalid_request(
            "owner: an instance's device is claimed by instance.create, not claim.prepare; name an external \
             owner ({\"kind\": \"resource_claim\", \"namespace\", \"name\", \"uid\"})",
        )
    })?;
    let External::ResourceClaim { namespace, name, uid } = e;
    for (what, v, max) in [("namespace", namespace, 253), ("name", name, 253), ("uid", uid, 128)] {
        if v.is_empty() || v.len() > max || !v.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiError::invalid_request(format!(
                "owner.{what} must be 1–{max} printable ASCII characters without spaces, not {v:?}"
            )));
        }
    }
    Ok(e)
}

/// `claim.prepare` parameters.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PrepareParams {
    /// The external owner, e.g. `{"kind": "resource_claim", "namespace": "default", "name":
    /// "gpu-claim", "uid": "…"}`.
    pub owner: Owner,
    /// The device: a VF (vendor VFIO), an mdev parent VF (mdev), or a passthrough GPU.
    pub device: String,
    /// How the device is given: `vendor_vfio`, `mdev` or `passthrough`.
    pub kind: Framework,
    /// The vGPU profile (e.g. `L40S-2Q`); required for `vendor_vfio` and `mdev`, absent for
    /// `passthrough`.
    #[serde(default)]
    pub profile: Option<String>,
}

/// `claim.release` parameters.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseParams {
    /// The external owner that prepared the device.
    pub owner: Owner,
    /// The device `claim.prepare` answered.
    pub device: String,
}

/// `claim.list` parameters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    /// Only claims of this owner kind (`instance`, `resource_claim`); absent: every claim.
    #[serde(default)]
    pub owner_kind: Option<String>,
}

/// `claim.owners` parameters.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OwnersParams {
    /// The external owner kind (`resource_claim`).
    pub kind: String,
    /// Every owner of that kind that exists now (ResourceClaim UIDs).
    pub live: Vec<String>,
    /// `true`: the list is complete (owners not in it are gone). An incomplete list is
    /// accepted and changes nothing.
    pub complete: bool,
}

/// A prepared device (`claim.prepare`), and a claim of `claim.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PreparedView {
    /// The claimed device (the VF, the mdev parent VF, or the GPU).
    pub device: String,
    /// `vendor_vfio`, `mdev` or `passthrough`.
    pub kind: Framework,
    /// The vGPU profile (`passthrough` for a whole GPU).
    pub profile: String,
    /// The type id written (vendor VFIO).
    pub type_id: Option<u32>,
    /// The mdev's UUID (mdev).
    pub mdev_uuid: Option<String>,
    /// The IOMMU group of the device (null when it cannot be read).
    pub vfio_group: Option<u32>,
    /// The device nodes a VMM needs: `/dev/vfio/<group>` and `/dev/vfio/vfio`.
    pub device_nodes: Vec<String>,
    /// The same nodes where this agent finds them (under `host_root`; on a real host the
    /// same paths as `device_nodes`): what a container runtime binds.
    pub host_paths: Vec<String>,
    /// The PCI address given to the VMM (the VF, or the GPU); null for an mdev.
    pub pci_address: Option<String>,
    /// The physical GPU (PF) the device belongs to.
    pub parent_gpu: String,
    /// The claim's owner.
    pub owner: Owner,
    /// `claimed`, `configured` or `release_pending`.
    pub state: ClaimState,
    /// When the claim was made (RFC 3339).
    pub claimed_at: String,
    /// Why the last release failed, if one did.
    pub last_error: Option<String>,
}

/// `claim.release` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReleaseResult {
    /// The device.
    pub device: String,
    /// `true`: cleared and its claim removed now; `false`: there was no claim (already
    /// released).
    pub released: bool,
}

/// `claim.list` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ClaimList {
    /// The claims, by device.
    pub claims: Vec<PreparedView>,
    /// Claim files that cannot be read (`path: error`): their devices are blocked.
    pub unreadable: Vec<String>,
}

/// `claim.owners` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OwnersResult {
    /// The owner kind.
    pub kind: String,
    /// How many owners the list names.
    pub live: usize,
    /// The list was recorded (it was complete).
    pub recorded: bool,
    /// When the list in force was received (RFC 3339); null when none is.
    pub at: Option<String>,
    /// How long it stays authoritative (`external_owner_lease_s`).
    pub lease_s: u64,
}

impl Manager {
    /// Marks `device` busy for an external-owner operation of the reconciler (`None`: a
    /// `claim.prepare`/`claim.release` is working on it).
    pub(crate) fn external_busy(&self, device: &str) -> Option<Busy<'_>> {
        self.owners.try_busy(device)
    }

    /// The liveness of an external owner now (the rule: [`external_liveness`]).
    pub(crate) fn external_liveness(&self, owner: &External) -> ExternalLiveness {
        let lists = lock(&self.owners.lists);
        external_liveness(
            owner,
            lists.get(owner.kind()),
            Instant::now(),
            Duration::from_secs(self.cfg.external_owner_lease_s),
        )
    }

    /// The view of a claim (`claim.prepare`, `claim.list`).
    pub(crate) fn prepared_view(&self, c: &Claim) -> PreparedView {
        let dev = crate::devices::backend(&c.kind).view(&self.host, &crate::devices::Held::of(c));
        let group = dev.group;
        let nodes: Vec<String> =
            group.map(|g| format!("/dev/vfio/{g}")).into_iter().chain(["/dev/vfio/vfio".to_string()]).collect();
        let host_paths = group
            .map(|g| self.host.vfio_group_node(g))
            .into_iter()
            .chain([self.host.vfio_dir().join("vfio")])
            .map(|p| p.display().to_string())
            .collect();
        PreparedView {
            device: c.device.clone(),
            kind: c.kind.framework(),
            profile: c.profile.clone(),
            type_id: c.kind.type_id(),
            mdev_uuid: c.kind.mdev_uuid().map(|u| u.to_string()),
            vfio_group: group,
            device_nodes: nodes,
            host_paths,
            pci_address: dev.pci_address,
            parent_gpu: c.gpu.clone(),
            owner: c.owner.clone(),
            state: c.state,
            claimed_at: c.claimed_at.clone(),
            last_error: c.last_error.clone(),
        }
    }

    /// `claim.prepare` (see the module docs). Logged once on failure.
    pub fn prepare(&self, p: PrepareParams) -> Result<PreparedView, ApiError> {
        let r = self.prepare_inner(&p);
        if let Err(e) = &r {
            let level_error = e.code.class() >= 500;
            if level_error {
                tracing::error!(op = "claim.prepare", owner = %p.owner, gpu.device = %p.device, code = %e.code.as_str(), error = %e.message, "operation failed");
            } else {
                tracing::warn!(op = "claim.prepare", owner = %p.owner, gpu.device = %p.device, code = %e.code.as_str(), error = %e.message, "operation failed");
            }
        }
        r
    }

    fn prepare_inner(&self, p: &PrepareParams) -> Result<PreparedView, ApiError> {
        let owner = external_owner(&p.owner)?;
        // Before anything is claimed: a pass that sees the claim sees its owner live.
        self.owners.note_live(owner);
        if !crate::config::is_bdf(&p.device) {
            return Err(ApiError::invalid_request(format!(
                "device {:?} is not a PCI address (domain:bus:device.function, e.g. 0000:41:00.4)",
                p.device
            )));
        }
        let device = p.device.to_ascii_lowercase();
        let profile = match (p.kind, &p.profile) {
            (Framework::Passthrough, None) => super::inventory::PASSTHROUGH.to_string(),
            (Framework::Passthrough, Some(_)) => {
                return Err(ApiError::invalid_request("profile: a passthrough GPU is given whole; name no profile"))
            }
            (_, Some(pr)) if !pr.trim().is_empty() => pr.clone(),
            (k, _) => return Err(ApiError::invalid_request(format!("profile: {} needs a vGPU profile", k.as_str()))),
        };
        self.require_ready()?;
        let _busy = self.owners.try_busy(&device).ok_or_else(|| busy_error(&device))?;
        // The same owner's claim of this device: the same answer (or, left half-done by a
        // crash or a failed release, released through the guard and claimed again).
        match self.store.read_claim(&device) {
            Ok(Some(c)) if c.owner == p.owner => {
                if c.state == ClaimState::Configured && c.kind.framework() == p.kind && c.profile == profile {
                    return Ok(self.prepared_view(&c));
                }
                if c.state == ClaimState::Configured {
                    return Err(ApiError::invalid_request(format!(
                        "{device} is prepared for this owner as {} {}, not {} {profile}; release it first",
                        c.kind.framework().as_str(),
                        c.profile,
                        p.kind.as_str()
                    )));
                }
                self.release_for(&c, &p.owner)?;
            }
            Ok(Some(c)) => return Err(ApiError::device_taken(&device, &c.owner)),
            Ok(None) => {}
            Err(StoreError::Corrupt { path, reason }) => return Err(ApiError::unreadable_record(&path, &reason)),
            Err(e) => return Err(e.into()),
        }
        let claim = self.claim_external(&p.owner, &device, p.kind, &profile)?;
        tracing::info!(owner = %p.owner, gpu.device = %claim.device, kind = %claim.kind.framework().as_str(), profile = %claim.profile,
            type_id = %claim.kind.type_id().map(|t| t.to_string()).unwrap_or_else(|| "-".into()), "device prepared for an external owner");
        Ok(self.prepared_view(&claim))
    }

    /// Releases `c` for its external owner `asker` through the release path. A holder is
    /// answered at once (`in_use`: the caller retries); a failed write (EBUSY while the
    /// kernel tears the last user down) is retried within `release_retry_s`, as an
    /// instance's release is. Errors: `in_use` while held or unverifiable, `not_ready`, else
    /// `internal` with the release error; the claim stays (`release_pending`).
    pub(crate) fn release_for(&self, c: &Claim, asker: &Owner) -> Result<bool, ApiError> {
        let Some(done) = self.external_asked(c, asker) else {
            return Err(ApiError::device_taken(&c.device, &c.owner));
        };
        let r = match self.release(Release::Claim(c, done), Duration::ZERO) {
            Err(ReleaseError::Failed(_)) => {
                self.release(Release::Claim(c, done), Duration::from_secs(self.cfg.release_retry_s))
            }
            r => r,
        };
        match r {
            Ok(Released::Cleared) => Ok(true),
            Ok(Released::NotOurs | Released::FoundClear) => match self.store.read_claim(&c.device)? {
                Some(cur) if cur.owner != *asker => Err(ApiError::device_taken(&c.device, &cur.owner)),
                Some(_) => {
                    Err(ApiError::internal(format!("the claim of {} changed during its release; retry", c.device)))
                }
                None => Ok(false),
            },
            Err(e @ ReleaseError::InUse(_)) | Err(e @ ReleaseError::ScanIncomplete(_)) => {
                let pids = if let ReleaseError::InUse(p) = &e { p.clone() } else { vec![] };
                Err(ApiError::in_use(&c.device, &pids, &e.failure()))
            }
            Err(ReleaseError::NotReady) => Err(ApiError::not_ready(ReleaseError::NotReady.to_string())),
            Err(e) => {
                let f: ReleaseFailure = e.failure();
                Err(ApiError::internal(format!(
                    "{} could not be released ({}: {}); the claim stays release_pending and the release can be retried",
                    c.device, f.code, f.message
                )))
            }
        }
    }

    /// `claim.release`.
    pub fn release_claim(&self, p: ReleaseParams) -> Result<ReleaseResult, ApiError> {
        let r = (|| {
            external_owner(&p.owner)?;
            let device = p.device.to_ascii_lowercase();
            let _busy = self.owners.try_busy(&device).ok_or_else(|| busy_error(&device))?;
            let released = match self.store.read_claim(&device) {
                Ok(None) => false,
                Ok(Some(c)) if c.owner != p.owner => return Err(ApiError::device_taken(&device, &c.owner)),
                Ok(Some(c)) => self.release_for(&c, &p.owner)?,
                Err(StoreError::Corrupt { path, reason }) => return Err(ApiError::unreadable_record(&path, &reason)),
                Err(e) => return Err(e.into()),
            };
            Ok(ReleaseResult { device, released })
        })();
        if let Err(e) = &r {
            tracing::warn!(op = "claim.release", owner = %p.owner, gpu.device = %p.device, code = %e.code.as_str(), error = %e.message, "operation failed");
        }
        r
    }

    /// `claim.list`.
    pub fn claim_list(&self, p: ListParams) -> Result<ClaimList, ApiError> {
        if let Some(k) = &p.owner_kind {
            if !["instance", "resource_claim"].contains(&k.as_str()) {
                return Err(ApiError::invalid_request(format!(
                    "owner_kind must be instance or resource_claim, not {k:?}"
                )));
            }
        }
        let claims = self.store.scan_claims()?;
        let mut out: Vec<PreparedView> = claims
            .records
            .iter()
            .filter(|c| p.owner_kind.as_deref().is_none_or(|k| c.owner.kind() == k))
            .map(|c| self.prepared_view(c))
            .collect();
        out.sort_by(|a, b| a.device.cmp(&b.device));
        Ok(ClaimList {
            claims: out,
            unreadable: claims.unreadable.iter().map(|u| format!("{}: {}", u.path.display(), u.error)).collect(),
        })
    }

    /// `claim.owners`.
    pub fn set_owners(&self, p: OwnersParams) -> Result<OwnersResult, ApiError> {
        if p.kind != "resource_claim" {
            return Err(ApiError::invalid_request(format!("kind must be resource_claim, not {:?}", p.kind)));
        }
        if p.live.len() > MAX_LIVE {
            return Err(ApiError::invalid_request(format!("live names more than {MAX_LIVE} owners")));
        }
        let lease_s = self.cfg.external_owner_lease_s;
        let mut lists = lock(&self.owners.lists);
        if p.complete {
            let at_wall = super::now_rfc3339();
            lists.insert(
                p.kind.clone(),
                LiveList { live: p.live.iter().cloned().collect(), at: Instant::now(), at_wall: at_wall.clone() },
            );
            tracing::debug!(kind = %p.kind, live = p.live.len(), "external owners recorded");
        }
        Ok(OwnersResult {
            kind: p.kind.clone(),
            live: p.live.len(),
            recorded: p.complete,
            at: lists.get(&p.kind).map(|l| l.at_wall.clone()),
            lease_s,
        })
    }

    /// The configured claim of ResourceClaim `rc` (`instance.create`'s
    /// `gpu.resource_claim`). Errors: `invalid_request` when it has none, or several.
    pub(crate) fn prepared_claim_of(&self, rc: &crate::store::ResourceClaimRef) -> Result<Claim, ApiError> {
        let mut mine: Vec<Claim> = self
            .store
            .scan_claims()?
            .records
            .into_iter()
            .filter(|c| rc.is(&c.owner) && c.state == ClaimState::Configured)
            .collect();
        match mine.len() {
            1 => Ok(mine.remove(0)),
            0 => Err(ApiError::invalid_request(format!(
                "resource claim {rc} has no device prepared on this host (claim.prepare first)"
            ))),
            n => Err(ApiError::invalid_request(format!(
                "resource claim {rc} has {n} devices prepared on this host; a VM takes a claim with one"
            ))),
        }
    }

    /// The device an instance on ResourceClaim `rc` uses now: its configured claim, refused
    /// (`invalid_state`) while another instance on the same claim is starting or running.
    pub(crate) fn borrowed_claim(
        &self,
        rec: &crate::store::InstanceRecord,
        rc: &crate::store::ResourceClaimRef,
    ) -> Result<Claim, ApiError> {
        use crate::store::InstanceState;
        let claim = self.prepared_claim_of(rc)?;
        for other in self.store.scan_instances()?.records {
            if other.id != rec.id
                && other.gpu_resource_claim.as_ref() == Some(rc)
                && matches!(other.state(), InstanceState::Starting | InstanceState::Running | InstanceState::Stopping)
            {
                return Err(ApiError::invalid_state(
                    format!("the device of resource claim {rc} is used by instance {}", other.name),
                    other.state().as_str(),
                ));
            }
        }
        Ok(claim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rc(uid: &str) -> External {
        External::ResourceClaim { namespace: "default".into(), name: "c".into(), uid: uid.into() }
    }

    fn list(uids: &[&str], at: Instant) -> LiveList {
        LiveList { live: uids.iter().map(|s| s.to_string()).collect(), at, at_wall: "t".into() }
    }

    #[test]
    fn an_owner_absent_from_a_fresh_complete_list_is_done() {
        let now = Instant::now();
        let l = list(&["a"], now);
        assert_eq!(external_liveness(&rc("b"), Some(&l), now, Duration::from_secs(300)), ExternalLiveness::Done);
        assert_eq!(external_liveness(&rc("a"), Some(&l), now, Duration::from_secs(300)), ExternalLiveness::Live);
    }

    #[test]
    fn an_owner_that_prepares_after_the_last_list_is_live_until_the_next_one() {
        let state = OwnersState::default();
        let now = Instant::now();
        lock(&state.lists).insert("resource_claim".into(), list(&["a"], now));
        let lease = Duration::from_secs(300);
        let get = |s: &OwnersState| lock(&s.lists).get("resource_claim").cloned();
        assert_eq!(external_liveness(&rc("late"), get(&state).as_ref(), now, lease), ExternalLiveness::Done);
        state.note_live(&rc("late"));
        assert_eq!(external_liveness(&rc("late"), get(&state).as_ref(), now, lease), ExternalLiveness::Live);
        // No list yet: nothing to amend (maybe alive stays maybe alive).
        let empty = OwnersState::default();
        empty.note_live(&rc("late"));
        assert!(get(&empty).is_none());
    }

    #[test]
    fn without_a_list_or_with_a_stale_one_every_owner_is_maybe_alive() {
        let now = Instant::now();
        assert!(matches!(
            external_liveness(&rc("b"), None, now, Duration::from_secs(300)),
            ExternalLiveness::Unknown(_)
        ));
        let old = list(&[], now);
        let later = now + Duration::from_secs(301);
        match external_liveness(&rc("b"), Some(&old), later, Duration::from_secs(300)) {
            ExternalLiveness::Unknown(why) => assert!(why.contains("external_owner_lease_s"), "{why}"),
            other => panic!("{other:?}"),
        }
        // At the lease exactly the list still holds.
        let at = now + Duration::from_secs(300);
        assert_eq!(external_liveness(&rc("b"), Some(&old), at, Duration::from_secs(300)), ExternalLiveness::Done);
    }
}
