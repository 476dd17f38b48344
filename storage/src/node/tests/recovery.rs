//! The start-up check of the node: mounts and loop devices of the pools that no
//! staged volume accounts for are reported, and removed only when asked.

use std::path::{Path, PathBuf};

use csi_sys::{LoopOptions, MountOptions};

use crate::ids::VolumeId;
use crate::model::*;
use crate::testkit::*;
use crate::volumes::MIB;

/// Stages and publishes a volume, then forgets the node record, as if the state
/// dir had been lost; returns the id and the target.
fn orphaned(w: &World) -> (String, PathBuf) {
    let id = w.create_staged("pvc-a");
    let t = w.target("t1");
    w.publish(&id, &t, &ext4(), false).unwrap();
    w.n()
        .node_records
        .remove(VolumeId::parse(&id).unwrap())
        .unwrap();
    (id, t)
}

#[test]
fn orphan_mounts_are_only_reported_by_default() {
    let mut w = World::new();
    let (_id, t) = orphaned(&w);
    let before = w.fake.counters();
    w.reopen();
    let after = w.fake.counters();
    assert_eq!(
        (after.unmount, after.detach),
        (before.unmount, before.detach)
    );
    assert_eq!(w.mounts_at(&t), 1);
    assert_eq!(w.mounts_at(&w.staging()), 1);
    assert_eq!(w.fake.loops().len(), 1);
}

#[test]
fn orphan_mounts_and_loop_devices_are_cleaned_when_asked() {
    let mut w = World::new();
    let (id, t) = orphaned(&w);
    // A foreign mount and a foreign loop device are never touched.
    let foreign = w.target("foreign");
    w.fake.set_filesystem(Path::new("/dev/vdz"), "xfs", 1 << 30);
    w.sys
        .mounter
        .mount(
            Path::new("/dev/vdz"),
            &foreign,
            "xfs",
            &MountOptions::default(),
        )
        .unwrap();
    let outside = w.tmp.path().join("outside.img");
    csi_sys::file::create_sparse(&outside, 16 * MIB).unwrap();
    w.sys
        .loops
        .attach(&outside, LoopOptions::default())
        .unwrap();

    let outside = std::fs::canonicalize(&outside).unwrap();

    w.reopen_with(|c| c.cleanup_orphans = true);
    assert_eq!(w.mounts_at(&t), 0);
    assert_eq!(w.mounts_at(&w.staging()), 0);
    assert_eq!(w.mounts_at(&foreign), 1);
    let loops = w.fake.loops();
    assert_eq!(loops.len(), 1);
    assert_eq!(loops[0].backing_file, outside);
    // The volume itself is kept, and can be staged again.
    assert_eq!(w.pool_files("volumes"), vec![format!("{id}.img")]);
    w.stage(&id, &ext4()).unwrap();
    assert_eq!(w.fake.counters().mkfs, 1, "its filesystem is found again");
}

#[test]
fn a_staged_volume_is_no_orphan() {
    let mut w = World::with(|c| c.cleanup_orphans = true);
    let id = w.create_staged("pvc-a");
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    let before = w.fake.counters();
    w.reopen_with(|c| c.cleanup_orphans = true);
    let after = w.fake.counters();
    assert_eq!(
        (after.unmount, after.detach),
        (before.unmount, before.detach)
    );
}

#[test]
fn a_stage_refused_for_its_fs_type_changes_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.format_image(&id, "ext4", 0);
    let err = w.stage(&id, &mount_cap("xfs", AccessMode::SingleNodeWriter));
    assert_eq!(kind(err), Kind::InvalidArgument);
    assert!(w.fake.loops().is_empty(), "no loop device is left attached");
    assert!(w.node_record(&id).is_none(), "no node record is left");
    // Bad input changed nothing: the volume can still be deleted.
    w.c().delete_volume(&id).unwrap();
}
