//! The volume and snapshot model: what a request asks for, and what a record keeps.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::{GroupSnapshotId, SnapshotId, VolumeId};

/// The topology key of this driver; its value is the node id.
pub const TOPOLOGY_KEY: &str = "topology.example.csi/node";

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;
/// Size of a volume whose request names no capacity.
pub const DEFAULT_SIZE: u64 = GIB;

/// The smallest volume each filesystem can be made on (xfsprogs refuses less than
/// 300 MiB; btrfs needs room for its metadata and system chunks).
pub fn minimum_size(fs_type: Option<&str>) -> u64 {
    match fs_type {
        Some("xfs") => 300 * MIB,
        Some("btrfs") => 128 * MIB,
        Some(_) => 8 * MIB,
        None => MIB,
    }
}

/// Parameters under this prefix are Kubernetes' own and always accepted.
pub const K8S_PREFIX: &str = "csi.storage.k8s.io/";

/// Filesystems a mount volume can carry.
pub const FILESYSTEMS: [&str; 3] = ["ext4", "xfs", "btrfs"];

/// The CSI access modes. MULTI_NODE modes are parsed so that they can be refused with
/// a clear message, and so that ValidateVolumeCapabilities can answer "not confirmed".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
    #[cfg_attr(feature = "clap", value(skip))]
    Unknown,
}

impl AccessMode {
    pub fn is_single_node(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeWriter
                | AccessMode::SingleNodeReaderOnly
                | AccessMode::SingleNodeSingleWriter
                | AccessMode::SingleNodeMultiWriter
        )
    }
    pub fn is_read_only(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    Block,
    Mount {
        fs_type: String,
        mount_flags: Vec<String>,
        volume_mount_group: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability {
    pub access: Access,
    pub mode: AccessMode,
}

impl Capability {
    /// A mount of `fs_type` (empty: the driver's default) without mount flags or
    /// a volume mount group.
    pub fn mount(fs_type: &str, mode: AccessMode) -> Self {
        Capability {
            access: Access::Mount {
                fs_type: fs_type.into(),
                mount_flags: vec![],
                volume_mount_group: String::new(),
            },
            mode,
        }
    }

    pub fn is_block(&self) -> bool {
        matches!(self.access, Access::Block)
    }
    /// The requested filesystem, if any was named.
    pub fn fs_type(&self) -> Option<&str> {
        match &self.access {
            Access::Mount { fs_type, .. } if !fs_type.is_empty() => Some(fs_type),
            _ => None,
        }
    }

    /// Checks what this driver supports: a known access mode that is single-node, and
    /// a filesystem it can make. Returns the reason when it is not supported.
    pub fn unsupported_reason(&self) -> Option<String> {
        match self.mode {
            AccessMode::Unknown => return Some("access mode is unknown or unset".into()),
            m if !m.is_single_node() => {
                return Some(format!(
                    "access mode {m:?} is not supported: volumes live on one node's local \
                     storage, so only SINGLE_NODE_* modes are offered"
                ))
            }
            _ => {}
        }
        if let Some(fs) = self.fs_type() {
            if !FILESYSTEMS.contains(&fs) {
                return Some(format!(
                    "fs_type {fs:?} is not supported; use one of {}",
                    FILESYSTEMS.join(", ")
                ));
            }
        }
        if let Access::Mount { mount_flags, .. } = &self.access {
            if let Some(bad) = mount_flags.iter().find(|f| !mount_flag_allowed(f)) {
                return Some(format!("mount flag {bad:?} is not accepted"));
            }
        }
        None
    }
}

/// Mount flags a caller may ask for. Options that would weaken the node (suid, dev)
/// or inject further options (commas) are refused.
pub fn mount_flag_allowed(flag: &str) -> bool {
    const FLAGS: [&str; 13] = [
        "ro",
        "rw",
        "noatime",
        "relatime",
        "strictatime",
        "nodiratime",
        "lazytime",
        "nodev",
        "nosuid",
        "noexec",
        "sync",
        "dirsync",
        "discard",
    ];
    FLAGS.contains(&flag) || flag == "nodiscard"
}

/// The required and limit bytes of a request; zero means not set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CapacityRange {
    pub required: i64,
    pub limit: i64,
}

impl CapacityRange {
    /// At least `required` bytes, with no upper limit.
    pub fn at_least(required: i64) -> Self {
        CapacityRange { required, limit: 0 }
    }

    pub fn validate(&self) -> Result<()> {
        if self.required < 0 || self.limit < 0 {
            return Err(Error::invalid("capacity_range bytes must not be negative"));
        }
        if self.limit > 0 && self.required > self.limit {
            return Err(Error::invalid(format!(
                "capacity_range required_bytes {} exceeds limit_bytes {}",
                self.required, self.limit
            )));
        }
        Ok(())
    }
    /// Whether an existing size satisfies this range.
    pub fn admits(&self, size: u64) -> bool {
        (self.required <= 0 || size >= self.required as u64)
            && (self.limit <= 0 || size <= self.limit as u64)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentSource {
    Snapshot(SnapshotId),
    Volume(VolumeId),
}

/// How a volume is stored in its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backing {
    /// A sparse image file attached through a loop device.
    Image,
    /// A plain directory; its size is recorded, not enforced.
    Directory,
    /// A btrfs subvolume with a qgroup limit.
    Subvolume,
}

/// The life of a record. A record in any state but Ready was left by an operation
/// that a crash interrupted; start-up finishes or rolls it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    Creating,
    Ready,
    Deleting,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timestamp {
    pub seconds: i64,
    pub nanos: i32,
}

impl Timestamp {
    pub fn now() -> Self {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Timestamp {
            seconds: d.as_secs() as i64,
            nanos: d.subsec_nanos() as i32,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    pub read_only: bool,
    /// Published for block access (else mount).
    #[serde(default)]
    pub block: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub id: VolumeId,
    pub name: String,
    pub pool: String,
    pub backing: Backing,
    pub size: u64,
    /// The filesystem the node makes on a mount volume (None for block-only).
    pub fs_type: Option<String>,
    pub capabilities: Vec<Capability>,
    pub parameters: BTreeMap<String, String>,
    pub mutable_parameters: BTreeMap<String, String>,
    pub source: Option<ContentSource>,
    pub created: Timestamp,
    pub state: RecordState,
    /// A size an expansion was growing to when it was interrupted.
    #[serde(default)]
    pub pending_size: Option<u64>,
    /// Nodes this volume is published to (ControllerPublishVolume).
    #[serde(default)]
    pub published: BTreeMap<String, Publication>,
    /// Set on volumes created for an ephemeral inline volume.
    #[serde(default)]
    pub ephemeral: bool,
    /// The size the request asked for when the driver made more (its filesystem's
    /// minimum, or a whole MiB): what a snapshot of the volume promises a restore
    /// needs, so that a restore may ask for what the source's creator asked for.
    #[serde(default)]
    pub requested: Option<u64>,
}

/// What was asked, when less than what was made.
pub fn requested_below(asked: i64, made: u64) -> Option<u64> {
    (asked > 0 && (asked as u64) < made).then_some(asked as u64)
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub id: SnapshotId,
    pub name: String,
    pub source_volume: VolumeId,
    pub pool: String,
    pub backing: Backing,
    pub size: u64,
    pub fs_type: Option<String>,
    pub created: Timestamp,
    pub state: RecordState,
    #[serde(default)]
    pub group: Option<GroupSnapshotId>,
    /// The source volume's `requested` size when it was taken.
    #[serde(default)]
    pub requested: Option<u64>,
}

impl SnapshotRecord {
    /// The size a volume restored from this snapshot needs (CSI `size_bytes`):
    /// the size its source's creator asked for. The data may be larger (the
    /// driver's minimum); a restore is made at least as large as the data anyway.
    pub fn restore_size(&self) -> u64 {
        self.requested.unwrap_or(self.size)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSnapshotRecord {
    pub id: GroupSnapshotId,
    pub name: String,
    pub source_volumes: Vec<VolumeId>,
    pub members: Vec<SnapshotId>,
    pub created: Timestamp,
    pub state: RecordState,
}
