//! Pool data and the mount table, as both domains see them: removing a volume's
//! or snapshot's data, sweeping what no record accounts for, telling which mounts
//! are of a block device; and small helpers of requests.

use std::path::Path;

use csi_sys::{btrfs, dir, file, MountEntry, Mounter};

use crate::core::Core;
use crate::error::{Context, Error, Result};
use crate::ids::VolumeId;
use crate::model::Backing;
use crate::pool::Pool;

/// (major, minor) of a device node.
pub(crate) fn device_numbers(dev: &Path) -> Option<(u32, u32)> {
    Some(dir::stat(dev).ok()??.device_numbers())
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

/// The first mount of `dev` whose path leads to it (not covered by a later
/// mount): the one to hand a tool that takes a path (grow, freeze).
pub(crate) fn reachable_mount_of<'a>(
    mounter: &dyn Mounter,
    mounts: &'a [MountEntry],
    dev: &Path,
) -> Option<&'a MountEntry> {
    mounts
        .iter()
        .find(|m| is_mount_of(m, dev) && mounter.reachable(m))
}

/// A caller's string cut to a length fit for a message.
pub(crate) fn shorten(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// Parses a pagination token: empty is the start, anything we did not issue is ABORTED.
pub(crate) fn parse_token<T>(token: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Option<T>> {
    if token.is_empty() {
        return Ok(None);
    }
    parse(token).map(Some).ok_or_else(|| {
        Error::Aborted(format!(
            "starting_token {token:?} was not issued by this driver"
        ))
    })
}

/// Removes a file, directory tree or btrfs subvolume, durably; absent is fine.
pub(crate) fn remove_data(path: &Path) -> Result<()> {
    remove_data_with(path, true)
}

/// Removes data whose record is gone already, without a sync of its folder:
/// what a power loss brings back has no record, and start-up removes it.
pub(crate) fn drop_data(path: &Path) -> Result<()> {
    remove_data_with(path, false)
}

/// The same, durable only when `sync`.
fn remove_data_with(path: &Path, sync: bool) -> Result<()> {
    let at = || format!("removing {}", path.display());
    let Some(meta) = dir::lstat(path).context(at)? else {
        return Ok(());
    };
    if meta.is_dir() {
        if btrfs::is_subvolume(path) {
            btrfs::subvolume_delete(path).context(at)?;
        } else {
            file::remove_tree(path).context(at)?;
        }
    } else {
        file::remove_file_if_exists(path).context(at)?;
    }
    if let Some(parent) = path.parent().filter(|_| sync) {
        file::fsync_dir(parent).context(at)?;
    }
    Ok(())
}

impl Core {
    /// Removes whatever data a volume id has in any pool.
    pub(crate) fn remove_volume_data(&self, id: VolumeId, ephemeral: bool) -> Result<()> {
        self.remove_volume_data_with(id, ephemeral, true)
    }

    /// Removes the data of a volume whose record is gone, without a sync: what a
    /// power loss brings back has no record, and start-up removes it.
    pub(crate) fn drop_volume_data(&self, id: VolumeId) -> Result<()> {
        self.remove_volume_data_with(id, false, false)
    }

    fn remove_volume_data_with(&self, id: VolumeId, ephemeral: bool, sync: bool) -> Result<()> {
        for pool in self.pools.values() {
            for backing in [Backing::Image, Backing::Directory] {
                let path = pool.volume_path(id, backing, ephemeral);
                remove_data_with(&path, sync)?;
                remove_data_with(&Pool::tmp_path(&path), sync)?;
            }
        }
        Ok(())
    }

    /// Removes entries of a pool directory that `known` does not account for, and
    /// every leftover temporary.
    pub(crate) fn remove_orphans(&self, folder: &Path, known: impl Fn(&str) -> bool) -> Result<()> {
        // Streamed: a pool of many volumes is walked at every start, and a
        // path is made only for what is removed.
        let Ok(names) = dir::names(folder) else {
            return Ok(());
        };
        for name in names.flatten() {
            let temp = name.starts_with('.');
            let stem = name.strip_suffix(".img").unwrap_or(&name);
            if temp || !known(stem) {
                let path = folder.join(&name);
                if !temp && name.ends_with(".img") {
                    // An image still attached is in use by something: leave it and say so.
                    if let Ok(devs) = self.sys.loops.find(&path) {
                        if !devs.is_empty() {
                            tracing::warn!(path = %path.display(),
                                "image has no record but is attached to a loop device; kept");
                            continue;
                        }
                    }
                }
                tracing::warn!(path = %path.display(), "removing pool data no record accounts for");
                remove_data(&path)?;
            }
        }
        Ok(())
    }
}
