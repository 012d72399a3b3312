//! # serial_relay — the agent's end of a VMM that serves its serial port on a socket
//!
//! A [`SerialPort::Relayed`](crate::hypervisor::SerialPort::Relayed) VMM (Cloud Hypervisor,
//! `serial.mode = Socket`) listens on `<vmm dir>/serial.sock` and serves one client. The
//! agent is that client, for as long as the VMM runs:
//!
//! - everything the guest writes is appended to `<vmm dir>/serial.log` (opened `O_APPEND`,
//!   only when it is the agent's own file, [`crate::own_file`]); being its only writer, the
//!   relay rotates it ([`crate::console::rotate`]) before a write would take it past
//!   `console_log_max_bytes`, so each of `serial.log` and `serial.log.1` stays within the
//!   cap however fast the guest writes;
//! - the agent listens on `<instance dir>/console.sock` (a directory no VMM sees) for
//!   `gpuvisor console`: one client at a time — a newcomer replaces the client before it,
//!   as `gpuvisor console --force` expects; the sessions themselves are arbitrated by the
//!   CLI ([`crate::console`]) — and what it types goes to the VMM;
//! - the relay ends when the VMM closes the serial socket (the VM is gone): the console
//!   socket is removed and [`Relay::is_done`] says so. An agent restart starts a new relay on
//!   the running VMM (`instances::console_logs`); what the guest wrote while no relay was
//!   connected is the VMM's to drop.
//!
//! The VMM's socket is connected only when its listener belongs to the process that bound
//! it ([`crate::own_file::connect`]), never a socket a VMM planted to reach another's.

use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::hypervisor::{CONSOLE_SOCKET, SERIAL_LOG, SERIAL_SOCKET};

/// A running relay.
#[derive(Debug)]
pub struct Relay {
    done: Arc<AtomicBool>,
}

impl Relay {
    /// Whether the VMM closed its serial port (the relay has ended).
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }
}

/// The console client of the moment with the number it was accepted as, shared by the pump
/// (which writes to it), the acceptor (which replaces it) and its input thread (which lets
/// it go when it closes).
type Client = Arc<Mutex<Option<(u64, UnixStream)>>>;

/// Starts relaying the serial port of the VMM whose directory is `vmm_dir` into its log and
/// to `<instance_dir>/console.sock`. `who` names the instance in the log lines.
///
/// Errors: the VMM's serial socket cannot be connected (not there yet, not the VMM's own
/// listener), the log is not the agent's own file, or the console socket cannot be bound.
pub fn start(vmm_dir: &Path, instance_dir: &Path, max_log: u64, who: &str) -> io::Result<Relay> {
    let vmm = crate::own_file::connect(&vmm_dir.join(SERIAL_SOCKET))?;
    let log = open_log(vmm_dir)?;
    let console = instance_dir.join(CONSOLE_SOCKET);
    crate::own_file::remove(instance_dir, CONSOLE_SOCKET)?;
    let listener = UnixListener::bind(&console)?;
    std::fs::set_permissions(&console, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    let bound = std::fs::symlink_metadata(&console)?.ino();
    let done = Arc::new(AtomicBool::new(false));
    let client: Client = Arc::new(Mutex::new(None));

    let to_vmm = vmm.try_clone()?;
    {
        let (client, done, who) = (client.clone(), done.clone(), who.to_string());
        std::thread::Builder::new().name("serial-accept".into()).spawn(move || {
            accept(listener, to_vmm, client, &done);
            // Only the socket this relay bound (a later relay may have bound its own).
            if std::fs::symlink_metadata(&console).map(|m| m.ino() == bound).unwrap_or(false) {
                let _ = std::fs::remove_file(&console);
            }
            tracing::debug!(instance = %who, "serial console relay: console socket closed");
        })?;
    }
    {
        let (done, who, console) = (done.clone(), who.to_string(), instance_dir.join(CONSOLE_SOCKET));
        let log =
            Log { file: log, vmm_dir: vmm_dir.to_path_buf(), rotated_dir: instance_dir.to_path_buf(), max: max_log };
        std::thread::Builder::new().name("serial-pump".into()).spawn(move || {
            let why = pump(vmm, log, &client);
            tracing::debug!(instance = %who, reason = %why, "serial console relay ended");
            done.store(true, Ordering::SeqCst);
            // Wakes the acceptor, which sees `done` and ends.
            let _ = UnixStream::connect(&console);
        })?;
    }
    Ok(Relay { done })
}

/// `<vmm_dir>/serial.log`, appending: the agent's own file, created when missing.
fn open_log(vmm_dir: &Path) -> io::Result<std::fs::File> {
    match crate::own_file::open(vmm_dir, SERIAL_LOG, true)? {
        Ok(f) => Ok(f),
        Err(crate::own_file::Entry::Missing) => std::fs::OpenOptions::new()
            .append(true)
            .create_new(true)
            .mode(0o640)
            .custom_flags(libc::O_NOFOLLOW)
            .open(vmm_dir.join(SERIAL_LOG)),
        Err(other) => Err(crate::own_file::foreign_error(vmm_dir, SERIAL_LOG, &other)),
    }
}

/// The console log as the relay writes it.
struct Log {
    file: std::fs::File,
    vmm_dir: std::path::PathBuf,
    rotated_dir: std::path::PathBuf,
    max: u64,
}

impl Log {
    /// Appends `bytes`, rotating the log first when they would take it past the cap.
    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        let len = self.file.metadata()?.len();
        if len > 0 && len + bytes.len() as u64 > self.max {
            // Rotates when the log is larger than `max - n`: exactly when `n` more bytes
            // would not fit. The file stays the same (truncated in place).
            crate::console::rotate(&self.vmm_dir, &self.rotated_dir, self.max.saturating_sub(bytes.len() as u64))?;
        }
        self.file.write_all(bytes)
    }
}

/// Copies the VMM's output into the log and to the client until the VMM closes the socket.
/// A failing log write is reported once and the output still goes to the client.
fn pump(mut vmm: UnixStream, mut log: Log, client: &Client) -> String {
    let mut buf = [0u8; 8192];
    let mut log_failed = false;
    loop {
        let n = match vmm.read(&mut buf) {
            Ok(0) => return "the VMM closed its serial port".into(),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return format!("reading the VMM's serial port failed: {e}"),
        };
        if let Err(e) = log.append(&buf[..n]) {
            if !log_failed {
                tracing::warn!(error = %e, "the console log cannot be written; the console still works");
                log_failed = true;
            }
        }
        let mut c = crate::sync::lock(client);
        if let Some((_, s)) = c.as_mut() {
            if s.write_all(&buf[..n]).is_err() {
                *c = None;
            }
        }
    }
}

/// Serves `gpuvisor console` clients until `done`: the newest client replaces the one
/// before it, and what it sends goes to the VMM.
fn accept(listener: UnixListener, to_vmm: UnixStream, client: Client, done: &AtomicBool) {
    for (number, conn) in (0u64..).zip(listener.incoming()) {
        if done.load(Ordering::SeqCst) {
            break;
        }
        let Ok(conn) = conn else { continue };
        let Ok(reader) = conn.try_clone() else { continue };
        if let Some((_, old)) = crate::sync::lock(&client).replace((number, conn)) {
            let _ = old.shutdown(std::net::Shutdown::Both);
        }
        let Ok(to_vmm) = to_vmm.try_clone() else { continue };
        let client = client.clone();
        let _ = std::thread::Builder::new().name("serial-input".into()).spawn(move || {
            input(reader, to_vmm);
            // The client went: its slot is free again (unless a newer one took it), so the
            // next `gpuvisor console` finds no connection in its way.
            let mut c = crate::sync::lock(&client);
            if c.as_ref().is_some_and(|(n, _)| *n == number) {
                *c = None;
            }
        });
    }
    if let Some((_, c)) = crate::sync::lock(&client).take() {
        let _ = c.shutdown(std::net::Shutdown::Both);
    }
}

/// Copies what a console client types to the VMM until either side closes.
fn input(mut from: UnixStream, mut to_vmm: UnixStream) {
    let mut buf = [0u8; 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to_vmm.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::time::Duration;

    fn console_socket(inst: &Path) -> PathBuf {
        inst.join(CONSOLE_SOCKET)
    }

    fn read_until(s: &mut UnixStream, want: &str) -> String {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while !String::from_utf8_lossy(&got).contains(want) {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "closed before {want:?}: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    /// A VMM's serial socket (this test is the VMM), the relay, a console client: output
    /// reaches the log and the client, input reaches the VMM, a second client replaces the
    /// first, and the VMM closing the port ends the relay and removes the console socket.
    #[test]
    fn output_goes_to_the_log_and_the_client_input_to_the_vmm_and_the_end_cleans_up() {
        let d = tempfile::tempdir().unwrap();
        let (vmm_dir, inst) = (d.path().join("vmm"), d.path().to_path_buf());
        std::fs::create_dir(&vmm_dir).unwrap();
        let serial = UnixListener::bind(vmm_dir.join(SERIAL_SOCKET)).unwrap();
        let relay = start(&vmm_dir, &inst, 1 << 20, "t").unwrap();
        let (mut guest, _) = serial.accept().unwrap();
        guest.write_all(b"boot line\n").unwrap();
        let mut c1 = UnixStream::connect(console_socket(&inst)).unwrap();
        // Typed input reaching the guest proves the client is attached (the accept is silent).
        c1.write_all(b"typed\n").unwrap();
        read_until(&mut guest, "typed");
        guest.write_all(b"after attach\n").unwrap();
        read_until(&mut c1, "after attach");
        // A second client replaces the first, which is closed.
        let mut c2 = UnixStream::connect(console_socket(&inst)).unwrap();
        c2.write_all(b"second typed\n").unwrap();
        read_until(&mut guest, "second typed");
        guest.write_all(b"to the second\n").unwrap();
        read_until(&mut c2, "to the second");
        let log = std::fs::read_to_string(vmm_dir.join(SERIAL_LOG)).unwrap();
        assert_eq!(log, "boot line\nafter attach\nto the second\n");
        // A client that goes lets its connection go: none stays at the console socket (a
        // `gpuvisor console` refuses to attach while one does), so the next one attaches.
        drop(c2);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let connected = || crate::host::proc::unix_connections_at(&console_socket(&inst)).unwrap();
        while connected() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(connected(), 0, "the relay let the closed client go");
        let mut c3 = UnixStream::connect(console_socket(&inst)).unwrap();
        c3.write_all(b"third\n").unwrap();
        read_until(&mut guest, "third");
        drop(guest);
        drop(serial);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while (!relay.is_done() || console_socket(&inst).exists()) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(relay.is_done());
        assert!(!console_socket(&inst).exists(), "the console socket is removed");
    }

    #[test]
    fn a_log_that_is_not_the_agents_own_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let (vmm_dir, inst) = (d.path().join("vmm"), d.path().to_path_buf());
        std::fs::create_dir(&vmm_dir).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", vmm_dir.join(SERIAL_LOG)).unwrap();
        let _serial = UnixListener::bind(vmm_dir.join(SERIAL_SOCKET)).unwrap();
        let e = start(&vmm_dir, &inst, 1 << 20, "t").unwrap_err();
        assert!(e.to_string().contains("link"), "{e}");
    }

    /// The relay is the log's only writer: it rotates before a write would pass the cap, so
    /// neither file ever holds more than the cap, and nothing is lost across a rotation.
    #[test]
    fn a_flood_keeps_each_log_within_the_cap_and_the_last_lines_whole() {
        let d = tempfile::tempdir().unwrap();
        let (vmm_dir, inst) = (d.path().join("vmm"), d.path().to_path_buf());
        std::fs::create_dir(&vmm_dir).unwrap();
        let serial = UnixListener::bind(vmm_dir.join(SERIAL_SOCKET)).unwrap();
        let max = 64 * 1024;
        let relay = start(&vmm_dir, &inst, max, "t").unwrap();
        let (mut guest, _) = serial.accept().unwrap();
        let mut sent = Vec::new();
        for i in 0..20_000 {
            sent.extend_from_slice(format!("flood {i:06} xxxxxxxxxxxxxxxxxxxxxxxx\n").as_bytes());
        }
        guest.write_all(&sent).unwrap();
        drop(guest);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !relay.is_done() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(relay.is_done());
        let log = std::fs::read(vmm_dir.join(SERIAL_LOG)).unwrap();
        let rotated = std::fs::read(inst.join(crate::console::ROTATED_LOG)).unwrap();
        assert!(log.len() as u64 <= max && rotated.len() as u64 <= max, "{} {}", log.len(), rotated.len());
        // The two files are the last bytes sent, in order.
        let both = [rotated, log].concat();
        assert!(sent.ends_with(&both), "the kept output is the tail of what was sent");
        assert!(both.len() as u64 > max, "more than one file's worth is kept");
    }
}
