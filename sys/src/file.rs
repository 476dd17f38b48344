//! File operations on the pools: sparse images, reflinks, sparse-aware copies,
//! directory tree copies, crash-safe writes and filesystem figures.
//!
//! These work on real files only (no trait, no fake): the tests run them on real
//! filesystems. Every function that creates a file makes it durable (fsync of the
//! file and of its directory) before it returns, because the domain records the
//! outcome right after and a crash must not leave a record pointing at nothing.
//! Files are created with O_EXCL so that a retry never silently overwrites data.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{
    DirBuilderExt, FileExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt,
};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::stat::{Mode, SFlag};
use nix::sys::statvfs::FsFlags;
use nix::sys::time::TimeSpec;

use crate::error::{Result, SysError};
use crate::fsrecord::{note, FsOp};
use crate::FsStats;

// FICLONE: share all extents of the source file, given by its descriptor.
nix::ioctl_write_int_bad!(ficlone, libc::FICLONE);

/// Errnos with which FICLONE / copy_file_range say "not here" (another filesystem,
/// no reflink support, not a regular file) rather than "went wrong".
fn is_unsupported_errno(errno: Option<i32>) -> bool {
    matches!(
        errno,
        Some(libc::EOPNOTSUPP)
            | Some(libc::EXDEV)
            | Some(libc::EINVAL)
            | Some(libc::ENOTTY)
            | Some(libc::EBADF)
            | Some(libc::ENOSYS)
    )
}

/// A path with a NUL byte cannot reach the kernel; say so clearly instead of
/// letting the call fail with EINVAL.
pub(crate) fn check_path(path: &Path) -> Result<()> {
    if path.as_os_str().as_bytes().contains(&0) {
        return Err(SysError::InvalidArgument {
            what: format!("path {} contains a NUL byte", path.display()),
        });
    }
    Ok(())
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Open a new file with O_EXCL and `mode`: an existing file is an Io error of kind
/// AlreadyExists.
fn create_new(path: &Path, mode: u32) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| SysError::io("create", path, e))
        .inspect(|_| {
            note(|| FsOp::Create {
                path: path.into(),
                truncate: false,
            })
        })
}

fn fsync(file: &File, path: &Path) -> Result<()> {
    file.sync_all()
        .map_err(|e| SysError::io("fsync", path, e))?;
    note(|| FsOp::Fsync { path: path.into() });
    Ok(())
}

fn set_len(file: &File, path: &Path, len: u64) -> Result<()> {
    file.set_len(len)
        .map_err(|e| SysError::io("set size of", path, e))?;
    note(|| FsOp::SetLen {
        path: path.into(),
        len,
    });
    Ok(())
}

fn open_read(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| SysError::io("open", path, e))
}

/// Run `fill` on a freshly created file and make it durable; on any failure remove
/// the file again so that no half-written copy is left for a retry to trip over.
pub(crate) fn create_with<F>(path: &Path, mode: u32, fill: F) -> Result<()>
where
    F: FnOnce(&File) -> Result<()>,
{
    create_unsynced_with(path, mode, |file| {
        fill(file)
            .and_then(|()| fsync(file, path))
            .and_then(|()| fsync_dir(parent_dir(path)))
    })
}

/// [`create_with`] without making anything durable.
pub(crate) fn create_unsynced_with<F>(path: &Path, mode: u32, fill: F) -> Result<()>
where
    F: FnOnce(&File) -> Result<()>,
{
    let file = create_new(path, mode)?;
    let res = fill(&file);
    if res.is_err() {
        drop(file);
        let _ = remove_file_if_exists(path);
    }
    res
}

/// Create a new sparse file of `size` bytes (mode 0600). Fails with an Io error of
/// kind AlreadyExists when `path` exists.
pub fn create_sparse(path: &Path, size: u64) -> Result<()> {
    create_with(path, 0o600, |f| set_len(f, path, size))
}

/// Grow the file at `path` to `size` bytes; a file already that large is left as
/// it is (never shrunk).
pub fn grow(path: &Path, size: u64) -> Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| SysError::io("open", path, e))?;
    let len = f
        .metadata()
        .map_err(|e| SysError::io("stat", path, e))?
        .len();
    if len >= size {
        return Ok(());
    }
    set_len(&f, path, size)?;
    fsync(&f, path)
}

/// Make `dst` (which must not exist) a reflink copy of `src` with FICLONE: O(1) in
/// time and space. Returns Unsupported when the filesystem cannot (ext4, another
/// filesystem, ...); `dst` is then removed.
pub fn reflink(src: &Path, dst: &Path) -> Result<()> {
    let s = open_read(src)?;
    create_with(dst, 0o600, |d| clone_into(d, &s, src, dst))
}

/// Shares every extent of `s` (opened from `src`) with the file `d` (at `dst`)
/// with FICLONE: what `d` held over the source's length is replaced.
/// Unsupported when the filesystem cannot.
pub(crate) fn clone_into(d: &File, s: &File, src: &Path, dst: &Path) -> Result<()> {
    // SAFETY: FICLONE takes the source's descriptor by value; both stay open
    // for the duration of the call.
    let r = unsafe { ficlone(d.as_raw_fd(), s.as_raw_fd()) };
    let Err(errno) = r else {
        note(|| FsOp::CopyData {
            src: src.into(),
            dst: dst.into(),
        });
        return Ok(());
    };
    let e = io::Error::from(errno);
    if is_unsupported_errno(e.raw_os_error()) {
        Err(SysError::Unsupported {
            what: format!(
                "reflink (FICLONE) of {} to {}: {e}",
                src.display(),
                dst.display()
            ),
        })
    } else {
        Err(SysError::io("reflink to", dst, e))
    }
}

/// Copy `src` to the new file `dst`, copying only data extents (SEEK_DATA /
/// SEEK_HOLE) so that holes stay holes. Uses copy_file_range (which itself shares
/// extents on xfs and btrfs) and falls back to read/write, skipping zero blocks.
pub fn sparse_copy(src: &Path, dst: &Path) -> Result<()> {
    let s = open_read(src)?;
    let len = s
        .metadata()
        .map_err(|e| SysError::io("stat", src, e))?
        .len();
    create_with(dst, 0o600, |d| {
        // Size first: everything not written below is a hole of the right length.
        set_len(d, dst, len)?;
        let mut copier = RangeCopier {
            src: &s,
            dst: d,
            src_path: src,
            dst_path: dst,
            use_copy_file_range: true,
            buf: Vec::new(),
        };
        for range in crate::extents::data_ranges(&s, src, 0, len)? {
            copier.copy(range.offset, range.end())?;
        }
        note(|| FsOp::CopyData {
            src: src.into(),
            dst: dst.into(),
        });
        Ok(())
    })
}

struct RangeCopier<'a> {
    src: &'a File,
    dst: &'a File,
    src_path: &'a Path,
    dst_path: &'a Path,
    use_copy_file_range: bool,
    buf: Vec<u8>,
}

impl RangeCopier<'_> {
    /// Copy bytes [start, end) at the same offsets.
    fn copy(&mut self, mut start: u64, end: u64) -> Result<()> {
        const CHUNK: u64 = 1 << 20;
        while start < end {
            if self.use_copy_file_range {
                let mut off_in = start as i64;
                let mut off_out = start as i64;
                let want = (end - start).min(1 << 30) as usize;
                match nix::fcntl::copy_file_range(
                    self.src,
                    Some(&mut off_in),
                    self.dst,
                    Some(&mut off_out),
                    want,
                ) {
                    // The source shrank under us: nothing more to read.
                    Ok(0) => return Ok(()),
                    Ok(n) => start += n as u64,
                    Err(e) if is_unsupported_errno(Some(e as i32)) => {
                        self.use_copy_file_range = false
                    }
                    Err(e) => {
                        return Err(SysError::io("copy_file_range to", self.dst_path, e.into()))
                    }
                }
                continue;
            }
            let want = (end - start).min(CHUNK) as usize;
            self.buf.resize(want, 0);
            let n = self
                .src
                .read_at(&mut self.buf[..want], start)
                .map_err(|e| SysError::io("read", self.src_path, e))?;
            if n == 0 {
                return Ok(());
            }
            let chunk = &self.buf[..n];
            // The destination was sized up front: skipping zeros leaves holes.
            if chunk.iter().any(|b| *b != 0) {
                self.dst
                    .write_all_at(chunk, start)
                    .map_err(|e| SysError::io("write", self.dst_path, e))?;
            }
            start += n as u64;
        }
        Ok(())
    }
}

/// Copy `src` to the new file `dst`: a reflink when the filesystem can (returns
/// true), else a sparse-aware copy (returns false).
pub fn copy_file(src: &Path, dst: &Path) -> Result<bool> {
    copy_file_with(src, dst, true)
}

/// [`copy_file`] whose reflink is not made durable, for a copy that must end
/// quickly (its source frozen meanwhile); [`make_new_file_durable`] makes it
/// durable afterwards. A sparse copy (no reflink) is synced as it is made.
pub fn copy_file_unsynced(src: &Path, dst: &Path) -> Result<bool> {
    copy_file_with(src, dst, false)
}

fn copy_file_with(src: &Path, dst: &Path, durable: bool) -> Result<bool> {
    let s = open_read(src)?;
    let clone = |d: &File| clone_into(d, &s, src, dst);
    let reflinked = match durable {
        true => create_with(dst, 0o600, clone),
        false => create_unsynced_with(dst, 0o600, clone),
    };
    match reflinked {
        Ok(()) => Ok(true),
        Err(e) if e.is_unsupported() => {
            tracing::debug!(src = %src.display(), dst = %dst.display(), "no reflink, sparse copy");
            sparse_copy(src, dst).map(|()| false)
        }
        Err(e) => Err(e),
    }
}

/// Makes a file made by this process durable: its data, length and attributes,
/// then its entry in its folder.
pub fn make_new_file_durable(path: &Path) -> Result<()> {
    sync_path(path)?;
    fsync_dir(parent_dir(path))
}

/// Copy the directory tree `src_dir` into `dst_dir` (created when missing; entries
/// must not exist in it yet). Regular files go through [`copy_file`] (reflinks where
/// possible), symlinks are recreated (never followed), fifos and device nodes are
/// recreated with mknod, sockets are skipped. Owner, mode and atime/mtime are kept;
/// extended attributes, ACLs and hard links are not (a hard-linked file becomes
/// separate copies). `dst_dir` may not lie inside `src_dir`. Filesystems mounted
/// inside `src_dir` are copied as seen (the walk does not stop at mount points).
pub fn copy_tree(src_dir: &Path, dst_dir: &Path) -> Result<()> {
    let root_meta = fs::symlink_metadata(src_dir).map_err(|e| SysError::io("stat", src_dir, e))?;
    if !root_meta.is_dir() {
        return Err(SysError::InvalidArgument {
            what: format!("copy_tree source {} is not a directory", src_dir.display()),
        });
    }
    let src_real = fs::canonicalize(src_dir).map_err(|e| SysError::io("resolve", src_dir, e))?;
    if resolve_maybe_missing(dst_dir)?.starts_with(&src_real) {
        return Err(SysError::InvalidArgument {
            what: format!(
                "copy_tree destination {} lies inside its source {}",
                dst_dir.display(),
                src_dir.display()
            ),
        });
    }
    make_dir(dst_dir)?;

    // Directories get their metadata after their contents are in place (adding
    // entries would change their mtime), deepest first.
    let mut dirs: Vec<(PathBuf, fs::Metadata)> = vec![(dst_dir.to_path_buf(), root_meta)];
    let mut stack: Vec<(PathBuf, PathBuf)> = vec![(src_dir.to_path_buf(), dst_dir.to_path_buf())];
    while let Some((s, d)) = stack.pop() {
        let entries = fs::read_dir(&s).map_err(|e| SysError::io("read directory", &s, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| SysError::io("read directory", &s, e))?;
            let sp = entry.path();
            let dp = d.join(entry.file_name());
            let m = fs::symlink_metadata(&sp).map_err(|e| SysError::io("stat", &sp, e))?;
            let ft = m.file_type();
            if ft.is_dir() {
                make_dir(&dp)?;
                dirs.push((dp.clone(), m));
                stack.push((sp, dp));
            } else if ft.is_file() {
                copy_file(&sp, &dp)?;
                apply_metadata(&dp, &m)?;
            } else if ft.is_symlink() {
                let target = fs::read_link(&sp).map_err(|e| SysError::io("read link", &sp, e))?;
                std::os::unix::fs::symlink(&target, &dp)
                    .map_err(|e| SysError::io("create symlink", &dp, e))?;
                note(|| FsOp::Other {
                    what: "a symlink",
                    path: dp.clone(),
                });
                apply_metadata(&dp, &m)?;
            } else if ft.is_fifo() || ft.is_char_device() || ft.is_block_device() {
                let kind = SFlag::from_bits_truncate(m.mode() & SFlag::S_IFMT.bits());
                let perm = Mode::from_bits_truncate(m.mode() & !SFlag::S_IFMT.bits());
                nix::sys::stat::mknod(&dp, kind, perm, m.rdev())
                    .map_err(|e| SysError::io("mknod", &dp, e.into()))?;
                note(|| FsOp::Other {
                    what: "a device node",
                    path: dp.clone(),
                });
                apply_metadata(&dp, &m)?;
            } else {
                // A socket is only meaningful to the process that bound it.
                tracing::debug!(path = %sp.display(), "copy_tree skips a socket");
            }
        }
    }
    for (d, m) in dirs.iter().rev() {
        apply_metadata(d, m)?;
    }
    // One syncfs makes the whole copy durable, cheaper than an fsync per file.
    syncfs(dst_dir)
}

/// syncfs of the filesystem holding `path`: everything written to it so far,
/// data and metadata of every file, is durable (and a writeback error of that
/// filesystem that no caller has been told of yet is reported).
pub fn syncfs(path: &Path) -> Result<()> {
    let f = open_read(path)?;
    nix::unistd::syncfs(&f).map_err(|e| SysError::io("syncfs", path, e.into()))?;
    note(|| FsOp::SyncFs { path: path.into() });
    Ok(())
}

/// The absolute, symlink-resolved form of a path whose last components may not
/// exist yet.
fn resolve_maybe_missing(path: &Path) -> Result<PathBuf> {
    let mut missing = Vec::new();
    let mut cur = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| SysError::io("get current directory for", path, e))?
            .join(path)
    };
    loop {
        match fs::canonicalize(&cur) {
            Ok(real) => {
                return Ok(missing
                    .iter()
                    .rev()
                    .fold(real, |p, c: &std::ffi::OsString| p.join(c)));
            }
            Err(_) => match (cur.file_name(), cur.parent()) {
                (Some(name), Some(parent)) => {
                    missing.push(name.to_os_string());
                    cur = parent.to_path_buf();
                }
                _ => return Ok(cur),
            },
        }
    }
}

fn make_dir(path: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {
            note(|| FsOp::Mkdir { path: path.into() });
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) => Err(SysError::io("create directory", path, e)),
    }
}

/// Owner, then mode (chown clears setuid bits), then times, without following a
/// symlink at `path`.
fn apply_metadata(path: &Path, m: &fs::Metadata) -> Result<()> {
    std::os::unix::fs::lchown(path, Some(m.uid()), Some(m.gid()))
        .map_err(|e| SysError::io("chown", path, e))?;
    if !m.file_type().is_symlink() {
        fs::set_permissions(path, fs::Permissions::from_mode(m.mode() & 0o7777))
            .map_err(|e| SysError::io("chmod", path, e))?;
    }
    check_path(path)?;
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &TimeSpec::new(m.atime(), m.atime_nsec()),
        &TimeSpec::new(m.mtime(), m.mtime_nsec()),
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| SysError::io("set times of", path, e.into()))
}

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

/// Creates a new sparse file of `size` bytes (mode 0600) without making it
/// durable: for data that recovery can make again from its record when a power
/// loss takes it. AlreadyExists when `path` exists.
pub fn create_sparse_unsynced(path: &Path, size: u64) -> Result<()> {
    let f = create_new(path, 0o600)?;
    if let Err(e) = set_len(&f, path, size) {
        drop(f);
        let _ = remove_file_if_exists(path);
        return Err(e);
    }
    Ok(())
}

/// fsync a file by its path, making its data and attributes (xattrs) durable.
pub fn sync_path(path: &Path) -> Result<()> {
    fsync(&open_read(path)?, path)
}

/// fsync a directory, making the creation, removal or rename of its entries durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let d = open_read(dir)?;
    d.sync_all()
        .map_err(|e| SysError::io("fsync directory", dir, e))?;
    note(|| FsOp::Fsync { path: dir.into() });
    Ok(())
}

/// Remove a file (or symlink); a missing one is Ok(false).
pub fn remove_file_if_exists(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            note(|| FsOp::Unlink { path: path.into() });
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(SysError::io("remove", path, e)),
    }
}

/// Remove `path` and, when it is a directory, everything below it. Symlinks are
/// removed, never followed. A missing path is Ok. Refuses (Busy) when anything is
/// mounted at or below `path`, so that a forgotten mount does not lose the data of
/// the filesystem mounted there.
pub fn remove_tree(path: &Path) -> Result<()> {
    let m = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(SysError::io("stat", path, e)),
    };
    if !m.is_dir() {
        return remove_file_if_exists(path).map(|_| ());
    }
    let real = fs::canonicalize(path).map_err(|e| SysError::io("resolve", path, e))?;
    let table = crate::mountinfo::read()?;
    if let Some(busy) = crate::mountinfo::mounts_under(&table, &real).first() {
        return Err(SysError::Busy {
            what: format!(
                "will not remove {}: {} is mounted at {}",
                path.display(),
                busy.source,
                busy.mount_point.display()
            ),
        });
    }
    // std's remove_dir_all does not follow symlinks (it removes the link).
    match fs::remove_dir_all(path) {
        Ok(()) => {
            note(|| FsOp::RemoveTree { path: path.into() });
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SysError::io("remove tree", path, e)),
    }
}

/// Bytes allocated on disk for the file (st_blocks * 512), less than its length
/// when it is sparse.
pub fn allocated_bytes(path: &Path) -> Result<u64> {
    let m = fs::metadata(path).map_err(|e| SysError::io("stat", path, e))?;
    Ok(m.blocks().saturating_mul(512))
}

/// The length of the file in bytes.
pub fn file_len(path: &Path) -> Result<u64> {
    let m = fs::metadata(path).map_err(|e| SysError::io("stat", path, e))?;
    Ok(m.len())
}

/// Whether FICLONE works in folder `dir`: two hidden probe files are created,
/// cloned and removed. Any failure answers false. Nothing is synced: the clone
/// writes the source's data back itself, and the files are thrown away (start-up
/// probes every pool, and a sync there costs what the rest of a start does).
pub fn probe_reflink(dir: &Path) -> bool {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let a = dir.join(format!(".csi-reflink-probe-{}-{n}.a", std::process::id()));
    let b = dir.join(format!(".csi-reflink-probe-{}-{n}.b", std::process::id()));
    let ok = create_unsynced_with(&a, 0o600, |f| {
        f.write_all_at(&[0x5a; 4096], 0)
            .map_err(|e| SysError::io("write", &a, e))?;
        note(|| FsOp::Write {
            path: a.clone(),
            offset: 0,
            data: vec![0x5a; 4096],
        });
        Ok(())
    })
    .and_then(|()| {
        let s = open_read(&a)?;
        create_unsynced_with(&b, 0o600, |d| clone_into(d, &s, &a, &b))
    });
    let _ = remove_file_if_exists(&a);
    let _ = remove_file_if_exists(&b);
    match ok {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "reflink probe failed");
            false
        }
    }
}

/// statvfs figures of the filesystem holding `path`, in bytes and inodes.
pub fn statvfs(path: &Path) -> Result<FsStats> {
    check_path(path)?;
    let st =
        nix::sys::statvfs::statvfs(path).map_err(|e| SysError::io("statvfs", path, e.into()))?;
    let frsize = st.fragment_size();
    Ok(FsStats {
        total_bytes: st.blocks().saturating_mul(frsize),
        free_bytes: st.blocks_free().saturating_mul(frsize),
        available_bytes: st.blocks_available().saturating_mul(frsize),
        total_inodes: st.files(),
        free_inodes: st.files_free(),
        read_only: st.flags().contains(FsFlags::ST_RDONLY),
    })
}

/// The type of the filesystem holding `path`, from the statfs magic: "ext4" (also
/// for ext2/ext3, which share the magic), "xfs", "btrfs", "tmpfs", "overlay", ...;
/// an unknown magic as hex ("0x1234abcd").
pub fn fs_type_name(path: &Path) -> Result<String> {
    check_path(path)?;
    let st = nix::sys::statfs::statfs(path).map_err(|e| SysError::io("statfs", path, e.into()))?;
    // f_type is signed on some targets; the magics are 32-bit values.
    let magic = st.filesystem_type().0 as u64 & 0xffff_ffff;
    Ok(magic_name(magic))
}

fn magic_name(magic: u64) -> String {
    let name = match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlay",
        0x8584_58F6 => "ramfs",
        0xF2F5_2010 => "f2fs",
        0x2FC1_2FC1 => "zfs",
        0x6969 => "nfs",
        0x6573_5546 => "fuse",
        0x7371_7368 => "squashfs",
        0x9FA0 => "proc",
        0x6265_6572 => "sysfs",
        _ => return format!("{magic:#x}"),
    };
    name.to_string()
}

/// Create `path` and its missing parents, durably; each folder created here gets
/// exactly `mode` (whatever the umask). Existing folders are left as they are.
pub fn mkdir_p_mode(path: &Path, mode: u32) -> Result<()> {
    let mut missing = Vec::new();
    let mut cur = path;
    loop {
        match fs::symlink_metadata(cur) {
            Ok(m) if m.is_dir() => break,
            Ok(_) if fs::metadata(cur).map(|m| m.is_dir()).unwrap_or(false) => break,
            Ok(_) => {
                return Err(SysError::Io {
                    op: "create directory",
                    path: cur.to_path_buf(),
                    source: io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "exists and is not a directory",
                    ),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                missing.push(cur);
                match cur.parent() {
                    Some(p) if !p.as_os_str().is_empty() => cur = p,
                    _ => break,
                }
            }
            Err(e) => return Err(SysError::io("stat", cur, e)),
        }
    }
    for dir in missing.into_iter().rev() {
        match fs::DirBuilder::new().mode(mode).create(dir) {
            Ok(()) => {
                note(|| FsOp::Mkdir { path: dir.into() });
                fs::set_permissions(dir, fs::Permissions::from_mode(mode))
                    .map_err(|e| SysError::io("chmod", dir, e))?
            }
            // Another thread made it meanwhile: fine.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(SysError::io("create directory", dir, e)),
        }
        // The new entry is durable only once its parent is synced; without this a
        // power loss can take the folder, and every record later synced inside it.
        fsync_dir(parent_dir(dir))?;
    }
    Ok(())
}

/// Group read/write, search, and setgid (so new files inherit the group): what a
/// directory shared with a group has.
const GROUP_DIR_BITS: u32 = 0o2070;
/// Group read/write: what a file shared with a group has.
const GROUP_FILE_BITS: u32 = 0o060;

/// Gives a directory to group `gid` with group read/write/search and the setgid bit,
/// so that files made in it inherit the group.
pub fn share_with_group(dir: &Path, gid: u32) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = fs::metadata(dir).map_err(|e| SysError::io("stat", dir, e))?;
    if meta.gid() != gid {
        std::os::unix::fs::chown(dir, None, Some(gid))
            .map_err(|e| SysError::io("chown", dir, e))?;
    }
    let mode = meta.permissions().mode() | GROUP_DIR_BITS;
    fs::set_permissions(dir, fs::Permissions::from_mode(mode))
        .map_err(|e| SysError::io("chmod", dir, e))
}

/// Whether `dir` is shared with group `gid` as [`share_with_group`] leaves it.
pub fn is_shared_with_group(dir: &Path, gid: u32) -> Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(dir).map_err(|e| SysError::io("stat", dir, e))?;
    Ok(meta.gid() == gid && meta.mode() & GROUP_DIR_BITS == GROUP_DIR_BITS)
}

/// Gives every file and directory below `root` on its filesystem to group `gid`
/// (files group read/write, directories also search and setgid; symbolic links
/// only change group): the walk follows no link and does not cross into other
/// mounts. `root` itself is left as it is.
pub fn share_contents_with_group(root: &Path, gid: u32) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let dev = fs::metadata(root)
        .map_err(|e| SysError::io("stat", root, e))?
        .dev();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = fs::read_dir(&dir).map_err(|e| SysError::io("list", &dir, e))?;
        for entry in entries {
            let path = entry.map_err(|e| SysError::io("list", &dir, e))?.path();
            let meta = match fs::symlink_metadata(&path) {
                Ok(m) => m,
                // Removed since it was listed (by a process still exiting).
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(SysError::io("stat", &path, e)),
            };
            if meta.dev() != dev {
                continue;
            }
            give_to_group(&path, &meta, gid)?;
            if meta.is_dir() {
                dirs.push(path);
            }
        }
    }
    Ok(())
}

fn give_to_group(path: &Path, meta: &fs::Metadata, gid: u32) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if meta.gid() != gid {
        std::os::unix::fs::lchown(path, None, Some(gid))
            .map_err(|e| SysError::io("chown", path, e))?;
    }
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    let bits = if meta.is_dir() {
        GROUP_DIR_BITS
    } else {
        GROUP_FILE_BITS
    };
    // chown clears a file's setuid/setgid bits: the mode is set after it, from
    // what it was before.
    let mode = meta.mode() & 0o7777 | bits;
    if meta.gid() != gid || mode != meta.mode() & 0o7777 {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(|e| SysError::io("chmod", path, e))?;
    }
    Ok(())
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
    fn magic_names() {
        assert_eq!(magic_name(0xEF53), "ext4");
        assert_eq!(magic_name(0x58465342), "xfs");
        assert_eq!(magic_name(0x9123683E), "btrfs");
        assert_eq!(magic_name(0x1234abcd), "0x1234abcd");
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
