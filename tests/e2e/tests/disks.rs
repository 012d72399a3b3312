//! Disks (docs/disks.md), against the real agent, real QEMU (TCG) and real `qemu-img`:
//! the demo disk (`scripts/build-image`'s `demo-disk`) imported and booted through its
//! overlay in BIOS and in UEFI mode; a file written on `/data` through the console survives
//! a stop and a start; a fork (source stopped) sees it and its own writes never reach the
//! source; delete removes the overlay with the instance directory; `image.delete` refuses
//! an image in use; bad disks and bad sizes are refused with clear errors.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// OVMF under TCG on a loaded machine takes tens of seconds: a generous bound on events.
const BOOT: Duration = Duration::from_secs(240);
const ANSWER: Duration = Duration::from_secs(60);

fn import_demo_disk(a: &Agent) -> Value {
    let dir = demo_disk_image();
    a.ok("image.import", json!({"name": "demo-disk", "disk": dir.join("disk.qcow2")}))
}

/// Boots (`create` or `start` answered `v`) and waits for the disk lines and `ready`.
fn wait_booted(v: &Value, from: usize, mode: &str) {
    wait_serial_after(v, from, &format!("gpuvisor-guest: boot {mode}"), BOOT);
    wait_serial_after(v, from, "gpuvisor-guest: disk /data", BOOT);
    wait_serial_after(v, from, "gpuvisor-guest: ready", BOOT);
}

/// Types `cmd` on the guest's console shell and waits for `expect` in the output.
fn console(v: &Value, cmd: &str, expect: &str) {
    console_run(v, cmd, expect, ANSWER);
}

fn start(a: &Agent, name: &str, mode: &str) -> Value {
    let before = a.ok("instance.get", json!({"ref": name}));
    let from = serial_len(&before);
    let v = a.ok("instance.start", json!({"ref": name}));
    wait_booted(&v, from, mode);
    v
}

fn stop(a: &Agent, name: &str) {
    let v = a.ok("instance.stop", json!({"ref": name}));
    assert_eq!(v["state"], "stopped", "{v}");
}

/// The instance's VMM directory (its overlay, UEFI variables, serial log).
fn instance_dir(a: &Agent, v: &Value) -> PathBuf {
    a.data_dir.join("instances").join(v["id"].as_str().unwrap()).join("vmm")
}

fn qemu_img_info(p: &Path) -> Value {
    let o =
        std::process::Command::new("qemu-img").args(["info", "--output=json", "-U"]).arg(p).output().expect("qemu-img");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn a_bios_guest_keeps_its_disk_across_restarts_and_a_fork_is_a_copy() {
    let a = Agent::start("l40s-2x16").unwrap();
    let img = import_demo_disk(&a);
    assert_eq!(img["disk"]["format"], "qcow2", "{img}");
    assert_eq!(img["disk"]["virtual_size_bytes"], 68_157_440, "{img}");
    assert!(img["kernel"].is_null(), "a disk-only image: {img}");

    // bios is the default for a disk-only image.
    let v = a.ok("instance.create", json!({"name": "src", "image": "demo-disk"}));
    assert_eq!(v["boot"], "bios", "{v}");
    let overlay = instance_dir(&a, &v).join("disk.qcow2");
    assert_eq!(v["disk"]["overlay"], overlay.display().to_string(), "{v}");
    let info = qemu_img_info(&overlay);
    assert_eq!(info["format"], "qcow2");
    assert_eq!(info["full-backing-filename"], a.data_dir.join("images/demo-disk/disk.qcow2").display().to_string());
    wait_booted(&v, 0, "bios");

    console(&v, "echo src-wrote >/data/f; sync; echo \"W:$(cat /data/f):W\"", "W:src-wrote:W");
    // The disk's counters, from QEMU: the firmware and the guest read it, the guest wrote.
    let st = a.ok("instance.stats", json!({"ref": "src"}));
    let d = &st["disks"][0];
    assert_eq!(d["id"], "disk0", "{st}");
    for k in ["read_bytes", "read_ops", "write_bytes", "write_ops"] {
        assert!(d[k].as_u64().is_some_and(|v| v > 0), "{k}: {st}");
    }
    stop(&a, "src");
    let v = start(&a, "src", "bios");
    console(&v, "echo \"R:$(cat /data/f):R\"", "R:src-wrote:R");

    // A running source with a disk is not forked: its disk is being written.
    let e = a.err("instance.fork", json!({"ref": "src", "name": "fk"}));
    assert_eq!(e.data_code, "invalid_state", "{e}");
    assert!(e.message.contains("stop it before forking"), "{e}");
    stop(&a, "src");

    let fk = a.ok("instance.fork", json!({"ref": "src", "name": "fk"}));
    assert_eq!(fk["boot"], "bios", "{fk}");
    assert!(instance_dir(&a, &fk).join("disk.qcow2").is_file(), "the fork has its own overlay");
    let fk = start(&a, "fk", "bios");
    console(&fk, "echo \"R:$(cat /data/f):R\"", "R:src-wrote:R");
    console(&fk, "echo fork-wrote >/data/g; sync; echo \"W:$(cat /data/g):W\"", "W:fork-wrote:W");
    stop(&a, "fk");

    let v = start(&a, "src", "bios");
    console(&v, "echo \"G:$(cat /data/g 2>/dev/null || echo absent):G\"", "G:absent:G");
    console(&v, "echo \"R:$(cat /data/f):R\"", "R:src-wrote:R");

    // The image is in use: refused, naming the instances.
    let e = a.err("image.delete", json!({"name": "demo-disk"}));
    assert_eq!(e.data_code, "image_in_use", "{e}");
    assert_eq!(e.code, 409);
    assert_eq!(e.data["instances"], json!(["fk", "src"]), "{e}");
    assert!(a.data_dir.join("images/demo-disk/disk.qcow2").is_file(), "nothing was deleted");

    for (name, inst) in [("fk", &fk), ("src", &v)] {
        a.ok("instance.delete", json!({"ref": name}));
        assert!(!instance_dir(&a, inst).exists(), "the instance directory (and its overlay) is gone: {name}");
    }
    a.ok("image.delete", json!({"name": "demo-disk"}));
    assert!(!a.data_dir.join("images/demo-disk").exists());
}

#[test]
fn a_uefi_guest_boots_its_disk_through_ovmf_and_keeps_its_writes() {
    let a = Agent::start("l40s-2x16").unwrap();
    import_demo_disk(&a);
    let v = a.ok("instance.create", json!({"name": "u", "image": "demo-disk", "boot": "uefi"}));
    assert_eq!(v["boot"], "uefi", "{v}");
    let dir = instance_dir(&a, &v);
    assert!(dir.join("efivars.fd").is_file(), "the instance has its own UEFI variable store");
    assert_eq!(
        std::fs::metadata(dir.join("efivars.fd")).unwrap().len(),
        std::fs::metadata("/usr/share/OVMF/OVMF_VARS_4M.fd").unwrap().len()
    );
    wait_booted(&v, 0, "uefi");
    console(&v, "echo uefi-wrote >/data/u; sync; echo \"W:$(cat /data/u):W\"", "W:uefi-wrote:W");
    stop(&a, "u");
    let v = start(&a, "u", "uefi");
    console(&v, "echo \"R:$(cat /data/u):R\"", "R:uefi-wrote:R");
    a.ok("instance.delete", json!({"ref": "u"}));
    assert!(!dir.exists(), "delete removes the overlay and the variable store with the instance directory");
}

#[test]
fn bad_disks_boot_modes_and_sizes_are_refused_and_disk_gib_grows_the_overlay() {
    let a =
        Agent::start_with(AgentOptions { extra: "ovmf_code = \"/nonexistent/OVMF_CODE_4M.fd\"", ..Default::default() })
            .unwrap();
    let t = tempfile::tempdir().unwrap();

    // Not a disk: qemu-img calls it raw, but it has no partition table signature.
    let junk = t.path().join("junk.img");
    std::fs::write(&junk, "this is not a disk\n".repeat(512)).unwrap();
    let e = a.err("image.import", json!({"name": "junk", "disk": junk}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert!(e.message.contains("neither a qcow2 image nor a partitioned raw disk"), "{e}");

    // A qcow2 whose backing file is missing.
    let base = t.path().join("base.qcow2");
    let top = t.path().join("top.qcow2");
    for args in [
        vec!["create", "-q", "-f", "qcow2", base.to_str().unwrap(), "16M"],
        vec!["create", "-q", "-f", "qcow2", "-b", base.to_str().unwrap(), "-F", "qcow2", top.to_str().unwrap()],
    ] {
        assert!(std::process::Command::new("qemu-img").args(&args).status().unwrap().success());
    }
    std::fs::remove_file(&base).unwrap();
    let e = a.err("image.import", json!({"name": "orphan", "disk": top}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert!(e.message.contains("backing file") && e.message.contains("is missing"), "{e}");
    let e = a.err("image.import", json!({"name": "rel", "disk": "disk.qcow2"}));
    assert!(e.data_code == "invalid_request" && e.message.contains("must be absolute"), "{e}");
    let e = a.err("image.import", json!({"name": "nothing"}));
    assert!(e.data_code == "invalid_request" && e.message.contains("a kernel, a disk"), "{e}");
    let names: Vec<String> = a.ok("image.list", json!({}))["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["demo"], "no refused import left an image behind");

    // A 2 GiB raw disk (sparse; an MBR signature, no boot loader).
    let big = t.path().join("big.raw");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(2 << 30).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0x55, 0xAA], 510).unwrap();
    // Through the CLI (`gpuvisor image import NAME --disk D`), which builds the same request.
    let o = a.cli(&["image", "import", "big", "--disk", big.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let img = a.ok("image.list", json!({}))["images"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "big")
        .cloned()
        .expect("big imported");
    assert_eq!(img["disk"]["format"], "raw", "{img}");
    assert_eq!(img["disk"]["virtual_size_bytes"], 2u64 << 30, "{img}");

    let e = a.err("instance.create", json!({"name": "small", "image": "big", "disk_gib": 1}));
    assert!(e.data_code == "invalid_request" && e.message.contains("disk_gib 1 is smaller"), "{e}");
    let e = a.err("instance.create", json!({"name": "d", "image": "big", "boot": "direct"}));
    assert!(e.data_code == "invalid_request" && e.message.contains("needs a kernel"), "{e}");
    let e = a.err("instance.create", json!({"name": "b", "image": "demo", "boot": "bios"}));
    assert!(e.data_code == "invalid_request" && e.message.contains("has none"), "{e}");
    let e = a.err("instance.create", json!({"name": "g", "image": "demo", "disk_gib": 4}));
    assert!(e.data_code == "invalid_request" && e.message.contains("has no disk"), "{e}");
    let e = a.err("instance.create", json!({"name": "u", "image": "big", "boot": "uefi"}));
    assert!(e.data_code == "invalid_request" && e.message.contains("/nonexistent/OVMF_CODE_4M.fd"), "{e}");
    assert!(e.message.contains("ovmf_code"), "the error names the config key: {e}");
    assert!(a.instance_names().is_empty(), "refused creates leave no instance: {:?}", a.instance_names());

    // Larger grows the overlay (the firmware finds nothing to boot; the VM just runs).
    let o = a.cli(&["create", "grown", "--image", "big", "--disk-gib", "3", "--boot", "bios"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = a.ok("instance.get", json!({"ref": "grown"}));
    assert_eq!(v["boot"], "bios", "{v}");
    assert_eq!(v["disk"]["disk_gib"], 3, "{v}");
    let overlay = instance_dir(&a, &v).join("disk.qcow2");
    assert_eq!(qemu_img_info(&overlay)["virtual-size"], 3u64 << 30);
    a.ok("instance.delete", json!({"ref": "grown"}));
    assert!(!overlay.exists());
    a.ok("image.delete", json!({"name": "big"}));
}

#[test]
fn a_crash_after_the_disk_step_leaves_nothing_that_delete_does_not_remove() {
    let mut a = Agent::start("l40s-2x16").unwrap();
    let big = tempfile::tempdir().unwrap();
    // A tiny partitioned raw disk: nothing to boot, so nothing runs long.
    let raw = big.path().join("tiny.raw");
    let f = std::fs::File::create(&raw).unwrap();
    f.set_len(1 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0x55, 0xAA], 510).unwrap();
    a.ok("image.import", json!({"name": "tiny", "disk": raw}));
    a.restart_with_failpoints(Some("boot_after_disk=return")).unwrap();
    a.wait_ready().unwrap();
    let e = a.call("instance.create", json!({"name": "c", "image": "tiny"})).unwrap_err();
    assert!(is_transport(&e), "the agent aborted at boot_after_disk: {e}");
    assert!(a.wait_agent_gone(Duration::from_secs(30)));
    a.restart_clean();

    // The record is there (the reconciler recorded it stopped), and so is the overlay.
    let v = a.ok("instance.get", json!({"ref": "c"}));
    assert_eq!(v["state"], "stopped", "{v}");
    let dir = instance_dir(&a, &v);
    assert!(dir.join("disk.qcow2").is_file(), "the overlay of the interrupted create");
    assert!(!dir.join("disk.qcow2.tmp").exists());
    let e = a.err("image.delete", json!({"name": "tiny"}));
    assert_eq!(e.data_code, "image_in_use", "{e}");
    a.ok("instance.delete", json!({"ref": "c"}));
    assert!(!dir.exists(), "delete removes the instance directory and the overlay");
    a.ok("image.delete", json!({"name": "tiny"}));
}
