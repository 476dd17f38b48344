//! Making filesystems (mkfs.ext4, mkfs.xfs, mkfs.btrfs) and finding what a device
//! holds (`blkid -p`).

use std::ffi::OsStr;
use std::path::Path;

use super::{supported, LinuxFilesystems};
use crate::cmd::{self, SHORT_TIMEOUT};
use crate::error::Result;

/// One tag of `blkid -p`; exit code 2 means nothing was found.
pub(super) fn blkid_value(device: &Path, tag: &str) -> Result<Option<String>> {
    let args: [&OsStr; 6] = [
        "-p".as_ref(),
        "-o".as_ref(),
        "value".as_ref(),
        "-s".as_ref(),
        tag.as_ref(),
        device.as_os_str(),
    ];
    let out = cmd::run_unchecked("blkid", &args, SHORT_TIMEOUT)?;
    match out.status.code() {
        Some(0) => {
            let v = cmd::stdout_text(&out).trim().to_string();
            Ok((!v.is_empty()).then_some(v))
        }
        Some(2) => Ok(None),
        _ => Err(cmd::command_error("blkid", &args, &out)),
    }
}

impl LinuxFilesystems {
    /// Make a filesystem of `fstype` on `device`, overwriting what it holds.
    pub(super) fn make(&self, device: &Path, fstype: &str) -> Result<()> {
        supported(fstype)?;
        let dev = device.as_os_str();
        tracing::info!(device = %device.display(), fstype, "making filesystem");
        match fstype {
            // No reserved blocks (a volume has one user); lazy init and no discard
            // keep mkfs fast on a sparse image.
            "ext4" => self.run(
                "mkfs.ext4",
                &[
                    "-F".as_ref(),
                    "-q".as_ref(),
                    "-m".as_ref(),
                    "0".as_ref(),
                    "-E".as_ref(),
                    "lazy_itable_init=1,lazy_journal_init=1,nodiscard".as_ref(),
                    dev,
                ],
            ),
            "xfs" => self.run(
                "mkfs.xfs",
                &["-f".as_ref(), "-q".as_ref(), "-K".as_ref(), dev],
            ),
            _ => self.run(
                "mkfs.btrfs",
                &["-f".as_ref(), "-q".as_ref(), "-K".as_ref(), dev],
            ),
        }
        .map(|_| ())
    }
}
