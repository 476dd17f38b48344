//! The central deployment's topology: a controller process (`--mode controller`)
//! and a node plugin process (`--mode node`) on one pool and one state dir, as
//! real binaries. Each mode owns its state, a second process of a mode refuses
//! to start, and what the two must coordinate (a freeze against an unmount, a
//! delete against a stage) goes through the volume's lock file; the races are
//! forced with failpoints. The node plugin fills a new volume from the template
//! the controller made.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use csi_proto::csi;
use tonic::Code;

/// The controller and the node plugin, started on one pool and state dir; the
/// failpoints of each in `ctl_fp` and `node_fp` (empty for none).
fn start(pool: &Pool, ctl_fp: &str, node_fp: &str) -> (Driver, Driver) {
    let env = |fp: &str| -> Vec<(&str, String)> {
        if fp.is_empty() {
            Vec::new()
        } else {
            vec![("EXAMPLE_CSI_FAILPOINTS", fp.to_string())]
        }
    };
    let ce = env(ctl_fp);
    let ce: Vec<(&str, &str)> = ce.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let ctl = Driver::start_with_env(pool, &["--mode=controller"], &ce);
    let ne = env(node_fp);
    let ne: Vec<(&str, &str)> = ne.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let node = ctl.start_beside("node", &["--mode=node"], &ne);
    (ctl, node)
}

/// Whether the filesystem mounted at `mp` is frozen: a second freeze of a frozen
/// filesystem fails with EBUSY; one that succeeds is undone at once. (Only asked
/// once the driver's freeze is known to be done or over: the probe's own freeze
/// would otherwise make the driver's fail.)
fn is_frozen(mp: &Path) -> bool {
    let out = Command::new("fsfreeze").arg("-f").arg(mp).output().unwrap();
    if out.status.success() {
        let _ = Command::new("fsfreeze").arg("-u").arg(mp).status();
        return false;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("busy"), "fsfreeze -f {}: {err}", mp.display());
    true
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen in {secs} s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn freeze_markers(state: &Path) -> usize {
    std::fs::read_dir(state.join("shared/frozen"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Runs the binary the way a second process would be started, and returns its
/// exit status and stderr once it ends (it must end on its own).
fn run_second(args: &[String]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_csi-driver"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status.code(), err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("a second process of a mode kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_second_process_of_one_mode_on_one_state_refuses_to_start() {
    require_root();
    let pool = Pool::new("xfs");
    let (ctl, node) = start(&pool, "", "");
    for (mode, name) in [("controller", "ctl2"), ("node", "node2"), ("all", "all2")] {
        let socket = ctl.socket.with_file_name(format!("{name}.sock"));
        let mut args = ctl.args_beside(&socket);
        args.push(format!("--mode={mode}"));
        let (code, err) = run_second(&args);
        assert_eq!(code, Some(2), "--mode {mode}: exit status; stderr: {err}");
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| l.starts_with("csi-driver:"))
            .collect();
        assert_eq!(lines.len(), 1, "--mode {mode}: one line of error: {err}");
        assert!(
            lines[0].contains("one process per mode and state dir"),
            "--mode {mode}: {}",
            lines[0]
        );
        assert!(!socket.exists(), "--mode {mode} made its socket");
    }
    // Both first processes still serve.
    for d in [&ctl, &node] {
        assert!(d.probe_ready().await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_the_node_waits_for_the_controllers_freeze_and_its_restart_does_not_thaw() {
    require_root();
    let pool = Pool::new("xfs");
    // The first copy under a freeze stays frozen for 6 s.
    let (ctl, mut node) = start(&pool, "freeze.after-freeze=1*sleep(6000)", "");
    let mut c = ctl.clients().await.controller;
    let mut n = node.clients().await.node;
    let cap = mount_cap("xfs", writer());
    let id = create_volume_id(&mut c, "pvc-frozen", 512 * MIB, cap.clone()).await;
    let staging = pool.scratch("staging");
    let target = pool.scratch("target");
    n.node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    n.node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
        .await
        .unwrap();
    std::fs::write(target.join("before.txt"), b"written before the snapshot").unwrap();

    let mut c2 = c.clone();
    let snap_id = id.clone();
    let snapshot = tokio::spawn(async move {
        c2.create_snapshot(snapshot_req("snap-frozen", &snap_id))
            .await
            .map(|r| r.into_inner())
    });
    wait_for("the controller's freeze", 20, || {
        ctl.log_text()
            .contains("failpoint freeze.after-freeze reached")
    });
    assert!(is_frozen(&staging));
    assert_eq!(freeze_markers(&ctl.state), 1);

    // The node plugin refuses to unmount what the controller holds frozen.
    let err = n
        .node_unpublish_volume(unpublish_req(&id, &target))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    let err = n
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    // A restart of the node plugin mid-copy leaves the freeze alone.
    node.restart();
    assert!(
        is_frozen(&staging),
        "the node plugin's start thawed the controller's freeze"
    );
    assert_eq!(freeze_markers(&ctl.state), 1);

    let snap = snapshot.await.unwrap().expect("the snapshot");
    assert!(snap.snapshot.unwrap().ready_to_use);
    assert!(!is_frozen(&staging), "thawed once the copy ended");
    assert_eq!(freeze_markers(&ctl.state), 0);
    let mut n = node.clients().await.node;
    n.node_unpublish_volume(unpublish_req(&id, &target))
        .await
        .unwrap();
    n.node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    assert!(mounts_below(pool.dir.path())
        .iter()
        .all(|m| m == &pool.path));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_controller_killed_while_frozen_is_thawed_by_its_own_restart() {
    require_root();
    let pool = Pool::new("xfs");
    // Every copy under a freeze hangs: the controller is killed in it.
    let (mut ctl, mut node) = start(&pool, "freeze.after-freeze=sleep(120000)", "");
    let mut c = ctl.clients().await.controller;
    let mut n = node.clients().await.node;
    let cap = mount_cap("xfs", writer());
    let id = create_volume_id(&mut c, "pvc-killed", 512 * MIB, cap.clone()).await;
    let staging = pool.scratch("staging");
    n.node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    let mut c2 = c.clone();
    let snap_id = id.clone();
    let snapshot = tokio::spawn(async move {
        let _ = c2
            .create_snapshot(snapshot_req("snap-killed", &snap_id))
            .await;
    });
    wait_for("the controller's freeze", 20, || {
        ctl.log_text()
            .contains("failpoint freeze.after-freeze reached")
    });
    assert!(is_frozen(&staging));
    assert_eq!(freeze_markers(&ctl.state), 1);
    ctl.kill9();
    let _ = snapshot.await;
    assert!(is_frozen(&staging));

    // The node plugin, and its restart, leave it to the controller.
    let err = n
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    assert!(err.message().contains("frozen"), "{}", err.message());
    node.restart();
    assert!(is_frozen(&staging));
    let mut n = node.clients().await.node;
    let err = n
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");

    // The controller's restart thaws it and removes the half-made snapshot.
    ctl.envs.clear();
    ctl.spawn();
    assert!(!is_frozen(&staging));
    assert_eq!(freeze_markers(&ctl.state), 0);
    assert!(std::fs::read_dir(pool.path.join("snapshots"))
        .unwrap()
        .next()
        .is_none());
    n.node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    let mut c = ctl.clients().await.controller;
    c.delete_volume(delete_req(&id)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_delete_and_a_stage_from_the_two_processes_exclude_each_other() {
    require_root();
    let pool = Pool::new("xfs");
    // The first delete, and the first node operation, pause with the volume's
    // lock held.
    let (ctl, node) = start(
        &pool,
        "delete-volume.after-volume-lock=1*sleep(3000)",
        "node.after-volume-lock=1*sleep(3000)",
    );
    let mut c = ctl.clients().await.controller;
    let mut n = node.clients().await.node;
    let cap = mount_cap("xfs", writer());
    let mut ids = Vec::new();
    for name in ["pvc-deleted", "pvc-staged"] {
        ids.push(create_volume_id(&mut c, name, 512 * MIB, cap.clone()).await);
    }
    let staging = pool.scratch("staging");

    // A stage while the controller deletes: refused, and then there is nothing
    // to stage.
    let (deleted, staged) = (ids[0].clone(), ids[1].clone());
    let mut c2 = c.clone();
    let id = deleted.clone();
    let delete = tokio::spawn(async move { c2.delete_volume(delete_req(&id)).await });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let err = n
        .node_stage_volume(stage_req(&deleted, &staging, cap.clone()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    delete.await.unwrap().expect("the delete");
    let err = n
        .node_stage_volume(stage_req(&deleted, &staging, cap.clone()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    // A delete while the node stages: refused, then refused because it is staged.
    let mut n2 = n.clone();
    let (id, st, cp) = (staged.clone(), staging.clone(), cap.clone());
    let stage = tokio::spawn(async move { n2.node_stage_volume(stage_req(&id, &st, cp)).await });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let err = c.delete_volume(delete_req(&staged)).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    stage.await.unwrap().expect("the stage");
    let err = c.delete_volume(delete_req(&staged)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(pool.path.join(format!("volumes/{staged}.img")).is_file());

    // The controller changes the loop device of a volume the node has staged
    // through the node plugin's process: on the device at once, and recorded.
    let image = pool.path.join(format!("volumes/{staged}.img"));
    let recorded = || {
        csi_sys::xattr::get(&image, "example-csi.readAheadKiB")
            .unwrap()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    };
    let devices = loops_below(&pool.path);
    assert_eq!(devices.len(), 1, "one loop device serves the staged volume");
    let read_ahead = || loop_settings(&devices[0]).1;
    let modify = |kib: &str| csi::ControllerModifyVolumeRequest {
        volume_id: staged.clone(),
        mutable_parameters: [("readAheadKiB".to_string(), kib.to_string())].into(),
        ..Default::default()
    };
    c.controller_modify_volume(modify("512")).await.unwrap();
    assert_eq!(
        read_ahead(),
        "512",
        "the staged volume's device has the new read-ahead"
    );
    assert_eq!(recorded().as_deref(), Some("512"));

    // Without its node plugin, a change of the staged volume is refused and
    // nothing changes.
    let mut node = node;
    node.stop();
    let err = c
        .controller_modify_volume(modify("1024"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("node plugin"), "{err:?}");
    assert_eq!(recorded().as_deref(), Some("512"), "the attribute was kept");
    assert_eq!(read_ahead(), "512", "the device was not changed");
    node.spawn();
    let mut n = node.clients().await.node;
    let modify = modify("1024");

    n.node_unstage_volume(unstage_req(&staged, &staging))
        .await
        .unwrap();
    c.controller_modify_volume(modify).await.unwrap();
    c.delete_volume(delete_req(&staged)).await.unwrap();
    assert!(std::fs::read_dir(pool.path.join("volumes"))
        .unwrap()
        .next()
        .is_none());
    let locks = volume_locks(&ctl.state);
    assert!(
        locks.is_empty(),
        "the lock files of deleted volumes are gone: {locks:?}"
    );
    assert!(loops_below(&pool.path).is_empty());
}

/// The controller makes a filesystem's template; the node plugin, in its own
/// process, fills a new volume from it at the first stage: the volume's extents
/// are shared with the template, its UUID is its own, and it keeps data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_the_node_process_fills_a_new_volume_from_the_controllers_template() {
    require_root();
    let pool = Pool::new("xfs");
    let (ctl, node) = start(&pool, "", "");
    let mut c = ctl.clients().await;
    let mut n = node.clients().await;
    let cap = mount_cap("xfs", writer());
    create_volume_id(&mut c.controller, "pvc-first", 512 * MIB, cap.clone()).await;
    let template = pool
        .path
        .join(format!(".templates/xfs-{}-f1.img", 512 * MIB));
    wait_for("the xfs template", 120, || template.is_file());
    let id = create_volume_id(&mut c.controller, "pvc-filled", 512 * MIB, cap.clone()).await;
    let image = pool.path.join(format!("volumes/{id}.img"));
    let (staging, target) = (pool.scratch("staging"), pool.scratch("target"));
    n.stage_and_publish(&id, &staging, &target, &cap).await;
    let filefrag = sh("filefrag", &["-v", image.to_str().unwrap()]);
    assert!(
        filefrag.contains("shared"),
        "filled from the template: {filefrag}"
    );
    assert_ne!(blkid(&image, "UUID"), blkid(&template, "UUID"));
    std::fs::write(target.join("data"), b"kept").unwrap();
    n.unpublish_and_unstage(&id, &target, &staging).await;
    n.stage_and_publish(&id, &staging, &target, &cap).await;
    assert_eq!(std::fs::read(target.join("data")).unwrap(), b"kept");
    n.unpublish_and_unstage(&id, &target, &staging).await;
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_a_state_of_a_later_format_is_refused_at_start_and_left_as_it_is() {
    require_root();
    let pool = Pool::new("xfs");
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(state.join("format"), "999\n").unwrap();
    let socket = dir.path().join("csi.sock");
    let args = [
        format!("--endpoint=unix://{}", socket.display()),
        "--nodeid=node-1".to_string(),
        format!("--pool=default={}", pool.path.display()),
        format!("--state-dir={}", state.display()),
    ];
    let (code, err) = run_second(&args);
    assert_eq!(code, Some(2), "exit status; stderr: {err}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("csi-driver:"))
        .collect();
    assert_eq!(lines.len(), 1, "one line of error: {err}");
    assert!(
        lines[0].contains("format 999") && lines[0].contains("later csi-driver"),
        "{}",
        lines[0]
    );
    assert!(!socket.exists(), "it made its socket");
    let left: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("format")]);
    assert_eq!(
        std::fs::read_to_string(state.join("format")).unwrap(),
        "999\n"
    );
}
