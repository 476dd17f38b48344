//! The controller side through the real binary: crash safety at every
//! failpoint of CreateVolume, DeleteVolume, ControllerExpandVolume and
//! ControllerModifyVolume on an xfs image pool and a btrfs subvolume pool; orphan
//! removal at start; 32 concurrent clients on 100 names; a table of bad inputs with
//! the codes of the CSI spec v1.14.0 and a check that nothing changed; real capacity;
//! name idempotency, GetCapacity, volume health, expansion, pagination and
//! ModifyVolume applied to a live loop device.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use csi_proto::csi::{
    self, controller_client::ControllerClient, volume_capability::access_mode::Mode,
};
use csi_storage::ids::VolumeId;
use tonic::transport::Channel;
use tonic::Code;

fn vid(name: &str) -> String {
    VolumeId::for_name(name).to_string()
}

fn map(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn list_req(max: i32, token: &str) -> csi::ListVolumesRequest {
    csi::ListVolumesRequest {
        max_entries: max,
        starting_token: token.to_string(),
    }
}

fn delete_req(id: &str) -> csi::DeleteVolumeRequest {
    csi::DeleteVolumeRequest {
        volume_id: id.to_string(),
        secrets: Default::default(),
    }
}

fn expand_req(id: &str, size: i64) -> csi::ControllerExpandVolumeRequest {
    csi::ControllerExpandVolumeRequest {
        volume_id: id.to_string(),
        capacity_range: csi_glue::capacity_at_least(size),
        ..Default::default()
    }
}

fn modify_req(id: &str, kv: &[(&str, &str)]) -> csi::ControllerModifyVolumeRequest {
    csi::ControllerModifyVolumeRequest {
        volume_id: id.to_string(),
        mutable_parameters: map(kv),
        ..Default::default()
    }
}

fn get_req(id: &str) -> csi::ControllerGetVolumeRequest {
    csi::ControllerGetVolumeRequest {
        volume_id: id.to_string(),
    }
}

/// Every volume ListVolumes reports, paging with `max` entries: (id, capacity).
async fn list_all(c: &mut Clients, max: i32) -> Vec<(String, i64)> {
    all_volumes(&c.controller, max)
        .await
        .into_iter()
        .map(|v| (v.volume_id, v.capacity_bytes))
        .collect()
}

/// The value of the extended attribute `name` on `path`, if set.
fn xattr(path: &Path, name: &str) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 256];
    // SAFETY: both strings are NUL-terminated and the buffer outlives the call.
    let len = unsafe {
        libc::getxattr(
            p.as_ptr(),
            n.as_ptr(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
        )
    };
    (len >= 0).then(|| String::from_utf8_lossy(&buf[..len as usize]).into_owned())
}

/// Every file or directory below `dir` whose name ends with `.tmp`.
/// Filesystem templates a pool's background worker makes (and, when cut short,
/// start-up removes) are the driver's cache, not an operation's leftovers:
/// tests/templates.rs checks them.
fn is_templates(p: &Path) -> bool {
    p.file_name().is_some_and(|n| n == ".templates")
}

fn temp_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if is_templates(&p) {
                continue;
            }
            if e.file_name().to_string_lossy().ends_with(".tmp") {
                out.push(p.clone());
            }
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(p);
            }
        }
    }
    out
}

/// A description of every entry below `dir`: files with size and mtime, directories
/// and symlinks by name (a directory's own mtime changes when an entry comes and
/// goes, which the entries themselves show).
fn tree(dir: &Path) -> BTreeMap<PathBuf, String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if is_templates(&p) {
                continue;
            }
            if m.is_dir() {
                out.insert(p.clone(), format!("dir {:o}", m.mode()));
                stack.push(p);
            } else {
                out.insert(
                    p,
                    format!(
                        "file {:o} {} {}.{}",
                        m.mode(),
                        m.len(),
                        m.mtime(),
                        m.mtime_nsec()
                    ),
                );
            }
        }
    }
    out
}

/// Top-level entries of a system directory with their mtimes.
fn shallow(dir: &Path) -> BTreeMap<String, i64> {
    use std::os::unix::fs::MetadataExt;
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if let Ok(m) = std::fs::symlink_metadata(e.path()) {
            out.insert(e.file_name().to_string_lossy().into_owned(), m.mtime());
        }
    }
    let m = std::fs::metadata(dir).unwrap();
    out.insert(".".into(), m.mtime());
    out
}

/// Paths (relative to the pool) of the btrfs subvolumes of the pool.
fn subvolumes(pool: &Pool) -> BTreeSet<String> {
    sh("btrfs", &["subvolume", "list", pool.path.to_str().unwrap()])
        .lines()
        .filter_map(|l| l.split(" path ").nth(1))
        .map(|s| s.trim().to_string())
        .collect()
}

/// The qgroup limit (max referenced) of a subvolume.
fn qgroup_limit(path: &Path) -> u64 {
    let out = sh(
        "btrfs",
        &["qgroup", "show", "-rf", "--raw", path.to_str().unwrap()],
    );
    let line = out
        .lines()
        .find(|l| l.starts_with("0/"))
        .unwrap_or_else(|| panic!("no qgroup line in {out}"));
    line.split_whitespace().nth(3).unwrap().parse().unwrap()
}

/// What a pool is expected to hold: the entry name in <pool>/volumes per id.
#[derive(Default)]
struct Expected {
    /// id -> (entry name in <pool>/volumes, size, is a btrfs subvolume)
    volumes: BTreeMap<String, (String, i64, bool)>,
}

impl Expected {
    fn add(&mut self, id: &str, kind: &str, size: i64, btrfs: bool) {
        let entry = if kind == "dir" {
            id.to_string()
        } else {
            format!("{id}.img")
        };
        self.volumes
            .insert(id.to_string(), (entry, size, btrfs && kind == "dir"));
    }
}

/// Checks ListVolumes, the pool and the state dir against what was acknowledged.
async fn verify(label: &str, c: &mut Clients, pool: &Pool, d: &Driver, exp: &Expected) {
    let listed: BTreeMap<String, i64> = list_all(c, 0).await.into_iter().collect();
    let want: BTreeMap<String, i64> = exp
        .volumes
        .iter()
        .map(|(id, (_, size, _))| (id.clone(), *size))
        .collect();
    assert_eq!(
        listed, want,
        "{label}: ListVolumes is exactly the acknowledged set"
    );
    let entries = names(&pool.path.join("volumes"));
    let want_entries: BTreeSet<String> = exp.volumes.values().map(|v| v.0.clone()).collect();
    assert_eq!(
        entries, want_entries,
        "{label}: <pool>/volumes holds exactly the acknowledged volumes (no leak, no temp)"
    );
    for (entry, size, _) in exp.volumes.values() {
        let p = pool.path.join("volumes").join(entry);
        if entry.ends_with(".img") {
            assert_eq!(
                std::fs::metadata(&p).unwrap().len() as i64,
                *size,
                "{label}: {entry} has the volume's size"
            );
        }
    }
    assert!(
        names(&pool.path.join("snapshots")).is_empty(),
        "{label}: no snapshot data"
    );
    let temps = temp_files(&d.state);
    assert!(
        temps.is_empty(),
        "{label}: temporary files in state dir: {temps:?}"
    );
    let temps = temp_files(&pool.path);
    assert!(
        temps.is_empty(),
        "{label}: temporary files in pool: {temps:?}"
    );
    if exp.volumes.values().any(|v| v.2) || pool_is_btrfs(pool) {
        let subs = subvolumes(pool);
        let want: BTreeSet<String> = exp
            .volumes
            .values()
            .filter(|v| v.2)
            .map(|v| format!("volumes/{}", v.0))
            .collect();
        assert_eq!(
            subs, want,
            "{label}: btrfs subvolumes are exactly the dir volumes"
        );
        for (entry, size, sub) in exp.volumes.values() {
            if *sub {
                assert_eq!(
                    qgroup_limit(&pool.path.join("volumes").join(entry)) as i64,
                    *size,
                    "{label}: qgroup limit of {entry}"
                );
            }
        }
    }
}

fn pool_is_btrfs(pool: &Pool) -> bool {
    sh("stat", &["-f", "-c", "%T", pool.path.to_str().unwrap()]).trim() == "btrfs"
}

const FAILPOINTS: &[&str] = &[
    "create-volume.before-data",
    "create-volume.after-copy",
    "create-volume.after-data",
    "create-volume.after-commit",
    "delete-volume.after-commit",
    "delete-volume.after-data",
    "expand-volume.after-intent",
    "expand-volume.after-grow",
    "modify-volume.after-attributes",
    "modify-volume.after-commit",
];

/// Restarts the driver with a failpoint armed.
async fn arm(d: &mut Driver, fp: &str) -> Clients {
    d.kill9();
    d.envs = vec![("EXAMPLE_CSI_FAILPOINTS".into(), fp.into())];
    d.spawn();
    d.clients().await
}

/// The call made with a failpoint armed must have killed the driver; start it again
/// without the failpoint.
async fn crashed<T: std::fmt::Debug>(
    d: &mut Driver,
    fp: &str,
    r: Result<T, tonic::Status>,
) -> Clients {
    assert!(r.is_err(), "{fp}: the call succeeded: {r:?}");
    assert!(
        d.wait_exit(60).is_some(),
        "{fp}: the driver did not die at the failpoint:\n{}",
        d.log_text()
    );
    d.envs.clear();
    d.spawn();
    d.clients().await
}

async fn crash_safety(fs: &str, kind: &str) {
    let pool = Pool::new(fs);
    let btrfs = fs == "btrfs";
    let mut d = Driver::start(&pool, &[]);
    let mut c = d.clients().await;
    let params = [("kind", kind)];
    let fs_cap = if kind == "dir" { "" } else { "ext4" };
    let cap = mount_cap(fs_cap, writer());
    let mut exp = Expected::default();

    // A source for clones, with some data in it when it is a directory.
    let base = must_create(
        &mut c.controller,
        create_req("base", 64 * MIB, cap.clone(), &params),
    )
    .await;
    exp.add(&base.volume_id, kind, 64 * MIB, btrfs);
    if kind == "dir" {
        std::fs::write(
            pool.path.join("volumes").join(&base.volume_id).join("data"),
            b"base data",
        )
        .unwrap();
    }
    verify("start", &mut c, &pool, &d, &exp).await;

    for fp in FAILPOINTS {
        let label = format!("{fs}/{kind} {fp}");
        let name = format!("crash-{fp}");
        let id = vid(&name);
        match fp.split('.').next().unwrap() {
            "create-volume" => {
                let mut req = create_req(&name, 64 * MIB, cap.clone(), &params);
                if *fp == "create-volume.after-copy" {
                    req.volume_content_source = Some(csi::VolumeContentSource {
                        r#type: Some(csi::volume_content_source::Type::Volume(
                            csi::volume_content_source::VolumeSource {
                                volume_id: base.volume_id.clone(),
                            },
                        )),
                    });
                }
                let mut cc = arm(&mut d, fp).await;
                let r = cc.controller.create_volume(req.clone()).await;
                c = crashed(&mut d, fp, r).await;
                let v = c
                    .controller
                    .create_volume(req.clone())
                    .await
                    .unwrap_or_else(|e| panic!("{label}: retry failed: {e}"))
                    .into_inner()
                    .volume
                    .unwrap();
                assert_eq!(v.volume_id, id, "{label}: same id on retry");
                assert_eq!(v.capacity_bytes, 64 * MIB, "{label}");
                // A second retry is still the same volume.
                let again = must_create(&mut c.controller, req).await;
                assert_eq!(again.volume_id, id, "{label}: idempotent");
                exp.add(&id, kind, 64 * MIB, btrfs);
                if kind == "dir" && *fp == "create-volume.after-copy" {
                    assert_eq!(
                        std::fs::read(pool.path.join("volumes").join(&id).join("data")).unwrap(),
                        b"base data",
                        "{label}: the clone holds the source's data"
                    );
                }
            }
            "delete-volume" => {
                c.controller
                    .create_volume(create_req(&name, 64 * MIB, cap.clone(), &params))
                    .await
                    .unwrap();
                exp.add(&id, kind, 64 * MIB, btrfs);
                verify(&format!("{label} before"), &mut c, &pool, &d, &exp).await;
                let mut cc = arm(&mut d, fp).await;
                let r = cc.controller.delete_volume(delete_req(&id)).await;
                c = crashed(&mut d, fp, r).await;
                c.controller
                    .delete_volume(delete_req(&id))
                    .await
                    .unwrap_or_else(|e| panic!("{label}: retry failed: {e}"));
                exp.volumes.remove(&id);
            }
            "expand-volume" => {
                c.controller
                    .create_volume(create_req(&name, 64 * MIB, cap.clone(), &params))
                    .await
                    .unwrap();
                exp.add(&id, kind, 64 * MIB, btrfs);
                let mut cc = arm(&mut d, fp).await;
                let r = cc
                    .controller
                    .controller_expand_volume(expand_req(&id, 96 * MIB))
                    .await;
                c = crashed(&mut d, fp, r).await;
                let r = c
                    .controller
                    .controller_expand_volume(expand_req(&id, 96 * MIB))
                    .await
                    .unwrap_or_else(|e| panic!("{label}: retry failed: {e}"))
                    .into_inner();
                assert_eq!(r.capacity_bytes, 96 * MIB, "{label}");
                assert_eq!(r.node_expansion_required, kind == "image", "{label}");
                exp.add(&id, kind, 96 * MIB, btrfs);
            }
            "modify-volume" => {
                // Mutable parameters mean something for loop-backed volumes only.
                let img = [("kind", "image")];
                c.controller
                    .create_volume(create_req(
                        &name,
                        64 * MIB,
                        mount_cap("ext4", writer()),
                        &img,
                    ))
                    .await
                    .unwrap();
                exp.add(&id, "image", 64 * MIB, btrfs);
                let mut cc = arm(&mut d, fp).await;
                let r = cc
                    .controller
                    .controller_modify_volume(modify_req(&id, &[("directIO", "true")]))
                    .await;
                c = crashed(&mut d, fp, r).await;
                c.controller
                    .controller_modify_volume(modify_req(&id, &[("directIO", "true")]))
                    .await
                    .unwrap_or_else(|e| panic!("{label}: retry failed: {e}"));
                let image = pool.path.join("volumes").join(format!("{id}.img"));
                assert_eq!(
                    xattr(&image, "user.example-csi.directIO").as_deref(),
                    Some("true"),
                    "{label}: directIO recorded on the image"
                );
                let v = c
                    .controller
                    .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                        volume_id: id.clone(),
                        volume_capabilities: vec![mount_cap("ext4", writer())],
                        mutable_parameters: map(&[("directIO", "true")]),
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert!(
                    v.confirmed.is_some(),
                    "{label}: the record holds directIO=true: {}",
                    v.message
                );
            }
            other => panic!("no scenario for {other}"),
        }
        verify(&label, &mut c, &pool, &d, &exp).await;
    }

    // Everything is deleted in the end, and the pool is empty.
    for id in exp.volumes.keys().cloned().collect::<Vec<_>>() {
        c.controller.delete_volume(delete_req(&id)).await.unwrap();
        exp.volumes.remove(&id);
    }
    verify("all deleted", &mut c, &pool, &d, &exp).await;
    let log = d.log_text();
    assert!(!log.contains("panicked"), "the driver panicked:\n{log}");
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_crash_at_every_failpoint_xfs_image() {
    require_root();
    crash_safety("xfs", "image").await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_crash_at_every_failpoint_btrfs_dir() {
    require_root();
    crash_safety("btrfs", "dir").await;
}

async fn orphans_removed(fs: &str) {
    let pool = Pool::new(fs);
    let mut d = Driver::start(&pool, &[]);
    let mut c = d.clients().await;
    let keep = must_create(
        &mut c.controller,
        create_req("keep", 16 * MIB, mount_cap("ext4", writer()), &[]),
    )
    .await;
    let keep_dir = c.create_dir("keep-dir", 16 * MIB).await;
    drop(c);
    let t = std::time::Instant::now();
    d.stop();
    eprintln!("SIGTERM stop took {:?}", t.elapsed());
    let vols = pool.path.join("volumes");
    let orphan_img = vols.join(format!("{}.img", uuid::Uuid::new_v4()));
    sh("truncate", &["-s", "16M", orphan_img.to_str().unwrap()]);
    std::fs::write(vols.join(".x.tmp"), b"half").unwrap();
    std::fs::write(vols.join(format!(".{}.img.tmp", keep.volume_id)), b"half").unwrap();
    let orphan_dir = vols.join(uuid::Uuid::new_v4().to_string());
    if fs == "btrfs" {
        sh(
            "btrfs",
            &["subvolume", "create", orphan_dir.to_str().unwrap()],
        );
    } else {
        std::fs::create_dir(&orphan_dir).unwrap();
    }
    std::fs::write(orphan_dir.join("f"), b"x").unwrap();
    let state_tmp = d.state.join("controller/volumes").join(".x.tmp");
    std::fs::write(&state_tmp, b"{").unwrap();

    d.spawn();
    let mut c = d.clients().await;
    let mut exp = Expected::default();
    exp.add(&keep.volume_id, "image", 16 * MIB, fs == "btrfs");
    exp.add(&keep_dir, "dir", 16 * MIB, fs == "btrfs");
    verify(&format!("{fs} orphans"), &mut c, &pool, &d, &exp).await;
    assert!(!orphan_img.exists() && !orphan_dir.exists() && !state_tmp.exists());
    let log = d.log_text();
    assert!(
        log.contains(&orphan_img.display().to_string()),
        "the removal is logged:\n{log}"
    );
    for id in [&keep.volume_id, &keep_dir] {
        c.controller.delete_volume(delete_req(id)).await.unwrap();
    }
    assert!(names(&vols).is_empty());
}

// Multi-threaded: the client's connection task must run while the test thread waits
// for the driver to stop, or the driver's graceful stop waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_orphans_and_temporaries_are_removed_at_start() {
    require_root();
    orphans_removed("xfs").await;
    orphans_removed("btrfs").await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_32_clients_on_100_names() {
    require_root();
    let pool = Pool::new("xfs");
    let d = Driver::start(&pool, &[]);
    let c = d.clients().await;
    let names: Vec<String> = (0..100).map(|i| format!("pvc-conc-{i:03}")).collect();
    let started = std::time::Instant::now();
    let (errors, aborted) = on_32_clients(&c, &names, |mut ctl, name| async move {
        let v = ctl
            .create_volume(create_req(
                &name,
                16 * MIB,
                mount_cap("ext4", writer()),
                &[],
            ))
            .await?
            .into_inner()
            .volume
            .unwrap();
        Ok((v.volume_id != vid(&name)).then(|| format!("{name}: id {}", v.volume_id)))
    })
    .await;
    assert!(errors.is_empty(), "errors other than ABORTED: {errors:?}");
    eprintln!(
        "32 clients x 100 names created in {:?} ({aborted} ABORTED answers)",
        started.elapsed()
    );
    let mut cc = c.clone_clients();
    let listed = list_all(&mut cc, 0).await;
    assert_eq!(listed.len(), 100, "exactly 100 volumes");
    let want: BTreeSet<String> = names.iter().map(|n| vid(n)).collect();
    let got: BTreeSet<String> = listed.into_iter().map(|v| v.0).collect();
    assert_eq!(got, want);
    assert_eq!(names_in(&pool).len(), 100);

    let started = std::time::Instant::now();
    let ids: Vec<String> = names.iter().map(|n| vid(n)).collect();
    let (errors, _) = on_32_clients(&c, &ids, |mut ctl, id| async move {
        ctl.delete_volume(delete_req(&id)).await?;
        Ok(None)
    })
    .await;
    assert!(errors.is_empty(), "errors other than ABORTED: {errors:?}");
    eprintln!("deleted concurrently in {:?}", started.elapsed());
    assert!(list_all(&mut cc, 0).await.is_empty());
    assert!(names_in(&pool).is_empty(), "the pool is empty");
    assert!(temp_files(&d.state).is_empty());
    assert!(
        csi_storage::core::store::read_raw(&d.state.join("controller/volumes"))
            .unwrap()
            .is_empty(),
        "no records left"
    );
}

/// Makes `call` for every key from 32 clients at once, all walking the keys in
/// the same order (half of them backwards) so that they collide on the same key
/// at the same time; a call answered ABORTED is made again. Gives what went wrong
/// otherwise (an error, or what `call` found wrong in an answer) and the number of
/// ABORTED answers.
async fn on_32_clients<F, Fut>(c: &Clients, keys: &[String], call: F) -> (Vec<String>, u32)
where
    F: Fn(ControllerClient<Channel>, String) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<Option<String>, tonic::Status>> + Send,
{
    let mut tasks = Vec::new();
    for t in 0..32 {
        let ctl = c.controller.clone();
        let keys = keys.to_vec();
        let call = call.clone();
        tasks.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            let mut aborted = 0u32;
            for k in 0..keys.len() {
                let key = &keys[if t % 2 == 0 { k } else { keys.len() - 1 - k }];
                loop {
                    match call(ctl.clone(), key.clone()).await {
                        Ok(wrong) => {
                            errors.extend(wrong);
                            break;
                        }
                        Err(s) if s.code() == Code::Aborted => {
                            aborted += 1;
                            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                        }
                        Err(s) => {
                            errors.push(format!("{key}: {:?} {}", s.code(), s.message()));
                            break;
                        }
                    }
                }
            }
            (errors, aborted)
        }));
    }
    let mut errors = Vec::new();
    let mut aborted = 0;
    for t in tasks {
        let (e, a) = t.await.unwrap();
        errors.extend(e);
        aborted += a;
    }
    (errors, aborted)
}

fn names_in(pool: &Pool) -> BTreeSet<String> {
    names(&pool.path.join("volumes"))
}

trait CloneClients {
    fn clone_clients(&self) -> Clients;
}

impl CloneClients for Clients {
    fn clone_clients(&self) -> Clients {
        Clients {
            identity: self.identity.clone(),
            controller: self.controller.clone(),
            node: self.node.clone(),
            group: self.group.clone(),
        }
    }
}

fn cap_mode(mode: Mode) -> csi::VolumeCapability {
    mount_cap("ext4", mode)
}

/// Records a failure when a call does not end with the expected code.
macro_rules! expect {
    ($fails:expr, $label:expr, $call:expr, $code:expr) => {{
        let r = $call.await;
        let got = match &r {
            Ok(_) => Code::Ok,
            Err(s) => s.code(),
        };
        if got != $code {
            $fails.push(format!(
                "{}: want {:?}, got {:?} {}",
                $label,
                $code,
                got,
                r.as_ref()
                    .err()
                    .map(|s| s.message().to_string())
                    .unwrap_or_default()
            ));
        }
        r.err()
    }};
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_bad_inputs_get_spec_codes_and_change_nothing() {
    require_root();
    let pool = Pool::new("xfs");
    let d = Driver::start(&pool, &["--enable-attach"]);
    let mut c = d.clients().await;
    let cap = mount_cap("ext4", writer());
    let good = c.create("good", 64 * MIB, cap.clone(), &[]).await;
    let published = c.create("published", 64 * MIB, cap.clone(), &[]).await;
    let publish = |vol: &str, node: &str, ro: bool| csi::ControllerPublishVolumeRequest {
        volume_id: vol.to_string(),
        node_id: node.to_string(),
        volume_capability: Some(mount_cap("ext4", writer())),
        readonly: ro,
        ..Default::default()
    };
    c.controller
        .controller_publish_volume(publish(&published, "test-node", false))
        .await
        .unwrap();

    let watched = [
        pool.path.clone(),
        d.state.clone(),
        pool.dir.path().join("scratch"),
    ];
    let before: Vec<_> = watched.iter().map(|p| tree(p)).collect();
    let sys_before: Vec<_> = ["/etc", "/", "/tmp", "/dev"]
        .iter()
        .map(|p| shallow(Path::new(p)))
        .collect();
    let top_before = names(pool.dir.path());

    let mut f: Vec<String> = Vec::new();
    let ctl = &mut c.controller;
    let invalid = Code::InvalidArgument;
    // Every request has its own name, so that one wrongly accepted cannot mask the
    // answer to the next as ALREADY_EXISTS.
    let serial = std::cell::Cell::new(0);
    let fresh = || {
        serial.set(serial.get() + 1);
        format!("bad-{}", serial.get())
    };
    let base = || create_req(&fresh(), 64 * MIB, mount_cap("ext4", writer()), &[]);

    // CreateVolume
    let mut r = base();
    r.name = "a\0b".into();
    expect!(f, "create: NUL in name", ctl.create_volume(r), invalid);
    let mut r = base();
    r.name = "x".repeat(10 * 1024);
    expect!(f, "create: 10 KiB name", ctl.create_volume(r), invalid);
    let mut r = base();
    r.name = String::new();
    expect!(f, "create: empty name", ctl.create_volume(r), invalid);
    for (label, req, lim, code) in [
        ("negative required", -1, 0, invalid),
        ("negative limit", 0, -1, invalid),
        ("i64::MAX required", i64::MAX, 0, Code::OutOfRange),
        ("required > limit", 64 * MIB, 32 * MIB, invalid),
        ("limit below ext4 minimum", 0, 4096, Code::OutOfRange),
    ] {
        let mut r = base();
        r.capacity_range = Some(csi::CapacityRange {
            required_bytes: req,
            limit_bytes: lim,
        });
        expect!(f, format!("create: {label}"), ctl.create_volume(r), code);
    }
    let mut r = create_req(
        &fresh(),
        i64::MAX,
        mount_cap("", writer()),
        &[("kind", "dir")],
    );
    r.capacity_range.as_mut().unwrap().required_bytes = i64::MAX;
    expect!(
        f,
        "create: i64::MAX dir volume",
        ctl.create_volume(r),
        Code::OutOfRange
    );
    let mut r = base();
    r.volume_capabilities.clear();
    expect!(f, "create: no capabilities", ctl.create_volume(r), invalid);
    let mut r = base();
    r.volume_capabilities[0].access_type = None;
    expect!(
        f,
        "create: capability without access type",
        ctl.create_volume(r),
        invalid
    );
    let mut r = base();
    r.volume_capabilities[0].access_mode = None;
    expect!(
        f,
        "create: capability without access mode",
        ctl.create_volume(r),
        invalid
    );
    for mode in [
        Mode::MultiNodeMultiWriter,
        Mode::MultiNodeReaderOnly,
        Mode::MultiNodeSingleWriter,
    ] {
        let mut r = base();
        r.volume_capabilities = vec![cap_mode(mode)];
        let res = expect!(
            f,
            format!("create: {mode:?}"),
            ctl.create_volume(r),
            invalid
        );
        if let Some(s) = res {
            if !s.message().contains("local") {
                f.push(format!(
                    "create {mode:?}: message does not say local: {}",
                    s.message()
                ));
            }
        }
    }
    let mut r = base();
    r.volume_capabilities = vec![mount_cap("zfs", writer())];
    expect!(f, "create: unknown fs_type", ctl.create_volume(r), invalid);
    let mut r = base();
    if let Some(csi::volume_capability::AccessType::Mount(m)) =
        r.volume_capabilities[0].access_type.as_mut()
    {
        m.mount_flags = vec!["suid".into()];
    }
    expect!(f, "create: mount flag suid", ctl.create_volume(r), invalid);
    for (label, params) in [
        ("unknown parameter", vec![("foo", "bar")]),
        ("unknown pool", vec![("type", "nope")]),
        ("path-like pool", vec![("type", "../etc")]),
        ("unknown kind", vec![("kind", "lvm")]),
    ] {
        let r = create_req(&fresh(), 64 * MIB, mount_cap("ext4", writer()), &params);
        expect!(f, format!("create: {label}"), ctl.create_volume(r), invalid);
    }
    for kv in [
        [("foo", "1")],
        [("directIO", "yes")],
        [("readAheadKiB", "x")],
    ] {
        let mut r = base();
        r.mutable_parameters = map(&kv);
        expect!(
            f,
            format!("create: mutable {kv:?}"),
            ctl.create_volume(r),
            invalid
        );
    }
    let r = create_req(&fresh(), 64 * MIB, block_cap(writer()), &[("kind", "dir")]);
    expect!(
        f,
        "create: kind=dir with block",
        ctl.create_volume(r),
        invalid
    );
    let mut r = base();
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![csi::Topology {
            segments: map(&[("topology.example.csi/node", "other-node")]),
        }],
        preferred: vec![],
    });
    expect!(
        f,
        "create: requisite topology excludes this node",
        ctl.create_volume(r),
        Code::ResourceExhausted
    );
    let snap_src = |id: &str| csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: id.into(),
            },
        )),
    };
    let vol_src = |id: &str| csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: id.into(),
            },
        )),
    };
    for (label, src) in [
        (
            "unknown snapshot source",
            snap_src(&uuid::Uuid::new_v4().to_string()),
        ),
        ("path-like snapshot source", snap_src("../x")),
        (
            "unknown volume source",
            vol_src(&uuid::Uuid::new_v4().to_string()),
        ),
        ("path-like volume source", vol_src("/etc")),
    ] {
        let mut r = base();
        r.volume_content_source = Some(src);
        expect!(
            f,
            format!("create: {label}"),
            ctl.create_volume(r),
            Code::NotFound
        );
    }
    let mut r = base();
    r.volume_content_source = Some(vol_src(&good));
    r.capacity_range = Some(csi::CapacityRange {
        required_bytes: 16 * MIB,
        limit_bytes: 32 * MIB,
    });
    expect!(
        f,
        "create: limit smaller than the source",
        ctl.create_volume(r),
        Code::OutOfRange
    );
    let r = create_req("good", 128 * MIB, mount_cap("ext4", writer()), &[]);
    expect!(
        f,
        "create: same name, bigger size",
        ctl.create_volume(r),
        Code::AlreadyExists
    );
    let r = create_req("good", 64 * MIB, block_cap(writer()), &[]);
    expect!(
        f,
        "create: same name, block",
        ctl.create_volume(r),
        Code::AlreadyExists
    );

    // DeleteVolume
    for id in ["../x", "/etc", "a/b", "..", "x\0y", &"v".repeat(10 * 1024)] {
        expect!(
            f,
            format!("delete {:.20?}", id),
            ctl.delete_volume(delete_req(id)),
            Code::Ok
        );
    }
    expect!(
        f,
        "delete: empty id",
        ctl.delete_volume(delete_req("")),
        invalid
    );
    expect!(
        f,
        "delete: published volume",
        ctl.delete_volume(delete_req(&published)),
        Code::FailedPrecondition
    );

    // ControllerPublishVolume
    expect!(
        f,
        "publish: unknown node",
        ctl.controller_publish_volume(publish(&good, "no-such-node", false)),
        Code::NotFound
    );
    expect!(
        f,
        "publish: to a second node",
        ctl.controller_publish_volume(publish(&published, "other-node", false)),
        Code::FailedPrecondition
    );
    expect!(
        f,
        "publish: again with another readonly flag",
        ctl.controller_publish_volume(publish(&published, "test-node", true)),
        Code::AlreadyExists
    );
    for id in ["../x", "/etc", &uuid::Uuid::new_v4().to_string()] {
        expect!(
            f,
            format!("publish: volume {id}"),
            ctl.controller_publish_volume(publish(id, "test-node", false)),
            Code::NotFound
        );
    }
    let mut r = publish(&good, "test-node", false);
    r.volume_capability = None;
    expect!(
        f,
        "publish: no capability",
        ctl.controller_publish_volume(r),
        invalid
    );

    // ListVolumes
    expect!(
        f,
        "list: foreign token",
        ctl.list_volumes(list_req(0, "foreign")),
        Code::Aborted
    );
    expect!(
        f,
        "list: path token",
        ctl.list_volumes(list_req(0, "../x")),
        Code::Aborted
    );
    expect!(
        f,
        "list: negative max",
        ctl.list_volumes(list_req(-1, "")),
        invalid
    );

    // ControllerModifyVolume
    for (label, kv) in [
        ("unknown parameter", vec![("foo", "1")]),
        ("invalid directIO", vec![("directIO", "maybe")]),
        (
            "valid and invalid",
            vec![("directIO", "true"), ("readAheadKiB", "-1")],
        ),
        (
            "valid and unknown",
            vec![("directIO", "true"), ("bar", "1")],
        ),
    ] {
        expect!(
            f,
            format!("modify: {label}"),
            ctl.controller_modify_volume(modify_req(&good, &kv)),
            invalid
        );
    }
    for id in ["../x", "/etc", &uuid::Uuid::new_v4().to_string()] {
        expect!(
            f,
            format!("modify: volume {id}"),
            ctl.controller_modify_volume(modify_req(id, &[("directIO", "true")])),
            Code::NotFound
        );
    }

    // ValidateVolumeCapabilities, ControllerGetVolume, ControllerExpandVolume
    for id in ["../x", "/etc", &uuid::Uuid::new_v4().to_string()] {
        expect!(
            f,
            format!("validate: volume {id}"),
            ctl.validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: id.to_string(),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            }),
            Code::NotFound
        );
        expect!(
            f,
            format!("get: volume {id}"),
            ctl.controller_get_volume(get_req(id)),
            Code::NotFound
        );
        expect!(
            f,
            format!("expand: volume {id}"),
            ctl.controller_expand_volume(expand_req(id, 128 * MIB)),
            Code::NotFound
        );
    }
    expect!(
        f,
        "validate: no capabilities",
        ctl.validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
            volume_id: good.clone(),
            ..Default::default()
        }),
        invalid
    );
    expect!(
        f,
        "expand: i64::MAX",
        ctl.controller_expand_volume(expand_req(&good, i64::MAX)),
        Code::OutOfRange
    );
    expect!(
        f,
        "expand: negative",
        ctl.controller_expand_volume(expand_req(&good, -5)),
        invalid
    );

    let after: Vec<_> = watched.iter().map(|p| tree(p)).collect();
    for (w, (b, a)) in watched.iter().zip(before.iter().zip(after.iter())) {
        if b != a {
            let changed: Vec<_> = b
                .iter()
                .filter(|(k, v)| a.get(*k) != Some(v))
                .map(|(k, _)| k.clone())
                .chain(a.keys().filter(|k| !b.contains_key(*k)).cloned())
                .collect();
            f.push(format!("{} changed: {changed:?}", w.display()));
        }
    }
    let sys_after: Vec<_> = ["/etc", "/", "/tmp", "/dev"]
        .iter()
        .map(|p| shallow(Path::new(p)))
        .collect();
    // /tmp and /dev see other tests' and engineers' activity: only /etc and / must be
    // exactly as they were; in /tmp and /dev look for names a bad id could make.
    for (i, p) in ["/etc", "/"].iter().enumerate() {
        if sys_before[i] != sys_after[i] {
            f.push(format!("{p} changed"));
        }
    }
    for p in ["/tmp", "/dev", "/etc"] {
        for bad in ["x", "a", "b", "bad", "good"] {
            if Path::new(p).join(bad).exists() && !sys_before[0].contains_key(bad) {
                f.push(format!("{p}/{bad} exists"));
            }
        }
    }
    assert_eq!(
        top_before,
        names(pool.dir.path()),
        "the test dir gained entries"
    );
    let image = pool.path.join("volumes").join(format!("{good}.img"));
    for attr in ["directIO", "readAheadKiB", "bar", "foo"] {
        if let Some(v) = xattr(&image, &format!("user.example-csi.{attr}")) {
            f.push(format!("a refused ModifyVolume left {attr}={v}"));
        }
    }
    let v = c
        .controller
        .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
            volume_id: good.clone(),
            volume_capabilities: vec![cap.clone()],
            mutable_parameters: map(&[("directIO", "true")]),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    if v.confirmed.is_some() {
        f.push("a refused ModifyVolume changed the record".into());
    }
    let log = d.log_text();
    if log.contains("panicked") {
        f.push("the driver panicked".into());
    }
    assert!(f.is_empty(), "{} failures:\n{}", f.len(), f.join("\n"));

    // Path-like names are just names: the volume is a UUID inside the pool.
    for name in ["../x", "/etc", "a/b", "..", "/etc/passwd"] {
        let v = c
            .controller
            .create_volume(create_req(name, 16 * MIB, cap.clone(), &[]))
            .await
            .unwrap_or_else(|e| panic!("create {name:?}: {e}"))
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(v.volume_id, vid(name));
        assert!(pool
            .path
            .join("volumes")
            .join(format!("{}.img", v.volume_id))
            .is_file());
        c.controller
            .delete_volume(delete_req(&v.volume_id))
            .await
            .unwrap();
    }
    assert_eq!(sys_before[0], shallow(Path::new("/etc")), "/etc changed");
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: published.clone(),
            node_id: "test-node".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    for id in [&good, &published] {
        c.controller.delete_volume(delete_req(id)).await.unwrap();
    }
    assert!(names_in(&pool).is_empty());
}

/// Writes 1 MiB blocks to `path` until a write fails; returns the MiB written and the
/// error.
fn fill(path: &Path, max_mib: usize) -> (usize, Option<std::io::Error>) {
    use std::io::Write;
    let mut file = std::fs::File::create(path).unwrap();
    let block = vec![0xa5u8; MIB as usize];
    for i in 0..max_mib {
        if let Err(e) = file.write_all(&block) {
            return (i, Some(e));
        }
    }
    match file.sync_all() {
        Ok(()) => (max_mib, None),
        Err(e) => (max_mib, Some(e)),
    }
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_64_mib_image_refuses_the_65th_mib() {
    require_root();
    let pool = Pool::new("xfs");
    let d = Driver::start(&pool, &[]);
    let mut c = d.clients().await;
    let cap = mount_cap("ext4", writer());
    let v = must_create(
        &mut c.controller,
        create_req("cap64", 64 * MIB, cap.clone(), &[]),
    )
    .await;
    assert_eq!(v.capacity_bytes, 64 * MIB);
    let id = v.volume_id;
    let staging = pool.scratch("staging");
    let target = pool.scratch("pods").join("target");
    c.stage_and_publish(&id, &staging, &target, &cap).await;
    let (written, err) = fill(&target.join("fill"), 80);
    eprintln!("64 MiB ext4 volume took {written} MiB before {err:?}");
    let err = err.expect("writing 80 MiB into a 64 MiB volume must fail");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert!(written < 65, "{written} MiB fit in a 64 MiB volume");
    assert!(written >= 48, "only {written} MiB fit in a 64 MiB volume");
    c.unpublish_and_unstage(&id, &target, &staging).await;
    c.controller.delete_volume(delete_req(&id)).await.unwrap();
    assert!(names_in(&pool).is_empty());
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_names_capacity_health_expand_list_modify() {
    require_root();
    let pool = Pool::new("xfs");
    let mut d = Driver::start(&pool, &[]);
    let mut c = d.clients().await;
    let cap = mount_cap("ext4", writer());
    let create = |name: &str, size: i64| create_req(name, size, mount_cap("ext4", writer()), &[]);

    // Name idempotency.
    let a = c
        .controller
        .create_volume(create("idem", 64 * MIB))
        .await
        .unwrap();
    let b = c
        .controller
        .create_volume(create("idem", 64 * MIB))
        .await
        .unwrap();
    let (a, b) = (
        a.into_inner().volume.unwrap(),
        b.into_inner().volume.unwrap(),
    );
    assert_eq!(a.volume_id, b.volume_id);
    assert_eq!(a.volume_id, vid("idem"));
    assert_eq!(a.capacity_bytes, b.capacity_bytes);
    assert_eq!(
        a.accessible_topology[0]
            .segments
            .get("topology.example.csi/node"),
        Some(&"test-node".to_string())
    );
    let e = c
        .controller
        .create_volume(create("idem", 128 * MIB))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    let idem = a.volume_id;

    // CreateVolume takes mutable parameters too; they are kept on the image.
    let mut r = create("mutable", 16 * MIB);
    r.mutable_parameters = map(&[("directIO", "true"), ("readAheadKiB", "256")]);
    let m = c.controller.create_volume(r).await.unwrap();
    let m = m.into_inner().volume.unwrap().volume_id;
    let mimg = pool.path.join("volumes").join(format!("{m}.img"));
    assert_eq!(
        xattr(&mimg, "user.example-csi.directIO").as_deref(),
        Some("true")
    );
    assert_eq!(
        xattr(&mimg, "user.example-csi.readAheadKiB").as_deref(),
        Some("256")
    );
    c.controller.delete_volume(delete_req(&m)).await.unwrap();

    // GetCapacity reflects the pool, and is 0 for another node's topology.
    let gc = |topo: Option<&str>| csi::GetCapacityRequest {
        volume_capabilities: vec![mount_cap("ext4", writer())],
        parameters: BTreeMap::new(),
        accessible_topology: topo.map(|n| csi::Topology {
            segments: map(&[("topology.example.csi/node", n)]),
        }),
    };
    let mine = c
        .controller
        .get_capacity(gc(Some("test-node")))
        .await
        .unwrap()
        .into_inner();
    let s = nix::sys::statvfs::statvfs(&pool.path).unwrap();
    let free = (s.blocks_available() * s.fragment_size()) as i64;
    assert!(
        (mine.available_capacity - free).abs() < 64 * MIB,
        "GetCapacity {} vs statvfs {free}",
        mine.available_capacity
    );
    assert!(mine.maximum_volume_size.unwrap() > 0);
    let none = c
        .controller
        .get_capacity(gc(None))
        .await
        .unwrap()
        .into_inner();
    assert!(none.available_capacity > 0);
    let other = c
        .controller
        .get_capacity(gc(Some("other-node")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(other.available_capacity, 0);

    // A class CreateVolume refuses (here a pool this node lacks) is not kept
    // from CreateVolume by its capacity: Kubernetes' scheduler would keep its
    // claims from every node, and CreateVolume's refusal, which names the cause,
    // would never reach them.
    let mut unknown = gc(Some("test-node"));
    unknown.parameters = map(&[("type", "nvme-does-not-exist")]);
    let answer = c
        .controller
        .get_capacity(unknown.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.available_capacity, i64::MAX);
    assert_eq!(answer.maximum_volume_size, Some(i64::MAX));
    unknown.accessible_topology = gc(Some("other-node")).accessible_topology;
    let elsewhere = c
        .controller
        .get_capacity(unknown)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(elsewhere.available_capacity, 0);
    let refused = c
        .controller
        .create_volume(create_req(
            "pvc-unknown-pool",
            64 * MIB,
            mount_cap("ext4", writer()),
            &[("type", "nvme-does-not-exist")],
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    for named in ["nvme-does-not-exist", "test-node", "default"] {
        assert!(refused.message().contains(named), "{}", refused.message());
    }

    // Volume health: the image deleted or truncated behind the driver's back.
    let gone = c
        .controller
        .create_volume(create("gone", 32 * MIB))
        .await
        .unwrap();
    let gone = gone.into_inner().volume.unwrap().volume_id;
    let short = c
        .controller
        .create_volume(create("short", 32 * MIB))
        .await
        .unwrap();
    let short = short.into_inner().volume.unwrap().volume_id;
    let healthy = controller_health(&mut c, &gone).await;
    assert_eq!(healthy.volume_id, gone);
    assert_eq!(health_reasons(&healthy), vec![]);
    let list_health = |max: i32, token: &str| csi::ControllerListVolumeHealthRequest {
        max_entries: max,
        starting_token: token.to_string(),
        ..Default::default()
    };
    let none = c
        .controller
        .controller_list_volume_health(list_health(0, ""))
        .await
        .unwrap()
        .into_inner();
    assert!(none.entries.is_empty(), "{none:?}");
    std::fs::remove_file(pool.path.join("volumes").join(format!("{gone}.img"))).unwrap();
    sh(
        "truncate",
        &[
            "-s",
            "1M",
            pool.path
                .join("volumes")
                .join(format!("{short}.img"))
                .to_str()
                .unwrap(),
        ],
    );
    use csi::VolumeHealthErrorType as H;
    let expected = BTreeMap::from([
        (
            gone.clone(),
            vec![(H::Inaccessible, "ImageMissing".to_string())],
        ),
        (
            short.clone(),
            vec![(H::DataLoss, "ImageTruncated".to_string())],
        ),
    ]);
    for (id, reasons) in &expected {
        let h = controller_health(&mut c, id).await;
        assert_eq!(&health_reasons(&h), reasons, "{h:?}");
        assert!(h.health_statuses[0].message.contains(id.as_str()), "{h:?}");
    }
    // ControllerListVolumeHealth lists exactly those, one page at a time.
    let mut listed = BTreeMap::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = c
            .controller
            .controller_list_volume_health(list_health(1, &token))
            .await
            .unwrap()
            .into_inner();
        assert!(page.entries.len() <= 1, "{page:?}");
        for e in &page.entries {
            listed.insert(e.volume_id.clone(), health_reasons(e));
        }
        pages += 1;
        token = page.next_token;
        if token.is_empty() {
            break;
        }
    }
    assert_eq!(listed, expected);
    assert_eq!(pages, 2);
    assert_eq!(
        c.controller
            .controller_list_volume_health(list_health(0, "not-a-token"))
            .await
            .unwrap_err()
            .code(),
        Code::Aborted
    );
    for id in [&gone, &short] {
        c.controller.delete_volume(delete_req(id)).await.unwrap();
    }

    // ControllerExpandVolume grows the image file.
    let img = pool.path.join("volumes").join(format!("{idem}.img"));
    let r = c
        .controller
        .controller_expand_volume(expand_req(&idem, 100 * MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 100 * MIB);
    assert!(r.node_expansion_required);
    assert_eq!(std::fs::metadata(&img).unwrap().len() as i64, 100 * MIB);
    for smaller in [100 * MIB, 64 * MIB] {
        let r = c
            .controller
            .controller_expand_volume(expand_req(&idem, smaller))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.capacity_bytes, 100 * MIB, "never shrinks");
    }
    assert_eq!(std::fs::metadata(&img).unwrap().len() as i64, 100 * MIB);

    // A plain directory on xfs: the size is recorded (not enforced), and survives a
    // restart.
    let dir = c.create_dir("plain", 10 * MIB).await;
    assert!(pool.path.join("volumes").join(&dir).is_dir());
    let r = c
        .controller
        .controller_expand_volume(expand_req(&dir, 20 * MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 20 * MIB);
    assert!(!r.node_expansion_required);
    d.restart();
    c = d.clients().await;
    let got = c
        .controller
        .controller_get_volume(get_req(&dir))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 20 * MIB);

    // Pagination: stable order, every volume exactly once.
    for i in 0..7 {
        c.controller
            .create_volume(create(&format!("page-{i}"), 16 * MIB))
            .await
            .unwrap();
    }
    let all = list_all(&mut c, 0).await;
    assert_eq!(all.len(), 9);
    let mut sorted = all.clone();
    sorted.sort();
    assert_eq!(all, sorted, "ListVolumes is in a stable (id) order");
    for max in [1, 2, 3, 4, 8, 9, 10] {
        assert_eq!(list_all(&mut c, max).await, all, "pages of {max}");
    }
    let first = c
        .controller
        .list_volumes(list_req(3, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.entries.len(), 3);
    assert!(!first.next_token.is_empty());

    // ModifyVolume directIO on a staged volume reaches its loop device.
    let staging = pool.scratch("staging");
    c.node
        .node_stage_volume(stage_req(&idem, &staging, cap.clone()))
        .await
        .unwrap();
    let loops = loops_below(&pool.path);
    assert_eq!(loops.len(), 1, "{loops:?}");
    let dio = || {
        let name = loops[0].trim_start_matches("/dev/");
        std::fs::read_to_string(format!("/sys/block/{name}/loop/dio"))
            .unwrap()
            .trim()
            .to_string()
    };
    assert_eq!(dio(), "0");
    c.controller
        .controller_modify_volume(modify_req(&idem, &[("directIO", "true")]))
        .await
        .unwrap();
    assert_eq!(dio(), "1", "directIO=true applied to the live loop device");
    c.controller
        .controller_modify_volume(modify_req(&idem, &[("directIO", "false")]))
        .await
        .unwrap();
    assert_eq!(dio(), "0", "directIO=false applied to the live loop device");
    c.controller
        .controller_modify_volume(modify_req(&idem, &[("directIO", "true")]))
        .await
        .unwrap();
    c.node
        .node_unstage_volume(unstage_req(&idem, &staging))
        .await
        .unwrap();
    // At the next stage the recorded value is applied.
    c.node
        .node_stage_volume(stage_req(&idem, &staging, cap.clone()))
        .await
        .unwrap();
    let loops2 = loops_below(&pool.path);
    let name = loops2[0].trim_start_matches("/dev/");
    assert_eq!(
        std::fs::read_to_string(format!("/sys/block/{name}/loop/dio"))
            .unwrap()
            .trim(),
        "1",
        "directIO applied at the next stage"
    );
    c.node
        .node_unstage_volume(unstage_req(&idem, &staging))
        .await
        .unwrap();
    for (id, _) in list_all(&mut c, 0).await {
        c.controller.delete_volume(delete_req(&id)).await.unwrap();
    }
    assert!(names_in(&pool).is_empty());
}

/// dd of `mib` MiB into `path`; whether it succeeded.
fn dd(path: &Path, mib: u64) -> bool {
    Command::new("dd")
        .args([
            "if=/dev/zero",
            &format!("of={}", path.display()),
            "bs=1M",
            &format!("count={mib}"),
            "conv=fsync",
            "status=none",
        ])
        .status()
        .unwrap()
        .success()
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_btrfs_dir_volume_expansion_raises_the_qgroup_limit() {
    require_root();
    let pool = Pool::new("btrfs");
    let d = Driver::start(&pool, &[]);
    let mut c = d.clients().await;
    let id = c.create_dir("subvol", 64 * MIB).await;
    let cap = mount_cap("", writer());
    let path = pool.path.join("volumes").join(&id);
    assert_eq!(qgroup_limit(&path), 64 * MIB as u64);
    let staging = pool.scratch("staging");
    let target = pool.scratch("pods").join("target");
    c.stage_and_publish(&id, &staging, &target, &cap).await;
    assert!(dd(&target.join("a"), 40), "40 MiB fit in 64 MiB");
    assert!(!dd(&target.join("b"), 40), "80 MiB do not fit in 64 MiB");
    std::fs::remove_file(target.join("b")).unwrap();
    nix::unistd::sync();
    let r = c
        .controller
        .controller_expand_volume(expand_req(&id, 160 * MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 160 * MIB);
    assert!(!r.node_expansion_required);
    assert_eq!(qgroup_limit(&path), 160 * MIB as u64);
    assert!(dd(&target.join("b"), 80), "40+80 MiB fit in 160 MiB");
    assert!(
        !dd(&target.join("c"), 60),
        "40+80+60 MiB do not fit in 160 MiB"
    );
    c.unpublish_and_unstage(&id, &target, &staging).await;
    c.controller.delete_volume(delete_req(&id)).await.unwrap();
    assert!(names_in(&pool).is_empty());
    assert!(subvolumes(&pool).is_empty());
}

/// ControllerModifyVolume on a staged image whose read-ahead cannot be set (a
/// failpoint fails it once, after direct I/O was turned on): the call fails and the
/// volume keeps its old settings, on the device, on the image and in the record. The
/// retry applies them; a stage that cannot apply the recorded settings fails and
/// leaves nothing, and its retry applies them.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_modify_volume_that_cannot_be_applied_changes_nothing() {
    require_root();
    const FAIL: (&str, &str) = ("EXAMPLE_CSI_FAILPOINTS", "loop.set-read-ahead=fail");
    // A pool that cannot reflink: the image is formatted at its stage, never
    // filled from a template, so the kernel allows it direct I/O (on xfs, an
    // image that shares blocks with a template does not get it:
    // tests/templates.rs).
    let pool = Pool::new("ext4");
    let mut d = Driver::start_with_env(&pool, &[], &[FAIL]);
    let mut c = d.clients().await;
    let cap = mount_cap("ext4", writer());
    let id = c.create("pvc-modify", 64 * MIB, cap.clone(), &[]).await;
    let image = pool.path.join("volumes").join(format!("{id}.img"));
    let staging = pool.scratch("staging");
    c.node
        .node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    let dev = loops_below(&pool.path).pop().expect("a loop device");
    let before = loop_settings(&dev);
    assert_eq!(before.0, "0");
    assert_ne!(before.1, "1024");
    let asked = [("directIO", "true"), ("readAheadKiB", "1024")];
    let recorded = |c: &mut Clients| {
        let mut ctl = c.controller.clone();
        let id = id.clone();
        async move {
            ctl.validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: id,
                volume_capabilities: vec![mount_cap("ext4", writer())],
                mutable_parameters: map(&asked),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .confirmed
            .is_some()
        }
    };

    let err = c
        .controller
        .controller_modify_volume(modify_req(&id, &asked))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    assert!(err.message().contains("read-ahead"), "{}", err.message());
    assert_eq!(loop_settings(&dev), before, "the device keeps its settings");
    assert_eq!(xattr(&image, "user.example-csi.directIO"), None);
    assert_eq!(xattr(&image, "user.example-csi.readAheadKiB"), None);
    assert!(!recorded(&mut c).await, "the record keeps its parameters");

    // The retry applies all of it, at once.
    c.controller
        .controller_modify_volume(modify_req(&id, &asked))
        .await
        .unwrap();
    assert_eq!(loop_settings(&dev), ("1".into(), "1024".into()));
    assert_eq!(
        xattr(&image, "user.example-csi.readAheadKiB").as_deref(),
        Some("1024")
    );
    assert!(recorded(&mut c).await);
    c.node
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();

    // A fresh process, armed again: the stage cannot set the recorded read-ahead.
    d.restart();
    c = d.clients().await;
    let err = c
        .node
        .node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    assert!(
        loops_below(&pool.path).is_empty(),
        "the stage left a device"
    );
    assert!(mounts_below(&staging).is_empty(), "the stage left a mount");
    c.node
        .node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    let dev = loops_below(&pool.path).pop().expect("a loop device");
    assert_eq!(
        loop_settings(&dev),
        ("1".into(), "1024".into()),
        "the next stage applies what was recorded"
    );
    c.node
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    c.controller.delete_volume(delete_req(&id)).await.unwrap();
    let log = d.log_text();
    assert!(
        log.contains("failpoint loop.set-read-ahead reached"),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
}

fn unpublish_req(
    id: &str,
    reason: csi::controller_unpublish_volume_request::Reason,
) -> csi::ControllerUnpublishVolumeRequest {
    csi::ControllerUnpublishVolumeRequest {
        volume_id: id.to_string(),
        node_id: "test-node".into(),
        reason: reason as i32,
        ..Default::default()
    }
}

fn controller_publish_req(
    id: &str,
    cap: &csi::VolumeCapability,
) -> csi::ControllerPublishVolumeRequest {
    csi::ControllerPublishVolumeRequest {
        volume_id: id.to_string(),
        node_id: "test-node".into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    }
}

/// Whether ControllerGetCapabilities advertises `rpc`.
async fn advertises(c: &mut Clients, rpc: csi::controller_service_capability::rpc::Type) -> bool {
    use csi::controller_service_capability::Type;
    let caps = c
        .controller
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    caps.iter()
        .any(|cap| matches!(&cap.r#type, Some(Type::Rpc(r)) if r.r#type == rpc as i32))
}

async fn controller_node_info(
    c: &mut Clients,
    node: &str,
) -> Result<csi::ControllerGetNodeInfoResponse, tonic::Status> {
    c.controller
        .controller_get_node_info(csi::ControllerGetNodeInfoRequest {
            node_id: node.into(),
        })
        .await
        .map(|r| r.into_inner())
}

/// CSI v1.14 through the binary: with --enable-attach, ControllerGetNodeInfo
/// answers what NodeGetInfo answers plus the volumes the node holds (published
/// and staged), and an unpublish whose reason says the node let go is refused
/// while the node still has the volume staged. NODE_INFO_FROM_CONTROLLER is not
/// advertised: no CO asks for it, and the node's own answer is complete.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_node_info_from_the_controller_and_unpublish_reasons() {
    use csi::controller_service_capability::rpc::Type as Rpc;
    use csi::controller_unpublish_volume_request::Reason;
    use csi::node_service_capability::{rpc::Type as NodeRpc, Type as NodeCap};
    require_root();
    let pool = Pool::new("xfs");
    let d = Driver::start(&pool, &["--enable-attach", "--max-volumes-per-node=4"]);
    let mut c = d.clients().await;
    assert!(advertises(&mut c, Rpc::GetNodeInfo).await);
    // What csi-sanity's capability spec checks, for CSI v1.14: each one known.
    for cap in c
        .controller
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
    {
        let Some(csi::controller_service_capability::Type::Rpc(r)) = cap.r#type else {
            panic!("a capability that is no RPC: {cap:?}");
        };
        assert!(
            matches!(Rpc::try_from(r.r#type), Ok(t) if t != Rpc::Unknown),
            "unknown capability {}",
            r.r#type
        );
    }
    let node_caps = c
        .node
        .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert!(!node_caps.iter().any(|cap| matches!(&cap.r#type,
        Some(NodeCap::Rpc(r)) if r.r#type == NodeRpc::NodeInfoFromController as i32)));

    let cap = mount_cap("ext4", writer());
    let published = c.create("published", 64 * MIB, cap.clone(), &[]).await;
    let staged = c.create("staged", 64 * MIB, cap.clone(), &[]).await;
    c.controller
        .controller_publish_volume(controller_publish_req(&published, &cap))
        .await
        .unwrap();
    let staging = pool.scratch("staging");
    c.node
        .node_stage_volume(stage_req(&staged, &staging, cap.clone()))
        .await
        .unwrap();

    let node_info = c
        .node
        .node_get_info(csi::NodeGetInfoRequest::default())
        .await
        .unwrap()
        .into_inner();
    let info = controller_node_info(&mut c, "test-node").await.unwrap();
    assert_eq!(info.max_volumes_per_node, 4);
    assert_eq!(info.accessible_topology, node_info.accessible_topology);
    let mut held: Vec<String> = info
        .published_volumes
        .iter()
        .map(|v| v.volume_id.clone())
        .collect();
    held.sort();
    let mut want = vec![published.clone(), staged.clone()];
    want.sort();
    assert_eq!(held, want);
    let e = controller_node_info(&mut c, "elsewhere").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");

    // Published and staged: the CO's "node cleaned up" is not so yet.
    c.controller
        .controller_publish_volume(controller_publish_req(&staged, &cap))
        .await
        .unwrap();
    for reason in [Reason::NodeCleanupSucceeded, Reason::NodeOutOfService] {
        let e = c
            .controller
            .controller_unpublish_volume(unpublish_req(&staged, reason))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{reason:?}: {e:?}");
    }
    c.node
        .node_unstage_volume(unstage_req(&staged, &staging))
        .await
        .unwrap();
    c.controller
        .controller_unpublish_volume(unpublish_req(&staged, Reason::NodeCleanupSucceeded))
        .await
        .unwrap();
    c.controller
        .controller_unpublish_volume(unpublish_req(&published, Reason::NodeCleanupTimeout))
        .await
        .unwrap();
    let info = controller_node_info(&mut c, "test-node").await.unwrap();
    assert!(info.published_volumes.is_empty(), "{info:?}");
    for id in [&published, &staged] {
        c.controller.delete_volume(delete_req(id)).await.unwrap();
    }
    let log = d.log_text();
    assert!(log.contains("NodeTimedOut"), "the reason is logged: {log}");
    drop(c);
    drop(d);

    // Without attach there is no publication to report.
    let d = Driver::start(&pool, &[]);
    let mut c = d.clients().await;
    assert!(!advertises(&mut c, Rpc::GetNodeInfo).await);
    let e = controller_node_info(&mut c, "test-node").await.unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
}
