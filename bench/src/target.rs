//! A driver under test: its socket, and (when the benchmark starts it) its
//! process, so that startup can be timed and RSS read.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use csi_proto::csi::{
    self, controller_client::ControllerClient, identity_client::IdentityClient,
    node_client::NodeClient,
};
use tonic::transport::Channel;

#[derive(Debug, Clone)]
pub struct Spec {
    pub name: String,
    pub endpoint: String,
    /// A shell command that starts the driver in the foreground (run as `exec CMD`).
    pub start: Option<String>,
    /// The pool directory (for the space a snapshot takes).
    pub pool: Option<PathBuf>,
    /// The driver's pid, when the benchmark did not start it.
    pub pid: Option<u32>,
    pub log: PathBuf,
}

pub struct Target {
    pub spec: Spec,
    child: Option<Child>,
    pub ctl: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
    pub id: IdentityClient<Channel>,
}

pub type Error = String;

impl Target {
    /// Starts the driver (when it has a start command) and connects.
    pub async fn open(spec: Spec) -> Result<(Target, Duration), Error> {
        let mut child = None;
        let t0 = Instant::now();
        if let Some(cmd) = &spec.start {
            child = Some(spawn(cmd, &spec)?);
        }
        let ch = wait_ready(&spec, &mut child, Duration::from_secs(600)).await?;
        let took = t0.elapsed();
        Ok((
            Target {
                ctl: ControllerClient::new(ch.clone()),
                node: NodeClient::new(ch.clone()),
                id: IdentityClient::new(ch),
                spec,
                child,
            },
            took,
        ))
    }

    pub fn can_restart(&self) -> bool {
        self.spec.start.is_some()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id()).or(self.spec.pid)
    }

    /// VmRSS in bytes.
    pub fn rss(&self) -> Option<u64> {
        let text = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }

    /// CPU time and context switches of each of the driver's threads so far,
    /// by thread id; None when its process is not known.
    pub fn usage(&self) -> Option<Usage> {
        usage_of_pid(self.pid()?)
    }

    /// SIGTERM (SIGKILL after 60 s) and wait.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the driver and starts it again; returns the time from process start
    /// to the first Probe that answers ready.
    pub async fn restart(&mut self) -> Result<Duration, Error> {
        let cmd = self
            .spec
            .start
            .clone()
            .ok_or("restart needs a start command")?;
        self.stop();
        let t0 = Instant::now();
        self.child = Some(spawn(&cmd, &self.spec)?);
        let ch = wait_ready(&self.spec, &mut self.child, Duration::from_secs(600)).await?;
        let took = t0.elapsed();
        self.ctl = ControllerClient::new(ch.clone());
        self.node = NodeClient::new(ch.clone());
        self.id = IdentityClient::new(ch);
        Ok(took)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.stop();
    }
}

fn spawn(cmd: &str, spec: &Spec) -> Result<Child, Error> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)
        .map_err(|e| format!("{}: {e}", spec.log.display()))?;
    let err = log.try_clone().map_err(|e| e.to_string())?;
    Command::new("sh")
        .arg("-c")
        .arg(format!("exec {cmd}"))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("{}: cannot start {cmd:?}: {e}", spec.name))
}

/// Polls connect + Probe until the driver says ready.
async fn wait_ready(
    spec: &Spec,
    child: &mut Option<Child>,
    limit: Duration,
) -> Result<Channel, Error> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(c) = child.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                *child = None;
                return Err(format!(
                    "{} exited with {status} at start (log: {})",
                    spec.name,
                    spec.log.display()
                ));
            }
        }
        if let Ok(ch) = csi_glue::connect(&spec.endpoint).await {
            let mut id = IdentityClient::new(ch.clone());
            if let Ok(r) = id.probe(csi::ProbeRequest {}).await {
                // An unset `ready` means ready (CSI spec).
                if r.into_inner().ready.unwrap_or(true) {
                    return Ok(ch);
                }
            }
        }
        if Instant::now() > deadline {
            return Err(format!("{} not ready after {limit:?}", spec.name));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub fn mount_cap(fs: &str) -> csi::VolumeCapability {
    use csi::volume_capability::{self, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume {
                fs_type: fs.to_string(),
                ..Default::default()
            },
        )),
        access_mode: Some(volume_capability::AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

/// The topology segments CreateVolume requires (`--topology`, repeatable),
/// as a CO passes the node it scheduled a pod to: one per request, in turn,
/// so that volumes spread evenly over the nodes named.
pub static TOPOLOGY: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();
static NEXT_TOPOLOGY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The segment of the next request, taking turns over `segments`.
fn next_segment(segments: &[(String, String)]) -> Option<&(String, String)> {
    let i = NEXT_TOPOLOGY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    turn(segments, i)
}

/// The segment whose turn request `i` is.
fn turn(segments: &[(String, String)], i: usize) -> Option<&(String, String)> {
    segments.get(i.checked_rem(segments.len())?)
}

pub fn create_req(
    name: &str,
    size: i64,
    fs: &str,
    params: &[(String, String)],
) -> csi::CreateVolumeRequest {
    let segment = TOPOLOGY.get().and_then(|t| next_segment(t));
    let accessibility_requirements = segment.map(|(k, v)| {
        let at = csi::Topology {
            segments: [(k.clone(), v.clone())].into_iter().collect(),
        };
        csi::TopologyRequirement {
            requisite: vec![at.clone()],
            preferred: vec![at],
        }
    });
    csi::CreateVolumeRequest {
        name: name.to_string(),
        capacity_range: csi_glue::capacity_at_least(size),
        volume_capabilities: vec![mount_cap(fs)],
        parameters: params.iter().cloned().collect::<BTreeMap<_, _>>(),
        accessibility_requirements,
        ..Default::default()
    }
}

/// What [`Target::usage`] reads, for the process `pid`.
fn usage_of_pid(pid: u32) -> Option<Usage> {
    let mut threads = BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let dir = entry.path();
        let cpu_ns = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok());
        let switches = std::fs::read_to_string(dir.join("status")).ok().map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum()
        });
        if let (Some(cpu_ns), Some(switches)) = (cpu_ns, switches) {
            threads.insert(tid, (cpu_ns, switches));
        }
    }
    Some(Usage(threads))
}

/// CPU time (ns) and context switches by thread, as [`Target::usage`] read them.
pub struct Usage(BTreeMap<u32, (u64, u64)>);

impl Usage {
    /// CPU time (ns) and context switches since `before`: the growth of each
    /// thread there then, and all of each thread started since. A thread that
    /// ended meanwhile leaves out what it used since `before`.
    pub fn since(&self, before: &Usage) -> (u64, u64) {
        self.0.iter().fold((0, 0), |(cpu, sw), (tid, &(c, s))| {
            let (c0, s0) = before.0.get(tid).copied().unwrap_or((0, 0));
            (cpu + c.saturating_sub(c0), sw + s.saturating_sub(s0))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_take_the_topology_segments_in_turn() {
        let segs: Vec<(String, String)> = ["node-a", "node-b"]
            .iter()
            .map(|n| ("topology.example.csi/node".to_string(), n.to_string()))
            .collect();
        let picked: Vec<&str> = (0..5).map(|i| turn(&segs, i).unwrap().1.as_str()).collect();
        assert_eq!(picked, ["node-a", "node-b", "node-a", "node-b", "node-a"]);
        assert!(turn(&[], 3).is_none());
    }

    #[test]
    fn usage_counts_each_threads_growth_and_new_threads_whole() {
        let before = Usage(BTreeMap::from([(1, (1_000, 10)), (2, (5_000, 50))]));
        // Thread 2 ended (what it used before is not taken off), 3 started.
        let after = Usage(BTreeMap::from([(1, (1_700, 14)), (3, (200, 2))]));
        assert_eq!(after.since(&before), (900, 6));
    }

    #[test]
    fn usage_of_this_process_grows_with_work() {
        let read =
            || usage_of_pid(std::process::id()).expect("this process's threads are readable");
        let own = || -> u64 {
            let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
            s.split_whitespace().next().unwrap().parse().unwrap()
        };
        let before = read();
        // Works until this thread has 20 ms more CPU time, however busy the machine.
        let (start, deadline) = (own(), Instant::now() + Duration::from_secs(30));
        let mut x = 0u64;
        while own() < start + 20_000_000 {
            assert!(Instant::now() < deadline, "no CPU time in 30 s");
            for _ in 0..10_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
        }
        std::hint::black_box(x);
        let (cpu_ns, _) = read().since(&before);
        assert!(cpu_ns >= 20_000_000, "{cpu_ns} ns");
    }
}
