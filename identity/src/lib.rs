//! The CSI Identity service: who the driver is, what it offers, whether it is ready.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use csi_glue::{call, Shared};
use csi_proto::csi::{self, identity_server::Identity, plugin_capability, PluginCapability};
use tonic::{Request, Response, Status};

pub struct IdentityService {
    driver: Shared,
    /// Whether this process serves the Controller, GroupController and
    /// SnapshotMetadata services.
    controller: bool,
}

impl IdentityService {
    pub fn new(driver: Shared, controller: bool) -> Self {
        IdentityService { driver, controller }
    }
}

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const COMMIT: &str = env!("EXAMPLE_CSI_COMMIT");

fn service(t: plugin_capability::service::Type) -> PluginCapability {
    PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service { r#type: t as i32 },
        )),
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        req: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        let name = self.driver.cfg.driver_name.clone();
        let resp = call("GetPluginInfo", "", req.get_ref(), move || {
            let mut manifest = BTreeMap::new();
            if !COMMIT.is_empty() {
                manifest.insert("commit".to_string(), COMMIT.to_string());
            }
            Ok(csi::GetPluginInfoResponse {
                name,
                vendor_version: VERSION.to_string(),
                manifest,
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn get_plugin_capabilities(
        &self,
        req: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use plugin_capability::service::Type as S;
        let controller = self.controller;
        let resp = call("GetPluginCapabilities", "", req.get_ref(), move || {
            let mut capabilities = vec![service(S::VolumeAccessibilityConstraints)];
            if controller {
                capabilities.push(service(S::ControllerService));
                capabilities.push(service(S::GroupControllerService));
                capabilities.push(service(S::SnapshotMetadataService));
                // Snapshots stay in the pool of the node that took them.
                capabilities.push(service(S::SnapshotAccessibilityConstraints));
            }
            capabilities.push(PluginCapability {
                r#type: Some(plugin_capability::Type::VolumeExpansion(
                    plugin_capability::VolumeExpansion {
                        r#type: plugin_capability::volume_expansion::Type::Online as i32,
                    },
                )),
            });
            Ok(csi::GetPluginCapabilitiesResponse { capabilities })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn probe(
        &self,
        req: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        let d = self.driver.clone();
        let ready = call("Probe", "", req.get_ref(), move || d.probe()).await?;
        Ok(Response::new(csi::ProbeResponse { ready: Some(ready) }))
    }
}
