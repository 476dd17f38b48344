//! Test harness: real pools on loop-mounted filesystem images, the real
//! `csi-driver` binary on a temporary socket, and the generated tonic clients.
//! Everything a test makes is torn down by Drop, also when the test fails.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use csi_proto::csi::{
    self, controller_client::ControllerClient, group_controller_client::GroupControllerClient,
    identity_client::IdentityClient, node_client::NodeClient, volume_capability,
};
use tonic::transport::Channel;

pub const MIB: i64 = 1024 * 1024;
pub const GIB: i64 = 1024 * MIB;

/// The first line of every test marked `#[ignore = "needs root: ..."]`. Such a test
/// runs only when asked for (`cargo test -- --include-ignored`, as
/// scripts/test-all.sh does); asked for without root, it fails rather than pass
/// without having checked anything.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (loop devices, mkfs, mounts): run it as root"
    );
}

/// A tag of `blkid -p`; empty when it finds no filesystem (its exit status 2).
pub fn blkid(path: &Path, tag: &str) -> String {
    let out = Command::new("blkid")
        .args(["-p", "-s", tag, "-o", "value"])
        .arg(path)
        .output()
        .unwrap();
    assert!(matches!(out.status.code(), Some(0 | 2)), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

pub fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The loop devices of the system with their backing files ("/dev/loop3",
/// "/x/vol.img"). A device without a backing file (being set up or torn down by
/// another process) is left out.
pub fn loop_devices() -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            let b = b.trim().trim_end_matches(" (deleted)");
            if !b.is_empty() {
                let dev = format!("/dev/{}", e.file_name().to_string_lossy());
                out.push((dev, PathBuf::from(b)));
            }
        }
    }
    out.sort();
    out
}

/// Loop devices whose backing file lies below `dir`.
pub fn loops_below(dir: &Path) -> Vec<String> {
    loop_devices()
        .into_iter()
        .filter(|(_, b)| b.starts_with(dir))
        .map(|(d, _)| d)
        .collect()
}

/// Backing files, in order, of the loop devices whose backing file lies below
/// `dir`.
pub fn loop_backings_below(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = loop_devices()
        .into_iter()
        .map(|(_, b)| b)
        .filter(|b| b.starts_with(dir))
        .collect();
    out.sort();
    out
}

/// Names of the entries of a directory, not recursive (empty if it does not
/// exist).
pub fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// The volume locks in a state dir: the files of `shared/locks` but the spares
/// (files of removed locks kept for the next volumes).
pub fn volume_locks(state: &Path) -> BTreeSet<String> {
    names(&state.join("shared/locks"))
        .into_iter()
        .filter(|n| !csi_sys::flock::is_spare(n))
        .collect()
}

/// Mount points at or below `dir`.
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(m.replace("\\040", " ")))
        .filter(|m| m.starts_with(dir))
        .collect()
}

/// A scratch directory holding a pool: a sparse image of `fs`, loop-mounted.
pub struct Pool {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    image: PathBuf,
}

impl Pool {
    pub fn new(fs: &str) -> Pool {
        Self::with_size(fs, "8G")
    }

    pub fn with_size(fs: &str, size: &str) -> Pool {
        let dir = tempfile::Builder::new()
            .prefix("example-csi-test")
            .tempdir_in("/tmp")
            .unwrap();
        let image = dir.path().join("pool.img");
        let path = dir.path().join("pool");
        std::fs::create_dir(&path).unwrap();
        sh("truncate", &["-s", size, image.to_str().unwrap()]);
        match fs {
            "xfs" => sh(
                "mkfs.xfs",
                &["-q", "-m", "reflink=1", image.to_str().unwrap()],
            ),
            "btrfs" => sh("mkfs.btrfs", &["-q", image.to_str().unwrap()]),
            "ext4" => sh("mkfs.ext4", &["-q", "-F", image.to_str().unwrap()]),
            other => panic!("no pool filesystem {other}"),
        };
        sh(
            "mount",
            &[
                "-o",
                "loop",
                image.to_str().unwrap(),
                path.to_str().unwrap(),
            ],
        );
        Pool { dir, path, image }
    }

    /// A directory for staging and target paths, outside the pool.
    pub fn scratch(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join("scratch").join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    /// Bytes used in the pool's filesystem.
    pub fn used_bytes(&self) -> u64 {
        let s = nix::sys::statvfs::statvfs(&self.path).unwrap();
        (s.blocks() - s.blocks_free()) * s.fragment_size()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let top = self.dir.path().to_path_buf();
        for _ in 0..3 {
            // Volume mounts first, then the volumes' loop devices, then the pool: a
            // pool unmounted lazily while an image in it is attached would hide the
            // image's path, and its loop device would leak.
            let mut ms: Vec<PathBuf> = mounts_below(&top)
                .into_iter()
                .filter(|m| *m != self.path)
                .collect();
            ms.sort();
            for m in ms.iter().rev() {
                let _ = nix::mount::umount2(m, nix::mount::MntFlags::empty());
            }
            for d in loops_below(&self.path) {
                let _ = Command::new("losetup").args(["-d", &d]).status();
            }
            let mut ms = mounts_below(&top);
            ms.sort();
            for m in ms.iter().rev() {
                let _ = nix::mount::umount2(m, nix::mount::MntFlags::empty())
                    .or_else(|_| nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH));
            }
            for d in loops_below(&top) {
                let _ = Command::new("losetup").args(["-d", &d]).status();
            }
        }
        let _ = &self.image;
    }
}

/// The real driver binary on a temporary socket.
pub struct Driver {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub state: PathBuf,
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
    pub log: PathBuf,
}

pub struct Clients {
    pub identity: IdentityClient<Channel>,
    pub controller: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
    pub group: GroupControllerClient<Channel>,
}

impl Clients {
    /// CreateVolume, which must succeed; the new volume's id.
    pub async fn create(
        &mut self,
        name: &str,
        size: i64,
        cap: csi::VolumeCapability,
        params: &[(&str, &str)],
    ) -> String {
        must_create(&mut self.controller, create_req(name, size, cap, params))
            .await
            .volume_id
    }

    /// CreateVolume of a `kind=dir` volume (a directory, or a btrfs subvolume)
    /// for a read-write mount, which must succeed; the new volume's id.
    pub async fn create_dir(&mut self, name: &str, size: i64) -> String {
        self.create(name, size, mount_cap("", writer()), &[("kind", "dir")])
            .await
    }

    /// NodeStageVolume then a read-write NodePublishVolume, as kubelet readies a
    /// volume for a pod; both must succeed.
    pub async fn stage_and_publish(
        &mut self,
        id: &str,
        staging: &Path,
        target: &Path,
        cap: &csi::VolumeCapability,
    ) {
        self.node
            .node_stage_volume(stage_req(id, staging, cap.clone()))
            .await
            .unwrap_or_else(|e| panic!("NodeStageVolume {id}: {e:?}"));
        self.node
            .node_publish_volume(publish_req(id, staging, target, cap.clone(), false))
            .await
            .unwrap_or_else(|e| panic!("NodePublishVolume {id}: {e:?}"));
    }

    /// NodeUnpublishVolume then NodeUnstageVolume; both must succeed.
    pub async fn unpublish_and_unstage(&mut self, id: &str, target: &Path, staging: &Path) {
        self.node
            .node_unpublish_volume(unpublish_req(id, target))
            .await
            .unwrap_or_else(|e| panic!("NodeUnpublishVolume {id}: {e:?}"));
        self.node
            .node_unstage_volume(unstage_req(id, staging))
            .await
            .unwrap_or_else(|e| panic!("NodeUnstageVolume {id}: {e:?}"));
    }
}

impl Driver {
    /// Starts the driver on `pool` with extra flags.
    pub fn start(pool: &Pool, extra: &[&str]) -> Driver {
        Self::start_with_env(pool, extra, &[])
    }

    pub fn start_with_env(pool: &Pool, extra: &[&str], envs: &[(&str, &str)]) -> Driver {
        let base = pool.dir.path().join("driver");
        std::fs::create_dir_all(&base).unwrap();
        let socket = base.join("csi.sock");
        let state = base.join("state");
        let mut args = vec![
            format!("--endpoint=unix://{}", socket.display()),
            "--nodeid=test-node".to_string(),
            format!("--pool=default={}", pool.path.display()),
            format!("--state-dir={}", state.display()),
            "--log-level=debug".to_string(),
            // The kernel's switch of expedited grace periods is the machine's,
            // and the tests of a binary run at once: only a test that asks for
            // it (`--expedite-freeze`, which comes later and wins) touches it.
            "--expedite-freeze=false".to_string(),
            // Inline ephemeral volumes are off by default; the tests that
            // publish them use the pool, up to its size.
            "--ephemeral-pools=default".to_string(),
            "--ephemeral-max-size=8Gi".to_string(),
            // The staging and target paths of the tests are in their own
            // directory, not the kubelet's.
            format!("--allowed-path-root={}", pool.dir.path().display()),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut d = Driver {
            child: None,
            socket,
            state,
            args,
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            log: base.join("driver.log"),
        };
        d.spawn();
        d
    }

    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_csi-driver"));
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        // Its own process group, so that a crash takes the processes it was
        // starting with it (see `reap_group`).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        self.child = Some(cmd.spawn().expect("start csi-driver"));
        self.wait_ready();
    }

    /// After the driver process ended: kills what is left of its process group
    /// and waits until no process holds its socket. A child it was starting
    /// when it died (cloned, not yet exec'd) holds copies of all its
    /// descriptors, the listening socket and the state lock among them, until
    /// it execs; a restart in that window would find the old socket still
    /// accepting (and resetting what it accepted when the child execs) and the
    /// state still locked. A crashed container loses all its processes at once;
    /// this makes the tests' crash the same.
    fn reap_group(&self, pid: u32) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
            if Instant::now() > deadline {
                // Not a panic: this also runs in Drop, maybe while unwinding.
                eprintln!("the socket of a dead driver still accepts after 10 s");
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until the socket answers, or the process exits.
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    self.child = None;
                    panic!(
                        "csi-driver exited with {status} at start:\n{}",
                        self.log_text()
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "csi-driver did not listen within 30 s:\n{}",
            self.log_text()
        );
    }

    /// Waits for the process to end by itself (a failpoint's abort), up to `secs`.
    pub fn wait_exit(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    let pid = c.id();
                    self.child = None;
                    self.reap_group(pid);
                    return Some(status);
                }
            } else {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGKILL, as a crash.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            self.reap_group(c.id());
        }
    }

    /// SIGTERM, then wait.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        c.wait().ok()
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Clients of the driver, once it answers a Probe (whatever the answer): a
    /// socket that accepted a connection in `wait_ready` has been seen to refuse
    /// the next one on a loaded machine right after a restart, and a call that
    /// never reached the driver proves nothing.
    pub async fn clients(&self) -> Clients {
        let ch = csi_glue::connect(&format!("unix://{}", self.socket.display()))
            .await
            .expect("connect");
        let mut identity = IdentityClient::new(ch.clone());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match identity.probe(csi::ProbeRequest {}).await {
                Err(e) if e.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) if e.code() == tonic::Code::Unavailable => {
                    panic!(
                        "the driver does not answer a Probe: {e:?}\n{}",
                        self.log_text()
                    )
                }
                _ => break,
            }
        }
        Clients {
            identity,
            controller: ControllerClient::new(ch.clone()),
            node: NodeClient::new(ch.clone()),
            group: GroupControllerClient::new(ch),
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub fn mount_cap(fs: &str, mode: volume_capability::access_mode::Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume {
                fs_type: fs.to_string(),
                mount_flags: vec![],
                volume_mount_group: String::new(),
            },
        )),
        access_mode: Some(volume_capability::AccessMode { mode: mode as i32 }),
    }
}

pub fn block_cap(mode: volume_capability::access_mode::Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(volume_capability::AccessType::Block(
            volume_capability::BlockVolume {},
        )),
        access_mode: Some(volume_capability::AccessMode { mode: mode as i32 }),
    }
}

pub fn writer() -> volume_capability::access_mode::Mode {
    volume_capability::access_mode::Mode::SingleNodeWriter
}

pub fn create_req(
    name: &str,
    size: i64,
    cap: csi::VolumeCapability,
    params: &[(&str, &str)],
) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.to_string(),
        capacity_range: csi_glue::capacity_at_least(size),
        volume_capabilities: vec![cap],
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>(),
        ..Default::default()
    }
}

// The request builders of the node's calls, for every test file: paths are
// taken as anything path-like and sent as they display.

pub fn stage_req(
    volume_id: &str,
    staging: impl AsRef<Path>,
    cap: csi::VolumeCapability,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: volume_id.to_string(),
        staging_target_path: staging.as_ref().display().to_string(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

pub fn publish_req(
    volume_id: &str,
    staging: impl AsRef<Path>,
    target: impl AsRef<Path>,
    cap: csi::VolumeCapability,
    readonly: bool,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: volume_id.to_string(),
        staging_target_path: staging.as_ref().display().to_string(),
        target_path: target.as_ref().display().to_string(),
        volume_capability: Some(cap),
        readonly,
        ..Default::default()
    }
}

pub fn unstage_req(id: &str, staging: impl AsRef<Path>) -> csi::NodeUnstageVolumeRequest {
    csi::NodeUnstageVolumeRequest {
        volume_id: id.to_string(),
        staging_target_path: staging.as_ref().display().to_string(),
    }
}

pub fn unpublish_req(id: &str, target: impl AsRef<Path>) -> csi::NodeUnpublishVolumeRequest {
    csi::NodeUnpublishVolumeRequest {
        volume_id: id.to_string(),
        target_path: target.as_ref().display().to_string(),
    }
}

/// NodeGetVolumeStats of a volume at a path where it is published or staged.
pub fn stats_req(id: &str, path: impl AsRef<Path>) -> csi::NodeGetVolumeStatsRequest {
    csi::NodeGetVolumeStatsRequest {
        volume_id: id.to_string(),
        volume_path: path.as_ref().display().to_string(),
        staging_target_path: String::new(),
    }
}

/// The volume context key that makes a NodePublishVolume an ephemeral inline
/// volume.
pub const EPHEMERAL_KEY: &str = "csi.storage.k8s.io/ephemeral";

/// NodePublishVolume of an ephemeral inline volume (no stage), with the pod's
/// volumeAttributes (`size`, `type`, ...).
pub fn ephemeral_req(
    volume_id: &str,
    target: impl AsRef<Path>,
    cap: csi::VolumeCapability,
    attributes: &[(&str, &str)],
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: volume_id.to_string(),
        target_path: target.as_ref().display().to_string(),
        volume_capability: Some(cap),
        volume_context: [(EPHEMERAL_KEY, "true")]
            .iter()
            .chain(attributes)
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

impl Driver {
    /// This driver's flags for another process on the same pool and state dir,
    /// serving `socket`; its `--mode` is left for the caller to add.
    pub fn args_beside(&self, socket: &Path) -> Vec<String> {
        let mut args: Vec<String> = self
            .args
            .iter()
            .filter(|a| !a.starts_with("--mode") && !a.starts_with("--endpoint"))
            .cloned()
            .collect();
        args.push(format!("--endpoint=unix://{}", socket.display()));
        args
    }

    /// Starts a second driver process on the same pool and state dir as this one,
    /// with its own socket and log: the other half of the central deployment
    /// (start this one with `--mode=controller`, give `--mode=node` here).
    pub fn start_beside(&self, name: &str, extra: &[&str], envs: &[(&str, &str)]) -> Driver {
        let base = self.socket.parent().unwrap().to_path_buf();
        let socket = base.join(format!("{name}.sock"));
        let mut args = self.args_beside(&socket);
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut d = Driver {
            child: None,
            socket,
            state: self.state.clone(),
            args,
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            log: base.join(format!("{name}.log")),
        };
        d.spawn();
        d
    }

    /// Whether Probe answers ready.
    pub async fn probe_ready(&self) -> bool {
        let mut c = self.clients().await;
        let r = c.identity.probe(csi::ProbeRequest {}).await;
        r.is_ok_and(|r| r.into_inner().ready == Some(true))
    }
}

/// CreateVolume, which must succeed: the volume made.
pub async fn must_create(
    c: &mut ControllerClient<Channel>,
    req: csi::CreateVolumeRequest,
) -> csi::Volume {
    let name = req.name.clone();
    c.create_volume(req)
        .await
        .unwrap_or_else(|e| panic!("CreateVolume {name}: {e:?}"))
        .into_inner()
        .volume
        .unwrap_or_else(|| panic!("CreateVolume {name} answered no volume"))
}

/// CreateSnapshot, which must succeed: the snapshot made.
pub async fn must_snapshot(
    c: &mut ControllerClient<Channel>,
    req: csi::CreateSnapshotRequest,
) -> csi::Snapshot {
    let name = req.name.clone();
    c.create_snapshot(req)
        .await
        .unwrap_or_else(|e| panic!("CreateSnapshot {name}: {e:?}"))
        .into_inner()
        .snapshot
        .unwrap_or_else(|| panic!("CreateSnapshot {name} answered no snapshot"))
}

/// Creates a volume and returns its id.
pub async fn create_volume_id(
    c: &mut ControllerClient<Channel>,
    name: &str,
    size: i64,
    cap: csi::VolumeCapability,
) -> String {
    must_create(c, create_req(name, size, cap, &[]))
        .await
        .volume_id
}

/// Every entry of a paged List call, asking page after page until no next token
/// is given: `page(client, token)` asks for the page at `token` and gives its
/// entries and the next token.
pub async fn all_pages<T, F, Fut>(c: &ControllerClient<Channel>, mut page: F) -> Vec<T>
where
    F: FnMut(ControllerClient<Channel>, String) -> Fut,
    Fut: std::future::Future<Output = (Vec<T>, String)>,
{
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let (entries, next) = page(c.clone(), token).await;
        out.extend(entries);
        if next.is_empty() {
            return out;
        }
        token = next;
    }
}

/// Every volume ListVolumes reports, in pages of `max` entries (0: as many as
/// the driver gives), in the order listed; a failed call fails the test.
pub async fn all_volumes(c: &ControllerClient<Channel>, max: i32) -> Vec<csi::Volume> {
    all_pages(c, |mut c, starting_token| async move {
        let req = csi::ListVolumesRequest {
            max_entries: max,
            starting_token,
        };
        let r = c.list_volumes(req).await.unwrap().into_inner();
        let volumes = r.entries.into_iter().map(|e| e.volume.unwrap());
        (volumes.collect(), r.next_token)
    })
    .await
}

pub async fn create_group(
    c: &mut Clients,
    name: &str,
    vols: &[&str],
) -> Result<csi::VolumeGroupSnapshot, tonic::Status> {
    Ok(c.group
        .create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
            name: name.to_string(),
            source_volume_ids: vols.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .group_snapshot
        .expect("CreateVolumeGroupSnapshot answers a group"))
}

pub async fn delete_group(c: &mut Clients, id: &str) -> Result<(), tonic::Status> {
    c.group
        .delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: id.to_string(),
            ..Default::default()
        })
        .await?;
    Ok(())
}

/// Every snapshot ListSnapshots reports, as `all_volumes` lists volumes.
pub async fn all_snapshots(c: &ControllerClient<Channel>, max: i32) -> Vec<csi::Snapshot> {
    all_pages(c, |mut c, starting_token| async move {
        let req = csi::ListSnapshotsRequest {
            max_entries: max,
            starting_token,
            ..Default::default()
        };
        let r = c.list_snapshots(req).await.unwrap().into_inner();
        let snapshots = r.entries.into_iter().map(|e| e.snapshot.unwrap());
        (snapshots.collect(), r.next_token)
    })
    .await
}

pub fn delete_req(id: &str) -> csi::DeleteVolumeRequest {
    csi::DeleteVolumeRequest {
        volume_id: id.to_string(),
        ..Default::default()
    }
}

pub fn delete_snapshot_req(id: &str) -> csi::DeleteSnapshotRequest {
    csi::DeleteSnapshotRequest {
        snapshot_id: id.to_string(),
        ..Default::default()
    }
}

pub fn snapshot_req(name: &str, source: &str) -> csi::CreateSnapshotRequest {
    csi::CreateSnapshotRequest {
        name: name.to_string(),
        source_volume_id: source.to_string(),
        ..Default::default()
    }
}

/// The (status, reason) pairs of a volume's health, sorted: what a health test
/// asserts on (messages are for humans and may change).
pub fn health_reasons(h: &csi::VolumeHealth) -> Vec<(csi::VolumeHealthErrorType, String)> {
    let mut out: Vec<_> = h
        .health_statuses
        .iter()
        .map(|e| {
            (
                csi::VolumeHealthErrorType::try_from(e.status)
                    .unwrap_or(csi::VolumeHealthErrorType::UnknownVolumeHealthType),
                e.reason.clone(),
            )
        })
        .collect();
    out.sort();
    out
}

/// NodeGetVolumeHealth of a volume, with the paths the node knows.
pub async fn node_health(c: &mut Clients, id: &str) -> csi::VolumeHealth {
    c.node
        .node_get_volume_health(csi::NodeGetVolumeHealthRequest {
            volume_id: id.to_string(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("NodeGetVolumeHealth {id}: {e:?}"))
        .into_inner()
        .volume_health
        .expect("volume_health is set")
}

/// ControllerGetVolumeHealth of a volume.
pub async fn controller_health(c: &mut Clients, id: &str) -> csi::VolumeHealth {
    c.controller
        .controller_get_volume_health(csi::ControllerGetVolumeHealthRequest {
            volume_id: id.to_string(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("ControllerGetVolumeHealth {id}: {e:?}"))
        .into_inner()
        .volume_health
        .expect("volume_health is set")
}

/// Whether GetPluginCapabilities advertises the service capability `t`.
pub async fn advertises_service(c: &mut Clients, t: csi::plugin_capability::service::Type) -> bool {
    c.identity
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .iter()
        .any(|cap| {
            matches!(&cap.r#type, Some(csi::plugin_capability::Type::Service(s))
                if s.r#type == t as i32)
        })
}

/// A loop device's settings as the kernel reports them: (direct I/O, read-ahead KiB).
pub fn loop_settings(dev: &str) -> (String, String) {
    let name = dev.trim_start_matches("/dev/");
    let read = |f: &str| {
        std::fs::read_to_string(format!("/sys/block/{name}/{f}"))
            .unwrap()
            .trim()
            .to_string()
    };
    (read("loop/dio"), read("queue/read_ahead_kb"))
}

/// The mode a socket the driver binds gets: 0660, less what the umask (which
/// the driver inherits from the test) takes away.
pub fn socket_mode() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let umask = status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        .expect("Umask in /proc/self/status");
    0o660 & !umask
}

/// GET /metrics on a driver's --metrics-address: the whole answer.
pub fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    answer
}

/// The value of the first sample named `name` whose labels include `labels`.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Runs a mount change on `p` (an unmount, a remount read-only), waiting out a
/// short refusal: the tests of one binary run side by side in one process, and
/// a child forked for another test (mkfs of that test's pool, a `truncate`)
/// holds a copy of every descriptor the process had open at that moment until
/// it execs a few milliseconds later; an open file below `p`, or one deleted
/// but still open, makes the kernel refuse the change (EBUSY) meanwhile. Still
/// refused after 5 s, the test fails and names who holds the mount.
pub fn settle_busy(what: &str, p: &Path, mut change: impl FnMut() -> nix::Result<()>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match change() {
            Ok(()) => return,
            Err(nix::errno::Errno::EBUSY) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("{what} {}: {e}; {}", p.display(), holders_of(p)),
        }
    }
}

/// Unmounts `p` as a reboot or a stray administrator would (see `settle_busy`).
pub fn umount(p: &Path) {
    settle_busy("umount", p, || {
        nix::mount::umount2(p, nix::mount::MntFlags::empty())
    });
}

/// Remounts the filesystem mounted on `p` read-only (`read_only`) or
/// read-write, its other options kept (see `settle_busy`).
pub fn remount(p: &Path, read_only: bool) {
    let mut flags = nix::mount::MsFlags::MS_REMOUNT;
    if read_only {
        flags |= nix::mount::MsFlags::MS_RDONLY;
    }
    settle_busy("remount", p, || {
        nix::mount::mount(None::<&str>, p, None::<&str>, flags, None::<&str>)
    });
}

/// Every process that holds something below `p` (its cwd, root, an open file,
/// deleted or not, or a mapping), as `pid comm: what`, and the loop devices
/// backed by a file below it, for a refused mount change to name them.
pub fn holders_of(p: &Path) -> String {
    let mut out = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return String::new();
    };
    for e in procs.flatten() {
        let pid = e.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let dir = e.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let mut links: Vec<PathBuf> = ["cwd", "root"].iter().map(|l| dir.join(l)).collect();
        if let Ok(fds) = std::fs::read_dir(dir.join("fd")) {
            links.extend(fds.flatten().map(|f| f.path()));
        }
        for l in links {
            if let Ok(t) = std::fs::read_link(&l) {
                if t.starts_with(p) {
                    out.push(format!(
                        "{pid} {}: {} -> {}",
                        comm.trim(),
                        l.display(),
                        t.display()
                    ));
                }
            }
        }
        let maps = std::fs::read_to_string(dir.join("maps")).unwrap_or_default();
        let ps = p.to_string_lossy();
        if let Some(m) = maps.lines().find(|m| m.contains(ps.as_ref())) {
            out.push(format!("{pid} {}: maps {m}", comm.trim()));
        }
    }
    for (dev, backing) in loop_devices() {
        if backing.starts_with(p) {
            out.push(format!("{dev} backed by {}", backing.display()));
        }
    }
    format!("held by: {out:?}")
}
