//! The controller's operations on volumes: create (empty, from a snapshot, from a
//! volume), delete, expand, publish, list, get, capacity, validate and modify; and
//! the start-up repair of what a crash left half-done.
//!
//! Every multi-step operation writes its intent into the volume's record first
//! (state Creating or Deleting, or a pending size), then changes the pool, then
//! commits the record. Start-up rolls Creating back, finishes Deleting and pending
//! expansions, and removes pool data that no record accounts for.

use std::collections::BTreeMap;
use std::path::Path;

use csi_sys::{btrfs, file, xattr};

use crate::core::fresh;
use crate::data::parse_token;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::health::{data_problems, Problems, Severity, VolumeHealth, VolumeHealthPage};
use crate::ids::{validate_name, VolumeId};
use crate::model::*;
use crate::pool::{Pool, DEFAULT_POOL};
use crate::settings::{attr_name, parse_settings, record_size};
use crate::Controller;

pub use crate::model::{minimum_size, DEFAULT_SIZE, GIB, K8S_PREFIX, KIB, MIB};

/// Parameters of CreateVolume (the StorageClass's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeParams {
    pub pool: String,
    pub kind: VolumeKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeKind {
    Image,
    Dir,
}

/// Accepted StorageClass parameter keys, besides the `csi.storage.k8s.io/` prefix.
pub const PARAMETERS: [&str; 2] = ["type", "kind"];

pub fn parse_parameters(p: &BTreeMap<String, String>) -> Result<VolumeParams> {
    for k in p.keys() {
        if !PARAMETERS.contains(&k.as_str()) && !k.starts_with(K8S_PREFIX) {
            return Err(Error::invalid(format!(
                "unknown parameter {k:?}; accepted: type (the pool), kind (image or dir), and \
                 keys beginning {K8S_PREFIX}"
            )));
        }
    }
    let kind = match p.get("kind").map(String::as_str) {
        None | Some("") | Some("image") => VolumeKind::Image,
        Some("dir") => VolumeKind::Dir,
        Some(other) => {
            return Err(Error::invalid(format!(
                "parameter kind={other:?} is not one of image, dir"
            )))
        }
    };
    let pool = match p.get("type").map(String::as_str) {
        None | Some("") => DEFAULT_POOL.to_string(),
        Some(t) => t.to_string(),
    };
    Ok(VolumeParams { pool, kind })
}

#[derive(Debug, Clone, Default)]
pub struct CreateVolume {
    pub name: String,
    pub capacity: CapacityRange,
    pub capabilities: Vec<Capability>,
    pub parameters: BTreeMap<String, String>,
    pub mutable_parameters: BTreeMap<String, String>,
    pub source: Option<ContentSource>,
    /// accessibility_requirements.requisite, each a topology segment.
    pub requisite: Vec<BTreeMap<String, String>>,
    pub preferred: Vec<BTreeMap<String, String>>,
}

/// What the Controller service answers about a volume.
#[derive(Debug, Clone)]
pub struct VolumeInfo {
    pub record: VolumeRecord,
    pub context: BTreeMap<String, String>,
}

/// A page of ListVolumes.
pub struct VolumePage {
    pub volumes: Vec<VolumeInfo>,
    pub next_token: Option<String>,
}

pub struct Capacity {
    pub available: u64,
    pub maximum_volume_size: u64,
    pub minimum_volume_size: u64,
}

impl Controller {
    fn check_capabilities(&self, caps: &[Capability]) -> Result<()> {
        if caps.is_empty() {
            return Err(Error::invalid("volume_capabilities are required"));
        }
        for c in caps {
            if let Some(why) = c.unsupported_reason() {
                return Err(Error::invalid(why));
            }
        }
        Ok(())
    }

    pub(crate) fn check_mutable(&self, m: &BTreeMap<String, String>) -> Result<()> {
        for (k, v) in m {
            if !self.cfg.mutable_parameters.iter().any(|a| a == k) {
                return Err(Error::invalid(format!(
                    "unknown mutable parameter {k:?}; accepted: {}",
                    self.cfg.mutable_parameters.join(", ")
                )));
            }
            let ok = match k.as_str() {
                "directIO" => v == "true" || v == "false",
                "readAheadKiB" => v.parse::<u32>().is_ok_and(|n| n <= 65536),
                "compression" => ["zstd", "lzo", "zlib", "none"].contains(&v.as_str()),
                _ => false,
            };
            if !ok {
                return Err(Error::invalid(format!(
                    "mutable parameter {k}={v:?} is invalid (directIO: true|false; \
                     readAheadKiB: 0..65536; compression: zstd|lzo|zlib|none)"
                )));
            }
        }
        Ok(())
    }

    /// Checks that every mutable parameter means something for this kind of volume.
    pub(crate) fn check_mutable_applies(
        backing: Backing,
        m: &BTreeMap<String, String>,
    ) -> Result<()> {
        for k in m.keys() {
            let applies = match backing {
                Backing::Image => k == "directIO" || k == "readAheadKiB",
                Backing::Subvolume => k == "compression",
                Backing::Directory => false,
            };
            if !applies {
                return Err(Error::invalid(format!(
                    "mutable parameter {k} does not apply to a {} volume (image volumes take \
                     directIO and readAheadKiB; kind=dir volumes on btrfs take compression)",
                    match backing {
                        Backing::Image => "kind=image",
                        Backing::Subvolume => "kind=dir (btrfs subvolume)",
                        Backing::Directory => "kind=dir on a non-btrfs pool",
                    }
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn topology_allows(&self, segments: &[BTreeMap<String, String>]) -> bool {
        let mine = self.topology();
        segments.is_empty() || segments.contains(&mine)
    }

    /// The size to make for a request, or OUT_OF_RANGE.
    fn size_for(&self, range: CapacityRange, fs: Option<&str>, at_least: u64) -> Result<u64> {
        range.validate()?;
        let limit = (range.limit > 0).then_some(range.limit as u64);
        let mut size = if range.required > 0 {
            range.required as u64
        } else {
            at_least.max(limit.map_or(DEFAULT_SIZE, |l| l.min(DEFAULT_SIZE)))
        };
        size = size.max(minimum_size(fs)).max(at_least);
        let rounded = size.div_ceil(MIB).saturating_mul(MIB);
        let size = match limit {
            Some(l) if rounded > l => size.div_ceil(4096).saturating_mul(4096),
            _ => rounded,
        };
        if let Some(l) = limit {
            if size > l {
                return Err(Error::OutOfRange(format!(
                    "a volume of at least {size} bytes is needed (filesystem minimum {} bytes, \
                     source {at_least} bytes) but limit_bytes is {l}",
                    minimum_size(fs)
                )));
            }
        }
        Ok(size)
    }

    pub fn create_volume(&self, req: CreateVolume) -> Result<VolumeInfo> {
        validate_name("volume", &req.name)?;
        self.check_capabilities(&req.capabilities)?;
        req.capacity.validate()?;
        let params = parse_parameters(&req.parameters)?;
        self.check_mutable(&req.mutable_parameters)?;
        let pool = self.pool(&params.pool)?.clone();
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
        let mut fs_type = match backing {
            Backing::Image if req.capabilities.iter().all(Capability::is_block) => None,
            Backing::Image => Some(
                fs_types
                    .first()
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| self.cfg.default_fstype.clone()),
            ),
            _ => None,
        };

        let id = VolumeId::for_name(&req.name);
        let mut keys = vec![format!("volume:{id}")];
        // A snapshot does not change while it is read, so restores from one
        // snapshot share it; a live source volume is frozen for the copy, one at a time.
        let mut shared = Vec::new();
        let source = req.source;
        match source {
            Some(ContentSource::Snapshot(s)) => shared.push(format!("snapshot:{s}")),
            Some(ContentSource::Volume(v)) => keys.push(format!("volume:{v}")),
            None => {}
        }
        let _guard = self.locks.try_lock_with(keys, shared)?;

        if let Some(existing) = self.volumes.get(id) {
            if existing.state == RecordState::Ready {
                return self.same_volume(existing, &req, &params, backing);
            }
            // An earlier attempt failed or crashed part-way: start over.
            self.roll_back_volume(&existing)?;
        }

        // The source decides the least size, the filesystem and the data.
        let (src_path, at_least) = match source {
            None => (None, 0),
            Some(src) => {
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
                if let (Some(want), Some(have)) = (&fs_type, &src_fs) {
                    if want != have && !fs_types.is_empty() {
                        return Err(Error::invalid(format!(
                            "the content source holds {have}, not the requested {want}"
                        )));
                    }
                }
                if src_fs.is_some() {
                    fs_type = src_fs;
                }
                (Some((src_path, src_backing)), src_size)
            }
        };
        let size = self.size_for(req.capacity, fs_type.as_deref(), at_least)?;
        if at_least > 0 && req.capacity.limit > 0 && at_least > req.capacity.limit as u64 {
            return Err(Error::OutOfRange(format!(
                "the content source is {at_least} bytes, more than limit_bytes {}",
                req.capacity.limit
            )));
        }
        let (available, total) = pool.space()?;
        // No volume, not even an unenforced directory, can be larger than its pool.
        if size > total {
            return Err(Error::OutOfRange(format!(
                "{size} bytes exceeds the largest volume pool {} can hold ({total} bytes)",
                pool.name
            )));
        }
        if size > available && backing != Backing::Directory {
            return Err(Error::ResourceExhausted(format!(
                "pool {} has {available} bytes free; {size} were asked for",
                pool.name
            )));
        }

        let record = VolumeRecord {
            id,
            name: req.name.clone(),
            pool: pool.name.clone(),
            backing,
            size,
            fs_type,
            capabilities: req.capabilities.clone(),
            parameters: req.parameters.clone(),
            mutable_parameters: req.mutable_parameters.clone(),
            source,
            created: Timestamp::now(),
            state: RecordState::Ready,
            pending_size: None,
            published: BTreeMap::new(),
            ephemeral: false,
        };
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
            &pool,
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
        Ok(self.info(record))
    }

    /// A retry of a create that already succeeded: the same volume if the request
    /// matches it, ALREADY_EXISTS otherwise.
    fn same_volume(
        &self,
        existing: VolumeRecord,
        req: &CreateVolume,
        params: &VolumeParams,
        backing: Backing,
    ) -> Result<VolumeInfo> {
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
        Ok(self.info(existing))
    }

    /// The pool, path, backing, size and filesystem of a content source.
    fn source_data(
        &self,
        src: ContentSource,
    ) -> Result<(String, std::path::PathBuf, Backing, u64, Option<String>)> {
        match src {
            ContentSource::Snapshot(sid) => {
                let s = self
                    .snapshots
                    .get(sid)
                    .filter(|s| s.state == RecordState::Ready)
                    .ok_or_else(|| {
                        Error::not_found(format!("source snapshot {sid} does not exist"))
                    })?;
                let pool = self.pool(&s.pool)?;
                Ok((
                    s.pool.clone(),
                    pool.snapshot_path(sid, s.backing),
                    s.backing,
                    s.size,
                    s.fs_type,
                ))
            }
            ContentSource::Volume(vid) => {
                let v = self
                    .volumes
                    .get(vid)
                    .filter(|v| v.state == RecordState::Ready)
                    .ok_or_else(|| {
                        Error::not_found(format!("source volume {vid} does not exist"))
                    })?;
                let pool = self.pool(&v.pool)?;
                Ok((
                    v.pool.clone(),
                    pool.volume_path(vid, v.backing, false),
                    v.backing,
                    v.size,
                    v.fs_type,
                ))
            }
        }
    }

    /// Makes the data of a new volume: an empty sparse image or directory, or a copy
    /// (reflink where the pool can) of a source.
    fn make_volume_data(
        &self,
        pool: &Pool,
        rec: &VolumeRecord,
        source: Option<(&Path, Backing)>,
    ) -> Result<()> {
        let path = pool.volume_path(rec.id, rec.backing, rec.ephemeral);
        let at = || format!("making volume {} at {}", rec.id, path.display());
        match (rec.backing, source) {
            // Its record alone makes it durable (see core::fresh).
            (Backing::Image, None) if fresh::is_fresh_image(rec) => return fresh::make(&path, rec),
            (Backing::Image, None) => file::create_sparse(&path, rec.size).context(at)?,
            (Backing::Image, Some((src, _))) => {
                // A live source is frozen while it is copied, so the copy is a
                // consistent filesystem; a snapshot does not change.
                // The slot is taken before the freeze, so a frozen source never waits
                // for another copy to finish.
                let copy = || file::copy_file(src, &path).context(at);
                let reflinked = match rec.source {
                    Some(ContentSource::Volume(v)) => {
                        self.heavy(|| self.with_frozen(&[(v, src.to_path_buf())], copy))??
                    }
                    _ => self.heavy(copy)??,
                };
                failpoint::hit("create-volume.after-copy");
                file::grow(&path, rec.size).context(at)?;
                tracing::debug!(volume.id = %rec.id, reflinked, "image copied");
            }
            (Backing::Subvolume, None) => {
                btrfs::subvolume_create(&path).context(at)?;
                btrfs::qgroup_limit(&path, rec.size).context(at)?;
            }
            (Backing::Subvolume, Some((src, _))) => {
                btrfs::subvolume_snapshot(src, &path, false).context(at)?;
                failpoint::hit("create-volume.after-copy");
                btrfs::qgroup_limit(&path, rec.size).context(at)?;
            }
            (Backing::Directory, None) => {
                file::mkdir_p_mode(&path, 0o755).context(at)?;
                record_size(&path, rec.size)?;
            }
            (Backing::Directory, Some((src, _))) => {
                self.heavy(|| file::copy_tree(src, &path))?.context(at)?;
                failpoint::hit("create-volume.after-copy");
                record_size(&path, rec.size)?;
            }
        }
        self.write_attributes(&path, rec.backing, &rec.mutable_parameters)?;
        Ok(())
    }

    /// Applies a volume's mutable attributes to its data: an image keeps them as
    /// xattrs, where the node reads them at stage; a subvolume takes its btrfs
    /// compression property at once.
    pub(crate) fn write_attributes(
        &self,
        path: &Path,
        backing: Backing,
        m: &BTreeMap<String, String>,
    ) -> Result<()> {
        for (k, v) in m {
            match backing {
                Backing::Subvolume => btrfs::set_compression(path, v)
                    .context(|| format!("setting compression={v} on {}", path.display()))?,
                _ => xattr::set(path, &attr_name(k), v.as_bytes())
                    .context(|| format!("recording {k} on {}", path.display()))?,
            }
        }
        if !m.is_empty() && backing != Backing::Subvolume {
            // The record written next must not outlive the attributes it names.
            file::sync_path(path).context(|| format!("syncing {}", path.display()))?;
        }
        Ok(())
    }

    /// Removes the data of a volume (whatever state it is in) and its record.
    fn roll_back_volume(&self, rec: &VolumeRecord) -> Result<()> {
        self.remove_volume_data(rec.id, false)?;
        self.volumes.remove(rec.id)
    }

    pub fn delete_volume(&self, volume_id: &str) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        // An id this driver never issued names nothing: deleting it succeeds.
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let _guard = self.locks.try_lock([format!("volume:{id}")])?;
        // The volume's lock, shared with the node: no stage can begin while the
        // volume is deleted, and the staged mark read here stays true.
        let volume = self.state.lock_volume(id)?;
        failpoint::hit("delete-volume.after-volume-lock");
        let Some(rec) = self.volumes.get(id) else {
            self.remove_volume_data(id, false)?;
            return volume.remove();
        };
        if let Some(node) = rec.published.keys().next() {
            return Err(Error::precondition(format!(
                "volume {id} is still published to node {node}; unpublish it first"
            )));
        }
        if volume.is_staged() {
            return Err(Error::precondition(format!(
                "volume {id} is staged on node {}; unstage it first",
                self.cfg.node_id
            )));
        }
        let pool = self.pool(&rec.pool)?;
        let path = pool.volume_path(id, rec.backing, false);
        // The staged mark answers for the node's own devices; a device attached
        // otherwise holds the image open, which the kernel tells without a look at
        // every device.
        if rec.backing == Backing::Image
            && self
                .sys
                .loops
                .may_serve(&path)
                .context(|| format!("asking whether {} is in use", path.display()))?
        {
            let attached = self
                .sys
                .loops
                .find(&path)
                .context(|| "listing loop devices".into())?;
            if let Some(dev) = attached.first() {
                return Err(Error::precondition(format!(
                    "volume {id} is in use on this node through {}; unstage it first",
                    dev.device.display()
                )));
            }
        }
        // The record goes first, in one journal write: a crash after it leaves data
        // that no record accounts for, which start-up removes, so removing the data
        // needs no sync of its own.
        self.volumes.remove(id)?;
        failpoint::hit("delete-volume.after-commit");
        self.drop_volume_data(id)?;
        failpoint::hit("delete-volume.after-data");
        volume.remove()?;
        tracing::info!(volume.id = %id, name = %rec.name, "volume deleted");
        Ok(())
    }

    fn existing_volume(&self, volume_id: &str) -> Result<VolumeRecord> {
        let id = VolumeId::parse_existing(volume_id)?;
        self.volumes
            .get(id)
            .filter(|r| r.state == RecordState::Ready)
            .ok_or_else(|| Error::not_found(format!("volume {id} does not exist")))
    }

    /// Grows a volume; returns the new size and whether the node must grow it too.
    pub fn expand_volume(
        &self,
        volume_id: &str,
        range: CapacityRange,
        capability: Option<&Capability>,
    ) -> Result<(u64, bool)> {
        let id = VolumeId::parse_existing(volume_id)?;
        range.validate()?;
        if range.required <= 0 && range.limit <= 0 {
            return Err(Error::invalid("capacity_range is required"));
        }
        if let Some(c) = capability {
            if let Some(why) = c.unsupported_reason() {
                return Err(Error::invalid(why));
            }
        }
        let _guard = self.locks.try_lock([format!("volume:{id}")])?;
        let mut rec = self.existing_volume(volume_id)?;
        if capability.is_some_and(|c| c.is_block()) && rec.backing != Backing::Image {
            return Err(Error::invalid(
                "block access is not possible on a kind=dir volume",
            ));
        }
        let node_grows = rec.backing == Backing::Image;
        let want = if range.required > 0 {
            range.required
        } else {
            range.limit
        } as u64;
        if want <= rec.size {
            return Ok((rec.size, node_grows));
        }
        let new = self.size_for(range, rec.fs_type.as_deref(), 0)?;
        let pool = self.pool(&rec.pool)?.clone();
        let (available, total) = pool.space()?;
        if new > total {
            return Err(Error::OutOfRange(format!(
                "{new} bytes exceeds the largest volume pool {} can hold ({total} bytes)",
                pool.name
            )));
        }
        if rec.backing != Backing::Directory && new - rec.size > available {
            return Err(Error::ResourceExhausted(format!(
                "pool {} has {available} bytes free; growing by {} was asked",
                pool.name,
                new - rec.size
            )));
        }
        rec.pending_size = Some(new);
        self.volumes.put(&rec)?;
        failpoint::hit("expand-volume.after-intent");
        self.apply_size(&pool, &rec, new)?;
        failpoint::hit("expand-volume.after-grow");
        rec.size = new;
        rec.pending_size = None;
        self.volumes.put(&rec)?;
        tracing::info!(volume.id = %id, size = new, "volume expanded");
        Ok((new, node_grows))
    }

    fn apply_size(&self, pool: &Pool, rec: &VolumeRecord, size: u64) -> Result<()> {
        let path = pool.volume_path(rec.id, rec.backing, rec.ephemeral);
        let at = || format!("growing volume {} to {size} bytes", rec.id);
        match rec.backing {
            Backing::Image => file::grow(&path, size).context(at),
            Backing::Subvolume => btrfs::qgroup_limit(&path, size).context(at),
            Backing::Directory => record_size(&path, size),
        }
    }

    /// What the controller can see of a volume: its data in its pool.
    fn problems(&self, rec: &VolumeRecord) -> Problems {
        let Ok(pool) = self.pool(&rec.pool) else {
            let mut out = Problems::default();
            out.push(
                Severity::Inaccessible,
                "PoolNotConfigured",
                format!(
                    "the volume's pool {} is not configured on this node",
                    rec.pool
                ),
            );
            return out;
        };
        let path = pool.volume_path(rec.id, rec.backing, rec.ephemeral);
        data_problems(&path, rec.backing, Some(rec.size))
    }

    /// ControllerGetVolumeHealth.
    pub fn volume_health(&self, volume_id: &str) -> Result<VolumeHealth> {
        let rec = self.existing_volume(volume_id)?;
        Ok(VolumeHealth {
            volume_id: volume_id.to_string(),
            problems: self.problems(&rec),
        })
    }

    /// ControllerListVolumeHealth: the volumes with a problem, paginated as
    /// ListVolumes is (a token is the last volume id of the previous page).
    pub fn list_volume_health(
        &self,
        max_entries: i32,
        starting_token: &str,
    ) -> Result<VolumeHealthPage> {
        if max_entries < 0 {
            return Err(Error::invalid("max_entries must not be negative"));
        }
        let after = parse_token::<VolumeId>(starting_token, VolumeId::parse)?;
        // Checked outside the store's lock: the checks read files (and run btrfs
        // for subvolumes), which must not hold up writers.
        let mut volumes = Vec::new();
        let mut next_token = None;
        let candidates = self
            .volumes
            .all()
            .into_iter()
            .filter(|r| r.state == RecordState::Ready && after.is_none_or(|a| r.id > a));
        for r in candidates {
            let problems = self.problems(&r);
            if problems.is_empty() {
                continue;
            }
            if max_entries > 0 && volumes.len() == max_entries as usize {
                next_token = volumes.last().map(|v: &VolumeHealth| v.volume_id.clone());
                break;
            }
            volumes.push(VolumeHealth {
                volume_id: r.id.to_string(),
                problems,
            });
        }
        Ok(VolumeHealthPage {
            volumes,
            next_token,
        })
    }

    fn info(&self, record: VolumeRecord) -> VolumeInfo {
        let mut context = BTreeMap::from([
            ("pool".to_string(), record.pool.clone()),
            (
                "kind".to_string(),
                match record.backing {
                    Backing::Image => "image",
                    _ => "dir",
                }
                .to_string(),
            ),
        ]);
        if let Some(fs) = &record.fs_type {
            context.insert("fsType".into(), fs.clone());
        }
        VolumeInfo { context, record }
    }

    pub fn get_volume(&self, volume_id: &str) -> Result<VolumeInfo> {
        let rec = self.existing_volume(volume_id)?;
        Ok(self.info(rec))
    }

    pub fn list_volumes(&self, max_entries: i32, starting_token: &str) -> Result<VolumePage> {
        if max_entries < 0 {
            return Err(Error::invalid("max_entries must not be negative"));
        }
        let after = parse_token::<VolumeId>(starting_token, VolumeId::parse)?;
        let (records, more) = self.volumes.page(after, max_entries as usize, |r| {
            r.state == RecordState::Ready
        });
        let next_token = if more {
            records.last().map(|r| r.id.to_string())
        } else {
            None
        };
        let volumes = records.into_iter().map(|r| self.info(r)).collect();
        Ok(VolumePage {
            volumes,
            next_token,
        })
    }

    pub fn get_capacity(
        &self,
        parameters: &BTreeMap<String, String>,
        capabilities: &[Capability],
        topology: Option<&BTreeMap<String, String>>,
    ) -> Result<Capacity> {
        let params = parse_parameters(parameters)?;
        let pool = self.pool(&params.pool)?;
        let fs = capabilities.iter().find_map(|c| c.fs_type());
        let minimum = if params.kind == VolumeKind::Dir {
            0
        } else {
            minimum_size(fs)
        };
        let unsupported = capabilities
            .iter()
            .any(|c| c.unsupported_reason().is_some())
            || (params.kind == VolumeKind::Dir && capabilities.iter().any(Capability::is_block));
        let elsewhere = topology.is_some_and(|t| *t != self.topology());
        if unsupported || elsewhere {
            return Ok(Capacity {
                available: 0,
                maximum_volume_size: 0,
                minimum_volume_size: minimum,
            });
        }
        let (available, _) = pool.space()?;
        Ok(Capacity {
            available,
            maximum_volume_size: available,
            minimum_volume_size: minimum,
        })
    }

    /// ValidateVolumeCapabilities: None when confirmed, else the reason.
    pub fn validate_capabilities(
        &self,
        volume_id: &str,
        caps: &[Capability],
        parameters: &BTreeMap<String, String>,
        mutable: &BTreeMap<String, String>,
    ) -> Result<Option<String>> {
        let rec = self.existing_volume(volume_id)?;
        if caps.is_empty() {
            return Err(Error::invalid("volume_capabilities are required"));
        }
        for c in caps {
            if let Some(why) = c.unsupported_reason() {
                return Ok(Some(why));
            }
            if c.is_block() && rec.backing != Backing::Image {
                return Ok(Some(
                    "block access is not possible on a kind=dir volume".into(),
                ));
            }
            if let (Some(want), Some(have)) = (c.fs_type(), &rec.fs_type) {
                if want != have {
                    return Ok(Some(format!("the volume holds {have}, not {want}")));
                }
            }
        }
        if !parameters.is_empty() && *parameters != rec.parameters {
            return Ok(Some("parameters differ from the volume's".into()));
        }
        if !mutable.is_empty() && *mutable != rec.mutable_parameters {
            return Ok(Some("mutable_parameters differ from the volume's".into()));
        }
        Ok(None)
    }

    /// ControllerPublishVolume: records the publication; returns the publish context.
    pub fn publish_volume(
        &self,
        volume_id: &str,
        node_id: &str,
        capability: Option<&Capability>,
        read_only: bool,
    ) -> Result<BTreeMap<String, String>> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        if node_id.is_empty() {
            return Err(Error::invalid("node_id is required"));
        }
        let cap = capability.ok_or_else(|| Error::invalid("volume_capability is required"))?;
        if let Some(why) = cap.unsupported_reason() {
            return Err(Error::invalid(why));
        }
        let id = VolumeId::parse_existing(volume_id)?;
        let _guard = self.locks.try_lock([format!("volume:{id}")])?;
        let mut rec = self.existing_volume(volume_id)?;
        // A single-node volume published elsewhere is the wrong state, whichever node
        // is asked for now; checked first so that the answer says so.
        if let Some(other) = rec.published.keys().find(|n| *n != node_id) {
            return Err(Error::precondition(format!(
                "volume {id} is published to node {other} already"
            )));
        }
        if node_id != self.cfg.node_id {
            return Err(Error::not_found(format!(
                "node {node_id:?} is not known to this driver; volumes here are local to \
                 node {}",
                self.cfg.node_id
            )));
        }
        if cap.is_block() && rec.backing != Backing::Image {
            return Err(Error::invalid(
                "block access is not possible on a kind=dir volume",
            ));
        }
        match rec.published.get(node_id) {
            Some(p) if p.read_only != read_only || p.block != cap.is_block() => {
                return Err(Error::AlreadyExists(format!(
                    "volume {id} is published to {node_id} already, with readonly={} and {} \
                     access",
                    p.read_only,
                    if p.block { "block" } else { "mount" }
                )))
            }
            Some(_) => {}
            None => {
                let max = self.cfg.max_volumes_per_node;
                if max > 0 {
                    let (on_node, _) = self
                        .volumes
                        .page(None, 0, |v| v.published.contains_key(node_id));
                    if on_node.len() as u64 >= max {
                        return Err(Error::ResourceExhausted(format!(
                            "node {node_id} has {max} volumes published, its limit"
                        )));
                    }
                }
                rec.published.insert(
                    node_id.to_string(),
                    Publication {
                        read_only,
                        block: cap.is_block(),
                    },
                );
                self.volumes.put(&rec)?;
            }
        }
        Ok(BTreeMap::from([
            ("pool".to_string(), rec.pool.clone()),
            ("readonly".to_string(), read_only.to_string()),
        ]))
    }

    pub fn unpublish_volume(&self, volume_id: &str, node_id: &str) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let _guard = self.locks.try_lock([format!("volume:{id}")])?;
        let Some(mut rec) = self.volumes.get(id) else {
            return Ok(());
        };
        let before = rec.published.len();
        if node_id.is_empty() {
            rec.published.clear();
        } else {
            rec.published.remove(node_id);
        }
        if rec.published.len() != before {
            self.volumes.put(&rec)?;
        }
        Ok(())
    }

    /// ControllerModifyVolume: validates every parameter before changing anything,
    /// then changes all or nothing. An image volume staged here gets the new values
    /// on its loop devices at once (elsewhere at its next stage); when they cannot
    /// be applied, the call fails and the volume keeps its old ones. Only the node
    /// domain reaches loop devices: a controller process without it refuses to
    /// change an image volume the node has staged, rather than answer for a change
    /// the volume does not have.
    pub fn modify_volume(&self, volume_id: &str, m: &BTreeMap<String, String>) -> Result<()> {
        let id = VolumeId::parse_existing(volume_id)?;
        self.check_mutable(m)?;
        let _guard = self.locks.try_lock([format!("volume:{id}")])?;
        // The volume's lock too: a stage running now could attach with the values
        // it read before this change. Only for a volume that exists: a call about
        // another leaves no lock file.
        let mut rec = self.existing_volume(volume_id)?;
        let volume = self.state.lock_volume(id)?;
        Self::check_mutable_applies(rec.backing, m)?;
        let pool = self.pool(&rec.pool)?.clone();
        let path = pool.volume_path(id, rec.backing, false);
        let undo = match rec.backing {
            Backing::Image => Some(self.change_image_settings(&path, m, volume.is_staged())?),
            _ => {
                self.write_attributes(&path, rec.backing, m)?;
                None
            }
        };
        failpoint::hit("modify-volume.after-attributes");
        for (k, v) in m {
            rec.mutable_parameters.insert(k.clone(), v.clone());
        }
        if let Err(e) = self.volumes.put(&rec) {
            return Err(match undo {
                Some(u) => e.with_cleanup(self.restore_image_settings(&u)),
                None => e,
            });
        }
        failpoint::hit("modify-volume.after-commit");
        Ok(())
    }

    /// Records new values of an image volume's mutable attributes on its file and
    /// gives them to the loop devices serving it now, through the node domain of
    /// this process. All or nothing: when a step fails, what the steps before it
    /// changed is put back, and the error tells what failed.
    fn change_image_settings(
        &self,
        image: &Path,
        values: &BTreeMap<String, String>,
        staged: bool,
    ) -> Result<ImageSettingsBefore> {
        let wanted = parse_settings(values)?;
        // Whether a loop device serves the image, without a look at every device;
        // the node finds which from its record.
        let attached = self
            .sys
            .loops
            .may_serve(image)
            .context(|| format!("finding the loop devices of {}", image.display()))?;
        let live = self.live_devices();
        if (staged || attached) && live.is_none() {
            return Err(Error::precondition(format!(
                "the volume is staged on node {}, and this controller process cannot change \
                 the loop device serving it (only the node plugin can); nothing was changed: \
                 change it while it is not staged, or run the driver with --mode all",
                self.cfg.node_id
            )));
        }
        let mut attributes = Vec::new();
        for key in values.keys() {
            let old = xattr::get(image, &attr_name(key))
                .context(|| format!("reading the {key} attribute of {}", image.display()))?;
            attributes.push((key.clone(), old));
        }
        let mut before = ImageSettingsBefore {
            image: image.to_path_buf(),
            attributes,
            devices: Vec::new(),
        };
        let recorded = values
            .iter()
            .try_for_each(|(key, v)| {
                xattr::set(image, &attr_name(key), v.as_bytes())
                    .context(|| format!("recording {key}={v} on {}", image.display()))
            })
            // Durable before the record that names them is written.
            .and_then(|()| {
                file::sync_path(image).context(|| format!("syncing {}", image.display()))
            });
        let applied = recorded.and_then(|()| match live {
            Some(live) if attached => live.apply_live(image, wanted),
            _ => Ok(Vec::new()),
        });
        match applied {
            Ok(devices) => {
                before.devices = devices;
                Ok(before)
            }
            Err(e) => Err(e.with_cleanup(self.restore_image_settings(&before))),
        }
    }

    /// Puts an image's attributes and its loop devices' settings back as they were.
    /// Every step is tried; the first failure is returned.
    fn restore_image_settings(&self, before: &ImageSettingsBefore) -> Result<()> {
        let mut result = Ok(());
        if let Some(live) = self.live_devices() {
            result = result.and(live.restore_live(&before.devices));
        }
        for (key, old) in &before.attributes {
            let name = attr_name(key);
            let put = match old {
                Some(v) => xattr::set(&before.image, &name, v),
                None => xattr::remove(&before.image, &name),
            };
            result = result
                .and(put.context(|| format!("putting {key} back on {}", before.image.display())));
        }
        result
    }

    /// Start-up: roll back creations, finish deletions and expansions, then remove
    /// pool data that no record accounts for.
    pub(crate) fn recover_volumes(&self) -> Result<()> {
        let made = self.volumes.created_in_journal().into_iter();
        self.repair_fresh_images(made.filter_map(|id| self.volumes.get(id)));
        let unfinished = self
            .volumes
            .select(|r| r.state != RecordState::Ready || r.pending_size.is_some());
        for rec in unfinished {
            // A record that cannot be repaired now stays as it is: it is not listed
            // (Creating, Deleting) and a retry of its call repairs it, so one bad
            // record never keeps the driver from starting.
            let repaired = match (rec.state, rec.pending_size) {
                (RecordState::Creating | RecordState::Deleting, _) => {
                    tracing::warn!(volume.id = %rec.id, state = ?rec.state,
                        "removing a volume an interrupted create or delete left");
                    self.roll_back_volume(&rec)
                }
                (RecordState::Ready, Some(size)) => {
                    tracing::warn!(volume.id = %rec.id, size, "finishing an interrupted expansion");
                    self.pool(&rec.pool)
                        .and_then(|pool| self.apply_size(pool, &rec, size))
                        .and_then(|()| {
                            let mut done = rec.clone();
                            done.size = size.max(rec.size);
                            done.pending_size = None;
                            self.volumes.put(&done)
                        })
                }
                _ => Ok(()),
            };
            if let Err(e) = repaired {
                tracing::error!(volume.id = %rec.id, error = %e,
                    "could not repair the volume at start; a retry of its call will");
            }
        }
        for pool in self.pools.values() {
            self.remove_orphans(&pool.volumes_dir(), |stem| {
                VolumeId::parse(stem).is_some_and(|id| self.volumes.contains(id))
                    || self.volumes.is_quarantined(stem)
            })?;
        }
        Ok(())
    }
}

/// An image's attributes and its loop devices' settings before a change.
struct ImageSettingsBefore {
    image: std::path::PathBuf,
    attributes: Vec<(String, Option<Vec<u8>>)>,
    devices: crate::settings::DevicesBefore,
}
