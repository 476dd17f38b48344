//! Unit tests of the domain's decisions, each telling one story: the driver runs on
//! a pool that is a plain directory and on the stateful fake of the system layer
//! (`csi_sys::fake`), so no root, loop device or mkfs is needed. The fake counts
//! every mount, attach and mkfs, which is how these tests see that the driver did
//! (or did not) do something.
//!
//! Pools live under /var/tmp (disk-backed on common systems): image volumes keep
//! their mutable attributes in user xattrs, which tmpfs may not take.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use csi_sys::fake::{FakeOp, FakeState};
use csi_sys::{LoopOptions, MountOptions, SysError, System};

use crate::ids::{SnapshotId, VolumeId};
use crate::model::*;
use crate::node::{Publish, Stage};
use crate::volumes::{CreateVolume, MIB};
use crate::{Config, Driver, Error, Result};

/// One test's world: a pool and a state dir in a temporary directory, the fake
/// system and the driver on them.
struct World {
    tmp: tempfile::TempDir,
    sys: System,
    fake: Arc<FakeState>,
    driver: Option<Driver>,
}

fn base_dir() -> PathBuf {
    let var_tmp = Path::new("/var/tmp");
    if var_tmp.is_dir() {
        var_tmp.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

impl World {
    fn new() -> World {
        Self::with(|_| {})
    }

    fn with(tune: impl FnOnce(&mut Config)) -> World {
        let tmp = tempfile::Builder::new()
            .prefix("csi-decisions")
            .tempdir_in(base_dir())
            .unwrap();
        std::fs::create_dir(tmp.path().join("pool")).unwrap();
        std::fs::create_dir(tmp.path().join("pods")).unwrap();
        let (sys, fake) = csi_sys::fake::system();
        let mut w = World {
            tmp,
            sys,
            fake,
            driver: None,
        };
        w.reopen_with(tune);
        w
    }

    fn config(&self) -> Config {
        Config::new(
            "node-1",
            &self.tmp.path().join("state"),
            vec![("default".into(), self.tmp.path().join("pool"))],
        )
    }

    /// Drops the driver and opens a new one on the same state, pool and fake
    /// system, as a restart of the process would.
    fn reopen_with(&mut self, tune: impl FnOnce(&mut Config)) {
        self.driver = None;
        let mut cfg = self.config();
        tune(&mut cfg);
        self.driver = Some(Driver::open(cfg, self.sys.clone()).unwrap());
    }

    fn reopen(&mut self) {
        self.reopen_with(|_| {});
    }

    fn d(&self) -> &Driver {
        self.driver.as_ref().unwrap()
    }

    fn c(&self) -> &crate::Controller {
        self.d().controller().expect("the controller domain")
    }

    fn n(&self) -> &crate::Node {
        self.d().node().expect("the node domain")
    }

    fn state_dir(&self) -> PathBuf {
        self.tmp.path().join("state")
    }

    fn staging(&self) -> PathBuf {
        self.tmp.path().join("staging")
    }

    fn target(&self, name: &str) -> PathBuf {
        self.tmp.path().join("pods").join(name)
    }

    fn pool_files(&self, sub: &str) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.tmp.path().join("pool").join(sub))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Creates an image volume of 64 MiB for `cap`; returns its id.
    fn create(&self, name: &str, cap: Capability) -> String {
        let info = self
            .c()
            .create_volume(CreateVolume {
                name: name.into(),
                capacity: CapacityRange {
                    required: 64 * MIB as i64,
                    limit: 0,
                },
                capabilities: vec![cap],
                ..Default::default()
            })
            .unwrap();
        info.record.id.to_string()
    }

    fn image(&self, id: &str) -> PathBuf {
        self.n()
            .locate(VolumeId::parse(id).unwrap())
            .expect("volume data")
            .path
    }

    fn stage(&self, id: &str, cap: &Capability) -> Result<()> {
        self.n().node_stage(Stage {
            volume_id: id.into(),
            staging_path: self.staging().display().to_string(),
            capability: Some(cap.clone()),
            volume_context: BTreeMap::new(),
        })
    }

    fn publish(&self, id: &str, target: &Path, cap: &Capability, read_only: bool) -> Result<()> {
        self.n().node_publish(Publish {
            volume_id: id.into(),
            staging_path: self.staging().display().to_string(),
            target_path: target.display().to_string(),
            capability: Some(cap.clone()),
            read_only,
            volume_context: BTreeMap::new(),
        })
    }

    fn mounts_at(&self, path: &Path) -> usize {
        self.fake
            .mounts()
            .iter()
            .filter(|m| m.mount_point == path)
            .count()
    }

    fn node_record(&self, id: &str) -> Option<crate::node::NodeRecord> {
        self.n().node_records.get(VolumeId::parse(id).unwrap())
    }
}

fn mount_cap(fs: &str, mode: AccessMode) -> Capability {
    Capability {
        access: Access::Mount {
            fs_type: fs.into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        },
        mode,
    }
}

fn ext4() -> Capability {
    mount_cap("ext4", AccessMode::SingleNodeWriter)
}

fn block() -> Capability {
    Capability {
        access: Access::Block,
        mode: AccessMode::SingleNodeWriter,
    }
}

/// The kind of a failure: its variant without its text. The glue maps each to
/// a gRPC code; these tests assert which one the domain chose.
#[derive(Debug, PartialEq)]
enum Kind {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    OutOfRange,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    Cancelled,
    StateInUse,
    System,
    Cleanup,
    Internal,
}

impl Error {
    fn kind(&self) -> Kind {
        match self {
            Error::InvalidArgument(_) => Kind::InvalidArgument,
            Error::NotFound(_) => Kind::NotFound,
            Error::AlreadyExists(_) => Kind::AlreadyExists,
            Error::OutOfRange(_) => Kind::OutOfRange,
            Error::ResourceExhausted(_) => Kind::ResourceExhausted,
            Error::FailedPrecondition(_) => Kind::FailedPrecondition,
            Error::Aborted(_) => Kind::Aborted,
            Error::Cancelled(_) => Kind::Cancelled,
            Error::StateInUse(_) => Kind::StateInUse,
            Error::System { .. } => Kind::System,
            Error::Cleanup { .. } => Kind::Cleanup,
            Error::Internal(_) => Kind::Internal,
        }
    }
}

fn kind<T>(r: Result<T>) -> Kind {
    match r {
        Ok(_) => panic!("the call was expected to fail"),
        Err(e) => e.kind(),
    }
}

fn eio(what: &str) -> impl FnOnce() -> SysError + Send + 'static {
    let what = what.to_string();
    move || SysError::syscall(what, "/fake", libc::EIO)
}

fn request(name: &str, required: i64, limit: i64, caps: Vec<Capability>) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        capacity: CapacityRange { required, limit },
        capabilities: caps,
        ..Default::default()
    }
}

fn params(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

// ---- node: stage, publish, unpublish, unstage ----

#[test]
fn second_publish_to_the_same_target_mounts_once() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let t = w.target("t1");
    w.publish(&id, &t, &ext4(), false).unwrap();
    w.publish(&id, &t, &ext4(), false).unwrap();
    assert_eq!(w.fake.counters().bind, 1, "the retry does not bind again");
    assert_eq!(w.mounts_at(&t), 1);
    // A retry with another readonly is a conflict, not a second mount.
    assert_eq!(kind(w.publish(&id, &t, &ext4(), true)), Kind::AlreadyExists);
    assert_eq!(w.mounts_at(&t), 1);
}

#[test]
fn second_stage_mounts_once_and_formats_once() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    w.stage(&id, &ext4()).unwrap();
    let c = w.fake.counters();
    assert_eq!((c.attach, c.mkfs, c.mount), (1, 1, 1));
    assert_eq!(w.mounts_at(&w.staging()), 1);
}

#[test]
fn unpublish_of_a_path_not_mounted_succeeds_without_unmounting() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let t = w.target("never-published");
    w.n().node_unpublish(&id, &t.display().to_string()).unwrap();
    // Twice: unpublish is idempotent.
    w.n().node_unpublish(&id, &t.display().to_string()).unwrap();
    // A volume that does not exist at all is fine too.
    let gone = VolumeId::for_name("never-created").to_string();
    w.n()
        .node_unpublish(&gone, &t.display().to_string())
        .unwrap();
    assert_eq!(w.fake.counters().unmount, 0);
}

#[test]
fn unpublish_unmounts_a_published_target_and_removes_it() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let t = w.target("t1");
    w.publish(&id, &t, &ext4(), false).unwrap();
    w.n().node_unpublish(&id, &t.display().to_string()).unwrap();
    assert_eq!(w.fake.counters().unmount, 1);
    assert_eq!(w.mounts_at(&t), 0);
    assert!(!t.exists(), "the target directory publish made is removed");
    assert!(w.node_record(&id).unwrap().targets.is_empty());
}

#[test]
fn unstage_skips_an_unmounted_staging_path_and_detaches_the_loop_device() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    // Someone (a reboot, an admin) unmounted the staging path behind our back.
    w.sys.mounter.unmount(&w.staging()).unwrap();
    let before = w.fake.counters();
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();
    let after = w.fake.counters();
    assert_eq!(after.unmount, before.unmount, "nothing to unmount");
    assert_eq!(after.detach, before.detach + 1);
    assert!(w.fake.loops().is_empty());
    assert!(w.node_record(&id).is_none());
    // Again: nothing left to do, and still success.
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();
    assert_eq!(w.fake.counters().detach, after.detach);
}

#[test]
fn unstage_refuses_while_a_target_is_still_published() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let t = w.target("t1");
    w.publish(&id, &t, &ext4(), false).unwrap();
    let err = w.n().node_unstage(&id, &w.staging().display().to_string());
    assert_eq!(kind(err), Kind::FailedPrecondition);
    assert_eq!(w.fake.counters().unmount, 0);
    assert_eq!(w.fake.loops().len(), 1);
}

#[test]
fn a_filesystem_already_on_the_device_is_never_reformatted() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let image = w.image(&id);
    let size = std::fs::metadata(&image).unwrap().len();
    // A previous life of this volume made the filesystem.
    w.fake.set_filesystem(&image, "ext4", size);

    // A request for another filesystem is refused, and nothing is formatted.
    let err = w.stage(&id, &mount_cap("xfs", AccessMode::SingleNodeWriter));
    assert_eq!(kind(err), Kind::InvalidArgument);
    assert_eq!(w.fake.counters().mkfs, 0);
    assert_eq!(w.fake.counters().mount, 0);
    assert_eq!(w.fake.filesystem(&image).unwrap().fstype, "ext4");

    // The right one (or none named) mounts what is there, after a check.
    w.stage(&id, &ext4()).unwrap();
    let c = w.fake.counters();
    assert_eq!(c.mkfs, 0);
    assert_eq!(c.check, 1);
    assert_eq!(c.mount, 1);
    assert_eq!(w.node_record(&id).unwrap().fs_type.as_deref(), Some("ext4"));
}

#[test]
fn a_filesystem_smaller_than_its_device_is_grown_not_remade() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let image = w.image(&id);
    let size = std::fs::metadata(&image).unwrap().len();
    // The controller grew the image while the volume was not staged.
    w.fake.set_filesystem(&image, "ext4", size - 16 * MIB);
    w.stage(&id, &ext4()).unwrap();
    let c = w.fake.counters();
    assert_eq!((c.mkfs, c.grow), (0, 1));
    assert_eq!(w.fake.filesystem(&image).unwrap().size, size);
}

#[test]
fn stage_reuses_an_attached_loop_device() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let image = w.image(&id);
    // Attached by an earlier stage that crashed before it recorded anything.
    let dev = w.sys.loops.attach(&image, LoopOptions::default()).unwrap();
    w.stage(&id, &ext4()).unwrap();
    assert_eq!(w.fake.counters().attach, 1, "no second attach");
    assert_eq!(w.fake.loops().len(), 1);
    let m = w
        .fake
        .mounts()
        .into_iter()
        .find(|m| m.mount_point == w.staging())
        .unwrap();
    assert_eq!(Path::new(&m.source), dev.device);
}

#[test]
fn a_read_only_loop_device_is_not_reused_for_staging() {
    let w = World::new();
    let id = w.create("pvc-a", block());
    let image = w.image(&id);
    w.sys
        .loops
        .attach(
            &image,
            LoopOptions {
                read_only: true,
                direct_io: false,
            },
        )
        .unwrap();
    w.stage(&id, &block()).unwrap();
    let loops = w.fake.loops();
    assert_eq!(loops.len(), 2);
    assert_eq!(loops.iter().filter(|d| !d.read_only).count(), 1);
}

#[test]
fn something_else_mounted_at_a_target_is_left_alone() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let t = w.target("foreign");
    std::fs::create_dir(&t).unwrap();
    w.fake.set_filesystem(Path::new("/dev/vdz"), "xfs", 1 << 30);
    w.sys
        .mounter
        .mount(Path::new("/dev/vdz"), &t, "xfs", &MountOptions::default())
        .unwrap();
    let before = w.fake.counters();

    assert_eq!(
        kind(w.publish(&id, &t, &ext4(), false)),
        Kind::AlreadyExists
    );
    assert_eq!(
        kind(w.n().node_unpublish(&id, &t.display().to_string())),
        Kind::FailedPrecondition
    );
    // Not even a volume of ours: NOT_FOUND, and the mount stays.
    let gone = VolumeId::for_name("never-created").to_string();
    assert_eq!(
        kind(w.n().node_unpublish(&gone, &t.display().to_string())),
        Kind::NotFound
    );
    let after = w.fake.counters();
    assert_eq!((after.bind, after.unmount), (before.bind, before.unmount));
    assert_eq!(w.mounts_at(&t), 1);
    assert!(t.is_dir());
}

#[test]
fn something_else_mounted_at_the_staging_path_is_left_alone() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    std::fs::create_dir(w.staging()).unwrap();
    w.fake.set_filesystem(Path::new("/dev/vdz"), "xfs", 1 << 30);
    w.sys
        .mounter
        .mount(
            Path::new("/dev/vdz"),
            &w.staging(),
            "xfs",
            &MountOptions::default(),
        )
        .unwrap();
    assert_eq!(kind(w.stage(&id, &ext4())), Kind::AlreadyExists);
    assert_eq!(w.fake.counters().mkfs, 0);
    assert_eq!(
        kind(w.n().node_unstage(&id, &w.staging().display().to_string())),
        Kind::FailedPrecondition
    );
    assert_eq!(w.fake.counters().unmount, 0);
    assert_eq!(w.mounts_at(&w.staging()), 1);
}

#[test]
fn single_node_single_writer_refuses_a_second_writer() {
    let w = World::new();
    let cap = mount_cap("ext4", AccessMode::SingleNodeSingleWriter);
    let id = w.create("pvc-a", cap.clone());
    w.stage(&id, &cap).unwrap();
    let (t1, t2, t3) = (w.target("t1"), w.target("t2"), w.target("t3"));
    w.publish(&id, &t1, &cap, false).unwrap();
    assert_eq!(
        kind(w.publish(&id, &t2, &cap, false)),
        Kind::FailedPrecondition
    );
    assert_eq!(w.mounts_at(&t2), 0);
    assert!(!w.node_record(&id).unwrap().targets.contains_key(&t2));
    // A reader is no writer.
    w.publish(&id, &t3, &cap, true).unwrap();
    // Once the writer is gone, another may come.
    w.n()
        .node_unpublish(&id, &t1.display().to_string())
        .unwrap();
    w.publish(&id, &t2, &cap, false).unwrap();
    assert_eq!(w.mounts_at(&t2), 1);
}

#[test]
fn single_node_writer_allows_two_writers() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    w.publish(&id, &w.target("t2"), &ext4(), false).unwrap();
    assert_eq!(w.fake.counters().bind, 2);
}

#[test]
fn a_failed_first_stage_is_undone_and_a_retry_completes() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.fake.fail_next(FakeOp::Mount, eio("mount"));
    assert_eq!(kind(w.stage(&id, &ext4())), Kind::System);
    // A failed (not crashed) first stage leaves nothing: no record, no device.
    assert!(
        w.node_record(&id).is_none(),
        "the failed stage's record is removed"
    );
    assert_eq!(w.mounts_at(&w.staging()), 0);
    assert_eq!(w.fake.counters().detach, 1, "its loop device is detached");

    w.stage(&id, &ext4()).unwrap();
    let c = w.fake.counters();
    assert_eq!(
        c.mkfs, 1,
        "the retry finds the filesystem the first try made"
    );
    assert_eq!(c.attach, 2, "the retry attaches again");
    assert_eq!(c.mount, 2);
    assert_eq!(w.mounts_at(&w.staging()), 1);
    assert_eq!(w.node_record(&id).unwrap().fs_type.as_deref(), Some("ext4"));
}

#[test]
fn a_failed_bind_at_publish_is_retried_to_one_mount() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let t = w.target("t1");
    w.fake.fail_next(FakeOp::Bind, eio("bind"));
    assert_eq!(kind(w.publish(&id, &t, &ext4(), false)), Kind::System);
    assert!(w.node_record(&id).unwrap().targets.contains_key(&t));
    w.publish(&id, &t, &ext4(), false).unwrap();
    assert_eq!(w.mounts_at(&t), 1);
}

#[test]
fn a_failed_detach_at_unstage_keeps_the_record_for_the_retry() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    w.fake.fail_next(FakeOp::Detach, eio("detach"));
    let staging = w.staging().display().to_string();
    assert_eq!(kind(w.n().node_unstage(&id, &staging)), Kind::System);
    assert!(w.node_record(&id).is_some());
    w.n().node_unstage(&id, &staging).unwrap();
    assert!(w.fake.loops().is_empty());
    assert!(w.node_record(&id).is_none());
}

#[test]
fn publish_before_stage_is_failed_precondition() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    assert_eq!(
        kind(w.publish(&id, &w.target("t1"), &ext4(), false)),
        Kind::FailedPrecondition
    );
    assert_eq!(w.fake.counters().bind, 0);
}

#[test]
fn paths_inside_the_driver_or_the_system_are_refused() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let inside_pool = w.tmp.path().join("pool").join("x");
    let inside_state = w.state_dir().join("x");
    for bad in [
        inside_pool,
        inside_state,
        PathBuf::from("/etc/x"),
        PathBuf::from("relative"),
        w.tmp.path().join("pods/../x"),
    ] {
        assert_eq!(
            kind(w.publish(&id, &bad, &ext4(), false)),
            Kind::InvalidArgument,
            "{}",
            bad.display()
        );
    }
    assert_eq!(w.fake.counters().bind, 0);
}

// ---- mutable attributes on live loop devices ----

fn attr(path: &Path, key: &str) -> Option<String> {
    csi_sys::xattr::get(path, &format!("example-csi.{key}"))
        .unwrap()
        .map(|v| String::from_utf8(v).unwrap())
}

#[test]
fn modify_volume_that_cannot_be_applied_changes_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let image = w.image(&id);
    w.stage(&id, &ext4()).unwrap();
    let dev = w.fake.loops()[0].device.clone();
    let read_ahead = || w.sys.loops.read_ahead_kib(&dev).unwrap();
    let asked = params(&[("directIO", "true"), ("readAheadKiB", "1024")]);
    let unchanged = |what: &str| {
        assert!(!w.fake.loops()[0].direct_io, "{what}: direct I/O put back");
        assert_eq!(
            read_ahead(),
            csi_sys::fake::DEFAULT_READ_AHEAD_KIB,
            "{what}"
        );
        assert_eq!(attr(&image, "directIO"), None, "{what}: attribute put back");
        assert_eq!(attr(&image, "readAheadKiB"), None, "{what}");
        let rec = w.c().get_volume(&id).unwrap().record;
        assert!(rec.mutable_parameters.is_empty(), "{what}: {rec:?}");
    };

    // The kernel refuses direct I/O for good (EINVAL): the parameter cannot be had.
    w.fake.fail_next(FakeOp::SetDirectIo, || {
        SysError::syscall("turn direct I/O on".into(), "/dev/loop0", libc::EINVAL)
    });
    assert_eq!(
        kind(w.c().modify_volume(&id, &asked)),
        Kind::InvalidArgument
    );
    unchanged("direct I/O refused");

    // Direct I/O is set, then the read-ahead fails: the direct I/O is undone.
    w.fake
        .fail_next(FakeOp::SetReadAheadKib, eio("write read_ahead_kb"));
    assert_eq!(kind(w.c().modify_volume(&id, &asked)), Kind::System);
    unchanged("read-ahead failed");

    // The settings of the device cannot even be read: nothing is tried.
    w.fake
        .fail_next(FakeOp::ReadAheadKib, eio("read read_ahead_kb"));
    assert_eq!(kind(w.c().modify_volume(&id, &asked)), Kind::System);
    unchanged("settings unreadable");

    // The retry applies everything.
    w.c().modify_volume(&id, &asked).unwrap();
    assert!(w.fake.loops()[0].direct_io);
    assert_eq!(read_ahead(), 1024);
    assert_eq!(attr(&image, "directIO").as_deref(), Some("true"));
    assert_eq!(
        w.c().get_volume(&id).unwrap().record.mutable_parameters,
        asked
    );

    // A change that fails on a volume with values already set puts those back.
    w.fake
        .fail_next(FakeOp::SetReadAheadKib, eio("write read_ahead_kb"));
    let r = w.c().modify_volume(
        &id,
        &params(&[("directIO", "false"), ("readAheadKiB", "64")]),
    );
    assert_eq!(kind(r), Kind::System);
    assert!(w.fake.loops()[0].direct_io);
    assert_eq!(read_ahead(), 1024);
    assert_eq!(attr(&image, "readAheadKiB").as_deref(), Some("1024"));
    assert_eq!(
        w.c().get_volume(&id).unwrap().record.mutable_parameters,
        asked
    );
}

#[test]
fn modify_volume_not_staged_here_is_recorded_for_the_next_stage() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let asked = params(&[("directIO", "true"), ("readAheadKiB", "512")]);
    w.c().modify_volume(&id, &asked).unwrap();
    assert_eq!(w.fake.counters().set_direct_io, 0, "no device to change");
    w.stage(&id, &ext4()).unwrap();
    let dev = &w.fake.loops()[0];
    assert!(dev.direct_io);
    assert_eq!(w.sys.loops.read_ahead_kib(&dev.device).unwrap(), 512);
}

#[test]
fn stage_that_cannot_apply_the_recorded_settings_fails_and_leaves_nothing() {
    let w = World::new();
    let mut req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    req.mutable_parameters = params(&[("readAheadKiB", "1024")]);
    let id = w.c().create_volume(req).unwrap().record.id.to_string();
    let nothing_left = |what: &str| {
        assert!(w.fake.loops().is_empty(), "{what}: loop device detached");
        assert!(w.fake.mounts().is_empty(), "{what}: nothing mounted");
        assert!(w.node_record(&id).is_none(), "{what}: no node record");
    };

    w.fake
        .fail_next(FakeOp::SetReadAheadKib, eio("write read_ahead_kb"));
    assert_eq!(kind(w.stage(&id, &ext4())), Kind::System);
    nothing_left("read-ahead failed");

    // An attribute that cannot be understood is an error, not "not set".
    let image = w.image(&id);
    csi_sys::xattr::set(&image, "example-csi.readAheadKiB", b"lots").unwrap();
    let err = w.stage(&id, &ext4()).unwrap_err();
    assert_eq!(err.kind(), Kind::Internal);
    assert!(err.to_string().contains("readAheadKiB"), "{err}");
    nothing_left("damaged attribute");

    csi_sys::xattr::set(&image, "example-csi.readAheadKiB", b"1024").unwrap();
    w.stage(&id, &ext4()).unwrap();
    let dev = &w.fake.loops()[0];
    assert_eq!(w.sys.loops.read_ahead_kib(&dev.device).unwrap(), 1024);
}

// ---- NodeExpandVolume ----

fn node_expand(w: &World, id: &str, required: u64) -> Result<u64> {
    w.n().node_expand(
        id,
        &w.staging().display().to_string(),
        CapacityRange {
            required: required as i64,
            limit: 0,
        },
        None,
    )
}

#[test]
fn node_expand_to_the_size_a_volume_has_grows_nothing() {
    let w = World::new();
    for (fs, size) in [("ext4", 64 * MIB), ("xfs", 300 * MIB), ("btrfs", 128 * MIB)] {
        let cap = mount_cap(fs, AccessMode::SingleNodeWriter);
        let id = w
            .c()
            .create_volume(request(
                &format!("pvc-{fs}"),
                size as i64,
                0,
                vec![cap.clone()],
            ))
            .unwrap()
            .record
            .id
            .to_string();
        w.stage(&id, &cap).unwrap();
        let grown = w.fake.counters().grow;
        assert_eq!(node_expand(&w, &id, size).unwrap(), size, "{fs}: same size");
        assert_eq!(
            node_expand(&w, &id, size / 2).unwrap(),
            size,
            "{fs}: smaller"
        );
        assert_eq!(node_expand(&w, &id, 0).unwrap(), size, "{fs}: no size");
        assert_eq!(w.fake.counters().grow, grown, "{fs}: no grow was tried");
        w.n()
            .node_unstage(&id, &w.staging().display().to_string())
            .unwrap();
    }
}

#[test]
fn node_expand_grows_what_is_smaller_and_refuses_a_btrfs_below_256_mib() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    assert_eq!(node_expand(&w, &id, 96 * MIB).unwrap(), 96 * MIB);
    assert_eq!(w.fake.counters().grow, 1);
    assert_eq!(node_expand(&w, &id, 96 * MIB).unwrap(), 96 * MIB);
    assert_eq!(w.fake.counters().grow, 1, "the retry grows nothing");
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();

    // The kernel resizes no btrfs to less than 256 MiB: said, not tried.
    let cap = mount_cap("btrfs", AccessMode::SingleNodeWriter);
    let id = w
        .c()
        .create_volume(request("pvc-b", 128 * MIB as i64, 0, vec![cap.clone()]))
        .unwrap()
        .record
        .id
        .to_string();
    w.stage(&id, &cap).unwrap();
    let err = node_expand(&w, &id, 200 * MIB).unwrap_err();
    assert_eq!(err.kind(), Kind::OutOfRange, "{err}");
    assert!(err.to_string().contains("256 MiB"), "{err}");
    assert_eq!(w.fake.counters().grow, 1);
    // Staged again at that size, it is mounted as it is.
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();
    w.stage(&id, &cap).unwrap();
    assert_eq!(w.fake.counters().grow, 1);
    assert_eq!(node_expand(&w, &id, 256 * MIB).unwrap(), 256 * MIB);
    assert_eq!(w.fake.counters().grow, 2);
}

// ---- freezing around snapshots ----

#[test]
fn a_snapshot_of_a_staged_image_freezes_and_thaws() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let snap = w
        .c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    let c = w.fake.counters();
    assert_eq!((c.freeze, c.thaw), (1, 1));
    assert!(!w.fake.is_frozen(&w.staging()));
    assert_eq!(w.pool_files("snapshots"), vec![format!("{}.img", snap.id)]);
    let markers = std::fs::read_dir(w.state_dir().join("shared/frozen"))
        .unwrap()
        .count();
    assert_eq!(markers, 0, "the freeze marker is removed after the thaw");
}

#[test]
fn a_snapshot_of_an_unstaged_image_freezes_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    let c = w.fake.counters();
    assert_eq!((c.freeze, c.thaw), (0, 0));
}

#[test]
fn a_failed_snapshot_copy_still_thaws() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    // The copy cannot create its destination: something is in its way.
    let sid = SnapshotId::for_name("snap-1");
    let blocker = w
        .tmp
        .path()
        .join("pool/snapshots")
        .join(format!("{sid}.img"));
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("f"), b"x").unwrap();

    let err = w.c().create_snapshot("snap-1", &id, &BTreeMap::new());
    assert_eq!(kind(err), Kind::System);
    let c = w.fake.counters();
    assert_eq!((c.freeze, c.thaw), (1, 1));
    assert!(!w.fake.is_frozen(&w.staging()));
    assert!(w.c().get_snapshot(&sid.to_string()).is_err());
    let markers = std::fs::read_dir(w.state_dir().join("shared/frozen"))
        .unwrap()
        .count();
    assert_eq!(markers, 0);

    // Nothing is stuck: the retry succeeds and freezes and thaws again.
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert!(!w.fake.is_frozen(&w.staging()));
    assert_eq!(w.fake.counters().thaw, 2);
}

#[test]
fn a_failed_freeze_copies_nothing_and_leaves_nothing_frozen() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    w.fake.fail_next(FakeOp::Freeze, eio("freeze"));
    let err = w.c().create_snapshot("snap-1", &id, &BTreeMap::new());
    assert_eq!(kind(err), Kind::System);
    assert!(!w.fake.is_frozen(&w.staging()));
    assert!(w.pool_files("snapshots").is_empty());
    assert_eq!(w.c().snapshot_count(), 0);
}

#[test]
fn a_failed_thaw_keeps_the_marker_and_the_next_start_thaws() {
    let mut w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    // Every try fails (the thaw is tried four times).
    for _ in 0..4 {
        w.fake.fail_next(FakeOp::Thaw, eio("thaw"));
    }
    // The snapshot itself is made; the thaw failure is logged.
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert!(w.fake.is_frozen(&w.staging()));
    let markers = std::fs::read_dir(w.state_dir().join("shared/frozen"))
        .unwrap()
        .count();
    assert_eq!(markers, 1, "the marker stays for the next start");
    w.reopen();
    assert!(!w.fake.is_frozen(&w.staging()));
    let markers = std::fs::read_dir(w.state_dir().join("shared/frozen"))
        .unwrap()
        .count();
    assert_eq!(markers, 0);
}

#[test]
fn a_call_whose_caller_left_undoes_its_intent_and_freezes_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let token = crate::cancel::Token::new();
    token.cancel();
    let err = token.run(|| w.c().create_snapshot("snap-1", &id, &BTreeMap::new()));
    assert_eq!(kind(err), Kind::Cancelled);
    assert!(!w.fake.is_frozen(&w.staging()));
    assert!(w.pool_files("snapshots").is_empty());
    assert_eq!(w.c().snapshot_count(), 0);
    // The retry of a live caller goes through.
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
}

#[test]
fn a_thaw_that_fails_once_is_tried_again() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    w.fake.fail_next(FakeOp::Thaw, eio("thaw"));
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    assert!(!w.fake.is_frozen(&w.staging()));
    assert!(w
        .state_dir()
        .join("shared/frozen")
        .read_dir()
        .unwrap()
        .next()
        .is_none());
}

#[test]
fn a_freeze_marker_left_by_a_crash_is_thawed_at_open() {
    let mut w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    // A crash between freeze and thaw: frozen, and the marker written before it.
    w.sys.fs.freeze(&w.staging()).unwrap();
    let dir = w.state_dir().join("shared/frozen");
    let marker = |mp: PathBuf| {
        serde_json::to_vec(&crate::state::FreezeMarker {
            owner: crate::state::Domain::Controller,
            pid: 1,
            volumes: vec![VolumeId::parse(&id).unwrap()],
            mountpoints: vec![mp],
        })
        .unwrap()
    };
    std::fs::write(dir.join(format!("{id}.json")), marker(w.staging())).unwrap();
    // A marker naming a path that is no longer mounted does not stop the start.
    std::fs::write(dir.join("other.json"), marker(w.tmp.path().join("gone"))).unwrap();

    w.reopen();
    assert!(!w.fake.is_frozen(&w.staging()));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    assert!(w.d().probe().unwrap());
}

// ---- CreateVolume ----

#[test]
fn create_volume_is_idempotent_and_conflicts_are_already_exists() {
    let w = World::new();
    let req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    let first = w.c().create_volume(req.clone()).unwrap();
    let again = w.c().create_volume(req.clone()).unwrap();
    assert_eq!(first.record, again.record);
    assert_eq!(w.pool_files("volumes").len(), 1);

    // A range the existing size satisfies is the same volume.
    let within = request("pvc-a", 32 * MIB as i64, 128 * MIB as i64, vec![ext4()]);
    assert_eq!(
        w.c().create_volume(within).unwrap().record.id,
        first.record.id
    );

    let bigger = request("pvc-a", 128 * MIB as i64, 0, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(bigger)), Kind::AlreadyExists);
    let other_fs = request(
        "pvc-a",
        64 * MIB as i64,
        0,
        vec![mount_cap("xfs", AccessMode::SingleNodeWriter)],
    );
    assert_eq!(kind(w.c().create_volume(other_fs)), Kind::AlreadyExists);
    let as_block = request("pvc-a", 64 * MIB as i64, 0, vec![block()]);
    assert_eq!(kind(w.c().create_volume(as_block)), Kind::AlreadyExists);
    let mut as_dir = req.clone();
    as_dir.parameters = params(&[("kind", "dir")]);
    assert_eq!(kind(w.c().create_volume(as_dir)), Kind::AlreadyExists);
    let mut from_snapshot = req.clone();
    from_snapshot.source = Some(ContentSource::Snapshot(SnapshotId::for_name("s")));
    assert_eq!(
        kind(w.c().create_volume(from_snapshot)),
        Kind::AlreadyExists
    );

    // None of the conflicts changed the volume.
    assert_eq!(w.c().volume_count(), 1);
    let len = std::fs::metadata(w.image(&first.record.id.to_string()))
        .unwrap()
        .len();
    assert_eq!(len, 64 * MIB);
}

#[test]
fn a_create_left_half_done_is_started_over() {
    let w = World::new();
    let req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    let info = w.c().create_volume(req.clone()).unwrap();
    let mut rec = info.record.clone();
    rec.state = RecordState::Creating;
    rec.size = 8 * MIB; // what the crashed attempt was making
    w.c().volumes.put(&rec).unwrap();
    let again = w.c().create_volume(req).unwrap();
    assert_eq!(again.record.state, RecordState::Ready);
    assert_eq!(again.record.size, 64 * MIB);
}

#[test]
fn sizes_are_rounded_to_the_filesystem_minimum_and_whole_mebibytes() {
    let w = World::new();
    let xfs = mount_cap("xfs", AccessMode::SingleNodeWriter);
    let btrfs = mount_cap("btrfs", AccessMode::SingleNodeWriter);
    let cases: Vec<(&str, i64, i64, Vec<Capability>, u64)> = vec![
        ("ext4-one-byte", 1, 0, vec![ext4()], 8 * MIB),
        ("xfs-one-byte", 1, 0, vec![xfs.clone()], 300 * MIB),
        ("btrfs-one-byte", 1, 0, vec![btrfs], 128 * MIB),
        ("block-one-byte", 1, 0, vec![block()], MIB),
        ("odd", 10 * MIB as i64 + 1, 0, vec![ext4()], 11 * MIB),
        // No required size: the default (1 GiB), or the limit if that is less.
        ("default", 0, 0, vec![ext4()], 1024 * MIB),
        ("limit-only", 0, 20 * MIB as i64, vec![ext4()], 20 * MIB),
        // Rounding up to a MiB would pass the limit: 4 KiB rounding instead.
        (
            "tight-limit",
            8 * MIB as i64 + 1,
            8 * MIB as i64 + 4096,
            vec![ext4()],
            8 * MIB + 4096,
        ),
    ];
    for (name, required, limit, caps, want) in cases {
        let info = w
            .c()
            .create_volume(request(name, required, limit, caps))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(info.record.size, want, "{name}");
        let len = std::fs::metadata(w.image(&info.record.id.to_string()))
            .unwrap()
            .len();
        assert_eq!(len, want, "{name}: the image is as large as recorded");
    }
}

#[test]
fn sizes_beyond_the_limit_or_the_pool_are_out_of_range() {
    let w = World::new();
    let xfs = mount_cap("xfs", AccessMode::SingleNodeWriter);
    // The filesystem's minimum does not fit under the limit.
    let small = request("xfs-small", 0, 100 * MIB as i64, vec![xfs]);
    assert_eq!(kind(w.c().create_volume(small)), Kind::OutOfRange);
    let small = request("ext4-small", 1, 4 * MIB as i64, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(small)), Kind::OutOfRange);
    // Larger than the pool's filesystem.
    let huge = request("huge", 1 << 60, 0, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(huge)), Kind::OutOfRange);
    // required above limit is a malformed range.
    let bad = request("bad", 20 * MIB as i64, 10 * MIB as i64, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(bad)), Kind::InvalidArgument);
    let negative = request("negative", -1, 0, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(negative)), Kind::InvalidArgument);
    assert_eq!(w.c().volume_count(), 0);
    assert!(w.pool_files("volumes").is_empty());
}

#[test]
fn bad_parameters_are_invalid_argument_and_make_nothing() {
    let w = World::new();
    let ok = || request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    let with_params = |kv: &[(&str, &str)]| {
        let mut r = ok();
        r.parameters = params(kv);
        r
    };
    let with_caps = |caps: Vec<Capability>| {
        let mut r = ok();
        r.capabilities = caps;
        r
    };
    let mut flags = ext4();
    if let Access::Mount { mount_flags, .. } = &mut flags.access {
        mount_flags.push("suid".into());
    }
    let mut nameless = ok();
    nameless.name = String::new();
    let mut long_name = ok();
    long_name.name = "n".repeat(129);
    let mut elsewhere = ok();
    elsewhere.requisite = vec![params(&[(TOPOLOGY_KEY, "node-2")])];
    let cases: Vec<(&str, CreateVolume, Kind)> = vec![
        (
            "unknown key",
            with_params(&[("color", "red")]),
            Kind::InvalidArgument,
        ),
        (
            "unknown kind",
            with_params(&[("kind", "lvm")]),
            Kind::InvalidArgument,
        ),
        (
            "unknown pool",
            with_params(&[("type", "fast")]),
            Kind::InvalidArgument,
        ),
        (
            "block on dir",
            {
                let mut r = with_params(&[("kind", "dir")]);
                r.capabilities = vec![block()];
                r
            },
            Kind::InvalidArgument,
        ),
        ("no capabilities", with_caps(vec![]), Kind::InvalidArgument),
        (
            "multi-node",
            with_caps(vec![mount_cap("ext4", AccessMode::MultiNodeMultiWriter)]),
            Kind::InvalidArgument,
        ),
        (
            "unknown mode",
            with_caps(vec![mount_cap("ext4", AccessMode::Unknown)]),
            Kind::InvalidArgument,
        ),
        (
            "unknown fs",
            with_caps(vec![mount_cap("ntfs", AccessMode::SingleNodeWriter)]),
            Kind::InvalidArgument,
        ),
        (
            "two filesystems",
            with_caps(vec![ext4(), mount_cap("xfs", AccessMode::SingleNodeWriter)]),
            Kind::InvalidArgument,
        ),
        (
            "unsafe mount flag",
            with_caps(vec![flags]),
            Kind::InvalidArgument,
        ),
        ("no name", nameless, Kind::InvalidArgument),
        ("long name", long_name, Kind::InvalidArgument),
        ("another node", elsewhere, Kind::ResourceExhausted),
    ];
    for (what, req, want) in cases {
        assert_eq!(kind(w.c().create_volume(req)), want, "{what}");
    }
    assert_eq!(w.c().volume_count(), 0);
    assert!(w.pool_files("volumes").is_empty());
    // The k8s-prefixed keys and this node's own topology are accepted.
    let mut fine = with_params(&[("csi.storage.k8s.io/pvc/name", "x"), ("kind", "image")]);
    fine.requisite = vec![params(&[(TOPOLOGY_KEY, "node-1")])];
    w.c().create_volume(fine).unwrap();
}

#[test]
fn mutable_parameters_must_apply_to_the_kind_of_volume() {
    let w = World::new();
    // directIO on an image: kept as an attribute, applied at attach.
    let mut image = request("pvc-img", 64 * MIB as i64, 0, vec![ext4()]);
    image.mutable_parameters = params(&[("directIO", "true"), ("readAheadKiB", "1024")]);
    let info = w.c().create_volume(image).unwrap();
    let id = info.record.id.to_string();
    let path = w.image(&id);
    let attr = csi_sys::xattr::get(&path, "example-csi.directIO").unwrap();
    assert_eq!(attr.as_deref(), Some(&b"true"[..]));
    w.stage(&id, &ext4()).unwrap();
    let dev = &w.fake.loops()[0];
    assert!(
        dev.direct_io,
        "the loop device was attached with direct I/O"
    );
    assert_eq!(w.fake.read_ahead_kib(&dev.device), Some(1024));
    // Modified while staged: applied to the live device at once.
    w.c()
        .modify_volume(&id, &params(&[("directIO", "false")]))
        .unwrap();
    assert!(!w.fake.loops()[0].direct_io);

    // compression means something only on a btrfs subvolume; this pool is not btrfs.
    let mut dir = request("pvc-dir", 64 * MIB as i64, 0, vec![ext4()]);
    dir.parameters = params(&[("kind", "dir")]);
    dir.mutable_parameters = params(&[("compression", "zstd")]);
    assert_eq!(
        kind(w.c().create_volume(dir.clone())),
        Kind::InvalidArgument
    );
    dir.mutable_parameters = params(&[("directIO", "true")]);
    assert_eq!(
        kind(w.c().create_volume(dir.clone())),
        Kind::InvalidArgument
    );
    let mut image = request("pvc-img2", 64 * MIB as i64, 0, vec![ext4()]);
    image.mutable_parameters = params(&[("compression", "zstd")]);
    assert_eq!(
        kind(w.c().create_volume(image.clone())),
        Kind::InvalidArgument
    );
    // Values and names are checked too.
    image.mutable_parameters = params(&[("directIO", "maybe")]);
    assert_eq!(
        kind(w.c().create_volume(image.clone())),
        Kind::InvalidArgument
    );
    image.mutable_parameters = params(&[("readAheadKiB", "65537")]);
    assert_eq!(
        kind(w.c().create_volume(image.clone())),
        Kind::InvalidArgument
    );
    image.mutable_parameters = params(&[("iops", "100")]);
    assert_eq!(kind(w.c().create_volume(image)), Kind::InvalidArgument);
    assert_eq!(w.c().volume_count(), 1);

    // ModifyVolume applies the same rules, and changes nothing when it refuses.
    dir.mutable_parameters = BTreeMap::new();
    let dir_id = w.c().create_volume(dir).unwrap().record.id.to_string();
    assert_eq!(
        kind(
            w.c()
                .modify_volume(&dir_id, &params(&[("compression", "lzo")]))
        ),
        Kind::InvalidArgument
    );
    assert_eq!(
        kind(w.c().modify_volume(
            &id,
            &params(&[("readAheadKiB", "64"), ("compression", "lzo")])
        )),
        Kind::InvalidArgument
    );
    let rec = w.c().get_volume(&id).unwrap().record;
    assert_eq!(
        rec.mutable_parameters,
        params(&[("directIO", "false"), ("readAheadKiB", "1024")])
    );
}

#[test]
fn a_driver_configured_without_a_mutable_parameter_refuses_it() {
    let w = World::with(|c| c.mutable_parameters = vec!["readAheadKiB".into()]);
    let mut image = request("pvc-img", 64 * MIB as i64, 0, vec![ext4()]);
    image.mutable_parameters = params(&[("directIO", "true")]);
    assert_eq!(kind(w.c().create_volume(image)), Kind::InvalidArgument);
}

// ---- ListVolumes, DeleteVolume ----

#[test]
fn list_volumes_pages_with_tokens_and_refuses_foreign_ones() {
    let w = World::new();
    let mut made: Vec<String> = (0..5)
        .map(|i| w.create(&format!("pvc-{i}"), ext4()))
        .collect();
    made.sort();
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = w.c().list_volumes(2, &token).unwrap();
        assert!(page.volumes.len() <= 2);
        pages += 1;
        seen.extend(page.volumes.iter().map(|v| v.record.id.to_string()));
        match page.next_token {
            Some(t) => token = t,
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, made, "every volume once, in id order");
    assert_eq!(w.c().list_volumes(0, "").unwrap().volumes.len(), 5);

    assert_eq!(kind(w.c().list_volumes(2, "not-a-token")), Kind::Aborted);
    assert_eq!(
        kind(w.c().list_volumes(2, &made[0].to_uppercase())),
        Kind::Aborted
    );
    assert_eq!(kind(w.c().list_volumes(-1, "")), Kind::InvalidArgument);
    // A token of a volume deleted since is still a place in the order.
    w.c().delete_volume(&made[1]).unwrap();
    let page = w.c().list_volumes(0, &made[1]).unwrap();
    let ids: Vec<String> = page
        .volumes
        .iter()
        .map(|v| v.record.id.to_string())
        .collect();
    assert_eq!(ids, made[2..].to_vec());
}

#[test]
fn volumes_half_made_are_not_listed() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let mut rec = w.c().volumes.get(VolumeId::parse(&id).unwrap()).unwrap();
    rec.state = RecordState::Creating;
    w.c().volumes.put(&rec).unwrap();
    assert!(w.c().list_volumes(0, "").unwrap().volumes.is_empty());
    assert_eq!(kind(w.c().get_volume(&id)), Kind::NotFound);
}

#[test]
fn delete_of_an_id_that_is_no_uuid_succeeds_and_touches_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let before = w.pool_files("volumes");
    for bogus in ["not-a-uuid", "../volumes", "pvc-a", &id.to_uppercase()] {
        w.c().delete_volume(bogus).unwrap();
    }
    assert_eq!(w.pool_files("volumes"), before);
    assert_eq!(w.c().volume_count(), 1);
    assert_eq!(
        w.fake.counters(),
        Default::default(),
        "no system call at all"
    );
    assert_eq!(kind(w.c().delete_volume("")), Kind::InvalidArgument);
    // A well-formed id of nothing: success too.
    w.c()
        .delete_volume(&VolumeId::for_name("never").to_string())
        .unwrap();
}

#[test]
fn delete_of_a_staged_volume_is_refused_until_unstaged() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    assert_eq!(kind(w.c().delete_volume(&id)), Kind::FailedPrecondition);
    assert_eq!(w.pool_files("volumes").len(), 1);
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();
    w.c().delete_volume(&id).unwrap();
    assert!(w.pool_files("volumes").is_empty());
    assert_eq!(w.c().volume_count(), 0);
}

// ---- the store across restarts ----

#[test]
fn records_survive_a_reopen() {
    let mut w = World::new();
    let mut req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    req.mutable_parameters = params(&[("readAheadKiB", "512")]);
    let made = w.c().create_volume(req).unwrap().record;
    let id = made.id.to_string();
    w.stage(&id, &ext4()).unwrap();
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    let snap = w
        .c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    let node_before = w.node_record(&id).unwrap();

    w.reopen();
    assert_eq!(w.c().get_volume(&id).unwrap().record, made);
    assert_eq!(w.c().get_snapshot(&snap.id.to_string()).unwrap(), snap);
    assert_eq!(w.node_record(&id).unwrap(), node_before);
    // The reopened driver carries on where the first left off: nothing redone.
    let before = w.fake.counters();
    w.stage(&id, &ext4()).unwrap();
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    let after = w.fake.counters();
    assert_eq!(
        (after.mount, after.bind, after.mkfs, after.attach),
        (before.mount, before.bind, before.mkfs, before.attach)
    );
    assert_eq!(w.pool_files("volumes"), vec![format!("{id}.img")]);
}

#[test]
fn an_unreadable_record_is_set_aside_and_its_data_kept() {
    let mut w = World::new();
    let id = w.create("pvc-a", ext4());
    let path = w
        .state_dir()
        .join("controller/volumes")
        .join(format!("{id}.json"));
    std::fs::write(&path, b"{ not json").unwrap();
    w.reopen();
    assert_eq!(w.pool_files("volumes"), vec![format!("{id}.img")]);
    assert!(path.with_extension("corrupt").exists());
    assert_eq!(kind(w.c().get_volume(&id)), Kind::NotFound);
}

// ---- start-up on the node: orphans ----

/// Stages and publishes a volume, then forgets the node record, as if the state
/// dir had been lost; returns the id and the target.
fn orphaned(w: &World) -> (String, PathBuf) {
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    let t = w.target("t1");
    w.publish(&id, &t, &ext4(), false).unwrap();
    w.n()
        .node_records
        .remove(VolumeId::parse(&id).unwrap())
        .unwrap();
    (id, t)
}

#[test]
fn orphan_mounts_are_only_reported_by_default() {
    let mut w = World::new();
    let (_id, t) = orphaned(&w);
    let before = w.fake.counters();
    w.reopen();
    let after = w.fake.counters();
    assert_eq!(
        (after.unmount, after.detach),
        (before.unmount, before.detach)
    );
    assert_eq!(w.mounts_at(&t), 1);
    assert_eq!(w.mounts_at(&w.staging()), 1);
    assert_eq!(w.fake.loops().len(), 1);
}

#[test]
fn orphan_mounts_and_loop_devices_are_cleaned_when_asked() {
    let mut w = World::new();
    let (id, t) = orphaned(&w);
    // A foreign mount and a foreign loop device are never touched.
    let foreign = w.target("foreign");
    w.fake.set_filesystem(Path::new("/dev/vdz"), "xfs", 1 << 30);
    w.sys
        .mounter
        .mount(
            Path::new("/dev/vdz"),
            &foreign,
            "xfs",
            &MountOptions::default(),
        )
        .unwrap();
    let outside = w.tmp.path().join("outside.img");
    csi_sys::file::create_sparse(&outside, 16 * MIB).unwrap();
    w.sys
        .loops
        .attach(&outside, LoopOptions::default())
        .unwrap();

    let outside = std::fs::canonicalize(&outside).unwrap();

    w.reopen_with(|c| c.cleanup_orphans = true);
    assert_eq!(w.mounts_at(&t), 0);
    assert_eq!(w.mounts_at(&w.staging()), 0);
    assert_eq!(w.mounts_at(&foreign), 1);
    let loops = w.fake.loops();
    assert_eq!(loops.len(), 1);
    assert_eq!(loops[0].backing_file, outside);
    // The volume itself is kept, and can be staged again.
    assert_eq!(w.pool_files("volumes"), vec![format!("{id}.img")]);
    w.stage(&id, &ext4()).unwrap();
    assert_eq!(w.fake.counters().mkfs, 1, "its filesystem is found again");
}

#[test]
fn a_staged_volume_is_no_orphan() {
    let mut w = World::with(|c| c.cleanup_orphans = true);
    let id = w.create("pvc-a", ext4());
    w.stage(&id, &ext4()).unwrap();
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    let before = w.fake.counters();
    w.reopen_with(|c| c.cleanup_orphans = true);
    let after = w.fake.counters();
    assert_eq!(
        (after.unmount, after.detach),
        (before.unmount, before.detach)
    );
}

#[test]
fn a_stage_refused_for_its_fs_type_changes_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let image = w.image(&id);
    let size = std::fs::metadata(&image).unwrap().len();
    w.fake.set_filesystem(&image, "ext4", size);
    let err = w.stage(&id, &mount_cap("xfs", AccessMode::SingleNodeWriter));
    assert_eq!(kind(err), Kind::InvalidArgument);
    assert!(w.fake.loops().is_empty(), "no loop device is left attached");
    assert!(w.node_record(&id).is_none(), "no node record is left");
    // Bad input changed nothing: the volume can still be deleted.
    w.c().delete_volume(&id).unwrap();
}

// ---- two processes on one state: the controller and the node plugin ----

impl World {
    /// Another driver on the same state, pool and system, as the other process of
    /// the central deployment: the node plugin when `node`, else a controller.
    fn other(&self, node: bool) -> Result<Driver> {
        let mut cfg = self.config();
        cfg.controller = !node;
        cfg.node = node;
        Driver::open(cfg, self.sys.clone())
    }
}

/// A controller process (the world's driver) and a node process on one state.
fn split() -> (World, Driver) {
    let w = World::with(|c| c.node = false);
    let node = w.other(true).unwrap();
    (w, node)
}

fn stage_on(node: &Driver, w: &World, id: &str, cap: &Capability) -> Result<()> {
    node.node().unwrap().node_stage(Stage {
        volume_id: id.into(),
        staging_path: w.staging().display().to_string(),
        capability: Some(cap.clone()),
        volume_context: BTreeMap::new(),
    })
}

fn unstage_on(node: &Driver, w: &World, id: &str) -> Result<()> {
    node.node()
        .unwrap()
        .node_unstage(id, &w.staging().display().to_string())
}

#[test]
fn a_second_process_of_one_mode_on_one_state_is_refused() {
    let w = World::new();
    for node in [true, false] {
        match w.other(node) {
            Err(e @ crate::Error::StateInUse(_)) => {
                assert!(e.to_string().contains("one process per mode"), "{e}")
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a second process (node={node}) was let in"),
        }
    }
    let (w, node) = split();
    assert!(matches!(w.other(true), Err(crate::Error::StateInUse(_))));
    assert!(matches!(w.other(false), Err(crate::Error::StateInUse(_))));
    drop(node);
    w.other(true)
        .expect("the node's part is free once its process is gone");
}

#[test]
fn each_mode_opens_only_its_own_records() {
    let w = World::with(|c| c.controller = false);
    assert!(w.state_dir().join("node").is_dir());
    assert!(!w.state_dir().join("controller").exists());
    let w = World::with(|c| c.node = false);
    assert!(w.state_dir().join("controller").is_dir());
    assert!(!w.state_dir().join("node").exists());
}

#[test]
fn the_controller_does_not_delete_a_volume_the_node_has_staged() {
    let (w, node) = split();
    let info = w
        .c()
        .create_volume(CreateVolume {
            name: "pvc-dir".into(),
            capacity: CapacityRange {
                required: 64 * MIB as i64,
                limit: 0,
            },
            capabilities: vec![mount_cap("", AccessMode::SingleNodeWriter)],
            parameters: BTreeMap::from([("kind".to_string(), "dir".to_string())]),
            ..Default::default()
        })
        .unwrap();
    let id = info.record.id.to_string();
    stage_on(&node, &w, &id, &mount_cap("", AccessMode::SingleNodeWriter)).unwrap();
    let err = w.c().delete_volume(&id);
    assert_eq!(kind(err), Kind::FailedPrecondition);
    assert_eq!(w.pool_files("volumes"), vec![id.clone()]);
    unstage_on(&node, &w, &id).unwrap();
    w.c().delete_volume(&id).unwrap();
    assert!(w.pool_files("volumes").is_empty());
    assert!(
        std::fs::read_dir(w.state_dir().join("shared/locks"))
            .unwrap()
            .next()
            .is_none(),
        "the lock file of a deleted volume goes with it"
    );
}

#[test]
fn a_controller_without_the_node_refuses_to_change_a_staged_image() {
    let (w, node) = split();
    let id = w.create("pvc-a", ext4());
    stage_on(&node, &w, &id, &ext4()).unwrap();
    let want = BTreeMap::from([("directIO".to_string(), "true".to_string())]);
    assert_eq!(
        kind(w.c().modify_volume(&id, &want)),
        Kind::FailedPrecondition
    );
    let image = w.tmp.path().join(format!("pool/volumes/{id}.img"));
    let attr = csi_sys::xattr::get(&image, "example-csi.directIO").unwrap();
    assert_eq!(attr, None, "nothing recorded");
    assert!(w
        .c()
        .get_volume(&id)
        .unwrap()
        .record
        .mutable_parameters
        .is_empty());
    unstage_on(&node, &w, &id).unwrap();
    w.c().modify_volume(&id, &want).unwrap();
    let attr = csi_sys::xattr::get(&image, "example-csi.directIO").unwrap();
    assert_eq!(
        attr.as_deref(),
        Some(&b"true"[..]),
        "recorded for the next stage"
    );
}

#[test]
fn only_the_controller_thaws_its_freeze_and_the_node_waits_for_it() {
    let (mut w, node) = split();
    let id = w.create("pvc-a", ext4());
    stage_on(&node, &w, &id, &ext4()).unwrap();
    // The controller died during a copy: frozen, its marker written before.
    w.sys.fs.freeze(&w.staging()).unwrap();
    let marker = crate::state::FreezeMarker {
        owner: crate::state::Domain::Controller,
        pid: 1,
        volumes: vec![VolumeId::parse(&id).unwrap()],
        mountpoints: vec![w.staging()],
    };
    std::fs::write(
        w.state_dir().join(format!("shared/frozen/{id}.json")),
        serde_json::to_vec(&marker).unwrap(),
    )
    .unwrap();
    w.driver = None;
    assert_eq!(kind(unstage_on(&node, &w, &id)), Kind::Aborted);
    // The node plugin's restart leaves the controller's freeze alone.
    drop(node);
    let node = w.other(true).unwrap();
    assert!(w.fake.is_frozen(&w.staging()));
    assert_eq!(kind(unstage_on(&node, &w, &id)), Kind::Aborted);
    // The controller's restart thaws it; then the node goes on.
    w.reopen_with(|c| c.node = false);
    assert!(!w.fake.is_frozen(&w.staging()));
    unstage_on(&node, &w, &id).unwrap();
}

#[test]
fn a_copy_holds_the_volume_against_the_node_and_a_node_operation_holds_it_against_a_copy() {
    let (w, node) = split();
    let id = w.create("pvc-a", ext4());
    stage_on(&node, &w, &id, &ext4()).unwrap();
    let vid = VolumeId::parse(&id).unwrap();
    let held = w.c().state.lock_volume(vid).unwrap();
    assert_eq!(kind(unstage_on(&node, &w, &id)), Kind::Aborted);
    drop(held);
    let held = node.node().unwrap().state.lock_volume(vid).unwrap();
    let err = w.c().create_snapshot("snap-1", &id, &BTreeMap::new());
    assert_eq!(kind(err), Kind::Aborted);
    assert_eq!(
        w.c().snapshot_count(),
        0,
        "the refused snapshot left nothing"
    );
    drop(held);
    w.c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    unstage_on(&node, &w, &id).unwrap();
}
