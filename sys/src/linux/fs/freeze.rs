//! Freezing and thawing a mounted filesystem (FIFREEZE / FITHAW of <linux/fs.h>),
//! so that a copy of its device is consistent.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use nix::errno::Errno;

use crate::error::{Result, SysError};

nix::ioctl_readwrite!(fifreeze, b'X', 119, libc::c_int);
nix::ioctl_readwrite!(fithaw, b'X', 120, libc::c_int);

/// The root of the filesystem mounted at `mountpoint`, opened; NotMounted when
/// nothing is mounted there.
fn open_mountpoint(mountpoint: &Path) -> Result<File> {
    let real =
        std::fs::canonicalize(mountpoint).map_err(|e| SysError::io("resolve", mountpoint, e))?;
    let table = crate::mountinfo::read()?;
    if crate::mountinfo::mount_at(&table, &real).is_none() {
        return Err(SysError::NotMounted {
            path: mountpoint.to_path_buf(),
        });
    }
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(&real)
        .map_err(|e| SysError::io("open", mountpoint, e))
}

/// FIFREEZE; already frozen (EBUSY) is Ok.
pub(super) fn freeze(mountpoint: &Path) -> Result<()> {
    let f = open_mountpoint(mountpoint)?;
    let mut unused: libc::c_int = 0;
    // SAFETY: FIFREEZE ignores its argument; the pointer is valid all the same.
    match unsafe { fifreeze(f.as_raw_fd(), &mut unused) } {
        Ok(_) | Err(Errno::EBUSY) => Ok(()),
        Err(Errno::EOPNOTSUPP) => Err(SysError::Unsupported {
            what: format!("freezing the filesystem at {}", mountpoint.display()),
        }),
        Err(e) => Err(SysError::syscall(
            format!("freeze {}", mountpoint.display()),
            mountpoint,
            e as i32,
        )),
    }
}

/// FITHAW; not frozen (EINVAL) is Ok.
pub(super) fn thaw(mountpoint: &Path) -> Result<()> {
    let f = open_mountpoint(mountpoint)?;
    let mut unused: libc::c_int = 0;
    // SAFETY: FITHAW ignores its argument; the pointer is valid all the same.
    match unsafe { fithaw(f.as_raw_fd(), &mut unused) } {
        Ok(_) | Err(Errno::EINVAL) => Ok(()),
        Err(e) => Err(SysError::syscall(
            format!("thaw {}", mountpoint.display()),
            mountpoint,
            e as i32,
        )),
    }
}

#[cfg(test)]
mod tests {
    /// The request numbers nix computes are those of <linux/fs.h>.
    #[test]
    fn request_numbers_match_the_kernel() {
        let size = std::mem::size_of::<libc::c_int>();
        assert_eq!(nix::request_code_readwrite!(b'X', 119, size), 0xC004_5877);
        assert_eq!(nix::request_code_readwrite!(b'X', 120, size), 0xC004_5878);
    }
}
