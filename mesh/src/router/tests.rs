//! The router's decisions, without agents: where a new volume goes, how a list
//! pages across nodes (with a fake in place of the agents' answers), how the
//! agents' failures and the caller's deadline cross the hop.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use csi_proto::csi;
use tonic::Status;

use super::controller::choose_node;
use super::listing::Page;
use super::*;
use crate::agents::{Agents, Source};
use crate::tls::{generate_authority, Authority, Role};

fn topo(node: &str) -> csi::Topology {
    csi::Topology {
        segments: [(csi_glue::TOPOLOGY_KEY.to_string(), node.to_string())]
            .into_iter()
            .collect(),
    }
}

fn req(requisite: &[&str], preferred: &[&str]) -> csi::TopologyRequirement {
    csi::TopologyRequirement {
        requisite: requisite.iter().map(|n| topo(n)).collect(),
        preferred: preferred.iter().map(|n| topo(n)).collect(),
    }
}

#[test]
fn a_new_volume_goes_to_the_first_preferred_node_that_is_allowed() {
    assert_eq!(
        choose_node(Some(&req(&["a", "b"], &["b", "a"])), None),
        Some("b".into())
    );
    assert_eq!(
        choose_node(Some(&req(&["a"], &["b", "a"])), None),
        Some("a".into())
    );
    assert_eq!(choose_node(Some(&req(&["c"], &[])), None), Some("c".into()));
    assert_eq!(choose_node(Some(&req(&[], &["d"])), None), Some("d".into()));
    assert_eq!(choose_node(None, None), None);
    // A segment of another key names no node.
    let other = csi::TopologyRequirement {
        requisite: vec![csi::Topology {
            segments: [("zone".to_string(), "z1".to_string())]
                .into_iter()
                .collect(),
        }],
        preferred: vec![],
    };
    assert_eq!(choose_node(Some(&other), None), None);
}

#[test]
fn a_copy_stays_with_its_source_when_the_requirements_allow_it() {
    // Immediate binding: every node allowed, the source's node wins.
    assert_eq!(
        choose_node(Some(&req(&["a", "b"], &["b"])), Some("a")),
        Some("a".into())
    );
    assert_eq!(choose_node(None, Some("a")), Some("a".into()));
    // The scheduler chose b alone (strict topology): b, wherever the source.
    assert_eq!(
        choose_node(Some(&req(&["b"], &["b"])), Some("a")),
        Some("b".into())
    );
}

#[test]
fn handles_in_answers_name_the_node_and_keep_handles_given() {
    let mut v = csi::Volume {
        volume_id: "v1".into(),
        content_source: Some(csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(
                csi::volume_content_source::SnapshotSource {
                    snapshot_id: "s1".into(),
                },
            )),
        }),
        ..Default::default()
    };
    qualify_volume(&mut v, "n1");
    assert_eq!(v.volume_id, "v1@n1");
    match v.content_source.unwrap().r#type.unwrap() {
        csi::volume_content_source::Type::Snapshot(s) => assert_eq!(s.snapshot_id, "s1@n1"),
        other => panic!("{other:?}"),
    }
    let mut id = "x@other".to_string();
    qualify(&mut id, "n1");
    assert_eq!(id, "x@other", "a handle already naming a node is kept");
    let mut empty = String::new();
    qualify(&mut empty, "n1");
    assert_eq!(empty, "", "no group: no handle");
}

#[test]
fn a_connection_closed_under_a_call_is_a_node_out_of_reach() {
    // tonic's answer when the agent's connection closes mid-call.
    let s = from_node("n7", Status::cancelled("operation was canceled"));
    assert_eq!(s.code(), tonic::Code::Unavailable);
    assert!(
        s.message().contains("node n7 is unreachable"),
        "{}",
        s.message()
    );
    // An agent's own CANCELLED (not the transport's) passes as it is.
    let s = from_node("n7", Status::cancelled("the call was abandoned"));
    assert_eq!(s.code(), tonic::Code::Cancelled);
}

#[test]
fn an_unreachable_agent_is_named_and_its_own_answers_pass_unchanged() {
    let s = from_node(
        "n7",
        Status::unavailable("error trying to connect: refused"),
    );
    assert_eq!(s.code(), tonic::Code::Unavailable);
    assert!(
        s.message().contains("node n7 is unreachable"),
        "{}",
        s.message()
    );
    let s = from_node("n7", Status::not_found("volume x does not exist"));
    assert_eq!(s.code(), tonic::Code::NotFound);
    assert_eq!(s.message(), "volume x does not exist");
    let s = from_node("n7", Status::aborted("in progress"));
    assert_eq!(s.code(), tonic::Code::Aborted);
}

#[test]
fn the_callers_deadline_goes_along() {
    let mut r = tonic::Request::new(());
    assert_eq!(deadline(&r), None);
    for (v, d) in [
        ("1500m", Duration::from_millis(1500)),
        ("2S", Duration::from_secs(2)),
        ("3M", Duration::from_secs(180)),
        ("250000u", Duration::from_millis(250)),
    ] {
        r.metadata_mut().insert("grpc-timeout", v.parse().unwrap());
        assert_eq!(deadline(&r), Some(d), "{v}");
    }
    r.metadata_mut()
        .insert("grpc-timeout", "12x".parse().unwrap());
    assert_eq!(deadline(&r), None);
    // What goes on is read back as the same deadline.
    let mut out = onward(Some(Duration::from_secs(2)), ());
    let header = out.metadata().get("grpc-timeout").cloned().unwrap();
    out.metadata_mut().insert("grpc-timeout", header);
    assert_eq!(deadline(&out), Some(Duration::from_secs(2)));
}

/// A router whose agents are the nodes named, never reached: the paging is
/// fed by a fake.
async fn router_of(nodes: &[&str]) -> Arc<Router> {
    router_with(nodes, false).await
}

async fn router_with(nodes: &[&str], enable_attach: bool) -> Arc<Router> {
    let (cert, key) = generate_authority().unwrap();
    let creds = Arc::new(
        Authority::from_pem(&cert, &key)
            .unwrap()
            .mint(&Role::Controller)
            .unwrap(),
    );
    let fixed: BTreeMap<String, String> = nodes
        .iter()
        .map(|n| (n.to_string(), "127.0.0.1:9".to_string()))
        .collect();
    let agents = Arc::new(Agents::new(creds, Source::Fixed(fixed)));
    agents.refresh().await.unwrap();
    Router::new(
        agents,
        Config {
            driver_name: "example.csi.k8s.io".into(),
            enable_attach,
            controller_expansion: true,
            modify_volume: false,
        },
    )
}

/// Each node's entries (named NODE-i), paged by index as an agent pages.
fn fake_pages(
    counts: &[(&str, usize)],
    asked: Arc<Mutex<Vec<(String, i32, String)>>>,
) -> impl FnMut(String, i32, String) -> Page<String> {
    let counts: BTreeMap<String, usize> = counts.iter().map(|(n, c)| (n.to_string(), *c)).collect();
    move |node, max, token| {
        asked
            .lock()
            .unwrap()
            .push((node.clone(), max, token.clone()));
        let total = counts[&node];
        let start: usize = token.parse().unwrap_or(0);
        let end = match max {
            0 => total,
            m => (start + m as usize).min(total),
        };
        let entries = (start..end).map(|i| format!("{node}-{i}")).collect();
        let next = if end < total {
            end.to_string()
        } else {
            String::new()
        };
        Box::pin(async move { Ok((entries, next)) })
    }
}

#[tokio::test]
async fn lists_page_across_the_nodes_in_order_and_resume_where_they_stopped() {
    let r = router_of(&["a", "b", "c"]).await;
    let counts = [("a", 3), ("b", 0), ("c", 2)];
    let all: Vec<String> = ["a-0", "a-1", "a-2", "c-0", "c-1"]
        .map(String::from)
        .to_vec();
    for max in [0, 1, 2, 3, 4, 5, 7] {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let mut got = Vec::new();
        let mut token = String::new();
        let mut pages = 0;
        loop {
            let (entries, next) = r
                .across(max, &token, fake_pages(&counts, asked.clone()))
                .await
                .unwrap();
            if max > 0 {
                assert!(entries.len() <= max as usize, "max {max}: {entries:?}");
            }
            got.extend(entries);
            pages += 1;
            if next.is_empty() {
                break;
            }
            token = next;
            assert!(pages < 20, "max {max}: no end");
        }
        assert_eq!(got, all, "max_entries {max}");
    }
    let e = r
        .across(
            -1,
            "",
            fake_pages(&counts, Arc::new(Mutex::new(Vec::new()))),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn a_node_that_fails_fails_the_list_naming_it() {
    let r = router_of(&["a", "b"]).await;
    let e = r
        .across(0, "", |node: String, _, _| -> Page<String> {
            Box::pin(async move {
                match node.as_str() {
                    "b" => Err(from_node("b", Status::unavailable("transport error"))),
                    _ => Ok((vec!["a-0".to_string()], String::new())),
                }
            })
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(e.message().contains("node b"), "{}", e.message());
}

#[tokio::test]
async fn a_handle_naming_no_known_node_is_unavailable_and_names_it() {
    let r = router_of(&["a"]).await;
    let e = r.place(Kind::Volume, "vol-1@gone").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(e.message().contains("gone"), "{}", e.message());
    let e = r.place(Kind::Volume, "").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let at = r.place(Kind::Volume, "vol-1@a").await.unwrap();
    assert_eq!(
        at,
        Placed {
            node: "a".into(),
            id: "vol-1".into()
        }
    );
    // A long node name travels as its digest, and finds its node.
    let long = "n".repeat(120);
    let r = router_of(&[&long]).await;
    let h = csi_glue::handle::qualify("vol-2", &long);
    assert!(h.len() <= csi_glue::handle::MAX_HANDLE_BYTES);
    assert_eq!(r.place(Kind::Volume, &h).await.unwrap().node, long);
}

/// ControllerGetNodeInfo goes to the node the request names: without
/// --enable-attach (no GET_NODE_INFO) it is not served, a request naming no
/// node is refused, and a node the router cannot reach is named.
#[tokio::test]
async fn node_info_is_asked_of_the_node_named_and_refused_before_any_hop() {
    use csi_proto::csi::controller_server::Controller;
    let ask = |node: &str| {
        tonic::Request::new(csi::ControllerGetNodeInfoRequest {
            node_id: node.to_string(),
        })
    };
    let plain = super::controller::RouterController::new(router_of(&["a"]).await);
    let e = plain.controller_get_node_info(ask("a")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented);

    let attach = super::controller::RouterController::new(router_with(&["a"], true).await);
    let e = attach.controller_get_node_info(ask("")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let e = attach
        .controller_get_node_info(ask("gone"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("gone"), "{}", e.message());
}

/// The parts of a group across nodes as one group: members qualified with
/// their nodes and naming the group's bare id, the latest part's time, and
/// ready only when every part is; parts of different ids are refused.
#[test]
fn the_parts_of_a_group_across_nodes_make_one_group() {
    let part = |id: &str, member: &str, volume: &str, seconds: i64, ready: bool| {
        csi::VolumeGroupSnapshot {
            group_snapshot_id: id.into(),
            snapshots: vec![csi::Snapshot {
                snapshot_id: member.into(),
                source_volume_id: volume.into(),
                group_snapshot_id: id.into(),
                ready_to_use: ready,
                ..Default::default()
            }],
            creation_time: Some(csi_glue::timestamp(csi_storage::model::Timestamp {
                seconds,
                nanos: 0,
            })),
            ready_to_use: ready,
        }
    };
    let g = super::across::combine(vec![
        ("a".into(), part("g1", "s1", "v1", 20, true)),
        ("b".into(), part("g1", "s2", "v2", 10, true)),
    ])
    .unwrap();
    assert_eq!(g.group_snapshot_id, "g1");
    let members: Vec<(&str, &str, &str)> = g
        .snapshots
        .iter()
        .map(|s| {
            (
                s.snapshot_id.as_str(),
                s.source_volume_id.as_str(),
                s.group_snapshot_id.as_str(),
            )
        })
        .collect();
    assert_eq!(
        members,
        vec![("s1@a", "v1@a", "g1"), ("s2@b", "v2@b", "g1")]
    );
    assert_eq!(g.creation_time.unwrap().seconds, 20);
    assert!(g.ready_to_use);

    let not_yet = super::across::combine(vec![
        ("a".into(), part("g1", "s1", "v1", 20, true)),
        ("b".into(), part("g1", "s2", "v2", 30, false)),
    ])
    .unwrap();
    assert!(!not_yet.ready_to_use);
    assert_eq!(not_yet.creation_time.unwrap().seconds, 30);

    let e = super::across::combine(vec![
        ("a".into(), part("g1", "s1", "v1", 20, true)),
        ("b".into(), part("g2", "s2", "v2", 20, true)),
    ])
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Internal);
    assert!(e.message().contains("node b"), "{}", e.message());
    let e = super::across::combine(vec![]).unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
}

#[test]
fn an_arrival_done_before_the_router_started_is_told_again_only_if_it_may_have_been_missed() {
    let a = moves::Announcer::starting_at(1_000);
    let done = |ended| csi_proto::mesh::TransferStatus {
        state: "done".into(),
        ended_seconds: ended,
        ..Default::default()
    };
    // Long before this process: the one before told it.
    assert!(a.told_before(&done(900), false));
    // Just before: the process before may have died before its next look.
    assert!(!a.told_before(&done(995), false));
    assert!(!a.told_before(&done(1_005), true));
    // A node that does not say when: done at the first look means before.
    assert!(a.told_before(&done(0), false));
    assert!(!a.told_before(&done(0), true));
}
