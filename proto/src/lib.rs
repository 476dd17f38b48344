//! The CSI v1.14.0 wire contract: the types and gRPC services generated from
//! `csi.proto` (with `RPCS`, the list of its methods); and the kubelet's
//! plugin-registration service (v1) from `pluginregistration.proto`; and the
//! driver's own mesh protocol from `mesh.proto`. Nothing else lives here.

#![forbid(unsafe_code)]

#[allow(clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("csi.v1");

    // RPCS: every method of the CSI services, written by build.rs.
    include!(concat!(env!("OUT_DIR"), "/csi_rpcs.rs"));
}

pub use v1 as csi;

/// The kubelet's plugin-registration service, v1 (its package has no version).
#[allow(clippy::all, clippy::pedantic)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The mesh of a multi-node deployment (`mesh.proto`): the driver's own
/// protocol between the cluster's controller and the node agents.
#[allow(clippy::all, clippy::pedantic)]
pub mod mesh {
    tonic::include_proto!("example.csi.mesh.v1");
}
