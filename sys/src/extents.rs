//! The block map of a file: its data ranges (lseek SEEK_DATA / SEEK_HOLE), its
//! physical extents (ioctl FS_IOC_FIEMAP), and a block-by-block comparison of two
//! files. The SnapshotMetadata service builds its answers from these.

/// An open file, as [`open_read`] gives it and the functions here take it.
pub use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use nix::errno::Errno;
use nix::unistd::{lseek, Whence};

use crate::error::{Result, SysError};

/// A byte range of a file or volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteRange {
    pub offset: u64,
    pub length: u64,
}

impl ByteRange {
    pub fn new(offset: u64, length: u64) -> Self {
        ByteRange { offset, length }
    }
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.length)
    }
}

/// Appends `r` to `out`, merging it into the last range when they touch.
/// Ranges must come in ascending order; empty ones are dropped.
pub fn push_merged(out: &mut Vec<ByteRange>, r: ByteRange) {
    if r.length == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if r.offset <= last.end() {
            let end = last.end().max(r.end());
            last.length = end - last.offset;
            return;
        }
    }
    out.push(r);
}

// Flags of a FIEMAP extent (linux/fiemap.h).
pub const FIEMAP_EXTENT_LAST: u32 = 0x0001;
pub const FIEMAP_EXTENT_UNKNOWN: u32 = 0x0002;
pub const FIEMAP_EXTENT_DELALLOC: u32 = 0x0004;
pub const FIEMAP_EXTENT_ENCODED: u32 = 0x0008;
pub const FIEMAP_EXTENT_DATA_ENCRYPTED: u32 = 0x0080;
pub const FIEMAP_EXTENT_NOT_ALIGNED: u32 = 0x0100;
pub const FIEMAP_EXTENT_DATA_INLINE: u32 = 0x0200;
pub const FIEMAP_EXTENT_DATA_TAIL: u32 = 0x0400;
pub const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x0800;
pub const FIEMAP_EXTENT_MERGED: u32 = 0x1000;
pub const FIEMAP_EXTENT_SHARED: u32 = 0x2000;

/// Flush dirty data before mapping, so that delayed allocations get addresses.
const FIEMAP_FLAG_SYNC: u32 = 0x0001;

/// One extent of a file as FIEMAP reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Byte offset in the file.
    pub logical: u64,
    /// Byte address on the device (or, on btrfs, in the filesystem's address space).
    pub physical: u64,
    pub length: u64,
    pub flags: u32,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.logical.saturating_add(self.length)
    }

    /// Whether `physical` cannot be trusted to identify the data: unknown or not
    /// yet allocated, encoded (compressed, encrypted), inline or unaligned.
    pub fn uncertain(&self) -> bool {
        self.flags
            & (FIEMAP_EXTENT_UNKNOWN
                | FIEMAP_EXTENT_DELALLOC
                | FIEMAP_EXTENT_ENCODED
                | FIEMAP_EXTENT_DATA_ENCRYPTED
                | FIEMAP_EXTENT_NOT_ALIGNED
                | FIEMAP_EXTENT_DATA_INLINE
                | FIEMAP_EXTENT_DATA_TAIL)
            != 0
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapHeader {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}

#[repr(C)]
struct FiemapBuf {
    header: FiemapHeader,
    extents: [FiemapExtent; EXTENTS_PER_CALL],
}

const EXTENTS_PER_CALL: usize = 256;

nix::ioctl_readwrite!(fs_ioc_fiemap, b'f', 11, FiemapHeader);

/// Opens a file for reading.
pub fn open_read(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| SysError::io("open", path, e))
}

/// The length of an open file.
pub fn len(f: &File, path: &Path) -> Result<u64> {
    f.metadata()
        .map(|m| m.len())
        .map_err(|e| SysError::io("stat", path, e))
}

/// The data ranges of `f` within `[start, end)`, found with SEEK_DATA/SEEK_HOLE,
/// cut to that window. A filesystem without SEEK_DATA support reports the whole
/// window as data.
pub fn data_ranges(f: &File, path: &Path, start: u64, end: u64) -> Result<Vec<ByteRange>> {
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end {
        let Some(data) = seek(f, pos, Whence::SeekData, path)? else {
            break;
        };
        if data >= end {
            break;
        }
        let hole = seek(f, data, Whence::SeekHole, path)?
            .unwrap_or(end)
            .min(end);
        if hole <= data {
            // Nonsense from the filesystem: call the rest data, which is safe.
            push_merged(&mut out, ByteRange::new(data, end - data));
            break;
        }
        push_merged(&mut out, ByteRange::new(data, hole - data));
        pos = hole;
    }
    Ok(out)
}

/// lseek with SEEK_DATA/SEEK_HOLE; None for "no more data" (ENXIO). A
/// filesystem without support (EINVAL) is treated as all data from `pos`.
fn seek(f: &File, pos: u64, whence: Whence, path: &Path) -> Result<Option<u64>> {
    let off = i64::try_from(pos).map_err(|_| SysError::InvalidArgument {
        what: format!("offset {pos} of {}", path.display()),
    })?;
    match lseek(f, off, whence) {
        Ok(r) => Ok(Some(r as u64)),
        Err(Errno::ENXIO) => Ok(None),
        Err(Errno::EINVAL) | Err(Errno::EOPNOTSUPP) => Ok(match whence {
            Whence::SeekData => Some(pos),
            _ => None,
        }),
        Err(e) => Err(SysError::io("seek in", path, e.into())),
    }
}

/// The extents of `f` overlapping `[start, end)` (not cut to the window), in
/// logical order, after flushing its dirty data. Unsupported when the filesystem
/// has no FIEMAP.
pub fn fiemap(f: &File, path: &Path, start: u64, end: u64) -> Result<Vec<Extent>> {
    let mut out: Vec<Extent> = Vec::new();
    let mut pos = start;
    let mut buf: Box<FiemapBuf> = Box::new(FiemapBuf {
        header: FiemapHeader::default(),
        extents: [FiemapExtent::default(); EXTENTS_PER_CALL],
    });
    while pos < end {
        buf.header = FiemapHeader {
            fm_start: pos,
            fm_length: end - pos,
            fm_flags: FIEMAP_FLAG_SYNC,
            fm_mapped_extents: 0,
            fm_extent_count: EXTENTS_PER_CALL as u32,
            fm_reserved: 0,
        };
        // SAFETY: the header is followed in memory by room for fm_extent_count
        // extents, as FS_IOC_FIEMAP expects.
        let r = unsafe {
            fs_ioc_fiemap(
                f.as_raw_fd(),
                (&mut *buf as *mut FiemapBuf).cast::<FiemapHeader>(),
            )
        };
        match r {
            Ok(_) => {}
            Err(Errno::EOPNOTSUPP) | Err(Errno::ENOTTY) => {
                return Err(SysError::Unsupported {
                    what: format!("FIEMAP on {}", path.display()),
                })
            }
            Err(e) => return Err(SysError::errno("FIEMAP", path, e as i32)),
        }
        let n = (buf.header.fm_mapped_extents as usize).min(EXTENTS_PER_CALL);
        if n == 0 {
            break;
        }
        let mut last = false;
        for e in &buf.extents[..n] {
            let ext = Extent {
                logical: e.fe_logical,
                physical: e.fe_physical,
                length: e.fe_length,
                flags: e.fe_flags,
            };
            last |= ext.flags & FIEMAP_EXTENT_LAST != 0;
            if ext.length > 0 && out.last().is_none_or(|p| ext.logical >= p.end()) {
                out.push(ext);
            }
        }
        let next = out.last().map(|e| e.end()).unwrap_or(end);
        if last || next <= pos {
            break;
        }
        pos = next;
    }
    Ok(out)
}

/// Bytes compared per read by [`differing_blocks`].
pub const COMPARE_CHUNK: usize = 1024 * 1024;

/// The blocks of `block` bytes (aligned to `block`) within `[start, end)` whose
/// contents differ between `a` and `b`, merged into ranges and cut to the window.
/// Both files are read in chunks of [`COMPARE_CHUNK`]; bytes past the end of a
/// file count as zeros.
pub fn differing_blocks(
    a: (&File, &Path),
    b: (&File, &Path),
    start: u64,
    end: u64,
    block: u64,
) -> Result<Vec<ByteRange>> {
    let block = block.max(1);
    let chunk = (COMPARE_CHUNK as u64 / block).max(1) * block;
    let mut out = Vec::new();
    let mut ba = vec![0u8; chunk as usize];
    let mut bb = vec![0u8; chunk as usize];
    // Start on a block boundary so that blocks are compared whole.
    let mut pos = start - start % block;
    while pos < end {
        let n = chunk.min(end.div_ceil(block) * block - pos) as usize;
        read_full(a.0, a.1, &mut ba[..n], pos)?;
        read_full(b.0, b.1, &mut bb[..n], pos)?;
        if ba[..n] != bb[..n] {
            for (i, (x, y)) in ba[..n]
                .chunks(block as usize)
                .zip(bb[..n].chunks(block as usize))
                .enumerate()
            {
                if x != y {
                    let off = pos + i as u64 * block;
                    let s = off.max(start);
                    let e = (off + x.len() as u64).min(end);
                    if e > s {
                        push_merged(&mut out, ByteRange::new(s, e - s));
                    }
                }
            }
        }
        pos += n as u64;
    }
    Ok(out)
}

/// Fills `buf` from `f` at `off`; what lies past the end of the file is zeros.
fn read_full(f: &File, path: &Path, buf: &mut [u8], off: u64) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(SysError::io("read", path, e)),
        }
    }
    buf[done..].fill(0);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn merging_joins_touching_ranges() {
        let mut v = Vec::new();
        push_merged(&mut v, ByteRange::new(0, 10));
        push_merged(&mut v, ByteRange::new(10, 5));
        push_merged(&mut v, ByteRange::new(20, 0));
        push_merged(&mut v, ByteRange::new(30, 5));
        assert_eq!(v, vec![ByteRange::new(0, 15), ByteRange::new(30, 5)]);
    }

    #[test]
    fn data_ranges_of_a_sparse_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        f.set_len(16 << 20).unwrap();
        f.write_at(&[1u8; 4096], 4 << 20).unwrap();
        f.sync_all().unwrap();
        let r = data_ranges(&f, &p, 0, 16 << 20).unwrap();
        // Filesystems without hole support (or with big blocks) may report more,
        // but the written block is always inside.
        assert!(r
            .iter()
            .any(|x| x.offset <= 4 << 20 && x.end() >= (4 << 20) + 4096));
        // A window starting inside the data cuts the range there.
        let r = data_ranges(&f, &p, (4 << 20) + 100, 16 << 20).unwrap();
        assert_eq!(r.first().map(|x| x.offset), Some((4 << 20) + 100));
    }

    #[test]
    fn differing_blocks_finds_the_changed_block_only() {
        let dir = tempfile::tempdir().unwrap();
        let pa = dir.path().join("a");
        let pb = dir.path().join("b");
        let mut data = vec![7u8; 3 << 20];
        std::fs::File::create(&pa)
            .unwrap()
            .write_all(&data)
            .unwrap();
        data[(2 << 20) + 5000] = 8;
        std::fs::File::create(&pb)
            .unwrap()
            .write_all(&data[..(3 << 20) - 4096])
            .unwrap();
        let a = open_read(&pa).unwrap();
        let b = open_read(&pb).unwrap();
        let d = differing_blocks((&a, &pa), (&b, &pb), 0, 3 << 20, 4096).unwrap();
        assert_eq!(
            d,
            vec![
                ByteRange::new((2 << 20) + 4096, 4096),
                // b is shorter: its missing tail reads as zeros.
                ByteRange::new((3 << 20) - 4096, 4096),
            ]
        );
        let d = differing_blocks((&a, &pa), (&b, &pb), (2 << 20) + 6000, 3 << 20, 4096).unwrap();
        assert_eq!(d[0], ByteRange::new((2 << 20) + 6000, 8192 - 6000));
    }
}
