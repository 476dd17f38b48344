//! The CSI v1.13.0 wire contract: the types and gRPC services generated from
//! `csi.proto` (with `RPCS`, the list of its methods); and the kubelet's
//! plugin-registration service (v1) from `pluginregistration.proto`. Nothing
//! else lives here.

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
