//! The domain of example-csi: pools, volumes, snapshots, group snapshots, the node's
//! staging and publishing, the crash-safe state store, per-object locks, and the one
//! error type with its mapping to gRPC codes. It touches the kernel only through
//! `csi-sys`, and knows nothing of gRPC beyond that mapping.

pub mod cancel;
mod driver;
pub mod error;
pub mod failpoint;
mod freeze;
pub mod ids;
mod locks;
pub mod metadata;
pub mod model;
pub mod node;
pub mod pool;
pub mod snapshots;
mod store;
pub mod volumes;

pub use csi_sys::System;
pub use driver::{Config, Driver, DEFAULT_FREEZE_TIMEOUT, MUTABLE_PARAMETERS};
pub use error::{Error, Result};
#[cfg(test)]
mod decisions;
