//! Small process shapes for the end-to-end tests that `sh` cannot make (tests/proc_faults.rs).
//!
//! - `hold PATH`: opens PATH read-only (retrying EBUSY as below), prints `holding <pid>` and
//!   sleeps forever: an ordinary holder of a VFIO node.
//! - `hold-nondumpable PATH`: opens PATH read-only and keeps the fd, makes itself
//!   non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`), prints `holding <pid>` and sleeps forever.
//!   A process without CAP_SYS_PTRACE can then list its `/proc/<pid>/fd` but `readlink` of an
//!   entry fails with EACCES (`proc_fd_access_allowed` → `ptrace_may_access`, fs/proc/base.c).
//! - `zombie-leader [PATH]`: optionally opens PATH (retrying EBUSY for up to 10 s: a VFIO
//!   group node is single-open and the previous holder's close may still be in flight) and
//!   keeps the fd, starts a thread that sleeps forever, prints `ready <pid>`, then ends its
//!   main thread alone: the thread-group leader becomes a zombie (`State: Z`) while the
//!   other thread runs on and keeps the (shared) fd table.
//!
//! Signal dispositions are left at their defaults, so a SIGTERM or SIGKILL sent to either
//! shape ends it and a SIGSTOP stops it: the tests observe "no signal" as "still running".

use std::io::Write;
use std::time::{Duration, Instant};

fn usage() -> ! {
    eprintln!("usage: e2e-helper hold PATH | hold-nondumpable PATH | zombie-leader [PATH]");
    std::process::exit(2)
}

fn sleep_forever() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Opens `path` read-only, retrying EBUSY for a bounded time.
fn open_retrying_ebusy(path: &str) -> std::fs::File {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match std::fs::File::open(path) {
            Ok(f) => return f,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                eprintln!("e2e-helper: open {path}: {e}");
                std::process::exit(1)
            }
        }
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    out.write_all(line.as_bytes()).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush()).expect("stdout");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["hold", path] => {
            let _keep = open_retrying_ebusy(path);
            say(&format!("holding {}", std::process::id()));
            sleep_forever()
        }
        ["hold-nondumpable", path] => {
            let f = open_retrying_ebusy(path);
            // SAFETY: prctl(PR_SET_DUMPABLE, 0) takes plain integer arguments.
            if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) } != 0 {
                eprintln!("e2e-helper: prctl(PR_SET_DUMPABLE, 0): {}", std::io::Error::last_os_error());
                std::process::exit(1)
            }
            say(&format!("holding {}", std::process::id()));
            let _keep = f;
            sleep_forever()
        }
        ["zombie-leader", rest @ ..] if rest.len() <= 1 => {
            let f = rest.first().map(|p| open_retrying_ebusy(p));
            std::thread::Builder::new().name("sleeper".into()).spawn(|| sleep_forever()).expect("spawn thread");
            say(&format!("ready {}", std::process::id()));
            // The fd table is shared with the sleeper thread: the fd stays open after the
            // leader has gone.
            std::mem::forget(f);
            // Only the calling thread exits (SYS_exit, not exit_group). pthread_exit would do
            // the same for the kernel, but its forced unwind through Rust frames is undefined
            // behaviour.
            // SAFETY: SYS_exit ends this thread; nothing after it runs.
            unsafe { libc::syscall(libc::SYS_exit, 0) };
            unreachable!("SYS_exit returned")
        }
        _ => usage(),
    }
}
