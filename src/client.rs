//! `csi-driver client`: calls CSI RPCs on any socket (this driver's or another's)
//! and prints the answer as YAML or JSON. Only argument parsing, request building
//! and printing live here: every decision is the driver's.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

use clap::{Args, Subcommand, ValueEnum};
use csi_proto::csi::{
    self, controller_client::ControllerClient, identity_client::IdentityClient,
    node_client::NodeClient, volume_capability,
};
use csi_storage::model::AccessMode;
use csi_storage::size::parse_size;
use serde_json::{json, Value};
use tonic::transport::Channel;

mod calls;

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// Output format (before or after the call's name).
    #[arg(
        short = 'o',
        long = "output",
        value_enum,
        default_value = "yaml",
        global = true
    )]
    pub output: Output,

    #[command(subcommand)]
    pub call: Call,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Yaml,
    Json,
}

/// How a volume is accessed: as a filesystem (`--fs`) or a raw device (`--block`).
#[derive(Debug, Args, Clone)]
pub struct Access {
    /// Filesystem type of a mount volume (empty: the driver's default).
    #[arg(long, default_value = "")]
    pub fs: String,
    /// Raw block access instead of a filesystem.
    #[arg(long, conflicts_with = "fs")]
    pub block: bool,
    /// Access mode.
    #[arg(long, value_enum, default_value = "single-node-writer")]
    pub mode: AccessMode,
    /// Mount flag (repeatable).
    #[arg(long = "mount-flag")]
    pub mount_flags: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum Call {
    /// GetPluginInfo, Probe and NodeGetInfo.
    Info,
    /// Plugin, controller, node and group controller capabilities.
    Capabilities,
    /// CreateVolume.
    CreateVolume(CreateVolume),
    /// DeleteVolume.
    DeleteVolume(DeleteVolume),
    /// ControllerGetVolume.
    GetVolume(GetVolume),
    /// ListVolumes (one page with --max, all pages without).
    ListVolumes(ListVolumes),
    /// ControllerExpandVolume.
    ExpandVolume(ExpandVolume),
    /// NodeExpandVolume.
    NodeExpand(NodeExpand),
    /// CreateSnapshot.
    CreateSnapshot(CreateSnapshot),
    /// DeleteSnapshot.
    DeleteSnapshot(DeleteSnapshot),
    /// ListSnapshots (all pages).
    ListSnapshots(ListSnapshots),
    /// GetCapacity.
    Capacity(Capacity),
    /// NodeStageVolume.
    NodeStage(NodeStage),
    /// NodePublishVolume.
    NodePublish(NodePublish),
    /// NodeUnpublishVolume.
    NodeUnpublish(NodeUnpublish),
    /// NodeUnstageVolume.
    NodeUnstage(NodeUnstage),
    /// NodeGetVolumeStats.
    Stats(Stats),
    /// Volume health: ControllerGetVolumeHealth of one volume, NodeGetVolumeHealth
    /// with --node, or without an id ControllerListVolumeHealth (the volumes with
    /// a problem; one page with --max, all pages without).
    VolumeHealth(VolumeHealth),
    /// NodeGetStorageHealth: the problems of this node's pools.
    StorageHealth,
    /// The transfers of volume data between nodes: on a node's socket, its
    /// arrivals and holds; on the cluster controller's, every node's.
    Transfers(Transfers),
}

#[derive(Debug, Args)]
pub struct CreateVolume {
    name: String,
    /// Requested size: bytes or with a suffix (K, M, G, T, Ki, Mi, Gi, Ti).
    #[arg(long, value_parser = parse_size, default_value = "1Gi")]
    size: i64,
    /// Largest size accepted (0: no limit).
    #[arg(long, value_parser = parse_size, default_value = "0")]
    limit: i64,
    #[command(flatten)]
    access: Access,
    /// StorageClass parameter KEY=VALUE (repeatable).
    #[arg(long = "param", value_parser = parse_pair)]
    params: Vec<(String, String)>,
    /// Restore from this snapshot.
    #[arg(long, conflicts_with = "source_volume")]
    source_snapshot: Option<String>,
    /// Clone this volume.
    #[arg(long)]
    source_volume: Option<String>,
    /// Make it on this node (its topology requirement); through the cluster's
    /// controller, a source on another node is then moved here.
    #[arg(long)]
    node: Option<String>,
}

#[derive(Debug, Args)]
pub struct DeleteVolume {
    volume_id: String,
}

#[derive(Debug, Args)]
pub struct GetVolume {
    volume_id: String,
}

#[derive(Debug, Args)]
pub struct ListVolumes {
    #[arg(long, default_value_t = 0)]
    max: i32,
    #[arg(long, default_value = "")]
    token: String,
}

#[derive(Debug, Args)]
pub struct ExpandVolume {
    volume_id: String,
    #[arg(long, value_parser = parse_size)]
    size: i64,
    #[command(flatten)]
    access: Access,
}

#[derive(Debug, Args)]
pub struct NodeExpand {
    volume_id: String,
    #[arg(long, value_parser = parse_size)]
    size: i64,
    /// The published (or staged) path.
    #[arg(long)]
    path: String,
    #[arg(long, default_value = "")]
    staging: String,
}

#[derive(Debug, Args)]
pub struct CreateSnapshot {
    name: String,
    #[arg(long)]
    volume: String,
    #[arg(long = "param", value_parser = parse_pair)]
    params: Vec<(String, String)>,
}

#[derive(Debug, Args)]
pub struct DeleteSnapshot {
    snapshot_id: String,
}

#[derive(Debug, Args)]
pub struct ListSnapshots {
    #[arg(long, default_value = "")]
    volume: String,
    #[arg(long, default_value = "")]
    snapshot: String,
}

#[derive(Debug, Args)]
pub struct Capacity {
    #[arg(long = "param", value_parser = parse_pair)]
    params: Vec<(String, String)>,
}

#[derive(Debug, Args)]
pub struct NodeStage {
    volume_id: String,
    #[arg(long)]
    staging: String,
    #[command(flatten)]
    access: Access,
    /// volume_context KEY=VALUE, as CreateVolume returned it (repeatable).
    #[arg(long = "context", value_parser = parse_pair)]
    context: Vec<(String, String)>,
}

#[derive(Debug, Args)]
pub struct NodePublish {
    volume_id: String,
    #[arg(long, default_value = "")]
    staging: String,
    #[arg(long)]
    target: String,
    #[arg(long)]
    readonly: bool,
    #[command(flatten)]
    access: Access,
    #[arg(long = "context", value_parser = parse_pair)]
    context: Vec<(String, String)>,
}

#[derive(Debug, Args)]
pub struct NodeUnpublish {
    volume_id: String,
    #[arg(long)]
    target: String,
}

#[derive(Debug, Args)]
pub struct NodeUnstage {
    volume_id: String,
    #[arg(long)]
    staging: String,
}

#[derive(Debug, Args)]
pub struct Stats {
    volume_id: String,
    /// The published (or staged) path.
    #[arg(long)]
    path: String,
    #[arg(long, default_value = "")]
    staging: String,
}

#[derive(Debug, Args)]
pub struct Transfers {
    /// Wait until the data of this volume has arrived (its transfer here
    /// done), then print that transfer alone.
    #[arg(long, value_name = "VOLUME_ID")]
    wait: Option<String>,
    /// Seconds --wait waits at most (then DEADLINE_EXCEEDED, with the
    /// transfer's last state).
    #[arg(long, default_value_t = 3600, requires = "wait")]
    timeout: u64,
}

#[derive(Debug, Args)]
pub struct VolumeHealth {
    volume_id: Option<String>,
    /// Ask the node service (what this node sees: mounts, loop device,
    /// filesystem errors).
    #[arg(long, requires = "volume_id")]
    node: bool,
    /// With --node: the published path to check (default: all it knows).
    #[arg(long, default_value = "", requires = "node")]
    path: String,
    /// With --node: the staging path to check (default: the one it knows).
    #[arg(long, default_value = "", requires = "node")]
    staging: String,
    #[arg(long, default_value_t = 0, conflicts_with = "volume_id")]
    max: i32,
    #[arg(long, default_value = "", conflicts_with = "volume_id")]
    token: String,
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

fn to_map(pairs: &[(String, String)]) -> BTreeMap<String, String> {
    pairs.iter().cloned().collect()
}

impl Access {
    fn capability(&self) -> csi::VolumeCapability {
        use volume_capability::access_mode::Mode;
        let access_type = if self.block {
            volume_capability::AccessType::Block(volume_capability::BlockVolume {})
        } else {
            volume_capability::AccessType::Mount(volume_capability::MountVolume {
                fs_type: self.fs.clone(),
                mount_flags: self.mount_flags.clone(),
                volume_mount_group: String::new(),
            })
        };
        let mode = match self.mode {
            AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
            AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
            AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
            AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
            AccessMode::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
            AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
            AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
            AccessMode::Unknown => Mode::Unknown,
        };
        csi::VolumeCapability {
            access_type: Some(access_type),
            access_mode: Some(volume_capability::AccessMode { mode: mode as i32 }),
        }
    }
}

pub fn main(endpoint: &str, args: &ClientArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            complain(&format!("csi-driver client: cannot start the runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(endpoint, &args.call)) {
        Ok(v) => {
            let text = match args.output {
                Output::Json => serde_json::to_string_pretty(&v)
                    .map(|t| t + "\n")
                    .map_err(|e| e.to_string()),
                Output::Yaml => yaml(&v),
            };
            let text = match text {
                Ok(t) => t,
                Err(e) => {
                    complain(&format!("csi-driver client: cannot render the answer: {e}"));
                    return ExitCode::FAILURE;
                }
            };
            let mut out = std::io::stdout().lock();
            match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                Ok(()) => ExitCode::SUCCESS,
                // The reader has gone (`| head -1`): it took what it wanted.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                Err(e) => {
                    complain(&format!("csi-driver client: cannot write the answer: {e}"));
                    ExitCode::FAILURE
                }
            }
        }
        Err(Failure::Connect(cause)) => {
            complain(&format!(
                "csi-driver client: cannot connect to {endpoint}: {cause}"
            ));
            ExitCode::FAILURE
        }
        Err(Failure::Rpc(s)) => {
            complain(&format!(
                "error: code = {:?} message = {}",
                s.code(),
                s.message()
            ));
            ExitCode::FAILURE
        }
    }
}

/// One line on standard error; a closed stderr is no reason to panic.
fn complain(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The innermost cause of a connection failure, as a phrase: "no such file or
/// directory", not the layers of transport wrappers around it.
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut inner = e;
    while let Some(s) = inner.source() {
        inner = s;
    }
    let text = match inner.downcast_ref::<std::io::Error>() {
        // "No such file or directory (os error 2)" -> "no such file or directory"
        Some(io) if io.raw_os_error().is_some() => {
            let t = io.to_string();
            t.rfind(" (os error ")
                .map_or(t.clone(), |i| t[..i].to_string())
        }
        _ => inner.to_string(),
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => e.to_string(),
    }
}

enum Failure {
    Connect(String),
    Rpc(tonic::Status),
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Self {
        Failure::Rpc(s)
    }
}

/// The clients of the driver's services, on one connection.
struct Services {
    id: IdentityClient<Channel>,
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    channel: Channel,
}

async fn run(endpoint: &str, call: &Call) -> Result<Value, Failure> {
    let channel = csi_glue::connect(endpoint)
        .await
        .map_err(|e| Failure::Connect(root_cause(&e)))?;
    let s = &mut Services {
        id: IdentityClient::new(channel.clone()),
        ctl: ControllerClient::new(channel.clone()),
        node: NodeClient::new(channel.clone()),
        channel,
    };
    match call {
        Call::Info => calls::info(s).await,
        Call::Capabilities => capabilities(s).await,
        Call::CreateVolume(a) => calls::create_volume(s, a).await,
        Call::DeleteVolume(a) => calls::delete_volume(s, a).await,
        Call::GetVolume(a) => calls::get_volume(s, a).await,
        Call::ListVolumes(a) => calls::list_volumes(s, a).await,
        Call::ExpandVolume(a) => calls::expand_volume(s, a).await,
        Call::NodeExpand(a) => calls::node_expand(s, a).await,
        Call::CreateSnapshot(a) => calls::create_snapshot(s, a).await,
        Call::DeleteSnapshot(a) => calls::delete_snapshot(s, a).await,
        Call::ListSnapshots(a) => calls::list_snapshots(s, a).await,
        Call::Capacity(a) => calls::capacity(s, a).await,
        Call::NodeStage(a) => calls::node_stage(s, a).await,
        Call::NodePublish(a) => calls::node_publish(s, a).await,
        Call::NodeUnpublish(a) => calls::node_unpublish(s, a).await,
        Call::NodeUnstage(a) => calls::node_unstage(s, a).await,
        Call::Stats(a) => calls::stats(s, a).await,
        Call::VolumeHealth(a) => calls::health(s, a).await,
        Call::StorageHealth => calls::storage_health(s).await,
        Call::Transfers(a) => calls::transfers(s, a).await,
    }
}

async fn capabilities(s: &mut Services) -> Result<Value, Failure> {
    let plugin = plugin_capabilities(&mut s.id).await?;
    let controller = controller_rpcs(&mut s.ctl).await;
    let node_caps = node_rpcs(&mut s.node).await;
    let group_caps = group_controller_rpcs(s.channel.clone()).await;
    Ok(json!({
        "plugin": plugin,
        "controller": controller,
        "node": node_caps,
        "group_controller": group_caps,
    }))
}

async fn plugin_capabilities(id: &mut IdentityClient<Channel>) -> Result<Vec<Value>, Failure> {
    use csi::plugin_capability;
    Ok(id
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| c.r#type)
        .map(|t| match t {
            plugin_capability::Type::Service(s) => json!(format!(
                "service: {}",
                plugin_capability::service::Type::try_from(s.r#type)
                    .map(|x| x.as_str_name())
                    .unwrap_or("UNKNOWN")
            )),
            plugin_capability::Type::VolumeExpansion(v) => json!(format!(
                "volume_expansion: {}",
                plugin_capability::volume_expansion::Type::try_from(v.r#type)
                    .map(|x| x.as_str_name())
                    .unwrap_or("UNKNOWN")
            )),
        })
        .collect())
}

async fn controller_rpcs(ctl: &mut ControllerClient<Channel>) -> Value {
    use csi::controller_service_capability;
    rpc_names(
        ctl.controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
            .await,
        |r| {
            r.capabilities
                .into_iter()
                .filter_map(|c| match c.r#type? {
                    controller_service_capability::Type::Rpc(r) => Some(r.r#type),
                })
                .collect()
        },
        |n| {
            controller_service_capability::rpc::Type::try_from(n)
                .ok()
                .map(|t| t.as_str_name())
        },
    )
}

async fn node_rpcs(node: &mut NodeClient<Channel>) -> Value {
    use csi::node_service_capability;
    rpc_names(
        node.node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
            .await,
        |r| {
            r.capabilities
                .into_iter()
                .filter_map(|c| match c.r#type? {
                    node_service_capability::Type::Rpc(r) => Some(r.r#type),
                })
                .collect()
        },
        |n| {
            node_service_capability::rpc::Type::try_from(n)
                .ok()
                .map(|t| t.as_str_name())
        },
    )
}

async fn group_controller_rpcs(channel: Channel) -> Value {
    use csi::group_controller_service_capability;
    let mut group = csi::group_controller_client::GroupControllerClient::new(channel);
    rpc_names(
        group
            .group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {})
            .await,
        |r| {
            r.capabilities
                .into_iter()
                .filter_map(|c| match c.r#type? {
                    group_controller_service_capability::Type::Rpc(r) => Some(r.r#type),
                })
                .collect()
        },
        |n| {
            group_controller_service_capability::rpc::Type::try_from(n)
                .ok()
                .map(|t| t.as_str_name())
        },
    )
}

/// The names of the RPC capabilities a GetCapabilities call answered; a service
/// the driver does not serve is reported, not fatal.
fn rpc_names<R>(
    answer: Result<tonic::Response<R>, tonic::Status>,
    rpcs: impl FnOnce(R) -> Vec<i32>,
    name: impl Fn(i32) -> Option<&'static str>,
) -> Value {
    match answer {
        Ok(r) => json!(rpcs(r.into_inner())
            .into_iter()
            .filter_map(name)
            .collect::<Vec<_>>()),
        Err(s) => json!(format!("{:?}: {}", s.code(), s.message())),
    }
}

fn volume(v: &csi::Volume) -> Value {
    use csi::volume_content_source::Type;
    let source = v
        .content_source
        .as_ref()
        .and_then(|s| s.r#type.as_ref())
        .map(|t| match t {
            Type::Snapshot(s) => json!({"snapshot_id": s.snapshot_id}),
            Type::Volume(s) => json!({"volume_id": s.volume_id}),
        });
    let mut out = json!({
        "volume_id": v.volume_id,
        "capacity_bytes": v.capacity_bytes,
        "volume_context": v.volume_context,
        "accessible_topology": v.accessible_topology.iter().map(|t| json!(t.segments)).collect::<Vec<_>>(),
    });
    if let Some(s) = source {
        out["content_source"] = s;
    }
    out
}

fn snapshot(s: &csi::Snapshot) -> Value {
    json!({
        "snapshot_id": s.snapshot_id,
        "source_volume_id": s.source_volume_id,
        "size_bytes": s.size_bytes,
        "ready_to_use": s.ready_to_use,
        "creation_time": s.creation_time.as_ref().map(|t| t.seconds),
        "group_snapshot_id": s.group_snapshot_id,
        "accessible_topology": s.accessible_topology.iter().map(|t| json!(t.segments)).collect::<Vec<_>>(),
    })
}

fn volume_health(h: &csi::VolumeHealth) -> Value {
    let statuses: Vec<Value> = h
        .health_statuses
        .iter()
        .map(|e| {
            let status = csi::VolumeHealthErrorType::try_from(e.status)
                .map(|x| x.as_str_name())
                .map_err(|_| e.status);
            finding(status, &e.reason, &e.message)
        })
        .collect();
    json!({ "volume_id": h.volume_id, "health_statuses": statuses })
}

/// One health finding: its status by name (by number when this client does not
/// know it), its reason and its message.
fn finding(status: Result<&'static str, i32>, reason: &str, message: &str) -> Value {
    let status = status.map_or_else(|n| json!(n.to_string()), |s| json!(s));
    json!({ "status": status, "reason": reason, "message": message })
}

/// The answer as YAML. Strings a YAML reader would take for something else
/// (`"true"`, `"123"`, `"yes"`, `"x: y"`) are quoted; every value stays on one
/// line, so a long message can still be found with grep.
pub fn yaml(v: &Value) -> Result<String, String> {
    let mut options = serde_saphyr::SerializerOptions::default();
    options.prefer_block_scalars = false;
    serde_saphyr::to_string_with_options(v, options).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_reads_back_as_the_same_answer() {
        let message = format!("failed: {}", "a long cause ".repeat(20));
        let v = json!({
            "a": "plain-id_1", "b": "true", "c": "123", "d": "x: y", "e": [],
            "f": [{"k": 1, "l": "m"}], "g": {"h": null}, "i": "yes", "j": "",
            "k": "two\nlines", "l": message, "m": {}, "n": u64::MAX, "o": "~",
        });
        let text = yaml(&v).unwrap();
        let back: Value = serde_saphyr::from_str(&text).unwrap();
        assert_eq!(back, v, "{text}");
        // Quoted where a YAML reader would see a boolean, a number or a map;
        // bare where it reads the same.
        for line in [
            "a: plain-id_1",
            "b: \"true\"",
            "c: \"123\"",
            "d: \"x: y\"",
            "e: []",
            "i: \"yes\"",
            "k: \"two\\nlines\"",
            "m: {}",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} in:\n{text}");
        }
        // A long message stays on one line, for grep.
        assert!(
            text.lines()
                .any(|l| l.starts_with("l: ") && l.contains(message.trim())),
            "{text}"
        );
    }
}
