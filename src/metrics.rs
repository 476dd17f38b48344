//! Operations: Prometheus metrics and a health check (`/healthz`, Probe on the CSI
//! endpoint, for a pod's livenessProbe) on HTTP (`--metrics-address`),
//! and the tower layer around the gRPC server that counts and times every RPC and
//! bounds how many non-Identity RPCs run at once.
//!
//! The layer reads the method from the request path and the gRPC code from the
//! `grpc-status` header of a trailers-only response or from the trailers of a
//! normal one, so the handlers know nothing of it.
//!
//! Volume and pool health reach the metrics through a check that a scrape starts
//! when the last one is older than `--metrics-health-max-age`; it runs on its own
//! thread, and a scrape waits for it only briefly, so /metrics answers in bounded
//! time even when a filesystem hangs.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Bytes;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Metric, Registry};

use csi_proto::csi;
use csi_storage::health::{PoolSeverity, Severity};
use csi_storage::{Driver, System};

use crate::endpoint::Endpoint;

type Labels = Vec<(&'static str, String)>;
type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// Seconds; CSI calls range from sub-millisecond (Probe) to minutes (a copy).
const BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

fn new_histogram() -> Histogram {
    Histogram::new(BUCKETS.iter().copied())
}

/// gRPC code names as the Go implementation (and so the CSI sidecars' own
/// metrics) spell them.
const CODE_NAMES: [&str; 17] = [
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

fn code_name(code: u32) -> &'static str {
    CODE_NAMES.get(code as usize).copied().unwrap_or("Unknown")
}

/// (service, method) labels of a request path `/csi.v1.Service/Method`: each
/// label is a name of CSI v1.13.0 (`csi::RPCS`) or "other", so a client sending
/// made-up paths cannot grow the label set without bound.
fn rpc_of(path: &str) -> (&'static str, &'static str) {
    let Some((service, method)) = path
        .strip_prefix("/csi.v1.")
        .and_then(|rest| rest.split_once('/'))
    else {
        return ("other", "other");
    };
    let service = csi::RPCS.iter().find(|(s, _)| *s == service).map(|r| r.0);
    let method = csi::RPCS.iter().find(|(_, m)| *m == method).map(|r| r.1);
    match (service, method) {
        (Some(s), Some(m)) => (s, m),
        (Some(s), None) => (s, "other"),
        _ => ("other", "other"),
    }
}

/// Every metric this driver exports.
pub struct Metrics {
    registry: Registry,
    rpcs: Family<Labels, Counter>,
    latency: HistogramFamily,
    pools: PoolGauges,
    ready: Gauge,
    scrape_errors: Counter<u64, AtomicU64>,
    shown: HealthGauges,
    health: Arc<HealthCache>,
    /// One scrape at a time sets and encodes: the health families are cleared
    /// and refilled, and a concurrent encode must not see them half done.
    rendering: Mutex<()>,
}

/// A figure of each pool.
type ByPool = Family<Labels, Gauge>;

/// What each pool holds.
struct PoolGauges {
    volumes: ByPool,
    snapshots: ByPool,
    capacity: ByPool,
    free: ByPool,
    reflink: ByPool,
    loops: ByPool,
}

/// What the last health check found, as the metrics show it.
struct HealthGauges {
    volumes_unhealthy: Family<Labels, Gauge>,
    node_volumes_unhealthy: Family<Labels, Gauge>,
    pool_problems: Family<Labels, Gauge>,
    pool_healthy: Family<Labels, Gauge>,
    age: Gauge<f64, AtomicU64>,
    took: Gauge<f64, AtomicU64>,
}

/// Registers `metric` under `name` and gives it back (a handle of the same
/// metric) for the driver to set.
fn register<M: Metric + Clone>(r: &mut Registry, name: &str, help: &str, metric: M) -> M {
    r.register(name, help, metric.clone());
    metric
}

fn family() -> Family<Labels, Gauge> {
    Family::default()
}

impl PoolGauges {
    fn new(r: &mut Registry) -> PoolGauges {
        PoolGauges {
            volumes: register(r, "volumes", "Volumes recorded, by pool", family()),
            snapshots: register(r, "snapshots", "Snapshots recorded, by pool", family()),
            capacity: register(
                r,
                "pool_capacity_bytes",
                "Size of the pool's filesystem, by pool",
                family(),
            ),
            free: register(
                r,
                "pool_free_bytes",
                "Bytes available to new volumes in the pool's filesystem, by pool",
                family(),
            ),
            reflink: register(
                r,
                "pool_reflink",
                "1 when the pool's filesystem clones by reflink (snapshots and clones \
                 share blocks), 0 when they are full copies",
                family(),
            ),
            loops: register(
                r,
                "loop_devices",
                "Loop devices attached to image files inside the pool, by pool",
                family(),
            ),
        }
    }
}

impl HealthGauges {
    fn new(r: &mut Registry) -> HealthGauges {
        HealthGauges {
            volumes_unhealthy: register(
                r,
                "volumes_unhealthy",
                "Volumes with this problem at the last health check (what \
                 ControllerListVolumeHealth reports), by CSI error type and reason",
                family(),
            ),
            node_volumes_unhealthy: register(
                r,
                "node_volumes_unhealthy",
                "Volumes this node serves (staged, published or ephemeral here) with this \
                 problem at the last health check (what NodeGetVolumeHealth reports at \
                 their recorded paths), by CSI error type and reason",
                family(),
            ),
            pool_problems: register(
                r,
                "pool_health_problems",
                "1 for each problem of a pool at the last health check (what \
                 NodeGetStorageHealth reports), by pool, CSI error type and reason",
                family(),
            ),
            pool_healthy: register(
                r,
                "pool_healthy",
                "1 when the pool had no problem at the last health check, else 0",
                family(),
            ),
            age: register(
                r,
                "health_check_age_seconds",
                "Age of the health figures shown (since the driver started, before the \
                 first check finished)",
                Gauge::default(),
            ),
            took: register(
                r,
                "health_check_duration_seconds",
                "How long the health check whose figures are shown took",
                Gauge::default(),
            ),
        }
    }
}

impl Metrics {
    pub fn new(driver_name: &str, mode: &str, health_max_age: Duration) -> Metrics {
        let mut r = Registry::with_prefix("example_csi");
        r.register(
            "build",
            "The driver's version, name and mode",
            Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("driver", driver_name.to_string()),
                ("mode", mode.to_string()),
            ]),
        );
        let r = &mut r;
        let rpcs = register(
            r,
            "rpc_requests",
            "gRPC calls finished, by service, method and gRPC code",
            Family::default(),
        );
        let latency = register(
            r,
            "rpc_duration_seconds",
            "Time from a gRPC call's arrival to its status, by service and method",
            Family::new_with_constructor(new_histogram as fn() -> Histogram),
        );
        let pools = PoolGauges::new(r);
        let ready = register(
            r,
            "ready",
            "1 when the driver answers Probe as ready (state loaded, every pool present)",
            Gauge::default(),
        );
        let scrape_errors = register(
            r,
            "scrape_errors",
            "Pool or loop device readings that failed while serving /metrics",
            Counter::default(),
        );
        let shown = HealthGauges::new(r);
        Metrics {
            registry: std::mem::take(r),
            rpcs,
            latency,
            pools,
            ready,
            scrape_errors,
            shown,
            health: Arc::new(HealthCache::new(health_max_age, HEALTH_WAIT)),
            rendering: Mutex::new(()),
        }
    }

    fn observe(
        &self,
        service: &'static str,
        method: &'static str,
        code: &'static str,
        t: Duration,
    ) {
        self.rpcs
            .get_or_create(&vec![
                ("service", service.to_string()),
                ("method", method.to_string()),
                ("grpc_code", code.to_string()),
            ])
            .inc();
        self.latency
            .get_or_create(&vec![
                ("service", service.to_string()),
                ("method", method.to_string()),
            ])
            .observe(t.as_secs_f64());
    }

    /// Reads the pools and loop devices (blocking: statvfs and sysfs), takes the
    /// health figures (waiting at most [`HEALTH_WAIT`] for a check), and renders
    /// the text exposition format.
    fn render(&self, driver: &Arc<Driver>, sys: &System) -> String {
        let health = {
            let driver = driver.clone();
            let errors = self.scrape_errors.clone();
            self.health.figures(move || check_health(&driver, &errors))
        };
        let _one = lock(&self.rendering);
        self.show_health(health.as_deref());
        let by_pool = driver.objects_by_pool();
        let devices = match sys.loops.list() {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(error = %e, "metrics: listing loop devices failed");
                self.scrape_errors.inc();
                None
            }
        };
        for pool in driver.pools() {
            let l: Labels = vec![("pool", pool.name.clone())];
            let (v, s) = by_pool.get(&pool.name).copied().unwrap_or_default();
            self.pools.volumes.get_or_create(&l).set(v as i64);
            self.pools.snapshots.get_or_create(&l).set(s as i64);
            self.pools
                .reflink
                .get_or_create(&l)
                .set(pool.reflink as i64);
            match pool.space() {
                Ok((free, total)) => {
                    self.pools.capacity.get_or_create(&l).set(clamp(total));
                    self.pools.free.get_or_create(&l).set(clamp(free));
                }
                Err(e) => {
                    tracing::warn!(pool = %pool.name, error = %e, "metrics: reading pool space failed");
                    self.scrape_errors.inc();
                }
            }
            if let Some(devices) = &devices {
                let n = devices
                    .iter()
                    .filter(|d| {
                        let b = d.backing_file.to_string_lossy();
                        let b = b.trim_end_matches(" (deleted)");
                        pool.contains(std::path::Path::new(b))
                    })
                    .count();
                self.pools.loops.get_or_create(&l).set(n as i64);
            }
        }
        self.ready.set(matches!(driver.probe(), Ok(true)) as i64);
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "metrics: encoding failed");
        }
        out
    }

    fn show_health(&self, figures: Option<&HealthFigures>) {
        // Cleared first: a problem that is gone must leave no sample behind.
        self.shown.volumes_unhealthy.clear();
        self.shown.node_volumes_unhealthy.clear();
        self.shown.pool_problems.clear();
        self.shown.pool_healthy.clear();
        let taken = figures.map_or(self.health.created, |f| f.taken);
        self.shown.age.set(taken.elapsed().as_secs_f64());
        let Some(f) = figures else { return };
        self.shown.took.set(f.took.as_secs_f64());
        for (family, counts) in [
            (&self.shown.volumes_unhealthy, &f.volumes),
            (&self.shown.node_volumes_unhealthy, &f.served),
        ] {
            for ((error_type, reason), n) in counts.iter().flatten() {
                family
                    .get_or_create(&vec![
                        ("error_type", error_type.to_string()),
                        ("reason", reason.to_string()),
                    ])
                    .set(*n);
            }
        }
        for (pool, problems) in &f.pools {
            self.shown
                .pool_healthy
                .get_or_create(&vec![("pool", pool.clone())])
                .set(problems.is_empty() as i64);
            for (error_type, reason) in problems {
                self.shown
                    .pool_problems
                    .get_or_create(&vec![
                        ("pool", pool.clone()),
                        ("error_type", error_type.to_string()),
                        ("reason", reason.to_string()),
                    ])
                    .set(1);
            }
        }
    }
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------
// Health figures.

/// How long a scrape waits for a health check it started or found running.
/// Past that it shows the previous figures (none before the first check ends),
/// and the check, still running, serves a later scrape.
const HEALTH_WAIT: Duration = Duration::from_secs(2);

/// Volumes asked for per ControllerListVolumeHealth page, so that a check holds
/// one page of problems at a time whatever the number of volumes.
const HEALTH_PAGE: i32 = 256;

/// What one health check found.
struct HealthFigures {
    /// Volumes with a problem, by (CSI error type, reason); `None` where this
    /// process has no controller domain (`--mode node`).
    volumes: Option<BTreeMap<(&'static str, &'static str), i64>>,
    /// The same for the volumes the node serves; `None` without a node domain.
    served: Option<BTreeMap<(&'static str, &'static str), i64>>,
    /// Every pool of the node, with its problems as (CSI error type, reason).
    pools: BTreeMap<String, Vec<(&'static str, &'static str)>>,
    took: Duration,
    /// When the check ended.
    taken: Instant,
}

fn volume_error_type(s: Severity) -> &'static str {
    match s {
        Severity::Degraded => "DEGRADED",
        Severity::Inaccessible => "INACCESSIBLE",
        Severity::DataLoss => "DATA_LOSS",
    }
}

fn pool_error_type(s: PoolSeverity) -> &'static str {
    match s {
        PoolSeverity::Degraded => "STORAGE_DEGRADED",
        PoolSeverity::Unreachable => "STORAGE_UNREACHABLE",
    }
}

/// The checks of ControllerListVolumeHealth (every page), NodeGetVolumeHealth of
/// every volume the node serves, and NodeGetStorageHealth.
fn check_health(driver: &Driver, errors: &Counter<u64, AtomicU64>) -> HealthFigures {
    let started = Instant::now();
    let volumes = driver.controller().map(|c| {
        let mut counts = BTreeMap::new();
        let mut token = String::new();
        loop {
            match c.list_volume_health(HEALTH_PAGE, &token) {
                Ok(page) => {
                    for p in page.volumes.iter().flat_map(|v| v.problems.iter()) {
                        *counts
                            .entry((volume_error_type(p.severity), p.reason))
                            .or_default() += 1;
                    }
                    match page.next_token {
                        Some(t) => token = t,
                        None => break,
                    }
                }
                Err(e) => {
                    // Counts so far are shown: a volume deleted under the token
                    // must not blank the whole gauge.
                    tracing::warn!(error = %e, "metrics: listing volume health failed");
                    errors.inc();
                    break;
                }
            }
        }
        counts
    });
    let served = driver.node().map(|n| {
        let mut counts = BTreeMap::new();
        match n.served_health() {
            Ok(volumes) => {
                for p in volumes.iter().flat_map(|v| v.problems.iter()) {
                    *counts
                        .entry((volume_error_type(p.severity), p.reason))
                        .or_default() += 1;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics: the node's volume health failed");
                errors.inc();
            }
        }
        counts
    });
    let mut pools: BTreeMap<String, Vec<_>> = driver
        .pools()
        .map(|p| (p.name.clone(), Vec::new()))
        .collect();
    for p in driver.storage_health() {
        pools
            .entry(p.pool)
            .or_default()
            .push((pool_error_type(p.severity), p.reason));
    }
    HealthFigures {
        volumes,
        served,
        pools,
        took: started.elapsed(),
        taken: Instant::now(),
    }
}

/// The last health figures, and at most one check running to renew them.
struct HealthCache {
    max_age: Duration,
    wait: Duration,
    created: Instant,
    state: Mutex<CacheState>,
    finished: Condvar,
}

#[derive(Default)]
struct CacheState {
    last: Option<Arc<HealthFigures>>,
    checking: bool,
}

/// Stores a check's figures and clears `checking` when dropped, so that a check
/// that panics does not stop every later one.
struct CheckDone {
    cache: Arc<HealthCache>,
    figures: Option<HealthFigures>,
}

impl Drop for CheckDone {
    fn drop(&mut self) {
        let mut st = lock(&self.cache.state);
        if let Some(f) = self.figures.take() {
            st.last = Some(Arc::new(f));
        }
        st.checking = false;
        self.cache.finished.notify_all();
    }
}

impl HealthCache {
    fn new(max_age: Duration, wait: Duration) -> HealthCache {
        HealthCache {
            max_age,
            wait,
            created: Instant::now(),
            state: Mutex::default(),
            finished: Condvar::new(),
        }
    }

    /// The last figures if they are at most `max_age` old; otherwise starts
    /// `check` on its own thread (unless a check is running already) and waits
    /// up to `wait` for the running check's figures.
    fn figures<F>(self: &Arc<Self>, check: F) -> Option<Arc<HealthFigures>>
    where
        F: FnOnce() -> HealthFigures + Send + 'static,
    {
        let mut st = lock(&self.state);
        if let Some(f) = st
            .last
            .as_ref()
            .filter(|f| f.taken.elapsed() <= self.max_age)
        {
            return Some(f.clone());
        }
        if !st.checking {
            let cache = self.clone();
            let spawned = std::thread::Builder::new()
                .name("health-metrics".into())
                .spawn(move || {
                    let mut done = CheckDone {
                        cache,
                        figures: None,
                    };
                    done.figures = Some(check());
                });
            match spawned {
                Ok(_) => st.checking = true,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: cannot start a health check");
                    return st.last.clone();
                }
            }
        }
        let deadline = Instant::now() + self.wait;
        while st.checking {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self
                .finished
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        st.last.clone()
    }
}

/// Parses `--metrics-address`: `HOST:PORT`, `[V6]:PORT` or `:PORT` (all
/// addresses), as the kubernetes-csi sidecars accept.
pub fn parse_address(s: &str) -> Result<SocketAddr, String> {
    let full = if s.starts_with(':') {
        format!("0.0.0.0{s}")
    } else {
        s.to_string()
    };
    full.parse()
        .map_err(|_| format!("--metrics-address {s:?} is not HOST:PORT or :PORT"))
}

/// What the HTTP server needs.
struct Http {
    metrics: Arc<Metrics>,
    driver: Arc<Driver>,
    sys: System,
    csi: Endpoint,
}

/// How long /healthz waits for Probe; a kubelet's probe gives up after a
/// second by default, the sidecar livenessprobe likewise.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Calls Probe on the CSI endpoint, as a CO would: the answer is that of the
/// service the sidecars and the kubelet use, so a driver whose socket is gone
/// or whose gRPC server no longer answers is not reported healthy.
async fn probe(csi: &Endpoint) -> Result<bool, String> {
    use csi_proto::csi::{identity_client::IdentityClient, ProbeRequest};
    let target = match csi {
        Endpoint::Unix(path) => format!("unix://{}", path.display()),
        Endpoint::Tcp(addr) => format!("tcp://{addr}"),
    };
    let call = async {
        let channel = csi_glue::connect(&target)
            .await
            .map_err(|e| format!("cannot connect to the CSI endpoint: {e}"))?;
        let answer = IdentityClient::new(channel)
            .probe(ProbeRequest {})
            .await
            .map_err(|s| format!("Probe failed: {}: {}", s.code(), s.message()))?;
        // CSI: an answer without `ready` means ready.
        Ok(answer.into_inner().ready.unwrap_or(true))
    };
    tokio::time::timeout(PROBE_TIMEOUT, call)
        .await
        .map_err(|_| format!("Probe did not answer within {PROBE_TIMEOUT:?}"))?
}

/// Binds the metrics listener (so that a busy port fails the start).
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--metrics-address {addr}: {e}"))
}

/// Serves `/metrics` and `/healthz` (Probe on `csi`) until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    driver: Arc<Driver>,
    sys: System,
    csi: Endpoint,
) {
    let http = Arc::new(Http {
        metrics,
        driver,
        sys,
        csi,
    });
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let http = http.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let http = http.clone();
                async move { Ok::<_, Infallible>(respond(&http, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .keep_alive(true)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            // A scraper that stops reading is cut off after a minute.
            let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
        });
    }
}

async fn respond<B>(http: &Arc<Http>, req: http::Request<B>) -> http::Response<Full<Bytes>> {
    let reply = |status: http::StatusCode, ctype: &'static str, body: String| {
        let mut r = http::Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(ctype),
        );
        r
    };
    if req.method() != http::Method::GET && req.method() != http::Method::HEAD {
        return reply(
            http::StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "only GET\n".into(),
        );
    }
    match req.uri().path() {
        "/metrics" => {
            let h = http.clone();
            match tokio::task::spawn_blocking(move || h.metrics.render(&h.driver, &h.sys)).await {
                Ok(text) => reply(
                    http::StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                ),
                Err(e) => reply(
                    http::StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain; charset=utf-8",
                    format!("{e}\n"),
                ),
            }
        }
        "/healthz" => match probe(&http.csi).await {
            Ok(true) => reply(
                http::StatusCode::OK,
                "text/plain; charset=utf-8",
                "ok\n".into(),
            ),
            Ok(false) => reply(
                http::StatusCode::SERVICE_UNAVAILABLE,
                "text/plain; charset=utf-8",
                "not ready\n".into(),
            ),
            Err(e) => reply(
                http::StatusCode::SERVICE_UNAVAILABLE,
                "text/plain; charset=utf-8",
                format!("not ready: {e}\n"),
            ),
        },
        _ => reply(
            http::StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "try /metrics or /healthz\n".into(),
        ),
    }
}

// ---------------------------------------------------------------------------
// The gRPC layer.

/// Wraps the tonic server: counts and times each RPC (when metrics are on) and
/// lets at most `limit` non-Identity RPCs run at once; the others wait here, as
/// cheap futures, rather than each holding a blocking thread. Identity calls
/// (Probe above all) are never held back, so a liveness check answers under load.
#[derive(Clone)]
pub struct RpcLayer {
    metrics: Option<Arc<Metrics>>,
    limit: Arc<tokio::sync::Semaphore>,
}

impl RpcLayer {
    pub fn new(metrics: Option<Arc<Metrics>>, limit: usize) -> Self {
        RpcLayer {
            metrics,
            limit: Arc::new(tokio::sync::Semaphore::new(limit.max(1))),
        }
    }
}

impl<S> tower::Layer<S> for RpcLayer {
    type Service = RpcService<S>;
    fn layer(&self, inner: S) -> RpcService<S> {
        RpcService {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RpcService<S> {
    inner: S,
    layer: RpcLayer,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for RpcService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = http::Response<MeteredBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        // The service that was polled ready is the one to call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let started = Instant::now();
        let (service, method) = rpc_of(req.uri().path());
        let metrics = self.layer.metrics.clone();
        let limit = (service != "Identity").then(|| self.layer.limit.clone());
        Box::pin(async move {
            let _permit = match limit {
                // The semaphore is never closed; on the impossible error go on unlimited.
                Some(l) => l.acquire_owned().await.ok(),
                None => None,
            };
            let mut rec = Recorder {
                metrics,
                service,
                method,
                started,
                done: false,
            };
            let resp = match inner.call(req).await {
                Ok(r) => r,
                Err(e) => {
                    rec.finish("Unknown");
                    return Err(e);
                }
            };
            let mut resp = resp;
            shorten_message(resp.headers_mut());
            oversized_is_resource_exhausted(resp.headers_mut());
            // Trailers-only responses (every error tonic returns) carry the status
            // in the headers; others in the trailers, seen by the body.
            if let Some(code) = grpc_status(resp.headers()) {
                rec.finish(code_name(code));
            } else if resp.status() != http::StatusCode::OK {
                rec.finish("Unknown");
            }
            Ok(resp.map(|body| MeteredBody {
                inner: Box::pin(body),
                rec,
            }))
        })
    }
}

/// Longest `grpc-message` sent, percent-encoded. Error messages may quote what
/// the client sent (an unknown parameter value); a client whose 3 MiB parameter
/// came back in a header would get a protocol error (HTTP/2 header limits)
/// instead of the status.
const MAX_STATUS_MESSAGE: usize = 2048;

fn shorten_message(headers: &mut http::HeaderMap) {
    let Some(text) = headers
        .get("grpc-message")
        .filter(|v| v.len() > MAX_STATUS_MESSAGE)
        .and_then(|v| v.to_str().ok())
    else {
        return;
    };
    let short = truncate_percent_encoded(text, MAX_STATUS_MESSAGE);
    if let Ok(v) = http::HeaderValue::from_str(&short) {
        headers.insert("grpc-message", v);
    }
}

/// Cuts a percent-encoded UTF-8 string to at most `max` bytes plus a "..." mark,
/// never inside an escape or a multi-byte character.
fn truncate_percent_encoded(text: &str, max: usize) -> String {
    // The encoded length and the decoded byte of the token at `i`.
    let token = |i: usize| -> (usize, u8) {
        let b = text.as_bytes();
        if b[i] == b'%' && i + 3 <= b.len() {
            if let Ok(v) = u8::from_str_radix(&text[i + 1..i + 3], 16) {
                return (3, v);
            }
        }
        (1, b[i])
    };
    let mut cut = 0;
    let mut i = 0;
    while i < text.len() {
        let (len, _) = token(i);
        if i + len > max {
            break;
        }
        i += len;
        // Safe to cut here unless the next byte continues a character.
        if i == text.len() || token(i).1 & 0xC0 != 0x80 {
            cut = i;
        }
    }
    format!("{}...", &text[..cut])
}

/// tonic refuses a request above the size limit with OUT_OF_RANGE; the gRPC
/// status code table (and every other gRPC implementation, so what clients
/// expect) says RESOURCE_EXHAUSTED.
fn oversized_is_resource_exhausted(headers: &mut http::HeaderMap) {
    let oversized = grpc_status(headers) == Some(tonic::Code::OutOfRange as u32)
        && headers
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|m| {
                m.contains("decoded%20message%20length%20too%20large")
                    || m.contains("decoded message length too large")
            });
    if oversized {
        headers.insert(
            "grpc-status",
            http::HeaderValue::from(tonic::Code::ResourceExhausted as u32),
        );
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<u32> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

struct Recorder {
    metrics: Option<Arc<Metrics>>,
    service: &'static str,
    method: &'static str,
    started: Instant,
    done: bool,
}

impl Recorder {
    fn finish(&mut self, code: &'static str) {
        if self.done {
            return;
        }
        self.done = true;
        if let Some(m) = &self.metrics {
            m.observe(self.service, self.method, code, self.started.elapsed());
        }
    }
}

impl Drop for Recorder {
    /// A call dropped before its status (the client went away) counts as cancelled.
    fn drop(&mut self) {
        self.finish("Canceled");
    }
}

/// A response body that records the call when its trailers pass.
pub struct MeteredBody<B> {
    inner: Pin<Box<B>>,
    rec: Recorder,
}

impl<B: Body<Data = Bytes>> Body for MeteredBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = this.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame.trailers_ref().and_then(grpc_status) {
                    this.rec.finish(code_name(code));
                }
            }
            Poll::Ready(Some(Err(_))) => this.rec.finish("Unknown"),
            // A body that ends without a status: the client sees an error.
            Poll::Ready(None) => this.rec.finish("Unknown"),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_labels_are_bounded() {
        assert_eq!(rpc_of("/csi.v1.Identity/Probe"), ("Identity", "Probe"));
        assert_eq!(
            rpc_of("/csi.v1.Controller/CreateVolume"),
            ("Controller", "CreateVolume")
        );
        assert_eq!(rpc_of("/csi.v1.Node/Nope"), ("Node", "other"));
        assert_eq!(rpc_of("/csi.v1.Node/"), ("Node", "other"));
        assert_eq!(rpc_of("/x.y/Probe"), ("other", "other"));
        assert_eq!(rpc_of("/"), ("other", "other"));
        assert_eq!(code_name(0), "OK");
        assert_eq!(code_name(8), "ResourceExhausted");
        assert_eq!(code_name(99), "Unknown");
    }

    #[test]
    fn long_status_messages_are_cut_cleanly() {
        assert_eq!(truncate_percent_encoded("abcdef", 4), "abcd...");
        // "é" is %C3%A9: never split inside the escape or the character.
        assert_eq!(truncate_percent_encoded("a%C3%A9b", 4), "a...");
        assert_eq!(truncate_percent_encoded("a%C3%A9b", 7), "a%C3%A9...");
        assert_eq!(truncate_percent_encoded("ab%25cd", 3), "ab...");
        let mut h = http::HeaderMap::new();
        h.insert(
            "grpc-message",
            http::HeaderValue::from_str(&"x".repeat(10_000)).unwrap(),
        );
        shorten_message(&mut h);
        assert_eq!(h["grpc-message"].len(), MAX_STATUS_MESSAGE + 3);
    }

    #[test]
    fn addresses() {
        assert_eq!(
            parse_address(":9810").unwrap(),
            "0.0.0.0:9810".parse().unwrap()
        );
        assert!(parse_address("127.0.0.1:0").is_ok());
        assert!(parse_address("[::1]:80").is_ok());
        for bad in ["", "x", "9810", "1.2.3.4", "host:port"] {
            assert!(parse_address(bad).is_err(), "{bad:?}");
        }
    }

    fn figures_now() -> HealthFigures {
        HealthFigures {
            volumes: Some(BTreeMap::from([(("DATA_LOSS", "ImageTruncated"), 2)])),
            served: Some(BTreeMap::new()),
            pools: BTreeMap::from([
                ("default".to_string(), vec![]),
                (
                    "ssd".to_string(),
                    vec![("STORAGE_UNREACHABLE", "PoolReadOnly")],
                ),
            ]),
            took: Duration::from_millis(5),
            taken: Instant::now(),
        }
    }

    #[test]
    fn a_slow_health_check_never_holds_a_scrape_and_runs_once() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let checks = Arc::new(AtomicUsize::new(0));
        let check = |pause: Duration| {
            let checks = checks.clone();
            move || {
                checks.fetch_add(1, SeqCst);
                std::thread::sleep(pause);
                figures_now()
            }
        };
        let cache = Arc::new(HealthCache::new(
            Duration::from_secs(600),
            Duration::from_millis(100),
        ));
        let t = Instant::now();
        assert!(cache.figures(check(Duration::from_secs(2))).is_none());
        assert!(
            t.elapsed() < Duration::from_millis(1500),
            "{:?}",
            t.elapsed()
        );
        // Scrapes meanwhile join the running check rather than start others.
        let deadline = Instant::now() + Duration::from_secs(30);
        let got = loop {
            if let Some(f) = cache.figures(check(Duration::ZERO)) {
                break f;
            }
            assert!(Instant::now() < deadline, "the check never finished");
        };
        assert_eq!(got.pools.len(), 2);
        assert!(cache.figures(check(Duration::ZERO)).is_some());
        assert_eq!(checks.load(SeqCst), 1, "young figures are reused");

        // Figures older than the maximum age: each scrape checks again, and
        // one whose check panics gets the previous figures, the next a new check.
        let cache = Arc::new(HealthCache::new(Duration::ZERO, Duration::from_secs(10)));
        let first = cache.figures(check(Duration::ZERO)).unwrap();
        let second = cache.figures(check(Duration::ZERO)).unwrap();
        assert!(second.taken > first.taken);
        let after_panic = cache.figures(|| panic!("a check that fails")).unwrap();
        assert_eq!(after_panic.taken, second.taken);
        assert!(cache.figures(check(Duration::ZERO)).unwrap().taken > second.taken);
        assert_eq!(checks.load(SeqCst), 4);
    }

    #[test]
    fn health_figures_render_and_vanish_when_gone() {
        let m = Metrics::new("example.csi.k8s.io", "all", Duration::from_secs(30));
        let text = |m: &Metrics| {
            let mut out = String::new();
            encode(&mut out, &m.registry).unwrap();
            out
        };
        m.show_health(Some(&figures_now()));
        let out = text(&m);
        for line in [
            "example_csi_volumes_unhealthy{error_type=\"DATA_LOSS\",reason=\"ImageTruncated\"} 2",
            "example_csi_pool_healthy{pool=\"default\"} 1",
            "example_csi_pool_healthy{pool=\"ssd\"} 0",
            "example_csi_pool_health_problems{pool=\"ssd\",error_type=\"STORAGE_UNREACHABLE\",reason=\"PoolReadOnly\"} 1",
            "example_csi_health_check_duration_seconds 0.005",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
        let mut healed = figures_now();
        healed.volumes = Some(BTreeMap::new());
        healed.pools.insert("ssd".into(), vec![]);
        m.show_health(Some(&healed));
        let out = text(&m);
        assert!(!out.contains("example_csi_volumes_unhealthy{"), "{out}");
        assert!(!out.contains("example_csi_pool_health_problems{"), "{out}");
        assert!(
            out.contains("example_csi_pool_healthy{pool=\"ssd\"} 1"),
            "{out}"
        );
    }

    #[test]
    fn renders_rpc_counters() {
        let m = Metrics::new("example.csi.k8s.io", "all", Duration::from_secs(30));
        m.observe("Identity", "Probe", "OK", Duration::from_millis(2));
        let mut out = String::new();
        encode(&mut out, &m.registry).unwrap();
        assert!(out.contains(
            "example_csi_rpc_requests_total{service=\"Identity\",method=\"Probe\",grpc_code=\"OK\"} 1"
        ), "{out}");
        assert!(out.contains("example_csi_build_info{"), "{out}");
        assert!(
            out.contains("example_csi_rpc_duration_seconds_bucket{"),
            "{out}"
        );
    }
}
