//! The OpenRPC document `rpc.discover` returns: every method of the table
//! ([`super::api`]) with its parameter and result schemas — generated (`schemars`) from the very types the agent decodes and returns, so
//! every limit the agent enforces is stated — and the stable error codes it can answer
//! (docs/design/lifecycle.md "Errors"), with their classes from [`ErrorCode::class`].

use super::api::methods;
use schemars::generate::SchemaSettings;
use schemars::{Schema, SchemaGenerator};
use serde_json::{json, Value};

/// The schema generator: draft-07, every subschema inline (OpenRPC content descriptors
/// carry plain schemas).
fn generator() -> SchemaGenerator {
    SchemaSettings::draft07()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .into_generator()
}

/// The parameters of a method as OpenRPC content descriptors (by name).
fn params_of(schema: &Schema) -> Vec<Value> {
    let v = schema.as_value();
    let required: Vec<&str> = v
        .get("required")
        .and_then(|r| r.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    let mut out = Vec::new();
    if let Some(props) = v.get("properties").and_then(|p| p.as_object()) {
        for (name, s) in props {
            out.push(json!({
                "name": name,
                "required": required.contains(&name.as_str()),
                "schema": s,
            }));
        }
    }
    out
}

/// The OpenRPC 1.2 document.
pub fn document() -> Value {
    let mut g = generator();
    let methods: Vec<Value> = methods()
        .iter()
        .map(|m| {
            let params = m.params.map(|p| params_of(&p(&mut g))).unwrap_or_default();
            json!({
                "name": m.name,
                "summary": m.summary,
                "paramStructure": "by-name",
                "params": params,
                "result": { "name": "result", "schema": (m.result)(&mut g) },
                "errors": m.errors.iter().map(|c| json!({
                    "code": c.class(), "message": c.as_str(), "data": { "code": c.as_str() },
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "openrpc": "1.2.6",
        "info": { "title": "gpuvisor", "version": env!("CARGO_PKG_VERSION"),
                  "description": "JSON-RPC 2.0 over HTTP on a Unix socket. Errors carry data.code (a stable string)." },
        "methods": methods,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;
    use crate::instances::request::{CreateRequest, NAME_PATTERN};

    fn param_schema(method: &str, param: &str) -> Value {
        let doc = document();
        let m = doc["methods"].as_array().unwrap().iter().find(|m| m["name"] == method).unwrap().clone();
        m["params"].as_array().unwrap().iter().find(|p| p["name"] == param).unwrap()["schema"].clone()
    }

    /// A client validating against the document and the agent agree: every probe value is
    /// accepted by both or refused by both.
    #[test]
    fn the_schema_and_the_agent_agree_on_names_labels_and_bounds() {
        let create = |v: Value| -> bool {
            serde_json::from_value::<CreateRequest>(v).map(|r| r.validate().is_ok()).unwrap_or(false)
        };
        let doc = document();
        let m = doc["methods"].as_array().unwrap().iter().find(|m| m["name"] == "instance.create").unwrap().clone();
        let mut props = serde_json::Map::new();
        let mut required = vec![];
        for p in m["params"].as_array().unwrap() {
            props.insert(p["name"].as_str().unwrap().to_string(), p["schema"].clone());
            if p["required"] == true {
                required.push(p["name"].clone());
            }
        }
        let schema =
            json!({"type": "object", "properties": props, "required": required, "additionalProperties": false});
        let validator = jsonschema::validator_for(&schema).unwrap();
        let k = |n: usize| "k".repeat(n);
        let probes = vec![
            json!({"name": "a", "image": "demo"}),
            json!({"name": "A", "image": "demo"}),
            json!({"name": "-a", "image": "demo"}),
            json!({"name": "a".repeat(63), "image": "demo"}),
            json!({"name": "a".repeat(64), "image": "demo"}),
            json!({"name": "a", "image": "demo", "vcpus": 0}),
            json!({"name": "a", "image": "demo", "vcpus": 64}),
            json!({"name": "a", "image": "demo", "vcpus": 65}),
            json!({"name": "a", "image": "demo", "memory_mib": 63}),
            json!({"name": "a", "image": "demo", "memory_mib": 1_048_576}),
            json!({"name": "a", "image": "demo", "memory_mib": 1_048_577}),
            json!({"name": "a", "image": "demo", "labels": {"tenant": "x"}}),
            json!({"name": "a", "image": "demo", "labels": {k(63): "x"}}),
            json!({"name": "a", "image": "demo", "labels": {k(64): "x"}}),
            json!({"name": "a", "image": "demo", "labels": {"": "x"}}),
            json!({"name": "a", "image": "demo", "labels": {"k": "v".repeat(255)}}),
            json!({"name": "a", "image": "demo", "labels": {"k": "v".repeat(256)}}),
            json!({"name": "a", "image": "demo", "labels": {"k": "é"}}),
            json!({"name": "a", "image": "demo", "labels": {"k é": "v"}}),
            json!({"name": "a", "image": "demo", "hypervisor": "xen"}),
            json!({"name": "a", "image": "demo", "hypervisor": "cloud-hypervisor"}),
            json!({"name": "a", "image": "demo", "labels": (0..65).map(|i| (format!("k{i}"), json!(""))).collect::<serde_json::Map<_, _>>()}),
            json!({"name": "a", "image": "demo", "force": true}),
        ];
        for p in probes {
            assert_eq!(validator.is_valid(&p), create(p.clone()), "schema and agent disagree on {p}");
        }
        assert_eq!(param_schema("instance.create", "name")["pattern"], NAME_PATTERN);
    }

    #[test]
    fn every_method_has_a_result_schema_and_errors_with_their_class() {
        let doc = document();
        for m in doc["methods"].as_array().unwrap() {
            assert!(m["result"]["schema"].is_object(), "{}", m["name"]);
            for e in m["errors"].as_array().unwrap() {
                let code = ErrorCode::from_name(e["data"]["code"].as_str().unwrap()).unwrap();
                assert_eq!(e["code"], code.class());
            }
        }
    }
}
