//! Handles: the volume, snapshot and group snapshot ids of a multi-node
//! deployment. A node agent's domain names its objects by bare ids (UUIDs); the
//! cluster controller hands them out qualified with the node that holds the
//! data, `ID@NODE`, so that any controller replica routes a call to that node
//! from the handle alone, with no table to keep or lose.
//!
//! CSI limits an id to 128 bytes: a node name too long to fit beside the id is
//! replaced by `#` and a digest of it (the router knows every node, so it finds
//! the node the digest names). An id without a node (made by a single-node or
//! distributed install) is still accepted everywhere: the router then asks the
//! nodes which one holds it.

use sha2::{Digest, Sha256};

/// CSI's general limit on a string field.
pub const MAX_HANDLE_BYTES: usize = 128;
const NAMED: char = '@';
const DIGESTED: char = '#';
/// Hex characters of a node's digest: 64 bits, no collision in any cluster.
const DIGEST_HEX: usize = 16;

/// Which node a handle names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeRef {
    /// The node's own name.
    Name(String),
    /// The digest of a name too long to carry.
    Digest(String),
}

impl NodeRef {
    /// Whether this names the node called `node`.
    pub fn is(&self, node: &str) -> bool {
        match self {
            NodeRef::Name(n) => n == node,
            NodeRef::Digest(d) => *d == digest(node),
        }
    }
}

impl std::fmt::Display for NodeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeRef::Name(n) => f.write_str(n),
            NodeRef::Digest(d) => write!(f, "the node whose name digests to {d}"),
        }
    }
}

/// A handle taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handle {
    /// The id the node's domain knows.
    pub id: String,
    /// The node that holds it; None for a bare id.
    pub node: Option<NodeRef>,
}

/// The digest that stands for a node name too long to carry in a handle.
pub fn digest(node: &str) -> String {
    let d = Sha256::digest(node.as_bytes());
    d.iter()
        .take(DIGEST_HEX / 2)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The handle of `id` on `node`.
pub fn qualify(id: &str, node: &str) -> String {
    if id.is_empty() {
        return String::new();
    }
    let named = format!("{id}{NAMED}{node}");
    if named.len() <= MAX_HANDLE_BYTES {
        return named;
    }
    format!("{id}{DIGESTED}{}", digest(node))
}

/// Takes a handle apart. The id part is whatever precedes the first `@` or `#`
/// (domain ids never hold either); its validity is the domain's to judge.
pub fn parse(handle: &str) -> Handle {
    match handle.find([NAMED, DIGESTED]) {
        None => Handle {
            id: handle.to_string(),
            node: None,
        },
        Some(at) => {
            let (id, rest) = handle.split_at(at);
            let node = match rest.chars().next() {
                Some(NAMED) => NodeRef::Name(rest[1..].to_string()),
                _ => NodeRef::Digest(rest[1..].to_string()),
            };
            Handle {
                id: id.to_string(),
                node: Some(node),
            }
        }
    }
}

/// The bare id a node's domain knows, from a handle the kubelet or the
/// controller passed to the node `this_node`: a handle naming another node
/// holds nothing here (NOT_FOUND, naming that node).
pub fn local_id(handle: &str, this_node: &str) -> Result<String, tonic::Status> {
    let h = parse(handle);
    match &h.node {
        Some(n) if !n.is(this_node) => Err(tonic::Status::not_found(format!(
            "{handle:?} lives on {n}, not on this node ({this_node})"
        ))),
        _ => Ok(h.id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f0c2c6e-5d0e-5b8e-9a4e-0c1f2a3b4c5d";

    #[test]
    fn a_handle_carries_its_node_and_parses_back() {
        let h = qualify(ID, "worker-1");
        assert_eq!(h, format!("{ID}@worker-1"));
        let p = parse(&h);
        assert_eq!(p.id, ID);
        assert_eq!(p.node, Some(NodeRef::Name("worker-1".into())));
        assert!(p.node.unwrap().is("worker-1"));
    }

    #[test]
    fn a_long_node_name_is_digested_and_the_handle_fits_csi() {
        let node = format!("node-{}.example.internal", "x".repeat(120));
        let h = qualify(ID, &node);
        assert!(h.len() <= MAX_HANDLE_BYTES, "{}", h.len());
        let p = parse(&h);
        assert_eq!(p.id, ID);
        let n = p.node.unwrap();
        assert!(n.is(&node));
        assert!(!n.is("node-other"));
        // The longest name that still fits is carried as it is.
        let fits = "n".repeat(MAX_HANDLE_BYTES - ID.len() - 1);
        assert_eq!(parse(&qualify(ID, &fits)).node, Some(NodeRef::Name(fits)));
    }

    #[test]
    fn a_bare_id_has_no_node_and_an_empty_id_stays_empty() {
        assert_eq!(
            parse(ID),
            Handle {
                id: ID.into(),
                node: None
            }
        );
        assert_eq!(qualify("", "n"), "");
    }

    #[test]
    fn a_node_takes_its_own_handles_and_bare_ids_and_refuses_others() {
        assert_eq!(local_id(&qualify(ID, "a"), "a").unwrap(), ID);
        assert_eq!(local_id(ID, "a").unwrap(), ID);
        let e = local_id(&qualify(ID, "b"), "a").unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(e.message().contains("lives on b"), "{}", e.message());
    }
}
