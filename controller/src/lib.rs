//! The CSI Controller and GroupController services: thin handlers that convert a
//! request, call the domain on a blocking thread, and build the response.

#![forbid(unsafe_code)]

mod controller;
mod group;
mod metadata;

pub use controller::ControllerService;
pub use group::GroupControllerService;
pub use metadata::SnapshotMetadataService;
