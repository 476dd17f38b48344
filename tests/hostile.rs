//! Hostile inputs, table-driven, against the real binary: each row is one request
//! with the gRPC code(s) the CSI spec calls for, and a check that nothing the
//! driver could reach changed: the test's directory with the pool, the state dir
//! and the kubelet dirs (names, kinds, sizes, and the contents of every small
//! file), a canary tree outside it, the system paths the rows aim at, the mounts
//! at or of any of those, and the loop devices backed by them; /tmp/pwned never
//! appears. Other processes' mounts and files elsewhere are not compared: the
//! machine runs other tests and containers at the same time, and a change of
//! theirs is not the driver's doing.
//!
//! Rows that the spec says must succeed (a volume *name* with `..` or `/` is an
//! opaque string: the id is a UUIDv5 of it, so it can never become a path) are
//! checked to change nothing outside the pool and the state dir, then undone, and
//! then the whole fingerprint must equal the one before.
//!
//! Non-UTF-8 bytes cannot be sent: every id, name and path of the CSI messages is
//! a proto3 `string`, which must be valid UTF-8; prost refuses to decode such a
//! message, so tonic answers the call with an error before any handler of the
//! driver runs (and tonic's generated clients cannot even build one, their fields
//! being Rust `String`s). NUL, which is valid UTF-8, is in the table.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use common::*;
use csi_proto::csi::{self, volume_capability};
use tonic::Code;

const PWNED: &str = "/tmp/pwned";

/// What a hostile row may be answered with.
#[derive(Debug, Clone)]
enum Want {
    /// One of these codes, and nothing changed.
    Refused(&'static [Code]),
    /// Success, contained in the pool and the state dir; the row's undo brings
    /// everything back.
    Contained,
}
use Want::*;

const INVALID: Want = Refused(&[Code::InvalidArgument]);
const OUT_OF_RANGE: Want = Refused(&[Code::OutOfRange]);

/// Paths outside the test's own directories that rows name or lead to (through
/// `..` or a symlink in the kubelet dirs), watched by path. Other processes on the
/// machine mount and write elsewhere at the same time (containers of other tests,
/// network namespaces, builds), so nothing beyond these is compared. "/" itself
/// is watched as a mount point only.
const SYSTEM_PATHS: &[&str] = &[
    "/",
    "/etc",
    "/etc/passwd",
    "/etc/hostile",
    "/etc/hostile-target",
    "/etc/newdir",
    "/proc/self",
    "/dev/sda",
    PWNED,
    // Where "<kubelet pods dir>/../../../etc" leads.
    "/tmp/etc",
];

/// A fingerprint of everything a request could change: the test's own directory
/// (pool, state dir, kubelet dirs), the canary tree, the system paths the rows aim
/// at, and the mounts and loop devices that involve any of those.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Fingerprint {
    /// path -> (kind, size, hash of contents for small regular files)
    tree: BTreeMap<String, String>,
    /// "mount point, options, source" of the watched mounts
    mounts: BTreeSet<String>,
    /// "device backing-file" of the watched loop devices
    loops: BTreeSet<String>,
    /// path -> what is there now, for each of `Env::system`
    system: BTreeMap<String, String>,
    pwned: bool,
}

fn walk(dir: &Path, skip: &[&Path], out: &mut BTreeMap<String, String>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if skip.iter().any(|s| p == *s) {
            continue;
        }
        // Filesystem templates are the driver's cache, made in the background
        // after a valid create (tests/templates.rs checks them); so are the
        // files of removed volume locks, kept as spares for the next volumes (a
        // call that locked a name and was refused leaves one).
        if is_journal(&p) || p.file_name().is_some_and(|n| n == ".templates") || is_spare_lock(&p) {
            continue;
        }
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        let ft = m.file_type();
        out.insert(p.display().to_string(), describe(&p, &m));
        if ft.is_dir() && !ft.is_symlink() {
            walk(&p, skip, out);
        }
    }
}

/// A spare file of the volume locks (`<state>/shared/locks/.spare-*`).
fn is_spare_lock(p: &Path) -> bool {
    p.parent().is_some_and(|d| d.ends_with("shared/locks"))
        && p.file_name()
            .is_some_and(|n| csi_sys::flock::is_spare(&n.to_string_lossy()))
}

/// A record store's journal or snapshot (`log.N`, `snapshot.N`, `packed.N`):
/// every change the driver makes and undoes appends to it, so its bytes are no
/// sign of one; what the records say is seen through the calls.
fn is_journal(p: &Path) -> bool {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    csi_storage::core::store::is_store_file(&name)
}

/// Kind, size and (for small files) a hash of the contents.
fn describe(p: &Path, m: &std::fs::Metadata) -> String {
    let ft = m.file_type();
    if ft.is_symlink() {
        format!("link->{:?}", std::fs::read_link(p).ok())
    } else if ft.is_dir() {
        "dir".to_string()
    } else if ft.is_file() && m.len() <= 1 << 20 {
        let body = std::fs::read(p).unwrap_or_default();
        format!("file {} {:x}", m.len(), fnv(&body))
    } else {
        format!("other {:?} {}", ft, m.len())
    }
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x100000001b3)
    })
}

struct Env {
    pool: Pool,
    driver: Driver,
    c: Clients,
    vol: String,
    /// A volume that was created and never staged.
    fresh: String,
    snap: String,
    staging: PathBuf,
    pods: PathBuf,
    /// Files outside the test's directory that no request may reach; the kubelet
    /// dirs hold a symlink to it.
    canary: tempfile::TempDir,
    /// `SYSTEM_PATHS`, the driver's own /proc entry, and where a relative path
    /// would lead from the driver's working directory.
    system: Vec<PathBuf>,
}

impl Env {
    /// Whether `p` is something the driver could reach from a row: the test's
    /// directory, the canary, or at or below a watched system path ("/" only as
    /// itself).
    fn watched(&self, p: &Path) -> bool {
        p.starts_with(self.pool.dir.path())
            || p.starts_with(self.canary.path())
            || self
                .system
                .iter()
                .any(|s| p == s || (s != Path::new("/") && p.starts_with(s)))
    }

    fn fingerprint(&self) -> Fingerprint {
        let top = self.pool.dir.path();
        let mut tree = BTreeMap::new();
        let log = self.driver.log.clone();
        let sock = self.driver.socket.clone();
        walk(top, &[&log, &sock], &mut tree);
        walk(self.canary.path(), &[], &mut tree);
        let all_loops = loop_devices();
        let loops: BTreeSet<String> = all_loops
            .iter()
            .filter(|(_, b)| self.watched(b))
            .map(|(d, b)| format!("{d} {}", b.display()))
            .collect();
        // A mount is watched where it is (a watched path) and by what it shows (a
        // loop device of a watched file, or a watched path as its source), so that
        // a volume mounted anywhere at all is seen.
        let watched_devices: BTreeSet<&str> = all_loops
            .iter()
            .filter(|(_, b)| self.watched(b))
            .map(|(d, _)| d.as_str())
            .collect();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                let mp = f.get(4)?.replace("\\040", " ");
                let opts = f.get(5).unwrap_or(&"");
                let dash = f.iter().position(|x| *x == "-")?;
                let source = f.get(dash + 2).unwrap_or(&"");
                let watched = self.watched(Path::new(&mp))
                    || watched_devices.contains(source)
                    || (source.starts_with('/') && self.watched(Path::new(source)));
                watched.then(|| format!("{mp} {opts} {source}"))
            })
            .collect();
        let system = self
            .system
            .iter()
            .map(|p| {
                let now = match std::fs::symlink_metadata(p) {
                    // A folder of the system gains and loses entries of other
                    // processes: only that it is still a folder counts.
                    Ok(m) if m.is_dir() => "dir".to_string(),
                    Ok(m) => format!("{} {:?}", describe(p, &m), m.modified().ok()),
                    Err(e) => format!("absent ({e})"),
                };
                (p.display().to_string(), now)
            })
            .collect();
        Fingerprint {
            tree,
            mounts,
            loops,
            system,
            pwned: Path::new(PWNED).exists(),
        }
    }
}

/// One request of the table. Returns the result's code.
type Call = Box<
    dyn for<'a> FnOnce(
        &'a mut Env,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<(), tonic::Status>> + 'a>,
    >,
>;

struct Row {
    what: String,
    want: Want,
    call: Call,
    undo: Option<Call>,
}

macro_rules! call {
    (|$e:ident| $body:expr) => {
        Box::new(move |$e: &mut Env| Box::pin(async move { $body.map(drop) }))
    };
}

/// A row's call of the controller service: `ctl!(create_volume(req))`.
macro_rules! ctl {
    ($method:ident($($arg:expr),*)) => {
        call!(|e| e.c.controller.$method($($arg),*).await)
    };
}

/// A row's call of the node service: `node!(node_stage_volume(req))`.
macro_rules! node {
    ($method:ident($($arg:expr),*)) => {
        call!(|e| e.c.node.$method($($arg),*).await)
    };
}

/// A row with nothing to undo.
fn row(what: impl Into<String>, want: Want, call: Call) -> Row {
    Row {
        what: what.into(),
        want,
        call,
        undo: None,
    }
}

/// The capability of most rows: an ext4 mount for one writer.
fn ext4() -> csi::VolumeCapability {
    mount_cap("ext4", writer())
}

fn cap_with(fs: &str, flags: &[&str], group: &str) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume {
                fs_type: fs.into(),
                mount_flags: flags.iter().map(|s| s.to_string()).collect(),
                volume_mount_group: group.into(),
            },
        )),
        access_mode: Some(volume_capability::AccessMode {
            mode: writer() as i32,
        }),
    }
}

fn delete_undo(name: &'static str) -> Option<Call> {
    let id = csi_storage::ids::VolumeId::for_name(name).to_string();
    Some(ctl!(delete_volume(delete_req(&id))))
}

fn rows(env: &Env) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    let long = "x".repeat(100_000);
    let (vol, snap) = (env.vol.clone(), env.snap.clone());
    let staging = env.staging.display().to_string();
    let pods = env.pods.clone();
    let pool = env.pool.path.clone();
    let state = env.driver.state.clone();

    // ---- names and ids ----
    for name in [
        "../../../../etc/hostile",
        "a/b/../../c",
        "/etc/passwd",
        "..",
        "/",
    ] {
        let name: &'static str = name;
        rows.push(Row {
            what: format!("CreateVolume name {name:?} (an opaque name)"),
            want: Contained,
            call: ctl!(create_volume(create_req(name, 64 * MIB, ext4(), &[]))),
            undo: delete_undo(name),
        });
    }
    for (label, name) in [
        ("NUL", "pvc-\0-x".to_string()),
        ("very long", long.clone()),
        ("empty", String::new()),
        ("newline", "pvc\nx".to_string()),
    ] {
        let name2 = name.clone();
        rows.push(row(
            format!("CreateVolume name {label}"),
            INVALID,
            ctl!(create_volume(create_req(&name, 64 * MIB, ext4(), &[]))),
        ));
        let src = vol.clone();
        rows.push(row(
            format!("CreateSnapshot name {label}"),
            INVALID,
            ctl!(create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: src.clone(),
                name: name2.clone(),
                ..Default::default()
            })),
        ));
    }
    for id in [
        "../../../etc".to_string(),
        "/".to_string(),
        "/etc/passwd".to_string(),
        "a\0b".to_string(),
        format!("{vol}/../../etc"),
        format!("../{vol}"),
        long.clone(),
        vol.to_uppercase(),
    ] {
        let short: String = id.chars().take(40).collect();
        // DeleteVolume and DeleteSnapshot of what does not exist succeed (spec).
        let i = id.clone();
        rows.push(row(
            format!("DeleteVolume id {short:?}"),
            Refused(&[Code::Ok, Code::NotFound]),
            ctl!(delete_volume(delete_req(&i))),
        ));
        let i = id.clone();
        rows.push(row(
            format!("DeleteSnapshot id {short:?}"),
            Refused(&[Code::Ok, Code::NotFound]),
            ctl!(delete_snapshot(delete_snapshot_req(&i))),
        ));
        let (i, st) = (id.clone(), env.staging.clone());
        rows.push(row(
            format!("NodeStageVolume id {short:?}"),
            Refused(&[Code::NotFound, Code::InvalidArgument]),
            node!(node_stage_volume(stage_req(&i, &st, ext4()))),
        ));
        let (i, st, t) = (id.clone(), env.staging.clone(), pods.join("t-id"));
        rows.push(row(
            format!("NodePublishVolume id {short:?}"),
            Refused(&[Code::NotFound, Code::InvalidArgument]),
            node!(node_publish_volume(publish_req(&i, &st, &t, ext4(), false))),
        ));
        let i = id.clone();
        rows.push(row(
            format!("ControllerExpandVolume id {short:?}"),
            Refused(&[Code::NotFound, Code::InvalidArgument]),
            ctl!(controller_expand_volume(
                csi::ControllerExpandVolumeRequest {
                    volume_id: i.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: 128 * MIB,
                        limit_bytes: 0,
                    }),
                    ..Default::default()
                }
            )),
        ));
        let i = id.clone();
        rows.push(row(
            format!("CreateVolume from snapshot id {short:?}"),
            Refused(&[Code::NotFound, Code::InvalidArgument]),
            call!(|e| {
                let mut r = create_req("pvc-from-bad", 64 * MIB, ext4(), &[]);
                r.volume_content_source = Some(csi::VolumeContentSource {
                    r#type: Some(csi::volume_content_source::Type::Snapshot(
                        csi::volume_content_source::SnapshotSource {
                            snapshot_id: i.clone(),
                        },
                    )),
                });
                e.c.controller.create_volume(r).await
            }),
        ));
    }

    // ---- target and staging paths ----
    let outside_link = pods.join("link-to-etc");
    let parent_link = pods.join("parent-link");
    let mut bad_targets: Vec<(String, Want)> = vec![
        ("/".into(), INVALID),
        ("/etc".into(), INVALID),
        ("/etc/hostile-target".into(), INVALID),
        ("/proc/self".into(), INVALID),
        (outside_link.display().to_string(), INVALID),
        (parent_link.join("newdir").display().to_string(), INVALID),
        (pool.join("volumes/hostile").display().to_string(), INVALID),
        (pool.display().to_string(), INVALID),
        (state.join("hostile").display().to_string(), INVALID),
        (state.display().to_string(), INVALID),
        (format!("{}/../../../etc", pods.display()), INVALID),
        ("relative/target".into(), INVALID),
        (format!("{}/t\0x", pods.display()), INVALID),
        (String::new(), INVALID),
    ];
    bad_targets.push((staging.clone(), INVALID));
    bad_targets.push((pods.join("link-to-canary").display().to_string(), INVALID));
    // The fingerprint watches by path: every place a target leads to must be in it.
    for (t, _) in &bad_targets {
        let mut p = PathBuf::new();
        for c in Path::new(t).components() {
            match c {
                std::path::Component::ParentDir => {
                    p.pop();
                }
                c => p.push(c),
            }
        }
        // /proc/self leads to the driver's own entry, which is watched, not ours.
        let real = match p.starts_with("/proc/self") {
            true => p.clone(),
            false => std::fs::canonicalize(&p).unwrap_or(p.clone()),
        };
        if p.is_absolute() {
            assert!(env.watched(&p) && env.watched(&real), "{t} is not watched");
        }
    }
    for (t, want) in bad_targets.clone() {
        let (v, st, t2) = (vol.clone(), env.staging.clone(), t.clone());
        rows.push(row(
            format!("NodePublishVolume target {t:?}"),
            want.clone(),
            node!(node_publish_volume(publish_req(
                &v,
                &st,
                &t2,
                ext4(),
                false
            ))),
        ));
        if t == staging {
            continue;
        }
        let (v, t2) = (vol.clone(), t.clone());
        rows.push(row(
            format!("NodeUnpublishVolume target {t:?}"),
            Refused(&[Code::InvalidArgument, Code::NotFound]),
            node!(node_unpublish_volume(unpublish_req(&v, &t2))),
        ));
        let (v, t2) = (vol.clone(), t.clone());
        // A second staging path for a staged volume is also refused.
        rows.push(row(
            format!("NodeStageVolume staging {t:?}"),
            Refused(&[Code::InvalidArgument, Code::FailedPrecondition]),
            node!(node_stage_volume(stage_req(&v, &t2, ext4()))),
        ));
        let (v, t2) = (vol.clone(), t.clone());
        rows.push(row(
            format!("NodeUnstageVolume staging {t:?}"),
            Refused(&[
                Code::InvalidArgument,
                Code::NotFound,
                Code::FailedPrecondition,
            ]),
            node!(node_unstage_volume(unstage_req(&v, &t2))),
        ));
        let (v, t2) = (vol.clone(), t.clone());
        rows.push(row(
            format!("NodeGetVolumeStats path {t:?}"),
            Refused(&[Code::InvalidArgument, Code::NotFound]),
            node!(node_get_volume_stats(stats_req(&v, &t2))),
        ));
        let t2 = t.clone();
        rows.push(row(
            format!("ephemeral NodePublishVolume target {t:?}"),
            INVALID,
            node!(node_publish_volume(ephemeral_req(
                "csi-hostile-eph",
                &t2,
                ext4(),
                &[]
            ))),
        ));
    }

    // ---- mount flags ----
    let flag_sets: Vec<(Vec<&'static str>, bool)> = vec![
        (vec!["rw,suid"], false),
        (vec!["suid"], false),
        (vec!["dev"], false),
        (vec!["exec"], true),
        (vec!["rw", "exec"], true),
        (vec!["nosuid,dev"], false),
        (vec!["noatime,exec"], false),
        (vec!["context=system_u:object_r:etc_t:s0"], false),
        (vec!["uid=0"], false),
        (vec!["loop=/dev/sda"], false),
        (vec!["remount"], false),
        (vec!["bind"], false),
        (vec!["x-mount.mkdir=/etc/hostile"], false),
        (vec![","], false),
        (vec!["="], false),
        (vec!["noexec", "--bind"], false),
        (vec!["ro\0rw"], false),
    ];
    for (flags, readonly) in flag_sets {
        let (v, st, t) = (vol.clone(), env.staging.clone(), pods.join("flags"));
        let f2 = flags.clone();
        rows.push(row(
            format!("NodePublishVolume mount_flags {flags:?} readonly={readonly}"),
            INVALID,
            node!(node_publish_volume(publish_req(
                &v,
                &st,
                &t,
                cap_with("ext4", &f2, ""),
                readonly
            ))),
        ));
        let f2 = flags.clone();
        rows.push(row(
            format!("CreateVolume mount_flags {flags:?}"),
            INVALID,
            ctl!(create_volume(create_req(
                "pvc-flags",
                64 * MIB,
                cap_with("ext4", &f2, ""),
                &[]
            ))),
        ));
    }

    // ---- filesystem types the node cannot make, or not on a volume this small ----
    for fs in [
        "vfat",
        "ext4 -F",
        "fz-4",
        "../../sbin/mkfs.ext4",
        "xfs",
        "btrfs",
    ] {
        let (v, st) = (env.fresh.clone(), env.staging.with_file_name("fresh"));
        rows.push(row(
            format!("NodeStageVolume fs_type {fs:?} on a fresh 64 MiB volume"),
            Refused(&[Code::InvalidArgument, Code::OutOfRange]),
            node!(node_stage_volume(stage_req(&v, &st, cap_with(fs, &[], "")))),
        ));
        // An ephemeral volume's size is rounded up to its filesystem's minimum, as
        // CreateVolume's is, so xfs and btrfs on 64Mi are made (at 300/128 MiB).
        if fs == "xfs" || fs == "btrfs" {
            continue;
        }
        let t = pods.join("eph-fs");
        rows.push(row(
            format!("ephemeral NodePublishVolume fs_type {fs:?} size=64Mi"),
            Refused(&[Code::InvalidArgument, Code::OutOfRange]),
            node!(node_publish_volume(ephemeral_req(
                "csi-hostile-fs",
                &t,
                cap_with(fs, &[], ""),
                &[("size", "64Mi")]
            ))),
        ));
    }

    // ---- capacities ----
    for (req, lim, want) in [
        (i64::MAX, 0, OUT_OF_RANGE),
        (i64::MAX, i64::MAX, OUT_OF_RANGE),
        (1 << 50, 0, OUT_OF_RANGE),
        (-1, 0, INVALID),
        (i64::MIN, 0, INVALID),
        (0, -1, INVALID),
        (0, i64::MIN, INVALID),
        (128 * MIB, 64 * MIB, INVALID),
        (i64::MAX - 4095, 0, OUT_OF_RANGE),
    ] {
        rows.push(row(
            format!("CreateVolume capacity required={req} limit={lim}"),
            want,
            call!(|e| {
                let mut r = create_req("pvc-cap", 0, ext4(), &[]);
                r.capacity_range = Some(csi::CapacityRange {
                    required_bytes: req,
                    limit_bytes: lim,
                });
                e.c.controller.create_volume(r).await
            }),
        ));
        let v = vol.clone();
        rows.push(row(
            format!("ControllerExpandVolume capacity required={req} limit={lim}"),
            Refused(&[Code::OutOfRange, Code::InvalidArgument]),
            ctl!(controller_expand_volume(
                csi::ControllerExpandVolumeRequest {
                    volume_id: v.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: req,
                        limit_bytes: lim,
                    }),
                    ..Default::default()
                }
            )),
        ));
    }
    for (req, lim) in [
        (i64::MAX, 0),
        (i64::MAX - 4095, 0),
        (1 << 62, 0),
        (1 << 50, 0),
        (-1, 0),
        (i64::MIN, 0),
        (128 * MIB, 64 * MIB),
    ] {
        let (v, st) = (vol.clone(), staging.clone());
        rows.push(row(
            format!("NodeExpandVolume capacity required={req} limit={lim}"),
            Refused(&[Code::OutOfRange, Code::InvalidArgument]),
            node!(node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: v.clone(),
                volume_path: st.clone(),
                staging_target_path: st.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: req,
                    limit_bytes: lim,
                }),
                volume_capability: Some(ext4()),
                ..Default::default()
            })),
        ));
    }
    rows.push(Row {
        what: "CreateVolume capacity limit=i64::MAX only".into(),
        want: Contained,
        call: call!(|e| {
            let mut r = create_req("pvc-cap-limit", 0, ext4(), &[]);
            r.capacity_range = Some(csi::CapacityRange {
                required_bytes: 0,
                limit_bytes: i64::MAX,
            });
            e.c.controller.create_volume(r).await
        }),
        undo: delete_undo("pvc-cap-limit"),
    });
    for size in [
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551615",
        "99999999999999999999",
        "-1",
        "16Ei",
        "8191Pi",
        "1e30",
        "$(touch /tmp/pwned)",
    ] {
        let t = pods.join("eph-size");
        rows.push(row(
            format!("ephemeral volumeAttributes size={size}"),
            Refused(&[
                Code::InvalidArgument,
                Code::OutOfRange,
                Code::ResourceExhausted,
            ]),
            node!(node_publish_volume(ephemeral_req(
                "csi-hostile-size",
                &t,
                ext4(),
                &[("size", size)]
            ))),
        ));
    }

    // ---- shell metacharacters ----
    let evil = [
        "$(touch /tmp/pwned)",
        "`touch /tmp/pwned`",
        "; touch /tmp/pwned",
        "| touch /tmp/pwned",
        "&& touch /tmp/pwned",
        "; rm -rf /",
        "x\ntouch /tmp/pwned",
        "' ; touch /tmp/pwned ; '",
    ];
    for s in evil {
        for key in ["type", "kind", "fsType", "unknown"] {
            rows.push(row(
                format!("CreateVolume parameter {key}={s:?}"),
                INVALID,
                ctl!(create_volume(create_req(
                    "pvc-shell",
                    64 * MIB,
                    ext4(),
                    &[(key, s)]
                ))),
            ));
        }
        rows.push(row(
            format!("CreateVolume fs_type {s:?}"),
            INVALID,
            ctl!(create_volume(create_req(
                "pvc-shell-fs",
                64 * MIB,
                cap_with(s, &[], ""),
                &[]
            ))),
        ));
        let (v, st, t) = (vol.clone(), env.staging.clone(), pods.join("shell"));
        rows.push(row(
            format!("NodePublishVolume fs_type {s:?}"),
            INVALID,
            node!(node_publish_volume(publish_req(
                &v,
                &st,
                &t,
                cap_with(s, &[], ""),
                false
            ))),
        ));
        let (v, st, t) = (vol.clone(), env.staging.clone(), pods.join("shell-group"));
        rows.push(row(
            format!("NodePublishVolume volume_mount_group {s:?}"),
            INVALID,
            node!(node_publish_volume(publish_req(
                &v,
                &st,
                &t,
                cap_with("ext4", &[], s),
                false
            ))),
        ));
        let v = vol.clone();
        // Snapshots take no parameters of their own: one they do not use is
        // ignored, never run or written anywhere.
        rows.push(Row {
            what: format!("CreateSnapshot parameter {s:?}"),
            want: Contained,
            call: ctl!(create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: v.clone(),
                name: "snap-shell".into(),
                parameters: [("x".into(), s.into())].into(),
                ..Default::default()
            })),
            undo: Some(ctl!(delete_snapshot(delete_snapshot_req(
                &csi_storage::ids::SnapshotId::for_name("snap-shell").to_string()
            )))),
        });
        for key in ["readAheadKiB", "directIO", "unknown"] {
            let v = vol.clone();
            rows.push(row(
                format!("ControllerModifyVolume {key}={s:?}"),
                INVALID,
                ctl!(controller_modify_volume(
                    csi::ControllerModifyVolumeRequest {
                        volume_id: v.clone(),
                        mutable_parameters: [(key.into(), s.into())].into(),
                        ..Default::default()
                    }
                )),
            ));
        }
        let t = pods.join("eph-shell");
        rows.push(row(
            format!("ephemeral volumeAttributes type={s:?}"),
            INVALID,
            node!(node_publish_volume(ephemeral_req(
                "csi-hostile-shell",
                &t,
                ext4(),
                &[("type", s)]
            ))),
        ));
    }
    // Metacharacters where the driver accepts free text: a Kubernetes-prefixed
    // parameter (kept as opaque metadata) and a snapshot name.
    rows.push(Row {
        what: "CreateVolume csi.storage.k8s.io/pvc/name=$(touch /tmp/pwned)".into(),
        want: Contained,
        call: ctl!(create_volume(create_req(
            "pvc-shell-k8s",
            64 * MIB,
            ext4(),
            &[(
                "csi.storage.k8s.io/pvc/name",
                "$(touch /tmp/pwned); rm -rf /"
            )]
        ))),
        undo: delete_undo("pvc-shell-k8s"),
    });
    let v = vol.clone();
    rows.push(Row {
        what: "CreateSnapshot name \"; rm -rf / $(touch /tmp/pwned)\"".into(),
        want: Contained,
        call: ctl!(create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: v.clone(),
            name: "; rm -rf / $(touch /tmp/pwned)".into(),
            ..Default::default()
        })),
        undo: Some(ctl!(delete_snapshot(delete_snapshot_req(
            &csi_storage::ids::SnapshotId::for_name("; rm -rf / $(touch /tmp/pwned)").to_string()
        )))),
    });
    let _ = snap;
    rows
}

/// How many times `root_hostile_inputs_get_the_right_code_and_change_nothing` runs
/// the table (environment HOSTILE_RUNS, default 1): a table that only a crowded
/// machine fails shows up over many runs.
fn runs() -> usize {
    std::env::var("HOSTILE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_hostile_inputs_get_the_right_code_and_change_nothing() {
    require_root();
    for run in 1..=runs() {
        let (nrows, failures) = run_table(&mut |_, _| {}).await;
        eprintln!(
            "hostile run {run}: {nrows} rows, {} failures",
            failures.len()
        );
        assert!(
            failures.is_empty(),
            "run {run}: {} failures in {nrows} hostile rows:\n{}",
            failures.len(),
            failures
                .iter()
                .map(|(_, f)| f.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// The table's own check, tested: a mount and a loop device that other processes
/// make elsewhere in the middle of the table (as other tests' containers and
/// network namespaces do) are blamed on no row, while a change in the test's
/// directory, in the canary tree or at a system path a row aims at is blamed on
/// the row during which it happened, and only on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: loop devices and mounts"]
async fn root_hostile_table_blames_only_changes_it_watches() {
    require_root();
    let elsewhere = tempfile::Builder::new()
        .prefix("example-csi-elsewhere")
        .tempdir_in("/var/tmp")
        .unwrap();
    let unrelated_mount = elsewhere.path().join("mnt");
    std::fs::create_dir(&unrelated_mount).unwrap();
    let unrelated_image = elsewhere.path().join("img");
    std::fs::write(&unrelated_image, vec![0u8; 1 << 20]).unwrap();
    let mut unrelated_loop = None;
    let mut watched_mount = None;
    let (unrelated_at, mount_at, canary_at) = (5, 40, 80);
    let (nrows, failures) = run_table(&mut |i, env| {
        if i == unrelated_at {
            sh(
                "mount",
                &["-t", "tmpfs", "tmpfs", unrelated_mount.to_str().unwrap()],
            );
            let dev = sh(
                "losetup",
                &["-f", "--show", unrelated_image.to_str().unwrap()],
            );
            unrelated_loop = Some(dev.trim().to_string());
        }
        if i == mount_at {
            let m = env.pods.join("appeared");
            std::fs::create_dir(&m).unwrap();
            sh("mount", &["-t", "tmpfs", "tmpfs", m.to_str().unwrap()]);
            watched_mount = Some(m);
        }
        if i == canary_at {
            std::fs::write(env.canary.path().join("a/b/appeared"), b"x").unwrap();
        }
    })
    .await;
    let _ = nix::mount::umount2(&unrelated_mount, nix::mount::MntFlags::MNT_DETACH);
    if let Some(m) = &watched_mount {
        let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
    }
    if let Some(dev) = &unrelated_loop {
        sh("losetup", &["-d", dev]);
    }
    assert!(nrows > canary_at, "the table has only {nrows} rows");
    let mut blamed: Vec<usize> = failures.iter().map(|(i, _)| *i).collect();
    blamed.dedup();
    assert_eq!(blamed, vec![mount_at, canary_at], "failures: {failures:#?}");
    let said = |row: usize| {
        failures
            .iter()
            .filter(|(i, _)| *i == row)
            .map(|(_, f)| f.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(said(mount_at).contains("mount "), "{}", said(mount_at));
    assert!(said(mount_at).contains("/appeared"), "{}", said(mount_at));
    assert!(
        said(canary_at).contains("/a/b/appeared"),
        "{}",
        said(canary_at)
    );
}

/// Runs every row against a fresh pool and driver; `disturb(i, env)` runs after
/// row `i`'s call and before the check of what it changed. Returns the number of
/// rows and the failures, each with the index of its row.
async fn run_table(disturb: &mut dyn FnMut(usize, &Env)) -> (usize, Vec<(usize, String)>) {
    if Path::new(PWNED).exists() {
        std::fs::remove_file(PWNED).unwrap();
    }
    let pool = Pool::new("xfs");
    let staging = pool.scratch("staging").join("vol");
    let pods = pool.scratch("pods");
    let canary = tempfile::Builder::new()
        .prefix("example-csi-canary")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::create_dir_all(canary.path().join("a/b")).unwrap();
    std::fs::write(canary.path().join("a/b/keep"), b"canary").unwrap();
    std::fs::write(canary.path().join("top"), b"canary").unwrap();
    std::os::unix::fs::symlink("/etc", pods.join("link-to-etc")).unwrap();
    std::os::unix::fs::symlink("/etc", pods.join("parent-link")).unwrap();
    std::os::unix::fs::symlink(canary.path(), pods.join("link-to-canary")).unwrap();
    let driver = Driver::start(&pool, &[]);
    let mut c = driver.clients().await;
    let cap = ext4();
    let vol = c.create("pvc-hostile", 64 * MIB, cap.clone(), &[]).await;
    c.node
        .node_stage_volume(stage_req(&vol, &staging, cap.clone()))
        .await
        .unwrap();
    let fresh = c
        .create("pvc-hostile-fresh", 64 * MIB, cap.clone(), &[])
        .await;
    let snap = must_snapshot(&mut c.controller, snapshot_req("snap-hostile", &vol))
        .await
        .snapshot_id;
    let mut env = Env {
        pool,
        driver,
        c,
        vol,
        fresh,
        snap,
        staging,
        pods,
        canary,
        system: Vec::new(),
    };
    let cwd = std::env::current_dir().unwrap();
    env.system = SYSTEM_PATHS
        .iter()
        .map(PathBuf::from)
        .chain([
            PathBuf::from(format!("/proc/{}", env.driver.pid())),
            // Where "relative/target" would lead: the driver runs in this
            // process's working directory.
            cwd.join("relative"),
        ])
        .collect();
    let table = rows(&env);
    let nrows = table.len();
    let mut failures = Vec::new();
    let mut before = env.fingerprint();
    for (i, row) in table.into_iter().enumerate() {
        let r = (row.call)(&mut env).await;
        disturb(i, &env);
        let code = r.as_ref().err().map_or(Code::Ok, |s| s.code());
        let msg = r
            .as_ref()
            .err()
            .map(|s| s.message().to_string())
            .unwrap_or_default();
        let msg: String = msg.chars().take(160).collect();
        match &row.want {
            Refused(codes) => {
                if !codes.contains(&code) {
                    failures.push((
                        i,
                        format!("{}: got {code:?} ({msg}), want one of {codes:?}", row.what),
                    ));
                }
            }
            Contained => {
                if code != Code::Ok {
                    failures.push((i, format!("{}: got {code:?} ({msg}), want Ok", row.what)));
                }
                let mid = env.fingerprint();
                let outside = |f: &Fingerprint| {
                    let mut f = f.clone();
                    f.tree.retain(|p, _| {
                        !Path::new(p).starts_with(&env.pool.path)
                            && !Path::new(p).starts_with(&env.driver.state)
                    });
                    f
                };
                if outside(&mid) != outside(&before) {
                    failures.push((
                        i,
                        format!("{}: changed something outside the pool", row.what),
                    ));
                }
                if let Some(undo) = row.undo {
                    if let Err(e) = undo(&mut env).await {
                        failures.push((i, format!("{}: undo failed: {e}", row.what)));
                    }
                }
            }
        }
        let after = env.fingerprint();
        if after != before {
            let mut d = Vec::new();
            for (k, v) in &after.tree {
                if before.tree.get(k) != Some(v) {
                    d.push(format!("+{k} {v}"));
                }
            }
            for k in before.tree.keys() {
                if !after.tree.contains_key(k) {
                    d.push(format!("-{k}"));
                }
            }
            for m in after.mounts.symmetric_difference(&before.mounts) {
                d.push(format!("mount {m}"));
            }
            for l in after.loops.symmetric_difference(&before.loops) {
                d.push(format!("loop {l}"));
            }
            for (p, v) in &after.system {
                if before.system.get(p) != Some(v) {
                    d.push(format!("{p}: {v}"));
                }
            }
            if after.pwned {
                d.push("/tmp/pwned exists".into());
            }
            failures.push((i, format!("{}: changed {d:?}", row.what)));
            if after.pwned {
                let _ = std::fs::remove_file(PWNED);
            }
            // Judge the next rows against the world as it now is.
            before = env.fingerprint();
        }
    }
    assert!(!Path::new(PWNED).exists(), "{PWNED} appeared");
    let log = env.driver.log_text();
    for p in log.lines().filter(|l| l.contains("panicked")) {
        failures.push((
            nrows,
            format!(
                "the driver panicked: {}",
                p.chars().take(400).collect::<String>()
            ),
        ));
    }
    (nrows, failures)
}
