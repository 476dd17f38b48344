//! Opening a store: its files read back into memory (a packed image when one
//! can stand for the snapshot, else the snapshot parsed on every core, then the
//! journal replayed over it), what a crash left cut off or half-made, damaged
//! entries quarantined rather than lost, and a store of the older layout (one
//! `<id>.json` per record) converted. Also the raw reads and writes of a store
//! that is not open, for tests and tools.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use csi_sys::dir;
use csi_sys::file::{self, AppendFile};

use super::format::{
    image_name, log_name, mark, par_chunks, read_image, snapshot_name, write_snapshot, Image,
    Listing, Packed,
};
use super::frame::{self, Entry, Kind};
use super::journal::Log;
use super::{Inner, Record, Store, Tuning};
use crate::error::{Context, Error, Result};
use crate::failpoint;

/// What the files of a store say about their entries, besides the entries.
#[derive(Default)]
pub(super) struct Replay {
    /// Ids with a damaged entry.
    pub(super) unreadable: BTreeSet<String>,
    pub(super) blind: bool,
    pub(super) last_batch: u64,
    /// Entries in the journals.
    pub(super) logged: u64,
}

/// Reads `snapshot.base` (if any) and the journals `logs`, in order: each
/// file's name and bytes.
pub(super) fn read_files(
    dir: &Path,
    base: Option<u64>,
    logs: &[u64],
) -> Result<Vec<(String, Vec<u8>)>> {
    let mut bufs = Vec::new();
    for name in base
        .map(snapshot_name)
        .into_iter()
        .chain(logs.iter().map(|g| log_name(*g)))
    {
        let path = dir.join(&name);
        let bytes = file::read(&path).context(|| format!("reading {}", path.display()))?;
        bufs.push((name, bytes));
    }
    Ok(bufs)
}

/// The frames of files [`read_files`] read, with each file's name and whether it
/// is a journal.
pub(super) fn scan_files(bufs: &[(String, Vec<u8>)]) -> Vec<(String, bool, frame::Scan<'_>)> {
    bufs.iter()
        .map(|(name, bytes)| {
            let is_log = name.starts_with("log.");
            (name.clone(), is_log, frame::scan(bytes, is_log))
        })
        .collect()
}

/// Removes what a compaction that finished left behind (files older than
/// generation `from`, packed images of other snapshots than the newest), and
/// records of the older layout a finished conversion had not removed yet.
pub(super) fn remove_stale(dir: &Path, listing: &Listing, from: u64) -> Result<()> {
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
pub(super) fn open_journal(
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
    pub(super) fn tally(
        dir: &Path,
        bufs: &[(String, Vec<u8>)],
        scans: &[(String, bool, frame::Scan<'_>)],
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
    pub(super) fn note_set_aside(&mut self, dir: &Path, corrupt: &[String]) {
        for name in corrupt {
            let Ok(bytes) = file::read(&dir.join(name)) else {
                continue;
            };
            let scan = frame::scan(&bytes, name.starts_with("log."));
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

/// The records of a store's files, as open builds them.
pub(super) struct Loaded<R: Record> {
    pub(super) records: BTreeMap<R::Id, Packed>,
    /// The ids of records not settled.
    pub(super) unsettled: BTreeSet<R::Id>,
    /// Records the journals made.
    pub(super) born: Vec<R::Id>,
    /// Ids whose last entry is damaged.
    pub(super) unreadable: BTreeSet<String>,
}

impl<R: Record> Loaded<R> {
    /// Parses the snapshot's records (each id once, so the map is built from them
    /// at once), then replays the journals' entries over them in order. Start-up
    /// time is mostly this: the payloads are parsed on every core, and no copy of
    /// the records is made besides the one the map keeps.
    pub(super) fn from_scans(
        image: Option<Image<R>>,
        scans: &[(String, bool, frame::Scan<'_>)],
    ) -> Self {
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

    pub(super) fn load_snapshot(&mut self, entries: &[Entry<'_>]) {
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
    pub(super) fn replay(&mut self, entries: &[Entry<'_>], born: &mut BTreeSet<R::Id>) {
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
    pub(super) fn refuse(&mut self, id: &str, why: &str) {
        tracing::error!(id, error = %why, "a record entry is unreadable");
        if let Some(k) = R::parse_id(id) {
            self.records.remove(&k);
            self.unsettled.remove(&k);
        }
        self.unreadable.insert(id.to_string());
    }
}

/// A parsed record: its id, packed, and whether it is settled.
pub(super) type Parsed<R> = (<R as Record>::Id, Packed, bool);

/// The record a put entry holds, packed (None for other entries), or why it
/// cannot be read: a damaged entry, a payload that does not parse, or one
/// naming another id.
pub(super) fn parse_entry<R: Record>(
    e: &Entry<'_>,
) -> std::result::Result<Option<Parsed<R>>, String> {
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

/// Keeps a copy of a damaged file beside it (once), for people to look at and
/// for the next starts to keep its records' data.
pub(super) fn set_aside(dir: &Path, name: &str, bytes: &[u8], damage: &[String]) {
    let copy = dir.join(format!("{name}.corrupt"));
    tracing::error!(path = %dir.join(name).display(), damage = ?damage,
        "damaged entries in the store; the file is kept as {}", copy.display());
    if !dir::exists(&copy) {
        if let Err(e) = file::write_atomic(&copy, bytes) {
            tracing::error!(path = %copy.display(), error = %e, "could not keep a copy");
        }
    }
}

/// Converts a store of the older layout: every `<id>.json` is read (an unreadable
/// one is set aside as `<id>.corrupt`, as that layout did), all go into a first
/// snapshot, made durable before any old file is removed. A crash before that
/// leaves the old layout whole (and converted again), after it the snapshot.
pub(super) fn migrate<R: Record>(dir: &Path, listing: &Listing) -> Result<()> {
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
                let _ = dir::rename_durably(&path, &path.with_extension("corrupt"));
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
pub(super) fn load_all<R: Record>(
    dir: &Path,
    names: &[String],
) -> Vec<(String, std::result::Result<R, String>)> {
    let parts = par_chunks(names, |part| {
        part.iter()
            .map(|name| {
                let r = file::read(&dir.join(name))
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()));
                (name.clone(), r)
            })
            .collect::<Vec<_>>()
    });
    parts.into_iter().flatten().collect()
}

/// The records of a store directory, as JSON by id, read without loading them
/// (for tests and tools). While the store is open, a batch being written may be
/// missed; what is acknowledged is there.
pub fn read_raw(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let listing = Listing::read(dir)?;
    let mut out = BTreeMap::new();
    if listing.snapshots.is_empty() && !listing.legacy.is_empty() {
        for name in &listing.legacy {
            let path = dir.join(name);
            let bytes = file::read(&path).context(|| format!("reading {}", path.display()))?;
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
    let bytes = file::read(&path).context(|| format!("reading {}", path.display()))?;
    let scan = frame::scan(&bytes, true);
    let batch = scan.entries.iter().map(|e| e.batch).max().unwrap_or(0) + 1;
    let mut buf = Vec::new();
    let (kind, payload) = match json {
        Some(j) => (Kind::Put, j),
        None => (Kind::Remove, &b""[..]),
    };
    frame::encode(&mut buf, batch, true, kind, id, payload);
    let f = AppendFile::open(&path).context(|| format!("opening {}", path.display()))?;
    f.truncate(scan.valid_len as u64)
        .and_then(|()| f.write_at(scan.valid_len as u64, &buf))
        .and_then(|()| f.sync_data())
        .context(|| format!("writing {}", path.display()))
}

impl<R: Record> Store<R> {
    pub fn open_with(dir: &Path, tuning: Tuning) -> Result<Self> {
        file::mkdir_p_mode(dir, 0o700).context(|| format!("making {}", dir.display()))?;
        let mut listing = Listing::read(dir)?;
        if listing.snapshots.is_empty() && !listing.legacy.is_empty() {
            migrate::<R>(dir, &listing)?;
            listing = Listing::read(dir)?;
        }
        let opened = Opened::<R>::load(dir, listing)?;
        Ok(Store {
            inner: Arc::new(Inner::new(dir, tuning, opened)),
        })
    }
}

/// What open found in a store's folder, ready to serve.
pub(super) struct Opened<R: Record> {
    pub(super) records: BTreeMap<R::Id, Packed>,
    pub(super) unsettled: BTreeSet<R::Id>,
    pub(super) quarantined: BTreeSet<String>,
    pub(super) blind: bool,
    /// Records the journals made.
    pub(super) born: Vec<R::Id>,
    pub(super) log: Log<R>,
    /// Read from the packed image rather than the snapshot.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) from_image: bool,
}

impl<R: Record> Opened<R> {
    /// Removes what a finished compaction left, reads the newest snapshot (its
    /// packed image when that can stand for it) and the journals after it, and
    /// opens the newest journal to go on with.
    fn load(dir: &Path, listing: Listing) -> Result<Self> {
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
        replay.unreadable.extend(loaded.unreadable);
        let quarantined = quarantine::<R>(dir, listing.legacy_corrupt, &replay, &loaded.records);

        let last_len = bufs.last().map_or(0, |b| b.1.len()) as u64;
        let (file, gen, len) =
            open_journal(dir, logs.last().copied(), from, last_len, journal_end)?;
        let journal_born = loaded.born.iter().map(|id| (gen, *id)).collect();
        let mut log = Log::new(file, gen, len, replay.logged, journal_born);
        log.next_batch = replay.last_batch + 1;
        log.snapshot = from;
        log.snapshot_entries = snapshot_entries;
        Ok(Opened {
            records: loaded.records,
            unsettled: loaded.unsettled,
            quarantined,
            blind: replay.blind,
            born: loaded.born,
            log,
            from_image,
        })
    }
}

/// The ids whose records could not be read (a damaged entry, a record of the
/// older layout set aside) and are not loaded otherwise: their data is kept.
fn quarantine<R: Record>(
    dir: &Path,
    set_aside: BTreeSet<String>,
    replay: &Replay,
    records: &BTreeMap<R::Id, Packed>,
) -> BTreeSet<String> {
    let mut quarantined = set_aside;
    quarantined.extend(
        replay
            .unreadable
            .iter()
            .filter(|id| R::parse_id(id).is_none_or(|k| !records.contains_key(&k)))
            .cloned(),
    );
    for id in &quarantined {
        tracing::error!(dir = %dir.display(), id, "record unreadable; its data is kept");
    }
    if replay.blind {
        tracing::error!(dir = %dir.display(),
            "records of unknown ids were lost; no data of this store is taken for an orphan");
    }
    quarantined
}
