//! btrfs subvolumes, snapshots and qgroups on a loop-mounted btrfs made by the test.

mod common;

use std::fs;
use std::io::Write;

use common::{require_root, LoopMountedPool, MIB};
use csi_sys::{btrfs, file};

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_btrfs_subvolumes_and_snapshots() {
    require_root();
    let pool = LoopMountedPool::new("btrfs", 512 * MIB);
    let p = pool.path();
    assert!(!btrfs::is_subvolume(p.join("missing").as_path()));
    assert_eq!(btrfs::subvolume_id(p).unwrap(), 5);

    let vol = p.join("vol");
    btrfs::subvolume_create(&vol).unwrap();
    assert!(btrfs::is_subvolume(&vol));
    let id = btrfs::subvolume_id(&vol).unwrap();
    assert!(id >= 256, "{id}");
    fs::create_dir(vol.join("dir")).unwrap();
    fs::write(vol.join("dir/f"), b"v1").unwrap();
    // A plain folder is not a subvolume.
    assert!(!btrfs::is_subvolume(&vol.join("dir")));
    assert!(btrfs::subvolume_create(&vol).is_err());

    let snap = p.join("snap");
    btrfs::subvolume_snapshot(&vol, &snap, true).unwrap();
    assert!(btrfs::is_subvolume(&snap));
    assert_ne!(btrfs::subvolume_id(&snap).unwrap(), id);
    fs::write(vol.join("dir/f"), b"v2").unwrap();
    assert_eq!(fs::read(snap.join("dir/f")).unwrap(), b"v1");
    let err = fs::write(snap.join("dir/new"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));

    let clone = p.join("clone");
    btrfs::subvolume_snapshot(&snap, &clone, false).unwrap();
    fs::write(clone.join("dir/new"), b"writable").unwrap();

    // Delete a read-only snapshot, a subvolume holding a nested subvolume, and a
    // missing path.
    btrfs::subvolume_delete(&snap).unwrap();
    assert!(!snap.exists());
    btrfs::subvolume_create(&vol.join("dir/nested")).unwrap();
    btrfs::subvolume_create(&vol.join("dir/nested/deeper")).unwrap();
    fs::write(vol.join("dir/nested/deeper/f"), b"x").unwrap();
    btrfs::subvolume_delete(&vol).unwrap();
    assert!(!vol.exists());
    btrfs::subvolume_delete(&vol).unwrap();
    btrfs::subvolume_delete(&clone).unwrap();

    // A plain folder is refused.
    fs::create_dir(p.join("plain")).unwrap();
    assert!(btrfs::subvolume_delete(&p.join("plain"))
        .unwrap_err()
        .is_invalid_argument());

    // Not btrfs at all.
    let tmp = tempfile::tempdir().unwrap();
    assert!(!btrfs::is_subvolume(tmp.path()));
    let err = btrfs::subvolume_id(tmp.path()).unwrap_err();
    assert!(err.is_unsupported(), "{err:?}");
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_btrfs_qgroup_limit_is_enforced_and_usage_reported() {
    require_root();
    let pool = LoopMountedPool::new("btrfs", 512 * MIB);
    let p = pool.path();
    assert!(!btrfs::quota_enabled(p).unwrap());
    btrfs::quota_enable(p).unwrap();
    btrfs::quota_enable(p).unwrap(); // idempotent
    assert!(btrfs::quota_enabled(p).unwrap());

    let vol = p.join("vol");
    btrfs::subvolume_create(&vol).unwrap();
    btrfs::qgroup_limit(&vol, 16 * MIB).unwrap();
    let info = btrfs::qgroup_info(&vol).unwrap();
    assert_eq!(info.max_referenced, Some(16 * MIB));
    assert!(info.referenced < MIB);

    // Write 4 MiB: usage follows.
    fs::write(vol.join("small"), vec![1u8; 4 << 20]).unwrap();
    let used = btrfs::qgroup_info(&vol).unwrap().referenced;
    assert!((4 * MIB..6 * MIB).contains(&used), "{used}");

    // Writing past the limit fails with EDQUOT.
    let mut f = fs::File::create(vol.join("big")).unwrap();
    let chunk = vec![2u8; 1 << 20];
    let mut err = None;
    for _ in 0..64 {
        if let Err(e) = f.write_all(&chunk).and_then(|()| f.sync_data()) {
            err = Some(e);
            break;
        }
    }
    drop(f);
    let err = err.expect("the qgroup limit was not enforced");
    assert_eq!(err.raw_os_error(), Some(libc::EDQUOT), "{err:?}");
    assert!(csi_sys::SysError::io("write", vol.join("big"), err).is_no_space());
    let used = btrfs::qgroup_info(&vol).unwrap().referenced;
    assert!(used <= 17 * MIB, "{used}");

    // Lifting the limit.
    btrfs::qgroup_limit(&vol, 0).unwrap();
    assert_eq!(btrfs::qgroup_info(&vol).unwrap().max_referenced, None);
    btrfs::subvolume_delete(&vol).unwrap();

    // Usage of something that is not a subvolume on btrfs is an error, not a panic.
    let tmp = tempfile::tempdir().unwrap();
    assert!(btrfs::qgroup_info(tmp.path()).is_err());
    assert!(file::statvfs(p).unwrap().total_bytes > 0);
}
