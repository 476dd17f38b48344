//! Volumes that follow their workload: a restore or clone made through the
//! cluster's controller on another node than its source's, with its data.
//! Two driver processes stand for two nodes (each its own xfs pool and
//! state), the router between them; the data is compared byte for byte,
//! either node is killed at each step of a transfer and the transfer goes
//! on, a peer that is not the target is refused the data, and a delete in
//! the middle leaves nothing behind on either node.

#[path = "common/cluster.rs"]
mod cluster;
mod common;
#[path = "common/moving.rs"]
mod moving;

use std::path::Path;
use std::time::{Duration, Instant};

use cluster::*;
use common::*;
use csi_proto::csi;
use csi_proto::mesh;
use moving::*;

const BANDWIDTH: &str = "CSI_TRANSFER_BANDWIDTH";
const FAILPOINTS: &str = "EXAMPLE_CSI_FAILPOINTS";
/// Between two patches of one cell of an incremental transfer.
const INSIDE: &str = "transfer.inside-a-patched-cell";
/// Right after a checkpoint's record is written.
const AFTER_CHECKPOINT: &str = "transfer.after-checkpoint";

/// A volume on node A with `mib` MiB of random data in the file `data`, and
/// a snapshot of it taken once the volume is unpublished.
async fn snapshot_with_data(cl: &Cluster, tag: &str, size: i64, mib: u32) -> csi::Snapshot {
    let mut r = cl.router.clients().await;
    let v = must_create(
        &mut r.controller,
        sized_on(&format!("pvc-{tag}"), NODE_A, size),
    )
    .await;
    let m = mount(&cl.a, &v.volume_id, tag).await;
    write_random(&m.target, "data", mib);
    unmount(&cl.a, &m).await;
    must_snapshot(
        &mut r.controller,
        snapshot_req(&format!("snap-{tag}"), &v.volume_id),
    )
    .await
}

/// The names in folder `dir` of a node's pool.
fn listed(pool: &Pool, dir: &str) -> Vec<String> {
    std::fs::read_dir(pool.path.join(dir))
        .map(|r| {
            r.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// What is left in a node's pool of transfers: images of holds not kept as a
/// base, and arrival records.
fn held_images(pool: &Pool) -> Vec<String> {
    listed(pool, ".holds")
}

/// The answer of node A's agent at `port` to a Read of transfer `id` by
/// `role` (minted by one side of a mesh) showing `token`: the first message
/// decides, a piece or a refusal.
async fn read_hold(
    port: u16,
    mesh: &csi_mesh::tls::Mesh,
    role: csi_mesh::tls::Role,
    id: String,
    token: &str,
) -> Result<(), tonic::Code> {
    let ch = agent_channel(port, mesh, role).await.unwrap();
    let got = mesh::transfer_client::TransferClient::new(ch)
        .read(mesh::ReadRequest {
            transfer_id: id,
            from: 0,
            base_transfer_id: String::new(),
            read_token: token.to_string(),
            patches: false,
            xxh3: true,
        })
        .await;
    match got {
        Err(s) => Err(s.code()),
        Ok(stream) => match stream.into_inner().message().await {
            Ok(_) => Ok(()),
            Err(s) => Err(s.code()),
        },
    }
}

/// The read token of the one hold in `pool`, from its description (what the
/// source told the controller, and the controller the target).
fn hold_token(pool: &Pool) -> String {
    let dir = pool.path.join(".holds");
    let descriptions: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .collect();
    assert_eq!(descriptions.len(), 1, "{descriptions:?}");
    let info: serde_json::Value =
        serde_json::from_slice(&std::fs::read(descriptions[0].path()).unwrap()).unwrap();
    let token = info["read_token"].as_str().unwrap().to_string();
    assert!(token.len() >= 32, "{token:?}");
    token
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_snapshot_restored_on_another_node_arrives_byte_for_byte_with_its_holes() {
    // The target reads slowly, so that the volume is seen arriving.
    let metrics = free_port();
    let metrics_address = format!("127.0.0.1:{metrics}");
    let cl = cluster_with(
        &[],
        &[
            (BANDWIDTH, "4Mi"),
            ("CSI_METRICS_ADDRESS", &metrics_address),
            ("CSI_METRICS_MAX_AGE", "1"),
        ],
    );
    let mut r = cl.router.clients().await;
    let v = must_create(&mut r.controller, sized_on("pvc-src", NODE_A, 256 * MIB)).await;
    let m = mount(&cl.a, &v.volume_id, "src").await;
    let sum = write_random(&m.target, "data", 40);
    let snap = must_snapshot(&mut r.controller, snapshot_req("snap-1", &v.volume_id)).await;
    assert_eq!(node_of(&snap.snapshot_id), NODE_A);

    // The restore is made at once on the chosen node; its data follows.
    let started = Instant::now();
    let req = create_from(
        "pvc-moved",
        NODE_B,
        256 * MIB,
        snapshot_source(&snap.snapshot_id),
    );
    let moved = must_create(&mut r.controller, req.clone()).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(node_of(&moved.volume_id), NODE_B);
    assert_eq!(moved.accessible_topology, vec![topology(NODE_B)]);
    match moved
        .content_source
        .as_ref()
        .and_then(|s| s.r#type.as_ref())
    {
        Some(csi::volume_content_source::Type::Snapshot(s)) => {
            assert_eq!(s.snapshot_id, snap.snapshot_id)
        }
        other => panic!("{other:?}"),
    }
    // A retry is the same volume, and starts nothing new.
    let again = must_create(&mut r.controller, req).await;
    assert_eq!(again.volume_id, moved.volume_id);

    // Until its data is whole the volume cannot be staged: the kubelet retries.
    let mut cb = cl.b.driver.clients().await;
    let early = cb
        .node
        .node_stage_volume(stage_req(
            &moved.volume_id,
            cl.b.pool.scratch("early"),
            mount_cap("ext4", writer()),
        ))
        .await
        .unwrap_err();
    assert_eq!(early.code(), tonic::Code::Aborted, "{early:?}");
    assert!(early.message().contains("arriving"), "{}", early.message());
    // The controller lists the transfer, with the node it runs on.
    let listed = transfers(&cl.router).await;
    let arriving: Vec<_> = listed
        .iter()
        .filter(|t| t.role == "arriving" && t.volume_id == local(&moved.volume_id))
        .collect();
    assert_eq!(arriving.len(), 1, "{listed:?}");
    assert_eq!(arriving[0].peer_node, NODE_A);
    assert!(listed.iter().any(|t| t.role == "hold"), "{listed:?}");
    // And the target's metrics show it arriving.
    let series = format!(
        "example_csi_transfer_bytes_total{{volume=\"{}\",source=\"{NODE_A}\"}} {}",
        local(&moved.volume_id),
        256 * MIB
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape(metrics);
        if text.contains(&series) {
            assert!(
                text.contains("example_csi_transfers{role=\"arriving\""),
                "{text}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no {series} in:\n{text}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    let done = arrived(&cl.b.driver, &moved.volume_id, 180).await;
    assert!(!done.incremental);
    // Only what the snapshot holds travelled: its data, not its holes.
    let src = snapshot_image(&cl.a.pool, &snap.snapshot_id);
    let dst = volume_image(&cl.b.pool, &moved.volume_id);
    assert!(
        done.data_bytes <= allocated(&src) + 8 * MIB as u64,
        "sent {} for {} allocated",
        done.data_bytes,
        allocated(&src)
    );
    assert_eq!(first_difference(&src, &dst), None, "the images differ");
    assert!(
        allocated(&dst) <= allocated(&src) + 8 * MIB as u64,
        "{} allocated against the source's {}",
        allocated(&dst),
        allocated(&src)
    );
    assert!(allocated(&dst) < 128 * MIB as u64, "the holes were filled");

    // The pod on the new node reads what was written on the old one.
    let mb = mount(&cl.b, &moved.volume_id, "moved").await;
    assert_eq!(sha256(&mb.target.join("data")), sum);
    unmount(&cl.b, &mb).await;
    unmount(&cl.a, &m).await;

    // Deletes through the controller leave no transfer behind.
    for id in [&moved.volume_id, &v.volume_id] {
        delete_as_a_co(&mut r.controller, id).await;
    }
    r.controller
        .delete_snapshot(delete_snapshot_req(&snap.snapshot_id))
        .await
        .unwrap();
    assert_eq!(images_in(&cl.a.pool.path), 0);
    assert_eq!(images_in(&cl.b.pool.path), 0);
    let left: Vec<_> = transfers(&cl.b.driver)
        .await
        .into_iter()
        .filter(|t| t.state != "done")
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_live_volume_cloned_to_another_node_twice_sends_only_the_change_the_second_time() {
    let cl = cluster(&[]);
    let mut r = cl.router.clients().await;
    let v = must_create(&mut r.controller, sized_on("pvc-live", NODE_A, 128 * MIB)).await;
    let m = mount(&cl.a, &v.volume_id, "live").await;
    let first = write_random(&m.target, "first", 24);

    // A clone of a volume in use: frozen while held, then sent.
    let c1 = must_create(
        &mut r.controller,
        create_from("pvc-c1", NODE_B, 128 * MIB, volume_source(&v.volume_id)),
    )
    .await;
    assert_eq!(node_of(&c1.volume_id), NODE_B);
    let t1 = arrived(&cl.b.driver, &c1.volume_id, 180).await;
    assert!(!t1.incremental);
    assert!(t1.data_bytes >= 24 * MIB as u64, "{t1:?}");
    let m1 = mount(&cl.b, &c1.volume_id, "c1").await;
    assert_eq!(sha256(&m1.target.join("first")), first);
    unmount(&cl.b, &m1).await;

    // The workload goes on on node A; a second move sends what changed.
    let second = write_random(&m.target, "second", 4);
    let c2 = must_create(
        &mut r.controller,
        create_from("pvc-c2", NODE_B, 128 * MIB, volume_source(&v.volume_id)),
    )
    .await;
    let t2 = arrived(&cl.b.driver, &c2.volume_id, 180).await;
    assert!(t2.incremental, "{t2:?}");
    // What the second transfer replaced, the first one's base on A and its
    // replica on B, goes soon after it: one of each is kept (an image and
    // its description).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (holds, replicas) = (
            listed(&cl.a.pool, ".holds"),
            listed(&cl.b.pool, ".replicas"),
        );
        if holds.len() == 2 && replicas.len() == 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "kept: {holds:?} {replicas:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // 4 MiB of file data changed: what differs (file data, the filesystem's
    // metadata and log) travels as patches of its cells, not whole cells.
    assert!(
        t2.data_bytes < 6 * MIB as u64,
        "an incremental transfer sent {} bytes",
        t2.data_bytes
    );
    let m2 = mount(&cl.b, &c2.volume_id, "c2").await;
    assert_eq!(sha256(&m2.target.join("first")), first);
    assert_eq!(sha256(&m2.target.join("second")), second);
    unmount(&cl.b, &m2).await;
    unmount(&cl.a, &m).await;

    // What the transfers kept for the next move goes with the volumes: the
    // replica on B with the last copy, the base on A with the source.
    let kept = listed;
    assert!(!kept(&cl.a.pool, ".holds").is_empty(), "no base kept on A");
    assert!(
        !kept(&cl.b.pool, ".replicas").is_empty(),
        "no replica kept on B"
    );
    for id in [&c1.volume_id, &c2.volume_id, &v.volume_id] {
        delete_as_a_co(&mut r.controller, id).await;
    }
    assert_eq!(kept(&cl.a.pool, ".holds"), Vec::<String>::new());
    assert_eq!(kept(&cl.b.pool, ".replicas"), Vec::<String>::new());
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_an_incremental_transfer_cut_between_patches_of_a_cell_goes_on_and_arrives_whole() {
    let mut cl = cluster(&[]);
    let mut r = cl.router.clients().await;
    let v = must_create(&mut r.controller, sized_on("pvc-src", NODE_A, 128 * MIB)).await;
    let m = mount(&cl.a, &v.volume_id, "src").await;
    write_random(&m.target, "first", 24);
    unmount(&cl.a, &m).await;
    let s1 = must_snapshot(&mut r.controller, snapshot_req("snap-1", &v.volume_id)).await;
    let r1 = must_create(
        &mut r.controller,
        create_from(
            "pvc-r1",
            NODE_B,
            128 * MIB,
            snapshot_source(&s1.snapshot_id),
        ),
    )
    .await;
    assert!(!arrived(&cl.b.driver, &r1.volume_id, 180).await.incremental);
    // Small changes here and there: several patches in some cells.
    let m = mount(&cl.a, &v.volume_id, "src").await;
    write_random(&m.target, "second", 1);
    for i in 0..8u8 {
        let bytes: Vec<u8> = (0..5000u32)
            .map(|j| (j as u8).wrapping_mul(7) ^ i)
            .collect();
        std::fs::write(m.target.join(format!("small-{i}")), bytes).unwrap();
    }
    unmount(&cl.a, &m).await;
    let s2 = must_snapshot(&mut r.controller, snapshot_req("snap-2", &v.volume_id)).await;

    let cases = [
        // Broken between two patches of a cell (as a cut network would):
        // the transfer goes on at once from that cell's start.
        ("pvc-r2", vec![format!("{INSIDE}=fail")], false),
        // Held there past a checkpoint's time (the record then says the
        // cell's start), killed right after that checkpoint, restarted.
        (
            "pvc-r3",
            vec![
                format!("{INSIDE}=1*sleep(2500)"),
                AFTER_CHECKPOINT.to_string(),
            ],
            true,
        ),
    ];
    for (name, failpoints, dies) in cases {
        cl.b.driver.envs = vec![(FAILPOINTS.into(), failpoints.join(","))];
        cl.b.driver.restart();
        let mut r = cl.router.clients().await;
        let moved = must_create(
            &mut r.controller,
            create_from(name, NODE_B, 128 * MIB, snapshot_source(&s2.snapshot_id)),
        )
        .await;
        if dies {
            assert!(
                cl.b.driver.wait_exit(120).is_some(),
                "[{name}] node B did not die after the checkpoint inside a cell"
            );
            cl.b.driver.envs = vec![];
            cl.b.driver.spawn();
        }
        let t = arrived(&cl.b.driver, &moved.volume_id, 180).await;
        assert!(t.incremental, "[{name}] {t:?}");
        assert!(
            t.data_bytes < 8 * MIB as u64,
            "[{name}] {} bytes sent",
            t.data_bytes
        );
        assert_eq!(
            first_difference(
                &snapshot_image(&cl.a.pool, &s2.snapshot_id),
                &volume_image(&cl.b.pool, &moved.volume_id)
            ),
            None,
            "[{name}] the images differ"
        );
        if !dies {
            assert!(t.resumed >= 1, "[{name}] never cut: {t:?}");
        }
        cl.b.driver.envs = vec![];
    }
}

/// Restores `snap` on node B as `name`; kills the node given at the point
/// given, restarts it without failpoints, and checks that the volume arrives
/// whole.
async fn killed_and_resumed(cl: &mut Cluster, snap: &csi::Snapshot, name: &str, failpoint: &str) {
    cl.b.driver.envs = vec![(FAILPOINTS.into(), failpoint.into())];
    cl.b.driver.restart();
    let mut r = cl.router.clients().await;
    let moved = must_create(
        &mut r.controller,
        create_from(name, NODE_B, 256 * MIB, snapshot_source(&snap.snapshot_id)),
    )
    .await;
    assert!(
        cl.b.driver.wait_exit(120).is_some(),
        "[{failpoint}] node B did not die at the failpoint"
    );
    cl.b.driver.envs = vec![];
    cl.b.driver.spawn();
    // Killed before its record moved on, the transfer goes on from the
    // checkpoint before (here, the start); after it, from there.
    arrived(&cl.b.driver, &moved.volume_id, 180).await;
    let src = snapshot_image(&cl.a.pool, &snap.snapshot_id);
    let dst = volume_image(&cl.b.pool, &moved.volume_id);
    assert_eq!(
        first_difference(&src, &dst),
        None,
        "[{failpoint}] the images differ"
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_transfer_cut_by_a_crash_of_either_node_goes_on_and_arrives_whole() {
    let mut cl = cluster(&[]);
    let mut r = cl.router.clients().await;
    // More data than one checkpoint's worth (64 MiB).
    let snap = snapshot_with_data(&cl, "src", 256 * MIB, 100).await;

    // The target dies after a checkpoint, then just before the volume is
    // declared whole.
    killed_and_resumed(&mut cl, &snap, "pvc-r1", "transfer.after-checkpoint-data").await;
    killed_and_resumed(&mut cl, &snap, "pvc-r2", "transfer.before-unmark").await;

    // The source dies in the middle of a transfer: the target waits, and
    // goes on from where it was once the source is back.
    let snap2 = snapshot_with_data(&cl, "src2", 128 * MIB, 48).await;
    cl.b.driver.envs = vec![(BANDWIDTH.into(), "8Mi".into())];
    cl.b.driver.restart();
    let moved = must_create(
        &mut r.controller,
        create_from(
            "pvc-r3",
            NODE_B,
            128 * MIB,
            snapshot_source(&snap2.snapshot_id),
        ),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    cl.a.driver.kill9();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = transfers(&cl.b.driver).await;
        let t = now
            .iter()
            .find(|t| t.volume_id == local(&moved.volume_id))
            .cloned();
        if t.as_ref().is_some_and(|t| t.state == "waiting") {
            assert!(t.unwrap().message.contains(NODE_A));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the transfer never waited: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cl.a.driver.spawn();
    let done = arrived(&cl.b.driver, &moved.volume_id, 180).await;
    assert!(done.resumed >= 1, "{done:?}");
    assert_eq!(
        first_difference(
            &snapshot_image(&cl.a.pool, &snap2.snapshot_id),
            &volume_image(&cl.b.pool, &moved.volume_id)
        ),
        None
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_nodes_bandwidth_is_shared_by_its_transfers_and_a_class_caps_its_own() {
    // Node B reads 16 MiB/s in all: two transfers at once share it. Each
    // from a volume of its own, so that none starts from what another
    // brought.
    let cl = cluster_with(&[], &[(BANDWIDTH, "16Mi")]);
    let mut r = cl.router.clients().await;
    let mut snaps = Vec::new();
    for tag in ["one", "two", "three"] {
        snaps.push(snapshot_with_data(&cl, tag, 64 * MIB, 16).await);
    }
    let restore = |name: &str, snap: &csi::Snapshot| {
        create_from(name, NODE_B, 64 * MIB, snapshot_source(&snap.snapshot_id))
    };
    // Each transfer sends all of its volume's data, and how long it must
    // take follows from what it sent.
    let sent = |t: &mesh::TransferStatus| {
        assert!(!t.incremental && t.data_bytes >= 16 * MIB as u64, "{t:?}");
        Duration::from_secs_f64(t.data_bytes as f64 / MIB as f64)
    };
    let started = Instant::now();
    let mut moved = Vec::new();
    for (name, snap) in [("pvc-one", &snaps[0]), ("pvc-two", &snaps[1])] {
        moved.push(must_create(&mut r.controller, restore(name, snap)).await);
    }
    let mut mib_seconds = Duration::ZERO;
    for v in &moved {
        mib_seconds += sent(&arrived(&cl.b.driver, &v.volume_id, 60).await);
    }
    // At 16 MiB/s for both together (each alone would take half).
    let (together, due) = (started.elapsed(), mib_seconds / 16);
    assert!(
        together >= due.mul_f64(0.85),
        "both arrived in {together:?}, under a node bandwidth of 16 MiB/s due in {due:?}"
    );

    // A class of 4 MiB/s caps its transfer under the node's 16.
    let mut req = restore("pvc-slow", &snaps[2]);
    req.parameters
        .insert("transferBandwidth".into(), "4Mi".into());
    let started = Instant::now();
    moved.push(must_create(&mut r.controller, req).await);
    let done = arrived(&cl.b.driver, &moved[2].volume_id, 60).await;
    let (alone, due) = (started.elapsed(), sent(&done) / 4);
    assert!(
        alone >= due.mul_f64(0.85),
        "it arrived in {alone:?}, under a class bandwidth of 4 MiB/s due in {due:?}: {done:?}"
    );
    for (v, snap) in moved.iter().zip(&snaps) {
        assert_eq!(
            first_difference(
                &snapshot_image(&cl.a.pool, &snap.snapshot_id),
                &volume_image(&cl.b.pool, &v.volume_id)
            ),
            None
        );
    }

    // A bandwidth that is no quantity is refused before anything is made.
    let mut bad = restore("pvc-bad", &snaps[0]);
    bad.parameters
        .insert("transferBandwidth".into(), "quick".into());
    let mut before = held_images(&cl.a.pool);
    before.sort();
    let e = r.controller.create_volume(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("transferBandwidth"), "{e:?}");
    // The hold the source made for it went with the refusal.
    let mut after = held_images(&cl.a.pool);
    after.sort();
    assert_eq!(after, before);
    assert_eq!(images_in(&cl.b.pool.path), 3);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_volume_attributes_class_caps_a_transfer_and_a_change_reaches_it_under_way() {
    // No cap of the node's: the volume's attributes alone slow it.
    let cl = cluster_with(&[], &[]);
    let mut r = cl.router.clients().await;
    let snap = snapshot_with_data(&cl, "src", 64 * MIB, 32).await;
    let mut req = create_from(
        "pvc-capped",
        NODE_B,
        64 * MIB,
        snapshot_source(&snap.snapshot_id),
    );
    // The class says 64 MiB/s; the attributes, 2 MiB/s, take its place.
    req.parameters
        .insert("transferBandwidth".into(), "64Mi".into());
    req.mutable_parameters
        .insert("transferBandwidth".into(), "2Mi".into());
    let moved = must_create(&mut r.controller, req).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let now = transfers(&cl.b.driver).await;
    let t = now
        .iter()
        .find(|t| t.volume_id == local(&moved.volume_id))
        .unwrap_or_else(|| panic!("no transfer of {}: {now:?}", moved.volume_id));
    // 32 MiB at 2 MiB/s: 16 s; far from done after 3.
    assert_eq!(t.state, "running", "{t:?}");
    assert!(t.rate <= 3 * MIB as u64, "{t:?}");

    // What ControllerModifyVolume refuses changes nothing.
    let modify = |v: &str| csi::ControllerModifyVolumeRequest {
        volume_id: moved.volume_id.clone(),
        mutable_parameters: [("transferBandwidth".to_string(), v.to_string())].into(),
        ..Default::default()
    };
    let e = r
        .controller
        .controller_modify_volume(modify("fast"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("transferBandwidth"), "{e:?}");
    // `client transfers --wait` gives up at its timeout, naming the
    // transfer's state; a volume that arrives from nowhere is not found.
    let wait = |volume: &str, secs: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_csi-driver"))
            .arg("client")
            .arg(format!(
                "--endpoint=unix://{}",
                cl.b.driver.socket.display()
            ))
            .args([
                "--output",
                "json",
                "transfers",
                "--wait",
                volume,
                "--timeout",
                secs,
            ])
            .output()
            .expect("run csi-driver client")
    };
    let out = wait(&moved.volume_id, "1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("DeadlineExceeded"),
        "{err}"
    );
    assert!(err.contains("running"), "{err}");
    let out = wait("pvc-nowhere", "1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("NotFound"), "{err}");

    // Another class: 0 lifts the cap, the class's own too; the transfer
    // under way takes it within a second and ends long before 16 s.
    let changed = Instant::now();
    r.controller
        .controller_modify_volume(modify("0"))
        .await
        .unwrap();
    // The client waits until the data is whole, and says so (a timeout
    // past what the clock counts is no timeout).
    let out = wait(&moved.volume_id, &u64::MAX.to_string());
    let waited = changed.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("\"state\": \"done\""), "{text}");
    let done = arrived(&cl.b.driver, &moved.volume_id, 30).await;
    assert!(
        text.contains(&format!("\"data_bytes\": {}", done.data_bytes)),
        "{text}"
    );
    assert!(waited < Duration::from_secs(8), "{waited:?}");
    assert!(
        changed.elapsed() < Duration::from_secs(8),
        "it arrived {:?} after the cap was lifted: {done:?}",
        changed.elapsed()
    );
    let image = volume_image(&cl.b.pool, &moved.volume_id);
    assert_eq!(
        first_difference(&snapshot_image(&cl.a.pool, &snap.snapshot_id), &image),
        None
    );
    // Only the volume's record keeps it: nothing on its image.
    let attr = csi_sys::xattr::get(&image, "example-csi.transferBandwidth").unwrap();
    assert_eq!(attr, None);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_hold_is_read_by_its_target_alone_and_a_delete_mid_transfer_leaves_nothing() {
    let cl = cluster_with(&[], &[(BANDWIDTH, "2Mi")]);
    let mut r = cl.router.clients().await;
    let snap = snapshot_with_data(&cl, "src", 128 * MIB, 32).await;
    let moved = must_create(
        &mut r.controller,
        create_from(
            "pvc-moved",
            NODE_B,
            128 * MIB,
            snapshot_source(&snap.snapshot_id),
        ),
    )
    .await;
    let hold = transfers(&cl.a.driver)
        .await
        .into_iter()
        .find(|t| t.role == "hold")
        .expect("node A holds the data for node B");
    assert_eq!(hold.peer_node, NODE_B);

    // Another node, the controller, a stranger, and even a node naming
    // itself the target (every node holds the key that signs nodes'
    // certificates) ask node A for that data without the hold's token.
    let (nodes, controller) = (cl.nodes_side(), cl.controller_side());
    let token = hold_token(&cl.a.pool);
    let id = hold.transfer_id.clone();
    let read = |mesh, role, token| read_hold(cl.a.port, mesh, role, id.clone(), token);
    use csi_mesh::tls::Role;
    let denied = Err(tonic::Code::PermissionDenied);
    assert_eq!(
        read(&nodes, Role::Node("node-c".into()), &token).await,
        denied
    );
    assert_eq!(read(&controller, Role::Controller, &token).await, denied);
    assert_eq!(read(&nodes, Role::Controller, &token).await, denied);
    assert_eq!(read(&nodes, Role::Node(NODE_B.into()), "").await, denied);
    // The real token with its last character changed (never to itself).
    let last = if token.ends_with('0') { '1' } else { '0' };
    let forged = format!("{}{last}", &token[..token.len() - 1]);
    assert_ne!(forged, token);
    assert_eq!(
        read(&nodes, Role::Node(NODE_B.into()), &forged).await,
        denied
    );
    let ch = agent_channel(cl.a.port, &stranger_mesh(), Role::Node(NODE_B.into())).await;
    if let Ok(ch) = ch {
        let e = mesh::transfer_client::TransferClient::new(ch)
            .read(mesh::ReadRequest {
                transfer_id: hold.transfer_id.clone(),
                from: 0,
                base_transfer_id: String::new(),
                read_token: token.clone(),
                patches: false,
                xxh3: true,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    }
    // Nor may another node, or the target without the token, let the hold go.
    for (role, token) in [("node-c", token.as_str()), (NODE_B, "")] {
        let ch = agent_channel(cl.a.port, &nodes, Role::Node(role.into()))
            .await
            .unwrap();
        let e = mesh::transfer_client::TransferClient::new(ch)
            .release(mesh::ReleaseRequest {
                transfer_id: hold.transfer_id.clone(),
                keep_as_base: false,
                read_token: token.to_string(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    }
    assert!(!held_images(&cl.a.pool).is_empty(), "the hold was let go");
    // The target with the token may: the refusals above are not a broken
    // agent.
    assert_eq!(
        read(&nodes, Role::Node(NODE_B.into()), &token).await,
        Ok(())
    );

    // Deleted while arriving: the transfer stops, the volume goes, and the
    // source lets its hold go.
    tokio::time::sleep(Duration::from_secs(1)).await;
    r.controller
        .delete_volume(delete_req(&moved.volume_id))
        .await
        .unwrap();
    assert!(!volume_image(&cl.b.pool, &moved.volume_id).exists());
    assert_eq!(images_in(&cl.b.pool.path), 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !held_images(&cl.a.pool).is_empty() {
        assert!(
            Instant::now() < deadline,
            "node A still holds {:?}",
            held_images(&cl.a.pool)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(transfers(&cl.b.driver).await.is_empty());
    let state = cl.b.driver.state.join("controller/transfers");
    let left: Vec<_> = std::fs::read_dir(&state)
        .map(|r| r.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
    // The same name again makes the volume anew, under the same id.
    let again = must_create(
        &mut r.controller,
        create_from(
            "pvc-moved",
            NODE_B,
            128 * MIB,
            snapshot_source(&snap.snapshot_id),
        ),
    )
    .await;
    assert_eq!(again.volume_id, moved.volume_id);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_restore_from_a_node_that_is_down_names_it_and_makes_nothing() {
    let mut cl = cluster(&[]);
    let snap = snapshot_with_data(&cl, "src", 64 * MIB, 8).await;
    cl.a.driver.kill9();
    let mut r = cl.router.clients().await;
    let req = create_from(
        "pvc-moved",
        NODE_B,
        64 * MIB,
        snapshot_source(&snap.snapshot_id),
    );
    let e = r.controller.create_volume(req.clone()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains(NODE_A), "{}", e.message());
    assert_eq!(
        images_in(&cl.b.pool.path),
        0,
        "something was made on node B"
    );
    assert!(transfers(&cl.b.driver).await.is_empty());
    // Once the source is back, the retry makes the volume and its data arrives.
    cl.a.driver.spawn();
    let moved = must_create(&mut r.controller, req).await;
    arrived(&cl.b.driver, &moved.volume_id, 120).await;
    assert_eq!(
        first_difference(
            &snapshot_image(&cl.a.pool, &snap.snapshot_id),
            &volume_image(&cl.b.pool, &moved.volume_id)
        ),
        None
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_snapshot_says_truthfully_where_it_can_be_restored() {
    let cl = cluster(&[]);
    let mut r = cl.router.clients().await;
    // An image snapshot: its data moves, so no topology (every node), and a
    // restore on the other node works.
    let image = snapshot_with_data(&cl, "img", 64 * MIB, 4).await;
    assert!(image.accessible_topology.is_empty(), "{image:?}");
    let restored = must_create(
        &mut r.controller,
        create_from(
            "pvc-img",
            NODE_B,
            64 * MIB,
            snapshot_source(&image.snapshot_id),
        ),
    )
    .await;
    assert_eq!(node_of(&restored.volume_id), NODE_B);

    // A directory snapshot's data moves too (its tree packed): no topology
    // either, and a restore on the other node works.
    let mut req = create_on("pvc-dir", NODE_A);
    req.parameters.insert("kind".into(), "dir".into());
    let dir = must_create(&mut r.controller, req).await;
    let dir_snap = must_snapshot(&mut r.controller, snapshot_req("snap-dir", &dir.volume_id)).await;
    assert!(dir_snap.accessible_topology.is_empty(), "{dir_snap:?}");
    let mut req = create_from(
        "pvc-dir-b",
        NODE_B,
        64 * MIB,
        snapshot_source(&dir_snap.snapshot_id),
    );
    req.parameters.insert("kind".into(), "dir".into());
    let restored = must_create(&mut r.controller, req).await;
    assert_eq!(node_of(&restored.volume_id), NODE_B);

    // ListSnapshots says the same as CreateSnapshot.
    let listed = r
        .controller
        .list_snapshots(csi::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    let topo_of = |id: &str| {
        listed
            .iter()
            .filter_map(|e| e.snapshot.as_ref())
            .find(|s| s.snapshot_id == id)
            .map(|s| s.accessible_topology.clone())
            .unwrap()
    };
    assert!(topo_of(&image.snapshot_id).is_empty());
    assert!(topo_of(&dir_snap.snapshot_id).is_empty());
}

/// Fills a directory with one of each kind of entry: nested folders, a
/// random file, a 64 MiB sparse file with one island of data, links (one
/// pointing outside), a fifo, other owners, setuid and setgid modes.
fn fill_tree(dir: &Path) {
    sh(
        "sh",
        &[
            "-c",
            &format!(
                "cd '{}' && mkdir -p a/b/c && head -c 3M /dev/urandom > a/b/big && \
                 truncate -s 64M a/b/c/sparse && \
                 printf island | dd of=a/b/c/sparse bs=1 seek=5242880 conv=notrunc status=none && \
                 echo hi > a/small && chmod 4751 a/small && ln -s /etc/shadow a/outside && \
                 ln -s ../small a/b/rel && mkfifo a/fifo && chown 1234:5678 a/b/big && \
                 chown -h 42:43 a/outside && chmod 2770 a/b/c && chmod 775 . && sync",
                dir.display()
            ),
        ],
    );
}

fn dir_from(name: &str, source: csi::VolumeContentSource) -> csi::CreateVolumeRequest {
    let mut req = create_from(name, NODE_B, 256 * MIB, source);
    req.parameters.insert("kind".into(), "dir".into());
    req
}

/// Nothing of a transfer left in a pool: no hold, no packed tree.
fn no_transfer_left(pool: &Pool) {
    assert!(held_images(pool).is_empty(), "{:?}", held_images(pool));
    let arriving: Vec<_> = std::fs::read_dir(pool.path.join(".arriving"))
        .map(|r| r.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(arriving.is_empty(), "{arriving:?}");
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_directory_volume_restored_and_cloned_on_another_node_arrives_equal() {
    // Node B holds the end of each transfer a moment before its unpack, so
    // that a stage is tried while the data is all here but not yet in place.
    let mut cl = cluster_with(&[], &[(FAILPOINTS, "transfer.before-unpack=1*sleep(4000)")]);
    let mut r = cl.router.clients().await;
    let mut req = sized_on("pvc-dir", NODE_A, 256 * MIB);
    req.parameters.insert("kind".into(), "dir".into());
    let v = must_create(&mut r.controller, req).await;
    let src = dir_volume(&cl.a.pool, &v.volume_id);
    fill_tree(&src);
    let want = tree_of(&src);
    let snap = must_snapshot(&mut r.controller, snapshot_req("snap-dir", &v.volume_id)).await;
    assert!(snap.accessible_topology.is_empty(), "{snap:?}");

    // A restore on the other node: made at once, never staged half-made.
    let restored = must_create(
        &mut r.controller,
        dir_from("pvc-dir-restored", snapshot_source(&snap.snapshot_id)),
    )
    .await;
    assert_eq!(node_of(&restored.volume_id), NODE_B);
    let staging = cl.b.pool.scratch("staging-early");
    let mut b = cl.b.driver.clients().await;
    let early = b
        .node
        .node_stage_volume(stage_req(
            &restored.volume_id,
            &staging,
            mount_cap("", writer()),
        ))
        .await
        .expect_err("a directory still arriving is staged");
    assert_eq!(early.code(), tonic::Code::Aborted, "{early:?}");
    let done = arrived(&cl.b.driver, &restored.volume_id, 120).await;
    let dst = dir_volume(&cl.b.pool, &restored.volume_id);
    assert_eq!(tree_of(&dst), want);
    // Holes stay holes, and only data travelled: 3 MiB and the island, not
    // the 64 MiB the sparse file reads as.
    assert!(allocated(&dst.join("a/b/c/sparse")) < MIB as u64);
    assert!(done.data_bytes < 4 * MIB as u64, "{done:?}");
    no_transfer_left(&cl.b.pool);
    no_transfer_left(&cl.a.pool);
    // A CO's retry of the call after the data arrived (its answer lost):
    // the same volume, and the hold the source makes again for it goes
    // with the call, nothing reading it.
    let again = must_create(
        &mut r.controller,
        dir_from("pvc-dir-restored", snapshot_source(&snap.snapshot_id)),
    )
    .await;
    assert_eq!(again.volume_id, restored.volume_id);
    no_transfer_left(&cl.a.pool);
    let m = mount(&cl.b, &restored.volume_id, "restored").await;
    assert_eq!(std::fs::read(m.target.join("a/small")).unwrap(), b"hi\n");
    unmount(&cl.b, &m).await;

    // A clone of the live volume, changed since the snapshot.
    std::fs::write(src.join("a/new"), b"written after the snapshot").unwrap();
    let want_now = tree_of(&src);
    let clone = must_create(
        &mut r.controller,
        dir_from("pvc-dir-clone", volume_source(&v.volume_id)),
    )
    .await;
    arrived(&cl.b.driver, &clone.volume_id, 120).await;
    assert_eq!(tree_of(&dir_volume(&cl.b.pool, &clone.volume_id)), want_now);

    // A directory's data is not made an image, nor an image's a directory.
    let mut as_image = dir_from("pvc-dir-as-image", snapshot_source(&snap.snapshot_id));
    as_image.parameters.remove("kind");
    let e = r.controller.create_volume(as_image).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let image_snap = snapshot_with_data(&cl, "img", 64 * MIB, 1).await;
    let e = r
        .controller
        .create_volume(dir_from(
            "pvc-image-as-dir",
            snapshot_source(&image_snap.snapshot_id),
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // Node B killed with all of the data here, before the unpack and after
    // it (before the mark is cleared): the next start unpacks it (again)
    // and it arrives equal.
    for (name, point) in [
        ("pvc-dir-k1", "transfer.before-unpack"),
        ("pvc-dir-k2", "transfer.before-unmark"),
    ] {
        cl.b.driver.envs = vec![(FAILPOINTS.into(), point.into())];
        cl.b.driver.restart();
        let mut r = cl.router.clients().await;
        let moved = must_create(
            &mut r.controller,
            dir_from(name, snapshot_source(&snap.snapshot_id)),
        )
        .await;
        assert!(
            cl.b.driver.wait_exit(120).is_some(),
            "[{point}] node B did not die at the failpoint"
        );
        cl.b.driver.envs = vec![];
        cl.b.driver.spawn();
        arrived(&cl.b.driver, &moved.volume_id, 120).await;
        assert_eq!(
            tree_of(&dir_volume(&cl.b.pool, &moved.volume_id)),
            want,
            "[{point}]"
        );
        no_transfer_left(&cl.b.pool);
    }

    // A delete of every copy leaves nothing on either node.
    let mut r = cl.router.clients().await;
    for id in [&restored.volume_id, &clone.volume_id] {
        r.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(!dir_volume(&cl.b.pool, id).exists(), "{id}");
    }
    no_transfer_left(&cl.a.pool);
}
