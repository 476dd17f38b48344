//! The domain of example-csi, in three parts:
//!
//! - `core`: the configuration, pools, state directory (with the cross-process
//!   locks), the record store (`core::store`: format, frames, journal,
//!   compaction, recovery), per-object locks (typed `LockKey`s), ids, model and
//!   the one error type;
//! - `controller`: volumes, snapshots, group snapshots, snapshot metadata and the
//!   freezes that make copies consistent; it owns the volume and snapshot records;
//! - `node`: stage, publish, stats, expansion, ephemeral volumes and the start-up
//!   check of the node; it owns what is staged and published here.
//!
//! Each domain opens only its own records: a process with `--mode node` never
//! loads the controller's, and `--mode controller` never the node's. `Driver`
//! composes the domains a mode asks for. The domain touches the kernel only
//! through `csi-sys` (no file-system, socket or C-library call of its own, so every
//! file operation follows the sys helpers' durability rules, keeps its errno and
//! is seen by the power-loss model), and knows nothing of gRPC: the glue maps its
//! errors to codes.

#![forbid(unsafe_code)]

pub mod controller;
pub mod core;
mod driver;
mod handoff;
pub mod node;

pub use crate::controller::{metadata, snapshots, volumes, Controller};
pub use crate::core::{cancel, error, failpoint, health, ids, model, mount_options, pool, size};
pub(crate) use crate::core::{data, fresh, locks, settings, state, store};
pub use crate::core::{
    kubelet_path_roots, Config, Core, DEFAULT_FREEZE_TIMEOUT, DEFAULT_KUBELET_DIR,
    MUTABLE_PARAMETERS, TRANSFER_BANDWIDTH,
};
pub use crate::node::Node;
pub use csi_sys::memory::release_free as release_free_memory;
pub use csi_sys::System;
pub use driver::Driver;
pub use error::{Error, Result};
#[cfg(test)]
mod power_loss;
#[cfg(test)]
mod testkit;
