//! Health: what is wrong with a volume or a pool, how bad it is, and a stable
//! reason a machine can match on. Nothing here is cached or polled: each answer
//! looks at the real world when it is asked for (files, mountinfo, sysfs, the
//! filesystems' own error records).
//!
//! The checks shared by both domains live here: a volume's data in its pool
//! (what the controller can see), a mounted filesystem's recorded errors (what
//! the node sees of a staged volume and of a pool), and a pool as a whole.

use std::path::Path;

use csi_sys::health::{self, LoopBacking};
use csi_sys::{btrfs, file, MountEntry};

use crate::core::Core;
use crate::model::{Backing, KIB, MIB};
use crate::pool::Pool;

/// How bad a volume's problem is (CSI's VolumeHealthErrorType).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Usable, but something is wrong.
    Degraded,
    /// Not usable (from here).
    Inaccessible,
    /// Data is known or strongly suspected to be lost.
    DataLoss,
}

/// One problem of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub severity: Severity,
    /// A CamelCase token that stays the same across releases.
    pub reason: &'static str,
    pub message: String,
}

/// The problems of one volume; at most one per (severity, reason), as CSI asks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Problems(Vec<Problem>);

impl Problems {
    pub fn push(&mut self, severity: Severity, reason: &'static str, message: String) {
        if !self
            .0
            .iter()
            .any(|p| p.severity == severity && p.reason == reason)
        {
            self.0.push(Problem {
                severity,
                reason,
                message,
            });
        }
    }

    pub fn extend(&mut self, other: Problems) {
        for p in other.0 {
            self.push(p.severity, p.reason, p.message);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Problem> {
        self.0.iter()
    }
}

/// The health of one volume as a domain reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeHealth {
    /// The id as the caller named it.
    pub volume_id: String,
    pub problems: Problems,
}

/// A page of ControllerListVolumeHealth: volumes with problems only.
pub struct VolumeHealthPage {
    pub volumes: Vec<VolumeHealth>,
    pub next_token: Option<String>,
}

/// How bad a pool's problem is (CSI's StorageHealthErrorType).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolSeverity {
    /// Usable, but something is wrong.
    Degraded,
    /// Volumes in it cannot be used from this node.
    Unreachable,
}

/// One problem of one pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolProblem {
    pub pool: String,
    pub severity: PoolSeverity,
    pub reason: &'static str,
    pub message: String,
}

/// Default of [`crate::Config::pool_full_percent`].
pub const DEFAULT_POOL_FULL_PERCENT: u8 = 90;

/// What can be seen of a volume's data in its pool: the image file missing,
/// unreadable or shorter than `size` (when known), the directory or subvolume
/// missing, a subvolume at its qgroup limit.
pub(crate) fn data_problems(path: &Path, backing: Backing, size: Option<u64>) -> Problems {
    let mut out = Problems::default();
    let shown = path.display();
    match backing {
        Backing::Image => match file::file_len(path) {
            Err(e) if e.is_not_found() => out.push(
                Severity::Inaccessible,
                "ImageMissing",
                format!("the image file {shown} is missing"),
            ),
            Err(e) => out.push(
                Severity::Inaccessible,
                "ImageUnreadable",
                format!("the image file {shown} cannot be read: {e}"),
            ),
            Ok(len) => {
                if let Err(e) = health::read_file_start(path) {
                    out.push(
                        Severity::Inaccessible,
                        "ImageUnreadable",
                        format!("the image file {shown} cannot be read: {e}"),
                    );
                }
                if let Some(size) = size.filter(|s| len < *s) {
                    out.push(
                        Severity::DataLoss,
                        "ImageTruncated",
                        format!(
                            "the image file {shown} is {len} bytes, shorter than the volume's \
                             {size}: the data beyond its end is lost"
                        ),
                    );
                }
            }
        },
        Backing::Subvolume if !btrfs::is_subvolume(path) => out.push(
            Severity::Inaccessible,
            "SubvolumeMissing",
            format!("the btrfs subvolume {shown} is missing"),
        ),
        Backing::Subvolume => {
            // btrfs refuses a write that would cross the limit, so a full
            // subvolume stays a few blocks below it.
            let full = |limit: &u64, used: u64| {
                limit.saturating_sub(used) < (limit / 100).clamp(64 * KIB, MIB)
            };
            if let Ok(q) = btrfs::qgroup_info(path) {
                if let Some(limit) = q.max_referenced.filter(|l| full(l, q.referenced)) {
                    out.push(
                        Severity::Degraded,
                        "QuotaExceeded",
                        format!(
                            "the subvolume {shown} holds {} bytes, at its limit of {limit}: \
                             writes fail with EDQUOT",
                            q.referenced
                        ),
                    );
                }
            }
        }
        Backing::Directory if !csi_sys::dir::is_dir(path) => out.push(
            Severity::Inaccessible,
            "DirectoryMissing",
            format!("the directory {shown} is missing"),
        ),
        Backing::Directory => {}
    }
    out
}

/// What a loop device serving a volume's image says about it.
pub(crate) fn loop_problems(device: &Path, image: &Path) -> Problems {
    let mut out = Problems::default();
    match health::loop_backing(device, image) {
        LoopBacking::Deleted { served } => out.push(
            Severity::DataLoss,
            "LoopBackingDeleted",
            format!(
                "{} serves {}, which was deleted: what is written goes to a file that \
                 vanishes when the device is detached",
                device.display(),
                served.display()
            ),
        ),
        LoopBacking::Replaced { served } => out.push(
            Severity::DataLoss,
            "LoopBackingReplaced",
            format!(
                "{} serves an earlier file at {}, not the image there now: the two \
                 have diverged",
                device.display(),
                served.display()
            ),
        ),
        LoopBacking::Current | LoopBacking::Unknown => {}
    }
    out
}

/// The errors the kernel recorded for the filesystem of mount `m`: ext4's error
/// count, btrfs's device error counters, and EIO from a shut-down filesystem.
/// `what` names the filesystem in messages.
pub(crate) fn filesystem_problems(m: &MountEntry, what: &str) -> Problems {
    let mut out = Problems::default();
    if let Err(e) = health::read_directory(&m.mount_point) {
        if e.is_io_failure() {
            let (reason, why) = if m.fs_type == "xfs" {
                ("FilesystemShutDown", "xfs has shut down")
            } else {
                ("FilesystemIoError", "the filesystem answers I/O errors")
            };
            out.push(
                Severity::Inaccessible,
                reason,
                format!("{what} at {}: {why} ({e})", m.mount_point.display()),
            );
        }
    }
    match m.fs_type.as_str() {
        "ext4" => {
            if let Some(errors) = health::ext4_errors(Path::new(&m.source)) {
                if errors.count > 0 {
                    let site = |s: &Option<health::Ext4ErrorSite>| {
                        s.as_ref().map_or_else(String::new, |s| {
                            format!(
                                "{} (line {}, inode {}, block {}, at {})",
                                s.function, s.line, s.inode, s.block, s.time
                            )
                        })
                    };
                    out.push(
                        Severity::Degraded,
                        "FilesystemErrors",
                        format!(
                            "{what} ({}, ext4) has recorded {} error(s); first in {}, last in \
                             {}; e2fsck repairs it (an image volume is checked at each stage)",
                            m.source,
                            errors.count,
                            site(&errors.first),
                            site(&errors.last)
                        ),
                    );
                }
            }
        }
        "btrfs" => {
            if let Ok(devices) = health::btrfs_device_errors(&m.mount_point) {
                for d in devices {
                    if d.corruption + d.generation > 0 {
                        out.push(
                            Severity::DataLoss,
                            "ChecksumErrors",
                            format!(
                                "{what} (btrfs on {}) read back {} block(s) that failed their \
                                 checksum and {} of the wrong generation",
                                d.device, d.corruption, d.generation
                            ),
                        );
                    }
                    if d.read_io + d.write_io + d.flush_io > 0 {
                        out.push(
                            Severity::Degraded,
                            "DeviceIoErrors",
                            format!(
                                "{what} (btrfs on {}) has {} read, {} write and {} flush \
                                 error(s)",
                                d.device, d.read_io, d.write_io, d.flush_io
                            ),
                        );
                    }
                }
            }
        }
        _ => {}
    }
    out
}

/// The mount holding `path`: the deepest mount point above it.
pub(crate) fn mount_of<'a>(mounts: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    mounts
        .iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| (m.mount_point.as_os_str().len(), m.mount_id))
}

impl Core {
    /// The problems of every pool of this node: its directory missing, its
    /// filesystem read-only or shut down, nearly full (at least
    /// `pool_full_percent` used), or with errors recorded.
    pub fn storage_health(&self) -> Vec<PoolProblem> {
        let mounts = self.sys.mounter.mounts().unwrap_or_default();
        self.pools
            .values()
            .flat_map(|p| self.pool_problems(p, &mounts))
            .collect()
    }

    fn pool_problems(&self, pool: &Pool, mounts: &[MountEntry]) -> Vec<PoolProblem> {
        let mut out = Vec::new();
        let mut push = |severity, reason, message: String| {
            out.push(PoolProblem {
                pool: pool.name.clone(),
                severity,
                reason,
                message: format!("pool {} ({}): {message}", pool.name, pool.root.display()),
            })
        };
        match csi_sys::dir::stat(&pool.root.join("volumes")) {
            Ok(Some(m)) if m.is_dir() => {}
            Err(e) => push(
                PoolSeverity::Unreachable,
                "PoolUnreadable",
                format!("its directory cannot be read: {e}"),
            ),
            _ => {
                push(
                    PoolSeverity::Unreachable,
                    "PoolMissing",
                    "its directory is missing (is its filesystem mounted?)".into(),
                );
                return out;
            }
        }
        let holder = mount_of(mounts, &pool.root);
        let stats = file::statvfs(&pool.root);
        let read_only = stats.as_ref().is_ok_and(|s| s.read_only)
            || holder.is_some_and(|m| m.read_only() || m.super_options.iter().any(|o| o == "ro"));
        if read_only {
            push(
                PoolSeverity::Unreachable,
                "PoolReadOnly",
                "its filesystem is read-only: images cannot be written, volumes cannot be \
                 made or deleted"
                    .into(),
            );
        }
        match &stats {
            Ok(s) if s.total_bytes > 0 => {
                let used = s.total_bytes.saturating_sub(s.available_bytes);
                let percent = used.saturating_mul(100) / s.total_bytes;
                let threshold = u64::from(self.cfg.pool_full_percent);
                if threshold > 0 && percent >= threshold {
                    push(
                        PoolSeverity::Degraded,
                        "PoolNearlyFull",
                        format!(
                            "{percent}% used ({} of {} bytes free), at or above the \
                             threshold of {threshold}%: thin image volumes may fail writes",
                            s.available_bytes, s.total_bytes
                        ),
                    );
                }
            }
            Ok(_) => {}
            Err(e) => push(
                PoolSeverity::Unreachable,
                "PoolUnreadable",
                format!("statvfs failed: {e}"),
            ),
        }
        if let Some(m) = holder {
            for p in filesystem_problems(m, "its filesystem").0 {
                let severity = match p.severity {
                    Severity::Inaccessible => PoolSeverity::Unreachable,
                    Severity::Degraded | Severity::DataLoss => PoolSeverity::Degraded,
                };
                push(severity, p.reason, p.message);
            }
        }
        out
    }
}
