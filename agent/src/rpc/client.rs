//! A minimal JSON-RPC client over the agent's Unix socket (HTTP/1.1 `POST /`), used by the
//! CLI. Built on hyper; one connection per call.

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{json, Value};
use std::path::Path;

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The agent is not running (or the socket is not reachable).
    #[error("cannot reach the gpuvisor agent at {socket}: {reason} (is `gpuvisor serve` running?)")]
    Unreachable { socket: String, reason: String },
    /// The agent answered with a JSON-RPC error.
    #[error("{message} ({})", data.get("code").and_then(|c| c.as_str()).unwrap_or("error"))]
    Rpc { code: i64, message: String, data: Value },
    /// The answer was not JSON-RPC.
    #[error("the agent answered something that is not JSON-RPC: {0}")]
    Protocol(String),
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
        return Err(ClientError::Rpc {
            code: err.get("code").and_then(|c| c.as_i64()).unwrap_or(0),
            message: err.get("message").and_then(|m| m.as_str()).unwrap_or("error").to_string(),
            data: err.get("data").cloned().unwrap_or(Value::Null),
        });
    }
    v.get("result").cloned().ok_or_else(|| ClientError::Protocol(v.to_string()))
}
