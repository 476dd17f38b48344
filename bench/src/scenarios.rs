//! The scenarios. Each one leaves the driver as it found it (it deletes what it
//! made) and appends its figures, named `scenario/parameter/metric_unit`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_proto::csi::{self, controller_client::ControllerClient};
use tokio::io::AsyncWriteExt;
use tonic::transport::Channel;

use crate::target::{create_req, mount_cap, Error, Target, Usage};

pub const MIB: i64 = 1 << 20;
pub const GIB: i64 = 1 << 30;

#[derive(Debug, Default, Clone)]
pub struct Figures(pub Vec<(String, f64)>);

impl Figures {
    pub fn put(&mut self, key: impl Into<String>, v: f64) {
        let key = key.into();
        eprintln!("    {key} = {v:.3}");
        self.0.push((key, v));
    }

    fn latencies(&mut self, prefix: &str, samples: &mut [Duration]) {
        samples.sort();
        for (q, name) in [(0.50, "p50"), (0.95, "p95"), (0.99, "p99")] {
            self.put(format!("{prefix}_{name}_ms"), ms(percentile(samples, q)));
        }
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub fn size_label(bytes: i64) -> String {
    if bytes % GIB == 0 {
        format!("{}GiB", bytes / GIB)
    } else {
        format!("{}MiB", bytes / MIB)
    }
}

fn status(what: &str, s: tonic::Status) -> Error {
    format!("{what}: {:?}: {}", s.code(), s.message())
}

pub async fn create(
    ctl: &mut ControllerClient<Channel>,
    req: csi::CreateVolumeRequest,
) -> Result<csi::Volume, Error> {
    let name = req.name.clone();
    ctl.create_volume(req)
        .await
        .map_err(|s| status(&format!("CreateVolume {name}"), s))?
        .into_inner()
        .volume
        .ok_or_else(|| format!("CreateVolume {name}: no volume in the answer"))
}

pub async fn delete(ctl: &mut ControllerClient<Channel>, id: &str) -> Result<(), Error> {
    ctl.delete_volume(csi::DeleteVolumeRequest {
        volume_id: id.to_string(),
        ..Default::default()
    })
    .await
    .map_err(|s| status(&format!("DeleteVolume {id}"), s))?;
    Ok(())
}

/// Volumes a ListVolumes page asks for, as a client walking them all would.
const LIST_PAGE: i32 = 1000;

/// The time to list every volume, a page at a time, and the pages it took; None
/// when the driver does not list volumes.
async fn list_all(ctl: &mut ControllerClient<Channel>) -> Result<Option<(Duration, usize)>, Error> {
    let t0 = Instant::now();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = match ctl
            .list_volumes(csi::ListVolumesRequest {
                max_entries: LIST_PAGE,
                starting_token: token.clone(),
            })
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) if pages == 0 && s.code() == tonic::Code::Unimplemented => return Ok(None),
            Err(s) => return Err(status("ListVolumes", s)),
        };
        pages += 1;
        if page.next_token.is_empty() {
            return Ok(Some((t0.elapsed(), pages)));
        }
        token = page.next_token;
    }
}

/// Runs `count` jobs with `concurrency` workers; returns each job's latency and the wall time.
async fn fan_out<F, Fut>(
    count: usize,
    concurrency: usize,
    job: F,
) -> Result<(Vec<Duration>, Duration), Error>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let job = Arc::new(job);
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency.max(1) {
        let next = next.clone();
        let job = job.clone();
        workers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    return Ok::<_, Error>(lat);
                }
                let t = Instant::now();
                job(i).await?;
                lat.push(t.elapsed());
            }
        }));
    }
    let mut all = Vec::with_capacity(count);
    let mut first_err = None;
    for w in workers {
        match w.await {
            Ok(Ok(l)) => all.extend(l),
            Ok(Err(e)) => first_err = first_err.or(Some(e)),
            Err(e) => first_err = first_err.or(Some(e.to_string())),
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok((all, t0.elapsed())),
    }
}

/// CreateVolume then DeleteVolume of `count` volumes at each concurrency.
pub async fn create_delete(
    t: &mut Target,
    tag: &str,
    count: usize,
    levels: &[usize],
    params: &[(String, String)],
    out: &mut Figures,
) -> Result<(), Error> {
    for &c in levels {
        let ids = Arc::new(std::sync::Mutex::new(vec![String::new(); count]));
        let before = t.usage();
        let (ctl, ids2, tag2, params2) =
            (t.ctl.clone(), ids.clone(), tag.to_string(), params.to_vec());
        let (mut lat, wall) = fan_out(count, c, move |i| {
            let mut ctl = ctl.clone();
            let ids = ids2.clone();
            let req = create_req(&format!("bench-cd-{tag2}-c{c}-{i}"), GIB, "", &params2);
            async move {
                let v = create(&mut ctl, req).await?;
                ids.lock().unwrap()[i] = v.volume_id;
                Ok(())
            }
        })
        .await?;
        out.put(
            format!("create-delete/c{c}/create_ops_s"),
            count as f64 / wall.as_secs_f64(),
        );
        out.latencies(&format!("create-delete/c{c}/create"), &mut lat);
        let before = per_call(t, before, count, &format!("create-delete/c{c}/create"), out);
        let ctl = t.ctl.clone();
        let (mut lat, wall) = fan_out(count, c, move |i| {
            let mut ctl = ctl.clone();
            let id = ids.lock().unwrap()[i].clone();
            async move { delete(&mut ctl, &id).await }
        })
        .await?;
        out.put(
            format!("create-delete/c{c}/delete_ops_s"),
            count as f64 / wall.as_secs_f64(),
        );
        out.latencies(&format!("create-delete/c{c}/delete"), &mut lat);
        per_call(t, before, count, &format!("create-delete/c{c}/delete"), out);
    }
    Ok(())
}

/// KEY=VALUE parameters of a request.
type Params = [(String, String)];

/// CreateSnapshot then DeleteSnapshot of `count` volumes (made first, 16 at
/// a time, not timed), at each concurrency level: ops/s, latencies and the
/// driver's CPU per call. The volumes hold no data: the figures are the
/// calls' own cost (and, through a cluster's controller, its hop).
pub async fn create_snapshots(
    t: &mut Target,
    tag: &str,
    count: usize,
    levels: &[usize],
    (params, class): (&Params, &Params),
    out: &mut Figures,
) -> Result<(), Error> {
    let ids = Arc::new(std::sync::Mutex::new(vec![String::new(); count]));
    let (ctl, ids2, tag2, params2) = (t.ctl.clone(), ids.clone(), tag.to_string(), params.to_vec());
    fan_out(count, 16, move |i| {
        let mut ctl = ctl.clone();
        let ids = ids2.clone();
        let req = create_req(&format!("bench-cs-{tag2}-{i}"), GIB, "", &params2);
        async move {
            let v = create(&mut ctl, req).await?;
            ids.lock().unwrap()[i] = v.volume_id;
            Ok(())
        }
    })
    .await?;
    let mut result = Ok(());
    for &c in levels {
        if let Err(e) = snapshot_round(t, tag, c, &ids, class, out).await {
            result = Err(e);
            break;
        }
    }
    // The volumes go whatever happened, so that a failed round leaves no
    // volumes behind in the driver measured.
    let ctl = t.ctl.clone();
    let ids3 = ids.clone();
    fan_out(count, 16, move |i| {
        let mut ctl = ctl.clone();
        let id = ids3.lock().unwrap()[i].clone();
        async move {
            if id.is_empty() {
                return Ok(());
            }
            delete(&mut ctl, &id).await
        }
    })
    .await?;
    result
}

/// One concurrency level of [`create_snapshots`].
async fn snapshot_round(
    t: &mut Target,
    tag: &str,
    c: usize,
    ids: &Arc<std::sync::Mutex<Vec<String>>>,
    class: &[(String, String)],
    out: &mut Figures,
) -> Result<(), Error> {
    let count = ids.lock().unwrap().len();
    let snaps = Arc::new(std::sync::Mutex::new(vec![String::new(); count]));
    let before = t.usage();
    let (ctl, ids2, snaps2, tag2, class2) = (
        t.ctl.clone(),
        ids.clone(),
        snaps.clone(),
        tag.to_string(),
        class.to_vec(),
    );
    let (mut lat, wall) = fan_out(count, c, move |i| {
        let mut ctl = ctl.clone();
        let source = ids2.lock().unwrap()[i].clone();
        let snaps = snaps2.clone();
        let name = format!("bench-cs-{tag2}-c{c}-{i}");
        let class = class2.clone();
        async move {
            let s = create_snapshot(&mut ctl, &source, &name, &class).await?;
            snaps.lock().unwrap()[i] = s.snapshot_id;
            Ok(())
        }
    })
    .await?;
    let prefix = format!("create-snapshot/c{c}");
    out.put(
        format!("{prefix}/create_ops_s"),
        count as f64 / wall.as_secs_f64(),
    );
    out.latencies(&format!("{prefix}/create"), &mut lat);
    let before = per_call(t, before, count, &format!("{prefix}/create"), out);
    let ctl = t.ctl.clone();
    let (mut lat, wall) = fan_out(count, c, move |i| {
        let mut ctl = ctl.clone();
        let id = snaps.lock().unwrap()[i].clone();
        async move {
            ctl.delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: id.clone(),
                ..Default::default()
            })
            .await
            .map_err(|s| status(&format!("DeleteSnapshot {id}"), s))?;
            Ok(())
        }
    })
    .await?;
    out.put(
        format!("{prefix}/delete_ops_s"),
        count as f64 / wall.as_secs_f64(),
    );
    out.latencies(&format!("{prefix}/delete"), &mut lat);
    per_call(t, before, count, &format!("{prefix}/delete"), out);
    Ok(())
}

/// Puts the driver's CPU time (µs) and context switches per call since
/// `before`, when its process is known; returns the usage now.
fn per_call(
    t: &Target,
    before: Option<Usage>,
    calls: usize,
    prefix: &str,
    out: &mut Figures,
) -> Option<Usage> {
    let now = t.usage()?;
    if let Some(before) = before {
        let (cpu_ns, switches) = now.since(&before);
        let calls = calls.max(1) as f64;
        out.put(format!("{prefix}_cpu_us"), cpu_ns as f64 / 1000.0 / calls);
        out.put(format!("{prefix}_switches"), switches as f64 / calls);
    }
    Some(now)
}

/// Background volumes, so that per-operation cost can be measured against a
/// growing number of volumes present.
#[derive(Default)]
pub struct Population {
    pub ids: Vec<String>,
}

impl Population {
    pub async fn grow_to(
        &mut self,
        t: &Target,
        tag: &str,
        n: usize,
        params: &[(String, String)],
    ) -> Result<(), Error> {
        let have = self.ids.len();
        if n <= have {
            return Ok(());
        }
        let made = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (ctl, made2, tag, params) = (
            t.ctl.clone(),
            made.clone(),
            tag.to_string(),
            params.to_vec(),
        );
        let t0 = Instant::now();
        fan_out(n - have, 16, move |i| {
            let mut ctl = ctl.clone();
            let made = made2.clone();
            let req = create_req(&format!("bench-pop-{tag}-{}", have + i), GIB, "", &params);
            async move {
                let v = create(&mut ctl, req).await?;
                made.lock().unwrap().push(v.volume_id);
                Ok(())
            }
        })
        .await?;
        self.ids.extend(made.lock().unwrap().drain(..));
        eprintln!(
            "    ({} volumes present; +{} in {:.1} s)",
            self.ids.len(),
            n - have,
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    }

    pub async fn clear(&mut self, t: &Target) -> Result<(), Error> {
        let ids = Arc::new(std::mem::take(&mut self.ids));
        let ctl = t.ctl.clone();
        let n = ids.len();
        fan_out(n, 16, move |i| {
            let mut ctl = ctl.clone();
            let id = ids[i].clone();
            async move { delete(&mut ctl, &id).await }
        })
        .await?;
        Ok(())
    }
}

/// `ops` CreateVolume calls one after the other, then as many DeleteVolume calls.
pub async fn scale_step(
    t: &mut Target,
    tag: &str,
    present: usize,
    ops: usize,
    params: &[(String, String)],
    out: &mut Figures,
) -> Result<(), Error> {
    if let Some((took, pages)) = list_all(&mut t.ctl).await? {
        out.put(format!("scale/{present}/list_all_ms"), ms(took));
        out.put(format!("scale/{present}/list_pages"), pages as f64);
    }
    let mut ids = Vec::with_capacity(ops);
    let mut lat = Vec::with_capacity(ops);
    for i in 0..ops {
        let req = create_req(&format!("bench-scale-{tag}-{present}-{i}"), GIB, "", params);
        let t0 = Instant::now();
        let v = create(&mut t.ctl, req).await?;
        lat.push(t0.elapsed());
        ids.push(v.volume_id);
    }
    out.latencies(&format!("scale/{present}/create"), &mut lat);
    lat.clear();
    for id in &ids {
        let t0 = Instant::now();
        delete(&mut t.ctl, id).await?;
        lat.push(t0.elapsed());
    }
    out.latencies(&format!("scale/{present}/delete"), &mut lat);
    Ok(())
}

fn stage_req(v: &csi::Volume, staging: &Path, fs: &str) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(mount_cap(fs)),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    }
}

fn publish_req(
    v: &csi::Volume,
    staging: &Path,
    target: &Path,
    fs: &str,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(mount_cap(fs)),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    }
}

async fn stage_publish(
    t: &mut Target,
    v: &csi::Volume,
    staging: &Path,
    target: &Path,
    fs: &str,
) -> Result<(), Error> {
    t.node
        .node_stage_volume(stage_req(v, staging, fs))
        .await
        .map_err(|s| status(&format!("NodeStageVolume {}", v.volume_id), s))?;
    t.node
        .node_publish_volume(publish_req(v, staging, target, fs))
        .await
        .map_err(|s| status(&format!("NodePublishVolume {}", v.volume_id), s))?;
    Ok(())
}

async fn unpublish_unstage(
    t: &mut Target,
    id: &str,
    staging: &Path,
    target: &Path,
) -> Result<(), Error> {
    t.node
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.to_string(),
            target_path: target.display().to_string(),
        })
        .await
        .map_err(|s| status(&format!("NodeUnpublishVolume {id}"), s))?;
    t.node
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: id.to_string(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .map_err(|s| status(&format!("NodeUnstageVolume {id}"), s))?;
    Ok(())
}

fn paths(scratch: &Path, id: &str) -> Result<(PathBuf, PathBuf), Error> {
    let staging = scratch.join("staging").join(id);
    let target = scratch.join("target").join(id);
    for p in [&staging, &target] {
        std::fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok((staging, target))
}

/// How the node and snapshot scenarios make their volumes: the filesystem, the
/// CreateVolume parameters, and a scratch directory for staging paths and
/// targets.
pub struct Volumes<'a> {
    pub fs: &'a str,
    pub params: &'a [(String, String)],
    pub scratch: &'a Path,
}

impl Volumes<'_> {
    fn create_req(&self, name: &str, size: i64) -> csi::CreateVolumeRequest {
        create_req(name, size, self.fs, self.params)
    }
}

/// NodeStage+NodePublish, then NodeUnpublish+NodeUnstage, of `count` volumes of a kind.
pub async fn node(
    t: &mut Target,
    tag: &str,
    kind: &str,
    count: usize,
    with: &Volumes<'_>,
    out: &mut Figures,
) -> Result<(), Error> {
    let mut vols = Vec::new();
    for i in 0..count {
        let req = with.create_req(&format!("bench-node-{tag}-{kind}-{i}"), GIB);
        vols.push(create(&mut t.ctl, req).await?);
    }
    let mut up = Vec::new();
    for v in &vols {
        let (staging, target) = paths(with.scratch, &v.volume_id)?;
        let t0 = Instant::now();
        stage_publish(t, v, &staging, &target, with.fs).await?;
        up.push(t0.elapsed());
    }
    let mut down = Vec::new();
    for v in &vols {
        let (staging, target) = paths(with.scratch, &v.volume_id)?;
        let t0 = Instant::now();
        unpublish_unstage(t, &v.volume_id, &staging, &target).await?;
        down.push(t0.elapsed());
        let _ = std::fs::remove_dir(&staging);
        let _ = std::fs::remove_dir(&target);
    }
    out.latencies(&format!("node/{kind}/stage_publish"), &mut up);
    out.latencies(&format!("node/{kind}/unpublish_unstage"), &mut down);
    for v in &vols {
        delete(&mut t.ctl, &v.volume_id).await?;
    }
    Ok(())
}

fn used_bytes(pool: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(pool).ok()?;
    Some((s.blocks() - s.blocks_free()) * s.fragment_size())
}

/// Writes `size` bytes of pseudo-random data (not compressible, not dedupable) and fsyncs.
async fn write_random(path: &Path, size: i64) -> Result<(), Error> {
    let mut f = tokio::fs::File::create(path)
        .await
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15 ^ (size as u64);
    let mut buf = vec![0u8; 4 << 20];
    let mut left = size as usize;
    while left > 0 {
        for chunk in buf.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes());
        }
        let n = left.min(buf.len());
        f.write_all(&buf[..n])
            .await
            .map_err(|e| format!("{}: {e}", path.display()))?;
        left -= n;
    }
    f.sync_all()
        .await
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

/// Runs `op`; puts its time as `{prefix}/{time}_ms` and, when the pool is
/// known, the space it took there as `{prefix}/{space}_mib`.
async fn time_and_space<T>(
    pool: Option<&Path>,
    out: &mut Figures,
    (prefix, time, space): (&str, &str, &str),
    op: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    let (made, took, used) = timed_with_space(pool, op).await?;
    out.put(format!("{prefix}/{time}_ms"), took);
    if let Some(used) = used {
        out.put(format!("{prefix}/{space}_mib"), used);
    }
    Ok(made)
}

/// What `op` made, the time it took (ms) and the space the pool lost to it (MiB,
/// where the pool is known).
async fn timed_with_space<T>(
    pool: Option<&Path>,
    op: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<(T, f64, Option<f64>), Error> {
    let before = pool.and_then(used_bytes);
    let t0 = Instant::now();
    let made = op.await?;
    let took = ms(t0.elapsed());
    let used = match (before, pool.and_then(used_bytes)) {
        (Some(before), Some(after)) => Some((after as f64 - before as f64) / MIB as f64),
        _ => None,
    };
    Ok((made, took, used))
}

/// For each size: a staged and published volume holding that much data; time
/// CreateSnapshot, then `repeats` restores from it and clones of the volume
/// (a restore then a clone, both deleted before the next pair), and the space
/// each took. A restore's and a clone's time is the median of their repeats,
/// their space that of the first.
pub async fn snapshot(
    t: &mut Target,
    tag: &str,
    sizes: &[i64],
    repeats: usize,
    (with, class): (&Volumes<'_>, &[(String, String)]),
    out: &mut Figures,
) -> Result<(), Error> {
    for &size in sizes {
        let name = format!("bench-snap-{tag}");
        snapshot_of(t, &name, size, repeats, (with, class), out).await?;
    }
    Ok(())
}

/// The snapshot scenario for one size; its volumes are named after `name`.
async fn snapshot_of(
    t: &mut Target,
    name: &str,
    size: i64,
    repeats: usize,
    (with, class): (&Volumes<'_>, &[(String, String)]),
    out: &mut Figures,
) -> Result<(), Error> {
    let label = size_label(size);
    let prefix = format!("snapshot/{label}");
    let name = format!("{name}-{label}");
    let pool = t.spec.pool.clone();
    let pool = pool.as_deref();
    // Room for the data and the filesystem's own overhead.
    let vol_size = size + size / 4 + 512 * MIB;
    let v = create(&mut t.ctl, with.create_req(&name, vol_size)).await?;
    let (staging, target) = paths(with.scratch, &v.volume_id)?;
    stage_publish(t, &v, &staging, &target, with.fs).await?;
    let t0 = Instant::now();
    write_random(&target.join("data"), size).await?;
    out.put(format!("{prefix}/write_s"), t0.elapsed().as_secs_f64());

    let snap = time_and_space(
        pool,
        out,
        (&prefix, "create_snapshot", "snapshot_space"),
        create_snapshot(&mut t.ctl, &v.volume_id, &format!("{name}-s"), class),
    )
    .await?;
    let made_from = MadeFrom {
        name: &name,
        size: vol_size,
        snapshot_id: &snap.snapshot_id,
        volume_id: &v.volume_id,
    };
    restores_and_clones(t, with, &made_from, repeats, &prefix, out).await?;
    t.ctl
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .map_err(|s| status("DeleteSnapshot", s))?;
    unpublish_unstage(t, &v.volume_id, &staging, &target).await?;
    let _ = std::fs::remove_dir(&staging);
    let _ = std::fs::remove_dir(&target);
    delete(&mut t.ctl, &v.volume_id).await
}

/// What restores and clones of the snapshot scenario are made from.
struct MadeFrom<'a> {
    name: &'a str,
    size: i64,
    snapshot_id: &'a str,
    volume_id: &'a str,
}

/// Times `repeats` restores of the snapshot and clones of the volume, with the
/// space the first of each takes.
async fn restores_and_clones(
    t: &mut Target,
    with: &Volumes<'_>,
    src: &MadeFrom<'_>,
    repeats: usize,
    prefix: &str,
    out: &mut Figures,
) -> Result<(), Error> {
    let pool = t.spec.pool.clone();
    let pool = pool.as_deref();
    let (name, vol_size) = (src.name, src.size);
    let from = |suffix: &str, source: csi::volume_content_source::Type| {
        let mut req = with.create_req(&format!("{name}-{suffix}"), vol_size);
        req.volume_content_source = Some(csi::VolumeContentSource {
            r#type: Some(source),
        });
        req
    };
    let restore =
        csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: src.snapshot_id.to_string(),
        });
    let clone =
        csi::volume_content_source::Type::Volume(csi::volume_content_source::VolumeSource {
            volume_id: src.volume_id.to_string(),
        });
    let kinds = [("restore", "r", restore), ("clone", "c", clone)];
    let mut times = vec![Vec::new(); kinds.len()];
    for k in 0..repeats.max(1) {
        let mut made = Vec::new();
        for ((what, suffix, source), times) in kinds.iter().zip(&mut times) {
            // The first of each keeps the name the scenario always gave it.
            let suffix = if k == 0 {
                suffix.to_string()
            } else {
                format!("{suffix}{k}")
            };
            let op = create(&mut t.ctl, from(&suffix, source.clone()));
            let (vol, took, used) = timed_with_space(pool, op)
                .await
                .map_err(|e| format!("{what}: {e}"))?;
            times.push(took);
            // Space from the first repeat only: a volume deleted before a
            // later one is measured may still be giving its blocks back.
            if let (0, Some(used)) = (k, used) {
                out.put(format!("{prefix}/{what}_space_mib"), used);
            }
            made.push(vol);
        }
        // Deleted before the next repeat: repeats of a large size would fill the pool.
        for m in &made {
            delete(&mut t.ctl, &m.volume_id).await?;
        }
    }
    for ((what, _, _), times) in kinds.iter().zip(&times) {
        out.put(format!("{prefix}/{what}_ms"), crate::report::median(times));
    }
    Ok(())
}

async fn create_snapshot(
    ctl: &mut ControllerClient<Channel>,
    source: &str,
    name: &str,
    class: &[(String, String)],
) -> Result<csi::Snapshot, Error> {
    ctl.create_snapshot(csi::CreateSnapshotRequest {
        source_volume_id: source.to_string(),
        name: name.to_string(),
        parameters: class.iter().cloned().collect(),
        ..Default::default()
    })
    .await
    .map_err(|s| status("CreateSnapshot", s))?
    .into_inner()
    .snapshot
    .ok_or_else(|| "CreateSnapshot: no snapshot in the answer".to_string())
}

pub fn rss_mib(t: &Target) -> Option<f64> {
    t.rss().map(|b| b as f64 / MIB as f64)
}
