//! One function per call of `csi-driver client`: the request it sends and the
//! answer it prints.

use csi_proto::csi;
use csi_proto::csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
use serde_json::{json, Value};

use super::{finding, snapshot, to_map, volume, volume_health, Failure, Services};
use super::{
    Capacity, CreateSnapshot, CreateVolume, DeleteSnapshot, DeleteVolume, ExpandVolume, GetVolume,
    ListSnapshots, ListVolumes, NodeExpand, NodePublish, NodeStage, NodeUnpublish, NodeUnstage,
    Stats, Transfers, VolumeHealth,
};

/// GetPluginInfo, Probe and NodeGetInfo.
pub(super) async fn info(s: &mut Services) -> Result<Value, Failure> {
    let Services { id, node, .. } = s;
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
    match node.node_get_info(csi::NodeGetInfoRequest::default()).await {
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
    Ok(out)
}

/// CreateVolume.
pub(super) async fn create_volume(s: &mut Services, a: &CreateVolume) -> Result<Value, Failure> {
    let CreateVolume {
        name,
        size,
        limit,
        access,
        params,
        source_snapshot,
        source_volume,
        node,
    } = a;
    let ctl = &mut s.ctl;
    // The node the volume must be on: what a CO asks after scheduling.
    let on_node = node.as_ref().map(|n| {
        let at = csi::Topology {
            segments: [(csi_glue::TOPOLOGY_KEY.to_string(), n.clone())]
                .into_iter()
                .collect(),
        };
        csi::TopologyRequirement {
            requisite: vec![at.clone()],
            preferred: vec![at],
        }
    });
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
            volume_content_source: source.map(|t| csi::VolumeContentSource { r#type: Some(t) }),
            accessibility_requirements: on_node,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(json!({ "volume": r.volume.as_ref().map(volume) }))
}

/// DeleteVolume.
pub(super) async fn delete_volume(s: &mut Services, a: &DeleteVolume) -> Result<Value, Failure> {
    let DeleteVolume { volume_id } = a;
    let ctl = &mut s.ctl;
    ctl.delete_volume(csi::DeleteVolumeRequest {
        volume_id: volume_id.clone(),
        ..Default::default()
    })
    .await?;
    Ok(json!({ "deleted": volume_id }))
}

/// ControllerGetVolume.
pub(super) async fn get_volume(s: &mut Services, a: &GetVolume) -> Result<Value, Failure> {
    let GetVolume { volume_id } = a;
    let ctl = &mut s.ctl;
    let r = ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: volume_id.clone(),
        })
        .await?
        .into_inner();
    Ok(json!({
        "volume": r.volume.as_ref().map(volume),
        "status": r.status.map(|s| json!({
            "published_node_ids": s.published_node_ids,
        })),
    }))
}

/// ListVolumes (one page with --max, all pages without).
pub(super) async fn list_volumes(s: &mut Services, a: &ListVolumes) -> Result<Value, Failure> {
    let ListVolumes { max, token } = a;
    let ctl = &mut s.ctl;
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
    Ok(out)
}

/// ControllerExpandVolume.
pub(super) async fn expand_volume(s: &mut Services, a: &ExpandVolume) -> Result<Value, Failure> {
    let ExpandVolume {
        volume_id,
        size,
        access,
    } = a;
    let ctl = &mut s.ctl;
    let r = ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: volume_id.clone(),
            capacity_range: csi_glue::capacity_at_least(*size),
            volume_capability: Some(access.capability()),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(
        json!({"capacity_bytes": r.capacity_bytes, "node_expansion_required": r.node_expansion_required}),
    )
}

/// NodeExpandVolume.
pub(super) async fn node_expand(s: &mut Services, a: &NodeExpand) -> Result<Value, Failure> {
    let NodeExpand {
        volume_id,
        size,
        path,
        staging,
    } = a;
    let node = &mut s.node;
    let r = node
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: volume_id.clone(),
            volume_path: path.clone(),
            staging_target_path: staging.clone(),
            capacity_range: csi_glue::capacity_at_least(*size),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(json!({"capacity_bytes": r.capacity_bytes}))
}

/// CreateSnapshot.
pub(super) async fn create_snapshot(
    s: &mut Services,
    a: &CreateSnapshot,
) -> Result<Value, Failure> {
    let CreateSnapshot {
        name,
        volume,
        params,
    } = a;
    let ctl = &mut s.ctl;
    let r = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: volume.clone(),
            name: name.clone(),
            parameters: to_map(params),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(json!({ "snapshot": r.snapshot.as_ref().map(snapshot) }))
}

/// DeleteSnapshot.
pub(super) async fn delete_snapshot(
    s: &mut Services,
    a: &DeleteSnapshot,
) -> Result<Value, Failure> {
    let DeleteSnapshot { snapshot_id } = a;
    let ctl = &mut s.ctl;
    ctl.delete_snapshot(csi::DeleteSnapshotRequest {
        snapshot_id: snapshot_id.clone(),
        ..Default::default()
    })
    .await?;
    Ok(json!({ "deleted": snapshot_id }))
}

/// ListSnapshots (all pages).
pub(super) async fn list_snapshots(s: &mut Services, a: &ListSnapshots) -> Result<Value, Failure> {
    let ListSnapshots {
        volume,
        snapshot: snap,
    } = a;
    let ctl = &mut s.ctl;
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
    Ok(json!({ "snapshots": entries }))
}

/// GetCapacity.
pub(super) async fn capacity(s: &mut Services, a: &Capacity) -> Result<Value, Failure> {
    let Capacity { params } = a;
    let ctl = &mut s.ctl;
    let r = ctl
        .get_capacity(csi::GetCapacityRequest {
            parameters: to_map(params),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(json!({
        "available_capacity": r.available_capacity,
        "maximum_volume_size": r.maximum_volume_size,
        "minimum_volume_size": r.minimum_volume_size,
    }))
}

/// NodeStageVolume.
pub(super) async fn node_stage(s: &mut Services, a: &NodeStage) -> Result<Value, Failure> {
    let NodeStage {
        volume_id,
        staging,
        access,
        context,
    } = a;
    let node = &mut s.node;
    node.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: volume_id.clone(),
        staging_target_path: staging.clone(),
        volume_capability: Some(access.capability()),
        volume_context: to_map(context),
        ..Default::default()
    })
    .await?;
    Ok(json!({ "staged": volume_id, "staging_target_path": staging }))
}

/// NodePublishVolume.
pub(super) async fn node_publish(s: &mut Services, a: &NodePublish) -> Result<Value, Failure> {
    let NodePublish {
        volume_id,
        staging,
        target,
        readonly,
        access,
        context,
    } = a;
    let node = &mut s.node;
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
    Ok(json!({ "published": volume_id, "target_path": target }))
}

/// NodeUnpublishVolume.
pub(super) async fn node_unpublish(s: &mut Services, a: &NodeUnpublish) -> Result<Value, Failure> {
    let NodeUnpublish { volume_id, target } = a;
    let node = &mut s.node;
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: volume_id.clone(),
        target_path: target.clone(),
    })
    .await?;
    Ok(json!({ "unpublished": volume_id, "target_path": target }))
}

/// NodeUnstageVolume.
pub(super) async fn node_unstage(s: &mut Services, a: &NodeUnstage) -> Result<Value, Failure> {
    let NodeUnstage { volume_id, staging } = a;
    let node = &mut s.node;
    node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: volume_id.clone(),
        staging_target_path: staging.clone(),
    })
    .await?;
    Ok(json!({ "unstaged": volume_id, "staging_target_path": staging }))
}

/// NodeGetVolumeStats.
pub(super) async fn stats(s: &mut Services, a: &Stats) -> Result<Value, Failure> {
    let Stats {
        volume_id,
        path,
        staging,
    } = a;
    let node = &mut s.node;
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
    Ok(json!({ "usage": usage }))
}

/// NodeGetStorageHealth: the problems of this node's pools.
pub(super) async fn storage_health(s: &mut Services) -> Result<Value, Failure> {
    let node = &mut s.node;
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
    Ok(json!({ "backend_health": problems }))
}

/// ControllerGetVolumeHealth, NodeGetVolumeHealth with --node, or without an id
/// ControllerListVolumeHealth.
pub(super) async fn health(s: &mut Services, a: &VolumeHealth) -> Result<Value, Failure> {
    let Services { ctl, node, .. } = s;
    Ok(match a {
        VolumeHealth {
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
        VolumeHealth {
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
        VolumeHealth {
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
    })
}

/// ListTransfers of the mesh's Agent service; with --wait, again until that
/// volume's data has arrived.
pub(super) async fn transfers(s: &mut Services, a: &Transfers) -> Result<Value, Failure> {
    use csi_proto::mesh::{agent_client::AgentClient, ListTransfersRequest};
    let mut agent = AgentClient::new(s.channel.clone());
    let Some(volume) = a.wait.as_deref() else {
        let list = agent.list_transfers(ListTransfersRequest {}).await?;
        let rows: Vec<Value> = list
            .into_inner()
            .transfers
            .iter()
            .map(transfer_row)
            .collect();
        return Ok(json!({ "transfers": rows }));
    };
    // A handle of the cluster's controller names its node; a node's own
    // list names the volume alone.
    let local = volume.split('@').next().unwrap_or(volume);
    // A timeout past what the clock can count waits without end.
    let deadline =
        tokio::time::Instant::now().checked_add(std::time::Duration::from_secs(a.timeout));
    // Asked again soon at first, so that a short transfer is seen done when
    // it is, then less and less often, down to once every 20 ms.
    let mut pause = std::time::Duration::from_millis(1);
    loop {
        let list = agent.list_transfers(ListTransfersRequest {}).await?;
        let mine = list
            .into_inner()
            .transfers
            .into_iter()
            .find(|t| t.role == "arriving" && (t.volume_id == volume || t.volume_id == local));
        let Some(t) = mine else {
            return Err(Failure::Rpc(tonic::Status::not_found(format!(
                "no transfer of volume {volume} arrives here"
            ))));
        };
        if t.state == "done" {
            return Ok(transfer_row(&t));
        }
        if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
            return Err(Failure::Rpc(tonic::Status::deadline_exceeded(format!(
                "volume {volume} did not arrive in {} s: {}",
                a.timeout,
                transfer_row(&t)
            ))));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 5 / 4).min(std::time::Duration::from_millis(20));
    }
}

fn transfer_row(t: &csi_proto::mesh::TransferStatus) -> Value {
    let mut row = json!({
        "transfer_id": t.transfer_id,
        "role": t.role,
        "volume_id": t.volume_id,
        "peer_node": t.peer_node,
        "state": t.state,
        "bytes_done": t.bytes_done,
        "bytes_total": t.bytes_total,
        "rate": t.rate,
        "incremental": t.incremental,
        "resumed": t.resumed,
    });
    if !t.message.is_empty() {
        row["message"] = json!(t.message);
    }
    if t.data_bytes > 0 {
        row["data_bytes"] = json!(t.data_bytes);
    }
    if t.ended_seconds > 0 {
        row["ended_seconds"] = json!(t.ended_seconds);
    }
    if !t.claim_name.is_empty() {
        row["claim"] = json!(format!("{}/{}", t.claim_namespace, t.claim_name));
    }
    row
}
