//! The state of loop devices as sysfs shows it, and their nodes in /dev.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use nix::sys::stat::{makedev, mknod, Mode, SFlag};

use crate::error::{Result, SysError};
use crate::LoopDevice;

/// Used when sysfs does not say a device's number.
const LOOP_MAJOR: u64 = 7;

/// N of `/dev/loopN`.
pub(crate) fn loop_number(device: &Path) -> Option<u32> {
    device
        .file_name()?
        .to_str()?
        .strip_prefix("loop")?
        .parse()
        .ok()
}

pub(super) fn sysfs_read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim_end_matches('\n').to_string())
}

/// The backing file of loop device `n`, or None when it is not attached.
pub(super) fn read_backing(n: u32) -> Option<PathBuf> {
    let backing = sysfs_read(Path::new(&format!("/sys/block/loop{n}/loop/backing_file")))?;
    // A backing file removed while attached is reported with this suffix.
    Some(PathBuf::from(
        backing.strip_suffix(" (deleted)").unwrap_or(&backing),
    ))
}

/// The numbers of the loop devices the kernel has.
pub(super) fn loop_numbers() -> Result<Vec<u32>> {
    let dir = std::fs::read_dir("/sys/block")
        .map_err(|e| SysError::io("read directory", "/sys/block", e))?;
    Ok(dir
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("loop")?
                .parse::<u32>()
                .ok()
        })
        .collect())
}

/// The state of /dev/loopN from sysfs, None when nothing is attached.
pub(super) fn read_loop(n: u32) -> Option<LoopDevice> {
    let base = PathBuf::from(format!("/sys/block/loop{n}"));
    let backing = read_backing(n)?;
    let flag = |name: &str| {
        sysfs_read(&base.join(name))
            .map(|v| v.trim() == "1")
            .unwrap_or(false)
    };
    let sectors: u64 = sysfs_read(&base.join("size"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Some(LoopDevice {
        device: PathBuf::from(format!("/dev/loop{n}")),
        backing_file: backing,
        read_only: flag("ro"),
        direct_io: flag("loop/dio"),
        size: sectors.saturating_mul(512),
    })
}

/// The node `loopN` in `dev_dir`, created when missing (no udev here). The device
/// number is read from sysfs, since loop's minors depend on its max_part setting.
pub(super) fn ensure_node(dev_dir: &Path, n: u32) -> Result<PathBuf> {
    let dev = dev_dir.join(format!("loop{n}"));
    match std::fs::metadata(&dev) {
        Ok(m) if m.file_type().is_block_device() => return Ok(dev),
        Ok(_) => {
            return Err(SysError::InvalidArgument {
                what: format!("{} exists and is not a block device", dev.display()),
            })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(SysError::io("stat", &dev, e)),
    }
    let (major, minor) = sysfs_read(Path::new(&format!("/sys/block/loop{n}/dev")))
        .and_then(|s| {
            let (a, b) = s.trim().split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((LOOP_MAJOR, u64::from(n)));
    crate::file::check_path(&dev)?;
    let mode = Mode::from_bits_truncate(0o660);
    match mknod(&dev, SFlag::S_IFBLK, mode, makedev(major, minor)) {
        // Another process made it meanwhile: fine.
        Ok(()) | Err(nix::errno::Errno::EEXIST) => Ok(dev),
        Err(e) => Err(SysError::io("create device node", &dev, e.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_numbers_of_paths() {
        assert_eq!(loop_number(Path::new("/dev/loop12")), Some(12));
        assert_eq!(loop_number(Path::new("/dev/sda")), None);
    }
}
