//! A claim: the one record of who owns a device, its kind (what the device backend
//! configured) and its owner (an instance, or an external consumer such as a Kubernetes
//! ResourceClaim).

use super::instance::Labels;
use super::state::ClaimState;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// How a GPU is given to an instance, as claim and instance records spell it
/// (`vendor_vfio`, `mdev`, `passthrough`). The store's own type: the records do not change
/// when the plugin SDK does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Framework {
    /// A type id written to an SR-IOV VF's `nvidia/current_vgpu_type`.
    VendorVfio,
    /// A mediated device created from `mdev_supported_types/<type>/create`.
    Mdev,
    /// A whole GPU (and its IOMMU group) bound to `vfio-pci`.
    Passthrough,
}

impl Framework {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Framework::VendorVfio => "vendor_vfio",
            Framework::Mdev => "mdev",
            Framework::Passthrough => "passthrough",
        }
    }
}

impl From<Framework> for gpuvisor_sdk::Framework {
    fn from(f: Framework) -> gpuvisor_sdk::Framework {
        match f {
            Framework::VendorVfio => gpuvisor_sdk::Framework::VendorVfio,
            Framework::Mdev => gpuvisor_sdk::Framework::Mdev,
            Framework::Passthrough => gpuvisor_sdk::Framework::Passthrough,
        }
    }
}

/// Who owns a claim: one of gpuvisor's instances, or an external consumer that prepared
/// the device through `claim.prepare` (a Kubernetes ResourceClaim). Each kind has its
/// liveness rule (an instance: its VMM provably dead, `vmm.rs`; an external owner: absent
/// from the last complete, fresh live list, `instances/owners.rs`); the release guard's
/// sequence is the same for every owner.
///
/// On the wire: `{"kind": "instance", "id": "<uuid>"}` or
/// `{"kind": "resource_claim", "namespace", "name", "uid"}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(from = "OwnerWire", into = "OwnerWire")]
pub enum Owner {
    /// A gpuvisor instance.
    Instance(Uuid),
    /// A consumer outside gpuvisor.
    External(External),
}

/// An owner outside gpuvisor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum External {
    /// A Kubernetes ResourceClaim (`resource.k8s.io`), named by namespace and name and
    /// identified by its UID (a claim recreated under the same name is another owner).
    ResourceClaim {
        /// The namespace (1–253 characters).
        namespace: String,
        /// The name (1–253 characters).
        name: String,
        /// The UID (1–128 characters).
        uid: String,
    },
}

/// The wire form of [`Owner`].
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
enum OwnerWire {
    /// A gpuvisor instance.
    Instance {
        /// The instance id.
        #[schemars(with = "String")]
        id: Uuid,
    },
    /// A Kubernetes ResourceClaim.
    ResourceClaim {
        /// The namespace.
        namespace: String,
        /// The name.
        name: String,
        /// The UID.
        uid: String,
    },
}

impl From<OwnerWire> for Owner {
    fn from(w: OwnerWire) -> Owner {
        match w {
            OwnerWire::Instance { id } => Owner::Instance(id),
            OwnerWire::ResourceClaim { namespace, name, uid } => {
                Owner::External(External::ResourceClaim { namespace, name, uid })
            }
        }
    }
}

impl From<Owner> for OwnerWire {
    fn from(o: Owner) -> OwnerWire {
        match o {
            Owner::Instance(id) => OwnerWire::Instance { id },
            Owner::External(External::ResourceClaim { namespace, name, uid }) => {
                OwnerWire::ResourceClaim { namespace, name, uid }
            }
        }
    }
}

impl Owner {
    /// The instance, when an instance owns the claim.
    pub fn instance(&self) -> Option<Uuid> {
        match self {
            Owner::Instance(id) => Some(*id),
            Owner::External(_) => None,
        }
    }

    /// The instance id for logs, `-` for an external owner.
    pub fn instance_label(&self) -> String {
        self.instance().map(|i| i.to_string()).unwrap_or_else(|| "-".into())
    }

    /// The external owner, if any.
    pub fn external(&self) -> Option<&External> {
        match self {
            Owner::External(e) => Some(e),
            Owner::Instance(_) => None,
        }
    }

    /// The wire name of the owner's kind (`instance`, `resource_claim`).
    pub fn kind(&self) -> &'static str {
        match self {
            Owner::Instance(_) => "instance",
            Owner::External(e) => e.kind(),
        }
    }
}

impl External {
    /// The wire name of the kind (`resource_claim`).
    pub fn kind(&self) -> &'static str {
        match self {
            External::ResourceClaim { .. } => "resource_claim",
        }
    }

    /// The identity the owner's live lists name (a ResourceClaim's UID).
    pub fn live_id(&self) -> &str {
        match self {
            External::ResourceClaim { uid, .. } => uid,
        }
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Instance(id) => write!(f, "instance {id}"),
            Owner::External(External::ResourceClaim { namespace, name, uid }) => {
                write!(f, "resource_claim {namespace}/{name} (uid {uid})")
            }
        }
    }
}

/// How a claim record stores its owner: an instance as `instance_id` (the format every
/// version wrote, so records stay readable both ways), an external owner as `owner` (a
/// version that does not know owners cannot decode it: it reads the claim as unreadable
/// and blocks the device — fail closed).
mod claim_owner {
    use super::{Owner, OwnerWire};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use uuid::Uuid;

    #[derive(Serialize, Deserialize)]
    struct Fields {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        instance_id: Option<Uuid>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<OwnerWire>,
    }

    pub fn serialize<S: Serializer>(o: &Owner, s: S) -> Result<S::Ok, S::Error> {
        match o {
            Owner::Instance(id) => Fields { instance_id: Some(*id), owner: None },
            Owner::External(_) => Fields { instance_id: None, owner: Some(o.clone().into()) },
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Owner, D::Error> {
        let f = Fields::deserialize(d)?;
        match (f.instance_id, f.owner) {
            (Some(id), None) => Ok(Owner::Instance(id)),
            (None, Some(o)) => Ok(o.into()),
            (Some(id), Some(o)) if Owner::from(o.clone()) == Owner::Instance(id) => Ok(Owner::Instance(id)),
            (Some(_), Some(_)) => Err(serde::de::Error::custom("the claim names two different owners")),
            (None, None) => Err(serde::de::Error::custom("the claim names no owner (instance_id or owner)")),
        }
    }
}

/// `claims/<device>.json` — the only record of who owns a device (docs/design/lifecycle.md, Words).
///
/// On disk it keeps the flat shape every version wrote ([`ClaimWire`]: `framework` plus
/// the per-kind `type_id`, `mdev_uuid`, `mdev_type` and `passthrough` fields); in memory
/// the per-kind part is one [`ClaimKind`]. A record whose per-kind fields do not match its
/// `framework` does not decode (it is unreadable, and its device is blocked: fail closed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "ClaimWire", into = "ClaimWire")]
pub struct Claim {
    /// The thing that can have one owner: the VF address (vendor VFIO, and mdev on a VF),
    /// or the GPU's address (passthrough).
    pub device: String,
    /// The owner (on disk: `instance_id`, or `owner` for an external one).
    pub owner: Owner,
    /// The owner's name at claim time (names never change), for views and reports.
    pub owner_name: Option<String>,
    /// The owner's labels at claim time (labels never change): what placement plugins see
    /// about the owner, without reading its instance record (O(1) store work per claim).
    /// `None` only in claims written before this field existed.
    pub owner_labels: Option<Labels>,
    /// The parent GPU's (PF's) address.
    pub gpu: String,
    /// The vGPU profile claimed (canonical name, e.g. `L40S-2Q`), or `passthrough`.
    pub profile: String,
    /// What the claim holds, by device kind.
    pub kind: ClaimKind,
    /// Wall time, RFC 3339.
    pub claimed_at: String,
    /// The host's boot id at claim (`/proc/sys/kernel/random/boot_id`): tells a claim of
    /// this boot from one of an earlier boot.
    pub claim_boot_id: String,
    /// CLOCK_BOOTTIME at claim, ms.
    pub claimed_boottime_ms: u64,
    /// The driver version at claim time (diagnostics).
    pub driver_version: Option<String>,
    /// Where the claim is in its life: claimed, configured, or release pending.
    pub state: ClaimState,
    /// Release attempts that failed so far (0 for a claim never released).
    pub release_attempts: u32,
    /// The last error met configuring or releasing the device, if any.
    pub last_error: Option<String>,
}

/// The per-kind part of a claim: what each device kind records about the device it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimKind {
    /// A vendor-VFIO VF. `type_id`: the type id looked up in the fresh catalog at
    /// configure time (diagnostics only; never written again without a new lookup).
    Vf {
        /// The type id found at configure time; `None` before configure.
        type_id: Option<u32>,
    },
    /// An mdev created on the VF (or GPU) `device`: its UUID and type directory name (e.g.
    /// `nvidia-1148`); `type_id` as for a VF.
    Mdev {
        /// The mdev's UUID (chosen at claim, recorded before the mdev is created).
        uuid: Uuid,
        /// The type directory name, e.g. `nvidia-1148`.
        mdev_type: String,
        /// The type id found at configure time; `None` before configure.
        type_id: Option<u32>,
    },
    /// A whole GPU and its IOMMU group: the group and each function's original driver,
    /// recorded before any driver changes (docs/design/host.md §7 Bind step 3).
    Passthrough(PassthroughClaim),
}

impl ClaimKind {
    /// The same kind for a new claim: an mdev gets a new UUID (each claim creates its own).
    pub fn renewed(&self) -> ClaimKind {
        match self {
            ClaimKind::Mdev { mdev_type, type_id, .. } => {
                ClaimKind::Mdev { uuid: Uuid::new_v4(), mdev_type: mdev_type.clone(), type_id: *type_id }
            }
            k => k.clone(),
        }
    }

    /// The framework (the kind's name in records and on the wire).
    pub fn framework(&self) -> Framework {
        match self {
            ClaimKind::Vf { .. } => Framework::VendorVfio,
            ClaimKind::Mdev { .. } => Framework::Mdev,
            ClaimKind::Passthrough(_) => Framework::Passthrough,
        }
    }

    /// The type id recorded at configure time (a VF or mdev; never for passthrough).
    pub fn type_id(&self) -> Option<u32> {
        match self {
            ClaimKind::Vf { type_id } | ClaimKind::Mdev { type_id, .. } => *type_id,
            ClaimKind::Passthrough(_) => None,
        }
    }

    /// The mdev's UUID (an mdev claim).
    pub fn mdev_uuid(&self) -> Option<Uuid> {
        match self {
            ClaimKind::Mdev { uuid, .. } => Some(*uuid),
            _ => None,
        }
    }

    /// The passthrough record (a passthrough claim).
    pub fn passthrough(&self) -> Option<&PassthroughClaim> {
        match self {
            ClaimKind::Passthrough(p) => Some(p),
            _ => None,
        }
    }
}

/// A claim record as it is on disk: the flat shape every version wrote, field for field
/// and in the same order (`agent/tests/fixtures/claims/*.json` are records written before
/// [`ClaimKind`] existed; a unit test reads and re-writes them byte for byte).
#[derive(Serialize, Deserialize)]
struct ClaimWire {
    device: String,
    framework: Framework,
    #[serde(flatten, with = "claim_owner")]
    owner: Owner,
    #[serde(default)]
    owner_name: Option<String>,
    #[serde(default)]
    owner_labels: Option<Labels>,
    gpu: String,
    profile: String,
    type_id: Option<u32>,
    mdev_uuid: Option<Uuid>,
    mdev_type: Option<String>,
    claimed_at: String,
    claim_boot_id: String,
    claimed_boottime_ms: u64,
    driver_version: Option<String>,
    state: ClaimState,
    #[serde(default)]
    release_attempts: u32,
    last_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    passthrough: Option<PassthroughClaim>,
}

impl TryFrom<ClaimWire> for Claim {
    type Error = String;

    fn try_from(w: ClaimWire) -> std::result::Result<Claim, String> {
        let kind = match (w.framework, w.mdev_uuid, w.mdev_type, w.passthrough) {
            (Framework::VendorVfio, None, None, None) => ClaimKind::Vf { type_id: w.type_id },
            (Framework::Mdev, Some(uuid), Some(mdev_type), None) => {
                ClaimKind::Mdev { uuid, mdev_type, type_id: w.type_id }
            }
            (Framework::Passthrough, None, None, Some(p)) if w.type_id.is_none() => ClaimKind::Passthrough(p),
            (f, ..) => {
                return Err(format!(
                    "the claim's per-kind fields (type_id, mdev_uuid, mdev_type, passthrough) do not match its framework {}",
                    f.as_str()
                ))
            }
        };
        Ok(Claim {
            device: w.device,
            owner: w.owner,
            owner_name: w.owner_name,
            owner_labels: w.owner_labels,
            gpu: w.gpu,
            profile: w.profile,
            kind,
            claimed_at: w.claimed_at,
            claim_boot_id: w.claim_boot_id,
            claimed_boottime_ms: w.claimed_boottime_ms,
            driver_version: w.driver_version,
            state: w.state,
            release_attempts: w.release_attempts,
            last_error: w.last_error,
        })
    }
}

impl From<Claim> for ClaimWire {
    fn from(c: Claim) -> ClaimWire {
        let framework = c.kind.framework();
        let type_id = c.kind.type_id();
        let (mdev_uuid, mdev_type, passthrough) = match c.kind {
            ClaimKind::Vf { .. } => (None, None, None),
            ClaimKind::Mdev { uuid, mdev_type, .. } => (Some(uuid), Some(mdev_type), None),
            ClaimKind::Passthrough(p) => (None, None, Some(p)),
        };
        ClaimWire {
            device: c.device,
            framework,
            owner: c.owner,
            owner_name: c.owner_name,
            owner_labels: c.owner_labels,
            gpu: c.gpu,
            profile: c.profile,
            type_id,
            mdev_uuid,
            mdev_type,
            claimed_at: c.claimed_at,
            claim_boot_id: c.claim_boot_id,
            claimed_boottime_ms: c.claimed_boottime_ms,
            driver_version: c.driver_version,
            state: c.state,
            release_attempts: c.release_attempts,
            last_error: c.last_error,
            passthrough,
        }
    }
}

/// The passthrough part of a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassthroughClaim {
    /// The IOMMU group (`dev/vfio/<group>`).
    pub group: u32,
    /// Every endpoint function of the group, the GPU first.
    pub functions: Vec<FunctionRecord>,
    /// The release path reset the GPU already (a retried give-back does not reset again).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reset_done: bool,
}

/// One function of a passthrough claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionRecord {
    /// The function's PCI address (BDF).
    pub bdf: String,
    /// The driver it was bound to before gpuvisor touched it (`None`: unbound).
    pub original_driver: Option<String>,
}

impl Claim {
    /// Who owns it, for messages: `instance <name or id>`, or the external owner.
    pub fn owner_label(&self) -> String {
        match &self.owner {
            Owner::Instance(id) => format!("instance {}", self.owner_name.clone().unwrap_or_else(|| id.to_string())),
            Owner::External(_) => self.owner.to_string(),
        }
    }

    /// True when instance `id` owns it.
    pub fn owned_by(&self, id: Uuid) -> bool {
        self.owner == Owner::Instance(id)
    }

    /// True when `other` is this very claim (same device, owner, boot, claim time and
    /// mdev): a claim re-read that differs belongs to someone else.
    pub fn same_claim(&self, other: &Claim) -> bool {
        self.device == other.device
            && self.owner == other.owner
            && self.claim_boot_id == other.claim_boot_id
            && self.claimed_boottime_ms == other.claimed_boottime_ms
            && self.kind.mdev_uuid() == other.kind.mdev_uuid()
    }
}
