//! The CSI Controller service.

use std::sync::Arc;

use csi_glue::{
    bytes, call, capabilities, capacity, create_volume, optional_capability, snapshot_of, topology,
    volume, volume_health,
};
use csi_proto::csi::{self, controller_server::Controller};
use csi_storage::ids::VolumeId;
use csi_storage::model::VolumeView;
use csi_storage::snapshots::SnapshotPage;
use csi_storage::volumes::UnpublishReason;
use csi_storage::Controller as Domain;
use tonic::{Request, Response, Status};

pub struct ControllerService {
    controller: Arc<Domain>,
}

impl ControllerService {
    pub fn new(controller: Arc<Domain>) -> Self {
        ControllerService { controller }
    }
}

/// The nodes a volume is published to, as CSI carries them.
fn published_on(v: &VolumeView) -> Vec<String> {
    v.published.0.iter().map(|n| n.to_string()).collect()
}

/// The reason of an unpublish; a value newer than this driver is not said.
fn unpublish_reason(value: i32) -> UnpublishReason {
    use csi::controller_unpublish_volume_request::Reason;
    match Reason::try_from(value) {
        Ok(Reason::NodeCleanupSucceeded) => UnpublishReason::NodeCleanedUp,
        Ok(Reason::NodeCleanupTimeout) => UnpublishReason::NodeTimedOut,
        Ok(Reason::NodeOutOfService) => UnpublishReason::NodeOutOfService,
        Ok(Reason::Unknown) => UnpublishReason::Unsaid,
        Err(_) => {
            tracing::warn!(
                reason = value,
                "an unpublish reason this driver does not know"
            );
            UnpublishReason::Unsaid
        }
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        req: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let id = VolumeId::for_name(&r.name).to_string();
        let rr = r.clone();
        let v = call("CreateVolume", &id, &r, move || {
            let v = d.create_volume(create_volume(&rr)?)?;
            Ok(volume(&topology(&d), &v.view()))
        })
        .await?;
        Ok(Response::new(csi::CreateVolumeResponse { volume: Some(v) }))
    }

    async fn delete_volume(
        &self,
        req: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let id = r.volume_id.clone();
        call("DeleteVolume", &r.volume_id, &r, move || {
            d.delete_volume(&id)
        })
        .await?;
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        req: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        if !self.controller.cfg.enable_attach {
            return Err(Status::unimplemented(
                "ControllerPublishVolume needs --enable-attach",
            ));
        }
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let ctx = call("ControllerPublishVolume", &r.volume_id, &r, move || {
            let cap = optional_capability(rr.volume_capability.as_ref())?;
            d.publish_volume(&rr.volume_id, &rr.node_id, cap.as_ref(), rr.readonly)
        })
        .await?;
        Ok(Response::new(csi::ControllerPublishVolumeResponse {
            publish_context: ctx,
        }))
    }

    async fn controller_unpublish_volume(
        &self,
        req: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        if !self.controller.cfg.enable_attach {
            return Err(Status::unimplemented(
                "ControllerUnpublishVolume needs --enable-attach",
            ));
        }
        let r = req.into_inner();
        let d = self.controller.clone();
        let (v, n) = (r.volume_id.clone(), r.node_id.clone());
        let reason = unpublish_reason(r.reason);
        call("ControllerUnpublishVolume", &r.volume_id, &r, move || {
            d.unpublish_volume(&v, &n, reason)
        })
        .await?;
        Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let resp = call("ValidateVolumeCapabilities", &r.volume_id, &r, move || {
            let caps = capabilities(&rr.volume_capabilities)?;
            let why = d.validate_capabilities(
                &rr.volume_id,
                &caps,
                &rr.parameters,
                &rr.mutable_parameters,
            )?;
            Ok(match why {
                None => csi::ValidateVolumeCapabilitiesResponse {
                    confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                        volume_context: rr.volume_context.clone(),
                        volume_capabilities: rr.volume_capabilities.clone(),
                        parameters: rr.parameters.clone(),
                        mutable_parameters: rr.mutable_parameters.clone(),
                    }),
                    message: String::new(),
                },
                Some(message) => csi::ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message,
                },
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn list_volumes(
        &self,
        req: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let resp = call("ListVolumes", "", &r, move || {
            let at = topology(&d);
            let page = d.list_volumes(rr.max_entries, &rr.starting_token, |v| {
                csi::list_volumes_response::Entry {
                    volume: Some(volume(&at, v)),
                    status: Some(csi::list_volumes_response::VolumeStatus {
                        published_node_ids: published_on(v),
                    }),
                }
            })?;
            let entries = page.volumes;
            let next_token = page.next_token.unwrap_or_default();
            csi_glue::memory::listing_page_served(entries.len(), next_token.is_empty());
            Ok(csi::ListVolumesResponse {
                entries,
                next_token,
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn get_capacity(
        &self,
        req: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let resp = call("GetCapacity", "", &r, move || {
            let caps = capabilities(&rr.volume_capabilities)?;
            let topo = rr.accessible_topology.as_ref().map(|t| &t.segments);
            let c = d.get_capacity(&rr.parameters, &caps, topo)?;
            Ok(csi::GetCapacityResponse {
                available_capacity: bytes(c.available),
                maximum_volume_size: Some(bytes(c.maximum_volume_size)),
                minimum_volume_size: Some(bytes(c.minimum_volume_size)),
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn controller_get_capabilities(
        &self,
        req: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        let cfg = self.controller.cfg.clone();
        let resp = call("ControllerGetCapabilities", "", req.get_ref(), move || {
            Ok(csi::ControllerGetCapabilitiesResponse {
                capabilities: csi_glue::controller_capabilities(
                    cfg.enable_attach,
                    cfg.controller_expansion,
                    !cfg.mutable_parameters.is_empty(),
                ),
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn create_snapshot(
        &self,
        req: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let s = call("CreateSnapshot", &r.source_volume_id, &r, move || {
            let requisite: Vec<_> = rr
                .accessibility_requirements
                .iter()
                .flat_map(|a| a.requisite.iter().map(|t| t.segments.clone()))
                .collect();
            d.create_snapshot_within(&rr.name, &rr.source_volume_id, &rr.parameters, &requisite)
                .map(|s| snapshot_of(&d, &s))
        })
        .await?;
        Ok(Response::new(csi::CreateSnapshotResponse {
            snapshot: Some(s),
        }))
    }

    async fn delete_snapshot(
        &self,
        req: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let id = r.snapshot_id.clone();
        call("DeleteSnapshot", "", &r, move || d.delete_snapshot(&id)).await?;
        Ok(Response::new(csi::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let resp = call("ListSnapshots", &r.source_volume_id, &r, move || {
            let SnapshotPage {
                snapshots,
                next_token,
            } = d.list_snapshots(
                rr.max_entries,
                &rr.starting_token,
                &rr.snapshot_id,
                &rr.source_volume_id,
            )?;
            Ok(csi::ListSnapshotsResponse {
                entries: snapshots
                    .iter()
                    .map(|s| csi::list_snapshots_response::Entry {
                        snapshot: Some(snapshot_of(&d, s)),
                    })
                    .collect(),
                next_token: next_token.unwrap_or_default(),
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn controller_expand_volume(
        &self,
        req: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        if !self.controller.cfg.controller_expansion {
            return Err(Status::unimplemented(
                "controller expansion is off; NodeExpandVolume grows volumes",
            ));
        }
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let (size, node) = call("ControllerExpandVolume", &r.volume_id, &r, move || {
            let cap = optional_capability(rr.volume_capability.as_ref())?;
            d.expand_volume(
                &rr.volume_id,
                capacity(rr.capacity_range.as_ref()),
                cap.as_ref(),
            )
        })
        .await?;
        Ok(Response::new(csi::ControllerExpandVolumeResponse {
            capacity_bytes: bytes(size),
            node_expansion_required: node,
        }))
    }

    async fn controller_get_volume(
        &self,
        req: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let id = r.volume_id.clone();
        let resp = call("ControllerGetVolume", &r.volume_id, &r, move || {
            let v = d.get_volume(&id)?;
            let v = v.view();
            Ok(csi::ControllerGetVolumeResponse {
                volume: Some(volume(&topology(&d), &v)),
                status: Some(csi::controller_get_volume_response::VolumeStatus {
                    published_node_ids: published_on(&v),
                }),
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn controller_modify_volume(
        &self,
        req: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        if self.controller.cfg.mutable_parameters.is_empty() {
            return Err(Status::unimplemented("no mutable parameters are enabled"));
        }
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        call("ControllerModifyVolume", &r.volume_id, &r, move || {
            d.modify_volume(&rr.volume_id, &rr.mutable_parameters)
        })
        .await?;
        Ok(Response::new(csi::ControllerModifyVolumeResponse {}))
    }

    async fn get_snapshot(
        &self,
        req: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let id = r.snapshot_id.clone();
        let s = call("GetSnapshot", "", &r, move || {
            d.get_snapshot(&id).map(|s| snapshot_of(&d, &s))
        })
        .await?;
        Ok(Response::new(csi::GetSnapshotResponse {
            snapshot: Some(s),
        }))
    }

    async fn controller_list_volume_health(
        &self,
        req: Request<csi::ControllerListVolumeHealthRequest>,
    ) -> Result<Response<csi::ControllerListVolumeHealthResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let resp = call("ControllerListVolumeHealth", "", &r, move || {
            let page = d.list_volume_health(rr.max_entries, &rr.starting_token)?;
            Ok(csi::ControllerListVolumeHealthResponse {
                entries: page.volumes.iter().map(volume_health).collect(),
                next_token: page.next_token.unwrap_or_default(),
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn controller_get_volume_health(
        &self,
        req: Request<csi::ControllerGetVolumeHealthRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeHealthResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let id = r.volume_id.clone();
        let h = call("ControllerGetVolumeHealth", &r.volume_id, &r, move || {
            d.volume_health(&id)
        })
        .await?;
        Ok(Response::new(csi::ControllerGetVolumeHealthResponse {
            volume_health: Some(volume_health(&h)),
        }))
    }

    async fn controller_get_node_info(
        &self,
        req: Request<csi::ControllerGetNodeInfoRequest>,
    ) -> Result<Response<csi::ControllerGetNodeInfoResponse>, Status> {
        if !self.controller.cfg.enable_attach {
            return Err(Status::unimplemented(
                "ControllerGetNodeInfo needs --enable-attach",
            ));
        }
        let r = req.into_inner();
        let d = self.controller.clone();
        let node = r.node_id.clone();
        let resp = call("ControllerGetNodeInfo", "", &r, move || {
            let info = d.node_info(&node)?;
            Ok(csi::ControllerGetNodeInfoResponse {
                max_volumes_per_node: bytes(info.max_volumes),
                accessible_topology: Some(topology(&d)),
                published_volumes: info
                    .volumes
                    .iter()
                    .map(
                        |id| csi::controller_get_node_info_response::PublishedVolume {
                            volume_id: id.to_string(),
                        },
                    )
                    .collect(),
            })
        })
        .await?;
        Ok(Response::new(resp))
    }
}
