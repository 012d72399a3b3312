//! NICs (docs/api.md "NICs"), against the real agent and QEMU: a `user` NIC with
//! `restrict=on` gets its address by DHCP and a forwarded host port on 127.0.0.1 reaches the
//! guest's listener; a `bridge` NIC, in a network namespace the test makes (a bridge with an
//! address, dnsmasq on it), gets its lease from dnsmasq and answers a ping, and its tap is
//! there while the VM runs and gone after a stop, after a QEMU crash plus a reconcile pass,
//! and (a persistent leftover of a gpuvisor name) after a reconcile pass; bad NICs are
//! refused with the field named and leave nothing behind.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::process::Stdio;
use std::time::Duration;

const BOOT: Duration = Duration::from_secs(120);

/// A port nobody listens on now (the kernel's pick for an ephemeral bind).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `GET /` on 127.0.0.1:`port`: the body, or `None` while it does not answer.
fn http_get(port: u16) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET / HTTP/1.0\r\nHost: guest\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.contains("200 OK").then_some(out)
}

#[test]
fn a_user_nic_gets_dhcp_and_a_forwarded_port_reaches_the_guest_listener() {
    let a = Agent::start(HOST_V).unwrap();
    let port = free_port();
    let v = a.ok(
        "instance.create",
        json!({"name": "web", "image": "demo",
               "nics": [{"mode": "user", "forwards": [{"host_port": port, "guest_port": 8080}]}]}),
    );
    let id = v["id"].as_str().unwrap().to_string();
    let nic = &v["nics"][0];
    assert_eq!(nic["mode"], "user", "{v}");
    assert_eq!(nic["forwards"][0]["host_addr"], "127.0.0.1", "{v}");
    let mac = nic["mac"].as_str().unwrap().to_string();
    assert!(mac.starts_with("52:54:00:"), "{mac}");
    let log = a.wait_serial(&v, "gpuvisor-guest: listening 8080", BOOT).unwrap();
    assert!(log.contains("gpuvisor-guest: net eth0 10.0.2.15/24"), "{log}");
    assert!(log.contains("gpuvisor-guest: hostname web"), "the seed names it: {log}");
    let cmd = a.qemu_cmdline(&id);
    assert!(cmd.contains(&format!("user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:{port}-:8080")), "{cmd}");
    assert!(cmd.contains(&format!("mac={mac}")), "{cmd}");

    let answer = wait_for(Duration::from_secs(30), || http_get(port)).expect("the forwarded port answers");
    assert!(answer.contains("gpuvisor-guest web"), "{answer}");
    // A user NIC has no counters gpuvisor can read: null, never zeros.
    let st = a.ok("instance.stats", json!({"ref": "web"}));
    assert_eq!(
        st["nics"],
        json!([{"mode": "user", "tap": null, "rx_bytes": null, "tx_bytes": null,
                                   "rx_packets": null, "tx_packets": null}]),
        "{st}"
    );
    assert_eq!(st["disks"][0]["id"], "seed", "the seed is its only disk: {st}");

    // The MAC is stable across a restart.
    a.ok("instance.stop", json!({"ref": "web"}));
    let v = a.ok("instance.start", json!({"ref": "web"}));
    assert_eq!(v["nics"][0]["mac"], mac.as_str());
    assert!(a.qemu_cmdline(&id).contains(&format!("mac={mac}")));
    a.ok("instance.delete", json!({"ref": "web"}));
}

fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

#[test]
fn a_bridge_nic_gets_a_lease_answers_ping_and_its_tap_never_outlives_the_vm() {
    let mut a = Agent::start(HOST_V).unwrap();
    let net = NetNs::new(&a);
    let mut net = net;
    net.ok("ip", &["link", "set", "lo", "up"]);
    net.ok("ip", &["link", "add", "gvtbr", "type", "bridge"]);
    net.ok("ip", &["addr", "add", "10.77.0.1/24", "dev", "gvtbr"]);
    net.ok("ip", &["link", "set", "gvtbr", "up"]);
    let leases = a.dir.path().join("dnsmasq.leases");
    let pidfile = a.dir.path().join("dnsmasq.pid");
    let dnsmasq_log = std::fs::File::create(a.dir.path().join("dnsmasq.log")).unwrap();
    net.dnsmasq = Some(
        net.cmd("dnsmasq")
            .args(["--keep-in-foreground", "--no-resolv", "--no-hosts", "--conf-file=/dev/null", "--port=0"])
            .args(["--user=root", "--interface=gvtbr", "--bind-interfaces", "--log-dhcp"])
            .args(["--dhcp-range=10.77.0.10,10.77.0.50,255.255.255.0,1h", "--log-facility=-"])
            .arg(format!("--dhcp-leasefile={}", leases.display()))
            .arg(format!("--pid-file={}", pidfile.display()))
            .stdin(Stdio::null())
            .stdout(dnsmasq_log.try_clone().unwrap())
            .stderr(dnsmasq_log)
            .spawn()
            .unwrap(),
    );
    // The agent again, now inside the namespace.
    a.move_into(&net);

    // A bridge that is missing, and an interface that is not a bridge, are refused at create
    // with nothing left behind.
    for (bridge, says) in [("gvtnope", "does not exist"), ("lo", "is not a bridge")] {
        let e = a.err(
            "instance.create",
            json!({"name": "b", "image": "demo", "nics": [{"mode": "bridge", "bridge": bridge}]}),
        );
        assert_eq!(e.data_code, "invalid_request", "{e:?}");
        assert!(e.message.contains("nics[0].bridge") && e.message.contains(says), "{e:?}");
    }
    assert!(a.instance_names().is_empty());

    let v =
        a.ok("instance.create", json!({"name": "b", "image": "demo", "nics": [{"mode": "bridge", "bridge": "gvtbr"}]}));
    let id = v["id"].as_str().unwrap().to_string();
    let tap = v["nics"][0]["tap"].as_str().unwrap().to_string();
    let mac = v["nics"][0]["mac"].as_str().unwrap().to_string();
    assert_eq!(tap, format!("gv{}0", &id.replace('-', "")[..8]));
    let log = a.wait_serial(&v, "gpuvisor-guest: ready", BOOT).unwrap();
    let line =
        log.lines().find(|l| l.starts_with("gpuvisor-guest: net eth0 ")).unwrap_or_else(|| panic!("no lease: {log}"));
    let addr = line["gpuvisor-guest: net eth0 ".len()..].trim().to_string();
    assert!(addr.starts_with("10.77.0.") && addr.ends_with("/24"), "{addr}");
    let ip = addr.trim_end_matches("/24");
    wait_for(Duration::from_secs(10), || {
        let leased = std::fs::read_to_string(&leases).unwrap_or_default();
        (leased.contains(&mac) && leased.contains(ip)).then_some(())
    })
    .unwrap_or_else(|| panic!("dnsmasq leased {ip} to {mac}: {:?}", std::fs::read_to_string(&leases)));
    let ping = net.run("busybox", &["ping", "-c", "1", "-W", "5", ip]);
    assert!(ping.status.success(), "the guest answers a ping: {}", String::from_utf8_lossy(&ping.stdout));
    assert!(net.link_exists(&tap), "the tap exists while the VM runs");
    let master = String::from_utf8_lossy(&net.run("ip", &["-o", "link", "show", "dev", &tap]).stdout).into_owned();
    assert!(master.contains("master gvtbr"), "{master}");
    // The guest's traffic, from its tap (the DHCP exchange and the ping both ways), and the
    // VMM's CPU time and memory.
    let st = a.ok("instance.stats", json!({"ref": "b"}));
    let n = &st["nics"][0];
    assert_eq!((n["mode"].as_str(), n["tap"].as_str()), (Some("bridge"), Some(tap.as_str())), "{st}");
    for k in ["rx_packets", "tx_packets", "rx_bytes", "tx_bytes"] {
        assert!(n[k].as_u64().is_some_and(|v| v > 0), "{k}: {st}");
    }
    assert!(st["cpu_ms"].as_u64().is_some_and(|v| v > 0), "{st}");
    assert!(st["rss_bytes"].as_u64().is_some_and(|v| v > 1 << 20), "{st}");
    assert_eq!(st["unavailable"], json!([]), "{st}");

    // Stop: the tap is gone.
    a.ok("instance.stop", json!({"ref": "b"}));
    assert!(!net.link_exists(&tap), "the tap is gone after stop");

    // Start again, then a crash: SIGKILL QEMU; after a reconcile pass the record is stopped
    // and the tap gone.
    let v = a.ok("instance.start", json!({"ref": "b"}));
    let serial = v["serial_log"].as_str().unwrap().to_string();
    wait_for(BOOT, || {
        let log = std::fs::read_to_string(&serial).unwrap_or_default();
        (count(&log, "gpuvisor-guest: ready") == 2).then_some(())
    })
    .expect("the second boot is ready");
    assert!(net.link_exists(&tap));
    let q: Vec<LiveQemu> =
        a.live_qemus().into_iter().filter(|q| q.instance_id.as_deref() == Some(id.as_str())).collect();
    assert_eq!(q.len(), 1);
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(q[0].pid), nix::sys::signal::Signal::SIGKILL);
    // Until every thread has exited, a killed QEMU counts as alive: wait until the view
    // shows no live VMM.
    wait_for(Duration::from_secs(30), || a.ok("instance.get", json!({"ref": "b"}))["vmm"].is_null().then_some(()))
        .expect("QEMU is gone");
    let report = a.pass();
    let got = a.ok("instance.get", json!({"ref": "b"}));
    assert_eq!(got["state"], "stopped", "{got}\n{report}\n{}", tail(&a.log(), 30));
    assert!(!net.link_exists(&tap), "the tap is gone after a QEMU crash and a reconcile pass");

    // A leftover of a gpuvisor name (a persistent tap, as a crashed older tool could leave)
    // is removed by the next pass, while a tap of another name stays.
    net.ok("ip", &["tuntap", "add", "dev", &tap, "mode", "tap"]);
    net.ok("ip", &["tuntap", "add", "dev", "othertap0", "mode", "tap"]);
    let report = a.pass();
    assert!(report["taps_removed"].as_array().is_some_and(|t| t.contains(&Value::from(tap.as_str()))), "{report}");
    assert!(!net.link_exists(&tap));
    assert!(net.link_exists("othertap0"), "a tap gpuvisor did not name is never touched");

    a.ok("instance.delete", json!({"ref": "b"}));
    assert!(!net.link_exists(&tap));
}

#[test]
fn bad_nics_are_refused_naming_the_field_and_leave_nothing_behind() {
    let a = Agent::start(HOST_V).unwrap();
    let create = |nics: Value| a.call("instance.create", json!({"name": "bad", "image": "demo", "nics": nics}));
    let cases: Vec<(Value, &str)> = vec![
        (json!([{"mode": "user", "forwards": [{"host_port": 0, "guest_port": 80}]}]), "nics[0].forwards[0].host_port"),
        (json!([{"mode": "user", "forwards": [{"host_port": 80, "guest_port": 70000}]}]), "guest_port"),
        (
            json!([{"mode": "user", "forwards": [{"host_port": 8080, "guest_port": 80}]},
                   {"mode": "user", "forwards": [{"host_port": 8080, "guest_port": 81}]}]),
            "forwarded twice",
        ),
        (json!([{"mode": "user", "forwards": [{"host_port": 1, "guest_port": 1, "host_addr": "::1"}]}]), "host_addr"),
        (json!([{"mode": "bridge", "bridge": "bad/name"}]), "nics[0].bridge"),
        (json!([{"mode": "bridge", "bridge": "gvt-missing-br"}]), "does not exist"),
        (json!((0..9).map(|_| json!({"mode": "user"})).collect::<Vec<_>>()), "at most 8"),
    ];
    for (nics, says) in cases {
        let e = create(nics.clone()).unwrap_err();
        assert_eq!(e.data_code, "invalid_request", "{nics}: {e:?}");
        assert!(e.message.contains(says), "{nics}: {e:?}");
    }
    // Shapes serde refuses: an unknown mode, a bridge NIC without its bridge.
    for nics in [json!([{"mode": "macvtap"}]), json!([{"mode": "bridge"}]), json!([{"mode": "user", "ports": []}])] {
        let e = create(nics.clone()).unwrap_err();
        assert_eq!(e.code, -32602, "{nics}: {e:?}");
    }
    let e = create(json!([{"mode": "macvtap"}])).unwrap_err();
    assert!(e.data.to_string().contains("unknown variant `macvtap`"), "the error names the mode: {e:?}");
    // The CLI builds the same request: a bad port is the agent's refusal (exit 1), a bad
    // flag a usage error (exit 2).
    let o = a.cli(&["create", "bad", "--image", "demo", "--nic", "user,fwd=tcp:127.0.0.1:0-:80"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("nics[0].forwards[0].host_port"), "{o:?}");
    let o = a.cli(&["create", "bad", "--image", "demo", "--nic", "macvtap"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(a.instance_names().is_empty(), "nothing listed");
    assert!(a.data_files("instances").is_empty(), "no instance directory: {:?}", a.data_files("instances"));
    assert!(a.qemu_pids().is_empty());
}

/// Issue 18 finding 9: user-NIC forwards the unprivileged VMM could never bind — a host
/// port below `net.ipv4.ip_unprivileged_port_start`, an address that is not this host's,
/// the same port on `0.0.0.0` and `127.0.0.1` — are refused `invalid_request` naming the
/// field before anything is claimed: no sysfs write, no claim, no record.
#[test]
fn forwards_that_can_never_bind_are_refused_before_anything_is_claimed() {
    let a = Agent::start(HOST_V).unwrap();
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start").unwrap();
    let low: u32 = start.trim().parse::<u32>().unwrap().saturating_sub(1).max(1);
    let before = writes(&a.state()).len();
    let cases: Vec<(Value, &str)> = vec![
        (json!([{"mode": "user", "forwards": [{"host_port": low, "guest_port": 80}]}]), "ip_unprivileged_port_start"),
        (
            json!([{"mode": "user", "forwards": [{"host_port": 18080, "guest_port": 80, "host_addr": "192.0.2.77"}]}]),
            "not an address of this host",
        ),
        (
            json!([{"mode": "user", "forwards": [{"host_port": 18081, "guest_port": 80, "host_addr": "0.0.0.0"},
                                                  {"host_port": 18081, "guest_port": 81}]}]),
            "clashes with the same port on 0.0.0.0",
        ),
    ];
    for (nics, says) in cases {
        let e = a.err("instance.create", json!({"name": "f", "image": "demo", "gpu": "L40S-2Q", "nics": nics}));
        assert_eq!((e.code, e.data_code.as_str()), (400, "invalid_request"), "BUG: {nics}: {e}");
        assert!(e.message.contains(says) && e.message.contains("nics[0].forwards["), "{nics}: {e}");
    }
    assert_eq!(writes(&a.state()).len(), before, "no sysfs write");
    assert!(
        a.claims().is_empty() && a.instance_names().is_empty() && a.qemu_pids().is_empty(),
        "nothing claimed or left"
    );
}
