//! Replicas: a reflink kept on the target of each volume that arrived whole,
//! the start of the next transfer of the same source volume from the same
//! node (which then sends only what changed).

use std::path::{Path, PathBuf};

use csi_sys::{dir, file};
use serde::{Deserialize, Serialize};

use super::arrive::ArrivalRecord;
use crate::ids::VolumeId;
use crate::model::Timestamp;
use crate::Controller;

/// A replica kept of a finished arrival: the start of the next one of the
/// same source volume from the same node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Replica {
    pub transfer_id: String,
    pub source_node: String,
    pub source_volume: String,
    pub created: Timestamp,
    /// The volume the transfer made here: the replica goes with it. None in
    /// replicas kept before they named it.
    #[serde(default)]
    pub volume: Option<VolumeId>,
}

/// How a replica set aside for removal is named.
const GONE: &str = "gone-";

impl Controller {
    fn replicas_dir(pool: &crate::pool::Pool) -> PathBuf {
        pool.root.join(".replicas")
    }

    fn replica_key(node: &str, source_volume: &str) -> String {
        blake3::hash(format!("{node}\n{source_volume}").as_bytes()).to_hex()[..32].to_string()
    }

    /// The replica of the last transfer of `source_volume` from `node`, if one
    /// is kept in `pool`.
    pub(super) fn replica_of(
        &self,
        pool: &crate::pool::Pool,
        node: &str,
        source_volume: &str,
    ) -> Option<(PathBuf, Replica)> {
        let key = Self::replica_key(node, source_volume);
        let dir = Self::replicas_dir(pool);
        let r: Replica =
            serde_json::from_slice(&file::read(&dir.join(format!("{key}.json"))).ok()?).ok()?;
        let img = dir.join(format!("{key}.img"));
        (r.source_node == node && r.source_volume == source_volume && dir::is_file(&img))
            .then_some((img, r))
    }

    /// Keeps a reflink of a volume that arrived whole: the next transfer of
    /// its source volume from the same node starts from it. Best effort: a
    /// failure only costs that transfer its shortcut.
    pub(super) fn keep_replica(&self, pool: &crate::pool::Pool, image: &Path, rec: &ArrivalRecord) {
        if !pool.reflink {
            return;
        }
        let key = Self::replica_key(&rec.source_node, &rec.source_volume);
        let dir = Self::replicas_dir(pool);
        let img = dir.join(format!("{key}.img"));
        let desc = dir.join(format!("{key}.json"));
        let r = Replica {
            transfer_id: rec.transfer_id.clone(),
            source_node: rec.source_node.clone(),
            source_volume: rec.source_volume.clone(),
            created: Timestamp::now(),
            volume: Some(rec.volume),
        };
        // The replica before is set aside under a name no description has,
        // and removed once this transfer is done with (see `remove_later`).
        let aside = dir.join(format!("{GONE}{}.img", uuid::Uuid::new_v4().simple()));
        let mut set_aside = false;
        let kept = file::mkdir_p_mode(&dir, 0o700)
            .and_then(|()| file::remove_file_if_exists(&desc).map(drop))
            .and_then(|()| {
                set_aside = dir::is_file(&img);
                match set_aside {
                    true => dir::rename_durably(&img, &aside),
                    false => Ok(()),
                }
            })
            .and_then(|()| file::reflink(image, &img))
            .and_then(|()| file::write_atomic(&desc, &serde_json::to_vec(&r).unwrap_or_default()));
        if let Err(e) = kept {
            tracing::info!(error = %e, "no replica kept of an arrived volume");
        }
        if set_aside {
            super::remove_later(aside);
        }
    }

    /// Removes each replica of this node's pools that `gone` picks (given its
    /// description, None when unreadable); the errors of those it could not.
    fn remove_replicas(&self, gone: impl Fn(Option<&Replica>) -> bool) -> Vec<csi_sys::SysError> {
        let mut errors = Vec::new();
        for pool in self.pools.values() {
            let dir_path = Self::replicas_dir(pool);
            for e in dir::list_if_exists(&dir_path).unwrap_or_default() {
                let Some(stem) = e.name.strip_suffix(".json") else {
                    continue;
                };
                let r: Option<Replica> = file::read(&dir_path.join(&e.name))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok());
                if gone(r.as_ref()) {
                    let removed =
                        file::remove_file_if_exists(&dir_path.join(&e.name)).and_then(|_| {
                            file::remove_file_if_exists(&dir_path.join(format!("{stem}.img")))
                        });
                    errors.extend(removed.err());
                }
            }
        }
        errors
    }

    /// At start: replicas past their age (a week) go, those whose description
    /// cannot be read, and those whose volume is gone (a crash may have kept
    /// them past it).
    pub(super) fn remove_old_replicas(&self) {
        self.remove_replicas(|r| {
            r.is_none_or(|r| {
                Timestamp::now().seconds - r.created.seconds > 7 * 24 * 3600
                    || r.volume.is_some_and(|v| !self.volumes.contains(v))
            })
        });
        // Images no description names: set aside, or kept by a crash
        // before (or without) their description.
        for pool in self.pools.values() {
            let dir_path = Self::replicas_dir(pool);
            let entries = dir::list_if_exists(&dir_path).unwrap_or_default();
            for e in &entries {
                let described = e
                    .name
                    .strip_suffix(".img")
                    .is_some_and(|stem| entries.iter().any(|d| d.name == format!("{stem}.json")));
                if !e.name.ends_with(".json") && !described {
                    if let Err(e) = file::remove_file_if_exists(&dir_path.join(&e.name)) {
                        tracing::warn!(error = %e, "cannot remove what is left of a replica");
                    }
                }
            }
        }
    }

    /// The replica kept of `volume`'s arrival, which is deleted. Best effort:
    /// what is left goes at the next start.
    pub(crate) fn forget_replica_of(&self, volume: VolumeId) {
        for e in self.remove_replicas(|r| r.is_some_and(|r| r.volume == Some(volume))) {
            tracing::warn!(error = %e, volume.id = %volume,
                "cannot remove the replica of a deleted volume");
        }
    }
}
