//! Reading and writing the data of an image file at offsets, for the
//! transfer of a volume between nodes: the source reads its allocated ranges,
//! the target writes what arrives, leaves zeros as holes, and makes it durable
//! with `fdatasync` at its checkpoints.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Result, SysError};
use crate::extents::ByteRange;
use crate::fsrecord::{note, FsOp};

/// Granularity of holes: a block of zeros this large is left a hole.
pub const BLOCK: u64 = 4096;

/// An image opened for reading.
pub struct ImageReader {
    file: File,
    path: PathBuf,
    len: u64,
}

impl ImageReader {
    pub fn open(path: &Path) -> Result<ImageReader> {
        let file = crate::extents::open_read(path)?;
        let len = crate::extents::len(&file, path)?;
        Ok(ImageReader {
            file,
            path: path.into(),
            len,
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The data ranges within `[start, end)` (SEEK_DATA / SEEK_HOLE).
    pub fn data_ranges(&self, start: u64, end: u64) -> Result<Vec<ByteRange>> {
        crate::extents::data_ranges(&self.file, &self.path, start, end.min(self.len))
    }

    /// Fills `buf` from `offset`; past the end reads zeros.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let n = self
                .file
                .read_at(&mut buf[done..], offset + done as u64)
                .map_err(|e| SysError::io("read", &self.path, e))?;
            if n == 0 {
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok(())
    }

    /// Starts reading `[offset, offset + len)` into the page cache without
    /// waiting for it, for a read that comes soon. Only a hint: the read
    /// works the same when it fails.
    pub fn read_soon(&self, offset: u64, len: u64) {
        use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
        let (Ok(o), Ok(l)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        let _ = posix_fadvise(&self.file, o, l, PosixFadviseAdvice::POSIX_FADV_WILLNEED);
    }

    /// The open file, for the calls that compare extents.
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// An existing image opened for writing at offsets.
pub struct ImageWriter {
    file: File,
    path: PathBuf,
}

impl ImageWriter {
    pub fn open(path: &Path) -> Result<ImageWriter> {
        let file = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| SysError::io("open", path, e))?;
        Ok(ImageWriter {
            file,
            path: path.into(),
        })
    }

    /// Writes `data` at `offset`. With `holes`, runs of whole zero blocks are
    /// punched out instead of written (where the file may hold other data);
    /// without, they are skipped (the file holds holes there already).
    pub fn write_sparse(&self, offset: u64, data: &[u8], holes: bool) -> Result<()> {
        let mut pos = 0usize;
        while pos < data.len() {
            let zero = is_zero_block(data, pos);
            let mut end = pos;
            while end < data.len() && is_zero_block(data, end) == zero {
                end = (end + BLOCK as usize).min(data.len());
            }
            let at = offset + pos as u64;
            match zero {
                false => self.write_at(at, &data[pos..end])?,
                true if holes => self.punch(at, (end - pos) as u64)?,
                true => {}
            }
            pos = end;
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.file
            .write_all_at(data, offset)
            .map_err(|e| SysError::io("write", &self.path, e))?;
        note(|| FsOp::Other {
            what: "data written at an offset",
            path: self.path.clone(),
        });
        Ok(())
    }

    /// Makes `[offset, offset + len)` a hole (reads as zeros), the file's length
    /// kept.
    pub fn punch(&self, offset: u64, len: u64) -> Result<()> {
        use nix::fcntl::{fallocate, FallocateFlags};
        if len == 0 {
            return Ok(());
        }
        let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
        let (o, l) = (to_off(offset, &self.path)?, to_off(len, &self.path)?);
        match fallocate(&self.file, flags, o, l) {
            Ok(()) => Ok(()),
            // No hole punching here: write the zeros.
            Err(nix::errno::Errno::EOPNOTSUPP) => {
                let zeros = vec![0u8; len.min(1 << 20) as usize];
                let mut at = offset;
                while at < offset + len {
                    let n = (offset + len - at).min(zeros.len() as u64) as usize;
                    self.write_at(at, &zeros[..n])?;
                    at += n as u64;
                }
                Ok(())
            }
            Err(e) => Err(SysError::io("punch a hole in", &self.path, e.into())),
        }
    }

    /// Starts writing `[offset, offset + len)` back to the disk, without
    /// waiting for it (`sync_file_range` with `SYNC_FILE_RANGE_WRITE`): a
    /// stream of writes then reaches the disk as it comes, and the next
    /// [`Self::sync_data`] finds little left to flush. Makes nothing durable
    /// (no metadata, no cache flush); only a hint.
    pub fn start_writeback(&self, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (o, l) = (to_off(offset, &self.path)?, to_off(len, &self.path)?);
        // SAFETY: sync_file_range reads no memory of ours; the descriptor stays
        // open for the call.
        let r = unsafe {
            libc::sync_file_range(self.file.as_raw_fd(), o, l, libc::SYNC_FILE_RANGE_WRITE)
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return Err(SysError::io("start the writeback of", &self.path, e));
        }
        Ok(())
    }

    /// Makes what was written durable (data and length).
    pub fn sync_data(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| SysError::io("fdatasync", &self.path, e))?;
        note(|| FsOp::SyncData {
            path: self.path.clone(),
        });
        Ok(())
    }
}

fn to_off(n: u64, path: &Path) -> Result<i64> {
    i64::try_from(n).map_err(|_| SysError::InvalidArgument {
        what: format!("offset {n} in {}", path.display()),
    })
}

/// Whether the block of `data` starting at `pos` holds only zeros.
fn is_zero_block(data: &[u8], pos: usize) -> bool {
    let end = (pos + BLOCK as usize).min(data.len());
    data[pos..end].iter().all(|b| *b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_blocks_stay_holes_or_become_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let f = File::create(&path).unwrap();
        f.set_len(1 << 20).unwrap();
        f.write_all_at(&[7u8; 1 << 20], 0).unwrap();
        drop(f);
        let w = ImageWriter::open(&path).unwrap();
        let mut data = vec![0u8; 3 * BLOCK as usize];
        data[BLOCK as usize..2 * BLOCK as usize].fill(9);
        // Over old data: the zero blocks must read as zeros afterwards.
        w.write_sparse(0, &data, true).unwrap();
        w.sync_data().unwrap();
        let r = ImageReader::open(&path).unwrap();
        let mut back = vec![1u8; 3 * BLOCK as usize];
        r.read_at(0, &mut back).unwrap();
        assert_eq!(back, data);
        let mut rest = vec![0u8; BLOCK as usize];
        r.read_at(3 * BLOCK, &mut rest).unwrap();
        assert!(rest.iter().all(|b| *b == 7), "beyond the write: untouched");
        // Past the end reads zeros.
        let mut tail = vec![1u8; 16];
        r.read_at((1 << 20) - 8, &mut tail).unwrap();
        assert_eq!(&tail[..8], &[7u8; 8]);
        assert_eq!(&tail[8..], &[0u8; 8]);
    }
}
