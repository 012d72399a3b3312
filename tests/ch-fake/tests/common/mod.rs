//! Helpers for the tests: start a VMM binary (the fake, or the real Cloud Hypervisor) on a
//! socket in a temporary directory, talk HTTP/1.1 to it with a tiny raw client, and wait
//! for events (socket appears, process exits, a stderr line, a log line) with deadlines.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Upper bound for any event: generous, for a loaded 2-core machine.
pub const DEADLINE: Duration = Duration::from_secs(20);
/// How often the wait loops look again (a poll interval, not a synchronisation).
const POLL: Duration = Duration::from_millis(10);

pub const FAKE: &str = env!("CARGO_BIN_EXE_cloud-hypervisor-fake");

/// Polls `check` until it gives a value or the deadline passes.
pub fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(Instant::now() < end, "timed out after {DEADLINE:?} waiting for {what}");
        std::thread::sleep(POLL);
    }
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// The error array of an error answer.
    pub fn errors(&self) -> Vec<String> {
        serde_json::from_value(self.json()).unwrap_or_else(|e| panic!("not an error array ({e}): {}", self.json()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl std::fmt::Debug for Resp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.text())
    }
}

/// One HTTP/1.1 connection (keep-alive), requests answered in order.
pub struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl Conn {
    pub fn open(socket: &Path) -> std::io::Result<Conn> {
        let stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(DEADLINE))?;
        Ok(Conn { stream, buf: Vec::new() })
    }

    pub fn send(&mut self, method: &str, path: &str, body: Option<&str>) -> std::io::Result<()> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n");
        if let Some(body) = body {
            req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
        }
        req.push_str("\r\n");
        req.push_str(body.unwrap_or(""));
        self.stream.write_all(req.as_bytes())
    }

    /// Sends a request with `fds` passed as SCM_RIGHTS on its first (single) sendmsg.
    pub fn send_with_fds(&mut self, method: &str, path: &str, body: &str, fds: &[i32]) -> std::io::Result<()> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        use std::os::fd::AsRawFd;
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let iov = [std::io::IoSlice::new(req.as_bytes())];
        let cmsgs = [ControlMessage::ScmRights(fds)];
        let sent = sendmsg::<()>(self.stream.as_raw_fd(), &iov, &cmsgs, MsgFlags::empty(), None)?;
        assert_eq!(sent, req.len(), "short sendmsg");
        Ok(())
    }

    /// Reads one response; `timeout` bounds the whole read.
    pub fn receive(&mut self, timeout: Duration) -> std::io::Result<Resp> {
        let end = Instant::now() + timeout;
        let head_end = loop {
            if let Some(at) = find(&self.buf, b"\r\n\r\n") {
                break at;
            }
            self.fill(end)?;
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
            .collect();
        let length = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse::<usize>().ok())
            .unwrap_or(0);
        let start = head_end + 4;
        while self.buf.len() < start + length {
            self.fill(end)?;
        }
        let body = self.buf[start..start + length].to_vec();
        self.buf.drain(..start + length);
        Ok(Resp { status, headers, body })
    }

    fn fill(&mut self, end: Instant) -> std::io::Result<()> {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "no answer in time"));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut chunk = [0u8; 4096];
        match self.stream.read(&mut chunk) {
            Ok(0) => Err(std::io::Error::new(ErrorKind::UnexpectedEof, "connection closed")),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(())
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(std::io::Error::new(ErrorKind::TimedOut, "no answer in time"))
            }
            Err(e) => Err(e),
        }
    }

    pub fn request(&mut self, method: &str, path: &str, body: Option<&str>) -> std::io::Result<Resp> {
        self.send(method, path, body)?;
        self.receive(DEADLINE)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A running VMM process (fake or real) with its socket in a temporary directory.
pub struct Vmm {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    stderr: Arc<Mutex<Vec<String>>>,
    status: Option<ExitStatus>,
}

pub struct Start<'a> {
    pub binary: &'a Path,
    pub dir: Option<tempfile::TempDir>,
    pub args: Vec<String>,
    pub env: Vec<(String, PathBuf)>,
    pub wait_socket: bool,
}

impl<'a> Start<'a> {
    pub fn new(binary: &'a Path) -> Start<'a> {
        Start { binary, dir: None, args: Vec::new(), env: Vec::new(), wait_socket: true }
    }

    pub fn fake() -> Start<'static> {
        Start::new(Path::new(FAKE))
    }

    pub fn env(mut self, key: &str, value: impl Into<PathBuf>) -> Self {
        self.env.push((key.to_string(), value.into()));
        self
    }

    pub fn in_dir(mut self, dir: tempfile::TempDir) -> Self {
        self.dir = Some(dir);
        self
    }

    /// Extra arguments; without any, `--api-socket path=<dir>/api.sock` is passed.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args = args.iter().map(|s| s.to_string()).collect();
        self
    }

    pub fn spawn(self) -> Vmm {
        let dir = self.dir.unwrap_or_else(|| tempfile::tempdir().expect("tempdir"));
        let socket = dir.path().join("api.sock");
        let args = if self.args.is_empty() {
            vec!["--api-socket".to_string(), format!("path={}", socket.display())]
        } else {
            self.args.iter().map(|a| a.replace("{socket}", &socket.to_string_lossy())).collect()
        };
        let mut cmd = Command::new(self.binary);
        cmd.args(&args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        cmd.env_remove("CH_FAKE_CONTROL").env_remove("CH_FAKE_LOG");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawning {}: {e}", self.binary.display()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let pipe = child.stderr.take().expect("stderr pipe");
        let lines = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        let mut vmm = Vmm { child, dir, socket, stderr, status: None };
        if self.wait_socket {
            vmm.wait_socket();
        }
        vmm
    }
}

impl Vmm {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until the socket accepts connections (fails if the process exits first).
    pub fn wait_socket(&mut self) {
        let socket = self.socket.clone();
        wait_for("the API socket", || {
            if let Some(status) = self.try_status() {
                panic!("the VMM exited ({status}) before its socket appeared; stderr: {:?}", self.stderr());
            }
            UnixStream::connect(&socket).ok().map(drop)
        });
    }

    pub fn conn(&self) -> Conn {
        Conn::open(&self.socket).unwrap_or_else(|e| panic!("connect {}: {e}", self.socket.display()))
    }

    /// One request on a fresh connection.
    pub fn req(&self, method: &str, endpoint: &str, body: Option<&str>) -> Resp {
        let path = if endpoint.starts_with('/') { endpoint.to_string() } else { format!("/api/v1/{endpoint}") };
        self.conn().request(method, &path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    pub fn get(&self, endpoint: &str) -> Resp {
        self.req("GET", endpoint, None)
    }

    pub fn put(&self, endpoint: &str, body: Option<&str>) -> Resp {
        self.req("PUT", endpoint, body)
    }

    /// A PUT with `fds` passed as SCM_RIGHTS, on a fresh connection.
    pub fn put_fds(&self, endpoint: &str, body: &str, fds: &[i32]) -> Resp {
        let path = format!("/api/v1/{endpoint}");
        let mut conn = self.conn();
        conn.send_with_fds("PUT", &path, body, fds).unwrap_or_else(|e| panic!("PUT {path}: {e}"));
        conn.receive(DEADLINE).unwrap_or_else(|e| panic!("PUT {path}: {e}"))
    }

    /// What the process's fd `n` is (the target of `/proc/<pid>/fd/<n>`).
    pub fn fd_target(&self, n: i64) -> Option<PathBuf> {
        std::fs::read_link(format!("/proc/{}/fd/{n}", self.pid())).ok()
    }

    /// The open fds of the process that point to `path`, with their `flags` (octal).
    pub fn fds_on(&self, path: &Path) -> Vec<(i64, u32)> {
        let dir = format!("/proc/{}/fd", self.pid());
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let Ok(n) = entry.file_name().to_string_lossy().parse::<i64>() else { continue };
            if std::fs::read_link(entry.path()).ok().as_deref() == Some(path) {
                let info = std::fs::read_to_string(format!("/proc/{}/fdinfo/{n}", self.pid())).unwrap_or_default();
                let flags = info
                    .lines()
                    .find_map(|l| l.strip_prefix("flags:"))
                    .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
                    .unwrap_or(0);
                out.push((n, flags));
            }
        }
        out
    }

    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("try_wait");
        }
        self.status
    }

    /// Waits for the process to exit (reaped with waitpid through `Child`).
    pub fn wait_exit(&mut self) -> ExitStatus {
        wait_for("the VMM to exit", || self.try_status())
    }

    pub fn stderr(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    pub fn wait_stderr(&self, needle: &str) {
        wait_for(&format!("{needle:?} on stderr"), || self.stderr().iter().any(|l| l.contains(needle)).then_some(()))
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid() as i32), signal).expect("kill");
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        if self.try_status().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Writes a file atomically (temporary file + rename), as a running fake may read it.
pub fn write_atomic(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// A VmConfig with a kernel file that exists (the fake only opens it).
pub fn minimal_config(dir: &Path) -> String {
    let kernel = dir.join("vmlinuz");
    if !kernel.exists() {
        std::fs::write(&kernel, b"not really a kernel").expect("kernel");
    }
    serde_json::json!({"payload": {"kernel": kernel}, "memory": {"size": 134217728u64}}).to_string()
}

/// A minimal qcow2 file: the header's magic, version 3, and (optionally) a backing file name.
pub fn write_qcow2(path: &Path, backing: Option<&str>) {
    let mut bytes = vec![0u8; 1024];
    bytes[..4].copy_from_slice(b"QFI\xfb");
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    if let Some(name) = backing {
        bytes[8..16].copy_from_slice(&512u64.to_be_bytes());
        bytes[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        bytes[512..512 + name.len()].copy_from_slice(name.as_bytes());
    }
    std::fs::write(path, bytes).expect("qcow2");
}
