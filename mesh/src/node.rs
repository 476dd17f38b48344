//! A node agent's own mesh services: the Transfer service (its holds, read by
//! the node they are for) and the Agent service (arriving volumes made for the
//! controller, the peers' addresses, the transfers' state); and the source
//! through which this node's arrivals read another node's hold.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use csi_proto::mesh::{
    self, agent_server::Agent, read_response, transfer_client::TransferClient,
    transfer_server::Transfer,
};
use csi_storage::controller::transfer::{
    ArrivingFrom, HoldSource, Piece, Received, Source, Sources, Sum, Trailer, TransferStatus,
};
use csi_storage::ids::{SnapshotId, VolumeId};
use csi_storage::Controller;
use prost::Message;
use tokio_stream::Stream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::tls::{self, Caller, Peer, Role};

/// Largest message of the mesh: a piece (1 MiB) and its framing.
pub const MAX_MESH_MESSAGE: usize = 2 * 1024 * 1024;
/// The HTTP/2 flow-control window of a transfer's stream: several pieces in
/// flight.
pub const PIECE_WINDOW: u32 = 16 * 1024 * 1024;
/// Pieces buffered between the network and the writer.
const IN_FLIGHT: usize = 8;
/// Longest silence of a source before its stream counts as cut.
const SILENCE: Duration = Duration::from_secs(60);

/// Where the other nodes' agents listen, as the controller last said.
#[derive(Default)]
pub struct Peers {
    addresses: RwLock<BTreeMap<String, String>>,
}

impl Peers {
    pub fn set(&self, peers: BTreeMap<String, String>) {
        *self.addresses.write().unwrap_or_else(|p| p.into_inner()) = peers;
    }

    pub fn get(&self, node: &str) -> Option<String> {
        self.addresses
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
            .cloned()
    }
}

fn status(e: csi_storage::Error) -> Status {
    csi_glue::status(e)
}

/// Runs a domain call off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> csi_storage::Result<T> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("the handler failed: {e}")))?
        .map_err(status)
}

fn require_controller<T>(creds: &tls::Credentials, req: &Request<T>) -> Result<(), Status> {
    match creds.caller(req) {
        Caller::Peer(Peer::Controller) => Ok(()),
        _ => Err(Status::permission_denied(
            "only the cluster's controller may call this",
        )),
    }
}

/// A node's Transfer service.
pub struct TransferService {
    controller: Arc<Controller>,
    creds: tls::Shared,
}

impl TransferService {
    pub fn new(controller: Arc<Controller>, creds: tls::Shared) -> Self {
        TransferService { controller, creds }
    }
}

impl TransferService {
    /// A hold is read and let go by the node it is for, showing the hold's
    /// token, and no other: a node's certificate alone is not enough, as
    /// every node holds the key that signs nodes' certificates.
    fn refuse_other_nodes(
        &self,
        transfer_id: &str,
        peer_digest: &str,
        token: &str,
    ) -> Result<(), Status> {
        let held = self
            .controller
            .holds()
            .into_iter()
            .find(|h| h.transfer_id == transfer_id);
        match held {
            Some(h) if csi_glue::handle::digest(&h.target_node) != peer_digest => {
                Err(Status::permission_denied(format!(
                    "transfer {transfer_id:?} is for node {}, not for the caller",
                    h.target_node
                )))
            }
            Some(h) if !h.token_is(token) => Err(Status::permission_denied(format!(
                "transfer {transfer_id:?}: the read token is not the hold's"
            ))),
            _ => Ok(()),
        }
    }
}

type Pieces = Pin<Box<dyn Stream<Item = Result<mesh::ReadResponse, Status>> + Send>>;

fn to_message(r: Received) -> mesh::ReadResponse {
    let chunk = |offset, length, data, digest: Option<[u8; 32]>, patch| {
        read_response::Item::Chunk(mesh::Chunk {
            offset,
            length,
            data,
            zero: digest.is_none(),
            digest: digest.map(|d| d.to_vec()).unwrap_or_default(),
            patch,
        })
    };
    let item = match r {
        Received::Piece(p) => {
            let patch = p.is_patch();
            match p {
                Piece::Data {
                    offset,
                    data,
                    digest,
                }
                | Piece::Patch {
                    offset,
                    data,
                    digest,
                } => chunk(offset, data.len() as u64, data, Some(digest), patch),
                Piece::Zero { offset, length } | Piece::Clear { offset, length } => {
                    chunk(offset, length, Default::default(), None, patch)
                }
            }
        }
        Received::Trailer(t) => read_response::Item::Trailer(mesh::Trailer {
            digest: t.digest.to_vec(),
            chunks: t.pieces,
            data_bytes: t.data_bytes,
            incremental: t.incremental,
        }),
    };
    mesh::ReadResponse { item: Some(item) }
}

fn from_message(m: mesh::ReadResponse) -> Result<Received, String> {
    match m.item {
        Some(read_response::Item::Chunk(c)) if c.zero => {
            let (offset, length) = (c.offset, c.length);
            Ok(Received::Piece(if c.patch {
                Piece::Clear { offset, length }
            } else {
                Piece::Zero { offset, length }
            }))
        }
        Some(read_response::Item::Chunk(c)) => {
            let digest = <[u8; 32]>::try_from(c.digest.as_slice())
                .map_err(|_| "a piece without a digest".to_string())?;
            if c.data.len() as u64 != c.length {
                return Err(format!(
                    "a piece of {} bytes said {}",
                    c.data.len(),
                    c.length
                ));
            }
            let (offset, data) = (c.offset, c.data);
            Ok(Received::Piece(if c.patch {
                Piece::Patch {
                    offset,
                    data,
                    digest,
                }
            } else {
                Piece::Data {
                    offset,
                    data,
                    digest,
                }
            }))
        }
        Some(read_response::Item::Trailer(t)) => Ok(Received::Trailer(Trailer {
            digest: <[u8; 32]>::try_from(t.digest.as_slice())
                .map_err(|_| "a trailer without a digest".to_string())?,
            pieces: t.chunks,
            data_bytes: t.data_bytes,
            incremental: t.incremental,
        })),
        None => Err("an empty message".into()),
    }
}

#[tonic::async_trait]
impl Transfer for TransferService {
    async fn hold(
        &self,
        req: Request<mesh::HoldRequest>,
    ) -> Result<Response<mesh::HoldResponse>, Status> {
        require_controller(&self.creds, &req)?;
        let r = req.into_inner();
        let source = match r.source {
            Some(mesh::hold_request::Source::SnapshotId(s)) => {
                HoldSource::Snapshot(SnapshotId::parse_existing(&s).map_err(status)?)
            }
            Some(mesh::hold_request::Source::VolumeId(v)) => {
                HoldSource::Volume(VolumeId::parse_existing(&v).map_err(status)?)
            }
            None => return Err(Status::invalid_argument("a hold names its source")),
        };
        let c = self.controller.clone();
        let h = blocking(move || c.hold(&r.transfer_id, &r.target_node, source)).await?;
        Ok(Response::new(mesh::HoldResponse {
            size: h.size,
            fs_type: h.fs_type.unwrap_or_default(),
            source_volume_id: h.source_volume.to_string(),
            requested: h.requested.unwrap_or(0),
            kind: if h.tree.is_some() { "dir" } else { "image" }.into(),
            read_token: h.read_token,
            volume_size: h.tree.unwrap_or(h.size),
            base: h.base,
        }))
    }

    type ReadStream = Pieces;

    async fn read(&self, req: Request<mesh::ReadRequest>) -> Result<Response<Pieces>, Status> {
        let peer = match self.creds.caller(&req) {
            Caller::Peer(Peer::Node(digest)) => digest,
            _ => return Err(Status::permission_denied("only a node agent reads a hold")),
        };
        let r = req.into_inner();
        self.refuse_other_nodes(&r.transfer_id, &peer, &r.read_token)?;
        let c = self.controller.clone();
        let base = Some(r.base_transfer_id.clone()).filter(|b| !b.is_empty());
        let stream = blocking(move || {
            let is_peer = move |node: &str| csi_glue::handle::digest(node) == peer;
            c.hold_stream(
                &r.transfer_id,
                &is_peer,
                &r.read_token,
                r.from,
                base.as_deref(),
                r.patches,
            )
            .map(|s| s.summed(if r.xxh3 { Sum::Xxh3 } else { Sum::Blake3 }))
        })
        .await?;
        // Pieces are read on a blocking thread and sent as the network takes
        // them: a slow reader holds back the disk, not memory.
        let (tx, rx) = tokio::sync::mpsc::channel(IN_FLIGHT);
        tokio::task::spawn_blocking(move || {
            for item in stream {
                let msg = item.map(to_message).map_err(status);
                if tx.blocking_send(msg).is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn release(
        &self,
        req: Request<mesh::ReleaseRequest>,
    ) -> Result<Response<mesh::ReleaseResponse>, Status> {
        let caller = self.creds.caller(&req);
        let r = req.into_inner();
        match caller {
            Caller::Peer(Peer::Controller) => {}
            Caller::Peer(Peer::Node(digest)) => {
                self.refuse_other_nodes(&r.transfer_id, &digest, &r.read_token)?
            }
            Caller::Local | Caller::Stranger => {
                return Err(Status::permission_denied("a mesh certificate is needed"))
            }
        }
        let c = self.controller.clone();
        blocking(move || c.release_hold(&r.transfer_id, r.keep_as_base)).await?;
        Ok(Response::new(mesh::ReleaseResponse {}))
    }
}

/// A node's Agent service.
pub struct AgentService {
    controller: Arc<Controller>,
    peers: Arc<Peers>,
    /// None on the node's own socket, where no call has a certificate.
    creds: Option<tls::Shared>,
}

impl AgentService {
    pub fn new(controller: Arc<Controller>, peers: Arc<Peers>, creds: Option<tls::Shared>) -> Self {
        AgentService {
            controller,
            peers,
            creds,
        }
    }

    /// Who called: on the node's own socket, the node's own tools.
    fn caller<T>(&self, req: &Request<T>) -> Caller {
        match &self.creds {
            Some(c) => c.caller(req),
            None => Caller::Local,
        }
    }

    fn require_controller<T>(&self, req: &Request<T>) -> Result<(), Status> {
        match self.caller(req) {
            Caller::Peer(Peer::Controller) => Ok(()),
            _ => Err(Status::permission_denied(
                "only the cluster's controller may call this",
            )),
        }
    }
}

pub fn status_message(s: TransferStatus) -> mesh::TransferStatus {
    let (claim_namespace, claim_name) = s.claim.unwrap_or_default();
    mesh::TransferStatus {
        transfer_id: s.transfer_id,
        role: s.role,
        volume_id: s.volume_id,
        peer_node: s.peer_node,
        state: s.state,
        bytes_done: s.bytes_done,
        bytes_total: s.bytes_total,
        rate: s.rate,
        message: s.message,
        incremental: s.incremental,
        claim_namespace,
        claim_name,
        resumed: s.resumed,
        data_bytes: s.data_bytes,
        ended_seconds: s.ended_seconds,
    }
}

/// The events of a node's part of a group snapshot.
type PartEvents = Pin<Box<dyn Stream<Item = Result<mesh::GroupPartEvent, Status>> + Send>>;

/// How often a part waiting for go looks at its call.
const PART_TICK: Duration = Duration::from_millis(20);

/// The controller's side of a part: go, or the call closed or broken, which
/// trips the part's token (its work stops at its next safe point: the freeze
/// is lifted, the part undone).
async fn watch_steps(
    mut steps: tonic::Streaming<mesh::GroupPartStep>,
    go: std::sync::mpsc::Sender<()>,
    token: csi_storage::cancel::Token,
) {
    loop {
        match steps.message().await {
            Ok(Some(step)) if step.go => {
                let _ = go.send(());
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                token.cancel();
                return;
            }
        }
    }
}

/// Says that a part is frozen, then waits for go: at most `wait`, and only
/// while the call lasts.
fn frozen_then_go(
    events: &tokio::sync::mpsc::Sender<Result<mesh::GroupPartEvent, Status>>,
    go: &std::sync::mpsc::Receiver<()>,
    wait: Duration,
    group: &str,
) -> csi_storage::Result<()> {
    use std::sync::mpsc::RecvTimeoutError;
    let said = events.blocking_send(Ok(mesh::GroupPartEvent {
        frozen: true,
        ..Default::default()
    }));
    if said.is_err() {
        return Err(csi_storage::Error::Cancelled(
            "the controller left before the part was frozen".into(),
        ));
    }
    let until = std::time::Instant::now() + wait;
    loop {
        match go.recv_timeout(PART_TICK) {
            Ok(()) => return Ok(()),
            Err(RecvTimeoutError::Disconnected) => {
                return Err(csi_storage::Error::Cancelled(
                    "the controller left before every part was frozen".into(),
                ))
            }
            Err(RecvTimeoutError::Timeout) => {
                csi_storage::cancel::check()?;
                if std::time::Instant::now() >= until {
                    return Err(csi_storage::Error::Aborted(format!(
                        "the other nodes' parts of group snapshot {group:?} were not frozen \
                         within {wait:?}: this part is thawed and undone"
                    )));
                }
            }
        }
    }
}

#[tonic::async_trait]
impl Agent for AgentService {
    type TakeGroupPartStream = PartEvents;

    async fn take_group_part(
        &self,
        req: Request<tonic::Streaming<mesh::GroupPartStep>>,
    ) -> Result<Response<PartEvents>, Status> {
        self.require_controller(&req)?;
        let mut steps = req.into_inner();
        let first = steps
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("the part's request is required"))?;
        let r = csi_proto::csi::CreateVolumeGroupSnapshotRequest::decode(first.create.as_slice())
            .map_err(|e| {
            Status::invalid_argument(format!("the CreateVolumeGroupSnapshot request: {e}"))
        })?;
        let (events, out) = tokio::sync::mpsc::channel(4);
        let (go, gone) = std::sync::mpsc::channel::<()>();
        let token = csi_storage::cancel::Token::new();
        let watch = token.clone();
        tokio::spawn(watch_steps(steps, go, watch));
        let c = self.controller.clone();
        let wait = c.cfg.freeze_timeout;
        tokio::task::spawn_blocking(move || {
            let froze = AtomicBool::new(false);
            let barrier = || {
                froze.store(true, Ordering::SeqCst);
                frozen_then_go(&events, &gone, wait, &r.name)
            };
            let made = token.run(|| {
                csi_storage::cancel::check()?;
                c.create_group_snapshot_part(&r.name, &r.source_volume_ids, &r.parameters, &barrier)
            });
            if let Err(e) = &made {
                tracing::warn!(group = %r.name, error = %e,
                    "this node's part of a group snapshot across nodes is not taken (undone)");
            }
            let event = made.map_err(status).map(|g| mesh::GroupPartEvent {
                frozen: false,
                group: csi_glue::group_snapshot_of(&c, &g).encode_to_vec(),
                existed: !froze.load(Ordering::SeqCst),
            });
            let _ = events.blocking_send(event);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    async fn create_arriving_volume(
        &self,
        req: Request<mesh::CreateArrivingVolumeRequest>,
    ) -> Result<Response<mesh::CreateArrivingVolumeResponse>, Status> {
        self.require_controller(&req)?;
        let r = req.into_inner();
        let csi = csi_proto::csi::CreateVolumeRequest::decode(r.create_volume.as_slice())
            .map_err(|e| Status::invalid_argument(format!("the CreateVolume request: {e}")))?;
        let hold = r
            .hold
            .ok_or_else(|| Status::invalid_argument("the source's hold is required"))?;
        let tree = match hold.kind.as_str() {
            "" | "image" => None,
            "dir" => Some(hold.volume_size),
            k => {
                return Err(Status::invalid_argument(format!(
                    "a hold of kind {k:?}: this node takes \"image\" and \"dir\""
                )))
            }
        };
        let claim = claim_of(&csi.parameters);
        let create = csi_glue::create_volume(&csi).map_err(status)?;
        let from = ArrivingFrom {
            node: r.source_node,
            transfer_id: r.transfer_id,
            size: hold.size,
            fs_type: Some(hold.fs_type).filter(|f| !f.is_empty()),
            requested: Some(hold.requested).filter(|r| *r > 0),
            source_volume: hold.source_volume_id,
            claim,
            read_token: hold.read_token,
            tree,
        };
        let c = self.controller.clone();
        let (v, data_whole) = blocking(move || {
            let v = c.create_arriving_volume(create, from)?;
            let whole = !c.is_arriving(v.id);
            Ok((v, whole))
        })
        .await?;
        let volume = csi_glue::volume_of(&self.controller, &v.view());
        Ok(Response::new(mesh::CreateArrivingVolumeResponse {
            volume: volume.encode_to_vec(),
            data_whole,
        }))
    }

    async fn set_peers(
        &self,
        req: Request<mesh::SetPeersRequest>,
    ) -> Result<Response<mesh::SetPeersResponse>, Status> {
        self.require_controller(&req)?;
        self.peers.set(req.into_inner().peers.into_iter().collect());
        Ok(Response::new(mesh::SetPeersResponse {}))
    }

    async fn list_transfers(
        &self,
        req: Request<mesh::ListTransfersRequest>,
    ) -> Result<Response<mesh::ListTransfersResponse>, Status> {
        // Over the mesh, the controller; without TLS, the node's own socket.
        if !matches!(
            self.caller(&req),
            Caller::Local | Caller::Peer(Peer::Controller)
        ) {
            return Err(Status::permission_denied(
                "only the controller lists transfers",
            ));
        }
        let c = self.controller.clone();
        let t = blocking(move || Ok(c.transfers())).await?;
        Ok(Response::new(mesh::ListTransfersResponse {
            transfers: t.into_iter().map(status_message).collect(),
        }))
    }
}

/// The claim a CreateVolume is for, from the provisioner's extra metadata.
fn claim_of(parameters: &BTreeMap<String, String>) -> Option<(String, String)> {
    let ns = parameters.get("csi.storage.k8s.io/pvc/namespace")?;
    let name = parameters.get("csi.storage.k8s.io/pvc/name")?;
    Some((ns.clone(), name.clone()))
}

/// The way this node's arrivals reach their sources: a Transfer client of the
/// source node's agent, at the address the controller gave.
pub fn sources(creds: tls::Shared, peers: Arc<Peers>, runtime: tokio::runtime::Handle) -> Sources {
    Arc::new(move |node: &str, transfer: &str, token: &str| {
        Box::new(MeshSource {
            creds: creds.clone(),
            peers: peers.clone(),
            runtime: runtime.clone(),
            node: node.to_string(),
            transfer: transfer.to_string(),
            token: token.to_string(),
        }) as Box<dyn Source>
    })
}

struct MeshSource {
    creds: tls::Shared,
    peers: Arc<Peers>,
    runtime: tokio::runtime::Handle,
    node: String,
    transfer: String,
    token: String,
}

impl MeshSource {
    fn client(&self) -> csi_storage::Result<TransferClient<Channel>> {
        let addr = self.peers.get(&self.node).ok_or_else(|| {
            csi_storage::Error::Aborted(format!(
                "the address of node {}'s agent is not known yet",
                self.node
            ))
        })?;
        let tls = self.creds.client(&Role::Node(self.node.clone()));
        // The channel's connection task runs on the process's runtime, not
        // on the transfer's own thread.
        let _runtime = self.runtime.enter();
        let ch = Endpoint::from_shared(format!("https://{addr}"))
            .and_then(|e| e.tls_config(tls))
            .map_err(|e| csi_storage::Error::internal(format!("node {}: {e}", self.node)))?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            // Pieces are 1 MiB: HTTP/2's default 64 KiB window would stop
            // the source after every 64 KiB to wait for a window update.
            .initial_stream_window_size(Some(PIECE_WINDOW))
            .initial_connection_window_size(Some(PIECE_WINDOW))
            .http2_keep_alive_interval(Duration::from_secs(15))
            .keep_alive_timeout(Duration::from_secs(10))
            .connect_lazy();
        Ok(TransferClient::new(ch)
            .max_decoding_message_size(MAX_MESH_MESSAGE)
            .max_encoding_message_size(MAX_MESH_MESSAGE))
    }

    fn unreachable(&self, s: Status) -> csi_storage::Error {
        csi_storage::Error::Aborted(format!("node {}: {}", self.node, s.message()))
    }
}

impl Source for MeshSource {
    fn read<'a>(
        &'a mut self,
        from: u64,
        base: Option<&str>,
        stop: &'a AtomicBool,
    ) -> csi_storage::Result<Box<dyn Iterator<Item = csi_storage::Result<Received>> + 'a>> {
        let mut client = self.client()?;
        let req = mesh::ReadRequest {
            transfer_id: self.transfer.clone(),
            from,
            base_transfer_id: base.unwrap_or_default().to_string(),
            read_token: self.token.clone(),
            // Where this node names a base, it starts from it.
            patches: base.is_some(),
            xxh3: true,
        };
        let (tx, mut rx) = tokio::sync::mpsc::channel(IN_FLIGHT);
        let node = self.node.clone();
        self.runtime.spawn(async move {
            let mut stream = match client.read(req).await {
                Ok(s) => s.into_inner(),
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            loop {
                let next = tokio::time::timeout(SILENCE, stream.message()).await;
                let item = match next {
                    Err(_) => Err(Status::unavailable(format!("node {node} fell silent"))),
                    Ok(Err(e)) => Err(e),
                    Ok(Ok(None)) => break,
                    Ok(Ok(Some(m))) => Ok(m),
                };
                let failed = item.is_err();
                // The writer's side is gone (stopped): the stream ends.
                if tx.send(item).await.is_err() || failed {
                    break;
                }
            }
        });
        let runtime = self.runtime.clone();
        Ok(Box::new(std::iter::from_fn(move || loop {
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            let next = runtime.block_on(async {
                tokio::time::timeout(Duration::from_millis(200), rx.recv()).await
            });
            match next {
                Ok(Some(Ok(m))) => {
                    return Some(from_message(m).map_err(|why| {
                        csi_storage::Error::invalid(format!("node {}: {why}", self.node))
                    }))
                }
                Ok(Some(Err(s))) => return Some(Err(self.unreachable(s))),
                Ok(None) => return None,
                Err(_) => continue,
            }
        })))
    }

    fn release(&mut self, keep_as_base: bool) -> csi_storage::Result<()> {
        let mut client = self.client()?;
        let req = mesh::ReleaseRequest {
            transfer_id: self.transfer.clone(),
            keep_as_base,
            read_token: self.token.clone(),
        };
        let done = self.runtime.block_on(async move {
            tokio::time::timeout(Duration::from_secs(10), client.release(req)).await
        });
        match done {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(s)) => Err(self.unreachable(s)),
            Err(_) => Err(csi_storage::Error::Aborted(format!(
                "node {} did not answer the release of transfer {} in time",
                self.node, self.transfer
            ))),
        }
    }
}
