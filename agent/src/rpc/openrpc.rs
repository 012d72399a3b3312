//! The OpenRPC document `rpc.discover` returns: every method with its parameter and result
//! schemas — generated (`schemars`) from the very types the agent decodes and returns, so
//! every limit the agent enforces is stated — and the stable error codes it can answer
//! (docs/design/lifecycle.md "Errors"), with their classes from [`ErrorCode::class`].

use crate::error::ErrorCode;
use crate::instances::request::*;
use crate::instances::saves::{SavedState, SnapshotDeleted, SnapshotList};
use crate::instances::view::*;
use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde_json::{json, Value};

/// One method: name, summary, the params type's schema (`None`: no params), the result
/// type's schema, the error codes.
pub struct Method {
    pub name: &'static str,
    pub summary: &'static str,
    pub params: Option<fn(&mut SchemaGenerator) -> Schema>,
    pub result: fn(&mut SchemaGenerator) -> Schema,
    pub errors: &'static [ErrorCode],
}

fn schema<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

fn string_result(_: &mut SchemaGenerator) -> Schema {
    schemars::json_schema!({ "type": "string", "description": "Prometheus text exposition format 0.0.4" })
}

fn bool_result(_: &mut SchemaGenerator) -> Schema {
    schemars::json_schema!({ "type": "boolean" })
}

fn any_object(_: &mut SchemaGenerator) -> Schema {
    schemars::json_schema!({ "type": "object" })
}

macro_rules! method {
    ($name:literal, $summary:literal, params: $p:ty, result: $r:ty, errors: [$($e:ident),*]) => {
        Method { name: $name, summary: $summary, params: Some(schema::<$p>), result: schema::<$r>, errors: &[$(ErrorCode::$e),*] }
    };
    ($name:literal, $summary:literal, result: $r:ty, errors: [$($e:ident),*]) => {
        Method { name: $name, summary: $summary, params: None, result: schema::<$r>, errors: &[$(ErrorCode::$e),*] }
    };
}

/// Every JSON-RPC method the agent serves (the module is checked against this list).
pub fn methods() -> Vec<Method> {
    let mut m = vec![
        method!("instance.create", "Create an instance and boot it; with `gpu` a vGPU of that profile, or a whole GPU (passthrough), is claimed and configured first.",
            params: CreateRequest, result: InstanceView,
            errors: [InvalidRequest, UnknownProfile, HypervisorUnsupported, NameTaken, NoCapacity, DeviceUnhealthy,
                IommuGroupConflict, GpuBusy, NotReady, PolicyFailed, VmmStartFailed, VmmKillFailed, PassthroughBindFailed,
                VmmLivenessUnknown, VgpuCleanupPending, Internal]),
        method!("instance.get", "One instance, with `gpu` derived from its claim.", params: RefParams, result: InstanceView,
            errors: [NotFound, Internal]),
        method!("instance.list", "Every instance, and every instance record that cannot be read.", result: InstanceList,
            errors: [Internal]),
        method!("instance.start", "Start a stopped instance (claims a device again).", params: RefParams, result: InstanceView,
            errors: [NotFound, InvalidState, InstanceCleanupPending, GpuReleasePending, NoCapacity, DeviceUnhealthy,
                IommuGroupConflict, GpuBusy, NotReady, PolicyFailed, VmmStartFailed, VmmKillFailed, PassthroughBindFailed,
                VmmLivenessUnknown, VgpuCleanupPending, Internal]),
        method!("instance.stop", "Power the guest off (or kill with force), then release its device; `gpu.release_pending` says when the release is still pending.",
            params: StopParams, result: InstanceView,
            errors: [NotFound, InvalidState, InstanceCleanupPending, VmmLivenessUnknown, VmmKillFailed, Internal]),
        method!("instance.reset", "Reset a running VM in place, like its reset button (QMP system_reset; Cloud Hypervisor vm.reboot): the VMM, its claim and devices stay; the guest starts over without shutting down.",
            params: RefParams, result: InstanceView, errors: [NotFound, InvalidState, InstanceCleanupPending, Internal]),
        method!("instance.update", "Change an instance after create: labels, restart and autostart at once; vCPUs, memory, NICs and cloud-init inputs at its next start (instance.reboot applies them). Checked as create checks them; nothing is written unless all pass.",
            params: crate::instances::update::UpdateRequest, result: crate::instances::update::UpdateResult,
            errors: [NotFound, InvalidRequest, InvalidState, InstanceCleanupPending, Internal]),
        method!("instance.stats", "What a running VM uses now: the VMM's CPU time and resident memory, each disk's I/O counters (from the VMM), each bridge NIC's traffic (from its tap); what cannot be read is null and named in unavailable.",
            params: RefParams, result: crate::instances::stats::InstanceStats, errors: [NotFound, InvalidState]),
        method!("instance.reboot", "Stop a running VM (the guest powers off, or force kills it; its device is released) and start it again: the definition as it is now applies, and a GPU instance claims a device like any start.",
            params: StopParams, result: InstanceView,
            errors: [NotFound, InvalidState, InstanceCleanupPending, VmmLivenessUnknown, VmmKillFailed, GpuReleasePending,
                NoCapacity, DeviceUnhealthy, IommuGroupConflict, GpuBusy, NotReady, PolicyFailed, VmmStartFailed,
                PassthroughBindFailed, VgpuCleanupPending, Internal]),
        method!("instance.delete", "Kill the VMM, release the device, remove the instance.", params: RefParams, result: DeleteResult,
            errors: [NotFound, VmmLivenessUnknown, VmmKillFailed, VgpuCleanupPending, Internal]),
        method!("instance.fork", "A new stopped instance with the source's definition and GPU profile, and a copy of its disk overlay (the source must then be stopped); never its claim or VMM.",
            params: ForkParams, result: InstanceView, errors: [NotFound, InvalidRequest, InvalidState, NameTaken, InstanceCleanupPending, Internal]),
        method!("instance.standby", "Save a running VM without a GPU (memory, device state; its disk stays) and stop its VMM: state standby, no VMM, no device; instance.start resumes it.",
            params: RefParams, result: InstanceView,
            errors: [NotFound, InvalidState, InstanceCleanupPending, UnsupportedWithGpu, HypervisorUnsupported, VmmKillFailed, Internal]),
        method!("instance.snapshot", "A named snapshot: of a running VM without a GPU its memory, device state and disk (paused for the save, then resumed); of a stopped VM its disk.",
            params: SaveStateParams, result: SavedState,
            errors: [NotFound, InvalidRequest, InvalidState, InstanceCleanupPending, UnsupportedWithGpu, HypervisorUnsupported, Internal]),
        method!("instance.snapshots", "An instance's snapshots, oldest first, with their sizes.", params: RefParams, result: SnapshotList,
            errors: [NotFound, Internal]),
        method!("instance.snapshot_delete", "Remove one snapshot.", params: SaveStateParams, result: SnapshotDeleted,
            errors: [NotFound, InvalidRequest, Internal]),
        method!("instance.restore", "Back to a snapshot (its disk replaces the instance's, then it starts: resumed where it was for a running snapshot, booted with a fresh device claim for a stopped one), or, without one, resume a standby instance. Never a claim or VMM identity of the time of the snapshot.",
            params: SaveStateParams, result: InstanceView,
            errors: [NotFound, InvalidRequest, InvalidState, InstanceCleanupPending, UnsupportedWithGpu, HypervisorUnsupported,
                NoCapacity, DeviceUnhealthy, NotReady, PolicyFailed, VmmStartFailed, VmmKillFailed, VmmLivenessUnknown,
                GpuReleasePending, VgpuCleanupPending, Internal]),
        method!("resources.get", "GPU mode, device counts, placeable count per profile (one observation).", result: Resources, errors: []),
        method!("gpu.list", "Every GPU and device: current type (or unknown), claim owner, health marks, what cannot be read.",
            result: GpuList, errors: [NotReady]),
        method!("claim.prepare", "Claim exactly one device for an external owner (a Kubernetes ResourceClaim) and configure it through the instance path (type write and read-back, mdev create, passthrough bind); the same owner and device again answer the same view.",
            params: crate::instances::owners::PrepareParams, result: crate::instances::owners::PreparedView,
            errors: [InvalidRequest, UnknownProfile, NotFound, DeviceTaken, InUse, DeviceUnhealthy, NoCapacity, IommuGroupConflict,
                GpuBusy, PassthroughBindFailed, NotReady, Internal]),
        method!("claim.release", "Release an external owner's device through the release guard: refused (`in_use`) while any process holds it; a claim already gone answers `released: false`.",
            params: crate::instances::owners::ReleaseParams, result: crate::instances::owners::ReleaseResult,
            errors: [InvalidRequest, DeviceTaken, InUse, NotReady, Internal]),
        method!("claim.list", "Every claim with its owner (instances and external owners), optionally of one owner kind.",
            params: crate::instances::owners::ListParams, result: crate::instances::owners::ClaimList,
            errors: [InvalidRequest, Internal]),
        method!("claim.owners", "The external owners of a kind that exist now (a complete list): claims of owners absent from it are released by the reconciler.",
            params: crate::instances::owners::OwnersParams, result: crate::instances::owners::OwnersResult,
            errors: [InvalidRequest]),
        method!("gpu.unquarantine", "Clear the health marks of a device, of several, or of a whole GPU, after repair.",
            params: UnquarantineParams, result: UnquarantineResult, errors: [InvalidRequest, NotFound, Internal]),
        method!("placement.dry_run", "What the placement plugin would choose for a profile now (claims nothing).",
            params: DryRunParams, result: DryRun, errors: [InvalidRequest, UnknownProfile, NoCapacity, DeviceUnhealthy, IommuGroupConflict, NotReady, PolicyFailed]),
        method!("image.import", "Copy a kernel (and initrd) and/or a disk (qcow2, or raw with an MBR/GPT) into the images directory.", params: ImportParams, result: crate::images::Image,
            errors: [InvalidRequest, NameTaken, Internal]),
        method!("image.list", "Every image.", result: ImageList, errors: []),
        method!("image.delete", "Delete an image; refused while instances use it.", params: NameParams, result: ImageDeleted,
            errors: [InvalidRequest, NotFound, ImageInUse, NotReady, Internal]),
        method!("reconcile.run", "Run one reconcile pass now and return its report (kept, released, failed, records changed).",
            result: PassReport, errors: []),
        method!("plugin.reload", "Re-read the config and load every plugin again with its params and limits; with `trial`, first call each new plugin on the slot's last input (or one given in `inputs`); on any error, or a failed trial call, the old ones stay.",
            params: crate::policies::ReloadParams, result: ReloadResult, errors: [InvalidRequest]),
        method!("plugin.list", "The loaded policy plugins with call counts.", result: PluginList, errors: []),
        method!("agent.health", "Liveness, readiness and what is degraded.", result: HealthView, errors: []),
        method!("host.check", "What gpuvisor needs from this host (IOMMU, VFIO, NVIDIA driver and vGPU manager, VFs, types, KVM, hypervisors, /proc, VMM user, cgroup v2), one verdict per check; reads only.",
            result: crate::host::check::HostReport, errors: []),
        method!("events.subscribe", "WebSocket only: subscribe to the agent's events (instance state changes, claims, releases, health marks, reconcile passes, policy failures), each with `seq` and `time`; notifications are `events.event` with the event as `result`. The answer is the subscription id.",
            params: EventsParams, result: crate::events::Event, errors: [InvalidRequest]),
        Method {
            name: "events.unsubscribe",
            summary: "End an `events.subscribe` subscription (params: the subscription id).",
            params: None,
            result: bool_result,
            errors: &[],
        },
        Method {
            name: "agent.metrics",
            summary: "Prometheus text exposition (format 0.0.4).",
            params: None,
            result: string_result,
            errors: &[],
        },
        Method {
            name: "rpc.discover",
            summary: "This OpenRPC document.",
            params: None,
            result: any_object,
            errors: &[],
        },
    ];
    if cfg!(feature = "failpoints") {
        m.push(method!("debug.failpoint", "Failpoint builds only: pause a failpoint (threads reaching it wait) or release it.",
            params: FailpointParams, result: FailpointList, errors: [InvalidRequest]));
        m.push(method!("debug.failpoints", "Failpoint builds only: every pause point, armed or not, with waiting threads and hits.",
            result: FailpointList, errors: []));
    }
    m
}

/// The schema generator: draft-07, every subschema inline (OpenRPC content descriptors
/// carry plain schemas).
fn generator() -> SchemaGenerator {
    SchemaSettings::draft07()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .into_generator()
}

/// The parameters of a method as OpenRPC content descriptors (by name).
fn params_of(schema: &Schema) -> Vec<Value> {
    let v = schema.as_value();
    let required: Vec<&str> = v
        .get("required")
        .and_then(|r| r.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    let mut out = Vec::new();
    if let Some(props) = v.get("properties").and_then(|p| p.as_object()) {
        for (name, s) in props {
            out.push(json!({
                "name": name,
                "required": required.contains(&name.as_str()),
                "schema": s,
            }));
        }
    }
    out
}

/// The OpenRPC 1.2 document.
pub fn document() -> Value {
    let mut g = generator();
    let methods: Vec<Value> = methods()
        .iter()
        .map(|m| {
            let params = m.params.map(|p| params_of(&p(&mut g))).unwrap_or_default();
            json!({
                "name": m.name,
                "summary": m.summary,
                "paramStructure": "by-name",
                "params": params,
                "result": { "name": "result", "schema": (m.result)(&mut g) },
                "errors": m.errors.iter().map(|c| json!({
                    "code": c.class(), "message": c.as_str(), "data": { "code": c.as_str() },
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "openrpc": "1.2.6",
        "info": { "title": "gpuvisor", "version": env!("CARGO_PKG_VERSION"),
                  "description": "JSON-RPC 2.0 over HTTP on a Unix socket. Errors carry data.code (a stable string)." },
        "methods": methods,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_schema(method: &str, param: &str) -> Value {
        let doc = document();
        let m = doc["methods"].as_array().unwrap().iter().find(|m| m["name"] == method).unwrap().clone();
        m["params"].as_array().unwrap().iter().find(|p| p["name"] == param).unwrap()["schema"].clone()
    }

    /// A client validating against the document and the agent agree: every probe value is
    /// accepted by both or refused by both.
    #[test]
    fn the_schema_and_the_agent_agree_on_names_labels_and_bounds() {
        let create = |v: Value| -> bool {
            serde_json::from_value::<CreateRequest>(v).map(|r| r.validate().is_ok()).unwrap_or(false)
        };
        let doc = document();
        let m = doc["methods"].as_array().unwrap().iter().find(|m| m["name"] == "instance.create").unwrap().clone();
        let mut props = serde_json::Map::new();
        let mut required = vec![];
        for p in m["params"].as_array().unwrap() {
            props.insert(p["name"].as_str().unwrap().to_string(), p["schema"].clone());
            if p["required"] == true {
                required.push(p["name"].clone());
            }
        }
        let schema =
            json!({"type": "object", "properties": props, "required": required, "additionalProperties": false});
        let validator = jsonschema::validator_for(&schema).unwrap();
        let k = |n: usize| "k".repeat(n);
        let probes = vec![
            json!({"name": "a", "image": "demo"}),
            json!({"name": "A", "image": "demo"}),
            json!({"name": "-a", "image": "demo"}),
            json!({"name": "a".repeat(63), "image": "demo"}),
            json!({"name": "a".repeat(64), "image": "demo"}),
            json!({"name": "a", "image": "demo", "vcpus": 0}),
            json!({"name": "a", "image": "demo", "vcpus": 64}),
            json!({"name": "a", "image": "demo", "vcpus": 65}),
            json!({"name": "a", "image": "demo", "memory_mib": 63}),
            json!({"name": "a", "image": "demo", "memory_mib": 1_048_576}),
            json!({"name": "a", "image": "demo", "memory_mib": 1_048_577}),
            json!({"name": "a", "image": "demo", "labels": {"tenant": "x"}}),
            json!({"name": "a", "image": "demo", "labels": {k(63): "x"}}),
            json!({"name": "a", "image": "demo", "labels": {k(64): "x"}}),
            json!({"name": "a", "image": "demo", "labels": {"": "x"}}),
            json!({"name": "a", "image": "demo", "labels": {"k": "v".repeat(255)}}),
            json!({"name": "a", "image": "demo", "labels": {"k": "v".repeat(256)}}),
            json!({"name": "a", "image": "demo", "labels": {"k": "é"}}),
            json!({"name": "a", "image": "demo", "labels": {"k é": "v"}}),
            json!({"name": "a", "image": "demo", "hypervisor": "xen"}),
            json!({"name": "a", "image": "demo", "hypervisor": "cloud-hypervisor"}),
            json!({"name": "a", "image": "demo", "labels": (0..65).map(|i| (format!("k{i}"), json!(""))).collect::<serde_json::Map<_, _>>()}),
            json!({"name": "a", "image": "demo", "force": true}),
        ];
        for p in probes {
            assert_eq!(validator.is_valid(&p), create(p.clone()), "schema and agent disagree on {p}");
        }
        assert_eq!(param_schema("instance.create", "name")["pattern"], NAME_PATTERN);
    }

    #[test]
    fn every_method_has_a_result_schema_and_errors_with_their_class() {
        let doc = document();
        for m in doc["methods"].as_array().unwrap() {
            assert!(m["result"]["schema"].is_object(), "{}", m["name"]);
            for e in m["errors"].as_array().unwrap() {
                let code = ErrorCode::from_name(e["data"]["code"].as_str().unwrap()).unwrap();
                assert_eq!(e["code"], code.class());
            }
        }
    }
}
