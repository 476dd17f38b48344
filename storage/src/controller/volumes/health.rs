//! ControllerGetVolumeHealth and ControllerListVolumeHealth: what the
//! controller can see of a volume, its data in its pool.

use std::ops::ControlFlow;

use crate::data::parse_token;
use crate::error::{Error, Result};
use crate::health::{data_problems, Problems, Severity, VolumeHealth, VolumeHealthPage};
use crate::ids::VolumeId;
use crate::model::*;
use crate::Controller;

impl Controller {
    /// What the controller can see of a volume: its data in its pool.
    fn problems(&self, rec: &VolumeRecord) -> Problems {
        let Ok(pool) = self.pool(&rec.pool) else {
            let mut out = Problems::default();
            out.push(
                Severity::Inaccessible,
                "PoolNotConfigured",
                format!(
                    "the volume's pool {} is not configured on this node",
                    rec.pool
                ),
            );
            return out;
        };
        let path = pool.volume_path(rec.id, rec.backing, rec.ephemeral);
        data_problems(&path, rec.backing, Some(rec.size))
    }

    /// ControllerGetVolumeHealth.
    pub fn volume_health(&self, volume_id: &str) -> Result<VolumeHealth> {
        let rec = self.existing_volume(volume_id)?;
        Ok(VolumeHealth {
            volume_id: volume_id.to_string(),
            problems: self.problems(&rec),
        })
    }

    /// ControllerListVolumeHealth: the volumes with a problem, paginated as
    /// ListVolumes is (a token is the last volume id of the previous page).
    pub fn list_volume_health(
        &self,
        max_entries: i32,
        starting_token: &str,
    ) -> Result<VolumeHealthPage> {
        if max_entries < 0 {
            return Err(Error::invalid("max_entries must not be negative"));
        }
        let after = parse_token::<VolumeId>(starting_token, VolumeId::parse)?;
        // Checked outside the store's lock (visit calls back outside it): the
        // checks read files (and run btrfs for subvolumes), which must not hold
        // up writers.
        let mut volumes = Vec::new();
        let mut next_token = None;
        self.volumes.visit(after, |r| {
            if r.state != RecordState::Ready {
                return ControlFlow::Continue(());
            }
            let problems = self.problems(&r);
            if problems.is_empty() {
                return ControlFlow::Continue(());
            }
            if max_entries > 0 && volumes.len() == max_entries as usize {
                next_token = volumes.last().map(|v: &VolumeHealth| v.volume_id.clone());
                return ControlFlow::Break(());
            }
            volumes.push(VolumeHealth {
                volume_id: r.id.to_string(),
                problems,
            });
            ControlFlow::Continue(())
        });
        Ok(VolumeHealthPage {
            volumes,
            next_token,
        })
    }
}
