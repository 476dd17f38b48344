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
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)
                .map_err(|e| SysError::io("open lock file", path, e))?;
            note(|| FsOp::Create {
                path: path.into(),
                truncate: false,
            });
            let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(f) => f,
                Err((_, Errno::EWOULDBLOCK)) => return Ok(None),
                Err((_, e)) => return Err(SysError::errno("flock", path, e as i32)),
            };
            // The holder before us may have removed the file between our open and
            // our lock: a lock on a removed file guards nothing, so take the new one.
            let held = file
                .metadata()
                .map_err(|e| SysError::io("fstat lock file", path, e))?;
            match std::fs::metadata(path) {
                Ok(m) if (m.dev(), m.ino()) == (held.dev(), held.ino()) => {
                    return Ok(Some(LockFile {
                        file,
                        path: path.to_path_buf(),
                    }))
                }
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(SysError::io("stat lock file", path, e)),
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
}
