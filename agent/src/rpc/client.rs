//! A minimal JSON-RPC client over the agent's Unix socket, used by the CLI: calls are
//! HTTP/1.1 `POST /` (hyper; one connection per call), the event stream a WebSocket
//! (soketto).

use super::api::{method, ApiMethod};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::path::Path;

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The agent is not running (or the socket is not reachable).
    #[error("cannot reach the gpuvisor agent at {socket}: {reason} (is `gpuvisor serve` running?)")]
    Unreachable {
        /// The agent's socket path.
        socket: String,
        /// Why the connection failed.
        reason: String,
    },
    /// The agent answered with a JSON-RPC error.
    #[error("{message} ({})", data.get("code").and_then(|c| c.as_str()).unwrap_or("error"))]
    Rpc {
        /// The JSON-RPC error code (e.g. 409).
        code: i64,
        /// The error's message.
        message: String,
        /// The error's `data` (its `code` is the stable error code).
        data: Value,
    },
    /// The answer was not JSON-RPC.
    #[error("the agent answered something that is not JSON-RPC: {0}")]
    Protocol(String),
}

/// A JSON-RPC error object as a [`ClientError::Rpc`].
fn rpc_error(err: &Value) -> ClientError {
    ClientError::Rpc {
        code: err.get("code").and_then(|c| c.as_i64()).unwrap_or(0),
        message: err.get("message").and_then(|m| m.as_str()).unwrap_or("error").to_string(),
        data: err.get("data").cloned().unwrap_or(Value::Null),
    }
}

/// Calls `method` with `params` (a JSON object) and returns `result`.
pub async fn call(socket: &Path, method: &str, params: Value) -> Result<Value, ClientError> {
    let unreachable = |reason: String| ClientError::Unreachable { socket: socket.display().to_string(), reason };
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| unreachable(e.to_string()))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": method, "params": params }).to_string();
    let req = hyper::Request::post("/")
        .header("content-type", "application/json")
        .header("host", "gpuvisor")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| ClientError::Protocol(e.to_string()))?;
    let resp = sender.send_request(req).await.map_err(|e| unreachable(e.to_string()))?;
    let bytes = resp.into_body().collect().await.map_err(|e| ClientError::Protocol(e.to_string()))?.to_bytes();
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|_| ClientError::Protocol(String::from_utf8_lossy(&bytes).chars().take(200).collect()))?;
    if let Some(err) = v.get("error") {
        return Err(rpc_error(err));
    }
    v.get("result").cloned().ok_or_else(|| ClientError::Protocol(v.to_string()))
}

/// Calls the method `M` of the table ([`super::api`]) with its typed params; returns the
/// answer as sent (`Value`, for `--output json` and for fields a newer agent adds) and as
/// `M`'s result type (`None` when it does not decode as that: an agent of another version).
pub async fn request<M: ApiMethod>(socket: &Path, params: &M::Params) -> Result<Answer<M::Result>, ClientError>
where
    M::Result: DeserializeOwned,
{
    let params = serde_json::to_value(params).map_err(|e| ClientError::Protocol(e.to_string()))?;
    let raw = call(socket, M::NAME, params).await?;
    let typed = serde_json::from_value(raw.clone()).map_err(|e| e.to_string());
    Ok(Answer { raw, typed })
}

/// A method's answer: as sent, and decoded as its result type (or why it does not decode).
#[derive(Debug)]
pub struct Answer<R> {
    /// The `result` member as the agent sent it.
    pub raw: Value,
    /// It, as the method's result type.
    pub typed: Result<R, String>,
}

/// Follows the agent's event stream: a WebSocket upgrade on the same socket, then
/// `events.subscribe` (only `types`, when not empty). Calls `each` with every event until
/// it returns `false`; returns when the agent closes the stream (an agent stop).
pub async fn follow_events(
    socket: &Path,
    types: &[String],
    mut each: impl FnMut(crate::events::Event) -> bool,
) -> Result<(), ClientError> {
    use tokio_util::compat::TokioAsyncReadCompatExt;
    let unreachable = |reason: String| ClientError::Unreachable { socket: socket.display().to_string(), reason };
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| unreachable(e.to_string()))?;
    let mut ws = soketto::handshake::Client::new(stream.compat(), "gpuvisor", "/");
    match ws.handshake().await.map_err(|e| unreachable(e.to_string()))? {
        soketto::handshake::ServerResponse::Accepted { .. } => {}
        other => return Err(ClientError::Protocol(format!("the WebSocket upgrade was refused: {other:?}"))),
    }
    let (mut tx, mut rx) = ws.into_builder().finish();
    let params = if types.is_empty() { json!({}) } else { json!({ "types": types }) };
    let sub =
        json!({ "jsonrpc": "2.0", "id": 1, "method": method::EventsSubscribe::NAME, "params": params }).to_string();
    let lost = |e: soketto::connection::Error| ClientError::Protocol(format!("the event stream broke: {e}"));
    tx.send_text(sub).await.map_err(lost)?;
    tx.flush().await.map_err(lost)?;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match rx.receive_data(&mut buf).await {
            Ok(_) => {}
            Err(soketto::connection::Error::Closed) => return Ok(()),
            Err(e) => return Err(lost(e)),
        }
        let v: Value = serde_json::from_slice(&buf)
            .map_err(|_| ClientError::Protocol(String::from_utf8_lossy(&buf).chars().take(200).collect()))?;
        if let Some(err) = v.get("error") {
            return Err(rpc_error(err));
        }
        if v.get("method").and_then(|m| m.as_str()) != Some("events.event") {
            continue; // the subscription's answer (its id)
        }
        let ev = v
            .pointer("/params/result")
            .cloned()
            .and_then(|r| serde_json::from_value(r).ok())
            .ok_or_else(|| ClientError::Protocol(format!("an event the CLI cannot read: {v}")))?;
        if !each(ev) {
            return Ok(());
        }
    }
}
