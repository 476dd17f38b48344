//! The core both domains stand on: the configuration, the pools, the system
//! layer, the state directory's layout and its cross-process locks, the
//! heavy-operation slots, and the model, ids, record store, locks and error type.
//! The controller domain (`controller`) and the node domain (`node`) each open
//! their own records on top of it; neither reaches into the other's.

pub(crate) mod arrival;
pub(crate) mod blank;
pub mod cancel;
pub(crate) mod data;
pub mod error;
pub mod failpoint;
pub(crate) mod fresh;
pub mod health;
pub mod ids;
pub(crate) mod locks;
pub mod model;
pub mod mount_options;
pub mod pool;
pub(crate) mod settings;
pub mod size;
pub(crate) mod state;
pub mod store;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use csi_sys::System;

use crate::error::{Error, Result};
use crate::pool::{Pool, DEFAULT_POOL};
use state::StateDir;

/// Mutable parameters this driver understands (ControllerModifyVolume and
/// CreateVolume's mutable_parameters).
/// `directIO` and `readAheadKiB` are attributes of an image volume's loop device;
/// `compression` is the btrfs compression of a subvolume (`kind: dir` on btrfs);
/// `transferBandwidth` caps the transfer of the volume's data from another node
/// (any kind of volume), and is kept in the volume's record only.
pub const MUTABLE_PARAMETERS: [&str; 4] = [
    "directIO",
    "readAheadKiB",
    "compression",
    TRANSFER_BANDWIDTH,
];

/// The mutable parameter that caps a transfer into the volume, bytes per
/// second; the one the volume's data does not carry.
pub const TRANSFER_BANDWIDTH: &str = "transferBandwidth";

#[derive(Debug, Clone)]
pub struct Config {
    pub driver_name: String,
    pub node_id: String,
    pub state_dir: PathBuf,
    /// (name, path) of each pool.
    pub pools: Vec<(String, PathBuf)>,
    pub default_fstype: String,
    pub enable_attach: bool,
    /// Whether ControllerExpandVolume is offered (off in the distributed
    /// deployment, where NodeExpandVolume grows the image).
    pub controller_expansion: bool,
    /// Mutable parameters accepted; a subset of [`MUTABLE_PARAMETERS`].
    pub mutable_parameters: Vec<String>,
    pub max_volumes_per_node: u64,
    /// This process runs the controller domain: it owns the volume and snapshot
    /// records and may remove pool data that no record accounts for.
    pub controller: bool,
    /// This process runs the node domain: it owns what is staged and published.
    pub node: bool,
    /// How many heavy operations (mkfs, copies, fsck) may run at once.
    pub heavy_operations: usize,
    /// At start, unmount and detach what no volume on this node accounts for (only
    /// reported otherwise).
    pub cleanup_orphans: bool,
    /// How long a filesystem may stay frozen for a copy beyond the copy's expected
    /// time (none for a reflink); then it is thawed and the copy undone.
    pub freeze_timeout: Duration,
    /// How long a long command (mkfs, fsck, resize) may run, the background
    /// making of filesystem templates included; then it is killed.
    pub command_timeout: Duration,
    /// Expedite the kernel's RCU grace periods while a filesystem freezes (a
    /// global switch, raised for the freeze only; see `csi_sys::expedite`).
    pub expedite_freeze: bool,
    /// The kernel's switch of expedited grace periods (a file of its own in
    /// tests).
    pub rcu_expedited_knob: PathBuf,
    /// A pool this full (percent of its filesystem used) is reported by
    /// NodeGetStorageHealth as nearly full; 0 turns the check off.
    pub pool_full_percent: u8,
    /// Pools that inline ephemeral volumes may use; none: inline ephemeral
    /// volumes are refused.
    pub ephemeral_pools: Vec<String>,
    /// The largest inline ephemeral volume, in bytes.
    pub ephemeral_max_size: u64,
    /// Mount options allowed per filesystem, and the flags every mount gets.
    pub mount_options: mount_options::MountOptionPolicy,
    /// Transfers of volumes from other nodes running at once.
    pub max_transfers: usize,
    /// Bytes of data per second the transfers to this node read together
    /// (0: no cap); a class's `transferBandwidth` caps one transfer more.
    pub transfer_bandwidth: u64,
    /// The directories below which the node stages and publishes volumes: the
    /// kubelet's (see [`kubelet_path_roots`]), and any an operator adds.
    pub allowed_path_roots: Vec<PathBuf>,
}

/// The kubelet's root directory when nothing else is said.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet";

/// Where a kubelet with root directory `dir` asks for volumes to be staged
/// and published: its pods' volume directories, and the staging and block
/// directories of CSI volumes. Nothing else of the kubelet's (its
/// credentials, plugin sockets, registration) is ever a place for a volume.
pub fn kubelet_path_roots(dir: &Path) -> Vec<PathBuf> {
    vec![dir.join("pods"), dir.join("plugins/kubernetes.io/csi")]
}

/// Default of [`Config::freeze_timeout`]: a reflink takes milliseconds, and the
/// freeze's own sync a few seconds on a busy disk.
pub const DEFAULT_FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

impl Config {
    pub fn new(node_id: &str, state_dir: &Path, pools: Vec<(String, PathBuf)>) -> Self {
        Config {
            driver_name: "example.csi.k8s.io".into(),
            node_id: node_id.into(),
            state_dir: state_dir.to_path_buf(),
            pools,
            default_fstype: "ext4".into(),
            enable_attach: false,
            controller_expansion: true,
            mutable_parameters: MUTABLE_PARAMETERS.iter().map(|s| s.to_string()).collect(),
            max_volumes_per_node: 0,
            controller: true,
            node: true,
            heavy_operations: 4,
            cleanup_orphans: false,
            freeze_timeout: DEFAULT_FREEZE_TIMEOUT,
            command_timeout: csi_sys::cmd::DEFAULT_TIMEOUT,
            expedite_freeze: true,
            rcu_expedited_knob: PathBuf::from(csi_sys::expedite::KNOB),
            pool_full_percent: health::DEFAULT_POOL_FULL_PERCENT,
            ephemeral_pools: Vec::new(),
            ephemeral_max_size: crate::model::GIB,
            mount_options: mount_options::MountOptionPolicy::default(),
            max_transfers: 2,
            transfer_bandwidth: 0,
            allowed_path_roots: kubelet_path_roots(Path::new(DEFAULT_KUBELET_DIR)),
        }
    }

    /// Why this driver cannot serve `cap` (see [`Capability::unsupported_reason`]),
    /// its mount options included; None when it can.
    pub fn unsupported(&self, cap: &crate::model::Capability) -> Option<String> {
        cap.unsupported_reason()
            .or_else(|| self.mount_options.refused(cap, &self.default_fstype))
    }
}

/// What both domains share: configuration, pools, the system layer, the state
/// directory and the heavy-operation slots. Opened once per process.
pub struct Core {
    pub cfg: Config,
    pub(crate) pools: BTreeMap<String, Pool>,
    pub(crate) sys: System,
    pub(crate) state: StateDir,
    heavy: Semaphore,
}

impl Core {
    /// Checks the configuration and opens the pools.
    pub fn open(cfg: Config, sys: System) -> Result<Core> {
        if cfg.node_id.is_empty() {
            return Err(Error::invalid("node id is required"));
        }
        for m in &cfg.mutable_parameters {
            if !MUTABLE_PARAMETERS.contains(&m.as_str()) {
                return Err(Error::invalid(format!(
                    "unknown mutable parameter {m:?}; supported: {}",
                    MUTABLE_PARAMETERS.join(", ")
                )));
            }
        }
        if let Some(p) = cfg
            .ephemeral_pools
            .iter()
            .find(|p| !cfg.pools.iter().any(|(name, _)| name == *p))
        {
            return Err(Error::invalid(format!(
                "ephemeral pool {p:?} is not one of the pools"
            )));
        }
        let mut pools = BTreeMap::new();
        for (name, path) in &cfg.pools {
            let pool = Pool::open(name, path)?;
            tracing::info!(pool = %pool.name, path = %pool.root.display(), fs = %pool.fs_type,
                reflink = pool.reflink, "pool ready");
            if pools.insert(name.clone(), pool).is_some() {
                return Err(Error::invalid(format!("pool {name} is named twice")));
            }
        }
        if pools.is_empty() {
            return Err(Error::invalid("at least one pool is required"));
        }
        let state = StateDir::open(&cfg.state_dir)?;
        Ok(Core {
            heavy: Semaphore::new(cfg.heavy_operations.max(1)),
            state,
            pools,
            sys,
            cfg,
        })
    }

    /// Whether every pool is still there.
    pub fn pools_present(&self) -> bool {
        let mut ok = true;
        for pool in self.pools.values() {
            if !csi_sys::dir::is_dir(&pool.root.join("volumes")) {
                tracing::warn!(pool = %pool.name, path = %pool.root.display(), "pool is gone");
                ok = false;
            }
        }
        ok
    }

    pub fn pool(&self, name: &str) -> Result<&Pool> {
        self.pools.get(name).ok_or_else(|| {
            Error::invalid(format!(
                "unknown pool {name:?}: node {} has the pools {}",
                self.cfg.node_id,
                self.pools.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })
    }

    pub fn pools(&self) -> impl Iterator<Item = &Pool> {
        self.pools.values()
    }

    pub fn default_pool(&self) -> &Pool {
        self.pools
            .get(DEFAULT_POOL)
            .or_else(|| self.pools.values().next())
            .expect("open() refuses a driver without pools")
    }

    /// The topology segment of this node.
    pub fn topology(&self) -> BTreeMap<String, String> {
        BTreeMap::from([(
            crate::model::TOPOLOGY_KEY.to_string(),
            self.cfg.node_id.clone(),
        )])
    }

    /// Whether a path lies inside a pool or the state dir: never a place to publish to.
    pub fn is_internal_path(&self, path: &Path) -> bool {
        path.starts_with(&self.cfg.state_dir)
            || self.pools.values().any(|p| p.contains(path))
            || self.cfg.pools.iter().any(|(_, p)| path.starts_with(p))
    }

    /// Runs a heavy operation (mkfs, copy, fsck) when a slot is free; Cancelled,
    /// without running it, when the caller goes away while it waits.
    pub(crate) fn heavy<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let _slot = self.heavy.acquire()?;
        Ok(f())
    }
}

/// A counting semaphore for blocking code.
struct Semaphore {
    free: Mutex<usize>,
    cv: Condvar,
}

struct Permit<'a>(&'a Semaphore);

impl Semaphore {
    fn new(n: usize) -> Self {
        Semaphore {
            free: Mutex::new(n),
            cv: Condvar::new(),
        }
    }
    /// Waits for a permit, looking at the call's cancellation every tick.
    fn acquire(&self) -> Result<Permit<'_>> {
        crate::cancel::check()?;
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        while *free == 0 {
            crate::cancel::check()?;
            free = self
                .cv
                .wait_timeout(free, crate::cancel::TICK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *free -= 1;
        Ok(Permit(self))
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.0.cv.notify_one();
    }
}
