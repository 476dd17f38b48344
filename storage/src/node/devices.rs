//! Which loop devices serve a volume's image, found without looking at every loop
//! device of the node (a node may have hundreds): the node record names the
//! devices the node attached, and each is checked against the kernel alone. Only
//! when the record cannot be trusted (an attach may have happened that it does
//! not name yet, or a device it names no longer serves the image) is every device
//! looked at.

use std::path::{Path, PathBuf};

use csi_sys::{LoopDevice, Loops};

/// The loop devices serving `image`. `recorded` is what the node record names:
/// `Some` when every device the node attached to the image is in it, `None` while
/// an attach may be under way (or for a record that predates the list, or no
/// record at all).
pub(crate) fn serving(
    loops: &dyn Loops,
    image: &Path,
    recorded: Option<&[PathBuf]>,
) -> csi_sys::Result<Vec<LoopDevice>> {
    match recorded {
        Some(list) => {
            let mut found = Vec::with_capacity(list.len());
            for d in list {
                match loops.serving(d, image)? {
                    Some(dev) => found.push(dev),
                    // Detached (a crash between a detach and its record, or by
                    // hand), or the number reused for another file: the record no
                    // longer says it all.
                    None => return loops.find(image),
                }
            }
            Ok(found)
        }
        // Nothing holds the image open for writing: no device serves it read-write,
        // and the node attaches read-only devices only beside a read-write one.
        None if !loops.may_serve(image)? => Ok(Vec::new()),
        None => loops.find(image),
    }
}

/// The devices a record names after `devices` were found and `added` attached.
pub(crate) fn listed(devices: &[LoopDevice], added: Option<&LoopDevice>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = devices.iter().map(|d| d.device.clone()).collect();
    if let Some(a) = added.filter(|a| !out.contains(&a.device)) {
        out.push(a.device.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use csi_sys::LoopOptions;

    /// The fake system's loop devices, counting how they are read: a look at
    /// every device (`list`, which the default `find` goes through), at one
    /// (`serving`), or the question whether any serves a file (`may_serve`, which
    /// the kernel answers from the file alone, and the fake from its state).
    struct Counting {
        inner: Arc<dyn Loops>,
        lists: AtomicUsize,
        single: AtomicUsize,
        probes: AtomicUsize,
    }

    impl Counting {
        fn over(inner: Arc<dyn Loops>) -> Counting {
            Counting {
                inner,
                lists: AtomicUsize::new(0),
                single: AtomicUsize::new(0),
                probes: AtomicUsize::new(0),
            }
        }

        fn reset(&self) {
            for c in [&self.lists, &self.single, &self.probes] {
                c.store(0, Ordering::SeqCst);
            }
        }

        fn counts(&self) -> (usize, usize, usize) {
            (
                self.lists.load(Ordering::SeqCst),
                self.single.load(Ordering::SeqCst),
                self.probes.load(Ordering::SeqCst),
            )
        }
    }

    impl Loops for Counting {
        fn list(&self) -> csi_sys::Result<Vec<LoopDevice>> {
            self.lists.fetch_add(1, Ordering::SeqCst);
            self.inner.list()
        }
        fn serving(&self, device: &Path, backing: &Path) -> csi_sys::Result<Option<LoopDevice>> {
            self.single.fetch_add(1, Ordering::SeqCst);
            // What one device's sysfs tells, without the count of a `list`.
            self.inner.serving(device, backing)
        }
        fn may_serve(&self, backing: &Path) -> csi_sys::Result<bool> {
            self.probes.fetch_add(1, Ordering::SeqCst);
            self.inner.may_serve(backing)
        }
        fn attach(&self, backing: &Path, opts: LoopOptions) -> csi_sys::Result<LoopDevice> {
            self.inner.attach(backing, opts)
        }
        fn detach(&self, device: &Path) -> csi_sys::Result<()> {
            self.inner.detach(device)
        }
        fn refresh_capacity(&self, device: &Path) -> csi_sys::Result<()> {
            self.inner.refresh_capacity(device)
        }
        fn set_direct_io(&self, device: &Path, on: bool) -> csi_sys::Result<()> {
            self.inner.set_direct_io(device, on)
        }
    }

    struct Setup {
        _tmp: tempfile::TempDir,
        loops: Counting,
        image: PathBuf,
        dev: LoopDevice,
    }

    /// An image attached read-write among 50 unrelated attached files.
    fn setup() -> Setup {
        let tmp = tempfile::tempdir().unwrap();
        let (sys, _) = csi_sys::fake::system();
        let rw = LoopOptions {
            read_only: false,
            direct_io: false,
        };
        for i in 0..50 {
            let other = tmp.path().join(format!("other-{i}.img"));
            std::fs::write(&other, b"x").unwrap();
            sys.loops.attach(&other, rw).unwrap();
        }
        let image = tmp.path().join("volume.img");
        std::fs::write(&image, b"x").unwrap();
        let dev = sys.loops.attach(&image, rw).unwrap();
        Setup {
            _tmp: tmp,
            loops: Counting::over(sys.loops.clone()),
            image,
            dev,
        }
    }

    #[test]
    fn a_right_record_reads_only_its_devices() {
        let s = setup();
        let recorded = vec![s.dev.device.clone()];
        let found = serving(&s.loops, &s.image, Some(&recorded)).unwrap();
        assert_eq!(found, vec![s.dev.clone()]);
        assert_eq!(
            s.loops.counts(),
            (0, 1, 0),
            "(lists, single devices, probes)"
        );
    }

    #[test]
    fn a_record_naming_no_device_reads_none() {
        let s = setup();
        s.loops.detach(&s.dev.device).unwrap();
        let found = serving(&s.loops, &s.image, Some(&[])).unwrap();
        assert!(found.is_empty());
        assert_eq!(s.loops.counts(), (0, 0, 0));
    }

    #[test]
    fn a_stale_device_falls_back_to_every_device() {
        let s = setup();
        // The record names a device that serves another file now.
        let recorded = vec![PathBuf::from("/dev/loop0"), s.dev.device.clone()];
        let found = serving(&s.loops, &s.image, Some(&recorded)).unwrap();
        assert_eq!(found, vec![s.dev.clone()]);
        assert_eq!(s.loops.counts().0, 1, "one look at every device");
    }

    #[test]
    fn an_unrecorded_attach_is_found_by_looking_at_every_device() {
        let s = setup();
        let found = serving(&s.loops, &s.image, None).unwrap();
        assert_eq!(found, vec![s.dev.clone()]);
        let (lists, _, probes) = s.loops.counts();
        assert_eq!((lists, probes), (1, 1));
    }

    #[test]
    fn no_record_and_nothing_attached_looks_at_no_device() {
        let s = setup();
        s.loops.detach(&s.dev.device).unwrap();
        assert!(serving(&s.loops, &s.image, None).unwrap().is_empty());
        assert_eq!(s.loops.counts(), (0, 0, 1));
    }

    #[test]
    fn the_list_adds_an_attached_device_once() {
        let s = setup();
        let l = listed(std::slice::from_ref(&s.dev), Some(&s.dev));
        assert_eq!(l, vec![s.dev.device.clone()]);
    }

    /// A volume's whole life on the node, beside 50 unrelated loop devices:
    /// stage, publish (a read-only block target too, which attaches a device of
    /// its own), stats, unpublish, unstage, delete. Not one look at every device.
    #[test]
    fn a_volume_s_life_never_looks_at_every_loop_device() {
        use std::collections::BTreeMap;

        use crate::model::{Access, AccessMode, Capability, CapacityRange};
        use crate::node::{Publish, Stage};
        use crate::volumes::{CreateVolume, MIB};
        use crate::{Config, Driver};

        // Image settings live in user xattrs, which tmpfs may not take.
        let base = Path::new("/var/tmp");
        let tmp = tempfile::Builder::new()
            .prefix("csi-devices")
            .tempdir_in(if base.is_dir() {
                base.to_path_buf()
            } else {
                std::env::temp_dir()
            })
            .unwrap();
        let root = tmp.path();
        for d in ["pool", "pods", "others"] {
            std::fs::create_dir(root.join(d)).unwrap();
        }
        let (fake, _) = csi_sys::fake::system();
        let loops = Arc::new(Counting::over(fake.loops.clone()));
        let sys = csi_sys::System {
            mounter: fake.mounter.clone(),
            loops: loops.clone(),
            fs: fake.fs.clone(),
            boot_id: fake.boot_id.clone(),
        };
        let rw = LoopOptions {
            read_only: false,
            direct_io: false,
        };
        for i in 0..50 {
            let other = root.join(format!("others/{i}.img"));
            std::fs::write(&other, b"x").unwrap();
            fake.loops.attach(&other, rw).unwrap();
        }
        let mut cfg = Config::new(
            "node-1",
            &root.join("state"),
            vec![("default".into(), root.join("pool"))],
        );
        cfg.rcu_expedited_knob = root.join("no-rcu-expedited");
        cfg.allowed_path_roots = vec![root.to_path_buf()];
        let driver = Driver::open(cfg, sys).unwrap();
        let (c, n) = (driver.controller().unwrap(), driver.node().unwrap());
        let path = |p: &str| root.join(p).display().to_string();
        for (name, access) in [
            (
                "fs",
                Access::Mount {
                    fs_type: "ext4".into(),
                    mount_flags: vec![],
                    volume_mount_group: String::new(),
                },
            ),
            ("block", Access::Block),
        ] {
            let cap = Capability {
                access,
                mode: AccessMode::SingleNodeWriter,
            };
            let id = c
                .create_volume(CreateVolume {
                    name: name.into(),
                    capacity: CapacityRange::at_least(64 * MIB as i64),
                    capabilities: vec![cap.clone()],
                    ..Default::default()
                })
                .unwrap()
                .id
                .to_string();
            loops.reset();
            n.node_stage(Stage {
                volume_id: id.clone(),
                staging_path: path("staging"),
                capability: Some(cap.clone()),
                volume_context: BTreeMap::new(),
            })
            .unwrap();
            let targets = [("pods/rw", false), ("pods/ro", true)];
            for (t, read_only) in targets {
                n.node_publish(Publish {
                    volume_id: id.clone(),
                    staging_path: path("staging"),
                    target_path: path(t),
                    capability: Some(cap.clone()),
                    read_only,
                    volume_context: BTreeMap::new(),
                })
                .unwrap();
            }
            n.node_stats(&id, &path("pods/rw")).unwrap();
            let attached = fake.loops.list().unwrap().len();
            let expected = if name == "block" { 52 } else { 51 };
            assert_eq!(attached, expected, "{name}: the volume's own devices");
            for (t, _) in targets {
                n.node_unpublish(&id, &path(t)).unwrap();
            }
            n.node_unstage(&id, &path("staging")).unwrap();
            assert_eq!(fake.loops.list().unwrap().len(), 50, "{name}: all detached");
            c.delete_volume(&id).unwrap();
            assert_eq!(
                loops.lists.load(Ordering::SeqCst),
                0,
                "{name}: a look at every device"
            );
            assert!(
                loops.single.load(Ordering::SeqCst) > 0,
                "{name}: recorded devices checked"
            );
        }
    }
}
