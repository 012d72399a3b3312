//! S036: a VMM that outlives SIGKILL stops the teardown.
//!
//! A process blocked in a FUSE request that the filesystem has already picked up waits
//! uninterruptibly until the reply (Linux `fs/fuse/dev.c` `request_wait_answer`): SIGKILL
//! cannot end it. The test VMM is a small QMP-speaking stand-in (Python) that, on SIGTERM,
//! writes to a simulator file whose writes are delayed (`delay-write`): it then survives
//! SIGTERM, SIGKILL and the group SIGKILL for the delay, exactly like a QEMU stuck in the
//! kernel.

use gpuvisor_e2e::*;
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

/// On SIGTERM the stand-in writes to STUCK_PATH (a delayed FUSE file), where SIGKILL cannot
/// reach it until the write ends.
const ON_TERM_STUCK: &str = r#"
def on_term(signum, frame):
    stuck = open(os.path.join(os.path.dirname(qmp), "stuck-path")).read().strip()
    with open(stuck, "w") as f:
        f.write("frame_rate_limiter=0")
signal.signal(signal.SIGTERM, on_term)
"#;

#[test]
fn s036_a_vmm_that_outlives_sigkill_stops_the_teardown() {
    let tools = vmm_writable_tempdir("gpuvisor-fake-vmm.").unwrap();
    let fake = tools.path().join("fake-vmm");
    std::fs::write(&fake, qmp_stand_in(ON_TERM_STUCK)).unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let qemu_binary = format!("{:?}", fake);
    let a = Agent::start_tuned(
        AgentOptions { model: HOST_V, ..Default::default() },
        None,
        &[("vfio_term_grace_s", "1"), ("qemu_binary", &qemu_binary)],
    )
    .unwrap();
    let inst = a.create_gpu("a", "L40S-1Q").unwrap();
    let vf = inst["gpu"]["device"].as_str().unwrap().to_string();
    let id = inst["id"].as_str().unwrap().to_string();
    // The VMM's directory (beside its QMP socket): the only one it sees of the data directory.
    let run_dir = a.data_dir.join("instances").join(&id).join("vmm");
    // The stand-in will write this VF's vgpu_params on SIGTERM; delay that write 12 s.
    let params = format!("sys/bus/pci/devices/{vf}/nvidia/vgpu_params");
    std::fs::write(run_dir.join("stuck-path"), a.sim.path().join(&params).display().to_string()).unwrap();
    a.sim.ctl(&["delay-write", &params, "12000", "--times", "1"]).unwrap();
    let vmm = pids_where(|c| c.contains("fake-vmm") && c.contains(&id));
    assert_eq!(vmm.len(), 1);

    let t0 = Instant::now();
    let e = a.err("instance.stop", json!({"ref": "a", "force": true}));
    assert_eq!((e.code, e.data_code.as_str()), (500, "vmm_kill_failed"), "{e}");
    assert!(e.data["pid"].is_number(), "the error names the pid: {e}");
    assert!(t0.elapsed() >= Duration::from_secs(5), "SIGTERM grace + 2 s + 2 s were waited: {:?}", t0.elapsed());
    // Nothing was torn down.
    assert_eq!(a.vf_type(&vf), 1147);
    let claims = a.claims();
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0]["state"], "configured");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "stopping");
    assert!(pids_where(|c| c.contains("fake-vmm") && c.contains(&id)).len() == 1, "still alive (in the kernel)");

    // Once the process has exited, a second stop completes normally.
    wait_for(Duration::from_secs(30), || {
        pids_where(|c| c.contains("fake-vmm") && c.contains(&id)).is_empty().then_some(())
    })
    .expect("the stuck VMM exits once its write returns");
    let stopped = a.ok("instance.stop", json!({"ref": "a", "force": true}));
    assert_eq!(stopped["state"], "stopped");
    assert_eq!(a.vf_type(&vf), 0);
    assert!(a.claims().is_empty());
}
