//! # host::vmm_view — the VMM's view of the filesystem (its own mount namespace)
//!
//! Every VMM sees only what it needs, Firecracker's jailer being the model
//! (docs/design/architecture.md "Isolation between VMs"): [`VmmView::plan`] turns a [`ViewSpec`] into
//! prepared steps (every path a `CString`, every directory to make listed) **before the
//! fork**; [`VmmView::enter`] runs them in the child between fork and exec using only
//! async-signal-safe system calls:
//!
//! 1. `unshare(CLONE_NEWNS | CLONE_NEWIPC)`; `/` becomes `MS_REC | MS_PRIVATE`, so nothing
//!    done here reaches the host;
//! 2. a small tmpfs on `root` (an empty directory of the agent's; mounted only in the
//!    child's namespace);
//! 3. in it, at the **same absolute paths** as on the host (so command lines, socket paths
//!    in `/proc/net/unix` and the agent's liveness checks stay as they are): the system
//!    trees read-only (`/usr`; `/bin`, `/lib`… as the links or directories they are; a few
//!    `/etc` files the dynamic linker and user-mode networking read), the read-only files
//!    (kernel, initrd, base disk, firmware, binary), the device nodes, the writable
//!    directory (the instance's VMM directory) and the shared paths (`vmm_shared_paths`,
//!    host permissions);
//! 4. `pivot_root(".", ".")`, the old root detached, `/` remounted read-only.
//!
//! Nothing else exists in the view: no `/proc`, no `/sys` (except the device directories of
//! `vfio_attach = "device"`), no `/tmp`, no other instance and none of the agent's records.
//! A step that fails writes one line naming it to fd 2 (the VMM log) before the spawn fails
//! with its errno.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// The host trees every view shows read-only (or as the symbolic links they are).
pub const SYSTEM_TREES: &[&str] = crate::config::VIEW_SYSTEM_TREES;

/// The `/etc` files a view shows read-only when they exist: the dynamic linker's cache,
/// and what QEMU's user-mode networking reads for its DNS forwarder.
pub const ETC_FILES: &[&str] =
    &["/etc/ld.so.cache", "/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/host.conf", "/etc/localtime"];

/// The device nodes every view has (those that exist on the host).
pub const BASE_DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"];

/// What one VMM's view holds, besides [`SYSTEM_TREES`], [`ETC_FILES`] and
/// [`BASE_DEVICES`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ViewSpec {
    /// An empty directory of the agent's: the view's tmpfs is mounted on it (in the child's
    /// namespace only), then becomes its `/`.
    pub root: PathBuf,
    /// Read-write, `nosuid,nodev,noexec`: the instance's VMM directory.
    pub writable: Vec<PathBuf>,
    /// Read-only, `nosuid,nodev,noexec`: kernel, initrd, the image's disk, firmware.
    pub read_only: Vec<PathBuf>,
    /// Read-only, `nosuid,nodev`, executable: the VMM binary (both the name it is started by
    /// and its canonical path, when they lie outside the system trees).
    pub executables: Vec<PathBuf>,
    /// Device nodes (`nosuid,noexec`): `/dev/kvm`, VFIO nodes.
    pub devices: Vec<PathBuf>,
    /// Read-only, `nosuid,nodev,noexec` directories: a VFIO device's sysfs directories.
    pub read_only_dirs: Vec<PathBuf>,
    /// `nosuid,nodev`, with the host's permissions: `vmm_shared_paths`.
    pub shared: Vec<PathBuf>,
}

/// How a bind is mounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindKind {
    /// A system tree: read-only, `nosuid,nodev`.
    System,
    /// A data file or directory: read-only, `nosuid,nodev,noexec`.
    ReadOnly,
    /// The binary: read-only, `nosuid,nodev`.
    Executable,
    /// A device node: read-only mount (the node stays writable), `nosuid,noexec`.
    Device,
    /// The VMM's own directory: `nosuid,nodev,noexec`.
    Writable,
    /// A shared path: `nosuid,nodev`.
    Shared,
}

impl BindKind {
    fn flags(self) -> libc::c_ulong {
        use libc::{MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_RDONLY};
        match self {
            BindKind::System | BindKind::Executable => MS_RDONLY | MS_NOSUID | MS_NODEV,
            BindKind::ReadOnly => MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
            BindKind::Device => MS_RDONLY | MS_NOSUID | MS_NOEXEC,
            BindKind::Writable => MS_NOSUID | MS_NODEV | MS_NOEXEC,
            BindKind::Shared => MS_NOSUID | MS_NODEV,
        }
    }
}

/// One planned step, as the child runs it (paths inside the view's tmpfs, i.e. under `root`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Mkdir(CString),
    Touch(CString),
    Symlink { target: CString, link: CString },
    Bind { src: CString, dst: CString, dir: bool, flags: libc::c_ulong },
}

/// One entry of the view as [`VmmView::entries`] lists it (for logs and tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewEntry {
    /// A bind of the host path of the same name.
    Bind(PathBuf, BindKind),
    /// A symbolic link (`/lib -> usr/lib`).
    Symlink(PathBuf, PathBuf),
}

/// A planned view, ready for [`VmmView::enter`] in a forked child.
#[derive(Debug, Clone)]
pub struct VmmView {
    root: CString,
    steps: Vec<Step>,
    /// One line per step, for the error line in the child: "gpuvisor: the VMM's view cannot
    /// be made: <what>: errno ".
    what: Vec<CString>,
    entries: Vec<ViewEntry>,
}

fn cstring(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other(format!("{} contains a NUL byte", p.display())))
}

/// `path` with `.` removed; `None` for a relative path or one with `..` (never mirrored).
fn normal(path: &Path) -> Option<PathBuf> {
    if !path.is_absolute() {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => out.push(n),
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

impl VmmView {
    /// Plans the view of `spec`. Paths that do not exist on the host are left out (a
    /// missing optional `/etc` file), except the writable and read-only ones the VMM needs
    /// (an error naming the path). A path already visible through an earlier bind (a file
    /// under `/usr`, a binary inside a shared directory) is not bound again.
    ///
    /// Errors: a needed path is missing, relative or holds `..`, or a path has a NUL byte.
    pub fn plan(spec: &ViewSpec) -> std::io::Result<VmmView> {
        let mut binds: Vec<(PathBuf, BindKind, bool)> = Vec::new();
        let mut symlinks: Vec<(PathBuf, PathBuf)> = Vec::new();
        for t in SYSTEM_TREES {
            let p = Path::new(t);
            match std::fs::symlink_metadata(p) {
                Ok(m) if m.file_type().is_symlink() => symlinks.push((p.to_path_buf(), std::fs::read_link(p)?)),
                Ok(m) if m.is_dir() && *t != "/etc" => binds.push((p.to_path_buf(), BindKind::System, true)),
                _ => {}
            }
        }
        for f in ETC_FILES.iter().map(Path::new).filter(|f| f.exists()) {
            binds.push((f.to_path_buf(), BindKind::System, false));
        }
        for d in BASE_DEVICES.iter().map(Path::new).filter(|d| d.exists()) {
            binds.push((d.to_path_buf(), BindKind::Device, false));
        }
        let needed = |p: &Path, what: &str| -> std::io::Result<(PathBuf, bool)> {
            let n = normal(p).ok_or_else(|| {
                std::io::Error::other(format!("{what} {} is not an absolute path without `..`", p.display()))
            })?;
            let m = std::fs::metadata(&n).map_err(|e| std::io::Error::other(format!("{what} {}: {e}", n.display())))?;
            Ok((n, m.is_dir()))
        };
        for (list, kind, what) in [
            (&spec.writable, BindKind::Writable, "the VMM directory"),
            (&spec.read_only, BindKind::ReadOnly, "the read-only file"),
            (&spec.read_only_dirs, BindKind::ReadOnly, "the device directory"),
            (&spec.executables, BindKind::Executable, "the VMM binary"),
            (&spec.devices, BindKind::Device, "the device node"),
            (&spec.shared, BindKind::Shared, "the shared path (vmm_shared_paths)"),
        ] {
            for p in list {
                let (n, dir) = needed(p, what)?;
                binds.push((n, kind, dir));
            }
        }
        // Parents before children; a path under an earlier bind is visible already.
        binds.sort_by_key(|(p, _, _)| p.components().count());
        let mut kept: Vec<(PathBuf, BindKind, bool)> = Vec::new();
        for b in binds {
            let under_link = symlinks.iter().any(|(l, _)| b.0.starts_with(l));
            if under_link
                || kept.iter().any(|(k, _, dir)| *dir && b.0.starts_with(k))
                || kept.iter().any(|k| k.0 == b.0)
            {
                continue;
            }
            kept.push(b);
        }

        let root = normal(&spec.root)
            .ok_or_else(|| std::io::Error::other(format!("the view root {} is not absolute", spec.root.display())))?;
        let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap_or(p));
        let mut steps = Vec::new();
        let mut what = Vec::new();
        let mut made: Vec<PathBuf> = Vec::new();
        let mut step = |s: Step, w: String, steps: &mut Vec<Step>| -> std::io::Result<()> {
            steps.push(s);
            what.push(CString::new(format!("gpuvisor: the VMM's view cannot be made: {w}: errno "))?);
            Ok(())
        };
        let mut entries = Vec::new();
        for (link, target) in &symlinks {
            step(
                Step::Symlink { target: cstring(target)?, link: cstring(&inside(link))? },
                format!("symlink {}", link.display()),
                &mut steps,
            )?;
            entries.push(ViewEntry::Symlink(link.clone(), target.clone()));
        }
        for (p, kind, dir) in &kept {
            // Every ancestor as a directory of the tmpfs, then the mount point.
            let mut anc: Vec<&Path> = p.ancestors().skip(1).filter(|a| *a != Path::new("/")).collect();
            anc.reverse();
            for a in anc {
                if !made.iter().any(|m| m == a) {
                    step(Step::Mkdir(cstring(&inside(a))?), format!("mkdir {}", a.display()), &mut steps)?;
                    made.push(a.to_path_buf());
                }
            }
            let dst = cstring(&inside(p))?;
            if *dir {
                step(Step::Mkdir(dst.clone()), format!("mkdir {}", p.display()), &mut steps)?;
                made.push(p.clone());
            } else {
                step(Step::Touch(dst.clone()), format!("create {}", p.display()), &mut steps)?;
            }
            step(
                Step::Bind { src: cstring(p)?, dst, dir: *dir, flags: kind.flags() },
                format!("bind {}", p.display()),
                &mut steps,
            )?;
            entries.push(ViewEntry::Bind(p.clone(), *kind));
        }
        Ok(VmmView { root: cstring(&root)?, steps, what, entries })
    }

    /// What the view holds (binds and links), in the order they are made.
    pub fn entries(&self) -> &[ViewEntry] {
        &self.entries
    }

    /// Makes the view and enters it (see the module docs). **Only for a forked child
    /// between fork and exec**: it changes the calling process's mount namespace and root.
    /// Calls only async-signal-safe functions and allocates nothing.
    ///
    /// # Safety
    /// Must run in a single-threaded child (a `pre_exec` hook) with fd 2 open.
    pub unsafe fn enter(&self) -> std::io::Result<()> {
        let fail = |what: &[u8]| -> std::io::Error {
            let e = std::io::Error::last_os_error();
            // SAFETY: write(2) of valid buffers is async-signal-safe.
            unsafe {
                libc::write(2, what.as_ptr().cast(), what.len());
                write_errno(e.raw_os_error().unwrap_or(0));
            }
            e
        };
        let root = self.root.as_ptr();
        let none = std::ptr::null::<libc::c_char>();
        // SAFETY: (the whole block) every pointer is a NUL-terminated string prepared before
        // the fork, or null where the call allows it.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWIPC) != 0 {
                return Err(fail(b"gpuvisor: the VMM's view cannot be made: unshare: errno "));
            }
            if libc::mount(none, c"/".as_ptr(), none, libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) != 0 {
                return Err(fail(b"gpuvisor: the VMM's view cannot be made: make / private: errno "));
            }
            if libc::mount(
                c"gpuvisor-vmm-view".as_ptr(),
                root,
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755,size=1m,nr_inodes=4096".as_ptr().cast(),
            ) != 0
            {
                return Err(fail(b"gpuvisor: the VMM's view cannot be made: mount the tmpfs: errno "));
            }
            for (s, what) in self.steps.iter().zip(&self.what) {
                let ok = match s {
                    Step::Mkdir(p) => {
                        libc::mkdir(p.as_ptr(), 0o755) == 0
                            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST)
                    }
                    Step::Touch(p) => {
                        let fd = libc::open(p.as_ptr(), libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC, 0o644);
                        fd >= 0 && libc::close(fd) == 0
                    }
                    Step::Symlink { target, link } => libc::symlink(target.as_ptr(), link.as_ptr()) == 0,
                    Step::Bind { src, dst, dir, flags } => {
                        let rec = if *dir { libc::MS_REC } else { 0 };
                        libc::mount(src.as_ptr(), dst.as_ptr(), none, libc::MS_BIND | rec, std::ptr::null()) == 0
                            && libc::mount(
                                none,
                                dst.as_ptr(),
                                none,
                                libc::MS_BIND | libc::MS_REMOUNT | flags,
                                std::ptr::null(),
                            ) == 0
                    }
                };
                if !ok {
                    return Err(fail(what.as_bytes()));
                }
            }
            if libc::chdir(root) != 0 {
                return Err(fail(b"gpuvisor: the VMM's view cannot be made: chdir: errno "));
            }
            if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0 {
                return Err(fail(b"gpuvisor: the VMM's view cannot be made: pivot_root: errno "));
            }
            if libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0 {
                return Err(fail(b"gpuvisor: the VMM's view cannot be made: detach the old root: errno "));
            }
            if libc::chdir(c"/".as_ptr()) != 0 {
                return Err(fail(b"gpuvisor: the VMM's view cannot be made: chdir /: errno "));
            }
            if libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
                std::ptr::null(),
            ) != 0
            {
                return Err(fail(b"gpuvisor: the VMM's view cannot be made: remount / read-only: errno "));
            }
        }
        Ok(())
    }
}

/// Writes `n` in decimal and a newline to fd 2, without allocating.
///
/// # Safety
/// Async-signal-safe; for the child between fork and exec.
unsafe fn write_errno(n: i32) {
    let mut buf = [0u8; 12];
    let mut i = buf.len() - 1;
    buf[i] = b'\n';
    let mut v = n.unsigned_abs();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 || i == 0 {
            break;
        }
    }
    // SAFETY: a valid buffer; write(2) is async-signal-safe.
    unsafe { libc::write(2, buf[i..].as_ptr().cast(), buf.len() - i) };
}
