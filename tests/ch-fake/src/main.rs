//! `cloud-hypervisor-fake`: a small, strict test server that imitates the REST API of
//! Cloud Hypervisor v53.0 on a Unix socket, so that gpuvisor's Cloud Hypervisor driver can
//! be tested on a machine whose KVM cannot boot guests.
//!
//! # What it imitates
//!
//! * The command line: `--api-socket path=<socket>` (or a bare path), `--log-file <path>`,
//!   `-v` (repeatable), `--seccomp <x>`, `--version`. A stale socket file at the path is
//!   replaced; the listener is a real listening Unix socket owned by this process (it shows
//!   in `/proc/net/unix` and among `/proc/<pid>/fd`), never handed to another process.
//! * HTTP/1.1 under `/api/v1/`: `vmm.ping`, `vmm.shutdown`, `vm.create`, `vm.boot`,
//!   `vm.info`, `vm.power-button`, `vm.shutdown`, `vm.delete`, `vm.pause`, `vm.resume`,
//!   `vm.add-device`, `vm.remove-device`, with the status codes and error arrays the real
//!   v53.0 binary gives (`["Error from API", <what failed>, <causes>...]`), its state
//!   machine (`vm.shutdown` goes back to `Created`), its boot-time validation (payload,
//!   memory size and alignment, CPU counts, kernel/initramfs/firmware files that cannot be
//!   opened, an SMBIOS UUID that does not parse), `["Bad Request"]` for a wrong method or a
//!   body where none is allowed, `["Not Found"]` for an unknown path.
//! * A guest: at boot, when the serial port is `{"mode":"File"}`, the serial file gets
//!   `boot_serial` (see below); the ACPI power button makes the "guest" power off, which
//!   appends a line to the serial file and makes the process exit 0, as a real VMM does.
//! * SIGTERM and SIGINT: the socket file is removed and the process exits 0.
//!
//! # What it does not imitate
//!
//! * Anything of a real VM: no KVM, no memory, no vCPU threads, no VFIO; a kernel is only
//!   opened (never parsed), a device path is never looked at, `device_tree` is `{}`.
//! * Unknown fields in a request body are a 400 at every level (the real binary ignores
//!   them): on purpose, so that a misspelt field in the driver is caught. Only the VmConfig
//!   subset gpuvisor uses is known (see the structs below), with the real binary's types
//!   (`boot_vcpus`/`max_vcpus` are u32, paths are path strings, `ip`/`mask` IP addresses,
//!   `mac`/`host_mac` MAC addresses) so that a wrong type gets the real error message.
//! * `vm.info` returns the config as received, without the defaults the real binary fills
//!   in; `memory_actual_size` is `memory.size`, or 0 without a `memory` section.
//! * Where the real v53.0 answers 500, the fake answers 409 to a duplicate `vm.add-device`
//!   and 404 to a `vm.remove-device` of an unknown id (same error texts).
//! * A serial or console in mode `File` without `file` (or `Socket` without `socket`) fails
//!   `vm.boot` with a clear 500; the real binary's VMM thread crashes there.
//! * A bad command line exits 1 (the real binary exits 2). No `fd=` sockets, no `--kernel`/`--cpus`/... VM on the command line, no lock file,
//!   no snapshots, no migration, no other endpoint; the state `Shutdown` is never reached.
//!
//! # Test knobs
//!
//! `CH_FAKE_CONTROL` names a JSON file, re-read on every request (absent variable or file:
//! defaults; an unreadable or invalid file, unknown keys included: logged, then defaults).
//! Write it atomically (write a temporary file, then rename) when a fake is running.
//!
//! ```json
//! { "fail": {"vm.boot": {"status": 500, "errors": ["Error from API", "..."]}},
//!   "hang": ["vm.boot"],            // read, never answered (the connection stays open)
//!   "exit_on": ["vm.create"],       // read, then exit 1, socket file left (a crashing VMM)
//!   "ignore_power_button": true,    // vm.power-button answers 204 and nothing happens
//!   "ignore_sigterm": true,         // SIGTERM is logged and ignored
//!   "boot_serial": "text",          // written to the serial file at boot
//!   "poweroff_delay_ms": 100 }      // power button -> power-off line -> exit 0
//! ```
//!
//! Endpoint names are the path after `/api/v1/`. An honoured power button does nothing if
//! the VM was shut down, deleted or paused before the delay ran out; the button of a paused
//! VM answers 204 and does nothing (as the real binary).
//!
//! `CH_FAKE_LOG` (optional) names a file to which every request is appended (O_APPEND) as
//! one JSON line `{"pid", "socket", "method", "path", "body", "status"}`: `body` is the
//! parsed JSON body or null, `status` is null for a request that is hung or exits.
//! Every request is also one line on stderr (and in `--log-file`, when given).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::net::IpAddr;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONNECTION, CONTENT_TYPE, SERVER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};

const API_PREFIX: &str = "/api/v1/";
const VERSION_LINE: &str = "cloud-hypervisor v53.0-fake";
const BUILD_VERSION: &str = "v53.0-fake";
const API_VERSION: &str = "53.0.0";
const PAGE_SIZE: u64 = 4096;
const DEFAULT_POWEROFF_DELAY_MS: u64 = 100;
const POWEROFF_LINE: &str = "fake cloud-hypervisor: ACPI power button: guest powered off\n";
const FIRST_HOTPLUG_SLOT: u32 = 6;
const USAGE: &str = "usage: cloud-hypervisor-fake --api-socket path=<socket> [--log-file <path>] [-v ...] \
                     [--seccomp <x>] | --version";

// ---- Command line ----

struct Args {
    socket: PathBuf,
    log_file: Option<PathBuf>,
}

enum Cli {
    Version,
    Run(Args),
}

/// The value of `--flag value` or `--flag=value`.
fn flag_value(flag: &str, inline: Option<String>, rest: &mut impl Iterator<Item = String>) -> Result<String, String> {
    match inline.or_else(|| rest.next()) {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(format!("{flag} needs a value")),
    }
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Cli, String> {
    let mut rest = args.into_iter();
    let mut socket = None;
    let mut log_file = None;
    while let Some(arg) = rest.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        match flag.as_str() {
            "--version" | "-V" => return Ok(Cli::Version),
            "--api-socket" => {
                let v = flag_value(&flag, inline, &mut rest)?;
                let path = if let Some(p) = v.strip_prefix("path=") {
                    p.to_string()
                } else if v.contains('=') {
                    return Err(format!("--api-socket {v}: only path=<socket> (or a bare path) is supported"));
                } else {
                    v
                };
                if path.is_empty() {
                    return Err("--api-socket: empty path".to_string());
                }
                socket = Some(PathBuf::from(path));
            }
            "--log-file" => log_file = Some(PathBuf::from(flag_value(&flag, inline, &mut rest)?)),
            "--seccomp" => {
                flag_value(&flag, inline, &mut rest)?;
            }
            f if f.len() > 1 && f.starts_with('-') && f[1..].bytes().all(|b| b == b'v') => {}
            _ => return Err(format!("unexpected argument '{arg}'")),
        }
    }
    let socket = socket.ok_or_else(|| "--api-socket path=<socket> is required".to_string())?;
    Ok(Cli::Run(Args { socket, log_file }))
}

// ---- Control file ----

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Control {
    #[serde(default)]
    fail: BTreeMap<String, FailSpec>,
    #[serde(default)]
    hang: Vec<String>,
    #[serde(default)]
    exit_on: Vec<String>,
    #[serde(default)]
    ignore_power_button: bool,
    #[serde(default)]
    ignore_sigterm: bool,
    boot_serial: Option<String>,
    poweroff_delay_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FailSpec {
    status: u16,
    #[serde(default)]
    errors: Vec<String>,
}

fn load_control() -> Control {
    let Some(path) = std::env::var_os("CH_FAKE_CONTROL").filter(|p| !p.is_empty()) else {
        return Control::default();
    };
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            eprintln!("cloud-hypervisor-fake: control file {}: {e}; using defaults", Path::new(&path).display());
            Control::default()
        }),
        Err(e) if e.kind() == ErrorKind::NotFound => Control::default(),
        Err(e) => {
            eprintln!("cloud-hypervisor-fake: control file {}: {e}; using defaults", Path::new(&path).display());
            Control::default()
        }
    }
}

// ---- VmConfig: the subset gpuvisor sends, strictly (unknown fields are errors) ----

// Some fields exist only so that their type is checked; they are never read.
#[allow(dead_code)]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VmConfig {
    payload: Option<PayloadConfig>,
    cpus: Option<CpusConfig>,
    memory: Option<MemoryConfig>,
    serial: Option<ConsoleConfig>,
    console: Option<ConsoleConfig>,
    devices: Option<Vec<DeviceConfig>>,
    disks: Option<Vec<DiskConfig>>,
    net: Option<Vec<NetConfig>>,
    platform: Option<PlatformConfig>,
}

#[allow(dead_code)]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PayloadConfig {
    kernel: Option<PathBuf>,
    firmware: Option<PathBuf>,
    initramfs: Option<PathBuf>,
    cmdline: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CpusConfig {
    boot_vcpus: u32,
    max_vcpus: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemoryConfig {
    size: u64,
}

/// The real binary checks `mode` once the whole object is read (a bad variant is reported
/// at the object's end, and a non-string mode "expected string or map"): so does the fake.
struct ConsoleConfig {
    /// One of `MODES`.
    mode: String,
    file: Option<PathBuf>,
    socket: Option<PathBuf>,
}

const MODES: &[&str] = &["Off", "Pty", "Tty", "File", "Socket", "Null"];

/// `mode` as any JSON value, so that a wrong type is reported after the value (as the real).
struct ModeName(String);

impl<'de> Deserialize<'de> for ModeName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let unexpected = match Value::deserialize(deserializer)? {
            Value::String(name) => return Ok(ModeName(name)),
            Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => de::Unexpected::Unsigned(u),
                (_, Some(i)) => de::Unexpected::Signed(i),
                _ => de::Unexpected::Float(n.as_f64().unwrap_or_default()),
            },
            Value::Bool(b) => de::Unexpected::Bool(b),
            Value::Null => de::Unexpected::Unit,
            Value::Array(_) => de::Unexpected::Seq,
            Value::Object(_) => de::Unexpected::Map,
        };
        Err(de::Error::invalid_type(unexpected, &"string or map"))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConsoleConfig {
    mode: ModeName,
    file: Option<PathBuf>,
    socket: Option<PathBuf>,
}

impl<'de> Deserialize<'de> for ConsoleConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ConsoleVisitor;
        impl<'de> Visitor<'de> for ConsoleVisitor {
            type Value = ConsoleConfig;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("struct ConsoleConfig")
            }
            // The mode is checked inside the object, once all of it is read.
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<ConsoleConfig, A::Error> {
                let raw = RawConsoleConfig::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let ModeName(mode) = raw.mode;
                if !MODES.contains(&mode.as_str()) {
                    return Err(de::Error::unknown_variant(&mode, MODES));
                }
                Ok(ConsoleConfig { mode, file: raw.file, socket: raw.socket })
            }
        }
        deserializer.deserialize_struct("ConsoleConfig", &["mode", "file", "socket"], ConsoleVisitor)
    }
}

/// A MAC address `xx:xx:xx:xx:xx:xx`, refused with the real binary's message otherwise.
struct MacAddr;

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        let octets: Vec<&str> = text.split(':').collect();
        if octets.len() == 6 && octets.iter().all(|o| o.len() == 2 && u8::from_str_radix(o, 16).is_ok()) {
            Ok(MacAddr)
        } else {
            Err(de::Error::custom(format!(
                "The provided MAC address is invalid: parsing of {text} into a MAC address failed"
            )))
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceConfig {
    path: PathBuf,
    id: Option<String>,
}

#[allow(dead_code)]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskConfig {
    path: PathBuf,
    readonly: Option<bool>,
    direct: Option<bool>,
    id: Option<String>,
}

#[allow(dead_code)]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NetConfig {
    tap: Option<String>,
    mac: Option<MacAddr>,
    host_mac: Option<MacAddr>,
    mtu: Option<u16>,
    id: Option<String>,
    ip: Option<IpAddr>,
    mask: Option<IpAddr>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlatformConfig {
    system_uuid: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveDeviceRequest {
    id: String,
}

impl VmConfig {
    fn serial_file(&self) -> Option<&Path> {
        self.serial.as_ref().filter(|s| s.mode == "File").and_then(|s| s.file.as_deref())
    }

    /// Every device id in the config (devices, disks, net).
    fn ids(&self) -> Vec<&str> {
        let devices = self.devices.iter().flatten().filter_map(|d| d.id.as_deref());
        let disks = self.disks.iter().flatten().filter_map(|d| d.id.as_deref());
        let net = self.net.iter().flatten().filter_map(|n| n.id.as_deref());
        devices.chain(disks).chain(net).collect()
    }
}

// ---- Replies ----

enum Reply {
    /// No body (204).
    Empty(StatusCode),
    /// `Content-Type: application/json` with an empty body (vmm.shutdown's 200, and the
    /// 400 of a vm.create without a body, as the real binary does).
    EmptyJson(StatusCode),
    Json(StatusCode, Value),
    Errors(StatusCode, Vec<String>),
}

/// What happens once the reply is on its way.
enum After {
    Nothing,
    /// Close the connection after this reply, then exit 0 (vmm.shutdown).
    ExitAfterReply,
    /// The guest powers off after a delay: the process exits 0 (vm.power-button).
    PowerOff(u64),
}

impl Reply {
    fn status(&self) -> StatusCode {
        match self {
            Reply::Empty(s) | Reply::EmptyJson(s) | Reply::Json(s, _) | Reply::Errors(s, _) => *s,
        }
    }

    fn into_response(self) -> Response<Full<Bytes>> {
        let status = self.status();
        let (json, body) = match self {
            Reply::Empty(_) => (false, Bytes::new()),
            Reply::EmptyJson(_) => (true, Bytes::new()),
            Reply::Json(_, v) => (true, Bytes::from(v.to_string())),
            Reply::Errors(_, e) => (true, Bytes::from(Value::from(e).to_string())),
        };
        let mut resp = Response::new(Full::new(body));
        *resp.status_mut() = status;
        resp.headers_mut().insert(SERVER, HeaderValue::from_static("Cloud Hypervisor API"));
        if json {
            resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        resp
    }
}

fn errors(status: StatusCode, items: &[&str]) -> Reply {
    Reply::Errors(status, items.iter().map(|s| s.to_string()).collect())
}

/// `["Error from API", what, causes...]`, the shape of every VMM-level error.
fn api_error(status: StatusCode, what: &str, causes: Vec<String>) -> Reply {
    let mut items = vec!["Error from API".to_string(), what.to_string()];
    items.extend(causes);
    Reply::Errors(status, items)
}

fn bad_request() -> Reply {
    errors(StatusCode::BAD_REQUEST, &["Bad Request"])
}

fn deserialize_error(e: serde_json::Error) -> Reply {
    Reply::Errors(StatusCode::BAD_REQUEST, vec!["Failed to deserialize JSON".to_string(), e.to_string()])
}

fn strings<const N: usize>(items: [&str; N]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

// ---- State ----

/// Its `Debug` form is the state's name in `vm.info`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum VmState {
    Created,
    Running,
    Paused,
}

struct Vm {
    /// The config as received (with hot-plugged or added devices appended).
    config: Value,
    state: VmState,
}

impl Vm {
    /// The typed view of the stored config (it was validated at vm.create).
    fn typed(&self) -> Result<VmConfig, Reply> {
        serde_json::from_value(self.config.clone()).map_err(|e| {
            api_error(StatusCode::INTERNAL_SERVER_ERROR, "Internal error of the fake", vec![e.to_string()])
        })
    }
}

#[derive(Default)]
struct State {
    vm: Option<Vm>,
    hotplugged: u32,
}

struct Shared {
    socket: PathBuf,
    /// (device, inode) of the socket file this process bound, so that exiting removes it
    /// only if nobody replaced it since.
    socket_id: Option<(u64, u64)>,
    log_file: Option<PathBuf>,
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn log(&self, msg: &str) {
        let line = format!("cloud-hypervisor-fake[{}]: {msg}\n", std::process::id());
        eprint!("{line}");
        if let Some(path) = &self.log_file {
            if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
                let _ = f.write_all(line.as_bytes());
            }
        }
    }

    /// One JSON line in `CH_FAKE_LOG`, written with a single O_APPEND write.
    fn record(&self, method: &Method, path: &str, body: &Bytes, status: Option<u16>) {
        let Some(log) = std::env::var_os("CH_FAKE_LOG").filter(|p| !p.is_empty()) else {
            return;
        };
        let body = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        let mut line = json!({
            "pid": std::process::id(),
            "socket": self.socket.to_string_lossy(),
            "method": method.as_str(),
            "path": path,
            "body": body,
            "status": status,
        })
        .to_string();
        line.push('\n');
        let written =
            OpenOptions::new().create(true).append(true).open(&log).and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            self.log(&format!("CH_FAKE_LOG {}: {e}", Path::new(&log).display()));
        }
    }

    /// Removes the socket file (if it is still the one this process bound) and exits.
    fn exit(&self, code: i32) -> ! {
        let same = std::fs::symlink_metadata(&self.socket).ok().map(|m| (m.dev(), m.ino()));
        if same.is_some() && same == self.socket_id {
            let _ = std::fs::remove_file(&self.socket);
        }
        self.log(&format!("exiting with status {code}"));
        std::process::exit(code)
    }
}

// ---- The API ----

fn dispatch(shared: &Shared, control: &Control, method: &Method, path: &str, body: &Bytes) -> (Reply, After) {
    let Some(endpoint) = path.strip_prefix(API_PREFIX) else {
        return (errors(StatusCode::NOT_FOUND, &["Not Found"]), After::Nothing);
    };
    let (expected, body_rule) = match endpoint {
        "vmm.ping" | "vm.info" => (Method::GET, BodyRule::Ignored),
        "vmm.shutdown" => (Method::PUT, BodyRule::Ignored),
        "vm.create" | "vm.add-device" | "vm.remove-device" => (Method::PUT, BodyRule::Required),
        "vm.boot" | "vm.shutdown" | "vm.power-button" | "vm.delete" | "vm.pause" | "vm.resume" => {
            (Method::PUT, BodyRule::Forbidden)
        }
        _ => return (errors(StatusCode::NOT_FOUND, &["Not Found"]), After::Nothing),
    };
    if *method != expected {
        return (bad_request(), After::Nothing);
    }
    match body_rule {
        BodyRule::Forbidden if !body.is_empty() => return (bad_request(), After::Nothing),
        // The real binary answers a vm.create without a body with an empty 400.
        BodyRule::Required if body.is_empty() && endpoint == "vm.create" => {
            return (Reply::EmptyJson(StatusCode::BAD_REQUEST), After::Nothing)
        }
        BodyRule::Required if body.is_empty() => return (bad_request(), After::Nothing),
        _ => {}
    }

    let mut state = shared.lock();
    let reply = match endpoint {
        "vmm.ping" => Reply::Json(
            StatusCode::OK,
            json!({"build_version": BUILD_VERSION, "version": API_VERSION, "pid": std::process::id(),
                   "features": ["kvm"]}),
        ),
        "vmm.shutdown" => return (Reply::EmptyJson(StatusCode::OK), After::ExitAfterReply),
        "vm.create" => vm_create(&mut state, body),
        "vm.boot" => vm_boot(&mut state, control),
        "vm.info" => vm_info(&state),
        "vm.power-button" => {
            return match state.vm.as_ref().map(|vm| vm.state) {
                Some(VmState::Running) if !control.ignore_power_button => (
                    Reply::Empty(StatusCode::NO_CONTENT),
                    After::PowerOff(control.poweroff_delay_ms.unwrap_or(DEFAULT_POWEROFF_DELAY_MS)),
                ),
                // The real binary accepts the button of a paused VM too.
                Some(VmState::Running | VmState::Paused) => (Reply::Empty(StatusCode::NO_CONTENT), After::Nothing),
                _ => (not_running("Error triggering power button"), After::Nothing),
            };
        }
        "vm.shutdown" => match state.vm.as_mut() {
            Some(vm) if vm.state != VmState::Created => {
                vm.state = VmState::Created;
                Reply::Empty(StatusCode::NO_CONTENT)
            }
            _ => not_running("The VM could not shutdown"),
        },
        "vm.delete" => {
            *state = State::default();
            Reply::Empty(StatusCode::NO_CONTENT)
        }
        "vm.pause" => vm_transition(&mut state, VmState::Running, VmState::Paused),
        "vm.resume" => vm_transition(&mut state, VmState::Paused, VmState::Running),
        "vm.add-device" => vm_add_device(&mut state, body),
        "vm.remove-device" => vm_remove_device(&mut state, body),
        _ => errors(StatusCode::NOT_FOUND, &["Not Found"]),
    };
    (reply, After::Nothing)
}

enum BodyRule {
    Ignored,
    Required,
    Forbidden,
}

fn not_running(what: &str) -> Reply {
    api_error(StatusCode::INTERNAL_SERVER_ERROR, what, strings(["VM is not running"]))
}

fn vm_create(state: &mut State, body: &Bytes) -> Reply {
    if let Err(e) = serde_json::from_slice::<VmConfig>(body) {
        return deserialize_error(e);
    }
    if state.vm.is_some() {
        return api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The VM could not be created",
            strings(["VM is already created"]),
        );
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(config) => {
            state.vm = Some(Vm { config, state: VmState::Created });
            Reply::Empty(StatusCode::NO_CONTENT)
        }
        Err(e) => deserialize_error(e),
    }
}

fn vm_boot(state: &mut State, control: &Control) -> Reply {
    const WHAT: &str = "The VM could not boot";
    let Some(vm) = state.vm.as_mut() else {
        return api_error(StatusCode::NOT_FOUND, WHAT, strings(["VM config is missing"]));
    };
    if vm.state != VmState::Created {
        return api_error(StatusCode::INTERNAL_SERVER_ERROR, WHAT, strings(["VM is already created"]));
    }
    let config = match vm.typed() {
        Ok(c) => c,
        Err(reply) => return reply,
    };
    match boot(&config, control) {
        Ok(()) => {
            vm.state = VmState::Running;
            Reply::Empty(StatusCode::NO_CONTENT)
        }
        Err(causes) => api_error(StatusCode::INTERNAL_SERVER_ERROR, WHAT, causes),
    }
}

/// The checks of the real `vm.boot`, in the order the real binary makes them (observed),
/// then the "guest" boot: the serial (and console) files are created and `boot_serial` is
/// written to the serial file.
fn boot(config: &VmConfig, control: &Control) -> Result<(), Vec<String>> {
    let payload = config.payload.as_ref();
    let kernel = payload.and_then(|p| p.kernel.as_deref());
    let firmware = payload.and_then(|p| p.firmware.as_deref());
    let Some(boot_item) = kernel.or(firmware) else {
        return Err(strings([
            "Failed to validate config",
            "Payload configuration is not bootable",
            "No bootitem provided: neither firmware nor kernel",
        ]));
    };
    if let Some(memory) = &config.memory {
        if memory.size == 0 {
            return Err(strings(["Memory manager error", "No memory zones found"]));
        }
        if memory.size % PAGE_SIZE != 0 {
            return Err(strings([
                "Memory manager error",
                "Memory size is misaligned with default page size or its hugepage size",
            ]));
        }
    }
    if let Some(cpus) = &config.cpus {
        if cpus.boot_vcpus > cpus.max_vcpus {
            return Err(vec![
                "Failed to validate config".to_string(),
                format!("Max CPUs ({}) lower than boot CPUs ({})", cpus.max_vcpus, cpus.boot_vcpus),
            ]);
        }
    }
    for (name, port) in [("serial", &config.serial), ("console", &config.console)] {
        let Some(port) = port else { continue };
        let missing = match port.mode.as_str() {
            "File" if port.file.is_none() => Some("File` needs `file"),
            "Socket" if port.socket.is_none() => Some("Socket` needs `socket"),
            _ => None,
        };
        if let Some(missing) = missing {
            return Err(vec![
                "Failed to validate config".to_string(),
                format!("{name}: mode `{missing}` (the real v53.0 VMM thread crashes here)"),
            ]);
        }
    }
    let open = |path: &Path, what: &str| File::open(path).map(drop).map_err(|e| vec![what.to_string(), e.to_string()]);
    if let Some(initramfs) = payload.and_then(|p| p.initramfs.as_deref()) {
        open(initramfs, "Cannot open initramfs file")?;
    }
    match kernel {
        Some(kernel) => open(kernel, "Cannot open kernel file")?,
        None => open(boot_item, "Error manipulating firmware file")?,
    }
    if let Some(uuid) = config.platform.as_ref().and_then(|p| p.system_uuid.as_deref()) {
        if let Err(e) = uuid::Uuid::parse_str(uuid) {
            return Err(vec![
                "Cannot configure system".to_string(),
                "Platform specific error (x86_64)".to_string(),
                "Error setting up SMBIOS table".to_string(),
                format!("Failure to parse uuid: {uuid}"),
                e.to_string(),
            ]);
        }
    }
    let console_file = config.console.as_ref().filter(|c| c.mode == "File").and_then(|c| c.file.as_deref());
    if let Some(path) = console_file {
        append(path, "").map_err(|e| vec!["Error creating console output file".to_string(), e.to_string()])?;
    }
    if let Some(path) = config.serial_file() {
        let text = match &control.boot_serial {
            Some(text) => text.clone(),
            None => format!("fake cloud-hypervisor: booting {}\ngpuvisor-guest: ready\n", boot_item.display()),
        };
        append(path, &text).map_err(|e| vec!["Error creating serial output file".to_string(), e.to_string()])?;
    }
    Ok(())
}

fn append(path: &Path, text: &str) -> std::io::Result<()> {
    OpenOptions::new().create(true).append(true).open(path)?.write_all(text.as_bytes())
}

fn vm_info(state: &State) -> Reply {
    let Some(vm) = state.vm.as_ref() else {
        return api_error(StatusCode::NOT_FOUND, "The VM info is not available", strings(["VM is not created"]));
    };
    let memory = vm.config.get("memory").and_then(|m| m.get("size")).and_then(Value::as_u64).unwrap_or(0);
    Reply::Json(
        StatusCode::OK,
        json!({"config": vm.config, "state": format!("{:?}", vm.state), "memory_actual_size": memory, "device_tree": {}}),
    )
}

fn vm_transition(state: &mut State, from: VmState, to: VmState) -> Reply {
    let (what, verb, component) = match to {
        VmState::Paused => ("The VM could not be paused", "Cannot pause VM", "Failed to pause migratable component"),
        _ => ("The VM could not resume", "Cannot resume VM", "Failed to resume migratable component"),
    };
    match state.vm.as_mut() {
        Some(vm) if vm.state == from => {
            vm.state = to;
            Reply::Empty(StatusCode::NO_CONTENT)
        }
        Some(vm) if vm.state == to => api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            what,
            vec![
                verb.to_string(),
                component.to_string(),
                format!("Invalid transition: InvalidStateTransition({to:?}, {to:?})"),
            ],
        ),
        _ => not_running(what),
    }
}

fn vm_add_device(state: &mut State, body: &Bytes) -> Reply {
    const WHAT: &str = "The device could not be added to the VM";
    let device: DeviceConfig = match serde_json::from_slice(body) {
        Ok(d) => d,
        Err(e) => return deserialize_error(e),
    };
    let mut entry: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let hotplugged = state.hotplugged;
    let Some(vm) = state.vm.as_mut() else {
        return api_error(StatusCode::NOT_FOUND, WHAT, strings(["VM is not created"]));
    };
    let config = match vm.typed() {
        Ok(c) => c,
        Err(reply) => return reply,
    };
    let invalid =
        |cause: String| api_error(StatusCode::CONFLICT, WHAT, vec!["Failed to validate config".into(), cause]);
    if config.devices.iter().flatten().any(|d| d.path == device.path) {
        return invalid(format!("Duplicated device path: {}", device.path.display()));
    }
    let ids = config.ids();
    if let Some(id) = device.id.as_deref().filter(|id| ids.contains(id)) {
        return invalid(format!("Identifier {id} is not unique"));
    }
    let hot = vm.state != VmState::Created;
    let id = match device.id {
        Some(id) => id,
        None => (0..).map(|n| format!("_vfio{n}")).find(|id| !ids.contains(&id.as_str())).unwrap_or_default(),
    };
    if hot {
        // A hot-plugged device gets its id at once; one added before boot keeps none.
        entry["id"] = Value::from(id.clone());
    }
    match vm.config.get_mut("devices") {
        Some(Value::Array(list)) => list.push(entry),
        _ => vm.config["devices"] = Value::Array(vec![entry]),
    }
    if !hot {
        return Reply::Empty(StatusCode::NO_CONTENT);
    }
    state.hotplugged = hotplugged + 1;
    let bdf = format!("0000:00:{:02x}.0", FIRST_HOTPLUG_SLOT + hotplugged);
    Reply::Json(StatusCode::OK, json!({"id": id, "bdf": bdf}))
}

fn vm_remove_device(state: &mut State, body: &Bytes) -> Reply {
    const WHAT: &str = "The device could not be removed from the VM";
    let request: RemoveDeviceRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return deserialize_error(e),
    };
    let Some(vm) = state.vm.as_mut() else {
        return api_error(StatusCode::NOT_FOUND, WHAT, strings(["VM is not created"]));
    };
    for section in ["devices", "disks", "net"] {
        if let Some(Value::Array(list)) = vm.config.get_mut(section) {
            if let Some(at) = list.iter().position(|d| d.get("id").and_then(Value::as_str) == Some(&request.id)) {
                list.remove(at);
                return Reply::Empty(StatusCode::NO_CONTENT);
            }
        }
    }
    api_error(StatusCode::NOT_FOUND, WHAT, vec![format!("No device with id \"{}\" to remove", request.id)])
}

// ---- Serving ----

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    exit_after: Arc<AtomicBool>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let method = req.method().clone();
    // The real binary matches the whole target: `vmm.ping?x=1` is not found.
    let path = req.uri().path_and_query().map_or_else(|| req.uri().path().to_string(), |p| p.as_str().to_string());
    let body = match req.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            shared.log(&format!("{method} {path}: reading the body: {e}"));
            Bytes::new()
        }
    };
    let control = load_control();
    let endpoint = path.strip_prefix(API_PREFIX).unwrap_or(&path).to_string();

    if control.exit_on.contains(&endpoint) {
        shared.record(&method, &path, &body, None);
        shared.log(&format!("{method} {path} -> no answer: exit_on, the VMM crashes"));
        std::process::exit(1);
    }
    if control.hang.contains(&endpoint) {
        shared.record(&method, &path, &body, None);
        shared.log(&format!("{method} {path} -> no answer: hang"));
        return std::future::pending().await;
    }

    let (reply, after) = match control.fail.get(&endpoint) {
        Some(fail) => {
            let status = StatusCode::from_u16(fail.status).unwrap_or_else(|_| {
                shared.log(&format!("control: fail.{endpoint}: bad status {}; using 500", fail.status));
                StatusCode::INTERNAL_SERVER_ERROR
            });
            (Reply::Errors(status, fail.errors.clone()), After::Nothing)
        }
        None => dispatch(&shared, &control, &method, &path, &body),
    };
    let status = reply.status();
    shared.record(&method, &path, &body, Some(status.as_u16()));
    shared.log(&format!("{method} {path} {}", status.as_u16()));
    let mut response = reply.into_response();
    match after {
        After::Nothing => {}
        After::ExitAfterReply => {
            // hyper closes the connection once this reply is written; `serve` then exits.
            response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            exit_after.store(true, Ordering::SeqCst);
        }
        After::PowerOff(delay_ms) => {
            tokio::spawn(power_off(shared.clone(), delay_ms));
        }
    }
    Ok(response)
}

/// The guest answers the ACPI power button: it powers off and the VMM exits 0 — unless
/// the VM was shut down, deleted or paused in the meantime.
async fn power_off(shared: Arc<Shared>, delay_ms: u64) {
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    let serial = {
        let state = shared.lock();
        match state.vm.as_ref().filter(|vm| vm.state == VmState::Running) {
            Some(vm) => vm.typed().ok().and_then(|c| c.serial_file().map(Path::to_path_buf)),
            None => {
                shared.log("power button: the VM is no longer running; nothing happens");
                return;
            }
        }
    };
    if let Some(path) = serial {
        if let Err(e) = append(&path, POWEROFF_LINE) {
            shared.log(&format!("serial file {}: {e}", path.display()));
        }
    }
    shared.log("guest powered off");
    shared.exit(0);
}

async fn serve(shared: Arc<Shared>, stream: UnixStream) {
    let exit_after = Arc::new(AtomicBool::new(false));
    let service = {
        let (shared, exit_after) = (shared.clone(), exit_after.clone());
        service_fn(move |req| handle(shared.clone(), req, exit_after.clone()))
    };
    if let Err(e) = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await {
        shared.log(&format!("connection: {e}"));
    }
    if exit_after.load(Ordering::SeqCst) {
        shared.exit(0);
    }
}

async fn run(args: Args) -> i32 {
    let fail = |msg: String| {
        eprintln!("cloud-hypervisor-fake: error: {msg}");
        1
    };
    // Handlers first: a SIGTERM that arrives as soon as the socket exists must find them.
    let (mut sigterm, mut sigint) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => return fail(format!("signal handlers: {e}")),
    };
    match std::fs::symlink_metadata(&args.socket) {
        Ok(m) if m.file_type().is_socket() => {
            if let Err(e) = std::fs::remove_file(&args.socket) {
                return fail(format!("removing the stale socket {}: {e}", args.socket.display()));
            }
        }
        Ok(_) => return fail(format!("{} exists and is not a socket", args.socket.display())),
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return fail(format!("{}: {e}", args.socket.display())),
    }
    let listener = match UnixListener::bind(&args.socket) {
        Ok(l) => l,
        Err(e) => return fail(format!("binding {}: {e}", args.socket.display())),
    };
    let socket_id = std::fs::symlink_metadata(&args.socket).ok().map(|m| (m.dev(), m.ino()));
    let shared = Arc::new(Shared {
        socket: args.socket,
        socket_id,
        log_file: args.log_file,
        state: Mutex::new(State::default()),
    });
    shared.log(&format!("{VERSION_LINE}: listening on {}", shared.socket.display()));
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(serve(shared.clone(), stream));
                }
                Err(e) => {
                    shared.log(&format!("accept: {e}"));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = sigterm.recv() => {
                if load_control().ignore_sigterm {
                    shared.log("SIGTERM ignored (ignore_sigterm)");
                } else {
                    shared.log("SIGTERM");
                    shared.exit(0);
                }
            }
            _ = sigint.recv() => {
                shared.log("SIGINT");
                shared.exit(0);
            }
        }
    }
}

fn main() {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Cli::Version) => {
            println!("{VERSION_LINE}");
            return;
        }
        Ok(Cli::Run(args)) => args,
        Err(e) => {
            eprintln!("cloud-hypervisor-fake: error: {e}\n{USAGE}");
            std::process::exit(1);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cloud-hypervisor-fake: error: tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    std::process::exit(runtime.block_on(run(args)));
}
