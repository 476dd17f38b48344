//! ControllerExpandVolume: the new size is recorded as pending, applied to the
//! data (the image's length, a subvolume's limit, a directory's recorded size),
//! then committed; the node grows the filesystem.

use csi_sys::{btrfs, file};

use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::locks::LockKey;
use crate::model::*;
use crate::pool::Pool;
use crate::settings::record_size;
use crate::Controller;

impl Controller {
    /// Grows a volume; returns the new size and whether the node must grow it too.
    pub fn expand_volume(
        &self,
        volume_id: &str,
        range: CapacityRange,
        capability: Option<&Capability>,
    ) -> Result<(u64, bool)> {
        let id = VolumeId::parse_existing(volume_id)?;
        range.validate()?;
        if range.required <= 0 && range.limit <= 0 {
            return Err(Error::invalid("capacity_range is required"));
        }
        if let Some(c) = capability {
            if let Some(why) = self.cfg.unsupported(c) {
                return Err(Error::invalid(why));
            }
        }
        let _guard = self.locks.try_lock([LockKey::Volume(id)])?;
        let mut rec = self.existing_volume(volume_id)?;
        if capability.is_some_and(|c| c.is_block()) && rec.backing != Backing::Image {
            return Err(Error::invalid(
                "block access is not possible on a kind=dir volume",
            ));
        }
        let node_grows = rec.backing == Backing::Image;
        let want = if range.required > 0 {
            range.required
        } else {
            range.limit
        } as u64;
        if want <= rec.size {
            return Ok((rec.size, node_grows));
        }
        let new = self.size_for(range, rec.fs_type.as_deref(), 0)?;
        let pool = self.pool(&rec.pool)?.clone();
        let (available, total) = pool.space()?;
        if new > total {
            return Err(Error::OutOfRange(format!(
                "{new} bytes exceeds the largest volume pool {} can hold ({total} bytes)",
                pool.name
            )));
        }
        if rec.backing != Backing::Directory && new - rec.size > available {
            return Err(Error::ResourceExhausted(format!(
                "pool {} has {available} bytes free; growing by {} was asked",
                pool.name,
                new - rec.size
            )));
        }
        rec.pending_size = Some(new);
        self.volumes.put(&rec)?;
        failpoint::hit("expand-volume.after-intent");
        self.apply_size(&pool, &rec, new)?;
        failpoint::hit("expand-volume.after-grow");
        rec.size = new;
        rec.pending_size = None;
        rec.requested = requested_below(want as i64, new);
        self.volumes.put(&rec)?;
        tracing::info!(volume.id = %id, size = new, "volume expanded");
        Ok((new, node_grows))
    }

    pub(super) fn apply_size(&self, pool: &Pool, rec: &VolumeRecord, size: u64) -> Result<()> {
        let path = pool.volume_path(rec.id, rec.backing, rec.ephemeral);
        let at = || format!("growing volume {} to {size} bytes", rec.id);
        match rec.backing {
            // Unmarked first: a fresh filesystem is not grown at its first stage.
            Backing::Image => {
                crate::fresh::unmark(&path).and_then(|()| file::grow(&path, size).context(at))
            }
            Backing::Subvolume => btrfs::qgroup_limit(&path, size).context(at),
            Backing::Directory => record_size(&path, size),
        }
    }
}
