//! ControllerPublishVolume, ControllerUnpublishVolume and ControllerGetNodeInfo:
//! the publications are only recorded (volumes are local to this node), so a
//! deletion can refuse a volume still in use. What the node holds is the
//! publications and the volumes it has staged: the node's volume limit counts
//! both, and an unpublish whose reason says the node let go is refused while the
//! node still holds the volume.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};
use crate::ids::VolumeId;
use crate::locks::LockKey;
use crate::model::*;
use crate::Controller;

/// Why the CO unpublishes (CSI's `ControllerUnpublishVolumeRequest.Reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnpublishReason {
    /// Not said: an older CO, or a reason newer than this driver.
    Unsaid,
    /// The node unpublished and unstaged the volume.
    NodeCleanedUp,
    /// The CO stopped waiting for the node, which may still use the volume.
    NodeTimedOut,
    /// The node is said to be removed, powered down or rebooting.
    NodeOutOfService,
}

impl UnpublishReason {
    /// Whether the CO asserts that the node no longer holds the volume.
    fn node_let_go(self) -> bool {
        matches!(
            self,
            UnpublishReason::NodeCleanedUp | UnpublishReason::NodeOutOfService
        )
    }
}

/// A node as the controller knows it (ControllerGetNodeInfo).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// 0: no limit.
    pub max_volumes: u64,
    /// Published to the node or staged there, in id order.
    pub volumes: Vec<VolumeId>,
}

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
        if let Some(why) = self.cfg.unsupported(cap) {
            return Err(Error::invalid(why));
        }
        let id = VolumeId::parse_existing(volume_id)?;
        let _guard = self.locks.try_lock([LockKey::Volume(id)])?;
        let mut rec = self.existing_volume(volume_id)?;
        // A single-node volume published elsewhere is the wrong state, whichever node
        // is asked for now; checked first so that the answer says so.
        if let Some(other) = rec.published.keys().find(|n| *n != node_id) {
            return Err(Error::precondition(format!(
                "volume {id} is published to node {other} already"
            )));
        }
        self.known_node(node_id)?;
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
                    let mut on_node = self.held_on(node_id);
                    on_node.remove(&id);
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

    /// ControllerUnpublishVolume: forgets the publication. A reason that says
    /// the node let go of the volume is refused (FAILED_PRECONDITION, the record
    /// kept) while this driver's node still has it staged: the CO's view is
    /// wrong or early, and its retry succeeds once the node unstages. A node
    /// that timed out may still hold the volume: the publication goes, and the
    /// volume keeps counting against the node until it is unstaged.
    pub fn unpublish_volume(
        &self,
        volume_id: &str,
        node_id: &str,
        reason: UnpublishReason,
    ) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        if node_id.is_empty() && reason != UnpublishReason::Unsaid {
            return Err(Error::invalid(
                "reason is only for an unpublish from one node (node_id is empty)",
            ));
        }
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let _guard = self.locks.try_lock([LockKey::Volume(id)])?;
        let Some(mut rec) = self.volumes.get(id) else {
            return Ok(());
        };
        // The node's lock, held to the end: no stage or unstage changes the
        // staged mark meanwhile.
        let node_lock = if node_id == self.cfg.node_id {
            Some(self.state.lock_volume(id)?)
        } else {
            None
        };
        if let Some(staged) = node_lock.as_ref().map(|l| l.is_staged()) {
            if staged && reason.node_let_go() {
                return Err(Error::precondition(format!(
                    "volume {id} is still staged on node {node_id}, which answers: \
                     the unpublish's reason ({reason:?}) says the node let go of it"
                )));
            }
            if staged {
                tracing::warn!(volume.id = %id, node = node_id, ?reason,
                    "unpublished while the node still has the volume staged");
            }
        }
        let before = rec.published.len();
        if node_id.is_empty() {
            rec.published.clear();
        } else {
            rec.published.remove(node_id);
        }
        if rec.published.len() != before {
            self.volumes.put(&rec)?;
        }
        tracing::info!(volume.id = %id, node = node_id, ?reason,
            was_published = rec.published.len() != before, "unpublished");
        drop(node_lock);
        Ok(())
    }

    /// ControllerGetNodeInfo: the node's volume limit and the volumes it holds.
    pub fn node_info(&self, node_id: &str) -> Result<NodeInfo> {
        if node_id.is_empty() {
            return Err(Error::invalid("node_id is required"));
        }
        self.known_node(node_id)?;
        Ok(NodeInfo {
            max_volumes: self.cfg.max_volumes_per_node,
            volumes: self.held_on(node_id).into_iter().collect(),
        })
    }

    /// NOT_FOUND unless `node_id` is this driver's node, the only one its
    /// volumes can be used on.
    fn known_node(&self, node_id: &str) -> Result<()> {
        if node_id != self.cfg.node_id {
            return Err(Error::not_found(format!(
                "node {node_id:?} is not known to this driver; volumes here are local to \
                 node {}",
                self.cfg.node_id
            )));
        }
        Ok(())
    }

    /// The volumes published to `node_id` or staged there (this driver's node).
    fn held_on(&self, node_id: &str) -> BTreeSet<VolumeId> {
        let (published, _) = self
            .volumes
            .page(None, 0, |v| v.published.contains_key(node_id));
        let mut held: BTreeSet<VolumeId> = published.iter().map(|v| v.id).collect();
        if node_id == self.cfg.node_id {
            held.extend(self.state.staged_ids());
        }
        held
    }
}
