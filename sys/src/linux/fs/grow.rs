//! Growing a filesystem to fill its device: resize2fs, xfs_growfs, btrfs resize.

use std::path::Path;

use super::{supported, LinuxFilesystems};
use crate::error::{Result, SysError};

impl LinuxFilesystems {
    pub(super) fn grow_fs(
        &self,
        device: &Path,
        mountpoint: Option<&Path>,
        fstype: &str,
    ) -> Result<()> {
        supported(fstype)?;
        tracing::info!(device = %device.display(), mountpoint = ?mountpoint, fstype, "growing filesystem");
        match (fstype, mountpoint) {
            ("ext4", None) => {
                self.e2fsck(device)?;
                self.run("resize2fs", &[device.as_os_str()]).map(|_| ())
            }
            ("ext4", Some(_)) => self.grow_ext4_online(device),
            ("xfs", Some(mnt)) => self
                .run("xfs_growfs", &["-d".as_ref(), mnt.as_os_str()])
                .map(|_| ()),
            ("btrfs", Some(mnt)) => self
                .run(
                    "btrfs",
                    &[
                        "filesystem".as_ref(),
                        "resize".as_ref(),
                        "max".as_ref(),
                        mnt.as_os_str(),
                    ],
                )
                .map(|_| ()),
            (_, _) => Err(SysError::Unsupported {
                what: format!(
                    "offline grow of {fstype} on {} (it grows only while mounted)",
                    device.display()
                ),
            }),
        }
    }

    /// `resize2fs` of a mounted ext4, which needs CAP_SYS_RESOURCE.
    fn grow_ext4_online(&self, device: &Path) -> Result<()> {
        match self.run("resize2fs", &[device.as_os_str()]) {
            Err(SysError::Command { stderr, .. })
                if stderr.contains("Operation not permitted")
                    || stderr.contains("Permission denied") =>
            {
                tracing::debug!(%stderr, "resize2fs refused the online grow");
                Err(SysError::PermissionDenied {
                    op: "online grow of ext4 with resize2fs (it needs CAP_SYS_RESOURCE; grow it while unmounted instead) on"
                        .to_string(),
                    path: device.to_path_buf(),
                })
            }
            other => other.map(|_| ()),
        }
    }
}
