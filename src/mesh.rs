//! The two ends of the multi-node mesh in this binary: the router (`--mode
//! router`: the cluster's controller) and a node's agent listener
//! (`--agent-listen`: its Controller services, for the router alone).

use std::collections::BTreeMap;
use std::sync::Arc;

use csi_mesh::agents::{Agents, Source};
use csi_mesh::kube::{AgentPods, Client as KubeClient};
use csi_mesh::node::{AgentService, Peers, TransferService, MAX_MESH_MESSAGE, PIECE_WINDOW};
use csi_mesh::router::moves::{announce, keep_peers_told, RouterAgent};
use csi_mesh::router::{
    Config as RouterConfig, Router, RouterController, RouterGroupController, RouterIdentity,
    RouterSnapshotMetadata,
};
use csi_mesh::tls::{self, Role};
use csi_proto::csi::{
    controller_server::ControllerServer, group_controller_server::GroupControllerServer,
    identity_server::IdentityServer, snapshot_metadata_server::SnapshotMetadataServer,
};
use csi_proto::mesh::{agent_server::AgentServer, transfer_server::TransferServer};
use csi_storage::Driver;
use tokio::sync::oneshot;

use crate::cli::Cli;
use crate::{Stop, MAX_MESSAGE_BYTES};

/// A CSI server of messages up to [`MAX_MESSAGE_BYTES`].
macro_rules! bounded {
    ($server:expr) => {
        $server
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    };
}

/// A mesh service, whose pieces of data are larger than CSI messages.
macro_rules! mesh_bounded {
    ($server:expr) => {
        $server
            .max_decoding_message_size(MAX_MESH_MESSAGE)
            .max_encoding_message_size(MAX_MESH_MESSAGE)
    };
}

/// Only the cluster's controller may call a node agent's services.
macro_rules! controller_only {
    ($creds:expr, $server:expr) => {
        tonic::service::interceptor::InterceptedService::new(
            bounded!($server),
            $creds.controller_only(),
        )
    };
}

/// The node agents a router reads: a fixed list, or Kubernetes.
fn source(cli: &Cli, kube: Option<&KubeClient>) -> Result<Source, String> {
    if let Some(client) = kube {
        if !cli.agents.is_empty() {
            return Err("--agent and --agents-from-kubernetes exclude each other".into());
        }
        return Ok(Source::Kubernetes {
            client: client.clone(),
            pods: AgentPods {
                selector: cli.agent_selector.clone(),
                port: cli.agent_port,
            },
        });
    }
    let mut fixed = BTreeMap::new();
    for a in cli.agents.iter().filter(|a| !a.is_empty()) {
        let (node, addr) = a
            .split_once('=')
            .filter(|(n, a)| !n.is_empty() && !a.is_empty())
            .ok_or_else(|| format!("--agent {a:?}: NODE=HOST:PORT is expected"))?;
        if fixed.insert(node.to_string(), addr.to_string()).is_some() {
            return Err(format!("--agent: node {node:?} is given twice"));
        }
    }
    if fixed.is_empty() {
        return Err(
            "--mode router needs --agent NODE=HOST:PORT or --agents-from-kubernetes".into(),
        );
    }
    Ok(Source::Fixed(fixed))
}

/// What the router serves, on the CSI endpoint, until a signal stops it.
pub async fn serve_router(
    cli: Cli,
    endpoint: crate::endpoint::Endpoint,
    metrics_address: Option<std::net::SocketAddr>,
) -> Result<(), Stop> {
    tracing::info!(version = env!("CARGO_PKG_VERSION"), driver = %cli.drivername,
        "starting the cluster's controller");
    let kube = match cli.agents_from_kubernetes {
        true => Some(KubeClient::in_cluster().map_err(|e| e.to_string())?),
        false => None,
    };
    let mesh = csi_mesh::controller_side(
        &cli.mesh_dir,
        kube.as_ref().map(|k| (k, cli.mesh_secret.as_str())),
    )
    .await
    .map_err(|e| e.to_string())?;
    let creds = Arc::new(mesh.mint(&Role::Controller).map_err(|e| e.to_string())?);
    let agents = Arc::new(Agents::new(creds, source(&cli, kube.as_ref())?));
    tokio::spawn(agents.clone().keep_fresh());
    // Bound before the CSI socket, as in the other modes.
    let metrics = match metrics_address {
        None => None,
        Some(addr) => {
            let refresh = crate::metrics::Metrics::of_router(agents.clone());
            Some(crate::start_metrics(addr, &cli, &cli.drivername, refresh, &endpoint).await?)
        }
    };
    let router = Router::new(
        agents,
        RouterConfig {
            driver_name: cli.drivername.clone(),
            enable_attach: cli.enable_attach,
            controller_expansion: !cli.disable_controller_expansion,
            modify_volume: cli.mutable_parameters.iter().any(|m| !m.is_empty()),
        },
    );
    let services = tonic::transport::Server::builder()
        .layer(crate::rpc::RpcLayer::new(
            metrics,
            crate::MIN_RPCS_IN_FLIGHT,
        ))
        .add_service(bounded!(IdentityServer::new(RouterIdentity::new(
            router.clone()
        ))))
        .add_service(bounded!(ControllerServer::new(RouterController::new(
            router.clone()
        ))))
        .add_service(bounded!(GroupControllerServer::new(
            RouterGroupController::new(router.clone(),)
        )))
        .add_service(bounded!(SnapshotMetadataServer::new(
            RouterSnapshotMetadata::new(router.clone())
        )))
        .add_service(bounded!(AgentServer::new(RouterAgent::new(router.clone()))));
    // The agents pull arrivals from each other: each is told where the
    // others listen. The claims hear of their transfers through Events.
    tokio::spawn(keep_peers_told(router.clone()));
    if let Some(client) = kube {
        tokio::spawn(announce(router, client));
    }
    let grace = std::time::Duration::from_secs(cli.shutdown_timeout);
    crate::listen(services, endpoint, grace, None, cli.socket_group).await
}

/// This node's certificate, from the nodes' mesh authority.
fn node_credentials(cli: &Cli, node_id: &str) -> Result<tls::Shared, Stop> {
    let mesh = tls::Mesh::load(&cli.mesh_dir, tls::Side::Nodes)
        .map_err(|e| Stop::Refused(e.to_string()))?;
    if mesh.is_single() {
        tracing::warn!(
            dir = %cli.mesh_dir.display(),
            "the mesh has one authority for the controller and the nodes: root on any node \
             could act as the controller"
        );
    }
    Ok(Arc::new(
        mesh.mint(&Role::Node(node_id.to_string()))
            .map_err(|e| e.to_string())?,
    ))
}

/// A running agent listener; dropped, it stops.
pub struct AgentListener {
    _stop: oneshot::Sender<()>,
    /// Where the other nodes' agents listen, as the controller says.
    pub peers: Arc<Peers>,
}

/// Serves this node's Controller, GroupController, SnapshotMetadata and
/// Identity services on `cli.agent_listen` with mutual TLS: the controller
/// role alone may call them.
pub async fn start_agent(cli: &Cli, driver: &Arc<Driver>) -> Result<Option<AgentListener>, Stop> {
    let addr = cli.agent_listen.trim();
    if addr.is_empty() {
        return Ok(None);
    }
    let Some(controller) = driver.controller().cloned() else {
        return Err(Stop::Refused(
            "--agent-listen serves this node's Controller services: it needs --mode all".into(),
        ));
    };
    let addr: std::net::SocketAddr = addr
        .parse()
        .map_err(|e| Stop::Refused(format!("--agent-listen {addr:?}: {e}")))?;
    let creds = node_credentials(cli, &driver.cfg.node_id)?;
    let peers = Arc::new(Peers::default());
    // Arrivals recorded before this start go on once their source answers.
    controller.start_transfers(csi_mesh::node::sources(
        creds.clone(),
        peers.clone(),
        tokio::runtime::Handle::current(),
    ));
    let identity = csi_identity::IdentityService::new(driver.clone(), true);
    let router = tonic::transport::Server::builder()
        .initial_stream_window_size(PIECE_WINDOW)
        .initial_connection_window_size(PIECE_WINDOW)
        .tls_config(creds.server())
        .map_err(|e| format!("--agent-listen: {e}"))?
        .layer(crate::rpc::RpcLayer::new(None, crate::MIN_RPCS_IN_FLIGHT))
        .add_service(controller_only!(creds, IdentityServer::new(identity)))
        .add_service(controller_only!(
            creds,
            ControllerServer::new(csi_controller::ControllerService::new(controller.clone()))
        ))
        .add_service(controller_only!(
            creds,
            GroupControllerServer::new(csi_controller::GroupControllerService::new(
                controller.clone()
            ))
        ))
        .add_service(controller_only!(
            creds,
            SnapshotMetadataServer::new(csi_controller::SnapshotMetadataService::new(
                controller.clone()
            ))
        ))
        // These two check the caller's role per call: the other nodes read
        // the holds made for them.
        .add_service(mesh_bounded!(TransferServer::new(TransferService::new(
            controller.clone(),
            creds.clone()
        ))))
        .add_service(mesh_bounded!(AgentServer::new(AgentService::new(
            controller,
            peers.clone(),
            Some(creds.clone())
        ))));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Stop::Refused(format!("--agent-listen {addr}: {e}")))?;
    tracing::info!(address = %addr, "serving this node's Controller services to the cluster's controller");
    let (tx, rx) = oneshot::channel::<()>();
    // Each answer goes out at once: without TCP_NODELAY the last frames of
    // an answer wait for the caller's delayed ACK (about 40 ms).
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |s| s.and_then(|s| s.set_nodelay(true).map(|()| s)),
    );
    tokio::spawn(async move {
        let stopping = async move {
            let _ = rx.await;
        };
        if let Err(e) = router
            .serve_with_incoming_shutdown(incoming, stopping)
            .await
        {
            tracing::error!(error = %e, "the agent listener stopped");
        }
    });
    Ok(Some(AgentListener { _stop: tx, peers }))
}
