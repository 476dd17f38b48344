//! Snapshots, restores, clones and group snapshots through the real binary, on
//! real pools: xfs (reflink), btrfs (reflink; image and subvolume volumes) and
//! ext4 (no reflink: the sparse-copy path).
//!
//! - data integrity: snapshot a staged volume (freeze path), overwrite part of it,
//!   restore and clone it, mount the copies beside the source, compare checksums;
//!   restore again after the source is deleted, into a larger volume;
//! - group snapshots of three volumes under a writer that fsyncs a sequence counter
//!   in each: the restored counters are a prefix of the writer's sequence;
//! - crash-consistent snapshots (no freeze) of xfs and ext4 volumes under write
//!   load: writers never wait, the restore replays its journal, holds every write
//!   acknowledged before the snapshot and checks clean;
//! - sparseness, measured in pool used bytes;
//! - crash safety at every snapshot failpoint: restart, nothing frozen, retry;
//! - ListSnapshots filters and pagination;
//! - snapshot and restore times on the xfs pool (logged, not asserted).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use csi_proto::csi::{self, volume_content_source};
use csi_storage::ids::{GroupSnapshotId, SnapshotId, VolumeId};
use rand::RngCore;
use sha2::{Digest, Sha256};
use tonic::{Code, Status};

// ---------------------------------------------------------------- helpers

fn snap_source(id: &str) -> csi::VolumeContentSource {
    csi::VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: id.to_string(),
            },
        )),
    }
}

fn vol_source(id: &str) -> csi::VolumeContentSource {
    csi::VolumeContentSource {
        r#type: Some(volume_content_source::Type::Volume(
            volume_content_source::VolumeSource {
                volume_id: id.to_string(),
            },
        )),
    }
}

/// How the volumes of one test are made.
#[derive(Clone)]
struct Kind {
    cap: csi::VolumeCapability,
    params: Vec<(&'static str, &'static str)>,
    /// Whether the volume is an image with a filesystem whose size follows it.
    image: bool,
}

impl Kind {
    fn image(fs: &str) -> Kind {
        Kind {
            cap: mount_cap(fs, writer()),
            params: vec![("kind", "image")],
            image: true,
        }
    }
    fn dir() -> Kind {
        Kind {
            cap: mount_cap("", writer()),
            params: vec![("kind", "dir")],
            image: false,
        }
    }
    fn block() -> Kind {
        Kind {
            cap: block_cap(writer()),
            params: vec![],
            image: true,
        }
    }
}

async fn create_volume(
    c: &mut Clients,
    name: &str,
    size: i64,
    kind: &Kind,
    source: Option<csi::VolumeContentSource>,
) -> Result<csi::Volume, Status> {
    let mut req = create_req(name, size, kind.cap.clone(), &kind.params);
    req.volume_content_source = source;
    Ok(c.controller
        .create_volume(req)
        .await?
        .into_inner()
        .volume
        .expect("CreateVolume answers a volume"))
}

async fn delete_volume(c: &mut Clients, id: &str) {
    c.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: id.to_string(),
            secrets: Default::default(),
        })
        .await
        .unwrap_or_else(|e| panic!("DeleteVolume {id}: {e}"));
}

async fn create_snapshot(c: &mut Clients, name: &str, vol: &str) -> Result<csi::Snapshot, Status> {
    Ok(c.controller
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: vol.to_string(),
            name: name.to_string(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .expect("CreateSnapshot answers a snapshot"))
}

async fn delete_snapshot(c: &mut Clients, id: &str) -> Result<(), Status> {
    c.controller
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: id.to_string(),
            secrets: Default::default(),
        })
        .await?;
    Ok(())
}

async fn list_snapshots(
    c: &mut Clients,
    max_entries: i32,
    token: &str,
    snapshot_id: &str,
    source: &str,
) -> Result<(Vec<csi::Snapshot>, String), Status> {
    let r = c
        .controller
        .list_snapshots(csi::ListSnapshotsRequest {
            max_entries,
            starting_token: token.to_string(),
            source_volume_id: source.to_string(),
            snapshot_id: snapshot_id.to_string(),
            secrets: Default::default(),
        })
        .await?
        .into_inner();
    Ok((
        r.entries.into_iter().filter_map(|e| e.snapshot).collect(),
        r.next_token,
    ))
}

async fn all_snapshot_ids(c: &mut Clients) -> BTreeSet<String> {
    let (snaps, next) = list_snapshots(c, 0, "", "", "").await.unwrap();
    assert!(next.is_empty());
    snaps.into_iter().map(|s| s.snapshot_id).collect()
}

async fn all_volume_ids(c: &mut Clients) -> BTreeSet<String> {
    let r = c
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    r.entries
        .into_iter()
        .filter_map(|e| e.volume)
        .map(|v| v.volume_id)
        .collect()
}

/// A volume staged and published by a test.
struct Mounted {
    id: String,
    staging: PathBuf,
    target: PathBuf,
}

async fn stage_publish(c: &mut Clients, pool: &Pool, id: &str, kind: &Kind) -> Mounted {
    let staging = pool.scratch(&format!("staging-{id}"));
    let target = pool.scratch("pods").join(id);
    c.stage_and_publish(id, &staging, &target, &kind.cap).await;
    Mounted {
        id: id.to_string(),
        staging,
        target,
    }
}

async fn unstage(c: &mut Clients, m: &Mounted) {
    c.unpublish_and_unstage(&m.id, &m.target, &m.staging).await;
}

/// Writes `len` random bytes to a new file and fsyncs it.
fn write_random(path: &Path, len: usize) {
    let mut f = std::fs::File::create(path).unwrap();
    let mut buf = vec![0u8; MIB as usize];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len());
        rand::rng().fill_bytes(&mut buf[..n]);
        f.write_all(&buf[..n]).unwrap();
        left -= n;
    }
    f.sync_all().unwrap();
}

/// Overwrites `len` bytes at `offset` with random data and fsyncs.
fn overwrite_random(path: &Path, offset: u64, len: usize) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    let mut buf = vec![0u8; len];
    rand::rng().fill_bytes(&mut buf);
    f.write_all_at(&buf, offset).unwrap();
    f.sync_all().unwrap();
}

fn sha256(path: &Path) -> String {
    let mut f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut h = Sha256::new();
    let mut buf = vec![0u8; MIB as usize];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    format!("{:x}", h.finalize())
}

/// Total bytes of the filesystem holding `path`.
fn fs_bytes(path: &Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(path).unwrap();
    s.blocks() * s.fragment_size()
}

/// Whether a write + fsync below `dir` finishes within 5 s. A frozen filesystem
/// blocks it; then the test thaws it itself (so that teardown can unmount) and
/// answers false.
fn writable_within_5s(dir: &Path) -> bool {
    let file = dir.join(".probe-write");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = std::fs::write(&file, b"probe")
            .and_then(|()| std::fs::File::open(&file).and_then(|f| f.sync_all()));
        let _ = tx.send(r.is_ok());
    });
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(ok) => ok,
        Err(_) => {
            let _ = std::process::Command::new("fsfreeze")
                .arg("-u")
                .arg(dir)
                .status();
            false
        }
    }
}

fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

// ---------------------------------------------------------------- (1) integrity

const DATA: usize = 24 * MIB as usize;

async fn integrity(pool_fs: &str, kind: Kind, size: i64) {
    let pool = Pool::new(pool_fs);
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;

    let src = create_volume(&mut c, "pvc-src", size, &kind, None)
        .await
        .unwrap();
    let sid = src.volume_id.clone();
    let m_src = stage_publish(&mut c, &pool, &sid, &kind).await;
    let data = m_src.target.join("data.bin");
    write_random(&data, DATA);
    let h_snap = sha256(&data);
    let src_fs_bytes = fs_bytes(&m_src.target);

    // Snapshot while staged: the freeze path for images.
    let t = Instant::now();
    let snap = create_snapshot(&mut c, "snap-1", &sid).await.unwrap();
    eprintln!(
        "[{pool_fs}] snapshot of a staged volume holding {} MiB: {:?}",
        DATA as i64 / MIB,
        t.elapsed()
    );
    assert!(snap.ready_to_use);
    assert_eq!(snap.source_volume_id, sid);
    assert_eq!(snap.size_bytes, src.capacity_bytes);
    assert!(snap.creation_time.is_some());
    assert_eq!(
        snap.snapshot_id,
        SnapshotId::for_name("snap-1").to_string(),
        "the snapshot id derives from the name"
    );
    let again = create_snapshot(&mut c, "snap-1", &sid).await.unwrap();
    assert_eq!(again.snapshot_id, snap.snapshot_id, "name idempotency");
    assert!(
        writable_within_5s(&m_src.target),
        "the source is thawed after the snapshot"
    );

    overwrite_random(&data, 8 * MIB as u64, 4 * MIB as usize);
    let h_now = sha256(&data);
    assert_ne!(h_now, h_snap);

    // Restore next to the still-mounted source.
    let restored = create_volume(
        &mut c,
        "pvc-restored",
        size,
        &kind,
        Some(snap_source(&snap.snapshot_id)),
    )
    .await
    .unwrap();
    assert_eq!(restored.capacity_bytes, src.capacity_bytes);
    let m_res = stage_publish(&mut c, &pool, &restored.volume_id, &kind).await;
    assert_eq!(
        sha256(&m_res.target.join("data.bin")),
        h_snap,
        "the restore holds the snapshot-time data"
    );
    // The restore is its own filesystem, not a second view of the source.
    std::fs::write(m_res.target.join("only-in-restore"), b"x").unwrap();
    assert!(!m_src.target.join("only-in-restore").exists());
    assert_eq!(sha256(&data), h_now, "the source is untouched");

    // Clone of the live (staged) volume: the current data.
    let clone = create_volume(&mut c, "pvc-clone", size, &kind, Some(vol_source(&sid)))
        .await
        .unwrap();
    let m_clone = stage_publish(&mut c, &pool, &clone.volume_id, &kind).await;
    assert_eq!(
        sha256(&m_clone.target.join("data.bin")),
        h_now,
        "the clone holds the current data"
    );
    std::fs::write(m_clone.target.join("only-in-clone"), b"x").unwrap();
    assert!(!m_src.target.join("only-in-clone").exists());
    assert!(!m_res.target.join("only-in-clone").exists());
    assert!(writable_within_5s(&m_src.target));

    // Delete the source; the snapshot stays and restores into a larger volume.
    for m in [&m_clone, &m_res, &m_src] {
        unstage(&mut c, m).await;
    }
    delete_volume(&mut c, &sid).await;
    let (listed, _) = list_snapshots(&mut c, 0, "", &snap.snapshot_id, "")
        .await
        .unwrap();
    assert_eq!(listed.len(), 1, "the snapshot survives its source");
    let bigger = size + 64 * MIB;
    let restored2 = create_volume(
        &mut c,
        "pvc-restored-2",
        bigger,
        &kind,
        Some(snap_source(&snap.snapshot_id)),
    )
    .await
    .unwrap();
    assert_eq!(restored2.capacity_bytes, bigger);
    let m_res2 = stage_publish(&mut c, &pool, &restored2.volume_id, &kind).await;
    assert_eq!(sha256(&m_res2.target.join("data.bin")), h_snap);
    if kind.image {
        let grown = fs_bytes(&m_res2.target);
        assert!(
            grown >= src_fs_bytes + 48 * MIB as u64,
            "the filesystem of the larger restore is grown at stage: {grown} vs {src_fs_bytes}"
        );
        let img = pool
            .path
            .join("volumes")
            .join(format!("{}.img", restored2.volume_id));
        assert_eq!(std::fs::metadata(&img).unwrap().len(), bigger as u64);
    }
    unstage(&mut c, &m_res2).await;

    for v in [&restored.volume_id, &clone.volume_id, &restored2.volume_id] {
        delete_volume(&mut c, v).await;
    }
    delete_snapshot(&mut c, &snap.snapshot_id).await.unwrap();
    assert!(all_snapshot_ids(&mut c).await.is_empty());
    assert!(names(&pool.path.join("snapshots")).is_empty());
    assert!(names(&pool.path.join("volumes")).is_empty());
    assert_eq!(
        loops_below(pool.dir.path()).len(),
        1,
        "only the pool's loop"
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_integrity_xfs_pool_xfs_volume() {
    require_root();
    integrity("xfs", Kind::image("xfs"), 320 * MIB).await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_integrity_btrfs_pool_btrfs_image_volume() {
    require_root();
    integrity("btrfs", Kind::image("btrfs"), 192 * MIB).await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_integrity_btrfs_pool_dir_volume() {
    require_root();
    integrity("btrfs", Kind::dir(), 128 * MIB).await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_integrity_ext4_pool_ext4_volume() {
    require_root();
    integrity("ext4", Kind::image("ext4"), 96 * MIB).await;
}

// ---------------------------------------------------------------- (2) groups

/// Writes iteration i into the counter file of every volume in order, fsyncing
/// each, until stopped. Returns the last iteration started.
fn counter_writer(
    targets: Vec<PathBuf>,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> std::thread::JoinHandle<u64> {
    let files: Vec<std::fs::File> = targets
        .iter()
        .map(|t| {
            let f = OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(t.join("counter"))
                .unwrap();
            f.write_all_at(format!("{:020}\n", 0).as_bytes(), 0)
                .unwrap();
            f.sync_all().unwrap();
            f
        })
        .collect();
    std::thread::spawn(move || {
        let mut i = 0u64;
        while !stop.load(Ordering::SeqCst) {
            i += 1;
            for f in &files {
                f.write_all_at(format!("{i:020}\n").as_bytes(), 0).unwrap();
                f.sync_data().unwrap();
            }
            done.store(i, Ordering::SeqCst);
        }
        i
    })
}

fn read_counter(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join("counter"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_group_snapshot_is_consistent_under_a_writer() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let kind = Kind::image("ext4");
    let mut vols = Vec::new();
    let mut mounted = Vec::new();
    for i in 0..3 {
        let v = create_volume(&mut c, &format!("pvc-g{i}"), 64 * MIB, &kind, None)
            .await
            .unwrap();
        mounted.push(stage_publish(&mut c, &pool, &v.volume_id, &kind).await);
        vols.push(v.volume_id);
    }
    let vol_refs: Vec<&str> = vols.iter().map(String::as_str).collect();

    for round in 0..2 {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let w = counter_writer(
            mounted.iter().map(|m| m.target.clone()).collect(),
            stop.clone(),
            done.clone(),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::SeqCst) < 30 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let before = done.load(Ordering::SeqCst);
        assert!(before >= 30, "the writer makes progress");
        let name = format!("group-{round}");
        let t = Instant::now();
        let g = create_group(&mut c, &name, &vol_refs).await;
        let took = t.elapsed();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.store(true, Ordering::SeqCst);
        let last = w.join().unwrap();
        let g = g.unwrap();
        eprintln!("group snapshot of 3 staged volumes under a writer: {took:?}");
        assert!(
            done.load(Ordering::SeqCst) > before,
            "the writer went on after the group snapshot (everything thawed)"
        );

        assert_eq!(
            g.group_snapshot_id,
            GroupSnapshotId::for_name(&name).to_string()
        );
        assert!(g.ready_to_use && g.creation_time.is_some());
        assert_eq!(g.snapshots.len(), 3);
        let by_source: BTreeMap<String, csi::Snapshot> = g
            .snapshots
            .iter()
            .map(|s| (s.source_volume_id.clone(), s.clone()))
            .collect();
        assert_eq!(
            by_source.keys().cloned().collect::<BTreeSet<_>>(),
            vols.iter().cloned().collect()
        );
        for s in &g.snapshots {
            assert_eq!(s.group_snapshot_id, g.group_snapshot_id);
            assert!(s.ready_to_use);
            let (listed, _) = list_snapshots(&mut c, 0, "", &s.snapshot_id, "")
                .await
                .unwrap();
            assert_eq!(listed.len(), 1);
            assert_eq!(listed[0].group_snapshot_id, g.group_snapshot_id);
        }

        // Get; name idempotency (also in another order); other volumes conflict.
        let got = c
            .group
            .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
                group_snapshot_id: g.group_snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .group_snapshot
            .unwrap();
        let ids = |g: &csi::VolumeGroupSnapshot| {
            g.snapshots
                .iter()
                .map(|s| s.snapshot_id.clone())
                .collect::<BTreeSet<_>>()
        };
        assert_eq!(ids(&got), ids(&g));
        let reversed: Vec<&str> = vol_refs.iter().rev().copied().collect();
        let again = create_group(&mut c, &name, &reversed).await.unwrap();
        assert_eq!(again.group_snapshot_id, g.group_snapshot_id);
        assert_eq!(ids(&again), ids(&g));
        let err = create_group(&mut c, &name, &vol_refs[..2])
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
        let member = g.snapshots[0].snapshot_id.clone();
        let err = delete_snapshot(&mut c, &member).await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

        // Restore every member and read its counter.
        let mut counters = Vec::new();
        let mut restores = Vec::new();
        for (i, v) in vols.iter().enumerate() {
            let s = &by_source[v];
            let r = create_volume(
                &mut c,
                &format!("pvc-r{round}-{i}"),
                64 * MIB,
                &kind,
                Some(snap_source(&s.snapshot_id)),
            )
            .await
            .unwrap();
            let m = stage_publish(&mut c, &pool, &r.volume_id, &kind).await;
            counters.push(read_counter(&m.target));
            restores.push(m);
        }
        eprintln!("round {round}: restored counters {counters:?}, writer reached {last}");
        // The writer writes i to volume 0, 1, 2 in turn. All members are frozen
        // before any is copied and a frozen filesystem blocks the writer, so the
        // restored state is a prefix of the write sequence: c0 >= c1 >= c2 >= c0 - 1.
        let (c0, c1, c2) = (counters[0], counters[1], counters[2]);
        assert!(
            c0 >= c1 && c1 >= c2 && c2 + 1 >= c0,
            "restored counters {counters:?} are not a prefix of the write sequence"
        );
        assert!(c0 >= before && c0 <= last, "{c0} within [{before}, {last}]");
        for m in &restores {
            unstage(&mut c, m).await;
            delete_volume(&mut c, &m.id).await;
        }

        delete_group(&mut c, &g.group_snapshot_id).await.unwrap();
        let left = all_snapshot_ids(&mut c).await;
        assert!(
            left.is_disjoint(&ids(&g)),
            "members are deleted with the group"
        );
        let err = c
            .group
            .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
                group_snapshot_id: g.group_snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        delete_group(&mut c, &g.group_snapshot_id)
            .await
            .expect("deleting a deleted group succeeds");
        assert!(names(&pool.path.join("snapshots")).is_empty());
    }
    for m in &mounted {
        unstage(&mut c, m).await;
        delete_volume(&mut c, &m.id).await;
    }
}

// ---------------------------------------------------------------- (2b) crash-consistent

/// Size of one record of [`record_writer`].
const RECORD: u64 = 4096;

/// Record `i` of [`record_writer`]: its number, then a byte of its own.
fn record(i: u64) -> Vec<u8> {
    let mut r = vec![(i % 251) as u8; RECORD as usize];
    r[..21].copy_from_slice(format!("{i:020}\n").as_bytes());
    r
}

/// What the writers of a volume under load saw: the last record made
/// durable, and when each was.
struct Acked {
    last: AtomicU64,
    times: std::sync::Mutex<Vec<Instant>>,
}

impl Acked {
    /// The longest a writer waited for one record in `[from, to]`.
    fn longest_wait(&self, from: Instant, to: Instant) -> Duration {
        let t = self.times.lock().unwrap();
        let mut marks: Vec<Instant> = t
            .iter()
            .copied()
            .filter(|x| *x >= from && *x <= to)
            .collect();
        marks.insert(0, from);
        marks.push(to);
        marks
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }
}

/// Appends record 1, 2, ... to `dir/records`, each made durable (fdatasync)
/// before it counts as acknowledged; beside it, rewrites 8 MiB of `dir/load`
/// without syncing, so that data and log are in flight at any instant.
fn record_writer(
    dir: &Path,
    stop: Arc<AtomicBool>,
    acked: Arc<Acked>,
) -> Vec<std::thread::JoinHandle<()>> {
    let records = std::fs::File::create(dir.join("records")).unwrap();
    let load = std::fs::File::create(dir.join("load")).unwrap();
    let stop2 = stop.clone();
    let a = std::thread::spawn(move || {
        let mut i = 0u64;
        while !stop.load(Ordering::SeqCst) {
            i += 1;
            records.write_all_at(&record(i), (i - 1) * RECORD).unwrap();
            records.sync_data().unwrap();
            acked.times.lock().unwrap().push(Instant::now());
            acked.last.store(i, Ordering::SeqCst);
        }
    });
    let b = std::thread::spawn(move || {
        let mut buf = vec![0u8; MIB as usize];
        let mut n = 0u64;
        while !stop2.load(Ordering::SeqCst) {
            rand::rng().fill_bytes(&mut buf);
            load.write_all_at(&buf, (n % 8) * MIB as u64).unwrap();
            n += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    vec![a, b]
}

/// A snapshot class's parameters asking `consistency`.
async fn snapshot_with(c: &mut Clients, name: &str, vol: &str, consistency: &str) -> csi::Snapshot {
    c.controller
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: vol.to_string(),
            name: name.to_string(),
            parameters: [("consistency".to_string(), consistency.to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("CreateSnapshot {name}: {e}"))
        .into_inner()
        .snapshot
        .unwrap()
}

/// A crash-consistent snapshot of a volume under write load: its writers
/// never wait for it (the copy is held 1.5 s by a failpoint; a frozen
/// snapshot, taken the same way, stalls them that long), and its restore
/// mounts (the filesystem's journal replayed), holds every record made
/// durable before the snapshot was asked for, and checks clean.
async fn crash_consistent_under_load(fs: &str) {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start_with_env(
        &pool,
        &[],
        &[("EXAMPLE_CSI_FAILPOINTS", "snapshot.after-copy=sleep(1500)")],
    );
    let mut c = driver.clients().await;
    let kind = Kind::image(fs);
    let v = create_volume(&mut c, "pvc-live", 256 * MIB, &kind, None)
        .await
        .unwrap();
    let m = stage_publish(&mut c, &pool, &v.volume_id, &kind).await;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Acked {
        last: AtomicU64::new(0),
        times: Default::default(),
    });
    let writers = record_writer(&m.target, stop.clone(), acked.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    while acked.last.load(Ordering::SeqCst) < 50 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let mut taken = Vec::new();
    for consistency in ["crash-consistent", "frozen"] {
        let before = acked.last.load(Ordering::SeqCst);
        assert!(before >= 50, "the writer makes progress");
        let t0 = Instant::now();
        let snap = snapshot_with(
            &mut c,
            &format!("snap-{consistency}"),
            &v.volume_id,
            consistency,
        )
        .await;
        let t1 = Instant::now();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let wait = acked.longest_wait(t0, t1);
        eprintln!("[{fs}] {consistency} snapshot under load: {:?}; longest wait of a writer meanwhile {wait:?}", t1 - t0);
        taken.push((consistency, snap, before, wait));
    }
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    let (_, crash, before, crash_wait) = &taken[0];
    let (_, _, _, frozen_wait) = &taken[1];
    assert!(
        *crash_wait < Duration::from_millis(1000),
        "a writer waited {crash_wait:?} during a crash-consistent snapshot"
    );
    assert!(
        *frozen_wait >= Duration::from_millis(1400),
        "a frozen snapshot held 1.5 s stalls the writers: the longest wait was {frozen_wait:?}"
    );

    // Its restore mounts beside the source, journal replayed, and holds every
    // record acknowledged before the snapshot was asked for.
    let r = create_volume(
        &mut c,
        "pvc-restored",
        256 * MIB,
        &kind,
        Some(snap_source(&crash.snapshot_id)),
    )
    .await
    .unwrap();
    let mr = stage_publish(&mut c, &pool, &r.volume_id, &kind).await;
    let got = std::fs::read(mr.target.join("records")).unwrap();
    for i in 1..=*before {
        let at = ((i - 1) * RECORD) as usize;
        assert!(
            got.get(at..at + RECORD as usize) == Some(&record(i)[..]),
            "record {i} of the {before} acknowledged before the snapshot is not in it"
        );
    }
    unstage(&mut c, &mr).await;
    let image = pool
        .path
        .join("volumes")
        .join(format!("{}.img", VolumeId::parse(&r.volume_id).unwrap()));
    let check = match fs {
        "xfs" => std::process::Command::new("xfs_repair")
            .args(["-n", "-f"])
            .arg(&image)
            .output()
            .unwrap(),
        _ => std::process::Command::new("e2fsck")
            .args(["-f", "-n"])
            .arg(&image)
            .output()
            .unwrap(),
    };
    assert!(
        check.status.success(),
        "the restored {fs} does not check clean: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    delete_volume(&mut c, &r.volume_id).await;
    for (_, s, _, _) in &taken {
        delete_snapshot(&mut c, &s.snapshot_id).await.unwrap();
    }
    unstage(&mut c, &m).await;
    delete_volume(&mut c, &v.volume_id).await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_crash_consistent_snapshot_of_xfs_under_load_replays_and_keeps_every_acknowledged_write(
) {
    crash_consistent_under_load("xfs").await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_crash_consistent_snapshot_of_ext4_under_load_replays_and_keeps_every_acknowledged_write(
) {
    crash_consistent_under_load("ext4").await;
}

// ---------------------------------------------------------------- (3) sparseness

async fn sparseness(pool_fs: &str) -> (u64, u64) {
    let pool = Pool::new(pool_fs);
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let kind = Kind::image("ext4");
    let v = create_volume(&mut c, "pvc-sparse", GIB, &kind, None)
        .await
        .unwrap();
    let m = stage_publish(&mut c, &pool, &v.volume_id, &kind).await;
    write_random(&m.target.join("data.bin"), 10 * MIB as usize);
    nix::unistd::sync();
    let img = pool
        .path
        .join("volumes")
        .join(format!("{}.img", v.volume_id));
    let source_alloc = allocated(&img);
    let before = pool.used_bytes();
    let s = create_snapshot(&mut c, "snap-sparse", &v.volume_id)
        .await
        .unwrap();
    nix::unistd::sync();
    let after = pool.used_bytes();
    let delta = after.saturating_sub(before);
    let snap_img = pool
        .path
        .join("snapshots")
        .join(format!("{}.img", s.snapshot_id));
    eprintln!(
        "[{pool_fs}] 1 GiB volume, 10 MiB written, image allocates {} KiB; the snapshot \
         added {} KiB to the pool (its file allocates {} KiB)",
        source_alloc / 1024,
        delta / 1024,
        allocated(&snap_img) / 1024
    );
    assert_eq!(std::fs::metadata(&snap_img).unwrap().len(), GIB as u64);
    unstage(&mut c, &m).await;
    delete_snapshot(&mut c, &s.snapshot_id).await.unwrap();
    delete_volume(&mut c, &v.volume_id).await;
    (delta, source_alloc)
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_sparse_snapshot_on_reflink_pool_adds_nothing() {
    require_root();
    let (delta, _) = sparseness("xfs").await;
    assert!(
        delta < 4 * MIB as u64,
        "a reflink snapshot adds about nothing: {delta} bytes"
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_sparse_snapshot_on_ext4_pool_copies_only_data() {
    require_root();
    let (delta, source_alloc) = sparseness("ext4").await;
    assert!(
        delta >= 10 * MIB as u64,
        "the copy holds the 10 MiB written: {delta} bytes"
    );
    assert!(
        delta < 100 * MIB as u64,
        "a sparse copy of a 1 GiB volume holding 10 MiB is far under 100 MiB: {delta} bytes"
    );
    assert!(
        delta <= source_alloc + 4 * MIB as u64,
        "the copy allocates no more than its source ({source_alloc}): {delta} bytes"
    );
}

// ---------------------------------------------------------------- (4) crash safety

/// An operation that a failpoint interrupts.
#[derive(Clone, Debug)]
enum Op {
    Snapshot(&'static str),
    DeleteSnapshot(&'static str),
    Group(&'static str),
    DeleteGroup(&'static str),
    Restore(&'static str, &'static str),
    Clone(&'static str),
}

struct CrashRig {
    pool: Pool,
    driver: Driver,
    kind: Kind,
    /// Two staged and published volumes: sources of every operation.
    src: Vec<Mounted>,
    snapshots: BTreeSet<String>,
    groups: BTreeSet<String>,
    volumes: BTreeSet<String>,
}

impl CrashRig {
    async fn clients(&self) -> Clients {
        self.driver.clients().await
    }

    /// Runs an operation; Ok(id of what it made or deleted).
    async fn run(&mut self, op: &Op) -> Result<String, Status> {
        let mut c = self.clients().await;
        let a = self.src[0].id.clone();
        let b = self.src[1].id.clone();
        match op {
            Op::Snapshot(n) => create_snapshot(&mut c, n, &a).await.map(|s| s.snapshot_id),
            Op::DeleteSnapshot(n) => {
                let id = SnapshotId::for_name(n).to_string();
                delete_snapshot(&mut c, &id).await.map(|()| id)
            }
            Op::Group(n) => create_group(&mut c, n, &[&a, &b])
                .await
                .map(|g| g.group_snapshot_id),
            Op::DeleteGroup(n) => {
                let id = GroupSnapshotId::for_name(n).to_string();
                delete_group(&mut c, &id).await.map(|()| id)
            }
            Op::Restore(n, snap) => {
                let sid = SnapshotId::for_name(snap).to_string();
                create_volume(&mut c, n, 64 * MIB, &self.kind, Some(snap_source(&sid)))
                    .await
                    .map(|v| v.volume_id)
            }
            Op::Clone(n) => create_volume(&mut c, n, 64 * MIB, &self.kind, Some(vol_source(&a)))
                .await
                .map(|v| v.volume_id),
        }
    }

    /// The expected state after `op` succeeded.
    fn apply(&mut self, op: &Op) {
        match op {
            Op::Snapshot(n) => {
                self.snapshots.insert(SnapshotId::for_name(n).to_string());
            }
            Op::DeleteSnapshot(n) => {
                self.snapshots.remove(&SnapshotId::for_name(n).to_string());
            }
            Op::Group(n) => {
                self.groups.insert(n.to_string());
            }
            Op::DeleteGroup(n) => {
                self.groups.remove(*n);
            }
            Op::Restore(n, _) | Op::Clone(n) => {
                self.volumes.insert(VolumeId::for_name(n).to_string());
            }
        }
    }

    fn expected_id(op: &Op) -> String {
        match op {
            Op::Snapshot(n) | Op::DeleteSnapshot(n) => SnapshotId::for_name(n).to_string(),
            Op::Group(n) | Op::DeleteGroup(n) => GroupSnapshotId::for_name(n).to_string(),
            Op::Restore(n, _) | Op::Clone(n) => VolumeId::for_name(n).to_string(),
        }
    }

    /// Checks the listings, the pool and the state dir against the expected state.
    async fn check(&mut self, when: &str) {
        let mut c = self.clients().await;
        for m in &self.src {
            assert!(
                writable_within_5s(&m.target),
                "{when}: {} is left frozen\n{}",
                m.id,
                self.driver.log_text()
            );
        }
        let mut want_snaps = self.snapshots.clone();
        for g in &self.groups {
            let got = c
                .group
                .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
                    group_snapshot_id: GroupSnapshotId::for_name(g).to_string(),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("{when}: group {g}: {e}"))
                .into_inner()
                .group_snapshot
                .unwrap();
            assert_eq!(got.snapshots.len(), 2);
            want_snaps.extend(got.snapshots.into_iter().map(|s| s.snapshot_id));
        }
        assert_eq!(
            all_snapshot_ids(&mut c).await,
            want_snaps,
            "{when}: ListSnapshots"
        );
        let files: BTreeSet<String> = want_snaps.iter().map(|s| format!("{s}.img")).collect();
        assert_eq!(
            names(&self.pool.path.join("snapshots")),
            files,
            "{when}: files in <pool>/snapshots"
        );
        let mut want_vols = self.volumes.clone();
        want_vols.extend(self.src.iter().map(|m| m.id.clone()));
        assert_eq!(
            all_volume_ids(&mut c).await,
            want_vols,
            "{when}: ListVolumes"
        );
        let vfiles: BTreeSet<String> = want_vols.iter().map(|v| format!("{v}.img")).collect();
        assert_eq!(
            names(&self.pool.path.join("volumes")),
            vfiles,
            "{when}: files in <pool>/volumes"
        );
        assert!(
            names(&self.driver.state.join("shared/frozen")).is_empty(),
            "{when}: freeze markers are left: {:?}",
            names(&self.driver.state.join("shared/frozen"))
        );
    }

    /// Runs `op` with `failpoint` armed: the driver dies; restart; nothing is left
    /// frozen or half-made; the retry succeeds with the id the name gives.
    async fn crash(&mut self, failpoint: &str, op: Op) {
        let when = format!("{failpoint} during {op:?}");
        self.driver.envs = vec![(
            csi_storage::failpoint::ENV.to_string(),
            failpoint.to_string(),
        )];
        self.driver.restart();
        let r = self.run(&op).await;
        assert!(
            r.is_err(),
            "{when}: the call fails when the driver dies: {r:?}"
        );
        assert!(
            self.driver.wait_exit(20).is_some(),
            "{when}: the driver died at the failpoint"
        );
        assert!(
            self.driver
                .log_text()
                .contains(&format!("failpoint {failpoint} reached")),
            "{when}: the failpoint was reached"
        );
        self.driver.envs.clear();
        self.driver.spawn();
        // A crash after the commit keeps what the call made; start-up finishes a
        // delete whose intent is recorded; every other creation is rolled back.
        let deletes = matches!(op, Op::DeleteSnapshot(_) | Op::DeleteGroup(_));
        if failpoint.ends_with("after-commit") || deletes {
            self.apply(&op);
        }
        self.check(&format!("{when}, after restart")).await;
        let id = self
            .run(&op)
            .await
            .unwrap_or_else(|e| panic!("{when}: the retry succeeds: {e}"));
        assert_eq!(
            id,
            Self::expected_id(&op),
            "{when}: the id derives from the name"
        );
        let id2 = self.run(&op).await.unwrap();
        assert_eq!(id2, id, "{when}: a second retry is the same");
        self.apply(&op);
        self.check(&format!("{when}, after retry")).await;
    }
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_crash_at_every_snapshot_failpoint_recovers() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let kind = Kind::image("ext4");
    let mut src = Vec::new();
    for n in ["pvc-crash-a", "pvc-crash-b"] {
        let v = create_volume(&mut c, n, 64 * MIB, &kind, None)
            .await
            .unwrap();
        let m = stage_publish(&mut c, &pool, &v.volume_id, &kind).await;
        write_random(&m.target.join("data.bin"), 4 * MIB as usize);
        src.push(m);
    }
    drop(c);
    let mut rig = CrashRig {
        pool,
        driver,
        kind,
        src,
        snapshots: BTreeSet::new(),
        groups: BTreeSet::new(),
        volumes: BTreeSet::new(),
    };
    rig.check("at start").await;

    for fp in [
        "create-snapshot.before-data",
        "create-snapshot.after-data",
        "create-snapshot.after-commit",
    ] {
        let name: &'static str = Box::leak(format!("snap-{fp}").into_boxed_str());
        rig.crash(fp, Op::Snapshot(name)).await;
    }
    rig.crash("freeze.after-freeze", Op::Snapshot("snap-freeze"))
        .await;
    rig.crash(
        "delete-snapshot.after-commit",
        Op::DeleteSnapshot("snap-freeze"),
    )
    .await;
    for fp in [
        "create-group-snapshot.after-intent",
        "create-group-snapshot.after-member",
        "create-group-snapshot.after-members",
    ] {
        let name: &'static str = Box::leak(format!("group-{fp}").into_boxed_str());
        rig.crash(fp, Op::Group(name)).await;
    }
    rig.crash("freeze.after-freeze", Op::Group("group-freeze"))
        .await;
    rig.crash(
        "delete-group-snapshot.after-intent",
        Op::DeleteGroup("group-freeze"),
    )
    .await;
    rig.crash(
        "create-volume.after-copy",
        Op::Restore("pvc-restore-crash", "snap-create-snapshot.after-data"),
    )
    .await;
    rig.crash("create-volume.after-copy", Op::Clone("pvc-clone-crash"))
        .await;
    rig.crash("freeze.after-freeze", Op::Clone("pvc-clone-freeze"))
        .await;

    // The restores hold the data; then everything is deleted.
    let mut c = rig.clients().await;
    let want = sha256(&rig.src[0].target.join("data.bin"));
    for v in rig.volumes.clone() {
        let m = stage_publish(&mut c, &rig.pool, &v, &rig.kind).await;
        assert_eq!(sha256(&m.target.join("data.bin")), want, "volume {v}");
        unstage(&mut c, &m).await;
        delete_volume(&mut c, &v).await;
    }
    rig.volumes.clear();
    for g in rig.groups.clone() {
        delete_group(&mut c, &GroupSnapshotId::for_name(&g).to_string())
            .await
            .unwrap();
    }
    rig.groups.clear();
    for s in rig.snapshots.clone() {
        delete_snapshot(&mut c, &s).await.unwrap();
    }
    rig.snapshots.clear();
    rig.check("after deleting everything").await;
    let src = std::mem::take(&mut rig.src);
    for m in &src {
        unstage(&mut c, m).await;
        delete_volume(&mut c, &m.id).await;
    }
}

// ---------------------------------------------------------------- (5) listing

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_list_snapshots_filters_and_pages() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let kind = Kind::block();
    let a = create_volume(&mut c, "pvc-list-a", 8 * MIB, &kind, None)
        .await
        .unwrap()
        .volume_id;
    let b = create_volume(&mut c, "pvc-list-b", 8 * MIB, &kind, None)
        .await
        .unwrap()
        .volume_id;
    let mut of_a = BTreeSet::new();
    let mut of_b = BTreeSet::new();
    for i in 0..4 {
        of_a.insert(
            create_snapshot(&mut c, &format!("snap-a{i}"), &a)
                .await
                .unwrap()
                .snapshot_id,
        );
    }
    for i in 0..3 {
        of_b.insert(
            create_snapshot(&mut c, &format!("snap-b{i}"), &b)
                .await
                .unwrap()
                .snapshot_id,
        );
    }
    let all: BTreeSet<String> = of_a.union(&of_b).cloned().collect();
    assert_eq!(all_snapshot_ids(&mut c).await, all);

    // Filters.
    let one = of_a.iter().next().unwrap().clone();
    let (l, next) = list_snapshots(&mut c, 0, "", &one, "").await.unwrap();
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].snapshot_id, one);
    assert!(next.is_empty());
    let (l, _) = list_snapshots(&mut c, 0, "", &one, &b).await.unwrap();
    assert!(l.is_empty(), "snapshot_id and another source: nothing");
    let (l, _) = list_snapshots(&mut c, 0, "", "", &a).await.unwrap();
    assert_eq!(
        l.into_iter()
            .map(|s| s.snapshot_id)
            .collect::<BTreeSet<_>>(),
        of_a
    );
    let (l, _) = list_snapshots(&mut c, 0, "", "", &b).await.unwrap();
    assert_eq!(
        l.into_iter()
            .map(|s| s.snapshot_id)
            .collect::<BTreeSet<_>>(),
        of_b
    );
    for unknown in [
        SnapshotId::for_name("never-made").to_string(),
        "not-an-id".to_string(),
    ] {
        let (l, next) = list_snapshots(&mut c, 0, "", &unknown, "").await.unwrap();
        assert!(l.is_empty() && next.is_empty(), "unknown id {unknown}");
    }
    let (l, _) = list_snapshots(&mut c, 0, "", "", "no-such-volume")
        .await
        .unwrap();
    assert!(l.is_empty());
    let err = list_snapshots(&mut c, 2, "foreign-token", "", "")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    let err = list_snapshots(&mut c, -1, "", "", "").await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    // Pagination: every page size covers everything once, in one stable order.
    let mut orders = Vec::new();
    for max in [1, 2, 3, 7, 100] {
        let mut seen = Vec::new();
        let mut token = String::new();
        let mut pages = 0;
        loop {
            let (l, next) = list_snapshots(&mut c, max, &token, "", "").await.unwrap();
            assert!(l.len() <= max as usize);
            seen.extend(l.into_iter().map(|s| s.snapshot_id));
            pages += 1;
            assert!(pages <= 10, "pagination ends");
            if next.is_empty() {
                break;
            }
            token = next;
        }
        assert_eq!(
            seen.len(),
            all.len(),
            "max_entries={max}: each once: {seen:?}"
        );
        assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), all);
        orders.push(seen);
    }
    assert!(orders.windows(2).all(|w| w[0] == w[1]), "stable order");
    // Paging by source too.
    let (l, next) = list_snapshots(&mut c, 3, "", "", &a).await.unwrap();
    assert_eq!(l.len(), 3);
    let (l2, next2) = list_snapshots(&mut c, 3, &next, "", &a).await.unwrap();
    assert_eq!(l2.len(), 1);
    assert!(next2.is_empty());
    let mut got: BTreeSet<String> = l.into_iter().map(|s| s.snapshot_id).collect();
    got.extend(l2.into_iter().map(|s| s.snapshot_id));
    assert_eq!(got, of_a);

    // Snapshots survive their source; GetSnapshot still answers.
    delete_volume(&mut c, &a).await;
    assert_eq!(all_snapshot_ids(&mut c).await, all);
    let (l, _) = list_snapshots(&mut c, 0, "", "", &a).await.unwrap();
    assert_eq!(
        l.len(),
        of_a.len(),
        "filter by a deleted source still finds them"
    );
    let got = c
        .controller
        .get_snapshot(csi::GetSnapshotRequest {
            snapshot_id: one.clone(),
            secrets: Default::default(),
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(got.source_volume_id, a);
    // Name idempotency: same name, other source.
    let err = create_snapshot(&mut c, "snap-b0", &b).await.unwrap();
    assert!(of_b.contains(&err.snapshot_id));
    let err = create_snapshot(&mut c, "snap-a0", &b).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    // A restore of a snapshot of the deleted volume.
    let r = create_volume(
        &mut c,
        "pvc-list-r",
        8 * MIB,
        &kind,
        Some(snap_source(&one)),
    )
    .await
    .unwrap();
    delete_volume(&mut c, &r.volume_id).await;
    for s in &all {
        delete_snapshot(&mut c, s).await.unwrap();
    }
    delete_volume(&mut c, &b).await;
    assert!(all_snapshot_ids(&mut c).await.is_empty());
    assert!(names(&pool.path.join("snapshots")).is_empty());
}

// ---------------------------------------------------------------- timing

fn write_pattern(path: &Path, mib: usize) {
    let mut f = std::fs::File::create(path).unwrap();
    let mut buf = vec![0u8; MIB as usize];
    rand::rng().fill_bytes(&mut buf);
    for i in 0..mib {
        buf[..8].copy_from_slice(&(i as u64).to_le_bytes());
        f.write_all(&buf).unwrap();
    }
    f.sync_all().unwrap();
}

/// The middle of three timings.
fn median(mut t: Vec<Duration>) -> Duration {
    t.sort();
    t[t.len() / 2]
}

/// On a pool that can reflink, a snapshot and a restore take constant time: with
/// 1 GiB of data in the staged volume they take at most 3x (plus 250 ms, so that
/// noise on a few milliseconds cannot fail it) what they take with 64 MiB. A data
/// copy would take 16x: on an ext4 pool here (a sparse copy) the snapshot takes
/// about 0.3 s with 64 MiB and 4 s with 1 GiB, and this check fails.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_snapshot_and_restore_time_do_not_grow_with_data_on_xfs_pool() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let kind = Kind::image("ext4");
    let v = create_volume(&mut c, "pvc-timing", 2 * GIB, &kind, None)
        .await
        .unwrap();
    let m = stage_publish(&mut c, &pool, &v.volume_id, &kind).await;
    let mut written = 0;
    let mut medians = Vec::new();
    for mib in [64usize, 1024] {
        write_pattern(&m.target.join(format!("data-{mib}")), mib - written);
        written = mib;
        nix::unistd::sync();
        let (mut snaps, mut snap_t, mut restores, mut restore_t) = (vec![], vec![], vec![], vec![]);
        for i in 0..3 {
            let t = Instant::now();
            let s = create_snapshot(&mut c, &format!("snap-t{mib}-{i}"), &v.volume_id)
                .await
                .unwrap();
            snap_t.push(t.elapsed());
            let t = Instant::now();
            let r = create_volume(
                &mut c,
                &format!("pvc-t{mib}-{i}"),
                2 * GIB,
                &kind,
                Some(snap_source(&s.snapshot_id)),
            )
            .await
            .unwrap();
            restore_t.push(t.elapsed());
            snaps.push(s.snapshot_id);
            restores.push(r.volume_id);
        }
        let (snap, restore) = (median(snap_t), median(restore_t));
        for r in &restores {
            delete_volume(&mut c, r).await;
        }
        for s in &snaps {
            delete_snapshot(&mut c, s).await.unwrap();
        }
        eprintln!("{mib} MiB of data: CreateSnapshot {snap:?}, restore {restore:?} (medians)");
        medians.push((snap, restore));
    }
    let ((snap_small, restore_small), (snap_big, restore_big)) = (medians[0], medians[1]);
    let bound = |small: Duration| small * 3 + Duration::from_millis(250);
    assert!(
        snap_big <= bound(snap_small),
        "CreateSnapshot grew with the data: {snap_small:?} with 64 MiB, {snap_big:?} with 1 GiB"
    );
    assert!(
        restore_big <= bound(restore_small),
        "restore grew with the data: {restore_small:?} with 64 MiB, {restore_big:?} with 1 GiB"
    );
    unstage(&mut c, &m).await;
    delete_volume(&mut c, &v.volume_id).await;
}

// ---------------------------------------------------------------- freeze window

/// A snapshot waits for a heavy-operation slot before it freezes its source, not
/// while frozen: with the one slot held by another snapshot's copy (a failpoint
/// holds it 3 s), the writers of a staged volume being snapshotted stall only for
/// its own copy.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_freeze_does_not_wait_for_a_heavy_slot() {
    require_root();
    let pool = Pool::new("ext4");
    let driver = Driver::start_with_env(
        &pool,
        &["--heavy-operations=1"],
        &[(
            "EXAMPLE_CSI_FAILPOINTS",
            "snapshot.after-copy=1*sleep(3000)",
        )],
    );
    let mut c = driver.clients().await;
    // An unstaged volume whose snapshot holds the slot.
    let big = create_volume(&mut c, "pvc-big", 64 * MIB, &Kind::block(), None)
        .await
        .unwrap();
    let kind = Kind::image("ext4");
    let small = create_volume(&mut c, "pvc-small", 64 * MIB, &kind, None)
        .await
        .unwrap();
    let m = stage_publish(&mut c, &pool, &small.volume_id, &kind).await;

    // A writer on the staged volume that records its longest write + fsync.
    let stop = Arc::new(AtomicBool::new(false));
    let longest = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let w = {
        let (stop, longest, measuring) = (stop.clone(), longest.clone(), measuring.clone());
        let f = std::fs::File::create(m.target.join("w")).unwrap();
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let counted = measuring.load(Ordering::SeqCst);
                let t = Instant::now();
                f.write_all_at(&i.to_le_bytes(), 0).unwrap();
                f.sync_data().unwrap();
                if counted {
                    longest.fetch_max(t.elapsed().as_millis() as u64, Ordering::SeqCst);
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };

    let mut c2 = driver.clients().await;
    let big_id = big.volume_id.clone();
    let t_big = Instant::now();
    let long = tokio::spawn(async move {
        let r = create_snapshot(&mut c2, "snap-big", &big_id).await;
        (r, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    measuring.store(true, Ordering::SeqCst);
    let t = Instant::now();
    let s = create_snapshot(&mut c, "snap-small", &small.volume_id)
        .await
        .unwrap();
    let small_took = t.elapsed();
    measuring.store(false, Ordering::SeqCst);
    let (r, big_done) = long.await.unwrap();
    let big_snap = r.unwrap();
    let big_took = big_done - t_big;
    stop.store(true, Ordering::SeqCst);
    w.join().unwrap();
    let stall = Duration::from_millis(longest.load(Ordering::SeqCst));
    eprintln!(
        "ext4 pool, one heavy slot: the held copy took {big_took:?}; snapshot of the staged \
         volume meanwhile took {small_took:?}; its writer stalled at most {stall:?}"
    );
    assert!(
        small_took >= Duration::from_secs(2),
        "the small snapshot waited for the slot (else this test proves nothing)"
    );
    assert!(
        // Frozen while it waited, a write would last the whole wait.
        stall < small_took / 2,
        "the writer of the staged volume stalled {stall:?}: it was frozen while its \
         snapshot waited for the slot"
    );
    unstage(&mut c, &m).await;
    for id in [&s.snapshot_id, &big_snap.snapshot_id] {
        delete_snapshot(&mut c, id).await.unwrap();
    }
    delete_volume(&mut c, &small.volume_id).await;
    delete_volume(&mut c, &big.volume_id).await;
}

/// While a snapshot holds a staged filesystem frozen, the node does not unpublish
/// or unstage it (ABORTED: retry), so the thaw always finds its mount. A failpoint
/// holds the copy under the freeze for 4 s, so the calls land in that window on
/// every run.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_unstage_waits_for_the_thaw() {
    require_root();
    let pool = Pool::new("ext4");
    let driver = Driver::start_with_env(
        &pool,
        &[],
        &[(
            "EXAMPLE_CSI_FAILPOINTS",
            "snapshot.after-copy=1*sleep(4000)",
        )],
    );
    let mut c = driver.clients().await;
    let kind = Kind::image("ext4");
    let v = create_volume(&mut c, "pvc-busy", 64 * MIB, &kind, None)
        .await
        .unwrap();
    let m = stage_publish(&mut c, &pool, &v.volume_id, &kind).await;
    write_random(&m.target.join("data"), 4 * MIB as usize);
    let data = sha256(&m.target.join("data"));
    let mut c2 = driver.clients().await;
    let id = v.volume_id.clone();
    let snap = tokio::spawn(async move { create_snapshot(&mut c2, "snap-busy", &id).await });
    assert!(
        wait_for_log(&driver, "failpoint snapshot.after-copy reached", 30).await,
        "the snapshot's copy never reached its failpoint:\n{}",
        driver.log_text()
    );
    assert_eq!(
        write_takes(&m.target, Duration::from_millis(300)),
        None,
        "the volume is not frozen while its copy is held"
    );
    let unpublish = c
        .node
        .node_unpublish_volume(unpublish_req(&m.id, &m.target))
        .await;
    let unstage_r = c
        .node
        .node_unstage_volume(unstage_req(&m.id, &m.staging))
        .await;
    assert!(
        !snap.is_finished(),
        "the snapshot ended before the calls: they did not race the freeze"
    );
    assert_eq!(
        unpublish.as_ref().map_err(|e| e.code()).unwrap_err(),
        Code::Aborted,
        "unpublish during the freeze: {unpublish:?}"
    );
    assert_eq!(
        unstage_r.as_ref().map_err(|e| e.code()).unwrap_err(),
        Code::Aborted,
        "unstage during the freeze: {unstage_r:?}"
    );
    let s = snap.await.unwrap().unwrap();
    // Thawed, still mounted where it was, and the retries go through.
    assert!(writable_within_5s(&m.target), "the volume stayed frozen");
    assert_eq!(sha256(&m.target.join("data")), data);
    unstage(&mut c, &m).await;
    assert_eq!(loops_below(pool.dir.path()).len(), 1);
    assert!(mounts_below(&m.staging).is_empty());
    delete_snapshot(&mut c, &s.snapshot_id).await.unwrap();
    delete_volume(&mut c, &v.volume_id).await;
}

// ---------------------------------------------------------------- freeze deadlines

/// A write and fsync of a small file below `dir`, on its own thread: Some(time it
/// took) when it finishes within `limit`, None otherwise (a frozen filesystem).
fn write_takes(dir: &Path, limit: Duration) -> Option<Duration> {
    let file = dir.join(".probe-deadline");
    let (tx, rx) = std::sync::mpsc::channel();
    let t = Instant::now();
    std::thread::spawn(move || {
        let ok = std::fs::write(&file, b"probe")
            .and_then(|()| std::fs::File::open(&file).and_then(|f| f.sync_all()))
            .is_ok();
        let _ = tx.send(ok);
    });
    match rx.recv_timeout(limit) {
        Ok(true) => Some(t.elapsed()),
        _ => None,
    }
}

/// What a snapshot left in the pool and the state dir: its image, its record, any
/// freeze marker.
fn snapshot_leftovers(pool: &Pool, driver: &Driver, sid: &str) -> Vec<String> {
    let mut out = Vec::new();
    let img = pool.path.join("snapshots").join(format!("{sid}.img"));
    if img.exists() {
        out.push(format!("image {}", img.display()));
    }
    let records = driver.state.join("controller/snapshots");
    let raw = csi_storage::core::store::read_raw(&records).unwrap_or_default();
    if raw.contains_key(sid) {
        out.push(format!("record {sid} in {}", records.display()));
    }
    for m in names(&driver.state.join("shared/frozen")) {
        out.push(format!("freeze marker {m}"));
    }
    out
}

/// Waits up to `secs` for `needle` in the driver's log.
async fn wait_for_log(driver: &Driver, needle: &str, secs: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if driver.log_text().contains(needle) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A staged, published volume holding checksummed data, on a driver whose
/// snapshot copies pause 8 s under their freeze the first time.
struct HeldCopy {
    // Dropped in this order: the driver before its pool.
    driver: Driver,
    pool: Pool,
    kind: Kind,
    volume: csi::Volume,
    mounted: Mounted,
    data: String,
}

impl HeldCopy {
    async fn new(name: &str, freeze_timeout_secs: u64) -> HeldCopy {
        let pool = Pool::new("xfs");
        let driver = Driver::start_with_env(
            &pool,
            &[&format!("--freeze-timeout={freeze_timeout_secs}")],
            &[(
                "EXAMPLE_CSI_FAILPOINTS",
                "snapshot.after-copy=1*sleep(8000)",
            )],
        );
        let mut c = driver.clients().await;
        let kind = Kind::image("ext4");
        let volume = create_volume(&mut c, name, 64 * MIB, &kind, None)
            .await
            .unwrap();
        let mounted = stage_publish(&mut c, &pool, &volume.volume_id, &kind).await;
        write_random(&mounted.target.join("data"), 4 * MIB as usize);
        let data = sha256(&mounted.target.join("data"));
        HeldCopy {
            driver,
            pool,
            kind,
            volume,
            mounted,
            data,
        }
    }

    /// Retries the snapshot (the failpoint has paused once), restores it and
    /// compares the data, then removes everything.
    async fn retry_and_restore(&self, snap: &str) {
        let mut c = self.driver.clients().await;
        let s = create_snapshot(&mut c, snap, &self.volume.volume_id)
            .await
            .unwrap();
        assert_eq!(s.snapshot_id, SnapshotId::for_name(snap).to_string());
        let r = create_volume(
            &mut c,
            &format!("{snap}-restored"),
            64 * MIB,
            &self.kind,
            Some(snap_source(&s.snapshot_id)),
        )
        .await
        .unwrap();
        let rm = stage_publish(&mut c, &self.pool, &r.volume_id, &self.kind).await;
        assert_eq!(sha256(&rm.target.join("data")), self.data);
        unstage(&mut c, &rm).await;
        unstage(&mut c, &self.mounted).await;
        delete_volume(&mut c, &r.volume_id).await;
        delete_snapshot(&mut c, &s.snapshot_id).await.unwrap();
        delete_volume(&mut c, &self.volume.volume_id).await;
    }
}

/// A copy held past the freeze deadline (a failpoint sleeps 8 s after the copy,
/// under the freeze; `--freeze-timeout=2`): the filesystem is thawed while the copy
/// is still held — a write to the staged volume completes before the call
/// answers —, the call fails with ABORTED, nothing of the snapshot remains, and
/// the retry succeeds with the data of the volume.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_freeze_deadline_thaws_and_undoes_the_snapshot() {
    require_root();
    let h = HeldCopy::new("pvc-held", 2).await;
    let (pool, driver) = (&h.pool, &h.driver);
    let (v, m) = (&h.volume, &h.mounted);
    let mut c = driver.clients().await;

    let mut c2 = driver.clients().await;
    let id = v.volume_id.clone();
    let started = Instant::now();
    let snap = tokio::spawn(async move { create_snapshot(&mut c2, "snap-held", &id).await });
    assert!(
        wait_for_log(driver, "failpoint snapshot.after-copy reached", 30).await,
        "the copy never reached its failpoint:\n{}",
        driver.log_text()
    );
    // Frozen, the write waits; thawed by the deadline (2 s), it finishes while the
    // copy is still held by the failpoint (8 s).
    let took = tokio::task::spawn_blocking({
        let t = m.target.clone();
        move || write_takes(&t, Duration::from_secs(5))
    })
    .await
    .unwrap();
    let held = !snap.is_finished();
    assert!(
        took.is_some(),
        "the staged volume was not writable 5 s after its copy began: still frozen"
    );
    assert!(
        held,
        "the call ended before the write: the thaw was not shown to precede the copy's end"
    );
    eprintln!(
        "a write to the staged volume finished {:?} after the call began (the copy held)",
        started.elapsed()
    );
    let r = snap.await.unwrap();
    let e = r.expect_err("a snapshot whose copy outlived its freeze must fail");
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    assert!(e.message().contains("--freeze-timeout"), "{e:?}");
    let sid = SnapshotId::for_name("snap-held").to_string();
    let left = snapshot_leftovers(pool, driver, &sid);
    assert!(left.is_empty(), "left by the failed snapshot: {left:?}");
    assert!(all_snapshot_ids(&mut c).await.is_empty());

    // The retry runs through (the failpoint paused once) and holds the data.
    assert!(writable_within_5s(&m.target));
    h.retry_and_restore("snap-held").await;
}

/// The kernel's switch of expedited grace periods.
const RCU_EXPEDITED: &str = "/sys/kernel/rcu_expedited";

fn rcu_expedited() -> String {
    std::fs::read_to_string(RCU_EXPEDITED)
        .unwrap()
        .trim()
        .to_string()
}

/// `--expedite-freeze`: the switch is raised for the freeze of a staged volume
/// (the marker says so before it is), put back when the call ends, and put back
/// by the next start after a crash with it raised. A switch raised already (by
/// the machine's operator) is left as it is.
#[tokio::test]
#[ignore = "needs root: loop devices, mounts and /sys/kernel/rcu_expedited"]
async fn root_expedited_freeze_raises_the_kernel_switch_for_the_freeze_only() {
    require_root();
    let before = rcu_expedited();
    let ours = before == "0";
    let pool = Pool::new("xfs");
    let mut driver = Driver::start_with_env(
        &pool,
        &["--expedite-freeze"],
        &[(
            csi_storage::failpoint::ENV,
            "freeze.before-fifreeze=1*sleep(3000)",
        )],
    );
    let mut c = driver.clients().await;
    let kind = Kind::image("xfs");
    let v = create_volume(&mut c, "pvc-expedite", 64 * MIB, &kind, None)
        .await
        .unwrap();
    let m = stage_publish(&mut c, &pool, &v.volume_id, &kind).await;
    write_random(&m.target.join("data"), MIB as usize);
    let data = sha256(&m.target.join("data"));

    let mut c2 = driver.clients().await;
    let id = v.volume_id.clone();
    let snap = tokio::spawn(async move { create_snapshot(&mut c2, "snap-expedite", &id).await });
    assert!(
        wait_for_log(&driver, "failpoint freeze.before-fifreeze reached", 30).await,
        "the snapshot never reached its freeze:\n{}",
        driver.log_text()
    );
    let during = rcu_expedited();
    let markers: Vec<String> = std::fs::read_dir(driver.state.join("shared/frozen"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    let s = snap.await.unwrap().expect("the snapshot succeeds");
    let after = rcu_expedited();
    assert_eq!(
        during, "1",
        "raised for the freeze (it read {before} before)"
    );
    assert_eq!(markers.len(), 1, "{markers:?}");
    assert_eq!(
        markers[0].contains(r#""expedited":true"#),
        ours,
        "the marker says whether the switch is the driver's to put back: {}",
        markers[0]
    );
    assert_eq!(after, before, "put back when the freeze ended");

    // The snapshot holds the data.
    let r = create_volume(
        &mut c,
        "pvc-expedite-r",
        64 * MIB,
        &kind,
        Some(snap_source(&s.snapshot_id)),
    )
    .await
    .unwrap();
    let rm = stage_publish(&mut c, &pool, &r.volume_id, &kind).await;
    assert_eq!(sha256(&rm.target.join("data")), data);
    unstage(&mut c, &rm).await;

    // A crash with the switch raised: the next start puts it back.
    driver.envs = vec![(
        csi_storage::failpoint::ENV.to_string(),
        "freeze.before-fifreeze".to_string(),
    )];
    driver.restart();
    let mut c = driver.clients().await;
    let e = create_snapshot(&mut c, "snap-expedite-crash", &v.volume_id)
        .await
        .expect_err("the driver dies at the failpoint");
    assert!(driver.wait_exit(20).is_some(), "{e:?}");
    assert_eq!(rcu_expedited(), "1", "the crash left the switch raised");
    driver.envs.clear();
    driver.spawn();
    let mut c = driver.clients().await;
    assert_eq!(
        rcu_expedited(),
        before,
        "the start after the crash put the switch back:\n{}",
        driver.log_text()
    );
    let s2 = create_snapshot(&mut c, "snap-expedite-crash", &v.volume_id)
        .await
        .unwrap();
    assert_eq!(rcu_expedited(), before);
    unstage(&mut c, &m).await;
    for sid in [&s.snapshot_id, &s2.snapshot_id] {
        delete_snapshot(&mut c, sid).await.unwrap();
    }
    for id in [&r.volume_id, &v.volume_id] {
        delete_volume(&mut c, id).await;
    }
}

/// The client's deadline (`grpc-timeout`, 1.5 s) passes while the copy is held
/// under the freeze (a failpoint sleeps 8 s; the freeze deadline is far): the
/// filesystem is thawed at once, the abandoned work keeps the volume's lock until
/// it has undone itself (a retry meanwhile is ABORTED, never run beside it), then
/// nothing of it remains and a retry succeeds.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_client_deadline_undoes_the_snapshot() {
    require_root();
    let h = HeldCopy::new("pvc-deadline", 60).await;
    let (pool, driver) = (&h.pool, &h.driver);
    let (v, m) = (&h.volume, &h.mounted);
    let mut c = driver.clients().await;

    let req = || csi::CreateSnapshotRequest {
        source_volume_id: v.volume_id.clone(),
        name: "snap-deadline".into(),
        ..Default::default()
    };
    let mut call = tonic::Request::new(req());
    call.set_timeout(Duration::from_millis(1500));
    let started = Instant::now();
    let e = c
        .controller
        .create_snapshot(call)
        .await
        .expect_err("the call cannot finish within its deadline");
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{e:?}"
    );
    assert!(
        driver
            .log_text()
            .contains("failpoint snapshot.after-copy reached"),
        "the deadline passed before the copy: this test proves nothing"
    );
    // The work is still held by the failpoint, yet the volume takes writes.
    let took = tokio::task::spawn_blocking({
        let t = m.target.clone();
        move || write_takes(&t, Duration::from_secs(4))
    })
    .await
    .unwrap();
    assert!(
        took.is_some(),
        "the staged volume stayed frozen after the caller left"
    );
    let retry = c.controller.create_snapshot(req()).await;
    let abandoned_done = driver.log_text().contains("abandoned call ended");
    assert!(
        !abandoned_done,
        "the abandoned work ended before the checks, {:?} after the call began",
        started.elapsed()
    );
    assert_eq!(
        retry.as_ref().map(|_| ()).unwrap_err().code(),
        Code::Aborted,
        "a retry while the abandoned work runs: {retry:?}"
    );
    assert!(
        wait_for_log(driver, "abandoned call ended: stopped and undone", 30).await,
        "the abandoned work never reported its end:\n{}",
        driver.log_text()
    );
    let sid = SnapshotId::for_name("snap-deadline").to_string();
    let left = snapshot_leftovers(pool, driver, &sid);
    assert!(left.is_empty(), "left by the abandoned snapshot: {left:?}");
    assert!(all_snapshot_ids(&mut c).await.is_empty());

    h.retry_and_restore("snap-deadline").await;
}

// ---------------------------------------------------------------- topology

fn node_topology(node: &str) -> csi::Topology {
    csi::Topology {
        segments: [("topology.example.csi/node".to_string(), node.to_string())].into(),
    }
}

/// A snapshot lives in the pool of the node that took it: its answers say so,
/// CreateSnapshot refuses a requisite that leaves this node out (and makes
/// nothing), and a restore is only made where the snapshot is.
#[tokio::test]
#[ignore = "needs root: pools on loop-mounted filesystems"]
async fn root_snapshots_live_on_the_node_that_took_them() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;

    assert!(
        advertises_service(
            &mut c,
            csi::plugin_capability::service::Type::SnapshotAccessibilityConstraints
        )
        .await
    );
    let here = c
        .node
        .node_get_info(csi::NodeGetInfoRequest::default())
        .await
        .unwrap()
        .into_inner()
        .accessible_topology
        .unwrap();
    assert_eq!(here, node_topology("test-node"));
    let elsewhere = node_topology("other-node");

    let vol = create_volume(&mut c, "pvc-topo", 32 * MIB, &Kind::image("ext4"), None)
        .await
        .unwrap();
    let snap_req = |name: &str, requisite: Vec<csi::Topology>, preferred: Vec<csi::Topology>| {
        csi::CreateSnapshotRequest {
            source_volume_id: vol.volume_id.clone(),
            name: name.to_string(),
            accessibility_requirements: Some(csi::TopologyRequirement {
                requisite,
                preferred,
            }),
            ..Default::default()
        }
    };
    let snap = |r: tonic::Response<csi::CreateSnapshotResponse>| r.into_inner().snapshot.unwrap();

    // Constrained to this node: made here, and it says so everywhere.
    let s = snap(
        c.controller
            .create_snapshot(snap_req(
                "snap-here",
                vec![here.clone()],
                vec![here.clone()],
            ))
            .await
            .unwrap(),
    );
    assert_eq!(s.accessible_topology, vec![here.clone()]);
    let got = c
        .controller
        .get_snapshot(csi::GetSnapshotRequest {
            snapshot_id: s.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(got.accessible_topology, vec![here.clone()]);
    // Without requirements, and with this node among others: also here.
    let plain = create_snapshot(&mut c, "snap-plain", &vol.volume_id)
        .await
        .unwrap();
    assert_eq!(plain.accessible_topology, vec![here.clone()]);
    let among = snap(
        c.controller
            .create_snapshot(snap_req(
                "snap-among",
                vec![elsewhere.clone(), here.clone()],
                vec![elsewhere.clone()],
            ))
            .await
            .unwrap(),
    );
    assert_eq!(among.accessible_topology, vec![here.clone()]);

    // A requisite without this node cannot be met, and leaves nothing behind.
    let err = c
        .controller
        .create_snapshot(snap_req("snap-away", vec![elsewhere.clone()], vec![]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let listed: BTreeSet<String> = c
        .controller
        .list_snapshots(csi::ListSnapshotsRequest {
            source_volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .map(|e| {
            let s = e.snapshot.unwrap();
            assert_eq!(s.accessible_topology, vec![here.clone()]);
            s.snapshot_id
        })
        .collect();
    assert_eq!(
        listed,
        BTreeSet::from([
            s.snapshot_id.clone(),
            plain.snapshot_id.clone(),
            among.snapshot_id.clone()
        ])
    );
    assert!(!pool.path.join("snapshots").read_dir().unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains(&SnapshotId::for_name("snap-away").to_string())));

    // A restore is made only where the snapshot is.
    let mut restore = create_req(
        "pvc-restore-away",
        32 * MIB,
        mount_cap("ext4", writer()),
        &[],
    );
    restore.volume_content_source = Some(snap_source(&s.snapshot_id));
    restore.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![elsewhere.clone()],
        preferred: vec![],
    });
    let err = c
        .controller
        .create_volume(restore.clone())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    restore.name = "pvc-restore-here".into();
    restore.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![here.clone()],
        preferred: vec![],
    });
    let restored = must_create(&mut c.controller, restore).await;
    assert_eq!(restored.accessible_topology, vec![here.clone()]);

    delete_volume(&mut c, &restored.volume_id).await;
    for id in [&s.snapshot_id, &plain.snapshot_id, &among.snapshot_id] {
        delete_snapshot(&mut c, id).await.unwrap();
    }
    delete_volume(&mut c, &vol.volume_id).await;
}

/// A claim smaller than the filesystem's minimum gets the minimum; its snapshots,
/// single or in a group, promise a restore the size the claim asked for (what a
/// CO checks a restore's request against), and a restore of that size is made as
/// large as the data.
#[tokio::test]
#[ignore = "needs root: loop devices, mkfs, mounts"]
async fn root_snapshots_of_a_volume_made_larger_than_asked_restore_at_the_asked_size() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    const MIB: i64 = 1 << 20;
    let kind = Kind::image("ext4");
    let vol = create_volume(&mut c, "pvc-tiny", MIB, &kind, None)
        .await
        .unwrap();
    assert_eq!(vol.capacity_bytes, 8 * MIB, "ext4's minimum is made");

    let snap = create_snapshot(&mut c, "snap-tiny", &vol.volume_id)
        .await
        .unwrap();
    assert_eq!(snap.size_bytes, MIB);
    let (listed, _) = list_snapshots(&mut c, 0, "", &snap.snapshot_id, "")
        .await
        .unwrap();
    assert_eq!(
        listed.iter().map(|s| s.size_bytes).collect::<Vec<_>>(),
        vec![MIB]
    );
    let group = create_group(&mut c, "group-tiny", &[&vol.volume_id])
        .await
        .unwrap();
    assert_eq!(
        group
            .snapshots
            .iter()
            .map(|s| s.size_bytes)
            .collect::<Vec<_>>(),
        vec![MIB]
    );

    for (name, from) in [("pvc-r1", &snap), ("pvc-r2", &group.snapshots[0])] {
        let restored = create_volume(
            &mut c,
            name,
            from.size_bytes,
            &kind,
            Some(snap_source(&from.snapshot_id)),
        )
        .await
        .unwrap();
        assert_eq!(restored.capacity_bytes, 8 * MIB, "{name}");
        delete_volume(&mut c, &restored.volume_id).await;
    }
    delete_group(&mut c, &group.group_snapshot_id)
        .await
        .unwrap();
    delete_snapshot(&mut c, &snap.snapshot_id).await.unwrap();
    delete_volume(&mut c, &vol.volume_id).await;
}
