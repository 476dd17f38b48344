//! The loop ioctls of <linux/loop.h> and the structs they take. The loop driver
//! numbers its requests with `_IO('L', n)` even where they take an argument, hence
//! the `_bad` forms of nix's macros.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use nix::errno::Errno;

use crate::error::{Result, SysError};
use crate::linux::block::open_device;
use crate::LoopOptions;

pub(super) const LOOP_CONTROL: &str = "/dev/loop-control";
const LO_NAME_SIZE: usize = 64;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// The ioctl type of the loop driver's requests.
const LOOP: u8 = b'L';

nix::ioctl_write_int_bad!(loop_set_fd, nix::request_code_none!(LOOP, 0x00));
nix::ioctl_none!(loop_clr_fd, LOOP, 0x01);
nix::ioctl_write_ptr_bad!(
    loop_set_status64,
    nix::request_code_none!(LOOP, 0x04),
    LoopInfo64
);
nix::ioctl_read_bad!(
    loop_get_status64,
    nix::request_code_none!(LOOP, 0x05),
    LoopInfo64
);
nix::ioctl_none!(loop_set_capacity, LOOP, 0x07);
nix::ioctl_write_int_bad!(loop_set_direct_io, nix::request_code_none!(LOOP, 0x08));
nix::ioctl_write_ptr_bad!(
    loop_configure,
    nix::request_code_none!(LOOP, 0x0A),
    LoopConfig
);
nix::ioctl_none!(loop_ctl_get_free, LOOP, 0x82);

/// struct loop_info64 of <linux/loop.h>.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// struct loop_config of <linux/loop.h> (LOOP_CONFIGURE, Linux 5.8+).
#[repr(C)]
pub(super) struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

impl LoopInfo64 {
    fn zeroed() -> Self {
        LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        }
    }
}

/// The number of a free loop device (LOOP_CTL_GET_FREE), which the kernel creates
/// when none is free.
pub(super) fn get_free_loop() -> Result<u32> {
    let ctl = open_device(Path::new(LOOP_CONTROL), true, false)?;
    // SAFETY: LOOP_CTL_GET_FREE takes no argument.
    let n = unsafe { loop_ctl_get_free(ctl.as_raw_fd()) }.map_err(|e| {
        SysError::syscall(
            format!("find a free loop device ({LOOP_CONTROL})"),
            LOOP_CONTROL,
            e as i32,
        )
    })?;
    u32::try_from(n).map_err(|_| SysError::InvalidArgument {
        what: format!("{LOOP_CONTROL} returned device number {n}"),
    })
}

/// The loop_info64 for attaching `backing` with `opts`.
pub(super) fn loop_info(backing: &Path, opts: LoopOptions) -> LoopInfo64 {
    let mut info = LoopInfo64::zeroed();
    if opts.read_only {
        info.lo_flags |= LO_FLAGS_READ_ONLY;
    }
    if opts.direct_io {
        info.lo_flags |= LO_FLAGS_DIRECT_IO;
    }
    // lo_file_name is informational (losetup shows it); keep a NUL at the end.
    let name = backing.as_os_str().as_encoded_bytes();
    let len = name.len().min(LO_NAME_SIZE - 1);
    info.lo_file_name[..len].copy_from_slice(&name[..len]);
    info
}

/// Bind `file` to the loop device `dev`: LOOP_CONFIGURE in one step, or the older
/// LOOP_SET_FD + LOOP_SET_STATUS64 on kernels without it.
pub(super) fn configure(
    dev: &File,
    file: &File,
    backing: &Path,
    opts: LoopOptions,
) -> std::result::Result<(), Errno> {
    let info = loop_info(backing, opts);
    let fd = u32::try_from(file.as_raw_fd()).map_err(|_| Errno::EBADF)?;
    // The sector size is chosen here, never left to the kernel (0): a device
    // asked for direct I/O would take the backing file's direct I/O alignment
    // as its sector size, 4096 for a file on xfs that shares blocks (a volume
    // filled from a template, a snapshot's source), where an xfs or a small
    // ext4 made on 512-byte sectors no longer mounts. So 512, the size every
    // filesystem mounts on; with direct I/O, 4096 where the image's own
    // filesystem allows it, so that such a file gets direct I/O too (at 512
    // the kernel leaves it off for that file).
    let block_size = if opts.direct_io {
        crate::superblock::widest_sector(file)
    } else {
        crate::superblock::SMALL_SECTOR
    };
    let config = LoopConfig {
        fd,
        block_size,
        info,
        reserved: [0; 8],
    };
    // SAFETY: LOOP_CONFIGURE reads a loop_config, laid out as the kernel's, through
    // the pointer, which outlives the call.
    match unsafe { loop_configure(dev.as_raw_fd(), &config) } {
        Ok(_) => Ok(()),
        // Kernels before 5.8 answer EINVAL (or ENOTTY) to an unknown loop ioctl.
        Err(Errno::EINVAL) | Err(Errno::ENOTTY) => configure_legacy(dev, file, info),
        Err(e) => Err(e),
    }
}

/// LOOP_SET_FD + LOOP_SET_STATUS64. Read-only follows from how `file` was opened;
/// direct I/O is turned on afterwards by the caller when asked.
pub(super) fn configure_legacy(
    dev: &File,
    file: &File,
    mut info: LoopInfo64,
) -> std::result::Result<(), Errno> {
    // SAFETY: LOOP_SET_FD takes the backing file's descriptor by value.
    unsafe { loop_set_fd(dev.as_raw_fd(), file.as_raw_fd()) }?;
    // SET_STATUS64 ignores flags other than autoclear/partscan.
    info.lo_flags &= !(LO_FLAGS_READ_ONLY | LO_FLAGS_DIRECT_IO);
    // SAFETY: LOOP_SET_STATUS64 reads a loop_info64 through the pointer, which
    // outlives the call.
    if let Err(e) = unsafe { loop_set_status64(dev.as_raw_fd(), &info) } {
        let _ = clear_fd(dev);
        return Err(e);
    }
    Ok(())
}

/// LOOP_CLR_FD: detach, or mark the device to detach when its last user closes it.
pub(super) fn clear_fd(dev: &File) -> std::result::Result<(), Errno> {
    // SAFETY: LOOP_CLR_FD takes no argument.
    unsafe { loop_clr_fd(dev.as_raw_fd()) }.map(drop)
}

/// LOOP_SET_CAPACITY: re-read the size of the backing file.
pub(super) fn set_capacity(dev: &File) -> std::result::Result<(), Errno> {
    // SAFETY: LOOP_SET_CAPACITY takes no argument.
    unsafe { loop_set_capacity(dev.as_raw_fd()) }.map(drop)
}

/// LOOP_SET_DIRECT_IO.
pub(super) fn set_direct_io(dev: &File, on: bool) -> std::result::Result<(), Errno> {
    // SAFETY: LOOP_SET_DIRECT_IO takes its argument by value.
    unsafe { loop_set_direct_io(dev.as_raw_fd(), on.into()) }.map(drop)
}

/// Whether the device open as `dev` serves the file `identity` (st_dev, st_ino);
/// if it does and is marked to detach itself once released (LO_FLAGS_AUTOCLEAR),
/// the mark is cleared, so it serves that file until it is detached on purpose.
/// The open descriptor keeps the kernel from tearing the device down meanwhile.
/// False for a device that serves another file, or none.
pub(super) fn keep_serving(dev: &File, identity: (u64, u64)) -> std::result::Result<bool, Errno> {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 writes a loop_info64 through the pointer, which
    // outlives the call.
    match unsafe { loop_get_status64(dev.as_raw_fd(), &mut info) } {
        Ok(_) => {}
        Err(Errno::ENXIO) => return Ok(false),
        Err(e) => return Err(e),
    }
    if (info.lo_device, info.lo_inode) != identity {
        return Ok(false);
    }
    if info.lo_flags & LO_FLAGS_AUTOCLEAR != 0 {
        // SET_STATUS64 takes autoclear (and partscan) from the flags given and
        // keeps the device's other flags; offset and size limit are the device's.
        info.lo_flags &= !LO_FLAGS_AUTOCLEAR;
        // SAFETY: LOOP_SET_STATUS64 reads a loop_info64 through the pointer, which
        // outlives the call.
        unsafe { loop_set_status64(dev.as_raw_fd(), &info) }?;
    }
    Ok(true)
}

/// (st_dev, st_ino) of the backing file of an attached loop device, from
/// LOOP_GET_STATUS64.
pub(crate) fn backing_identity(device: &Path) -> Option<(u64, u64)> {
    let f = open_device(device, false, false).ok()?;
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 writes a loop_info64 through the pointer, which
    // outlives the call.
    unsafe { loop_get_status64(f.as_raw_fd(), &mut info) }.ok()?;
    Some((info.lo_device, info.lo_inode))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_layouts_match_the_kernel() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    /// The request numbers nix computes are those of <linux/loop.h>.
    #[test]
    fn request_numbers_match_the_kernel() {
        let codes = [
            nix::request_code_none!(LOOP, 0x00),
            nix::request_code_none!(LOOP, 0x0A),
            nix::request_code_none!(LOOP, 0x82),
        ];
        assert_eq!(codes, [0x4C00, 0x4C0A, 0x4C82]);
    }
}
