//! DeleteVolume: refused while the volume is published or in use on the node;
//! the record goes before the data, so data a crash leaves is an orphan, removed
//! at start.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::locks::LockKey;
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
        let _guard = self.locks.try_lock([LockKey::Volume(id)])?;
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
        if rec.backing == Backing::Image {
            if let Some(dev) = self.device_serving(&path)? {
                return Err(Error::precondition(format!(
                    "volume {id} is in use on this node through {}; unstage it first",
                    dev.display()
                )));
            }
        }
        // The record goes first, in one journal write: a crash after it leaves data
        // that no record accounts for, which start-up removes, so removing the data
        // needs no sync of its own.
        // A volume still arriving: its transfer stops first (the source's hold
        // is let go), so nothing writes into data about to go.
        self.stop_arrival(id)?;
        self.volumes.remove(id)?;
        failpoint::hit("delete-volume.after-commit");
        self.drop_volume_data(id)?;
        failpoint::hit("delete-volume.after-data");
        // What transfers kept of it for their next run: useless without it.
        self.forget_bases_of(id);
        self.forget_replica_of(id);
        volume.remove()?;
        tracing::info!(volume.id = %id, name = %rec.name, "volume deleted");
        Ok(())
    }

    /// A loop device serving the image at `path`, if one is still there after
    /// [`RELEASE_WAIT`]: a device the node detached while another process had it
    /// open for a moment (a scan, a container runtime's copy of the mount table)
    /// is torn down by the kernel only at that close.
    fn device_serving(&self, path: &Path) -> Result<Option<PathBuf>> {
        let deadline = Instant::now() + RELEASE_WAIT;
        loop {
            let may_serve = self
                .sys
                .loops
                .may_serve(path)
                .context(|| format!("asking whether {} is in use", path.display()))?;
            if !may_serve {
                return Ok(None);
            }
            let attached = self
                .sys
                .loops
                .find(path)
                .context(|| "listing loop devices".into())?;
            let Some(dev) = attached.into_iter().next() else {
                return Ok(None);
            };
            if Instant::now() >= deadline {
                return Ok(Some(dev.device));
            }
            crate::cancel::check()?;
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// How long DeleteVolume waits for a loop device on its image to be released.
const RELEASE_WAIT: Duration = Duration::from_secs(1);
