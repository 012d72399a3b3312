//! JSON Schemas of the ABI v1 wire types (feature `schema`), generated from the SDK's own
//! types with `schemars`. The checked-in copies are `docs/schema/v1/<name>.json`; the test
//! `sdk/tests/schema.rs` fails when they differ from what these types generate
//! (regenerate with `GPUVISOR_UPDATE_SCHEMA=1 cargo test -p gpuvisor-sdk --features schema --test schema`).
//!
//! Each schema is self-contained (JSON Schema draft 2020-12, nested types under `$defs`),
//! so any standard validator can check a recorded input or a plugin's reply against one
//! file.

use crate::types::{
    GraceAnswer, GraceInput, HypervisorAnswer, HypervisorInput, Manifest, PlacementAnswer, PlacementInput, Reply,
};
use schemars::JsonSchema;
use serde_json::Value;

fn schema_of<T: JsonSchema>() -> Value {
    schemars::schema_for!(T).to_value()
}

/// Every ABI v1 schema as `(name, schema)`, in a fixed order; the file of each is
/// `docs/schema/v1/<name>.json`.
///
/// - `placement-input`, `hypervisor-input`, `grace-input`: what the agent sends to
///   `gpuvisor_placement`, `gpuvisor_hypervisor`, `gpuvisor_grace`;
/// - `placement-answer`, `hypervisor-answer`, `grace-answer`: the answer inside `{"ok": ..}`;
/// - `placement-reply`, `hypervisor-reply`, `grace-reply`: the whole reply envelope an entry
///   point returns, `{"ok": <answer>}` or `{"error": "message"}`;
/// - `manifest`: what `gpuvisor_manifest()` points at.
pub fn v1_schemas() -> Vec<(&'static str, Value)> {
    vec![
        ("manifest", schema_of::<Manifest>()),
        ("placement-input", schema_of::<PlacementInput>()),
        ("placement-answer", schema_of::<PlacementAnswer>()),
        ("placement-reply", schema_of::<Reply<PlacementAnswer>>()),
        ("hypervisor-input", schema_of::<HypervisorInput>()),
        ("hypervisor-answer", schema_of::<HypervisorAnswer>()),
        ("hypervisor-reply", schema_of::<Reply<HypervisorAnswer>>()),
        ("grace-input", schema_of::<GraceInput>()),
        ("grace-answer", schema_of::<GraceAnswer>()),
        ("grace-reply", schema_of::<Reply<GraceAnswer>>()),
    ]
}
