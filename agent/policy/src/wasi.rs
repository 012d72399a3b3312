//! WASI 0.2 for components: every interface wasmtime-wasi implements, backed by a context
//! that grants nothing, and with every call that could wait replaced by one that never
//! waits.
//!
//! Granting nothing ([`deny_all`]): no preopened directories, no environment, no
//! arguments, every socket address refused, no name lookup, a fixed wall clock, random
//! bytes from a fixed seed, an empty stdin, and stdout/stderr captured ([`Captured`]) to
//! go to the plugin's log line by line.
//!
//! Never waiting (issue 19: the deadline must not be escaped by a blocking host call;
//! epoch interruption stops wasm code, not a host call that sleeps). Time does not pass
//! inside a plugin:
//! - the monotonic clock reads 0 and every subscription to it (`subscribe-duration`,
//!   `subscribe-instant`: what `sleep` becomes) is ready at once ([`Frozen`]);
//! - `wasi:io/poll` (`poll`, `pollable.block`, `pollable.ready`) and the blocking stream
//!   calls (`blocking-read`, `blocking-write-and-flush`, ...) poll their operation once
//!   ([`at_once`], [`NeverBlock`]): every pollable a plugin can make is ready at once
//!   (the clock's, stdin's — closed —, stdout's — [`Captured`] never fills up), so they
//!   return at once; a wait that could not end (nothing else in the sandbox ever becomes
//!   ready later) traps instead of blocking;
//! - `wasi:sockets/udp-create-socket` refuses at once (UDP is not granted).
//!
//! None of these calls enters a tokio runtime (wasmtime-wasi's blocking calls do, which
//! panics when the caller is itself inside one, e.g. `gpuvisor plugin test` or the agent's
//! start), so a plugin call behaves the same from any thread.

use crate::plugin::CallState;
use bytes::Bytes;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::clocks::monotonic_clock;
use wasmtime_wasi::p2::bindings::io::{poll as async_poll, streams as async_streams};
use wasmtime_wasi::p2::bindings::sockets::network::{self, ErrorCode as SocketErrorCode};
use wasmtime_wasi::p2::bindings::sync::io::{poll, streams};
use wasmtime_wasi::p2::bindings::sync::sockets::udp_create_socket;
use wasmtime_wasi::p2::{
    DynInputStream, DynOutputStream, DynPollable, OutputStream, Pollable, SocketError, SocketResult, StreamError,
    StreamResult, UdpSocket,
};
use wasmtime_wasi::sockets::{WasiSocketsCtxView, WasiSocketsView};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// Bytes of stdout + stderr kept per call; the rest is counted and dropped.
pub const STDIO_CAPTURE_BYTES: usize = 16 << 10;

/// The fixed wall-clock time a plugin sees: 2024-01-01T00:00:00Z.
const FIXED_WALL_CLOCK: Duration = Duration::from_secs(1_704_067_200);

/// The seed of the random bytes a plugin gets.
const RANDOM_SEED: &[u8] = b"gpuvisor policy plugins draw no randomness";

/// The most random bytes one call of `get-random-bytes` returns (wasmtime-wasi allocates
/// the answer on the host before the guest sees it).
const MAX_RANDOM_BYTES: u64 = 64 << 10;

/// The permit `check-write` gives on stdout and stderr (never 0: they never fill up).
const WRITE_PERMIT: u64 = 4096;

/// What a component call's store carries for WASI: the context (built on first use) and
/// the captured stdout/stderr.
#[derive(Default)]
pub(crate) struct WasiState {
    ctx: Option<WasiCtx>,
    table: ResourceTable,
    output: Captured,
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        let w = &mut self.wasi;
        let output = &w.output;
        let ctx = w.ctx.get_or_insert_with(|| deny_all(output));
        WasiCtxView { ctx, table: &mut w.table }
    }
}

impl WasiState {
    /// What the guest wrote to stdout/stderr in this call (at most
    /// [`STDIO_CAPTURE_BYTES`]), as lines for the log, and the bytes past the cap.
    pub(crate) fn take_output(&mut self) -> (Vec<String>, u64) {
        let (bytes, dropped) = self.output.take();
        let lines =
            String::from_utf8_lossy(&bytes).lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
        (lines, dropped)
    }
}

/// A WASI context that grants nothing (see the module docs); stdout and stderr write to
/// `output`.
fn deny_all(output: &Captured) -> WasiCtx {
    struct FixedWall;
    impl wasmtime_wasi::HostWallClock for FixedWall {
        fn resolution(&self) -> Duration {
            Duration::from_secs(1)
        }
        fn now(&self) -> Duration {
            FIXED_WALL_CLOCK
        }
    }
    let mut b = WasiCtx::builder();
    b.stdout(output.clone())
        .stderr(output.clone())
        .wall_clock(FixedWall)
        .secure_random(wasmtime_wasi::Deterministic::new(RANDOM_SEED.to_vec()))
        .insecure_random(wasmtime_wasi::Deterministic::new(RANDOM_SEED.to_vec()))
        .insecure_random_seed(0)
        .max_random_size(MAX_RANDOM_BYTES)
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .socket_addr_check(|_, _| Box::pin(async { false }));
    b.build()
}

/// Links WASI 0.2 for a component: wasmtime-wasi's synchronous implementation, then the
/// frozen monotonic clock, the never-blocking poll and streams and the refused UDP socket
/// over it (see the module docs).
pub(crate) fn add_to_linker(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    wasmtime_wasi::p2::add_to_linker_sync(linker)?;
    linker.allow_shadowing(true);
    monotonic_clock::add_to_linker::<CallState, Frozen>(linker, |s| FrozenClock(&mut s.wasi.table))?;
    poll::add_to_linker::<CallState, NeverBlock>(linker, |s| NeverBlocking(&mut s.wasi.table))?;
    streams::add_to_linker::<CallState, NeverBlock>(linker, |s| NeverBlocking(&mut s.wasi.table))?;
    udp_create_socket::add_to_linker::<CallState, NoUdp>(linker, |s| NoUdpView(s.sockets()))?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Polls `f` once: its output if that finished it, `None` if it would have waited.
fn at_once<F: Future>(f: F) -> Option<F::Output> {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => Some(out),
        Poll::Pending => None,
    }
}

/// The trap of a wait that could never end.
fn never_ready(what: &str) -> wasmtime::Error {
    wasmtime::format_err!(
        "{what} waited on something that is not ready; nothing in a policy plugin's sandbox becomes ready later (no clock, files or network)"
    )
}

// ---------------------------------------------------------------------------------------
// the frozen monotonic clock

/// `wasi:clocks/monotonic-clock` where time does not pass: `now` is 0 and every
/// subscription is ready at once.
struct Frozen;

impl HasData for Frozen {
    type Data<'a> = FrozenClock<'a>;
}

struct FrozenClock<'a>(&'a mut ResourceTable);

/// A clock subscription: ready at once.
struct Elapsed;

#[wasmtime_wasi::async_trait]
impl Pollable for Elapsed {
    async fn ready(&mut self) {}
}

fn elapsed(table: &mut ResourceTable) -> wasmtime::Result<Resource<DynPollable>> {
    let at = table.push(Elapsed)?;
    wasmtime_wasi::p2::subscribe(table, at)
}

impl monotonic_clock::Host for FrozenClock<'_> {
    fn now(&mut self) -> wasmtime::Result<monotonic_clock::Instant> {
        Ok(0)
    }

    fn resolution(&mut self) -> wasmtime::Result<monotonic_clock::Duration> {
        Ok(1_000_000_000)
    }

    fn subscribe_instant(&mut self, _when: monotonic_clock::Instant) -> wasmtime::Result<Resource<DynPollable>> {
        elapsed(self.0)
    }

    fn subscribe_duration(&mut self, _when: monotonic_clock::Duration) -> wasmtime::Result<Resource<DynPollable>> {
        elapsed(self.0)
    }
}

// ---------------------------------------------------------------------------------------
// poll and streams that never block

/// `wasi:io/poll` and `wasi:io/streams` over the call's resource table, each blocking call
/// polled once ([`at_once`]).
struct NeverBlock;

impl HasData for NeverBlock {
    type Data<'a> = NeverBlocking<'a>;
}

struct NeverBlocking<'a>(&'a mut ResourceTable);

impl poll::Host for NeverBlocking<'_> {
    fn poll(&mut self, pollables: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
        at_once(async_poll::Host::poll(self.0, pollables)).unwrap_or_else(|| Err(never_ready("poll")))
    }
}

impl poll::HostPollable for NeverBlocking<'_> {
    fn ready(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<bool> {
        at_once(async_poll::HostPollable::ready(self.0, pollable)).unwrap_or(Ok(false))
    }

    fn block(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        at_once(async_poll::HostPollable::block(self.0, pollable)).unwrap_or_else(|| Err(never_ready("pollable.block")))
    }

    fn drop(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        async_poll::HostPollable::drop(self.0, pollable)
    }
}

/// A blocking stream operation, polled once.
fn stream_at_once<T>(what: &str, f: impl Future<Output = StreamResult<T>>) -> StreamResult<T> {
    at_once(f).unwrap_or_else(|| Err(StreamError::Trap(never_ready(what))))
}

impl streams::Host for NeverBlocking<'_> {
    fn convert_stream_error(&mut self, err: StreamError) -> wasmtime::Result<streams::StreamError> {
        Ok(match async_streams::Host::convert_stream_error(self.0, err)? {
            async_streams::StreamError::LastOperationFailed(e) => streams::StreamError::LastOperationFailed(e),
            async_streams::StreamError::Closed => streams::StreamError::Closed,
        })
    }
}

impl streams::HostOutputStream for NeverBlocking<'_> {
    fn drop(&mut self, stream: Resource<DynOutputStream>) -> wasmtime::Result<()> {
        at_once(async_streams::HostOutputStream::drop(self.0, stream))
            .unwrap_or_else(|| Err(never_ready("dropping an output stream")))
    }

    fn check_write(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<u64> {
        async_streams::HostOutputStream::check_write(self.0, stream)
    }

    fn write(&mut self, stream: Resource<DynOutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        async_streams::HostOutputStream::write(self.0, stream, bytes)
    }

    fn blocking_write_and_flush(&mut self, stream: Resource<DynOutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        stream_at_once(
            "blocking-write-and-flush",
            async_streams::HostOutputStream::blocking_write_and_flush(self.0, stream, bytes),
        )
    }

    fn blocking_write_zeroes_and_flush(&mut self, stream: Resource<DynOutputStream>, len: u64) -> StreamResult<()> {
        stream_at_once(
            "blocking-write-zeroes-and-flush",
            async_streams::HostOutputStream::blocking_write_zeroes_and_flush(self.0, stream, len),
        )
    }

    fn subscribe(&mut self, stream: Resource<DynOutputStream>) -> wasmtime::Result<Resource<DynPollable>> {
        async_streams::HostOutputStream::subscribe(self.0, stream)
    }

    fn write_zeroes(&mut self, stream: Resource<DynOutputStream>, len: u64) -> StreamResult<()> {
        async_streams::HostOutputStream::write_zeroes(self.0, stream, len)
    }

    fn flush(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<()> {
        async_streams::HostOutputStream::flush(self.0, stream)
    }

    fn blocking_flush(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<()> {
        stream_at_once("blocking-flush", async_streams::HostOutputStream::blocking_flush(self.0, stream))
    }

    fn splice(&mut self, dst: Resource<DynOutputStream>, src: Resource<DynInputStream>, len: u64) -> StreamResult<u64> {
        async_streams::HostOutputStream::splice(self.0, dst, src, len)
    }

    fn blocking_splice(
        &mut self,
        dst: Resource<DynOutputStream>,
        src: Resource<DynInputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        stream_at_once("blocking-splice", async_streams::HostOutputStream::blocking_splice(self.0, dst, src, len))
    }
}

impl streams::HostInputStream for NeverBlocking<'_> {
    fn drop(&mut self, stream: Resource<DynInputStream>) -> wasmtime::Result<()> {
        at_once(async_streams::HostInputStream::drop(self.0, stream))
            .unwrap_or_else(|| Err(never_ready("dropping an input stream")))
    }

    fn read(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<Vec<u8>> {
        async_streams::HostInputStream::read(self.0, stream, len)
    }

    fn blocking_read(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<Vec<u8>> {
        stream_at_once("blocking-read", async_streams::HostInputStream::blocking_read(self.0, stream, len))
    }

    fn skip(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<u64> {
        async_streams::HostInputStream::skip(self.0, stream, len)
    }

    fn blocking_skip(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<u64> {
        stream_at_once("blocking-skip", async_streams::HostInputStream::blocking_skip(self.0, stream, len))
    }

    fn subscribe(&mut self, stream: Resource<DynInputStream>) -> wasmtime::Result<Resource<DynPollable>> {
        async_streams::HostInputStream::subscribe(self.0, stream)
    }
}

/// `wasi:sockets/udp-create-socket`, refused at once; the rest of `wasi:sockets/network` as
/// wasmtime-wasi has it.
struct NoUdp;

impl HasData for NoUdp {
    type Data<'a> = NoUdpView<'a>;
}

struct NoUdpView<'a>(WasiSocketsCtxView<'a>);

impl udp_create_socket::Host for NoUdpView<'_> {
    fn create_udp_socket(&mut self, _family: udp_create_socket::IpAddressFamily) -> SocketResult<Resource<UdpSocket>> {
        Err(SocketErrorCode::AccessDenied.into())
    }
}

impl network::Host for NoUdpView<'_> {
    fn convert_error_code(&mut self, error: SocketError) -> wasmtime::Result<SocketErrorCode> {
        network::Host::convert_error_code(&mut self.0, error)
    }

    fn network_error_code(&mut self, err: Resource<wasmtime::Error>) -> wasmtime::Result<Option<SocketErrorCode>> {
        network::Host::network_error_code(&mut self.0, err)
    }
}

impl network::HostNetwork for NoUdpView<'_> {
    fn drop(&mut self, this: Resource<network::Network>) -> wasmtime::Result<()> {
        network::HostNetwork::drop(&mut self.0, this)
    }
}

// ---------------------------------------------------------------------------------------
// stdout and stderr

/// The guest's stdout and stderr (one buffer): the first [`STDIO_CAPTURE_BYTES`] are kept,
/// the rest counted. Always ready, never full, never an error: printing too much loses
/// output, never the call.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<CapturedBytes>>);

#[derive(Default)]
struct CapturedBytes {
    kept: Vec<u8>,
    dropped: u64,
}

impl Captured {
    fn push(&self, bytes: &[u8]) {
        let mut c = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let room = STDIO_CAPTURE_BYTES.saturating_sub(c.kept.len());
        let (kept, dropped) = bytes.split_at(bytes.len().min(room));
        c.kept.extend_from_slice(kept);
        c.dropped = c.dropped.saturating_add(dropped.len() as u64);
    }

    fn take(&self) -> (Vec<u8>, u64) {
        let mut c = self.0.lock().unwrap_or_else(|p| p.into_inner());
        (std::mem::take(&mut c.kept), std::mem::take(&mut c.dropped))
    }
}

impl OutputStream for Captured {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT as usize)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for Captured {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for Captured {
    fn poll_write(self: std::pin::Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: std::pin::Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl wasmtime_wasi::cli::IsTerminal for Captured {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for Captured {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}
