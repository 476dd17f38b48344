//! The calls that span nodes: lists (volumes, snapshots, volume health), paged
//! across the nodes in name order, and the capacity of the whole cluster.
//!
//! A page token is `NODE|TOKEN`: the node where the next page starts and that
//! node's own token. A node that does not answer fails the list (UNAVAILABLE,
//! naming it) rather than giving a list that silently misses its objects.

use std::future::Future;
use std::pin::Pin;

use csi_proto::csi;
use tonic::{Request, Status};

use super::{
    deadline, onward, qualify, qualify_snapshot, qualify_volume, topology_node, Kind, Router,
};

pub(crate) type Page<E> = Pin<Box<dyn Future<Output = Result<(Vec<E>, String), Status>> + Send>>;

/// Where a list resumes: the index of its node among `nodes`, and the node's
/// own token.
fn resume(nodes: &[String], token: &str) -> Result<(usize, String), Status> {
    if token.is_empty() {
        return Ok((0, String::new()));
    }
    let bad = || {
        Status::aborted(format!(
            "starting_token {token:?} is not one this controller gave"
        ))
    };
    let (node, inner) = token.split_once('|').ok_or_else(bad)?;
    let at = nodes.iter().position(|n| n == node).ok_or_else(bad)?;
    Ok((at, inner.to_string()))
}

impl Router {
    /// Pages through every node's list: `page(node, max, token)` asks one node
    /// for at most `max` entries (0: all) from `token`.
    pub(crate) async fn across<E, F>(
        &self,
        max_entries: i32,
        token: &str,
        mut page: F,
    ) -> Result<(Vec<E>, String), Status>
    where
        F: FnMut(String, i32, String) -> Page<E>,
    {
        if max_entries < 0 {
            return Err(Status::invalid_argument("max_entries may not be negative"));
        }
        let max = max_entries as usize;
        let nodes = self.agents.nodes();
        let (start, mut inner) = resume(&nodes, token)?;
        let mut out = Vec::new();
        for (i, node) in nodes.iter().enumerate().skip(start) {
            loop {
                let want = if max == 0 {
                    0
                } else {
                    (max - out.len()) as i32
                };
                let (entries, next) = page(node.clone(), want, std::mem::take(&mut inner)).await?;
                out.extend(entries);
                if next.is_empty() {
                    break;
                }
                if max > 0 && out.len() >= max {
                    return Ok((out, format!("{node}|{next}")));
                }
                inner = next;
            }
            if max > 0 && out.len() >= max {
                let rest = nodes
                    .get(i + 1)
                    .map(|n| format!("{n}|"))
                    .unwrap_or_default();
                return Ok((out, rest));
            }
        }
        Ok((out, String::new()))
    }

    pub(crate) async fn list_volumes(
        self: &std::sync::Arc<Self>,
        req: Request<csi::ListVolumesRequest>,
    ) -> Result<csi::ListVolumesResponse, Status> {
        let dl = deadline(&req);
        let r = req.into_inner();
        let me = self.clone();
        let (entries, next_token) = self
            .across(r.max_entries, &r.starting_token, move |node, max, token| {
                let me = me.clone();
                Box::pin(async move {
                    let ask = csi::ListVolumesRequest {
                        max_entries: max,
                        starting_token: token,
                    };
                    let mut page = me
                        .on(&node, |mut c| async move {
                            c.list_volumes(onward(dl, ask)).await
                        })
                        .await?;
                    for e in &mut page.entries {
                        if let Some(v) = e.volume.as_mut() {
                            qualify_volume(v, &node);
                        }
                    }
                    Ok((page.entries, page.next_token))
                })
            })
            .await?;
        Ok(csi::ListVolumesResponse {
            entries,
            next_token,
        })
    }

    pub(crate) async fn list_snapshots(
        self: &std::sync::Arc<Self>,
        req: Request<csi::ListSnapshotsRequest>,
    ) -> Result<csi::ListSnapshotsResponse, Status> {
        let dl = deadline(&req);
        let mut r = req.into_inner();
        // A filter by snapshot or by source volume names one node.
        let one = if !r.snapshot_id.is_empty() {
            Some(self.place(Kind::Snapshot, &r.snapshot_id).await.map(|at| {
                r.snapshot_id = at.id;
                at.node
            }))
        } else if !r.source_volume_id.is_empty() {
            Some(
                self.place(Kind::Volume, &r.source_volume_id)
                    .await
                    .map(|at| {
                        r.source_volume_id = at.id;
                        at.node
                    }),
            )
        } else {
            None
        };
        let snapshots = |node: &str, mut page: csi::ListSnapshotsResponse| {
            for e in &mut page.entries {
                if let Some(s) = e.snapshot.as_mut() {
                    qualify_snapshot(s, node);
                }
            }
            page
        };
        match one {
            // Nothing holds it: an empty list, as the spec asks.
            Some(Err(s)) if s.code() == tonic::Code::NotFound => {
                Ok(csi::ListSnapshotsResponse::default())
            }
            Some(Err(s)) => Err(s),
            Some(Ok(node)) => {
                let page = self
                    .on(&node, |mut c| async move {
                        c.list_snapshots(onward(dl, r)).await
                    })
                    .await?;
                Ok(snapshots(&node, page))
            }
            None => {
                let me = self.clone();
                let secrets = r.secrets.clone();
                let (entries, next_token) = self
                    .across(r.max_entries, &r.starting_token, move |node, max, token| {
                        let me = me.clone();
                        let ask = csi::ListSnapshotsRequest {
                            max_entries: max,
                            starting_token: token,
                            secrets: secrets.clone(),
                            ..Default::default()
                        };
                        Box::pin(async move {
                            let page = me
                                .on(&node, |mut c| async move {
                                    c.list_snapshots(onward(dl, ask)).await
                                })
                                .await?;
                            let page = snapshots(&node, page);
                            Ok((page.entries, page.next_token))
                        })
                    })
                    .await?;
                Ok(csi::ListSnapshotsResponse {
                    entries,
                    next_token,
                })
            }
        }
    }

    pub(crate) async fn list_volume_health(
        self: &std::sync::Arc<Self>,
        req: Request<csi::ControllerListVolumeHealthRequest>,
    ) -> Result<csi::ControllerListVolumeHealthResponse, Status> {
        let dl = deadline(&req);
        let r = req.into_inner();
        let me = self.clone();
        let secrets = r.secrets.clone();
        let (entries, next_token) = self
            .across(r.max_entries, &r.starting_token, move |node, max, token| {
                let me = me.clone();
                let ask = csi::ControllerListVolumeHealthRequest {
                    max_entries: max,
                    starting_token: token,
                    secrets: secrets.clone(),
                };
                Box::pin(async move {
                    let mut page = me
                        .on(&node, |mut c| async move {
                            c.controller_list_volume_health(onward(dl, ask)).await
                        })
                        .await?;
                    for h in &mut page.entries {
                        qualify(&mut h.volume_id, &node);
                    }
                    Ok((page.entries, page.next_token))
                })
            })
            .await?;
        Ok(csi::ControllerListVolumeHealthResponse {
            entries,
            next_token,
        })
    }

    /// The capacity of the node a topology names; with none, of the whole
    /// cluster (the sum of what each node has, the largest volume any one
    /// can take). A node that does not answer counts for nothing.
    pub(crate) async fn get_capacity(
        &self,
        req: Request<csi::GetCapacityRequest>,
    ) -> Result<csi::GetCapacityResponse, Status> {
        let dl = deadline(&req);
        let r = req.into_inner();
        if let Some(node) = r.accessible_topology.as_ref().and_then(topology_node) {
            let node = node.to_string();
            if self
                .agents
                .resolve(&csi_glue::handle::NodeRef::Name(node.clone()))
                .await
                .is_err()
            {
                // A node without an agent has no room for this driver.
                return Ok(csi::GetCapacityResponse {
                    available_capacity: 0,
                    maximum_volume_size: Some(0),
                    minimum_volume_size: None,
                });
            }
            return self
                .on(
                    &node,
                    |mut c| async move { c.get_capacity(onward(dl, r)).await },
                )
                .await;
        }
        let mut total = csi::GetCapacityResponse::default();
        for node in self.agents.nodes() {
            let ask = r.clone();
            match self
                .on(&node, |mut c| async move {
                    c.get_capacity(onward(dl, ask)).await
                })
                .await
            {
                Ok(c) => {
                    total.available_capacity = total
                        .available_capacity
                        .saturating_add(c.available_capacity);
                    total.maximum_volume_size =
                        total.maximum_volume_size.max(c.maximum_volume_size);
                    total.minimum_volume_size =
                        match (total.minimum_volume_size, c.minimum_volume_size) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                }
                // A request a node finds malformed is so on every node: say so.
                // (A class naming an unknown pool is not refused here: nodes
                // answer it the largest capacity, so that CreateVolume runs and
                // names the mistake on the claim.)
                Err(s) if s.code() == tonic::Code::InvalidArgument => return Err(s),
                Err(s) => tracing::warn!(node, error = %s.message(), "no capacity from a node"),
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::resume;

    #[test]
    fn tokens_name_a_known_node() {
        let nodes = vec!["a".to_string(), "b".to_string()];
        assert_eq!(resume(&nodes, "").unwrap(), (0, String::new()));
        assert_eq!(resume(&nodes, "b|7").unwrap(), (1, "7".to_string()));
        assert_eq!(resume(&nodes, "b|").unwrap(), (1, String::new()));
        for bad in ["c|1", "nonsense", "|"] {
            assert_eq!(
                resume(&nodes, bad).unwrap_err().code(),
                tonic::Code::Aborted,
                "{bad}"
            );
        }
    }
}
