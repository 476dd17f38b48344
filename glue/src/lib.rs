//! What the gRPC services share: conversion of CSI messages into the domain's
//! types, the one mapping of the domain's errors to gRPC statuses (`status`),
//! redaction of secrets before anything is logged, and the edge of every
//! RPC: one span with the method and volume id, the domain call on a blocking
//! thread with a cancellation token that trips when the caller goes away, the
//! response or the error logged once.

#![forbid(unsafe_code)]

use std::fmt::Debug;
use std::sync::Arc;

use csi_proto::csi::{self, volume_capability};
use std::collections::BTreeMap;

use csi_proto::csi::volume_content_source;
use csi_storage::ids::{SnapshotId, VolumeId};
use csi_storage::model::{
    Access, AccessMode, Capability, CapacityRange, ContentSource, SnapshotRecord, VolumeView,
};
use csi_storage::snapshots::GroupSnapshot;
use csi_storage::volumes::CreateVolume;
use csi_storage::{cancel, health, Core, Driver, Error};
use tonic::Status;
use tracing::Instrument;

pub mod handle;
pub mod memory;
mod status;
pub use status::{code, status};

/// The state every service holds.
pub type Shared = Arc<Driver>;

/// Runs a domain call off the async runtime inside a span named after the RPC,
/// logging the (redacted) request and the response at debug level and an error
/// once, at warn level.
pub async fn call<Req, T, F>(
    method: &'static str,
    volume_id: &str,
    req: &Req,
    f: F,
) -> Result<T, Status>
where
    Req: Redact + Debug + Clone,
    T: Debug + Send + 'static,
    F: FnOnce() -> csi_storage::Result<T> + Send + 'static,
{
    let span = tracing::info_span!("rpc", method, volume.id = %volume_id);
    async move {
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(request = ?Redacted(req), "request");
        }
        let started = std::time::Instant::now();
        let token = cancel::Token::new();
        let mut trip = TripOnDrop(Some(token.clone()));
        let work_span = tracing::Span::current();
        // The driver is busy until the work ends, even when the caller left first.
        let busy = memory::busy();
        let work = move || {
            let _busy = busy;
            let _span = work_span.enter();
            let out = token.run(|| cancel::check().and_then(|()| f()));
            if token.is_cancelled() {
                // Nobody reads this answer: the log is the only place it shows.
                match &out {
                    Ok(_) => tracing::info!("abandoned call ended: it completed, so a retry finds it done"),
                    Err(e) => tracing::warn!(code = ?code(e), error = %e, "abandoned call ended: stopped and undone"),
                }
            }
            out
        };
        let out = tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| Status::internal(format!("the {method} handler failed: {e}")))?;
        trip.0 = None;
        let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
        match out {
            Ok(v) => {
                tracing::debug!(response = ?v, elapsed_ms, "response");
                Ok(v)
            }
            Err(e) => {
                let status = status(e);
                // Messages may quote what the caller sent: keep them to a readable size.
                let status = Status::new(status.code(), shorten(status.message(), MAX_MESSAGE));
                match status.code() {
                    tonic::Code::Internal | tonic::Code::DeadlineExceeded => {
                        tracing::error!(code = ?status.code(), error = %status.message(), elapsed_ms, "failed")
                    }
                    _ => tracing::warn!(code = ?status.code(), error = %status.message(), elapsed_ms, "refused"),
                }
                Err(status)
            }
        }
    }
    .instrument(span)
    .await
}

/// Trips the call's cancellation token when the RPC's future is dropped before
/// the blocking work has answered: tonic drops it when the client's deadline
/// (`grpc-timeout`) passes or the client cancels or disconnects. The work then
/// stops at its next safe point and undoes itself (see `csi_storage::cancel`).
struct TripOnDrop(Option<cancel::Token>);

impl Drop for TripOnDrop {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            tracing::info!("the caller went away (cancelled, deadline passed or disconnected); stopping its work");
            t.cancel();
        }
    }
}

/// Longest error message sent or logged, in bytes.
pub const MAX_MESSAGE: usize = 1024;

/// Cuts `s` to at most `max` bytes on a character boundary, saying so.
pub fn shorten(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes cut)", &s[..end], s.len() - end)
}

/// Requests that may carry secrets clear their values before being logged.
pub trait Redact {
    fn redact(&mut self) {}
}

struct Redacted<'a, R>(&'a R);

impl<R: Redact + Debug + Clone> Debug for Redacted<'_, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut copy = self.0.clone();
        copy.redact();
        copy.fmt(f)
    }
}

macro_rules! no_secrets {
    ($($t:ty),* $(,)?) => { $(impl Redact for $t {})* };
}
macro_rules! with_secrets {
    ($($t:ty),* $(,)?) => { $(impl Redact for $t {
        fn redact(&mut self) {
            for v in self.secrets.values_mut() {
                *v = "<redacted>".into();
            }
        }
    })* };
}

no_secrets!(
    csi::GetPluginInfoRequest,
    csi::GetPluginCapabilitiesRequest,
    csi::ProbeRequest,
    csi::ListVolumesRequest,
    csi::ControllerGetVolumeRequest,
    csi::GetCapacityRequest,
    csi::ControllerGetCapabilitiesRequest,
    csi::NodeUnstageVolumeRequest,
    csi::NodeUnpublishVolumeRequest,
    csi::NodeGetVolumeStatsRequest,
    csi::NodeGetCapabilitiesRequest,
    csi::NodeGetInfoRequest,
    csi::GroupControllerGetCapabilitiesRequest,
    csi::NodeGetVolumeHealthRequest,
    csi::ControllerGetNodeInfoRequest,
);
with_secrets!(
    csi::ControllerListVolumeHealthRequest,
    csi::ControllerGetVolumeHealthRequest,
    csi::NodeGetStorageHealthRequest,
    csi::CreateVolumeRequest,
    csi::DeleteVolumeRequest,
    csi::ControllerPublishVolumeRequest,
    csi::ControllerUnpublishVolumeRequest,
    csi::ValidateVolumeCapabilitiesRequest,
    csi::ControllerModifyVolumeRequest,
    csi::CreateSnapshotRequest,
    csi::DeleteSnapshotRequest,
    csi::ListSnapshotsRequest,
    csi::GetSnapshotRequest,
    csi::ControllerExpandVolumeRequest,
    csi::NodeStageVolumeRequest,
    csi::NodePublishVolumeRequest,
    csi::NodeExpandVolumeRequest,
    csi::CreateVolumeGroupSnapshotRequest,
    csi::DeleteVolumeGroupSnapshotRequest,
    csi::GetVolumeGroupSnapshotRequest,
);

// ---- conversions ----

pub fn access_mode(m: Option<&volume_capability::AccessMode>) -> AccessMode {
    use volume_capability::access_mode::Mode;
    match m.and_then(|m| Mode::try_from(m.mode).ok()) {
        Some(Mode::SingleNodeWriter) => AccessMode::SingleNodeWriter,
        Some(Mode::SingleNodeReaderOnly) => AccessMode::SingleNodeReaderOnly,
        Some(Mode::SingleNodeSingleWriter) => AccessMode::SingleNodeSingleWriter,
        Some(Mode::SingleNodeMultiWriter) => AccessMode::SingleNodeMultiWriter,
        Some(Mode::MultiNodeReaderOnly) => AccessMode::MultiNodeReaderOnly,
        Some(Mode::MultiNodeSingleWriter) => AccessMode::MultiNodeSingleWriter,
        Some(Mode::MultiNodeMultiWriter) => AccessMode::MultiNodeMultiWriter,
        Some(Mode::Unknown) | None => AccessMode::Unknown,
    }
}

/// Converts a capability; a missing access type is INVALID_ARGUMENT.
pub fn capability(c: &csi::VolumeCapability) -> Result<Capability, Error> {
    let access = match &c.access_type {
        Some(volume_capability::AccessType::Block(_)) => Access::Block,
        Some(volume_capability::AccessType::Mount(m)) => Access::Mount {
            fs_type: m.fs_type.clone(),
            mount_flags: m.mount_flags.clone(),
            volume_mount_group: m.volume_mount_group.clone(),
        },
        None => return Err(Error::invalid("volume_capability.access_type is required")),
    };
    if c.access_mode.is_none() {
        return Err(Error::invalid("volume_capability.access_mode is required"));
    }
    Ok(Capability {
        access,
        mode: access_mode(c.access_mode.as_ref()),
    })
}

pub fn capabilities(cs: &[csi::VolumeCapability]) -> Result<Vec<Capability>, Error> {
    cs.iter().map(capability).collect()
}

pub fn optional_capability(c: Option<&csi::VolumeCapability>) -> Result<Option<Capability>, Error> {
    c.map(capability).transpose()
}

pub fn capacity(r: Option<&csi::CapacityRange>) -> CapacityRange {
    r.map(|r| CapacityRange {
        required: r.required_bytes,
        limit: r.limit_bytes,
    })
    .unwrap_or_default()
}

/// What a request sends for at least `bytes` and no limit: the wire form of
/// `CapacityRange::at_least`, for those that build requests (the client, the
/// bench, the tests).
pub fn capacity_at_least(bytes: i64) -> Option<csi::CapacityRange> {
    Some(csi::CapacityRange {
        required_bytes: bytes,
        limit_bytes: 0,
    })
}

pub use csi_storage::model::TOPOLOGY_KEY;

/// A volume as CSI carries it, in the node's topology `at` (made once for a
/// page of many).
pub fn volume(at: &csi::Topology, v: &VolumeView) -> csi::Volume {
    csi::Volume {
        capacity_bytes: bytes(v.size),
        volume_id: v.id.to_string(),
        volume_context: {
            // Inserted one by one: a collect would gather and sort them first.
            let mut m = BTreeMap::new();
            for (key, value) in v.context() {
                m.insert(key.to_string(), value.to_string());
            }
            m
        },
        content_source: v.source.map(|s| csi::VolumeContentSource {
            r#type: Some(match s {
                ContentSource::Snapshot(id) => {
                    volume_content_source::Type::Snapshot(volume_content_source::SnapshotSource {
                        snapshot_id: id.to_string(),
                    })
                }
                ContentSource::Volume(id) => {
                    volume_content_source::Type::Volume(volume_content_source::VolumeSource {
                        volume_id: id.to_string(),
                    })
                }
            }),
        }),
        accessible_topology: vec![at.clone()],
    }
}

/// The domain's CreateVolume from CSI's.
pub fn create_volume(r: &csi::CreateVolumeRequest) -> Result<CreateVolume, Error> {
    let (requisite, preferred) = r
        .accessibility_requirements
        .as_ref()
        .map(|a| {
            let seg = |ts: &[csi::Topology]| ts.iter().map(|t| t.segments.clone()).collect();
            (seg(&a.requisite), seg(&a.preferred))
        })
        .unwrap_or_default();
    Ok(CreateVolume {
        name: r.name.clone(),
        capacity: capacity(r.capacity_range.as_ref()),
        capabilities: capabilities(&r.volume_capabilities)?,
        parameters: r.parameters.clone(),
        mutable_parameters: r.mutable_parameters.clone(),
        source: content_source(r.volume_content_source.as_ref())?,
        requisite,
        preferred,
    })
}

pub fn content_source(
    s: Option<&csi::VolumeContentSource>,
) -> Result<Option<ContentSource>, Error> {
    let Some(s) = s else { return Ok(None) };
    match &s.r#type {
        Some(volume_content_source::Type::Snapshot(snap)) => Ok(Some(ContentSource::Snapshot(
            SnapshotId::parse_existing(&snap.snapshot_id)?,
        ))),
        Some(volume_content_source::Type::Volume(vol)) => Ok(Some(ContentSource::Volume(
            VolumeId::parse_existing(&vol.volume_id)?,
        ))),
        None => Err(Error::invalid(
            "volume_content_source names no snapshot or volume",
        )),
    }
}

/// A volume of this node as CSI carries it.
pub fn volume_of(core: &Core, v: &VolumeView) -> csi::Volume {
    volume(&topology(core), v)
}

/// The Controller capabilities of a driver with these options, the same for
/// a controller on its own pools and for the router of a multi-node cluster.
pub fn controller_capabilities(
    enable_attach: bool,
    controller_expansion: bool,
    modify_volume: bool,
) -> Vec<csi::ControllerServiceCapability> {
    use csi::controller_service_capability::{rpc::Type as T, Rpc, Type};
    let mut caps = vec![
        T::CreateDeleteVolume,
        T::ListVolumes,
        T::GetCapacity,
        T::CreateDeleteSnapshot,
        T::ListSnapshots,
        T::CloneVolume,
        T::GetVolume,
        T::SingleNodeMultiWriter,
        T::GetSnapshot,
        T::GetVolumeHealth,
        T::ListVolumeHealth,
    ];
    if enable_attach {
        // GET_NODE_INFO needs PUBLISH_UNPUBLISH_VOLUME.
        caps.extend([
            T::PublishUnpublishVolume,
            T::PublishReadonly,
            T::ListVolumesPublishedNodes,
            T::GetNodeInfo,
        ]);
    }
    if controller_expansion {
        caps.push(T::ExpandVolume);
    }
    if modify_volume {
        caps.push(T::ModifyVolume);
    }
    caps.into_iter()
        .map(|t| csi::ControllerServiceCapability {
            r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })),
        })
        .collect()
}

/// A snapshot of this node as CSI carries it.
pub fn snapshot_of(d: &csi_storage::Controller, s: &SnapshotRecord) -> csi::Snapshot {
    csi::Snapshot {
        size_bytes: bytes(s.restore_size()),
        snapshot_id: s.id.to_string(),
        source_volume_id: s.source_volume.to_string(),
        creation_time: Some(timestamp(s.created)),
        ready_to_use: true,
        group_snapshot_id: s.group.map(|g| g.to_string()).unwrap_or_default(),
        // A snapshot is in a pool of the node that took it. On a mesh, its
        // data (an image, or a directory's packed tree) moves to wherever a
        // restore is asked for: no topology is said, which CSI reads as
        // "every node". Without a mesh only its own node can restore it.
        accessible_topology: match d.on_mesh() {
            true => vec![],
            false => vec![topology(d)],
        },
    }
}

/// A group snapshot of this node as CSI carries it.
pub fn group_snapshot_of(
    d: &csi_storage::Controller,
    g: &GroupSnapshot,
) -> csi::VolumeGroupSnapshot {
    csi::VolumeGroupSnapshot {
        group_snapshot_id: g.group.id.to_string(),
        snapshots: g.members.iter().map(|s| snapshot_of(d, s)).collect(),
        creation_time: Some(timestamp(g.group.created)),
        ready_to_use: true,
    }
}

pub fn topology(core: &Core) -> csi::Topology {
    csi::Topology {
        segments: core.topology(),
    }
}

/// A volume's health as CSI carries it.
pub fn volume_health(h: &health::VolumeHealth) -> csi::VolumeHealth {
    use csi::volume_health::VolumeHealthEntry;
    use csi::VolumeHealthErrorType as T;
    csi::VolumeHealth {
        volume_id: h.volume_id.clone(),
        health_statuses: h
            .problems
            .iter()
            .map(|p| VolumeHealthEntry {
                status: match p.severity {
                    health::Severity::Degraded => T::Degraded,
                    health::Severity::Inaccessible => T::Inaccessible,
                    health::Severity::DataLoss => T::DataLoss,
                } as i32,
                reason: p.reason.to_string(),
                message: p.message.clone(),
            })
            .collect(),
    }
}

pub fn timestamp(t: csi_storage::model::Timestamp) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.seconds,
        nanos: t.nanos,
    }
}

pub fn bytes(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A gRPC channel to a CSI endpoint (`unix:///path`, a bare path, or
/// `tcp://host:port`), for the client, the benchmark and the tests.
pub async fn connect(endpoint: &str) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    use tonic::transport::Endpoint;
    if let Some(addr) = endpoint.strip_prefix("tcp://") {
        return Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await;
    }
    let path = endpoint
        .strip_prefix("unix://")
        .unwrap_or(endpoint)
        .to_string();
    Endpoint::from_static("http://csi.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_reach_a_rendering() {
        let req = csi::CreateVolumeRequest {
            name: "pvc-1".into(),
            secrets: [
                ("password".to_string(), "hunter2".to_string()),
                ("k\"x".into(), "v}\"{".into()),
            ]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        let text = format!("{:?}", Redacted(&req));
        assert!(!text.contains("hunter2"), "{text}");
        assert!(!text.contains("v}"), "{text}");
        assert!(text.contains("password"), "{text}");
        assert!(text.contains("pvc-1"));
        let text = format!("{:?}", Redacted(&req));
        assert!(!text.contains("hunter2") && text.contains("<redacted>"));
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        let long = "é".repeat(1000);
        let short = shorten(&long, 11);
        assert!(
            short.starts_with("ééééé") && short.contains("bytes cut"),
            "{short}"
        );
        assert_eq!(shorten("abc", 10), "abc");
    }

    #[test]
    fn capability_without_access_type_is_invalid() {
        let c = csi::VolumeCapability {
            access_type: None,
            access_mode: Some(volume_capability::AccessMode { mode: 1 }),
        };
        assert!(capability(&c).is_err());
    }
}
