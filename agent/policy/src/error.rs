//! The plugin host's errors: [`LoadError`] (the plugin is refused; the agent does not start,
//! or `plugin.reload` keeps the old plugin) and [`CallError`] (one call failed; the agent
//! fails closed as docs/plugins.md "Failure semantics" says). Every message is one sentence that
//! names the plugin.

use gpuvisor_sdk::PolicyKind;
use std::path::PathBuf;

/// A plugin could not be loaded. The `path` is the module file as configured.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The shared wasmtime engine could not be created (host problem, not the plugin's).
    #[error("policy plugin {path}: the wasm engine could not be created: {reason}")]
    Engine {
        /// The module file, as configured.
        path: PathBuf,
        /// Why wasmtime refused the engine configuration.
        reason: String,
    },
    /// The configured limits are out of range.
    #[error("policy plugin {path}: invalid limits: {reason}")]
    Limits {
        /// The module file, as configured.
        path: PathBuf,
        /// Which limit is out of range, and its allowed range.
        reason: String,
    },
    /// The file could not be read.
    #[error("policy plugin {path}: cannot read the module")]
    Read {
        /// The module file, as configured.
        path: PathBuf,
        /// The read's I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a valid WebAssembly module (binary or `.wat` text) wasmtime accepts.
    #[error("policy plugin {path}: not a valid WebAssembly module: {reason}")]
    Compile {
        /// The module file, as configured.
        path: PathBuf,
        /// wasmtime's error.
        reason: String,
    },
    /// The module imports WASI; a policy has no files, network, clock or randomness.
    #[error("policy plugin {path}: imports WASI ({module}.{name}); the only allowed import is gpuvisor.log")]
    WasiImport {
        /// The module file, as configured.
        path: PathBuf,
        /// The import's module name.
        module: String,
        /// The import's name.
        name: String,
    },
    /// The module imports something other than `gpuvisor.log(i32, i32, i32)`; for a
    /// component, `module` is the import's name (`name` empty) and the message names what
    /// a component may import.
    #[error("policy plugin {path}: forbidden import {module}{}{name}; {}", if name.is_empty() { "" } else { "." }, if name.is_empty() { "a component may import gpuvisor:policy/log@2.0.0 and WASI 0.2 only" } else { "the only allowed import is gpuvisor.log(i32, i32, i32)" })]
    ForbiddenImport {
        /// The module file, as configured.
        path: PathBuf,
        /// The import's module name (a component: the import's name).
        module: String,
        /// The import's name (empty for a component).
        name: String,
    },
    /// A required export is missing.
    #[error("policy plugin {path}: missing export {export} ({expected})")]
    MissingExport {
        /// The module file, as configured.
        path: PathBuf,
        /// The export's name.
        export: &'static str,
        /// What the host expects there.
        expected: &'static str,
    },
    /// An export exists with the wrong kind or signature.
    #[error("policy plugin {path}: export {export} has the wrong type (expected {expected})")]
    ExportType {
        /// The module file, as configured.
        path: PathBuf,
        /// The export's name.
        export: &'static str,
        /// What the host expects there.
        expected: &'static str,
    },
    /// `gpuvisor_abi_version()` returned something other than 1 (a core module), or the
    /// manifest's `abi-version` is not 2 (a component).
    #[error("policy plugin {path}: ABI version {found} is not supported (this agent speaks ABI version {expected} for a {form}{})", if *form == "core module" { "; ABI v2 plugins are components" } else { "" })]
    AbiVersion {
        /// The module file, as configured.
        path: PathBuf,
        /// The version the plugin reports.
        found: i64,
        /// The version this agent speaks for that form.
        expected: i64,
        /// `core module` or `component`.
        form: &'static str,
    },
    /// A component imports or exports an interface of `gpuvisor:policy` at another version.
    #[error("policy plugin {path}: {name} is not the WIT package this agent speaks (gpuvisor:policy@{expected}); rebuild the plugin against sdk/wit of this agent")]
    WitVersion {
        /// The module file, as configured.
        path: PathBuf,
        /// The interface, with its version.
        name: String,
        /// The package version this agent speaks (e.g. `2.0.0`).
        expected: &'static str,
    },
    /// A component imports a WASI interface the host does not link.
    #[error("policy plugin {path}: imports {name}, which the host does not grant (only wasi:cli, wasi:clocks, wasi:filesystem, wasi:io, wasi:random and wasi:sockets are linked, and they grant nothing)")]
    WasiNotGranted {
        /// The module file, as configured.
        path: PathBuf,
        /// The WASI interface imported.
        name: String,
    },
    /// A component's imports do not match what the host links (e.g. a `log` of another shape).
    #[error("policy plugin {path}: the component does not link against the host: {reason}")]
    Link {
        /// The module file, as configured.
        path: PathBuf,
        /// wasmtime's linking error.
        reason: String,
    },
    /// A component's manifest lists other kinds than the interfaces it exports.
    #[error("policy plugin {path} ({name}): the manifest lists {listed:?} but the component exports {exported:?}")]
    KindsMismatch {
        /// The module file, as configured.
        path: PathBuf,
        /// The plugin's manifest name.
        name: String,
        /// The kinds the manifest lists.
        listed: Vec<PolicyKind>,
        /// The kinds whose interfaces the component exports.
        exported: Vec<PolicyKind>,
    },
    /// Calling `gpuvisor_abi_version` or `gpuvisor_manifest` failed (trap, limit, bad pointer).
    #[error("policy plugin {path}: {what} failed at load")]
    Init {
        /// The module file, as configured.
        path: PathBuf,
        /// The export called: `gpuvisor_abi_version` or `gpuvisor_manifest`.
        what: &'static str,
        /// How the call failed.
        #[source]
        source: Box<CallError>,
    },
    /// The manifest is not the JSON object `{"name", "version", "kinds"}`.
    #[error("policy plugin {path}: the manifest does not decode: {reason}")]
    Manifest {
        /// The module file, as configured.
        path: PathBuf,
        /// Why it does not decode.
        reason: String,
    },
    /// The manifest's `name` is empty, too long, of other characters than a safe set, or a
    /// name gpuvisor's own plugins carry (`name` as shown: escaped, cut).
    #[error("policy plugin {path}: the manifest's name \"{name}\" {problem}")]
    Name {
        /// The module file, as configured.
        path: PathBuf,
        /// The name as shown (escaped, cut).
        name: String,
        /// What is wrong with it, as the end of a sentence.
        problem: String,
    },
    /// The manifest's `kinds` do not include the slot the config puts the plugin in.
    #[error("policy plugin {path} ({name}) implements {kinds:?}, not the {slot} slot it is configured for", slot = slot.as_str())]
    WrongSlot {
        /// The module file, as configured.
        path: PathBuf,
        /// The plugin's manifest name.
        name: String,
        /// The slot the config puts it in.
        slot: PolicyKind,
        /// The kinds its manifest lists.
        kinds: Vec<PolicyKind>,
    },
    /// No slot was given and the manifest lists zero or several kinds.
    #[error("policy plugin {path} ({name}) implements {kinds:?}; name the kind to run")]
    AmbiguousKind {
        /// The module file, as configured.
        path: PathBuf,
        /// The plugin's manifest name.
        name: String,
        /// The kinds its manifest lists.
        kinds: Vec<PolicyKind>,
    },
}

/// One plugin call failed. `plugin` is the manifest name (the file path during load),
/// `kind` the entry point called.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The plugin does not implement this kind.
    #[error("policy plugin {plugin} does not implement {}", kind.as_str())]
    NotProvided {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The kind asked for.
        kind: PolicyKind,
    },
    /// The input JSON is larger than `Limits::max_input_bytes`.
    #[error("policy plugin {plugin} ({}): input of {len} bytes exceeds the {max}-byte limit", kind.as_str())]
    InputTooLarge {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// The input's size, bytes.
        len: usize,
        /// `Limits::max_input_bytes`.
        max: usize,
    },
    /// The input could not be encoded as JSON (should not happen for the SDK types).
    #[error("policy plugin {plugin} ({}): the input does not encode as JSON: {reason}", kind.as_str())]
    InputEncode {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// serde_json's error.
        reason: String,
    },
    /// A fresh instance could not be created (e.g. every sandbox slot is in use).
    #[error("policy plugin {plugin} ({}): no sandbox instance could be created: {reason}", kind.as_str())]
    Instantiate {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// wasmtime's error.
        reason: String,
    },
    /// Every place of the slot's share of the sandbox pool stayed taken by other calls of
    /// the slot for the call's whole deadline: the call was not run (see docs/plugins.md and
    /// docs/plugins.md "The sandbox and its limits").
    #[error("policy plugin {plugin} ({}): not run: the {share} slot already had {calls} calls running (its share of the sandbox) for {waited_ms} ms, the call's deadline", kind.as_str())]
    Busy {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// The slot whose share was full (`placement`, `hypervisor`, `grace`).
        share: &'static str,
        /// The calls of the slot running (the size of its share).
        calls: u32,
        /// How long the call waited, ms (its deadline).
        waited_ms: u128,
    },
    /// The plugin trapped (e.g. `unreachable`, a panic, an out-of-bounds access).
    #[error("policy plugin {plugin} ({}) trapped: {message}", kind.as_str())]
    Trap {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// wasmtime's description of the trap.
        message: String,
    },
    /// The instruction budget ran out.
    #[error("policy plugin {plugin} ({}) ran out of fuel ({fuel} units)", kind.as_str())]
    OutOfFuel {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// The budget the call had, fuel units.
        fuel: u64,
    },
    /// The wall-clock deadline passed.
    #[error("policy plugin {plugin} ({}) passed its {deadline_ms} ms deadline", kind.as_str())]
    Deadline {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// The deadline, ms.
        deadline_ms: u128,
    },
    /// The plugin tried to grow its memory beyond `Limits::memory_bytes`.
    #[error("policy plugin {plugin} ({}) hit its memory limit of {limit_bytes} bytes", kind.as_str())]
    MemoryLimit {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// `Limits::memory_bytes`.
        limit_bytes: usize,
    },
    /// The reply is larger than `Limits::max_output_bytes`.
    #[error("policy plugin {plugin} ({}): reply of {len} bytes exceeds the {max}-byte limit", kind.as_str())]
    OutputTooLarge {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// The reply's size, bytes.
        len: usize,
        /// `Limits::max_output_bytes`.
        max: usize,
    },
    /// A pointer the plugin returned lies outside its memory.
    #[error("policy plugin {plugin} ({}): {what} returned a bad pointer ({ptr:#x}, {len} bytes)", kind.as_str())]
    BadPointer {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// The export that returned it.
        what: &'static str,
        /// The pointer returned.
        ptr: u32,
        /// The length returned, bytes.
        len: u32,
    },
    /// The reply is not `{"ok": <answer of this kind>}` or `{"error": "message"}`.
    #[error("policy plugin {plugin} ({}): reply does not decode: {reason}", kind.as_str())]
    UndecodableReply {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// Why it does not decode.
        reason: String,
    },
    /// The plugin answered `{"error": message}`.
    #[error("policy plugin {plugin} ({}) returned an error: {message}", kind.as_str())]
    Plugin {
        /// The plugin's manifest name (its file path during load).
        plugin: String,
        /// The entry point called.
        kind: PolicyKind,
        /// The plugin's message.
        message: String,
    },
}

impl CallError {
    /// A stable short label for metrics (`result` / `reason` label values): `not_provided`,
    /// `input_too_large`, `input_encode`, `instantiate`, `trap`, `out_of_fuel`, `deadline`,
    /// `memory_limit`, `output_too_large`, `bad_pointer`, `undecodable_reply`,
    /// `plugin_error`, `busy`.
    pub fn reason(&self) -> &'static str {
        match self {
            CallError::NotProvided { .. } => "not_provided",
            CallError::InputTooLarge { .. } => "input_too_large",
            CallError::InputEncode { .. } => "input_encode",
            CallError::Instantiate { .. } => "instantiate",
            CallError::Trap { .. } => "trap",
            CallError::OutOfFuel { .. } => "out_of_fuel",
            CallError::Deadline { .. } => "deadline",
            CallError::MemoryLimit { .. } => "memory_limit",
            CallError::OutputTooLarge { .. } => "output_too_large",
            CallError::BadPointer { .. } => "bad_pointer",
            CallError::UndecodableReply { .. } => "undecodable_reply",
            CallError::Plugin { .. } => "plugin_error",
            CallError::Busy { .. } => "busy",
        }
    }
}

/// `run_plugin_file` failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The plugin was refused at load.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The call failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The input file could not be read or is not JSON.
    #[error("input file {path}: {reason}")]
    Input {
        /// The input file.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
}
