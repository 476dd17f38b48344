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

/// Why the filesystem `fs` (named by the request's field `what`) cannot be made
/// here, when it is not one of [`FILESYSTEMS`].
pub fn unsupported_fs(what: &str, fs: &str) -> Option<String> {
    (!FILESYSTEMS.contains(&fs)).then(|| {
        format!(
            "{what} {:?} is not supported; use one of {}",
            crate::data::shorten(fs),
            FILESYSTEMS.join(", ")
        )
    })
}

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
        // Mount options depend on the driver's configuration: Config::unsupported.
        self.fs_type().and_then(|fs| unsupported_fs("fs_type", fs))
    }
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

// Start-up finishes or rolls back what a volume record says is under way: the
// volume being made or removed, or an expansion.
crate::core::store::record!(VolumeRecord, VolumeId, layout 1,
    settled |r| r.state == RecordState::Ready && r.pending_size.is_none());

/// A volume record read in place from its packed form, for the answers that
/// name only some of its fields (a listing of many volumes): its strings are
/// borrowed and the fields no answer carries are read past, not built.
///
/// Its fields mirror `VolumeRecord`'s one for one, in the same order and of the
/// same encoding, so that it reads the record's packed form;
/// `a_volume_view_reads_every_record_as_the_record_does` fails when the two part.
#[derive(Debug, PartialEq, Eq, Deserialize)]
pub struct VolumeView<'a> {
    pub id: VolumeId,
    pub name: &'a str,
    pub pool: &'a str,
    pub backing: Backing,
    pub size: u64,
    #[serde(borrow)]
    pub fs_type: Option<&'a str>,
    capabilities: ReadPast<Vec<CapabilityView<'a>>>,
    parameters: ReadPast<BTreeMap<&'a str, &'a str>>,
    mutable_parameters: ReadPast<BTreeMap<&'a str, &'a str>>,
    pub source: Option<ContentSource>,
    pub created: Timestamp,
    pub state: RecordState,
    pub pending_size: Option<u64>,
    /// The nodes it is published to, in order.
    #[serde(borrow)]
    pub published: NodeNames<'a>,
    pub ephemeral: bool,
    pub requested: Option<u64>,
}

impl VolumeRecord {
    /// The record seen as a view (the fields a view reads past are left out).
    pub fn view(&self) -> VolumeView<'_> {
        VolumeView {
            id: self.id,
            name: &self.name,
            pool: &self.pool,
            backing: self.backing,
            size: self.size,
            fs_type: self.fs_type.as_deref(),
            capabilities: ReadPast::default(),
            parameters: ReadPast::default(),
            mutable_parameters: ReadPast::default(),
            source: self.source,
            created: self.created,
            state: self.state,
            pending_size: self.pending_size,
            published: NodeNames(self.published.keys().map(String::as_str).collect()),
            ephemeral: self.ephemeral,
            requested: self.requested,
        }
    }
}

impl VolumeView<'_> {
    /// The volume context a node is handed: the pool, the kind, and the
    /// filesystem of a mount volume.
    pub fn context(&self) -> impl Iterator<Item = (&'static str, &str)> {
        let kind = match self.backing {
            Backing::Image => "image",
            _ => "dir",
        };
        [("pool", self.pool), ("kind", kind)]
            .into_iter()
            .chain(self.fs_type.map(|fs| ("fsType", fs)))
    }
}

/// `Capability` as a view reads it: strings borrowed.
#[derive(Deserialize)]
#[allow(dead_code)] // read to step over, never looked at
struct CapabilityView<'a> {
    #[serde(borrow)]
    access: AccessView<'a>,
    mode: AccessMode,
}

#[derive(Deserialize)]
#[allow(dead_code)]
enum AccessView<'a> {
    Block,
    Mount {
        fs_type: &'a str,
        #[serde(borrow)]
        mount_flags: ReadPast<Vec<&'a str>>,
        volume_mount_group: &'a str,
    },
}

/// A field of type `T` read past: its elements (of a list or a map) are read
/// one at a time and dropped, so a collection is never built. Every two are
/// equal: a view does not hold what it reads past.
struct ReadPast<T>(std::marker::PhantomData<T>);

impl<T> Default for ReadPast<T> {
    fn default() -> Self {
        ReadPast(std::marker::PhantomData)
    }
}
impl<T> std::fmt::Debug for ReadPast<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("..")
    }
}
impl<T> PartialEq for ReadPast<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<T> Eq for ReadPast<T> {}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ReadPast<Vec<T>> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Each<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Each<T> {
            type Value = ReadPast<Vec<T>>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                while seq.next_element::<T>()?.is_some() {}
                Ok(ReadPast::default())
            }
        }
        d.deserialize_seq(Each(std::marker::PhantomData))
    }
}

impl<'de, K: Deserialize<'de>, V: Deserialize<'de>> Deserialize<'de> for ReadPast<BTreeMap<K, V>> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Each<K, V>(std::marker::PhantomData<(K, V)>);
        impl<'de, K: Deserialize<'de>, V: Deserialize<'de>> serde::de::Visitor<'de> for Each<K, V> {
            type Value = ReadPast<BTreeMap<K, V>>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                while map.next_entry::<K, V>()?.is_some() {}
                Ok(ReadPast::default())
            }
        }
        d.deserialize_map(Each(std::marker::PhantomData))
    }
}

/// The keys of a record's `published` map, borrowed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NodeNames<'a>(pub Vec<&'a str>);

impl<'de: 'a, 'a> Deserialize<'de> for NodeNames<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = NodeNames<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of nodes")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut names = Vec::new();
                while let Some((node, _)) = map.next_entry::<&'de str, Publication>()? {
                    names.push(node);
                }
                Ok(NodeNames(names))
            }
        }
        d.deserialize_map(Keys)
    }
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

// A snapshot of a group is settled only with its group (which may be gone).
crate::core::store::record!(SnapshotRecord, SnapshotId, layout 1,
    settled |r| r.state == RecordState::Ready && r.group.is_none());

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

crate::core::store::record!(GroupSnapshotRecord, GroupSnapshotId, layout 1,
    settled |r| r.state == RecordState::Ready);
