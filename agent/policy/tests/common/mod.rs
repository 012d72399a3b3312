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

/// The target directory (`CARGO_TARGET_DIR`, else the workspace's `target/`).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"))
}

/// A file `scripts/build-plugins` writes under the target directory, e.g.
/// `plugins/tenant-isolation-py.wasm`.
pub fn built(file: &str) -> PathBuf {
    let path = target_dir().join(file);
    assert!(
        path.exists(),
        "{} is missing: run scripts/setup (the guest toolchains), then scripts/build-plugins",
        path.display()
    );
    path
}

/// The hostile Python test plugin (`tests/hostile-py`), built by `scripts/build-plugins`.
pub fn hostile_py() -> PathBuf {
    built("hostile-py/hostile-py.wasm")
}

/// A fixture's JSON.
pub fn fixture_json(name: &str) -> serde_json::Value {
    let path = fixture(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
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
    let target_dir = target_dir();
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

/// The component at `core` (a wasm32 core module with a `component-type` section, as
/// wit-bindgen builds it) made into a component at `out` by `wasm-tools component new`
/// (`scripts/setup` installs wasm-tools).
pub fn componentize(core: &Path, out: &Path) -> Result<(), String> {
    let tool = wasm_tools();
    let status = Command::new(&tool)
        .args(["component", "new"])
        .arg(core)
        .arg("-o")
        .arg(out)
        .status()
        .map_err(|e| format!("cannot run {} ({e}); run scripts/setup", tool.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("wasm-tools component new {} failed ({status})", core.display()))
    }
}

/// `wasm-tools`: from PATH, else cargo's bin directory.
pub fn wasm_tools() -> PathBuf {
    let in_cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .map(|h| h.join("bin/wasm-tools"));
    match in_cargo_home {
        Some(p) if p.exists() => p,
        _ => PathBuf::from("wasm-tools"),
    }
}

/// The hostile ABI v2 test plugin (`tests/hostile-v2`) as a component, built once per
/// feature set (`""` for none) per test run.
pub fn hostile_v2(features: &str) -> PathBuf {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    static BUILT: Mutex<BTreeMap<String, Result<PathBuf, String>>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    let result = built.entry(features.to_string()).or_insert_with(|| build_hostile_v2(features));
    result.clone().unwrap_or_else(|e| panic!("{e}"))
}

fn build_hostile_v2(features: &str) -> Result<PathBuf, String> {
    let target_root = target_dir();
    let variant = if features.is_empty() { "default" } else { features };
    // One target directory for every feature set (the builds are serialised by the lock in
    // `hostile_v2`); each build is made into its own component file at once.
    let target_dir = target_root.join("hostile-v2");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root())
        .args(["build", "--target", "wasm32-unknown-unknown", "--release", "-p", "hostile-v2"])
        .arg("--target-dir")
        .arg(&target_dir);
    if !features.is_empty() {
        cmd.args(["--features", features]);
    }
    let status = cmd.status().map_err(|e| format!("cannot run cargo to build hostile-v2: {e}"))?;
    if !status.success() {
        return Err(format!("building hostile-v2 ({variant}) failed ({status})"));
    }
    let core = target_dir.join("wasm32-unknown-unknown/release/hostile_v2.wasm");
    let out = target_dir.join(format!("hostile-v2-{variant}.component.wasm"));
    componentize(&core, &out)?;
    Ok(out)
}

/// Polls `f` (every 10 ms) until it gives a value, at most `timeout`.
pub fn wait_until<T>(timeout: std::time::Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let until = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if std::time::Instant::now() > until {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
