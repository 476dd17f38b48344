//! The start-up repair of volumes: creations and deletions left half-done are
//! rolled back or finished, pending expansions applied, and pool data that no
//! record accounts for removed.

use crate::error::Result;
use crate::ids::VolumeId;
use crate::model::*;
use crate::state::Domain;
use crate::Controller;

impl Controller {
    /// Start-up: roll back creations, finish deletions and expansions, then remove
    /// pool data that no record accounts for.
    pub(crate) fn recover_volumes(&self) -> Result<()> {
        // New images are not synced: only a power loss takes what was written
        // of them, and a start in the boot that wrote them finds them whole.
        let boot = &self.sys.boot_id;
        if !self.state.looked_over_in(Domain::Controller, boot) {
            let made = self.volumes.created_in_journal().into_iter();
            if self.repair_fresh_images(made.filter_map(|id| self.volumes.get(id))) {
                self.state.note_looked_over_in(Domain::Controller, boot)?;
            }
        }
        for rec in self.volumes.unsettled() {
            // A record that cannot be repaired now stays as it is: it is not listed
            // (Creating, Deleting) and a retry of its call repairs it, so one bad
            // record never keeps the driver from starting.
            let repaired = match (rec.state, rec.pending_size) {
                (RecordState::Creating | RecordState::Deleting, _) => {
                    tracing::warn!(volume.id = %rec.id, state = ?rec.state,
                        "removing a volume an interrupted create or delete left");
                    self.roll_back_volume(&rec)
                }
                (RecordState::Ready, Some(size)) => {
                    tracing::warn!(volume.id = %rec.id, size, "finishing an interrupted expansion");
                    self.pool(&rec.pool)
                        .and_then(|pool| self.apply_size(pool, &rec, size))
                        .and_then(|()| {
                            let mut done = rec.clone();
                            done.size = size.max(rec.size);
                            done.pending_size = None;
                            self.volumes.put(&done)
                        })
                }
                _ => Ok(()),
            };
            if let Err(e) = repaired {
                tracing::error!(volume.id = %rec.id, error = %e,
                    "could not repair the volume at start; a retry of its call will");
            }
        }
        for pool in self.pools.values() {
            self.remove_orphans(&pool.volumes_dir(), |stem| {
                VolumeId::parse(stem).is_some_and(|id| self.volumes.contains(id))
                    || self.volumes.is_quarantined(stem)
            })?;
        }
        Ok(())
    }
}
