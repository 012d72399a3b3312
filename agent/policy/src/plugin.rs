//! [`Plugin`]: one loaded, checked policy plugin and its calls.
//!
//! The host's one sequence for both ABIs: the limits checked at load, the per-call store
//! (fuel, the memory limiter, the epoch deadline, a place in the slot's share of the pool),
//! the log budget, the classification of what went wrong ([`CallError`]), the stats and the
//! report of each call. What differs between the ABIs sits beside it: `core_module.rs` (ABI
//! v1: core modules speaking JSON through their memory) and `component.rs` (ABI v2:
//! components of `gpuvisor:policy@2.0.0`).

use crate::cache::{self, CacheOutcome};
use crate::component;
use crate::core_module;
use crate::engine::{self, Share};
use crate::error::{CallError, LoadError};
use crate::text::{self, MAX_TEXT_BYTES};
pub(crate) use gpuvisor_sdk::abi::LogLevel;
use gpuvisor_sdk::{
    GraceAnswer, GraceInput, HypervisorAnswer, HypervisorInput, Manifest, PlacementAnswer, PlacementInput, PolicyKind,
    ABI_VERSION,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::any::Any;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use wasmtime::{Engine, Instance, InstancePre, Module, ResourceLimiter, Store, Trap, UpdateDeadline};

/// Per-plugin limits, applied to every call (and to the load-time manifest call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Instruction budget per call (wasmtime fuel units; about one per wasm instruction).
    pub fuel: u64,
    /// Largest linear memory, bytes (at most [`crate::MAX_MEMORY_BYTES`]).
    pub memory_bytes: usize,
    /// Wall-clock deadline per call (epoch interruption; resolution [`crate::TICK`]).
    pub deadline: Duration,
    /// Largest input JSON, bytes.
    pub max_input_bytes: usize,
    /// Largest reply JSON, bytes.
    pub max_output_bytes: usize,
}

impl Default for Limits {
    /// 10 million fuel, 64 MiB, 100 ms, 4 MiB in, 1 MiB out (docs/plugins.md "The sandbox").
    fn default() -> Self {
        Limits {
            fuel: 10_000_000,
            memory_bytes: 64 << 20,
            deadline: Duration::from_millis(100),
            max_input_bytes: 4 << 20,
            max_output_bytes: 1 << 20,
        }
    }
}

/// Counters of one plugin's calls since load (all kinds together).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginStats {
    /// Calls that returned an answer of the right shape (`{"ok": ..}`).
    pub calls_ok: u64,
    /// Failed calls by [`CallError::reason`].
    pub calls_failed: BTreeMap<&'static str, u64>,
    /// Wall-clock time spent in calls (instantiation included), ok and failed.
    pub total_duration: Duration,
    /// Fuel consumed by all calls.
    pub fuel_consumed: u64,
    /// `gpuvisor.log` lines dropped by the rate limit or as unreadable.
    pub log_lines_dropped: u64,
    /// stdout/stderr bytes dropped past each call's capture (components).
    pub output_bytes_dropped: u64,
    /// Calls waiting now for a place in the slot's share of the sandbox pool.
    pub calls_waiting: u64,
    /// Calls holding a place now (at most [`crate::SLOT_CALLS`] per slot over all plugins
    /// of the slot).
    pub calls_running: u64,
}

/// One `gpuvisor.log` line of a call, as the plugin wrote it (truncated to
/// [`LOG_LINE_MAX_BYTES`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogLine {
    /// `error`, `warn`, `info`, `debug` or `trace` (the ABI's levels 0..=3, 4+ is trace).
    pub level: &'static str,
    /// The line.
    pub line: String,
}

/// What one call cost and said, besides its answer ([`Plugin::call_json_report`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CallReport {
    /// The lines the plugin logged (admitted by the rate limits), in order.
    pub logs: Vec<LogLine>,
    /// Lines of this call dropped by the rate limits or as unreadable.
    pub logs_dropped: u64,
    /// Bytes the plugin wrote to stdout/stderr past the first
    /// [`crate::STDIO_CAPTURE_BYTES`] of the call (components): dropped, never an error.
    pub output_bytes_dropped: u64,
    /// Fuel consumed (instantiation included); `None` when it is not known: the call was
    /// stopped inside a function by its deadline or by a trap of the code itself (an
    /// out-of-bounds access, a stack overflow, ...), and wasmtime counts the fuel of a
    /// running function only at its calls and returns (a trap by `unreachable` — a panic —
    /// or by running out of fuel is counted).
    pub fuel_used: Option<u64>,
    /// Wall-clock time of the call (input encoding, waiting for a place in the slot's share,
    /// instantiation, the call, reply decoding).
    #[serde(serialize_with = "ser_ms")]
    pub wall: Duration,
    /// The part of `wall` spent waiting for a place in the slot's share of the sandbox pool
    /// (every place taken by other calls of the slot).
    #[serde(serialize_with = "ser_ms")]
    pub waited: Duration,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1000.0)
}

fn level_name(level: LogLevel) -> &'static str {
    match level {
        LogLevel::Error => "error",
        LogLevel::Warn => "warn",
        LogLevel::Info => "info",
        LogLevel::Debug => "debug",
        LogLevel::Trace => "trace",
    }
}

/// Log lines a plugin may emit per call; further lines are dropped and counted.
pub const LOG_LINES_PER_CALL: u32 = 16;
/// Log lines a plugin may emit per second over all its calls.
pub const LOG_LINES_PER_SECOND: u32 = 100;
/// Longest log line kept, bytes (longer lines are truncated).
pub const LOG_LINE_MAX_BYTES: usize = 1024;
/// The shortest deadline of a load's calls (`gpuvisor_abi_version`, `gpuvisor_manifest`):
/// the slot's deadline when longer. A plugin that never answers them is still refused.
pub const LOAD_DEADLINE: Duration = Duration::from_secs(5);

/// Longest manifest name, bytes.
pub const MAX_NAME_BYTES: usize = 64;

/// The names of the plugins gpuvisor ships. A plugin may carry one only when it is loaded
/// from a file of that name (`<name>.wasm`, or cargo's `<name_with_underscores>.wasm`),
/// i.e. when whoever installed the file called it that; a site's plugin needs a name of
/// its own, so that logs, metrics and `plugin.list` never credit a default plugin with
/// another plugin's calls.
pub const RESERVED_NAMES: [&str; 4] = ["placement-spread", "placement-pack", "hypervisor-default", "grace-default"];

/// A loaded policy plugin: the module compiled once, linked against the only allowed
/// import, and checked (ABI version, exports, manifest, slot). Every call runs in a fresh
/// instance under the plugin's [`Limits`], so no state survives between calls.
///
/// `Plugin` is `Send + Sync`; call it from any number of threads (each call has its own
/// instance; at most [`crate::POOL_INSTANCES`] instances exist at once, process-wide).
pub struct Plugin {
    path: PathBuf,
    slot: PolicyKind,
    manifest: Manifest,
    limits: Limits,
    sandbox: Sandbox,
    stats: Mutex<PluginStats>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("slot", &self.slot)
            .field("manifest", &self.manifest)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Plugin {
    /// Loads the module at `path` (`.wasm` binary or `.wat` text) for the config slot
    /// `slot`, with `limits` for every call.
    ///
    /// Errors ([`LoadError`], naming the file): unreadable file, invalid module, an import
    /// other than `gpuvisor.log(i32, i32, i32)` (WASI included), a missing or mistyped
    /// export (`memory`, `gpuvisor_abi_version`, `gpuvisor_alloc`, `gpuvisor_free`,
    /// `gpuvisor_manifest`, and `gpuvisor_<kind>` for the slot and every manifest kind),
    /// ABI version other than 1, a manifest that fails or does not decode, a manifest whose
    /// `kinds` lack `slot`, limits out of range.
    pub fn load(path: &Path, slot: PolicyKind, limits: Limits) -> Result<Plugin, LoadError> {
        Self::load_inner(path, Some(slot), limits)
    }

    /// As [`Plugin::load`], with the slot taken from the manifest when it lists exactly
    /// one kind (for `gpuvisor plugin test`). Errors: as `load`, plus
    /// [`LoadError::AmbiguousKind`].
    pub fn load_any(path: &Path, limits: Limits) -> Result<Plugin, LoadError> {
        Self::load_inner(path, None, limits)
    }

    fn load_inner(path: &Path, slot: Option<PolicyKind>, limits: Limits) -> Result<Plugin, LoadError> {
        let p = || path.to_path_buf();
        if limits.memory_bytes > engine::MAX_MEMORY_BYTES {
            return Err(LoadError::Limits {
                path: p(),
                reason: format!(
                    "memory_bytes {} exceeds the host maximum of {} bytes",
                    limits.memory_bytes,
                    engine::MAX_MEMORY_BYTES
                ),
            });
        }
        if limits.fuel == 0 || limits.deadline.is_zero() {
            return Err(LoadError::Limits { path: p(), reason: "fuel and deadline must be non-zero".into() });
        }
        let shared = engine::shared().map_err(|reason| LoadError::Engine { path: p(), reason })?;
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read { path: p(), source })?;
        let bytes = wat::parse_bytes(&bytes).map_err(compile_error(path))?;
        if component::is_component(&bytes) {
            return Self::load_component(path, slot, limits, &shared.engine, &bytes);
        }
        Self::load_module(path, slot, limits, &shared.engine, &bytes)
    }

    /// The ABI v1 half of [`Plugin::load`]: compile, check and link the module
    /// ([`core_module::compile`]), ask for its ABI version and manifest in a sandbox like any
    /// call's ([`core_module::manifest`]), check the manifest and the entry points of the
    /// kinds it lists.
    fn load_module(
        path: &Path,
        slot: Option<PolicyKind>,
        limits: Limits,
        engine: &Engine,
        bytes: &[u8],
    ) -> Result<Plugin, LoadError> {
        let p = || path.to_path_buf();
        let (module, cached) = cache::compile::<Module>(engine, bytes).map_err(compile_error(path))?;
        let pre = core_module::compile(engine, path, &module)?;
        let sandbox = Sandbox::new(path, Code::Module(pre), cached, limits);
        let kind_for_errors = slot.unwrap_or(PolicyKind::Placement);
        let (version, manifest_bytes) = sandbox
            .with_instance(kind_for_errors, Share::Load, &mut CallReport::default(), |store, instance, label| {
                core_module::manifest(store, instance, label, kind_for_errors, &limits)
            })
            .map_err(|source| LoadError::Init {
                path: p(),
                what: "calling gpuvisor_abi_version / gpuvisor_manifest",
                source: Box::new(source),
            })?;
        if version != ABI_VERSION {
            return Err(LoadError::AbiVersion {
                path: p(),
                found: version.into(),
                expected: ABI_VERSION.into(),
                form: "core module",
            });
        }
        let manifest: Manifest = serde_json::from_slice(&manifest_bytes)
            .map_err(|e| LoadError::Manifest { path: p(), reason: text::shown(&e.to_string(), MAX_TEXT_BYTES) })?;
        check_name(path, &manifest.name)?;
        let slot = slot_of(path, slot, &manifest)?;
        for kind in &manifest.kinds {
            core_module::check_entry_point(path, &module, *kind)?;
        }
        Ok(Self::loaded(path, slot, manifest, sandbox))
    }

    /// The ABI v2 half of [`Plugin::load`]: compile and check the component
    /// ([`component::compile`]), ask for its manifest in a sandbox like any call's, check
    /// the manifest against the exports and the slot.
    fn load_component(
        path: &Path,
        slot: Option<PolicyKind>,
        limits: Limits,
        engine: &Engine,
        bytes: &[u8],
    ) -> Result<Plugin, LoadError> {
        let p = || path.to_path_buf();
        let exported = component::inspect(path, bytes)?;
        let (compiled, cached) =
            cache::compile::<wasmtime::component::Component>(engine, bytes).map_err(compile_error(path))?;
        let compiled = component::compile(engine, path, compiled, &exported)?;
        let sandbox = Sandbox::new(path, Code::Component(Box::new(compiled)), cached, limits);
        let kind_for_errors = slot.unwrap_or(exported[0]);
        let (manifest, abi_version) = sandbox
            .with_store(kind_for_errors, Share::Load, &mut CallReport::default(), |store, code, label| match code {
                Code::Component(c) => {
                    c.manifest(store).map_err(|e| classify(e, store, label, kind_for_errors, &limits))
                }
                Code::Module(_) => Err(CallError::Trap {
                    plugin: label.to_string(),
                    kind: kind_for_errors,
                    message: "not a component".into(),
                }),
            })
            .map_err(|source| LoadError::Init { path: p(), what: "calling manifest", source: Box::new(source) })?;
        check_name(path, &manifest.name)?;
        if abi_version != component::ABI_VERSION_V2 {
            return Err(LoadError::AbiVersion {
                path: p(),
                found: i64::from(abi_version),
                expected: i64::from(component::ABI_VERSION_V2),
                form: "component",
            });
        }
        let mut listed = manifest.kinds.clone();
        listed.sort();
        listed.dedup();
        if listed != exported {
            return Err(LoadError::KindsMismatch { path: p(), name: manifest.name, listed: manifest.kinds, exported });
        }
        let slot = slot_of(path, slot, &manifest)?;
        Ok(Self::loaded(path, slot, manifest, sandbox))
    }

    fn loaded(path: &Path, slot: PolicyKind, mut manifest: Manifest, mut sandbox: Sandbox) -> Plugin {
        sandbox.label = Arc::from(manifest.name.as_str());
        // Free text, shown in logs and lists: escaped, cut like a name.
        manifest.version = text::shown(&manifest.version, MAX_NAME_BYTES);
        tracing::info!(
            plugin = %manifest.name,
            version = %manifest.version,
            abi = sandbox.code.abi(),
            compiled = ?sandbox.cached,
            slot = %slot.as_str(),
            path = %path.display(),
            "policy plugin loaded"
        );
        Plugin {
            path: path.to_path_buf(),
            slot,
            manifest,
            limits: sandbox.limits,
            sandbox,
            stats: Mutex::new(PluginStats::default()),
        }
    }

    /// Whether the load compiled the plugin or found it compiled in the cache.
    pub fn cache_outcome(&self) -> CacheOutcome {
        self.sandbox.cached
    }

    /// The ABI the plugin speaks: 1 (a core module, JSON) or 2 (a component of
    /// `gpuvisor:policy@2.0.0`).
    pub fn abi_version(&self) -> u32 {
        self.sandbox.code.abi()
    }

    /// The manifest the plugin returned at load.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The slot it was loaded for.
    pub fn slot(&self) -> PolicyKind {
        self.slot
    }

    /// Its limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// A snapshot of its call counters.
    pub fn stats(&self) -> PluginStats {
        let mut stats = match self.stats.lock() {
            Ok(s) => s.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        stats.log_lines_dropped = self.sandbox.log.dropped();
        stats.calls_waiting = self.sandbox.activity.waiting.load(Ordering::SeqCst);
        stats.calls_running = self.sandbox.activity.running.load(Ordering::SeqCst);
        stats
    }

    /// Asks for the ranked devices. Errors: any [`CallError`]; the caller fails the
    /// create/start with `policy_failed` (docs/plugins.md).
    pub fn call_placement(&self, input: &PlacementInput) -> Result<PlacementAnswer, CallError> {
        self.call_typed(PolicyKind::Placement, input)
    }

    /// Asks for the hypervisor. Errors: any [`CallError`]; the caller fails the create with
    /// `policy_failed`.
    pub fn call_hypervisor(&self, input: &HypervisorInput) -> Result<HypervisorAnswer, CallError> {
        self.call_typed(PolicyKind::Hypervisor, input)
    }

    /// Asks for grace decisions. Errors: any [`CallError`]; the caller keeps every item of
    /// the batch this pass.
    pub fn call_grace(&self, input: &GraceInput) -> Result<GraceAnswer, CallError> {
        self.call_typed(PolicyKind::Grace, input)
    }

    /// Calls the `kind` entry point with any JSON input and returns the `ok` answer as
    /// JSON, unchecked against the kind's answer type. Errors: as the typed calls
    /// (`{"error": ..}` → [`CallError::Plugin`]).
    pub fn call_json(&self, kind: PolicyKind, input: &serde_json::Value) -> Result<serde_json::Value, CallError> {
        self.call_typed(kind, input)
    }

    /// As [`Plugin::call_json`], and what the call cost and logged ([`CallReport`]), for
    /// `gpuvisor plugin test`. The log lines still go to `tracing` as in any call.
    pub fn call_json_report(
        &self,
        kind: PolicyKind,
        input: &serde_json::Value,
    ) -> (Result<serde_json::Value, CallError>, CallReport) {
        self.call_report(kind, input)
    }

    fn call_typed<I: Serialize + Any, T: DeserializeOwned + Any>(
        &self,
        kind: PolicyKind,
        input: &I,
    ) -> Result<T, CallError> {
        self.call_report(kind, input).0
    }

    /// The one call sequence (every call above goes through it): encode, call in a fresh
    /// instance, decode as `T`; count it in the stats; report fuel, time and log lines
    /// ([`CallReport`]). `I` and `T` are the kind's SDK types (or JSON).
    pub fn call_report<I: Serialize + Any, T: DeserializeOwned + Any>(
        &self,
        kind: PolicyKind,
        input: &I,
    ) -> (Result<T, CallError>, CallReport) {
        let started = Instant::now();
        let mut report = CallReport::default();
        let result = self.call_inner(kind, input, &mut report).map(safe_answer);
        report.wall = started.elapsed();
        let mut stats = match self.stats.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        stats.total_duration += report.wall;
        stats.fuel_consumed += report.fuel_used.unwrap_or(0);
        stats.output_bytes_dropped += report.output_bytes_dropped;
        match &result {
            Ok(_) => stats.calls_ok += 1,
            Err(e) => *stats.calls_failed.entry(e.reason()).or_insert(0) += 1,
        }
        drop(stats);
        if let Err(e) = &result {
            tracing::debug!(plugin = %self.manifest.name, kind = %kind.as_str(), error = %e, "policy plugin call failed");
        }
        (result, report)
    }

    fn call_inner<I: Serialize + Any, T: DeserializeOwned + Any>(
        &self,
        kind: PolicyKind,
        input: &I,
        report: &mut CallReport,
    ) -> Result<T, CallError> {
        let label = &self.sandbox.label;
        if !self.manifest.kinds.contains(&kind) {
            return Err(CallError::NotProvided { plugin: label.to_string(), kind });
        }
        if let Code::Component(_) = self.sandbox.code {
            return self.call_component(kind, input, report);
        }
        self.call_module(kind, input, report)
    }

    /// The v1 half of the call sequence: the input as JSON, its size checked, the call in a
    /// fresh instance ([`core_module::call`]), the reply envelope decoded as `T`
    /// ([`core_module::answer`]).
    fn call_module<I: Serialize + Any, T: DeserializeOwned + Any>(
        &self,
        kind: PolicyKind,
        input: &I,
        report: &mut CallReport,
    ) -> Result<T, CallError> {
        let label = &self.sandbox.label;
        let bytes = serde_json::to_vec(input).map_err(|e| CallError::InputEncode {
            plugin: label.to_string(),
            kind,
            reason: e.to_string(),
        })?;
        if bytes.len() > self.limits.max_input_bytes {
            return Err(CallError::InputTooLarge {
                plugin: label.to_string(),
                kind,
                len: bytes.len(),
                max: self.limits.max_input_bytes,
            });
        }
        let limits = self.limits;
        let reply = self.sandbox.with_instance(kind, Share::Slot(self.slot), report, |store, instance, label| {
            core_module::call(store, instance, label, kind, &limits, &bytes)
        })?;
        core_module::answer(&reply, label, kind)
    }
}

/// A compile failure of the plugin at `path` (the cause with its chain, `{:#}`).
fn compile_error<E: std::fmt::Display>(path: &Path) -> impl FnOnce(E) -> LoadError + '_ {
    move |e| LoadError::Compile { path: path.to_path_buf(), reason: format!("{e:#}") }
}

/// Checks the manifest's name: 1 to [`MAX_NAME_BYTES`] bytes of ASCII letters, digits,
/// `.`, `_` and `-`, starting with a letter or a digit; one of [`RESERVED_NAMES`] only
/// from the file of that name. The name is what logs, metrics and `plugin.list` call the
/// plugin.
fn check_name(path: &Path, name: &str) -> Result<(), LoadError> {
    let charset = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let problem = if name.is_empty() {
        "is empty".to_string()
    } else if name.len() > MAX_NAME_BYTES {
        format!("is {} bytes long (at most {MAX_NAME_BYTES})", name.len())
    } else if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) || !name.chars().all(charset) {
        "must be ASCII letters, digits, '.', '_' and '-', starting with a letter or a digit".to_string()
    } else if RESERVED_NAMES.contains(&name) && !file_is_named(path, name) {
        format!(
            "is the name of a plugin gpuvisor ships, which only its own file ({name}.wasm) may carry; give the plugin a name of its own"
        )
    } else {
        return Ok(());
    };
    Err(LoadError::Name { path: path.to_path_buf(), name: text::shown(name, MAX_NAME_BYTES), problem })
}

/// True when the file at `path` is called `name` (`<name>.wasm`, or `<name_with_underscores>.wasm`
/// as cargo names a build).
fn file_is_named(path: &Path, name: &str) -> bool {
    path.file_stem().and_then(|s| s.to_str()).is_some_and(|stem| stem.replace('_', "-") == name)
}

/// An answer's free text — reject reasons, grace reasons, the hypervisor's name — made
/// [`text::printable`] and cut to [`MAX_TEXT_BYTES`], as every plugin text the agent shows
/// (an answer of any other type, e.g. JSON, as is).
fn safe_answer<T: Any>(mut answer: T) -> T {
    let safe = |s: &mut String| {
        if s.len() > MAX_TEXT_BYTES || text::printable(s) != s.as_str() {
            *s = text::shown(s, MAX_TEXT_BYTES);
        }
    };
    let any = &mut answer as &mut dyn Any;
    if let Some(PlacementAnswer::Reject(why)) = any.downcast_mut::<PlacementAnswer>() {
        safe(why);
    } else if let Some(a) = any.downcast_mut::<HypervisorAnswer>() {
        match a {
            HypervisorAnswer::Hypervisor(name) => safe(name),
            HypervisorAnswer::Reject(why) => safe(why),
        }
    } else if let Some(a) = any.downcast_mut::<GraceAnswer>() {
        a.decisions.iter_mut().for_each(|d| safe(&mut d.reason));
    }
    answer
}

/// The slot a plugin is loaded for: the configured one, which its manifest must list, or
/// (none configured) the manifest's only kind.
fn slot_of(path: &Path, slot: Option<PolicyKind>, manifest: &Manifest) -> Result<PolicyKind, LoadError> {
    let slot = match slot {
        Some(slot) => slot,
        None => match manifest.kinds.as_slice() {
            [only] => *only,
            _ => {
                return Err(LoadError::AmbiguousKind {
                    path: path.to_path_buf(),
                    name: manifest.name.clone(),
                    kinds: manifest.kinds.clone(),
                })
            }
        },
    };
    if !manifest.kinds.contains(&slot) {
        return Err(LoadError::WrongSlot {
            path: path.to_path_buf(),
            name: manifest.name.clone(),
            slot,
            kinds: manifest.kinds.clone(),
        });
    }
    Ok(slot)
}

/// Counts the bytes of a JSON encoding without keeping them: the size limits of v2 calls
/// are the sizes of the same values as v1 JSON, so a limit means one thing for both ABIs.
struct JsonLen(usize);

impl std::io::Write for JsonLen {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn json_len<V: Serialize + ?Sized>(value: &V) -> usize {
    let mut len = JsonLen(0);
    match serde_json::to_writer(&mut len, value) {
        Ok(()) => len.0,
        Err(_) => usize::MAX,
    }
}

impl Plugin {
    /// The v2 half of the call sequence: the input as the kind's SDK type (itself, or JSON
    /// decoded as it), its JSON size checked, the typed call in a fresh store, the answer's
    /// JSON size checked, the answer as `T` (itself, or through JSON).
    fn call_component<I: Serialize + Any, T: DeserializeOwned + Any>(
        &self,
        kind: PolicyKind,
        input: &I,
        report: &mut CallReport,
    ) -> Result<T, CallError> {
        let label = &self.sandbox.label;
        let limits = self.limits;
        let len = json_len(input);
        if len > limits.max_input_bytes {
            return Err(CallError::InputTooLarge { plugin: label.to_string(), kind, len, max: limits.max_input_bytes });
        }
        let bad_input = |reason: String| CallError::InputEncode { plugin: label.to_string(), kind, reason };
        let (mut p, mut h, mut g) = (None, None, None);
        let typed = match kind {
            PolicyKind::Placement => component::Input::Placement(as_typed(input, &mut p).map_err(bad_input)?),
            PolicyKind::Hypervisor => component::Input::Hypervisor(as_typed(input, &mut h).map_err(bad_input)?),
            PolicyKind::Grace => component::Input::Grace(as_typed(input, &mut g).map_err(bad_input)?),
        };
        let answer =
            self.sandbox.with_store(kind, Share::Slot(self.slot), report, |store, code, label| match code {
                Code::Component(c) => c.call(store, typed).map_err(|e| classify(e, store, label, kind, &limits)),
                Code::Module(_) => Err(component::not_exported(label, kind)),
            })?;
        let answer = answer.map_err(|message| CallError::Plugin {
            plugin: label.to_string(),
            kind,
            message: text::shown(&message, MAX_TEXT_BYTES),
        })?;
        let (len, converted) = match answer {
            component::Answer::Placement(a) => (json_len(&a), answer_as::<T, _>(a)),
            component::Answer::Hypervisor(a) => (json_len(&a), answer_as::<T, _>(a)),
            component::Answer::Grace(a) => (json_len(&a), answer_as::<T, _>(a)),
        };
        if len > limits.max_output_bytes {
            return Err(CallError::OutputTooLarge {
                plugin: label.to_string(),
                kind,
                len,
                max: limits.max_output_bytes,
            });
        }
        converted.map_err(|reason| CallError::UndecodableReply { plugin: label.to_string(), kind, reason })
    }
}

/// `input` as the SDK type `X`: itself when it is one, else decoded from its JSON into
/// `slot`.
fn as_typed<'a, X: DeserializeOwned + Any, I: Serialize + Any>(
    input: &'a I,
    slot: &'a mut Option<X>,
) -> Result<&'a X, String> {
    if let Some(x) = (input as &dyn Any).downcast_ref::<X>() {
        return Ok(x);
    }
    let value = serde_json::to_value(input).map_err(|e| e.to_string())?;
    let x = X::deserialize(value).map_err(|e| format!("not a valid input of this kind: {e}"))?;
    Ok(slot.insert(x))
}

/// An answer `A` as the caller's `T`: itself when `T` is `A`, else through JSON (e.g.
/// `serde_json::Value` for [`Plugin::call_json`]).
fn answer_as<T: DeserializeOwned + Any, A: Serialize + Any>(answer: A) -> Result<T, String> {
    let any: Box<dyn Any> = Box::new(answer);
    match any.downcast::<T>() {
        Ok(t) => Ok(*t),
        Err(any) => match any.downcast::<A>() {
            Ok(a) => serde_json::to_value(&*a).and_then(T::deserialize).map_err(|e| e.to_string()),
            Err(_) => Err("the answer has an unexpected type".into()),
        },
    }
}

// ---------------------------------------------------------------------------------------
// sandbox

/// What a call's store carries.
pub(crate) struct CallState {
    limiter: Limiter,
    pub(crate) log: CallLog,
    /// WASI (components only; built on first use).
    pub(crate) wasi: crate::wasi::WasiState,
    /// The call stopped where wasmtime had not counted its fuel ([`CallReport::fuel_used`]).
    fuel_uncounted: bool,
}

impl CallState {
    /// A memory growth of this call was refused by the limiter.
    pub(crate) fn memory_hit(&self) -> bool {
        self.limiter.memory_hit
    }
}

/// Memory/table limits of one call; remembers a refused memory growth so the resulting
/// trap is reported as [`CallError::MemoryLimit`]. `memory_bytes` bounds the sum of every
/// linear memory of the call (a component may have several).
struct Limiter {
    memory_bytes: usize,
    used: usize,
    memory_hit: bool,
    counts: Counts,
}

/// How many instances, memories and tables one call may create.
#[derive(Clone, Copy)]
struct Counts {
    instances: usize,
    memories: usize,
    tables: usize,
}

/// A v1 module: one instance, one memory.
const MODULE_COUNTS: Counts = Counts { instances: 1, memories: 1, tables: 4 };
/// A component: its core instances (a guest built by a language toolchain has a few).
const COMPONENT_COUNTS: Counts = Counts {
    instances: engine::MAX_CORE_INSTANCES_PER_COMPONENT as usize,
    memories: engine::MAX_MEMORIES_PER_COMPONENT as usize,
    tables: engine::MAX_TABLES_PER_COMPONENT as usize,
};

use engine::MAX_TABLE_ELEMENTS;

impl ResourceLimiter for Limiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let used = self.used.saturating_sub(current).saturating_add(desired);
        let ok = used <= self.memory_bytes && maximum.is_none_or(|m| desired <= m);
        if ok {
            self.used = used;
        } else {
            self.memory_hit = true;
        }
        Ok(ok)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS && maximum.is_none_or(|m| desired <= m))
    }

    fn instances(&self) -> usize {
        self.counts.instances
    }

    fn tables(&self) -> usize {
        self.counts.tables
    }

    fn memories(&self) -> usize {
        self.counts.memories
    }
}

/// Per-call log budget.
pub(crate) struct CallLog {
    plugin: Arc<str>,
    left: u32,
    shared: Arc<LogLimiter>,
    /// The admitted lines of this call, for its [`CallReport`].
    lines: Vec<LogLine>,
    /// Lines of this call dropped.
    dropped: u64,
}

/// Per-plugin log rate limit (lines per one-second window) and drop counter.
#[derive(Default)]
struct LogLimiter {
    state: Mutex<LogWindow>,
}

#[derive(Default)]
struct LogWindow {
    window_start: Option<Instant>,
    lines: u32,
    dropped: u64,
}

impl LogLimiter {
    fn admit(&self) -> bool {
        let mut w = match self.state.lock() {
            Ok(w) => w,
            Err(poisoned) => poisoned.into_inner(),
        };
        let now = Instant::now();
        match w.window_start {
            Some(start) if now.duration_since(start) < Duration::from_secs(1) => {}
            _ => {
                w.window_start = Some(now);
                w.lines = 0;
            }
        }
        if w.lines < LOG_LINES_PER_SECOND {
            w.lines += 1;
            true
        } else {
            w.dropped += 1;
            false
        }
    }

    fn drop_one(&self) {
        match self.state.lock() {
            Ok(mut w) => w.dropped += 1,
            Err(poisoned) => poisoned.into_inner().dropped += 1,
        }
    }

    fn dropped(&self) -> u64 {
        match self.state.lock() {
            Ok(w) => w.dropped,
            Err(poisoned) => poisoned.into_inner().dropped,
        }
    }
}

/// What a plugin's code is: a v1 core module or a v2 component, compiled and linked.
enum Code {
    Module(InstancePre<CallState>),
    Component(Box<component::Compiled>),
}

impl Code {
    fn abi(&self) -> u32 {
        match self {
            Code::Module(_) => 1,
            Code::Component(_) => component::ABI_VERSION_V2,
        }
    }
}

/// A compiled, linked plugin plus its limits: creates a fresh store and instance per call.
struct Sandbox {
    label: Arc<str>,
    code: Code,
    /// How the code was obtained at load.
    cached: CacheOutcome,
    limits: Limits,
    log: Arc<LogLimiter>,
    activity: Activity,
}

/// Calls of one plugin in progress now.
#[derive(Default)]
struct Activity {
    /// Waiting for a place in the slot's share of the pool.
    waiting: AtomicU64,
    /// Holding a place: instantiating, running, reading the answer.
    running: AtomicU64,
}

/// One more in a counter, one less again on drop.
struct Count<'a>(&'a AtomicU64);

impl<'a> Count<'a> {
    fn up(counter: &'a AtomicU64) -> Count<'a> {
        counter.fetch_add(1, Ordering::SeqCst);
        Count(counter)
    }
}

impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Sandbox {
    /// The sandbox of `code` loaded from `path` (its label until the manifest names it).
    fn new(path: &Path, code: Code, cached: CacheOutcome, limits: Limits) -> Sandbox {
        Sandbox {
            label: Arc::from(path.display().to_string()),
            code,
            cached,
            limits,
            log: Arc::new(LogLimiter::default()),
            activity: Activity::default(),
        }
    }

    /// Runs `f` with a fresh store and a fresh instance of the v1 module.
    fn with_instance<R>(
        &self,
        kind: PolicyKind,
        share: Share,
        report: &mut CallReport,
        f: impl FnOnce(&mut Store<CallState>, &Instance, &str) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        let limits = self.limits;
        self.with_store(kind, share, report, |store, code, label| {
            let Code::Module(pre) = code else {
                return Err(CallError::Trap { plugin: label.to_string(), kind, message: "not a core module".into() });
            };
            match pre.instantiate(&mut *store) {
                Ok(instance) => f(store, &instance, label),
                Err(e) => Err(match classify(e, store, label, kind, &limits) {
                    CallError::Trap { message, .. } => {
                        CallError::Instantiate { plugin: label.to_string(), kind, reason: message }
                    }
                    other => other,
                }),
            }
        })
    }

    /// The one store sequence of every call, v1 and v2: a place in the call's share of the
    /// pool (waiting at most the deadline for one), a fresh store (fuel, memory limiter,
    /// the deadline set, the ticker running), `f`, then the fuel consumed and the log lines
    /// (the plugin's own and, for components, its stdout/stderr) into `report`.
    fn with_store<R>(
        &self,
        kind: PolicyKind,
        share: Share,
        report: &mut CallReport,
        f: impl FnOnce(&mut Store<CallState>, &Code, &str) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        let label: &str = &self.label;
        let shared =
            engine::shared().map_err(|reason| CallError::Instantiate { plugin: label.to_string(), kind, reason })?;
        // The deadline covers the whole call: waiting for a place, then running. A load's
        // calls (ABI version, manifest) are off every request's path and include the first
        // instantiation of a large guest (a JavaScript engine): at least LOAD_DEADLINE.
        let allowed = match share {
            Share::Load => self.limits.deadline.max(LOAD_DEADLINE),
            _ => self.limits.deadline,
        };
        let asked = Instant::now();
        let deadline = asked + allowed;
        let place = {
            let _waiting = Count::up(&self.activity.waiting);
            share.enter(allowed)
        };
        report.waited = asked.elapsed();
        let (Some(_place), false) = (place, Instant::now() >= deadline) else {
            return Err(CallError::Busy {
                plugin: label.to_string(),
                kind,
                share: share.name(),
                calls: engine::SLOT_CALLS,
                waited_ms: report.waited.as_millis(),
            });
        };
        let _running = Count::up(&self.activity.running);
        let counts = match self.code {
            Code::Module(_) => MODULE_COUNTS,
            Code::Component(_) => COMPONENT_COUNTS,
        };
        let mut store = Store::new(
            &shared.engine,
            CallState {
                limiter: Limiter { memory_bytes: self.limits.memory_bytes, used: 0, memory_hit: false, counts },
                log: CallLog {
                    plugin: self.label.clone(),
                    left: LOG_LINES_PER_CALL,
                    shared: self.log.clone(),
                    lines: Vec::new(),
                    dropped: 0,
                },
                wasi: crate::wasi::WasiState::default(),
                fuel_uncounted: false,
            },
        );
        store.limiter(|state| &mut state.limiter);
        store.set_fuel(self.limits.fuel).map_err(|e| CallError::Instantiate {
            plugin: label.to_string(),
            kind,
            reason: format!("{e:#}"),
        })?;
        let _ticking = shared.running();
        // The deadline is the wall clock's: every tick checks it (a tick is at least TICK
        // and more on a busy host, so counting ticks would make the deadline longer).
        store.epoch_deadline_callback(move |_| {
            if Instant::now() >= deadline {
                Err(Trap::Interrupt.into())
            } else {
                Ok(UpdateDeadline::Continue(1))
            }
        });
        store.set_epoch_deadline(1);
        let result = f(&mut store, &self.code, label);
        report.fuel_used =
            (!store.data().fuel_uncounted).then(|| self.limits.fuel.saturating_sub(store.get_fuel().unwrap_or(0)));
        let state = store.data_mut();
        let (lines, output_dropped) = state.wasi.take_output();
        for line in lines {
            state.log.line(LogLevel::Info, line);
        }
        report.output_bytes_dropped = output_dropped;
        let log = &mut state.log;
        report.logs = std::mem::take(&mut log.lines);
        report.logs_dropped = log.dropped;
        result
    }
}

/// Maps a wasmtime error from instantiation or a call to a [`CallError`].
pub(crate) fn classify(
    e: wasmtime::Error,
    store: &mut Store<CallState>,
    label: &str,
    kind: PolicyKind,
    limits: &Limits,
) -> CallError {
    let plugin = label.to_string();
    // Stopped inside a function: its fuel since its last call was not written back.
    store.data_mut().fuel_uncounted =
        e.downcast_ref::<Trap>().is_some_and(|t| !matches!(t, Trap::OutOfFuel | Trap::UnreachableCodeReached));
    if let (Some(failed), false) = (e.downcast_ref::<component::InstantiateFailed>(), store.data().limiter.memory_hit) {
        return CallError::Instantiate { plugin, kind, reason: text::shown(&failed.0, MAX_TEXT_BYTES) };
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => CallError::OutOfFuel { plugin, kind, fuel: limits.fuel },
        Some(Trap::Interrupt) => CallError::Deadline { plugin, kind, deadline_ms: limits.deadline.as_millis() },
        _ if store.data().limiter.memory_hit => {
            CallError::MemoryLimit { plugin, kind, limit_bytes: limits.memory_bytes }
        }
        // A guest's names (e.g. in a backtrace) are the plugin's text.
        Some(trap) => CallError::Trap { plugin, kind, message: text::shown(&trap.to_string(), MAX_TEXT_BYTES) },
        None => CallError::Trap { plugin, kind, message: text::shown(&format!("{e:#}"), MAX_TEXT_BYTES) },
    }
}

impl CallLog {
    /// The one log path of a plugin (v1 `gpuvisor.log`, v2 `log`, v2 stdout/stderr):
    /// admits the line under the per-call and per-second budgets, truncates it to
    /// [`LOG_LINE_MAX_BYTES`], sends it to `tracing` with the plugin's name and keeps it
    /// for the call's [`CallReport`]; a line over budget is dropped and counted.
    pub(crate) fn line(&mut self, level: LogLevel, line: String) {
        let admitted = if self.left == 0 {
            self.shared.drop_one();
            false
        } else if self.shared.admit() {
            self.left -= 1;
            true
        } else {
            false
        };
        if !admitted {
            self.dropped += 1;
            return;
        }
        // One line of the log per line the plugin wrote, whatever it wrote.
        let line = text::shown(&line, LOG_LINE_MAX_BYTES);
        let plugin: &str = &self.plugin;
        match level {
            LogLevel::Error => tracing::error!(plugin = %plugin, "{line}"),
            LogLevel::Warn => tracing::warn!(plugin = %plugin, "{line}"),
            LogLevel::Info => tracing::info!(plugin = %plugin, "{line}"),
            LogLevel::Debug => tracing::debug!(plugin = %plugin, "{line}"),
            LogLevel::Trace => tracing::trace!(plugin = %plugin, "{line}"),
        }
        self.lines.push(LogLine { level: level_name(level), line });
    }

    /// A line that could not be read from the plugin's memory: dropped and counted.
    pub(crate) fn unreadable(&mut self) {
        self.shared.drop_one();
        self.dropped += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn plugin_is_send_and_sync() {
        assert_send_sync::<Plugin>();
    }

    #[test]
    fn default_limits_follow_plugins_md() {
        let l = Limits::default();
        assert_eq!(l.memory_bytes, 64 << 20);
        assert_eq!(l.deadline, Duration::from_millis(100));
        assert_eq!((l.max_input_bytes, l.max_output_bytes), (4 << 20, 1 << 20));
    }
}
