//! # config — the agent's configuration (one TOML file, every key overridable by a flag)
//!
//! Unknown keys are refused (a typo must not silently fall back to a default). Durations
//! carry their unit in the key name (`_s`, `_ms`).
//!
//! [`KEYS`] is the one description of every key (what it sets, its default, its unit,
//! whether a `serve` flag overrides it): `Config`'s field docs, the `serve` flags' help,
//! the man page and the table in `docs/configuration.md` are generated from it.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// How a VFIO device reaches QEMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum VfioAttach {
    /// `-device vfio-pci,sysfsdev=...` (production).
    Device,
    /// The agent's child opens the simulated `dev/vfio/<group>` node and hands the fd to
    /// QEMU with `-add-fd` (simulated hosts, where QEMU cannot open a FUSE "device").
    HoldFd,
}

/// The range of uids (and the same gids) VMMs run under (`vmm_ids`): every instance gets
/// one of its own ([`crate::instances::vmm_ids`]). No user or group may have an id in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VmmIds {
    /// The first id.
    pub first: u32,
    /// How many ids (the most instances an agent can hold).
    pub count: u32,
}

impl VmmIds {
    /// The last id of the range.
    pub fn last(&self) -> u32 {
        self.first.saturating_add(self.count.saturating_sub(1))
    }

    /// Whether `id` is in the range.
    pub fn contains(&self, id: u32) -> bool {
        id >= self.first && id <= self.last()
    }
}

impl Default for VmmIds {
    /// 0x70000000 + 65536: the window systemd's "UID/GID allocation" lists as unused
    /// (1879048192…2147352575), above regular users, systemd's dynamic users, `nobody`,
    /// shadow's default subordinate ranges (100000…600100000) and systemd-nspawn's
    /// `--private-users=pick` ranges (…1879048191).
    fn default() -> VmmIds {
        VmmIds { first: 1_879_048_192, count: 65_536 }
    }
}

/// The host trees every VMM's view binds read-only ([`crate::host::vmm_view`]): the data
/// directory may not lie inside one of them (the view would show the agent's records).
pub const VIEW_SYSTEM_TREES: &[&str] = &["/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"];

/// Limits and site parameters of one policy plugin slot (`[plugins.<kind>]`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSlot {
    /// Path of the `.wasm` (or `.wat`) module.
    pub path: PathBuf,
    /// Instruction budget per call (wasmtime fuel).
    #[serde(default)]
    pub fuel: Option<u64>,
    /// Linear memory limit per call, MiB.
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// Wall-clock deadline per call, ms.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// The JSON object passed as `params` in every input of this plugin.
    #[serde(default)]
    pub params: Option<toml::Table>,
}

/// The `[plugins]` table.
#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Plugins {
    /// The placement plugin (which device a request gets); absent: the default one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<PluginSlot>,
    /// The hypervisor plugin (which VMM runs an instance); absent: the default one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hypervisor: Option<PluginSlot>,
    /// The grace plugin (whether the reconciler releases an eligible device now); absent:
    /// the default one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grace: Option<PluginSlot>,
}

/// What a number of a config key counts (the key's name carries it too: `_s`, `_mib`,
/// `_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Not a quantity (a path, a name, a list, a switch), or a plain count.
    None,
    /// Seconds.
    Seconds,
    /// MiB (2^20 bytes).
    Mib,
    /// Bytes.
    Bytes,
    /// A multiple of a host quantity (its `MemTotal`, its CPUs).
    Times,
}

impl Unit {
    /// The unit as printed after a number (`30 s`), or "" for [`Unit::None`].
    pub fn symbol(self) -> &'static str {
        match self {
            Unit::None => "",
            Unit::Seconds => "s",
            Unit::Mib => "MiB",
            Unit::Bytes => "bytes",
            Unit::Times => "×",
        }
    }
}

/// One config key as users see it, in `gpuvisor serve --help`, the man page and
/// `docs/configuration.md` (all three generated from [`KEYS`]).
#[derive(Debug, Clone, Copy)]
pub struct KeyDoc {
    /// The TOML key (the `Config` field's serde name); its `serve` flag is `--<key with ->`.
    pub key: &'static str,
    /// One line: what the key sets (no default, no unit: those are rendered from the fields
    /// below).
    pub help: &'static str,
    /// The default as a TOML value (`"/var/lib/gpuvisor"`, `60`, `[]`), `None` when the key
    /// is absent by default. Checked against [`Config::default`] by a unit test.
    pub default: Option<&'static str>,
    /// What the key's number counts, printed after its default.
    pub unit: Unit,
    /// A `gpuvisor serve` flag of the same name overrides the file's value.
    pub serve_flag: bool,
}

impl KeyDoc {
    /// The default as users read it: a TOML string without its quotes, other values as
    /// written, `none` for an absent key.
    pub fn shown_value(&self) -> &'static str {
        match self.default {
            None => "none",
            Some(d) => d.strip_prefix('"').and_then(|d| d.strip_suffix('"')).unwrap_or(d),
        }
    }

    /// [`shown_value`](Self::shown_value) with the unit after a number (`30 s`).
    pub fn shown_default(&self) -> String {
        match (self.unit, self.default) {
            (Unit::None, _) | (_, None) => self.shown_value().to_string(),
            (u, Some(_)) => format!("{} {}", self.shown_value(), u.symbol()),
        }
    }

    /// The `serve` flag (`--stop-timeout-s`).
    pub fn flag(&self) -> String {
        format!("--{}", self.key.replace('_', "-"))
    }

    /// The help line of the key's `serve` flag: the description and the default.
    pub fn flag_help(&self) -> String {
        format!("{} [default: {}]", self.help, self.shown_default())
    }
}

/// The generated part of `docs/configuration.md` (between [`DOC_BEGIN`] and [`DOC_END`]):
/// a Markdown table of every key with its default, unit, `serve` flag and description.
pub fn keys_markdown() -> String {
    let mut out = String::from("| key | default | unit | `serve` flag | description |\n|---|---|---|---|---|\n");
    for k in KEYS {
        let flag = if k.serve_flag { format!("`{}`", k.flag()) } else { String::new() };
        let help = k.help.replace('<', "&lt;").replace('>', "&gt;");
        out.push_str(&format!("| `{}` | `{}` | {} | {flag} | {help} |\n", k.key, k.shown_value(), k.unit.symbol()));
    }
    out
}

/// The marker lines around the generated table in `docs/configuration.md`.
pub const DOC_BEGIN: &str = "<!-- keys:begin (generated from agent/src/config.rs KEYS; do not edit) -->";
/// The marker line after the generated table in `docs/configuration.md`.
pub const DOC_END: &str = "<!-- keys:end -->";

/// The [`KeyDoc`] of a key.
pub fn key_doc(key: &str) -> Option<&'static KeyDoc> {
    KEYS.iter().find(|k| k.key == key)
}

/// Declares the `Config` struct and [`KEYS`] from one list, so every field has exactly one
/// description (used as its doc comment too) and every description a field.
macro_rules! config_keys {
    ($(
        $(#[$attr:meta])*
        $key:ident: $ty:ty {
            help: $help:literal,
            default: $default:expr,
            unit: $unit:ident,
            serve_flag: $flag:literal $(,)?
        }
    ),* $(,)?) => {
        /// The agent's configuration. Defaults are production defaults (docs/design/architecture.md
        /// "Configuration"); each key's description, default and unit are in [`KEYS`].
        #[derive(Debug, Clone, Deserialize, Serialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct Config {
            $(
                #[doc = $help]
                $(#[$attr])*
                pub $key: $ty,
            )*
        }

        /// Every config key, in the order of `Config`'s fields and of the docs' table.
        pub const KEYS: &[KeyDoc] = &[$(
            KeyDoc { key: stringify!($key), help: $help, default: $default, unit: Unit::$unit, serve_flag: $flag },
        )*];
    };
}

config_keys! {
    data_dir: PathBuf {
        help: "Data directory: records, claims, images, instance directories",
        default: Some(r#""/var/lib/gpuvisor""#), unit: None, serve_flag: true,
    },
    socket: PathBuf {
        help: "The JSON-RPC Unix socket (mode 0600)",
        default: Some(r#""/run/gpuvisor/gpuvisor.sock""#), unit: None, serve_flag: true,
    },
    host_root: PathBuf {
        help: "Root of sysfs/devfs: / on a real host, a gpuvisor-sim mount in tests",
        default: Some(r#""/""#), unit: None, serve_flag: true,
    },
    qemu_binary: PathBuf {
        help: "The QEMU binary, looked up in PATH when not absolute",
        default: Some(r#""qemu-system-x86_64""#), unit: None, serve_flag: true,
    },
    cloud_hypervisor_binary: PathBuf {
        help: "The Cloud Hypervisor binary, looked up in PATH when not absolute",
        default: Some(r#""cloud-hypervisor""#), unit: None, serve_flag: true,
    },
    default_hypervisor: String {
        help: "Hypervisor for plain instances when the request names none (not used yet: the hypervisor plugin decides)",
        default: Some(r#""qemu""#), unit: None, serve_flag: false,
    },
    accel: String {
        help: "QEMU accelerator: kvm (production) or tcg (nested or simulated hosts)",
        default: Some(r#""kvm""#), unit: None, serve_flag: true,
    },
    vfio_attach: VfioAttach {
        help: "How VFIO devices reach QEMU: device (the sysfs path) or hold-fd (simulated hosts)",
        default: Some(r#""device""#), unit: None, serve_flag: true,
    },
    managed_gpus: Option<Vec<String>> {
        help: "PF addresses gpuvisor may touch for vGPUs; absent = every NVIDIA GPU found except the passthrough GPUs",
        default: None, unit: None, serve_flag: false,
    },
    passthrough_gpus: Vec<String> {
        help: "GPU addresses handed out whole (bound to vfio-pci with their IOMMU group); never also a vGPU parent",
        default: Some("[]"), unit: None, serve_flag: true,
    },
    passthrough_stop_services: Vec<String> {
        help: "A command (argv) that stops the host services holding a passthrough GPU before its bind; empty = a held GPU is refused (gpu_busy)",
        default: Some("[]"), unit: None, serve_flag: false,
    },
    passthrough_start_services: Vec<String> {
        help: "The command (argv) that starts those services again after the bind",
        default: Some("[]"), unit: None, serve_flag: false,
    },
    plugin_dir: PathBuf {
        help: "Directory of the default plugins (<name>.wasm) used for the slots not set under [plugins]",
        default: Some(r#""/usr/lib/gpuvisor/plugins""#), unit: None, serve_flag: true,
    },
    plugins: Plugins {
        help: "The policy plugin slots [plugins.placement], [plugins.hypervisor], [plugins.grace]",
        default: Some("{}"), unit: None, serve_flag: false,
    },
    reconcile_interval_s: u64 {
        help: "Time between reconcile passes (at least 1)",
        default: Some("60"), unit: Seconds, serve_flag: false,
    },
    claim_grace_s: u64 {
        help: "Protection of claims without a recorded VMM, and of orphans (the grace plugin's params.claim_grace_s)",
        default: Some("300"), unit: Seconds, serve_flag: false,
    },
    external_owner_lease_s: u64 {
        help: "How long the last complete claim.owners list of an external owner kind stays authoritative; older (or none): external owners are maybe alive, their claims never released",
        default: Some("300"), unit: Seconds, serve_flag: false,
    },
    vfio_term_grace_s: u64 {
        help: "SIGTERM to SIGKILL wait on the kill path of a VMM holding a VFIO device",
        default: Some("5"), unit: Seconds, serve_flag: true,
    },
    stop_timeout_s: u64 {
        help: "How long a graceful stop waits for the guest to power off",
        default: Some("30"), unit: Seconds, serve_flag: true,
    },
    release_retry_s: u64 {
        help: "How long a release retries inline (EBUSY during kernel teardown) before leaving the claim release_pending",
        default: Some("30"), unit: Seconds, serve_flag: true,
    },
    #[serde(alias = "qmp_ready_timeout_s")]
    vmm_ready_timeout_s: u64 {
        help: "How long each step of a VMM start may take (QMP answering; each Cloud Hypervisor API request); older name qmp_ready_timeout_s",
        default: Some("30"), unit: Seconds, serve_flag: true,
    },
    default_cmdline: String {
        help: "Kernel command line for images imported without one",
        default: Some(r#""console=ttyS0 panic=-1""#), unit: None, serve_flag: false,
    },
    console_log_max_bytes: u64 {
        help: "The largest an instance's serial.log grows before it is rotated to serial.log.1 (8 MiB; at least 4096)",
        default: Some("8388608"), unit: Bytes, serve_flag: false,
    },
    restart_backoff_s: u64 {
        help: "Wait before the first restart under a restart policy; doubled per further restart within restart_window_s, at most 60 s",
        default: Some("1"), unit: Seconds, serve_flag: false,
    },
    restart_limit: u32 {
        help: "At most this many restarts within restart_window_s; then the instance stays stopped until started by hand",
        default: Some("5"), unit: None, serve_flag: false,
    },
    restart_window_s: u64 {
        help: "The window of restart_limit",
        default: Some("600"), unit: Seconds, serve_flag: false,
    },
    restart_host_wait_s: u64 {
        help: "How long a restart (autostart after a reboot, or a restart policy) that fails because the host is not ready yet (not_ready: no SR-IOV VFs yet, the driver loading) is retried, restart_backoff_s doubling up to 60 s; these tries do not count against restart_limit",
        default: Some("600"), unit: Seconds, serve_flag: false,
    },
    memory_overcommit: f64 {
        help: "An instance may have at most this times the host's MemTotal of guest memory (above 0, at most 1000)",
        default: Some("1.0"), unit: Times, serve_flag: false,
    },
    vcpu_overcommit: f64 {
        help: "An instance may have at most this times the host's CPUs as vCPUs (above 0, at most 1000)",
        default: Some("4.0"), unit: Times, serve_flag: false,
    },
    qemu_sandbox: bool {
        help: "QEMU runs under its seccomp sandbox (-sandbox on, obsolete/elevateprivileges/spawn/resourcecontrol denied)",
        default: Some("true"), unit: None, serve_flag: false,
    },
    vmm_ids: VmmIds {
        help: "The uids/gids VMMs run under, one of its own per instance (uid = gid), never a user's: first and count; reserve them (docs/configuration.md \"VMM identities\")",
        default: Some("{ first = 1879048192, count = 65536 }"), unit: None, serve_flag: false,
    },
    vmm_shared_paths: Vec<PathBuf> {
        help: "Host paths every VMM also sees, at the same path with the host's permissions (e.g. a qemu_binary wrapper's directory); shared by all VMMs",
        default: Some("[]"), unit: None, serve_flag: false,
    },
    vmm_cgroup: bool {
        help: "Each VMM runs in its own cgroup v2 (gpuvisor/vm-<id>) with memory.max = guest memory + cgroup_memory_overhead_mib",
        default: Some("true"), unit: None, serve_flag: false,
    },
    cgroup_memory_overhead_mib: u64 {
        help: "The VMM's own memory on top of the guest's, in its cgroup's limit",
        default: Some("1024"), unit: Mib, serve_flag: false,
    },
    log_format: String {
        help: "Format of the agent's log on stderr: text or json (level: GPUVISOR_LOG)",
        default: Some(r#""text""#), unit: None, serve_flag: true,
    },
    record_policy_inputs: Option<PathBuf> {
        help: "Write every policy plugin call (the input and the answer) to this directory as <kind>-<unix ms>-<n>.json (to replay with gpuvisor plugin test)",
        default: None, unit: None, serve_flag: true,
    },
    metrics_listen: Option<std::net::SocketAddr> {
        help: "Serve GET /metrics (Prometheus text) on this loopback address, e.g. 127.0.0.1:9464",
        default: None, unit: None, serve_flag: true,
    },
    user_net_restrict: bool {
        help: "user NICs run QEMU user-mode networking with restrict=on: the guest reaches only its port forwards",
        default: Some("true"), unit: None, serve_flag: false,
    },
    qemu_img_binary: PathBuf {
        help: "qemu-img (Debian qemu-utils), looked up in PATH when not absolute: imports disks, creates overlays",
        default: Some(r#""qemu-img""#), unit: None, serve_flag: false,
    },
    ovmf_code: PathBuf {
        help: "The UEFI firmware code (Debian ovmf) for boot = \"uefi\", read-only pflash unit 0",
        default: Some(r#""/usr/share/OVMF/OVMF_CODE_4M.fd""#), unit: None, serve_flag: false,
    },
    ovmf_vars: PathBuf {
        help: "The UEFI variable store template, copied once per instance (pflash unit 1); must match ovmf_code (4M or 2M)",
        default: Some(r#""/usr/share/OVMF/OVMF_VARS_4M.fd""#), unit: None, serve_flag: false,
    },
    cloud_hypervisor_firmware: Option<PathBuf> {
        help: "Cloud Hypervisor's UEFI firmware for boot = \"uefi\" (CLOUDHV.fd, an OVMF build for Cloud Hypervisor, or rust-hypervisor-firmware; not packaged by Debian); unset: Cloud Hypervisor instances boot only direct",
        default: None, unit: None, serve_flag: false,
    },
}

impl Default for Config {
    fn default() -> Config {
        Config {
            data_dir: PathBuf::from("/var/lib/gpuvisor"),
            socket: PathBuf::from("/run/gpuvisor/gpuvisor.sock"),
            host_root: PathBuf::from("/"),
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            cloud_hypervisor_binary: PathBuf::from("cloud-hypervisor"),
            default_hypervisor: "qemu".into(),
            accel: "kvm".into(),
            vfio_attach: VfioAttach::Device,
            managed_gpus: None,
            passthrough_gpus: Vec::new(),
            passthrough_stop_services: Vec::new(),
            passthrough_start_services: Vec::new(),
            plugin_dir: PathBuf::from("/usr/lib/gpuvisor/plugins"),
            plugins: Plugins::default(),
            reconcile_interval_s: 60,
            claim_grace_s: 300,
            external_owner_lease_s: 300,
            vfio_term_grace_s: 5,
            stop_timeout_s: 30,
            release_retry_s: 30,
            vmm_ready_timeout_s: 30,
            default_cmdline: "console=ttyS0 panic=-1".into(),
            console_log_max_bytes: 8 * 1024 * 1024,
            restart_backoff_s: 1,
            restart_limit: 5,
            restart_window_s: 600,
            restart_host_wait_s: 600,
            memory_overcommit: 1.0,
            vcpu_overcommit: 4.0,
            qemu_sandbox: true,
            vmm_ids: VmmIds::default(),
            vmm_shared_paths: Vec::new(),
            vmm_cgroup: true,
            cgroup_memory_overhead_mib: 1024,
            log_format: "text".into(),
            record_policy_inputs: None,
            metrics_listen: None,
            user_net_restrict: true,
            qemu_img_binary: PathBuf::from("qemu-img"),
            ovmf_code: PathBuf::from("/usr/share/OVMF/OVMF_CODE_4M.fd"),
            ovmf_vars: PathBuf::from("/usr/share/OVMF/OVMF_VARS_4M.fd"),
            cloud_hypervisor_firmware: None,
        }
    }
}

/// The largest value any `*_s` duration key accepts: one year.
pub const MAX_DURATION_S: u64 = 365 * 24 * 3600;

impl Config {
    /// Reads a TOML config file. Errors name the file and the offending key.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text =
            std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read config {}: {e}", path.display()))?;
        Config::parse(&text).map_err(|e| anyhow::anyhow!("config {}: {e}", path.display()))
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> anyhow::Result<Config> {
        // A key that was removed says what replaced it (serde would only say "unknown").
        if let Ok(t) = text.parse::<toml::Table>() {
            if t.contains_key("vmm_user") {
                anyhow::bail!(
                    "vmm_user was removed: every VMM now runs under a uid/gid of its own from vmm_ids, in a view of \
                     the filesystem holding only its instance's files (docs/configuration.md \"VMM identities\"); \
                     remove the key"
                );
            }
        }
        let mut cfg: Config = toml::from_str(text)?;
        // sysfs names PCI functions in lower case.
        cfg.passthrough_gpus.iter_mut().for_each(|g| g.make_ascii_lowercase());
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks what TOML cannot: enums, BDFs, loopback-only metrics, duration bounds, and that
    /// `host_root` exists. Errors name the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !matches!(self.accel.as_str(), "kvm" | "tcg") {
            anyhow::bail!("accel must be \"kvm\" or \"tcg\", not {:?}", self.accel);
        }
        if !matches!(self.log_format.as_str(), "text" | "json") {
            anyhow::bail!("log_format must be \"text\" or \"json\", not {:?}", self.log_format);
        }
        for g in self.managed_gpus.iter().flatten() {
            if !is_bdf(g) {
                anyhow::bail!(
                    "managed_gpus: {g:?} is not a PCI address (domain:bus:device.function, e.g. 0000:41:00.0)"
                );
            }
        }
        for (i, g) in self.passthrough_gpus.iter().enumerate() {
            if self.passthrough_gpus[..i].iter().any(|x| x.eq_ignore_ascii_case(g)) {
                anyhow::bail!("passthrough_gpus: {g} is listed twice");
            }
            if !is_bdf(g) {
                anyhow::bail!(
                    "passthrough_gpus: {g:?} is not a PCI address (domain:bus:device.function, e.g. 0000:82:00.0)"
                );
            }
            if self.managed_gpus.iter().flatten().any(|m| m.eq_ignore_ascii_case(g)) {
                anyhow::bail!("{g} is in both managed_gpus and passthrough_gpus: a GPU is a vGPU parent or a passthrough GPU, never both");
            }
        }
        if self.passthrough_start_services.is_empty() != self.passthrough_stop_services.is_empty() {
            anyhow::bail!("passthrough_stop_services and passthrough_start_services are set together, or neither");
        }
        if let Some(a) = self.metrics_listen {
            if !a.ip().is_loopback() {
                anyhow::bail!("metrics_listen must be a loopback address, not {a}");
            }
        }
        for (key, v) in [("memory_overcommit", self.memory_overcommit), ("vcpu_overcommit", self.vcpu_overcommit)] {
            if !(v.is_finite() && v > 0.0 && v <= 1000.0) {
                anyhow::bail!("{key} must be a number above 0 and at most 1000, not {v}");
            }
        }
        if self.console_log_max_bytes < 4096 {
            anyhow::bail!("console_log_max_bytes must be at least 4096, not {}", self.console_log_max_bytes);
        }
        if self.reconcile_interval_s == 0 {
            anyhow::bail!("reconcile_interval_s must be at least 1");
        }
        if self.vmm_ready_timeout_s == 0 {
            anyhow::bail!("vmm_ready_timeout_s must be at least 1");
        }
        // Durations are added to clock readings; a bound keeps every sum finite (and a
        // grace of more than a year is a typo, not a policy).
        for (key, v) in [
            ("reconcile_interval_s", self.reconcile_interval_s),
            ("claim_grace_s", self.claim_grace_s),
            ("external_owner_lease_s", self.external_owner_lease_s),
            ("vfio_term_grace_s", self.vfio_term_grace_s),
            ("stop_timeout_s", self.stop_timeout_s),
            ("release_retry_s", self.release_retry_s),
            ("vmm_ready_timeout_s", self.vmm_ready_timeout_s),
            ("restart_backoff_s", self.restart_backoff_s),
            ("restart_window_s", self.restart_window_s),
            ("restart_host_wait_s", self.restart_host_wait_s),
        ] {
            if v > MAX_DURATION_S {
                anyhow::bail!("{key} = {v} is too large (at most {MAX_DURATION_S} s, one year)");
            }
        }
        if !self.host_root.is_dir() {
            anyhow::bail!("host_root {} is not a directory", self.host_root.display());
        }
        self.validate_vmm_view()
    }

    /// `vmm_ids`, `vmm_shared_paths` and the data directory as every VMM's view needs them:
    /// a non-empty range of real ids, absolute paths, and no shared path and no system tree
    /// of the view holding the data directory (the agent's records). Errors name the key.
    fn validate_vmm_view(&self) -> anyhow::Result<()> {
        let ids = self.vmm_ids;
        if ids.first == 0 || ids.count == 0 || ids.first.checked_add(ids.count - 1).is_none_or(|l| l == u32::MAX) {
            anyhow::bail!(
                "vmm_ids must be a non-empty range above 0 and below 4294967295, not first = {} count = {}",
                ids.first,
                ids.count
            );
        }
        if !self.data_dir.is_absolute() {
            anyhow::bail!("data_dir must be an absolute path, not {}", self.data_dir.display());
        }
        if let Some(t) = VIEW_SYSTEM_TREES.iter().find(|t| self.data_dir.starts_with(t)) {
            anyhow::bail!(
                "data_dir {} lies under {t}, which every VMM sees read-only: choose a data directory elsewhere \
                 (e.g. /var/lib/gpuvisor)",
                self.data_dir.display()
            );
        }
        for p in &self.vmm_shared_paths {
            if !p.is_absolute() {
                anyhow::bail!("vmm_shared_paths: {} is not an absolute path", p.display());
            }
            if self.data_dir.starts_with(p) || p.starts_with(&self.data_dir) {
                anyhow::bail!(
                    "vmm_shared_paths: {} and data_dir {} overlap: every VMM would see the agent's records",
                    p.display(),
                    self.data_dir.display()
                );
            }
        }
        Ok(())
    }

    /// True when gpuvisor may touch vGPU devices of the GPU (PF) at `pf` (never a
    /// passthrough GPU).
    pub fn manages(&self, pf: &str) -> bool {
        if self.is_passthrough_gpu(pf) {
            return false;
        }
        match &self.managed_gpus {
            None => true,
            Some(list) => list.iter().any(|g| g.eq_ignore_ascii_case(pf)),
        }
    }

    /// True when `bdf` is one of the `passthrough_gpus`.
    pub fn is_passthrough_gpu(&self, bdf: &str) -> bool {
        self.passthrough_gpus.iter().any(|g| g.eq_ignore_ascii_case(bdf))
    }

    /// The plugin path of a slot: `[plugins.<kind>].path`, else `<plugin_dir>/<default>.wasm`.
    pub fn plugin_path(&self, kind: gpuvisor_sdk::PolicyKind) -> PathBuf {
        let (slot, default) = self.slot(kind);
        match slot {
            Some(s) => s.path.clone(),
            None => self.plugin_dir.join(format!("{default}.wasm")),
        }
    }

    /// The slot config and the default plugin name of a kind.
    pub fn slot(&self, kind: gpuvisor_sdk::PolicyKind) -> (Option<&PluginSlot>, &'static str) {
        use gpuvisor_sdk::PolicyKind::*;
        match kind {
            Placement => (self.plugins.placement.as_ref(), "placement-spread"),
            Hypervisor => (self.plugins.hypervisor.as_ref(), "hypervisor-default"),
            Grace => (self.plugins.grace.as_ref(), "grace-default"),
        }
    }

    /// The `params` JSON object of a slot (`{}` when absent).
    pub fn plugin_params(&self, kind: gpuvisor_sdk::PolicyKind) -> serde_json::Value {
        match self.slot(kind).0.and_then(|s| s.params.as_ref()) {
            Some(t) => serde_json::to_value(t).unwrap_or_else(|_| serde_json::json!({})),
            None => serde_json::json!({}),
        }
    }
}

/// True for a full PCI address `dddd:bb:dd.f` (hex, function 0–7).
pub fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11])
        && [0, 1, 2, 3, 5, 6, 8, 9].iter().all(|&i| b[i].is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_production_defaults() {
        let c = Config::parse("").unwrap();
        assert_eq!(c.reconcile_interval_s, 60);
        assert_eq!(c.claim_grace_s, 300);
        assert_eq!(c.vfio_term_grace_s, 5);
        assert_eq!(c.vfio_attach, VfioAttach::Device);
        assert!(c.manages("0000:41:00.0"));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_the_key_named() {
        let e = Config::parse("data_dri = \"/x\"").unwrap_err().to_string();
        assert!(e.contains("data_dri"), "{e}");
        let e = Config::parse("accel = \"hvf\"").unwrap_err().to_string();
        assert!(e.contains("accel"), "{e}");
        let e = Config::parse("managed_gpus = [\"not-a-bdf\"]").unwrap_err().to_string();
        assert!(e.contains("not-a-bdf"), "{e}");
        let e = Config::parse("metrics_listen = \"0.0.0.0:9464\"").unwrap_err().to_string();
        assert!(e.contains("loopback"), "{e}");
        let e = Config::parse("vfio_attach = \"magic\"").unwrap_err().to_string();
        assert!(e.contains("magic") || e.contains("vfio_attach"), "{e}");
    }

    /// The field names serde knows (the "expected one of" list of an unknown-key error).
    fn serde_field_names() -> Vec<String> {
        let e = Config::parse("no_such_key = 1").unwrap_err().to_string();
        let list = e.split("expected one of").nth(1).unwrap_or_else(|| panic!("no field list in {e}"));
        list.split('`').skip(1).step_by(2).map(String::from).collect()
    }

    #[test]
    fn every_config_field_has_exactly_one_key_doc_and_every_key_doc_a_field() {
        let keys: Vec<&str> = KEYS.iter().map(|k| k.key).collect();
        for (i, k) in keys.iter().enumerate() {
            assert!(!keys[..i].contains(k), "{k} is in KEYS twice");
        }
        // The serialised default: exactly the fields, in order.
        let fields: Vec<String> = match serde_json::to_value(Config::default()).unwrap() {
            serde_json::Value::Object(m) => m.keys().cloned().collect(),
            v => panic!("not an object: {v}"),
        };
        let mut sorted_keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        sorted_keys.sort();
        let mut sorted_fields = fields.clone();
        sorted_fields.sort();
        assert_eq!(sorted_fields, sorted_keys);
        // What an unknown-key error lists: the keys, and the older name of vmm_ready_timeout_s.
        let mut named = serde_field_names();
        named.retain(|n| n != "qmp_ready_timeout_s");
        named.sort();
        assert_eq!(named, sorted_keys);
    }

    #[test]
    fn every_key_doc_default_is_the_real_default() {
        let real = serde_json::to_value(Config::default()).unwrap();
        for k in KEYS {
            let shown = match k.default {
                None => serde_json::Value::Null,
                Some(lit) => {
                    let t: toml::Table = toml::from_str(&format!("v = {lit}"))
                        .unwrap_or_else(|e| panic!("{}: default {lit} is not a TOML value: {e}", k.key));
                    serde_json::to_value(&t["v"]).unwrap()
                }
            };
            assert_eq!(
                shown, real[k.key],
                "{}: KEYS says {:?}, Config::default() has {}",
                k.key, k.default, real[k.key]
            );
        }
    }

    #[test]
    fn every_key_doc_has_a_one_line_description_and_the_unit_its_name_says() {
        for k in KEYS {
            assert!(!k.help.is_empty() && !k.help.contains('\n') && !k.help.ends_with('.'), "{}: {:?}", k.key, k.help);
            let by_name = if k.key.ends_with("_s") {
                Unit::Seconds
            } else if k.key.ends_with("_mib") {
                Unit::Mib
            } else if k.key.ends_with("_bytes") {
                Unit::Bytes
            } else {
                k.unit
            };
            assert_eq!(k.unit, by_name, "{}", k.key);
        }
        assert_eq!(
            key_doc("stop_timeout_s").unwrap().flag_help(),
            format!("{} [default: 30 s]", key_doc("stop_timeout_s").unwrap().help)
        );
        assert_eq!(key_doc("data_dir").unwrap().shown_default(), "/var/lib/gpuvisor");
        assert_eq!(key_doc("metrics_listen").unwrap().shown_default(), "none");
    }

    /// `docs/configuration.md` between the markers is [`keys_markdown`]; with
    /// `GPUVISOR_UPDATE_DOCS=1` the test rewrites it instead.
    #[test]
    fn the_configuration_doc_lists_every_key_as_the_table_generates() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let (Some(b), Some(e)) = (doc.find(DOC_BEGIN), doc.find(DOC_END)) else {
            panic!("{} has no {DOC_BEGIN} ... {DOC_END} section", path.display())
        };
        let start = b + DOC_BEGIN.len() + 1;
        let want = keys_markdown();
        if doc[start..e] == want {
            return;
        }
        if std::env::var_os("GPUVISOR_UPDATE_DOCS").is_some() {
            std::fs::write(&path, format!("{}{want}{}", &doc[..start], &doc[e..])).unwrap();
            return;
        }
        panic!(
            "docs/configuration.md's key table differs from config::KEYS; regenerate it with\n  \
             GPUVISOR_UPDATE_DOCS=1 cargo test -p gpuvisor --lib config::tests::the_configuration_doc_lists_every_key_as_the_table_generates"
        );
    }

    #[test]
    fn plugin_slots_and_params_are_read() {
        let c = Config::parse(
            "managed_gpus = [\"0000:41:00.0\"]\n[plugins.placement]\npath = \"/p/pack.wasm\"\nfuel = 5\n[plugins.placement.params]\ntenant_key = \"tenant\"\n",
        )
        .unwrap();
        assert_eq!(c.plugin_path(gpuvisor_sdk::PolicyKind::Placement), PathBuf::from("/p/pack.wasm"));
        assert_eq!(c.plugin_params(gpuvisor_sdk::PolicyKind::Placement)["tenant_key"], "tenant");
        assert!(!c.manages("0001:81:00.0"));
        assert_eq!(
            c.plugin_path(gpuvisor_sdk::PolicyKind::Hypervisor),
            PathBuf::from("/usr/lib/gpuvisor/plugins/hypervisor-default.wasm")
        );
    }
}
