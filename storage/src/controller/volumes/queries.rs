//! The calls that only read: GetVolume, ListVolumes (paged by volume id),
//! GetCapacity and ValidateVolumeCapabilities.

use std::collections::BTreeMap;

use super::{parse_parameters, Capacity, VolumeKind, VolumePage};
use crate::data::parse_token;
use crate::error::{Error, Result};
use crate::ids::VolumeId;
use crate::model::*;
use crate::store::unpack;
use crate::Controller;

impl Controller {
    pub fn get_volume(&self, volume_id: &str) -> Result<VolumeRecord> {
        self.existing_volume(volume_id)
    }

    /// ListVolumes: up to `max_entries` ready volumes (all when 0) after the
    /// token's, each answered by `answer` from a view of its record that
    /// borrows from memory (under the store's read lock), so that a listing of
    /// many builds only what it answers.
    pub fn list_volumes<T>(
        &self,
        max_entries: i32,
        starting_token: &str,
        mut answer: impl FnMut(&VolumeView) -> T,
    ) -> Result<VolumePage<T>> {
        if max_entries < 0 {
            return Err(Error::invalid("max_entries must not be negative"));
        }
        let after = parse_token::<VolumeId>(starting_token, VolumeId::parse)?;
        let (answers, more) = self
            .volumes
            .page_packed(after, max_entries as usize, |packed| {
                let v = unpack::<VolumeView>(packed)?;
                (v.state == RecordState::Ready).then(|| (v.id, answer(&v)))
            });
        let next_token = if more {
            answers.last().map(|(id, _)| id.to_string())
        } else {
            None
        };
        Ok(VolumePage {
            volumes: answers.into_iter().map(|(_, a)| a).collect(),
            next_token,
        })
    }

    pub fn get_capacity(
        &self,
        parameters: &BTreeMap<String, String>,
        capabilities: &[Capability],
        topology: Option<&BTreeMap<String, String>>,
    ) -> Result<Capacity> {
        let params = parse_parameters(parameters)?;
        let pool = self.pool(&params.pool)?;
        let fs = capabilities.iter().find_map(|c| c.fs_type());
        let minimum = if params.kind == VolumeKind::Dir {
            0
        } else {
            minimum_size(fs)
        };
        let unsupported = capabilities
            .iter()
            .any(|c| c.unsupported_reason().is_some())
            || (params.kind == VolumeKind::Dir && capabilities.iter().any(Capability::is_block));
        let elsewhere = topology.is_some_and(|t| *t != self.topology());
        if unsupported || elsewhere {
            return Ok(Capacity {
                available: 0,
                maximum_volume_size: 0,
                minimum_volume_size: minimum,
            });
        }
        let (available, _) = pool.space()?;
        Ok(Capacity {
            available,
            maximum_volume_size: available,
            minimum_volume_size: minimum,
        })
    }

    /// ValidateVolumeCapabilities: None when confirmed, else the reason.
    pub fn validate_capabilities(
        &self,
        volume_id: &str,
        caps: &[Capability],
        parameters: &BTreeMap<String, String>,
        mutable: &BTreeMap<String, String>,
    ) -> Result<Option<String>> {
        let rec = self.existing_volume(volume_id)?;
        if caps.is_empty() {
            return Err(Error::invalid("volume_capabilities are required"));
        }
        for c in caps {
            if let Some(why) = c.unsupported_reason() {
                return Ok(Some(why));
            }
            if c.is_block() && rec.backing != Backing::Image {
                return Ok(Some(
                    "block access is not possible on a kind=dir volume".into(),
                ));
            }
            if let (Some(want), Some(have)) = (c.fs_type(), &rec.fs_type) {
                if want != have {
                    return Ok(Some(format!("the volume holds {have}, not {want}")));
                }
            }
        }
        if !parameters.is_empty() && *parameters != rec.parameters {
            return Ok(Some("parameters differ from the volume's".into()));
        }
        if !mutable.is_empty() && *mutable != rec.mutable_parameters {
            return Ok(Some("mutable_parameters differ from the volume's".into()));
        }
        Ok(None)
    }
}
