//! The OpenRPC document `rpc.discover` returns: every method with its parameters and the
//! stable error codes it can answer (LIFECYCLE.md "Errors").

use serde_json::{json, Value};

/// One method: name, summary, params `(name, JSON schema, required)`, error codes.
pub struct Method {
    pub name: &'static str,
    pub summary: &'static str,
    pub params: &'static [(&'static str, &'static str, bool)],
    pub errors: &'static [&'static str],
}

const REF: (&str, &str, bool) = ("ref", r#"{"type":"string","description":"instance id or name"}"#, true);

/// Every JSON-RPC method the agent serves (a test checks this against the module).
pub const METHODS: &[Method] = &[
    Method {
        name: "instance.create",
        summary: "Create an instance and boot it; with `gpu` a vGPU of that profile is claimed and configured first.",
        params: &[
            ("name", r#"{"type":"string","pattern":"^[a-z0-9][a-z0-9-]{0,62}$"}"#, true),
            ("image", r#"{"type":"string"}"#, true),
            ("gpu", r#"{"type":"string","description":"vGPU profile, e.g. L40S-2Q"}"#, false),
            ("labels", r#"{"type":"object","additionalProperties":{"type":"string","maxLength":255},"maxProperties":64}"#, false),
            ("vcpus", r#"{"type":"integer","minimum":1,"maximum":64}"#, false),
            ("memory_mib", r#"{"type":"integer","minimum":64}"#, false),
            ("hypervisor", r#"{"type":"string","enum":["qemu","cloud-hypervisor"]}"#, false),
        ],
        errors: &[
            "invalid_request",
            "unknown_profile",
            "hypervisor_unsupported",
            "name_taken",
            "no_capacity",
            "not_ready",
            "policy_failed",
            "vmm_start_failed",
            "vgpu_cleanup_pending",
            "internal",
        ],
    },
    Method {
        name: "instance.get",
        summary: "One instance, with `gpu` derived from its claim.",
        params: &[REF],
        errors: &["not_found"],
    },
    Method { name: "instance.list", summary: "Every instance.", params: &[], errors: &["internal"] },
    Method {
        name: "instance.start",
        summary: "Start a stopped instance (claims a device again).",
        params: &[REF],
        errors: &[
            "not_found",
            "invalid_state",
            "instance_cleanup_pending",
            "gpu_release_pending",
            "no_capacity",
            "not_ready",
            "policy_failed",
            "vmm_start_failed",
            "vgpu_cleanup_pending",
        ],
    },
    Method {
        name: "instance.stop",
        summary: "Power the guest off (or kill with force), then release its device.",
        params: &[REF, ("force", r#"{"type":"boolean"}"#, false)],
        errors: &["not_found", "instance_cleanup_pending", "vmm_liveness_unknown", "vmm_kill_failed"],
    },
    Method {
        name: "instance.delete",
        summary: "Kill the VMM, release the device, remove the instance.",
        params: &[REF],
        errors: &["not_found", "vmm_liveness_unknown", "vmm_kill_failed", "vgpu_cleanup_pending"],
    },
    Method {
        name: "instance.fork",
        summary: "A new stopped instance with the source's definition and GPU profile; never its claim or VMM.",
        params: &[REF, ("name", r#"{"type":"string","pattern":"^[a-z0-9][a-z0-9-]{0,62}$"}"#, true)],
        errors: &["not_found", "invalid_request", "name_taken", "instance_cleanup_pending"],
    },
    Method {
        name: "instance.standby",
        summary: "Refused for cleanup_pending instances and running vGPU instances; not implemented for plain instances yet.",
        params: &[REF],
        errors: &["not_found", "instance_cleanup_pending", "unsupported_with_gpu", "invalid_request"],
    },
    Method {
        name: "instance.snapshot",
        summary: "Refused for cleanup_pending instances and running vGPU instances; not implemented for plain instances yet.",
        params: &[REF],
        errors: &["not_found", "instance_cleanup_pending", "unsupported_with_gpu", "invalid_request"],
    },
    Method {
        name: "instance.restore",
        summary: "Refused for cleanup_pending instances; not implemented yet (a restore never brings back a claim or VMM identity).",
        params: &[REF, ("snapshot", r#"{"type":"string"}"#, false)],
        errors: &["not_found", "instance_cleanup_pending", "invalid_request"],
    },
    Method {
        name: "resources.get",
        summary: "GPU mode, device counts, placeable count per profile.",
        params: &[],
        errors: &[],
    },
    Method {
        name: "gpu.list",
        summary: "Every GPU and device: address, current type, claim owner, quarantine.",
        params: &[],
        errors: &["not_ready"],
    },
    Method {
        name: "gpu.unquarantine",
        summary: "Clear a device's quarantine mark after repair.",
        params: &[("device", r#"{"type":"string"}"#, true)],
        errors: &["not_found"],
    },
    Method {
        name: "placement.dry_run",
        summary: "What the placement plugin would choose for a profile now (claims nothing).",
        params: &[
            ("profile", r#"{"type":"string"}"#, true),
            ("name", r#"{"type":"string"}"#, false),
            ("labels", r#"{"type":"object","additionalProperties":{"type":"string","maxLength":255},"maxProperties":64}"#, false),
        ],
        errors: &["unknown_profile", "no_capacity", "not_ready", "policy_failed"],
    },
    Method {
        name: "image.import",
        summary: "Copy a kernel (and initrd) into the images directory.",
        params: &[
            ("name", r#"{"type":"string"}"#, true),
            ("kernel", r#"{"type":"string","description":"path on the host"}"#, true),
            ("initrd", r#"{"type":"string"}"#, false),
            ("cmdline", r#"{"type":"string"}"#, false),
        ],
        errors: &["invalid_request", "name_taken"],
    },
    Method { name: "image.list", summary: "Every image.", params: &[], errors: &[] },
    Method {
        name: "image.delete",
        summary: "Delete an image.",
        params: &[("name", r#"{"type":"string"}"#, true)],
        errors: &["not_found"],
    },
    Method {
        name: "reconcile.run",
        summary: "Run one reconcile pass now and return its report (kept, released, failed, records changed).",
        params: &[],
        errors: &[],
    },
    Method {
        name: "plugin.reload",
        summary: "Re-read the [plugins] config and load every plugin again; on any error the old plugins stay.",
        params: &[],
        errors: &["invalid_request"],
    },
    Method { name: "plugin.list", summary: "The loaded policy plugins with call counts.", params: &[], errors: &[] },
    Method { name: "agent.health", summary: "Liveness and readiness.", params: &[], errors: &[] },
    Method { name: "agent.metrics", summary: "Prometheus text exposition.", params: &[], errors: &[] },
    Method { name: "rpc.discover", summary: "This OpenRPC document.", params: &[], errors: &[] },
];

fn error_class(code: &str) -> i64 {
    match code {
        "invalid_request" | "unknown_profile" | "hypervisor_unsupported" => 400,
        "not_found" => 404,
        "not_ready" | "vmm_liveness_unknown" => 503,
        "vgpu_cleanup_pending"
        | "vmm_start_failed"
        | "vmm_kill_failed"
        | "passthrough_bind_failed"
        | "policy_failed"
        | "internal" => 500,
        _ => 409,
    }
}

/// The OpenRPC 1.2 document.
pub fn document() -> Value {
    let methods: Vec<Value> = METHODS
        .iter()
        .map(|m| {
            json!({
                "name": m.name,
                "summary": m.summary,
                "paramStructure": "by-name",
                "params": m.params.iter().map(|(n, schema, req)| json!({
                    "name": n,
                    "required": req,
                    "schema": serde_json::from_str::<Value>(schema).unwrap_or(Value::Null),
                })).collect::<Vec<_>>(),
                "result": { "name": "result", "schema": { "type": if m.name == "agent.metrics" { "string" } else { "object" } } },
                "errors": m.errors.iter().map(|c| json!({
                    "code": error_class(c), "message": c, "data": { "code": c },
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
