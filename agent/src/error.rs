//! # error — the lifecycle's error type and its stable codes
//!
//! Every failed operation ends as an [`ApiError`]: a stable string [`ErrorCode`] (what
//! clients match on), one clear sentence, and structured details. The numeric class
//! (400/404/409/500/503) follows docs/design/lifecycle.md "Errors"; the rpc layer is the one place
//! that turns it into a JSON-RPC error object.
//!
//! **One constructor per code.** An `ApiError` is only built by the constructor of its
//! code ([`ApiError::no_capacity`], [`ApiError::vgpu_cleanup_pending`], ...), which fixes
//! the detail fields of that code, so the same error has the same shape everywhere.

use serde_json::{json, Map, Value};

/// The stable `data.code` strings of docs/design/lifecycle.md "Errors".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// `invalid_request` (400): a parameter value is invalid.
    InvalidRequest,
    /// `unknown_profile` (400): no GPU on this host has ever listed the vGPU profile.
    UnknownProfile,
    /// `hypervisor_unsupported` (400): the hypervisor named cannot carry the request's GPU.
    HypervisorUnsupported,
    /// `not_found` (404): no instance, image or health mark by that name or id.
    NotFound,
    /// `name_taken` (409): an instance (or image) with that name exists.
    NameTaken,
    /// `invalid_state` (409): the operation does not apply to the instance's state.
    InvalidState,
    /// `no_capacity` (409): no device can take the profile now; nothing was left claimed.
    NoCapacity,
    /// `instance_cleanup_pending` (409): the instance awaits the release of its GPU device;
    /// only delete is allowed.
    InstanceCleanupPending,
    /// `unsupported_with_gpu` (409): standby or snapshot of a running instance with a GPU.
    UnsupportedWithGpu,
    /// `gpu_release_pending` (409): a claim left by an earlier failed release still cannot
    /// be released.
    GpuReleasePending,
    /// `device_unhealthy` (409): the passthrough GPU the request names is quarantined.
    DeviceUnhealthy,
    /// `iommu_group_conflict` (409): the named passthrough GPU's IOMMU group holds a
    /// foreign device.
    IommuGroupConflict,
    /// `gpu_busy` (409): a host process holds the passthrough GPU through the host driver.
    GpuBusy,
    /// `vgpu_cleanup_pending` (500): the operation failed and its GPU device could not be
    /// released.
    VgpuCleanupPending,
    /// `vmm_start_failed` (500): the VMM did not start; the claim was rolled back.
    VmmStartFailed,
    /// `vmm_kill_failed` (500): the VMM outlived SIGTERM and SIGKILL; nothing was torn
    /// down.
    VmmKillFailed,
    /// `passthrough_bind_failed` (500): moving the passthrough GPU's group to `vfio-pci`
    /// failed.
    PassthroughBindFailed,
    /// `policy_failed` (500): a policy plugin call failed (the operation failed closed).
    PolicyFailed,
    /// `internal` (500): an unexpected failure, or a record that cannot be decoded.
    Internal,
    /// `not_ready` (503): the host cannot be used for vGPUs now (e.g. before the startup
    /// reconcile pass).
    NotReady,
    /// `vmm_liveness_unknown` (503): whether the instance's VMM is alive cannot be proved.
    VmmLivenessUnknown,
    /// `image_in_use` (409): instance records still name the image.
    ImageInUse,
    /// `device_taken` (409): the device's claim belongs to another owner.
    DeviceTaken,
    /// `in_use` (409): the device is held open by a process, or its holders cannot be
    /// verified.
    InUse,
}

impl ErrorCode {
    /// Every code, in the order of docs/design/lifecycle.md's table.
    pub const ALL: [ErrorCode; 24] = {
        use ErrorCode::*;
        [
            InvalidRequest,
            UnknownProfile,
            HypervisorUnsupported,
            NotFound,
            NameTaken,
            InvalidState,
            NoCapacity,
            InstanceCleanupPending,
            UnsupportedWithGpu,
            GpuReleasePending,
            DeviceUnhealthy,
            IommuGroupConflict,
            GpuBusy,
            VgpuCleanupPending,
            VmmStartFailed,
            VmmKillFailed,
            PassthroughBindFailed,
            PolicyFailed,
            Internal,
            NotReady,
            VmmLivenessUnknown,
            ImageInUse,
            DeviceTaken,
            InUse,
        ]
    };

    /// The stable string, e.g. `no_capacity`.
    pub fn as_str(self) -> &'static str {
        use ErrorCode::*;
        match self {
            InvalidRequest => "invalid_request",
            UnknownProfile => "unknown_profile",
            HypervisorUnsupported => "hypervisor_unsupported",
            NotFound => "not_found",
            NameTaken => "name_taken",
            InvalidState => "invalid_state",
            NoCapacity => "no_capacity",
            InstanceCleanupPending => "instance_cleanup_pending",
            UnsupportedWithGpu => "unsupported_with_gpu",
            GpuReleasePending => "gpu_release_pending",
            DeviceUnhealthy => "device_unhealthy",
            IommuGroupConflict => "iommu_group_conflict",
            GpuBusy => "gpu_busy",
            VgpuCleanupPending => "vgpu_cleanup_pending",
            VmmStartFailed => "vmm_start_failed",
            VmmKillFailed => "vmm_kill_failed",
            PassthroughBindFailed => "passthrough_bind_failed",
            PolicyFailed => "policy_failed",
            Internal => "internal",
            NotReady => "not_ready",
            VmmLivenessUnknown => "vmm_liveness_unknown",
            ImageInUse => "image_in_use",
            DeviceTaken => "device_taken",
            InUse => "in_use",
        }
    }

    /// The code for a stable string.
    pub fn from_name(s: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The numeric class used as the JSON-RPC error `code`.
    pub fn class(self) -> i32 {
        use ErrorCode::*;
        match self {
            InvalidRequest | UnknownProfile | HypervisorUnsupported => 400,
            NotFound => 404,
            NameTaken
            | InvalidState
            | NoCapacity
            | InstanceCleanupPending
            | UnsupportedWithGpu
            | GpuReleasePending
            | DeviceUnhealthy
            | IommuGroupConflict
            | GpuBusy
            | ImageInUse
            | DeviceTaken
            | InUse => 409,
            VgpuCleanupPending | VmmStartFailed | VmmKillFailed | PassthroughBindFailed | PolicyFailed | Internal => {
                500
            }
            NotReady | VmmLivenessUnknown => 503,
        }
    }
}

/// A failed operation: code, one-sentence message, details (`data` minus `code`).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The stable code clients match on (`data.code`).
    pub code: ErrorCode,
    /// One sentence saying what failed and why.
    pub message: String,
    details: Map<String, Value>,
}

/// Why a device could not be released, for `vgpu_cleanup_pending` and
/// `gpu_release_pending` (`release_error: {code, message}`).
#[derive(Debug, Clone, PartialEq)]
pub struct ReleaseFailure {
    /// `in_use`, `scan_incomplete`, `failed`, `foreign_write`, `store`, `not_ready`,
    /// `vmm_kill_failed`, `vmm_liveness_unknown`.
    pub code: String,
    /// What the release failed on, one sentence.
    pub message: String,
}

/// What a `vgpu_cleanup_pending` answer says (docs/design/lifecycle.md Create step 6, Delete step 4).
#[derive(Debug, Clone, PartialEq)]
pub struct CleanupPending {
    /// The instance whose device is still held.
    pub instance_id: uuid::Uuid,
    /// The device's sysfs path, when a claim is known.
    pub device_path: Option<String>,
    /// The instance was turned into a delete-only `cleanup_pending` record.
    pub retained: bool,
    /// The error that started the rollback (`None` for a delete, whose cause is the release).
    pub cause: Option<ApiError>,
    /// Why the device was not released.
    pub release: ReleaseFailure,
}

impl ApiError {
    fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), details: Map::new() }
    }

    fn with(mut self, key: &str, value: impl Into<Value>) -> ApiError {
        self.details.insert(key.to_string(), value.into());
        self
    }

    /// `invalid_request`: the request (or a stored definition it relies on) is not valid.
    pub fn invalid_request(msg: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidRequest, msg)
    }

    /// `unknown_profile`: no GPU on this host has ever offered the profile.
    pub fn unknown_profile(profile: &str) -> ApiError {
        ApiError::new(ErrorCode::UnknownProfile, format!("profile {profile} is not offered by any GPU on this host"))
            .with("profile", profile)
    }

    /// `hypervisor_unsupported`, with the hypervisor concerned and the policy's reason.
    pub fn hypervisor_unsupported(
        msg: impl Into<String>,
        hypervisor: Option<&str>,
        policy_reason: Option<&str>,
    ) -> ApiError {
        let mut e = ApiError::new(ErrorCode::HypervisorUnsupported, msg);
        if let Some(h) = hypervisor {
            e = e.with("hypervisor", h);
        }
        if let Some(r) = policy_reason {
            e = e.with("policy_reason", r);
        }
        e
    }

    /// `not_found` for `what` (an instance reference, an image, a health mark).
    pub fn not_found(what: &str) -> ApiError {
        ApiError::new(ErrorCode::NotFound, format!("{what} was not found")).with("ref", what)
    }

    /// `name_taken`.
    pub fn name_taken(what: &str, name: &str) -> ApiError {
        ApiError::new(ErrorCode::NameTaken, format!("{what} named {name} exists")).with("name", name)
    }

    /// `invalid_state`: the instance is not in a state the operation accepts.
    pub fn invalid_state(msg: impl Into<String>, state: &str) -> ApiError {
        ApiError::new(ErrorCode::InvalidState, msg).with("state", state)
    }

    /// `no_capacity`: no legal candidate could take the profile now; `notes` say why for
    /// each device tried or skipped (bounded), `policy_reason` is the plugin's reject.
    pub fn no_capacity(
        msg: impl Into<String>,
        profile: &str,
        notes: Vec<String>,
        policy_reason: Option<&str>,
    ) -> ApiError {
        let mut e = ApiError::new(ErrorCode::NoCapacity, msg).with("profile", profile).with("notes", notes);
        if let Some(r) = policy_reason {
            e = e.with("policy_reason", r);
        }
        e
    }

    /// `device_unhealthy`: the device the request needs is quarantined (`reason`, `detail`).
    pub fn device_unhealthy(device: &str, reason: &str, detail: &str) -> ApiError {
        ApiError::new(
            ErrorCode::DeviceUnhealthy,
            format!("{device} is quarantined ({reason}: {detail}); see gpuvisor gpus, and gpuvisor gpus unquarantine once repaired"),
        )
        .with("device", device)
        .with("reason", reason)
    }

    /// `iommu_group_conflict`: the passthrough GPU's IOMMU group holds `members`, which are
    /// not functions of the GPU (and not bridges): the group cannot be moved whole.
    pub fn iommu_group_conflict(gpu: &str, group: u32, members: &[String]) -> ApiError {
        ApiError::new(
            ErrorCode::IommuGroupConflict,
            format!(
                "the IOMMU group {group} of {gpu} also holds {}, which is not a function of this GPU; nothing was changed",
                members.join(", ")
            ),
        )
        .with("device", gpu)
        .with("group", group)
        .with("members", members.to_vec())
    }

    /// `gpu_busy`: host processes hold the passthrough GPU through the host driver.
    pub fn gpu_busy(gpu: &str, node: &str, holders: &[String], services_stopped: bool) -> ApiError {
        let advice = if services_stopped {
            "they still held it after passthrough_stop_services ran (and the services were started again)"
        } else {
            "stop it, or configure passthrough_stop_services"
        };
        ApiError::new(
            ErrorCode::GpuBusy,
            format!(
                "{gpu} is held through {node} by {} (e.g. nvidia-persistenced or DCGM); {advice}; nothing was changed",
                holders.join(", ")
            ),
        )
        .with("device", gpu)
        .with("holders", holders.to_vec())
    }

    /// `passthrough_bind_failed`: moving the group to `vfio-pci` failed (`binding`: what
    /// the functions are bound to now, after the undo).
    pub fn passthrough_bind_failed(gpu: &str, error: &str, binding: &str) -> ApiError {
        ApiError::new(
            ErrorCode::PassthroughBindFailed,
            if binding.is_empty() {
                format!("{gpu} could not be bound to vfio-pci: {error}")
            } else {
                format!("{gpu} could not be bound to vfio-pci: {error}; every function was given back ({binding})")
            },
        )
        .with("device", gpu)
        .with("error", error)
        .with("binding", binding)
    }

    /// `instance_cleanup_pending`: only `instance.delete` is allowed.
    pub fn instance_cleanup_pending(id: uuid::Uuid, name: &str) -> ApiError {
        ApiError::new(
            ErrorCode::InstanceCleanupPending,
            format!("instance {name} awaits the release of its GPU device; only delete is allowed"),
        )
        .with("instance_id", id.to_string())
    }

    /// `unsupported_with_gpu`: device state cannot be saved.
    pub fn unsupported_with_gpu(op: &str, name: &str) -> ApiError {
        ApiError::new(
            ErrorCode::UnsupportedWithGpu,
            format!("{op} of {name} is refused while its GPU device is attached: device state cannot be saved"),
        )
    }

    /// `image_in_use`: `image.delete` of an image that instance records still name
    /// (`instances`: their names, sorted). Delete those instances first.
    pub fn image_in_use(image: &str, instances: &[String]) -> ApiError {
        ApiError::new(
            ErrorCode::ImageInUse,
            format!("image {image} is used by instance(s) {}; delete them first", instances.join(", ")),
        )
        .with("image", image)
        .with("instances", instances.to_vec())
    }

    /// `device_taken`: `claim.prepare` or `claim.release` of a device another owner holds
    /// the claim of (`data.device`, `data.owner`: that owner).
    pub fn device_taken(device: &str, owner: &crate::domain::Owner) -> ApiError {
        ApiError::new(ErrorCode::DeviceTaken, format!("{device} is claimed by {owner}, not by the caller"))
            .with("device", device)
            .with("owner", serde_json::to_value(owner).unwrap_or(Value::Null))
    }

    /// `in_use`: the device cannot be released (or prepared) while a process holds it open,
    /// or while its holders cannot be verified (`data.device`, `data.pids`,
    /// `data.release_error: {code, message}`); nothing was written to the device.
    pub fn in_use(device: &str, pids: &[i32], release: &ReleaseFailure) -> ApiError {
        let held = if pids.is_empty() { release.message.clone() } else { format!("held open by pid {pids:?}") };
        ApiError::new(
            ErrorCode::InUse,
            format!(
                "{device} cannot be released while it may be in use ({held}); the claim stays, nothing was written"
            ),
        )
        .with("device", device)
        .with("pids", pids.to_vec())
        .with("release_error", json!({"code": release.code, "message": release.message}))
    }

    /// `gpu_release_pending`: start waits on an earlier release that still fails.
    pub fn gpu_release_pending(name: &str, device: &str, release: &ReleaseFailure) -> ApiError {
        ApiError::new(
            ErrorCode::GpuReleasePending,
            format!("the earlier GPU device of {name} ({device}) still cannot be released: {}", release.message),
        )
        .with("device", device)
        .with("release_error", json!({"code": release.code, "message": release.message}))
    }

    /// `vgpu_cleanup_pending` (decided before any other mapping: it wraps the cause).
    /// Details: `instance_id`, `device_path`, `retained`, `guidance`, and `cause` — the
    /// original error's data (for a delete: `{code: "release_failed"}`) with
    /// `release_error: {code, message}` saying why the device was not released.
    pub fn vgpu_cleanup_pending(c: CleanupPending) -> ApiError {
        let guidance = if c.retained {
            format!("delete instance {} to retry the release", c.instance_id)
        } else {
            "the device will be released automatically once it is proven free; do not delete".to_string()
        };
        let release = json!({"code": c.release.code, "message": c.release.message});
        let (message, mut cause) = match &c.cause {
            Some(cause) => (
                format!(
                    "{} and its GPU device could not be released ({}); {guidance}",
                    cause.message, c.release.message
                ),
                cause.data(),
            ),
            None => (
                format!("the GPU device could not be released ({}); {guidance}", c.release.message),
                json!({"code": "release_failed", "detail": c.release.message}),
            ),
        };
        cause["release_error"] = release;
        ApiError::new(ErrorCode::VgpuCleanupPending, message)
            .with("instance_id", c.instance_id.to_string())
            .with("device_path", c.device_path)
            .with("retained", c.retained)
            .with("cause", cause)
            .with("guidance", guidance)
    }

    /// `vmm_start_failed`.
    ///
    /// With the VMM API request that was refused or not answered (Cloud Hypervisor), its
    /// answer verbatim in `vmm_api: {request, status, errors}`.
    pub fn vmm_start_failed(msg: impl Into<String>, api: Option<&crate::hypervisor::ApiFailure>) -> ApiError {
        let e = ApiError::new(ErrorCode::VmmStartFailed, msg);
        match api.map(serde_json::to_value) {
            Some(Ok(v)) => e.with("vmm_api", v),
            _ => e,
        }
    }

    /// `vmm_kill_failed`: the VMM outlived SIGKILL; nothing was torn down.
    pub fn vmm_kill_failed(pid: i32) -> ApiError {
        ApiError::new(ErrorCode::VmmKillFailed, format!("the VMM (pid {pid}) outlived SIGKILL; nothing was torn down"))
            .with("pid", pid)
    }

    /// `policy_failed`: a placement or hypervisor plugin call failed (nothing allocated).
    pub fn policy_failed(plugin: &str, kind: &str, reason: &str, msg: impl std::fmt::Display) -> ApiError {
        ApiError::new(ErrorCode::PolicyFailed, format!("the {kind} plugin failed: {msg}"))
            .with("plugin", plugin)
            .with("reason", reason)
    }

    /// `internal` with the given cause.
    pub fn internal(msg: impl std::fmt::Display) -> ApiError {
        ApiError::new(ErrorCode::Internal, msg.to_string())
    }

    /// `internal` for a record that exists but cannot be read.
    pub fn unreadable_record(path: &std::path::Path, error: &str) -> ApiError {
        ApiError::new(ErrorCode::Internal, format!("the record {} cannot be read: {error}", path.display()))
            .with("path", path.display().to_string())
            .with("error", error)
    }

    /// `not_ready`: retry later (the startup pass, a probe error, unreadable state).
    pub fn not_ready(msg: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::NotReady, msg)
    }

    /// `vmm_liveness_unknown`: whether the VMM lives cannot be decided; nothing changed.
    pub fn vmm_liveness_unknown(name: &str, reason: &str) -> ApiError {
        ApiError::new(
            ErrorCode::VmmLivenessUnknown,
            format!("cannot tell whether the VMM of {name} is alive: {reason}"),
        )
        .with("reason", reason)
    }

    /// The details (`data` minus `code`).
    pub fn details(&self) -> &Map<String, Value> {
        &self.details
    }

    /// The `data` object: `{"code": ..., ...details}`.
    pub fn data(&self) -> Value {
        let mut m = self.details.clone();
        m.insert("code".into(), Value::String(self.code.as_str().into()));
        Value::Object(m)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code.as_str())
    }
}

impl std::error::Error for ApiError {}

impl From<crate::network::Invalid> for ApiError {
    fn from(e: crate::network::Invalid) -> ApiError {
        ApiError::invalid_request(e.0)
    }
}

impl From<crate::domain::IllegalTransition> for ApiError {
    fn from(e: crate::domain::IllegalTransition) -> ApiError {
        ApiError::internal(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_and_has_the_documented_class() {
        for c in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_name(c.as_str()), Some(c));
        }
        assert_eq!(ErrorCode::NoCapacity.class(), 409);
        assert_eq!(ErrorCode::VgpuCleanupPending.class(), 500);
        assert_eq!(ErrorCode::NotReady.class(), 503);
        assert_eq!(ErrorCode::UnknownProfile.class(), 400);
        assert_eq!(ErrorCode::NotFound.class(), 404);
    }

    #[test]
    fn cleanup_pending_wraps_the_cause_and_says_why_the_release_failed() {
        let e = ApiError::vgpu_cleanup_pending(CleanupPending {
            instance_id: uuid::Uuid::nil(),
            device_path: Some("/sys/bus/pci/devices/0000:41:00.4".into()),
            retained: true,
            cause: Some(ApiError::vmm_start_failed("the VMM did not start", None)),
            release: ReleaseFailure { code: "vmm_kill_failed".into(), message: "pid 7 outlived SIGKILL".into() },
        });
        let d = e.data();
        assert_eq!(d["code"], "vgpu_cleanup_pending");
        assert_eq!(d["retained"], true);
        assert_eq!(d["cause"]["code"], "vmm_start_failed");
        assert_eq!(d["cause"]["release_error"]["code"], "vmm_kill_failed");
        assert!(d["guidance"].as_str().unwrap().contains("delete instance"));
    }
}
