//! The optional loopback listener serving `GET /metrics` (the same text as
//! `agent.metrics`, rendered by [`crate::metrics`]).

use crate::instances::Manager;

/// Serves `GET /metrics` on a loopback TCP address until the process ends. Any other path
/// answers 404.
pub async fn serve_http(m: std::sync::Arc<Manager>, addr: std::net::SocketAddr) -> anyhow::Result<()> {
    use http_body_util::Full;
    use hyper::body::Bytes;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot serve metrics on {addr}: {e}"))?;
    tracing::info!(%addr, "metrics listening on GET /metrics");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let m = m.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let m = m.clone();
                    async move {
                        if req.uri().path() == "/metrics" {
                            let text = tokio::task::spawn_blocking(move || m.metrics_text()).await.unwrap_or_default();
                            hyper::Response::builder()
                                .header("content-type", crate::metrics::CONTENT_TYPE)
                                .body(Full::new(Bytes::from(text)))
                        } else {
                            hyper::Response::builder().status(404).body(Full::new(Bytes::from_static(b"not found\n")))
                        }
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(())
}
