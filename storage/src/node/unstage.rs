//! NodeUnstageVolume: unmount the staging path and detach the volume's loop
//! devices, refused while a target is still published.

use std::path::Path;

use csi_sys::SysError;

use super::Node;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::locks::LockKey;
use crate::state::VolumeLock;

impl Node {
    pub fn node_unstage(&self, volume_id: &str, staging_path: &str) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let staging = self.check_path("staging_target_path", staging_path)?;
        let id = VolumeId::parse_existing(volume_id)?;
        let _guard = self.locks.try_lock([LockKey::Node(id)])?;
        let volume = self.lock_if_known(id)?;
        self.unstage_locked(id, &staging, volume.as_ref())?;
        self.release_if_gone(id, volume)
    }

    /// Unstages a volume; `volume` is the lock of a controller's volume, whose
    /// staged mark goes once nothing of it is left here.
    pub(super) fn unstage_locked(
        &self,
        id: VolumeId,
        staging: &Path,
        volume: Option<&VolumeLock>,
    ) -> Result<()> {
        let rec = self.node_records.get(id);
        let loc = self.locate_or_recorded(id, rec.as_ref());
        let Some(loc) = loc else {
            // Neither data nor record: nothing of this volume is left here.
            return volume.map_or(Ok(()), |v| v.set_staged(false));
        };
        let devices = self.devices(&loc, rec.as_ref())?;
        let mut mounts = self.mounts()?;
        // Targets still mounted mean the CO skipped an unpublish.
        if let Some(r) = &rec {
            for t in r.targets.keys() {
                if mounts
                    .iter()
                    .any(|m| &m.mount_point == t && self.owns(&mounts, m, id, &loc, &devices))
                {
                    return Err(Error::precondition(format!(
                        "volume {id} is still published at {}; unpublish it first",
                        t.display()
                    )));
                }
            }
        }
        self.unmount_owned(id, &loc, &devices, staging, &mut mounts)?;
        if let Some(old) = rec
            .as_ref()
            .and_then(|r| r.staging_path.as_ref())
            .filter(|p| p.as_path() != staging)
        {
            if mounts
                .iter()
                .any(|m| &m.mount_point == old && self.owns(&mounts, m, id, &loc, &devices))
            {
                // Nothing of the volume at this path; it stays staged where it is.
                return Ok(());
            }
        }
        failpoint::hit("unstage.after-unmount");
        for d in &devices {
            if !self.is_mounted(&mut mounts, &d.device)? {
                match self.sys.loops.detach(&d.device) {
                    // Still open elsewhere for a moment: the kernel detaches it when
                    // the last user closes it, so the volume is unstaged all the same.
                    Err(SysError::Busy { .. }) => tracing::warn!(device = %d.device.display(),
                        "loop device busy; the kernel detaches it once it is closed"),
                    other => other.context(|| format!("detaching {}", d.device.display()))?,
                }
            } else {
                tracing::warn!(device = %d.device.display(), "loop device still mounted elsewhere; kept");
            }
        }
        failpoint::hit("unstage.after-detach");
        self.node_records.remove(id)?;
        volume.map_or(Ok(()), |v| v.set_staged(false))
    }
}
