//! Filesystems on block devices: made and probed ([`mkfs`]), checked ([`check`]),
//! measured ([`size`]), grown ([`grow`]) and frozen ([`freeze`]). The tools run
//! through [`crate::cmd`], each bounded by a timeout.

mod check;
mod freeze;
mod grow;
mod mkfs;
mod size;

use std::ffi::OsStr;
use std::path::Path;
use std::time::Duration;

use crate::cmd::{self, DEFAULT_TIMEOUT};
use crate::error::{Result, SysError};
use crate::{Filesystems, FsStats};

/// Filesystems through the usual tools. `timeout` bounds each long command
/// (mkfs, fsck, resize); None means [`cmd::DEFAULT_TIMEOUT`].
#[derive(Debug, Default)]
pub struct LinuxFilesystems {
    pub timeout: Option<Duration>,
}

/// The filesystem types `repair` repairs: ext4 alone (the others are checked
/// and replayed, never repaired whatever the damage).
pub(crate) fn repairable(device: &Path, fstype: &str) -> Result<()> {
    supported(fstype)?;
    if fstype != "ext4" {
        return Err(SysError::Unsupported {
            what: format!("repair of {fstype} on {}", device.display()),
        });
    }
    Ok(())
}

/// The filesystem types the driver makes and grows.
pub(crate) fn supported(fstype: &str) -> Result<()> {
    match fstype {
        "ext4" | "xfs" | "btrfs" => Ok(()),
        other => Err(SysError::Unsupported {
            what: format!("filesystem type {other:?} (supported: ext4, xfs, btrfs)"),
        }),
    }
}

impl LinuxFilesystems {
    pub fn with_timeout(timeout: Duration) -> Self {
        LinuxFilesystems {
            timeout: Some(timeout),
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout.unwrap_or(DEFAULT_TIMEOUT)
    }

    fn run(&self, program: &str, args: &[&OsStr]) -> Result<std::process::Output> {
        cmd::run(program, args, self.timeout())
    }
}

impl Filesystems for LinuxFilesystems {
    fn held(&self, device: &Path) -> Result<bool> {
        crate::linux::block::held(device)
    }

    fn probe(&self, device: &Path) -> Result<Option<String>> {
        mkfs::blkid_value(device, "TYPE")
    }

    fn mkfs(&self, device: &Path, fstype: &str) -> Result<()> {
        self.make(device, fstype)
    }

    /// ext4: `e2fsck -f -p` (fixes what is safe). xfs: `xfs_repair -n` (reports
    /// only), after replaying a dirty log by mounting once with nouuid. btrfs:
    /// `btrfs check --readonly`.
    fn check(&self, device: &Path, fstype: &str) -> Result<()> {
        self.check_fs(device, fstype)
    }

    fn repair(&self, device: &Path, fstype: &str) -> Result<()> {
        self.repair_fs(device, fstype)
    }

    /// From the superblock on the device; for a mounted xfs or btrfs from the
    /// mounted filesystem itself (their superblock writes bypass the device's page
    /// cache, so reading the device while mounted can show an old size).
    fn fs_size(&self, device: &Path, fstype: &str) -> Result<u64> {
        size::fs_size(device, fstype)
    }

    /// ext4 grows offline (`e2fsck -f -p`, then `resize2fs`) or online; online
    /// needs CAP_SYS_RESOURCE and answers PermissionDenied without it. xfs and
    /// btrfs grow online only: without a mountpoint they answer Unsupported.
    fn grow(&self, device: &Path, mountpoint: Option<&Path>, fstype: &str) -> Result<()> {
        self.grow_fs(device, mountpoint, fstype)
    }

    /// FIFREEZE; already frozen is Ok.
    fn freeze(&self, mountpoint: &Path) -> Result<()> {
        freeze::freeze(mountpoint)
    }

    /// FITHAW; not frozen is Ok.
    fn thaw(&self, mountpoint: &Path) -> Result<()> {
        freeze::thaw(mountpoint)
    }

    fn stats(&self, path: &Path) -> Result<FsStats> {
        crate::file::statvfs(path)
    }

    /// BLKGETSIZE64 of a block device; for a regular file (an image) its length.
    fn device_size(&self, device: &Path) -> Result<u64> {
        crate::linux::block::size(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fstype_is_unsupported() {
        let fs = LinuxFilesystems::default();
        assert!(fs
            .mkfs(Path::new("/dev/null"), "ntfs")
            .unwrap_err()
            .is_unsupported());
        assert!(fs
            .grow(Path::new("/dev/null"), None, "xfs")
            .unwrap_err()
            .is_unsupported());
    }
}
