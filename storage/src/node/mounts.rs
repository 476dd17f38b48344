//! The mount table as the node reads it: which mounts belong to a volume, and
//! unmounting only those.

use std::path::Path;

use csi_sys::{LoopDevice, MountEntry, SysError};

use super::Node;
use crate::data::{is_mount_of, mounts_of};
use crate::error::{Context, Error, Result};
use crate::ids::VolumeId;
use crate::model::*;
use crate::pool::Located;

impl Node {
    pub(super) fn mounts(&self) -> Result<Vec<MountEntry>> {
        self.sys
            .mounter
            .mounts()
            .context(|| "reading the mount table".into())
    }

    /// Whether `device` is mounted anywhere, from the table this operation read
    /// (less what it unmounted since). A mount that table still shows is looked up
    /// again: an unmount may have taken propagated copies of it along.
    pub(super) fn is_mounted(&self, mounts: &mut Vec<MountEntry>, device: &Path) -> Result<bool> {
        if mounts_of(mounts, device).is_empty() {
            return Ok(false);
        }
        *mounts = self.mounts()?;
        Ok(!mounts_of(mounts, device).is_empty())
    }

    /// Whether a mount entry belongs to this volume: a mount of one of its loop
    /// devices (or a bind of the device node), or for a directory volume a bind of
    /// exactly its directory from the pool's own filesystem.
    pub(super) fn owns(
        &self,
        mounts: &[MountEntry],
        m: &MountEntry,
        id: VolumeId,
        loc: &Located,
        devices: &[LoopDevice],
    ) -> bool {
        match loc.backing {
            Backing::Image => devices.iter().any(|d| {
                is_mount_of(m, &d.device)
                    || (m.root == Path::new("/").join(d.device.file_name().unwrap_or_default())
                        && m.fs_type == "devtmpfs")
            }),
            _ => {
                let id = id.to_string();
                let named = m.root.ends_with(Path::new("volumes").join(&id))
                    || m.root.ends_with(Path::new("ephemeral").join(&id));
                // The mount holding the volume's directory tells which filesystem
                // and subtree a bind of it shows; another pool with a volume of the
                // same id (another driver instance) shows something else.
                let holder = mounts
                    .iter()
                    .filter(|h| loc.path.starts_with(&h.mount_point) && h.mount_point != loc.path)
                    .max_by_key(|h| h.mount_point.as_os_str().len());
                match holder {
                    Some(h) => {
                        let rel = loc.path.strip_prefix(&h.mount_point).unwrap_or(&loc.path);
                        named
                            && m.source == h.source
                            && (m.major, m.minor) == (h.major, h.minor)
                            && m.root == h.root.join(rel)
                    }
                    None => named,
                }
            }
        }
    }

    /// Unmounts every mount of this volume at `path` (mounts may be stacked);
    /// FAILED_PRECONDITION if something else is mounted there. `mounts` is the
    /// table the operation read; what is unmounted leaves it.
    pub(super) fn unmount_owned(
        &self,
        id: VolumeId,
        loc: &Located,
        devices: &[LoopDevice],
        path: &Path,
        mounts: &mut Vec<MountEntry>,
    ) -> Result<()> {
        loop {
            let Some(i) = mounts.iter().rposition(|m| m.mount_point == path) else {
                return Ok(());
            };
            if !self.owns(mounts, &mounts[i], id, loc, devices) {
                return Err(Error::precondition(format!(
                    "{} is a mount of something other than volume {id}; it is left alone",
                    path.display()
                )));
            }
            // A process forked at the wrong moment (or a scanner) can hold the
            // mount for a moment: EBUSY is retried briefly before it is an error.
            let mut tries = 0;
            loop {
                match self.sys.mounter.unmount(path) {
                    // Gone already: another of its propagated copies went first.
                    Ok(()) | Err(SysError::NotMounted { .. }) => break,
                    Err(SysError::Busy { .. }) if tries < 20 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    Err(e) => {
                        return Err(Error::System {
                            context: format!("unmounting {}", path.display()),
                            source: e,
                        })
                    }
                }
            }
            mounts.remove(i);
        }
    }
}
