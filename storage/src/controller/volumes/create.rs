//! CreateVolume: an empty volume, or one filled from a snapshot or a volume
//! (see `content`). The id comes from the name, so a retry finds what an earlier
//! attempt made: the same volume, a conflict, or data to start over from.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::{parse_parameters, CreateVolume, VolumeKind, VolumeParams};
use crate::error::{Error, Result};
use crate::failpoint;
use crate::ids::{validate_name, VolumeId};
use crate::locks::LockKey;
use crate::model::*;
use crate::pool::Pool;
use crate::Controller;

/// What a CreateVolume request asks for, checked: the pool, the kind of data and
/// the filesystem.
pub(crate) struct Plan {
    pub(crate) params: VolumeParams,
    pub(crate) pool: Pool,
    pub(crate) backing: Backing,
    pub(crate) fs_type: Option<String>,
    /// Whether the capabilities name a filesystem (else it is the default).
    pub(crate) fs_named: bool,
}

impl Controller {
    fn check_capabilities(&self, caps: &[Capability]) -> Result<()> {
        if caps.is_empty() {
            return Err(Error::invalid("volume_capabilities are required"));
        }
        for c in caps {
            if let Some(why) = self.cfg.unsupported(c) {
                return Err(Error::invalid(why));
            }
        }
        Ok(())
    }

    pub fn create_volume(&self, req: CreateVolume) -> Result<VolumeRecord> {
        let mut plan = self.plan_volume(&req)?;
        let id = VolumeId::for_name(&req.name);
        let mut keys = vec![LockKey::Volume(id)];
        // A snapshot does not change while it is read, so restores from one
        // snapshot share it; a live source volume is frozen for the copy, one at a time.
        let mut shared = Vec::new();
        let source = req.source;
        match source {
            Some(ContentSource::Snapshot(s)) => shared.push(LockKey::Snapshot(s)),
            Some(ContentSource::Volume(v)) => keys.push(LockKey::Volume(v)),
            None => {}
        }
        let _guard = self.locks.try_lock_with(keys, shared)?;

        if let Some(existing) = self.volumes.get(id) {
            if existing.state == RecordState::Ready {
                return self.same_volume(existing, &req, &plan.params, plan.backing);
            }
            // An earlier attempt failed or crashed part-way: start over.
            self.roll_back_volume(&existing)?;
        }

        // The source decides the least size, the filesystem and the data.
        let (src_path, at_least) = match source {
            None => (None, 0),
            Some(src) => self.plan_source(src, &mut plan)?,
        };
        let size = self.size_in_pool(req.capacity, &plan, at_least)?;

        let record = VolumeRecord {
            id,
            name: req.name.clone(),
            pool: plan.pool.name.clone(),
            backing: plan.backing,
            size,
            fs_type: plan.fs_type,
            capabilities: req.capabilities.clone(),
            parameters: req.parameters.clone(),
            mutable_parameters: req.mutable_parameters.clone(),
            source,
            created: Timestamp::now(),
            state: RecordState::Ready,
            pending_size: None,
            published: BTreeMap::new(),
            ephemeral: false,
            requested: requested_below(req.capacity.required, size),
        };
        self.make_volume(record, &plan.pool, src_path)
    }

    /// Checks a request and decides its pool, its kind of data and its filesystem.
    pub(crate) fn plan_volume(&self, req: &CreateVolume) -> Result<Plan> {
        validate_name("volume", &req.name)?;
        self.check_capabilities(&req.capabilities)?;
        req.capacity.validate()?;
        let params = parse_parameters(&req.parameters)?;
        self.check_mutable(&req.mutable_parameters)?;
        let pool = match self.pool(&params.pool) {
            Ok(pool) => pool.clone(),
            Err(e) => return Err(Error::invalid(format!("StorageClass parameter type: {e}"))),
        };
        if !self.topology_allows(&req.requisite) {
            return Err(Error::ResourceExhausted(format!(
                "accessibility_requirements.requisite does not include this node \
                 ({}={}); volumes are local to the node that makes them",
                TOPOLOGY_KEY, self.cfg.node_id
            )));
        }
        let block = req.capabilities.iter().any(Capability::is_block);
        let backing = match params.kind {
            VolumeKind::Image => Backing::Image,
            VolumeKind::Dir if block => {
                return Err(Error::invalid(
                    "block access is not possible on a kind=dir volume; use kind=image",
                ))
            }
            VolumeKind::Dir if pool.is_btrfs() => Backing::Subvolume,
            VolumeKind::Dir => Backing::Directory,
        };
        Self::check_mutable_applies(backing, &req.mutable_parameters)?;
        let mut fs_types: Vec<&str> = req
            .capabilities
            .iter()
            .filter_map(|c| c.fs_type())
            .collect();
        fs_types.dedup();
        if fs_types.len() > 1 {
            return Err(Error::invalid(format!(
                "volume_capabilities name different filesystems: {}",
                fs_types.join(", ")
            )));
        }
        let fs_type = match backing {
            Backing::Image if req.capabilities.iter().all(Capability::is_block) => None,
            Backing::Image => Some(
                fs_types
                    .first()
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| self.cfg.default_fstype.clone()),
            ),
            _ => None,
        };
        Ok(Plan {
            params,
            pool,
            backing,
            fs_type,
            fs_named: !fs_types.is_empty(),
        })
    }

    /// Checks that a content source can fill the planned volume, which takes its
    /// filesystem; returns the source's data and its size, the least the volume
    /// may have.
    fn plan_source(
        &self,
        src: ContentSource,
        plan: &mut Plan,
    ) -> Result<(Option<(PathBuf, Backing)>, u64)> {
        let (pool, backing) = (&plan.pool, plan.backing);
        let (src_pool, src_path, src_backing, src_size, src_fs) = self.source_data(src)?;
        if src_pool != pool.name {
            return Err(Error::invalid(format!(
                "the content source is in pool {src_pool}; a volume made from it must \
                 be in the same pool, not {}",
                pool.name
            )));
        }
        let same_kind = (src_backing == Backing::Image) == (backing == Backing::Image);
        if !same_kind {
            return Err(Error::invalid(format!(
                "the content source is a {src_backing:?} volume; it cannot fill a \
                 {backing:?} volume"
            )));
        }
        if let (Some(want), Some(have)) = (&plan.fs_type, &src_fs) {
            if want != have && plan.fs_named {
                return Err(Error::invalid(format!(
                    "the content source holds {have}, not the requested {want}"
                )));
            }
        }
        if src_fs.is_some() {
            plan.fs_type = src_fs;
        }
        Ok((Some((src_path, src_backing)), src_size))
    }

    /// The size to make, within the request's range and what the pool can hold.
    pub(crate) fn size_in_pool(
        &self,
        capacity: CapacityRange,
        plan: &Plan,
        at_least: u64,
    ) -> Result<u64> {
        let pool = &plan.pool;
        let size = self.size_for(capacity, plan.fs_type.as_deref(), at_least)?;
        if at_least > 0 && capacity.limit > 0 && at_least > capacity.limit as u64 {
            return Err(Error::OutOfRange(format!(
                "the content source is {at_least} bytes, more than limit_bytes {}",
                capacity.limit
            )));
        }
        let (available, total) = self.templates.space_for(pool, size)?;
        // No volume, not even an unenforced directory, can be larger than its pool.
        if size > total {
            return Err(Error::OutOfRange(format!(
                "{size} bytes exceeds the largest volume pool {} can hold ({total} bytes)",
                pool.name
            )));
        }
        if size > available && plan.backing != Backing::Directory {
            return Err(Error::ResourceExhausted(format!(
                "pool {} has {available} bytes free; {size} were asked for",
                pool.name
            )));
        }
        Ok(size)
    }

    /// Makes the volume's data and then its record.
    fn make_volume(
        &self,
        record: VolumeRecord,
        pool: &Pool,
        src_path: Option<(PathBuf, Backing)>,
    ) -> Result<VolumeRecord> {
        let id = record.id;
        // No intent record is written: the id comes from the name, so data that a
        // crash leaves without a record is found by the retry (removed just below)
        // or by the orphan sweep at start. One record write, after the data is
        // durable, is what makes the volume exist.
        // The volume's lock file lives as long as the volume: made here, removed
        // with the volume.
        let volume = self.state.lock_volume(id)?;
        self.remove_volume_data(id, false)?;
        failpoint::hit("create-volume.before-data");
        if let Err(e) = self.make_volume_data(
            pool,
            &record,
            src_path.as_ref().map(|(p, b)| (p.as_path(), *b)),
        ) {
            let undo = self
                .roll_back_volume(&record)
                .and_then(|()| volume.remove());
            return Err(e.with_cleanup(undo));
        }
        failpoint::hit("create-volume.after-data");
        self.volumes.put(&record)?;
        failpoint::hit("create-volume.after-commit");
        tracing::info!(volume.id = %id, name = %record.name, pool = %record.pool,
            size = record.size, backing = ?record.backing, "volume created");
        Ok(record)
    }

    /// A retry of a create that already succeeded: the same volume if the request
    /// matches it, ALREADY_EXISTS otherwise.
    pub(crate) fn same_volume(
        &self,
        existing: VolumeRecord,
        req: &CreateVolume,
        params: &VolumeParams,
        backing: Backing,
    ) -> Result<VolumeRecord> {
        let conflict = |what: &str| {
            Err(Error::AlreadyExists(format!(
                "volume {:?} exists already with another {what}",
                req.name
            )))
        };
        if !req.capacity.admits(existing.size) {
            return conflict("size");
        }
        if existing.pool != params.pool || existing.backing != backing {
            return conflict("pool or kind");
        }
        if existing.parameters != req.parameters {
            return conflict("set of parameters");
        }
        if existing.source != req.source {
            return conflict("content source");
        }
        let block = |caps: &[Capability]| caps.iter().any(Capability::is_block);
        if block(&existing.capabilities) != block(&req.capabilities) {
            return conflict("access type");
        }
        if let (Some(fs), Some(want)) = (
            &existing.fs_type,
            req.capabilities.iter().find_map(|c| c.fs_type()),
        ) {
            if fs != want && existing.source.is_none() {
                return conflict("filesystem");
            }
        }
        Ok(existing)
    }
}
