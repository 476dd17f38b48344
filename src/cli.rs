//! Command-line flags. Every flag can also be set through an environment variable,
//! as the kubernetes-csi drivers do, so manifests may use either.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Identity, Controller, GroupController and Node.
    All,
    /// Identity, Controller and GroupController.
    Controller,
    /// Identity and Node.
    Node,
    /// The controller of a multi-node cluster: Identity, Controller,
    /// GroupController and SnapshotMetadata for the volumes of every node,
    /// each call sent to the node agent that holds its data. Keeps no
    /// volumes itself.
    Router,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Default pool, made when no --pool is given.
pub const DEFAULT_POOL_PATH: &str = "/var/lib/example-csi/pool";

#[derive(Debug, Parser)]
#[command(
    name = "csi-driver",
    version,
    // A flag given twice takes its last value, as with the Go flag package the
    // sidecars use (an overlay may patch a flag the base already sets).
    args_override_self = true,
    about = "example-csi: a CSI driver for node-local storage (image files on loop devices, \
             directories, btrfs subvolumes)"
)]
pub struct Cli {
    /// CSI endpoint: unix:///path/to/csi.sock or a bare path. tcp:// only with --allow-tcp.
    #[arg(
        long,
        env = "CSI_ENDPOINT",
        default_value = "unix:///csi/csi.sock",
        global = true
    )]
    pub endpoint: String,

    /// This node's id, as kubelet knows it (usually the node name).
    #[arg(long, env = "NODE_ID")]
    pub nodeid: Option<String>,

    /// The driver's name, as in the CSIDriver object and StorageClasses.
    #[arg(long, env = "CSI_DRIVER_NAME", default_value = "example.csi.k8s.io")]
    pub drivername: String,

    /// Which services to serve.
    #[arg(long, env = "CSI_MODE", value_enum, default_value = "all")]
    pub mode: Mode,

    /// A storage pool, NAME=PATH (a bare PATH is the pool "default"). Repeatable;
    /// the directory must exist. Without any, /var/lib/example-csi/pool is made and used.
    #[arg(long = "pool", env = "CSI_POOLS", value_delimiter = ',')]
    pub pools: Vec<String>,

    /// Where the driver keeps its records.
    #[arg(
        long,
        env = "CSI_STATE_DIR",
        default_value = "/var/lib/example-csi/state"
    )]
    pub state_dir: PathBuf,

    /// Serve ControllerPublish/Unpublish (the CSIDriver must then say attachRequired: true).
    #[arg(long, env = "CSI_ENABLE_ATTACH")]
    pub enable_attach: bool,

    /// Do not offer ControllerExpandVolume; NodeExpandVolume grows volumes instead
    /// (for the distributed deployment, where the resizer runs once per cluster).
    #[arg(long, env = "CSI_DISABLE_CONTROLLER_EXPANSION")]
    pub disable_controller_expansion: bool,

    /// Mutable parameters accepted by ControllerModifyVolume (empty: MODIFY_VOLUME off).
    #[arg(
        long,
        env = "CSI_MUTABLE_PARAMETERS",
        value_delimiter = ',',
        default_value = "directIO,readAheadKiB,compression,transferBandwidth"
    )]
    pub mutable_parameters: Vec<String>,

    /// Serve Prometheus metrics and /healthz on this address (off when empty).
    #[arg(long, env = "CSI_METRICS_ADDRESS", default_value = "")]
    pub metrics_address: String,

    /// Seconds the figures of /metrics (pools, loop devices, readiness) and the
    /// answer of /healthz may be reused; a scrape or probe after that waits
    /// (briefly) for new ones. However many scrapes come, they are read at most
    /// this often, by a thread of their own, never by the CSI calls' threads.
    #[arg(long, env = "CSI_METRICS_MAX_AGE", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(0..=300))]
    pub metrics_max_age: u64,

    /// Connections the metrics port serves at once; more are closed at once
    /// (counted in example_csi_metrics_connections_refused_total).
    #[arg(long, env = "CSI_METRICS_MAX_CONNECTIONS", default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub metrics_max_connections: u64,

    /// Seconds the volume and pool health figures of /metrics are reused before a
    /// scrape checks again (0: every scrape checks). A check reads every volume's
    /// image or directory, so a short age costs I/O on a node with many volumes.
    #[arg(long, env = "CSI_METRICS_HEALTH_MAX_AGE", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub metrics_health_max_age: u64,

    /// Register the driver with the kubelet without node-driver-registrar: the
    /// kubelet's plugins_registry directory as mounted here (e.g.
    /// /var/lib/kubelet/plugins_registry). Serves <drivername>-reg.sock there.
    /// Off when empty; --mode node or all only.
    #[arg(long, env = "CSI_KUBELET_REGISTRATION_DIR", default_value = "")]
    pub kubelet_registration_dir: String,

    /// The CSI socket's path as the kubelet on the host sees it (e.g.
    /// /var/lib/kubelet/plugins/example.csi.k8s.io/csi.sock); required with
    /// --kubelet-registration-dir.
    #[arg(long, env = "CSI_KUBELET_REGISTRATION_PATH", default_value = "")]
    pub kubelet_registration_path: String,

    /// Filesystem made on a mount volume whose capability names none.
    #[arg(long, env = "CSI_DEFAULT_FSTYPE", default_value = "ext4",
          value_parser = ["ext4", "xfs", "btrfs"])]
    pub default_fstype: String,

    /// Most volumes this node stages at once (0: no limit).
    #[arg(long, env = "CSI_MAX_VOLUMES_PER_NODE", default_value_t = 0)]
    pub max_volumes_per_node: u64,

    /// Heavy operations (mkfs, copies, fsck) run at once; the rest wait their turn.
    #[arg(long, env = "CSI_HEAVY_OPERATIONS", default_value_t = 4,
          value_parser = clap::value_parser!(u64).range(1..=256))]
    pub heavy_operations: u64,

    /// Threads of the async runtime, which read, route and answer the gRPC calls;
    /// the work of every call runs on the blocking pool. One keeps each call's
    /// answer on the thread that read it, which saves a hand-off between threads
    /// per call; more help only where TLS to other nodes is the load.
    #[arg(long, env = "CSI_ASYNC_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub async_threads: u64,

    /// At start, unmount and detach loop devices and mounts of pool volumes that no
    /// volume staged on this node accounts for (they are only reported otherwise).
    #[arg(long, env = "CSI_CLEANUP_ORPHANS")]
    pub cleanup_orphans: bool,

    /// Seconds an external filesystem tool (mkfs, fsck, resize2fs, xfs_growfs,
    /// tune2fs) may run before it is killed and the call fails with DEADLINE_EXCEEDED.
    #[arg(long, env = "CSI_COMMAND_TIMEOUT", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub command_timeout: u64,

    /// Seconds a filesystem may stay frozen for a snapshot or clone beyond the
    /// copy's expected time (none for a reflink); then it is thawed and the call
    /// fails with ABORTED, undone, to be retried.
    #[arg(long, env = "CSI_FREEZE_TIMEOUT", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub freeze_timeout: u64,

    /// While a filesystem freezes for a snapshot or clone, expedite the kernel's
    /// RCU grace periods (/sys/kernel/rcu_expedited, raised for the freeze only and
    /// put back; left alone when already raised): a freeze takes a few ms instead
    /// of three normal grace periods, at the price of an interrupt to every busy
    /// CPU while it runs. On by default; --expedite-freeze=false leaves the
    /// kernel's switch alone.
    #[arg(long, env = "CSI_EXPEDITE_FREEZE", default_value_t = true,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub expedite_freeze: bool,

    /// Percent of a pool's filesystem in use at which NodeGetStorageHealth reports
    /// the pool as nearly full (0: never).
    #[arg(long, env = "CSI_POOL_FULL_PERCENT", default_value_t = 90,
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub pool_full_percent: u8,

    /// More mount options callers may ask for, FS=OPTION (FS: ext4, xfs, btrfs,
    /// or * for any; OPTION a word, or name= for that option with any plain
    /// value). Repeatable. Options of the filesystem's own that name nothing of
    /// the host are allowed already.
    #[arg(
        long = "allow-mount-option",
        env = "CSI_ALLOW_MOUNT_OPTIONS",
        value_delimiter = ','
    )]
    pub allow_mount_options: Vec<String>,

    /// Flags every mount volume gets unless its request names the opposite
    /// (dev, suid, exec, which must then be allowed with --allow-mount-option).
    /// Empty: none. Never given to raw block volumes.
    #[arg(
        long,
        env = "CSI_DEFAULT_MOUNT_FLAGS",
        value_delimiter = ',',
        default_value = "nodev,nosuid"
    )]
    pub default_mount_flags: Vec<String>,

    /// Pools that inline ephemeral volumes (CSI volumes written into a pod's
    /// spec, with no claim or quota) may use. Empty: they are refused, and
    /// generic ephemeral volumes are the way to give a pod a volume of its own.
    #[arg(long, env = "CSI_EPHEMERAL_POOLS", value_delimiter = ',')]
    pub ephemeral_pools: Vec<String>,

    /// The largest inline ephemeral volume (e.g. 1Gi, 512Mi). Each one reserves
    /// its size in its pool until its pod is gone.
    #[arg(long, env = "CSI_EPHEMERAL_MAX_SIZE", default_value = "1Gi")]
    pub ephemeral_max_size: String,

    /// The kubelet's root directory (its --root-dir). Volumes are staged and
    /// published only below its pods/ and plugins/kubernetes.io/csi/
    /// directories; any other path is refused.
    #[arg(long, env = "CSI_KUBELET_DIR", default_value = csi_storage::DEFAULT_KUBELET_DIR)]
    pub kubelet_dir: PathBuf,

    /// One more directory below which volumes may be staged and published
    /// (repeatable), beside the kubelet's: for tests and tools that are not
    /// the kubelet. By default /tmp, where conformance tools put their
    /// paths (in the deployed container, the container's own /tmp, which
    /// nothing on the host sees); given, it replaces that; an empty value
    /// allows none.
    #[arg(
        long = "allowed-path-root",
        env = "CSI_ALLOWED_PATH_ROOTS",
        value_delimiter = ',',
        default_value = "/tmp"
    )]
    pub allowed_path_roots: Vec<PathBuf>,

    /// Transfers of volume data from other nodes that run at once on this
    /// node; more wait their turn.
    #[arg(long, env = "CSI_MAX_TRANSFERS", default_value_t = 2,
        value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_transfers: u32,

    /// Bytes per second that the transfers to this node read from the
    /// network, together (e.g. 100Mi; 0: no limit).
    #[arg(long, env = "CSI_TRANSFER_BANDWIDTH", default_value = "0")]
    pub transfer_bandwidth: String,

    /// Seconds to let running RPCs finish after SIGTERM/SIGINT.
    #[arg(long, env = "CSI_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,

    /// The numeric group the CSI socket is given (it is 0660): clients running as
    /// another user in that group (a sidecar as non-root) can connect. Default:
    /// the driver's own group.
    #[arg(long, env = "CSI_SOCKET_GROUP")]
    pub socket_group: Option<u32>,

    /// Allow a tcp:// endpoint. The CSI API can mount anything anywhere: only for
    /// tests on an isolated host.
    #[arg(long, env = "CSI_ALLOW_TCP")]
    pub allow_tcp: bool,

    /// Log format.
    #[arg(long, env = "CSI_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Log level or filter (error, warn, info, debug, trace, or a tracing filter).
    #[arg(long, env = "CSI_LOG_LEVEL", default_value = "info")]
    pub log_level: String,

    /// Serve this node's Controller services to the cluster's controller on
    /// this TCP address (host:port), with mutual TLS under the mesh
    /// authority (--mesh-dir): this process is the node's agent. Needs
    /// --mode all.
    #[arg(long, env = "CSI_AGENT_LISTEN", default_value = "")]
    pub agent_listen: String,

    /// Folder holding the mesh authority (ca.crt and ca.key, or tls.crt and
    /// tls.key: a mounted Secret), for --agent-listen and --mode router.
    #[arg(long, env = "CSI_MESH_DIR", default_value = "/etc/example-csi/mesh")]
    pub mesh_dir: PathBuf,

    /// --mode router: the node agents, as NODE=HOST:PORT (repeat, or
    /// comma-separated), when they are not read from Kubernetes.
    #[arg(long = "agent", env = "CSI_AGENTS", value_delimiter = ',')]
    pub agents: Vec<String>,

    /// --mode router: read the node agents from the Kubernetes API: the pods
    /// of this pod's namespace matching --agent-selector, at --agent-port.
    /// With it, a mesh authority missing from --mesh-dir is read from (or
    /// made as) the Secret --mesh-secret.
    #[arg(long, env = "CSI_AGENTS_FROM_KUBERNETES")]
    pub agents_from_kubernetes: bool,

    #[arg(
        long,
        env = "CSI_AGENT_SELECTOR",
        default_value = "app.kubernetes.io/name=example-csi,app.kubernetes.io/component=node"
    )]
    pub agent_selector: String,

    #[arg(long, env = "CSI_AGENT_PORT", default_value_t = 9820)]
    pub agent_port: u16,

    #[arg(long, env = "CSI_MESH_SECRET", default_value = "example-csi-mesh")]
    pub mesh_secret: String,

    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Parses the command line. A bad flag is one line on stderr and exit status 2;
/// --help and --version print as usual.
pub fn parse() -> Result<Cli, std::process::ExitCode> {
    match Cli::try_parse() {
        Ok(c) => Ok(c),
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    return Err(std::process::ExitCode::SUCCESS);
                }
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    return Err(std::process::ExitCode::from(2));
                }
                _ => {}
            }
            let text = e.render().to_string();
            let line = text
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or("bad command line");
            let line = line.strip_prefix("error: ").unwrap_or(line);
            let hint = text
                .lines()
                .map(str::trim)
                .find(|l| l.starts_with("[possible values:"))
                .map(|l| format!(" {l}"))
                .unwrap_or_default();
            eprintln!("csi-driver: {line}{hint} (see --help)");
            Err(std::process::ExitCode::from(2))
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Call CSI RPCs on a socket (this driver's or any other) and print the answer.
    Client(crate::client::ClientArgs),
    /// Make a new pair of mesh authorities in a folder: DIR/controller for
    /// the controller's --mesh-dir, DIR/node for the nodes'. `kubectl create
    /// secret generic example-csi-mesh --from-file=DIR/controller` and
    /// `... example-csi-mesh-node --from-file=DIR/node` make their Secrets.
    MeshAuthority {
        /// The folder to write into (made if missing; existing files are kept).
        #[arg(long)]
        dir: PathBuf,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expedite(flags: &[&str]) -> Result<bool, clap::Error> {
        let mut args = vec!["csi-driver", "--nodeid=n1"];
        args.extend_from_slice(flags);
        Cli::try_parse_from(args).map(|c| c.expedite_freeze)
    }

    #[test]
    fn freezes_are_expedited_unless_turned_off() {
        assert!(expedite(&[]).unwrap(), "on by default");
        assert!(expedite(&["--expedite-freeze"]).unwrap());
        for on in ["true", "1", "yes", "on"] {
            assert!(
                expedite(&[&format!("--expedite-freeze={on}")]).unwrap(),
                "{on}"
            );
        }
        for off in ["false", "0", "no", "off"] {
            assert!(
                !expedite(&[&format!("--expedite-freeze={off}")]).unwrap(),
                "{off}"
            );
        }
        assert!(expedite(&["--expedite-freeze=maybe"]).is_err());
        // The last of two wins, as for every flag.
        assert!(!expedite(&["--expedite-freeze", "--expedite-freeze=false"]).unwrap());
    }

    #[test]
    fn one_async_thread_unless_asked_and_never_none() {
        let threads = |flags: &[&str]| {
            let mut args = vec!["csi-driver", "--nodeid=n1"];
            args.extend_from_slice(flags);
            Cli::try_parse_from(args).map(|c| c.async_threads)
        };
        assert_eq!(threads(&[]).unwrap(), 1);
        assert_eq!(threads(&["--async-threads=4"]).unwrap(), 4);
        for bad in ["0", "65", "-1", "many"] {
            assert!(
                threads(&[&format!("--async-threads={bad}")]).is_err(),
                "{bad}"
            );
        }
    }
}
