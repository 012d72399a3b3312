//! Helpers shared by the integration tests (real FUSE mounts).
#![allow(dead_code)]

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use gpuvisor_sim::SimMount;
use serde_json::Value;

/// A model with one L40S and 4 VFs (the "V" host of docs/design/scenarios.md).
pub const V: &str = r#"
name = "v"
release_delay_ms = 600
[[gpu]]
bdf = "0000:41:00.0"
vf_count = 4
iommu_group = 40
"#;

/// `V` with `framework = "mdev"`.
pub const M: &str = r#"
name = "m"
framework = "mdev"
release_delay_ms = 600
[[gpu]]
bdf = "0000:41:00.0"
vf_count = 4
iommu_group = 40
"#;

pub const VF0: &str = "0000:41:00.4";
pub const VF1: &str = "0000:41:00.5";
pub const VF2: &str = "0000:41:00.6";
pub const VF3: &str = "0000:41:00.7";

pub fn vf_file(sim: &SimMount, vf: &str, file: &str) -> PathBuf {
    sim.path().join(format!("sys/bus/pci/devices/{vf}/{file}"))
}

pub fn ty(sim: &SimMount, vf: &str) -> PathBuf {
    vf_file(sim, vf, "nvidia/current_vgpu_type")
}

/// One write(2) on a freshly opened fd; the errno on failure.
pub fn write(path: &Path, value: &str) -> Result<(), i32> {
    let mut f = OpenOptions::new().write(true).open(path).map_err(|e| e.raw_os_error().unwrap_or(-1))?;
    match f.write(value.as_bytes()) {
        Ok(n) if n == value.len() => Ok(()),
        Ok(n) => panic!("short write {n}"),
        Err(e) => Err(e.raw_os_error().unwrap_or(-1)),
    }
}

pub fn read(path: &Path) -> Result<String, i32> {
    let mut f = OpenOptions::new().read(true).open(path).map_err(|e| e.raw_os_error().unwrap_or(-1))?;
    let mut s = String::new();
    f.read_to_string(&mut s).map_err(|e| e.raw_os_error().unwrap_or(-1))?;
    Ok(s)
}

pub fn catalog_ids(sim: &SimMount, vf: &str) -> Vec<u32> {
    let text = read(&vf_file(sim, vf, "nvidia/creatable_vgpu_types")).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("ID    : vGPU Name"));
    lines.map(|l| l.split(':').next().unwrap().trim().parse().unwrap()).collect()
}

pub fn open_rw(path: &Path) -> Result<std::fs::File, i32> {
    OpenOptions::new().read(true).write(true).open(path).map_err(|e| e.raw_os_error().unwrap_or(-1))
}

/// A process holding `path` open on fd 3 (`sh -c 'exec 3<>PATH; echo held; sleep 60'`).
pub struct Holder(pub Child);

impl Holder {
    /// Spawns the holder and waits until it has the fd open.
    pub fn spawn(path: &Path) -> Holder {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3<>'{}' && echo held && exec sleep 60", path.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "held", "holder failed to open {}", path.display());
        Holder(child)
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Kills the holder and reaps it (its fds are closed by the kernel).
    pub fn kill(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `f` every 20 ms until it returns true or `timeout` passes.
pub fn poll(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn vf_state<'a>(state: &'a Value, vf: &str) -> &'a Value {
    state["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["vfs"].as_array().unwrap())
        .find(|v| v["bdf"] == vf)
        .unwrap_or_else(|| panic!("no VF {vf} in state"))
}

/// Writes (not set-type etc.) in the log, as (path, value, result).
pub fn writes(state: &Value) -> Vec<(String, String, String)> {
    state["log"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["op"] == "write")
        .map(|e| {
            (
                e["path"].as_str().unwrap().to_string(),
                e["value"].as_str().unwrap().to_string(),
                e["result"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}
