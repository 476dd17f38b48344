//! The soak: mixed operations from concurrent clients against the
//! real binary while the driver is SIGKILLed at random moments and, separately,
//! the node "reboots" (every mount below the test dirs removed and every loop
//! device of the pool detached behind the driver's back, then the driver
//! restarted and kubelet re-staging and re-publishing what it had).
//!
//! Every call is retried on error as the sidecars and kubelet do; at the end every
//! acknowledged volume and snapshot must exist with its content (SHA-256), nothing
//! may be leaked, and the driver's RSS once idle after the run (the clients gone,
//! no call for a few seconds) must be within 2x of its RSS after a fresh start
//! with the same volumes.
//!
//! The same soak runs on the two processes of the central deployment: a
//! controller (`--mode controller`) and a node plugin (`--mode node`) on one pool
//! and one state dir, each SIGKILLed at random moments; and on a btrfs pool with
//! every kind of volume mixed: images with ext4, xfs and btrfs, raw block volumes
//! and directory volumes (subvolumes), each restored and cloned as its own kind.
//!
//! Parameters (environment): SOAK_OPS (2000), SOAK_CLIENTS (8), SOAK_KILLS (5),
//! SOAK_REBOOTS (1), SOAK_SEED (random). The full run is
//! `SOAK_OPS=20000 SOAK_CLIENTS=32 SOAK_KILLS=20 SOAK_REBOOTS=3`
//! (scripts/reliability.sh).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use csi_proto::csi::{self, controller_client::ControllerClient, node_client::NodeClient};
use csi_storage::ids::{SnapshotId, VolumeId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};
use tonic::transport::Channel;
use tonic::{Code, Status};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What a soak volume is: how it is made, staged, published, written and read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    #[default]
    Ext4,
    Xfs,
    Btrfs,
    Block,
    Dir,
}

impl Kind {
    fn cap(self) -> csi::VolumeCapability {
        match self {
            Kind::Ext4 => mount_cap("ext4", writer()),
            Kind::Xfs => mount_cap("xfs", writer()),
            Kind::Btrfs => mount_cap("btrfs", writer()),
            Kind::Block => block_cap(writer()),
            Kind::Dir => mount_cap("", writer()),
        }
    }

    fn params(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Kind::Dir => &[("kind", "dir")],
            _ => &[],
        }
    }

    /// The size a new volume asks for: the smallest its filesystem is made on.
    fn base(self) -> i64 {
        match self {
            Kind::Xfs => 300 * MIB,
            Kind::Btrfs => 128 * MIB,
            _ => 64 * MIB,
        }
    }

    /// The largest size expansions take it to; a clone or restore asks for it, as
    /// the biggest its source may have.
    fn max(self) -> i64 {
        self.base() + 192 * MIB
    }

    /// Kept in an image file (attached to a loop device when staged).
    fn is_image(self) -> bool {
        self != Kind::Dir
    }
}

/// The pool and the volumes of one soak.
#[derive(Clone, Copy, Debug)]
struct Setup {
    /// The central deployment's two processes instead of one.
    split: bool,
    pool_fs: &'static str,
    /// New volumes take one of these at random.
    kinds: &'static [Kind],
}

#[derive(Clone, Debug, Default)]
struct Vol {
    name: String,
    id: String,
    kind: Kind,
    size: i64,
    staged: bool,
    published: bool,
    data: Option<[u8; 32]>,
}

#[derive(Clone, Debug)]
struct Snap {
    id: String,
    kind: Kind,
    data: Option<[u8; 32]>,
}

/// Figures of the run.
#[derive(Default)]
struct Stats {
    ops: AtomicU64,
    retries: AtomicU64,
    unexpected: AtomicU64,
    mismatches: AtomicU64,
    kills: AtomicU64,
    reboots: AtomicU64,
    writes: AtomicU64,
    reads: AtomicU64,
    /// Volumes made of each kind (clones and restores included).
    made: Mutex<BTreeMap<String, u64>>,
}

struct Shared {
    /// The controller's socket, and the node plugin's (the same in `--mode all`).
    ctl_socket: String,
    node_socket: String,
    scratch: PathBuf,
    stats: Stats,
    /// Bumped by each reboot; a client that sees it change re-stages and
    /// re-publishes what it had, as kubelet does after a node restart.
    epoch: AtomicUsize,
    /// Clients hold it shared for each operation; a reboot takes it exclusively.
    gate: tokio::sync::RwLock<()>,
    target_ops: u64,
    errors: Mutex<BTreeMap<String, u64>>,
    kinds: &'static [Kind],
}

fn sha(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

fn payload(rng: &mut StdRng) -> Vec<u8> {
    let n = rng.random_range(4096..256 * 1024);
    let mut v = vec![0u8; n];
    rng.fill(&mut v[..]);
    v
}

fn fsync_path(p: &Path) -> std::io::Result<()> {
    std::fs::File::open(p)?.sync_all()
}

struct Client {
    k: usize,
    sh: Arc<Shared>,
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    rng: StdRng,
    vols: BTreeMap<String, Vol>,
    snaps: BTreeMap<String, Snap>,
    seq: u64,
    epoch: usize,
}

/// Writes `bytes` at the start of a block device, after their length (4 bytes,
/// little-endian), and syncs them.
fn write_block(dev: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().write(true).open(dev)?;
    let mut buf = (bytes.len() as u32).to_le_bytes().to_vec();
    buf.extend_from_slice(bytes);
    f.write_all(&buf)?;
    f.sync_all()
}

/// What `write_block` left on a device: None for a device never written (zeros),
/// or one whose length is not one a soak writes.
fn read_block(dev: &Path) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(dev).ok()?;
    let mut len = [0u8; 4];
    f.read_exact(&mut len).ok()?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > 1024 * 1024 {
        return None;
    }
    let mut b = vec![0u8; len];
    f.read_exact(&mut b).ok()?;
    Some(b)
}

/// What a hung call leaves to look at: the last lines of each driver process's
/// log (the HTTP/2 frames left out), the freeze markers, the mounts, where each
/// thread of the drivers and of this test waits in the kernel when it is not an
/// idle wait, and (with gdb) the driver's own frames of every driver thread.
fn hang_report(sh: &Shared) -> String {
    // One report, by the first client to find its call hung; the others wait
    // for it (a panic would end the test before the report is out).
    static REPORTED: Mutex<bool> = Mutex::new(false);
    let mut reported = REPORTED.lock().unwrap_or_else(|p| p.into_inner());
    if std::mem::replace(&mut *reported, true) {
        return "(see the hang report above)".into();
    }
    let socket = sh.ctl_socket.trim_start_matches("unix://");
    let base = Path::new(socket).parent().unwrap_or(Path::new("/"));
    let mut out = format!("=== hang report ({})\n", base.display());
    for log in ["driver.log", "node.log"] {
        let text = std::fs::read_to_string(base.join(log)).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.contains("h2::") && !l.contains("hyper"))
            .collect();
        out += &format!("--- last lines of {log}\n");
        for l in &lines[lines.len().saturating_sub(60)..] {
            out += l;
            out.push('\n');
        }
    }
    for f in std::fs::read_dir(base.join("state/shared/frozen"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let text = std::fs::read_to_string(f.path()).unwrap_or_default();
        out += &format!("--- freeze marker {}: {text}\n", f.path().display());
    }
    out += "--- mounts below the test dir\n";
    for m in mounts_below(base.parent().unwrap_or(base)) {
        out += &format!("{}\n", m.display());
    }
    let marker = base.display().to_string();
    let me = std::process::id().to_string();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let driver = cmd.contains(&marker);
        if !driver && pid != me {
            continue;
        }
        out += &format!(
            "--- process {pid}: {}\n",
            cmd.chars().take(120).collect::<String>()
        );
        let mut idle = 0;
        for task in std::fs::read_dir(entry.path().join("task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let read = |f: &str| std::fs::read_to_string(task.path().join(f)).unwrap_or_default();
            let wchan = read("wchan");
            if matches!(wchan.trim(), "0" | "futex_do_wait" | "do_epoll_wait") {
                idle += 1;
                continue;
            }
            out += &format!(
                "thread {} {} wchan={}\n{}",
                task.file_name().to_string_lossy(),
                read("comm").trim(),
                wchan.trim(),
                read("stack")
            );
        }
        out += &format!("({idle} threads in idle waits)\n");
        if driver {
            let gdb = std::process::Command::new("timeout")
                .args([
                    "60",
                    "gdb",
                    "-p",
                    &pid,
                    "-batch",
                    "-ex",
                    "thread apply all bt",
                ])
                .output();
            match gdb {
                Ok(o) => {
                    let text = String::from_utf8_lossy(&o.stdout);
                    let ours: Vec<&str> = text
                        .lines()
                        .filter(|l| l.starts_with("Thread ") || l.contains(" csi_"))
                        .collect();
                    if ours.is_empty() {
                        out += &format!("(gdb: {})\n", String::from_utf8_lossy(&o.stderr).trim());
                    }
                    for l in ours {
                        out += l;
                        out.push('\n');
                    }
                }
                Err(e) => out += &format!("(no gdb: {e})\n"),
            }
        }
    }
    out
}

fn is_transient(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Aborted | Code::Unavailable | Code::Unknown | Code::Cancelled
    )
}

/// `retry` of one call of the controller's (`ctl`) or the node's (`node`) client
/// with `req`, cloned for each attempt; gives the answer.
macro_rules! retried {
    ($s:expr, $what:literal, ctl.$method:ident($req:expr)) => {{
        let req = $req;
        $s.retry($what, |mut c, _| {
            let req = req.clone();
            async move { c.$method(req).await.map(|r| r.into_inner()) }
        })
        .await
    }};
    ($s:expr, $what:literal, node.$method:ident($req:expr)) => {{
        let req = $req;
        $s.retry($what, |_, mut c| {
            let req = req.clone();
            async move { c.$method(req).await.map(|r| r.into_inner()) }
        })
        .await
    }};
}

impl Client {
    async fn connect_to(socket: &str) -> Option<Channel> {
        for _ in 0..200 {
            if let Ok(ch) = csi_glue::connect(socket).await {
                return Some(ch);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Channels to the controller and to the node plugin.
    async fn connect(sh: &Arc<Shared>) -> Option<(Channel, Channel)> {
        let ctl = Self::connect_to(&sh.ctl_socket).await?;
        let node = Self::connect_to(&sh.node_socket).await?;
        Some((ctl, node))
    }

    /// Drops the connections (the driver frees what it held for them); a later
    /// `reconnect` makes new ones.
    fn disconnect(&mut self) {
        let nowhere = tonic::transport::Endpoint::from_static("http://[::1]:9").connect_lazy();
        self.ctl = ControllerClient::new(nowhere.clone());
        self.node = NodeClient::new(nowhere);
    }

    async fn reconnect(&mut self) {
        if let Some((ctl, node)) = Self::connect(&self.sh).await {
            self.ctl = ControllerClient::new(ctl);
            self.node = NodeClient::new(node);
        }
    }

    fn staging(&self, v: &str) -> PathBuf {
        self.sh.scratch.join("staging").join(v)
    }
    fn target(&self, v: &str) -> PathBuf {
        self.sh.scratch.join("pods").join(v)
    }

    /// Runs `f` until it succeeds, as the sidecars do (with a reconnect after a
    /// transport error). Counts one operation.
    async fn retry<T, F, Fut>(&mut self, what: &str, mut f: F) -> T
    where
        F: FnMut(ControllerClient<Channel>, NodeClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut delay = 50;
        for attempt in 0.. {
            let call = f(self.ctl.clone(), self.node.clone());
            match tokio::time::timeout(Duration::from_secs(120), call).await {
                Ok(Ok(v)) => {
                    self.sh.stats.ops.fetch_add(1, Ordering::Relaxed);
                    return v;
                }
                Ok(Err(s)) => {
                    self.sh.stats.retries.fetch_add(1, Ordering::Relaxed);
                    if !is_transient(&s) {
                        self.sh.stats.unexpected.fetch_add(1, Ordering::Relaxed);
                        let key = format!("{what}: {:?}: {}", s.code(), s.message());
                        eprintln!("soak client {}: {key}", self.k);
                        *self.sh.errors.lock().unwrap().entry(key).or_default() += 1;
                    }
                    if matches!(
                        s.code(),
                        Code::Unavailable | Code::Unknown | Code::Cancelled
                    ) {
                        self.reconnect().await;
                    }
                }
                Err(_) => {
                    eprintln!("{}", hang_report(&self.sh));
                    panic!("soak client {}: {what} hung for 120 s", self.k)
                }
            }
            assert!(
                attempt < 200,
                "soak client {}: {what} never succeeded",
                self.k
            );
            tokio::time::sleep(Duration::from_millis(delay)).await;
            delay = (delay * 2).min(1000);
        }
        unreachable!()
    }

    /// A new volume of `kind`, or of a kind picked at random when None; a clone or
    /// restore (`source`) names its source's kind.
    async fn create(
        &mut self,
        kind: Option<Kind>,
        source: Option<csi::VolumeContentSource>,
        data: Option<[u8; 32]>,
    ) {
        self.seq += 1;
        let name = format!("soak-c{}-v{}", self.k, self.seq);
        let kind = kind.unwrap_or_else(|| {
            let kinds = self.sh.kinds;
            kinds[self.rng.random_range(0..kinds.len())]
        });
        let mut req = create_req(&name, kind.base(), kind.cap(), kind.params());
        let size = if let Some(src) = source {
            req.volume_content_source = Some(src);
            // A clone or restore is at least as big as its source: ask for the
            // biggest size a source may have.
            req.capacity_range = csi_glue::capacity_at_least(kind.max());
            kind.max()
        } else {
            kind.base()
        };
        let v = retried!(self, "CreateVolume", ctl.create_volume(req))
            .volume
            .expect("volume");
        assert_eq!(v.volume_id, VolumeId::for_name(&name).to_string());
        *self
            .sh
            .stats
            .made
            .lock()
            .unwrap()
            .entry(format!("{kind:?}"))
            .or_default() += 1;
        self.vols.insert(
            name.clone(),
            Vol {
                name,
                id: v.volume_id,
                kind,
                size: v.capacity_bytes.max(size),
                data,
                ..Default::default()
            },
        );
    }

    async fn stage(&mut self, n: &str) {
        let v = &self.vols[n];
        let req = stage_req(&v.id, self.staging(n), v.kind.cap());
        retried!(self, "NodeStageVolume", node.node_stage_volume(req));
        self.vols.get_mut(n).unwrap().staged = true;
    }

    async fn publish(&mut self, n: &str) {
        let req = publish_req(
            &self.vols[n].id,
            self.staging(n),
            self.target(n),
            self.vols[n].kind.cap(),
            false,
        );
        retried!(self, "NodePublishVolume", node.node_publish_volume(req));
        self.vols.get_mut(n).unwrap().published = true;
    }

    async fn unpublish(&mut self, n: &str) {
        let req = unpublish_req(&self.vols[n].id, self.target(n));
        retried!(self, "NodeUnpublishVolume", node.node_unpublish_volume(req));
        self.vols.get_mut(n).unwrap().published = false;
    }

    async fn unstage(&mut self, n: &str) {
        let req = unstage_req(&self.vols[n].id, self.staging(n));
        retried!(self, "NodeUnstageVolume", node.node_unstage_volume(req));
        self.vols.get_mut(n).unwrap().staged = false;
    }

    async fn delete(&mut self, n: &str) {
        retried!(
            self,
            "DeleteVolume",
            ctl.delete_volume(delete_req(&self.vols[n].id))
        );
        self.vols.remove(n);
    }

    async fn snapshot(&mut self, n: &str) {
        self.seq += 1;
        let name = format!("soak-c{}-s{}", self.k, self.seq);
        let v = self.vols[n].clone();
        let s = retried!(
            self,
            "CreateSnapshot",
            ctl.create_snapshot(snapshot_req(&name, &v.id))
        )
        .snapshot
        .expect("snapshot");
        assert_eq!(s.snapshot_id, SnapshotId::for_name(&name).to_string());
        self.snaps.insert(
            name,
            Snap {
                id: s.snapshot_id,
                kind: v.kind,
                data: v.data,
            },
        );
    }

    async fn delete_snapshot(&mut self, n: &str) {
        let req = delete_snapshot_req(&self.snaps[n].id);
        retried!(self, "DeleteSnapshot", ctl.delete_snapshot(req));
        self.snaps.remove(n);
    }

    async fn expand(&mut self, n: &str) {
        let v = self.vols[n].clone();
        let want = (v.size + 64 * MIB).min(v.kind.max());
        let req = csi::ControllerExpandVolumeRequest {
            volume_id: v.id.clone(),
            capacity_range: csi_glue::capacity_at_least(want),
            volume_capability: Some(v.kind.cap()),
            ..Default::default()
        };
        let r = retried!(
            self,
            "ControllerExpandVolume",
            ctl.controller_expand_volume(req)
        );
        assert!(r.capacity_bytes >= want);
        self.vols.get_mut(n).unwrap().size = r.capacity_bytes;
    }

    /// Writes a new payload into a published volume. The file I/O runs on a
    /// blocking thread: on the async workers, a slow fsync (or a frozen
    /// filesystem) would stall every client's calls and the chaos task with it.
    async fn write(&mut self, n: &str) {
        let bytes = payload(&mut self.rng);
        let digest = sha(&bytes);
        let t = self.target(n);
        let k = self.k;
        let what = n.to_string();
        let block = self.vols[n].kind == Kind::Block;
        tokio::task::spawn_blocking(move || {
            if block {
                return write_block(&t, &bytes)
                    .unwrap_or_else(|e| panic!("soak client {k}: writing {what}: {e}"));
            }
            let f = t.join("data");
            let tmp = t.join("data.new");
            std::fs::write(&tmp, &bytes)
                .and_then(|_| fsync_path(&tmp))
                .and_then(|_| std::fs::rename(&tmp, &f))
                .and_then(|_| fsync_path(&t))
                .unwrap_or_else(|e| panic!("soak client {k}: writing {what}: {e}"));
        })
        .await
        .expect("a soak write panicked");
        self.vols.get_mut(n).unwrap().data = Some(digest);
        self.sh.stats.writes.fetch_add(1, Ordering::Relaxed);
    }

    async fn verify(&mut self, n: &str) {
        let block = self.vols[n].kind == Kind::Block;
        let t = self.target(n);
        let got = tokio::task::spawn_blocking(move || {
            let bytes = if block {
                read_block(&t)
            } else {
                std::fs::read(t.join("data")).ok()
            };
            bytes.map(|b| sha(&b))
        })
        .await
        .expect("a soak read panicked");
        let v = &self.vols[n];
        self.sh.stats.reads.fetch_add(1, Ordering::Relaxed);
        if got != v.data {
            self.sh.stats.mismatches.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "soak client {}: DATA MISMATCH in {n} ({}): read {:?}",
                self.k,
                v.id,
                got.map(|_| "other bytes").unwrap_or("nothing")
            );
        }
    }

    /// After a reboot: stage and publish again what kubelet had.
    async fn recover_reboot(&mut self) {
        let names: Vec<String> = self.vols.keys().cloned().collect();
        for n in names {
            let v = self.vols[&n].clone();
            if v.staged {
                self.stage(&n).await;
            }
            if v.published {
                self.publish(&n).await;
            }
        }
    }

    fn pick(&mut self, names: Vec<String>) -> Option<String> {
        if names.is_empty() {
            None
        } else {
            let i = self.rng.random_range(0..names.len());
            Some(names[i].clone())
        }
    }

    fn vols_where(&self, f: impl Fn(&Vol) -> bool) -> Vec<String> {
        self.vols
            .values()
            .filter(|v| f(v))
            .map(|v| v.name.clone())
            .collect()
    }

    async fn one_op(&mut self) {
        let roll = self.rng.random_range(0..100);
        let unstaged = self.vols_where(|v| !v.staged);
        let published = self.vols_where(|v| v.published);
        match roll {
            0..=14 if self.vols.len() < 4 => self.create(None, None, None).await,
            15..=34 => {
                if let Some(n) = self.pick(unstaged.clone()) {
                    self.stage(&n).await;
                    self.publish(&n).await;
                    if self.vols[&n].data.is_some() {
                        self.verify(&n).await;
                    }
                    self.write(&n).await;
                }
            }
            35..=44 => {
                if let Some(n) = self.pick(published.clone()) {
                    self.verify(&n).await;
                    self.write(&n).await;
                }
            }
            45..=54 if self.snaps.len() < 3 => {
                let all = self.vols_where(|_| true);
                if let Some(n) = self.pick(all) {
                    self.snapshot(&n).await;
                }
            }
            55..=61 if self.vols.len() < 5 => {
                let snaps: Vec<String> = self.snaps.keys().cloned().collect();
                if let Some(s) = self.pick(snaps) {
                    let sn = self.snaps[&s].clone();
                    let src = csi::VolumeContentSource {
                        r#type: Some(csi::volume_content_source::Type::Snapshot(
                            csi::volume_content_source::SnapshotSource { snapshot_id: sn.id },
                        )),
                    };
                    self.create(Some(sn.kind), Some(src), sn.data).await;
                }
            }
            62..=67 if self.vols.len() < 5 => {
                let all = self.vols_where(|_| true);
                if let Some(n) = self.pick(all) {
                    let v = self.vols[&n].clone();
                    let src = csi::VolumeContentSource {
                        r#type: Some(csi::volume_content_source::Type::Volume(
                            csi::volume_content_source::VolumeSource { volume_id: v.id },
                        )),
                    };
                    self.create(Some(v.kind), Some(src), v.data).await;
                }
            }
            68..=73 => {
                let small = self.vols_where(|v| v.size < v.kind.max());
                if let Some(n) = self.pick(small) {
                    self.expand(&n).await;
                }
            }
            74..=85 => {
                if let Some(n) = self.pick(published) {
                    self.verify(&n).await;
                    self.unpublish(&n).await;
                    self.unstage(&n).await;
                }
            }
            86..=93 => {
                if let Some(n) = self.pick(unstaged) {
                    self.delete(&n).await;
                }
            }
            94..=99 => {
                let snaps: Vec<String> = self.snaps.keys().cloned().collect();
                if let Some(s) = self.pick(snaps) {
                    self.delete_snapshot(&s).await;
                }
            }
            _ => {}
        }
    }

    async fn run(mut self) -> Client {
        while self.sh.stats.ops.load(Ordering::Relaxed) < self.sh.target_ops {
            let sh = self.sh.clone();
            let _g = sh.gate.read().await;
            let e = sh.epoch.load(Ordering::SeqCst);
            if e != self.epoch {
                self.epoch = e;
                self.recover_reboot().await;
            }
            self.one_op().await;
        }
        self
    }
}

/// The driver's processes: one with `--mode all`, or the controller and the node
/// plugin of the central deployment.
struct Procs {
    ctl: Driver,
    node: Option<Driver>,
}

impl Procs {
    fn start(pool: &Pool, split: bool) -> Procs {
        if !split {
            return Procs {
                ctl: Driver::start(pool, &[]),
                node: None,
            };
        }
        let ctl = Driver::start(pool, &["--mode=controller"]);
        let node = ctl.start_beside("node", &["--mode=node"], &[]);
        Procs {
            ctl,
            node: Some(node),
        }
    }

    fn node_socket(&self) -> String {
        let d = self.node.as_ref().unwrap_or(&self.ctl);
        format!("unix://{}", d.socket.display())
    }

    /// SIGKILLs one process (the node plugin when `node` and there is one) and
    /// starts it again; true when it was the node plugin.
    fn kill_one(&mut self, node: bool) -> bool {
        match self.node.as_mut() {
            Some(n) if node => {
                n.restart();
                true
            }
            _ => {
                self.ctl.restart();
                false
            }
        }
    }

    fn kill9(&mut self) {
        self.ctl.kill9();
        if let Some(n) = self.node.as_mut() {
            n.kill9();
        }
    }

    fn spawn(&mut self) {
        self.ctl.spawn();
        if let Some(n) = self.node.as_mut() {
            n.spawn();
        }
    }

    fn log_text(&self) -> String {
        let node = self.node.as_ref().map(|n| n.log_text()).unwrap_or_default();
        self.ctl.log_text() + &node
    }
}

/// A node reboot behind the driver's back: the driver dies, every mount below the
/// test dir but the pool goes, every loop device of the pool is detached.
fn reboot(pool: &Pool, driver: &mut Procs) {
    driver.kill9();
    for _ in 0..5 {
        let mut ms: Vec<PathBuf> = mounts_below(pool.dir.path())
            .into_iter()
            .filter(|m| m != &pool.path)
            .collect();
        if ms.is_empty() {
            break;
        }
        ms.sort();
        for m in ms.iter().rev() {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::empty())
                .or_else(|_| nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH));
        }
    }
    for d in loops_below(&pool.path) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &d])
            .status();
    }
    // A detach of a busy device is deferred: wait for it.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !loops_below(&pool.path).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    driver.spawn();
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Where a process's heap memory lies, from /proc/PID/smaps: the resident KiB of
/// the main arena (`[heap]`) and of each other glibc arena. A thread arena lives in
/// its own 64 MiB-aligned anonymous reservation (its heap, then the part not yet
/// in use), so each writable anonymous mapping that starts on a 64 MiB boundary
/// begins one, and every anonymous mapping up to the next boundary belongs to it.
fn arenas_kib(pid: u32) -> (u64, Vec<u64>) {
    const HEAP_MAX: u64 = 64 << 20;
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let (mut main, mut arenas) = (0, Vec::new());
    // The mapping being read: whether it is the main heap, the arena it is part
    // of (index into `arenas`) and where that arena's reservation ends.
    let (mut in_main, mut arena, mut arena_end): (bool, Option<usize>, u64) = (false, None, 0);
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let range = fields.first().and_then(|r| r.split_once('-'));
        if let Some((a, b)) = range.filter(|_| fields.len() >= 5) {
            let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
            else {
                continue;
            };
            let anonymous = fields[4] == "0" && fields.len() == 5;
            in_main = fields.get(5) == Some(&"[heap]");
            if anonymous && start % HEAP_MAX == 0 && fields[1].starts_with("rw") {
                arenas.push(0);
                arena = Some(arenas.len() - 1);
                arena_end = start + HEAP_MAX;
            } else if !(anonymous && end <= arena_end) {
                arena = None;
            }
        } else if let Some(kib) = line
            .strip_prefix("Rss:")
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        {
            if in_main {
                main += kib;
            } else if let Some(i) = arena {
                arenas[i] += kib;
            }
        }
    }
    (main, arenas)
}

/// The RSS of a driver that has gone idle: the lowest of readings every half
/// second for 25 seconds (the driver hands back a busy spell's memory once it has
/// been idle for a little longer than its blocking threads' 10 s keep-alive).
async fn rss_once_idle(pid: u32) -> u64 {
    let start = Instant::now();
    let mut low = u64::MAX;
    while start.elapsed() < Duration::from_secs(25) {
        let now = rss_kib(pid);
        assert!(now > 0, "the driver (pid {pid}) is gone");
        low = low.min(now);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    low
}

/// The ids of a store of the state; any file in it but its snapshot and journal
/// (a temporary, a damaged file set aside) counts as an id of its own, so that
/// the diff shows it.
fn records(dir: &Path) -> BTreeSet<String> {
    let mut ids: BTreeSet<String> = csi_storage::core::store::read_raw(dir)
        .map(|r| r.into_keys().collect())
        .unwrap_or_default();
    ids.extend(
        names(dir)
            .into_iter()
            .filter(|n| !csi_storage::core::store::is_store_file(n)),
    );
    ids
}

fn diff(out: &mut Vec<String>, what: &str, have: BTreeSet<String>, want: BTreeSet<String>) {
    for x in have.difference(&want) {
        out.push(format!("{what}: unaccounted {x}"));
    }
    for x in want.difference(&have) {
        out.push(format!("{what}: missing {x}"));
    }
}

/// Differences between what is there and what the clients account for, each
/// described; empty when nothing leaked and nothing is missing.
async fn leaks(pool: &Pool, driver: &Driver, clients: &[Client]) -> Vec<String> {
    let mut out = Vec::new();
    let vols: Vec<&Vol> = clients.iter().flat_map(|c| c.vols.values()).collect();
    let snaps: Vec<&Snap> = clients.iter().flat_map(|c| c.snaps.values()).collect();
    let vol_ids: BTreeSet<String> = vols.iter().map(|v| v.id.clone()).collect();
    let snap_ids: BTreeSet<String> = snaps.iter().map(|s| s.id.clone()).collect();
    // The name of each one's data in the pool: an image file, or a directory.
    let in_pool = |id: &str, kind: Kind| {
        if kind.is_image() {
            format!("{id}.img")
        } else {
            id.to_string()
        }
    };

    // The driver's view.
    let c = driver.clients().await;
    let listed = all_volumes(&c.controller, 100).await;
    let listed = listed.into_iter().map(|v| v.volume_id).collect();
    diff(&mut out, "ListVolumes", listed, vol_ids.clone());
    let listed = all_snapshots(&c.controller, 100).await;
    let listed = listed.into_iter().map(|s| s.snapshot_id).collect();
    diff(&mut out, "ListSnapshots", listed, snap_ids.clone());

    // The pool and the state dir.
    diff(
        &mut out,
        "<pool>/volumes",
        names(&pool.path.join("volumes")),
        vols.iter().map(|v| in_pool(&v.id, v.kind)).collect(),
    );
    diff(
        &mut out,
        "<pool>/snapshots",
        names(&pool.path.join("snapshots")),
        snaps.iter().map(|s| in_pool(&s.id, s.kind)).collect(),
    );
    diff(
        &mut out,
        "<pool>/ephemeral",
        names(&pool.path.join("ephemeral")),
        BTreeSet::new(),
    );
    let st = &driver.state;
    diff(
        &mut out,
        "<state>/controller/volumes",
        records(&st.join("controller/volumes")),
        vol_ids.clone(),
    );
    diff(
        &mut out,
        "<state>/controller/snapshots",
        records(&st.join("controller/snapshots")),
        snap_ids.clone(),
    );
    let staged: BTreeSet<String> = vols
        .iter()
        .filter(|v| v.staged || v.published)
        .map(|v| v.id.clone())
        .collect();
    diff(
        &mut out,
        "<state>/node/staged",
        records(&st.join("node/staged")),
        staged.clone(),
    );
    diff(
        &mut out,
        "<state>/shared/staged",
        names(&st.join("shared/staged")),
        staged.clone(),
    );
    diff(
        &mut out,
        "<state>/shared/frozen",
        names(&st.join("shared/frozen")),
        BTreeSet::new(),
    );
    let locks = volume_locks(st);
    if !locks.is_subset(&vol_ids) {
        diff(&mut out, "<state>/shared/locks", locks, vol_ids.clone());
    }

    // Loop devices and mounts.
    let want_loops: BTreeSet<String> = vols
        .iter()
        .filter(|v| v.staged && v.kind.is_image())
        .map(|v| format!("{}/volumes/{}.img", pool.path.display(), v.id))
        .collect();
    let loops = loop_backings_below(&pool.path);
    let have_loops: BTreeSet<String> = loops.iter().map(|p| p.display().to_string()).collect();
    if loops.len() != have_loops.len() {
        out.push(format!(
            "loop devices: an image is attached twice: {loops:?}"
        ));
    }
    let mut want_mounts = vec![pool.path.clone()];
    for cl in clients {
        for v in cl.vols.values() {
            // A raw block volume is attached at its stage, not mounted.
            if v.staged && v.kind != Kind::Block {
                want_mounts.push(cl.staging(&v.name));
            }
            if v.published {
                want_mounts.push(cl.target(&v.name));
            }
        }
    }
    want_mounts.sort();
    let mut mounts = mounts_below(pool.dir.path());
    mounts.sort();
    if mounts != want_mounts {
        let have: BTreeSet<String> = mounts.iter().map(|p| p.display().to_string()).collect();
        let want: BTreeSet<String> = want_mounts
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        if have == want {
            out.push("mounts: a path is mounted twice".into());
        }
        let mut o = Vec::new();
        for x in have.difference(&want) {
            o.push(format!("mounts: unaccounted {x}"));
        }
        for x in want.difference(&have) {
            o.push(format!("mounts: missing {x}"));
        }
        out.extend(o);
    }
    diff(&mut out, "loop devices", have_loops, want_loops);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_soak_mixed_operations_with_kills_and_reboots() {
    require_root();
    soak(Setup {
        split: false,
        pool_fs: "xfs",
        kinds: &[Kind::Ext4],
    })
    .await;
}

/// The central deployment's two processes on one pool and state dir, each killed
/// at random moments.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_soak_controller_and_node_processes_with_kills_of_either() {
    require_root();
    soak(Setup {
        split: true,
        pool_fs: "xfs",
        kinds: &[Kind::Ext4],
    })
    .await;
}

/// A btrfs pool with every kind of volume: images with each filesystem, raw
/// block volumes and subvolumes, snapshotted, restored, cloned and grown under
/// the same kills and reboots.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_soak_btrfs_pool_with_every_kind_of_volume() {
    require_root();
    soak(Setup {
        split: false,
        pool_fs: "btrfs",
        kinds: &[Kind::Ext4, Kind::Xfs, Kind::Btrfs, Kind::Block, Kind::Dir],
    })
    .await;
}

/// The soaks of this file run one after the other: each is timed, and each
/// checks every loop device and mount below its own directories.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn soak(setup: Setup) {
    let _one = ONE_AT_A_TIME.lock().await;
    let split = setup.split;
    let ops = env_or("SOAK_OPS", 2000);
    let nclients = env_or("SOAK_CLIENTS", 8) as usize;
    let kills = env_or("SOAK_KILLS", 5);
    let reboots = env_or("SOAK_REBOOTS", 1);
    let seed = env_or("SOAK_SEED", rand::rng().random());
    eprintln!(
        "soak: ops={ops} clients={nclients} kills={kills} reboots={reboots} seed={seed} \
         two_processes={split} pool={} kinds={:?} (SOAK_SEED={seed} repeats the choices)",
        setup.pool_fs, setup.kinds
    );
    let started = Instant::now();
    let pool = Pool::with_size(setup.pool_fs, "32G");
    let scratch = pool.scratch("soak");
    std::fs::create_dir_all(scratch.join("staging")).unwrap();
    std::fs::create_dir_all(scratch.join("pods")).unwrap();
    let driver = Procs::start(&pool, split);
    let sh = Arc::new(Shared {
        ctl_socket: format!("unix://{}", driver.ctl.socket.display()),
        node_socket: driver.node_socket(),
        scratch: scratch.clone(),
        stats: Stats::default(),
        epoch: AtomicUsize::new(0),
        gate: tokio::sync::RwLock::new(()),
        target_ops: ops,
        errors: Mutex::new(BTreeMap::new()),
        kinds: setup.kinds,
    });
    let driver = Arc::new(Mutex::new(driver));
    let pool = Arc::new(pool);

    // The chaos: kills and reboots at random points of the run.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut events: Vec<(u64, bool)> = Vec::new();
    let node_kills = Arc::new(AtomicU64::new(0));
    for _ in 0..kills {
        events.push((rng.random_range(ops / 50..ops * 19 / 20), false));
    }
    for _ in 0..reboots {
        events.push((rng.random_range(ops / 10..ops * 9 / 10), true));
    }
    events.sort();
    let chaos = {
        let (sh, driver, pool) = (sh.clone(), driver.clone(), pool.clone());
        let node_kills = node_kills.clone();
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        tokio::spawn(async move {
            for (at, is_reboot) in events {
                while sh.stats.ops.load(Ordering::Relaxed) < at {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..80))).await;
                if is_reboot {
                    let _g = sh.gate.write().await;
                    let (driver, pool) = (driver.clone(), pool.clone());
                    tokio::task::spawn_blocking(move || reboot(&pool, &mut driver.lock().unwrap()))
                        .await
                        .unwrap();
                    sh.epoch.fetch_add(1, Ordering::SeqCst);
                    sh.stats.reboots.fetch_add(1, Ordering::Relaxed);
                } else {
                    let driver = driver.clone();
                    let node = rng.random_bool(0.5);
                    let was_node =
                        tokio::task::spawn_blocking(move || driver.lock().unwrap().kill_one(node))
                            .await
                            .unwrap();
                    if was_node {
                        node_kills.fetch_add(1, Ordering::Relaxed);
                    }
                    sh.stats.kills.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };

    let mut tasks = Vec::new();
    for k in 0..nclients {
        let sh = sh.clone();
        let (ctl, node) = Client::connect(&sh).await.expect("connect");
        let c = Client {
            k,
            sh: sh.clone(),
            ctl: ControllerClient::new(ctl),
            node: NodeClient::new(node),
            rng: StdRng::seed_from_u64(seed.wrapping_add(k as u64 + 1)),
            vols: BTreeMap::new(),
            snaps: BTreeMap::new(),
            seq: 0,
            epoch: 0,
        };
        tasks.push(tokio::spawn(c.run()));
    }
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await.expect("a soak client panicked"));
    }
    chaos.await.unwrap();
    let run_secs = started.elapsed().as_secs_f64();

    // Every client verifies what it has published, and reads back each snapshot
    // by restoring it.
    let driver = Arc::try_unwrap(driver).ok().unwrap().into_inner().unwrap();
    let pool = Arc::try_unwrap(pool).ok().unwrap();
    let rss_run = rss_kib(driver.ctl.pid());
    let leaked = leaks(&pool, &driver.ctl, &clients).await;
    for l in &leaked {
        eprintln!("soak: LEAK {l}");
    }

    let mut verify = Vec::new();
    for mut c in clients {
        verify.push(tokio::spawn(async move {
            let names: Vec<String> = c.vols.keys().cloned().collect();
            for n in names {
                if c.vols[&n].data.is_none() {
                    continue;
                }
                if !c.vols[&n].staged {
                    c.stage(&n).await;
                }
                if !c.vols[&n].published {
                    c.publish(&n).await;
                }
                c.verify(&n).await;
            }
            let snaps: Vec<String> = c.snaps.keys().cloned().collect();
            for s in snaps {
                let sn = c.snaps[&s].clone();
                if sn.data.is_none() {
                    continue;
                }
                let src = csi::VolumeContentSource {
                    r#type: Some(csi::volume_content_source::Type::Snapshot(
                        csi::volume_content_source::SnapshotSource { snapshot_id: sn.id },
                    )),
                };
                c.create(Some(sn.kind), Some(src), sn.data).await;
                let n = format!("soak-c{}-v{}", c.k, c.seq);
                c.stage(&n).await;
                c.publish(&n).await;
                c.verify(&n).await;
            }
            c
        }));
    }
    let mut clients = Vec::new();
    for t in verify {
        clients.push(t.await.expect("a verifying client panicked"));
    }

    // Memory: once idle after the run (no call for a while, the clients gone)
    // versus a fresh start with the same volumes.
    for c in &mut clients {
        c.disconnect();
    }
    let rss_idle = rss_once_idle(driver.ctl.pid()).await;
    let (heap_idle, arenas_idle) = arenas_kib(driver.ctl.pid());
    let mut driver = driver;
    let nvols: usize = clients.iter().map(|c| c.vols.len()).sum();
    let nsnaps: usize = clients.iter().map(|c| c.snaps.len()).sum();
    driver.kill9();
    driver.spawn();
    {
        let mut c = driver.ctl.clients().await;
        let _ = c
            .controller
            .list_volumes(csi::ListVolumesRequest::default())
            .await;
    }
    let rss_fresh = rss_kib(driver.ctl.pid());
    let (heap_fresh, arenas_fresh) = arenas_kib(driver.ctl.pid());

    // Teardown through the driver: everything must go.
    let mut down = Vec::new();
    for mut c in clients {
        c.reconnect().await;
        down.push(tokio::spawn(async move {
            let names: Vec<String> = c.vols.keys().cloned().collect();
            for n in names {
                if c.vols[&n].published {
                    c.unpublish(&n).await;
                }
                if c.vols[&n].staged {
                    c.unstage(&n).await;
                }
                c.delete(&n).await;
            }
            let snaps: Vec<String> = c.snaps.keys().cloned().collect();
            for s in snaps {
                c.delete_snapshot(&s).await;
            }
            c
        }));
    }
    let mut clients = Vec::new();
    for t in down {
        clients.push(t.await.expect("a client panicked in teardown"));
    }
    let after = leaks(&pool, &driver.ctl, &clients).await;
    if after.is_empty() {
        let locks = volume_locks(&driver.ctl.state);
        assert!(
            locks.is_empty(),
            "volume locks left after teardown: {locks:?}"
        );
    }
    for l in &after {
        eprintln!("soak: LEFT AFTER TEARDOWN {l}");
    }

    let st = &sh.stats;
    let errors = sh.errors.lock().unwrap().clone();
    let made = st.made.lock().unwrap().clone();
    println!(
        "soak figures: two_processes={split} pool={} ops={} clients={nclients} kills={} (node plugin {}) reboots={} retries={} \
         unexpected_errors={} writes={} reads={} leaks={} leaks_after_teardown={} \
         mismatches={} volumes={nvols} snapshots={nsnaps} made={made:?} rss_after_run={} KiB \
         rss_idle_after_run={} KiB rss_fresh_start={} KiB main_heap_idle={heap_idle} KiB \
         arenas_idle={arenas_idle:?} KiB main_heap_fresh={heap_fresh} KiB arenas_fresh={arenas_fresh:?} KiB \
         run={run_secs:.0}s total={:.0}s seed={seed}",
        setup.pool_fs,
        st.ops.load(Ordering::Relaxed),
        st.kills.load(Ordering::Relaxed),
        node_kills.load(Ordering::Relaxed),
        st.reboots.load(Ordering::Relaxed),
        st.retries.load(Ordering::Relaxed),
        st.unexpected.load(Ordering::Relaxed),
        st.writes.load(Ordering::Relaxed),
        st.reads.load(Ordering::Relaxed),
        leaked.len(),
        after.len(),
        st.mismatches.load(Ordering::Relaxed),
        rss_run,
        rss_idle,
        rss_fresh,
        started.elapsed().as_secs_f64(),
    );
    for (e, n) in &errors {
        println!("soak: unexpected error x{n}: {e}");
    }
    let log = driver.log_text();
    assert!(!log.contains("panicked"), "the driver panicked");
    assert_eq!(
        st.unexpected.load(Ordering::Relaxed),
        0,
        "unexpected (non-retryable) errors, each distinct one with its count: {errors:#?}"
    );
    assert_eq!(st.mismatches.load(Ordering::Relaxed), 0, "data mismatches");
    for k in setup.kinds {
        assert!(
            made.contains_key(&format!("{k:?}")),
            "no {k:?} volume was made: {made:?}"
        );
    }
    assert!(leaked.is_empty(), "leaks after the run: {leaked:#?}");
    assert!(after.is_empty(), "leaks after teardown: {after:#?}");
    assert_eq!(st.kills.load(Ordering::Relaxed), kills);
    assert_eq!(st.reboots.load(Ordering::Relaxed), reboots);
    assert!(
        rss_idle <= 2 * rss_fresh.max(1),
        "RSS once idle after the run {rss_idle} KiB (right after it {rss_run} KiB) is more \
         than twice the fresh start's {rss_fresh} KiB"
    );
}
