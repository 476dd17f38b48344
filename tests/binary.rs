//! The real `csi-driver` binary as an operator and an attacker see it: flags,
//! the socket's life and permissions, signals, secrets in logs, metrics, message
//! limits, garbage on the wire, and 500 simultaneous CreateVolume calls.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use csi_proto::csi;

const BIN: &str = env!("CARGO_BIN_EXE_csi-driver");
const SECRET: &str = "s3cr3t-VALUE";

/// Runs the binary with no CSI_*/NODE_ID variables from the environment.
fn run_bare(args: &[&str], cwd: &Path) -> std::process::Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).current_dir(cwd).stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("CSI_") || k == "NODE_ID" {
            cmd.env_remove(k);
        }
    }
    cmd.output().expect("run csi-driver")
}

/// Every path below `dir`, sorted.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn bad_flags_exit_2_with_one_line_and_make_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let pool = base.join("pool");
    std::fs::create_dir(&pool).unwrap();
    let file = base.join("afile");
    std::fs::write(&file, b"x").unwrap();
    let before = tree(base);
    let sock = base.join("run/csi.sock");
    let state = base.join("state");
    let endpoint = format!("--endpoint=unix://{}", sock.display());
    let state_flag = format!("--state-dir={}", state.display());
    let pool_flag = format!("--pool=default={}", pool.display());
    let missing_pool = format!("--pool=default={}", base.join("nope").display());
    let file_pool = format!("--pool=default={}", file.display());
    let cases: Vec<(&str, Vec<String>)> = vec![
        (
            "malformed endpoint",
            vec!["--endpoint=csi.sock".into(), "--nodeid=n".into()],
        ),
        (
            "http endpoint",
            vec!["--endpoint=http://x/y".into(), "--nodeid=n".into()],
        ),
        (
            "endpoint naming a directory",
            vec![
                format!("--endpoint=unix://{}/", base.display()),
                "--nodeid=n".into(),
            ],
        ),
        ("missing --nodeid", vec![endpoint.clone()]),
        (
            "blank --nodeid",
            vec![endpoint.clone(), "--nodeid=  ".into()],
        ),
        (
            "pool missing",
            vec![endpoint.clone(), "--nodeid=n".into(), missing_pool.clone()],
        ),
        (
            "pool not a directory",
            vec![endpoint.clone(), "--nodeid=n".into(), file_pool.clone()],
        ),
        (
            "relative pool",
            vec![
                endpoint.clone(),
                "--nodeid=n".into(),
                "--pool=a=rel/p".into(),
            ],
        ),
        (
            "unknown --mode",
            vec![
                endpoint.clone(),
                "--nodeid=n".into(),
                "--mode=everything".into(),
            ],
        ),
        (
            "tcp without --allow-tcp",
            vec![
                "--endpoint=tcp://127.0.0.1:10000".into(),
                "--nodeid=n".into(),
            ],
        ),
        (
            "bad --metrics-address",
            vec![
                endpoint.clone(),
                "--nodeid=n".into(),
                "--metrics-address=localhost".into(),
            ],
        ),
        (
            "unknown flag",
            vec![
                endpoint.clone(),
                "--nodeid=n".into(),
                "--no-such-flag".into(),
            ],
        ),
        (
            "bad --log-format",
            vec![
                endpoint.clone(),
                "--nodeid=n".into(),
                "--log-format=xml".into(),
            ],
        ),
    ];
    for (what, mut args) in cases {
        if !args.iter().any(|a| a.starts_with("--pool")) {
            args.push(pool_flag.clone());
        }
        args.push(state_flag.clone());
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run_bare(&argv, base);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{what}: exit status; stderr: {stderr}"
        );
        assert_eq!(
            stderr.trim_end().lines().count(),
            1,
            "{what}: one line expected, got: {stderr:?}"
        );
        assert!(
            stderr.starts_with("csi-driver: "),
            "{what}: the line names the program: {stderr:?}"
        );
        assert_eq!(tree(base), before, "{what}: nothing is made");
    }
}

#[test]
fn the_flags_the_manifests_pass_are_accepted() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("python3")
        .args(["deploy/check_manifests.py", "--driver-flags"])
        .current_dir(root)
        .output()
        .expect("python3 deploy/check_manifests.py");
    assert!(
        out.status.success(),
        "check_manifests.py --driver-flags: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let flags: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    assert!(flags.len() >= 3, "the manifests pass flags: {flags:?}");
    let help = run_bare(&["--help"], Path::new(root));
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout);
    let known: Vec<&str> = help
        .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '<')
        .filter(|w| w.starts_with("--"))
        .collect();
    for f in &flags {
        let name = f.split('=').next().unwrap();
        assert!(
            known.contains(&name),
            "{name} is passed by the manifests but not accepted by csi-driver --help"
        );
    }
}

fn unix_socket_mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_socket_is_0660_from_its_first_moment_and_lives_with_the_process() {
    require_root();
    let pool = Pool::new("xfs");
    let mut driver = Driver::start(&pool, &[]);
    driver.kill9();
    assert!(driver.socket.exists(), "SIGKILL leaves the socket behind");
    // Restart over the stale socket, watching the path from the start.
    let _ = std::fs::remove_file(&driver.socket);
    let watcher = {
        let sock = driver.socket.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(m) = std::fs::symlink_metadata(&sock) {
                    return Some(m.permissions().mode() & 0o7777);
                }
                std::hint::spin_loop();
            }
            None
        })
    };
    driver.spawn();
    let first = watcher.join().unwrap().expect("the socket appeared");
    assert_eq!(
        first & !0o660,
        0,
        "first seen mode {first:o} is wider than 0660"
    );
    assert_eq!(unix_socket_mode(&driver.socket), socket_mode());
    let meta = std::fs::symlink_metadata(&driver.socket).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (0, 0));

    // A stale socket (SIGKILL) is replaced at the next start.
    driver.kill9();
    assert!(driver.socket.exists());
    driver.spawn();
    let mut c = driver.clients().await;
    let ready = c
        .identity
        .probe(csi::ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ready.ready, Some(true));

    // A second driver on the same live socket refuses and leaves it alone.
    let log = pool.dir.path().join("second.log");
    let out = Command::new(BIN)
        .args(&driver.args)
        .arg(format!(
            "--state-dir={}",
            pool.dir.path().join("state2").display()
        ))
        .stderr(std::fs::File::create(&log).unwrap())
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(!out.success(), "a second driver on a live socket must fail");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("in use"), "{text}");
    assert!(driver.socket.exists());
    c.identity.probe(csi::ProbeRequest {}).await.unwrap();

    // SIGTERM: exit 0, socket removed, promptly, although a client (like a
    // sidecar) keeps its connection open and answers.
    let started = Instant::now();
    let (status, driver) = tokio::task::spawn_blocking(move || (driver.stop(), driver))
        .await
        .unwrap();
    let status = status.expect("exit status");
    drop(c);
    assert!(status.success(), "SIGTERM exit: {status}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(!driver.socket.exists(), "the socket is removed on SIGTERM");
}

/// `--socket-group`: the socket is that group's (still 0660), so that a client
/// running as another user in that group (a sidecar as non-root) is let in, and
/// one outside it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts, and clients run as other users"]
async fn root_a_socket_group_lets_in_its_members_and_no_one_else() {
    require_root();
    const GROUP: u32 = 65532;
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[&format!("--socket-group={GROUP}")]);
    let meta = std::fs::symlink_metadata(&driver.socket).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (0, GROUP));
    assert_eq!(unix_socket_mode(&driver.socket), 0o660);

    // Other users may pass through the test's directories (not list them) and
    // run a copy of the binary.
    let mut dir = driver.socket.parent();
    while let Some(d) = dir.filter(|d| d.starts_with(pool.dir.path())) {
        let mode = std::fs::metadata(d).unwrap().permissions().mode();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode | 0o011)).unwrap();
        dir = d.parent();
    }
    let bin_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bin_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = bin_dir.path().join("csi-driver");
    std::fs::copy(BIN, &bin).unwrap();
    let info_as = |uid: u32, gid: u32| {
        Command::new(&bin)
            .arg("client")
            .arg(format!("--endpoint=unix://{}", driver.socket.display()))
            .arg("info")
            .uid(uid)
            .gid(gid)
            .output()
            .expect("run csi-driver client as another user")
    };
    let member = info_as(65533, GROUP);
    assert!(
        member.status.success(),
        "a member of the socket's group was refused: {}",
        String::from_utf8_lossy(&member.stderr)
    );
    assert!(
        String::from_utf8_lossy(&member.stdout).contains("example.csi.k8s.io"),
        "{}",
        String::from_utf8_lossy(&member.stdout)
    );
    let stranger = info_as(65533, 65533);
    assert!(
        !stranger.status.success(),
        "a user outside the group got in"
    );
    let err = String::from_utf8_lossy(&stranger.stderr).to_lowercase();
    assert!(err.contains("permission denied"), "{err}");
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_live_socket_of_another_process_is_refused() {
    require_root();
    let pool = Pool::new("xfs");
    let dir = pool.dir.path().join("other");
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("csi.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let ino = std::fs::metadata(&sock).unwrap().ino();
    // The driver started on `socket`, run until it exits.
    let start_on = |socket: &Path| {
        Command::new(BIN)
            .args([
                &format!("--endpoint=unix://{}", socket.display()),
                "--nodeid=n",
                &format!("--pool=default={}", pool.path.display()),
                &format!("--state-dir={}", dir.join("state").display()),
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = start_on(&sock);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("in use"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::metadata(&sock).unwrap().ino(),
        ino,
        "the other process's socket is untouched"
    );
    // A regular file at the socket path is not removed either.
    let file = dir.join("file.sock");
    std::fs::write(&file, b"keep").unwrap();
    let out = start_on(&file);
    assert!(!out.status.success());
    assert_eq!(std::fs::read(&file).unwrap(), b"keep");
}

/// The image file of a volume.
fn image_of(pool: &Pool, volume_id: &str) -> PathBuf {
    let p = pool.path.join("volumes").join(format!("{volume_id}.img"));
    assert!(p.exists(), "{} exists", p.display());
    p
}

/// Writes `mib` MiB of incompressible data at the start of `file`.
fn fill(file: &Path, mib: usize) {
    let mut f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    let mut block = vec![0u8; 1024 * 1024];
    for i in 0..mib {
        for (j, b) in block.iter_mut().enumerate() {
            *b = (j as u32).wrapping_mul(2654435761).wrapping_add(i as u32) as u8 ^ (j >> 8) as u8;
        }
        f.write_all(&block).unwrap();
    }
    f.sync_all().unwrap();
}

fn clone_req(name: &str, source: &str, size: i64) -> csi::CreateVolumeRequest {
    let mut r = create_req(
        name,
        size,
        mount_cap("ext4", writer()),
        &[("kind", "image")],
    );
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: source.to_string(),
            },
        )),
    });
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_sigterm_lets_a_running_call_finish() {
    require_root();
    // ext4 has no reflink: a clone is a real copy of the source's data.
    let pool = Pool::new("ext4");
    let mut driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let src = must_create(
        &mut c.controller,
        create_req(
            "pvc-src",
            1024 * MIB,
            mount_cap("ext4", writer()),
            &[("kind", "image")],
        ),
    )
    .await;
    fill(&image_of(&pool, &src.volume_id), 512);
    let mut ctl = c.controller.clone();
    let src_id = src.volume_id.clone();
    let call = tokio::spawn(async move {
        let started = Instant::now();
        let r = ctl
            .create_volume(clone_req("pvc-clone", &src_id, 1024 * MIB))
            .await;
        (r, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let pid = driver.pid();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let (r, took) = call.await.unwrap();
    let vol = r
        .expect("the call running at SIGTERM completes")
        .into_inner();
    eprintln!("clone of 512 MiB took {took:?} across SIGTERM");
    let signalled = Instant::now();
    let status = driver
        .wait_exit(60)
        .expect("the driver exits after SIGTERM");
    eprintln!("exited {:?} after the call returned", signalled.elapsed());
    assert!(status.success(), "{status}");
    assert!(!driver.socket.exists());
    // The clone is whole: same bytes as the source.
    let new_id = vol.volume.unwrap().volume_id;
    let a = std::fs::read(image_of(&pool, &src.volume_id)).unwrap();
    let b = std::fs::read(image_of(&pool, &new_id)).unwrap();
    assert!(a == b, "the clone matches its source");
}

fn system_python() -> &'static str {
    ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("a python3 that uid 65534 can run")
}

/// Connects to `sock` as uid/gid 65534 with no groups; returns the outcome.
fn connect_as_nobody(sock: &Path) -> String {
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            system_python(),
            "-c",
            "import socket,sys\n\
             s=socket.socket(socket.AF_UNIX)\n\
             try:\n  s.connect(sys.argv[1]); print('CONNECTED')\n\
             except OSError as e:\n  print('ERRNO', e.errno)",
        ])
        .arg(sock)
        .output()
        .expect("setpriv");
    assert!(
        out.status.success(),
        "setpriv: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_an_unprivileged_user_cannot_connect() {
    require_root();
    let pool = Pool::new("xfs");
    // Let anyone reach the folder, so that only the socket's own mode decides.
    for d in [
        pool.dir.path().to_path_buf(),
        pool.dir.path().join("driver"),
    ] {
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let driver = Driver::start(&pool, &[]);
    assert_eq!(
        connect_as_nobody(&driver.socket),
        format!("ERRNO {}", libc::EACCES)
    );
    // The check can tell: with the socket opened up, the same user connects.
    std::fs::set_permissions(&driver.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(connect_as_nobody(&driver.socket), "CONNECTED");
}

/// Secret values (the keys of a secrets map are not secret: CSI redacts values).
fn secrets() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("password".to_string(), SECRET.to_string()),
        ("token".to_string(), format!("Bearer {SECRET}")),
    ])
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_secrets_never_reach_the_logs() {
    require_root();
    let pool = Pool::new("xfs");
    for fmt in ["text", "json"] {
        let mut driver = Driver::start(
            &pool,
            &["--log-level=trace", &format!("--log-format={fmt}")],
        );
        let mut c = driver.clients().await;
        let cap = mount_cap("ext4", writer());
        let mut req = create_req(&format!("pvc-secret-{fmt}"), 64 * MIB, cap.clone(), &[]);
        req.secrets = secrets();
        let vol = must_create(&mut c.controller, req.clone()).await;
        // Requests refused by validation, with secrets.
        let mut bad = req.clone();
        bad.name.clear();
        assert!(c.controller.create_volume(bad).await.is_err());
        let mut bad = req.clone();
        bad.parameters.insert("nope".into(), "x".into());
        bad.name = "pvc-bad-param".into();
        let _ = c.controller.create_volume(bad).await;
        let staging = pool.scratch(&format!("staging-{fmt}"));
        let target = pool.scratch(&format!("pods-{fmt}")).join("t");
        let mut stage = stage_req(&vol.volume_id, &staging, cap.clone());
        stage.secrets = secrets();
        c.node.node_stage_volume(stage.clone()).await.unwrap();
        let mut bad_stage = stage.clone();
        bad_stage.staging_target_path.clear();
        assert!(c.node.node_stage_volume(bad_stage).await.is_err());
        let mut publish = publish_req(&vol.volume_id, &staging, &target, cap.clone(), false);
        publish.secrets = secrets();
        c.node.node_publish_volume(publish.clone()).await.unwrap();
        let mut bad_publish = publish.clone();
        bad_publish.target_path = "/etc".into();
        assert!(c.node.node_publish_volume(bad_publish).await.is_err());
        let snap = c
            .controller
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: vol.volume_id.clone(),
                name: format!("snap-secret-{fmt}"),
                secrets: secrets(),
                ..Default::default()
            })
            .await;
        let _ = c
            .controller
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: "no-such-volume".into(),
                name: String::new(),
                secrets: secrets(),
                ..Default::default()
            })
            .await;
        c.unpublish_and_unstage(&vol.volume_id, &target, &staging)
            .await;
        if let Ok(s) = snap {
            c.controller
                .delete_snapshot(csi::DeleteSnapshotRequest {
                    snapshot_id: s.into_inner().snapshot.unwrap().snapshot_id,
                    secrets: secrets(),
                })
                .await
                .unwrap();
        }
        let _ = c
            .controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: String::new(),
                secrets: secrets(),
            })
            .await;
        c.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: vol.volume_id.clone(),
                secrets: secrets(),
            })
            .await
            .unwrap();
        driver.stop();
        let log = driver.log_text();
        assert!(
            log.contains("CreateVolume") && log.contains("NodeStageVolume"),
            "the trace log records the calls ({fmt})"
        );
        assert!(
            !log.contains(SECRET),
            "a secret value reached the {fmt} log:\n{}",
            log.lines()
                .filter(|l| l.contains(SECRET))
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::fs::remove_file(&driver.log).unwrap();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A plain HTTP/1.0 GET: (status, body).
fn http_get(port: u16, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_string())
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_identity_and_metrics() {
    require_root();
    let pool = Pool::new("xfs");
    let port = free_port();
    let driver = Driver::start(
        &pool,
        &[
            &format!("--metrics-address=127.0.0.1:{port}"),
            // Every scrape and probe sees the driver as it is now.
            "--metrics-max-age=0",
        ],
    );
    let mut c = driver.clients().await;
    let info = c
        .identity
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "example.csi.k8s.io");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
    let probe = c
        .identity
        .probe(csi::ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(probe.ready, Some(true));
    let (code, body) = http_get(port, "/healthz");
    assert_eq!((code, body.trim()), (200, "ok"));

    let (_, before) = http_get(port, "/metrics");
    let ok = [("method", "CreateVolume"), ("grpc_code", "OK")];
    assert_eq!(sample(&before, "example_csi_rpc_requests_total", &ok), None);

    let cap = mount_cap("ext4", writer());
    let vol = must_create(
        &mut c.controller,
        create_req("pvc-metrics", 64 * MIB, cap.clone(), &[]),
    )
    .await;
    for _ in 0..2 {
        let e = c
            .controller
            .create_volume(create_req("", 64 * MIB, cap.clone(), &[]))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }
    let e = c
        .controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: String::new(),
            secrets: Default::default(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    c.controller
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: vol.volume_id.clone(),
            name: "snap-metrics".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let staging = pool.scratch("staging");
    c.node
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();

    let (code, text) = http_get(port, "/metrics");
    assert_eq!(code, 200);
    let get = |name: &str, labels: &[(&str, &str)]| {
        sample(&text, name, labels).unwrap_or_else(|| panic!("{name} {labels:?} in:\n{text}"))
    };
    let requests = "example_csi_rpc_requests_total";
    assert_eq!(
        get(
            requests,
            &[
                ("service", "Controller"),
                ("method", "CreateVolume"),
                ("grpc_code", "OK")
            ]
        ),
        1.0
    );
    assert_eq!(
        get(
            requests,
            &[("method", "CreateVolume"), ("grpc_code", "InvalidArgument")]
        ),
        2.0
    );
    assert_eq!(
        get(
            requests,
            &[("method", "DeleteVolume"), ("grpc_code", "InvalidArgument")]
        ),
        1.0
    );
    assert_eq!(
        get(
            requests,
            &[("method", "CreateSnapshot"), ("grpc_code", "OK")]
        ),
        1.0
    );
    assert_eq!(
        get(
            requests,
            &[
                ("service", "Node"),
                ("method", "NodeStageVolume"),
                ("grpc_code", "OK")
            ]
        ),
        1.0
    );
    assert!(
        get(
            requests,
            &[
                ("service", "Identity"),
                ("method", "Probe"),
                ("grpc_code", "OK")
            ]
        ) >= 1.0
    );
    assert_eq!(
        get(
            "example_csi_rpc_duration_seconds_count",
            &[("method", "CreateVolume")]
        ),
        3.0
    );
    assert_eq!(get("example_csi_volumes", &[("pool", "default")]), 1.0);
    assert_eq!(get("example_csi_snapshots", &[("pool", "default")]), 1.0);
    assert_eq!(get("example_csi_pool_reflink", &[("pool", "default")]), 1.0);
    assert_eq!(
        get("example_csi_loop_devices", &[("pool", "default")]),
        1.0,
        "the staged volume's loop device"
    );
    let cap_bytes = get("example_csi_pool_capacity_bytes", &[("pool", "default")]);
    let free_bytes = get("example_csi_pool_free_bytes", &[("pool", "default")]);
    assert!(cap_bytes > 7e9 && cap_bytes < 9e9, "{cap_bytes}");
    assert!(free_bytes > 0.0 && free_bytes < cap_bytes);
    assert_eq!(get("example_csi_ready", &[]), 1.0);
    assert_eq!(
        get(
            "example_csi_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );
    assert_eq!(http_get(port, "/nope").0, 404);

    c.node
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    let (_, text) = http_get(port, "/metrics");
    assert_eq!(
        sample(&text, "example_csi_loop_devices", &[("pool", "default")]),
        Some(0.0)
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_healthz_fails_when_a_pool_is_gone() {
    require_root();
    let pool = Pool::new("xfs");
    let port = free_port();
    let _driver = Driver::start(
        &pool,
        &[
            &format!("--metrics-address=127.0.0.1:{port}"),
            // Every scrape and probe sees the driver as it is now.
            "--metrics-max-age=0",
        ],
    );
    assert_eq!(http_get(port, "/healthz").0, 200);
    let volumes = pool.path.join("volumes");
    let aside = pool.path.join("volumes.aside");
    std::fs::rename(&volumes, &aside).unwrap();
    let (code, _) = http_get(port, "/healthz");
    std::fs::rename(&aside, &volumes).unwrap();
    assert_eq!(code, 503);
    assert_eq!(http_get(port, "/healthz").0, 200);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_healthz_answers_what_probe_answers_on_the_socket() {
    require_root();
    let pool = Pool::new("xfs");
    let port = free_port();
    let driver = Driver::start(
        &pool,
        &[
            &format!("--metrics-address=127.0.0.1:{port}"),
            // Every scrape and probe sees the driver as it is now.
            "--metrics-max-age=0",
        ],
    );
    assert_eq!(http_get(port, "/healthz").0, 200);
    // The CSI socket is gone (a cleaned host directory): the kubelet and the
    // sidecars can no longer reach the driver, so it is not alive to them.
    let aside = driver.socket.with_extension("aside");
    std::fs::rename(&driver.socket, &aside).unwrap();
    let (code, body) = http_get(port, "/healthz");
    std::fs::rename(&aside, &driver.socket).unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("cannot connect"), "{body}");
    assert_eq!(http_get(port, "/healthz").0, 200);
}

/// Sockets the process `pid` holds open (TCP and Unix).
fn open_sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| {
        d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.to_string_lossy().starts_with("socket:"))
            .count()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_flood_of_scrapes_neither_fails_nor_holds_csi_calls_and_is_capped() {
    require_root();
    let pool = Pool::new("xfs");
    let port = free_port();
    let cap_connections = 32;
    let driver = Driver::start(
        &pool,
        &[
            &format!("--metrics-address=127.0.0.1:{port}"),
            &format!("--metrics-max-connections={cap_connections}"),
        ],
    );
    let mut c = driver.clients().await;
    let pid = driver.pid();
    let idle_sockets = open_sockets(pid);

    // 300 clients, each opening a connection per scrape, for as long as the
    // CSI calls below run.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let scrapers: Vec<_> = (0..300)
        .map(|_| {
            let (stop, answered) = (stop.clone(), answered.clone());
            tokio::spawn(async move {
                use std::sync::atomic::Ordering::Relaxed;
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                while !stop.load(Relaxed) {
                    let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await
                    else {
                        continue;
                    };
                    let mut text = Vec::new();
                    let asked = async {
                        conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await?;
                        conn.read_to_end(&mut text).await
                    };
                    if tokio::time::timeout(Duration::from_secs(30), asked)
                        .await
                        .is_ok()
                        && text.starts_with(b"HTTP/1.0 200")
                    {
                        answered.fetch_add(1, Relaxed);
                    }
                }
            })
        })
        .collect();
    let watcher = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut most = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(open_sockets(pid));
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        })
    };

    let cap = mount_cap("xfs", writer());
    for i in 0..6 {
        let name = format!("pvc-under-scrapes-{i}");
        let vol = must_create(
            &mut c.controller,
            create_req(&name, 512 * MIB, cap.clone(), &[]),
        )
        .await;
        let (staging, target) = (
            pool.scratch(&format!("s{i}")),
            pool.scratch(&format!("t{i}")),
        );
        c.stage_and_publish(&vol.volume_id, &staging, &target.join("m"), &cap)
            .await;
        c.unpublish_and_unstage(&vol.volume_id, &target.join("m"), &staging)
            .await;
        c.controller
            .delete_volume(delete_req(&vol.volume_id))
            .await
            .unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in scrapers {
        s.await.unwrap();
    }
    let most = watcher.join().unwrap();

    // Idle sockets: the listeners and the CSI connections; the metrics port
    // added at most its cap (and a few the kernel had not yet closed).
    assert!(
        most <= idle_sockets + cap_connections + 8,
        "{most} sockets open at most, {idle_sockets} idle, cap {cap_connections}"
    );
    let answered = answered.load(std::sync::atomic::Ordering::Relaxed);
    assert!(answered > 0, "some scrapes were answered");
    let (code, text) = http_get(port, "/metrics");
    assert_eq!(code, 200);
    let refused = sample(&text, "example_csi_metrics_connections_refused_total", &[]).unwrap();
    assert!(refused > 0.0, "the cap was reached and counted:\n{text}");
    assert_eq!(http_get(port, "/healthz").0, 200);
    eprintln!("{answered} scrapes answered, {refused} connections refused, {most} sockets at most");
}

/// A codec that sends and receives raw bytes, to put what we like on the wire.
#[derive(Clone, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        let mut v = vec![0; n];
        bytes::Buf::copy_to_slice(src, &mut v);
        Ok(Some(v))
    }
}

async fn raw_call(
    ch: tonic::transport::Channel,
    path: &'static str,
    body: Vec<u8>,
) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::from_static(path),
        RawCodec,
    )
    .await
    .map(|r| r.into_inner())
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_oversized_and_garbage_requests_do_not_hurt_the_server() {
    require_root();
    let pool = Pool::new("xfs");
    let mut driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let probe = |mut c: csi_proto::csi::identity_client::IdentityClient<
        tonic::transport::Channel,
    >| async move {
        c.probe(csi::ProbeRequest {})
            .await
            .unwrap()
            .into_inner()
            .ready
    };

    // 5 MiB request: over the 4 MiB limit.
    let mut big = create_req("pvc-big", 64 * MIB, mount_cap("ext4", writer()), &[]);
    big.parameters
        .insert("type".into(), "x".repeat(5 * 1024 * 1024));
    let e = c.controller.create_volume(big).await.unwrap_err();
    assert_eq!(
        e.code(),
        tonic::Code::ResourceExhausted,
        "5 MiB request: {e:?}"
    );
    assert_eq!(probe(c.identity.clone()).await, Some(true));
    // A 3 MiB one is read and refused on its merits.
    let mut large = create_req("pvc-large", 64 * MIB, mount_cap("ext4", writer()), &[]);
    large
        .parameters
        .insert("type".into(), "x".repeat(3 * 1024 * 1024));
    let e = c.controller.create_volume(large).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().len() < 4096, "the message is cut short");

    // Protobuf that is not protobuf, or has the wrong wire types.
    let ch = csi_glue::connect(&format!("unix://{}", driver.socket.display()))
        .await
        .unwrap();
    let bodies: Vec<Vec<u8>> = vec![
        vec![0xff; 64],
        vec![0x0a, 0x7f, 0x01],             // length past the end
        vec![0x0a, 0x02, 0xff, 0xfe],       // a string that is not UTF-8
        vec![0x09, 1, 2, 3, 4, 5, 6, 7, 8], // field 1 as fixed64
        vec![
            0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01,
        ], // overlong varint key
        vec![0x12, 0x03, 0x0a, 0x01],       // truncated nested message
        (0..4096u32)
            .map(|i| (i.wrapping_mul(7919) >> 3) as u8)
            .collect(),
    ];
    let paths = [
        "/csi.v1.Controller/CreateVolume",
        "/csi.v1.Controller/DeleteVolume",
        "/csi.v1.Node/NodeStageVolume",
        "/csi.v1.Node/NodePublishVolume",
        "/csi.v1.Controller/CreateSnapshot",
        "/csi.v1.Identity/Probe",
        "/csi.v1.Nope/Nope",
    ];
    for path in paths {
        for body in &bodies {
            let r = raw_call(ch.clone(), path, body.clone()).await;
            if let Err(e) = &r {
                assert_ne!(e.code(), tonic::Code::Unavailable, "{path}: {e:?}");
            }
        }
    }
    assert_eq!(probe(c.identity.clone()).await, Some(true));

    // Bytes that are not HTTP/2 at all, and an HTTP/2 preface followed by junk.
    for junk in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        (0..65536u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
            .collect(),
        [
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".as_slice(),
            &[0, 0, 4, 0xff, 0xff, 0, 0, 0, 1, 1, 2, 3, 4],
        ]
        .concat(),
    ] {
        let mut s = std::os::unix::net::UnixStream::connect(&driver.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = s.write_all(&junk);
        let mut buf = [0u8; 1024];
        let _ = s.read(&mut buf);
    }
    assert_eq!(probe(c.identity.clone()).await, Some(true));
    let mut fresh = driver.clients().await;
    assert_eq!(
        fresh
            .identity
            .probe(csi::ProbeRequest {})
            .await
            .unwrap()
            .into_inner()
            .ready,
        Some(true)
    );
    assert!(driver.wait_exit(0).is_none(), "the driver is still running");
    driver.stop();
}

fn threads_of(pid: u32) -> Option<usize> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// 500 CreateVolume calls at once, each a clone (a real copy on ext4) of one of
/// 25 sources, retried on ABORTED as the external-provisioner does (a source is
/// locked while it is copied). The driver stays up, its threads stay bounded,
/// Probe stays quick, and every volume is made in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_500_simultaneous_creates_keep_the_driver_bounded() {
    require_root();
    const CALLS: usize = 500;
    const SOURCES: usize = 25;
    const CHANNELS: usize = 10;
    let pool = Pool::new("ext4");
    let mut driver = Driver::start(&pool, &["--log-level=info"]);
    let c = driver.clients().await;
    let mut ctl = c.controller.clone();
    let mut sources = Vec::new();
    for i in 0..SOURCES {
        let src = must_create(
            &mut ctl,
            create_req(
                &format!("pvc-heavy-src-{i}"),
                64 * MIB,
                mount_cap("ext4", writer()),
                &[("kind", "image")],
            ),
        )
        .await;
        // Real data to copy: ext4 has no reflink, so each clone copies it.
        fill(&image_of(&pool, &src.volume_id), 1);
        sources.push(src.volume_id);
    }

    let pid = driver.pid();
    let start_threads = threads_of(pid).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut max = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(n) = threads_of(pid) {
                    max = max.max(n);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            max
        })
    };
    let mut channels = Vec::new();
    for _ in 0..CHANNELS {
        channels.push(
            csi_glue::connect(&format!("unix://{}", driver.socket.display()))
                .await
                .unwrap(),
        );
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CALLS {
        let mut client = csi_proto::csi::controller_client::ControllerClient::new(
            channels[i % CHANNELS].clone(),
        );
        let src = sources[i % SOURCES].clone();
        tasks.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(300);
            let mut first = None;
            let mut attempts = 0u32;
            loop {
                attempts += 1;
                let r = client
                    .create_volume(clone_req(&format!("pvc-heavy-{i}"), &src, 64 * MIB))
                    .await
                    .map(|_| ())
                    .map_err(|e| e.code());
                first.get_or_insert(r);
                match r {
                    Err(tonic::Code::Aborted) | Err(tonic::Code::ResourceExhausted)
                        if Instant::now() < deadline =>
                    {
                        let wait = 20 + (i as u64 * 7 + attempts as u64 * 13) % 80;
                        tokio::time::sleep(Duration::from_millis(wait)).await;
                    }
                    _ => return (first.unwrap(), r, attempts),
                }
            }
        }));
    }
    // Probe answers promptly while they run: Identity calls are never queued.
    let mut id = c.identity.clone();
    let mut worst_probe = Duration::ZERO;
    for _ in 0..20 {
        let t = Instant::now();
        let r = id.probe(csi::ProbeRequest {}).await.unwrap().into_inner();
        assert_eq!(r.ready, Some(true));
        worst_probe = worst_probe.max(t.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut first_codes: HashMap<String, usize> = HashMap::new();
    let mut final_codes: HashMap<String, usize> = HashMap::new();
    let mut attempts = 0;
    for t in tasks {
        let (first, last, n) = t.await.unwrap();
        attempts += n;
        let name = |r: Result<(), tonic::Code>| match r {
            Ok(()) => "Ok".to_string(),
            Err(c) => format!("{c:?}"),
        };
        *first_codes.entry(name(first)).or_default() += 1;
        *final_codes.entry(name(last)).or_default() += 1;
    }
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let max_threads = sampler.join().unwrap();
    eprintln!(
        "{CALLS} clones of {SOURCES} sources: first answers {first_codes:?}, final {final_codes:?}, \
         {attempts} calls in {took:?}; driver threads {start_threads} at start, {max_threads} at \
         most; slowest Probe under load {worst_probe:?}"
    );
    assert!(
        first_codes
            .keys()
            .all(|c| c == "Ok" || c == "Aborted" || c == "ResourceExhausted"),
        "only ABORTED or RESOURCE_EXHAUSTED may refuse: {first_codes:?}"
    );
    assert_eq!(
        final_codes.get("Ok"),
        Some(&CALLS),
        "every volume is made in the end: {final_codes:?}"
    );
    assert!(
        max_threads <= 100,
        "thread count {max_threads} is not bounded (start: {start_threads})"
    );
    assert!(
        worst_probe < Duration::from_secs(2),
        "Probe took {worst_probe:?} under load"
    );
    assert!(driver.wait_exit(0).is_none(), "the driver survived");
    let mut id = driver.clients().await.identity;
    assert_eq!(
        id.probe(csi::ProbeRequest {})
            .await
            .unwrap()
            .into_inner()
            .ready,
        Some(true)
    );
    let volumes = std::fs::read_dir(pool.path.join("volumes"))
        .unwrap()
        .filter(|e| {
            !e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with('.')
        })
        .count();
    assert_eq!(
        volumes,
        CALLS + SOURCES,
        "one image per volume, no leftovers"
    );
    driver.stop();
}

/// Processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // The arguments are separated by NULs: read as one line, as ps shows it.
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(needle)
                })
                .unwrap_or(false)
        })
        .collect()
}

/// A stuck mkfs is killed at --command-timeout, the call fails with
/// DEADLINE_EXCEEDED, the volume is not left locked (the retry is not ABORTED),
/// and once mkfs works the same call succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_stuck_mkfs_is_killed_and_the_volume_released() {
    require_root();
    let pool = Pool::new("xfs");
    let fake = pool.dir.path().join("stuck-bin");
    std::fs::create_dir_all(&fake).unwrap();
    let mkfs = fake.join("mkfs.ext4");
    std::fs::write(&mkfs, "#!/bin/sh\nsleep 600 &\nsleep 600\n").unwrap();
    std::fs::set_permissions(&mkfs, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        fake.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let driver = Driver::start_with_env(&pool, &["--command-timeout=2"], &[("PATH", &path)]);
    let mut c = driver.clients().await;
    let cap = mount_cap("ext4", writer());
    let vol = must_create(
        &mut c.controller,
        create_req("pvc-stuck", 64 * MIB, cap.clone(), &[]),
    )
    .await;
    let staging = pool.scratch("staging");
    for round in 0..2 {
        let started = Instant::now();
        let e = c
            .node
            .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
            .await
            .unwrap_err();
        let took = started.elapsed();
        assert_eq!(
            e.code(),
            tonic::Code::DeadlineExceeded,
            "round {round}: {e:?}"
        );
        assert!(
            took < Duration::from_secs(15),
            "round {round}: took {took:?}"
        );
        // The stage's mkfs, and the template's the create asked for (the same
        // stuck script, started in the background), are killed with their
        // helpers within the timeout.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !processes_mentioning("sleep 600").is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let left = processes_mentioning("sleep 600");
        assert!(
            left.is_empty(),
            "the stuck mkfs and its children are killed: {left:?}"
        );
    }
    std::fs::remove_file(&mkfs).unwrap();
    c.node
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .expect("with a working mkfs the same stage succeeds");
    c.node
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    assert_eq!(
        loops_below(&pool.path).len(),
        0,
        "no loop device is left on the volume"
    );
    // The create asked for a filesystem template, whose mkfs (the same stuck
    // one) ran in the background: --command-timeout bounds it too, helpers
    // and all.
    let stuck = fake.display().to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(processes_mentioning(&stuck).is_empty() && processes_mentioning("sleep 600").is_empty())
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(processes_mentioning(&stuck), Vec::<u32>::new());
    assert_eq!(processes_mentioning("sleep 600"), Vec::<u32>::new());
}

/// A command the driver runs dies with it: a driver killed (SIGKILL) while
/// mkfs runs leaves no mkfs behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_command_dies_with_the_driver() {
    require_root();
    let pool = Pool::new("xfs");
    let fake = pool.dir.path().join("slow-bin");
    std::fs::create_dir_all(&fake).unwrap();
    let mkfs = fake.join("mkfs.ext4");
    std::fs::write(&mkfs, "#!/bin/sh\nexec sleep 601\n").unwrap();
    std::fs::set_permissions(&mkfs, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        fake.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut driver = Driver::start_with_env(&pool, &["--command-timeout=600"], &[("PATH", &path)]);
    let mut c = driver.clients().await;
    let cap = mount_cap("ext4", writer());
    // A new ext4 volume on a reflink pool asks for its template: mkfs runs.
    must_create(
        &mut c.controller,
        create_req("pvc-slow", 64 * MIB, cap.clone(), &[]),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while processes_mentioning("sleep 601").is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(processes_mentioning("sleep 601").len(), 1, "mkfs runs");
    driver.kill9();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !processes_mentioning("sleep 601").is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        processes_mentioning("sleep 601"),
        Vec::<u32>::new(),
        "the mkfs of a killed driver is left running"
    );
}
