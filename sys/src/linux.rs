//! The Linux implementation of [`Mounter`], [`Loops`] and [`Filesystems`].
//!
//! Mounts use mount(2)/umount2(2) directly (no mount(8), no lazy unmount). Loop
//! devices are driven with the loop ioctls on /dev/loop-control and /dev/loopN,
//! creating missing device nodes since there may be no udev; their state is read
//! back from sysfs. Filesystems are made, checked and grown with the usual tools
//! (mkfs.*, e2fsck, xfs_repair, resize2fs, xfs_growfs, btrfs) through [`crate::cmd`],
//! and frozen with FIFREEZE/FITHAW.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::mount::{MntFlags, MsFlags};

use crate::cmd::{self, DEFAULT_TIMEOUT, SHORT_TIMEOUT};
use crate::error::{Result, SysError};
use crate::{
    Filesystems, FsStats, LoopDevice, LoopOptions, Loops, MountEntry, MountOptions, Mounter,
};

// ---------------------------------------------------------------------------
// Mounts

/// Mounts through mount(2) and umount2(2).
#[derive(Debug, Clone, Copy, Default)]
pub struct LinuxMounter;

/// Mount options split into MS_* flags and the filesystem's data string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitOptions {
    pub flags: MsFlags,
    /// Comma-separated filesystem options (`discard`, `nouuid`, `key=value`).
    pub data: String,
}

/// Split [`MountOptions`] into MS_* flags and the data string. Each entry of
/// `flags` may itself be a comma-separated list. `read_only` wins over an `rw`
/// flag. Flags that change what kind of mount this is (bind, remount, move,
/// propagation, loop) and flags containing a NUL byte are rejected.
pub fn split_options(opts: &MountOptions) -> Result<SplitOptions> {
    let mut flags = MsFlags::empty();
    let mut data: Vec<&str> = Vec::new();
    for raw in &opts.flags {
        if raw.contains('\0') {
            return Err(SysError::InvalidArgument {
                what: format!("mount flag {raw:?} contains a NUL byte"),
            });
        }
        for opt in raw.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            let (set, clear) = match opt {
                "defaults" => (MsFlags::empty(), MsFlags::empty()),
                "ro" => (MsFlags::MS_RDONLY, MsFlags::empty()),
                "rw" => (MsFlags::empty(), MsFlags::MS_RDONLY),
                "noatime" => (MsFlags::MS_NOATIME, MsFlags::MS_RELATIME | MsFlags::MS_STRICTATIME),
                "atime" => (MsFlags::empty(), MsFlags::MS_NOATIME),
                "relatime" => (MsFlags::MS_RELATIME, MsFlags::MS_NOATIME | MsFlags::MS_STRICTATIME),
                "norelatime" => (MsFlags::empty(), MsFlags::MS_RELATIME),
                "strictatime" => (MsFlags::MS_STRICTATIME, MsFlags::MS_NOATIME | MsFlags::MS_RELATIME),
                "nodiratime" => (MsFlags::MS_NODIRATIME, MsFlags::empty()),
                "diratime" => (MsFlags::empty(), MsFlags::MS_NODIRATIME),
                "nodev" => (MsFlags::MS_NODEV, MsFlags::empty()),
                "dev" => (MsFlags::empty(), MsFlags::MS_NODEV),
                "nosuid" => (MsFlags::MS_NOSUID, MsFlags::empty()),
                "suid" => (MsFlags::empty(), MsFlags::MS_NOSUID),
                "noexec" => (MsFlags::MS_NOEXEC, MsFlags::empty()),
                "exec" => (MsFlags::empty(), MsFlags::MS_NOEXEC),
                "sync" => (MsFlags::MS_SYNCHRONOUS, MsFlags::empty()),
                "async" => (MsFlags::empty(), MsFlags::MS_SYNCHRONOUS),
                "dirsync" => (MsFlags::MS_DIRSYNC, MsFlags::empty()),
                "lazytime" => (MsFlags::MS_LAZYTIME, MsFlags::empty()),
                "nolazytime" => (MsFlags::empty(), MsFlags::MS_LAZYTIME),
                "silent" => (MsFlags::MS_SILENT, MsFlags::empty()),
                "loud" => (MsFlags::empty(), MsFlags::MS_SILENT),
                "bind" | "rbind" | "remount" | "move" | "loop" | "shared" | "rshared" | "slave" | "rslave"
                | "private" | "rprivate" | "unbindable" | "runbindable" => {
                    return Err(SysError::InvalidArgument {
                        what: format!(
                            "mount flag {opt:?} is not allowed here (binds, remounts, propagation and loop devices have their own operations)"
                        ),
                    })
                }
                other => {
                    data.push(other);
                    continue;
                }
            };
            flags.remove(clear);
            flags.insert(set);
        }
    }
    if opts.read_only {
        flags.insert(MsFlags::MS_RDONLY);
    }
    Ok(SplitOptions {
        flags,
        data: data.join(","),
    })
}

/// The per-mount flags a bind must be remounted with to take effect (the kernel
/// ignores them on the first MS_BIND call).
const BIND_REMOUNT_FLAGS: MsFlags = MsFlags::MS_RDONLY
    .union(MsFlags::MS_NODEV)
    .union(MsFlags::MS_NOSUID)
    .union(MsFlags::MS_NOEXEC)
    .union(MsFlags::MS_NOATIME)
    .union(MsFlags::MS_NODIRATIME)
    .union(MsFlags::MS_RELATIME)
    .union(MsFlags::MS_STRICTATIME);

impl Mounter for LinuxMounter {
    fn mounts(&self) -> Result<Vec<MountEntry>> {
        crate::mountinfo::read()
    }

    fn mount(&self, source: &Path, target: &Path, fstype: &str, opts: &MountOptions) -> Result<()> {
        let split = split_options(opts)?;
        if fstype.is_empty() || fstype.contains('\0') {
            return Err(SysError::InvalidArgument {
                what: format!(
                    "filesystem type {fstype:?} for mounting {}",
                    source.display()
                ),
            });
        }
        let data = (!split.data.is_empty()).then_some(split.data.as_str());
        tracing::debug!(source = %source.display(), target = %target.display(), fstype, flags = ?split.flags, data = ?data, "mount");
        nix::mount::mount(Some(source), target, Some(fstype), split.flags, data).map_err(|e| {
            SysError::syscall(
                format!(
                    "mount {} ({fstype}{}{}) at {}",
                    source.display(),
                    if data.is_some() { ", " } else { "" },
                    data.unwrap_or(""),
                    target.display()
                ),
                target,
                e as i32,
            )
        })
    }

    fn bind(&self, source: &Path, target: &Path, opts: &MountOptions) -> Result<()> {
        let split = split_options(opts)?;
        if !split.data.is_empty() {
            // A bind shares the mounted filesystem; its options were set when it
            // was mounted. Ignoring them lets callers pass a volume's mount flags
            // to stage and publish alike.
            tracing::debug!(data = %split.data, target = %target.display(), "ignoring filesystem options on a bind mount");
        }
        nix::mount::mount(
            Some(source),
            target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| {
            SysError::syscall(
                format!("bind-mount {} at {}", source.display(), target.display()),
                target,
                e as i32,
            )
        })?;
        let extra = split.flags & BIND_REMOUNT_FLAGS;
        if extra.is_empty() {
            return Ok(());
        }
        let flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | extra;
        if let Err(e) = nix::mount::mount(None::<&str>, target, None::<&str>, flags, None::<&str>) {
            // Do not leave a writable bind behind when read-only was asked for.
            if let Err(undo) = nix::mount::umount2(target, MntFlags::empty()) {
                tracing::error!(target = %target.display(), error = %undo, "could not undo a bind mount whose remount failed");
            }
            return Err(SysError::syscall(
                format!(
                    "remount bind of {} at {} with {extra:?}",
                    source.display(),
                    target.display()
                ),
                target,
                e as i32,
            ));
        }
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<()> {
        match nix::mount::umount2(target, MntFlags::empty()) {
            Ok(()) => Ok(()),
            // EINVAL: not a mount point; ENOENT: does not even exist.
            Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {
                Err(SysError::NotMounted {
                    path: target.to_path_buf(),
                })
            }
            Err(e) => Err(SysError::syscall(
                format!("unmount {}", target.display()),
                target,
                e as i32,
            )),
        }
    }
}

// ---------------------------------------------------------------------------
// Loop devices

const LOOP_CONTROL: &str = "/dev/loop-control";
const LOOP_MAJOR: u32 = 7;
const LO_NAME_SIZE: usize = 64;

const LOOP_SET_FD: u64 = 0x4C00;
const LOOP_CLR_FD: u64 = 0x4C01;
const LOOP_SET_STATUS64: u64 = 0x4C04;
const LOOP_GET_STATUS64: u64 = 0x4C05;
const LOOP_SET_CAPACITY: u64 = 0x4C07;
const LOOP_SET_DIRECT_IO: u64 = 0x4C08;
const LOOP_CONFIGURE: u64 = 0x4C0A;
const LOOP_CTL_GET_FREE: u64 = 0x4C82;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// BLKROSET = _IO(0x12, 93), BLKGETSIZE64 = _IOR(0x12, 114, u64);
/// BLKRASET = _IO(0x12, 98) and BLKRAGET = _IO(0x12, 99), in 512-byte sectors.
const BLKROSET: u64 = 0x125D;
const BLKRASET: u64 = 0x1262;
const BLKRAGET: u64 = 0x1263;
const BLKGETSIZE64: u64 = 0x8008_1272;

/// How many free devices attach tries when another process grabs the one it got.
const ATTACH_ATTEMPTS: usize = 8;

/// struct loop_info64 of <linux/loop.h>.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
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
struct LoopConfig {
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

/// Serialises attaches of this process: two threads would otherwise get the same
/// free device from LOOP_CTL_GET_FREE and one would fail with EBUSY.
static ATTACH_LOCK: Mutex<()> = Mutex::new(());

/// Loop devices through the loop ioctls and sysfs. Devices are attached without
/// LO_FLAGS_AUTOCLEAR: they outlive this process (the node keeps volumes staged
/// across driver restarts).
#[derive(Debug, Default)]
pub struct LinuxLoops {
    // Built with `LinuxLoops::default()`, so settings can be added later without
    // touching callers.
    _private: (),
}

fn ioctl_errno<T>(fd: &File, request: u64, arg: T) -> std::result::Result<libc::c_int, i32> {
    // SAFETY: every caller passes a request whose argument is `arg`: an integer, or
    // a pointer to a properly laid-out struct that outlives the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg) };
    if r < 0 {
        Err(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO))
    } else {
        Ok(r)
    }
}

fn open_device(device: &Path, write: bool, exclusive: bool) -> Result<File> {
    let mut flags = libc::O_CLOEXEC;
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

fn loop_number(device: &Path) -> Option<u32> {
    device
        .file_name()?
        .to_str()?
        .strip_prefix("loop")?
        .parse()
        .ok()
}

fn sysfs_read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim_end_matches('\n').to_string())
}

/// The state of /dev/loopN from sysfs, None when nothing is attached.
/// The backing file of loop device `n`, or None when it is not attached.
fn read_backing(n: u32) -> Option<PathBuf> {
    let backing = sysfs_read(Path::new(&format!("/sys/block/loop{n}/loop/backing_file")))?;
    // A backing file removed while attached is reported with this suffix.
    Some(PathBuf::from(
        backing.strip_suffix(" (deleted)").unwrap_or(&backing),
    ))
}

/// The numbers of the loop devices the kernel has.
fn loop_numbers() -> Result<Vec<u32>> {
    let dir = std::fs::read_dir("/sys/block")
        .map_err(|e| SysError::io("read directory", "/sys/block", e))?;
    Ok(dir
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("loop")?
                .parse::<u32>()
                .ok()
        })
        .collect())
}

fn read_loop(n: u32) -> Option<LoopDevice> {
    let base = PathBuf::from(format!("/sys/block/loop{n}"));
    let backing = read_backing(n)?;
    let flag = |name: &str| {
        sysfs_read(&base.join(name))
            .map(|v| v.trim() == "1")
            .unwrap_or(false)
    };
    let sectors: u64 = sysfs_read(&base.join("size"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Some(LoopDevice {
        device: PathBuf::from(format!("/dev/loop{n}")),
        backing_file: backing,
        read_only: flag("ro"),
        direct_io: flag("loop/dio"),
        size: sectors.saturating_mul(512),
    })
}

/// The node /dev/loopN, created when missing (no udev here). The device number is
/// read from sysfs, since loop's minors depend on its max_part setting.
fn ensure_node(dev_dir: &Path, n: u32) -> Result<PathBuf> {
    let dev = dev_dir.join(format!("loop{n}"));
    match std::fs::metadata(&dev) {
        Ok(m) if m.file_type().is_block_device() => return Ok(dev),
        Ok(_) => {
            return Err(SysError::InvalidArgument {
                what: format!("{} exists and is not a block device", dev.display()),
            })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(SysError::io("stat", &dev, e)),
    }
    let (major, minor) = sysfs_read(Path::new(&format!("/sys/block/loop{n}/dev")))
        .and_then(|s| {
            let (a, b) = s.trim().split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((LOOP_MAJOR, n));
    let c = crate::file::cpath(&dev)?;
    // SAFETY: c is a valid path; mknod only creates a node.
    let r = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFBLK | 0o660,
            libc::makedev(major, minor),
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::AlreadyExists {
            return Err(SysError::io("create device node", &dev, e));
        }
    }
    Ok(dev)
}

fn get_free_loop() -> Result<u32> {
    let ctl = open_device(Path::new(LOOP_CONTROL), true, false)?;
    let n = ioctl_errno(&ctl, LOOP_CTL_GET_FREE, 0 as libc::c_ulong).map_err(|e| {
        SysError::syscall(
            format!("find a free loop device ({LOOP_CONTROL})"),
            LOOP_CONTROL,
            e,
        )
    })?;
    u32::try_from(n).map_err(|_| SysError::InvalidArgument {
        what: format!("{LOOP_CONTROL} returned device number {n}"),
    })
}

/// The loop_info64 for attaching `backing` with `opts`.
fn loop_info(backing: &Path, opts: LoopOptions) -> LoopInfo64 {
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
/// LOOP_SET_FD + LOOP_SET_STATUS64 on kernels without it. Returns the errno.
fn configure(
    dev: &File,
    file: &File,
    backing: &Path,
    opts: LoopOptions,
) -> std::result::Result<(), i32> {
    let info = loop_info(backing, opts);
    let fd = u32::try_from(file.as_raw_fd()).map_err(|_| libc::EBADF)?;
    let config = LoopConfig {
        fd,
        block_size: 0,
        info,
        reserved: [0; 8],
    };
    match ioctl_errno(dev, LOOP_CONFIGURE, &config as *const LoopConfig) {
        Ok(_) => Ok(()),
        // Kernels before 5.8 answer EINVAL (or ENOTTY) to an unknown loop ioctl.
        Err(libc::EINVAL) | Err(libc::ENOTTY) => configure_legacy(dev, file, info),
        Err(e) => Err(e),
    }
}

/// LOOP_SET_FD + LOOP_SET_STATUS64. Read-only follows from how `file` was opened;
/// direct I/O is turned on afterwards by the caller when asked.
fn configure_legacy(dev: &File, file: &File, mut info: LoopInfo64) -> std::result::Result<(), i32> {
    ioctl_errno(dev, LOOP_SET_FD, file.as_raw_fd() as libc::c_ulong)?;
    // SET_STATUS64 ignores flags other than autoclear/partscan.
    info.lo_flags &= !(LO_FLAGS_READ_ONLY | LO_FLAGS_DIRECT_IO);
    if let Err(e) = ioctl_errno(dev, LOOP_SET_STATUS64, &info as *const LoopInfo64) {
        let _ = ioctl_errno(dev, LOOP_CLR_FD, 0 as libc::c_ulong);
        return Err(e);
    }
    Ok(())
}

/// Whether a filesystem on the block device `device` is mounted in this mount
/// namespace (by its device number in /proc/self/mountinfo).
fn mounted_device(device: &Path) -> Result<bool> {
    let rdev = match std::fs::metadata(device) {
        Ok(m) => m.rdev(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(SysError::io("stat", device, e)),
    };
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    Ok(crate::mountinfo::read()?
        .iter()
        .any(|m| m.major == major && m.minor == minor))
}

/// (st_dev, st_ino) of the backing file of an attached loop device, from
/// LOOP_GET_STATUS64.
pub(crate) fn backing_identity(device: &Path) -> Option<(u64, u64)> {
    let f = open_device(device, false, false).ok()?;
    let mut info = LoopInfo64::zeroed();
    ioctl_errno(&f, LOOP_GET_STATUS64, &mut info as *mut LoopInfo64).ok()?;
    Some((info.lo_device, info.lo_inode))
}

/// The backing file a lookup wants: its canonical path and its identity.
struct Wanted {
    path: PathBuf,
    identity: Option<(u64, u64)>,
}

impl Wanted {
    fn new(backing: &Path) -> Wanted {
        let path = std::fs::canonicalize(backing).unwrap_or_else(|_| backing.to_path_buf());
        let identity = std::fs::metadata(&path).ok().map(|m| (m.dev(), m.ino()));
        Wanted { path, identity }
    }

    /// Whether loop device `n` shows a backing file by this path, or by another
    /// path with the same file name (see [`Loops::find`]); reads one sysfs file.
    fn candidate(&self, n: u32) -> bool {
        let name = self.path.file_name();
        read_backing(n).is_some_and(|b| {
            b == self.path || (self.identity.is_some() && name.is_some() && b.file_name() == name)
        })
    }

    /// Loop device `n` when the kernel's identity of its backing file is this
    /// file's, reported by the path wanted.
    fn confirm(&self, n: u32) -> Option<LoopDevice> {
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
fn open_for_writing_elsewhere(path: &Path) -> Option<bool> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    // SAFETY: fcntl on a descriptor this function owns; the lease is released
    // at once (and with the descriptor in any case).
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

impl LinuxLoops {
    /// Makes the block device read-only (BLKROSET), for a read-only attach.
    fn set_read_only(&self, device: &Path, read_only: bool) -> Result<()> {
        let dev = open_device(device, false, false)?;
        let value: libc::c_int = read_only.into();
        ioctl_errno(&dev, BLKROSET, &value as *const libc::c_int)
            .map(|_| ())
            .map_err(|e| {
                SysError::syscall(
                    format!("set read-only={read_only} on {}", device.display()),
                    device,
                    e,
                )
            })
    }

    fn attach_locked(&self, backing: &Path, opts: LoopOptions) -> Result<LoopDevice> {
        let real =
            std::fs::canonicalize(backing).map_err(|e| SysError::io("resolve", backing, e))?;
        let file = OpenOptions::new()
            .read(true)
            .write(!opts.read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(&real)
            .map_err(|e| SysError::io("open backing file", &real, e))?;
        if !file
            .metadata()
            .map_err(|e| SysError::io("stat", &real, e))?
            .is_file()
        {
            return Err(SysError::InvalidArgument {
                what: format!("loop backing {} is not a regular file", real.display()),
            });
        }
        let mut last_err = None;
        for attempt in 0..ATTACH_ATTEMPTS {
            let n = get_free_loop()?;
            let device = ensure_node(Path::new("/dev"), n)?;
            let dev = open_device(&device, true, false)?;
            match configure(&dev, &file, &real, opts) {
                Ok(()) => {
                    drop(dev);
                    return self.finish_attach(n, &device, &real, opts);
                }
                Err(errno) => {
                    drop(dev);
                    // The kernel has been seen to answer EBUSY yet attach the file:
                    // look before trying another device, or the file ends up
                    // attached twice.
                    if let Some(d) = read_loop(n).filter(|d| d.backing_file == real) {
                        tracing::warn!(device = %d.device.display(), backing = %real.display(), errno, "attach reported an error but the file is attached");
                        return self.finish_attach(n, &device, &real, opts);
                    }
                    if errno == libc::EBUSY {
                        // Another process took this device between GET_FREE and
                        // our configure: take the next free one.
                        tracing::debug!(device = %device.display(), attempt, "loop device busy, retrying");
                        last_err = Some(SysError::syscall(
                            format!("attach {} to {}", real.display(), device.display()),
                            &device,
                            errno,
                        ));
                        continue;
                    }
                    return Err(SysError::syscall(
                        format!("attach {} to {}", real.display(), device.display()),
                        &device,
                        errno,
                    ));
                }
            }
        }
        Err(last_err.unwrap_or_else(|| SysError::Busy {
            what: format!("no free loop device for {}", real.display()),
        }))
    }

    fn finish_attach(
        &self,
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
            match self.set_direct_io(device, true) {
                Ok(()) => state.direct_io = true,
                Err(e) => {
                    tracing::warn!(device = %device.display(), error = %e, "direct I/O not available, using buffered I/O")
                }
            }
        }
        if opts.read_only && !state.read_only {
            self.set_read_only(device, true)?;
            state.read_only = true;
        }
        tracing::info!(device = %device.display(), backing = %real.display(), read_only = state.read_only, direct_io = state.direct_io, "attached loop device");
        Ok(state)
    }
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

    fn attach(&self, backing: &Path, opts: LoopOptions) -> Result<LoopDevice> {
        // A poisoned lock only means another attach panicked; the guarded data is ().
        let _guard = ATTACH_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        self.attach_locked(backing, opts)
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
            Err(SysError::Busy { .. }) => {
                // Mounted here: it stays attached. Mounted only in another mount
                // namespace (a copy of the mount table a container runtime took a
                // moment before the unmount here) or held exclusively by another
                // process: the kernel is told to detach it once that goes, or it
                // would stay attached for good.
                let mounted_here = mounted_device(device)?;
                if !mounted_here {
                    if let Ok(f) = open_device(device, false, false) {
                        // Sets autoclear while the device has other users.
                        let _ = ioctl_errno(&f, LOOP_CLR_FD, 0 as libc::c_ulong);
                    }
                }
                return Err(SysError::Busy {
                    what: if mounted_here {
                        format!("{} is mounted; not detached", device.display())
                    } else {
                        format!(
                            "{} is held elsewhere (mounted in another mount namespace, or open exclusively); the kernel detaches it when it is released",
                            device.display()
                        )
                    },
                });
            }
            Err(e) => return Err(e),
        };
        match ioctl_errno(&dev, LOOP_CLR_FD, 0 as libc::c_ulong) {
            Ok(_) => {}
            Err(libc::ENXIO) => return Ok(()),
            Err(e) => {
                return Err(SysError::syscall(
                    format!("detach {}", device.display()),
                    device,
                    e,
                ))
            }
        }
        // The kernel tears the device down when its last opener (maybe us) closes it.
        drop(dev);
        let deadline = Instant::now() + Duration::from_secs(2);
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
        tracing::info!(device = %device.display(), "detached loop device");
        Ok(())
    }

    fn refresh_capacity(&self, device: &Path) -> Result<()> {
        let dev = open_device(device, false, false)?;
        ioctl_errno(&dev, LOOP_SET_CAPACITY, 0 as libc::c_ulong)
            .map(|_| ())
            .map_err(|e| {
                SysError::syscall(
                    format!("refresh capacity of {}", device.display()),
                    device,
                    e,
                )
            })
    }

    fn set_direct_io(&self, device: &Path, on: bool) -> Result<()> {
        let dev = open_device(device, false, false)?;
        ioctl_errno(&dev, LOOP_SET_DIRECT_IO, on as libc::c_ulong)
            .map(|_| ())
            .map_err(|e| {
                SysError::syscall(
                    format!(
                        "turn direct I/O {} on {}",
                        if on { "on" } else { "off" },
                        device.display()
                    ),
                    device,
                    e,
                )
            })
    }

    /// Through the device (BLKRASET), not sysfs: a container that is not in the
    /// host's network namespace gets /sys read-only, privileged or not.
    fn set_read_ahead_kib(&self, device: &Path, kib: u32) -> Result<()> {
        let dev = open_device(device, false, false)?;
        let sectors = libc::c_ulong::from(kib) * 2;
        ioctl_errno(&dev, BLKRASET, sectors)
            .map(|_| ())
            .map_err(|e| {
                SysError::syscall(
                    format!("set the read-ahead of {} to {kib} KiB", device.display()),
                    device,
                    e,
                )
            })
    }

    fn read_ahead_kib(&self, device: &Path) -> Result<u32> {
        let dev = open_device(device, false, false)?;
        let mut sectors: libc::c_long = 0;
        ioctl_errno(&dev, BLKRAGET, &mut sectors as *mut libc::c_long).map_err(|e| {
            SysError::syscall(
                format!("read the read-ahead of {}", device.display()),
                device,
                e,
            )
        })?;
        u32::try_from(sectors / 2).map_err(|_| SysError::InvalidArgument {
            what: format!(
                "{} reports a read-ahead of {sectors} sectors",
                device.display()
            ),
        })
    }
}

// ---------------------------------------------------------------------------
// Filesystems

/// FIFREEZE = _IOWR('X', 119, int), FITHAW = _IOWR('X', 120, int).
const FIFREEZE: u64 = 0xC004_5877;
const FITHAW: u64 = 0xC004_5878;

/// Filesystems through the usual tools. `timeout` bounds each long command
/// (mkfs, fsck, resize); None means [`cmd::DEFAULT_TIMEOUT`].
#[derive(Debug, Default)]
pub struct LinuxFilesystems {
    pub timeout: Option<Duration>,
}

fn supported(fstype: &str) -> Result<()> {
    match fstype {
        "ext4" | "xfs" | "btrfs" => Ok(()),
        other => Err(SysError::Unsupported {
            what: format!("filesystem type {other:?} (supported: ext4, xfs, btrfs)"),
        }),
    }
}

impl LinuxFilesystems {
    pub fn with_timeout(timeout: Duration) -> Self {
        LinuxFilesystems {
            timeout: Some(timeout),
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout.unwrap_or(DEFAULT_TIMEOUT)
    }

    fn run(&self, program: &str, args: &[&OsStr]) -> Result<std::process::Output> {
        cmd::run(program, args, self.timeout())
    }

    /// `e2fsck -f -p`: exit 0 (clean), 1 (errors fixed) and 2 (fixed, reboot
    /// advised, irrelevant for an unmounted volume) are success.
    fn e2fsck(&self, device: &Path) -> Result<()> {
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
}

impl LinuxFilesystems {
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

/// One tag of `blkid -p`; exit code 2 means nothing was found.
fn blkid_value(device: &Path, tag: &str) -> Result<Option<String>> {
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

/// The number after `key` on the first line that starts with it (`key: 123`,
/// `key = 123`, `key\t\t123`).
fn field_u64(text: &str, key: &str) -> Option<u64> {
    const SEPARATORS: [char; 4] = [' ', '\t', ':', '='];
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?;
        // The key must end here ("total_bytes" is not "total_bytes_used").
        if !rest.starts_with(SEPARATORS) {
            return None;
        }
        rest.trim_start_matches(SEPARATORS)
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Data size from `xfs_info`: the line `data = bsize=4096 blocks=81920, ...`.
fn xfs_info_data_size(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.trim_start().starts_with("data"))?;
    let value = |key: &str| -> Option<u64> {
        line.split_whitespace()
            .find_map(|t| t.strip_prefix(key))?
            .trim_end_matches(',')
            .parse()
            .ok()
    };
    Some(value("bsize=")?.saturating_mul(value("blocks=")?))
}

/// Sum of the device sizes in `btrfs filesystem show --raw`
/// (`devid 1 size 402653184 used 75497472 path /dev/loop0`).
fn btrfs_show_size(text: &str) -> Option<u64> {
    let sizes: Vec<u64> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("devid"))
        .filter_map(|l| {
            let mut it = l.split_whitespace().skip_while(|t| *t != "size");
            it.next()?;
            it.next()?.parse().ok()
        })
        .collect();
    (!sizes.is_empty()).then(|| sizes.iter().sum())
}

/// Where the filesystem on `device` is mounted, if it is (matched by source, which
/// also works for btrfs's anonymous device numbers).
fn mount_point_of(device: &Path) -> Result<Option<PathBuf>> {
    let real = std::fs::canonicalize(device).unwrap_or_else(|_| device.to_path_buf());
    let table = crate::mountinfo::read()?;
    Ok(table
        .iter()
        .find(|e| e.root == Path::new("/") && Path::new(&e.source) == real)
        .or_else(|| table.iter().find(|e| Path::new(&e.source) == real))
        .map(|e| e.mount_point.clone()))
}

impl Filesystems for LinuxFilesystems {
    fn probe(&self, device: &Path) -> Result<Option<String>> {
        blkid_value(device, "TYPE")
    }

    fn mkfs(&self, device: &Path, fstype: &str) -> Result<()> {
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

    /// ext4: `e2fsck -f -p` (fixes what is safe). xfs: `xfs_repair -n` (reports
    /// only), after replaying a dirty log by mounting once with nouuid. btrfs:
    /// `btrfs check --readonly`.
    fn check(&self, device: &Path, fstype: &str) -> Result<()> {
        supported(fstype)?;
        let dev = device.as_os_str();
        match fstype {
            "ext4" => self.e2fsck(device),
            "xfs" => {
                let args: [&OsStr; 2] = ["-n".as_ref(), dev];
                let mut replayed = false;
                loop {
                    let out = cmd::run_unchecked("xfs_repair", &args, self.timeout())?;
                    if out.status.success() {
                        return Ok(());
                    }
                    // With -n a dirty log is ignored and the check reports
                    // spurious damage; replaying the log (mounting once) first
                    // gives a real answer.
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    if !replayed && stderr.contains("valuable metadata changes in a log") {
                        self.replay_xfs_log(device)?;
                        replayed = true;
                        continue;
                    }
                    return Err(cmd::command_error("xfs_repair", &args, &out));
                }
            }
            _ => self
                .run("btrfs", &["check".as_ref(), "--readonly".as_ref(), dev])
                .map(|_| ()),
        }
    }

    /// From the superblock on the device; for a mounted xfs or btrfs from the
    /// mounted filesystem itself (their superblock writes bypass the device's page
    /// cache, so reading the device while mounted can show an old size).
    fn fs_size(&self, device: &Path, fstype: &str) -> Result<u64> {
        supported(fstype)?;
        let dev = device.as_os_str();
        let mounted = mount_point_of(device)?;
        let (program, args, size) = match (fstype, &mounted) {
            ("ext4", _) => {
                let args = vec!["-h".as_ref(), dev];
                let text = cmd::stdout_text(&cmd::run("dumpe2fs", &args, SHORT_TIMEOUT)?);
                let size = field_u64(&text, "Block count")
                    .zip(field_u64(&text, "Block size"))
                    .map(|(count, bs)| count.saturating_mul(bs));
                ("dumpe2fs", args, (size, text))
            }
            ("xfs", Some(mnt)) => {
                let args = vec![mnt.as_os_str()];
                let text = cmd::stdout_text(&cmd::run("xfs_info", &args, SHORT_TIMEOUT)?);
                ("xfs_info", args, (xfs_info_data_size(&text), text))
            }
            ("xfs", None) => {
                let args = vec![
                    "-r".as_ref(),
                    "-c".as_ref(),
                    "sb 0".as_ref(),
                    "-c".as_ref(),
                    "p dblocks blocksize".as_ref(),
                    dev,
                ];
                let text = cmd::stdout_text(&cmd::run("xfs_db", &args, SHORT_TIMEOUT)?);
                let size = field_u64(&text, "dblocks")
                    .zip(field_u64(&text, "blocksize"))
                    .map(|(count, bs)| count.saturating_mul(bs));
                ("xfs_db", args, (size, text))
            }
            (_, Some(mnt)) => {
                let args = vec![
                    "filesystem".as_ref(),
                    "show".as_ref(),
                    "--raw".as_ref(),
                    mnt.as_os_str(),
                ];
                let text = cmd::stdout_text(&cmd::run("btrfs", &args, SHORT_TIMEOUT)?);
                ("btrfs", args, (btrfs_show_size(&text), text))
            }
            (_, None) => {
                let args = vec!["inspect-internal".as_ref(), "dump-super".as_ref(), dev];
                let text = cmd::stdout_text(&cmd::run("btrfs", &args, SHORT_TIMEOUT)?);
                ("btrfs", args, (field_u64(&text, "total_bytes"), text))
            }
        };
        let (size, text) = size;
        size.ok_or_else(|| SysError::NotFound {
            what: format!(
                "filesystem size in the output of `{}`: {}",
                cmd::display(program, &args),
                text.trim()
            ),
        })
    }

    /// ext4 grows offline (`e2fsck -f -p`, then `resize2fs`) or online; online
    /// needs CAP_SYS_RESOURCE and answers PermissionDenied without it. xfs and
    /// btrfs grow online only: without a mountpoint they answer Unsupported.
    fn grow(&self, device: &Path, mountpoint: Option<&Path>, fstype: &str) -> Result<()> {
        supported(fstype)?;
        tracing::info!(device = %device.display(), mountpoint = ?mountpoint, fstype, "growing filesystem");
        match (fstype, mountpoint) {
            ("ext4", None) => {
                self.e2fsck(device)?;
                self.run("resize2fs", &[device.as_os_str()]).map(|_| ())
            }
            ("ext4", Some(_)) => match self.run("resize2fs", &[device.as_os_str()]) {
                Err(SysError::Command { stderr, .. })
                    if stderr.contains("Operation not permitted")
                        || stderr.contains("Permission denied") =>
                {
                    tracing::debug!(%stderr, "resize2fs refused the online grow");
                    Err(SysError::PermissionDenied {
                        op: "online grow of ext4 with resize2fs (it needs CAP_SYS_RESOURCE; grow it while unmounted instead) on"
                            .to_string(),
                        path: device.to_path_buf(),
                    })
                }
                other => other.map(|_| ()),
            },
            ("xfs", Some(mnt)) => self
                .run("xfs_growfs", &["-d".as_ref(), mnt.as_os_str()])
                .map(|_| ()),
            ("btrfs", Some(mnt)) => self
                .run(
                    "btrfs",
                    &[
                        "filesystem".as_ref(),
                        "resize".as_ref(),
                        "max".as_ref(),
                        mnt.as_os_str(),
                    ],
                )
                .map(|_| ()),
            (_, _) => Err(SysError::Unsupported {
                what: format!(
                    "offline grow of {fstype} on {} (it grows only while mounted)",
                    device.display()
                ),
            }),
        }
    }

    fn freeze(&self, mountpoint: &Path) -> Result<()> {
        let f = open_mountpoint(mountpoint)?;
        match ioctl_errno(&f, FIFREEZE, 0 as libc::c_ulong) {
            Ok(_) | Err(libc::EBUSY) => Ok(()),
            Err(libc::EOPNOTSUPP) => Err(SysError::Unsupported {
                what: format!("freezing the filesystem at {}", mountpoint.display()),
            }),
            Err(e) => Err(SysError::syscall(
                format!("freeze {}", mountpoint.display()),
                mountpoint,
                e,
            )),
        }
    }

    /// FITHAW; not frozen is Ok.
    fn thaw(&self, mountpoint: &Path) -> Result<()> {
        let f = open_mountpoint(mountpoint)?;
        match ioctl_errno(&f, FITHAW, 0 as libc::c_ulong) {
            Ok(_) | Err(libc::EINVAL) => Ok(()),
            Err(e) => Err(SysError::syscall(
                format!("thaw {}", mountpoint.display()),
                mountpoint,
                e,
            )),
        }
    }

    fn stats(&self, path: &Path) -> Result<FsStats> {
        crate::file::statvfs(path)
    }

    /// BLKGETSIZE64 of a block device; for a regular file (an image) its length.
    fn device_size(&self, device: &Path) -> Result<u64> {
        let f = open_device(device, false, false)?;
        let m = f.metadata().map_err(|e| SysError::io("stat", device, e))?;
        if m.is_file() {
            return Ok(m.len());
        }
        let mut size: u64 = 0;
        ioctl_errno(&f, BLKGETSIZE64, &mut size as *mut u64).map_err(|e| {
            SysError::syscall(format!("get size of {}", device.display()), device, e)
        })?;
        Ok(size)
    }
}

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
        .custom_flags(libc::O_CLOEXEC | libc::O_DIRECTORY)
        .open(&real)
        .map_err(|e| SysError::io("open", mountpoint, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(read_only: bool, flags: &[&str]) -> MountOptions {
        MountOptions {
            read_only,
            flags: flags.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn splits_flags_and_data() {
        let s = split_options(&opts(
            false,
            &["noatime", "nodev,nosuid", "discard", "nouuid", "commit=30"],
        ))
        .unwrap();
        assert_eq!(
            s.flags,
            MsFlags::MS_NOATIME | MsFlags::MS_NODEV | MsFlags::MS_NOSUID
        );
        assert_eq!(s.data, "discard,nouuid,commit=30");

        let s = split_options(&opts(true, &["rw", "defaults", ""])).unwrap();
        assert_eq!(s.flags, MsFlags::MS_RDONLY);
        assert_eq!(s.data, "");

        let s = split_options(&opts(false, &["ro", "rw", "relatime", "noatime"])).unwrap();
        assert_eq!(s.flags, MsFlags::MS_NOATIME);
    }

    #[test]
    fn rejects_nul_and_mount_kind_flags() {
        assert!(split_options(&opts(false, &["a\0b"]))
            .unwrap_err()
            .is_invalid_argument());
        assert!(split_options(&opts(false, &["bind"]))
            .unwrap_err()
            .is_invalid_argument());
        assert!(split_options(&opts(false, &["noatime,remount"]))
            .unwrap_err()
            .is_invalid_argument());
    }

    #[test]
    fn parses_tool_fields() {
        let dumpe2fs = "Filesystem volume name:   <none>\nBlock count:              131072\nBlock size:               4096\n";
        assert_eq!(field_u64(dumpe2fs, "Block count"), Some(131072));
        assert_eq!(field_u64(dumpe2fs, "Block size"), Some(4096));
        let xfs = "dblocks = 131072\nblocksize = 4096\n";
        assert_eq!(field_u64(xfs, "dblocks"), Some(131072));
        assert_eq!(field_u64(xfs, "blocksize"), Some(4096));
        let btrfs = "bytes_used\t\t147456\ntotal_bytes\t\t536870912\ndev_item.total_bytes\t1\n";
        assert_eq!(field_u64(btrfs, "total_bytes"), Some(536870912));
        assert_eq!(field_u64("total_bytes_used 5\n", "total_bytes"), None);
        assert_eq!(field_u64("", "dblocks"), None);

        let xfs_info = "meta-data=/dev/loop0             isize=512    agcount=4, agsize=20480 blks\n         =                       sectsz=512   attr=2, projid32bit=1\ndata     =                       bsize=4096   blocks=81920, imaxpct=25\n         =                       sunit=0      swidth=0 blks\n";
        assert_eq!(xfs_info_data_size(xfs_info), Some(81920 * 4096));
        assert_eq!(xfs_info_data_size("nothing"), None);
        let show = "Label: none  uuid: 0b1\n\tTotal devices 2 FS bytes used 144.00KiB\n\tdevid    1 size 402653184 used 75497472 path /dev/loop0\n\tdevid    2 size 100 used 0 path /dev/loop1\n";
        assert_eq!(btrfs_show_size(show), Some(402653184 + 100));
        assert_eq!(btrfs_show_size("Label: none"), None);
    }

    #[test]
    fn struct_layouts_match_the_kernel() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
        assert_eq!(loop_number(Path::new("/dev/loop12")), Some(12));
        assert_eq!(loop_number(Path::new("/dev/sda")), None);
    }

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
        let n = get_free_loop().unwrap();
        let dev = ensure_node(tmp.path(), n).unwrap();
        let m = std::fs::metadata(&dev).unwrap();
        assert!(m.file_type().is_block_device());
        let want = sysfs_read(Path::new(&format!("/sys/block/loop{n}/dev"))).unwrap();
        let rdev = m.rdev();
        assert_eq!(
            format!("{}:{}", libc::major(rdev), libc::minor(rdev)),
            want.trim()
        );
        // Existing node: returned as is.
        assert_eq!(ensure_node(tmp.path(), n).unwrap(), dev);
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
        let _guard = ATTACH_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let n = get_free_loop().unwrap();
        let device = ensure_node(Path::new("/dev"), n).unwrap();
        let dev = open_device(&device, true, false).unwrap();
        let opts = LoopOptions::default();
        configure_legacy(&dev, &file, loop_info(&real, opts)).unwrap();
        drop(dev);
        let loops = LinuxLoops::default();
        let res = std::panic::catch_unwind(|| {
            let state = read_loop(n).expect("attached");
            assert_eq!(state.backing_file, real);
            assert_eq!(state.size, 8 << 20);
            assert_eq!(
                sysfs_read(Path::new(&format!("/sys/block/loop{n}/loop/autoclear"))).as_deref(),
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

    #[test]
    fn unknown_fstype_is_unsupported() {
        let fs = LinuxFilesystems::default();
        assert!(fs
            .mkfs(Path::new("/dev/null"), "ntfs")
            .unwrap_err()
            .is_unsupported());
        assert!(fs
            .grow(Path::new("/dev/null"), None, "xfs")
            .unwrap_err()
            .is_unsupported());
    }
}
