//! The C header of ABI v1 (`sdk/include/gpuvisor_v1.h`) is right: its export and import
//! names, ABI version and log levels are the SDK's; it compiles with the host's C compiler;
//! and a C plugin built against it with clang for wasm32
//! (`plugins/examples/c-placement/placement.c`) loads in the plugin host and answers.
//! clang and lld come from scripts/setup (Debian packages `clang`, `lld`).

mod common;

use common::{fixture, root};
use gpuvisor_policy::{Limits, Plugin};
use gpuvisor_sdk::abi::{LogLevel, BASE_EXPORTS, LOG_IMPORT};
use gpuvisor_sdk::testing::load_input;
use gpuvisor_sdk::{PlacementAnswer, PlacementInput, PolicyKind, ABI_VERSION};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

fn header() -> PathBuf {
    root().join("sdk/include/gpuvisor_v1.h")
}

fn header_text() -> String {
    std::fs::read_to_string(header()).unwrap()
}

/// Every string argument of `macro("...")` / `macro("...", "...")` in the header's code
/// (not its comments, not the macro definitions).
fn macro_args(text: &str, name: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| l.starts_with(&format!("{name}(\""))) {
        let args = &line[name.len() + 1..line.find(')').unwrap()];
        out.push(args.split(',').map(|a| a.trim().trim_matches('"').to_string()).collect());
    }
    out
}

#[test]
fn header_names_are_the_sdks() {
    let text = header_text();
    let exports: BTreeSet<String> = macro_args(&text, "GPUVISOR_EXPORT").into_iter().map(|a| a[0].clone()).collect();
    let mut want: BTreeSet<String> = BASE_EXPORTS.iter().filter(|e| **e != "memory").map(|e| e.to_string()).collect();
    for kind in [PolicyKind::Placement, PolicyKind::Hypervisor, PolicyKind::Grace] {
        want.insert(kind.export_name().to_string());
    }
    assert_eq!(exports, want, "the header's GPUVISOR_EXPORT names");
    // Each declaration's C name is its export name.
    for line in text.lines().filter(|l| l.starts_with("GPUVISOR_EXPORT(\"")) {
        let name = macro_args(line, "GPUVISOR_EXPORT")[0][0].clone();
        let decl = &line[line.find(')').unwrap() + 1..];
        let declared = decl.split('(').next().unwrap().trim_end().rsplit([' ', '*']).next().unwrap();
        assert_eq!(declared, name, "{line}: declares another name than it exports");
    }
    let imports = macro_args(&text, "GPUVISOR_IMPORT");
    assert_eq!(imports, vec![vec![LOG_IMPORT.0.to_string(), LOG_IMPORT.1.to_string()]], "the header's imports");
    assert!(text.contains(&format!("#define GPUVISOR_ABI_VERSION {ABI_VERSION}\n")));
    for (name, level) in [
        ("ERROR", LogLevel::Error),
        ("WARN", LogLevel::Warn),
        ("INFO", LogLevel::Info),
        ("DEBUG", LogLevel::Debug),
        ("TRACE", LogLevel::Trace),
    ] {
        let line = format!("GPUVISOR_LOG_{name} = {},", level as i32);
        assert!(text.contains(&line), "the header lacks `{line}`");
    }
    assert!(text.contains("__attribute__((export_name(name)))"));
    assert!(text.contains("__attribute__((import_module(module), import_name(name)))"));
}

#[test]
fn header_compiles_with_the_host_c_compiler() {
    for std in ["c99", "c11"] {
        let out = Command::new("gcc")
            .args(["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-pedantic", &format!("-std={std}"), "-x", "c"])
            .arg(header())
            .output()
            .expect("gcc runs (Debian: build-essential)");
        assert!(out.status.success(), "gcc -std={std}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Builds the C example for wasm32 with clang and lld (as the header's comment says).
fn build_c_plugin(dir: &std::path::Path) -> PathBuf {
    let wasm = dir.join("c_placement.wasm");
    let out = Command::new("clang")
        .args([
            "--target=wasm32",
            "-nostdlib",
            "-ffreestanding",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wl,--no-entry",
        ])
        .arg("-I")
        .arg(root().join("sdk/include"))
        .arg("-o")
        .arg(&wasm)
        .arg(root().join("plugins/examples/c-placement/placement.c"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run clang ({e}); install clang and lld (scripts/setup)"));
    assert!(out.status.success(), "clang --target=wasm32 failed: {}", String::from_utf8_lossy(&out.stderr));
    wasm
}

#[test]
fn a_c_plugin_built_against_the_header_loads_and_answers() {
    let dir = tempfile::tempdir().unwrap();
    let wasm = build_c_plugin(dir.path());
    let plugin = Plugin::load(&wasm, PolicyKind::Placement, Limits::default())
        .unwrap_or_else(|e| panic!("the C plugin does not load: {e}"));
    assert_eq!(plugin.manifest().name, "c-placement");
    assert_eq!(plugin.manifest().kinds, vec![PolicyKind::Placement]);

    let input: PlacementInput = load_input(fixture("placement-empty-2q.json")).unwrap();
    let first = input.inventory.gpus[0].devices[0].address.clone();
    let answer = plugin.call_placement(&input).unwrap();
    assert_eq!(answer, PlacementAnswer::Ranked(vec![first]));

    let mut empty = input.clone();
    empty.inventory.gpus.clear();
    assert_eq!(plugin.call_placement(&empty).unwrap(), PlacementAnswer::Reject("no device".into()));
    // Its log lines went through the one import, none dropped.
    assert_eq!(plugin.stats().log_lines_dropped, 0);

    // The slot must match the manifest: the same module is refused as a grace plugin.
    assert!(Plugin::load(&wasm, PolicyKind::Grace, Limits::default()).is_err());
}
