//! The controller domain: volumes, snapshots, group snapshots, snapshot metadata
//! and the freezes that keep copies of live volumes consistent.
//!
//! The domain owns `<state>/controller` (the volume, snapshot and group snapshot
//! records) and never reads the node's records. What it must agree on with the
//! node goes through the volume's lock in the shared state: a copy, a delete or a
//! change of settings holds it, so the node cannot stage, unstage or unmount the
//! volume meanwhile, and the node's staged mark tells whether a volume is in use.

pub mod freeze;
pub mod metadata;
pub mod snapshots;
pub mod templates;
#[cfg(test)]
mod tests;
pub mod transfer;
pub mod volumes;

use std::collections::BTreeMap;
use std::ops::{ControlFlow, Deref};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use crate::core::Core;
use crate::error::Result;
use crate::ids::VolumeId;
use crate::locks::Locks;
use crate::model::{GroupSnapshotRecord, SnapshotRecord, VolumeRecord};
use crate::settings::LiveDevices;
use crate::state::{Domain, OwnerLock};
use crate::store::Store;

/// The controller domain of a process.
pub struct Controller {
    core: Arc<Core>,
    pub(crate) volumes: Store<VolumeRecord>,
    pub(crate) snapshots: Store<SnapshotRecord>,
    pub(crate) groups: Store<GroupSnapshotRecord>,
    pub(crate) locks: Locks,
    pub(crate) templates: templates::Templates,
    /// Volumes whose data is arriving from other nodes.
    pub(crate) arrivals: transfer::Arrivals,
    /// The node domain of this process, if it runs one (`--mode all`): only it
    /// reaches loop devices.
    live: OnceLock<Arc<dyn LiveDevices>>,
    /// The sweep of lock files that start-up leaves to the background.
    sweep: Mutex<Option<JoinHandle<()>>>,
    /// Expedited grace periods for freezes (`--expedite-freeze`).
    pub(crate) expediter: csi_sys::expedite::Expediter,
    _owner: OwnerLock,
}

impl Deref for Controller {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl Controller {
    /// Claims the controller's part of the state (refused while another process
    /// holds it), thaws what a crash of this domain left frozen, loads the records
    /// and repairs what a crash left half-done.
    pub fn open(core: Arc<Core>) -> Result<Controller> {
        let owner = core.state.claim(Domain::Controller)?;
        let dir = core.state.domain(Domain::Controller);
        let c = Controller {
            volumes: Store::open(&dir.join("volumes"))?,
            snapshots: Store::open(&dir.join("snapshots"))?,
            groups: Store::open(&dir.join("groups"))?,
            locks: Locks::default(),
            templates: Default::default(),
            arrivals: Default::default(),
            live: OnceLock::new(),
            sweep: Mutex::new(None),
            expediter: csi_sys::expedite::Expediter::new(
                &core.cfg.rcu_expedited_knob,
                core.cfg.expedite_freeze,
            ),
            _owner: owner,
            core,
        };
        let dirs = c.pools.values().map(|p| p.volumes_dir()).collect();
        c.volumes
            .set_compaction_barrier(crate::core::blank::barrier(dirs));
        c.recover()?;
        let ((), ms) = timed(|| {
            c.volumes.compact_if_due();
            c.snapshots.compact_if_due();
            c.groups.compact_if_due();
            c.start_lock_sweep();
        });
        tracing::debug!(ms, "controller's background work started");
        Ok(c)
    }

    /// Lets the controller change the loop devices of staged volumes through the
    /// node domain of the same process.
    pub(crate) fn set_live_devices(&self, live: Arc<dyn LiveDevices>) {
        let _ = self.live.set(live);
    }

    pub(crate) fn live_devices(&self) -> Option<&Arc<dyn LiveDevices>> {
        self.live.get()
    }

    fn recover(&self) -> Result<()> {
        self.thaw_left_frozen();
        for pool in self.pools.values() {
            if pool.is_btrfs() {
                if let Err(e) = csi_sys::btrfs::quota_enable(&pool.root) {
                    tracing::warn!(pool = %pool.name, error = %e,
                        "btrfs quotas could not be enabled: dir volume sizes are not enforced");
                }
            }
        }
        let ((), templates_ms) = timed(|| {
            for pool in self.pools.values() {
                self.templates.recover(pool);
            }
        });
        let (volumes, volumes_ms) = timed(|| self.recover_volumes());
        volumes?;
        let (snapshots, snapshots_ms) = timed(|| self.recover_snapshots());
        snapshots?;
        let ((), transfers_ms) = timed(|| {
            self.recover_holds();
            self.recover_arrivals();
        });
        tracing::debug!(
            templates_ms,
            volumes_ms,
            snapshots_ms,
            transfers_ms,
            "controller state looked over"
        );
        Ok(())
    }

    /// Removes the lock files of volumes that are gone (a crash of a delete
    /// between the record and the lock leaves one) on a thread of its own: a
    /// stale lock file harms nothing meanwhile, and listing one per volume is a
    /// large part of a start with many volumes. Each file is removed only under
    /// its lock, after the volume is found gone again, so a volume made or
    /// staged since the listing keeps its lock.
    fn start_lock_sweep(&self) {
        let core = self.core.clone();
        let volumes = self.volumes.clone();
        let spawned = std::thread::Builder::new()
            .name("lock-sweep".into())
            .spawn(move || sweep_volume_locks(&core, &volumes));
        match spawned {
            Ok(h) => *self.sweep.lock().unwrap_or_else(|p| p.into_inner()) = Some(h),
            Err(e) => {
                tracing::warn!(error = %e, "no thread for the lock sweep; sweeping now");
                sweep_volume_locks(&self.core, &self.volumes);
            }
        }
    }

    /// Waits until the start-up's background sweep has ended.
    pub fn settle(&self) {
        let running = self.sweep.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = running {
            let _ = h.join();
        }
    }

    pub fn volume_count(&self) -> usize {
        self.volumes.len()
    }

    pub fn snapshot_count(&self) -> usize {
        self.snapshots.len()
    }

    /// Volume and snapshot records per pool (every configured pool, zeros
    /// included), for metrics.
    pub fn objects_by_pool(&self) -> BTreeMap<String, (usize, usize)> {
        let mut out: BTreeMap<String, (usize, usize)> =
            self.pools.keys().map(|k| (k.clone(), (0, 0))).collect();
        self.volumes.visit(None, |v| {
            out.entry(v.pool).or_default().0 += 1;
            ControlFlow::Continue(())
        });
        self.snapshots.visit(None, |s| {
            out.entry(s.pool).or_default().1 += 1;
            ControlFlow::Continue(())
        });
        out
    }
}

/// What `f` gives, and how long it took in milliseconds (for the start's log).
fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let started = std::time::Instant::now();
    let out = f();
    (out, started.elapsed().as_secs_f64() * 1000.0)
}

fn sweep_volume_locks(core: &Core, volumes: &Store<VolumeRecord>) {
    let gone = gone_volume_locks(core, volumes);
    remove_volume_locks(core, volumes, &gone);
}

fn lock_is_known(volumes: &Store<VolumeRecord>, id: VolumeId) -> bool {
    volumes.contains(id) || volumes.is_quarantined(&id.to_string())
}

/// The ids with a lock file and neither a record nor a staged mark.
pub(crate) fn gone_volume_locks(core: &Core, volumes: &Store<VolumeRecord>) -> Vec<VolumeId> {
    let staged: std::collections::BTreeSet<_> = core.state.staged_ids().into_iter().collect();
    core.state
        .locked_ids()
        .into_iter()
        .filter(|&id| !lock_is_known(volumes, id) && !staged.contains(&id))
        .collect()
}

/// Removes the lock files of `gone`, each under its lock and only if its volume
/// is still gone: it may have been made or staged since `gone` was listed.
pub(crate) fn remove_volume_locks(core: &Core, volumes: &Store<VolumeRecord>, gone: &[VolumeId]) {
    let mut removed = 0usize;
    for &id in gone {
        // An operation of this process or of the node's may hold it right now,
        // and then the volume is not gone. A call of this process that meets
        // the lock while the sweep holds it waits for it.
        let Ok(Some(lock)) = core.state.sweep_lock_volume(id) else {
            continue;
        };
        if lock_is_known(volumes, id) || lock.is_staged() {
            continue;
        }
        match lock.remove() {
            Ok(()) => removed += 1,
            Err(e) => {
                tracing::warn!(volume.id = %id, error = %e, "lock file of a gone volume kept")
            }
        }
    }
    if removed > 0 {
        tracing::info!(removed, "removed the lock files of volumes that are gone");
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.settle();
    }
}
