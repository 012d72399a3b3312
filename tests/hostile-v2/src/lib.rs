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
//! - anything else: ranks the free devices.
//!
//! Features change the manifest: `lying-manifest` lists `grace`, `abi-one` says
//! abi-version 1; the host refuses both at load.

#![cfg(target_arch = "wasm32")]

wit_bindgen::generate!({ path: "wit", world: "hostile", generate_all });

use exports::gpuvisor::policy::placement::{DeviceState, Guest as Placement, PlacementAnswer, PlacementInput};
use gpuvisor::policy::types::PolicyKind;

struct Hostile;

impl Guest for Hostile {
    fn manifest() -> Manifest {
        let kinds =
            if cfg!(feature = "lying-manifest") { vec![PolicyKind::Grace] } else { vec![PolicyKind::Placement] };
        let abi_version = if cfg!(feature = "abi-one") { 1 } else { 2 };
        Manifest { name: "hostile-v2".into(), version: "0.1.0".into(), kinds, abi_version }
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
