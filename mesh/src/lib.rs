//! The multi-node control plane. One controller (a Deployment, any number of
//! replicas behind the sidecars' leader election) serves the CSI Controller
//! services for every node; a node agent on each node (the node plugin, in the
//! node DaemonSet) holds that node's volumes and serves the same services to
//! the controller alone, over mutual TLS (`tls`). The controller finds the
//! agents (`agents`, from the Kubernetes API or a fixed list) and routes each
//! call to the node that holds its data (`router`). docs/multi-node.md says
//! why this shape, and what it costs.

#![forbid(unsafe_code)]

pub mod agents;
pub mod kube;
pub mod node;
pub mod router;
pub mod tls;

use std::path::Path;

use base64::Engine;

/// What can stop the mesh from starting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("mesh TLS: {0}")]
    Tls(String),
    #[error("Kubernetes API: {0}")]
    Kube(String),
}

/// The controller's side of the mesh: from `dir` (a mounted Secret) when it
/// holds one; else from the Secret `secret` of its namespace, made there with
/// a new pair of authorities when missing (several replicas starting at once
/// agree: the first one's stays). With Kubernetes, the nodes' Secret
/// (`secret`-node) is made too when missing, from what the controller's holds.
pub async fn controller_side(
    dir: &Path,
    kube: Option<(&kube::Client, &str)>,
) -> Result<tls::Mesh, Error> {
    let in_dir = tls::Mesh::load(dir, tls::Side::Controller);
    let Some((client, secret)) = kube else {
        return in_dir;
    };
    let mesh = match in_dir {
        Ok(m) => m,
        Err(_) => {
            let (controller, _) = tls::generate_pair()?;
            let files = get_or_create(client, secret, &controller).await?;
            tls::Mesh::from_files(&files, tls::Side::Controller)
                .map_err(|e| Error::Tls(format!("Secret {secret}: {e}")))?
        }
    };
    if mesh.is_single() {
        tracing::warn!(
            secret,
            "the mesh has one authority for the controller and the nodes: root on any node \
             could act as the controller; delete both mesh Secrets and restart the \
             controller, then the nodes, to split it"
        );
    }
    let nodes_secret = nodes_secret_name(secret);
    match mesh.nodes_files() {
        Some(files) => {
            get_or_create(client, &nodes_secret, &files).await?;
        }
        None => {
            if client
                .get(&secret_path(client, &nodes_secret))
                .await?
                .is_none()
            {
                return Err(Error::Tls(format!(
                    "the Secret {secret} has no node-ca.key to make the Secret {nodes_secret} \
                     of: supply {nodes_secret} (tls.crt, tls.key, controller-ca.crt)"
                )));
            }
        }
    }
    Ok(mesh)
}

/// The name of the nodes' Secret beside the controller's.
pub fn nodes_secret_name(secret: &str) -> String {
    format!("{secret}-node")
}

fn secret_path(client: &kube::Client, name: &str) -> String {
    format!("/api/v1/namespaces/{}/secrets/{name}", client.namespace())
}

/// The files of the Secret `name`, made of `files` when missing (the files
/// of one made first by someone else when it appears meanwhile).
async fn get_or_create(
    client: &kube::Client,
    name: &str,
    files: &tls::Files,
) -> Result<tls::Files, Error> {
    let b64 = base64::engine::general_purpose::STANDARD;
    for _ in 0..2 {
        if let Some(s) = client.get(&secret_path(client, name)).await? {
            let mut out = tls::Files::new();
            if let Some(data) = s["data"].as_object() {
                for (k, v) in data {
                    let raw = b64
                        .decode(v.as_str().unwrap_or(""))
                        .map_err(|e| Error::Tls(format!("Secret {name}: {k}: {e}")))?;
                    let text = String::from_utf8(raw)
                        .map_err(|e| Error::Tls(format!("Secret {name}: {k}: {e}")))?;
                    out.insert(k.clone(), text);
                }
            }
            return Ok(out);
        }
        let mut data = serde_json::Map::new();
        for (k, v) in files {
            data.insert(k.clone(), b64.encode(v).into());
        }
        // The type of a TLS Secret, as tools expect of a tls.crt and tls.key.
        let body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {"name": name, "namespace": client.namespace(),
                         "labels": {"app.kubernetes.io/part-of": "example-csi"}},
            "data": data,
        });
        let list = format!("/api/v1/namespaces/{}/secrets", client.namespace());
        if client.create(&list, &body).await? {
            tracing::info!(secret = name, "made a mesh authority's Secret");
            return Ok(files.clone());
        }
        // Another replica made it first: read theirs.
    }
    Err(Error::Tls(format!(
        "the Secret {name} could not be read or made"
    )))
}
