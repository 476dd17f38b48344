#![allow(dead_code)]

//! What the tests of volumes moving between nodes share: requests through
//! the router, a volume mounted on its node, random data and its digest, the
//! images in a node's pool compared byte for byte, a node's transfers and the
//! wait for an arrival.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cluster::*;
use crate::common::*;
use csi_proto::csi;
use csi_proto::mesh::{self, agent_client::AgentClient};

/// A CreateVolume on `node` of `size` bytes from `source`.
pub fn create_from(
    name: &str,
    node: &str,
    size: i64,
    source: csi::VolumeContentSource,
) -> csi::CreateVolumeRequest {
    let mut r = create_on(name, node);
    r.capacity_range = csi_glue::capacity_at_least(size);
    r.volume_content_source = Some(source);
    r
}

pub fn sized_on(name: &str, node: &str, size: i64) -> csi::CreateVolumeRequest {
    let mut r = create_on(name, node);
    r.capacity_range = csi_glue::capacity_at_least(size);
    r
}

pub fn local(handle: &str) -> String {
    csi_glue::handle::parse(handle).id
}

pub fn volume_image(pool: &Pool, handle: &str) -> PathBuf {
    pool.path
        .join("volumes")
        .join(format!("{}.img", local(handle)))
}

pub fn snapshot_image(pool: &Pool, handle: &str) -> PathBuf {
    pool.path
        .join("snapshots")
        .join(format!("{}.img", local(handle)))
}

/// Whether two files hold the same bytes; the first offset where they differ.
pub fn first_difference(a: &Path, b: &Path) -> Option<u64> {
    let (mut fa, mut fb) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut at = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba);
        let nb = read_full(&mut fb, &mut bb);
        if na != nb || ba[..na] != bb[..nb] {
            let off = ba[..na.min(nb)]
                .iter()
                .zip(&bb[..na.min(nb)])
                .position(|(x, y)| x != y)
                .unwrap_or(na.min(nb));
            return Some(at + off as u64);
        }
        if na == 0 {
            return None;
        }
        at += na as u64;
    }
}

pub fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    n
}

pub fn allocated(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().blocks() * 512
}

/// The transfers a node (or the router) lists on its own socket.
pub async fn transfers(d: &Driver) -> Vec<mesh::TransferStatus> {
    let ch = csi_glue::connect(&format!("unix://{}", d.socket.display()))
        .await
        .unwrap();
    AgentClient::new(ch)
        .list_transfers(mesh::ListTransfersRequest {})
        .await
        .unwrap()
        .into_inner()
        .transfers
}

/// The arrival of `volume` on `node`, once it is done.
pub async fn arrived(node: &Driver, volume: &str, secs: u64) -> mesh::TransferStatus {
    let want = local(volume);
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let now = transfers(node).await;
        if let Some(t) = now
            .iter()
            .find(|t| t.role == "arriving" && t.volume_id == want && t.state == "done")
        {
            return t.clone();
        }
        assert!(
            Instant::now() < deadline,
            "volume {volume} did not arrive in {secs}s: {now:?}\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Writes `mib` MiB of random data to a new file in a published volume; its
/// sha256.
pub fn write_random(dir: &Path, name: &str, mib: u32) -> String {
    let f = dir.join(name);
    sh(
        "sh",
        &[
            "-c",
            &format!("head -c {}M /dev/urandom > {} && sync", mib, f.display()),
        ],
    );
    sha256(&f)
}

pub fn sha256(f: &Path) -> String {
    sh("sha256sum", &[f.to_str().unwrap()])
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// A volume on a node, staged and published there through the node's socket.
pub struct Mounted {
    pub id: String,
    pub staging: PathBuf,
    pub target: PathBuf,
}

pub async fn mount(node: &Node, id: &str, tag: &str) -> Mounted {
    let staging = node.pool.scratch(&format!("staging-{tag}"));
    let target = node.pool.scratch(&format!("target-{tag}"));
    let mut c = node.driver.clients().await;
    c.stage_and_publish(id, &staging, &target, &mount_cap("ext4", writer()))
        .await;
    Mounted {
        id: id.to_string(),
        staging,
        target,
    }
}

pub async fn unmount(node: &Node, m: &Mounted) {
    let mut c = node.driver.clients().await;
    c.unpublish_and_unstage(&m.id, &m.target, &m.staging).await;
}

/// A directory volume's folder in a node's pool.
pub fn dir_volume(pool: &Pool, handle: &str) -> PathBuf {
    pool.path.join("volumes").join(local(handle))
}

/// What a directory holds, for comparison: its own mode and owner, then each
/// entry's kind, mode, owner, length or link target, mtime, and each file's
/// sha256.
pub fn tree_of(dir: &Path) -> String {
    sh(
        "sh",
        &[
            "-c",
            &format!(
                "cd '{}' && stat -c '%a %u:%g' . && \
                 find . -mindepth 1 \\( -type d -printf '%P %y %m %U:%G %T@\\n' \\) \
                   -o -printf '%P %y %m %U:%G %s %l %T@\\n' | sort && \
                 find . -type f -exec sha256sum {{}} + | sort",
                dir.display()
            ),
        ],
    )
}

/// A directory snapshot's folder in a node's pool.
pub fn dir_snapshot(pool: &Pool, handle: &str) -> PathBuf {
    pool.path.join("snapshots").join(local(handle))
}
