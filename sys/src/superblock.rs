//! The unit of I/O a filesystem image was made for, read from its superblock:
//! how large the logical sectors of a device serving it may be. A filesystem
//! does not mount on a device whose sectors are larger than its own unit (xfs:
//! "device supports 4096 byte sectors (not 512)"; ext4: "bad block size").

use std::fs::File;
use std::os::unix::fs::FileExt;

/// The sector size of a device that any filesystem mounts on.
pub const SMALL_SECTOR: u32 = 512;
/// The larger sector size a device may take where its filesystem allows.
pub const LARGE_SECTOR: u32 = 4096;

const EXT4_SB: u64 = 1024;
const XFS_MAGIC: u32 = 0x5846_5342;
const BTRFS_SB: u64 = 64 << 10;

/// The largest logical sector size, [`LARGE_SECTOR`] or [`SMALL_SECTOR`], that a
/// device serving the image open as `f` may have: large for an ext4 of 4 KiB
/// blocks or more, an xfs whose sectors (and log sectors) are 4 KiB or more, a
/// btrfs of 4 KiB sectors or more; small for anything else (a smaller unit, no
/// filesystem, one not known here, an image that cannot be read).
pub fn widest_sector(f: &File) -> u32 {
    if filesystem_unit(f).is_some_and(|unit| unit >= LARGE_SECTOR) {
        LARGE_SECTOR
    } else {
        SMALL_SECTOR
    }
}

/// The smallest unit of I/O of the filesystem on the image, if it is one of
/// ext4, xfs and btrfs.
fn filesystem_unit(f: &File) -> Option<u32> {
    let head = read(f, 0, 2048)?;
    let ext4 = &head[EXT4_SB as usize..];
    if le16(ext4, 0x38) == 0xEF53 {
        // s_log_block_size: the block is 1 KiB shifted by it.
        return 1024u32.checked_shl(le32(ext4, 0x18));
    }
    if be32(&head, 0) == XFS_MAGIC {
        let sector = u32::from(be16(&head, 102));
        // sb_logsectsize: 0 when the log has basic 512-byte sectors.
        let log = match be16(&head, 194) {
            0 => SMALL_SECTOR,
            n => u32::from(n),
        };
        return Some(sector.min(log));
    }
    let btrfs = read(f, BTRFS_SB, 0x100)?;
    (&btrfs[0x40..0x48] == b"_BHRfS_M").then(|| le32(&btrfs, 0x90))
}

fn read(f: &File, offset: u64, len: usize) -> Option<Vec<u8>> {
    let mut b = vec![0; len];
    f.read_exact_at(&mut b, offset).ok()?;
    Some(b)
}

// The fields of on-disk structures, at byte `at` of `b`.

pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}
pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::process::Command;

    fn image(dir: &Path, name: &str, size: u64) -> std::path::PathBuf {
        let p = dir.join(name);
        File::create(&p).unwrap().set_len(size).unwrap();
        p
    }

    fn run(cmd: &str, args: &[&str]) -> bool {
        Command::new(cmd)
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    }

    fn widest(p: &Path) -> u32 {
        widest_sector(&File::open(p).unwrap())
    }

    #[test]
    fn nothing_known_is_small() {
        let d = tempfile::tempdir().unwrap();
        let blank = image(d.path(), "blank", 1 << 20);
        assert_eq!(widest(&blank), SMALL_SECTOR);
        let short = image(d.path(), "short", 100);
        assert_eq!(widest(&short), SMALL_SECTOR);
    }

    /// The mkfs programs make the images (without root): each filesystem's unit
    /// is read as they wrote it.
    #[test]
    fn units_of_real_filesystems() {
        let d = tempfile::tempdir().unwrap();
        let cases: [(&str, &[&str], u32); 6] = [
            ("mkfs.ext4", &["-q", "-F", "-b", "4096"], LARGE_SECTOR),
            ("mkfs.ext4", &["-q", "-F", "-b", "1024"], SMALL_SECTOR),
            ("mkfs.xfs", &["-q", "-f", "-s", "size=512"], SMALL_SECTOR),
            ("mkfs.xfs", &["-q", "-f", "-s", "size=4096"], LARGE_SECTOR),
            ("mkfs.btrfs", &["-q", "-f"], LARGE_SECTOR),
            ("mkfs.btrfs", &["-q", "-f", "-s", "4096"], LARGE_SECTOR),
        ];
        for (i, (mkfs, args, want)) in cases.into_iter().enumerate() {
            let p = image(d.path(), &format!("fs{i}"), 320 << 20);
            let mut all: Vec<&str> = args.to_vec();
            all.push(p.to_str().unwrap());
            assert!(run(mkfs, &all), "{mkfs} {args:?}");
            assert_eq!(widest(&p), want, "{mkfs} {args:?}");
        }
    }
}
