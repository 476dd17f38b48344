use super::*;

fn image(dir: &Path, name: &str, size: u64) -> PathBuf {
    let p = dir.join(name);
    crate::file::create_sparse(&p, size).unwrap();
    p
}

#[test]
fn loops_mkfs_probe_and_mount() {
    let tmp = tempfile::tempdir().unwrap();
    let img = image(tmp.path(), "a.img", 1 << 20);
    let (sys, state) = system();
    let dev = sys.loops.attach(&img, LoopOptions::default()).unwrap();
    assert_eq!(dev.device, PathBuf::from("/dev/loop0"));
    assert_eq!(dev.size, 1 << 20);
    assert_eq!(sys.loops.find(&img).unwrap(), vec![dev.clone()]);

    assert_eq!(sys.fs.probe(&dev.device).unwrap(), None);
    let staging = Path::new("/staging");
    let err = sys
        .mounter
        .mount(&dev.device, staging, "ext4", &MountOptions::default())
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EINVAL));

    sys.fs.mkfs(&dev.device, "ext4").unwrap();
    assert_eq!(sys.fs.probe(&dev.device).unwrap().as_deref(), Some("ext4"));
    sys.mounter
        .mount(&dev.device, staging, "ext4", &MountOptions::default())
        .unwrap();
    assert!(state.is_mounted(staging));
    assert!(sys.loops.detach(&dev.device).unwrap_err().is_busy());

    let target = Path::new("/pods/x/volume");
    let ro = MountOptions {
        read_only: true,
        flags: vec![],
    };
    sys.mounter.bind(staging, target, &ro).unwrap();
    let m = state.mounts();
    assert_eq!(m.len(), 2);
    assert_eq!(m[1].source, dev.device.to_string_lossy());
    assert!(m[1].read_only());
    assert_eq!(m[1].parent_id, 1);

    sys.mounter.unmount(target).unwrap();
    assert!(sys.mounter.unmount(target).unwrap_err().is_not_mounted());
    sys.mounter.unmount(staging).unwrap();
    sys.loops.set_read_ahead_kib(&dev.device, 4096).unwrap();
    assert_eq!(state.read_ahead_kib(&dev.device), Some(4096));
    sys.loops.detach(&dev.device).unwrap();
    sys.loops.detach(&dev.device).unwrap();

    // The filesystem belongs to the file: a new device still finds it.
    let again = sys.loops.attach(&img, LoopOptions::default()).unwrap();
    assert_eq!(
        sys.fs.probe(&again.device).unwrap().as_deref(),
        Some("ext4")
    );
    assert_eq!(state.counters().mkfs, 1);
}

#[test]
fn mounts_stack_and_failures_inject() {
    let (sys, state) = system();
    state.set_filesystem(Path::new("/dev/vdb"), "xfs", 1 << 30);
    state.set_filesystem(Path::new("/dev/vdc"), "xfs", 1 << 30);
    let t = Path::new("/mnt/t");
    sys.mounter
        .mount(Path::new("/dev/vdb"), t, "xfs", &MountOptions::default())
        .unwrap();
    // The same filesystem on top of itself is refused; another one stacks.
    assert!(sys
        .mounter
        .mount(Path::new("/dev/vdb"), t, "xfs", &MountOptions::default())
        .unwrap_err()
        .is_busy());
    sys.mounter
        .mount(Path::new("/dev/vdc"), t, "xfs", &MountOptions::default())
        .unwrap();
    assert_eq!(state.mounts().len(), 2);
    sys.mounter.unmount(t).unwrap();
    assert!(state.is_mounted(t));

    state.fail_next(FakeOp::Unmount, || SysError::Busy {
        what: "test".into(),
    });
    assert!(sys.mounter.unmount(t).unwrap_err().is_busy());
    sys.mounter.unmount(t).unwrap();
    assert!(!state.is_mounted(t));
}

#[test]
fn grow_freeze_and_uuid() {
    let tmp = tempfile::tempdir().unwrap();
    let img = image(tmp.path(), "b.img", 1 << 20);
    let (sys, state) = system();
    let dev = sys.loops.attach(&img, LoopOptions::default()).unwrap();
    sys.fs.mkfs(&dev.device, "xfs").unwrap();
    crate::file::grow(&img, 2 << 20).unwrap();
    sys.loops.refresh_capacity(&dev.device).unwrap();
    assert_eq!(sys.fs.device_size(&dev.device).unwrap(), 2 << 20);
    assert!(sys
        .fs
        .grow(&dev.device, None, "xfs")
        .unwrap_err()
        .is_unsupported());
    let m = Path::new("/m");
    sys.mounter
        .mount(&dev.device, m, "xfs", &MountOptions::default())
        .unwrap();
    sys.fs.grow(&dev.device, Some(m), "xfs").unwrap();
    assert_eq!(sys.fs.fs_size(&dev.device, "xfs").unwrap(), 2 << 20);
    assert_eq!(sys.fs.stats(m).unwrap().total_bytes, 2 << 20);

    sys.fs.freeze(m).unwrap();
    assert!(state.is_frozen(m));
    sys.fs.thaw(m).unwrap();
    assert!(!state.is_frozen(m));
    assert!(sys
        .fs
        .freeze(Path::new("/elsewhere"))
        .unwrap_err()
        .is_not_mounted());
    sys.mounter.unmount(m).unwrap();
    assert!(sys
        .fs
        .mkfs(&dev.device, "zfs")
        .unwrap_err()
        .is_unsupported());
}
