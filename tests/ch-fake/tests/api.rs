//! The fake Cloud Hypervisor against its brief: the command line, the API and its state
//! machine, strict body checking, the guest's serial output and power-off, the control
//! knobs, the request log, the signals and the listening socket.

mod common;

use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use common::{minimal_config, wait_for, write_atomic, Start, Vmm, FAKE};
use nix::sys::signal::Signal;
use serde_json::{json, Value};

fn assert_errors(resp: &common::Resp, status: u16, errors: &[&str]) {
    assert_eq!(resp.status, status, "{resp:?}");
    assert_eq!(resp.header("content-type"), Some("application/json"), "{resp:?}");
    assert_eq!(resp.errors(), errors, "{resp:?}");
}

fn api(what: &str, causes: &[&str]) -> Vec<String> {
    let mut v = vec!["Error from API".to_string(), what.to_string()];
    v.extend(causes.iter().map(|s| s.to_string()));
    v
}

fn assert_api(resp: &common::Resp, status: u16, what: &str, causes: &[&str]) {
    let expected = api(what, causes);
    let expected: Vec<&str> = expected.iter().map(String::as_str).collect();
    assert_errors(resp, status, &expected);
}

fn assert_204(resp: &common::Resp) {
    assert_eq!(resp.status, 204, "{resp:?}");
    assert!(resp.body.is_empty(), "{resp:?}");
}

fn fake_with_control(control: Value) -> Vmm {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("control.json");
    write_atomic(&path, &control.to_string());
    Start::fake().in_dir(dir).env("CH_FAKE_CONTROL", path).spawn()
}

fn socket_exists(vmm: &Vmm) -> bool {
    std::fs::symlink_metadata(&vmm.socket).is_ok()
}

#[test]
fn version_and_command_line_errors() {
    let out = Command::new(FAKE).arg("--version").output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "cloud-hypervisor v53.0-fake");

    for args in [&["--bogus"][..], &[], &["--api-socket"], &["--api-socket", "fd=3"], &["--kernel", "/x"]] {
        let out = Command::new(FAKE).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("error"), "{args:?}: {out:?}");
    }
}

#[test]
fn ping_on_a_bare_path_and_the_listener_is_owned_by_the_process() {
    let vmm = Start::fake().args(&["--api-socket", "{socket}", "-v", "-vv", "--seccomp", "false"]).spawn();
    let ping = vmm.get("vmm.ping");
    assert_eq!(ping.status, 200, "{ping:?}");
    assert_eq!(ping.header("content-type"), Some("application/json"));
    assert_eq!(
        ping.json(),
        json!({"build_version": "v53.0-fake", "version": "53.0.0", "pid": vmm.pid(), "features": ["kvm"]})
    );

    // /proc/net/unix: "Num RefCount Protocol Flags Type St Inode Path"; flags 00010000 = listening.
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    let socket = vmm.socket.to_string_lossy().into_owned();
    let inode = table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() >= 8 && f[7] == socket && f[3] == "00010000")
        .map(|f| f[6].to_string())
        .unwrap_or_else(|| panic!("no listening socket {socket} in /proc/net/unix"));
    let wanted = format!("socket:[{inode}]");
    let owned = std::fs::read_dir(format!("/proc/{}/fd", vmm.pid()))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .any(|target| target.to_string_lossy() == wanted);
    assert!(owned, "the fake holds no fd for {wanted}");
}

#[test]
fn lifecycle_create_boot_info_power_button_then_exit() {
    let mut vmm = Start::fake().spawn();
    let (kernel, initrd, serial) = (vmm.path("vmlinuz"), vmm.path("initrd.img"), vmm.path("serial.log"));
    std::fs::write(&kernel, b"kernel").unwrap();
    std::fs::write(&initrd, b"initrd").unwrap();
    let disk = vmm.path("x.img");
    std::fs::write(&disk, [0u8; 4096]).unwrap();
    let config = json!({
        "payload": {"kernel": kernel, "initramfs": initrd, "cmdline": "console=ttyS0 quiet"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
        "memory": {"size": 1073741824u64},
        "serial": {"mode": "File", "file": serial},
        "console": {"mode": "Off"},
        "devices": [{"path": "/sys/bus/pci/devices/0000:41:00.0/", "id": "gpu0"}],
        "disks": [{"path": disk, "readonly": true, "direct": false, "id": "disk0"}],
        "net": [{"tap": "tap0", "mac": "52:54:00:12:34:56", "host_mac": "52:54:00:12:34:57", "mtu": 1500,
                 "id": "net0", "ip": "192.168.249.1", "mask": "255.255.255.0"}],
        "platform": {"system_uuid": "6b2c7f0e-1111-4222-8333-444455556666"},
    });
    assert_204(&vmm.put("vm.create", Some(&config.to_string())));
    let info = vmm.get("vm.info");
    assert_eq!(info.status, 200, "{info:?}");
    assert_eq!(
        info.json(),
        json!({"config": config, "state": "Created", "memory_actual_size": 1073741824u64, "device_tree": {}})
    );
    assert!(!serial.exists(), "the serial file is written at boot, not at create");

    assert_204(&vmm.put("vm.boot", None));
    assert_eq!(vmm.get("vm.info").json()["state"], "Running");
    let booted = std::fs::read_to_string(&serial).unwrap();
    assert_eq!(booted, format!("fake cloud-hypervisor: booting {}\ngpuvisor-guest: ready\n", kernel.display()));

    assert_204(&vmm.put("vm.power-button", None));
    let status = vmm.wait_exit();
    assert_eq!(status.code(), Some(0), "{status}");
    assert_eq!(
        std::fs::read_to_string(&serial).unwrap(),
        format!("{booted}fake cloud-hypervisor: ACPI power button: guest powered off\n")
    );
    assert!(!socket_exists(&vmm), "the socket file is removed at exit");
}

#[test]
fn create_rejects_bad_bodies_with_an_error_array() {
    let vmm = Start::fake().spawn();
    let cases: &[(&str, &str)] = &[
        ("{\"payload\":{\"kernel\":\"/k\"},\"bogus\":1}", "unknown field `bogus`"),
        ("{\"payload\":{\"kernel\":\"/k\",\"initrd\":\"/i\"}}", "unknown field `initrd`"),
        ("{\"devices\":[{\"path\":\"/d\",\"iommu\":true}]}", "unknown field `iommu`"),
        ("{\"memory\":{\"size\":1,\"shared\":true}}", "unknown field `shared`"),
        ("{\"cpus\":{\"boot_vcpus\":1}}", "missing field `max_vcpus` at line 1 column 24"),
        ("{\"memory\":{\"size\":\"x\"}}", "invalid type: string \"x\", expected u64 at line 1 column 21"),
        ("{\"devices\":[{\"id\":\"x\"}]}", "missing field `path`"),
        ("{\"serial\":{\"mode\":\"Bogus\"}}", "unknown variant `Bogus`, expected one of `Off`, `Pty`, `Tty`, `File`"),
        ("{\"net\":[{\"mtu\":70000}]}", "invalid value: integer `70000`, expected u16"),
        ("notjson", "expected ident at line 1 column 2"),
        ("null", "invalid type: null, expected struct VmConfig at line 1 column 4"),
        ("{} x", "trailing characters at line 1 column 4"),
    ];
    for (body, message) in cases {
        let resp = vmm.put("vm.create", Some(body));
        assert_eq!(resp.status, 400, "{body}: {resp:?}");
        let errors = resp.errors();
        assert_eq!(errors.len(), 2, "{body}: {errors:?}");
        assert_eq!(errors[0], "Failed to deserialize JSON", "{body}");
        assert!(errors[1].starts_with(message), "{body}: {errors:?}");
    }
    // No body at all: an empty 400, as the real binary answers.
    let resp = vmm.put("vm.create", None);
    assert_eq!((resp.status, resp.body.len()), (400, 0), "{resp:?}");
    // Nothing was created by any of those.
    assert_eq!(vmm.get("vm.info").status, 404);
}

#[test]
fn state_machine_answers() {
    let vmm = Start::fake().spawn();
    let config = minimal_config(vmm.dir.path());
    assert_api(&vmm.get("vm.info"), 404, "The VM info is not available", &["VM is not created"]);
    assert_api(&vmm.put("vm.boot", None), 404, "The VM could not boot", &["VM config is missing"]);
    assert_api(&vmm.put("vm.power-button", None), 500, "Error triggering power button", &["VM is not running"]);
    assert_api(&vmm.put("vm.shutdown", None), 500, "The VM could not shutdown", &["VM is not running"]);
    assert_api(&vmm.put("vm.pause", None), 500, "The VM could not be paused", &["VM is not running"]);
    assert_api(&vmm.put("vm.resume", None), 500, "The VM could not resume", &["VM is not running"]);
    assert_204(&vmm.put("vm.delete", None));

    assert_204(&vmm.put("vm.create", Some(&config)));
    assert_api(&vmm.put("vm.create", Some(&config)), 500, "The VM could not be created", &["VM is already created"]);
    assert_api(&vmm.put("vm.power-button", None), 500, "Error triggering power button", &["VM is not running"]);
    assert_api(&vmm.put("vm.shutdown", None), 500, "The VM could not shutdown", &["VM is not running"]);
    assert_204(&vmm.put("vm.boot", None));
    assert_api(&vmm.put("vm.boot", None), 500, "The VM could not boot", &["VM is already created"]);
    assert_api(&vmm.put("vm.create", Some(&config)), 500, "The VM could not be created", &["VM is already created"]);

    assert_204(&vmm.put("vm.pause", None));
    assert_eq!(vmm.get("vm.info").json()["state"], "Paused");
    let again = &["Cannot pause VM", "Failed to pause migratable component"];
    let resp = vmm.put("vm.pause", None);
    assert_eq!(resp.errors()[..4], api("The VM could not be paused", again)[..], "{resp:?}");
    assert_204(&vmm.put("vm.resume", None));
    let resp = vmm.put("vm.resume", None);
    assert_eq!(resp.status, 500);
    assert_eq!(resp.errors()[3], "Failed to resume migratable component", "{resp:?}");

    // vm.shutdown goes back to Created (as the real binary), and the VM boots again.
    assert_204(&vmm.put("vm.shutdown", None));
    assert_eq!(vmm.get("vm.info").json()["state"], "Created");
    assert_204(&vmm.put("vm.boot", None));
    assert_eq!(vmm.get("vm.info").json()["state"], "Running");

    // Body where none is allowed, wrong method, unknown path.
    for endpoint in ["vm.delete", "vm.boot", "vm.shutdown", "vm.power-button"] {
        assert_errors(&vmm.put(endpoint, Some("{}")), 400, &["Bad Request"]);
    }
    assert_errors(&vmm.get("vm.boot"), 400, &["Bad Request"]);
    assert_errors(&vmm.put("vmm.ping", None), 400, &["Bad Request"]);
    assert_errors(&vmm.req("POST", "vm.create", Some(&config)), 400, &["Bad Request"]);
    assert_errors(&vmm.req("DELETE", "vm.delete", None), 400, &["Bad Request"]);
    assert_errors(&vmm.get("vm.nothing"), 404, &["Not Found"]);
    assert_errors(&vmm.get("/api/v2/vmm.ping"), 404, &["Not Found"]);
    assert_errors(&vmm.get("vmm.ping?x=1"), 404, &["Not Found"]);
    assert_eq!(vmm.get("vm.info").json()["state"], "Running", "the refused requests changed nothing");

    assert_204(&vmm.put("vm.delete", None));
    assert_api(&vmm.get("vm.info"), 404, "The VM info is not available", &["VM is not created"]);
    assert_204(&vmm.put("vm.delete", None));
}

#[test]
fn boot_validates_the_config_like_the_real_binary() {
    let vmm = Start::fake().spawn();
    let kernel = vmm.path("vmlinuz");
    std::fs::write(&kernel, b"k").unwrap();
    let k = kernel.to_string_lossy().into_owned();
    let enoent = "No such file or directory (os error 2)";
    let cases: Vec<(Value, Vec<&str>)> = vec![
        (
            json!({}),
            vec![
                "Failed to validate config",
                "Payload configuration is not bootable",
                "No bootitem provided: neither firmware nor kernel",
            ],
        ),
        (
            json!({"payload": {"kernel": k}, "cpus": {"boot_vcpus": 2, "max_vcpus": 1}}),
            vec!["Failed to validate config", "Max CPUs (1) lower than boot CPUs (2)"],
        ),
        (
            // Memory is checked before the CPUs (observed order).
            json!({"payload": {"kernel": k}, "memory": {"size": 1000}, "cpus": {"boot_vcpus": 2, "max_vcpus": 1}}),
            vec!["Memory manager error", "Memory size is misaligned with default page size or its hugepage size"],
        ),
        (
            json!({"payload": {"kernel": k}, "memory": {"size": 0}}),
            vec!["Memory manager error", "No memory zones found"],
        ),
        (json!({"payload": {"kernel": "/nonexistent/vmlinuz"}}), vec!["Cannot open kernel file", enoent]),
        (
            json!({"payload": {"kernel": "/nonexistent/vmlinuz", "initramfs": "/nonexistent/initrd"}}),
            vec!["Cannot open initramfs file", enoent],
        ),
        (json!({"payload": {"firmware": "/nonexistent/fw"}}), vec!["Error manipulating firmware file", enoent]),
        (
            json!({"payload": {"kernel": k}, "platform": {"system_uuid": "xyz"}}),
            vec![
                "Cannot configure system",
                "Platform specific error (x86_64)",
                "Error setting up SMBIOS table",
                "Failure to parse uuid: xyz",
                "invalid character: found `x` at 0",
            ],
        ),
    ];
    for (config, causes) in cases {
        assert_204(&vmm.put("vm.create", Some(&config.to_string())));
        assert_api(&vmm.put("vm.boot", None), 500, "The VM could not boot", &causes);
        assert_eq!(vmm.get("vm.info").json()["state"], "Created", "{config}");
        assert_204(&vmm.put("vm.delete", None));
    }
    // Serial mode File without a file: a clear 500 (the real VMM thread crashes).
    assert_204(&vmm.put("vm.create", Some(&json!({"payload": {"kernel": k}, "serial": {"mode": "File"}}).to_string())));
    let resp = vmm.put("vm.boot", None);
    assert_eq!(resp.status, 500, "{resp:?}");
    assert_eq!(resp.errors()[..3], api("The VM could not boot", &["Failed to validate config"])[..]);
    assert!(resp.errors()[3].contains("serial"), "{resp:?}");
    assert_eq!(vmm.get("vmm.ping").status, 200, "the fake survives it");
}

#[test]
fn devices_are_added_before_boot_and_hot_plugged_after() {
    let vmm = Start::fake().spawn();
    let what_add = "The device could not be added to the VM";
    let what_remove = "The device could not be removed from the VM";
    let gpu = r#"{"path":"/sys/bus/pci/devices/0000:41:00.0/","id":"gpu0"}"#;
    assert_api(&vmm.put("vm.add-device", Some(gpu)), 404, what_add, &["VM is not created"]);
    assert_api(&vmm.put("vm.remove-device", Some(r#"{"id":"gpu0"}"#)), 404, what_remove, &["VM is not created"]);
    assert_errors(&vmm.put("vm.add-device", None), 400, &["Bad Request"]);
    let resp = vmm.put("vm.add-device", Some(r#"{"path":"/x","iommu":true}"#));
    assert_eq!((resp.status, resp.errors()[0].as_str()), (400, "Failed to deserialize JSON"), "{resp:?}");
    let resp = vmm.put("vm.remove-device", Some("{}"));
    assert_errors(&resp, 400, &["Failed to deserialize JSON", "missing field `id` at line 1 column 2"]);

    assert_204(&vmm.put("vm.create", Some(&minimal_config(vmm.dir.path()))));
    assert_204(&vmm.put("vm.add-device", Some(gpu)));
    assert_eq!(
        vmm.get("vm.info").json()["config"]["devices"],
        json!([{"path": "/sys/bus/pci/devices/0000:41:00.0/", "id": "gpu0"}])
    );
    let dup_path = r#"{"path":"/sys/bus/pci/devices/0000:41:00.0/","id":"gpu1"}"#;
    let cause = "Duplicated device path: /sys/bus/pci/devices/0000:41:00.0/";
    assert_api(&vmm.put("vm.add-device", Some(dup_path)), 409, what_add, &["Failed to validate config", cause]);
    let dup_id = r#"{"path":"/sys/bus/pci/devices/0000:42:00.0/","id":"gpu0"}"#;
    let cause = "Identifier gpu0 is not unique";
    assert_api(&vmm.put("vm.add-device", Some(dup_id)), 409, what_add, &["Failed to validate config", cause]);

    assert_204(&vmm.put("vm.boot", None));
    let resp = vmm.put("vm.add-device", Some(r#"{"path":"/sys/bus/pci/devices/0000:42:00.0/"}"#));
    assert_eq!((resp.status, resp.json()), (200, json!({"id": "_vfio0", "bdf": "0000:00:06.0"})), "{resp:?}");
    let resp = vmm.put("vm.add-device", Some(r#"{"path":"/sys/bus/pci/devices/0000:43:00.0/","id":"gpu3"}"#));
    assert_eq!((resp.status, resp.json()), (200, json!({"id": "gpu3", "bdf": "0000:00:07.0"})), "{resp:?}");
    let ids: Vec<Value> =
        vmm.get("vm.info").json()["config"]["devices"].as_array().unwrap().iter().map(|d| d["id"].clone()).collect();
    assert_eq!(ids, [json!("gpu0"), json!("_vfio0"), json!("gpu3")]);

    assert_204(&vmm.put("vm.remove-device", Some(r#"{"id":"_vfio0"}"#)));
    let cause = "No device with id \"_vfio0\" to remove";
    assert_api(&vmm.put("vm.remove-device", Some(r#"{"id":"_vfio0"}"#)), 404, what_remove, &[cause]);
    assert_eq!(vmm.get("vm.info").json()["config"]["devices"].as_array().unwrap().len(), 2);
}

#[test]
fn control_fail_answers_the_given_error_and_the_file_is_reread_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.json");
    let fail = json!({"fail": {
        "vm.boot": {"status": 500, "errors": ["Error from API", "The VM could not boot", "injected"]},
        "vmm.ping": {"status": 503, "errors": ["down"]},
    }});
    write_atomic(&control, &fail.to_string());
    let vmm = Start::fake().in_dir(dir).env("CH_FAKE_CONTROL", &control).spawn();
    assert_errors(&vmm.get("vmm.ping"), 503, &["down"]);
    assert_204(&vmm.put("vm.create", Some(&minimal_config(vmm.dir.path()))));
    assert_errors(&vmm.put("vm.boot", None), 500, &["Error from API", "The VM could not boot", "injected"]);
    assert_eq!(vmm.get("vm.info").json()["state"], "Created", "a failed request changes no state");

    write_atomic(&control, "{}");
    assert_eq!(vmm.get("vmm.ping").status, 200);
    assert_204(&vmm.put("vm.boot", None));

    // An invalid control file (here: a misspelt key) is logged and the defaults apply.
    write_atomic(&control, r#"{"fial": {}}"#);
    assert_eq!(vmm.get("vmm.ping").status, 200);
    vmm.wait_stderr("unknown field `fial`");
    // A missing one is the defaults, silently.
    std::fs::remove_file(&control).unwrap();
    assert_eq!(vmm.get("vm.info").json()["state"], "Running");
}

#[test]
fn control_hang_reads_the_request_and_never_answers() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let control = dir.path().join("control.json");
    write_atomic(&control, &json!({"hang": ["vm.boot"]}).to_string());
    let vmm = Start::fake().in_dir(dir).env("CH_FAKE_CONTROL", &control).env("CH_FAKE_LOG", &log).spawn();
    assert_204(&vmm.put("vm.create", Some(&minimal_config(vmm.dir.path()))));

    let mut hung = vmm.conn();
    hung.send("PUT", "/api/v1/vm.boot", None).unwrap();
    // The fake has read it (it is in the log, without a status) ...
    wait_for("the hung request in the log", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .any(|l| l["path"] == "/api/v1/vm.boot" && l["status"].is_null())
            .then_some(())
    });
    // ... answers other connections meanwhile ...
    assert_eq!(vmm.get("vmm.ping").status, 200);
    assert_eq!(vmm.get("vm.info").json()["state"], "Created");
    // ... and never this one: the client's timeout fires, the connection stays open.
    let err = hung.receive(Duration::from_millis(700)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    let err = hung.receive(Duration::from_millis(300)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "still open, still silent: {err}");
}

#[test]
fn control_ignore_power_button_keeps_the_guest_running() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.json");
    write_atomic(&control, &json!({"ignore_power_button": true, "poweroff_delay_ms": 0}).to_string());
    let mut vmm = Start::fake().in_dir(dir).env("CH_FAKE_CONTROL", &control).spawn();
    let serial = vmm.path("serial.log");
    let mut config: Value = serde_json::from_str(&minimal_config(vmm.dir.path())).unwrap();
    config["serial"] = json!({"mode": "File", "file": serial});
    assert_204(&vmm.put("vm.create", Some(&config.to_string())));
    assert_204(&vmm.put("vm.boot", None));
    assert_204(&vmm.put("vm.power-button", None));
    assert_204(&vmm.put("vm.power-button", None));
    // Nothing happens: with a delay of 0 the power-off would be due at once; give it a
    // bounded moment to (not) happen while the fake keeps answering.
    let until = std::time::Instant::now() + Duration::from_millis(300);
    while std::time::Instant::now() < until {
        assert!(vmm.try_status().is_none(), "the fake exited although the button is ignored");
        assert_eq!(vmm.get("vm.info").json()["state"], "Running");
    }
    assert!(!std::fs::read_to_string(&serial).unwrap().contains("powered off"));

    // The same fake honours the button once the knob is gone.
    write_atomic(&control, &json!({"poweroff_delay_ms": 0}).to_string());
    assert_204(&vmm.put("vm.power-button", None));
    assert_eq!(vmm.wait_exit().code(), Some(0));
    assert!(std::fs::read_to_string(&serial).unwrap().ends_with("guest powered off\n"));
}

#[test]
fn control_ignore_sigterm_needs_sigkill() {
    let mut vmm = fake_with_control(json!({"ignore_sigterm": true}));
    vmm.signal(Signal::SIGTERM);
    vmm.wait_stderr("SIGTERM ignored");
    assert_eq!(vmm.get("vmm.ping").status, 200);
    assert!(vmm.try_status().is_none());
    vmm.signal(Signal::SIGKILL);
    assert_eq!(vmm.wait_exit().signal(), Some(Signal::SIGKILL as i32));
}

#[test]
fn control_exit_on_crashes_without_answering() {
    let mut vmm = fake_with_control(json!({"exit_on": ["vm.boot"]}));
    assert_204(&vmm.put("vm.create", Some(&minimal_config(vmm.dir.path()))));
    let err = vmm.conn().request("PUT", "/api/v1/vm.boot", None).unwrap_err();
    assert!(
        matches!(err.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset),
        "no answer, the connection drops: {err}"
    );
    assert_eq!(vmm.wait_exit().code(), Some(1));
    assert!(socket_exists(&vmm), "a crashing VMM leaves its socket file behind");
}

#[test]
fn control_boot_serial_replaces_the_boot_text() {
    let mut vmm = fake_with_control(json!({"boot_serial": "custom boot\n", "poweroff_delay_ms": 1}));
    let serial = vmm.path("serial.log");
    std::fs::write(&serial, "earlier run\n").unwrap();
    let mut config: Value = serde_json::from_str(&minimal_config(vmm.dir.path())).unwrap();
    config["serial"] = json!({"mode": "File", "file": serial});
    assert_204(&vmm.put("vm.create", Some(&config.to_string())));
    assert_204(&vmm.put("vm.boot", None));
    assert_eq!(std::fs::read_to_string(&serial).unwrap(), "earlier run\ncustom boot\n", "appended");
    assert_204(&vmm.put("vm.power-button", None));
    assert_eq!(vmm.wait_exit().code(), Some(0));
    assert_eq!(
        std::fs::read_to_string(&serial).unwrap(),
        "earlier run\ncustom boot\nfake cloud-hypervisor: ACPI power button: guest powered off\n"
    );
}

#[test]
fn every_request_is_a_json_line_in_ch_fake_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    std::fs::write(&log, "{\"earlier\":true}\n").unwrap();
    let vmm = Start::fake().in_dir(dir).env("CH_FAKE_LOG", &log).spawn();
    let config = minimal_config(vmm.dir.path());
    vmm.get("vmm.ping");
    vmm.put("vm.create", Some(&config));
    vmm.put("vm.create", Some("not json"));
    vmm.put("vm.boot", None);
    let lines: Vec<Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let socket = vmm.socket.to_string_lossy();
    let pid = vmm.pid();
    let config: Value = serde_json::from_str(&config).unwrap();
    assert_eq!(
        lines,
        [
            json!({"earlier": true}),
            json!({"pid": pid, "socket": socket, "method": "GET", "path": "/api/v1/vmm.ping", "body": null, "fds": [], "status": 200}),
            json!({"pid": pid, "socket": socket, "method": "PUT", "path": "/api/v1/vm.create", "body": config, "fds": [], "status": 204}),
            json!({"pid": pid, "socket": socket, "method": "PUT", "path": "/api/v1/vm.create", "body": null, "fds": [], "status": 400}),
            json!({"pid": pid, "socket": socket, "method": "PUT", "path": "/api/v1/vm.boot", "body": null, "fds": [], "status": 204}),
        ]
    );
    // And one line per request on stderr.
    vmm.wait_stderr("PUT /api/v1/vm.boot 204");
}

#[test]
fn vmm_shutdown_answers_200_then_exits() {
    let mut vmm = Start::fake().spawn();
    assert_204(&vmm.put("vm.create", Some(&minimal_config(vmm.dir.path()))));
    let resp = vmm.put("vmm.shutdown", None);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.header("content-length"), Some("0"));
    assert!(resp.body.is_empty());
    assert_eq!(vmm.wait_exit().code(), Some(0));
    assert!(!socket_exists(&vmm));
}

#[test]
fn sigterm_and_sigint_remove_the_socket_and_exit_0() {
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let mut vmm = Start::fake().spawn();
        vmm.signal(signal);
        assert_eq!(vmm.wait_exit().code(), Some(0), "{signal}");
        assert!(!socket_exists(&vmm), "{signal}");
    }
}

#[test]
fn a_stale_socket_is_replaced_and_a_regular_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(std::fs::symlink_metadata(&socket).unwrap().file_type().is_socket());
    // Stale: nobody listens. (A child another test thread forks at this moment holds a copy
    // of the listener's fd until it execs: wait until that copy is gone.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&socket).is_ok() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(std::os::unix::net::UnixStream::connect(&socket).is_err(), "stale: nobody listens");
    let vmm = Start::fake().in_dir(dir).spawn();
    assert_eq!(vmm.get("vmm.ping").status, 200);

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("api.sock"), "not a socket").unwrap();
    let mut start = Start::fake().in_dir(dir);
    start.wait_socket = false;
    let mut vmm = start.spawn();
    assert_eq!(vmm.wait_exit().code(), Some(1));
    vmm.wait_stderr("exists and is not a socket");
}

#[test]
fn one_connection_carries_several_requests() {
    let vmm = Start::fake().spawn();
    let mut conn = vmm.conn();
    let config = minimal_config(vmm.dir.path());
    assert_eq!(conn.request("GET", "/api/v1/vmm.ping", None).unwrap().status, 200);
    assert_eq!(conn.request("PUT", "/api/v1/vm.create", Some(&config)).unwrap().status, 204);
    assert_eq!(conn.request("PUT", "/api/v1/vm.boot", None).unwrap().status, 204);
    assert_eq!(conn.request("GET", "/api/v1/vm.info", None).unwrap().json()["state"], "Running");
}

// ---- Disks, NICs by fd, the serial socket, snapshots ----

fn config_with(vmm: &Vmm, extra: Value) -> String {
    let mut config: Value = serde_json::from_str(&minimal_config(vmm.dir.path())).unwrap();
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    config.to_string()
}

const O_ACCMODE: u32 = 0o3;

#[test]
fn disks_are_opened_at_boot_held_while_booted_and_checked_like_the_real() {
    let vmm = Start::fake().spawn();
    let d = |n: &str| vmm.path(n);
    common::write_qcow2(&d("base.qcow2"), None);
    common::write_qcow2(&d("ov.qcow2"), Some("base.qcow2"));
    std::fs::write(d("raw.img"), [0u8; 4096]).unwrap();
    let boot_with = |disks: Value| {
        assert_204(&vmm.put("vm.create", Some(&config_with(&vmm, json!({"disks": disks})))));
        let resp = vmm.put("vm.boot", None);
        if resp.status != 204 {
            assert_204(&vmm.put("vm.delete", None));
        }
        resp
    };
    fn dev<'a>(causes: &[&'a str]) -> Vec<&'a str> {
        [&["Error from device manager"], causes].concat()
    }
    let missing = d("missing.img");
    let resp = boot_with(json!([{"path": missing}]));
    let io = format!("I/O error (path={} op=open)", missing.display());
    assert_api(
        &resp,
        500,
        "The VM could not boot",
        &dev(&["Cannot open disk path", &io, "No such file or directory (os error 2)"]),
    );
    let ov = d("ov.qcow2");
    let unsupported = format!("Unsupported feature (path={} op=open)", ov.display());
    for disk in [json!({"path": ov}), json!({"path": ov, "backing_files": false, "image_type": "Qcow2"})] {
        let resp = boot_with(json!([disk]));
        assert_api(
            &resp,
            500,
            "The VM could not boot",
            &dev(&["Cannot open disk path", &unsupported, "Maximum disk nesting depth exceeded"]),
        );
    }
    let resp = boot_with(json!([{"path": d("raw.img"), "image_type": "Qcow2"}]));
    assert_api(
        &resp,
        500,
        "The VM could not boot",
        &dev(&["Disk image type does not match expected type: specified = qcow2, detected = raw"]),
    );
    let resp = boot_with(json!([{"path": d("base.qcow2"), "image_type": "Raw"}]));
    assert_api(
        &resp,
        500,
        "The VM could not boot",
        &dev(&["Disk image type does not match expected type: specified = raw, detected = qcow2"]),
    );
    let resp = boot_with(json!([{"path": d("raw.img"), "id": "a"}, {"path": d("base.qcow2"), "id": "a"}]));
    assert_api(&resp, 500, "The VM could not boot", &["Failed to validate config", "Identifier a is not unique"]);
    common::write_qcow2(&d("orphan.qcow2"), Some("gone.qcow2"));
    let resp = boot_with(json!([{"path": d("orphan.qcow2"), "backing_files": true}]));
    let io = format!("I/O error (path={} op=open)", d("orphan.qcow2").display());
    assert_api(
        &resp,
        500,
        "The VM could not boot",
        &dev(&[
            "Cannot open disk path",
            &io,
            "Backing file I/O error: gone.qcow2",
            "No such file or directory (os error 2)",
        ]),
    );
    let resp = vmm.put("vm.create", Some(&config_with(&vmm, json!({"disks": [{"path": "x", "image_type": "Vhd"}]}))));
    assert_eq!(resp.status, 400);
    assert!(
        resp.errors()[1]
            .starts_with("unknown variant `Vhd`, expected one of `FixedVhd`, `Qcow2`, `Raw`, `Vhdx`, `Unknown`"),
        "{resp:?}"
    );

    // The overlay read-write, its backing file and a read-only disk read-only.
    let disks = json!([{"path": ov, "image_type": "Qcow2", "backing_files": true, "id": "disk0"},
                       {"path": d("raw.img"), "readonly": true, "id": "disk1"}]);
    assert_204(&boot_with(disks.clone()));
    assert_eq!(vmm.get("vm.info").json()["config"]["disks"], disks);
    let mode = |p: &std::path::Path| vmm.fds_on(p).iter().map(|(_, f)| f & O_ACCMODE).collect::<Vec<_>>();
    assert_eq!(mode(&ov), [2], "overlay O_RDWR");
    assert_eq!(mode(&d("base.qcow2")), [0], "backing file O_RDONLY");
    assert_eq!(mode(&d("raw.img")), [0], "readonly disk O_RDONLY");
    assert_204(&vmm.put("vm.shutdown", None));
    assert!(
        vmm.fds_on(&ov).is_empty() && vmm.fds_on(&d("base.qcow2")).is_empty(),
        "closed at vm.shutdown, as the real"
    );
}

#[test]
fn add_net_takes_the_fds_passed_with_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let vmm = Start::fake().in_dir(dir).env("CH_FAKE_LOG", &log).spawn();
    let null = std::fs::File::open("/dev/null").unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&null);
    let body = r#"{"mac":"52:54:00:12:34:56","id":"net0"}"#;
    let what = "The network device could not be added to the VM";
    assert_api(&vmm.put_fds("vm.add-net", body, &[fd]), 404, what, &["VM is not created"]);
    assert_errors(&vmm.put("vm.add-net", None), 400, &["Bad Request"]);
    assert_errors(&vmm.req("GET", "vm.add-net", Some(body)), 400, &["Bad Request"]);
    assert_204(&vmm.put("vm.create", Some(&config_with(&vmm, json!({})))));
    let resp = vmm.put("vm.add-net", Some(r#"{"mac":"zz"}"#));
    assert_errors(
        &resp,
        400,
        &[
            "Failed to deserialize JSON",
            "The provided MAC address is invalid: parsing of zz into a MAC address failed at line 1 column 12",
        ],
    );
    assert_204(&vmm.put_fds("vm.add-net", body, &[fd]));
    assert_api(
        &vmm.put_fds("vm.add-net", body, &[fd]),
        500,
        what,
        &["Failed to validate config", "Identifier net0 is not unique"],
    );
    let two = r#"{"mac":"52:54:00:12:34:57","id":"net1"}"#;
    assert_api(
        &vmm.put_fds("vm.add-net", two, &[fd, fd]),
        500,
        what,
        &["Failed to validate config", "Number of queues (2) to virtio_net does not match the number of FDs (4)"],
    );
    let net = vmm.get("vm.info").json()["config"]["net"].clone();
    assert_eq!(net.as_array().unwrap().len(), 1, "{net}");
    assert_eq!((net[0]["id"].as_str(), net[0]["mac"].as_str()), (Some("net0"), Some("52:54:00:12:34:56")));
    let held = net[0]["fds"][0].as_i64().expect("fds: [n]");
    assert_eq!(vmm.fd_target(held).as_deref(), Some(std::path::Path::new("/dev/null")), "the fake holds the fd");
    let lines: Vec<Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let adds: Vec<&Value> = lines.iter().filter(|l| l["path"] == "/api/v1/vm.add-net").collect();
    assert_eq!(adds[0]["fds"], json!(["/dev/null"]));
    assert_eq!(adds[1]["fds"], json!([]));
    assert_eq!(adds[6]["fds"], json!(["/dev/null", "/dev/null"]));
    // After boot: hot-plugged, with an id and a bdf.
    assert_204(&vmm.put("vm.boot", None));
    let resp = vmm.put_fds("vm.add-net", r#"{"mac":"52:54:00:12:34:58"}"#, &[fd]);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.json()["id"], "_net0");
    assert!(resp.json()["bdf"].as_str().unwrap().starts_with("0000:00:"));
    assert_204(&vmm.put("vm.shutdown", None));
    assert!(vmm.fd_target(held).is_some(), "kept while the VM exists");
    assert_204(&vmm.put("vm.delete", None));
    assert_ne!(vmm.fd_target(held).as_deref(), Some(std::path::Path::new("/dev/null")), "closed with the VM");
    // fds in a vm.create body are ignored (the real binary warns).
    let config = config_with(&vmm, json!({"net": [{"mac": "52:54:00:12:34:56", "id": "net0", "fds": [3]}]}));
    assert_204(&vmm.put("vm.create", Some(&config)));
    assert_eq!(vmm.get("vm.info").json()["config"]["net"], json!([{"mac": "52:54:00:12:34:56", "id": "net0"}]));
    vmm.wait_stderr("FD numbers were present in HTTP request body");
}

/// Reads from a serial client until `needle` arrived (or the deadline).
fn read_until(stream: &mut std::os::unix::net::UnixStream, got: &mut Vec<u8>, needle: &str) {
    use std::io::Read;
    stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    wait_for(&format!("{needle:?} on the serial socket"), || {
        let mut buf = [0u8; 65536];
        match stream.read(&mut buf) {
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => panic!("serial read: {e}"),
        }
        String::from_utf8_lossy(got).contains(needle).then_some(())
    });
}

#[test]
fn the_serial_socket_serves_one_client_echoes_and_keeps_output_without_client() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let mut vmm = fake_with_control(json!({"serial_flood_bytes": 100000, "poweroff_delay_ms": 1}));
    let sock = vmm.path("serial.sock");
    // A stale socket file: vm.create answers EADDRINUSE (as the real) and keeps the VM.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let config = config_with(&vmm, json!({"serial": {"mode": "Socket", "socket": sock}}));
    let in_use =
        ["Error creating console devices", "Error creating console device", "Address already in use (os error 98)"];
    assert_api(&vmm.put("vm.create", Some(&config)), 500, "The VM could not be created", &in_use);
    assert_eq!(vmm.get("vm.info").json()["state"], "Created");
    assert_api(&vmm.put("vm.boot", None), 500, "The VM could not boot", &in_use);
    assert_204(&vmm.put("vm.delete", None));
    std::fs::remove_file(&sock).unwrap();
    let missing = config_with(&vmm, json!({"serial": {"mode": "Socket", "socket": vmm.path("no/dir/s.sock")}}));
    let no_dir =
        ["Error creating console devices", "Error creating console device", "No such file or directory (os error 2)"];
    assert_api(&vmm.put("vm.create", Some(&missing)), 500, "The VM could not be created", &no_dir);
    assert_204(&vmm.put("vm.delete", None));

    // Bound at vm.create; the boot text and the flood are kept until a client comes.
    assert_204(&vmm.put("vm.create", Some(&config)));
    assert!(std::fs::symlink_metadata(&sock).unwrap().file_type().is_socket(), "bound at vm.create");
    assert_204(&vmm.put("vm.boot", None));
    let mut a = UnixStream::connect(&sock).unwrap();
    let mut got = Vec::new();
    read_until(&mut a, &mut got, "gpuvisor-guest: ready\n");
    let text = String::from_utf8_lossy(&got).into_owned();
    assert!(text.starts_with("fake cloud-hypervisor: booting "), "{text:?}");
    while got.len() < text.find("ready\n").unwrap() + 6 + 100000 {
        read_until(&mut a, &mut got, "flood");
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let flood = &text[text.find("ready\n").unwrap() + 6..];
    assert_eq!(flood.len(), 100000);
    assert!(flood.starts_with("flood 000001 xxx"), "{:?}", &flood[..40]);
    // Echo.
    a.write_all(b"uname -a\n").unwrap();
    let mut echo = Vec::new();
    read_until(&mut a, &mut echo, "uname -a\n");
    // A second client replaces the first, which reads EOF.
    let mut b = UnixStream::connect(&sock).unwrap();
    b.write_all(b"hello\n").unwrap();
    let mut got_b = Vec::new();
    read_until(&mut b, &mut got_b, "hello\n");
    a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    assert_eq!(a.read_to_end(&mut rest).unwrap(), 0, "the first client got EOF");
    // The power-off line goes to the client, then the VMM exits.
    assert_204(&vmm.put("vm.power-button", None));
    read_until(&mut b, &mut got_b, "guest powered off\n");
    assert_eq!(vmm.wait_exit().code(), Some(0));
}

#[test]
fn the_serial_socket_is_removed_at_shutdown_and_bound_again_at_boot() {
    let vmm = Start::fake().spawn();
    let sock = vmm.path("serial.sock");
    let config = config_with(&vmm, json!({"serial": {"mode": "Socket", "socket": sock}}));
    assert_204(&vmm.put("vm.create", Some(&config)));
    assert_204(&vmm.put("vm.boot", None));
    assert_204(&vmm.put("vm.shutdown", None));
    assert!(!sock.exists(), "removed at vm.shutdown, as the real");
    assert_204(&vmm.put("vm.boot", None));
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let mut got = Vec::new();
    read_until(&mut c, &mut got, "ready\n");
    assert_204(&vmm.put("vm.delete", None));
    assert!(!sock.exists(), "removed at vm.delete");
}

#[test]
fn snapshot_then_restore_paused_with_new_tap_fds() {
    let vmm = Start::fake().spawn();
    let snap = vmm.path("snap");
    std::fs::create_dir(&snap).unwrap();
    let url = format!("file://{}", snap.display());
    let snapshot = json!({"destination_url": url}).to_string();
    let restore = json!({"source_url": url}).to_string();
    let w = "The VM could not be snapshotted";
    let r = "The VM could not be restored";
    assert_api(&vmm.put("vm.snapshot", Some(&snapshot)), 500, w, &["VM is not running"]);
    assert_errors(&vmm.put("vm.snapshot", None), 400, &["Bad Request"]);
    assert_errors(
        &vmm.put("vm.snapshot", Some("{}")),
        400,
        &["Failed to deserialize JSON", "missing field `destination_url` at line 1 column 2"],
    );
    let sock = vmm.path("serial.sock");
    std::fs::write(vmm.path("disk.img"), [0u8; 4096]).unwrap();
    let config = config_with(
        &vmm,
        json!({"serial": {"mode": "Socket", "socket": sock}, "disks": [{"path": vmm.path("disk.img"), "id": "disk0"}]}),
    );
    assert_204(&vmm.put("vm.create", Some(&config)));
    let null = std::fs::File::open("/dev/null").unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&null);
    assert_204(&vmm.put_fds("vm.add-net", r#"{"mac":"52:54:00:12:34:56","id":"net0"}"#, &[fd]));
    assert_api(&vmm.put("vm.snapshot", Some(&snapshot)), 500, w, &["VM is not running"]);
    assert_204(&vmm.put("vm.boot", None));
    assert_api(
        &vmm.put("vm.snapshot", Some(&snapshot)),
        500,
        w,
        &["Cannot snapshot VM", "Failed to snapshot migratable component", "Trying to snapshot while VM is running"],
    );
    assert_204(&vmm.put("vm.pause", None));
    let nodir = json!({"destination_url": format!("file://{}", vmm.path("nodir").display())}).to_string();
    let resp = vmm.put("vm.snapshot", Some(&nodir));
    assert_eq!((resp.status, resp.errors()[1].as_str()), (500, w), "{resp:?}");
    assert_204(&vmm.put("vm.snapshot", Some(&snapshot)));
    let saved: Value = serde_json::from_slice(&std::fs::read(snap.join("config.json")).unwrap()).unwrap();
    assert_eq!(saved, vmm.get("vm.info").json()["config"]);
    let state: Value = serde_json::from_slice(&std::fs::read(snap.join("state.json")).unwrap()).unwrap();
    assert!(state["serial_written"].as_u64().unwrap() > 0, "{state}");
    assert!(snap.join("memory-ranges").is_file());
    assert_api(&vmm.put("vm.restore", Some(&restore)), 500, r, &["VM is already created"]);
    assert_204(&vmm.put("vm.delete", None));
    assert!(!sock.exists());

    // Restore errors.
    let nodir = vmm.path("nodir");
    let resp = vmm.put("vm.restore", Some(&json!({"source_url": format!("file://{}", nodir.display())}).to_string()));
    let not_dir = format!("Destination is not a directory: {nodir:?}");
    assert_api(&resp, 500, r, &["Cannot restore VM", "Failed to send migratable component snapshot", &not_dir]);
    let resp = vmm.put("vm.restore", Some(&json!({"source_url": snap}).to_string()));
    let no_url = format!("Could not extract path from URL: {}", snap.display());
    assert_api(&resp, 500, r, &["Cannot restore VM", "Failed to send migratable component snapshot", &no_url]);
    assert_errors(
        &vmm.put("vm.restore", Some("{}")),
        400,
        &["Failed to deserialize JSON", "missing field `source_url` at line 1 column 2"],
    );
    // net0 had an fd: the restore needs one, named by net_fds (num_fds), else the fd count is a 400.
    let named = json!({"source_url": url, "net_fds": [{"id": "net0", "fds": [3]}]}).to_string();
    assert_errors(&vmm.put_fds("vm.restore", &named, &[fd]), 400, &["Bad Request"]);
    let resp = vmm.put("vm.restore", Some(&restore));
    assert_api(&resp, 500, r, &["Failed to validate config", "Net id net0 is associated with FDs and is required"]);
    let empty = vmm.path("empty");
    std::fs::create_dir(&empty).unwrap();
    let resp = vmm.put("vm.restore", Some(&json!({"source_url": format!("file://{}", empty.display())}).to_string()));
    let open = format!("Error opening VM config snapshot file {:?}", empty.join("config.json"));
    assert_api(
        &resp,
        500,
        r,
        &[
            "Cannot restore VM",
            "Failed to receive migratable component snapshot",
            &open,
            "No such file or directory (os error 2)",
        ],
    );

    // A restore: Paused, disks open again, the serial socket bound again, no boot text.
    let with_fds = json!({"source_url": url, "prefault": false, "net_fds": [{"id": "net0", "num_fds": 1}]}).to_string();
    assert_204(&vmm.put_fds("vm.restore", &with_fds, &[fd]));
    let info = vmm.get("vm.info").json();
    assert_eq!(info["state"], "Paused");
    let held = info["config"]["net"][0]["fds"][0].as_i64().unwrap();
    assert_eq!(vmm.fd_target(held).as_deref(), Some(std::path::Path::new("/dev/null")));
    assert_eq!(vmm.fds_on(&vmm.path("disk.img")).len(), 1, "the disk is open again");
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let mut got = Vec::new();
    let restored = format!("fake cloud-hypervisor: restored from {}\n", snap.display());
    read_until(&mut c, &mut got, &restored);
    assert_eq!(String::from_utf8_lossy(&got), restored, "no boot text");
    assert_204(&vmm.put("vm.resume", None));
    assert_eq!(vmm.get("vm.info").json()["state"], "Running");
}

#[test]
fn reboot_boots_the_guest_again_and_counters_name_every_disk() {
    let mut vmm = fake_with_control(json!({"boot_serial": "booted\n"}));
    let serial = vmm.path("serial.log");
    let disk = vmm.path("d.raw");
    std::fs::write(&disk, vec![0u8; 4096]).unwrap();
    let mut config: Value = serde_json::from_str(&minimal_config(vmm.dir.path())).unwrap();
    config["serial"] = json!({"mode": "File", "file": serial});
    config["disks"] = json!([{"path": disk, "id": "disk0"}]);
    assert_api(&vmm.put("vm.reboot", None), 404, "The VM could not reboot", &["VM is not created"]);
    assert_api(&vmm.get("vm.counters"), 500, "The VM info is not available", &["VM is not running"]);
    assert_204(&vmm.put("vm.create", Some(&config.to_string())));
    assert_api(&vmm.put("vm.reboot", None), 404, "The VM could not reboot", &["VM is not created"]);
    assert_204(&vmm.put("vm.boot", None));
    let counters = vmm.get("vm.counters");
    assert_eq!(counters.status, 200, "{counters:?}");
    assert_eq!(counters.json(), json!({"disk0": {"read_bytes": 0, "write_bytes": 0, "read_ops": 0, "write_ops": 0}}));
    assert_204(&vmm.put("vm.reboot", None));
    assert_eq!(std::fs::read_to_string(&serial).unwrap(), "booted\nbooted\n", "the guest booted again");
    assert_eq!(vmm.get("vm.info").json()["state"], "Running");
    assert_eq!(vmm.put("vmm.shutdown", None).status, 200);
    assert_eq!(vmm.wait_exit().code(), Some(0));
}
