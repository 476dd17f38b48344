//! Loop devices through the loop ioctls ([`ctl`]) and sysfs ([`sysfs`]):
//! attaching ([`attach`]), finding who serves a file ([`find`]), detaching.

mod attach;
mod ctl;
mod find;
mod sysfs;

use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;

use self::find::{mounted_device, open_for_writing_elsewhere, Wanted};
use self::sysfs::{loop_numbers, read_loop};
use crate::error::{Result, SysError};
use crate::linux::block::{self, open_device};
use crate::{LoopDevice, LoopOptions, Loops};

pub(crate) use self::ctl::backing_identity;
pub(crate) use self::sysfs::loop_number;

/// Loop devices through the loop ioctls and sysfs. Devices are attached without
/// LO_FLAGS_AUTOCLEAR: they outlive this process (the node keeps volumes staged
/// across driver restarts).
#[derive(Debug, Default)]
pub struct LinuxLoops {
    // Built with `LinuxLoops::default()`, so settings can be added later without
    // touching callers.
    _private: (),
}

/// How long detach waits for the kernel to tear a device down.
const DETACH_WAIT: Duration = Duration::from_secs(2);

/// The Busy answer of a detach that O_EXCL refused. Mounted here: it stays
/// attached. Mounted only in another mount namespace (a copy of the mount table a
/// container runtime took a moment before the unmount here) or held exclusively
/// by another process: the kernel is told to detach it once that goes, or it
/// would stay attached for good.
fn detach_busy(device: &Path) -> Result<()> {
    let mounted_here = mounted_device(device)?;
    if !mounted_here {
        if let Ok(f) = open_device(device, false, false) {
            // Sets autoclear while the device has other users.
            let _ = ctl::clear_fd(&f);
        }
    }
    Err(SysError::Busy {
        what: if mounted_here {
            format!("{} is mounted; not detached", device.display())
        } else {
            format!(
                "{} is held elsewhere (mounted in another mount namespace, or open exclusively); the kernel detaches it when it is released",
                device.display()
            )
        },
    })
}

/// Wait until loop device `n` is gone; the kernel tears it down when its last
/// opener closes it.
fn wait_detached(device: &Path, n: u32) -> Result<()> {
    let deadline = Instant::now() + DETACH_WAIT;
    while read_loop(n).is_some() {
        if Instant::now() >= deadline {
            return Err(SysError::Busy {
                what: format!(
                    "{} is still open elsewhere; the kernel will detach it when it is closed",
                    device.display()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Run a loop ioctl on `device`, naming `what` in its error.
fn on_device(
    device: &Path,
    what: impl FnOnce() -> String,
    op: impl FnOnce(&std::fs::File) -> std::result::Result<(), Errno>,
) -> Result<()> {
    let dev = open_device(device, false, false)?;
    op(&dev).map_err(|e| SysError::syscall(what(), device, e as i32))
}

impl Loops for LinuxLoops {
    fn list(&self) -> Result<Vec<LoopDevice>> {
        let mut out: Vec<LoopDevice> = loop_numbers()?.into_iter().filter_map(read_loop).collect();
        out.sort_by_key(|d| loop_number(&d.device));
        Ok(out)
    }

    /// The devices attached to `backing`. The kernel reports a device's backing
    /// file by the path it has from the reader's root, which is not the path it
    /// was attached by when the attacher ran in another mount namespace (a node
    /// plugin's container that has since been replaced shows `/volumes/<id>.img`
    /// once the mount it was attached through is gone). So a device matches when
    /// its backing file is the same file (device and inode, as the kernel keeps
    /// them) under the same file name; when the file's identity cannot be read,
    /// only the same canonical path matches. A file deleted and re-created under
    /// the same name is not the attached one. A match reports `backing` as seen
    /// from here.
    fn find(&self, backing: &Path) -> Result<Vec<LoopDevice>> {
        let want = Wanted::new(backing);
        // Only the backing file of each device is read; the rest of a device's
        // attributes only for a candidate (a node may have hundreds of loop devices).
        let mut numbers: Vec<u32> = loop_numbers()?
            .into_iter()
            .filter(|n| want.candidate(*n))
            .collect();
        numbers.sort_unstable();
        Ok(numbers
            .into_iter()
            .filter_map(|n| want.confirm(n))
            .collect())
    }

    fn serving(&self, device: &Path, backing: &Path) -> Result<Option<LoopDevice>> {
        let want = Wanted::new(backing);
        Ok(loop_number(device)
            .filter(|n| device == Path::new(&format!("/dev/loop{n}")) && want.candidate(*n))
            .and_then(|n| want.confirm(n)))
    }

    /// A loop device that serves a file read-write holds it open for writing, and
    /// while anything does, the kernel refuses a read lease on the file: one
    /// `fcntl` answers for every device, attached by whoever, from any mount
    /// namespace. Where leases are not available, every device is looked at.
    fn may_serve(&self, backing: &Path) -> Result<bool> {
        match open_for_writing_elsewhere(backing) {
            Some(open) => Ok(open),
            None => Ok(self.find(backing)?.iter().any(|d| !d.read_only)),
        }
    }

    fn keep(&self, device: &Path, backing: &Path) -> Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let Ok(meta) = std::fs::metadata(backing) else {
            return Ok(false);
        };
        let dev = match open_device(device, false, false) {
            Ok(f) => f,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENXIO)) => {
                return Ok(false)
            }
            Err(e) => return Err(e),
        };
        ctl::keep_serving(&dev, (meta.dev(), meta.ino())).map_err(|e| {
            SysError::syscall(
                format!(
                    "keeping {} attached to {}",
                    device.display(),
                    backing.display()
                ),
                device,
                e as i32,
            )
        })
    }

    fn attach(&self, backing: &Path, opts: LoopOptions) -> Result<LoopDevice> {
        // A poisoned lock only means another attach panicked; the guarded data is ().
        let _guard = attach::ATTACH_LOCK
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        attach::attach_locked(self, backing, opts)
    }

    /// Detach `device`. Not attached (or no such node) is Ok. A device that is
    /// mounted is Busy and stays attached. A device that another process holds
    /// open is marked by the kernel to detach when that process closes it; that is
    /// reported as Busy too, and a retry succeeds once it is gone.
    fn detach(&self, device: &Path) -> Result<()> {
        let Some(n) = loop_number(device) else {
            return Err(SysError::InvalidArgument {
                what: format!("{} is not a loop device", device.display()),
            });
        };
        // O_EXCL fails with EBUSY while a filesystem on the device is mounted.
        let dev = match open_device(device, false, true) {
            Ok(f) => f,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(SysError::Busy { .. }) => return detach_busy(device),
            Err(e) => return Err(e),
        };
        match ctl::clear_fd(&dev) {
            Ok(()) => {}
            Err(Errno::ENXIO) => return Ok(()),
            Err(e) => {
                return Err(SysError::syscall(
                    format!("detach {}", device.display()),
                    device,
                    e as i32,
                ))
            }
        }
        drop(dev);
        wait_detached(device, n)?;
        tracing::info!(device = %device.display(), "detached loop device");
        Ok(())
    }

    fn refresh_capacity(&self, device: &Path) -> Result<()> {
        on_device(
            device,
            || format!("refresh capacity of {}", device.display()),
            ctl::set_capacity,
        )
    }

    fn set_direct_io(&self, device: &Path, on: bool) -> Result<()> {
        on_device(
            device,
            || {
                format!(
                    "turn direct I/O {} on {}",
                    if on { "on" } else { "off" },
                    device.display()
                )
            },
            |dev| ctl::set_direct_io(dev, on),
        )
    }

    fn set_read_ahead_kib(&self, device: &Path, kib: u32) -> Result<()> {
        block::set_read_ahead_kib(device, kib)
    }

    fn read_ahead_kib(&self, device: &Path) -> Result<u32> {
        block::read_ahead_kib(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    /// The root tests below are ignored unless asked for; asked for without root,
    /// they fail rather than pass without having checked anything.
    fn require_root() {
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
    }

    #[test]
    #[ignore = "needs root: loop devices"]
    fn root_ensure_node_creates_a_block_device_node() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let n = ctl::get_free_loop().unwrap();
        let dev = sysfs::ensure_node(tmp.path(), n).unwrap();
        let m = std::fs::metadata(&dev).unwrap();
        assert!(m.file_type().is_block_device());
        let want = sysfs::sysfs_read(Path::new(&format!("/sys/block/loop{n}/dev"))).unwrap();
        let rdev = m.rdev();
        assert_eq!(
            format!(
                "{}:{}",
                nix::sys::stat::major(rdev),
                nix::sys::stat::minor(rdev)
            ),
            want.trim()
        );
        // Existing node: returned as is.
        assert_eq!(sysfs::ensure_node(tmp.path(), n).unwrap(), dev);
    }

    /// The path for kernels without LOOP_CONFIGURE, exercised directly.
    #[test]
    #[ignore = "needs root: loop devices"]
    fn root_legacy_set_fd_and_status_attach() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let img = tmp.path().join("legacy.img");
        crate::file::create_sparse(&img, 8 << 20).unwrap();
        let real = std::fs::canonicalize(&img).unwrap();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&real)
            .unwrap();
        let _guard = attach::ATTACH_LOCK
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let n = ctl::get_free_loop().unwrap();
        let device = sysfs::ensure_node(Path::new("/dev"), n).unwrap();
        let dev = open_device(&device, true, false).unwrap();
        let opts = LoopOptions::default();
        ctl::configure_legacy(&dev, &file, ctl::loop_info(&real, opts)).unwrap();
        drop(dev);
        let loops = LinuxLoops::default();
        let res = std::panic::catch_unwind(|| {
            let state = read_loop(n).expect("attached");
            assert_eq!(state.backing_file, real);
            assert_eq!(state.size, 8 << 20);
            assert_eq!(
                sysfs::sysfs_read(Path::new(&format!("/sys/block/loop{n}/loop/autoclear")))
                    .as_deref(),
                Some("0")
            );
            let found = loops.find(&img).unwrap();
            assert_eq!(found.len(), 1);
            assert_eq!(backing_identity(&device), {
                let m = std::fs::metadata(&real).unwrap();
                Some((m.dev(), m.ino()))
            });
        });
        loops.detach(&device).unwrap();
        assert!(read_loop(n).is_none() || read_loop(n).unwrap().backing_file != real);
        if let Err(p) = res {
            std::panic::resume_unwind(p);
        }
    }
}
