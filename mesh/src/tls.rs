//! Who may talk on the mesh: mutual TLS under the mesh's own certificate
//! authorities.
//!
//! Two authorities, each a certificate and its key: the controller's, whose
//! key only the controller holds, signs the controller's certificate; the
//! nodes', whose key every node agent holds, signs the nodes' certificates.
//! They are kept in two Kubernetes Secrets (the controller makes both on its
//! first start when they are missing; an operator may supply their own) and
//! each side is given its own key and the other's certificate. Each process
//! mints its own certificate at start, naming its role: the controller, or
//! one node. A node agent answers only peers with a certificate of one of the
//! authorities, serves the Controller services to a certificate the
//! controller's authority signed alone, and a hold's data to the node it was
//! made for; a client checks that the node it reached is the node it asked
//! for. So root on one node, which has the nodes' key, still cannot act as the
//! controller towards another node.
//!
//! A folder with one authority and no certificate of the other side (an
//! install made before the split) uses that one authority for both roles.

use std::path::Path;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic::Status;

use crate::Error;

/// File names of the authority in its folder: a Secret of type
/// kubernetes.io/tls holds `tls.crt` and `tls.key`; `ca.crt` and `ca.key` are
/// read first where both are present.
const CERT_FILES: [(&str, &str); 2] = [("ca.crt", "ca.key"), ("tls.crt", "tls.key")];
/// In the controller's folder: the nodes' authority (its key too, when the
/// controller made it, so that it can make the nodes' Secret).
pub const NODE_CA: (&str, &str) = ("node-ca.crt", "node-ca.key");
/// In a node's folder: the controller's authority, its certificate only.
pub const CONTROLLER_CA: &str = "controller-ca.crt";

/// The names certificates carry: under `.invalid`, which never resolves.
const CONTROLLER_NAME: &str = "controller.mesh.invalid";
const NODE_SUFFIX: &str = ".node.mesh.invalid";

/// What a process is on the mesh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Controller,
    Node(String),
}

impl Role {
    /// The DNS name its certificate carries. A node's is a digest of its name,
    /// which may hold characters a DNS name cannot.
    pub fn dns_name(&self) -> String {
        match self {
            Role::Controller => CONTROLLER_NAME.to_string(),
            Role::Node(n) => format!("{}{NODE_SUFFIX}", csi_glue::handle::digest(n)),
        }
    }
}

/// A peer as its certificate names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    Controller,
    /// A node agent, by the digest of its name.
    Node(String),
}

impl Peer {
    pub fn is_node(&self, node: &str) -> bool {
        matches!(self, Peer::Node(d) if *d == csi_glue::handle::digest(node))
    }
}

/// The authority: its certificate and what signs with its key.
pub struct Authority {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A new authority, as PEM (certificate, key): what goes into the Secret.
pub fn generate_authority() -> Result<(String, String), Error> {
    generate_named("example-csi mesh authority")
}

/// A new authority named `name` (the issuer its certificates carry).
fn generate_named(name: &str) -> Result<(String, String), Error> {
    let key = KeyPair::generate().map_err(tls_error("make the authority's key"))?;
    let mut params = CertificateParams::new(Vec::<String>::new())
        .map_err(tls_error("describe the authority"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params);
    let cert = params
        .self_signed(&key)
        .map_err(tls_error("sign the authority"))?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The files of both sides' folders (or Secrets), file name to content.
pub type Files = std::collections::BTreeMap<String, String>;

/// A new pair of authorities: the files of the controller's folder and of the
/// nodes' folder.
pub fn generate_pair() -> Result<(Files, Files), Error> {
    let (ccert, ckey) = generate_named("example-csi mesh controller authority")?;
    let (ncert, nkey) = generate_named("example-csi mesh node authority")?;
    let controller = Files::from([
        ("tls.crt".into(), ccert.clone()),
        ("tls.key".into(), ckey),
        (NODE_CA.0.into(), ncert.clone()),
        (NODE_CA.1.into(), nkey.clone()),
    ]);
    let nodes = nodes_files(&ncert, &nkey, &ccert);
    Ok((controller, nodes))
}

/// The files of the nodes' folder.
fn nodes_files(node_cert: &str, node_key: &str, controller_cert: &str) -> Files {
    Files::from([
        ("tls.crt".into(), node_cert.to_string()),
        ("tls.key".into(), node_key.to_string()),
        (CONTROLLER_CA.into(), controller_cert.to_string()),
    ])
}

/// Which side of the mesh a folder is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Controller,
    Nodes,
}

/// One side's authority and the other side's certificate.
pub struct Mesh {
    pub own: Authority,
    side: Side,
    /// The other side's authority; none when one authority serves both.
    other_pem: Option<String>,
    /// The nodes' key, in the controller's folder when the controller made it.
    node_key_pem: Option<String>,
}

impl Mesh {
    /// A side from its files.
    pub fn from_files(files: &Files, side: Side) -> Result<Mesh, Error> {
        let (cert, key) = CERT_FILES
            .iter()
            .find_map(|(c, k)| Some((files.get(*c)?, files.get(*k)?)))
            .ok_or_else(|| {
                Error::Tls(
                    "no mesh authority (ca.crt and ca.key, or tls.crt and tls.key)".to_string(),
                )
            })?;
        let other = match side {
            Side::Controller => NODE_CA.0,
            Side::Nodes => CONTROLLER_CA,
        };
        let node_key_pem = match side {
            Side::Controller => files.get(NODE_CA.1).cloned(),
            Side::Nodes => None,
        };
        Ok(Mesh {
            own: Authority::from_pem(cert, key)?,
            side,
            other_pem: files.get(other).cloned(),
            node_key_pem,
        })
    }

    /// A side from its folder (a mounted Secret).
    pub fn load(dir: &Path, side: Side) -> Result<Mesh, Error> {
        let mut names: Vec<&str> = CERT_FILES.iter().flat_map(|(c, k)| [*c, *k]).collect();
        names.extend([NODE_CA.0, NODE_CA.1, CONTROLLER_CA]);
        let mut files = Files::new();
        for name in names {
            let path = dir.join(name);
            match std::fs::read_to_string(&path) {
                Ok(text) => {
                    files.insert(name.to_string(), text);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::Tls(format!("cannot read {}: {e}", path.display()))),
            }
        }
        Mesh::from_files(&files, side).map_err(|e| Error::Tls(format!("{}: {e}", dir.display())))
    }

    /// One authority for both roles: any node's root could act as the
    /// controller.
    pub fn is_single(&self) -> bool {
        self.other_pem.is_none()
    }

    /// The files of the nodes' folder, as the controller can make them: with
    /// one authority, that one.
    pub fn nodes_files(&self) -> Option<Files> {
        match (&self.other_pem, &self.node_key_pem) {
            (Some(cert), Some(key)) => Some(nodes_files(cert, key, &self.own.cert_pem)),
            (None, _) => Some(Files::from([
                ("tls.crt".into(), self.own.cert_pem.clone()),
                ("tls.key".into(), self.own.key_pem.clone()),
            ])),
            (Some(_), None) => None,
        }
    }

    /// This process's certificate of `role`, signed by this side's authority.
    pub fn mint(&self, role: &Role) -> Result<Credentials, Error> {
        let own = self.own.cert_pem.as_str();
        let other = self.other_pem.as_deref().unwrap_or(own);
        let (controller, nodes) = match self.side {
            Side::Controller => (own, other),
            Side::Nodes => (other, own),
        };
        self.own.mint_trusting(role, controller, nodes)
    }
}

/// Certificates are valid from long ago to far ahead: nodes' clocks differ, and
/// a process's certificate lives as long as the process. Trust ends when the
/// authority is replaced (the Secret), not by a date.
fn validity(params: &mut CertificateParams) {
    params.not_before = rcgen::date_time_ymd(2000, 1, 1);
    params.not_after = rcgen::date_time_ymd(2200, 1, 1);
}

fn tls_error(what: &'static str) -> impl Fn(rcgen::Error) -> Error {
    move |e| Error::Tls(format!("cannot {what}: {e}"))
}

impl Authority {
    /// The authority from PEM.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Authority, Error> {
        let key = KeyPair::from_pem(key_pem).map_err(tls_error("read the authority's key"))?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)
            .map_err(tls_error("read the authority's certificate"))?;
        Ok(Authority {
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
            issuer,
        })
    }

    /// The authority of a folder (a mounted Secret), whichever side's.
    pub fn load(dir: &Path) -> Result<Authority, Error> {
        Ok(Mesh::load(dir, Side::Nodes)?.own)
    }

    /// The authority's certificate.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate of `role`, trusting this authority alone for both roles.
    pub fn mint(&self, role: &Role) -> Result<Credentials, Error> {
        self.mint_trusting(role, &self.cert_pem, &self.cert_pem)
    }

    /// A certificate of `role` for this process, with a key of its own,
    /// trusting these authorities for the controller's and nodes' roles.
    fn mint_trusting(
        &self,
        role: &Role,
        controller_pem: &str,
        nodes_pem: &str,
    ) -> Result<Credentials, Error> {
        let key = KeyPair::generate().map_err(tls_error("make a key"))?;
        let mut params = CertificateParams::new(vec![role.dns_name()])
            .map_err(tls_error("describe a certificate"))?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, role.dns_name());
        params.distinguished_name = dn;
        params.is_ca = IsCa::NoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        validity(&mut params);
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(tls_error("sign a certificate"))?;
        let der = |pem: &str| -> Result<Vec<u8>, Error> {
            let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
                .map_err(|e| Error::Tls(format!("cannot read an authority's certificate: {e}")))?;
            Ok(p.contents)
        };
        let roots_pem = match controller_pem == nodes_pem {
            true => nodes_pem.to_string(),
            false => format!("{}\n{}", controller_pem.trim_end(), nodes_pem),
        };
        Ok(Credentials {
            roots_pem,
            node_ca_pem: nodes_pem.to_string(),
            controller_ca: der(controller_pem)?,
            node_ca: der(nodes_pem)?,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            role: role.clone(),
        })
    }
}

/// Makes the process's TLS provider (ring) offer AES-128-GCM first, before
/// AES-256-GCM: both ends of a mesh connection then take it. A volume's data
/// crosses the mesh encrypted, and AES-128 takes 10 rounds a block where
/// AES-256 takes 14, for a security margin TLS 1.3 counts as ample. Once per
/// process, before the first configuration; a provider installed before
/// stays.
fn prefer_aes_128() {
    use tokio_rustls::rustls::{crypto::ring, CipherSuite};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut provider = ring::default_provider();
        provider
            .cipher_suites
            .sort_by_key(|s| s.suite() != CipherSuite::TLS13_AES_128_GCM_SHA256);
        let _ = provider.install_default();
    });
}

/// A process's certificate and key, and the authorities it trusts.
#[derive(Clone)]
pub struct Credentials {
    /// The certificates of both authorities (one when they are the same).
    roots_pem: String,
    /// The nodes' authority: what a node serving a call must show.
    node_ca_pem: String,
    controller_ca: Vec<u8>,
    node_ca: Vec<u8>,
    cert_pem: String,
    key_pem: String,
    pub role: Role,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// A server that asks every client for a certificate of either
    /// authority; each call then checks the role (`caller`).
    pub fn server(&self) -> ServerTlsConfig {
        prefer_aes_128();
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(Certificate::from_pem(&self.roots_pem))
    }

    /// A client of node `peer`, which must show that node's certificate of
    /// the nodes' authority (only nodes serve on the mesh).
    pub fn client(&self, peer: &Role) -> ClientTlsConfig {
        prefer_aes_128();
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.node_ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(peer.dns_name())
    }
}

/// Who called: the role a client proved with its certificate, checked
/// against the authority that signs that role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// No TLS: the node's own socket.
    Local,
    Peer(Peer),
    /// A certificate that names no role, or a role its signer may not give.
    Stranger,
}

impl Credentials {
    /// Who called `req`.
    pub fn caller<T>(&self, req: &tonic::Request<T>) -> Caller {
        let Some(certs) = req.peer_certs() else {
            return Caller::Local;
        };
        let Some(leaf) = certs.first() else {
            return Caller::Stranger;
        };
        match self.verify(leaf.as_ref()) {
            Some(p) => Caller::Peer(p),
            None => Caller::Stranger,
        }
    }

    /// The role `der` names, if the authority of that role signed it.
    fn verify(&self, der: &[u8]) -> Option<Peer> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        let peer = san.value.general_names.iter().find_map(|n| match n {
            x509_parser::extensions::GeneralName::DNSName(d) if *d == CONTROLLER_NAME => {
                Some(Peer::Controller)
            }
            x509_parser::extensions::GeneralName::DNSName(d) => d
                .strip_suffix(NODE_SUFFIX)
                .map(|digest| Peer::Node(digest.to_string())),
            _ => None,
        })?;
        let signer = match peer {
            Peer::Controller => &self.controller_ca,
            Peer::Node(_) => &self.node_ca,
        };
        let (_, ca) = x509_parser::parse_x509_certificate(signer).ok()?;
        cert.verify_signature(Some(ca.public_key())).ok()?;
        Some(peer)
    }

    /// An interceptor that lets through the calls of the controller alone.
    pub fn controller_only(
        self: &Arc<Self>,
    ) -> impl Fn(tonic::Request<()>) -> Result<tonic::Request<()>, Status> + Clone {
        let creds = self.clone();
        move |req| match creds.caller(&req) {
            Caller::Peer(Peer::Controller) => Ok(req),
            Caller::Peer(other) => Err(Status::permission_denied(format!(
                "{other:?} may not call the controller services of a node agent"
            ))),
            Caller::Local | Caller::Stranger => Err(Status::unauthenticated(
                "a node agent serves these to the controller's certificate alone",
            )),
        }
    }
}

/// The credentials of a process, shared by its servers and clients.
pub type Shared = Arc<Credentials>;

#[cfg(test)]
mod tests {
    use super::*;

    fn der(creds: &Credentials) -> Vec<u8> {
        let (_, p) = x509_parser::pem::parse_x509_pem(creds.cert_pem.as_bytes()).unwrap();
        p.contents
    }

    #[test]
    fn a_role_counts_only_when_its_own_authority_signed_it() {
        let (controller, nodes) = generate_pair().unwrap();
        let controller = Mesh::from_files(&controller, Side::Controller).unwrap();
        let nodes = Mesh::from_files(&nodes, Side::Nodes).unwrap();
        assert!(!controller.is_single() && !nodes.is_single());
        let agent = nodes.mint(&Role::Node("node-a".into())).unwrap();

        let real = controller.mint(&Role::Controller).unwrap();
        assert_eq!(agent.verify(&der(&real)), Some(Peer::Controller));
        let peer = nodes.mint(&Role::Node("node-b".into())).unwrap();
        assert_eq!(
            agent.verify(&der(&peer)),
            Some(Peer::Node(csi_glue::handle::digest("node-b")))
        );
        // What root on a node can make: the controller's name, signed with
        // the nodes' key.
        let forged = nodes.mint(&Role::Controller).unwrap();
        assert_eq!(agent.verify(&der(&forged)), None);
        // And the controller's key does not make nodes.
        let odd = controller.mint(&Role::Node("node-b".into())).unwrap();
        assert_eq!(agent.verify(&der(&odd)), None);
        // A stranger's certificate of either role.
        let (other, _) = generate_pair().unwrap();
        let other = Mesh::from_files(&other, Side::Controller).unwrap();
        assert_eq!(
            agent.verify(&der(&other.mint(&Role::Controller).unwrap())),
            None
        );
    }

    #[test]
    fn the_controller_makes_the_nodes_folder_without_its_own_key() {
        let (controller, _) = generate_pair().unwrap();
        let mesh = Mesh::from_files(&controller, Side::Controller).unwrap();
        let files = mesh.nodes_files().unwrap();
        let own_key = &controller["tls.key"];
        assert!(files.values().all(|v| v != own_key), "{:?}", files.keys());
        assert_eq!(files[CONTROLLER_CA], controller["tls.crt"]);
        assert_eq!(files["tls.key"], controller[NODE_CA.1]);
        // Without the nodes' key, the controller cannot make their folder.
        let mut supplied = controller.clone();
        supplied.remove(NODE_CA.1);
        let mesh = Mesh::from_files(&supplied, Side::Controller).unwrap();
        assert!(mesh.nodes_files().is_none());
    }

    #[test]
    fn one_authority_serves_both_roles_as_before_the_split() {
        let (cert, key) = generate_authority().unwrap();
        let files = Files::from([("tls.crt".into(), cert.clone()), ("tls.key".into(), key)]);
        let nodes = Mesh::from_files(&files, Side::Nodes).unwrap();
        let controller = Mesh::from_files(&files, Side::Controller).unwrap();
        assert!(nodes.is_single() && controller.is_single());
        let agent = nodes.mint(&Role::Node("node-a".into())).unwrap();
        let c = controller.mint(&Role::Controller).unwrap();
        assert_eq!(agent.verify(&der(&c)), Some(Peer::Controller));
        assert_eq!(controller.nodes_files().unwrap()["tls.crt"], cert);
    }
}
