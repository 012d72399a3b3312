//! # gpuvisor plugin host
//!
//! Loads policy plugins — WebAssembly core modules speaking ABI v1 (PLUGINS.md, the SDK's
//! `abi` module) — into wasmtime and calls them under limits. This is the only crate of the
//! agent that touches wasmtime.
//!
//! Invariants this crate keeps:
//! - a module is compiled once, at [`Plugin::load`], and checked there: only the import
//!   `gpuvisor.log(i32, i32, i32)` (WASI and everything else refused), the ABI v1 exports
//!   with their signatures, `gpuvisor_abi_version() == 1`, a manifest that decodes and
//!   lists the slot the config puts the plugin in;
//! - every call runs in a **fresh instance** (pooled), so no state survives between calls;
//! - every call is bounded by [`Limits`]: fuel, memory, a wall-clock deadline (epoch
//!   interruption driven by one shared ticker thread), input and reply size;
//! - every failure is a [`CallError`] naming the plugin; the caller fails closed
//!   (PLUGINS.md "Failure semantics"). Answers are only *decoded* here; validating them
//!   against the inventory is the agent's job.
//!
//! ```ignore
//! let plugin = Plugin::load(Path::new("/etc/gpuvisor/placement-spread.wasm"),
//!                           PolicyKind::Placement, Limits::default())?;
//! let answer = plugin.call_placement(&input)?;          // PlacementAnswer
//! let stats = plugin.stats();                           // for the metrics
//! ```

// No unwrap() outside tests (STYLE.md): a panic is a crash.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod engine;
mod error;
mod plugin;

pub use engine::{MAX_MEMORY_BYTES, POOL_INSTANCES, TICK};
pub use error::{CallError, LoadError, RunError};
pub use plugin::{Limits, Plugin, PluginStats, LOG_LINES_PER_CALL, LOG_LINES_PER_SECOND, LOG_LINE_MAX_BYTES};

use gpuvisor_sdk::{
    GraceAnswer, GraceInput, HypervisorAnswer, HypervisorInput, PlacementAnswer, PlacementInput, PolicyKind,
};
use std::path::Path;

/// Runs the plugin at `wasm` on the JSON input file `input_json`, as
/// `gpuvisor plugin test <plugin.wasm> --input <file>` does, with default [`Limits`].
///
/// `kind` selects the entry point; `None` takes it from the manifest when it lists exactly
/// one kind. The input must decode as the kind's input type (so what is tested is what the
/// agent could send). Returns the answer (the `ok` member of the reply) after decoding it
/// as the kind's answer type, re-encoded as JSON.
///
/// Errors: [`RunError::Input`] (unreadable file, not JSON, not the kind's input),
/// [`RunError::Load`], [`RunError::Call`] (including the plugin's `{"error": ..}`).
pub fn run_plugin_file(
    wasm: &Path,
    input_json: &Path,
    kind: Option<PolicyKind>,
) -> Result<serde_json::Value, RunError> {
    let input_err = |reason: String| RunError::Input { path: input_json.to_path_buf(), reason };
    let text = std::fs::read_to_string(input_json).map_err(|e| input_err(e.to_string()))?;
    let plugin = match kind {
        Some(kind) => Plugin::load(wasm, kind, Limits::default())?,
        None => Plugin::load_any(wasm, Limits::default())?,
    };
    let encode = |v: Result<serde_json::Value, serde_json::Error>| {
        v.map_err(|e| input_err(format!("the answer does not re-encode: {e}")))
    };
    match plugin.slot() {
        PolicyKind::Placement => {
            let input: PlacementInput = decode(&text).map_err(input_err)?;
            let answer: PlacementAnswer = plugin.call_placement(&input)?;
            encode(serde_json::to_value(answer))
        }
        PolicyKind::Hypervisor => {
            let input: HypervisorInput = decode(&text).map_err(input_err)?;
            let answer: HypervisorAnswer = plugin.call_hypervisor(&input)?;
            encode(serde_json::to_value(answer))
        }
        PolicyKind::Grace => {
            let input: GraceInput = decode(&text).map_err(input_err)?;
            let answer: GraceAnswer = plugin.call_grace(&input)?;
            encode(serde_json::to_value(answer))
        }
    }
}

fn decode<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    serde_json::from_str(text).map_err(|e| format!("not a valid input of this kind: {e}"))
}
