//! ControllerGetVolumeHealth and ControllerListVolumeHealth: what the
//! controller can see of a volume, its data in its pool.

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
        // Checked outside the store's lock: the checks read files (and run btrfs
        // for subvolumes), which must not hold up writers.
        // The records are taken a chunk at a time, so that no copy of them all is
        // made.
        const CHUNK: usize = 512;
        let mut volumes = Vec::new();
        let mut next_token = None;
        let mut cursor = after;
        'pages: loop {
            let (chunk, more) = self
                .volumes
                .page(cursor, CHUNK, |r| r.state == RecordState::Ready);
            cursor = chunk.last().map(|r| r.id);
            for r in chunk {
                let problems = self.problems(&r);
                if problems.is_empty() {
                    continue;
                }
                if max_entries > 0 && volumes.len() == max_entries as usize {
                    next_token = volumes.last().map(|v: &VolumeHealth| v.volume_id.clone());
                    break 'pages;
                }
                volumes.push(VolumeHealth {
                    volume_id: r.id.to_string(),
                    problems,
                });
            }
            if !more {
                break;
            }
        }
        Ok(VolumeHealthPage {
            volumes,
            next_token,
        })
    }
}
