//! Tests against a real QEMU (`qemu-system-x86_64`, TCG, no guest kernel: the firmware
//! idles with no boot device). Each QEMU uses 64 MiB and one vCPU, so they fit on two
//! shared cores.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill as send_signal, Signal};
use nix::unistd::Pid;

use super::qemu::Qemu;
use super::*;
use crate::host::proc::testutil::in_private_proc;
use crate::host::proc::{
    identity_of, open_paths_of, scan_open_handles, unix_listener_owners, vmm_liveness, HandleScan, Liveness,
    ProcessIdentity,
};

const BOOT: &str = "vmm-test-boot";
const READY: Duration = Duration::from_secs(30);

fn vm_spec(run_dir: &Path, vfio: Option<VfioAttach>, paused: bool) -> VmSpec {
    VmSpec {
        id: uuid::Uuid::new_v4(),
        name: "vmm-test".into(),
        vcpus: 1,
        memory_mib: 64,
        kernel: None,
        initrd: None,
        cmdline: String::new(),
        accel: "tcg".into(),
        paused,
        hypervisor: HypervisorKind::Qemu,
        binary: PathBuf::from("qemu-system-x86_64"),
        run_dir: run_dir.to_path_buf(),
        log_dir: run_dir.to_path_buf(),
        vfio,
        sandbox: false,
        ..VmSpec::test_base()
    }
}

fn no_graceful(term_grace: Duration) -> StopOptions {
    StopOptions { graceful: false, stop_timeout: Duration::ZERO, term_grace }
}

fn holds(pid: i32, node: &Path) -> bool {
    open_paths_of(pid).expect("read QEMU's fds").iter().any(|p| p == node)
}

fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

#[test]
fn spawned_qemu_is_alive_then_provably_dead_after_stop() {
    let dir = tempfile::tempdir().unwrap();
    let spec = vm_spec(dir.path(), None, true);

    let vmm = spawn(&spec, BOOT, READY).expect("QEMU starts");

    let pid = vmm.identity.pid;
    assert_eq!(identity_of(pid, BOOT).unwrap(), Some(vmm.identity.clone()));
    assert_eq!(vmm.control_socket, dir.path().join("qmp.sock"));
    assert_eq!(vmm_liveness(Some(&vmm.identity), Some(&vmm.control_socket), BOOT), Liveness::Alive { pid });
    let mut qmp = QmpClient::connect(&vmm.control_socket, Duration::from_secs(5)).unwrap();
    assert_eq!(qmp.query_status().unwrap(), "prelaunch");
    drop(qmp);

    let report = stop(&Qemu, &vmm.identity, &vmm.control_socket, no_graceful(Duration::from_secs(5)), BOOT)
        .expect("stop succeeds");

    assert!(report.escalations.is_empty(), "{report:?}");
    assert!(!report.graceful_exit && !report.already_dead);
    assert_eq!(vmm_liveness(Some(&vmm.identity), Some(&vmm.control_socket), BOOT), Liveness::Dead);
    assert!(unix_listener_owners(&vmm.control_socket).unwrap().is_empty());
    assert!(wait_until(Duration::from_secs(5), || vmm.exit.exited().is_some()));
    assert!(std::fs::read_to_string(dir.path().join("qemu.log")).is_ok());
}

/// A confined QEMU runs under its own id (no capability, `no_new_privs`), in a view that
/// holds the system trees, its device nodes and — writable — only its VMM directory: the
/// instance directory around it (the agent's records) and a file beside it are not there.
#[test]
fn a_confined_qemu_runs_as_its_own_id_in_a_view_of_only_its_directory() {
    let base = tempfile::tempdir().unwrap();
    let inst = base.path().join("inst");
    let run = inst.join(confine::VMM_DIR);
    std::fs::create_dir_all(&inst).unwrap();
    std::fs::write(inst.join("instance.json"), b"{}").unwrap();
    std::fs::write(base.path().join("beside"), b"secret").unwrap();
    let id = 1_879_048_192 + 40_000 + std::process::id() % 10_000;
    let mut spec = vm_spec(&run, None, true);
    spec.log_dir = inst.clone();
    spec.confine = Some(confine::Confinement {
        identity: confine::VmmIdentity::new(id),
        view: crate::host::vmm_view::ViewSpec { root: base.path().join("vmm-root"), ..Default::default() },
    });

    let vmm = spawn(&spec, BOOT, READY).expect("QEMU starts confined");

    let pid = vmm.identity.pid;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field =
        |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).unwrap_or("").split_whitespace().collect::<Vec<_>>();
    assert_eq!(field("Uid:"), vec![id.to_string(); 4]);
    assert_eq!(field("Gid:"), vec![id.to_string(); 4]);
    assert_eq!(field("CapEff:"), vec!["0000000000000000"]);
    assert_eq!(field("NoNewPrivs:"), vec!["1"]);
    let root = std::path::PathBuf::from(format!("/proc/{pid}/root"));
    let names = |p: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(root.join(p.strip_prefix("/").unwrap()))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(base.path()), vec!["inst"], "only the path to its VMM directory");
    assert_eq!(names(&inst), vec![confine::VMM_DIR], "none of the agent's files");
    assert!(names(&run).contains(&"qmp.sock".to_string()));
    assert!(names(Path::new("/dev"))
        .iter()
        .all(|d| ["null", "zero", "full", "random", "urandom", "kvm"].contains(&d.as_str())));
    let top = base.path().components().nth(1).unwrap().as_os_str().to_string_lossy().into_owned();
    let mut want: Vec<String> = ["bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "usr", top.as_str()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    want.retain(|w| w == &top || Path::new("/").join(w).exists());
    want.sort();
    want.dedup();
    assert_eq!(names(Path::new("/")), want, "no /proc, /sys, /run, /home, /var, /root");
    let mut qmp = QmpClient::connect(&vmm.control_socket, Duration::from_secs(5)).unwrap();
    assert_eq!(qmp.query_status().unwrap(), "prelaunch", "the agent reaches the socket from outside");
    drop(qmp);

    stop(&Qemu, &vmm.identity, &vmm.control_socket, no_graceful(Duration::from_secs(5)), BOOT).expect("stop");
    assert!(std::fs::read_to_string(inst.join("qemu.log")).is_ok());
}

/// A step of the view that fails (a read-only file that does not exist) fails the spawn,
/// naming it, before any process runs.
#[test]
fn a_view_that_cannot_be_made_fails_the_start_naming_the_path() {
    let base = tempfile::tempdir().unwrap();
    let inst = base.path().join("inst");
    let mut spec = vm_spec(&inst.join(confine::VMM_DIR), None, true);
    spec.log_dir = inst.clone();
    spec.confine = Some(confine::Confinement {
        identity: confine::VmmIdentity::new(1_879_048_192 + 50_000),
        view: crate::host::vmm_view::ViewSpec {
            root: base.path().join("vmm-root"),
            read_only: vec![base.path().join("no-such-kernel")],
            ..Default::default()
        },
    });
    let e = spawn(&spec, BOOT, READY).unwrap_err().to_string();
    assert!(e.contains("no-such-kernel"), "{e}");
}

#[test]
fn graceful_stop_of_a_guest_that_ignores_powerdown_ends_with_quit() {
    let dir = tempfile::tempdir().unwrap();
    let vmm = spawn(&vm_spec(dir.path(), None, true), BOOT, READY).expect("QEMU starts");

    let report = stop(
        &Qemu,
        &vmm.identity,
        &vmm.control_socket,
        StopOptions { graceful: true, stop_timeout: Duration::from_millis(500), term_grace: Duration::from_secs(5) },
        BOOT,
    )
    .expect("stop succeeds");

    assert!(report.graceful_exit, "{report:?}");
    assert!(report.escalations.is_empty());
    let status = vmm.exit.wait_timeout(Duration::from_secs(5)).expect("reaped");
    assert!(status.success(), "QMP quit exits 0, got {status}");
}

#[test]
fn a_stopped_qemu_is_escalated_to_sigkill_and_dies() {
    let dir = tempfile::tempdir().unwrap();
    let vmm = spawn(&vm_spec(dir.path(), None, true), BOOT, READY).expect("QEMU starts");
    send_signal(Pid::from_raw(vmm.identity.pid), Signal::SIGSTOP).unwrap();

    let report = kill(&vmm.identity, &vmm.control_socket, Duration::from_secs(1), BOOT).expect("kill succeeds");

    assert_eq!(report.escalations, vec!["SIGKILL"]);
    assert_eq!(vmm_liveness(Some(&vmm.identity), Some(&vmm.control_socket), BOOT), Liveness::Dead);
    let status = vmm.exit.wait_timeout(Duration::from_secs(5)).expect("reaped");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL));
}

struct SleepGuard(Child);

impl Drop for SleepGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_recycled_pid_is_never_signalled() {
    let dir = tempfile::tempdir().unwrap();
    let qmp = dir.path().join("qmp.sock");
    let sleeper = SleepGuard(Command::new("sleep").arg("60").spawn().unwrap());
    let pid = sleeper.0.id() as i32;
    let real = identity_of(pid, BOOT).unwrap().unwrap();
    let recycled = ProcessIdentity { start_time: real.start_time + 1, ..real.clone() };
    let old_boot = ProcessIdentity { boot_id: "an-earlier-boot".into(), ..real };

    for rec in [&recycled, &old_boot] {
        assert_eq!(vmm_liveness(Some(rec), Some(&qmp), BOOT), Liveness::Dead);
        let k = kill(rec, &qmp, Duration::from_millis(100), BOOT).expect("nothing to kill");
        assert!(k.already_dead && k.escalations.is_empty());
        let s = stop(&Qemu, rec, &qmp, StopOptions::default(), BOOT).expect("nothing to stop");
        assert!(s.already_dead);
    }

    std::thread::sleep(Duration::from_millis(100));
    assert!(send_signal(Pid::from_raw(pid), None).is_ok());
    let stat = procfs::process::Process::new(pid).unwrap().stat().unwrap();
    assert!(!matches!(stat.state, 'Z' | 'X'), "sleep was signalled");
}

#[test]
fn a_stale_record_still_finds_qemu_through_its_control_socket() {
    if !in_private_proc(module_path!(), "a_stale_record_still_finds_qemu_through_its_control_socket") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vmm = spawn(&vm_spec(dir.path(), None, true), BOOT, READY).expect("QEMU starts");
    let stale = ProcessIdentity { start_time: vmm.identity.start_time + 1, ..vmm.identity.clone() };

    assert_eq!(vmm_liveness(Some(&stale), Some(&vmm.control_socket), BOOT), Liveness::Alive { pid: vmm.identity.pid });
    let report = kill(&stale, &vmm.control_socket, Duration::from_secs(5), BOOT).expect("killed");

    assert!(report.escalations.is_empty() && !report.already_dead);
    assert!(vmm.exit.wait_timeout(Duration::from_secs(5)).is_some());
    assert_eq!(vmm_liveness(Some(&stale), Some(&vmm.control_socket), BOOT), Liveness::Dead);
}

#[test]
fn hold_fd_node_is_held_by_qemu_alone_across_qmp_sessions_until_it_dies() {
    if !in_private_proc(module_path!(), "hold_fd_node_is_held_by_qemu_alone_across_qmp_sessions_until_it_dies") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = dir.path().join("41");
    std::fs::write(&node, b"").unwrap();
    let node = std::fs::canonicalize(&node).unwrap();
    let spec = vm_spec(&dir.path().join("run"), Some(VfioAttach::HoldFd { node: node.clone() }), false);

    let vmm = spawn(&spec, BOOT, READY).expect("QEMU starts");
    let pid = vmm.identity.pid;

    assert!(holds(pid, &node));
    assert_eq!(scan_open_handles(std::slice::from_ref(&node)), HandleScan::Held { pids: vec![pid] });
    // A full QMP session while the VM runs: QEMU 7.2 drops un-dup'ed fdset fds when the
    // last monitor disconnects (monitor_fdset_cleanup); the second copy must survive it.
    for _ in 0..2 {
        let mut qmp = QmpClient::connect(&vmm.control_socket, Duration::from_secs(5)).unwrap();
        assert_eq!(qmp.query_status().unwrap(), "running");
        drop(qmp);
        std::thread::sleep(Duration::from_millis(300));
        assert!(holds(pid, &node), "QEMU let go of the node after a QMP session");
    }
    assert_eq!(scan_open_handles(std::slice::from_ref(&node)), HandleScan::Held { pids: vec![pid] });

    kill(&vmm.identity, &vmm.control_socket, Duration::from_secs(5), BOOT).expect("killed");

    assert!(vmm.exit.wait_timeout(Duration::from_secs(5)).is_some());
    assert_eq!(scan_open_handles(std::slice::from_ref(&node)), HandleScan::Clean);
}

#[test]
fn hold_fd_open_failure_is_a_clear_start_error() {
    let dir = tempfile::tempdir().unwrap();
    let node = dir.path().join("dev/vfio/missing");
    let spec = vm_spec(dir.path(), Some(VfioAttach::HoldFd { node: node.clone() }), true);

    let err = spawn(&spec, BOOT, READY).expect_err("the open fails");

    let msg = err.to_string();
    assert!(matches!(err, HypervisorError::StartFailed { .. }), "{err:?}");
    assert!(msg.contains(&node.display().to_string()), "{msg}");
    assert!(msg.contains("No such file"), "{msg}");
}

#[test]
fn qemu_exiting_during_start_fails_fast_with_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = vm_spec(dir.path(), None, true);
    spec.kernel = Some(dir.path().join("no-such-kernel"));
    let t0 = Instant::now();

    let err = spawn(&spec, BOOT, READY).expect_err("QEMU exits");

    let msg = err.to_string();
    assert!(msg.contains("exited during start"), "{msg}");
    assert!(msg.contains("no-such-kernel"), "qemu.log tail missing: {msg}");
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_live_owner_of_the_control_socket_blocks_a_second_start() {
    let dir = tempfile::tempdir().unwrap();
    let spec = vm_spec(dir.path(), None, true);
    let vmm = spawn(&spec, BOOT, READY).expect("QEMU starts");

    let second = spawn(&spec, BOOT, READY);

    // Owner scan may be inconclusive without a private /proc: both refuse to start.
    assert!(
        matches!(second, Err(HypervisorError::StartFailed { .. }) | Err(HypervisorError::LivenessUnknown { .. })),
        "{second:?}"
    );
    kill(&vmm.identity, &vmm.control_socket, Duration::from_secs(5), BOOT).expect("killed");
}

/// `Driver::save` writes the VM's state through an fd the agent opened (the file is never in
/// the VMM's view; QEMU runs confined and under its seccomp sandbox) and leaves the VM
/// paused until `resume`; a new QEMU given that file (`VmSpec::incoming`) loads it and runs.
#[test]
fn a_saved_qemu_state_loads_into_a_new_qemu_that_runs_on() {
    let base = tempfile::tempdir().unwrap();
    let id = 1_879_048_192 + 50_000 + std::process::id() % 10_000;
    let confined = |name: &str| {
        let run = base.path().join(name).join(confine::VMM_DIR);
        std::fs::create_dir_all(&run).unwrap();
        let mut spec = vm_spec(&run, None, false);
        spec.sandbox = true;
        spec.log_dir = base.path().join(name);
        spec.confine = Some(confine::Confinement {
            identity: confine::VmmIdentity::new(id),
            view: crate::host::vmm_view::ViewSpec {
                root: base.path().join(format!("{name}-root")),
                ..Default::default()
            },
        });
        spec
    };
    let spec = confined("a");
    let vmm = spawn(&spec, BOOT, READY).expect("QEMU starts");
    let saved = base.path().join("state");
    Qemu.save(&vmm.control_socket, &spec.run_dir, &saved, READY).expect("saved");
    assert!(Qemu.paused_by_save(&Qemu.vm_state(&vmm.control_socket, READY).unwrap()));
    assert!(std::fs::metadata(&saved).unwrap().len() > 0);
    assert_eq!(Qemu.vm_state(&vmm.control_socket, READY).unwrap(), "postmigrate", "paused after the save");
    Qemu.resume(&vmm.control_socket, READY).expect("resumed");
    assert_eq!(Qemu.vm_state(&vmm.control_socket, READY).unwrap(), "running");
    stop(&Qemu, &vmm.identity, &vmm.control_socket, no_graceful(Duration::from_secs(5)), BOOT).unwrap();

    let mut spec = confined("b");
    spec.incoming = Some(saved.clone());
    assert!(Qemu.command_line(&spec).unwrap().windows(2).any(|w| w == ["-incoming", "defer"]));
    let vmm = spawn(&spec, BOOT, READY).expect("QEMU loads the saved state");
    assert_eq!(Qemu.vm_state(&vmm.control_socket, READY).unwrap(), "running");
    stop(&Qemu, &vmm.identity, &vmm.control_socket, no_graceful(Duration::from_secs(5)), BOOT).unwrap();

    // A state that is not one: the start fails, naming the file.
    std::fs::write(&saved, b"not a migration stream").unwrap();
    let mut spec = confined("c");
    spec.incoming = Some(saved.clone());
    let e = spawn(&spec, BOOT, READY).unwrap_err();
    assert!(e.to_string().contains("saved state") || format!("{e:?}").contains("saved state"), "{e:?}");
}
