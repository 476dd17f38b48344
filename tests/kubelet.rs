//! The kubelet's plugin registration without node-driver-registrar: the
//! handshake on the registration socket, with this test playing the kubelet (a
//! client of the Registration service). The liveness side, `/healthz`, is tested
//! with the other metrics tests in tests/binary.rs.

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use csi_proto::pluginregistration::{
    registration_client::RegistrationClient, InfoRequest, RegistrationStatus,
};

const HOST_PATH: &str = "/var/lib/kubelet/plugins/example.csi.k8s.io/csi.sock";

fn registry(pool: &Pool) -> PathBuf {
    let dir = pool.dir.path().join("plugins_registry");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn start(pool: &Pool, extra: &[&str]) -> (Driver, PathBuf) {
    let dir = registry(pool);
    let mut args = vec![
        format!("--kubelet-registration-dir={}", dir.display()),
        format!("--kubelet-registration-path={HOST_PATH}"),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let driver = Driver::start(pool, &args);
    (driver, dir.join("example.csi.k8s.io-reg.sock"))
}

async fn kubelet(sock: &Path) -> RegistrationClient<tonic::transport::Channel> {
    let ch = csi_glue::connect(&format!("unix://{}", sock.display()))
        .await
        .expect("connect to the registration socket");
    RegistrationClient::new(ch)
}

/// Tells one socket file from the next at the same path: the inode number may
/// be reused at once, the change time is not.
type Identity = (u64, i64, i64);

fn inode(p: &Path) -> Option<Identity> {
    std::fs::symlink_metadata(p)
        .ok()
        .filter(|m| m.file_type().is_socket())
        .map(|m| (m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Waits until `p` is a socket that answers, other than `old`.
fn wait_new_socket(p: &Path, old: Identity, secs: u64) -> Option<Identity> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if let Some(i) = inode(p).filter(|i| *i != old) {
            if std::os::unix::net::UnixStream::connect(p).is_ok() {
                return Some(i);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

// Multi-threaded: the clients' connection tasks must run while the test blocks
// on the driver's exit, or the driver waits for them to close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_the_kubelet_registers_the_driver_and_a_refusal_is_retried() {
    require_root();
    let pool = Pool::new("xfs");
    // A socket left by a crash is replaced.
    let dir = registry(&pool);
    let reg = dir.join("example.csi.k8s.io-reg.sock");
    drop(std::os::unix::net::UnixListener::bind(&reg).unwrap());
    let stale = inode(&reg).unwrap();
    let (mut driver, reg) = start(&pool, &["--mode=node"]);
    let first = wait_new_socket(&reg, stale, 30).expect("the stale socket is replaced");
    assert_eq!(
        std::fs::symlink_metadata(&reg).unwrap().mode() & 0o777,
        socket_mode()
    );

    let mut k = kubelet(&reg).await;
    let info = k.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "CSIPlugin");
    assert_eq!(info.name, "example.csi.k8s.io");
    assert_eq!(info.endpoint, HOST_PATH);
    assert_eq!(info.supported_versions, ["1.0.0"]);

    // Success: nothing changes.
    k.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(inode(&reg), Some(first), "a success keeps the socket");

    // A refusal: answered, logged as an error, and the socket is made anew so
    // that the kubelet tries again; the CSI service keeps running meanwhile.
    k.notify_registration_status(RegistrationStatus {
        plugin_registered: false,
        error: "test: version mismatch".into(),
    })
    .await
    .unwrap();
    drop(k);
    let second = wait_new_socket(&reg, first, 30).expect("the registration socket is remade");
    assert_ne!(second, first);
    let log = driver.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("test: version mismatch")),
        "the refusal is logged as an error:\n{log}"
    );
    let mut c = driver.clients().await;
    let ready = c
        .identity
        .probe(csi_proto::csi::ProbeRequest {})
        .await
        .unwrap();
    assert_eq!(ready.into_inner().ready, Some(true));
    let mut k = kubelet(&reg).await;
    let info = k.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.name, "example.csi.k8s.io");
    drop(k);

    // A clean stop removes the socket (the kubelet then drops the plugin).
    drop(c);
    let started = Instant::now();
    let status = driver.stop().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the stop took {:?}",
        started.elapsed()
    );
    assert!(status.success(), "{status}");
    assert!(!reg.exists(), "the registration socket is removed at stop");
}

#[test]
fn registration_flags_are_checked() {
    let base = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_csi-driver");
    let sock = format!("--endpoint=unix://{}/csi.sock", base.path().display());
    let dir = format!(
        "--kubelet-registration-dir={}/registry",
        base.path().display()
    );
    let path = format!("--kubelet-registration-path={HOST_PATH}");
    for (what, args) in [
        (
            "controller mode",
            vec![dir.as_str(), path.as_str(), "--mode=controller"],
        ),
        ("no host path", vec![dir.as_str()]),
        ("a path without a dir", vec![path.as_str()]),
        (
            "a relative dir",
            vec!["--kubelet-registration-dir=registry", path.as_str()],
        ),
        (
            "a relative host path",
            vec![dir.as_str(), "--kubelet-registration-path=csi.sock"],
        ),
    ] {
        let out = std::process::Command::new(bin)
            .arg(&sock)
            .arg("--nodeid=n")
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{what}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("--kubelet-registration"),
            "{what}: {stderr}"
        );
        assert!(
            !base.path().join("registry").exists() && !base.path().join("csi.sock").exists(),
            "{what}: nothing is made"
        );
    }
}
