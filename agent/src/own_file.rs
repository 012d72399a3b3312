//! # own_file — the files the agent (and the CLI) read or reuse where a VMM can write
//!
//! A VMM may create names in its instance's VMM directory (its sockets live there): a
//! symbolic link, a FIFO, a directory, a hard link or a file of its own where the agent
//! expects one of *its* files. Nothing found under such a name is trusted
//! (docs/design/architecture.md "Isolation between VMs", docs/design/invariants.md I16):
//!
//! - [`inspect`] looks without following a link (`fstatat(AT_SYMLINK_NOFOLLOW)` relative to
//!   the directory's fd) and says [`Entry::Own`] only for a regular file owned by the
//!   agent's effective uid with exactly one link (a hard link to a root-owned file is a plant
//!   too where `fs.protected_hardlinks` is 0);
//! - [`open`] opens such a file `O_NOFOLLOW | O_NONBLOCK` relative to the same directory fd
//!   and checks that the open file is the inode inspected (a name swapped in between is
//!   refused): a FIFO can never block the caller, a link never leads elsewhere;
//! - [`remove`] takes whatever sits at a name away (a directory whole, never following a
//!   link), so the agent can make its own file there.
//!
//! The directory itself must be the agent's (its path is trusted: every directory above a
//! VMM directory is root's and not writable by a VMM).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What [`inspect`] read of the agent's own file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnMeta {
    /// Its group.
    pub gid: u32,
    /// Its mode (type and permission bits).
    pub mode: u32,
    /// Its size, bytes.
    pub len: u64,
    dev: u64,
    ino: u64,
}

/// What sits at a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Nothing.
    Missing,
    /// A regular file of the agent's, with one link.
    Own(OwnMeta),
    /// Something else: what it is, in a few words ("a symbolic link", "a directory",
    /// "a regular file of uid 1879048192", "a regular file with 2 links").
    Foreign(String),
}

impl Entry {
    /// True for [`Entry::Own`].
    pub fn is_own(&self) -> bool {
        matches!(self, Entry::Own(_))
    }

    /// What is there, in a few words ("missing", "the agent's own file", "a FIFO").
    pub fn describe(&self) -> &str {
        match self {
            Entry::Missing => "missing",
            Entry::Own(_) => "the agent's own file",
            Entry::Foreign(w) => w,
        }
    }
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte"))
}

/// Opens `dir` as a directory, not following a link at its last component.
fn open_dir(dir: &Path) -> io::Result<OwnedFd> {
    let c = cstr(dir)?;
    // SAFETY: `c` is a valid NUL-terminated path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh, owned descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn kind(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFDIR => "a directory",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "a regular file",
    }
}

/// Judges a `stat` result: the agent's own regular file, or what it is instead.
fn judge(st: libc::stat) -> Entry {
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Entry::Foreign(kind(st.st_mode).to_string());
    }
    if st.st_uid != me {
        return Entry::Foreign(format!("a regular file of uid {}", st.st_uid));
    }
    if st.st_nlink != 1 {
        return Entry::Foreign(format!("a regular file with {} links", st.st_nlink));
    }
    Entry::Own(OwnMeta { gid: st.st_gid, mode: st.st_mode, len: st.st_size as u64, dev: st.st_dev, ino: st.st_ino })
}

fn stat_at(dirfd: &OwnedFd, name: &CString) -> io::Result<Option<libc::stat>> {
    // SAFETY: an all-zero `stat` is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, NUL-terminated name, writable `st`.
    let rc = unsafe { libc::fstatat(dirfd.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::NotFound { Ok(None) } else { Err(e) };
    }
    Ok(Some(st))
}

fn name_of(name: &str) -> io::Result<CString> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a file name")));
    }
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte"))
}

/// What sits at `dir/name`, without following a link and without opening it. Errors: `dir`
/// cannot be opened as a directory, or the `fstatat` fails otherwise than "not found".
pub fn inspect(dir: &Path, name: &str) -> io::Result<Entry> {
    let d = open_dir(dir)?;
    let n = name_of(name)?;
    Ok(match stat_at(&d, &n)? {
        None => Entry::Missing,
        Some(st) => judge(st),
    })
}

/// Opens `dir/name` when it is the agent's own regular file ([`inspect`]): read-only, or
/// read and append with `append`. `Ok(Err(entry))` says what is there instead (missing or
/// foreign). Errors: the directory or the open fail for another reason.
pub fn open(dir: &Path, name: &str, append: bool) -> io::Result<Result<File, Entry>> {
    let d = open_dir(dir)?;
    let n = name_of(name)?;
    let st = match stat_at(&d, &n)? {
        None => return Ok(Err(Entry::Missing)),
        Some(st) => match judge(st) {
            Entry::Own(m) => m,
            other => return Ok(Err(other)),
        },
    };
    let access = if append { libc::O_RDWR | libc::O_APPEND } else { libc::O_RDONLY };
    let flags = access | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: valid fd and NUL-terminated name; the result is checked.
    let fd = unsafe { libc::openat(d.as_raw_fd(), n.as_ptr(), flags) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ELOOP) => Ok(Err(Entry::Foreign(kind(libc::S_IFLNK).to_string()))),
            Some(libc::ENOENT) => Ok(Err(Entry::Missing)),
            _ => Err(e),
        };
    }
    // SAFETY: `fd` is a fresh, owned descriptor.
    let file = unsafe { File::from_raw_fd(fd) };
    // SAFETY: an all-zero `stat` is a valid value to be overwritten.
    let mut now: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, writable `now`.
    if unsafe { libc::fstat(file.as_raw_fd(), &mut now) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if (now.st_dev, now.st_ino) != (st.dev, st.ino) {
        return Ok(Err(Entry::Foreign("a file swapped in while it was being opened".into())));
    }
    match judge(now) {
        Entry::Own(_) => {}
        other => return Ok(Err(other)),
    }
    // Blocking again for the reader (O_NONBLOCK only guarded the open).
    // SAFETY: valid fd; F_SETFL with plain flags.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, if append { libc::O_APPEND } else { 0 }) };
    Ok(Ok(file))
}

/// Removes whatever sits at `dir/name` (a file, a link — never followed —, a FIFO, a
/// directory with its content). Nothing there is not an error.
pub fn remove(dir: &Path, name: &str) -> io::Result<()> {
    name_of(name)?;
    let p = dir.join(name);
    let meta = match std::fs::symlink_metadata(&p) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let r = if meta.file_type().is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Reads `dir/name` whole when it is the agent's own file; `Ok(None)` when it is missing.
/// Errors: something else sits there (the error says what), or the read fails.
pub fn read(dir: &Path, name: &str) -> io::Result<Option<Vec<u8>>> {
    match open(dir, name, false)? {
        Ok(mut f) => {
            let mut buf = Vec::new();
            io::Read::read_to_end(&mut f, &mut buf)?;
            Ok(Some(buf))
        }
        Err(Entry::Missing) => Ok(None),
        Err(other) => Err(foreign_error(dir, name, &other)),
    }
}

/// The error for a foreign entry at `dir/name`: "<path> is <what>, not the agent's own file".
pub fn foreign_error(dir: &Path, name: &str, entry: &Entry) -> io::Error {
    io::Error::other(format!("{} is {}, not the agent's own file", dir.join(name).display(), entry.describe()))
}

/// The uid owning the Unix socket at `path`, which must be a socket and not a link to one
/// (a VMM may replace its own socket by a link to another VMM's). Errors: anything else
/// there, or the `lstat` fails.
pub fn socket_owner(path: &Path) -> io::Result<u32> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::symlink_metadata(path)?;
    if !m.file_type().is_socket() {
        return Err(io::Error::other(format!(
            "{} is {}, not a socket",
            path.display(),
            kind(m.mode() as libc::mode_t)
        )));
    }
    Ok(m.uid())
}

/// The uid of the process at the other end of the connected Unix socket `fd`
/// (`SO_PEERCRED`: for a client, the credentials of the listener's owner at `listen`).
pub fn peer_uid(fd: &impl AsRawFd) -> io::Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: valid fd; `cred` and `len` are writable and sized for SO_PEERCRED.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Checks, after connecting to `path` (whose file [`socket_owner`] said `owner` owns), that
/// the listener is that owner's: a socket swapped for a link to another VMM's socket
/// between the two steps is refused.
pub fn check_peer(path: &Path, owner: u32, stream: &impl AsRawFd) -> io::Result<()> {
    let peer = peer_uid(stream)?;
    if peer != owner {
        return Err(io::Error::other(format!(
            "the listener behind {} runs as uid {peer}, not as the socket's owner {owner}: refused",
            path.display()
        )));
    }
    Ok(())
}

/// Connects to the Unix socket at `path` only if it is a socket (not a link) whose
/// listener runs as the socket file's owner ([`socket_owner`], [`check_peer`]): the agent
/// and the CLI never talk to a socket a VMM pointed them to.
pub fn connect(path: &Path) -> io::Result<std::os::unix::net::UnixStream> {
    let owner = socket_owner(path)?;
    let s = std::os::unix::net::UnixStream::connect(path)?;
    check_peer(path, owner, &s)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_a_regular_file_of_the_agents_with_one_link_is_own() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::write(p.join("own"), b"mine").unwrap();
        std::fs::write(p.join("target"), b"secret").unwrap();
        std::os::unix::fs::symlink(p.join("target"), p.join("link")).unwrap();
        std::fs::create_dir(p.join("dir")).unwrap();
        nix::unistd::mkfifo(&p.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        std::fs::hard_link(p.join("target"), p.join("hard")).unwrap();
        std::fs::write(p.join("theirs"), b"x").unwrap();
        std::os::unix::fs::chown(p.join("theirs"), Some(65534), None).unwrap();

        assert!(inspect(p, "own").unwrap().is_own());
        assert!(matches!(inspect(p, "none").unwrap(), Entry::Missing));
        for (name, what) in [
            ("link", "a symbolic link"),
            ("dir", "a directory"),
            ("fifo", "a FIFO"),
            ("hard", "a regular file with 2 links"),
            ("theirs", "a regular file of uid 65534"),
        ] {
            match inspect(p, name).unwrap() {
                Entry::Foreign(w) => assert_eq!(w, what, "{name}"),
                e => panic!("{name}: {e:?}"),
            }
        }
        assert_eq!(read(p, "own").unwrap().unwrap(), b"mine");
        let e = read(p, "link").unwrap_err().to_string();
        assert!(e.contains("is a symbolic link, not the agent's own file"), "{e}");
        assert!(read(p, "none").unwrap().is_none());
        assert!(inspect(p, "../x").is_err(), "a path is not a name");
    }

    #[test]
    fn a_fifo_is_refused_without_blocking_and_remove_takes_any_plant_away() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        nix::unistd::mkfifo(&p.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let start = std::time::Instant::now();
        assert!(matches!(open(p, "fifo", false).unwrap(), Err(Entry::Foreign(_))));
        assert!(start.elapsed() < std::time::Duration::from_secs(5));

        std::fs::create_dir_all(p.join("dir/sub")).unwrap();
        std::fs::write(p.join("dir/sub/f"), b"x").unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"k").unwrap();
        std::fs::set_permissions(outside.path().join("keep"), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(outside.path(), p.join("link")).unwrap();
        for n in ["fifo", "dir", "link", "none"] {
            remove(p, n).unwrap();
            assert!(std::fs::symlink_metadata(p.join(n)).is_err(), "{n}");
        }
        assert!(outside.path().join("keep").is_file(), "a link's target is untouched");
    }

    #[test]
    fn a_link_to_a_socket_is_refused_and_a_socket_of_its_owner_accepted() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        std::os::unix::fs::symlink(&sock, d.path().join("link.sock")).unwrap();

        connect(&sock).unwrap();
        let e = connect(&d.path().join("link.sock")).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link, not a socket"), "{e}");
        // A socket file of another owner than its listener (the listener's uid is ours).
        std::os::unix::fs::lchown(&sock, Some(65534), None).unwrap();
        let e = connect(&sock).unwrap_err().to_string();
        assert!(e.contains("runs as uid 0, not as the socket's owner 65534"), "{e}");
    }

    #[test]
    fn open_for_append_writes_at_the_end() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("log"), b"a").unwrap();
        let mut f = open(d.path(), "log", true).unwrap().unwrap();
        io::Write::write_all(&mut f, b"b").unwrap();
        assert_eq!(std::fs::read(d.path().join("log")).unwrap(), b"ab");
    }
}
