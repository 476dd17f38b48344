//! Freezing around snapshots: a staged image is frozen for its copy and always
//! thawed, by this process or by its next start.

use csi_sys::fake::FakeOp;
use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::ids::{SnapshotId, VolumeId};
use crate::testkit::*;

#[test]
fn a_snapshot_of_a_staged_image_freezes_and_thaws() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let snap = w
        .c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    let c = w.fake.counters();
    assert_eq!((c.freeze, c.thaw), (1, 1));
    assert!(!w.fake.is_frozen(&w.staging()));
    assert_eq!(w.pool_files("snapshots"), vec![format!("{}.img", snap.id)]);
    let markers = std::fs::read_dir(w.state_dir().join("shared/frozen"))
        .unwrap()
        .count();
    assert_eq!(markers, 0, "the freeze marker is removed after the thaw");
}

#[test]
fn a_snapshot_of_an_unstaged_image_freezes_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    let c = w.fake.counters();
    assert_eq!((c.freeze, c.thaw), (0, 0));
}

#[test]
fn a_failed_snapshot_copy_still_thaws() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    // The copy cannot create its destination: something is in its way.
    let sid = SnapshotId::for_name("snap-1");
    let blocker = w
        .tmp
        .path()
        .join("pool/snapshots")
        .join(format!("{sid}.img"));
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("f"), b"x").unwrap();

    let err = w.c().create_snapshot("snap-1", &id, &BTreeMap::new());
    assert_eq!(kind(err), Kind::System);
    let c = w.fake.counters();
    assert_eq!((c.freeze, c.thaw), (1, 1));
    assert!(!w.fake.is_frozen(&w.staging()));
    assert!(w.c().get_snapshot(&sid.to_string()).is_err());
    let markers = std::fs::read_dir(w.state_dir().join("shared/frozen"))
        .unwrap()
        .count();
    assert_eq!(markers, 0);

    // Nothing is stuck: the retry succeeds and freezes and thaws again.
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert!(!w.fake.is_frozen(&w.staging()));
    assert_eq!(w.fake.counters().thaw, 2);
}

#[test]
fn a_failed_freeze_copies_nothing_and_leaves_nothing_frozen() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    w.fake.fail_next(FakeOp::Freeze, eio("freeze"));
    let err = w.c().create_snapshot("snap-1", &id, &BTreeMap::new());
    assert_eq!(kind(err), Kind::System);
    assert!(!w.fake.is_frozen(&w.staging()));
    assert!(w.pool_files("snapshots").is_empty());
    assert_eq!(w.c().snapshot_count(), 0);
}

#[test]
fn a_failed_thaw_keeps_the_marker_and_the_next_start_thaws() {
    let mut w = World::new();
    let id = w.create_staged("pvc-a");
    // Every try fails (the thaw is tried four times).
    for _ in 0..4 {
        w.fake.fail_next(FakeOp::Thaw, eio("thaw"));
    }
    // The snapshot itself is made; the thaw failure is logged.
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert!(w.fake.is_frozen(&w.staging()));
    let markers = std::fs::read_dir(w.state_dir().join("shared/frozen"))
        .unwrap()
        .count();
    assert_eq!(markers, 1, "the marker stays for the next start");
    w.reopen();
    assert!(!w.fake.is_frozen(&w.staging()));
    let markers = std::fs::read_dir(w.state_dir().join("shared/frozen"))
        .unwrap()
        .count();
    assert_eq!(markers, 0);
}

#[test]
fn a_call_whose_caller_left_undoes_its_intent_and_freezes_nothing() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let token = crate::cancel::Token::new();
    token.cancel();
    let err = token.run(|| w.c().create_snapshot("snap-1", &id, &BTreeMap::new()));
    assert_eq!(kind(err), Kind::Cancelled);
    assert!(!w.fake.is_frozen(&w.staging()));
    assert!(w.pool_files("snapshots").is_empty());
    assert_eq!(w.c().snapshot_count(), 0);
    // The retry of a live caller goes through.
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
}

#[test]
fn a_thaw_that_fails_once_is_tried_again() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    w.fake.fail_next(FakeOp::Thaw, eio("thaw"));
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert!(!w.fake.is_frozen(&w.staging()));
    assert!(w
        .state_dir()
        .join("shared/frozen")
        .read_dir()
        .unwrap()
        .next()
        .is_none());
}

#[test]
fn a_freeze_marker_left_by_a_crash_is_thawed_at_open() {
    let mut w = World::new();
    let id = w.create_staged("pvc-a");
    // A crash between freeze and thaw: frozen, and the marker written before it.
    w.sys.fs.freeze(&w.staging()).unwrap();
    let dir = w.state_dir().join("shared/frozen");
    let marker = |mp: PathBuf| {
        serde_json::to_vec(&crate::state::FreezeMarker {
            owner: crate::state::Domain::Controller,
            pid: 1,
            volumes: vec![VolumeId::parse(&id).unwrap()],
            mountpoints: vec![mp],
        })
        .unwrap()
    };
    std::fs::write(dir.join(format!("{id}.json")), marker(w.staging())).unwrap();
    // A marker naming a path that is no longer mounted does not stop the start.
    std::fs::write(dir.join("other.json"), marker(w.tmp.path().join("gone"))).unwrap();

    w.reopen();
    assert!(!w.fake.is_frozen(&w.staging()));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    assert!(w.d().probe().unwrap());
}

#[test]
fn snapshot_class_parameters_the_driver_does_not_use_are_ignored() {
    let w = World::new();
    let a = w.create("pvc-a", ext4());
    let b = w.create("pvc-b", ext4());
    // What Kubernetes' storage suite puts in a (group) snapshot class.
    let params = BTreeMap::from([("deletionPolicy".to_string(), "Delete".to_string())]);
    let snap = w.c().create_snapshot("snap-1", &a, &params).unwrap();
    assert_eq!(
        w.c().create_snapshot("snap-1", &a, &params).unwrap().id,
        snap.id
    );
    let group = w
        .c()
        .create_group_snapshot("group-1", &[a.clone(), b.clone()], &params)
        .unwrap();
    assert_eq!(group.members.len(), 2);
}
