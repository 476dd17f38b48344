//! NodeUnpublishVolume: unmount the target, remove what publish made there and
//! detach the target's own read-only loop device.

use std::path::Path;

use super::Node;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::locks::LockKey;

impl Node {
    pub fn node_unpublish(&self, volume_id: &str, target_path: &str) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let target = self.check_path("target_path", target_path)?;
        if let Some(eid) = self.ephemeral_id(volume_id) {
            let _guard = self.locks.try_lock([LockKey::Node(eid)])?;
            return self.unpublish_ephemeral(eid, &target);
        }
        // An id that is no volume id of this driver may be an ephemeral volume
        // torn down already: unpublish stays idempotent for it (and still leaves a
        // mount it does not own alone).
        let id = VolumeId::parse(volume_id).unwrap_or_else(|| VolumeId::for_ephemeral(volume_id));
        let _guard = self.locks.try_lock([LockKey::Node(id)])?;
        let volume = self.lock_if_known(id)?;
        self.unpublish_locked(id, &target)?;
        self.release_if_gone(id, volume)
    }

    pub(super) fn unpublish_locked(&self, id: VolumeId, target: &Path) -> Result<()> {
        let mut rec = self.node_records.get(id);
        let loc = self.locate_or_recorded(id, rec.as_ref());
        let devices = match &loc {
            Some(l) => self.devices(l, rec.as_ref())?,
            None => Vec::new(),
        };
        let mut mounts = self.mounts()?;
        if let Some(loc) = &loc {
            self.unmount_owned(id, loc, &devices, target, &mut mounts)?;
        } else if mounts.iter().any(|m| m.mount_point == target) {
            return Err(Error::not_found(format!(
                "volume {id} does not exist; {} is left alone",
                target.display()
            )));
        }
        failpoint::hit("unpublish.after-unmount");
        let entry = rec.as_mut().and_then(|r| r.targets.remove(target));
        // Remove only what publish made: an empty directory or an empty file.
        match csi_sys::dir::lstat(target) {
            Ok(Some(m)) if m.is_dir() => {
                let _ = csi_sys::dir::remove_empty_dir(target);
            }
            Ok(Some(m)) if m.is_file() && m.len == 0 => {
                let _ = csi_sys::file::remove_file_if_exists(target);
            }
            _ => {}
        }
        if let Some(dev) = entry.and_then(|t| t.ro_device) {
            if devices.iter().any(|d| d.device == dev) && !self.is_mounted(&mut mounts, &dev)? {
                self.sys
                    .loops
                    .detach(&dev)
                    .context(|| format!("detaching {}", dev.display()))?;
                if let Some(list) = rec.as_mut().and_then(|r| r.loop_devices.as_mut()) {
                    list.retain(|d| *d != dev);
                }
            }
        }
        if let Some(r) = rec {
            self.node_records.put(&r)?;
        }
        failpoint::hit("unpublish.after-commit");
        Ok(())
    }
}
