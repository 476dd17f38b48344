//! Ephemeral inline volumes: made, staged and published by the first
//! NodePublishVolume, and removed with their last target. They are the node's
//! alone: their records live in the node's state, never in the controller's.
//!
//! Any pod author may write one, with no claim and no quota in between, so they
//! are off unless the operator names the pools they may use and their largest
//! size. Each one reserves its whole size against its pool: its record, written
//! durably before its image is made, is the reservation, and a new one is
//! admitted only while the pool's free space covers it and what the others have
//! not written yet. Admissions run one at a time, so two publishes cannot both
//! count the same free space. A reservation goes with its volume's record: at
//! the last unpublish, or at start-up for one whose image a crash left unmade.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::PoisonError;

use csi_sys::file;

use super::publish::Publish;
use super::stage::ToStage;
use super::Node;
use crate::data::remove_data;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::{validate_name, VolumeId};
use crate::locks::LockKey;
use crate::model::*;
use crate::pool::Pool;
use crate::size::parse_size;
use crate::state::Domain;

pub const EPHEMERAL_KEY: &str = "csi.storage.k8s.io/ephemeral";

/// Size of an ephemeral inline volume whose volumeAttributes name none.
pub const EPHEMERAL_DEFAULT_SIZE: u64 = GIB;

/// An ephemeral volume as its publish asks for it, checked: its size rounded
/// up to what its filesystem needs.
struct Ephemeral {
    id: VolumeId,
    pool: Pool,
    cap: Capability,
    size: u64,
    fs: String,
}

impl Node {
    pub(super) fn ephemeral_id(&self, volume_id: &str) -> Option<VolumeId> {
        let id = VolumeId::for_ephemeral(volume_id);
        self.node_records
            .get(id)
            .filter(|r| r.ephemeral)
            .map(|_| id)
            .or_else(|| self.ephemeral_volumes.get(id).map(|_| id))
    }

    fn ephemeral_staging(&self, id: VolumeId) -> PathBuf {
        self.state
            .domain(Domain::Node)
            .join("ephemeral-staging")
            .join(id.to_string())
    }

    pub(super) fn publish_ephemeral(&self, req: &Publish, target: &Path) -> Result<()> {
        validate_name("ephemeral volume", &req.volume_id)?;
        if self.cfg.ephemeral_pools.is_empty() {
            return Err(Error::invalid(
                "inline ephemeral volumes are off on this node (the driver runs without \
                 --ephemeral-pools); a generic ephemeral volume (a volumeClaimTemplate in \
                 the pod) gives a pod a volume of its own under the claim's quota",
            ));
        }
        let id = VolumeId::for_ephemeral(&req.volume_id);
        let cap = self.ephemeral_capability(req)?;
        let (pool, size, fs) = self.ephemeral_attributes(req, &cap)?;
        let (_, total) = pool.space()?;
        if size > total {
            return Err(Error::OutOfRange(format!(
                "{size} bytes exceeds the largest volume pool {} can hold ({total} bytes)",
                pool.name
            )));
        }
        let _guard = self.locks.try_lock([LockKey::Node(id)])?;
        let created = self
            .ephemeral_volumes
            .get(id)
            .is_none_or(|r| r.state != RecordState::Ready);
        let wanted = Ephemeral {
            id,
            pool,
            cap,
            size,
            fs,
        };
        if created {
            self.reserve_ephemeral(&wanted, &req.volume_id)?;
        }
        let result = self.make_ephemeral(req, target, &wanted, created);
        if result.is_err() && created {
            self.undo_first_ephemeral_publish(id, target);
        }
        result
    }

    /// Admits a new ephemeral volume against its pool and records it (state
    /// Creating), which reserves its size; one admission at a time.
    fn reserve_ephemeral(&self, wanted: &Ephemeral, name: &str) -> Result<()> {
        let _one = self
            .ephemeral_admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (available, _) = wanted.pool.space()?;
        let promised = self.ephemeral_promised(&wanted.pool, wanted.id);
        failpoint::hit("ephemeral.admission");
        if wanted.size > available.saturating_sub(promised) {
            return Err(Error::ResourceExhausted(format!(
                "pool {} has {available} bytes free, of which {promised} are reserved for the \
                 inline ephemeral volumes already here; {} were asked for",
                wanted.pool.name, wanted.size
            )));
        }
        self.ephemeral_volumes
            .put(&Self::ephemeral_record(wanted, name, RecordState::Creating))?;
        failpoint::hit("ephemeral.after-reserve");
        Ok(())
    }

    /// Bytes the ephemeral volumes of `pool` (but `except`) may still write:
    /// each one's size less what its image holds already.
    fn ephemeral_promised(&self, pool: &Pool, except: VolumeId) -> u64 {
        self.ephemeral_volumes
            .all()
            .iter()
            .filter(|r| r.pool == pool.name && r.id != except)
            .map(|r| {
                let image = pool.volume_path(r.id, Backing::Image, true);
                // An image not made yet holds nothing: its whole size is promised.
                r.size
                    .saturating_sub(file::allocated_bytes(&image).unwrap_or(0))
            })
            .sum()
    }

    /// Start-up: an ephemeral volume recorded as Creating never had its image
    /// made whole, nor was it staged; it and its reservation go, and the
    /// kubelet's retry of the publish admits it anew.
    pub(super) fn release_unmade_ephemeral(&self) -> Result<()> {
        for rec in self.ephemeral_volumes.all() {
            if rec.state == RecordState::Creating {
                tracing::info!(volume.id = %rec.id, pool = %rec.pool,
                    "releasing an ephemeral volume a crash left unmade");
                self.remove_volume_data(rec.id, true)?;
                self.ephemeral_volumes.remove(rec.id)?;
            }
        }
        Ok(())
    }

    /// The capability of an ephemeral volume: a supported mount.
    fn ephemeral_capability(&self, req: &Publish) -> Result<Capability> {
        let cap = req
            .capability
            .clone()
            .ok_or_else(|| Error::invalid("volume_capability is required"))?;
        if cap.is_block() {
            return Err(Error::invalid("ephemeral inline volumes are mount volumes"));
        }
        if let Some(why) = self.cfg.unsupported(&cap) {
            return Err(Error::invalid(why));
        }
        Ok(cap)
    }

    /// The pool, size and filesystem that an ephemeral volume's attributes ask
    /// for; the size is rounded up to the filesystem's least and whole MiB.
    fn ephemeral_attributes(&self, req: &Publish, cap: &Capability) -> Result<(Pool, u64, String)> {
        let allowed = ["size", "type", EPHEMERAL_KEY];
        if let Some(k) = req
            .volume_context
            .keys()
            .find(|k| !allowed.contains(&k.as_str()) && !k.starts_with(K8S_PREFIX))
        {
            return Err(Error::invalid(format!(
                "unknown volumeAttribute {k:?} for an ephemeral volume; accepted: size, type"
            )));
        }
        let size = match req.volume_context.get("size") {
            None => EPHEMERAL_DEFAULT_SIZE,
            // A parsed size is never negative: unsigned_abs is exact.
            Some(s) => parse_size(s)
                .map(i64::unsigned_abs)
                .map_err(|e| Error::invalid(format!("volumeAttribute size: {e}")))?,
        };
        let allowed = &self.cfg.ephemeral_pools;
        let pool_name = match req.volume_context.get("type") {
            Some(p) => p.clone(),
            None if allowed.contains(&self.default_pool().name) => self.default_pool().name.clone(),
            None => allowed[0].clone(),
        };
        if !allowed.contains(&pool_name) {
            return Err(Error::invalid(format!(
                "volumeAttribute type={:?}: inline ephemeral volumes may use only the pools {} \
                 on this node",
                crate::data::shorten(&pool_name),
                allowed.join(", ")
            )));
        }
        let pool = self.pool(&pool_name)?.clone();
        let fs = cap
            .fs_type()
            .map(String::from)
            .unwrap_or_else(|| self.cfg.default_fstype.clone());
        let size = size
            .max(minimum_size(Some(&fs)))
            .checked_next_multiple_of(MIB)
            .filter(|s| i64::try_from(*s).is_ok())
            .ok_or_else(|| {
                Error::OutOfRange(format!("volumeAttribute size={size} is too large"))
            })?;
        if size > self.cfg.ephemeral_max_size {
            return Err(Error::invalid(format!(
                "an inline ephemeral volume of {size} bytes ({fs}) is larger than this node \
                 makes them (--ephemeral-max-size, {} bytes)",
                self.cfg.ephemeral_max_size
            )));
        }
        Ok((pool, size, fs))
    }

    /// A refused or failed first publish leaves nothing behind.
    fn undo_first_ephemeral_publish(&self, id: VolumeId, target: &Path) {
        let staging = self.ephemeral_staging(id);
        // The target may hold something else: that is left alone, the rest goes.
        let _ = self.unpublish_locked(id, target);
        let undo = self
            .unstage_locked(id, &staging, None)
            .and_then(|()| self.remove_volume_data(id, true))
            .and_then(|()| self.ephemeral_volumes.remove(id));
        let _ = csi_sys::dir::remove_empty_dir(&staging);
        if let Err(e) = undo {
            tracing::warn!(volume.id = %id, error = %e, "could not undo a failed ephemeral publish");
        }
    }

    fn make_ephemeral(
        &self,
        req: &Publish,
        target: &Path,
        wanted: &Ephemeral,
        create: bool,
    ) -> Result<()> {
        let Ephemeral { id, pool, cap, .. } = wanted;
        let id = *id;
        if create {
            self.create_ephemeral(wanted, &req.volume_id)?;
        }
        failpoint::hit("ephemeral.after-create");
        let loc = pool
            .locate(id)
            .ok_or_else(|| Error::internal(format!("ephemeral volume {id} vanished")))?;
        let staging = self.ephemeral_staging(id);
        file::mkdir_p_mode(&staging, 0o700)
            .context(|| "making the ephemeral staging dir".into())?;
        let mut stage_cap = cap.clone();
        if let Access::Mount { mount_flags, .. } = &mut stage_cap.access {
            mount_flags.clear();
        }
        let to_stage = ToStage {
            id,
            volume_id: &req.volume_id,
            loc: &loc,
            staging: &staging,
            cap: &stage_cap,
            context: &BTreeMap::new(),
        };
        self.stage_locked(&to_stage, None)?;
        self.publish_locked(id, &loc, &staging, target, cap, req.read_only)
    }

    fn ephemeral_record(wanted: &Ephemeral, name: &str, state: RecordState) -> VolumeRecord {
        let Ephemeral {
            id,
            pool,
            cap,
            size,
            fs,
        } = wanted;
        // The caller checked and rounded the size.
        VolumeRecord {
            id: *id,
            name: name.to_string(),
            pool: pool.name.clone(),
            backing: Backing::Image,
            size: *size,
            fs_type: Some(fs.clone()),
            capabilities: vec![cap.clone()],
            parameters: BTreeMap::new(),
            mutable_parameters: BTreeMap::new(),
            source: None,
            created: Timestamp::now(),
            state,
            pending_size: None,
            published: BTreeMap::new(),
            ephemeral: true,
            requested: None,
        }
    }

    fn create_ephemeral(&self, wanted: &Ephemeral, name: &str) -> Result<()> {
        let (id, size) = (wanted.id, wanted.size);
        let path = wanted.pool.volume_path(id, Backing::Image, true);
        remove_data(&path)?;
        file::create_sparse(&path, size).context(|| format!("making {}", path.display()))?;
        self.ephemeral_volumes
            .put(&Self::ephemeral_record(wanted, name, RecordState::Ready))
    }

    pub(super) fn unpublish_ephemeral(&self, id: VolumeId, target: &Path) -> Result<()> {
        self.unpublish_locked(id, target)?;
        let remaining = self.node_records.get(id).map_or(0, |r| r.targets.len());
        if remaining > 0 {
            return Ok(());
        }
        self.unstage_locked(id, &self.ephemeral_staging(id), None)?;
        failpoint::hit("ephemeral.after-unstage");
        let _ = csi_sys::dir::remove_empty_dir(&self.ephemeral_staging(id));
        self.remove_volume_data(id, true)?;
        self.ephemeral_volumes.remove(id)?;
        Ok(())
    }
}
