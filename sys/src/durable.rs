//! Crash-safe writes: a whole file replaced atomically (a temporary beside it,
//! synced, renamed over it, its folder synced), and a file that only grows at
//! its end and is made durable with `fdatasync` (a journal). Every write is
//! recorded for the power-loss model.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Result, SysError};
use crate::file::{create_new, fsync, fsync_dir, parent_dir, remove_file_if_exists, set_len};
use crate::fsrecord::{note, FsOp};

/// The temporary file [`write_atomic`] uses for `path`: `.<name>.tmp` next to it. A
/// leftover one after a crash is an orphan that may be removed.
pub fn temp_path_for(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| SysError::InvalidArgument {
        what: format!("{} has no file name", path.display()),
    })?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(".tmp");
    Ok(parent_dir(path).join(tmp))
}

/// Replace the content of `path` crash-safely: write `.<name>.tmp` in the same
/// folder, fsync it, rename it over `path`, fsync the folder. A reader sees the old
/// or the new content, never a mix. The file gets mode 0600.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// Like [`write_atomic`] without its syncs, for what matters only while the
/// running kernel does (a freeze): a reader, and a process started again after a
/// crash, see the old or the new content, never a mix; after a power loss the file
/// may be missing, empty or hold part of the new content, so a reader must
/// treat an unreadable one as left by a power loss.
pub fn write_atomic_unsynced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut r = Replacement::create(path)?;
    r.write_all(bytes)
        .map_err(|e| SysError::io("write", &r.tmp, e))?;
    r.put_in_place(false)
}

/// Like [`write_atomic`], for content too large to hold at once: `fill` writes
/// it in pieces into the temporary file, which is then synced and renamed over
/// `path`, and the folder synced.
pub fn write_atomic_with<F>(path: &Path, fill: F) -> Result<()>
where
    F: FnOnce(&mut dyn Write) -> io::Result<()>,
{
    let mut r = Replacement::create(path)?;
    fill(&mut r).map_err(|e| SysError::io("write", &r.tmp, e))?;
    r.commit()
}

/// New content for `path`, written in pieces into `.<name>.tmp` beside it, which
/// [`Replacement::commit`] syncs and renames over `path` (then syncs the
/// folder): a reader sees the old or the new content, never a mix. Dropped
/// without a commit, the temporary file is removed. Mode 0600.
pub struct Replacement {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<io::BufWriter<NotedWriter>>,
}

impl Replacement {
    pub fn create(path: &Path) -> Result<Replacement> {
        let tmp = temp_path_for(path)?;
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(|e| SysError::io("create", &tmp, e))?;
        note(|| FsOp::Create {
            path: tmp.clone(),
            truncate: true,
        });
        let writer = NotedWriter {
            file,
            path: tmp.clone(),
            offset: 0,
        };
        Ok(Replacement {
            path: path.to_path_buf(),
            tmp,
            out: Some(io::BufWriter::with_capacity(1 << 20, writer)),
        })
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.out
            .as_ref()
            .map_or(0, |o| o.get_ref().offset + o.buffer().len() as u64)
    }

    /// Makes the content durable and puts it in place of `path`.
    pub fn commit(self) -> Result<()> {
        self.put_in_place(true)
    }

    /// Puts the content in place of `path`, synced before and after when `durable`.
    fn put_in_place(mut self, durable: bool) -> Result<()> {
        let Some(out) = self.out.take() else {
            return Ok(());
        };
        let res = (|| {
            let writer = out
                .into_inner()
                .map_err(|e| SysError::io("write", &self.tmp, e.into_error()))?;
            if durable {
                fsync(&writer.file, &self.tmp)?;
            }
            fs::rename(&self.tmp, &self.path)
                .map_err(|e| SysError::io("rename over", &self.path, e))?;
            note(|| FsOp::Rename {
                from: self.tmp.clone(),
                to: self.path.clone(),
            });
            if durable {
                fsync_dir(parent_dir(&self.path))?;
            }
            Ok(())
        })();
        if res.is_err() {
            let _ = remove_file_if_exists(&self.tmp);
        }
        res
    }
}

impl Write for Replacement {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self.out.as_mut() {
            Some(out) => out.write(buf),
            None => Err(io::Error::other("the replacement is committed")),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        self.out.as_mut().map_or(Ok(()), |o| o.flush())
    }
}

impl Drop for Replacement {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = remove_file_if_exists(&self.tmp);
        }
    }
}

/// Writes at increasing offsets of a file, each write recorded.
struct NotedWriter {
    file: File,
    path: PathBuf,
    offset: u64,
}

impl Write for NotedWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write_all_at(buf, self.offset)?;
        note(|| FsOp::Write {
            path: self.path.clone(),
            offset: self.offset,
            data: buf.to_vec(),
        });
        self.offset += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A file that only grows at its end, made durable with `fdatasync` (a journal).
/// The caller keeps the offset: appends of one writer at a time.
#[derive(Debug)]
pub struct AppendFile {
    file: File,
    path: PathBuf,
    /// The file's length: appends below it overwrite zeros in place.
    room: AtomicU64,
}

/// How far ahead of its appends an [`AppendFile`] is written with zeros. An
/// append that changes a file's length needs its metadata synced too (a journal
/// commit on ext4, a log force on xfs, on top of the data and the cache flush);
/// one within the length does not. So the length moves in steps of this, and all
/// but one append in each step sync their data alone.
#[cfg(not(feature = "fs-recording"))]
pub const APPEND_ROOM: u64 = 128 << 10;
/// Recorded runs (the power-loss model replays every write at every crash point)
/// take the same steps, smaller: fewer zeros to replay.
#[cfg(feature = "fs-recording")]
pub const APPEND_ROOM: u64 = 4 << 10;

impl AppendFile {
    /// Makes a new empty file (mode 0600) and makes its entry durable: appends to
    /// it are then durable with one `fdatasync` each.
    pub fn create(path: &Path) -> Result<AppendFile> {
        let file = create_new(path, 0o600)?;
        fsync(&file, path)?;
        fsync_dir(parent_dir(path))?;
        Ok(AppendFile {
            file,
            path: path.into(),
            room: AtomicU64::new(0),
        })
    }

    /// Opens an existing file to append to it (the zeros at its end, if any,
    /// are room for appends).
    pub fn open(path: &Path) -> Result<AppendFile> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| SysError::io("open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| SysError::io("stat", path, e))?
            .len();
        Ok(AppendFile {
            file,
            path: path.into(),
            room: AtomicU64::new(len),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `data` at `offset` (the end of what the file holds), not yet
    /// durable. When it reaches past the file's length, zeros follow it up to the
    /// next step of [`APPEND_ROOM`]. Appends are not concurrent.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.write_raw(offset, data)?;
        let end = offset + data.len() as u64;
        let room = self.room.load(Ordering::Relaxed);
        if end > room {
            let grown = (end + 1).next_multiple_of(APPEND_ROOM);
            self.write_raw(end, &vec![0; (grown - end) as usize])?;
            self.room.store(grown, Ordering::Relaxed);
        }
        Ok(())
    }

    fn write_raw(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.file
            .write_all_at(data, offset)
            .map_err(|e| SysError::io("append to", &self.path, e))?;
        note(|| FsOp::Write {
            path: self.path.clone(),
            offset,
            data: data.to_vec(),
        });
        Ok(())
    }

    /// Writes `data` at `offset` (the end of what the file holds) and returns
    /// once it is durable: [`write_at`](Self::write_at) then
    /// [`sync_data`](Self::sync_data), in one call where it can be. Within the
    /// room the file's length does not change, so `pwritev2` with `RWF_DSYNC`
    /// writes and syncs the range in one system call (the data and whatever is
    /// needed to read it back, as `O_DSYNC` does); an append past the room
    /// changes the length and takes the two steps. Appends are not concurrent.
    pub fn write_durable_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let end = offset + data.len() as u64;
        if end > self.room.load(Ordering::Relaxed) || !self.dsync_writes(offset, data)? {
            self.write_at(offset, data)?;
            return self.sync_data();
        }
        note(|| FsOp::Write {
            path: self.path.clone(),
            offset,
            data: data.to_vec(),
        });
        note(|| FsOp::SyncRange {
            path: self.path.clone(),
            offset,
            len: data.len() as u64,
        });
        Ok(())
    }

    /// `pwritev2(RWF_DSYNC)` of all of `data`; false when the kernel does not
    /// know the flag (before Linux 4.7) and nothing was written.
    fn dsync_writes(&self, offset: u64, data: &[u8]) -> Result<bool> {
        use rustix::io::{pwritev2, Errno, ReadWriteFlags};
        let mut done = 0;
        while done < data.len() {
            let at = offset + done as u64;
            match pwritev2(
                &self.file,
                &[io::IoSlice::new(&data[done..])],
                at,
                ReadWriteFlags::DSYNC,
            ) {
                Ok(0) => {
                    return Err(SysError::io(
                        "append to",
                        &self.path,
                        io::ErrorKind::WriteZero.into(),
                    ))
                }
                Ok(n) => done += n,
                Err(Errno::INTR) => {}
                Err(Errno::OPNOTSUPP | Errno::NOSYS) if done == 0 => return Ok(false),
                Err(e) => return Err(SysError::io("append to", &self.path, e.into())),
            }
        }
        Ok(true)
    }

    /// Makes what was written durable (`fdatasync`: the data and the length).
    pub fn sync_data(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| SysError::io("fdatasync", &self.path, e))?;
        note(|| FsOp::SyncData {
            path: self.path.clone(),
        });
        Ok(())
    }

    /// Cuts the file back to `len` bytes, durably (what lies beyond was never
    /// acknowledged, or failed to reach the disk).
    pub fn truncate(&self, len: u64) -> Result<()> {
        set_len(&self.file, &self.path, len)?;
        self.room.store(len, Ordering::Relaxed);
        self.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsynced_atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("marker.json");
        #[cfg(feature = "fs-recording")]
        let rec = crate::fsrecord::Recording::start(dir.path());
        write_atomic_unsynced(&path, b"first").unwrap();
        write_atomic_unsynced(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("marker.json")]);
        #[cfg(feature = "fs-recording")]
        {
            let ops = rec.ops();
            assert!(
                !ops.iter()
                    .any(|op| matches!(op, FsOp::Fsync { .. } | FsOp::SyncData { .. })),
                "no sync: {ops:?}"
            );
            assert_eq!(
                ops.iter()
                    .filter(|op| matches!(op, FsOp::Rename { .. }))
                    .count(),
                2
            );
        }
    }

    #[test]
    fn an_append_file_grows_in_steps_of_zeros_and_appends_within_them_keep_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let f = AppendFile::create(&path).unwrap();
        let len = || std::fs::metadata(&path).unwrap().len();
        assert_eq!(len(), 0);
        f.write_at(0, b"first").unwrap();
        assert_eq!(len(), APPEND_ROOM);
        let mut end = 5;
        while end + 1000 < APPEND_ROOM {
            f.write_at(end, &[7; 1000]).unwrap();
            end += 1000;
        }
        assert_eq!(len(), APPEND_ROOM, "appends within the room");
        f.write_at(end, &[7; 1000]).unwrap();
        end += 1000;
        assert_eq!(len(), 2 * APPEND_ROOM);
        f.sync_data().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..5], b"first");
        assert!(bytes[5..end as usize].iter().all(|&b| b == 7));
        assert!(bytes[end as usize..].iter().all(|&b| b == 0));
        // Opened again, its zeros are room; cut back, the room goes.
        drop(f);
        let f = AppendFile::open(&path).unwrap();
        f.write_at(end, b"more").unwrap();
        assert_eq!(len(), 2 * APPEND_ROOM);
        f.truncate(end).unwrap();
        assert_eq!(len(), end);
        f.write_at(end, b"more").unwrap();
        assert_eq!(len(), (end + 5).next_multiple_of(APPEND_ROOM));
    }

    #[test]
    fn a_durable_append_within_the_room_keeps_the_length_and_one_past_it_grows_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let f = AppendFile::create(&path).unwrap();
        let len = || std::fs::metadata(&path).unwrap().len();
        // The first append has no room yet: it grows the file.
        f.write_durable_at(0, b"first").unwrap();
        assert_eq!(len(), APPEND_ROOM);
        let mut end = 5;
        while end + 100 < APPEND_ROOM {
            f.write_durable_at(end, &[9; 100]).unwrap();
            end += 100;
        }
        assert_eq!(len(), APPEND_ROOM, "appends within the room");
        f.write_durable_at(end, &[8; 100]).unwrap();
        assert_eq!(len(), 2 * APPEND_ROOM, "an append past the room");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..5], b"first");
        assert!(bytes[5..end as usize].iter().all(|&b| b == 9));
        assert!(bytes[end as usize..end as usize + 100]
            .iter()
            .all(|&b| b == 8));
        assert!(bytes[end as usize + 100..].iter().all(|&b| b == 0));
    }

    /// Rule 7 of the power-loss model: after a write with `RWF_DSYNC` returns, no
    /// crash state lacks it; an ordinary write before it, not yet synced, may
    /// still be lost or cut short.
    #[cfg(feature = "fs-recording")]
    #[test]
    fn a_dsync_write_is_in_every_crash_state_an_unsynced_one_is_not() {
        use crate::fsrecord::{Model, Recording};
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap().join("root");
        std::fs::create_dir(&root).unwrap();
        let path = root.join("log");
        let f = AppendFile::create(&path).unwrap();
        f.write_durable_at(0, b"made room").unwrap();
        let mut model = Model::scan(&root);
        let rec = Recording::start(&root);
        f.write_at(100, b"loose").unwrap();
        f.write_durable_at(200, b"durable").unwrap();
        let ops = rec.ops();
        assert!(
            ops.iter().any(|op| matches!(
                op,
                FsOp::SyncRange {
                    offset: 200,
                    len: 7,
                    ..
                }
            )),
            "the durable write took one call: {ops:?}"
        );
        let mut states_before_return = Vec::new();
        for op in &ops {
            if matches!(op, FsOp::SyncRange { .. }) {
                states_before_return = model.crash_states();
            }
            model.apply(op);
        }
        let at = |t: &crate::fsrecord::Tree, range: std::ops::Range<usize>| {
            let d = t[std::path::Path::new("log")].as_ref().unwrap();
            d.bytes.get(range).map(<[u8]>::to_vec).unwrap_or_default()
        };
        let after = model.crash_states();
        assert!(after.len() > 1, "the loose write may be lost: {after:?}");
        for t in &after {
            assert_eq!(at(t, 0..9), b"made room");
            assert_eq!(at(t, 200..207), b"durable");
        }
        assert!(after.iter().any(|t| at(t, 100..105) != b"loose"));
        assert!(
            states_before_return
                .iter()
                .any(|t| at(t, 200..207) != b"durable"),
            "until it returns it may be lost"
        );
    }

    #[test]
    fn temp_path() {
        assert_eq!(
            temp_path_for(Path::new("/s/vol-1.json")).unwrap(),
            PathBuf::from("/s/.vol-1.json.tmp")
        );
        assert!(temp_path_for(Path::new("/")).is_err());
    }
}
