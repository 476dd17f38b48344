//! NodeExpandVolume: grow the image where the controller did not, refresh the
//! loop devices and grow the mounted filesystem online.

use csi_sys::{btrfs, file, LoopDevice, MountEntry, SysError};

use super::{Node, BTRFS_LEAST_RESIZE};
use crate::data::{mounts_of, reachable_mount_of};
use crate::error::{Context, Error, Result};
use crate::ids::VolumeId;
use crate::locks::LockKey;
use crate::model::*;
use crate::pool::Located;
use crate::settings::recorded_size;

impl Node {
    /// NodeExpandVolume: grows the image if the controller did not, refreshes the
    /// loop device and grows the filesystem online. Returns the new capacity.
    pub fn node_expand(
        &self,
        volume_id: &str,
        volume_path: &str,
        range: CapacityRange,
        capability: Option<&Capability>,
    ) -> Result<u64> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        if volume_path.is_empty() {
            return Err(Error::invalid("volume_path is required"));
        }
        range.validate()?;
        let (id, loc) = self.located(volume_id)?;
        if let Some(c) = capability {
            self.check_capability(Some(c), &loc)?;
        }
        let path = self.check_path("volume_path", volume_path)?;
        if !matches!(csi_sys::dir::lstat(&path), Ok(Some(_))) {
            return Err(Error::not_found(format!("{volume_path} does not exist")));
        }
        let _guard = self.locks.try_lock([LockKey::Node(id)])?;
        let (_volume, loc) = self.lock_located(id)?;
        if loc.backing != Backing::Image {
            // The controller raised the quota (a subvolume's limit is its size) or
            // recorded the size on the directory.
            let required = range.required.max(0) as u64;
            if loc.backing == Backing::Subvolume {
                let q = btrfs::qgroup_info(&loc.path)
                    .context(|| format!("reading the qgroup of volume {id}"))?;
                return Ok(q.max_referenced.unwrap_or(required));
            }
            return Ok(recorded_size(&loc.path).unwrap_or(required));
        }
        self.grow_image(&loc, range.required.max(0) as u64)?;
        let devices = self.devices(&loc, self.node_records.get(id).as_ref())?;
        let dev = devices.iter().find(|d| !d.read_only).ok_or_else(|| {
            Error::precondition(format!("volume {id} is not staged on this node"))
        })?;
        for d in &devices {
            self.sys
                .loops
                .refresh_capacity(&d.device)
                .context(|| format!("refreshing the size of {}", d.device.display()))?;
        }
        let size = self
            .sys
            .fs
            .device_size(&dev.device)
            .context(|| format!("sizing {}", dev.device.display()))?;
        let mounts = self.mounts()?;
        if mounts_of(&mounts, &dev.device).is_empty() {
            return Ok(size); // block volume, or not mounted: nothing more to grow
        }
        // The tools that grow a filesystem take a path: one that leads to the
        // volume's mount, not to whatever was mounted over it since.
        let Some(m) = reachable_mount_of(self.sys.mounter.as_ref(), &mounts, &dev.device).cloned()
        else {
            return Err(Error::precondition(format!(
                "volume {id} is mounted only where other mounts now cover it; \
                 it cannot be grown online"
            )));
        };
        self.grow_mounted(id, dev, &m, size)
    }

    /// The controller grew the image already; the node only makes up for a
    /// missed growth, never beyond what was required (`want`).
    fn grow_image(&self, loc: &Located, want: u64) -> Result<()> {
        let len = file::file_len(&loc.path).context(|| format!("sizing {}", loc.path.display()))?;
        if want > len {
            let want = want.div_ceil(4096).saturating_mul(4096);
            let pool = self.pool(&loc.pool)?;
            let (available, total) = pool.space()?;
            if want > total {
                return Err(Error::OutOfRange(format!(
                    "{want} bytes exceeds the largest volume pool {} can hold ({total} bytes)",
                    pool.name
                )));
            }
            if want - len > available {
                return Err(Error::ResourceExhausted(format!(
                    "pool {} has {available} bytes free; growing by {} was asked",
                    pool.name,
                    want - len
                )));
            }
            file::grow(&loc.path, want).context(|| format!("growing {}", loc.path.display()))?;
        }
        Ok(())
    }

    /// Grows the filesystem mounted from `dev` (mount `m`) online to the device's
    /// `size`; returns that size.
    fn grow_mounted(
        &self,
        id: VolumeId,
        dev: &LoopDevice,
        m: &MountEntry,
        size: u64,
    ) -> Result<u64> {
        // A filesystem that fills its device already is left alone: growing it
        // again is refused by some (btrfs below 256 MiB, ext4 online without
        // CAP_SYS_RESOURCE) and needless for all.
        if !self.fs_smaller_than_device(&dev.device, &m.fs_type)? {
            return Ok(size);
        }
        if m.fs_type == "btrfs" && size < BTRFS_LEAST_RESIZE {
            return Err(Error::OutOfRange(format!(
                "volume {id} has {size} bytes; btrfs filesystems can only be resized to \
                 {BTRFS_LEAST_RESIZE} bytes (256 MiB) or more: expand it to at least that"
            )));
        }
        if m.read_only() {
            return Err(Error::precondition(format!(
                "volume {id} is staged read-only; its filesystem grows at its next read-write \
                 stage"
            )));
        }
        match self
            .sys
            .fs
            .grow(&dev.device, Some(&m.mount_point), &m.fs_type)
        {
            Ok(()) => Ok(size),
            Err(SysError::PermissionDenied { .. }) => Err(Error::precondition(format!(
                "the kernel refused to grow the mounted {} filesystem of volume {id} online \
                 (this node withholds CAP_SYS_RESOURCE); it grows at the next NodeStageVolume",
                m.fs_type
            ))),
            Err(e) => Err(Error::System {
                context: format!("growing the {} filesystem of volume {id}", m.fs_type),
                source: e,
            }),
        }
    }
}
