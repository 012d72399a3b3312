//! # console — the serial console of an instance
//!
//! QEMU serves the guest's serial port on `<instance dir>/console.sock` (a Unix socket
//! chardev; output is dropped, never blocked, while no client is attached) and appends
//! everything to `<instance dir>/serial.log` across boots ([`crate::hypervisor::qemu`]).
//!
//! - [`rotate`] keeps each log under `console_log_max_bytes`: once a log is larger, it is
//!   copied to [`ROTATED_LOG`] in the instance directory (replacing the previous one; the
//!   VMM never sees that directory) and truncated in place, keeping what arrived during the
//!   copy — QEMU holds it open with `O_APPEND`, so its next write lands at the new end. The
//!   agent runs it every [`ROTATE_EVERY`]: the two files stay within about twice the cap
//!   plus what a guest writes between two checks. The log is the VMM's to write but the
//!   agent's file: anything else at its name is never read ([`crate::own_file`]).
//! - [`attach`] is `gpuvisor console NAME`: the terminal in raw mode, bytes both ways, and
//!   the escape byte [`ESCAPE`] (`^]`, as `virsh console`) detaches.
//! - One session per console, as `virsh console`: QEMU serves one client and leaves a
//!   second one waiting in its backlog, a dead session. A session holds the abstract Unix
//!   socket [`session_name`] (the kernel frees it with the process, so a killed client
//!   leaves nothing): a second `gpuvisor console` is refused, naming the first's pid (the
//!   socket's peer credentials), or with `--force` asks the first to detach over that
//!   socket ([`ask_to_detach`]: it restores its terminal, says who took over and exits)
//!   and takes over. A connection that is not a `gpuvisor console` (e.g. `socat`) refuses
//!   any session while it lasts ([`crate::host::proc::unix_connections_at`]).

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// How often the agent checks the console logs' sizes.
pub const ROTATE_EVERY: Duration = Duration::from_millis(500);

/// `^]`: detaches `gpuvisor console`.
pub const ESCAPE: u8 = 0x1d;

/// The rotated console log's file name, in the instance directory.
pub const ROTATED_LOG: &str = "serial.log.1";

/// Rotates `<vmm_dir>/serial.log` when it is larger than `max` bytes: its first `len` bytes
/// (as seen at the check) go to `<rotated_dir>/`[`ROTATED_LOG`] (through a temp file in the
/// agent's private directory and a rename, so the previous copy is replaced whole, and so is
/// whatever else sits at that name — a directory left from the old layout included); what
/// the guest wrote meanwhile is read back, the log truncated and that tail appended again —
/// only output written between that read and the truncation (a few microseconds) can be
/// lost. Returns whether it rotated.
///
/// The VMM directory is writable by the VMM, so the log is used only when it is the
/// agent's own file ([`crate::own_file::open`]: never a link, a FIFO or a file of the VMM's).
/// Errors: something else sits at the log's name (the error says what), or I/O.
pub fn rotate(vmm_dir: &Path, rotated_dir: &Path, max: u64) -> io::Result<bool> {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::OpenOptionsExt;
    let log = crate::hypervisor::SERIAL_LOG;
    let mut src = match crate::own_file::open(vmm_dir, log, true)? {
        Ok(f) => f,
        Err(crate::own_file::Entry::Missing) => return Ok(false),
        Err(other) => return Err(crate::own_file::foreign_error(vmm_dir, log, &other)),
    };
    let len = src.metadata()?.len();
    if len <= max {
        return Ok(false);
    }
    let dest = rotated_dir.join(ROTATED_LOG);
    let tmp = crate::hypervisor::confine::staging_path(&dest)?;
    let copied = (|| {
        let mut out = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o640).open(&tmp)?;
        io::copy(&mut (&mut src).take(len), &mut out)?;
        if let crate::own_file::Entry::Foreign(_) = crate::own_file::inspect(rotated_dir, ROTATED_LOG)? {
            crate::own_file::remove(rotated_dir, ROTATED_LOG)?;
        }
        std::fs::rename(&tmp, &dest)
    })();
    if let Err(e) = copied {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    let mut tail = Vec::new();
    src.seek(SeekFrom::Start(len))?;
    src.read_to_end(&mut tail)?;
    src.set_len(0)?;
    src.write_all(&tail)?;
    Ok(true)
}

/// The name (abstract namespace) of the socket a console session of instance `id` holds.
pub fn session_name(id: &str) -> String {
    format!("gpuvisor-console-{id}")
}

/// The session socket's name as `/proc/net/unix` prints it (`@` + the abstract name).
pub fn session_path(id: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("@{}", session_name(id)))
}

fn session_addr(id: &str) -> io::Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(session_name(id).as_bytes())
}

/// What a `--force` newcomer sends the session holder.
const TAKEOVER: &[u8] = b"takeover\n";

/// Why a console session could not be taken.
#[derive(Debug)]
pub enum SessionError {
    /// Another session holds it (its pid, when the socket's peer credentials say).
    Held {
        /// The holder's pid, from the socket's peer credentials; `None` when they cannot be
        /// read.
        pid: Option<i32>,
    },
    /// The session socket could not be bound or reached.
    Io(io::Error),
}

/// Takes the console session of instance `id`: binds (and listens on) its abstract socket
/// for as long as the returned listener lives. Errors: [`SessionError::Held`] while another
/// session holds it.
pub fn take_session(id: &str) -> Result<std::os::unix::net::UnixListener, SessionError> {
    match std::os::unix::net::UnixListener::bind_addr(&session_addr(id).map_err(SessionError::Io)?) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            let pid = UnixStream::connect_addr(&session_addr(id).map_err(SessionError::Io)?)
                .ok()
                .and_then(|s| nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials).ok())
                .map(|c| c.pid());
            Err(SessionError::Held { pid })
        }
        Err(e) => Err(SessionError::Io(e)),
    }
}

/// Asks the session holding the console of instance `id` to detach.
pub fn ask_to_detach(id: &str) -> io::Result<()> {
    UnixStream::connect_addr(&session_addr(id)?)?.write_all(TAKEOVER)
}

/// In the session's holder: a thread that waits for [`ask_to_detach`]; on it, puts the
/// terminal back, prints `notice` and ends the process (exit 0).
pub fn serve_takeovers(session: std::os::unix::net::UnixListener, notice: String) {
    std::thread::spawn(move || {
        for conn in session.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; TAKEOVER.len()];
            if conn.read_exact(&mut buf).is_ok() && buf == TAKEOVER {
                restore_terminal();
                eprint!("\r\n{notice}\r\n");
                std::process::exit(0);
            }
        }
    });
}

/// The terminal attributes of stdin before raw mode, to put back on any way out (a
/// detach, or the SIGTERM of a `--force` takeover).
static SAVED_TERMIOS: std::sync::Mutex<Option<nix::sys::termios::Termios>> = std::sync::Mutex::new(None);

/// Puts the terminal back as it was before [`attach`] (nothing if it never changed it).
pub fn restore_terminal() {
    let saved = SAVED_TERMIOS.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(t) = saved {
        let _ = nix::sys::termios::tcsetattr(io::stdin(), nix::sys::termios::SetArg::TCSANOW, &t);
    }
}

/// Stdin in raw mode, restored on drop.
struct RawMode;

impl RawMode {
    fn enter() -> RawMode {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = io::stdin();
        let Ok(saved) = tcgetattr(&stdin) else { return RawMode };
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        if tcsetattr(&stdin, SetArg::TCSANOW, &raw).is_ok() {
            *SAVED_TERMIOS.lock().unwrap_or_else(|p| p.into_inner()) = Some(saved);
        }
        RawMode
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore_terminal();
    }
}

/// Why [`attach`] ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Detach {
    /// The user typed [`ESCAPE`].
    Escape,
    /// stdin ended.
    EndOfInput,
    /// The VMM closed the console (the VM stopped).
    Closed,
}

/// Attaches the terminal to the console socket until the escape byte, the end of stdin,
/// or the VMM closing it. Errors: the socket cannot be connected (the VM is not running,
/// or another client is attached).
pub fn attach(socket: &Path) -> io::Result<Detach> {
    // Only the VMM's own socket (never a link it planted to another VMM's console).
    let stream: UnixStream = crate::own_file::connect(socket)?;
    let mut reader = stream.try_clone()?;
    let (tx, rx) = std::sync::mpsc::channel::<Detach>();
    let closed = tx.clone();
    std::thread::spawn(move || {
        let mut out = io::stdout();
        let mut buf = [0u8; 4096];
        loop {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if out.write_all(&buf[..n]).and_then(|_| out.flush()).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = closed.send(Detach::Closed);
    });
    let _raw = RawMode::enter();
    let mut writer = stream;
    std::thread::spawn(move || {
        let mut stdin = io::stdin();
        let mut buf = [0u8; 1024];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let (data, escape) = match buf[..n].iter().position(|b| *b == ESCAPE) {
                        Some(i) => (&buf[..i], true),
                        None => (&buf[..n], false),
                    };
                    if writer.write_all(data).is_err() {
                        let _ = tx.send(Detach::Closed);
                        return;
                    }
                    if escape {
                        let _ = tx.send(Detach::Escape);
                        return;
                    }
                }
            }
        }
        let _ = tx.send(Detach::EndOfInput);
    });
    Ok(rx.recv().unwrap_or(Detach::Closed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_over_its_cap_is_copied_and_truncated_and_appends_go_on_at_the_start() {
        let d = tempfile::tempdir().unwrap();
        let (inst, vmm) = (d.path(), d.path().join("vmm"));
        std::fs::create_dir(&vmm).unwrap();
        let log = vmm.join("serial.log");
        let rotated = inst.join(ROTATED_LOG);
        // The writer keeps an O_APPEND fd, as QEMU's logappend does.
        let mut w = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        w.write_all(&[b'a'; 100]).unwrap();
        assert!(!rotate(&vmm, inst, 100).unwrap(), "at the cap: kept");
        w.write_all(b"b").unwrap();
        assert!(rotate(&vmm, inst, 100).unwrap());
        assert_eq!(std::fs::read(&rotated).unwrap().len(), 101);
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        w.write_all(b"after").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"after", "no hole: the writer appends at the new end");
        // A second rotation replaces the copy.
        w.write_all(&[b'c'; 200]).unwrap();
        assert!(rotate(&vmm, inst, 100).unwrap());
        assert_eq!(std::fs::read(&rotated).unwrap().len(), 205);
        assert!(!rotate(&inst.join("none"), inst, 1).is_ok_and(|r| r), "no log: nothing to do");
    }

    /// Finding 8: a directory where the rotated log goes no longer stops the rotation, and a
    /// log that is not the agent's own is never read.
    #[test]
    fn a_directory_at_the_rotated_name_is_replaced_and_a_planted_log_refused() {
        let d = tempfile::tempdir().unwrap();
        let (inst, vmm) = (d.path(), d.path().join("vmm"));
        std::fs::create_dir(&vmm).unwrap();
        std::fs::create_dir_all(inst.join(ROTATED_LOG).join("x")).unwrap();
        std::fs::write(vmm.join("serial.log"), [b'a'; 200]).unwrap();

        assert!(rotate(&vmm, inst, 100).unwrap());
        assert_eq!(std::fs::read(inst.join(ROTATED_LOG)).unwrap().len(), 200);

        let secret = d.path().join("secret");
        std::fs::write(&secret, [b's'; 300]).unwrap();
        std::fs::remove_file(vmm.join("serial.log")).unwrap();
        std::os::unix::fs::symlink(&secret, vmm.join("serial.log")).unwrap();
        let e = rotate(&vmm, inst, 100).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link, not the agent's own file"), "{e}");
        assert_eq!(std::fs::read(inst.join(ROTATED_LOG)).unwrap().len(), 200, "the secret was not copied");
        assert_eq!(std::fs::read(&secret).unwrap().len(), 300, "nor truncated");
    }
}
