//! New empty images, made without a sync of their own. A new image holds no data,
//! so its record says all there is to know of it: the record's one journal write
//! is the create's only synchronous write, and what a power loss takes of the
//! image (its entry, its length, its attributes) start-up makes again from the
//! record. Data can reach an image only through a loop device the node attaches,
//! and the node makes the image durable before it attaches it; a compaction makes
//! the images of the records it folds durable before it drops their journal.
//!
//! Each such image carries its record's creation time, so that start-up tells the
//! image of this record from one of an earlier volume of the same id whose
//! removal a power loss undid.

use std::path::{Path, PathBuf};

use csi_sys::{file, xattr};

use crate::core::Core;
use crate::data::remove_data;
use crate::error::{Context, Result};
use crate::model::{Backing, RecordState, VolumeRecord};
use crate::pool::Pool;
use crate::settings::{attr_name, carried_by_data};
use crate::store::Barrier;

/// The attribute holding the creation time of the record an image was made for.
const MADE_FOR: &str = "created";

fn stamp(rec: &VolumeRecord) -> String {
    format!("{}.{:09}", rec.created.seconds, rec.created.nanos)
}

/// Whether a volume's data is a new empty image, made without a sync.
pub(crate) fn is_fresh_image(rec: &VolumeRecord) -> bool {
    rec.backing == Backing::Image && rec.source.is_none() && !rec.ephemeral
}

/// The attributes a new image of `rec` carries: its mutable parameters and the
/// stamp of its record.
pub(crate) fn attributes(rec: &VolumeRecord) -> Vec<(String, Vec<u8>)> {
    carried_by_data(&rec.mutable_parameters)
        .iter()
        .map(|(k, v)| (attr_name(k), v.as_bytes().to_vec()))
        .chain(std::iter::once((
            attr_name(MADE_FOR),
            stamp(rec).into_bytes(),
        )))
        .collect()
}

/// Makes the image of a new volume of `pool` with its attributes, marked to be
/// filled from a template at its first stage when templates serve its
/// filesystem (see `fresh`); nothing of it is durable yet. Fails with
/// AlreadyExists when the path exists.
pub(crate) fn make(path: &Path, rec: &VolumeRecord, pool: &Pool) -> Result<()> {
    let at = || format!("making volume {} at {}", rec.id, path.display());
    file::create_sparse_unsynced(path, rec.size).context(at)?;
    let pending = crate::fresh::pending_mark(pool, rec.fs_type.as_deref());
    for (name, value) in attributes(rec).into_iter().chain(pending) {
        xattr::set(path, &name, &value)
            .context(|| format!("recording {name} on {}", path.display()))?;
    }
    Ok(())
}

/// Makes an image and its entry durable: before anything can write data into it.
pub(crate) fn make_durable(image: &Path) -> Result<()> {
    file::make_new_file_durable(image).context(|| format!("syncing {}", image.display()))
}

impl Core {
    /// Start-up: the images of `records` (those the journal made) that a power
    /// loss took in part, or that are another volume's, are made again, durably.
    /// Returns whether every one is whole now.
    pub(crate) fn repair_fresh_images(
        &self,
        records: impl IntoIterator<Item = VolumeRecord>,
    ) -> bool {
        let mut whole = true;
        for rec in records {
            if !is_fresh_image(&rec) || rec.state != RecordState::Ready {
                continue;
            }
            let Ok(pool) = self.pool(&rec.pool) else {
                continue;
            };
            let path = pool.volume_path(rec.id, Backing::Image, false);
            let made_for = xattr::get(&path, &attr_name(MADE_FOR)).ok().flatten();
            if made_for.as_deref() == Some(stamp(&rec).as_bytes()) {
                continue;
            }
            tracing::warn!(volume.id = %rec.id, path = %path.display(),
                "making again the new image a power loss took");
            let remade = remove_data(&path)
                .and_then(|()| make(&path, &rec, pool))
                .and_then(|()| make_durable(&path));
            if let Err(e) = remade {
                whole = false;
                tracing::error!(volume.id = %rec.id, error = %e,
                    "could not make the image again; a stage of the volume will fail");
            }
        }
        whole
    }
}

/// From this many images in a part of a compaction's barrier on, one syncfs of
/// each pool's filesystem makes them durable instead of an fsync each: an fsync
/// of a new image costs a log force and a flush of the disk's cache (over a
/// millisecond on a loop-mounted pool), so after many creates the per-image
/// fsyncs of one compaction ran for tens of seconds beside the calls it served.
/// A syncfs also writes back what volumes wrote through their loop devices and
/// the kernel had not written yet; a part this large makes that worth it.
const SYNCFS_FROM: usize = 32;

#[cfg(test)]
thread_local! {
    /// Tests set how many images a part needs for a syncfs (`SYNCFS_FROM`
    /// otherwise); the power-loss model takes both ways.
    pub(crate) static TEST_SYNCFS_FROM: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

fn syncfs_from() -> usize {
    #[cfg(test)]
    if let Some(n) = TEST_SYNCFS_FROM.with(|c| c.get()) {
        return n;
    }
    SYNCFS_FROM
}

/// The barrier of the volume store's compactions: the images of the records
/// folded, in the pools' volume folders `dirs`, made durable.
pub(crate) fn barrier(dirs: Vec<PathBuf>) -> Barrier {
    Box::new(move |ids: &[String]| {
        let each = ids.len() < syncfs_from();
        dirs.iter().try_for_each(|dir| {
            if each {
                sync_each(dir, ids)
            } else {
                sync_filesystem(dir)
            }
        })
    })
}

/// The images `ids` in `dir`, an fsync each, then `dir` once.
fn sync_each(dir: &Path, ids: &[String]) -> Result<()> {
    let mut synced = false;
    for id in ids {
        let path = dir.join(format!("{id}.img"));
        match file::sync_path(&path) {
            Ok(()) => synced = true,
            // Removed since, or not an image.
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e).context(|| format!("syncing {}", path.display())),
        }
    }
    if synced {
        file::fsync_dir(dir).context(|| format!("syncing {}", dir.display()))?;
    }
    Ok(())
}

/// Every image in `dir`, its entry, length, attributes and data, at once.
fn sync_filesystem(dir: &Path) -> Result<()> {
    match file::syncfs(dir) {
        // A pool that never held an image.
        Err(e) if e.is_not_found() => Ok(()),
        r => r.context(|| format!("syncing the filesystem of {}", dir.display())),
    }
}
