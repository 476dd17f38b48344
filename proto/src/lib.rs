//! The CSI v1.12.0 wire contract: the types and gRPC services generated from
//! `csi.proto`. Nothing else lives here.

#[allow(clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("csi.v1");
}

pub use v1 as csi;
