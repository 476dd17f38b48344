//! NodePublishVolume: bind the staged volume (or its loop device, or a read-only
//! loop device of its own) at the target path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use csi_sys::{LoopDevice, LoopOptions, MountEntry, MountOptions};

use super::ephemeral::EPHEMERAL_KEY;
use super::{devices, make_dir, Node, NodeRecord, Target};
use crate::data::mounts_of;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::locks::LockKey;
use crate::model::*;
use crate::pool::Located;

pub struct Publish {
    pub volume_id: String,
    pub staging_path: String,
    pub target_path: String,
    pub capability: Option<Capability>,
    pub read_only: bool,
    pub volume_context: BTreeMap<String, String>,
}

/// What a publish found under the volume's lock: the volume, where it goes, its
/// loop devices and the mount table.
struct Found<'a> {
    id: VolumeId,
    loc: &'a Located,
    target: &'a Path,
    read_only: bool,
    devices: Vec<LoopDevice>,
    mounts: Vec<MountEntry>,
}

impl Node {
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
        let cap = self.check_capability(req.capability.as_ref(), &loc)?;
        let _guard = self.locks.try_lock([LockKey::Node(id)])?;
        let (_volume, loc) = self.lock_located(id)?;
        self.publish_locked(id, &loc, &staging, &target, &cap, req.read_only)
    }

    pub(super) fn publish_locked(
        &self,
        id: VolumeId,
        loc: &Located,
        staging: &Path,
        target: &Path,
        cap: &Capability,
        read_only: bool,
    ) -> Result<()> {
        let (read_only, mut flags) = Self::publish_options(staging, target, cap, read_only)?;
        // Not for a block volume: nodev on the bind of its device node would
        // make the device unusable.
        if !cap.is_block() {
            flags = self.cfg.mount_options.with_defaults(&flags);
        }
        let mut rec = self.staged_record(id, staging, cap)?;
        let devices = self.devices(loc, Some(&rec))?;
        if loc.backing == Backing::Image {
            // All of them, found under the volume's lock: a record that did not
            // name them right does from its next write on.
            rec.loop_devices = Some(devices::listed(&devices, None));
        }
        let found = Found {
            id,
            loc,
            target,
            read_only,
            devices,
            mounts: self.mounts()?,
        };
        if let Some(m) = found.mounts.iter().rev().find(|m| m.mount_point == target) {
            return self.published_already(&found, m, rec);
        }
        // SINGLE_NODE_SINGLE_WRITER: one writer at a time.
        if cap.mode == AccessMode::SingleNodeSingleWriter && !read_only {
            self.check_single_writer(&found, &rec)?;
        }
        let opts = MountOptions { read_only, flags };
        if rec.block {
            self.publish_block(&found, rec, &opts)?;
        } else {
            self.publish_mount(&found, rec, staging, &opts)?;
        }
        failpoint::hit("publish.after-mount");
        Ok(())
    }

    /// Whether the target is mounted read-only, and its mount flags; refuses a
    /// target that overlaps the staging path and flags that contradict it.
    fn publish_options(
        staging: &Path,
        target: &Path,
        cap: &Capability,
        read_only: bool,
    ) -> Result<(bool, Vec<String>)> {
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
        Ok((read_only, flags))
    }

    /// The record of the volume, staged at `staging` for the access type of `cap`.
    fn staged_record(&self, id: VolumeId, staging: &Path, cap: &Capability) -> Result<NodeRecord> {
        let rec = self.node_records.get(id).ok_or_else(|| {
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
        Ok(rec)
    }

    /// Something is mounted at the target already: a retry when it is the volume
    /// the same way (the target recorded if it was not), else ALREADY_EXISTS.
    fn published_already(&self, f: &Found, m: &MountEntry, mut rec: NodeRecord) -> Result<()> {
        let (id, target, read_only) = (f.id, f.target, f.read_only);
        if !self.owns(&f.mounts, m, id, f.loc, &f.devices) {
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
        Ok(())
    }

    /// Refuses a second writer of a SINGLE_NODE_SINGLE_WRITER volume.
    fn check_single_writer(&self, f: &Found, rec: &NodeRecord) -> Result<()> {
        let (id, loc, target, mounts) = (f.id, f.loc, f.target, &f.mounts);
        let live: Vec<&PathBuf> = rec
            .targets
            .iter()
            .filter(|(p, t)| {
                !t.read_only
                    && p.as_path() != target
                    && mounts
                        .iter()
                        .any(|m| &m.mount_point == *p && self.owns(mounts, m, id, loc, &f.devices))
            })
            .map(|(p, _)| p)
            .collect();
        if let Some(other) = live.first() {
            return Err(Error::precondition(format!(
                "volume {id} is SINGLE_NODE_SINGLE_WRITER and has a writer at {}",
                other.display()
            )));
        }
        Ok(())
    }

    /// Binds the volume's loop device at the target: the read-write one, or for
    /// a read-only target a read-only device of its own.
    fn publish_block(&self, f: &Found, mut rec: NodeRecord, opts: &MountOptions) -> Result<()> {
        let (id, target, read_only) = (f.id, f.target, f.read_only);
        let mut ro_device = None;
        let dev = f.devices.iter().find(|d| !d.read_only).ok_or_else(|| {
            Error::precondition(format!("volume {id} is not staged (no loop device)"))
        })?;
        let source = if read_only {
            let ro = self.read_only_device(f, &mut rec)?;
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
            .bind(&source, target, opts)
            .context(|| format!("binding {} at {}", source.display(), target.display()))
    }

    /// A read-only bind does not stop writes to a device node: a separate
    /// read-only loop device does. One attached by an earlier try that crashed
    /// (recorded for this target, or not yet recorded at all) is reused, so that
    /// retries never leak devices.
    fn read_only_device(&self, f: &Found, rec: &mut NodeRecord) -> Result<LoopDevice> {
        let (loc, target, devices) = (f.loc, f.target, &f.devices);
        let others: Vec<&Path> = rec
            .targets
            .iter()
            .filter(|(p, _)| p.as_path() != target)
            .filter_map(|(_, t)| t.ro_device.as_deref())
            .collect();
        let recorded = rec.targets.get(target).and_then(|t| t.ro_device.clone());
        let spare = devices
            .iter()
            .filter(|d| d.read_only && mounts_of(&f.mounts, &d.device).is_empty())
            .filter(|d| !others.contains(&d.device.as_path()))
            .min_by_key(|d| recorded.as_ref() != Some(&d.device))
            .cloned();
        let ro = match spare {
            Some(d) => d,
            None => {
                // Said before the attach, so a crash after it leaves no
                // device unnamed.
                rec.loop_devices = None;
                self.node_records.put(rec)?;
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
        rec.loop_devices = Some(devices::listed(devices, Some(&ro)));
        Ok(ro)
    }

    /// Binds the volume's staging path at the target.
    fn publish_mount(
        &self,
        f: &Found,
        mut rec: NodeRecord,
        staging: &Path,
        opts: &MountOptions,
    ) -> Result<()> {
        let (id, loc, target, read_only, mounts) = (f.id, f.loc, f.target, f.read_only, &f.mounts);
        if !mounts
            .iter()
            .any(|m| m.mount_point == staging && self.owns(mounts, m, id, loc, &f.devices))
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
            .bind(staging, target, opts)
            .context(|| format!("binding {} at {}", staging.display(), target.display()))
    }
}

fn make_file(path: &Path) -> Result<()> {
    match csi_sys::dir::lstat(path) {
        Ok(Some(m)) if m.is_file() => Ok(()),
        Ok(Some(_)) => Err(Error::AlreadyExists(format!(
            "{} exists and is not a file",
            path.display()
        ))),
        _ => csi_sys::file::create_empty_unsynced(path)
            .map_err(|e| Error::invalid(format!("cannot make {}: {e}", path.display()))),
    }
}
