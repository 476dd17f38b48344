//! DeleteVolume: refused while the volume is published or in use on the node;
//! the intent is recorded before the data goes, so a crash is finished at start.

use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::model::*;
use crate::Controller;

impl Controller {
    pub fn delete_volume(&self, volume_id: &str) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        // An id this driver never issued names nothing: deleting it succeeds.
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let _guard = self.locks.try_lock([format!("volume:{id}")])?;
        // The volume's lock, shared with the node: no stage can begin while the
        // volume is deleted, and the staged mark read here stays true.
        let volume = self.state.lock_volume(id)?;
        failpoint::hit("delete-volume.after-volume-lock");
        let Some(rec) = self.volumes.get(id) else {
            self.remove_volume_data(id, false)?;
            return volume.remove();
        };
        if let Some(node) = rec.published.keys().next() {
            return Err(Error::precondition(format!(
                "volume {id} is still published to node {node}; unpublish it first"
            )));
        }
        if volume.is_staged() {
            return Err(Error::precondition(format!(
                "volume {id} is staged on node {}; unstage it first",
                self.cfg.node_id
            )));
        }
        let pool = self.pool(&rec.pool)?;
        let path = pool.volume_path(id, rec.backing, false);
        // The staged mark answers for the node's own devices; a device attached
        // otherwise holds the image open, which the kernel tells without a look at
        // every device.
        if rec.backing == Backing::Image
            && self
                .sys
                .loops
                .may_serve(&path)
                .context(|| format!("asking whether {} is in use", path.display()))?
        {
            let attached = self
                .sys
                .loops
                .find(&path)
                .context(|| "listing loop devices".into())?;
            if let Some(dev) = attached.first() {
                return Err(Error::precondition(format!(
                    "volume {id} is in use on this node through {}; unstage it first",
                    dev.device.display()
                )));
            }
        }
        // The record goes first, in one journal write: a crash after it leaves data
        // that no record accounts for, which start-up removes, so removing the data
        // needs no sync of its own.
        self.volumes.remove(id)?;
        failpoint::hit("delete-volume.after-commit");
        self.drop_volume_data(id)?;
        failpoint::hit("delete-volume.after-data");
        volume.remove()?;
        tracing::info!(volume.id = %id, name = %rec.name, "volume deleted");
        Ok(())
    }
}
