//! `hostile-v2`: a placement component that misbehaves on request, for the plugin host's
//! tests (`agent/policy/tests/components.rs`). `params.do` picks the behaviour:
//!
//! - `trap`: panics (a wasm trap);
//! - `loop`: loops forever;
//! - `grow`: allocates until refused;
//! - `huge`: ranks 100,000 addresses (a reply over the size limit);
//! - `claimed`: ranks every device, claimed ones first;
//! - `error`: answers `err("hostile error")`;
//! - `nothing` (params exactly `{"do":"nothing"}`): ranks nothing at once (the empty
//!   plugin of the cost benchmark);
//! - `wasi`: tries every WASI capability and answers `reject(<what it got>)`;
//! - `sleep`: blocks on a 60 s `monotonic-clock.subscribe-duration`, then ranks the free
//!   devices; `sleep-until`: the same on `subscribe-instant` of the end of time;
//!   `poll`: the same through `wasi:io/poll.poll` on a list of such clocks;
//! - `stdin`: a `blocking-read` of stdin, then ranks the free devices;
//! - `stdout`: writes 100 KiB to stdout with `blocking-write-and-flush`, then ranks the
//!   free devices;
//! - anything else: ranks the free devices.
//!
//! Features change the manifest: `lying-manifest` lists `grace`, `abi-one` says
//! abi-version 1; the host refuses both at load. `name-escape` (escape codes and a newline),
//! `name-empty`, `name-long` (200 bytes) and `name-default` (`placement-spread`, a default
//! plugin's) change its name.

#![cfg(target_arch = "wasm32")]
// A test plugin: the items wit-bindgen generates below (modules, `Guest` traits, the WIT
// types) carry no docs, and nothing of its own is public.
#![allow(missing_docs)]

wit_bindgen::generate!({ path: "wit", world: "hostile", generate_all });

use exports::gpuvisor::policy::placement::{DeviceState, Guest as Placement, PlacementAnswer, PlacementInput};
use gpuvisor::policy::types::PolicyKind;

struct Hostile;

impl Guest for Hostile {
    fn manifest() -> Manifest {
        let kinds =
            if cfg!(feature = "lying-manifest") { vec![PolicyKind::Grace] } else { vec![PolicyKind::Placement] };
        let abi_version = if cfg!(feature = "abi-one") { 1 } else { 2 };
        Manifest { name: name(), version: "0.1.0".into(), kinds, abi_version }
    }
}

/// The manifest's name (the features `name-*` make it lie).
fn name() -> String {
    if cfg!(feature = "name-escape") {
        "hostile\u{1b}[31m\n2026-01-01T00:00:00Z ERROR forged".into()
    } else if cfg!(feature = "name-empty") {
        String::new()
    } else if cfg!(feature = "name-long") {
        "h".repeat(200)
    } else if cfg!(feature = "name-default") {
        "placement-spread".into()
    } else {
        "hostile-v2".into()
    }
}

fn wants(params: &str, what: &str) -> bool {
    params.contains(&format!("\"do\":\"{what}\""))
}

impl Placement for Hostile {
    fn place(input: PlacementInput) -> Result<PlacementAnswer, String> {
        if input.params == r#"{"do":"nothing"}"# {
            // The empty plugin of the cost benchmark: the input was lifted, nothing else.
            return Ok(PlacementAnswer::Ranked(Vec::new()));
        }
        let p = input.params.replace(' ', "");
        if wants(&p, "trap") {
            panic!("hostile trap");
        }
        if wants(&p, "loop") {
            let mut n: u64 = 0;
            loop {
                n = std::hint::black_box(n.wrapping_add(1));
            }
        }
        if wants(&p, "grow") {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                hoard.push(vec![1u8; 1 << 20]);
                std::hint::black_box(&hoard);
            }
        }
        if wants(&p, "huge") {
            return Ok(PlacementAnswer::Ranked(
                (0..100_000).map(|i| format!("0000:41:{:02x}.{}", i % 256, i % 8)).collect(),
            ));
        }
        if wants(&p, "error") {
            return Err("hostile error".into());
        }
        if wants(&p, "wasi") {
            return Ok(PlacementAnswer::Reject(probe_wasi()));
        }
        block(&p);
        let devices = input.inventory.gpus.iter().flat_map(|g| g.devices.iter());
        let ranked: Vec<String> = if wants(&p, "claimed") {
            let mut all: Vec<_> = devices.collect();
            all.sort_by_key(|d| d.state != DeviceState::Claimed);
            all.into_iter().map(|d| d.address.clone()).collect()
        } else {
            devices.filter(|d| d.state == DeviceState::Free).map(|d| d.address.clone()).collect()
        };
        Ok(PlacementAnswer::Ranked(ranked))
    }
}

/// The steps that wait on the host: a clock, stdin; and the stdout flood.
fn block(p: &str) {
    use wasi::clocks::monotonic_clock;
    const MINUTE_NS: u64 = 60_000_000_000;
    if wants(p, "sleep") {
        monotonic_clock::subscribe_duration(MINUTE_NS).block();
    }
    if wants(p, "sleep-until") {
        monotonic_clock::subscribe_instant(u64::MAX).block();
    }
    if wants(p, "poll") {
        let clocks = [monotonic_clock::subscribe_duration(MINUTE_NS), monotonic_clock::subscribe_duration(MINUTE_NS)];
        let list: Vec<&wasi::io::poll::Pollable> = clocks.iter().collect();
        std::hint::black_box(wasi::io::poll::poll(&list));
    }
    if wants(p, "stdin") {
        std::hint::black_box(wasi::cli::stdin::get_stdin().blocking_read(4096)).ok();
    }
    if wants(p, "stdout") {
        let out = wasi::cli::stdout::get_stdout();
        let mut line = [b'.'; 4096];
        line[4095] = b'\n';
        for _ in 0..25 {
            // 25 × 4 KiB: over the host's 16 KiB capture.
            if out.blocking_write_and_flush(&line).is_err() {
                break;
            }
        }
    }
}

/// Tries files, sockets, the clocks, randomness, the environment and stdout; says what
/// each gave, as `key=value` pairs separated by spaces.
fn probe_wasi() -> String {
    use wasi::sockets::network::IpAddressFamily;
    let dirs = wasi::filesystem::preopens::get_directories().len();
    let socket = match wasi::sockets::tcp_create_socket::create_tcp_socket(IpAddressFamily::Ipv4) {
        Err(e) => format!("err:{}", e.name()),
        Ok(sock) => {
            let net = wasi::sockets::instance_network::instance_network();
            let addr = wasi::sockets::network::IpSocketAddress::Ipv4(wasi::sockets::network::Ipv4SocketAddress {
                port: 80,
                address: (127, 0, 0, 1),
            });
            match sock.start_connect(&net, addr) {
                Err(e) => format!("connect-err:{}", e.name()),
                Ok(()) => {
                    sock.subscribe().block();
                    match sock.finish_connect() {
                        Err(e) => format!("connect-err:{}", e.name()),
                        Ok(_) => "connected".to_string(),
                    }
                }
            }
        }
    };
    let wall1 = wasi::clocks::wall_clock::now();
    let wall2 = wasi::clocks::wall_clock::now();
    let mono1 = wasi::clocks::monotonic_clock::now();
    let mono2 = wasi::clocks::monotonic_clock::now();
    let random1 = wasi::random::random::get_random_bytes(8);
    let random2 = wasi::random::random::get_random_bytes(8);
    let env = wasi::cli::environment::get_environment().len();
    let args = wasi::cli::environment::get_arguments().len();
    let stdout = wasi::cli::stdout::get_stdout();
    let printed = stdout.blocking_write_and_flush(b"hello from hostile-v2 stdout\n").is_ok();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "dirs={dirs} socket={socket} wall={},{} wall2={},{} mono={mono1},{mono2} random={},{} env={env} args={args} printed={printed}",
        wall1.seconds,
        wall1.nanoseconds,
        wall2.seconds,
        wall2.nanoseconds,
        hex(&random1),
        hex(&random2)
    )
}

export!(Hostile);
