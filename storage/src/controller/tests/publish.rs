//! ControllerPublishVolume, ControllerUnpublishVolume and its reasons, and
//! ControllerGetNodeInfo: what the node holds is its publications and its
//! staged volumes.

use crate::ids::VolumeId;
use crate::testkit::*;
use crate::volumes::{NodeInfo, UnpublishReason};

const NODE: &str = "node-1";

fn attach_world(max_volumes: u64) -> World {
    World::with(|cfg| {
        cfg.enable_attach = true;
        cfg.max_volumes_per_node = max_volumes;
    })
}

fn publish(w: &World, id: &str) -> crate::Result<()> {
    w.c()
        .publish_volume(id, NODE, Some(&ext4()), false)
        .map(drop)
}

fn published_to(w: &World, id: &str) -> Vec<String> {
    let rec = w.c().volumes.get(VolumeId::parse(id).unwrap()).unwrap();
    rec.published.keys().cloned().collect()
}

fn held(w: &World) -> Vec<String> {
    let NodeInfo { volumes, .. } = w.c().node_info(NODE).unwrap();
    volumes.iter().map(|v| v.to_string()).collect()
}

fn unstage(w: &World, id: &str) {
    w.n()
        .node_unstage(id, &w.staging().display().to_string())
        .unwrap();
}

#[test]
fn node_info_gives_the_limit_and_the_published_and_staged_volumes() {
    let w = attach_world(8);
    let published = w.create("pvc-published", ext4());
    publish(&w, &published).unwrap();
    let staged = w.create_staged("pvc-staged");
    let idle = w.create("pvc-idle", ext4());

    let info = w.c().node_info(NODE).unwrap();
    assert_eq!(info.max_volumes, 8);
    let mut want = vec![published.clone(), staged.clone()];
    want.sort();
    assert_eq!(held(&w), want, "{idle} is neither published nor staged");

    // Gone from the answer once the node lets go.
    unstage(&w, &staged);
    w.c()
        .unpublish_volume(&published, NODE, UnpublishReason::NodeCleanedUp)
        .unwrap();
    assert!(held(&w).is_empty());
}

#[test]
fn node_info_of_another_node_is_not_found_and_of_none_invalid() {
    let w = attach_world(0);
    assert_eq!(kind(w.c().node_info("node-2")), Kind::NotFound);
    assert_eq!(kind(w.c().node_info("")), Kind::InvalidArgument);
    assert_eq!(w.c().node_info(NODE).unwrap().max_volumes, 0);
}

#[test]
fn the_volume_limit_counts_staged_volumes_that_were_never_published() {
    let w = attach_world(2);
    let staged = w.create_staged("pvc-staged");
    let a = w.create("pvc-a", ext4());
    let b = w.create("pvc-b", ext4());
    publish(&w, &a).unwrap();
    assert_eq!(kind(publish(&w, &b)), Kind::ResourceExhausted);
    // Publishing the staged volume itself is not one more.
    publish(&w, &staged).unwrap();
    unstage(&w, &staged);
    w.c()
        .unpublish_volume(&staged, NODE, UnpublishReason::NodeCleanedUp)
        .unwrap();
    publish(&w, &b).unwrap();
}

#[test]
fn a_reason_saying_the_node_let_go_is_refused_while_the_volume_is_staged() {
    for reason in [
        UnpublishReason::NodeCleanedUp,
        UnpublishReason::NodeOutOfService,
    ] {
        let w = attach_world(0);
        let id = w.create_staged("pvc-a");
        publish(&w, &id).unwrap();
        let e = w.c().unpublish_volume(&id, NODE, reason);
        assert_eq!(kind(e), Kind::FailedPrecondition, "{reason:?}");
        assert_eq!(published_to(&w, &id), [NODE], "{reason:?}: record kept");
        // The retry after the node unstaged succeeds.
        unstage(&w, &id);
        w.c().unpublish_volume(&id, NODE, reason).unwrap();
        assert!(published_to(&w, &id).is_empty(), "{reason:?}");
    }
}

#[test]
fn a_timed_out_node_is_unpublished_and_still_holds_the_volume_against_its_limit() {
    let w = attach_world(1);
    let id = w.create_staged("pvc-a");
    publish(&w, &id).unwrap();
    w.c()
        .unpublish_volume(&id, NODE, UnpublishReason::NodeTimedOut)
        .unwrap();
    assert!(published_to(&w, &id).is_empty());
    assert_eq!(held(&w), vec![id.clone()], "the node may still use it");
    let other = w.create("pvc-b", ext4());
    assert_eq!(kind(publish(&w, &other)), Kind::ResourceExhausted);
    unstage(&w, &id);
    publish(&w, &other).unwrap();
}

#[test]
fn an_unsaid_reason_unpublishes_a_staged_volume_as_before() {
    let w = attach_world(0);
    let id = w.create_staged("pvc-a");
    publish(&w, &id).unwrap();
    w.c()
        .unpublish_volume(&id, NODE, UnpublishReason::Unsaid)
        .unwrap();
    assert!(published_to(&w, &id).is_empty());
}

#[test]
fn a_reason_without_a_node_is_invalid_and_changes_nothing() {
    let w = attach_world(0);
    let id = w.create("pvc-a", ext4());
    publish(&w, &id).unwrap();
    let e = w
        .c()
        .unpublish_volume(&id, "", UnpublishReason::NodeCleanedUp);
    assert_eq!(kind(e), Kind::InvalidArgument);
    assert_eq!(published_to(&w, &id), [NODE]);
    w.c()
        .unpublish_volume(&id, "", UnpublishReason::Unsaid)
        .unwrap();
    assert!(published_to(&w, &id).is_empty());
}

#[test]
fn a_reason_for_another_node_does_not_look_at_this_nodes_stage() {
    let w = attach_world(0);
    let id = w.create_staged("pvc-a");
    w.c()
        .unpublish_volume(&id, "node-2", UnpublishReason::NodeOutOfService)
        .unwrap();
}
