//! A directory tree as one stream of bytes, and back: how a directory volume
//! travels to another node.
//!
//! [`pack_tree`] walks a tree as [`copy_tree`](super::copy_tree) does (each
//! entry opened beneath its directory, following nothing, an entry that
//! vanished skipped and counted) and writes every entry with its owner, mode
//! and times; a regular file's data goes as its allocated ranges only, so a
//! sparse file stays sparse. [`unpack_tree`] makes the tree again in an empty
//! directory and takes nothing it reads on trust: every name is one path
//! component, every entry is made beneath the directory it belongs to with
//! `*at` calls on that directory's descriptor (never by path, never through a
//! link), ranges of a file lie within its length in ascending order, the data
//! of the whole tree stays within the caller's limit, and a stream that ends
//! early, holds anything after its end or does not add up is refused.
//!
//! The stream: a magic line, then records, each a tag byte followed by its
//! fields (integers little-endian, names and link targets with a 16-bit
//! length):
//! - `DIR` name meta: a directory; the records up to its `UP` are its entries;
//! - `UP`: the end of the directory opened last (its meta is applied then, as
//!   adding entries changes its times);
//! - `FILE` name meta length, then pieces (offset u64, size u32, bytes), the
//!   last a piece of size 0: a regular file;
//! - `LINK` name meta target: a symbolic link;
//! - `NODE` name meta rdev u64: a fifo or device node;
//! - `END` meta entries: the root's meta and the count of entries written.
//!
//! meta: `st_mode` u32, uid u32, gid u32, atime (i64 s, u32 ns), mtime (same).

use std::ffi::{CStr, CString};
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};

use super::{
    apply_metadata_at, apply_metadata_fd, file_type, list, make_dir_at, next_name, open_counted,
    open_root, os, reopen_file, too_deep, Meta, Opened, WalkReport, MAX_DEPTH,
};
use crate::error::{Result, SysError};
use crate::fsrecord::{note, FsOp};

const MAGIC: &[u8] = b"example-csi tree v1\n";
const DIR: u8 = 1;
const UP: u8 = 2;
const FILE: u8 = 3;
const LINK: u8 = 4;
const NODE: u8 = 5;
const END: u8 = 6;
/// The largest piece of a file's data in the stream.
const PIECE: usize = 1 << 20;
/// The longest name of one entry (NAME_MAX).
const MAX_NAME: usize = 255;
/// The longest target of a symbolic link (PATH_MAX less its NUL).
const MAX_LINK: usize = 4095;

/// What a pack wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Packed {
    pub report: WalkReport,
    /// Bytes of file data in the stream.
    pub data: u64,
    /// Length of the stream.
    pub bytes: u64,
}

/// Writes the tree `src_dir` as a stream to the new file `out` (refused when
/// it exists). Not synced: the caller makes `out` durable. The tree may change
/// while it is packed (entries that vanish are skipped and counted); sockets
/// and mount points inside it are skipped, as by `copy_tree`.
pub fn pack_tree(src_dir: &Path, out: &Path) -> Result<Packed> {
    let root = open_root(src_dir)?;
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(out)
        .map_err(|e| SysError::io("create", out, e))?;
    note(|| FsOp::Create {
        path: out.into(),
        truncate: false,
    });
    let mut w = Writer {
        out: BufWriter::with_capacity(PIECE, file),
        path: out,
        bytes: 0,
        data: 0,
        buf: vec![0; PIECE],
    };
    w.put(MAGIC)?;
    let mut report = WalkReport::default();
    let root_meta = Meta::of(&root.stat);
    let mut stack = vec![(
        list(&root).map_err(|e| SysError::io("list", src_dir, e))?,
        root,
        src_dir.to_path_buf(),
    )];
    while let Some((dir, opened, at)) = stack.last_mut() {
        let Some(name) = next_name(dir, at)? else {
            stack.pop();
            if !stack.is_empty() {
                w.put(&[UP])?;
            }
            continue;
        };
        let path = at.join(os(&name));
        let Some(entry) = open_counted(opened.fd.as_fd(), &name, &path, &mut report)? else {
            continue;
        };
        let depth = stack.len();
        match w.entry(&name, entry, &path, depth, &mut report)? {
            Some(pushed) => stack.push(pushed),
            None => continue,
        }
    }
    w.put(&[END])?;
    w.meta(&root_meta)?;
    w.put(&report.entries.to_le_bytes())?;
    w.out.flush().map_err(|e| SysError::io("write", out, e))?;
    Ok(Packed {
        report,
        data: w.data,
        bytes: w.bytes,
    })
}

type Frame = (rustix::fs::Dir, Opened, PathBuf);

struct Writer<'a> {
    out: BufWriter<File>,
    path: &'a Path,
    bytes: u64,
    data: u64,
    buf: Vec<u8>,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) -> Result<()> {
        self.out
            .write_all(b)
            .map_err(|e| SysError::io("write", self.path, e))?;
        self.bytes += b.len() as u64;
        Ok(())
    }

    fn name(&mut self, b: &[u8]) -> Result<()> {
        self.put(&(b.len() as u16).to_le_bytes())?;
        self.put(b)
    }

    fn meta(&mut self, m: &Meta) -> Result<()> {
        let mut b = Vec::with_capacity(36);
        b.extend_from_slice(&m.mode.to_le_bytes());
        b.extend_from_slice(&m.uid.to_le_bytes());
        b.extend_from_slice(&m.gid.to_le_bytes());
        b.extend_from_slice(&m.atime.0.to_le_bytes());
        b.extend_from_slice(&m.atime.1.to_le_bytes());
        b.extend_from_slice(&m.mtime.0.to_le_bytes());
        b.extend_from_slice(&m.mtime.1.to_le_bytes());
        self.put(&b)
    }

    fn head(&mut self, tag: u8, name: &CStr, m: &Meta) -> Result<()> {
        self.put(&[tag])?;
        self.name(name.to_bytes())?;
        self.meta(m)
    }

    /// Writes one opened entry; the frame of a directory to walk next.
    fn entry(
        &mut self,
        name: &CStr,
        entry: Opened,
        path: &Path,
        depth: usize,
        report: &mut WalkReport,
    ) -> Result<Option<Frame>> {
        let meta = Meta::of(&entry.stat);
        match file_type(&entry.stat) {
            FileType::Directory => {
                if depth >= MAX_DEPTH {
                    return Err(too_deep(path));
                }
                let listed = match list(&entry) {
                    Ok(d) => d,
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                        report.vanished += 1;
                        return Ok(None);
                    }
                    Err(e) => return Err(SysError::io("list", path, e)),
                };
                self.head(DIR, name, &meta)?;
                report.entries += 1;
                Ok(Some((listed, entry, path.to_path_buf())))
            }
            FileType::RegularFile => {
                let f = match reopen_file(&entry) {
                    Ok(f) => f,
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                        report.vanished += 1;
                        return Ok(None);
                    }
                    Err(e) => return Err(SysError::io("open", path, e)),
                };
                self.head(FILE, name, &meta)?;
                self.file_data(&f, entry.stat.st_size as u64, path)?;
                report.entries += 1;
                Ok(None)
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(&entry.fd, c"", Vec::new())
                    .map_err(|e| SysError::io("read link", path, e.into()))?;
                self.head(LINK, name, &meta)?;
                self.name(target.as_bytes())?;
                report.entries += 1;
                Ok(None)
            }
            FileType::Fifo | FileType::CharacterDevice | FileType::BlockDevice => {
                self.head(NODE, name, &meta)?;
                let rdev: u64 = entry.stat.st_rdev as _;
                self.put(&rdev.to_le_bytes())?;
                report.entries += 1;
                Ok(None)
            }
            _ => {
                report.sockets_skipped += 1;
                Ok(None)
            }
        }
    }

    /// The length, then the allocated ranges of `f` as pieces, then the end
    /// piece. A file that shrinks meanwhile ends where its data ended.
    fn file_data(&mut self, f: &File, len: u64, path: &Path) -> Result<()> {
        self.put(&len.to_le_bytes())?;
        for r in crate::extents::data_ranges(f, path, 0, len)? {
            let mut at = r.offset;
            let end = r.offset + r.length;
            while at < end {
                let want = ((end - at) as usize).min(PIECE);
                let got = read_at_most(f, &mut self.buf[..want], at)
                    .map_err(|e| SysError::io("read", path, e))?;
                if got == 0 {
                    break;
                }
                self.put(&at.to_le_bytes())?;
                self.put(&(got as u32).to_le_bytes())?;
                let piece = std::mem::take(&mut self.buf);
                let put = self.put(&piece[..got]);
                self.buf = piece;
                put?;
                self.data += got as u64;
                at += got as u64;
            }
        }
        self.put(&0u64.to_le_bytes())?;
        self.put(&0u32.to_le_bytes())
    }
}

/// Reads up to `buf.len()` bytes at `at`; fewer only at the end of the file.
fn read_at_most(f: &File, buf: &mut [u8], at: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], at + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Makes the tree of the stream `archive` in the directory `dst_dir`, which
/// must exist and be empty, with at most `max_data` bytes of file data in
/// all. The root takes the packed root's owner, mode and times. Durable when
/// this returns. A stream that is damaged or breaks a rule (module doc) is
/// refused (InvalidArgument); what was made of it by then stays for the caller
/// to remove.
pub fn unpack_tree(archive: &Path, dst_dir: &Path, max_data: u64) -> Result<WalkReport> {
    let root = open_root(dst_dir)?;
    let mut listed = list(&root).map_err(|e| SysError::io("list", dst_dir, e))?;
    if next_name(&mut listed, dst_dir)?.is_some() {
        return Err(SysError::InvalidArgument {
            what: format!(
                "{} is not empty: a tree is unpacked into an empty directory",
                dst_dir.display()
            ),
        });
    }
    let f = File::open(archive).map_err(|e| SysError::io("open", archive, e))?;
    let mut r = Reader {
        src: BufReader::with_capacity(PIECE, f),
        path: archive,
        max_data,
        data: 0,
        buf: vec![0; PIECE],
    };
    let mut magic = [0u8; MAGIC.len()];
    r.exact(&mut magic)?;
    if magic != MAGIC {
        return Err(r.damaged("it does not start as a packed tree"));
    }
    let mut report = WalkReport::default();
    // Each directory made and not yet closed, with the meta it gets then.
    let mut stack: Vec<(OwnedFd, PathBuf, Meta)> = Vec::new();
    loop {
        let (dir, at) = match stack.last() {
            Some((fd, p, _)) => (fd.as_fd(), p.clone()),
            None => (root.fd.as_fd(), dst_dir.to_path_buf()),
        };
        match r.byte()? {
            DIR => {
                let (name, meta, path) = r.head(&at, FileType::Directory)?;
                if stack.len() + 1 >= MAX_DEPTH {
                    return Err(too_deep(&path));
                }
                let fd = make_dir_at(dir, &name, &path)?;
                stack.push((fd, path, meta));
            }
            UP => {
                let (fd, path, meta) = stack
                    .pop()
                    .ok_or_else(|| r.damaged("it closes more directories than it opens"))?;
                apply_metadata_fd(fd.as_fd(), &meta, &path)?;
                continue;
            }
            FILE => {
                let (name, meta, path) = r.head(&at, FileType::RegularFile)?;
                r.file(dir, &name, &meta, &path)?;
            }
            LINK => r.link(dir, &at)?,
            NODE => r.node(dir, &at)?,
            END => {
                if !stack.is_empty() {
                    return Err(r.damaged("it ends inside a directory"));
                }
                let meta = r.end(report.entries)?;
                apply_metadata_fd(root.fd.as_fd(), &meta, dst_dir)?;
                break;
            }
            t => return Err(r.damaged(&format!("an unknown record {t}"))),
        }
        report.entries += 1;
    }
    crate::file::syncfs(dst_dir)?;
    Ok(report)
}

struct Reader<'a> {
    src: BufReader<File>,
    path: &'a Path,
    max_data: u64,
    data: u64,
    buf: Vec<u8>,
}

impl Reader<'_> {
    /// A symbolic link's record: the link made in `dir` (the folder `at`).
    fn link(&mut self, dir: BorrowedFd, at: &Path) -> Result<()> {
        let (name, meta, path) = self.head(at, FileType::Symlink)?;
        let target = self.name(MAX_LINK)?;
        rustix::fs::symlinkat(target.as_c_str(), dir, &name)
            .map_err(|e| SysError::io("create symlink", &path, e.into()))?;
        note(|| FsOp::Other {
            what: "a symlink",
            path: path.clone(),
        });
        apply_metadata_at(dir, &name, &meta, &path)
    }

    /// A device node's or fifo's record: the node made in `dir`.
    fn node(&mut self, dir: BorrowedFd, at: &Path) -> Result<()> {
        let (name, meta, path) = self.node_head(at)?;
        let rdev = u64::from_le_bytes(self.array()?);
        rustix::fs::mknodat(dir, &name, meta.kind(), meta.permissions(), rdev as _)
            .map_err(|e| SysError::io("mknod", &path, e.into()))?;
        note(|| FsOp::Other {
            what: "a device node",
            path: path.clone(),
        });
        apply_metadata_at(dir, &name, &meta, &path)
    }

    /// The end record, after `entries` entries: the root's meta, once the
    /// count agrees and nothing follows.
    fn end(&mut self, entries: u64) -> Result<Meta> {
        let meta = self.meta()?;
        if meta.kind() != FileType::Directory {
            return Err(self.damaged("its root is not a directory"));
        }
        let said = u64::from_le_bytes(self.array()?);
        if said != entries {
            return Err(self.damaged(&format!("it says {said} entries and holds {entries}")));
        }
        let mut more = [0u8; 1];
        if self
            .src
            .read(&mut more)
            .map_err(|e| SysError::io("read", self.path, e))?
            != 0
        {
            return Err(self.damaged("it goes on after its end"));
        }
        Ok(meta)
    }

    fn damaged(&self, why: &str) -> SysError {
        SysError::InvalidArgument {
            what: format!("the packed tree {} is refused: {why}", self.path.display()),
        }
    }

    fn exact(&mut self, b: &mut [u8]) -> Result<()> {
        match self.src.read_exact(b) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                Err(self.damaged("it ends before its end record"))
            }
            Err(e) => Err(SysError::io("read", self.path, e)),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.exact(&mut b)?;
        Ok(b)
    }

    fn byte(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    /// A name or link target of 1 to `max` bytes without NUL.
    fn name(&mut self, max: usize) -> Result<CString> {
        let n = u16::from_le_bytes(self.array()?) as usize;
        if n == 0 || n > max {
            return Err(self.damaged(&format!("a name or link of {n} bytes")));
        }
        let mut b = vec![0u8; n];
        self.exact(&mut b)?;
        CString::new(b).map_err(|_| self.damaged("a name or link with a NUL byte"))
    }

    /// The name of an entry: one path component.
    fn entry_name(&mut self) -> Result<CString> {
        let n = self.name(MAX_NAME)?;
        let b = n.as_bytes();
        if b == b"." || b == b".." || b.contains(&b'/') {
            return Err(self.damaged(&format!(
                "the name {:?} is not one path component",
                String::from_utf8_lossy(b)
            )));
        }
        Ok(n)
    }

    fn meta(&mut self) -> Result<Meta> {
        let b: [u8; 36] = self.array()?;
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let i64_at = |i: usize| i64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let meta = Meta {
            mode: u32_at(0),
            uid: u32_at(4),
            gid: u32_at(8),
            atime: (i64_at(12), u32_at(20)),
            mtime: (i64_at(24), u32_at(32)),
        };
        if meta.atime.1 >= 1_000_000_000 || meta.mtime.1 >= 1_000_000_000 {
            return Err(self.damaged("a time with more than a second of nanoseconds"));
        }
        Ok(meta)
    }

    /// An entry's name and meta, its kind the record's.
    fn head(&mut self, at: &Path, kind: FileType) -> Result<(CString, Meta, PathBuf)> {
        let name = self.entry_name()?;
        let meta = self.meta()?;
        if meta.kind() != kind {
            return Err(self.damaged("an entry whose mode says another kind"));
        }
        let path = at.join(os(&name));
        Ok((name, meta, path))
    }

    fn node_head(&mut self, at: &Path) -> Result<(CString, Meta, PathBuf)> {
        let name = self.entry_name()?;
        let meta = self.meta()?;
        if !matches!(
            meta.kind(),
            FileType::Fifo | FileType::CharacterDevice | FileType::BlockDevice
        ) {
            return Err(self.damaged("a node that is not a fifo or device"));
        }
        let path = at.join(os(&name));
        Ok((name, meta, path))
    }

    /// A regular file: made, its pieces written, its length and meta set. A
    /// half-made file is removed.
    fn file(&mut self, dir: BorrowedFd<'_>, name: &CStr, meta: &Meta, path: &Path) -> Result<()> {
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(dir, name, flags, Mode::from_bits_truncate(0o600))
            .map_err(|e| SysError::io("create", path, e.into()))?;
        note(|| FsOp::Create {
            path: path.into(),
            truncate: false,
        });
        let f = File::from(fd);
        let made = self
            .file_pieces(&f, path)
            .and_then(|()| apply_metadata_fd(f.as_fd(), meta, path));
        if made.is_err() {
            drop(f);
            let _ = rustix::fs::unlinkat(dir, name, rustix::fs::AtFlags::empty());
        }
        made
    }

    fn file_pieces(&mut self, f: &File, path: &Path) -> Result<()> {
        let len = u64::from_le_bytes(self.array()?);
        if len > i64::MAX as u64 {
            return Err(self.damaged("a file longer than a file can be"));
        }
        let mut next = 0u64;
        loop {
            let offset = u64::from_le_bytes(self.array()?);
            let size = u32::from_le_bytes(self.array()?) as usize;
            if size == 0 {
                break;
            }
            let end = offset.checked_add(size as u64);
            if size > PIECE || offset < next || end.is_none_or(|e| e > len) {
                return Err(self.damaged(&format!(
                    "a piece of {size} bytes at {offset} of a file of {len} (the last ended at {next})"
                )));
            }
            self.data += size as u64;
            if self.data > self.max_data {
                return Err(self.damaged(&format!(
                    "it holds more than the {} bytes of data allowed",
                    self.max_data
                )));
            }
            let mut buf = std::mem::take(&mut self.buf);
            let read = self.exact(&mut buf[..size]);
            let wrote = read.and_then(|()| {
                f.write_all_at(&buf[..size], offset)
                    .map_err(|e| SysError::io("write", path, e))
            });
            self.buf = buf;
            wrote?;
            next = offset + size as u64;
        }
        f.set_len(len)
            .map_err(|e| SysError::io("set the length of", path, e))
    }
}
