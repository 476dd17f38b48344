//! Figures of the filesystem holding a path: its size and free space
//! (statvfs) and its type (the statfs magic).

use std::path::Path;

use nix::sys::statvfs::FsFlags;

use crate::error::{Result, SysError};
use crate::file::check_path;
use crate::FsStats;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magic_names() {
        assert_eq!(magic_name(0xEF53), "ext4");
        assert_eq!(magic_name(0x58465342), "xfs");
        assert_eq!(magic_name(0x9123683E), "btrfs");
        assert_eq!(magic_name(0x1234abcd), "0x1234abcd");
    }
}
