//! Records survive `kill -9` of a writer between (and inside) steps: a child process
//! rewrites instance and claim records as fast as it can; it is killed with SIGKILL at an
//! arbitrary moment; every record must still decode (the old or the new version), and the
//! strict listings must succeed.

use gpuvisor::store::{
    Claim, ClaimKind, ClaimState, Framework, InstanceDefinition, InstanceRecord, InstanceState, Store,
};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use uuid::Uuid;

const CHILD_ENV: &str = "GPUVISOR_STORE_WRITER_DIR";

fn record(id: Uuid, n: u64) -> InstanceRecord {
    let mut r = InstanceRecord::new(
        InstanceDefinition {
            id,
            name: format!("vm-{n}"),
            image: "demo".into(),
            hypervisor: gpuvisor::hypervisor::HypervisorKind::Qemu,
            vcpus: 1,
            memory_mib: 256 + n,
            labels: Default::default(),
            gpu_profile: Some("L40S-2Q".into()),
            gpu_framework: Some(Framework::VendorVfio),
            gpu_passthrough: None,
            gpu_resource_claim: None,
            restart: Default::default(),
            autostart: false,
            created_at: "2026-01-01T00:00:00Z".into(),
            nics: vec![],
            cloud_init: None,
            boot: Default::default(),
            disk_gib: None,
        },
        if n.is_multiple_of(2) { InstanceState::Running } else { InstanceState::Stopped },
    );
    r.last_error = Some("x".repeat((n % 4096) as usize));
    r
}

fn claim(device: &str, id: Uuid, n: u64) -> Claim {
    Claim {
        device: device.into(),
        owner: gpuvisor::store::Owner::Instance(id),
        owner_name: None,
        owner_labels: None,
        gpu: "0000:41:00.0".into(),
        profile: "L40S-2Q".into(),
        kind: ClaimKind::Vf { type_id: Some(1148) },
        claimed_at: "2026-01-01T00:00:00Z".into(),
        claim_boot_id: "b".into(),
        // The same claim on every rewrite (an update never replaces another claim).
        claimed_boottime_ms: 1,
        driver_version: None,
        state: ClaimState::ReleasePending,
        release_attempts: n as u32,
        last_error: Some("y".repeat((n % 3000) as usize)),
    }
}

/// The child: rewrites records forever (until killed).
#[test]
fn store_writer_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else { return };
    let store = Store::open(&dir).unwrap();
    let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    let mut n = 0u64;
    loop {
        for (i, id) in ids.iter().enumerate() {
            store.persist_instance(&record(*id, n)).unwrap();
            let dev = format!("0000:41:00.{}", 4 + i);
            match store.persist_new_claim(&claim(&dev, *id, n)) {
                Ok(()) => {}
                Err(_) => {
                    store.update_claim(&claim(&dev, *id, n)).unwrap();
                    if n.is_multiple_of(3) {
                        store.remove_claim(&dev).unwrap();
                    }
                }
            }
        }
        n += 1;
        if n == 20 {
            println!("writing");
        }
    }
}

#[test]
fn records_survive_kill_9_of_a_writer_between_steps() {
    for round in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "store_writer_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        // Let it write for a while (varying per round), then kill it mid-write.
        let store = Store::open(dir.path()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while store.list_instances().map(|v| v.len()).unwrap_or(0) < 4 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(20 + 37 * round));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGKILL)
            .unwrap();
        child.wait().unwrap();
        let instances = store.list_instances().expect("every instance record decodes after kill -9");
        assert_eq!(instances.len(), 4, "round {round}");
        store.list_claims().expect("every claim decodes after kill -9");
    }
}
