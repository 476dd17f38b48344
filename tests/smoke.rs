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
    let vol = must_create(
        &mut c.controller,
        create_req("pvc-smoke", 64 * MIB, cap.clone(), &[]),
    )
    .await;
    let id = vol.volume_id.clone();
    let staging = pool.scratch("staging");
    let target = pool.scratch("pods").join("target");
    for round in 0..2 {
        c.stage_and_publish(&id, &staging, &target, &cap).await;
        let file = target.join("data");
        if round == 0 {
            std::fs::write(&file, b"hello from round 0").unwrap();
            nix::unistd::sync();
        } else {
            assert_eq!(std::fs::read(&file).unwrap(), b"hello from round 0");
        }
        c.node
            .node_unpublish_volume(unpublish_req(&id, &target))
            .await
            .unwrap();
        assert!(!target.exists(), "unpublish removes the target it made");
        c.node
            .node_unstage_volume(unstage_req(&id, &staging))
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
