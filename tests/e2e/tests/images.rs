//! Issue 18 findings 9, 10 and 11 for images, against the real agent: a full images
//! directory is said as such (never a 400 about reading the source); an image whose
//! metadata is broken is listed as unreadable, never hidden; an import killed midway leaves
//! no hidden staging copy once the agent has started again.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

fn import_demo_as(a: &Agent, name: &str) -> Result<Value, RpcError> {
    let image = demo_image();
    a.call("image.import", json!({"name": name, "kernel": image.join("vmlinuz"), "initrd": image.join("initrd.img")}))
}

/// Issue 18 finding 9: ENOSPC while an import writes into the images directory answers
/// that the destination is full (`internal`, naming the images directory) — not a 400
/// about reading the source — and leaves nothing behind.
#[test]
fn an_import_into_a_full_images_directory_says_the_destination_is_full() {
    let disk = Tmpfs::mount("24m");
    let data = disk.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let a = Agent::start_tuned(AgentOptions { model: HOST_V, ..Default::default() }, Some(data), &[]).unwrap();
    disk.fill();
    let e = import_demo_as(&a, "big").unwrap_err();
    assert_ne!(e.code, 400, "BUG: blamed on the source: {e}");
    assert_eq!((e.code, e.data_code.as_str()), (500, "internal"), "{e}");
    assert!(e.message.contains("is full") && e.message.contains("ENOSPC"), "{e}");
    assert!(e.message.contains(&a.data_dir.join("images").display().to_string()), "names the directory: {e}");
    let list = a.ok("image.list", json!({}));
    assert!(!list.to_string().contains("\"big\""), "{list}");
    let left: Vec<String> = std::fs::read_dir(a.data_dir.join("images"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "demo")
        .collect();
    assert!(left.is_empty(), "nothing left in images/: {left:?}");
}

/// Issue 18 finding 11: `image.list` (and `image ls`) lists an image whose `image.toml` is
/// broken as unreadable, with the reason, instead of hiding it.
#[test]
fn an_image_with_broken_metadata_is_listed_as_unreadable() {
    let a = Agent::start(HOST_V).unwrap();
    import_demo_as(&a, "broken").unwrap();
    std::fs::write(a.data_dir.join("images/broken/image.toml"), "name = \"broken\"\nkernel = [1, 2\n").unwrap();
    let list = a.ok("image.list", json!({}));
    let names: Vec<&str> = list["images"].as_array().unwrap().iter().filter_map(|i| i["name"].as_str()).collect();
    assert_eq!(names, vec!["demo"], "{list}");
    let bad = list["unreadable"].as_array().cloned().unwrap_or_default();
    assert_eq!(bad.len(), 1, "BUG: the broken image is hidden: {list}");
    assert_eq!(bad[0]["name"], "broken");
    assert!(bad[0]["error"].as_str().unwrap().contains("image.toml"), "{list}");
    let o = a.cli(&["image", "ls"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("unreadable image broken"), "{out}");
}

/// Issue 18 finding 10: an import killed after it copied the kernel into its hidden staging
/// directory leaves that copy; the restarted agent removes it before anything runs, says so
/// in a WARN, and the same import then succeeds.
#[test]
fn an_import_killed_midway_leaves_no_staging_copy_after_a_restart() {
    assert_failpoints_built();
    let mut a = Agent::start(HOST_V).unwrap();
    // A staging copy as an older kill left it (from before the start-up sweep).
    let planted = a.data_dir.join("images/.old.0123456789abcdef0123456789abcdef");
    std::fs::create_dir_all(&planted).unwrap();
    std::fs::write(planted.join("vmlinuz"), vec![0u8; 4096]).unwrap();
    a.restart_with_failpoints(Some("import_after_stage=return")).unwrap();
    a.wait_ready().unwrap();
    assert!(!planted.exists(), "BUG: the staging copy of an interrupted import survives a restart");
    let e = import_demo_as(&a, "k").unwrap_err();
    assert!(is_transport(&e), "the agent died in the import: {e}");
    assert!(a.wait_agent_gone(Duration::from_secs(30)));
    let stages: Vec<String> = std::fs::read_dir(a.data_dir.join("images"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".k."))
        .collect();
    assert_eq!(stages.len(), 1, "the kill left a staging copy: {stages:?}");
    a.restart_clean();
    assert!(!a.data_dir.join("images").join(&stages[0]).exists(), "removed at start");
    let log = a.log();
    assert!(
        log.lines().any(|l| l.contains(" WARN ") && l.contains("interrupted operation") && l.contains(&stages[0])),
        "says so: {}",
        tail(&log, 20)
    );
    import_demo_as(&a, "k").unwrap();
}

/// Issue 18 finding 10: a create killed right after it made the instance directory (before
/// its first record) leaves an empty directory and a name entry that nothing lists; the
/// restarted agent removes both (one WARN each) and the name can be used again.
#[test]
fn a_create_killed_before_its_first_record_leaves_nothing_after_a_restart() {
    assert_failpoints_built();
    let mut a = Agent::start(HOST_V).unwrap();
    // The same leftovers as an older kill left them.
    let ghost = uuid_like();
    std::fs::create_dir_all(a.data_dir.join("instances").join(&ghost)).unwrap();
    std::fs::write(a.data_dir.join("names/ghost"), json!({"id": ghost}).to_string()).unwrap();
    a.restart_with_failpoints(Some("instance_dir_created=return")).unwrap();
    a.wait_ready().unwrap();
    assert!(!a.data_dir.join("instances").join(&ghost).exists(), "BUG: the empty instance directory survives");
    assert!(!a.data_dir.join("names/ghost").exists(), "BUG: the stale name entry survives");
    let e = a.call("instance.create", json!({"name": "k", "image": "demo"})).unwrap_err();
    assert!(is_transport(&e), "the agent died in the create: {e}");
    assert!(a.wait_agent_gone(Duration::from_secs(30)));
    let dirs = a.data_files("instances");
    assert_eq!(dirs.len(), 1, "the kill left an instance directory: {dirs:?}");
    assert!(a.data_dir.join("names/k").exists(), "and a name entry");
    assert!(a.instance_records().is_empty(), "and no record");
    a.restart_clean();
    assert!(a.data_files("instances").is_empty(), "removed at start");
    assert!(!a.data_dir.join("names/k").exists(), "removed at start");
    let log = a.log();
    for what in [dirs[0].as_str(), "\"k\""] {
        assert!(
            log.lines().any(|l| l.contains(" WARN ") && l.contains("interrupted operation") && l.contains(what)),
            "says so for {what}: {}",
            tail(&log, 20)
        );
    }
    a.ok("instance.create", json!({"name": "k", "image": "demo"}));
}

/// A fresh random lower-case UUID.
fn uuid_like() -> String {
    let b: Vec<u8> = std::fs::read("/proc/sys/kernel/random/uuid").unwrap();
    String::from_utf8(b).unwrap().trim().to_string()
}
