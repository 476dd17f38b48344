//! The system layer: every syscall and every external command of the domain
//! lives here. The domain (`csi-storage`) reaches the kernel only through this
//! crate and keeps the decisions; what the binary does for itself (its socket,
//! signals, logging) and the mesh's network stay in their crates.
//!
//! Node-side operations whose outcome the domain must decide on (what is mounted,
//! which loop device serves a file) sit behind the traits [`Mounter`], [`Loops`] and
//! [`Filesystems`], with a Linux implementation ([`linux`]) and a stateful fake
//! ([`fake`]) for unit tests of decisions. File operations on the pools (reflinks
//! and sparse copies, crash-safe writes, filesystem figures: all reached through
//! [`file`]), directory entries ([`dir`]), tree walks ([`tree`]), btrfs
//! subvolumes ([`btrfs`]), cross-process locks ([`flock`]) and the hand-off
//! socket ([`socket`]) are plain functions and types, tested against real
//! filesystems; their file operations are recorded for the power-loss model
//! ([`fsrecord`]) in the tests that ask for it.
//!
//! Syscalls go through nix (and mount/umount2 through `sys-mount`, extended
//! attributes through `xattr`). What stays `unsafe` is the call of an ioctl that
//! nix's macros declare (the kernel reads or writes the argument through a pointer
//! the compiler cannot check; each call says why it is sound) and the one fcntl
//! nix has no wrapper for (F_SETLEASE). What stays of `libc` is C types and
//! constants: errno values, open flags, and FICLONE and MS_LAZYTIME, which nix
//! and `sys-mount` do not name.

pub mod btrfs;
pub mod cmd;
mod copy;
pub mod dir;
mod durable;
pub mod error;
pub mod expedite;
pub mod extents;
pub mod fake;
pub mod file;
pub mod flock;
pub mod fresh;
mod fsinfo;
pub mod fsrecord;
pub mod health;
pub mod image_io;
pub mod linux;
pub mod memory;
pub mod mountinfo;
pub mod socket;
mod superblock;
pub mod tree;
pub mod xattr;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use error::{Result, SysError};
pub use mountinfo::MountEntry;

/// The crash tests' hook, called by name at the points of this layer where a
/// kill must leave nothing behind; the storage layer sets it to its failpoints.
static FAILPOINT_HOOK: std::sync::OnceLock<fn(&str)> = std::sync::OnceLock::new();

/// Sets the hook [`failpoint`] calls; the first setting stays.
pub fn set_failpoint_hook(hook: fn(&str)) {
    let _ = FAILPOINT_HOOK.set(hook);
}

/// Reaches the named point: the hook decides (crash, pause or nothing).
pub(crate) fn failpoint(name: &str) {
    if let Some(hook) = FAILPOINT_HOOK.get() {
        hook(name);
    }
}

/// Options of a mount made by [`Mounter::mount`] or [`Mounter::bind`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountOptions {
    pub read_only: bool,
    /// Flags such as `noatime`, `nodev`, `nosuid`, `noexec`, `sync`, `dirsync`,
    /// `discard` (the data part) and any filesystem-specific `key=value`. The
    /// implementation splits them into MS_* flags and the data string.
    pub flags: Vec<String>,
}

pub trait Mounter: Send + Sync {
    /// The current mount table of this process's mount namespace.
    fn mounts(&self) -> Result<Vec<MountEntry>>;
    /// Mount a filesystem of type `fstype` from `source` (a block device) at `target`.
    fn mount(&self, source: &Path, target: &Path, fstype: &str, opts: &MountOptions) -> Result<()>;
    /// Bind-mount `source` (a directory, or a device node onto a file) at `target`;
    /// read-only binds are remounted read-only as the kernel requires.
    fn bind(&self, source: &Path, target: &Path, opts: &MountOptions) -> Result<()>;
    /// Unmount `target` (not lazily). Not mounted is an error of kind NotMounted.
    fn unmount(&self, target: &Path) -> Result<()>;
    /// Whether the path of mount `m` (an entry of [`Mounter::mounts`]) leads to it:
    /// not covered by a later mount at or above that path, not gone.
    fn reachable(&self, m: &MountEntry) -> bool;
}

/// One attached loop device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDevice {
    /// `/dev/loopN`
    pub device: PathBuf,
    /// The backing file as the kernel reports it (`/sys/block/loopN/loop/backing_file`).
    pub backing_file: PathBuf,
    pub read_only: bool,
    pub direct_io: bool,
    /// Size of the block device in bytes.
    pub size: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoopOptions {
    pub read_only: bool,
    pub direct_io: bool,
}

pub trait Loops: Send + Sync {
    /// Every attached loop device.
    fn list(&self) -> Result<Vec<LoopDevice>>;
    /// The loop devices attached to `backing` (canonical path comparison).
    fn find(&self, backing: &Path) -> Result<Vec<LoopDevice>> {
        let want = std::fs::canonicalize(backing).unwrap_or_else(|_| backing.to_path_buf());
        Ok(self
            .list()?
            .into_iter()
            .filter(|d| d.backing_file == want)
            .collect())
    }
    /// `device` when it is attached to `backing` (by the rule of [`Loops::find`]),
    /// else None. Reads only that device's state: a recorded device is checked
    /// in constant time, whatever the number of loop devices.
    fn serving(&self, device: &Path, backing: &Path) -> Result<Option<LoopDevice>> {
        Ok(self.find(backing)?.into_iter().find(|d| d.device == device))
    }
    /// False when no loop device serves `backing` read-write; true when one may.
    /// Where the implementation can tell without looking at every device (Linux:
    /// whether anything holds the file open for writing) it does; a device that
    /// serves the file read-only only is not seen.
    fn may_serve(&self, backing: &Path) -> Result<bool> {
        Ok(self.find(backing)?.iter().any(|d| !d.read_only))
    }
    /// Attach `backing` to a free loop device (created through /dev/loop-control when
    /// none is free) and return it. After a failed attach the implementation looks the
    /// file up before retrying, so an attach that the kernel did finish is not doubled.
    fn attach(&self, backing: &Path, opts: LoopOptions) -> Result<LoopDevice>;
    /// Makes sure `device`, found serving `backing`, goes on serving it until it
    /// is detached on purpose, before it is used again: a device a detach left
    /// marked to detach itself once released (see [`Loops::detach`]) loses the
    /// mark, or its number could serve another file by the time it is mounted.
    /// False when it no longer serves `backing` (then attach another).
    fn keep(&self, device: &Path, backing: &Path) -> Result<bool> {
        Ok(self.serving(device, backing)?.is_some())
    }
    fn detach(&self, device: &Path) -> Result<()>;
    /// Re-read the backing file's size (LOOP_SET_CAPACITY).
    fn refresh_capacity(&self, device: &Path) -> Result<()>;
    fn set_direct_io(&self, device: &Path, on: bool) -> Result<()>;
    /// Set the device's read-ahead in KiB (`/sys/block/loopN/queue/read_ahead_kb`).
    fn set_read_ahead_kib(&self, device: &Path, kib: u32) -> Result<()> {
        let attr = read_ahead_attr(device)?;
        std::fs::write(&attr, kib.to_string()).map_err(|source| SysError::Io {
            op: "write",
            path: attr,
            source,
        })
    }
    /// The device's read-ahead in KiB.
    fn read_ahead_kib(&self, device: &Path) -> Result<u32> {
        let attr = read_ahead_attr(device)?;
        let text = std::fs::read_to_string(&attr).map_err(|source| SysError::Io {
            op: "read",
            path: attr.clone(),
            source,
        })?;
        text.trim().parse().map_err(|_| SysError::InvalidArgument {
            what: format!("{} holds {:?}, not a number", attr.display(), text.trim()),
        })
    }
}

/// The sysfs file holding a block device's read-ahead.
fn read_ahead_attr(device: &Path) -> Result<PathBuf> {
    let name = device.file_name().ok_or_else(|| SysError::NotFound {
        what: format!("device {}", device.display()),
    })?;
    Ok(Path::new("/sys/block")
        .join(name)
        .join("queue/read_ahead_kb"))
}

/// statvfs figures, in bytes and inodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FsStats {
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub available_bytes: u64,
    pub total_inodes: u64,
    pub free_inodes: u64,
    pub read_only: bool,
}

pub trait Filesystems: Send + Sync {
    /// The filesystem type found on `device` by `blkid -p`, or None when it holds none.
    fn probe(&self, device: &Path) -> Result<Option<String>>;
    /// Make a filesystem of `fstype` (ext4, xfs, btrfs) on `device`.
    fn mkfs(&self, device: &Path, fstype: &str) -> Result<()>;
    /// Check (and where safe, repair) an unmounted filesystem: `e2fsck -p`,
    /// `xfs_repair -n`, `btrfs check --readonly`.
    fn check(&self, device: &Path, fstype: &str) -> Result<()>;
    /// Repair an unmounted ext4 whatever the damage (`e2fsck -f -y`): for the one
    /// an offline grow cut short leaves (its new groups half described), which
    /// `check` refuses to repair on its own. Other types: Unsupported.
    fn repair(&self, device: &Path, fstype: &str) -> Result<()>;
    /// Size in bytes of the filesystem on `device` (from its superblock).
    fn fs_size(&self, device: &Path, fstype: &str) -> Result<u64>;
    /// Grow the filesystem to fill its device. `mountpoint` is where it is mounted
    /// (xfs and btrfs grow only online; ext4 grows offline when it is None).
    fn grow(&self, device: &Path, mountpoint: Option<&Path>, fstype: &str) -> Result<()>;
    fn freeze(&self, mountpoint: &Path) -> Result<()>;
    fn thaw(&self, mountpoint: &Path) -> Result<()>;
    fn stats(&self, path: &Path) -> Result<FsStats>;
    /// Size in bytes of a block device (BLKGETSIZE64).
    fn device_size(&self, device: &Path) -> Result<u64>;
    /// Whether a live filesystem (or another exclusive user) holds `device`: one
    /// mounted here, or only in another mount namespace where no mount table of
    /// ours shows it. Such a filesystem is never checked or grown offline.
    fn held(&self, device: &Path) -> Result<bool> {
        let _ = device;
        Ok(false)
    }
}

/// The system layer as the domain sees it.
#[derive(Clone)]
pub struct System {
    pub mounter: Arc<dyn Mounter>,
    pub loops: Arc<dyn Loops>,
    pub fs: Arc<dyn Filesystems>,
    /// The machine's boot: unchanged while its page cache lives, so new on the
    /// first start after a power loss.
    pub boot_id: String,
}

impl System {
    pub fn linux() -> Self {
        System {
            mounter: Arc::new(linux::LinuxMounter),
            loops: Arc::new(linux::LinuxLoops::default()),
            fs: Arc::new(linux::LinuxFilesystems::default()),
            boot_id: boot_id(),
        }
    }
}

/// The kernel's id of this boot; when it cannot be read, one no earlier start
/// can have seen (so everything a power loss could have taken is looked at).
fn boot_id() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        Ok(id) if !id.trim().is_empty() => id.trim().to_string(),
        _ => unique_boot("unknown"),
    }
}

/// A boot id of its own: `prefix`, the process and the time.
pub(crate) fn unique_boot(prefix: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{}-{}-{seq}", std::process::id(), now.as_nanos())
}
