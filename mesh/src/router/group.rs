//! The router's GroupController (a group snapshot of one node's volumes is
//! taken there; one across nodes, in parts, see `across`; either way its
//! handle is its bare id, found through its members), SnapshotMetadata
//! (streamed from the node that holds the snapshots) and Identity services.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;

use csi_proto::csi::{
    self, group_controller_client::GroupControllerClient, group_controller_server::GroupController,
    identity_server::Identity, plugin_capability, snapshot_metadata_client::SnapshotMetadataClient,
    snapshot_metadata_server::SnapshotMetadata, PluginCapability,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::across;
use super::{deadline, from_node, onward, qualify_group, Kind, Router, MAX_MESSAGE_BYTES};

pub struct RouterGroupController {
    r: Arc<Router>,
    /// Held while a group across nodes is taken.
    across: tokio::sync::Mutex<()>,
}

impl RouterGroupController {
    pub fn new(r: Arc<Router>) -> Self {
        RouterGroupController {
            r,
            across: tokio::sync::Mutex::new(()),
        }
    }

    async fn client(
        &self,
        node: &str,
    ) -> Result<GroupControllerClient<tonic::transport::Channel>, Status> {
        Ok(
            GroupControllerClient::new(self.r.agents.channel(node).await?)
                .max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
    }

    /// The one node holding every object of `handles`, and their ids there
    /// (None for no handle); objects on several nodes are refused, `why`
    /// saying what must be on one.
    async fn one_node(
        &self,
        kind: Kind,
        handles: &[String],
        why: &str,
    ) -> Result<Option<(String, Vec<String>)>, Status> {
        let mut node: Option<String> = None;
        let mut ids = Vec::new();
        for h in handles {
            let at = self.r.place(kind, h).await?;
            match &node {
                Some(n) if *n != at.node => {
                    return Err(Status::invalid_argument(format!(
                        "{why}: {h:?} is on {}, the others on {n}",
                        at.node
                    )))
                }
                _ => node = Some(at.node),
            }
            ids.push(at.id);
        }
        Ok(node.map(|n| (n, ids)))
    }

    /// The node of a group snapshot whose handle names it, its id and its
    /// members' ids there written into the request's fields.
    async fn group(
        &self,
        handle: &mut String,
        members: &mut Vec<String>,
    ) -> Result<String, Status> {
        if handle.is_empty() {
            return Err(Status::invalid_argument("group_snapshot_id is required"));
        }
        let h = csi_glue::handle::parse(handle);
        let Some(named) = &h.node else {
            return Err(Status::internal(format!(
                "group snapshot {handle:?} names no node"
            )));
        };
        let node = self.r.agents.resolve(named).await?;
        let why = "the snapshots of a group live on one node";
        if let Some((at, ids)) = self.one_node(Kind::Snapshot, members, why).await? {
            if at != node {
                return Err(Status::invalid_argument(format!(
                    "group snapshot {handle:?} is on {node}, its snapshots on {at}"
                )));
            }
            *members = ids;
        }
        *handle = h.id;
        Ok(node)
    }
}

#[tonic::async_trait]
impl GroupController for RouterGroupController {
    async fn group_controller_get_capabilities(
        &self,
        _req: Request<csi::GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::GroupControllerGetCapabilitiesResponse>, Status> {
        use csi::group_controller_service_capability::{rpc::Type, Rpc, Type as Kind};
        Ok(Response::new(csi::GroupControllerGetCapabilitiesResponse {
            capabilities: vec![csi::GroupControllerServiceCapability {
                r#type: Some(Kind::Rpc(Rpc {
                    r#type: Type::CreateDeleteGetVolumeGroupSnapshot as i32,
                })),
            }],
        }))
    }

    async fn create_volume_group_snapshot(
        &self,
        req: Request<csi::CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::CreateVolumeGroupSnapshotResponse>, Status> {
        let dl = deadline(&req);
        let mut r = req.into_inner();
        let mut parts = across::by_node(&self.r, Kind::Volume, &r.source_volume_ids).await?;
        if parts.len() > 1 {
            let g = across::create(&self.r, &self.across, dl, r, parts).await?;
            return Ok(Response::new(csi::CreateVolumeGroupSnapshotResponse {
                group_snapshot: Some(g),
            }));
        }
        let (node, ids) = parts
            .pop_first()
            .ok_or_else(|| Status::invalid_argument("source_volume_ids is required"))?;
        r.source_volume_ids = ids;
        let mut resp = self
            .client(&node)
            .await?
            .create_volume_group_snapshot(onward(dl, r))
            .await
            .map_err(|s| from_node(&node, s))?
            .into_inner();
        if let Some(g) = resp.group_snapshot.as_mut() {
            qualify_group(g, &node);
        }
        Ok(Response::new(resp))
    }

    async fn delete_volume_group_snapshot(
        &self,
        req: Request<csi::DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::DeleteVolumeGroupSnapshotResponse>, Status> {
        let dl = deadline(&req);
        let mut r = req.into_inner();
        if bare(&r.group_snapshot_id) {
            across::delete(&self.r, dl, &r.group_snapshot_id, &r.snapshot_ids).await?;
            return Ok(Response::new(csi::DeleteVolumeGroupSnapshotResponse {}));
        }
        let node = match self
            .group(&mut r.group_snapshot_id, &mut r.snapshot_ids)
            .await
        {
            Ok(node) => node,
            Err(s) if s.code() == tonic::Code::NotFound => {
                return Ok(Response::new(csi::DeleteVolumeGroupSnapshotResponse {}))
            }
            Err(s) => return Err(s),
        };
        let resp = self
            .client(&node)
            .await?
            .delete_volume_group_snapshot(onward(dl, r))
            .await
            .map_err(|s| from_node(&node, s))?;
        Ok(resp)
    }

    async fn get_volume_group_snapshot(
        &self,
        req: Request<csi::GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::GetVolumeGroupSnapshotResponse>, Status> {
        let dl = deadline(&req);
        let mut r = req.into_inner();
        if bare(&r.group_snapshot_id) {
            let g = across::get(&self.r, dl, &r.group_snapshot_id, &r.snapshot_ids).await?;
            return Ok(Response::new(csi::GetVolumeGroupSnapshotResponse {
                group_snapshot: Some(g),
            }));
        }
        // A handle naming its node (given out before group handles were
        // bare) is answered as it was asked.
        let asked = r.group_snapshot_id.clone();
        let node = self
            .group(&mut r.group_snapshot_id, &mut r.snapshot_ids)
            .await?;
        let mut resp = self
            .client(&node)
            .await?
            .get_volume_group_snapshot(onward(dl, r))
            .await
            .map_err(|s| from_node(&node, s))?
            .into_inner();
        if let Some(g) = resp.group_snapshot.as_mut() {
            qualify_group(g, &node);
            g.group_snapshot_id = asked.clone();
            for s in &mut g.snapshots {
                s.group_snapshot_id = asked.clone();
            }
        }
        Ok(Response::new(resp))
    }
}

/// Whether a group snapshot's handle names no node: a group across nodes (or
/// one made before handles named nodes), whose parts its members or the
/// nodes themselves tell.
fn bare(handle: &str) -> bool {
    !handle.is_empty() && csi_glue::handle::parse(handle).node.is_none()
}

pub struct RouterSnapshotMetadata {
    r: Arc<Router>,
}

impl RouterSnapshotMetadata {
    pub fn new(r: Arc<Router>) -> Self {
        RouterSnapshotMetadata { r }
    }

    async fn client(
        &self,
        node: &str,
    ) -> Result<SnapshotMetadataClient<tonic::transport::Channel>, Status> {
        Ok(
            SnapshotMetadataClient::new(self.r.agents.channel(node).await?)
                .max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
    }
}

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// An agent's stream as the router's, its failures naming the node.
fn relay<T: Send + 'static>(node: String, s: tonic::Streaming<T>) -> Streamed<T> {
    use tokio_stream::StreamExt;
    Box::pin(s.map(move |m| m.map_err(|e| from_node(&node, e))))
}

#[tonic::async_trait]
impl SnapshotMetadata for RouterSnapshotMetadata {
    type GetMetadataAllocatedStream = Streamed<csi::GetMetadataAllocatedResponse>;
    type GetMetadataDeltaStream = Streamed<csi::GetMetadataDeltaResponse>;

    async fn get_metadata_allocated(
        &self,
        req: Request<csi::GetMetadataAllocatedRequest>,
    ) -> Result<Response<Self::GetMetadataAllocatedStream>, Status> {
        let dl = deadline(&req);
        let mut r = req.into_inner();
        let at = self.r.place(Kind::Snapshot, &r.snapshot_id).await?;
        r.snapshot_id = at.id;
        let s = self
            .client(&at.node)
            .await?
            .get_metadata_allocated(onward(dl, r))
            .await
            .map_err(|s| from_node(&at.node, s))?
            .into_inner();
        Ok(Response::new(relay(at.node, s)))
    }

    async fn get_metadata_delta(
        &self,
        req: Request<csi::GetMetadataDeltaRequest>,
    ) -> Result<Response<Self::GetMetadataDeltaStream>, Status> {
        let dl = deadline(&req);
        let mut r = req.into_inner();
        let target = self.r.place(Kind::Snapshot, &r.target_snapshot_id).await?;
        let base = self.r.place(Kind::Snapshot, &r.base_snapshot_id).await?;
        if base.node != target.node {
            return Err(Status::invalid_argument(format!(
                "the changes between two snapshots are known where both are: {:?} is on {}, \
                 {:?} on {}",
                r.base_snapshot_id, base.node, r.target_snapshot_id, target.node
            )));
        }
        r.target_snapshot_id = target.id;
        r.base_snapshot_id = base.id;
        let s = self
            .client(&target.node)
            .await?
            .get_metadata_delta(onward(dl, r))
            .await
            .map_err(|s| from_node(&target.node, s))?
            .into_inner();
        Ok(Response::new(relay(target.node, s)))
    }
}

pub struct RouterIdentity {
    r: Arc<Router>,
}

impl RouterIdentity {
    pub fn new(r: Arc<Router>) -> Self {
        RouterIdentity { r }
    }
}

fn service(t: plugin_capability::service::Type) -> PluginCapability {
    PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service { r#type: t as i32 },
        )),
    }
}

#[tonic::async_trait]
impl Identity for RouterIdentity {
    async fn get_plugin_info(
        &self,
        _req: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: self.r.cfg.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: BTreeMap::new(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use plugin_capability::service::Type as S;
        let capabilities = vec![
            service(S::ControllerService),
            service(S::VolumeAccessibilityConstraints),
            service(S::GroupControllerService),
            service(S::SnapshotMetadataService),
            service(S::SnapshotAccessibilityConstraints),
            PluginCapability {
                r#type: Some(plugin_capability::Type::VolumeExpansion(
                    plugin_capability::VolumeExpansion {
                        r#type: plugin_capability::volume_expansion::Type::Online as i32,
                    },
                )),
            },
        ];
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    /// Ready once the list of node agents has been read: calls can be routed.
    async fn probe(
        &self,
        _req: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        Ok(Response::new(csi::ProbeResponse {
            ready: Some(self.r.agents.ready()),
        }))
    }
}
