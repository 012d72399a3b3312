//! Test helpers: run a policy function natively against a recorded JSON input (a file the
//! agent wrote with `--record-policy-inputs DIR`, or a fixture) and get the reply JSON —
//! exactly the bytes the wasm build would return, decoded as a `serde_json::Value`
//! (`{"ok": answer}` or `{"error": "message"}`).
//!
//! ```ignore
//! let reply = gpuvisor_sdk::testing::run_native_placement("fixtures/input.json", my_plugin::place)?;
//! assert_eq!(reply["ok"]["ranked"][0], "0000:41:00.4");
//! ```
//!
//! To run the built `.wasm` instead, use `gpuvisor plugin test <plugin.wasm> --input <file>`
//! (the agent's plugin host, `gpuvisor_policy::run_plugin_file`).

use crate::abi::{dispatch, IntoReply};
use crate::types::{GraceAnswer, GraceInput, HypervisorAnswer, HypervisorInput, PlacementAnswer, PlacementInput};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

/// Runs `f` on the JSON text `input` and returns the reply JSON. An input that does not
/// decode as `I` gives `{"error": "input does not decode: ..."}`, as in the wasm build.
pub fn run_native_str<I, T, R>(input: &str, f: impl FnOnce(&I) -> R) -> Value
where
    I: DeserializeOwned,
    T: Serialize,
    R: IntoReply<T>,
{
    let bytes = dispatch::<I, T, R>(input.as_bytes(), f);
    // `dispatch` always produces valid JSON.
    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
}

/// Reads the JSON file at `path` and runs `f` on it; see [`run_native_str`].
///
/// Errors: the file cannot be read (`std::io::Error`, naming nothing but the OS cause).
pub fn run_native_file<I, T, R>(path: impl AsRef<Path>, f: impl FnOnce(&I) -> R) -> std::io::Result<Value>
where
    I: DeserializeOwned,
    T: Serialize,
    R: IntoReply<T>,
{
    let text = std::fs::read_to_string(path)?;
    Ok(run_native_str::<I, T, R>(&text, f))
}

/// [`run_native_file`] for a placement function.
pub fn run_native_placement<R: IntoReply<PlacementAnswer>>(
    path: impl AsRef<Path>,
    f: impl FnOnce(&PlacementInput) -> R,
) -> std::io::Result<Value> {
    run_native_file::<PlacementInput, PlacementAnswer, R>(path, f)
}

/// [`run_native_file`] for a hypervisor function.
pub fn run_native_hypervisor<R: IntoReply<HypervisorAnswer>>(
    path: impl AsRef<Path>,
    f: impl FnOnce(&HypervisorInput) -> R,
) -> std::io::Result<Value> {
    run_native_file::<HypervisorInput, HypervisorAnswer, R>(path, f)
}

/// [`run_native_file`] for a grace function.
pub fn run_native_grace<R: IntoReply<GraceAnswer>>(
    path: impl AsRef<Path>,
    f: impl FnOnce(&GraceInput) -> R,
) -> std::io::Result<Value> {
    run_native_file::<GraceInput, GraceAnswer, R>(path, f)
}

/// Reads and decodes a JSON input file (e.g. to tweak a recorded input in a test).
///
/// Errors: the file cannot be read or does not decode as `I` (`std::io::Error` of kind
/// `InvalidData` for the latter).
pub fn load_input<I: DeserializeOwned>(path: impl AsRef<Path>) -> std::io::Result<I> {
    let text = std::fs::read_to_string(path)?;
    serde_json::from_str(&text).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_is_the_ok_envelope() {
        let v = run_native_str::<Value, HypervisorAnswer, _>("{}", |_| HypervisorAnswer::Hypervisor("qemu".into()));
        assert_eq!(v, serde_json::json!({"ok": {"hypervisor": "qemu"}}));
    }
}
