//! NodeGetVolumeHealth: what this node sees of a volume. On top of the data in
//! the pool (as the controller sees it), the node looks at the mounts it made
//! (gone, replaced, switched to read-only), the loop device (its backing file
//! deleted or replaced, the image shorter than the device) and the errors the
//! kernel recorded for the volume's filesystem. Only reads; takes no lock, so it
//! answers while another operation on the volume runs.

use std::path::{Path, PathBuf};

use csi_sys::health::{self as probe, LoopBacking};
use csi_sys::{file, MountEntry};

use super::{Node, NodeRecord};
use crate::error::{Error, Result};
use crate::health::VolumeHealth;
use crate::health::{data_problems, filesystem_problems, loop_problems, Problems, Severity};
use crate::ids::VolumeId;
use crate::model::Backing;
use crate::pool::Located;

/// A path the node expects the volume to be mounted at.
struct Expected {
    path: PathBuf,
    staging: bool,
    read_only: bool,
}

impl Node {
    pub fn volume_health(
        &self,
        volume_id: &str,
        publish_path: &str,
        staging_path: &str,
    ) -> Result<VolumeHealth> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let publish = optional_path("volume_publish_path", publish_path)?;
        let staging = optional_path("staging_target_path", staging_path)?;
        let id = self
            .ephemeral_id(volume_id)
            .map(Ok)
            .unwrap_or_else(|| VolumeId::parse_existing(volume_id))?;
        let rec = self.node_records.get(id);
        let loc = self.locate_or_recorded(id, rec.as_ref()).ok_or_else(|| {
            Error::not_found(format!("volume {volume_id} does not exist on this node"))
        })?;
        let mounts = self.mounts()?;
        Ok(VolumeHealth {
            volume_id: volume_id.to_string(),
            problems: self.problems(id, rec.as_ref(), &loc, &mounts, publish, staging),
        })
    }

    /// The health of every volume this node serves (staged, published or
    /// ephemeral here), as NodeGetVolumeHealth would answer for each at its
    /// recorded paths; the mount table is read once for all of them.
    pub fn served_health(&self) -> Result<Vec<VolumeHealth>> {
        let mounts = self.mounts()?;
        let mut out = Vec::new();
        for rec in self.node_records.all() {
            // With a record there is always a place to look (the recorded one
            // when the pool no longer has the data, which data_problems reports).
            let Some(loc) = self.locate_or_recorded(rec.id, Some(&rec)) else {
                continue;
            };
            out.push(VolumeHealth {
                volume_id: rec.volume_id.clone(),
                problems: self.problems(rec.id, Some(&rec), &loc, &mounts, None, None),
            });
        }
        Ok(out)
    }

    fn problems(
        &self,
        id: VolumeId,
        rec: Option<&NodeRecord>,
        loc: &Located,
        mounts: &[MountEntry],
        publish: Option<PathBuf>,
        staging: Option<PathBuf>,
    ) -> Problems {
        let mut problems = data_problems(&loc.path, loc.backing, None);
        if loc.backing == Backing::Image {
            problems.extend(self.image_against_devices(&loc.path, rec));
        }
        for expected in expected_mounts(rec, publish, staging) {
            let m = mounts.iter().rev().find(|m| m.mount_point == expected.path);
            problems.extend(self.mount_problems(mounts, m, &expected, id, loc));
        }
        problems
    }

    /// An image shorter than the loop device serving it: the kernel reads past
    /// the file's end as zeros, and what was there is gone.
    fn image_against_devices(&self, image: &Path, rec: Option<&NodeRecord>) -> Problems {
        let mut out = Problems::default();
        let (Ok(len), Ok(devices)) = (file::file_len(image), self.image_devices(image, rec)) else {
            return out;
        };
        if let Some(d) = devices.iter().find(|d| d.size > len) {
            out.push(
                Severity::DataLoss,
                "ImageTruncated",
                format!(
                    "the image file {} is {len} bytes, shorter than {} ({} bytes) that \
                     serves it: the data beyond its end is lost",
                    image.display(),
                    d.device.display(),
                    d.size
                ),
            );
        }
        out
    }

    fn mount_problems(
        &self,
        mounts: &[MountEntry],
        m: Option<&MountEntry>,
        expected: &Expected,
        id: VolumeId,
        loc: &Located,
    ) -> Problems {
        let mut out = Problems::default();
        let path = expected.path.display();
        let Some(m) = m else {
            let (reason, what) = if expected.staging {
                ("StagingMountMissing", "staging path")
            } else {
                ("PublishMountMissing", "published path")
            };
            out.push(
                Severity::Inaccessible,
                reason,
                format!("the volume's {what} {path} is no longer mounted"),
            );
            return out;
        };
        let ours = match loc.backing {
            Backing::Image => {
                let device = device_of(m);
                match probe::loop_backing(&device, &loc.path) {
                    LoopBacking::Current => true,
                    // The image's file, even moved or deleted since: its name
                    // starts with the volume id.
                    LoopBacking::Deleted { served } | LoopBacking::Replaced { served }
                        if same_volume(&served, &loc.path) =>
                    {
                        out.extend(loop_problems(&device, &loc.path));
                        true
                    }
                    _ => false,
                }
            }
            _ => self.owns(mounts, m, id, loc, &[]),
        };
        if !ours {
            out.push(
                Severity::Inaccessible,
                "MountReplaced",
                format!(
                    "{path} holds a mount of {} ({}), not of this volume",
                    m.source, m.fs_type
                ),
            );
            return out;
        }
        if m.fs_type == "devtmpfs" {
            return out;
        }
        let super_ro = m.super_options.iter().any(|o| o == "ro");
        if (super_ro || m.read_only()) && !expected.read_only {
            out.push(
                Severity::Degraded,
                "FilesystemReadOnly",
                format!(
                    "the filesystem at {path} is read-only though the volume was made \
                     available read-write (an error may have forced it): writes fail"
                ),
            );
        }
        out.extend(filesystem_problems(m, "the volume's filesystem"));
        out
    }
}

/// The paths to look at: those the caller names, else every path the node
/// record holds.
fn expected_mounts(
    rec: Option<&NodeRecord>,
    publish: Option<PathBuf>,
    staging: Option<PathBuf>,
) -> Vec<Expected> {
    let volume_ro = rec.is_some_and(|r| r.mode.is_read_only());
    let target_ro = |p: &Path| {
        volume_ro
            || rec
                .and_then(|r| r.targets.get(p))
                .is_some_and(|t| t.read_only)
    };
    let mut out = Vec::new();
    if let Some(path) = staging.or_else(|| rec.and_then(|r| r.staging_path.clone())) {
        out.push(Expected {
            path,
            staging: true,
            read_only: volume_ro,
        });
    }
    let targets: Vec<PathBuf> = match publish {
        Some(p) => vec![p],
        None => rec
            .map(|r| r.targets.keys().cloned().collect())
            .unwrap_or_default(),
    };
    for path in targets {
        out.push(Expected {
            read_only: target_ro(&path),
            path,
            staging: false,
        });
    }
    out
}

/// The block device behind a mount: its source, or for a bind of a device
/// node (a block volume) the node it binds.
fn device_of(m: &MountEntry) -> PathBuf {
    if m.fs_type == "devtmpfs" {
        Path::new("/dev").join(m.root.file_name().unwrap_or_default())
    } else {
        PathBuf::from(&m.source)
    }
}

/// Whether `served` is a name the image `image` has had: the volume id its
/// name starts with is unique.
fn same_volume(served: &Path, image: &Path) -> bool {
    let (Some(name), Some(stem)) = (
        served.file_name().and_then(|n| n.to_str()),
        image.file_stem().and_then(|n| n.to_str()),
    ) else {
        return false;
    };
    name.starts_with(stem)
}

fn optional_path(what: &str, p: &str) -> Result<Option<PathBuf>> {
    if p.is_empty() {
        return Ok(None);
    }
    if p.contains('\0') || !Path::new(p).is_absolute() {
        return Err(Error::invalid(format!(
            "{what} {p:?} must be an absolute path"
        )));
    }
    Ok(Some(PathBuf::from(p)))
}
