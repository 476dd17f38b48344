//! The multi-node control plane without Kubernetes: two driver processes
//! standing for two nodes (`--mode all --agent-listen`, each with its own pool
//! and state), and the cluster's controller (`--mode router`) reaching both
//! over mutual TLS. Every Controller and GroupController call goes through the
//! router; a node down, the router killed mid-call, a deadline passing on the
//! far side of the hop, and strangers knocking at an agent.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use std::time::{Duration, Instant};

use cluster::*;
use common::*;
use csi_proto::csi::{self, controller_client::ControllerClient};
use tonic::transport::Channel;

async fn all_volume_ids(c: &ControllerClient<Channel>, max: i32) -> Vec<String> {
    let mut ids: Vec<String> = all_volumes(c, max)
        .await
        .into_iter()
        .map(|v| v.volume_id)
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_the_router_serves_every_controller_call_for_both_nodes() {
    let cl = cluster(&[]);
    let mut r = cl.router.clients().await;

    // New volumes go where their topology says, and their handles say where.
    let va = must_create(&mut r.controller, create_on("pvc-a", NODE_A)).await;
    let vb = must_create(&mut r.controller, create_on("pvc-b", NODE_B)).await;
    assert_eq!(node_of(&va.volume_id), NODE_A);
    assert_eq!(node_of(&vb.volume_id), NODE_B);
    assert_eq!(va.accessible_topology, vec![topology(NODE_A)]);
    assert_eq!(vb.accessible_topology, vec![topology(NODE_B)]);
    // The same name again: the same volume (idempotent across the hop).
    let again = must_create(&mut r.controller, create_on("pvc-a", NODE_A)).await;
    assert_eq!(again.volume_id, va.volume_id);
    // Each node holds its own, and only its own.
    let mut ca = cl.a.driver.clients().await;
    let cb = cl.b.driver.clients().await;
    assert_eq!(all_volumes(&ca.controller, 0).await.len(), 1);
    assert_eq!(all_volumes(&cb.controller, 0).await.len(), 1);

    // Lists span the nodes, page by page.
    let mut want = vec![va.volume_id.clone(), vb.volume_id.clone()];
    want.sort();
    for max in [0, 1, 2, 5] {
        assert_eq!(
            all_volume_ids(&r.controller, max).await,
            want,
            "max_entries {max}"
        );
    }
    let bad = r
        .controller
        .list_volumes(csi::ListVolumesRequest {
            max_entries: 1,
            starting_token: "node-z|1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::Aborted);

    // Capacity per node, and of the whole cluster.
    let cap = |t: Option<csi::Topology>| csi::GetCapacityRequest {
        volume_capabilities: vec![mount_cap("ext4", writer())],
        parameters: Default::default(),
        accessible_topology: t,
    };
    let on_a = r
        .controller
        .get_capacity(cap(Some(topology(NODE_A))))
        .await
        .unwrap()
        .into_inner();
    let on_b = r
        .controller
        .get_capacity(cap(Some(topology(NODE_B))))
        .await
        .unwrap()
        .into_inner();
    let all = r
        .controller
        .get_capacity(cap(None))
        .await
        .unwrap()
        .into_inner();
    assert!(on_a.available_capacity > 0 && on_b.available_capacity > 0);
    let sum = on_a.available_capacity + on_b.available_capacity;
    assert!(
        (all.available_capacity - sum).abs() < 64 * MIB,
        "{} against {sum}",
        all.available_capacity
    );
    let unknown = r
        .controller
        .get_capacity(cap(Some(topology("node-z"))))
        .await
        .unwrap();
    assert_eq!(unknown.into_inner().available_capacity, 0);

    // Snapshots, on the node of their volume; lists across and by filter.
    let sa = must_snapshot(&mut r.controller, snapshot_req("snap-a", &va.volume_id)).await;
    let sb = must_snapshot(&mut r.controller, snapshot_req("snap-b", &vb.volume_id)).await;
    assert_eq!(node_of(&sa.snapshot_id), NODE_A);
    assert_eq!(sa.source_volume_id, va.volume_id);
    assert_eq!(node_of(&sb.snapshot_id), NODE_B);
    let snaps = all_snapshots(&r.controller, 1).await;
    assert_eq!(snaps.len(), 2);
    let by_source = r
        .controller
        .list_snapshots(csi::ListSnapshotsRequest {
            source_volume_id: vb.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_source.entries.len(), 1);
    assert_eq!(
        by_source.entries[0].snapshot.as_ref().unwrap().snapshot_id,
        sb.snapshot_id
    );
    let none = r
        .controller
        .list_snapshots(csi::ListSnapshotsRequest {
            snapshot_id: format!("{}@{NODE_A}", uuid_like()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(none.into_inner().entries.is_empty());

    // A clone and a restore stay with their source when their topology allows.
    let mut clone = create_req("clone-a", 64 * MIB, mount_cap("ext4", writer()), &[]);
    clone.volume_content_source = Some(volume_source(&va.volume_id));
    let clone = must_create(&mut r.controller, clone).await;
    assert_eq!(node_of(&clone.volume_id), NODE_A);
    let mut restore = create_on("restore-b", NODE_B);
    restore.volume_content_source = Some(snapshot_source(&sb.snapshot_id));
    let restore = must_create(&mut r.controller, restore).await;
    assert_eq!(node_of(&restore.volume_id), NODE_B);
    match restore.content_source.and_then(|s| s.r#type) {
        Some(csi::volume_content_source::Type::Snapshot(s)) => {
            assert_eq!(s.snapshot_id, sb.snapshot_id)
        }
        other => panic!("{other:?}"),
    }

    // Expansion and a change of mutable parameters reach the right node.
    let grown = r
        .controller
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: vb.volume_id.clone(),
            capacity_range: csi_glue::capacity_at_least(128 * MIB),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 128 * MIB);
    r.controller
        .controller_modify_volume(csi::ControllerModifyVolumeRequest {
            volume_id: va.volume_id.clone(),
            mutable_parameters: [("readAheadKiB".to_string(), "256".to_string())]
                .into_iter()
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    let got = r
        .controller
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: vb.volume_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 128 * MIB);

    // A group snapshot of one node's volumes is taken there; one across
    // nodes is taken in parts. Either way its handle is bare, as its
    // members name it, and they name their nodes.
    let group = create_group(&mut r, "group-a", &[&va.volume_id, &clone.volume_id])
        .await
        .unwrap();
    assert!(!group.group_snapshot_id.contains('@'), "{group:?}");
    assert!(group.snapshots.iter().all(
        |s| node_of(&s.snapshot_id) == NODE_A && s.group_snapshot_id == group.group_snapshot_id
    ));
    // A handle naming the node (as earlier releases gave out) is still
    // served, and answered as asked.
    let named = csi_glue::handle::qualify(&group.group_snapshot_id, NODE_A);
    let got = r
        .group
        .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: named.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(got.group_snapshot_id, named);
    assert_eq!(got.snapshots.len(), 2);
    assert!(got.snapshots.iter().all(|s| s.group_snapshot_id == named));
    // Listed alone, a member names its group the same way.
    let listed = all_snapshots(&r.controller, 0).await;
    for m in &group.snapshots {
        let l = listed
            .iter()
            .find(|s| s.snapshot_id == m.snapshot_id)
            .unwrap();
        assert_eq!(l.group_snapshot_id, group.group_snapshot_id);
    }
    let across = create_group(&mut r, "group-ab", &[&va.volume_id, &vb.volume_id])
        .await
        .unwrap();
    assert!(!across.group_snapshot_id.contains('@'), "{across:?}");
    let members: Vec<(String, String)> = across
        .snapshots
        .iter()
        .map(|s| (node_of(&s.snapshot_id), node_of(&s.source_volume_id)))
        .collect();
    assert_eq!(
        members,
        vec![
            (NODE_A.into(), NODE_A.into()),
            (NODE_B.into(), NODE_B.into())
        ]
    );
    assert!(across
        .snapshots
        .iter()
        .all(|s| s.group_snapshot_id == across.group_snapshot_id && s.ready_to_use));
    // The same name again: the same group, not taken again.
    let again = create_group(&mut r, "group-ab", &[&va.volume_id, &vb.volume_id])
        .await
        .unwrap();
    assert_eq!(again, across);
    let listed = all_snapshots(&r.controller, 0).await;
    for m in &across.snapshots {
        let l = listed
            .iter()
            .find(|s| s.snapshot_id == m.snapshot_id)
            .unwrap();
        assert_eq!(l.group_snapshot_id, across.group_snapshot_id);
    }
    // Found by its members, and by its handle alone (every node asked).
    let across_ids: Vec<String> = across
        .snapshots
        .iter()
        .map(|s| s.snapshot_id.clone())
        .collect();
    for ids in [across_ids.clone(), vec![]] {
        let got = r
            .group
            .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
                group_snapshot_id: across.group_snapshot_id.clone(),
                snapshot_ids: ids,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .group_snapshot
            .unwrap();
        assert_eq!(got, across);
    }
    // Of other volumes under the same name: refused.
    let other = r
        .group
        .create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
            name: "group-ab".into(),
            source_volume_ids: vec![clone.volume_id.clone(), vb.volume_id.clone()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(other.code(), tonic::Code::AlreadyExists, "{other:?}");
    delete_group(&mut r, &across.group_snapshot_id)
        .await
        .unwrap();
    let gone = r
        .group
        .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: across.group_snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
    assert_eq!(all_snapshots(&cb.controller, 0).await.len(), 1);
    let fetched = r
        .group
        .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: group
                .snapshots
                .iter()
                .map(|s| s.snapshot_id.clone())
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        fetched.group_snapshot.unwrap().group_snapshot_id,
        group.group_snapshot_id
    );

    // The node plugin takes the handles the router gave: its own node's, and
    // refuses another node's.
    let staging = cl.a.pool.scratch("staging");
    let target = cl.a.pool.scratch("pod").join("v");
    ca.stage_and_publish(
        &va.volume_id,
        &staging,
        &target,
        &mount_cap("ext4", writer()),
    )
    .await;
    std::fs::write(target.join("hello"), b"on node a").unwrap();
    let foreign = ca
        .node
        .node_stage_volume(stage_req(
            &vb.volume_id,
            cl.a.pool.scratch("staging-b"),
            mount_cap("ext4", writer()),
        ))
        .await
        .unwrap_err();
    assert_eq!(foreign.code(), tonic::Code::NotFound);
    assert!(foreign.message().contains(NODE_B), "{}", foreign.message());
    ca.unpublish_and_unstage(&va.volume_id, &target, &staging)
        .await;

    // Everything deleted through the router leaves both pools empty.
    r.group
        .delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: group
                .snapshots
                .iter()
                .map(|s| s.snapshot_id.clone())
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    for s in [&sa.snapshot_id, &sb.snapshot_id] {
        r.controller
            .delete_snapshot(delete_snapshot_req(s))
            .await
            .unwrap();
    }
    for v in [
        &va.volume_id,
        &vb.volume_id,
        &clone.volume_id,
        &restore.volume_id,
    ] {
        r.controller.delete_volume(delete_req(v)).await.unwrap();
        // Again: already gone is success.
        r.controller.delete_volume(delete_req(v)).await.unwrap();
    }
    assert!(all_volumes(&r.controller, 0).await.is_empty());
    assert!(all_snapshots(&r.controller, 0).await.is_empty());
    assert!(all_volumes(&cb.controller, 0).await.is_empty());
    drop(cl);
}

/// Writes `n` into `path` and makes it durable.
fn put_count(path: &std::path::Path, n: u64) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(n.to_string().as_bytes()).unwrap();
    f.sync_all().unwrap();
}

/// The count in the file `seq` of a volume made from `snapshot` on `node`.
async fn count_restored(
    cl: &Cluster,
    r: &mut Clients,
    name: &str,
    node: &str,
    snapshot: &str,
) -> u64 {
    let mut req = create_on(name, node);
    req.volume_content_source = Some(snapshot_source(snapshot));
    let v = must_create(&mut r.controller, req).await;
    assert_eq!(node_of(&v.volume_id), node);
    let on = if node == NODE_A { &cl.a } else { &cl.b };
    let mut c = on.driver.clients().await;
    let staging = on.pool.scratch(&format!("staging-{name}"));
    let target = on.pool.scratch(&format!("pod-{name}")).join("v");
    let cap = mount_cap("ext4", writer());
    c.stage_and_publish(&v.volume_id, &staging, &target, &cap)
        .await;
    let n = std::fs::read_to_string(target.join("seq"))
        .unwrap()
        .parse()
        .unwrap();
    c.unpublish_and_unstage(&v.volume_id, &target, &staging)
        .await;
    r.controller
        .delete_volume(delete_req(&v.volume_id))
        .await
        .unwrap();
    n
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_group_snapshot_across_nodes_is_of_one_instant() {
    // Node B waits 2 s before it freezes its part: node A's part, frozen
    // first, must not be copied (and thawed) before B's is frozen too.
    let cl = cluster_with(
        &[],
        &[(
            "EXAMPLE_CSI_FAILPOINTS",
            "freeze.after-volume-lock=1*sleep(2000)",
        )],
    );
    let mut r = cl.router.clients().await;
    let va = must_create(&mut r.controller, create_on("pvc-a", NODE_A)).await;
    let vb = must_create(&mut r.controller, create_on("pvc-b", NODE_B)).await;
    let cap = mount_cap("ext4", writer());
    let mut ca = cl.a.driver.clients().await;
    let mut cb = cl.b.driver.clients().await;
    let (sa, ta) = (
        cl.a.pool.scratch("staging"),
        cl.a.pool.scratch("pod").join("v"),
    );
    let (sb, tb) = (
        cl.b.pool.scratch("staging"),
        cl.b.pool.scratch("pod").join("v"),
    );
    ca.stage_and_publish(&va.volume_id, &sa, &ta, &cap).await;
    cb.stage_and_publish(&vb.volume_id, &sb, &tb, &cap).await;

    // A workload counts on both volumes, A first: whenever B holds n, A
    // durably held n before. A snapshot where B is ahead of A is of two
    // instants.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let counting = {
        let stop = stop.clone();
        let (fa, fb) = (ta.join("seq"), tb.join("seq"));
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                n += 1;
                put_count(&fa, n);
                put_count(&fb, n);
            }
            n
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let g = create_group(&mut r, "group-ab", &[&va.volume_id, &vb.volume_id])
        .await
        .unwrap();
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let written = counting.join().unwrap();
    assert!(took >= Duration::from_millis(1900), "{took:?}");
    let member = |node: &str| {
        g.snapshots
            .iter()
            .find(|s| node_of(&s.snapshot_id) == node)
            .unwrap()
            .snapshot_id
            .clone()
    };
    let on_a = count_restored(&cl, &mut r, "ra", NODE_A, &member(NODE_A)).await;
    let on_b = count_restored(&cl, &mut r, "rb", NODE_B, &member(NODE_B)).await;
    eprintln!("counts: A {on_a}, B {on_b}, written {written}");
    assert!(on_b >= 1, "the workload wrote before the group: {on_b}");
    assert!(
        on_a >= on_b,
        "B's part ({on_b}) is ahead of A's ({on_a}): not one instant"
    );
    // Both were frozen at once: at most the one count A held while B froze.
    assert!(on_a <= on_b + 1, "A {on_a}, B {on_b}");
    assert!(written > on_a, "the workload went on after the thaw");
    ca.unpublish_and_unstage(&va.volume_id, &ta, &sa).await;
    cb.unpublish_and_unstage(&vb.volume_id, &tb, &sb).await;
}

/// Neither node holds a snapshot.
async fn nothing_left(cl: &Cluster, what: &str) {
    let a = cl.a.driver.clients().await;
    let b = cl.b.driver.clients().await;
    assert!(
        all_snapshots(&a.controller, 0).await.is_empty(),
        "{what}: on A"
    );
    assert!(
        all_snapshots(&b.controller, 0).await.is_empty(),
        "{what}: on B"
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_group_across_nodes_is_undone_whole_when_a_node_fails_and_a_retry_makes_it() {
    let mut cl = cluster(&[]);
    let mut r = cl.router.clients().await;
    let va = must_create(&mut r.controller, create_on("pvc-a", NODE_A)).await;
    let vb = must_create(&mut r.controller, create_on("pvc-b", NODE_B)).await;
    let pair = [va.volume_id.as_str(), vb.volume_id.as_str()];
    // B dies before its freeze (A's part is frozen and waits), then after
    // the go, in the middle of its copies (A's part is made): either way the
    // whole group fails, naming B, and A keeps nothing.
    for point in [
        "create-group-snapshot.after-intent",
        "create-group-snapshot.after-member",
    ] {
        cl.b.driver.envs = vec![("EXAMPLE_CSI_FAILPOINTS".into(), point.into())];
        cl.b.driver.restart();
        let mut r = cl.router.clients().await;
        let e = create_group(&mut r, "group-ab", &pair).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{point}: {e:?}");
        assert!(e.message().contains(NODE_B), "{point}: {}", e.message());
        assert!(cl.b.driver.wait_exit(30).is_some(), "{point}");
        cl.b.driver.envs.clear();
        cl.b.driver.spawn();
        nothing_left(&cl, point).await;
    }
    // B down: refused at once, naming it; nothing made on A.
    cl.b.driver.kill9();
    let e = create_group(&mut r, "group-ab", &pair).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains(NODE_B), "{}", e.message());
    cl.b.driver.spawn();
    nothing_left(&cl, "B down").await;

    // A part left by a call that died before it answered (here: B's part
    // made alone, directly on B) is of another instant: the router's call
    // takes the group again, whole.
    let mut cb = cl.b.driver.clients().await;
    let stale = create_group(
        &mut cb,
        "group-ab",
        &[&csi_glue::handle::parse(&vb.volume_id).id],
    )
    .await
    .unwrap();
    let g = create_group(&mut r, "group-ab", &pair).await.unwrap();
    assert_eq!(g.snapshots.len(), 2);
    let on_b = all_snapshots(&cb.controller, 0).await;
    assert_eq!(on_b.len(), 1);
    let at = |s: &csi::Snapshot| {
        let t = s.creation_time.unwrap();
        (t.seconds, t.nanos)
    };
    let b_member = &on_b[0];
    assert!(
        at(b_member) > at(&stale.snapshots[0]),
        "B's part was taken again: {b_member:?} after {stale:?}"
    );
    r.group
        .delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: g.group_snapshot_id.clone(),
            snapshot_ids: g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    nothing_left(&cl, "deleted").await;
    // B down: a delete of a group with parts there is retryable, naming it.
    let g = create_group(&mut r, "group-ab", &pair).await.unwrap();
    cl.b.driver.kill9();
    let e = delete_group(&mut r, &g.group_snapshot_id)
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains(NODE_B), "{}", e.message());
    cl.b.driver.spawn();
    delete_group(&mut r, &g.group_snapshot_id).await.unwrap();
    nothing_left(&cl, "deleted after B came back").await;
}

fn uuid_like() -> &'static str {
    "00000000-0000-5000-8000-000000000000"
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_node_down_is_named_changes_nothing_and_a_retry_converges() {
    let mut cl = cluster(&[]);
    let mut r = cl.router.clients().await;
    let va = must_create(&mut r.controller, create_on("pvc-a", NODE_A)).await;
    let vb = must_create(&mut r.controller, create_on("pvc-b", NODE_B)).await;

    cl.b.driver.kill9();
    let e = r
        .controller
        .create_snapshot(snapshot_req("snap-b", &vb.volume_id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains(NODE_B), "{}", e.message());
    let e = r
        .controller
        .create_volume(create_on("pvc-b2", NODE_B))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let e = r
        .controller
        .delete_volume(delete_req(&vb.volume_id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let e = r
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(e.message().contains(NODE_B), "{}", e.message());
    // Node A is served all the while.
    must_snapshot(&mut r.controller, snapshot_req("snap-a", &va.volume_id)).await;

    // Back up: the same calls now succeed, and nothing was made twice.
    cl.b.driver.spawn();
    let sb = must_snapshot(&mut r.controller, snapshot_req("snap-b", &vb.volume_id)).await;
    let b2 = must_create(&mut r.controller, create_on("pvc-b2", NODE_B)).await;
    assert_eq!(node_of(&b2.volume_id), NODE_B);
    let cb = cl.b.driver.clients().await;
    assert_eq!(all_volumes(&cb.controller, 0).await.len(), 2);
    assert_eq!(all_snapshots(&cb.controller, 0).await.len(), 1);
    r.controller
        .delete_snapshot(delete_snapshot_req(&sb.snapshot_id))
        .await
        .unwrap();
    r.controller
        .delete_volume(delete_req(&b2.volume_id))
        .await
        .unwrap();
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_the_router_killed_mid_call_leaves_one_volume_after_a_retry() {
    // Node A holds its first CreateVolume for 3 s before it makes the data.
    let mut cl = cluster(&[(
        "EXAMPLE_CSI_FAILPOINTS",
        "create-volume.before-data=1*sleep(3000)",
    )]);
    let r = cl.router.clients().await;
    let mut first = r.controller.clone();
    let call =
        tokio::spawn(async move { first.create_volume(create_on("pvc-held", NODE_A)).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    cl.router.kill9();
    assert!(
        call.await.unwrap().is_err(),
        "the router died before it answered"
    );
    cl.router.spawn();
    let mut r = cl.router.clients().await;
    // The CO retries until the call that was under way has ended on the node.
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        match r
            .controller
            .create_volume(create_on("pvc-held", NODE_A))
            .await
        {
            Ok(v) => break v.into_inner().volume.unwrap(),
            Err(e) if e.code() == tonic::Code::Aborted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    assert_eq!(node_of(&v.volume_id), NODE_A);
    let ca = cl.a.driver.clients().await;
    let on_a = all_volumes(&ca.controller, 0).await;
    assert_eq!(on_a.len(), 1, "{on_a:?}");
    assert_eq!(images_in(&cl.a.pool.path), 1);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_deadline_crosses_the_hop_and_the_abandoned_snapshot_is_undone() {
    let cl = cluster(&[(
        "EXAMPLE_CSI_FAILPOINTS",
        "freeze.after-volume-lock=1*sleep(2000)",
    )]);
    let mut r = cl.router.clients().await;
    let va = must_create(&mut r.controller, create_on("pvc-a", NODE_A)).await;
    let mut req = tonic::Request::new(snapshot_req("snap-late", &va.volume_id));
    req.set_timeout(Duration::from_millis(500));
    let started = Instant::now();
    let e = r.controller.create_snapshot(req).await.unwrap_err();
    assert!(
        matches!(
            e.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{e:?}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    // The node stopped the work at its next safe point and undid it.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let ca = cl.a.driver.clients().await;
    assert!(all_snapshots(&ca.controller, 0).await.is_empty());
    let log = cl.a.driver.log_text();
    assert!(
        log.contains("abandoned call ended: stopped and undone"),
        "{log}"
    );
    // A retry with time enough succeeds.
    must_snapshot(&mut r.controller, snapshot_req("snap-late", &va.volume_id)).await;
}

/// A TLS client of node A's agent with credentials of `role` minted by one
/// side of a mesh.
async fn agent_client(
    port: u16,
    mesh: &csi_mesh::tls::Mesh,
    role: csi_mesh::tls::Role,
) -> Result<ControllerClient<Channel>, tonic::transport::Error> {
    Ok(ControllerClient::new(
        agent_channel(port, mesh, role).await?,
    ))
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_strangers_cannot_make_an_agent_do_anything() {
    let cl = cluster(&[]);
    let port = cl.a.port;
    let before = images_in(&cl.a.pool.path);

    // No TLS at all.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        let e = ControllerClient::new(ch)
            .create_volume(create_on("stranger-1", NODE_A))
            .await
            .unwrap_err();
        assert_ne!(e.code(), tonic::Code::Ok);
    }

    // A certificate of another authority: the handshake fails.
    let other = stranger_mesh();
    match agent_client(port, &other, csi_mesh::tls::Role::Controller).await {
        Err(_) => {}
        Ok(mut c) => {
            let e = c
                .create_volume(create_on("stranger-2", NODE_A))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        }
    }

    // The nodes' authority and the role of a node: refused by the agent.
    let nodes = cl.nodes_side();
    let mut c = agent_client(port, &nodes, csi_mesh::tls::Role::Node(NODE_B.into()))
        .await
        .unwrap();
    let e = c
        .create_volume(create_on("stranger-3", NODE_A))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    let e = c
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    // Root on a node has the nodes' authority and signs itself the
    // controller's role: the agent sees the wrong signer and refuses.
    let mut c = agent_client(port, &nodes, csi_mesh::tls::Role::Controller)
        .await
        .unwrap();
    let e = c
        .create_volume(create_on("stranger-4", NODE_A))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let e = c
        .delete_volume(delete_req(&format!("anything@{NODE_A}")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let mut agent = csi_proto::mesh::agent_client::AgentClient::new(
        agent_channel(port, &nodes, csi_mesh::tls::Role::Controller)
            .await
            .unwrap(),
    );
    let e = agent
        .list_transfers(csi_proto::mesh::ListTransfersRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // Nor may another node take a part of a group snapshot here (a freeze).
    let mut agent = csi_proto::mesh::agent_client::AgentClient::new(
        agent_channel(port, &nodes, csi_mesh::tls::Role::Node(NODE_B.into()))
            .await
            .unwrap(),
    );
    let part = csi_proto::mesh::GroupPartStep {
        // Refused before its request is read.
        create: Vec::new(),
        go: true,
    };
    let e = agent
        .take_group_part(tokio_stream::iter(vec![part]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    // The controller's role from the controller's authority is served: the
    // checks above are not a broken agent.
    let mut c = agent_client(port, &cl.controller_side(), csi_mesh::tls::Role::Controller)
        .await
        .unwrap();
    c.list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap();
    assert_eq!(
        images_in(&cl.a.pool.path),
        before,
        "a stranger made something"
    );
    let ca = cl.a.driver.clients().await;
    assert!(all_volumes(&ca.controller, 0).await.is_empty());
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_volumes_made_before_handles_named_nodes_are_found_on_their_node() {
    let cl = cluster(&[]);
    // As a distributed install made them: on the node's own socket, bare ids.
    let mut cb = cl.b.driver.clients().await;
    let old = must_create(&mut cb.controller, create_on("pvc-old", NODE_B)).await;
    assert!(csi_glue::handle::parse(&old.volume_id).node.is_none());
    let old_snap =
        must_snapshot(&mut cb.controller, snapshot_req("snap-old", &old.volume_id)).await;

    let mut r = cl.router.clients().await;
    let got = r
        .controller
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: old.volume_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(got.volume_id, format!("{}@{NODE_B}", old.volume_id));
    // Snapshots and restores of it, by its bare id.
    let snap = must_snapshot(&mut r.controller, snapshot_req("snap-new", &old.volume_id)).await;
    assert_eq!(node_of(&snap.snapshot_id), NODE_B);
    let mut restore = create_req("restore-old", 64 * MIB, mount_cap("ext4", writer()), &[]);
    restore.volume_content_source = Some(snapshot_source(&old_snap.snapshot_id));
    let restored = must_create(&mut r.controller, restore).await;
    assert_eq!(node_of(&restored.volume_id), NODE_B);
    // An id no node holds: NOT_FOUND where the spec says so, success for deletes.
    let e = r
        .controller
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: uuid_like().into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    r.controller
        .delete_volume(delete_req(uuid_like()))
        .await
        .unwrap();
    // Deleted by their bare ids, they are gone from their node.
    r.controller
        .delete_snapshot(delete_snapshot_req(&snap.snapshot_id))
        .await
        .unwrap();
    r.controller
        .delete_snapshot(delete_snapshot_req(&old_snap.snapshot_id))
        .await
        .unwrap();
    r.controller
        .delete_volume(delete_req(&restored.volume_id))
        .await
        .unwrap();
    r.controller
        .delete_volume(delete_req(&old.volume_id))
        .await
        .unwrap();
    assert!(all_volumes(&cb.controller, 0).await.is_empty());
    assert!(all_snapshots(&cb.controller, 0).await.is_empty());
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_controller_get_node_info_through_the_router_is_each_nodes_own() {
    let attach = [
        ("CSI_ENABLE_ATTACH", "true"),
        ("CSI_MAX_VOLUMES_PER_NODE", "7"),
    ];
    let cl = cluster_of(&attach, &attach, &["--enable-attach"]);
    let mut r = cl.router.clients().await;
    let mut published = Vec::new();
    for node in [NODE_A, NODE_B] {
        let v = must_create(
            &mut r.controller,
            create_on(&format!("pvc-info-{node}"), node),
        )
        .await;
        r.controller
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: v.volume_id.clone(),
                node_id: node.to_string(),
                volume_capability: Some(mount_cap("ext4", writer())),
                ..Default::default()
            })
            .await
            .unwrap();
        published.push((node, v.volume_id));
    }
    // Another volume on node A, not published: not listed.
    must_create(&mut r.controller, create_on("pvc-info-idle", NODE_A)).await;
    for (node, id) in &published {
        let info = r
            .controller
            .controller_get_node_info(csi::ControllerGetNodeInfoRequest {
                node_id: node.to_string(),
            })
            .await
            .unwrap()
            .into_inner();
        let ids: Vec<&str> = info
            .published_volumes
            .iter()
            .map(|p| p.volume_id.as_str())
            .collect();
        assert_eq!(ids, vec![id.as_str()], "{node}: {info:?}");
        assert_eq!(node_of(ids[0]), *node);
        assert_eq!(info.accessible_topology, Some(topology(node)), "{node}");
        assert_eq!(info.max_volumes_per_node, 7, "{node}");
    }
    let e = r
        .controller
        .controller_get_node_info(csi::ControllerGetNodeInfoRequest {
            node_id: "node-c".into(),
        })
        .await
        .unwrap_err();
    assert_ne!(e.code(), tonic::Code::Ok);
    assert!(e.message().contains("node-c"), "{e:?}");
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_the_router_counts_and_times_its_calls_on_its_metrics_port() {
    let port = free_port();
    let address = format!("--metrics-address=127.0.0.1:{port}");
    let cl = cluster_of(&[], &[], &[&address, "--metrics-max-age=0"]);
    let mut r = cl.router.clients().await;
    let before = scrape(port);
    assert!(
        before.contains("mode=\"router\""),
        "the build info names the mode: {before}"
    );
    assert_eq!(sample(&before, "example_csi_mesh_agents", &[]), Some(2.0));
    assert_eq!(sample(&before, "example_csi_ready", &[]), Some(1.0));
    let created = [("method", "CreateVolume"), ("grpc_code", "OK")];
    assert_eq!(
        sample(&before, "example_csi_rpc_requests_total", &created),
        None
    );

    for node in [NODE_A, NODE_B] {
        must_create(
            &mut r.controller,
            create_on(&format!("pvc-metrics-{node}"), node),
        )
        .await;
    }
    let e = r
        .controller
        .delete_volume(delete_req(""))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);

    let after = scrape(port);
    assert_eq!(
        sample(&after, "example_csi_rpc_requests_total", &created),
        Some(2.0)
    );
    let refused = [("method", "DeleteVolume"), ("grpc_code", "InvalidArgument")];
    assert_eq!(
        sample(&after, "example_csi_rpc_requests_total", &refused),
        Some(1.0)
    );
    let timed = [("method", "CreateVolume")];
    assert_eq!(
        sample(&after, "example_csi_rpc_duration_seconds_count", &timed),
        Some(2.0)
    );
    // A node's own figures (pools) are the node agents' to show, not the router's.
    assert!(
        !after.contains("example_csi_pool_capacity_bytes{"),
        "{after}"
    );
    let health = {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        conn.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        answer
    };
    assert!(health.starts_with("HTTP/1.0 200"), "{health}");
}
