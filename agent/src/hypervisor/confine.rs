//! # hypervisor::confine — what a VMM process may do and see
//!
//! Every VMM (QEMU or Cloud Hypervisor) starts as root from the agent and, between fork and
//! exec, after the hold-fd node is opened (it needs root and the host's view), gives up
//! everything else:
//!
//! 1. it joins its VM's cgroup (where cgroup v2 with the memory controller is writable:
//!    `memory.max` = the guest memory plus an overhead, `crate::host::cgroup`);
//! 2. it enters **its own view of the filesystem** ([`crate::host::vmm_view`]): a mount
//!    namespace whose root holds the system trees read-only, its image's files read-only,
//!    its device nodes and, writable, only its instance's VMM directory — nothing of another
//!    instance and none of the agent's records;
//! 3. it drops to **its own identity** ([`VmmIdentity`]: a uid and the same gid from
//!    `vmm_ids`, recorded with the instance, [`crate::instances::vmm_ids`]): `setgroups` (its
//!    gid, plus `kvm` when that group exists, for `/dev/kvm`), `setresgid`, `setresuid` —
//!    moving every uid off 0 clears the permitted, effective and ambient capability sets
//!    (capabilities(7), "Effect of user ID changes on capabilities"), so the VMM holds no
//!    capability;
//! 4. it sets `no_new_privs` (`prctl(PR_SET_NO_NEW_PRIVS)`), so no exec can gain privileges
//!    again (a set-uid binary, file capabilities).
//!
//! QEMU's own seccomp sandbox (`-sandbox on,…=deny`, [`super::qemu`]) then denies obsolete
//! syscalls, privilege changes, fork/exec and affinity/priority changes.
//!
//! **Files.** The instance directory is the agent's alone (`root:root 0700`: records, the
//! VMM log, the rotated console log, the seed's input hash). [`prepare_run_dir`] makes its
//! `vmm/` directory (the VMM's whole writable world) `root:<id>` mode `01770` — the VMM may
//! create its sockets there, but the sticky bit keeps it from removing or replacing any file
//! it does not own — and the files the VMM writes (the serial log, a disk overlay, UEFI
//! variables) stay root's, group `<id>`, mode `0660`. A name the VMM could have created is
//! never trusted ([`crate::own_file`]): a file that is not the agent's own where one of these
//! should be is removed and made again (the serial log) or refused. On a host without vendor
//! VFIO hold-fd, the VFIO group node is given to the VMM's group the same way before the
//! spawn ([`grant_device`]).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::host::vmm_view::{ViewSpec, VmmView};

/// The identity a VMM runs under: the uid and the same gid of its instance
/// (`vmm_ids`), plus the `kvm` group for `/dev/kvm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmIdentity {
    /// Its uid (never 0).
    pub uid: u32,
    /// Its primary group (the same number).
    pub gid: u32,
    /// Every group it holds: its own, plus `kvm` when that group exists.
    pub groups: Vec<u32>,
}

impl VmmIdentity {
    /// The identity of id `id` (uid = gid = `id`), with the `kvm` group when it exists.
    pub fn new(id: u32) -> VmmIdentity {
        let mut groups = vec![id];
        if let Ok(Some(kvm)) = nix::unistd::Group::from_name("kvm") {
            if kvm.gid.as_raw() != id {
                groups.push(kvm.gid.as_raw());
            }
        }
        VmmIdentity { uid: id, gid: id, groups }
    }
}

/// How one VMM is confined: who it runs as and what it sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    /// Its uid/gid.
    pub identity: VmmIdentity,
    /// Its view of the filesystem (the writable VMM directory is the spec's `run_dir`,
    /// added by [`super::process::spawn`]).
    pub view: ViewSpec,
}

/// The name of the VMM's directory inside an instance directory.
pub const VMM_DIR: &str = "vmm";

/// Mode of the VMM directory: the VMM's group may create (its sockets) but, sticky, never
/// remove or replace a file it does not own.
pub const RUN_DIR_MODE: u32 = 0o1770;

/// Mode of the instance directory: the agent's alone.
pub const INSTANCE_DIR_MODE: u32 = 0o700;

/// Mode of the files the VMM writes (group = the VMM's group).
pub const VMM_FILE_MODE: u32 = 0o660;

/// Mode of the files the VMM only reads (the cloud-init seed).
pub const VMM_READ_MODE: u32 = 0o440;

/// Gives the agent's own file `dir/name` to group `gid` as `mode` (owner root). Errors: it
/// is not the agent's own file ([`crate::own_file`]), or the chown/chmod fails.
pub fn give_to_group(dir: &Path, name: &str, gid: u32, mode: u32) -> std::io::Result<()> {
    let st = match crate::own_file::inspect(dir, name)? {
        crate::own_file::Entry::Own(st) => st,
        other => return Err(crate::own_file::foreign_error(dir, name, &other)),
    };
    let path = dir.join(name);
    if st.gid != gid {
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            &path,
            None,
            Some(nix::unistd::Gid::from_raw(gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(std::io::Error::from)?;
    }
    if st.mode & 0o7777 != mode {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// Sets a directory of the agent's (not a link) to `uid:gid` `mode`, making it when missing.
pub fn own_dir(path: &Path, gid: u32, mode: u32) -> std::io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir(path)?;
            std::fs::symlink_metadata(path)?
        }
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_dir() {
        return Err(std::io::Error::other(format!("{} is not a directory", path.display())));
    }
    if meta.uid() != 0 || meta.gid() != gid {
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            path,
            Some(nix::unistd::Uid::from_raw(0)),
            Some(nix::unistd::Gid::from_raw(gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(std::io::Error::from)?;
    }
    if meta.mode() & 0o7777 != mode {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// What [`prepare_run_dir`] replaced: `(file, what was there)`, for the caller's log.
pub type Replaced = Vec<(std::path::PathBuf, String)>;

/// Makes `instance_dir` the agent's alone ([`INSTANCE_DIR_MODE`]) and its `run_dir` (the VMM
/// directory, made when missing) `root:<gid>` [`RUN_DIR_MODE`], and gives each of
/// `vmm_files` (names in `run_dir`) to the VMM's group as [`VMM_FILE_MODE`]. A file of the
/// list that is not the agent's own ([`crate::own_file`]: a link, a FIFO, a file the VMM
/// made) is removed; those with `true` are then made empty (the serial log), the others
/// must have been made by the caller (a missing one is left alone; a foreign one is
/// removed and reported as an error). Returns what was replaced.
pub fn prepare_run_dir(
    identity: &VmmIdentity,
    instance_dir: &Path,
    run_dir: &Path,
    vmm_files: &[(&str, bool)],
) -> std::io::Result<Replaced> {
    own_dir(instance_dir, 0, INSTANCE_DIR_MODE)?;
    own_dir(run_dir, identity.gid, RUN_DIR_MODE)?;
    let mut replaced = Vec::new();
    for (name, create) in vmm_files {
        match crate::own_file::inspect(run_dir, name)? {
            crate::own_file::Entry::Own(_) => {}
            crate::own_file::Entry::Missing if !create => continue,
            crate::own_file::Entry::Missing => {}
            crate::own_file::Entry::Foreign(what) => {
                crate::own_file::remove(run_dir, name)?;
                replaced.push((run_dir.join(name), what.clone()));
                if !create {
                    return Err(std::io::Error::other(format!(
                        "{} was {what}, not the agent's own file (a VMM may have planted it); it was removed",
                        run_dir.join(name).display()
                    )));
                }
            }
        }
        if *create {
            match std::fs::OpenOptions::new().append(true).create_new(true).open(run_dir.join(name)) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        give_to_group(run_dir, name, identity.gid, VMM_FILE_MODE)?;
    }
    Ok(replaced)
}

/// The paths a VMM's view needs for `binary` to be executed by the name it is started by:
/// that name (looked up in `PATH` when it has no `/`) and its canonical path (a link's
/// target). Those inside the view's system trees are visible already
/// ([`crate::host::vmm_view::VmmView::plan`] skips them). Empty when it cannot be found (the
/// spawn then fails with the exec's error).
pub fn binary_paths(binary: &Path) -> Vec<std::path::PathBuf> {
    let found = if binary.as_os_str().as_bytes().contains(&b'/') {
        Some(binary.to_path_buf())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(binary))
                .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
        })
    };
    let Some(found) = found.filter(|f| f.is_absolute()) else { return Vec::new() };
    let mut paths = vec![found.clone()];
    if let Ok(c) = std::fs::canonicalize(&found) {
        if c != found {
            paths.push(c);
        }
    }
    paths
}

/// The system user that owns the reservation of `vmm_ids` in `/etc/subuid` and
/// `/etc/subgid` (made by `scripts/setup` and the package): no VMM runs as it.
pub const RESERVATION_OWNER: &str = "gpuvisor-vmm";

/// What in `<etc>/passwd`, `group`, `subuid` and `subgid` overlaps `ids`, one sentence per
/// entry: a user or group whose id is in the range, a subordinate range of any owner but
/// [`RESERVATION_OWNER`]. Files that do not exist count as empty. (Users from other NSS
/// sources, e.g. LDAP, are not seen: the operator reserves the range there.)
pub fn range_conflicts(ids: crate::config::VmmIds, etc: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let read = |f: &str| std::fs::read_to_string(etc.join(f)).unwrap_or_default();
    for (file, what) in [("passwd", "user"), ("group", "group")] {
        for line in read(file).lines() {
            let f: Vec<&str> = line.split(':').collect();
            if let Some(id) = f.get(2).and_then(|v| v.parse::<u32>().ok()) {
                if ids.contains(id) {
                    out.push(format!("{what} {} has id {id}, inside vmm_ids ({}…{})", f[0], ids.first, ids.last()));
                }
            }
        }
    }
    for file in ["subuid", "subgid"] {
        for line in read(file).lines() {
            let f: Vec<&str> = line.split(':').collect();
            let (Some(start), Some(count)) =
                (f.get(1).and_then(|v| v.parse::<u64>().ok()), f.get(2).and_then(|v| v.parse::<u64>().ok()))
            else {
                continue;
            };
            let end = start + count.max(1) - 1;
            if f[0] != RESERVATION_OWNER && start <= u64::from(ids.last()) && end >= u64::from(ids.first) {
                out.push(format!(
                    "/etc/{file} gives {} the ids {start}…{end}, which overlap vmm_ids ({}…{})",
                    f[0],
                    ids.first,
                    ids.last()
                ));
            }
        }
    }
    out
}

/// Whether `<etc>/subuid` and `<etc>/subgid` both reserve all of `ids` for
/// [`RESERVATION_OWNER`] (so `useradd` never hands those ids to a user's subordinate range).
pub fn range_reserved(ids: crate::config::VmmIds, etc: &Path) -> bool {
    ["subuid", "subgid"].iter().all(|file| {
        std::fs::read_to_string(etc.join(file)).unwrap_or_default().lines().any(|line| {
            let f: Vec<&str> = line.split(':').collect();
            let start = f.get(1).and_then(|v| v.parse::<u64>().ok());
            let count = f.get(2).and_then(|v| v.parse::<u64>().ok());
            matches!((f.first(), start, count), (Some(&o), Some(s), Some(c))
                if o == RESERVATION_OWNER && s <= u64::from(ids.first) && s + c > u64::from(ids.last()))
        })
    })
}

/// The name of the agent's private directory inside an instance directory.
pub const PRIVATE_DIR: &str = ".gpuvisor-private";

/// `<dir>/.gpuvisor-private`, root's alone (mode 0700), made when missing: where the agent
/// writes a file before renaming it into `dir` (an overlay, a seed). `dir` is writable by the
/// VMM user (any instance's VMM), so a temp name there could be a planted symlink that a
/// root write would follow; a file the VMM user placed where this directory belongs is
/// removed first.
pub fn private_dir(dir: &Path) -> std::io::Result<std::path::PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let p = dir.join(PRIVATE_DIR);
    for _ in 0..2 {
        match std::fs::DirBuilder::new().mode(0o700).create(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let m = std::fs::symlink_metadata(&p)?;
        if m.file_type().is_dir() && m.uid() == 0 && m.mode() & 0o077 == 0 {
            return Ok(p);
        }
        if m.file_type().is_dir() {
            std::fs::remove_dir_all(&p)?;
        } else {
            std::fs::remove_file(&p)?;
        }
    }
    Err(std::io::Error::other(format!("{} keeps being replaced", p.display())))
}

/// A fresh temp path for a file that will be renamed to `dst`: in the private directory
/// beside it ([`private_dir`]) — for a file of a VMM directory, the instance directory's
/// (the VMM never sees it) —, with a random name.
pub fn staging_path(dst: &Path) -> std::io::Result<std::path::PathBuf> {
    let mut parent = dst.parent().unwrap_or(Path::new("."));
    if parent.file_name().is_some_and(|n| n == VMM_DIR) {
        parent = parent.parent().unwrap_or(parent);
    }
    let base = dst.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(private_dir(parent)?.join(format!("{base}.{}.tmp", uuid::Uuid::new_v4().simple())))
}

/// Gives a device node (a VFIO group, `/dev/vfio/<N>`) to the VMM's own group, mode 0660 —
/// what libvirt does for its `qemu` user, per VM.
pub fn grant_device(identity: &VmmIdentity, node: &Path) -> std::io::Result<()> {
    let u = identity;
    let meta = std::fs::symlink_metadata(node)?;
    if meta.gid() != u.gid {
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            node,
            None,
            Some(nix::unistd::Gid::from_raw(u.gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(std::io::Error::from)?;
    }
    if meta.mode() & 0o060 != 0o060 {
        std::fs::set_permissions(node, std::fs::Permissions::from_mode((meta.mode() & 0o7777) | 0o060))?;
    }
    Ok(())
}

/// What the child does between fork and exec, after the hold-fd open: join `cgroup_procs`
/// (write `0`: "the writing process"), enter `view`, drop to `identity`, set
/// `no_new_privs`. The data is prepared here, before the fork; the closure only makes
/// async-signal-safe calls. Without an identity (unit tests of the drivers), only the
/// cgroup and `no_new_privs`.
pub(crate) fn add_pre_exec(
    cmd: &mut std::process::Command,
    identity: Option<&VmmIdentity>,
    view: Option<VmmView>,
    cgroup_procs: Option<&Path>,
) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let procs = match cgroup_procs {
        Some(p) => Some(
            CString::new(p.as_os_str().as_bytes())
                .map_err(|_| format!("the cgroup path {} contains a NUL byte", p.display()))?,
        ),
        None => None,
    };
    let ids = identity.map(|u| (u.uid, u.gid, u.groups.iter().map(|g| *g as libc::gid_t).collect::<Vec<_>>()));
    // SAFETY: the closure runs in the child between fork and exec and only calls
    // async-signal-safe functions (open, write, close, the view's mount calls, setgroups,
    // setresgid, setresuid, prctl) on data allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fail = || Err(std::io::Error::last_os_error());
            if let Some(p) = &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return fail();
                }
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if n != 1 {
                    return Err(err);
                }
            }
            if let Some(v) = &view {
                v.enter()?;
            }
            if let Some((uid, gid, groups)) = &ids {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0 {
                    return fail();
                }
                if libc::setresgid(*gid, *gid, *gid) != 0 {
                    return fail();
                }
                if libc::setresuid(*uid, *uid, *uid) != 0 {
                    return fail();
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return fail();
            }
            Ok(())
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident() -> VmmIdentity {
        VmmIdentity { uid: 1_879_048_192, gid: 1_879_048_192, groups: vec![1_879_048_192] }
    }

    #[test]
    fn a_link_planted_where_the_serial_log_belongs_is_replaced_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let inst = dir.path().join("i");
        let run = inst.join(VMM_DIR);
        std::fs::create_dir_all(&run).unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"x").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&target, run.join("serial.log")).unwrap();

        let replaced = prepare_run_dir(&ident(), &inst, &run, &[("serial.log", true)]).unwrap();

        assert_eq!(replaced, vec![(run.join("serial.log"), "a symbolic link".to_string())]);
        let m = std::fs::symlink_metadata(run.join("serial.log")).unwrap();
        assert!(m.file_type().is_file());
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777, m.len()), (0, ident().gid, VMM_FILE_MODE, 0));
        let t = std::fs::metadata(&target).unwrap();
        assert_eq!((t.gid(), t.mode() & 0o777), (0, 0o600), "the link's target is untouched");
    }

    #[test]
    fn a_plant_where_a_disk_belongs_is_removed_and_refused() {
        let dir = tempfile::tempdir().unwrap();
        let inst = dir.path().join("i");
        let run = inst.join(VMM_DIR);
        std::fs::create_dir_all(&run).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", run.join("disk.qcow2")).unwrap();

        let e = prepare_run_dir(&ident(), &inst, &run, &[("disk.qcow2", false)]).unwrap_err().to_string();

        assert!(e.contains("a symbolic link, not the agent's own file"), "{e}");
        assert!(std::fs::symlink_metadata(run.join("disk.qcow2")).is_err());
    }

    #[test]
    fn a_planted_private_dir_is_replaced_by_roots_own() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(PRIVATE_DIR)).unwrap();

        let p = private_dir(dir.path()).unwrap();

        let m = std::fs::symlink_metadata(&p).unwrap();
        assert!(m.file_type().is_dir() && m.mode() & 0o777 == 0o700);
        assert!(target.is_dir(), "the symlink's target is untouched");
        assert!(staging_path(&dir.path().join("seed.inputs")).unwrap().starts_with(&p));
        assert!(
            staging_path(&dir.path().join(VMM_DIR).join("seed.iso")).unwrap().starts_with(&p),
            "a file of the VMM directory is staged in the instance directory's private directory"
        );
    }

    #[test]
    fn users_groups_and_subordinate_ranges_inside_the_range_are_named_and_the_reservation_is_not() {
        let etc = tempfile::tempdir().unwrap();
        let ids = crate::config::VmmIds { first: 1000, count: 100 };
        let w = |f: &str, t: &str| std::fs::write(etc.path().join(f), t).unwrap();
        w("passwd", "root:x:0:0::/root:/bin/sh\nbob:x:1050:1050::/home/bob:/bin/sh\n");
        w("group", "bob:x:1050:\nkvm:x:994:\n");
        w("subuid", "gpuvisor-vmm:1000:100\nalice:1090:65536\n");
        w("subgid", "gpuvisor-vmm:1000:100\n");

        let c = range_conflicts(ids, etc.path());

        assert_eq!(c.len(), 3, "{c:?}");
        assert!(c[0].contains("user bob has id 1050"), "{c:?}");
        assert!(c[1].contains("group bob has id 1050"), "{c:?}");
        assert!(c[2].contains("/etc/subuid gives alice the ids 1090…66625"), "{c:?}");
        assert!(range_reserved(ids, etc.path()));
        assert!(!range_reserved(crate::config::VmmIds { first: 1000, count: 101 }, etc.path()));
        assert!(range_conflicts(ids, &etc.path().join("none")).is_empty());
    }

    #[test]
    fn the_instance_dir_is_the_agents_and_the_vmm_dir_sticky_for_the_vmms_own_group() {
        let dir = tempfile::tempdir().unwrap();
        let inst = dir.path().join("i");
        std::fs::create_dir(&inst).unwrap();
        std::fs::set_permissions(&inst, std::fs::Permissions::from_mode(0o1770)).unwrap();
        let run = inst.join(VMM_DIR);

        prepare_run_dir(&ident(), &inst, &run, &[("serial.log", true)]).unwrap();

        let i = std::fs::metadata(&inst).unwrap();
        assert_eq!((i.uid(), i.gid(), i.mode() & 0o7777), (0, 0, INSTANCE_DIR_MODE));
        let d = std::fs::metadata(&run).unwrap();
        assert_eq!((d.uid(), d.gid(), d.mode() & 0o7777), (0, ident().gid, RUN_DIR_MODE));
        let f = std::fs::metadata(run.join("serial.log")).unwrap();
        assert_eq!((f.uid(), f.gid(), f.mode() & 0o7777), (0, ident().gid, VMM_FILE_MODE));
    }
}
