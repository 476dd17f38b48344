//! ControllerPublishVolume and ControllerUnpublishVolume: the publications are
//! only recorded (volumes are local to this node), so a deletion can refuse a
//! volume still in use.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::ids::VolumeId;
use crate::model::*;
use crate::Controller;

impl Controller {
    /// ControllerPublishVolume: records the publication; returns the publish context.
    pub fn publish_volume(
        &self,
        volume_id: &str,
        node_id: &str,
        capability: Option<&Capability>,
        read_only: bool,
    ) -> Result<BTreeMap<String, String>> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        if node_id.is_empty() {
            return Err(Error::invalid("node_id is required"));
        }
        let cap = capability.ok_or_else(|| Error::invalid("volume_capability is required"))?;
        if let Some(why) = cap.unsupported_reason() {
            return Err(Error::invalid(why));
        }
        let id = VolumeId::parse_existing(volume_id)?;
        let _guard = self.locks.try_lock([format!("volume:{id}")])?;
        let mut rec = self.existing_volume(volume_id)?;
        // A single-node volume published elsewhere is the wrong state, whichever node
        // is asked for now; checked first so that the answer says so.
        if let Some(other) = rec.published.keys().find(|n| *n != node_id) {
            return Err(Error::precondition(format!(
                "volume {id} is published to node {other} already"
            )));
        }
        if node_id != self.cfg.node_id {
            return Err(Error::not_found(format!(
                "node {node_id:?} is not known to this driver; volumes here are local to \
                 node {}",
                self.cfg.node_id
            )));
        }
        if cap.is_block() && rec.backing != Backing::Image {
            return Err(Error::invalid(
                "block access is not possible on a kind=dir volume",
            ));
        }
        match rec.published.get(node_id) {
            Some(p) if p.read_only != read_only || p.block != cap.is_block() => {
                return Err(Error::AlreadyExists(format!(
                    "volume {id} is published to {node_id} already, with readonly={} and {} \
                     access",
                    p.read_only,
                    if p.block { "block" } else { "mount" }
                )))
            }
            Some(_) => {}
            None => {
                let max = self.cfg.max_volumes_per_node;
                if max > 0 {
                    let (on_node, _) = self
                        .volumes
                        .page(None, 0, |v| v.published.contains_key(node_id));
                    if on_node.len() as u64 >= max {
                        return Err(Error::ResourceExhausted(format!(
                            "node {node_id} has {max} volumes published, its limit"
                        )));
                    }
                }
                rec.published.insert(
                    node_id.to_string(),
                    Publication {
                        read_only,
                        block: cap.is_block(),
                    },
                );
                self.volumes.put(&rec)?;
            }
        }
        Ok(BTreeMap::from([
            ("pool".to_string(), rec.pool.clone()),
            ("readonly".to_string(), read_only.to_string()),
        ]))
    }

    pub fn unpublish_volume(&self, volume_id: &str, node_id: &str) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let _guard = self.locks.try_lock([format!("volume:{id}")])?;
        let Some(mut rec) = self.volumes.get(id) else {
            return Ok(());
        };
        let before = rec.published.len();
        if node_id.is_empty() {
            rec.published.clear();
        } else {
            rec.published.remove(node_id);
        }
        if rec.published.len() != before {
            self.volumes.put(&rec)?;
        }
        Ok(())
    }
}
