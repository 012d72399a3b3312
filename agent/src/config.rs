//! # config — the agent's configuration (one TOML file, every key overridable by a flag)
//!
//! Unknown keys are refused (a typo must not silently fall back to a default). Durations
//! carry their unit in the key name (`_s`, `_ms`).

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// How a VFIO device reaches QEMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum VfioAttach {
    /// `-device vfio-pci,sysfsdev=...` (production).
    Device,
    /// The agent's child opens the simulated `dev/vfio/<group>` node and hands the fd to
    /// QEMU with `-add-fd` (simulated hosts, where QEMU cannot open a FUSE "device").
    HoldFd,
}

/// Limits and site parameters of one policy plugin slot (`[plugins.<kind>]`).
#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Plugins {
    pub placement: Option<PluginSlot>,
    pub hypervisor: Option<PluginSlot>,
    pub grace: Option<PluginSlot>,
}

/// The agent's configuration. Defaults are production defaults (ARCHITECTURE.md
/// "Configuration").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Data directory (records, claims, images). Default `/var/lib/gpuvisor`.
    pub data_dir: PathBuf,
    /// JSON-RPC Unix socket (mode 0600). Default `/run/gpuvisor/gpuvisor.sock`.
    pub socket: PathBuf,
    /// Root of sysfs/devfs: `/` on a real host, a `gpuvisor-sim` mount in tests.
    pub host_root: PathBuf,
    /// QEMU binary (looked up in `PATH` when not absolute).
    pub qemu_binary: PathBuf,
    /// Cloud Hypervisor binary (looked up in `PATH` when not absolute).
    pub cloud_hypervisor_binary: PathBuf,
    /// Hypervisor for plain instances when the request names none (`qemu`).
    pub default_hypervisor: String,
    /// QEMU accelerator: `kvm` (production) or `tcg` (nested/simulated hosts).
    pub accel: String,
    /// How VFIO devices reach QEMU.
    pub vfio_attach: VfioAttach,
    /// PF addresses gpuvisor may touch for vGPUs; absent = every NVIDIA GPU found (except
    /// the passthrough GPUs).
    pub managed_gpus: Option<Vec<String>>,
    /// GPU addresses gpuvisor may hand out whole (bound to `vfio-pci` with their IOMMU
    /// group); none by default. A GPU is never both a vGPU parent and a passthrough GPU.
    pub passthrough_gpus: Vec<String>,
    /// A command (argv) that stops the host services holding a passthrough GPU through the
    /// host driver (`/dev/nvidia*`: persistenced, DCGM) before the GPU leaves `nvidia`;
    /// empty = none are stopped and a held GPU is refused with `gpu_busy`.
    pub passthrough_stop_services: Vec<String>,
    /// The command (argv) that starts those services again after the bind.
    pub passthrough_start_services: Vec<String>,
    /// Directory of the default plugins (`placement-spread.wasm`, `hypervisor-default.wasm`,
    /// `grace-default.wasm`) used for slots not set under `[plugins]`.
    pub plugin_dir: PathBuf,
    pub plugins: Plugins,
    /// Seconds between reconcile passes.
    pub reconcile_interval_s: u64,
    /// Protection of claims without a recorded VMM, and of orphans, in seconds.
    pub claim_grace_s: u64,
    /// SIGTERM → SIGKILL grace for VMMs holding VFIO devices, seconds (NVIDIA-HOST.md §9).
    pub vfio_term_grace_s: u64,
    /// How long a graceful stop waits for the guest to power off, seconds.
    pub stop_timeout_s: u64,
    /// How long a release retries inline (EBUSY during kernel teardown) before leaving the
    /// claim `release_pending`, seconds.
    pub release_retry_s: u64,
    /// How long each step of a VMM start may take before the start counts as failed,
    /// seconds: QEMU answering QMP; Cloud Hypervisor answering `vmm.ping`, then each of
    /// `vm.create`, `vm.boot`, `vm.info`. (`qmp_ready_timeout_s` is the older name.)
    #[serde(alias = "qmp_ready_timeout_s")]
    pub vmm_ready_timeout_s: u64,
    /// Kernel command line appended for images that do not set one.
    pub default_cmdline: String,
    /// The largest a serial console log (`serial.log`) may grow, bytes, before it is
    /// rotated to `serial.log.1` (QEMU instances). Default 8 MiB; at least 4096.
    pub console_log_max_bytes: u64,
    /// The wait before the first restart under a restart policy, seconds; doubled for each
    /// further restart within `restart_window_s`, at most 60 s.
    pub restart_backoff_s: u64,
    /// At most this many restarts within `restart_window_s`; then the instance stays
    /// `stopped` until started by hand.
    pub restart_limit: u32,
    /// The window of `restart_limit`, seconds.
    pub restart_window_s: u64,
    /// An instance may have at most this times the host's `MemTotal` of guest memory; a
    /// create or start beyond it is refused. Default 1.0.
    pub memory_overcommit: f64,
    /// An instance may have at most this times the host's CPUs as vCPUs. Default 4.0.
    pub vcpu_overcommit: f64,
    /// QEMU runs under its seccomp sandbox (`-sandbox on` with obsolete, elevateprivileges,
    /// spawn and resourcecontrol denied). Default true.
    pub qemu_sandbox: bool,
    /// The unprivileged user every VMM runs as (no capabilities, `no_new_privs`); `root`
    /// runs them as the agent. Default `gpuvisor-vmm` (created by `scripts/setup`).
    pub vmm_user: String,
    /// Where cgroup v2 has the memory controller: each VMM runs in its own cgroup
    /// (`/sys/fs/cgroup/gpuvisor/vm-<id>`) whose `memory.max` is the guest memory plus
    /// `cgroup_memory_overhead_mib`. Default true.
    pub vmm_cgroup: bool,
    /// The VMM's own memory on top of the guest's, in its cgroup's limit, MiB. Default 1024.
    pub cgroup_memory_overhead_mib: u64,
    /// `text` or `json`.
    pub log_format: String,
    /// When set, every policy plugin input the agent sends is also written to this directory
    /// as `<kind>-<unix ms>-<n>.json`, so a site can test a new plugin on its real data with
    /// `gpuvisor plugin test` before swapping it in.
    pub record_policy_inputs: Option<PathBuf>,
    /// Optional loopback HTTP listener serving `GET /metrics` (Prometheus text), e.g.
    /// `127.0.0.1:9464`. Only loopback addresses are accepted.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// `user` NICs run QEMU user-mode networking with `restrict=on`: the guest reaches only
    /// its host port forwards, never the host's other services or the outside network.
    /// Default true.
    pub user_net_restrict: bool,
    /// `qemu-img` (looked up in `PATH` when not absolute): inspects imported disks, copies
    /// them into images, creates the instances' overlays. Default `qemu-img` (Debian
    /// `qemu-utils`).
    pub qemu_img_binary: PathBuf,
    /// The UEFI firmware code (read-only pflash unit 0) for `boot = "uefi"`. Default
    /// `/usr/share/OVMF/OVMF_CODE_4M.fd` (Debian `ovmf`).
    pub ovmf_code: PathBuf,
    /// The UEFI variable store template, copied once per instance to
    /// `<instance dir>/efivars.fd` (pflash unit 1). Default `/usr/share/OVMF/OVMF_VARS_4M.fd`;
    /// it must match `ovmf_code` (both 4M, or both 2M).
    pub ovmf_vars: PathBuf,
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
            vfio_term_grace_s: 5,
            stop_timeout_s: 30,
            release_retry_s: 30,
            vmm_ready_timeout_s: 30,
            default_cmdline: "console=ttyS0 panic=-1".into(),
            console_log_max_bytes: 8 * 1024 * 1024,
            restart_backoff_s: 1,
            restart_limit: 5,
            restart_window_s: 600,
            memory_overcommit: 1.0,
            vcpu_overcommit: 4.0,
            qemu_sandbox: true,
            vmm_user: "gpuvisor-vmm".into(),
            vmm_cgroup: true,
            cgroup_memory_overhead_mib: 1024,
            log_format: "text".into(),
            record_policy_inputs: None,
            metrics_listen: None,
            user_net_restrict: true,
            qemu_img_binary: PathBuf::from("qemu-img"),
            ovmf_code: PathBuf::from("/usr/share/OVMF/OVMF_CODE_4M.fd"),
            ovmf_vars: PathBuf::from("/usr/share/OVMF/OVMF_VARS_4M.fd"),
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
            ("vfio_term_grace_s", self.vfio_term_grace_s),
            ("stop_timeout_s", self.stop_timeout_s),
            ("release_retry_s", self.release_retry_s),
            ("vmm_ready_timeout_s", self.vmm_ready_timeout_s),
            ("restart_backoff_s", self.restart_backoff_s),
            ("restart_window_s", self.restart_window_s),
        ] {
            if v > MAX_DURATION_S {
                anyhow::bail!("{key} = {v} is too large (at most {MAX_DURATION_S} s, one year)");
            }
        }
        if !self.host_root.is_dir() {
            anyhow::bail!("host_root {} is not a directory", self.host_root.display());
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

pub use crate::store::Labels;

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
