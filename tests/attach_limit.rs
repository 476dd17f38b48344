//! `--max-volumes-per-node` on the node side, through the real binary: the
//! limit NodeGetInfo reports is the one NodeStageVolume and an ephemeral
//! NodePublishVolume enforce, with RESOURCE_EXHAUSTED, and a volume that is
//! staged already is not counted twice. (ControllerPublishVolume's side runs in
//! csi-sanity's attach-limit spec.)

mod common;

use std::path::PathBuf;

use common::*;
use csi_proto::csi;
use tonic::Code;

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_staging_beyond_the_limit_is_resource_exhausted() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &["--max-volumes-per-node=2"]);
    let mut c = driver.clients().await;
    let info = c
        .node
        .node_get_info(csi::NodeGetInfoRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.max_volumes_per_node, 2);

    let cap = block_cap(writer());
    let mut volumes: Vec<(String, PathBuf)> = Vec::new();
    for name in ["pvc-a", "pvc-b", "pvc-c"] {
        let id = create_volume_id(&mut c.controller, name, 16 * MIB, cap.clone()).await;
        volumes.push((id, pool.scratch(&format!("staging-{name}"))));
    }
    let stage = |i: usize| stage_req(&volumes[i].0, &volumes[i].1, cap.clone());
    let unstage = |i: usize| unstage_req(&volumes[i].0, &volumes[i].1);

    c.node.node_stage_volume(stage(0)).await.unwrap();
    c.node.node_stage_volume(stage(1)).await.unwrap();
    let e = c.node.node_stage_volume(stage(2)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(
        loops_below(&pool.path).len(),
        2,
        "the refused volume gets no loop device"
    );
    // A retry of a stage that succeeded is not a third volume.
    c.node.node_stage_volume(stage(1)).await.unwrap();

    // An ephemeral inline volume is staged too, and counts the same.
    let target = pool.scratch("pods").join("inline");
    let e = c
        .node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: "csi-limit-inline".into(),
            target_path: target.display().to_string(),
            volume_capability: Some(mount_cap("ext4", writer())),
            volume_context: [("csi.storage.k8s.io/ephemeral", "true"), ("size", "16Mi")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");

    // A slot freed is a slot taken.
    c.node.node_unstage_volume(unstage(0)).await.unwrap();
    c.node.node_stage_volume(stage(2)).await.unwrap();
    for i in [1, 2] {
        c.node.node_unstage_volume(unstage(i)).await.unwrap();
    }
    assert!(loops_below(&pool.path).is_empty());
}
