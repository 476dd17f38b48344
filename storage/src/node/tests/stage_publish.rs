//! Stage, publish, unpublish and unstage: each done once however often it is
//! asked, undone when it fails part way, and never touching what is not the
//! volume's.

use csi_sys::fake::FakeOp;
use std::path::{Path, PathBuf};

use csi_sys::{LoopOptions, MountOptions};

use crate::ids::VolumeId;
use crate::model::*;
use crate::testkit::*;
use crate::volumes::MIB;

#[test]
fn second_publish_to_the_same_target_mounts_once() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let t = w.target("t1");
    w.publish(&id, &t, &ext4(), false).unwrap();
    w.publish(&id, &t, &ext4(), false).unwrap();
    assert_eq!(w.fake.counters().bind, 1, "the retry does not bind again");
    assert_eq!(w.mounts_at(&t), 1);
    // A retry with another readonly is a conflict, not a second mount.
    assert_eq!(kind(w.publish(&id, &t, &ext4(), true)), Kind::AlreadyExists);
    assert_eq!(w.mounts_at(&t), 1);
}

#[test]
fn second_stage_mounts_once_and_formats_once() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    w.stage(&id, &ext4()).unwrap();
    let c = w.fake.counters();
    assert_eq!((c.attach, c.mkfs, c.mount), (1, 1, 1));
    assert_eq!(w.mounts_at(&w.staging()), 1);
}

#[test]
fn unpublish_of_a_path_not_mounted_succeeds_without_unmounting() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let t = w.target("never-published");
    w.n().node_unpublish(&id, &t.display().to_string()).unwrap();
    // Twice: unpublish is idempotent.
    w.n().node_unpublish(&id, &t.display().to_string()).unwrap();
    // A volume that does not exist at all is fine too.
    let gone = VolumeId::for_name("never-created").to_string();
    w.n()
        .node_unpublish(&gone, &t.display().to_string())
        .unwrap();
    assert_eq!(w.fake.counters().unmount, 0);
}

#[test]
fn unpublish_unmounts_a_published_target_and_removes_it() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let t = w.target("t1");
    w.publish(&id, &t, &ext4(), false).unwrap();
    w.n().node_unpublish(&id, &t.display().to_string()).unwrap();
    assert_eq!(w.fake.counters().unmount, 1);
    assert_eq!(w.mounts_at(&t), 0);
    assert!(!t.exists(), "the target directory publish made is removed");
    assert!(w.node_record(&id).unwrap().targets.is_empty());
}

#[test]
fn unstage_skips_an_unmounted_staging_path_and_detaches_the_loop_device() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    // Someone (a reboot, an admin) unmounted the staging path behind our back.
    w.sys.mounter.unmount(&w.staging()).unwrap();
    let before = w.fake.counters();
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();
    let after = w.fake.counters();
    assert_eq!(after.unmount, before.unmount, "nothing to unmount");
    assert_eq!(after.detach, before.detach + 1);
    assert!(w.fake.loops().is_empty());
    assert!(w.node_record(&id).is_none());
    // Again: nothing left to do, and still success.
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();
    assert_eq!(w.fake.counters().detach, after.detach);
}

#[test]
fn unstage_refuses_while_a_target_is_still_published() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let t = w.target("t1");
    w.publish(&id, &t, &ext4(), false).unwrap();
    let err = w.n().node_unstage(&id, &w.staging().display().to_string());
    assert_eq!(kind(err), Kind::FailedPrecondition);
    assert_eq!(w.fake.counters().unmount, 0);
    assert_eq!(w.fake.loops().len(), 1);
}

#[test]
fn a_filesystem_already_on_the_device_is_never_reformatted() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    // A previous life of this volume made the filesystem.
    let (image, _) = w.format_image(&id, "ext4", 0);

    // A request for another filesystem is refused, and nothing is formatted.
    let err = w.stage(&id, &mount_cap("xfs", AccessMode::SingleNodeWriter));
    assert_eq!(kind(err), Kind::InvalidArgument);
    assert_eq!(w.fake.counters().mkfs, 0);
    assert_eq!(w.fake.counters().mount, 0);
    assert_eq!(w.fake.filesystem(&image).unwrap().fstype, "ext4");

    // The right one (or none named) mounts what is there, after a check.
    w.stage(&id, &ext4()).unwrap();
    let c = w.fake.counters();
    assert_eq!(c.mkfs, 0);
    assert_eq!(c.check, 1);
    assert_eq!(c.mount, 1);
    assert_eq!(w.node_record(&id).unwrap().fs_type.as_deref(), Some("ext4"));
}

#[test]
fn a_filesystem_smaller_than_its_device_is_grown_not_remade() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    // The controller grew the image while the volume was not staged.
    let (image, size) = w.format_image(&id, "ext4", 16 * MIB);
    w.stage(&id, &ext4()).unwrap();
    let c = w.fake.counters();
    assert_eq!((c.mkfs, c.grow), (0, 1));
    assert_eq!(w.fake.filesystem(&image).unwrap().size, size);
}

#[test]
fn stage_reuses_an_attached_loop_device() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let image = w.image(&id);
    // Attached by an earlier stage that crashed before it recorded anything.
    let dev = w.sys.loops.attach(&image, LoopOptions::default()).unwrap();
    w.stage(&id, &ext4()).unwrap();
    assert_eq!(w.fake.counters().attach, 1, "no second attach");
    assert_eq!(w.fake.loops().len(), 1);
    let m = w
        .fake
        .mounts()
        .into_iter()
        .find(|m| m.mount_point == w.staging())
        .unwrap();
    assert_eq!(Path::new(&m.source), dev.device);
}

#[test]
fn a_read_only_loop_device_is_not_reused_for_staging() {
    let w = World::new();
    let id = w.create("pvc-a", block());
    let image = w.image(&id);
    w.sys
        .loops
        .attach(
            &image,
            LoopOptions {
                read_only: true,
                direct_io: false,
            },
        )
        .unwrap();
    w.stage(&id, &block()).unwrap();
    let loops = w.fake.loops();
    assert_eq!(loops.len(), 2);
    assert_eq!(loops.iter().filter(|d| !d.read_only).count(), 1);
}

#[test]
fn something_else_mounted_at_a_target_is_left_alone() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let t = w.target("foreign");
    std::fs::create_dir(&t).unwrap();
    w.fake.set_filesystem(Path::new("/dev/vdz"), "xfs", 1 << 30);
    w.sys
        .mounter
        .mount(Path::new("/dev/vdz"), &t, "xfs", &MountOptions::default())
        .unwrap();
    let before = w.fake.counters();

    assert_eq!(
        kind(w.publish(&id, &t, &ext4(), false)),
        Kind::AlreadyExists
    );
    assert_eq!(
        kind(w.n().node_unpublish(&id, &t.display().to_string())),
        Kind::FailedPrecondition
    );
    // Not even a volume of ours: NOT_FOUND, and the mount stays.
    let gone = VolumeId::for_name("never-created").to_string();
    assert_eq!(
        kind(w.n().node_unpublish(&gone, &t.display().to_string())),
        Kind::NotFound
    );
    let after = w.fake.counters();
    assert_eq!((after.bind, after.unmount), (before.bind, before.unmount));
    assert_eq!(w.mounts_at(&t), 1);
    assert!(t.is_dir());
}

#[test]
fn something_else_mounted_at_the_staging_path_is_left_alone() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    std::fs::create_dir(w.staging()).unwrap();
    w.fake.set_filesystem(Path::new("/dev/vdz"), "xfs", 1 << 30);
    w.sys
        .mounter
        .mount(
            Path::new("/dev/vdz"),
            &w.staging(),
            "xfs",
            &MountOptions::default(),
        )
        .unwrap();
    assert_eq!(kind(w.stage(&id, &ext4())), Kind::AlreadyExists);
    assert_eq!(w.fake.counters().mkfs, 0);
    assert_eq!(
        kind(w.n().node_unstage(&id, &w.staging().display().to_string())),
        Kind::FailedPrecondition
    );
    assert_eq!(w.fake.counters().unmount, 0);
    assert_eq!(w.mounts_at(&w.staging()), 1);
}

#[test]
fn single_node_single_writer_refuses_a_second_writer() {
    let w = World::new();
    let cap = mount_cap("ext4", AccessMode::SingleNodeSingleWriter);
    let id = w.create("pvc-a", cap.clone());
    w.stage(&id, &cap).unwrap();
    let (t1, t2, t3) = (w.target("t1"), w.target("t2"), w.target("t3"));
    w.publish(&id, &t1, &cap, false).unwrap();
    assert_eq!(
        kind(w.publish(&id, &t2, &cap, false)),
        Kind::FailedPrecondition
    );
    assert_eq!(w.mounts_at(&t2), 0);
    assert!(!w.node_record(&id).unwrap().targets.contains_key(&t2));
    // A reader is no writer.
    w.publish(&id, &t3, &cap, true).unwrap();
    // Once the writer is gone, another may come.
    w.n()
        .node_unpublish(&id, &t1.display().to_string())
        .unwrap();
    w.publish(&id, &t2, &cap, false).unwrap();
    assert_eq!(w.mounts_at(&t2), 1);
}

#[test]
fn single_node_writer_allows_two_writers() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    w.publish(&id, &w.target("t2"), &ext4(), false).unwrap();
    assert_eq!(w.fake.counters().bind, 2);
}

#[test]
fn a_failed_first_stage_is_undone_and_a_retry_completes() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.fake.fail_next(FakeOp::Mount, eio("mount"));
    assert_eq!(kind(w.stage(&id, &ext4())), Kind::System);
    // A failed (not crashed) first stage leaves nothing: no record, no device.
    assert!(
        w.node_record(&id).is_none(),
        "the failed stage's record is removed"
    );
    assert_eq!(w.mounts_at(&w.staging()), 0);
    assert_eq!(w.fake.counters().detach, 1, "its loop device is detached");

    w.stage(&id, &ext4()).unwrap();
    let c = w.fake.counters();
    assert_eq!(
        c.mkfs, 1,
        "the retry finds the filesystem the first try made"
    );
    assert_eq!(c.attach, 2, "the retry attaches again");
    assert_eq!(c.mount, 2);
    assert_eq!(w.mounts_at(&w.staging()), 1);
    assert_eq!(w.node_record(&id).unwrap().fs_type.as_deref(), Some("ext4"));
}

#[test]
fn a_failed_bind_at_publish_is_retried_to_one_mount() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let t = w.target("t1");
    w.fake.fail_next(FakeOp::Bind, eio("bind"));
    assert_eq!(kind(w.publish(&id, &t, &ext4(), false)), Kind::System);
    assert!(w.node_record(&id).unwrap().targets.contains_key(&t));
    w.publish(&id, &t, &ext4(), false).unwrap();
    assert_eq!(w.mounts_at(&t), 1);
}

#[test]
fn a_failed_detach_at_unstage_keeps_the_record_for_the_retry() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    w.fake.fail_next(FakeOp::Detach, eio("detach"));
    let staging = w.staging().display().to_string();
    assert_eq!(kind(w.n().node_unstage(&id, &staging)), Kind::System);
    assert!(w.node_record(&id).is_some());
    w.n().node_unstage(&id, &staging).unwrap();
    assert!(w.fake.loops().is_empty());
    assert!(w.node_record(&id).is_none());
}

#[test]
fn publish_before_stage_is_failed_precondition() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    assert_eq!(
        kind(w.publish(&id, &w.target("t1"), &ext4(), false)),
        Kind::FailedPrecondition
    );
    assert_eq!(w.fake.counters().bind, 0);
}

#[test]
fn paths_inside_the_driver_or_the_system_are_refused() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let inside_pool = w.tmp.path().join("pool").join("x");
    let inside_state = w.state_dir().join("x");
    for bad in [
        inside_pool,
        inside_state,
        PathBuf::from("/etc/x"),
        PathBuf::from("relative"),
        w.tmp.path().join("pods/../x"),
    ] {
        assert_eq!(
            kind(w.publish(&id, &bad, &ext4(), false)),
            Kind::InvalidArgument,
            "{}",
            bad.display()
        );
    }
    assert_eq!(w.fake.counters().bind, 0);
}

#[test]
fn a_stage_whose_context_names_an_unknown_filesystem_is_refused_before_anything_is_done() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let stage = |fs: &str| {
        w.n().node_stage(crate::node::Stage {
            volume_id: id.clone(),
            staging_path: w.staging().display().to_string(),
            capability: Some(mount_cap("", AccessMode::SingleNodeWriter)),
            volume_context: [("fsType".to_string(), fs.to_string())].into(),
        })
    };
    for bad in ["fz-2", "128", "ext4 ", "../xfs"] {
        assert_eq!(kind(stage(bad)), Kind::InvalidArgument, "{bad:?}");
    }
    let c = w.fake.counters();
    assert_eq!((c.attach, c.mkfs, c.mount), (0, 0, 0));
    assert!(w.node_record(&id).is_none(), "nothing recorded as staged");
    // An empty name names nothing: the stage takes the volume's own.
    stage("").unwrap();
    assert_eq!(w.mounts_at(&w.staging()), 1);
}

/// The kubelet's SELinux context (CSIDriver seLinuxMount): the stage mounts
/// the filesystem with it, the publish binds what is staged (a bind takes no
/// filesystem options); a flag that only looks like a context is refused.
#[test]
fn an_selinux_context_labels_the_staged_filesystem() {
    let w = World::new();
    let context = r#"context="system_u:object_r:container_file_t:s0:c0,c1""#;
    let with = |flags: &[&str]| Capability {
        access: Access::Mount {
            fs_type: "ext4".into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            volume_mount_group: String::new(),
        },
        mode: AccessMode::SingleNodeWriter,
    };
    let cap = with(&["noatime", context]);
    let id = w.create("pvc-a", cap.clone());
    w.stage(&id, &cap).unwrap();
    let staged = w
        .fake
        .mounts()
        .into_iter()
        .find(|m| m.mount_point == w.staging())
        .unwrap();
    assert!(
        staged.super_options.iter().any(|o| o == context),
        "{:?}",
        staged.super_options
    );
    let t = w.target("t1");
    w.publish(&id, &t, &cap, false).unwrap();
    assert_eq!(w.mounts_at(&t), 1);

    for bad in [
        r#"context="system_u:object_r:t:s0:c0",nosuid"#,
        r#"context="system_u:object_r:t:s0:c0,suid=x""#,
        r#"context="a:b:c""#,
        r#"context="system_u:object_r:t:s0:c0.x""#,
        r#"fscontext="system_u:object_r:t:s0""#,
    ] {
        assert_eq!(
            kind(w.stage(&id, &with(&[bad]))),
            Kind::InvalidArgument,
            "{bad}"
        );
    }
}
