//! `csi-driver client`: calls CSI RPCs on any socket (this driver's or another's)
//! and prints the answer as YAML or JSON. Only argument parsing, request building
//! and printing live here: every decision is the driver's.

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;

use clap::{Args, Subcommand, ValueEnum};
use csi_proto::csi::{
    self, controller_client::ControllerClient, identity_client::IdentityClient,
    node_client::NodeClient, volume_capability,
};
use csi_storage::size::parse_size;
use serde_json::{json, Map, Value};
use tonic::transport::Channel;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
}

#[derive(Debug, Subcommand)]
pub enum Call {
    /// GetPluginInfo, Probe and NodeGetInfo.
    Info,
    /// Plugin, controller, node and group controller capabilities.
    Capabilities,
    /// CreateVolume.
    CreateVolume {
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
    },
    /// DeleteVolume.
    DeleteVolume { volume_id: String },
    /// ControllerGetVolume.
    GetVolume { volume_id: String },
    /// ListVolumes (one page with --max, all pages without).
    ListVolumes {
        #[arg(long, default_value_t = 0)]
        max: i32,
        #[arg(long, default_value = "")]
        token: String,
    },
    /// ControllerExpandVolume.
    ExpandVolume {
        volume_id: String,
        #[arg(long, value_parser = parse_size)]
        size: i64,
        #[command(flatten)]
        access: Access,
    },
    /// NodeExpandVolume.
    NodeExpand {
        volume_id: String,
        #[arg(long, value_parser = parse_size)]
        size: i64,
        /// The published (or staged) path.
        #[arg(long)]
        path: String,
        #[arg(long, default_value = "")]
        staging: String,
    },
    /// CreateSnapshot.
    CreateSnapshot {
        name: String,
        #[arg(long)]
        volume: String,
        #[arg(long = "param", value_parser = parse_pair)]
        params: Vec<(String, String)>,
    },
    /// DeleteSnapshot.
    DeleteSnapshot { snapshot_id: String },
    /// ListSnapshots (all pages).
    ListSnapshots {
        #[arg(long, default_value = "")]
        volume: String,
        #[arg(long, default_value = "")]
        snapshot: String,
    },
    /// GetCapacity.
    Capacity {
        #[arg(long = "param", value_parser = parse_pair)]
        params: Vec<(String, String)>,
    },
    /// NodeStageVolume.
    NodeStage {
        volume_id: String,
        #[arg(long)]
        staging: String,
        #[command(flatten)]
        access: Access,
        /// volume_context KEY=VALUE, as CreateVolume returned it (repeatable).
        #[arg(long = "context", value_parser = parse_pair)]
        context: Vec<(String, String)>,
    },
    /// NodePublishVolume.
    NodePublish {
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
    },
    /// NodeUnpublishVolume.
    NodeUnpublish {
        volume_id: String,
        #[arg(long)]
        target: String,
    },
    /// NodeUnstageVolume.
    NodeUnstage {
        volume_id: String,
        #[arg(long)]
        staging: String,
    },
    /// NodeGetVolumeStats.
    Stats {
        volume_id: String,
        /// The published (or staged) path.
        #[arg(long)]
        path: String,
        #[arg(long, default_value = "")]
        staging: String,
    },
    /// Volume health: ControllerGetVolumeHealth of one volume, NodeGetVolumeHealth
    /// with --node, or without an id ControllerListVolumeHealth (the volumes with
    /// a problem; one page with --max, all pages without).
    VolumeHealth {
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
    },
    /// NodeGetStorageHealth: the problems of this node's pools.
    StorageHealth,
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

fn to_map(pairs: &[(String, String)]) -> HashMap<String, String> {
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

async fn run(endpoint: &str, call: &Call) -> Result<Value, Failure> {
    let channel = csi_glue::connect(endpoint)
        .await
        .map_err(|e| Failure::Connect(root_cause(&e)))?;
    let mut id = IdentityClient::new(channel.clone());
    let mut ctl = ControllerClient::new(channel.clone());
    let mut node = NodeClient::new(channel.clone());
    Ok(match call {
        Call::Info => {
            let info = id
                .get_plugin_info(csi::GetPluginInfoRequest {})
                .await?
                .into_inner();
            let probe = id.probe(csi::ProbeRequest {}).await?.into_inner();
            let mut out = json!({
                "name": info.name,
                "vendor_version": info.vendor_version,
                "manifest": info.manifest,
                "ready": probe.ready,
            });
            // A controller-only driver has no Node service: say so rather than fail.
            match node.node_get_info(csi::NodeGetInfoRequest {}).await {
                Ok(n) => {
                    let n = n.into_inner();
                    out["node"] = json!({
                        "node_id": n.node_id,
                        "max_volumes_per_node": n.max_volumes_per_node,
                        "accessible_topology": n.accessible_topology.map(|t| t.segments),
                    });
                }
                Err(s) => out["node"] = json!(format!("{:?}: {}", s.code(), s.message())),
            }
            out
        }
        Call::Capabilities => capabilities(&mut id, &mut ctl, &mut node, channel).await?,
        Call::CreateVolume {
            name,
            size,
            limit,
            access,
            params,
            source_snapshot,
            source_volume,
        } => {
            use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
            let source = match (source_snapshot, source_volume) {
                (Some(s), _) => Some(Type::Snapshot(SnapshotSource {
                    snapshot_id: s.clone(),
                })),
                (_, Some(v)) => Some(Type::Volume(VolumeSource {
                    volume_id: v.clone(),
                })),
                _ => None,
            };
            let r = ctl
                .create_volume(csi::CreateVolumeRequest {
                    name: name.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: *size,
                        limit_bytes: *limit,
                    }),
                    volume_capabilities: vec![access.capability()],
                    parameters: to_map(params),
                    volume_content_source: source
                        .map(|t| csi::VolumeContentSource { r#type: Some(t) }),
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({ "volume": r.volume.as_ref().map(volume) })
        }
        Call::DeleteVolume { volume_id } => {
            ctl.delete_volume(csi::DeleteVolumeRequest {
                volume_id: volume_id.clone(),
                ..Default::default()
            })
            .await?;
            json!({ "deleted": volume_id })
        }
        Call::GetVolume { volume_id } => {
            let r = ctl
                .controller_get_volume(csi::ControllerGetVolumeRequest {
                    volume_id: volume_id.clone(),
                })
                .await?
                .into_inner();
            json!({
                "volume": r.volume.as_ref().map(volume),
                "status": r.status.map(|s| json!({
                    "published_node_ids": s.published_node_ids,
                })),
            })
        }
        Call::ListVolumes { max, token } => {
            let mut entries = Vec::new();
            let mut token = token.clone();
            loop {
                let r = ctl
                    .list_volumes(csi::ListVolumesRequest {
                        max_entries: *max,
                        starting_token: token.clone(),
                    })
                    .await?
                    .into_inner();
                for e in r.entries {
                    let mut v = e.volume.as_ref().map(volume).unwrap_or(Value::Null);
                    if let Some(s) = e.status {
                        v["published_node_ids"] = json!(s.published_node_ids);
                    }
                    entries.push(v);
                }
                token = r.next_token;
                if token.is_empty() || *max > 0 {
                    break;
                }
            }
            let mut out = json!({ "volumes": entries });
            if !token.is_empty() {
                out["next_token"] = json!(token);
            }
            out
        }
        Call::ExpandVolume {
            volume_id,
            size,
            access,
        } => {
            let r = ctl
                .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: volume_id.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: *size,
                        limit_bytes: 0,
                    }),
                    volume_capability: Some(access.capability()),
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({"capacity_bytes": r.capacity_bytes, "node_expansion_required": r.node_expansion_required})
        }
        Call::NodeExpand {
            volume_id,
            size,
            path,
            staging,
        } => {
            let r = node
                .node_expand_volume(csi::NodeExpandVolumeRequest {
                    volume_id: volume_id.clone(),
                    volume_path: path.clone(),
                    staging_target_path: staging.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: *size,
                        limit_bytes: 0,
                    }),
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({"capacity_bytes": r.capacity_bytes})
        }
        Call::CreateSnapshot {
            name,
            volume,
            params,
        } => {
            let r = ctl
                .create_snapshot(csi::CreateSnapshotRequest {
                    source_volume_id: volume.clone(),
                    name: name.clone(),
                    parameters: to_map(params),
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({ "snapshot": r.snapshot.as_ref().map(snapshot) })
        }
        Call::DeleteSnapshot { snapshot_id } => {
            ctl.delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: snapshot_id.clone(),
                ..Default::default()
            })
            .await?;
            json!({ "deleted": snapshot_id })
        }
        Call::ListSnapshots {
            volume,
            snapshot: snap,
        } => {
            let mut entries = Vec::new();
            let mut token = String::new();
            loop {
                let r = ctl
                    .list_snapshots(csi::ListSnapshotsRequest {
                        source_volume_id: volume.clone(),
                        snapshot_id: snap.clone(),
                        starting_token: token.clone(),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                entries.extend(
                    r.entries
                        .iter()
                        .filter_map(|e| e.snapshot.as_ref().map(snapshot)),
                );
                token = r.next_token;
                if token.is_empty() {
                    break;
                }
            }
            json!({ "snapshots": entries })
        }
        Call::Capacity { params } => {
            let r = ctl
                .get_capacity(csi::GetCapacityRequest {
                    parameters: to_map(params),
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({
                "available_capacity": r.available_capacity,
                "maximum_volume_size": r.maximum_volume_size,
                "minimum_volume_size": r.minimum_volume_size,
            })
        }
        Call::NodeStage {
            volume_id,
            staging,
            access,
            context,
        } => {
            node.node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: volume_id.clone(),
                staging_target_path: staging.clone(),
                volume_capability: Some(access.capability()),
                volume_context: to_map(context),
                ..Default::default()
            })
            .await?;
            json!({ "staged": volume_id, "staging_target_path": staging })
        }
        Call::NodePublish {
            volume_id,
            staging,
            target,
            readonly,
            access,
            context,
        } => {
            node.node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: volume_id.clone(),
                staging_target_path: staging.clone(),
                target_path: target.clone(),
                volume_capability: Some(access.capability()),
                readonly: *readonly,
                volume_context: to_map(context),
                ..Default::default()
            })
            .await?;
            json!({ "published": volume_id, "target_path": target })
        }
        Call::NodeUnpublish { volume_id, target } => {
            node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: volume_id.clone(),
                target_path: target.clone(),
            })
            .await?;
            json!({ "unpublished": volume_id, "target_path": target })
        }
        Call::NodeUnstage { volume_id, staging } => {
            node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: volume_id.clone(),
                staging_target_path: staging.clone(),
            })
            .await?;
            json!({ "unstaged": volume_id, "staging_target_path": staging })
        }
        Call::Stats {
            volume_id,
            path,
            staging,
        } => {
            let r = node
                .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                    volume_id: volume_id.clone(),
                    volume_path: path.clone(),
                    staging_target_path: staging.clone(),
                })
                .await?
                .into_inner();
            let usage: Vec<Value> = r
                .usage
                .iter()
                .map(|u| {
                    json!({
                        "unit": csi::volume_usage::Unit::try_from(u.unit)
                            .map(|x| x.as_str_name().to_string())
                            .unwrap_or_else(|_| u.unit.to_string()),
                        "total": u.total, "used": u.used, "available": u.available,
                    })
                })
                .collect();
            json!({ "usage": usage })
        }
        Call::VolumeHealth {
            volume_id: Some(volume_id),
            node: true,
            path,
            staging,
            ..
        } => {
            let r = node
                .node_get_volume_health(csi::NodeGetVolumeHealthRequest {
                    volume_id: volume_id.clone(),
                    volume_publish_path: path.clone(),
                    staging_target_path: staging.clone(),
                })
                .await?
                .into_inner();
            json!({ "volume_health": r.volume_health.as_ref().map(volume_health) })
        }
        Call::VolumeHealth {
            volume_id: Some(volume_id),
            ..
        } => {
            let r = ctl
                .controller_get_volume_health(csi::ControllerGetVolumeHealthRequest {
                    volume_id: volume_id.clone(),
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({ "volume_health": r.volume_health.as_ref().map(volume_health) })
        }
        Call::VolumeHealth {
            volume_id: None,
            max,
            token,
            ..
        } => {
            let mut entries = Vec::new();
            let mut token = token.clone();
            loop {
                let r = ctl
                    .controller_list_volume_health(csi::ControllerListVolumeHealthRequest {
                        max_entries: *max,
                        starting_token: token.clone(),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                entries.extend(r.entries.iter().map(volume_health));
                token = r.next_token;
                if token.is_empty() || *max > 0 {
                    break;
                }
            }
            let mut out = json!({ "unhealthy_volumes": entries });
            if !token.is_empty() {
                out["next_token"] = json!(token);
            }
            out
        }
        Call::StorageHealth => {
            let r = node
                .node_get_storage_health(csi::NodeGetStorageHealthRequest::default())
                .await?
                .into_inner();
            let problems: Vec<Value> = r
                .backend_health
                .iter()
                .map(|b| {
                    let status = csi::StorageHealthErrorType::try_from(b.status)
                        .map(|x| x.as_str_name())
                        .map_err(|_| b.status);
                    finding(status, &b.reason, &b.message)
                })
                .collect();
            json!({ "backend_health": problems })
        }
    })
}

async fn capabilities(
    id: &mut IdentityClient<Channel>,
    ctl: &mut ControllerClient<Channel>,
    node: &mut NodeClient<Channel>,
    channel: Channel,
) -> Result<Value, Failure> {
    use csi::{
        controller_service_capability, group_controller_service_capability,
        node_service_capability, plugin_capability,
    };
    let plugin: Vec<Value> = id
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
        .collect();
    let controller = rpc_names(
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
    );
    let node_caps = rpc_names(
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
    );
    let mut group = csi::group_controller_client::GroupControllerClient::new(channel);
    let group_caps = rpc_names(
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
    );
    Ok(json!({
        "plugin": plugin,
        "controller": controller,
        "node": node_caps,
        "group_controller": group_caps,
    }))
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
        "volume_context": sorted(&v.volume_context),
        "accessible_topology": v.accessible_topology.iter().map(|t| sorted(&t.segments)).collect::<Vec<_>>(),
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
        "accessible_topology": s.accessible_topology.iter().map(|t| sorted(&t.segments)).collect::<Vec<_>>(),
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

fn sorted(m: &HashMap<String, String>) -> Value {
    let mut out = Map::new();
    let mut keys: Vec<_> = m.keys().collect();
    keys.sort();
    for k in keys {
        out.insert(k.clone(), json!(m[k]));
    }
    Value::Object(out)
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
