//! Fuzzing the request validation of every RPC, on stable Rust: a
//! seeded generator of arbitrary requests drives the REAL service implementations
//! (csi_identity::IdentityService, csi_controller::{ControllerService,
//! GroupControllerService}, csi_node::NodeService) in process, over a real
//! `csi_storage::Driver` opened on a loop-mounted xfs pool with
//! `csi_sys::System::linux()` (real loop devices, mkfs and mounts).
//!
//! Asserted for every input: no panic (a panic hook counts them, and the glue's
//! "handler failed ... panicked" answers are counted too), no hang (each call has
//! a timeout), and at the end no file created, changed or removed outside the
//! test dirs: /etc (recursively), the top levels of /, /var/lib, /root, /run and
//! /tmp entries named like the fuzzer's markers, plus the system mount table and
//! loop devices outside the test dirs.
//!
//! Corpus: fuzz/corpus/ holds one file per saved input, named
//! `<rpc>-<seed>.txt`: its first line is `<rpc> <seed>`, which regenerates the
//! input with this file's generator (GENERATOR = 1); the rest is the request as
//! it was generated, for people to read. The generator is deterministic per seed,
//! so the corpus replays exactly as long as GENERATOR is unchanged (bump it and
//! re-save the corpus when the generator changes); a new field is drawn after
//! the others of its request, and a test without root checks that every saved
//! seed still generates the request its file shows. Inputs that produced a new
//! (rpc, code, message shape) are saved when FUZZ_SAVE=1.
//!
//! `cargo test --test fuzz` replays the corpus and fuzzes for FUZZ_SECONDS
//! (default 15); scripts/reliability.sh runs it for 10 minutes or more.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use csi_proto::csi::{
    self, controller_server::Controller, group_controller_server::GroupController,
    identity_server::Identity, node_server::Node, volume_capability,
};
use csi_storage::ids::{GroupSnapshotId, SnapshotId, VolumeId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::{Code, Request, Status};

const GENERATOR: u32 = 1;
const MARK: &str = "csi-fuzz-outside";

static PANICS: AtomicU64 = AtomicU64::new(0);

struct Services {
    identity: csi_identity::IdentityService,
    controller: csi_controller::ControllerService,
    group: csi_controller::GroupControllerService,
    node: csi_node::NodeService,
}

/// The vocabulary the generator draws from.
struct Dict {
    scratch: PathBuf,
    pool: PathBuf,
    state: PathBuf,
    volume_ids: Vec<String>,
    snapshot_ids: Vec<String>,
    group_ids: Vec<String>,
}

impl Dict {
    /// The vocabulary of a fuzz run whose pool lives in `dir`.
    fn below(dir: &Path) -> Dict {
        Dict {
            scratch: dir.join("scratch/fuzz"),
            pool: dir.join("pool"),
            state: dir.join("state"),
            volume_ids: (0..12)
                .map(|i| VolumeId::for_name(&format!("fz-{i}")).to_string())
                .collect(),
            snapshot_ids: (0..12)
                .map(|i| SnapshotId::for_name(&format!("fs-{i}")).to_string())
                .collect(),
            group_ids: (0..12)
                .map(|i| GroupSnapshotId::for_name(&format!("fg-{i}")).to_string())
                .collect(),
        }
    }
}

/// The methods the fuzzer calls: every CSI method but the streaming ones of
/// SnapshotMetadata.
static RPCS: std::sync::LazyLock<Vec<&str>> = std::sync::LazyLock::new(|| {
    csi::RPCS
        .iter()
        .filter(|(service, _)| *service != "SnapshotMetadata")
        .map(|(_, method)| *method)
        .collect()
});

struct G<'a> {
    r: StdRng,
    d: &'a Dict,
    /// Draw mostly valid values, so the calls reach past validation into the
    /// real work (attach, mkfs, mount, copies).
    sane: bool,
}

const HOSTILE: &[&str] = &[
    "",
    "..",
    "../..",
    "/",
    "a/b",
    "\0",
    "x\0y",
    "\n",
    "$(touch /tmp/csi-fuzz-outside-pwned)",
    "; touch /tmp/csi-fuzz-outside-pwned",
    "`id`",
    "%s%s%n",
    "🙂",
    "\u{202e}",
    "-rf",
    "--help",
    "=",
    ",",
    "rw,suid",
    " ",
];

impl G<'_> {
    fn chance(&mut self, p: f64) -> bool {
        self.r.random_bool(p)
    }
    fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.r.random_range(0..xs.len())].clone()
    }
    fn junk(&mut self) -> String {
        let n = self.pick(&[0usize, 1, 2, 8, 36, 64, 129, 300, 5000]);
        (0..n)
            .map(|_| match self.r.random_range(0..10) {
                0 => char::from_u32(self.r.random_range(0..0x800)).unwrap_or('?'),
                1 => self.pick(&['/', '.', '\0', ',', '=', '$', '-']),
                _ => self.r.random_range(b'a'..=b'z') as char,
            })
            .collect()
    }
    fn string(&mut self) -> String {
        if self.sane && self.chance(0.9) {
            return format!("fz-{}", self.r.random_range(0..12));
        }
        match self.r.random_range(0..4) {
            0 => self.pick(HOSTILE).to_string(),
            1 => self.junk(),
            _ => format!("fz-{}", self.r.random_range(0..12)),
        }
    }
    fn name(&mut self, prefix: &str) -> String {
        if self.sane || self.chance(0.8) {
            format!("{prefix}-{}", self.r.random_range(0..12))
        } else {
            self.string()
        }
    }
    fn id(&mut self, kind: u8) -> String {
        let roll = if self.sane {
            0
        } else {
            self.r.random_range(0..10)
        };
        match roll {
            0..=5 => {
                let ids = match kind {
                    0 => &self.d.volume_ids,
                    1 => &self.d.snapshot_ids,
                    _ => &self.d.group_ids,
                };
                self.pick(ids)
            }
            6 => uuid::Uuid::from_u128(self.r.random()).to_string(),
            7 => self.pick(&self.d.volume_ids).to_uppercase(),
            8 => format!("{}/../x", self.pick(&self.d.volume_ids)),
            _ => self.string(),
        }
    }
    fn stage_path(&mut self) -> String {
        if self.sane && self.chance(0.9) {
            let n = self.r.random_range(0..3);
            return self
                .d
                .scratch
                .join(format!("stage/{n}"))
                .display()
                .to_string();
        }
        self.path()
    }
    fn target_path(&mut self) -> String {
        if self.sane && self.chance(0.9) {
            let n = self.r.random_range(0..5);
            return self
                .d
                .scratch
                .join(format!("pods/{n}"))
                .display()
                .to_string();
        }
        self.path()
    }
    fn path(&mut self) -> String {
        let s = &self.d.scratch;
        match self.r.random_range(0..16) {
            0..=3 => s
                .join(format!("stage/{}", self.r.random_range(0..3)))
                .display()
                .to_string(),
            4..=8 => s
                .join(format!("pods/{}", self.r.random_range(0..5)))
                .display()
                .to_string(),
            9 => s.join("pods/link-etc").display().to_string(),
            10 => s.join("pods/link-etc/x").display().to_string(),
            11 => self
                .pick(&[
                    "/",
                    "/etc",
                    "/etc/fz",
                    "/proc/1/root",
                    "/dev/null",
                    "relative",
                    "",
                ])
                .to_string(),
            12 => self
                .d
                .pool
                .join(self.pick(&["volumes", "snapshots", "volumes/x", ""]))
                .display()
                .to_string(),
            13 => self.d.state.join("node").display().to_string(),
            14 => format!("{}/pods/../../../etc", s.display()),
            _ => format!("{}/{}", s.display(), self.junk()),
        }
    }
    fn map(&mut self, keys: &[&str]) -> BTreeMap<String, String> {
        if self.sane && self.chance(0.8) {
            return BTreeMap::new();
        }
        let n = self.pick(&[0usize, 0, 1, 2, 4]);
        (0..n)
            .map(|_| {
                let k = if self.chance(0.7) {
                    self.pick(keys).to_string()
                } else {
                    self.string()
                };
                let v = match self.r.random_range(0..4) {
                    0 => self.string(),
                    1 => self
                        .pick(&[
                            "true",
                            "false",
                            "0",
                            "1",
                            "128",
                            "-1",
                            "image",
                            "dir",
                            "default",
                            "64Mi",
                            "1Gi",
                            "99999999999999Ti",
                            "18446744073709551615",
                            "9223372036854775808",
                        ])
                        .to_string(),
                    _ => self
                        .pick(&["", "ext4", "xfs", "default", "256"])
                        .to_string(),
                };
                (k, v)
            })
            .collect()
    }
    fn params(&mut self) -> BTreeMap<String, String> {
        self.map(&[
            "type",
            "kind",
            "csi.storage.k8s.io/pvc/name",
            "fsType",
            "directIO",
            "readAheadKiB",
        ])
    }
    fn secrets(&mut self) -> BTreeMap<String, String> {
        if self.chance(0.2) {
            [("password".to_string(), "fuzz-secret-value".to_string())].into()
        } else {
            BTreeMap::new()
        }
    }
    fn context(&mut self) -> BTreeMap<String, String> {
        self.map(&[
            "csi.storage.k8s.io/ephemeral",
            "size",
            "type",
            "fsType",
            "csi.storage.k8s.io/pod.name",
        ])
    }
    fn capability(&mut self) -> Option<csi::VolumeCapability> {
        if self.sane && self.chance(0.9) {
            let block = self.chance(0.2);
            let fs = self.pick(&["ext4", "ext4", "xfs", "btrfs", ""]).to_string();
            let mode = self.pick(&[1, 1, 1, 2, 3, 5, 7]);
            return Some(if block {
                block_cap(volume_capability::access_mode::Mode::try_from(mode).unwrap())
            } else {
                mount_cap(
                    &fs,
                    volume_capability::access_mode::Mode::try_from(mode).unwrap(),
                )
            });
        }
        if self.chance(0.1) {
            return None;
        }
        let access_type = match self.r.random_range(0..6) {
            0 => None,
            1 => Some(volume_capability::AccessType::Block(
                volume_capability::BlockVolume {},
            )),
            _ => {
                let nflags = self.pick(&[0usize, 0, 1, 2]);
                let mount_flags = (0..nflags)
                    .map(|_| {
                        if self.chance(0.6) {
                            self.pick(&[
                                "ro", "rw", "noatime", "nodev", "nosuid", "noexec", "suid", "dev",
                                "exec", "rw,suid", "nouuid", "discard", "sync",
                            ])
                            .to_string()
                        } else {
                            self.string()
                        }
                    })
                    .collect();
                Some(volume_capability::AccessType::Mount(
                    volume_capability::MountVolume {
                        fs_type: self
                            .pick(&["", "ext4", "ext4", "xfs", "btrfs", "vfat", "ext4 -F", "nfs"])
                            .to_string(),
                        mount_flags,
                        volume_mount_group: self
                            .pick(&["", "", "", "1000", "0", "-1", "4294967296", "wheel"])
                            .to_string(),
                    },
                ))
            }
        };
        Some(csi::VolumeCapability {
            access_type,
            access_mode: if self.chance(0.9) {
                Some(volume_capability::AccessMode {
                    mode: self.r.random_range(-1..10),
                })
            } else {
                None
            },
        })
    }
    fn caps(&mut self) -> Vec<csi::VolumeCapability> {
        let n = self.pick(&[0usize, 1, 1, 1, 2]);
        (0..n).filter_map(|_| self.capability()).collect()
    }
    fn bytes(&mut self) -> i64 {
        self.pick(&[
            0,
            1,
            -1,
            4096,
            8 * MIB,
            64 * MIB,
            64 * MIB,
            100 * MIB + 1,
            300 * MIB,
            GIB,
            64 * GIB,
            i64::MAX,
            i64::MIN,
            i64::MAX - 1,
            1 << 62,
        ])
    }
    fn range(&mut self) -> Option<csi::CapacityRange> {
        if self.sane && self.chance(0.9) {
            return Some(csi::CapacityRange {
                required_bytes: self.pick(&[64 * MIB, 128 * MIB, 320 * MIB]),
                limit_bytes: 0,
            });
        }
        self.chance(0.85).then(|| csi::CapacityRange {
            required_bytes: self.bytes(),
            limit_bytes: if self.chance(0.6) { 0 } else { self.bytes() },
        })
    }
    fn topology(&mut self) -> csi::Topology {
        let key = self
            .pick(&["topology.example.csi/node", "zone", ""])
            .to_string();
        let val = self.pick(&["fuzz-node", "other-node", ""]).to_string();
        csi::Topology {
            segments: [(key, val)].into(),
        }
    }
    /// Requisite and preferred lists of any length, topologies of zero to two
    /// segments: this node's, another's, or keys this driver does not know.
    /// (Its own draws, so that topology()'s callers keep their seeds.)
    fn requirement(&mut self) -> csi::TopologyRequirement {
        let topologies = |g: &mut Self| {
            let n = g.pick(&[0usize, 1, 1, 2, 3]);
            (0..n)
                .map(|_| {
                    let k = g.pick(&[0usize, 1, 1, 1, 2]);
                    csi::Topology {
                        segments: (0..k)
                            .map(|_| {
                                let key = g.pick(&["topology.example.csi/node", "zone", ""]);
                                let val = g.pick(&["fuzz-node", "fuzz-node", "other-node", ""]);
                                (key.to_string(), val.to_string())
                            })
                            .collect(),
                    }
                })
                .collect()
        };
        csi::TopologyRequirement {
            requisite: topologies(self),
            preferred: topologies(self),
        }
    }
    fn ids(&mut self, kind: u8) -> Vec<String> {
        let n = self.pick(&[0usize, 1, 2, 3]);
        (0..n).map(|_| self.id(kind)).collect()
    }
    fn token(&mut self) -> String {
        self.pick(&[
            "",
            "0",
            "1",
            "5",
            "-1",
            "999999999999999999999",
            "abc",
            "18446744073709551615",
        ])
        .to_string()
    }
    fn max_entries(&mut self) -> i32 {
        self.pick(&[0, 1, 2, -1, i32::MAX, i32::MIN])
    }
}

/// The input of one call.
#[derive(Debug)]
enum Input {
    Empty(&'static str),
    CreateVolume(csi::CreateVolumeRequest),
    DeleteVolume(csi::DeleteVolumeRequest),
    ControllerPublishVolume(csi::ControllerPublishVolumeRequest),
    ControllerUnpublishVolume(csi::ControllerUnpublishVolumeRequest),
    ValidateVolumeCapabilities(csi::ValidateVolumeCapabilitiesRequest),
    ListVolumes(csi::ListVolumesRequest),
    GetCapacity(csi::GetCapacityRequest),
    CreateSnapshot(csi::CreateSnapshotRequest),
    DeleteSnapshot(csi::DeleteSnapshotRequest),
    ListSnapshots(csi::ListSnapshotsRequest),
    GetSnapshot(csi::GetSnapshotRequest),
    ControllerExpandVolume(csi::ControllerExpandVolumeRequest),
    ControllerGetVolume(csi::ControllerGetVolumeRequest),
    ControllerModifyVolume(csi::ControllerModifyVolumeRequest),
    ControllerGetVolumeHealth(csi::ControllerGetVolumeHealthRequest),
    ControllerListVolumeHealth(csi::ControllerListVolumeHealthRequest),
    ControllerGetNodeInfo(csi::ControllerGetNodeInfoRequest),
    CreateVolumeGroupSnapshot(csi::CreateVolumeGroupSnapshotRequest),
    DeleteVolumeGroupSnapshot(csi::DeleteVolumeGroupSnapshotRequest),
    GetVolumeGroupSnapshot(csi::GetVolumeGroupSnapshotRequest),
    NodeStageVolume(csi::NodeStageVolumeRequest),
    NodeUnstageVolume(csi::NodeUnstageVolumeRequest),
    NodePublishVolume(csi::NodePublishVolumeRequest),
    NodeUnpublishVolume(csi::NodeUnpublishVolumeRequest),
    NodeGetVolumeStats(csi::NodeGetVolumeStatsRequest),
    NodeExpandVolume(csi::NodeExpandVolumeRequest),
    NodeGetVolumeHealth(csi::NodeGetVolumeHealthRequest),
    NodeGetStorageHealth(csi::NodeGetStorageHealthRequest),
}

fn generate(rpc: &str, seed: u64, d: &Dict) -> Input {
    let mut r = StdRng::seed_from_u64(seed ^ ((GENERATOR as u64) << 56));
    let sane = r.random_bool(0.5);
    let mut g = G { r, d, sane };
    match rpc {
        "CreateVolume" => {
            let src = match g.r.random_range(0..5) {
                0 => Some(csi::VolumeContentSource {
                    r#type: Some(csi::volume_content_source::Type::Snapshot(
                        csi::volume_content_source::SnapshotSource {
                            snapshot_id: g.id(1),
                        },
                    )),
                }),
                1 => Some(csi::VolumeContentSource {
                    r#type: Some(csi::volume_content_source::Type::Volume(
                        csi::volume_content_source::VolumeSource { volume_id: g.id(0) },
                    )),
                }),
                2 if g.chance(0.2) => Some(csi::VolumeContentSource { r#type: None }),
                _ => None,
            };
            Input::CreateVolume(csi::CreateVolumeRequest {
                name: g.name("fz"),
                capacity_range: g.range(),
                volume_capabilities: g.caps(),
                parameters: g.params(),
                secrets: g.secrets(),
                volume_content_source: src,
                accessibility_requirements: g.chance(0.2).then(|| csi::TopologyRequirement {
                    requisite: vec![g.topology()],
                    preferred: vec![g.topology()],
                }),
                mutable_parameters: g.map(&["directIO", "readAheadKiB"]),
            })
        }
        "DeleteVolume" => Input::DeleteVolume(csi::DeleteVolumeRequest {
            volume_id: g.id(0),
            secrets: g.secrets(),
        }),
        "ControllerPublishVolume" => {
            Input::ControllerPublishVolume(csi::ControllerPublishVolumeRequest {
                volume_id: g.id(0),
                node_id: g.pick(&["fuzz-node", "other", ""]).to_string(),
                volume_capability: g.capability(),
                readonly: g.chance(0.3),
                secrets: g.secrets(),
                volume_context: g.context(),
            })
        }
        "ControllerUnpublishVolume" => {
            Input::ControllerUnpublishVolume(csi::ControllerUnpublishVolumeRequest {
                volume_id: g.id(0),
                node_id: g.pick(&["fuzz-node", "other", ""]).to_string(),
                secrets: g.secrets(),
                reason: g.pick(&[0, 1, 2, 3, 99]),
            })
        }
        "ControllerGetNodeInfo" => {
            Input::ControllerGetNodeInfo(csi::ControllerGetNodeInfoRequest {
                node_id: g.pick(&["fuzz-node", "other", ""]).to_string(),
            })
        }
        "ValidateVolumeCapabilities" => {
            Input::ValidateVolumeCapabilities(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: g.id(0),
                volume_context: g.context(),
                volume_capabilities: g.caps(),
                parameters: g.params(),
                secrets: g.secrets(),
                mutable_parameters: g.map(&["directIO", "readAheadKiB"]),
            })
        }
        "ListVolumes" => Input::ListVolumes(csi::ListVolumesRequest {
            max_entries: g.max_entries(),
            starting_token: g.token(),
        }),
        "GetCapacity" => Input::GetCapacity(csi::GetCapacityRequest {
            volume_capabilities: g.caps(),
            parameters: g.params(),
            accessible_topology: g.chance(0.3).then(|| g.topology()),
        }),
        "CreateSnapshot" => Input::CreateSnapshot(csi::CreateSnapshotRequest {
            source_volume_id: g.id(0),
            name: g.name("fs"),
            secrets: g.secrets(),
            parameters: g.map(&["x", "csi.storage.k8s.io/volumesnapshot/name"]),
            // Drawn last, so that saved seeds keep the rest of their request.
            accessibility_requirements: g.chance(0.3).then(|| g.requirement()),
        }),
        "DeleteSnapshot" => Input::DeleteSnapshot(csi::DeleteSnapshotRequest {
            snapshot_id: g.id(1),
            secrets: g.secrets(),
        }),
        "ListSnapshots" => Input::ListSnapshots(csi::ListSnapshotsRequest {
            max_entries: g.max_entries(),
            starting_token: g.token(),
            source_volume_id: if g.chance(0.5) {
                String::new()
            } else {
                g.id(0)
            },
            snapshot_id: if g.chance(0.5) {
                String::new()
            } else {
                g.id(1)
            },
            secrets: g.secrets(),
        }),
        "GetSnapshot" => Input::GetSnapshot(csi::GetSnapshotRequest {
            snapshot_id: g.id(1),
            secrets: g.secrets(),
        }),
        "ControllerExpandVolume" => {
            Input::ControllerExpandVolume(csi::ControllerExpandVolumeRequest {
                volume_id: g.id(0),
                capacity_range: g.range(),
                secrets: g.secrets(),
                volume_capability: g.capability(),
            })
        }
        "ControllerGetVolume" => {
            Input::ControllerGetVolume(csi::ControllerGetVolumeRequest { volume_id: g.id(0) })
        }
        "ControllerModifyVolume" => {
            Input::ControllerModifyVolume(csi::ControllerModifyVolumeRequest {
                volume_id: g.id(0),
                secrets: g.secrets(),
                mutable_parameters: g.map(&["directIO", "readAheadKiB"]),
            })
        }
        "ControllerGetVolumeHealth" => {
            Input::ControllerGetVolumeHealth(csi::ControllerGetVolumeHealthRequest {
                volume_id: g.id(0),
                secrets: g.secrets(),
            })
        }
        "ControllerListVolumeHealth" => {
            Input::ControllerListVolumeHealth(csi::ControllerListVolumeHealthRequest {
                max_entries: g.max_entries(),
                // A volume id is the token a previous page hands out.
                starting_token: if g.chance(0.3) { g.id(0) } else { g.token() },
                secrets: g.secrets(),
            })
        }
        "CreateVolumeGroupSnapshot" => {
            Input::CreateVolumeGroupSnapshot(csi::CreateVolumeGroupSnapshotRequest {
                name: g.name("fg"),
                source_volume_ids: g.ids(0),
                secrets: g.secrets(),
                parameters: g.map(&["x"]),
            })
        }
        "DeleteVolumeGroupSnapshot" => {
            Input::DeleteVolumeGroupSnapshot(csi::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: g.id(2),
                snapshot_ids: g.ids(1),
                secrets: g.secrets(),
            })
        }
        "GetVolumeGroupSnapshot" => {
            Input::GetVolumeGroupSnapshot(csi::GetVolumeGroupSnapshotRequest {
                group_snapshot_id: g.id(2),
                snapshot_ids: g.ids(1),
                secrets: g.secrets(),
            })
        }
        "NodeStageVolume" => Input::NodeStageVolume(csi::NodeStageVolumeRequest {
            volume_id: g.id(0),
            publish_context: g.context(),
            staging_target_path: g.stage_path(),
            volume_capability: g.capability(),
            secrets: g.secrets(),
            volume_context: g.context(),
        }),
        "NodeUnstageVolume" => Input::NodeUnstageVolume(csi::NodeUnstageVolumeRequest {
            volume_id: g.id(0),
            staging_target_path: g.stage_path(),
        }),
        "NodePublishVolume" => {
            let eph = g.chance(0.15);
            let volume_id = if eph {
                format!("csi-fz-eph-{}", g.r.random_range(0..100))
            } else {
                g.id(0)
            };
            let mut volume_context = g.context();
            if eph && g.chance(0.7) {
                volume_context.insert("csi.storage.k8s.io/ephemeral".into(), "true".into());
                if g.sane {
                    volume_context.insert("size".into(), "64Mi".into());
                }
                if g.chance(0.3) {
                    let size = g.pick(&[
                        "0",
                        "1",
                        "-1",
                        "1Ki",
                        "9223372036854775807",
                        "9223372036854775808",
                        "18446744073709551615",
                        "16Ei",
                        "8191Pi",
                        "1e9",
                        "64Mi ",
                    ]);
                    volume_context.insert("size".into(), size.into());
                }
            }
            Input::NodePublishVolume(csi::NodePublishVolumeRequest {
                volume_id,
                publish_context: g.context(),
                staging_target_path: if eph { String::new() } else { g.stage_path() },
                target_path: g.target_path(),
                volume_capability: g.capability(),
                readonly: g.chance(0.3),
                secrets: g.secrets(),
                volume_context,
            })
        }
        "NodeUnpublishVolume" => Input::NodeUnpublishVolume(csi::NodeUnpublishVolumeRequest {
            volume_id: if g.chance(0.15) {
                format!("csi-fz-eph-{}", g.r.random_range(0..100))
            } else {
                g.id(0)
            },
            target_path: g.target_path(),
        }),
        "NodeGetVolumeStats" => Input::NodeGetVolumeStats(csi::NodeGetVolumeStatsRequest {
            volume_id: g.id(0),
            volume_path: g.target_path(),
            staging_target_path: if g.chance(0.5) {
                String::new()
            } else {
                g.stage_path()
            },
        }),
        "NodeExpandVolume" => Input::NodeExpandVolume(csi::NodeExpandVolumeRequest {
            volume_id: g.id(0),
            volume_path: g.target_path(),
            capacity_range: g.range(),
            staging_target_path: if g.chance(0.5) {
                String::new()
            } else {
                g.stage_path()
            },
            volume_capability: g.capability(),
            secrets: g.secrets(),
        }),
        "NodeGetVolumeHealth" => Input::NodeGetVolumeHealth(csi::NodeGetVolumeHealthRequest {
            volume_id: if g.chance(0.15) {
                format!("csi-fz-eph-{}", g.r.random_range(0..100))
            } else {
                g.id(0)
            },
            volume_publish_path: if g.chance(0.4) {
                String::new()
            } else {
                g.target_path()
            },
            staging_target_path: if g.chance(0.4) {
                String::new()
            } else {
                g.stage_path()
            },
        }),
        "NodeGetStorageHealth" => Input::NodeGetStorageHealth(csi::NodeGetStorageHealthRequest {
            secrets: g.secrets(),
        }),
        other => Input::Empty(RPCS.iter().find(|r| **r == other).expect("known rpc")),
    }
}

fn rq<T>(t: T) -> Request<T> {
    Request::new(t)
}

async fn dispatch(s: &Services, input: Input) -> Result<(), Status> {
    use Input::*;
    match input {
        Empty("GetPluginInfo") => s
            .identity
            .get_plugin_info(rq(Default::default()))
            .await
            .map(drop),
        Empty("GetPluginCapabilities") => s
            .identity
            .get_plugin_capabilities(rq(Default::default()))
            .await
            .map(drop),
        Empty("Probe") => s.identity.probe(rq(Default::default())).await.map(drop),
        Empty("ControllerGetCapabilities") => s
            .controller
            .controller_get_capabilities(rq(Default::default()))
            .await
            .map(drop),
        Empty("GroupControllerGetCapabilities") => s
            .group
            .group_controller_get_capabilities(rq(Default::default()))
            .await
            .map(drop),
        Empty("NodeGetCapabilities") => s
            .node
            .node_get_capabilities(rq(Default::default()))
            .await
            .map(drop),
        Empty("NodeGetInfo") => s.node.node_get_info(rq(Default::default())).await.map(drop),
        Empty(other) => panic!("no dispatch for {other}"),
        CreateVolume(r) => s.controller.create_volume(rq(r)).await.map(drop),
        DeleteVolume(r) => s.controller.delete_volume(rq(r)).await.map(drop),
        ControllerPublishVolume(r) => s
            .controller
            .controller_publish_volume(rq(r))
            .await
            .map(drop),
        ControllerUnpublishVolume(r) => s
            .controller
            .controller_unpublish_volume(rq(r))
            .await
            .map(drop),
        ValidateVolumeCapabilities(r) => s
            .controller
            .validate_volume_capabilities(rq(r))
            .await
            .map(drop),
        ListVolumes(r) => s.controller.list_volumes(rq(r)).await.map(drop),
        GetCapacity(r) => s.controller.get_capacity(rq(r)).await.map(drop),
        CreateSnapshot(r) => s.controller.create_snapshot(rq(r)).await.map(drop),
        DeleteSnapshot(r) => s.controller.delete_snapshot(rq(r)).await.map(drop),
        ListSnapshots(r) => s.controller.list_snapshots(rq(r)).await.map(drop),
        GetSnapshot(r) => s.controller.get_snapshot(rq(r)).await.map(drop),
        ControllerExpandVolume(r) => s.controller.controller_expand_volume(rq(r)).await.map(drop),
        ControllerGetVolume(r) => s.controller.controller_get_volume(rq(r)).await.map(drop),
        ControllerModifyVolume(r) => s.controller.controller_modify_volume(rq(r)).await.map(drop),
        ControllerGetVolumeHealth(r) => s
            .controller
            .controller_get_volume_health(rq(r))
            .await
            .map(drop),
        ControllerListVolumeHealth(r) => s
            .controller
            .controller_list_volume_health(rq(r))
            .await
            .map(drop),
        ControllerGetNodeInfo(r) => s.controller.controller_get_node_info(rq(r)).await.map(drop),
        CreateVolumeGroupSnapshot(r) => s.group.create_volume_group_snapshot(rq(r)).await.map(drop),
        DeleteVolumeGroupSnapshot(r) => s.group.delete_volume_group_snapshot(rq(r)).await.map(drop),
        GetVolumeGroupSnapshot(r) => s.group.get_volume_group_snapshot(rq(r)).await.map(drop),
        NodeStageVolume(r) => s.node.node_stage_volume(rq(r)).await.map(drop),
        NodeUnstageVolume(r) => s.node.node_unstage_volume(rq(r)).await.map(drop),
        NodePublishVolume(r) => s.node.node_publish_volume(rq(r)).await.map(drop),
        NodeUnpublishVolume(r) => s.node.node_unpublish_volume(rq(r)).await.map(drop),
        NodeGetVolumeStats(r) => s.node.node_get_volume_stats(rq(r)).await.map(drop),
        NodeExpandVolume(r) => s.node.node_expand_volume(rq(r)).await.map(drop),
        NodeGetVolumeHealth(r) => s.node.node_get_volume_health(rq(r)).await.map(drop),
        NodeGetStorageHealth(r) => s.node.node_get_storage_health(rq(r)).await.map(drop),
    }
}

/// What lies outside the test dirs that a request could touch.
fn outside_fingerprint(test_dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    fn entry(out: &mut BTreeMap<String, String>, p: &Path) {
        if let Ok(m) = std::fs::symlink_metadata(p) {
            out.insert(
                p.display().to_string(),
                format!("{:?} {} {:?}", m.file_type(), m.len(), m.modified().ok()),
            );
        }
    }
    fn walk(out: &mut BTreeMap<String, String>, dir: &Path, depth: usize) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            entry(out, &p);
            if depth > 0 && e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                walk(out, &p, depth - 1);
            }
        }
    }
    walk(&mut out, Path::new("/etc"), 8);
    // Other engineers' builds and tests write below these at the same time: only
    // the names of their entries are compared.
    for d in [
        "/",
        "/var",
        "/var/lib",
        "/root",
        "/run",
        "/usr",
        "/usr/local/bin",
    ] {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            out.insert(e.path().display().to_string(), "exists".into());
        }
    }
    for e in std::fs::read_dir("/tmp").into_iter().flatten().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.contains(MARK) || n.contains("pwned") || n.starts_with("fz") {
            out.insert(format!("/tmp/{n}"), "marker".into());
        }
    }
    // Mounts the driver could make or remove: any mount of the pool's devices
    // (its own loop mount, the volumes' loop devices, binds of its folders),
    // wherever it is, and any mount at the paths outside the test dirs that
    // requests name. Other mounts (a cluster or a build on the same machine)
    // come and go on their own.
    let devices: std::collections::BTreeSet<String> = loop_devices()
        .into_iter()
        .filter(|(_, b)| b.starts_with(test_dir))
        .map(|(d, _)| d)
        .collect();
    let named = |mp: &Path| {
        ["/", "/proc/1/root", "/dev/null"]
            .iter()
            .any(|n| mp == Path::new(n))
            || mp.starts_with("/etc")
    };
    for l in std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
    {
        let f: Vec<&str> = l.split(' ').collect();
        let (Some(mp), Some(dash)) = (f.get(4), f.iter().position(|x| *x == "-")) else {
            continue;
        };
        let mp = Path::new(mp);
        let source = f.get(dash + 2).copied().unwrap_or("");
        if !mp.starts_with(test_dir) && (named(mp) || devices.contains(source)) {
            out.insert(
                format!("mount {} {source}", mp.display()),
                f.get(5).unwrap_or(&"").to_string(),
            );
        }
    }
    out
}

struct Fuzzer {
    services: Services,
    dict: Dict,
    seen: Mutex<BTreeSet<String>>,
    calls: AtomicU64,
    codes: Mutex<BTreeMap<String, u64>>,
    failures: Mutex<Vec<String>>,
    corpus: PathBuf,
    save: bool,
}

/// The shape of an answer: its first words, without ids, numbers or paths.
fn shape(msg: &str) -> String {
    msg.split_whitespace()
        .filter(|w| w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .take(4)
        .collect::<Vec<_>>()
        .join(" ")
}

impl Fuzzer {
    async fn run_one(&self, rpc: &str, seed: u64) {
        let input = generate(rpc, seed, &self.dict);
        let shown = format!("{input:?}");
        let before = PANICS.load(Ordering::SeqCst);
        let r =
            tokio::time::timeout(Duration::from_secs(120), dispatch(&self.services, input)).await;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let (code, msg) = match &r {
            Err(_) => {
                self.failures
                    .lock()
                    .unwrap()
                    .push(format!("HANG {rpc} seed {seed}: {shown}"));
                return;
            }
            Ok(Ok(())) => (Code::Ok, String::new()),
            Ok(Err(s)) => (s.code(), s.message().to_string()),
        };
        if PANICS.load(Ordering::SeqCst) != before || msg.contains("panicked") {
            self.failures.lock().unwrap().push(format!(
                "PANIC {rpc} seed {seed}: {code:?} {msg}\n  request: {}",
                shown.chars().take(2000).collect::<String>()
            ));
        }
        if code == Code::Internal || code == Code::Unknown {
            // Not a failure by itself (a real syscall may fail), but worth reading.
            eprintln!(
                "fuzz: {rpc} seed {seed}: {code:?}: {}",
                msg.chars().take(300).collect::<String>()
            );
        }
        *self
            .codes
            .lock()
            .unwrap()
            .entry(format!("{rpc} {code:?}"))
            .or_default() += 1;
        let sig = format!("{rpc}|{code:?}|{}", shape(&msg));
        let new = self.seen.lock().unwrap().insert(sig);
        if new && self.save {
            let _ = std::fs::create_dir_all(&self.corpus);
            let _ = std::fs::write(
                self.corpus.join(format!("{rpc}-{seed:016x}.txt")),
                format!(
                    "{rpc} {seed}\n# generator {GENERATOR}; answered {code:?}: {}\n# {}\n",
                    msg.chars().take(200).collect::<String>().replace('\n', " "),
                    shown
                        .chars()
                        .take(600)
                        .collect::<String>()
                        .replace('\n', " ")
                ),
            );
        }
    }
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

fn read_corpus() -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(corpus_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let mut it = text.lines().next().unwrap_or("").split_whitespace();
        if let (Some(rpc), Some(seed)) = (it.next(), it.next().and_then(|s| s.parse().ok())) {
            if RPCS.contains(&rpc) {
                out.push((rpc.to_string(), seed));
            }
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_fuzz_every_rpc_with_arbitrary_requests() {
    require_root();
    let secs: u64 = std::env::var("FUZZ_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let save = std::env::var("FUZZ_SAVE").as_deref() == Ok("1");
    let base_seed: u64 = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        prev(info);
    }));

    let pool = Pool::new("xfs");
    let scratch = pool.scratch("fuzz");
    for d in ["stage", "pods"] {
        std::fs::create_dir_all(scratch.join(d)).unwrap();
    }
    std::os::unix::fs::symlink("/etc", scratch.join("pods/link-etc")).unwrap();
    let state = pool.dir.path().join("state");
    let before = outside_fingerprint(pool.dir.path());

    let mut cfg = csi_storage::Config::new(
        "fuzz-node",
        &state,
        vec![("default".to_string(), pool.path.clone())],
    );
    cfg.allowed_path_roots = vec![scratch.clone()];
    let driver = Arc::new(csi_storage::Driver::open(cfg, csi_sys::System::linux()).expect("open"));
    let services = Services {
        identity: csi_identity::IdentityService::new(driver.clone(), true),
        controller: csi_controller::ControllerService::new(driver.controller().unwrap().clone()),
        group: csi_controller::GroupControllerService::new(driver.controller().unwrap().clone()),
        node: csi_node::NodeService::new(driver.node().unwrap().clone()),
    };
    let dict = Dict::below(pool.dir.path());
    let fz = Fuzzer {
        services,
        dict,
        seen: Mutex::new(BTreeSet::new()),
        calls: AtomicU64::new(0),
        codes: Mutex::new(BTreeMap::new()),
        failures: Mutex::new(Vec::new()),
        corpus: corpus_dir(),
        save,
    };

    // 1. The corpus.
    let corpus = read_corpus();
    let started = Instant::now();
    for (rpc, seed) in &corpus {
        fz.run_one(rpc, *seed).await;
    }
    let replay_secs = started.elapsed().as_secs_f64();
    // 2. New inputs, for the time given.
    let mut rng = StdRng::seed_from_u64(base_seed);
    let fuzz_started = Instant::now();
    let mut generated = 0u64;
    while fuzz_started.elapsed() < Duration::from_secs(secs) {
        let rpc = RPCS[rng.random_range(0..RPCS.len())];
        let seed: u64 = rng.random();
        fz.run_one(rpc, seed).await;
        generated += 1;
    }
    let fuzz_secs = fuzz_started.elapsed().as_secs_f64();

    // 3. Undo through the driver what the accepted inputs made, then compare.
    let d = &fz.dict;
    let s = &fz.services;
    for t in 0..5 {
        for id in d
            .volume_ids
            .iter()
            .cloned()
            .chain((0..100).map(|i| format!("csi-fz-eph-{i}")))
        {
            let _ = s
                .node
                .node_unpublish_volume(rq(csi::NodeUnpublishVolumeRequest {
                    volume_id: id,
                    target_path: scratch.join(format!("pods/{t}")).display().to_string(),
                }))
                .await;
        }
    }
    for st in 0..3 {
        for id in &d.volume_ids {
            let _ = s
                .node
                .node_unstage_volume(rq(csi::NodeUnstageVolumeRequest {
                    volume_id: id.clone(),
                    staging_target_path: scratch.join(format!("stage/{st}")).display().to_string(),
                }))
                .await;
        }
    }
    drop(fz.services);
    drop(driver);
    let after = outside_fingerprint(pool.dir.path());
    let mut changed = Vec::new();
    for (k, v) in &after {
        if before.get(k) != Some(v) {
            changed.push(format!("+ {k} {v}"));
        }
    }
    for k in before.keys() {
        if !after.contains_key(k) {
            changed.push(format!("- {k}"));
        }
    }
    for c in &changed {
        println!("fuzz: outside change: {c}");
    }
    let codes = fz.codes.lock().unwrap().clone();
    let failures = fz.failures.lock().unwrap().clone();
    println!(
        "fuzz figures: corpus={} replayed in {replay_secs:.1}s; generated={generated} in \
         {fuzz_secs:.0}s (FUZZ_SECONDS={secs}, FUZZ_SEED={base_seed}); calls={}; signatures={}; \
         panics={}; failures={}; outside changes={}",
        corpus.len(),
        fz.calls.load(Ordering::Relaxed),
        fz.seen.lock().unwrap().len(),
        PANICS.load(Ordering::SeqCst),
        failures.len(),
        changed.len()
    );
    for (k, n) in &codes {
        println!("  {k}: {n}");
    }
    assert!(
        failures.is_empty(),
        "fuzz failures:\n{}",
        failures.join("\n")
    );
    assert!(
        changed.is_empty(),
        "files or mounts changed outside the test dirs:\n{}",
        changed.join("\n")
    );
}

/// `text` with the entries of every map (`{"k": "v", ...}`) sorted: the saved
/// requests were printed when the maps were `HashMap`s, each in an order of
/// its own. A map that the end
/// of `text` cuts off is left out, with what would follow it.
fn maps_sorted(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("{\"") {
        out.push_str(&rest[..i]);
        let Some((mut entries, after)) = map_entries(&rest[i + 1..]) else {
            return out;
        };
        entries.sort_unstable();
        out.push('{');
        out.push_str(&entries.join(", "));
        out.push('}');
        rest = after;
    }
    out + rest
}

/// The `"k": "v"` entries of a map's inside, up to its `}`, and the text after.
fn map_entries(mut s: &str) -> Option<(Vec<&str>, &str)> {
    let mut entries = Vec::new();
    loop {
        let (k, r) = quoted(s)?;
        let (v, r) = quoted(r.strip_prefix(": ")?)?;
        entries.push(&s[..k.len() + 2 + v.len()]);
        match r.strip_prefix(", ") {
            Some(next) => s = next,
            None => return Some((entries, r.strip_prefix('}')?)),
        }
    }
}

/// The Debug-quoted string at the start of `s` (escapes kept), and the rest.
fn quoted(s: &str) -> Option<(&str, &str)> {
    let b = s.as_bytes();
    if b.first() != Some(&b'"') {
        return None;
    }
    let mut i = 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some((&s[..=i], &s[i + 1..])),
            _ => i += 1,
        }
    }
    None
}

/// Whether every bracket of `text` outside its strings is closed: a saved
/// request is cut short after 600 characters (fewer where a later edit of the
/// corpus shortened a string).
fn complete(text: &str) -> bool {
    let mut depth = 0i32;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if c == '"' {
            match quoted(rest) {
                Some((_, after)) => rest = after,
                None => return false,
            }
            continue;
        }
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            _ => {}
        }
        rest = &rest[c.len_utf8()..];
    }
    depth == 0
}

/// Every saved seed still generates the request its file shows, so the corpus
/// keeps meaning what it meant when RPCs are added or fields are drawn after
/// the others. Left out of the comparison: the pool's temporary directory (it
/// differs per run), the order of map entries, and the fields the generator
/// draws since a file was saved.
#[test]
fn saved_seeds_regenerate_the_requests_their_files_show() {
    const DIR: &str = "/tmp/example-csi-testXXXXXX";
    let dict = Dict::below(Path::new(DIR));
    let same_dir = |text: &str| {
        let mut out = String::new();
        let mut rest = text;
        while let Some(i) = rest.find("/tmp/example-csi-test") {
            out.push_str(&rest[..i]);
            out.push_str(DIR);
            rest = rest.get(i + DIR.len()..).unwrap_or("");
        }
        out + rest
    };
    let (mut compared, mut mismatched) = (0, Vec::new());
    for e in std::fs::read_dir(corpus_dir()).unwrap().flatten() {
        let text = std::fs::read_to_string(e.path()).unwrap();
        let mut first = text.lines().next().unwrap_or("").split_whitespace();
        let (Some(rpc), Some(seed)) = (first.next(), first.next().and_then(|s| s.parse().ok()))
        else {
            continue;
        };
        // A file written by hand names the seed without the generated request.
        let Some(saved) = text
            .lines()
            .find(|l| l.starts_with(&format!("# {rpc}(")) || l.starts_with("# Empty("))
        else {
            continue;
        };
        let saved = same_dir(&saved[2..]);
        let mut now = format!("{:?}", generate(rpc, seed, &dict));
        // The last field of a request, drawn after a file was saved.
        for (drawn_later, field) in [
            ("CreateSnapshot", "accessibility_requirements"),
            ("ControllerUnpublishVolume", "reason"),
        ] {
            if rpc == drawn_later && !saved.contains(&format!(", {field}: ")) {
                if let Some(i) = now.find(&format!(", {field}: ")) {
                    now = format!("{} }})", &now[..i]);
                }
            }
        }
        let whole = complete(&saved);
        let (saved, now) = (maps_sorted(&saved), maps_sorted(&now));
        compared += 1;
        if (whole && now != saved) || (!whole && !now.starts_with(&saved)) {
            mismatched.push(format!(
                "{}:\n  saved: {saved}\n  now:   {now}",
                e.path().display()
            ));
        }
    }
    assert!(compared > 200, "only {compared} corpus requests compared");
    assert!(
        mismatched.is_empty(),
        "{} of {compared}:\n{}",
        mismatched.len(),
        mismatched.join("\n")
    );
}
