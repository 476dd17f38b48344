//! Block devices: opening them, and the ioctls of <linux/fs.h> the driver uses on
//! them (size, read-ahead, read-only). The block ioctls are old `_IO` numbers that
//! nonetheless take an argument, hence the `_bad` forms of nix's macros.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use nix::errno::Errno;

use crate::error::{Result, SysError};

/// The ioctl type of the block layer's requests.
const BLK: u8 = 0x12;

nix::ioctl_write_ptr_bad!(blkroset, nix::request_code_none!(BLK, 93), libc::c_int);
nix::ioctl_write_int_bad!(blkraset, nix::request_code_none!(BLK, 98));
nix::ioctl_read_bad!(blkraget, nix::request_code_none!(BLK, 99), libc::c_long);
// The kernel declares it with size_t, which is 8 bytes on every 64-bit target,
// and writes a u64.
nix::ioctl_read!(blkgetsize64, BLK, 114, u64);
nix::ioctl_none_bad!(blkflsbuf, nix::request_code_none!(BLK, 97));

/// Open a device (close-on-exec, as std always does). `exclusive` adds O_EXCL,
/// which on a block device fails with EBUSY while it is mounted.
pub(crate) fn open_device(device: &Path, write: bool, exclusive: bool) -> Result<File> {
    let mut flags = 0;
    if exclusive {
        flags |= libc::O_EXCL;
    }
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(flags)
        .open(device)
        .map_err(|e| SysError::io("open device", device, e))
}

/// Makes the block device read-only or writable (BLKROSET).
pub(crate) fn set_read_only(device: &Path, read_only: bool) -> Result<()> {
    let dev = open_device(device, false, false)?;
    let value: libc::c_int = read_only.into();
    // SAFETY: BLKROSET reads one int through the pointer, which outlives the call.
    unsafe { blkroset(dev.as_raw_fd(), &value) }
        .map(drop)
        .map_err(|e| {
            SysError::syscall(
                format!("set read-only={read_only} on {}", device.display()),
                device,
                e as i32,
            )
        })
}

/// Set the read-ahead through the device (BLKRASET, in 512-byte sectors), not
/// sysfs: a container that is not in the host's network namespace gets /sys
/// read-only, privileged or not.
pub(crate) fn set_read_ahead_kib(device: &Path, kib: u32) -> Result<()> {
    let what = || format!("set the read-ahead of {} to {kib} KiB", device.display());
    let sectors = kib
        .checked_mul(2)
        .and_then(|s| libc::c_int::try_from(s).ok())
        .ok_or_else(|| SysError::InvalidArgument { what: what() })?;
    let dev = open_device(device, false, false)?;
    // SAFETY: BLKRASET takes its argument by value; no memory is passed.
    unsafe { blkraset(dev.as_raw_fd(), sectors) }
        .map(drop)
        .map_err(|e| SysError::syscall(what(), device, e as i32))
}

/// Whether something holds `device` exclusively (a filesystem on it, mounted in
/// any mount namespace, or being put away): an exclusive open is refused (EBUSY).
pub(crate) fn held(device: &Path) -> Result<bool> {
    match open_device(device, false, true) {
        Ok(_) => Ok(false),
        Err(e) if e.is_busy() => Ok(true),
        Err(e) => Err(e),
    }
}

/// Drops what the page cache of the device holds (BLKFLSBUF): what a filesystem
/// wrote to the device underneath it since is read afresh.
pub(crate) fn drop_cache(device: &Path) -> Result<()> {
    let dev = open_device(device, false, false)?;
    // SAFETY: BLKFLSBUF takes no argument.
    unsafe { blkflsbuf(dev.as_raw_fd()) }
        .map(drop)
        .map_err(|e| {
            SysError::syscall(
                format!("drop the page cache of {}", device.display()),
                device,
                e as i32,
            )
        })
}

/// The read-ahead of the device in KiB (BLKRAGET).
pub(crate) fn read_ahead_kib(device: &Path) -> Result<u32> {
    let dev = open_device(device, false, false)?;
    let mut sectors: libc::c_long = 0;
    // SAFETY: BLKRAGET writes one long through the pointer, which outlives the call.
    unsafe { blkraget(dev.as_raw_fd(), &mut sectors) }.map_err(|e| {
        SysError::syscall(
            format!("read the read-ahead of {}", device.display()),
            device,
            e as i32,
        )
    })?;
    u32::try_from(sectors / 2).map_err(|_| SysError::InvalidArgument {
        what: format!(
            "{} reports a read-ahead of {sectors} sectors",
            device.display()
        ),
    })
}

/// BLKGETSIZE64 of a block device; for a regular file (an image) its length.
pub(crate) fn size(device: &Path) -> Result<u64> {
    let f = open_device(device, false, false)?;
    let m = f.metadata().map_err(|e| SysError::io("stat", device, e))?;
    if m.is_file() {
        return Ok(m.len());
    }
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which outlives the call.
    unsafe { blkgetsize64(f.as_raw_fd(), &mut size) }.map_err(|e: Errno| {
        SysError::syscall(
            format!("get size of {}", device.display()),
            device,
            e as i32,
        )
    })?;
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request numbers nix computes are the kernel's.
    #[test]
    fn request_numbers_match_the_kernel() {
        assert_eq!(nix::request_code_none!(BLK, 93), 0x125D);
        assert_eq!(nix::request_code_none!(BLK, 98), 0x1262);
        assert_eq!(nix::request_code_none!(BLK, 99), 0x1263);
        assert_eq!(
            nix::request_code_read!(BLK, 114, std::mem::size_of::<u64>()),
            0x8008_1272
        );
    }
}
