//! The source side of a transfer: holds, and the pieces read from them.
//!
//! A hold lives in its source's pool, in the hidden folder `.holds/`: the
//! image (a reflink of the snapshot or of the frozen volume where the pool can,
//! else a sparse copy) and a small description beside it, written after the
//! image is durable. At start, an image without a description is removed, and
//! holds past their age are: a hold whose transfer never ended after a day, a
//! base after a week.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_sys::image_io::{ImageReader, BLOCK};
use csi_sys::{dir, file};
use serde::{Deserialize, Serialize};

use super::pieces::{Ledger, Sum, CELL};
use super::{Piece, Received, Trailer};
use crate::error::{Context, Error, Result};
use crate::ids::{SnapshotId, VolumeId};
use crate::locks::LockKey;
use crate::model::{Backing, RecordState, Timestamp};
use crate::pool::Pool;
use crate::Controller;

const HOLDS: &str = ".holds";
/// How long a hold waits for its transfer to end.
pub(super) const HOLD_AGE: Duration = Duration::from_secs(24 * 3600);
/// How long a base waits for the next transfer of its volume.
const BASE_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// Longest transfer id taken (a handle: an id and a node name).
const MAX_ID: usize = 512;

/// What a hold is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldSource {
    Snapshot(SnapshotId),
    Volume(VolumeId),
}

/// A hold, as its description keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldInfo {
    pub transfer_id: String,
    pub target_node: String,
    pub pool: String,
    pub size: u64,
    pub fs_type: Option<String>,
    pub source_volume: VolumeId,
    pub requested: Option<u64>,
    pub created: Timestamp,
    /// Kept after its transfer, for the next one of its volume to its node.
    pub base: bool,
    /// What a reader must show besides its certificate: made here, told to
    /// the controller, and by it to the target alone. Empty in holds made
    /// before holds had tokens.
    #[serde(default)]
    pub read_token: String,
    /// Of a directory volume or snapshot: the source's size. The hold is
    /// then its tree packed into one stream (`csi_sys::tree::pack_tree`),
    /// `size` bytes long; None for an image.
    #[serde(default)]
    pub tree: Option<u64>,
}

impl HoldInfo {
    /// Whether `token` is this hold's (in time that does not depend on where
    /// they differ).
    pub fn token_is(&self, token: &str) -> bool {
        self.read_token.is_empty()
            || blake3::hash(token.as_bytes()) == blake3::hash(self.read_token.as_bytes())
    }
}

/// A new read token: 244 random bits.
fn new_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// The file names of a transfer's hold: from a digest of its id, which may
/// hold any character.
fn key(transfer_id: &str) -> String {
    blake3::hash(transfer_id.as_bytes()).to_hex()[..32].to_string()
}

fn holds_dir(pool: &Pool) -> PathBuf {
    pool.root.join(HOLDS)
}

fn image_path(pool: &Pool, transfer_id: &str) -> PathBuf {
    holds_dir(pool).join(format!("{}.img", key(transfer_id)))
}

fn info_path(pool: &Pool, transfer_id: &str) -> PathBuf {
    holds_dir(pool).join(format!("{}.json", key(transfer_id)))
}

/// Packs the tree `src` into the new file `out`, the number of its entries
/// that changed meanwhile logged.
fn pack(src: &Path, out: &Path) -> csi_sys::Result<csi_sys::tree::Packed> {
    let packed = csi_sys::tree::pack_tree(src, out)?;
    let r = packed.report;
    if r.vanished + r.mounts_skipped + r.sockets_skipped > 0 {
        tracing::info!(src = %src.display(), entries = r.entries, vanished = r.vanished,
            mounts_skipped = r.mounts_skipped, sockets_skipped = r.sockets_skipped,
            "a directory packed for another node changed while it was packed");
    }
    Ok(packed)
}

fn check_id(transfer_id: &str) -> Result<()> {
    if transfer_id.is_empty() || transfer_id.len() > MAX_ID {
        return Err(Error::invalid(format!(
            "a transfer id of 1 to {MAX_ID} bytes is required"
        )));
    }
    Ok(())
}

fn read_info(path: &Path) -> Option<HoldInfo> {
    let bytes = file::read(path).ok()?;
    serde_json::from_slice(&bytes).ok()
}

pub(super) fn age(t: Timestamp) -> Duration {
    let now = Timestamp::now();
    Duration::from_secs(now.seconds.saturating_sub(t.seconds).max(0) as u64)
}

impl Controller {
    /// The hold of a transfer, with the pool it is in.
    fn find_hold(&self, transfer_id: &str) -> Option<(HoldInfo, &Pool)> {
        self.pools.values().find_map(|p| {
            let info = read_info(&info_path(p, transfer_id))?;
            (info.transfer_id == transfer_id).then_some((info, p))
        })
    }

    /// Makes the hold of a transfer to `target_node`; the hold made already
    /// for the same transfer when there is one.
    pub fn hold(
        &self,
        transfer_id: &str,
        target_node: &str,
        source: HoldSource,
    ) -> Result<HoldInfo> {
        check_id(transfer_id)?;
        if target_node.is_empty() || target_node == self.cfg.node_id {
            return Err(Error::invalid(format!(
                "a hold is for another node than this one, not {target_node:?}"
            )));
        }
        let (vid, sid) = match source {
            HoldSource::Snapshot(s) => (None, Some(s)),
            HoldSource::Volume(v) => (Some(v), None),
        };
        // A snapshot does not change while it is copied: holds of it share it.
        let _guard = self
            .locks
            .try_lock_with(vid.map(LockKey::Volume), sid.map(LockKey::Snapshot))?;
        if let Some((info, _)) = self.find_hold(transfer_id) {
            if info.target_node != target_node {
                return Err(Error::AlreadyExists(format!(
                    "transfer {transfer_id:?} is for node {}",
                    info.target_node
                )));
            }
            return Ok(info);
        }
        let (src_path, mut info, volume) = self.hold_source(source, transfer_id, target_node)?;
        let pool = self.pool(&info.pool)?.clone();
        let at = || format!("holding {} for transfer {transfer_id}", src_path.display());
        file::mkdir_p_mode(&holds_dir(&pool), 0o700).context(at)?;
        let img = image_path(&pool, transfer_id);
        let tmp = Pool::tmp_path(&img);
        file::remove_file_if_exists(&tmp).context(at)?;
        let copy = || file::copy_file_unsynced(&src_path, &tmp).map(|_| ());
        let made = match volume {
            // A directory travels as its tree packed: a live one as each entry
            // is when the walk reaches it, as a local clone copies it.
            _ if info.tree.is_some() => self.heavy(|| pack(&src_path, &tmp)).and_then(|r| {
                let packed = r.context(at)?;
                info.size = packed.bytes;
                Ok(())
            }),
            // A volume in use is frozen while it is copied, as for a snapshot.
            Some(v) => self
                .heavy(|| self.with_frozen(&[(v, src_path.clone())], || copy().context(at)))
                .and_then(|r| r),
            None => self.heavy(copy).and_then(|r| r.context(at)),
        };
        let made = made
            .and_then(|()| file::make_new_file_durable(&tmp).context(at))
            .and_then(|()| dir::rename_durably(&tmp, &img).context(at));
        if let Err(e) = made {
            return Err(e.with_cleanup(file::remove_file_if_exists(&tmp).map(drop).context(at)));
        }
        info.created = Timestamp::now();
        let json = serde_json::to_vec(&info).map_err(|e| Error::internal(e.to_string()))?;
        file::write_atomic(&info_path(&pool, transfer_id), &json).context(at)?;
        tracing::info!(
            transfer = transfer_id,
            target = target_node,
            size = info.size,
            "hold made for a transfer"
        );
        Ok(info)
    }

    /// The data a hold copies, its description and, for a volume, its id.
    fn hold_source(
        &self,
        source: HoldSource,
        transfer_id: &str,
        target_node: &str,
    ) -> Result<(PathBuf, HoldInfo, Option<VolumeId>)> {
        let info = |pool: &str, size, fs_type, source_volume, requested, backing| HoldInfo {
            transfer_id: transfer_id.to_string(),
            target_node: target_node.to_string(),
            pool: pool.to_string(),
            size,
            fs_type,
            source_volume,
            requested,
            created: Timestamp::now(),
            base: false,
            read_token: new_token(),
            // Its length is known once it is packed.
            tree: (backing != Backing::Image).then_some(size),
        };
        match source {
            HoldSource::Snapshot(s) => {
                let rec = self
                    .snapshots
                    .get(s)
                    .filter(|r| r.state == RecordState::Ready)
                    .ok_or_else(|| Error::not_found(format!("snapshot {s} does not exist")))?;
                let path = self.pool(&rec.pool)?.snapshot_path(s, rec.backing);
                let i = info(
                    &rec.pool,
                    rec.size,
                    rec.fs_type.clone(),
                    rec.source_volume,
                    rec.requested,
                    rec.backing,
                );
                Ok((path, i, None))
            }
            HoldSource::Volume(v) => {
                let rec = self
                    .volumes
                    .get(v)
                    .filter(|r| r.state == RecordState::Ready)
                    .ok_or_else(|| Error::not_found(format!("volume {v} does not exist")))?;
                let path = self.pool(&rec.pool)?.volume_path(v, rec.backing, false);
                crate::core::arrival::refuse_while_arriving(&path, "a copy of this volume")?;
                let i = info(
                    &rec.pool,
                    rec.size,
                    rec.fs_type.clone(),
                    v,
                    rec.requested,
                    rec.backing,
                );
                Ok((path, i, Some(v)))
            }
        }
    }

    /// The pieces of a hold for the peer `peer_is` recognizes (it must be the
    /// hold's target node) showing the hold's token, from `from` on: only what
    /// differs from the hold `base` when this node still has it as the base of
    /// the same volume for the same node, as patches where the target takes
    /// them (`patches`), else as whole cells. Its pieces carry BLAKE3 digests
    /// unless [`HoldStream::summed`] says otherwise.
    pub fn hold_stream(
        &self,
        transfer_id: &str,
        peer_is: &dyn Fn(&str) -> bool,
        token: &str,
        from: u64,
        base: Option<&str>,
        patches: bool,
    ) -> Result<HoldStream> {
        check_id(transfer_id)?;
        let (info, pool) = self
            .find_hold(transfer_id)
            .ok_or_else(|| Error::not_found(format!("no hold of transfer {transfer_id:?} here")))?;
        if !peer_is(&info.target_node) || !info.token_is(token) {
            return Err(Error::precondition(format!(
                "the hold of transfer {transfer_id:?} is for node {} and its token, not for the caller",
                info.target_node
            )));
        }
        // A transfer whose data all arrived reads on from its end (the end
        // of a packed tree is anywhere).
        if (!from.is_multiple_of(CELL) && from != info.size) || from > info.size {
            return Err(Error::invalid(format!(
                "a transfer resumes at a multiple of {CELL} within its {} bytes, not at {from}",
                info.size
            )));
        }
        let base = base
            .filter(|b| !b.is_empty() && *b != transfer_id)
            .and_then(|b| self.find_hold(b))
            .filter(|(b, _)| {
                b.base
                    && b.source_volume == info.source_volume
                    && b.target_node == info.target_node
                    && b.tree.is_none()
                    && info.tree.is_none()
            })
            .map(|(b, p)| image_path(p, &b.transfer_id));
        let img = image_path(pool, transfer_id);
        HoldStream::open(
            &img,
            info.size,
            from,
            base.as_deref(),
            pool.reflink,
            patches,
        )
    }

    /// The target is done with a hold: removed, or kept as the base of the
    /// next transfer of its volume to its node (the base kept before goes).
    pub fn release_hold(&self, transfer_id: &str, keep_as_base: bool) -> Result<()> {
        check_id(transfer_id)?;
        let Some((mut info, pool)) = self.find_hold(transfer_id) else {
            return Ok(());
        };
        let at = || format!("releasing the hold of transfer {transfer_id}");
        // A base serves the next transfers of its volume: none once the
        // volume is gone (deleted while its data was on the way).
        if !keep_as_base || !self.volumes.contains(info.source_volume) {
            return remove_hold(pool, transfer_id).context(at);
        }
        if !info.base {
            info.base = true;
            let json = serde_json::to_vec(&info).map_err(|e| Error::internal(e.to_string()))?;
            file::write_atomic(&info_path(pool, transfer_id), &json).context(at)?;
        }
        // The base kept before goes: its description now, its image once
        // this call has answered (it shares its extents with the volume's
        // snapshots, and freeing them takes a while the target need not wait).
        for (old, p) in self.holds_with_pools() {
            let same =
                old.source_volume == info.source_volume && old.target_node == info.target_node;
            if old.base && same && old.transfer_id != transfer_id {
                file::remove_file_if_exists(&info_path(p, &old.transfer_id)).context(at)?;
                super::remove_later(image_path(p, &old.transfer_id));
            }
        }
        Ok(())
    }

    fn holds_with_pools(&self) -> Vec<(HoldInfo, &Pool)> {
        let mut out = Vec::new();
        for p in self.pools.values() {
            for e in dir::list_if_exists(&holds_dir(p)).unwrap_or_default() {
                if e.name.ends_with(".json") {
                    if let Some(info) = read_info(&holds_dir(p).join(&e.name)) {
                        out.push((info, p));
                    }
                }
            }
        }
        out
    }

    /// Every hold of this node.
    pub fn holds(&self) -> Vec<HoldInfo> {
        self.holds_with_pools()
            .into_iter()
            .map(|(h, _)| h)
            .collect()
    }

    /// At start: removes what a crash left of holds being made, and holds past
    /// their age.
    pub(crate) fn recover_holds(&self) {
        for p in self.pools.values() {
            let dir_path = holds_dir(p);
            let entries = dir::list_if_exists(&dir_path).unwrap_or_default();
            let described: BTreeMap<String, HoldInfo> = entries
                .iter()
                .filter(|e| e.name.ends_with(".json"))
                .filter_map(|e| {
                    Some((
                        e.name.trim_end_matches(".json").to_string(),
                        read_info(&dir_path.join(&e.name))?,
                    ))
                })
                .collect();
            for e in &entries {
                let stem = e.name.split('.').find(|s| !s.is_empty()).unwrap_or("");
                let info = described.get(stem);
                // A base serves the next transfers of its volume only: it
                // goes with the volume (a crash may have kept it past it).
                let expired = info.is_some_and(|i| {
                    age(i.created) > if i.base { BASE_AGE } else { HOLD_AGE }
                        || (i.base && !self.volumes.contains(i.source_volume))
                });
                if info.is_none() || expired {
                    if let Err(e) = file::remove_file_if_exists(&dir_path.join(&e.name)) {
                        tracing::warn!(error = %e, "cannot remove what is left of a hold");
                    }
                }
            }
        }
    }
}

impl Controller {
    /// The base holds of `volume`, which is deleted: they served only its
    /// next transfers. Best effort: what is left goes at the next start.
    pub(crate) fn forget_bases_of(&self, volume: VolumeId) {
        for (h, p) in self.holds_with_pools() {
            if !(h.base && h.source_volume == volume) {
                continue;
            }
            match remove_hold(p, &h.transfer_id) {
                Ok(()) => tracing::info!(volume.id = %volume, transfer = %h.transfer_id,
                    "the base kept for the volume's next transfer went with it"),
                Err(e) => tracing::warn!(error = %e, "cannot remove the base of a deleted volume"),
            }
        }
    }
}

fn remove_hold(pool: &Pool, transfer_id: &str) -> csi_sys::Result<()> {
    // The description first: an image without one is an orphan, removed at start.
    file::remove_file_if_exists(&info_path(pool, transfer_id))?;
    file::remove_file_if_exists(&image_path(pool, transfer_id))?;
    Ok(())
}

/// What to send of a run of cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Cells of zeros `[start, end)`.
    Zeros(u64, u64),
    /// The allocated part `[start, end)` of one cell.
    Cell(u64, u64),
    /// A changed range `[start, end)` within one cell, the rest of it kept.
    Patch(u64, u64),
}

/// The pieces of a hold, read as they are sent, then its trailer.
pub struct HoldStream {
    reader: ImageReader,
    plan: std::vec::IntoIter<Plan>,
    /// How far reads were asked ahead of the pieces.
    asked_to: u64,
    from: u64,
    ledger: Ledger,
    incremental: bool,
    ended: bool,
    /// How each piece's data is summed.
    sum: Sum,
}

/// How far ahead of the pieces a hold is read.
const READ_AHEAD: u64 = 16 * CELL;

impl HoldStream {
    fn open(
        img: &Path,
        size: u64,
        from: u64,
        base: Option<&Path>,
        reflink: bool,
        patches: bool,
    ) -> Result<HoldStream> {
        let at = || format!("reading the hold {}", img.display());
        let reader = ImageReader::open(img).context(at)?;
        let size = size.min(reader.len().max(size));
        let changed = match base {
            Some(b) => {
                let (changed, method) =
                    crate::controller::metadata::changed_ranges(b, img, 0, size, reflink)
                        .context(at)?;
                tracing::debug!(
                    ranges = changed.len(),
                    ?method,
                    patches,
                    "a transfer sends what changed"
                );
                Some(changed)
            }
            None => None,
        };
        let plan = match &changed {
            Some(changed) if patches => patch_plan(changed, size),
            _ => {
                let cells = match &changed {
                    Some(changed) => cells_of(changed, size),
                    None => vec![(0, size)],
                };
                let allocated = reader.data_ranges(0, size).context(at)?;
                plan(&cells, &allocated, size)
            }
        };
        let incremental = changed.is_some();
        Ok(HoldStream {
            reader,
            plan: plan.into_iter(),
            asked_to: 0,
            from,
            ledger: Ledger::default(),
            incremental,
            ended: false,
            sum: Sum::Blake3,
        })
    }

    /// The same stream with its pieces summed as `sum` (what the target asked
    /// for).
    pub fn summed(self, sum: Sum) -> HoldStream {
        HoldStream { sum, ..self }
    }

    /// Asks the disk for the data of the next pieces (up to `READ_AHEAD`
    /// bytes of them) not asked for yet, so that their reads find it read.
    fn read_ahead(&mut self) {
        let mut ahead = 0;
        for item in self.plan.as_slice() {
            let (Plan::Cell(start, end) | Plan::Patch(start, end)) = *item else {
                continue;
            };
            if end > self.asked_to {
                let from = start.max(self.asked_to);
                self.reader.read_soon(from, end - from);
                self.asked_to = end;
            }
            ahead += end - start;
            if ahead >= READ_AHEAD {
                break;
            }
        }
    }

    /// The next piece of the plan, whether sent or only counted.
    fn next_piece(&mut self) -> Option<Result<Piece>> {
        self.read_ahead();
        let item = self.plan.next()?;
        Some(match item {
            Plan::Zeros(start, end) => Ok(Piece::Zero {
                offset: start,
                length: end - start,
            }),
            Plan::Cell(start, end) => {
                let mut data = vec![0u8; (end - start) as usize];
                match self.reader.read_at(start, &mut data) {
                    Err(e) => Err(e).context(|| "reading a hold".to_string()),
                    // Allocated zeros travel as zeros.
                    Ok(()) if data.iter().all(|b| *b == 0) => Ok(Piece::Zero {
                        offset: start / CELL * CELL,
                        length: (start / CELL * CELL + CELL).min(self.reader.len())
                            - start / CELL * CELL,
                    }),
                    Ok(()) => Ok(Piece::data_summed(start, data, self.sum)),
                }
            }
            Plan::Patch(start, end) => {
                let mut data = vec![0u8; (end - start) as usize];
                match self.reader.read_at(start, &mut data) {
                    Err(e) => Err(e).context(|| "reading a hold".to_string()),
                    // A range now empty is named, not sent.
                    Ok(()) if data.iter().all(|b| *b == 0) => Ok(Piece::Clear {
                        offset: start,
                        length: end - start,
                    }),
                    Ok(()) => Ok(Piece::patch_summed(start, data, self.sum)),
                }
            }
        })
    }
}

impl Iterator for HoldStream {
    type Item = Result<Received>;

    fn next(&mut self) -> Option<Result<Received>> {
        loop {
            let Some(piece) = self.next_piece() else {
                if self.ended {
                    return None;
                }
                self.ended = true;
                return Some(Ok(Received::Trailer(Trailer {
                    digest: self.ledger.digest(),
                    pieces: self.ledger.pieces,
                    data_bytes: self.ledger.data_bytes,
                    incremental: self.incremental,
                })));
            };
            let piece = match piece {
                Ok(p) => p,
                Err(e) => return Some(Err(e)),
            };
            self.ledger.add(&piece.entry());
            // Pieces before the resume point are counted, not sent.
            if piece.offset() + piece.length() <= self.from {
                continue;
            }
            return Some(Ok(Received::Piece(piece)));
        }
    }
}

/// The runs of whole cells that `ranges` touch.
fn cells_of(ranges: &[csi_sys::extents::ByteRange], size: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for r in ranges {
        let start = r.offset / CELL * CELL;
        let end = r.end().next_multiple_of(CELL).min(size);
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// The patches of the changed ranges `changed` of an image of `size` bytes:
/// the ranges merged where they touch, cut at each cell's boundary.
fn patch_plan(changed: &[csi_sys::extents::ByteRange], size: u64) -> Vec<Plan> {
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for r in changed {
        let (start, end) = (r.offset.min(size), r.end().min(size));
        if start >= end {
            continue;
        }
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    let mut out = Vec::new();
    for (mut start, end) in merged {
        while start < end {
            let stop = ((start / CELL + 1) * CELL).min(end);
            out.push(Plan::Patch(start, stop));
            start = stop;
        }
    }
    out
}

/// What to send of the runs of cells `cells` of an image whose allocated
/// ranges are `allocated`: each cell with data as its allocated part (from
/// its first to its last allocated block), and runs of cells without as zeros.
fn plan(cells: &[(u64, u64)], allocated: &[csi_sys::extents::ByteRange], size: u64) -> Vec<Plan> {
    let mut out = Vec::new();
    let mut zeros: Option<(u64, u64)> = None;
    let mut alloc = allocated.iter().peekable();
    let flush = |zeros: &mut Option<(u64, u64)>, out: &mut Vec<Plan>| {
        if let Some((s, e)) = zeros.take() {
            out.push(Plan::Zeros(s, e));
        }
    };
    for &(run_start, run_end) in cells {
        let mut cell = run_start;
        while cell < run_end {
            let end = (cell + CELL).min(size);
            // The allocated bytes within this cell.
            while alloc.peek().is_some_and(|r| r.end() <= cell) {
                alloc.next();
            }
            let mut first = None;
            let mut last = cell;
            let mut look = alloc.clone();
            while let Some(r) = look.peek() {
                if r.offset >= end {
                    break;
                }
                first.get_or_insert(r.offset.max(cell));
                last = r.end().min(end);
                look.next();
            }
            match first {
                None => match &mut zeros {
                    Some((_, e)) if *e == cell => *e = end,
                    _ => {
                        flush(&mut zeros, &mut out);
                        zeros = Some((cell, end));
                    }
                },
                Some(f) => {
                    flush(&mut zeros, &mut out);
                    let f = f / BLOCK * BLOCK;
                    let l = last.next_multiple_of(BLOCK).min(end);
                    out.push(Plan::Cell(f, l));
                }
            }
            cell = end;
        }
        flush(&mut zeros, &mut out);
    }
    flush(&mut zeros, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi_sys::extents::ByteRange;

    #[test]
    fn cells_with_data_send_their_allocated_part_and_empty_runs_send_zeros() {
        let size = 5 * CELL + 4096;
        let allocated = [
            ByteRange::new(4096, 8192),
            ByteRange::new(2 * CELL + 100, 10),
            ByteRange::new(5 * CELL, 4096),
        ];
        let p = plan(&[(0, size)], &allocated, size);
        assert_eq!(
            p,
            vec![
                Plan::Cell(4096, 3 * 4096),
                Plan::Zeros(CELL, 2 * CELL),
                Plan::Cell(2 * CELL, 2 * CELL + 4096),
                Plan::Zeros(3 * CELL, 5 * CELL),
                Plan::Cell(5 * CELL, 5 * CELL + 4096),
            ]
        );
    }

    #[test]
    fn a_delta_covers_the_cells_its_ranges_touch() {
        let size = 10 * CELL;
        let changed = [
            ByteRange::new(10, 20),
            ByteRange::new(CELL - 5, 10),
            ByteRange::new(7 * CELL, 1),
        ];
        assert_eq!(
            cells_of(&changed, size),
            vec![(0, 2 * CELL), (7 * CELL, 8 * CELL)]
        );
        // A changed cell that is now empty travels as zeros.
        let p = plan(&cells_of(&changed, size), &[ByteRange::new(0, 4096)], size);
        assert_eq!(
            p,
            vec![
                Plan::Cell(0, 4096),
                Plan::Zeros(CELL, 2 * CELL),
                Plan::Zeros(7 * CELL, 8 * CELL)
            ]
        );
    }

    #[test]
    fn patches_are_the_changed_ranges_cut_at_the_cells() {
        let size = 4 * CELL + 4096;
        let changed = [
            ByteRange::new(4096, 4096),
            ByteRange::new(8192, 4096),
            ByteRange::new(CELL - 4096, 8192),
            ByteRange::new(3 * CELL, 4 * CELL),
        ];
        assert_eq!(
            patch_plan(&changed, size),
            vec![
                Plan::Patch(4096, 3 * 4096),
                Plan::Patch(CELL - 4096, CELL),
                Plan::Patch(CELL, CELL + 4096),
                Plan::Patch(3 * CELL, 4 * CELL),
                Plan::Patch(4 * CELL, size),
            ]
        );
        assert!(patch_plan(&[ByteRange::new(size, 4096)], size).is_empty());
    }
}
