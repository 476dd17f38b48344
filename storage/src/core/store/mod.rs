//! The state store: the records of one kind, kept in memory in id order (every
//! operation O(log n), listings stable) and on disk as a snapshot plus a journal
//! (frames of [`frame`]). Memory holds each record in its compact binary form
//! ([`format::Packed`]), a fraction of the size of the record with its strings
//! and collections; a read decodes the records it returns.
//!
//! The snapshot's records are JSON, readable by any version; parsing them is
//! most of a start's time. So a compaction also writes `packed.N`: the bytes
//! memory keeps for each record, sealed with the build's version and the
//! records' [`Record::PACKED_LAYOUT`], which a start takes into memory as they
//! are. A start reads the snapshot instead when the image is missing, damaged,
//! of another build or layout, or not of the snapshot beside it (its length).
//!
//! Its rooms: [`format`] (the forms records take in memory and on disk),
//! [`frame`] (the checksummed entries every file is made of), [`journal`]
//! (group commit), [`compaction`] (the snapshot rewritten in the background)
//! and [`recovery`] (open, replay, quarantine, conversion). This file is the
//! typed API the domains call; each record type declares itself a [`Record`]
//! with [`record!`] beside its definition.
//!
//! A damaged entry is not a lost record: the file is kept as `<file>.corrupt`,
//! the entry's id (or, when even that is lost, every id) is quarantined, so the
//! data it describes is never taken for an orphan.

mod compaction;
mod format;
mod frame;
mod journal;
mod recovery;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::ops::{Bound, ControlFlow};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, RwLock};
use std::thread::JoinHandle;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};
use format::Packed;
pub use format::{is_store_file, unpack};
use frame::Kind;
use journal::{Log, Op, Pending, Waiter};
pub use recovery::{read_raw, write_raw};

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
    fn new(dir: &Path, tuning: Tuning, opened: recovery::Opened<R>) -> Self {
        Inner {
            dir: dir.to_path_buf(),
            records: RwLock::new(opened.records),
            unsettled: Mutex::new(opened.unsettled),
            quarantined: opened.quarantined,
            blind: opened.blind,
            born: opened.born,
            log: Mutex::new(opened.log),
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
            from_image: opened.from_image,
        }
    }

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
}

/// Makes a type a [`Record`] of the store: its id type, the version of its
/// packed form, and (when some of its records say an operation is unfinished)
/// what settled means for it. Written beside each record type.
macro_rules! record {
    ($rec:ty, $id:ty, layout $layout:literal $(, settled $settled:expr)?) => {
        impl $crate::core::store::Record for $rec {
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
pub(crate) use record;

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
