//! One try of an arrival: the source's pieces checked, written and entered
//! in the ledger as they come, made durable at checkpoints on a thread of
//! their own, paced by the caps; then the whole checked against the source's
//! ledger and the volume handed over.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};
use std::thread::Scope;
use std::time::{Duration, Instant};

use csi_sys::image_io::ImageWriter;
use csi_sys::{dir, file};

use super::arrive::{packed_path, ArrivalRecord, Job, TransferStatus};
use super::pieces::Checker;
use super::target::{write_piece, LedgerFile, Meter};
use super::{Piece, Received, Source, Trailer};
use crate::core::arrival;
use crate::error::{Context, Error, Result};
use crate::model::Backing;
use crate::Controller;

/// Bytes written between two checkpoints, at most.
const CHECKPOINT_BYTES: u64 = 64 << 20;
/// Time between two checkpoints, at most.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(2);
/// Checkpoints due while one is under way before the transfer waits for it.
const CHECKPOINTS_BEHIND: u64 = 4;
/// Time between two looks at the volume's cap (ControllerModifyVolume may
/// change it while its data arrives).
const CAP_LOOK_EVERY: Duration = Duration::from_millis(500);

/// The thread of a transfer's checkpoints ended before answering.
fn gone() -> Error {
    Error::internal("the transfer's checkpoint thread ended")
}

/// The checkpoints of one try, made on a thread of their own while the next
/// pieces are written: the writes never wait for the disk's flushes. Each
/// records only what was written before its flush began.
struct Checkpoints {
    ask: SyncSender<ArrivalRecord>,
    told: Receiver<Result<()>>,
    in_flight: bool,
    /// How far the record moved since the last checkpoint was asked for.
    unsynced: u64,
    last: Instant,
}

impl Checkpoints {
    fn start<'scope, 'env: 'scope>(
        scope: &'scope Scope<'scope, 'env>,
        ctl: &'env Controller,
        writer: &'env ImageWriter,
        ledger: &'env LedgerFile,
        job: &'env Job,
    ) -> Checkpoints {
        let (ask, asked) = std::sync::mpsc::sync_channel::<ArrivalRecord>(1);
        let (tell, told) = std::sync::mpsc::channel::<Result<()>>();
        scope.spawn(move || {
            for mut at in asked {
                let (progress, entries) = (at.progress, at.entries);
                let made = ctl.checkpoint(writer, ledger, &mut at, progress, entries);
                if made.is_ok() {
                    // What the status calls done is durable: a crash now
                    // goes on from here, never from below.
                    job.set(|s| s.bytes_done = progress);
                }
                if tell.send(made).is_err() {
                    break;
                }
            }
        });
        Checkpoints {
            ask,
            told,
            in_flight: false,
            unsynced: 0,
            last: Instant::now(),
        }
    }

    /// The record moved on by `by` bytes: a checkpoint of it is asked for
    /// when one is due. One at a time: a due one waits for the one under
    /// way, past a few of them for good.
    fn advanced(&mut self, by: u64, rec: &ArrivalRecord) -> Result<()> {
        self.unsynced += by;
        if self.unsynced < CHECKPOINT_BYTES && self.last.elapsed() < CHECKPOINT_EVERY {
            return Ok(());
        }
        let ready = match self.in_flight {
            false => true,
            true if self.unsynced >= CHECKPOINT_BYTES * CHECKPOINTS_BEHIND => {
                self.told.recv().map_err(|_| gone())??;
                true
            }
            true => match self.told.try_recv() {
                Ok(made) => {
                    made?;
                    true
                }
                Err(TryRecvError::Empty) => false,
                Err(TryRecvError::Disconnected) => return Err(gone()),
            },
        };
        if ready {
            self.ask.send(rec.clone()).map_err(|_| gone())?;
            self.in_flight = true;
            self.unsynced = 0;
            self.last = Instant::now();
        }
        Ok(())
    }

    /// Waits for the checkpoint under way, if one is.
    fn drain(&mut self) -> Result<()> {
        if std::mem::take(&mut self.in_flight) {
            self.told.recv().map_err(|_| gone())??;
        }
        Ok(())
    }
}

/// The pieces of one try as they are placed.
struct Placing {
    checker: Checker,
    /// A fresh image holds holes where zeros come: nothing to punch.
    fresh: bool,
    /// The cell the last pieces patched, and the ledger's length before its
    /// first patch: until the cell is done, a checkpoint records the
    /// transfer at the cell's start (a resumed read sends all of its
    /// patches again).
    open_cell: Option<(u64, u64)>,
}

impl Placing {
    fn new(rec: &ArrivalRecord, volume_size: u64) -> Placing {
        let fresh = rec.base.is_none();
        Placing {
            // A target that starts from its base takes patches of cells.
            checker: Checker::new(rec.progress, volume_size.max(rec.size), !fresh),
            fresh,
            open_cell: None,
        }
    }

    /// Checks piece `p`, writes it and enters it in the ledger; moves `rec`
    /// on to what a checkpoint may then record, and answers by how much.
    fn place(
        &mut self,
        p: &Piece,
        writer: &ImageWriter,
        ledger: &LedgerFile,
        rec: &mut ArrivalRecord,
    ) -> Result<u64> {
        self.checker.check(p)?;
        write_piece(writer, p, self.fresh)
            .context(|| format!("writing the arriving volume {}", rec.volume))?;
        let (cell, cell_end) = p.cells();
        if self.open_cell.is_none_or(|(c, _)| c != cell) {
            self.open_cell = Some((cell, ledger.len()));
        }
        ledger.append(&p.entry())?;
        let end = p.offset() + p.length();
        let (progress, entries) = match self.open_cell {
            Some((c, before)) if p.is_patch() && end < cell_end.min(rec.size) => (c, before),
            _ => (cell_end, ledger.len()),
        };
        if progress < cell_end {
            // Between two patches of one cell: a test holds the transfer
            // here past a checkpoint's time, or breaks it here.
            crate::failpoint::hit("transfer.inside-a-patched-cell");
            crate::failpoint::fail("transfer.inside-a-patched-cell")
                .map_err(|e| Error::Aborted(e.to_string()))?;
        }
        let progress = progress.min(rec.size).max(rec.progress);
        let moved = progress - rec.progress;
        rec.progress = progress;
        rec.entries = entries;
        Ok(moved)
    }
}

/// How fast one try goes: the volume's own cap (its class or attributes,
/// looked at again now and then: a change counts from the next look) and
/// the node's, shared by all of its transfers.
struct Pacing {
    meter: Meter,
    cap_seen: Instant,
}

impl Pacing {
    fn new(vol: &crate::model::VolumeRecord) -> Pacing {
        Pacing {
            meter: Meter::new(crate::volumes::transfer_cap(vol)),
            cap_seen: Instant::now(),
        }
    }

    /// After a piece of `n` bytes of data: the rate shown, then as long a
    /// wait as the caps ask for.
    fn after(&mut self, ctl: &Controller, rec: &ArrivalRecord, job: &Job, n: u64) {
        self.meter.note(n);
        let rate = self.meter.rate();
        job.set(|s| s.rate = rate);
        if self.cap_seen.elapsed() >= CAP_LOOK_EVERY {
            self.cap_seen = Instant::now();
            if let Some(v) = ctl.volumes.get(rec.volume) {
                self.meter.set_cap(crate::volumes::transfer_cap(&v));
            }
        }
        self.meter.wait(&job.stop);
        ctl.arrivals.pace(ctl.cfg.transfer_bandwidth, n, job);
    }
}

impl Controller {
    /// One try of a transfer, from its last checkpoint: Ok(true) once the
    /// volume is whole, Ok(false) when stopped.
    pub(super) fn arrive_once(&self, job: &Job, rec: &mut ArrivalRecord) -> Result<bool> {
        let mut source = self.source_of(rec)?;
        let vol = self
            .volumes
            .get(rec.volume)
            .ok_or_else(|| Error::not_found(format!("volume {} is gone", rec.volume)))?;
        let pool = self.pool(&vol.pool)?;
        // A directory's packed tree arrives beside it.
        let image = match rec.tree {
            true => packed_path(pool, vol.id),
            false => pool.volume_path(vol.id, Backing::Image, false),
        };
        let writer = ImageWriter::open(&image)
            .context(|| format!("writing the arriving volume {}", vol.id))?;
        let ledger = LedgerFile::open(&self.ledger_path(rec.volume), rec.entries)?;
        job.set(|s| {
            s.state = "running".into();
            s.message.clear();
            s.resumed = rec.resumed;
        });
        let mut placing = Placing::new(rec, vol.size);
        let mut pacing = Pacing::new(&vol);
        let stream = source.read(rec.progress, rec.base.as_deref(), &job.stop)?;
        let trailer = std::thread::scope(|scope| -> Result<Option<Trailer>> {
            let mut checkpoints = Checkpoints::start(scope, self, &writer, &ledger, job);
            for item in stream {
                if job.stop.load(Ordering::Relaxed) {
                    return Ok(None);
                }
                let p = match item? {
                    Received::Piece(p) => p,
                    Received::Trailer(t) => {
                        checkpoints.drain()?;
                        return Ok(Some(t));
                    }
                };
                let moved = placing.place(&p, &writer, &ledger, rec)?;
                checkpoints.advanced(moved, rec)?;
                pacing.after(self, rec, job, p.data_len());
            }
            checkpoints.drain()?;
            Ok(None)
        })?;
        if job.stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let Some(t) = trailer else {
            return Err(Error::Aborted(format!(
                "node {} stopped sending before the end of transfer {}",
                rec.source_node, rec.transfer_id
            )));
        };
        tracing::debug!(volume.id = %rec.volume, transfer = %rec.transfer_id,
            "the last piece arrived; the volume is made durable and checked");
        self.checkpoint(&writer, &ledger, rec, rec.size, ledger.len())?;
        self.finish(&image, rec, &t, &ledger, source.as_mut(), job)?;
        Ok(true)
    }

    /// The arrival is done, its data whole and durable: so the list of
    /// arrivals that ended says, on disk, before its record goes (a restart
    /// in between ends it again). Its own status says so once the source is
    /// told ([`Self::hand_over`]).
    fn done(&self, job: &Job, rec: &ArrivalRecord, t: &Trailer) -> TransferStatus {
        let mut s = job.status();
        s.state = "done".into();
        s.bytes_done = rec.size;
        s.incremental = t.incremental;
        s.data_bytes = t.data_bytes;
        s.ended_seconds = crate::model::Timestamp::now().seconds;
        self.remember_arrival(s.clone());
        s
    }

    /// The source node of an arrival, as the mesh reaches it.
    fn source_of(&self, rec: &ArrivalRecord) -> Result<Box<dyn Source>> {
        let sources = self
            .arrivals
            .sources
            .get()
            .ok_or_else(|| Error::internal("no mesh to reach the source through"))?;
        Ok(sources(&rec.source_node, &rec.transfer_id, &rec.read_token))
    }

    /// Makes everything written durable, then moves the record on.
    fn checkpoint(
        &self,
        writer: &ImageWriter,
        ledger: &LedgerFile,
        rec: &mut ArrivalRecord,
        progress: u64,
        entries: u64,
    ) -> Result<()> {
        writer
            .sync_data()
            .context(|| format!("syncing the arriving volume {}", rec.volume))?;
        ledger.sync()?;
        rec.progress = progress;
        rec.entries = entries;
        crate::failpoint::hit("transfer.after-checkpoint-data");
        self.write_arrival(rec)?;
        crate::failpoint::hit("transfer.after-checkpoint");
        Ok(())
    }

    /// The end of a transfer: its ledger checked whole against the source's,
    /// the mark cleared, a replica kept for the next transfer of the volume,
    /// the source's hold kept there as that transfer's base.
    fn finish(
        &self,
        image: &Path,
        rec: &mut ArrivalRecord,
        trailer: &Trailer,
        ledger: &LedgerFile,
        source: &mut dyn Source,
        job: &Job,
    ) -> Result<()> {
        let ours = ledger.digest()?;
        if ours.0 != trailer.digest || ours.1 != trailer.pieces {
            // Something was lost or doubled on the way: start over.
            rec.progress = 0;
            rec.entries = 0;
            ledger.truncate()?;
            self.write_arrival(rec)?;
            return Err(Error::internal(format!(
                "transfer {} arrived with {} pieces against the {} node {} sent, or with \
                 other digests; it starts over",
                rec.transfer_id, ours.1, trailer.pieces, rec.source_node
            )));
        }
        if rec.tree {
            return self.finish_tree(image, rec, trailer, source, job);
        }
        crate::failpoint::hit("transfer.before-unmark");
        arrival::clear(image)?;
        let vol = self.volumes.get(rec.volume);
        if let Some(pool) = vol.and_then(|v| self.pool(&v.pool).ok().cloned()) {
            self.keep_replica(&pool, image, rec);
        }
        self.hand_over(rec, trailer, source, job, true)?;
        tracing::info!(volume.id = %rec.volume, transfer = %rec.transfer_id,
            pieces = trailer.pieces, bytes = trailer.data_bytes,
            incremental = trailer.incremental, resumed = rec.resumed,
            "all of the volume's data arrived and is durable");
        Ok(())
    }

    /// The end of a directory's transfer, its packed tree whole and durable:
    /// unpacked into the volume (emptied first: a crash may have cut an
    /// earlier unpack short), then the mark cleared. A volume no longer
    /// marked was unpacked already, and may be in use: it is left alone.
    fn finish_tree(
        &self,
        packed: &Path,
        rec: &mut ArrivalRecord,
        trailer: &Trailer,
        source: &mut dyn Source,
        job: &Job,
    ) -> Result<()> {
        let vol = self
            .volumes
            .get(rec.volume)
            .ok_or_else(|| Error::not_found(format!("volume {} is gone", rec.volume)))?;
        let path = self
            .pool(&vol.pool)?
            .volume_path(vol.id, vol.backing, false);
        let at = || format!("unpacking the arrived directory of volume {}", vol.id);
        if arrival::arriving_from(&path)?.is_some() {
            for e in dir::list(&path).context(at)? {
                file::remove_tree(&path.join(&e.name)).context(at)?;
            }
            crate::failpoint::hit("transfer.before-unpack");
            // Its data fits what the source sent, which fits the stream.
            let report = self
                .heavy(|| csi_sys::tree::unpack_tree(packed, &path, rec.size))?
                .context(at)?;
            tracing::debug!(volume.id = %vol.id, entries = report.entries, "directory unpacked");
            crate::failpoint::hit("transfer.before-unmark");
            arrival::clear(&path)?;
        }
        // A packed tree is no base for the next transfer: it goes.
        self.hand_over(rec, trailer, source, job, false)?;
        tracing::info!(volume.id = %rec.volume, transfer = %rec.transfer_id,
            pieces = trailer.pieces, bytes = trailer.data_bytes, resumed = rec.resumed,
            "all of the directory's data arrived and is durable");
        Ok(())
    }

    /// The last steps of every arrival, in the order a crash between any two
    /// needs: the ended arrival on disk and the source's release noted before
    /// the record goes (a restart ends it again, or retries the release); the
    /// source told; the status done only then. `keep_as_base`: the source keeps
    /// what it sent as the base of the volume's next transfer.
    fn hand_over(
        &self,
        rec: &ArrivalRecord,
        trailer: &Trailer,
        source: &mut dyn Source,
        job: &Job,
        keep_as_base: bool,
    ) -> Result<()> {
        let done = self.done(job, rec, trailer);
        let note = self.note_release(rec, keep_as_base)?;
        self.remove_arrival(rec.volume)?;
        self.tell_release(note, Some(source));
        job.set(|s| *s = done);
        Ok(())
    }
}
