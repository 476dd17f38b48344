//! Volume and storage health through the real binary. Each condition the driver
//! reports is caused for real on a throwaway volume or pool (an image truncated,
//! replaced or removed, a mount gone or remounted read-only, ext4 errors raised
//! through the kernel's own sysfs trigger, an xfs shut down, btrfs blocks
//! corrupted under their checksums, a qgroup filled, a pool remounted, filled or
//! unmounted), and the RPC's answer is checked: its status and stable reason.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use csi_proto::csi;
use csi_proto::csi::StorageHealthErrorType as S;
use csi_proto::csi::VolumeHealthErrorType as H;
use tonic::Code;

/// A driver on its own pool, with a stage+publish helper.
struct Fx {
    c: Clients,
    // Kept for its Drop: the driver stops before the pool it uses goes.
    _driver: Driver,
    pool: Pool,
}

async fn fixture(pool_fs: &str, extra: &[&str]) -> Fx {
    let pool = Pool::new(pool_fs);
    let driver = Driver::start(&pool, extra);
    let c = driver.clients().await;
    Fx {
        c,
        _driver: driver,
        pool,
    }
}

struct InUse {
    id: String,
    staging: PathBuf,
    target: PathBuf,
}

impl Fx {
    /// Stages and publishes a volume.
    async fn use_again(&mut self, v: &InUse, cap: csi::VolumeCapability) {
        self.c
            .stage_and_publish(&v.id, &v.staging, &v.target, &cap)
            .await;
    }

    /// Creates a volume, stages and publishes it.
    async fn in_use(
        &mut self,
        name: &str,
        size: i64,
        cap: csi::VolumeCapability,
        params: &[(&str, &str)],
    ) -> InUse {
        let v = InUse {
            id: self.c.create(name, size, cap.clone(), params).await,
            staging: self.pool.scratch(&format!("staging-{name}")),
            target: self.pool.scratch("pods").join(name),
        };
        self.use_again(&v, cap).await;
        v
    }

    async fn unuse(&mut self, v: &InUse) {
        self.c
            .unpublish_and_unstage(&v.id, &v.target, &v.staging)
            .await;
    }

    async fn node(&mut self, id: &str) -> Vec<(H, String)> {
        health_reasons(&node_health(&mut self.c, id).await)
    }

    async fn controller(&mut self, id: &str) -> Vec<(H, String)> {
        health_reasons(&controller_health(&mut self.c, id).await)
    }

    async fn storage(&mut self) -> Vec<(S, String)> {
        let mut out: Vec<_> = self
            .c
            .node
            .node_get_storage_health(csi::NodeGetStorageHealthRequest::default())
            .await
            .unwrap()
            .into_inner()
            .backend_health
            .into_iter()
            .map(|b| {
                assert!(b.message.contains("pool default"), "{b:?}");
                (S::try_from(b.status).unwrap(), b.reason)
            })
            .collect();
        out.sort();
        out
    }

    fn image(&self, id: &str) -> PathBuf {
        self.pool.path.join("volumes").join(format!("{id}.img"))
    }
}

fn r(status: H, reason: &str) -> (H, String) {
    (status, reason.to_string())
}

fn s(status: S, reason: &str) -> (S, String) {
    (status, reason.to_string())
}

/// The block device mounted at `path`.
fn source_of(path: &Path) -> String {
    sh("findmnt", &["-n", "-o", "SOURCE", path.to_str().unwrap()])
        .trim()
        .to_string()
}

// ---------------------------------------------------------------- volumes

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_health_rpcs_validate_and_answer_healthy_volumes() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let v = fx
        .in_use("pvc-ok", 64 * MIB, mount_cap("ext4", writer()), &[])
        .await;
    assert_eq!(fx.node(&v.id).await, vec![]);
    assert_eq!(fx.controller(&v.id).await, vec![]);
    assert_eq!(fx.storage().await, vec![]);
    let h = node_health(&mut fx.c, &v.id).await;
    assert_eq!(h.volume_id, v.id);

    // Bad requests: the codes CSI names.
    let err =
        fx.c.node
            .node_get_volume_health(csi::NodeGetVolumeHealthRequest::default())
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err =
        fx.c.node
            .node_get_volume_health(csi::NodeGetVolumeHealthRequest {
                volume_id: v.id.clone(),
                volume_publish_path: "relative/path".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let unknown = "00000000-0000-5000-8000-000000000000";
    let err =
        fx.c.node
            .node_get_volume_health(csi::NodeGetVolumeHealthRequest {
                volume_id: unknown.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    for id in ["", unknown] {
        let err =
            fx.c.controller
                .controller_get_volume_health(csi::ControllerGetVolumeHealthRequest {
                    volume_id: id.into(),
                    ..Default::default()
                })
                .await
                .unwrap_err();
        let want = if id.is_empty() {
            Code::InvalidArgument
        } else {
            Code::NotFound
        };
        assert_eq!(err.code(), want, "{id:?}: {err:?}");
    }
    let err =
        fx.c.controller
            .controller_list_volume_health(csi::ControllerListVolumeHealthRequest {
                max_entries: -1,
                ..Default::default()
            })
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // A path the caller names is the one checked.
    let elsewhere = fx.pool.scratch("never-mounted");
    let h =
        fx.c.node
            .node_get_volume_health(csi::NodeGetVolumeHealthRequest {
                volume_id: v.id.clone(),
                volume_publish_path: elsewhere.display().to_string(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume_health
            .unwrap();
    assert_eq!(
        health_reasons(&h),
        vec![r(H::Inaccessible, "PublishMountMissing")]
    );
    fx.unuse(&v).await;
    // Unstaged, the node has nothing of it mounted to worry about.
    assert_eq!(fx.node(&v.id).await, vec![]);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_mounts_read_only_or_gone_are_reported() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let v = fx
        .in_use("pvc-mounts", 64 * MIB, mount_cap("ext4", writer()), &[])
        .await;
    // The filesystem turns read-only under a read-write publish (as ext4's
    // errors=remount-ro does).
    remount(&v.staging, true);
    let ro = fx.node(&v.id).await;
    remount(&v.staging, false);
    assert_eq!(ro, vec![r(H::Degraded, "FilesystemReadOnly")]);
    assert_eq!(fx.node(&v.id).await, vec![], "healthy again once rw");
    // The controller sees nothing of mounts.
    assert_eq!(fx.controller(&v.id).await, vec![]);

    // Mounts vanish behind the driver's back.
    umount(&v.target);
    assert_eq!(
        fx.node(&v.id).await,
        vec![r(H::Inaccessible, "PublishMountMissing")]
    );
    // Something else is mounted at the staging path.
    umount(&v.staging);
    sh(
        "mount",
        &["-t", "tmpfs", "tmpfs", v.staging.to_str().unwrap()],
    );
    assert_eq!(
        fx.node(&v.id).await,
        vec![
            r(H::Inaccessible, "MountReplaced"),
            r(H::Inaccessible, "PublishMountMissing")
        ]
    );
    umount(&v.staging);
    assert_eq!(
        fx.node(&v.id).await,
        vec![
            r(H::Inaccessible, "PublishMountMissing"),
            r(H::Inaccessible, "StagingMountMissing")
        ]
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_image_truncated_replaced_or_removed_is_reported() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let cap = mount_cap("ext4", writer());

    // Truncated under a staged volume: data beyond the new end is lost, as
    // both the controller (record size) and the node (loop device size) see.
    let short = fx.in_use("pvc-short", 64 * MIB, cap.clone(), &[]).await;
    sh(
        "truncate",
        &["-s", "16M", fx.image(&short.id).to_str().unwrap()],
    );
    assert_eq!(
        fx.controller(&short.id).await,
        vec![r(H::DataLoss, "ImageTruncated")]
    );
    assert!(
        fx.node(&short.id)
            .await
            .contains(&r(H::DataLoss, "ImageTruncated")),
        "{:?}",
        fx.node(&short.id).await
    );

    // Moved away and copied back: the loop device still serves the moved
    // file, and what is written now goes where the volume's path no longer
    // leads.
    let replaced = fx.in_use("pvc-replaced", 64 * MIB, cap.clone(), &[]).await;
    let image = fx.image(&replaced.id);
    let moved = image.with_extension("img.moved");
    std::fs::rename(&image, &moved).unwrap();
    sh(
        "cp",
        &[
            "--sparse=always",
            moved.to_str().unwrap(),
            image.to_str().unwrap(),
        ],
    );
    assert_eq!(
        fx.node(&replaced.id).await,
        vec![r(H::DataLoss, "LoopBackingReplaced")]
    );
    assert_eq!(
        fx.controller(&replaced.id).await,
        vec![],
        "the file is whole"
    );

    // Replaced by a copy renamed over it: the old file is gone.
    let overwritten = fx
        .in_use("pvc-overwritten", 64 * MIB, cap.clone(), &[])
        .await;
    let image = fx.image(&overwritten.id);
    let copy = image.with_extension("copy");
    sh(
        "cp",
        &[
            "--sparse=always",
            image.to_str().unwrap(),
            copy.to_str().unwrap(),
        ],
    );
    std::fs::rename(&copy, &image).unwrap();
    assert_eq!(
        fx.node(&overwritten.id).await,
        vec![r(H::DataLoss, "LoopBackingDeleted")]
    );

    // Removed: the controller finds no image; the node also sees the loop
    // device serving a deleted file.
    let removed = fx.in_use("pvc-removed", 64 * MIB, cap.clone(), &[]).await;
    std::fs::remove_file(fx.image(&removed.id)).unwrap();
    assert_eq!(
        fx.controller(&removed.id).await,
        vec![r(H::Inaccessible, "ImageMissing")]
    );
    assert_eq!(
        fx.node(&removed.id).await,
        vec![
            r(H::Inaccessible, "ImageMissing"),
            r(H::DataLoss, "LoopBackingDeleted")
        ]
    );

    // ControllerListVolumeHealth lists exactly the two it can see.
    let listed: Vec<String> =
        fx.c.controller
            .controller_list_volume_health(csi::ControllerListVolumeHealthRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
            .into_iter()
            .map(|e| e.volume_id)
            .collect();
    let mut want = vec![short.id.clone(), removed.id.clone()];
    want.sort();
    assert_eq!(listed, want);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_ext4_errors_recorded_by_the_kernel_are_reported() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let v = fx
        .in_use(
            "pvc-ext4-errors",
            64 * MIB,
            mount_cap("ext4", writer()),
            &[],
        )
        .await;
    let dev = source_of(&v.staging);
    let name = Path::new(&dev).file_name().unwrap().to_str().unwrap();
    // ext4's own test hook raises an error as a corruption would.
    std::fs::write(format!("/sys/fs/ext4/{name}/trigger_fs_error"), "1").unwrap();
    let found = fx.node(&v.id).await;
    assert!(
        found.contains(&r(H::Degraded, "FilesystemErrors")),
        "{found:?}"
    );
    let h = node_health(&mut fx.c, &v.id).await;
    let msg = &h
        .health_statuses
        .iter()
        .find(|e| e.reason == "FilesystemErrors")
        .unwrap()
        .message;
    assert!(
        msg.contains("1 error(s)") && msg.contains("trigger_test_error"),
        "{msg}"
    );
    // The next stage checks the filesystem, and e2fsck clears the record.
    fx.unuse(&v).await;
    fx.use_again(&v, mount_cap("ext4", writer())).await;
    assert_eq!(fx.node(&v.id).await, vec![]);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_xfs_shut_down_is_inaccessible() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let v = fx
        .in_use("pvc-xfs-down", 300 * MIB, mount_cap("xfs", writer()), &[])
        .await;
    assert_eq!(fx.node(&v.id).await, vec![]);
    sh(
        "xfs_io",
        &["-x", "-c", "shutdown", v.staging.to_str().unwrap()],
    );
    assert_eq!(
        fx.node(&v.id).await,
        vec![r(H::Inaccessible, "FilesystemShutDown")]
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_btrfs_checksum_failures_are_data_loss() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let cap = mount_cap("btrfs", writer());
    let v = fx
        .in_use("pvc-btrfs-csum", 128 * MIB, cap.clone(), &[])
        .await;
    let marker = b"HEALTH-CHECKSUM-MARKER-";
    let data: Vec<u8> = marker.iter().copied().cycle().take(1024 * 1024).collect();
    std::fs::write(v.target.join("data"), &data).unwrap();
    sh("sync", &[]);
    fx.unuse(&v).await;
    // Flip bytes of the file's data in the image, behind btrfs's back.
    let image = fx.image(&v.id);
    let bytes = std::fs::read(&image).unwrap();
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("the data is in the image");
    drop(bytes);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"XXXX", at as u64).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fx.use_again(&v, cap).await;
    assert_eq!(fx.node(&v.id).await, vec![], "nothing read back yet");
    let read = std::fs::read(v.target.join("data"));
    assert!(read.is_err(), "btrfs refuses the corrupted block");
    assert_eq!(fx.node(&v.id).await, vec![r(H::DataLoss, "ChecksumErrors")]);
}

#[tokio::test]
#[ignore = "needs root: loop devices, mounts and btrfs qgroups"]
async fn root_dir_volumes_missing_or_at_their_quota_are_reported() {
    require_root();
    let mut fx = fixture("btrfs", &[]).await;
    let cap = mount_cap("", writer());
    let v = fx
        .in_use("pvc-quota", 16 * MIB, cap.clone(), &[("kind", "dir")])
        .await;
    assert_eq!(fx.controller(&v.id).await, vec![]);
    // Fill it to its qgroup limit.
    let mut f = std::fs::File::create(v.target.join("fill")).unwrap();
    let chunk = vec![7u8; 1024 * 1024];
    let mut full = false;
    for _ in 0..64 {
        use std::io::Write;
        if f.write_all(&chunk).and_then(|_| f.sync_all()).is_err() {
            full = true;
            break;
        }
    }
    drop(f);
    sh("sync", &[]);
    assert!(full, "the qgroup limit stops writes");
    assert_eq!(
        fx.controller(&v.id).await,
        vec![r(H::Degraded, "QuotaExceeded")]
    );
    assert_eq!(fx.node(&v.id).await, vec![r(H::Degraded, "QuotaExceeded")]);

    // A subvolume deleted behind the driver's back.
    let gone =
        fx.c.create("pvc-gone", 16 * MIB, cap, &[("kind", "dir")])
            .await;
    let path = fx.pool.path.join("volumes").join(&gone);
    sh("btrfs", &["subvolume", "delete", path.to_str().unwrap()]);
    assert_eq!(
        fx.controller(&gone).await,
        vec![r(H::Inaccessible, "SubvolumeMissing")]
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_plain_dir_volume_missing_is_inaccessible() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let id =
        fx.c.create(
            "pvc-dir",
            16 * MIB,
            mount_cap("", writer()),
            &[("kind", "dir")],
        )
        .await;
    assert_eq!(fx.controller(&id).await, vec![]);
    std::fs::remove_dir_all(fx.pool.path.join("volumes").join(&id)).unwrap();
    assert_eq!(
        fx.controller(&id).await,
        vec![r(H::Inaccessible, "DirectoryMissing")]
    );
}

// ---------------------------------------------------------------- pools

#[tokio::test]
#[ignore = "needs root: loop-mounted pools"]
async fn root_storage_health_follows_the_pool() {
    require_root();
    let mut fx = fixture("ext4", &["--pool-full-percent=50"]).await;
    assert_eq!(fx.storage().await, vec![]);

    // Filled past the threshold, then freed.
    let filler = fx.pool.path.join("filler");
    let free = nix::sys::statvfs::statvfs(&fx.pool.path).unwrap();
    let want = free.blocks_available() * free.fragment_size() * 3 / 4;
    sh(
        "fallocate",
        &["-l", &want.to_string(), filler.to_str().unwrap()],
    );
    assert_eq!(
        fx.storage().await,
        vec![s(S::StorageDegraded, "PoolNearlyFull")]
    );
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(fx.storage().await, vec![]);

    // Remounted read-only.
    let root = fx.pool.path.to_str().unwrap().to_string();
    remount(&fx.pool.path, true);
    let ro = fx.storage().await;
    remount(&fx.pool.path, false);
    assert_eq!(ro, vec![s(S::StorageUnreachable, "PoolReadOnly")]);

    // Errors recorded by the pool's own ext4.
    let dev = source_of(&fx.pool.path);
    let name = Path::new(&dev).file_name().unwrap().to_str().unwrap();
    std::fs::write(format!("/sys/fs/ext4/{name}/trigger_fs_error"), "1").unwrap();
    // The kernel counts the error in the superblock from a work queue, a moment
    // after the error itself.
    let mut seen = fx.storage().await;
    for _ in 0..50 {
        if !seen.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        seen = fx.storage().await;
    }
    assert_eq!(seen, vec![s(S::StorageDegraded, "FilesystemErrors")]);

    // Its filesystem unmounted: the pool's directory is empty.
    umount(&fx.pool.path);
    let gone = fx.storage().await;
    let image = fx.pool.dir.path().join("pool.img");
    sh("mount", &["-o", "loop", image.to_str().unwrap(), &root]);
    assert_eq!(gone, vec![s(S::StorageUnreachable, "PoolMissing")]);
}

#[tokio::test]
#[ignore = "needs root: loop-mounted pools"]
async fn root_pool_shut_down_makes_images_unreadable() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let id =
        fx.c.create(
            "pvc-on-a-dying-pool",
            64 * MIB,
            mount_cap("ext4", writer()),
            &[],
        )
        .await;
    assert_eq!(fx.controller(&id).await, vec![]);
    sh(
        "xfs_io",
        &["-x", "-c", "shutdown", fx.pool.path.to_str().unwrap()],
    );
    assert_eq!(
        fx.controller(&id).await,
        vec![r(H::Inaccessible, "ImageUnreadable")]
    );
    assert_eq!(
        fx.storage().await,
        vec![
            s(S::StorageUnreachable, "FilesystemShutDown"),
            s(S::StorageUnreachable, "PoolUnreadable")
        ]
    );
}

// ---------------------------------------------------------------- metrics

/// The value of one series, named with its labels as the driver writes them.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_health_problems_show_in_the_metrics() {
    require_root();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let address = format!("--metrics-address=127.0.0.1:{port}");
    let mut fx = fixture(
        "xfs",
        &[
            &address,
            "--metrics-health-max-age=0",
            "--metrics-max-age=0",
        ],
    )
    .await;
    let cap = mount_cap("ext4", writer());
    let mut ids = Vec::new();
    for name in ["pvc-short", "pvc-gone", "pvc-gone-too", "pvc-fine"] {
        ids.push(fx.c.create(name, 64 * MIB, cap.clone(), &[]).await);
    }
    let truncated =
        r#"example_csi_volumes_unhealthy{error_type="DATA_LOSS",reason="ImageTruncated"}"#;
    let missing =
        r#"example_csi_volumes_unhealthy{error_type="INACCESSIBLE",reason="ImageMissing"}"#;
    let healthy = r#"example_csi_pool_healthy{pool="default"}"#;
    let read_only = r#"example_csi_pool_health_problems{pool="default",error_type="STORAGE_UNREACHABLE",reason="PoolReadOnly"}"#;

    let text = scrape(port);
    assert_eq!(value(&text, healthy), Some(1.0), "{text}");
    assert!(!text.contains("example_csi_volumes_unhealthy{"), "{text}");
    assert!(
        !text.contains("example_csi_pool_health_problems{"),
        "{text}"
    );
    assert!(value(&text, "example_csi_health_check_age_seconds").is_some_and(|a| a < 5.0));

    sh(
        "truncate",
        &["-s", "16M", fx.image(&ids[0]).to_str().unwrap()],
    );
    std::fs::remove_file(fx.image(&ids[1])).unwrap();
    std::fs::remove_file(fx.image(&ids[2])).unwrap();
    let text = scrape(port);
    assert_eq!(value(&text, truncated), Some(1.0), "{text}");
    assert_eq!(value(&text, missing), Some(2.0), "{text}");

    remount(&fx.pool.path, true);
    let text = scrape(port);
    remount(&fx.pool.path, false);
    assert_eq!(value(&text, healthy), Some(0.0), "{text}");
    assert_eq!(value(&text, read_only), Some(1.0), "{text}");

    // Repaired: the problems' series are gone, not left at their last value.
    sh(
        "truncate",
        &["-s", "64M", fx.image(&ids[0]).to_str().unwrap()],
    );
    let text = scrape(port);
    assert_eq!(value(&text, healthy), Some(1.0), "{text}");
    assert_eq!(value(&text, read_only), None, "{text}");
    assert_eq!(value(&text, truncated), None, "{text}");
    assert_eq!(value(&text, missing), Some(2.0), "{text}");

    // The node's side: a volume it serves whose published mount went away.
    let served = "example_csi_node_volumes_unhealthy{";
    let unpublished = r#"example_csi_node_volumes_unhealthy{error_type="INACCESSIBLE",reason="PublishMountMissing"}"#;
    let v = fx.in_use("pvc-served", 64 * MIB, cap.clone(), &[]).await;
    let text = scrape(port);
    assert!(!text.contains(served), "{text}");
    umount(&v.target);
    let text = scrape(port);
    assert_eq!(value(&text, unpublished), Some(1.0), "{text}");
    fx.unuse(&v).await;
    let text = scrape(port);
    assert!(!text.contains(served), "{text}");
}
