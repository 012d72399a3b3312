//! # rpc — JSON-RPC 2.0 on a Unix socket (jsonrpsee: HTTP and WebSocket)
//!
//! A WebSocket upgrade of `GET /` on the same socket carries the same methods plus the
//! event subscription `events.subscribe` ([`crate::events`]; `gpuvisor events`). A request
//! is an HTTP/1.1 `POST /` with a JSON-RPC body, so
//! `curl --unix-socket /run/gpuvisor/gpuvisor.sock -H 'content-type: application/json' -d '{"jsonrpc":"2.0","id":1,"method":"agent.health"}' http://x/`
//! works. Methods are `noun.verb`, each declared once in [`api`] (params, result, errors,
//! call), from which the registration here, the OpenRPC document `rpc.discover` publishes
//! and the CLI's typed client come. This layer is thin: it decodes the request types
//! of `instances::request`, runs the lifecycle on a blocking thread, serialises the typed
//! view it returns, and is the one place that maps [`ApiError`] to a JSON-RPC error
//! object: numeric `code` = the class (400/404/409/500/503), `data` =
//! `{"code": "<stable string>", ...details}`.

pub mod api;
pub mod client;
pub mod metrics;
pub mod openrpc;

use crate::error::ApiError;
use crate::instances::request::EventsParams;
use crate::instances::Manager;
use jsonrpsee::types::ErrorObjectOwned;
use jsonrpsee::RpcModule;
use serde::Serialize;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

/// The largest request body, bytes.
pub const MAX_REQUEST_BYTES: u32 = 4 * 1024 * 1024;

fn to_rpc_error(e: ApiError) -> ErrorObjectOwned {
    ErrorObjectOwned::owned(e.code.class(), e.message.clone(), Some(e.data()))
}

/// Runs a blocking lifecycle call off the async runtime, counts it, and serialises its
/// typed answer (the one place views become JSON).
async fn blocking<T, F>(method: &'static str, m: &Arc<Manager>, f: F) -> Result<Value, ErrorObjectOwned>
where
    T: Serialize + Send + 'static,
    F: FnOnce(&Manager) -> Result<T, ApiError> + Send + 'static,
{
    let mm = m.clone();
    let started = std::time::Instant::now();
    let res =
        tokio::task::spawn_blocking(move || f(&mm).and_then(|v| serde_json::to_value(v).map_err(ApiError::internal)))
            .await
            .map_err(|e| to_rpc_error(ApiError::internal(format!("operation panicked: {e}"))))
            .and_then(|r| r.map_err(to_rpc_error));
    let elapsed = started.elapsed();
    m.metrics().rpc_call(method, res.is_ok(), elapsed.as_secs_f64());
    tracing::debug!(method = %method, duration_ms = elapsed.as_millis() as u64, ok = res.is_ok(), "rpc call done");
    res
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

/// Builds the module with every method of the table ([`api`]).
pub fn module(m: Arc<Manager>) -> anyhow::Result<RpcModule<Arc<Manager>>> {
    let mut module = RpcModule::new(m);
    api::register(&mut module)?;
    // rpc.discover must describe exactly what is served.
    let served: std::collections::BTreeSet<&str> = module.method_names().collect();
    let methods = api::methods();
    let declared: std::collections::BTreeSet<&str> = methods.iter().map(|m| m.name).collect();
    if served != declared {
        anyhow::bail!(
            "the OpenRPC document and the served methods differ: served only {:?}, declared only {:?}",
            served.difference(&declared).collect::<Vec<_>>(),
            declared.difference(&served).collect::<Vec<_>>()
        );
    }
    Ok(module)
}

/// `events.subscribe` (WebSocket only): every event from now on, as `events.event`
/// notifications, optionally only of some types; a subscriber that falls behind gets a
/// `lagged` event with the number it missed.
async fn subscribe_events(
    params: jsonrpsee::types::Params<'static>,
    pending: jsonrpsee::PendingSubscriptionSink,
    m: Arc<Manager>,
    _: jsonrpsee::Extensions,
) {
    use crate::events::Event;
    use tokio::sync::broadcast::error::RecvError;
    let p: EventsParams =
        match parse(&params).and_then(|p: EventsParams| p.validate().map(|()| p).map_err(invalid_params)) {
            Ok(p) => p,
            Err(e) => return pending.reject(e).await,
        };
    // Subscribe before accepting: nothing published after the answer is missed.
    let mut rx = m.store().events().subscribe();
    let Ok(sink) = pending.accept().await else { return };
    loop {
        let ev = tokio::select! {
            _ = sink.closed() => return,
            r = rx.recv() => match r {
                Ok(ev) => ev,
                Err(RecvError::Lagged(missed)) => Event::lagged(missed),
                Err(RecvError::Closed) => return,
            },
        };
        if !p.wants(&ev) {
            continue;
        }
        let Ok(raw) = serde_json::value::to_raw_value(&ev) else { continue };
        if sink.send(raw).await.is_err() {
            return;
        }
    }
}

/// Refuses a request whose `id` jsonrpsee cannot represent (a negative or fractional
/// number): JSON-RPC 2.0 answers it `-32600 Invalid Request` with a `null` id instead of
/// an empty body. `Some(answer)` when refused.
pub fn refuse_bad_ids(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let bad = |r: &Value| match r.get("id") {
        Some(Value::Number(n)) => n.as_u64().is_none(),
        Some(Value::Bool(_) | Value::Array(_) | Value::Object(_)) => true,
        _ => false,
    };
    let refusal = || {
        json!({"jsonrpc": "2.0", "id": null, "error": {"code": jsonrpsee::types::error::INVALID_REQUEST_CODE,
            "message": "Invalid request: the id must be a string, a non-negative integer, or null"}})
        .to_string()
    };
    match &v {
        Value::Object(_) if bad(&v) => Some(refusal()),
        Value::Array(items) if items.iter().any(bad) => Some(refusal()),
        _ => None,
    }
}

/// Refuses a plain-HTTP call of a subscription method (`events.subscribe`,
/// `events.unsubscribe`): they need a WebSocket connection, and jsonrpsee would answer a
/// bare `Internal error`. `Some(answer)` when refused (`invalid_request`, saying how).
pub fn refuse_http_subscriptions(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let wants =
        |r: &Value| matches!(r.get("method").and_then(Value::as_str), Some("events.subscribe" | "events.unsubscribe"));
    let hit = match &v {
        Value::Object(_) => wants(&v).then(|| v.clone()),
        Value::Array(items) => items.iter().find(|r| wants(r)).cloned(),
        _ => None,
    }?;
    let e = ApiError::invalid_request(
        "events.subscribe needs a WebSocket connection: upgrade `GET /` on the agent's socket to WebSocket \
         (`gpuvisor events` does); over plain HTTP only the other methods are served",
    );
    Some(
        json!({"jsonrpc": "2.0", "id": hit.get("id").cloned().unwrap_or(Value::Null),
            "error": {"code": e.code.class(), "message": e.message.clone(), "data": e.data()}})
        .to_string(),
    )
}

/// The answer to a body over [`MAX_REQUEST_BYTES`]: `-32600`, saying the limit.
fn too_large_answer(read: usize) -> String {
    json!({"jsonrpc": "2.0", "id": null, "error": {"code": jsonrpsee::types::error::INVALID_REQUEST_CODE,
        "message": format!("Invalid request: the body is larger than {MAX_REQUEST_BYTES} bytes (4 MiB), the most the agent \
            reads ({read} bytes or more were sent)")}})
    .to_string()
}

/// How much of an oversized body is read (and dropped) so the client, still sending, gets
/// the answer instead of a reset connection.
const DRAIN_BYTES: usize = 64 * 1024 * 1024;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A JSON answer with `status`.
fn json_response(status: u16, body: String) -> Result<jsonrpsee::server::HttpResponse, BoxError> {
    Ok(jsonrpsee::server::HttpResponse::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(jsonrpsee::server::HttpBody::from(body))?)
}

/// One HTTP request: the body is read (bounded: a larger one is answered `-32600` with HTTP
/// 413, saying the limit), requests with ids jsonrpsee cannot represent are refused with
/// `-32600`, a subscription over plain HTTP is refused saying to use WebSocket, everything
/// else goes to jsonrpsee.
async fn checked_call<S>(
    mut svc: S,
    req: jsonrpsee::server::HttpRequest<hyper::body::Incoming>,
) -> Result<jsonrpsee::server::HttpResponse, BoxError>
where
    S: tower::Service<
        jsonrpsee::server::HttpRequest<http_body_util::Full<hyper::body::Bytes>>,
        Response = jsonrpsee::server::HttpResponse,
        Error = BoxError,
    >,
{
    use http_body_util::BodyExt;
    let (parts, mut body) = req.into_parts();
    let mut buf: Vec<u8> = Vec::new();
    let mut read = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        read += data.len();
        if read <= MAX_REQUEST_BYTES as usize {
            buf.extend_from_slice(&data);
        } else if read > DRAIN_BYTES {
            break;
        }
    }
    if read > MAX_REQUEST_BYTES as usize {
        return json_response(413, too_large_answer(read));
    }
    if let Some(answer) = refuse_bad_ids(&buf).or_else(|| refuse_http_subscriptions(&buf)) {
        return json_response(200, answer);
    }
    let bytes = hyper::body::Bytes::from(buf);
    svc.call(jsonrpsee::server::HttpRequest::from_parts(parts, http_body_util::Full::new(bytes))).await
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
    let server_cfg = jsonrpsee::server::ServerConfig::builder().max_request_body_size(MAX_REQUEST_BYTES).build();
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
                let checked = tower::service_fn(move |req: jsonrpsee::server::HttpRequest<hyper::body::Incoming>| {
                    checked_call(svc.clone(), req)
                });
                tokio::spawn(async move {
                    if let Err(e) = jsonrpsee::server::serve(stream, checked).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 18 finding 12: `events.subscribe` over plain HTTP is refused saying to use
    /// WebSocket (not `Internal error`), with the request's id; other methods pass.
    #[test]
    fn a_subscription_over_plain_http_is_refused_saying_to_use_websocket() {
        let a: Value = serde_json::from_str(
            &refuse_http_subscriptions(br#"{"jsonrpc":"2.0","id":7,"method":"events.subscribe"}"#).unwrap(),
        )
        .unwrap();
        assert_eq!(a["id"], 7);
        assert_eq!(a["error"]["data"]["code"], "invalid_request");
        assert!(a["error"]["message"].as_str().unwrap().contains("WebSocket"), "{a}");
        assert!(refuse_http_subscriptions(br#"{"jsonrpc":"2.0","id":1,"method":"agent.health"}"#).is_none());
    }

    #[test]
    fn negative_and_fractional_ids_are_refused_not_dropped() {
        for body in
            [r#"{"jsonrpc":"2.0","id":-1,"method":"agent.health"}"#, r#"{"jsonrpc":"2.0","id":1.5,"method":"x"}"#]
        {
            let a: Value = serde_json::from_str(&refuse_bad_ids(body.as_bytes()).unwrap()).unwrap();
            assert_eq!(a["error"]["code"], -32600, "{body}");
            assert!(a["id"].is_null());
        }
        for body in [
            r#"{"jsonrpc":"2.0","id":1,"method":"a"}"#,
            r#"{"jsonrpc":"2.0","id":"x","method":"a"}"#,
            r#"{"jsonrpc":"2.0","method":"a"}"#,
            "not json",
        ] {
            assert!(refuse_bad_ids(body.as_bytes()).is_none(), "{body}");
        }
        let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"a"},{"jsonrpc":"2.0","id":-2,"method":"a"}]"#;
        assert!(refuse_bad_ids(batch.as_bytes()).is_some());
    }
}
