//! Freezing around snapshots: a staged image is frozen for its copy and always
//! thawed, by this process or by its next start.

use csi_sys::fake::FakeOp;
use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::ids::SnapshotId;
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
    // The copy cannot read its source: the image is moved away for the first try.
    let sid = SnapshotId::for_name("snap-1");
    let image = w.tmp.path().join("pool/volumes").join(format!("{id}.img"));
    let aside = w.tmp.path().join("aside.img");
    std::fs::rename(&image, &aside).unwrap();

    let err = w.c().create_snapshot("snap-1", &id, &BTreeMap::new());
    assert_eq!(kind(err), Kind::System);
    assert!(w.pool_files("snapshots").is_empty());
    std::fs::rename(&aside, &image).unwrap();
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
    let marker = |mp: PathBuf| controller_freeze_marker(&id, mp, false);
    std::fs::write(dir.join(format!("{id}.json")), marker(w.staging())).unwrap();
    // A marker naming a path that is no longer mounted does not stop the start.
    std::fs::write(dir.join("other.json"), marker(w.tmp.path().join("gone"))).unwrap();
    // Markers are not synced: a power loss can leave one empty or torn. Removed.
    std::fs::write(dir.join("torn.json"), b"").unwrap();
    std::fs::write(dir.join("torn2.json"), &marker(w.staging())[..20]).unwrap();

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

#[test]
fn a_crash_consistent_snapshot_freezes_only_where_the_copy_takes_time() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let crash = |v: &str| BTreeMap::from([("consistency".to_string(), v.to_string())]);
    let snap = w
        .c()
        .create_snapshot("snap-1", &id, &crash("crash-consistent"))
        .unwrap();
    // A reflink is one instant's copy: no freeze. A plain copy takes time
    // and would be torn unfrozen: frozen all the same.
    let reflink = w.c().pool("default").unwrap().reflink;
    let c = w.fake.counters();
    let want = if reflink { (0, 0) } else { (1, 1) };
    assert_eq!((c.freeze, c.thaw), want, "reflink: {reflink}");
    assert_eq!(w.pool_files("snapshots"), vec![format!("{}.img", snap.id)]);
    // The default, and its name, freeze.
    w.c()
        .create_snapshot("snap-2", &id, &crash("frozen"))
        .unwrap();
    let c = w.fake.counters();
    assert_eq!((c.freeze, c.thaw), (want.0 + 1, want.1 + 1));

    // Another value is refused, and makes nothing.
    let err = w.c().create_snapshot("snap-3", &id, &crash("fast"));
    assert_eq!(kind(err), Kind::InvalidArgument);
    assert_eq!(w.pool_files("snapshots").len(), 2);
    // A group's members are consistent with each other only frozen.
    let err = w.c().create_group_snapshot(
        "group-1",
        std::slice::from_ref(&id),
        &crash("crash-consistent"),
    );
    assert_eq!(kind(err), Kind::InvalidArgument);
    assert_eq!(w.pool_files("snapshots").len(), 2);
}

/// A switch of expedited grace periods of the test's own, reading `value`.
fn rcu_knob(w: &World, value: &str) -> PathBuf {
    let knob = w.tmp.path().join("rcu_expedited");
    std::fs::write(&knob, value).unwrap();
    knob
}

fn knob_value(knob: &std::path::Path) -> String {
    std::fs::read_to_string(knob).unwrap().trim().to_string()
}

/// Restarts the driver on `knob` as its switch, with `--expedite-freeze` or not.
fn reopen_with_knob(w: &mut World, knob: &std::path::Path, expedite: bool) {
    let knob = knob.to_path_buf();
    w.reopen_with(|cfg| {
        cfg.expedite_freeze = expedite;
        cfg.rcu_expedited_knob = knob;
    });
}

/// Makes the fake's next FIFREEZE fail, and keeps what `look` sees at that
/// moment (the error is made while the freeze runs).
fn fail_next_freeze_seeing<T: Send + 'static>(
    w: &World,
    look: impl FnOnce() -> T + Send + 'static,
) -> std::sync::Arc<std::sync::Mutex<Option<T>>> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let s = seen.clone();
    w.fake.fail_next(FakeOp::Freeze, move || {
        *s.lock().unwrap() = Some(look());
        csi_sys::SysError::Unsupported {
            what: "freezing (test)".into(),
        }
    });
    seen
}

/// By default (the world's config is the driver's, on a switch of its own).
#[test]
fn an_expedited_freeze_raises_the_switch_for_the_freeze_only() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let knob = rcu_knob(&w, "0\n");
    let cfg = w.config();
    assert!(cfg.expedite_freeze && cfg.rcu_expedited_knob == knob);
    // What the switch and the marker say while FIFREEZE runs.
    let (k, frozen) = (knob.clone(), w.state_dir().join("shared/frozen"));
    let seen = fail_next_freeze_seeing(&w, move || {
        let marker = std::fs::read_dir(&frozen).unwrap().next().unwrap().unwrap();
        let marker: crate::state::FreezeMarker =
            serde_json::from_slice(&std::fs::read(marker.path()).unwrap()).unwrap();
        (knob_value(&k), marker.expedited)
    });
    assert!(w
        .c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .is_err());
    assert_eq!(
        seen.lock().unwrap().take(),
        Some(("1".to_string(), true)),
        "raised during FIFREEZE, and the marker says so first"
    );
    assert_eq!(knob_value(&knob), "0", "put back after a failed freeze");

    // A snapshot that succeeds puts it back too, and takes its copy.
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert_eq!(knob_value(&knob), "0");
    assert!(!w.fake.is_frozen(&w.staging()));
}

#[test]
fn a_switch_the_operator_raised_stays_raised_and_a_freeze_without_the_option_leaves_it() {
    let mut w = World::new();
    let id = w.create_staged("pvc-a");
    let knob = rcu_knob(&w, "1");
    reopen_with_knob(&mut w, &knob, true);
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert_eq!(knob_value(&knob), "1");

    std::fs::write(&knob, "0").unwrap();
    reopen_with_knob(&mut w, &knob, false);
    let k = knob.clone();
    let seen = fail_next_freeze_seeing(&w, move || knob_value(&k));
    assert!(w
        .c()
        .create_snapshot("snap-2", &id, &BTreeMap::new())
        .is_err());
    assert_eq!(seen.lock().unwrap().as_deref(), Some("0"));
}

#[test]
fn a_switch_a_crash_left_raised_is_put_back_at_the_next_start() {
    let mut w = World::new();
    let id = w.create_staged("pvc-a");
    let knob = rcu_knob(&w, "1");
    let dir = w.state_dir().join("shared/frozen");
    // A crash during a freeze, the switch raised: by the driver (the marker says
    // so: put back), or by someone else (left as it is). The next start need not
    // have the option.
    for (expedited, after) in [(true, "0"), (false, "1")] {
        std::fs::write(&knob, "1").unwrap();
        w.sys.fs.freeze(&w.staging()).unwrap();
        let body = controller_freeze_marker(&id, w.staging(), expedited);
        std::fs::write(dir.join(format!("{id}.json")), body).unwrap();
        reopen_with_knob(&mut w, &knob, false);
        assert_eq!(knob_value(&knob), after, "expedited: {expedited}");
        assert!(!w.fake.is_frozen(&w.staging()));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    }
}

#[test]
fn a_marker_of_an_earlier_version_reads_as_not_expedited() {
    let old = br#"{"owner":"controller","pid":7,"volumes":[],"mountpoints":["/m"]}"#;
    let m: crate::state::FreezeMarker = serde_json::from_slice(old).unwrap();
    assert!(!m.expedited);
    let written = serde_json::to_string(&m).unwrap();
    assert!(!written.contains("expedited"), "{written}");
}

/// The members of a group are frozen at once; when one freeze fails, the ones
/// that froze are thawed, nothing is copied, and a retry freezes and thaws all.
#[test]
fn a_group_whose_member_fails_to_freeze_leaves_nothing_frozen_and_copies_nothing() {
    let w = World::new();
    let stage_at = |name: &str| {
        let id = w.create(name, ext4());
        let staging = w.tmp.path().join(format!("staging-{name}"));
        w.n()
            .node_stage(crate::node::Stage {
                volume_id: id.clone(),
                staging_path: staging.display().to_string(),
                capability: Some(ext4()),
                volume_context: BTreeMap::new(),
            })
            .unwrap();
        (id, staging)
    };
    let (a, sa) = stage_at("pvc-a");
    let (b, sb) = stage_at("pvc-b");
    w.fake.fail_next(FakeOp::Freeze, eio("freeze"));
    let err = w
        .c()
        .create_group_snapshot("group-1", &[a.clone(), b.clone()], &BTreeMap::new());
    assert_eq!(kind(err), Kind::System);
    assert!(!w.fake.is_frozen(&sa) && !w.fake.is_frozen(&sb));
    let c = w.fake.counters();
    assert_eq!(
        (c.freeze, c.thaw),
        (2, 1),
        "both freezes tried, the member that froze thawed"
    );
    assert!(w.pool_files("snapshots").is_empty());
    assert_eq!(w.c().snapshot_count(), 0);

    let group = w
        .c()
        .create_group_snapshot("group-1", &[a, b], &BTreeMap::new())
        .unwrap();
    assert_eq!(group.members.len(), 2);
    assert!(!w.fake.is_frozen(&sa) && !w.fake.is_frozen(&sb));
    let c = w.fake.counters();
    assert_eq!((c.freeze, c.thaw), (4, 3));
}

#[test]
fn a_staged_image_covered_by_a_later_mount_is_frozen_through_a_path_that_leads_to_it() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    let target = w.target("t");
    w.publish(&id, &target, &ext4(), false).unwrap();
    // A later mount at the staging path covers the volume's mount there: freezing
    // through that path would freeze the other filesystem.
    let other = w.tmp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    w.sys
        .mounter
        .bind(&other, &w.staging(), &csi_sys::MountOptions::default())
        .unwrap();
    // The freeze fails: its error names the path it was asked to freeze.
    w.fake
        .fail_next(FakeOp::Freeze, || csi_sys::SysError::Unsupported {
            what: "freezing (test)".into(),
        });
    let err = w
        .c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains(&target.display().to_string()), "{err}");
    assert!(!err.contains(&w.staging().display().to_string()), "{err}");
    assert!(
        !w.fake.is_frozen(&w.staging()),
        "the covering mount is not frozen"
    );
}
