//! ABI v2: policy plugins as WebAssembly components of the WIT package
//! `gpuvisor:policy@2.0.0` (`sdk/wit/policy.wit`).
//!
//! What this module adds to the one plugin host ([`crate::Plugin`]): telling a component
//! from a core module, the load-time checks of a component (its imports, its exports and
//! their version, its manifest), the typed calls, and WASI that grants nothing. Everything
//! else — fuel, the memory limiter, the epoch deadline, size limits, the per-call store, the
//! log budget, error classification and stats — is the host's one sequence in `plugin.rs`.
//!
//! WASI (for guests built by componentize-py, componentize-js and other toolchains): every
//! WASI 0.2 interface wasmtime-wasi implements is linked, granting nothing and never
//! waiting (`wasi.rs`). Any other import is refused at load.

use crate::error::{CallError, LoadError};
use crate::plugin::{CallState, LogLevel};
use gpuvisor_sdk as sdk;
use gpuvisor_sdk::PolicyKind;
use std::path::Path;
use wasmtime::component::{Component, HasSelf, InstancePre, Linker};
use wasmtime::{Engine, Store};

/// The generated host bindings of the three worlds. `types` and `log` are generated once
/// (in `placement`) and shared.
#[allow(clippy::all, missing_docs)]
pub(crate) mod bindings {
    pub(crate) mod placement {
        wasmtime::component::bindgen!({ path: "../../sdk/wit", world: "placement-plugin" });
    }
    pub(crate) mod hypervisor {
        wasmtime::component::bindgen!({
            path: "../../sdk/wit",
            world: "hypervisor-plugin",
            with: {
                "gpuvisor:policy/types": super::placement::gpuvisor::policy::types,
                "gpuvisor:policy/log": super::placement::gpuvisor::policy::log,
            },
        });
    }
    pub(crate) mod grace {
        wasmtime::component::bindgen!({
            path: "../../sdk/wit",
            world: "grace-plugin",
            with: {
                "gpuvisor:policy/types": super::placement::gpuvisor::policy::types,
                "gpuvisor:policy/log": super::placement::gpuvisor::policy::log,
            },
        });
    }
}

use bindings::grace::exports::gpuvisor::policy::grace as wg;
use bindings::hypervisor::exports::gpuvisor::policy::hypervisor as wh;
use bindings::placement::exports::gpuvisor::policy::placement as wp;
use bindings::placement::gpuvisor::policy::{log as wit_log, types as wit};

/// The WIT package a v2 plugin's interfaces belong to.
pub const PACKAGE: &str = "gpuvisor:policy";
/// The version of that package this host speaks.
pub const PACKAGE_VERSION: &str = "2.0.0";
/// The `abi-version` a v2 manifest must carry.
pub const ABI_VERSION_V2: u32 = 2;

/// The WASI 0.2 packages linked (each granting nothing); any other import is refused.
const WASI_PACKAGES: [&str; 6] =
    ["wasi:cli/", "wasi:clocks/", "wasi:filesystem/", "wasi:io/", "wasi:random/", "wasi:sockets/"];

/// True when `bytes` (binary wasm) is a component rather than a core module: the
/// preamble's version/layer field is `0x0d 0x00` / `0x01 0x00`.
pub(crate) fn is_component(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && bytes[..4] == *b"\0asm" && bytes[4..8] == [0x0d, 0x00, 0x01, 0x00]
}

/// A compiled, checked, linked component.
pub(crate) struct Compiled {
    placement: Option<bindings::placement::PlacementPluginPre<CallState>>,
    hypervisor: Option<bindings::hypervisor::HypervisorPluginPre<CallState>>,
    grace: Option<bindings::grace::GracePluginPre<CallState>>,
    pre: InstancePre<CallState>,
}

/// The kind of a `gpuvisor:policy/<kind>` interface name.
fn kind_of_interface(interface: &str) -> Option<PolicyKind> {
    match interface {
        "placement" => Some(PolicyKind::Placement),
        "hypervisor" => Some(PolicyKind::Hypervisor),
        "grace" => Some(PolicyKind::Grace),
        _ => None,
    }
}

/// Splits `gpuvisor:policy/placement@2.0.0` into `("placement", Some("2.0.0"))`.
fn policy_interface(name: &str) -> Option<(&str, Option<&str>)> {
    let rest = name.strip_prefix(PACKAGE)?.strip_prefix('/')?;
    Some(match rest.split_once('@') {
        Some((interface, version)) => (interface, Some(version)),
        None => (rest, None),
    })
}

fn wrong_version(path: &Path, name: &str) -> LoadError {
    LoadError::WitVersion { path: path.to_path_buf(), name: name.to_string(), expected: PACKAGE_VERSION }
}

/// Checks a component from its binary, before it is compiled (compiling a language
/// toolchain's guest takes seconds; a refused one is refused at once): its top-level
/// imports (only `gpuvisor:policy/{log,types}@2.0.0` and the WASI packages) and exports
/// (`manifest` and at least one kind interface, all at [`PACKAGE_VERSION`]). Returns the
/// kinds it exports, sorted. Errors: [`LoadError`] naming the import or export, or
/// `Compile` for a binary that does not parse.
pub(crate) fn inspect(path: &Path, bytes: &[u8]) -> Result<Vec<PolicyKind>, LoadError> {
    use wasmtime::wasmparser::{ComponentTypeRef, Parser, Payload};
    let p = || path.to_path_buf();
    let malformed =
        |e: wasmtime::wasmparser::BinaryReaderError| LoadError::Compile { path: p(), reason: e.to_string() };
    let (mut imports, mut exports) = (Vec::new(), Vec::new());
    // Nested modules and components come inline, each closed by its own `End`.
    let mut depth = 0u32;
    for payload in Parser::new(0).parse_all(bytes) {
        match payload.map_err(malformed)? {
            Payload::ModuleSection { .. } | Payload::ComponentSection { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::ComponentImportSection(r) if depth == 0 => {
                for import in r {
                    let import = import.map_err(malformed)?;
                    // A type (e.g. the world's `use types.{manifest}`) grants nothing.
                    if !matches!(import.ty, ComponentTypeRef::Type(_)) {
                        imports.push(import.name.name.to_string());
                    }
                }
            }
            Payload::ComponentExportSection(r) if depth == 0 => {
                for export in r {
                    exports.push(export.map_err(malformed)?.name.name.to_string());
                }
            }
            _ => {}
        }
    }
    for name in &imports {
        if let Some((interface, version)) = policy_interface(name) {
            if version != Some(PACKAGE_VERSION) {
                return Err(wrong_version(path, name));
            }
            if interface == "log" || interface == "types" {
                continue;
            }
            return Err(LoadError::ForbiddenImport { path: p(), module: name.to_string(), name: String::new() });
        }
        if name.starts_with("wasi:") {
            if WASI_PACKAGES.iter().any(|w| name.starts_with(w)) {
                continue;
            }
            return Err(LoadError::WasiNotGranted { path: p(), name: name.to_string() });
        }
        return Err(LoadError::ForbiddenImport { path: p(), module: name.to_string(), name: String::new() });
    }
    let mut kinds = Vec::new();
    let mut has_manifest = false;
    for name in &exports {
        if name == "manifest" {
            has_manifest = true;
            continue;
        }
        if let Some((interface, version)) = policy_interface(name) {
            if version != Some(PACKAGE_VERSION) {
                return Err(wrong_version(path, name));
            }
            if let Some(kind) = kind_of_interface(interface) {
                kinds.push(kind);
            }
        }
    }
    if !has_manifest {
        return Err(LoadError::MissingExport { path: p(), export: "manifest", expected: "func() -> manifest" });
    }
    if kinds.is_empty() {
        return Err(LoadError::MissingExport {
            path: p(),
            export: "gpuvisor:policy/<kind>@2.0.0",
            expected: "one of the interfaces placement, hypervisor, grace",
        });
    }
    kinds.sort();
    kinds.dedup();
    Ok(kinds)
}

/// Links a compiled component that [`inspect`] accepted, exporting `kinds`; the manifest
/// is checked by the caller after [`Compiled::manifest`].
pub(crate) fn compile(
    engine: &Engine,
    path: &Path,
    component: Component,
    kinds: &[PolicyKind],
) -> Result<Compiled, LoadError> {
    let p = || path.to_path_buf();

    let link_err = |e: wasmtime::Error| LoadError::Link { path: p(), reason: format!("{e:#}") };
    let mut linker: Linker<CallState> = Linker::new(engine);
    crate::wasi::add_to_linker(&mut linker).map_err(link_err)?;
    bindings::placement::PlacementPlugin::add_to_linker::<CallState, HasSelf<CallState>>(&mut linker, |s| s)
        .map_err(link_err)?;
    let pre = linker.instantiate_pre(&component).map_err(link_err)?;
    let exports = |kind| kinds.contains(&kind);
    let compiled = Compiled {
        placement: if exports(PolicyKind::Placement) {
            Some(bindings::placement::PlacementPluginPre::new(pre.clone()).map_err(link_err)?)
        } else {
            None
        },
        hypervisor: if exports(PolicyKind::Hypervisor) {
            Some(bindings::hypervisor::HypervisorPluginPre::new(pre.clone()).map_err(link_err)?)
        } else {
            None
        },
        grace: if exports(PolicyKind::Grace) {
            Some(bindings::grace::GracePluginPre::new(pre.clone()).map_err(link_err)?)
        } else {
            None
        },
        pre,
    };
    Ok(compiled)
}

/// An instantiation that failed for another reason than a trap of the guest (e.g. the
/// pool): reported as what it is ([`CallError::Instantiate`]), never as the plugin's trap.
#[derive(Debug)]
pub(crate) struct InstantiateFailed(pub(crate) String);

impl std::fmt::Display for InstantiateFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InstantiateFailed {}

fn instantiating(e: wasmtime::Error) -> wasmtime::Error {
    if e.is::<wasmtime::Trap>() {
        e
    } else {
        wasmtime::Error::new(InstantiateFailed(format!("{e:#}")))
    }
}

/// A typed v2 answer, before it is handed back as the caller's type.
pub(crate) enum Answer {
    Placement(sdk::PlacementAnswer),
    Hypervisor(sdk::HypervisorAnswer),
    Grace(sdk::GraceAnswer),
}

/// A typed v2 input.
pub(crate) enum Input<'a> {
    Placement(&'a sdk::PlacementInput),
    Hypervisor(&'a sdk::HypervisorInput),
    Grace(&'a sdk::GraceInput),
}

impl Compiled {
    /// Instantiates the component in `store` and calls `manifest`.
    pub(crate) fn manifest(&self, store: &mut Store<CallState>) -> wasmtime::Result<(sdk::Manifest, u32)> {
        let instance = self.pre.instantiate(&mut *store).map_err(instantiating)?;
        let func = instance.get_typed_func::<(), (wit::Manifest,)>(&mut *store, "manifest")?;
        let (m,) = func.call(&mut *store, ())?;
        let kinds = m
            .kinds
            .iter()
            .map(|k| match k {
                wit::PolicyKind::Placement => PolicyKind::Placement,
                wit::PolicyKind::Hypervisor => PolicyKind::Hypervisor,
                wit::PolicyKind::Grace => PolicyKind::Grace,
            })
            .collect();
        Ok((sdk::Manifest { name: m.name, version: m.version, kinds }, m.abi_version))
    }

    /// Instantiates the component in `store` and calls the input's kind. `Ok(Err(message))`
    /// is the plugin's own `err`. The caller checked the kind is exported.
    pub(crate) fn call(
        &self,
        store: &mut Store<CallState>,
        input: Input<'_>,
    ) -> wasmtime::Result<Result<Answer, String>> {
        let missing = || wasmtime::format_err!("the component does not export this kind");
        Ok(match input {
            Input::Placement(i) => {
                let plugin =
                    self.placement.as_ref().ok_or_else(missing)?.instantiate(&mut *store).map_err(instantiating)?;
                plugin
                    .gpuvisor_policy_placement()
                    .call_place(&mut *store, &placement_input(i))?
                    .map(|a| Answer::Placement(placement_answer(a)))
            }
            Input::Hypervisor(i) => {
                let plugin =
                    self.hypervisor.as_ref().ok_or_else(missing)?.instantiate(&mut *store).map_err(instantiating)?;
                plugin
                    .gpuvisor_policy_hypervisor()
                    .call_choose(&mut *store, &hypervisor_input(i))?
                    .map(|a| Answer::Hypervisor(hypervisor_answer(a)))
            }
            Input::Grace(i) => {
                let plugin =
                    self.grace.as_ref().ok_or_else(missing)?.instantiate(&mut *store).map_err(instantiating)?;
                plugin
                    .gpuvisor_policy_grace()
                    .call_decide(&mut *store, &grace_input(i))?
                    .map(|a| Answer::Grace(grace_answer(a)))
            }
        })
    }
}

// ---------------------------------------------------------------------------------------
// the log import

impl wit_log::Host for CallState {
    fn log(&mut self, level: wit_log::Level, message: String) {
        let level = match level {
            wit_log::Level::Error => LogLevel::Error,
            wit_log::Level::Warn => LogLevel::Warn,
            wit_log::Level::Info => LogLevel::Info,
            wit_log::Level::Debug => LogLevel::Debug,
            wit_log::Level::Trace => LogLevel::Trace,
        };
        self.log.line(level, message);
    }
}

impl wit::Host for CallState {}

/// The error of a v2 call the host could not classify.
pub(crate) fn not_exported(plugin: &str, kind: PolicyKind) -> CallError {
    CallError::NotProvided { plugin: plugin.to_string(), kind }
}

// ---------------------------------------------------------------------------------------
// SDK types <-> WIT types. Struct literals name every field, so a field added on one side
// and not the other does not compile.

fn labels(l: &sdk::Labels) -> Vec<(String, String)> {
    l.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn params(p: &serde_json::Value) -> String {
    if p.is_null() {
        "{}".to_string()
    } else {
        p.to_string()
    }
}

fn framework(f: sdk::Framework) -> wit::Framework {
    match f {
        sdk::Framework::VendorVfio => wit::Framework::VendorVfio,
        sdk::Framework::Mdev => wit::Framework::Mdev,
        sdk::Framework::Passthrough => wit::Framework::Passthrough,
    }
}

fn placement_input(i: &sdk::PlacementInput) -> wp::PlacementInput {
    let r = &i.request;
    wp::PlacementInput {
        request: wp::PlacementRequest {
            instance_id: r.instance_id.clone(),
            name: r.name.clone(),
            labels: labels(&r.labels),
            framework: framework(r.framework),
            profile: r.profile.clone(),
            framebuffer_mib: r.framebuffer_mib,
        },
        inventory: wp::Inventory {
            gpus: i
                .inventory
                .gpus
                .iter()
                .map(|g| wp::GpuView {
                    address: g.address.clone(),
                    model: g.model.clone(),
                    framebuffer_mib: g.framebuffer_mib,
                    numa_node: g.numa_node,
                    claimed_framebuffer_mib: g.claimed_framebuffer_mib,
                    load_known: g.load_known,
                    devices: g
                        .devices
                        .iter()
                        .map(|d| wp::DeviceView {
                            address: d.address.clone(),
                            state: match d.state {
                                sdk::DeviceState::Free => wp::DeviceState::Free,
                                sdk::DeviceState::Claimed => wp::DeviceState::Claimed,
                                sdk::DeviceState::Dirty => wp::DeviceState::Dirty,
                                sdk::DeviceState::Quarantined => wp::DeviceState::Quarantined,
                                sdk::DeviceState::Unreadable => wp::DeviceState::Unreadable,
                            },
                            current_type: d.current_type,
                            creatable: d.creatable.clone(),
                            owner: d.owner.as_ref().map(|o| wp::DeviceOwner {
                                instance_id: o.instance_id.clone(),
                                profile: o.profile.clone(),
                                labels: labels(&o.labels),
                                labels_known: o.labels_known,
                            }),
                        })
                        .collect(),
                })
                .collect(),
        },
        params: params(&i.params),
    }
}

fn placement_answer(a: wp::PlacementAnswer) -> sdk::PlacementAnswer {
    match a {
        wp::PlacementAnswer::Ranked(r) => sdk::PlacementAnswer::Ranked(r),
        wp::PlacementAnswer::Reject(why) => sdk::PlacementAnswer::Reject(why),
    }
}

fn hypervisor_input(i: &sdk::HypervisorInput) -> wh::HypervisorInput {
    let r = &i.request;
    wh::HypervisorInput {
        request: wh::HypervisorRequest {
            name: r.name.clone(),
            labels: labels(&r.labels),
            requested_hypervisor: r.requested_hypervisor.clone(),
            framework: r.framework.map(framework),
            devices: r.devices.clone(),
        },
        hypervisors: i
            .hypervisors
            .iter()
            .map(|h| wh::HypervisorInfo {
                name: h.name.clone(),
                available: h.available,
                capabilities: h
                    .capabilities
                    .iter()
                    .map(|c| match c {
                        sdk::Capability::VendorVfio => wh::Capability::VendorVfio,
                        sdk::Capability::Mdev => wh::Capability::Mdev,
                        sdk::Capability::Passthrough => wh::Capability::Passthrough,
                        sdk::Capability::Standby => wh::Capability::Standby,
                        sdk::Capability::Snapshot => wh::Capability::Snapshot,
                    })
                    .collect(),
            })
            .collect(),
        params: params(&i.params),
    }
}

fn hypervisor_answer(a: wh::HypervisorAnswer) -> sdk::HypervisorAnswer {
    match a {
        wh::HypervisorAnswer::Hypervisor(h) => sdk::HypervisorAnswer::Hypervisor(h),
        wh::HypervisorAnswer::Reject(why) => sdk::HypervisorAnswer::Reject(why),
    }
}

fn grace_input(i: &sdk::GraceInput) -> wg::GraceInput {
    wg::GraceInput {
        now_boottime_ms: i.now_boottime_ms,
        boot_id: i.boot_id.clone(),
        items: i
            .items
            .iter()
            .map(|it| wg::GraceItem {
                kind: match it.kind {
                    sdk::GraceItemKind::StaleClaim => wg::GraceItemKind::StaleClaim,
                    sdk::GraceItemKind::OrphanVf => wg::GraceItemKind::OrphanVf,
                    sdk::GraceItemKind::OrphanMdev => wg::GraceItemKind::OrphanMdev,
                },
                device: it.device.clone(),
                framework: framework(it.framework),
                owner: it.owner.as_ref().map(|o| wg::GraceOwner {
                    instance_id: o.instance_id.clone(),
                    state: o.state.clone(),
                    labels: labels(&o.labels),
                    vmm_identity_recorded: o.vmm_identity_recorded,
                }),
                claimed_age_ms: it.claimed_age_ms,
                dirty_age_ms: it.dirty_age_ms,
                same_boot: it.same_boot,
                release_attempts: it.release_attempts,
                last_error: it.last_error.clone(),
            })
            .collect(),
        params: params(&i.params),
    }
}

fn grace_answer(a: wg::GraceAnswer) -> sdk::GraceAnswer {
    sdk::GraceAnswer {
        decisions: a
            .decisions
            .into_iter()
            .map(|d| sdk::GraceDecision {
                device: d.device,
                action: match d.action {
                    wg::GraceAction::Release => sdk::GraceAction::Release,
                    wg::GraceAction::Keep => sdk::GraceAction::Keep,
                },
                recheck_after_ms: d.recheck_after_ms,
                reason: d.reason,
            })
            .collect(),
    }
}
