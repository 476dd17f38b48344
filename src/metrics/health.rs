//! Volume and pool health as figures: checked on a thread of its own, at most
//! once per `--metrics-health-max-age`, never holding a scrape.

use super::*;

/// How long a scrape waits for a health check it started or found running.
/// Past that it shows the previous figures (none before the first check ends),
/// and the check, still running, serves a later scrape.
pub(super) const HEALTH_WAIT: Duration = Duration::from_secs(2);

/// Volumes asked for per ControllerListVolumeHealth page, so that a check holds
/// one page of problems at a time whatever the number of volumes.
pub(super) const HEALTH_PAGE: i32 = 256;

/// What one health check found.
pub(super) struct HealthFigures {
    /// Volumes with a problem, by (CSI error type, reason); `None` where this
    /// process has no controller domain (`--mode node`).
    pub(super) volumes: Option<BTreeMap<(&'static str, &'static str), i64>>,
    /// The same for the volumes the node serves; `None` without a node domain.
    pub(super) served: Option<BTreeMap<(&'static str, &'static str), i64>>,
    /// Every pool of the node, with its problems as (CSI error type, reason).
    pub(super) pools: BTreeMap<String, Vec<(&'static str, &'static str)>>,
    pub(super) took: Duration,
    /// When the check ended.
    pub(super) taken: Instant,
}

pub(super) fn volume_error_type(s: Severity) -> &'static str {
    match s {
        Severity::Degraded => "DEGRADED",
        Severity::Inaccessible => "INACCESSIBLE",
        Severity::DataLoss => "DATA_LOSS",
    }
}

pub(super) fn pool_error_type(s: PoolSeverity) -> &'static str {
    match s {
        PoolSeverity::Degraded => "STORAGE_DEGRADED",
        PoolSeverity::Unreachable => "STORAGE_UNREACHABLE",
    }
}

/// The checks of ControllerListVolumeHealth (every page), NodeGetVolumeHealth of
/// every volume the node serves, and NodeGetStorageHealth.
pub(super) fn check_health(driver: &Driver, errors: &Counter<u64, AtomicU64>) -> HealthFigures {
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
pub(super) struct HealthCache {
    pub(super) max_age: Duration,
    pub(super) wait: Duration,
    pub(super) created: Instant,
    pub(super) state: Mutex<CacheState>,
    pub(super) finished: Condvar,
}

#[derive(Default)]
pub(super) struct CacheState {
    pub(super) last: Option<Arc<HealthFigures>>,
    pub(super) checking: bool,
}

/// Stores a check's figures and clears `checking` when dropped, so that a check
/// that panics does not stop every later one.
pub(super) struct CheckDone {
    pub(super) cache: Arc<HealthCache>,
    pub(super) figures: Option<HealthFigures>,
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
    pub(super) fn new(max_age: Duration, wait: Duration) -> HealthCache {
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
    pub(super) fn figures<F>(self: &Arc<Self>, check: F) -> Option<Arc<HealthFigures>>
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
