//! `--cleanup-orphans`: after a crash that also lost the node's state (its node
//! record), the mounts and loop devices of a staged volume are orphans. Without
//! the flag the driver only reports them at start; with it, it unmounts and
//! detaches them, and the volume's data stays whole.

mod common;

use common::*;
use csi_proto::csi;

/// The driver's log since byte `from`.
fn log_since(d: &Driver, from: usize) -> String {
    d.log_text().get(from..).unwrap_or_default().to_string()
}

async fn orphans_on(fs: &str, kind: &str) {
    let pool = Pool::new(fs);
    let mut d = Driver::start(&pool, &[]);
    let mut c = d.clients().await;
    let cap = mount_cap("ext4", writer());
    let params: &[(&str, &str)] = &[("kind", kind)];
    // One name per test: volume ids derive from names, and tests run side by
    // side (a driver with --cleanup-orphans judges every mount on the machine).
    let req = create_req(&format!("pvc-orphan-{kind}"), 64 * MIB, cap.clone(), params);
    let vol = must_create(&mut c.controller, req).await;
    let id = vol.volume_id.clone();
    let scratch = pool.scratch("node");
    let staging = scratch.join("staging");
    let target = scratch.join("target");
    std::fs::create_dir_all(&staging).unwrap();
    c.stage_and_publish(&id, &staging, &target, &cap).await;
    std::fs::write(target.join("keep"), b"written before the crash").unwrap();
    nix::unistd::sync();
    let image = kind == "image";
    let volume_loops = || loops_below(&pool.path);
    assert_eq!(volume_loops().len(), usize::from(image));
    let mut mounted = mounts_below(&scratch);
    mounted.sort();
    assert_eq!(mounted, vec![staging.clone(), target.clone()]);

    // The crash, and the node's memory of the volume with it.
    drop(c);
    d.kill9();
    csi_storage::core::store::write_raw(&d.state.join("node/staged"), &id, None).unwrap();

    // Without the flag: reported, and nothing is touched.
    let from = d.log_text().len();
    d.spawn();
    let log = log_since(&d, from);
    assert!(
        log.contains("mount of a pool volume that no staged volume accounts for"),
        "the orphan mounts are reported:\n{log}"
    );
    for m in [&staging, &target] {
        assert!(
            log.contains(&m.display().to_string()),
            "{} is named in the log:\n{log}",
            m.display()
        );
    }
    if image {
        assert!(
            log.contains("loop device of a pool image that no staged volume accounts for"),
            "the orphan loop device is reported:\n{log}"
        );
    }
    let mut still = mounts_below(&scratch);
    still.sort();
    assert_eq!(still, mounted, "nothing is unmounted without the flag");
    assert_eq!(volume_loops().len(), usize::from(image));
    assert_eq!(
        std::fs::read(target.join("keep")).unwrap(),
        b"written before the crash"
    );

    // With the flag: unmounted and detached.
    d.kill9();
    d.args.push("--cleanup-orphans".to_string());
    let from = d.log_text().len();
    d.spawn();
    let log = log_since(&d, from);
    assert!(
        !log.contains("could not unmount") && !log.contains("could not detach"),
        "{log}"
    );
    assert!(
        mounts_below(&scratch).is_empty(),
        "orphan mounts are unmounted: {:?}\n{log}",
        mounts_below(&scratch)
    );
    assert!(
        volume_loops().is_empty(),
        "the orphan loop device is detached: {:?}\n{log}",
        volume_loops()
    );

    // The volume itself is intact: stage and publish again, and read back.
    let mut c = d.clients().await;
    c.stage_and_publish(&id, &staging, &target, &cap).await;
    assert_eq!(
        std::fs::read(target.join("keep")).unwrap(),
        b"written before the crash"
    );

    // A restart with the flag leaves a volume it knows alone.
    d.kill9();
    d.spawn();
    let mut c = d.clients().await;
    let mut now = mounts_below(&scratch);
    now.sort();
    assert_eq!(now, mounted, "a staged volume is no orphan");
    assert_eq!(volume_loops().len(), usize::from(image));

    c.unpublish_and_unstage(&id, &target, &staging).await;
    c.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: id,
            secrets: Default::default(),
        })
        .await
        .unwrap();
    assert!(mounts_below(&scratch).is_empty());
    assert!(volume_loops().is_empty());
    let log = d.log_text();
    assert!(!log.contains("panicked"), "the driver panicked:\n{log}");
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_cleanup_orphans_image_volume() {
    require_root();
    orphans_on("xfs", "image").await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_cleanup_orphans_dir_volume() {
    require_root();
    orphans_on("xfs", "dir").await;
}

/// Two instances of the driver on one node (two deployments, each with its own
/// pool): a volume of one is never the other's orphan, even when both hold a
/// volume of the same name (and so of the same id).
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_cleanup_orphans_leaves_another_instances_volumes_alone() {
    require_root();
    let (pool_a, pool_b) = (Pool::new("xfs"), Pool::new("xfs"));
    let a = Driver::start(&pool_a, &[]);
    let mut b = Driver::start(&pool_b, &[]);
    let cap = mount_cap("", writer());
    let dir: &[(&str, &str)] = &[("kind", "dir")];
    let mut ca = a.clients().await;
    let mut cb = b.clients().await;
    let id = ca.create("pvc-shared", 64 * MIB, cap.clone(), dir).await;
    cb.create("pvc-shared", 64 * MIB, cap.clone(), dir).await;
    let scratch = pool_a.scratch("node");
    let (staging, target) = (scratch.join("staging"), scratch.join("target"));
    std::fs::create_dir_all(&staging).unwrap();
    ca.stage_and_publish(&id, &staging, &target, &cap).await;
    drop(cb);
    b.kill9();
    b.args.push("--cleanup-orphans".to_string());
    b.spawn();
    let mut left = mounts_below(&scratch);
    left.sort();
    assert_eq!(left, vec![staging, target], "{}", b.log_text());
}

/// A loop device of a pool image attached by an earlier container of the node
/// plugin shows its backing file by the path that container had (here: through
/// a view of the pool that is gone). With its record lost it is still
/// recognised as the volume's, reported and, with the flag, detached.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_cleanup_orphans_finds_a_loop_attached_through_another_view() {
    require_root();
    let pool = Pool::new("xfs");
    let mut d = Driver::start(&pool, &[]);
    let mut c = d.clients().await;
    let cap = mount_cap("ext4", writer());
    let id = c.create("pvc-orphan-view", 64 * MIB, cap, &[]).await;
    drop(c);
    d.kill9();
    let image = pool.path.join("volumes").join(format!("{id}.img"));
    assert!(image.is_file(), "{}", image.display());

    // Attached through a view of the pool, which then goes away.
    let view = pool.scratch("view");
    sh(
        "mount",
        &[
            "--bind",
            pool.path.to_str().unwrap(),
            view.to_str().unwrap(),
        ],
    );
    let through_view = view.join("volumes").join(format!("{id}.img"));
    let dev = sh(
        "losetup",
        &["--find", "--show", through_view.to_str().unwrap()],
    );
    let dev = dev.trim().to_string();
    let backing_file = format!(
        "/sys/block/{}/loop/backing_file",
        dev.trim_start_matches("/dev/")
    );
    nix::mount::umount2(&view, nix::mount::MntFlags::MNT_DETACH).unwrap();
    let shown = std::fs::read_to_string(&backing_file).unwrap();
    assert!(
        !shown.trim().starts_with(pool.path.to_str().unwrap()),
        "the kernel shows the view's path, not the pool's: {shown}"
    );

    d.args.push("--cleanup-orphans".to_string());
    let from = d.log_text().len();
    d.spawn();
    let log = log_since(&d, from);
    let attached = std::path::Path::new(&backing_file).exists();
    if attached {
        // leave the machine clean even when the assertion below fails
        let _ = std::process::Command::new("losetup")
            .args(["-d", &dev])
            .status();
    }
    assert!(
        log.contains("loop device of a pool image that no staged volume accounts for"),
        "the orphan loop device is reported:\n{log}"
    );
    assert!(!attached, "{dev} is detached:\n{log}");
}
