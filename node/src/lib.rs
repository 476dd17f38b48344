//! The CSI Node service: thin handlers over the domain's node operations.

#![forbid(unsafe_code)]

use std::sync::Arc;

use csi_glue::handle::{self, local_id};
use csi_glue::{bytes, call, capacity, optional_capability, topology, volume_health};
use csi_proto::csi::{
    self, node_server::Node, node_service_capability, volume_usage, NodeServiceCapability,
};
use csi_storage::health::PoolSeverity;
use csi_storage::node::{Publish, Stage};
use csi_storage::Node as Domain;
use tonic::{Request, Response, Status};

pub struct NodeService {
    node: Arc<Domain>,
}

impl NodeService {
    pub fn new(node: Arc<Domain>) -> Self {
        NodeService { node }
    }
}

/// The id a handle names. Calls that only undo or look (unstage, unpublish,
/// stats, health) take any handle: what this node holds decides, and a kubelet
/// cleaning up is never refused for a handle's form.
fn bare(handle: &str) -> String {
    handle::parse(handle).id
}

fn rpc(t: node_service_capability::rpc::Type) -> NodeServiceCapability {
    NodeServiceCapability {
        r#type: Some(node_service_capability::Type::Rpc(
            node_service_capability::Rpc { r#type: t as i32 },
        )),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        req: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let r = req.into_inner();
        let d = self.node.clone();
        let volume_id = local_id(&r.volume_id, &d.cfg.node_id)?;
        let rr = r.clone();
        call("NodeStageVolume", &r.volume_id, &r, move || {
            d.node_stage(Stage {
                capability: optional_capability(rr.volume_capability.as_ref())?,
                volume_context: rr.volume_context.clone(),
                volume_id,
                staging_path: rr.staging_target_path,
            })
        })
        .await?;
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        req: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let r = req.into_inner();
        let d = self.node.clone();
        let rr = r.clone();
        call("NodeUnstageVolume", &r.volume_id, &r, move || {
            d.node_unstage(&bare(&rr.volume_id), &rr.staging_target_path)
        })
        .await?;
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        req: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let r = req.into_inner();
        let d = self.node.clone();
        let volume_id = local_id(&r.volume_id, &d.cfg.node_id)?;
        let rr = r.clone();
        call("NodePublishVolume", &r.volume_id, &r, move || {
            d.node_publish(Publish {
                capability: optional_capability(rr.volume_capability.as_ref())?,
                volume_context: rr.volume_context.clone(),
                volume_id,
                staging_path: rr.staging_target_path,
                target_path: rr.target_path,
                read_only: rr.readonly,
            })
        })
        .await?;
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let r = req.into_inner();
        let d = self.node.clone();
        let rr = r.clone();
        call("NodeUnpublishVolume", &r.volume_id, &r, move || {
            d.node_unpublish(&bare(&rr.volume_id), &rr.target_path)
        })
        .await?;
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let r = req.into_inner();
        let d = self.node.clone();
        let rr = r.clone();
        let s = call("NodeGetVolumeStats", &r.volume_id, &r, move || {
            d.node_stats(&bare(&rr.volume_id), &rr.volume_path)
        })
        .await?;
        let mut usage = vec![csi::VolumeUsage {
            available: bytes(s.available_bytes),
            total: bytes(s.total_bytes),
            used: bytes(s.used_bytes),
            unit: volume_usage::Unit::Bytes as i32,
        }];
        // A filesystem that counts no inodes (btrfs) gets no inode figures.
        if !s.block && s.total_inodes > 0 {
            usage.push(csi::VolumeUsage {
                available: bytes(s.available_inodes),
                total: bytes(s.total_inodes),
                used: bytes(s.used_inodes),
                unit: volume_usage::Unit::Inodes as i32,
            });
        }
        Ok(Response::new(csi::NodeGetVolumeStatsResponse { usage }))
    }

    async fn node_expand_volume(
        &self,
        req: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        let d = self.node.clone();
        let volume_id = local_id(&r.volume_id, &d.cfg.node_id)?;
        let rr = r.clone();
        let size = call("NodeExpandVolume", &r.volume_id, &r, move || {
            let cap = optional_capability(rr.volume_capability.as_ref())?;
            d.node_expand(
                &volume_id,
                &rr.volume_path,
                capacity(rr.capacity_range.as_ref()),
                cap.as_ref(),
            )
        })
        .await?;
        Ok(Response::new(csi::NodeExpandVolumeResponse {
            capacity_bytes: bytes(size),
        }))
    }

    async fn node_get_capabilities(
        &self,
        req: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use node_service_capability::rpc::Type as T;
        let resp = call("NodeGetCapabilities", "", req.get_ref(), || {
            Ok(csi::NodeGetCapabilitiesResponse {
                capabilities: [
                    T::StageUnstageVolume,
                    T::GetVolumeStats,
                    T::ExpandVolume,
                    T::SingleNodeMultiWriter,
                    T::VolumeMountGroup,
                    T::GetVolumeHealth,
                    T::GetStorageHealth,
                ]
                .into_iter()
                .map(rpc)
                .collect(),
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn node_get_info(
        &self,
        req: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        let d = self.node.clone();
        let resp = call("NodeGetInfo", "", req.get_ref(), move || {
            Ok(csi::NodeGetInfoResponse {
                node_id: d.cfg.node_id.clone(),
                max_volumes_per_node: bytes(d.cfg.max_volumes_per_node),
                accessible_topology: Some(topology(&d)),
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn node_get_volume_health(
        &self,
        req: Request<csi::NodeGetVolumeHealthRequest>,
    ) -> Result<Response<csi::NodeGetVolumeHealthResponse>, Status> {
        let r = req.into_inner();
        let d = self.node.clone();
        let rr = r.clone();
        let h = call("NodeGetVolumeHealth", &r.volume_id, &r, move || {
            d.volume_health(
                &bare(&rr.volume_id),
                &rr.volume_publish_path,
                &rr.staging_target_path,
            )
        })
        .await?;
        Ok(Response::new(csi::NodeGetVolumeHealthResponse {
            volume_health: Some(volume_health(&h)),
        }))
    }

    async fn node_get_storage_health(
        &self,
        req: Request<csi::NodeGetStorageHealthRequest>,
    ) -> Result<Response<csi::NodeGetStorageHealthResponse>, Status> {
        use csi::node_get_storage_health_response::StorageBackendHealth;
        use csi::StorageHealthErrorType as T;
        let d = self.node.clone();
        let problems = call("NodeGetStorageHealth", "", req.get_ref(), move || {
            Ok(d.storage_health())
        })
        .await?;
        let backend_health = problems
            .into_iter()
            .map(|p| StorageBackendHealth {
                status: match p.severity {
                    PoolSeverity::Degraded => T::StorageDegraded,
                    PoolSeverity::Unreachable => T::StorageUnreachable,
                } as i32,
                reason: p.reason.to_string(),
                message: p.message,
                volume_capability: None,
            })
            .collect();
        Ok(Response::new(csi::NodeGetStorageHealthResponse {
            backend_health,
        }))
    }
}
