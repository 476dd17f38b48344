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
    /// Opens (making it if needed) the directory and loads every record.
    pub fn open(dir: &Path) -> Result<Self> {
        file::mkdir_p_mode(dir, 0o700).context(|| format!("making {}", dir.display()))?;
        let mut records = BTreeMap::new();
        let mut quarantined = BTreeSet::new();
        let entries = std::fs::read_dir(dir)
            .map_err(|e| Error::internal(format!("reading {}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.starts_with('.') {
                // A temporary file of a write a crash interrupted: the rename never
                // happened, so the old record (if any) is still whole.
                if name.ends_with(".tmp") {
                    let _ = std::fs::remove_file(&path);
                    tracing::info!(path = %path.display(), "removed an interrupted record write");
                }
                continue;
            }
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            let parsed = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<R>(&b).map_err(|e| e.to_string()));
            match parsed {
                Ok(r) if r.id().to_string() == stem => {
                    records.insert(r.id(), r);
                }
                other => {
                    let why = other.err().unwrap_or_else(|| "id does not match".into());
                    tracing::error!(path = %path.display(), error = %why,
                        "record unreadable; set aside as .corrupt and its data kept");
                    let _ = std::fs::rename(&path, path.with_extension("corrupt"));
                    quarantined.insert(stem.to_string());
                }
            }
        }
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(stem) = name.strip_suffix(".corrupt") {
                quarantined.insert(stem.to_string());
            }
        }
        Ok(Store {
            dir: dir.to_path_buf(),
            records: RwLock::new(records),
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
