//! What the router does for data that moves between nodes: a new volume made
//! on one node from a snapshot or volume of another (a hold taken on the
//! source, then the volume made on the target, which pulls the data); the
//! agents told where their peers listen; the transfers of every node listed;
//! and the claims told, through Events, when a transfer starts, ends or
//! stalls.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use csi_glue::handle;
use csi_proto::csi::{self, volume_content_source};
use csi_proto::mesh::{self, agent_client::AgentClient, transfer_client::TransferClient};
use prost::Message;
use tonic::transport::Channel;
use tonic::Status;

use super::{from_node, onward, qualify_volume, Placed, Router};
use crate::kube;
use crate::node::MAX_MESH_MESSAGE;

impl Router {
    async fn transfer_client(&self, node: &str) -> Result<TransferClient<Channel>, Status> {
        Ok(TransferClient::new(self.agents.channel(node).await?)
            .max_decoding_message_size(MAX_MESH_MESSAGE)
            .max_encoding_message_size(MAX_MESH_MESSAGE))
    }

    async fn agent_client(&self, node: &str) -> Result<AgentClient<Channel>, Status> {
        Ok(AgentClient::new(self.agents.channel(node).await?)
            .max_decoding_message_size(MAX_MESH_MESSAGE)
            .max_encoding_message_size(MAX_MESH_MESSAGE))
    }

    /// CreateVolume on `target` of a volume whose source lives on another
    /// node: the source node holds what is to be sent (frozen if it is a live
    /// volume), then the target makes the volume, marked as arriving, and
    /// pulls the data. A source node that cannot be reached fails the call
    /// before anything is made on the target. Retries find the same hold and
    /// the same volume.
    pub(crate) async fn create_from_another_node(
        &self,
        dl: Option<Duration>,
        mut r: csi::CreateVolumeRequest,
        source: &Placed,
        target: &str,
    ) -> Result<csi::Volume, Status> {
        let given = r.volume_content_source.take();
        let hold_source = match given.as_ref().and_then(|s| s.r#type.as_ref()) {
            Some(volume_content_source::Type::Snapshot(_)) => {
                mesh::hold_request::Source::SnapshotId(source.id.clone())
            }
            _ => mesh::hold_request::Source::VolumeId(source.id.clone()),
        };
        let volume_id = csi_storage::ids::VolumeId::for_name(&r.name).to_string();
        let transfer_id = handle::qualify(&volume_id, target);
        let hold = self
            .transfer_client(&source.node)
            .await?
            .hold(onward(
                dl,
                mesh::HoldRequest {
                    transfer_id: transfer_id.clone(),
                    target_node: target.to_string(),
                    source: Some(hold_source),
                },
            ))
            .await
            .map_err(|s| from_node(&source.node, s))?
            .into_inner();
        let hold_was_base = hold.base;
        // The target pulls from the source at once: it must know where the
        // source listens before the periodic word reaches it.
        self.tell_peers_to(target).await;
        let made = self
            .agent_client(target)
            .await?
            .create_arriving_volume(onward(
                dl,
                mesh::CreateArrivingVolumeRequest {
                    create_volume: r.encode_to_vec(),
                    source_node: source.node.clone(),
                    transfer_id: transfer_id.clone(),
                    hold: Some(hold),
                },
            ))
            .await;
        let made = match made {
            Ok(m) => m.into_inner(),
            Err(s) => {
                if refused_as_asked(s.code()) {
                    self.release_unread_hold(dl, &source.node, &transfer_id, "refused the volume")
                        .await;
                }
                return Err(from_node(target, s));
            }
        };
        // A retry after the transfer ended: the hold this call made again
        // (the first went with the transfer's end) is read by nobody. One
        // kept as the base of the next transfer is the first one: it stays.
        if made.data_whole && !hold_was_base {
            self.release_unread_hold(
                dl,
                &source.node,
                &transfer_id,
                "had all of its data already",
            )
            .await;
        }
        let mut v = csi::Volume::decode(made.volume.as_slice())
            .map_err(|e| Status::internal(format!("node {target} answered a volume: {e}")))?;
        qualify_volume(&mut v, target);
        // The answer names the source as the request did.
        v.content_source = given;
        tracing::info!(volume = %v.volume_id, source = %source.node, target,
            transfer = %transfer_id, "volume made from another node's data; the data follows");
        Ok(v)
    }

    /// Lets the source drop a hold that nothing will read, its target having
    /// `why` (a retry of the call makes it again). A failure is logged (the
    /// hold then goes at the source's next start, past its age).
    async fn release_unread_hold(
        &self,
        dl: Option<Duration>,
        node: &str,
        transfer_id: &str,
        why: &str,
    ) {
        let req = mesh::ReleaseRequest {
            transfer_id: transfer_id.to_string(),
            keep_as_base: false,
            read_token: String::new(),
        };
        let released = match self.transfer_client(node).await {
            Ok(mut c) => c.release(onward(dl, req)).await.map(drop),
            Err(e) => Err(e),
        };
        match released {
            Ok(()) => tracing::info!(
                node,
                transfer = transfer_id,
                reason = why,
                "the source let go a hold no target reads"
            ),
            Err(e) => tracing::warn!(node, transfer = transfer_id, reason = why,
                error = %e.message(),
                "a hold no target reads stays on the source until it ages out"),
        }
    }

    /// Tells every agent where the others listen (each pulls its arrivals
    /// from its peers).
    pub async fn tell_peers(&self) {
        for node in self.agents.addresses().keys() {
            self.tell_peers_to(node).await;
        }
    }

    /// Tells one agent where the others listen; a failure is logged (the
    /// next round tells it again).
    async fn tell_peers_to(&self, node: &str) {
        let req = mesh::SetPeersRequest {
            peers: self.agents.addresses().into_iter().collect(),
        };
        let told = match self.agent_client(node).await {
            Ok(mut c) => c
                .set_peers(onward(Some(Duration::from_secs(5)), req))
                .await
                .map(drop),
            Err(e) => Err(e),
        };
        if let Err(e) = told {
            tracing::debug!(node, error = %e.message(), "cannot tell an agent its peers");
        }
    }

    /// The transfers of every node that answers.
    pub async fn transfers(&self) -> Vec<(String, mesh::TransferStatus)> {
        self.transfers_and_who_answered().await.0
    }

    /// The transfers of every node that answers, and those nodes.
    pub async fn transfers_and_who_answered(
        &self,
    ) -> (Vec<(String, mesh::TransferStatus)>, BTreeSet<String>) {
        let mut out = Vec::new();
        let mut answered = BTreeSet::new();
        for node in self.agents.nodes() {
            let listed = match self.agent_client(&node).await {
                Ok(mut c) => c
                    .list_transfers(onward(
                        Some(Duration::from_secs(5)),
                        mesh::ListTransfersRequest {},
                    ))
                    .await
                    .map(|r| r.into_inner().transfers)
                    .map_err(|s| from_node(&node, s)),
                Err(e) => Err(e),
            };
            match listed {
                Ok(ts) => {
                    out.extend(ts.into_iter().map(|t| (node.clone(), t)));
                    answered.insert(node);
                }
                Err(e) => tracing::debug!(node, error = %e.message(), "no transfers from a node"),
            }
        }
        (out, answered)
    }
}

/// What the router last told of each transfer, so that each change makes one
/// Event on its claim.
pub struct Announcer {
    /// Of each transfer: its node, and its state and resumptions as told.
    told: Mutex<BTreeMap<String, (String, String)>>,
    /// Whether a look was made: arrivals found done at the first one, from
    /// nodes that do not say when they ended, ended before this process
    /// (their Events were made then).
    looked: std::sync::atomic::AtomicBool,
    /// When this process started, in seconds since the Unix epoch.
    since: i64,
}

impl Default for Announcer {
    fn default() -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        Announcer::starting_at(now)
    }
}

/// How long before this process an arrival may have ended and still be told
/// done by it: the process before may have died before its next look.
const TOLD_BEFORE: i64 = 2 * LOOK_EVERY.as_secs() as i64;

impl Announcer {
    /// An announcer of a process started at `since` (seconds since the Unix
    /// epoch).
    pub(super) fn starting_at(since: i64) -> Announcer {
        Announcer {
            told: Mutex::default(),
            looked: Default::default(),
            since,
        }
    }

    /// Whether `t`, seen done for the first time, ended before this process
    /// and was told by the one before (`primed`: a look was made before).
    pub(super) fn told_before(&self, t: &mesh::TransferStatus, primed: bool) -> bool {
        match t.ended_seconds {
            0 => !primed,
            ended => ended + TOLD_BEFORE < self.since,
        }
    }
}

impl Announcer {
    /// Looks at every node's arrivals and records an Event on the claim of
    /// each that started, resumed, stalled or ended since the last look.
    pub async fn look(&self, router: &Router, client: &kube::Client) {
        let (listed, answered) = router.transfers_and_who_answered().await;
        let now: BTreeMap<String, (String, mesh::TransferStatus)> = listed
            .into_iter()
            .filter(|(_, t)| t.role == "arriving")
            .map(|(n, t)| (t.transfer_id.clone(), (n, t)))
            .collect();
        let primed = self.looked.swap(true, std::sync::atomic::Ordering::Relaxed);
        let mut events = Vec::new();
        {
            let mut told = self.told.lock().unwrap_or_else(|p| p.into_inner());
            for (id, (node, t)) in &now {
                let key = format!("{}/{}", t.state, t.resumed);
                if told.get(id).is_some_and(|(_, k)| *k == key) {
                    continue;
                }
                let before = told.insert(id.clone(), (node.clone(), key)).map(|(_, k)| k);
                if before.is_none() && t.state == "done" && self.told_before(t, primed) {
                    continue;
                }
                // A resumption between two looks that the state no longer
                // shows (the transfer went on and ended, or stalled again)
                // is told too.
                let resumed_before = before
                    .as_deref()
                    .and_then(|k| k.rsplit_once('/'))
                    .and_then(|(_, r)| r.parse::<u32>().ok())
                    .unwrap_or(0);
                if t.resumed > resumed_before && t.state != "running" {
                    let mut resumed = t.clone();
                    resumed.state = "running".into();
                    events.push((event_of(node, &resumed, false), t.clone()));
                }
                events.push((event_of(node, t, before.is_none()), t.clone()));
            }
            // Gone from a node that answered: deleted, or done long ago (a
            // node that did not answer still has its transfers).
            let ended: Vec<String> = told
                .iter()
                .filter(|(id, (node, _))| !now.contains_key(*id) && answered.contains(node))
                .map(|(id, _)| id.clone())
                .collect();
            for id in ended {
                told.remove(&id);
            }
        }
        for ((warning, reason, message), t) in events {
            if t.claim_name.is_empty() {
                continue;
            }
            let claim = kube::Claim {
                namespace: t.claim_namespace.clone(),
                name: t.claim_name.clone(),
            };
            client.claim_event(&claim, warning, reason, &message).await;
        }
    }
}

/// The Event for a transfer's state: (warning, reason, message).
fn event_of(node: &str, t: &mesh::TransferStatus, first: bool) -> (bool, &'static str, String) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let what = format!(
        "volume {} on node {node} from node {}: {:.2} of {:.2} GiB",
        t.volume_id,
        t.peer_node,
        gib(t.bytes_done),
        gib(t.bytes_total)
    );
    match t.state.as_str() {
        "done" => (false, "TransferDone", format!("all data arrived: {what}")),
        "waiting" => (
            true,
            "TransferStalled",
            format!("the transfer waits to go on ({}): {what}", t.message),
        ),
        _ if first && t.resumed == 0 => (
            false,
            "TransferStarted",
            format!("data is arriving: {what}"),
        ),
        _ => (
            false,
            "TransferResumed",
            format!("the transfer goes on: {what}"),
        ),
    }
}

/// Time between two looks at the transfers.
const LOOK_EVERY: Duration = Duration::from_secs(5);

/// Looks at the transfers every few seconds, for as long as the process runs.
pub async fn announce(router: Arc<Router>, client: kube::Client) {
    let a = Announcer::default();
    loop {
        a.look(&router, &client).await;
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

/// Tells the agents their peers every refresh of the list of agents.
pub async fn keep_peers_told(router: Arc<Router>) {
    loop {
        router.tell_peers().await;
        tokio::time::sleep(crate::agents::REFRESH).await;
    }
}

/// The router's Agent service: the transfers of every node (`csi-driver
/// client transfers` on the controller's socket).
pub struct RouterAgent {
    r: Arc<Router>,
}

impl RouterAgent {
    pub fn new(r: Arc<Router>) -> Self {
        RouterAgent { r }
    }
}

#[tonic::async_trait]
impl mesh::agent_server::Agent for RouterAgent {
    type TakeGroupPartStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<mesh::GroupPartEvent, Status>> + Send>,
    >;

    async fn take_group_part(
        &self,
        _req: tonic::Request<tonic::Streaming<mesh::GroupPartStep>>,
    ) -> Result<tonic::Response<Self::TakeGroupPartStream>, Status> {
        Err(Status::unimplemented(
            "the controller takes group snapshots through the CSI GroupController",
        ))
    }

    async fn create_arriving_volume(
        &self,
        _req: tonic::Request<mesh::CreateArrivingVolumeRequest>,
    ) -> Result<tonic::Response<mesh::CreateArrivingVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "the controller makes no volumes itself",
        ))
    }

    async fn set_peers(
        &self,
        _req: tonic::Request<mesh::SetPeersRequest>,
    ) -> Result<tonic::Response<mesh::SetPeersResponse>, Status> {
        Err(Status::unimplemented(
            "the controller tells the agents their peers",
        ))
    }

    async fn list_transfers(
        &self,
        _req: tonic::Request<mesh::ListTransfersRequest>,
    ) -> Result<tonic::Response<mesh::ListTransfersResponse>, Status> {
        let transfers = self
            .r
            .transfers()
            .await
            .into_iter()
            .map(|(node, mut t)| {
                // A hold's peer is the target; an arrival's, the source: both
                // are read with the node that reported them.
                if t.role == "hold" {
                    t.message = format!("held on {node}");
                }
                t
            })
            .collect();
        Ok(tonic::Response::new(mesh::ListTransfersResponse {
            transfers,
        }))
    }
}

/// Whether a target's refusal of CreateArrivingVolume means it made nothing
/// and the same request will not succeed: the request itself is wrong, or
/// the target has no room. Not ALREADY_EXISTS (an earlier try's volume of the
/// name may be pulling from that very hold) nor a transient code (the target
/// may have made the volume before the answer was lost).
fn refused_as_asked(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(
        code,
        InvalidArgument
            | OutOfRange
            | ResourceExhausted
            | FailedPrecondition
            | NotFound
            | Unimplemented
    )
}
