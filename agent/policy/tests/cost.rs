//! The cost of one plugin call, v1 and v2, as ratios to the empty-plugin floor of each ABI
//! (printed, never asserted: `scripts/bench` runs it with `--ignored` in a release build).
//! Goals (the issue's): a v2 placement call at most 3x an empty v2 call on the 32-VF
//! fixture; a v1 call no more than before.
//!
//! Plugins: the v1 and v2 builds under `target/plugins/` (`scripts/build-plugins`), the
//! empty v1 module `tests/plugins/rank-fixed.wat` (answers without reading its input), and
//! the empty v2 component `tests/hostile-v2` with params `{"do":"nothing"}`.

mod common;

use common::{fixture, hostile_v2, root, wat};
use gpuvisor_policy::{Limits, Plugin};
use gpuvisor_sdk::testing::load_input;
use gpuvisor_sdk::{PlacementInput, PolicyKind};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn plugins_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target")).join("plugins")
}

/// The 32-VF fixture (2 GPUs x 16 VFs) and the same inventory with 16 GPUs (256 VFs).
fn inputs() -> [(&'static str, PlacementInput); 2] {
    let small: PlacementInput = load_input(fixture("placement-second-2q.json")).unwrap();
    let mut large = small.clone();
    let gpus = small.inventory.gpus.clone();
    large.inventory.gpus = (0..8)
        .flat_map(|n| {
            gpus.iter().map(move |g| {
                let mut g = g.clone();
                let bus = |a: &str| format!("{}{:x}{}", &a[..5], n, &a[6..]);
                g.address = bus(&g.address);
                for d in &mut g.devices {
                    d.address = bus(&d.address);
                }
                g
            })
        })
        .collect();
    [("32 VFs", small), ("256 VFs", large)]
}

struct Cost {
    wall: Duration,
    fuel: u64,
}

/// The median wall time and the fuel of one call, over `n` typed calls (as the agent
/// makes them: the SDK's input, no JSON on the host side for v2).
fn cost(p: &Plugin, input: &PlacementInput, n: u32) -> Cost {
    let mut walls = Vec::new();
    let before = p.stats().fuel_consumed;
    for _ in 0..n {
        let started = Instant::now();
        let result = p.call_placement(input);
        walls.push(started.elapsed());
        result.unwrap_or_else(|e| panic!("{}: {e}", p.manifest().name));
    }
    walls.sort();
    Cost { wall: walls[walls.len() / 2], fuel: (p.stats().fuel_consumed - before) / u64::from(n) }
}

fn load(path: PathBuf) -> Plugin {
    let limits =
        Limits { fuel: 2_000_000_000, memory_bytes: 256 << 20, deadline: Duration::from_secs(10), ..Limits::default() };
    Plugin::load(&path, PolicyKind::Placement, limits).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
#[ignore]
fn bench_call_cost_against_the_empty_plugin() {
    let empty_v1 = load(wat("rank-fixed.wat"));
    let empty_v2 = load(hostile_v2(""));
    let spread_v1 = load(plugins_dir().join("v1/placement-spread.wasm"));
    let spread_v2 = load(plugins_dir().join("placement-spread.wasm"));
    let tenant_v1 = load(plugins_dir().join("tenant-isolation.wasm"));
    let tenant_py = load(plugins_dir().join("tenant-isolation-py.wasm"));
    let tenant_js = load(plugins_dir().join("tenant-isolation-js.wasm"));
    assert_eq!((spread_v1.abi_version(), spread_v2.abi_version()), (1, 2), "v1 and v2 builds of placement-spread");
    for (size, input) in inputs() {
        let mut empty_input = input.clone();
        empty_input.params = serde_json::json!({"do": "nothing"});
        let n = 50;
        let floor_v1 = cost(&empty_v1, &input, n);
        let floor_v2 = cost(&empty_v2, &empty_input, n);
        let row = |what: &str, c: &Cost, floor: &Cost, abi: &str| {
            // The empty v1 module reads nothing (a few instructions): a fuel ratio to it
            // says nothing, so only v2's is printed.
            let fuel_ratio = if floor.fuel >= 1000 {
                format!(", {:.2}x in fuel", c.fuel as f64 / floor.fuel as f64)
            } else {
                String::new()
            };
            println!(
                "bench plugin call ({size}) {what}: {:.1} us, {} fuel; {:.2}x the empty {abi} plugin in time{fuel_ratio}",
                c.wall.as_secs_f64() * 1e6,
                c.fuel,
                c.wall.as_secs_f64() / floor.wall.as_secs_f64(),
            );
        };
        row("empty v1", &floor_v1, &floor_v1, "v1");
        row("empty v2", &floor_v2, &floor_v2, "v2");
        row("placement-spread v1", &cost(&spread_v1, &input, n), &floor_v1, "v1");
        row("placement-spread v2 (goal <= 3x)", &cost(&spread_v2, &input, n), &floor_v2, "v2");
        row("tenant-isolation v1 (Rust)", &cost(&tenant_v1, &input, n), &floor_v1, "v1");
        row("tenant-isolation v2 (Python)", &cost(&tenant_py, &input, 10), &floor_v2, "v2");
        row("tenant-isolation v2 (JavaScript)", &cost(&tenant_js, &input, 10), &floor_v2, "v2");
    }
}
