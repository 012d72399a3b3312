//! Shared helpers of the plugin host's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A fixture of the default plugins (`plugins/fixtures/<name>`).
pub fn fixture(name: &str) -> PathBuf {
    root().join("plugins/fixtures").join(name)
}

/// A hostile/test plugin in WAT (`tests/plugins/<name>`).
pub fn wat(name: &str) -> PathBuf {
    root().join("tests/plugins").join(name)
}

/// Every plugin crate of the repository: the defaults and the examples.
const PLUGINS: [&str; 5] =
    ["placement-spread", "placement-pack", "hypervisor-default", "grace-default", "hypervisor-ch-plain"];

/// The release wasm32 build of a plugin of the repository, built once per test run
/// (`cargo build --target wasm32-unknown-unknown --release -p ...`; a no-op when fresh).
pub fn built_plugin(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = BUILT.get_or_init(build_plugins).as_ref().unwrap_or_else(|e| panic!("{e}"));
    let file = dir.join(format!("{}.wasm", name.replace('-', "_")));
    assert!(file.exists(), "{} is missing after the build; run scripts/build-plugins", file.display());
    file
}

fn build_plugins() -> Result<PathBuf, String> {
    let target_dir = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root())
        .args(["build", "--target", "wasm32-unknown-unknown", "--release"])
        .arg("--target-dir")
        .arg(&target_dir);
    for p in PLUGINS {
        cmd.args(["-p", p]);
    }
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run cargo to build the plugins ({e}); run scripts/build-plugins first"))?;
    if !status.success() {
        return Err(format!(
            "building the plugins for wasm32-unknown-unknown failed ({status}); \
             is the target installed? (rustup target add wasm32-unknown-unknown)"
        ));
    }
    Ok(target_dir.join("wasm32-unknown-unknown/release"))
}
