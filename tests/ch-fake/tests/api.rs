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
    let config = json!({
        "payload": {"kernel": kernel, "initramfs": initrd, "cmdline": "console=ttyS0 quiet"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
        "memory": {"size": 1073741824u64},
        "serial": {"mode": "File", "file": serial},
        "console": {"mode": "Off"},
        "devices": [{"path": "/sys/bus/pci/devices/0000:41:00.0/", "id": "gpu0"}],
        "disks": [{"path": "/var/lib/x.img", "readonly": true, "direct": false, "id": "disk0"}],
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
            json!({"pid": pid, "socket": socket, "method": "GET", "path": "/api/v1/vmm.ping", "body": null, "status": 200}),
            json!({"pid": pid, "socket": socket, "method": "PUT", "path": "/api/v1/vm.create", "body": config, "status": 204}),
            json!({"pid": pid, "socket": socket, "method": "PUT", "path": "/api/v1/vm.create", "body": null, "status": 400}),
            json!({"pid": pid, "socket": socket, "method": "PUT", "path": "/api/v1/vm.boot", "body": null, "status": 204}),
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
