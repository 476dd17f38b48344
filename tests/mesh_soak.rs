//! A soak of volumes moving between two nodes. Volumes (images, and
//! directories one time in four) are written on their node, snapshotted,
//! restored and cloned on the other node (or the same) through the
//! cluster's controller, written again and moved again (then only what
//! changed travels, for an image), deleted, some while their data is still
//! on the way. Meanwhile either node's agent or the controller is killed at a
//! random moment of a call or of a transfer, stays down a while and starts
//! again; every call that failed for it is retried until it succeeds, as a
//! CO would. Each volume that arrived is compared byte for byte with the
//! image it was made from (a directory entry by entry: kind, mode, owner,
//! length, link, times and digest), and at the end, everything deleted,
//! nothing is left on either node: no image, hold, replica, arrival record,
//! release not yet told, packed tree, loop device or mount.
//!
//! Parameters (environment): MESH_SOAK_OPS (40), MESH_SOAK_KILLS (10, at
//! most), MESH_SOAK_SEED (random; printed, and repeats the run's choices).

#[path = "common/cluster.rs"]
mod cluster;
mod common;
#[path = "common/moving.rs"]
mod moving;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cluster::*;
use common::*;
use csi_proto::csi;
use moving::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Every volume's size.
const SIZE: i64 = 64 * MIB;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone, Debug)]
struct Item {
    id: String,
    node: &'static str,
    /// A `kind: dir` volume, or a snapshot of one (else an image's).
    dir: bool,
}

impl Item {
    /// Where its data lies in `pool`: an image or a directory, of a
    /// snapshot or of a volume.
    fn data(&self, pool: &Pool, snapshot: bool) -> PathBuf {
        match (self.dir, snapshot) {
            (true, true) => dir_snapshot(pool, &self.id),
            (false, true) => snapshot_image(pool, &self.id),
            (true, false) => dir_volume(pool, &self.id),
            (false, false) => volume_image(pool, &self.id),
        }
    }
}

/// Codes a CO retries when a process of the driver died under its call.
fn retryable(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(
        code,
        Unavailable | Aborted | DeadlineExceeded | Cancelled | Unknown
    )
}

struct Soak {
    cl: Cluster,
    rng: StdRng,
    kills_left: u64,
    vols: Vec<Item>,
    snaps: Vec<Item>,
    n: u32,
    counts: BTreeMap<&'static str, u64>,
}

impl Soak {
    fn count(&mut self, what: &'static str) {
        *self.counts.entry(what).or_default() += 1;
    }

    fn name(&mut self, kind: &str) -> String {
        self.n += 1;
        format!("{kind}-{}", self.n)
    }

    fn node(&self, name: &str) -> &Node {
        if name == NODE_A {
            &self.cl.a
        } else {
            &self.cl.b
        }
    }

    fn logs(&self) -> String {
        format!(
            "--- node-a\n{}\n--- node-b\n{}\n--- router\n{}",
            tail(&self.cl.a.driver.log_text()),
            tail(&self.cl.b.driver.log_text()),
            tail(&self.cl.router.log_text())
        )
    }

    /// The three processes' logs copied where a failed run leaves them.
    fn keep_logs(&self, seed: u64) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("example-csi-mesh-soak-{seed}"));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, d) in [
            ("node-a", &self.cl.a.driver),
            ("node-b", &self.cl.b.driver),
            ("router", &self.cl.router),
        ] {
            let _ = std::fs::copy(&d.log, dir.join(format!("{name}.log")));
        }
        dir
    }

    /// `call` through the router, again until it succeeds.
    async fn until_ok<T, F, Fut>(&mut self, what: &str, mut call: F) -> T
    where
        F: FnMut(Clients) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let clients = self.cl.router.clients().await;
            match call(clients).await {
                Ok(v) => return v,
                Err(s) if retryable(s.code()) && Instant::now() < deadline => {
                    self.count("retries");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(s) => panic!("{what}: {s:?}\n{}", self.logs()),
            }
        }
    }

    /// CreateVolume through the router, again until it succeeds.
    async fn create_volume(&mut self, req: csi::CreateVolumeRequest) -> csi::Volume {
        self.until_ok("CreateVolume", |mut c| {
            let req = req.clone();
            async move { c.controller.create_volume(req).await }
        })
        .await
        .into_inner()
        .volume
        .unwrap()
    }

    /// Kills one of the three processes (SIGKILL), leaves it down up to a
    /// second, and starts it again; maybe, while kills are left.
    fn maybe_kill(&mut self, chance: f64, victims: &[&'static str]) {
        if self.kills_left == 0 || !self.rng.random_bool(chance) {
            return;
        }
        self.kills_left -= 1;
        self.count("kills");
        let who = victims[self.rng.random_range(0..victims.len())];
        let down = Duration::from_millis(self.rng.random_range(0..1000));
        let driver = match who {
            NODE_A => &mut self.cl.a.driver,
            NODE_B => &mut self.cl.b.driver,
            _ => &mut self.cl.router,
        };
        driver.kill9();
        std::thread::sleep(down);
        driver.spawn();
        eprintln!("mesh soak: killed {who}, down {down:?}");
    }

    /// A new volume on a node of its own (a directory one time in four),
    /// with random data written there.
    async fn create(&mut self) {
        let node = [NODE_A, NODE_B][self.rng.random_range(0..2)];
        let dir = self.rng.random_bool(0.25);
        let name = self.name("vol");
        let mut req = sized_on(&name, node, SIZE);
        if dir {
            req.parameters.insert("kind".into(), "dir".into());
        }
        let v = self.create_volume(req).await;
        assert_eq!(node_of(&v.volume_id), node);
        let item = Item {
            id: v.volume_id,
            node,
            dir,
        };
        self.write(&item).await;
        self.vols.push(item);
        self.count(if dir { "volumes, dir" } else { "volumes" });
    }

    /// Random data written to a volume on its node: through a mount of an
    /// image, or into a directory volume as a pod's bind mount would.
    async fn write(&mut self, v: &Item) {
        let tag = self.name("mount");
        let mib = self.rng.random_range(1..=6);
        let node = self.node(v.node);
        if v.dir {
            let sub = dir_volume(&node.pool, &v.id).join(&tag);
            std::fs::create_dir_all(&sub).unwrap();
            write_random(&sub, "data", mib);
        } else {
            let m = mount(node, &v.id, &tag).await;
            write_random(&m.target, &tag, mib);
            unmount(node, &m).await;
        }
        self.count("writes");
    }

    async fn snapshot(&mut self) {
        let v = self.vols[self.rng.random_range(0..self.vols.len())].clone();
        let name = self.name("snap");
        let req = snapshot_req(&name, &v.id);
        let s = self
            .until_ok("CreateSnapshot", |mut c| {
                let req = req.clone();
                async move { c.controller.create_snapshot(req).await }
            })
            .await
            .into_inner()
            .snapshot
            .unwrap();
        self.snaps.push(Item {
            id: s.snapshot_id,
            node: v.node,
            dir: v.dir,
        });
        self.count("snapshots");
    }

    /// A restore of a snapshot or a clone of a volume on a node (the other
    /// one mostly), a process maybe killed during the call and during the
    /// transfer; the image that arrived equals the source's byte for byte.
    /// With `abandon`, it is deleted at once instead, its data on the way.
    async fn copy(&mut self, abandon: bool) {
        let from_snapshot = !self.snaps.is_empty() && self.rng.random_bool(0.5);
        let (src, source, src_data) = if from_snapshot {
            let s = self.snaps[self.rng.random_range(0..self.snaps.len())].clone();
            let data = s.data(&self.node(s.node).pool, true);
            (s.clone(), snapshot_source(&s.id), data)
        } else {
            let v = self.vols[self.rng.random_range(0..self.vols.len())].clone();
            let data = v.data(&self.node(v.node).pool, false);
            (v.clone(), volume_source(&v.id), data)
        };
        let other = if src.node == NODE_A { NODE_B } else { NODE_A };
        let target = if self.rng.random_bool(0.8) {
            other
        } else {
            src.node
        };
        let name = self.name(if from_snapshot { "restore" } else { "clone" });
        let mut req = create_from(&name, target, SIZE, source);
        if src.dir {
            req.parameters.insert("kind".into(), "dir".into());
        }

        // The call, with a process killed at a random moment of it.
        let first = {
            let mut c = self.cl.router.clients().await;
            let req = req.clone();
            tokio::spawn(async move { c.controller.create_volume(req).await })
        };
        tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..40))).await;
        self.maybe_kill(0.3, &[NODE_A, NODE_B, "router"]);
        let made = match first.await.unwrap() {
            Ok(r) => r.into_inner().volume.unwrap(),
            Err(s) if retryable(s.code()) => {
                self.count("retries");
                self.create_volume(req).await
            }
            Err(s) => panic!("CreateVolume {name}: {s:?}\n{}", self.logs()),
        };
        assert_eq!(node_of(&made.volume_id), target, "{made:?}");
        let item = Item {
            id: made.volume_id.clone(),
            node: target,
            dir: src.dir,
        };
        if abandon {
            self.count("deleted while arriving");
            self.delete_volume(item).await;
            return;
        }
        if target != src.node {
            // A process killed while the data is on the way.
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..200))).await;
            self.maybe_kill(0.3, &[src.node, target, "router"]);
            let t = arrival_over(self.node(target), &item.id).await;
            self.count(match t.incremental {
                true => "moved, incremental",
                false => "moved, whole",
            });
        } else {
            self.count("copied on its node");
        }
        let pool = &self.node(target).pool;
        if src.dir {
            let (want, got) = (tree_of(&src_data), tree_of(&item.data(pool, false)));
            assert!(
                want == got,
                "{} made from {} differs:\n{want}\n---\n{got}\n{}",
                item.id,
                src.id,
                self.logs()
            );
        } else if let Some(at) = first_difference(&src_data, &item.data(pool, false)) {
            panic!(
                "{} made from {} differs at byte {at}\n{}",
                item.id,
                src.id,
                self.logs()
            );
        }
        self.vols.push(item);
    }

    async fn delete_volume(&mut self, v: Item) {
        let req = delete_req(&v.id);
        self.until_ok("DeleteVolume", |mut c| {
            let req = req.clone();
            async move { c.controller.delete_volume(req).await }
        })
        .await;
        self.count("volumes deleted");
    }

    async fn delete_snapshot(&mut self, s: Item) {
        let req = delete_snapshot_req(&s.id);
        self.until_ok("DeleteSnapshot", |mut c| {
            let req = req.clone();
            async move { c.controller.delete_snapshot(req).await }
        })
        .await;
        self.count("snapshots deleted");
    }

    async fn step(&mut self) {
        if self.vols.len() < 2 {
            return self.create().await;
        }
        match self.rng.random_range(0..100) {
            0..10 => self.create().await,
            10..25 => {
                let v = self.vols[self.rng.random_range(0..self.vols.len())].clone();
                self.write(&v).await
            }
            25..40 => self.snapshot().await,
            40..80 => self.copy(false).await,
            80..87 => self.copy(true).await,
            87..95 if self.vols.len() > 3 => {
                let v = self.vols.remove(self.rng.random_range(0..self.vols.len()));
                self.delete_volume(v).await
            }
            _ if !self.snaps.is_empty() => {
                let s = self
                    .snaps
                    .remove(self.rng.random_range(0..self.snaps.len()));
                self.delete_snapshot(s).await
            }
            _ => self.snapshot().await,
        }
    }
}

/// Waits until the data of `volume` has arrived on `node`: its status once
/// done. A node keeps the statuses of the arrivals that ended across its
/// restarts, and an arrival's record until then: one neither listed nor
/// recorded is lost.
async fn arrival_over(node: &Node, volume: &str) -> csi_proto::mesh::TransferStatus {
    let id = csi_glue::handle::parse(volume).id;
    let record = node
        .driver
        .state
        .join("controller")
        .join("transfers")
        .join(format!("{id}.json"));
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let now = transfers(&node.driver).await;
        let mine = now
            .iter()
            .find(|t| t.role == "arriving" && t.volume_id == id);
        match mine {
            Some(t) if t.state == "done" => return t.clone(),
            None if !record.exists() => panic!(
                "the arrival of {volume} is neither listed nor recorded: {now:?}\n{}",
                tail(&node.driver.log_text())
            ),
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "volume {volume} did not arrive in 180 s: {mine:?}\n{}",
            tail(&node.driver.log_text())
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// What transfers and volumes left in a node: images, holds, replicas,
/// packed trees, arrival records.
fn left_on(node: &Node) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in ["volumes", "snapshots", ".holds", ".replicas", ".arriving"] {
        if let Ok(r) = std::fs::read_dir(node.pool.path.join(dir)) {
            out.extend(r.flatten().map(|e| e.path()));
        }
    }
    for dir in ["transfers", "releases"] {
        if let Ok(r) = std::fs::read_dir(node.driver.state.join("controller").join(dir)) {
            out.extend(r.flatten().map(|e| e.path()));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_mesh_soak_volumes_moving_between_nodes_while_processes_die() {
    let ops = env_or("MESH_SOAK_OPS", 40);
    let seed = env_or("MESH_SOAK_SEED", rand::rng().random());
    eprintln!("mesh soak: ops={ops} (MESH_SOAK_SEED={seed} repeats the choices)");
    let mut soak = Soak {
        cl: cluster(&[]),
        rng: StdRng::seed_from_u64(seed),
        kills_left: env_or("MESH_SOAK_KILLS", 10),
        vols: Vec::new(),
        snaps: Vec::new(),
        n: 0,
        counts: BTreeMap::new(),
    };
    let started = Instant::now();
    for _ in 0..ops {
        soak.step().await;
    }

    // Everything deleted, nothing is left on either node once the images
    // the last transfers replaced are removed (on a thread of their own).
    for v in std::mem::take(&mut soak.vols) {
        soak.delete_volume(v).await;
    }
    for s in std::mem::take(&mut soak.snaps) {
        soak.delete_snapshot(s).await;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left: Vec<PathBuf> = [&soak.cl.a, &soak.cl.b]
            .into_iter()
            .flat_map(left_on)
            .collect();
        if left.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let described: Vec<String> = left
                .iter()
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .map(|p| std::fs::read_to_string(p).unwrap_or_default())
                .collect();
            panic!(
                "left after every delete: {left:?}\n{described:#?}\nlogs kept in {}",
                soak.keep_logs(seed).display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for node in [&soak.cl.a, &soak.cl.b] {
        assert_eq!(loops_below(&node.pool.path), Vec::<String>::new());
        let scratch = node.pool.dir.path().join("scratch");
        assert_eq!(mounts_below(&scratch), Vec::<PathBuf>::new());
    }
    eprintln!(
        "mesh soak figures: {ops} steps in {:.0?}, seed {seed}: {:?}",
        started.elapsed(),
        soak.counts
    );
    assert!(soak.counts.get("moved, whole").copied().unwrap_or(0) > 0);
}
