//! Filesystems made ahead of time: a template image formatted once per filesystem
//! and size, and the step that gives a reflinked copy of it its own filesystem
//! UUID before it is first mounted (xfs refuses a second mount of one UUID, and
//! blkid should never see two filesystems with one).
//!
//! The UUID is written into the copy's superblocks here, not by tune2fs, xfs_admin
//! or btrfstune: those start a process and, for xfs, rewrite the whole log
//! (64 MiB for 1 GiB, unsharing it from the template), tens to hundreds of
//! milliseconds on a busy node, where these are a few small writes. Only a
//! filesystem of the exact shape [`format_template`] leaves is changed (checked
//! first, checksums included); its metadata checksums do not depend on the UUID:
//!
//! - ext4, made with `metadata_csum_seed`: the primary superblock's UUID and its
//!   checksum (the backups are only read by a repair, which rewrites them);
//! - xfs v5: every allocation group's superblock, the old UUID moving to
//!   `sb_meta_uuid` under the META_UUID feature (as `xfs_admin -U` does), and the
//!   UUID in the header of the log's one record: the unmount record mkfs writes,
//!   whose CRC mkfs leaves zero and the kernel does not check;
//! - btrfs: every superblock copy inside the file, the old fsid moving to
//!   `metadata_uuid` under the METADATA_UUID feature (as `btrfstune -m` does).

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use crate::cmd;
use crate::error::{Result, SysError};
use crate::superblock::{be16, be32, be64, le16, le32, le64};

/// Changes whenever the options of [`format_template`] change, so that a template
/// made with other options is never taken for one made with these.
pub const TEMPLATE_FORMAT: u32 = 1;

/// Filesystems [`format_template`] and [`renew_uuid`] know.
pub const FS_TYPES: [&str; 3] = ["ext4", "xfs", "btrfs"];

/// Formats the file `image` (its size already set) as a template of `fstype`.
/// The options are those of the node's mkfs, so a volume made from a template is
/// the filesystem the node would have made; ext4 adds `metadata_csum_seed`, so
/// that its checksums do not depend on its UUID.
pub fn format_template(image: &Path, fstype: &str, timeout: Duration) -> Result<()> {
    let dev = image.as_os_str();
    let args: Vec<&OsStr> = match fstype {
        "ext4" => vec![
            "-F".as_ref(),
            "-q".as_ref(),
            "-m".as_ref(),
            "0".as_ref(),
            "-O".as_ref(),
            "metadata_csum_seed".as_ref(),
            "-E".as_ref(),
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard".as_ref(),
            dev,
        ],
        "xfs" | "btrfs" => vec!["-f".as_ref(), "-q".as_ref(), "-K".as_ref(), dev],
        other => return Err(unsupported(other)),
    };
    cmd::run(&format!("mkfs.{fstype}"), &args, timeout).map(|_| ())
}

/// Checks that `image` holds a fresh, intact filesystem of `fstype` of the shape
/// [`renew_uuid`] can change: never mounted, superblock checksums right.
pub fn check_template(image: &Path, fstype: &str) -> Result<()> {
    let f = open(image, false)?;
    plan(&f, image, fstype).map(|_| ())
}

/// Gives the fresh copy of a template at `image` the filesystem UUID `uuid`.
/// The caller makes the change durable (it fsyncs the new image anyway).
pub fn renew_uuid(image: &Path, fstype: &str, uuid: [u8; 16]) -> Result<()> {
    let f = open(image, true)?;
    write_uuid(&f, image, &f, image, fstype, uuid)
}

/// Writes `uuid` into `dst`, which holds the same filesystem as `src` (the
/// same file, or a new copy of the template `src`): the blocks that carry it
/// are read from `src` and written to `dst` as whole pages. A new copy's own
/// pages are not cached yet, so a read of them, or a write of part of a page,
/// would each wait for the disk (several for xfs, one per allocation group);
/// the template's are cached.
fn write_uuid(
    src: &File,
    src_path: &Path,
    dst: &File,
    dst_path: &Path,
    fstype: &str,
    uuid: [u8; 16],
) -> Result<()> {
    let page = page_size();
    // Every page a changed block touches, by its offset: blocks may share one.
    let mut pages = std::collections::BTreeMap::<u64, Vec<u8>>::new();
    for mut block in plan(src, src_path, fstype)? {
        (block.change)(&mut block.bytes, &uuid);
        let end = block.offset + block.bytes.len() as u64;
        let mut at = block.offset / page * page;
        while at < end {
            let bytes = match pages.entry(at) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    e.insert(read(src, src_path, at, page as usize)?)
                }
            };
            // The part of the block in this page.
            let (from, to) = (block.offset.max(at), end.min(at + page));
            bytes[(from - at) as usize..(to - at) as usize].copy_from_slice(
                &block.bytes[(from - block.offset) as usize..(to - block.offset) as usize],
            );
            at += page;
        }
    }
    for (at, bytes) in pages {
        dst.write_all_at(&bytes, at)
            .map_err(|e| SysError::io("writing the UUID into", dst_path, e))?;
    }
    Ok(())
}

/// The size of a page of the page cache.
fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |p| p as u64)
}

/// The filesystem UUID of the fresh filesystem at `image` (the one blkid shows).
pub fn read_uuid(image: &Path, fstype: &str) -> Result<[u8; 16]> {
    let f = open(image, false)?;
    let (offset, at) = match fstype {
        "ext4" => (EXT4_SB, EXT4_UUID),
        "xfs" => (0, XFS_UUID),
        "btrfs" => (BTRFS_SB[0], BTRFS_FSID),
        other => return Err(unsupported(other)),
    };
    let b = read(&f, image, offset + at as u64, 16)?;
    Ok(b.try_into().unwrap_or([0; 16]))
}

/// Makes `dst` a reflink of the template `template` with the filesystem UUID
/// `uuid` and the xattrs `attrs` (`user.` names, as [`crate::xattr::set`]).
/// Nothing of it is durable yet: the caller syncs it before anything is written
/// to it, and [`carries_uuid`] tells a copy whose UUID a power loss took in part.
/// Nothing is left at `dst` when a step fails. The template's modification time
/// is set to now, so the least recently used template is the oldest.
pub fn clone_template(
    template: &Path,
    dst: &Path,
    fstype: &str,
    uuid: [u8; 16],
    attrs: &[(&str, &[u8])],
) -> Result<()> {
    let src = open(template, false)?;
    crate::file::create_unsynced_with(dst, 0o600, |d| {
        crate::file::clone_into(d, &src, template, dst)?;
        write_uuid(&src, template, d, dst, fstype, uuid)?;
        attrs
            .iter()
            .try_for_each(|(name, value)| crate::xattr::set(dst, name, value))
    })?;
    // Only an order among templates: not worth an fsync.
    let _ = src.set_modified(std::time::SystemTime::now());
    Ok(())
}

/// Fills the existing image `dst`, of the template's length and never attached,
/// with a reflink of the template `template` and gives it the filesystem UUID
/// `uuid`; whatever `dst` held is replaced. Nothing of it is durable yet: the
/// caller syncs it before anything is written to it, and [`carries_uuid`] tells
/// a copy whose UUID a power loss took in part. The template's modification
/// time is set to now, as by [`clone_template`].
pub fn fill_from_template(template: &Path, dst: &Path, fstype: &str, uuid: [u8; 16]) -> Result<()> {
    let src = open(template, false)?;
    let d = open(dst, true)?;
    let (have, want) = (len_of(&d, dst)?, len_of(&src, template)?);
    if have != want {
        return Err(SysError::InvalidArgument {
            what: format!(
                "{} has {have} bytes, the template {} {want}",
                dst.display(),
                template.display()
            ),
        });
    }
    crate::file::clone_into(&d, &src, template, dst)?;
    write_uuid(&src, template, &d, dst, fstype, uuid)?;
    let _ = src.set_modified(std::time::SystemTime::now());
    Ok(())
}

/// Whether the copy of a template at `image` carries `uuid` in every place
/// [`renew_uuid`] writes it, each checksum right: false for a copy of which a
/// power loss kept only some of those writes (or none).
pub fn carries_uuid(image: &Path, fstype: &str, uuid: [u8; 16]) -> Result<bool> {
    let f = open(image, false)?;
    let len = len_of(&f, image)?;
    let holds = |offset: u64, size: usize, at: usize| -> Result<Vec<u8>> {
        let b = read(&f, image, offset, size)?;
        Ok(if b[at..at + 16] == uuid {
            b
        } else {
            Vec::new()
        })
    };
    match fstype {
        "ext4" => {
            let sb = holds(EXT4_SB, 1024, EXT4_UUID)?;
            Ok(!sb.is_empty() && le32(&sb, EXT4_CSUM) == ext4_csum(&sb))
        }
        "xfs" => {
            let sb = holds(0, 512, XFS_UUID)?;
            if sb.is_empty() || &sb[0..4] != b"XFSB" {
                return Ok(false);
            }
            let (sect, bsize) = (be16(&sb, 102) as usize, be32(&sb, 4) as u64);
            let (agblocks, agcount) = (be32(&sb, 84) as u64, be32(&sb, 88) as u64);
            if !(512..=32768).contains(&sect)
                || agcount.saturating_mul(agblocks).saturating_mul(bsize) > len
            {
                return Ok(false);
            }
            for ag in 0..agcount {
                let s = holds(ag * agblocks * bsize, sect, XFS_UUID)?;
                if s.is_empty()
                    || s[XFS_CRC..XFS_CRC + 4] != xfs_crc(&s).to_le_bytes()
                    || be32(&s, XFS_INCOMPAT) & XFS_INCOMPAT_META_UUID == 0
                {
                    return Ok(false);
                }
            }
            let log = xfs_log_offset(&sb);
            Ok(log.saturating_add(512) <= len && !holds(log, 512, XLOG_UUID)?.is_empty())
        }
        "btrfs" => {
            let mut any = false;
            for &offset in BTRFS_SB.iter().filter(|&&o| o + 4096 <= len) {
                let s = holds(offset, 4096, BTRFS_FSID)?;
                if s.is_empty()
                    || le32(&s, 0) != crc32c(&s[0x20..])
                    || le64(&s, BTRFS_INCOMPAT) & BTRFS_INCOMPAT_METADATA_UUID == 0
                {
                    return Ok(false);
                }
                any = true;
            }
            Ok(any)
        }
        other => Err(unsupported(other)),
    }
}

/// Empties the never-mounted copy of a template at `image` (its length and
/// attributes kept), so that it is formatted at its first stage as a blank image.
/// Its blocks are punched out, so its length never changes: a kill between a cut
/// to nothing and a growth back (the way of a filesystem that cannot punch holes)
/// would leave an image of no bytes, which no stage can format.
pub fn discard(image: &Path) -> Result<()> {
    use nix::fcntl::{fallocate, FallocateFlags};
    let f = open(image, true)?;
    let len = len_of(&f, image)?;
    if len == 0 {
        return Ok(());
    }
    let punch = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
    match fallocate(&f, punch, 0, len as i64) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EOPNOTSUPP) => f
            .set_len(0)
            .and_then(|()| f.set_len(len))
            .map_err(|e| SysError::io("emptying", image, e)),
        Err(e) => Err(SysError::errno(
            "punching the blocks out of",
            image,
            e as i32,
        )),
    }
}

/// Where in the image an xfs filesystem's internal log starts, from its superblock.
fn xfs_log_offset(sb: &[u8]) -> u64 {
    let (bsize, agblocks) = (be32(sb, 4) as u64, be32(sb, 84) as u64);
    let agblklog = (sb[124] as u32).min(63);
    let logstart = be64(sb, 48);
    let mask = (1u64 << agblklog) - 1;
    (logstart >> agblklog)
        .saturating_mul(agblocks)
        .saturating_add(logstart & mask)
        .saturating_mul(bsize)
}

/// One block to rewrite: where, what it holds now, and how the new UUID goes in.
struct Block {
    offset: u64,
    bytes: Vec<u8>,
    change: fn(&mut [u8], &[u8; 16]),
}

fn unsupported(fstype: &str) -> SysError {
    SysError::Unsupported {
        what: format!("a template of filesystem {fstype:?} (supported: ext4, xfs, btrfs)"),
    }
}

fn not_fresh(image: &Path, fstype: &str, why: &str) -> SysError {
    SysError::InvalidArgument {
        what: format!(
            "{} is not a fresh {fstype} template: {why}",
            image.display()
        ),
    }
}

/// The length of `f`, opened from `path`.
fn len_of(f: &File, path: &Path) -> Result<u64> {
    f.metadata()
        .map(|m| m.len())
        .map_err(|e| SysError::io("reading the size of", path, e))
}

fn open(image: &Path, write: bool) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .open(image)
        .map_err(|e| SysError::io("opening", image, e))
}

fn read(f: &File, image: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
    let mut b = vec![0; len];
    f.read_exact_at(&mut b, offset)
        .map_err(|e| SysError::io("reading the superblock of", image, e))?;
    Ok(b)
}

/// The blocks to rewrite, each checked; an error when the filesystem is not of
/// the expected shape, so nothing is written to anything else.
fn plan(f: &File, image: &Path, fstype: &str) -> Result<Vec<Block>> {
    let len = len_of(f, image)?;
    let image = Image {
        f,
        path: image,
        fstype,
    };
    match fstype {
        "ext4" => plan_ext4(&image),
        "xfs" => plan_xfs(&image, len),
        "btrfs" => plan_btrfs(&image, len),
        other => Err(unsupported(other)),
    }
}

/// The image a plan reads, and what it should hold.
struct Image<'a> {
    f: &'a File,
    path: &'a Path,
    fstype: &'a str,
}

impl Image<'_> {
    fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        read(self.f, self.path, offset, len)
    }

    fn bad(&self, why: &str) -> SysError {
        not_fresh(self.path, self.fstype, why)
    }
}

/// ext4: the primary superblock.
fn plan_ext4(image: &Image) -> Result<Vec<Block>> {
    let sb = image.read(EXT4_SB, 1024)?;
    if le16(&sb, 0x38) != 0xEF53 {
        return Err(image.bad("no ext4 superblock"));
    }
    if le32(&sb, 0x60) & EXT4_INCOMPAT_CSUM_SEED == 0
        || le32(&sb, 0x64) & EXT4_RO_METADATA_CSUM == 0
    {
        return Err(image.bad("not made with metadata_csum and metadata_csum_seed"));
    }
    if le32(&sb, EXT4_CSUM) != ext4_csum(&sb) {
        return Err(image.bad("superblock checksum mismatch"));
    }
    if le16(&sb, 0x34) != 0 {
        return Err(image.bad("it has been mounted"));
    }
    Ok(vec![Block {
        offset: EXT4_SB,
        bytes: sb,
        change: |sb, uuid| {
            sb[EXT4_UUID..EXT4_UUID + 16].copy_from_slice(uuid);
            let c = ext4_csum(sb);
            sb[EXT4_CSUM..EXT4_CSUM + 4].copy_from_slice(&c.to_le_bytes());
        },
    }])
}

/// xfs: every allocation group's superblock, then the header of the log.
fn plan_xfs(image: &Image, len: u64) -> Result<Vec<Block>> {
    let sb = image.read(0, 512)?;
    if &sb[0..4] != b"XFSB" || be16(&sb, 100) & 0xf != 5 {
        return Err(image.bad("no xfs v5 superblock"));
    }
    let sect = be16(&sb, 102) as usize;
    let bsize = be32(&sb, 4) as u64;
    let agblocks = be32(&sb, 84) as u64;
    let agcount = be32(&sb, 88) as u64;
    let logstart = be64(&sb, 48);
    if !(512..=32768).contains(&sect)
        || agcount == 0
        || agcount.saturating_mul(agblocks).saturating_mul(bsize) > len
        || logstart == 0
    {
        return Err(image.bad("unexpected geometry or external log"));
    }
    let uuid: [u8; 16] = sb[XFS_UUID..XFS_UUID + 16].try_into().unwrap_or([0; 16]);
    let mut blocks = Vec::new();
    for ag in 0..agcount {
        blocks.push(xfs_ag_superblock(
            image,
            ag * agblocks * bsize,
            sect,
            &uuid,
        )?);
    }
    let log = xfs_log_offset(&sb);
    let head = image.read(log, 512)?;
    // The unmount record mkfs writes: cycle 1, no CRC, this filesystem's UUID.
    let fresh_log = be32(&head, 0) == XLOG_MAGIC
        && be32(&head, 4) == 1
        && be32(&head, 32) == 0
        && head[XLOG_UUID..XLOG_UUID + 16] == uuid;
    if !fresh_log {
        return Err(image.bad("its log is not the one mkfs writes"));
    }
    blocks.push(Block {
        offset: log,
        bytes: head,
        change: |h, uuid| h[XLOG_UUID..XLOG_UUID + 16].copy_from_slice(uuid),
    });
    Ok(blocks)
}

/// The superblock of an xfs allocation group at `offset`, checked against the
/// primary's `uuid`.
fn xfs_ag_superblock(image: &Image, offset: u64, sect: usize, uuid: &[u8; 16]) -> Result<Block> {
    let s = image.read(offset, sect)?;
    if &s[0..4] != b"XFSB" || s[XFS_UUID..XFS_UUID + 16] != *uuid {
        return Err(image.bad("allocation group superblocks disagree"));
    }
    if s[XFS_CRC..XFS_CRC + 4] != xfs_crc(&s).to_le_bytes() {
        return Err(image.bad("superblock checksum mismatch"));
    }
    if be32(&s, XFS_INCOMPAT) & XFS_INCOMPAT_META_UUID != 0 {
        return Err(image.bad("its UUID has been changed already"));
    }
    Ok(Block {
        offset,
        bytes: s,
        change: xfs_new_uuid,
    })
}

/// An xfs superblock's UUID changed as `xfs_admin -U` does it.
fn xfs_new_uuid(s: &mut [u8], uuid: &[u8; 16]) {
    move_uuid(s, XFS_UUID, XFS_META_UUID, uuid);
    let inc = be32(s, XFS_INCOMPAT) | XFS_INCOMPAT_META_UUID;
    s[XFS_INCOMPAT..XFS_INCOMPAT + 4].copy_from_slice(&inc.to_be_bytes());
    let c = xfs_crc(s);
    s[XFS_CRC..XFS_CRC + 4].copy_from_slice(&c.to_le_bytes());
}

/// btrfs: every superblock copy inside the file.
fn plan_btrfs(image: &Image, len: u64) -> Result<Vec<Block>> {
    let mut blocks = Vec::new();
    for &offset in BTRFS_SB.iter().filter(|&&o| o + 4096 <= len) {
        let s = image.read(offset, 4096)?;
        if &s[0x40..0x48] != b"_BHRfS_M" || le16(&s, 0xC4) != 0 {
            return Err(image.bad("no btrfs superblock with crc32c checksums"));
        }
        if le32(&s, 0) != crc32c(&s[0x20..]) {
            return Err(image.bad("superblock checksum mismatch"));
        }
        if le64(&s, BTRFS_INCOMPAT) & BTRFS_INCOMPAT_METADATA_UUID != 0 {
            return Err(image.bad("its fsid has been changed already"));
        }
        blocks.push(Block {
            offset,
            bytes: s,
            change: btrfs_new_uuid,
        });
    }
    if blocks.is_empty() {
        return Err(image.bad("too small for a btrfs superblock"));
    }
    Ok(blocks)
}

/// A btrfs superblock's fsid changed as `btrfstune -m` does it.
fn btrfs_new_uuid(s: &mut [u8], uuid: &[u8; 16]) {
    move_uuid(s, BTRFS_FSID, BTRFS_META_UUID, uuid);
    let inc = le64(s, BTRFS_INCOMPAT) | BTRFS_INCOMPAT_METADATA_UUID;
    s[BTRFS_INCOMPAT..BTRFS_INCOMPAT + 8].copy_from_slice(&inc.to_le_bytes());
    let c = crc32c(&s[0x20..]);
    s[0..4].copy_from_slice(&c.to_le_bytes());
}

const EXT4_SB: u64 = 1024;
const EXT4_UUID: usize = 0x68;
const EXT4_CSUM: usize = 0x3FC;
const EXT4_INCOMPAT_CSUM_SEED: u32 = 0x2000;
const EXT4_RO_METADATA_CSUM: u32 = 0x400;

const XFS_UUID: usize = 32;
const XFS_INCOMPAT: usize = 216;
const XFS_CRC: usize = 224;
const XFS_META_UUID: usize = 248;
const XFS_INCOMPAT_META_UUID: u32 = 1 << 2;
const XLOG_MAGIC: u32 = 0xFEED_BABE;
const XLOG_UUID: usize = 304;

const BTRFS_SB: [u64; 3] = [64 << 10, 64 << 20, 256 << 30];
const BTRFS_FSID: usize = 0x20;
const BTRFS_INCOMPAT: usize = 0xBC;
const BTRFS_META_UUID: usize = 0x23B;
const BTRFS_INCOMPAT_METADATA_UUID: u64 = 1 << 10;

/// Keeps the UUID at `at` as the metadata UUID at `meta` (the one checksums
/// and block headers go on naming) and puts `uuid` at `at`.
fn move_uuid(s: &mut [u8], at: usize, meta: usize, uuid: &[u8; 16]) {
    s.copy_within(at..at + 16, meta);
    s[at..at + 16].copy_from_slice(uuid);
}

/// ext4 stores the CRC32C state without the final inversion.
fn ext4_csum(sb: &[u8]) -> u32 {
    !crc32c(&sb[..EXT4_CSUM])
}

/// xfs checksums the sector with its CRC field taken as zero.
fn xfs_crc(s: &[u8]) -> u32 {
    let mut zeroed = s.to_vec();
    zeroed[XFS_CRC..XFS_CRC + 4].fill(0);
    crc32c(&zeroed)
}

/// CRC32C (Castagnoli), as the filesystems use it for metadata.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: OnceLock<[u32; 256]> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A discarded image reads as zeros, keeps its length, holds no blocks, and
    /// its length never moved (a kill at any moment leaves it whole-sized).
    #[test]
    fn discard_punches_the_blocks_out_and_keeps_the_length() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("copy.img");
        std::fs::write(&img, vec![7u8; 4 << 20]).unwrap();
        File::open(&img).unwrap().sync_all().unwrap();
        let before = std::fs::metadata(&img).unwrap();
        discard(&img).unwrap();
        let after = std::fs::metadata(&img).unwrap();
        assert_eq!(after.len(), 4 << 20);
        assert_eq!(after.ino(), before.ino());
        assert!(
            after.blocks() < before.blocks() / 8,
            "{} blocks left of {}",
            after.blocks(),
            before.blocks()
        );
        assert!(std::fs::read(&img).unwrap().iter().all(|b| *b == 0));
        // Again, and on an empty file: nothing to do.
        discard(&img).unwrap();
        let empty = dir.path().join("empty.img");
        std::fs::write(&empty, b"").unwrap();
        discard(&empty).unwrap();
        assert_eq!(std::fs::metadata(&empty).unwrap().len(), 0);
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn anything_else_is_refused_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("blank.img");
        std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
        for fs in FS_TYPES {
            assert!(check_template(&img, fs).is_err(), "{fs}");
            assert!(renew_uuid(&img, fs, [7; 16]).is_err(), "{fs}");
        }
        assert!(std::fs::read(&img).unwrap().iter().all(|&b| b == 0));
        assert!(matches!(
            check_template(&img, "vfat"),
            Err(SysError::Unsupported { .. })
        ));
    }
}
