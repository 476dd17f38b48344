//! The SnapshotMetadata service through the real binary: allocated ranges of an
//! image snapshot and the delta between two snapshots of one block volume, on an
//! xfs pool with reflink (delta from shared extents), a btrfs pool (extents too)
//! and an ext4 pool (delta by comparing data), with paging and the spec's error
//! codes.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::*;
use csi_proto::csi::{
    self, plugin_capability, snapshot_metadata_client::SnapshotMetadataClient, BlockMetadataType,
};
use tonic::transport::Channel;
use tonic::Code;

const KIB: u64 = 1024;
const M: u64 = 1024 * 1024;
const SIZE: i64 = 64 * MIB;
const SECRET: &str = "metadata-secret-value-7f3a";

/// (offset, length) of a write.
type W = (u64, u64);

/// Written before snapshot A.
const FIRST: [W; 3] = [(M, 64 * KIB), (10 * M + 12 * KIB, 8 * KIB), (40 * M, M)];
/// Written after snapshot A, before snapshot B: new places, and a rewrite of one
/// block inside the first writes' last range.
const SECOND: [W; 3] = [
    (2 * M, 8 * KIB),
    (20 * M, 256 * KIB),
    (40 * M + 512 * KIB, 4 * KIB),
];

fn merged(ws: &[W]) -> Vec<W> {
    let mut v = ws.to_vec();
    v.sort_unstable();
    let mut out: Vec<W> = Vec::new();
    for (o, l) in v {
        match out.last_mut() {
            Some(last) if o <= last.0 + last.1 => {
                last.1 = last.1.max(o + l - last.0);
            }
            _ => out.push((o, l)),
        }
    }
    out
}

/// Ranges cut to start at `from`.
fn from(ws: &[W], start: u64) -> Vec<W> {
    ws.iter()
        .filter(|(o, l)| o + l > start)
        .map(|&(o, l)| {
            if o < start {
                (start, o + l - start)
            } else {
                (o, l)
            }
        })
        .collect()
}

struct Fixture {
    pool: Pool,
    driver: Driver,
    c: Clients,
    meta: SnapshotMetadataClient<Channel>,
}

async fn fixture(fs: &str) -> Fixture {
    let pool = Pool::new(fs);
    let driver = Driver::start(&pool, &[]);
    let c = driver.clients().await;
    let ch = csi_glue::connect(&format!("unix://{}", driver.socket.display()))
        .await
        .unwrap();
    Fixture {
        pool,
        driver,
        c,
        meta: SnapshotMetadataClient::new(ch),
    }
}

fn secrets() -> BTreeMap<String, String> {
    BTreeMap::from([("token".to_string(), SECRET.to_string())])
}

/// What the messages of both metadata streams carry.
trait Ranges {
    fn kind(&self) -> i32;
    fn capacity(&self) -> i64;
    fn blocks(&self) -> &[csi::BlockMetadata];
}

/// Both messages name their fields alike.
macro_rules! ranges_of {
    ($($message:ty),*) => {$(
        impl Ranges for $message {
            fn kind(&self) -> i32 {
                self.block_metadata_type
            }
            fn capacity(&self) -> i64 {
                self.volume_capacity_bytes
            }
            fn blocks(&self) -> &[csi::BlockMetadata] {
                &self.block_metadata
            }
        }
    )*};
}

ranges_of!(
    csi::GetMetadataAllocatedResponse,
    csi::GetMetadataDeltaResponse
);

/// All messages of a stream, checked for the invariants of every message;
/// returns (ranges, number of messages).
async fn ranges<M: Ranges>(
    mut s: tonic::Streaming<M>,
    start: i64,
    max: i32,
) -> Result<(Vec<W>, usize), tonic::Status> {
    let mut out = Vec::new();
    let mut n = 0;
    while let Some(msg) = s.message().await? {
        n += 1;
        assert_eq!(msg.kind(), BlockMetadataType::VariableLength as i32);
        assert_eq!(msg.capacity(), SIZE);
        if max > 0 {
            assert!(msg.blocks().len() <= max as usize);
        }
        out.extend(
            msg.blocks()
                .iter()
                .map(|b| (b.byte_offset as u64, b.size_bytes as u64)),
        );
    }
    check_order(&out, start);
    Ok((out, n))
}

async fn allocated(
    m: &mut SnapshotMetadataClient<Channel>,
    id: &str,
    start: i64,
    max: i32,
) -> Result<(Vec<W>, usize), tonic::Status> {
    let req = csi::GetMetadataAllocatedRequest {
        snapshot_id: id.to_string(),
        starting_offset: start,
        max_results: max,
        secrets: secrets(),
    };
    ranges(
        m.get_metadata_allocated(req).await?.into_inner(),
        start,
        max,
    )
    .await
}

async fn delta(
    m: &mut SnapshotMetadataClient<Channel>,
    base: &str,
    target: &str,
    start: i64,
    max: i32,
) -> Result<(Vec<W>, usize), tonic::Status> {
    let req = csi::GetMetadataDeltaRequest {
        base_snapshot_id: base.to_string(),
        target_snapshot_id: target.to_string(),
        starting_offset: start,
        max_results: max,
        secrets: secrets(),
    };
    ranges(m.get_metadata_delta(req).await?.into_inner(), start, max).await
}

/// The spec's rules: sizes > 0, strictly ascending, no overlap, and the first
/// range ends after the starting offset.
fn check_order(rs: &[W], start: i64) {
    for r in rs {
        assert!(r.1 > 0, "empty range in {rs:?}");
    }
    for w in rs.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "overlap or disorder in {rs:?}");
    }
    if let Some(f) = rs.first() {
        assert!(f.0 + f.1 > start as u64, "first range ends before start");
    }
}

fn code<T>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// Writes a distinct pattern at each (offset, length) through the block device
/// and flushes it.
fn write_blocks(dev: &Path, ws: &[W], seed: u8) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev)
        .unwrap();
    for (i, &(o, l)) in ws.iter().enumerate() {
        let buf: Vec<u8> = (0..l)
            .map(|k| (k as u8) ^ seed ^ (i as u8).wrapping_mul(31) | 1)
            .collect();
        f.write_all_at(&buf, o).unwrap();
    }
    f.sync_all().unwrap();
}

struct Block {
    id: String,
    staging: PathBuf,
    target: PathBuf,
}

async fn block_volume(fx: &mut Fixture, name: &str) -> Block {
    let cap = block_cap(writer());
    let id = fx.c.create(name, SIZE, cap.clone(), &[]).await;
    let staging = fx.pool.scratch(&format!("{name}-staging"));
    let target = fx.pool.scratch(&format!("{name}-pods")).join("dev");
    fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
    Block {
        id,
        staging,
        target,
    }
}

async fn release(fx: &mut Fixture, b: &Block) {
    fx.c.unpublish_and_unstage(&b.id, &b.target, &b.staging)
        .await;
}

async fn snapshot(fx: &mut Fixture, name: &str, vol: &str) -> String {
    must_snapshot(&mut fx.c.controller, snapshot_req(name, vol))
        .await
        .snapshot_id
}

async fn delete_snapshot(fx: &mut Fixture, id: &str) {
    fx.c.controller
        .delete_snapshot(delete_snapshot_req(id))
        .await
        .unwrap();
}

async fn delete_volume(fx: &mut Fixture, id: &str) {
    fx.c.controller.delete_volume(delete_req(id)).await.unwrap();
}

/// The whole scenario on one pool filesystem; `method` is the log line that
/// says how the delta was computed.
async fn scenario(fs: &str, method: &str) {
    let mut fx = fixture(fs).await;
    let vol = block_volume(&mut fx, "pvc-cbt").await;
    write_blocks(&vol.target, &FIRST, 0x10);
    let a = snapshot(&mut fx, "snap-a", &vol.id).await;
    write_blocks(&vol.target, &SECOND, 0x20);
    let b = snapshot(&mut fx, "snap-b", &vol.id).await;
    let m = &mut fx.meta;

    // Allocated: exactly what was written (every write is 4 KiB aligned, the
    // block size of the pool filesystems).
    let (ra, _) = allocated(m, &a, 0, 0).await.unwrap();
    assert_eq!(ra, merged(&FIRST), "allocated ranges of snapshot A on {fs}");
    let all: Vec<W> = FIRST.iter().chain(SECOND.iter()).copied().collect();
    let (rb, _) = allocated(m, &b, 0, 0).await.unwrap();
    assert_eq!(rb, merged(&all), "allocated ranges of snapshot B on {fs}");

    // Delta: the second writes, not the first.
    let (d, _) = delta(m, &a, &b, 0, 0).await.unwrap();
    assert_eq!(d, merged(&SECOND), "delta A -> B on {fs}");
    assert!(
        fx.driver.log_text().contains(method),
        "the delta on {fs} was computed by {method:?}"
    );
    let (same, n) = delta(m, &b, &b, 0, 0).await.unwrap();
    assert!(
        same.is_empty() && n == 1,
        "a snapshot has no delta to itself"
    );

    // Paging: one range per message gives the same ranges.
    let (p, n) = allocated(m, &b, 0, 1).await.unwrap();
    assert_eq!(p, rb);
    assert_eq!(n, rb.len(), "one message per range with max_results 1");
    let (p, n) = delta(m, &a, &b, 0, 2).await.unwrap();
    assert_eq!(p, d);
    assert_eq!(n, d.len().div_ceil(2));
    // starting_offset inside a range cuts it there; past all data: nothing.
    let s = 40 * M + 100;
    let (p, _) = allocated(m, &b, s as i64, 0).await.unwrap();
    assert_eq!(p, from(&merged(&all), s));
    assert_eq!(p[0].0, s);
    let s = 20 * M + 4 * KIB;
    let (p, _) = delta(m, &a, &b, s as i64, 0).await.unwrap();
    assert_eq!(p, from(&merged(&SECOND), s));
    let (p, n) = allocated(m, &b, SIZE, 0).await.unwrap();
    assert!(p.is_empty() && n == 1, "offset == capacity: no ranges");
    let (p, _) = delta(m, &a, &b, SIZE - 1, 0).await.unwrap();
    assert!(p.is_empty());

    // Errors.
    let unknown = "6f1c2e9a-0000-5000-8000-000000000000";
    assert_eq!(code(allocated(m, "", 0, 0).await), Code::InvalidArgument);
    assert_eq!(code(allocated(m, unknown, 0, 0).await), Code::NotFound);
    assert_eq!(code(allocated(m, "not-an-id", 0, 0).await), Code::NotFound);
    assert_eq!(code(allocated(m, &a, -1, 0).await), Code::OutOfRange);
    assert_eq!(code(allocated(m, &a, SIZE + 1, 0).await), Code::OutOfRange);
    assert_eq!(code(allocated(m, &a, 0, -5).await), Code::InvalidArgument);
    assert_eq!(code(delta(m, "", &b, 0, 0).await), Code::InvalidArgument);
    assert_eq!(code(delta(m, &a, "", 0, 0).await), Code::InvalidArgument);
    assert_eq!(code(delta(m, unknown, &b, 0, 0).await), Code::NotFound);
    assert_eq!(code(delta(m, &a, unknown, 0, 0).await), Code::NotFound);
    assert_eq!(code(delta(m, &a, &b, -1, 0).await), Code::OutOfRange);
    assert_eq!(
        code(delta(m, &a, &b, SIZE + 4096, 0).await),
        Code::OutOfRange
    );
    assert_eq!(code(delta(m, &a, &b, 0, -1).await), Code::InvalidArgument);

    // Snapshots of another volume: no delta between them.
    let other = block_volume(&mut fx, "pvc-other").await;
    write_blocks(&other.target, &FIRST, 0x10);
    let o = snapshot(&mut fx, "snap-other", &other.id).await;
    let m = &mut fx.meta;
    assert_eq!(code(delta(m, &a, &o, 0, 0).await), Code::InvalidArgument);
    let (ro, _) = allocated(m, &o, 0, 0).await.unwrap();
    assert_eq!(ro, merged(&FIRST));

    // A directory volume's snapshot has no block data.
    let dir =
        fx.c.create("pvc-dir", SIZE, mount_cap("", writer()), &[("kind", "dir")])
            .await;
    let ds = snapshot(&mut fx, "snap-dir", &dir).await;
    let m = &mut fx.meta;
    assert_eq!(code(allocated(m, &ds, 0, 0).await), Code::InvalidArgument);
    assert_eq!(code(delta(m, &ds, &ds, 0, 0).await), Code::InvalidArgument);

    // Secrets are never logged (the driver logs requests at debug level).
    let log = fx.driver.log_text();
    assert!(log.contains("GetMetadataDelta"), "requests are logged");
    assert!(!log.contains(SECRET), "a secret reached the log");

    // The snapshots' data was not changed by any of this.
    let (again, _) = allocated(&mut fx.meta, &a, 0, 0).await.unwrap();
    assert_eq!(again, ra);

    release(&mut fx, &vol).await;
    release(&mut fx, &other).await;
    for s in [&a, &b, &o, &ds] {
        delete_snapshot(&mut fx, s).await;
    }
    for v in [&vol.id, &other.id, &dir] {
        delete_volume(&mut fx, v).await;
    }
    assert_eq!(
        code(allocated(&mut fx.meta, &a, 0, 0).await),
        Code::NotFound
    );
    assert_eq!(
        loops_below(fx.pool.dir.path()).len(),
        1,
        "only the pool's loop is left"
    );
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_metadata_on_xfs_reflink_uses_shared_extents() {
    require_root();
    scenario("xfs", "delta from shared extents").await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_metadata_on_ext4_compares_data() {
    require_root();
    scenario("ext4", "delta from comparing data").await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_metadata_on_btrfs_uses_shared_extents() {
    require_root();
    scenario("btrfs", "delta from shared extents").await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_identity_advertises_snapshot_metadata() {
    require_root();
    let pool = Pool::new("xfs");
    let has = |mode: &'static str| {
        let pool = &pool;
        async move {
            let d = Driver::start(pool, &[mode]);
            let mut c = d.clients().await;
            advertises_service(
                &mut c,
                plugin_capability::service::Type::SnapshotMetadataService,
            )
            .await
        }
    };
    assert!(has("--mode=all").await);
    assert!(has("--mode=controller").await);
    assert!(!has("--mode=node").await);
}
