//! The node domain: stage, publish, unpublish, unstage, stats and expansion,
//! ephemeral inline volumes, and the start-up check of the node. Idempotency is
//! decided from the live mount table and loop devices; the node record only
//! remembers what was asked (staging path, targets), and every use of it is
//! checked against the real world.
//!
//! The domain owns `<state>/node` (its records) and never reads the controller's.
//! What it must agree on with the controller goes through the volume's lock in
//! the shared state: every operation on a volume holds it, says there whether the
//! volume is staged, and leaves a volume alone while a freeze of it is recorded.
//!
//! One file per operation (`stage`, `unstage`, `publish`, `unpublish`, `stats`,
//! `expand`, `ephemeral`, `recovery`, `health`); `checks`, `mounts`, `devices` and
//! `live_settings` hold what they share, and this file the domain itself, its
//! records and its locks.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use csi_sys::LoopDevice;

use crate::core::Core;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::locks::Locks;
use crate::model::*;
use crate::pool::Located;
use crate::state::{Domain, OwnerLock, VolumeLock};
use crate::store::Store;

mod checks;
mod devices;
mod ephemeral;
mod expand;
mod group;
mod health;
mod live_settings;
mod mounts;
mod publish;
mod recovery;
mod stage;
mod stats;
#[cfg(test)]
mod tests;
mod unpublish;
mod unstage;

pub use ephemeral::{EPHEMERAL_DEFAULT_SIZE, EPHEMERAL_KEY};
pub use publish::Publish;
pub use stage::Stage;
pub use stats::VolumeStats;

/// The node domain of a process.
pub struct Node {
    core: Arc<Core>,
    pub(crate) node_records: Store<NodeRecord>,
    ephemeral_volumes: Store<VolumeRecord>,
    /// Held while an ephemeral volume is admitted against its pool's space.
    ephemeral_admission: std::sync::Mutex<()>,
    locks: Locks,
    _owner: OwnerLock,
}

impl Deref for Node {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

/// What the node remembers of a volume it staged or published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: VolumeId,
    /// The id kubelet uses; differs from `id` for ephemeral volumes.
    pub volume_id: String,
    pub data: PathBuf,
    pub backing: Backing,
    pub staging_path: Option<PathBuf>,
    pub block: bool,
    pub fs_type: Option<String>,
    pub mode: AccessMode,
    pub targets: BTreeMap<PathBuf, Target>,
    pub ephemeral: bool,
    /// Every loop device the node attached to the volume's image (the read-write
    /// one and the read-only ones of targets), so that they are found without
    /// looking at every device of the node. None while an attach may be under way
    /// (written before it, so a crash leaves no device unnamed) and in records of
    /// older versions: then every device is looked at.
    #[serde(default)]
    pub loop_devices: Option<Vec<PathBuf>>,
}

crate::core::store::record!(NodeRecord, VolumeId, layout 1);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    pub read_only: bool,
    pub block: bool,
    /// A read-only loop device made for this target alone.
    pub ro_device: Option<PathBuf>,
}

/// The kernel refuses to resize a btrfs filesystem to less than this.
const BTRFS_LEAST_RESIZE: u64 = 256 * MIB;

impl Node {
    /// Claims the node's part of the state (refused while another process holds
    /// it), loads its records and checks the node.
    pub fn open(core: Arc<Core>) -> Result<Node> {
        let owner = core.state.claim(Domain::Node)?;
        let dir = core.state.domain(Domain::Node);
        let node = Node {
            node_records: Store::open(&dir.join("staged"))?,
            ephemeral_volumes: Store::open(&dir.join("ephemeral"))?,
            ephemeral_admission: std::sync::Mutex::new(()),
            locks: Locks::default(),
            _owner: owner,
            core,
        };
        node.recover_node()?;
        node.node_records.compact_if_due();
        node.ephemeral_volumes.compact_if_due();
        Ok(node)
    }

    /// How many volumes this node has staged (ephemeral ones included).
    pub fn staged_count(&self) -> usize {
        self.node_records.len()
    }

    /// Takes a volume's lock for a node operation, refusing while a freeze of it
    /// is recorded: the freeze's owner (or its restart) thaws it, and unmounting
    /// or growing a frozen filesystem would hang.
    fn lock_volume(&self, id: VolumeId) -> Result<VolumeLock> {
        let lock = self.state.lock_volume(id)?;
        failpoint::hit("node.after-volume-lock");
        if let Some(m) = self.state.freeze_of(id) {
            return Err(Error::Aborted(format!(
                "volume {id} is frozen for a copy by the {} (pid {}); it is thawed when the \
                 copy ends, or when that process starts again; retry later",
                m.owner.name(),
                m.pid
            )));
        }
        Ok(lock)
    }

    /// Takes the lock of a volume found in a pool, and finds it again under the
    /// lock: the controller may have deleted it meanwhile.
    fn lock_located(&self, id: VolumeId) -> Result<(VolumeLock, Located)> {
        let lock = self.lock_volume(id)?;
        match self.locate(id) {
            Some(loc) => Ok((lock, loc)),
            None => {
                lock.remove()?;
                Err(Error::not_found(format!(
                    "volume {id} does not exist on this node"
                )))
            }
        }
    }

    /// Finds a volume's data in the pools.
    pub fn locate(&self, id: VolumeId) -> Option<Located> {
        self.pools.values().find_map(|p| p.locate(id))
    }

    /// Where a volume's data is, or was when this node staged it (the volume may
    /// have been deleted since).
    fn locate_or_recorded(&self, id: VolumeId, rec: Option<&NodeRecord>) -> Option<Located> {
        self.locate(id).or_else(|| {
            rec.map(|r| Located {
                pool: String::new(),
                path: r.data.clone(),
                backing: r.backing,
                ephemeral: r.ephemeral,
            })
        })
    }

    fn located(&self, volume_id: &str) -> Result<(VolumeId, Located)> {
        let id = VolumeId::parse_existing(volume_id)?;
        let loc = self
            .locate(id)
            .ok_or_else(|| Error::not_found(format!("volume {id} does not exist on this node")))?;
        Ok((id, loc))
    }

    /// The loop devices serving the volume at `loc` (none for a directory), from
    /// what its record names where that can be trusted.
    fn devices(&self, loc: &Located, rec: Option<&NodeRecord>) -> Result<Vec<LoopDevice>> {
        if loc.backing != Backing::Image {
            return Ok(Vec::new());
        }
        self.image_devices(&loc.path, rec)
    }

    fn image_devices(&self, image: &Path, rec: Option<&NodeRecord>) -> Result<Vec<LoopDevice>> {
        let recorded = rec.and_then(|r| r.loop_devices.as_deref());
        devices::serving(&*self.sys.loops, image, recorded)
            .context(|| format!("finding the loop devices of {}", image.display()))
    }

    /// The volume's lock when anything of the volume is here (its data or a
    /// record); a call about an unknown volume has nothing to coordinate, and
    /// leaves no lock file behind.
    fn lock_if_known(&self, id: VolumeId) -> Result<Option<VolumeLock>> {
        if self.locate(id).is_none() && !self.node_records.contains(id) {
            return Ok(None);
        }
        self.lock_volume(id).map(Some)
    }

    /// Removes the lock file of a volume whose data and record are both gone.
    fn release_if_gone(&self, id: VolumeId, lock: Option<VolumeLock>) -> Result<()> {
        match lock {
            Some(l) if self.locate(id).is_none() && !self.node_records.contains(id) => l.remove(),
            _ => Ok(()),
        }
    }
}

fn make_dir(path: &Path) -> Result<()> {
    match csi_sys::dir::lstat(path) {
        Ok(Some(m)) if m.is_dir() => Ok(()),
        Ok(Some(_)) => Err(Error::AlreadyExists(format!(
            "{} exists and is not a directory",
            path.display()
        ))),
        _ => csi_sys::dir::create_unsynced(path)
            .map_err(|e| Error::invalid(format!("cannot make {}: {e}", path.display()))),
    }
}
