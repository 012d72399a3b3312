//! docs/design/scenarios.md S030 ("An unreadable /proc entry blocks the release") and S033 ("Zombies and
//! unreadable status files"), against the real agent, gpuvisor-sim and QEMU (guests paused
//! through a `qemu_binary` wrapper). Pids the agent reports or stores are pids of the agent's
//! PID namespace (it sees only that namespace's /proc).
//!
//! # How the /proc faults are produced
//!
//! The agent normally runs as root with every capability and can read every `/proc/<pid>/fd`.
//! The kernel checks (fs/proc/fd.c, fs/proc/base.c, kernel/ptrace.c, security/commoncap.c):
//!
//! - `readlink /proc/<pid>/fd/N` goes through `proc_fd_access_allowed` →
//!   `ptrace_may_access(task, PTRACE_MODE_READ_FSCREDS)`. `__ptrace_may_access` refuses a
//!   target whose mm is not dumpable (`prctl(PR_SET_DUMPABLE, 0)`) unless the caller has
//!   CAP_SYS_PTRACE, and `cap_ptrace_access_check` refuses a target whose permitted
//!   capabilities are not a subset of the caller's, again unless the caller has
//!   CAP_SYS_PTRACE. Listing `/proc/<pid>/fd` is not subject to these checks.
//! - Listing `/proc/<pid>/fd` goes through `proc_fd_permission` → `generic_permission` on a
//!   directory of mode 0500 owned by the target's euid (for a dumpable target): root lists
//!   another user's fd directory only with CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH.
//!
//! **S030 (a)**, readlink fails with EACCES: every process of the agent's namespace (its
//! init, the agent, its QEMUs, the test's holders) is started without CAP_SYS_PTRACE in its
//! bounding set, by dropping it (`PR_CAPBSET_DROP`) from the test's own thread before the
//! agent is started (capabilities are per thread; the test runs in a thread of its own). The
//! agent then still reads the fds of every process there (same uid, same capabilities,
//! dumpable) except those of a non-dumpable holder (`e2e-helper hold-nondumpable`). Dropping
//! CAP_SYS_PTRACE from the agent alone (`setpriv --bounding-set -sys_ptrace`) is not enough:
//! the namespace's init keeps the full set, so the capability-subset check makes *its* fds
//! unreadable too and every scan would fail, holder or not.
//!
//! **S030 (b)**, listing fails with EACCES: the agent runs without CAP_DAC_OVERRIDE and
//! CAP_DAC_READ_SEARCH (`Agent::wrap` = `setpriv --bounding-set -dac_override,-dac_read_search`;
//! it keeps CAP_SYS_PTRACE, so the fds of every root process stay readable), and a holder runs
//! as uid 1000 (`setpriv --reuid 1000`; it is dumpable again after its exec, so its fd
//! directory is owned by uid 1000, mode 0500).
//!
//! **S033 (a)**: the agent is stopped with SIGSTOP, its own QEMU child is SIGKILLed and stays
//! a zombie (its parent cannot reap it), then the agent is continued. **(b)**: after the
//! agent is killed, `e2e-helper zombie-leader` holds the VF's group node from a thread whose
//! leader has exited (the leader is a zombie, the thread runs on) and A's record is rewritten
//! to name it (namespace pid, `/proc/<pid>/stat` start time, same boot id). **(c)** (an
//! unreadable `/proc/<pid>/status`) cannot be produced: the file is mode 0444 and readable
//! for any process that may see the pid, so there is no test for it.

use gpuvisor_e2e::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use std::io::BufRead;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const HOST_V: &str = "release_delay_ms = 300\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
const VF0: &str = "0000:41:00.4";
const STALE: &str = "gpuvisor_vgpu_stale_releases";
/// `CAP_DAC_OVERRIDE`, `CAP_DAC_READ_SEARCH`, `CAP_SYS_PTRACE` (include/uapi/linux/capability.h).
const CAP_DAC_OVERRIDE: u32 = 1;
const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_SYS_PTRACE: u32 = 19;

fn agent(w: &QemuWrapper) -> Agent {
    let extra = w.extra() + "reconcile_interval_s = 3600\n";
    Agent::start_tuned(
        AgentOptions { model: HOST_V, extra: &extra, ..Default::default() },
        None,
        &[("release_retry_s", "1")],
    )
    .unwrap()
}

fn sig(pid: i32, s: Signal) {
    kill(Pid::from_raw(pid), s).unwrap_or_else(|e| panic!("kill({pid}, {s}): {e}"));
}

/// The `State` letter of `/proc/<pid>/stat` (`None`: no such process).
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Field 4 (`ppid`) of `/proc/<pid>/stat`.
fn proc_ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// A hex capability mask line (`CapEff`, `CapBnd`, …) of `/proc/<pid>/status`.
fn cap_mask(pid: i32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(&format!("{field}:"))).unwrap();
    u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
}

fn has_cap(pid: i32, cap: u32) -> bool {
    cap_mask(pid, "CapEff") & (1u64 << cap) != 0
}

/// The single `gpuvisor serve` process of `a` (root-namespace pid).
fn agent_pid(a: &Agent) -> i32 {
    let pids = a.agent_pids();
    assert_eq!(pids.len(), 1, "one agent process: {pids:?}");
    pids[0]
}

/// True when `text` names `/proc/<pid>/fd` (followed by `/`, a non-digit or the end).
fn names_proc_fd(text: &str, pid: i32) -> bool {
    let needle = format!("/proc/{pid}/fd");
    text.match_indices(&needle).any(|(i, _)| !text[i + needle.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

/// A process started inside the agent's namespace; killed (SIGKILL by its pid) on drop.
struct NsProc {
    /// `nsenter`, whose only child is the process.
    launcher: Child,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
    /// The first line it printed.
    line: String,
    /// Its root-namespace pid.
    root: i32,
}

impl NsProc {
    /// Runs `program args` in `a`'s namespace and waits for its first stdout line.
    fn spawn(a: &Agent, program: &str, args: &[&str]) -> NsProc {
        let mut launcher =
            a.ns.command(program)
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn in the agent's namespace");
        let mut out = std::io::BufReader::new(launcher.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let line = line.trim().to_string();
        let np = launcher.id();
        // nsenter forks once to enter the PID namespace: its child is the process (it may
        // already be a zombie leader, which is why it is not looked up by command line).
        let root = wait_for(Duration::from_secs(5), || {
            let children = std::fs::read_to_string(format!("/proc/{np}/task/{np}/children")).ok()?;
            children.split_whitespace().next()?.parse::<i32>().ok()
        })
        .unwrap_or_else(|| panic!("{program} {args:?} has no process (printed {line:?})"));
        NsProc { launcher, _stdout: out, line, root }
    }

    /// The namespace pid from a `<word> <pid>` line.
    fn printed_pid(&self, word: &str) -> i32 {
        let pid = self.line.strip_prefix(word).and_then(|r| r.trim().parse().ok());
        let pid = pid.unwrap_or_else(|| panic!("expected {word:?} <pid>, got {:?}", self.line));
        assert_eq!(ns_pid(self.root), Some(pid), "the printed pid is the process's namespace pid");
        pid
    }

    /// SIGKILL, then waits for the launcher (which reaps the process).
    fn kill(&mut self) {
        let _ = kill(Pid::from_raw(self.root), Signal::SIGKILL);
        let _ = self.launcher.wait();
    }
}

impl Drop for NsProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `body` in a thread of its own (capability sets are per thread: a change made there
/// reaches only the processes that thread starts) and re-raises its panic.
fn in_own_thread(body: impl FnOnce() + Send + 'static) {
    if let Err(p) = std::thread::spawn(body).join() {
        std::panic::resume_unwind(p);
    }
}

/// Drops `cap` from the calling thread's bounding set: programs it execs from now on
/// (unshare and the namespace's init, nsenter and everything it starts) run without it.
fn drop_from_bounding_set(cap: u32) {
    // SAFETY: prctl(PR_CAPBSET_DROP, cap) takes plain integer arguments.
    let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
    assert_eq!(rc, 0, "PR_CAPBSET_DROP {cap}: {}", std::io::Error::last_os_error());
}

/// The claim fields a failed release must not change (`release_attempts` and `last_error`
/// record the attempts).
fn claim_identity(c: &Value) -> Value {
    let mut c = c.clone();
    if let Some(o) = c.as_object_mut() {
        o.remove("release_attempts");
        o.remove("last_error");
    }
    c
}

/// `sh` in `a`'s namespace (with `prefix` prepended), as the agent's view of /proc.
fn ns_probe(a: &Agent, prefix: &[&str], script: &str) -> String {
    let mut argv: Vec<&str> = prefix.to_vec();
    argv.extend(["sh", "-c", script]);
    let out = a.ns.command(argv[0]).args(&argv[1..]).stdin(Stdio::null()).output().expect("probe");
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// S030 steps shared by (a) and (b), with the fault in place for namespace pid `nspid`
/// (held by `holder`): delete → 500 `vgpu_cleanup_pending` naming the incomplete scan of
/// `nspid`; VF and claim unchanged; one pass leaves them alone and counts
/// `scan_incomplete`. Then the holder is killed and the delete goes through.
fn s030_steps(a: &Agent, id: &str, nspid: i32, holder: &mut NsProc) {
    let claim0 = a.claim_file(VF0).expect("retained claim");
    assert_eq!(claim0["state"], "release_pending", "{claim0}");
    let type0 = a.vf_type(VF0);
    assert_eq!(type0, 1148, "vf0 holds L40S-2Q");
    let seq = last_seq(&a.state());

    let e = a.err("instance.delete", json!({"ref": "a"}));
    eprintln!("delete with the fault in place: {e}\n  data: {}", e.data);
    assert_eq!((e.code, e.data_code.as_str()), (500, "vgpu_cleanup_pending"), "{e} {}", e.data);
    assert_eq!(e.data["retained"], true, "{}", e.data);
    assert_eq!(e.data["instance_id"], id, "{}", e.data);
    let cause = e.data["cause"].to_string();
    assert!(cause.contains("scan_incomplete"), "the cause is an incomplete scan: {}", e.data);
    assert!(names_proc_fd(&cause, nspid), "the cause names /proc/{nspid}/fd: {}", e.data);
    assert!(cause.contains("Permission denied"), "the cause names the errno: {}", e.data);

    let unchanged = |when: &str| {
        let w: Vec<_> = log_after(&a.state(), seq).into_iter().filter(|e| e["op"] == "write").collect();
        assert!(w.is_empty(), "{when}: no sysfs write: {w:?}");
        assert_eq!(a.vf_type(VF0), type0, "{when}: vf0 still reads its type");
        let c = a.claim_file(VF0).unwrap_or_else(|| panic!("{when}: the claim stays"));
        assert_eq!(claim_identity(&c), claim_identity(&claim0), "{when}: the claim is unchanged");
        let le = c["last_error"].as_str().unwrap_or("");
        assert!(le.contains("scan_incomplete") && names_proc_fd(le, nspid), "{when}: last_error {le:?}");
        assert!(alive(holder.root), "{when}: the holder got no signal");
    };
    unchanged("after the delete");
    assert_eq!(a.ok("instance.get", json!({"ref": "a"}))["state"], "cleanup_pending");

    let before = metric0(&a.metrics(), STALE, &[("result", "scan_incomplete")]);
    let released_before = metric0(&a.metrics(), STALE, &[("result", "released")]);
    let rep = a.pass();
    eprintln!("pass with the fault in place: {rep}");
    unchanged("after the pass");
    let failed = rep["failed"].as_array().cloned().unwrap_or_default();
    assert!(
        failed.iter().any(|f| f["device"] == VF0 && f["error"].as_str().is_some_and(|s| s.contains("scan_incomplete"))),
        "the pass reports vf0's incomplete scan: {rep}"
    );
    let m = a.metrics();
    let stale: Vec<&str> = m.lines().filter(|l| l.contains(STALE)).collect();
    assert_eq!(metric0(&m, STALE, &[("result", "scan_incomplete")]), before + 1.0, "{stale:#?}");
    assert_eq!(metric0(&m, STALE, &[("result", "released")]), released_before);

    // Without the unreadable process the same delete goes through.
    holder.kill();
    assert!(!alive(holder.root));
    let del = a.ok("instance.delete", json!({"ref": "a"}));
    assert_eq!(del["deleted"], true, "{del}");
    assert_eq!(a.vf_type(VF0), 0);
    assert!(a.claim_file(VF0).is_none(), "{:?}", a.claims());
    assert!(a.instance_names().is_empty(), "{:?}", a.instance_names());
}

#[test]
fn s030a_an_unreadable_fd_link_blocks_the_release() {
    in_own_thread(|| {
        drop_from_bounding_set(CAP_SYS_PTRACE);
        let w = QemuWrapper::new();
        let a = agent(&w);
        let ap = agent_pid(&a);
        assert!(!has_cap(ap, CAP_SYS_PTRACE), "the agent runs without CAP_SYS_PTRACE");
        let (id, vf) = a.retained_stopped("a", "L40S-2Q");
        assert_eq!(vf, VF0);
        let group = vf_entry(&a.state(), VF0)["group"].as_u64().unwrap();
        let node = a.sim.path().join(format!("dev/vfio/{group}")).display().to_string();

        // A non-dumpable process holds vf0's group node.
        let mut holder = NsProc::spawn(&a, helper_binary().to_str().unwrap(), &["hold-nondumpable", &node]);
        let nspid = holder.printed_pid("holding");
        assert!(fd_targets(holder.root).contains(&node), "the holder holds {node}");
        // The fault, as a process with the agent's capabilities sees it: the fd directory
        // lists, its links do not read.
        let probe = ns_probe(
            &a,
            &[],
            &format!("ls /proc/{nspid}/fd >/dev/null && echo LIST-OK; readlink -v /proc/{nspid}/fd/* || echo READLINK-FAILED"),
        );
        assert!(probe.contains("LIST-OK") && probe.contains("READLINK-FAILED"), "fault not in place: {probe}");
        assert!(probe.contains("Permission denied"), "EACCES: {probe}");

        s030_steps(&a, &id, nspid, &mut holder);
    });
}

#[test]
fn s030b_an_unlistable_fd_directory_blocks_the_release() {
    let w = QemuWrapper::new();
    let mut a = agent(&w);
    let (id, vf) = a.retained_stopped("a", "L40S-2Q");
    assert_eq!(vf, VF0);

    // A dumpable process of uid 1000 (its fd directory is uid 1000's, mode 0500). It is in
    // place before the agent restarts: the startup pass would release the claim otherwise.
    let mut holder = NsProc::spawn(
        &a,
        "setpriv",
        &["--reuid=1000", "--regid=1000", "--clear-groups", "--", "sh", "-c", "echo pid $$; exec sleep 3030"],
    );
    let nspid = holder.printed_pid("pid");
    // The agent restarts without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (it keeps
    // CAP_SYS_PTRACE).
    let wrap = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"];
    let probe = ns_probe(&a, &wrap, &format!("ls /proc/{nspid}/fd || echo LIST-FAILED"));
    assert!(probe.contains("LIST-FAILED") && probe.contains("Permission denied"), "fault not in place: {probe}");
    a.wrap = wrap.iter().map(|s| s.to_string()).collect();
    a.restart().unwrap();
    let ap = agent_pid(&a);
    assert!(!has_cap(ap, CAP_DAC_OVERRIDE) && !has_cap(ap, CAP_DAC_READ_SEARCH), "agent caps");
    assert!(has_cap(ap, CAP_SYS_PTRACE), "the agent keeps CAP_SYS_PTRACE");

    s030_steps(&a, &id, nspid, &mut holder);
}

/// Issue 18 finding 11: an agent whose open-handle scan cannot read another process's fds
/// (it runs without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH, a process of uid 1000 in its
/// namespace) is not plainly healthy: `agent.health` is `degraded` and names the unreadable
/// fd table, before any release is refused for it.
#[test]
fn health_names_an_fd_table_the_open_handle_scan_cannot_read() {
    let w = QemuWrapper::new();
    let mut a = agent(&w);
    let holder = NsProc::spawn(
        &a,
        "setpriv",
        &["--reuid=1000", "--regid=1000", "--clear-groups", "--", "sh", "-c", "echo pid $$; exec sleep 3031"],
    );
    let nspid = holder.printed_pid("pid");
    let wrap = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"];
    a.wrap = wrap.iter().map(|s| s.to_string()).collect();
    a.restart().unwrap();
    let h = a.ok("agent.health", json!({}));
    assert_eq!(h["degraded"], true, "{h}");
    let problems = h["problems"].to_string();
    assert!(
        problems.contains("open-handle scan") && names_proc_fd(&problems, nspid),
        "BUG: health does not name the unreadable fd table of {nspid}: {h}"
    );
}

#[test]
fn s033a_a_zombie_direct_child_is_dead_reaped_and_released() {
    let w = QemuWrapper::new();
    let a = agent(&w);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    assert_eq!(inst["gpu"]["device"], VF0);
    let qemu = qemu_of(&id)[0];
    let ap = agent_pid(&a);
    assert_eq!(proc_ppid(qemu), Some(ap), "QEMU is the agent's own child");
    let qemu_start = proc_start_time(qemu).unwrap();

    // The agent cannot reap while stopped: the killed QEMU stays a zombie until it runs again.
    // nsenter (the harness's launcher, the agent's parent) stops itself when its child stops
    // and sends it SIGCONT when continued: it is continued too, or it would stay stopped.
    let launcher = proc_ppid(ap).unwrap();
    let cmd = std::fs::read(format!("/proc/{launcher}/cmdline")).unwrap_or_default();
    assert!(cmd.starts_with(b"nsenter"), "the agent's parent is the harness's nsenter");
    sig(ap, Signal::SIGSTOP);
    let stopped = wait_for(Duration::from_secs(10), || {
        (proc_state(ap) == Some('T') && proc_state(launcher) == Some('T')).then_some(())
    });
    let zombie = stopped.and_then(|_| {
        sig(qemu, Signal::SIGKILL);
        wait_for(Duration::from_secs(10), || (proc_state(qemu) == Some('Z')).then_some(()))
    });
    // Its VF's last handle is gone and the simulator's teardown lag is over before the agent
    // runs again (the lag would make the first clear EBUSY; that is not what S033 is about).
    let idle = zombie.and_then(|_| wait_vf_idle(&a, VF0));
    sig(launcher, Signal::SIGCONT);
    sig(ap, Signal::SIGCONT);
    stopped.expect("the agent (and its launcher) stopped");
    zombie.expect("QEMU is a zombie while its parent is stopped");
    idle.expect("vf0 idle in the simulator");
    wait_for(Duration::from_secs(10), || {
        (proc_state(ap) != Some('T') && proc_state(launcher) != Some('T')).then_some(())
    })
    .expect("the agent runs again");

    let t0 = Instant::now();
    let rep = a.pass();
    eprintln!("pass after the zombie: {rep}");
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert!(t0.elapsed() < Duration::from_secs(30), "nothing blocks: {:?}", t0.elapsed());
    assert_eq!(got["state"], "stopped", "A is reported dead: {got}\npass: {rep}");
    assert_eq!(a.vf_type(VF0), 0, "vf0 is released: {rep}");
    assert!(a.claim_file(VF0).is_none(), "no claim: {:?}", a.claims());
    let reaped = wait_for(Duration::from_secs(10), || (proc_start_time(qemu) != Some(qemu_start)).then_some(()));
    assert!(reaped.is_some(), "the zombie QEMU {qemu} is reaped (state {:?})", proc_state(qemu));
    assert!(a.log().lines().all(|l| !l.contains("panicked")), "{}", tail(&a.log(), 30));
}

/// Waits (bounded) until the simulator shows no open handle on `vf` and no running teardown
/// lag (`busy_until_ms`).
fn wait_vf_idle(a: &Agent, vf: &str) -> Option<()> {
    wait_for(Duration::from_secs(10), || {
        let v = vf_entry(&a.state(), vf);
        (v["handles"].as_array().is_some_and(|h| h.is_empty()) && v["busy_until_ms"].is_null()).then_some(())
    })
}

/// `/proc/<pid>/task` entries of a root-namespace pid: `(tid, state)`.
fn tasks(pid: i32) -> Vec<(i32, char)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let Ok(tid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        if let Some(s) = stat.rsplit_once(')').and_then(|(_, r)| r.trim_start().chars().next()) {
            out.push((tid, s));
        }
    }
    out.sort();
    out
}

/// The zombie-leader helper is as it was started: leader `Z`, one other thread sleeping
/// (`S`: not stopped, not killed), no pending signal.
fn zombie_leader_intact(root: i32) -> Result<(), String> {
    let t = tasks(root);
    let leader = t.iter().find(|(tid, _)| *tid == root).map(|(_, s)| *s);
    let others: Vec<char> = t.iter().filter(|(tid, _)| *tid != root).map(|(_, s)| *s).collect();
    if leader != Some('Z') || others != ['S'] {
        return Err(format!("tasks {t:?}"));
    }
    let status = std::fs::read_to_string(format!("/proc/{root}/status")).unwrap_or_default();
    for f in ["ShdPnd", "SigPnd"] {
        let v = status.lines().find(|l| l.starts_with(f)).and_then(|l| l.split_whitespace().nth(1));
        if v.is_none_or(|v| u64::from_str_radix(v, 16) != Ok(0)) {
            return Err(format!("{f}: {v:?}"));
        }
    }
    Ok(())
}

#[test]
fn s033b_a_zombie_leader_with_live_threads_is_alive() {
    let w = QemuWrapper::new();
    let mut a = agent(&w);
    let inst = a.create_gpu("a", "L40S-2Q").unwrap();
    let id = inst["id"].as_str().unwrap().to_string();
    assert_eq!(inst["gpu"]["device"], VF0);
    let qemu = qemu_of(&id)[0];
    let group = vf_entry(&a.state(), VF0)["group"].as_u64().unwrap();
    let node = a.sim.path().join(format!("dev/vfio/{group}")).display().to_string();
    assert!(fd_targets(qemu).contains(&node), "QEMU holds {node}");

    // The agent is down; A's QEMU is replaced by a process whose leader is a zombie and
    // whose other thread holds vf0's group node.
    a.kill_agent();
    sig(qemu, Signal::SIGKILL);
    wait_for(Duration::from_secs(10), || (!alive(qemu)).then_some(())).expect("QEMU died");
    wait_vf_idle(&a, VF0).expect("QEMU's handle on vf0 is closed");
    let mut h = NsProc::spawn(&a, helper_binary().to_str().unwrap(), &["zombie-leader", &node]);
    let nspid = h.printed_pid("ready");
    wait_for(Duration::from_secs(10), || zombie_leader_intact(h.root).ok()).unwrap_or_else(|| {
        panic!("the helper's leader never became a zombie beside a running thread: {:?}", zombie_leader_intact(h.root))
    });
    let sleeper = tasks(h.root).into_iter().find(|(t, _)| *t != h.root).unwrap().0;
    assert!(fd_targets(h.root).is_empty(), "the zombie leader's own fd table is empty");
    let held: Vec<String> = std::fs::read_dir(format!("/proc/{}/task/{sleeper}/fd", h.root))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|t| t.display().to_string())
        .collect();
    assert!(held.contains(&node), "the helper's thread holds {node}: {held:?}");

    let mut rec = a.record(&id);
    assert_eq!(rec["state"], "running");
    rec["vmm"]["identity"]["pid"] = json!(nspid);
    rec["vmm"]["identity"]["start_time"] = json!(proc_start_time(h.root).unwrap());
    a.write_record(&id, &rec);
    let claim0 = a.claim_file(VF0).expect("claim");
    let type0 = a.vf_type(VF0);
    assert_ne!(type0, 0);
    let seq = last_seq(&a.state());

    a.spawn().unwrap();
    a.wait_ready().unwrap();
    let rep = a.pass();
    eprintln!("pass with the zombie leader: {rep}");
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["state"], "running", "A is alive: {got}\npass: {rep}");
    assert_eq!(a.claim_file(VF0), Some(claim0), "the claim is untouched");
    assert_eq!(a.vf_type(VF0), type0);
    let w: Vec<_> = log_after(&a.state(), seq).into_iter().filter(|e| e["op"] == "write").collect();
    assert!(w.is_empty(), "no sysfs write: {w:?}");
    assert_eq!(a.record(&id)["vmm"]["identity"]["pid"], nspid, "the record still names the helper");
    zombie_leader_intact(h.root).unwrap_or_else(|e| panic!("the helper got a signal: {e}"));

    // Once the whole thread group has gone, A is dead: stopped and released.
    h.kill();
    assert!(proc_state(h.root).is_none(), "the helper is gone");
    // (The simulator's teardown lag would make the first clear EBUSY.)
    wait_vf_idle(&a, VF0).expect("vf0 idle in the simulator");
    let rep = a.pass();
    let got = a.ok("instance.get", json!({"ref": "a"}));
    assert_eq!(got["state"], "stopped", "{got}\npass: {rep}");
    assert_eq!(a.vf_type(VF0), 0, "vf0 is released: {rep}");
    assert!(a.claim_file(VF0).is_none(), "{:?}", a.claims());
}
