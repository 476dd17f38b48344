//! NodeStageVolume: attach the image to a loop device, make or check its
//! filesystem, grow it if its device grew, and mount it at the staging path (a
//! directory volume is bound there). A first stage that fails is undone.

use std::collections::BTreeMap;
use std::path::Path;

use csi_sys::{LoopDevice, LoopOptions, MountEntry, MountOptions};

use super::group::apply_mount_group;
use super::{devices, make_dir, Node, NodeRecord, BTRFS_LEAST_RESIZE};
use crate::data::mounts_of;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::locks::LockKey;
use crate::model::*;
use crate::pool::Located;
use crate::settings::recorded_settings;
use crate::state::VolumeLock;
use marks::{FORMATTING, GROWING};

pub struct Stage {
    pub volume_id: String,
    pub staging_path: String,
    pub capability: Option<Capability>,
    pub volume_context: BTreeMap<String, String>,
}

/// A stage request checked and resolved: the volume, where its data lies, the
/// staging path and the capability it is staged with.
#[derive(Clone, Copy)]
pub(super) struct ToStage<'a> {
    pub id: VolumeId,
    pub volume_id: &'a str,
    pub loc: &'a Located,
    pub staging: &'a Path,
    pub cap: &'a Capability,
    pub context: &'a BTreeMap<String, String>,
}

impl Node {
    pub fn node_stage(&self, req: Stage) -> Result<()> {
        let staging = self.check_request(
            &req.volume_id,
            "staging_target_path",
            &req.staging_path,
            req.capability.is_some(),
        )?;
        let (id, loc) = self.located(&req.volume_id)?;
        let cap = self.check_capability(req.capability.as_ref(), &loc)?;
        if let Some(why) = context_fs(&req.volume_context)
            .and_then(|fs| unsupported_fs("volume_context fsType", fs))
        {
            return Err(Error::invalid(why));
        }
        let _guard = self.locks.try_lock([LockKey::Node(id)])?;
        let (volume, loc) = self.lock_located(id)?;
        let to_stage = ToStage {
            id,
            volume_id: &req.volume_id,
            loc: &loc,
            staging: &staging,
            cap: &cap,
            context: &req.volume_context,
        };
        self.stage_locked(&to_stage, Some(&volume))
    }

    /// Stages a volume. When the first stage of a volume fails, what this call did
    /// is undone (mount, loop device, record), so a refused or failed stage leaves
    /// nothing behind; a crash instead leaves the record, which the retry or the
    /// unstage finishes. A volume of the controller (`volume`, its lock held) is
    /// marked staged before anything is done, so that the controller never deletes
    /// it from under the node; an ephemeral volume is the node's alone.
    pub(super) fn stage_locked(&self, req: &ToStage, volume: Option<&VolumeLock>) -> Result<()> {
        let ToStage {
            id, loc, staging, ..
        } = *req;
        let first_stage = !self.node_records.contains(id);
        let ephemeral = volume.is_none();
        let result = volume
            .map_or(Ok(()), |v| v.set_staged(true))
            .and_then(|()| self.stage_steps(req, ephemeral));
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
        // Something else mounted at the staging path (the usual reason the stage
        // was refused) is not this stage's to undo, and no reason to keep what it
        // attached: a device it mounted nowhere is detached below.
        let others_at_staging = mounts
            .iter()
            .rev()
            .find(|m| m.mount_point == staging)
            .is_some_and(|m| !self.owns(&mounts, m, id, loc, &devices));
        if !others_at_staging {
            self.unmount_owned(id, loc, &devices, staging, &mut mounts)?;
        }
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

    fn stage_steps(&self, req: &ToStage, ephemeral: bool) -> Result<()> {
        let ToStage {
            id,
            volume_id,
            loc,
            staging,
            cap,
            context,
        } = *req;
        let existing = self.node_records.get(id);
        let devices = self.devices(loc, existing.as_ref())?;
        let mut rec = match existing {
            Some(r) => {
                self.check_restage(&r, id, loc, staging, cap, &devices)?;
                r
            }
            None => self.new_node_record(id, volume_id, loc, cap, ephemeral)?,
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
            } => (
                self.cfg.mount_options.with_defaults(mount_flags),
                volume_mount_group.clone(),
            ),
            Access::Block => (Vec::new(), String::new()),
        };
        let opts = MountOptions { read_only, flags };
        if loc.backing != Backing::Image {
            // A directory whose data is still arriving is never served half-made.
            crate::core::arrival::refuse_while_arriving(&loc.path, "NodeStageVolume")?;
            self.bind_dir_at_staging(id, loc, staging, &opts)?;
            return self.finish_stage(rec, staging, &group);
        }

        let named = named_fs(cap, context);
        let dev = self.attach(loc, &devices, cap.is_block(), named.as_deref())?;
        rec.loop_devices = Some(devices::listed(&devices, Some(&dev)));
        failpoint::hit("stage.after-attach");
        if cap.is_block() {
            return self.finish_stage(rec, staging, "");
        }
        let mounts = self.mounts()?;
        let fs_type = match self.mounted_at_staging(&mounts, id, loc, &dev, staging)? {
            Some(fs_type) => fs_type,
            None => self.mount_at_staging(id, &dev, staging, cap, context, opts)?,
        };
        rec.fs_type = Some(fs_type);
        self.finish_stage(rec, staging, &group)
    }

    /// Checks that a volume the node staged already may be staged again at
    /// `staging` with `cap`.
    fn check_restage(
        &self,
        r: &NodeRecord,
        id: VolumeId,
        loc: &Located,
        staging: &Path,
        cap: &Capability,
        devices: &[LoopDevice],
    ) -> Result<()> {
        if let Some(old) = r.staging_path.as_ref().filter(|p| *p != staging) {
            let mounts = self.mounts()?;
            if mounts
                .iter()
                .any(|m| &m.mount_point == old && self.owns(&mounts, m, id, loc, devices))
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
        Ok(())
    }

    /// The record of a volume staged here for the first time, within the node's
    /// limit of staged volumes.
    fn new_node_record(
        &self,
        id: VolumeId,
        volume_id: &str,
        loc: &Located,
        cap: &Capability,
        ephemeral: bool,
    ) -> Result<NodeRecord> {
        let max = self.cfg.max_volumes_per_node;
        if max > 0 && self.node_records.len() as u64 >= max {
            return Err(Error::ResourceExhausted(format!(
                "this node has {max} volumes staged, its limit"
            )));
        }
        Ok(NodeRecord {
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
        })
    }

    /// A directory volume is bind-mounted at the staging path, so that publish
    /// and the checks after it treat both kinds alike.
    fn bind_dir_at_staging(
        &self,
        id: VolumeId,
        loc: &Located,
        staging: &Path,
        opts: &MountOptions,
    ) -> Result<()> {
        let mounts = self.mounts()?;
        if let Some(m) = mounts.iter().find(|m| m.mount_point == staging) {
            if self.owns(&mounts, m, id, loc, &[]) {
                return Ok(());
            }
            return Err(Error::AlreadyExists(format!(
                "{} is a mount of something else",
                staging.display()
            )));
        }
        make_dir(staging)?;
        self.sys
            .mounter
            .bind(&loc.path, staging, opts)
            .context(|| format!("binding {} at {}", loc.path.display(), staging.display()))
    }

    /// The filesystem type of the volume's mount at the staging path, when it is
    /// mounted there already; an error when something else is mounted there or
    /// the volume is mounted elsewhere.
    fn mounted_at_staging(
        &self,
        mounts: &[MountEntry],
        id: VolumeId,
        loc: &Located,
        dev: &LoopDevice,
        staging: &Path,
    ) -> Result<Option<String>> {
        if let Some(m) = mounts.iter().find(|m| m.mount_point == staging) {
            if self.owns(mounts, m, id, loc, std::slice::from_ref(dev)) {
                return Ok(Some(m.fs_type.clone()));
            }
            return Err(Error::AlreadyExists(format!(
                "{} is a mount of something else",
                staging.display()
            )));
        }
        if let Some(m) = mounts_of(mounts, &dev.device).first() {
            return Err(Error::AlreadyExists(format!(
                "volume {id} is mounted at {} already",
                m.mount_point.display()
            )));
        }
        Ok(None)
    }

    /// Mounts the volume's filesystem at the staging path: made on a blank
    /// device, else checked and grown to its device; returns its type.
    fn mount_at_staging(
        &self,
        id: VolumeId,
        dev: &LoopDevice,
        staging: &Path,
        cap: &Capability,
        context: &BTreeMap<String, String>,
        mut opts: MountOptions,
    ) -> Result<String> {
        // An image made from a template names its fresh filesystem: nothing to
        // probe, check or grow, and it has a UUID of its own.
        let from_template = crate::fresh::fresh_filesystem(&dev.backing_file);
        let (fs_type, fresh) = self.filesystem_of(id, dev, cap, context, from_template.clone())?;
        failpoint::hit("stage.after-mkfs");
        // Still live in another mount namespace (unstaged here while a container
        // being started held a copy of the mount table): no offline check or grow
        // may touch it; the mount below shares that filesystem as it is.
        let live = !fresh && self.sys.fs.held(&dev.device).unwrap_or(false);
        if live {
            tracing::warn!(volume.id = %id, device = %dev.device.display(), "the volume's filesystem is still mounted in another mount namespace: mounted as it is, without a check");
        }
        if !fresh && !live {
            let image = dev.backing_file.as_path();
            if fs_type == "ext4" && GROWING.is_set(image)? {
                // A grow cut short (the driver killed, a power loss) leaves new
                // groups half described, which the check below refuses to
                // repair on its own; nothing of the data moved.
                tracing::warn!(volume.id = %id, "an offline grow of the volume's ext4 was cut short; repairing it");
                self.heavy(|| self.sys.fs.repair(&dev.device, &fs_type))?
                    .context(|| format!("repairing the cut-short grow of volume {id}"))?;
                GROWING.clear(image)?;
            }
            self.heavy(|| self.sys.fs.check(&dev.device, &fs_type))?
                .context(|| format!("checking the {fs_type} filesystem of volume {id}"))?;
            if fs_type == "ext4" && self.grows_at_stage(&dev.device, &fs_type) {
                // ext4 is grown before it is mounted: online growth needs a
                // privilege some nodes withhold, offline growth does not.
                GROWING.set(image, &fs_type)?;
                failpoint::hit("stage.before-grow");
                self.heavy(|| self.sys.fs.grow(&dev.device, None, &fs_type))?
                    .context(|| format!("growing the ext4 filesystem of volume {id}"))?;
                failpoint::hit("stage.after-grow");
                GROWING.clear(image)?;
            }
        }
        make_dir(staging)?;
        if from_template.is_some() {
            crate::fresh::clear(&dev.backing_file)?;
        } else if fs_type == "xfs" && !opts.flags.iter().any(|f| f == "nouuid") {
            // Snapshots and clones share their source's UUID; xfs refuses a second
            // mount of one UUID unless told not to check.
            opts.flags.push("nouuid".into());
        }
        self.sys
            .mounter
            .mount(&dev.device, staging, &fs_type, &opts)
            .context(|| format!("mounting volume {id} at {}", staging.display()))?;
        failpoint::hit("stage.after-mount");
        let read_only = opts.read_only;
        if !fresh && fs_type != "ext4" && !read_only && self.grows_at_stage(&dev.device, &fs_type) {
            self.sys
                .fs
                .grow(&dev.device, Some(staging), &fs_type)
                .context(|| format!("growing the {fs_type} filesystem of volume {id}"))?;
        }
        Ok(fs_type)
    }

    /// The filesystem on the device and whether it was made just now (by mkfs
    /// here, or from a template: `known`): a blank device, or one whose fresh
    /// filesystem was never mounted, gets the one asked for; one that holds a
    /// filesystem with a history is never reformatted.
    fn filesystem_of(
        &self,
        id: VolumeId,
        dev: &LoopDevice,
        cap: &Capability,
        context: &BTreeMap<String, String>,
        known: Option<String>,
    ) -> Result<(String, bool)> {
        let named = named_fs(cap, context);
        let wanted = named
            .clone()
            .unwrap_or_else(|| self.cfg.default_fstype.clone());
        let found = match known {
            // A filesystem never mounted holds nothing: one of another type than
            // the stage names is replaced (the fresh mark is cleared before the
            // mount; a crash before that finds the mark and formats again).
            Some(fs) if named.as_ref().is_some_and(|n| *n != fs) => {
                tracing::info!(volume.id = %id, have = fs, wanted,
                    "a new volume's filesystem is not the one asked for; it is made anew");
                None
            }
            Some(fs) => return Ok((fs, true)),
            // A mkfs cut short: what it left is made again.
            None if FORMATTING.is_set(&dev.backing_file)? => {
                tracing::warn!(volume.id = %id, wanted,
                    "the making of the volume's filesystem was cut short; it is made anew");
                None
            }
            None => self
                .sys
                .fs
                .probe(&dev.device)
                .context(|| format!("probing {}", dev.device.display()))?,
        };
        match found {
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
                FORMATTING.set(&dev.backing_file, &wanted)?;
                failpoint::hit("stage.before-mkfs");
                self.heavy(|| self.sys.fs.mkfs(&dev.device, &wanted))?
                    .context(|| format!("making {wanted} on {}", dev.device.display()))?;
                // mkfs flushed the device, the image with it: the mark goes
                // once the filesystem is whole on the disk.
                FORMATTING.clear(&dev.backing_file)?;
                Ok((wanted, true))
            }
            Some(have) => {
                if cap.fs_type().is_some_and(|w| w != have) {
                    return Err(Error::invalid(format!(
                        "volume {id} holds {have}, not the requested {wanted}; it is never \
                         reformatted"
                    )));
                }
                Ok((have, false))
            }
        }
    }

    /// The loop device serving an image read-write (among `devices`, those serving
    /// it now), attached if there is none, with the settings recorded on the image.
    /// A setting that cannot be read or applied fails the stage: a volume is never
    /// served without what was asked for it.
    /// `named` is the filesystem the stage names, if any.
    fn attach(
        &self,
        loc: &Located,
        devices: &[LoopDevice],
        block: bool,
        named: Option<&str>,
    ) -> Result<LoopDevice> {
        let image = loc.path.as_path();
        // A volume whose data is still arriving from another node is never
        // served half-made.
        crate::core::arrival::refuse_while_arriving(image, "NodeStageVolume")?;
        // A new image is filled from its template before it is first attached
        // for a filesystem, and may not be durable yet (core::blank, core::fresh);
        // data goes in after this. A device for block access is the caller's to
        // write: a later stage must never take it for a fresh filesystem.
        if devices.is_empty() {
            crate::fresh::fill_pending(self.pool(&loc.pool)?, image, block, named)?;
            crate::fresh::settle(image)?;
            if block {
                crate::fresh::clear(image)?;
            }
        }
        crate::core::blank::make_durable(image)?;
        let mut settings = recorded_settings(image)?;
        // A device found attached is held to the image first: one whose detach
        // was deferred (it was mounted in another mount namespace too) would
        // otherwise go, and its number serve another volume, before the mount.
        let kept = match devices.iter().find(|d| !d.read_only) {
            Some(d)
                if self.sys.loops.keep(&d.device, image).context(|| {
                    format!("holding {} to {}", d.device.display(), image.display())
                })? =>
            {
                Some(d.clone())
            }
            _ => None,
        };
        let dev = match kept {
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
        if settings.direct_io == Some(true) && !dev.direct_io && !self.direct_io_at_stage(&dev)? {
            settings.direct_io = None;
        }
        // Also on a device found attached: a stage cut short may have left it
        // without them.
        self.apply_settings(&dev.device, settings)?;
        Ok(dev)
    }

    /// Direct I/O asked for a device that does not have it: turned on, or,
    /// where the kernel refuses it for this image for good, the volume is
    /// served with buffered I/O (false) rather than not at all: the data is
    /// the same either way, and a volume must not become unusable because a
    /// snapshot now shares its blocks. Any other failure fails the stage.
    fn direct_io_at_stage(&self, dev: &LoopDevice) -> Result<bool> {
        match self.sys.loops.set_direct_io(&dev.device, true) {
            Ok(()) => Ok(true),
            Err(e) if e.is_refused_by_kernel() => {
                tracing::warn!(device = %dev.device.display(), backing = %dev.backing_file.display(),
                    error = %e, "directIO=true: the kernel refuses direct I/O for this image \
                    (on xfs, an image that shares blocks with a snapshot, a clone or a template \
                    takes it only in 4096-byte units, and the volume's filesystem was made on \
                    512-byte sectors); served with buffered I/O");
                Ok(false)
            }
            Err(e) => Err(Error::System {
                context: format!("turning direct I/O on on {}", dev.device.display()),
                source: e,
            }),
        }
    }

    pub(super) fn fs_smaller_than_device(&self, dev: &Path, fs_type: &str) -> Result<bool> {
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
}

/// The filesystem a stage names: its capability's, else the one CreateVolume
/// chose (the volume context); None when it names none.
fn named_fs(cap: &Capability, context: &BTreeMap<String, String>) -> Option<String> {
    cap.fs_type()
        .or_else(|| context_fs(context))
        .map(String::from)
}

/// The filesystem the volume context names (as CreateVolume answered it), if any.
fn context_fs(context: &BTreeMap<String, String>) -> Option<&str> {
    context
        .get("fsType")
        .map(String::as_str)
        .filter(|f| !f.is_empty())
}

/// Marks an image carries, durably, while a step that is not atomic changes
/// its filesystem: set before the step and cleared after it, before the
/// filesystem is next mounted. A stage that finds one knows the step was cut
/// short (the driver killed, a power loss).
mod marks {
    use std::path::Path;

    use csi_sys::{file, xattr};

    use crate::error::{Context, Result};
    use crate::settings::attr_name;

    pub(super) struct Mark(&'static str);

    /// While an ext4 grows offline (`resize2fs`): a stage that finds it
    /// repairs the filesystem before it checks it.
    pub(super) const GROWING: Mark = Mark("growing");
    /// While mkfs makes the filesystem of a blank image (a cut mkfs leaves a
    /// filesystem no check accepts, an xfs with its in-progress bit set): a
    /// stage that finds it makes the filesystem again, as nothing was ever
    /// written to it.
    pub(super) const FORMATTING: Mark = Mark("formatting");

    impl Mark {
        pub(super) fn is_set(&self, image: &Path) -> Result<bool> {
            Ok(xattr::get(image, &attr_name(self.0))
                .context(|| format!("reading the marks of {}", image.display()))?
                .is_some())
        }

        pub(super) fn set(&self, image: &Path, fs_type: &str) -> Result<()> {
            let at = || format!("marking {} as {}", image.display(), self.0);
            xattr::set(image, &attr_name(self.0), fs_type.as_bytes()).context(at)?;
            file::sync_path(image).context(at)
        }

        pub(super) fn clear(&self, image: &Path) -> Result<()> {
            let at = || format!("clearing the {} mark of {}", self.0, image.display());
            xattr::remove(image, &attr_name(self.0)).context(at)?;
            file::sync_path(image).context(at)
        }
    }
}
