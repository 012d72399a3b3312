//! # error — the lifecycle's error type and its stable codes
//!
//! Every failed operation ends as an [`ApiError`]: a stable string [`ErrorCode`] (what
//! clients match on), one clear sentence, and structured details. The numeric class
//! (400/404/409/500/503) follows LIFECYCLE.md "Errors"; the rpc layer is the one place
//! that turns it into a JSON-RPC error object.

use serde_json::{Map, Value};

/// The stable `data.code` strings of LIFECYCLE.md "Errors".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
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
    VgpuCleanupPending,
    VmmStartFailed,
    VmmKillFailed,
    PolicyFailed,
    Internal,
    NotReady,
    VmmLivenessUnknown,
}

impl ErrorCode {
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
            VgpuCleanupPending => "vgpu_cleanup_pending",
            VmmStartFailed => "vmm_start_failed",
            VmmKillFailed => "vmm_kill_failed",
            PolicyFailed => "policy_failed",
            Internal => "internal",
            NotReady => "not_ready",
            VmmLivenessUnknown => "vmm_liveness_unknown",
        }
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
            | DeviceUnhealthy => 409,
            VgpuCleanupPending | VmmStartFailed | VmmKillFailed | PolicyFailed | Internal => 500,
            NotReady | VmmLivenessUnknown => 503,
        }
    }
}

/// A failed operation: code, one-sentence message, details (`data` minus `code`).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub details: Map<String, Value>,
}

impl ApiError {
    /// An error with no details.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), details: Map::new() }
    }

    /// Adds one detail field.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> ApiError {
        self.details.insert(key.to_string(), value.into());
        self
    }

    /// `internal` with the given cause.
    pub fn internal(msg: impl std::fmt::Display) -> ApiError {
        ApiError::new(ErrorCode::Internal, msg.to_string())
    }

    /// `invalid_request`.
    pub fn invalid(msg: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidRequest, msg)
    }

    /// `not_found` for an instance reference.
    pub fn not_found(what: &str) -> ApiError {
        ApiError::new(ErrorCode::NotFound, format!("{what} was not found")).with("ref", what)
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

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> ApiError {
        ApiError::internal(format!("store: {e}"))
    }
}
