//! Attaching a file to a free loop device, without ever attaching it twice.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;

use super::ctl::{configure, get_free_loop};
use super::sysfs::{ensure_node, read_loop};
use crate::error::{Result, SysError};
use crate::linux::block::{self, open_device};
use crate::{LoopDevice, LoopOptions, Loops};

/// How many free devices attach tries when another process grabs the one it got.
const ATTACH_ATTEMPTS: usize = 8;

/// Serialises attaches of this process: two threads would otherwise get the same
/// free device from LOOP_CTL_GET_FREE and one would fail with EBUSY.
pub(super) static ATTACH_LOCK: Mutex<()> = Mutex::new(());

/// Opens the backing file as the attach needs it, checking that it is a regular
/// file; returns it with its canonical path.
fn open_backing(backing: &Path, opts: LoopOptions) -> Result<(File, PathBuf)> {
    let real = std::fs::canonicalize(backing).map_err(|e| SysError::io("resolve", backing, e))?;
    let file = OpenOptions::new()
        .read(true)
        .write(!opts.read_only)
        .open(&real)
        .map_err(|e| SysError::io("open backing file", &real, e))?;
    let meta = file
        .metadata()
        .map_err(|e| SysError::io("stat", &real, e))?;
    if !meta.is_file() {
        return Err(SysError::InvalidArgument {
            what: format!("loop backing {} is not a regular file", real.display()),
        });
    }
    Ok((file, real))
}

/// Attach `backing` with `opts`; the caller holds [`ATTACH_LOCK`].
pub(super) fn attach_locked(
    loops: &dyn Loops,
    backing: &Path,
    opts: LoopOptions,
) -> Result<LoopDevice> {
    let (file, real) = open_backing(backing, opts)?;
    let mut last_err = None;
    for attempt in 0..ATTACH_ATTEMPTS {
        let n = get_free_loop()?;
        let device = ensure_node(Path::new("/dev"), n)?;
        let dev = open_device(&device, true, false)?;
        let res = configure(&dev, &file, &real, opts);
        drop(dev);
        let errno = match res {
            Ok(()) => return finish_attach(loops, n, &device, &real, opts),
            Err(errno) => errno,
        };
        // The kernel has been seen to answer EBUSY yet attach the file: look
        // before trying another device, or the file ends up attached twice.
        if let Some(d) = read_loop(n).filter(|d| d.backing_file == real) {
            tracing::warn!(device = %d.device.display(), backing = %real.display(), errno = errno as i32, "attach reported an error but the file is attached");
            return finish_attach(loops, n, &device, &real, opts);
        }
        let err = SysError::syscall(
            format!("attach {} to {}", real.display(), device.display()),
            &device,
            errno as i32,
        );
        if errno != Errno::EBUSY {
            return Err(err);
        }
        // Another process took this device between GET_FREE and our configure:
        // take the next free one.
        tracing::debug!(device = %device.display(), attempt, "loop device busy, retrying");
        last_err = Some(err);
    }
    Err(last_err.unwrap_or_else(|| SysError::Busy {
        what: format!("no free loop device for {}", real.display()),
    }))
}

/// The state of the device just attached, with direct I/O and read-only applied
/// where the attach itself could not.
fn finish_attach(
    loops: &dyn Loops,
    n: u32,
    device: &Path,
    real: &Path,
    opts: LoopOptions,
) -> Result<LoopDevice> {
    let mut state = read_loop(n).ok_or_else(|| SysError::NotFound {
        what: format!(
            "{} vanished right after attaching {}",
            device.display(),
            real.display()
        ),
    })?;
    if opts.direct_io && !state.direct_io {
        // LOOP_SET_FD kernels (and some backing filesystems) need this step;
        // when it fails the device stays usable with buffered I/O.
        match loops.set_direct_io(device, true) {
            Ok(()) => state.direct_io = true,
            Err(e) => {
                tracing::warn!(device = %device.display(), error = %e, "direct I/O not available, using buffered I/O")
            }
        }
    }
    if opts.read_only && !state.read_only {
        block::set_read_only(device, true)?;
        state.read_only = true;
    }
    tracing::info!(device = %device.display(), backing = %real.display(), read_only = state.read_only, direct_io = state.direct_io, "attached loop device");
    Ok(state)
}
