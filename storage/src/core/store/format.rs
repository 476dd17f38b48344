//! The forms records take: in memory (packed), in the store's folder (the
//! names of its files, and what a listing of them says), in a snapshot (every
//! record as JSON, readable by any version) and in a packed image (a
//! snapshot's records as memory keeps them, sealed by the build).
//!
//! ```text
//! <dir>/snapshot.N    every record as of the start of log.N (absent: none)
//! <dir>/packed.N      the same records in their packed form (absent: none)
//! <dir>/log.N ...     the changes since, one batch per write + fdatasync
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use csi_sys::{dir, file};
use serde::{Deserialize, Serialize};

use super::frame::{self, Kind};
use super::Record;
use crate::error::{Context, Result};

/// A record as memory keeps it: its postcard encoding, about a fifth of the
/// decoded record with its strings, maps and lists (each their own allocation).
pub(super) struct Packed(pub(super) Box<[u8]>);

impl Packed {
    pub(super) fn of<R: Serialize>(record: &R) -> std::result::Result<Packed, String> {
        postcard::to_allocvec(record)
            .map(|v| Packed(v.into_boxed_slice()))
            .map_err(|e| format!("encoding the record for memory: {e}"))
    }

    /// The record. Every packed record was encoded from one of the same type by
    /// this process, so this fails only on a defect; the record is then left
    /// out of what is read (its data is never taken for an orphan: the map
    /// still holds its id).
    pub(super) fn open<R: Record>(&self) -> Option<R> {
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

pub(super) fn log_name(gen: u64) -> String {
    format!("log.{gen}")
}
pub(super) fn snapshot_name(gen: u64) -> String {
    format!("snapshot.{gen}")
}
pub(super) fn image_name(gen: u64) -> String {
    format!("packed.{gen}")
}

/// The files of a store directory, by kind.
#[derive(Default)]
pub(super) struct Listing {
    pub(super) snapshots: BTreeSet<u64>,
    pub(super) images: BTreeSet<u64>,
    pub(super) logs: BTreeSet<u64>,
    /// Records of the older layout.
    pub(super) legacy: Vec<String>,
    /// Damaged files set aside: of this layout (journals, snapshots) and stems of
    /// the older one.
    pub(super) corrupt: Vec<String>,
    pub(super) legacy_corrupt: BTreeSet<String>,
}

impl Listing {
    pub(super) fn read(dir: &Path) -> Result<Listing> {
        let mut l = Listing::default();
        let entries = dir::list(dir).context(|| format!("reading {}", dir.display()))?;
        for entry in entries {
            let name = entry.name;
            let gen = |prefix: &str| generation(&name, prefix);
            if name.starts_with('.') {
                // A temporary file of a write a crash interrupted: the rename never
                // happened, so what it was to replace is still whole.
                if name.ends_with(".tmp") {
                    let _ = file::remove_file_if_exists(&entry.path);
                    tracing::info!(path = %entry.path.display(), "removed an interrupted write");
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

/// Whether `name` is one of the files a store keeps: a snapshot, its packed
/// image or a journal (not a temporary, not a damaged file set aside).
pub fn is_store_file(name: &str) -> bool {
    ["log.", "snapshot.", "packed."]
        .iter()
        .any(|prefix| generation(name, prefix).is_some())
}

/// The generation N of a file named `<prefix>N`.
pub(super) fn generation(name: &str, prefix: &str) -> Option<u64> {
    name.strip_prefix(prefix)
        .filter(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))?
        .parse()
        .ok()
}

/// The flag of an image entry whose record is not settled.
pub(super) const UNSETTLED: u8 = 1;

/// Appends the frame of one record to a packed image: a flags byte, then the
/// record as memory keeps it.
pub(super) fn image_entry(out: &mut Vec<u8>, id: &str, packed: &Packed, settled: bool) {
    let mut payload = Vec::with_capacity(1 + packed.0.len());
    payload.push(if settled { 0 } else { UNSETTLED });
    payload.extend_from_slice(&packed.0);
    frame::encode(out, 0, false, Kind::Put, id, &payload);
}

/// What an image of records `R` written by this build next to a snapshot of
/// `snapshot_len` bytes says of itself: anything else is not read.
pub(super) fn image_identity<R: Record>(snapshot_len: u64) -> String {
    format!(
        "{} {} {} {snapshot_len}",
        env!("CARGO_PKG_VERSION"),
        std::any::type_name::<R>(),
        R::PACKED_LAYOUT
    )
}

/// Ends a packed image: its identity (an entry of no id), then the end mark.
pub(super) fn image_seal<R: Record>(out: &mut Vec<u8>, snapshot_len: u64) {
    frame::encode(
        out,
        0,
        false,
        Kind::Put,
        "",
        image_identity::<R>(snapshot_len).as_bytes(),
    );
    frame::encode(out, 0, true, Kind::End, "", b"");
}

/// The records of a packed image, as memory keeps them.
pub(super) struct Image<R: Record> {
    pub(super) records: BTreeMap<R::Id, Packed>,
    pub(super) unsettled: BTreeSet<R::Id>,
}

/// Reads `packed.gen` when it can stand for `snapshot.gen`: whole, sealed by
/// this build for these records, and written beside a snapshot of the length
/// that one has. None otherwise (an unusable image is removed: the next
/// compaction writes another).
pub(super) fn read_image<R: Record>(dir: &Path, gen: u64) -> Option<Image<R>> {
    let path = dir.join(image_name(gen));
    let bytes = match file::read(&path) {
        Ok(b) => b,
        Err(e) if e.is_not_found() => return None,
        Err(e) => {
            tracing::info!(path = %path.display(), error = %e, "packed image not read");
            return None;
        }
    };
    let snapshot_len = dir::stat(&dir.join(snapshot_name(gen))).ok()??.len;
    match image_records::<R>(&bytes, snapshot_len) {
        Ok(image) => Some(image),
        Err(why) => {
            tracing::info!(path = %path.display(), why, "packed image not used; reading the snapshot");
            let _ = file::remove_file_if_exists(&path);
            None
        }
    }
}

pub(super) fn image_records<R: Record>(
    bytes: &[u8],
    snapshot_len: u64,
) -> std::result::Result<Image<R>, String> {
    let scan = frame::scan(bytes, false);
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

/// Keeps `unsettled` the set of the records not settled, as `id` now is or not.
pub(super) fn mark<I: Ord>(unsettled: &mut BTreeSet<I>, id: I, settled: bool) {
    if settled {
        unsettled.remove(&id);
    } else {
        unsettled.insert(id);
    }
}

/// Writes the snapshot file `path`, crash-safely: a Put entry for each (id,
/// payload) of `entries`, then the End mark.
pub(super) fn write_snapshot<K, P>(
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
            frame::encode(&mut buf, 0, false, Kind::Put, id.as_ref(), payload.as_ref());
            w.write_all(&buf)?;
        }
        buf.clear();
        frame::encode(&mut buf, 0, true, Kind::End, "", b"");
        w.write_all(&buf)
    })
    .context(|| format!("writing {}", path.display()))
}

/// `f` of consecutive parts of `items`, in order, run on as many threads as the
/// machine has cores (one for few items).
pub(super) fn par_chunks<'a, T: Sync, U: Send>(
    items: &'a [T],
    f: impl Fn(&'a [T]) -> U + Sync,
) -> Vec<U> {
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
