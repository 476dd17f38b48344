//! Checking unmounted filesystems: e2fsck, xfs_repair -n, btrfs check.

use std::ffi::OsStr;
use std::path::Path;

use super::{supported, LinuxFilesystems};
use crate::cmd;
use crate::error::Result;
use crate::linux::LinuxMounter;
use crate::{MountOptions, Mounter};

impl LinuxFilesystems {
    pub(super) fn check_fs(&self, device: &Path, fstype: &str) -> Result<()> {
        supported(fstype)?;
        let dev = device.as_os_str();
        match fstype {
            "ext4" => self.e2fsck(device),
            "xfs" => self.xfs_repair_check(device),
            _ => self
                .run("btrfs", &["check".as_ref(), "--readonly".as_ref(), dev])
                .map(|_| ()),
        }
    }

    /// `e2fsck -f -p`: exit 0 (clean), 1 (errors fixed) and 2 (fixed, reboot
    /// advised, irrelevant for an unmounted volume) are success.
    pub(super) fn e2fsck(&self, device: &Path) -> Result<()> {
        let args: [&OsStr; 3] = ["-f".as_ref(), "-p".as_ref(), device.as_os_str()];
        let out = cmd::run_unchecked("e2fsck", &args, self.timeout())?;
        match out.status.code() {
            Some(0) => Ok(()),
            Some(1) | Some(2) => {
                tracing::warn!(device = %device.display(), "e2fsck fixed errors");
                Ok(())
            }
            _ => Err(cmd::command_error("e2fsck", &args, &out)),
        }
    }

    /// `xfs_repair -n`. With -n a dirty log is ignored and the check reports
    /// spurious damage; replaying the log (mounting once) first gives a real answer.
    fn xfs_repair_check(&self, device: &Path) -> Result<()> {
        let args: [&OsStr; 2] = ["-n".as_ref(), device.as_os_str()];
        let mut replayed = false;
        loop {
            let out = cmd::run_unchecked("xfs_repair", &args, self.timeout())?;
            if out.status.success() {
                return Ok(());
            }
            let stderr = String::from_utf8_lossy(&out.stderr);
            if !replayed && stderr.contains("valuable metadata changes in a log") {
                self.replay_xfs_log(device)?;
                replayed = true;
                continue;
            }
            return Err(cmd::command_error("xfs_repair", &args, &out));
        }
    }

    /// Replay the log of an unmounted xfs by mounting it once (nouuid, since its
    /// source may be mounted with the same UUID) on a temporary folder.
    fn replay_xfs_log(&self, device: &Path) -> Result<()> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            ".csi-sys-xfs-replay-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        crate::file::mkdir_p_mode(&dir, 0o700)?;
        tracing::info!(device = %device.display(), "replaying the xfs log before changing its UUID");
        let opts = MountOptions {
            read_only: false,
            flags: vec!["nouuid".to_string()],
        };
        let res = LinuxMounter
            .mount(device, &dir, "xfs", &opts)
            .and_then(|()| LinuxMounter.unmount(&dir));
        if let Err(e) = std::fs::remove_dir(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove the replay folder");
        }
        res
    }
}
