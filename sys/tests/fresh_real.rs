//! Templates and their copies' new UUIDs against the real tools and kernel: a copy
//! passes its filesystem's check, mounts next to another copy (xfs without
//! nouuid), keeps data, and survives a shutdown without a clean unmount.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::{mountpoint, require_root, sh, Attached, LoopMountedPool, Mounted, MIB};
use csi_sys::fresh::{
    carries_uuid, check_template, clone_template, discard, format_template, read_uuid, renew_uuid,
};
use csi_sys::linux::LinuxMounter;
use csi_sys::{file, LoopOptions, MountOptions, Mounter};

fn blkid_uuid(path: &Path) -> String {
    sh(
        "blkid",
        &["-p", "-s", "UUID", "-o", "value", path.to_str().unwrap()],
    )
    .trim()
    .to_string()
}

fn fsck_ok(fstype: &str, image: &Path) {
    let img = image.to_str().unwrap();
    let (prog, args): (&str, Vec<&str>) = match fstype {
        "ext4" => ("e2fsck", vec!["-f", "-n", img]),
        "xfs" => ("xfs_repair", vec!["-n", img]),
        _ => ("btrfs", vec!["check", "--readonly", img]),
    };
    let out = std::process::Command::new(prog)
        .args(&args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{prog} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn random_uuid() -> [u8; 16] {
    let mut u = [0u8; 16];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut u).unwrap();
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    u
}

fn template(dir: &Path, fstype: &str) -> std::path::PathBuf {
    let t = dir.join(format!("t-{fstype}.img"));
    file::create_sparse(&t, 512 * MIB).unwrap();
    format_template(&t, fstype, Duration::from_secs(120)).unwrap();
    check_template(&t, fstype).unwrap();
    t
}

#[test]
#[ignore = "needs root: mkfs, loop devices and mounts"]
fn root_copies_get_their_own_uuid_and_mount_side_by_side() {
    require_root();
    let pool = LoopMountedPool::new("xfs", 4096 * MIB);
    for fstype in ["ext4", "xfs", "btrfs"] {
        let t = template(pool.path(), fstype);
        let a = pool.path().join(format!("a-{fstype}.img"));
        let b = pool.path().join(format!("b-{fstype}.img"));
        // One copy made by `clone_template` (its UUID written as whole pages
        // read from the template), one reflinked and then changed in place.
        for copy in [&a, &b] {
            let uuid = random_uuid();
            if copy == &a {
                clone_template(&t, copy, fstype, uuid, &[]).unwrap();
            } else {
                file::reflink(&t, copy).unwrap();
                assert!(!carries_uuid(copy, fstype, uuid).unwrap(), "{fstype}");
                renew_uuid(copy, fstype, uuid).unwrap();
            }
            assert!(carries_uuid(copy, fstype, uuid).unwrap(), "{fstype}");
            assert!(
                !carries_uuid(copy, fstype, random_uuid()).unwrap(),
                "{fstype}"
            );
            // A copy is no longer a fresh template: a second change is refused
            // where the filesystem records the first.
            if fstype != "ext4" {
                assert!(renew_uuid(copy, fstype, [1; 16]).is_err(), "{fstype}");
            }
            fsck_ok(fstype, copy);
        }
        let (ut, ua, ub) = (blkid_uuid(&t), blkid_uuid(&a), blkid_uuid(&b));
        assert!(
            !ut.is_empty() && ut != ua && ua != ub && ut != ub,
            "{ut} {ua} {ub}"
        );
        let hex: String = read_uuid(&a, fstype)
            .unwrap()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hex, ua.replace('-', ""));

        // Two copies mounted side by side, no nouuid.
        let (db, da) = (
            Attached::new(&b, LoopOptions::default()),
            Attached::new(&a, LoopOptions::default()),
        );
        let (mb, ma) = (
            mountpoint(pool.path(), &format!("mb-{fstype}")),
            mountpoint(pool.path(), &format!("ma-{fstype}")),
        );
        let opts = MountOptions::default();
        LinuxMounter.mount(db.path(), &mb, fstype, &opts).unwrap();
        let gb = Mounted::guard(&mb);
        LinuxMounter.mount(da.path(), &ma, fstype, &opts).unwrap();
        let ga = Mounted::guard(&ma);
        std::fs::write(ma.join("kept"), vec![5u8; MIB as usize]).unwrap();
        sh("sync", &[]);
        if fstype == "xfs" {
            // A crash with the log to replay: the next mount recovers from
            // records carrying the new UUID.
            std::fs::write(ma.join("late"), b"x").unwrap();
            sh("xfs_io", &["-x", "-c", "shutdown", ma.to_str().unwrap()]);
        }
        drop(ga);
        drop(gb);
        LinuxMounter.mount(da.path(), &ma, fstype, &opts).unwrap();
        let ga = Mounted::guard(&ma);
        assert_eq!(
            std::fs::read(ma.join("kept")).unwrap(),
            vec![5u8; MIB as usize]
        );
        drop(ga);
        drop(da);
        drop(db);
        fsck_ok(fstype, &a);
        fsck_ok(fstype, &b);
        // The copies' changes never reach the template's blocks.
        check_template(&t, fstype).unwrap();
    }
}

/// A copy of which only some UUID writes were kept is not taken for one that
/// has its UUID; emptied, it holds no filesystem and keeps its length.
#[test]
#[ignore = "needs root: mkfs, loop devices and mounts"]
fn root_a_copy_with_part_of_its_uuid_is_told_and_discarded() {
    require_root();
    let pool = LoopMountedPool::new("xfs", 2048 * MIB);
    for fstype in ["ext4", "xfs", "btrfs"] {
        let t = template(pool.path(), fstype);
        let copy = pool.path().join(format!("c-{fstype}.img"));
        file::reflink(&t, &copy).unwrap();
        let uuid = random_uuid();
        renew_uuid(&copy, fstype, uuid).unwrap();
        // The template's first superblock back, as if that write were lost.
        let mut head = vec![0u8; 128 << 10];
        std::fs::File::open(&t)
            .unwrap()
            .read_exact_at(&mut head, 0)
            .unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&copy)
            .unwrap()
            .write_all_at(&head, 0)
            .unwrap();
        assert!(!carries_uuid(&copy, fstype, uuid).unwrap(), "{fstype}");
        discard(&copy).unwrap();
        assert_eq!(std::fs::metadata(&copy).unwrap().len(), 512 * MIB);
        let mut now = vec![1u8; 128 << 10];
        std::fs::File::open(&copy)
            .unwrap()
            .read_exact_at(&mut now, 0)
            .unwrap();
        assert!(now.iter().all(|&b| b == 0), "{fstype}: emptied");
        // The blocks are punched out; xfs may keep a few of the copy-on-write
        // reservations the UUID's writes made until its background collection.
        let left = file::allocated_bytes(&copy).unwrap();
        assert!(left <= MIB, "{fstype}: {left} bytes still allocated");
        assert!(!carries_uuid(&copy, fstype, uuid).unwrap(), "{fstype}");
    }
}
