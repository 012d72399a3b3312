//! # doctor — `gpuvisor host check`: what gpuvisor needs from this host, read only
//!
//! [`check_host`] reads the host (sysfs and devfs under `host_root`; `/proc`, `/dev/kvm`,
//! the cgroup v2 mount, the passwd database and the hypervisor binaries on the real host,
//! as the agent itself does) and answers a [`HostReport`]: one [`Check`] per line, each
//! with a [`Verdict`] and one sentence saying what was found and, when not `ok`, what to
//! do. It never writes to the host: no sysfs write, no device-node open other than
//! `/dev/kvm` (opened to ask `KVM_GET_API_VERSION`; an open of `/dev/kvm` changes nothing).
//! The hypervisor probes are the agent's own ([`crate::hypervisor::Driver::probe`]; the
//! Cloud Hypervisor probe runs a throw-away VMM on a temporary socket).
//!
//! It reads what `devices/` and `hypervisor/` know of a host, so it sits above them (not in
//! `host/`, which they build on).
//!
//! Sources: docs/design/host.md §§1–7 (what the frameworks look like in sysfs);
//! `Documentation/ABI/testing/sysfs-bus-pci` (`sriov_totalvfs`, `sriov_numvfs`,
//! `virtfn<N>`); `Documentation/virt/kvm/api.rst` (`KVM_GET_API_VERSION` answers 12);
//! `Documentation/admin-guide/cgroup-v2.rst` (`cgroup.controllers`).

use crate::config::Config;
use crate::devices::{self, mdev::MdevParent, passthrough, vendor_vfio::GpuInfo, HostMode, NVIDIA_VENDOR};
use crate::host::{cgroup, proc, HostRoot, KVM_DEVICE};
use crate::hypervisor::HypervisorKind;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::Path;

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// What gpuvisor needs is there.
    Ok,
    /// gpuvisor runs, but something is missing or degraded (the detail says what to do).
    Warn,
    /// gpuvisor cannot do its job on this host as configured until this is fixed.
    Fail,
    /// Not relevant with this configuration (the detail says why).
    Skip,
}

impl Verdict {
    /// The table spelling: `ok`, `warn`, `fail`, `skip`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
            Verdict::Skip => "skip",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Check {
    /// What was checked: `iommu`, `vfio-pci`, `vgpu-framework`, `nvidia-driver`,
    /// `vgpu-manager`, `gpu <PF>`, `passthrough <BDF>`, `kvm`, `qemu`, `cloud-hypervisor`,
    /// `pid-namespace`, `proc`, `vmm-ids`, `cgroup`.
    pub check: String,
    /// The verdict.
    pub verdict: Verdict,
    /// One sentence: what was found and, when not `ok`, what to do.
    pub detail: String,
}

/// The whole report (`host.check`'s result; `gpuvisor host check -o json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct HostReport {
    /// The host root read (`/` on a real host, a simulator mount in tests).
    pub host_root: String,
    /// The checks, in a stable order.
    pub checks: Vec<Check>,
    /// True when some check says `fail` (the CLI then exits 1).
    pub failed: bool,
}

/// `KVM_GET_API_VERSION` answers this on every kernel since 2.6.22 (api.rst §4.1).
pub const KVM_API_VERSION: i32 = 12;

/// `KVM_GET_API_VERSION` = `_IO(KVMIO, 0x00)`, `KVMIO` = 0xAE (include/uapi/linux/kvm.h).
/// Called through `libc::ioctl` with an explicit 0 argument: KVM answers EINVAL to a
/// non-zero one, and nix's `ioctl_none!` passes none (the register holds garbage).
const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;

fn check(name: impl Into<String>, verdict: Verdict, detail: impl Into<String>) -> Check {
    Check { check: name.into(), verdict, detail: detail.into() }
}

/// Runs every check for configuration `cfg` (its `host_root`, `managed_gpus`,
/// `passthrough_gpus`, `accel`, binaries, `vmm_ids`, `vmm_cgroup`). Never fails: an
/// unreadable file is a verdict. Takes a few seconds (the hypervisor probes).
pub fn check_host(cfg: &Config) -> HostReport {
    let host = HostRoot::new(&cfg.host_root);
    let needs_kvm = cfg.accel == "kvm";
    let mut checks = Vec::new();
    let nvidia_pcis = nvidia_functions(&host);
    let scan = devices::scan(&host, &cfg.passthrough_gpus);
    let vgpu_found = matches!(scan.mode, Ok(HostMode::VendorVfio | HostMode::Mdev | HostMode::Mixed));
    checks.push(iommu(&host));
    checks.push(vfio_pci(&host, !cfg.passthrough_gpus.is_empty()));
    checks.push(framework(&scan.mode, &nvidia_pcis, !cfg.passthrough_gpus.is_empty()));
    checks.push(nvidia_driver(&host, scan.driver_version.as_deref(), !nvidia_pcis.is_empty()));
    checks.push(vgpu_manager(&host, vgpu_found, cfg.passthrough_gpus.is_empty()));
    checks.extend(managed_gpus(&host, cfg, &nvidia_pcis, &scan));
    checks.extend(cfg.passthrough_gpus.iter().map(|b| passthrough_gpu(&host, b)));
    checks.push(kvm(needs_kvm));
    checks.extend(HypervisorKind::ALL.map(|k| hypervisor(cfg, k)));
    checks.push(pid_namespace());
    checks.push(proc_readable());
    checks.push(vmm_ids(cfg.vmm_ids, needs_kvm));
    checks.push(cgroup_v2(cfg.vmm_cgroup));
    let failed = checks.iter().any(|c| c.verdict == Verdict::Fail);
    HostReport { host_root: host.root().display().to_string(), checks, failed }
}

/// Entries of a directory (sorted); `Ok(vec![])` when it is missing.
fn entries(dir: &Path) -> io::Result<Vec<String>> {
    match std::fs::read_dir(dir) {
        Ok(rd) => {
            let mut v = Vec::new();
            for e in rd {
                v.push(e?.file_name().to_string_lossy().into_owned());
            }
            v.sort();
            Ok(v)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

fn iommu(host: &HostRoot) -> Check {
    let groups = match entries(&host.iommu_groups_dir()) {
        Ok(g) => g,
        Err(e) => return check("iommu", Verdict::Fail, format!("cannot list sys/kernel/iommu_groups: {e}")),
    };
    let units = entries(&host.iommu_class_dir()).unwrap_or_default();
    let units = if units.is_empty() { "none listed in sys/class/iommu".to_string() } else { units.join(", ") };
    if groups.is_empty() {
        return check(
            "iommu",
            Verdict::Fail,
            "no IOMMU groups: enable VT-d (Intel) or AMD-Vi/IOMMU (AMD) in the firmware and boot with \
             intel_iommu=on iommu=pt (Intel) or iommu=pt (AMD); see docs/hardware.md",
        );
    }
    check("iommu", Verdict::Ok, format!("{} IOMMU groups; IOMMU units: {units}", groups.len()))
}

fn vfio_pci(host: &HostRoot, passthrough: bool) -> Check {
    if host.pci_driver_dir(passthrough::VFIO_PCI).is_dir() {
        return check("vfio-pci", Verdict::Ok, "the vfio-pci driver is registered");
    }
    if passthrough {
        check(
            "vfio-pci",
            Verdict::Fail,
            "the vfio-pci driver is not registered, and passthrough_gpus needs it: `modprobe vfio-pci` (and add \
             vfio-pci to /etc/modules-load.d/)",
        )
    } else {
        check(
            "vfio-pci",
            Verdict::Skip,
            "the vfio-pci driver is not registered; only whole-GPU passthrough needs it (vGPU VFs use the NVIDIA \
             driver's own VFIO registration)",
        )
    }
}

fn framework(mode: &Result<HostMode, devices::DeviceError>, nvidia: &[NvidiaFn], passthrough: bool) -> Check {
    let name = "vgpu-framework";
    match mode {
        Err(e) => check(name, Verdict::Fail, format!("the vGPU probe failed: {e}; check the NVIDIA driver and dmesg")),
        Ok(HostMode::VendorVfio) => check(
            name,
            Verdict::Ok,
            "vendor-specific VFIO: VFs bound to nvidia with nvidia/current_vgpu_type (docs/design/host.md §3)",
        ),
        Ok(HostMode::Mdev) => check(
            name,
            Verdict::Ok,
            "mdev: sys/class/mdev_bus parents with mdev_supported_types (docs/design/host.md §6)",
        ),
        Ok(HostMode::Mixed) => check(
            name,
            Verdict::Fail,
            "both vendor-VFIO VFs and mdev parents are present (mixed): vGPU claims are refused; install one \
             vGPU manager only",
        ),
        Ok(HostMode::WaitingForVfs) => check(
            name,
            Verdict::Warn,
            "an NVIDIA GPU has SR-IOV but no VFs enabled yet: run `/usr/lib/nvidia/sriov-manage -e ALL` (at boot, \
             see docs/hardware.md)",
        ),
        Ok(HostMode::None) if passthrough => {
            check(name, Verdict::Skip, "no vGPU devices; this host hands out whole GPUs only (passthrough_gpus)")
        }
        Ok(HostMode::None) if nvidia.iter().all(|f| !f.is_gpu()) => check(
            name,
            Verdict::Warn,
            "no NVIDIA GPU on this host: gpuvisor runs VMs without GPUs only; on a GPU host see docs/hardware.md",
        ),
        Ok(HostMode::None) => check(
            name,
            Verdict::Warn,
            "NVIDIA GPUs are present but offer no vGPU devices: install the NVIDIA vGPU manager and enable SR-IOV \
             VFs (docs/hardware.md), or list them in passthrough_gpus",
        ),
    }
}

/// The driver version from `/proc/driver/nvidia/version`'s `NVRM version:` line: its first
/// token that looks like a version (`580.82.07`). `None` when there is no such line.
pub fn parse_proc_nvidia_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.trim_start().starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|t| t.contains('.') && t.split('.').all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())))
        .map(str::to_string)
}

fn nvidia_driver(host: &HostRoot, module_version: Option<&str>, nvidia_present: bool) -> Check {
    let name = "nvidia-driver";
    let proc_version =
        devices::read_attr(&host.nvidia_proc_version_path()).ok().and_then(|t| parse_proc_nvidia_version(&t));
    match (module_version, proc_version.as_deref()) {
        (Some(m), Some(p)) if m != p => check(
            name,
            Verdict::Warn,
            format!(
                "sys/module/nvidia/version says {m} but proc/driver/nvidia/version says {p}: a driver update is \
                 half done; reboot or reload the driver"
            ),
        ),
        (Some(m), Some(_)) => check(
            name,
            Verdict::Ok,
            format!("NVIDIA driver {m} (sys/module/nvidia/version, proc/driver/nvidia/version)"),
        ),
        (Some(m), None) => check(name, Verdict::Ok, format!("NVIDIA driver {m} (sys/module/nvidia/version)")),
        (None, Some(p)) => check(name, Verdict::Ok, format!("NVIDIA driver {p} (proc/driver/nvidia/version)")),
        (None, None) if nvidia_present => check(
            name,
            Verdict::Warn,
            "NVIDIA devices are present but no NVIDIA driver is loaded (no sys/module/nvidia/version): install \
             the vGPU manager's host driver, or use the GPUs for passthrough only",
        ),
        (None, None) => check(name, Verdict::Warn, "no NVIDIA driver is loaded (no sys/module/nvidia/version)"),
    }
}

/// The vGPU manager's kernel module (NVIDIA vGPU software user guide, "Verifying the
/// Installation of the NVIDIA vGPU Software": `lsmod` lists `nvidia_vgpu_vfio`).
const VGPU_MODULE: &str = "nvidia_vgpu_vfio";

fn vgpu_manager(host: &HostRoot, vgpu_found: bool, vgpu_wanted: bool) -> Check {
    let name = "vgpu-manager";
    let dir = host.module_dir(VGPU_MODULE);
    if dir.is_dir() {
        let v = devices::read_attr(&dir.join("version")).ok();
        return check(
            name,
            Verdict::Ok,
            match v {
                Some(v) => format!("the vGPU manager module {VGPU_MODULE} {v} is loaded"),
                None => format!("the vGPU manager module {VGPU_MODULE} is loaded"),
            },
        );
    }
    if vgpu_found {
        check(
            name,
            Verdict::Warn,
            format!("vGPU devices exist but sys/module/{VGPU_MODULE} does not: check `lsmod | grep nvidia`"),
        )
    } else if !vgpu_wanted {
        check(name, Verdict::Skip, format!("{VGPU_MODULE} is not loaded; this host hands out whole GPUs only"))
    } else {
        check(
            name,
            Verdict::Warn,
            format!(
                "the vGPU manager is not loaded (no sys/module/{VGPU_MODULE}): install the NVIDIA vGPU manager \
                 (docs/hardware.md)"
            ),
        )
    }
}

/// An NVIDIA PCI function as listed in `sys/bus/pci/devices`.
#[derive(Debug, Clone)]
struct NvidiaFn {
    bdf: String,
    class: String,
    is_vf: bool,
}

impl NvidiaFn {
    /// A display controller (class `0x03xxxx`).
    fn is_gpu(&self) -> bool {
        self.class.starts_with("0x03")
    }
}

fn nvidia_functions(host: &HostRoot) -> Vec<NvidiaFn> {
    let Ok(all) = entries(&host.pci_devices_dir()) else { return Vec::new() };
    all.into_iter()
        .filter_map(|bdf| {
            let d = host.pci_device(&bdf);
            if devices::read_attr(&d.join("vendor")).ok()? != NVIDIA_VENDOR {
                return None;
            }
            Some(NvidiaFn {
                class: devices::read_attr(&d.join("class")).unwrap_or_default(),
                is_vf: d.join("physfn").symlink_metadata().is_ok(),
                bdf,
            })
        })
        .collect()
}

fn read_u32(path: &Path) -> Option<u32> {
    devices::read_attr(path).ok()?.parse().ok()
}

/// Types listed once each, in first-seen order, canonical names (`L40S-2Q`).
fn push_unique(out: &mut Vec<String>, name: &str) {
    let n = gpuvisor_sdk::canonical_profile(name).to_string();
    if !out.contains(&n) {
        out.push(n);
    }
}

/// The vGPU devices of `pf` and the types they can create now: (devices, free, types).
fn vgpu_devices(
    pf: &str,
    vendor: &[GpuInfo],
    parents: &[MdevParent],
    mdev_parents_used: &[String],
) -> (usize, usize, Vec<String>) {
    let mut types = Vec::new();
    if let Some(g) = vendor.iter().find(|g| g.bdf == pf) {
        let free: Vec<_> = g.vfs.iter().filter(|v| v.current_type == Ok(0)).collect();
        for v in &free {
            for e in v.catalog.as_ref().map(|c| c.entries.as_slice()).unwrap_or(&[]) {
                push_unique(&mut types, &e.name);
            }
        }
        return (g.vfs.len(), free.len(), types);
    }
    let mine: Vec<_> = parents.iter().filter(|p| p.pf == pf).collect();
    let free: Vec<_> = mine.iter().filter(|p| !mdev_parents_used.contains(&p.bdf)).collect();
    for p in &free {
        for t in p.types().iter().filter(|t| t.available > 0) {
            push_unique(&mut types, &t.name);
        }
    }
    (mine.len(), free.len(), types)
}

fn managed_gpus(host: &HostRoot, cfg: &Config, nvidia: &[NvidiaFn], scan: &devices::HostScan) -> Vec<Check> {
    let is_pt = |b: &str| cfg.passthrough_gpus.iter().any(|p| p.eq_ignore_ascii_case(b));
    let pfs: Vec<&NvidiaFn> = nvidia.iter().filter(|f| f.is_gpu() && !f.is_vf && !is_pt(&f.bdf)).collect();
    let mut out = Vec::new();
    let managed = |b: &str| match &cfg.managed_gpus {
        None => true,
        Some(m) => m.iter().any(|g| g.eq_ignore_ascii_case(b)),
    };
    for m in cfg.managed_gpus.iter().flatten() {
        if !pfs.iter().any(|f| f.bdf.eq_ignore_ascii_case(m)) {
            out.push(check(
                format!("gpu {m}"),
                Verdict::Fail,
                "listed in managed_gpus but not an NVIDIA GPU on this host (no such PCI function, or not a \
                 physical NVIDIA GPU): fix managed_gpus",
            ));
        }
    }
    let used: Vec<String> = scan.mdevs.iter().map(|m| m.parent.clone()).collect();
    for f in pfs {
        let name = format!("gpu {}", f.bdf);
        if !managed(&f.bdf) {
            out.push(check(name, Verdict::Skip, "not in managed_gpus: gpuvisor leaves it alone"));
            continue;
        }
        let d = host.pci_device(&f.bdf);
        let total = read_u32(&d.join("sriov_totalvfs"));
        let numvfs = read_u32(&d.join("sriov_numvfs"));
        let links = entries(&d).map(|e| e.iter().filter(|n| n.starts_with("virtfn")).count()).unwrap_or(0);
        let model = read_model(host, &f.bdf);
        let (devs, free, types) = vgpu_devices(&f.bdf, &scan.vendor, &scan.parents, &used);
        let types = if types.is_empty() { "none".to_string() } else { types.join(", ") };
        let detail = match (total, numvfs) {
            (Some(t), Some(0)) if t > 0 => {
                out.push(check(
                    name,
                    Verdict::Warn,
                    format!(
                        "{model}: SR-IOV VFs are not enabled (sriov_numvfs 0 of {t}): run \
                         `/usr/lib/nvidia/sriov-manage -e {}` (at boot, before creating vGPUs; docs/hardware.md)",
                        f.bdf
                    ),
                ));
                continue;
            }
            (Some(t), Some(n)) => {
                let mismatch = if links != n as usize {
                    format!(" (but {links} virtfn links: trusting the links)")
                } else {
                    String::new()
                };
                format!("{model}: {n} of {t} SR-IOV VFs enabled{mismatch}; ")
            }
            _ => format!("{model}: no SR-IOV; "),
        };
        if devs == 0 {
            out.push(check(
                name,
                Verdict::Warn,
                format!("{detail}no vGPU devices on it: install the NVIDIA vGPU manager (docs/hardware.md)"),
            ));
            continue;
        }
        out.push(check(name, Verdict::Ok, format!("{detail}{devs} vGPU devices, {free} free; creatable now: {types}")));
    }
    out
}

/// The GPU's model name from its PCI device id (`NVIDIA L40S`), or the id itself.
fn read_model(host: &HostRoot, bdf: &str) -> String {
    let id = devices::read_attr(&host.pci_device(bdf).join("device")).unwrap_or_default();
    devices::model_by_device_id(&id).map(str::to_string).unwrap_or_else(|| format!("NVIDIA device {id}"))
}

fn passthrough_gpu(host: &HostRoot, bdf: &str) -> Check {
    let name = format!("passthrough {bdf}");
    match passthrough::read_gpu(host, bdf) {
        Err(e) => check(name, Verdict::Fail, format!("cannot be read: {e}")),
        Ok(None) => check(
            name,
            Verdict::Fail,
            "listed in passthrough_gpus but no such PCI function exists: fix passthrough_gpus",
        ),
        Ok(Some(g)) => {
            let fns: Vec<String> = g
                .functions
                .iter()
                .map(|f| format!("{} ({})", f.bdf, f.driver.as_deref().unwrap_or("no driver")))
                .collect();
            let mut detail = format!("IOMMU group {}: {}", g.group, fns.join(", "));
            if !g.bridges.is_empty() {
                detail.push_str(&format!("; bridges (stay): {}", g.bridges.join(", ")));
            }
            if g.numvfs > 0 {
                return check(
                    name,
                    Verdict::Fail,
                    format!(
                        "{detail}; it has {} SR-IOV VFs enabled: a vGPU parent cannot be passed through whole",
                        g.numvfs
                    ),
                );
            }
            if !g.foreign.is_empty() {
                return check(
                    name,
                    Verdict::Fail,
                    format!(
                        "{detail}; the group also holds {} (not this GPU's): move the card to another slot or fix \
                         the ACS/IOMMU grouping",
                        g.foreign.join(", ")
                    ),
                );
            }
            check(name, Verdict::Ok, detail)
        }
    }
}

/// Opens `/dev/kvm` and asks its API version.
fn kvm_api_version() -> Result<i32, String> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(KVM_DEVICE)
        .map_err(|e| format!("cannot open {KVM_DEVICE}: {e}"))?;
    // SAFETY: KVM_GET_API_VERSION reads no memory: its argument must be 0; it returns an int.
    let v = unsafe { libc::ioctl(f.as_raw_fd(), KVM_GET_API_VERSION, 0 as libc::c_ulong) };
    if v < 0 {
        return Err(format!("KVM_GET_API_VERSION on {KVM_DEVICE}: {}", io::Error::last_os_error()));
    }
    Ok(v)
}

fn kvm(needed: bool) -> Check {
    match kvm_api_version() {
        Ok(KVM_API_VERSION) => {
            check("kvm", Verdict::Ok, format!("{KVM_DEVICE} opens; KVM API version {KVM_API_VERSION}"))
        }
        Ok(v) => {
            check("kvm", Verdict::Fail, format!("{KVM_DEVICE} answers KVM API version {v}, not {KVM_API_VERSION}"))
        }
        Err(e) if needed => check(
            "kvm",
            Verdict::Fail,
            format!("{e}: load kvm_intel or kvm_amd and enable virtualisation (VT-x/AMD-V) in the firmware"),
        ),
        Err(e) => check("kvm", Verdict::Warn, format!("{e}; accel = \"tcg\": guests run emulated (slow)")),
    }
}

fn hypervisor(cfg: &Config, kind: HypervisorKind) -> Check {
    let binary = kind.binary(cfg);
    let default = cfg.default_hypervisor == kind.name();
    match kind.driver().probe(binary) {
        Ok(v) => check(kind.name(), Verdict::Ok, format!("{} runs: {v}", binary.display())),
        // The default, and the one that carries vGPUs, must run.
        Err(e) if default || kind.capabilities().contains(&gpuvisor_sdk::Capability::VendorVfio) => check(
            kind.name(),
            Verdict::Fail,
            format!(
                "{e}: install it (`apt-get install qemu-system-x86`) or set {}_binary",
                kind.name().replace('-', "_")
            ),
        ),
        Err(e) => check(kind.name(), Verdict::Warn, format!("{e}; instances cannot ask for {}", kind.name())),
    }
}

fn pid_namespace() -> Check {
    match proc::own_pid_namespace() {
        Some(proc::INITIAL_PID_NS) => check("pid-namespace", Verdict::Ok, "this is the host's PID namespace"),
        Some(ns) => check(
            "pid-namespace",
            Verdict::Warn,
            format!(
                "PID namespace {ns} is not the host's: processes outside it are invisible to the liveness checks \
                 and open-handle scans; run the agent in the host PID namespace"
            ),
        ),
        None => check("pid-namespace", Verdict::Warn, "the PID namespace cannot be read from /proc/self/ns/pid"),
    }
}

fn proc_readable() -> Check {
    match proc::fd_tables_readable() {
        Ok(n) => check("proc", Verdict::Ok, format!("/proc is readable: the fd tables of {n} processes")),
        Err(e) => check(
            "proc",
            Verdict::Fail,
            format!("{e}: the open-handle scan fails closed (every release refused); run as root"),
        ),
    }
}

fn vmm_ids(ids: crate::config::VmmIds, needs_kvm: bool) -> Check {
    use crate::hypervisor::confine::{range_conflicts, range_reserved, VmmIdentity, RESERVATION_OWNER};
    let range = format!("{}…{}", ids.first, ids.last());
    let etc = Path::new("/etc");
    let conflicts = range_conflicts(ids, etc);
    if !conflicts.is_empty() {
        return check("vmm-ids", Verdict::Fail, format!("vmm_ids {range} is in use: {}", conflicts.join("; ")));
    }
    let reserved = if range_reserved(ids, etc) {
        format!("reserved for {RESERVATION_OWNER} in /etc/subuid and /etc/subgid")
    } else {
        String::new()
    };
    // Every VMM holds the same groups besides its own: the first id stands for all.
    let identity = VmmIdentity::new(ids.first);
    let meta = match std::fs::metadata(KVM_DEVICE) {
        Ok(m) => m,
        Err(e) => {
            let v = if needs_kvm { Verdict::Fail } else { Verdict::Ok };
            return check("vmm-ids", v, format!("VMMs run under ids {range}; {KVM_DEVICE}: {e}"));
        }
    };
    use std::os::unix::fs::MetadataExt;
    let (gid, mode) = (meta.gid(), meta.mode());
    let group =
        nix::unistd::Group::from_gid(gid.into()).ok().flatten().map(|g| g.name).unwrap_or_else(|| gid.to_string());
    let reach = if identity.groups.contains(&gid) && mode & 0o060 == 0o060 {
        Some(format!("through group {group}"))
    } else if mode & 0o006 == 0o006 {
        Some("as any user".to_string())
    } else {
        None
    };
    match (reach, reserved.is_empty()) {
        (Some(how), false) => check(
            "vmm-ids",
            Verdict::Ok,
            format!("VMMs run under ids {range} ({reserved}); they reach {KVM_DEVICE} {how}"),
        ),
        (Some(how), true) => check(
            "vmm-ids",
            Verdict::Warn,
            format!(
                "VMMs run under ids {range}, which are not reserved in /etc/subuid and /etc/subgid (a user added \
                 later could get them): usermod --add-subuids {f}-{l} --add-subgids {f}-{l} {RESERVATION_OWNER}; they \
                 reach {KVM_DEVICE} {how}",
                f = ids.first,
                l = ids.last()
            ),
        ),
        (None, _) => check(
            "vmm-ids",
            if needs_kvm { Verdict::Fail } else { Verdict::Warn },
            format!(
                "VMMs run under ids {range}, which cannot open {KVM_DEVICE} (group {group}, mode {:o}): create the \
                 kvm group and give {KVM_DEVICE} to it (udev), as Debian's qemu packages do",
                mode & 0o777
            ),
        ),
    }
}

fn cgroup_v2(enabled: bool) -> Check {
    if !enabled {
        return check("cgroup", Verdict::Skip, "vmm_cgroup = false: VMMs run without a per-VM cgroup");
    }
    match cgroup::v2_controllers(Path::new(cgroup::CGROUP2_ROOT)) {
        Ok(Some(c)) if c.iter().any(|c| c == "memory") => check(
            "cgroup",
            Verdict::Ok,
            format!("cgroup v2 with the memory controller at {}: each VM gets its memory.max", cgroup::CGROUP2_ROOT),
        ),
        Ok(Some(_)) => check(
            "cgroup",
            Verdict::Warn,
            format!(
                "cgroup v2 at {} has no memory controller: VMMs run without a memory limit; enable it \
                 (cgroup_enable=memory)",
                cgroup::CGROUP2_ROOT
            ),
        ),
        Ok(None) => check(
            "cgroup",
            Verdict::Warn,
            format!(
                "{} is cgroup v1 or hybrid: VMMs run without a per-VM memory limit; boot with \
                 systemd.unified_cgroup_hierarchy=1 for cgroup v2",
                cgroup::CGROUP2_ROOT
            ),
        ),
        Err(e) => {
            check("cgroup", Verdict::Warn, format!("cannot read {}/cgroup.controllers: {e}", cgroup::CGROUP2_ROOT))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proc_banner_gives_the_version() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build  \
                    (dvs-builder@U16-I3-B03-4-3)  Wed Aug 27 01:01:01 UTC 2025\nGCC version:  gcc version 13.3.0\n";
        assert_eq!(parse_proc_nvidia_version(open).as_deref(), Some("580.82.07"));
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.16  Thu Feb 22 01:44:30 UTC 2024\n";
        assert_eq!(parse_proc_nvidia_version(closed).as_deref(), Some("550.54.16"));
        assert_eq!(parse_proc_nvidia_version("GCC version: 12.2.0\n"), None);
        assert_eq!(parse_proc_nvidia_version(""), None);
        assert_eq!(parse_proc_nvidia_version("NVRM version: NVIDIA x86_64 Kernel Module  (no number)\n"), None);
    }

    #[test]
    fn an_empty_host_root_fails_the_iommu_and_warns_about_gpus() {
        let d = tempfile::tempdir().unwrap();
        let h = HostRoot::new(d.path());
        assert_eq!(iommu(&h).verdict, Verdict::Fail);
        assert_eq!(vfio_pci(&h, false).verdict, Verdict::Skip);
        assert_eq!(vfio_pci(&h, true).verdict, Verdict::Fail);
        assert_eq!(framework(&Ok(HostMode::None), &[], false).verdict, Verdict::Warn);
        assert_eq!(nvidia_driver(&h, None, false).verdict, Verdict::Warn);
        assert_eq!(vgpu_manager(&h, false, true).verdict, Verdict::Warn);
    }

    #[test]
    fn iommu_groups_and_units_are_counted() {
        let d = tempfile::tempdir().unwrap();
        for g in ["0", "1", "2"] {
            std::fs::create_dir_all(d.path().join("sys/kernel/iommu_groups").join(g)).unwrap();
        }
        std::fs::create_dir_all(d.path().join("sys/class/iommu/dmar0")).unwrap();
        let c = iommu(&HostRoot::new(d.path()));
        assert_eq!(c.verdict, Verdict::Ok);
        assert_eq!(c.detail, "3 IOMMU groups; IOMMU units: dmar0");
    }

    #[test]
    fn a_module_and_proc_version_disagreeing_is_a_warning() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("proc/driver/nvidia")).unwrap();
        std::fs::write(
            d.path().join("proc/driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.82.07  Wed Aug 27 UTC 2025\n",
        )
        .unwrap();
        let h = HostRoot::new(d.path());
        assert_eq!(nvidia_driver(&h, Some("580.82.07"), true).verdict, Verdict::Ok);
        let c = nvidia_driver(&h, Some("570.1"), true);
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert_eq!(nvidia_driver(&h, None, true).detail, "NVIDIA driver 580.82.07 (proc/driver/nvidia/version)");
    }
}
