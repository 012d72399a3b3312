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
//!   `vm.reboot` (a booted VM's boot text comes again), `vm.counters` (zeros), `vm.add-device`, `vm.remove-device`,
//!   `vm.add-net`, `vm.snapshot`, `vm.restore`, with
//!   the status codes and error arrays the real v53.0 binary gives (`["Error from API",
//!   <what failed>, <causes>...]`), its state machine (`vm.shutdown` goes back to
//!   `Created`), its boot-time validation (payload, memory size and alignment, CPU counts,
//!   ids that are not unique, disks, kernel/initramfs/firmware files that cannot be opened,
//!   an SMBIOS UUID that does not parse), `["Bad Request"]` for a wrong method or a body
//!   where none is allowed (or none where one is required), `["Not Found"]` for an unknown
//!   path.
//! * Disks (`disks: [{path, readonly?, direct?, id?, backing_files?: bool, image_type?:
//!   "FixedVhd"|"Qcow2"|"Raw"|"Vhdx"|"Unknown"}]`): at vm.boot each disk is opened
//!   (read-only if `readonly`, else read-write) and its type detected (qcow2 magic
//!   `QFI\xfb`, else raw); a qcow2 naming a backing file is refused unless `backing_files`
//!   is true, then the backing file (relative to the overlay's directory) is opened
//!   read-only; `image_type` `Raw`/`Qcow2` must match what is detected. The errors are the
//!   real ones. The files are held open while the VM is booted (closed at vm.shutdown and
//!   vm.delete, as the real binary does), so a test sees them among `/proc/<pid>/fd`.
//! * NICs by fd: `PUT vm.add-net` with a NetConfig body; the fds passed as SCM_RIGHTS
//!   ancillary data on the connection (every read of a connection is a recvmsg) belong to
//!   the request. Before boot: 204 and the entry (with `"fds": [<fd numbers in the fake>]`)
//!   appended to `net`; after boot: hot-plugged, 200 `{"id", "bdf"}` (id `_net<n>` if none);
//!   without VM: 404. One fd per NIC (the default 2 queues); a duplicate id is the real's
//!   500. The fds are held while the VM exists (also across vm.shutdown, as the real).
//!   `fds` in a vm.create body are ignored, with the real's warning on stderr.
//! * The serial port in mode `Socket`: bound at vm.create, as the real binary does (an
//!   existing file, a stale socket included, is EADDRINUSE: vm.create answers 500 and keeps
//!   the VM; vm.boot tries again), removed at vm.shutdown and vm.delete, bound again at
//!   boot. One client at a time: a new client replaces the connected one (which reads EOF),
//!   as with the real. What the "guest" writes (boot text, flood, power-off line, restore
//!   line) goes to the client; every byte a client sends is echoed back (a guest shell's
//!   echo).
//! * A guest: at boot, the serial port (mode `File` or `Socket`) gets `boot_serial` (see
//!   below); the ACPI power button makes the "guest" power off, which writes a line to the
//!   serial port and makes the process exit 0, as a real VMM does.
//! * Snapshots: `PUT vm.snapshot {"destination_url": "file:///<dir>"}` needs a Paused VM
//!   (the real's errors for a running VM, a created one, none); the fake writes
//!   `config.json` (the stored config, fd numbers included), `state.json` (`{"snapshots":
//!   {}, "fake": ..., "serial_written": <bytes>}`) and `memory-ranges` into the directory,
//!   which must exist. `PUT vm.restore {"source_url": "file:///<dir>", "prefault"?: bool,
//!   "resume"?: bool, "memory_restore_mode"?: "Copy"|"OnDemand", "net_fds"?: [{"id": str,
//!   "num_fds": usize, "fds"?: [int]}]}` (the real v53 RestoreConfig) on a VMM without VM:
//!   the real's errors for a bad URL, a missing directory, a missing or bad `config.json`
//!   or `state.json`; with `net_fds`, the number of fds passed by SCM_RIGHTS must be the
//!   sum of `num_fds` (else a bare 400, as the real); they replace, in order, the `fds` of
//!   the net entries with those ids. The VM is then `Paused` (`Running` with `resume`),
//!   its disks open, its serial socket bound, and instead of a boot text the serial port
//!   gets `fake cloud-hypervisor: restored from <dir>\n`.
//! * SIGTERM and SIGINT: the socket file is removed and the process exits 0.
//!
//! # What it does not imitate
//!
//! * Anything of a real VM: no KVM, no memory, no vCPU threads, no VFIO; a kernel is only
//!   opened (never parsed), a device path is never looked at, `device_tree` is `{}`; a tap
//!   fd is never looked at (any fd does); a qcow2 header is read for its magic and backing
//!   file name only (the real checks all of it), `FixedVhd`/`Vhdx` are not checked.
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
//!   `vm.boot` with a clear 500; the real binary's VMM thread crashes there. A serial file
//!   is created at boot (the real opens it at vm.create).
//! * Serial output produced while no client is connected to the serial socket is kept and
//!   delivered to the next client (a choice of the fake, so that a test sees the boot text
//!   whenever it connects; whether the real keeps it could not be seen here, its guest
//!   never runs).
//! * After a successful vm.create, the real binary keeps its console devices across
//!   vm.delete: a later vm.create whose serial socket cannot be bound answers 500, and its
//!   vm.boot then boots without the socket. The fake tries to bind again at every boot.
//! * Snapshots succeed (the real fails on this machine's KVM: GetNestedState); a snapshot
//!   into a missing directory answers `["Error from API", "The VM could not be
//!   snapshotted", "Cannot send VM snapshot", "Failed to send migratable component
//!   snapshot", "Destination is not a directory: \"<dir>\""]` (not seen on the real).
//!   A restore whose snapshot has a net entry with fds but no `net_fds` for its id answers
//!   500 `["Error from API", "The VM could not be restored", "Failed to validate config",
//!   "Net id <id> is associated with FDs and is required"]` (not seen on the real either).
//!   `prefault` and `memory_restore_mode` are accepted and do nothing.
//! * A bad command line exits 1 (the real binary exits 2). No `fd=` sockets, no `--kernel`/`--cpus`/... VM on the command line, no lock file,
//!   no migration, no other endpoint; the state `Shutdown` is never reached.
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
//!   "boot_serial": "text",          // written to the serial port at boot
//!   "serial_flood_bytes": 1000000,  // then this many bytes of "flood 000001 xxx...\n" lines
//!   "poweroff_delay_ms": 100 }      // power button -> power-off line -> exit 0
//! ```
//!
//! Endpoint names are the path after `/api/v1/`. An honoured power button does nothing if
//! the VM was shut down, deleted or paused before the delay ran out; the button of a paused
//! VM answers 204 and does nothing (as the real binary).
//!
//! `CH_FAKE_LOG` (optional) names a file to which every request is appended (O_APPEND) as
//! one JSON line `{"pid", "socket", "method", "path", "body", "fds", "status"}`: `body` is
//! the parsed JSON body or null, `fds` what each fd passed with the request is (the target
//! of `/proc/self/fd/N`, e.g. `"/dev/net/tun"`; `[]` when none), `status` is null for a
//! request that is hung or exits. Every request is also one line on stderr (and in
//! `--log-file`, when given).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, IoSliceMut, Read, Write};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONNECTION, CONTENT_TYPE, SERVER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, oneshot};

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
    serial_flood_bytes: Option<u64>,
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
    backing_files: Option<bool>,
    image_type: Option<ImageType>,
}

/// The real v53.0 variants, in the order its error message lists them.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
enum ImageType {
    FixedVhd,
    Qcow2,
    Raw,
    Vhdx,
    Unknown,
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
    /// In a vm.create body the real binary ignores them (with a warning): so does the fake.
    fds: Option<Vec<i32>>,
}

#[allow(dead_code)]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotConfig {
    destination_url: String,
}

#[allow(dead_code)]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RestoreConfig {
    source_url: PathBuf,
    prefault: Option<bool>,
    resume: Option<bool>,
    memory_restore_mode: Option<MemoryRestoreMode>,
    net_fds: Option<Vec<RestoredNetConfig>>,
}

#[derive(Deserialize)]
enum MemoryRestoreMode {
    Copy,
    OnDemand,
}

#[allow(dead_code)]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RestoredNetConfig {
    id: String,
    #[serde(default)]
    num_fds: usize,
    /// Replaced by the received fds (as the real binary does).
    fds: Option<Vec<i32>>,
}

/// `state.json` of a fake snapshot (`snapshots` is required, as in the real one).
#[derive(Deserialize)]
struct SnapshotState {
    #[allow(dead_code)]
    snapshots: Value,
    #[serde(default)]
    serial_written: u64,
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

    fn serial_socket(&self) -> Option<&Path> {
        self.serial.as_ref().filter(|s| s.mode == "Socket").and_then(|s| s.socket.as_deref())
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
    /// The config as received (with hot-plugged or added devices appended, and the numbers
    /// of the tap fds this process holds in `net[].fds`).
    config: Value,
    state: VmState,
    /// Tap fds received with vm.add-net or vm.restore: held while the VM exists.
    net_fds: Vec<OwnedFd>,
    /// Disk files (and qcow2 backing files, read-only) opened at boot: held while booted.
    disks: Vec<File>,
    /// The serial port in mode `Socket`: bound at vm.create (again at boot or restore).
    serial: Option<SerialSocket>,
    /// Bytes the "guest" wrote to its serial port (kept across a snapshot).
    serial_written: u64,
}

impl Vm {
    fn new(config: Value, state: VmState) -> Vm {
        Vm { config, state, net_fds: Vec::new(), disks: Vec::new(), serial: None, serial_written: 0 }
    }

    /// The typed view of the stored config (it was validated at vm.create).
    fn typed(&self) -> Result<VmConfig, Reply> {
        serde_json::from_value(self.config.clone()).map_err(|e| {
            api_error(StatusCode::INTERNAL_SERVER_ERROR, "Internal error of the fake", vec![e.to_string()])
        })
    }

    /// Binds the serial socket if the config wants one and it is not bound yet.
    fn bind_serial(&mut self, config: &VmConfig) -> Result<(), Vec<String>> {
        if let (Some(path), None) = (config.serial_socket(), &self.serial) {
            let socket = SerialSocket::bind(path).map_err(|e| {
                vec!["Error creating console devices".into(), "Error creating console device".into(), e.to_string()]
            })?;
            self.serial = Some(socket);
        }
        Ok(())
    }

    /// What the "guest" writes on its serial port: appended to the serial file, or sent to
    /// the serial socket's client. The receiver, if any, fires once the bytes are delivered
    /// to a client or kept for the next one.
    fn guest_writes(&mut self, config: &VmConfig, text: &[u8]) -> std::io::Result<Option<oneshot::Receiver<()>>> {
        self.serial_written += text.len() as u64;
        if let Some(path) = config.serial_file() {
            OpenOptions::new().create(true).append(true).open(path)?.write_all(text)?;
            return Ok(None);
        }
        Ok(self.serial.as_ref().map(|socket| socket.send(text.to_vec())))
    }

    /// The VM goes back to `Created`: the disks are closed, the serial socket removed (as
    /// the real binary does at vm.shutdown); the tap fds stay with the config.
    fn shut_down(&mut self) {
        self.state = VmState::Created;
        self.disks.clear();
        self.serial = None;
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
    fn record(&self, method: &Method, path: &str, body: &Bytes, fds: &[String], status: Option<u16>) {
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
            "fds": fds,
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

// ---- The serial port in mode Socket ----

struct SerialOut {
    data: Vec<u8>,
    done: oneshot::Sender<()>,
}

/// A listening socket served by a task: one client at a time (a new client replaces the
/// connected one, which gets EOF, as with the real binary), the guest's output goes to the
/// client or, without one, is kept for the next client; what a client sends is echoed back.
struct SerialSocket {
    path: PathBuf,
    id: Option<(u64, u64)>,
    tx: mpsc::UnboundedSender<SerialOut>,
    task: tokio::task::JoinHandle<()>,
}

impl SerialSocket {
    /// Binds without replacing anything: an existing file is EADDRINUSE, as with the real.
    fn bind(path: &Path) -> std::io::Result<SerialSocket> {
        let listener = UnixListener::bind(path)?;
        let id = std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()));
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(serial_task(listener, rx));
        Ok(SerialSocket { path: path.to_path_buf(), id, tx, task })
    }

    fn send(&self, data: Vec<u8>) -> oneshot::Receiver<()> {
        let (done, receiver) = oneshot::channel();
        let _ = self.tx.send(SerialOut { data, done });
        receiver
    }
}

impl Drop for SerialSocket {
    fn drop(&mut self) {
        self.task.abort();
        let same = std::fs::symlink_metadata(&self.path).ok().map(|m| (m.dev(), m.ino()));
        if same.is_some() && same == self.id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

async fn serial_task(listener: UnixListener, mut rx: mpsc::UnboundedReceiver<SerialOut>) {
    let mut pending: Vec<u8> = Vec::new();
    let mut client: Option<UnixStream> = None;
    let mut buf = vec![0u8; 4096];
    loop {
        let read = async {
            match client.as_mut() {
                Some(c) => c.read(&mut buf).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((mut stream, _)) = accepted else { continue };
                if !pending.is_empty() {
                    if stream.write_all(&pending).await.is_err() {
                        continue;
                    }
                    pending.clear();
                }
                // The previous client, if any, is dropped: it reads EOF.
                client = Some(stream);
            }
            out = rx.recv() => {
                let Some(out) = out else { return };
                let delivered = match client.as_mut() {
                    Some(c) => c.write_all(&out.data).await.is_ok(),
                    None => false,
                };
                if !delivered {
                    client = None;
                    pending.extend_from_slice(&out.data);
                }
                let _ = out.done.send(());
            }
            n = read => match n {
                Ok(0) | Err(_) => client = None,
                Ok(n) => {
                    let echo = buf[..n].to_vec();
                    if let Some(c) = client.as_mut() {
                        if c.write_all(&echo).await.is_err() {
                            client = None;
                        }
                    }
                }
            },
        }
    }
}

// ---- The connection: reads with recvmsg, so that SCM_RIGHTS fds are received ----

/// The accepted stream; every read is a recvmsg, and the fds passed with it are collected
/// in `fds` (taken by the request handler).
struct FdStream {
    inner: UnixStream,
    fds: Arc<Mutex<Vec<OwnedFd>>>,
}

fn recv_with_fds(fd: RawFd, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([RawFd; 32]);
    let msg =
        recvmsg::<()>(fd, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC).map_err(std::io::Error::from)?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            // SAFETY: the kernel just installed these fds in this process; nobody else owns them.
            fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    Ok((msg.bytes, fds))
}

impl AsyncRead for FdStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            match this.inner.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
            }
            let fd = this.inner.as_raw_fd();
            let unfilled = buf.initialize_unfilled();
            match this.inner.try_io(Interest::READABLE, || recv_with_fds(fd, unfilled)) {
                Ok((n, fds)) => {
                    if !fds.is_empty() {
                        this.fds.lock().unwrap_or_else(|e| e.into_inner()).extend(fds);
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for FdStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// What an fd is, for the log: the target of `/proc/self/fd/N` (e.g. `/dev/net/tun`).
fn describe_fd(fd: &OwnedFd) -> String {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|e| format!("fd {}: {e}", fd.as_raw_fd()))
}

// ---- The API ----

fn dispatch(
    shared: &Shared,
    control: &Control,
    method: &Method,
    path: &str,
    body: &Bytes,
    fds: Vec<OwnedFd>,
) -> (Reply, After) {
    let Some(endpoint) = path.strip_prefix(API_PREFIX) else {
        return (errors(StatusCode::NOT_FOUND, &["Not Found"]), After::Nothing);
    };
    let (expected, body_rule) = match endpoint {
        "vmm.ping" | "vm.info" | "vm.counters" => (Method::GET, BodyRule::Ignored),
        "vmm.shutdown" => (Method::PUT, BodyRule::Ignored),
        "vm.create" | "vm.add-device" | "vm.remove-device" | "vm.add-net" | "vm.snapshot" | "vm.restore" => {
            (Method::PUT, BodyRule::Required)
        }
        "vm.boot" | "vm.shutdown" | "vm.power-button" | "vm.delete" | "vm.pause" | "vm.resume" | "vm.reboot" => {
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
        "vm.create" => vm_create(shared, &mut state, body),
        "vm.boot" => vm_boot(&mut state, control),
        "vm.info" => vm_info(&state),
        "vm.counters" => vm_counters(&state),
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
                vm.shut_down();
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
        "vm.reboot" => vm_reboot(&mut state, control),
        "vm.add-device" => vm_add_device(&mut state, body),
        "vm.remove-device" => vm_remove_device(&mut state, body),
        "vm.add-net" => vm_add_net(&mut state, body, fds),
        "vm.snapshot" => vm_snapshot(&mut state, body),
        "vm.restore" => vm_restore(&mut state, body, fds),
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

fn vm_create(shared: &Shared, state: &mut State, body: &Bytes) -> Reply {
    let typed = match serde_json::from_slice::<VmConfig>(body) {
        Ok(c) => c,
        Err(e) => return deserialize_error(e),
    };
    if state.vm.is_some() {
        return api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The VM could not be created",
            strings(["VM is already created"]),
        );
    }
    let mut config = match serde_json::from_slice::<Value>(body) {
        Ok(config) => config,
        Err(e) => return deserialize_error(e),
    };
    // fds in a vm.create body are ignored, with a warning (as the real binary does).
    if let Some(Value::Array(net)) = config.get_mut("net") {
        for entry in net.iter_mut().filter_map(Value::as_object_mut) {
            if entry.remove("fds").is_some() {
                shared.log(&format!(
                    "FD numbers were present in HTTP request body for device {:?} but will be ignored",
                    entry.get("id").and_then(Value::as_str)
                ));
            }
        }
    }
    // The real binary creates the console devices (binds the serial socket) at vm.create;
    // when that fails the VM is kept anyway, and vm.boot tries again.
    let mut vm = Vm::new(config, VmState::Created);
    let bound = vm.bind_serial(&typed);
    state.vm = Some(vm);
    match bound {
        Ok(()) => Reply::Empty(StatusCode::NO_CONTENT),
        Err(causes) => api_error(StatusCode::INTERNAL_SERVER_ERROR, "The VM could not be created", causes),
    }
}

/// `vm.reboot`: a booted VM (running or paused) resets and runs: the guest's boot text
/// comes again on its serial port. Before a boot (no VM, or only created) the real v53.0
/// answers 404 "VM is not created".
fn vm_reboot(state: &mut State, control: &Control) -> Reply {
    const WHAT: &str = "The VM could not reboot";
    let Some(vm) = state.vm.as_mut().filter(|vm| vm.state != VmState::Created) else {
        return api_error(StatusCode::NOT_FOUND, WHAT, strings(["VM is not created"]));
    };
    let config = match vm.typed() {
        Ok(c) => c,
        Err(reply) => return reply,
    };
    let boot_item = config.payload.as_ref().and_then(|p| p.kernel.clone().or_else(|| p.firmware.clone()));
    let text = match &control.boot_serial {
        Some(text) => text.clone(),
        None => format!(
            "fake cloud-hypervisor: rebooting\nfake cloud-hypervisor: booting {}\ngpuvisor-guest: ready\n",
            boot_item.unwrap_or_default().display()
        ),
    };
    vm.state = VmState::Running;
    match vm.guest_writes(&config, text.as_bytes()) {
        Ok(_) => Reply::Empty(StatusCode::NO_CONTENT),
        Err(e) => api_error(StatusCode::INTERNAL_SERVER_ERROR, WHAT, vec![e.to_string()]),
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
    match boot(vm, &config, control) {
        Ok(()) => {
            vm.state = VmState::Running;
            Reply::Empty(StatusCode::NO_CONTENT)
        }
        Err(causes) => api_error(StatusCode::INTERNAL_SERVER_ERROR, WHAT, causes),
    }
}

/// The checks of the real `vm.boot`, in the order the real binary makes them (observed):
/// the serial socket is bound (if it is not yet), the config validated, the disks opened,
/// the payload files opened; then the "guest" boots: the serial (and console) files are
/// created and the boot text (then `serial_flood_bytes` more bytes) goes to the serial port.
fn boot(vm: &mut Vm, config: &VmConfig, control: &Control) -> Result<(), Vec<String>> {
    // The console devices come first (before the config is validated), as with the real.
    vm.bind_serial(config)?;
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
    let ids = config.ids();
    if let Some((_, id)) = ids.iter().enumerate().find(|(at, id)| ids[..*at].contains(id)) {
        return Err(vec!["Failed to validate config".to_string(), format!("Identifier {id} is not unique")]);
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
    let mut disks = Vec::new();
    for disk in config.disks.iter().flatten() {
        disks.extend(open_disk(disk).map_err(|causes| {
            let mut all = vec!["Error from device manager".to_string()];
            all.extend(causes);
            all
        })?);
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
    let text = match &control.boot_serial {
        Some(text) => text.clone(),
        None => format!("fake cloud-hypervisor: booting {}\ngpuvisor-guest: ready\n", boot_item.display()),
    };
    let mut output = text.into_bytes();
    output.extend(flood(control.serial_flood_bytes.unwrap_or(0)));
    vm.guest_writes(config, &output)
        .map_err(|e| vec!["Error creating serial output file".to_string(), e.to_string()])?;
    vm.disks = disks;
    Ok(())
}

/// `n` bytes of numbered text lines, the last one cut short if need be.
fn flood(n: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(n as usize);
    let mut line_no = 0u64;
    while (out.len() as u64) < n {
        line_no += 1;
        out.extend_from_slice(format!("flood {line_no:06} {}\n", "x".repeat(50)).as_bytes());
    }
    out.truncate(n as usize);
    out
}

/// Opens a disk as the real binary does at boot: read-only or read-write, the image type
/// detected (qcow2 magic, else raw), a qcow2 backing file opened read-only when
/// `backing_files` is true and refused otherwise. Returns the files to hold.
fn open_disk(disk: &DiskConfig) -> Result<Vec<File>, Vec<String>> {
    let path = &disk.path;
    let io_error = |e: std::io::Error| {
        vec!["Cannot open disk path".to_string(), format!("I/O error (path={} op=open)", path.display()), e.to_string()]
    };
    let readonly = disk.readonly.unwrap_or(false);
    let mut file = OpenOptions::new().read(true).write(!readonly).open(path).map_err(io_error)?;
    let mut header = [0u8; 20];
    let mut got = 0;
    while got < header.len() {
        match file.read(&mut header[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => return Err(io_error(e)),
        }
    }
    let qcow2 = got >= 4 && header[..4] == *b"QFI\xfb";
    let mut files = Vec::new();
    if qcow2 && got == header.len() {
        let offset = u64::from_be_bytes(header[8..16].try_into().unwrap_or_default());
        let size = u32::from_be_bytes(header[16..20].try_into().unwrap_or_default());
        if offset != 0 && size != 0 {
            if disk.backing_files != Some(true) {
                return Err(vec![
                    "Cannot open disk path".to_string(),
                    format!("Unsupported feature (path={} op=open)", path.display()),
                    "Maximum disk nesting depth exceeded".to_string(),
                ]);
            }
            let mut name = vec![0u8; size as usize];
            let read = std::os::unix::fs::FileExt::read_exact_at(&file, &mut name, offset);
            read.map_err(io_error)?;
            let name = PathBuf::from(String::from_utf8_lossy(&name).into_owned());
            let backing = path.parent().map_or_else(|| name.clone(), |dir| dir.join(&name));
            let opened = File::open(&backing).map_err(|e| {
                vec![
                    "Cannot open disk path".to_string(),
                    format!("I/O error (path={} op=open)", path.display()),
                    format!("Backing file I/O error: {}", name.display()),
                    e.to_string(),
                ]
            })?;
            files.push(opened);
        }
    }
    let detected = if qcow2 { ImageType::Qcow2 } else { ImageType::Raw };
    if let Some(specified @ (ImageType::Raw | ImageType::Qcow2)) = disk.image_type {
        if specified != detected {
            let name = |t: ImageType| format!("{t:?}").to_lowercase();
            return Err(vec![format!(
                "Disk image type does not match expected type: specified = {}, detected = {}",
                name(specified),
                name(detected)
            )]);
        }
    }
    files.insert(0, file);
    Ok(files)
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

/// `vm.counters`: every disk and NIC of a booted VM by id (the fake moves no data: all
/// zeros; the real adds latencies). Not booted: the real's 500 "VM is not running".
fn vm_counters(state: &State) -> Reply {
    let Some(vm) = state.vm.as_ref().filter(|vm| vm.state != VmState::Created) else {
        return api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The VM info is not available",
            strings(["VM is not running"]),
        );
    };
    let mut out = serde_json::Map::new();
    let ids = |section: &str| -> Vec<String> {
        vm.config[section].as_array().into_iter().flatten().filter_map(|d| d["id"].as_str().map(String::from)).collect()
    };
    for id in ids("disks") {
        out.insert(id, json!({"read_bytes": 0, "write_bytes": 0, "read_ops": 0, "write_ops": 0}));
    }
    for id in ids("net") {
        out.insert(id, json!({"rx_bytes": 0, "tx_bytes": 0, "rx_frames": 0, "tx_frames": 0}));
    }
    Reply::Json(StatusCode::OK, Value::Object(out))
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

fn vm_add_net(state: &mut State, body: &Bytes, fds: Vec<OwnedFd>) -> Reply {
    const WHAT: &str = "The network device could not be added to the VM";
    let net: NetConfig = match serde_json::from_slice(body) {
        Ok(n) => n,
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
    let invalid = |cause: String| {
        api_error(StatusCode::INTERNAL_SERVER_ERROR, WHAT, vec!["Failed to validate config".into(), cause])
    };
    let ids = config.ids();
    if let Some(id) = net.id.as_deref().filter(|id| ids.contains(id)) {
        return invalid(format!("Identifier {id} is not unique"));
    }
    // Two queues (one pair) by default: one tap fd.
    if !fds.is_empty() && fds.len() * 2 != 2 {
        return invalid(format!(
            "Number of queues (2) to virtio_net does not match the number of FDs ({})",
            fds.len() * 2
        ));
    }
    // The fds of the request replace any numbers in the body.
    if let Some(object) = entry.as_object_mut() {
        object.remove("fds");
        if !fds.is_empty() {
            object.insert("fds".into(), fds.iter().map(|fd| fd.as_raw_fd()).collect());
        }
    }
    let hot = vm.state != VmState::Created;
    let id = match net.id {
        Some(id) => id,
        None => (0..).map(|n| format!("_net{n}")).find(|id| !ids.contains(&id.as_str())).unwrap_or_default(),
    };
    if hot {
        entry["id"] = Value::from(id.clone());
    }
    match vm.config.get_mut("net") {
        Some(Value::Array(list)) => list.push(entry),
        _ => vm.config["net"] = Value::Array(vec![entry]),
    }
    vm.net_fds.extend(fds);
    if !hot {
        return Reply::Empty(StatusCode::NO_CONTENT);
    }
    state.hotplugged = hotplugged + 1;
    let bdf = format!("0000:00:{:02x}.0", FIRST_HOTPLUG_SLOT + hotplugged);
    Reply::Json(StatusCode::OK, json!({"id": id, "bdf": bdf}))
}

/// The directory of a `file://` URL, checked as the real binary does.
fn url_dir(url: &str, what: &str) -> Result<PathBuf, Vec<String>> {
    let send = "Failed to send migratable component snapshot".to_string();
    let Some(path) = url.strip_prefix("file://") else {
        return Err(vec![what.to_string(), send, format!("Could not extract path from URL: {url}")]);
    };
    let path = PathBuf::from(path);
    if !path.is_dir() {
        return Err(vec![what.to_string(), send, format!("Destination is not a directory: {path:?}")]);
    }
    Ok(path)
}

fn vm_snapshot(state: &mut State, body: &Bytes) -> Reply {
    const WHAT: &str = "The VM could not be snapshotted";
    let request: SnapshotConfig = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return deserialize_error(e),
    };
    let vm = match state.vm.as_mut() {
        Some(vm) if vm.state == VmState::Paused => vm,
        Some(vm) if vm.state == VmState::Running => {
            return api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                WHAT,
                strings([
                    "Cannot snapshot VM",
                    "Failed to snapshot migratable component",
                    "Trying to snapshot while VM is running",
                ]),
            )
        }
        _ => return not_running(WHAT),
    };
    let dir = match url_dir(&request.destination_url, "Cannot send VM snapshot") {
        Ok(dir) => dir,
        Err(causes) => return api_error(StatusCode::INTERNAL_SERVER_ERROR, WHAT, causes),
    };
    let state_json = json!({"snapshots": {}, "fake": "cloud-hypervisor-fake", "serial_written": vm.serial_written});
    let written = [
        ("config.json", serde_json::to_vec_pretty(&vm.config).unwrap_or_default()),
        ("state.json", serde_json::to_vec_pretty(&state_json).unwrap_or_default()),
        ("memory-ranges", b"cloud-hypervisor-fake: no guest memory\n".to_vec()),
    ]
    .into_iter()
    .try_for_each(|(name, bytes)| std::fs::write(dir.join(name), bytes).map_err(|e| (name, e)));
    match written {
        Ok(()) => Reply::Empty(StatusCode::NO_CONTENT),
        Err((name, e)) => api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            WHAT,
            vec![
                "Cannot send VM snapshot".into(),
                "Failed to send migratable component snapshot".into(),
                format!("Error writing {name}"),
                e.to_string(),
            ],
        ),
    }
}

fn vm_restore(state: &mut State, body: &Bytes, mut fds: Vec<OwnedFd>) -> Reply {
    const WHAT: &str = "The VM could not be restored";
    const CANNOT: &str = "Cannot restore VM";
    const RECEIVE: &str = "Failed to receive migratable component snapshot";
    let request: RestoreConfig = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return deserialize_error(e),
    };
    // With `net_fds`, the real binary checks the fd count at the HTTP level (a bare 400);
    // without, fds passed along are not looked at.
    if let Some(net_fds) = &request.net_fds {
        if net_fds.iter().map(|n| n.num_fds).sum::<usize>() != fds.len() {
            return bad_request();
        }
    }
    let net_fds = request.net_fds.unwrap_or_default();
    if state.vm.is_some() {
        return api_error(StatusCode::INTERNAL_SERVER_ERROR, WHAT, strings(["VM is already created"]));
    }
    let fail = |causes: Vec<String>| api_error(StatusCode::INTERNAL_SERVER_ERROR, WHAT, causes);
    let Some(url) = request.source_url.to_str() else {
        return fail(vec![CANNOT.into(), "Source URL is not UTF-8".into()]);
    };
    let dir = match url_dir(url, CANNOT) {
        Ok(dir) => dir,
        Err(causes) => return fail(causes),
    };
    let read = |name: &str, what: &str| -> Result<Vec<u8>, Reply> {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|e| {
            fail(vec![
                CANNOT.into(),
                RECEIVE.into(),
                format!("Error opening VM {what} snapshot file {path:?}"),
                e.to_string(),
            ])
        })
    };
    let deserialising = |what: &str, e: serde_json::Error| {
        fail(vec![CANNOT.into(), RECEIVE.into(), format!("Error deserialising VM {what} snapshot"), e.to_string()])
    };
    let config_bytes = match read("config.json", "config") {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let mut config = match serde_json::from_slice::<VmConfig>(&config_bytes)
        .and_then(|_| serde_json::from_slice::<Value>(&config_bytes))
    {
        Ok(v) => v,
        Err(e) => return deserialising("config", e),
    };
    let saved: SnapshotState = match read("state.json", "state").map(|b| serde_json::from_slice(&b)) {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return deserialising("state", e),
        Err(reply) => return reply,
    };
    // New tap fds for the net entries, named by `net_fds` (in order, `num_fds` each).
    let mut held = Vec::new();
    for restored in &net_fds {
        let given: Vec<OwnedFd> = fds.drain(..restored.num_fds).collect();
        let numbers: Value = given.iter().map(|fd| fd.as_raw_fd()).collect();
        let entry = config.get_mut("net").and_then(Value::as_array_mut).and_then(|list| {
            list.iter_mut().find(|n| n.get("id").and_then(Value::as_str) == Some(restored.id.as_str()))
        });
        match entry {
            Some(entry) => entry["fds"] = numbers,
            None => {
                return fail(vec![CANNOT.into(), format!("No net device with id {:?} in the snapshot", restored.id)])
            }
        }
        held.extend(given);
    }
    for entry in config.get("net").and_then(Value::as_array).into_iter().flatten() {
        let id = entry.get("id").and_then(Value::as_str).unwrap_or_default();
        if entry.get("fds").is_some() && !net_fds.iter().any(|n| n.id == id) {
            return fail(vec![
                "Failed to validate config".into(),
                format!("Net id {id} is associated with FDs and is required"),
            ]);
        }
    }
    let mut vm = Vm::new(config, VmState::Paused);
    let typed = match vm.typed() {
        Ok(c) => c,
        Err(reply) => return reply,
    };
    if let Err(causes) = vm.bind_serial(&typed) {
        return fail([vec![CANNOT.to_string()], causes].concat());
    }
    for disk in typed.disks.iter().flatten() {
        match open_disk(disk) {
            Ok(files) => vm.disks.extend(files),
            Err(causes) => {
                return fail([vec![CANNOT.to_string(), "Error from device manager".to_string()], causes].concat())
            }
        }
    }
    vm.net_fds = held;
    vm.serial_written = saved.serial_written;
    let line = format!("fake cloud-hypervisor: restored from {}\n", dir.display());
    if let Err(e) = vm.guest_writes(&typed, line.as_bytes()) {
        return fail(vec![CANNOT.into(), "Error creating serial output file".into(), e.to_string()]);
    }
    if request.resume == Some(true) {
        vm.state = VmState::Running;
    }
    state.vm = Some(vm);
    Reply::Empty(StatusCode::NO_CONTENT)
}

// ---- Serving ----

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    exit_after: Arc<AtomicBool>,
    conn_fds: Arc<Mutex<Vec<OwnedFd>>>,
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
    // The fds received so far on this connection belong to this request.
    let fds: Vec<OwnedFd> = std::mem::take(&mut *conn_fds.lock().unwrap_or_else(|e| e.into_inner()));
    let fd_names: Vec<String> = fds.iter().map(describe_fd).collect();
    let control = load_control();
    let endpoint = path.strip_prefix(API_PREFIX).unwrap_or(&path).to_string();

    if control.exit_on.contains(&endpoint) {
        shared.record(&method, &path, &body, &fd_names, None);
        shared.log(&format!("{method} {path} -> no answer: exit_on, the VMM crashes"));
        std::process::exit(1);
    }
    if control.hang.contains(&endpoint) {
        shared.record(&method, &path, &body, &fd_names, None);
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
        None => dispatch(&shared, &control, &method, &path, &body, fds),
    };
    let status = reply.status();
    shared.record(&method, &path, &body, &fd_names, Some(status.as_u16()));
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
    let delivered = {
        let mut state = shared.lock();
        let Some(vm) = state.vm.as_mut().filter(|vm| vm.state == VmState::Running) else {
            shared.log("power button: the VM is no longer running; nothing happens");
            return;
        };
        match vm.typed() {
            Ok(config) => vm.guest_writes(&config, POWEROFF_LINE.as_bytes()).unwrap_or_else(|e| {
                shared.log(&format!("serial output: {e}"));
                None
            }),
            Err(_) => None,
        }
    };
    if let Some(delivered) = delivered {
        let _ = tokio::time::timeout(Duration::from_secs(2), delivered).await;
    }
    shared.log("guest powered off");
    shared.exit(0);
}

async fn serve(shared: Arc<Shared>, stream: UnixStream) {
    let exit_after = Arc::new(AtomicBool::new(false));
    let fds = Arc::new(Mutex::new(Vec::new()));
    let service = {
        let (shared, exit_after, fds) = (shared.clone(), exit_after.clone(), fds.clone());
        service_fn(move |req| handle(shared.clone(), req, exit_after.clone(), fds.clone()))
    };
    let io = TokioIo::new(FdStream { inner: stream, fds });
    if let Err(e) = http1::Builder::new().serve_connection(io, service).await {
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
