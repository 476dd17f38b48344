//! The Controller service of the router: each call to the node that holds its
//! volume or snapshot, a new volume to the node its topology names.

use std::sync::Arc;

use csi_proto::csi::{self, controller_server::Controller, volume_content_source};
use tonic::{Request, Response, Status};

use super::{
    deadline, onward, qualify_snapshot, qualify_volume, topology_node, Kind, Placed, Router,
};

pub struct RouterController {
    r: Arc<Router>,
}

impl RouterController {
    pub fn new(r: Arc<Router>) -> Self {
        RouterController { r }
    }
}

/// The node a new volume goes to, and where its content comes from.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub node: String,
    pub source: Option<Placed>,
}

/// Chooses the node of a new volume from its accessibility requirements: a
/// volume made from another stays with its source when the requirements allow
/// it (no data moves); otherwise the first preferred node that is also allowed,
/// then the first allowed one, and its data moves there. None when the request
/// names no node (the caller then picks).
pub(crate) fn choose_node(
    req: Option<&csi::TopologyRequirement>,
    source_node: Option<&str>,
) -> Option<String> {
    let nodes = |ts: &[csi::Topology]| -> Vec<String> {
        ts.iter()
            .filter_map(topology_node)
            .map(str::to_string)
            .collect()
    };
    let (requisite, preferred) = req
        .map(|r| (nodes(&r.requisite), nodes(&r.preferred)))
        .unwrap_or_default();
    let allowed = |n: &str| requisite.is_empty() || requisite.iter().any(|r| r == n);
    if let Some(s) = source_node {
        if allowed(s) {
            return Some(s.to_string());
        }
    }
    preferred
        .iter()
        .find(|p| allowed(p))
        .or(requisite.first())
        .cloned()
}

impl RouterController {
    /// The source of a new volume, placed.
    async fn source(
        &self,
        src: Option<&csi::VolumeContentSource>,
    ) -> Result<Option<Placed>, Status> {
        match src.and_then(|s| s.r#type.as_ref()) {
            None => Ok(None),
            Some(volume_content_source::Type::Snapshot(s)) => {
                Ok(Some(self.r.place(Kind::Snapshot, &s.snapshot_id).await?))
            }
            Some(volume_content_source::Type::Volume(v)) => {
                Ok(Some(self.r.place(Kind::Volume, &v.volume_id).await?))
            }
        }
    }

    /// Where a new volume goes (see [`choose_node`]); with no node named, the
    /// node whose pools have the most room for it.
    async fn placement(&self, req: &csi::CreateVolumeRequest) -> Result<Placement, Status> {
        let source = match self.source(req.volume_content_source.as_ref()).await {
            Err(s) if s.code() == tonic::Code::NotFound => {
                // The spec's code for a source that does not exist.
                return Err(Status::not_found(s.message().to_string()));
            }
            other => other?,
        };
        let chosen = choose_node(
            req.accessibility_requirements.as_ref(),
            source.as_ref().map(|s| s.node.as_str()),
        );
        let node = match chosen {
            Some(n) => n,
            None => self.roomiest(req).await?,
        };
        Ok(Placement { node, source })
    }

    /// The node with the most room for a volume of these parameters.
    async fn roomiest(&self, req: &csi::CreateVolumeRequest) -> Result<String, Status> {
        let nodes = self.r.agents.nodes();
        if nodes.len() == 1 {
            return Ok(nodes[0].clone());
        }
        let mut best: Option<(i64, String)> = None;
        let mut why = Vec::new();
        for node in nodes {
            let ask = csi::GetCapacityRequest {
                volume_capabilities: req.volume_capabilities.clone(),
                parameters: req.parameters.clone(),
                accessible_topology: None,
            };
            match self
                .r
                .on(&node, |mut c| async move { c.get_capacity(ask).await })
                .await
            {
                Ok(c) if best.as_ref().is_none_or(|(b, _)| c.available_capacity > *b) => {
                    best = Some((c.available_capacity, node))
                }
                Ok(_) => {}
                Err(e) => why.push(format!("{node}: {}", e.message())),
            }
        }
        best.map(|(_, n)| n).ok_or_else(|| {
            Status::unavailable(format!(
                "no node agent could take the volume ({})",
                if why.is_empty() {
                    "none is known".to_string()
                } else {
                    why.join("; ")
                }
            ))
        })
    }
}

/// The answer of a delete or unpublish: an object no node holds is done.
fn gone_is_done<T: Default>(done: Result<(String, T), Status>) -> Result<Response<T>, Status> {
    match done {
        Ok((_, t)) => Ok(Response::new(t)),
        Err(s) if s.code() == tonic::Code::NotFound => Ok(Response::new(T::default())),
        Err(s) => Err(s),
    }
}

fn bare_source(src: &mut Option<csi::VolumeContentSource>, id: &str) {
    if let Some(t) = src.as_mut().and_then(|s| s.r#type.as_mut()) {
        match t {
            volume_content_source::Type::Snapshot(s) => s.snapshot_id = id.to_string(),
            volume_content_source::Type::Volume(v) => v.volume_id = id.to_string(),
        }
    }
}

#[tonic::async_trait]
impl Controller for RouterController {
    async fn create_volume(
        &self,
        req: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let dl = deadline(&req);
        let mut r = req.into_inner();
        let at = self.placement(&r).await?;
        if let Some(s) = at.source.as_ref().filter(|s| s.node != at.node) {
            let v = self.r.create_from_another_node(dl, r, s, &at.node).await?;
            return Ok(Response::new(csi::CreateVolumeResponse { volume: Some(v) }));
        }
        if let Some(s) = &at.source {
            bare_source(&mut r.volume_content_source, &s.id);
        }
        let node = at.node;
        let mut resp = self
            .r
            .on(&node, |mut c| async move {
                c.create_volume(onward(dl, r)).await
            })
            .await?;
        if let Some(v) = resp.volume.as_mut() {
            qualify_volume(v, &node);
        }
        Ok(Response::new(resp))
    }

    async fn delete_volume(
        &self,
        req: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let done = self
            .r
            .routed(
                req,
                Kind::Volume,
                |r| &mut r.volume_id,
                |mut c, r| async move { c.delete_volume(r).await },
            )
            .await;
        // Nothing holds it: deleted already, as far as anyone can tell.
        gone_is_done(done)
    }

    async fn controller_publish_volume(
        &self,
        req: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        if !self.r.cfg.enable_attach {
            return Err(Status::unimplemented(
                "ControllerPublishVolume needs --enable-attach",
            ));
        }
        let dl = deadline(&req);
        let mut r = req.into_inner();
        let at = self.r.place(Kind::Volume, &r.volume_id).await?;
        if !r.node_id.is_empty() && r.node_id != at.node {
            return Err(Status::failed_precondition(format!(
                "volume {:?} lives on node {}: it cannot be published to node {}",
                r.volume_id, at.node, r.node_id
            )));
        }
        r.volume_id = at.id;
        let resp = self
            .r
            .on(&at.node, |mut c| async move {
                c.controller_publish_volume(onward(dl, r)).await
            })
            .await?;
        Ok(Response::new(resp))
    }

    async fn controller_unpublish_volume(
        &self,
        req: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        if !self.r.cfg.enable_attach {
            return Err(Status::unimplemented(
                "ControllerUnpublishVolume needs --enable-attach",
            ));
        }
        let done = self
            .r
            .routed(
                req,
                Kind::Volume,
                |r| &mut r.volume_id,
                |mut c, r| async move { c.controller_unpublish_volume(r).await },
            )
            .await;
        gone_is_done(done)
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let (_, resp) = self
            .r
            .routed(
                req,
                Kind::Volume,
                |r| &mut r.volume_id,
                |mut c, r| async move { c.validate_volume_capabilities(r).await },
            )
            .await?;
        Ok(Response::new(resp))
    }

    async fn list_volumes(
        &self,
        req: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        self.r.list_volumes(req).await.map(Response::new)
    }

    async fn get_capacity(
        &self,
        req: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        self.r.get_capacity(req).await.map(Response::new)
    }

    async fn controller_get_capabilities(
        &self,
        _req: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        let c = &self.r.cfg;
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: csi_glue::controller_capabilities(
                c.enable_attach,
                c.controller_expansion,
                c.modify_volume,
            ),
        }))
    }

    async fn create_snapshot(
        &self,
        req: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let (node, mut resp) = self
            .r
            .routed(
                req,
                Kind::Volume,
                |r| &mut r.source_volume_id,
                |mut c, r| async move { c.create_snapshot(r).await },
            )
            .await?;
        if let Some(s) = resp.snapshot.as_mut() {
            qualify_snapshot(s, &node);
        }
        Ok(Response::new(resp))
    }

    async fn delete_snapshot(
        &self,
        req: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let done = self
            .r
            .routed(
                req,
                Kind::Snapshot,
                |r| &mut r.snapshot_id,
                |mut c, r| async move { c.delete_snapshot(r).await },
            )
            .await;
        gone_is_done(done)
    }

    async fn list_snapshots(
        &self,
        req: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        self.r.list_snapshots(req).await.map(Response::new)
    }

    async fn get_snapshot(
        &self,
        req: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        let (node, mut resp) = self
            .r
            .routed(
                req,
                Kind::Snapshot,
                |r| &mut r.snapshot_id,
                |mut c, r| async move { c.get_snapshot(r).await },
            )
            .await?;
        if let Some(s) = resp.snapshot.as_mut() {
            qualify_snapshot(s, &node);
        }
        Ok(Response::new(resp))
    }

    async fn controller_expand_volume(
        &self,
        req: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let (_, resp) = self
            .r
            .routed(
                req,
                Kind::Volume,
                |r| &mut r.volume_id,
                |mut c, r| async move { c.controller_expand_volume(r).await },
            )
            .await?;
        Ok(Response::new(resp))
    }

    async fn controller_get_volume(
        &self,
        req: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        let (node, mut resp) = self
            .r
            .routed(
                req,
                Kind::Volume,
                |r| &mut r.volume_id,
                |mut c, r| async move { c.controller_get_volume(r).await },
            )
            .await?;
        if let Some(v) = resp.volume.as_mut() {
            qualify_volume(v, &node);
        }
        Ok(Response::new(resp))
    }

    async fn controller_modify_volume(
        &self,
        req: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        let (_, resp) = self
            .r
            .routed(
                req,
                Kind::Volume,
                |r| &mut r.volume_id,
                |mut c, r| async move { c.controller_modify_volume(r).await },
            )
            .await?;
        Ok(Response::new(resp))
    }

    async fn controller_list_volume_health(
        &self,
        req: Request<csi::ControllerListVolumeHealthRequest>,
    ) -> Result<Response<csi::ControllerListVolumeHealthResponse>, Status> {
        self.r.list_volume_health(req).await.map(Response::new)
    }

    async fn controller_get_volume_health(
        &self,
        req: Request<csi::ControllerGetVolumeHealthRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeHealthResponse>, Status> {
        let (node, mut resp) = self
            .r
            .routed(
                req,
                Kind::Volume,
                |r| &mut r.volume_id,
                |mut c, r| async move { c.controller_get_volume_health(r).await },
            )
            .await?;
        if let Some(h) = resp.volume_health.as_mut() {
            super::qualify(&mut h.volume_id, &node);
        }
        Ok(Response::new(resp))
    }

    /// Asked of the node the request names, which knows what it holds; its
    /// volumes are named as the router names them.
    async fn controller_get_node_info(
        &self,
        req: Request<csi::ControllerGetNodeInfoRequest>,
    ) -> Result<Response<csi::ControllerGetNodeInfoResponse>, Status> {
        if !self.r.cfg.enable_attach {
            return Err(Status::unimplemented(
                "ControllerGetNodeInfo needs --enable-attach",
            ));
        }
        let dl = deadline(&req);
        let r = req.into_inner();
        if r.node_id.is_empty() {
            return Err(Status::invalid_argument("node_id is empty"));
        }
        let node = r.node_id.clone();
        let mut resp = self
            .r
            .on(&node, |mut c| async move {
                c.controller_get_node_info(onward(dl, r)).await
            })
            .await?;
        for v in &mut resp.published_volumes {
            super::qualify(&mut v.volume_id, &node);
        }
        Ok(Response::new(resp))
    }
}
