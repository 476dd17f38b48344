//! Snapshots and group snapshots. A snapshot of an image volume is a reflink of the
//! image where the pool can (O(1) in time and space) and a sparse copy elsewhere; a
//! snapshot of a btrfs subvolume is a read-only btrfs snapshot; of a plain
//! directory, a copy of the tree. Staged filesystems are frozen during the copy,
//! unless the snapshot class asks for a crash-consistent snapshot ([`Consistency`]).
//! Snapshots never depend on their source, which may be deleted.

use std::collections::{BTreeMap, BTreeSet};

use csi_sys::{btrfs, file};

use crate::data::{drop_data, parse_token, remove_data, shorten};
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::{validate_name, GroupSnapshotId, SnapshotId, VolumeId};
use crate::locks::LockKey;
use crate::model::K8S_PREFIX;
use crate::model::*;
use crate::Controller;

pub struct SnapshotPage {
    pub snapshots: Vec<SnapshotRecord>,
    pub next_token: Option<String>,
}

pub struct GroupSnapshot {
    pub group: GroupSnapshotRecord,
    pub members: Vec<SnapshotRecord>,
}

/// How a snapshot of a volume in use is made: the snapshot class's
/// `consistency` parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consistency {
    /// The volume's filesystem frozen for the copy (the default): every write
    /// the filesystem took before the snapshot is in it, and it mounts
    /// without recovery. Its writers wait for the freeze (tens of
    /// milliseconds for xfs).
    Frozen,
    /// No freeze where the copy is one instant's (a reflink of the image, a
    /// btrfs snapshot): the snapshot holds what a power cut at that instant
    /// would leave, which the filesystem's journal recovers at the next
    /// mount; what an application had made durable (fsync) is in it, what it
    /// had not may be missing. A copy that takes time (a pool without
    /// reflinks) is frozen all the same, since unfrozen it would be torn.
    CrashConsistent,
}

/// The snapshot class parameter that chooses [`Consistency`].
pub const CONSISTENCY: &str = "consistency";

/// The consistency a (group) snapshot class asks for. Other keys than
/// `consistency` and the CO's `csi.storage.k8s.io/` ones are ignored, with a
/// warning naming them: Kubernetes' own storage suite, for one, puts the
/// class's `deletionPolicy` there.
pub fn snapshot_consistency(p: &BTreeMap<String, String>) -> Result<Consistency> {
    let unknown: Vec<String> = p
        .keys()
        .filter(|k| !k.starts_with(K8S_PREFIX) && k.as_str() != CONSISTENCY)
        .map(|k| shorten(k))
        .collect();
    if !unknown.is_empty() {
        tracing::warn!(parameters = ?unknown, "snapshot parameters this driver does not use; ignored");
    }
    match p.get(CONSISTENCY).map(String::as_str) {
        None | Some("") | Some("frozen") => Ok(Consistency::Frozen),
        Some("crash-consistent") => Ok(Consistency::CrashConsistent),
        Some(other) => Err(Error::invalid(format!(
            "snapshot parameter {CONSISTENCY}={:?} is not one of frozen, crash-consistent",
            shorten(other)
        ))),
    }
}

impl Controller {
    /// CreateSnapshot with accessibility requirements: a snapshot lives in its
    /// source volume's pool on this node, so a requisite that leaves this node
    /// out cannot be met (RESOURCE_EXHAUSTED, as for CreateVolume).
    pub fn create_snapshot_within(
        &self,
        name: &str,
        source_volume_id: &str,
        parameters: &BTreeMap<String, String>,
        requisite: &[BTreeMap<String, String>],
    ) -> Result<SnapshotRecord> {
        validate_name("snapshot", name)?;
        if source_volume_id.is_empty() {
            return Err(Error::invalid("source_volume_id is required"));
        }
        if !self.topology_allows(requisite) {
            return Err(Error::ResourceExhausted(format!(
                "accessibility_requirements.requisite does not include this node \
                 ({}={}); snapshots live in the pool of the node that takes them",
                crate::model::TOPOLOGY_KEY,
                self.cfg.node_id
            )));
        }
        self.create_snapshot(name, source_volume_id, parameters)
    }

    pub fn create_snapshot(
        &self,
        name: &str,
        source_volume_id: &str,
        parameters: &BTreeMap<String, String>,
    ) -> Result<SnapshotRecord> {
        validate_name("snapshot", name)?;
        if source_volume_id.is_empty() {
            return Err(Error::invalid("source_volume_id is required"));
        }
        let consistency = snapshot_consistency(parameters)?;
        let vid = VolumeId::parse_existing(source_volume_id)?;
        let sid = SnapshotId::for_name(name);
        let _guard = self
            .locks
            .try_lock([LockKey::Snapshot(sid), LockKey::Volume(vid)])?;
        if let Some(existing) = self.snapshots.get(sid) {
            if existing.state == RecordState::Ready {
                if existing.source_volume != vid {
                    return Err(Error::AlreadyExists(format!(
                        "snapshot {name:?} exists already, of volume {}",
                        existing.source_volume
                    )));
                }
                return Ok(existing);
            }
            self.roll_back_snapshot(&existing)?;
        }
        let vol = self
            .volumes
            .get(vid)
            .filter(|v| v.state == RecordState::Ready)
            .ok_or_else(|| Error::not_found(format!("source volume {vid} does not exist")))?;
        if vol.backing == crate::model::Backing::Image {
            crate::core::arrival::refuse_while_arriving(
                &self.pool(&vol.pool)?.volume_path(vid, vol.backing, false),
                "a snapshot of this volume",
            )?;
        }
        let mut rec = self.snapshot_record(sid, name.to_string(), &vol, None);
        // No intent record is written: the id comes from the name, so data that a
        // crash leaves without a record is found by the retry (removed just below)
        // or by the orphan sweep at start. One record write, after the data is
        // durable, is what makes the snapshot exist.
        self.remove_snapshot_data(&rec)?;
        failpoint::hit("create-snapshot.before-data");
        let made = self
            .pool(&vol.pool)
            .map(|p| p.volume_path(vid, vol.backing, false));
        // The heavy-operation slot is taken before the freeze: waiting for one
        // while frozen would stall the volume's writers for as long as other
        // copies take.
        let made = made.and_then(|src| {
            self.heavy(|| {
                if consistency == Consistency::CrashConsistent
                    && self.copy_at_an_instant(&vol, &rec)?
                {
                    return Ok(());
                }
                self.with_frozen(&[(vid, src)], || self.copy_to_snapshot(&vol, &rec))
            })?
        });
        if let Err(e) = made.and_then(|()| self.make_snapshot_durable(&rec)) {
            return Err(e.with_cleanup(self.remove_snapshot_data(&rec)));
        }
        failpoint::hit("create-snapshot.after-data");
        rec.state = RecordState::Ready;
        self.snapshots.put(&rec)?;
        failpoint::hit("create-snapshot.after-commit");
        tracing::info!(snapshot.id = %sid, volume.id = %vid, name, "snapshot created");
        Ok(rec)
    }

    fn snapshot_record(
        &self,
        id: SnapshotId,
        name: String,
        vol: &VolumeRecord,
        group: Option<GroupSnapshotId>,
    ) -> SnapshotRecord {
        SnapshotRecord {
            id,
            name,
            source_volume: vol.id,
            pool: vol.pool.clone(),
            backing: vol.backing,
            size: vol.size,
            fs_type: vol.fs_type.clone(),
            created: Timestamp::now(),
            state: RecordState::Creating,
            group,
            requested: vol.requested,
        }
    }

    /// Copies a volume's data into a snapshot (the caller takes a heavy-operation
    /// slot, then freezes). An image's reflink is made durable after the thaw
    /// ([`Self::make_snapshot_durable`]): the volume's writers need not wait for
    /// the sync.
    fn copy_to_snapshot(&self, vol: &VolumeRecord, snap: &SnapshotRecord) -> Result<()> {
        let pool = self.pool(&vol.pool)?;
        let src = pool.volume_path(vol.id, vol.backing, false);
        let dst = pool.snapshot_path(snap.id, snap.backing);
        let at = || format!("copying volume {} into snapshot {}", vol.id, snap.id);
        match vol.backing {
            Backing::Image => {
                let reflinked = file::copy_file_unsynced(&src, &dst).context(at)?;
                tracing::debug!(snapshot.id = %snap.id, reflinked, "image copied");
            }
            Backing::Subvolume => btrfs::subvolume_snapshot(&src, &dst, true).context(at)?,
            Backing::Directory => {
                file::copy_tree(&src, &dst).context(at)?;
            }
        }
        failpoint::hit("snapshot.after-copy");
        Ok(())
    }

    /// A crash-consistent snapshot's copy, made unfrozen where the copy is
    /// one instant's: a reflink of the image (FICLONE takes the image's inode
    /// lock and writes back its dirty pages first, so the copy holds every
    /// write the volume's loop device had made, and none half), a btrfs
    /// snapshot of a subvolume. False when it cannot be (no reflink here, a
    /// plain directory): the caller copies frozen.
    fn copy_at_an_instant(&self, vol: &VolumeRecord, snap: &SnapshotRecord) -> Result<bool> {
        let pool = self.pool(&vol.pool)?;
        let src = pool.volume_path(vol.id, vol.backing, false);
        let dst = pool.snapshot_path(snap.id, snap.backing);
        let at = || format!("copying volume {} into snapshot {}", vol.id, snap.id);
        match vol.backing {
            Backing::Image => match file::reflink_unsynced(&src, &dst) {
                Ok(()) => {}
                Err(e) if e.is_unsupported() => return Ok(false),
                Err(e) => return Err(e).context(at),
            },
            Backing::Subvolume => btrfs::subvolume_snapshot(&src, &dst, true).context(at)?,
            Backing::Directory => return Ok(false),
        }
        failpoint::hit("snapshot.after-copy");
        tracing::debug!(snapshot.id = %snap.id, "copied unfrozen (crash-consistent)");
        Ok(true)
    }

    /// Makes an image snapshot's copy durable, before its record names it (the
    /// other kinds are durable as they are made).
    fn make_snapshot_durable(&self, snap: &SnapshotRecord) -> Result<()> {
        if snap.backing != Backing::Image {
            return Ok(());
        }
        let path = self.pool(&snap.pool)?.snapshot_path(snap.id, snap.backing);
        file::make_new_file_durable(&path).context(|| format!("syncing snapshot {}", snap.id))
    }

    fn remove_snapshot_data(&self, rec: &SnapshotRecord) -> Result<()> {
        self.remove_snapshot_data_with(rec, remove_data)
    }

    /// Removes the data of a snapshot whose record is gone, without a sync: what
    /// a power loss brings back has no record, and start-up removes it.
    fn drop_snapshot_data(&self, rec: &SnapshotRecord) -> Result<()> {
        self.remove_snapshot_data_with(rec, drop_data)
    }

    fn remove_snapshot_data_with(
        &self,
        rec: &SnapshotRecord,
        remove: fn(&std::path::Path) -> Result<()>,
    ) -> Result<()> {
        let pool = self.pool(&rec.pool)?;
        let path = pool.snapshot_path(rec.id, rec.backing);
        remove(&path)?;
        remove(&crate::pool::Pool::tmp_path(&path))
    }

    fn roll_back_snapshot(&self, rec: &SnapshotRecord) -> Result<()> {
        self.remove_snapshot_data(rec)?;
        self.snapshots.remove(rec.id)
    }

    pub fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        if snapshot_id.is_empty() {
            return Err(Error::invalid("snapshot_id is required"));
        }
        let Some(sid) = SnapshotId::parse(snapshot_id) else {
            return Ok(());
        };
        let _guard = self.locks.try_lock([LockKey::Snapshot(sid)])?;
        let Some(rec) = self.snapshots.get(sid) else {
            for pool in self.pools.values() {
                for b in [Backing::Image, Backing::Directory] {
                    remove_data(&pool.snapshot_path(sid, b))?;
                }
            }
            return Ok(());
        };
        if let Some(g) = rec.group.filter(|g| self.groups.contains(*g)) {
            return Err(Error::precondition(format!(
                "snapshot {sid} belongs to group snapshot {g}; delete the group instead"
            )));
        }
        // The record goes first, in one journal write, then the data without a
        // sync of its folder: data a crash leaves (or a power loss brings back)
        // has no record, and the start-up sweep or a retry removes it.
        self.snapshots.remove(sid)?;
        failpoint::hit("delete-snapshot.after-commit");
        self.drop_snapshot_data(&rec)?;
        tracing::info!(snapshot.id = %sid, "snapshot deleted");
        Ok(())
    }

    pub fn get_snapshot(&self, snapshot_id: &str) -> Result<SnapshotRecord> {
        let sid = SnapshotId::parse_existing(snapshot_id)?;
        self.snapshots
            .get(sid)
            .filter(|s| s.state == RecordState::Ready)
            .ok_or_else(|| Error::not_found(format!("snapshot {sid} does not exist")))
    }

    pub fn list_snapshots(
        &self,
        max_entries: i32,
        starting_token: &str,
        snapshot_id: &str,
        source_volume_id: &str,
    ) -> Result<SnapshotPage> {
        if max_entries < 0 {
            return Err(Error::invalid("max_entries must not be negative"));
        }
        let after = parse_token(starting_token, SnapshotId::parse)?;
        let empty = SnapshotPage {
            snapshots: Vec::new(),
            next_token: None,
        };
        let want_source = match source_volume_id {
            "" => None,
            s => match VolumeId::parse(s) {
                Some(v) => Some(v),
                None => return Ok(empty),
            },
        };
        if !snapshot_id.is_empty() {
            let found = SnapshotId::parse(snapshot_id)
                .and_then(|s| self.snapshots.get(s))
                .filter(|s| s.state == RecordState::Ready)
                .filter(|s| want_source.is_none_or(|v| s.source_volume == v));
            return Ok(SnapshotPage {
                snapshots: found.into_iter().collect(),
                next_token: None,
            });
        }
        let (snapshots, more) = self.snapshots.page(after, max_entries as usize, |s| {
            s.state == RecordState::Ready && want_source.is_none_or(|v| s.source_volume == v)
        });
        let next_token = if more {
            snapshots.last().map(|s| s.id.to_string())
        } else {
            None
        };
        Ok(SnapshotPage {
            snapshots,
            next_token,
        })
    }

    // ---- group snapshots ----

    pub fn create_group_snapshot(
        &self,
        name: &str,
        source_volume_ids: &[String],
        parameters: &BTreeMap<String, String>,
    ) -> Result<GroupSnapshot> {
        self.create_group_snapshot_part(name, source_volume_ids, parameters, &|| Ok(()))
    }

    /// A group snapshot of this node's volumes that is one part of a group
    /// spanning several nodes: once this node's members are frozen (and
    /// before anything is copied) `barrier` runs, and the copies start only
    /// when it returns Ok — the caller makes it return once every node's part
    /// is frozen, so that all of them copy one instant. An error from it
    /// thaws and undoes the part. A part made earlier under the same name is
    /// answered as it is, without a call to `barrier`.
    pub fn create_group_snapshot_part(
        &self,
        name: &str,
        source_volume_ids: &[String],
        parameters: &BTreeMap<String, String>,
        barrier: &dyn Fn() -> Result<()>,
    ) -> Result<GroupSnapshot> {
        validate_name("group snapshot", name)?;
        if source_volume_ids.is_empty() {
            return Err(Error::invalid("source_volume_ids are required"));
        }
        if snapshot_consistency(parameters)? != Consistency::Frozen {
            return Err(Error::invalid(format!(
                "a group snapshot is made frozen: its members are consistent with each \
                 other only under one freeze ({CONSISTENCY}=crash-consistent is for \
                 single snapshots)"
            )));
        }
        let vids = group_sources(source_volume_ids)?;
        let gid = GroupSnapshotId::for_name(name);
        let member_id = |v: VolumeId| SnapshotId::for_name(&format!("group/{gid}/{v}"));
        let mut keys = vec![LockKey::Group(gid)];
        for v in &vids {
            keys.push(LockKey::Volume(*v));
            keys.push(LockKey::Snapshot(member_id(*v)));
        }
        let _guard = self.locks.try_lock(keys)?;
        if let Some(existing) = self.groups.get(gid) {
            if existing.state == RecordState::Ready {
                let have: BTreeSet<_> = existing.source_volumes.iter().collect();
                let want: BTreeSet<_> = vids.iter().collect();
                if have != want {
                    return Err(Error::AlreadyExists(format!(
                        "group snapshot {name:?} exists already, of other volumes"
                    )));
                }
                return self.group_with_members(existing);
            }
            self.roll_back_group(&existing)?;
        }
        let vols = self.ready_sources(&vids)?;
        let mut group = GroupSnapshotRecord {
            id: gid,
            name: name.to_string(),
            source_volumes: vids.clone(),
            members: vids.iter().map(|v| member_id(*v)).collect(),
            created: Timestamp::now(),
            state: RecordState::Creating,
        };
        self.groups.put(&group)?;
        failpoint::hit("create-group-snapshot.after-intent");
        let mut members: Vec<SnapshotRecord> = vols
            .iter()
            .map(|v| {
                self.snapshot_record(member_id(v.id), format!("{name}/{}", v.id), v, Some(gid))
            })
            .collect();
        if let Err(e) = self.copy_group_members(&vols, &members, barrier) {
            return Err(e.with_cleanup(self.roll_back_group(&group)));
        }
        for m in &mut members {
            m.state = RecordState::Ready;
            self.snapshots.put(m)?;
        }
        failpoint::hit("create-group-snapshot.after-members");
        group.state = RecordState::Ready;
        self.groups.put(&group)?;
        tracing::info!(group.id = %gid, name, members = members.len(), "group snapshot created");
        Ok(GroupSnapshot { group, members })
    }

    /// The records of a group's source volumes, each of which must exist.
    fn ready_sources(&self, vids: &[VolumeId]) -> Result<Vec<VolumeRecord>> {
        let mut vols = Vec::new();
        for v in vids {
            vols.push(
                self.volumes
                    .get(*v)
                    .filter(|r| r.state == RecordState::Ready)
                    .ok_or_else(|| Error::not_found(format!("source volume {v} does not exist")))?,
            );
        }
        Ok(vols)
    }

    /// Records the members (not yet ready) and copies every source volume into
    /// its member under one freeze.
    fn copy_group_members(
        &self,
        vols: &[VolumeRecord],
        members: &[SnapshotRecord],
        barrier: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        for m in members {
            self.snapshots.put(m)?;
        }
        let images = vols
            .iter()
            .map(|v| {
                Ok((
                    v.id,
                    self.pool(&v.pool)?.volume_path(v.id, v.backing, false),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        // One freeze over all members: their snapshots are consistent with each
        // other. One heavy slot, taken before the freeze, covers every copy.
        self.heavy(|| {
            self.with_frozen(&images, || {
                barrier()?;
                for (v, m) in vols.iter().zip(members) {
                    self.copy_to_snapshot(v, m)?;
                    failpoint::hit("create-group-snapshot.after-member");
                }
                Ok(())
            })
        })??;
        members
            .iter()
            .try_for_each(|m| self.make_snapshot_durable(m))
    }

    fn group_with_members(&self, group: GroupSnapshotRecord) -> Result<GroupSnapshot> {
        let members = group
            .members
            .iter()
            .map(|s| {
                self.snapshots
                    .get(*s)
                    .ok_or_else(|| Error::internal(format!("member snapshot {s} is missing")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(GroupSnapshot { group, members })
    }

    fn roll_back_group(&self, group: &GroupSnapshotRecord) -> Result<()> {
        for sid in &group.members {
            if let Some(s) = self.snapshots.get(*sid) {
                self.roll_back_snapshot(&s)?;
            } else {
                for pool in self.pools.values() {
                    for b in [Backing::Image, Backing::Directory] {
                        remove_data(&pool.snapshot_path(*sid, b))?;
                    }
                }
            }
        }
        self.groups.remove(group.id)
    }

    fn check_members(group: &GroupSnapshotRecord, snapshot_ids: &[String]) -> Result<()> {
        if snapshot_ids.is_empty() {
            return Ok(());
        }
        let have: BTreeSet<String> = group.members.iter().map(|s| s.to_string()).collect();
        let want: BTreeSet<String> = snapshot_ids.iter().cloned().collect();
        if have != want {
            return Err(Error::precondition(format!(
                "snapshot_ids do not match the members of group snapshot {}",
                group.id
            )));
        }
        Ok(())
    }

    pub fn delete_group_snapshot(&self, group_id: &str, snapshot_ids: &[String]) -> Result<()> {
        if group_id.is_empty() {
            return Err(Error::invalid("group_snapshot_id is required"));
        }
        let Some(gid) = GroupSnapshotId::parse(group_id) else {
            return Ok(());
        };
        let _guard = self.locks.try_lock([LockKey::Group(gid)])?;
        let Some(mut group) = self.groups.get(gid) else {
            return Ok(());
        };
        Self::check_members(&group, snapshot_ids)?;
        let keys: Vec<LockKey> = group
            .members
            .iter()
            .map(|s| LockKey::Snapshot(*s))
            .collect();
        let _members = self.locks.try_lock(keys)?;
        group.state = RecordState::Deleting;
        self.groups.put(&group)?;
        failpoint::hit("delete-group-snapshot.after-intent");
        self.roll_back_group(&group)?;
        tracing::info!(group.id = %gid, "group snapshot deleted");
        Ok(())
    }

    pub fn get_group_snapshot(
        &self,
        group_id: &str,
        snapshot_ids: &[String],
    ) -> Result<GroupSnapshot> {
        let gid = GroupSnapshotId::parse_existing(group_id)?;
        let group = self
            .groups
            .get(gid)
            .filter(|g| g.state == RecordState::Ready)
            .ok_or_else(|| Error::not_found(format!("group snapshot {gid} does not exist")))?;
        Self::check_members(&group, snapshot_ids)?;
        self.group_with_members(group)
    }

    /// Start-up: roll back interrupted creations, finish deletions, remove orphans.
    pub(crate) fn recover_snapshots(&self) -> Result<()> {
        for g in self.groups.unsettled() {
            if g.state != RecordState::Ready {
                tracing::warn!(group.id = %g.id, state = ?g.state, "repairing an interrupted group snapshot");
                self.roll_back_group(&g)?;
            }
        }
        for s in self.snapshots.unsettled() {
            let orphan_member = s.group.is_some_and(|g| !self.groups.contains(g));
            if s.state != RecordState::Ready || orphan_member {
                tracing::warn!(snapshot.id = %s.id, state = ?s.state, "repairing an interrupted snapshot");
                self.roll_back_snapshot(&s)?;
            }
        }
        for pool in self.pools.values() {
            self.remove_orphans(&pool.snapshots_dir(), |stem| {
                SnapshotId::parse(stem).is_some_and(|id| self.snapshots.contains(id))
                    || self.snapshots.is_quarantined(stem)
            })?;
        }
        Ok(())
    }
}

/// The volume ids of a group snapshot's sources, each named once.
fn group_sources(source_volume_ids: &[String]) -> Result<Vec<VolumeId>> {
    let mut vids = Vec::new();
    for s in source_volume_ids {
        let v = VolumeId::parse_existing(s)?;
        if vids.contains(&v) {
            return Err(Error::invalid(format!("volume {v} is named twice")));
        }
        vids.push(v);
    }
    Ok(vids)
}
