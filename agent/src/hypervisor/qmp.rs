//! # hypervisor::qmp — a minimal blocking QMP client
//!
//! QMP is line-delimited JSON over a Unix stream socket (QEMU `docs/interop/qmp-spec`):
//! the server greets with `{"QMP": {...}}`, the client must send `qmp_capabilities` before
//! any other command, and each command gets one `{"return": ...}` or `{"error": {...}}`.
//! Asynchronous `{"event": ...}` lines may arrive at any time and are skipped.
//!
//! Every read and write has a timeout, so a stopped or wedged QEMU cannot block a caller.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

/// Default per-read/per-write timeout of a QMP exchange.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of a QMP exchange.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be connected, read or written (includes timeouts).
    #[error("QMP socket I/O failed")]
    Io(#[from] std::io::Error),
    /// QEMU closed the connection before answering.
    #[error("QEMU closed the QMP connection")]
    Closed,
    /// A line was not the JSON QMP defines.
    #[error("QEMU sent an unexpected QMP message: {0}")]
    Protocol(String),
    /// QEMU answered the command with an error.
    #[error("QEMU refused `{command}`: {class}: {desc}")]
    Command {
        /// The command sent.
        command: String,
        /// QMP error class (e.g. `GenericError`).
        class: String,
        /// QEMU's description.
        desc: String,
    },
}

/// One connected, capability-negotiated QMP session.
#[derive(Debug)]
pub struct QmpClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl QmpClient {
    /// Connects to the QMP socket at `path`, reads the greeting and negotiates
    /// capabilities. `io_timeout` bounds every single read and write.
    ///
    /// Errors: connect/read/write failure or timeout, a greeting that is not QMP, or a
    /// refused `qmp_capabilities`.
    pub fn connect(path: &Path, io_timeout: Duration) -> Result<QmpClient, QmpError> {
        // Only a socket of the VMM's own (never a link it planted to another VMM's).
        let stream: UnixStream = crate::own_file::connect(path)?;
        stream.set_read_timeout(Some(io_timeout))?;
        stream.set_write_timeout(Some(io_timeout))?;
        let writer = stream.try_clone()?;
        let mut client = QmpClient { reader: BufReader::new(stream), writer };
        let greeting = client.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("expected a greeting, got {greeting}")));
        }
        client.execute("qmp_capabilities", None)?;
        Ok(client)
    }

    /// Reads one JSON message (one line).
    fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.reader.read_line(&mut line)?;
            if n == 0 {
                return Err(QmpError::Closed);
            }
            if !line.trim().is_empty() {
                break;
            }
        }
        serde_json::from_str(line.trim()).map_err(|e| QmpError::Protocol(format!("{e}: {}", line.trim())))
    }

    /// Sends `command` (with optional `arguments`) and returns its `return` value, skipping
    /// asynchronous events.
    ///
    /// Errors: I/O or timeout, connection closed, malformed reply, or a QMP `error` reply.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let line = Self::message(command, arguments);
        self.writer.write_all(line.as_bytes())?;
        self.reply(command)
    }

    /// Sends `command` with `fd` attached (`SCM_RIGHTS`, as QMP `getfd` and `add-fd` take a
    /// file descriptor) and returns its `return` value. QEMU keeps its own copy; the
    /// caller's stays open.
    pub fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        use std::os::fd::{AsRawFd, RawFd};
        let line = Self::message(command, arguments);
        let fds: [RawFd; 1] = [fd.as_raw_fd()];
        let iov = [std::io::IoSlice::new(line.as_bytes())];
        let sent =
            sendmsg::<()>(self.writer.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
                .map_err(std::io::Error::from)?;
        // The fd went with the first byte; the rest of a short write goes as plain bytes.
        self.writer.write_all(&line.as_bytes()[sent..])?;
        self.reply(command)
    }

    /// One command line: `{"execute": .., "arguments": ..}` and a newline.
    fn message(command: &str, arguments: Option<Value>) -> String {
        let mut msg = json!({ "execute": command });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut line = msg.to_string();
        line.push('\n');
        line
    }

    /// The reply to `command`, skipping asynchronous events.
    fn reply(&mut self, command: &str) -> Result<Value, QmpError> {
        loop {
            let reply = self.read_message()?;
            if reply.get("event").is_some() {
                continue;
            }
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: field("class"),
                    desc: field("desc"),
                });
            }
            return Err(QmpError::Protocol(reply.to_string()));
        }
    }

    /// `query-status`: the VM's run state (e.g. `running`, `prelaunch`, `paused`, `shutdown`).
    pub fn query_status(&mut self) -> Result<String, QmpError> {
        let ret = self.execute("query-status", None)?;
        ret.get("status")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| QmpError::Protocol(format!("query-status returned {ret}")))
    }

    /// `system_powerdown`: asks the guest to power off (ACPI power button). The guest may
    /// ignore it.
    pub fn system_powerdown(&mut self) -> Result<(), QmpError> {
        self.execute("system_powerdown", None).map(|_| ())
    }

    /// `quit`: asks QEMU to exit now (runs device teardown, including VFIO). QEMU may close
    /// the connection before or after answering; both count as success.
    pub fn quit(&mut self) -> Result<(), QmpError> {
        match self.execute("quit", None) {
            Ok(_) | Err(QmpError::Closed) => Ok(()),
            Err(QmpError::Io(e))
                if matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// `cont`: resumes a VM started paused (`-S`) or stopped.
    pub fn cont(&mut self) -> Result<(), QmpError> {
        self.execute("cont", None).map(|_| ())
    }

    /// `system_reset`: resets the machine in place (the reset button).
    pub fn system_reset(&mut self) -> Result<(), QmpError> {
        self.execute("system_reset", None).map(|_| ())
    }

    /// `stop`: pauses the vCPUs; QEMU drains and flushes every disk before it answers, so
    /// the disk files are consistent with the paused VM.
    pub fn stop(&mut self) -> Result<(), QmpError> {
        self.execute("stop", None).map(|_| ())
    }

    /// Saves the VM's memory and device state into `out` (QEMU's migration stream, `fd:`):
    /// `getfd`, `migrate-set-parameters` (no bandwidth cap: the stream goes to a local
    /// file), `migrate`, then `query-migrate` until `completed` (within `timeout`). The VM
    /// should be paused first ([`QmpClient::stop`]); it stays paused after the save, its disks
    /// inactive until `cont`.
    ///
    /// Errors: QEMU refused a step, the migration `failed` or was `cancelled` (with QEMU's
    /// `error-desc`), or did not complete within `timeout`.
    pub fn save_to(&mut self, out: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> Result<(), QmpError> {
        self.execute_with_fd("getfd", Some(json!({"fdname": SAVE_FD})), out)?;
        self.execute("migrate-set-parameters", Some(json!({"max-bandwidth": UNCAPPED_BYTES_PER_S})))?;
        self.execute("migrate", Some(json!({"uri": format!("fd:{SAVE_FD}")})))?;
        self.wait_migration("migrate", timeout)
    }

    /// Loads a VM state saved by [`QmpClient::save_to`] from `input` into a QEMU started with
    /// `-incoming defer`: `getfd`, `migrate-incoming`, then `query-migrate` until `completed`
    /// (within `timeout`). QEMU starts the vCPUs itself once the state is loaded (unless `-S`).
    pub fn load_from(&mut self, input: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> Result<(), QmpError> {
        self.execute_with_fd("getfd", Some(json!({"fdname": SAVE_FD})), input)?;
        self.execute("migrate-incoming", Some(json!({"uri": format!("fd:{SAVE_FD}")})))?;
        self.wait_migration("migrate-incoming", timeout)
    }

    /// Polls `query-migrate` until the migration `completed`; `failed` and `cancelled` are
    /// errors carrying QEMU's `error-desc`.
    fn wait_migration(&mut self, command: &str, timeout: Duration) -> Result<(), QmpError> {
        let deadline = std::time::Instant::now() + timeout;
        let mut step = Duration::from_millis(5);
        loop {
            let info = self.execute("query-migrate", None)?;
            let status = info.get("status").and_then(Value::as_str).unwrap_or("none");
            match status {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    return Err(QmpError::Command {
                        command: command.to_string(),
                        class: status.to_string(),
                        desc: info.get("error-desc").and_then(Value::as_str).unwrap_or("no reason given").to_string(),
                    })
                }
                _ if std::time::Instant::now() >= deadline => {
                    return Err(QmpError::Command {
                        command: command.to_string(),
                        class: "timeout".into(),
                        desc: format!("the VM state was not {status:?} → completed within {timeout:?}"),
                    })
                }
                _ => {
                    std::thread::sleep(step);
                    step = (step * 2).min(Duration::from_millis(100));
                }
            }
        }
    }
}

/// The name a saved-state fd goes by in QEMU (`getfd`, `fd:<name>`).
const SAVE_FD: &str = "gpuvisor-state";

/// `max-bandwidth` for a save to a local file: QEMU's default (128 MiB/s) throttles it.
const UNCAPPED_BYTES_PER_S: u64 = 1 << 40;
