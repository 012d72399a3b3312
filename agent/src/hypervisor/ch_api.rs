//! # hypervisor::ch_api — a blocking client for Cloud Hypervisor's REST API
//!
//! HTTP/1.1 over the VMM's Unix API socket, base path `/api/v1` (docs/design/cloud-hypervisor.md
//! "REST API"), with `hyper`. Each request opens one connection and runs on its own
//! current-thread tokio runtime, bounded by one timeout for connect, send and the whole
//! answer, so a hung VMM cannot block the caller and a hang never holds up another request.
//! Callers are blocking threads (never an async task).
//!
//! Any answer outside 2xx is an [`ApiFailure`] carrying the error array the VMM sent
//! (a JSON array of strings, outermost error first) verbatim.
//!
//! A request can carry file descriptors ([`ChApi::put_with_fds`]): they go as `SCM_RIGHTS`
//! with the request's first bytes, which is how Cloud Hypervisor takes a tap for
//! `vm.add-net` (fds named in a JSON body are ignored by it).

use std::path::Path;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;

/// A Cloud Hypervisor API request that was refused or not answered.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub struct ApiFailure {
    /// The request, e.g. `PUT vm.create`.
    pub request: String,
    /// The HTTP status; `None` when no answer came (connect failure, timeout, closed).
    pub status: Option<u16>,
    /// The VMM's error array verbatim (outermost error first); without an answer, the
    /// transport error.
    pub errors: Vec<String>,
}

impl std::fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.status {
            Some(status) => write!(
                f,
                "cloud-hypervisor answered {} with HTTP {status}: {}",
                self.request,
                serde_json::to_string(&self.errors).unwrap_or_default()
            ),
            None => write!(f, "cloud-hypervisor did not answer {}: {}", self.request, self.errors.join("; ")),
        }
    }
}

impl std::error::Error for ApiFailure {}

/// A client for one API socket.
#[derive(Debug, Clone)]
pub struct ChApi<'a> {
    socket: &'a Path,
    timeout: Duration,
}

impl<'a> ChApi<'a> {
    /// A client for the API socket `socket`; `timeout` bounds each whole request.
    pub fn new(socket: &'a Path, timeout: Duration) -> ChApi<'a> {
        ChApi { socket, timeout }
    }

    /// `GET /api/v1/<endpoint>`: the answer body of a 2xx answer.
    pub fn get(&self, endpoint: &str) -> Result<Bytes, ApiFailure> {
        self.call(Outgoing { method: Method::GET, endpoint, body: None, fds: Vec::new() })
    }

    /// `PUT /api/v1/<endpoint>`, with `body` as JSON when given: the answer body of a 2xx
    /// answer.
    pub fn put(&self, endpoint: &str, body: Option<&serde_json::Value>) -> Result<Bytes, ApiFailure> {
        let body = body.map(|b| serde_json::to_vec(b).unwrap_or_default());
        self.call(Outgoing { method: Method::PUT, endpoint, body, fds: Vec::new() })
    }

    /// `PUT /api/v1/<endpoint>` with `body` as JSON, and `fds` passed with the request
    /// (`SCM_RIGHTS`): the answer body of a 2xx answer. The VMM gets its own copies.
    pub fn put_with_fds(
        &self,
        endpoint: &str,
        body: &serde_json::Value,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Bytes, ApiFailure> {
        use std::os::fd::AsRawFd;
        let body = Some(serde_json::to_vec(body).unwrap_or_default());
        self.call(Outgoing { method: Method::PUT, endpoint, body, fds: fds.iter().map(|f| f.as_raw_fd()).collect() })
    }

    fn call(&self, out: Outgoing<'_>) -> Result<Bytes, ApiFailure> {
        let request = format!("{} {}", out.method, out.endpoint);
        let sent = out.body.as_deref().map(String::from_utf8_lossy).map(|b| b.into_owned()).unwrap_or_default();
        let answer = self.exchange(out);
        match &answer {
            Ok((status, got)) => tracing::debug!(socket = %self.socket.display(), %request, body = %sent, status,
                answer = %String::from_utf8_lossy(got), "cloud-hypervisor API"),
            Err(e) => tracing::debug!(socket = %self.socket.display(), %request, body = %sent, error = %e,
                "cloud-hypervisor API: no answer"),
        }
        match answer {
            Ok((status, body)) if (200..300).contains(&status) => Ok(body),
            Ok((status, body)) => Err(ApiFailure { request, status: Some(status), errors: error_array(&body) }),
            Err(e) => Err(ApiFailure { request, status: None, errors: vec![e] }),
        }
    }

    /// One request on its own current-thread runtime. A caller on a thread that is inside
    /// a tokio runtime (which may not start another one there: "Cannot start a runtime from
    /// within a runtime") gets the exchange run on a thread of its own.
    fn exchange(&self, out: Outgoing<'_>) -> Result<(u16, Bytes), String> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return std::thread::scope(|s| {
                s.spawn(|| self.exchange_here(out))
                    .join()
                    .unwrap_or_else(|_| Err("the request's thread panicked".to_string()))
            });
        }
        self.exchange_here(out)
    }

    fn exchange_here(&self, out: Outgoing<'_>) -> Result<(u16, Bytes), String> {
        let Outgoing { method, endpoint, body, fds } = out;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start an I/O runtime: {e}"))?;
        let socket = self.socket.to_path_buf();
        let timeout = self.timeout;
        rt.block_on(async move {
            let exchange = async {
                // Only a socket of the VMM's own (never a link it planted to another VMM's).
                let owner = crate::own_file::socket_owner(&socket)
                    .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
                let stream = tokio::net::UnixStream::connect(&socket)
                    .await
                    .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
                crate::own_file::check_peer(&socket, owner, &stream)
                    .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
                let stream = FdPassing { stream, fds };
                let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("HTTP handshake failed: {e}"))?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                let mut req = Request::builder()
                    .method(method)
                    .uri(format!("/api/v1/{endpoint}"))
                    .header(hyper::header::HOST, "localhost")
                    .header(hyper::header::ACCEPT, "application/json");
                if body.is_some() {
                    req = req.header(hyper::header::CONTENT_TYPE, "application/json");
                }
                let req = req
                    .body(Full::new(Bytes::from(body.unwrap_or_default())))
                    .map_err(|e| format!("cannot build the request: {e}"))?;
                let resp = sender.send_request(req).await.map_err(|e| format!("the request failed: {e}"))?;
                let status = resp.status().as_u16();
                let bytes =
                    resp.into_body().collect().await.map_err(|e| format!("reading the answer failed: {e}"))?.to_bytes();
                Ok((status, bytes))
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(r) => r,
                Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
            }
        })
    }
}

/// One request to send.
struct Outgoing<'e> {
    method: Method,
    /// The path after `/api/v1/`.
    endpoint: &'e str,
    /// JSON, when the request has a body.
    body: Option<Vec<u8>>,
    /// Fds passed with the request's first bytes (`SCM_RIGHTS`).
    fds: Vec<i32>,
}

/// A connection that passes `fds` (`SCM_RIGHTS`) with the first bytes it writes, then is a
/// plain stream. The fds stay the caller's (the kernel gives the receiver its own copies).
struct FdPassing {
    stream: tokio::net::UnixStream,
    /// Still to be sent: emptied by the first write.
    fds: Vec<i32>,
}

impl tokio::io::AsyncRead for FdPassing {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for FdPassing {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::os::fd::AsRawFd;
        use std::task::Poll;
        if self.fds.is_empty() || buf.is_empty() {
            return std::pin::Pin::new(&mut self.stream).poll_write(cx, buf);
        }
        loop {
            if let Err(e) = std::task::ready!(self.stream.poll_write_ready(cx)) {
                return Poll::Ready(Err(e));
            }
            let fd = self.stream.as_raw_fd();
            let fds = self.fds.clone();
            let sent = self.stream.try_io(tokio::io::Interest::WRITABLE, || {
                let rights = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
                nix::sys::socket::sendmsg::<()>(
                    fd,
                    &[std::io::IoSlice::new(buf)],
                    &rights,
                    nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(std::io::Error::from)
            });
            match sent {
                Ok(n) => {
                    self.fds.clear();
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The error array of an answer; a body that is not one is kept as one string.
fn error_array(body: &[u8]) -> Vec<String> {
    match serde_json::from_slice::<Vec<String>>(body) {
        Ok(v) if !v.is_empty() => v,
        _ if body.is_empty() => vec!["(empty answer)".to_string()],
        _ => vec![String::from_utf8_lossy(body).trim().to_string()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 18 finding 9: a request from a thread inside a tokio runtime (as `host check`
    /// runs in the CLI's) answers — never "Cannot start a runtime from within a runtime".
    #[test]
    fn a_request_from_inside_a_runtime_does_not_panic() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("ch.sock");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let r = rt.block_on(async { ChApi::new(&sock, Duration::from_millis(200)).get("vmm.ping") });
        let e = r.unwrap_err();
        assert_eq!(e.status, None);
        assert!(e.errors[0].contains("cannot connect"), "{e}");
    }

    #[test]
    fn an_error_array_is_kept_verbatim_and_anything_else_as_one_string() {
        assert_eq!(
            error_array(br#"["Error from API","The VM could not boot","Cannot open kernel file"]"#),
            vec!["Error from API", "The VM could not boot", "Cannot open kernel file"]
        );
        assert_eq!(error_array(b"oops\n"), vec!["oops"]);
        assert_eq!(error_array(b""), vec!["(empty answer)"]);
    }

    #[test]
    fn a_failure_says_the_request_the_status_and_the_array() {
        let f = ApiFailure {
            request: "PUT vm.boot".into(),
            status: Some(500),
            errors: vec!["Error from API".into(), "The VM could not boot".into()],
        };
        assert_eq!(
            f.to_string(),
            r#"cloud-hypervisor answered PUT vm.boot with HTTP 500: ["Error from API","The VM could not boot"]"#
        );
        let g =
            ApiFailure { request: "GET vmm.ping".into(), status: None, errors: vec!["no answer within 5 ms".into()] };
        assert_eq!(g.to_string(), "cloud-hypervisor did not answer GET vmm.ping: no answer within 5 ms");
    }

    #[test]
    fn a_socket_nobody_listens_on_is_a_failure_without_status() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("ch.sock");
        let e = ChApi::new(&sock, Duration::from_secs(1)).get("vmm.ping").unwrap_err();
        assert_eq!(e.status, None);
        assert!(e.errors[0].contains("cannot connect"), "{e}");
    }

    #[test]
    fn a_listener_that_never_answers_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("ch.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let e = ChApi::new(&sock, Duration::from_millis(200)).put("vm.boot", None).unwrap_err();
        assert_eq!(e.status, None);
        assert!(e.errors[0].contains("no answer within 200 ms"), "{e}");
    }
}
