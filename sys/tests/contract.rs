//! The contract of the system traits ([`Mounter`], [`Loops`], [`Filesystems`]),
//! written once and run twice: against the fake (`fake::*`, as any user) and
//! against Linux (`linux::*`, as root, on real loop devices, mkfs and mounts in a
//! temporary folder). The domain's decision tests trust the fake to answer as the
//! kernel does; a case that passes on one side and fails on the other is drift.
//!
//! Each case drives the traits through a sequence and asserts the answers and the
//! kinds of the errors, never the wording. It touches only what it made itself:
//! no device number it did not just get from attach, since other processes on the
//! machine attach and detach loop devices too.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::MIB;
use csi_sys::fake::FakeState;
use csi_sys::{
    file, Filesystems, LoopDevice, LoopOptions, Loops, MountEntry, MountOptions, Mounter, SysError,
    System,
};

/// One run of a case: the system under test and a temporary folder for its
/// images and mount points, cleaned up (thawed, unmounted, detached) on drop.
struct Env {
    sys: System,
    root: PathBuf,
    _fake: Option<Arc<FakeState>>,
    _dir: tempfile::TempDir,
}

impl Env {
    fn new(sys: System, fake: Option<Arc<FakeState>>) -> Env {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("canonical tempdir");
        Env {
            sys,
            root,
            _fake: fake,
            _dir: dir,
        }
    }

    fn fake() -> Env {
        let (sys, state) = csi_sys::fake::system();
        // Mount points are real folders here, so the fake may check them as Linux does.
        state.set_require_targets(true);
        Env::new(sys, Some(state))
    }

    fn linux() -> Env {
        common::require_root();
        Env::new(System::linux(), None)
    }

    fn mounter(&self) -> &dyn Mounter {
        &*self.sys.mounter
    }

    fn loops(&self) -> &dyn Loops {
        &*self.sys.loops
    }

    fn fs(&self) -> &dyn Filesystems {
        &*self.sys.fs
    }

    /// A sparse image of `size` bytes.
    fn image(&self, name: &str, size: u64) -> PathBuf {
        common::image(&self.root, name, size)
    }

    /// An empty folder to mount on.
    fn folder(&self, name: &str) -> PathBuf {
        common::mountpoint(&self.root, name)
    }

    /// A new image attached to a loop device.
    fn attached(&self, name: &str, size: u64) -> LoopDevice {
        let img = self.image(name, size);
        self.loops()
            .attach(&img, LoopOptions::default())
            .expect("attach")
    }

    /// A new image attached and holding a filesystem of `fstype`.
    fn formatted(&self, name: &str, fstype: &str, size: u64) -> LoopDevice {
        let dev = self.attached(name, size);
        self.fs().mkfs(&dev.device, fstype).expect("mkfs");
        dev
    }

    /// A new ext4 image, attached and mounted with `opts` at the new folder `name`.
    fn mounted(&self, name: &str, opts: &MountOptions) -> (LoopDevice, PathBuf) {
        let dev = self.formatted(&format!("{name}.img"), "ext4", 32 * MIB);
        let at = self.folder(name);
        self.mounter()
            .mount(&dev.device, &at, "ext4", opts)
            .expect("mount");
        (dev, at)
    }

    /// The mounts at `target`, oldest first.
    fn mounts_at(&self, target: &Path) -> Vec<MountEntry> {
        self.mounter()
            .mounts()
            .expect("mount table")
            .into_iter()
            .filter(|m| m.mount_point == target)
            .collect()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let mounts = self.mounter().mounts().unwrap_or_default();
        for m in mounts.iter().rev() {
            if m.mount_point.starts_with(&self.root) {
                // Unmounting a frozen filesystem would hang.
                let _ = self.fs().thaw(&m.mount_point);
                let _ = self.mounter().unmount(&m.mount_point);
            }
        }
        for d in self.loops().list().unwrap_or_default() {
            if d.backing_file.starts_with(&self.root) {
                let _ = self.loops().detach(&d.device);
            }
        }
    }
}

fn plain() -> MountOptions {
    MountOptions::default()
}

fn read_only() -> MountOptions {
    MountOptions {
        read_only: true,
        flags: Vec::new(),
    }
}

fn is_command_error(e: &SysError) -> bool {
    matches!(e, SysError::Command { .. })
}

// ---------------------------------------------------------------------------
// Loop devices

fn attach_find_serve_detach(env: &Env) {
    let img = env.image("vol.img", 32 * MIB);
    let d = env.loops().attach(&img, LoopOptions::default()).unwrap();
    assert_eq!(d.backing_file, std::fs::canonicalize(&img).unwrap());
    assert_eq!(d.size, 32 * MIB);
    assert!(!d.read_only && !d.direct_io, "{d:?}");
    assert_eq!(env.loops().find(&img).unwrap(), vec![d.clone()]);
    assert!(env.loops().list().unwrap().contains(&d));
    assert_eq!(
        env.loops().serving(&d.device, &img).unwrap(),
        Some(d.clone())
    );
    assert!(env.loops().may_serve(&img).unwrap());
    assert_eq!(env.fs().device_size(&d.device).unwrap(), 32 * MIB);

    env.loops().detach(&d.device).unwrap();
    assert!(env.loops().find(&img).unwrap().is_empty());
    assert_eq!(env.loops().serving(&d.device, &img).unwrap(), None);
    assert!(!env.loops().may_serve(&img).unwrap());
}

fn attach_of_a_missing_file_is_not_found(env: &Env) {
    let err = env
        .loops()
        .attach(&env.root.join("missing.img"), LoopOptions::default())
        .unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
    assert!(env
        .loops()
        .find(&env.root.join("missing.img"))
        .unwrap()
        .is_empty());
}

fn detach_of_no_loop_device(env: &Env) {
    // A loop device node that does not exist: nothing to detach.
    env.loops().detach(Path::new("/dev/loop999999")).unwrap();
    let err = env.loops().detach(Path::new("/dev/null")).unwrap_err();
    assert!(err.is_invalid_argument(), "{err:?}");
}

fn attach_read_only_with_direct_io(env: &Env) {
    let img = env.image("ro.img", 16 * MIB);
    let opts = LoopOptions {
        read_only: true,
        direct_io: true,
    };
    let d = env.loops().attach(&img, opts).unwrap();
    assert!(d.read_only && d.direct_io, "{d:?}");
    assert_eq!(env.loops().find(&img).unwrap(), vec![d.clone()]);
    env.loops().set_direct_io(&d.device, false).unwrap();
    assert!(!env.loops().find(&img).unwrap()[0].direct_io);
    env.loops().set_direct_io(&d.device, true).unwrap();
    assert!(env.loops().find(&img).unwrap()[0].direct_io);
}

fn refresh_capacity_sees_the_grown_file(env: &Env) {
    let img = env.image("grow.img", 16 * MIB);
    let d = env.loops().attach(&img, LoopOptions::default()).unwrap();
    file::grow(&img, 24 * MIB).unwrap();
    assert_eq!(env.fs().device_size(&d.device).unwrap(), 16 * MIB);
    env.loops().refresh_capacity(&d.device).unwrap();
    assert_eq!(env.fs().device_size(&d.device).unwrap(), 24 * MIB);
    assert_eq!(env.loops().find(&img).unwrap()[0].size, 24 * MIB);
}

fn read_ahead_reads_back(env: &Env) {
    let d = env.attached("ra.img", 16 * MIB);
    env.loops().set_read_ahead_kib(&d.device, 1024).unwrap();
    assert_eq!(env.loops().read_ahead_kib(&d.device).unwrap(), 1024);
    env.loops().set_read_ahead_kib(&d.device, 64).unwrap();
    assert_eq!(env.loops().read_ahead_kib(&d.device).unwrap(), 64);
}

fn device_size_of_a_regular_file_is_its_length(env: &Env) {
    let img = env.image("plain.img", 3 * MIB);
    assert_eq!(env.fs().device_size(&img).unwrap(), 3 * MIB);
}

// ---------------------------------------------------------------------------
// Filesystems

fn mkfs_probe_size_check(env: &Env) {
    let d = env.attached("fs.img", 32 * MIB);
    assert_eq!(env.fs().probe(&d.device).unwrap(), None);
    env.fs().mkfs(&d.device, "ext4").unwrap();
    assert_eq!(env.fs().probe(&d.device).unwrap().as_deref(), Some("ext4"));
    assert_eq!(env.fs().fs_size(&d.device, "ext4").unwrap(), 32 * MIB);
    env.fs().check(&d.device, "ext4").unwrap();
    // Another type's tool finds no filesystem of its kind.
    let err = env.fs().check(&d.device, "btrfs").unwrap_err();
    assert!(is_command_error(&err), "{err:?}");
}

fn unknown_filesystem_types_are_unsupported(env: &Env) {
    let d = env.attached("zfs.img", 16 * MIB);
    for err in [
        env.fs().mkfs(&d.device, "zfs").unwrap_err(),
        env.fs().check(&d.device, "zfs").unwrap_err(),
        env.fs().fs_size(&d.device, "zfs").unwrap_err(),
        env.fs().grow(&d.device, None, "zfs").unwrap_err(),
    ] {
        assert!(err.is_unsupported(), "{err:?}");
    }
    assert_eq!(env.fs().probe(&d.device).unwrap(), None);
}

fn the_filesystem_stays_with_the_file(env: &Env) {
    let d = env.formatted("keep.img", "ext4", 32 * MIB);
    env.loops().detach(&d.device).unwrap();
    let again = env
        .loops()
        .attach(&d.backing_file, LoopOptions::default())
        .unwrap();
    assert_eq!(
        env.fs().probe(&again.device).unwrap().as_deref(),
        Some("ext4")
    );
}

fn mkfs_of_a_mounted_device_fails(env: &Env) {
    let (d, m) = env.mounted("busy", &plain());
    let err = env.fs().mkfs(&d.device, "ext4").unwrap_err();
    assert!(is_command_error(&err), "{err:?}");
    assert_eq!(env.mounts_at(&m).len(), 1);
}

fn grow_xfs_online_only(env: &Env) {
    let d = env.formatted("x.img", "xfs", 320 * MIB);
    file::grow(&d.backing_file, 400 * MIB).unwrap();
    env.loops().refresh_capacity(&d.device).unwrap();
    assert_eq!(env.fs().device_size(&d.device).unwrap(), 400 * MIB);
    let err = env.fs().grow(&d.device, None, "xfs").unwrap_err();
    assert!(err.is_unsupported(), "{err:?}");
    assert_eq!(env.fs().fs_size(&d.device, "xfs").unwrap(), 320 * MIB);

    let m = env.folder("m");
    env.mounter().mount(&d.device, &m, "xfs", &plain()).unwrap();
    env.fs().grow(&d.device, Some(&m), "xfs").unwrap();
    assert_eq!(env.fs().fs_size(&d.device, "xfs").unwrap(), 400 * MIB);
}

fn grow_ext4_offline(env: &Env) {
    let d = env.formatted("e.img", "ext4", 32 * MIB);
    file::grow(&d.backing_file, 48 * MIB).unwrap();
    env.loops().refresh_capacity(&d.device).unwrap();
    env.fs().grow(&d.device, None, "ext4").unwrap();
    assert_eq!(env.fs().fs_size(&d.device, "ext4").unwrap(), 48 * MIB);
    env.fs().check(&d.device, "ext4").unwrap();
    // A repair of a sound filesystem changes nothing; only ext4 is repaired.
    env.fs().repair(&d.device, "ext4").unwrap();
    env.fs().check(&d.device, "ext4").unwrap();
    let err = env.fs().repair(&d.device, "xfs").unwrap_err();
    assert!(err.is_unsupported(), "{err:?}");
}

fn freeze_and_thaw(env: &Env) {
    let unmounted = env.folder("unmounted");
    let err = env.fs().freeze(&unmounted).unwrap_err();
    assert!(err.is_not_mounted(), "{err:?}");
    let err = env.fs().thaw(&unmounted).unwrap_err();
    assert!(err.is_not_mounted(), "{err:?}");

    let (_, m) = env.mounted("f", &plain());
    env.fs().freeze(&m).unwrap();
    // Frozen already, and thawed already, are both fine.
    env.fs().freeze(&m).unwrap();
    env.fs().thaw(&m).unwrap();
    env.fs().thaw(&m).unwrap();
}

fn stats_of_a_mounted_filesystem(env: &Env) {
    let (d, m) = env.mounted("s", &plain());
    let st = env.fs().stats(&m).unwrap();
    assert!(st.total_bytes > 0 && st.total_bytes <= 32 * MIB, "{st:?}");
    assert!(st.available_bytes <= st.free_bytes, "{st:?}");
    assert!(st.free_bytes <= st.total_bytes, "{st:?}");
    assert!(st.total_inodes > 0 && st.free_inodes <= st.total_inodes);
    assert!(!st.read_only);
    env.mounter().unmount(&m).unwrap();

    env.mounter()
        .mount(&d.device, &m, "ext4", &read_only())
        .unwrap();
    assert!(env.fs().stats(&m).unwrap().read_only);
}

// ---------------------------------------------------------------------------
// Mounts

fn mount_of_no_filesystem_of_that_type_is_einval(env: &Env) {
    let blank = env.attached("blank.img", 16 * MIB);
    let ext4 = env.formatted("t.img", "ext4", 32 * MIB);
    let m = env.folder("m");
    for (dev, fstype) in [(&blank, "ext4"), (&ext4, "btrfs")] {
        let err = env
            .mounter()
            .mount(&dev.device, &m, fstype, &plain())
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL), "{err:?}");
    }
    assert!(env.mounts_at(&m).is_empty());
}

fn malformed_mounts_are_invalid_arguments(env: &Env) {
    let d = env.formatted("bad.img", "ext4", 32 * MIB);
    let m = env.folder("m");
    let bind_flag = MountOptions {
        read_only: false,
        flags: vec!["bind".into()],
    };
    for err in [
        env.mounter()
            .mount(&d.device, &m, "ext4", &bind_flag)
            .unwrap_err(),
        env.mounter()
            .mount(&d.device, &m, "", &plain())
            .unwrap_err(),
        env.mounter().bind(&env.root, &m, &bind_flag).unwrap_err(),
    ] {
        assert!(err.is_invalid_argument(), "{err:?}");
    }
    assert!(env.mounts_at(&m).is_empty());
}

fn mount_on_a_missing_folder_is_not_found(env: &Env) {
    let d = env.formatted("nf.img", "ext4", 32 * MIB);
    let missing = env.root.join("missing");
    let err = env
        .mounter()
        .mount(&d.device, &missing, "ext4", &plain())
        .unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
    let err = env
        .mounter()
        .bind(&env.root, &missing, &plain())
        .unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
}

fn mounts_stack_but_not_the_same_filesystem_twice(env: &Env) {
    let d = env.formatted("twice.img", "ext4", 32 * MIB);
    let other = env.formatted("other.img", "ext4", 32 * MIB);
    let m = env.folder("m");
    env.mounter()
        .mount(&d.device, &m, "ext4", &plain())
        .unwrap();
    let err = env
        .mounter()
        .mount(&d.device, &m, "ext4", &plain())
        .unwrap_err();
    assert!(err.is_busy(), "{err:?}");
    assert_eq!(env.mounts_at(&m).len(), 1);
    env.mounter()
        .mount(&other.device, &m, "ext4", &plain())
        .unwrap();
    let stack = env.mounts_at(&m);
    assert_eq!(stack.len(), 2);
    assert_eq!(Path::new(&stack[1].source), other.device);
    // The one on top goes first.
    env.mounter().unmount(&m).unwrap();
    let rest = env.mounts_at(&m);
    assert_eq!(rest.len(), 1);
    assert_eq!(Path::new(&rest[0].source), d.device);
    env.mounter().unmount(&m).unwrap();
    assert!(env.mounts_at(&m).is_empty());
    let err = env.mounter().unmount(&m).unwrap_err();
    assert!(err.is_not_mounted(), "{err:?}");
}

fn unmount_of_what_is_not_mounted(env: &Env) {
    let m = env.folder("never");
    assert!(env.mounter().unmount(&m).unwrap_err().is_not_mounted());
    let missing = env.root.join("missing");
    assert!(env
        .mounter()
        .unmount(&missing)
        .unwrap_err()
        .is_not_mounted());
}

fn the_mount_table_shows_what_was_asked(env: &Env) {
    let opts = MountOptions {
        read_only: true,
        flags: vec!["noatime".into(), "nodev,nosuid".into(), "discard".into()],
    };
    let (d, m) = env.mounted("opts", &opts);
    let e = env.mounts_at(&m).pop().expect("mounted");
    assert_eq!(e.fs_type, "ext4");
    assert_eq!(Path::new(&e.source), d.device);
    assert_eq!(e.root, Path::new("/"));
    assert!(e.read_only(), "{:?}", e.options);
    for o in ["noatime", "nodev", "nosuid"] {
        assert!(e.has_option(o), "{o} in {:?}", e.options);
    }
    assert!(!e.has_option("noexec"), "{:?}", e.options);
    assert!(e.has_super_option("discard"), "{:?}", e.super_options);
}

fn a_mounted_device_is_not_detached(env: &Env) {
    let (d, m) = env.mounted("held", &plain());
    let err = env.loops().detach(&d.device).unwrap_err();
    assert!(err.is_busy(), "{err:?}");
    assert_eq!(env.loops().find(&d.backing_file).unwrap().len(), 1);
    env.mounter().unmount(&m).unwrap();
    env.loops().detach(&d.device).unwrap();
    assert!(env.loops().find(&d.backing_file).unwrap().is_empty());
}

fn a_read_write_mount_of_a_read_only_device_is_refused(env: &Env) {
    let d = env.formatted("rodev.img", "ext4", 32 * MIB);
    env.loops().detach(&d.device).unwrap();
    let opts = LoopOptions {
        read_only: true,
        direct_io: false,
    };
    let ro = env.loops().attach(&d.backing_file, opts).unwrap();
    let m = env.folder("m");
    let err = env
        .mounter()
        .mount(&ro.device, &m, "ext4", &plain())
        .unwrap_err();
    assert!(err.is_permission_denied(), "{err:?}");
    env.mounter()
        .mount(&ro.device, &m, "ext4", &read_only())
        .unwrap();
    assert!(env.mounts_at(&m)[0].read_only());
}

fn bind_read_only_of_a_subfolder(env: &Env) {
    let (d, staging) = env.mounted("staging", &plain());
    let sub = staging.join("data");
    std::fs::create_dir(&sub).unwrap();
    let target = env.folder("target");
    let opts = MountOptions {
        read_only: true,
        flags: vec!["nosuid".into(), "discard".into()],
    };
    env.mounter().bind(&sub, &target, &opts).unwrap();
    let b = env.mounts_at(&target).pop().expect("bound");
    assert!(b.read_only(), "{:?}", b.options);
    assert!(b.has_option("nosuid"), "{:?}", b.options);
    assert_eq!(b.fs_type, "ext4");
    assert_eq!(Path::new(&b.source), d.device);
    assert_eq!(b.root, Path::new("/data"));
    assert!(env.fs().stats(&target).unwrap().read_only);
    // The bind is its own mount: unmounting it leaves the staging mount.
    env.mounter().unmount(&target).unwrap();
    assert!(env.mounts_at(&target).is_empty());
    assert_eq!(env.mounts_at(&staging).len(), 1);
    assert!(!env.mounts_at(&staging)[0].read_only());
}

/// Both runs of every case: `fake::NAME` as any user, `linux::NAME` as root.
macro_rules! contract {
    ($($case:ident),* $(,)?) => {
        mod fake {
            $(
                #[test]
                fn $case() {
                    super::$case(&super::Env::fake());
                }
            )*
        }
        mod linux {
            $(
                #[test]
                #[ignore = "needs root: real loop devices, mkfs and mounts"]
                fn $case() {
                    super::$case(&super::Env::linux());
                }
            )*
        }
    };
}

contract!(
    attach_find_serve_detach,
    attach_of_a_missing_file_is_not_found,
    detach_of_no_loop_device,
    attach_read_only_with_direct_io,
    refresh_capacity_sees_the_grown_file,
    read_ahead_reads_back,
    device_size_of_a_regular_file_is_its_length,
    mkfs_probe_size_check,
    unknown_filesystem_types_are_unsupported,
    the_filesystem_stays_with_the_file,
    mkfs_of_a_mounted_device_fails,
    grow_xfs_online_only,
    grow_ext4_offline,
    freeze_and_thaw,
    stats_of_a_mounted_filesystem,
    mount_of_no_filesystem_of_that_type_is_einval,
    malformed_mounts_are_invalid_arguments,
    mount_on_a_missing_folder_is_not_found,
    mounts_stack_but_not_the_same_filesystem_twice,
    unmount_of_what_is_not_mounted,
    the_mount_table_shows_what_was_asked,
    a_mounted_device_is_not_detached,
    a_read_write_mount_of_a_read_only_device_is_refused,
    bind_read_only_of_a_subfolder,
);
