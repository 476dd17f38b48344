//! The controller's operations on volumes: create (empty, from a snapshot, from a
//! volume), delete, expand, publish, list, get, capacity, validate and modify; and
//! the start-up repair of what a crash left half-done.
//!
//! Every multi-step operation writes its intent into the volume's record first
//! (state Creating or Deleting, or a pending size), then changes the pool, then
//! commits the record. Start-up rolls Creating back, finishes Deleting and pending
//! expansions, and removes pool data that no record accounts for.
//!
//! One file per operation (`create` with the `content` it fills a volume with,
//! `delete`, `expand`, `modify`, `publish`, `queries`, `health`, `recovery`); this
//! file holds the requests and answers they share and the helpers of several.

use std::collections::BTreeMap;
use std::path::Path;

use csi_sys::{btrfs, file, xattr};

use crate::error::{Context, Error, Result};
use crate::ids::VolumeId;
use crate::model::*;
use crate::pool::DEFAULT_POOL;
use crate::settings::{attr_name, carried_by_data};
use crate::Controller;

mod content;
pub(crate) mod create;
mod delete;
mod expand;
mod health;
mod modify;
mod publish;
mod queries;
mod recovery;

pub use crate::model::{minimum_size, DEFAULT_SIZE, GIB, K8S_PREFIX, KIB, MIB};
pub use publish::{NodeInfo, UnpublishReason};

/// Parameters of CreateVolume (the StorageClass's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeParams {
    pub pool: String,
    pub kind: VolumeKind,
    /// Bytes per second a transfer of the volume's data to another node
    /// reads at most (0: no limit of its own).
    pub transfer_bandwidth: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeKind {
    Image,
    Dir,
}

/// Accepted StorageClass parameter keys, besides the `csi.storage.k8s.io/` prefix.
pub const PARAMETERS: [&str; 3] = ["type", "kind", "transferBandwidth"];

pub fn parse_parameters(p: &BTreeMap<String, String>) -> Result<VolumeParams> {
    for k in p.keys() {
        if !PARAMETERS.contains(&k.as_str()) && !k.starts_with(K8S_PREFIX) {
            return Err(Error::invalid(format!(
                "unknown parameter {k:?}; accepted: type (the pool), kind (image or dir), \
                 transferBandwidth (bytes per second, e.g. 100Mi), and keys beginning {K8S_PREFIX}"
            )));
        }
    }
    let kind = match p.get("kind").map(String::as_str) {
        None | Some("") | Some("image") => VolumeKind::Image,
        Some("dir") => VolumeKind::Dir,
        Some(other) => {
            return Err(Error::invalid(format!(
                "parameter kind={other:?} is not one of image, dir"
            )))
        }
    };
    let pool = match p.get("type").map(String::as_str) {
        None | Some("") => DEFAULT_POOL.to_string(),
        Some(t) => t.to_string(),
    };
    let transfer_bandwidth = match p.get("transferBandwidth").map(String::as_str) {
        None | Some("") => 0,
        Some(b) => crate::size::parse_size(b).map_err(|e| {
            Error::invalid(format!(
                "parameter transferBandwidth={b:?} is not bytes per second (e.g. 100Mi): {e}"
            ))
        })? as u64,
    };
    Ok(VolumeParams {
        pool,
        kind,
        transfer_bandwidth,
    })
}

/// Bytes per second a transfer of the data of `rec` from another node reads at
/// most (0: no cap of its own): its mutable `transferBandwidth` (a
/// VolumeAttributesClass, changed by ControllerModifyVolume) where it has
/// one, else its class's parameter.
pub(crate) fn transfer_cap(rec: &VolumeRecord) -> u64 {
    let mutable = rec.mutable_parameters.get(crate::TRANSFER_BANDWIDTH);
    match mutable.and_then(|b| crate::size::parse_size(b).ok()) {
        Some(b) => b as u64,
        None => parse_parameters(&rec.parameters).map_or(0, |p| p.transfer_bandwidth),
    }
}

#[derive(Debug, Clone, Default)]
pub struct CreateVolume {
    pub name: String,
    pub capacity: CapacityRange,
    pub capabilities: Vec<Capability>,
    pub parameters: BTreeMap<String, String>,
    pub mutable_parameters: BTreeMap<String, String>,
    pub source: Option<ContentSource>,
    /// accessibility_requirements.requisite, each a topology segment.
    pub requisite: Vec<BTreeMap<String, String>>,
    pub preferred: Vec<BTreeMap<String, String>>,
}

/// A page of ListVolumes: each volume's answer.
pub struct VolumePage<T> {
    pub volumes: Vec<T>,
    pub next_token: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub available: u64,
    pub maximum_volume_size: u64,
    pub minimum_volume_size: u64,
}

impl Capacity {
    /// No room.
    pub const NONE: Capacity = Capacity {
        available: 0,
        maximum_volume_size: 0,
        minimum_volume_size: 0,
    };

    /// The answer for parameters CreateVolume refuses: a figure that keeps
    /// no claim away, not a measurement (see `Controller::get_capacity`).
    pub const UNLIMITED: Capacity = Capacity {
        available: i64::MAX as u64,
        maximum_volume_size: i64::MAX as u64,
        minimum_volume_size: 0,
    };
}

impl Controller {
    pub(crate) fn topology_allows(&self, segments: &[BTreeMap<String, String>]) -> bool {
        let mine = self.topology();
        segments.is_empty() || segments.contains(&mine)
    }

    /// The size to make for a request, or OUT_OF_RANGE.
    fn size_for(&self, range: CapacityRange, fs: Option<&str>, at_least: u64) -> Result<u64> {
        range.validate()?;
        let limit = (range.limit > 0).then_some(range.limit as u64);
        let mut size = if range.required > 0 {
            range.required as u64
        } else {
            at_least.max(limit.map_or(DEFAULT_SIZE, |l| l.min(DEFAULT_SIZE)))
        };
        size = size.max(minimum_size(fs)).max(at_least);
        let rounded = size.div_ceil(MIB).saturating_mul(MIB);
        let size = match limit {
            Some(l) if rounded > l => size.div_ceil(4096).saturating_mul(4096),
            _ => rounded,
        };
        if let Some(l) = limit {
            if size > l {
                return Err(Error::OutOfRange(format!(
                    "a volume of at least {size} bytes is needed (filesystem minimum {} bytes, \
                     source {at_least} bytes) but limit_bytes is {l}",
                    minimum_size(fs)
                )));
            }
        }
        Ok(size)
    }

    /// Applies a volume's mutable attributes to its data: an image keeps them as
    /// xattrs, where the node reads them at stage; a subvolume takes its btrfs
    /// compression property at once.
    pub(crate) fn write_attributes(
        &self,
        path: &Path,
        backing: Backing,
        m: &BTreeMap<String, String>,
    ) -> Result<()> {
        let m = &carried_by_data(m);
        for (k, v) in m {
            match backing {
                Backing::Subvolume => btrfs::set_compression(path, v)
                    .context(|| format!("setting compression={v} on {}", path.display()))?,
                _ => xattr::set(path, &attr_name(k), v.as_bytes())
                    .context(|| format!("recording {k} on {}", path.display()))?,
            }
        }
        if !m.is_empty() && backing != Backing::Subvolume {
            // The record written next must not outlive the attributes it names.
            file::sync_path(path).context(|| format!("syncing {}", path.display()))?;
        }
        Ok(())
    }

    /// Removes the data of a volume (whatever state it is in) and its record.
    pub(crate) fn roll_back_volume(&self, rec: &VolumeRecord) -> Result<()> {
        self.remove_volume_data(rec.id, false)?;
        self.volumes.remove(rec.id)
    }

    fn existing_volume(&self, volume_id: &str) -> Result<VolumeRecord> {
        let id = VolumeId::parse_existing(volume_id)?;
        self.volumes
            .get(id)
            .filter(|r| r.state == RecordState::Ready)
            .ok_or_else(|| Error::not_found(format!("volume {id} does not exist")))
    }
}
