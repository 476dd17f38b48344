//! Compaction: when the journal outgrows the snapshot a background thread moves
//! writes to a new journal, then writes the records in memory (each durable
//! already) into a new snapshot (temporary file, fsync, rename, directory
//! fsync) a chunk at a time, so no caller waits for it and neither the old files
//! nor a copy of the records is held meanwhile; the new journal's replay settles
//! any record changed while it was written. Start-up reads one snapshot and one
//! journal.

use std::fmt::Display;
use std::io::Write;
use std::ops::Bound;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use csi_sys::file::{self, AppendFile};

use super::format::{image_entry, image_name, image_seal, log_name, snapshot_name, Listing};
use super::frame::{self, Kind};
use super::journal::Log;
use super::{Inner, Record, CHUNK};
use crate::error::{Context, Error, Result};
use crate::failpoint;

/// Ids handed to the compaction barrier per call (each call makes their data
/// durable, with an fsync each and one of their folder or with one syncfs).
pub(super) const BARRIER_PART: usize = 1024;

/// Entries a start may parse beyond twice the live records before the removals
/// that left them are compacted away.
pub(super) const SMALL_STORE: u64 = 1024;

impl<R: Record> Inner<R> {
    /// Whether to compact now (and then marked as compacting): once the journal
    /// holds [`Tuning::compact_at`] bytes, or once a start would parse more than
    /// twice the live records (and [`SMALL_STORE`] more) because many were removed
    /// since the snapshot; and in both cases only with as many entries as a
    /// quarter of the live records, so that a compaction costs each change a few
    /// records' worth of writing.
    pub(super) fn due(&self, st: &mut Log<R>, live: u64) -> bool {
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

    pub(super) fn start_compaction(self: &Arc<Self>) {
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

    pub(super) fn run_compaction(&self) {
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

    pub(super) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// An error once the store is closing, for a compaction to stop at.
    pub(super) fn go_on(&self) -> Result<()> {
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
    pub(super) fn compact(&self) -> Result<()> {
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
    pub(super) fn write_snapshot_of_memory(&self, gen: u64) -> Result<u64> {
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
                    frame::encode(&mut buf, 0, false, Kind::Put, &id, &payload);
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
        frame::encode(&mut buf, 0, true, Kind::End, "", b"");
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
