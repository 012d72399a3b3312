//! Each VMM in its own box (docs/design/architecture.md "Isolation between VMs", docs/design/invariants.md I16),
//! shown rather than asserted, against the real agent, gpuvisor-sim and QEMU: a process
//! that *is* one instance's VMM as far as the kernel can tell — in its QEMU's mount
//! namespace (`nsenter`), with its uid, gid and groups and `no_new_privs` (`setpriv`) — tries
//! to read, write, open and connect to another instance's overlay, seed, UEFI variables,
//! console log, QMP and console sockets and device node, and to the agent's records, and
//! fails at each; as controls, the same process reads and appends to its own console log
//! and connects to its own QMP socket, and root reads the other instance's secret.
//!
//! Finding 2 and 8 of issue 18 are here too: nothing a VMM plants where the agent or the
//! CLI looks (a link at the seed's name with a forged input hash, a link, a FIFO or a
//! directory at the rotated console log's name) is followed, waited on or kept.

use gpuvisor_e2e::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const BOOT: Duration = Duration::from_secs(120);

/// The isolation tests' agents share nothing with their VMMs (no `vmm_shared_paths`).
fn agent() -> Agent {
    Agent::start_tuned(AgentOptions { model: HOST_V, ..Default::default() }, None, &[("vmm_shared_paths", "[]")])
        .unwrap()
}

/// The root-namespace pid of instance `id`'s QEMU.
fn qemu_pid(a: &Agent, id: &str) -> i32 {
    let q: Vec<LiveQemu> = a.live_qemus().into_iter().filter(|q| q.instance_id.as_deref() == Some(id)).collect();
    assert_eq!(q.len(), 1, "one QEMU of {id}");
    q[0].pid
}

/// `(uid, gid, groups)` of process `pid` (`/proc/<pid>/status`).
fn ids_of(pid: i32) -> (String, String, String) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |k: &str| -> Vec<String> {
        status.lines().find_map(|l| l.strip_prefix(k)).unwrap_or("").split_whitespace().map(str::to_string).collect()
    };
    (field("Uid:")[0].clone(), field("Gid:")[0].clone(), field("Groups:").join(","))
}

/// Runs `sh -c script` as QEMU `pid` would: in its mount namespace and root, with its uid,
/// gid and groups, no capabilities and `no_new_privs`. Its exit code and output.
fn as_vmm(pid: i32, script: &str) -> (i32, String) {
    let (uid, gid, groups) = ids_of(pid);
    let out = Command::new("nsenter")
        .args(["--target", &pid.to_string(), "--mount", "--root", "--wd", "--"])
        .args(["setpriv", &format!("--reuid={uid}"), &format!("--regid={gid}"), &format!("--groups={groups}")])
        .args(["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--", "/bin/sh", "-c", script])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// `sh` that prints `<label>=ok` or `<label>=fail` for each attempt.
fn attempts(list: &[(String, String)]) -> String {
    // Each attempt in a subshell: a failing redirection must not end the script.
    let body: String = list
        .iter()
        .map(|(label, cmd)| format!("if ({cmd}) >/dev/null 2>&1; then echo {label}=ok; else echo {label}=fail; fi\n"))
        .collect();
    format!("cd /\n{body}")
}

fn q(p: &Path) -> String {
    format!("'{}'", p.display())
}

/// Read, append-open, open (exists) and — for a socket — connect, for `p`.
fn every_access(name: &str, p: &Path, socket: bool) -> Vec<(String, String)> {
    let mut v = vec![
        (format!("{name}.exists"), format!("test -e {}", q(p))),
        (format!("{name}.read"), format!("cat {}", q(p))),
        (format!("{name}.write"), format!(": >>{}", q(p))),
    ];
    if socket {
        v.push((format!("{name}.connect"), format!("socat -u OPEN:/dev/null UNIX-CONNECT:{}", q(p))));
    }
    v
}

fn results(out: &str) -> Vec<(String, bool)> {
    out.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v == "ok")).collect()
}

#[test]
fn a_vmm_reaches_nothing_of_another_instance_nor_the_agents_records_and_all_of_its_own() {
    assert!(Path::new("/usr/bin/socat").is_file(), "socat (scripts/setup) connects to sockets");
    let a = agent();
    a.ok("image.import", json!({"name": "demo-disk", "disk": demo_disk_image().join("disk.qcow2")}));
    let secret = format!("secret-of-b-{}", std::process::id());
    // A: the "escaped" VMM. B: every kind of file an instance has.
    let va = a.create_gpu("a", "L40S-2Q").unwrap();
    let vb = a.ok(
        "instance.create",
        json!({"name": "b", "image": "demo-disk", "boot": "uefi", "gpu": "L40S-2Q",
               "nics": [{"mode": "user"}],
               "cloud_init": {"user_data": format!("#cloud-config\n# {secret}\n")}}),
    );
    let (ida, idb) = (va["id"].as_str().unwrap().to_string(), vb["id"].as_str().unwrap().to_string());
    let (pa, pb) = (qemu_pid(&a, &ida), qemu_pid(&a, &idb));

    // Each VMM runs under its own id from vmm_ids, as its record says.
    let (ua, ub) = (ids_of(pa).0, ids_of(pb).0);
    assert_ne!(ua, ub, "two VMMs, two uids");
    assert_eq!(a.record(&ida)["vmm_id"].to_string(), ua);
    assert_eq!(a.record(&idb)["vmm_id"].to_string(), ub);
    let range = 1_879_048_192u64..1_879_048_192 + 65_536;
    assert!(range.contains(&ua.parse().unwrap()) && range.contains(&ub.parse().unwrap()));

    let vmm_b = a.data_dir.join("instances").join(&idb).join("vmm");
    let files_b = [
        ("b.overlay", vmm_b.join("disk.qcow2"), false),
        ("b.seed", vmm_b.join("seed.iso"), false),
        ("b.efivars", vmm_b.join("efivars.fd"), false),
        ("b.serial", vmm_b.join("serial.log"), false),
        ("b.qmp", vmm_b.join("qmp.sock"), true),
        ("b.console", vmm_b.join("console.sock"), true),
    ];
    // Control: they exist, and B's seed holds the secret (root reads it).
    for (_, p, _) in &files_b {
        assert!(std::fs::symlink_metadata(p).is_ok(), "{} exists", p.display());
    }
    let seed = std::fs::read(vmm_b.join("seed.iso")).unwrap();
    assert!(String::from_utf8_lossy(&seed).contains(&secret), "the secret is in B's seed");

    let mut tries: Vec<(String, String)> = Vec::new();
    for (name, p, socket) in &files_b {
        tries.extend(every_access(name, p, *socket));
    }
    let records = [
        ("rec.a", a.data_dir.join("instances").join(&ida).join("instance.json")),
        ("rec.b", a.data_dir.join("instances").join(&idb).join("instance.json")),
        ("rec.qemu-log-a", a.data_dir.join("instances").join(&ida).join("qemu.log")),
        ("rec.claims", a.data_dir.join("claims")),
        ("rec.names", a.data_dir.join("names")),
        ("rec.vmm-ids", a.data_dir.join("vmm-ids")),
        ("rec.images", a.data_dir.join("images/demo-disk/image.toml")),
        ("rec.lock", a.data_dir.join("lock")),
    ];
    for (name, p) in &records {
        tries.extend(every_access(name, p, false));
    }
    // B's device node (the simulated host's VFIO group) and the host's /proc of B.
    let group_b = a.ok("instance.get", json!({"ref": "b"}))["gpu"]["device"].as_str().unwrap().to_string();
    tries.push(("b.sysfs".into(), format!("ls {}", q(&a.sim.path().join("sys/bus/pci/devices").join(&group_b)))));
    tries.push(("b.proc".into(), format!("ls /proc/{pb}/root")));
    tries.push(("b.signal".into(), format!("kill -0 {pb}")));

    let (_, out) = as_vmm(pa, &attempts(&tries));
    let got = results(&out);
    assert_eq!(got.len(), tries.len(), "every attempt ran: {out}");
    let reached: Vec<&String> = got.iter().filter(|(_, ok)| *ok).map(|(k, _)| k).collect();
    assert!(reached.is_empty(), "A's VMM reached {reached:?} (of B or of the agent):\n{out}");

    // What A sees of the data directory: only the path to its own VMM directory and its
    // image's files (read-only).
    for (dir, want) in [
        (a.data_dir.clone(), "images\ninstances"),
        (a.data_dir.join("images"), "demo"),
        (a.data_dir.join("images/demo"), "initrd.img\nvmlinuz"),
        (a.data_dir.join("instances"), ida.as_str()),
        (a.data_dir.join("instances").join(&ida), "vmm"),
    ] {
        let (code, out) = as_vmm(pa, &format!("ls -A {}", q(&dir)));
        assert_eq!((code, out.trim()), (0, want), "A's view of {}", dir.display());
    }

    // The same accesses from the host's view (A's uid without the mount namespace): the
    // permissions alone refuse them too.
    let (uid, gid, groups) = ids_of(pa);
    let host = Command::new("setpriv")
        .args([&format!("--reuid={uid}"), &format!("--regid={gid}"), &format!("--groups={groups}"), "--no-new-privs"])
        .args(["--", "/bin/sh", "-c", &attempts(&tries[..tries.len() - 3])])
        .output()
        .unwrap();
    let host_out = String::from_utf8_lossy(&host.stdout).into_owned();
    let reached: Vec<String> = results(&host_out).into_iter().filter(|(_, ok)| *ok).map(|(k, _)| k).collect();
    assert!(reached.is_empty(), "A's uid reached {reached:?} through the host's paths:\n{host_out}");

    // Controls: A reads and appends to its own console log and connects to its own QMP
    // socket; its kernel is there read-only.
    let vmm_a = a.data_dir.join("instances").join(&ida).join("vmm");
    let own = [
        ("own.serial.read".to_string(), format!("cat {}", q(&vmm_a.join("serial.log")))),
        ("own.serial.append".to_string(), format!(": >>{}", q(&vmm_a.join("serial.log")))),
        ("own.qmp.connect".to_string(), format!("socat -u OPEN:/dev/null UNIX-CONNECT:{}", q(&vmm_a.join("qmp.sock")))),
        ("own.kernel.read".to_string(), format!("cat {}", q(&a.data_dir.join("images/demo/vmlinuz")))),
    ];
    let (_, out) = as_vmm(pa, &attempts(&own));
    assert!(results(&out).iter().all(|(_, ok)| *ok) && results(&out).len() == own.len(), "A's own files: {out}");
    let (_, out) = as_vmm(
        pa,
        &attempts(&[("own.kernel.write".into(), format!(": >>{}", q(&a.data_dir.join("images/demo/vmlinuz"))))]),
    );
    assert!(out.contains("own.kernel.write=fail"), "the image is read-only for A: {out}");

    // Both VMs keep running and stop as usual.
    for n in ["a", "b"] {
        assert_eq!(a.ok("instance.stop", json!({"ref": n, "force": true}))["state"], "stopped");
    }
    assert!(a.claims().is_empty());
}

/// Finding 2: a seed that went missing, a link planted at its name (by the VMM, in its
/// directory) to a file it chose, and a forged input hash beside it: the next start builds
/// the agent's own seed; QEMU never opens the link's target.
#[test]
fn a_planted_seed_link_with_a_forged_hash_is_replaced_and_never_opened() {
    let a = agent();
    let v =
        a.ok("instance.create", json!({"name": "s", "image": "demo", "cloud_init": {"user_data": "#cloud-config\n"}}));
    let id = v["id"].as_str().unwrap().to_string();
    let seed = PathBuf::from(v["seed"]["path"].as_str().unwrap());
    let vmm_dir = seed.parent().unwrap().to_path_buf();
    // A file the VMM chose (readable by anyone: before the fix QEMU opened it as the seed).
    let target = vmm_reachable_tempdir("gpuvisor-chosen.").unwrap();
    let secret = target.path().join("chosen");
    std::fs::write(&secret, "chosen by the VMM").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let hash = std::fs::read_to_string(vmm_dir.parent().unwrap().join("seed.inputs"))
        .or_else(|_| std::fs::read_to_string(vmm_dir.join("seed.inputs")))
        .unwrap();
    // The seed goes missing (with its hash, where the old layout kept it beside the seed);
    // the VMM (in its own view, as its own uid) plants the link and a forged hash in its
    // directory.
    std::fs::remove_file(&seed).unwrap();
    let _ = std::fs::remove_file(vmm_dir.join("seed.inputs"));
    let plant = format!(
        "ln -s {} {} && printf %s '{}' >{}",
        q(&secret),
        q(&seed),
        hash.trim(),
        q(&vmm_dir.join("seed.inputs"))
    );
    let (code, out) = as_vmm(qemu_pid(&a, &id), &plant);
    assert_eq!(code, 0, "the VMM can create names in its directory: {out}");
    a.ok("instance.stop", json!({"ref": "s", "force": true}));

    let v = a.ok("instance.start", json!({"ref": "s"}));
    let pid = qemu_pid(&a, &id);
    let fds: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .collect();
    assert!(!fds.iter().any(|f| f == &secret), "BUG: QEMU opened the planted link's target: {fds:?}");
    let m = std::fs::symlink_metadata(&seed).unwrap();
    assert!(m.file_type().is_file(), "the seed is a regular file again, not the planted link");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&m), 0, "the agent's own");
    a.wait_serial(&v, "gpuvisor-guest: ready", BOOT).unwrap();
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "chosen by the VMM");
}

/// Finding 8: `console --log` prints only the agent's own logs: a link the VMM planted
/// where the rotated log used to be (its directory) is not followed; a link, a FIFO or a
/// directory at the names the CLI reads is refused at once, printing nothing of a target.
#[test]
fn console_log_never_follows_a_planted_link_nor_waits_on_a_fifo() {
    let a = agent();
    let v = a.ok("instance.create", json!({"name": "c", "image": "demo"}));
    let id = v["id"].as_str().unwrap().to_string();
    a.wait_serial(&v, "gpuvisor-guest: ready", BOOT).unwrap();
    let pid = qemu_pid(&a, &id);
    let serial = PathBuf::from(v["serial_log"].as_str().unwrap());
    let vmm_dir = serial.parent().unwrap().to_path_buf();
    let secret_dir = vmm_reachable_tempdir("gpuvisor-secret.").unwrap();
    let secret = secret_dir.path().join("secret");
    std::fs::write(&secret, "TOP-SECRET-ROOT-ONLY").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    // The VMM plants, in its own view and as its own uid.
    let as_uid = |script: &str| {
        let (code, out) = as_vmm(pid, script);
        assert_eq!(code, 0, "{script}: {out}");
    };
    let console_log = || {
        let mut c = Command::new(agent_binary());
        c.args(["--socket", a.socket.to_str().unwrap(), "console", "c", "--log"]).stdin(Stdio::null());
        let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        wait_output(child, Duration::from_secs(20))
    };

    // The VMM plants a link at serial.log.1 in its directory (where the log was rotated to).
    as_uid(&format!("ln -s {} {}", q(&secret), q(&vmm_dir.join("serial.log.1"))));
    let (ok, out) = console_log().expect("console --log answers");
    assert!(!out.contains("TOP-SECRET"), "BUG: console --log printed a file the VMM pointed it to:\n{out}");
    assert!(ok && out.contains("gpuvisor-guest: ready"), "the log itself is printed: {out}");
    std::fs::remove_file(vmm_dir.join("serial.log.1")).unwrap();

    // A FIFO there: no hang.
    as_uid(&format!("mkfifo {}", q(&vmm_dir.join("serial.log.1"))));
    assert!(console_log().is_some(), "BUG: console --log hangs on a FIFO the VMM planted");
    std::fs::remove_file(vmm_dir.join("serial.log.1")).unwrap();

    // At the names the CLI reads (the log made to go missing and a plant in its place, by
    // root here: no VMM runs): refused with a clear error, nothing of the target printed.
    a.ok("instance.stop", json!({"ref": "c", "force": true}));
    std::fs::remove_file(&serial).unwrap();
    std::os::unix::fs::symlink(&secret, &serial).unwrap();
    let (ok, out) = console_log().expect("console --log answers");
    assert!(!ok && !out.contains("TOP-SECRET"), "{out}");
    assert!(out.contains("is a symbolic link, not the agent's own file"), "{out}");
    std::fs::remove_file(&serial).unwrap();
    assert!(Command::new("mkfifo").arg(&serial).status().unwrap().success());
    let (ok, out) = console_log().expect("BUG: console --log hangs on a FIFO at serial.log");
    assert!(!ok && out.contains("is a FIFO, not the agent's own file"), "{out}");

    // The next start replaces the plant by the agent's own log.
    a.ok("instance.start", json!({"ref": "c"}));
    assert!(std::fs::symlink_metadata(&serial).unwrap().file_type().is_file());
}

/// `(exit status success, stdout + stderr)` of `child`, or `None` (it is killed) when it
/// has not exited within `timeout`.
fn wait_output(mut child: std::process::Child, timeout: Duration) -> Option<(bool, String)> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            let out = child.wait_with_output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            return Some((out.status.success(), text));
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Finding 8: a directory the VMM planted where the rotated log went (its directory)
/// no longer stops rotation: `serial.log` stays under the cap while the guest floods it.
#[test]
fn a_planted_directory_never_stops_console_log_rotation() {
    let a = Agent::start_tuned(
        AgentOptions { model: HOST_V, ..Default::default() },
        None,
        &[("vmm_shared_paths", "[]"), ("console_log_max_bytes", "65536")],
    )
    .unwrap();
    let v = a.ok("instance.create", json!({"name": "f", "image": "demo"}));
    let id = v["id"].as_str().unwrap().to_string();
    a.wait_serial(&v, "gpuvisor-guest: ready", BOOT).unwrap();
    let serial = PathBuf::from(v["serial_log"].as_str().unwrap());
    let vmm_dir = serial.parent().unwrap().to_path_buf();
    // The VMM plants a directory where the rotated log went (its directory).
    let (code, out) = as_vmm(qemu_pid(&a, &id), &format!("mkdir -p {}/x", q(&vmm_dir.join("serial.log.1"))));
    assert_eq!(code, 0, "{out}");
    // A console flood: 256 KiB appended to the log QEMU appends to (as the guest's output
    // would be; the rotation does not care who wrote it).
    let rotated = PathBuf::from(v["serial_log_rotated"].as_str().unwrap_or("serial_log_rotated missing"));
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(&serial).unwrap();
        for i in 0..4096 {
            writeln!(f, "flood-line-{i:05}-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx").unwrap();
        }
    }
    // Rotation runs every 0.5 s: it brings the log under the cap.
    wait_for(Duration::from_secs(30), || (std::fs::metadata(&serial).unwrap().len() <= 65536).then_some(()))
        .unwrap_or_else(|| panic!("BUG: serial.log stays {} bytes", std::fs::metadata(&serial).unwrap().len()));
    assert!(rotated.is_file(), "the log was rotated to {}", rotated.display());
}

/// Finding 2 (disks): a link the VMM planted where an overlay would be (its instance has
/// none: the image has no disk) is never followed by a fork's copy; the fork gets nothing
/// of the link's target.
#[test]
fn a_fork_never_copies_what_a_vmm_planted_at_a_disks_name() {
    let a = agent();
    let v = a.ok("instance.create", json!({"name": "src", "image": "demo"}));
    let id = v["id"].as_str().unwrap().to_string();
    let vmm_dir = PathBuf::from(v["serial_log"].as_str().unwrap()).parent().unwrap().to_path_buf();
    let secret_dir = vmm_reachable_tempdir("gpuvisor-secret.").unwrap();
    let secret = secret_dir.path().join("secret");
    std::fs::write(&secret, "TOP-SECRET-ROOT-ONLY").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    // The VMM plants, in its own view and as its own uid, a link where an overlay would be.
    let (code, out) = as_vmm(qemu_pid(&a, &id), &format!("ln -s {} {}", q(&secret), q(&vmm_dir.join("disk.qcow2"))));
    assert_eq!(code, 0, "the VMM can create names in its directory: {out}");
    a.ok("instance.stop", json!({"ref": "src", "force": true}));

    let f = a.ok("instance.fork", json!({"ref": "src", "name": "copy"}));
    let fork_dir = a.data_dir.join("instances").join(f["id"].as_str().unwrap());
    for p in [fork_dir.join("vmm/disk.qcow2"), fork_dir.join("disk.qcow2")] {
        let copied = std::fs::read(&p).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&copied).contains("TOP-SECRET"),
            "BUG: the fork copied the target of a link the VMM planted to {}",
            p.display()
        );
    }
}

/// Finding 9: a kernel and initrd imported from `0600` files (as in a typical `/boot`)
/// boot: the import makes them readable for the VMMs, which never run as root.
#[test]
fn an_image_imported_from_0600_files_boots() {
    use std::os::unix::fs::PermissionsExt;
    let a = agent();
    let src = vmm_reachable_tempdir("gpuvisor-boot.").unwrap();
    let demo = demo_image();
    for f in ["vmlinuz", "initrd.img"] {
        std::fs::copy(demo.join(f), src.path().join(f)).unwrap();
        std::fs::set_permissions(src.path().join(f), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let cmdline = std::fs::read_to_string(demo.join("cmdline")).unwrap_or_default();
    a.ok(
        "image.import",
        json!({"name": "boot600", "kernel": src.path().join("vmlinuz"), "initrd": src.path().join("initrd.img"),
               "cmdline": cmdline.trim()}),
    );
    let v = a.ok("instance.create", json!({"name": "k", "image": "boot600"}));
    a.wait_serial(&v, "gpuvisor-guest: ready", BOOT)
        .expect("BUG: a VM of an image imported from 0600 files cannot boot");
    // A file that is no kernel is refused at import, naming it.
    std::fs::write(src.path().join("notes.txt"), "not a kernel\n").unwrap();
    let e = a.err("image.import", json!({"name": "bad", "kernel": src.path().join("notes.txt")}));
    assert_eq!(e.data_code, "invalid_request", "{e}");
    assert!(e.message.contains("notes.txt") && e.message.contains("bzImage"), "{e}");
}
