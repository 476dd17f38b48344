//! The size of a filesystem, read by its own tools (dumpe2fs, xfs_spaceman,
//! xfs_db, btrfs), and the parsers of their output.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use super::supported;
use crate::cmd::{self, SHORT_TIMEOUT};
use crate::error::{Result, SysError};

/// Run `program` with `args` and read a size from its output with `parse`.
fn tool_size(program: &str, args: &[&OsStr], parse: impl Fn(&str) -> Option<u64>) -> Result<u64> {
    let text = cmd::stdout_text(&cmd::run(program, args, SHORT_TIMEOUT)?);
    parse(&text).ok_or_else(|| SysError::NotFound {
        what: format!(
            "filesystem size in the output of `{}`: {}",
            cmd::display(program, args),
            text.trim()
        ),
    })
}

/// `count_key` times `size_key`, both read with [`field_u64`].
fn product(text: &str, count_key: &str, size_key: &str) -> Option<u64> {
    field_u64(text, count_key)
        .zip(field_u64(text, size_key))
        .map(|(count, bs)| count.saturating_mul(bs))
}

/// See [`crate::Filesystems::fs_size`].
pub(super) fn fs_size(device: &Path, fstype: &str) -> Result<u64> {
    supported(fstype)?;
    let dev = device.as_os_str();
    match (fstype, mount_point_of(device)?) {
        ("ext4", _) => tool_size("dumpe2fs", &["-h".as_ref(), dev], |t| {
            product(t, "Block count", "Block size")
        }),
        // What `xfs_info` runs for a mount, without the script around it: the
        // script finds the mount point again with `findmnt`, which in the C
        // locale escapes a path's non-ASCII bytes into one that does not exist.
        ("xfs", Some(mnt)) => tool_size(
            "xfs_spaceman",
            &[
                "-p".as_ref(),
                "xfs_info".as_ref(),
                "-c".as_ref(),
                "info".as_ref(),
                mnt.as_os_str(),
            ],
            xfs_info_data_size,
        ),
        ("xfs", None) => tool_size(
            "xfs_db",
            &[
                "-r".as_ref(),
                "-c".as_ref(),
                "sb 0".as_ref(),
                "-c".as_ref(),
                "p dblocks blocksize".as_ref(),
                dev,
            ],
            |t| product(t, "dblocks", "blocksize"),
        ),
        // `filesystem usage` asks the mount alone; `filesystem show` walks every
        // btrfs mount of the node and fails when any one of them cannot be
        // opened (one hidden under a later mount, say).
        (_, Some(mnt)) => tool_size(
            "btrfs",
            &[
                "filesystem".as_ref(),
                "usage".as_ref(),
                "-b".as_ref(),
                mnt.as_os_str(),
            ],
            btrfs_usage_device_size,
        ),
        (_, None) => tool_size(
            "btrfs",
            &["inspect-internal".as_ref(), "dump-super".as_ref(), dev],
            |t| field_u64(t, "total_bytes"),
        ),
    }
}

/// The number after `key` on the first line that starts with it (`key: 123`,
/// `key = 123`, `key\t\t123`).
fn field_u64(text: &str, key: &str) -> Option<u64> {
    const SEPARATORS: [char; 4] = [' ', '\t', ':', '='];
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?;
        // The key must end here ("total_bytes" is not "total_bytes_used").
        if !rest.starts_with(SEPARATORS) {
            return None;
        }
        rest.trim_start_matches(SEPARATORS)
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Data size from `xfs_info`: the line `data = bsize=4096 blocks=81920, ...`.
fn xfs_info_data_size(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.trim_start().starts_with("data"))?;
    let value = |key: &str| -> Option<u64> {
        line.split_whitespace()
            .find_map(|t| t.strip_prefix(key))?
            .trim_end_matches(',')
            .parse()
            .ok()
    };
    Some(value("bsize=")?.saturating_mul(value("blocks=")?))
}

/// The size of all the filesystem's devices in `btrfs filesystem usage -b`
/// (`    Device size:\t\t 402653184` under `Overall:`).
fn btrfs_usage_device_size(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix("Device size:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Where the filesystem on `device` is mounted and can be reached, if it is
/// (matched by source, which also works for btrfs's anonymous device numbers). A
/// mount hidden under a later mount at or above its path is passed over: its path
/// leads to another filesystem.
fn mount_point_of(device: &Path) -> Result<Option<PathBuf>> {
    let real = std::fs::canonicalize(device).unwrap_or_else(|_| device.to_path_buf());
    let table = crate::mountinfo::read()?;
    let reachable =
        |e: &&crate::mountinfo::MountEntry| Path::new(&e.source) == real && e.reachable();
    Ok(table
        .iter()
        .filter(reachable)
        .find(|e| e.root == Path::new("/"))
        .or_else(|| table.iter().find(reachable))
        .map(|e| e.mount_point.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tool_fields() {
        let dumpe2fs = "Filesystem volume name:   <none>\nBlock count:              131072\nBlock size:               4096\n";
        assert_eq!(field_u64(dumpe2fs, "Block count"), Some(131072));
        assert_eq!(field_u64(dumpe2fs, "Block size"), Some(4096));
        assert_eq!(
            product(dumpe2fs, "Block count", "Block size"),
            Some(131072 * 4096)
        );
        let xfs = "dblocks = 131072\nblocksize = 4096\n";
        assert_eq!(field_u64(xfs, "dblocks"), Some(131072));
        assert_eq!(field_u64(xfs, "blocksize"), Some(4096));
        let btrfs = "bytes_used\t\t147456\ntotal_bytes\t\t536870912\ndev_item.total_bytes\t1\n";
        assert_eq!(field_u64(btrfs, "total_bytes"), Some(536870912));
        assert_eq!(field_u64("total_bytes_used 5\n", "total_bytes"), None);
        assert_eq!(field_u64("", "dblocks"), None);

        let xfs_info = "meta-data=/dev/loop0             isize=512    agcount=4, agsize=20480 blks\n         =                       sectsz=512   attr=2, projid32bit=1\ndata     =                       bsize=4096   blocks=81920, imaxpct=25\n         =                       sunit=0      swidth=0 blks\n";
        assert_eq!(xfs_info_data_size(xfs_info), Some(81920 * 4096));
        assert_eq!(xfs_info_data_size("nothing"), None);
        let usage = "Overall:\n    Device size:\t\t         314572800\n    Device allocated:\t\t          92274688\n    Device unallocated:\t\t         222298112\n    Device missing:\t\t                 0\n    Device slack:\t\t                 0\n";
        assert_eq!(btrfs_usage_device_size(usage), Some(314572800));
        assert_eq!(btrfs_usage_device_size("Overall:\n"), None);
        assert_eq!(btrfs_usage_device_size("    Device size: 300MiB\n"), None);
    }
}
