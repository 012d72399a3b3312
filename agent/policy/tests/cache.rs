//! The compiled-plugin cache (`gpuvisor_policy::set_cache_dir`): a second load of the same
//! file is a hit, a changed file or a damaged entry compiles again, an untrusted directory
//! is not used; a component refused for its imports is never compiled. One test (the cache
//! directory is process-wide).

mod common;

use common::{hostile_v2, wat};
use gpuvisor_policy::{set_cache_dir, CacheOutcome, Limits, Plugin};
use gpuvisor_sdk::PolicyKind;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

fn load(path: &Path) -> Plugin {
    Plugin::load(path, PolicyKind::Placement, Limits::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "cwasm")).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn compiled_plugins_are_kept_found_and_recompiled_when_damaged_or_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugin-cache");
    set_cache_dir(Some(dir.clone()));
    let module = wat("rank-fixed.wat");
    let component = hostile_v2("");

    // First loads compile and keep; the directory is created 0700.
    assert_eq!(load(&module).cache_outcome(), CacheOutcome::Compiled);
    assert_eq!(load(&component).cache_outcome(), CacheOutcome::Compiled);
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    assert_eq!(entries(&dir).len(), 2, "one entry per file");

    // Second loads are hits, and the plugins still answer.
    let m = load(&module);
    let c = load(&component);
    assert_eq!((m.cache_outcome(), c.cache_outcome()), (CacheOutcome::Hit, CacheOutcome::Hit));
    let input: gpuvisor_sdk::PlacementInput =
        gpuvisor_sdk::testing::load_input(common::fixture("placement-second-2q.json")).unwrap();
    m.call_placement(&input).unwrap();
    c.call_placement(&input).unwrap();

    // Other code is another key: compiled, a third entry. (The key is over the module's
    // binary: a `.wat` file changed only in a comment is the same module, a hit.)
    let copy = tmp.path().join("rank-fixed-commented.wat");
    std::fs::write(&copy, format!("{}\n;; a comment\n", std::fs::read_to_string(&module).unwrap())).unwrap();
    assert_eq!(load(&copy).cache_outcome(), CacheOutcome::Hit);
    let changed = tmp.path().join("rank-fixed-changed.wat");
    let text = std::fs::read_to_string(&module).unwrap();
    let edited = text.replacen("rank-fixed", "rank-fixes", 1); // same length: the manifest's (ptr, len) holds
    assert_ne!(edited, text, "the module names itself");
    std::fs::write(&changed, edited).unwrap();
    assert_eq!(load(&changed).cache_outcome(), CacheOutcome::Compiled);
    assert_eq!(entries(&dir).len(), 3);

    // A damaged entry is a miss: compiled again, rewritten, then a hit.
    for e in entries(&dir) {
        std::fs::write(&e, b"not a compiled plugin").unwrap();
    }
    assert_eq!(load(&component).cache_outcome(), CacheOutcome::Compiled);
    assert_eq!(load(&component).cache_outcome(), CacheOutcome::Hit);
    c.call_placement(&input).unwrap();

    // A directory others may write is not trusted: every load compiles, nothing is read.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_eq!(load(&module).cache_outcome(), CacheOutcome::Uncached);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();

    // A component with an import the host does not grant is refused from its binary, before
    // it is compiled (issue 19: a toolchain's guest took ~28 s to compile, then was refused):
    // nothing compiled, nothing kept. Its core module has 20,000 functions.
    let before = entries(&dir).len();
    let funcs: String = (0..20_000).map(|i| format!("(func (export \"f{i}\") (result i32) i32.const {i})\n")).collect();
    let big = tmp.path().join("big-forbidden.wat");
    std::fs::write(
        &big,
        format!("(component (import \"evil:net/socket\" (instance)) (core module $m {funcs}) (core instance (instantiate $m)))"),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let e = Plugin::load(&big, PolicyKind::Placement, Limits::default()).expect_err("a forbidden import");
    println!(
        "{} bytes of component text refused in {:?}: {e}",
        std::fs::metadata(&big).unwrap().len(),
        started.elapsed()
    );
    assert!(e.to_string().contains("forbidden import evil:net/socket"), "{e}");
    assert_eq!(entries(&dir).len(), before, "the refused component was compiled and kept");

    // No cache directory: uncached.
    set_cache_dir(None);
    assert_eq!(load(&module).cache_outcome(), CacheOutcome::Uncached);
}
