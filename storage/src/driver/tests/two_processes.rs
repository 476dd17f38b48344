//! Two processes on one state, the controller and the node plugin: each opens
//! only its own records, and what they share goes through the volume's lock.

use std::collections::BTreeMap;

use crate::ids::VolumeId;
use crate::model::*;
use crate::node::Stage;
use crate::testkit::*;
use crate::volumes::{CreateVolume, MIB};
use crate::{Driver, Result};

impl World {
    /// Another driver on the same state, pool and system, as the other process of
    /// the central deployment: the node plugin when `node`, else a controller.
    fn other(&self, node: bool) -> Result<Driver> {
        let mut cfg = self.config();
        cfg.controller = !node;
        cfg.node = node;
        Driver::open(cfg, self.sys.clone())
    }
}

/// A controller process (the world's driver) and a node process on one state.
fn split() -> (World, Driver) {
    let w = World::with(|c| c.node = false);
    let node = w.other(true).unwrap();
    (w, node)
}

fn stage_on(node: &Driver, w: &World, id: &str, cap: &Capability) -> Result<()> {
    node.node().unwrap().node_stage(Stage {
        volume_id: id.into(),
        staging_path: w.staging().display().to_string(),
        capability: Some(cap.clone()),
        volume_context: BTreeMap::new(),
    })
}

fn unstage_on(node: &Driver, w: &World, id: &str) -> Result<()> {
    node.node()
        .unwrap()
        .node_unstage(id, &w.staging().display().to_string())
}

#[test]
fn a_second_process_of_one_mode_on_one_state_is_refused() {
    let w = World::new();
    for node in [true, false] {
        match w.other(node) {
            Err(e @ crate::Error::StateInUse(_)) => {
                assert!(e.to_string().contains("one process per mode"), "{e}")
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a second process (node={node}) was let in"),
        }
    }
    let (w, node) = split();
    assert!(matches!(w.other(true), Err(crate::Error::StateInUse(_))));
    assert!(matches!(w.other(false), Err(crate::Error::StateInUse(_))));
    drop(node);
    w.other(true)
        .expect("the node's part is free once its process is gone");
}

#[test]
fn each_mode_opens_only_its_own_records() {
    let w = World::with(|c| c.controller = false);
    assert!(w.state_dir().join("node").is_dir());
    assert!(!w.state_dir().join("controller").exists());
    let w = World::with(|c| c.node = false);
    assert!(w.state_dir().join("controller").is_dir());
    assert!(!w.state_dir().join("node").exists());
}

#[test]
fn the_controller_does_not_delete_a_volume_the_node_has_staged() {
    let (w, node) = split();
    let info = w
        .c()
        .create_volume(CreateVolume {
            name: "pvc-dir".into(),
            capacity: CapacityRange::at_least(64 * MIB as i64),
            capabilities: vec![mount_cap("", AccessMode::SingleNodeWriter)],
            parameters: BTreeMap::from([("kind".to_string(), "dir".to_string())]),
            ..Default::default()
        })
        .unwrap();
    let id = info.id.to_string();
    stage_on(&node, &w, &id, &mount_cap("", AccessMode::SingleNodeWriter)).unwrap();
    let err = w.c().delete_volume(&id);
    assert_eq!(kind(err), Kind::FailedPrecondition);
    assert_eq!(w.pool_files("volumes"), vec![id.clone()]);
    unstage_on(&node, &w, &id).unwrap();
    w.c().delete_volume(&id).unwrap();
    assert!(w.pool_files("volumes").is_empty());
    assert!(
        std::fs::read_dir(w.state_dir().join("shared/locks"))
            .unwrap()
            .flatten()
            .all(|e| csi_sys::flock::is_spare(&e.file_name().to_string_lossy())),
        "the lock file of a deleted volume goes with it (kept as a spare)"
    );
}

#[test]
fn a_controller_without_the_node_hands_a_staged_image_change_to_the_node_process() {
    let (w, node) = split();
    let id = w.create("pvc-a", ext4());
    stage_on(&node, &w, &id, &ext4()).unwrap();
    let image = w.tmp.path().join(format!("pool/volumes/{id}.img"));
    let direct_io = || {
        w.fake
            .loops()
            .iter()
            .filter(|d| d.backing_file.ends_with(format!("{id}.img")))
            .map(|d| d.direct_io)
            .collect::<Vec<_>>()
    };
    assert_eq!(direct_io(), vec![false]);
    let on = BTreeMap::from([("directIO".to_string(), "true".to_string())]);
    w.c().modify_volume(&id, &on).unwrap();
    assert_eq!(
        direct_io(),
        vec![true],
        "the node process changed its device"
    );
    let attr = csi_sys::xattr::get(&image, "example-csi.directIO").unwrap();
    assert_eq!(attr.as_deref(), Some(&b"true"[..]));

    // Without the node process, a change of the staged image is refused and
    // nothing changes.
    drop(node);
    let off = BTreeMap::from([("directIO".to_string(), "false".to_string())]);
    assert_eq!(
        kind(w.c().modify_volume(&id, &off)),
        Kind::FailedPrecondition
    );
    assert_eq!(direct_io(), vec![true]);
    let attr = csi_sys::xattr::get(&image, "example-csi.directIO").unwrap();
    assert_eq!(
        attr.as_deref(),
        Some(&b"true"[..]),
        "the attribute was kept"
    );
    let rec = w.c().get_volume(&id).unwrap();
    assert_eq!(
        rec.mutable_parameters.get("directIO").map(String::as_str),
        Some("true")
    );
}

#[test]
fn only_the_controller_thaws_its_freeze_and_the_node_waits_for_it() {
    let (mut w, node) = split();
    let id = w.create("pvc-a", ext4());
    stage_on(&node, &w, &id, &ext4()).unwrap();
    // The controller died during a copy: frozen, its marker written before.
    w.sys.fs.freeze(&w.staging()).unwrap();
    std::fs::write(
        w.state_dir().join(format!("shared/frozen/{id}.json")),
        controller_freeze_marker(&id, w.staging(), false),
    )
    .unwrap();
    w.driver = None;
    assert_eq!(kind(unstage_on(&node, &w, &id)), Kind::Aborted);
    // The node plugin's restart leaves the controller's freeze alone.
    drop(node);
    let node = w.other(true).unwrap();
    assert!(w.fake.is_frozen(&w.staging()));
    assert_eq!(kind(unstage_on(&node, &w, &id)), Kind::Aborted);
    // The controller's restart thaws it; then the node goes on.
    w.reopen_with(|c| c.node = false);
    assert!(!w.fake.is_frozen(&w.staging()));
    unstage_on(&node, &w, &id).unwrap();
}

#[test]
fn a_copy_holds_the_volume_against_the_node_and_a_node_operation_holds_it_against_a_copy() {
    let (w, node) = split();
    let id = w.create("pvc-a", ext4());
    stage_on(&node, &w, &id, &ext4()).unwrap();
    let vid = VolumeId::parse(&id).unwrap();
    let held = w.c().state.lock_volume(vid).unwrap();
    assert_eq!(kind(unstage_on(&node, &w, &id)), Kind::Aborted);
    drop(held);
    let held = node.node().unwrap().state.lock_volume(vid).unwrap();
    let err = w.c().create_snapshot("snap-1", &id, &BTreeMap::new());
    assert_eq!(kind(err), Kind::Aborted);
    assert_eq!(
        w.c().snapshot_count(),
        0,
        "the refused snapshot left nothing"
    );
    drop(held);
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    unstage_on(&node, &w, &id).unwrap();
}
