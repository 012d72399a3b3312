//! Compiled plugins kept on disk, so that an agent start does not compile every plugin
//! again (compiling a component of a language toolchain takes seconds).
//!
//! A cache entry is the artifact wasmtime serialises (`Module::serialize`,
//! `Component::serialize`), stored as `<dir>/<key>.cwasm` where the key is the SHA-256 of
//! the wasm bytes, of the engine's compatibility hash (wasmtime's version, the compiler
//! and its settings, fuel and epoch instrumentation, the pool's settings), of this crate's
//! version and of the kind of code. A different file, another engine configuration or
//! another agent build never meets an entry it did not write. On load an entry is
//! deserialised, which wasmtime checks again against the engine (a mismatch, a truncated
//! or unreadable entry is a miss: the plugin is compiled and the entry written anew).
//!
//! Deserialising runs the entry's machine code, so the cache directory is trusted like the
//! agent's binary: it is created `0700`, and it is used only when it is owned by the
//! agent's user and not writable by group or others; otherwise every load compiles (one
//! WARN per directory).
//!
//! The directory is set once per process with [`set_cache_dir`] (the agent uses
//! `<data_dir>/plugin-cache`); without one, every load compiles.

use sha2::{Digest, Sha256};
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::RwLock;
use wasmtime::component::Component;
use wasmtime::{Engine, Module};

static DIR: RwLock<Option<PathBuf>> = RwLock::new(None);

/// Sets (or, with `None`, clears) the directory compiled plugins are kept in, for every
/// later [`crate::Plugin::load`] of this process. The directory is created on first use.
pub fn set_cache_dir(dir: Option<PathBuf>) {
    match DIR.write() {
        Ok(mut d) => *d = dir,
        Err(poisoned) => *poisoned.into_inner() = dir,
    }
}

fn cache_dir() -> Option<PathBuf> {
    match DIR.read() {
        Ok(d) => d.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

/// How a load got its compiled code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheOutcome {
    /// Read from the cache.
    Hit,
    /// Compiled, and written to the cache.
    Compiled,
    /// Compiled; no usable cache directory (none set, or not trusted).
    Uncached,
}

impl CacheOutcome {
    /// `hit`, `compiled` or `uncached`.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheOutcome::Hit => "hit",
            CacheOutcome::Compiled => "compiled",
            CacheOutcome::Uncached => "uncached",
        }
    }
}

/// The two kinds of code, compiled and (de)serialised alike.
pub(crate) trait Code: Sized {
    const TAG: &'static str;
    fn compile(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Self>;
    fn serialize(&self) -> wasmtime::Result<Vec<u8>>;
    /// # Safety
    /// `bytes` must be an artifact wasmtime serialised (see the module docs).
    unsafe fn deserialize(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Self>;
}

impl Code for Module {
    const TAG: &'static str = "module";
    fn compile(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Self> {
        Module::new(engine, bytes)
    }
    fn serialize(&self) -> wasmtime::Result<Vec<u8>> {
        Module::serialize(self)
    }
    unsafe fn deserialize(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Self> {
        // SAFETY: forwarded to the caller.
        unsafe { Module::deserialize(engine, bytes) }
    }
}

impl Code for Component {
    const TAG: &'static str = "component";
    fn compile(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Self> {
        Component::new(engine, bytes)
    }
    fn serialize(&self) -> wasmtime::Result<Vec<u8>> {
        Component::serialize(self)
    }
    unsafe fn deserialize(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Self> {
        // SAFETY: forwarded to the caller.
        unsafe { Component::deserialize(engine, bytes) }
    }
}

/// The cache key of `bytes` compiled as `C` by `engine`.
fn key<C: Code>(engine: &Engine, bytes: &[u8]) -> String {
    struct Sha(Sha256);
    impl Hasher for Sha {
        fn finish(&self) -> u64 {
            0
        }
        fn write(&mut self, bytes: &[u8]) {
            self.0.update(bytes);
        }
    }
    let mut h = Sha(Sha256::new());
    engine.precompile_compatibility_hash().hash(&mut h);
    h.0.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.0.update(C::TAG.as_bytes());
    h.0.update(Sha256::digest(bytes));
    h.0.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// `bytes` compiled as `C`: from the cache when it holds them, else compiled (and kept).
/// Errors: the compile error (a cache problem is never an error: it is a miss).
pub(crate) fn compile<C: Code>(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<(C, CacheOutcome)> {
    let Some(dir) = cache_dir().filter(|d| trusted(d)) else {
        return Ok((C::compile(engine, bytes)?, CacheOutcome::Uncached));
    };
    let entry = dir.join(format!("{}.cwasm", key::<C>(engine, bytes)));
    // Read into memory, not mapped: a mapped entry truncated or rewritten in place under a
    // loaded plugin would kill the agent with SIGBUS (a test does exactly that).
    match std::fs::read(&entry) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(entry = %entry.display(), error = %e,
            "policy plugins: a cached compiled plugin cannot be read; compiling again"),
        // SAFETY: the entry is in a directory only the agent's user can write (checked by
        // `trusted`), written by `store` from wasmtime's own serialisation; wasmtime
        // checks its header and the engine's compatibility before using it.
        Ok(artifact) => match unsafe { C::deserialize(engine, &artifact) } {
            Ok(code) => return Ok((code, CacheOutcome::Hit)),
            Err(e) => tracing::warn!(entry = %entry.display(), error = %format!("{e:#}"),
                "policy plugins: a cached compiled plugin is unusable; compiling again"),
        },
    }
    let code = C::compile(engine, bytes)?;
    let outcome = match code.serialize().map_err(|e| format!("{e:#}")).and_then(|a| store(&entry, &a)) {
        Ok(()) => CacheOutcome::Compiled,
        Err(e) => {
            tracing::warn!(entry = %entry.display(), error = %e, "policy plugins: cannot keep a compiled plugin");
            CacheOutcome::Uncached
        }
    };
    Ok((code, outcome))
}

/// Writes an entry atomically: a temporary file in the directory, fsynced, renamed.
fn store(entry: &Path, artifact: &[u8]) -> Result<(), String> {
    let dir = entry.parent().ok_or("no directory")?;
    let mut tmp = tempfile_in(dir)?;
    tmp.1.write_all(artifact).map_err(|e| e.to_string())?;
    tmp.1.sync_all().map_err(|e| e.to_string())?;
    std::fs::rename(&tmp.0, entry).map_err(|e| {
        let _ = std::fs::remove_file(&tmp.0);
        e.to_string()
    })
}

fn tempfile_in(dir: &Path) -> Result<(PathBuf, std::fs::File), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let name = format!(".tmp-{}-{:?}", std::process::id(), std::thread::current().id());
    let path = dir.join(name.replace(['(', ')'], ""));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((path, file))
}

/// Creates the directory (0700) when missing; true when it is owned by this process's
/// user and writable by nobody else. Warns once per directory when it is not.
fn trusted(dir: &Path) -> bool {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if !dir.exists() {
        if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
            warn_once(dir, &format!("cannot create it: {e}"));
            return false;
        }
    }
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) => {
            warn_once(dir, &format!("cannot read it: {e}"));
            return false;
        }
    };
    let euid = nix_euid();
    if !meta.is_dir() || meta.uid() != euid || meta.mode() & 0o022 != 0 {
        warn_once(dir, &format!("it must be a directory owned by uid {euid} and not writable by group or others"));
        return false;
    }
    true
}

fn nix_euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn warn_once(dir: &Path, why: &str) {
    static WARNED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    if !warned.iter().any(|d| d == dir) {
        warned.push(dir.to_path_buf());
        tracing::warn!(dir = %dir.display(), "policy plugins: not using the compiled-plugin cache: {why}; every load compiles");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_bytes_and_by_kind_and_are_stable() {
        let engine = Engine::default();
        let a = key::<Module>(&engine, b"a");
        assert_eq!(a, key::<Module>(&engine, b"a"));
        assert_ne!(a, key::<Module>(&engine, b"b"));
        assert_ne!(a, key::<Component>(&engine, b"a"));
        let mut other = wasmtime::Config::new();
        other.consume_fuel(true);
        assert_ne!(a, key::<Module>(&Engine::new(&other).unwrap(), b"a"), "the engine's configuration is in the key");
        assert_eq!(a.len(), 64);
    }
}
