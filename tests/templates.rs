//! Filesystem templates through the real binary: a new volume is marked at
//! create and filled from its template at its first stage (its extents shared
//! with the template), mounts with its own UUID (xfs without nouuid) and keeps
//! data; ext4, xfs and btrfs; a new volume takes the filesystem type its first
//! stage asks for and refuses another once mounted; a
//! pool that cannot reflink formats at stage as before; templates are not
//! orphans, and a template cut short by a crash or damaged is never used; a fill
//! cut short by a crash is made again, and one whose UUID a power loss took in
//! part is formatted anew; a mkfs cut short is made again at the next stage.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use csi_proto::csi;
use tonic::Code;

const GIB: i64 = 1 << 30;

/// Dropped in field order: the driver stops before the pool's Drop unmounts and
/// detaches what a failed test left below it.
struct Fx {
    c: Clients,
    driver: Driver,
    pool: Pool,
}

async fn fixture(pool_fs: &str, envs: &[(&str, &str)]) -> Fx {
    let pool = Pool::new(pool_fs);
    let driver = Driver::start_with_env(&pool, &[], envs);
    let c = driver.clients().await;
    Fx { pool, driver, c }
}

fn cap(fs: &str) -> csi::VolumeCapability {
    mount_cap(fs, writer())
}

impl Fx {
    fn templates(&self) -> PathBuf {
        self.pool.path.join(".templates")
    }

    fn template(&self, fs: &str) -> PathBuf {
        self.templates().join(format!("{fs}-{GIB}-f1.img"))
    }

    fn image(&self, id: &str) -> PathBuf {
        self.pool.path.join("volumes").join(format!("{id}.img"))
    }

    /// Waits for the background worker to finish the template of `fs`.
    fn wait_template(&self, fs: &str) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !self.template(fs).is_file() {
            assert!(Instant::now() < deadline, "no {fs} template was made");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Creates a volume once the template of `fs` exists: its first stage fills
    /// it from the template.
    async fn create_from_template(&mut self, name: &str, fs: &str) -> String {
        self.c
            .create(&format!("{name}-first"), GIB, cap(fs), &[])
            .await;
        self.wait_template(fs);
        let id = self.c.create(name, GIB, cap(fs), &[]).await;
        assert_eq!(pending_mark(&self.image(&id)).as_deref(), Some(fs));
        assert_eq!(fresh_mark(&self.image(&id)), None);
        assert_eq!(blkid(&self.image(&id), "TYPE"), "", "blank until staged");
        id
    }

    /// Stages `id` with the driver set to end at `failpoint`, then starts the
    /// driver again without it.
    async fn crash_stage_at(&mut self, id: &str, fs: &str, failpoint: &str) {
        self.driver.envs = vec![("EXAMPLE_CSI_FAILPOINTS".into(), failpoint.into())];
        self.driver.restart();
        self.c = self.driver.clients().await;
        let staging = self.pool.scratch(&format!("staging-{id}"));
        let r = self
            .c
            .node
            .node_stage_volume(stage_req(id, &staging, cap(fs)))
            .await;
        assert!(r.is_err(), "{failpoint} was not reached");
        assert!(
            self.driver.wait_exit(30).is_some(),
            "the driver ended at {failpoint}"
        );
        self.driver.envs.clear();
        self.driver.spawn();
        self.c = self.driver.clients().await;
    }

    async fn expand(&mut self, id: &str, bytes: i64) {
        let range = csi::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        };
        self.c
            .controller
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: id.to_string(),
                capacity_range: Some(range),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    /// Puts the template's first superblock back into the copy `id`, as a power
    /// loss that kept only some of the writes of its new UUID would.
    fn lose_uuid_writes(&self, id: &str, fs: &str) {
        use std::os::unix::fs::FileExt;
        let mut head = vec![0u8; 128 << 10];
        let template = std::fs::File::open(self.template(fs)).unwrap();
        template.read_exact_at(&mut head, 0).unwrap();
        let copy = std::fs::OpenOptions::new().write(true).open(self.image(id));
        copy.unwrap().write_all_at(&head, 0).unwrap();
    }

    async fn stage_publish(&mut self, id: &str, fs: &str) -> (PathBuf, PathBuf) {
        let staging = self.pool.scratch(&format!("staging-{id}"));
        let target = self.pool.scratch(&format!("target-{id}"));
        self.c
            .stage_and_publish(id, &staging, &target, &cap(fs))
            .await;
        (staging, target)
    }
}

/// The filesystem type a fresh image's mark names (the mark also names its UUID).
fn fresh_mark(image: &Path) -> Option<String> {
    csi_sys::xattr::get(image, "example-csi.freshFilesystem")
        .unwrap()
        .map(|v| String::from_utf8(v).unwrap())
        .map(|v| v.split(' ').next().unwrap_or_default().to_string())
}

/// The filesystem type the pending mark of a new image names.
fn pending_mark(image: &Path) -> Option<String> {
    csi_sys::xattr::get(image, "example-csi.fromTemplate")
        .unwrap()
        .map(|v| String::from_utf8(v).unwrap())
}

/// Whether `image` shares extents with another file (a reflink of a template),
/// as `filefrag -v` shows them.
fn shares_extents(image: &Path) -> bool {
    sh("filefrag", &["-v", image.to_str().unwrap()]).contains("shared")
}

fn mount_options(path: &Path) -> String {
    sh(
        "findmnt",
        &[
            "-n",
            "-o",
            "OPTIONS",
            "--mountpoint",
            path.to_str().unwrap(),
        ],
    )
}

#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_volumes_from_templates_mount_with_their_own_uuid_and_keep_data() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    for fs in ["ext4", "xfs", "btrfs"] {
        let a = fx.create_from_template(&format!("a-{fs}"), fs).await;
        let b = fx.c.create(&format!("b-{fs}"), GIB, cap(fs), &[]).await;

        let (sa, ta) = fx.stage_publish(&a, fs).await;
        let (sb, tb) = fx.stage_publish(&b, fs).await;
        let template_uuid = blkid(&fx.template(fs), "UUID");
        let (ua, ub) = (blkid(&fx.image(&a), "UUID"), blkid(&fx.image(&b), "UUID"));
        assert!(!template_uuid.is_empty());
        assert!(
            ua != template_uuid && ub != template_uuid && ua != ub,
            "{fs}: {ua} {ub}"
        );
        for id in [&a, &b] {
            assert!(
                shares_extents(&fx.image(id)),
                "{fs}: filled from the template"
            );
            assert_eq!(
                fresh_mark(&fx.image(id)),
                None,
                "cleared at the first stage"
            );
            assert_eq!(
                pending_mark(&fx.image(id)),
                None,
                "cleared at the first stage"
            );
        }
        if fs == "xfs" {
            // Two volumes of one template, mounted together, neither with nouuid.
            for s in [&sa, &sb] {
                let opts = mount_options(s);
                assert!(!opts.contains("nouuid"), "{opts}");
            }
        }
        std::fs::write(ta.join("data"), b"kept").unwrap();
        fx.c.unpublish_and_unstage(&a, &ta, &sa).await;
        fx.c.unpublish_and_unstage(&b, &tb, &sb).await;
        // The second stage treats it as any filesystem: probed and checked.
        let (sa, ta) = fx.stage_publish(&a, fs).await;
        assert_eq!(std::fs::read(ta.join("data")).unwrap(), b"kept");
        assert_eq!(blkid(&fx.image(&a), "TYPE"), fs);
        fx.c.unpublish_and_unstage(&a, &ta, &sa).await;
    }
}

#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_a_new_volume_takes_the_filesystem_its_first_stage_asks_for_then_keeps_it() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    // Pending: filled at the stage with the filesystem the stage names.
    let pending = fx.create_from_template("pending", "xfs").await;
    // Filled with xfs and fresh (a stage that ended before its mount), then
    // staged as ext4: formatted, as nothing was ever written to it.
    let fresh = fx.create_from_template("fresh", "xfs").await;
    fx.crash_stage_at(&fresh, "xfs", "stage.after-fill").await;
    assert_eq!(fresh_mark(&fx.image(&fresh)).as_deref(), Some("xfs"));
    for id in [&pending, &fresh] {
        let (staging, target) = fx.stage_publish(id, "ext4").await;
        assert_eq!(blkid(&fx.image(id), "TYPE"), "ext4");
        assert!(mount_options(&staging).starts_with("rw"));
        assert_eq!(fresh_mark(&fx.image(id)), None);
        assert_eq!(pending_mark(&fx.image(id)), None);
        std::fs::write(target.join("data"), b"kept").unwrap();
        fx.c.unpublish_and_unstage(id, &target, &staging).await;

        // Mounted once: another type is refused and the data stays.
        let staging = fx.pool.scratch(&format!("again-{id}"));
        let err =
            fx.c.node
                .node_stage_volume(stage_req(id, &staging, cap("xfs")))
                .await
                .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("holds ext4"), "{err:?}");
        assert!(mounts_below(&staging).is_empty());
        let (staging, target) = fx.stage_publish(id, "ext4").await;
        assert_eq!(std::fs::read(target.join("data")).unwrap(), b"kept");
        fx.c.unpublish_and_unstage(id, &target, &staging).await;
    }
    // Asked for none: the filesystem CreateVolume chose, from its template.
    let chosen = fx.create_from_template("chosen", "xfs").await;
    let (staging, _) = fx.stage_publish(&chosen, "").await;
    assert_eq!(blkid(&fx.image(&chosen), "TYPE"), "xfs");
    assert!(shares_extents(&fx.image(&chosen)));
    assert!(!mount_options(&staging).contains("nouuid"));
}

#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_a_pool_without_reflink_formats_at_stage() {
    require_root();
    let mut fx = fixture("ext4", &[]).await;
    let a = fx.c.create("a", GIB, cap("xfs"), &[]).await;
    let b = fx.c.create("b", GIB, cap("xfs"), &[]).await;
    std::thread::sleep(Duration::from_millis(500));
    assert!(!fx.templates().exists());
    for id in [&a, &b] {
        assert_eq!(pending_mark(&fx.image(id)), None);
        assert_eq!(blkid(&fx.image(id), "TYPE"), "", "blank until staged");
        fx.stage_publish(id, "xfs").await;
        assert_eq!(blkid(&fx.image(id), "TYPE"), "xfs");
    }
}

/// A mkfs cut short (the driver killed while mkfs.xfs wrote, as a soak found
/// it) leaves an xfs with its in-progress bit set, which blkid names and no
/// check accepts. The image was marked before the mkfs: the next stage makes
/// the filesystem again instead of refusing it forever.
#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_a_mkfs_cut_short_is_made_again_at_the_next_stage() {
    require_root();
    let mut fx = fixture("ext4", &[]).await;
    for fs in ["xfs", "ext4", "btrfs"] {
        let id = fx.c.create(&format!("cut-{fs}"), GIB, cap(fs), &[]).await;
        fx.crash_stage_at(&id, fs, "stage.before-mkfs").await;
        let image = fx.image(&id);
        let loops = sh(
            "losetup",
            &["-n", "-O", "NAME", "-j", image.to_str().unwrap()],
        );
        // What a mkfs cut in its middle leaves (written here through the
        // image, the device the crash left attached detached first).
        for dev in loops.lines().map(str::trim).filter(|l| !l.is_empty()) {
            sh("losetup", &["-d", dev]);
        }
        match fs {
            "xfs" => {
                sh("mkfs.xfs", &["-q", "-f", image.to_str().unwrap()]);
                sh(
                    "xfs_db",
                    &[
                        "-x",
                        "-c",
                        "sb 0",
                        "-c",
                        "write -d inprogress 1",
                        image.to_str().unwrap(),
                    ],
                );
            }
            "ext4" => {
                sh("mkfs.ext4", &["-q", "-F", image.to_str().unwrap()]);
                // The group descriptors after the superblock, lost.
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&image)
                    .unwrap();
                std::os::unix::fs::FileExt::write_all_at(&f, &vec![0xa5u8; 64 << 10], 4096)
                    .unwrap();
            }
            _ => {
                sh("mkfs.btrfs", &["-q", "-f", image.to_str().unwrap()]);
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&image)
                    .unwrap();
                std::os::unix::fs::FileExt::write_all_at(&f, &vec![0u8; 1 << 20], 1 << 20).unwrap();
            }
        }
        assert_eq!(blkid(&image, "TYPE"), fs, "a filesystem is found on it");
        let (staging, target) = fx.stage_publish(&id, fs).await;
        assert_eq!(blkid(&image, "TYPE"), fs);
        std::fs::write(target.join("file"), b"after the cut").unwrap();
        fx.c.unpublish_and_unstage(&id, &target, &staging).await;
        // Made whole and marked no more: a second stage keeps what it holds.
        let (staging, target) = fx.stage_publish(&id, fs).await;
        assert_eq!(
            std::fs::read(target.join("file")).unwrap(),
            b"after the cut"
        );
        fx.c.unpublish_and_unstage(&id, &target, &staging).await;
    }
}

#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_templates_are_not_orphans_and_damaged_ones_are_removed() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let id = fx.create_from_template("v", "ext4").await;
    let good = fx.template("ext4");
    let damaged = fx.template("xfs");
    std::fs::write(&damaged, vec![0u8; GIB as usize / 1024]).unwrap();
    nix::unistd::truncate(&damaged, GIB).unwrap();
    let half = fx.templates().join(format!(".btrfs-{GIB}-f1.img.tmp"));
    std::fs::write(&half, b"cut short").unwrap();

    fx.driver.restart();
    fx.c = fx.driver.clients().await;
    assert!(good.is_file(), "a whole template is kept");
    assert!(!damaged.exists(), "a damaged template is removed");
    assert!(!half.exists(), "a half-made template is removed");
    assert!(fx.image(&id).is_file(), "the volume is untouched");
    // The kept template still serves.
    let next = fx.c.create("next", GIB, cap("ext4"), &[]).await;
    assert_eq!(pending_mark(&fx.image(&next)).as_deref(), Some("ext4"));
    fx.stage_publish(&next, "ext4").await;
    assert!(shares_extents(&fx.image(&next)));
}

#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_a_template_cut_short_by_a_crash_is_never_used() {
    require_root();
    let mut fx = fixture(
        "xfs",
        &[("EXAMPLE_CSI_FAILPOINTS", "template.before-rename")],
    )
    .await;
    fx.c.create("first", GIB, cap("xfs"), &[]).await;
    // The worker reaches the point between mkfs and the rename: the process ends.
    assert!(
        fx.driver.wait_exit(120).is_some(),
        "the failpoint ended the driver"
    );
    let half = fx.templates().join(format!(".xfs-{GIB}-f1.img.tmp"));
    assert!(half.is_file(), "the crash left the template half-made");
    assert!(!fx.template("xfs").exists());

    fx.driver.envs.clear();
    fx.driver.spawn();
    fx.c = fx.driver.clients().await;
    assert!(!half.exists(), "start-up removed it");
    let early = fx.c.create("second", GIB, cap("xfs"), &[]).await;
    assert_eq!(blkid(&fx.image(&early), "TYPE"), "", "a blank image");
    fx.wait_template("xfs");
    // Made before its template, staged after it: filled from it all the same.
    let made = fx.c.create("third", GIB, cap("xfs"), &[]).await;
    for id in [&early, &made] {
        fx.stage_publish(id, "xfs").await;
        assert!(shares_extents(&fx.image(id)));
    }
}

#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_a_template_volume_expanded_before_its_first_stage_is_grown() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let id = fx.create_from_template("v", "xfs").await;
    fx.expand(&id, 2 * GIB).await;
    // No template of the new size: formatted at the stage.
    let (staging, _) = fx.stage_publish(&id, "xfs").await;
    assert!(!shares_extents(&fx.image(&id)));
    let s = nix::sys::statvfs::statvfs(&staging).unwrap();
    let size = s.blocks() * s.fragment_size();
    assert!(
        size > GIB as u64 * 3 / 2,
        "the filesystem fills the volume: {size}"
    );
}

/// The fill of a first stage is synced before the image is attached; a power
/// loss before that may keep the copy and its mark but only some of the writes
/// that gave it its UUID (here: the stage ended between the fill and its sync,
/// and the template's first superblock put back). The next stage finds the UUID
/// incomplete and formats the never-used image anew; a fill whose stage ended
/// before it cleared the pending mark is made again; an intact fill keeps the
/// UUID it was given.
#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_a_template_copy_whose_uuid_was_partly_lost_is_formatted_at_its_first_stage() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    for fs in ["ext4", "xfs", "btrfs"] {
        let intact = fx.create_from_template(&format!("intact-{fs}"), fs).await;
        let torn = fx.c.create(&format!("torn-{fs}"), GIB, cap(fs), &[]).await;
        let again = fx.c.create(&format!("again-{fs}"), GIB, cap(fs), &[]).await;
        fx.crash_stage_at(&intact, fs, "stage.after-fill").await;
        fx.crash_stage_at(&torn, fs, "stage.after-fill").await;
        fx.crash_stage_at(&again, fs, "stage.before-unmark").await;
        assert_eq!(fresh_mark(&fx.image(&torn)).as_deref(), Some(fs));
        assert_eq!(pending_mark(&fx.image(&again)).as_deref(), Some(fs));
        let given = blkid(&fx.image(&intact), "UUID");
        let template_uuid = blkid(&fx.template(fs), "UUID");
        assert!(given != template_uuid, "{fs}");
        fx.lose_uuid_writes(&torn, fs);

        let (sa, ta) = fx.stage_publish(&again, fs).await;
        assert!(shares_extents(&fx.image(&again)), "{fs}: filled again");
        let refilled = blkid(&fx.image(&again), "UUID");
        assert!(refilled != template_uuid && refilled != given, "{fs}");
        fx.c.unpublish_and_unstage(&again, &ta, &sa).await;
        let (si, ti) = fx.stage_publish(&intact, fs).await;
        assert_eq!(
            blkid(&fx.image(&intact), "UUID"),
            given,
            "{fs}: not formatted again"
        );
        let (st, tt) = fx.stage_publish(&torn, fs).await;
        assert_eq!(fresh_mark(&fx.image(&torn)), None, "{fs}");
        let remade = blkid(&fx.image(&torn), "UUID");
        assert_eq!(blkid(&fx.image(&torn), "TYPE"), fs);
        assert!(
            !remade.is_empty() && remade != template_uuid && remade != given,
            "{fs}: {remade}"
        );
        std::fs::write(tt.join("data"), b"kept").unwrap();
        fx.c.unpublish_and_unstage(&torn, &tt, &st).await;
        fx.c.unpublish_and_unstage(&intact, &ti, &si).await;
        let (st, tt) = fx.stage_publish(&torn, fs).await;
        assert_eq!(std::fs::read(tt.join("data")).unwrap(), b"kept", "{fs}");
        fx.c.unpublish_and_unstage(&torn, &tt, &st).await;
    }
}

/// The same loss, then the stage undone and an expansion before the next stage:
/// the expansion settles the copy (formatted anew at the stage) before it
/// unmarks it.
#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_a_partly_lost_template_copy_expanded_before_its_first_stage_is_formatted() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let id = fx.create_from_template("v", "xfs").await;
    let template_uuid = blkid(&fx.template("xfs"), "UUID");
    fx.crash_stage_at(&id, "xfs", "stage.after-fill").await;
    let staging = fx.pool.scratch(&format!("staging-{id}"));
    fx.c.node
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    fx.lose_uuid_writes(&id, "xfs");
    fx.expand(&id, 2 * GIB).await;
    assert_eq!(fresh_mark(&fx.image(&id)), None);
    assert_eq!(
        blkid(&fx.image(&id), "TYPE"),
        "",
        "emptied before it was grown"
    );
    let (staging, target) = fx.stage_publish(&id, "xfs").await;
    let uuid = blkid(&fx.image(&id), "UUID");
    assert!(!uuid.is_empty() && uuid != template_uuid, "{uuid}");
    let s = nix::sys::statvfs::statvfs(&staging).unwrap();
    assert!(s.blocks() * s.fragment_size() > GIB as u64 * 3 / 2);
    std::fs::write(target.join("data"), b"kept").unwrap();
}

/// A volume made for a filesystem and staged first for block access is the
/// caller's device: left blank, not filled from the template, and unmarked, so
/// that no later stage fills it over what was written.
#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_a_template_volume_staged_for_block_access_is_left_blank_and_unmarked() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    let id = fx.create_from_template("v", "xfs").await;
    let staging = fx.pool.scratch("staging-block");
    fx.c.node
        .node_stage_volume(stage_req(&id, &staging, block_cap(writer())))
        .await
        .unwrap();
    let image = fx.image(&id);
    assert_eq!(pending_mark(&image), None);
    assert_eq!(fresh_mark(&image), None);
    assert!(!shares_extents(&image));
    assert_eq!(blkid(&image, "TYPE"), "", "the device holds nothing");
    fx.c.node
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    let (_, target) = fx.stage_publish(&id, "xfs").await;
    assert!(!shares_extents(&image), "formatted, not filled");
    assert_eq!(blkid(&image, "TYPE"), "xfs");
    std::fs::write(target.join("data"), b"kept").unwrap();
}

/// ControllerModifyVolume asking direct I/O for volume `id`.
fn direct_io_req(id: &str) -> csi::ControllerModifyVolumeRequest {
    csi::ControllerModifyVolumeRequest {
        volume_id: id.to_string(),
        mutable_parameters: [("directIO".to_string(), "true".to_string())].into(),
        ..Default::default()
    }
}

/// The logical sector size of a loop device, as the kernel reports it.
fn sector_size(dev: &str) -> String {
    let name = dev.trim_start_matches("/dev/");
    std::fs::read_to_string(format!("/sys/block/{name}/queue/logical_block_size"))
        .unwrap()
        .trim()
        .to_string()
}

/// Direct I/O for volumes filled from their templates on an xfs pool: their
/// images share blocks with the templates, and xfs takes direct I/O for such a
/// file only in 4096-byte units. Staged without it (on 512-byte sectors), a live
/// change is refused (INVALID_ARGUMENT, saying why) and changes nothing.
/// Recorded for the next stage: an ext4 of 4 KiB blocks is served on 4096-byte
/// sectors with direct I/O; the xfs, made on 512-byte sectors, stays on them
/// (left to the kernel, its device would take 4096 and it would not mount) and
/// is served with buffered I/O and a warning. Both keep their data.
#[tokio::test]
#[ignore = "needs root: loop devices, mkfs and mounts"]
async fn root_direct_io_for_images_sharing_blocks_with_their_templates() {
    require_root();
    let mut fx = fixture("xfs", &[]).await;
    for (fs, sector, dio) in [("ext4", "4096", "1"), ("xfs", "512", "0")] {
        let id = fx.create_from_template(&format!("dio-{fs}"), fs).await;
        let (s, t) = fx.stage_publish(&id, fs).await;
        assert!(
            shares_extents(&fx.image(&id)),
            "{fs}: filled from the template"
        );
        std::fs::write(t.join("data"), b"kept").unwrap();
        let dev = loops_below(&fx.pool.path).pop().expect("a loop device");
        assert_eq!(sector_size(&dev), "512", "{fs}");
        let before = loop_settings(&dev);
        assert_eq!(before.0, "0");
        let err =
            fx.c.controller
                .controller_modify_volume(direct_io_req(&id))
                .await
                .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{fs}: {err:?}");
        assert!(err.message().contains("shares blocks"), "{}", err.message());
        assert_eq!(
            loop_settings(&dev),
            before,
            "{fs}: the device keeps its settings"
        );
        let image = fx.image(&id);
        let attr = || csi_sys::xattr::get(&image, "example-csi.directIO").unwrap();
        assert_eq!(attr(), None, "{fs}: nothing recorded");
        fx.c.unpublish_and_unstage(&id, &t, &s).await;

        fx.c.controller
            .controller_modify_volume(direct_io_req(&id))
            .await
            .unwrap();
        assert_eq!(attr().as_deref(), Some(&b"true"[..]), "{fs}: recorded");
        let (s, t) = fx.stage_publish(&id, fs).await;
        let dev = loops_below(&fx.pool.path).pop().expect("a loop device");
        assert_eq!(sector_size(&dev), sector, "{fs}");
        assert_eq!(loop_settings(&dev).0, dio, "{fs}: direct I/O");
        assert_eq!(std::fs::read(t.join("data")).unwrap(), b"kept");
        fx.c.unpublish_and_unstage(&id, &t, &s).await;
    }
    let log = fx.driver.log_text();
    assert!(log.contains("served with buffered I/O"), "{log}");
}
