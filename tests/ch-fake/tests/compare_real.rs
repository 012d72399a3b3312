//! The same request sequence against the real Cloud Hypervisor binary and against the
//! fake: status codes and error arrays must agree on the subset both implement (requests
//! whose answer does not depend on a guest that runs). Skipped, with one line, when no real
//! binary is found (`CLOUD_HYPERVISOR_BIN`, then `cloud-hypervisor` on `PATH`, then
//! `<repo>/../shared/tools/cloud-hypervisor`).
//!
//! Where the fake differs on purpose (unknown fields are a 400; a duplicate device is a
//! 409 and an unknown device id a 404 where the real answers 500; hot-plug succeeds), the
//! step compares only what is shared, or is left out.

mod common;

use std::path::{Path, PathBuf};

use common::{write_atomic, Start, Vmm};
use nix::sys::signal::Signal;
use serde_json::{json, Value};

/// The real binary, or why the comparison is skipped.
fn real_binary() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os("CLOUD_HYPERVISOR_BIN").filter(|b| !b.is_empty()) {
        let bin = PathBuf::from(bin);
        return if bin.is_file() { Ok(bin) } else { Err(format!("CLOUD_HYPERVISOR_BIN={} is no file", bin.display())) };
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("cloud-hypervisor"))
        .find(|p| p.is_file());
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let shared = repo.join("../shared/tools/cloud-hypervisor");
    let found = on_path.or_else(|| Some(shared).filter(|p| p.is_file()));
    let found =
        found.ok_or("no real cloud-hypervisor (CLOUD_HYPERVISOR_BIN, PATH, ../shared/tools/cloud-hypervisor)")?;
    if !Path::new("/dev/kvm").exists() {
        return Err(format!("{} needs /dev/kvm, which this machine lacks", found.display()));
    }
    Ok(found)
}

/// A kernel the real binary can load (only then can the Running part be compared).
fn bootable_kernel() -> Option<PathBuf> {
    if let Some(k) = std::env::var_os("CH_COMPARE_KERNEL").filter(|k| !k.is_empty()) {
        return Some(PathBuf::from(k));
    }
    Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/images/demo/vmlinuz")).filter(|p| p.is_file())
}

#[derive(Clone, Copy, PartialEq)]
enum Compare {
    /// Status and body (error array, or raw bytes) must be equal.
    Exact,
    /// Status only (success bodies that legitimately differ).
    Status,
    /// The error array only (the fake's status differs on purpose).
    Errors,
}

struct Pair {
    real: Vmm,
    fake: Vmm,
    steps: usize,
}

impl Pair {
    fn step(&mut self, compare: Compare, method: &str, endpoint: &str, body: Option<&str>) -> (Value, Value) {
        self.steps += 1;
        let real = self.real.req(method, endpoint, body);
        let fake = self.fake.req(method, endpoint, body);
        let what = format!("{method} {endpoint} {}\n  real: {real:?}\n  fake: {fake:?}", body.unwrap_or(""));
        if compare != Compare::Errors {
            assert_eq!(real.status, fake.status, "status differs: {what}");
        }
        if compare != Compare::Status {
            if real.status >= 400 && !real.body.is_empty() {
                assert_eq!(real.errors(), fake.errors(), "error arrays differ: {what}");
            } else {
                assert_eq!(real.body, fake.body, "bodies differ: {what}");
            }
        }
        let json = |r: &common::Resp| serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        (json(&real), json(&fake))
    }

    fn exact(&mut self, method: &str, endpoint: &str, body: Option<&str>) {
        self.step(Compare::Exact, method, endpoint, body);
    }

    fn state(&mut self, expected: &str) {
        let (real, fake) = self.step(Compare::Status, "GET", "vm.info", None);
        assert_eq!((real["state"].as_str(), fake["state"].as_str()), (Some(expected), Some(expected)));
    }
}

#[test]
fn the_fake_answers_as_the_real_binary_does() {
    let real_bin = match real_binary() {
        Ok(bin) => bin,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let real = Start::new(&real_bin).spawn();
    // The real binary ignores the power button on this machine: so does the fake here.
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.json");
    write_atomic(&control, &json!({"ignore_power_button": true}).to_string());
    let fake = Start::fake().in_dir(dir).env("CH_FAKE_CONTROL", &control).spawn();
    let mut p = Pair { real, fake, steps: 0 };
    let (real_ping, fake_ping) = p.step(Compare::Status, "GET", "vmm.ping", None);
    for key in ["build_version", "version", "pid", "features"] {
        assert!(real_ping.get(key).is_some() && fake_ping.get(key).is_some(), "{key}: {real_ping} / {fake_ping}");
    }
    assert_eq!(real_ping["pid"], p.real.pid());
    assert_eq!(real_ping["version"], fake_ping["version"]);

    // No VM yet.
    for (method, endpoint) in [
        ("GET", "vm.info"),
        ("PUT", "vm.boot"),
        ("PUT", "vm.power-button"),
        ("PUT", "vm.shutdown"),
        ("PUT", "vm.pause"),
        ("PUT", "vm.resume"),
        ("PUT", "vm.reboot"),
        ("GET", "vm.counters"),
    ] {
        p.exact(method, endpoint, None);
    }
    p.exact("PUT", "vm.add-device", Some(r#"{"path":"/sys/bus/pci/devices/0000:00:01.0/"}"#));
    p.exact("PUT", "vm.remove-device", Some(r#"{"id":"x"}"#));
    p.exact("PUT", "vm.add-device", None);
    p.exact("PUT", "vm.remove-device", Some("{}"));

    // Bodies the real binary refuses, and HTTP-level refusals.
    p.exact("PUT", "vm.create", None);
    for body in [
        "notjson",
        "null",
        "{} x",
        r#"{"cpus":{"boot_vcpus":1}}"#,
        r#"{"memory":{"size":"x"}}"#,
        r#"{"serial":{"mode":"Bogus"}}"#,
        r#"{"serial":{"mode":"Bogus","file":"x"}}"#,
        r#"{"serial":{"mode":5}}"#,
        r#"{"serial":{"file":"x"}}"#,
        r#"{"console":{"mode":"Bogus"}}"#,
        r#"{"payload":{"kernel":7}}"#,
        r#"{"payload":{"cmdline":7}}"#,
        r#"{"devices":[{"path":7}]}"#,
        r#"{"platform":{"system_uuid":7}}"#,
        r#"{"net":[{"mtu":70000}]}"#,
        r#"{"net":[{"ip":"zz"}]}"#,
        r#"{"net":[{"mac":"zz"}]}"#,
        r#"{"cpus":{"boot_vcpus":"x","max_vcpus":1}}"#,
        r#"{"disks":[{"path":"x","readonly":"yes"}]}"#,
        r#"{"disks":[{"path":"x","image_type":"Vhd"}]}"#,
        r#"{"disks":[{"path":"x","image_type":"qcow2"}]}"#,
        r#"{"disks":[{"path":"x","image_type":5}]}"#,
        r#"{"disks":[{"path":"x","backing_files":"yes"}]}"#,
        r#"{"net":[{"fds":"x"}]}"#,
    ] {
        p.exact("PUT", "vm.create", Some(body));
    }
    p.exact("GET", "vm.boot", None);
    p.exact("PUT", "vmm.ping", None);
    p.exact("GET", "vm.nothing", None);
    p.exact("GET", "vmm.ping?x=1", None);
    for endpoint in ["vm.delete", "vm.boot", "vm.shutdown", "vm.power-button"] {
        p.exact("PUT", endpoint, Some("{}"));
    }

    // Created, and the boot-time validation.
    let scratch = tempfile::tempdir().unwrap();
    let missing = scratch.path().join("missing");
    let m = missing.to_string_lossy();
    let created = json!({"payload": {"kernel": format!("{m}/vmlinuz")}, "memory": {"size": 134217728u64}});
    // The serial socket is bound at vm.create: a stale file or a missing directory fails it
    // (the VM is kept), and vm.boot tries again. Done before any vm.create succeeds: after
    // one has, the real binary keeps its console devices across vm.delete and does not try
    // again at boot (its VM then boots without the socket); the fake always tries again.
    let stale = scratch.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    for socket in [stale.clone(), missing.join("s.sock")] {
        let mut config = created.clone();
        config["serial"] = json!({"mode": "Socket", "socket": socket});
        p.exact("PUT", "vm.create", Some(&config.to_string()));
        p.state("Created");
        p.exact("PUT", "vm.boot", None);
        p.exact("PUT", "vm.delete", None);
    }

    p.exact("PUT", "vm.create", Some(&created.to_string()));
    p.exact("PUT", "vm.create", Some(&created.to_string()));
    p.state("Created");
    for (method, endpoint) in [("PUT", "vm.power-button"), ("PUT", "vm.shutdown"), ("PUT", "vm.pause")] {
        p.exact(method, endpoint, None);
    }
    p.exact("PUT", "vm.boot", None);
    p.exact("PUT", "vm.delete", None);
    p.exact("GET", "vm.info", None);
    p.exact("PUT", "vm.delete", None);
    let kernel = format!("{m}/vmlinuz");
    for config in [
        json!({}),
        json!({"payload": {"kernel": kernel}, "cpus": {"boot_vcpus": 2, "max_vcpus": 1}}),
        json!({"payload": {"kernel": kernel}, "memory": {"size": 1000}, "cpus": {"boot_vcpus": 2, "max_vcpus": 1}}),
        json!({"payload": {"kernel": kernel}, "memory": {"size": 0}}),
        json!({"payload": {"kernel": kernel, "initramfs": format!("{m}/initrd")}}),
        json!({"payload": {"firmware": format!("{m}/fw")}}),
    ] {
        p.exact("PUT", "vm.create", Some(&config.to_string()));
        p.exact("PUT", "vm.boot", None);
        p.state("Created");
        p.exact("PUT", "vm.delete", None);
    }

    // Devices before boot (paths are not looked at before boot).
    p.exact("PUT", "vm.create", Some(&created.to_string()));
    let gpu = r#"{"path":"/sys/bus/pci/devices/0000:00:01.0/","id":"gpu0"}"#;
    p.exact("PUT", "vm.add-device", Some(gpu));
    p.step(Compare::Errors, "PUT", "vm.add-device", Some(gpu));
    p.step(
        Compare::Errors,
        "PUT",
        "vm.add-device",
        Some(r#"{"path":"/sys/bus/pci/devices/0000:00:02.0/","id":"gpu0"}"#),
    );
    p.exact("PUT", "vm.remove-device", Some(r#"{"id":"gpu0"}"#));
    p.step(Compare::Errors, "PUT", "vm.remove-device", Some(r#"{"id":"gpu0"}"#));
    p.exact("PUT", "vm.delete", None);

    // NICs by fd (no fds passed here: the answers do not depend on them), snapshots and
    // restores that fail, disks and the serial socket at create/boot.
    let net0 = r#"{"mac":"52:54:00:12:34:56","id":"net0"}"#;
    p.exact("PUT", "vm.add-net", Some(net0));
    p.exact("PUT", "vm.add-net", None);
    p.exact("GET", "vm.add-net", Some(net0));
    let snap = scratch.path().join("snap");
    std::fs::create_dir(&snap).unwrap();
    let url = format!("file://{}", snap.display());
    let snapshot = json!({"destination_url": url}).to_string();
    p.exact("PUT", "vm.snapshot", Some(&snapshot));
    p.exact("PUT", "vm.snapshot", None);
    p.exact("GET", "vm.snapshot", Some(&snapshot));
    p.exact("PUT", "vm.snapshot", Some("{}"));
    p.exact("PUT", "vm.snapshot", Some(r#"{"destination_url":5}"#));
    let restore = json!({"source_url": url}).to_string();
    p.exact("PUT", "vm.restore", None);
    p.exact("GET", "vm.restore", Some(&restore));
    for body in [
        json!({}),
        json!({"source_url": 5}),
        json!({"source_url": url, "prefault": "x"}),
        json!({"source_url": url, "resume": "x"}),
        json!({"source_url": url, "memory_restore_mode": "Bogus"}),
        json!({"source_url": url, "net_fds": 5}),
        json!({"source_url": url, "net_fds": [{"fds": [3]}]}),
        json!({"source_url": url, "net_fds": [{"id": "net0", "fds": "x"}]}),
        json!({"source_url": url, "net_fds": [{"id": "net0", "num_fds": "x"}]}),
        // num_fds without fds passed: a bare 400 before anything else.
        json!({"source_url": url, "net_fds": [{"id": "net0", "num_fds": 1}]}),
        json!({"source_url": format!("file://{m}")}),
        json!({"source_url": format!("file://{}", snap.join("x").display())}),
        json!({"source_url": snap}),
        json!({"source_url": "file://"}),
        // An empty directory: no config.json.
        json!({"source_url": url, "prefault": true, "net_fds": [{"id": "net0", "num_fds": 0}]}),
    ] {
        p.exact("PUT", "vm.restore", Some(&body.to_string()));
    }
    std::fs::write(snap.join("config.json"), "notjson").unwrap();
    p.exact("PUT", "vm.restore", Some(&restore));
    std::fs::write(snap.join("config.json"), created.to_string()).unwrap();
    p.exact("PUT", "vm.restore", Some(&restore));
    std::fs::write(snap.join("state.json"), "{}").unwrap();
    p.exact("PUT", "vm.restore", Some(&restore));
    p.exact("GET", "vm.info", None);

    p.exact("PUT", "vm.create", Some(&created.to_string()));
    p.step(Compare::Status, "PUT", "vm.add-net", Some("{}"));
    p.exact("PUT", "vm.add-net", Some(r#"{"mac":"zz"}"#));
    p.exact("PUT", "vm.add-net", Some(r#"{"fds":"x"}"#));
    p.exact("PUT", "vm.add-net", Some(net0));
    p.exact("PUT", "vm.add-net", Some(net0));
    p.exact("PUT", "vm.snapshot", Some(&snapshot));
    p.exact("PUT", "vm.restore", Some(&restore));
    p.exact("PUT", "vm.delete", None);
    // A NIC by fd before boot: the fd is held and its number shown in vm.info (a tap is not
    // looked at before boot, so /dev/null does). Two fds do not fit the default 2 queues.
    p.exact("PUT", "vm.create", Some(&created.to_string()));
    let null = std::fs::File::open("/dev/null").unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&null);
    let both = |p: &mut Pair, endpoint: &str, body: &str, fds: &[i32]| {
        p.steps += 1;
        let (real, fake) = (p.real.put_fds(endpoint, body, fds), p.fake.put_fds(endpoint, body, fds));
        assert_eq!(real.status, fake.status, "{endpoint} {body}: real {real:?} fake {fake:?}");
        if real.status >= 400 {
            assert_eq!(real.errors(), fake.errors(), "{endpoint} {body}");
        }
    };
    both(&mut p, "vm.add-net", r#"{"mac":"52:54:00:12:34:57","id":"net1"}"#, &[fd]);
    both(&mut p, "vm.add-net", r#"{"mac":"52:54:00:12:34:58","id":"net2"}"#, &[fd, fd]);
    let (real_info, fake_info) = p.step(Compare::Status, "GET", "vm.info", None);
    for (vmm, info) in [(&p.real, &real_info), (&p.fake, &fake_info)] {
        let net = info["config"]["net"].as_array().unwrap();
        assert_eq!(net.len(), 1, "{info}");
        let n = net[0]["fds"][0].as_i64().unwrap_or_else(|| panic!("fds: {info}"));
        assert_eq!(vmm.fd_target(n).as_deref(), Some(Path::new("/dev/null")));
    }
    p.exact("PUT", "vm.delete", None);
    // A restore whose fd count does not match net_fds: a bare 400; without net_fds the fds
    // are not looked at.
    both(&mut p, "vm.restore", &restore, &[fd]);
    let named = json!({"source_url": url, "net_fds": [{"id": "net0", "fds": [3]}]}).to_string();
    both(&mut p, "vm.restore", &named, &[fd]);
    let named = json!({"source_url": url, "net_fds": [{"id": "net0", "num_fds": 2}]}).to_string();
    both(&mut p, "vm.restore", &named, &[fd]);

    // fds in a vm.create body are dropped (with a warning).
    let with_fds = json!({"payload": {"kernel": format!("{m}/vmlinuz")},
                          "net": [{"mac": "52:54:00:12:34:56", "id": "net0", "fds": [3]}]});
    p.exact("PUT", "vm.create", Some(&with_fds.to_string()));
    let (real_info, fake_info) = p.step(Compare::Status, "GET", "vm.info", None);
    assert!(real_info["config"]["net"][0].get("fds").is_none() && fake_info["config"]["net"][0].get("fds").is_none());
    p.exact("PUT", "vm.delete", None);

    println!("compared {} requests before the booting part", p.steps);

    // A VM that boots (the real one reports Running; its guest never runs here).
    match bootable_kernel() {
        None => println!("part skipped: no bootable kernel (CH_COMPARE_KERNEL, target/images/demo/vmlinuz)"),
        Some(kernel) => {
            let config = json!({"payload": {"kernel": kernel, "cmdline": "console=ttyS0"},
                                "memory": {"size": 134217728u64}, "console": {"mode": "Off"}});
            p.exact("PUT", "vm.create", Some(&config.to_string()));
            p.exact("PUT", "vm.reboot", None);
            p.exact("GET", "vm.counters", None);
            p.exact("PUT", "vm.boot", None);
            p.state("Running");
            p.step(Compare::Status, "GET", "vm.counters", None);
            p.exact("PUT", "vm.reboot", None);
            p.state("Running");
            p.exact("PUT", "vm.boot", None);
            p.exact("PUT", "vm.create", Some(&config.to_string()));
            p.exact("PUT", "vm.power-button", None);
            let snapshot = json!({"destination_url": format!("file://{}", scratch.path().display())});
            p.exact("PUT", "vm.snapshot", Some(&snapshot.to_string()));
            p.exact("PUT", "vm.pause", None);
            p.state("Paused");
            p.exact("PUT", "vm.reboot", None);
            p.state("Running");
            p.exact("PUT", "vm.pause", None);
            p.exact("PUT", "vm.pause", None);
            p.exact("PUT", "vm.power-button", None);
            p.exact("PUT", "vm.resume", None);
            p.exact("PUT", "vm.resume", None);
            p.exact("PUT", "vm.shutdown", None);
            p.state("Created");
            p.exact("PUT", "vm.delete", None);
            disk_steps(&mut p, &config, scratch.path());
            let mut bad_uuid = config.clone();
            bad_uuid["platform"] = json!({"system_uuid": "xyz"});
            p.exact("PUT", "vm.create", Some(&bad_uuid.to_string()));
            p.exact("PUT", "vm.boot", None);
            p.exact("PUT", "vm.delete", None);
        }
    }

    // vmm.shutdown: 200, empty body, both exit 0 and remove their socket.
    let real_resp = p.real.put("vmm.shutdown", None);
    let fake_resp = p.fake.put("vmm.shutdown", None);
    assert_eq!((real_resp.status, real_resp.body.len()), (200, 0), "{real_resp:?}");
    assert_eq!((fake_resp.status, fake_resp.body.len()), (200, 0), "{fake_resp:?}");
    assert_eq!(real_resp.header("content-type"), fake_resp.header("content-type"));
    assert_eq!(p.real.wait_exit().code(), Some(0));
    assert_eq!(p.fake.wait_exit().code(), Some(0));
    assert!(!p.real.socket.exists() && !p.fake.socket.exists());

    // SIGTERM: both exit 0.
    let mut real = Start::new(&real_bin).spawn();
    let mut fake = Start::fake().spawn();
    real.signal(Signal::SIGTERM);
    fake.signal(Signal::SIGTERM);
    assert_eq!(real.wait_exit().code(), Some(0));
    assert_eq!(fake.wait_exit().code(), Some(0));
    println!("compared {} requests with {}", p.steps, real_bin.display());
}

/// Disks at boot (the real binary opens them: the kernel must be loadable); qcow2 files are
/// made with `qemu-img` (the real parses the whole header), those steps are skipped without.
fn disk_steps(p: &mut Pair, config: &Value, dir: &Path) {
    let raw = dir.join("raw.img");
    std::fs::write(&raw, vec![0u8; 1 << 20]).unwrap();
    let qemu_img = |args: &[&str]| {
        std::process::Command::new("qemu-img")
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let (base, ov, orphan) = (dir.join("base.qcow2"), dir.join("ov.qcow2"), dir.join("orphan.qcow2"));
    let have_qcow2 = qemu_img(&["create", "-f", "qcow2", &base.to_string_lossy(), "16M"])
        && qemu_img(&["create", "-f", "qcow2", "-F", "qcow2", "-b", &base.to_string_lossy(), &ov.to_string_lossy()])
        && qemu_img(&[
            "create",
            "-u",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            &dir.join("gone.qcow2").to_string_lossy(),
            &orphan.to_string_lossy(),
            "16M",
        ]);
    let mut disks = vec![
        (json!([{"path": dir.join("missing.img")}]), false),
        (json!([{"path": dir.join("missing.img"), "readonly": true}]), false),
        (json!([{"path": raw, "image_type": "Qcow2"}]), false),
        (json!([{"path": raw, "id": "a"}, {"path": raw, "id": "a"}]), false),
        (json!([{"path": raw, "readonly": true, "backing_files": true, "image_type": "Raw", "id": "disk0"}]), true),
    ];
    if have_qcow2 {
        disks.extend([
            (json!([{"path": ov}]), false),
            (json!([{"path": ov, "image_type": "Qcow2", "backing_files": false}]), false),
            (json!([{"path": base, "image_type": "Raw"}]), false),
            (json!([{"path": orphan, "backing_files": true}]), false),
            (json!([{"path": ov, "image_type": "Qcow2", "backing_files": true, "id": "disk0"}]), true),
        ]);
    } else {
        println!("qcow2 disk steps skipped: no qemu-img");
    }
    for (disks, boots) in disks {
        let mut config = config.clone();
        config["disks"] = disks;
        p.exact("PUT", "vm.create", Some(&config.to_string()));
        p.exact("PUT", "vm.boot", None);
        if boots {
            p.state("Running");
            let held = |pid: u32| {
                std::fs::read_dir(format!("/proc/{pid}/fd"))
                    .unwrap()
                    .flatten()
                    .filter_map(|e| std::fs::read_link(e.path()).ok())
                    .filter(|t| t.starts_with(dir))
                    .collect::<std::collections::BTreeSet<_>>()
            };
            assert_eq!(held(p.real.pid()), held(p.fake.pid()), "the same disk files are held open");
            p.exact("PUT", "vm.shutdown", None);
            assert!(held(p.real.pid()).is_empty() && held(p.fake.pid()).is_empty(), "closed at vm.shutdown");
        }
        p.exact("PUT", "vm.delete", None);
    }
}
