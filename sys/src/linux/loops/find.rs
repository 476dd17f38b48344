//! Finding the loop devices that serve a file, and whether anything writes to it.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::ctl::backing_identity;
use super::sysfs::{read_backing, read_loop};
use crate::error::{Result, SysError};
use crate::LoopDevice;

/// The backing file a lookup wants: its canonical path and its identity.
pub(super) struct Wanted {
    path: PathBuf,
    identity: Option<(u64, u64)>,
}

impl Wanted {
    pub(super) fn new(backing: &Path) -> Wanted {
        let path = std::fs::canonicalize(backing).unwrap_or_else(|_| backing.to_path_buf());
        let identity = std::fs::metadata(&path).ok().map(|m| (m.dev(), m.ino()));
        Wanted { path, identity }
    }

    /// Whether loop device `n` shows a backing file by this path, or by another
    /// path with the same file name (see [`crate::Loops::find`]); reads one sysfs
    /// file.
    pub(super) fn candidate(&self, n: u32) -> bool {
        let name = self.path.file_name();
        read_backing(n).is_some_and(|b| {
            b == self.path || (self.identity.is_some() && name.is_some() && b.file_name() == name)
        })
    }

    /// Loop device `n` when the kernel's identity of its backing file is this
    /// file's, reported by the path wanted.
    pub(super) fn confirm(&self, n: u32) -> Option<LoopDevice> {
        read_loop(n)
            .filter(|d| match (self.identity, backing_identity(&d.device)) {
                (Some(a), Some(b)) => a == b,
                _ => d.backing_file == self.path,
            })
            .map(|d| LoopDevice {
                backing_file: self.path.clone(),
                ..d
            })
    }
}

/// Whether anything holds `path` open for writing, from whether the kernel grants
/// a read lease on it (it refuses one exactly then); None when that cannot be
/// asked (no such file, a filesystem without leases, leases turned off).
pub(super) fn open_for_writing_elsewhere(path: &Path) -> Option<bool> {
    let f = OpenOptions::new().read(true).open(path).ok()?;
    // nix has no F_SETLEASE, so this one fcntl is called through libc.
    // SAFETY: fcntl on a descriptor this function owns, with integer arguments;
    // the lease is released at once (and with the descriptor in any case).
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) };
    if r == 0 {
        // SAFETY: as above.
        unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) };
        return Some(false);
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN) => Some(true),
        _ => None,
    }
}

/// Whether a filesystem on the block device `device` is mounted in this mount
/// namespace (by its device number in /proc/self/mountinfo).
pub(super) fn mounted_device(device: &Path) -> Result<bool> {
    let rdev = match std::fs::metadata(device) {
        Ok(m) => m.rdev(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(SysError::io("stat", device, e)),
    };
    let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    Ok(crate::mountinfo::read()?
        .iter()
        .any(|m| u64::from(m.major) == major && u64::from(m.minor) == minor))
}
