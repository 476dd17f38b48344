//! Checking unmounted filesystems: e2fsck, xfs_repair -n, btrfs check.

use std::ffi::OsStr;
use std::path::Path;

use super::{supported, LinuxFilesystems};
use crate::cmd;
use crate::error::{Result, SysError};

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
        self.e2fsck_with(device, "-p")
    }

    /// `e2fsck -f -y`, success as for `e2fsck`; 4 and above (errors left, or
    /// e2fsck itself failed) are not.
    pub(super) fn repair_fs(&self, device: &Path, fstype: &str) -> Result<()> {
        super::repairable(device, fstype)?;
        self.e2fsck_with(device, "-y")
    }

    fn e2fsck_with(&self, device: &Path, mode: &str) -> Result<()> {
        let args: [&OsStr; 3] = ["-f".as_ref(), mode.as_ref(), device.as_os_str()];
        let out = cmd::run_unchecked("e2fsck", &args, self.timeout())?;
        match out.status.code() {
            Some(0) => Ok(()),
            Some(1) | Some(2) => {
                tracing::warn!(device = %device.display(), mode, "e2fsck fixed errors");
                Ok(())
            }
            _ => Err(cmd::command_error("e2fsck", &args, &out)),
        }
    }

    /// `xfs_repair -n`. With -n a log holding changes is not replayed, and the
    /// check reports damage that is none: the "valuable metadata changes in a log"
    /// it names, or, before it even looks at the log, a primary superblock that
    /// disagrees with the others (a grow whose new size is in the log, copied by a
    /// snapshot or clone, or cut short by a crash, has written the other
    /// superblocks already). So after a first failure the log is replayed (the
    /// filesystem made once, see `replay_xfs_log`) and the check runs again; its
    /// answer is the check's. A filesystem that cannot be made to replay keeps the
    /// first answer.
    fn xfs_repair_check(&self, device: &Path) -> Result<()> {
        let args: [&OsStr; 2] = ["-n".as_ref(), device.as_os_str()];
        let out = cmd::run_unchecked("xfs_repair", &args, self.timeout())?;
        if out.status.success() {
            return Ok(());
        }
        let first = cmd::command_error("xfs_repair", &args, &out);
        if let Err(e) = self.replay_xfs_log(device) {
            tracing::warn!(device = %device.display(), error = %e, "the xfs log could not be replayed");
            return Err(first);
        }
        let out = cmd::run_unchecked("xfs_repair", &args, self.timeout())?;
        if out.status.success() {
            return Ok(());
        }
        tracing::warn!(device = %device.display(), before = %first, "xfs_repair -n fails after the log was replayed too");
        Err(cmd::command_error("xfs_repair", &args, &out))
    }

    /// Replays the log of an unmounted xfs by making its filesystem once (nouuid,
    /// since its source may be mounted with the same UUID) through the new mount
    /// API, attached nowhere: no process sees a mount, nothing is left in any
    /// mount table or directory, and the filesystem is put away cleanly when its
    /// descriptor closes, here or, should the driver be killed in between, at the
    /// process's end. (A mount on a directory, left behind by a kill, held the
    /// volume's device and refused every later stage of the volume.)
    fn replay_xfs_log(&self, device: &Path) -> Result<()> {
        use rustix::mount::FsOpenFlags;
        use rustix::mount::{fsconfig_create, fsconfig_set_flag, fsconfig_set_string, fsopen};
        tracing::info!(device = %device.display(), "replaying the xfs log before checking it");
        let failed = |what: &str, e: rustix::io::Errno| {
            SysError::syscall(
                format!("{what} in the xfs log replay of {}", device.display()),
                device,
                e.raw_os_error(),
            )
        };
        let fs = fsopen("xfs", FsOpenFlags::FSOPEN_CLOEXEC).map_err(|e| failed("fsopen", e))?;
        fsconfig_set_string(&fs, "source", device).map_err(|e| failed("fsconfig source", e))?;
        fsconfig_set_flag(&fs, "nouuid").map_err(|e| failed("fsconfig nouuid", e))?;
        // The log is replayed as the filesystem is made.
        fsconfig_create(&fs).map_err(|e| failed("fsconfig create", e))?;
        crate::failpoint("xfs.replay-mounted");
        drop(fs);
        // The kernel puts the filesystem away once its descriptor is closed, and
        // lets go of the device only then, which may be a moment later: the next
        // check must not read the device before. Then the device's page cache,
        // which still holds what the first check read, is dropped: the
        // filesystem wrote underneath it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while crate::linux::block::held(device)? {
            if std::time::Instant::now() >= deadline {
                return Err(SysError::Busy {
                    what: format!(
                        "{} is still held 10 s after its xfs log replay",
                        device.display()
                    ),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        crate::linux::block::drop_cache(device)
    }
}
