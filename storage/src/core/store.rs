//! The state store: the records of one kind, kept in memory in id order (every
//! operation O(log n), listings stable) and on disk as a snapshot plus a journal
//! (frames of [`crate::core::journal`]). Memory holds each record in its compact
//! binary form ([`Packed`]), a fraction of the size of the record with its
//! strings and collections; a read decodes the records it returns.
//!
//! ```text
//! <dir>/snapshot.N    every record as of the start of log.N (absent: none)
//! <dir>/packed.N      the same records in their packed form (absent: none)
//! <dir>/log.N ...     the changes since, one batch per write + fdatasync
//! ```
//!
//! The snapshot's records are JSON, readable by any version; parsing them is
//! most of a start's time. So a compaction also writes `packed.N`: the bytes
//! memory keeps for each record, sealed with the build's version and the
//! records' [`Record::PACKED_LAYOUT`], which a start takes into memory as they
//! are. A start reads the snapshot instead when the image is missing, damaged,
//! of another build or layout, or not of the snapshot beside it (its length).
//!
//! A change is durable before it is visible and before its caller goes on: the
//! caller's entry joins the next batch, and one caller (the leader) writes the
//! whole batch and syncs it once for everyone in it (group commit). When the
//! journal outgrows the snapshot a background thread moves writes to a new
//! journal, then writes the records in memory (each durable already) into a new
//! snapshot (temporary file, fsync, rename, directory fsync) a chunk at a time,
//! so no caller waits for it and neither the old files nor a copy of the records
//! is held meanwhile; the new journal's replay settles any record changed while
//! it was written. Start-up reads one snapshot and one journal.
//!
//! A damaged entry is not a lost record: the file is kept as `<file>.corrupt`,
//! the entry's id (or, when even that is lost, every id) is quarantined, so the
//! data it describes is never taken for an orphan. A store of the older layout
//! (one `<id>.json` per record) is converted when opened.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::io::Write;
use std::ops::{Bound, ControlFlow};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, RwLock};
use std::thread::JoinHandle;

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use csi_sys::file::{self, AppendFile};

use crate::core::journal::{self, Entry, Kind};
use crate::error::{Context, Error, Result};
use crate::failpoint;

/// A record's serde must write every field (no `skip_serializing_if`): memory
/// keeps it in a form whose fields are known by their order, not their names.
pub trait Record: Serialize + DeserializeOwned + Clone + Send + Sync + 'static {
    type Id: Ord + Copy + Display + Send + Sync + 'static;
    /// The version of the record's packed form: raised with every change of its
    /// fields or of their types, so that a start never reads a packed image
    /// written by a build whose records had other fields (the test
    /// `packed_forms_are_pinned` fails until it is).
    const PACKED_LAYOUT: u32;
    fn id(&self) -> Self::Id;
    /// The id its `Display` wrote.
    fn parse_id(s: &str) -> Option<Self::Id>;
    /// False while the record says an operation on it is unfinished: what
    /// start-up looks at ([`Store::unsettled`]) without decoding every record.
    fn settled(&self) -> bool {
        true
    }
}

/// Called before a snapshot drops the journals it folds, with the ids of the
/// records those journals made: whatever recovery would make again for them
/// from the journal must be made durable first.
pub type Barrier = Box<dyn Fn(&[String]) -> Result<()> + Send + Sync>;

/// Records decoded (for a caller walking them all) or written (by a
/// compaction) per hold of the read lock: a writer waits for one chunk at most.
const CHUNK: usize = 512;

/// Ids handed to the compaction barrier per call (each call makes their data
/// durable, with an fsync each and one of their folder or with one syncfs).
const BARRIER_PART: usize = 1024;

/// Entries a start may parse beyond twice the live records before the removals
/// that left them are compacted away.
const SMALL_STORE: u64 = 1024;

/// When to compact, and where.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// The journal is folded into a snapshot once it holds this many bytes and
    /// as many entries as a quarter of the live records: rewriting the snapshot
    /// costs each change about four records' worth of writing, whatever their
    /// number, and start-up parses at most about 1.25 entries per live record
    /// (also after many removals, which shrink the snapshot's due size).
    pub compact_at: u64,
    /// Compacts on the path of the call that crosses the threshold rather than
    /// in the background (the power-loss test, for a replayable order).
    pub inline: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            compact_at: 1 << 20,
            inline: false,
        }
    }
}

#[cfg(test)]
thread_local! {
    /// The tuning of the stores this thread opens, for tests.
    pub(crate) static TEST_TUNING: std::cell::Cell<Option<Tuning>> =
        const { std::cell::Cell::new(None) };
}

pub struct Store<R: Record> {
    inner: Arc<Inner<R>>,
}

/// Another handle on the same store.
impl<R: Record> Clone for Store<R> {
    fn clone(&self) -> Self {
        self.inner.handles.fetch_add(1, Ordering::Relaxed);
        Store {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<R: Record> {
    dir: PathBuf,
    records: RwLock<BTreeMap<R::Id, Packed>>,
    /// The ids of records not [`Record::settled`]; changed with the map, under
    /// its write lock.
    unsettled: Mutex<BTreeSet<R::Id>>,
    quarantined: BTreeSet<String>,
    /// Records were lost whose ids are unknown: all data is kept.
    blind: bool,
    /// Records the journals made, as loaded at open.
    born: Vec<R::Id>,
    log: Mutex<Log<R>>,
    changed: Condvar,
    barrier: OnceLock<Barrier>,
    compactor: Mutex<Option<JoinHandle<()>>>,
    /// The `Store` handles on it: when the last goes, the store is closing.
    handles: AtomicUsize,
    /// The store is closing: a running compaction gives up at its next step
    /// (what it leaves, the next open removes or reads as a crash's).
    closing: AtomicBool,
    tuning: Tuning,
    #[cfg(test)]
    gate: (Mutex<bool>, Condvar),
    /// Called after each chunk a compaction writes, with its number.
    #[cfg(test)]
    chunk_hook: ChunkHook,
    /// Whether open read the packed image rather than the snapshot.
    #[cfg(test)]
    from_image: bool,
}

#[cfg(test)]
type ChunkHook = Mutex<Option<Box<dyn FnMut(usize) + Send>>>;

struct Log<R: Record> {
    file: Arc<AppendFile>,
    gen: u64,
    /// Durable length of `file`.
    len: u64,
    /// Entries in `file`.
    entries: u64,
    queue: Vec<Pending<R>>,
    writing: bool,
    next_batch: u64,
    /// The journal the next batch goes to, made ready by a compaction.
    next_file: Option<(u64, AppendFile)>,
    compacting: bool,
    /// Generation of the newest snapshot (0 for none).
    snapshot: u64,
    /// Records in that snapshot: what a start parses besides the journal.
    snapshot_entries: u64,
    /// A write failed and could not be undone: nothing more is written.
    broken: Option<String>,
    batches: u64,
    /// The records each journal made (its generation, the id), until a
    /// compaction folds that journal: what the barrier is given.
    born: Vec<(u64, R::Id)>,
}

enum Op<R: Record> {
    /// The record, packed, and whether it is settled.
    Put(R::Id, Packed, bool),
    Remove(R::Id),
}

/// A record as memory keeps it: its postcard encoding, about a fifth of the
/// decoded record with its strings, maps and lists (each their own allocation).
struct Packed(Box<[u8]>);

impl Packed {
    fn of<R: Serialize>(record: &R) -> std::result::Result<Packed, String> {
        postcard::to_allocvec(record)
            .map(|v| Packed(v.into_boxed_slice()))
            .map_err(|e| format!("encoding the record for memory: {e}"))
    }

    /// The record. Every packed record was encoded from one of the same type by
    /// this process, so this fails only on a defect; the record is then left
    /// out of what is read (its data is never taken for an orphan: the map
    /// still holds its id).
    fn open<R: Record>(&self) -> Option<R> {
        unpack(&self.0)
    }
}

/// A packed record read as `V`: the record's own type, or a view of it that
/// borrows from `bytes` (such as `VolumeView`). Fails only on a defect (see
/// `Packed::open`), which is logged.
pub fn unpack<'a, V: Deserialize<'a>>(bytes: &'a [u8]) -> Option<V> {
    match postcard::from_bytes(bytes) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::error!(error = %e, "a record in memory cannot be decoded");
            None
        }
    }
}

/// A queued change's caller: the batch's outcome, set once by the leader that
/// wrote it, and the thread to wake then (or to ask to lead the next batch).
struct Waiter {
    outcome: OnceLock<std::result::Result<(), String>>,
    /// Set when the caller is to lead the next batch (no batch is being written).
    lead: AtomicBool,
    thread: std::thread::Thread,
}

type Outcome = Arc<Waiter>;

impl Waiter {
    fn new() -> Outcome {
        Arc::new(Waiter {
            outcome: OnceLock::new(),
            lead: AtomicBool::new(false),
            thread: std::thread::current(),
        })
    }

    /// Parks until the outcome is set or the caller is asked to lead.
    fn park(&self) {
        while self.outcome.get().is_none() && !self.lead.swap(false, Ordering::AcqRel) {
            std::thread::park();
        }
    }
}

struct Pending<R: Record> {
    op: Op<R>,
    kind: Kind,
    id: String,
    payload: Vec<u8>,
    done: Outcome,
}

fn log_name(gen: u64) -> String {
    format!("log.{gen}")
}
fn snapshot_name(gen: u64) -> String {
    format!("snapshot.{gen}")
}
fn image_name(gen: u64) -> String {
    format!("packed.{gen}")
}

/// The files of a store directory, by kind.
#[derive(Default)]
struct Listing {
    snapshots: BTreeSet<u64>,
    images: BTreeSet<u64>,
    logs: BTreeSet<u64>,
    /// Records of the older layout.
    legacy: Vec<String>,
    /// Damaged files set aside: of this layout (journals, snapshots) and stems of
    /// the older one.
    corrupt: Vec<String>,
    legacy_corrupt: BTreeSet<String>,
}

impl Listing {
    fn read(dir: &Path) -> Result<Listing> {
        let mut l = Listing::default();
        let entries = std::fs::read_dir(dir)
            .map_err(|e| Error::internal(format!("reading {}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let gen = |prefix: &str| generation(&name, prefix);
            if name.starts_with('.') {
                // A temporary file of a write a crash interrupted: the rename never
                // happened, so what it was to replace is still whole.
                if name.ends_with(".tmp") {
                    let _ = file::remove_file_if_exists(&entry.path());
                    tracing::info!(path = %entry.path().display(), "removed an interrupted write");
                }
            } else if let Some(g) = gen("snapshot.") {
                l.snapshots.insert(g);
            } else if let Some(g) = gen("log.") {
                l.logs.insert(g);
            } else if let Some(g) = gen("packed.") {
                l.images.insert(g);
            } else if let Some(stem) = name.strip_suffix(".corrupt") {
                if stem.starts_with("log.") || stem.starts_with("snapshot.") {
                    l.corrupt.push(name);
                } else {
                    l.legacy_corrupt.insert(stem.to_string());
                }
            } else if name.ends_with(".json") {
                l.legacy.push(name);
            }
        }
        Ok(l)
    }
}

/// What the files of a store say about their entries, besides the entries.
#[derive(Default)]
struct Replay {
    /// Ids with a damaged entry.
    unreadable: BTreeSet<String>,
    blind: bool,
    last_batch: u64,
    /// Entries in the journals.
    logged: u64,
}

/// Reads `snapshot.base` (if any) and the journals `logs`, in order: each
/// file's name and bytes.
fn read_files(dir: &Path, base: Option<u64>, logs: &[u64]) -> Result<Vec<(String, Vec<u8>)>> {
    let mut bufs = Vec::new();
    for name in base
        .map(snapshot_name)
        .into_iter()
        .chain(logs.iter().map(|g| log_name(*g)))
    {
        let path = dir.join(&name);
        let bytes = std::fs::read(&path)
            .map_err(|e| Error::internal(format!("reading {}: {e}", path.display())))?;
        bufs.push((name, bytes));
    }
    Ok(bufs)
}

/// The frames of files [`read_files`] read, with each file's name and whether it
/// is a journal.
fn scan_files(bufs: &[(String, Vec<u8>)]) -> Vec<(String, bool, journal::Scan<'_>)> {
    bufs.iter()
        .map(|(name, bytes)| {
            let is_log = name.starts_with("log.");
            (name.clone(), is_log, journal::scan(bytes, is_log))
        })
        .collect()
}

/// Removes what a compaction that finished left behind (files older than
/// generation `from`, packed images of other snapshots than the newest), and
/// records of the older layout a finished conversion had not removed yet.
fn remove_stale(dir: &Path, listing: &Listing, from: u64) -> Result<()> {
    let stale = listing
        .snapshots
        .range(..from)
        .map(|g| snapshot_name(*g))
        .chain(listing.logs.range(..from).map(|g| log_name(*g)))
        .chain(
            listing
                .images
                .iter()
                .filter(|g| **g != from)
                .map(|g| image_name(*g)),
        )
        .chain(listing.legacy.iter().cloned());
    for name in stale {
        file::remove_file_if_exists(&dir.join(&name)).context(|| format!("removing {name}"))?;
    }
    Ok(())
}

/// Opens the newest journal `newest` (`len` is its length; `end` says where
/// its last whole batch ends when something follows: cut off when it is a torn
/// write, kept as room for appends when it is zeros), or makes journal `from`
/// when there is none. Returns it with its generation and durable length.
fn open_journal(
    dir: &Path,
    newest: Option<u64>,
    from: u64,
    len: u64,
    end: Option<(u64, bool)>,
) -> Result<(AppendFile, u64, u64)> {
    let Some(g) = newest else {
        let path = dir.join(log_name(from));
        let f = AppendFile::create(&path).context(|| format!("making {}", path.display()))?;
        return Ok((f, from, 0));
    };
    let path = dir.join(log_name(g));
    let f = AppendFile::open(&path).context(|| format!("opening {}", path.display()))?;
    match end {
        Some((valid, true)) => {
            tracing::info!(path = %path.display(), bytes = len - valid,
                "cut an unacknowledged write off the journal");
            f.truncate(valid)
                .context(|| format!("truncating {}", path.display()))?;
            Ok((f, g, valid))
        }
        Some((valid, false)) => Ok((f, g, valid)),
        None => Ok((f, g, len)),
    }
}

impl Replay {
    /// What the scanned files say besides their entries; sets damaged files
    /// aside. Also returns where the newest journal's last whole batch ends,
    /// when something follows it, and whether that is a torn write (or only
    /// the zeros of its room for appends).
    fn tally(
        dir: &Path,
        bufs: &[(String, Vec<u8>)],
        scans: &[(String, bool, journal::Scan<'_>)],
    ) -> (Replay, Option<(u64, bool)>) {
        let mut replay = Replay::default();
        let mut end = None;
        for (i, (name, is_log, scan)) in scans.iter().enumerate() {
            if !scan.damage.is_empty() {
                set_aside(dir, name, &bufs[i].1, &scan.damage);
            }
            if *is_log && i + 1 == scans.len() && scan.valid_len < bufs[i].1.len() {
                end = Some((scan.valid_len as u64, !scan.zero_tail));
            }
            replay.blind |= scan.blind;
            if *is_log {
                replay.logged += scan.entries.len() as u64;
                let last = scan.entries.iter().map(|e| e.batch).max();
                replay.last_batch = replay.last_batch.max(last.unwrap_or(0));
            }
        }
        (replay, end)
    }

    /// Files set aside earlier: their damaged entries stay quarantined.
    fn note_set_aside(&mut self, dir: &Path, corrupt: &[String]) {
        for name in corrupt {
            let Ok(bytes) = std::fs::read(dir.join(name)) else {
                continue;
            };
            let scan = journal::scan(&bytes, name.starts_with("log."));
            self.blind |= scan.blind;
            self.unreadable.extend(
                scan.entries
                    .iter()
                    .filter(|e| e.kind == Kind::Unreadable)
                    .map(|e| e.id.to_string()),
            );
        }
    }
}

impl<R: Record> Store<R> {
    /// Opens (making it if needed) the store in `dir` and loads every record;
    /// converts a store of the older layout first.
    pub fn open(dir: &Path) -> Result<Self> {
        #[cfg(test)]
        if let Some(t) = TEST_TUNING.with(|t| t.get()) {
            return Self::open_with(dir, t);
        }
        Self::open_with(dir, Tuning::default())
    }

    pub fn open_with(dir: &Path, tuning: Tuning) -> Result<Self> {
        file::mkdir_p_mode(dir, 0o700).context(|| format!("making {}", dir.display()))?;
        let mut listing = Listing::read(dir)?;
        if listing.snapshots.is_empty() && !listing.legacy.is_empty() {
            migrate::<R>(dir, &listing)?;
            listing = Listing::read(dir)?;
        }
        let base = listing.snapshots.iter().next_back().copied();
        let from = base.unwrap_or(0);
        remove_stale(dir, &listing, from)?;
        let logs: Vec<u64> = listing.logs.range(from..).copied().collect();

        let started = std::time::Instant::now();
        let image = base.and_then(|g| read_image::<R>(dir, g));
        let from_image = image.is_some();
        let snapshot = if from_image { None } else { base };
        let bufs = read_files(dir, snapshot, &logs)?;
        let read = started.elapsed();
        let scans = scan_files(&bufs);
        let scanned = started.elapsed();
        let snapshot_entries = match &image {
            Some(i) => i.records.len() as u64,
            None => scans
                .iter()
                .filter(|(_, is_log, _)| !is_log)
                .map(|(_, _, scan)| scan.entries.len() as u64)
                .sum(),
        };
        let (mut replay, journal_end) = Replay::tally(dir, &bufs, &scans);
        replay.note_set_aside(dir, &listing.corrupt);
        let loaded = Loaded::<R>::from_scans(image, &scans);
        tracing::debug!(dir = %dir.display(), records = loaded.records.len(), from_image,
            read_ms = read.as_secs_f64() * 1e3, scanned_ms = scanned.as_secs_f64() * 1e3,
            parsed_ms = started.elapsed().as_secs_f64() * 1e3, "store loaded");
        let Loaded {
            records,
            unsettled,
            born,
            unreadable,
        } = loaded;
        replay.unreadable.extend(unreadable);
        let mut quarantined = listing.legacy_corrupt;
        quarantined.extend(
            replay
                .unreadable
                .into_iter()
                .filter(|id| R::parse_id(id).is_none_or(|k| !records.contains_key(&k))),
        );
        for id in &quarantined {
            tracing::error!(dir = %dir.display(), id, "record unreadable; its data is kept");
        }
        if replay.blind {
            tracing::error!(dir = %dir.display(),
                "records of unknown ids were lost; no data of this store is taken for an orphan");
        }

        let logged = replay.logged;
        let last_len = bufs.last().map_or(0, |b| b.1.len()) as u64;
        let (file, gen, len) =
            open_journal(dir, logs.last().copied(), from, last_len, journal_end)?;
        let born: Vec<R::Id> = born.into_iter().collect();
        let journal_born = born.iter().map(|id| (gen, *id)).collect();
        let (blind, next_batch) = (replay.blind, replay.last_batch + 1);
        drop(scans);
        drop(bufs);
        Ok(Store {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                records: RwLock::new(records),
                unsettled: Mutex::new(unsettled),
                quarantined,
                blind,
                born,
                log: Mutex::new(Log {
                    file: Arc::new(file),
                    gen,
                    len,
                    entries: logged,
                    queue: Vec::new(),
                    writing: false,
                    next_batch,
                    next_file: None,
                    compacting: false,
                    snapshot: from,
                    snapshot_entries,
                    broken: None,
                    batches: 0,
                    born: journal_born,
                }),
                changed: Condvar::new(),
                barrier: OnceLock::new(),
                compactor: Mutex::new(None),
                handles: AtomicUsize::new(1),
                closing: AtomicBool::new(false),
                tuning,
                #[cfg(test)]
                gate: (Mutex::new(true), Condvar::new()),
                #[cfg(test)]
                chunk_hook: Mutex::new(None),
                #[cfg(test)]
                from_image,
            }),
        })
    }

    pub fn get(&self, id: R::Id) -> Option<R> {
        self.inner.read().get(&id).and_then(Packed::open)
    }

    /// Writes the record durably, then makes it visible.
    pub fn put(&self, record: &R) -> Result<()> {
        let payload = serde_json::to_vec(record)
            .map_err(|e| Error::internal(format!("encoding record: {e}")))?;
        let packed = Packed::of(record).map_err(Error::internal)?;
        self.inner.commit(Pending {
            kind: Kind::Put,
            id: record.id().to_string(),
            payload,
            op: Op::Put(record.id(), packed, record.settled()),
            done: Waiter::new(),
        })
    }

    /// Removes the record durably. Also when it is not there: an earlier attempt
    /// may have removed it from memory only, its write having failed.
    pub fn remove(&self, id: R::Id) -> Result<()> {
        self.inner.commit(Pending {
            kind: Kind::Remove,
            id: id.to_string(),
            payload: Vec::new(),
            op: Op::Remove(id),
            done: Waiter::new(),
        })
    }

    pub fn contains(&self, id: R::Id) -> bool {
        self.inner.read().contains_key(&id)
    }

    /// The records that are not [`Record::settled`], in id order: found without
    /// decoding the others.
    pub fn unsettled(&self) -> Vec<R> {
        let map = self.inner.read();
        let ids = self
            .inner
            .unsettled
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        ids.iter()
            .filter_map(|id| map.get(id).and_then(Packed::open))
            .collect()
    }

    /// The records `filter` picks, in id order.
    pub fn select(&self, filter: impl Fn(&R) -> bool) -> Vec<R> {
        let mut out = Vec::new();
        self.visit(None, |r| {
            if filter(&r) {
                out.push(r);
            }
            ControlFlow::Continue(())
        });
        out
    }

    /// Calls `f` with every record after `after` (all when None) in id order
    /// until it breaks, decoding a chunk at a time under the read lock and
    /// calling `f` outside it: no copy of all the records is made, `f` may take
    /// its time, and a writer waits for one chunk at most. A record changed
    /// meanwhile is seen as it was or as it is.
    pub fn visit(&self, mut after: Option<R::Id>, mut f: impl FnMut(R) -> ControlFlow<()>) {
        loop {
            let (chunk, more) = self.page(after, CHUNK, |_| true);
            after = chunk.last().map(R::id);
            for r in chunk {
                if f(r).is_break() {
                    return;
                }
            }
            if !more {
                return;
            }
        }
    }

    pub fn len(&self) -> usize {
        self.inner.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.read().is_empty()
    }

    pub fn all(&self) -> Vec<R> {
        self.select(|_| true)
    }

    /// Up to `max` records (all when 0) with ids after `after`, in id order, and
    /// whether more follow.
    pub fn page(
        &self,
        after: Option<R::Id>,
        max: usize,
        filter: impl Fn(&R) -> bool,
    ) -> (Vec<R>, bool) {
        self.page_packed(after, max, |packed| {
            unpack::<R>(packed).filter(|r| filter(r))
        })
    }

    /// Like `page`, with each record read from its packed form by `read` (with
    /// `unpack`, as a view that borrows from it), which leaves it out with
    /// None. `read` runs under the read lock.
    pub fn page_packed<T>(
        &self,
        after: Option<R::Id>,
        max: usize,
        mut read: impl FnMut(&[u8]) -> Option<T>,
    ) -> (Vec<T>, bool) {
        let map = self.inner.read();
        let lower = match after {
            Some(id) => Bound::Excluded(id),
            None => Bound::Unbounded,
        };
        let mut out = Vec::new();
        for (_, p) in map.range((lower, Bound::Unbounded)) {
            let Some(t) = read(&p.0) else { continue };
            if max > 0 && out.len() == max {
                return (out, true);
            }
            out.push(t);
        }
        (out, false)
    }

    /// Whether data named `stem` may belong to a record that could not be read.
    pub fn is_quarantined(&self, stem: &str) -> bool {
        self.inner.blind || self.inner.quarantined.contains(stem)
    }

    /// The records that the journals, as loaded at open, made (rather than the
    /// snapshot): those whose data a power loss may have taken since.
    pub fn created_in_journal(&self) -> Vec<R::Id> {
        self.inner.born.clone()
    }

    /// Sets what a compaction does before it drops journals (once, before the
    /// first change).
    pub fn set_compaction_barrier(&self, barrier: Barrier) {
        let _ = self.inner.barrier.set(barrier);
    }

    /// Starts a compaction in the background when one is due already, so that
    /// the next start does not parse again what many removals left (a compaction
    /// is otherwise only considered after a change). Call it once the store's
    /// barrier is set.
    pub fn compact_if_due(&self) {
        let live = self.inner.read().len() as u64;
        let due = {
            let mut st = self.inner.lock();
            self.inner.due(&mut st, live)
        };
        if due {
            self.inner.start_compaction();
        }
    }
}

impl<R: Record> Drop for Store<R> {
    fn drop(&mut self) {
        if self.inner.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
            // A stop need not wait for a compaction (the images the journals
            // made synced, then the whole snapshot): the journals it would
            // fold are kept, and the next one folds them.
            self.inner.closing.store(true, Ordering::Release);
        }
        let running = self.inner.compactor.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = running {
            let _ = h.join();
        }
    }
}

impl<R: Record> Inner<R> {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<R::Id, Packed>> {
        self.records.read().unwrap_or_else(|p| p.into_inner())
    }
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<R::Id, Packed>> {
        self.records.write().unwrap_or_else(|p| p.into_inner())
    }
    fn lock(&self) -> MutexGuard<'_, Log<R>> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn wait<'a>(&self, g: MutexGuard<'a, Log<R>>) -> MutexGuard<'a, Log<R>> {
        self.changed.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    /// Queues the change and returns once the batch holding it is durable (and
    /// applied), leading that batch when no other caller is writing. A caller
    /// whose change waits sleeps on its own: the leader wakes each caller of its
    /// batch, and the first of the next when it is done, so that no caller wakes
    /// for another's batch or queues for the lock to learn that it is done.
    fn commit(self: &Arc<Self>, p: Pending<R>) -> Result<()> {
        let done = p.done.clone();
        let mut st = self.lock();
        if let Some(why) = &st.broken {
            return Err(Error::internal(format!(
                "the journal of {} cannot be written: {why}",
                self.dir.display()
            )));
        }
        st.queue.push(p);
        let outcome = || {
            done.outcome
                .get()
                .map(|o| o.clone().map_err(Error::internal))
        };
        loop {
            if let Some(outcome) = outcome() {
                return outcome;
            }
            if st.writing {
                drop(st);
                done.park();
                // Woken with the outcome, without the lock; or to lead.
                if let Some(outcome) = outcome() {
                    return outcome;
                }
                st = self.lock();
                continue;
            }
            let (next, compact) = self.lead(st);
            st = next;
            if compact {
                drop(st);
                self.start_compaction();
                st = self.lock();
            }
        }
    }

    /// Writes every queued entry as one batch, syncs it, applies it, and tells
    /// the callers. Returns whether a compaction is due.
    fn lead<'a>(&'a self, mut st: MutexGuard<'a, Log<R>>) -> (MutexGuard<'a, Log<R>>, bool) {
        st.writing = true;
        if let Some((gen, file)) = st.next_file.take() {
            st.file = Arc::new(file);
            st.gen = gen;
            st.len = 0;
            st.entries = 0;
            self.changed.notify_all();
        }
        let batch = std::mem::take(&mut st.queue);
        let batch_gen = st.gen;
        let number = st.next_batch;
        st.next_batch += 1;
        let (file, offset) = (st.file.clone(), st.len);
        drop(st);
        #[cfg(test)]
        {
            let (open, cv) = &self.gate;
            let mut g = open.lock().unwrap();
            while !*g {
                g = cv.wait(g).unwrap();
            }
        }
        let made = self.made_by(&batch);
        let mut buf = Vec::new();
        for (i, (p, made)) in batch.iter().zip(&made).enumerate() {
            journal::encode_frame(
                &mut buf,
                number,
                i + 1 == batch.len(),
                *made,
                p.kind,
                &p.id,
                &p.payload,
            );
        }
        let res = file
            .write_at(offset, &buf)
            .and_then(|()| file.sync_data())
            .map_err(|e| e.to_string());
        let mut st = self.lock();
        let mut applied = Vec::with_capacity(batch.len());
        let mut live = 0;
        match &res {
            Ok(()) => {
                st.len += buf.len() as u64;
                st.entries += batch.len() as u64;
                st.batches += 1;
                let mut map = self.write();
                let mut unsettled = self.unsettled.lock().unwrap_or_else(|p| p.into_inner());
                for (p, made) in batch.into_iter().zip(made) {
                    match p.op {
                        Op::Put(id, r, settled) => {
                            map.insert(id, r);
                            if made {
                                st.born.push((batch_gen, id));
                            }
                            mark(&mut unsettled, id, settled);
                        }
                        Op::Remove(id) => {
                            map.remove(&id);
                            unsettled.remove(&id);
                        }
                    }
                    applied.push(p.done);
                }
                live = map.len() as u64;
            }
            Err(e) => {
                // What may have reached the file is cut off again, so that the next
                // batch follows the last durable one.
                if let Err(e2) = file.truncate(offset) {
                    st.broken = Some(format!("{e}; undoing it: {e2}"));
                }
                applied.extend(batch.into_iter().map(|p| p.done));
            }
        }
        let me = std::thread::current().id();
        for done in applied {
            let _ = done.outcome.set(res.clone());
            if done.thread.id() != me {
                done.thread.unpark();
            }
        }
        st.writing = false;
        // The next batch's leader: the first caller queued meanwhile (a caller
        // that comes first takes the lead itself, and this one finds its change
        // written or waits again).
        if let Some(next) = st.queue.first() {
            next.done.lead.store(true, Ordering::Release);
            next.done.thread.unpark();
        }
        let due = res.is_ok() && self.due(&mut st, live);
        // A compaction waits for the batch to end to move to its new journal.
        self.changed.notify_all();
        (st, due)
    }

    /// For each change of `batch`, whether it is a put that makes its record
    /// (none is there before it, in memory or earlier in the batch). Only a
    /// leader changes the map, so what it holds now is what the batch follows.
    fn made_by(&self, batch: &[Pending<R>]) -> Vec<bool> {
        let map = self.read();
        let mut present: BTreeMap<R::Id, bool> = BTreeMap::new();
        batch
            .iter()
            .map(|p| match &p.op {
                Op::Put(id, _, _) => {
                    let before = present.insert(*id, true);
                    !before.unwrap_or_else(|| map.contains_key(id))
                }
                Op::Remove(id) => {
                    present.insert(*id, false);
                    false
                }
            })
            .collect()
    }

    /// Whether to compact now (and then marked as compacting): once the journal
    /// holds [`Tuning::compact_at`] bytes, or once a start would parse more than
    /// twice the live records (and [`SMALL_STORE`] more) because many were removed
    /// since the snapshot; and in both cases only with as many entries as a
    /// quarter of the live records, so that a compaction costs each change a few
    /// records' worth of writing.
    fn due(&self, st: &mut Log<R>, live: u64) -> bool {
        let parsed = st.snapshot_entries + st.entries;
        let due = !st.compacting
            && st.broken.is_none()
            && st.entries >= live / 4
            && (st.len >= self.tuning.compact_at || parsed > 2 * live + SMALL_STORE);
        if due {
            st.compacting = true;
        }
        due
    }

    fn start_compaction(self: &Arc<Self>) {
        if self.tuning.inline {
            self.run_compaction();
            return;
        }
        let mut slot = self.compactor.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = slot.take() {
            // Finished: `compacting` was set only after it ended.
            let _ = h.join();
        }
        let inner = self.clone();
        match std::thread::Builder::new()
            .name("store-compact".into())
            .spawn(move || inner.run_compaction())
        {
            Ok(h) => *slot = Some(h),
            Err(e) => {
                tracing::warn!(error = %e, "could not start a compaction");
                self.lock().compacting = false;
            }
        }
    }

    fn run_compaction(&self) {
        match self.compact() {
            Ok(()) => {}
            Err(e) if self.is_closing() => {
                tracing::info!(dir = %self.dir.display(), error = %e,
                    "compaction given up as the store closes; the journal is kept");
            }
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e,
                    "compaction failed; the journal is kept and compacted later");
            }
        }
        self.lock().compacting = false;
        // What its buffers, and the records removed since the last one, leave
        // free in the allocator's arenas goes back to the system.
        csi_sys::memory::release_free();
    }

    fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// An error once the store is closing, for a compaction to stop at.
    fn go_on(&self) -> Result<()> {
        if self.is_closing() {
            return Err(Error::Cancelled(format!(
                "the store in {} is closing",
                self.dir.display()
            )));
        }
        Ok(())
    }

    /// Moves writes to a new journal, then folds the snapshot and the journals
    /// before it into a new snapshot and removes them. A crash at any point
    /// leaves files that open reads back to the same records.
    fn compact(&self) -> Result<()> {
        let started = std::time::Instant::now();
        let gen = self.lock().gen + 1;
        let path = self.dir.join(log_name(gen));
        // An empty journal an earlier attempt made and never used.
        file::remove_file_if_exists(&path).context(|| format!("removing {}", path.display()))?;
        let next = AppendFile::create(&path).context(|| format!("making {}", path.display()))?;
        failpoint::hit("store.compact.after-new-log");
        {
            // The next leader switches, or this thread once no batch is being
            // written, whichever comes first.
            let mut st = self.lock();
            st.next_file = Some((gen, next));
            while st.gen != gen {
                if !st.writing {
                    if let Some((g, f)) = st.next_file.take() {
                        st.file = Arc::new(f);
                        st.gen = g;
                        st.len = 0;
                        st.entries = 0;
                    }
                    break;
                }
                st = self.wait(st);
            }
        }
        failpoint::hit("store.compact.after-rotate");
        let base = self.lock().snapshot;
        let listing = Listing::read(&self.dir)?;
        let logs: Vec<u64> = listing.logs.range(base..gen).copied().collect();
        let base_file = listing.snapshots.contains(&base).then_some(base);
        let born: Vec<String> = {
            let st = self.lock();
            let map = self.read();
            st.born
                .iter()
                .filter(|(g, id)| *g < gen && map.contains_key(id))
                .map(|(_, id)| id.to_string())
                .collect()
        };
        let barrier_started = std::time::Instant::now();
        if let Some(barrier) = self.barrier.get() {
            // A part at a time, so that a closing store is not kept waiting
            // for all of them.
            for part in born.chunks(BARRIER_PART) {
                self.go_on()?;
                barrier(part)?;
            }
        }
        let barrier_ms = barrier_started.elapsed().as_secs_f64() * 1000.0;
        let written = self.write_snapshot_of_memory(gen)?;
        failpoint::hit("store.compact.after-snapshot");
        {
            let mut st = self.lock();
            st.snapshot = gen;
            st.snapshot_entries = written;
            st.born.retain(|(g, _)| *g >= gen);
        }
        for name in base_file
            .into_iter()
            .flat_map(|g| [snapshot_name(g), image_name(g)])
            .chain(logs.iter().map(|g| log_name(*g)))
        {
            // Left behind, open removes it.
            let _ = file::remove_file_if_exists(&self.dir.join(name));
        }
        tracing::info!(dir = %self.dir.display(), records = written, born = born.len(),
            barrier_ms, took_ms = started.elapsed().as_secs_f64() * 1000.0, "compacted");
        Ok(())
    }
}

impl<R: Record> Inner<R> {
    /// Writes every record in memory into a new snapshot `snapshot.gen` and its
    /// packed image `packed.gen`, a few hundred at a time under the read lock, so
    /// that neither the files they replace nor a copy of the records is held,
    /// and a writer waits for one chunk at most. Each record in memory is durable
    /// already (a batch is applied once synced). Changes made meanwhile may or
    /// may not be in them: they are all in the journal the snapshot comes
    /// before, whose replay makes each record what its last entry says,
    /// whichever the snapshot holds. The snapshot is in place before the image
    /// (an image is only read beside its snapshot); an image that cannot be
    /// written costs only a slower start. Returns how many records they hold.
    fn write_snapshot_of_memory(&self, gen: u64) -> Result<u64> {
        let path = self.dir.join(snapshot_name(gen));
        let at = || format!("writing {}", path.display());
        let failed = |e: std::io::Error| Error::internal(format!("{}: {e}", at()));
        let mut snap = file::Replacement::create(&path).context(at)?;
        let image_path = self.dir.join(image_name(gen));
        let no_image = |e: &dyn Display| {
            tracing::warn!(path = %image_path.display(), error = %e,
                "no packed image of the snapshot; the next start parses it");
        };
        let mut image = file::Replacement::create(&image_path)
            .map_err(|e| no_image(&e))
            .ok();
        let mut written = 0u64;
        let mut buf = Vec::new();
        let mut packed = Vec::new();
        let mut after: Option<R::Id> = None;
        #[cfg(test)]
        let mut chunks = 0;
        loop {
            self.go_on()?;
            buf.clear();
            packed.clear();
            let mut last = None;
            {
                let map = self.read();
                let unsettled = self.unsettled.lock().unwrap_or_else(|p| p.into_inner());
                let chunk = match after {
                    Some(a) => map.range((Bound::Excluded(a), Bound::Unbounded)),
                    None => map.range(..),
                };
                for (id, p) in chunk.take(CHUNK) {
                    let record: R = p
                        .open()
                        .ok_or_else(|| Error::internal(format!("record {id} cannot be decoded")))?;
                    let payload = serde_json::to_vec(&record)
                        .map_err(|e| Error::internal(format!("encoding record {id}: {e}")))?;
                    let id = id.to_string();
                    journal::encode(&mut buf, 0, false, Kind::Put, &id, &payload);
                    if image.is_some() {
                        image_entry(&mut packed, &id, p, !unsettled.contains(&record.id()));
                    }
                    last = Some(record.id());
                    written += 1;
                }
            }
            let Some(last) = last else { break };
            snap.write_all(&buf).map_err(failed)?;
            if let Some(Err(e)) = image.as_mut().map(|f| f.write_all(&packed)) {
                no_image(&e);
                image = None;
            }
            after = Some(last);
            #[cfg(test)]
            if let Some(hook) = self.chunk_hook.lock().unwrap().as_mut() {
                hook(chunks);
            }
            #[cfg(test)]
            {
                chunks += 1;
            }
        }
        buf.clear();
        journal::encode(&mut buf, 0, true, Kind::End, "", b"");
        snap.write_all(&buf).map_err(failed)?;
        let snapshot_len = snap.written();
        snap.commit().context(at)?;
        if let Some(mut f) = image {
            packed.clear();
            image_seal::<R>(&mut packed, snapshot_len);
            match f.write_all(&packed) {
                Ok(()) => f.commit().unwrap_or_else(|e| no_image(&e)),
                Err(e) => no_image(&e),
            }
        }
        Ok(written)
    }
}

/// The flag of an image entry whose record is not settled.
const UNSETTLED: u8 = 1;

/// Appends the frame of one record to a packed image: a flags byte, then the
/// record as memory keeps it.
fn image_entry(out: &mut Vec<u8>, id: &str, packed: &Packed, settled: bool) {
    let mut payload = Vec::with_capacity(1 + packed.0.len());
    payload.push(if settled { 0 } else { UNSETTLED });
    payload.extend_from_slice(&packed.0);
    journal::encode(out, 0, false, Kind::Put, id, &payload);
}

/// What an image of records `R` written by this build next to a snapshot of
/// `snapshot_len` bytes says of itself: anything else is not read.
fn image_identity<R: Record>(snapshot_len: u64) -> String {
    format!(
        "{} {} {} {snapshot_len}",
        env!("CARGO_PKG_VERSION"),
        std::any::type_name::<R>(),
        R::PACKED_LAYOUT
    )
}

/// Ends a packed image: its identity (an entry of no id), then the end mark.
fn image_seal<R: Record>(out: &mut Vec<u8>, snapshot_len: u64) {
    journal::encode(
        out,
        0,
        false,
        Kind::Put,
        "",
        image_identity::<R>(snapshot_len).as_bytes(),
    );
    journal::encode(out, 0, true, Kind::End, "", b"");
}

/// The records of a packed image, as memory keeps them.
struct Image<R: Record> {
    records: BTreeMap<R::Id, Packed>,
    unsettled: BTreeSet<R::Id>,
}

/// Reads `packed.gen` when it can stand for `snapshot.gen`: whole, sealed by
/// this build for these records, and written beside a snapshot of the length
/// that one has. None otherwise (an unusable image is removed: the next
/// compaction writes another).
fn read_image<R: Record>(dir: &Path, gen: u64) -> Option<Image<R>> {
    let path = dir.join(image_name(gen));
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::info!(path = %path.display(), error = %e, "packed image not read");
            return None;
        }
    };
    let snapshot_len = std::fs::metadata(dir.join(snapshot_name(gen))).ok()?.len();
    match image_records::<R>(&bytes, snapshot_len) {
        Ok(image) => Some(image),
        Err(why) => {
            tracing::info!(path = %path.display(), why, "packed image not used; reading the snapshot");
            let _ = file::remove_file_if_exists(&path);
            None
        }
    }
}

fn image_records<R: Record>(
    bytes: &[u8],
    snapshot_len: u64,
) -> std::result::Result<Image<R>, String> {
    let scan = journal::scan(bytes, false);
    if !scan.damage.is_empty() {
        return Err(scan.damage.join("; "));
    }
    let Some((seal, entries)) = scan.entries.split_last() else {
        return Err("no seal".into());
    };
    let identity = image_identity::<R>(snapshot_len);
    if !seal.id.is_empty() || seal.kind != Kind::Put {
        return Err("no seal".into());
    }
    if seal.payload != identity.as_bytes() {
        return Err(format!(
            "sealed as {:?}, not {identity:?}",
            String::from_utf8_lossy(seal.payload)
        ));
    }
    let parts = par_chunks(entries, |part| {
        let mut out = Vec::with_capacity(part.len());
        for e in part {
            let id = R::parse_id(e.id).ok_or_else(|| format!("entry of id {:?}", e.id))?;
            let (&flags, packed) = match (e.kind, e.payload.split_first()) {
                (Kind::Put, Some(split)) => split,
                _ => return Err(format!("entry of {} is not a record", e.id)),
            };
            out.push((id, Packed(packed.into()), flags & UNSETTLED == 0));
        }
        Ok(out)
    });
    let mut records = Vec::with_capacity(entries.len());
    let mut unsettled = BTreeSet::new();
    for part in parts {
        for (id, packed, settled) in part? {
            mark(&mut unsettled, id, settled);
            records.push((id, packed));
        }
    }
    if !records.windows(2).all(|w| w[0].0 < w[1].0) {
        return Err("records out of order".into());
    }
    Ok(Image {
        // In id order: the map is built without a search per record.
        records: records.into_iter().collect(),
        unsettled,
    })
}

/// The records of a store's files, as open builds them.
struct Loaded<R: Record> {
    records: BTreeMap<R::Id, Packed>,
    /// The ids of records not settled.
    unsettled: BTreeSet<R::Id>,
    /// Records the journals made.
    born: Vec<R::Id>,
    /// Ids whose last entry is damaged.
    unreadable: BTreeSet<String>,
}

impl<R: Record> Loaded<R> {
    /// Parses the snapshot's records (each id once, so the map is built from them
    /// at once), then replays the journals' entries over them in order. Start-up
    /// time is mostly this: the payloads are parsed on every core, and no copy of
    /// the records is made besides the one the map keeps.
    fn from_scans(image: Option<Image<R>>, scans: &[(String, bool, journal::Scan<'_>)]) -> Self {
        let (records, unsettled) =
            image.map_or_else(Default::default, |i| (i.records, i.unsettled));
        let mut out = Loaded {
            records,
            unsettled,
            born: Vec::new(),
            unreadable: BTreeSet::new(),
        };
        let mut born = BTreeSet::new();
        for (_, is_log, scan) in scans {
            if *is_log {
                out.replay(&scan.entries, &mut born);
            } else {
                out.load_snapshot(&scan.entries);
            }
        }
        out.born = born.into_iter().collect();
        out
    }

    fn load_snapshot(&mut self, entries: &[Entry<'_>]) {
        let parts = par_chunks(entries, |part| {
            let mut good = Vec::with_capacity(part.len());
            let mut bad = Vec::new();
            for e in part {
                match parse_entry::<R>(e) {
                    Ok(Some((id, r, settled))) => good.push((id, r, settled)),
                    Ok(None) => {}
                    Err(why) => bad.push((e.id, why)),
                }
            }
            (good, bad)
        });
        let mut good = Vec::with_capacity(parts.iter().map(|p| p.0.len()).sum());
        for (g, bad) in parts {
            for (id, r, settled) in g {
                mark(&mut self.unsettled, id, settled);
                good.push((id, r));
            }
            for (id, why) in bad {
                self.refuse(id, &why);
            }
        }
        if self.records.is_empty() {
            // In id order already: the map is built without a search per record.
            self.records = good.into_iter().collect();
        } else {
            self.records.extend(good);
        }
    }

    /// Applies a journal's entries in order.
    fn replay(&mut self, entries: &[Entry<'_>], born: &mut BTreeSet<R::Id>) {
        let parts = par_chunks(entries, |part| {
            part.iter().map(parse_entry::<R>).collect::<Vec<_>>()
        });
        for (e, parsed) in entries.iter().zip(parts.into_iter().flatten()) {
            match (e.kind, parsed) {
                (Kind::Put, Ok(Some((id, r, settled)))) => {
                    // Made by this journal, also when the snapshot read before it
                    // was written after the put and holds the record already.
                    if self.records.insert(id, r).is_none() || e.made {
                        born.insert(id);
                    }
                    mark(&mut self.unsettled, id, settled);
                    self.unreadable.remove(e.id);
                }
                (Kind::Remove, _) => {
                    if let Some(k) = R::parse_id(e.id) {
                        self.records.remove(&k);
                        self.unsettled.remove(&k);
                        born.remove(&k);
                    }
                    self.unreadable.remove(e.id);
                }
                (_, Err(why)) => {
                    if let Some(k) = R::parse_id(e.id) {
                        born.remove(&k);
                    }
                    self.refuse(e.id, &why);
                }
                _ => {}
            }
        }
    }

    /// An entry that could not be read: its record is not loaded.
    fn refuse(&mut self, id: &str, why: &str) {
        tracing::error!(id, error = %why, "a record entry is unreadable");
        if let Some(k) = R::parse_id(id) {
            self.records.remove(&k);
            self.unsettled.remove(&k);
        }
        self.unreadable.insert(id.to_string());
    }
}

/// Keeps `unsettled` the set of the records not settled, as `id` now is or not.
fn mark<I: Ord>(unsettled: &mut BTreeSet<I>, id: I, settled: bool) {
    if settled {
        unsettled.remove(&id);
    } else {
        unsettled.insert(id);
    }
}

/// A parsed record: its id, packed, and whether it is settled.
type Parsed<R> = (<R as Record>::Id, Packed, bool);

/// The record a put entry holds, packed (None for other entries), or why it
/// cannot be read: a damaged entry, a payload that does not parse, or one
/// naming another id.
fn parse_entry<R: Record>(e: &Entry<'_>) -> std::result::Result<Option<Parsed<R>>, String> {
    match e.kind {
        Kind::Put => {
            let r: R = serde_json::from_slice(e.payload).map_err(|e| e.to_string())?;
            if R::parse_id(e.id) != Some(r.id()) {
                return Err("its id does not match".into());
            }
            Ok(Some((r.id(), Packed::of(&r)?, r.settled())))
        }
        Kind::Unreadable => Err("its checksum does not match".into()),
        Kind::Remove | Kind::End => Ok(None),
    }
}

/// `f` of consecutive parts of `items`, in order, run on as many threads as the
/// machine has cores (one for few items).
fn par_chunks<'a, T: Sync, U: Send>(items: &'a [T], f: impl Fn(&'a [T]) -> U + Sync) -> Vec<U> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len() / 512 + 1);
    if threads == 1 {
        return vec![f(items)];
    }
    let chunk = items.len().div_ceil(threads).max(1);
    let f = &f;
    std::thread::scope(|s| {
        let parts: Vec<_> = items
            .chunks(chunk)
            .map(|part| s.spawn(move || f(part)))
            .collect();
        parts
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Keeps a copy of a damaged file beside it (once), for people to look at and
/// for the next starts to keep its records' data.
fn set_aside(dir: &Path, name: &str, bytes: &[u8], damage: &[String]) {
    let copy = dir.join(format!("{name}.corrupt"));
    tracing::error!(path = %dir.join(name).display(), damage = ?damage,
        "damaged entries in the store; the file is kept as {}", copy.display());
    if !copy.exists() {
        if let Err(e) = file::write_atomic(&copy, bytes) {
            tracing::error!(path = %copy.display(), error = %e, "could not keep a copy");
        }
    }
}

/// Writes the snapshot file `path`, crash-safely: a Put entry for each (id,
/// payload) of `entries`, then the End mark.
fn write_snapshot<K, P>(
    path: &Path,
    entries: impl Iterator<Item = std::io::Result<(K, P)>>,
) -> Result<()>
where
    K: AsRef<str>,
    P: AsRef<[u8]>,
{
    file::write_atomic_with(path, |w| {
        let mut buf = Vec::new();
        for entry in entries {
            let (id, payload) = entry?;
            buf.clear();
            journal::encode(&mut buf, 0, false, Kind::Put, id.as_ref(), payload.as_ref());
            w.write_all(&buf)?;
        }
        buf.clear();
        journal::encode(&mut buf, 0, true, Kind::End, "", b"");
        w.write_all(&buf)
    })
    .context(|| format!("writing {}", path.display()))
}

/// Converts a store of the older layout: every `<id>.json` is read (an unreadable
/// one is set aside as `<id>.corrupt`, as that layout did), all go into a first
/// snapshot, made durable before any old file is removed. A crash before that
/// leaves the old layout whole (and converted again), after it the snapshot.
fn migrate<R: Record>(dir: &Path, listing: &Listing) -> Result<()> {
    tracing::info!(dir = %dir.display(), records = listing.legacy.len(),
        "converting the store to a snapshot and a journal");
    let mut records = Vec::with_capacity(listing.legacy.len());
    for (name, parsed) in load_all::<R>(dir, &listing.legacy) {
        let stem = name.strip_suffix(".json").unwrap_or(&name);
        match parsed {
            Ok(r) if r.id().to_string() == stem => records.push(r),
            other => {
                let path = dir.join(&name);
                let why = other.err().unwrap_or_else(|| "id does not match".into());
                tracing::error!(path = %path.display(), error = %why,
                    "record unreadable; set aside as .corrupt and its data kept");
                let _ = std::fs::rename(&path, path.with_extension("corrupt"));
            }
        }
    }
    records.sort_by_key(|r| r.id().to_string());
    let snap = dir.join(snapshot_name(1));
    write_snapshot(
        &snap,
        records.iter().map(|r| {
            let payload = serde_json::to_vec(r).map_err(std::io::Error::other)?;
            Ok((r.id().to_string(), payload))
        }),
    )?;
    failpoint::hit("store.migrate.after-snapshot");
    // From here the snapshot rules: open removes any old file left.
    for name in &listing.legacy {
        let _ = file::remove_file_if_exists(&dir.join(name));
    }
    Ok(())
}

/// Reads and parses the files `names` of `dir`, split among threads; each
/// answer is the record or why it could not be read.
fn load_all<R: Record>(
    dir: &Path,
    names: &[String],
) -> Vec<(String, std::result::Result<R, String>)> {
    let parts = par_chunks(names, |part| {
        part.iter()
            .map(|name| {
                let r = std::fs::read(dir.join(name))
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()));
                (name.clone(), r)
            })
            .collect::<Vec<_>>()
    });
    parts.into_iter().flatten().collect()
}

/// Whether `name` is one of the files a store keeps: a snapshot, its packed
/// image or a journal (not a temporary, not a damaged file set aside).
pub fn is_store_file(name: &str) -> bool {
    ["log.", "snapshot.", "packed."]
        .iter()
        .any(|prefix| generation(name, prefix).is_some())
}

/// The generation N of a file named `<prefix>N`.
fn generation(name: &str, prefix: &str) -> Option<u64> {
    name.strip_prefix(prefix)
        .filter(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))?
        .parse()
        .ok()
}

/// The records of a store directory, as JSON by id, read without loading them
/// (for tests and tools). While the store is open, a batch being written may be
/// missed; what is acknowledged is there.
pub fn read_raw(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let listing = Listing::read(dir)?;
    let mut out = BTreeMap::new();
    if listing.snapshots.is_empty() && !listing.legacy.is_empty() {
        for name in &listing.legacy {
            let bytes = std::fs::read(dir.join(name))
                .map_err(|e| Error::internal(format!("{}: {e}", dir.join(name).display())))?;
            out.insert(name.trim_end_matches(".json").to_string(), bytes);
        }
        return Ok(out);
    }
    let base = listing.snapshots.iter().next_back().copied();
    let logs: Vec<u64> = listing.logs.range(base.unwrap_or(0)..).copied().collect();
    let bufs = read_files(dir, base, &logs)?;
    for (_, _, scan) in scan_files(&bufs) {
        for e in scan.entries {
            match e.kind {
                Kind::Put => {
                    out.insert(e.id.to_string(), e.payload.to_vec());
                }
                Kind::Remove | Kind::Unreadable => {
                    out.remove(e.id);
                }
                Kind::End => {}
            }
        }
    }
    Ok(out)
}

/// Writes (`Some`) or removes (`None`) one record of a store that is not open,
/// durably (for tests and tools that play a lost or a stale record).
pub fn write_raw(dir: &Path, id: &str, json: Option<&[u8]>) -> Result<()> {
    let listing = Listing::read(dir)?;
    let Some(&g) = listing.logs.iter().next_back() else {
        return Err(Error::internal(format!("{} has no journal", dir.display())));
    };
    let path = dir.join(log_name(g));
    let bytes =
        std::fs::read(&path).map_err(|e| Error::internal(format!("{}: {e}", path.display())))?;
    let scan = journal::scan(&bytes, true);
    let batch = scan.entries.iter().map(|e| e.batch).max().unwrap_or(0) + 1;
    let mut buf = Vec::new();
    let (kind, payload) = match json {
        Some(j) => (Kind::Put, j),
        None => (Kind::Remove, &b""[..]),
    };
    journal::encode(&mut buf, batch, true, kind, id, payload);
    let f = AppendFile::open(&path).context(|| format!("opening {}", path.display()))?;
    f.truncate(scan.valid_len as u64)
        .and_then(|()| f.write_at(scan.valid_len as u64, &buf))
        .and_then(|()| f.sync_data())
        .context(|| format!("writing {}", path.display()))
}

macro_rules! record {
    ($rec:ty, $id:ty, layout $layout:literal $(, settled $settled:expr)?) => {
        impl Record for $rec {
            type Id = $id;
            const PACKED_LAYOUT: u32 = $layout;
            fn id(&self) -> $id {
                self.id
            }
            fn parse_id(s: &str) -> Option<$id> {
                <$id>::parse(s)
            }
            $(fn settled(&self) -> bool {
                let settled: fn(&$rec) -> bool = $settled;
                settled(self)
            })?
        }
    };
}

use crate::model::RecordState;

// Start-up finishes or rolls back what these say is under way: a record being
// made or removed, an expansion, a snapshot of a group (whose group may be
// gone).
record!(crate::model::VolumeRecord, crate::ids::VolumeId, layout 1,
    settled |r| r.state == RecordState::Ready && r.pending_size.is_none());
record!(crate::model::SnapshotRecord, crate::ids::SnapshotId, layout 1,
    settled |r| r.state == RecordState::Ready && r.group.is_none());
record!(crate::model::GroupSnapshotRecord, crate::ids::GroupSnapshotId, layout 1,
    settled |r| r.state == RecordState::Ready);
record!(crate::node::NodeRecord, crate::ids::VolumeId, layout 1);

#[cfg(test)]
impl<R: Record> Store<R> {
    /// Holds the leader of the next batch before it writes (false), or lets it go.
    fn set_gate(&self, open: bool) {
        let (g, cv) = &self.inner.gate;
        *g.lock().unwrap() = open;
        cv.notify_all();
    }
    /// (entries queued, a batch being written, batches written)
    fn progress(&self) -> (usize, bool, u64) {
        let st = self.inner.lock();
        (st.queue.len(), st.writing, st.batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
    struct Tid(u32);
    impl Display for Tid {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "r{:04}", self.0)
        }
    }
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Rec {
        id: Tid,
        v: String,
    }
    impl Record for Rec {
        type Id = Tid;
        const PACKED_LAYOUT: u32 = 1;
        fn id(&self) -> Tid {
            self.id
        }
        fn parse_id(s: &str) -> Option<Tid> {
            s.strip_prefix('r')?.parse().ok().map(Tid)
        }
        fn settled(&self) -> bool {
            !self.v.starts_with("pending")
        }
    }
    fn rec(i: u32, v: &str) -> Rec {
        Rec {
            id: Tid(i),
            v: v.to_string(),
        }
    }

    const SMALL: Tuning = Tuning {
        compact_at: 2048,
        inline: true,
    };

    /// Compacts only when a test says (`compact_now`).
    const MANUAL: Tuning = Tuning {
        compact_at: u64::MAX,
        inline: true,
    };

    fn open(dir: &Path) -> Store<Rec> {
        Store::open_with(dir, SMALL).unwrap()
    }

    fn compact_now<R: Record>(s: &Store<R>) {
        s.inner.lock().compacting = true;
        s.inner.run_compaction();
    }

    fn contents(s: &Store<Rec>) -> BTreeMap<u32, String> {
        s.all().into_iter().map(|r| (r.id.0, r.v)).collect()
    }

    fn names(dir: &Path) -> BTreeSet<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// The changes of step `i` of the crash workload, and the model of them.
    fn step(s: &Store<Rec>, model: &mut BTreeMap<u32, String>, i: u32) -> Result<()> {
        if i % 3 == 2 {
            model.remove(&(i / 3));
            s.remove(Tid(i / 3))
        } else {
            let v = format!("value {i} {}", "x".repeat(i as usize % 40));
            model.insert(i, v.clone());
            s.put(&rec(i, &v))
        }
    }

    /// A compaction writes the records in memory a chunk at a time: changes
    /// made between two chunks (a record of a written chunk changed, one of a
    /// later chunk removed, records made on both sides) are in memory and in
    /// the new journal, and a reopen reads back exactly what memory held.
    #[test]
    fn changes_between_the_chunks_of_a_compaction_are_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
        let mut model = BTreeMap::new();
        for i in 0..2000 {
            let v = format!("v{i}");
            s.put(&rec(i * 2, &v)).unwrap();
            model.insert(i * 2, v);
        }
        let during = s.clone();
        let hooked = Arc::new(Mutex::new(0));
        let calls = hooked.clone();
        *s.inner.chunk_hook.lock().unwrap() = Some(Box::new(move |chunk| {
            *calls.lock().unwrap() += 1;
            if chunk == 0 {
                during.put(&rec(10, "changed after its chunk")).unwrap();
                during.remove(Tid(3000)).unwrap();
                during.put(&rec(11, "made behind the writer")).unwrap();
                during.put(&rec(3001, "made ahead of the writer")).unwrap();
            }
        }));
        compact_now(&s);
        assert!(
            *hooked.lock().unwrap() >= 4,
            "2000 records are several chunks"
        );
        model.insert(10, "changed after its chunk".into());
        model.remove(&3000);
        model.insert(11, "made behind the writer".into());
        model.insert(3001, "made ahead of the writer".into());
        assert_eq!(contents(&s), model);
        *s.inner.chunk_hook.lock().unwrap() = None;
        drop(s);
        let files = names(tmp.path());
        assert!(
            files.contains("snapshot.1") && files.contains("log.1"),
            "{files:?}"
        );
        assert!(!files.contains("log.0"), "{files:?}");
        let reopened = open(tmp.path());
        assert_eq!(contents(&reopened), model);
        // Both records made meanwhile are known as made by the journal (whose
        // barrier has not run for them), also the one the snapshot holds.
        assert_eq!(reopened.created_in_journal(), vec![Tid(11), Tid(3001)]);
    }

    /// When the last handle on a store goes (the driver stops), a compaction
    /// running then gives up at its next step instead of holding the stop until
    /// it has written everything; the journals it would have folded are kept,
    /// so nothing is lost, and the next compaction does the work.
    #[test]
    fn a_closing_store_gives_up_its_compaction_and_keeps_every_record() {
        let tmp = tempfile::tempdir().unwrap();
        let background = Tuning {
            compact_at: u64::MAX,
            inline: false,
        };
        let s = Store::<Rec>::open_with(tmp.path(), background).unwrap();
        let mut model = BTreeMap::new();
        for i in 0..2000 {
            let v = format!("v{i}");
            s.put(&rec(i, &v)).unwrap();
            model.insert(i, v);
        }
        let other = s.clone();
        drop(other);
        assert!(!s.inner.is_closing(), "another handle is still open");
        // The compaction waits after its first chunk until the store closes.
        let inner = Arc::downgrade(&s.inner);
        let (reached, at_chunk) = std::sync::mpsc::channel();
        let chunks = Arc::new(AtomicUsize::new(0));
        let seen = chunks.clone();
        *s.inner.chunk_hook.lock().unwrap() = Some(Box::new(move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
            let _ = reached.send(());
            // Bounded, so that a store that never tells closes the test fails
            // on what the compaction then does rather than hanging.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !inner.upgrade().is_some_and(|i| i.is_closing())
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }));
        s.inner.lock().compacting = true;
        s.inner.start_compaction();
        at_chunk.recv().unwrap();
        drop(s);
        assert_eq!(
            chunks.load(Ordering::SeqCst),
            1,
            "2000 records are several chunks"
        );
        let files = names(tmp.path());
        assert!(!files.contains("snapshot.1"), "{files:?}");
        let reopened = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
        assert_eq!(contents(&reopened), model);
        compact_now(&reopened);
        assert!(
            names(tmp.path()).contains("snapshot.2"),
            "{:?}",
            names(tmp.path())
        );
        drop(reopened);
        assert_eq!(contents(&open(tmp.path())), model);
    }

    /// A start takes the records of a compaction's packed image, with the
    /// unsettled ones known without decoding the rest; when the image is
    /// damaged or sealed by another build or layout, the snapshot is parsed
    /// instead, to the same records, and the image removed.
    #[test]
    fn a_start_takes_the_packed_image_or_else_the_snapshot_to_the_same_records() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
        let mut model = BTreeMap::new();
        for i in 0..2000 {
            let v = if i % 7 == 0 {
                format!("pending {i}")
            } else {
                format!("v{i}")
            };
            s.put(&rec(i, &v)).unwrap();
            model.insert(i, v);
        }
        compact_now(&s);
        // After the snapshot: one settles, one is made pending, one pending goes.
        s.put(&rec(7, "done")).unwrap();
        s.put(&rec(8, "pending again")).unwrap();
        s.remove(Tid(14)).unwrap();
        model.insert(7, "done".into());
        model.insert(8, "pending again".into());
        model.remove(&14);
        let pending: Vec<u32> = model
            .iter()
            .filter(|(_, v)| v.starts_with("pending"))
            .map(|(k, _)| *k)
            .collect();
        let unsettled = |s: &Store<Rec>| s.unsettled().iter().map(|r| r.id.0).collect::<Vec<_>>();
        assert_eq!(unsettled(&s), pending);
        drop(s);
        let image = tmp.path().join("packed.1");
        let whole = std::fs::read(&image).unwrap();

        let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
        assert!(s.inner.from_image, "the image is read");
        assert_eq!(contents(&s), model);
        assert_eq!(unsettled(&s), pending);
        drop(s);

        // Damaged in the middle of a record.
        let mut damaged = whole.clone();
        damaged[whole.len() / 2] ^= 0x40;
        // Sealed by another build.
        let scan = journal::scan(&whole, false);
        let mut other = Vec::new();
        for e in &scan.entries[..scan.entries.len() - 1] {
            journal::encode(&mut other, 0, false, e.kind, e.id, e.payload);
        }
        let snapshot_len = std::fs::metadata(tmp.path().join("snapshot.1"))
            .unwrap()
            .len();
        let seal =
            image_identity::<Rec>(snapshot_len).replace(env!("CARGO_PKG_VERSION"), "0.0.0-other");
        journal::encode(&mut other, 0, false, Kind::Put, "", seal.as_bytes());
        journal::encode(&mut other, 0, true, Kind::End, "", b"");
        // Cut short.
        let cut = whole[..whole.len() - 30].to_vec();
        for (what, bytes) in [
            ("damaged", damaged),
            ("another build's", other),
            ("cut", cut),
        ] {
            std::fs::write(&image, &bytes).unwrap();
            let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
            assert!(!s.inner.from_image, "a {what} image is not read");
            assert_eq!(contents(&s), model, "{what}");
            assert_eq!(unsettled(&s), pending, "{what}");
            assert!(!image.exists(), "a {what} image is removed");
            assert!(
                !names(tmp.path()).iter().any(|n| n.ends_with(".corrupt")),
                "an image is not set aside"
            );
            drop(s);
        }
    }

    /// The barrier is given the records the folded journals made and that still
    /// exist: not those they only changed, not those removed since; after a
    /// reopen too, where the journal it appends to was made before it.
    #[test]
    fn the_barrier_is_given_what_the_folded_journals_made() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
        for i in 0..10 {
            s.put(&rec(i, "first")).unwrap();
        }
        let seen = Arc::new(Mutex::new(Vec::new()));
        let into = seen.clone();
        s.set_compaction_barrier(Box::new(move |ids: &[String]| {
            into.lock().unwrap().push(ids.to_vec());
            Ok(())
        }));
        compact_now(&s);
        let made: Vec<String> = (0..10).map(|i| Tid(i).to_string()).collect();
        assert_eq!(seen.lock().unwrap().pop(), Some(made));
        // In journal 1: 0 changed, 1 removed, 20 and 21 made, 21 removed.
        s.put(&rec(0, "second")).unwrap();
        s.remove(Tid(1)).unwrap();
        s.put(&rec(20, "new")).unwrap();
        s.put(&rec(21, "gone")).unwrap();
        s.remove(Tid(21)).unwrap();
        drop(s);
        // Reopened: what journal 1 made is known from it.
        let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
        let into = seen.clone();
        s.set_compaction_barrier(Box::new(move |ids: &[String]| {
            into.lock().unwrap().push(ids.to_vec());
            Ok(())
        }));
        s.put(&rec(30, "after the reopen")).unwrap();
        compact_now(&s);
        assert_eq!(
            seen.lock().unwrap().pop(),
            Some(vec![Tid(20).to_string(), Tid(30).to_string()])
        );
    }

    #[test]
    fn changes_survive_a_reopen_and_start_up_reads_one_snapshot_and_one_journal() {
        let tmp = tempfile::tempdir().unwrap();
        let s = open(tmp.path());
        let mut model = BTreeMap::new();
        for i in 0..300 {
            step(&s, &mut model, i).unwrap();
        }
        assert_eq!(contents(&s), model);
        drop(s);
        let files = names(tmp.path());
        let snaps: Vec<_> = files
            .iter()
            .filter(|n| n.starts_with("snapshot."))
            .collect();
        let logs: Vec<_> = files.iter().filter(|n| n.starts_with("log.")).collect();
        assert_eq!((snaps.len(), logs.len()), (1, 1), "{files:?}");
        assert_eq!(snaps[0][9..], logs[0][4..], "{files:?}");
        let s = open(tmp.path());
        assert_eq!(contents(&s), model);
        // Made by the journal since the snapshot: what start-up checks the data of.
        let made: BTreeSet<u32> = s.created_in_journal().into_iter().map(|t| t.0).collect();
        assert!(!made.is_empty() && made.iter().all(|i| model.contains_key(i)));
        assert!(
            made.len() < model.len(),
            "the snapshot's records are not in it"
        );
        assert!(!s.is_quarantined("r0001"));
    }

    #[test]
    fn a_torn_end_is_cut_and_nothing_acknowledged_is_lost() {
        let tmp = tempfile::tempdir().unwrap();
        let s = open(tmp.path());
        let mut model = BTreeMap::new();
        for i in 0..4 {
            step(&s, &mut model, i).unwrap();
        }
        drop(s);
        let log = tmp.path().join("log.0");
        let mut whole = std::fs::read(&log).unwrap();
        // The batches, without the zeros of the journal's room for appends.
        whole.truncate(journal::scan(&whole, true).valid_len);
        // A batch of two whose write reached the disk only in part.
        let mut next = Vec::new();
        journal::encode(
            &mut next,
            99,
            false,
            Kind::Put,
            "r0050",
            b"{\"id\":50,\"v\":\"a\"}",
        );
        journal::encode(&mut next, 99, true, Kind::Remove, "r0000", b"");
        for cut in [1, 10, 30, next.len() / 2, next.len() - 1] {
            let mut torn = whole.clone();
            torn.extend_from_slice(&next[..cut]);
            std::fs::write(&log, &torn).unwrap();
            let s = open(tmp.path());
            assert_eq!(contents(&s), model, "cut {cut}");
            assert!(!s.is_quarantined("r0050"), "cut {cut}");
            drop(s);
            assert_eq!(std::fs::read(&log).unwrap(), whole, "cut {cut}: cut back");
            assert!(!names(tmp.path()).iter().any(|n| n.ends_with(".corrupt")));
        }
        // And the journal takes new batches after it.
        let s = open(tmp.path());
        step(&s, &mut model, 4).unwrap();
        drop(s);
        assert_eq!(contents(&open(tmp.path())), model);
    }

    /// The journal is written with zeros ahead of its appends, so that most
    /// appends leave its length alone: a start keeps those zeros as the room
    /// they are, and cuts a torn write within them.
    #[test]
    fn the_journal_keeps_room_for_appends_across_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("log.0");
        let s = open(tmp.path());
        let mut model = BTreeMap::new();
        step(&s, &mut model, 0).unwrap();
        let room = std::fs::metadata(&log).unwrap().len();
        assert_eq!(room % csi_sys::file::APPEND_ROOM, 0);
        for i in 1..4 {
            step(&s, &mut model, i).unwrap();
        }
        assert_eq!(
            std::fs::metadata(&log).unwrap().len(),
            room,
            "appends within the room"
        );
        drop(s);
        let bytes = std::fs::read(&log).unwrap();
        let end = journal::scan(&bytes, true).valid_len;
        assert!(end > 0 && bytes[end..].iter().all(|&b| b == 0));
        let s = open(tmp.path());
        assert_eq!(contents(&s), model);
        assert_eq!(std::fs::read(&log).unwrap(), bytes, "the room is kept");
        step(&s, &mut model, 4).unwrap();
        drop(s);
        assert_eq!(contents(&open(tmp.path())), model);
        // A write cut short within the room: cut off, and appends go on.
        let bytes = std::fs::read(&log).unwrap();
        let end = journal::scan(&bytes, true).valid_len;
        let mut torn = bytes.clone();
        let mut next = Vec::new();
        journal::encode(&mut next, 99, true, Kind::Remove, "r0000", b"");
        torn[end..end + next.len() / 2].copy_from_slice(&next[..next.len() / 2]);
        std::fs::write(&log, &torn).unwrap();
        let s = open(tmp.path());
        assert_eq!(contents(&s), model);
        assert_eq!(std::fs::read(&log).unwrap(), bytes[..end], "cut back");
        step(&s, &mut model, 5).unwrap();
        drop(s);
        assert_eq!(contents(&open(tmp.path())), model);
    }

    /// A store of three records, one batch each, with the byte `at(frame size)`
    /// of its journal damaged.
    fn three_with_damage(at: impl Fn(usize) -> usize) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        let s = open(tmp.path());
        for i in 1..=3 {
            s.put(&rec(i, "v")).unwrap();
        }
        drop(s);
        let log = tmp.path().join("log.0");
        let mut bytes = std::fs::read(&log).unwrap();
        let i = at(journal::scan(&bytes, true).valid_len / 3);
        bytes[i] ^= 0x55;
        std::fs::write(&log, &bytes).unwrap();
        tmp
    }

    #[test]
    fn removals_are_compacted_away_before_a_start_parses_more_than_twice_the_live_records() {
        let tmp = tempfile::tempdir().unwrap();
        // Far from the journal's byte threshold: only the removals can make it due.
        let tuning = Tuning {
            compact_at: 1 << 40,
            inline: true,
        };
        let s = Store::<Rec>::open_with(tmp.path(), tuning).unwrap();
        for i in 0..3000 {
            s.put(&rec(i, "v")).unwrap();
        }
        let parsed = |s: &Store<Rec>| {
            let st = s.inner.lock();
            st.snapshot_entries + st.entries
        };
        assert_eq!(parsed(&s), 3000, "no compaction while records are added");
        for i in 0..3000 {
            s.remove(Tid(i)).unwrap();
            let live = 3000 - u64::from(i) - 1;
            assert!(
                parsed(&s) <= 2 * live + SMALL_STORE + 1,
                "after {i} removals"
            );
        }
        drop(s);
        let s = Store::<Rec>::open_with(tmp.path(), tuning).unwrap();
        assert!(contents(&s).is_empty());
        assert!(parsed(&s) <= SMALL_STORE, "a start parses {}", parsed(&s));
    }

    #[test]
    fn a_damaged_entry_is_reported_and_its_record_quarantined_not_lost() {
        // The last byte of r0002's payload: its header still names it.
        let tmp = three_with_damage(|frame| 2 * frame - 2);
        let s = open(tmp.path());
        assert_eq!(contents(&s).keys().copied().collect::<Vec<_>>(), [1, 3]);
        assert!(s.is_quarantined("r0002") && !s.is_quarantined("r0001"));
        assert!(tmp.path().join("log.0.corrupt").is_file());
        // Compacted away, the damaged journal still keeps the record's data safe.
        for i in 10..60 {
            s.put(&rec(i, &"y".repeat(60))).unwrap();
        }
        drop(s);
        assert!(!tmp.path().join("log.0").exists(), "compacted");
        let s = open(tmp.path());
        assert!(s.is_quarantined("r0002") && !s.is_quarantined("r0003"));
        // Put again, it is known once more.
        s.put(&rec(2, "again")).unwrap();
        drop(s);
        assert!(!open(tmp.path()).is_quarantined("r0002"));

        // A header damaged: which record it held is unknown, so every stem is
        // treated as one that may be.
        let tmp = three_with_damage(|frame| frame + 5);
        let s = open(tmp.path());
        assert_eq!(contents(&s).keys().copied().collect::<Vec<_>>(), [1, 3]);
        assert!(s.is_quarantined("anything"));
    }

    #[test]
    fn writers_at_once_share_one_write_and_one_sync() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Arc::new(open(tmp.path()));
        s.set_gate(false);
        let writers: Vec<_> = (0..16)
            .map(|i| {
                let s = s.clone();
                std::thread::spawn(move || s.put(&rec(i, "v")))
            })
            .collect();
        // The first leader holds its batch of one; the other fifteen queue behind it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while s.progress() != (15, true, 0) {
            assert!(std::time::Instant::now() < deadline, "{:?}", s.progress());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        s.set_gate(true);
        for w in writers {
            w.join().unwrap().unwrap();
        }
        assert_eq!(
            s.progress(),
            (0, false, 2),
            "two writes for sixteen changes"
        );
        assert_eq!(s.len(), 16);
        drop(s);
        assert_eq!(open(tmp.path()).len(), 16);
    }

    #[test]
    fn every_queued_change_is_led_when_batches_hand_over() {
        // Each batch's leader hands the next batch to the first caller queued
        // behind it; a change left without a leader would keep its caller
        // waiting. Each writer is a new thread with one change, so nothing but
        // the hand-over can wake it.
        let tmp = tempfile::tempdir().unwrap();
        let s = Arc::new(open(tmp.path()));
        for round in 0..20u32 {
            let (tx, rx) = std::sync::mpsc::channel();
            for t in 0..16u32 {
                let (s, tx) = (s.clone(), tx.clone());
                std::thread::spawn(move || {
                    let id = round * 100 + t;
                    let _ = tx.send(s.put(&rec(id, "v")).and_then(|()| match t % 4 {
                        3 => s.remove(Tid(id)),
                        _ => Ok(()),
                    }));
                });
            }
            for _ in 0..16 {
                rx.recv_timeout(std::time::Duration::from_secs(20))
                    .expect("a writer's change was never written")
                    .unwrap();
            }
        }
        let (queued, writing, _) = s.progress();
        assert_eq!((queued, writing), (0, false));
        assert_eq!(s.len(), 20 * 12);
        drop(s);
        assert_eq!(open(tmp.path()).len(), 20 * 12);
    }

    #[test]
    fn a_large_snapshot_loads_on_every_core_and_its_journal_replays_over_it() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        // Enough records for the parse to be split among threads, one of them
        // with a payload that checks out but does not parse, one naming another id.
        let mut model = BTreeMap::new();
        let mut snap = Vec::new();
        for i in 0..3000 {
            let r = rec(i, &format!("s{i}"));
            let payload = match i {
                1500 => b"{\"id\":1500,\"v\":".to_vec(),
                2500 => serde_json::to_vec(&rec(7, "other")).unwrap(),
                _ => {
                    model.insert(i, r.v.clone());
                    serde_json::to_vec(&r).unwrap()
                }
            };
            snap.push((r.id.to_string(), payload));
        }
        write_snapshot(
            &d.join(snapshot_name(4)),
            snap.iter().map(|(id, p)| Ok((id.as_str(), p.as_slice()))),
        )
        .unwrap();
        // The journal: a change, a removal, a new record, and the record that did
        // not parse written again.
        let mut log = Vec::new();
        let changes: [(u32, Option<&str>); 4] = [
            (10, Some("changed")),
            (11, None),
            (5000, Some("new")),
            (1500, Some("again")),
        ];
        for (batch, (i, v)) in changes.iter().enumerate() {
            let (kind, payload) = match v {
                Some(v) => {
                    model.insert(*i, v.to_string());
                    (Kind::Put, serde_json::to_vec(&rec(*i, v)).unwrap())
                }
                None => {
                    model.remove(i);
                    (Kind::Remove, Vec::new())
                }
            };
            journal::encode(
                &mut log,
                batch as u64 + 1,
                true,
                kind,
                &Tid(*i).to_string(),
                &payload,
            );
        }
        std::fs::write(d.join(log_name(4)), &log).unwrap();
        let s = open(d);
        assert_eq!(contents(&s), model);
        let made: Vec<u32> = s.created_in_journal().into_iter().map(|t| t.0).collect();
        assert_eq!(made, [1500, 5000], "only what the journal made");
        assert!(s.is_quarantined("r2500") && !s.is_quarantined("r1500"));
        assert!(!s.is_quarantined("r0010") && !s.is_quarantined("r0011"));
        // The next batch follows the journal's last one.
        s.put(&rec(6000, "after")).unwrap();
        model.insert(6000, "after".into());
        drop(s);
        assert_eq!(contents(&open(d)), model);
    }

    #[test]
    fn a_store_of_the_older_layout_is_converted_once() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        for i in 1..=2 {
            std::fs::write(
                d.join(format!("r{i:04}.json")),
                serde_json::to_vec(&rec(i, "old")).unwrap(),
            )
            .unwrap();
        }
        std::fs::write(d.join("r0003.json"), b"{ half a rec").unwrap();
        std::fs::write(d.join(".r0004.json.tmp"), b"{}").unwrap();
        let s = open(d);
        assert_eq!(contents(&s).keys().copied().collect::<Vec<_>>(), [1, 2]);
        assert!(s.is_quarantined("r0003"));
        s.remove(Tid(1)).unwrap();
        drop(s);
        assert_eq!(
            names(d),
            ["log.1", "r0003.corrupt", "snapshot.1"]
                .map(String::from)
                .into()
        );
        let s = open(d);
        assert_eq!(contents(&s).keys().copied().collect::<Vec<_>>(), [2]);
        assert!(s.is_quarantined("r0003"));
        let raw = read_raw(d).unwrap();
        assert_eq!(raw.keys().collect::<Vec<_>>(), ["r0002"]);
        write_raw(d, "r0002", None).unwrap();
        write_raw(
            d,
            "r0005",
            Some(&serde_json::to_vec(&rec(5, "raw")).unwrap()),
        )
        .unwrap();
        assert_eq!(contents(&open(d)), [(5, "raw".to_string())].into());
    }

    const CHILD: &str = "STORE_CRASH_CHILD";

    /// In a child process (this test, run again): the workload, until the
    /// failpoint armed there ends the process. Prints each acknowledged step.
    fn child(dir: &Path, what: &str) {
        let mut model = BTreeMap::new();
        if what == "migrate" {
            let _ = open(dir);
            println!("opened");
            return;
        }
        let s = open(dir);
        for i in 0..400 {
            step(&s, &mut model, i).unwrap();
            println!("acked {i}");
        }
    }

    #[test]
    fn a_crash_at_each_step_of_a_compaction_or_a_conversion_loses_nothing() {
        if let Ok(dir) = std::env::var(CHILD) {
            let what = std::env::var("STORE_CRASH_WHAT").unwrap();
            return child(Path::new(&dir), &what);
        }
        let me = "core::store::tests::a_crash_at_each_step_of_a_compaction_or_a_conversion_loses_nothing";
        for fp in [
            "store.compact.after-new-log",
            "store.compact.after-rotate",
            "store.compact.after-snapshot",
            "store.migrate.after-snapshot",
        ] {
            let tmp = tempfile::tempdir().unwrap();
            let what = fp.split('.').nth(1).unwrap();
            let mut legacy = BTreeMap::new();
            if what == "migrate" {
                for i in 0..50 {
                    let r = rec(i, "old");
                    let bytes = serde_json::to_vec(&r).unwrap();
                    std::fs::write(tmp.path().join(format!("{}.json", r.id)), bytes).unwrap();
                    legacy.insert(i, r.v);
                }
            }
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([me, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD, tmp.path())
                .env("STORE_CRASH_WHAT", what)
                .env(failpoint::ENV, fp)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(
                out.status.signal(),
                Some(libc::SIGABRT),
                "{fp}: the child must die there\n{stdout}\n{stderr}"
            );
            assert!(
                stderr.contains(&format!("failpoint {fp} reached")),
                "{stderr}"
            );
            let mut model = if what == "migrate" {
                legacy
            } else {
                // Every step acknowledged, and the one whose batch started the
                // compaction: it was durable before the compaction began.
                // (The harness may print the test's name on the first line's start.)
                let acked = stdout
                    .lines()
                    .filter_map(|l| l.split("acked ").nth(1)?.trim().parse::<u32>().ok())
                    .max()
                    .map_or(0, |last| last + 1);
                let (mut model, scratch) = (BTreeMap::new(), tempfile::tempdir().unwrap());
                let replay = open(scratch.path());
                for i in 0..=acked {
                    step(&replay, &mut model, i).unwrap();
                }
                model
            };
            let s = open(tmp.path());
            assert_eq!(contents(&s), model, "{fp}: after the crash");
            assert!(!s.is_quarantined("r0001"), "{fp}");
            // It goes on, compacts again, and reads back the same.
            for i in 1000..1100 {
                step(&s, &mut model, i).unwrap();
            }
            drop(s);
            assert_eq!(contents(&open(tmp.path())), model, "{fp}: after more");
            let files = names(tmp.path());
            assert!(
                !files
                    .iter()
                    .any(|n| n.starts_with('.') || n.ends_with(".json")),
                "{fp}: {files:?}"
            );
        }
    }

    /// A listing reads volume records through `VolumeView`, which mirrors the
    /// record's fields in their packed form: it must read each record's packed
    /// bytes to their end, to the same values as the record's own.
    #[test]
    fn a_volume_view_reads_every_record_as_the_record_does() {
        use crate::model::VolumeView;
        let (volumes, ..) = every_kind();
        assert!(volumes.iter().any(|v| !v.published.is_empty()));
        for v in &volumes {
            let packed = postcard::to_allocvec(v).unwrap();
            let (view, rest) = postcard::take_from_bytes::<VolumeView>(&packed).unwrap();
            assert!(rest.is_empty(), "{} bytes left unread", rest.len());
            assert_eq!(view, v.view());
            assert_eq!(unpack::<VolumeView>(&packed), Some(v.view()));
        }
        // A view is a view of its own record only.
        let mut other = volumes[0].clone();
        other.pending_size = other.pending_size.map_or(Some(1), |s| Some(s + 1));
        assert_ne!(other.view(), volumes[0].view());
    }

    /// Every record kind, with every field set (and with the optional ones
    /// unset), reads back from memory as it was put, and from the files after a
    /// restart: memory's form knows fields by their order alone.
    #[test]
    fn records_of_every_kind_read_back_whole() {
        fn check<R: Record + PartialEq + std::fmt::Debug>(dir: &Path, records: &[R]) {
            let store = Store::<R>::open(dir).unwrap();
            for r in records {
                store.put(r).unwrap();
                assert_eq!(store.get(r.id()).as_ref(), Some(r));
            }
            drop(store);
            let store = Store::<R>::open(dir).unwrap();
            let mut want = records.to_vec();
            want.sort_by_key(|r| r.id());
            assert_eq!(store.all(), want);
            // And from a snapshot's packed image.
            compact_now(&store);
            drop(store);
            let store = Store::<R>::open(dir).unwrap();
            assert!(store.inner.from_image);
            assert_eq!(store.all(), want);
        }

        let tmp = tempfile::tempdir().unwrap();
        let (volumes, snapshots, groups, staged) = every_kind();
        check(&tmp.path().join("volumes"), &volumes);
        check(&tmp.path().join("snapshots"), &snapshots);
        check(&tmp.path().join("groups"), &groups);
        check(&tmp.path().join("staged"), &staged);
    }

    /// The packed form of every record kind, with every field set and unset, is
    /// what the layouts pinned here say. When this fails, the records' fields
    /// changed: raise the kind's PACKED_LAYOUT (in the `record!` line) and pin
    /// the new checksum, so that no start reads an image of the older fields.
    #[test]
    fn packed_forms_are_pinned() {
        fn form<R: Record>(records: &[R]) -> (u32, u32) {
            let mut bytes = Vec::new();
            for r in records {
                bytes.extend_from_slice(&Packed::of(r).unwrap().0);
            }
            (R::PACKED_LAYOUT, crc32fast::hash(&bytes))
        }
        let (volumes, snapshots, groups, staged) = every_kind();
        assert_eq!(form(&volumes), (1, PINNED[0]), "volume records");
        assert_eq!(form(&snapshots), (1, PINNED[1]), "snapshot records");
        assert_eq!(form(&groups), (1, PINNED[2]), "group snapshot records");
        assert_eq!(form(&staged), (1, PINNED[3]), "node records");
    }

    const PINNED: [u32; 4] = [1_714_172_006, 3_478_877_198, 1_404_644_243, 1_544_629_552];

    /// Records of every kind, with every field set and unset.
    #[allow(clippy::type_complexity)]
    fn every_kind() -> (
        Vec<crate::model::VolumeRecord>,
        Vec<crate::model::SnapshotRecord>,
        Vec<crate::model::GroupSnapshotRecord>,
        Vec<crate::node::NodeRecord>,
    ) {
        use crate::ids::{GroupSnapshotId, SnapshotId, VolumeId};
        use crate::model::*;
        use crate::node::{NodeRecord, Target};

        let map = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let full = VolumeRecord {
            id: VolumeId::for_name("full"),
            name: "full".into(),
            pool: "ssd".into(),
            backing: Backing::Image,
            size: 5 << 30,
            fs_type: Some("xfs".into()),
            capabilities: vec![
                Capability {
                    access: Access::Mount {
                        fs_type: "xfs".into(),
                        mount_flags: vec!["noatime".into(), "nodev".into()],
                        volume_mount_group: "1000".into(),
                    },
                    mode: AccessMode::SingleNodeMultiWriter,
                },
                Capability {
                    access: Access::Block,
                    mode: AccessMode::Unknown,
                },
            ],
            parameters: map(&[("kind", "image"), ("pool", "ssd")]),
            mutable_parameters: map(&[("iops", "100")]),
            source: Some(ContentSource::Snapshot(SnapshotId::for_name("s"))),
            created: Timestamp {
                seconds: -5,
                nanos: 999_999_999,
            },
            state: RecordState::Deleting,
            pending_size: Some(6 << 30),
            published: [
                (
                    "node-a".to_string(),
                    Publication {
                        read_only: true,
                        block: true,
                    },
                ),
                (
                    "node-b".to_string(),
                    Publication {
                        read_only: false,
                        block: false,
                    },
                ),
            ]
            .into(),
            ephemeral: true,
            requested: Some(1),
        };
        let bare = VolumeRecord {
            id: VolumeId::for_name("bare"),
            name: String::new(),
            fs_type: None,
            capabilities: vec![],
            parameters: BTreeMap::new(),
            mutable_parameters: BTreeMap::new(),
            source: Some(ContentSource::Volume(VolumeId::for_name("v"))),
            pending_size: None,
            published: BTreeMap::new(),
            ephemeral: false,
            requested: None,
            ..full.clone()
        };
        let volumes = vec![full, bare];

        let snapshot = SnapshotRecord {
            id: SnapshotId::for_name("snap"),
            name: "snap".into(),
            source_volume: VolumeId::for_name("full"),
            pool: "ssd".into(),
            backing: Backing::Subvolume,
            size: u64::MAX,
            fs_type: Some("btrfs".into()),
            created: Timestamp {
                seconds: 1_700_000_000,
                nanos: 5,
            },
            state: RecordState::Creating,
            group: Some(GroupSnapshotId::for_name("g")),
            requested: Some(7),
        };
        let plain = SnapshotRecord {
            id: SnapshotId::for_name("plain"),
            fs_type: None,
            group: None,
            requested: None,
            ..snapshot.clone()
        };
        let snapshots = vec![snapshot, plain];

        let group = GroupSnapshotRecord {
            id: GroupSnapshotId::for_name("g"),
            name: "g".into(),
            source_volumes: vec![VolumeId::for_name("a"), VolumeId::for_name("b")],
            members: vec![SnapshotId::for_name("a"), SnapshotId::for_name("b")],
            created: Timestamp {
                seconds: 1_700_000_001,
                nanos: 0,
            },
            state: RecordState::Ready,
        };

        let staged = NodeRecord {
            id: VolumeId::for_name("staged"),
            volume_id: "kubelet-id".into(),
            data: "/pool/a.img".into(),
            backing: Backing::Directory,
            staging_path: Some("/var/lib/kubelet/staging/x".into()),
            block: true,
            fs_type: Some("ext4".into()),
            mode: AccessMode::SingleNodeReaderOnly,
            targets: [(
                PathBuf::from("/target/one"),
                Target {
                    read_only: true,
                    block: false,
                    ro_device: Some("/dev/loop7".into()),
                },
            )]
            .into(),
            ephemeral: true,
            loop_devices: Some(vec!["/dev/loop7".into(), "/dev/loop8".into()]),
        };
        let unstaged = NodeRecord {
            id: VolumeId::for_name("unstaged"),
            staging_path: None,
            fs_type: None,
            targets: BTreeMap::new(),
            loop_devices: None,
            ..staged.clone()
        };
        (volumes, snapshots, vec![group], vec![staged, unstaged])
    }
}
