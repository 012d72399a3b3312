//! The cloud-init NoCloud seed (docs/api.md "cloud-init"), against the real agent, QEMU and
//! genisoimage: the demo guest reads its hostname (the instance name) and a user-data
//! marker from the `cidata` volume and prints them; a restart with nothing changed keeps
//! the seed file; a seed whose recorded inputs differ is built again at start; an
//! oversized user-data is refused with nothing left behind; an instance with neither NICs
//! nor `cloud_init` gets no seed.

use gpuvisor_e2e::*;
use serde_json::json;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

const BOOT: Duration = Duration::from_secs(120);

fn inode(p: &PathBuf) -> u64 {
    std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())).ino()
}

#[test]
fn the_guest_reads_its_hostname_and_marker_from_the_seed_and_a_restart_keeps_it() {
    let a = Agent::start(HOST_V).unwrap();
    let marker = format!("m-{}", std::process::id());
    let user_data = format!("#cloud-config\ngpuvisor-marker: {marker}\n");
    let v = a.ok("instance.create", json!({"name": "ci-one", "image": "demo", "cloud_init": {"user_data": user_data}}));
    let seed = PathBuf::from(v["seed"]["path"].as_str().unwrap_or_else(|| panic!("no seed in {v}")));
    assert_eq!(v["seed"]["user_data_bytes"], user_data.len());
    let log = a.wait_serial(&v, "gpuvisor-guest: ready", BOOT).unwrap();
    assert!(log.contains("gpuvisor-guest: hostname ci-one"), "{log}");
    assert!(log.contains(&format!("gpuvisor-guest: marker {marker}")), "{log}");
    assert!(!log.contains("gpuvisor-guest: net "), "no NIC, no lease: {log}");
    let first = inode(&seed);

    // Nothing changed: the same seed file on the next boot.
    a.ok("instance.stop", json!({"ref": "ci-one"}));
    let v = a.ok("instance.start", json!({"ref": "ci-one"}));
    wait_for(BOOT, || {
        let log = std::fs::read_to_string(v["serial_log"].as_str().unwrap()).unwrap_or_default();
        (log.matches("gpuvisor-guest: ready").count() == 2).then_some(())
    })
    .expect("the second boot is ready");
    assert_eq!(inode(&seed), first, "the seed was kept");

    // Inputs that differ from the recorded ones (as after a changed setting): rebuilt.
    // The hash of the seed's inputs lives in the instance directory (the VMM never sees it).
    let inputs = seed.parent().and_then(|v| v.parent()).unwrap().join("seed.inputs");
    std::fs::write(&inputs, "0000000000000000\n").unwrap();
    a.ok("instance.stop", json!({"ref": "ci-one"}));
    let v = a.ok("instance.start", json!({"ref": "ci-one"}));
    let log = wait_for(BOOT, || {
        let log = std::fs::read_to_string(v["serial_log"].as_str().unwrap()).unwrap_or_default();
        (log.matches("gpuvisor-guest: ready").count() == 3).then_some(log)
    })
    .expect("the third boot is ready");
    assert_ne!(inode(&seed), first, "the seed was built again");
    assert_ne!(std::fs::read_to_string(&inputs).unwrap().trim(), "0000000000000000");
    assert_eq!(log.matches(&format!("gpuvisor-guest: marker {marker}")).count(), 3, "{log}");

    a.ok("instance.delete", json!({"ref": "ci-one"}));
    assert!(!seed.exists(), "delete removes the seed with the instance directory");
}

#[test]
fn an_oversized_user_data_is_refused_and_a_plain_instance_gets_no_seed() {
    let a = Agent::start(HOST_V).unwrap();
    let big = "x".repeat(64 * 1024 + 1);
    let e = a.err("instance.create", json!({"name": "ci-big", "image": "demo", "cloud_init": {"user_data": big}}));
    assert_eq!(e.data_code, "invalid_request", "{e:?}");
    assert!(e.message.contains("cloud_init.user_data") && e.message.contains("65536"), "{e:?}");
    let e =
        a.err("instance.create", json!({"name": "ci-big", "image": "demo", "cloud_init": {"user_data": "a\u{0}b"}}));
    assert!(e.message.contains("NUL"), "{e:?}");
    let e = a.call("instance.create", json!({"name": "ci-big", "image": "demo", "cloud_init": {"vendor_data": "x"}}));
    assert_eq!(e.unwrap_err().code, -32602, "unknown cloud_init fields are refused");
    assert!(a.instance_names().is_empty());
    assert!(a.data_files("instances").is_empty(), "{:?}", a.data_files("instances"));

    let v = a.ok("instance.create", json!({"name": "plain", "image": "demo"}));
    assert!(v.get("seed").is_none() && v.get("nics").is_none(), "{v}");
    a.wait_serial(&v, "gpuvisor-guest: ready", BOOT).unwrap();
    let dir = a.data_dir.join("instances").join(v["id"].as_str().unwrap()).join("vmm");
    assert!(!dir.join("seed.iso").exists());
    a.ok("instance.delete", json!({"ref": "plain"}));
}
