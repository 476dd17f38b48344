//! Copies of files on the pools: reflinks (FICLONE, constant time and space)
//! where the filesystem can, else sparse-aware copies that never read holes
//! (SEEK_DATA/SEEK_HOLE, copy_file_range). Each new file is made durable
//! before it is handed back, unless the caller asks for an unsynced copy.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Result, SysError};
use crate::file::{
    create_unsynced_with, create_with, fsync_dir, open_read, parent_dir, remove_file_if_exists,
    set_len, sync_path,
};
use crate::fsrecord::{note, FsOp};

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

/// Make `dst` (which must not exist) a reflink copy of `src` with FICLONE: O(1) in
/// time and space. Returns Unsupported when the filesystem cannot (ext4, another
/// filesystem, ...); `dst` is then removed.
pub fn reflink(src: &Path, dst: &Path) -> Result<()> {
    let s = open_read(src)?;
    create_with(dst, 0o600, |d| clone_into(d, &s, src, dst))
}

/// [`reflink`] not made durable: for a copy that must end quickly;
/// [`make_new_file_durable`] makes it durable afterwards.
pub fn reflink_unsynced(src: &Path, dst: &Path) -> Result<()> {
    let s = open_read(src)?;
    create_unsynced_with(dst, 0o600, |d| clone_into(d, &s, src, dst))
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
    create_with(dst, 0o600, |d| sparse_fill(&s, src, d, dst))
}

/// Fills the new, empty file `d` with the data extents of `s`, leaving holes
/// where `s` has them.
fn sparse_fill(s: &File, src: &Path, d: &File, dst: &Path) -> Result<()> {
    let len = s
        .metadata()
        .map_err(|e| SysError::io("stat", src, e))?
        .len();
    // Size first: everything not written below is a hole of the right length.
    set_len(d, dst, len)?;
    let mut copier = RangeCopier {
        src: s,
        dst: d,
        src_path: src,
        dst_path: dst,
        use_copy_file_range: true,
        buf: Vec::new(),
    };
    for range in crate::extents::data_ranges(s, src, 0, len)? {
        copier.copy(range.offset, range.end())?;
    }
    note(|| FsOp::CopyData {
        src: src.into(),
        dst: dst.into(),
    });
    Ok(())
}

/// Makes the new, empty file `d` a copy of the open file `s`: a reflink when
/// the filesystem can, else a sparse copy. Nothing is synced.
pub(crate) fn copy_open_file(s: &File, src: &Path, d: &File, dst: &Path) -> Result<()> {
    match clone_into(d, s, src, dst) {
        Err(e) if e.is_unsupported() => sparse_fill(s, src, d, dst),
        other => other,
    }
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
