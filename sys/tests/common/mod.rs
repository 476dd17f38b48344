//! Helpers of the real-kernel tests: the root check, and guards that undo what a
//! test set up (mounts, loop devices, frozen filesystems) even when it fails.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use csi_sys::linux::{LinuxFilesystems, LinuxLoops, LinuxMounter};
use csi_sys::{Filesystems, LoopDevice, LoopOptions, Loops, MountOptions, Mounter};

pub const MIB: u64 = 1 << 20;

/// The first line of every `root_*` test, which is marked
/// `#[ignore = "needs root: ..."]` and so runs only when asked for
/// (`cargo test -- --include-ignored`, as scripts/test-all.sh does); asked for
/// without root, it fails rather than pass without having checked anything.
/// Tests that mount take this shared; a test that makes a mount namespace takes
/// it alone: the new namespace copies every mount there is at that moment, and
/// would hold another test's device busy until it ends.
static NAMESPACE_COPIES: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Held by a test that mounts, while it may.
pub fn mounts_of_this_test() -> std::sync::RwLockReadGuard<'static, ()> {
    NAMESPACE_COPIES.read().unwrap_or_else(|p| p.into_inner())
}

/// Held by a test that makes a mount namespace, while it exists.
pub fn no_other_mounts() -> std::sync::RwLockWriteGuard<'static, ()> {
    NAMESPACE_COPIES.write().unwrap_or_else(|p| p.into_inner())
}

pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (loop devices, mkfs, mounts): run it as root"
    );
}

/// Run a command of the test setup (not of the code under test); panics with its
/// output when it fails.
pub fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .env("PATH", csi_sys::cmd::search_path())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A filesystem made on a sparse image in a temporary folder and mounted with
/// `mount -o loop` (whose loop device detaches itself at unmount). Used as a pool:
/// /tmp here is ext4, which cannot reflink.
pub struct LoopMountedPool {
    pub mountpoint: PathBuf,
    pub image: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoopMountedPool {
    pub fn new(fstype: &str, size: u64) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("pool.img");
        csi_sys::file::create_sparse(&image, size).expect("pool image");
        let img = image.to_str().expect("utf-8 path");
        match fstype {
            "xfs" => sh("mkfs.xfs", &["-f", "-q", "-K", "-m", "reflink=1", img]),
            "btrfs" => sh("mkfs.btrfs", &["-f", "-q", "-K", img]),
            "ext4" => sh("mkfs.ext4", &["-F", "-q", img]),
            other => panic!("no pool of type {other}"),
        };
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint).expect("mkdir");
        sh(
            "mount",
            &["-o", "loop", img, mountpoint.to_str().expect("utf-8")],
        );
        LoopMountedPool {
            mountpoint,
            image,
            _dir: dir,
        }
    }

    pub fn path(&self) -> &Path {
        &self.mountpoint
    }
}

impl Drop for LoopMountedPool {
    fn drop(&mut self) {
        unmount_retrying(&self.mountpoint);
    }
}

/// Unmount, retrying a little while the filesystem is busy (a guard dropped during
/// a panic may race with a closing file).
pub fn unmount_retrying(path: &Path) {
    for _ in 0..50 {
        match nix::mount::umount2(path, nix::mount::MntFlags::empty()) {
            Ok(()) => return,
            Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => return,
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    eprintln!("WARNING: could not unmount {}", path.display());
}

/// A loop device attached by the code under test, detached on drop.
pub struct Attached {
    pub dev: LoopDevice,
}

impl Attached {
    pub fn new(backing: &Path, opts: LoopOptions) -> Self {
        let dev = LinuxLoops::default().attach(backing, opts).expect("attach");
        Attached { dev }
    }

    pub fn path(&self) -> &Path {
        &self.dev.device
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        for _ in 0..50 {
            match LinuxLoops::default().detach(&self.dev.device) {
                Ok(()) => return,
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        eprintln!("WARNING: could not detach {}", self.dev.device.display());
    }
}

/// A mount made by the code under test, unmounted on drop.
pub struct Mounted {
    pub path: PathBuf,
}

impl Mounted {
    pub fn guard(path: &Path) -> Self {
        Mounted {
            path: path.to_path_buf(),
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        // Thaw first: unmounting a frozen filesystem would hang.
        let _ = LinuxFilesystems::default().thaw(&self.path);
        let mounted = csi_sys::mountinfo::read()
            .map(|t| t.iter().any(|e| e.mount_point == self.path))
            .unwrap_or(false);
        if mounted {
            match LinuxMounter.unmount(&self.path) {
                Ok(()) => {}
                Err(_) => unmount_retrying(&self.path),
            }
        }
    }
}

/// A sparse image of `size` bytes in `dir`.
pub fn image(dir: &Path, name: &str, size: u64) -> PathBuf {
    let p = dir.join(name);
    csi_sys::file::create_sparse(&p, size).expect("create image");
    p
}

/// A folder to mount on.
pub fn mountpoint(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::create_dir_all(&p).expect("mkdir");
    p
}

/// The start of a `root_*` test that mounts: the root check, this test's share
/// of the mounts (see `mounts_of_this_test`), and a temporary folder.
pub fn root_scratch() -> (std::sync::RwLockReadGuard<'static, ()>, tempfile::TempDir) {
    require_root();
    let mounts = mounts_of_this_test();
    (mounts, tempfile::tempdir().expect("tempdir"))
}

/// A sparse image of `size` bytes in `dir`, attached to a loop device and made a
/// filesystem of `fstype`, both by the code under test.
pub fn formatted(dir: &Path, name: &str, size: u64, fstype: &str) -> (PathBuf, Attached) {
    let img = image(dir, name, size);
    let a = Attached::new(&img, LoopOptions::default());
    LinuxFilesystems::default()
        .mkfs(a.path(), fstype)
        .expect("mkfs");
    (img, a)
}

/// `device`'s `fstype` mounted without options by the code under test at the
/// folder `name` in `dir`: the mount point, and its guard.
pub fn mounted(device: &Path, dir: &Path, name: &str, fstype: &str) -> (PathBuf, Mounted) {
    let mnt = mountpoint(dir, name);
    LinuxMounter
        .mount(device, &mnt, fstype, &MountOptions::default())
        .expect("mount");
    let guard = Mounted::guard(&mnt);
    (mnt, guard)
}
