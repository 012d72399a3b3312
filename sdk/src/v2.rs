//! ABI v2 guest glue (feature `v2`): the `wit-bindgen` bindings of the WIT package
//! `gpuvisor:policy@2.0.0` (`wit/policy.wit`), conversions between the bindings' types and
//! the SDK's [`types`](crate::types), and the [`export_plugin_v2!`](crate::export_plugin_v2)
//! macro that turns plain Rust functions into a v2 component's exports.
//!
//! # Writing a v2 plugin
//!
//! The policy functions are the same as for v1 (`fn(&XInput) -> Answer` or
//! `Result<Answer, E: Display>`); only the macro differs, and a component implements one
//! kind:
//!
//! ```ignore
//! gpuvisor_sdk::export_plugin_v2! {
//!     name: "my-placement",
//!     version: env!("CARGO_PKG_VERSION"),
//!     placement: crate::place,
//! }
//! ```
//!
//! Build the crate for `wasm32-unknown-unknown` with the SDK's feature `v2`, then wrap the
//! core module: `wasm-tools component new target/.../my_placement.wasm -o my-placement.wasm`.
//! The core module carries the world in a `component-type` custom section (emitted by the
//! macro's expansion in the plugin crate), so `wasm-tools` needs no WIT file.
//!
//! With the feature on, [`crate::abi::log`] calls the v2 import `gpuvisor:policy/log@2.0.0`
//! instead of v1's `gpuvisor.log`: a crate built with `gpuvisor-sdk/v2` must export with
//! `export_plugin_v2!`, not `export_plugin!`.
//!
//! # The conversions name every field
//!
//! Every conversion below destructures its source struct without `..` and builds its target
//! with a struct literal naming every field, and every enum conversion is an exhaustive
//! `match` with no wildcard. A field or case added to, removed from or renamed in either
//! `wit/policy.wit` or [`crate::types`] without its counterpart is therefore a **compile
//! error** of this module (built by `cargo test -p gpuvisor-sdk --features v2` and by
//! `scripts/check-sdk-package`): that is the check the WIT header refers to.
//!
//! `params` is JSON object text in v2 (`{}` when absent) and a [`serde_json::Value`] in the
//! SDK: text that is not JSON gives the error reply `input does not decode: params: ...`,
//! as an undecodable v1 input does.

use crate::abi::{IntoReply, LogLevel};
use crate::types::{self as sdk, Reply};

/// The ABI version of a v2 manifest (`abi-version`), also the WIT package's major version.
pub const ABI_VERSION: u32 = 2;

/// The WIT file the bindings are generated from, as shipped in the crate (`wit/policy.wit`).
pub const WIT: &str = include_str!("../wit/policy.wit");

/// Bindings of the world `placement-plugin` (also the home of the shared `types` and `log`
/// interfaces, which the other two worlds reuse through `with`).
pub mod placement {
    wit_bindgen::generate!({
        path: "wit",
        world: "placement-plugin",
        // The export macro (`export!`) is used by plugin crates, and the full world's
        // `component-type` section is emitted where it is expanded: the SDK itself only
        // carries the worlds' imports, so one crate can hold the three worlds.
        pub_export_macro: true,
        default_bindings_module: "gpuvisor_sdk::v2::placement",
    });
}

/// Bindings of the world `hypervisor-plugin`.
pub mod hypervisor {
    wit_bindgen::generate!({
        path: "wit",
        world: "hypervisor-plugin",
        pub_export_macro: true,
        default_bindings_module: "gpuvisor_sdk::v2::hypervisor",
        with: {
            "gpuvisor:policy/types@2.0.0": crate::v2::placement::gpuvisor::policy::types,
            "gpuvisor:policy/log@2.0.0": crate::v2::placement::gpuvisor::policy::log,
        },
    });
}

/// Bindings of the world `grace-plugin`.
pub mod grace {
    wit_bindgen::generate!({
        path: "wit",
        world: "grace-plugin",
        pub_export_macro: true,
        default_bindings_module: "gpuvisor_sdk::v2::grace",
        with: {
            "gpuvisor:policy/types@2.0.0": crate::v2::placement::gpuvisor::policy::types,
            "gpuvisor:policy/log@2.0.0": crate::v2::placement::gpuvisor::policy::log,
        },
    });
}

/// The bindings' types by WIT interface: `wit::types`, `wit::log`, `wit::placement`,
/// `wit::hypervisor`, `wit::grace`.
pub mod wit {
    pub use super::grace::exports::gpuvisor::policy::grace;
    pub use super::hypervisor::exports::gpuvisor::policy::hypervisor;
    pub use super::placement::exports::gpuvisor::policy::placement;
    pub use super::placement::gpuvisor::policy::{log, types};
}

use wit::{grace as wg, hypervisor as wh, placement as wp, types as wt};

// ---------------------------------------------------------------------------------------
// the generated exports' runtime

/// Runs a policy function on a v2 input: converts the input to the SDK's type (an error
/// reply when `params` is not JSON), calls `f`, converts the answer back (an `Err` of `f`
/// becomes the `err` of the WIT result). Used by [`export_plugin_v2!`](crate::export_plugin_v2)
/// and by native tests, which exercise the same path as the wasm build.
pub fn dispatch<W, I, A, WA, R>(input: W, f: impl FnOnce(&I) -> R) -> Result<WA, String>
where
    I: TryFrom<W, Error = String>,
    R: IntoReply<A>,
    WA: From<A>,
{
    let input = I::try_from(input)?;
    match f(&input).into_reply() {
        Reply::Ok(answer) => Ok(WA::from(answer)),
        Reply::Error(message) => Err(message),
    }
}

/// The v2 manifest of a one-kind plugin (`abi-version` [`ABI_VERSION`]).
pub fn manifest(name: &str, version: &str, kind: sdk::PolicyKind) -> wt::Manifest {
    manifest_to_wit(&sdk::Manifest { name: name.to_string(), version: version.to_string(), kinds: vec![kind] })
}

/// An SDK manifest as the WIT record, with `abi-version` [`ABI_VERSION`].
pub fn manifest_to_wit(manifest: &sdk::Manifest) -> wt::Manifest {
    let sdk::Manifest { name, version, kinds } = manifest;
    wt::Manifest {
        name: name.clone(),
        version: version.clone(),
        kinds: kinds.iter().map(|k| wt::PolicyKind::from(*k)).collect(),
        abi_version: ABI_VERSION,
    }
}

/// A WIT manifest as the SDK's, with its `abi-version`.
pub fn manifest_from_wit(manifest: wt::Manifest) -> (sdk::Manifest, u32) {
    let wt::Manifest { name, version, kinds, abi_version } = manifest;
    (sdk::Manifest { name, version, kinds: kinds.into_iter().map(sdk::PolicyKind::from).collect() }, abi_version)
}

/// Sends one line to the agent's log through the v2 import `gpuvisor:policy/log@2.0.0`
/// (wasm32 only; natively it does nothing). [`crate::abi::log`] calls this with the
/// feature `v2`.
pub fn log(level: LogLevel, message: &str) {
    #[cfg(target_arch = "wasm32")]
    wit::log::log(level.into(), message);
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (level, message);
    }
}

// ---------------------------------------------------------------------------------------
// shared types

impl From<LogLevel> for wit::log::Level {
    fn from(level: LogLevel) -> Self {
        match level {
            LogLevel::Error => wit::log::Level::Error,
            LogLevel::Warn => wit::log::Level::Warn,
            LogLevel::Info => wit::log::Level::Info,
            LogLevel::Debug => wit::log::Level::Debug,
            LogLevel::Trace => wit::log::Level::Trace,
        }
    }
}

impl From<wit::log::Level> for LogLevel {
    fn from(level: wit::log::Level) -> Self {
        match level {
            wit::log::Level::Error => LogLevel::Error,
            wit::log::Level::Warn => LogLevel::Warn,
            wit::log::Level::Info => LogLevel::Info,
            wit::log::Level::Debug => LogLevel::Debug,
            wit::log::Level::Trace => LogLevel::Trace,
        }
    }
}

impl From<sdk::PolicyKind> for wt::PolicyKind {
    fn from(kind: sdk::PolicyKind) -> Self {
        match kind {
            sdk::PolicyKind::Placement => wt::PolicyKind::Placement,
            sdk::PolicyKind::Hypervisor => wt::PolicyKind::Hypervisor,
            sdk::PolicyKind::Grace => wt::PolicyKind::Grace,
        }
    }
}

impl From<wt::PolicyKind> for sdk::PolicyKind {
    fn from(kind: wt::PolicyKind) -> Self {
        match kind {
            wt::PolicyKind::Placement => sdk::PolicyKind::Placement,
            wt::PolicyKind::Hypervisor => sdk::PolicyKind::Hypervisor,
            wt::PolicyKind::Grace => sdk::PolicyKind::Grace,
        }
    }
}

impl From<sdk::Framework> for wt::Framework {
    fn from(f: sdk::Framework) -> Self {
        match f {
            sdk::Framework::VendorVfio => wt::Framework::VendorVfio,
            sdk::Framework::Mdev => wt::Framework::Mdev,
            sdk::Framework::Passthrough => wt::Framework::Passthrough,
        }
    }
}

impl From<wt::Framework> for sdk::Framework {
    fn from(f: wt::Framework) -> Self {
        match f {
            wt::Framework::VendorVfio => sdk::Framework::VendorVfio,
            wt::Framework::Mdev => sdk::Framework::Mdev,
            wt::Framework::Passthrough => sdk::Framework::Passthrough,
        }
    }
}

/// WIT labels (key/value pairs) as the SDK's map; a repeated key keeps its last value.
pub fn labels_from_wit(labels: wt::Labels) -> sdk::Labels {
    labels.into_iter().collect()
}

/// SDK labels as WIT key/value pairs, sorted by key.
pub fn labels_to_wit(labels: &sdk::Labels) -> wt::Labels {
    labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// WIT `params` (JSON text) as a JSON value. Errors: `input does not decode: params: ...`.
pub fn params_from_wit(params: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(params).map_err(|e| format!("input does not decode: params: {e}"))
}

/// SDK `params` as WIT JSON text; `null` (the SDK's value for absent params) is `{}`, as
/// the WIT says and the host sends.
pub fn params_to_wit(params: &serde_json::Value) -> wt::Params {
    if params.is_null() {
        "{}".to_string()
    } else {
        params.to_string()
    }
}

// ---------------------------------------------------------------------------------------
// placement

impl TryFrom<wp::PlacementInput> for sdk::PlacementInput {
    type Error = String;
    fn try_from(input: wp::PlacementInput) -> Result<Self, String> {
        let wp::PlacementInput { request, inventory, params } = input;
        Ok(sdk::PlacementInput {
            request: request.into(),
            inventory: inventory.into(),
            params: params_from_wit(&params)?,
        })
    }
}

impl From<&sdk::PlacementInput> for wp::PlacementInput {
    fn from(input: &sdk::PlacementInput) -> Self {
        let sdk::PlacementInput { request, inventory, params } = input;
        wp::PlacementInput { request: request.into(), inventory: inventory.into(), params: params_to_wit(params) }
    }
}

impl From<wp::PlacementRequest> for sdk::PlacementRequest {
    fn from(r: wp::PlacementRequest) -> Self {
        let wp::PlacementRequest { instance_id, name, labels, framework, profile, framebuffer_mib } = r;
        sdk::PlacementRequest {
            instance_id,
            name,
            labels: labels_from_wit(labels),
            framework: framework.into(),
            profile,
            framebuffer_mib,
        }
    }
}

impl From<&sdk::PlacementRequest> for wp::PlacementRequest {
    fn from(r: &sdk::PlacementRequest) -> Self {
        let sdk::PlacementRequest { instance_id, name, labels, framework, profile, framebuffer_mib } = r;
        wp::PlacementRequest {
            instance_id: instance_id.clone(),
            name: name.clone(),
            labels: labels_to_wit(labels),
            framework: (*framework).into(),
            profile: profile.clone(),
            framebuffer_mib: *framebuffer_mib,
        }
    }
}

impl From<wp::Inventory> for sdk::Inventory {
    fn from(i: wp::Inventory) -> Self {
        let wp::Inventory { gpus } = i;
        sdk::Inventory { gpus: gpus.into_iter().map(sdk::GpuView::from).collect() }
    }
}

impl From<&sdk::Inventory> for wp::Inventory {
    fn from(i: &sdk::Inventory) -> Self {
        let sdk::Inventory { gpus } = i;
        wp::Inventory { gpus: gpus.iter().map(wp::GpuView::from).collect() }
    }
}

impl From<wp::GpuView> for sdk::GpuView {
    fn from(g: wp::GpuView) -> Self {
        let wp::GpuView { address, model, framebuffer_mib, numa_node, claimed_framebuffer_mib, load_known, devices } =
            g;
        sdk::GpuView {
            address,
            model,
            framebuffer_mib,
            numa_node,
            claimed_framebuffer_mib,
            load_known,
            devices: devices.into_iter().map(sdk::DeviceView::from).collect(),
        }
    }
}

impl From<&sdk::GpuView> for wp::GpuView {
    fn from(g: &sdk::GpuView) -> Self {
        let sdk::GpuView { address, model, framebuffer_mib, numa_node, claimed_framebuffer_mib, load_known, devices } =
            g;
        wp::GpuView {
            address: address.clone(),
            model: model.clone(),
            framebuffer_mib: *framebuffer_mib,
            numa_node: *numa_node,
            claimed_framebuffer_mib: *claimed_framebuffer_mib,
            load_known: *load_known,
            devices: devices.iter().map(wp::DeviceView::from).collect(),
        }
    }
}

impl From<wp::DeviceState> for sdk::DeviceState {
    fn from(s: wp::DeviceState) -> Self {
        match s {
            wp::DeviceState::Free => sdk::DeviceState::Free,
            wp::DeviceState::Claimed => sdk::DeviceState::Claimed,
            wp::DeviceState::Dirty => sdk::DeviceState::Dirty,
            wp::DeviceState::Quarantined => sdk::DeviceState::Quarantined,
            wp::DeviceState::Unreadable => sdk::DeviceState::Unreadable,
        }
    }
}

impl From<sdk::DeviceState> for wp::DeviceState {
    fn from(s: sdk::DeviceState) -> Self {
        match s {
            sdk::DeviceState::Free => wp::DeviceState::Free,
            sdk::DeviceState::Claimed => wp::DeviceState::Claimed,
            sdk::DeviceState::Dirty => wp::DeviceState::Dirty,
            sdk::DeviceState::Quarantined => wp::DeviceState::Quarantined,
            sdk::DeviceState::Unreadable => wp::DeviceState::Unreadable,
        }
    }
}

impl From<wp::DeviceView> for sdk::DeviceView {
    fn from(d: wp::DeviceView) -> Self {
        let wp::DeviceView { address, state, current_type, creatable, owner } = d;
        sdk::DeviceView {
            address,
            state: state.into(),
            current_type,
            creatable,
            owner: owner.map(sdk::DeviceOwner::from),
        }
    }
}

impl From<&sdk::DeviceView> for wp::DeviceView {
    fn from(d: &sdk::DeviceView) -> Self {
        let sdk::DeviceView { address, state, current_type, creatable, owner } = d;
        wp::DeviceView {
            address: address.clone(),
            state: (*state).into(),
            current_type: *current_type,
            creatable: creatable.clone(),
            owner: owner.as_ref().map(wp::DeviceOwner::from),
        }
    }
}

impl From<wp::DeviceOwner> for sdk::DeviceOwner {
    fn from(o: wp::DeviceOwner) -> Self {
        let wp::DeviceOwner { instance_id, profile, labels, labels_known } = o;
        sdk::DeviceOwner { instance_id, profile, labels: labels_from_wit(labels), labels_known }
    }
}

impl From<&sdk::DeviceOwner> for wp::DeviceOwner {
    fn from(o: &sdk::DeviceOwner) -> Self {
        let sdk::DeviceOwner { instance_id, profile, labels, labels_known } = o;
        wp::DeviceOwner {
            instance_id: instance_id.clone(),
            profile: profile.clone(),
            labels: labels_to_wit(labels),
            labels_known: *labels_known,
        }
    }
}

impl From<sdk::PlacementAnswer> for wp::PlacementAnswer {
    fn from(a: sdk::PlacementAnswer) -> Self {
        match a {
            sdk::PlacementAnswer::Ranked(devices) => wp::PlacementAnswer::Ranked(devices),
            sdk::PlacementAnswer::Reject(why) => wp::PlacementAnswer::Reject(why),
        }
    }
}

impl From<wp::PlacementAnswer> for sdk::PlacementAnswer {
    fn from(a: wp::PlacementAnswer) -> Self {
        match a {
            wp::PlacementAnswer::Ranked(devices) => sdk::PlacementAnswer::Ranked(devices),
            wp::PlacementAnswer::Reject(why) => sdk::PlacementAnswer::Reject(why),
        }
    }
}

// ---------------------------------------------------------------------------------------
// hypervisor

impl TryFrom<wh::HypervisorInput> for sdk::HypervisorInput {
    type Error = String;
    fn try_from(input: wh::HypervisorInput) -> Result<Self, String> {
        let wh::HypervisorInput { request, hypervisors, params } = input;
        Ok(sdk::HypervisorInput {
            request: request.into(),
            hypervisors: hypervisors.into_iter().map(sdk::HypervisorInfo::from).collect(),
            params: params_from_wit(&params)?,
        })
    }
}

impl From<&sdk::HypervisorInput> for wh::HypervisorInput {
    fn from(input: &sdk::HypervisorInput) -> Self {
        let sdk::HypervisorInput { request, hypervisors, params } = input;
        wh::HypervisorInput {
            request: request.into(),
            hypervisors: hypervisors.iter().map(wh::HypervisorInfo::from).collect(),
            params: params_to_wit(params),
        }
    }
}

impl From<wh::HypervisorRequest> for sdk::HypervisorRequest {
    fn from(r: wh::HypervisorRequest) -> Self {
        let wh::HypervisorRequest { name, labels, requested_hypervisor, framework, devices } = r;
        sdk::HypervisorRequest {
            name,
            labels: labels_from_wit(labels),
            requested_hypervisor,
            framework: framework.map(sdk::Framework::from),
            devices,
        }
    }
}

impl From<&sdk::HypervisorRequest> for wh::HypervisorRequest {
    fn from(r: &sdk::HypervisorRequest) -> Self {
        let sdk::HypervisorRequest { name, labels, requested_hypervisor, framework, devices } = r;
        wh::HypervisorRequest {
            name: name.clone(),
            labels: labels_to_wit(labels),
            requested_hypervisor: requested_hypervisor.clone(),
            framework: framework.map(wt::Framework::from),
            devices: devices.clone(),
        }
    }
}

impl From<wh::Capability> for sdk::Capability {
    fn from(c: wh::Capability) -> Self {
        match c {
            wh::Capability::VendorVfio => sdk::Capability::VendorVfio,
            wh::Capability::Mdev => sdk::Capability::Mdev,
            wh::Capability::Passthrough => sdk::Capability::Passthrough,
            wh::Capability::Standby => sdk::Capability::Standby,
            wh::Capability::Snapshot => sdk::Capability::Snapshot,
        }
    }
}

impl From<sdk::Capability> for wh::Capability {
    fn from(c: sdk::Capability) -> Self {
        match c {
            sdk::Capability::VendorVfio => wh::Capability::VendorVfio,
            sdk::Capability::Mdev => wh::Capability::Mdev,
            sdk::Capability::Passthrough => wh::Capability::Passthrough,
            sdk::Capability::Standby => wh::Capability::Standby,
            sdk::Capability::Snapshot => wh::Capability::Snapshot,
        }
    }
}

impl From<wh::HypervisorInfo> for sdk::HypervisorInfo {
    fn from(h: wh::HypervisorInfo) -> Self {
        let wh::HypervisorInfo { name, available, capabilities } = h;
        sdk::HypervisorInfo {
            name,
            available,
            capabilities: capabilities.into_iter().map(sdk::Capability::from).collect(),
        }
    }
}

impl From<&sdk::HypervisorInfo> for wh::HypervisorInfo {
    fn from(h: &sdk::HypervisorInfo) -> Self {
        let sdk::HypervisorInfo { name, available, capabilities } = h;
        wh::HypervisorInfo {
            name: name.clone(),
            available: *available,
            capabilities: capabilities.iter().map(|c| wh::Capability::from(*c)).collect(),
        }
    }
}

impl From<sdk::HypervisorAnswer> for wh::HypervisorAnswer {
    fn from(a: sdk::HypervisorAnswer) -> Self {
        match a {
            sdk::HypervisorAnswer::Hypervisor(name) => wh::HypervisorAnswer::Hypervisor(name),
            sdk::HypervisorAnswer::Reject(why) => wh::HypervisorAnswer::Reject(why),
        }
    }
}

impl From<wh::HypervisorAnswer> for sdk::HypervisorAnswer {
    fn from(a: wh::HypervisorAnswer) -> Self {
        match a {
            wh::HypervisorAnswer::Hypervisor(name) => sdk::HypervisorAnswer::Hypervisor(name),
            wh::HypervisorAnswer::Reject(why) => sdk::HypervisorAnswer::Reject(why),
        }
    }
}

// ---------------------------------------------------------------------------------------
// grace

impl TryFrom<wg::GraceInput> for sdk::GraceInput {
    type Error = String;
    fn try_from(input: wg::GraceInput) -> Result<Self, String> {
        let wg::GraceInput { now_boottime_ms, boot_id, items, params } = input;
        Ok(sdk::GraceInput {
            now_boottime_ms,
            boot_id,
            items: items.into_iter().map(sdk::GraceItem::from).collect(),
            params: params_from_wit(&params)?,
        })
    }
}

impl From<&sdk::GraceInput> for wg::GraceInput {
    fn from(input: &sdk::GraceInput) -> Self {
        let sdk::GraceInput { now_boottime_ms, boot_id, items, params } = input;
        wg::GraceInput {
            now_boottime_ms: *now_boottime_ms,
            boot_id: boot_id.clone(),
            items: items.iter().map(wg::GraceItem::from).collect(),
            params: params_to_wit(params),
        }
    }
}

impl From<wg::GraceItemKind> for sdk::GraceItemKind {
    fn from(k: wg::GraceItemKind) -> Self {
        match k {
            wg::GraceItemKind::StaleClaim => sdk::GraceItemKind::StaleClaim,
            wg::GraceItemKind::OrphanVf => sdk::GraceItemKind::OrphanVf,
            wg::GraceItemKind::OrphanMdev => sdk::GraceItemKind::OrphanMdev,
        }
    }
}

impl From<sdk::GraceItemKind> for wg::GraceItemKind {
    fn from(k: sdk::GraceItemKind) -> Self {
        match k {
            sdk::GraceItemKind::StaleClaim => wg::GraceItemKind::StaleClaim,
            sdk::GraceItemKind::OrphanVf => wg::GraceItemKind::OrphanVf,
            sdk::GraceItemKind::OrphanMdev => wg::GraceItemKind::OrphanMdev,
        }
    }
}

impl From<wg::GraceItem> for sdk::GraceItem {
    fn from(i: wg::GraceItem) -> Self {
        let wg::GraceItem {
            kind,
            device,
            framework,
            owner,
            claimed_age_ms,
            dirty_age_ms,
            same_boot,
            release_attempts,
            last_error,
        } = i;
        sdk::GraceItem {
            kind: kind.into(),
            device,
            framework: framework.into(),
            owner: owner.map(sdk::GraceOwner::from),
            claimed_age_ms,
            dirty_age_ms,
            same_boot,
            release_attempts,
            last_error,
        }
    }
}

impl From<&sdk::GraceItem> for wg::GraceItem {
    fn from(i: &sdk::GraceItem) -> Self {
        let sdk::GraceItem {
            kind,
            device,
            framework,
            owner,
            claimed_age_ms,
            dirty_age_ms,
            same_boot,
            release_attempts,
            last_error,
        } = i;
        wg::GraceItem {
            kind: (*kind).into(),
            device: device.clone(),
            framework: (*framework).into(),
            owner: owner.as_ref().map(wg::GraceOwner::from),
            claimed_age_ms: *claimed_age_ms,
            dirty_age_ms: *dirty_age_ms,
            same_boot: *same_boot,
            release_attempts: *release_attempts,
            last_error: last_error.clone(),
        }
    }
}

impl From<wg::GraceOwner> for sdk::GraceOwner {
    fn from(o: wg::GraceOwner) -> Self {
        let wg::GraceOwner { instance_id, state, labels, vmm_identity_recorded } = o;
        sdk::GraceOwner { instance_id, state, labels: labels_from_wit(labels), vmm_identity_recorded }
    }
}

impl From<&sdk::GraceOwner> for wg::GraceOwner {
    fn from(o: &sdk::GraceOwner) -> Self {
        let sdk::GraceOwner { instance_id, state, labels, vmm_identity_recorded } = o;
        wg::GraceOwner {
            instance_id: instance_id.clone(),
            state: state.clone(),
            labels: labels_to_wit(labels),
            vmm_identity_recorded: *vmm_identity_recorded,
        }
    }
}

impl From<sdk::GraceAction> for wg::GraceAction {
    fn from(a: sdk::GraceAction) -> Self {
        match a {
            sdk::GraceAction::Release => wg::GraceAction::Release,
            sdk::GraceAction::Keep => wg::GraceAction::Keep,
        }
    }
}

impl From<wg::GraceAction> for sdk::GraceAction {
    fn from(a: wg::GraceAction) -> Self {
        match a {
            wg::GraceAction::Release => sdk::GraceAction::Release,
            wg::GraceAction::Keep => sdk::GraceAction::Keep,
        }
    }
}

impl From<sdk::GraceDecision> for wg::GraceDecision {
    fn from(d: sdk::GraceDecision) -> Self {
        let sdk::GraceDecision { device, action, recheck_after_ms, reason } = d;
        wg::GraceDecision { device, action: action.into(), recheck_after_ms, reason }
    }
}

impl From<wg::GraceDecision> for sdk::GraceDecision {
    fn from(d: wg::GraceDecision) -> Self {
        let wg::GraceDecision { device, action, recheck_after_ms, reason } = d;
        sdk::GraceDecision { device, action: action.into(), recheck_after_ms, reason }
    }
}

impl From<sdk::GraceAnswer> for wg::GraceAnswer {
    fn from(a: sdk::GraceAnswer) -> Self {
        let sdk::GraceAnswer { decisions } = a;
        wg::GraceAnswer { decisions: decisions.into_iter().map(wg::GraceDecision::from).collect() }
    }
}

impl From<wg::GraceAnswer> for sdk::GraceAnswer {
    fn from(a: wg::GraceAnswer) -> Self {
        let wg::GraceAnswer { decisions } = a;
        sdk::GraceAnswer { decisions: decisions.into_iter().map(sdk::GraceDecision::from).collect() }
    }
}

/// Generates the ABI v2 exports of a one-kind plugin component (wasm32 only): the world's
/// `manifest` (with `abi-version: 2`) and the kind's interface, through the bindings'
/// `export!`. Same arguments as [`export_plugin!`](crate::export_plugin) but exactly one
/// of `placement:`, `hypervisor:` or `grace:`, a function `fn(&XInput) -> R` with `R` the
/// answer or `Result<answer, E: Display>` (an `Err` becomes the WIT result's `err`).
///
/// ```ignore
/// gpuvisor_sdk::export_plugin_v2! {
///     name: "grace-default",
///     version: env!("CARGO_PKG_VERSION"),
///     grace: crate::decide,
/// }
/// ```
#[macro_export]
macro_rules! export_plugin_v2 {
    (name: $name:expr, version: $version:expr, placement: $f:path $(,)?) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        pub mod __gpuvisor_plugin_v2_exports {
            #[allow(unused_imports)]
            use super::*;

            /// The type the bindings' traits are implemented for.
            pub struct Plugin;

            impl $crate::v2::placement::Guest for Plugin {
                fn manifest() -> $crate::v2::wit::types::Manifest {
                    $crate::v2::manifest($name, $version, $crate::PolicyKind::Placement)
                }
            }

            impl $crate::v2::wit::placement::Guest for Plugin {
                fn place(
                    input: $crate::v2::wit::placement::PlacementInput,
                ) -> ::std::result::Result<$crate::v2::wit::placement::PlacementAnswer, ::std::string::String> {
                    $crate::v2::dispatch::<_, $crate::PlacementInput, $crate::PlacementAnswer, _, _>(input, $f)
                }
            }

            $crate::v2::placement::export!(Plugin with_types_in $crate::v2::placement);
        }
    };
    (name: $name:expr, version: $version:expr, hypervisor: $f:path $(,)?) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        pub mod __gpuvisor_plugin_v2_exports {
            #[allow(unused_imports)]
            use super::*;

            /// The type the bindings' traits are implemented for.
            pub struct Plugin;

            impl $crate::v2::hypervisor::Guest for Plugin {
                fn manifest() -> $crate::v2::wit::types::Manifest {
                    $crate::v2::manifest($name, $version, $crate::PolicyKind::Hypervisor)
                }
            }

            impl $crate::v2::wit::hypervisor::Guest for Plugin {
                fn choose(
                    input: $crate::v2::wit::hypervisor::HypervisorInput,
                ) -> ::std::result::Result<$crate::v2::wit::hypervisor::HypervisorAnswer, ::std::string::String> {
                    $crate::v2::dispatch::<_, $crate::HypervisorInput, $crate::HypervisorAnswer, _, _>(input, $f)
                }
            }

            $crate::v2::hypervisor::export!(Plugin with_types_in $crate::v2::hypervisor);
        }
    };
    (name: $name:expr, version: $version:expr, grace: $f:path $(,)?) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        pub mod __gpuvisor_plugin_v2_exports {
            #[allow(unused_imports)]
            use super::*;

            /// The type the bindings' traits are implemented for.
            pub struct Plugin;

            impl $crate::v2::grace::Guest for Plugin {
                fn manifest() -> $crate::v2::wit::types::Manifest {
                    $crate::v2::manifest($name, $version, $crate::PolicyKind::Grace)
                }
            }

            impl $crate::v2::wit::grace::Guest for Plugin {
                fn decide(
                    input: $crate::v2::wit::grace::GraceInput,
                ) -> ::std::result::Result<$crate::v2::wit::grace::GraceAnswer, ::std::string::String> {
                    $crate::v2::dispatch::<_, $crate::GraceInput, $crate::GraceAnswer, _, _>(input, $f)
                }
            }

            $crate::v2::grace::export!(Plugin with_types_in $crate::v2::grace);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::*;
    use serde_json::json;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Every field set, optional ones both ways.
    fn placement_input() -> PlacementInput {
        PlacementInput {
            request: PlacementRequest {
                instance_id: "i-1".into(),
                name: "web".into(),
                labels: labels(&[("tenant", "acme"), ("env", "prod")]),
                framework: Framework::VendorVfio,
                profile: "L40S-2Q".into(),
                framebuffer_mib: Some(2048),
            },
            inventory: Inventory {
                gpus: vec![
                    GpuView {
                        address: "0000:41:00.0".into(),
                        model: "NVIDIA L40S".into(),
                        framebuffer_mib: Some(49152),
                        numa_node: Some(-1),
                        claimed_framebuffer_mib: 2048,
                        load_known: false,
                        devices: vec![
                            DeviceView {
                                address: "0000:41:00.4".into(),
                                state: DeviceState::Claimed,
                                current_type: Some(1155),
                                creatable: vec![],
                                owner: Some(DeviceOwner {
                                    instance_id: "i-0".into(),
                                    profile: Some("L40S-2Q".into()),
                                    labels: labels(&[("tenant", "other")]),
                                    labels_known: true,
                                }),
                            },
                            DeviceView {
                                address: "0000:41:00.5".into(),
                                state: DeviceState::Claimed,
                                current_type: None,
                                creatable: vec![],
                                owner: Some(DeviceOwner {
                                    instance_id: String::new(),
                                    profile: None,
                                    labels: Labels::new(),
                                    labels_known: false,
                                }),
                            },
                            DeviceView {
                                address: "0000:41:00.6".into(),
                                state: DeviceState::Free,
                                current_type: None,
                                creatable: vec!["L40S-2Q".into(), "L40S-4Q".into()],
                                owner: None,
                            },
                        ],
                    },
                    GpuView {
                        address: "0001:81:00.0".into(),
                        model: "unknown".into(),
                        framebuffer_mib: None,
                        numa_node: None,
                        claimed_framebuffer_mib: 0,
                        load_known: true,
                        devices: [DeviceState::Dirty, DeviceState::Quarantined, DeviceState::Unreadable]
                            .into_iter()
                            .enumerate()
                            .map(|(n, state)| DeviceView {
                                address: format!("0001:81:00.{}", n + 4),
                                state,
                                current_type: None,
                                creatable: vec![],
                                owner: None,
                            })
                            .collect(),
                    },
                ],
            },
            params: json!({"spread": {"numa": true}, "weights": [1, 2.5], "name": "x"}),
        }
    }

    fn hypervisor_input() -> HypervisorInput {
        HypervisorInput {
            request: HypervisorRequest {
                name: "db".into(),
                labels: labels(&[("tenant", "acme")]),
                requested_hypervisor: Some("cloud-hypervisor".into()),
                framework: Some(Framework::Passthrough),
                devices: vec!["0000:41:00.0".into()],
            },
            hypervisors: vec![
                HypervisorInfo {
                    name: "qemu".into(),
                    available: true,
                    capabilities: vec![
                        Capability::VendorVfio,
                        Capability::Mdev,
                        Capability::Passthrough,
                        Capability::Standby,
                        Capability::Snapshot,
                    ],
                },
                HypervisorInfo { name: "cloud-hypervisor".into(), available: false, capabilities: vec![] },
            ],
            params: json!({}),
        }
    }

    fn grace_input() -> GraceInput {
        GraceInput {
            now_boottime_ms: 7_200_000,
            boot_id: "3f1d6c2e".into(),
            items: vec![
                GraceItem {
                    kind: GraceItemKind::StaleClaim,
                    device: "0000:41:00.4".into(),
                    framework: Framework::VendorVfio,
                    owner: Some(GraceOwner {
                        instance_id: "i-stopped".into(),
                        state: "stopped".into(),
                        labels: labels(&[("tenant", "acme")]),
                        vmm_identity_recorded: true,
                    }),
                    claimed_age_ms: Some(20_000),
                    dirty_age_ms: None,
                    same_boot: true,
                    release_attempts: 3,
                    last_error: Some("EBUSY".into()),
                },
                GraceItem {
                    kind: GraceItemKind::OrphanVf,
                    device: "0000:41:00.5".into(),
                    framework: Framework::VendorVfio,
                    owner: None,
                    claimed_age_ms: None,
                    dirty_age_ms: Some(90_000),
                    same_boot: false,
                    release_attempts: 0,
                    last_error: None,
                },
                GraceItem {
                    kind: GraceItemKind::OrphanMdev,
                    device: "0000:41:00.0/uuid".into(),
                    framework: Framework::Mdev,
                    owner: None,
                    claimed_age_ms: None,
                    dirty_age_ms: Some(1),
                    same_boot: true,
                    release_attempts: 1,
                    last_error: None,
                },
            ],
            params: json!({"claim_grace_s": 30}),
        }
    }

    #[test]
    fn a_placement_input_survives_the_round_trip_through_wit() {
        let input = placement_input();
        let w = wp::PlacementInput::from(&input);
        // Labels are pairs sorted by key; params JSON text.
        assert_eq!(w.request.labels, vec![("env".into(), "prod".into()), ("tenant".into(), "acme".into())]);
        assert_eq!(w.request.framework, wt::Framework::VendorVfio);
        assert_eq!(w.inventory.gpus[0].devices[2].state, wp::DeviceState::Free);
        assert_eq!(serde_json::from_str::<serde_json::Value>(&w.params).unwrap(), input.params);
        assert_eq!(PlacementInput::try_from(w).unwrap(), input);
    }

    #[test]
    fn a_hypervisor_input_survives_the_round_trip_through_wit() {
        let mut input = hypervisor_input();
        let w = wh::HypervisorInput::from(&input);
        assert_eq!(w.params, "{}");
        assert_eq!(w.hypervisors[0].capabilities.len(), 5);
        assert_eq!(HypervisorInput::try_from(w).unwrap(), input);
        input.request.framework = None;
        input.request.requested_hypervisor = None;
        input.request.devices.clear();
        assert_eq!(HypervisorInput::try_from(wh::HypervisorInput::from(&input)).unwrap(), input);
    }

    #[test]
    fn a_grace_input_survives_the_round_trip_through_wit() {
        let input = grace_input();
        let w = wg::GraceInput::from(&input);
        assert_eq!(w.items[2].kind, wg::GraceItemKind::OrphanMdev);
        assert_eq!(GraceInput::try_from(w).unwrap(), input);
    }

    #[test]
    fn absent_params_are_an_empty_object_in_wit() {
        // The SDK decodes absent v1 params as null; the WIT says `{}` when absent.
        let mut input = grace_input();
        input.params = serde_json::Value::Null;
        let w = wg::GraceInput::from(&input);
        assert_eq!(w.params, "{}");
        assert_eq!(GraceInput::try_from(w).unwrap().params, json!({}));
    }

    #[test]
    fn repeated_label_keys_keep_the_last_value() {
        let l = labels_from_wit(vec![("a".into(), "1".into()), ("b".into(), "2".into()), ("a".into(), "3".into())]);
        assert_eq!(l, labels(&[("a", "3"), ("b", "2")]));
    }

    #[test]
    fn params_that_are_not_json_give_an_error_reply_without_calling_the_policy() {
        let mut w = wp::PlacementInput::from(&placement_input());
        w.params = "{not json".into();
        let out: Result<wp::PlacementAnswer, String> =
            dispatch::<_, PlacementInput, PlacementAnswer, _, _>(w, |_: &PlacementInput| -> PlacementAnswer {
                panic!("called on an input that does not decode")
            });
        let e = out.err().unwrap();
        assert!(e.starts_with("input does not decode: params: "), "{e}");
    }

    #[test]
    fn dispatch_converts_answers_and_errors() {
        let w = wp::PlacementInput::from(&placement_input());
        let out: Result<wp::PlacementAnswer, String> =
            dispatch::<_, PlacementInput, PlacementAnswer, _, _>(w, |i: &PlacementInput| {
                PlacementAnswer::Ranked(vec![i.inventory.gpus[0].devices[2].address.clone()])
            });
        assert!(matches!(out, Ok(wp::PlacementAnswer::Ranked(r)) if r == ["0000:41:00.6"]));

        let w = wh::HypervisorInput::from(&hypervisor_input());
        let out: Result<wh::HypervisorAnswer, String> =
            dispatch::<_, HypervisorInput, HypervisorAnswer, _, _>(w, |_: &HypervisorInput| {
                Err::<HypervisorAnswer, _>("no hypervisor")
            });
        assert_eq!(out.err().as_deref(), Some("no hypervisor"));

        let w = wg::GraceInput::from(&grace_input());
        let out: Result<wg::GraceAnswer, String> = dispatch::<_, GraceInput, GraceAnswer, _, _>(w, |i: &GraceInput| {
            Ok::<_, String>(GraceAnswer {
                decisions: vec![GraceDecision {
                    device: i.items[0].device.clone(),
                    action: GraceAction::Release,
                    recheck_after_ms: None,
                    reason: "owner stopped".into(),
                }],
            })
        });
        let a = GraceAnswer::from(out.unwrap());
        assert_eq!(a.decisions[0].device, "0000:41:00.4");
        assert_eq!(a.decisions[0].action, GraceAction::Release);
    }

    #[test]
    fn answers_survive_the_round_trip_through_wit() {
        for a in [PlacementAnswer::Ranked(vec!["a".into(), "b".into()]), PlacementAnswer::Reject("full".into())] {
            assert_eq!(PlacementAnswer::from(wp::PlacementAnswer::from(a.clone())), a);
        }
        for a in [HypervisorAnswer::Hypervisor("qemu".into()), HypervisorAnswer::Reject("none".into())] {
            assert_eq!(HypervisorAnswer::from(wh::HypervisorAnswer::from(a.clone())), a);
        }
        let a = GraceAnswer {
            decisions: vec![
                GraceDecision {
                    device: "d0".into(),
                    action: GraceAction::Keep,
                    recheck_after_ms: Some(5000),
                    reason: "young".into(),
                },
                GraceDecision {
                    device: "d1".into(),
                    action: GraceAction::Release,
                    recheck_after_ms: None,
                    reason: String::new(),
                },
            ],
        };
        assert_eq!(GraceAnswer::from(wg::GraceAnswer::from(a.clone())), a);
    }

    #[test]
    fn the_manifest_has_abi_version_2_and_one_kind() {
        let m = manifest("grace-default", "0.1.0", PolicyKind::Grace);
        assert_eq!(m.abi_version, 2);
        assert_eq!(m.kinds, vec![wt::PolicyKind::Grace]);
        let (sdk, abi) = manifest_from_wit(m);
        assert_eq!(abi, super::ABI_VERSION);
        assert_eq!(
            sdk,
            Manifest { name: "grace-default".into(), version: "0.1.0".into(), kinds: vec![PolicyKind::Grace] }
        );
    }

    #[test]
    fn log_levels_map_one_to_one_and_log_is_a_no_op_natively() {
        for l in [LogLevel::Error, LogLevel::Warn, LogLevel::Info, LogLevel::Debug, LogLevel::Trace] {
            let w = wit::log::Level::from(l);
            assert_eq!(w as i32, l as i32, "the v1 and v2 levels have the same order");
            assert_eq!(LogLevel::from(w), l);
        }
        crate::abi::log(LogLevel::Info, "natively nothing happens");
    }

    #[test]
    fn the_shipped_wit_is_the_package_the_bindings_name() {
        assert!(WIT.contains("package gpuvisor:policy@2.0.0;"));
        for world in ["placement-plugin", "hypervisor-plugin", "grace-plugin"] {
            assert!(WIT.contains(&format!("world {world} {{")), "{world}");
        }
    }
}
