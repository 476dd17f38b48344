//! What a new volume holds: nothing yet (a sparse image, a subvolume with its
//! limit, a directory), or a copy of a snapshot (a restore) or of a live volume (a
//! clone, frozen while it is copied), made by reflink where the pool can.

use std::path::Path;

use csi_sys::{btrfs, file};

use crate::core::blank;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::model::*;
use crate::pool::Pool;
use crate::settings::record_size;
use crate::Controller;

impl Controller {
    /// The pool, path, backing, size and filesystem of a content source.
    pub(super) fn source_data(
        &self,
        src: ContentSource,
    ) -> Result<(String, std::path::PathBuf, Backing, u64, Option<String>)> {
        match src {
            ContentSource::Snapshot(sid) => {
                let s = self
                    .snapshots
                    .get(sid)
                    .filter(|s| s.state == RecordState::Ready)
                    .ok_or_else(|| {
                        Error::not_found(format!("source snapshot {sid} does not exist"))
                    })?;
                let pool = self.pool(&s.pool)?;
                Ok((
                    s.pool.clone(),
                    pool.snapshot_path(sid, s.backing),
                    s.backing,
                    s.size,
                    s.fs_type,
                ))
            }
            ContentSource::Volume(vid) => {
                let v = self
                    .volumes
                    .get(vid)
                    .filter(|v| v.state == RecordState::Ready)
                    .ok_or_else(|| {
                        Error::not_found(format!("source volume {vid} does not exist"))
                    })?;
                let pool = self.pool(&v.pool)?;
                crate::core::arrival::refuse_while_arriving(
                    &pool.volume_path(vid, v.backing, false),
                    "a clone of this volume",
                )?;
                Ok((
                    v.pool.clone(),
                    pool.volume_path(vid, v.backing, false),
                    v.backing,
                    v.size,
                    v.fs_type,
                ))
            }
        }
    }

    /// Makes the data of a new volume: an empty sparse image or directory, or a copy
    /// (reflink where the pool can) of a source.
    pub(crate) fn make_volume_data(
        &self,
        pool: &Pool,
        rec: &VolumeRecord,
        source: Option<(&Path, Backing)>,
    ) -> Result<()> {
        let path = pool.volume_path(rec.id, rec.backing, rec.ephemeral);
        let at = || format!("making volume {} at {}", rec.id, path.display());
        match (rec.backing, source) {
            // Its record alone makes a blank image durable (see core::blank); the
            // first stage fills it from a template (see core::fresh).
            (Backing::Image, None) if blank::is_fresh_image(rec) => {
                if let Some(fs) = rec.fs_type.as_deref() {
                    self.templates
                        .want(pool, fs, rec.size, self.cfg.command_timeout);
                }
                return blank::make(&path, rec, pool);
            }
            (Backing::Image, None) => {
                let from_template = rec.fs_type.as_deref().is_some_and(|fs| {
                    self.templates
                        .fill(pool, (fs, rec.size), &path, &[], self.cfg.command_timeout)
                });
                if !from_template {
                    file::create_sparse(&path, rec.size).context(at)?;
                }
            }
            (Backing::Image, Some((src, _))) => {
                // A live source is frozen while it is copied, so the copy is a
                // consistent filesystem; a snapshot does not change.
                // The slot is taken before the freeze, so a frozen source never waits
                // for another copy to finish.
                // The copy is made durable below, after the thaw and with its length.
                let copy = || file::copy_file_unsynced(src, &path).context(at);
                let reflinked = match rec.source {
                    Some(ContentSource::Volume(v)) => {
                        self.heavy(|| self.with_frozen(&[(v, src.to_path_buf())], copy))??
                    }
                    _ => self.heavy(copy)??,
                };
                failpoint::hit("create-volume.after-copy");
                file::grow(&path, rec.size).context(at)?;
                file::make_new_file_durable(&path).context(at)?;
                tracing::debug!(volume.id = %rec.id, reflinked, "image copied");
            }
            (Backing::Subvolume, None) => {
                btrfs::subvolume_create(&path).context(at)?;
                btrfs::qgroup_limit(&path, rec.size).context(at)?;
            }
            (Backing::Subvolume, Some((src, _))) => {
                btrfs::subvolume_snapshot(src, &path, false).context(at)?;
                failpoint::hit("create-volume.after-copy");
                btrfs::qgroup_limit(&path, rec.size).context(at)?;
            }
            (Backing::Directory, None) => {
                file::mkdir_p_mode(&path, 0o755).context(at)?;
                record_size(&path, rec.size)?;
            }
            (Backing::Directory, Some((src, _))) => {
                self.heavy(|| file::copy_tree(src, &path))?.context(at)?;
                failpoint::hit("create-volume.after-copy");
                record_size(&path, rec.size)?;
            }
        }
        self.write_attributes(&path, rec.backing, &rec.mutable_parameters)?;
        Ok(())
    }
}
