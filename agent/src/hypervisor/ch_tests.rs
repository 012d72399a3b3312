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
    assert_eq!(info["config"]["serial"]["mode"], "File");

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
