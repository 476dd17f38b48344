#![allow(dead_code)]

//! Two nodes and the cluster's controller, without Kubernetes: two driver
//! processes standing for two nodes (`--mode all --agent-listen`, each with
//! its own pool and state) and the router (`--mode router`) reaching both over
//! mutual TLS, for the tests of the multi-node control plane.

use std::path::{Path, PathBuf};

use crate::common::*;
use csi_proto::csi;

pub const NODE_A: &str = "node-a";
pub const NODE_B: &str = "node-b";

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One node: a pool and its driver, which is also the node's agent.
pub struct Node {
    pub name: &'static str,
    pub port: u16,
    pub driver: Driver,
    pub pool: Pool,
}

pub fn start_node(name: &'static str, mesh: &Path, envs: &[(&str, &str)]) -> Node {
    let pool = Pool::new("xfs");
    let port = free_port();
    let driver = Driver::start_with_env(
        &pool,
        &[
            &format!("--nodeid={name}"),
            &format!("--agent-listen=127.0.0.1:{port}"),
            &format!("--mesh-dir={}", mesh.display()),
            "--mutable-parameters=directIO,readAheadKiB,transferBandwidth",
        ],
        envs,
    );
    Node {
        name,
        port,
        driver,
        pool,
    }
}

/// The router, on its own socket, with a fixed list of agents.
pub fn start_router(dir: &Path, mesh: &Path, nodes: &[&Node]) -> Driver {
    start_router_with(dir, mesh, nodes, &[])
}

/// The router with these arguments beside its own.
pub fn start_router_with(dir: &Path, mesh: &Path, nodes: &[&Node], extra: &[&str]) -> Driver {
    let socket = dir.join("router.sock");
    let mut args = vec![
        format!("--endpoint=unix://{}", socket.display()),
        "--mode=router".to_string(),
        format!("--mesh-dir={}", mesh.display()),
        "--mutable-parameters=directIO,readAheadKiB,transferBandwidth".to_string(),
        "--log-level=debug".to_string(),
    ];
    for n in nodes {
        args.push(format!("--agent={}=127.0.0.1:{}", n.name, n.port));
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    let mut d = Driver {
        child: None,
        socket,
        state: dir.join("no-state"),
        args,
        envs: vec![],
        log: dir.join("router.log"),
    };
    d.spawn();
    d
}

/// A new pair of mesh authorities, as an operator makes it: `controller/` for
/// the router, `node/` for the nodes.
pub fn mesh_authority(dir: &Path) -> PathBuf {
    let mesh = dir.join("mesh");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_csi-driver"))
        .args(["mesh-authority", "--dir", mesh.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    mesh
}

pub struct Cluster {
    pub a: Node,
    pub b: Node,
    pub router: Driver,
    pub mesh: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// The mesh as the router has it: the controller's authority.
    pub fn controller_side(&self) -> csi_mesh::tls::Mesh {
        let side = csi_mesh::tls::Side::Controller;
        csi_mesh::tls::Mesh::load(&self.mesh.join("controller"), side).unwrap()
    }

    /// The mesh as every node has it (root on any node has this much).
    pub fn nodes_side(&self) -> csi_mesh::tls::Mesh {
        let side = csi_mesh::tls::Side::Nodes;
        csi_mesh::tls::Mesh::load(&self.mesh.join("node"), side).unwrap()
    }
}

/// The controller's side of a pair of authorities nobody in the cluster
/// trusts.
pub fn stranger_mesh() -> csi_mesh::tls::Mesh {
    let (controller, _) = csi_mesh::tls::generate_pair().unwrap();
    csi_mesh::tls::Mesh::from_files(&controller, csi_mesh::tls::Side::Controller).unwrap()
}

/// Two nodes, the first with `envs_a` in its environment, and the router.
pub fn cluster(envs_a: &[(&str, &str)]) -> Cluster {
    cluster_with(envs_a, &[])
}

/// Two nodes with these environments, and the router.
pub fn cluster_with(envs_a: &[(&str, &str)], envs_b: &[(&str, &str)]) -> Cluster {
    cluster_of(envs_a, envs_b, &[])
}

/// Two nodes with these environments, and the router with these arguments.
pub fn cluster_of(
    envs_a: &[(&str, &str)],
    envs_b: &[(&str, &str)],
    router_args: &[&str],
) -> Cluster {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let mesh = mesh_authority(dir.path());
    let a = start_node(NODE_A, &mesh.join("node"), envs_a);
    let b = start_node(NODE_B, &mesh.join("node"), envs_b);
    let router = start_router_with(dir.path(), &mesh.join("controller"), &[&a, &b], router_args);
    Cluster {
        a,
        b,
        router,
        mesh,
        dir,
    }
}

pub fn topology(node: &str) -> csi::Topology {
    csi::Topology {
        segments: [(csi_glue::TOPOLOGY_KEY.to_string(), node.to_string())]
            .into_iter()
            .collect(),
    }
}

/// A CreateVolume request for a volume on `node`.
pub fn create_on(name: &str, node: &str) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, 64 * MIB, mount_cap("ext4", writer()), &[]);
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topology(node)],
        preferred: vec![topology(node)],
    });
    r
}

pub fn node_of(handle: &str) -> String {
    match csi_glue::handle::parse(handle).node {
        Some(csi_glue::handle::NodeRef::Name(n)) => n,
        other => panic!("{handle}: {other:?}"),
    }
}

pub fn volume_source(id: &str) -> csi::VolumeContentSource {
    csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: id.to_string(),
            },
        )),
    }
}

pub fn snapshot_source(id: &str) -> csi::VolumeContentSource {
    csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: id.to_string(),
            },
        )),
    }
}

/// The volume images in a pool.
pub fn images_in(pool: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![pool.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() && !name.starts_with('.') {
                stack.push(p);
            } else if name.ends_with(".img") && p.starts_with(pool.join("volumes")) {
                n += 1;
            }
        }
    }
    n
}

/// A TLS channel to node A's agent at `port`, with a certificate of `role`
/// minted by one side of a mesh (the cluster's, or a stranger's).
pub async fn agent_channel(
    port: u16,
    mesh: &csi_mesh::tls::Mesh,
    role: csi_mesh::tls::Role,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let creds = mesh.mint(&role).unwrap();
    tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{port}"))?
        .tls_config(creds.client(&csi_mesh::tls::Role::Node(NODE_A.into())))?
        .connect()
        .await
}

/// DeleteVolume as a CO makes it: FAILED_PRECONDITION (a loop device the
/// kernel has not let go of yet, after an unstage) is tried again, for up to
/// 20 s.
pub async fn delete_as_a_co(
    c: &mut csi_proto::csi::controller_client::ControllerClient<tonic::transport::Channel>,
    id: &str,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        match c.delete_volume(delete_req(id)).await {
            Ok(_) => return,
            Err(e)
                if e.code() == tonic::Code::FailedPrecondition
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await
            }
            Err(e) => panic!("DeleteVolume {id}: {e:?}"),
        }
    }
}
