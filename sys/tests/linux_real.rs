//! The Linux implementation against the real kernel: loop devices, mkfs, probe,
//! mount, bind, grow, new UUID, freeze/thaw. Every test is `root_*`.

mod common;

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use common::{
    formatted, image, mounted, mountpoint, mounts_of_this_test, no_other_mounts, require_root,
    root_scratch, Attached, LoopMountedPool, Mounted, MIB,
};
use csi_sys::linux::{LinuxFilesystems, LinuxLoops, LinuxMounter};
use csi_sys::{file, mountinfo, Filesystems, LoopOptions, Loops, MountOptions, Mounter};

fn sysfs(dev: &Path, attr: &str) -> String {
    let name = dev.file_name().unwrap().to_str().unwrap();
    std::fs::read_to_string(format!("/sys/block/{name}/{attr}"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_loop_attach_find_resize_flags_detach() {
    let (_mounts, tmp) = root_scratch();
    let img = image(tmp.path(), "vol.img", 64 * MIB);
    let loops = LinuxLoops::default();
    let real = std::fs::canonicalize(&img).unwrap();
    let dev_path;
    {
        let a = Attached::new(&img, LoopOptions::default());
        dev_path = a.path().to_path_buf();
        assert!(a.path().to_str().unwrap().starts_with("/dev/loop"));
        assert_eq!(a.dev.backing_file, real);
        assert_eq!(a.dev.size, 64 * MIB);
        assert!(!a.dev.read_only);
        assert!(!a.dev.direct_io);
        // The device must outlive the process that attached it.
        assert_eq!(sysfs(a.path(), "loop/autoclear"), "0");

        let found = loops.find(&img).unwrap();
        assert_eq!(found, vec![a.dev.clone()]);
        assert!(loops.list().unwrap().contains(&a.dev));
        let fs = LinuxFilesystems::default();
        assert_eq!(fs.device_size(a.path()).unwrap(), 64 * MIB);

        file::grow(&img, 96 * MIB).unwrap();
        loops.refresh_capacity(a.path()).unwrap();
        assert_eq!(fs.device_size(a.path()).unwrap(), 96 * MIB);
        assert_eq!(loops.find(&img).unwrap()[0].size, 96 * MIB);

        loops.set_direct_io(a.path(), true).unwrap();
        assert!(loops.find(&img).unwrap()[0].direct_io);
        loops.set_direct_io(a.path(), false).unwrap();
        assert!(!loops.find(&img).unwrap()[0].direct_io);

        loops.detach(a.path()).unwrap();
        assert!(loops.find(&img).unwrap().is_empty());
        // Detaching again is fine (already detached).
        loops.detach(a.path()).unwrap();
    }
    assert!(loops
        .list()
        .unwrap()
        .iter()
        .all(|d| d.device != dev_path || d.backing_file != real));
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_loop_attach_read_only_and_direct_io() {
    let (_mounts, tmp) = root_scratch();
    let img = image(tmp.path(), "ro.img", 16 * MIB);
    let a = Attached::new(
        &img,
        LoopOptions {
            read_only: true,
            direct_io: true,
        },
    );
    assert!(a.dev.read_only);
    assert_eq!(sysfs(a.path(), "ro"), "1");
    assert!(
        a.dev.direct_io,
        "direct I/O should work on an ext4 backing file"
    );
    assert_eq!(sysfs(a.path(), "loop/dio"), "1");
    // Writing to a read-only device fails (the open itself may succeed).
    let err = std::fs::OpenOptions::new()
        .write(true)
        .open(a.path())
        .and_then(|mut f| f.write_all(&[1u8; 4096]).and_then(|()| f.sync_all()))
        .unwrap_err();
    assert!(
        matches!(
            err.raw_os_error(),
            Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES)
        ),
        "{err:?}"
    );
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_loop_concurrent_attaches_get_distinct_devices() {
    let (_mounts, tmp) = root_scratch();
    let images: Vec<_> = (0..4)
        .map(|i| image(tmp.path(), &format!("c{i}.img"), 8 * MIB))
        .collect();
    let guards: Vec<Attached> = std::thread::scope(|s| {
        let handles: Vec<_> = images
            .iter()
            .map(|img| s.spawn(move || Attached::new(img, LoopOptions::default())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut devs: Vec<_> = guards.iter().map(|g| g.path().to_path_buf()).collect();
    devs.sort();
    devs.dedup();
    assert_eq!(devs.len(), 4);
    for (g, img) in guards.iter().zip(&images) {
        assert_eq!(
            LinuxLoops::default().find(img).unwrap(),
            vec![g.dev.clone()]
        );
    }
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_loop_detach_of_mounted_device_is_busy() {
    let (_mounts, tmp) = root_scratch();
    let (img, a) = formatted(tmp.path(), "busy.img", 32 * MIB, "ext4");
    let (_, m) = mounted(a.path(), tmp.path(), "m", "ext4");
    let err = LinuxLoops::default().detach(a.path()).unwrap_err();
    assert!(err.is_busy(), "{err:?}");
    // Still attached and still mounted.
    assert_eq!(LinuxLoops::default().find(&img).unwrap().len(), 1);
    assert_eq!(sysfs(a.path(), "loop/autoclear"), "0");
    drop(m);
    LinuxLoops::default().detach(a.path()).unwrap();
    assert!(LinuxLoops::default().find(&img).unwrap().is_empty());
}

/// mkfs, probe, size, check, mount, bind read-only, unmount, for one fstype.
fn mkfs_mount_bind_cycle(fstype: &str, size: u64, data_flag: &str) {
    let (_mounts, tmp) = root_scratch();
    let img = image(tmp.path(), "vol.img", size);
    let a = Attached::new(&img, LoopOptions::default());
    let fs = LinuxFilesystems::default();

    assert_eq!(fs.probe(a.path()).unwrap(), None);
    fs.mkfs(a.path(), fstype).unwrap();
    assert_eq!(fs.probe(a.path()).unwrap().as_deref(), Some(fstype));
    assert_eq!(fs.fs_size(a.path(), fstype).unwrap(), size);
    fs.check(a.path(), fstype).unwrap();
    assert!(
        !fs_uuid(a.path()).is_empty(),
        "mkfs gave the filesystem a UUID"
    );

    let staging = mountpoint(tmp.path(), "staging dir");
    let opts = MountOptions {
        read_only: false,
        flags: vec!["noatime".into(), "nodev".into(), data_flag.into()],
    };
    LinuxMounter
        .mount(a.path(), &staging, fstype, &opts)
        .unwrap();
    let _staged = Mounted::guard(&staging);
    let table = LinuxMounter.mounts().unwrap();
    let e = mountinfo::mount_at(&table, &staging).expect("staging is in the mount table");
    assert_eq!(e.fs_type, fstype);
    assert_eq!(Path::new(&e.source), a.path());
    assert!(
        e.has_option("noatime") && e.has_option("nodev"),
        "{:?}",
        e.options
    );
    assert!(!e.read_only());
    assert!(e.has_super_option(data_flag), "{:?}", e.super_options);

    let data = staging.join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("hello"), b"world").unwrap();
    let st = fs.stats(&staging).unwrap();
    assert!(st.total_bytes > 0 && st.available_bytes <= st.total_bytes);
    assert!(!st.read_only);

    // Bind the subfolder read-only, as a publish does.
    let target = mountpoint(tmp.path(), "target");
    LinuxMounter
        .bind(
            &data,
            &target,
            &MountOptions {
                read_only: true,
                flags: vec!["nosuid".into(), "discard".into()],
            },
        )
        .unwrap();
    let _published = Mounted::guard(&target);
    let table = LinuxMounter.mounts().unwrap();
    let b = mountinfo::mount_at(&table, &target).expect("target is in the mount table");
    assert!(b.read_only());
    assert!(b.has_option("nosuid"));
    assert_eq!(b.fs_type, fstype);
    assert!(b.root.ends_with("data"), "{}", b.root.display());
    assert_eq!(std::fs::read(target.join("hello")).unwrap(), b"world");
    let err = std::fs::write(target.join("x"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    assert!(fs.stats(&target).unwrap().read_only);

    LinuxMounter.unmount(&target).unwrap();
    assert!(LinuxMounter.unmount(&target).unwrap_err().is_not_mounted());
    LinuxMounter.unmount(&staging).unwrap();
    assert!(LinuxMounter.unmount(&staging).unwrap_err().is_not_mounted());
    fs.check(a.path(), fstype).unwrap();
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_ext4_mkfs_probe_mount_bind() {
    mkfs_mount_bind_cycle("ext4", 64 * MIB, "discard");
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_xfs_mkfs_probe_mount_bind() {
    mkfs_mount_bind_cycle("xfs", 320 * MIB, "discard");
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_btrfs_mkfs_probe_mount_bind() {
    mkfs_mount_bind_cycle("btrfs", 256 * MIB, "discard");
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_mount_errors_are_clear() {
    let (_mounts, tmp) = root_scratch();
    let img = image(tmp.path(), "empty.img", 16 * MIB);
    let a = Attached::new(&img, LoopOptions::default());
    let mnt = mountpoint(tmp.path(), "m");
    let err = LinuxMounter
        .mount(a.path(), &mnt, "ext4", &MountOptions::default())
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(a.path().to_str().unwrap()) && msg.contains("ext4"),
        "{msg}"
    );
    assert!(LinuxMounter
        .mounts()
        .unwrap()
        .iter()
        .all(|e| e.mount_point != mnt));
    let err = LinuxMounter
        .mount(
            a.path(),
            &tmp.path().join("missing"),
            "ext4",
            &MountOptions::default(),
        )
        .unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
    assert!(LinuxMounter.unmount(&mnt).unwrap_err().is_not_mounted());
    assert!(LinuxMounter
        .unmount(&tmp.path().join("missing"))
        .unwrap_err()
        .is_not_mounted());
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_grow_xfs_online() {
    let (_mounts, tmp) = root_scratch();
    let (img, a) = formatted(tmp.path(), "x.img", 320 * MIB, "xfs");
    let fs = LinuxFilesystems::default();
    let (mnt, _m) = mounted(a.path(), tmp.path(), "m", "xfs");
    let before = fs.stats(&mnt).unwrap().total_bytes;
    assert!(fs.grow(a.path(), None, "xfs").unwrap_err().is_unsupported());

    file::grow(&img, 512 * MIB).unwrap();
    LinuxLoops::default().refresh_capacity(a.path()).unwrap();
    assert_eq!(fs.device_size(a.path()).unwrap(), 512 * MIB);
    fs.grow(a.path(), Some(&mnt), "xfs").unwrap();
    assert_eq!(fs.fs_size(a.path(), "xfs").unwrap(), 512 * MIB);
    let after = fs.stats(&mnt).unwrap().total_bytes;
    assert!(after > before + 150 * MIB, "{before} -> {after}");
    // Growing a filesystem that already fills its device is harmless.
    fs.grow(a.path(), Some(&mnt), "xfs").unwrap();
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_grow_btrfs_online() {
    let (_mounts, tmp) = root_scratch();
    let (img, a) = formatted(tmp.path(), "b.img", 256 * MIB, "btrfs");
    let fs = LinuxFilesystems::default();
    let (mnt, _m) = mounted(a.path(), tmp.path(), "m", "btrfs");
    file::grow(&img, 384 * MIB).unwrap();
    LinuxLoops::default().refresh_capacity(a.path()).unwrap();
    fs.grow(a.path(), Some(&mnt), "btrfs").unwrap();
    // The superblock on disk is written at commit.
    nix::unistd::sync();
    assert_eq!(fs.fs_size(a.path(), "btrfs").unwrap(), 384 * MIB);
    assert!(fs.stats(&mnt).unwrap().total_bytes > 300 * MIB);
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_grow_ext4_offline() {
    let (_mounts, tmp) = root_scratch();
    let (img, a) = formatted(tmp.path(), "e.img", 64 * MIB, "ext4");
    let fs = LinuxFilesystems::default();
    // Mount and write once, so the grow works on a used filesystem.
    let mnt = mountpoint(tmp.path(), "m");
    LinuxMounter
        .mount(a.path(), &mnt, "ext4", &MountOptions::default())
        .unwrap();
    {
        let _m = Mounted::guard(&mnt);
        std::fs::write(mnt.join("f"), vec![7u8; 1 << 20]).unwrap();
    }
    file::grow(&img, 128 * MIB).unwrap();
    LinuxLoops::default().refresh_capacity(a.path()).unwrap();
    fs.grow(a.path(), None, "ext4").unwrap();
    assert_eq!(fs.fs_size(a.path(), "ext4").unwrap(), 128 * MIB);
    fs.check(a.path(), "ext4").unwrap();
    LinuxMounter
        .mount(a.path(), &mnt, "ext4", &MountOptions::default())
        .unwrap();
    let _m = Mounted::guard(&mnt);
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), vec![7u8; 1 << 20]);
    assert!(fs.stats(&mnt).unwrap().total_bytes > 100 * MIB);
}

/// An offline ext4 grow killed part way (as the driver's death kills its
/// resize2fs) leaves, at some points, new groups half described: a filesystem
/// `e2fsck -p` refuses to repair. Cut at points from the start to near the end,
/// for 1 KiB and 4 KiB blocks, each time `repair` gives back a filesystem that
/// checks clean, holds its data byte for byte, and grows on the next try.
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_an_ext4_grow_killed_part_way_is_repaired_and_done_again() {
    let (_mounts, tmp) = root_scratch();
    let fs = LinuxFilesystems::default();
    let data: Vec<u8> = (0..3u32 << 20).map(|i| (i * 7 + i / 4093) as u8).collect();
    let (mut cut, mut damaged) = (0, 0);
    let mut i = 0;
    for block in ["1024", "4096"] {
        for delay_ms in [0u64, 5, 10, 20, 30, 45, 70] {
            i += 1;
            let img = image(tmp.path(), &format!("k{i}.img"), 256 * MIB);
            let a = Attached::new(&img, LoopOptions::default());
            let made = std::process::Command::new("mkfs.ext4")
                .args(["-q", "-F", "-b", block])
                .arg(a.path())
                .status()
                .unwrap();
            assert!(made.success());
            {
                let (mnt, _m) = mounted(a.path(), tmp.path(), &format!("k{i}"), "ext4");
                std::fs::write(mnt.join("f"), &data).unwrap();
            }
            file::grow(&img, 8192 * MIB).unwrap();
            LinuxLoops::default().refresh_capacity(a.path()).unwrap();
            let mut child = std::process::Command::new("resize2fs")
                .arg(a.path())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            std::thread::sleep(Duration::from_millis(delay_ms));
            if child.try_wait().unwrap().is_none() {
                cut += 1;
                child.kill().unwrap();
            }
            child.wait().unwrap();
            let at = format!("{block}-byte blocks, cut after {delay_ms} ms");
            if fs.check(a.path(), "ext4").is_err() {
                damaged += 1;
            }
            fs.repair(a.path(), "ext4")
                .unwrap_or_else(|e| panic!("{at}: {e}"));
            fs.check(a.path(), "ext4")
                .unwrap_or_else(|e| panic!("{at}: checked after the repair: {e}"));
            fs.grow(a.path(), None, "ext4").unwrap();
            fs.check(a.path(), "ext4").unwrap();
            assert_eq!(fs.fs_size(a.path(), "ext4").unwrap(), 8192 * MIB, "{at}");
            let (mnt, _m) = mounted(a.path(), tmp.path(), &format!("k{i}"), "ext4");
            assert!(
                std::fs::read(mnt.join("f")).unwrap() == data,
                "{at}: the data changed"
            );
        }
    }
    eprintln!("{cut} grows cut part way; {damaged} left a filesystem the check refused");
    assert!(cut >= 1, "no grow was cut: the test proves nothing");
}

/// Online grow of ext4 needs CAP_SYS_RESOURCE, which this project's VMs withhold:
/// there the caller must get PermissionDenied (and grows at the next stage); on a
/// real node the grow succeeds. Either outcome is checked.
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_grow_ext4_online_succeeds_or_reports_permission_denied() {
    let (_mounts, tmp) = root_scratch();
    let (img, a) = formatted(tmp.path(), "e.img", 64 * MIB, "ext4");
    let fs = LinuxFilesystems::default();
    let (mnt, _m) = mounted(a.path(), tmp.path(), "m", "ext4");
    file::grow(&img, 128 * MIB).unwrap();
    LinuxLoops::default().refresh_capacity(a.path()).unwrap();
    match fs.grow(a.path(), Some(&mnt), "ext4") {
        Ok(()) => assert!(fs.stats(&mnt).unwrap().total_bytes > 100 * MIB),
        Err(e) => {
            assert!(e.is_permission_denied(), "{e:?}");
            assert!(e.to_string().contains("CAP_SYS_RESOURCE"), "{e}");
            eprintln!("NOTE: online ext4 grow is not permitted on this machine: {e}");
        }
    }
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_freeze_blocks_writes_until_thaw() {
    let (_mounts, tmp) = root_scratch();
    let (_, a) = formatted(tmp.path(), "f.img", 64 * MIB, "ext4");
    let fs = LinuxFilesystems::default();
    let (mnt, _m) = mounted(a.path(), tmp.path(), "m", "ext4");

    // A path that is not a mount point is refused, never the filesystem holding it.
    let sub = mnt.join("sub");
    std::fs::create_dir(&sub).unwrap();
    assert!(fs.freeze(&sub).unwrap_err().is_not_mounted());

    fs.freeze(&mnt).unwrap();
    fs.freeze(&mnt).unwrap(); // already frozen: fine
    let (tx, rx) = std::sync::mpsc::channel();
    let target = mnt.join("written-while-frozen");
    let writer = std::thread::spawn(move || {
        let r = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&target)
            .and_then(|mut f| f.write_all(b"x"));
        let _ = tx.send(r.is_ok());
    });
    let blocked = rx.recv_timeout(Duration::from_millis(500)).is_err();
    fs.thaw(&mnt).unwrap();
    let done = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    writer.join().unwrap();
    assert!(blocked, "a write went through while frozen");
    assert!(done);
    fs.thaw(&mnt).unwrap(); // not frozen: fine
}

/// Shuts the xfs mounted at `mnt` down with its log written to disk and unmounts
/// it: the filesystem as a power loss leaves it, its log holding what recovery
/// must replay.
fn xfs_lose_power(mnt: &Path) {
    let down = std::process::Command::new("xfs_io")
        .args(["-x", "-c", "shutdown -f"])
        .arg(mnt)
        .status()
        .unwrap();
    assert!(down.success());
    LinuxMounter.unmount(mnt).unwrap();
}

/// `xfs_repair -n` of `dev`: whether it passed, and what it said on stderr.
fn xfs_repair_n(dev: &Path) -> (bool, String) {
    let out = std::process::Command::new("xfs_repair")
        .arg("-n")
        .arg(dev)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// An xfs whose node lost power with changes in its log (forced here by shutting
/// the filesystem down after its log went to disk) passes the check: its log is
/// replayed first, and the check then finds nothing wrong, every time. Its data
/// is there afterwards, and no mount was left anywhere by the replay.
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_xfs_check_replays_the_log_of_a_filesystem_that_lost_power() {
    let (_mounts, tmp) = root_scratch();
    let fs = LinuxFilesystems::default();
    for round in 0..3u8 {
        let img = image(tmp.path(), &format!("lost-{round}.img"), 320 * MIB);
        let a = Attached::new(&img, LoopOptions::default());
        fs.mkfs(a.path(), "xfs").unwrap();
        let mnt = mountpoint(tmp.path(), &format!("lost-{round}"));
        LinuxMounter
            .mount(a.path(), &mnt, "xfs", &MountOptions::default())
            .unwrap();
        for i in 0..50 {
            let data = vec![round.wrapping_add(i as u8); 64 << 10];
            let path = mnt.join(format!("f{i}"));
            std::fs::write(&path, &data).unwrap();
            std::fs::File::open(&path).unwrap().sync_all().unwrap();
        }
        xfs_lose_power(&mnt);
        let (_, said) = xfs_repair_n(a.path());
        assert!(
            said.contains("valuable metadata changes in a log"),
            "round {round}: the log should need replaying: {said}"
        );
        fs.check(a.path(), "xfs")
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let dev = a.path().display().to_string();
        assert!(
            !mountinfo::read().unwrap().iter().any(|m| m.source == dev),
            "round {round}: a mount of {dev} was left"
        );
        let (clean, said) = xfs_repair_n(a.path());
        assert!(clean, "round {round}: {said}");
        LinuxMounter
            .mount(a.path(), &mnt, "xfs", &MountOptions::default())
            .unwrap();
        for i in 0..50 {
            let data = std::fs::read(mnt.join(format!("f{i}"))).unwrap();
            assert_eq!(
                data,
                vec![round.wrapping_add(i as u8); 64 << 10],
                "round {round}"
            );
        }
        LinuxMounter.unmount(&mnt).unwrap();
    }
}

/// An xfs grown online whose node lost power before the new size reached its
/// primary superblock (the grow wrote the other superblocks at once; the primary
/// one is in the log): `xfs_repair -n` stops at its first phase, before it looks
/// at the log. The check replays the log and passes, and the filesystem has its
/// grown size.
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_xfs_check_replays_a_grow_that_the_log_holds() {
    let (_mounts, tmp) = root_scratch();
    let fs = LinuxFilesystems::default();
    let img = image(tmp.path(), "grown.img", 300 * MIB);
    let a = Attached::new(&img, LoopOptions::default());
    fs.mkfs(a.path(), "xfs").unwrap();
    let mnt = mountpoint(tmp.path(), "grown");
    LinuxMounter
        .mount(a.path(), &mnt, "xfs", &MountOptions::default())
        .unwrap();
    std::fs::write(mnt.join("keep"), b"kept").unwrap();
    std::fs::File::open(mnt.join("keep"))
        .unwrap()
        .sync_all()
        .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(500 * MIB)
        .unwrap();
    LinuxLoops::default().refresh_capacity(a.path()).unwrap();
    fs.grow(a.path(), Some(&mnt), "xfs").unwrap();
    xfs_lose_power(&mnt);
    let (passed, _) = xfs_repair_n(a.path());
    assert!(
        !passed,
        "the primary superblock should still have the old size"
    );

    fs.check(a.path(), "xfs").unwrap();
    let (passed, said) = xfs_repair_n(a.path());
    assert!(passed, "{said}");
    LinuxMounter
        .mount(a.path(), &mnt, "xfs", &MountOptions::default())
        .unwrap();
    assert_eq!(std::fs::read(mnt.join("keep")).unwrap(), b"kept");
    let total = nix::sys::statvfs::statvfs(&mnt).unwrap();
    let bytes = total.blocks() as u64 * total.fragment_size() as u64;
    LinuxMounter.unmount(&mnt).unwrap();
    assert!(bytes > 400 * MIB, "grown: {bytes} bytes");
}

/// The snapshot path of an image volume: freeze, reflink the image in an xfs pool
/// (reflink=1), thaw; the clone shares its source's UUID and, as the node mounts
/// every xfs (nouuid), mounts next to it with the data of the freeze.
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_reflink_clone_of_xfs_image_mounts_beside_its_source() {
    require_root();
    let _mounts = mounts_of_this_test();
    let pool = LoopMountedPool::new("xfs", 2048 * MIB);
    assert!(file::probe_reflink(pool.path()));
    assert_eq!(file::fs_type_name(pool.path()).unwrap(), "xfs");
    let img = image(pool.path(), "src.img", 320 * MIB);
    let clone = pool.path().join("clone.img");
    let tmp = tempfile::tempdir().unwrap();
    let fs = LinuxFilesystems::default();

    let src = Attached::new(&img, LoopOptions::default());
    fs.mkfs(src.path(), "xfs").unwrap();
    let (m1, _g1) = mounted(src.path(), tmp.path(), "src", "xfs");
    std::fs::write(m1.join("file"), vec![3u8; 4 << 20]).unwrap();

    fs.freeze(&m1).unwrap();
    let copied = file::copy_file(&img, &clone);
    fs.thaw(&m1).unwrap();
    assert!(copied.unwrap(), "the xfs pool should reflink");
    assert_eq!(file::file_len(&clone).unwrap(), 320 * MIB);

    let c = Attached::new(&clone, LoopOptions::default());
    // The clone of a mounted (frozen) xfs has a dirty log: check must accept it,
    // since mounting replays it.
    fs.check(c.path(), "xfs").unwrap();
    assert_eq!(fs_uuid(c.path()), fs_uuid(src.path()));
    let m2 = mountpoint(tmp.path(), "clone");
    let same_uuid = LinuxMounter.mount(c.path(), &m2, "xfs", &MountOptions::default());
    assert!(same_uuid.is_err(), "xfs refuses a second mount of one UUID");
    LinuxMounter
        .mount(
            c.path(),
            &m2,
            "xfs",
            &MountOptions {
                read_only: false,
                flags: vec!["nouuid".into()],
            },
        )
        .unwrap();
    let _g2 = Mounted::guard(&m2);
    assert_eq!(std::fs::read(m2.join("file")).unwrap(), vec![3u8; 4 << 20]);
}

/// The filesystem UUID of `device`, as blkid reads it from the superblock.
fn fs_uuid(device: &Path) -> String {
    common::sh(
        "blkid",
        &["-p", "-s", "UUID", "-o", "value", device.to_str().unwrap()],
    )
    .trim()
    .to_string()
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_fs_type_names() {
    require_root();
    let _mounts = mounts_of_this_test();
    let pool = LoopMountedPool::new("btrfs", 256 * MIB);
    assert_eq!(file::fs_type_name(pool.path()).unwrap(), "btrfs");
    assert!(file::probe_reflink(pool.path()));
    assert!(file::statvfs(pool.path()).unwrap().total_bytes > 200 * MIB);
}

/// A device attached through a mount that is gone (a replaced container's view
/// of the pool) is reported by the kernel under another path; it is still found
/// by the file's own path, and a different file of the same name is not.
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_loop_found_after_the_attaching_mount_is_gone() {
    let (_mounts, tmp) = root_scratch();
    let pool = tmp.path().join("pool");
    let other = tmp.path().join("other");
    let view = tmp.path().join("view");
    for d in [&pool, &other, &view] {
        std::fs::create_dir(d).unwrap();
    }
    let img = image(&pool, "vol.img", 16 * MIB);
    let twin = image(&other, "vol.img", 16 * MIB);
    common::sh(
        "mount",
        &["--bind", pool.to_str().unwrap(), view.to_str().unwrap()],
    );
    let a = Attached::new(&view.join("vol.img"), LoopOptions::default());
    // The mount the device was attached through goes away; the loop device
    // keeps it alive, detached, so the kernel reports a path from its root.
    nix::mount::umount2(&view, nix::mount::MntFlags::MNT_DETACH).unwrap();
    let reported = std::fs::read_to_string(format!(
        "/sys/block/{}/loop/backing_file",
        a.path().file_name().unwrap().to_str().unwrap()
    ))
    .unwrap();
    assert_eq!(reported.trim(), "/vol.img", "the kernel's view changed");

    let loops = LinuxLoops::default();
    let found = loops.find(&img).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].device, a.dev.device);
    assert_eq!(found[0].backing_file, std::fs::canonicalize(&img).unwrap());
    assert!(loops.find(&twin).unwrap().is_empty());
}

/// A device whose filesystem is mounted only in another mount namespace (as when
/// a container runtime copied the mount table a moment before the unmount here)
/// cannot be detached now; detach says so and the kernel detaches it once that
/// namespace lets go. Mounted here, it stays attached.
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_loop_detach_when_mounted_only_in_another_namespace() {
    require_root();
    let _alone = no_other_mounts();
    let tmp = tempfile::tempdir().unwrap();
    let img = image(tmp.path(), "held.img", 64 * MIB);
    let a = Attached::new(&img, LoopOptions::default());
    LinuxFilesystems::default().mkfs(a.path(), "ext4").unwrap();
    let loops = LinuxLoops::default();
    let n = a.path().file_name().unwrap().to_str().unwrap().to_string();

    // Mounted here: busy, and it stays attached after the unmount.
    let here = mountpoint(tmp.path(), "here");
    LinuxMounter
        .mount(a.path(), &here, "ext4", &MountOptions::default())
        .unwrap();
    assert!(loops.detach(a.path()).unwrap_err().is_busy());
    assert_eq!(sysfs(a.path(), "loop/autoclear"), "0");
    LinuxMounter.unmount(&here).unwrap();
    assert!(!loops.find(&img).unwrap().is_empty());

    // Mounted in another namespace only.
    let there = mountpoint(tmp.path(), "there");
    struct Holder(std::process::Child);
    impl Drop for Holder {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut holder = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount {} {} && echo ready && exec sleep 600",
            a.path().display(),
            there.display()
        ))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = holder.stdout.take().unwrap();
    let holder = Holder(holder);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let err = loops.detach(a.path()).unwrap_err();
    assert!(err.is_busy(), "{err}");
    assert!(err.to_string().contains("held elsewhere"), "{err}");
    assert_eq!(sysfs(a.path(), "loop/autoclear"), "1");
    assert!(!loops.find(&img).unwrap().is_empty(), "still attached");
    drop(holder);
    let gone = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        !Path::new(&format!("/sys/block/{n}/loop/backing_file")).exists()
    });
    assert!(
        gone,
        "the kernel detached {n} once the other namespace let go"
    );
}

/// A device whose detach was deferred (held elsewhere: here a descriptor open in
/// this test) is kept by `keep` before it is used again: the mark goes, and the
/// device stays attached to its file once the other holder lets go. `keep` of a
/// device for another file, or of a device gone, is false and changes nothing.
#[test]
#[ignore = "needs root: loop devices"]
fn root_loop_keep_cancels_a_deferred_detach() {
    let (_mounts, tmp) = root_scratch();
    let img = image(tmp.path(), "kept.img", 16 * MIB);
    let other = image(tmp.path(), "other.img", 16 * MIB);
    let a = Attached::new(&img, LoopOptions::default());
    let loops = LinuxLoops::default();
    let n = a.path().file_name().unwrap().to_str().unwrap().to_string();

    let holder = std::fs::File::open(a.path()).unwrap();
    let err = loops.detach(a.path()).unwrap_err();
    assert!(err.is_busy(), "{err}");
    assert_eq!(sysfs(a.path(), "loop/autoclear"), "1");

    assert!(
        !loops.keep(a.path(), &other).unwrap(),
        "serves another file"
    );
    assert_eq!(sysfs(a.path(), "loop/autoclear"), "1", "left as it was");
    assert!(loops.keep(a.path(), &img).unwrap());
    assert_eq!(sysfs(a.path(), "loop/autoclear"), "0");
    assert!(loops.keep(a.path(), &img).unwrap(), "again: nothing to do");

    drop(holder);
    std::thread::sleep(Duration::from_millis(300));
    let backing = Path::new("/sys/block").join(&n).join("loop/backing_file");
    assert_eq!(
        std::fs::read_to_string(&backing)
            .map(|b| b.trim().to_string())
            .ok(),
        Some(std::fs::canonicalize(&img).unwrap().display().to_string()),
        "{n} still serves its file once the other holder let go"
    );
    // A detach on purpose still works; then the device is gone for `keep`.
    loops.detach(a.path()).unwrap();
    assert!(!loops.keep(a.path(), &img).unwrap());
}

/// Read-ahead is set and read through the device itself, and the kernel's view
/// in sysfs agrees (a container off the host's network namespace sees /sys
/// read-only, so sysfs cannot be the way in).
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_loop_read_ahead_through_the_device() {
    let (_mounts, tmp) = root_scratch();
    let img = image(tmp.path(), "ra.img", 16 * MIB);
    let a = Attached::new(&img, LoopOptions::default());
    let loops = LinuxLoops::default();
    for kib in [512, 4096, 0, 128] {
        loops.set_read_ahead_kib(a.path(), kib).unwrap();
        assert_eq!(loops.read_ahead_kib(a.path()).unwrap(), kib);
        assert_eq!(sysfs(a.path(), "queue/read_ahead_kb"), kib.to_string());
    }
}
