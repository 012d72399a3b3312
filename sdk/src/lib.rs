//! # gpuvisor plugin SDK
//!
//! The types that cross the plugin boundary (the single source of the policy contract:
//! the agent and every plugin use these), the [`export_plugin!`] macro that turns plain
//! Rust functions into a plugin with the ABI v1 exports, and [`testing`] helpers that run a
//! policy function natively against recorded JSON inputs.
//!
//! The SDK depends on `serde` and `serde_json` only, so it builds for
//! `wasm32-unknown-unknown`. The optional feature `schema` adds `schemars` and the
//! [`schema`] module (JSON Schemas of the wire types); plugins leave it off.
//!
//! ABI v1 (see `docs/plugins.md`): the module exports `memory`, `gpuvisor_abi_version`,
//! `gpuvisor_alloc`, `gpuvisor_free`, `gpuvisor_manifest` and one entry point per policy
//! kind (`gpuvisor_placement`, `gpuvisor_hypervisor`, `gpuvisor_grace`). Every entry point
//! takes `(ptr: i32, len: i32)` of a UTF-8 JSON input and returns a packed
//! `(ptr << 32) | len` of a UTF-8 JSON reply `{"ok": <answer>}` or `{"error": "message"}`.
//! The only import a plugin may have is `gpuvisor.log(level: i32, ptr: i32, len: i32)`.
//!
//! ABI v2 (feature `v2`, module [`v2`]): the plugin is a WebAssembly component of one of
//! the worlds of `wit/policy.wit` (package `gpuvisor:policy@2.0.0`), with bindings from
//! `wit-bindgen`; `export_plugin_v2!` generates its exports from the same policy functions.
//! The feature is off by default, so v1 plugins and the agent do not build `wit-bindgen`.

pub mod abi;
#[cfg(feature = "schema")]
pub mod schema;
pub mod testing;
pub mod types;
#[cfg(feature = "v2")]
pub mod v2;

pub use types::*;
