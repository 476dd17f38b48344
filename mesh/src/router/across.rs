//! Group snapshots whose volumes are on several nodes.
//!
//! Each node takes its part (a group snapshot of its own volumes) under the
//! group's name; parts of one name share one group id (the id is made from
//! the name), which is the whole group's handle, bare as every group's: it
//! names no node, and its members say where its parts are. For the parts to be of one instant,
//! the controller holds one `TakeGroupPart` call per node: every node
//! freezes its members and says so, and only once all have does any copy
//! (go). A failure before go lifts every freeze and undoes every part; a
//! failure after it deletes the parts that were made. A part left by an
//! earlier call (the controller died before answering) is of another instant:
//! a retry that finds some parts made and others not deletes the old ones and
//! takes the group again.

use std::collections::BTreeMap;

use csi_proto::csi::{self, group_controller_client::GroupControllerClient};
use csi_proto::mesh::{self, agent_client::AgentClient};
use prost::Message;
use tokio::sync::mpsc;
use tonic::Status;

use super::{from_node, onward, qualify_snapshot, Kind, Router, MAX_MESSAGE_BYTES};

/// The longest a group snapshot across nodes takes when its caller sets no
/// deadline.
const UNBOUNDED_CALL: std::time::Duration = std::time::Duration::from_secs(300);

/// The objects of `handles` by the node that holds them (their ids there, in
/// the order given).
pub(super) async fn by_node(
    r: &Router,
    kind: Kind,
    handles: &[String],
) -> Result<BTreeMap<String, Vec<String>>, Status> {
    let mut parts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for h in handles {
        let at = r.place(kind, h).await?;
        parts.entry(at.node).or_default().push(at.id);
    }
    Ok(parts)
}

/// One node's part while it is being taken.
struct Part {
    node: String,
    /// The controller's side of the call: kept open until the part answers
    /// (closing it undoes the part).
    steps: mpsc::Sender<mesh::GroupPartStep>,
    events: tonic::Streaming<mesh::GroupPartEvent>,
}

impl Part {
    async fn open(
        r: &Router,
        deadline: Option<std::time::Duration>,
        node: &str,
        mut req: csi::CreateVolumeGroupSnapshotRequest,
        ids: Vec<String>,
    ) -> Result<Part, Status> {
        req.source_volume_ids = ids;
        let (steps, rx) = mpsc::channel(2);
        steps
            .send(mesh::GroupPartStep {
                create: req.encode_to_vec(),
                go: false,
            })
            .await
            .map_err(|_| Status::internal("the part's first step was not queued"))?;
        let mut c = AgentClient::new(r.agents.channel(node).await?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let events = c
            .take_group_part(onward(
                deadline,
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ))
            .await
            .map_err(|s| from_node(node, s))?
            .into_inner();
        Ok(Part {
            node: node.to_string(),
            steps,
            events,
        })
    }

    async fn next(&mut self) -> Result<mesh::GroupPartEvent, Status> {
        self.events
            .message()
            .await
            .map_err(|s| from_node(&self.node, s))?
            .ok_or_else(|| {
                Status::unavailable(format!(
                    "node {}: its part of the group snapshot ended without an answer",
                    self.node
                ))
            })
    }
}

/// A part's answer: the group it made.
fn made(node: &str, ev: &mesh::GroupPartEvent) -> Result<csi::VolumeGroupSnapshot, Status> {
    csi::VolumeGroupSnapshot::decode(ev.group.as_slice()).map_err(|e| {
        Status::internal(format!(
            "node {node} answered its part of the group snapshot unreadably: {e}"
        ))
    })
}

/// What one round of taking the parts found.
enum Round {
    Taken(Vec<(String, csi::VolumeGroupSnapshot)>),
    /// Some parts were made by an earlier call, others were not: the old ones
    /// (on these nodes) are of another instant.
    Stale(Vec<(String, String)>),
}

/// CreateVolumeGroupSnapshot of volumes on several nodes (`parts`: each
/// node's volume ids there).
pub(super) async fn create(
    r: &Router,
    one_at_a_time: &tokio::sync::Mutex<()>,
    deadline: Option<std::time::Duration>,
    req: csi::CreateVolumeGroupSnapshotRequest,
    parts: BTreeMap<String, Vec<String>>,
) -> Result<csi::VolumeGroupSnapshot, Status> {
    let limit = deadline.unwrap_or(UNBOUNDED_CALL);
    let work = async {
        // Two groups across nodes taken at once could each hold one node's
        // slot for copies while waiting for the other's freeze: one at a time.
        let _one = one_at_a_time.lock().await;
        for _ in 0..2 {
            match round(r, deadline, &req, &parts).await? {
                Round::Taken(parts) => return combine(parts),
                Round::Stale(old) => {
                    for (node, id) in old {
                        tracing::info!(group = %id, node = %node,
                            "deleting a part of group snapshot {:?} left by an earlier call", req.name);
                        delete_part(r, deadline, &node, &id, Vec::new()).await?;
                    }
                }
            }
        }
        Err(Status::aborted(format!(
            "group snapshot {:?}: parts of an earlier call keep appearing; retry",
            req.name
        )))
    };
    tokio::time::timeout(limit, work).await.unwrap_or_else(|_| {
        Err(Status::deadline_exceeded(format!(
            "group snapshot {:?} was not taken within {limit:?}; every part is undone",
            req.name
        )))
    })
}

async fn round(
    r: &Router,
    deadline: Option<std::time::Duration>,
    req: &csi::CreateVolumeGroupSnapshotRequest,
    parts: &BTreeMap<String, Vec<String>>,
) -> Result<Round, Status> {
    let mut open = Vec::new();
    for (node, ids) in parts {
        open.push(Part::open(r, deadline, node, req.clone(), ids.clone()).await?);
    }
    // Every node freezes its members at once; each says so and waits.
    let mut frozen = Vec::new();
    let mut existed = Vec::new();
    for mut p in open {
        let ev = p.next().await?;
        if ev.frozen {
            frozen.push(p);
        } else {
            let g = made(&p.node, &ev)?;
            existed.push((p.node, g));
        }
    }
    if frozen.is_empty() {
        return Ok(Round::Taken(existed));
    }
    if !existed.is_empty() {
        // Dropping the frozen parts' calls thaws and undoes them.
        drop(frozen);
        return Ok(Round::Stale(
            existed
                .into_iter()
                .map(|(n, g)| (n, g.group_snapshot_id))
                .collect(),
        ));
    }
    tracing::info!(name = %req.name, nodes = frozen.len(), "every part of a group snapshot is frozen: go");
    for p in &frozen {
        // A part whose call has ended says why at its next event.
        let _ = p
            .steps
            .send(mesh::GroupPartStep {
                create: Vec::new(),
                go: true,
            })
            .await;
    }
    let mut taken = Vec::new();
    let mut failed = None;
    for mut p in frozen {
        match p.next().await.and_then(|ev| made(&p.node, &ev)) {
            Ok(g) => taken.push((p.node, g)),
            Err(s) => failed = failed.or(Some(s)),
        }
    }
    if let Some(s) = failed {
        for (node, g) in taken {
            if let Err(e) = delete_part(r, deadline, &node, &g.group_snapshot_id, Vec::new()).await
            {
                tracing::warn!(node = %node, error = %e.message(),
                    "a part of a failed group snapshot is left until the group is deleted or taken again");
            }
        }
        return Err(s);
    }
    Ok(Round::Taken(taken))
}

/// The parts as one group: the members qualified with their nodes, each
/// naming the whole group.
pub(super) fn combine(
    parts: Vec<(String, csi::VolumeGroupSnapshot)>,
) -> Result<csi::VolumeGroupSnapshot, Status> {
    let id = match parts.first() {
        Some((_, g)) => g.group_snapshot_id.clone(),
        None => return Err(Status::not_found("the group snapshot has no part")),
    };
    let mut whole = csi::VolumeGroupSnapshot {
        group_snapshot_id: id.clone(),
        snapshots: Vec::new(),
        creation_time: None,
        ready_to_use: true,
    };
    for (node, g) in parts {
        if g.group_snapshot_id != id {
            return Err(Status::internal(format!(
                "node {node} holds part {:?} of group snapshot {id:?}",
                g.group_snapshot_id
            )));
        }
        whole.ready_to_use &= g.ready_to_use;
        let later = match (&whole.creation_time, &g.creation_time) {
            (Some(a), Some(b)) => (b.seconds, b.nanos) > (a.seconds, a.nanos),
            (None, _) => true,
            _ => false,
        };
        if later {
            whole.creation_time = g.creation_time;
        }
        for mut s in g.snapshots {
            qualify_snapshot(&mut s, &node);
            s.group_snapshot_id = id.clone();
            whole.snapshots.push(s);
        }
    }
    Ok(whole)
}

async fn group_client(
    r: &Router,
    node: &str,
) -> Result<GroupControllerClient<tonic::transport::Channel>, Status> {
    Ok(GroupControllerClient::new(r.agents.channel(node).await?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES))
}

async fn delete_part(
    r: &Router,
    deadline: Option<std::time::Duration>,
    node: &str,
    id: &str,
    snapshot_ids: Vec<String>,
) -> Result<(), Status> {
    group_client(r, node)
        .await?
        .delete_volume_group_snapshot(onward(
            deadline,
            csi::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: id.to_string(),
                snapshot_ids,
                secrets: Default::default(),
            },
        ))
        .await
        .map_err(|s| from_node(node, s))?;
    Ok(())
}

/// The nodes to ask about a group of bare handle: its members' nodes (with
/// their ids there), or, when no member is named, every node (asked for the
/// whole part it holds).
async fn where_parts(
    r: &Router,
    members: &[String],
) -> Result<(BTreeMap<String, Vec<String>>, bool), Status> {
    if members.is_empty() {
        let every = r.every_node().await.into_iter().map(|n| (n, Vec::new()));
        return Ok((every.collect(), true));
    }
    Ok((by_node(r, Kind::Snapshot, members).await?, false))
}

/// GetVolumeGroupSnapshot of a group whose handle names no node (on one
/// node or several).
pub(super) async fn get(
    r: &Router,
    deadline: Option<std::time::Duration>,
    id: &str,
    members: &[String],
) -> Result<csi::VolumeGroupSnapshot, Status> {
    let (nodes, every) = where_parts(r, members).await?;
    let mut found = Vec::new();
    let mut unreachable = Vec::new();
    for (node, ids) in nodes {
        let asked = match group_client(r, &node).await {
            Ok(mut c) => c
                .get_volume_group_snapshot(onward(
                    deadline,
                    csi::GetVolumeGroupSnapshotRequest {
                        group_snapshot_id: id.to_string(),
                        snapshot_ids: ids,
                        secrets: Default::default(),
                    },
                ))
                .await
                .map_err(|s| from_node(&node, s)),
            Err(e) => Err(e),
        };
        match asked {
            Ok(g) => {
                if let Some(g) = g.into_inner().group_snapshot {
                    found.push((node, g));
                }
            }
            Err(s) if every && s.code() == tonic::Code::NotFound => {}
            Err(s) if every => unreachable.push(format!("{node} ({})", s.message())),
            Err(s) => return Err(s),
        }
    }
    if !unreachable.is_empty() {
        return Err(Status::unavailable(format!(
            "group snapshot {id:?} may have parts on nodes that did not answer: {}",
            unreachable.join(", ")
        )));
    }
    if found.is_empty() {
        return Err(Status::not_found(format!(
            "group snapshot {id:?} does not exist on any node"
        )));
    }
    combine(found)
}

/// DeleteVolumeGroupSnapshot of a group whose handle names no node: every
/// part, wherever it is.
pub(super) async fn delete(
    r: &Router,
    deadline: Option<std::time::Duration>,
    id: &str,
    members: &[String],
) -> Result<(), Status> {
    let (nodes, _) = match where_parts(r, members).await {
        Err(s) if s.code() == tonic::Code::NotFound => return Ok(()),
        other => other?,
    };
    let mut unreachable = Vec::new();
    for (node, ids) in nodes {
        match delete_part(r, deadline, &node, id, ids).await {
            Ok(()) => {}
            Err(s) if s.code() == tonic::Code::Unavailable => {
                unreachable.push(format!("{node} ({})", s.message()))
            }
            Err(s) => return Err(s),
        }
    }
    if !unreachable.is_empty() {
        return Err(Status::unavailable(format!(
            "group snapshot {id:?}: its parts on nodes that did not answer are not deleted yet: {}",
            unreachable.join(", ")
        )));
    }
    Ok(())
}
