//! The start-up check of the node: staged marks made to follow the node's
//! records, and mounts, loop devices and ephemeral data of the pools that no
//! volume accounts for reported (and removed when asked).

use csi_sys::{LoopDevice, MountEntry};

use super::Node;
use crate::data::{is_mount_of, mounts_of};
use crate::error::Result;
use crate::ids::VolumeId;
use crate::model::*;

impl Node {
    /// Makes the staged marks of the shared state follow the node's records: a
    /// crash between writing one and the other leaves them apart.
    fn reconcile_staged_marks(&self) {
        let marked: std::collections::BTreeSet<VolumeId> =
            self.state.staged_ids().into_iter().collect();
        let staged: std::collections::BTreeSet<VolumeId> = self
            .node_records
            .all()
            .into_iter()
            .filter(|r| !r.ephemeral)
            .map(|r| r.id)
            .collect();
        for id in marked.symmetric_difference(&staged) {
            let fixed = self
                .state
                .lock_volume(*id)
                .and_then(|l| l.set_staged(staged.contains(id)));
            if let Err(e) = fixed {
                tracing::warn!(volume.id = %id, error = %e, "could not correct the staged mark");
            }
        }
    }

    /// Start-up on the node: report mounts and loop devices of the pools that no
    /// volume accounts for, and remove ephemeral data without a record.
    pub(crate) fn recover_node(&self) -> Result<()> {
        self.reconcile_staged_marks();
        self.release_unmade_ephemeral()?;
        for pool in self.pools.values() {
            self.remove_orphans(&pool.ephemeral_dir(), |stem| {
                VolumeId::parse(stem).is_some_and(|id| self.ephemeral_volumes.contains(id))
            })?;
        }
        let loops: Vec<LoopDevice> = self
            .sys
            .loops
            .list()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|d| self.as_pool_loop(d))
            .collect();
        self.report_orphan_mounts(&loops);
        self.report_orphan_loops(loops);
        Ok(())
    }

    /// Mounts of pool volumes (of their loop devices, or binds of their
    /// directories) that no staged volume accounts for: reported, and unmounted
    /// when asked.
    fn report_orphan_mounts(&self, loops: &[LoopDevice]) {
        let known_id = |id: Option<VolumeId>| id.is_some_and(|id| self.node_records.contains(id));
        let all = self.mounts().unwrap_or_default();
        for m in all.iter().cloned() {
            if self
                .pools
                .values()
                .any(|p| m.mount_point.starts_with(&p.root))
            {
                continue; // the pool itself, or mounts inside it
            }
            if let Some(id) = self.pool_volume_mounted(&all, &m, loops) {
                if !known_id(id) {
                    tracing::warn!(mountpoint = %m.mount_point.display(), source = %m.source,
                        clean = self.cfg.cleanup_orphans,
                        "mount of a pool volume that no staged volume accounts for");
                    if self.cfg.cleanup_orphans {
                        if let Err(e) = self.sys.mounter.unmount(&m.mount_point) {
                            tracing::error!(mountpoint = %m.mount_point.display(), error = %e,
                                "could not unmount an orphan mount");
                        }
                    }
                }
            }
        }
    }

    /// Some when `m` is a mount of a pool volume, with the volume's id when its
    /// image's name tells one; None for any other mount.
    fn pool_volume_mounted(
        &self,
        all: &[MountEntry],
        m: &MountEntry,
        loops: &[LoopDevice],
    ) -> Option<Option<VolumeId>> {
        let by_device = loops.iter().find(|d| {
            self.pools.values().any(|p| p.contains(&d.backing_file)) && is_mount_of(m, &d.device)
        });
        if let Some(d) = by_device {
            Some(
                d.backing_file
                    .file_stem()
                    .and_then(|s| VolumeId::parse(&s.to_string_lossy())),
            )
        } else if m
            .root
            .parent()
            .is_some_and(|p| p.ends_with("volumes") || p.ends_with("ephemeral"))
        {
            m.root
                .file_name()
                .and_then(|s| VolumeId::parse(&s.to_string_lossy()))
                .filter(|id| {
                    self.locate(*id)
                        .is_some_and(|loc| self.owns(all, m, *id, &loc, &[]))
                })
                .map(Some)
        } else {
            None
        }
    }

    /// Loop devices of pool images that no staged volume accounts for:
    /// reported, and detached when asked and not mounted.
    fn report_orphan_loops(&self, loops: Vec<LoopDevice>) {
        let mounts = self.mounts().unwrap_or_default();
        for d in loops {
            if self.pools.values().any(|p| p.contains(&d.backing_file)) {
                let known = d
                    .backing_file
                    .file_stem()
                    .and_then(|s| VolumeId::parse(&s.to_string_lossy()))
                    .is_some_and(|id| self.node_records.contains(id));
                if !known {
                    tracing::warn!(device = %d.device.display(), file = %d.backing_file.display(),
                        clean = self.cfg.cleanup_orphans,
                        "loop device of a pool image that no staged volume accounts for");
                    if self.cfg.cleanup_orphans && mounts_of(&mounts, &d.device).is_empty() {
                        if let Err(e) = self.sys.loops.detach(&d.device) {
                            tracing::error!(device = %d.device.display(), error = %e,
                                "could not detach an orphan loop device");
                        }
                    }
                }
            }
        }
    }

    /// `d` as a loop device of a pool image (its backing file named by its pool
    /// path), or None when it is not one. A device attached by an earlier
    /// container of the node plugin shows its backing file by the path that
    /// container had: it is recognised by the volume id of the file's name and
    /// the identity of that volume's image.
    fn as_pool_loop(&self, d: LoopDevice) -> Option<LoopDevice> {
        if self.pools.values().any(|p| p.contains(&d.backing_file)) {
            return Some(d);
        }
        let id = d
            .backing_file
            .file_stem()
            .and_then(|s| VolumeId::parse(&s.to_string_lossy()))?;
        let loc = self.locate(id).filter(|l| l.backing == Backing::Image)?;
        self.sys
            .loops
            .find(&loc.path)
            .ok()?
            .into_iter()
            .find(|f| f.device == d.device)
    }
}
