//! csi-bench: a load generator that speaks CSI to any endpoint. It measures one
//! driver, or two side by side (`--compare`: rounds A B A B ..., medians, B/A).
//!
//! Scenarios: create-delete, scale, snapshot, node, startup, memory; and, apart,
//! `--sync-writes DIR`: the cost of one durable journal write on a filesystem.

#![forbid(unsafe_code)]

mod hammer;
mod report;
mod scenarios;
mod svg;
mod syncwrite;
mod target;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;
use csi_storage::size::parse_size;

use scenarios::{Figures, Population, Volumes};
use target::{Spec, Target};

const SCENARIOS: [&str; 7] = [
    "create-delete",
    "create-snapshot",
    "scale",
    "snapshot",
    "node",
    "startup",
    "memory",
];

#[derive(Debug, Parser)]
#[command(
    name = "csi-bench",
    about = "Measures CSI drivers: one, or two side by side with --compare"
)]
pub struct Args {
    /// Driver A (the one measured alone, or the baseline of --compare): its endpoint.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    a_endpoint: String,
    /// A shell command that starts driver A in the foreground (needed by startup,
    /// and by memory unless --a-pid is given).
    #[arg(long)]
    a_start: Option<String>,
    /// Driver A's pool directory (for the space snapshots take).
    #[arg(long)]
    a_pool: Option<PathBuf>,
    /// Driver A's pid, when it runs already.
    #[arg(long)]
    a_pid: Option<u32>,
    #[arg(long, default_value = "A")]
    a_name: String,

    /// Compare A with B.
    #[arg(long)]
    compare: bool,
    #[arg(long)]
    b_endpoint: Option<String>,
    #[arg(long)]
    b_start: Option<String>,
    #[arg(long)]
    b_pool: Option<PathBuf>,
    #[arg(long)]
    b_pid: Option<u32>,
    #[arg(long, default_value = "B")]
    b_name: String,
    /// The most volumes B is given by scale, memory and startup: their steps above
    /// it are measured for A alone (a driver whose every change rewrites all its
    /// state would take hours to reach 100,000).
    #[arg(long)]
    b_max_volumes: Option<usize>,

    /// Start each round without first writing back what the machine holds dirty
    /// (by default a `sync` comes first, so that no round pays for the writeback
    /// of the one before it: the other driver's copies above all).
    #[arg(long)]
    no_settle: bool,

    /// Scenarios to run (comma-separated): create-delete, scale, snapshot, node, startup, memory, all.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    scenarios: Vec<String>,
    /// Rounds per driver (with --compare at least 3: A B A B A B).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Volumes created and deleted at each concurrency by create-delete (enough
    /// that a burst of many clients lasts long enough to measure on a busy machine).
    #[arg(long, default_value_t = 1000)]
    count: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    concurrency: Vec<usize>,
    /// Volumes present at each step of scale.
    #[arg(long, value_delimiter = ',', default_value = "0,2000,5000,10000")]
    scale_steps: Vec<usize>,
    /// CreateVolume (and DeleteVolume) calls timed at each step of scale.
    #[arg(long, default_value_t = 200)]
    scale_ops: usize,
    /// Data written before snapshotting (100Mi, 1Gi, 4Gi, ...).
    #[arg(long, value_delimiter = ',', default_value = "100Mi,1Gi,4Gi", value_parser = parse_size)]
    snapshot_sizes: Vec<i64>,
    /// Restores and clones made from each snapshot in a round; their figures are
    /// the round's median (one CreateSnapshot a size and round).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    snapshot_repeats: u32,
    /// Volumes staged and published per kind by node.
    #[arg(long, default_value_t = 50)]
    node_volumes: usize,
    /// Volume kinds for node, as NAME=KEY=VALUE (the parameters that select the kind).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "dir=kind=dir,image=kind=image"
    )]
    node_kinds: Vec<String>,
    /// Volumes present when startup is timed (besides 0).
    #[arg(long, value_delimiter = ',', default_value = "10000")]
    startup_volumes: Vec<usize>,
    /// Restarts timed at each startup step in a round; the figure is their median
    /// (the population is made once per round, and a restart is quick).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    startup_repeats: u32,
    /// Volumes present when memory is sampled (besides at start and after deleting them).
    #[arg(long, value_delimiter = ',', default_value = "5000,10000")]
    memory_volumes: Vec<usize>,
    /// Filesystem of mount volumes in node and snapshot.
    #[arg(long, default_value = "xfs")]
    fs: String,
    /// Parameters of the volumes made by snapshot (KEY=VALUE, repeatable).
    #[arg(long = "snapshot-param", default_value = "kind=image", value_parser = parse_pair)]
    snapshot_params: Vec<(String, String)>,
    /// Parameters of the snapshots snapshot takes, as a VolumeSnapshotClass
    /// gives them (KEY=VALUE, repeatable; e.g. consistency=crash-consistent).
    #[arg(long = "snapshot-class-param", value_parser = parse_pair)]
    snapshot_class_params: Vec<(String, String)>,
    /// Parameters of all other volumes (KEY=VALUE, repeatable).
    #[arg(long = "param", value_parser = parse_pair)]
    params: Vec<(String, String)>,
    /// A topology segment (KEY=VALUE) CreateVolume requires, as a CO passes
    /// the node it chose: through a cluster's controller, the node the
    /// volumes go to. Repeated, the requests take the segments in turn
    /// (volumes spread over those nodes).
    #[arg(long, value_parser = parse_pair)]
    topology: Vec<(String, String)>,
    /// Where staging and target directories are made.
    #[arg(long, default_value = "/tmp/csi-bench-scratch")]
    scratch: PathBuf,
    /// Folder for results.json, results.txt and the SVG charts.
    #[arg(long, default_value = "csi-bench-report")]
    out: PathBuf,

    /// While the scenarios run, keep clients scraping GET /metrics at this
    /// HOST:PORT (each scrape on a new connection).
    #[arg(long)]
    metrics_hammer: Option<String>,
    /// How many clients --metrics-hammer keeps busy.
    #[arg(long, default_value_t = 300)]
    metrics_hammer_connections: usize,

    /// Instead of the scenarios: time small durable writes, each way of making
    /// them durable, in a file under this directory (the journal's write path;
    /// no driver is needed), and print a table.
    #[arg(long, value_name = "DIR")]
    sync_writes: Option<PathBuf>,
    /// Writes each way for --sync-writes.
    #[arg(long, default_value_t = 400)]
    sync_write_count: usize,
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(dir) = &args.sync_writes {
        return match syncwrite::run(dir, args.sync_write_count.max(1)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("csi-bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let _ = target::TOPOLOGY.set(args.topology.clone());
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("csi-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("csi-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let chosen: BTreeSet<String> = if args.scenarios.iter().any(|s| s == "all") {
        SCENARIOS.iter().map(|s| s.to_string()).collect()
    } else {
        args.scenarios.iter().cloned().collect()
    };
    if let Some(bad) = chosen.iter().find(|s| !SCENARIOS.contains(&s.as_str())) {
        return Err(format!(
            "unknown scenario {bad:?}; known: {}",
            SCENARIOS.join(", ")
        ));
    }
    if args.compare && args.rounds < 3 {
        return Err("--compare needs --rounds 3 or more".into());
    }
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let mut specs = vec![Spec {
        name: args.a_name.clone(),
        endpoint: args.a_endpoint.clone(),
        start: args.a_start.clone(),
        pool: args.a_pool.clone(),
        pid: args.a_pid,
        log: args.out.join(format!("{}.log", args.a_name)),
    }];
    if args.compare {
        specs.push(Spec {
            name: args.b_name.clone(),
            endpoint: args
                .b_endpoint
                .clone()
                .ok_or("--compare needs --b-endpoint")?,
            start: args.b_start.clone(),
            pool: args.b_pool.clone(),
            pid: args.b_pid,
            log: args.out.join(format!("{}.log", args.b_name)),
        });
    }
    let mut targets = Vec::new();
    for s in specs {
        eprintln!("starting/connecting {} at {}", s.name, s.endpoint);
        let (t, _) = Target::open(s).await?;
        targets.push(t);
    }
    let hammer = args
        .metrics_hammer
        .as_deref()
        .map(|a| hammer::Hammer::start(a, args.metrics_hammer_connections));
    let mut results: Vec<Vec<Figures>> = vec![Vec::new(); targets.len()];
    for round in 0..args.rounds {
        for (i, t) in targets.iter_mut().enumerate() {
            eprintln!("== round {} / {}: {}", round + 1, args.rounds, t.spec.name);
            let most = if i == 0 { None } else { args.b_max_volumes };
            if !args.no_settle {
                settle().await;
            }
            let figs = run_round(t, &args, &chosen, round, most).await?;
            results[i].push(figs);
            // Keep what was measured so far, in case a later round fails.
            report::write(&args, &targets_names(&results, &args), &results)?;
        }
    }
    drop(targets);
    if let Some(h) = hammer {
        let (answered, refused) = h.stop().await;
        let line = format!(
            "metrics hammer: {} clients, {answered} scrapes answered, {refused} refused or failed\n",
            args.metrics_hammer_connections
        );
        eprint!("{line}");
        std::fs::write(args.out.join("hammer.txt"), line)
            .map_err(|e| format!("{}: {e}", args.out.display()))?;
    }
    let names = targets_names(&results, &args);
    report::write(&args, &names, &results)?;
    print!(
        "{}",
        std::fs::read_to_string(args.out.join("results.txt")).unwrap_or_default()
    );
    Ok(())
}

/// Writes back what is dirty on the machine before a round. A snapshot of the
/// reference driver is a copy of the data through the page cache, written back
/// after its call returns: without this, the next round (the other driver's)
/// would measure its operations beside gigabytes of writeback. Bounded: a
/// `sync` that takes longer than two minutes is left to finish on its own.
async fn settle() {
    let started = std::time::Instant::now();
    let sync = tokio::task::spawn_blocking(nix::unistd::sync);
    let waited = tokio::time::timeout(std::time::Duration::from_secs(120), sync).await;
    let ms = started.elapsed().as_millis();
    match waited {
        Ok(_) => eprintln!("  settled: sync took {ms} ms"),
        Err(_) => eprintln!("  settle: sync still running after {ms} ms; going on"),
    }
}

fn targets_names(results: &[Vec<Figures>], args: &Args) -> Vec<String> {
    let mut n = vec![args.a_name.clone()];
    if results.len() > 1 {
        n.push(args.b_name.clone());
    }
    n
}

async fn run_round(
    t: &mut Target,
    args: &Args,
    chosen: &BTreeSet<String>,
    round: usize,
    most: Option<usize>,
) -> Result<Figures, String> {
    let mut out = Figures::default();
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let tag = format!("{stamp:x}r{round}");
    let has = |s: &str| chosen.contains(s);
    if has("startup") && t.can_restart() {
        let d = timed_restarts(t, args.startup_repeats).await?;
        out.put("startup/0/ready_ms", scenarios::ms(d));
    } else if has("memory") && t.can_restart() {
        t.restart().await?;
    }
    if has("memory") {
        if let Some(m) = scenarios::rss_mib(t) {
            out.put("memory/0/rss_mib", m);
        }
    }
    if has("create-delete") {
        eprintln!("  create-delete");
        scenarios::create_delete(
            t,
            &tag,
            args.count,
            &args.concurrency,
            &args.params,
            &mut out,
        )
        .await?;
    }
    if has("create-snapshot") {
        eprintln!("  create-snapshot");
        let class = &args.snapshot_class_params;
        let with = (args.params.as_slice(), class.as_slice());
        scenarios::create_snapshots(t, &tag, args.count, &args.concurrency, with, &mut out).await?;
    }
    if has("node") {
        for k in &args.node_kinds {
            let (kind, param) = k.split_once('=').unwrap_or((k.as_str(), ""));
            let params: Vec<(String, String)> = param
                .split_once('=')
                .map(|(a, b)| vec![(a.to_string(), b.to_string())])
                .unwrap_or_default();
            eprintln!("  node {kind}");
            let with = Volumes {
                fs: &args.fs,
                params: &params,
                scratch: &args.scratch,
            };
            scenarios::node(t, &tag, kind, args.node_volumes, &with, &mut out).await?;
        }
    }
    if has("snapshot") {
        eprintln!("  snapshot");
        let with = Volumes {
            fs: &args.fs,
            params: &args.snapshot_params,
            scratch: &args.scratch,
        };
        let sizes = &args.snapshot_sizes;
        let repeats = args.snapshot_repeats as usize;
        let class = &args.snapshot_class_params;
        scenarios::snapshot(t, &tag, sizes, repeats, (&with, class), &mut out).await?;
    }
    ladder(t, args, &has, &tag, most, &mut out).await?;
    Ok(out)
}

/// One ladder of volumes present serves scale, memory and startup.
async fn ladder(
    t: &mut Target,
    args: &Args,
    has: &impl Fn(&str) -> bool,
    tag: &str,
    most: Option<usize>,
    out: &mut Figures,
) -> Result<(), String> {
    let mut steps = BTreeSet::new();
    if has("scale") {
        steps.extend(args.scale_steps.iter().copied());
    }
    if has("memory") {
        steps.extend(args.memory_volumes.iter().copied());
    }
    if has("startup") && t.can_restart() {
        steps.extend(args.startup_volumes.iter().copied());
    }
    if let Some(most) = most {
        steps.retain(|&n| n <= most);
    }
    if !steps.is_empty() {
        eprintln!("  scale/memory/startup ladder: {steps:?}");
    }
    let mut pop = Population::default();
    for &n in &steps {
        pop.grow_to(t, tag, n, &args.params).await?;
        if has("scale") && args.scale_steps.contains(&n) {
            scenarios::scale_step(t, tag, n, args.scale_ops, &args.params, out).await?;
        }
        if has("memory") && args.memory_volumes.contains(&n) {
            if let Some(m) = scenarios::rss_mib(t) {
                out.put(format!("memory/{n}/rss_mib"), m);
            }
        }
        if has("startup") && t.can_restart() && args.startup_volumes.contains(&n) {
            let d = timed_restarts(t, args.startup_repeats).await?;
            out.put(format!("startup/{n}/ready_ms"), scenarios::ms(d));
        }
    }
    if !pop.ids.is_empty() {
        pop.clear(t).await?;
        if has("memory") {
            if let Some(m) = scenarios::rss_mib(t) {
                out.put("memory/after-delete/rss_mib", m);
            }
        }
    }
    Ok(())
}

/// The median time to ready of `repeats` restarts.
async fn timed_restarts(t: &mut Target, repeats: u32) -> Result<std::time::Duration, String> {
    let mut times = Vec::new();
    for _ in 0..repeats {
        times.push(t.restart().await?);
    }
    times.sort();
    Ok(scenarios::percentile(&times, 0.5))
}
