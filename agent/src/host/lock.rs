//! # host::lock — one agent per GPU (docs/design/invariants.md I17)
//!
//! The data directory's lock (`<data-dir>/lock`) keeps two agents off one store; it cannot
//! keep two agents with different data directories off one GPU. So each GPU an agent
//! manages is locked too, for the agent's lifetime: an exclusive, non-blocking `flock(2)`
//! on the GPU's own sysfs directory (`<host_root>/sys/bus/pci/devices/<bdf>`, the link
//! followed). Every agent that sees the GPU through the same sysfs — whatever its data
//! directory — locks the same inode, so the second one fails to take it and refuses to
//! start. The lock is the kernel's and goes with the process: a crashed agent leaves
//! nothing to clean up. On a `gpuvisor-sim` mount (FUSE) it is the same local lock: two
//! agents on one mount conflict, agents on two mounts do not.
//!
//! Who holds a GPU is written to a note in the host-wide runtime directory
//! [`HOLDERS_DIR`], named by the device and inode of the locked directory
//! (`<st_dev>-<st_ino>`), so the refusal names the first agent (its pid, data directory
//! and socket). The note only names; the `flock` decides.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::HostRoot;

/// Where the holders of GPU locks are named (one small file per locked GPU).
pub const HOLDERS_DIR: &str = "/run/gpuvisor/gpu-holders";

/// The GPU locks an agent holds; dropped (closed) when the agent exits.
#[derive(Debug)]
pub struct GpuLocks {
    held: Vec<(String, nix::fcntl::Flock<File>)>,
}

impl GpuLocks {
    /// The GPUs locked.
    pub fn gpus(&self) -> Vec<&str> {
        self.held.iter().map(|(g, _)| g.as_str()).collect()
    }
}

/// Why the GPUs could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another agent holds one of the GPUs.
    #[error(
        "another gpuvisor agent manages GPU {gpu} ({holder}): one agent per host — stop it, or give this one other \
         GPUs (managed_gpus, passthrough_gpus)"
    )]
    Held {
        /// The GPU.
        gpu: String,
        /// Who holds it, as its note says.
        holder: String,
    },
    /// The GPU's sysfs directory cannot be opened or locked.
    #[error("cannot lock GPU {gpu} ({path}): {source}")]
    Io {
        /// The GPU.
        gpu: String,
        /// Its sysfs directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Locks every GPU of `gpus` (PCI addresses) under `host` for this process, naming it
/// `holder` (e.g. `pid 123, data_dir /var/lib/gpuvisor, socket /run/gpuvisor/gpuvisor.sock`)
/// in [`HOLDERS_DIR`]. A GPU the host does not have is skipped (nothing to manage there).
/// Errors: [`LockError::Held`] when another process holds one of them (nothing is kept
/// locked then), [`LockError::Io`] when one cannot be opened or locked.
pub fn lock_gpus(host: &HostRoot, gpus: &[String], holder: &str) -> Result<GpuLocks, LockError> {
    lock_gpus_in(host, gpus, holder, Path::new(HOLDERS_DIR))
}

fn lock_gpus_in(host: &HostRoot, gpus: &[String], holder: &str, notes: &Path) -> Result<GpuLocks, LockError> {
    let mut held = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for gpu in gpus {
        if !seen.insert(gpu.to_ascii_lowercase()) {
            continue;
        }
        let path = host.pci_device(gpu);
        let io = |source| LockError::Io { gpu: gpu.clone(), path: path.clone(), source };
        let dir = match File::open(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(e)),
        };
        let meta = dir.metadata().map_err(io)?;
        let note = notes.join(format!("{}-{}", meta.dev(), meta.ino()));
        match nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => {
                write_note(&note, &format!("{holder}, GPU {gpu} under {}", host.root().display()));
                held.push((gpu.clone(), lock));
            }
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                let holder = std::fs::read_to_string(&note)
                    .ok()
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .unwrap_or_else(|| "its pid is not recorded yet".into());
                return Err(LockError::Held { gpu: gpu.clone(), holder });
            }
            Err((_, e)) => return Err(io(std::io::Error::from(e))),
        }
    }
    Ok(GpuLocks { held })
}

/// Writes the holder's note (best effort: the lock is what excludes; a note that cannot be
/// written only makes a refusal less precise, and is logged).
fn write_note(note: &Path, text: &str) {
    let res = (|| -> std::io::Result<()> {
        if let Some(dir) = note.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = note.with_extension(format!("{}.tmp", std::process::id()));
        std::fs::write(&tmp, format!("{text}\n"))?;
        std::fs::rename(&tmp, note)
    })();
    if let Err(e) = res {
        tracing::warn!(note = %note.display(), error = %e, "cannot name this agent as the GPU's holder");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_host() -> (tempfile::TempDir, HostRoot) {
        let d = tempfile::tempdir().unwrap();
        for g in ["0000:41:00.0", "0000:42:00.0"] {
            std::fs::create_dir_all(d.path().join("sys/bus/pci/devices").join(g)).unwrap();
        }
        let h = HostRoot::new(d.path());
        (d, h)
    }

    /// Issue 18 finding 7: a second holder of any of the same GPUs is refused and told who
    /// holds it; another set of GPUs, or the same GPUs once the first let go, can be taken.
    #[test]
    fn a_second_holder_of_a_gpu_is_refused_and_named_until_the_first_lets_go() {
        let (_d, host) = fake_host();
        let notes = tempfile::tempdir().unwrap();
        let a = ["0000:41:00.0".to_string()];
        let both = ["0000:42:00.0".to_string(), "0000:41:00.0".to_string()];
        let first = lock_gpus_in(&host, &a, "pid 1, data_dir /first", notes.path()).unwrap();
        assert_eq!(first.gpus(), vec!["0000:41:00.0"]);
        match lock_gpus_in(&host, &both, "pid 2, data_dir /second", notes.path()) {
            Err(LockError::Held { gpu, holder }) => {
                assert_eq!(gpu, "0000:41:00.0");
                assert!(holder.contains("pid 1, data_dir /first"), "{holder}");
            }
            other => panic!("{other:?}"),
        }
        // The refused attempt kept nothing: 42 is free for a third.
        let third = lock_gpus_in(&host, &["0000:42:00.0".to_string()], "pid 3", notes.path()).unwrap();
        drop(third);
        drop(first);
        let again = lock_gpus_in(&host, &both, "pid 4", notes.path()).unwrap();
        assert_eq!(again.gpus().len(), 2);
        // A GPU the host does not have is skipped.
        let none = lock_gpus_in(&host, &["0000:99:00.0".to_string()], "pid 5", notes.path()).unwrap();
        assert!(none.gpus().is_empty());
    }
}
