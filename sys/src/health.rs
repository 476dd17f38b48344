//! What the kernel tells about the health of a filesystem, a file or a loop
//! device: ext4's recorded errors (sysfs), btrfs's device error counters, a
//! filesystem or file that answers EIO (an xfs after a shutdown, a failing
//! disk), and a loop device whose backing file was deleted or replaced. These
//! probes only read; what a finding means is the domain's decision.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::cmd::{self, SHORT_TIMEOUT};
use crate::error::{Result, SysError};

/// One error site ext4 keeps in its superblock (first and last error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ext4ErrorSite {
    /// Seconds since the epoch.
    pub time: u64,
    pub function: String,
    pub line: u64,
    pub inode: u64,
    pub block: u64,
}

/// The errors an ext4 filesystem has recorded since it was made (or last
/// repaired): they survive unmounts, so a volume that hit corruption once says so
/// until e2fsck clears it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ext4Errors {
    pub count: u64,
    pub first: Option<Ext4ErrorSite>,
    pub last: Option<Ext4ErrorSite>,
}

/// The recorded errors of the mounted ext4 on `device` (`/dev/loop3`), from
/// `/sys/fs/ext4/<name>/`. None when the kernel has no such entry (not a mounted
/// ext4).
pub fn ext4_errors(device: &Path) -> Option<Ext4Errors> {
    ext4_errors_in(&Path::new("/sys/fs/ext4").join(device.file_name()?))
}

fn ext4_errors_in(dir: &Path) -> Option<Ext4Errors> {
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .ok()
            .map(|s| s.trim().to_string())
    };
    let number = |name: &str| read(name).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    let count = read("errors_count")?.parse().ok()?;
    let site = |which: &str| {
        let time = number(&format!("{which}_error_time"));
        (time != 0).then(|| Ext4ErrorSite {
            time,
            function: read(&format!("{which}_error_func")).unwrap_or_default(),
            line: number(&format!("{which}_error_line")),
            inode: number(&format!("{which}_error_ino")),
            block: number(&format!("{which}_error_block")),
        })
    };
    Some(Ext4Errors {
        count,
        first: site("first"),
        last: site("last"),
    })
}

/// The persistent error counters btrfs keeps per device of a filesystem.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BtrfsDeviceErrors {
    pub device: String,
    pub write_io: u64,
    pub read_io: u64,
    pub flush_io: u64,
    /// Checksum mismatches: data or metadata read back wrong.
    pub corruption: u64,
    /// Blocks from the wrong generation: lost or misdirected writes.
    pub generation: u64,
}

/// `btrfs device stats` of the filesystem mounted at `mountpoint`.
pub fn btrfs_device_errors(mountpoint: &Path) -> Result<Vec<BtrfsDeviceErrors>> {
    let out = cmd::run(
        "btrfs",
        &["device".as_ref(), "stats".as_ref(), mountpoint.as_os_str()],
        SHORT_TIMEOUT,
    )?;
    Ok(parse_btrfs_device_stats(&cmd::stdout_text(&out)))
}

/// Parses lines such as `[/dev/loop2].corruption_errs  2`.
fn parse_btrfs_device_stats(text: &str) -> Vec<BtrfsDeviceErrors> {
    let mut out: Vec<BtrfsDeviceErrors> = Vec::new();
    for line in text.lines() {
        let Some((key, value)) = line.trim().rsplit_once(char::is_whitespace) else {
            continue;
        };
        let Some((device, counter)) = key.trim().rsplit_once("].") else {
            continue;
        };
        let device = device.trim_start_matches('[').to_string();
        let Ok(value) = value.trim().parse::<u64>() else {
            continue;
        };
        if out.last().is_none_or(|d| d.device != device) {
            out.push(BtrfsDeviceErrors {
                device,
                ..Default::default()
            });
        }
        let Some(d) = out.last_mut() else { continue };
        match counter {
            "write_io_errs" => d.write_io = value,
            "read_io_errs" => d.read_io = value,
            "flush_io_errs" => d.flush_io = value,
            "corruption_errs" => d.corruption = value,
            "generation_errs" => d.generation = value,
            _ => {}
        }
    }
    out
}

/// Opens a directory and reads one entry: a filesystem that was shut down (xfs
/// after a metadata I/O error or `xfs_io -x -c shutdown`) or whose disk fails
/// answers EIO here, though statvfs still works.
pub fn read_directory(dir: &Path) -> Result<()> {
    let mut entries = std::fs::read_dir(dir).map_err(|e| SysError::io("list", dir, e))?;
    match entries.next() {
        Some(Err(e)) => Err(SysError::io("list", dir, e)),
        _ => Ok(()),
    }
}

/// Reads the first bytes of a file (an image), so that a file whose blocks the
/// disk cannot read, or that sits on a shut-down filesystem, shows as unreadable.
pub fn read_file_start(file: &Path) -> Result<()> {
    let mut f = std::fs::File::open(file).map_err(|e| SysError::io("open", file, e))?;
    let mut buf = [0u8; 4096];
    f.read(&mut buf)
        .map(|_| ())
        .map_err(|e| SysError::io("read", file, e))
}

/// What a loop device serves, compared with the file the volume's image is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoopBacking {
    /// The device serves this very file.
    Current,
    /// The file the device serves was deleted: writes go to an orphan inode that
    /// vanishes when the device is detached.
    Deleted { served: PathBuf },
    /// A different file now sits at the path the device was attached from.
    Replaced { served: PathBuf },
    /// Nothing is attached to the device, or its state cannot be read.
    Unknown,
}

/// Compares what loop `device` serves with `image`.
pub fn loop_backing(device: &Path, image: &Path) -> LoopBacking {
    let Some(n) = device
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("loop"))
        .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
    else {
        return LoopBacking::Unknown;
    };
    let Ok(text) = std::fs::read_to_string(format!("/sys/block/loop{n}/loop/backing_file")) else {
        return LoopBacking::Unknown;
    };
    let text = text.trim_end_matches('\n');
    if let Some(path) = text.strip_suffix(" (deleted)") {
        return LoopBacking::Deleted {
            served: PathBuf::from(path),
        };
    }
    let served = PathBuf::from(text);
    let now = std::fs::metadata(image).ok().map(|m| (m.dev(), m.ino()));
    match (crate::linux::backing_identity(device), now) {
        (Some(a), Some(b)) if a != b => LoopBacking::Replaced { served },
        (Some(_), None) => LoopBacking::Replaced { served },
        (Some(_), Some(_)) => LoopBacking::Current,
        (None, _) => LoopBacking::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn btrfs_device_stats_are_parsed_per_device() {
        let text = "[/dev/loop2].write_io_errs    0\n\
                    [/dev/loop2].read_io_errs     3\n\
                    [/dev/loop2].flush_io_errs    0\n\
                    [/dev/loop2].corruption_errs  2\n\
                    [/dev/loop2].generation_errs  1\n\
                    [/dev/loop5].write_io_errs    7\n";
        let stats = parse_btrfs_device_stats(text);
        assert_eq!(
            stats,
            vec![
                BtrfsDeviceErrors {
                    device: "/dev/loop2".into(),
                    read_io: 3,
                    corruption: 2,
                    generation: 1,
                    ..Default::default()
                },
                BtrfsDeviceErrors {
                    device: "/dev/loop5".into(),
                    write_io: 7,
                    ..Default::default()
                },
            ]
        );
    }

    #[test]
    fn ext4_error_sites_are_read_from_sysfs_files() {
        let dir = std::env::temp_dir().join(format!("ext4-sysfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, value) in [
            ("errors_count", "2\n"),
            ("first_error_time", "1700000000\n"),
            ("first_error_func", "ext4_lookup\n"),
            ("first_error_line", "1812\n"),
            ("first_error_ino", "12\n"),
            ("first_error_block", "0\n"),
            ("last_error_time", "0\n"),
        ] {
            std::fs::write(dir.join(name), value).unwrap();
        }
        let errors = ext4_errors_in(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(errors.count, 2);
        assert_eq!(
            errors.first,
            Some(Ext4ErrorSite {
                time: 1_700_000_000,
                function: "ext4_lookup".into(),
                line: 1812,
                inode: 12,
                block: 0,
            })
        );
        assert_eq!(errors.last, None);
        assert_eq!(ext4_errors_in(&dir), None, "no sysfs entry, no answer");
    }
}
