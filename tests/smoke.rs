//! The basic life of a volume through the real binary: create, stage, publish,
//! write, unpublish, unstage, stage and publish again, read back, delete.

mod common;

use common::*;

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_volume_round_trip_keeps_data() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let cap = mount_cap("ext4", writer());
    let vol = c
        .controller
        .create_volume(create_req("pvc-smoke", 64 * MIB, cap.clone(), &[]))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let id = vol.volume_id.clone();
    let staging = pool.scratch("staging");
    let target = pool.scratch("pods").join("target");
    for round in 0..2 {
        c.node
            .node_stage_volume(stage_req(&id, &staging, cap.clone()))
            .await
            .unwrap();
        c.node
            .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
            .await
            .unwrap();
        let file = target.join("data");
        if round == 0 {
            std::fs::write(&file, b"hello from round 0").unwrap();
            nix::unistd::sync();
        } else {
            assert_eq!(std::fs::read(&file).unwrap(), b"hello from round 0");
        }
        c.node
            .node_unpublish_volume(csi_proto::csi::NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: target.display().to_string(),
            })
            .await
            .unwrap();
        assert!(!target.exists(), "unpublish removes the target it made");
        c.node
            .node_unstage_volume(csi_proto::csi::NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .unwrap();
        assert!(
            loops_below(pool.dir.path()).len() == 1,
            "only the pool's own loop device is left"
        );
    }
    c.controller
        .delete_volume(csi_proto::csi::DeleteVolumeRequest {
            volume_id: id,
            secrets: Default::default(),
        })
        .await
        .unwrap();
    let left: Vec<_> = std::fs::read_dir(pool.path.join("volumes"))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "the pool is empty after delete: {left:?}");
}
