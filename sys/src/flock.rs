//! Advisory file locks (flock). Two driver processes on one node (the controller
//! and the node plugin of the central deployment) agree through them on who owns
//! a piece of state and who may act on a volume right now. The kernel drops a
//! lock when its holder exits, so a killed process never leaves one held; and
//! since a lock belongs to an open file, two threads of one process that each
//! take it exclude each other as two processes would.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::error::{Result, SysError};
use crate::fsrecord::{note, FsOp};

/// An exclusive lock on a file, held until dropped.
#[derive(Debug)]
pub struct LockFile {
    file: Flock<File>,
    path: PathBuf,
}

impl LockFile {
    /// Takes the exclusive lock of `path` (made, mode 0600, if missing) without
    /// waiting; None when someone else holds it.
    pub fn try_exclusive(path: &Path) -> Result<Option<LockFile>> {
        loop {
            let file = open_lock_file_or_fail(path, true)?;
            match lock_opened(file, path)? {
                Taken::Held(lock) => return Ok(Some(lock)),
                Taken::Busy => return Ok(None),
                Taken::Moved => continue,
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the file's content (who holds it, for the message a second
    /// process prints).
    pub fn set_holder(&mut self, text: &str) -> Result<()> {
        let f: &mut File = &mut self.file;
        f.set_len(0)
            .and_then(|()| f.rewind())
            .and_then(|()| f.write_all(text.as_bytes()))
            .map_err(|e| SysError::io("write lock file", &self.path, e))?;
        note(|| FsOp::SetLen {
            path: self.path.clone(),
            len: 0,
        });
        note(|| FsOp::Write {
            path: self.path.clone(),
            offset: 0,
            data: text.as_bytes().to_vec(),
        });
        Ok(())
    }

    /// Records this process as the holder: `pid N, WHAT`, which a second process
    /// prints and [`try_exclusive_after_ended_holder`](Self::try_exclusive_after_ended_holder)
    /// reads.
    pub fn set_holder_process(&mut self, what: &str) -> Result<()> {
        self.set_holder(&format!("pid {}, {what}", std::process::id()))
    }

    /// Like [`try_exclusive`](Self::try_exclusive), but when the lock is held and
    /// the process its holder recorded (`pid N`) has ended, waits up to `wait`
    /// for it to be let go. Only a child that process left can hold it then: one
    /// it was starting when it died (cloned, not yet exec'd) keeps copies of all
    /// its descriptors until it execs. A living holder is not waited for.
    pub fn try_exclusive_after_ended_holder(
        path: &Path,
        wait: std::time::Duration,
    ) -> Result<Option<LockFile>> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            if let Some(lock) = LockFile::try_exclusive(path)? {
                return Ok(Some(lock));
            }
            if !holder_ended(path) || std::time::Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// What the holder of `path` wrote into it, if anything.
    pub fn holder(path: &Path) -> Option<String> {
        let mut s = String::new();
        File::open(path).ok()?.read_to_string(&mut s).ok()?;
        let s = s.trim().to_string();
        (!s.is_empty()).then_some(s)
    }

    /// Removes the file, then lets the lock go. Whoever waited on it finds it
    /// gone and makes a new one.
    pub fn remove(self) -> Result<()> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {
                note(|| FsOp::Unlink {
                    path: self.path.clone(),
                });
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(SysError::io("remove lock file", &self.path, e)),
        }
    }
}

/// A directory of lock files, one per name, that recycles its files. A lock
/// file holds nothing, so a removed one is renamed to a spare name and the next
/// new name takes a spare by a rename: making and freeing an inode for each lock
/// costs far more than a rename on some filesystems (ext4 without a journal
/// looks over every inode freed in the last minutes on each allocation). Spares
/// are named `.spare-*`; two processes sharing the directory each take them by a
/// rename that fails when the other took the spare first, and a process of an
/// earlier version, which makes and removes lock files by their names, passes
/// them by.
#[derive(Debug)]
pub struct LockDir {
    dir: PathBuf,
    /// Spares this process may take (some may have been taken by another).
    spares: Mutex<Vec<PathBuf>>,
    next: AtomicU64,
}

const SPARE_PREFIX: &str = ".spare-";

/// Whether `name` is that of a spare lock file.
pub fn is_spare(name: &str) -> bool {
    name.starts_with(SPARE_PREFIX)
}
/// Spares kept at most; a removal beyond them removes the file.
pub const MAX_SPARES: usize = 4096;
/// How often a lock of a name just made from a spare is tried again when busy:
/// only a process that opened the spare under its earlier name and has yet to
/// find it renamed can hold it then, and only for a moment.
const SPARE_BUSY_RETRIES: u32 = 3;

impl LockDir {
    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The lock files of `dir`. Spares it holds already are taken into use at
    /// the first [`list`](Self::list): a start does not wait for a listing of
    /// every volume's lock.
    pub fn open(dir: &Path) -> LockDir {
        LockDir {
            dir: dir.to_path_buf(),
            spares: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        }
    }

    /// The names of the locks in the directory (not the spares). The spares
    /// found are taken into use; those beyond [`MAX_SPARES`] are removed.
    pub fn list(&self) -> Result<Vec<String>> {
        let entries =
            std::fs::read_dir(&self.dir).map_err(|e| SysError::io("list", &self.dir, e))?;
        let mut names = Vec::new();
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if is_spare(&name) {
                found.push(entry.path());
            } else if !name.starts_with('.') {
                names.push(name);
            }
        }
        let mut spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
        let known: std::collections::HashSet<PathBuf> = spares.iter().cloned().collect();
        for path in found.into_iter().filter(|p| !known.contains(p)) {
            if spares.len() < MAX_SPARES {
                spares.push(path);
            } else {
                let _ = crate::file::remove_file_if_exists(&path);
            }
        }
        Ok(names)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Spares this process knows of now.
    pub fn spares(&self) -> usize {
        self.spares.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Takes the exclusive lock of `name` without waiting (its file made from a
    /// spare, or anew, if missing); None when someone else holds it.
    pub fn try_exclusive(&self, name: &str) -> Result<Option<LockFile>> {
        let path = self.path(name);
        let mut busy_retries = 0;
        loop {
            let (file, from_spare) = match open_lock_file(&path, false) {
                Ok(f) => (f, false),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // Made anew if it is gone again by now.
                    let from_spare = self.take_spare(&path)?;
                    (open_lock_file_or_fail(&path, true)?, from_spare)
                }
                Err(e) => return Err(SysError::io("open lock file", &path, e)),
            };
            match lock_opened(file, &path)? {
                Taken::Held(lock) => return Ok(Some(lock)),
                Taken::Busy if from_spare && busy_retries < SPARE_BUSY_RETRIES => {
                    busy_retries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Taken::Busy => return Ok(None),
                Taken::Moved => continue,
            }
        }
    }

    /// Puts a spare in place of `path`; false when there is none. True also
    /// when `path` was made meanwhile: it is then used as it is.
    fn take_spare(&self, path: &Path) -> Result<bool> {
        loop {
            let Some(spare) = self.spares.lock().unwrap_or_else(|p| p.into_inner()).pop() else {
                return Ok(false);
            };
            match rename_no_replace(&spare, path) {
                Ok(()) => return Ok(true),
                // Taken by the other process, or removed.
                Err(Errno::ENOENT) => continue,
                Err(Errno::EEXIST) => {
                    self.keep_spare(spare);
                    return Ok(true);
                }
                // A filesystem that cannot rename without replacing: make files.
                Err(Errno::EINVAL) | Err(Errno::ENOSYS) => {
                    self.keep_spare(spare);
                    return Ok(false);
                }
                Err(e) => {
                    return Err(SysError::errno(
                        "rename a spare lock file to",
                        path,
                        e as i32,
                    ))
                }
            }
        }
    }

    fn keep_spare(&self, spare: PathBuf) {
        self.spares
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(spare);
    }

    /// Removes the file of a held lock (kept as a spare, or removed), then lets
    /// the lock go. Whoever waited on it finds it gone and takes a new one.
    pub fn remove(&self, lock: LockFile) -> Result<()> {
        if self.spares() >= MAX_SPARES {
            return lock.remove();
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let spare = self
            .dir
            .join(format!("{SPARE_PREFIX}{}-{n}", std::process::id()));
        match rename_no_replace(&lock.path, &spare) {
            Ok(()) => {
                drop(lock);
                self.keep_spare(spare);
                Ok(())
            }
            Err(Errno::ENOENT) => Ok(()),
            // A spare of that name left by an earlier process of this pid, or a
            // filesystem that cannot rename without replacing.
            Err(Errno::EEXIST) | Err(Errno::EINVAL) | Err(Errno::ENOSYS) => lock.remove(),
            Err(e) => Err(SysError::errno("rename a lock file to", &spare, e as i32)),
        }
    }
}

/// `rename(from, to)` that fails with EEXIST instead of replacing `to`.
fn rename_no_replace(from: &Path, to: &Path) -> std::result::Result<(), Errno> {
    nix::fcntl::renameat2(
        nix::fcntl::AT_FDCWD,
        from,
        nix::fcntl::AT_FDCWD,
        to,
        nix::fcntl::RenameFlags::RENAME_NOREPLACE,
    )?;
    note(|| FsOp::Rename {
        from: from.into(),
        to: to.into(),
    });
    Ok(())
}

/// What a lock attempt on an opened lock file found.
enum Taken {
    Held(LockFile),
    /// Someone else holds it.
    Busy,
    /// The file was removed or renamed between the open and the lock: a lock
    /// on it guards nothing, so the caller opens the path again.
    Moved,
}

fn open_lock_file(path: &Path, create: bool) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    if create {
        note(|| FsOp::Create {
            path: path.into(),
            truncate: false,
        });
    }
    Ok(file)
}

fn open_lock_file_or_fail(path: &Path, create: bool) -> Result<File> {
    open_lock_file(path, create).map_err(|e| SysError::io("open lock file", path, e))
}

/// Locks `file`, opened at `path`, and checks that `path` still names it.
fn lock_opened(file: File, path: &Path) -> Result<Taken> {
    let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(f) => f,
        Err((_, Errno::EWOULDBLOCK)) => return Ok(Taken::Busy),
        Err((_, e)) => return Err(SysError::errno("flock", path, e as i32)),
    };
    let held = file
        .metadata()
        .map_err(|e| SysError::io("fstat lock file", path, e))?;
    match std::fs::metadata(path) {
        Ok(m) if (m.dev(), m.ino()) == (held.dev(), held.ino()) => Ok(Taken::Held(LockFile {
            file,
            path: path.to_path_buf(),
        })),
        Ok(_) => Ok(Taken::Moved),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Taken::Moved),
        Err(e) => Err(SysError::io("stat lock file", path, e)),
    }
}

/// Whether the holder of `path` recorded a pid whose process no longer exists.
fn holder_ended(path: &Path) -> bool {
    LockFile::holder(path)
        .and_then(|h| {
            h.strip_prefix("pid ")?
                .split(',')
                .next()?
                .parse::<u32>()
                .ok()
        })
        .is_some_and(|pid| !Path::new("/proc").join(pid.to_string()).exists())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A lock whose recorded holder has ended (a child it left holds it until
    /// it execs) is waited for; one whose holder lives is refused at once.
    #[test]
    fn a_lock_held_after_its_holder_ended_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("owner.lock");
        let mut held = LockFile::try_exclusive(&path).unwrap().unwrap();
        // No process has this pid (above pid_max).
        held.set_holder("pid 4294967295, --mode node").unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(held);
        });
        let t0 = Instant::now();
        let got =
            LockFile::try_exclusive_after_ended_holder(&path, Duration::from_secs(5)).unwrap();
        assert!(got.is_some(), "the lock was let go after 300 ms");
        assert!(t0.elapsed() >= Duration::from_millis(250));
        release.join().unwrap();
        drop(got);

        let mut held = LockFile::try_exclusive(&path).unwrap().unwrap();
        held.set_holder_process("--mode node").unwrap();
        let t0 = Instant::now();
        let got =
            LockFile::try_exclusive_after_ended_holder(&path, Duration::from_secs(5)).unwrap();
        assert!(got.is_none(), "a living holder's lock is not taken");
        assert!(t0.elapsed() < Duration::from_secs(1), "and not waited for");
        // Ended, and still held when the wait is over: refused.
        held.set_holder("pid 4294967295, --mode node").unwrap();
        let got =
            LockFile::try_exclusive_after_ended_holder(&path, Duration::from_millis(100)).unwrap();
        assert!(got.is_none());
    }

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.lock");
        let mut a = LockFile::try_exclusive(&path).unwrap().expect("first");
        a.set_holder("pid 1").unwrap();
        assert!(LockFile::try_exclusive(&path).unwrap().is_none());
        assert_eq!(LockFile::holder(&path).as_deref(), Some("pid 1"));
        drop(a);
        assert!(LockFile::try_exclusive(&path).unwrap().is_some());
    }

    #[test]
    fn a_removed_lock_file_is_made_anew() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("y.lock");
        let a = LockFile::try_exclusive(&path).unwrap().expect("first");
        a.remove().unwrap();
        assert!(!path.exists());
        let b = LockFile::try_exclusive(&path)
            .unwrap()
            .expect("after remove");
        assert!(path.exists());
        drop(b);
    }

    fn ino(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().ino()
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_removed_lock_file_becomes_the_file_of_the_next_new_name() {
        let dir = tempfile::tempdir().unwrap();
        let locks = LockDir::open(dir.path());
        let a = locks.try_exclusive("a").unwrap().expect("a");
        let inode = ino(&locks.path("a"));
        locks.remove(a).unwrap();
        assert!(!locks.path("a").exists());
        assert_eq!(locks.spares(), 1);
        let b = locks.try_exclusive("b").unwrap().expect("b");
        assert_eq!(ino(&locks.path("b")), inode, "b's file is a's, renamed");
        assert_eq!(locks.spares(), 0);
        assert_eq!(names(dir.path()), vec!["b".to_string()]);
        // Held: refused to a second taker, as any lock file.
        assert!(locks.try_exclusive("b").unwrap().is_none());
        drop(b);
        // A name whose file is there is locked as it is, leaving spares alone.
        let a = locks.try_exclusive("a").unwrap().expect("a again");
        locks.remove(a).unwrap();
        let b = locks.try_exclusive("b").unwrap().expect("b again");
        assert_eq!(ino(&locks.path("b")), inode);
        assert_eq!(locks.spares(), 1);
        drop(b);
    }

    #[test]
    fn spares_are_found_again_and_shared_with_another_process_by_rename() {
        let dir = tempfile::tempdir().unwrap();
        let first = LockDir::open(dir.path());
        let a = first.try_exclusive("a").unwrap().unwrap();
        let b = first.try_exclusive("b").unwrap().unwrap();
        first.remove(a).unwrap();
        first.remove(b).unwrap();
        // Another process (or the next start) finds both spares once it lists
        // the locks.
        let other = LockDir::open(dir.path());
        assert_eq!(other.spares(), 0);
        assert!(other.list().unwrap().is_empty());
        assert_eq!(other.spares(), 2);
        assert!(first.list().unwrap().is_empty());
        assert_eq!(first.spares(), 2, "a listing adds no spare twice");
        let x = other.try_exclusive("x").unwrap().unwrap();
        let y = other.try_exclusive("y").unwrap().unwrap();
        assert_eq!(other.spares(), 0);
        // The first process's spares were taken: it makes a file of its own.
        let z = first.try_exclusive("z").unwrap().expect("a new file");
        assert_eq!(first.spares(), 0, "both taken spares were passed by");
        assert_eq!(names(dir.path()), vec!["x", "y", "z"]);
        drop((x, y, z));
    }

    #[test]
    fn spares_beyond_the_bound_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..MAX_SPARES + 5 {
            std::fs::write(dir.path().join(format!("{SPARE_PREFIX}old-{i}")), b"").unwrap();
        }
        std::fs::write(dir.path().join("held"), b"").unwrap();
        let locks = LockDir::open(dir.path());
        assert_eq!(locks.list().unwrap(), vec!["held".to_string()]);
        assert_eq!(locks.spares(), MAX_SPARES);
        std::fs::remove_file(dir.path().join("held")).unwrap();
        assert_eq!(names(dir.path()).len(), MAX_SPARES);
        // Full: a removal removes the file.
        let a = locks.try_exclusive("a").unwrap().unwrap();
        assert_eq!(locks.spares(), MAX_SPARES - 1);
        locks.remove(a).unwrap();
        let a = locks.try_exclusive("a").unwrap().unwrap();
        locks.remove(a).unwrap();
        assert_eq!(locks.spares(), MAX_SPARES);
        let b = locks.try_exclusive("b").unwrap().unwrap();
        let extra = locks.try_exclusive("c").unwrap().unwrap();
        locks.remove(b).unwrap();
        locks.remove(extra).unwrap();
        assert_eq!(locks.spares(), MAX_SPARES);
        assert_eq!(names(dir.path()).len(), MAX_SPARES);
    }

    /// A taker that opened the file before its holder removed it, and locks it
    /// after, finds it moved and takes the name's file as it is now.
    #[test]
    fn a_lock_on_a_file_moved_after_its_open_is_taken_again() {
        let dir = tempfile::tempdir().unwrap();
        let locks = LockDir::open(dir.path());
        let a = locks.try_exclusive("a").unwrap().unwrap();
        let early = open_lock_file(&locks.path("a"), false).unwrap();
        locks.remove(a).unwrap();
        assert!(matches!(
            lock_opened(early, &locks.path("a")).unwrap(),
            Taken::Moved
        ));
        // Held by a taker that has yet to see it moved: a name made from that
        // spare is refused while it holds it, and had once it lets go.
        let early = open_lock_file(&locks.path("b"), true).unwrap();
        let Taken::Held(b) = lock_opened(early, &locks.path("b")).unwrap() else {
            panic!("b is free");
        };
        let inode = ino(&locks.path("b"));
        let stale = open_lock_file(&locks.path("b"), false).unwrap();
        locks.remove(b).unwrap();
        let stale = Flock::lock(stale, FlockArg::LockExclusiveNonblock).unwrap();
        assert!(locks.try_exclusive("c").unwrap().is_none());
        assert_eq!(ino(&locks.path("c")), inode, "c was made from b's spare");
        drop(stale);
        let c = locks.try_exclusive("c").unwrap().expect("c once let go");
        assert_eq!(ino(&locks.path("c")), inode);
        drop(c);
    }
}
