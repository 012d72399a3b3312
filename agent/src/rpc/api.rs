//! # api — the one table of JSON-RPC methods
//!
//! Each method is declared once below ([`api!`]): its name, summary, params type, result
//! type, the stable error codes it can answer, and the call into the lifecycle. From that
//! one declaration come:
//! - a marker type (e.g. [`method::InstanceCreate`]) implementing [`ApiMethod`]: the name and the
//!   typed params and result, which the CLI's client ([`crate::rpc::client::request`]) and
//!   any Rust client call through — a client cannot send another method's params or read
//!   another method's answer;
//! - the JSON-RPC registration ([`register`]): params decoded as the declared type
//!   (`NoParams`: none), the call run on a blocking thread, counted, its answer serialised;
//! - the OpenRPC entry ([`methods`], published by `rpc.discover` through
//!   [`super::openrpc::document`]): schemas generated from the very types decoded and
//!   returned.
//!
//! Adding a method is one entry here plus its implementation (and its section in
//! `docs/api.md`, which a test keeps in step with this table). Like cloud-hypervisor's
//! `ApiAction`: the list of what the API can do is data, not spread over the server, the
//! document and the client.

use super::{blocking, no_params, parse};
use crate::doctor::HostReport;
use crate::error::{ApiError, ErrorCode};
use crate::events::Event;
use crate::images::Image;
use crate::instances::owners::{
    ClaimList, ListParams as ClaimListParams, OwnersParams, OwnersResult, PrepareParams, PreparedView, ReleaseParams,
    ReleaseResult,
};
use crate::instances::request::*;
use crate::instances::saves::{SavedState, SnapshotDeleted, SnapshotList};
use crate::instances::stats::InstanceStats;
use crate::instances::update::{UpdateRequest, UpdateResult};
use crate::instances::Manager;
use crate::policies::ReloadParams;
use crate::wire::*;
use jsonrpsee::RpcModule;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// A JSON-RPC method of the agent: its name and the types of its params and result.
pub trait ApiMethod {
    /// The method's name (`noun.verb`).
    const NAME: &'static str;
    /// What the method takes ([`NoParams`]: nothing).
    type Params: Serialize;
    /// What it answers.
    type Result;
}

/// The params of a method that takes none: absent, `null`, `{}` or `[]` on the wire; a
/// client sends `{}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct NoParams {}

/// One method as the OpenRPC document states it: name, summary, the params type's schema
/// (`None`: no params), the result type's schema, the error codes.
pub struct Method {
    /// `noun.verb`.
    pub name: &'static str,
    /// One sentence: what it does.
    pub summary: &'static str,
    /// The params' schema (an object of named parameters).
    pub params: Option<fn(&mut SchemaGenerator) -> Schema>,
    /// The result's schema.
    pub result: fn(&mut SchemaGenerator) -> Schema,
    /// The stable error codes it can answer.
    pub errors: &'static [ErrorCode],
}

fn schema<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

/// `agent.metrics`' answer: the Prometheus text exposition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MetricsText(pub String);

impl JsonSchema for MetricsText {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "MetricsText".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        schemars::json_schema!({ "type": "string", "description": "Prometheus text exposition format 0.0.4" })
    }
}

/// `rpc.discover`'s answer: the OpenRPC document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OpenRpcDocument(pub serde_json::Value);

impl JsonSchema for OpenRpcDocument {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "OpenRpcDocument".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        schemars::json_schema!({ "type": "object", "description": "An OpenRPC 1.2 document" })
    }
}

/// `events.unsubscribe`'s answer: whether the subscription existed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct Unsubscribed(pub bool);

/// The table: generates the marker types, [`methods`] and [`register`].
macro_rules! api {
    (
        methods {
            $(
                $(#[cfg($cfg:meta)])?
                $Marker:ident {
                    name: $name:literal,
                    summary: $summary:literal,
                    params: $P:ident,
                    result: $R:ident,
                    errors: [$($e:ident),* $(,)?],
                    call: |$m:ident, $p:pat_param| $body:expr $(,)?
                }
            )*
        }
        subscription $Sub:ident {
            name: $sname:literal,
            summary: $ssummary:literal,
            notification: $notif:literal,
            unsubscribe: $unsub:literal,
            unsubscribe_summary: $usummary:literal,
            params: $SP:ident,
            result: $SR:ident,
            errors: [$($se:ident),* $(,)?],
            serve: $serve:path $(,)?
        }
    ) => {
        /// One type per method, named after it (`instance.list` → [`method::InstanceList`]),
        /// implementing [`ApiMethod`].
        pub mod method {
            $(
                $(#[cfg($cfg)])?
                #[doc = concat!("`", $name, "`: ", $summary)]
                pub struct $Marker;
                $(#[cfg($cfg)])?
                impl super::ApiMethod for $Marker {
                    const NAME: &'static str = $name;
                    type Params = super::$P;
                    type Result = super::$R;
                }
            )*
            #[doc = concat!("`", $sname, "`: ", $ssummary)]
            pub struct $Sub;
            impl super::ApiMethod for $Sub {
                const NAME: &'static str = $sname;
                type Params = super::$SP;
                type Result = super::$SR;
            }
        }

        /// Every JSON-RPC method the agent serves, as the OpenRPC document lists them.
        // One push per entry: an entry may be compiled out (`cfg`), which `vec![]` cannot say.
        #[allow(clippy::vec_init_then_push)]
        pub fn methods() -> Vec<Method> {
            let mut all = Vec::new();
            $(
                $(#[cfg($cfg)])?
                all.push(Method {
                    name: $name,
                    summary: $summary,
                    params: api!(@schema $P),
                    result: schema::<$R>,
                    errors: &[$(ErrorCode::$e),*],
                });
            )*
            all.push(Method {
                name: $sname,
                summary: $ssummary,
                params: api!(@schema $SP),
                result: schema::<$SR>,
                errors: &[$(ErrorCode::$se),*],
            });
            all.push(Method { name: $unsub, summary: $usummary, params: None, result: schema::<Unsubscribed>, errors: &[] });
            all
        }

        /// Registers every method of the table on `module`.
        pub fn register(module: &mut RpcModule<Arc<Manager>>) -> anyhow::Result<()> {
            $(
                $(#[cfg($cfg)])?
                module.register_async_method($name, |params, m, _| async move {
                    let decoded: $P = api!(@decode $P, params)?;
                    blocking($name, &m, move |$m: &Manager| {
                        let $p = decoded;
                        $body
                    })
                    .await
                })?;
            )*
            module.register_subscription($sname, $notif, $unsub, |p, s, m, e| $serve(p, s, Arc::clone(&*m), e))?;
            Ok(())
        }
    };
    (@schema NoParams) => { None };
    (@schema $P:ident) => { Some(schema::<$P>) };
    (@decode NoParams, $params:ident) => { no_params(&$params).map(|()| NoParams {}) };
    (@decode $P:ident, $params:ident) => { parse::<$P>(&$params) };
}

/// `Ok` for the lifecycle calls that cannot fail.
fn always<T>(v: T) -> Result<T, ApiError> {
    Ok(v)
}

api! {
    methods {
        InstanceCreate {
            name: "instance.create",
            summary: "Create an instance and boot it; with `gpu` a vGPU of that profile, or a whole GPU (passthrough), is claimed and configured first.",
            params: CreateRequest,
            result: InstanceView,
            errors: [InvalidRequest, UnknownProfile, HypervisorUnsupported, NameTaken, NoCapacity, DeviceUnhealthy,
                IommuGroupConflict, GpuBusy, NotReady, PolicyFailed, VmmStartFailed, VmmKillFailed, PassthroughBindFailed,
                VmmLivenessUnknown, VgpuCleanupPending, Internal],
            call: |m, r| m.create(r),
        }
        InstanceGet {
            name: "instance.get",
            summary: "One instance, with `gpu` derived from its claim.",
            params: RefParams,
            result: InstanceView,
            errors: [NotFound, Internal],
            call: |m, r| m.get(&r.reference),
        }
        InstanceList {
            name: "instance.list",
            summary: "Every instance, and every instance record that cannot be read.",
            params: NoParams,
            result: InstanceList,
            errors: [Internal],
            call: |m, _| m.list(),
        }
        InstanceStart {
            name: "instance.start",
            summary: "Start a stopped instance (claims a device again).",
            params: RefParams,
            result: InstanceView,
            errors: [NotFound, InvalidState, InstanceCleanupPending, GpuReleasePending, NoCapacity, DeviceUnhealthy,
                IommuGroupConflict, GpuBusy, NotReady, PolicyFailed, VmmStartFailed, VmmKillFailed, PassthroughBindFailed,
                VmmLivenessUnknown, VgpuCleanupPending, Internal],
            call: |m, r| m.start(&r.reference),
        }
        InstanceStop {
            name: "instance.stop",
            summary: "Power the guest off (or kill with force), then release its device; `gpu.release_pending` says when the release is still pending.",
            params: StopParams,
            result: InstanceView,
            errors: [NotFound, InvalidRequest, InvalidState, InstanceCleanupPending, VmmLivenessUnknown, VmmKillFailed, Internal],
            call: |m, r| r.timeout().and_then(|t| m.stop(&r.reference, r.force, t)),
        }
        InstanceReset {
            name: "instance.reset",
            summary: "Reset a running VM in place, like its reset button (QMP system_reset; Cloud Hypervisor vm.reboot): the VMM, its claim and devices stay; the guest starts over without shutting down.",
            params: RefParams,
            result: InstanceView,
            errors: [NotFound, InvalidState, InstanceCleanupPending, Internal],
            call: |m, r| m.reset(&r.reference),
        }
        InstanceUpdate {
            name: "instance.update",
            summary: "Change an instance after create: labels, restart and autostart at once; vCPUs, memory, NICs and cloud-init inputs at its next start (instance.reboot applies them). Checked as create checks them; nothing is written unless all pass.",
            params: UpdateRequest,
            result: UpdateResult,
            errors: [NotFound, InvalidRequest, InvalidState, InstanceCleanupPending, Internal],
            call: |m, r| m.update(r),
        }
        InstanceStats {
            name: "instance.stats",
            summary: "What a running VM uses now: the VMM's CPU time and resident memory, each disk's I/O counters (from the VMM), each bridge NIC's traffic (from its tap); what cannot be read is null and named in unavailable.",
            params: RefParams,
            result: InstanceStats,
            errors: [NotFound, InvalidState],
            call: |m, r| m.stats(&r.reference),
        }
        InstanceReboot {
            name: "instance.reboot",
            summary: "Stop a running VM (the guest powers off, or force kills it; its device is released) and start it again: the definition as it is now applies, and a GPU instance claims a device like any start.",
            params: StopParams,
            result: InstanceView,
            errors: [NotFound, InvalidRequest, InvalidState, InstanceCleanupPending, VmmLivenessUnknown, VmmKillFailed, GpuReleasePending,
                NoCapacity, DeviceUnhealthy, IommuGroupConflict, GpuBusy, NotReady, PolicyFailed, VmmStartFailed,
                PassthroughBindFailed, VgpuCleanupPending, Internal],
            call: |m, r| r.timeout().and_then(|t| m.reboot(&r.reference, r.force, t)),
        }
        InstanceDelete {
            name: "instance.delete",
            summary: "Kill the VMM, release the device, remove the instance.",
            params: RefParams,
            result: DeleteResult,
            errors: [NotFound, VmmLivenessUnknown, VmmKillFailed, VgpuCleanupPending, Internal],
            call: |m, r| m.delete(&r.reference),
        }
        InstanceFork {
            name: "instance.fork",
            summary: "A new stopped instance with the source's definition and GPU profile, and a copy of its disk overlay (the source must then be stopped); never its claim or VMM.",
            params: ForkParams,
            result: InstanceView,
            errors: [NotFound, InvalidRequest, InvalidState, NameTaken, InstanceCleanupPending, Internal],
            call: |m, f| m.fork(&f.reference, &f.name, f.snapshot.as_deref()),
        }
        InstanceStandby {
            name: "instance.standby",
            summary: "Save a running VM without a GPU (memory, device state; its disk stays) and stop its VMM: state standby, no VMM, no device; instance.start resumes it.",
            params: RefParams,
            result: InstanceView,
            errors: [NotFound, InvalidState, InstanceCleanupPending, UnsupportedWithGpu, HypervisorUnsupported, VmmKillFailed, Internal],
            call: |m, s| m.standby(&s.reference),
        }
        InstanceSnapshot {
            name: "instance.snapshot",
            summary: "A named snapshot: of a running VM without a GPU its memory, device state and disk (paused for the save, then resumed); of a stopped VM its disk.",
            params: SaveStateParams,
            result: SavedState,
            errors: [NotFound, InvalidRequest, InvalidState, InstanceCleanupPending, UnsupportedWithGpu, HypervisorUnsupported, Internal],
            call: |m, s| m.snapshot(&s.reference, s.snapshot.as_deref()),
        }
        InstanceSnapshots {
            name: "instance.snapshots",
            summary: "An instance's snapshots, oldest first, with their sizes.",
            params: RefParams,
            result: SnapshotList,
            errors: [NotFound, Internal],
            call: |m, s| m.snapshots(&s.reference),
        }
        InstanceSnapshotDelete {
            name: "instance.snapshot_delete",
            summary: "Remove one snapshot.",
            params: SaveStateParams,
            result: SnapshotDeleted,
            errors: [NotFound, InvalidRequest, Internal],
            call: |m, s| s
                .snapshot
                .as_deref()
                .ok_or_else(|| ApiError::invalid_request("instance.snapshot_delete needs the snapshot's name (snapshot)"))
                .and_then(|n| m.delete_snapshot(&s.reference, n)),
        }
        InstanceRestore {
            name: "instance.restore",
            summary: "Back to a snapshot (its disk replaces the instance's, then it starts: resumed where it was for a running snapshot, booted with a fresh device claim for a stopped one), or, without one, resume a standby instance. Never a claim or VMM identity of the time of the snapshot.",
            params: SaveStateParams,
            result: InstanceView,
            errors: [NotFound, InvalidRequest, InvalidState, InstanceCleanupPending, UnsupportedWithGpu, HypervisorUnsupported,
                NoCapacity, DeviceUnhealthy, NotReady, PolicyFailed, VmmStartFailed, VmmKillFailed, VmmLivenessUnknown,
                GpuReleasePending, VgpuCleanupPending, Internal],
            call: |m, s| m.restore(&s.reference, s.snapshot.as_deref()),
        }
        ResourcesGet {
            name: "resources.get",
            summary: "GPU mode, device counts, placeable count per profile (one observation).",
            params: NoParams,
            result: Resources,
            errors: [],
            call: |m, _| m.resources(),
        }
        GpuList {
            name: "gpu.list",
            summary: "Every GPU and device: current type (or unknown), claim owner, health marks, what cannot be read.",
            params: NoParams,
            result: GpuList,
            errors: [NotReady],
            call: |m, _| m.gpus(),
        }
        ClaimPrepare {
            name: "claim.prepare",
            summary: "Claim exactly one device for an external owner (a Kubernetes ResourceClaim) and configure it through the instance path (type write and read-back, mdev create, passthrough bind); the same owner and device again answer the same view.",
            params: PrepareParams,
            result: PreparedView,
            errors: [InvalidRequest, UnknownProfile, NotFound, DeviceTaken, InUse, DeviceUnhealthy, NoCapacity, IommuGroupConflict,
                GpuBusy, PassthroughBindFailed, NotReady, Internal],
            call: |m, p| m.prepare(p),
        }
        ClaimRelease {
            name: "claim.release",
            summary: "Release an external owner's device through the release guard: refused (`in_use`) while any process holds it; a claim already gone answers `released: false`.",
            params: ReleaseParams,
            result: ReleaseResult,
            errors: [InvalidRequest, DeviceTaken, InUse, NotReady, Internal],
            call: |m, p| m.release_claim(p),
        }
        ClaimList {
            name: "claim.list",
            summary: "Every claim with its owner (instances and external owners), optionally of one owner kind.",
            params: ClaimListParams,
            result: ClaimList,
            errors: [InvalidRequest, Internal],
            call: |m, p| m.claim_list(p),
        }
        ClaimOwners {
            name: "claim.owners",
            summary: "The external owners of a kind that exist now (a complete list): claims of owners absent from it are released by the reconciler.",
            params: OwnersParams,
            result: OwnersResult,
            errors: [InvalidRequest],
            call: |m, p| m.set_owners(p),
        }
        GpuUnquarantine {
            name: "gpu.unquarantine",
            summary: "Clear the health marks of a device, of several, or of a whole GPU, after repair.",
            params: UnquarantineParams,
            result: UnquarantineResult,
            errors: [InvalidRequest, NotFound, Internal],
            call: |m, u| m.unquarantine(u),
        }
        PlacementDryRun {
            name: "placement.dry_run",
            summary: "What the placement plugin would choose for a profile now (claims nothing).",
            params: DryRunParams,
            result: DryRun,
            errors: [InvalidRequest, UnknownProfile, NoCapacity, DeviceUnhealthy, IommuGroupConflict, NotReady, PolicyFailed],
            call: |m, d| m.dry_run(d),
        }
        ImageImport {
            name: "image.import",
            summary: "Copy a kernel (and initrd) and/or a disk (qcow2, or raw with an MBR/GPT) into the images directory.",
            params: ImportParams,
            result: Image,
            errors: [InvalidRequest, NameTaken, Internal],
            call: |m, i| m.import_image(&i),
        }
        ImageList {
            name: "image.list",
            summary: "Every image.",
            params: NoParams,
            result: ImageList,
            errors: [],
            call: |m, _| crate::images::list(&m.store().images_dir()).map(|(images, unreadable)| ImageList { images, unreadable }),
        }
        ImageDelete {
            name: "image.delete",
            summary: "Delete an image; refused while instances use it.",
            params: NameParams,
            result: ImageDeleted,
            errors: [InvalidRequest, NotFound, ImageInUse, NotReady, Internal],
            call: |m, n| m.delete_image(&n.name),
        }
        ReconcileRun {
            name: "reconcile.run",
            summary: "Run one reconcile pass now and return its report (kept, released, failed, records changed).",
            params: NoParams,
            result: PassReport,
            errors: [],
            call: |m, _| always(m.reconcile()),
        }
        PluginReload {
            name: "plugin.reload",
            summary: "Re-read the config and load every plugin again with its params and limits; with `trial`, first call each new plugin on the slot's last input (or one given in `inputs`); on any error, or a failed trial call, the old ones stay.",
            params: ReloadParams,
            result: ReloadResult,
            errors: [InvalidRequest],
            call: |m, r| m.reload_plugins(&r),
        }
        PluginList {
            name: "plugin.list",
            summary: "The loaded policy plugins with call counts.",
            params: NoParams,
            result: PluginList,
            errors: [],
            call: |m, _| always(m.plugin_list()),
        }
        AgentHealth {
            name: "agent.health",
            summary: "Liveness, readiness and what is degraded.",
            params: NoParams,
            result: HealthView,
            errors: [],
            call: |m, _| always(m.health()),
        }
        AgentMetrics {
            name: "agent.metrics",
            summary: "Prometheus text exposition (format 0.0.4).",
            params: NoParams,
            result: MetricsText,
            errors: [],
            call: |m, _| always(MetricsText(m.metrics_text())),
        }
        HostCheck {
            name: "host.check",
            summary: "What gpuvisor needs from this host (IOMMU, VFIO, NVIDIA driver and vGPU manager, VFs, types, KVM, hypervisors, /proc, VMM user, cgroup v2), one verdict per check; reads only.",
            params: NoParams,
            result: HostReport,
            errors: [],
            call: |m, _| always(crate::doctor::check_host(m.config())),
        }
        RpcDiscover {
            name: "rpc.discover",
            summary: "This OpenRPC document.",
            params: NoParams,
            result: OpenRpcDocument,
            errors: [],
            call: |_m, _| always(OpenRpcDocument(super::openrpc::document())),
        }
        #[cfg(feature = "failpoints")]
        DebugFailpoint {
            name: "debug.failpoint",
            summary: "Failpoint builds only: pause a failpoint (threads reaching it wait) or release it.",
            params: FailpointParams,
            result: FailpointList,
            errors: [InvalidRequest],
            call: |m, f| crate::failpoints::set_pause(&f.name, f.action == FailpointAction::Pause)
                .map_err(ApiError::invalid_request)
                .map(|()| m.failpoints()),
        }
        #[cfg(feature = "failpoints")]
        DebugFailpoints {
            name: "debug.failpoints",
            summary: "Failpoint builds only: every pause point, armed or not, with waiting threads and hits.",
            params: NoParams,
            result: FailpointList,
            errors: [],
            call: |m, _| always(m.failpoints()),
        }
    }
    subscription EventsSubscribe {
        name: "events.subscribe",
        summary: "WebSocket only: subscribe to the agent's events (instance state changes, claims, releases, health marks, reconcile passes, policy failures), each with `seq` and `time`; notifications are `events.event` with the event as `result`. The answer is the subscription id.",
        notification: "events.event",
        unsubscribe: "events.unsubscribe",
        unsubscribe_summary: "End an `events.subscribe` subscription (params: the subscription id).",
        params: EventsParams,
        result: Event,
        errors: [InvalidRequest],
        serve: super::subscribe_events,
    }
}
