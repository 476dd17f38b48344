//! The world the domain's unit tests run in: the driver on a pool that is a plain
//! directory and on the stateful fake of the system layer (`csi_sys::fake`), so
//! no root, loop device or mkfs is needed. The fake counts every mount, attach and
//! mkfs, which is how the tests see that the driver did (or did not) do something.
//!
//! Pools live under /var/tmp (disk-backed on common systems): image volumes keep
//! their mutable attributes in user xattrs, which tmpfs may not take.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use csi_sys::fake::FakeState;
use csi_sys::{SysError, System};

use crate::ids::VolumeId;
use crate::model::*;
use crate::node::{Publish, Stage};
use crate::volumes::{CreateVolume, MIB};
use crate::{Config, Driver, Error, Result};

/// One test's world: a pool and a state dir in a temporary directory, the fake
/// system and the driver on them.
pub(crate) struct World {
    /// First, so that it is dropped first: the driver stops before the directory
    /// that holds its state (and its sockets) is removed.
    pub(crate) driver: Option<Driver>,
    pub(crate) tmp: tempfile::TempDir,
    pub(crate) sys: System,
    pub(crate) fake: Arc<FakeState>,
}

pub(crate) fn base_dir() -> PathBuf {
    let var_tmp = Path::new("/var/tmp");
    if var_tmp.is_dir() {
        var_tmp.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

impl World {
    pub(crate) fn new() -> World {
        Self::with(|_| {})
    }

    pub(crate) fn with(tune: impl FnOnce(&mut Config)) -> World {
        let tmp = tempfile::Builder::new()
            .prefix("csi-decisions")
            .tempdir_in(base_dir())
            .unwrap();
        std::fs::create_dir(tmp.path().join("pool")).unwrap();
        std::fs::create_dir(tmp.path().join("pods")).unwrap();
        std::fs::write(tmp.path().join("rcu_expedited"), "0\n").unwrap();
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

    /// The driver's defaults, but for the kernel's switch of expedited grace
    /// periods: a file of the world's own, never the machine's.
    pub(crate) fn config(&self) -> Config {
        let mut cfg = Config::new(
            "node-1",
            &self.tmp.path().join("state"),
            vec![("default".into(), self.tmp.path().join("pool"))],
        );
        cfg.rcu_expedited_knob = self.tmp.path().join("rcu_expedited");
        // The tests' staging and target paths are in their own directory.
        cfg.allowed_path_roots = vec![self.tmp.path().to_path_buf()];
        cfg
    }

    /// Drops the driver and opens a new one on the same state, pool and fake
    /// system, as a restart of the process would.
    pub(crate) fn reopen_with(&mut self, tune: impl FnOnce(&mut Config)) {
        self.driver = None;
        let mut cfg = self.config();
        tune(&mut cfg);
        self.driver = Some(Driver::open(cfg, self.sys.clone()).unwrap());
    }

    pub(crate) fn reopen(&mut self) {
        self.reopen_with(|_| {});
    }

    pub(crate) fn d(&self) -> &Driver {
        self.driver.as_ref().unwrap()
    }

    pub(crate) fn c(&self) -> &crate::Controller {
        self.d().controller().expect("the controller domain")
    }

    pub(crate) fn n(&self) -> &crate::Node {
        self.d().node().expect("the node domain")
    }

    pub(crate) fn state_dir(&self) -> PathBuf {
        self.tmp.path().join("state")
    }

    pub(crate) fn staging(&self) -> PathBuf {
        self.tmp.path().join("staging")
    }

    pub(crate) fn target(&self, name: &str) -> PathBuf {
        self.tmp.path().join("pods").join(name)
    }

    pub(crate) fn pool_files(&self, sub: &str) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.tmp.path().join("pool").join(sub))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Creates an image volume of 64 MiB for `cap`; returns its id.
    pub(crate) fn create(&self, name: &str, cap: Capability) -> String {
        let info = self
            .c()
            .create_volume(CreateVolume {
                name: name.into(),
                capacity: CapacityRange::at_least(64 * MIB as i64),
                capabilities: vec![cap],
                ..Default::default()
            })
            .unwrap();
        info.id.to_string()
    }

    /// Creates an image volume for ext4 (as `create`) and stages it; returns its id.
    pub(crate) fn create_staged(&self, name: &str) -> String {
        let id = self.create(name, ext4());
        self.stage(&id, &ext4()).unwrap();
        id
    }

    pub(crate) fn image(&self, id: &str) -> PathBuf {
        self.n()
            .locate(VolumeId::parse(id).unwrap())
            .expect("volume data")
            .path
    }

    /// Puts a `fs_type` filesystem on the image of volume `id`, as a previous life
    /// of the volume left it: `short_by` bytes smaller than the image (0: all of
    /// it). Gives the image and its size.
    pub(crate) fn format_image(&self, id: &str, fs_type: &str, short_by: u64) -> (PathBuf, u64) {
        let image = self.image(id);
        let size = std::fs::metadata(&image).unwrap().len();
        self.fake.set_filesystem(&image, fs_type, size - short_by);
        (image, size)
    }

    pub(crate) fn stage(&self, id: &str, cap: &Capability) -> Result<()> {
        self.n().node_stage(Stage {
            volume_id: id.into(),
            staging_path: self.staging().display().to_string(),
            capability: Some(cap.clone()),
            volume_context: BTreeMap::new(),
        })
    }

    pub(crate) fn publish(
        &self,
        id: &str,
        target: &Path,
        cap: &Capability,
        read_only: bool,
    ) -> Result<()> {
        self.n().node_publish(Publish {
            volume_id: id.into(),
            staging_path: self.staging().display().to_string(),
            target_path: target.display().to_string(),
            capability: Some(cap.clone()),
            read_only,
            volume_context: BTreeMap::new(),
        })
    }

    pub(crate) fn mounts_at(&self, path: &Path) -> usize {
        self.fake
            .mounts()
            .iter()
            .filter(|m| m.mount_point == path)
            .count()
    }

    pub(crate) fn node_record(&self, id: &str) -> Option<crate::node::NodeRecord> {
        self.n().node_records.get(VolumeId::parse(id).unwrap())
    }
}

pub(crate) fn mount_cap(fs: &str, mode: AccessMode) -> Capability {
    Capability::mount(fs, mode)
}

pub(crate) fn ext4() -> Capability {
    mount_cap("ext4", AccessMode::SingleNodeWriter)
}

pub(crate) fn block() -> Capability {
    Capability {
        access: Access::Block,
        mode: AccessMode::SingleNodeWriter,
    }
}

/// The kind of a failure: its variant without its text. The glue maps each to
/// a gRPC code; these tests assert which one the domain chose.
#[derive(Debug, PartialEq)]
pub(crate) enum Kind {
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
    pub(crate) fn kind(&self) -> Kind {
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

pub(crate) fn kind<T>(r: Result<T>) -> Kind {
    match r {
        Ok(_) => panic!("the call was expected to fail"),
        Err(e) => e.kind(),
    }
}

pub(crate) fn eio(what: &str) -> impl FnOnce() -> SysError + Send + 'static {
    let what = what.to_string();
    move || SysError::syscall(what, "/fake", libc::EIO)
}

pub(crate) fn request(
    name: &str,
    required: i64,
    limit: i64,
    caps: Vec<Capability>,
) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        capacity: CapacityRange { required, limit },
        capabilities: caps,
        ..Default::default()
    }
}

pub(crate) fn params(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The marker a controller writes before it freezes `mountpoint` for the volume
/// `id`, as it lies in `shared/frozen`: what a crash during the freeze leaves.
pub(crate) fn controller_freeze_marker(id: &str, mountpoint: PathBuf, expedited: bool) -> Vec<u8> {
    serde_json::to_vec(&crate::state::FreezeMarker {
        owner: crate::state::Domain::Controller,
        pid: 1,
        volumes: vec![VolumeId::parse(id).unwrap()],
        mountpoints: vec![mountpoint],
        expedited,
    })
    .unwrap()
}
