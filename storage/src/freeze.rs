//! Consistent copies of live volumes: the filesystems of the volumes being copied
//! are frozen (FIFREEZE) for the copy and always thawed afterwards, on error too.
//! Before a freeze the driver writes a marker under the state dir, so that a freeze
//! left by a crash is thawed at the next start.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use csi_sys::{file, MountEntry};

use crate::error::{Context, Result};
use crate::ids::VolumeId;
use crate::Driver;

/// (major, minor) of a device node.
pub(crate) fn device_numbers(dev: &Path) -> Option<(u32, u32)> {
    let rdev = std::fs::metadata(dev).ok()?.rdev();
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
    let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
    Some((major as u32, minor as u32))
}

/// Whether a mount is of a block device: by device numbers, or by source, since
/// btrfs reports an anonymous device number (0:N) for its mounts.
pub(crate) fn is_mount_of(m: &MountEntry, dev: &Path) -> bool {
    Path::new(&m.source) == dev || device_numbers(dev).is_some_and(|n| (m.major, m.minor) == n)
}

/// The mounts of a block device.
pub(crate) fn mounts_of<'a>(mounts: &'a [MountEntry], dev: &Path) -> Vec<&'a MountEntry> {
    mounts.iter().filter(|m| is_mount_of(m, dev)).collect()
}

struct Frozen<'a> {
    driver: &'a Driver,
    marker: PathBuf,
    mountpoints: Vec<PathBuf>,
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        let mut thawed = true;
        for mp in self.mountpoints.iter().rev() {
            if let Err(e) = self.driver.sys.fs.thaw(mp) {
                tracing::error!(path = %mp.display(), error = %e, "thaw failed");
                thawed = false;
            }
        }
        // A marker whose thaw failed stays, so that the next start tries again.
        if thawed {
            let _ = std::fs::remove_file(&self.marker);
        }
    }
}

impl Driver {
    fn frozen_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("frozen")
    }

    /// Runs `f` with the filesystem of every staged image among `images` frozen.
    pub(crate) fn with_frozen<T>(
        &self,
        images: &[(VolumeId, PathBuf)],
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        // The node's lock on every volume: an unpublish or unstage cannot unmount a
        // filesystem while it is frozen (the thaw would then find no mount point,
        // and the filesystem would stay frozen).
        let _node = self
            .locks
            .try_lock(images.iter().map(|(id, _)| format!("node:{id}")))?;
        let mounts = self
            .sys
            .mounter
            .mounts()
            .context(|| "reading the mount table".into())?;
        let mut mountpoints = Vec::new();
        for (_, image) in images {
            if image.is_dir() {
                continue;
            }
            let devs = self
                .sys
                .loops
                .find(image)
                .context(|| "listing loop devices".into())?;
            for dev in devs {
                if let Some(m) = mounts_of(&mounts, &dev.device).first() {
                    if !mountpoints.contains(&m.mount_point) {
                        mountpoints.push(m.mount_point.clone());
                    }
                }
            }
        }
        if mountpoints.is_empty() {
            return f();
        }
        let dir = self.frozen_dir();
        file::mkdir_p_mode(&dir, 0o700).context(|| "making the freeze marker dir".into())?;
        let key = images
            .first()
            .map(|(id, _)| id.to_string())
            .unwrap_or_default();
        let marker = dir.join(format!("{key}.json"));
        let body = serde_json::to_vec(&mountpoints).unwrap_or_default();
        file::write_atomic(&marker, &body).context(|| "writing the freeze marker".into())?;
        let mut guard = Frozen {
            driver: self,
            marker,
            mountpoints: Vec::new(),
        };
        for mp in &mountpoints {
            self.sys
                .fs
                .freeze(mp)
                .context(|| format!("freezing {}", mp.display()))?;
            guard.mountpoints.push(mp.clone());
        }
        crate::failpoint::hit("freeze.after-freeze");
        f()
    }

    /// Thaws what a crash left frozen.
    pub(crate) fn thaw_left_frozen(&self) {
        let Ok(entries) = std::fs::read_dir(self.frozen_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let mps: Vec<PathBuf> = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            for mp in mps {
                match self.sys.fs.thaw(&mp) {
                    Ok(()) => {
                        tracing::warn!(path = %mp.display(), "thawed a filesystem a crash left frozen")
                    }
                    Err(e) => tracing::debug!(path = %mp.display(), error = %e, "thaw at start"),
                }
            }
            let _ = std::fs::remove_file(&path);
        }
    }
}
