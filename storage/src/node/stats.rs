//! NodeGetVolumeStats: the figures of a mounted path of a volume (statvfs, the
//! qgroup of a subvolume, the size of a block device).

use csi_sys::btrfs;

use super::Node;
use crate::error::{Context, Error, Result};
use crate::ids::VolumeId;
use crate::model::*;

#[derive(Debug, Default)]
pub struct VolumeStats {
    pub block: bool,
    pub total_bytes: u64,
    pub available_bytes: u64,
    pub used_bytes: u64,
    pub total_inodes: u64,
    pub available_inodes: u64,
    pub used_inodes: u64,
}

impl Node {
    pub fn node_stats(&self, volume_id: &str, volume_path: &str) -> Result<VolumeStats> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        if volume_path.is_empty() {
            return Err(Error::invalid("volume_path is required"));
        }
        let id = self
            .ephemeral_id(volume_id)
            .map(Ok)
            .unwrap_or_else(|| VolumeId::parse_existing(volume_id))?;
        let loc = self.locate(id).ok_or_else(|| {
            Error::not_found(format!("volume {volume_id} does not exist on this node"))
        })?;
        // The spec's answer for a path that holds no volume of this id: where
        // no volume is ever published, none is.
        let path = self
            .check_path("volume_path", volume_path)
            .map_err(|e| match e {
                Error::InvalidArgument(why) => Error::NotFound(why),
                e => e,
            })?;
        if !matches!(csi_sys::dir::lstat(&path), Ok(Some(_))) {
            return Err(Error::not_found(format!("{volume_path} does not exist")));
        }
        let rec = self.node_records.get(id);
        let devices = self.devices(&loc, rec.as_ref())?;
        let mounts = self.mounts()?;
        let mount = mounts.iter().rev().find(|m| m.mount_point == path);
        let mut stats = VolumeStats::default();
        // A path of the volume whose mount vanished or was replaced has no figures
        // of the volume; NodeGetVolumeHealth says what happened to it.
        let Some(m) = mount.filter(|m| self.owns(&mounts, m, id, &loc, &devices)) else {
            return Err(Error::not_found(format!(
                "{volume_path} is not a mounted path of volume {volume_id}"
            )));
        };
        let block = rec.as_ref().is_some_and(|r| r.block) || m.fs_type == "devtmpfs";
        if block {
            let dev = devices.first().ok_or_else(|| {
                Error::not_found(format!("volume {volume_id} has no loop device"))
            })?;
            stats.block = true;
            stats.total_bytes = self
                .sys
                .fs
                .device_size(&dev.device)
                .context(|| format!("sizing {}", dev.device.display()))?;
            return Ok(stats);
        }
        let s = self
            .sys
            .fs
            .stats(&path)
            .context(|| format!("statvfs of {volume_path}"))?;
        stats.total_bytes = s.total_bytes;
        stats.available_bytes = s.available_bytes;
        stats.used_bytes = s.total_bytes.saturating_sub(s.free_bytes);
        // btrfs counts no inodes (statvfs says 0): the figures stay unknown.
        stats.total_inodes = s.total_inodes;
        stats.available_inodes = s.free_inodes;
        stats.used_inodes = s.total_inodes.saturating_sub(s.free_inodes);
        if loc.backing == Backing::Subvolume {
            // statvfs shows the whole pool; the volume's size is its qgroup's.
            let q = btrfs::qgroup_info(&loc.path)
                .context(|| format!("reading the qgroup of volume {volume_id}"))?;
            stats.used_bytes = q.referenced;
            if let Some(limit) = q.max_referenced {
                stats.total_bytes = limit;
                // The pool may run out before the limit is reached.
                stats.available_bytes = limit.saturating_sub(q.referenced).min(s.available_bytes);
            }
        }
        Ok(stats)
    }
}
