//! The target's writing side of an arrival: pieces onto the image, the
//! ledger of what was written, and the rate meter with its cap.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use csi_sys::file::{self, AppendFile};
use csi_sys::image_io::ImageWriter;

use super::pieces::Entry;
use super::Piece;
use crate::error::{Context, Error, Result};

/// Writes a piece: its data over its cell (the rest of the cell zeros), its
/// run of zeros, or a patch over part of a cell (the rest kept). Where the
/// image started empty, zeros are holes already.
pub(super) fn write_piece(w: &ImageWriter, p: &Piece, fresh: bool) -> csi_sys::Result<()> {
    match p {
        Piece::Zero { offset, length } if !fresh => w.punch(*offset, *length),
        Piece::Zero { .. } => Ok(()),
        // A patch changes its own bytes only: the rest of the cell is the
        // base's, already in the image.
        Piece::Clear { offset, length } if !fresh => w.punch(*offset, *length),
        Piece::Clear { .. } => Ok(()),
        Piece::Patch { offset, data, .. } => {
            w.write_sparse(*offset, data, !fresh)?;
            if let Err(e) = w.start_writeback(*offset, data.len() as u64) {
                tracing::debug!(error = %e, "no early writeback; the checkpoint flushes it");
            }
            Ok(())
        }
        Piece::Data { offset, data, .. } => {
            if !fresh {
                let (start, end) = p.cells();
                let data_end = offset + data.len() as u64;
                w.punch(start, offset - start)?;
                w.punch(data_end, end.saturating_sub(data_end))?;
            }
            w.write_sparse(*offset, data, !fresh)?;
            // The disk takes the data as it comes: a checkpoint's sync then
            // waits for little, instead of for all written since the last.
            if let Err(e) = w.start_writeback(*offset, data.len() as u64) {
                tracing::debug!(error = %e, "no early writeback; the checkpoint flushes it");
            }
            Ok(())
        }
    }
}

/// The ledger an arrival keeps: the entries of the pieces written.
pub(super) struct LedgerFile {
    file: AppendFile,
    len: AtomicU64,
}

impl LedgerFile {
    /// The ledger at `path` with its first `entries` entries (the rest were
    /// never checkpointed).
    pub(super) fn open(path: &Path, entries: u64) -> Result<LedgerFile> {
        let at = || format!("opening the transfer ledger {}", path.display());
        let file = match AppendFile::open(path) {
            Ok(f) => f,
            Err(e) if e.is_not_found() => AppendFile::create(path).context(at)?,
            Err(e) => return Err(e).context(at),
        };
        Ok(LedgerFile {
            file,
            len: AtomicU64::new(entries),
        })
    }

    pub(super) fn len(&self) -> u64 {
        self.len.load(Ordering::Relaxed)
    }

    pub(super) fn append(&self, e: &Entry) -> Result<()> {
        let at = self.len() * Entry::BYTES as u64;
        self.file
            .write_at(at, &e.encode())
            .context(|| "writing the transfer ledger".to_string())?;
        self.len.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .context(|| "syncing the transfer ledger".to_string())
    }

    pub(super) fn truncate(&self) -> Result<()> {
        self.len.store(0, Ordering::Relaxed);
        self.file
            .truncate(0)
            .context(|| "emptying the transfer ledger".to_string())
    }

    /// The digest over its entries, and their count.
    pub(super) fn digest(&self) -> Result<([u8; 32], u64)> {
        let bytes =
            file::read(self.file.path()).context(|| "reading the transfer ledger".to_string())?;
        let mut l = super::pieces::Ledger::default();
        for chunk in bytes.chunks(Entry::BYTES).take(self.len() as usize) {
            let e = Entry::decode(chunk)
                .ok_or_else(|| Error::internal("the transfer ledger is damaged"))?;
            l.add(&e);
        }
        Ok((l.digest(), l.pieces))
    }
}

/// The rate of a transfer, and its cap.
pub(super) struct Meter {
    cap: u64,
    /// Since when, and after how many bytes, the cap holds.
    capped_from: (Instant, u64),
    bytes: u64,
    window: (Instant, u64),
    rate: u64,
}

impl Meter {
    pub(super) fn new(cap: u64) -> Meter {
        Meter {
            cap,
            capped_from: (Instant::now(), 0),
            bytes: 0,
            window: (Instant::now(), 0),
            rate: 0,
        }
    }

    pub(super) fn note(&mut self, n: u64) {
        self.bytes += n;
        let (t, b) = self.window;
        let dt = t.elapsed();
        if dt >= Duration::from_secs(1) {
            self.rate = ((self.bytes - b) as f64 / dt.as_secs_f64()) as u64;
            self.window = (Instant::now(), self.bytes);
        }
    }

    pub(super) fn rate(&self) -> u64 {
        self.rate
    }

    /// A new cap (0: none), which counts from now: what came before is not
    /// paid again, nor taken as credit.
    pub(super) fn set_cap(&mut self, cap: u64) {
        if cap != self.cap {
            self.cap = cap;
            self.capped_from = (Instant::now(), self.bytes);
        }
    }

    /// Sleeps as long as the cap asks (none without a cap).
    pub(super) fn wait(&self, stop: &AtomicBool) {
        if self.cap == 0 {
            return;
        }
        let (since, before) = self.capped_from;
        let due = Duration::from_secs_f64((self.bytes - before) as f64 / self.cap as f64);
        let spent = since.elapsed();
        if due > spent && !stop.load(Ordering::Relaxed) {
            std::thread::sleep((due - spent).min(Duration::from_secs(1)));
        }
    }
}
