//! ABI v1 and ABI v2 builds of the same plugin give the same answers: for every fixture of
//! `plugins/fixtures/` of its kind, the v1 core module and the v2 component of each default
//! plugin (and of the example `hypervisor-ch-plain`) return identical result JSON and log
//! the same lines. The test builds both itself, as `scripts/build-plugins` does and in the
//! same target dirs (so either one's build makes the other's a no-op), without the other
//! languages' toolchains that script also needs: v1 without features
//! (`target/wasm32-unknown-unknown/release`), v2 with `--features <crate>/v2` in
//! `target/v2`, then `wasm-tools component new` to `target/v2/components/<name>.wasm`.

mod common;

use gpuvisor_policy::{read_input_file, reply_json, run_input, Limits, Plugin};
use gpuvisor_sdk::PolicyKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The plugins built both ways, with their kind.
const PLUGINS: [(&str, PolicyKind); 5] = [
    ("placement-spread", PolicyKind::Placement),
    ("placement-pack", PolicyKind::Placement),
    ("hypervisor-default", PolicyKind::Hypervisor),
    ("hypervisor-ch-plain", PolicyKind::Hypervisor),
    ("grace-default", PolicyKind::Grace),
];

/// The directory of the v2 components, built once per test process.
fn components_dir() -> &'static Path {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT.get_or_init(build_components).as_ref().map(PathBuf::as_path).unwrap_or_else(|e| panic!("{e}"))
}

fn build_components() -> Result<PathBuf, String> {
    let target_root =
        std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| common::root().join("target"));
    let target_dir = target_root.join("v2");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(common::root())
        .args(["build", "--target", "wasm32-unknown-unknown", "--release"])
        .arg("--target-dir")
        .arg(&target_dir);
    let mut features = Vec::new();
    for (name, _) in PLUGINS {
        cmd.args(["-p", name]);
        features.push(format!("{name}/v2"));
    }
    cmd.args(["--features", &features.join(",")]);
    let status = cmd.status().map_err(|e| format!("cannot run cargo to build the v2 plugins: {e}"))?;
    if !status.success() {
        return Err(format!("building the v2 plugins failed ({status})"));
    }
    let out = target_dir.join("components");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    for (name, _) in PLUGINS {
        let core = target_dir.join("wasm32-unknown-unknown/release").join(format!("{}.wasm", name.replace('-', "_")));
        common::componentize(&core, &out.join(format!("{name}.wasm")))?;
    }
    Ok(out)
}

/// The v1 module and the v2 component of a plugin.
fn builds(name: &str) -> (PathBuf, PathBuf) {
    let (v1, v2) = (common::built_plugin(name), components_dir().join(format!("{name}.wasm")));
    // A core module's preamble is `\0asm` 01 00 00 00, a component's `\0asm` 0d 00 01 00.
    let preamble = |p: &Path| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))[..8].to_vec();
    assert_eq!(preamble(&v1), b"\0asm\x01\0\0\0", "{} is not a core module", v1.display());
    assert_eq!(preamble(&v2), b"\0asm\x0d\0\x01\0", "{} is not a component", v2.display());
    (v1, v2)
}

/// The fixtures of a kind (`plugins/fixtures/<kind>-*.json`), sorted.
fn fixtures(kind: PolicyKind) -> Vec<PathBuf> {
    let dir = common::root().join("plugins/fixtures");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(&format!("{}-", kind.as_str())) && name.ends_with(".json")
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no {} fixtures in {}", kind.as_str(), dir.display());
    files
}

fn load(path: &Path, kind: PolicyKind) -> Plugin {
    Plugin::load(path, kind, Limits::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn v1_and_v2_builds_have_the_same_manifest() {
    for (name, kind) in PLUGINS {
        let (v1, v2) = builds(name);
        let (v1, v2) = (load(&v1, kind), load(&v2, kind));
        assert_eq!(v1.manifest(), v2.manifest(), "{name}");
        assert_eq!(v2.manifest().name, name);
        assert_eq!(v2.manifest().kinds, vec![kind], "{name}");
    }
}

#[test]
fn v1_and_v2_builds_give_identical_results_on_every_fixture() {
    let mut compared = 0;
    for (name, kind) in PLUGINS {
        let (v1, v2) = builds(name);
        let (v1, v2) = (load(&v1, kind), load(&v2, kind));
        for fixture in fixtures(kind) {
            let input = read_input_file(&fixture).unwrap().input;
            let f = fixture.file_name().unwrap().to_string_lossy().into_owned();
            let (r1, report1) = run_input(&v1, &input).unwrap_or_else(|e| panic!("{name} v1 on {f}: {e}"));
            let (r2, report2) = run_input(&v2, &input).unwrap_or_else(|e| panic!("{name} v2 on {f}: {e}"));
            assert_eq!(reply_json(&r1), reply_json(&r2), "{name} on {f}: the v1 module and the v2 component differ");
            assert_eq!(report1.logs, report2.logs, "{name} on {f}: the v1 module and the v2 component log differently");
            compared += 1;
        }
    }
    assert!(compared >= PLUGINS.len(), "compared {compared} pairs");
}
