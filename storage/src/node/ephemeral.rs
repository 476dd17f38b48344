//! Ephemeral inline volumes: made, staged and published by the first
//! NodePublishVolume, and removed with their last target. They are the node's
//! alone: their records live in the node's state, never in the controller's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use csi_sys::file;

use super::publish::Publish;
use super::stage::ToStage;
use super::Node;
use crate::data::remove_data;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::{validate_name, VolumeId};
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
        let id = VolumeId::for_ephemeral(&req.volume_id);
        let cap = Self::ephemeral_capability(req)?;
        let (pool, size, fs) = self.ephemeral_attributes(req, &cap)?;
        let (available, total) = pool.space()?;
        if size > total {
            return Err(Error::OutOfRange(format!(
                "{size} bytes exceeds the largest volume pool {} can hold ({total} bytes)",
                pool.name
            )));
        }
        let _guard = self.locks.try_lock([format!("node:{id}")])?;
        let created = self
            .ephemeral_volumes
            .get(id)
            .is_none_or(|r| r.state != RecordState::Ready);
        if created && size > available {
            return Err(Error::ResourceExhausted(format!(
                "pool {} has {available} bytes free; {size} were asked for",
                pool.name
            )));
        }
        let wanted = Ephemeral {
            id,
            pool,
            cap,
            size,
            fs,
        };
        let result = self.make_ephemeral(req, target, &wanted, created);
        if result.is_err() && created {
            self.undo_first_ephemeral_publish(id, target);
        }
        result
    }

    /// The capability of an ephemeral volume: a supported mount.
    fn ephemeral_capability(req: &Publish) -> Result<Capability> {
        let cap = req
            .capability
            .clone()
            .ok_or_else(|| Error::invalid("volume_capability is required"))?;
        if cap.is_block() {
            return Err(Error::invalid("ephemeral inline volumes are mount volumes"));
        }
        if let Some(why) = cap.unsupported_reason() {
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
        let pool_name = req
            .volume_context
            .get("type")
            .cloned()
            .unwrap_or_else(|| self.default_pool().name.clone());
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
        let _ = std::fs::remove_dir(&staging);
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

    fn create_ephemeral(&self, wanted: &Ephemeral, name: &str) -> Result<()> {
        let Ephemeral {
            id,
            pool,
            cap,
            size,
            fs,
        } = wanted;
        let (id, size) = (*id, *size);
        // The caller checked and rounded the size.
        let rec = VolumeRecord {
            id,
            name: name.to_string(),
            pool: pool.name.clone(),
            backing: Backing::Image,
            size,
            fs_type: Some(fs.clone()),
            capabilities: vec![cap.clone()],
            parameters: BTreeMap::new(),
            mutable_parameters: BTreeMap::new(),
            source: None,
            created: Timestamp::now(),
            state: RecordState::Ready,
            pending_size: None,
            published: BTreeMap::new(),
            ephemeral: true,
            requested: None,
        };
        let path = pool.volume_path(id, Backing::Image, true);
        remove_data(&path)?;
        file::create_sparse(&path, size).context(|| format!("making {}", path.display()))?;
        self.ephemeral_volumes.put(&rec)
    }

    pub(super) fn unpublish_ephemeral(&self, id: VolumeId, target: &Path) -> Result<()> {
        self.unpublish_locked(id, target)?;
        let remaining = self.node_records.get(id).map_or(0, |r| r.targets.len());
        if remaining > 0 {
            return Ok(());
        }
        self.unstage_locked(id, &self.ephemeral_staging(id), None)?;
        failpoint::hit("ephemeral.after-unstage");
        let _ = std::fs::remove_dir(self.ephemeral_staging(id));
        self.remove_volume_data(id, true)?;
        self.ephemeral_volumes.remove(id)?;
        Ok(())
    }
}
