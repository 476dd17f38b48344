//! Snapshot metadata (changed block tracking) of image snapshots: which byte
//! ranges of a snapshot hold data, and which ranges differ between two snapshots
//! of one volume. Only image snapshots have block data; directory and subvolume
//! snapshots are refused.
//!
//! Allocated ranges are the data ranges of the snapshot's sparse image
//! (SEEK_DATA/SEEK_HOLE). A delta on a reflink pool comes from the physical
//! extents of the two images (FIEMAP): snapshots of one volume share every block
//! the volume did not rewrite between them, so a logical range whose physical
//! blocks differ, or that is mapped on one side only, may have changed. Where the
//! extents cannot tell, the two images are compared byte by byte.

use std::path::{Path, PathBuf};

use csi_sys::extents::{self, Extent, File};
pub use csi_sys::extents::{push_merged, ByteRange};

use crate::error::{Context, Error, Result};
use crate::ids::SnapshotId;
use crate::model::{Backing, RecordState, SnapshotRecord};
use crate::Controller;

/// Ranges per streamed message when the caller leaves max_results at 0.
pub const DEFAULT_MAX_RESULTS: usize = 256;

/// Most ranges per message whatever the caller asks (the spec lets the plugin
/// send fewer): keeps a message far below the server's 4 MiB limit.
pub const MAX_PER_MESSAGE: usize = 16384;

/// Granularity of the byte-by-byte comparison: the block size of the pools'
/// filesystems, so that both ways of computing a delta agree.
pub const COMPARE_BLOCK: u64 = 4096;

/// How a delta was computed (for logs and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaMethod {
    /// Allocated ranges only (GetMetadataAllocated).
    Allocation,
    /// Physical extents compared (FIEMAP) on a reflink pool.
    Extents,
    /// Data compared block by block over the ranges allocated in either image.
    Compare,
    /// Base and target are the same snapshot.
    Same,
}

/// The answer of a metadata call: the volume's capacity, the ranges (ascending,
/// not overlapping, none ending at or before the starting offset) and how many
/// go into one streamed message.
#[derive(Clone)]
pub struct BlockMap {
    pub capacity: u64,
    pub ranges: Vec<ByteRange>,
    pub per_message: usize,
    pub method: DeltaMethod,
}

/// Logged once per call: the counts, not the (possibly many) ranges.
impl std::fmt::Debug for BlockMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMap")
            .field("capacity", &self.capacity)
            .field("ranges", &self.ranges.len())
            .field("bytes", &self.ranges.iter().map(|r| r.length).sum::<u64>())
            .field("first", &self.ranges.first())
            .field("per_message", &self.per_message)
            .field("method", &self.method)
            .finish()
    }
}

impl BlockMap {
    /// The ranges in message-sized batches; at least one (maybe empty) batch, so
    /// that the caller always learns the capacity.
    pub fn batches(&self) -> Vec<&[ByteRange]> {
        if self.ranges.is_empty() {
            return vec![&[]];
        }
        self.ranges.chunks(self.per_message.max(1)).collect()
    }
}

fn per_message(max_results: i32) -> Result<usize> {
    match max_results {
        n if n < 0 => Err(Error::invalid(format!(
            "max_results must not be negative (got {n})"
        ))),
        0 => Ok(DEFAULT_MAX_RESULTS),
        n => Ok((n as usize).min(MAX_PER_MESSAGE)),
    }
}

/// Checks the starting offset against the capacity (the spec's OUT_OF_RANGE for a
/// negative offset or one beyond the volume).
fn start_offset(starting_offset: i64, capacity: u64) -> Result<u64> {
    if starting_offset < 0 {
        return Err(Error::OutOfRange(format!(
            "starting_offset must not be negative (got {starting_offset})"
        )));
    }
    let s = starting_offset as u64;
    if s > capacity {
        return Err(Error::OutOfRange(format!(
            "starting_offset {s} lies beyond the end of the volume ({capacity} bytes)"
        )));
    }
    Ok(s)
}

impl Controller {
    /// An image snapshot by id, and the path of its image.
    fn block_snapshot(&self, field: &str, id: &str) -> Result<(SnapshotRecord, PathBuf)> {
        if id.is_empty() {
            return Err(Error::invalid(format!("{field} is required")));
        }
        let sid = SnapshotId::parse(id)
            .ok_or_else(|| Error::not_found(format!("snapshot {id:?} does not exist")))?;
        let rec = self
            .snapshots
            .get(sid)
            .filter(|s| s.state == RecordState::Ready)
            .ok_or_else(|| Error::not_found(format!("snapshot {sid} does not exist")))?;
        if rec.backing != Backing::Image {
            return Err(Error::invalid(format!(
                "snapshot {sid} is of a directory volume: snapshot metadata describes \
                 the block data of image volumes only"
            )));
        }
        let path = self.pool(&rec.pool)?.snapshot_path(sid, Backing::Image);
        Ok((rec, path))
    }

    /// GetMetadataAllocated: the data ranges of a snapshot's image from
    /// `starting_offset` on (a range that straddles it starts there).
    pub fn metadata_allocated(
        &self,
        snapshot_id: &str,
        starting_offset: i64,
        max_results: i32,
    ) -> Result<BlockMap> {
        let per_message = per_message(max_results)?;
        let (rec, path) = self.block_snapshot("snapshot_id", snapshot_id)?;
        let start = start_offset(starting_offset, rec.size)?;
        let at = || format!("reading the block map of snapshot {}", rec.id);
        let f = extents::open_read(&path).context(at)?;
        let ranges = extents::data_ranges(&f, &path, start, rec.size).context(at)?;
        tracing::debug!(snapshot.id = %rec.id, start, ranges = ranges.len(), "allocated ranges");
        Ok(BlockMap {
            capacity: rec.size,
            ranges,
            per_message,
            method: DeltaMethod::Allocation,
        })
    }

    /// GetMetadataDelta: the ranges of `target` that may differ from `base`, both
    /// snapshots of one volume, from `starting_offset` on. The capacity is the
    /// target's size; past the base's end the base counts as zeros.
    pub fn metadata_delta(
        &self,
        base_snapshot_id: &str,
        target_snapshot_id: &str,
        starting_offset: i64,
        max_results: i32,
    ) -> Result<BlockMap> {
        let per_message = per_message(max_results)?;
        let (base, base_path) = self.block_snapshot("base_snapshot_id", base_snapshot_id)?;
        let (target, target_path) =
            self.block_snapshot("target_snapshot_id", target_snapshot_id)?;
        if base.source_volume != target.source_volume {
            return Err(Error::invalid(format!(
                "snapshots {} and {} are of different volumes ({} and {}); a delta is \
                 computed between two snapshots of the same volume",
                base.id, target.id, base.source_volume, target.source_volume
            )));
        }
        let capacity = target.size;
        let start = start_offset(starting_offset, capacity)?;
        let done = |ranges, method| BlockMap {
            capacity,
            ranges,
            per_message,
            method,
        };
        if base.id == target.id {
            return Ok(done(Vec::new(), DeltaMethod::Same));
        }
        let at = || format!("comparing snapshots {} and {}", base.id, target.id);
        let reflink = self.pool(&target.pool).map(|p| p.reflink).unwrap_or(false);
        let (ranges, method) =
            changed_ranges(&base_path, &target_path, start, capacity, reflink).context(at)?;
        match method {
            DeltaMethod::Extents => tracing::debug!(base = %base.id, target = %target.id, start,
                ranges = ranges.len(), "delta from shared extents"),
            _ => tracing::debug!(base = %base.id, target = %target.id, start,
                ranges = ranges.len(), "delta from comparing data"),
        }
        Ok(done(ranges, method))
    }
}

/// The ranges of the image at `target` that may differ from the one at `base`
/// (two copies of one volume) within `[start, capacity)`: from their shared
/// physical extents where the pool reflinks and the extents can tell, else by
/// comparing their data.
pub(crate) fn changed_ranges(
    base: &Path,
    target: &Path,
    start: u64,
    capacity: u64,
    reflink: bool,
) -> csi_sys::Result<(Vec<ByteRange>, DeltaMethod)> {
    let fb = extents::open_read(base)?;
    let ft = extents::open_read(target)?;
    if reflink {
        match (
            extents::fiemap(&fb, base, start, capacity),
            extents::fiemap(&ft, target, start, capacity),
        ) {
            (Ok(b), Ok(t)) if extents_can_tell(&b, &t) => {
                return Ok((extent_delta(&b, &t, start, capacity), DeltaMethod::Extents))
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::debug!(error = %e, "FIEMAP failed; comparing data instead")
            }
            _ => tracing::debug!("the images share no extents; comparing data instead"),
        }
    }
    // When the extents cannot tell (a pool without reflink, where copies are
    // copies, or images that share no extent).
    let ranges = compare_data((&fb, base), (&ft, target), start, capacity)?;
    Ok((ranges, DeltaMethod::Compare))
}

/// The ranges where two images' data differ, from `start` to `capacity`:
/// compared block by block, in chunks of 1 MiB, but only over the ranges
/// allocated in either image, since holes on both sides read as zeros on both.
fn compare_data(
    base: (&File, &Path),
    target: (&File, &Path),
    start: u64,
    capacity: u64,
) -> csi_sys::Result<Vec<ByteRange>> {
    let (fb, base_path) = base;
    let (ft, target_path) = target;
    let mut either = Vec::new();
    let mut b = extents::data_ranges(fb, base_path, start, capacity)?
        .into_iter()
        .peekable();
    let mut t = extents::data_ranges(ft, target_path, start, capacity)?
        .into_iter()
        .peekable();
    loop {
        let next = match (b.peek(), t.peek()) {
            (Some(x), Some(y)) if x.offset <= y.offset => b.next(),
            (Some(_), Some(_)) => t.next(),
            (Some(_), None) => b.next(),
            (None, Some(_)) => t.next(),
            (None, None) => None,
        };
        let Some(r) = next else { break };
        push_merged(&mut either, r);
    }
    let mut ranges = Vec::new();
    for r in either {
        let diff = extents::differing_blocks(
            (fb, base_path),
            (ft, target_path),
            r.offset,
            r.end().min(capacity),
            COMPARE_BLOCK,
        )?;
        for d in diff {
            push_merged(&mut ranges, d);
        }
    }
    Ok(ranges)
}

/// Whether FIEMAP can answer: unless one image has no extents at all, the two
/// must share at least one physical block (else they are independent copies and
/// every block would count as changed).
fn extents_can_tell(base: &[Extent], target: &[Extent]) -> bool {
    if base.is_empty() || target.is_empty() {
        return true;
    }
    let mut i = 0;
    for t in target {
        while i < base.len() && base[i].end() <= t.logical {
            i += 1;
        }
        let mut j = i;
        while j < base.len() && base[j].logical < t.end() {
            if same_blocks(&base[j], t, base[j].logical.max(t.logical)) {
                return true;
            }
            j += 1;
        }
    }
    false
}

/// Whether the block at logical offset `pos` (inside both extents) is the same
/// physical block in both.
fn same_blocks(a: &Extent, b: &Extent, pos: u64) -> bool {
    !a.uncertain()
        && !b.uncertain()
        && a.physical.wrapping_add(pos - a.logical) == b.physical.wrapping_add(pos - b.logical)
}

/// The logical ranges within `[start, end)` where the two extent maps differ: the
/// physical blocks differ, the range is mapped on one side only (in the target
/// but not the base: new data; in the base but a hole in the target: now zeros),
/// or either side's address is uncertain (conservatively changed).
pub fn extent_delta(base: &[Extent], target: &[Extent], start: u64, end: u64) -> Vec<ByteRange> {
    // Every extent edge inside the window splits it into segments that are each
    // wholly inside or outside each extent.
    let mut cuts: Vec<u64> = vec![start, end];
    for e in base.iter().chain(target) {
        for p in [e.logical, e.end()] {
            if p > start && p < end {
                cuts.push(p);
            }
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    let covering = |map: &[Extent], pos: u64| -> Option<Extent> {
        let i = map.partition_point(|e| e.end() <= pos);
        map.get(i).filter(|e| e.logical <= pos).copied()
    };
    let mut out = Vec::new();
    for w in cuts.windows(2) {
        let (s, e) = (w[0], w[1]);
        let changed = match (covering(base, s), covering(target, s)) {
            (None, None) => false,
            (Some(a), Some(b)) => !same_blocks(&a, &b, s),
            _ => true,
        };
        if changed {
            push_merged(&mut out, ByteRange::new(s, e - s));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(logical: u64, physical: u64, length: u64) -> Extent {
        Extent {
            logical,
            physical,
            length,
            flags: 0,
        }
    }

    #[test]
    fn shared_blocks_are_unchanged_and_new_ones_changed() {
        let base = [ext(0, 1000, 100), ext(200, 5000, 100)];
        // Target: first extent split, middle rewritten; a new extent at 400;
        // base's extent at 200 punched out (now zeros).
        let target = [
            ext(0, 1000, 40),
            ext(40, 9000, 20),
            ext(60, 1060, 40),
            ext(400, 7000, 50),
        ];
        let d = extent_delta(&base, &target, 0, 1000);
        assert_eq!(
            d,
            vec![
                ByteRange::new(40, 20),
                ByteRange::new(200, 100),
                ByteRange::new(400, 50)
            ]
        );
        // The window cuts ranges at its start.
        let d = extent_delta(&base, &target, 250, 1000);
        assert_eq!(d, vec![ByteRange::new(250, 50), ByteRange::new(400, 50)]);
        assert!(extents_can_tell(&base, &target));
    }

    #[test]
    fn uncertain_extents_count_as_changed() {
        let mut e = ext(0, 1000, 100);
        e.flags = extents::FIEMAP_EXTENT_DELALLOC;
        let d = extent_delta(&[ext(0, 1000, 100)], &[e], 0, 100);
        assert_eq!(d, vec![ByteRange::new(0, 100)]);
    }

    #[test]
    fn unshared_copies_need_a_comparison() {
        assert!(!extents_can_tell(
            &[ext(0, 1000, 100)],
            &[ext(0, 2000, 100)]
        ));
        assert!(extents_can_tell(&[], &[ext(0, 2000, 100)]));
    }

    #[test]
    fn batches_respect_max_results() {
        let m = BlockMap {
            capacity: 10,
            ranges: (0..5).map(|i| ByteRange::new(i * 2, 1)).collect(),
            per_message: per_message(2).unwrap(),
            method: DeltaMethod::Allocation,
        };
        let b = m.batches();
        assert_eq!(b.iter().map(|b| b.len()).collect::<Vec<_>>(), vec![2, 2, 1]);
        assert!(per_message(-1).is_err());
        assert_eq!(per_message(0).unwrap(), DEFAULT_MAX_RESULTS);
        assert!(start_offset(-1, 10).is_err());
        assert!(start_offset(11, 10).is_err());
        assert_eq!(start_offset(10, 10).unwrap(), 10);
    }
}
