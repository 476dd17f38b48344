//! The node domain: stage, publish, unpublish, unstage, stats and expansion,
//! ephemeral inline volumes, and the start-up check of the node. Idempotency is
//! decided from the live mount table and loop devices; the node record only
//! remembers what was asked (staging path, targets), and every use of it is
//! checked against the real world.
//!
//! The domain owns `<state>/node` (its records) and never reads the controller's.
//! What it must agree on with the controller goes through the volume's lock in
//! the shared state: every operation on a volume holds it, says there whether the
//! volume is staged, and leaves a volume alone while a freeze of it is recorded.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use csi_sys::{btrfs, file, LoopDevice, LoopOptions, MountEntry, MountOptions, SysError};

use crate::core::Core;
use crate::data::{is_mount_of, mounts_of, remove_data, shorten};
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::{validate_name, VolumeId};
use crate::locks::Locks;
use crate::model::*;
use crate::pool::Located;
use crate::settings::{recorded_settings, recorded_size, DevicesBefore, LiveDevices, LoopSettings};
use crate::size::parse_size;
use crate::state::{Domain, OwnerLock, VolumeLock};
use crate::store::Store;

mod devices;
mod health;

/// The node domain of a process.
pub struct Node {
    core: Arc<Core>,
    pub(crate) node_records: Store<NodeRecord>,
    ephemeral_volumes: Store<VolumeRecord>,
    locks: Locks,
    _owner: OwnerLock,
}

impl Deref for Node {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

/// What the node remembers of a volume it staged or published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: VolumeId,
    /// The id kubelet uses; differs from `id` for ephemeral volumes.
    pub volume_id: String,
    pub data: PathBuf,
    pub backing: Backing,
    pub staging_path: Option<PathBuf>,
    pub block: bool,
    pub fs_type: Option<String>,
    pub mode: AccessMode,
    pub targets: BTreeMap<PathBuf, Target>,
    pub ephemeral: bool,
    /// Every loop device the node attached to the volume's image (the read-write
    /// one and the read-only ones of targets), so that they are found without
    /// looking at every device of the node. None while an attach may be under way
    /// (written before it, so a crash leaves no device unnamed) and in records of
    /// older versions: then every device is looked at.
    #[serde(default)]
    pub loop_devices: Option<Vec<PathBuf>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    pub read_only: bool,
    pub block: bool,
    /// A read-only loop device made for this target alone.
    pub ro_device: Option<PathBuf>,
}

pub struct Stage {
    pub volume_id: String,
    pub staging_path: String,
    pub capability: Option<Capability>,
    pub volume_context: BTreeMap<String, String>,
}

pub struct Publish {
    pub volume_id: String,
    pub staging_path: String,
    pub target_path: String,
    pub capability: Option<Capability>,
    pub read_only: bool,
    pub volume_context: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
pub struct VolumeStats {
    pub block: bool,
    pub total_bytes: u64,
    pub available_bytes: u64,
    pub used_bytes: u64,
    pub total_inodes: u64,
    pub available_inodes: u64,
    pub used_inodes: u64,
}

pub const EPHEMERAL_KEY: &str = "csi.storage.k8s.io/ephemeral";
/// Size of an ephemeral inline volume whose volumeAttributes name none.
pub const EPHEMERAL_DEFAULT_SIZE: u64 = GIB;

/// The kernel refuses to resize a btrfs filesystem to less than this.
const BTRFS_LEAST_RESIZE: u64 = 256 * MIB;

/// Directories no volume may ever be published onto.
const FORBIDDEN: [&str; 12] = [
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/root",
    "/run/secrets",
];

impl Node {
    /// Claims the node's part of the state (refused while another process holds
    /// it), loads its records and checks the node.
    pub fn open(core: Arc<Core>) -> Result<Node> {
        let owner = core.state.claim(Domain::Node)?;
        let dir = core.state.domain(Domain::Node);
        let node = Node {
            node_records: Store::open(&dir.join("staged"))?,
            ephemeral_volumes: Store::open(&dir.join("ephemeral"))?,
            locks: Locks::default(),
            _owner: owner,
            core,
        };
        node.recover_node()?;
        Ok(node)
    }

    /// How many volumes this node has staged (ephemeral ones included).
    pub fn staged_count(&self) -> usize {
        self.node_records.len()
    }

    /// Takes a volume's lock for a node operation, refusing while a freeze of it
    /// is recorded: the freeze's owner (or its restart) thaws it, and unmounting
    /// or growing a frozen filesystem would hang.
    fn lock_volume(&self, id: VolumeId) -> Result<VolumeLock> {
        let lock = self.state.lock_volume(id)?;
        failpoint::hit("node.after-volume-lock");
        if let Some(m) = self.state.freeze_of(id) {
            return Err(Error::Aborted(format!(
                "volume {id} is frozen for a copy by the {} (pid {}); it is thawed when the \
                 copy ends, or when that process starts again; retry later",
                m.owner.name(),
                m.pid
            )));
        }
        Ok(lock)
    }

    /// Takes the lock of a volume found in a pool, and finds it again under the
    /// lock: the controller may have deleted it meanwhile.
    fn lock_located(&self, id: VolumeId) -> Result<(VolumeLock, Located)> {
        let lock = self.lock_volume(id)?;
        match self.locate(id) {
            Some(loc) => Ok((lock, loc)),
            None => {
                lock.remove()?;
                Err(Error::not_found(format!(
                    "volume {id} does not exist on this node"
                )))
            }
        }
    }

    /// Checks a path given by the CO: absolute, no `..`, no NUL, outside the
    /// driver's own directories and the system's.
    /// What every stage and publish request is checked for first, in this order:
    /// a volume id, the path (see [`Self::check_path`]), a capability.
    fn check_request(
        &self,
        volume_id: &str,
        what: &str,
        path: &str,
        has_capability: bool,
    ) -> Result<PathBuf> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let path = self.check_path(what, path)?;
        if !has_capability {
            return Err(Error::invalid("volume_capability is required"));
        }
        Ok(path)
    }

    fn check_path(&self, what: &str, p: &str) -> Result<PathBuf> {
        if p.is_empty() {
            return Err(Error::invalid(format!("{what} is required")));
        }
        if p.contains('\0') {
            return Err(Error::invalid(format!("{what} contains a NUL byte")));
        }
        let path = PathBuf::from(p);
        if !path.is_absolute() {
            return Err(Error::invalid(format!("{what} {p:?} is not absolute")));
        }
        if path.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(Error::invalid(format!("{what} {p:?} contains '..'")));
        }
        if path.parent().is_none() {
            return Err(Error::invalid(format!("{what} may not be /")));
        }
        // Judge where the path really leads: a symlinked parent may point anywhere.
        let real_parent = path
            .parent()
            .and_then(|d| std::fs::canonicalize(d).ok())
            .unwrap_or_else(|| path.parent().unwrap_or(Path::new("/")).to_path_buf());
        let real = real_parent.join(path.file_name().unwrap_or_default());
        for candidate in [&path, &real] {
            if self.is_internal_path(candidate) {
                return Err(Error::invalid(format!(
                    "{what} {p:?} lies inside the driver's pools or state directory"
                )));
            }
            if FORBIDDEN.iter().any(|f| candidate.starts_with(f)) {
                return Err(Error::invalid(format!(
                    "{what} {p:?} lies in a system directory"
                )));
            }
        }
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(Error::invalid(format!("{what} {p:?} is a symbolic link")));
        }
        Ok(path)
    }

    /// Finds a volume's data in the pools.
    pub fn locate(&self, id: VolumeId) -> Option<Located> {
        self.pools.values().find_map(|p| p.locate(id))
    }

    /// Where a volume's data is, or was when this node staged it (the volume may
    /// have been deleted since).
    fn locate_or_recorded(&self, id: VolumeId, rec: Option<&NodeRecord>) -> Option<Located> {
        self.locate(id).or_else(|| {
            rec.map(|r| Located {
                pool: String::new(),
                path: r.data.clone(),
                backing: r.backing,
                ephemeral: r.ephemeral,
            })
        })
    }

    fn located(&self, volume_id: &str) -> Result<(VolumeId, Located)> {
        let id = VolumeId::parse_existing(volume_id)?;
        let loc = self
            .locate(id)
            .ok_or_else(|| Error::not_found(format!("volume {id} does not exist on this node")))?;
        Ok((id, loc))
    }

    fn mounts(&self) -> Result<Vec<MountEntry>> {
        self.sys
            .mounter
            .mounts()
            .context(|| "reading the mount table".into())
    }

    /// The loop devices serving the volume at `loc` (none for a directory), from
    /// what its record names where that can be trusted.
    fn devices(&self, loc: &Located, rec: Option<&NodeRecord>) -> Result<Vec<LoopDevice>> {
        if loc.backing != Backing::Image {
            return Ok(Vec::new());
        }
        self.image_devices(&loc.path, rec)
    }

    fn image_devices(&self, image: &Path, rec: Option<&NodeRecord>) -> Result<Vec<LoopDevice>> {
        let recorded = rec.and_then(|r| r.loop_devices.as_deref());
        devices::serving(&*self.sys.loops, image, recorded)
            .context(|| format!("finding the loop devices of {}", image.display()))
    }

    /// Whether `device` is mounted anywhere, from the table this operation read
    /// (less what it unmounted since). A mount that table still shows is looked up
    /// again: an unmount may have taken propagated copies of it along.
    fn is_mounted(&self, mounts: &mut Vec<MountEntry>, device: &Path) -> Result<bool> {
        if mounts_of(mounts, device).is_empty() {
            return Ok(false);
        }
        *mounts = self.mounts()?;
        Ok(!mounts_of(mounts, device).is_empty())
    }

    /// `d` as a loop device of a pool image (its backing file named by its pool
    /// path), or None when it is not one. A device attached by an earlier
    /// container of the node plugin shows its backing file by the path that
    /// container had: it is recognised by the volume id of the file's name and
    /// the identity of that volume's image.
    fn as_pool_loop(&self, d: LoopDevice) -> Option<LoopDevice> {
        if self.pools.values().any(|p| p.contains(&d.backing_file)) {
            return Some(d);
        }
        let id = d
            .backing_file
            .file_stem()
            .and_then(|s| VolumeId::parse(&s.to_string_lossy()))?;
        let loc = self.locate(id).filter(|l| l.backing == Backing::Image)?;
        self.sys
            .loops
            .find(&loc.path)
            .ok()?
            .into_iter()
            .find(|f| f.device == d.device)
    }

    /// Whether a mount entry belongs to this volume: a mount of one of its loop
    /// devices (or a bind of the device node), or for a directory volume a bind of
    /// exactly its directory from the pool's own filesystem.
    fn owns(
        &self,
        mounts: &[MountEntry],
        m: &MountEntry,
        id: VolumeId,
        loc: &Located,
        devices: &[LoopDevice],
    ) -> bool {
        match loc.backing {
            Backing::Image => devices.iter().any(|d| {
                is_mount_of(m, &d.device)
                    || (m.root == Path::new("/").join(d.device.file_name().unwrap_or_default())
                        && m.fs_type == "devtmpfs")
            }),
            _ => {
                let id = id.to_string();
                let named = m.root.ends_with(Path::new("volumes").join(&id))
                    || m.root.ends_with(Path::new("ephemeral").join(&id));
                // The mount holding the volume's directory tells which filesystem
                // and subtree a bind of it shows; another pool with a volume of the
                // same id (another driver instance) shows something else.
                let holder = mounts
                    .iter()
                    .filter(|h| loc.path.starts_with(&h.mount_point) && h.mount_point != loc.path)
                    .max_by_key(|h| h.mount_point.as_os_str().len());
                match holder {
                    Some(h) => {
                        let rel = loc.path.strip_prefix(&h.mount_point).unwrap_or(&loc.path);
                        named
                            && m.source == h.source
                            && (m.major, m.minor) == (h.major, h.minor)
                            && m.root == h.root.join(rel)
                    }
                    None => named,
                }
            }
        }
    }

    fn check_capability(cap: Option<&Capability>, loc: &Located) -> Result<Capability> {
        let cap = cap
            .cloned()
            .ok_or_else(|| Error::invalid("volume_capability is required"))?;
        if let Some(why) = cap.unsupported_reason() {
            return Err(Error::invalid(why));
        }
        if cap.is_block() && loc.backing != Backing::Image {
            return Err(Error::invalid(
                "block access is not possible on a kind=dir volume",
            ));
        }
        if let Access::Mount {
            volume_mount_group, ..
        } = &cap.access
        {
            if !volume_mount_group.is_empty() && volume_mount_group.parse::<u32>().is_err() {
                return Err(Error::invalid(format!(
                    "volume_mount_group {:?} is not a numeric group id",
                    shorten(volume_mount_group)
                )));
            }
        }
        Ok(cap)
    }

    /// The loop device serving an image read-write (among `devices`, those serving
    /// it now), attached if there is none, with the settings recorded on the image.
    /// A setting that cannot be read or applied fails the stage: a volume is never
    /// served without what was asked for it.
    fn attach(&self, image: &Path, devices: &[LoopDevice]) -> Result<LoopDevice> {
        // A new image may not be durable yet (core::fresh); data goes in after this.
        crate::core::fresh::make_durable(image)?;
        let settings = recorded_settings(image)?;
        let dev = match devices.iter().find(|d| !d.read_only).cloned() {
            Some(d) => d,
            None => self
                .sys
                .loops
                .attach(
                    image,
                    LoopOptions {
                        read_only: false,
                        direct_io: settings.direct_io == Some(true),
                    },
                )
                .context(|| format!("attaching {}", image.display()))?,
        };
        // Also on a device found attached: a stage cut short may have left it
        // without them.
        self.apply_settings(&dev.device, settings)?;
        Ok(dev)
    }

    /// Gives a loop device the settings that are set; the others stay as they are.
    fn apply_settings(&self, device: &Path, s: LoopSettings) -> Result<()> {
        if let Some(on) = s.direct_io {
            if let Err(e) = self.sys.loops.set_direct_io(device, on) {
                let context = format!(
                    "turning direct I/O {} on {}",
                    if on { "on" } else { "off" },
                    device.display()
                );
                return Err(if on && e.raw_os_error() == Some(libc::EINVAL) {
                    // Permanent: the backing file's filesystem or block size
                    // does not allow it.
                    Error::invalid(format!(
                        "{context}: the kernel refused it ({e}); directIO=true is not \
                         possible on this pool"
                    ))
                } else {
                    Error::System { context, source: e }
                });
            }
        }
        if let Some(kib) = s.read_ahead_kib {
            failpoint::fail("loop.set-read-ahead")
                .and_then(|()| self.sys.loops.set_read_ahead_kib(device, kib))
                .context(|| {
                    format!(
                        "setting the read-ahead of {} to {kib} KiB",
                        device.display()
                    )
                })?;
        }
        Ok(())
    }

    /// The settings a loop device has now.
    fn current_settings(&self, device: &LoopDevice) -> Result<LoopSettings> {
        let kib = self
            .sys
            .loops
            .read_ahead_kib(&device.device)
            .context(|| format!("reading the read-ahead of {}", device.device.display()))?;
        Ok(LoopSettings {
            direct_io: Some(device.direct_io),
            read_ahead_kib: Some(kib),
        })
    }

    pub fn node_stage(&self, req: Stage) -> Result<()> {
        let staging = self.check_request(
            &req.volume_id,
            "staging_target_path",
            &req.staging_path,
            req.capability.is_some(),
        )?;
        let (id, loc) = self.located(&req.volume_id)?;
        let cap = Self::check_capability(req.capability.as_ref(), &loc)?;
        let _guard = self.locks.try_lock([format!("node:{id}")])?;
        let (volume, loc) = self.lock_located(id)?;
        self.stage_locked(
            id,
            &req.volume_id,
            &loc,
            &staging,
            &cap,
            &req.volume_context,
            Some(&volume),
        )
    }

    /// Stages a volume. When the first stage of a volume fails, what this call did
    /// is undone (mount, loop device, record), so a refused or failed stage leaves
    /// nothing behind; a crash instead leaves the record, which the retry or the
    /// unstage finishes. A volume of the controller (`volume`, its lock held) is
    /// marked staged before anything is done, so that the controller never deletes
    /// it from under the node; an ephemeral volume is the node's alone.
    #[allow(clippy::too_many_arguments)]
    fn stage_locked(
        &self,
        id: VolumeId,
        volume_id: &str,
        loc: &Located,
        staging: &Path,
        cap: &Capability,
        context: &BTreeMap<String, String>,
        volume: Option<&VolumeLock>,
    ) -> Result<()> {
        let first_stage = self.node_records.get(id).is_none();
        let ephemeral = volume.is_none();
        let result = volume
            .map_or(Ok(()), |v| v.set_staged(true))
            .and_then(|()| self.stage_steps(id, volume_id, loc, staging, cap, context, ephemeral));
        if result.is_err() && first_stage {
            if let Err(e) = self.undo_first_stage(id, loc, staging, volume) {
                tracing::warn!(volume.id = %id, error = %e, "could not undo a failed stage");
            }
        }
        result
    }

    fn undo_first_stage(
        &self,
        id: VolumeId,
        loc: &Located,
        staging: &Path,
        volume: Option<&VolumeLock>,
    ) -> Result<()> {
        let devices = self.devices(loc, self.node_records.get(id).as_ref())?;
        let mut mounts = self.mounts()?;
        self.unmount_owned(id, loc, &devices, staging, &mut mounts)?;
        for d in &devices {
            if !self.is_mounted(&mut mounts, &d.device)? {
                self.sys
                    .loops
                    .detach(&d.device)
                    .context(|| format!("detaching {}", d.device.display()))?;
            }
        }
        self.node_records.remove(id)?;
        volume.map_or(Ok(()), |v| v.set_staged(false))
    }

    #[allow(clippy::too_many_arguments)]
    fn stage_steps(
        &self,
        id: VolumeId,
        volume_id: &str,
        loc: &Located,
        staging: &Path,
        cap: &Capability,
        context: &BTreeMap<String, String>,
        ephemeral: bool,
    ) -> Result<()> {
        let existing = self.node_records.get(id);
        let devices = self.devices(loc, existing.as_ref())?;
        let mut rec = match existing {
            Some(r) => {
                if let Some(old) = r.staging_path.as_ref().filter(|p| *p != staging) {
                    let mounts = self.mounts()?;
                    if mounts
                        .iter()
                        .any(|m| &m.mount_point == old && self.owns(&mounts, m, id, loc, &devices))
                    {
                        return Err(Error::AlreadyExists(format!(
                            "volume {id} is staged at {} already",
                            old.display()
                        )));
                    }
                }
                if r.block != cap.is_block() && !r.targets.is_empty() {
                    return Err(Error::AlreadyExists(format!(
                        "volume {id} is staged with another access type"
                    )));
                }
                r
            }
            None => {
                let max = self.cfg.max_volumes_per_node;
                if max > 0 && self.node_records.len() as u64 >= max {
                    return Err(Error::ResourceExhausted(format!(
                        "this node has {max} volumes staged, its limit"
                    )));
                }
                NodeRecord {
                    id,
                    volume_id: volume_id.to_string(),
                    data: loc.path.clone(),
                    backing: loc.backing,
                    staging_path: None,
                    block: cap.is_block(),
                    fs_type: None,
                    mode: cap.mode,
                    targets: BTreeMap::new(),
                    ephemeral,
                    loop_devices: None,
                }
            }
        };
        rec.staging_path = Some(staging.to_path_buf());
        rec.block = cap.is_block();
        rec.mode = cap.mode;
        // The devices are named only when no attach is to come; else the record
        // says so, and a crash after the attach leaves no device unnamed.
        let attaching = loc.backing == Backing::Image && !devices.iter().any(|d| !d.read_only);
        rec.loop_devices = (!attaching).then(|| devices::listed(&devices, None));
        // The intent first: an unstage after a crash knows what to undo.
        self.node_records.put(&rec)?;
        failpoint::hit("stage.after-intent");

        let read_only = cap.mode.is_read_only();
        let (flags, group) = match &cap.access {
            Access::Mount {
                mount_flags,
                volume_mount_group,
                ..
            } => (mount_flags.clone(), volume_mount_group.clone()),
            Access::Block => (Vec::new(), String::new()),
        };
        if loc.backing != Backing::Image {
            // A directory volume is bind-mounted at the staging path, so that
            // publish and the checks after it treat both kinds alike.
            let mounts = self.mounts()?;
            if let Some(m) = mounts.iter().find(|m| m.mount_point == staging) {
                if self.owns(&mounts, m, id, loc, &[]) {
                    return self.finish_stage(rec, staging, &group);
                }
                return Err(Error::AlreadyExists(format!(
                    "{} is a mount of something else",
                    staging.display()
                )));
            }
            make_dir(staging)?;
            let opts = MountOptions {
                read_only,
                flags: flags.clone(),
            };
            self.sys
                .mounter
                .bind(&loc.path, staging, &opts)
                .context(|| format!("binding {} at {}", loc.path.display(), staging.display()))?;
            return self.finish_stage(rec, staging, &group);
        }

        let dev = self.attach(&loc.path, &devices)?;
        rec.loop_devices = Some(devices::listed(&devices, Some(&dev)));
        failpoint::hit("stage.after-attach");
        if cap.is_block() {
            return self.finish_stage(rec, staging, "");
        }
        let mounts = self.mounts()?;
        if let Some(m) = mounts.iter().find(|m| m.mount_point == staging) {
            if self.owns(&mounts, m, id, loc, std::slice::from_ref(&dev)) {
                rec.fs_type = Some(m.fs_type.clone());
                return self.finish_stage(rec, staging, &group);
            }
            return Err(Error::AlreadyExists(format!(
                "{} is a mount of something else",
                staging.display()
            )));
        }
        if let Some(m) = mounts_of(&mounts, &dev.device).first() {
            return Err(Error::AlreadyExists(format!(
                "volume {id} is mounted at {} already",
                m.mount_point.display()
            )));
        }
        let wanted = cap
            .fs_type()
            .map(String::from)
            .or_else(|| context.get("fsType").cloned())
            .unwrap_or_else(|| self.cfg.default_fstype.clone());
        let found = self
            .sys
            .fs
            .probe(&dev.device)
            .context(|| format!("probing {}", dev.device.display()))?;
        let (fs_type, fresh) = match found {
            None => {
                let size = self
                    .sys
                    .fs
                    .device_size(&dev.device)
                    .context(|| format!("sizing {}", dev.device.display()))?;
                let least = minimum_size(Some(&wanted));
                if size < least {
                    return Err(Error::invalid(format!(
                        "volume {id} has {size} bytes; {wanted} needs at least {least}"
                    )));
                }
                self.heavy(|| self.sys.fs.mkfs(&dev.device, &wanted))?
                    .context(|| format!("making {wanted} on {}", dev.device.display()))?;
                (wanted, true)
            }
            Some(have) => {
                if cap.fs_type().is_some_and(|w| w != have) {
                    return Err(Error::invalid(format!(
                        "volume {id} holds {have}, not the requested {wanted}; it is never \
                         reformatted"
                    )));
                }
                (have, false)
            }
        };
        failpoint::hit("stage.after-mkfs");
        if !fresh {
            self.heavy(|| self.sys.fs.check(&dev.device, &fs_type))?
                .context(|| format!("checking the {fs_type} filesystem of volume {id}"))?;
            if fs_type == "ext4" && self.grows_at_stage(&dev.device, &fs_type) {
                // ext4 is grown before it is mounted: online growth needs a
                // privilege some nodes withhold, offline growth does not.
                self.heavy(|| self.sys.fs.grow(&dev.device, None, &fs_type))?
                    .context(|| format!("growing the ext4 filesystem of volume {id}"))?;
            }
        }
        make_dir(staging)?;
        let mut mflags = flags;
        if fs_type == "xfs" && !mflags.iter().any(|f| f == "nouuid") {
            // Snapshots and clones share their source's UUID; xfs refuses a second
            // mount of one UUID unless told not to check.
            mflags.push("nouuid".into());
        }
        let opts = MountOptions {
            read_only,
            flags: mflags,
        };
        self.sys
            .mounter
            .mount(&dev.device, staging, &fs_type, &opts)
            .context(|| format!("mounting volume {id} at {}", staging.display()))?;
        failpoint::hit("stage.after-mount");
        if !fresh && fs_type != "ext4" && !read_only && self.grows_at_stage(&dev.device, &fs_type) {
            self.sys
                .fs
                .grow(&dev.device, Some(staging), &fs_type)
                .context(|| format!("growing the {fs_type} filesystem of volume {id}"))?;
        }
        rec.fs_type = Some(fs_type);
        self.finish_stage(rec, staging, &group)
    }

    fn fs_smaller_than_device(&self, dev: &Path, fs_type: &str) -> Result<bool> {
        let device = self
            .sys
            .fs
            .device_size(dev)
            .context(|| format!("sizing {}", dev.display()))?;
        let fs = self
            .sys
            .fs
            .fs_size(dev, fs_type)
            .context(|| format!("sizing the {fs_type} filesystem on {}", dev.display()))?;
        // Filesystems end on a block boundary: ignore less than a MiB.
        Ok(fs + MIB <= device)
    }

    /// Whether the stage should grow the filesystem (now or, for ext4, before it is
    /// mounted). A size that cannot be read is no reason to refuse the stage.
    fn grows_at_stage(&self, dev: &Path, fs_type: &str) -> bool {
        let smaller = self.fs_smaller_than_device(dev, fs_type).unwrap_or(false);
        if smaller && fs_type == "btrfs" {
            match self.sys.fs.device_size(dev) {
                Ok(size) if size >= BTRFS_LEAST_RESIZE => {}
                _ => {
                    tracing::warn!(device = %dev.display(),
                        "btrfs below 256 MiB cannot be resized; staged at its present size");
                    return false;
                }
            }
        }
        smaller
    }

    fn finish_stage(&self, rec: NodeRecord, staging: &Path, group: &str) -> Result<()> {
        // A read-only filesystem cannot change its owner; pods only read it.
        if !group.is_empty() && !rec.block && !rec.mode.is_read_only() {
            apply_mount_group(staging, group)?;
        }
        self.node_records.put(&rec)?;
        failpoint::hit("stage.after-commit");
        Ok(())
    }

    pub fn node_unstage(&self, volume_id: &str, staging_path: &str) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let staging = self.check_path("staging_target_path", staging_path)?;
        let id = VolumeId::parse_existing(volume_id)?;
        let _guard = self.locks.try_lock([format!("node:{id}")])?;
        let volume = self.lock_if_known(id)?;
        self.unstage_locked(id, &staging, volume.as_ref())?;
        self.release_if_gone(id, volume)
    }

    /// The volume's lock when anything of the volume is here (its data or a
    /// record); a call about an unknown volume has nothing to coordinate, and
    /// leaves no lock file behind.
    fn lock_if_known(&self, id: VolumeId) -> Result<Option<VolumeLock>> {
        if self.locate(id).is_none() && self.node_records.get(id).is_none() {
            return Ok(None);
        }
        self.lock_volume(id).map(Some)
    }

    /// Removes the lock file of a volume whose data and record are both gone.
    fn release_if_gone(&self, id: VolumeId, lock: Option<VolumeLock>) -> Result<()> {
        match lock {
            Some(l) if self.locate(id).is_none() && self.node_records.get(id).is_none() => {
                l.remove()
            }
            _ => Ok(()),
        }
    }

    /// Unstages a volume; `volume` is the lock of a controller's volume, whose
    /// staged mark goes once nothing of it is left here.
    fn unstage_locked(
        &self,
        id: VolumeId,
        staging: &Path,
        volume: Option<&VolumeLock>,
    ) -> Result<()> {
        let rec = self.node_records.get(id);
        let loc = self.locate_or_recorded(id, rec.as_ref());
        let Some(loc) = loc else {
            // Neither data nor record: nothing of this volume is left here.
            return volume.map_or(Ok(()), |v| v.set_staged(false));
        };
        let devices = self.devices(&loc, rec.as_ref())?;
        let mut mounts = self.mounts()?;
        // Targets still mounted mean the CO skipped an unpublish.
        if let Some(r) = &rec {
            for t in r.targets.keys() {
                if mounts
                    .iter()
                    .any(|m| &m.mount_point == t && self.owns(&mounts, m, id, &loc, &devices))
                {
                    return Err(Error::precondition(format!(
                        "volume {id} is still published at {}; unpublish it first",
                        t.display()
                    )));
                }
            }
        }
        self.unmount_owned(id, &loc, &devices, staging, &mut mounts)?;
        if let Some(old) = rec
            .as_ref()
            .and_then(|r| r.staging_path.as_ref())
            .filter(|p| p.as_path() != staging)
        {
            if mounts
                .iter()
                .any(|m| &m.mount_point == old && self.owns(&mounts, m, id, &loc, &devices))
            {
                // Nothing of the volume at this path; it stays staged where it is.
                return Ok(());
            }
        }
        failpoint::hit("unstage.after-unmount");
        for d in &devices {
            if !self.is_mounted(&mut mounts, &d.device)? {
                match self.sys.loops.detach(&d.device) {
                    // Still open elsewhere for a moment: the kernel detaches it when
                    // the last user closes it, so the volume is unstaged all the same.
                    Err(SysError::Busy { .. }) => tracing::warn!(device = %d.device.display(),
                        "loop device busy; the kernel detaches it once it is closed"),
                    other => other.context(|| format!("detaching {}", d.device.display()))?,
                }
            } else {
                tracing::warn!(device = %d.device.display(), "loop device still mounted elsewhere; kept");
            }
        }
        failpoint::hit("unstage.after-detach");
        self.node_records.remove(id)?;
        volume.map_or(Ok(()), |v| v.set_staged(false))
    }

    /// Unmounts every mount of this volume at `path` (mounts may be stacked);
    /// FAILED_PRECONDITION if something else is mounted there. `mounts` is the
    /// table the operation read; what is unmounted leaves it.
    fn unmount_owned(
        &self,
        id: VolumeId,
        loc: &Located,
        devices: &[LoopDevice],
        path: &Path,
        mounts: &mut Vec<MountEntry>,
    ) -> Result<()> {
        loop {
            let Some(i) = mounts.iter().rposition(|m| m.mount_point == path) else {
                return Ok(());
            };
            if !self.owns(mounts, &mounts[i], id, loc, devices) {
                return Err(Error::precondition(format!(
                    "{} is a mount of something other than volume {id}; it is left alone",
                    path.display()
                )));
            }
            // A process forked at the wrong moment (or a scanner) can hold the
            // mount for a moment: EBUSY is retried briefly before it is an error.
            let mut tries = 0;
            loop {
                match self.sys.mounter.unmount(path) {
                    // Gone already: another of its propagated copies went first.
                    Ok(()) | Err(SysError::NotMounted { .. }) => break,
                    Err(SysError::Busy { .. }) if tries < 20 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    Err(e) => {
                        return Err(Error::System {
                            context: format!("unmounting {}", path.display()),
                            source: e,
                        })
                    }
                }
            }
            mounts.remove(i);
        }
    }

    pub fn node_publish(&self, req: Publish) -> Result<()> {
        let target = self.check_request(
            &req.volume_id,
            "target_path",
            &req.target_path,
            req.capability.is_some(),
        )?;
        if req.volume_context.get(EPHEMERAL_KEY).map(String::as_str) == Some("true") {
            return self.publish_ephemeral(&req, &target);
        }
        let staging = self.check_path("staging_target_path", &req.staging_path)?;
        let (id, loc) = self.located(&req.volume_id)?;
        let cap = Self::check_capability(req.capability.as_ref(), &loc)?;
        let _guard = self.locks.try_lock([format!("node:{id}")])?;
        let (_volume, loc) = self.lock_located(id)?;
        self.publish_locked(id, &loc, &staging, &target, &cap, req.read_only)
    }

    fn publish_locked(
        &self,
        id: VolumeId,
        loc: &Located,
        staging: &Path,
        target: &Path,
        cap: &Capability,
        read_only: bool,
    ) -> Result<()> {
        if target.starts_with(staging) || staging.starts_with(target) {
            return Err(Error::invalid(format!(
                "target_path {} overlaps the staging path {}",
                target.display(),
                staging.display()
            )));
        }
        let read_only = read_only || cap.mode.is_read_only();
        let flags = match &cap.access {
            Access::Mount { mount_flags, .. } => mount_flags.clone(),
            Access::Block => Vec::new(),
        };
        if read_only && flags.iter().any(|f| f == "rw") {
            return Err(Error::invalid(
                "mount flag rw contradicts a read-only publish",
            ));
        }
        let mut rec = self.node_records.get(id).ok_or_else(|| {
            Error::precondition(format!("volume {id} is not staged on this node"))
        })?;
        if rec.staging_path.as_deref() != Some(staging) {
            return Err(Error::precondition(format!(
                "volume {id} is not staged at {}",
                staging.display()
            )));
        }
        if rec.block != cap.is_block() {
            return Err(Error::invalid(format!(
                "volume {id} was staged for {} access",
                if rec.block { "block" } else { "mount" }
            )));
        }
        let devices = self.devices(loc, Some(&rec))?;
        if loc.backing == Backing::Image {
            // All of them, found under the volume's lock: a record that did not
            // name them right does from its next write on.
            rec.loop_devices = Some(devices::listed(&devices, None));
        }
        let mounts = self.mounts()?;
        if let Some(m) = mounts.iter().rev().find(|m| m.mount_point == target) {
            if !self.owns(&mounts, m, id, loc, &devices) {
                return Err(Error::AlreadyExists(format!(
                    "{} is a mount of something else",
                    target.display()
                )));
            }
            if m.read_only() != read_only {
                return Err(Error::AlreadyExists(format!(
                    "volume {id} is published at {} with readonly={}",
                    target.display(),
                    m.read_only()
                )));
            }
            if !rec.targets.contains_key(target) {
                rec.targets.insert(
                    target.to_path_buf(),
                    Target {
                        read_only,
                        block: rec.block,
                        ro_device: None,
                    },
                );
                self.node_records.put(&rec)?;
            }
            return Ok(());
        }
        // SINGLE_NODE_SINGLE_WRITER: one writer at a time.
        if cap.mode == AccessMode::SingleNodeSingleWriter && !read_only {
            let live: Vec<&PathBuf> = rec
                .targets
                .iter()
                .filter(|(p, t)| {
                    !t.read_only
                        && p.as_path() != target
                        && mounts.iter().any(|m| {
                            &m.mount_point == *p && self.owns(&mounts, m, id, loc, &devices)
                        })
                })
                .map(|(p, _)| p)
                .collect();
            if let Some(other) = live.first() {
                return Err(Error::precondition(format!(
                    "volume {id} is SINGLE_NODE_SINGLE_WRITER and has a writer at {}",
                    other.display()
                )));
            }
        }
        let opts = MountOptions { read_only, flags };
        let mut ro_device = None;
        if rec.block {
            let dev = devices.iter().find(|d| !d.read_only).ok_or_else(|| {
                Error::precondition(format!("volume {id} is not staged (no loop device)"))
            })?;
            let source = if read_only {
                // A read-only bind does not stop writes to a device node: a separate
                // read-only loop device does. One attached by an earlier try that
                // crashed (recorded for this target, or not yet recorded at all) is
                // reused, so that retries never leak devices.
                let others: Vec<&Path> = rec
                    .targets
                    .iter()
                    .filter(|(p, _)| p.as_path() != target)
                    .filter_map(|(_, t)| t.ro_device.as_deref())
                    .collect();
                let recorded = rec.targets.get(target).and_then(|t| t.ro_device.clone());
                let spare = devices
                    .iter()
                    .filter(|d| d.read_only && mounts_of(&mounts, &d.device).is_empty())
                    .filter(|d| !others.contains(&d.device.as_path()))
                    .min_by_key(|d| recorded.as_ref() != Some(&d.device))
                    .cloned();
                let ro = match spare {
                    Some(d) => d,
                    None => {
                        // Said before the attach, so a crash after it leaves no
                        // device unnamed.
                        rec.loop_devices = None;
                        self.node_records.put(&rec)?;
                        self.sys
                            .loops
                            .attach(
                                &loc.path,
                                LoopOptions {
                                    read_only: true,
                                    direct_io: false,
                                },
                            )
                            .context(|| format!("attaching {} read-only", loc.path.display()))?
                    }
                };
                rec.loop_devices = Some(devices::listed(&devices, Some(&ro)));
                ro_device = Some(ro.device.clone());
                ro.device
            } else {
                dev.device.clone()
            };
            make_file(target)?;
            rec.targets.insert(
                target.to_path_buf(),
                Target {
                    read_only,
                    block: true,
                    ro_device: ro_device.clone(),
                },
            );
            self.node_records.put(&rec)?;
            failpoint::hit("publish.after-intent");
            self.sys
                .mounter
                .bind(&source, target, &opts)
                .context(|| format!("binding {} at {}", source.display(), target.display()))?;
        } else {
            if !mounts
                .iter()
                .any(|m| m.mount_point == staging && self.owns(&mounts, m, id, loc, &devices))
            {
                return Err(Error::precondition(format!(
                    "volume {id} is not mounted at its staging path {}",
                    staging.display()
                )));
            }
            make_dir(target)?;
            rec.targets.insert(
                target.to_path_buf(),
                Target {
                    read_only,
                    block: false,
                    ro_device: None,
                },
            );
            self.node_records.put(&rec)?;
            failpoint::hit("publish.after-intent");
            self.sys
                .mounter
                .bind(staging, target, &opts)
                .context(|| format!("binding {} at {}", staging.display(), target.display()))?;
        }
        failpoint::hit("publish.after-mount");
        Ok(())
    }

    pub fn node_unpublish(&self, volume_id: &str, target_path: &str) -> Result<()> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let target = self.check_path("target_path", target_path)?;
        if let Some(eid) = self.ephemeral_id(volume_id) {
            let _guard = self.locks.try_lock([format!("node:{eid}")])?;
            return self.unpublish_ephemeral(eid, &target);
        }
        // An id that is no volume id of this driver may be an ephemeral volume
        // torn down already: unpublish stays idempotent for it (and still leaves a
        // mount it does not own alone).
        let id = VolumeId::parse(volume_id).unwrap_or_else(|| VolumeId::for_ephemeral(volume_id));
        let _guard = self.locks.try_lock([format!("node:{id}")])?;
        let volume = self.lock_if_known(id)?;
        self.unpublish_locked(id, &target)?;
        self.release_if_gone(id, volume)
    }

    fn unpublish_locked(&self, id: VolumeId, target: &Path) -> Result<()> {
        let mut rec = self.node_records.get(id);
        let loc = self.locate_or_recorded(id, rec.as_ref());
        let devices = match &loc {
            Some(l) => self.devices(l, rec.as_ref())?,
            None => Vec::new(),
        };
        let mut mounts = self.mounts()?;
        if let Some(loc) = &loc {
            self.unmount_owned(id, loc, &devices, target, &mut mounts)?;
        } else if mounts.iter().any(|m| m.mount_point == target) {
            return Err(Error::not_found(format!(
                "volume {id} does not exist; {} is left alone",
                target.display()
            )));
        }
        failpoint::hit("unpublish.after-unmount");
        let entry = rec.as_mut().and_then(|r| r.targets.remove(target));
        // Remove only what publish made: an empty directory or an empty file.
        match std::fs::symlink_metadata(target) {
            Ok(m) if m.is_dir() => {
                let _ = std::fs::remove_dir(target);
            }
            Ok(m) if m.is_file() && m.len() == 0 => {
                let _ = std::fs::remove_file(target);
            }
            _ => {}
        }
        if let Some(dev) = entry.and_then(|t| t.ro_device) {
            if devices.iter().any(|d| d.device == dev) && !self.is_mounted(&mut mounts, &dev)? {
                self.sys
                    .loops
                    .detach(&dev)
                    .context(|| format!("detaching {}", dev.display()))?;
                if let Some(list) = rec.as_mut().and_then(|r| r.loop_devices.as_mut()) {
                    list.retain(|d| *d != dev);
                }
            }
        }
        if let Some(r) = rec {
            self.node_records.put(&r)?;
        }
        failpoint::hit("unpublish.after-commit");
        Ok(())
    }

    pub fn node_stats(&self, volume_id: &str, volume_path: &str) -> Result<VolumeStats> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        if volume_path.is_empty() {
            return Err(Error::invalid("volume_path is required"));
        }
        let path = PathBuf::from(volume_path);
        let id = self
            .ephemeral_id(volume_id)
            .map(Ok)
            .unwrap_or_else(|| VolumeId::parse_existing(volume_id))?;
        let loc = self.locate(id).ok_or_else(|| {
            Error::not_found(format!("volume {volume_id} does not exist on this node"))
        })?;
        if std::fs::symlink_metadata(&path).is_err() {
            return Err(Error::not_found(format!("{volume_path} does not exist")));
        }
        let rec = self.node_records.get(id);
        let devices = self.devices(&loc, rec.as_ref())?;
        let mounts = self.mounts()?;
        let mount = mounts.iter().rev().find(|m| m.mount_point == path);
        let mut stats = VolumeStats::default();
        // A path of the volume whose mount vanished or was replaced has no figures
        // of the volume; NodeGetVolumeHealth says what happened to it.
        let Some(m) = mount.filter(|m| self.owns(&mounts, m, id, &loc, &devices)) else {
            return Err(Error::not_found(format!(
                "{volume_path} is not a mounted path of volume {volume_id}"
            )));
        };
        let block = rec.as_ref().is_some_and(|r| r.block) || m.fs_type == "devtmpfs";
        if block {
            let dev = devices.first().ok_or_else(|| {
                Error::not_found(format!("volume {volume_id} has no loop device"))
            })?;
            stats.block = true;
            stats.total_bytes = self
                .sys
                .fs
                .device_size(&dev.device)
                .context(|| format!("sizing {}", dev.device.display()))?;
            return Ok(stats);
        }
        let s = self
            .sys
            .fs
            .stats(&path)
            .context(|| format!("statvfs of {volume_path}"))?;
        stats.total_bytes = s.total_bytes;
        stats.available_bytes = s.available_bytes;
        stats.used_bytes = s.total_bytes.saturating_sub(s.free_bytes);
        // btrfs counts no inodes (statvfs says 0): the figures stay unknown.
        stats.total_inodes = s.total_inodes;
        stats.available_inodes = s.free_inodes;
        stats.used_inodes = s.total_inodes.saturating_sub(s.free_inodes);
        if loc.backing == Backing::Subvolume {
            // statvfs shows the whole pool; the volume's size is its qgroup's.
            let q = btrfs::qgroup_info(&loc.path)
                .context(|| format!("reading the qgroup of volume {volume_id}"))?;
            stats.used_bytes = q.referenced;
            if let Some(limit) = q.max_referenced {
                stats.total_bytes = limit;
                // The pool may run out before the limit is reached.
                stats.available_bytes = limit.saturating_sub(q.referenced).min(s.available_bytes);
            }
        }
        Ok(stats)
    }

    /// NodeExpandVolume: grows the image if the controller did not, refreshes the
    /// loop device and grows the filesystem online. Returns the new capacity.
    pub fn node_expand(
        &self,
        volume_id: &str,
        volume_path: &str,
        range: CapacityRange,
        capability: Option<&Capability>,
    ) -> Result<u64> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        if volume_path.is_empty() {
            return Err(Error::invalid("volume_path is required"));
        }
        range.validate()?;
        let (id, loc) = self.located(volume_id)?;
        if let Some(c) = capability {
            Self::check_capability(Some(c), &loc)?;
        }
        let path = PathBuf::from(volume_path);
        if std::fs::symlink_metadata(&path).is_err() {
            return Err(Error::not_found(format!("{volume_path} does not exist")));
        }
        let _guard = self.locks.try_lock([format!("node:{id}")])?;
        let (_volume, loc) = self.lock_located(id)?;
        if loc.backing != Backing::Image {
            // The controller raised the quota (a subvolume's limit is its size) or
            // recorded the size on the directory.
            let required = range.required.max(0) as u64;
            if loc.backing == Backing::Subvolume {
                let q = btrfs::qgroup_info(&loc.path)
                    .context(|| format!("reading the qgroup of volume {id}"))?;
                return Ok(q.max_referenced.unwrap_or(required));
            }
            return Ok(recorded_size(&loc.path).unwrap_or(required));
        }
        // The controller grew the image already; the node only makes up for a
        // missed growth, never beyond what was required.
        let want = range.required.max(0) as u64;
        let len = file::file_len(&loc.path).context(|| format!("sizing {}", loc.path.display()))?;
        if want > len {
            let want = want.div_ceil(4096).saturating_mul(4096);
            let pool = self.pool(&loc.pool)?;
            let (available, total) = pool.space()?;
            if want > total {
                return Err(Error::OutOfRange(format!(
                    "{want} bytes exceeds the largest volume pool {} can hold ({total} bytes)",
                    pool.name
                )));
            }
            if want - len > available {
                return Err(Error::ResourceExhausted(format!(
                    "pool {} has {available} bytes free; growing by {} was asked",
                    pool.name,
                    want - len
                )));
            }
            file::grow(&loc.path, want).context(|| format!("growing {}", loc.path.display()))?;
        }
        let devices = self.devices(&loc, self.node_records.get(id).as_ref())?;
        let dev = devices.iter().find(|d| !d.read_only).ok_or_else(|| {
            Error::precondition(format!("volume {id} is not staged on this node"))
        })?;
        for d in &devices {
            self.sys
                .loops
                .refresh_capacity(&d.device)
                .context(|| format!("refreshing the size of {}", d.device.display()))?;
        }
        let size = self
            .sys
            .fs
            .device_size(&dev.device)
            .context(|| format!("sizing {}", dev.device.display()))?;
        let mounts = self.mounts()?;
        let Some(m) = mounts_of(&mounts, &dev.device).into_iter().next().cloned() else {
            return Ok(size); // block volume, or not mounted: nothing more to grow
        };
        // A filesystem that fills its device already is left alone: growing it
        // again is refused by some (btrfs below 256 MiB, ext4 online without
        // CAP_SYS_RESOURCE) and needless for all.
        if !self.fs_smaller_than_device(&dev.device, &m.fs_type)? {
            return Ok(size);
        }
        if m.fs_type == "btrfs" && size < BTRFS_LEAST_RESIZE {
            return Err(Error::OutOfRange(format!(
                "volume {id} has {size} bytes; btrfs filesystems can only be resized to \
                 {BTRFS_LEAST_RESIZE} bytes (256 MiB) or more: expand it to at least that"
            )));
        }
        if m.read_only() {
            return Err(Error::precondition(format!(
                "volume {id} is staged read-only; its filesystem grows at its next read-write \
                 stage"
            )));
        }
        match self
            .sys
            .fs
            .grow(&dev.device, Some(&m.mount_point), &m.fs_type)
        {
            Ok(()) => Ok(size),
            Err(SysError::PermissionDenied { .. }) => Err(Error::precondition(format!(
                "the kernel refused to grow the mounted {} filesystem of volume {id} online \
                 (this node withholds CAP_SYS_RESOURCE); it grows at the next NodeStageVolume",
                m.fs_type
            ))),
            Err(e) => Err(Error::System {
                context: format!("growing the {} filesystem of volume {id}", m.fs_type),
                source: e,
            }),
        }
    }

    // ---- ephemeral inline volumes ----

    fn ephemeral_id(&self, volume_id: &str) -> Option<VolumeId> {
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

    fn publish_ephemeral(&self, req: &Publish, target: &Path) -> Result<()> {
        validate_name("ephemeral volume", &req.volume_id)?;
        let id = VolumeId::for_ephemeral(&req.volume_id);
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
        let result = self.make_ephemeral(req, target, id, &pool, &cap, size, fs, created);
        if result.is_err() && created {
            // A refused or failed first publish leaves nothing behind.
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
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn make_ephemeral(
        &self,
        req: &Publish,
        target: &Path,
        id: VolumeId,
        pool: &crate::pool::Pool,
        cap: &Capability,
        size: u64,
        fs: String,
        create: bool,
    ) -> Result<()> {
        if create {
            self.create_ephemeral(id, pool, &req.volume_id, cap, size, fs)?;
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
        self.stage_locked(
            id,
            &req.volume_id,
            &loc,
            &staging,
            &stage_cap,
            &BTreeMap::new(),
            None,
        )?;
        self.publish_locked(id, &loc, &staging, target, cap, req.read_only)
    }

    fn create_ephemeral(
        &self,
        id: VolumeId,
        pool: &crate::pool::Pool,
        name: &str,
        cap: &Capability,
        size: u64,
        fs: String,
    ) -> Result<()> {
        // The caller checked and rounded the size.
        let rec = VolumeRecord {
            id,
            name: name.to_string(),
            pool: pool.name.clone(),
            backing: Backing::Image,
            size,
            fs_type: Some(fs),
            capabilities: vec![cap.clone()],
            parameters: BTreeMap::new(),
            mutable_parameters: BTreeMap::new(),
            source: None,
            created: Timestamp::now(),
            state: RecordState::Ready,
            pending_size: None,
            published: BTreeMap::new(),
            ephemeral: true,
        };
        let path = pool.volume_path(id, Backing::Image, true);
        remove_data(&path)?;
        file::create_sparse(&path, size).context(|| format!("making {}", path.display()))?;
        self.ephemeral_volumes.put(&rec)
    }

    fn unpublish_ephemeral(&self, id: VolumeId, target: &Path) -> Result<()> {
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

    /// Makes the staged marks of the shared state follow the node's records: a
    /// crash between writing one and the other leaves them apart.
    fn reconcile_staged_marks(&self) {
        let marked: std::collections::BTreeSet<VolumeId> =
            self.state.staged_ids().into_iter().collect();
        let staged: std::collections::BTreeSet<VolumeId> = self
            .node_records
            .all()
            .into_iter()
            .filter(|r| !r.ephemeral)
            .map(|r| r.id)
            .collect();
        for id in marked.symmetric_difference(&staged) {
            let fixed = self
                .state
                .lock_volume(*id)
                .and_then(|l| l.set_staged(staged.contains(id)));
            if let Err(e) = fixed {
                tracing::warn!(volume.id = %id, error = %e, "could not correct the staged mark");
            }
        }
    }

    /// Start-up on the node: report mounts and loop devices of the pools that no
    /// volume accounts for, and remove ephemeral data without a record.
    pub(crate) fn recover_node(&self) -> Result<()> {
        self.reconcile_staged_marks();
        for pool in self.pools.values() {
            self.remove_orphans(&pool.ephemeral_dir(), |stem| {
                VolumeId::parse(stem).is_some_and(|id| self.ephemeral_volumes.get(id).is_some())
            })?;
        }
        let loops: Vec<LoopDevice> = self
            .sys
            .loops
            .list()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|d| self.as_pool_loop(d))
            .collect();
        let known_id =
            |id: Option<VolumeId>| id.is_some_and(|id| self.node_records.get(id).is_some());
        // Mounts of pool volumes: of their loop devices, or binds of their directories.
        let all = self.mounts().unwrap_or_default();
        for m in all.iter().cloned() {
            if self
                .pools
                .values()
                .any(|p| m.mount_point.starts_with(&p.root))
            {
                continue; // the pool itself, or mounts inside it
            }
            let by_device = loops.iter().find(|d| {
                self.pools.values().any(|p| p.contains(&d.backing_file))
                    && is_mount_of(&m, &d.device)
            });
            let id = if let Some(d) = by_device {
                Some(
                    d.backing_file
                        .file_stem()
                        .and_then(|s| VolumeId::parse(&s.to_string_lossy())),
                )
            } else if m
                .root
                .parent()
                .is_some_and(|p| p.ends_with("volumes") || p.ends_with("ephemeral"))
            {
                m.root
                    .file_name()
                    .and_then(|s| VolumeId::parse(&s.to_string_lossy()))
                    .filter(|id| {
                        self.locate(*id)
                            .is_some_and(|loc| self.owns(&all, &m, *id, &loc, &[]))
                    })
                    .map(Some)
            } else {
                None
            };
            if let Some(id) = id {
                if !known_id(id) {
                    tracing::warn!(mountpoint = %m.mount_point.display(), source = %m.source,
                        clean = self.cfg.cleanup_orphans,
                        "mount of a pool volume that no staged volume accounts for");
                    if self.cfg.cleanup_orphans {
                        if let Err(e) = self.sys.mounter.unmount(&m.mount_point) {
                            tracing::error!(mountpoint = %m.mount_point.display(), error = %e,
                                "could not unmount an orphan mount");
                        }
                    }
                }
            }
        }
        let mounts = self.mounts().unwrap_or_default();
        for d in loops {
            if self.pools.values().any(|p| p.contains(&d.backing_file)) {
                let known = d
                    .backing_file
                    .file_stem()
                    .and_then(|s| VolumeId::parse(&s.to_string_lossy()))
                    .is_some_and(|id| self.node_records.get(id).is_some());
                if !known {
                    tracing::warn!(device = %d.device.display(), file = %d.backing_file.display(),
                        clean = self.cfg.cleanup_orphans,
                        "loop device of a pool image that no staged volume accounts for");
                    if self.cfg.cleanup_orphans && mounts_of(&mounts, &d.device).is_empty() {
                        if let Err(e) = self.sys.loops.detach(&d.device) {
                            tracing::error!(device = %d.device.display(), error = %e,
                                "could not detach an orphan loop device");
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl LiveDevices for Node {
    fn apply_live(&self, image: &Path, wanted: LoopSettings) -> Result<DevicesBefore> {
        let mut before = Vec::new();
        let rec = image
            .file_stem()
            .and_then(|s| VolumeId::parse(&s.to_string_lossy()))
            .and_then(|id| self.node_records.get(id));
        for d in self.image_devices(image, rec.as_ref())? {
            before.push((d.device.clone(), self.current_settings(&d)?));
        }
        match before
            .iter()
            .try_for_each(|(dev, _)| self.apply_settings(dev, wanted))
        {
            Ok(()) => Ok(before),
            Err(e) => Err(e.with_cleanup(self.restore_live(&before))),
        }
    }

    fn restore_live(&self, before: &DevicesBefore) -> Result<()> {
        let mut result = Ok(());
        for (dev, settings) in before {
            result = result.and(self.apply_settings(dev, *settings));
        }
        result
    }
}

fn make_dir(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::AlreadyExists(format!(
            "{} exists and is not a directory",
            path.display()
        ))),
        Err(_) => std::fs::create_dir(path)
            .map_err(|e| Error::invalid(format!("cannot make {}: {e}", path.display()))),
    }
}

fn make_file(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(Error::AlreadyExists(format!(
            "{} exists and is not a file",
            path.display()
        ))),
        Err(_) => std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map(drop)
            .map_err(|e| Error::invalid(format!("cannot make {}: {e}", path.display()))),
    }
}

/// Gives the volume's root to `group` with group write and setgid, so new files
/// inherit the group and a pod's fsGroup works without a recursive chown.
fn apply_mount_group(root: &Path, group: &str) -> Result<()> {
    let gid: u32 = group.parse().map_err(|_| {
        Error::invalid(format!(
            "volume_mount_group {group:?} is not a numeric group id"
        ))
    })?;
    file::share_with_group(root, gid)
        .context(|| format!("giving {} to group {gid}", root.display()))
}
