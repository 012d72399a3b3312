//! The FUSE side: maps kernel requests onto [`State`].
//!
//! Every file is opened with `FOPEN_DIRECT_IO` and every attribute and entry has a zero TTL,
//! so each read sees the current state. Attribute files report size 4096, device nodes 0.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow,
};

use crate::state::{FaultKind, State};
use crate::tree::{FileKind, Node};

const TTL: Duration = Duration::ZERO;

/// The mounted filesystem; a handle to the shared, mutex-protected state.
#[derive(Clone)]
pub struct SimFs {
    state: Arc<Mutex<State>>,
    started: SystemTime,
}

impl SimFs {
    /// Wraps a booted state.
    pub fn new(state: State) -> SimFs {
        SimFs { state: Arc::new(Mutex::new(state)), started: SystemTime::now() }
    }

    /// Locks the state (the driver lock) and applies pending time-based changes.
    fn lock(&self) -> MutexGuard<'_, State> {
        lock_state(&self.state)
    }

    fn attr(&self, ino: u64, node: &Node) -> FileAttr {
        let (kind, perm, size, nlink) = match node {
            Node::Dir(_) => (FileType::Directory, 0o755, 0, 2),
            Node::Link(t) => (FileType::Symlink, 0o777, t.len() as u64, 1),
            Node::File(FileKind::Node(_), m) => (FileType::RegularFile, *m, 0, 1),
            Node::File(_, m) => (FileType::RegularFile, *m, 4096, 1),
        };
        FileAttr {
            ino,
            size,
            blocks: 0,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

fn lock_state(m: &Mutex<State>) -> MutexGuard<'_, State> {
    let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
    g.tick();
    g
}

/// The process (thread-group) id of the thread FUSE reports as the requester.
fn tgid(tid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Tgid:")).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(tid)
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}/{name}")
    }
}

impl Filesystem for SimFs {
    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let mut st = self.lock();
        let Some(pp) = st.path_of(parent) else {
            return reply.error(libc::ENOENT);
        };
        let path = join(&pp, &name.to_string_lossy());
        let Some(node) = st.tree().nodes.get(&path).cloned() else {
            return reply.error(libc::ENOENT);
        };
        let ino = st.ino(&path);
        reply.entry(&TTL, &self.attr(ino, &node), 0);
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        let mut st = self.lock();
        let Some(path) = st.path_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        match st.tree().nodes.get(&path).cloned() {
            Some(node) => reply.attr(&TTL, &self.attr(ino, &node)),
            None => reply.error(libc::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &mut self,
        req: &Request<'_>,
        ino: u64,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        // Truncation (O_TRUNC) and the like are accepted and ignored, as on sysfs.
        self.getattr(req, ino, fh, reply);
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        let mut st = self.lock();
        let Some(path) = st.path_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        let target = match st.tree().nodes.get(&path) {
            Some(Node::Link(t)) => t.clone(),
            Some(_) => return reply.error(libc::EINVAL),
            None => return reply.error(libc::ENOENT),
        };
        if let Some((e, _)) = st.take_fault(FaultKind::FailRead, &path) {
            return reply.error(e);
        }
        reply.data(target.as_bytes());
    }

    fn open(&mut self, req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        let mut st = self.lock();
        let Some(path) = st.path_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        let acc = flags & libc::O_ACCMODE;
        let read = acc == libc::O_RDONLY || acc == libc::O_RDWR;
        let write = acc == libc::O_WRONLY || acc == libc::O_RDWR;
        match st.open(&path, tgid(req.pid()), read, write) {
            Ok(fh) => reply.opened(fh, fuser::consts::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let mut st = self.lock();
        let is_ctl = st.handles.get(&fh).is_some_and(|h| matches!(h.kind, FileKind::Ctl));
        match st.read_file(fh) {
            Ok(data) if is_ctl => {
                // The answer is read with a cursor of its own: the file position is past the
                // request the client wrote.
                let n = data.len().min(size as usize);
                st.advance_ctl(fh, n);
                reply.data(&data[..n]);
            }
            Ok(data) => {
                let start = (offset.max(0) as usize).min(data.len());
                let end = (start + size as usize).min(data.len());
                reply.data(&data[start..end]);
            }
            Err(e) => reply.error(e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        req: &Request<'_>,
        _ino: u64,
        fh: u64,
        _offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        let pid = tgid(req.pid());
        let mut st = self.lock();
        let delay = match st.write_faults(fh, pid, data) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        if delay == 0 {
            match st.write(fh, pid, data) {
                Ok(()) => reply.written(data.len() as u32),
                Err(e) => reply.error(e),
            }
            return;
        }
        drop(st);
        // A delayed write must not block the session loop: finish it on its own thread.
        let state = Arc::clone(&self.state);
        let data = data.to_vec();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(delay));
            let mut st = lock_state(&state);
            match st.write(fh, pid, &data) {
                Ok(()) => reply.written(data.len() as u32),
                Err(e) => reply.error(e),
            }
        });
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lo: u64, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.lock().release(fh);
        reply.ok();
    }

    fn opendir(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        let mut st = self.lock();
        let Some(path) = st.path_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        match st.tree().nodes.get(&path) {
            Some(Node::Dir(_)) => reply.opened(0, 0),
            Some(_) => reply.error(libc::ENOTDIR),
            None => reply.error(libc::ENOENT),
        }
    }

    fn readdir(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, offset: i64, mut reply: ReplyDirectory) {
        let mut st = self.lock();
        let Some(path) = st.path_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        if offset == 0 {
            if let Some((e, _)) = st.take_fault(FaultKind::FailRead, &path) {
                return reply.error(e);
            }
        }
        let children = match st.tree().nodes.get(&path) {
            Some(Node::Dir(c)) => c.clone(),
            Some(_) => return reply.error(libc::ENOTDIR),
            None => return reply.error(libc::ENOENT),
        };
        let mut entries: Vec<(u64, FileType, String)> =
            vec![(ino, FileType::Directory, ".".into()), (ino, FileType::Directory, "..".into())];
        for c in children {
            let p = join(&path, &c);
            let ft = match st.tree().nodes.get(&p) {
                Some(Node::Dir(_)) => FileType::Directory,
                Some(Node::Link(_)) => FileType::Symlink,
                _ => FileType::RegularFile,
            };
            let i = st.ino(&p);
            entries.push((i, ft, c));
        }
        for (i, (ino, ft, name)) in entries.into_iter().enumerate().skip(offset.max(0) as usize) {
            if reply.add(ino, (i + 1) as i64, ft, name) {
                break;
            }
        }
        reply.ok();
    }

    #[allow(clippy::too_many_arguments)]
    fn create(
        &mut self,
        _req: &Request<'_>,
        _parent: u64,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        // Like sysfs: files cannot be created; a missing path is missing (rule 11).
        reply.error(libc::ENOENT);
    }
}

/// Mount options used by [`mount`].
pub fn mount_options() -> Vec<MountOption> {
    vec![
        MountOption::FSName("gpuvisor-sim".into()),
        MountOption::Subtype("gpuvisor-sim".into()),
        MountOption::AllowOther,
        MountOption::NoAtime,
    ]
}

/// Mounts `fs` on `dir` and serves it on a background thread until the returned session
/// is dropped (which unmounts).
pub fn mount(fs: SimFs, dir: &Path) -> std::io::Result<fuser::BackgroundSession> {
    let session = fuser::Session::new(fs, dir, &mount_options())?;
    session.spawn()
}
