//! The target side of a transfer: a volume that exists at once, marked as
//! arriving, whose data a job of its own pulls from the source node.
//!
//! Each arrival has a record in `<state>/controller/transfers/` (how far its
//! data is durable, and from where it comes) and a ledger beside it (the
//! entries of the pieces written so far). The record is written before the
//! volume's, and removed only after the mark is cleared, so a start finds
//! every arrival that did not end and goes on with it where its last
//! checkpoint left it. Recorded data is durable: a checkpoint syncs the image
//! and the ledger before it moves the record on.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use csi_sys::file::AppendFile;
use csi_sys::{dir, file};
use serde::{Deserialize, Serialize};

use super::Source;
use crate::core::arrival;
use crate::error::{Context, Error, Result};
use crate::ids::VolumeId;
use crate::locks::LockKey;
use crate::model::*;
use crate::state::Domain;
use crate::volumes::create::Plan;
use crate::volumes::CreateVolume;
use crate::Controller;

/// Makes the source of an arrival, from the source node's name, the
/// transfer's id and the token its hold is read with; set by the process that
/// runs the mesh.
pub type Sources = Arc<dyn Fn(&str, &str, &str) -> Box<dyn Source> + Send + Sync>;

/// The hidden folder of a pool where directories' packed trees arrive.
const ARRIVING: &str = ".arriving";

pub(super) fn packed_path(pool: &crate::pool::Pool, id: VolumeId) -> PathBuf {
    pool.root.join(ARRIVING).join(format!("{id}.tree"))
}

/// The longest wait between two tries of a transfer that failed.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Where a new volume's data comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrivingFrom {
    pub node: String,
    pub transfer_id: String,
    /// The size of the data (the hold's).
    pub size: u64,
    pub fs_type: Option<String>,
    pub requested: Option<u64>,
    /// The source volume's id on its node (a later transfer of it to this
    /// node may start from what this one brought).
    pub source_volume: String,
    /// The claim's namespace and name, when the CO said.
    pub claim: Option<(String, String)>,
    /// What the source asks of whoever reads its hold: given to this node
    /// alone, through the controller.
    pub read_token: String,
    /// Of a directory: the source's size. Its tree arrives packed, `size`
    /// bytes, and is unpacked into the volume once all of it is here.
    pub tree: Option<u64>,
}

/// An arrival as its record keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ArrivalRecord {
    pub(super) volume: VolumeId,
    pub(super) transfer_id: String,
    pub(super) source_node: String,
    pub(super) source_volume: String,
    pub(super) size: u64,
    /// Everything before this offset is durable here.
    pub(super) progress: u64,
    /// Ledger entries durable, for the pieces before `progress`.
    pub(super) entries: u64,
    /// The transfer whose data the image started from (a replica kept here).
    pub(super) base: Option<String>,
    pub(super) started: Timestamp,
    pub(super) resumed: u32,
    pub(super) claim: Option<(String, String)>,
    /// Empty in records made before holds had tokens.
    #[serde(default)]
    pub(super) read_token: String,
    /// The data is a packed tree, unpacked into the volume at the end.
    #[serde(default)]
    pub(super) tree: bool,
}

/// A transfer as `ListTransfers` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TransferStatus {
    pub transfer_id: String,
    /// "arriving" or "hold".
    pub role: String,
    pub volume_id: String,
    pub peer_node: String,
    /// queued, running, waiting, done, failed.
    pub state: String,
    /// Of an arrival: the bytes made durable here (where a restart goes on
    /// from), not those merely written.
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub rate: u64,
    pub message: String,
    pub incremental: bool,
    pub claim: Option<(String, String)>,
    pub resumed: u32,
    /// Once done: the bytes of data the source sent.
    pub data_bytes: u64,
    /// Once done: when, in seconds since the Unix epoch.
    pub ended_seconds: i64,
}

/// A running arrival.
pub(super) struct Job {
    pub(super) stop: AtomicBool,
    /// Stopped because its volume is deleted (else by the process's end).
    deleted: AtomicBool,
    status: Mutex<TransferStatus>,
    ended: (Mutex<bool>, Condvar),
}

impl Job {
    pub(super) fn status(&self) -> TransferStatus {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(super) fn set(&self, f: impl FnOnce(&mut TransferStatus)) {
        f(&mut self.status.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn end(&self) {
        let (m, cv) = &self.ended;
        *m.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
    }

    /// Waits up to `d` for the job to end; whether it did.
    fn wait(&self, d: Duration) -> bool {
        let (m, cv) = &self.ended;
        let g = m.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = cv
            .wait_timeout_while(g, d, |ended| !*ended)
            .unwrap_or_else(|p| p.into_inner());
        *g
    }

    /// Sleeps up to `d`, less when the job is stopped.
    fn pause(&self, d: Duration) {
        let end = Instant::now() + d;
        while Instant::now() < end && !self.stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50).min(end - Instant::now()));
        }
    }
}

/// The arrivals of a controller.
#[derive(Default)]
pub(crate) struct Arrivals {
    jobs: Mutex<BTreeMap<VolumeId, Arc<Job>>>,
    pub(super) sources: OnceLock<Sources>,
    /// Arrivals running now, of at most `cfg.max_transfers`.
    running: (Mutex<usize>, Condvar),
    /// The last arrivals that ended whole, newest last, so that a look at
    /// the transfers after the end still sees it done.
    finished: Mutex<std::collections::VecDeque<TransferStatus>>,
    /// Held while the list of finished arrivals is written to disk, so that
    /// the last list is the one written last.
    finished_written: Mutex<()>,
    /// When the bytes the arrivals read so far are paid for under the
    /// node's bandwidth (`cfg.transfer_bandwidth`, shared by all of them).
    paid_until: Mutex<Option<Instant>>,
}

/// Arrivals kept in the list once done.
const FINISHED_KEPT: usize = 32;

impl Arrivals {
    fn jobs(&self) -> std::sync::MutexGuard<'_, BTreeMap<VolumeId, Arc<Job>>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a free slot; false when the job is stopped meanwhile.
    fn take_slot(&self, max: usize, job: &Job) -> bool {
        let (m, cv) = &self.running;
        let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
        while *n >= max.max(1) {
            if job.stop.load(Ordering::Relaxed) {
                return false;
            }
            n = cv
                .wait_timeout(n, Duration::from_millis(200))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *n += 1;
        true
    }

    /// Keeps `done` in the list of arrivals that ended; the list as it is
    /// then.
    fn remember(&self, done: TransferStatus) -> Vec<TransferStatus> {
        let mut f = self.finished.lock().unwrap_or_else(|p| p.into_inner());
        f.retain(|s| s.transfer_id != done.transfer_id);
        f.push_back(done);
        while f.len() > FINISHED_KEPT {
            f.pop_front();
        }
        f.iter().cloned().collect()
    }

    /// Holds `job` back until `n` more bytes fit under `cap` bytes per
    /// second, counted together with every other arrival's: each piece books
    /// the time it costs after those booked before it.
    pub(super) fn pace(&self, cap: u64, n: u64, job: &Job) {
        if cap == 0 {
            return;
        }
        let until = {
            let mut paid = self.paid_until.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            let from = paid.map_or(now, |t| t.max(now));
            let until = from + Duration::from_secs_f64(n as f64 / cap as f64);
            *paid = Some(until);
            until
        };
        job.pause(until.saturating_duration_since(Instant::now()));
    }

    fn give_slot(&self) {
        let (m, cv) = &self.running;
        let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        cv.notify_all();
    }
}

/// Whether a volume planned as `plan` can take the data `from` sends: of
/// its kind, of the filesystem it asks for if it names one (it takes the
/// source's).
fn fits_source(plan: &mut Plan, from: &ArrivingFrom) -> Result<()> {
    match (from.tree.is_some(), plan.backing == Backing::Image) {
        (true, true) => Err(Error::invalid(
            "the content source is a directory: its copy is one too (kind=dir)",
        )),
        (false, false) => Err(Error::invalid(
            "the content source is an image: its copy is one too (kind=image)",
        )),
        _ => Ok(()),
    }?;
    if let (Some(want), Some(have)) = (&plan.fs_type, &from.fs_type) {
        if want != have && plan.fs_named {
            return Err(Error::invalid(format!(
                "the content source holds {have}, not the requested {want}"
            )));
        }
    }
    plan.fs_type = from.fs_type.clone();
    Ok(())
}

impl Controller {
    fn transfers_dir(&self) -> PathBuf {
        self.state.domain(Domain::Controller).join("transfers")
    }

    fn record_path(&self, id: VolumeId) -> PathBuf {
        self.transfers_dir().join(format!("{id}.json"))
    }

    pub(super) fn ledger_path(&self, id: VolumeId) -> PathBuf {
        self.transfers_dir().join(format!("{id}.ledger"))
    }

    pub(super) fn write_arrival(&self, rec: &ArrivalRecord) -> Result<()> {
        let json = serde_json::to_vec(rec).map_err(|e| Error::internal(e.to_string()))?;
        file::write_atomic(&self.record_path(rec.volume), &json)
            .context(|| format!("recording the arrival of volume {}", rec.volume))
    }

    fn read_arrival(&self, id: VolumeId) -> Option<ArrivalRecord> {
        serde_json::from_slice(&file::read(&self.record_path(id)).ok()?).ok()
    }

    /// Where the last arrivals that ended are listed, so that a look at the
    /// transfers after a restart still sees them done.
    fn arrived_path(&self) -> PathBuf {
        self.state.domain(Domain::Controller).join("arrived.json")
    }

    /// Keeps `done` among the arrivals that ended, here and on disk (best
    /// effort: the volume is whole whatever becomes of the list).
    pub(super) fn remember_arrival(&self, done: TransferStatus) {
        let _writing = self
            .arrivals
            .finished_written
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let list = self.arrivals.remember(done);
        let json = serde_json::to_vec(&list).unwrap_or_default();
        if let Err(e) = file::write_atomic(&self.arrived_path(), &json) {
            tracing::info!(error = %e, "the list of arrivals that ended is not kept on disk");
        }
    }

    /// At start: the arrivals that ended before, as the last process left
    /// the list.
    fn recall_arrivals(&self) {
        let list: Vec<TransferStatus> = file::read(&self.arrived_path())
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        for done in list {
            self.arrivals.remember(done);
        }
    }

    pub(super) fn remove_arrival(&self, id: VolumeId) -> Result<()> {
        let at = || format!("removing the arrival record of volume {id}");
        file::remove_file_if_exists(&self.ledger_path(id)).context(at)?;
        for p in self.pools.values() {
            file::remove_file_if_exists(&packed_path(p, id)).context(at)?;
        }
        file::remove_file_if_exists(&self.record_path(id)).context(at)?;
        Ok(())
    }

    /// Whether this node is on a mesh (its transfers started): its image
    /// data can then be restored or cloned on any other node of it.
    pub fn on_mesh(&self) -> bool {
        self.arrivals.sources.get().is_some()
    }

    /// The process's mesh gives the controller the way to reach the other
    /// nodes; arrivals recorded before start then go on.
    pub fn start_transfers(self: &Arc<Self>, sources: Sources) {
        if self.arrivals.sources.set(sources).is_err() {
            return;
        }
        self.retry_noted_releases();
        for e in dir::list_if_exists(&self.transfers_dir()).unwrap_or_default() {
            let Some(id) = e.name.strip_suffix(".json").and_then(VolumeId::parse) else {
                continue;
            };
            if let Some(mut rec) = self.read_arrival(id) {
                if rec.entries > 0 || rec.progress > 0 {
                    // It goes on from a checkpoint an earlier process made.
                    rec.resumed += 1;
                }
                self.spawn_arrival(rec);
            }
        }
    }

    /// CreateVolume of a volume whose data comes from another node: the
    /// volume is made here at once, empty (or from the replica of an earlier
    /// transfer of the same volume) and marked as arriving; its data follows.
    /// A retry finds the same volume, and its transfer going on.
    pub fn create_arriving_volume(
        self: &Arc<Self>,
        req: CreateVolume,
        from: ArrivingFrom,
    ) -> Result<VolumeRecord> {
        let mut plan = self.plan_volume(&req)?;
        fits_source(&mut plan, &from)?;
        let id = VolumeId::for_name(&req.name);
        let _guard = self.locks.try_lock([LockKey::Volume(id)])?;
        if let Some(existing) = self.volumes.get(id) {
            if existing.state == RecordState::Ready {
                return self.same_volume(existing, &req, &plan.params, plan.backing);
            }
            self.roll_back_volume(&existing)?;
        }
        let size = self.size_in_pool(req.capacity, &plan, from.tree.unwrap_or(from.size))?;
        if from.tree.is_some() {
            // The packed tree waits in the pool until it is unpacked.
            let (available, _) = self.templates.space_for(&plan.pool, from.size)?;
            if from.size > available {
                return Err(Error::ResourceExhausted(format!(
                    "pool {} has {available} bytes free; the directory's {} bytes of data \
                     need to arrive there first",
                    plan.pool.name, from.size
                )));
            }
        }
        let record = VolumeRecord {
            id,
            name: req.name.clone(),
            pool: plan.pool.name.clone(),
            backing: plan.backing,
            size,
            fs_type: plan.fs_type.clone(),
            capabilities: req.capabilities.clone(),
            parameters: req.parameters.clone(),
            mutable_parameters: req.mutable_parameters.clone(),
            source: None,
            created: Timestamp::now(),
            state: RecordState::Ready,
            pending_size: None,
            published: BTreeMap::new(),
            ephemeral: false,
            requested: from
                .requested
                .or(requested_below(req.capacity.required, size)),
        };
        self.make_arriving_volume(record, &plan.pool, &from)
    }

    /// The volume of `record`, made arriving from `from`, its transfer
    /// started; nothing of it left when it cannot be.
    fn make_arriving_volume(
        self: &Arc<Self>,
        record: VolumeRecord,
        pool: &crate::pool::Pool,
        from: &ArrivingFrom,
    ) -> Result<VolumeRecord> {
        let id = record.id;
        let volume = self.state.lock_volume(id)?;
        self.remove_volume_data(id, false)?;
        self.remove_arrival(id)?;
        let made = self.make_arriving(&record, pool, from);
        let arrival = match made {
            Ok(a) => a,
            Err(e) => {
                let undo = self
                    .remove_arrival(id)
                    .and_then(|()| self.roll_back_volume(&record))
                    .and_then(|()| volume.remove());
                return Err(e.with_cleanup(undo));
            }
        };
        self.volumes.put(&record)?;
        tracing::info!(volume.id = %id, name = %record.name, source = %from.node,
            transfer = %from.transfer_id, incremental = arrival.base.is_some(),
            "volume created; its data is arriving");
        self.spawn_arrival(arrival);
        Ok(record)
    }

    /// The image of an arriving volume, marked, and its arrival record.
    fn make_arriving(
        &self,
        rec: &VolumeRecord,
        pool: &crate::pool::Pool,
        from: &ArrivingFrom,
    ) -> Result<ArrivalRecord> {
        if from.tree.is_some() {
            return self.make_arriving_tree(rec, pool, from);
        }
        let path = pool.volume_path(rec.id, Backing::Image, false);
        let at = || format!("making volume {} at {}", rec.id, path.display());
        let replica = self.replica_of(pool, &from.node, &from.source_volume);
        let base = match &replica {
            Some((img, r)) if file::copy_file(img, &path).is_ok() => Some(r.transfer_id.clone()),
            _ => {
                file::remove_file_if_exists(&path).context(at)?;
                file::create_sparse(&path, rec.size).context(at)?;
                None
            }
        };
        file::grow(&path, rec.size).context(at)?;
        for (name, value) in crate::core::blank::attributes(rec) {
            csi_sys::xattr::set(&path, &name, &value).context(at)?;
        }
        arrival::mark(&path, &from.node)?;
        self.record_new_arrival(rec, from, base)
    }

    /// A directory volume, empty and marked, and the file its packed tree
    /// arrives in, in the pool's hidden folder `.arriving/`.
    fn make_arriving_tree(
        &self,
        rec: &VolumeRecord,
        pool: &crate::pool::Pool,
        from: &ArrivingFrom,
    ) -> Result<ArrivalRecord> {
        let path = pool.volume_path(rec.id, rec.backing, false);
        let at = || format!("making volume {} at {}", rec.id, path.display());
        self.make_volume_data(pool, rec, None)?;
        arrival::mark(&path, &from.node)?;
        let packed = packed_path(pool, rec.id);
        file::mkdir_p_mode(&pool.root.join(ARRIVING), 0o700).context(at)?;
        file::remove_file_if_exists(&packed).context(at)?;
        file::create_sparse(&packed, from.size).context(at)?;
        self.record_new_arrival(rec, from, None)
    }

    fn record_new_arrival(
        &self,
        rec: &VolumeRecord,
        from: &ArrivingFrom,
        base: Option<String>,
    ) -> Result<ArrivalRecord> {
        let at = || format!("recording the arrival of volume {}", rec.id);
        file::mkdir_p_mode(&self.transfers_dir(), 0o700).context(at)?;
        let arrival = ArrivalRecord {
            volume: rec.id,
            transfer_id: from.transfer_id.clone(),
            source_node: from.node.clone(),
            source_volume: from.source_volume.clone(),
            size: from.size,
            progress: 0,
            entries: 0,
            base,
            started: Timestamp::now(),
            resumed: 0,
            claim: from.claim.clone(),
            read_token: from.read_token.clone(),
            tree: from.tree.is_some(),
        };
        AppendFile::create(&self.ledger_path(rec.id)).context(at)?;
        self.write_arrival(&arrival)?;
        Ok(arrival)
    }

    fn spawn_arrival(self: &Arc<Self>, rec: ArrivalRecord) {
        if self.arrivals.sources.get().is_none() {
            // Started once the mesh is up (start_transfers).
            return;
        }
        let mut jobs = self.arrivals.jobs();
        if jobs.contains_key(&rec.volume) {
            return;
        }
        let job = Arc::new(Job {
            stop: AtomicBool::new(false),
            deleted: AtomicBool::new(false),
            status: Mutex::new(TransferStatus {
                transfer_id: rec.transfer_id.clone(),
                role: "arriving".into(),
                volume_id: rec.volume.to_string(),
                peer_node: rec.source_node.clone(),
                state: "queued".into(),
                bytes_done: rec.progress,
                bytes_total: rec.size,
                incremental: rec.base.is_some(),
                claim: rec.claim.clone(),
                resumed: rec.resumed,
                ..Default::default()
            }),
            ended: (Mutex::new(false), Condvar::new()),
        });
        jobs.insert(rec.volume, job.clone());
        drop(jobs);
        let c = self.clone();
        let spawned = std::thread::Builder::new()
            .name("transfer".into())
            .spawn(move || {
                let ended = job.clone();
                // The controller is let go before the end is told: a waiting
                // shutdown then finds no thread holding it.
                c.run_arrival(job, rec);
                ended.end();
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "no thread for a transfer; it goes on at the next start");
        }
    }

    fn run_arrival(self: Arc<Self>, job: Arc<Job>, mut rec: ArrivalRecord) {
        let id = rec.volume;
        if self.arrivals.take_slot(self.cfg.max_transfers, &job) {
            let mut backoff = Duration::from_secs(1);
            while !job.stop.load(Ordering::Relaxed) {
                // A bug in one transfer costs that try, not the thread: the
                // transfer waits and goes on like one cut by the network.
                let once = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.arrive_once(&job, &mut rec)
                }))
                .unwrap_or_else(|_| Err(Error::internal("the transfer's thread panicked")));
                match once {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(volume.id = %id, transfer = %rec.transfer_id,
                            source = %rec.source_node, error = %e, retry_in = ?backoff,
                            "transfer interrupted; it goes on from its last checkpoint");
                        job.set(|s| {
                            s.state = "waiting".into();
                            s.message = e.to_string();
                        });
                        rec.resumed += 1;
                        job.pause(backoff);
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
            self.arrivals.give_slot();
        }
        if job.deleted.load(Ordering::Relaxed) {
            // Stopped by a delete of the volume: the source may let its hold
            // go (noted first: the delete removes the record next).
            match self.note_release(&rec, false) {
                Ok(note) => self.tell_release(note, None),
                Err(e) => tracing::warn!(transfer = %rec.transfer_id, error = %e,
                    "the source's hold could not be released; it expires there"),
            }
        }
        self.arrivals.jobs().remove(&id);
    }

    /// Whether the data of volume `id` is still on its way here: its
    /// transfer runs, or waits to.
    pub fn is_arriving(&self, id: VolumeId) -> bool {
        self.arrivals.jobs().contains_key(&id) || self.read_arrival(id).is_some()
    }

    /// DeleteVolume of a volume still arriving: its transfer is stopped (the
    /// source's hold released) and its record removed.
    pub(crate) fn stop_arrival(&self, id: VolumeId) -> Result<()> {
        let job = self.arrivals.jobs().get(&id).cloned();
        if let Some(job) = job {
            job.deleted.store(true, Ordering::Relaxed);
            job.stop.store(true, Ordering::Relaxed);
            if !job.wait(Duration::from_secs(10)) {
                tracing::warn!(volume.id = %id,
                    "the transfer did not stop within 10 s; the volume goes anyway");
            }
        }
        self.remove_arrival(id)
    }

    /// The process ends: every transfer stops at its next piece (each goes on
    /// from its last checkpoint at the next start).
    pub fn stop_transfers(&self) {
        let jobs: Vec<Arc<Job>> = self.arrivals.jobs().values().cloned().collect();
        for j in &jobs {
            j.stop.store(true, Ordering::Relaxed);
        }
        for j in jobs {
            if !j.wait(Duration::from_secs(10)) {
                tracing::warn!("a transfer did not stop within 10 s");
            }
        }
    }

    /// At start: arrivals whose volume a crash left unmade are removed, and
    /// replicas past their age.
    pub(crate) fn recover_arrivals(&self) {
        self.recall_arrivals();
        for e in dir::list_if_exists(&self.transfers_dir()).unwrap_or_default() {
            let Some(id) = e.name.strip_suffix(".json").and_then(VolumeId::parse) else {
                continue;
            };
            if !self.volumes.contains(id) {
                if let Err(e) = self.remove_arrival(id) {
                    tracing::warn!(error = %e, "cannot remove an arrival left by a crash");
                }
            }
        }
        for p in self.pools.values() {
            let folder = p.root.join(ARRIVING);
            for e in dir::list_if_exists(&folder).unwrap_or_default() {
                let id = e.name.strip_suffix(".tree").and_then(VolumeId::parse);
                if id.is_some_and(|id| self.read_arrival(id).is_some()) {
                    continue;
                }
                if let Err(e) = file::remove_file_if_exists(&folder.join(&e.name)) {
                    tracing::warn!(error = %e, "cannot remove a packed tree left by a crash");
                }
            }
        }
        self.remove_old_replicas();
    }

    /// The transfers of this node: arrivals and holds.
    pub fn transfers(&self) -> Vec<TransferStatus> {
        let mut out: Vec<TransferStatus> =
            self.arrivals.jobs().values().map(|j| j.status()).collect();
        for e in dir::list_if_exists(&self.transfers_dir()).unwrap_or_default() {
            let Some(rec) = e
                .name
                .strip_suffix(".json")
                .and_then(VolumeId::parse)
                .and_then(|id| self.read_arrival(id))
            else {
                continue;
            };
            if !out.iter().any(|s| s.transfer_id == rec.transfer_id) {
                out.push(TransferStatus {
                    transfer_id: rec.transfer_id,
                    role: "arriving".into(),
                    volume_id: rec.volume.to_string(),
                    peer_node: rec.source_node,
                    state: "queued".into(),
                    bytes_done: rec.progress,
                    bytes_total: rec.size,
                    incremental: rec.base.is_some(),
                    claim: rec.claim,
                    resumed: rec.resumed,
                    ..Default::default()
                });
            }
        }
        let finished = self
            .arrivals
            .finished
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for f in finished {
            if !out.iter().any(|s| s.transfer_id == f.transfer_id) {
                out.push(f);
            }
        }
        for h in self.holds() {
            out.push(TransferStatus {
                transfer_id: h.transfer_id,
                role: "hold".into(),
                volume_id: h.source_volume.to_string(),
                peer_node: h.target_node,
                state: if h.base { "base" } else { "held" }.into(),
                bytes_total: h.size,
                ..Default::default()
            });
        }
        out
    }
}
