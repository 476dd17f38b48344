//! A tenant attacking the node through its own directory volume, on the real
//! driver: while snapshots, clones and fsGroup stages of the volume run, a
//! thread standing for the pod swaps the volume's directories and files for
//! symbolic links to a canary outside the pool (as a pod could point them at
//! other pods' Secrets). Nothing of the canary may be copied into the pool, and
//! the canary may not change. The windows between the walk's steps are widened
//! with the walk's failpoints (`tree.entry-listed`, `tree.entry-opened`).
//!
//! Then a workload that renames and deletes files during 200 snapshots of its
//! volume: every snapshot is taken (entries that vanish are skipped), none
//! answers INTERNAL.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use csi_proto::csi;
use csi_proto::csi::volume_capability;

const MIB: i64 = 1 << 20;
const CANARY: &[u8] = b"CANARY: a Secret of another pod";
const NAMES: [&str; 8] = ["d0", "d1", "d2", "d3", "f0", "f1", "f2", "f3"];

fn dir_cap(group: &str) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume {
                fs_type: String::new(),
                mount_flags: vec![],
                volume_mount_group: group.to_string(),
            },
        )),
        access_mode: Some(volume_capability::AccessMode {
            mode: writer() as i32,
        }),
    }
}

fn clone_req(name: &str, source: &str) -> csi::CreateVolumeRequest {
    let mut req = create_req(name, 64 * MIB, dir_cap(""), &[("kind", "dir")]);
    req.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: source.to_string(),
            },
        )),
    });
    req
}

/// The canary: a folder outside the pool with a secret in it.
struct Canary {
    dir: PathBuf,
}

impl Canary {
    fn new(pool: &Pool) -> Canary {
        let dir = pool.scratch("other-pods-secrets");
        fs::write(dir.join("token"), CANARY).unwrap();
        Canary { dir }
    }

    /// Bytes, group and mode of everything in it: what must not change.
    fn state(&self) -> Vec<(Vec<u8>, u32, u32)> {
        [self.dir.clone(), self.dir.join("token")]
            .iter()
            .map(|p| {
                let m = fs::symlink_metadata(p).unwrap();
                let bytes = if m.is_file() {
                    fs::read(p).unwrap()
                } else {
                    vec![]
                };
                (bytes, m.gid(), m.mode())
            })
            .collect()
    }
}

/// The regular files below `dir` (links not followed) holding the canary.
fn canary_copies(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(m) = fs::symlink_metadata(&p) else {
                continue;
            };
            if m.is_dir() {
                stack.push(p);
            } else if m.is_file()
                && m.len() == CANARY.len() as u64
                && fs::read(&p).map(|b| b == CANARY).unwrap_or(false)
            {
                found.push(p);
            }
        }
    }
    found
}

/// The folder in the pool holding the volume `fill` filled.
fn volume_root(pool: &Path) -> PathBuf {
    let mut stack = vec![pool.to_path_buf()];
    while let Some(d) = stack.pop() {
        if d.join("d0/deeper/file").is_file() {
            return d;
        }
        for e in fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
    panic!("no volume folder in {}", pool.display());
}

/// The pod: swaps each of the volume's entries for a link to the canary and
/// back, as fast as it can, until stopped. Returns the number of swaps.
fn tenant(root: PathBuf, canary: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut swaps = 0;
        while !stop.load(Ordering::Relaxed) {
            for n in NAMES {
                let p = root.join(n);
                let real = root.join(format!("{n}.real"));
                let target = match n.starts_with('d') {
                    true => canary.clone(),
                    false => canary.join("token"),
                };
                if fs::rename(&p, &real).is_ok() && std::os::unix::fs::symlink(&target, &p).is_ok()
                {
                    swaps += 1;
                }
            }
            for n in NAMES {
                let p = root.join(n);
                let _ = fs::remove_file(&p);
                let _ = fs::rename(root.join(format!("{n}.real")), &p);
            }
        }
        swaps
    })
}

fn fill(root: &Path) {
    for i in 0..4 {
        fs::create_dir_all(root.join(format!("d{i}/deeper"))).unwrap();
        fs::write(root.join(format!("d{i}/file")), format!("inside d{i}")).unwrap();
        fs::write(root.join(format!("d{i}/deeper/file")), b"inside deeper").unwrap();
        fs::write(root.join(format!("f{i}")), format!("inside f{i}")).unwrap();
    }
}

async fn swapped_links_reach_nothing_outside(fs_type: &str) {
    require_root();
    let pool = Pool::new(fs_type);
    let envs = [(
        "EXAMPLE_CSI_FAILPOINTS",
        "tree.entry-listed=sleep(1),tree.entry-opened=sleep(1)",
    )];
    let driver = Driver::start_with_env(&pool, &[], &envs);
    let mut c = driver.clients().await;
    let canary = Canary::new(&pool);
    let before = canary.state();

    let id = c.create_dir("pvc-tenant", 256 * MIB).await;
    let staging = pool.scratch("staging");
    let target = pool.scratch("pod").join("volume");
    c.stage_and_publish(&id, &staging, &target, &dir_cap(""))
        .await;
    fill(&target);

    // The pod's view and the volume's folder in the pool are one tree; the
    // tenant works on the folder so that restaging (below) never interrupts it.
    let root = volume_root(&pool.path);
    let stop = Arc::new(AtomicBool::new(false));
    let pod = tenant(root, canary.dir.clone(), stop.clone());
    let rounds = 25;
    let mut failures = Vec::new();
    for i in 0..rounds {
        let snap = c
            .controller
            .create_snapshot(snapshot_req(&format!("snap-{i}"), &id))
            .await;
        let clone = c
            .controller
            .create_volume(clone_req(&format!("clone-{i}"), &id))
            .await;
        failures.extend(snap.err().map(|e| format!("snapshot {i}: {e:?}")));
        failures.extend(clone.err().map(|e| format!("clone {i}: {e:?}")));
        // A pod with another fsGroup: the stage walks the whole volume.
        c.unpublish_and_unstage(&id, &target, &staging).await;
        let cap = dir_cap(&format!("{}", 5000 + i));
        c.stage_and_publish(&id, &staging, &target, &cap).await;
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = pod.join().unwrap();
    eprintln!("{fs_type}: {swaps} swaps during {rounds} snapshots, clones and fsGroup stages");

    assert!(failures.is_empty(), "{fs_type}: {failures:#?}");
    let copied = canary_copies(&pool.path);
    assert!(
        copied.is_empty(),
        "{fs_type}: the canary was copied into the pool: {copied:#?}"
    );
    assert_eq!(canary.state(), before, "{fs_type}: the canary changed");
    assert!(
        swaps >= 500,
        "{fs_type}: only {swaps} swaps: the race did not run"
    );
    c.unpublish_and_unstage(&id, &target, &staging).await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_swapped_links_reach_nothing_outside_an_xfs_pool() {
    swapped_links_reach_nothing_outside("xfs").await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_swapped_links_reach_nothing_outside_a_btrfs_pool() {
    swapped_links_reach_nothing_outside("btrfs").await;
}

/// A workload churning its files: creating, renaming and deleting them.
fn churn(root: PathBuf, stop: Arc<AtomicBool>, ops: Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut i: u64 = 0;
        while !stop.load(Ordering::Relaxed) {
            let dir = root.join(format!("batch-{}", i % 8));
            let _ = fs::create_dir_all(&dir);
            let a = dir.join(format!("new-{i}"));
            let b = dir.join(format!("done-{i}"));
            if fs::write(&a, i.to_le_bytes()).is_ok() && fs::rename(&a, &b).is_ok() {
                ops.fetch_add(2, Ordering::Relaxed);
            }
            if i >= 16 {
                let _ =
                    fs::remove_file(root.join(format!("batch-{}/done-{}", (i - 16) % 8, i - 16)));
                ops.fetch_add(1, Ordering::Relaxed);
            }
            if i % 64 == 63 {
                let _ = fs::rename(&dir, root.join(format!("renamed-{i}")));
                let _ = fs::remove_dir_all(root.join(format!("renamed-{i}")));
            }
            i += 1;
        }
    })
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_snapshots_of_a_dir_volume_whose_files_come_and_go() {
    require_root();
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let id = c.create_dir("pvc-churn", 256 * MIB).await;
    let staging = pool.scratch("staging");
    let target = pool.scratch("pod").join("volume");
    c.stage_and_publish(&id, &staging, &target, &dir_cap(""))
        .await;
    fill(&target);

    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let workload = churn(target.clone(), stop.clone(), ops.clone());
    let mut codes: BTreeMap<String, u32> = BTreeMap::new();
    let mut taken = Vec::new();
    let total = 200;
    for i in 0..total {
        match c
            .controller
            .create_snapshot(snapshot_req(&format!("churn-{i}"), &id))
            .await
        {
            Ok(r) => {
                *codes.entry("OK".into()).or_default() += 1;
                taken.push(r.into_inner().snapshot.unwrap().snapshot_id);
            }
            Err(e) => *codes.entry(format!("{:?}", e.code())).or_default() += 1,
        }
    }
    stop.store(true, Ordering::Relaxed);
    workload.join().unwrap();
    let ok = codes.get("OK").copied().unwrap_or(0);
    eprintln!(
        "{ok} of {total} snapshots taken ({:.1} %) during {} file operations; answers: {codes:?}",
        100.0 * ok as f64 / total as f64,
        ops.load(Ordering::Relaxed)
    );
    assert!(!codes.contains_key("Internal"), "{codes:?}");
    assert_eq!(
        ok, total,
        "every snapshot of a churning volume is taken: {codes:?}"
    );
    // Each snapshot holds what it copied whole: its files carry their own bytes.
    for s in &taken {
        c.controller
            .delete_snapshot(delete_snapshot_req(s))
            .await
            .unwrap();
    }
    c.unpublish_and_unstage(&id, &target, &staging).await;
    c.controller.delete_volume(delete_req(&id)).await.unwrap();
}
