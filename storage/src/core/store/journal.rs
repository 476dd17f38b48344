//! The journal's writer: a change is durable before it is visible and before
//! its caller goes on. The caller's entry joins the next batch, and one caller
//! (the leader) writes the whole batch and syncs it once for everyone in it
//! (group commit); the others sleep until the leader wakes them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, MutexGuard, OnceLock};

use csi_sys::file::AppendFile;

use super::format::{mark, Packed};
use super::frame::{self, Kind};
use super::{Inner, Record};
use crate::error::{Error, Result};

pub(super) struct Log<R: Record> {
    pub(super) file: Arc<AppendFile>,
    pub(super) gen: u64,
    /// Durable length of `file`.
    pub(super) len: u64,
    /// Entries in `file`.
    pub(super) entries: u64,
    pub(super) queue: Vec<Pending<R>>,
    pub(super) writing: bool,
    pub(super) next_batch: u64,
    /// The journal the next batch goes to, made ready by a compaction.
    pub(super) next_file: Option<(u64, AppendFile)>,
    pub(super) compacting: bool,
    /// Generation of the newest snapshot (0 for none).
    pub(super) snapshot: u64,
    /// Records in that snapshot: what a start parses besides the journal.
    pub(super) snapshot_entries: u64,
    /// A write failed and could not be undone: nothing more is written.
    pub(super) broken: Option<String>,
    pub(super) batches: u64,
    /// The records each journal made (its generation, the id), until a
    /// compaction folds that journal: what the barrier is given.
    pub(super) born: Vec<(u64, R::Id)>,
}

impl<R: Record> Log<R> {
    /// The writer of journal `file` (generation `gen`, `len` durable bytes
    /// holding `entries` entries, which made the records `born`).
    pub(super) fn new(
        file: AppendFile,
        gen: u64,
        len: u64,
        entries: u64,
        born: Vec<(u64, R::Id)>,
    ) -> Log<R> {
        Log {
            file: std::sync::Arc::new(file),
            gen,
            len,
            entries,
            queue: Vec::new(),
            writing: false,
            next_batch: 1,
            next_file: None,
            compacting: false,
            snapshot: 0,
            snapshot_entries: 0,
            broken: None,
            batches: 0,
            born,
        }
    }
}

pub(super) enum Op<R: Record> {
    /// The record, packed, and whether it is settled.
    Put(R::Id, Packed, bool),
    Remove(R::Id),
}

/// A queued change's caller: the batch's outcome, set once by the leader that
/// wrote it, and the thread to wake then (or to ask to lead the next batch).
pub(super) struct Waiter {
    pub(super) outcome: OnceLock<std::result::Result<(), String>>,
    /// Set when the caller is to lead the next batch (no batch is being written).
    pub(super) lead: AtomicBool,
    pub(super) thread: std::thread::Thread,
}

pub(super) type Outcome = Arc<Waiter>;

impl Waiter {
    pub(super) fn new() -> Outcome {
        Arc::new(Waiter {
            outcome: OnceLock::new(),
            lead: AtomicBool::new(false),
            thread: std::thread::current(),
        })
    }

    /// Parks until the outcome is set or the caller is asked to lead.
    pub(super) fn park(&self) {
        while self.outcome.get().is_none() && !self.lead.swap(false, Ordering::AcqRel) {
            std::thread::park();
        }
    }
}

pub(super) struct Pending<R: Record> {
    pub(super) op: Op<R>,
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) payload: Vec<u8>,
    pub(super) done: Outcome,
}

impl<R: Record> Inner<R> {
    /// Queues the change and returns once the batch holding it is durable (and
    /// applied), leading that batch when no other caller is writing. A caller
    /// whose change waits sleeps on its own: the leader wakes each caller of its
    /// batch, and the first of the next when it is done, so that no caller wakes
    /// for another's batch or queues for the lock to learn that it is done.
    pub(super) fn commit(self: &Arc<Self>, p: Pending<R>) -> Result<()> {
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
    pub(super) fn lead<'a>(
        &'a self,
        mut st: MutexGuard<'a, Log<R>>,
    ) -> (MutexGuard<'a, Log<R>>, bool) {
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
        let buf = encode_batch(&batch, &made, number);
        let res = file
            .write_durable_at(offset, &buf)
            .map_err(|e| e.to_string());
        let mut st = self.lock();
        let mut live = 0;
        let done = match &res {
            Ok(()) => {
                st.len += buf.len() as u64;
                st.entries += batch.len() as u64;
                st.batches += 1;
                let (done, n) = self.apply(&mut st, batch, made, batch_gen);
                live = n;
                done
            }
            Err(e) => {
                // What may have reached the file is cut off again, so that the next
                // batch follows the last durable one.
                if let Err(e2) = file.truncate(offset) {
                    st.broken = Some(format!("{e}; undoing it: {e2}"));
                }
                batch.into_iter().map(|p| p.done).collect()
            }
        };
        self.hand_over(&mut st, done, &res);
        let due = res.is_ok() && self.due(&mut st, live);
        // A compaction waits for the batch to end to move to its new journal.
        self.changed.notify_all();
        (st, due)
    }

    /// Applies a written batch to memory; returns its callers and how many
    /// records there are now.
    fn apply(
        &self,
        st: &mut Log<R>,
        batch: Vec<Pending<R>>,
        made: Vec<bool>,
        batch_gen: u64,
    ) -> (Vec<Outcome>, u64) {
        let mut done = Vec::with_capacity(batch.len());
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
            done.push(p.done);
        }
        (done, map.len() as u64)
    }

    /// Tells the batch's callers its outcome, and wakes the next batch's
    /// leader: the first caller queued meanwhile (a caller that comes first
    /// takes the lead itself, and this one finds its change written or waits
    /// again).
    fn hand_over(
        &self,
        st: &mut Log<R>,
        done: Vec<Outcome>,
        res: &std::result::Result<(), String>,
    ) {
        let me = std::thread::current().id();
        for done in done {
            let _ = done.outcome.set(res.clone());
            if done.thread.id() != me {
                done.thread.unpark();
            }
        }
        st.writing = false;
        if let Some(next) = st.queue.first() {
            next.done.lead.store(true, Ordering::Release);
            next.done.thread.unpark();
        }
    }

    /// For each change of `batch`, whether it is a put that makes its record
    /// (none is there before it, in memory or earlier in the batch). Only a
    /// leader changes the map, so what it holds now is what the batch follows.
    pub(super) fn made_by(&self, batch: &[Pending<R>]) -> Vec<bool> {
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
}

/// The frames of one batch: each change, the last one marked as the batch's
/// end, each put marked when it makes its record.
fn encode_batch<R: Record>(batch: &[Pending<R>], made: &[bool], number: u64) -> Vec<u8> {
    let mut buf = Vec::new();
    for (i, (p, made)) in batch.iter().zip(made).enumerate() {
        frame::encode_frame(
            &mut buf,
            number,
            i + 1 == batch.len(),
            *made,
            p.kind,
            &p.id,
            &p.payload,
        );
    }
    buf
}
