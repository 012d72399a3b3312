//! Bad input on the JSON-RPC surface (docs/design/invariants.md "How they are tested", 8): every method
//! and parameter of the agent's own OpenRPC document (`rpc.discover`) is called with wrong
//! types, huge values, hostile strings (paths, NUL, empty, non-ASCII), unknown fields,
//! missing required parameters and non-object params. Every call must get an answer (the
//! agent never dies), never `internal`, and an error wherever the input is invalid; and
//! nothing is lost: the running GPU instance `keep`, its claim, the image and the host are
//! exactly as before, and no instance, claim or sysfs write appears.

use gpuvisor_e2e::*;
use serde_json::{json, Value};

/// A valid-looking value for a parameter, by name then by schema type. Instance refs name
/// `keep`, so a mutation the agent wrongly accepted would show on it.
fn base_value(name: &str, schema: &Value) -> Value {
    match name {
        "ref" => json!("keep"),
        "name" => json!("fz"),
        "image" => json!("demo"),
        "gpu" | "profile" => json!("L40S-1Q"),
        "device" => json!("0000:41:00.5"),
        "kernel" | "initrd" | "disk" => json!("/nonexistent/fuzz"),
        _ => match schema["type"].as_str().or_else(|| schema["type"][0].as_str()) {
            Some("integer") => json!(1),
            Some("boolean") => json!(false),
            Some("object") => json!({}),
            Some("array") => json!([]),
            // An enum of strings: `enum`, or `oneOf` of documented `const`s.
            _ => schema["enum"].get(0).or_else(|| schema["oneOf"][0].get("const")).cloned().unwrap_or(json!("x")),
        },
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_u64() || n.is_i64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// One call to make and whether it must be refused.
struct Case {
    method: String,
    params: Value,
    what: String,
    must_fail: bool,
}

fn cases(methods: &[Value]) -> Vec<Case> {
    let huge = "a".repeat(1 << 20);
    let hostile =
        ["", " ", "../../../../etc/passwd", "a/b", "ü-名前", "a\u{0}b", "-rf", "$(reboot)", "keep\n", "*", "%s%s%s%n"];
    let wrong = [json!(5), json!("s"), json!(true), json!([1]), json!({"a": 1}), json!(1.5)];
    let mut out = Vec::new();
    for m in methods {
        let method = m["name"].as_str().unwrap().to_string();
        if method == "rpc.discover" {
            continue;
        }
        let params = m["params"].as_array().cloned().unwrap_or_default();
        let base: serde_json::Map<String, Value> = params
            .iter()
            .filter(|p| p["required"] == true)
            .map(|p| (p["name"].as_str().unwrap().to_string(), base_value(p["name"].as_str().unwrap(), &p["schema"])))
            .collect();
        let mut push = |params: Value, what: String, must_fail: bool| {
            out.push(Case { method: method.clone(), params, what, must_fail })
        };
        // Unknown fields are refused.
        let mut p = base.clone();
        p.insert("zz_unknown".into(), json!(1));
        push(Value::Object(p), "unknown field".into(), true);
        // Params that are not an object.
        for v in [json!("keep"), json!(7)] {
            push(v.clone(), format!("params {v}"), true);
        }
        if !base.is_empty() {
            push(json!(["keep"]), "positional params".into(), true);
        }
        for prm in &params {
            let name = prm["name"].as_str().unwrap();
            let required = prm["required"] == true;
            // An optional parameter's schema may say `["integer", "null"]`: its type is the
            // non-null one (null is accepted, as the schema says).
            let ty = match &prm["schema"]["type"] {
                Value::String(s) => s.as_str(),
                Value::Array(a) => a.iter().filter_map(|t| t.as_str()).find(|t| *t != "null").unwrap_or(""),
                _ => "",
            };
            if required {
                let mut p = base.clone();
                p.remove(name);
                push(Value::Object(p), format!("{name} missing"), true);
                let mut p = base.clone();
                p.insert(name.into(), Value::Null);
                push(Value::Object(p), format!("{name} null"), true);
            }
            for w in &wrong {
                let wt = json_type(w);
                // 1.5 is a number but not an integer: wrong for every declared type here.
                if wt == ty && wt != "number" {
                    continue;
                }
                let mut p = base.clone();
                p.insert(name.into(), w.clone());
                push(Value::Object(p), format!("{name} = {w} (schema {ty})"), true);
            }
            match ty {
                "string" => {
                    let mut p = base.clone();
                    p.insert(name.into(), json!(huge));
                    push(Value::Object(p), format!("{name} = 1 MiB string"), false);
                    for h in hostile {
                        let mut p = base.clone();
                        p.insert(name.into(), json!(h));
                        push(Value::Object(p), format!("{name} = {h:?}"), false);
                    }
                }
                "integer" => {
                    for v in [json!(u64::MAX), json!(-1), json!(0), json!(1e300), json!(i64::MIN)] {
                        let mut p = base.clone();
                        p.insert(name.into(), v.clone());
                        push(Value::Object(p), format!("{name} = {v}"), false);
                    }
                }
                "object" => {
                    let mut p = base.clone();
                    p.insert(name.into(), json!({"k": 5, "n": null, "a": [1]}));
                    push(Value::Object(p), format!("{name} with non-string values"), true);
                }
                _ => {}
            }
        }
    }
    out
}

#[test]
fn every_method_survives_bad_input_from_its_own_openrpc_document_and_nothing_is_lost() {
    let wrap = QemuWrapper::new();
    let a = Agent::start_with(AgentOptions { model: HOST_V, extra: &wrap.extra(), ..Default::default() }).unwrap();
    let keep = a.create_gpu("keep", "L40S-2Q").unwrap();
    let vf = keep["gpu"]["device"].as_str().unwrap().to_string();
    let claims_before = a.claims();
    let writes_before = writes(&a.state()).len();
    let images_before = a.ok("image.list", json!({}));
    let doc = a.ok("rpc.discover", json!({}));
    let methods = doc["methods"].as_array().unwrap().clone();
    let cases = cases(&methods);
    let mut problems = Vec::new();
    let mut refused = 0;
    for c in &cases {
        let short = {
            let s = c.params.to_string();
            if s.len() > 120 {
                format!("{}…", &s[..s.char_indices().nth(120).map(|(i, _)| i).unwrap_or(s.len())])
            } else {
                s
            }
        };
        match a.call(&c.method, c.params.clone()) {
            Ok(v) if c.must_fail => {
                problems.push(format!("{} {}: accepted: {}", c.method, c.what, tail(&v.to_string(), 1)))
            }
            Ok(_) => eprintln!("accepted: {} {}: {short}", c.method, c.what),
            Err(e) if is_transport(&e) => {
                problems.push(format!("{} {}: no answer ({e}); params {short}", c.method, c.what));
                break;
            }
            Err(e) if e.data_code == "internal" => {
                problems.push(format!("{} {}: internal error: {e}", c.method, c.what))
            }
            Err(_) => refused += 1,
        }
    }
    eprintln!("{} calls over {} methods, {refused} refused", cases.len(), methods.len());
    // Nothing lost, nothing made.
    match a.call("instance.get", json!({"ref": "keep"})) {
        Ok(k) if k["state"] == "running" && k["gpu"]["device"] == vf.as_str() => {}
        other => problems.push(format!("keep changed: {other:?}")),
    }
    if a.instance_names() != vec!["keep".to_string()] {
        problems.push(format!("instances now: {:?}", a.instance_names()));
    }
    if a.claims() != claims_before {
        problems.push(format!("claims changed: {:?}", a.claims()));
    }
    if writes(&a.state()).len() != writes_before {
        problems.push(format!("sysfs writes: {:?}", &writes(&a.state())[writes_before..]));
    }
    if a.ok("image.list", json!({})) != images_before {
        problems.push("the image list changed".into());
    }
    for v in World::observe(&a).safety_violations(&[]) {
        problems.push(v);
    }
    assert!(problems.is_empty(), "{} problems:\n{}", problems.len(), problems.join("\n"));
}
