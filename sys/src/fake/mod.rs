//! A stateful fake of [`Mounter`], [`Loops`] and [`Filesystems`] for unit tests of
//! the domain's decisions (does a second publish mount again? does unstage skip an
//! unmounted path? is a staged volume never formatted twice?).
//!
//! It keeps a mount table, loop devices and filesystems in memory and behaves like
//! Linux where the domain could tell the difference: mounts stack (but the same
//! filesystem is not mounted again on top of itself), unmounting what is not
//! mounted is NotMounted, a mounted device cannot be detached nor formatted, a
//! device without a filesystem cannot be mounted, a read-only device only
//! read-only, and a filesystem belongs to the backing file (it is found again after
//! a detach and re-attach to another device). It never touches the machine, except
//! that `attach` reads the backing file's length and `stats` of a path outside
//! every fake mount uses the real statvfs. The contract tests (sys/tests/contract.rs)
//! run the same sequences against the fake and against Linux to keep it so.
//!
//! Tests inspect the state through the [`FakeState`] returned by [`system`], and
//! can make the next call of an operation fail with [`FakeState::fail_next`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use sys_mount::MountFlags;

use crate::error::{Result, SysError};
use crate::linux::loops::loop_number;
use crate::linux::options::LAZYTIME;
use crate::{
    Filesystems, FsStats, LoopDevice, LoopOptions, Loops, MountEntry, MountOptions, Mounter, System,
};

/// A filesystem the fake made (or a test declared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeFs {
    pub fstype: String,
    /// Size in bytes, from the device at mkfs and at each grow.
    pub size: u64,
}

/// How often each operation was called (failed calls included).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeCounters {
    pub mount: u32,
    pub bind: u32,
    pub unmount: u32,
    pub attach: u32,
    pub detach: u32,
    pub refresh_capacity: u32,
    pub set_direct_io: u32,
    pub probe: u32,
    pub mkfs: u32,
    pub check: u32,
    pub grow: u32,
    pub freeze: u32,
    pub thaw: u32,
}

/// An operation of the fake, named for [`FakeState::fail_next`]: one per method
/// of the system traits that the fake implements itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FakeOp {
    Mounts,
    Mount,
    Bind,
    Unmount,
    List,
    Attach,
    Detach,
    RefreshCapacity,
    SetDirectIo,
    SetReadAheadKib,
    ReadAheadKib,
    Probe,
    Mkfs,
    Check,
    FsSize,
    Grow,
    Freeze,
    Thaw,
    Stats,
    DeviceSize,
}

type Failure = Box<dyn FnOnce() -> SysError + Send>;

#[derive(Default)]
struct Inner {
    mounts: Vec<MountEntry>,
    next_mount_id: u32,
    loops: BTreeMap<u32, LoopDevice>,
    /// Keyed by backing file (for loop devices) or device path.
    filesystems: BTreeMap<PathBuf, FakeFs>,
    frozen: Vec<PathBuf>,
    device_sizes: BTreeMap<PathBuf, u64>,
    read_ahead_kib: BTreeMap<PathBuf, u32>,
    counters: FakeCounters,
    failures: Vec<(FakeOp, Failure)>,
    require_targets: bool,
}

/// The shared state of the fake, for tests to inspect and steer.
#[derive(Default)]
pub struct FakeState {
    inner: Mutex<Inner>,
}

/// A fake [`System`] and its state.
pub fn system() -> (System, Arc<FakeState>) {
    let state = Arc::new(FakeState::default());
    let sys = System {
        mounter: Arc::new(FakeMounter(state.clone())),
        loops: Arc::new(FakeLoops(state.clone())),
        fs: Arc::new(FakeFilesystems(state.clone())),
        // Each fake system boots anew: a test of a start in the same boot says so.
        boot_id: crate::unique_boot("fake"),
    };
    (sys, state)
}

impl FakeState {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A test that panicked while holding the lock must not poison the others.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fake mount table, oldest first.
    pub fn mounts(&self) -> Vec<MountEntry> {
        self.lock().mounts.clone()
    }

    /// Whether something is mounted at `target`.
    pub fn is_mounted(&self, target: &Path) -> bool {
        self.lock().mounts.iter().any(|m| m.mount_point == target)
    }

    /// The attached fake loop devices.
    pub fn loops(&self) -> Vec<LoopDevice> {
        self.lock().loops.values().cloned().collect()
    }

    /// The filesystem on `path` (a fake loop device, a backing file or a device).
    pub fn filesystem(&self, path: &Path) -> Option<FakeFs> {
        let inner = self.lock();
        let key = inner.fs_key(path);
        inner.filesystems.get(&key).cloned()
    }

    /// Declare that `path` (a backing file or device) holds a filesystem, as if a
    /// previous run had made it.
    pub fn set_filesystem(&self, path: &Path, fstype: &str, size: u64) {
        let mut inner = self.lock();
        let key = inner.fs_key(path);
        inner.filesystems.insert(
            key,
            FakeFs {
                fstype: fstype.to_string(),
                size,
            },
        );
    }

    /// Declare the size of a device that is not a fake loop device.
    pub fn set_device_size(&self, device: &Path, size: u64) {
        self.lock().device_sizes.insert(device.to_path_buf(), size);
    }

    /// Whether the filesystem mounted at `mountpoint` is frozen.
    pub fn is_frozen(&self, mountpoint: &Path) -> bool {
        self.lock().frozen.iter().any(|p| p == mountpoint)
    }

    /// The read-ahead last set on `device` with `set_read_ahead_kib` since it was
    /// attached.
    pub fn read_ahead_kib(&self, device: &Path) -> Option<u32> {
        self.lock().read_ahead_kib.get(device).copied()
    }

    pub fn counters(&self) -> FakeCounters {
        self.lock().counters.clone()
    }

    /// Make the next call of `op` fail with the error `make` returns.
    pub fn fail_next(&self, op: FakeOp, make: impl FnOnce() -> SysError + Send + 'static) {
        self.lock().failures.push((op, Box::new(make)));
    }

    /// When on, mount and bind fail like Linux when the target does not exist on
    /// the real filesystem (off by default, so tests may use made-up paths).
    pub fn set_require_targets(&self, on: bool) {
        self.lock().require_targets = on;
    }
}

impl Inner {
    fn take_failure(&mut self, op: FakeOp) -> Result<()> {
        match self.failures.iter().position(|(o, _)| *o == op) {
            Some(i) => {
                let (_, make) = self.failures.remove(i);
                Err(make())
            }
            None => Ok(()),
        }
    }

    fn loop_at(&self, device: &Path) -> Option<&LoopDevice> {
        self.loops.values().find(|d| d.device == device)
    }

    fn fs_key(&self, path: &Path) -> PathBuf {
        if let Some(d) = self.loop_at(path) {
            return d.backing_file.clone();
        }
        std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
    }

    fn device_size(&self, device: &Path) -> Result<u64> {
        if let Some(d) = self.loop_at(device) {
            return Ok(d.size);
        }
        if let Some(size) = self.device_sizes.get(device) {
            return Ok(*size);
        }
        crate::file::file_len(device)
    }

    fn is_source_mounted(&self, device: &Path) -> bool {
        self.mounts.iter().any(|m| Path::new(&m.source) == device)
    }

    fn check_target(&self, target: &Path) -> Result<()> {
        if self.require_targets && !target.exists() {
            return Err(SysError::syscall(
                format!("mount at {}", target.display()),
                target,
                libc::ENOENT,
            ));
        }
        Ok(())
    }

    /// The checks mount(2) makes before mounting `source` at `target`, answered as
    /// Linux answers them; the device numbers of the new mount.
    fn admit_mount(
        &self,
        source: &Path,
        target: &Path,
        fstype: &str,
        flags: &MountFlags,
    ) -> Result<(u32, u32)> {
        self.check_target(target)?;
        let what = format!(
            "mount {} ({fstype}) at {}",
            source.display(),
            target.display()
        );
        let (major, minor) = match loop_number(source) {
            Some(n) if source.starts_with("/dev") => {
                if self.loop_at(source).is_none() {
                    return Err(SysError::syscall(what, target, libc::ENXIO));
                }
                (7, n)
            }
            _ => (0, 0),
        };
        let key = self.fs_key(source);
        match self.filesystems.get(&key) {
            Some(fs) if fs.fstype == fstype => {}
            // Linux answers EINVAL ("wrong fs type, bad superblock").
            _ => return Err(SysError::syscall(what, target, libc::EINVAL)),
        }
        // A writable mount needs a writable device.
        if !flags.contains(MountFlags::RDONLY) && self.loop_at(source).is_some_and(|d| d.read_only)
        {
            return Err(SysError::syscall(what, target, libc::EACCES));
        }
        // The same filesystem again on top of itself at the same place is refused.
        let top = self.mounts.iter().rev().find(|m| m.mount_point == target);
        if top.is_some_and(|m| self.fs_key(Path::new(&m.source)) == key) {
            return Err(SysError::syscall(what, target, libc::EBUSY));
        }
        Ok((major, minor))
    }

    fn push_mount(&mut self, mut entry: MountEntry) {
        self.next_mount_id += 1;
        entry.mount_id = 100 + self.next_mount_id;
        entry.parent_id = self
            .mounts
            .iter()
            .rev()
            .filter(|m| entry.mount_point.starts_with(&m.mount_point))
            .max_by_key(|m| m.mount_point.as_os_str().len())
            .map(|m| m.mount_id)
            .unwrap_or(1);
        self.mounts.push(entry);
    }
}

/// The per-mount options as /proc/self/mountinfo lists them.
fn options_list(read_only: bool, flags: &MountFlags) -> Vec<String> {
    let mut out = vec![if read_only { "ro" } else { "rw" }.to_string()];
    for (flag, name) in [
        (MountFlags::NOSUID, "nosuid"),
        (MountFlags::NODEV, "nodev"),
        (MountFlags::NOEXEC, "noexec"),
        (MountFlags::SYNCHRONOUS, "sync"),
        (MountFlags::DIRSYNC, "dirsync"),
        (MountFlags::NOATIME, "noatime"),
        (MountFlags::NODIRATIME, "nodiratime"),
        (MountFlags::STRICTATIME, "strictatime"),
        (LAZYTIME, "lazytime"),
    ] {
        if flags.contains(flag) {
            out.push(name.to_string());
        }
    }
    if !flags.intersects(MountFlags::NOATIME | MountFlags::STRICTATIME) {
        out.push("relatime".to_string());
    }
    out
}

/// The fake [`Mounter`].
pub struct FakeMounter(pub Arc<FakeState>);
/// The fake [`Loops`].
pub struct FakeLoops(pub Arc<FakeState>);
/// The fake [`Filesystems`].
pub struct FakeFilesystems(pub Arc<FakeState>);

impl Mounter for FakeMounter {
    fn mounts(&self) -> Result<Vec<MountEntry>> {
        let mut inner = self.0.lock();
        inner.take_failure(FakeOp::Mounts)?;
        Ok(inner.mounts.clone())
    }

    fn reachable(&self, m: &MountEntry) -> bool {
        let inner = self.0.lock();
        let Some(i) = inner.mounts.iter().position(|e| e.mount_id == m.mount_id) else {
            return false;
        };
        !inner.mounts[i + 1..]
            .iter()
            .any(|later| m.mount_point.starts_with(&later.mount_point))
    }

    fn mount(&self, source: &Path, target: &Path, fstype: &str, opts: &MountOptions) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.mount += 1;
        inner.take_failure(FakeOp::Mount)?;
        let split = crate::linux::split_options(opts)?;
        crate::linux::mount::valid_fstype(fstype, source)?;
        let (major, minor) = inner.admit_mount(source, target, fstype, &split.flags)?;
        let read_only = split.flags.contains(MountFlags::RDONLY);
        let entry = MountEntry {
            mount_id: 0,
            parent_id: 0,
            major,
            minor,
            root: PathBuf::from("/"),
            mount_point: target.to_path_buf(),
            options: options_list(read_only, &split.flags),
            optional_fields: Vec::new(),
            fs_type: fstype.to_string(),
            source: source.to_string_lossy().into_owned(),
            super_options: std::iter::once(if read_only { "ro" } else { "rw" }.to_string())
                .chain(
                    crate::linux::list_options(&split.data)
                        .unwrap_or_default()
                        .into_iter()
                        .map(str::to_string),
                )
                .collect(),
        };
        inner.push_mount(entry);
        Ok(())
    }

    fn bind(&self, source: &Path, target: &Path, opts: &MountOptions) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.bind += 1;
        inner.take_failure(FakeOp::Bind)?;
        let split = crate::linux::split_options(opts)?;
        inner.check_target(target)?;
        let read_only = split.flags.contains(MountFlags::RDONLY);
        // The visible mount holding `source` decides what the bind shows, as in
        // /proc/self/mountinfo: its filesystem and source, and the bound subtree
        // as root.
        let holder = inner
            .mounts
            .iter()
            .rev()
            .filter(|m| source.starts_with(&m.mount_point))
            .max_by_key(|m| m.mount_point.as_os_str().len())
            .cloned();
        let (fs_type, src, root, major, minor, super_options) = match holder {
            Some(h) => {
                let rel = source.strip_prefix(&h.mount_point).unwrap_or(Path::new(""));
                (
                    h.fs_type,
                    h.source,
                    h.root.join(rel),
                    h.major,
                    h.minor,
                    h.super_options,
                )
            }
            None if source.starts_with("/dev") => {
                let rel = source.strip_prefix("/dev").unwrap_or(source);
                (
                    "devtmpfs".to_string(),
                    "devtmpfs".to_string(),
                    Path::new("/").join(rel),
                    0,
                    5,
                    vec!["rw".to_string()],
                )
            }
            None => (
                "fake".to_string(),
                "fake".to_string(),
                source.to_path_buf(),
                0,
                0,
                vec!["rw".to_string()],
            ),
        };
        let entry = MountEntry {
            mount_id: 0,
            parent_id: 0,
            major,
            minor,
            root,
            mount_point: target.to_path_buf(),
            options: options_list(read_only, &split.flags),
            optional_fields: Vec::new(),
            fs_type,
            source: src,
            super_options,
        };
        inner.push_mount(entry);
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.unmount += 1;
        inner.take_failure(FakeOp::Unmount)?;
        let Some(i) = inner.mounts.iter().rposition(|m| m.mount_point == target) else {
            return Err(SysError::NotMounted {
                path: target.to_path_buf(),
            });
        };
        let id = inner.mounts[i].mount_id;
        if inner.mounts.iter().any(|m| m.parent_id == id) {
            return Err(SysError::Busy {
                what: format!("unmount {}: other mounts sit on it", target.display()),
            });
        }
        inner.mounts.remove(i);
        inner.frozen.retain(|p| p != target);
        Ok(())
    }
}

impl Loops for FakeLoops {
    fn list(&self) -> Result<Vec<LoopDevice>> {
        let mut inner = self.0.lock();
        inner.take_failure(FakeOp::List)?;
        Ok(inner.loops.values().cloned().collect())
    }

    fn attach(&self, backing: &Path, opts: LoopOptions) -> Result<LoopDevice> {
        let mut inner = self.0.lock();
        inner.counters.attach += 1;
        inner.take_failure(FakeOp::Attach)?;
        let real =
            std::fs::canonicalize(backing).map_err(|e| SysError::io("resolve", backing, e))?;
        let size = crate::file::file_len(&real)?;
        let n = (0..).find(|n| !inner.loops.contains_key(n)).unwrap_or(0);
        let dev = LoopDevice {
            device: PathBuf::from(format!("/dev/loop{n}")),
            backing_file: real,
            read_only: opts.read_only,
            direct_io: opts.direct_io,
            size,
        };
        inner.loops.insert(n, dev.clone());
        Ok(dev)
    }

    fn detach(&self, device: &Path) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.detach += 1;
        inner.take_failure(FakeOp::Detach)?;
        if loop_number(device).is_none() {
            return Err(SysError::InvalidArgument {
                what: format!("{} is not a loop device", device.display()),
            });
        }
        let Some(n) = inner.loop_at(device).and_then(|d| loop_number(&d.device)) else {
            return Ok(());
        };
        if inner.is_source_mounted(device) {
            return Err(SysError::Busy {
                what: format!(
                    "{} is mounted or held exclusively; not detached",
                    device.display()
                ),
            });
        }
        inner.loops.remove(&n);
        // A device attached again starts from the kernel's default.
        inner.read_ahead_kib.remove(device);
        Ok(())
    }

    fn refresh_capacity(&self, device: &Path) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.refresh_capacity += 1;
        inner.take_failure(FakeOp::RefreshCapacity)?;
        let n = attached(&inner, device)?;
        let size = inner
            .loops
            .get(&n)
            .map(|d| crate::file::file_len(&d.backing_file))
            .transpose()?;
        if let (Some(d), Some(size)) = (inner.loops.get_mut(&n), size) {
            d.size = size;
        }
        Ok(())
    }

    fn set_direct_io(&self, device: &Path, on: bool) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.set_direct_io += 1;
        inner.take_failure(FakeOp::SetDirectIo)?;
        let n = attached(&inner, device)?;
        if let Some(d) = inner.loops.get_mut(&n) {
            d.direct_io = on;
        }
        Ok(())
    }

    fn set_read_ahead_kib(&self, device: &Path, kib: u32) -> Result<()> {
        let mut inner = self.0.lock();
        inner.take_failure(FakeOp::SetReadAheadKib)?;
        attached(&inner, device)?;
        inner.read_ahead_kib.insert(device.to_path_buf(), kib);
        Ok(())
    }

    fn read_ahead_kib(&self, device: &Path) -> Result<u32> {
        let mut inner = self.0.lock();
        inner.take_failure(FakeOp::ReadAheadKib)?;
        attached(&inner, device)?;
        Ok(inner
            .read_ahead_kib
            .get(device)
            .copied()
            .unwrap_or(DEFAULT_READ_AHEAD_KIB))
    }
}

/// The read-ahead Linux gives a new loop device.
pub const DEFAULT_READ_AHEAD_KIB: u32 = 128;

fn attached(inner: &Inner, device: &Path) -> Result<u32> {
    inner
        .loop_at(device)
        .and_then(|d| loop_number(&d.device))
        .ok_or_else(|| {
            SysError::syscall(
                format!("loop ioctl on {}", device.display()),
                device,
                libc::ENXIO,
            )
        })
}

impl FakeFilesystems {
    fn existing(inner: &Inner, device: &Path, fstype: &str) -> Result<PathBuf> {
        let key = inner.fs_key(device);
        match inner.filesystems.get(&key) {
            Some(fs) if fs.fstype == fstype => Ok(key),
            _ => Err(SysError::Command {
                command: format!("fake {fstype} tool {}", device.display()),
                status: Some(1),
                stderr: format!("no {fstype} filesystem on {}", device.display()),
            }),
        }
    }
}

impl Filesystems for FakeFilesystems {
    fn probe(&self, device: &Path) -> Result<Option<String>> {
        let mut inner = self.0.lock();
        inner.counters.probe += 1;
        inner.take_failure(FakeOp::Probe)?;
        let key = inner.fs_key(device);
        Ok(inner.filesystems.get(&key).map(|f| f.fstype.clone()))
    }

    fn mkfs(&self, device: &Path, fstype: &str) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.mkfs += 1;
        inner.take_failure(FakeOp::Mkfs)?;
        crate::linux::fs::supported(fstype)?;
        if inner.is_source_mounted(device) {
            // As mkfs.* answer: they refuse a mounted device.
            return Err(SysError::Command {
                command: format!("fake mkfs.{fstype} {}", device.display()),
                status: Some(1),
                stderr: format!(
                    "{} is mounted; will not make a filesystem here",
                    device.display()
                ),
            });
        }
        let size = inner.device_size(device)?;
        let key = inner.fs_key(device);
        inner.filesystems.insert(
            key,
            FakeFs {
                fstype: fstype.to_string(),
                size,
            },
        );
        Ok(())
    }

    fn check(&self, device: &Path, fstype: &str) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.check += 1;
        inner.take_failure(FakeOp::Check)?;
        crate::linux::fs::supported(fstype)?;
        Self::existing(&inner, device, fstype).map(|_| ())
    }

    fn fs_size(&self, device: &Path, fstype: &str) -> Result<u64> {
        let mut inner = self.0.lock();
        inner.take_failure(FakeOp::FsSize)?;
        crate::linux::fs::supported(fstype)?;
        let key = Self::existing(&inner, device, fstype)?;
        Ok(inner.filesystems.get(&key).map(|f| f.size).unwrap_or(0))
    }

    fn repair(&self, device: &Path, fstype: &str) -> Result<()> {
        crate::linux::fs::repairable(device, fstype)?;
        Self::existing(&self.0.lock(), device, fstype).map(|_| ())
    }

    fn grow(&self, device: &Path, mountpoint: Option<&Path>, fstype: &str) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.grow += 1;
        inner.take_failure(FakeOp::Grow)?;
        crate::linux::fs::supported(fstype)?;
        if mountpoint.is_none() && fstype != "ext4" {
            return Err(SysError::Unsupported {
                what: format!("offline grow of {fstype} on {}", device.display()),
            });
        }
        let key = Self::existing(&inner, device, fstype)?;
        let size = inner.device_size(device)?;
        if let Some(fs) = inner.filesystems.get_mut(&key) {
            fs.size = fs.size.max(size);
        }
        Ok(())
    }

    fn freeze(&self, mountpoint: &Path) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.freeze += 1;
        inner.take_failure(FakeOp::Freeze)?;
        if !inner.mounts.iter().any(|m| m.mount_point == mountpoint) {
            return Err(SysError::NotMounted {
                path: mountpoint.to_path_buf(),
            });
        }
        if !inner.frozen.iter().any(|p| p == mountpoint) {
            inner.frozen.push(mountpoint.to_path_buf());
        }
        Ok(())
    }

    fn thaw(&self, mountpoint: &Path) -> Result<()> {
        let mut inner = self.0.lock();
        inner.counters.thaw += 1;
        inner.take_failure(FakeOp::Thaw)?;
        if !inner.mounts.iter().any(|m| m.mount_point == mountpoint) {
            return Err(SysError::NotMounted {
                path: mountpoint.to_path_buf(),
            });
        }
        inner.frozen.retain(|p| p != mountpoint);
        Ok(())
    }

    fn stats(&self, path: &Path) -> Result<FsStats> {
        let mut inner = self.0.lock();
        inner.take_failure(FakeOp::Stats)?;
        let holder = inner
            .mounts
            .iter()
            .rev()
            .filter(|m| path.starts_with(&m.mount_point))
            .max_by_key(|m| m.mount_point.as_os_str().len())
            .cloned();
        if let Some(m) = holder {
            let key = inner.fs_key(Path::new(&m.source));
            let size = inner.filesystems.get(&key).map(|f| f.size).unwrap_or(0);
            return Ok(FsStats {
                total_bytes: size,
                free_bytes: size,
                available_bytes: size,
                total_inodes: 65536,
                free_inodes: 65536,
                read_only: m.read_only(),
            });
        }
        drop(inner);
        crate::file::statvfs(path)
    }

    fn device_size(&self, device: &Path) -> Result<u64> {
        let mut inner = self.0.lock();
        inner.take_failure(FakeOp::DeviceSize)?;
        inner.device_size(device)
    }
}

#[cfg(test)]
mod tests;
