//! The node agents the controller can reach: which node is at which address,
//! and one gRPC channel (mutual TLS) to each.
//!
//! The list comes from a source the controller reads again whenever it meets
//! a node it does not know (at most once a second) and every
//! [`REFRESH`]: a fixed list (`--agent NODE=HOST:PORT`), or the node agent pods
//! of the controller's own namespace, read from the Kubernetes API. Nothing of
//! it is kept on disk: a controller started again, or another replica taking
//! the lead, reads it afresh.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use csi_glue::handle::NodeRef;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

use crate::kube::{AgentPods, Client as KubeClient};
use crate::tls::{Role, Shared};
use crate::Error;

/// How often the list is read again when nothing asks for it sooner.
pub const REFRESH: Duration = Duration::from_secs(15);
/// Least time between two reads caused by unknown nodes.
const MIN_REREAD: Duration = Duration::from_secs(1);
/// How long a connection to an agent may take before the call fails as
/// unavailable (the node is down or cut off).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the list of agents comes from.
pub enum Source {
    Fixed(BTreeMap<String, String>),
    Kubernetes { client: KubeClient, pods: AgentPods },
}

struct Known {
    /// Node name to address (host:port).
    addresses: BTreeMap<String, String>,
    /// The open channels, with the address each was made for.
    channels: BTreeMap<String, (String, Channel)>,
    read_at: Option<Instant>,
}

pub struct Agents {
    creds: Shared,
    source: Source,
    known: Mutex<Known>,
    /// One read of the source at a time.
    reading: tokio::sync::Mutex<()>,
}

impl Agents {
    pub fn new(creds: Shared, source: Source) -> Agents {
        Agents {
            creds,
            source,
            known: Mutex::new(Known {
                addresses: BTreeMap::new(),
                channels: BTreeMap::new(),
                read_at: None,
            }),
            reading: tokio::sync::Mutex::new(()),
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the source again. A failed read keeps what was known.
    pub async fn refresh(&self) -> Result<(), Error> {
        let _one = self.reading.lock().await;
        let addresses = match &self.source {
            Source::Fixed(m) => m.clone(),
            Source::Kubernetes { client, pods } => pods.list(client).await?,
        };
        let mut k = self.known();
        if k.addresses != addresses {
            tracing::info!(agents = ?addresses, "node agents");
        }
        // A channel whose node moved to another address (a pod started again)
        // is dropped; a node gone from the list keeps nothing.
        k.channels
            .retain(|node, (addr, _)| addresses.get(node) == Some(addr));
        k.addresses = addresses;
        k.read_at = Some(Instant::now());
        Ok(())
    }

    /// Whether the source was read at least once.
    pub fn ready(&self) -> bool {
        self.known().read_at.is_some()
    }

    /// Reads the source again unless it was read less than [`MIN_REREAD`] ago.
    async fn reread(&self) {
        let recent = self
            .known()
            .read_at
            .is_some_and(|t| t.elapsed() < MIN_REREAD);
        if !recent {
            if let Err(e) = self.refresh().await {
                tracing::warn!(error = %e, "cannot read the list of node agents");
            }
        }
    }

    /// Every node with an agent, and where it listens.
    pub fn addresses(&self) -> BTreeMap<String, String> {
        self.known().addresses.clone()
    }

    /// Every node with an agent, sorted.
    pub fn nodes(&self) -> Vec<String> {
        self.known().addresses.keys().cloned().collect()
    }

    fn find(&self, r: &NodeRef) -> Option<String> {
        let k = self.known();
        match r {
            NodeRef::Name(n) => k.addresses.contains_key(n).then(|| n.clone()),
            NodeRef::Digest(_) => k.addresses.keys().find(|n| r.is(n)).cloned(),
        }
    }

    /// The node a handle names, among those with an agent; UNAVAILABLE (a
    /// retry may find it once its agent is up) when none has that name.
    pub async fn resolve(&self, r: &NodeRef) -> Result<String, Status> {
        if let Some(n) = self.find(r) {
            return Ok(n);
        }
        self.reread().await;
        self.find(r).ok_or_else(|| {
            Status::unavailable(format!(
                "no node agent of {r} is known: the node is down, gone, or its agent is not running"
            ))
        })
    }

    /// The channel to the agent of `node` (made at its first use; it connects
    /// when a call needs it).
    pub async fn channel(&self, node: &str) -> Result<Channel, Status> {
        if !self.known().addresses.contains_key(node) {
            self.resolve(&NodeRef::Name(node.to_string())).await?;
        }
        let mut k = self.known();
        let addr = k
            .addresses
            .get(node)
            .cloned()
            .ok_or_else(|| Status::unavailable(format!("no node agent of {node} is known")))?;
        if let Some((a, ch)) = k.channels.get(node) {
            if *a == addr {
                return Ok(ch.clone());
            }
        }
        let ch = self.connect(node, &addr)?;
        k.channels.insert(node.to_string(), (addr, ch.clone()));
        Ok(ch)
    }

    fn connect(&self, node: &str, addr: &str) -> Result<Channel, Status> {
        let tls = self.creds.client(&Role::Node(node.to_string()));
        let ch = Endpoint::from_shared(format!("https://{addr}"))
            .and_then(|e| e.tls_config(tls))
            .map_err(|e| Status::internal(format!("the address {addr} of node {node}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .connect_lazy();
        Ok(ch)
    }

    /// Reads the source every [`REFRESH`], for as long as the process runs.
    pub async fn keep_fresh(self: std::sync::Arc<Self>) {
        loop {
            if let Err(e) = self.refresh().await {
                tracing::warn!(error = %e, "cannot read the list of node agents");
            }
            tokio::time::sleep(REFRESH).await;
        }
    }
}
