//! # gpuvisor plugin host
//!
//! Loads policy plugins into wasmtime and calls them under limits: WebAssembly core
//! modules speaking ABI v1 (JSON; docs/plugins.md, the SDK's `abi` module; `core_module.rs`)
//! and components of the WIT package `gpuvisor:policy@2.0.0` (ABI v2, `sdk/wit/policy.wit`;
//! `component.rs`), side by side behind one [`Plugin`] (`plugin.rs`: the one host
//! sequence). This is the only crate of the agent that touches wasmtime.
//!
//! Invariants this crate keeps:
//! - a plugin is compiled once, at [`Plugin::load`] (or read compiled from the cache of
//!   [`set_cache_dir`]), and checked there. A module: only the import
//!   `gpuvisor.log(i32, i32, i32)` (WASI and everything else refused), the ABI v1 exports
//!   with their signatures, `gpuvisor_abi_version() == 1`. A component: only the imports
//!   `gpuvisor:policy/{log,types}@2.0.0` and WASI 0.2 (implemented to grant nothing), the
//!   kind interfaces at `@2.0.0`, a manifest with `abi-version` 2 whose kinds are its
//!   exports. Both: a manifest that decodes and lists the slot the config puts the plugin
//!   in;
//! - every call runs in a **fresh instance** (pooled), so no state survives between calls;
//! - every call is bounded by [`Limits`]: fuel, memory, a wall-clock deadline (epoch
//!   interruption driven by one shared ticker thread), input and reply size;
//! - every failure is a [`CallError`] naming the plugin; the caller fails closed
//!   (docs/plugins.md "Failure semantics"). Answers are only *decoded* here; validating them
//!   against the inventory is the agent's job.
//!
//! ```ignore
//! let plugin = Plugin::load(Path::new("/etc/gpuvisor/placement-spread.wasm"),
//!                           PolicyKind::Placement, Limits::default())?;
//! let answer = plugin.call_placement(&input)?;          // PlacementAnswer
//! let stats = plugin.stats();                           // for the metrics
//! ```

// No unwrap() outside tests (docs/design/style.md): a panic is a crash.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod cache;
mod component;
mod core_module;
mod engine;
mod error;
mod plugin;
mod text;
mod wasi;

pub use cache::{set_cache_dir, CacheOutcome};
pub use component::{ABI_VERSION_V2, PACKAGE, PACKAGE_VERSION};
pub use engine::SLOT_CALLS;
pub use engine::{MAX_MEMORY_BYTES, POOL_INSTANCES, TICK};
pub use error::{CallError, LoadError, RunError};
pub use plugin::{
    CallReport, Limits, LogLine, Plugin, PluginStats, LOAD_DEADLINE, LOG_LINES_PER_CALL, LOG_LINES_PER_SECOND,
    LOG_LINE_MAX_BYTES, MAX_NAME_BYTES, RESERVED_NAMES,
};
pub use text::{printable, shown, MAX_TEXT_BYTES};
pub use wasi::STDIO_CAPTURE_BYTES;

use gpuvisor_sdk::{
    GraceAnswer, GraceInput, HypervisorAnswer, HypervisorInput, PlacementAnswer, PlacementInput, PolicyKind,
};
use std::path::Path;

/// A policy input read from a file: either the input JSON alone (a fixture, or a file an
/// older agent recorded) or a recording of the agent's `record_policy_inputs`
/// ([`Recording`]), which also holds the answer the agent got.
#[derive(Debug, Clone)]
pub struct InputFile {
    /// The input, as sent to the plugin.
    pub input: serde_json::Value,
    /// The recorded kind, when the file is a [`Recording`].
    pub kind: Option<PolicyKind>,
    /// The recorded reply (`{"ok": ..}` or `{"error": {"reason", "message"}}`), when the
    /// file is a [`Recording`].
    pub answer: Option<serde_json::Value>,
}

/// What `record_policy_inputs` writes per call: `{"recorded": "gpuvisor policy call",
/// "kind", "plugin", "input", "answer"}`; `answer` is `{"ok": <answer>}` or
/// `{"error": {"reason": .., "message": ..}}` ([`reply_json`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Recording<'a, I: serde::Serialize> {
    /// Always [`RECORDING_TAG`]: tells a recording from a bare input.
    pub recorded: &'static str,
    /// The policy kind called.
    pub kind: PolicyKind,
    /// The plugin's manifest name.
    pub plugin: &'a str,
    /// The input the agent sent (a `PlacementInput`, `HypervisorInput` or `GraceInput`).
    pub input: &'a I,
    /// The reply: `{"ok": <answer>}` or `{"error": {"reason", "message"}}`.
    pub answer: serde_json::Value,
}

/// The `recorded` member of a [`Recording`].
pub const RECORDING_TAG: &str = "gpuvisor policy call";

/// A call's result as JSON, as recorded and as `plugin test` compares it: `{"ok": answer}`
/// or `{"error": {"reason": .., "message": ..}}`.
pub fn reply_json<A: serde::Serialize>(result: &Result<A, CallError>) -> serde_json::Value {
    match result {
        Ok(a) => serde_json::json!({ "ok": serde_json::to_value(a).unwrap_or(serde_json::Value::Null) }),
        Err(e) => serde_json::json!({ "error": { "reason": e.reason(), "message": e.to_string() } }),
    }
}

/// A reply of [`reply_json`] (or a recorded one) in the form two replies are compared in:
/// an error's message without the `policy plugin <name>` it starts with, so that two
/// plugins (or a plugin and the one recorded) failing the same way compare equal.
pub fn comparable_reply(reply: &serde_json::Value) -> serde_json::Value {
    let mut r = reply.clone();
    if let Some(serde_json::Value::String(m)) = r.pointer_mut("/error/message") {
        if let Some(rest) = m.strip_prefix("policy plugin ") {
            // A manifest name has no spaces (it is checked at load).
            *m = rest.split_once(' ').map(|(_, after)| after.to_string()).unwrap_or_default();
        }
    }
    r
}

/// Reads a policy input file ([`InputFile`]). Errors: [`RunError::Input`] (unreadable,
/// not JSON).
pub fn read_input_file(path: &Path) -> Result<InputFile, RunError> {
    let input_err = |reason: String| RunError::Input { path: path.to_path_buf(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| input_err(e.to_string()))?;
    let mut v: serde_json::Value = serde_json::from_str(&text).map_err(|e| input_err(format!("not JSON: {e}")))?;
    if v.get("recorded").and_then(|t| t.as_str()) == Some(RECORDING_TAG) {
        let kind = v.get("kind").cloned().and_then(|k| serde_json::from_value(k).ok());
        let answer = v.get_mut("answer").map(serde_json::Value::take);
        let input = v
            .get_mut("input")
            .map(serde_json::Value::take)
            .ok_or_else(|| input_err("a recording without an input".into()))?;
        return Ok(InputFile { input, kind, answer });
    }
    Ok(InputFile { input: v, kind: None, answer: None })
}

/// Calls `plugin` (its slot's entry point) on `input`, after checking that `input` decodes
/// as the kind's input type (so what is tested is what the agent could send); the answer
/// is decoded as the kind's answer type and re-encoded as JSON. Returns the call's result
/// and its [`CallReport`] (log lines, fuel, wall time).
///
/// Errors: `Err(reason)` when the input is not a valid input of the kind (nothing called).
pub fn run_input(
    plugin: &Plugin,
    input: &serde_json::Value,
) -> Result<(Result<serde_json::Value, CallError>, CallReport), String> {
    fn go<
        I: serde::de::DeserializeOwned + serde::Serialize + 'static,
        A: serde::de::DeserializeOwned + serde::Serialize + 'static,
    >(
        plugin: &Plugin,
        input: &serde_json::Value,
    ) -> Result<(Result<serde_json::Value, CallError>, CallReport), String> {
        let typed: I = I::deserialize(input).map_err(|e| format!("not a valid input of this kind: {e}"))?;
        let (result, report) = plugin.call_report::<I, A>(plugin.slot(), &typed);
        let result = result.map(|a| serde_json::to_value(a).unwrap_or(serde_json::Value::Null));
        Ok((result, report))
    }
    match plugin.slot() {
        PolicyKind::Placement => go::<PlacementInput, PlacementAnswer>(plugin, input),
        PolicyKind::Hypervisor => go::<HypervisorInput, HypervisorAnswer>(plugin, input),
        PolicyKind::Grace => go::<GraceInput, GraceAnswer>(plugin, input),
    }
}

/// Runs the plugin at `wasm` on the JSON input file `input_json` (a bare input or a
/// [`Recording`]) with default [`Limits`].
///
/// `kind` selects the entry point; `None` takes it from the manifest when it lists exactly
/// one kind. The input must decode as the kind's input type. Returns the answer (the `ok`
/// member of the reply) after decoding it as the kind's answer type, re-encoded as JSON.
///
/// Errors: [`RunError::Input`] (unreadable file, not JSON, not the kind's input),
/// [`RunError::Load`], [`RunError::Call`] (including the plugin's `{"error": ..}`).
pub fn run_plugin_file(
    wasm: &Path,
    input_json: &Path,
    kind: Option<PolicyKind>,
) -> Result<serde_json::Value, RunError> {
    let file = read_input_file(input_json)?;
    let plugin = match kind {
        Some(kind) => Plugin::load(wasm, kind, Limits::default())?,
        None => Plugin::load_any(wasm, Limits::default())?,
    };
    let (result, _report) =
        run_input(&plugin, &file.input).map_err(|reason| RunError::Input { path: input_json.to_path_buf(), reason })?;
    Ok(result?)
}
