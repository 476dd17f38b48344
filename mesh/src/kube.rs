//! The few things the controller asks of the Kubernetes API, with the
//! credentials Kubernetes gives a pod (its ServiceAccount token and CA): the
//! node agent pods of its namespace (where each node's agent listens), the
//! mesh authority's Secret (read, or made on the first start), and Events on
//! claims. Three REST calls over one short-lived HTTPS connection each; the
//! node agents never talk to the API.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{json, Value};
use tokio_rustls::rustls;

use crate::Error;

/// Where Kubernetes mounts a pod's ServiceAccount credentials.
const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Longest a request may take, connection included.
const TIMEOUT: Duration = Duration::from_secs(10);

/// An API client of the pod this process runs in.
#[derive(Clone)]
pub struct Client {
    /// host:port of the API server (the `kubernetes` Service).
    host: String,
    server_name: rustls::pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    token: PathBuf,
    namespace: String,
}

impl Client {
    /// The in-cluster client: the API server from the environment Kubernetes
    /// sets, the credentials and namespace from the ServiceAccount mount.
    pub fn in_cluster() -> Result<Client, Error> {
        let dir = PathBuf::from(SA_DIR);
        let host = std::env::var("KUBERNETES_SERVICE_HOST")
            .map_err(|_| Error::Kube("KUBERNETES_SERVICE_HOST is not set: not in a pod".into()))?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let namespace = std::fs::read_to_string(dir.join("namespace"))
            .map_err(|e| Error::Kube(format!("cannot read the pod's namespace: {e}")))?
            .trim()
            .to_string();
        let ca = std::fs::read(dir.join("ca.crt"))
            .map_err(|e| Error::Kube(format!("cannot read the API server's CA: {e}")))?;
        Client::new(&host, &port, &ca, dir.join("token"), namespace)
    }

    pub fn new(
        host: &str,
        port: &str,
        ca_pem: &[u8],
        token: PathBuf,
        namespace: String,
    ) -> Result<Client, Error> {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem) {
            let cert = cert.map_err(|e| Error::Kube(format!("the API server's CA: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| Error::Kube(format!("the API server's CA: {e}")))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Kube(format!("TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let server_name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| Error::Kube(format!("the API server's name {host}: {e}")))?;
        let host = match host.contains(':') {
            true => format!("[{host}]:{port}"),
            false => format!("{host}:{port}"),
        };
        Ok(Client {
            host,
            server_name,
            tls: Arc::new(tls),
            token,
            namespace,
        })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// One request; the answer's status and JSON body.
    async fn request(
        &self,
        method: http::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), Error> {
        let work = async {
            // The token is read at every call: Kubernetes rotates it.
            let token = std::fs::read_to_string(&self.token)
                .map_err(|e| Error::Kube(format!("cannot read the ServiceAccount token: {e}")))?;
            let tcp = tokio::net::TcpStream::connect(&self.host)
                .await
                .map_err(|e| {
                    Error::Kube(format!("cannot reach the API server {}: {e}", self.host))
                })?;
            let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
                .connect(self.server_name.clone(), tcp)
                .await
                .map_err(|e| Error::Kube(format!("TLS with the API server: {e}")))?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                    .await
                    .map_err(|e| Error::Kube(format!("HTTP with the API server: {e}")))?;
            tokio::spawn(conn);
            let bytes = body.map(|b| b.to_string()).unwrap_or_default();
            let req = http::Request::builder()
                .method(method.clone())
                .uri(path)
                .header(http::header::HOST, &self.host)
                .header(
                    http::header::AUTHORIZATION,
                    format!("Bearer {}", token.trim()),
                )
                .header(http::header::ACCEPT, "application/json")
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(bytes)))
                .map_err(|e| Error::Kube(format!("{method} {path}: {e}")))?;
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| Error::Kube(format!("{method} {path}: {e}")))?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| Error::Kube(format!("{method} {path}: {e}")))?
                .to_bytes();
            let value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            Ok((status, value))
        };
        tokio::time::timeout(TIMEOUT, work)
            .await
            .map_err(|_| Error::Kube(format!("{method} {path}: no answer within {TIMEOUT:?}")))?
    }

    /// GET: the object, or None when it does not exist.
    pub async fn get(&self, path: &str) -> Result<Option<Value>, Error> {
        match self.request(http::Method::GET, path, None).await? {
            (200, v) => Ok(Some(v)),
            (404, _) => Ok(None),
            (s, v) => Err(refused("GET", path, s, &v)),
        }
    }

    /// POST: true when made, false when it already existed (409).
    pub async fn create(&self, path: &str, body: &Value) -> Result<bool, Error> {
        match self.request(http::Method::POST, path, Some(body)).await? {
            (200..=202, _) => Ok(true),
            (409, _) => Ok(false),
            (s, v) => Err(refused("POST", path, s, &v)),
        }
    }

    /// Records an Event on a PersistentVolumeClaim, as `kubectl describe`
    /// shows it. Best effort: a failure is logged, never returned.
    pub async fn claim_event(&self, claim: &Claim, warning: bool, reason: &str, message: &str) {
        let now = now_rfc3339();
        let body = json!({
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": format!("{}.", claim.name), "namespace": claim.namespace},
            "involvedObject": {
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "name": claim.name, "namespace": claim.namespace,
            },
            "type": if warning { "Warning" } else { "Normal" },
            "reason": reason,
            "message": message,
            "source": {"component": "example-csi-controller"},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        });
        let path = format!("/api/v1/namespaces/{}/events", claim.namespace);
        if let Err(e) = self.create(&path, &body).await {
            tracing::warn!(claim = %claim, reason, error = %e, "cannot record an Event");
        }
    }
}

/// A claim by its namespace and name (the provisioner passes both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

fn refused(method: &str, path: &str, status: u16, body: &Value) -> Error {
    let why = body
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("no message");
    Error::Kube(format!("{method} {path}: HTTP {status}: {why}"))
}

fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Percent-encodes a query value.
fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The node agents as pods of the controller's namespace with a label
/// selector, each listening on `port` at its pod address.
pub struct AgentPods {
    pub selector: String,
    pub port: u16,
}

impl AgentPods {
    /// Node name to host:port, for the running pods that have an address. Of
    /// two pods on one node (a rolling update), the newer.
    pub async fn list(&self, client: &Client) -> Result<BTreeMap<String, String>, Error> {
        let path = format!(
            "/api/v1/namespaces/{}/pods?labelSelector={}",
            client.namespace(),
            query_escape(&self.selector)
        );
        let list = client
            .get(&path)
            .await?
            .ok_or_else(|| Error::Kube(format!("GET {path}: not found")))?;
        Ok(agents_of(&list, self.port))
    }
}

/// The agents a pod list shows (see [`AgentPods::list`]).
fn agents_of(list: &Value, port: u16) -> BTreeMap<String, String> {
    let mut best: BTreeMap<String, (String, String)> = BTreeMap::new();
    for pod in list["items"].as_array().into_iter().flatten() {
        let node = pod["spec"]["nodeName"].as_str().unwrap_or("");
        let ip = pod["status"]["podIP"].as_str().unwrap_or("");
        let running = pod["status"]["phase"].as_str() == Some("Running");
        let leaving = !pod["metadata"]["deletionTimestamp"].is_null();
        if node.is_empty() || ip.is_empty() || !running || leaving {
            continue;
        }
        let created = pod["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let addr = match ip.contains(':') {
            true => format!("[{ip}]:{port}"),
            false => format!("{ip}:{port}"),
        };
        match best.get(node) {
            Some((c, _)) if *c >= created => {}
            _ => {
                best.insert(node.to_string(), (created, addr));
            }
        }
    }
    best.into_iter().map(|(n, (_, a))| (n, a)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_are_the_running_pods_with_an_address_newest_first() {
        let list = json!({"items": [
            {"metadata": {"creationTimestamp": "2026-12-01T10:00:00Z"},
             "spec": {"nodeName": "a"}, "status": {"phase": "Running", "podIP": "10.0.0.1"}},
            {"metadata": {"creationTimestamp": "2026-12-02T10:00:00Z"},
             "spec": {"nodeName": "a"}, "status": {"phase": "Running", "podIP": "10.0.0.9"}},
            {"metadata": {"creationTimestamp": "2026-12-02T10:00:00Z"},
             "spec": {"nodeName": "b"}, "status": {"phase": "Pending", "podIP": "10.0.1.1"}},
            {"metadata": {"creationTimestamp": "2026-12-02T10:00:00Z", "deletionTimestamp": "x"},
             "spec": {"nodeName": "c"}, "status": {"phase": "Running", "podIP": "10.0.2.1"}},
            {"metadata": {"creationTimestamp": "2026-12-02T10:00:00Z"},
             "spec": {"nodeName": "d"}, "status": {"phase": "Running", "podIP": "fd00::5"}},
        ]});
        let got = agents_of(&list, 9820);
        assert_eq!(
            got.into_iter().collect::<Vec<_>>(),
            vec![
                ("a".to_string(), "10.0.0.9:9820".to_string()),
                ("d".to_string(), "[fd00::5]:9820".to_string()),
            ]
        );
    }

    #[test]
    fn selectors_are_escaped_and_dates_are_civil() {
        assert_eq!(
            query_escape("app.kubernetes.io/name=x,c=node"),
            "app.kubernetes.io%2Fname%3Dx%2Cc%3Dnode"
        );
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_790), (2026, 12, 3));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}
