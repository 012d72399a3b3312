//! The agent as a systemd service (`agent/packaging/gpuvisor.service`, `Type=notify`,
//! `WatchdogSec=`), without systemd: the test plays the service manager's notify socket.
//! The package itself is tested by `scripts/check-package` (dpkg -i, run, purge).

use gpuvisor_e2e::*;
use serde_json::json;
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// The next datagram on `sock`, as text (at most 60 s).
fn next(sock: &UnixDatagram, a: &Agent) -> String {
    let mut buf = [0u8; 4096];
    sock.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    match sock.recv(&mut buf) {
        Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
        Err(e) => panic!("no notification within 60 s ({e}); the agent's log:\n{}", tail(&a.log(), 30)),
    }
}

/// `READY=1` is sent once the startup reconcile pass let creates in (the agent answers
/// `ready`), and `WATCHDOG=1` keeps coming when systemd asks for a watchdog.
#[test]
fn the_agent_tells_systemd_it_is_ready_after_the_startup_pass_and_pings_the_watchdog() {
    let mut a = Agent::start(HOST_V).unwrap();
    let path = a.dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    a.env.push(("NOTIFY_SOCKET".into(), path.display().to_string()));
    a.env.push(("WATCHDOG_USEC".into(), "400000".into()));
    a.kill_agent();
    a.spawn().unwrap();

    let mut seen = Vec::new();
    let ready_at = loop {
        let msg = next(&sock, &a);
        seen.push(msg.clone());
        if msg.lines().any(|l| l == "READY=1") {
            break a.ok("agent.health", json!({}));
        }
        assert!(seen.len() < 100, "no READY=1 among {seen:?}");
    };
    assert_eq!(ready_at["ready"], true, "READY=1 came after the startup pass: {ready_at}");
    assert_eq!(seen.iter().filter(|m| m.contains("READY=1")).count(), 1);
    let pings = (0..3).map(|_| next(&sock, &a)).filter(|m| m.lines().any(|l| l == "WATCHDOG=1")).count();
    assert!(pings >= 2, "watchdog pings keep coming");
    assert!(a.log().contains("pinging the systemd watchdog") && a.log().contains("told systemd: ready"));
}
