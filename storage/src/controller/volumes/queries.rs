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

    /// GetCapacity: the free space of the pool the parameters name, for this
    /// node's topology (0 for another node's), less what an unsupported
    /// capability rules out.
    ///
    /// Parameters CreateVolume refuses whatever the space (an unknown pool,
    /// kind or key) get [`Capacity::UNLIMITED`], not an error or 0: Kubernetes'
    /// scheduler keeps a claim away from every node whose capacity for its
    /// class is missing or too small, so either would leave the claim Pending
    /// with "did not have enough free storage" and CreateVolume never called.
    /// With a figure that does not stop it, the claim reaches CreateVolume,
    /// whose INVALID_ARGUMENT naming the cause the external-provisioner shows
    /// on the claim (ProvisioningFailed).
    pub fn get_capacity(
        &self,
        parameters: &BTreeMap<String, String>,
        capabilities: &[Capability],
        topology: Option<&BTreeMap<String, String>>,
    ) -> Result<Capacity> {
        if topology.is_some_and(|t| *t != self.topology()) {
            return Ok(Capacity::NONE);
        }
        let checked = parse_parameters(parameters)
            .and_then(|params| self.pool(&params.pool).map(|pool| (params, pool)));
        let (params, pool) = match checked {
            Ok(found) => found,
            Err(Error::InvalidArgument(why)) => {
                tracing::warn!(
                    %why,
                    "GetCapacity with parameters CreateVolume refuses: answered as unlimited, \
                     so that a claim of them reaches CreateVolume and shows why"
                );
                return Ok(Capacity::UNLIMITED);
            }
            Err(e) => return Err(e),
        };
        let fs = capabilities.iter().find_map(|c| c.fs_type());
        let minimum = if params.kind == VolumeKind::Dir {
            0
        } else {
            minimum_size(fs)
        };
        let unsupported = capabilities
            .iter()
            .any(|c| self.cfg.unsupported(c).is_some())
            || (params.kind == VolumeKind::Dir && capabilities.iter().any(Capability::is_block));
        if unsupported {
            return Ok(Capacity {
                minimum_volume_size: minimum,
                ..Capacity::NONE
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
            if let Some(why) = self.cfg.unsupported(c) {
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
