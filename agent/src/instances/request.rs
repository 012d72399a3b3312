//! The API's request types — the parameters of every JSON-RPC method that takes some — and
//! their validation. The rpc layer decodes them, the CLI builds them, and the OpenRPC
//! document's parameter schemas are generated from them (`schemars`), with every limit the
//! agent enforces stated from the constants below, so a client validating against
//! `rpc.discover` and the agent agree.

use crate::error::ApiError;
use crate::store::Labels;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use uuid::Uuid;

/// Instance names: the pattern, as JSON Schema states it.
pub const NAME_PATTERN: &str = "^[a-z0-9][a-z0-9-]{0,62}$";
/// At most this many labels per instance: every policy input carries them, and plugins run
/// under a fuel budget (docs/plugins.md), so an unbounded map would surface as `policy_failed`.
pub const MAX_LABELS: usize = 64;
/// Label keys: 1–63 bytes of `[A-Za-z0-9._/-]`, starting with a letter or digit.
pub const LABEL_KEY_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$";
/// Label values: 0–255 bytes of printable ASCII (so bytes and characters agree).
pub const LABEL_VALUE_PATTERN: &str = "^[ -~]{0,255}$";
/// The longest label key, bytes.
pub const LABEL_KEY_MAX: usize = 63;
/// The longest label value, bytes.
pub const LABEL_VALUE_MAX: usize = 255;
/// vCPUs of an instance.
pub const VCPUS_MIN: u32 = 1;
/// The most vCPUs an instance may have.
pub const VCPUS_MAX: u32 = 64;
/// Guest memory, MiB.
pub const MEMORY_MIB_MIN: u64 = 64;
/// The most guest memory an instance may have, MiB (1 TiB).
pub const MEMORY_MIB_MAX: u64 = 1_048_576;
/// Defaults when a create omits them.
pub const DEFAULT_VCPUS: u32 = 1;
/// Guest memory when a create omits it, MiB.
pub const DEFAULT_MEMORY_MIB: u64 = 256;

fn labels_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "description": format!(
            "free-form key/values that policy plugins see (e.g. a tenant): at most {MAX_LABELS}; keys 1-{LABEL_KEY_MAX} \
             bytes of [A-Za-z0-9._/-], values 0-{LABEL_VALUE_MAX} bytes of printable ASCII"
        ),
        "maxProperties": MAX_LABELS,
        "propertyNames": { "pattern": LABEL_KEY_PATTERN },
        "additionalProperties": { "type": "string", "pattern": LABEL_VALUE_PATTERN },
    })
}

fn name_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "description": "instance name: lower-case letters, digits and '-', 1-63 bytes, not UUID-shaped",
        "pattern": NAME_PATTERN,
    })
}

/// `instance.create` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    /// Unique instance name.
    #[schemars(schema_with = "name_schema")]
    pub name: String,
    /// An image under `<data-dir>/images/`.
    pub image: String,
    /// The GPU: a vGPU profile, e.g. `"L40S-2Q"` (with or without the `NVIDIA ` prefix), or
    /// `{"profile": "L40S-2Q"}`, or a whole GPU: `{"passthrough": true}` (any free
    /// passthrough GPU) or `{"passthrough": true, "address": "0000:82:00.0"}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuRequest>,
    /// Labels (`key: value`) the policy plugins see; at most 64.
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    #[schemars(schema_with = "labels_schema")]
    pub labels: Labels,
    /// vCPUs, default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = VCPUS_MIN, max = VCPUS_MAX))]
    pub vcpus: Option<u32>,
    /// Guest memory in MiB, default 256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MEMORY_MIB_MIN, max = MEMORY_MIB_MAX))]
    pub memory_mib: Option<u64>,
    /// `qemu` or `cloud-hypervisor`; the `hypervisor` plugin decides when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "hypervisor_schema")]
    pub hypervisor: Option<String>,
    /// When the VMM dies without a stop: `no` (default), `on-failure`, `always`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<crate::store::RestartPolicy>,
    /// Start it again when the agent starts after a host reboot (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autostart: Option<bool>,
    /// virtio-net NICs, in guest order (at most 8): `{"mode": "user", "forwards": [...]}`
    /// or `{"mode": "bridge", "bridge": "br0"}` (docs/api.md "NICs").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = crate::network::MAX_NICS))]
    pub nics: Vec<crate::network::Nic>,
    /// cloud-init NoCloud inputs: `user_data`, `network_config` (each at most 64 KiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<crate::network::CloudInit>,
    /// How the VM boots: `direct` (the image's kernel; the default when it has one), `bios`
    /// (SeaBIOS from the disk; the default for a disk-only image) or `uefi` (OVMF from the
    /// disk: what GPU guests with large BARs need).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<crate::store::BootMode>,
    /// Size of the instance's disk overlay, GiB (images with a disk only): at least the
    /// image disk's virtual size; default that size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = DISK_GIB_MAX))]
    pub disk_gib: Option<u64>,
    /// `false`: define the instance only — checked and recorded `stopped`, nothing claimed,
    /// nothing started (`instance.start` boots it). Default `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<bool>,
}

/// The largest `disk_gib`: 64 TiB.
pub const DISK_GIB_MAX: u64 = 65_536;

/// The `gpu` of a create request.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum GpuRequest {
    /// A vGPU profile name.
    Profile(String),
    /// A vGPU profile or a whole GPU.
    Spec(GpuSpec),
}

impl<'de> Deserialize<'de> for GpuRequest {
    /// A string is a profile, an object a [`GpuSpec`] (its own errors name the field).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<GpuRequest, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(s) => Ok(GpuRequest::Profile(s)),
            v @ serde_json::Value::Object(_) => {
                serde_json::from_value(v).map(GpuRequest::Spec).map_err(|e| D::Error::custom(format!("gpu: {e}")))
            }
            _ => Err(D::Error::custom("gpu must be a profile name or an object ({\"passthrough\": true, ...})")),
        }
    }
}

/// `{"profile": ...}` or `{"passthrough": true, "address"?: ...}`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// vGPU profile, e.g. `L40S-2Q`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// A whole GPU (one of the agent's `passthrough_gpus`), bound to `vfio-pci`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub passthrough: bool,
    /// With `passthrough`: this GPU (its PCI address), not any free one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The device already prepared (`claim.prepare`) for this Kubernetes ResourceClaim,
    /// `<namespace>/<name>`: the VM uses it, and the claim stays the ResourceClaim's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_claim: Option<String>,
}

/// What a validated `gpu` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuWant {
    /// A vGPU of this profile (as given; the catalog's spelling is looked up later).
    Profile(String),
    /// A whole GPU: any, or the one at `address` (lower case).
    Passthrough {
        /// The GPU's PCI address (lower case); `None`: any free passthrough GPU.
        address: Option<String>,
    },
    /// The device prepared for a Kubernetes ResourceClaim.
    ResourceClaim(crate::store::ResourceClaimRef),
}

impl GpuRequest {
    /// `gpu` from the CLI's `--gpu`: `passthrough`, `passthrough=<BDF>`, or a profile.
    pub fn from_flag(s: &str) -> GpuRequest {
        let lower = s.to_ascii_lowercase();
        match lower.strip_prefix("passthrough").map(|r| &s[s.len() - r.len()..]) {
            Some("") => GpuRequest::Spec(GpuSpec { passthrough: true, ..Default::default() }),
            Some(rest) if rest.starts_with('=') => GpuRequest::Spec(GpuSpec {
                passthrough: true,
                address: Some(rest[1..].to_string()),
                ..Default::default()
            }),
            _ => GpuRequest::Profile(s.to_string()),
        }
    }

    /// Checks the shape; errors are `invalid_request`.
    pub fn want(&self) -> Result<GpuWant, ApiError> {
        let profile = |p: &str| {
            if gpuvisor_sdk::canonical_profile(p).is_empty() {
                Err(ApiError::invalid_request("gpu profile is empty"))
            } else {
                Ok(GpuWant::Profile(p.to_string()))
            }
        };
        if let GpuRequest::Spec(GpuSpec { resource_claim: Some(rc), profile, passthrough, address }) = self {
            if profile.is_some() || *passthrough || address.is_some() {
                return Err(ApiError::invalid_request(
                    "resource_claim names a device already prepared: no profile, passthrough or address with it",
                ));
            }
            return match rc.split_once('/') {
                Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                    Ok(GpuWant::ResourceClaim(crate::store::ResourceClaimRef {
                        namespace: ns.to_string(),
                        name: name.to_string(),
                    }))
                }
                _ => Err(ApiError::invalid_request(format!("resource_claim must be <namespace>/<name>, not {rc:?}"))),
            };
        }
        match self {
            // `"gpu": "passthrough"` is what a user means by it: a whole GPU.
            GpuRequest::Profile(p) if p.trim().eq_ignore_ascii_case("passthrough") => {
                Ok(GpuWant::Passthrough { address: None })
            }
            GpuRequest::Profile(p) => profile(p),
            GpuRequest::Spec(GpuSpec { profile: Some(_), passthrough: true, .. }) => {
                Err(ApiError::invalid_request("a profile (vGPU) or passthrough (a whole GPU), not both"))
            }
            GpuRequest::Spec(GpuSpec { profile: Some(p), passthrough: false, address: None, .. }) => profile(p),
            GpuRequest::Spec(GpuSpec { passthrough: false, address: Some(_), .. }) => {
                Err(ApiError::invalid_request("address names a whole GPU: it needs \"passthrough\": true"))
            }
            GpuRequest::Spec(GpuSpec { profile: None, passthrough: false, .. }) => {
                Err(ApiError::invalid_request("a GPU request needs a profile, or \"passthrough\": true"))
            }
            GpuRequest::Spec(GpuSpec { passthrough: true, address, .. }) => match address {
                Some(a) if !crate::config::is_bdf(&a.to_ascii_lowercase()) => Err(ApiError::invalid_request(format!(
                    "address {a:?} is not a PCI address (domain:bus:device.function, e.g. 0000:82:00.0)"
                ))),
                a => Ok(GpuWant::Passthrough { address: a.as_ref().map(|a| a.to_ascii_lowercase()) }),
            },
        }
    }
}

fn hypervisor_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let names: Vec<&str> = crate::hypervisor::HypervisorKind::ALL.iter().map(|k| k.name()).collect();
    schemars::json_schema!({ "type": "string", "enum": names })
}

impl CreateRequest {
    /// Checks every limit; errors are `invalid_request` naming the field.
    pub fn validate(&self) -> Result<(u32, u64, Option<GpuWant>), ApiError> {
        check_instance_name(&self.name)?;
        check_labels(&self.labels)?;
        let vcpus = self.vcpus.unwrap_or(DEFAULT_VCPUS);
        let memory_mib = self.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        if !(VCPUS_MIN..=VCPUS_MAX).contains(&vcpus) {
            return Err(ApiError::invalid_request(format!("vcpus must be {VCPUS_MIN}..={VCPUS_MAX}, not {vcpus}")));
        }
        if !(MEMORY_MIB_MIN..=MEMORY_MIB_MAX).contains(&memory_mib) {
            return Err(ApiError::invalid_request(format!(
                "memory_mib must be {MEMORY_MIB_MIN}..={MEMORY_MIB_MAX}, not {memory_mib}"
            )));
        }
        if let Some(h) = &self.hypervisor {
            if crate::hypervisor::HypervisorKind::from_name(h).is_none() {
                let names: Vec<String> =
                    crate::hypervisor::HypervisorKind::ALL.iter().map(|k| format!("{:?}", k.name())).collect();
                return Err(ApiError::invalid_request(format!("hypervisor {h:?} is not one of {}", names.join(", "))));
            }
        }
        if let Some(g) = self.disk_gib {
            if !(1..=DISK_GIB_MAX).contains(&g) {
                return Err(ApiError::invalid_request(format!("disk_gib must be 1..={DISK_GIB_MAX}, not {g}")));
            }
        }
        let gpu = self.gpu.as_ref().map(GpuRequest::want).transpose()?;
        crate::network::check_nics(&self.nics)?;
        if let Some(c) = &self.cloud_init {
            crate::network::check_cloud_init(c)?;
        }
        Ok((vcpus, memory_mib, gpu))
    }
}

/// Instance names: [`NAME_PATTERN`], and never UUID-shaped — a `ref` is first looked up as
/// an instance id, so a name equal to another instance's id would make `delete <name>` act
/// on that other instance. Errors: `invalid_request`.
pub fn check_instance_name(name: &str) -> Result<(), ApiError> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && Uuid::parse_str(name).is_err();
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_request(format!(
            "instance name {name:?} is not valid (use [a-z0-9][a-z0-9-]{{0,62}}, not a UUID)"
        )))
    }
}

fn label_key_ok(k: &str) -> bool {
    let b = k.as_bytes();
    !b.is_empty()
        && b.len() <= LABEL_KEY_MAX
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'/' | b'-'))
}

fn label_value_ok(v: &str) -> bool {
    v.len() <= LABEL_VALUE_MAX && v.bytes().all(|c| (b' '..=b'~').contains(&c))
}

/// Labels: at most [`MAX_LABELS`], keys [`LABEL_KEY_PATTERN`], values
/// [`LABEL_VALUE_PATTERN`]. Errors: `invalid_request` naming the label.
pub fn check_labels(labels: &Labels) -> Result<(), ApiError> {
    if labels.len() > MAX_LABELS {
        return Err(ApiError::invalid_request(format!("{} labels; at most {MAX_LABELS} are allowed", labels.len())));
    }
    if let Some(k) = labels.keys().find(|k| !label_key_ok(k)) {
        return Err(ApiError::invalid_request(format!(
            "label key {k:?} is not valid (1-{LABEL_KEY_MAX} bytes of [A-Za-z0-9._/-], starting with a letter or digit)"
        )));
    }
    if let Some((k, _)) = labels.iter().find(|(_, v)| !label_value_ok(v)) {
        return Err(ApiError::invalid_request(format!(
            "the value of label {k:?} is not valid (0-{LABEL_VALUE_MAX} bytes of printable ASCII)"
        )));
    }
    Ok(())
}

/// `{"ref": "<id or name>"}`: `instance.get`, `instance.start`, `instance.delete`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RefParams {
    /// Instance id or name.
    #[serde(alias = "id", alias = "name", rename = "ref")]
    pub reference: String,
}

/// `instance.stop` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StopParams {
    /// Instance id or name.
    #[serde(alias = "id", alias = "name", rename = "ref")]
    pub reference: String,
    /// Skip the guest power-off: SIGTERM first, then the kill path.
    #[serde(default)]
    pub force: bool,
    /// How long this stop waits for the guest to power off before the kill path, seconds
    /// (1..=3600; default: the agent's `stop_timeout_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub timeout_s: Option<u64>,
}

impl StopParams {
    /// The power-off wait this stop asked for, checked (`invalid_request` outside 1..=3600,
    /// or beside `force`, which skips the power-off it would bound).
    pub fn timeout(&self) -> Result<Option<std::time::Duration>, ApiError> {
        match self.timeout_s {
            Some(t) if self.force => Err(ApiError::invalid_request(format!(
                "timeout_s ({t}) bounds the guest power-off, which force skips: give one of them"
            ))),
            Some(t) if !(1..=3600).contains(&t) => {
                Err(ApiError::invalid_request(format!("timeout_s must be 1..=3600, not {t}")))
            }
            t => Ok(t.map(std::time::Duration::from_secs)),
        }
    }
}

/// `instance.fork` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkParams {
    /// The source instance's id or name.
    #[serde(alias = "id", rename = "ref")]
    pub reference: String,
    /// The new instance's name.
    #[schemars(schema_with = "name_schema")]
    pub name: String,
    /// Fork from this snapshot of the source (its disk state) instead of the source's
    /// current disk; the source may then be running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// `instance.snapshot` / `instance.restore` / `instance.snapshot_delete` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SaveStateParams {
    /// Instance id or name.
    #[serde(alias = "id", alias = "name", rename = "ref")]
    pub reference: String,
    /// The snapshot: its name for `instance.snapshot` (default `snap-<UTC time>`), the one
    /// to restore (`instance.restore`; absent: resume a standby instance) or to delete
    /// (`instance.snapshot_delete`, required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// `placement.dry_run` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DryRunParams {
    /// vGPU profile, e.g. `L40S-2Q`; absent with `passthrough`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Ask for a whole GPU (any free passthrough GPU, or `address`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub passthrough: bool,
    /// With `passthrough`: this GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The instance name the plugin sees (default `dry-run`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "optional_name_schema")]
    pub name: Option<String>,
    /// The instance's labels the plugin sees.
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    #[schemars(schema_with = "labels_schema")]
    pub labels: Labels,
}

fn optional_name_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    name_schema(g)
}

/// `image.import` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ImportParams {
    /// Image name, `[a-z0-9][a-z0-9._-]{0,62}`.
    #[schemars(regex(pattern = "^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub name: String,
    /// Absolute path of the kernel on the agent's host (direct boot); optional when `disk`
    /// is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// Absolute path of the initrd (only with `kernel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    /// Kernel command line (the agent's `default_cmdline` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// Absolute path of a disk image on the agent's host: qcow2, or a raw disk with an MBR
    /// or GPT (`qemu-img info` decides the format); copied into the image as `disk.qcow2`
    /// or `disk.raw`, flattened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<PathBuf>,
}

/// `image.delete` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NameParams {
    /// Image name.
    pub name: String,
}

/// `gpu.unquarantine` parameters: one device, several, or every mark of a GPU.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UnquarantineParams {
    /// One device (VF or mdev parent address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Several devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    /// A GPU (PF address): its own mark and the marks of all its devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
}

/// `debug.failpoint` parameters (failpoint builds only).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FailpointParams {
    /// A point of `agent/src/failpoints.rs`.
    pub name: String,
    /// `pause` arms the point, `release` lets waiting threads go on and disarms it.
    pub action: FailpointAction,
}

/// What `debug.failpoint` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailpointAction {
    /// Arm the point: the next thread that reaches it waits there.
    Pause,
    /// Let the waiting threads go on and disarm the point.
    Release,
}

crate::deserialize_by_name!(
    FailpointAction,
    [("pause", FailpointAction::Pause), ("release", FailpointAction::Release)]
);

#[cfg(test)]
mod tests {
    use super::*;

    /// `force` skips the power-off that `timeout_s` bounds: the pair is refused (the CLI
    /// refuses `--force --timeout` too), as is a timeout outside 1..=3600.
    #[test]
    fn a_stop_with_force_and_a_timeout_is_refused() {
        let p = |v: serde_json::Value| serde_json::from_value::<StopParams>(v).unwrap().timeout();
        let e = p(serde_json::json!({"ref": "a", "force": true, "timeout_s": 5})).unwrap_err();
        assert_eq!(e.code, crate::error::ErrorCode::InvalidRequest);
        assert!(e.message.contains("force"), "{}", e.message);
        assert!(p(serde_json::json!({"ref": "a", "timeout_s": 0})).is_err());
        assert_eq!(
            p(serde_json::json!({"ref": "a", "timeout_s": 5})).unwrap(),
            Some(std::time::Duration::from_secs(5))
        );
        assert_eq!(p(serde_json::json!({"ref": "a", "force": true})).unwrap(), None);
    }

    /// Issue 18 finding 12: a value of the wrong JSON type for an enum parameter
    /// (`"restart": true`) gets an error that lists the allowed values, like an unknown one.
    #[test]
    fn a_wrong_type_for_an_enum_parameter_lists_the_allowed_values() {
        let base = serde_json::json!({"name": "a", "image": "demo"});
        for (field, value, allowed) in [
            ("restart", serde_json::json!(true), ["\"no\"", "\"on-failure\"", "\"always\""].as_slice()),
            ("restart", serde_json::json!(1), ["\"no\"", "\"on-failure\"", "\"always\""].as_slice()),
            ("boot", serde_json::json!(false), ["\"direct\"", "\"bios\"", "\"uefi\""].as_slice()),
        ] {
            let mut req = base.clone();
            req[field] = value.clone();
            let e = serde_json::from_value::<CreateRequest>(req).unwrap_err().to_string();
            for a in allowed {
                assert!(e.contains(a), "{field}: {value}: {e}");
            }
        }
        let nic = serde_json::json!({"mode": "user", "forwards": [{"host_port": 8080, "guest_port": 80, "proto": 6}]});
        let e =
            serde_json::from_value::<CreateRequest>(serde_json::json!({"name": "a", "image": "demo", "nics": [nic]}))
                .unwrap_err()
                .to_string();
        assert!(e.contains("\"tcp\"") && e.contains("\"udp\""), "{e}");
    }

    #[test]
    fn names_follow_the_pattern_and_are_never_uuids() {
        for ok in ["a", "vm-1", "0abc", &"a".repeat(63)] {
            assert!(check_instance_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "A", "a_b", &"a".repeat(64), "6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d", "vm.1"] {
            assert!(check_instance_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn label_limits_are_bytes_of_ascii() {
        let l = |k: &str, v: &str| Labels::from([(k.to_string(), v.to_string())]);
        assert!(check_labels(&l("tenant", "a")).is_ok());
        assert!(check_labels(&l("example.com/team-a_1", "")).is_ok());
        assert!(check_labels(&l(&"k".repeat(63), &"v".repeat(255))).is_ok());
        assert!(check_labels(&l(&"k".repeat(64), "v")).is_err());
        assert!(check_labels(&l("k", &"v".repeat(256))).is_err());
        assert!(check_labels(&l("", "v")).is_err());
        assert!(check_labels(&l("-k", "v")).is_err());
        assert!(check_labels(&l("k", "é")).is_err(), "non-ASCII values are refused");
        assert!(check_labels(&l("k", "a\nb")).is_err(), "control characters are refused");
        let many: Labels = (0..65).map(|i| (format!("k{i}"), String::new())).collect();
        assert!(check_labels(&many).is_err());
    }

    #[test]
    fn gpu_requests_are_a_profile_or_a_whole_gpu() {
        let want = |j: &str| {
            serde_json::from_str::<GpuRequest>(j)
                .map_err(|e| e.to_string())
                .and_then(|g| g.want().map_err(|e| e.message))
        };
        assert_eq!(want(r#""L40S-2Q""#), Ok(GpuWant::Profile("L40S-2Q".into())));
        assert_eq!(want(r#"{"profile":"L40S-2Q"}"#), Ok(GpuWant::Profile("L40S-2Q".into())));
        assert_eq!(want(r#"{"passthrough":true}"#), Ok(GpuWant::Passthrough { address: None }));
        assert_eq!(
            want(r#"{"passthrough":true,"address":"0000:82:00.0"}"#),
            Ok(GpuWant::Passthrough { address: Some("0000:82:00.0".into()) })
        );
        assert!(want(r#"{"passthrough":true,"profile":"L40S-2Q"}"#).unwrap_err().contains("not both"));
        assert!(want(r#"{"address":"0000:82:00.0"}"#).unwrap_err().contains("passthrough"));
        assert!(want(r#"{"passthrough":true,"address":"82:00.0"}"#).unwrap_err().contains("not a PCI address"));
        assert!(want("{}").is_err());
        assert!(want(r#"{"passthrough":true,"bogus":1}"#).is_err());
        assert!(want("\"\"").is_err());
        assert_eq!(GpuRequest::from_flag("passthrough").want(), Ok(GpuWant::Passthrough { address: None }));
        assert_eq!(
            GpuRequest::from_flag("passthrough=0000:83:00.0").want(),
            Ok(GpuWant::Passthrough { address: Some("0000:83:00.0".into()) })
        );
        assert_eq!(GpuRequest::from_flag("L40S-2Q").want(), Ok(GpuWant::Profile("L40S-2Q".into())));
    }

    #[test]
    fn ref_params_take_ref_id_or_name_and_nothing_else() {
        let p: RefParams = serde_json::from_str(r#"{"ref":"a"}"#).unwrap();
        assert_eq!(p.reference, "a");
        let p: RefParams = serde_json::from_str(r#"{"name":"a"}"#).unwrap();
        assert_eq!(p.reference, "a");
        assert!(serde_json::from_str::<RefParams>(r#"{"ref":"a","force":true}"#).is_err());
        let s: StopParams = serde_json::from_str(r#"{"ref":"a","force":true}"#).unwrap();
        assert!(s.force);
    }
}

/// `events.subscribe` params: `{}` for every event, or `{"types": ["instance_state", …]}`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EventsParams {
    /// Only these event types (see `events.event`); absent = every type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub types: Option<Vec<String>>,
}

impl EventsParams {
    /// Errors: an unknown type, named with the valid ones.
    pub fn validate(&self) -> Result<(), String> {
        for t in self.types.iter().flatten() {
            if !crate::events::EventKind::TYPES.contains(&t.as_str()) {
                return Err(format!(
                    "invalid params: unknown event type {t:?}; valid: {}",
                    crate::events::EventKind::TYPES.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// True when `ev` is of a wanted type (a `lagged` notice always is).
    pub fn wants(&self, ev: &crate::events::Event) -> bool {
        let ty = ev.kind.type_name();
        ty == "lagged" || self.types.as_ref().is_none_or(|t| t.iter().any(|x| x == ty))
    }
}
