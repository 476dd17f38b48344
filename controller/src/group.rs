//! The CSI GroupController service: snapshots of several volumes taken together.

use std::sync::Arc;

use csi_glue::{call, group_snapshot_of};
use csi_proto::csi::{
    self, group_controller_server::GroupController, group_controller_service_capability,
};
use csi_storage::Controller as Domain;
use tonic::{Request, Response, Status};

pub struct GroupControllerService {
    controller: Arc<Domain>,
}

impl GroupControllerService {
    pub fn new(controller: Arc<Domain>) -> Self {
        GroupControllerService { controller }
    }
}

#[tonic::async_trait]
impl GroupController for GroupControllerService {
    async fn group_controller_get_capabilities(
        &self,
        req: Request<csi::GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::GroupControllerGetCapabilitiesResponse>, Status> {
        use group_controller_service_capability::rpc::Type as T;
        let resp = call("GroupControllerGetCapabilities", "", req.get_ref(), || {
            Ok(csi::GroupControllerGetCapabilitiesResponse {
                capabilities: vec![csi::GroupControllerServiceCapability {
                    r#type: Some(group_controller_service_capability::Type::Rpc(
                        group_controller_service_capability::Rpc {
                            r#type: T::CreateDeleteGetVolumeGroupSnapshot as i32,
                        },
                    )),
                }],
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn create_volume_group_snapshot(
        &self,
        req: Request<csi::CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::CreateVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let g = call("CreateVolumeGroupSnapshot", "", &r, move || {
            d.create_group_snapshot(&rr.name, &rr.source_volume_ids, &rr.parameters)
                .map(|g| group_snapshot_of(&d, &g))
        })
        .await?;
        Ok(Response::new(csi::CreateVolumeGroupSnapshotResponse {
            group_snapshot: Some(g),
        }))
    }

    async fn delete_volume_group_snapshot(
        &self,
        req: Request<csi::DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::DeleteVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        call("DeleteVolumeGroupSnapshot", "", &r, move || {
            d.delete_group_snapshot(&rr.group_snapshot_id, &rr.snapshot_ids)
        })
        .await?;
        Ok(Response::new(csi::DeleteVolumeGroupSnapshotResponse {}))
    }

    async fn get_volume_group_snapshot(
        &self,
        req: Request<csi::GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::GetVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        let d = self.controller.clone();
        let rr = r.clone();
        let g = call("GetVolumeGroupSnapshot", "", &r, move || {
            d.get_group_snapshot(&rr.group_snapshot_id, &rr.snapshot_ids)
                .map(|g| group_snapshot_of(&d, &g))
        })
        .await?;
        Ok(Response::new(csi::GetVolumeGroupSnapshotResponse {
            group_snapshot: Some(g),
        }))
    }
}
