//! The HTTP side: /metrics and /healthz, bounded connections, a refresh of
//! the figures that never holds a scrape for long.

use super::*;

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

/// How long a scrape waits for the refresh it asked for; past that it shows the
/// figures of the last refresh (the refresh, still running, serves later ones).
pub(super) const SCRAPE_WAIT: Duration = Duration::from_secs(2);

/// The refresh thread and the scrapes that ask it for figures.
pub(super) struct Refresher {
    pub(super) max_age: Duration,
    pub(super) asked: Mutex<Asked>,
    pub(super) wake: Condvar,
    /// (refreshes finished, when the last one ended).
    pub(super) done: tokio::sync::watch::Sender<(u64, Option<Instant>)>,
}

#[derive(Default)]
pub(super) struct Asked {
    /// A scrape wants a refresh that has not started yet.
    pub(super) wanted: bool,
    /// Refreshes started so far.
    pub(super) started: u64,
}

/// What a refresh reads into the metrics, on the refresh thread: a driver's
/// pools, devices, health and transfers ([`Metrics::of_driver`]), or the node
/// agents of the cluster's controller ([`Metrics::of_router`]).
pub type Refresh = Box<dyn Fn(&Metrics) + Send + 'static>;

impl Refresher {
    /// Starts the refresh thread of `metrics`.
    pub(super) fn start(
        metrics: Arc<Metrics>,
        refresh: Refresh,
        max_age: Duration,
    ) -> std::io::Result<Arc<Refresher>> {
        let r = Arc::new(Refresher {
            max_age,
            asked: Mutex::default(),
            wake: Condvar::new(),
            done: tokio::sync::watch::channel((0, None)).0,
        });
        let this = r.clone();
        std::thread::Builder::new()
            .name("metrics-refresh".into())
            .spawn(move || loop {
                let generation = {
                    let mut a = lock(&this.asked);
                    while !a.wanted {
                        a = this.wake.wait(a).unwrap_or_else(PoisonError::into_inner);
                    }
                    a.wanted = false;
                    a.started += 1;
                    a.started
                };
                // A refresh that panics must not stop the later ones.
                let refreshed =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| refresh(&metrics)));
                if refreshed.is_err() {
                    tracing::warn!("metrics: a refresh failed");
                }
                this.done.send_replace((generation, Some(Instant::now())));
            })?;
        Ok(r)
    }

    /// The generation of figures a scrape shows: the last one when it is at
    /// most `max_age` old, else one refreshed after this call began (waiting at
    /// most [`SCRAPE_WAIT`] for it, without holding a thread).
    async fn fresh(&self) -> u64 {
        let mut done = self.done.subscribe();
        let (generation, at) = *done.borrow_and_update();
        if at.is_some_and(|t| t.elapsed() <= self.max_age) {
            return generation;
        }
        let target = {
            let mut a = lock(&self.asked);
            a.wanted = true;
            a.started + 1
        };
        self.wake.notify_one();
        let waited = tokio::time::timeout(SCRAPE_WAIT, done.wait_for(|(g, _)| *g >= target)).await;
        match waited {
            Ok(Ok(now)) => now.0,
            _ => self.done.borrow().0,
        }
    }
}

/// How long /healthz waits for Probe; a kubelet's probe gives up after a
/// second by default, the sidecar livenessprobe likewise.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// /healthz: Probe on the CSI endpoint, as a CO would call it, so a driver
/// whose socket is gone or whose gRPC server no longer answers is not reported
/// healthy; over one connection kept open, at most once per `max_age`, one
/// answer for every request that came while it was asked.
pub(super) struct Healthz {
    pub(super) csi: Endpoint,
    pub(super) max_age: Duration,
    pub(super) state: tokio::sync::Mutex<HealthzState>,
}

#[derive(Default)]
pub(super) struct HealthzState {
    pub(super) channel: Option<tonic::transport::Channel>,
    /// (device, inode) of the socket file the channel was opened through.
    pub(super) socket: Option<(u64, u64)>,
    /// The last answer and when it came.
    pub(super) last: Option<(Instant, Result<bool, String>)>,
}

impl Healthz {
    async fn answer(&self) -> Result<bool, String> {
        let asked = Instant::now();
        let wait = async {
            let mut st = self.state.lock().await;
            if let Some((at, answer)) = &st.last {
                if *at >= asked || at.elapsed() <= self.max_age {
                    return answer.clone();
                }
            }
            // A socket file removed or replaced (a cleaned host directory)
            // leaves the kubelet and the sidecars unable to reach the driver,
            // whatever an open connection still says.
            let socket = self.socket_identity();
            if socket.is_none() || socket != st.socket {
                st.channel = None;
            }
            st.socket = socket;
            let answer = tokio::time::timeout(PROBE_TIMEOUT, self.probe(&mut st.channel))
                .await
                .unwrap_or_else(|_| Err(format!("Probe did not answer within {PROBE_TIMEOUT:?}")));
            if answer.is_err() {
                // Connect anew next time: the socket may have been replaced.
                st.channel = None;
            }
            st.last = Some((Instant::now(), answer.clone()));
            answer
        };
        // Queued behind a Probe that hangs: bounded all the same.
        tokio::time::timeout(2 * PROBE_TIMEOUT, wait)
            .await
            .unwrap_or_else(|_| Err(format!("Probe did not answer within {PROBE_TIMEOUT:?}")))
    }

    /// (device, inode) of the CSI socket file; for TCP, a constant.
    pub(super) fn socket_identity(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        match &self.csi {
            Endpoint::Unix(path) => std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino())),
            Endpoint::Tcp(_) => Some((0, 0)),
        }
    }

    async fn probe(&self, channel: &mut Option<tonic::transport::Channel>) -> Result<bool, String> {
        use csi_proto::csi::{identity_client::IdentityClient, ProbeRequest};
        let ch = match channel {
            Some(c) => c.clone(),
            None => {
                let target = match &self.csi {
                    Endpoint::Unix(path) => format!("unix://{}", path.display()),
                    Endpoint::Tcp(addr) => format!("tcp://{addr}"),
                };
                let c = csi_glue::connect(&target)
                    .await
                    .map_err(|e| format!("cannot connect to the CSI endpoint: {e}"))?;
                channel.insert(c).clone()
            }
        };
        let answer = IdentityClient::new(ch)
            .probe(ProbeRequest {})
            .await
            .map_err(|s| format!("Probe failed: {}: {}", s.code(), s.message()))?;
        // CSI: an answer without `ready` means ready.
        Ok(answer.into_inner().ready.unwrap_or(true))
    }
}

/// Binds the metrics listener (so that a busy port fails the start).
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--metrics-address {addr}: {e}"))
}

/// What the HTTP server needs.
pub(super) struct Http {
    pub(super) metrics: Arc<Metrics>,
    pub(super) refresher: Arc<Refresher>,
    pub(super) healthz: Healthz,
}

/// How the metrics port is served.
pub struct Limits {
    /// How old the figures of a scrape and the answer of /healthz may be.
    pub max_age: Duration,
    /// Connections served at once.
    pub max_connections: usize,
}

/// A connection is cut off this long after it was accepted, however busy: a
/// slow or idle client cannot keep one of the few places for long.
pub(super) const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// Serves `/metrics` and `/healthz` (Probe on `csi`) until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    refresh: Refresh,
    csi: Endpoint,
    limits: Limits,
) -> Result<(), String> {
    let refresher = Refresher::start(metrics.clone(), refresh, limits.max_age)
        .map_err(|e| format!("cannot start the metrics refresh: {e}"))?;
    let http = Arc::new(Http {
        metrics,
        refresher,
        healthz: Healthz {
            csi,
            max_age: limits.max_age,
            state: tokio::sync::Mutex::default(),
        },
    });
    let places = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(place) = places.clone().try_acquire_owned() else {
                // Closed at once: a flood of connections costs a counter.
                http.metrics.refused.inc();
                drop(stream);
                continue;
            };
            let http = http.clone();
            tokio::spawn(async move {
                let _place = place;
                let service = hyper::service::service_fn(move |req| {
                    let http = http.clone();
                    async move { Ok::<_, Infallible>(respond(&http, req).await) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(5))
                    .keep_alive(true)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
            });
        }
    });
    Ok(())
}

async fn respond<B>(http: &Arc<Http>, req: http::Request<B>) -> http::Response<Full<Bytes>> {
    let reply = |status: http::StatusCode, ctype: &'static str, body: Bytes| {
        let mut r = http::Response::new(Full::new(body));
        *r.status_mut() = status;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(ctype),
        );
        r
    };
    let text = |status, body: String| reply(status, "text/plain; charset=utf-8", body.into());
    if req.method() != http::Method::GET && req.method() != http::Method::HEAD {
        return text(http::StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match req.uri().path() {
        "/metrics" => {
            let generation = http.refresher.fresh().await;
            reply(
                http::StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                http.metrics.encode(generation),
            )
        }
        "/healthz" => match http.healthz.answer().await {
            Ok(true) => text(http::StatusCode::OK, "ok\n".into()),
            Ok(false) => text(http::StatusCode::SERVICE_UNAVAILABLE, "not ready\n".into()),
            Err(e) => text(
                http::StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {e}\n"),
            ),
        },
        _ => text(
            http::StatusCode::NOT_FOUND,
            "try /metrics or /healthz\n".into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
