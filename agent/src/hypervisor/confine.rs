//! # hypervisor::confine — what a VMM process may do
//!
//! Every VMM (QEMU or Cloud Hypervisor) starts as root from the agent and, between fork and
//! exec, after the hold-fd node is opened (it needs root), gives up everything else:
//!
//! 1. it joins its VM's cgroup (where cgroup v2 with the memory controller is writable:
//!    `memory.max` = the guest memory plus an overhead, `crate::host::cgroup`);
//! 2. it drops to the unprivileged [`VmmUser`] (`vmm_user`, default `gpuvisor-vmm`, created
//!    by `scripts/setup`): `setgroups` (its own group, plus `kvm` when that group exists, for
//!    `/dev/kvm`), `setresgid`, `setresuid` — moving every uid off 0 clears the permitted,
//!    effective and ambient capability sets (capabilities(7), "Effect of user ID changes on
//!    capabilities"), so the VMM holds no capability;
//! 3. it sets `no_new_privs` (`prctl(PR_SET_NO_NEW_PRIVS)`), so no exec can gain privileges
//!    again (a set-uid binary, file capabilities).
//!
//! QEMU's own seccomp sandbox (`-sandbox on,…=deny`, [`super::qemu`]) then denies obsolete
//! syscalls, privilege changes, fork/exec and affinity/priority changes.
//!
//! **Files.** The VMM owns nothing: [`prepare_run_dir`] makes the instance directory
//! `root:<vmm group>` mode `01770` — the VMM may create its sockets there, but the sticky bit
//! keeps it from removing or replacing any file it does not own (the agent's records) — and
//! the files the VMM writes (the serial log, a disk overlay, UEFI variables) stay root's,
//! group `<vmm group>`, mode `0660`. A file of the VMM's user can be replaced by the VMM,
//! so none is ever used: a symlink where such a file should be refuses the start. On a
//! host without vendor VFIO hold-fd, the VFIO group node is given to the VMM's group the
//! same way before the spawn ([`grant_device`]).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// The user VMMs run as when `vmm_user` says `root`: nobody is switched to.
pub const ROOT: &str = "root";

/// The unprivileged user a VMM runs as (resolved once, when the agent starts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmUser {
    /// Its name (`vmm_user`).
    pub name: String,
    /// Its uid (never 0).
    pub uid: u32,
    /// Its primary group.
    pub gid: u32,
    /// Every group it holds: the primary one, plus `kvm` when that group exists.
    pub groups: Vec<u32>,
}

impl VmmUser {
    /// The user `name` from the passwd database; `Ok(None)` for `root` (VMMs then run as the
    /// agent). Errors: a user that does not exist, cannot be read, or has uid 0.
    pub fn resolve(name: &str) -> Result<Option<VmmUser>, String> {
        if name == ROOT {
            return Ok(None);
        }
        let user = nix::unistd::User::from_name(name)
            .map_err(|e| format!("vmm_user {name:?} cannot be looked up: {e}"))?
            .ok_or_else(|| {
                format!(
                    "vmm_user {name:?} does not exist: create it (scripts/setup does: `useradd --system --user-group \
                     --no-create-home --shell /usr/sbin/nologin {name}`), or set vmm_user = \"root\" to run VMMs as \
                     root (not recommended)"
                )
            })?;
        if user.uid.is_root() {
            return Err(format!("vmm_user {name:?} has uid 0; use \"root\" to say so, or an unprivileged user"));
        }
        let gid = user.gid.as_raw();
        let mut groups = vec![gid];
        if let Ok(Some(kvm)) = nix::unistd::Group::from_name("kvm") {
            if kvm.gid.as_raw() != gid {
                groups.push(kvm.gid.as_raw());
            }
        }
        Ok(Some(VmmUser { name: name.to_string(), uid: user.uid.as_raw(), gid, groups }))
    }
}

/// Mode of the instance directory when the VMM runs unprivileged: the VMM's group may
/// create (its sockets) but, sticky, never remove or replace a file it does not own.
pub const RUN_DIR_MODE: u32 = 0o1770;

/// Mode of the files the VMM writes (group = the VMM's group).
pub const VMM_FILE_MODE: u32 = 0o660;

/// Gives `path` to the VMM's group as `mode` (owner root), refusing a symlink or a file of
/// another type than `dir` says (a file the VMM could have planted). A missing `path` is
/// created empty when `create` (a regular file), else left alone.
fn give_to_group(path: &Path, gid: u32, mode: u32, dir: bool, create: bool) -> std::io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            std::fs::OpenOptions::new().append(true).create_new(true).open(path)?;
            std::fs::symlink_metadata(path)?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let ft = meta.file_type();
    if ft.is_symlink() || (dir && !ft.is_dir()) || (!dir && !ft.is_file()) {
        return Err(std::io::Error::other(format!(
            "{} is not a {} (a VMM may have planted it)",
            path.display(),
            if dir { "directory" } else { "regular file" }
        )));
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

/// Makes `run_dir` `root:<vmm group>` [`RUN_DIR_MODE`] and each of `vmm_files`
/// `root:<vmm group>` [`VMM_FILE_MODE`]; those with `true` are created empty when missing
/// (the VMM may not create them itself: the serial log), the others are left alone when
/// missing. Without a VMM user, nothing changes. Errors: a symlink or a non-regular file
/// where one of them should be, or a failing chown/chmod.
pub fn prepare_run_dir(user: Option<&VmmUser>, run_dir: &Path, vmm_files: &[(&Path, bool)]) -> std::io::Result<()> {
    let Some(u) = user else { return Ok(()) };
    check_reachable(u, run_dir)?;
    give_to_group(run_dir, u.gid, RUN_DIR_MODE, true, false)?;
    for (f, create) in vmm_files {
        give_to_group(f, u.gid, VMM_FILE_MODE, false, *create)?;
    }
    Ok(())
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
/// beside it ([`private_dir`]), with a random name.
pub fn staging_path(dst: &Path) -> std::io::Result<std::path::PathBuf> {
    let parent = dst.parent().unwrap_or(Path::new("."));
    let base = dst.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(private_dir(parent)?.join(format!("{base}.{}.tmp", uuid::Uuid::new_v4().simple())))
}

/// Every directory above `dir` lets `user` search it (`x` for its uid, one of its groups, or
/// others): a data directory under a `0700` directory (e.g. a `mktemp -d`) would make every
/// VMM fail on its first open with a bare "Permission denied". Errors name the directory.
pub fn check_reachable(user: &VmmUser, dir: &Path) -> std::io::Result<()> {
    for a in dir.ancestors().skip(1) {
        let m = std::fs::metadata(a)?;
        let mode = m.mode();
        let ok = if m.uid() == user.uid {
            mode & 0o100 != 0
        } else if user.groups.contains(&m.gid()) {
            mode & 0o010 != 0
        } else {
            mode & 0o001 != 0
        };
        if !ok {
            return Err(std::io::Error::other(format!(
                "the VMM user {} cannot reach {}: {} is mode {:04o} (owner {}); give it o+x (or make the data \
                 directory elsewhere)",
                user.name,
                dir.display(),
                a.display(),
                mode & 0o7777,
                m.uid()
            )));
        }
    }
    Ok(())
}

/// Gives a device node (a VFIO group, `/dev/vfio/<N>`) to the VMM's group, mode 0660 —
/// what libvirt does for its `qemu` user. Without a VMM user, nothing changes.
pub fn grant_device(user: Option<&VmmUser>, node: &Path) -> std::io::Result<()> {
    let Some(u) = user else { return Ok(()) };
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
/// (write `0`: "the writing process"), drop to `user`, set `no_new_privs`. The data is
/// prepared here, before the fork; the closure only makes async-signal-safe calls.
pub(crate) fn add_pre_exec(
    cmd: &mut std::process::Command,
    user: Option<&VmmUser>,
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
    let ids = user.map(|u| (u.uid, u.gid, u.groups.iter().map(|g| *g as libc::gid_t).collect::<Vec<_>>()));
    // SAFETY: the closure runs in the child between fork and exec and only calls
    // async-signal-safe functions (open, write, close, setgroups, setresgid, setresuid,
    // prctl) on data allocated before the fork.
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

    #[test]
    fn root_means_no_switch_and_an_unknown_user_is_a_clear_error() {
        assert_eq!(VmmUser::resolve("root"), Ok(None));
        let err = VmmUser::resolve("gpuvisor-no-such-user").unwrap_err();
        assert!(err.contains("does not exist") && err.contains("useradd"), "{err}");
    }

    #[test]
    fn a_symlink_where_a_vmm_file_belongs_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"x").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = dir.path().join("serial.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let u = VmmUser { name: "x".into(), uid: 65534, gid: 65534, groups: vec![65534] };

        let err = prepare_run_dir(Some(&u), dir.path(), &[(&link, true)]).unwrap_err();

        assert!(err.to_string().contains("planted"), "{err}");
        let m = std::fs::metadata(&target).unwrap();
        assert_eq!((m.gid(), m.mode() & 0o777), (0, 0o600));
    }

    #[test]
    fn a_run_dir_under_a_0700_directory_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let run = dir.path().join("data/instances/x");
        std::fs::create_dir_all(&run).unwrap();
        let u = VmmUser { name: "gpuvisor-vmm".into(), uid: 65534, gid: 65534, groups: vec![65534] };

        let err = prepare_run_dir(Some(&u), &run, &[]).unwrap_err().to_string();

        assert!(
            err.contains("cannot reach") && err.contains(&format!("{} is mode 0700", dir.path().display())),
            "{err}"
        );
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare_run_dir(Some(&u), &run, &[]).unwrap();
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
        assert!(staging_path(&dir.path().join("seed.iso")).unwrap().starts_with(&p));
    }

    #[test]
    fn the_run_dir_is_sticky_for_the_vmm_group_and_its_files_root_owned_group_writable() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("serial.log");
        let u = VmmUser { name: "x".into(), uid: 65534, gid: 65534, groups: vec![65534] };

        prepare_run_dir(Some(&u), dir.path(), &[(&log, true)]).unwrap();

        let d = std::fs::metadata(dir.path()).unwrap();
        assert_eq!((d.uid(), d.gid(), d.mode() & 0o7777), (0, 65534, RUN_DIR_MODE));
        let f = std::fs::metadata(&log).unwrap();
        assert_eq!((f.uid(), f.gid(), f.mode() & 0o7777), (0, 65534, VMM_FILE_MODE));
    }
}
