//! The CSI SnapshotMetadata service: changed block tracking of image snapshots.
//! The domain computes the ranges on a blocking thread; the handler then streams
//! them in messages of at most max_results ranges. Secrets are ignored (the
//! external-snapshot-metadata sidecar authenticates callers) and never logged.

use std::fmt;
use std::sync::Arc;

use csi_glue::{bytes, call, Redact};
use csi_proto::csi::{self, snapshot_metadata_server::SnapshotMetadata, BlockMetadataType};
use csi_storage::metadata::{BlockMap, ByteRange};
use csi_storage::Controller as Domain;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

pub struct SnapshotMetadataService {
    controller: Arc<Domain>,
}

impl SnapshotMetadataService {
    pub fn new(controller: Arc<Domain>) -> Self {
        SnapshotMetadataService { controller }
    }
}

/// A request as it may be logged: its secrets' values already replaced.
#[derive(Clone)]
struct Shown<T>(T);

impl<T: fmt::Debug> fmt::Debug for Shown<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<T> Redact for Shown<T> {}

fn hide(secrets: &mut std::collections::BTreeMap<String, String>) {
    for v in secrets.values_mut() {
        *v = "<redacted>".into();
    }
}

fn block_metadata(batch: &[ByteRange]) -> Vec<csi::BlockMetadata> {
    batch
        .iter()
        .map(|r| csi::BlockMetadata {
            byte_offset: bytes(r.offset),
            size_bytes: bytes(r.length),
        })
        .collect()
}

/// Streams `map` as messages built by `make(capacity, ranges)`, stopping when the
/// caller goes away.
fn stream<T: Send + 'static>(
    map: BlockMap,
    make: fn(i64, Vec<csi::BlockMetadata>) -> T,
) -> ReceiverStream<Result<T, Status>> {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        let capacity = bytes(map.capacity);
        for batch in map.batches() {
            let msg = make(capacity, block_metadata(batch));
            if tx.send(Ok(msg)).await.is_err() {
                tracing::debug!("the caller closed the metadata stream");
                break;
            }
        }
    });
    ReceiverStream::new(rx)
}

#[tonic::async_trait]
impl SnapshotMetadata for SnapshotMetadataService {
    type GetMetadataAllocatedStream =
        ReceiverStream<Result<csi::GetMetadataAllocatedResponse, Status>>;
    type GetMetadataDeltaStream = ReceiverStream<Result<csi::GetMetadataDeltaResponse, Status>>;

    async fn get_metadata_allocated(
        &self,
        req: Request<csi::GetMetadataAllocatedRequest>,
    ) -> Result<Response<Self::GetMetadataAllocatedStream>, Status> {
        let mut r = req.into_inner();
        hide(&mut r.secrets);
        let d = self.controller.clone();
        let (id, start, max) = (r.snapshot_id.clone(), r.starting_offset, r.max_results);
        let map = call("GetMetadataAllocated", "", &Shown(r), move || {
            d.metadata_allocated(&id, start, max)
        })
        .await?;
        Ok(Response::new(stream(map, |capacity, block_metadata| {
            csi::GetMetadataAllocatedResponse {
                block_metadata_type: BlockMetadataType::VariableLength as i32,
                volume_capacity_bytes: capacity,
                block_metadata,
            }
        })))
    }

    async fn get_metadata_delta(
        &self,
        req: Request<csi::GetMetadataDeltaRequest>,
    ) -> Result<Response<Self::GetMetadataDeltaStream>, Status> {
        let mut r = req.into_inner();
        hide(&mut r.secrets);
        let d = self.controller.clone();
        let (base, target) = (r.base_snapshot_id.clone(), r.target_snapshot_id.clone());
        let (start, max) = (r.starting_offset, r.max_results);
        let map = call("GetMetadataDelta", "", &Shown(r), move || {
            d.metadata_delta(&base, &target, start, max)
        })
        .await?;
        Ok(Response::new(stream(map, |capacity, block_metadata| {
            csi::GetMetadataDeltaResponse {
                block_metadata_type: BlockMetadataType::VariableLength as i32,
                volume_capacity_bytes: capacity,
                block_metadata,
            }
        })))
    }
}
