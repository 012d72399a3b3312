//! The Cloud Hypervisor driver against the real v53.0 binary, for everything that does not
//! need a guest that runs (this machine's KVM boots no ordinary guest: `vm.boot` reports
//! `Running`, the serial log stays empty and the power button does nothing). The binary is
//! found through `CLOUD_HYPERVISOR_BIN`, then `cloud-hypervisor` on `PATH`, then
//! `../shared/tools/cloud-hypervisor` beside the checkout; without one each test says so
//! in one line and passes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{kill as send_signal, Signal};
use nix::unistd::Pid;

use super::ch_api::ChApi;
use super::cloud_hypervisor::CloudHypervisor;
use super::*;
use crate::host::proc::{identity_of, unix_listener_owners, vmm_liveness, Liveness};

const BOOT: &str = "ch-test-boot";
const READY: Duration = Duration::from_secs(30);

/// The real binary, or `None` (and one line saying why).
pub(crate) fn real_cloud_hypervisor() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CLOUD_HYPERVISOR_BIN") {
        return Some(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(p) = std::env::split_paths(&path).map(|d| d.join("cloud-hypervisor")).find(|p| p.is_file()) {
            return Some(p);
        }
    }
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/cloud-hypervisor");
    if shared.is_file() {
        return Some(shared);
    }
    println!("skipped: no cloud-hypervisor binary (CLOUD_HYPERVISOR_BIN, PATH, ../shared/tools)");
    None
}

/// The demo kernel when it is built (`target/images/demo`), else any readable file: the real
/// binary reads the kernel at `vm.boot`, and this machine's KVM never runs it anyway.
fn kernel() -> PathBuf {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images/demo/vmlinuz");
    if demo.is_file() {
        demo
    } else {
        std::env::current_exe().unwrap()
    }
}

fn ch_spec(binary: &Path, run_dir: &Path) -> VmSpec {
    VmSpec {
        hypervisor: HypervisorKind::CloudHypervisor,
        id: uuid::Uuid::new_v4(),
        name: "ch-test".into(),
        vcpus: 1,
        memory_mib: 64,
        kernel: Some(kernel()),
        initrd: None,
        cmdline: "console=ttyS0".into(),
        accel: "kvm".into(),
        paused: false,
        binary: binary.to_path_buf(),
        run_dir: run_dir.to_path_buf(),
        log_dir: run_dir.to_path_buf(),
        vfio: None,
        sandbox: false,
        ..VmSpec::test_base()
    }
}

#[test]
fn the_real_binary_probes_boots_reports_running_and_is_stopped_by_vmm_shutdown_after_an_ignored_power_button() {
    let Some(bin) = real_cloud_hypervisor() else { return };
    assert!(CloudHypervisor.probe(&bin).expect("probe").starts_with("cloud-hypervisor 53."), "version");
    let dir = tempfile::tempdir().unwrap();
    let spec = ch_spec(&bin, dir.path());

    let vmm = spawn(&spec, BOOT, READY).expect("cloud-hypervisor starts and boots");

    let pid = vmm.identity.pid;
    assert_eq!(vmm.control_socket, dir.path().join("ch.sock"));
    assert_eq!(identity_of(pid, BOOT).unwrap(), Some(vmm.identity.clone()));
    assert_eq!(vmm_liveness(Some(&vmm.identity), Some(&vmm.control_socket), BOOT), Liveness::Alive { pid });
    assert_eq!(CloudHypervisor.vm_state(&vmm.control_socket, Duration::from_secs(5)).unwrap(), "Running");
    // The configuration the VMM holds is the one gpuvisor sent.
    let info: serde_json::Value =
        serde_json::from_slice(&ChApi::new(&vmm.control_socket, Duration::from_secs(5)).get("vm.info").unwrap())
            .unwrap();
    assert_eq!(info["config"]["memory"]["size"], 64 * 1024 * 1024);
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], 1);
    assert_eq!(info["config"]["platform"]["system_uuid"], spec.id.to_string());
    assert_eq!(info["config"]["serial"]["mode"], "Socket");

    // The power button has no effect here: the stop waits its timeout, then vmm.shutdown.
    let opts =
        StopOptions { graceful: true, stop_timeout: Duration::from_millis(500), term_grace: Duration::from_secs(5) };
    let report = stop(&CloudHypervisor, &vmm.identity, &vmm.control_socket, opts, BOOT).expect("stopped");

    assert!(report.graceful_exit && report.escalations.is_empty(), "{report:?}");
    let status = vmm.exit.wait_timeout(Duration::from_secs(10)).expect("reaped");
    assert!(status.success(), "vmm.shutdown exits 0, got {status}");
    assert_eq!(vmm_liveness(Some(&vmm.identity), Some(&vmm.control_socket), BOOT), Liveness::Dead);
}

#[test]
fn the_real_binary_dies_on_the_sigterm_of_the_kill_path_and_a_stopped_one_needs_sigkill() {
    let Some(bin) = real_cloud_hypervisor() else { return };
    let dir = tempfile::tempdir().unwrap();
    let vmm = spawn(&ch_spec(&bin, &dir.path().join("a")), BOOT, READY).expect("starts");

    let report = kill(&vmm.identity, &vmm.control_socket, Duration::from_secs(5), BOOT).expect("killed");

    assert!(report.escalations.is_empty() && !report.graceful_exit, "{report:?}");
    assert!(vmm.exit.wait_timeout(Duration::from_secs(10)).is_some());

    let vmm = spawn(&ch_spec(&bin, &dir.path().join("b")), BOOT, READY).expect("starts");
    send_signal(Pid::from_raw(vmm.identity.pid), Signal::SIGSTOP).unwrap();
    let report = kill(&vmm.identity, &vmm.control_socket, Duration::from_millis(500), BOOT).expect("killed");
    assert_eq!(report.escalations, vec!["SIGKILL"]);
    assert!(vmm.exit.wait_timeout(Duration::from_secs(10)).is_some());
}

#[test]
fn a_kernel_the_real_binary_cannot_open_fails_the_start_with_its_error_array_and_leaves_no_process() {
    let Some(bin) = real_cloud_hypervisor() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut spec = ch_spec(&bin, dir.path());
    spec.kernel = Some(dir.path().join("no-such-kernel"));

    let err = spawn(&spec, BOOT, READY).expect_err("vm.boot fails");

    let HypervisorError::StartFailed { reason, api } = &err else { panic!("{err:?}") };
    let api = api.as_ref().expect("the refused request");
    assert_eq!(api.request, "PUT vm.boot");
    assert_eq!(api.status, Some(500));
    assert_eq!(api.errors[..3], ["Error from API", "The VM could not boot", "Cannot open kernel file"]);
    assert!(reason.contains(r#"["Error from API","The VM could not boot","Cannot open kernel file""#), "{reason}");
    // The VMM that refused was stopped before the answer.
    assert!(unix_listener_owners(&spec.control_socket()).unwrap_or_default().is_empty());
}

/// Opens a tap in a network namespace of its own (made by a thread that leaves it behind),
/// so the test touches no interface of the host.
fn private_tap(name: &str) -> crate::host::net::Tap {
    let name = name.to_string();
    std::thread::spawn(move || {
        // SAFETY: unshare(2) with a flag constant; this thread alone moves to the new namespace.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "a network namespace");
        crate::host::net::open_tap(&name).expect("a tap")
    })
    .join()
    .unwrap()
}

/// What `/proc/<pid>/fd` of the VMM points at, with each fd's `fdinfo` (a tap's names its
/// interface: `iff:`).
fn fds_of(pid: i32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let target = std::fs::read_link(e.path()).map(|p| p.display().to_string()).unwrap_or_default();
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", e.file_name().to_string_lossy()))
            .unwrap_or_default();
        out.push((target, info));
    }
    out
}

/// Issue 22 part 4: the create requests with a disk overlay, a seed, a tap NIC and the
/// serial port on a socket, as the real binary takes them: it holds the overlay and its
/// backing file, the seed, and the agent's tap (passed with `vm.add-net`), and serves the
/// serial socket, which the agent's relay connects to.
#[test]
fn the_real_binary_takes_the_overlay_the_seed_a_tap_by_fd_and_serves_the_serial_socket() {
    let Some(bin) = real_cloud_hypervisor() else { return };
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let overlay = dir.path().join("disk.qcow2");
    let img = |args: &[&str]| {
        let o = std::process::Command::new("qemu-img").args(args).output().expect("qemu-img");
        assert!(o.status.success(), "qemu-img {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    img(&["create", "-f", "qcow2", base.to_str().unwrap(), "16M"]);
    img(&["create", "-f", "qcow2", "-b", base.to_str().unwrap(), "-F", "qcow2", overlay.to_str().unwrap()]);
    let seed = dir.path().join("seed.iso");
    std::fs::write(&seed, vec![0u8; 64 * 1024]).unwrap();
    let tap_name = format!("gvcht{}", std::process::id() % 100000);
    let tap = private_tap(&tap_name);
    let mut spec = ch_spec(&bin, dir.path());
    spec.disk = Some(overlay.clone());
    spec.seed = Some(seed.clone());
    spec.nics = vec![NicSpec {
        mac: "52:54:00:aa:bb:01".into(),
        backend: NicBackend::Tap { ifname: tap_name.clone(), agent_fd: tap.raw_fd() },
    }];

    let vmm = spawn(&spec, BOOT, READY).expect("cloud-hypervisor starts and boots");
    drop(tap);

    let info: serde_json::Value =
        serde_json::from_slice(&ChApi::new(&vmm.control_socket, Duration::from_secs(5)).get("vm.info").unwrap())
            .unwrap();
    let cfg = &info["config"];
    assert_eq!(info["state"], "Running");
    assert_eq!(cfg["disks"][0]["path"], overlay.display().to_string());
    assert_eq!(cfg["disks"][0]["backing_files"], true);
    assert_eq!(cfg["disks"][0]["image_type"], "Qcow2");
    assert_eq!(cfg["disks"][1]["readonly"], true);
    assert_eq!(cfg["net"][0]["mac"], "52:54:00:aa:bb:01");
    assert_eq!(cfg["net"][0]["id"], "net0");
    assert_eq!(cfg["serial"], serde_json::json!({"mode": "Socket", "socket": spec.serial_socket()}));
    let fds = fds_of(vmm.identity.pid);
    for f in [&overlay, &base, &seed] {
        assert!(fds.iter().any(|(t, _)| t == &f.display().to_string()), "{} held: {fds:?}", f.display());
    }
    assert!(
        fds.iter().any(|(t, i)| t == "/dev/net/tun" && i.lines().any(|l| l.split_whitespace().eq(["iff:", &tap_name]))),
        "the VMM holds the agent's tap {tap_name}: {fds:?}"
    );
    // The agent's relay connects to the VMM's own serial socket.
    std::fs::create_dir_all(dir.path().join("agent")).unwrap();
    let relay = crate::serial_relay::start(dir.path(), &dir.path().join("agent"), 1 << 20, "ch-test")
        .expect("the relay connects to the VMM's serial socket");
    assert!(!relay.is_done());

    kill(&vmm.identity, &vmm.control_socket, Duration::from_secs(5), BOOT).expect("killed");
    assert!(vmm.exit.wait_timeout(Duration::from_secs(10)).is_some());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !relay.is_done() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(relay.is_done(), "the relay ends with the VMM");
}

/// A save of the real binary's VM: on this machine's KVM `vm.snapshot` fails (its vCPU's
/// nested state cannot be read: `GetNestedState`); wherever it fails, the VMM's error array
/// comes back whole, nothing is left at `memory` or in the VMM directory, and the paused
/// VM resumes. Where it works, `memory` is the directory the VMM wrote.
#[test]
fn a_save_of_the_real_binary_either_writes_its_directory_or_fails_whole_and_the_vm_resumes() {
    let Some(bin) = real_cloud_hypervisor() else { return };
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("vmm");
    let spec = ch_spec(&bin, &run);
    let vmm = spawn(&spec, BOOT, READY).expect("starts");
    let memory = dir.path().join("memory");

    let saved = CloudHypervisor.save(&vmm.control_socket, &run, &memory, READY);

    assert!(CloudHypervisor.paused_by_save(&CloudHypervisor.vm_state(&vmm.control_socket, READY).unwrap()));
    match &saved {
        Ok(()) => {
            assert!(memory.join("config.json").is_file() && memory.join("state.json").is_file(), "{memory:?}");
        }
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("PUT vm.snapshot") && e.contains("The VM could not be snapshotted"), "{e}");
            assert!(!memory.exists());
        }
    }
    let staged: Vec<_> = std::fs::read_dir(&run)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(VM_STATE_STAGING))
        .collect();
    assert!(staged.is_empty(), "nothing staged is left: {staged:?}");
    CloudHypervisor.resume(&vmm.control_socket, READY).expect("resumed");
    assert_eq!(CloudHypervisor.vm_state(&vmm.control_socket, READY).unwrap(), "Running");
    println!("vm.snapshot on this machine: {saved:?}");
    kill(&vmm.identity, &vmm.control_socket, Duration::from_secs(5), BOOT).expect("killed");
}

/// A UEFI boot gives the firmware as the payload: `vm.create` takes that shape; Debian's
/// OVMF build (`OVMF_CODE_4M.fd`) is not firmware the real v53.0 loads — `vm.boot` refuses
/// it with its error array ("Cannot load the kernel into memory", "Invalid bzImage"), which
/// the start surfaces whole. (`cloud_hypervisor_firmware` wants CLOUDHV.fd or
/// rust-hypervisor-firmware, which this machine does not have.)
#[test]
fn the_real_binary_takes_a_firmware_payload_and_refuses_debians_ovmf_with_its_error_array() {
    let Some(bin) = real_cloud_hypervisor() else { return };
    let ovmf = Path::new("/usr/share/OVMF/OVMF_CODE_4M.fd");
    if !ovmf.is_file() {
        println!("skipped: no {}", ovmf.display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.raw");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let mut spec = ch_spec(&bin, dir.path());
    spec.kernel = None;
    spec.uefi = Some(UefiPflash { code: ovmf.to_path_buf(), vars: None });
    spec.disk = None;

    match spawn(&spec, BOOT, READY) {
        Ok(vmm) => {
            // A binary that loads it: the payload was the firmware.
            let info: serde_json::Value = serde_json::from_slice(
                &ChApi::new(&vmm.control_socket, Duration::from_secs(5)).get("vm.info").unwrap(),
            )
            .unwrap();
            assert_eq!(info["config"]["payload"]["firmware"], ovmf.display().to_string());
            kill(&vmm.identity, &vmm.control_socket, Duration::from_secs(5), BOOT).expect("killed");
        }
        Err(HypervisorError::StartFailed { api: Some(api), .. }) => {
            assert_eq!(api.request, "PUT vm.boot", "vm.create took the firmware payload: {api:?}");
            assert_eq!(
                api.errors[..3],
                ["Error from API", "The VM could not boot", "Cannot load the kernel into memory"]
            );
            assert!(unix_listener_owners(&spec.control_socket()).unwrap_or_default().is_empty(), "stopped");
        }
        Err(e) => panic!("{e:?}"),
    }
}
