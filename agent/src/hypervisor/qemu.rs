//! # hypervisor::qemu — the QEMU driver
//!
//! [`qemu_command_line`] is pure; [`Qemu`] implements [`Driver`]: readiness is QMP
//! `query-status` answering, the power button is `system_powerdown`, quitting is `quit`.
//! The process itself is started by [`super::process::spawn`].
//!
//! **Hold-fd (simulated host).** QEMU gets the VFIO group node as fd 3 in an fdset
//! (`-add-fd fd=3,set=1`) **and** as fd 4, which QEMU never touches: QEMU closes fdset fds
//! that no device has dup'ed when the last QMP monitor disconnects while the VM runs
//! (`monitor_fdset_cleanup` in QEMU 7.2 `monitor/misc.c`:
//! `QLIST_EMPTY(&mon_fdset->dup_fds) && mon_refcount == 0 && runstate_is_running()`), so
//! fd 3 alone would be dropped after the first QMP session.

use std::path::Path;
use std::time::Duration;

use super::process::{wait_answering, RunningVmm, HOLD_FD_FDSET};
use super::qmp::QmpClient;
use super::{
    DiskCounters, Driver, HypervisorError, HypervisorKind, NicBackend, StartFailure, UefiPflash, VfioAttach, VmSpec,
    VmmError,
};

/// The QEMU driver.
#[derive(Debug, Clone, Copy)]
pub struct Qemu;

/// Escapes a value for QEMU's option syntax (`key=value,key=value`): commas are doubled.
fn opt_escape(s: &str) -> String {
    s.replace(',', ",,")
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The fdset opaque string for a held node: `vfio-group-<basename>`.
fn hold_fd_opaque(node: &Path) -> String {
    let g = node.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    format!("vfio-group-{g}")
}

/// The disk and firmware arguments of `spec`. Pure.
///
/// UEFI: `-drive if=pflash,format=raw,unit=0,readonly=on,file=<code>` and
/// `-drive if=pflash,format=raw,unit=1,file=<vars>` (OVMF's split image: read-only code,
/// the instance's own variable store). The disk: `-drive file=<overlay>,format=qcow2,
/// if=none,id=disk0 -device virtio-blk-pci,drive=disk0[,bootindex=0]`; `bootindex=0` only
/// when the firmware boots the disk (no `-kernel`): QEMU gives a `-kernel` its own boot
/// entry at index 0.
fn disk_args(spec: &VmSpec) -> Vec<String> {
    let mut a = Vec::new();
    if let Some(UefiPflash { code, vars }) = &spec.uefi {
        a.push("-drive".to_string());
        a.push(format!("if=pflash,format=raw,unit=0,readonly=on,file={}", opt_escape(&path_str(code))));
        if let Some(vars) = vars {
            a.push("-drive".to_string());
            a.push(format!("if=pflash,format=raw,unit=1,file={}", opt_escape(&path_str(vars))));
        }
    }
    if let Some(disk) = &spec.disk {
        a.push("-drive".to_string());
        a.push(format!("file={},format=qcow2,if=none,id={}", opt_escape(&path_str(disk)), super::DISK_ID));
        let boot = if spec.kernel.is_none() { ",bootindex=0" } else { "" };
        a.push("-device".to_string());
        a.push(format!("virtio-blk-pci,drive={}{boot}", super::DISK_ID));
    }
    a
}

/// The guest PCI slot of a passthrough GPU's functions.
const PASSTHROUGH_SLOT: u32 = 0x10;

/// QEMU's arguments for `spec` (without the binary itself). Pure.
///
/// Shape: `-machine q35,accel=<accel> -cpu max|host -m <MiB> -smp <n> -nodefaults
/// -no-user-config -display none -uuid <id> -name <name> [-S] [-kernel .. [-initrd ..]
/// [-append ..]] -chardev socket,id=serial0,path=<run_dir>/console.sock,server=on,wait=off,
/// logfile=<run_dir>/serial.log,logappend=on -serial chardev:serial0 -qmp unix:<run_dir>/qmp.sock,server=on,wait=off`
/// then the firmware and disk arguments (`disk_args`), then the VFIO arguments: `-device vfio-pci,sysfsdev=<path>` or, for hold-fd,
/// `-add-fd fd=3,set=1,opaque=vfio-group-<G>`. `-cpu host` only with `kvm` (TCG cannot
/// emulate the host CPU). A passthrough group gets one `-device` per function in guest
/// slot 0x10 (`addr=0x10.<fn>`, `multifunction=on` on function 0).
pub fn qemu_command_line(spec: &VmSpec) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    push(&["-machine", &format!("q35,accel={}", opt_escape(&spec.accel))]);
    push(&["-cpu", if spec.accel == "kvm" { "host" } else { "max" }]);
    push(&["-m", &spec.memory_mib.to_string()]);
    push(&["-smp", &spec.vcpus.to_string()]);
    push(&["-nodefaults", "-no-user-config", "-display", "none"]);
    if spec.sandbox {
        // seccomp: no obsolete syscalls, no setuid/setgid, no fork/exec, no affinity or
        // priority changes.
        push(&["-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]);
    }
    push(&["-uuid", &spec.id.to_string()]);
    push(&["-name", &opt_escape(&spec.name)]);
    if spec.paused {
        push(&["-S"]);
    }
    if spec.incoming.is_some() {
        // The saved state comes through QMP (`migrate-incoming` with an fd): the file is
        // the agent's, never in the VMM's view.
        push(&["-incoming", "defer"]);
    }
    if let Some(kernel) = &spec.kernel {
        push(&["-kernel", &path_str(kernel)]);
        if let Some(initrd) = &spec.initrd {
            push(&["-initrd", &path_str(initrd)]);
        }
        if !spec.cmdline.is_empty() {
            push(&["-append", &spec.cmdline]);
        }
    }
    // The serial console: a Unix socket server for `gpuvisor console` (output is dropped,
    // never blocked, while no client is attached) that also appends everything to the log.
    push(&[
        "-chardev",
        &format!(
            "socket,id=serial0,path={},server=on,wait=off,logfile={},logappend=on",
            opt_escape(&path_str(&spec.console_socket())),
            opt_escape(&path_str(&spec.serial_log()))
        ),
    ]);
    push(&["-serial", "chardev:serial0"]);
    push(&["-qmp", &format!("unix:{},server=on,wait=off", opt_escape(&path_str(&spec.control_socket())))]);
    a.extend(disk_args(spec));
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    match &spec.vfio {
        None => {}
        Some(VfioAttach::Device { sysfsdevs }) if sysfsdevs.len() == 1 => {
            push(&["-device", &format!("vfio-pci,sysfsdev={}", opt_escape(&path_str(&sysfsdevs[0])))])
        }
        // A passthrough group: every function in one guest slot, function 0 multifunction.
        Some(VfioAttach::Device { sysfsdevs }) => {
            for (f, dev) in sysfsdevs.iter().enumerate() {
                let mf = if f == 0 { ",multifunction=on" } else { "" };
                push(&[
                    "-device",
                    &format!("vfio-pci,sysfsdev={},addr=0x{PASSTHROUGH_SLOT:x}.{f}{mf}", opt_escape(&path_str(dev))),
                ])
            }
        }
        Some(VfioAttach::HoldFd { node }) => {
            push(&["-add-fd", &format!("fd={HOLD_FD_FDSET},set=1,opaque={}", opt_escape(&hold_fd_opaque(node)))])
        }
    }
    a.extend(network_args(spec));
    a
}

/// The NIC and seed arguments of `spec` (part of [`qemu_command_line`]). Pure.
///
/// NIC `i` (id `net<i>`): `-netdev user,id=net<i>,restrict=on|off[,hostfwd=<proto>:<addr>:<host>-:<guest>]…`
/// or `-netdev tap,id=net<i>,fd=<5+i>` (the agent's tap, see [`super::tap_fd`]), then
/// `-device virtio-net-pci,netdev=net<i>,mac=<mac>,romfile=` (no option ROM: nothing boots
/// from the network). The seed: `-drive file=<seed>,format=raw,if=none,id=seed,readonly=on
/// -device virtio-blk-pci,drive=seed,serial=cidata`.
pub fn network_args(spec: &VmSpec) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    for (i, nic) in spec.nics.iter().enumerate() {
        let netdev = match &nic.backend {
            NicBackend::User { restrict, forwards } => {
                let mut s = format!("user,id=net{i},restrict={}", if *restrict { "on" } else { "off" });
                for f in forwards {
                    s.push_str(&format!(
                        ",hostfwd={}:{}:{}-:{}",
                        f.proto.as_str(),
                        opt_escape(&f.host_addr),
                        f.host_port,
                        f.guest_port
                    ));
                }
                s
            }
            NicBackend::Tap { .. } => format!("tap,id=net{i},fd={}", super::tap_fd(i)),
        };
        a.extend(["-netdev".to_string(), netdev]);
        a.extend(["-device".to_string(), format!("virtio-net-pci,netdev=net{i},mac={},romfile=", nic.mac)]);
    }
    if let Some(seed) = &spec.seed {
        a.extend([
            "-drive".to_string(),
            format!("file={},format=raw,if=none,id=seed,readonly=on", opt_escape(&path_str(seed))),
            "-device".to_string(),
            "virtio-blk-pci,drive=seed,serial=cidata".to_string(),
        ]);
    }
    a
}

impl Driver for Qemu {
    fn kind(&self) -> HypervisorKind {
        HypervisorKind::Qemu
    }

    fn control_socket_name(&self) -> &'static str {
        "qmp.sock"
    }

    fn log_name(&self) -> &'static str {
        "qemu.log"
    }

    /// A socket chardev on `console.sock` with `logfile=serial.log,logappend=on`.
    fn serial_port(&self) -> super::SerialPort {
        super::SerialPort::Served
    }

    /// `-netdev tap,fd=N`.
    fn taps_at_exec(&self) -> bool {
        true
    }

    fn command_line(&self, spec: &VmSpec) -> Result<Vec<String>, HypervisorError> {
        if spec.accel != "tcg" && spec.accel != "kvm" {
            return Err(HypervisorError::start_failed(format!("accelerator `{}` is not tcg or kvm", spec.accel)));
        }
        Ok(qemu_command_line(spec))
    }

    /// Polls until QMP answers `query-status`, which QEMU dispatches from its main loop,
    /// i.e. only once the machine is initialised and its signal handlers are installed. The
    /// socket alone is not enough: QEMU creates it before loading the kernel and may still
    /// exit after accepting a connection.
    fn bring_up(&self, vmm: &RunningVmm, spec: &VmSpec, timeout: Duration) -> Result<(), StartFailure> {
        let what = format!("QMP on {}", vmm.control_socket.display());
        let status =
            wait_answering(vmm, &what, timeout, |io| QmpClient::connect(&vmm.control_socket, io)?.query_status())?;
        tracing::debug!(pid = vmm.identity.pid, %status, "QMP is up");
        if let Some(saved) = &spec.incoming {
            let file = std::fs::File::open(saved).map_err(|e| {
                StartFailure::from(format!("the saved state {} cannot be opened: {e}", saved.display()))
            })?;
            let mut q = QmpClient::connect(&vmm.control_socket, super::qmp::DEFAULT_IO_TIMEOUT)
                .map_err(|e| StartFailure::from(e.to_string()))?;
            q.load_from(std::os::fd::AsFd::as_fd(&file), timeout)
                .map_err(|e| StartFailure::from(format!("the saved state {} was not loaded: {e}", saved.display())))?;
            // The state keeps the run state it was saved in: paused (a save pauses first).
            let mut status = q.query_status().map_err(|e| StartFailure::from(e.to_string()))?;
            if status == "paused" && !spec.paused {
                q.cont().map_err(|e| StartFailure::from(format!("the restored VM does not resume: {e}")))?;
                status = q.query_status().map_err(|e| StartFailure::from(e.to_string()))?;
            }
            if status != "running" && !spec.paused {
                return Err(StartFailure::from(format!("the restored VM is {status:?}, not running")));
            }
            tracing::debug!(pid = vmm.identity.pid, saved = %saved.display(), "saved state loaded");
        }
        Ok(())
    }

    fn power_button(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError> {
        Ok(QmpClient::connect(socket, io_timeout)?.system_powerdown()?)
    }

    fn quit(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError> {
        Ok(QmpClient::connect(socket, io_timeout)?.quit()?)
    }

    fn vm_state(&self, socket: &Path, io_timeout: Duration) -> Result<String, VmmError> {
        Ok(QmpClient::connect(socket, io_timeout)?.query_status()?)
    }

    /// `stop`, then the migration stream into the file `memory`, created by the agent and
    /// handed over as an fd (`getfd`, `migrate fd:`): it never enters the VMM's view.
    fn save(&self, socket: &Path, _run_dir: &Path, memory: &Path, timeout: Duration) -> Result<(), VmmError> {
        let out = std::fs::File::create_new(memory).map_err(|e| VmmError::io(memory, e))?;
        let mut q = QmpClient::connect(socket, super::qmp::DEFAULT_IO_TIMEOUT)?;
        q.stop()?;
        q.save_to(std::os::fd::AsFd::as_fd(&out), timeout)?;
        out.sync_all().map_err(|e| VmmError::io(memory, e))
    }

    /// `paused` (stopped for the save), `postmigrate`, `finish-migrate`.
    fn paused_by_save(&self, vm_state: &str) -> bool {
        matches!(vm_state, "paused" | "postmigrate" | "finish-migrate")
    }

    fn reset(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError> {
        Ok(QmpClient::connect(socket, io_timeout)?.system_reset()?)
    }

    /// `query-blockstats`: the entries whose `device` (the `-drive` id) is the disk or the
    /// seed; `rd_bytes`, `wr_bytes`, `rd_operations`, `wr_operations`.
    fn disk_counters(&self, socket: &Path, io_timeout: Duration) -> Result<Vec<DiskCounters>, VmmError> {
        let v = QmpClient::connect(socket, io_timeout)?.execute("query-blockstats", None)?;
        let mut out = Vec::new();
        for id in [super::DISK_ID, super::SEED_ID] {
            let Some(e) = v.as_array().into_iter().flatten().find(|e| e["device"] == id) else { continue };
            let n = |k: &str| {
                e["stats"][k].as_u64().ok_or_else(|| VmmError::Missing {
                    request: "query-blockstats",
                    id,
                    field: format!("stats.{k}"),
                    entry: e.to_string(),
                })
            };
            out.push(DiskCounters {
                id: id.to_string(),
                read_bytes: n("rd_bytes")?,
                write_bytes: n("wr_bytes")?,
                read_ops: n("rd_operations")?,
                write_ops: n("wr_operations")?,
            });
        }
        Ok(out)
    }

    fn resume(&self, socket: &Path, io_timeout: Duration) -> Result<(), VmmError> {
        Ok(QmpClient::connect(socket, io_timeout)?.cont()?)
    }

    /// `<binary> --version`: its first line.
    fn probe(&self, binary: &Path) -> Result<String, VmmError> {
        super::process::version_of(binary, &["--version"])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(vfio: Option<VfioAttach>) -> VmSpec {
        VmSpec {
            id: uuid::Uuid::parse_str("6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d").unwrap(),
            name: "vm-a".into(),
            vcpus: 2,
            memory_mib: 512,
            kernel: Some("/images/vmlinuz".into()),
            initrd: Some("/images/initrd.img".into()),
            cmdline: "console=ttyS0".into(),
            accel: "tcg".into(),
            paused: false,
            binary: "/usr/bin/qemu-system-x86_64".into(),
            hypervisor: HypervisorKind::Qemu,
            run_dir: "/var/lib/gpuvisor/instances/x".into(),
            vfio,
            sandbox: false,
            ..VmSpec::test_base()
        }
    }

    fn has_pair(args: &[String], flag: &str, value: &str) -> bool {
        args.windows(2).any(|w| w[0] == flag && w[1] == value)
    }

    #[test]
    fn command_line_always_carries_uuid_and_name() {
        let args = qemu_command_line(&spec(None));

        assert!(has_pair(&args, "-uuid", "6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"));
        assert!(has_pair(&args, "-name", "vm-a"));
        assert!(has_pair(&args, "-machine", "q35,accel=tcg"));
        assert!(has_pair(&args, "-cpu", "max"));
        assert!(has_pair(&args, "-m", "512"));
        assert!(has_pair(&args, "-smp", "2"));
        assert!(has_pair(&args, "-display", "none"));
        assert!(args.contains(&"-nodefaults".to_string()));
        assert!(args.contains(&"-no-user-config".to_string()));
        assert!(has_pair(&args, "-kernel", "/images/vmlinuz"));
        assert!(has_pair(&args, "-initrd", "/images/initrd.img"));
        assert!(has_pair(&args, "-append", "console=ttyS0"));
        assert!(has_pair(
            &args,
            "-chardev",
            "socket,id=serial0,path=/var/lib/gpuvisor/instances/x/console.sock,server=on,wait=off,\
             logfile=/var/lib/gpuvisor/instances/x/serial.log,logappend=on"
        ));
        assert!(has_pair(&args, "-serial", "chardev:serial0"));
        assert!(has_pair(&args, "-qmp", "unix:/var/lib/gpuvisor/instances/x/qmp.sock,server=on,wait=off"));
        assert!(!args.contains(&"-S".to_string()));
        assert!(!args.iter().any(|a| a == "-device" || a == "-add-fd"));
    }

    #[test]
    fn kvm_uses_the_host_cpu_and_paused_adds_dash_s() {
        let mut s = spec(None);
        s.accel = "kvm".into();
        s.paused = true;
        s.kernel = None;

        let args = qemu_command_line(&s);

        assert!(has_pair(&args, "-cpu", "host"));
        assert!(has_pair(&args, "-machine", "q35,accel=kvm"));
        assert!(args.contains(&"-S".to_string()));
        assert!(!args.iter().any(|a| a == "-kernel" || a == "-append" || a == "-initrd"));
    }

    #[test]
    fn device_attach_passes_sysfsdev() {
        let args = qemu_command_line(&spec(Some(VfioAttach::Device {
            sysfsdevs: vec!["/sys/bus/pci/devices/0001:81:00.4".into()],
        })));

        assert!(has_pair(&args, "-device", "vfio-pci,sysfsdev=/sys/bus/pci/devices/0001:81:00.4"));
    }

    #[test]
    fn the_sandbox_denies_obsolete_elevate_spawn_and_resourcecontrol() {
        let mut s = spec(None);
        s.sandbox = true;
        let args = qemu_command_line(&s);
        assert!(has_pair(&args, "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"));
        s.sandbox = false;
        assert!(!qemu_command_line(&s).contains(&"-sandbox".to_string()));
    }

    #[test]
    fn a_passthrough_group_shares_one_multifunction_slot() {
        let args = qemu_command_line(&spec(Some(VfioAttach::Device {
            sysfsdevs: vec!["/sys/bus/pci/devices/0000:82:00.0".into(), "/sys/bus/pci/devices/0000:82:00.1".into()],
        })));
        assert!(has_pair(
            &args,
            "-device",
            "vfio-pci,sysfsdev=/sys/bus/pci/devices/0000:82:00.0,addr=0x10.0,multifunction=on"
        ));
        assert!(has_pair(&args, "-device", "vfio-pci,sysfsdev=/sys/bus/pci/devices/0000:82:00.1,addr=0x10.1"));
    }

    #[test]
    fn mdev_attach_passes_the_mdev_directory_and_escapes_commas() {
        let args = qemu_command_line(&spec(Some(VfioAttach::Device {
            sysfsdevs: vec!["/sim,1/sys/bus/mdev/devices/aa-bb".into()],
        })));

        assert!(has_pair(&args, "-device", "vfio-pci,sysfsdev=/sim,,1/sys/bus/mdev/devices/aa-bb"));
    }

    #[test]
    fn no_nics_and_no_seed_add_nothing() {
        assert!(network_args(&spec(None)).is_empty());
    }

    #[test]
    fn a_user_nic_is_restricted_with_its_forwards_and_a_stable_mac() {
        let mut s = spec(None);
        s.nics = vec![super::super::NicSpec {
            mac: "52:54:00:12:34:56".into(),
            backend: NicBackend::User {
                restrict: true,
                forwards: vec![
                    crate::network::Forward {
                        host_port: 8080,
                        guest_port: 80,
                        proto: crate::network::Proto::Tcp,
                        host_addr: "127.0.0.1".into(),
                    },
                    crate::network::Forward {
                        host_port: 5353,
                        guest_port: 53,
                        proto: crate::network::Proto::Udp,
                        host_addr: "0.0.0.0".into(),
                    },
                ],
            },
        }];
        let args = qemu_command_line(&s);
        assert!(has_pair(
            &args,
            "-netdev",
            "user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:8080-:80,hostfwd=udp:0.0.0.0:5353-:53"
        ));
        assert!(has_pair(&args, "-device", "virtio-net-pci,netdev=net0,mac=52:54:00:12:34:56,romfile="));
        if let NicBackend::User { restrict, .. } = &mut s.nics[0].backend {
            *restrict = false;
        }
        assert!(network_args(&s)[1].starts_with("user,id=net0,restrict=off"));
    }

    #[test]
    fn a_tap_nic_takes_its_fd_by_index_and_the_seed_is_read_only() {
        let mut s = spec(None);
        let tap = |i: usize| super::super::NicSpec {
            mac: format!("52:54:00:00:00:0{i}"),
            backend: NicBackend::Tap { ifname: format!("gv6f1b2c3d{i}"), agent_fd: 40 + i as i32 },
        };
        s.nics = vec![tap(0), tap(1)];
        s.seed = Some("/var/lib/gpuvisor/instances/x/seed.iso".into());
        let args = network_args(&s);
        assert!(has_pair(&args, "-netdev", "tap,id=net0,fd=5"));
        assert!(has_pair(&args, "-netdev", "tap,id=net1,fd=6"));
        assert!(has_pair(&args, "-device", "virtio-net-pci,netdev=net1,mac=52:54:00:00:00:01,romfile="));
        assert!(has_pair(
            &args,
            "-drive",
            "file=/var/lib/gpuvisor/instances/x/seed.iso,format=raw,if=none,id=seed,readonly=on"
        ));
        assert!(has_pair(&args, "-device", "virtio-blk-pci,drive=seed,serial=cidata"));
    }

    #[test]
    fn a_bios_boot_boots_the_overlay_with_bootindex_0_and_no_kernel() {
        let mut s = spec(None);
        s.kernel = None;
        s.initrd = None;
        s.disk = Some("/var/lib/gpuvisor/instances/x/disk.qcow2".into());

        let args = qemu_command_line(&s);

        assert!(has_pair(
            &args,
            "-drive",
            "file=/var/lib/gpuvisor/instances/x/disk.qcow2,format=qcow2,if=none,id=disk0"
        ));
        assert!(has_pair(&args, "-device", "virtio-blk-pci,drive=disk0,bootindex=0"));
        assert!(!args.iter().any(|a| a == "-kernel" || a == "-initrd" || a == "-append"));
        assert!(!args.iter().any(|a| a.contains("pflash")));
    }

    #[test]
    fn a_uefi_boot_adds_the_read_only_code_and_the_instances_vars() {
        let mut s = spec(None);
        s.kernel = None;
        s.disk = Some("/d/x/disk.qcow2".into());
        s.uefi =
            Some(UefiPflash { code: "/usr/share/OVMF/OVMF_CODE_4M.fd".into(), vars: Some("/d/x/efivars.fd".into()) });

        let args = qemu_command_line(&s);

        let drives: Vec<&String> = args.windows(2).filter(|w| w[0] == "-drive").map(|w| &w[1]).collect();
        assert_eq!(
            drives,
            [
                "if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd",
                "if=pflash,format=raw,unit=1,file=/d/x/efivars.fd",
                "file=/d/x/disk.qcow2,format=qcow2,if=none,id=disk0",
            ]
        );
        assert!(has_pair(&args, "-device", "virtio-blk-pci,drive=disk0,bootindex=0"));
    }

    #[test]
    fn a_direct_boot_with_a_disk_keeps_the_kernel_and_attaches_the_disk_without_bootindex() {
        let mut s = spec(None);
        s.disk = Some("/d/a,b/disk.qcow2".into());

        let args = qemu_command_line(&s);

        assert!(has_pair(&args, "-kernel", "/images/vmlinuz"));
        assert!(has_pair(&args, "-drive", "file=/d/a,,b/disk.qcow2,format=qcow2,if=none,id=disk0"));
        assert!(has_pair(&args, "-device", "virtio-blk-pci,drive=disk0"));
    }

    #[test]
    fn hold_fd_attach_adds_fd_3_to_an_fdset() {
        let args = qemu_command_line(&spec(Some(VfioAttach::HoldFd { node: "/sim/dev/vfio/41".into() })));

        assert!(has_pair(&args, "-add-fd", "fd=3,set=1,opaque=vfio-group-41"));
        assert!(!args.contains(&"-device".to_string()));
    }
}
