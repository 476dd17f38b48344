//! The records across a restart of the process.

use std::collections::BTreeMap;

use crate::testkit::*;
use crate::volumes::MIB;

#[test]
fn records_survive_a_reopen() {
    let mut w = World::new();
    let mut req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    req.mutable_parameters = params(&[("readAheadKiB", "512")]);
    let made = w.c().create_volume(req).unwrap();
    let id = made.id.to_string();
    w.stage(&id, &ext4()).unwrap();
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    let snap = w
        .c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    let node_before = w.node_record(&id).unwrap();

    w.reopen();
    assert_eq!(w.c().get_volume(&id).unwrap(), made);
    assert_eq!(w.c().get_snapshot(&snap.id.to_string()).unwrap(), snap);
    assert_eq!(w.node_record(&id).unwrap(), node_before);
    // The reopened driver carries on where the first left off: nothing redone.
    let before = w.fake.counters();
    w.stage(&id, &ext4()).unwrap();
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    let after = w.fake.counters();
    assert_eq!(
        (after.mount, after.bind, after.mkfs, after.attach),
        (before.mount, before.bind, before.mkfs, before.attach)
    );
    assert_eq!(w.pool_files("volumes"), vec![format!("{id}.img")]);
}

/// A snapshot is recorded once its data is there, with no record before: data a
/// crash left in the copy is removed by the next start, or by a retry that comes
/// first, and the snapshot the retry makes holds the volume's data.
#[test]
fn snapshot_data_a_crash_left_without_a_record_is_removed_by_the_start_or_the_retry() {
    let mut w = World::new();
    let id = w.create("pvc-a", ext4()).to_string();
    let image = w.tmp.path().join("pool/volumes").join(format!("{id}.img"));
    std::fs::write(&image, b"the volume's data").unwrap();
    let sid = crate::ids::SnapshotId::for_name("snap-1");
    let left = w
        .tmp
        .path()
        .join("pool/snapshots")
        .join(format!("{sid}.img"));

    // Left by a crash, then a start: gone.
    std::fs::write(&left, b"torn").unwrap();
    w.reopen();
    assert!(w.pool_files("snapshots").is_empty());

    // Left by a crash, and the retry comes first (as in the same process after
    // a failed copy): replaced by the volume's data.
    std::fs::write(&left, b"torn").unwrap();
    let snap = w
        .c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert_eq!(snap.id, sid);
    assert_eq!(std::fs::read(&left).unwrap(), b"the volume's data");
    w.reopen();
    assert_eq!(w.c().get_snapshot(&sid.to_string()).unwrap(), snap);
}

#[test]
fn an_unreadable_record_is_set_aside_and_its_data_kept() {
    let mut w = World::new();
    let id = w.create("pvc-a", ext4());
    let path = w
        .state_dir()
        .join("controller/volumes")
        .join(format!("{id}.json"));
    std::fs::write(&path, b"{ not json").unwrap();
    w.reopen();
    assert_eq!(w.pool_files("volumes"), vec![format!("{id}.img")]);
    assert!(path.with_extension("corrupt").exists());
    assert_eq!(kind(w.c().get_volume(&id)), Kind::NotFound);
}

#[test]
fn a_restart_removes_the_lock_files_of_gone_volumes_only() {
    let mut w = World::new();
    let live = w.create("pvc-live", ext4());
    let staged = w.create("pvc-staged", ext4());
    w.stage(&staged, &ext4()).unwrap();
    let locks = w.state_dir().join("shared/locks");
    // What a crash of a delete between its record and its lock leaves.
    let gone = crate::ids::VolumeId::for_name("pvc-gone").to_string();
    std::fs::write(locks.join(&gone), b"").unwrap();
    // A lock a running operation holds is never taken from it.
    let held = crate::ids::VolumeId::for_name("pvc-held").to_string();
    let holder = csi_sys::flock::LockFile::try_exclusive(&locks.join(&held))
        .unwrap()
        .unwrap();
    w.reopen();
    w.c().settle();
    let mut left: Vec<String> = std::fs::read_dir(&locks)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !csi_sys::flock::is_spare(name))
        .collect();
    left.sort();
    let mut want = vec![live, staged, held];
    want.sort();
    assert_eq!(
        left, want,
        "only the gone volume's unheld lock file is removed"
    );
    drop(holder);
}

/// A deleted volume's lock file is kept as a spare; the next start takes it
/// into use with its sweep, and the next new volume's lock is that file.
#[test]
fn a_restart_takes_the_spare_lock_files_into_use() {
    use std::os::unix::fs::MetadataExt;
    let mut w = World::new();
    let locks = w.state_dir().join("shared/locks");
    let old = w.create("pvc-old", ext4());
    let inode = std::fs::metadata(locks.join(&old)).unwrap().ino();
    w.c().delete_volume(&old).unwrap();
    let spares: Vec<_> = std::fs::read_dir(&locks).unwrap().flatten().collect();
    assert_eq!(spares.len(), 1);
    assert!(csi_sys::flock::is_spare(
        &spares[0].file_name().to_string_lossy()
    ));
    w.reopen();
    w.c().settle();
    let new = w.create("pvc-new", ext4());
    assert_eq!(std::fs::metadata(locks.join(&new)).unwrap().ino(), inode);
    assert_eq!(std::fs::read_dir(&locks).unwrap().count(), 1);
}

#[test]
fn a_lock_listed_as_gone_is_kept_when_its_volume_is_made_before_the_sweep_takes_it() {
    let w = World::new();
    let locks = w.state_dir().join("shared/locks");
    let id = crate::ids::VolumeId::for_name("pvc-late");
    let c = w.c();
    // The start's own sweep ends first: it would remove the file made below.
    c.settle();
    std::fs::write(locks.join(id.to_string()), b"").unwrap();
    // Listed as gone, then made by a CreateVolume before the sweep gets to it.
    let gone = crate::controller::gone_volume_locks(c, &c.volumes);
    assert_eq!(gone, vec![id]);
    let made = w.create("pvc-late", ext4());
    assert_eq!(made, id.to_string());
    crate::controller::remove_volume_locks(c, &c.volumes, &gone);
    assert!(
        locks.join(&made).exists(),
        "the new volume keeps its lock file"
    );
    // Gone for real: removed.
    w.c().delete_volume(&made).unwrap();
    std::fs::write(locks.join(&made), b"").unwrap();
    crate::controller::remove_volume_locks(c, &c.volumes, &gone);
    assert!(!locks.join(&made).exists());
}

#[test]
fn a_call_that_meets_a_lock_the_sweep_holds_waits_for_it_instead_of_aborting() {
    let w = World::new();
    let id = crate::ids::VolumeId::for_name("pvc-swept");
    let c = w.c();
    // The start-up's own sweep ends first: meeting the lock file made below, it
    // would try the lock too and end its claim, ending the create's wait early.
    c.settle();
    let released = std::sync::atomic::AtomicBool::new(false);
    let swept = c.state.sweep_lock_volume(id).unwrap().unwrap();
    std::thread::scope(|s| {
        let call = s.spawn(|| {
            let made = w.create("pvc-swept", ext4());
            (made, released.load(std::sync::atomic::Ordering::SeqCst))
        });
        // Let go only once the create waits on the sweep, so the order is forced.
        let began = std::time::Instant::now();
        while c.state.sweep_waiters() == 0 {
            assert!(
                began.elapsed() < std::time::Duration::from_secs(30),
                "the create never waited on the sweep"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        released.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(swept);
        let (made, after) = call.join().unwrap();
        assert_eq!(made, id.to_string());
        assert!(
            after,
            "the create went on only once the sweep let the lock go"
        );
    });
    // Another operation's hold is still ABORTED at once.
    let other = c.state.lock_volume(id).unwrap();
    assert_eq!(kind(c.delete_volume(&id.to_string())), Kind::Aborted);
    drop(other);
}

/// New images are not synced, so a power loss may take them; it always brings
/// a new boot. A start after one makes again what it took; a start in the boot
/// that made them (a restart of the process) has nothing to look for.
#[test]
fn new_images_are_looked_over_on_the_first_start_of_a_boot_only() {
    let mut w = World::new();
    let id = w.create("pvc-fresh", ext4());
    let size = w.c().get_volume(&id).unwrap().size;
    let image = w.tmp.path().join("pool/volumes").join(format!("{id}.img"));
    // All a power loss can take of an image never synced.
    std::fs::remove_file(&image).unwrap();
    w.reopen();
    assert!(
        !image.exists(),
        "a restart in the same boot looks at nothing"
    );
    w.sys.boot_id = "the next boot".into();
    w.reopen();
    assert_eq!(std::fs::metadata(&image).unwrap().len(), size);
    // Looked over once in this boot: taken again, it is not made again.
    std::fs::remove_file(&image).unwrap();
    w.reopen();
    assert!(!image.exists());
}
