//! `csi-driver`: serves the CSI services of example-csi on a Unix socket, or, as
//! `csi-driver client ...`, calls them.

#![forbid(unsafe_code)]

mod authority;
mod cli;
mod client;
mod endpoint;
mod huffman;
mod mesh;
mod metrics;
mod registration;
mod rpc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt;

use cli::{Cli, Command, LogFormat, Mode, DEFAULT_POOL_PATH};
use csi_proto::csi::{
    controller_server::ControllerServer, group_controller_server::GroupControllerServer,
    identity_server::IdentityServer, node_server::NodeServer,
    snapshot_metadata_server::SnapshotMetadataServer,
};
use csi_proto::mesh::agent_server::AgentServer;
use csi_storage::{Config, Driver, System};
use endpoint::Endpoint;

/// Largest gRPC message accepted or sent; CSI messages are small, so anything
/// near this is hostile.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Non-Identity RPCs running at once (at least; raised with --heavy-operations).
/// Each runs its domain call on a blocking thread; the rest wait as futures.
pub(crate) const MIN_RPCS_IN_FLIGHT: usize = 48;

/// Blocking threads kept above the RPC limit, for Identity calls (Probe), the
/// metrics scrape and calls whose client gave up while their work still runs.
const SPARE_BLOCKING_THREADS: usize = 16;

/// How long an idle blocking thread waits for more work before it ends (tokio's
/// default, named because the release of idle memory waits for it).
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(10);

/// How many RPCs may run at once, and the blocking-pool size that follows.
/// tokio's default of 512 blocking threads would let 500 simultaneous calls
/// each hold a thread (and its stack) while they wait for a heavy-operation slot.
fn limits(heavy_operations: usize) -> (usize, usize) {
    let rpcs = MIN_RPCS_IN_FLIGHT.max(heavy_operations + SPARE_BLOCKING_THREADS);
    (rpcs, rpcs + SPARE_BLOCKING_THREADS)
}

fn usage_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("csi-driver: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = match cli::parse() {
        Ok(c) => c,
        Err(code) => return code,
    };
    match &cli.command {
        Some(Command::Client(args)) => return client::main(&cli.endpoint, args),
        Some(Command::MeshAuthority { dir }) => return make_mesh_authority(dir),
        None => {}
    }
    // One allocator arena per core the process may use, set before any thread
    // starts (MALLOC_ARENA_MAX in the environment wins).
    csi_sys::memory::limit_arenas(std::thread::available_parallelism().map_or(1, |n| n.get()));
    if cli.mode == Mode::Router {
        return run_router(cli);
    }
    let start = match Start::from_cli(&cli) {
        Ok(s) => s,
        Err(e) => return usage_error(e),
    };
    let (_, blocking_threads) = limits(start.cfg.heavy_operations);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.async_threads as usize)
        .enable_all()
        .max_blocking_threads(blocking_threads)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("csi-driver: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(cli, start)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Stop::Refused(e)) => {
            tracing::error!(error = %e, "refused to start");
            usage_error(e)
        }
        Err(Stop::Failed(e)) => {
            tracing::error!(error = %e, "stopped");
            eprintln!("csi-driver: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What a node or all-in-one process starts with, checked from its flags.
struct Start {
    cfg: Config,
    endpoint: Endpoint,
    metrics_address: Option<std::net::SocketAddr>,
    registration: Option<registration::Config>,
}

impl Start {
    /// Checks the flags (a mistake is a usage error, before anything starts)
    /// and sets up logging.
    fn from_cli(cli: &Cli) -> Result<Start, String> {
        let nodeid = match cli.nodeid.as_deref() {
            Some(n) if !n.trim().is_empty() => n.to_string(),
            _ => return Err("--nodeid (or NODE_ID) is required".into()),
        };
        let endpoint = endpoint::parse(&cli.endpoint, cli.allow_tcp)?;
        let pools = pools(&cli.pools)?;
        if let Some(bad) = cli
            .mutable_parameters
            .iter()
            .find(|m| !m.is_empty() && !csi_storage::MUTABLE_PARAMETERS.contains(&m.as_str()))
        {
            return Err(format!(
                "--mutable-parameters: {bad:?} is not one of {}",
                csi_storage::MUTABLE_PARAMETERS.join(", ")
            ));
        }
        let metrics_address = match cli.metrics_address.trim() {
            "" => None,
            a => Some(metrics::parse_address(a)?),
        };
        let registration = registration_config(cli)?;
        init_logging(cli)?;
        let mut cfg = config(cli, &nodeid, pools);
        ephemeral_config(cli, &mut cfg)?;
        transfer_config(cli, &mut cfg)?;
        path_roots_config(cli, &mut cfg)?;
        cfg.mount_options = csi_storage::mount_options::MountOptionPolicy::new(
            &cli.allow_mount_options,
            &cli.default_mount_flags,
        )
        .map_err(|e| format!("--allow-mount-option/--default-mount-flags: {e}"))?;
        Ok(Start {
            cfg,
            endpoint,
            metrics_address,
            registration,
        })
    }
}

/// Writes a new pair of mesh authorities into `dir`: `dir/controller` for the
/// controller's Secret, `dir/node` for the nodes'.
fn make_mesh_authority(dir: &std::path::Path) -> ExitCode {
    let (controller, nodes) = match csi_mesh::tls::generate_pair() {
        Ok(pair) => pair,
        Err(e) => return usage_error(e),
    };
    let write = |sub: &str, files: &csi_mesh::tls::Files| -> Result<(), String> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let folder = dir.join(sub);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&folder)
            .map_err(|e| format!("{}: {e}", folder.display()))?;
        for (name, text) in files {
            let path = folder.join(name);
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
        Ok(())
    };
    match write("controller", &controller).and_then(|()| write("node", &nodes)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => usage_error(e),
    }
}

/// `--mode router`: the cluster's controller, with no state of its own.
fn run_router(cli: Cli) -> ExitCode {
    let endpoint = match endpoint::parse(&cli.endpoint, cli.allow_tcp) {
        Ok(e) => e,
        Err(e) => return usage_error(e),
    };
    let metrics_address = match cli.metrics_address.trim() {
        "" => None,
        a => match metrics::parse_address(a) {
            Ok(a) => Some(a),
            Err(e) => return usage_error(e),
        },
    };
    if let Err(e) = init_logging(&cli) {
        return usage_error(e);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("csi-driver: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(mesh::serve_router(cli, endpoint, metrics_address)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Stop::Refused(e)) => usage_error(e),
        Err(Stop::Failed(e)) => {
            tracing::error!(error = %e, "stopped");
            eprintln!("csi-driver: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The domain's configuration from the command line.
fn config(cli: &Cli, nodeid: &str, pools: Vec<(String, PathBuf)>) -> Config {
    let mut cfg = Config::new(nodeid, &cli.state_dir, pools);
    cfg.driver_name = cli.drivername.clone();
    cfg.default_fstype = cli.default_fstype.clone();
    cfg.enable_attach = cli.enable_attach;
    cfg.controller_expansion = !cli.disable_controller_expansion;
    cfg.mutable_parameters = cli
        .mutable_parameters
        .iter()
        .filter(|m| !m.is_empty())
        .cloned()
        .collect();
    cfg.max_volumes_per_node = cli.max_volumes_per_node;
    cfg.command_timeout = Duration::from_secs(cli.command_timeout);
    cfg.controller = cli.mode != Mode::Node;
    cfg.node = cli.mode != Mode::Controller;
    cfg.heavy_operations = cli.heavy_operations as usize;
    cfg.cleanup_orphans = cli.cleanup_orphans;
    cfg.freeze_timeout = Duration::from_secs(cli.freeze_timeout);
    cfg.expedite_freeze = cli.expedite_freeze;
    cfg.pool_full_percent = cli.pool_full_percent;
    cfg.max_transfers = cli.max_transfers as usize;
    cfg
}

/// The bandwidth of this node's transfers.
fn transfer_config(cli: &Cli, cfg: &mut Config) -> Result<(), String> {
    let bw = &cli.transfer_bandwidth;
    cfg.transfer_bandwidth = csi_storage::size::parse_size(bw)
        .ok()
        .and_then(|s| u64::try_from(s).ok())
        .ok_or_else(|| format!("--transfer-bandwidth {bw:?} is not a size such as 100Mi"))?;
    Ok(())
}

/// The directories below which volumes are staged and published.
fn path_roots_config(cli: &Cli, cfg: &mut Config) -> Result<(), String> {
    let mut roots = csi_storage::kubelet_path_roots(&cli.kubelet_dir);
    roots.extend(
        cli.allowed_path_roots
            .iter()
            .filter(|r| !r.as_os_str().is_empty())
            .cloned(),
    );
    for r in &roots {
        let bad = !r.is_absolute()
            || r.parent().is_none()
            || r.components()
                .any(|c| matches!(c, std::path::Component::ParentDir));
        if bad {
            return Err(format!(
                "--kubelet-dir/--allowed-path-root {:?}: an absolute directory below / \
                 without '..' is required",
                r.display().to_string()
            ));
        }
    }
    cfg.allowed_path_roots = roots;
    Ok(())
}

/// The pools and largest size of inline ephemeral volumes.
fn ephemeral_config(cli: &Cli, cfg: &mut Config) -> Result<(), String> {
    let max = &cli.ephemeral_max_size;
    cfg.ephemeral_max_size = csi_storage::size::parse_size(max)
        .ok()
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
        .ok_or_else(|| format!("--ephemeral-max-size {max:?} is not a size such as 1Gi"))?;
    cfg.ephemeral_pools = Vec::new();
    for p in cli.ephemeral_pools.iter().map(|p| p.trim()) {
        if p.is_empty() || cfg.ephemeral_pools.iter().any(|q| q == p) {
            continue;
        }
        if !cfg.pools.iter().any(|(name, _)| name == p) {
            return Err(format!("--ephemeral-pools: {p:?} is not a pool of --pool"));
        }
        cfg.ephemeral_pools.push(p.to_string());
    }
    Ok(())
}

/// Why serving ended in error.
pub(crate) enum Stop {
    /// The driver refused to start as configured (exit status 2): another process
    /// holds the state this mode owns.
    Refused(String),
    Failed(String),
}

impl From<String> for Stop {
    fn from(e: String) -> Stop {
        Stop::Failed(e)
    }
}

/// The built-in kubelet registration, when --kubelet-registration-dir asks for it.
fn registration_config(cli: &Cli) -> Result<Option<registration::Config>, String> {
    let dir = cli.kubelet_registration_dir.trim();
    let path = cli.kubelet_registration_path.trim();
    if dir.is_empty() {
        if !path.is_empty() {
            return Err("--kubelet-registration-path needs --kubelet-registration-dir".into());
        }
        return Ok(None);
    }
    if cli.mode == Mode::Controller {
        return Err(
            "--kubelet-registration-dir registers a node plugin: not with --mode controller".into(),
        );
    }
    if !dir.starts_with('/') {
        return Err(format!(
            "--kubelet-registration-dir {dir:?}: the path must be absolute"
        ));
    }
    if !path.starts_with('/') {
        return Err(format!(
            "--kubelet-registration-path {path:?}: the absolute path of the CSI socket on \
             the host is required with --kubelet-registration-dir"
        ));
    }
    let cfg = registration::Config::new(std::path::Path::new(dir), &cli.drivername, path);
    let name = cfg.socket.to_string_lossy().into_owned();
    endpoint::parse(&name, false).map_err(|e| format!("--kubelet-registration-dir: {e}"))?;
    Ok(Some(cfg))
}

/// Parses --pool values. Without any, the default pool directory is made.
fn pools(values: &[String]) -> Result<Vec<(String, PathBuf)>, String> {
    if values.is_empty() {
        std::fs::create_dir_all(DEFAULT_POOL_PATH)
            .map_err(|e| format!("cannot make the default pool {DEFAULT_POOL_PATH}: {e}"))?;
        return Ok(vec![("default".into(), DEFAULT_POOL_PATH.into())]);
    }
    let mut out: Vec<(String, PathBuf)> = Vec::new();
    for v in values {
        let (name, path) = match v.split_once('=') {
            Some((n, p)) => (n.to_string(), p.to_string()),
            None => ("default".to_string(), v.clone()),
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(format!(
                "--pool {v:?}: the name must be letters, digits, - or _"
            ));
        }
        let path = PathBuf::from(path);
        if !path.is_absolute() {
            return Err(format!("--pool {v:?}: the path must be absolute"));
        }
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(format!(
                    "--pool {v:?}: {} is not a directory",
                    path.display()
                ))
            }
            Err(e) => return Err(format!("--pool {v:?}: {}: {e}", path.display())),
        }
        if out.iter().any(|(n, _)| *n == name) {
            return Err(format!("--pool: the name {name:?} is given twice"));
        }
        out.push((name, path));
    }
    Ok(out)
}

fn init_logging(cli: &Cli) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log_level)
        .map_err(|e| format!("--log-level {:?}: {e}", cli.log_level))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match cli.log_format {
        LogFormat::Json => builder.json().with_current_span(true).init(),
        LogFormat::Text => builder.init(),
    }
    Ok(())
}

async fn serve(cli: Cli, start: Start) -> Result<(), Stop> {
    let Start {
        cfg,
        endpoint,
        metrics_address,
        registration,
    } = start;
    let mode = cli.mode;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), node = %cfg.node_id, mode = ?mode,
        driver = %cfg.driver_name, "starting");
    // The socket exists only once the state is loaded: the sidecars' Probe then
    // finds the driver ready.
    let (rpc_limit, _) = limits(cfg.heavy_operations);
    let mut sys = System::linux();
    sys.fs = Arc::new(csi_sys::linux::LinuxFilesystems::with_timeout(
        cfg.command_timeout,
    ));
    let driver = open_driver(cfg, sys.clone()).await?;

    // The metrics listener is bound before the CSI socket: a busy port fails the
    // start without leaving a socket behind.
    let metrics = match metrics_address {
        None => None,
        Some(addr) => {
            let refresh = metrics::Metrics::of_driver(driver.clone(), sys);
            let name = driver.cfg.driver_name.clone();
            Some(start_metrics(addr, &cli, &name, refresh, &endpoint).await?)
        }
    };

    let agent = mesh::start_agent(&cli, &driver).await?;
    let peers = agent.as_ref().map(|a| a.peers.clone()).unwrap_or_default();
    let router = services(&driver, metrics, rpc_limit, peers);
    tokio::spawn(csi_glue::memory::release_when_idle(
        BLOCKING_KEEP_ALIVE + Duration::from_secs(1),
    ));
    let grace = Duration::from_secs(cli.shutdown_timeout);
    listen(router, endpoint, grace, registration, cli.socket_group).await
}

/// A CSI service that takes and sends messages up to [`MAX_MESSAGE_BYTES`].
macro_rules! bounded {
    ($server:expr) => {
        $server
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    };
}

type Services = tonic::transport::server::Router<
    tower::layer::util::Stack<rpc::RpcLayer, tower::layer::util::Identity>,
>;

/// The CSI services this mode serves, behind the RPC limit and the metrics.
fn services(
    driver: &Arc<Driver>,
    metrics: Option<Arc<metrics::Metrics>>,
    rpc_limit: usize,
    peers: Arc<csi_mesh::node::Peers>,
) -> Services {
    let controller = driver.controller().cloned();
    let node = driver.node().cloned();
    let identity = csi_identity::IdentityService::new(driver.clone(), controller.is_some());
    tonic::transport::Server::builder()
        .layer(rpc::RpcLayer::new(metrics, rpc_limit))
        .add_service(bounded!(IdentityServer::new(identity)))
        .add_optional_service(controller.clone().map(|c| {
            bounded!(ControllerServer::new(
                csi_controller::ControllerService::new(c)
            ))
        }))
        .add_optional_service(controller.clone().map(|c| {
            bounded!(GroupControllerServer::new(
                csi_controller::GroupControllerService::new(c)
            ))
        }))
        .add_optional_service(controller.clone().map(|c| {
            bounded!(SnapshotMetadataServer::new(
                csi_controller::SnapshotMetadataService::new(c)
            ))
        }))
        // The transfers of this node's volumes (`csi-driver client transfers`).
        .add_optional_service(controller.map(|c| {
            bounded!(AgentServer::new(csi_mesh::node::AgentService::new(
                c, peers, None
            )))
        }))
        .add_optional_service(
            node.map(|n| bounded!(NodeServer::new(csi_node::NodeService::new(n)))),
        )
}

/// Serves `router` on the endpoint until a signal stops it, registered with the
/// kubelet meanwhile when asked to be.
pub(crate) async fn listen(
    router: Services,
    endpoint: Endpoint,
    grace: Duration,
    registration: Option<registration::Config>,
    socket_group: Option<u32>,
) -> Result<(), Stop> {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stopping = async move {
        let _ = stop_rx.await;
    };
    match endpoint {
        Endpoint::Unix(path) => {
            endpoint::prepare(&path)?;
            let listener = endpoint::bind(&path, socket_group)
                .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
            tracing::info!(endpoint = %path.display(), "serving");
            let server = tokio::spawn(router.serve_with_incoming_shutdown(
                UnixListenerStream::new(listener).map(|s| s.map(authority::Conn::new)),
                stopping,
            ));
            serve_unix(server, stop_tx, grace, registration, &path).await
        }
        Endpoint::Tcp(addr) => {
            let addr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
            tracing::warn!(%addr, "serving on TCP: anyone who can reach it controls this node's mounts");
            let server = tokio::spawn(router.serve_with_shutdown(addr, stopping));
            let registering = start_registration(registration)?;
            let result = wait(server, stop_tx, grace).await;
            stop_registration(registering).await;
            Ok(result?)
        }
    }
}

/// Opens the driver's state off the async runtime: the start-up repair may take
/// a while.
async fn open_driver(cfg: Config, sys: System) -> Result<Arc<Driver>, Stop> {
    let driver = tokio::task::spawn_blocking(move || Driver::open(cfg, sys))
        .await
        .map_err(|e| format!("opening the driver failed: {e}"))?
        .map_err(|e| match e {
            csi_storage::Error::StateInUse(msg) => Stop::Refused(msg),
            e => Stop::Failed(format!("opening the driver failed: {e}")),
        })?;
    let driver = Arc::new(driver);
    tracing::info!(
        volumes = driver.volume_count(),
        snapshots = driver.snapshot_count(),
        "state loaded"
    );
    Ok(driver)
}

/// Binds the metrics listener and serves /metrics and /healthz on it.
pub(crate) async fn start_metrics(
    addr: std::net::SocketAddr,
    cli: &Cli,
    driver_name: &str,
    refresh: metrics::Refresh,
    endpoint: &Endpoint,
) -> Result<Arc<metrics::Metrics>, Stop> {
    let listener = metrics::bind(addr).await?;
    let m = Arc::new(metrics::Metrics::new(
        driver_name,
        mode_name(cli.mode),
        Duration::from_secs(cli.metrics_health_max_age),
    ));
    tracing::info!(address = %listener.local_addr().map_err(|e| e.to_string())?,
        "serving metrics on /metrics and health on /healthz");
    let limits = metrics::Limits {
        max_age: Duration::from_secs(cli.metrics_max_age),
        max_connections: cli.metrics_max_connections as usize,
    };
    metrics::serve(listener, m.clone(), refresh, endpoint.clone(), limits).await?;
    Ok(m)
}

/// Registers with the kubelet once the CSI socket at `path` is served, waits
/// for the server to stop, and removes the socket.
async fn serve_unix(
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    stop_tx: tokio::sync::oneshot::Sender<()>,
    grace: Duration,
    registration: Option<registration::Config>,
    path: &std::path::Path,
) -> Result<(), Stop> {
    // The kubelet calls the CSI socket as soon as it is registered, so the
    // registration starts once that socket is served.
    let registering = match start_registration(registration) {
        Ok(r) => r,
        Err(e) => {
            server.abort();
            let _ = std::fs::remove_file(path);
            return Err(e.into());
        }
    };
    let result = wait(server, stop_tx, grace).await;
    stop_registration(registering).await;
    let _ = std::fs::remove_file(path);
    tracing::info!("stopped");
    Ok(result?)
}

type Registering = (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
    PathBuf,
);

fn start_registration(cfg: Option<registration::Config>) -> Result<Option<Registering>, String> {
    let Some(cfg) = cfg else {
        return Ok(None);
    };
    let listener = registration::bind(&cfg)?;
    let socket = cfg.socket.clone();
    let (tx, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(registration::serve(cfg, listener, rx));
    Ok(Some((tx, task, socket)))
}

/// Removes the registration socket: the kubelet then drops the plugin.
async fn stop_registration(registering: Option<Registering>) {
    if let Some((tx, task, socket)) = registering {
        let _ = tx.send(true);
        if tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .is_err()
        {
            tracing::warn!("the registration server did not stop in time");
            let _ = std::fs::remove_file(socket);
        }
    }
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::All => "all",
        Mode::Controller => "controller",
        Mode::Node => "node",
        Mode::Router => "router",
    }
}

/// Waits for SIGTERM or SIGINT, then stops accepting and gives running RPCs
/// `grace` to finish.
async fn wait(
    mut server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    stop: tokio::sync::oneshot::Sender<()>,
    grace: Duration,
) -> Result<(), String> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    tokio::select! {
        r = &mut server => return r.map_err(|e| e.to_string())?.map_err(|e| e.to_string()),
        _ = term.recv() => tracing::info!("SIGTERM: finishing running calls"),
        _ = int.recv() => tracing::info!("SIGINT: finishing running calls"),
    }
    let _ = stop.send(());
    match tokio::time::timeout(grace, &mut server).await {
        Ok(r) => r.map_err(|e| e.to_string())?.map_err(|e| e.to_string()),
        Err(_) => {
            tracing::warn!(
                seconds = grace.as_secs(),
                "calls still running after the grace period; stopping anyway"
            );
            server.abort();
            Ok(())
        }
    }
}
