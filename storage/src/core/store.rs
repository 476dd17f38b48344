//! The state store: one JSON record per object, written crash-safely (temporary
//! dot file, fsync, rename, fsync of the directory) and kept in memory in id order,
//! so every operation is O(log n) whatever the number of objects and listings are
//! stable. A record that cannot be read is set aside as `<name>.corrupt` and its id
//! remembered, so that the data it describes is never taken for an orphan.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use serde::{de::DeserializeOwned, Serialize};

use csi_sys::file;

use crate::error::{Context, Error, Result};

pub trait Record: Serialize + DeserializeOwned + Clone + Send + Sync {
    type Id: Ord + Copy + Display + Send + Sync;
    fn id(&self) -> Self::Id;
}

pub struct Store<R: Record> {
    dir: PathBuf,
    records: RwLock<BTreeMap<R::Id, R>>,
    quarantined: BTreeSet<String>,
}

impl<R: Record> Store<R> {
    /// Opens (making it if needed) the directory and loads every record, parsed
    /// on as many threads as the machine has cores: start-up time is mostly this.
    pub fn open(dir: &Path) -> Result<Self> {
        file::mkdir_p_mode(dir, 0o700).context(|| format!("making {}", dir.display()))?;
        let mut names = Vec::new();
        let mut quarantined = BTreeSet::new();
        let entries = std::fs::read_dir(dir)
            .map_err(|e| Error::internal(format!("reading {}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                // A temporary file of a write a crash interrupted: the rename never
                // happened, so the old record (if any) is still whole.
                if name.ends_with(".tmp") {
                    let path = entry.path();
                    let _ = std::fs::remove_file(&path);
                    tracing::info!(path = %path.display(), "removed an interrupted record write");
                }
            } else if let Some(stem) = name.strip_suffix(".corrupt") {
                quarantined.insert(stem.to_string());
            } else if name.ends_with(".json") {
                names.push(name);
            }
        }
        let mut records = Vec::with_capacity(names.len());
        for (name, parsed) in load_all::<R>(dir, names)? {
            let stem = name.strip_suffix(".json").unwrap_or(&name);
            match parsed {
                Ok(r) if r.id().to_string() == stem => records.push((r.id(), r)),
                other => {
                    let path = dir.join(&name);
                    let why = other.err().unwrap_or_else(|| "id does not match".into());
                    tracing::error!(path = %path.display(), error = %why,
                        "record unreadable; set aside as .corrupt and its data kept");
                    let _ = std::fs::rename(&path, path.with_extension("corrupt"));
                    quarantined.insert(stem.to_string());
                }
            }
        }
        Ok(Store {
            dir: dir.to_path_buf(),
            records: RwLock::new(records.into_iter().collect()),
            quarantined,
        })
    }

    fn path(&self, id: R::Id) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    pub fn get(&self, id: R::Id) -> Option<R> {
        self.read().get(&id).cloned()
    }

    /// Writes the record durably, then makes it visible.
    pub fn put(&self, record: &R) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(record)
            .map_err(|e| Error::internal(format!("encoding record: {e}")))?;
        let path = self.path(record.id());
        file::write_atomic(&path, &bytes).context(|| format!("writing {}", path.display()))?;
        self.write().insert(record.id(), record.clone());
        Ok(())
    }

    /// Removes the record durably.
    pub fn remove(&self, id: R::Id) -> Result<()> {
        let path = self.path(id);
        file::remove_file_if_exists(&path).context(|| format!("removing {}", path.display()))?;
        // Also when the file was already gone: the remove may be an earlier
        // attempt's that died before this sync.
        file::fsync_dir(&self.dir).context(|| format!("syncing {}", self.dir.display()))?;
        self.write().remove(&id);
        Ok(())
    }

    pub fn contains(&self, id: R::Id) -> bool {
        self.read().contains_key(&id)
    }

    /// The records `filter` picks, in id order; only those are copied.
    pub fn select(&self, filter: impl Fn(&R) -> bool) -> Vec<R> {
        self.read()
            .values()
            .filter(|r| filter(r))
            .cloned()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn all(&self) -> Vec<R> {
        self.read().values().cloned().collect()
    }

    /// Up to `max` records (all when 0) with ids after `after`, in id order, and
    /// whether more follow.
    pub fn page(
        &self,
        after: Option<R::Id>,
        max: usize,
        filter: impl Fn(&R) -> bool,
    ) -> (Vec<R>, bool) {
        let map = self.read();
        let lower = match after {
            Some(id) => Bound::Excluded(id),
            None => Bound::Unbounded,
        };
        let mut out = Vec::new();
        for r in map.range((lower, Bound::Unbounded)).map(|(_, r)| r) {
            if !filter(r) {
                continue;
            }
            if max > 0 && out.len() == max {
                return (out, true);
            }
            out.push(r.clone());
        }
        (out, false)
    }

    /// Whether data named `stem` belongs to a record that could not be read.
    pub fn is_quarantined(&self, stem: &str) -> bool {
        self.quarantined.contains(stem)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<R::Id, R>> {
        self.records.read().unwrap_or_else(|p| p.into_inner())
    }
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<R::Id, R>> {
        self.records.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Reads and parses the files `names` of `dir`, split among threads; each
/// answer is the record or why it could not be read.
#[allow(clippy::type_complexity)]
fn load_all<R: Record>(
    dir: &Path,
    names: Vec<String>,
) -> Result<Vec<(String, std::result::Result<R, String>)>> {
    // A thread is worth its start only for a few hundred records.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(names.len() / 256 + 1);
    let chunk = names.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let loaders: Vec<_> = names
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    let mut buf = Vec::new();
                    part.iter()
                        .map(|name| (name.clone(), load(&dir.join(name), &mut buf)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(names.len());
        for l in loaders {
            out.extend(l.join().map_err(|_| {
                Error::internal(format!("loading the records of {}", dir.display()))
            })?);
        }
        Ok(out)
    })
}

fn load<R: Record>(path: &Path, buf: &mut Vec<u8>) -> std::result::Result<R, String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(buf.len().max(4096) * 2, 0);
        }
        match f.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => {
                len += n;
                // A record file is never changed in place (a new one is renamed
                // over it): a read short of the buffer reached its end, and a
                // second read would only say so.
                if len < buf.len() {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    serde_json::from_slice(&buf[..len]).map_err(|e| e.to_string())
}

macro_rules! record {
    ($rec:ty, $id:ty) => {
        impl Record for $rec {
            type Id = $id;
            fn id(&self) -> $id {
                self.id
            }
        }
    };
}

record!(crate::model::VolumeRecord, crate::ids::VolumeId);
record!(crate::model::SnapshotRecord, crate::ids::SnapshotId);
record!(
    crate::model::GroupSnapshotRecord,
    crate::ids::GroupSnapshotId
);
record!(crate::node::NodeRecord, crate::ids::VolumeId);
