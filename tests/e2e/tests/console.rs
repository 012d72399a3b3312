//! The serial console (docs/api.md `console_socket`; `gpuvisor console`), against the real
//! agent and QEMU: a session driven through a pseudo-terminal (type a command, read its
//! output, detach with `^]`), the log appended across boots, and its cap when a guest
//! floods it.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `gpuvisor console NAME` on a pseudo-terminal: the child, the master side to type on,
/// and everything it printed so far.
struct Session {
    child: Child,
    master: std::fs::File,
    out: Arc<Mutex<Vec<u8>>>,
}

impl Session {
    fn open(a: &Agent, name: &str, flags: &[&str]) -> Session {
        let pty = nix::pty::openpty(None, None).expect("openpty");
        let slave: OwnedFd = pty.slave;
        let child = Command::new(agent_binary())
            .arg("--socket")
            .arg(&a.socket)
            .args(["console", name])
            .args(flags)
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave))
            .spawn()
            .expect("gpuvisor console");
        let master = std::fs::File::from(pty.master);
        let out = Arc::new(Mutex::new(Vec::new()));
        let (mut r, sink) = (master.try_clone().unwrap(), out.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Session { child, master, out }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    fn type_line(&mut self, line: &str) {
        self.master.write_all(format!("{line}\r").as_bytes()).unwrap();
    }

    fn wait_for(&self, needle: &str, timeout: Duration) {
        wait_for(timeout, || self.text().contains(needle).then_some(()))
            .unwrap_or_else(|| panic!("{needle:?} never appeared on the console:\n{}", tail(&self.text(), 20)));
    }

    /// Types `^]` and waits for the client to exit; returns its status.
    fn detach(mut self) -> (std::process::ExitStatus, String) {
        self.master.write_all(&[0x1d]).unwrap();
        let st = wait_for(Duration::from_secs(10), || self.child.try_wait().ok().flatten())
            .expect("gpuvisor console exits on ^]");
        (st, self.text())
    }
}

fn boot(a: &Agent, name: &str) -> Value {
    let v = a.ok("instance.create", json!({"name": name, "image": "demo"}));
    a.wait_serial(&v, "gpuvisor-guest: ready", Duration::from_secs(120)).unwrap();
    v
}

fn console_log(a: &Agent, name: &str) -> String {
    let o = a.cli(&["console", name, "--log"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A session through a pseudo-terminal: the command typed runs in the guest's shell, its
/// output comes back, `^]` detaches (exit 0, the VM keeps running); the log has the
/// session and survives a stop and start (appended: two boots).
#[test]
fn a_console_session_runs_a_command_and_detaches_and_the_log_survives_a_restart() {
    let a = Agent::start(HOST_V).unwrap();
    let v = boot(&a, "c");
    assert!(v["console_socket"].as_str().unwrap().ends_with("/console.sock"), "{v}");
    let mut s = Session::open(&a, "c", &[]);
    s.wait_for("escape character is ^]", Duration::from_secs(10));
    s.type_line("");
    s.type_line("echo con-$((6*7))");
    s.wait_for("con-42", Duration::from_secs(60));
    let (st, text) = s.detach();
    assert!(st.success(), "{st}: {text}");
    assert!(text.contains("Detached."), "{text}");
    assert_eq!(a.ok("instance.get", json!({"ref": "c"}))["state"], "running", "detaching leaves the VM running");
    let log = console_log(&a, "c");
    assert!(log.contains("con-42"), "the session is in the log:\n{}", tail(&log, 10));

    a.ok("instance.stop", json!({"ref": "c", "force": true}));
    let e = a.cli(&["console", "c"]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("not running"), "{}", String::from_utf8_lossy(&e.stderr));
    a.ok("instance.start", json!({"ref": "c"}));
    wait_for(Duration::from_secs(120), || {
        (console_log(&a, "c").matches("gpuvisor-guest: ready").count() == 2).then_some(())
    })
    .unwrap_or_else(|| panic!("the second boot is appended:\n{}", tail(&console_log(&a, "c"), 20)));
    let log = console_log(&a, "c");
    assert!(log.contains("con-42"), "the first boot's session is still there");
}

/// A guest flooding its console: the log is rotated to `serial.log.1` whenever it passes
/// `console_log_max_bytes`, so both files stay far below what the guest wrote, and the
/// newest output is at the end of the log.
#[test]
fn a_flooding_guest_keeps_its_console_log_under_the_cap() {
    const CAP: u64 = 16384;
    let a = Agent::start_with(AgentOptions {
        model: HOST_V,
        extra: &format!("console_log_max_bytes = {CAP}\n"),
        ..Default::default()
    })
    .unwrap();
    let v = boot(&a, "f");
    let log = std::path::PathBuf::from(v["serial_log"].as_str().unwrap());
    let mut s = Session::open(&a, "f", &[]);
    s.wait_for("escape character is ^]", Duration::from_secs(10));
    s.type_line("");
    // About 170 KB of output: ten caps.
    s.type_line("i=0; while [ $i -lt 10000 ]; do echo flood-line-$i; i=$((i+1)); done; echo flood-$((1+1))-done");
    s.wait_for("flood-2-done", Duration::from_secs(300));
    let written = s.text().len() as u64;
    let (st, _) = s.detach();
    assert!(st.success());
    assert!(written > 6 * CAP, "the flood wrote {written} bytes");
    // The next check after the flood brings the log under the cap.
    wait_for(Duration::from_secs(10), || (std::fs::metadata(&log).unwrap().len() <= CAP).then_some(()))
        .unwrap_or_else(|| panic!("serial.log stays {} bytes", std::fs::metadata(&log).unwrap().len()));
    let rotated = std::path::PathBuf::from(v["serial_log_rotated"].as_str().unwrap());
    let r = std::fs::metadata(&rotated).expect("serial.log.1").len();
    assert!(r < written / 2, "serial.log.1 is {r} bytes of the {written} written");
    let text = console_log(&a, "f");
    assert!(text.contains("flood-2-done"), "the newest output is kept:\n{}", tail(&text, 5));
    assert!(!text.contains("flood-line-0\r\n"), "the oldest output was rotated away");
}

/// Issue 18 finding 12: one session per console, as `virsh console`. A second `gpuvisor
/// console` is refused (exit 1, naming the first and `--force`) instead of being told
/// "Connected" to a dead session; `--force` detaches the first (which restores its terminal
/// and says who took over) and takes the console.
#[test]
fn a_second_console_client_is_refused_and_force_takes_over() {
    let a = Agent::start(HOST_V).unwrap();
    boot(&a, "c");
    let first = Session::open(&a, "c", &[]);
    first.wait_for("escape character is ^]", Duration::from_secs(10));

    let mut second = Session::open(&a, "c", &[]);
    let st = wait_for(Duration::from_secs(15), || second.child.try_wait().ok().flatten());
    let text = second.text();
    let Some(st) = st else {
        let _ = second.child.kill();
        panic!("BUG: a second client stays attached to a dead session: {text}");
    };
    assert_eq!(st.code(), Some(1), "{text}");
    assert!(!text.contains("Connected"), "{text}");
    assert!(text.contains("another `gpuvisor console`") && text.contains("--force"), "{text}");

    let mut third = Session::open(&a, "c", &["--force"]);
    third.wait_for("escape character is ^]", Duration::from_secs(15));
    first.wait_for("took over", Duration::from_secs(10));
    third.type_line("");
    third.type_line("echo force-$((6*7))");
    third.wait_for("force-42", Duration::from_secs(60));
    let (st, text) = third.detach();
    assert!(st.success(), "{st}: {text}");
}
