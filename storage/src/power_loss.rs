//! Power loss at every step of the state's real workloads. The workload runs once
//! on a real directory (tmpfs when there is one: the crash semantics come from the
//! model, not from the disk) with the fake system layer, while `csi_sys::fsrecord`
//! records every file-system operation. Then, for every operation boundary, each
//! on-disk state the model says a power loss could leave is rebuilt, the driver is
//! started on it as after a reboot (a fresh fake: nothing mounted, nothing
//! attached), and its recovery is checked:
//!
//! - what it shows is what the last acknowledged call left, or what the call in
//!   flight would have left (never less: no acknowledged change is lost);
//! - no record is unreadable, none is half-made, every record's data is there with
//!   its size and attributes, and no data, temporary or freeze marker is left that
//!   no record accounts for;
//! - a retry of the call in flight succeeds and leaves what it left the first time.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use csi_sys::fsrecord::{read_tree, FsOp, Model, Recording, Tree};

use crate::ids::{SnapshotId, VolumeId};
use crate::model::*;
use crate::node::Stage;
use crate::volumes::{CreateVolume, MIB};
use crate::{Config, Driver, Result};

/// The test's directories: `data` (state and pool, what a power loss acts on)
/// and, outside it, the staging path.
struct Dirs {
    _tmp: [tempfile::TempDir; 2],
    data: PathBuf,
    staging: PathBuf,
}

impl Dirs {
    fn new() -> Dirs {
        let tmp_in = |bases: &[&str]| {
            let base = bases
                .iter()
                .map(Path::new)
                .find(|p| p.is_dir())
                .map(Path::to_path_buf)
                .unwrap_or_else(std::env::temp_dir);
            tempfile::Builder::new()
                .prefix("csi-power-loss")
                .tempdir_in(base)
                .unwrap()
        };
        // The staging path lives apart, where the fake power loss does not act.
        let tmp = [tmp_in(&["/dev/shm", "/var/tmp"]), tmp_in(&["/var/tmp"])];
        let data = std::fs::canonicalize(tmp[0].path()).unwrap().join("data");
        std::fs::create_dir_all(data.join("pool")).unwrap();
        Dirs {
            staging: tmp[1].path().join("staging"),
            data,
            _tmp: tmp,
        }
    }

    fn open(&self) -> Result<Driver> {
        let mut cfg = Config::new(
            "node-1",
            &self.data.join("state"),
            vec![("default".into(), self.data.join("pool"))],
        );
        // Never the machine's switch of expedited grace periods (a fake freeze
        // needs none): a path that does not exist leaves it to its normal time.
        cfg.rcu_expedited_knob = self.data.join("no-rcu-expedited");
        if let Some(dir) = self.staging.parent() {
            cfg.allowed_path_roots = vec![dir.to_path_buf()];
        }
        Driver::open(cfg, csi_sys::fake::system().0)
    }

    fn image(&self, id: &str) -> PathBuf {
        self.data.join("pool/volumes").join(format!("{id}.img"))
    }
}

/// What a client (and the node) sees: the volumes with their size, mutable
/// parameters and first bytes, the snapshots with theirs, the group snapshots and
/// what the node has staged.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    volumes: BTreeMap<VolumeId, (u64, BTreeMap<String, String>, String)>,
    snapshots: BTreeMap<SnapshotId, (VolumeId, u64, String)>,
    groups: BTreeSet<String>,
    staged: BTreeSet<VolumeId>,
}

const TAG_LEN: usize = 40;
const DATA: &[u8; TAG_LEN] = b"what the pod wrote, fsynced, volume pl-a";

/// The first bytes of a volume's or snapshot's data, as text.
fn head(path: &Path) -> String {
    let mut buf = vec![0u8; TAG_LEN];
    let n = std::fs::File::open(path)
        .and_then(|f| f.read_at(&mut buf, 0))
        .unwrap_or(0);
    buf.truncate(n);
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .to_string()
}

fn seen(d: &Driver) -> Seen {
    let c = d.controller().unwrap();
    let n = d.node().unwrap();
    let pool = d.default_pool();
    Seen {
        volumes: c
            .volumes
            .all()
            .into_iter()
            .map(|v| {
                let path = pool.volume_path(v.id, v.backing, false);
                (v.id, (v.size, v.mutable_parameters, head(&path)))
            })
            .collect(),
        snapshots: c
            .snapshots
            .all()
            .into_iter()
            .map(|s| {
                let path = pool.snapshot_path(s.id, s.backing);
                (s.id, (s.source_volume, s.size, head(&path)))
            })
            .collect(),
        groups: c
            .groups
            .all()
            .into_iter()
            .map(|g| g.id.to_string())
            .collect(),
        staged: n.node_records.all().into_iter().map(|r| r.id).collect(),
    }
}

/// Nothing half-made: every record whole and ready, its data there with its size
/// and attributes, and nothing else in the pool or the state dir. An image's
/// attributes may also hold the values of the call in flight (`pending`): they are
/// written before the record that commits them, and its retry writes both.
fn check_clean(d: &Driver, dirs: &Dirs, pending: Option<&Seen>) -> std::result::Result<(), String> {
    let c = d.controller().unwrap();
    let pool = d.default_pool();
    let mut want_volumes = BTreeSet::new();
    for v in c.volumes.all() {
        if v.state != RecordState::Ready || v.pending_size.is_some() {
            return Err(format!("volume {} left {:?}", v.id, v.state));
        }
        let path = pool.volume_path(v.id, v.backing, false);
        let len = std::fs::metadata(&path).map(|m| m.len());
        if len.as_ref().ok() != Some(&v.size) {
            return Err(format!("volume {} of {} bytes has {len:?}", v.id, v.size));
        }
        for (k, val) in &v.mutable_parameters {
            let have = csi_sys::xattr::get(&path, &format!("example-csi.{k}")).unwrap();
            let in_flight = pending
                .and_then(|p| p.volumes.get(&v.id))
                .and_then(|p| p.1.get(k));
            let have_text = have.as_deref().map(String::from_utf8_lossy);
            if have_text.as_deref() != Some(val.as_str())
                && have_text.as_deref() != in_flight.map(String::as_str)
            {
                return Err(format!(
                    "volume {}: {k}={val} recorded, image has {have:?}",
                    v.id
                ));
            }
        }
        want_volumes.insert(format!("{}.img", v.id));
    }
    let mut want_snapshots = BTreeSet::new();
    for s in c.snapshots.all() {
        if s.state != RecordState::Ready {
            return Err(format!("snapshot {} left {:?}", s.id, s.state));
        }
        let path = pool.snapshot_path(s.id, s.backing);
        let len = std::fs::metadata(&path).map(|m| m.len());
        if len.as_ref().ok() != Some(&s.size) {
            return Err(format!("snapshot {} of {} bytes has {len:?}", s.id, s.size));
        }
        want_snapshots.insert(format!("{}.img", s.id));
    }
    let names = |dir: &str| -> BTreeSet<String> {
        std::fs::read_dir(dirs.data.join(dir))
            .map(|r| {
                r.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    if names("pool/volumes") != want_volumes {
        return Err(format!(
            "pool volumes {:?}, records {want_volumes:?}",
            names("pool/volumes")
        ));
    }
    if names("pool/snapshots") != want_snapshots {
        return Err(format!(
            "pool snapshots {:?}, records {want_snapshots:?}",
            names("pool/snapshots")
        ));
    }
    if !names("state/shared/frozen").is_empty() {
        return Err(format!(
            "freeze markers left: {:?}",
            names("state/shared/frozen")
        ));
    }
    let mut stack = vec![dirs.data.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // The files of removed locks are kept, as spares, on purpose.
            let spare = csi_sys::flock::is_spare(&name) && dir.ends_with("state/shared/locks");
            if (name.starts_with('.') && !spare) || name.ends_with(".corrupt") {
                return Err(format!("{} left", e.path().display()));
            }
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
    Ok(())
}

/// A call of the workload: on the driver, with the recording while recording.
type Call = dyn Fn(&Driver, &Dirs, Option<&Recording>) -> Result<()>;

/// One call of the workload, made again as its retry.
struct Step {
    name: &'static str,
    run: Box<Call>,
}

fn step(
    name: &'static str,
    run: impl Fn(&Driver, &Dirs, Option<&Recording>) -> Result<()> + 'static,
) -> Step {
    Step {
        name,
        run: Box::new(run),
    }
}

fn vid(name: &str) -> String {
    VolumeId::for_name(name).to_string()
}

fn cap() -> Capability {
    Capability::mount("ext4", AccessMode::SingleNodeWriter)
}

fn params(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn create(name: &'static str, source: Option<ContentSource>) -> Step {
    step("create volume", move |d, _, _| {
        d.controller()
            .unwrap()
            .create_volume(CreateVolume {
                name: name.into(),
                capacity: CapacityRange::at_least(64 * MIB as i64),
                capabilities: vec![cap()],
                mutable_parameters: params(&[("readAheadKiB", "512")]),
                source,
                ..Default::default()
            })
            .map(drop)
    })
}

/// The workload: every kind of record the state keeps is made, changed and removed.
fn workload() -> Vec<Step> {
    let snap = || SnapshotId::for_name("pl-snap").to_string();
    vec![
        create("pl-a", None),
        step("stage", |d, dirs, _| {
            d.node().unwrap().node_stage(Stage {
                volume_id: vid("pl-a"),
                staging_path: dirs.staging.display().to_string(),
                capability: Some(cap()),
                volume_context: BTreeMap::new(),
            })
        }),
        step("write data", |_, dirs, rec| {
            let image = dirs.image(&vid("pl-a"));
            match rec {
                Some(rec) => rec.write_durably(&image, 0, DATA),
                None => std::fs::OpenOptions::new()
                    .write(true)
                    .open(&image)
                    .and_then(|f| f.write_all_at(DATA, 0).and_then(|()| f.sync_all()))
                    .map_err(|e| crate::Error::internal(format!("{}: {e}", image.display())))?,
            }
            Ok(())
        }),
        step("snapshot a staged volume", |d, _, _| {
            d.controller()
                .unwrap()
                .create_snapshot("pl-snap", &vid("pl-a"), &BTreeMap::new())
                .map(drop)
        }),
        step("unstage", |d, dirs, _| {
            d.node()
                .unwrap()
                .node_unstage(&vid("pl-a"), &dirs.staging.display().to_string())
        }),
        step("expand", |d, _, _| {
            let range = CapacityRange {
                required: 128 * MIB as i64,
                limit: 0,
            };
            d.controller()
                .unwrap()
                .expand_volume(&vid("pl-a"), range, None)
                .map(drop)
        }),
        step("modify", |d, _, _| {
            d.controller()
                .unwrap()
                .modify_volume(&vid("pl-a"), &params(&[("readAheadKiB", "1024")]))
        }),
        create(
            "pl-restored",
            Some(ContentSource::Snapshot(SnapshotId::for_name("pl-snap"))),
        ),
        create(
            "pl-clone",
            Some(ContentSource::Volume(VolumeId::for_name("pl-a"))),
        ),
        step("group snapshot", |d, _, _| {
            d.controller()
                .unwrap()
                .create_group_snapshot(
                    "pl-group",
                    &[vid("pl-a"), vid("pl-clone")],
                    &BTreeMap::new(),
                )
                .map(drop)
        }),
        step("delete group snapshot", |d, _, _| {
            let c = d.controller().unwrap();
            let Some(g) = c.groups.all().into_iter().next() else {
                return Ok(());
            };
            let members: Vec<String> = g.members.iter().map(|s| s.to_string()).collect();
            c.delete_group_snapshot(&g.id.to_string(), &members)
        }),
        step("delete snapshot", move |d, _, _| {
            d.controller().unwrap().delete_snapshot(&snap())
        }),
        step("delete volume", |d, _, _| {
            d.controller().unwrap().delete_volume(&vid("pl-clone"))
        }),
        step("delete volume", |d, _, _| {
            d.controller().unwrap().delete_volume(&vid("pl-restored"))
        }),
        step("delete volume", |d, _, _| {
            d.controller().unwrap().delete_volume(&vid("pl-a"))
        }),
    ]
}

#[test]
fn a_power_loss_at_any_step_loses_nothing_acknowledged_and_leaves_nothing_half_made() {
    // The workload's compactions fold a few images each: an fsync each.
    power_loss_at_every_step(None);
}

#[test]
fn a_power_loss_at_any_step_with_compactions_that_sync_the_pool_filesystem() {
    // Every compaction makes the images it folds durable with one syncfs.
    power_loss_at_every_step(Some(1));
}

/// Runs the workload once, recording its file-system operations, then starts
/// the driver on every state a power loss could leave and retries the call in
/// flight. `syncfs_from` is how many images a compaction's barrier needs before
/// it syncs the pool's filesystem instead of each image.
fn power_loss_at_every_step(syncfs_from: Option<usize>) {
    // Journals small enough that the workload compacts them several times, on the
    // path of its calls, so that the compactions' steps are crash points too.
    crate::store::TEST_TUNING.with(|t| {
        t.set(Some(crate::store::Tuning {
            compact_at: 2048,
            inline: true,
        }))
    });
    crate::core::blank::TEST_SYNCFS_FROM.with(|c| c.set(syncfs_from));
    let dirs = Dirs::new();
    let steps = workload();

    // The recorded run. `after[j]` is what is seen once j calls returned (the
    // first start counts as the call 0).
    let start = Model::scan(&dirs.data);
    let rec = Recording::start(&dirs.data);
    let driver = dirs.open().expect("first start");
    rec.mark("started");
    let mut after = vec![seen(&driver)];
    for s in &steps {
        (s.run)(&driver, &dirs, Some(&rec)).unwrap_or_else(|e| panic!("{}: {e}", s.name));
        rec.mark(s.name);
        after.push(seen(&driver));
    }
    drop(driver);
    // Freeze markers are written without a sync (a freeze ends with the kernel
    // that holds it), and a start removes whatever a power loss leaves of them,
    // readable or not (unit tests: `controller::tests::freeze`). Left in, their
    // writes would never be synced and would multiply every later crash point's
    // states by theirs; they are taken out of the replay.
    let frozen = dirs.data.join("state/shared/frozen");
    let mut ops = rec.ops();
    ops.retain(|op| {
        op.path()
            .is_none_or(|p| p.parent() != Some(frozen.as_path()))
    });
    drop(rec);
    // Which way the compactions made their images durable.
    let pool_syncs = ops
        .iter()
        .filter(|op| matches!(op, FsOp::SyncFs { path } if path.ends_with("volumes")))
        .count();
    assert_eq!(
        pool_syncs > 0,
        syncfs_from.is_some(),
        "syncs of the pool's filesystem by compactions: {pool_syncs}"
    );
    // Journal batches within the room are written and synced in one call
    // (RWF_DSYNC, the model's rule 7); those that grow it, in two.
    let one_call = ops
        .iter()
        .filter(|op| matches!(op, FsOp::SyncRange { .. }))
        .count();
    assert!(one_call > 0, "no journal write took the one-call path");
    assert!(
        after[4].snapshots.values().all(|s| s.2.as_bytes() == DATA),
        "the snapshot holds the data: {:?}",
        after[4]
    );

    // The model must end where the real run did, or the recording missed an
    // operation and the states below would be made up.
    let mut model = start.clone();
    for op in &ops {
        model.apply(op);
    }
    let normal = |t: Tree| -> Tree {
        t.into_iter()
            .map(|(p, d)| (p, d.map(|d| d.normalized())))
            .collect()
    };
    assert_eq!(
        normal(model.current()),
        normal(read_tree(&dirs.data)),
        "the model and the real tree differ"
    );

    let mut model = start;
    // Calls acknowledged so far: the first start is call 0 and `after[i]` what
    // call i left; whether an operation of the next call already ran.
    let mut done = 0;
    let mut started = false;
    let mut checked = BTreeSet::new();
    let (mut states, mut points, mut retries) = (0, 0, 0);
    let mut failures = Vec::new();
    for k in 0..=ops.len() {
        if k > 0 {
            match &ops[k - 1] {
                FsOp::Mark(_) => {
                    done += 1;
                    started = false;
                    continue;
                }
                op => {
                    model.apply(op);
                    started = true;
                }
            }
        }
        points += 1;
        // The call in flight, whose effect may or may not be there.
        let in_flight = (started && done < after.len()).then_some(done);
        for tree in model.crash_states() {
            if !checked.insert((tree.clone(), done, started)) {
                continue;
            }
            states += 1;
            model.rebuild(&tree);
            let what = format!(
                "crash after op {k} ({:?}), {done} calls acknowledged",
                ops.get(k.wrapping_sub(1))
            );
            let d = match dirs.open() {
                Ok(d) => d,
                Err(e) => {
                    failures.push(format!("{what}: start failed: {e}"));
                    continue;
                }
            };
            let now = seen(&d);
            let before = &after[done.saturating_sub(1)];
            let ok = now == *before || in_flight.is_some_and(|j| now == after[j]);
            if !ok {
                failures.push(format!(
                    "{what}: recovery shows\n  {now:?}\nexpected\n  {before:?}{}",
                    in_flight
                        .map(|j| format!("\nor\n  {:?}", after[j]))
                        .unwrap_or_default()
                ));
            }
            if let Err(e) = check_clean(&d, &dirs, in_flight.map(|j| &after[j])) {
                failures.push(format!("{what}: after recovery: {e}"));
            }
            // The retry: kubelet and the sidecars repeat a call that got no answer.
            if let Some(j) = in_flight.filter(|j| *j > 0) {
                retries += 1;
                let s = &steps[j - 1];
                match (s.run)(&d, &dirs, None) {
                    Err(e) => failures.push(format!("{what}: retry of {} failed: {e}", s.name)),
                    Ok(()) => {
                        let now = seen(&d);
                        if now != after[j] {
                            failures.push(format!(
                                "{what}: after the retry of {}:\n  {now:?}\nexpected\n  {:?}",
                                s.name, after[j]
                            ));
                        }
                        if let Err(e) = check_clean(&d, &dirs, None) {
                            failures.push(format!("{what}: after the retry of {}: {e}", s.name));
                        }
                    }
                }
            }
            if failures.len() > 20 {
                break;
            }
        }
        if failures.len() > 20 {
            break;
        }
    }
    eprintln!(
        "power loss: {} operations, {points} crash points, {states} distinct states started, \
         {retries} retries",
        ops.len()
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    assert!(states > ops.len(), "too few states: {states}");
}
