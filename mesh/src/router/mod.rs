//! The controller of a multi-node deployment. It holds no volumes: it serves
//! the CSI Controller, GroupController, SnapshotMetadata and Identity services
//! to the sidecars, and sends each call to the node agent that holds the data
//! (or, for a new volume, the node the scheduler chose), over the mesh.
//!
//! Handles (`csi_glue::handle`) carry the node, so a call is routed from its
//! request alone; ids made before handles carried nodes are found by asking
//! every node once, and remembered while the process lives. Deadlines cross
//! the hop (the caller's `grpc-timeout` goes along) and so does cancellation:
//! a call the caller gives up is dropped, which cancels it on the agent, whose
//! domain undoes it at its next safe point.

mod across;
mod controller;
mod group;
mod listing;
pub mod moves;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use csi_glue::handle;
use csi_proto::csi::{self, controller_client::ControllerClient};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::agents::Agents;

pub use controller::RouterController;
pub use group::{RouterGroupController, RouterIdentity, RouterSnapshotMetadata};
pub use moves::{announce, keep_peers_told, Announcer, RouterAgent};

/// Largest message taken from an agent (as the driver's own limit).
const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Ids found by asking every node, remembered (a bounded number).
const MAX_LOCATED: usize = 100_000;

/// What the router advertises: it must match its node agents' flags.
#[derive(Debug, Clone)]
pub struct Config {
    pub driver_name: String,
    pub enable_attach: bool,
    pub controller_expansion: bool,
    pub modify_volume: bool,
}

/// The kinds of object a handle can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Volume,
    Snapshot,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Volume => "volume",
            Kind::Snapshot => "snapshot",
        }
    }
}

/// An object placed: the node that holds it and its id there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placed {
    pub node: String,
    pub id: String,
}

pub struct Router {
    pub(crate) agents: Arc<Agents>,
    pub(crate) cfg: Config,
    located: Mutex<HashMap<(Kind, String), String>>,
}

impl Router {
    pub fn new(agents: Arc<Agents>, cfg: Config) -> Arc<Router> {
        Arc::new(Router {
            agents,
            cfg,
            located: Mutex::new(HashMap::new()),
        })
    }

    /// A Controller client of the agent of `node`.
    pub(crate) async fn controller(&self, node: &str) -> Result<ControllerClient<Channel>, Status> {
        let ch = self.agents.channel(node).await?;
        Ok(ControllerClient::new(ch)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    /// Sends one call to the Controller service of `node`'s agent.
    pub(crate) async fn on<T, F, Fut>(&self, node: &str, call: F) -> Result<T, Status>
    where
        F: FnOnce(ControllerClient<Channel>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let c = self.controller(node).await?;
        call(c)
            .await
            .map(Response::into_inner)
            .map_err(|s| from_node(node, s))
    }

    /// Sends a call about one object to the node holding it: `handle` is the
    /// request's field naming the object, replaced by its id there. The node
    /// and the answer.
    pub(crate) async fn routed<Req, T, F, Fut>(
        &self,
        req: Request<Req>,
        kind: Kind,
        handle: fn(&mut Req) -> &mut String,
        call: F,
    ) -> Result<(String, T), Status>
    where
        F: FnOnce(ControllerClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let dl = deadline(&req);
        let mut r = req.into_inner();
        let at = self.place(kind, handle(&mut r)).await?;
        *handle(&mut r) = at.id;
        let answer = self.on(&at.node, |c| call(c, onward(dl, r))).await?;
        Ok((at.node, answer))
    }

    /// Where the object a handle names lives. A bare id is looked for on
    /// every node; NOT_FOUND when no node has it (and all answered).
    pub(crate) async fn place(&self, kind: Kind, handle: &str) -> Result<Placed, Status> {
        if handle.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{} id is required",
                kind.name()
            )));
        }
        let h = handle::parse(handle);
        let node = match &h.node {
            Some(r) => self.agents.resolve(r).await?,
            None => match self.locate(kind, &h.id).await? {
                Some(n) => n,
                None => {
                    return Err(Status::not_found(format!(
                        "{} {handle:?} does not exist on any node",
                        kind.name()
                    )))
                }
            },
        };
        Ok(Placed { node, id: h.id })
    }

    /// The node that holds the object of a bare id, asking every node at once.
    async fn locate(&self, kind: Kind, id: &str) -> Result<Option<String>, Status> {
        if let Some(n) = self.located_lock().get(&(kind, id.to_string())) {
            return Ok(Some(n.clone()));
        }
        let mut asks = tokio::task::JoinSet::new();
        for node in self.every_node().await {
            let c = self.controller(&node).await;
            let id = id.to_string();
            asks.spawn(async move {
                let found = match c {
                    Err(e) => Err(e),
                    Ok(c) => holds(c, kind, id).await,
                };
                (node, found)
            });
        }
        let mut unreachable = Vec::new();
        while let Some(done) = asks.join_next().await {
            let Ok((node, found)) = done else { continue };
            match found {
                Ok(true) => {
                    let mut located = self.located_lock();
                    if located.len() >= MAX_LOCATED {
                        located.clear();
                    }
                    located.insert((kind, id.to_string()), node.clone());
                    return Ok(Some(node));
                }
                Ok(false) => {}
                Err(e) => unreachable.push(format!("{node} ({})", e.message())),
            }
        }
        if unreachable.is_empty() {
            return Ok(None);
        }
        Err(Status::unavailable(format!(
            "{} {id:?} is on no node that answered; not asked: {}",
            kind.name(),
            unreachable.join(", ")
        )))
    }

    /// Every node, the list read first if it never was: a call that must
    /// ask them all does not answer for none while the router starts.
    pub(crate) async fn every_node(&self) -> Vec<String> {
        if !self.agents.ready() {
            let _ = self.agents.refresh().await;
        }
        self.agents.nodes()
    }

    fn located_lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Kind, String), String>> {
        self.located.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether the agent behind `c` holds the object.
async fn holds(mut c: ControllerClient<Channel>, kind: Kind, id: String) -> Result<bool, Status> {
    let answer = match kind {
        Kind::Volume => c
            .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id })
            .await
            .map(|_| true),
        Kind::Snapshot => c
            .list_snapshots(csi::ListSnapshotsRequest {
                snapshot_id: id,
                ..Default::default()
            })
            .await
            .map(|r| !r.into_inner().entries.is_empty()),
    };
    match answer {
        Ok(found) => Ok(found),
        Err(s) if s.code() == tonic::Code::NotFound => Ok(false),
        Err(s) => Err(s),
    }
}

/// An agent's answer as the router gives it: its own codes, except that a
/// failure to reach the agent names the node (UNAVAILABLE: retry later). A
/// connection that closes under a call (the agent's process killed after the
/// router last used it) fails it as CANCELLED in tonic; that too is a node
/// out of reach, never the caller's cancellation (the router answers no
/// caller who went away).
pub(crate) fn from_node(node: &str, s: Status) -> Status {
    match s.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
            if is_transport(&s) =>
        {
            Status::unavailable(format!("node {node} is unreachable: {}", s.message()))
        }
        tonic::Code::Unavailable => Status::unavailable(format!("node {node}: {}", s.message())),
        _ => s,
    }
}

/// Whether a status is tonic's own report of a connection that failed, not an
/// answer of the agent.
fn is_transport(s: &Status) -> bool {
    let m = s.message();
    std::error::Error::source(s).is_some()
        || m.contains("transport error")
        || m.contains("connect")
        || m.contains("connection")
        || m == "operation was canceled"
}

/// The caller's deadline, from its `grpc-timeout` header.
pub(crate) fn deadline<T>(req: &Request<T>) -> Option<Duration> {
    let v = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The request to send on, with the caller's deadline.
pub(crate) fn onward<T>(deadline: Option<Duration>, msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    if let Some(d) = deadline {
        r.set_timeout(d);
    }
    r
}

/// The node named in a topology segment of this driver.
pub(crate) fn topology_node(t: &csi::Topology) -> Option<&str> {
    t.segments
        .get(csi_glue::TOPOLOGY_KEY)
        .map(String::as_str)
        .filter(|n| !n.is_empty())
}

/// A handle on `node`, for the id an agent answered.
pub(crate) fn qualify(id: &mut String, node: &str) {
    if !id.is_empty() && handle::parse(id).node.is_none() {
        *id = handle::qualify(id, node);
    }
}

pub(crate) fn qualify_volume(v: &mut csi::Volume, node: &str) {
    qualify(&mut v.volume_id, node);
    if let Some(src) = v.content_source.as_mut().and_then(|s| s.r#type.as_mut()) {
        use csi::volume_content_source::Type;
        match src {
            Type::Snapshot(s) => qualify(&mut s.snapshot_id, node),
            Type::Volume(s) => qualify(&mut s.volume_id, node),
        }
    }
}

/// A snapshot of `node` with its handles. Its group's id stays bare: a group
/// snapshot's handle names no node (its parts may be on several; its id is
/// made from its name, the same on each), so a member listed alone names the
/// group as the group's own answers do.
pub(crate) fn qualify_snapshot(s: &mut csi::Snapshot, node: &str) {
    qualify(&mut s.snapshot_id, node);
    qualify(&mut s.source_volume_id, node);
}

/// A group snapshot of `node`: its members' handles (its own id stays bare).
pub(crate) fn qualify_group(g: &mut csi::VolumeGroupSnapshot, node: &str) {
    for s in &mut g.snapshots {
        qualify_snapshot(s, node);
    }
}

#[cfg(test)]
mod tests;
