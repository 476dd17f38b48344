//! Operations: Prometheus metrics and a health check (`/healthz`, Probe on the CSI
//! endpoint, for a pod's livenessProbe) on HTTP (`--metrics-address`). The
//! figures of the RPCs come from the layer around the gRPC server (`crate::rpc`).
//!
//! Nothing the HTTP side does can take from the CSI calls: the figures that need
//! the pools and the kernel (statvfs, loop devices, Probe, volume health) are
//! read by one thread of their own, never by the blocking pool the CSI calls
//! run on, at most once per `--metrics-max-age` whatever the number of scrapes;
//! a scrape waits for that thread only briefly (asynchronously, holding no
//! thread) and otherwise shows the last figures. The text is encoded again only
//! when a figure changed. At most `--metrics-max-connections` connections are
//! served at once; more are closed at once and counted. /healthz asks Probe over
//! one long-lived connection to the CSI socket, and one answer serves every
//! request that came while it was asked.
//!
//! Volume and pool health reach the metrics through a check that the refresh
//! starts when the last one is older than `--metrics-health-max-age`; it runs on
//! its own thread, and the refresh waits for it only briefly, so /metrics
//! answers in bounded time even when a filesystem hangs.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::Bytes;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Metric, Registry};

use csi_storage::health::{PoolSeverity, Severity};
use csi_storage::{Driver, System};

use crate::endpoint::Endpoint;

mod health;
mod server;

use health::*;
pub use server::{bind, parse_address, serve, Limits, Refresh};

type Labels = Vec<(&'static str, String)>;
type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// Seconds; CSI calls range from sub-millisecond (Probe) to minutes (a copy).
const BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

fn new_histogram() -> Histogram {
    Histogram::new(BUCKETS.iter().copied())
}

/// Every metric this driver exports.
pub struct Metrics {
    registry: Registry,
    rpcs: Family<Labels, Counter>,
    latency: HistogramFamily,
    pools: PoolGauges,
    ready: Gauge,
    /// Node agents known (the router only).
    agents: Gauge,
    scrape_errors: Counter<u64, AtomicU64>,
    shown: HealthGauges,
    transfers: TransferGauges,
    health: Arc<HealthCache>,
    /// One refresh or encode at a time: the health families are cleared and
    /// refilled, and a concurrent encode must not see them half done. Never
    /// held across I/O.
    rendering: Mutex<()>,
    refused: Counter<u64, AtomicU64>,
    /// RPCs observed so far: the encoded text is reused while this and the
    /// refresh generation are unchanged.
    observed: AtomicU64,
    encoded: Mutex<Option<Encoded>>,
}

/// The last encoded text and what it showed.
struct Encoded {
    generation: u64,
    observed: u64,
    text: Bytes,
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

/// The transfers of volume data between nodes on this node.
struct TransferGauges {
    /// How many, by role (arriving, hold) and state.
    count: Family<Labels, Gauge>,
    /// Of each arrival not yet done, by volume and source node.
    done: Family<Labels, Gauge>,
    total: Family<Labels, Gauge>,
    rate: Family<Labels, Gauge>,
    resumed: Family<Labels, Gauge>,
}

impl TransferGauges {
    fn new(r: &mut Registry) -> TransferGauges {
        TransferGauges {
            count: register(
                r,
                "transfers",
                "Transfers of volume data between nodes on this node, by role \
                 (arriving: pulled here; hold: kept here for another node) and state",
                family(),
            ),
            done: register(
                r,
                "transfer_bytes_done",
                "Bytes of an arriving volume durable here, by volume and source node",
                family(),
            ),
            total: register(
                r,
                "transfer_bytes_total",
                "Size of an arriving volume, by volume and source node",
                family(),
            ),
            rate: register(
                r,
                "transfer_rate_bytes",
                "Bytes per second an arriving volume receives now, by volume and source node",
                family(),
            ),
            resumed: register(
                r,
                "transfer_resumes",
                "Times an arriving volume's transfer went on after a cut or a restart, \
                 by volume and source node",
                family(),
            ),
        }
    }

    fn show(&self, transfers: &[csi_storage::controller::transfer::TransferStatus]) {
        for f in [
            &self.count,
            &self.done,
            &self.total,
            &self.rate,
            &self.resumed,
        ] {
            f.clear();
        }
        for t in transfers {
            let by_state: Labels = vec![("role", t.role.clone()), ("state", t.state.clone())];
            self.count.get_or_create(&by_state).inc();
            if t.role != "arriving" || t.state == "done" {
                continue;
            }
            let l: Labels = vec![
                ("volume", t.volume_id.clone()),
                ("source", t.peer_node.clone()),
            ];
            self.done.get_or_create(&l).set(clamp(t.bytes_done));
            self.total.get_or_create(&l).set(clamp(t.bytes_total));
            self.rate.get_or_create(&l).set(clamp(t.rate));
            self.resumed.get_or_create(&l).set(t.resumed as i64);
        }
    }
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
            "1 when the driver answers Probe as ready (state loaded, every pool present; \
             the router: the list of node agents read)",
            Gauge::default(),
        );
        let agents = Gauge::default();
        if mode == "router" {
            r.register(
                "mesh_agents",
                "Node agents the cluster's controller knows of",
                agents.clone(),
            );
        }
        let scrape_errors = register(
            r,
            "scrape_errors",
            "Pool or loop device readings that failed while serving /metrics",
            Counter::default(),
        );
        let shown = HealthGauges::new(r);
        let transfers = TransferGauges::new(r);
        let refused = register(
            r,
            "metrics_connections_refused",
            "Connections to the metrics port closed at once because \
             --metrics-max-connections were being served",
            Counter::default(),
        );
        Metrics {
            registry: std::mem::take(r),
            rpcs,
            latency,
            pools,
            ready,
            agents,
            scrape_errors,
            shown,
            transfers,
            health: Arc::new(HealthCache::new(health_max_age, HEALTH_WAIT)),
            rendering: Mutex::new(()),
            refused,
            observed: AtomicU64::new(0),
            encoded: Mutex::new(None),
        }
    }

    pub(crate) fn observe(
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
        self.observed.fetch_add(1, Ordering::Relaxed);
    }

    /// The refresh of a driver's figures (every mode but the router).
    pub fn of_driver(driver: Arc<Driver>, sys: System) -> Refresh {
        Box::new(move |m: &Metrics| m.refresh(&driver, &sys))
    }

    /// The refresh of the cluster's controller: ready once it has read the
    /// list of node agents, and how many it knows.
    pub fn of_router(agents: Arc<csi_mesh::agents::Agents>) -> Refresh {
        Box::new(move |m: &Metrics| {
            let (ready, known) = (agents.ready(), agents.nodes().len());
            let _one = lock(&m.rendering);
            m.ready.set(ready as i64);
            m.agents.set(known as i64);
        })
    }

    /// Reads the pools and loop devices (blocking: statvfs and sysfs), takes the
    /// health figures (waiting at most [`HEALTH_WAIT`] for a check) and Probe's
    /// answer, then sets the gauges. Runs on the refresh thread only.
    fn refresh(&self, driver: &Arc<Driver>, sys: &System) {
        let health = {
            let driver = driver.clone();
            let errors = self.scrape_errors.clone();
            self.health.figures(move || check_health(&driver, &errors))
        };
        let by_pool = driver.objects_by_pool();
        let devices = match sys.loops.list() {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(error = %e, "metrics: listing loop devices failed");
                self.scrape_errors.inc();
                None
            }
        };
        let mut pools = Vec::new();
        for pool in driver.pools() {
            let space = pool
                .space()
                .inspect_err(|e| {
                    tracing::warn!(pool = %pool.name, error = %e, "metrics: reading pool space failed");
                    self.scrape_errors.inc();
                })
                .ok();
            let loops = devices.as_ref().map(|devices| {
                devices
                    .iter()
                    .filter(|d| {
                        let b = d.backing_file.to_string_lossy();
                        let b = b.trim_end_matches(" (deleted)");
                        pool.contains(std::path::Path::new(b))
                    })
                    .count()
            });
            let (v, s) = by_pool.get(&pool.name).copied().unwrap_or_default();
            pools.push((pool.name.clone(), v, s, pool.reflink, space, loops));
        }
        let ready = matches!(driver.probe(), Ok(true));
        let transfers = driver
            .controller()
            .map(|c| c.transfers())
            .unwrap_or_default();

        let _one = lock(&self.rendering);
        self.show_health(health.as_deref());
        self.transfers.show(&transfers);
        for (name, v, s, reflink, space, loops) in pools {
            let l: Labels = vec![("pool", name)];
            self.pools.volumes.get_or_create(&l).set(v as i64);
            self.pools.snapshots.get_or_create(&l).set(s as i64);
            self.pools.reflink.get_or_create(&l).set(reflink as i64);
            if let Some((free, total)) = space {
                self.pools.capacity.get_or_create(&l).set(clamp(total));
                self.pools.free.get_or_create(&l).set(clamp(free));
            }
            if let Some(n) = loops {
                self.pools.loops.get_or_create(&l).set(n as i64);
            }
        }
        self.ready.set(ready as i64);
    }

    /// The text exposition format of every metric, encoded again only when the
    /// refresh `generation` or an RPC's figures changed since the last time.
    fn encode(&self, generation: u64) -> Bytes {
        let observed = self.observed.load(Ordering::Relaxed);
        let mut cached = lock(&self.encoded);
        if let Some(e) = cached
            .as_ref()
            .filter(|e| e.generation == generation && e.observed == observed)
        {
            return e.text.clone();
        }
        let mut out = String::new();
        {
            let _one = lock(&self.rendering);
            if let Err(e) = encode(&mut out, &self.registry) {
                tracing::warn!(error = %e, "metrics: encoding failed");
            }
        }
        let text = Bytes::from(out);
        *cached = Some(Encoded {
            generation,
            observed,
            text: text.clone(),
        });
        text
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
#[cfg(test)]
mod tests {
    use super::*;

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
