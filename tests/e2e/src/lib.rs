//! # gpuvisor end-to-end harness
//!
//! Runs the real `gpuvisor serve` binary against a real `gpuvisor-sim` FUSE mount, with
//! real QEMU guests (TCG) booting the demo image and real wasm plugins. Every [`Agent`]
//! has its own temp directory (data dir, socket, config) and simulated host; dropping it
//! kills the agent, every QEMU it started (found by the data dir in their command line)
//! and unmounts the simulator.
//!
//! Synchronisation is on events (the socket accepting, a line in a guest's serial log, a
//! state change), polled with short steps and a generous bound — never a bare sleep.

pub mod k8s;

use anyhow::{anyhow, bail, Context};
pub use gpuvisor_sim::testing::SimMount;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A temp directory others can traverse and read (mode 0755; `tempfile` makes 0700): the
/// agent's data directory and socket live under it.
pub fn vmm_reachable_tempdir(prefix: &str) -> std::io::Result<tempfile::TempDir> {
    tempdir_with_mode(prefix, 0o755)
}

/// The directory the harness's agents share with every VMM (`vmm_shared_paths`): stand-in
/// VMMs, wrappers, their hooks, pid files and logs live under it
/// ([`vmm_writable_tempdir`]). Mode 01777, as `/tmp`.
pub fn vmm_shared_dir() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let d = std::env::temp_dir().join("gpuvisor-e2e-vmm-shared");
    let _ = std::fs::create_dir_all(&d);
    let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777));
    d
}

/// A temp directory in [`vmm_shared_dir`] that every VMM sees and may write (mode 01777):
/// stand-in VMMs and their hooks, which run under the VMM's own uid, leave their pid files
/// and logs there.
pub fn vmm_writable_tempdir(prefix: &str) -> std::io::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(vmm_shared_dir())?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777))?;
    Ok(dir)
}

/// The `vmm_shared_paths` of the harness's agents (a TOML array): [`vmm_shared_dir`] (the
/// stand-ins), the build's `target/` (the simulator's `ctl` for hooks, the Cloud
/// Hypervisor test server), `../shared/tools` (the real Cloud Hypervisor) and the
/// simulated host `sim` (hooks talk to it). Tests that show the isolation set `[]`.
pub fn harness_shared_paths(sim: &Path) -> String {
    let mut v = vec![vmm_shared_dir(), target_dir().canonicalize().unwrap_or_else(|_| target_dir()), sim.to_path_buf()];
    if let Ok(t) = repo_root().join("../shared/tools").canonicalize() {
        v.push(t);
    }
    format!("[{}]", v.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", "))
}

fn tempdir_with_mode(prefix: &str, mode: u32) -> std::io::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new().prefix(prefix).tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode))?;
    Ok(dir)
}

/// `target/` of this workspace (from the test executable's location).
pub fn target_dir() -> PathBuf {
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(t);
    }
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test-binary>
    exe.parent().and_then(|p| p.parent()).and_then(|p| p.parent()).expect("target dir").to_path_buf()
}

/// The workspace root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent().and_then(|p| p.parent()).expect("profile dir").to_path_buf()
}

/// The `gpuvisor` binary built beside this test.
pub fn agent_binary() -> PathBuf {
    let p = profile_dir().join("gpuvisor");
    assert!(p.is_file(), "{} not built (run `cargo build -p gpuvisor`)", p.display());
    p
}

static BUILD_LOCK: Mutex<()> = Mutex::new(());

/// A default plugin built for wasm32 (built on first use with cargo, which serialises
/// concurrent builds itself).
pub fn plugin(name: &str) -> PathBuf {
    let _g = BUILD_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let wasm = target_dir().join("wasm32-unknown-unknown/release").join(format!("{}.wasm", name.replace('-', "_")));
    if !wasm.is_file() {
        let st = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(repo_root())
            .args(["build", "--release", "--target", "wasm32-unknown-unknown", "-p", name])
            .status()
            .expect("cargo");
        assert!(st.success(), "building plugin {name} failed");
    }
    wasm
}

/// The hostile Python test plugin (`tests/hostile-py`, all three kinds), built by
/// `scripts/build-plugins`.
pub fn hostile_py() -> PathBuf {
    let p = target_dir().join("hostile-py/hostile-py.wasm");
    assert!(p.is_file(), "{} is missing: run scripts/build-plugins", p.display());
    p
}

/// The `gpuvisor` CLI with `--socket` naming no agent, for its local commands (`plugin
/// test`, `host check`, ...) and for the answer when no agent runs.
pub fn cli_alone_command() -> Command {
    let mut c = Command::new(agent_binary());
    c.arg("--socket").arg("/nonexistent/gpuvisor-e2e/gpuvisor.sock");
    c
}

/// Runs [`cli_alone_command`] with `args`.
pub fn cli_alone(args: &[&str]) -> std::process::Output {
    cli_alone_command().args(args).output().expect("gpuvisor cli")
}

/// A test fixture plugin (`tests/plugins/<file>`, WAT text).
pub fn fixture_plugin(file: &str) -> PathBuf {
    repo_root().join("tests/plugins").join(file)
}

/// The demo image directory, brought up to date by `scripts/build-image` once per test
/// process (it does nothing when the image is newer than its sources, so a changed
/// `scripts/guest/*` is never tested against a stale image).
pub fn demo_image() -> PathBuf {
    static CHECKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let _g = BUILD_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let dir = target_dir().join("images/demo");
    if !CHECKED.swap(true, std::sync::atomic::Ordering::SeqCst) || !dir.join("image.toml").is_file() {
        let st = Command::new(repo_root().join("scripts/build-image")).arg(&dir).status().expect("build-image");
        assert!(st.success(), "scripts/build-image failed");
    }
    dir
}

/// The demo disk image directory (`disk.qcow2`, `image.toml`; built by
/// `scripts/build-image` next to the demo image on first use).
pub fn demo_disk_image() -> PathBuf {
    let dir = target_dir().join("images/demo-disk");
    let _built = demo_image();
    if !dir.join("disk.qcow2").is_file() {
        let _g = BUILD_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let st = Command::new(repo_root().join("scripts/build-image"))
            .arg(target_dir().join("images/demo"))
            .status()
            .expect("build-image");
        assert!(st.success(), "scripts/build-image failed");
    }
    dir
}

/// A JSON-RPC error as the client sees it.
#[derive(Debug, Clone)]
pub struct RpcError {
    /// Numeric class (400/404/409/500/503) or a standard JSON-RPC code.
    pub code: i64,
    /// `data.code`.
    pub data_code: String,
    /// The error's message.
    pub message: String,
    /// The error's whole `data` object.
    pub data: Value,
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.code, self.data_code, self.message)
    }
}

/// Posts one JSON-RPC request over HTTP/1.1 on a Unix socket (blocking).
pub fn rpc_raw(socket: &Path, body: &str) -> anyhow::Result<Value> {
    let mut s = UnixStream::connect(socket).with_context(|| format!("connect {}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    let req = format!(
        "POST / HTTP/1.1\r\nHost: gpuvisor\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        body.len(),
        body
    );
    s.write_all(req.as_bytes())?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let text = String::from_utf8_lossy(&resp);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| anyhow!("bad HTTP answer: {text}"))?;
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_string() };
    serde_json::from_str(&body).with_context(|| format!("not JSON: {body}"))
}

fn dechunk(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some((len, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// A private PID namespace (with its own `/proc`) that the agent, its QEMUs and any test
/// "holder" processes run in.
///
/// Why: the agent's open-handle scan reads every `/proc/<pid>/fd` and fails closed on any
/// unreadable one (docs/design/host.md §5). Sandboxed machines (CI here) hide some processes'
/// fds even from root, so tests run the agent "in their own PID namespace with a private
/// `/proc`" as docs/design/host.md §5 says. Pid 1 of the namespace is `sleep infinity` (it does
/// not reap: a VMM orphaned by a killed agent stays a zombie, which the agent's liveness
/// check counts as dead); dropping the namespace kills every process in it.
pub struct PidNs {
    holder: Child,
    /// Root-namespace pid of the namespace's init (the `nsenter` target).
    pub init_pid: i32,
}

impl PidNs {
    /// Creates the namespace and waits until its init runs.
    pub fn new() -> anyhow::Result<PidNs> {
        let holder = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "infinity"])
            .stdin(Stdio::null())
            .spawn()
            .context("spawning unshare")?;
        let upid = holder.id();
        let init_pid = wait_for(Duration::from_secs(10), || {
            let children = std::fs::read_to_string(format!("/proc/{upid}/task/{upid}/children")).ok()?;
            let pid: i32 = children.split_whitespace().next()?.parse().ok()?;
            // nsenter needs the child to be in its new namespace already.
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
            exe.to_string_lossy().contains("sleep").then_some(pid)
        })
        .ok_or_else(|| anyhow!("the PID namespace init did not start"))?;
        Ok(PidNs { holder, init_pid })
    }

    /// A command that runs `program` inside the namespace (pid and mount namespaces).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("-t").arg(self.init_pid.to_string()).args(["-p", "-m", "--"]).arg(program);
        c
    }
}

impl Drop for PidNs {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// A running agent on its own simulated host.
pub struct Agent {
    /// The simulated host (sysfs, `/dev`) the agent sees as its host root.
    pub sim: SimMount,
    /// The agent's PID namespace (dropped after everything else).
    pub ns: PidNs,
    /// The agent's temporary directory (its config, socket and data).
    pub dir: tempfile::TempDir,
    /// The agent's JSON-RPC socket.
    pub socket: PathBuf,
    /// The agent's `data_dir` (its records).
    pub data_dir: PathBuf,
    /// The agent's config file.
    pub config_path: PathBuf,
    /// Extra environment for the next [`Agent::spawn`] (e.g. `FAILPOINTS`).
    pub env: Vec<(String, String)>,
    /// Command prefix run inside the namespace before the agent binary on the next
    /// [`Agent::spawn`] (e.g. `["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]`).
    pub wrap: Vec<String>,
    child: Option<Child>,
}

/// Options for [`Agent::start_with`].
pub struct AgentOptions<'a> {
    /// Simulator preset or TOML model text.
    pub model: &'a str,
    /// Placement plugin (default: placement-spread).
    pub placement: Option<PathBuf>,
    /// Hypervisor plugin (default: hypervisor-default).
    pub hypervisor: Option<PathBuf>,
    /// Grace plugin (default: grace-default).
    pub grace: Option<PathBuf>,
    /// Extra TOML appended to the generated config (top-level keys).
    pub extra: &'a str,
}

impl Default for AgentOptions<'_> {
    fn default() -> Self {
        AgentOptions { model: "l40s-2x16", placement: None, hypervisor: None, grace: None, extra: "" }
    }
}

impl Agent {
    /// Starts a simulator with `model` and an agent with the default plugins.
    pub fn start(model: &str) -> anyhow::Result<Agent> {
        Agent::start_with(AgentOptions { model, ..Default::default() })
    }

    /// Starts a simulator and an agent (hold-fd, tcg, short graces for tests) and imports
    /// the demo image as `demo`.
    pub fn start_with(o: AgentOptions<'_>) -> anyhow::Result<Agent> {
        Agent::start_tuned(o, None, &[])
    }

    /// Spawns `gpuvisor serve` and waits until its socket answers `agent.health`.
    pub fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("agent.log"))?;
        let mut cmd = match self.wrap.split_first() {
            Some((first, rest)) => {
                let mut c = self.ns.command(first);
                c.args(rest).arg(agent_binary());
                c
            }
            None => self.ns.command(agent_binary()),
        };
        let child = cmd
            .args(["serve", "--config"])
            .arg(&self.config_path)
            .env("GPUVISOR_LOG", "info,gpuvisor=debug")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Some(st) = c.try_wait()? {
                    bail!("agent exited with {st}: {}", self.log());
                }
            }
            if self.call("agent.health", json!({})).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("agent did not answer within 60 s: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `agent.health` reports ready (the startup reconcile pass is done).
    pub fn wait_ready(&self) -> anyhow::Result<()> {
        wait_for(Duration::from_secs(60), || {
            self.call("agent.health", json!({})).ok().filter(|h| h["ready"] == true).map(|_| ())
        })
        .ok_or_else(|| anyhow!("agent never became ready: {}", tail(&self.log(), 40)))
    }

    /// Kills the agent with SIGKILL (VMs keep running, as after a crash).
    pub fn kill_agent(&mut self) {
        // `self.child` is nsenter; the agent is its child inside the namespace.
        let cfg = self.config_path.to_string_lossy().into_owned();
        for pid in pids_where(|cmd| cmd.contains(&cfg) && cmd.contains("serve") && !cmd.starts_with("nsenter")) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// Calls a method; `Err` carries the JSON-RPC error.
    pub fn call(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        let body = json!({ "jsonrpc": "2.0", "id": 1, "method": method, "params": params }).to_string();
        let v = rpc_raw(&self.socket, &body).map_err(|e| RpcError {
            code: 0,
            data_code: "transport".into(),
            message: e.to_string(),
            data: Value::Null,
        })?;
        if let Some(err) = v.get("error") {
            return Err(RpcError {
                code: err["code"].as_i64().unwrap_or(0),
                data_code: err["data"]["code"].as_str().unwrap_or("").to_string(),
                message: err["message"].as_str().unwrap_or("").to_string(),
                data: err["data"].clone(),
            });
        }
        Ok(v["result"].clone())
    }

    /// Calls a method that must succeed.
    pub fn ok(&self, method: &str, params: Value) -> Value {
        match self.call(method, params.clone()) {
            Ok(v) => v,
            Err(e) => panic!("{method} {params} failed: {e}\n--- agent log ---\n{}", tail(&self.log(), 60)),
        }
    }

    /// Calls a method that must fail; returns the error.
    pub fn err(&self, method: &str, params: Value) -> RpcError {
        match self.call(method, params.clone()) {
            Ok(v) => panic!("{method} {params} unexpectedly succeeded: {v}"),
            Err(e) => e,
        }
    }

    /// Creates a GPU instance of `profile` from the demo image.
    pub fn create_gpu(&self, name: &str, profile: &str) -> Result<Value, RpcError> {
        self.call("instance.create", json!({ "name": name, "image": "demo", "gpu": profile }))
    }

    /// Runs the CLI against this agent.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(agent_binary()).arg("--socket").arg(&self.socket).args(args).output().expect("gpuvisor cli")
    }

    /// Rewrites the `[plugins.<kind>]` table of the agent's config: its path, and `keys`
    /// (TOML lines, e.g. `deadline_ms = 500`; a `[plugins.<kind>.params]` table may follow
    /// them) after it. Takes effect at the next `plugin.reload`.
    pub fn set_slot(&self, kind: &str, path: &Path, keys: &str) {
        let cfg = std::fs::read_to_string(&self.config_path).expect("config");
        let head = format!("[plugins.{kind}]");
        let start = cfg.find(&head).unwrap_or_else(|| panic!("no {head} in\n{cfg}"));
        // The table ends at the next table that is not one of its own (`.params`).
        let own = format!("[plugins.{kind}.");
        let mut end = cfg.len();
        let mut at = start + head.len();
        while let Some(i) = cfg[at..].find("\n[") {
            at += i + 1;
            if !cfg[at..].starts_with(&own) {
                end = at;
                break;
            }
        }
        let table = format!("{head}\npath = {path:?}\n{keys}\n");
        std::fs::write(&self.config_path, format!("{}{table}{}", &cfg[..start], &cfg[end..])).expect("config");
    }

    /// The claims directory's records.
    pub fn claims(&self) -> Vec<Value> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(self.data_dir.join("claims")) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue;
                }
                let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                out.push(serde_json::from_str(&text).unwrap_or(Value::Null));
            }
        }
        out
    }

    /// The simulator's state dump.
    pub fn state(&self) -> Value {
        self.sim.state().expect("sim state")
    }

    /// A VF's current type from the state dump.
    pub fn vf_type(&self, vf: &str) -> u64 {
        vf_entry(&self.state(), vf)["type"].as_u64().unwrap_or(u64::MAX)
    }

    /// Waits until the instance's serial log has a line containing `needle`.
    pub fn wait_serial(&self, instance: &Value, needle: &str, timeout: Duration) -> anyhow::Result<String> {
        let path = PathBuf::from(instance["serial_log"].as_str().ok_or_else(|| anyhow!("no serial_log"))?);
        let deadline = Instant::now() + timeout;
        loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.contains(needle) {
                return Ok(text);
            }
            if Instant::now() > deadline {
                bail!("{needle:?} not in {} after {timeout:?}:\n{text}", path.display());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Pids of QEMU processes started by this agent (their command line names the data dir).
    pub fn qemu_pids(&self) -> Vec<i32> {
        processes_mentioning(&self.data_dir)
    }
}

/// The serial log of an instance (`serial_log` of its view).
pub fn serial_of(v: &Value) -> PathBuf {
    PathBuf::from(v["serial_log"].as_str().expect("serial_log"))
}

/// The serial log's text (read lossily: firmware writes bytes that are not UTF-8).
pub fn serial_text(v: &Value) -> String {
    String::from_utf8_lossy(&std::fs::read(serial_of(v)).unwrap_or_default()).into_owned()
}

/// The serial log's length now: where the next lines start (the log is appended across
/// boots).
pub fn serial_len(v: &Value) -> usize {
    std::fs::metadata(serial_of(v)).map(|m| m.len() as usize).unwrap_or(0)
}

/// Waits until `needle` appears in the serial log after byte offset `from`; panics with the
/// log's tail when it does not within `timeout`.
pub fn wait_serial_after(v: &Value, from: usize, needle: &str, timeout: Duration) {
    wait_for(timeout, || {
        let t = std::fs::read(serial_of(v)).unwrap_or_default();
        let t = String::from_utf8_lossy(t.get(from..).unwrap_or_default()).into_owned();
        t.contains(needle).then_some(())
    })
    .unwrap_or_else(|| {
        panic!("{needle:?} never appeared on the console of {}:\n{}", v["name"], tail(&serial_text(v), 30))
    });
}

/// Types `cmd` on the guest's console shell (its `console_socket`) and waits for `expect`
/// in the output. Commands print a marker built at run time (`X:$(...):X`), so the echo of
/// the typed line never matches by itself.
pub fn console_run(v: &Value, cmd: &str, expect: &str, timeout: Duration) {
    use std::io::Write;
    let from = serial_len(v);
    let sock = v["console_socket"].as_str().expect("console_socket");
    let mut s = std::os::unix::net::UnixStream::connect(sock).expect("console socket");
    // A fresh line first: the shell may be mid-prompt.
    s.write_all(format!("\r{cmd}\r").as_bytes()).unwrap();
    wait_serial_after(v, from, expect, timeout);
}

/// The state-dump entry of a VF.
pub fn vf_entry(state: &Value, vf: &str) -> Value {
    for g in state["gpus"].as_array().cloned().unwrap_or_default() {
        for v in g["vfs"].as_array().cloned().unwrap_or_default() {
            if v["bdf"] == vf {
                return v;
            }
        }
    }
    Value::Null
}

/// Every VF of the state dump with a non-zero type: `(bdf, type)`.
pub fn set_vfs(state: &Value) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for g in state["gpus"].as_array().cloned().unwrap_or_default() {
        for v in g["vfs"].as_array().cloned().unwrap_or_default() {
            let t = v["type"].as_u64().unwrap_or(0);
            if t != 0 {
                out.push((v["bdf"].as_str().unwrap_or("").to_string(), t));
            }
        }
    }
    out
}

/// Sysfs writes in the simulator's log (`op == "write"`), as `(path, value, result)`.
pub fn writes(state: &Value) -> Vec<(String, String, String)> {
    state["log"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|e| e["op"] == "write")
        .map(|e| {
            (
                e["path"].as_str().unwrap_or("").to_string(),
                e["value"].as_str().unwrap_or("").trim().to_string(),
                e["result"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// Root-namespace pids of live (non-zombie) processes whose command line (NULs as spaces)
/// satisfies `f`.
pub fn pids_where(f: impl Fn(&str) -> bool) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            if pid == std::process::id() as i32 {
                continue;
            }
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = stat.rsplit_once(')').map(|(_, r)| r.trim_start().starts_with('Z')).unwrap_or(true);
            if !zombie && f(&cmd) {
                out.push(pid);
            }
        }
    }
    out.sort();
    out
}

/// Root-namespace pids of live QEMU processes whose command line mentions `needle`.
pub fn processes_mentioning(needle: &Path) -> Vec<i32> {
    let needle = needle.to_string_lossy().into_owned();
    pids_where(|cmd| cmd.contains(&needle) && cmd.contains("qemu-system"))
}

/// The `/proc/<pid>/fd` link targets of a process.
pub fn fd_targets(pid: i32) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in rd.flatten() {
            if let Ok(t) = std::fs::read_link(e.path()) {
                out.push(t.to_string_lossy().into_owned());
            }
        }
    }
    out
}

/// The last `n` lines of a text.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Polls `f` until it returns `Some`, for at most `timeout`.
pub fn wait_for<T>(timeout: Duration, f: impl FnMut() -> Option<T>) -> Option<T> {
    wait_for_every(Duration::from_millis(50), timeout, f)
}

/// [`wait_for`], asking every `step` (a benchmark's bare side, timed to the millisecond).
pub fn wait_for_every<T>(step: Duration, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(step);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill_agent();
        for pid in self.qemu_pids() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
        wait_for(Duration::from_secs(10), || self.qemu_pids().is_empty().then_some(()));
        if std::thread::panicking() {
            eprintln!("--- agent log (tail) ---\n{}", tail(&self.log(), 80));
        }
    }
}

// ---------------------------------------------------------------------- helpers (api/cli/mdev/policy tests)

/// The sum of every sample of metric `name` (or `name_total`, as counters are exposed) in
/// Prometheus text whose label set contains every `k="v"` of `labels`; `None` if no sample
/// matches.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        let metric_name = &line[..end];
        if metric_name != name && metric_name != format!("{name}_total") {
            continue;
        }
        let label_part = if line[end..].starts_with('{') { &line[end..line.rfind('}').unwrap_or(end)] } else { "" };
        if !labels.iter().all(|(k, v)| label_part.contains(&format!("{k}=\"{v}\""))) {
            continue;
        }
        let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        *found.get_or_insert(0.0) += value;
    }
    found
}

/// True when `s` is a canonical lower-case hyphenated UUID.
pub fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit() && !c.is_ascii_uppercase(),
        })
}

/// The simulator's mdevs from a state dump.
pub fn sim_mdevs(state: &Value) -> Vec<Value> {
    state["mdevs"].as_array().cloned().unwrap_or_default()
}

/// Spawns `gpuvisor serve --config <config>` outside any namespace, for agents that must
/// refuse to start; waits at most `timeout` for it to exit (kills it and fails otherwise).
/// Returns (exit status, stderr + stdout).
pub fn serve_expecting_exit(config: &Path, timeout: Duration) -> anyhow::Result<(std::process::ExitStatus, String)> {
    let dir = tempfile::Builder::new().prefix("gpuvisor-serve.").tempdir()?;
    let out_path = dir.path().join("out.log");
    let out = std::fs::File::create(&out_path)?;
    let mut child = Command::new(agent_binary())
        .args(["serve", "--config"])
        .arg(config)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()?;
    let status = wait_for(timeout, || child.try_wait().ok().flatten());
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    match status {
        Some(st) => Ok((st, text)),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("gpuvisor serve did not exit within {timeout:?}: {text}")
        }
    }
}

impl Agent {
    /// Names of the instances `instance.list` reports.
    pub fn instance_names(&self) -> Vec<String> {
        self.ok("instance.list", json!({}))["instances"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|i| i["name"].as_str().unwrap_or("").to_string())
            .collect()
    }

    /// File names under `<data_dir>/<sub>` (dot files excluded), sorted.
    pub fn data_files(&self, sub: &str) -> Vec<String> {
        let mut out: Vec<String> = std::fs::read_dir(self.data_dir.join(sub))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| !n.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }

    /// `agent.metrics` text.
    pub fn metrics(&self) -> String {
        self.ok("agent.metrics", json!({})).as_str().unwrap_or_default().to_string()
    }

    /// Sysfs writes the simulator logged so far.
    pub fn sim_writes(&self) -> Vec<(String, String, String)> {
        writes(&self.state())
    }
}

// ====================================================================== reconcile & crash-matrix helpers
// (used by tests/reconcile.rs and tests/crash_matrix.rs; another block above/below belongs to
// other suites — keep this one self-contained)

/// Host V (docs/design/scenarios.md conventions): one L40S `0000:41:00.0` with 4 VFs `.4`–`.7`
/// (groups 41–44), teardown lag 300 ms.
pub const HOST_V: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
/// Host V2: V plus `0001:81:00.0` with VFs `0001:81:00.4`–`.7` (groups 61–64).
pub const HOST_V2: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n\
     [[gpu]]\nbdf = \"0001:81:00.0\"\nvf_count = 4\niommu_group = 60\n";
/// The VFs of host V.
pub const V_VFS: [&str; 4] = ["0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7"];

/// CLOCK_BOOTTIME now, in ms (what claims store as `claimed_boottime_ms`).
pub fn boottime_now_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// True for the error a client sees when the agent died under the call.
pub fn is_transport(e: &RpcError) -> bool {
    e.data_code == "transport"
}

impl Agent {
    /// Root-namespace pids of this agent's `gpuvisor serve` process(es) (not nsenter).
    pub fn agent_pids(&self) -> Vec<i32> {
        let cfg = self.config_path.to_string_lossy().into_owned();
        pids_where(|cmd| cmd.contains(&cfg) && cmd.contains("serve") && !cmd.starts_with("nsenter"))
    }

    /// Waits (bounded) until the agent process is gone, e.g. after a failpoint abort, and
    /// reaps the launcher. True when it is gone.
    pub fn wait_agent_gone(&mut self, timeout: Duration) -> bool {
        let gone = wait_for(timeout, || self.agent_pids().is_empty().then_some(())).is_some();
        if gone {
            if let Some(mut c) = self.child.take() {
                let _ = c.wait();
            }
        }
        gone
    }

    /// Kills the agent (if running) and starts it again with `FAILPOINTS` set to
    /// `failpoints` (`None`: no failpoint). Does not wait for readiness; `Err` when the
    /// agent exited before it answered (e.g. it aborted inside its startup pass).
    pub fn restart_with_failpoints(&mut self, failpoints: Option<&str>) -> anyhow::Result<()> {
        self.kill_agent();
        self.env.retain(|(k, _)| k != "FAILPOINTS");
        if let Some(fp) = failpoints {
            self.env.push(("FAILPOINTS".into(), fp.into()));
        }
        self.spawn()
    }

    /// Restarts the agent without failpoints and waits until it is ready.
    pub fn restart_clean(&mut self) {
        self.restart_with_failpoints(None).expect("restart");
        self.wait_ready().expect("ready after restart");
    }

    /// One reconcile pass (`reconcile.run`), which must answer.
    pub fn pass(&self) -> Value {
        self.ok("reconcile.run", json!({}))
    }

    /// The claim record of `device` as stored (`None`: no claim file; `Null`: undecodable).
    pub fn claim_file(&self, device: &str) -> Option<Value> {
        let text = std::fs::read_to_string(self.data_dir.join("claims").join(format!("{device}.json"))).ok()?;
        Some(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// The instance records as stored: `(id, Ok(record) | Err(why))`, directories without
    /// `instance.json` skipped.
    pub fn instance_records(&self) -> Vec<(String, Result<Value, String>)> {
        let mut out = Vec::new();
        for id in self.data_files("instances") {
            let p = self.data_dir.join("instances").join(&id).join("instance.json");
            match std::fs::read_to_string(&p) {
                Ok(t) => out.push((id, serde_json::from_str(&t).map_err(|e| format!("undecodable: {e}")))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => out.push((id, Err(format!("unreadable: {e}")))),
            }
        }
        out
    }

    /// Path of an instance's record file.
    pub fn instance_record_path(&self, id: &str) -> PathBuf {
        self.data_dir.join("instances").join(id).join("instance.json")
    }

    /// Live QEMUs of this agent: (root-ns pid, instance id from `-uuid`, VFs whose group
    /// node or cdev the process holds open).
    pub fn live_qemus(&self) -> Vec<LiveQemu> {
        let state = self.state();
        let root = self.sim.path().to_string_lossy().into_owned();
        let mut out = Vec::new();
        for pid in self.qemu_pids() {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<String> = String::from_utf8_lossy(&cmd).split('\0').map(|s| s.to_string()).collect();
            let uuid = args.iter().position(|a| a == "-uuid").and_then(|i| args.get(i + 1)).cloned();
            let targets = fd_targets(pid);
            let mut vfs = Vec::new();
            for g in state["gpus"].as_array().cloned().unwrap_or_default() {
                for v in g["vfs"].as_array().cloned().unwrap_or_default() {
                    let group = format!("{root}/dev/vfio/{}", v["group"]);
                    let cdev = format!("{root}/dev/vfio/devices/{}", v["cdev"].as_str().unwrap_or("-"));
                    if targets.iter().any(|t| *t == group || *t == cdev) {
                        vfs.push(v["bdf"].as_str().unwrap_or("").to_string());
                    }
                }
            }
            out.push(LiveQemu { pid, instance_id: uuid, vfs });
        }
        out
    }
}

/// A live QEMU process as the invariant checker sees it.
#[derive(Debug, Clone)]
pub struct LiveQemu {
    /// The QEMU's pid in the root PID namespace.
    pub pid: i32,
    /// The instance id from its `-uuid` argument.
    pub instance_id: Option<String>,
    /// The VFs (BDFs) whose VFIO group node or cdev it holds open.
    pub vfs: Vec<String>,
}

/// One observation of everything the invariant checker reads.
#[derive(Debug, Clone)]
pub struct World {
    /// The simulator's state dump.
    pub state: Value,
    /// `(device, claim)`; an undecodable claim is `Null`.
    pub claims: Vec<(String, Value)>,
    /// `(id, record)` of every instance record; an unreadable one is `Err(why)`.
    pub instances: Vec<(String, Result<Value, String>)>,
    /// The live QEMUs of the agent.
    pub qemus: Vec<LiveQemu>,
    /// `(uid, record)` of `vmm-ids/`; an undecodable record is `Null`.
    pub vmm_ids: Vec<(String, Value)>,
}

/// The real uid of process `pid` (root namespace), if it can be read.
pub fn uid_of(pid: i32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()
}

impl World {
    /// Reads everything the invariant checker needs from `a`, once.
    pub fn observe(a: &Agent) -> World {
        let claims = a
            .data_files("claims")
            .into_iter()
            .filter_map(|f| f.strip_suffix(".json").map(|d| d.to_string()))
            .map(|d| {
                let c = a.claim_file(&d).unwrap_or(Value::Null);
                (d, c)
            })
            .collect();
        let vmm_ids = a
            .data_files("vmm-ids")
            .into_iter()
            .filter_map(|f| f.strip_suffix(".json").map(|u| u.to_string()))
            .map(|u| {
                let r = std::fs::read_to_string(a.data_dir.join(format!("vmm-ids/{u}.json")))
                    .ok()
                    .and_then(|t| serde_json::from_str(&t).ok())
                    .unwrap_or(Value::Null);
                (u, r)
            })
            .collect();
        World { state: a.state(), claims, instances: a.instance_records(), qemus: a.live_qemus(), vmm_ids }
    }

    fn claim(&self, dev: &str) -> Option<&Value> {
        self.claims.iter().find(|(d, _)| d == dev).map(|(_, c)| c)
    }

    fn record(&self, id: &str) -> Option<&Value> {
        self.instances.iter().find(|(i, _)| i == id).and_then(|(_, r)| r.as_ref().ok())
    }

    fn qemu_of(&self, id: &str) -> Vec<&LiveQemu> {
        self.qemus.iter().filter(|q| q.instance_id.as_deref() == Some(id)).collect()
    }

    /// Safety (docs/design/invariants.md I1, I3, I4), which must hold at every observation.
    /// `dirty_before`: VFs that carried a type gpuvisor did not claim before the test acted.
    pub fn safety_violations(&self, dirty_before: &[String]) -> Vec<String> {
        let mut v = Vec::new();
        let sets = set_vfs(&self.state);
        // I1: every live QEMU's VF still reads its type and its claim names that instance.
        for q in &self.qemus {
            for vf in &q.vfs {
                if !sets.iter().any(|(b, _)| b == vf) {
                    v.push(format!("I1: VF {vf} reads 0 while QEMU {} ({:?}) holds it", q.pid, q.instance_id));
                }
                match self.claim(vf) {
                    None => v.push(format!("I1/I4: VF {vf} held by live QEMU {} has no claim", q.pid)),
                    Some(c) if c["instance_id"].as_str() != q.instance_id.as_deref() => v.push(format!(
                        "I3: VF {vf} held by QEMU {} of {:?} is claimed by {}",
                        q.pid, q.instance_id, c["instance_id"]
                    )),
                    Some(_) => {}
                }
            }
        }
        // I3: no two live QEMUs hold one VF; no two live QEMUs run one instance.
        let mut held: Vec<&String> = self.qemus.iter().flat_map(|q| q.vfs.iter()).collect();
        held.sort();
        for w in held.windows(2) {
            if w[0] == w[1] {
                v.push(format!("I3: two live QEMUs hold VF {}", w[0]));
            }
        }
        let mut ids: Vec<&String> = self.qemus.iter().filter_map(|q| q.instance_id.as_ref()).collect();
        ids.sort();
        for w in ids.windows(2) {
            if w[0] == w[1] {
                v.push(format!("I3: two live QEMUs run instance {}", w[0]));
            }
        }
        // I16: one VMM id per instance and one instance per VMM id; every live VMM runs as its
        // record's id, no two as one uid.
        let mut by_id: Vec<(u64, &str)> = self
            .instances
            .iter()
            .filter_map(|(i, r)| r.as_ref().ok().and_then(|r| r["vmm_id"].as_u64()).map(|u| (u, i.as_str())))
            .collect();
        by_id.sort();
        for w in by_id.windows(2) {
            if w[0].0 == w[1].0 {
                v.push(format!("I16: instances {} and {} both name VMM id {}", w[0].1, w[1].1, w[0].0));
            }
        }
        for (u, r) in &self.vmm_ids {
            let owner = r["instance_id"].as_str().unwrap_or("?");
            if let Some(rec) = self.record(owner) {
                if rec["vmm_id"].as_u64().is_some_and(|x| x.to_string() != *u) {
                    v.push(format!(
                        "I16: vmm-ids/{u}.json gives instance {owner} an id its record does not name ({})",
                        rec["vmm_id"]
                    ));
                }
            }
        }
        let mut uids: Vec<(u32, i32)> = Vec::new();
        for q in &self.qemus {
            let Some(uid) = uid_of(q.pid) else { continue };
            if let Some(want) = q.instance_id.as_deref().and_then(|i| self.record(i)).and_then(|r| r["vmm_id"].as_u64())
            {
                if u64::from(uid) != want {
                    v.push(format!(
                        "I16: QEMU {} of {:?} runs as uid {uid}, its record says {want}",
                        q.pid, q.instance_id
                    ));
                }
            }
            uids.push((uid, q.pid));
        }
        uids.sort();
        for w in uids.windows(2) {
            if w[0].0 == w[1].0 && w[0].0 != 0 {
                v.push(format!("I16: QEMUs {} and {} both run as uid {}", w[0].1, w[1].1, w[0].0));
            }
        }
        // I3: one instance holds at most one active (non release_pending) claim.
        let mut owners: Vec<String> = self
            .claims
            .iter()
            .filter(|(_, c)| c["state"] != "release_pending")
            .map(|(_, c)| c["instance_id"].as_str().unwrap_or("?").to_string())
            .collect();
        owners.sort();
        for w in owners.windows(2) {
            if w[0] == w[1] {
                v.push(format!("I3: instance {} holds two active claims: {:?}", w[0], self.claims));
            }
        }
        // Claims must decode and name their own file's device.
        for (d, c) in &self.claims {
            if c["device"].as_str() != Some(d.as_str()) {
                v.push(format!("store: claim file {d}.json is undecodable or names another device: {c}"));
            }
        }
        // I4: every VF with a type has a claim, or was dirty before the test acted.
        for (vf, t) in &sets {
            if self.claim(vf).is_none() && !dirty_before.contains(vf) {
                v.push(format!("I4: VF {vf} reads type {t} with no claim (was not dirty before)"));
            }
        }
        v
    }

    /// Liveness (I2, I8) at the end of the bounded window.
    pub fn liveness_violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        // I2: every claim's owner exists and its VMM runs; otherwise the device must be back
        // at 0 with no claim.
        for (d, c) in &self.claims {
            let owner = c["instance_id"].as_str().unwrap_or("?");
            if self.qemu_of(owner).is_empty() {
                let rec = self.record(owner).map(|r| r["state"].clone()).unwrap_or(Value::Null);
                v.push(format!(
                    "I2: claim {d} (state {}, last_error {}) survives its dead owner {owner} (record state {rec}); VF type {}",
                    c["state"], c["last_error"], vf_entry(&self.state, d)["type"]
                ));
            }
        }
        for (vf, t) in set_vfs(&self.state) {
            let owner_alive = self
                .claim(&vf)
                .and_then(|c| c["instance_id"].as_str())
                .map(|o| !self.qemu_of(o).is_empty())
                .unwrap_or(false);
            if !owner_alive {
                v.push(format!("I2: VF {vf} still reads type {t} with no live owner"));
            }
        }
        // I8: records agree with processes.
        for (id, r) in &self.instances {
            match r {
                Err(e) => v.push(format!("store: instance {id} record {e}")),
                Ok(r) => {
                    let alive = !self.qemu_of(id).is_empty();
                    let st = r["state"].as_str().unwrap_or("?");
                    if matches!(st, "running" | "starting" | "stopping") && !alive {
                        v.push(format!("I8: instance {id} ({}) is recorded {st} without a live QEMU", r["name"]));
                    }
                    if alive && st != "running" {
                        v.push(format!(
                            "I8: instance {id} ({}) has a live QEMU but is recorded {st} (vmm {})",
                            r["name"], r["vmm"]
                        ));
                    }
                }
            }
        }
        for q in &self.qemus {
            if q.instance_id.as_deref().and_then(|id| self.record(id)).is_none() {
                v.push(format!("I8: live QEMU {} ({:?}) has no instance record", q.pid, q.instance_id));
            }
        }
        v
    }
}

// ---------------------------------------------------------------------- helpers (lifecycle suites)

/// The generated config with some harness keys given other values (`(key, toml value)`);
/// keys the harness does not set are appended.
fn harness_config(base: &str, set: &[(&str, &str)]) -> String {
    let mut lines: Vec<String> = base.lines().map(str::to_string).collect();
    for (k, v) in set {
        let prefix = format!("{k} = ");
        match lines.iter().position(|l| l.starts_with(&prefix)) {
            Some(i) => lines[i] = format!("{k} = {v}"),
            // Top-level keys must come before the first table.
            None => {
                let at = lines.iter().position(|l| l.starts_with('[')).unwrap_or(lines.len());
                lines.insert(at, format!("{k} = {v}"));
            }
        }
    }
    lines.join("\n") + "\n"
}

impl Agent {
    /// Like [`Agent::start_with`], but with a caller-chosen data directory (which must exist
    /// and be mounted before this call: the agent's namespace copies the mounts of the moment)
    /// and with harness keys overridden (`set`, e.g. `[("release_retry_s", "1")]`; TOML
    /// duplicates in `extra` would be a parse error).
    pub fn start_tuned(o: AgentOptions<'_>, data_dir: Option<PathBuf>, set: &[(&str, &str)]) -> anyhow::Result<Agent> {
        let image = demo_image();
        let sim = SimMount::start(o.model)?;
        let dir = vmm_reachable_tempdir("gpuvisor-e2e.")?;
        let data_dir = data_dir.unwrap_or_else(|| dir.path().join("data"));
        let socket = dir.path().join("gpuvisor.sock");
        let placement = o.placement.unwrap_or_else(|| plugin("placement-spread"));
        let hypervisor = o.hypervisor.unwrap_or_else(|| plugin("hypervisor-default"));
        let grace = o.grace.unwrap_or_else(|| plugin("grace-default"));
        let base = format!(
            "data_dir = {data:?}\nsocket = {sock:?}\nhost_root = {root:?}\naccel = \"tcg\"\nvfio_attach = \"hold-fd\"\n\
             vfio_term_grace_s = 2\nstop_timeout_s = 10\nrelease_retry_s = 5\nvmm_shared_paths = {shared}\n{extra}\n\
             [plugins.placement]\npath = {pl:?}\n[plugins.hypervisor]\npath = {hv:?}\n[plugins.grace]\npath = {gr:?}\n",
            data = data_dir,
            sock = socket,
            root = sim.path(),
            shared = harness_shared_paths(sim.path()),
            extra = o.extra,
            pl = placement,
            hv = hypervisor,
            gr = grace,
        );
        let config_path = dir.path().join("gpuvisor.toml");
        std::fs::write(&config_path, harness_config(&base, set))?;
        let ns = PidNs::new()?;
        let mut agent =
            Agent { sim, ns, dir, socket, data_dir, config_path, env: Vec::new(), wrap: Vec::new(), child: None };
        agent.spawn()?;
        agent.wait_ready()?;
        agent
            .call(
                "image.import",
                json!({
                    "name": "demo",
                    "kernel": image.join("vmlinuz"),
                    "initrd": image.join("initrd.img"),
                    "cmdline": std::fs::read_to_string(image.join("cmdline")).unwrap_or_default().trim(),
                }),
            )
            .map_err(|e| anyhow!("image.import: {e}"))?;
        Ok(agent)
    }

    /// Kills the agent (SIGKILL) and starts it again with `self.env`; waits until ready.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill_agent();
        self.spawn()?;
        self.wait_ready()
    }

    /// The instance record as stored (`instances/<id>/instance.json`).
    pub fn record(&self, id: &str) -> Value {
        let p = self.data_dir.join(format!("instances/{id}/instance.json"));
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
            .expect("instance.json")
    }

    /// Overwrites the instance record (tests that fake a recycled pid and the like).
    pub fn write_record(&self, id: &str, rec: &Value) {
        let p = self.data_dir.join(format!("instances/{id}/instance.json"));
        let tmp = p.with_extension("json.test-tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(rec).unwrap()).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
    }

    /// The claim record of `device`, if any.
    pub fn claim(&self, device: &str) -> Option<Value> {
        let text = std::fs::read_to_string(self.data_dir.join(format!("claims/{device}.json"))).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Sends one JSON-RPC call from another thread (for tests that act while the call is
    /// in flight); the handle yields the whole response object (`result` or `error`).
    pub fn spawn_call(&self, method: &str, params: Value) -> std::thread::JoinHandle<anyhow::Result<Value>> {
        let sock = self.socket.clone();
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
        std::thread::spawn(move || rpc_raw(&sock, &body))
    }

    /// Spawns `sh -c script` inside the agent's PID namespace with piped stdout and returns
    /// it with the first line it prints (the script prints one when it is ready).
    pub fn ns_sh(&self, script: &str) -> (Child, String) {
        let mut child = self
            .ns
            .command("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn in the agent's namespace");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
        (child, line.trim().to_string())
    }
}

/// A QEMU wrapper for `qemu_binary`: sources `hook` first when it exists (a hook can
/// `exit 1` to make "QEMU" fail right after spawn, or run `gpuvisor-sim ctl` first), then
/// execs the real QEMU with `-S` (the guest stays paused: the lifecycle tests need a real
/// VMM holding its VF and QMP socket, not a booting guest, and the host has 2 shared cores).
pub struct QemuWrapper {
    /// The wrapper's directory (writable by the VMM's uid).
    pub dir: tempfile::TempDir,
    /// The wrapper script, to give as `qemu_binary`.
    pub binary: PathBuf,
    /// The hook file the wrapper sources before it execs QEMU.
    pub hook: PathBuf,
}

impl QemuWrapper {
    /// A wrapper in a fresh directory; its hook file does not exist yet.
    pub fn new() -> QemuWrapper {
        use std::os::unix::fs::PermissionsExt;
        let dir = vmm_writable_tempdir("gpuvisor-qemu-wrap.").unwrap();
        let binary = dir.path().join("qemu-wrapper");
        let hook = dir.path().join("hook.sh");
        std::fs::write(
            &binary,
            format!("#!/bin/sh\nif [ -f {h:?} ]; then . {h:?}; fi\nexec qemu-system-x86_64 \"$@\" -S\n", h = hook),
        )
        .unwrap();
        std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
        QemuWrapper { dir, binary, hook }
    }

    /// `qemu_binary = "<wrapper>"` for `AgentOptions::extra`.
    pub fn extra(&self) -> String {
        format!("qemu_binary = {:?}\n", self.binary)
    }

    /// Makes the next spawns run `body` (shell) first.
    pub fn set_hook(&self, body: &str) {
        std::fs::write(&self.hook, body).unwrap();
    }

    /// Spawns exec the real QEMU again.
    pub fn clear_hook(&self) {
        let _ = std::fs::remove_file(&self.hook);
    }
}

impl Default for QemuWrapper {
    fn default() -> Self {
        QemuWrapper::new()
    }
}

/// A shell command line that sends one `gpuvisor-sim ctl` to `sim` (for QEMU hooks).
pub fn sim_ctl_sh(sim: &SimMount, args: &[&str]) -> String {
    let bin = gpuvisor_sim::testing::sim_binary().expect("gpuvisor-sim binary");
    let mut s = format!("{:?} ctl {:?}", bin, sim.path());
    for a in args {
        s.push_str(&format!(" '{a}'"));
    }
    s + " >/dev/null 2>&1"
}

/// `(function, driver)` pairs, sorted (`none` for an unbound function): how tests write the
/// binding of a passthrough GPU's IOMMU group.
pub fn bindings(x: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = x.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    v.sort();
    v
}

impl Agent {
    /// The binding of every member of the passthrough GPU `gpu`'s IOMMU group, from the
    /// simulator's state dump, as [`bindings`].
    pub fn pt_drivers(&self, gpu: &str) -> Vec<(String, String)> {
        let st = self.state();
        let e = st["passthrough"]
            .as_array()
            .and_then(|a| a.iter().find(|g| g["bdf"] == gpu))
            .cloned()
            .unwrap_or_else(|| panic!("no passthrough GPU {gpu} in {st}"));
        let mut v: Vec<(String, String)> = e["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| (f["bdf"].as_str().unwrap_or("").to_string(), f["driver"].as_str().unwrap_or("none").to_string()))
            .collect();
        v.sort();
        v
    }
}

/// `/proc/<pid>/stat` field 22 (start time in clock ticks).
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The pid of a root-namespace process inside its innermost PID namespace (`NSpid`).
pub fn ns_pid(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// The root-namespace pid of a process whose innermost-namespace pid is `nspid` and whose
/// command line satisfies `f`.
pub fn root_pid_of(nspid: i32, f: impl Fn(&str) -> bool) -> Option<i32> {
    pids_where(f).into_iter().find(|p| ns_pid(*p) == Some(nspid))
}

/// True while a root-namespace pid exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')').map(|(_, r)| !r.trim_start().starts_with('Z')).unwrap_or(false)
}

/// The sysfs path of a VF's `current_vgpu_type` (relative to the host root).
pub fn type_path(vf: &str) -> String {
    format!("sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type")
}

/// `(value, result)` of every logged write to a VF's type file, in order.
pub fn type_writes_of(state: &Value, vf: &str) -> Vec<(String, String)> {
    writes(state).into_iter().filter(|(p, _, _)| *p == type_path(vf)).map(|(_, v, r)| (v, r)).collect()
}

/// The highest `seq` in the simulator's log (0 when empty).
pub fn last_seq(state: &Value) -> u64 {
    state["log"].as_array().map(|l| l.iter().filter_map(|e| e["seq"].as_u64()).max().unwrap_or(0)).unwrap_or(0)
}

/// Log entries after `seq`.
pub fn log_after(state: &Value, seq: u64) -> Vec<Value> {
    state["log"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["seq"].as_u64().unwrap_or(0) > seq)
        .collect()
}

/// A metric value, absent = 0.
pub fn metric0(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric(text, name, labels).unwrap_or(0.0)
}

impl Agent {
    /// Creates `name` (vGPU `profile`), then stops it while every write to its VF's type
    /// fails with EBUSY: the result is a stopped instance with a retained
    /// (`release_pending`) claim, its VF still set, no holder. Faults are cleared at the end.
    /// Returns (instance id, VF).
    pub fn retained_stopped(&self, name: &str, profile: &str) -> (String, String) {
        let inst = self.create_gpu(name, profile).unwrap_or_else(|e| panic!("create {name}: {e}"));
        let id = inst["id"].as_str().unwrap().to_string();
        let vf = inst["gpu"]["device"].as_str().unwrap().to_string();
        self.sim.ctl(&["fail-write", &type_path(&vf), "EBUSY", "--always"]).unwrap();
        let stopped = self.ok("instance.stop", json!({"ref": name, "force": true}));
        assert_eq!(stopped["state"], "stopped", "{stopped}");
        assert_eq!(stopped["gpu"]["release_pending"], true, "{stopped}");
        self.sim.ctl(&["clear-faults"]).unwrap();
        let c = self.claim(&vf).expect("retained claim");
        assert_eq!(c["state"], "release_pending", "{c}");
        assert_eq!(c["instance_id"], id.as_str());
        assert_ne!(self.vf_type(&vf), 0, "the VF still holds its type");
        assert!(qemu_of(&id).is_empty(), "QEMU of {name} is gone");
        (id, vf)
    }
}

/// `resources.get`'s placeable count for a profile (0 when it is not listed).
pub fn placeable(res: &Value, profile: &str) -> u64 {
    res["profiles"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["profile"] == profile))
        .and_then(|p| p["placeable"].as_u64())
        .unwrap_or(0)
}

/// Fails with a clear message when the agent binary was built without the `failpoints`
/// feature (the crash tests need it).
pub fn assert_failpoints_built() {
    let bin = std::fs::read(agent_binary()).expect("agent binary");
    assert!(
        bin.windows(b"reconcile_before_release".len()).any(|w| w == b"reconcile_before_release"),
        "{} was built without failpoints: run `cargo build --workspace --bins --features gpuvisor/failpoints`",
        agent_binary().display()
    );
}

/// SIGKILL to a root-namespace pid (errors ignored: the process may be gone already).
pub fn sigkill(pid: i32) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
}

/// The failpoint names of `agent/src/failpoints.rs` (`ALL`), read from the source so the
/// crash tests follow every failpoint added there.
pub fn all_failpoints() -> Vec<String> {
    let src = std::fs::read_to_string(repo_root().join("agent/src/failpoints.rs")).expect("agent/src/failpoints.rs");
    let start = src.find("pub const ALL").expect("ALL in failpoints.rs");
    let body = &src[start..start + src[start..].find("];").expect("end of ALL")];
    body.split('"').skip(1).step_by(2).map(String::from).collect()
}

/// A small tmpfs on a fresh temp directory (a data directory that can fill up), unmounted
/// (lazily) on drop: declare it before the [`Agent`] that uses it, so the agent goes first.
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (e.g. `"24m"`).
    pub fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::Builder::new().prefix("gpuvisor-tmpfs.").tempdir().expect("tempdir");
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("mount");
        assert!(st.success(), "mount tmpfs");
        Tmpfs { dir }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills the filesystem to the last byte (appending to `fill` in it).
    pub fn fill(&self) {
        let mut f =
            std::fs::OpenOptions::new().create(true).append(true).open(self.path().join("fill")).expect("fill file");
        while f.write_all(&[0u8; 65536]).is_ok() {}
        while f.write_all(&[0u8; 1]).is_ok() {}
        let _ = f.sync_all();
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// `target/debug/e2e-helper` (`tests/e2e/src/bin/e2e-helper.rs`, built by `cargo build
/// --workspace --bins`): process shapes `sh` cannot make (holders, non-dumpable processes,
/// zombie leaders).
pub fn helper_binary() -> PathBuf {
    let p = target_dir().join("debug/e2e-helper");
    assert!(
        p.is_file(),
        "{} not built (run `cargo build --workspace --bins --features gpuvisor/failpoints`)",
        p.display()
    );
    p
}

/// Root-namespace pids of the QEMU processes whose command line names `id` (an instance id).
pub fn qemu_of(id: &str) -> Vec<i32> {
    pids_where(|c| c.contains("qemu-system") && c.contains(id))
}

/// Waits (bounded, 10 s) until `pid` is reaped: its `/proc` entry is gone. A zombie whose
/// threads are still exiting is not gone yet (the agent counts it as alive). True when gone.
pub fn wait_reaped(pid: i32) -> bool {
    let dir = PathBuf::from(format!("/proc/{pid}"));
    wait_for(Duration::from_secs(10), || (!dir.exists()).then_some(())).is_some()
}

/// The real Cloud Hypervisor for the tests: `CLOUD_HYPERVISOR_BIN`, then `cloud-hypervisor`
/// on `PATH`, then `../shared/tools/cloud-hypervisor` beside the checkout. `None` (after
/// printing one line saying why) when there is none: the caller skips.
pub fn real_cloud_hypervisor() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CLOUD_HYPERVISOR_BIN") {
        return Some(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(p) = std::env::split_paths(&path).map(|d| d.join("cloud-hypervisor")).find(|p| p.is_file()) {
            return Some(p);
        }
    }
    let shared = repo_root().join("../shared/tools/cloud-hypervisor");
    if shared.is_file() {
        return Some(shared.canonicalize().unwrap_or(shared));
    }
    println!("skipped: no cloud-hypervisor binary (CLOUD_HYPERVISOR_BIN, PATH, ../shared/tools/cloud-hypervisor)");
    None
}

/// A `cloud_hypervisor_binary` for the tests: a wrapper script that runs the Cloud
/// Hypervisor test server (`tests/ch-fake`, `cloud-hypervisor-fake`) with a control file
/// (`CH_FAKE_CONTROL`: fail a request, hang, ignore the power button, ...) and a request
/// log (`CH_FAKE_LOG`), or the real binary.
pub struct ChWrapper {
    /// The wrapper's directory.
    pub dir: tempfile::TempDir,
    /// The wrapper script, to give as `cloud_hypervisor_binary`.
    pub binary: PathBuf,
    /// The control file (`CH_FAKE_CONTROL`).
    pub control: PathBuf,
    /// The request log (`CH_FAKE_LOG`): one JSON line per API request.
    pub requests_log: PathBuf,
    /// `true`: the real Cloud Hypervisor (the control file and request log do nothing).
    pub real: bool,
}

impl ChWrapper {
    /// The test server.
    pub fn fake() -> ChWrapper {
        let fake = profile_dir().join("cloud-hypervisor-fake");
        assert!(fake.is_file(), "{} not built (cargo build -p gpuvisor-ch-fake)", fake.display());
        ChWrapper::around(&fake, false)
    }

    /// The real binary, if there is one.
    pub fn real() -> Option<ChWrapper> {
        real_cloud_hypervisor().map(|b| ChWrapper::around(&b, true))
    }

    fn around(target: &Path, real: bool) -> ChWrapper {
        use std::os::unix::fs::PermissionsExt;
        let dir = vmm_writable_tempdir("gpuvisor-ch-wrap.").unwrap();
        let binary = dir.path().join("cloud-hypervisor");
        let control = dir.path().join("control.json");
        let requests_log = dir.path().join("requests.jsonl");
        std::fs::write(
            &binary,
            format!(
                "#!/bin/sh\nexport CH_FAKE_CONTROL={control:?} CH_FAKE_LOG={log:?}\nexec {target:?} \"$@\"\n",
                control = control,
                log = requests_log,
                target = target
            ),
        )
        .unwrap();
        std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
        // The VMM runs under its own unprivileged uid: it appends to the log the test reads.
        std::fs::write(&requests_log, "").unwrap();
        std::fs::set_permissions(&requests_log, std::fs::Permissions::from_mode(0o666)).unwrap();
        ChWrapper { dir, binary, control, requests_log, real }
    }

    /// `("cloud_hypervisor_binary", "<wrapper>")` for [`Agent::start_tuned`]'s `set`.
    pub fn setting(&self) -> (&'static str, String) {
        ("cloud_hypervisor_binary", format!("{:?}", self.binary))
    }

    /// Replaces the test server's control file (read on every request).
    pub fn control(&self, v: Value) {
        let tmp = self.control.with_extension("tmp");
        std::fs::write(&tmp, v.to_string()).unwrap();
        std::fs::rename(&tmp, &self.control).unwrap();
    }

    /// Every request the test servers answered (or read), in order.
    pub fn requests(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.requests_log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

/// Root-namespace pids of every VMM (QEMU or Cloud Hypervisor, real or the test server)
/// whose command line names instance `id`.
pub fn vmm_of(id: &str) -> Vec<i32> {
    pids_where(|c| c.contains(id) && (c.contains("qemu-system") || c.contains("cloud-hypervisor")))
}

impl Agent {
    /// Holds `path` open (read-write) from a shell inside the agent's PID namespace, as a VMM
    /// holding a VFIO node would; returns the holder once it provably holds the file (it
    /// lets go when dropped or [`Holder::let_go`]).
    pub fn hold_open(&self, path: &Path) -> Holder {
        let (child, nspid) = self.ns_sh(&format!("exec 3<>{}; echo $$; exec sleep 300", path.display()));
        let nspid: i32 = nspid.parse().unwrap_or_else(|_| panic!("holder of {}: {nspid:?}", path.display()));
        let pid =
            wait_for(Duration::from_secs(5), || root_pid_of(nspid, |c| c.contains("sleep 300"))).expect("holder pid");
        assert!(fd_targets(pid).contains(&path.display().to_string()), "the holder holds {}", path.display());
        Holder { child, pid }
    }
}

/// A process holding a file open ([`Agent::hold_open`]).
pub struct Holder {
    child: Child,
    /// Its root-namespace pid.
    pub pid: i32,
}

impl Holder {
    /// SIGKILLs the holder and waits until it is gone.
    pub fn let_go(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), nix::sys::signal::Signal::SIGKILL);
        wait_for(Duration::from_secs(10), || (!alive(self.pid)).then_some(())).expect("the holder is gone");
        let _ = self.child.wait();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if alive(self.pid) {
            self.let_go();
        }
    }
}

/// A Kubernetes ResourceClaim as a claim owner (`claim.prepare`, `claim.release`).
pub fn resource_claim(name: &str, uid: &str) -> Value {
    json!({"kind": "resource_claim", "namespace": "default", "name": name, "uid": uid})
}

/// A network namespace the test owns: held by a `sleep` inside the agent's PID namespace
/// (so the agent can enter it by `/proc/<pid>/ns/net` there), entered from the test through
/// the holder's root-namespace pid. Dropping it kills dnsmasq and the holder.
pub struct NetNs {
    holder: Child,
    /// The holder's pid in the root PID namespace.
    pub host_pid: i32,
    /// The holder's pid inside the agent's PID namespace.
    pub ns_pid: i32,
    /// The dnsmasq serving the namespace, once started.
    pub dnsmasq: Option<Child>,
}

impl NetNs {
    /// A new network namespace, held by a process in `a`'s PID namespace.
    pub fn new(a: &Agent) -> NetNs {
        let holder = a.ns.command("unshare").args(["--net", "sleep", "infinity"]).stdin(Stdio::null()).spawn().unwrap();
        let nsenter_pid = holder.id() as i32;
        // nsenter forks the program as its child: find the sleep and its pid in the namespace.
        let (host_pid, ns_pid) = wait_for(Duration::from_secs(10), || {
            let pid =
                pids_where(|c| c.starts_with("sleep infinity")).into_iter().find(|p| is_descendant(*p, nsenter_pid))?;
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let nspid = status.lines().find(|l| l.starts_with("NSpid:"))?;
            let inner: i32 = nspid.split_whitespace().last()?.parse().ok()?;
            let own = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
            let ours = std::fs::read_link("/proc/self/ns/net").ok()?;
            (own != ours).then_some((pid, inner))
        })
        .expect("the network namespace holder runs");
        NetNs { holder, host_pid, ns_pid, dnsmasq: None }
    }

    /// A command that runs `program` inside the namespace.
    pub fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/proc/{}/ns/net", self.host_pid)).arg("--").arg(program);
        c
    }

    /// Runs `program args` inside the namespace and returns its output.
    pub fn run(&self, program: &str, args: &[&str]) -> std::process::Output {
        self.cmd(program).args(args).stdin(Stdio::null()).output().unwrap()
    }

    /// Runs `program args` inside the namespace; panics when it fails.
    pub fn ok(&self, program: &str, args: &[&str]) {
        let o = self.run(program, args);
        assert!(o.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }

    /// True when the interface `name` exists in the namespace.
    pub fn link_exists(&self, name: &str) -> bool {
        self.run("ip", &["link", "show", "dev", name]).status.success()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Some(mut d) = self.dnsmasq.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.host_pid), nix::sys::signal::Signal::SIGKILL);
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

fn is_descendant(pid: i32, ancestor: i32) -> bool {
    let mut p = pid;
    for _ in 0..8 {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { return false };
        let Some(ppid) = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<i32>().ok())
        else {
            return false;
        };
        if ppid == ancestor {
            return true;
        }
        p = ppid;
    }
    false
}

impl Agent {
    /// Restarts the agent inside `net`'s network namespace (its taps and bridges are there).
    pub fn move_into(&mut self, net: &NetNs) {
        self.kill_agent();
        self.wrap = vec!["nsenter".into(), format!("--net=/proc/{}/ns/net", net.ns_pid), "--".into()];
        self.spawn().unwrap();
        self.wait_ready().unwrap();
    }
}

impl Agent {
    /// Arms the failpoint `fp`, runs `method` (the agent aborts there), restarts the agent
    /// cleanly.
    pub fn crash_at(&mut self, fp: &str, method: &str, params: Value) {
        self.restart_with_failpoints(Some(&format!("{fp}=return"))).unwrap();
        self.wait_ready().unwrap();
        let e = self.call(method, params).unwrap_err();
        assert!(is_transport(&e), "{method} reached {fp} and the agent aborted: {e}");
        assert!(self.wait_agent_gone(Duration::from_secs(30)), "the agent is gone after {fp}");
        self.restart_clean();
    }
}

impl Agent {
    /// The root-namespace pid of the one live QEMU of instance `id`.
    pub fn qemu_pid(&self, id: &str) -> i32 {
        let q: Vec<LiveQemu> = self.live_qemus().into_iter().filter(|q| q.instance_id.as_deref() == Some(id)).collect();
        assert_eq!(q.len(), 1, "one live QEMU for {id}: {q:?}");
        q[0].pid
    }

    /// The command line of the one live QEMU of instance `id`, its arguments joined by spaces.
    pub fn qemu_cmdline(&self, id: &str) -> String {
        let pid = self.qemu_pid(id);
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap()).replace('\0', " ")
    }
}

/// The `(path, value, result)` of every sysfs write the simulator logged after `seq`.
pub fn writes_after(a: &Agent, seq: u64) -> Vec<(String, String, String)> {
    writes(&json!({ "log": log_after(&a.state(), seq) }))
}

/// The `device` of every entry of a reconcile report's list `key` (`released`, `kept`, ...).
pub fn devices_in(report: &Value, key: &str) -> Vec<String> {
    report[key]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|e| e["device"].as_str())
        .map(String::from)
        .collect()
}

/// A QMP-speaking stand-in for `qemu_binary` (a Python script): it answers `--version` like
/// QEMU (the agent probes its binary), runs `setup` (top-level Python; `qmp` is the QMP
/// socket's path, e.g. for a SIGTERM handler), then answers every QMP command (`running` to
/// `query-status`) and holds whatever the agent handed it across exec (its VF's VFIO group,
/// with `hold-fd`) — a VMM whose guest is idle, without a guest.
pub fn qmp_stand_in(setup: &str) -> String {
    format!(
        r#"#!/usr/bin/env python3
import sys
if sys.argv[1:] == ["--version"]:
    print("QEMU emulator version 7.2.0 (test stand-in)")
    sys.exit(0)
import json, os, signal, socket, threading
args = sys.argv[1:]
qmp = args[args.index("-qmp") + 1].split("unix:", 1)[1].split(",", 1)[0]
{setup}
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(qmp)
srv.listen(4)
def serve(c):
    f = c.makefile("rw")
    f.write(json.dumps({{"QMP": {{"version": {{}}, "capabilities": []}}}}) + "\n"); f.flush()
    for line in f:
        cmd = json.loads(line).get("execute")
        ret = {{"status": "running", "running": True}} if cmd == "query-status" else {{}}
        f.write(json.dumps({{"return": ret}}) + "\n"); f.flush()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#
    )
}
