//! The node finds a volume's loop devices from what its record names, checked
//! against the kernel, and falls back to looking at every device only when the
//! record is wrong. These tests run the domain on the real system (loop devices,
//! mkfs, mounts) beside 50 unrelated loop devices, with a record that names a
//! device now serving another file, and a DeleteVolume of an image that
//! something else has attached.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use csi_storage::model::{AccessMode, Capability, CapacityRange};
use csi_storage::node::{Publish, Stage};
use csi_storage::volumes::{CreateVolume, MIB};
use csi_storage::{Config, Driver, System};
use tonic::Code;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (loop devices, mkfs, mounts): run it as root"
    );
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Detaches `device` and waits until the kernel has let it go: a detach while
/// another process has the device open (a scan reading its status) only marks
/// it to be cleared on that last close.
fn detach(device: &str) {
    run("losetup", &["-d", device]);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while backing_of(device).is_some() {
        assert!(
            std::time::Instant::now() < until,
            "{device} still attached 10 s after its detach"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn backing_of(device: &str) -> Option<String> {
    let n = device.strip_prefix("/dev/")?;
    std::fs::read_to_string(format!("/sys/block/{n}/loop/backing_file"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// A directory for the test with its pool; whatever is left mounted below it or
/// attached from it goes at the end, also when the test fails.
struct Place {
    dir: tempfile::TempDir,
}

impl Place {
    fn new() -> Place {
        // On disk: the pool's images keep attributes in user xattrs.
        let dir = tempfile::Builder::new()
            .prefix("csi-lookups")
            .tempdir_in("/var/tmp")
            .unwrap();
        for d in ["pool", "pods", "others"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        Place { dir }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn driver(&self) -> Driver {
        let mut cfg = Config::new(
            "node-1",
            &self.path("state"),
            vec![("default".into(), self.path("pool"))],
        );
        cfg.allowed_path_roots = vec![self.dir.path().to_path_buf()];
        Driver::open(cfg, System::linux()).unwrap()
    }

    /// Attaches `file` by hand, as something other than the driver would.
    fn losetup(&self, file: &Path) -> String {
        run("losetup", &["-f", "--show", &file.display().to_string()])
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let top = self.dir.path().display().to_string();
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut below: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| m.starts_with(&top))
            .collect();
        below.sort();
        for m in below.iter().rev() {
            let _ = nix::mount::umount2(*m, nix::mount::MntFlags::MNT_DETACH);
        }
        let ours = std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
            .filter(|d| backing_of(d).is_some_and(|b| b.starts_with(&top)));
        for d in ours {
            let _ = Command::new("losetup").args(["-d", &d]).status();
        }
    }
}

fn ext4() -> Capability {
    Capability::mount("ext4", AccessMode::SingleNodeWriter)
}

fn create(d: &Driver, name: &str) -> String {
    d.controller()
        .unwrap()
        .create_volume(CreateVolume {
            name: name.into(),
            capacity: CapacityRange::at_least(64 * MIB as i64),
            capabilities: vec![ext4()],
            ..Default::default()
        })
        .unwrap()
        .id
        .to_string()
}

fn stage(d: &Driver, p: &Place, id: &str) {
    d.node()
        .unwrap()
        .node_stage(Stage {
            volume_id: id.into(),
            staging_path: p.path("staging").display().to_string(),
            capability: Some(ext4()),
            volume_context: BTreeMap::new(),
        })
        .unwrap();
}

fn publish(d: &Driver, p: &Place, id: &str) {
    d.node()
        .unwrap()
        .node_publish(Publish {
            volume_id: id.into(),
            staging_path: p.path("staging").display().to_string(),
            target_path: p.path("pods/t").display().to_string(),
            capability: Some(ext4()),
            read_only: false,
            volume_context: BTreeMap::new(),
        })
        .unwrap();
}

/// The loop devices serving `image`, as the kernel shows them.
fn devices_of(image: &Path) -> Vec<String> {
    let out = run("losetup", &["-j", &image.display().to_string()]);
    out.lines()
        .filter_map(|l| l.split(':').next())
        .map(String::from)
        .collect()
}

/// The node's record of a volume, as the state dir holds it.
fn node_record(p: &Place, id: &str) -> serde_json::Value {
    let raw = csi_storage::core::store::read_raw(&p.path("state/node/staged")).unwrap();
    serde_json::from_slice(&raw[id]).unwrap()
}

#[test]
#[ignore = "needs root: loop devices, mkfs, mounts"]
fn a_stale_recorded_device_among_many_is_neither_trusted_nor_touched() {
    require_root();
    let p = Place::new();
    let mut others = Vec::new();
    for i in 0..50 {
        let f = p.path(&format!("others/{i}.img"));
        std::fs::write(&f, vec![0u8; 4096]).unwrap();
        others.push((p.losetup(&f), f));
    }
    let d = p.driver();
    let id = create(&d, "vol");
    let image = p.path(&format!("pool/volumes/{id}.img"));
    stage(&d, &p, &id);
    let serving = devices_of(&image);
    assert_eq!(serving.len(), 1, "one device serves the staged image");
    drop(d);
    let rec = node_record(&p, &id);
    assert_eq!(
        rec["loop_devices"],
        serde_json::json!([serving[0]]),
        "the record names the device"
    );

    // The record names an unrelated device instead, as after a crash between a
    // detach and its record and the number's reuse; the process starts again.
    let (stale, stale_file) = others[17].clone();
    let mut rec = rec;
    rec["loop_devices"] = serde_json::json!([stale]);
    let bytes = serde_json::to_vec(&rec).unwrap();
    csi_storage::core::store::write_raw(&p.path("state/node/staged"), &id, Some(&bytes)).unwrap();
    let d = p.driver();

    publish(&d, &p, &id);
    let stats = d
        .node()
        .unwrap()
        .node_stats(&id, &p.path("pods/t").display().to_string())
        .unwrap();
    assert!(stats.total_bytes > 0);
    let healed = node_record(&p, &id);
    assert_eq!(
        healed["loop_devices"],
        serde_json::json!([serving[0]]),
        "the record names the real device again"
    );
    let n = d.node().unwrap();
    n.node_unpublish(&id, &p.path("pods/t").display().to_string())
        .unwrap();
    n.node_unstage(&id, &p.path("staging").display().to_string())
        .unwrap();
    assert!(
        devices_of(&image).is_empty(),
        "the volume's device is detached"
    );
    assert_eq!(
        backing_of(&stale).as_deref(),
        Some(stale_file.display().to_string().as_str()),
        "the unrelated device is left alone"
    );
    for (dev, file) in &others {
        assert_eq!(
            backing_of(dev).as_deref(),
            Some(file.display().to_string().as_str())
        );
    }
    d.controller().unwrap().delete_volume(&id).unwrap();
    assert!(!image.exists());
}

#[test]
#[ignore = "needs root: loop devices, mkfs, mounts"]
fn delete_refuses_an_image_attached_by_something_else() {
    require_root();
    let p = Place::new();
    let d = p.driver();
    let id = create(&d, "held");
    let image = p.path(&format!("pool/volumes/{id}.img"));
    let dev = p.losetup(&image);
    let err = d.controller().unwrap().delete_volume(&id).unwrap_err();
    assert_eq!(csi_glue::code(&err), Code::FailedPrecondition, "{err}");
    assert!(err.to_string().contains(&dev), "{err}");
    assert!(image.exists());
    detach(&dev);
    d.controller().unwrap().delete_volume(&id).unwrap();
    assert!(!image.exists());
}

/// A device let go of while another process holds it open is torn down by the
/// kernel only at that close; DeleteVolume waits a moment for it instead of
/// answering that the volume is in use.
#[test]
#[ignore = "needs root: loop devices, mkfs, mounts"]
fn delete_waits_for_a_detached_device_the_kernel_is_still_releasing() {
    require_root();
    let p = Place::new();
    let d = p.driver();
    let id = create(&d, "releasing");
    let image = p.path(&format!("pool/volumes/{id}.img"));
    let dev = p.losetup(&image);
    let held = std::fs::File::open(&dev).unwrap();
    run("losetup", &["-d", &dev]);
    assert_eq!(
        devices_of(&image),
        vec![dev.clone()],
        "held open, the device outlives its detach"
    );
    let closer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
    });
    d.controller().unwrap().delete_volume(&id).unwrap();
    closer.join().unwrap();
    assert!(!image.exists());
    assert!(backing_of(&dev).is_none());
}
