//! # rpc — JSON-RPC 2.0 on a Unix socket (jsonrpsee, HTTP transport)
//!
//! A request is an HTTP/1.1 `POST /` with a JSON-RPC body, so
//! `curl --unix-socket /run/gpuvisor/gpuvisor.sock -H 'content-type: application/json' -d '{"jsonrpc":"2.0","id":1,"method":"agent.health"}' http://x/`
//! works. Methods are `noun.verb`; [`openrpc::METHODS`] lists every one and `rpc.discover`
//! publishes them as an OpenRPC document. This layer is thin: it parses parameters, runs
//! the lifecycle on a blocking thread, and is the one place that maps [`ApiError`] to a
//! JSON-RPC error object: numeric `code` = the class (400/404/409/500/503), `data` =
//! `{"code": "<stable string>", ...details}`.

pub mod client;
pub mod metrics;
pub mod openrpc;

use crate::error::ApiError;
use crate::instances::{CreateRequest, Manager};
use jsonrpsee::types::ErrorObjectOwned;
use jsonrpsee::RpcModule;
use serde::Deserialize;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

fn to_rpc_error(e: ApiError) -> ErrorObjectOwned {
    ErrorObjectOwned::owned(e.code.class(), e.message.clone(), Some(e.data()))
}

/// Runs a blocking lifecycle call off the async runtime and maps its error.
async fn blocking<F>(method: &'static str, m: &Arc<Manager>, f: F) -> Result<Value, ErrorObjectOwned>
where
    F: FnOnce(&Manager) -> Result<Value, ApiError> + Send + 'static,
{
    let m = m.clone();
    let started = std::time::Instant::now();
    let res = tokio::task::spawn_blocking(move || f(&m))
        .await
        .map_err(|e| to_rpc_error(ApiError::internal(format!("operation panicked: {e}"))))
        .and_then(|r| r.map_err(to_rpc_error));
    let elapsed = started.elapsed();
    metrics::observe_rpc(method, res.is_ok(), elapsed.as_secs_f64());
    tracing::debug!(method, duration_ms = elapsed.as_millis() as u64, ok = res.is_ok(), "rpc call done");
    res
}

/// `{"ref": "<id or name>"}` for instance methods.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RefParams {
    #[serde(alias = "id", alias = "name")]
    r#ref: String,
    #[serde(default)]
    force: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkParams {
    #[serde(alias = "id")]
    r#ref: String,
    name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SaveParams {
    #[serde(alias = "id", alias = "name")]
    r#ref: String,
    #[serde(default)]
    #[allow(dead_code)]
    snapshot: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DryRunParams {
    profile: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    labels: crate::config::Labels,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ImportParams {
    name: String,
    kernel: std::path::PathBuf,
    #[serde(default)]
    initrd: Option<std::path::PathBuf>,
    #[serde(default)]
    cmdline: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NameParams {
    name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceParams {
    device: String,
}

fn invalid_params(msg: String) -> ErrorObjectOwned {
    ErrorObjectOwned::owned(jsonrpsee::types::error::INVALID_PARAMS_CODE, msg, None::<()>)
}

/// Parses object parameters; absent params parse as `{}`. Positional (array) params are
/// refused: every method is declared `paramStructure: by-name` in the OpenRPC document, and
/// serde would otherwise bind `["a", true]` to fields by order.
fn parse<T: serde::de::DeserializeOwned>(p: &jsonrpsee::types::Params<'_>) -> Result<T, ErrorObjectOwned> {
    let Some(raw) = p.as_str() else {
        return serde_json::from_value(json!({})).map_err(|e| invalid_params(format!("invalid params: {e}")));
    };
    if !raw.trim_start().starts_with('{') {
        return Err(invalid_params("invalid params: params must be an object of named parameters".into()));
    }
    p.parse::<T>()
}

/// For methods without parameters: absent, `null`, `{}` or `[]` only (an unknown parameter
/// is an error here as everywhere else).
fn no_params(p: &jsonrpsee::types::Params<'_>) -> Result<(), ErrorObjectOwned> {
    let Some(raw) = p.as_str() else { return Ok(()) };
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Null) => Ok(()),
        Ok(Value::Object(o)) if o.is_empty() => Ok(()),
        Ok(Value::Array(a)) if a.is_empty() => Ok(()),
        _ => Err(invalid_params(format!("invalid params: this method takes no parameters, got {raw}"))),
    }
}

/// Builds the module with every method of [`openrpc::METHODS`].
pub fn module(m: Arc<Manager>) -> anyhow::Result<RpcModule<Arc<Manager>>> {
    let mut module = RpcModule::new(m);
    module.register_async_method("instance.create", |p, m, _| async move {
        let req: CreateRequest = parse(&p)?;
        blocking("instance.create", &m, move |m| m.create(req)).await
    })?;
    module.register_async_method("instance.get", |p, m, _| async move {
        let r: RefParams = parse(&p)?;
        blocking("instance.get", &m, move |m| m.get(&r.r#ref)).await
    })?;
    module.register_async_method("instance.list", |p, m, _| async move {
        no_params(&p)?;
        blocking("instance.list", &m, |m| m.list()).await
    })?;
    module.register_async_method("instance.start", |p, m, _| async move {
        let r: RefParams = parse(&p)?;
        blocking("instance.start", &m, move |m| m.start(&r.r#ref)).await
    })?;
    module.register_async_method("instance.stop", |p, m, _| async move {
        let r: RefParams = parse(&p)?;
        blocking("instance.stop", &m, move |m| m.stop(&r.r#ref, r.force)).await
    })?;
    module.register_async_method("instance.delete", |p, m, _| async move {
        let r: RefParams = parse(&p)?;
        blocking("instance.delete", &m, move |m| m.delete(&r.r#ref)).await
    })?;
    module.register_async_method("instance.fork", |p, m, _| async move {
        let f: ForkParams = parse(&p)?;
        blocking("instance.fork", &m, move |m| m.fork(&f.r#ref, &f.name)).await
    })?;
    for op in ["standby", "snapshot", "restore"] {
        let method: &'static str = match op {
            "standby" => "instance.standby",
            "snapshot" => "instance.snapshot",
            _ => "instance.restore",
        };
        module.register_async_method(method, move |p, m, _| async move {
            let s: SaveParams = parse(&p)?;
            blocking(method, &m, move |m| m.save_state_op(&s.r#ref, op)).await
        })?;
    }
    module.register_async_method("resources.get", |p, m, _| async move {
        no_params(&p)?;
        blocking("resources.get", &m, |m| m.resources()).await
    })?;
    module.register_async_method("gpu.list", |p, m, _| async move {
        no_params(&p)?;
        blocking("gpu.list", &m, |m| m.gpus()).await
    })?;
    module.register_async_method("gpu.unquarantine", |p, m, _| async move {
        let d: DeviceParams = parse(&p)?;
        blocking("gpu.unquarantine", &m, move |m| m.unquarantine(&d.device)).await
    })?;
    module.register_async_method("placement.dry_run", |p, m, _| async move {
        let d: DryRunParams = parse(&p)?;
        blocking("placement.dry_run", &m, move |m| m.dry_run(&d.profile, d.name, d.labels)).await
    })?;
    module.register_async_method("image.import", |p, m, _| async move {
        let i: ImportParams = parse(&p)?;
        blocking("image.import", &m, move |m| {
            let img =
                crate::images::import(&m.store().images_dir(), &i.name, &i.kernel, i.initrd.as_deref(), i.cmdline)?;
            Ok(serde_json::to_value(img).unwrap_or(Value::Null))
        })
        .await
    })?;
    module.register_async_method("image.list", |p, m, _| async move {
        no_params(&p)?;
        blocking("image.list", &m, |m| Ok(json!({ "images": crate::images::list(&m.store().images_dir()) }))).await
    })?;
    module.register_async_method("image.delete", |p, m, _| async move {
        let n: NameParams = parse(&p)?;
        blocking("image.delete", &m, move |m| {
            crate::images::delete(&m.store().images_dir(), &n.name)?;
            Ok(json!({ "name": n.name, "deleted": true }))
        })
        .await
    })?;
    module.register_async_method("plugin.list", |p, m, _| async move {
        no_params(&p)?;
        blocking("plugin.list", &m, |m| {
            let p = m.policies();
            let mut out = vec![plugin_json("placement", &p.placement), plugin_json("hypervisor", &p.hypervisor)];
            if let Some(g) = &p.grace {
                out.push(plugin_json("grace", g));
            }
            Ok(json!({ "plugins": out }))
        })
        .await
    })?;
    module.register_async_method("plugin.reload", |p, m, _| async move {
        no_params(&p)?;
        blocking("plugin.reload", &m, |m| m.reload_plugins()).await
    })?;
    module.register_async_method("reconcile.run", |p, m, _| async move {
        no_params(&p)?;
        blocking("reconcile.run", &m, |m| Ok(serde_json::to_value(m.reconcile()).unwrap_or(Value::Null))).await
    })?;
    module.register_async_method("agent.health", |p, m, _| async move {
        no_params(&p)?;
        blocking("agent.health", &m, |m| Ok(m.health())).await
    })?;
    module.register_async_method("agent.metrics", |p, m, _| async move {
        no_params(&p)?;
        blocking("agent.metrics", &m, |m| Ok(Value::String(metrics::render(m)))).await
    })?;
    module.register_method("rpc.discover", |p, _m, _| {
        no_params(&p)?;
        Ok::<Value, ErrorObjectOwned>(openrpc::document())
    })?;
    // rpc.discover must describe exactly what is served.
    let served: std::collections::BTreeSet<&str> = module.method_names().collect();
    let declared: std::collections::BTreeSet<&str> = openrpc::METHODS.iter().map(|m| m.name).collect();
    if served != declared {
        anyhow::bail!(
            "the OpenRPC document and the served methods differ: served only {:?}, declared only {:?}",
            served.difference(&declared).collect::<Vec<_>>(),
            declared.difference(&served).collect::<Vec<_>>()
        );
    }
    Ok(module)
}

fn plugin_json(slot: &str, p: &gpuvisor_policy::Plugin) -> Value {
    let s = p.stats();
    json!({
        "slot": slot,
        "name": p.manifest().name,
        "version": p.manifest().version,
        "kinds": p.manifest().kinds,
        "path": p.path().display().to_string(),
        "calls_ok": s.calls_ok,
        "calls_failed": s.calls_failed.values().sum::<u64>(),
        "failures_by_reason": s.calls_failed,
    })
}

/// Serves JSON-RPC on `socket` (created with mode 0600; a stale socket file is replaced)
/// until `shutdown` resolves.
pub async fn serve(
    module: RpcModule<Arc<Manager>>,
    socket: &Path,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("cannot create the directory of the socket {}: {e}", socket.display()))?;
    }
    // Replace only a stale socket file: if something still accepts connections there,
    // another agent serves it and must not be cut off.
    if socket.exists() {
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            anyhow::bail!("another process is serving on {}; refusing to replace its socket", socket.display());
        }
        match std::fs::remove_file(socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("cannot replace {}: {e}", socket.display()),
        }
    }
    let listener = tokio::net::UnixListener::bind(socket)
        .map_err(|e| anyhow::anyhow!("cannot listen on the socket {}: {e}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| anyhow::anyhow!("cannot make {} mode 0600: {e}", socket.display()))?;
    let (stop_handle, server_handle) = jsonrpsee::server::stop_channel();
    let server_cfg =
        jsonrpsee::server::ServerConfig::builder().max_request_body_size(4 * 1024 * 1024).http_only().build();
    let builder = jsonrpsee::server::Server::builder().set_config(server_cfg).to_service_builder();
    let methods: jsonrpsee::Methods = module.into();
    tracing::info!(socket = %socket.display(), "JSON-RPC listening");
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            conn = listener.accept() => {
                let (stream, _) = match conn {
                    Ok(c) => c,
                    Err(e) => { tracing::warn!(error = %e, "accept failed"); continue; }
                };
                let svc = builder.clone().build(methods.clone(), stop_handle.clone());
                tokio::spawn(async move {
                    if let Err(e) = jsonrpsee::server::serve(stream, svc).await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
        }
    }
    let _ = server_handle.stop();
    let _ = std::fs::remove_file(socket);
    Ok(())
}
