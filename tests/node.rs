//! The node side through the real binary: stage, publish, block
//! volumes, read-only publishes, idempotency, volume_mount_group, stats,
//! expansion, ephemeral inline volumes, access modes, validation, concurrency,
//! and recovery after driver crashes (failpoints) and a simulated node reboot.
//! Every test uses its own pool; the pool's Drop unmounts and detaches whatever a
//! failed test left behind.

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use csi_proto::csi::{self, volume_capability};
use tonic::Code;

type Mode = volume_capability::access_mode::Mode;

const FAILPOINTS: &str = "EXAMPLE_CSI_FAILPOINTS";

// ---------------------------------------------------------------- helpers

/// Tests that need root, each one call: `name: call(args);`.
macro_rules! root_cases {
    ($($name:ident: $call:expr;)*) => {$(
        #[tokio::test]
        #[ignore = "needs root: loop devices and mounts"]
        async fn $name() {
            require_root();
            $call.await;
        }
    )*};
}

struct Fx {
    pool: Pool,
    driver: Driver,
    c: Clients,
}

/// Also when a test fails: the driver is stopped and the volumes' mounts and loop
/// devices go before the pool's own mount, which they would otherwise keep busy
/// (a lazily detached pool hides their backing files from `loops_below`).
impl Drop for Fx {
    fn drop(&mut self) {
        self.driver.kill9();
        let top = self.pool.dir.path().to_path_buf();
        for _ in 0..3 {
            let mut ms: Vec<PathBuf> = mounts_below(&top)
                .into_iter()
                .filter(|m| m != &self.pool.path)
                .collect();
            ms.sort();
            for m in ms.iter().rev() {
                let _ = nix::mount::umount2(m, nix::mount::MntFlags::empty());
            }
            for d in loops_below(&self.pool.path) {
                let _ = std::process::Command::new("losetup")
                    .args(["-d", &d])
                    .status();
            }
        }
    }
}

/// A pool of `pool_fs` and the driver on it, with `extra` flags; only for root.
async fn fixture(pool_fs: &str, extra: &[&str]) -> Fx {
    require_root();
    let pool = Pool::new(pool_fs);
    let driver = Driver::start(&pool, extra);
    let c = driver.clients().await;
    Fx { pool, driver, c }
}

impl Fx {
    async fn reconnect(&mut self) {
        self.c = self.driver.clients().await;
    }

    /// DeleteVolume, retried as a CO retries while it answers FAILED_PRECONDITION:
    /// an unstage whose loop device was still open elsewhere for a moment succeeds
    /// and leaves the kernel to finish the detach, and until it has, the volume is
    /// in use.
    async fn delete(&mut self, id: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        loop {
            let answer = self
                .c
                .controller
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: id.to_string(),
                    secrets: Default::default(),
                })
                .await;
            match answer {
                Ok(_) => return,
                Err(e)
                    if e.code() == tonic::Code::FailedPrecondition
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await
                }
                Err(e) => panic!("DeleteVolume {id}: {e:?}"),
            }
        }
    }

    async fn stage(
        &mut self,
        id: &str,
        staging: &Path,
        cap: &csi::VolumeCapability,
    ) -> Result<(), tonic::Status> {
        let req = stage_req(id, staging, cap.clone());
        self.c.node.node_stage_volume(req).await.map(drop)
    }

    async fn publish(
        &mut self,
        id: &str,
        staging: &Path,
        target: &Path,
        cap: &csi::VolumeCapability,
        ro: bool,
    ) -> Result<(), tonic::Status> {
        let req = publish_req(id, staging, target, cap.clone(), ro);
        self.c.node.node_publish_volume(req).await.map(drop)
    }

    async fn unpublish(&mut self, id: &str, target: &Path) -> Result<(), tonic::Status> {
        let req = unpublish_req(id, target);
        self.c.node.node_unpublish_volume(req).await.map(drop)
    }

    async fn unstage(&mut self, id: &str, staging: &Path) -> Result<(), tonic::Status> {
        let req = unstage_req(id, staging);
        self.c.node.node_unstage_volume(req).await.map(drop)
    }

    async fn stats(
        &mut self,
        id: &str,
        path: &Path,
    ) -> Result<csi::NodeGetVolumeStatsResponse, tonic::Status> {
        let req = stats_req(id, path);
        self.c
            .node
            .node_get_volume_stats(req)
            .await
            .map(|r| r.into_inner())
    }

    /// NodeUnpublishVolume, NodeUnstageVolume and DeleteVolume, each of which
    /// must succeed.
    async fn remove(&mut self, id: &str, staging: &Path, target: &Path) {
        self.unpublish(id, target).await.unwrap();
        self.unstage(id, staging).await.unwrap();
        self.delete(id).await;
    }

    /// CreateVolume of `name` with `cap`, which must succeed, and the paths a
    /// kubelet would stage and publish it at (neither used yet).
    async fn volume(&mut self, name: &str, size: i64, cap: csi::VolumeCapability) -> Vol {
        self.volume_with(name, size, cap, &[]).await
    }

    /// `volume`, with StorageClass parameters.
    async fn volume_with(
        &mut self,
        name: &str,
        size: i64,
        cap: csi::VolumeCapability,
        params: &[(&str, &str)],
    ) -> Vol {
        let id = self.c.create(name, size, cap.clone(), params).await;
        let staging = self.pool.scratch("staging");
        (id, cap, staging, self.pool.scratch("pods").join("t"))
    }

    /// `volume`, then staged and published read-write, as a pod uses it.
    async fn volume_in_use(&mut self, name: &str, size: i64, cap: csi::VolumeCapability) -> Vol {
        let (id, cap, staging, target) = self.volume(name, size, cap).await;
        self.c.stage_and_publish(&id, &staging, &target, &cap).await;
        (id, cap, staging, target)
    }

    /// Loop devices of the volumes (the pool's own device is not below its mount).
    fn volume_loops(&self) -> Vec<String> {
        let mut v = loops_below(&self.pool.path);
        v.sort();
        v
    }

    fn all_mounts(&self) -> Vec<PathBuf> {
        let mut v = mounts_below(self.pool.dir.path());
        v.sort();
        v
    }

    /// Restarts the driver with `envs` (a failpoint, or none) and reconnects.
    async fn respawn(&mut self, envs: &[(&str, &str)]) {
        self.driver.kill9();
        self.driver.envs = envs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.driver.spawn();
        self.reconnect().await;
    }

    /// The call of one phase of a volume's life on the node, with the volume's
    /// staging and target paths.
    async fn run(
        &mut self,
        phase: Phase,
        id: &str,
        [staging, target]: [&Path; 2],
        cap: &csi::VolumeCapability,
        ro: bool,
    ) -> Result<(), tonic::Status> {
        match phase {
            Phase::Stage => self.stage(id, staging, cap).await,
            Phase::Publish => self.publish(id, staging, target, cap, ro).await,
            Phase::Unpublish => self.unpublish(id, target).await,
            Phase::Unstage => self.unstage(id, staging).await,
        }
    }
}

/// A volume made by a test: its id, its capability, and the staging and target
/// paths it is used at.
type Vol = (String, csi::VolumeCapability, PathBuf, PathBuf);

fn code(r: Result<(), tonic::Status>) -> Code {
    match r {
        Ok(()) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// How many mounts sit exactly at `p`.
fn mount_count(p: &Path) -> usize {
    mounts_below(p).iter().filter(|m| m.as_path() == p).count()
}

/// The capability most tests use: an ext4 mount for one writer.
fn ext4() -> csi::VolumeCapability {
    mount_cap("ext4", writer())
}

fn cap_with(fs: &str, mode: Mode, flags: &[&str], group: &str) -> csi::VolumeCapability {
    let mut c = mount_cap(fs, mode);
    c.access_type = Some(volume_capability::AccessType::Mount(
        volume_capability::MountVolume {
            fs_type: fs.to_string(),
            mount_flags: flags.iter().map(|s| s.to_string()).collect(),
            volume_mount_group: group.to_string(),
        },
    ));
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1] ^ seed)
        .collect()
}

fn write_synced(path: &Path, data: &[u8]) {
    let mut f = std::fs::File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

fn statvfs(p: &Path) -> nix::sys::statvfs::Statvfs {
    nix::sys::statvfs::statvfs(p).unwrap()
}

fn fs_bytes(p: &Path) -> u64 {
    let s = statvfs(p);
    s.blocks() * s.fragment_size()
}

fn usage(r: &csi::NodeGetVolumeStatsResponse, unit: csi::volume_usage::Unit) -> &csi::VolumeUsage {
    r.usage
        .iter()
        .find(|u| u.unit == unit as i32)
        .unwrap_or_else(|| panic!("no {unit:?} usage in {r:?}"))
}

/// Detaches `dev` and waits for the kernel to let it go (a detach while a scan
/// has the device open only takes effect on that last close).
fn detach(dev: &str) {
    sh("losetup", &["-d", dev]);
    let backing = format!(
        "/sys/block/{}/loop/backing_file",
        dev.trim_start_matches("/dev/")
    );
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while Path::new(&backing).exists() {
        assert!(
            std::time::Instant::now() < until,
            "{dev} still attached 10 s after its detach"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------- data paths

async fn round_trip(vol_fs: &str, size: i64) {
    let mut fx = fixture("xfs", &[]).await;
    let before_loops = fx.volume_loops();
    let before_mounts = fx.all_mounts();
    let name = format!("pvc-rt-{vol_fs}");
    let (id, cap, staging, target) = fx.volume(&name, size, mount_cap(vol_fs, writer())).await;
    let data = pattern(3 * 1024 * 1024 + 17, 7);
    for round in 0..2 {
        fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
        let m = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = m
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(staging.to_str().unwrap()))
            .expect("staging is mounted");
        assert!(
            line.contains(&format!(" - {vol_fs} ")),
            "staging holds {vol_fs}: {line}"
        );
        let file = target.join("data.bin");
        if round == 0 {
            write_synced(&file, &data);
        } else {
            assert!(std::fs::read(&file).unwrap() == data, "data differs");
        }
        fx.unpublish(&id, &target).await.unwrap();
        assert!(!target.exists());
        fx.unstage(&id, &staging).await.unwrap();
        assert_eq!(mount_count(&staging), 0);
        assert_eq!(fx.volume_loops(), before_loops);
    }
    fx.delete(&id).await;
    assert_eq!(fx.all_mounts(), before_mounts);
}

root_cases! {
    root_round_trip_ext4: round_trip("ext4", 64 * MIB);
    root_round_trip_xfs: round_trip("xfs", 300 * MIB);
    root_round_trip_btrfs: round_trip("btrfs", 128 * MIB);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_small_volume_refuses_writes_past_its_size() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, _, staging, target) = fx.volume_in_use("pvc-full", 64 * MIB, ext4()).await;
    let mut f = std::fs::File::create(target.join("big")).unwrap();
    let chunk = vec![0x5au8; 1024 * 1024];
    let mut written = 0u64;
    let mut err = None;
    for _ in 0..100 {
        match f.write_all(&chunk) {
            Ok(()) => written += chunk.len() as u64,
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let err = err
        .or_else(|| f.sync_all().err())
        .expect("a 64 MiB volume took 100 MiB");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert!(written <= 64 * 1024 * 1024, "wrote {written} bytes");
    drop(f);
    fx.remove(&id, &staging, &target).await;
}

/// The kubelet's SELinux context (CSIDriver seLinuxMount, on an SELinux node)
/// reaches the filesystem's mount at the stage. Where the kernel has SELinux
/// the staged filesystem carries it; where it has none (as here) the kernel
/// refuses the option, and the stage says so and leaves nothing behind.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_an_selinux_context_goes_to_the_filesystem_mount() {
    let mut fx = fixture("xfs", &[]).await;
    let context = r#"context="system_u:object_r:container_file_t:s0:c0,c1""#;
    let mut cap = ext4();
    if let Some(csi::volume_capability::AccessType::Mount(m)) = cap.access_type.as_mut() {
        m.mount_flags = vec![context.to_string()];
    }
    let (id, cap, staging, target) = fx.volume("pvc-selinux", 64 * MIB, cap).await;
    let answer = fx.stage(&id, &staging, &cap).await;
    if Path::new("/sys/fs/selinux/enforce").exists() {
        answer.unwrap();
        fx.publish(&id, &staging, &target, &cap, false)
            .await
            .unwrap();
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = mountinfo
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(&*staging.display().to_string()))
            .expect("the staging mount");
        assert!(line.contains("context="), "{line}");
        fx.remove(&id, &staging, &target).await;
    } else {
        let e = answer.unwrap_err();
        assert!(e.message().contains("context="), "{e:?}");
        assert!(mounts_below(&staging).is_empty(), "the stage left a mount");
        assert!(fx.volume_loops().is_empty(), "{:?}", fx.volume_loops());
        fx.delete(&id).await;
    }
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_read_only_publish_refuses_writes() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, cap, staging, _) = fx.volume("pvc-ro", 64 * MIB, ext4()).await;
    let rw = fx.pool.scratch("pods").join("rw");
    let ro = fx.pool.scratch("pods").join("ro");
    fx.c.stage_and_publish(&id, &staging, &rw, &cap).await;
    write_synced(&rw.join("f"), b"written read-write");
    fx.unpublish(&id, &rw).await.unwrap();
    fx.publish(&id, &staging, &ro, &cap, true).await.unwrap();
    assert_eq!(std::fs::read(ro.join("f")).unwrap(), b"written read-write");
    let e = std::fs::File::create(ro.join("g")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    let e = std::fs::OpenOptions::new()
        .append(true)
        .open(ro.join("f"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    // Publishing the same target read-write now is a conflict, not a silent change.
    assert_eq!(
        code(fx.publish(&id, &staging, &ro, &cap, false).await),
        Code::AlreadyExists
    );
    fx.remove(&id, &staging, &ro).await;
    assert!(fx.volume_loops().is_empty());
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_block_publish_read_only_refuses_writes_and_rw_works() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, cap, staging, _) = fx
        .volume(
            "pvc-block",
            64 * MIB,
            block_cap(Mode::SingleNodeMultiWriter),
        )
        .await;
    let rw = fx.pool.scratch("pods").join("rw");
    let ro = fx.pool.scratch("pods").join("ro");
    fx.stage(&id, &staging, &cap).await.unwrap();
    assert_eq!(mount_count(&staging), 0, "a block volume is not mounted");
    assert_eq!(fx.volume_loops().len(), 1);
    fx.publish(&id, &staging, &rw, &cap, false).await.unwrap();
    fx.publish(&id, &staging, &ro, &cap, true).await.unwrap();
    assert_eq!(mount_count(&rw), 1);
    assert_eq!(mount_count(&ro), 1);
    // Read-write: write a pattern through the device and read it back.
    let data = pattern(1024 * 1024, 3);
    {
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&rw)
            .unwrap();
        f.seek(SeekFrom::Start(4 * 1024 * 1024)).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
    }
    {
        let mut f = std::fs::File::open(&rw).unwrap();
        f.seek(SeekFrom::Start(4 * 1024 * 1024)).unwrap();
        let mut back = vec![0u8; data.len()];
        f.read_exact(&mut back).unwrap();
        assert!(back == data, "block data read back differs");
        assert_eq!(f.seek(SeekFrom::End(0)).unwrap(), 64 * 1024 * 1024);
    }
    // Read-only: the device itself refuses writes, whatever the opener does.
    let refused = match std::fs::OpenOptions::new().write(true).open(&ro) {
        Err(_) => true,
        Ok(mut f) => f
            .write_all(&[1u8; 4096])
            .and_then(|_| f.sync_all())
            .is_err(),
    };
    assert!(refused, "a read-only block publish took a write");
    // Also with O_DIRECT, past the page cache: the write must fail.
    let refused_direct = match std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&ro)
    {
        Err(_) => true,
        Ok(f) => {
            let mut buf = vec![0u8; 3 * 4096];
            let off = buf.as_ptr().align_offset(4096);
            let aligned = &mut buf[off..off + 4096];
            aligned.fill(0xee);
            use std::os::unix::fs::FileExt;
            f.write_at(aligned, 0).is_err()
        }
    };
    assert!(
        refused_direct,
        "a read-only block device took an O_DIRECT write"
    );
    // The read-only device sees the same data.
    {
        let mut f = std::fs::File::open(&ro).unwrap();
        f.seek(SeekFrom::Start(4 * 1024 * 1024)).unwrap();
        let mut back = vec![0u8; data.len()];
        f.read_exact(&mut back).unwrap();
        assert!(back == data);
    }
    // Block stats: the device size.
    let s = fx.stats(&id, &rw).await.unwrap();
    assert_eq!(
        usage(&s, csi::volume_usage::Unit::Bytes).total,
        64 * 1024 * 1024
    );
    fx.unpublish(&id, &ro).await.unwrap();
    assert_eq!(
        fx.volume_loops().len(),
        1,
        "the read-only device is detached"
    );
    fx.unpublish(&id, &rw).await.unwrap();
    assert!(!rw.exists() && !ro.exists());
    fx.unstage(&id, &staging).await.unwrap();
    assert!(fx.volume_loops().is_empty());
    fx.delete(&id).await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_publish_twice_is_one_mount_and_unpublish_twice_succeeds() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, cap, staging, target) = fx.volume("pvc-idem", 64 * MIB, ext4()).await;
    fx.stage(&id, &staging, &cap).await.unwrap();
    fx.stage(&id, &staging, &cap).await.unwrap();
    assert_eq!(mount_count(&staging), 1, "stage twice gives one mount");
    fx.publish(&id, &staging, &target, &cap, false)
        .await
        .unwrap();
    fx.publish(&id, &staging, &target, &cap, false)
        .await
        .unwrap();
    assert_eq!(mount_count(&target), 1, "publish twice gives one mount");
    fx.unpublish(&id, &target).await.unwrap();
    fx.unpublish(&id, &target).await.unwrap();
    assert_eq!(mount_count(&target), 0);
    // A path that never was mounted, and one that does not exist at all.
    let never = fx.pool.scratch("pods").join("never");
    std::fs::create_dir(&never).unwrap();
    fx.unpublish(&id, &never).await.unwrap();
    fx.unpublish(&id, &fx.pool.scratch("pods").join("missing"))
        .await
        .unwrap();
    // Unstage at a path where the volume is not staged succeeds and leaves the
    // real staging alone: publish still works afterwards.
    fx.unstage(&id, &fx.pool.scratch("elsewhere"))
        .await
        .unwrap();
    assert_eq!(mount_count(&staging), 1, "the real staging mount stays");
    fx.publish(&id, &staging, &target, &cap, false)
        .await
        .unwrap();
    fx.unpublish(&id, &target).await.unwrap();
    fx.unstage(&id, &staging).await.unwrap();
    fx.unstage(&id, &staging).await.unwrap();
    fx.unstage(&id, &fx.pool.scratch("nowhere")).await.unwrap();
    assert!(fx.volume_loops().is_empty());
    fx.delete(&id).await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_unpublish_never_does_not_touch_foreign_mounts() {
    let mut fx = fixture("xfs", &[]).await;
    let id = fx.c.create("pvc-foreign", 64 * MIB, ext4(), &[]).await;
    // A tmpfs that is not the volume's sits at the target.
    let target = fx.pool.scratch("pods").join("foreign");
    std::fs::create_dir(&target).unwrap();
    sh("mount", &["-t", "tmpfs", "tmpfs", target.to_str().unwrap()]);
    let r = fx.unpublish(&id, &target).await;
    assert_eq!(mount_count(&target), 1, "a foreign mount is left alone");
    assert_ne!(code(r), Code::Ok);
    umount(&target);
    fx.delete(&id).await;
}

/// A first stage refused because something else is mounted at its staging path
/// leaves nothing behind: no loop device, no record that it is staged (which
/// would hold the volume against DeleteVolume), the foreign mount untouched.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_stage_refused_for_a_foreign_mount_at_its_path_leaves_nothing_behind() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, cap, staging, _) = fx.volume("pvc-foreign-staging", 64 * MIB, ext4()).await;
    std::fs::create_dir_all(&staging).unwrap();
    sh(
        "mount",
        &["-t", "tmpfs", "tmpfs", staging.to_str().unwrap()],
    );
    let r = fx.stage(&id, &staging, &cap).await;
    assert_eq!(code(r), Code::AlreadyExists);
    assert_eq!(mount_count(&staging), 1, "the foreign mount is left alone");
    assert!(
        fx.volume_loops().is_empty(),
        "the device the refused stage attached is detached: {:?}",
        fx.volume_loops()
    );
    let deleted =
        fx.c.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: id.clone(),
                secrets: Default::default(),
            })
            .await;
    assert!(
        deleted.is_ok(),
        "nothing holds the volume after the refused stage: {deleted:?}"
    );
    umount(&staging);
}

/// A volume staged again while another mount namespace still holds its filesystem
/// (it was unstaged here while a container being started had copied the mount
/// table): the filesystem is live, so no offline check or grow may touch it (fsck
/// tools cannot see a mount in another namespace, and would repair a mounted
/// filesystem, or refuse); the stage mounts it as it is, sharing the live
/// filesystem, and the data is there. For ext4 and xfs.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_restage_while_another_namespace_holds_the_filesystem_mounts_it_as_it_is() {
    let mut fx = fixture("xfs", &[]).await;
    for (fs, size) in [("ext4", 64 * MIB), ("xfs", 300 * MIB)] {
        let cap = mount_cap(fs, writer());
        let id =
            fx.c.create(&format!("pvc-live-{fs}"), size, cap.clone(), &[])
                .await;
        let staging = fx.pool.scratch(&format!("staging-live-{fs}"));
        let target = fx.pool.scratch("pods").join(format!("live-{fs}"));
        fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
        let data = pattern(1024 * 1024, 9);
        write_synced(&target.join("keep"), &data);
        fx.unpublish(&id, &target).await.unwrap();
        let holder = NamespaceHolder::start();
        fx.unstage(&id, &staging).await.unwrap();
        assert_eq!(
            fx.volume_loops().len(),
            1,
            "{fs}: the held device stays attached"
        );

        fx.stage(&id, &staging, &cap)
            .await
            .unwrap_or_else(|e| panic!("{fs}: the restage: {e:?}"));
        assert_eq!(std::fs::read(staging.join("keep")).unwrap(), data, "{fs}");
        drop(holder);
        fx.unstage(&id, &staging).await.unwrap();
        fx.delete(&id).await;
        assert!(
            fx.volume_loops().is_empty(),
            "{fs}: {:?}",
            fx.volume_loops()
        );
    }
}

/// A process in a mount namespace of its own, private, holding a copy of every
/// mount of the moment it started (as a container runtime does while it starts a
/// container); it ends on drop.
struct NamespaceHolder(std::process::Child);

impl NamespaceHolder {
    fn start() -> NamespaceHolder {
        let mut child = std::process::Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                "echo ready && exec sleep 600",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let holder = NamespaceHolder(child);
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        holder
    }
}

impl Drop for NamespaceHolder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A volume unstaged while another mount namespace still held its filesystem (a
/// container started at that moment copies the mount table) keeps its loop device
/// with a deferred detach. Staged again, that device is held to the image before
/// the mount: when the other namespace lets go in between (forced here inside the
/// stage, after the attach step) the device stays the volume's, and a second
/// volume staged meanwhile gets a device of its own, instead of the first volume's
/// number with its own filesystem, which the first stage would then have mounted.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_restage_keeps_a_device_whose_detach_was_deferred() {
    require_root();
    let pool = Pool::new("xfs");
    // Stages 1 and 2 (both of the first volume) wait at the attach step.
    let driver = Driver::start_with_env(
        &pool,
        &[],
        &[(FAILPOINTS, "stage.after-attach=2*sleep(1500)")],
    );
    let c = driver.clients().await;
    let mut fx = Fx { pool, driver, c };
    let cap = ext4();
    let id =
        fx.c.create("pvc-deferred", 64 * MIB, cap.clone(), &[])
            .await;
    let other = fx.c.create("pvc-other", 64 * MIB, cap.clone(), &[]).await;
    let staging = fx.pool.scratch("staging-deferred");
    let staging2 = fx.pool.scratch("staging-other");
    let target = fx.pool.scratch("pods").join("deferred");
    fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
    let data = pattern(1024 * 1024, 7);
    write_synced(&target.join("keep"), &data);
    fx.unpublish(&id, &target).await.unwrap();

    // Another mount namespace holds the staged filesystem; the unstage here
    // leaves its device to detach itself once that namespace lets go.
    let holder = NamespaceHolder::start();
    fx.unstage(&id, &staging).await.unwrap();
    let devices = fx.volume_loops();
    assert_eq!(
        devices.len(),
        1,
        "the held device is still attached: {devices:?}"
    );
    let dev = devices[0].trim_start_matches("/dev/").to_string();
    let autoclear = format!("/sys/block/{dev}/loop/autoclear");
    assert_eq!(std::fs::read_to_string(&autoclear).unwrap().trim(), "1");

    // Stage again; while it waits after the attach step, the other namespace
    // goes and the second volume is staged.
    let mut node = fx.c.node.clone();
    let req = stage_req(&id, &staging, cap.clone());
    let restage = tokio::spawn(async move { node.node_stage_volume(req).await.map(drop) });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    drop(holder);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    fx.stage(&other, &staging2, &cap).await.unwrap();
    restage.await.unwrap().expect("the restage succeeds");

    assert_eq!(
        std::fs::read_to_string(&autoclear).unwrap().trim(),
        "0",
        "the device is held to its image"
    );
    let backing = |path: &Path| {
        let m = csi_sys::mountinfo::read()
            .unwrap()
            .into_iter()
            .find(|m| m.mount_point == path)
            .unwrap_or_else(|| panic!("nothing mounted at {}", path.display()));
        let n = m.source.trim_start_matches("/dev/").to_string();
        std::fs::read_to_string(format!("/sys/block/{n}/loop/backing_file"))
            .unwrap()
            .trim()
            .to_string()
    };
    assert!(
        backing(&staging).ends_with(&format!("{id}.img")),
        "{}",
        backing(&staging)
    );
    assert!(
        backing(&staging2).ends_with(&format!("{other}.img")),
        "{}",
        backing(&staging2)
    );
    assert_eq!(std::fs::read(staging.join("keep")).unwrap(), data);
    fx.unstage(&id, &staging).await.unwrap();
    fx.unstage(&other, &staging2).await.unwrap();
    fx.delete(&id).await;
    fx.delete(&other).await;
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_volume_mount_group_gives_group_and_setgid() {
    let mut fx = fixture("xfs", &[]).await;
    for fs in ["ext4", "xfs"] {
        let cap = cap_with(fs, writer(), &[], "4321");
        let size = if fs == "xfs" { 300 * MIB } else { 64 * MIB };
        let id =
            fx.c.create(&format!("pvc-group-{fs}"), size, cap.clone(), &[])
                .await;
        let staging = fx.pool.scratch(&format!("staging-{fs}"));
        let target = fx.pool.scratch("pods").join(fs);
        fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
        let m = std::fs::metadata(&target).unwrap();
        assert_eq!(m.gid(), 4321, "{fs}: the root belongs to the group");
        let mode = m.permissions().mode();
        assert!(mode & 0o2000 != 0, "{fs}: setgid: {mode:o}");
        assert!(mode & 0o020 != 0, "{fs}: group write: {mode:o}");
        std::fs::create_dir(target.join("sub")).unwrap();
        write_synced(&target.join("file"), b"x");
        assert_eq!(std::fs::metadata(target.join("file")).unwrap().gid(), 4321);
        assert_eq!(std::fs::metadata(target.join("sub")).unwrap().gid(), 4321);
        fx.unpublish(&id, &target).await.unwrap();
        fx.unstage(&id, &staging).await.unwrap();
        // A pod with another fsGroup: what the first one wrote is given to it.
        let other = cap_with(fs, writer(), &[], "4322");
        fx.c.stage_and_publish(&id, &staging, &target, &other).await;
        for p in [&target, &target.join("sub"), &target.join("file")] {
            let m = std::fs::metadata(p).unwrap();
            assert_eq!(m.gid(), 4322, "{fs}: {} takes the new group", p.display());
            assert!(
                m.permissions().mode() & 0o060 == 0o060,
                "{fs}: group read/write"
            );
        }
        let sub = std::fs::metadata(target.join("sub"))
            .unwrap()
            .permissions()
            .mode();
        assert!(
            sub & 0o2010 == 0o2010,
            "{fs}: a directory gets setgid and search: {sub:o}"
        );
        fx.remove(&id, &staging, &target).await;
    }
    assert!(fx.volume_loops().is_empty());
}

// ---------------------------------------------------------------- stats

/// What `df` with `args` prints for `path`, and the numbers of its one row.
fn df_figures(args: &[&str], path: &Path) -> (String, Vec<i64>) {
    let mut args = args.to_vec();
    args.push(path.to_str().unwrap());
    let out = sh("df", &args);
    let nums = out
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    (out, nums)
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_stats_match_df_and_refuse_vanished_mounts() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, _, staging, target) = fx.volume_in_use("pvc-stats", 64 * MIB, ext4()).await;
    write_synced(&target.join("some"), &pattern(5 * 1024 * 1024, 1));
    for i in 0..20 {
        write_synced(&target.join(format!("f{i}")), b"i");
    }
    let s = fx.stats(&id, &target).await.unwrap();
    let v = statvfs(&target);
    let fr = v.fragment_size();
    let bytes = usage(&s, csi::volume_usage::Unit::Bytes);
    assert_eq!(bytes.total as u64, v.blocks() * fr);
    assert_eq!(bytes.available as u64, v.blocks_available() * fr);
    assert_eq!(bytes.used as u64, (v.blocks() - v.blocks_free()) * fr);
    let inodes = usage(&s, csi::volume_usage::Unit::Inodes);
    assert_eq!(inodes.total as u64, v.files());
    assert_eq!(inodes.available as u64, v.files_free());
    assert_eq!(inodes.used as u64, v.files() - v.files_free());
    // And `df` agrees.
    let (df, nums) = df_figures(&["-B1", "--output=size,used,avail"], &target);
    assert_eq!(
        nums,
        vec![bytes.total, bytes.used, bytes.available],
        "df: {df}"
    );
    let (dfi, nums) = df_figures(&["--output=itotal,iused,iavail"], &target);
    assert_eq!(
        nums,
        vec![inodes.total, inodes.used, inodes.available],
        "df -i: {dfi}"
    );
    assert_eq!(health_reasons(&node_health(&mut fx.c, &id).await), vec![]);
    // The staging path answers too.
    fx.stats(&id, &staging).await.unwrap();
    // A path that is no published path of the volume: NOT_FOUND.
    let other = fx.pool.scratch("other");
    assert_eq!(
        fx.stats(&id, &other).await.unwrap_err().code(),
        Code::NotFound
    );
    assert_eq!(
        fx.stats(&id, &fx.pool.scratch("x").join("missing"))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    // The mount vanishes behind the driver's back: no figures of the volume are
    // there (NodeGetVolumeHealth tells what happened).
    umount(&target);
    assert_eq!(
        fx.stats(&id, &target).await.unwrap_err().code(),
        Code::NotFound
    );
    fx.remove(&id, &staging, &target).await;
    assert!(fx.volume_loops().is_empty());
}

/// `btrfs qgroup show` of a subvolume: (referenced, limit) in bytes.
fn qgroup_show(subvolume: &Path) -> (u64, Option<u64>) {
    let out = sh(
        "btrfs",
        &[
            "qgroup",
            "show",
            "--raw",
            "-r",
            "-f",
            "--sync",
            subvolume.to_str().unwrap(),
        ],
    );
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("0/"))
        .unwrap_or_else(|| panic!("no qgroup row in:\n{out}"))
        .split_whitespace()
        .collect();
    (row[1].parse().unwrap(), row[3].parse().ok())
}

/// A btrfs `dir` volume (a subvolume with a qgroup limit) reports its qgroup's
/// figures, not the pool's; btrfs counts no inodes, so none are reported.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_stats_of_a_btrfs_dir_volume_are_its_qgroup() {
    let mut fx = fixture("btrfs", &[]).await;
    let (id, cap, staging, target) = fx
        .volume_with(
            "pvc-qgroup",
            64 * MIB,
            mount_cap("", writer()),
            &[("kind", "dir")],
        )
        .await;
    let subvolume = fx.pool.path.join("volumes").join(&id);
    fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
    for (i, mib) in [0usize, 5, 20].into_iter().enumerate() {
        if mib > 0 {
            write_synced(&target.join(format!("f{i}")), &pattern(mib << 20, i as u8));
        }
        let s = fx.stats(&id, &target).await.unwrap();
        let bytes = usage(&s, csi::volume_usage::Unit::Bytes);
        let (referenced, limit) = qgroup_show(&subvolume);
        assert_eq!(limit, Some(64 * MIB as u64), "the qgroup limit is the size");
        assert_eq!(bytes.total, 64 * MIB, "{mib} MiB written: {s:?}");
        assert_eq!(bytes.used as u64, referenced, "{mib} MiB written: {s:?}");
        assert_eq!(bytes.available, bytes.total - bytes.used, "{s:?}");
        assert!(
            bytes.used >= (mib as i64) * MIB,
            "{mib} MiB written, {} used",
            bytes.used
        );
        assert!(
            s.usage
                .iter()
                .all(|u| u.unit != csi::volume_usage::Unit::Inodes as i32),
            "btrfs tells no inode counts: {s:?}"
        );
        // statvfs would have told the pool's 8 GiB.
        assert!(fs_bytes(&target) > 1024 * 1024 * 1024);
    }
    // The staging path answers the same.
    let s = fx.stats(&id, &staging).await.unwrap();
    assert_eq!(usage(&s, csi::volume_usage::Unit::Bytes).total, 64 * MIB);
    fx.remove(&id, &staging, &target).await;
}

// ---------------------------------------------------------------- expansion

async fn controller_expand(
    fx: &mut Fx,
    id: &str,
    size: i64,
) -> csi::ControllerExpandVolumeResponse {
    fx.c.controller
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: id.to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: size,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

async fn node_expand(
    fx: &mut Fx,
    id: &str,
    path: &Path,
    size: i64,
    cap: &csi::VolumeCapability,
) -> Result<i64, tonic::Status> {
    fx.c.node
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: id.to_string(),
            volume_path: path.display().to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: size,
                limit_bytes: 0,
            }),
            staging_target_path: String::new(),
            volume_capability: Some(cap.clone()),
            secrets: Default::default(),
        })
        .await
        .map(|r| r.into_inner().capacity_bytes)
}

async fn online_expand(vol_fs: &str, size: i64) {
    let mut fx = fixture("xfs", &[]).await;
    let name = format!("pvc-grow-{vol_fs}");
    let (id, cap, staging, target) = fx
        .volume_in_use(&name, size, mount_cap(vol_fs, writer()))
        .await;
    let data = pattern(1024 * 1024, 9);
    write_synced(&target.join("keep"), &data);
    let before = fs_bytes(&target);
    let new = 2 * size;
    let r = controller_expand(&mut fx, &id, new).await;
    assert!(r.capacity_bytes >= new);
    assert!(r.node_expansion_required);
    let got = node_expand(&mut fx, &id, &target, new, &cap).await.unwrap();
    assert!(got >= new, "answered {got}");
    let after = fs_bytes(&target);
    assert!(
        after > before + (size as u64) * 9 / 10,
        "{vol_fs} grew online from {before} to {after}"
    );
    // Again: idempotent.
    node_expand(&mut fx, &id, &target, new, &cap).await.unwrap();
    assert_eq!(std::fs::read(target.join("keep")).unwrap(), data);
    fx.remove(&id, &staging, &target).await;
    assert!(fx.volume_loops().is_empty());
}

root_cases! {
    root_node_expand_grows_xfs_online: online_expand("xfs", 300 * MIB);
    root_node_expand_grows_btrfs_online: online_expand("btrfs", 128 * MIB);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_node_expand_ext4_grows_online_or_at_next_stage() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, cap, staging, target) = fx.volume_in_use("pvc-grow-ext4", 64 * MIB, ext4()).await;
    let data = pattern(1024 * 1024, 11);
    write_synced(&target.join("keep"), &data);
    let before = fs_bytes(&target);
    controller_expand(&mut fx, &id, 128 * MIB).await;
    match node_expand(&mut fx, &id, &target, 128 * MIB, &cap).await {
        Ok(n) => {
            // A machine that allows online ext4 growth.
            assert!(n >= 128 * MIB);
            assert!(fs_bytes(&target) > before + 50 * 1024 * 1024);
        }
        Err(s) => {
            // This machine withholds CAP_SYS_RESOURCE: the kernel refuses it.
            assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
            eprintln!(
                "online ext4 grow refused here, as expected: {}",
                s.message()
            );
            assert!(
                s.message().contains("NodeStageVolume") && s.message().contains("online"),
                "the message says why and what happens next: {}",
                s.message()
            );
            assert_eq!(fs_bytes(&target), before);
        }
    }
    // At the next stage it grows (or stays grown).
    fx.unpublish(&id, &target).await.unwrap();
    fx.unstage(&id, &staging).await.unwrap();
    fx.stage(&id, &staging, &cap).await.unwrap();
    let after = fs_bytes(&staging);
    assert!(
        after > before + 50 * 1024 * 1024,
        "ext4 grew at stage: {before} -> {after}"
    );
    fx.publish(&id, &staging, &target, &cap, false)
        .await
        .unwrap();
    assert_eq!(std::fs::read(target.join("keep")).unwrap(), data);
    fx.remove(&id, &staging, &target).await;
    assert!(fx.volume_loops().is_empty());
}

/// NodeExpandVolume to the size a volume has, or less, succeeds and changes nothing,
/// as csi-sanity's "node-expand after node-publish" asks with a volume made at its
/// filesystem's minimum. A no-op that tried to grow would fail here: the kernel
/// resizes no btrfs below 256 MiB, and this machine refuses online ext4 growth.
async fn expand_to_present_size(pool_fs: &str, kinds: &[(&str, i64)]) {
    let mut fx = fixture(pool_fs, &[]).await;
    for &(kind, size) in kinds {
        let label = format!("{kind} on a {pool_fs} pool");
        let (cap, params) = match kind {
            "block" => (block_cap(writer()), vec![]),
            "dir" => (mount_cap("", writer()), vec![("kind", "dir")]),
            fs => (mount_cap(fs, writer()), vec![]),
        };
        // Asked small, made at the filesystem's minimum: the expansion asks for
        // what the volume has already.
        let id =
            fx.c.create(&format!("pvc-same-{kind}"), 64 * MIB, cap.clone(), &params)
                .await;
        let staging = fx.pool.scratch(&format!("staging-{kind}"));
        let target = fx.pool.scratch("pods").join(kind);
        fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
        let data = pattern(1024 * 1024, 3);
        let before = if kind == "block" {
            0
        } else {
            write_synced(&target.join("keep"), &data);
            fs_bytes(&target)
        };
        let r = controller_expand(&mut fx, &id, size).await;
        assert_eq!(
            r.capacity_bytes, size,
            "{label}: the volume has {size} bytes"
        );
        for asked in [size, size / 2] {
            let got = node_expand(&mut fx, &id, &target, asked, &cap)
                .await
                .unwrap_or_else(|e| panic!("{label}: NodeExpandVolume to {asked}: {e:?}"));
            assert_eq!(got, size, "{label}: asked {asked}");
        }
        if kind != "block" {
            assert_eq!(
                fs_bytes(&target),
                before,
                "{label}: the filesystem is unchanged"
            );
            assert_eq!(std::fs::read(target.join("keep")).unwrap(), data, "{label}");
        }
        fx.remove(&id, &staging, &target).await;
    }
    assert!(fx.volume_loops().is_empty());
}

root_cases! {
    root_node_expand_to_the_present_size_is_a_no_op_btrfs_pool: expand_to_present_size(
        "btrfs",
        &[("ext4", 64 * MIB), ("xfs", 300 * MIB), ("btrfs", 128 * MIB), ("block", 64 * MIB), ("dir", 64 * MIB)],
    );
    root_node_expand_to_the_present_size_is_a_no_op_xfs_pool_dir: expand_to_present_size("xfs", &[("dir", 64 * MIB)]);
}

/// A volume's filesystem is sized and grown through a mount its path leads to:
/// here its staging mount is hidden under a tmpfs mounted over the staging
/// path's parent (as when the directory above is mounted again after the stage),
/// and the expansion goes through the published mount, whose path is not ASCII.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_a_volume_grows_through_a_mount_its_path_leads_to() {
    let mut fx = fixture("xfs", &[]).await;
    for fs in ["btrfs", "xfs"] {
        let cap = mount_cap(fs, writer());
        let id =
            fx.c.create(&format!("pvc-cover-{fs}"), 300 * MIB, cap.clone(), &[])
                .await;
        let cover = fx.pool.scratch(&format!("cover-{fs}"));
        let staging = cover.join("staging");
        let target = fx.pool.scratch("pods").join(format!("{fs}-\u{fd}c"));
        std::fs::create_dir_all(&staging).unwrap();
        fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
        sh("mount", &["-t", "tmpfs", "tmpfs", cover.to_str().unwrap()]);

        let before = fs_bytes(&target);
        controller_expand(&mut fx, &id, 400 * MIB).await;
        let grown = node_expand(&mut fx, &id, &target, 400 * MIB, &cap).await;
        let after = fs_bytes(&target);

        umount(&cover);
        fx.remove(&id, &staging, &target).await;
        assert_eq!(grown.expect("NodeExpandVolume"), 400 * MIB, "{fs}");
        assert!(
            after >= before + 90 * MIB as u64,
            "{fs} grown from {before} to {after} bytes"
        );
    }
    assert!(fx.volume_loops().is_empty());
}

/// The kernel resizes no btrfs to less than 256 MiB: an expansion of a 128 MiB
/// btrfs to 200 MiB says so (OUT_OF_RANGE), and the volume still stages at its
/// present size; at 256 MiB it grows.
#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_btrfs_below_256_mib_says_it_cannot_grow_and_still_stages() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, cap, staging, _) = fx
        .volume("pvc-small-btrfs", 128 * MIB, mount_cap("btrfs", writer()))
        .await;
    fx.stage(&id, &staging, &cap).await.unwrap();
    let before = fs_bytes(&staging);
    controller_expand(&mut fx, &id, 200 * MIB).await;
    let err = node_expand(&mut fx, &id, &staging, 200 * MIB, &cap)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    assert!(err.message().contains("256 MiB"), "{}", err.message());
    fx.unstage(&id, &staging).await.unwrap();
    fx.stage(&id, &staging, &cap).await.unwrap();
    assert_eq!(fs_bytes(&staging), before);
    controller_expand(&mut fx, &id, 256 * MIB).await;
    assert_eq!(
        node_expand(&mut fx, &id, &staging, 256 * MIB, &cap)
            .await
            .unwrap(),
        256 * MIB
    );
    assert!(fs_bytes(&staging) > before + 100 * 1024 * 1024);
    fx.unstage(&id, &staging).await.unwrap();
    fx.delete(&id).await;
    assert!(fx.volume_loops().is_empty());
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_expand_while_unstaged_completes_at_stage() {
    let mut fx = fixture("xfs", &[]).await;
    for (fs, size) in [("xfs", 300 * MIB), ("btrfs", 128 * MIB)] {
        let cap = mount_cap(fs, writer());
        let id =
            fx.c.create(&format!("pvc-offline-{fs}"), size, cap.clone(), &[])
                .await;
        let staging = fx.pool.scratch(&format!("staging-{fs}"));
        fx.stage(&id, &staging, &cap).await.unwrap();
        let before = fs_bytes(&staging);
        fx.unstage(&id, &staging).await.unwrap();
        controller_expand(&mut fx, &id, 2 * size).await;
        fx.stage(&id, &staging, &cap).await.unwrap();
        let after = fs_bytes(&staging);
        assert!(
            after > before + (size as u64) * 9 / 10,
            "{fs}: {before} -> {after}"
        );
        fx.unstage(&id, &staging).await.unwrap();
        fx.delete(&id).await;
    }
    assert!(fx.volume_loops().is_empty());
}

// ---------------------------------------------------------------- ephemeral

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_ephemeral_inline_volume_lives_and_dies_with_the_pod() {
    let mut fx = fixture("xfs", &[]).await;
    let mounts_before = fx.all_mounts();
    let target = fx.pool.scratch("pods").join("inline");
    let cap = mount_cap("", writer());
    let req = ephemeral_req(
        "csi-0123456789abcdef",
        &target,
        cap.clone(),
        &[("size", "100Mi"), ("csi.storage.k8s.io/pod.name", "web-0")],
    );
    fx.c.node.node_publish_volume(req.clone()).await.unwrap();
    fx.c.node.node_publish_volume(req.clone()).await.unwrap();
    assert_eq!(mount_count(&target), 1);
    let total = fs_bytes(&target);
    assert!(
        total > 80 * 1024 * 1024 && total <= 100 * 1024 * 1024,
        "size=100Mi gives about 100 MiB: {total}"
    );
    write_synced(&target.join("scratch"), &pattern(4096, 2));
    assert_eq!(fx.volume_loops().len(), 1);
    let eph = fx.pool.path.join("ephemeral");
    assert_eq!(std::fs::read_dir(&eph).unwrap().count(), 1);
    fx.stats("csi-0123456789abcdef", &target).await.unwrap();
    assert_eq!(
        health_reasons(&node_health(&mut fx.c, "csi-0123456789abcdef").await),
        vec![]
    );
    fx.unpublish("csi-0123456789abcdef", &target).await.unwrap();
    assert!(!target.exists());
    assert!(fx.volume_loops().is_empty(), "no loop device is left");
    assert_eq!(
        std::fs::read_dir(&eph).unwrap().count(),
        0,
        "no image is left in <pool>/ephemeral"
    );
    assert_eq!(fx.all_mounts(), mounts_before);
    assert!(mounts_below(&fx.driver.state).is_empty());
    fx.unpublish("csi-0123456789abcdef", &target).await.unwrap();
}

/// The pool's inline ephemeral images.
fn ephemeral_images(fx: &Fx) -> usize {
    std::fs::read_dir(fx.pool.path.join("ephemeral")).map_or(0, |d| d.count())
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_inline_ephemeral_volumes_are_off_by_default_and_kept_to_named_pools_and_sizes() {
    let mut fx = fixture("xfs", &[]).await;
    let other = fx.pool.scratch("other-pool");
    let target = fx.pool.scratch("pods").join("inline");
    let cap = mount_cap("", writer());
    let publish =
        |attributes: &[(&str, &str)]| ephemeral_req("csi-eph", &target, cap.clone(), attributes);

    // The driver as deployed by default: no --ephemeral-pools.
    fx.driver.args.retain(|a| !a.starts_with("--ephemeral"));
    fx.respawn(&[]).await;
    let e =
        fx.c.node
            .node_publish_volume(publish(&[]))
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("generic ephemeral volume"), "{e:?}");

    // Pools and a largest size named: other pools and larger sizes are refused.
    fx.driver.args.extend([
        format!("--pool=other={}", other.display()),
        "--ephemeral-pools=default".into(),
        "--ephemeral-max-size=128Mi".into(),
    ]);
    fx.respawn(&[]).await;
    for (attributes, says) in [
        (&[("type", "other")][..], "only the pools default"),
        (&[("size", "256Mi")][..], "--ephemeral-max-size"),
        // xfs is made no smaller than 300 MiB, above the largest size.
        (&[("size", "64Mi")][..], "--ephemeral-max-size"),
    ] {
        let mut req = publish(attributes);
        if attributes == [("size", "64Mi")] {
            req.volume_capability = Some(mount_cap("xfs", writer()));
        }
        let e = fx.c.node.node_publish_volume(req).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{attributes:?}: {e:?}");
        assert!(e.message().contains(says), "{attributes:?}: {e:?}");
    }
    assert!(!target.exists(), "a refused publish makes no target");
    assert_eq!(ephemeral_images(&fx), 0);
    assert!(fx.volume_loops().is_empty());
    assert_eq!(
        std::fs::read_dir(other.join("ephemeral")).map_or(0, |d| d.count()),
        0
    );

    fx.c.node
        .node_publish_volume(publish(&[("size", "100Mi")]))
        .await
        .unwrap();
    assert_eq!(mount_count(&target), 1);
    fx.unpublish("csi-eph", &target).await.unwrap();
    assert_eq!(ephemeral_images(&fx), 0);
}

/// A pool of 2 GiB and a driver that makes inline volumes of up to 2 GiB in it.
async fn small_pool_fixture(envs: &[(&str, &str)]) -> Fx {
    require_root();
    let pool = Pool::with_size("xfs", "2G");
    let driver = Driver::start_with_env(&pool, &["--ephemeral-max-size=2Gi"], envs);
    let c = driver.clients().await;
    Fx { pool, driver, c }
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_inline_ephemeral_sizes_are_reserved_across_restarts_and_released_with_the_pod() {
    let mut fx = small_pool_fixture(&[]).await;
    let first = fx.pool.scratch("pods").join("first");
    let second = fx.pool.scratch("pods").join("second");
    let cap = mount_cap("ext4", writer());
    let big = [("size", "1200Mi")];
    // Each fits the pool's free space alone (the images are sparse, so the
    // first takes little of it); both do not.
    fx.c.node
        .node_publish_volume(ephemeral_req("csi-first", &first, cap.clone(), &big))
        .await
        .unwrap();
    let used = fx.pool.used_bytes();
    assert!(used < 600 * MIB as u64, "the first image is sparse: {used}");
    let second_req = ephemeral_req("csi-second", &second, cap.clone(), &big);
    for when in ["beside the first", "after a restart"] {
        let e =
            fx.c.node
                .node_publish_volume(second_req.clone())
                .await
                .unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{when}: {e:?}");
        assert!(e.message().contains("reserved"), "{when}: {e:?}");
        assert!(!second.exists(), "{when}");
        assert_eq!(ephemeral_images(&fx), 1, "{when}");
        fx.respawn(&[]).await;
    }
    // The first pod goes: its reservation with it.
    fx.unpublish("csi-first", &first).await.unwrap();
    fx.c.node.node_publish_volume(second_req).await.unwrap();
    assert_eq!(mount_count(&second), 1);
    fx.unpublish("csi-second", &second).await.unwrap();
    assert_eq!(ephemeral_images(&fx), 0);
    assert!(fx.volume_loops().is_empty());
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_concurrent_inline_ephemeral_publishes_cannot_both_take_the_same_space() {
    // The first admission pauses after its check: a second one that did not
    // wait for it would find the same free space and pass too.
    let fx = small_pool_fixture(&[(FAILPOINTS, "ephemeral.admission=1*sleep(1500)")]).await;
    let cap = mount_cap("ext4", writer());
    let mut calls = Vec::new();
    for (i, name) in ["csi-a", "csi-b"].into_iter().enumerate() {
        let target = fx.pool.scratch("pods").join(name);
        let req = ephemeral_req(name, &target, cap.clone(), &[("size", "1200Mi")]);
        let mut node = fx.c.node.clone();
        calls.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300 * i as u64)).await;
            (name, target, node.node_publish_volume(req).await.map(drop))
        }));
    }
    let mut fx = fx;
    let mut published = Vec::new();
    for call in calls {
        let (name, target, answer) = call.await.unwrap();
        match answer {
            Ok(()) => published.push((name, target)),
            Err(e) => assert_eq!(e.code(), Code::ResourceExhausted, "{name}: {e:?}"),
        }
    }
    assert_eq!(published.len(), 1, "exactly one of the two is admitted");
    assert_eq!(ephemeral_images(&fx), 1);
    for (name, target) in published {
        fx.unpublish(name, &target).await.unwrap();
    }
    assert_eq!(ephemeral_images(&fx), 0);
}

/// The per-mount options (nodev, nosuid, noatime, ...) of the mount at `p`.
fn mount_flags_at(p: &Path) -> Vec<String> {
    let m = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = m
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some(p.to_str().unwrap()))
        .unwrap_or_else(|| panic!("{} is not mounted", p.display()));
    line.split(' ')
        .nth(5)
        .unwrap()
        .split(',')
        .map(String::from)
        .collect()
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_mounts_are_nodev_nosuid_and_host_naming_options_are_refused() {
    let mut fx = fixture("xfs", &[]).await;
    let loops_before = fx.volume_loops();
    for (fs, bad) in [
        ("ext4", "journal_path=/dev/loop0"),
        ("ext4", "errors=panic"),
        ("xfs", "logdev=/dev/loop0"),
        ("btrfs", "device=/dev/loop0"),
        ("ext4", "suid"),
    ] {
        let cap = cap_with(fs, writer(), &[bad], "");
        let e =
            fx.c.controller
                .create_volume(create_req(
                    &format!("pvc-bad-{fs}"),
                    512 * MIB,
                    cap.clone(),
                    &[],
                ))
                .await
                .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{fs} {bad}: {e:?}");
        assert!(e.message().contains(fs), "{fs} {bad}: {e:?}");
    }
    // A volume made for plain ext4, then staged with an option that names a device.
    let (id, plain, staging, target) = fx.volume("pvc-flags", 64 * MIB, ext4()).await;
    let bad = cap_with("ext4", writer(), &["journal_path=/dev/loop0"], "");
    let e = fx.stage(&id, &staging, &bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(mount_count(&staging), 0);
    assert_eq!(
        fx.volume_loops(),
        loops_before,
        "a refused stage attaches nothing"
    );

    // Allowed options reach the mount, with nodev and nosuid added.
    let cap = cap_with("ext4", writer(), &["noatime", "commit=30"], "");
    fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
    for p in [&staging, &target] {
        let flags = mount_flags_at(p);
        for f in ["nodev", "nosuid", "noatime"] {
            assert!(
                flags.iter().any(|x| x == f),
                "{f} at {}: {flags:?}",
                p.display()
            );
        }
    }
    fx.c.unpublish_and_unstage(&id, &target, &staging).await;

    // An operator who lets volumes be suid, and sets no default flags.
    fx.driver.args.extend([
        "--allow-mount-option=*=suid".to_string(),
        "--default-mount-flags=".to_string(),
    ]);
    fx.respawn(&[]).await;
    let suid = cap_with("ext4", writer(), &["suid"], "");
    fx.c.stage_and_publish(&id, &staging, &target, &suid).await;
    for p in [&staging, &target] {
        let flags = mount_flags_at(p);
        assert!(
            !flags.iter().any(|x| x == "nosuid" || x == "nodev"),
            "{}: {flags:?}",
            p.display()
        );
    }
    fx.c.unpublish_and_unstage(&id, &target, &staging).await;
    let _ = plain;
}

// ---------------------------------------------------------------- access modes

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_single_writer_refuses_second_writer_multi_writer_allows() {
    let mut fx = fixture("xfs", &[]).await;
    let single = mount_cap("ext4", Mode::SingleNodeSingleWriter);
    let id =
        fx.c.create("pvc-single", 64 * MIB, single.clone(), &[])
            .await;
    let staging = fx.pool.scratch("staging-single");
    let a = fx.pool.scratch("pods").join("a");
    let b = fx.pool.scratch("pods").join("b");
    fx.c.stage_and_publish(&id, &staging, &a, &single).await;
    let r = fx.publish(&id, &staging, &b, &single, false).await;
    assert_eq!(code(r), Code::FailedPrecondition);
    assert_eq!(mount_count(&b), 0, "a refused publish changes nothing");
    // Once the writer is gone, another may write.
    fx.unpublish(&id, &a).await.unwrap();
    fx.publish(&id, &staging, &b, &single, false).await.unwrap();
    fx.remove(&id, &staging, &b).await;

    let multi = mount_cap("ext4", Mode::SingleNodeMultiWriter);
    let id = fx.c.create("pvc-multi", 64 * MIB, multi.clone(), &[]).await;
    let staging = fx.pool.scratch("staging-multi");
    fx.c.stage_and_publish(&id, &staging, &a, &multi).await;
    fx.publish(&id, &staging, &b, &multi, false).await.unwrap();
    write_synced(&a.join("shared"), b"seen from b");
    assert_eq!(std::fs::read(b.join("shared")).unwrap(), b"seen from b");
    // Unstage while published is refused.
    assert_eq!(
        code(fx.unstage(&id, &staging).await),
        Code::FailedPrecondition
    );
    fx.unpublish(&id, &a).await.unwrap();
    assert_eq!(mount_count(&b), 1, "the other target stays");
    fx.remove(&id, &staging, &b).await;
    assert!(fx.volume_loops().is_empty());
}

// ---------------------------------------------------------------- validation

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_validation_refuses_bad_paths_and_capabilities() {
    let mut fx = fixture("btrfs", &[]).await;
    let (id, cap, staging, target) = fx.volume("pvc-valid", 64 * MIB, ext4()).await;
    let mounts_before = fx.all_mounts();
    fx.stage(&id, &staging, &cap).await.unwrap();
    let state_target = fx.driver.state.join("evil");
    let pool_target = fx.pool.path.join("volumes").join("evil");
    let link = fx.pool.scratch("pods").join("link");
    std::os::unix::fs::symlink(fx.pool.scratch("elsewhere"), &link).unwrap();
    let link_parent = fx.pool.scratch("pods").join("linkdir");
    std::os::unix::fs::symlink(&fx.pool.path, &link_parent).unwrap();
    let bad: Vec<(String, &str)> = vec![
        (pool_target.display().to_string(), "inside the pool"),
        (fx.pool.path.display().to_string(), "the pool itself"),
        (state_target.display().to_string(), "inside the state dir"),
        ("relative/target".into(), "relative"),
        (
            format!(
                "{}/pods/../pods/t",
                fx.pool.dir.path().join("scratch").display()
            ),
            "with ..",
        ),
        (link.display().to_string(), "a symlink"),
        (
            link_parent.join("t").display().to_string(),
            "through a symlink into the pool",
        ),
        ("".into(), "empty"),
        ("/etc/evil".into(), "system directory"),
    ];
    for (t, why) in &bad {
        let mut req = publish_req(&id, &staging, Path::new(t), cap.clone(), false);
        req.target_path = t.clone();
        let r = fx.c.node.node_publish_volume(req).await;
        assert_eq!(
            r.map(drop).unwrap_err().code(),
            Code::InvalidArgument,
            "publish to {t} ({why})"
        );
        let r = fx.c.node.node_unpublish_volume(unpublish_req(&id, t)).await;
        assert_eq!(
            r.map(drop).unwrap_err().code(),
            Code::InvalidArgument,
            "unpublish of {t} ({why})"
        );
        let mut sreq = stage_req(&id, &staging, cap.clone());
        sreq.staging_target_path = t.clone();
        let r = fx.c.node.node_stage_volume(sreq).await;
        assert_eq!(
            r.map(drop).unwrap_err().code(),
            Code::InvalidArgument,
            "stage at {t} ({why})"
        );
    }
    assert!(!state_target.exists() && !pool_target.exists());
    assert!(std::fs::read_dir(fx.pool.scratch("elsewhere"))
        .unwrap()
        .next()
        .is_none());
    // Missing pieces.
    let mut req = publish_req(&id, &staging, &target, cap.clone(), false);
    req.volume_capability = None;
    assert_eq!(
        fx.c.node.node_publish_volume(req).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let mut req = publish_req("", &staging, &target, cap.clone(), false);
    req.volume_id.clear();
    assert_eq!(
        fx.c.node.node_publish_volume(req).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    // Unknown volumes.
    let unknown = uuid::Uuid::new_v4().to_string();
    assert_eq!(
        code(fx.stage(&unknown, &staging, &cap).await),
        Code::NotFound
    );
    assert_eq!(
        code(fx.publish(&unknown, &staging, &target, &cap, false).await),
        Code::NotFound
    );
    assert_eq!(
        code(fx.stage("no-such-volume", &staging, &cap).await),
        Code::NotFound
    );
    // Block access on a kind=dir volume.
    let dir =
        fx.c.create("pvc-dir", 64 * MIB, cap.clone(), &[("kind", "dir")])
            .await;
    let dstaging = fx.pool.scratch("dstaging");
    assert_eq!(
        code(fx.stage(&dir, &dstaging, &block_cap(writer())).await),
        Code::InvalidArgument
    );
    assert_eq!(mount_count(&dstaging), 0);
    // The dir volume works as a mount volume.
    fx.stage(&dir, &dstaging, &cap).await.unwrap();
    let dt = fx.pool.scratch("pods").join("dt");
    fx.publish(&dir, &dstaging, &dt, &cap, false).await.unwrap();
    write_synced(&dt.join("x"), b"dir data");
    assert_eq!(
        code(
            fx.publish(
                &dir,
                &dstaging,
                &fx.pool.scratch("pods").join("db"),
                &block_cap(writer()),
                false
            )
            .await
        ),
        Code::InvalidArgument
    );
    fx.remove(&dir, &dstaging, &dt).await;
    // Nothing changed by the refused calls.
    assert!(target.symlink_metadata().is_err());
    fx.unstage(&id, &staging).await.unwrap();
    assert_eq!(fx.all_mounts(), mounts_before);
    fx.delete(&id).await;
    assert!(fx.volume_loops().is_empty());
}

/// A kubelet's directory of its own for a test, with the directories a
/// kubelet makes before it asks for a volume, and an outside folder.
struct KubeletDirs {
    _top: tempfile::TempDir,
    kubelet: PathBuf,
    outside: PathBuf,
}

impl KubeletDirs {
    fn new() -> KubeletDirs {
        let top = tempfile::Builder::new()
            .prefix("example-csi-kubelet")
            .tempdir_in("/tmp")
            .unwrap();
        let kubelet = top.path().join("kubelet");
        let outside = top.path().join("outside");
        for d in [
            "pods/uid-1/volumes/kubernetes.io~csi/pv-1",
            "plugins/kubernetes.io/csi/example.csi.k8s.io/hash-1",
            "plugins_registry",
            "pki",
        ] {
            std::fs::create_dir_all(kubelet.join(d)).unwrap();
        }
        std::fs::create_dir_all(&outside).unwrap();
        KubeletDirs {
            _top: top,
            kubelet,
            outside,
        }
    }
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_volumes_go_only_below_the_kubelet_volume_dirs_and_allowed_roots() {
    let k = KubeletDirs::new();
    let kubelet_flag = format!("--kubelet-dir={}", k.kubelet.display());
    let mut fx = fixture("xfs", &[&kubelet_flag]).await;
    let cap = mount_cap("xfs", writer());
    let id = fx.c.create("pvc-roots", 300 * MIB, cap.clone(), &[]).await;
    let pods = k.kubelet.join("pods");
    let csi_dir = k.kubelet.join("plugins/kubernetes.io/csi");
    let staging = csi_dir.join("example.csi.k8s.io/hash-1/globalmount");
    let target = pods.join("uid-1/volumes/kubernetes.io~csi/pv-1/mount");
    // Links a pod's author or a node's tenant could have left on the way out.
    std::os::unix::fs::symlink(&k.outside, pods.join("escape")).unwrap();
    std::os::unix::fs::symlink("../../outside", pods.join("relative-escape")).unwrap();

    // Where the kubelet stages and publishes: served.
    fx.stage(&id, &staging, &cap).await.unwrap();
    fx.publish(&id, &staging, &target, &cap, false)
        .await
        .unwrap();
    write_synced(&target.join("data"), b"in the kubelet's dirs");
    fx.stats(&id, &target).await.unwrap();
    // --allowed-path-root adds a root beside the kubelet's (the tests' own
    // directory here).
    let extra = fx.pool.scratch("pods").join("t");
    fx.publish(&id, &staging, &extra, &cap, false)
        .await
        .unwrap();
    fx.unpublish(&id, &extra).await.unwrap();

    let roots = [pods.display().to_string(), csi_dir.display().to_string()];
    let refused: Vec<(PathBuf, &str)> = vec![
        (k.outside.join("t"), "outside every root"),
        (
            k.kubelet.join("plugins_registry/t"),
            "the kubelet's registration dir",
        ),
        (k.kubelet.join("pki/t"), "the kubelet's credentials"),
        (k.kubelet.join("t"), "the kubelet dir itself"),
        (pods.clone(), "a root itself"),
        (pods.join("escape/t"), "through an absolute link out"),
        (pods.join("escape"), "an absolute link out"),
        (
            pods.join("relative-escape/t"),
            "through a relative link out",
        ),
        (
            pods.join("relative-escape/new/t"),
            "below a link out, not made yet",
        ),
    ];
    for (path, why) in &refused {
        let p = path.display().to_string();
        let check = |what: &str, r: Result<(), tonic::Status>, want: Code| {
            let e = r.expect_err(&format!("{what} at {p} ({why})"));
            assert_eq!(e.code(), want, "{what} at {p} ({why}): {e:?}");
            assert!(e.message().contains(&p), "{what} ({why}): {}", e.message());
            // A path outside every root is told which roots there are.
            if !path.starts_with(&pods) && !path.starts_with(&csi_dir) {
                for r in &roots {
                    assert!(e.message().contains(r), "{what} ({why}): {}", e.message());
                }
            }
        };
        let invalid = Code::InvalidArgument;
        check(
            "publish",
            fx.publish(&id, &staging, path, &cap, false).await,
            invalid,
        );
        check("stage", fx.stage(&id, path, &cap).await, invalid);
        check("unpublish", fx.unpublish(&id, path).await, invalid);
        check("unstage", fx.unstage(&id, path).await, invalid);
        // NodeGetVolumeStats: no volume is at a path where none is ever put.
        check("stats", fx.stats(&id, path).await.map(drop), Code::NotFound);
        let expand = csi::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: p.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 400 * MIB,
                limit_bytes: 0,
            }),
            ..Default::default()
        };
        check(
            "expand",
            fx.c.node.node_expand_volume(expand).await.map(drop),
            invalid,
        );
    }
    // Nothing was made or mounted outside, and the volume kept its size.
    assert_eq!(std::fs::read_dir(&k.outside).unwrap().count(), 0);
    assert!(!k.kubelet.join("t").exists() && !k.kubelet.join("pki/t").exists());
    assert!(mounts_below(&k.outside).is_empty());
    assert!(
        fs_bytes(&target) < 350 * MIB as u64,
        "the volume did not grow"
    );

    fx.unpublish(&id, &target).await.unwrap();
    fx.unstage(&id, &staging).await.unwrap();
    fx.delete(&id).await;
    assert!(mounts_below(&k.kubelet).is_empty());
}

// ---------------------------------------------------------------- concurrency

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_concurrent_calls_on_one_volume_abort_others_proceed() {
    let mut fx = fixture("xfs", &[]).await;
    let cap = mount_cap("xfs", writer());
    let id = fx.c.create("pvc-conc", 300 * MIB, cap.clone(), &[]).await;
    let other = fx.c.create("pvc-conc-2", 300 * MIB, cap.clone(), &[]).await;
    let staging = fx.pool.scratch("staging");
    let staging2 = fx.pool.scratch("staging2");
    // Several stages of one volume at once (mkfs, check and mount take a while):
    // each either does the work or is ABORTED; a second volume is not held up.
    let mut calls = Vec::new();
    for _ in 0..6 {
        let mut n = fx.c.node.clone();
        let req = stage_req(&id, &staging, cap.clone());
        calls.push(tokio::spawn(async move {
            n.node_stage_volume(req).await.map(drop)
        }));
    }
    let mut n2 = fx.c.node.clone();
    let req2 = stage_req(&other, &staging2, cap.clone());
    let second = tokio::spawn(async move { n2.node_stage_volume(req2).await.map(drop) });
    let mut ok = 0;
    let mut aborted = 0;
    for c in calls {
        match c.await.unwrap() {
            Ok(()) => ok += 1,
            Err(s) if s.code() == Code::Aborted => aborted += 1,
            Err(s) => panic!("unexpected {s:?}"),
        }
    }
    second.await.unwrap().expect("another volume proceeds");
    assert!(ok >= 1, "one call did the work");
    assert!(aborted >= 1, "concurrent calls were ABORTED ({ok} ok)");
    assert_eq!(mount_count(&staging), 1);
    assert_eq!(mount_count(&staging2), 1);
    // The retries kubelet makes afterwards succeed.
    fx.stage(&id, &staging, &cap).await.unwrap();
    fx.unstage(&id, &staging).await.unwrap();
    fx.unstage(&other, &staging2).await.unwrap();
    fx.delete(&id).await;
    fx.delete(&other).await;
    assert!(fx.volume_loops().is_empty());
}

// ---------------------------------------------------------------- crashes

#[derive(Clone, Copy, PartialEq, Debug)]
enum Phase {
    Stage,
    Publish,
    Unpublish,
    Unstage,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Mount,
    Block,
    BlockRo,
}

/// Brings a volume to just before `phase`, crashes the driver at `point` during
/// it, restarts, retries as kubelet would, checks the state, then finishes the
/// volume's life and checks nothing leaked.
async fn crash_at(point: &str, phase: Phase, kind: Kind) {
    let mut fx = fixture("xfs", &[]).await;
    let loops_before = fx.volume_loops();
    let mounts_before = fx.all_mounts();
    let cap = match kind {
        Kind::Mount => ext4(),
        _ => block_cap(writer()),
    };
    let ro = kind == Kind::BlockRo;
    let (id, cap, staging, target) = fx.volume("pvc-crash", 64 * MIB, cap).await;
    let data = pattern(256 * 1024, 5);
    let write = |t: &Path| {
        if kind == Kind::Mount {
            write_synced(&t.join("d"), &data);
        } else if !ro {
            let mut f = std::fs::OpenOptions::new().write(true).open(t).unwrap();
            f.write_all(&data).unwrap();
            f.sync_all().unwrap();
        }
    };
    let check = |t: &Path| {
        if kind == Kind::Mount {
            assert!(std::fs::read(t.join("d")).unwrap() == data, "data differs");
        } else if !ro {
            let mut back = vec![0u8; data.len()];
            std::fs::File::open(t)
                .unwrap()
                .read_exact(&mut back)
                .unwrap();
            assert!(back == data, "block data differs");
        }
    };
    // Before the phase.
    if phase != Phase::Stage {
        fx.stage(&id, &staging, &cap).await.unwrap();
    }
    if matches!(phase, Phase::Unpublish | Phase::Unstage) {
        fx.publish(&id, &staging, &target, &cap, ro).await.unwrap();
        write(&target);
    }
    if phase == Phase::Unstage {
        fx.unpublish(&id, &target).await.unwrap();
    }
    // The crash.
    fx.respawn(&[(FAILPOINTS, point)]).await;
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        fx.run(phase, &id, [&staging, &target], &cap, ro),
    )
    .await;
    assert!(
        !matches!(r, Ok(Ok(()))),
        "{point}: the call succeeded, the failpoint was not reached"
    );
    let status = fx.driver.wait_exit(30);
    assert!(
        status.is_some(),
        "{point}: the driver did not die; the call answered {r:?}; its log:\n{}",
        fx.driver.log_text()
    );
    assert!(fx
        .driver
        .log_text()
        .contains(&format!("failpoint {point} reached")));
    // The retry after the restart.
    fx.respawn(&[]).await;
    let retry = fx.run(phase, &id, [&staging, &target], &cap, ro).await;
    retry.unwrap_or_else(|e| panic!("{point}: retry failed: {e:?}\n{}", fx.driver.log_text()));
    // A second retry changes nothing.
    let again = fx.run(phase, &id, [&staging, &target], &cap, ro).await;
    again.unwrap_or_else(|e| panic!("{point}: second retry failed: {e:?}"));
    let block = kind != Kind::Mount;
    let staged_loops = loops_before.len() + 1;
    match phase {
        Phase::Stage => {
            assert_eq!(mount_count(&staging), usize::from(!block), "{point}");
            assert_eq!(fx.volume_loops().len(), staged_loops, "{point}");
        }
        Phase::Publish => {
            assert_eq!(mount_count(&target), 1, "{point}");
            assert_eq!(mount_count(&staging), usize::from(!block), "{point}");
            assert_eq!(
                fx.volume_loops().len(),
                staged_loops + usize::from(ro),
                "{point}: exactly the loop devices expected: {:?}",
                fx.volume_loops()
            );
        }
        Phase::Unpublish => {
            assert_eq!(mount_count(&target), 0, "{point}");
            assert!(!target.exists(), "{point}: the target is removed");
            assert_eq!(mount_count(&staging), usize::from(!block), "{point}");
            assert_eq!(fx.volume_loops().len(), staged_loops, "{point}");
        }
        Phase::Unstage => {
            assert_eq!(mount_count(&staging), 0, "{point}");
            assert_eq!(fx.volume_loops(), loops_before, "{point}");
        }
    }
    // The rest of the volume's life, with the data checked.
    if matches!(phase, Phase::Stage | Phase::Publish) {
        if phase == Phase::Stage {
            fx.publish(&id, &staging, &target, &cap, ro).await.unwrap();
        }
        write(&target);
        check(&target);
        fx.unpublish(&id, &target).await.unwrap();
    }
    if phase == Phase::Unpublish {
        fx.publish(&id, &staging, &target, &cap, ro).await.unwrap();
        check(&target);
        fx.unpublish(&id, &target).await.unwrap();
    }
    if phase != Phase::Unstage {
        fx.unstage(&id, &staging).await.unwrap();
    } else {
        fx.stage(&id, &staging, &cap).await.unwrap();
        fx.publish(&id, &staging, &target, &cap, ro).await.unwrap();
        check(&target);
        fx.unpublish(&id, &target).await.unwrap();
        fx.unstage(&id, &staging).await.unwrap();
    }
    fx.delete(&id).await;
    assert_eq!(
        fx.volume_loops(),
        loops_before,
        "{point}: loop devices leaked"
    );
    assert_eq!(fx.all_mounts(), mounts_before, "{point}: mounts leaked");
}

root_cases! {
    root_crash_stage_after_intent: crash_at("stage.after-intent", Phase::Stage, Kind::Mount);
    root_crash_stage_after_attach: crash_at("stage.after-attach", Phase::Stage, Kind::Mount);
    root_crash_stage_after_mkfs: crash_at("stage.after-mkfs", Phase::Stage, Kind::Mount);
    root_crash_stage_after_mount: crash_at("stage.after-mount", Phase::Stage, Kind::Mount);
    root_crash_stage_after_commit: crash_at("stage.after-commit", Phase::Stage, Kind::Mount);
    root_crash_stage_block_after_attach: crash_at("stage.after-attach", Phase::Stage, Kind::Block);
    root_crash_publish_after_intent: crash_at("publish.after-intent", Phase::Publish, Kind::Mount);
    root_crash_publish_after_mount: crash_at("publish.after-mount", Phase::Publish, Kind::Mount);
    root_crash_publish_block_after_intent: crash_at("publish.after-intent", Phase::Publish, Kind::Block);
    root_crash_publish_block_ro_after_intent: crash_at("publish.after-intent", Phase::Publish, Kind::BlockRo);
    root_crash_publish_block_ro_after_mount: crash_at("publish.after-mount", Phase::Publish, Kind::BlockRo);
    root_crash_unpublish_after_unmount: crash_at("unpublish.after-unmount", Phase::Unpublish, Kind::Mount);
    root_crash_unpublish_after_commit: crash_at("unpublish.after-commit", Phase::Unpublish, Kind::Mount);
    root_crash_unpublish_block_ro_after_unmount: crash_at("unpublish.after-unmount", Phase::Unpublish, Kind::BlockRo);
    root_crash_unstage_after_unmount: crash_at("unstage.after-unmount", Phase::Unstage, Kind::Mount);
    root_crash_unstage_after_detach: crash_at("unstage.after-detach", Phase::Unstage, Kind::Mount);
    root_crash_unstage_block_after_detach: crash_at("unstage.after-detach", Phase::Unstage, Kind::Block);
}

// ---------------------------------------------------------------- reboot

/// Kills the driver and removes every mount and loop device of the volumes, as a
/// node reboot does.
async fn simulate_reboot(fx: &mut Fx, paths: &[&Path]) {
    fx.driver.kill9();
    for p in paths {
        while mount_count(p) > 0 {
            umount(p);
        }
    }
    for d in fx.volume_loops() {
        detach(&d);
    }
    assert!(fx.volume_loops().is_empty());
    fx.respawn(&[]).await;
}

async fn reboot(vol_fs: &str, size: i64) {
    let mut fx = fixture("xfs", &[]).await;
    let mounts_before = fx.all_mounts();
    let name = format!("pvc-reboot-{vol_fs}");
    let (id, cap, staging, target) = fx
        .volume_in_use(&name, size, mount_cap(vol_fs, writer()))
        .await;
    let data = pattern(2 * 1024 * 1024 + 5, 13);
    write_synced(&target.join("d"), &data);
    simulate_reboot(&mut fx, &[&target, &staging]).await;
    // Health before kubelet's retries: both mounts are gone.
    assert_eq!(
        health_reasons(&node_health(&mut fx.c, &id).await),
        vec![
            (
                csi::VolumeHealthErrorType::Inaccessible,
                "PublishMountMissing".to_string()
            ),
            (
                csi::VolumeHealthErrorType::Inaccessible,
                "StagingMountMissing".to_string()
            ),
        ]
    );
    fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
    assert!(
        std::fs::read(target.join("d")).unwrap() == data,
        "data intact"
    );
    assert_eq!(mount_count(&target), 1);
    assert_eq!(mount_count(&staging), 1);
    assert_eq!(fx.volume_loops().len(), 1);
    fx.remove(&id, &staging, &target).await;
    assert!(fx.volume_loops().is_empty());
    assert_eq!(fx.all_mounts(), mounts_before);
}

root_cases! {
    root_reboot_ext4_data_intact: reboot("ext4", 64 * MIB);
    root_reboot_xfs_data_intact: reboot("xfs", 300 * MIB);
    root_reboot_btrfs_data_intact: reboot("btrfs", 128 * MIB);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_reboot_block_volumes_come_back() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, cap, staging, _) = fx
        .volume("pvc-reboot-block", 64 * MIB, block_cap(writer()))
        .await;
    let rw = fx.pool.scratch("pods").join("rw");
    let ro = fx.pool.scratch("pods").join("ro");
    fx.c.stage_and_publish(&id, &staging, &rw, &cap).await;
    fx.publish(&id, &staging, &ro, &cap, true).await.unwrap();
    let data = pattern(64 * 1024, 21);
    {
        let mut f = std::fs::OpenOptions::new().write(true).open(&rw).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
    }
    simulate_reboot(&mut fx, &[&rw, &ro]).await;
    fx.c.stage_and_publish(&id, &staging, &rw, &cap).await;
    fx.publish(&id, &staging, &ro, &cap, true).await.unwrap();
    assert_eq!(fx.volume_loops().len(), 2, "{:?}", fx.volume_loops());
    let mut back = vec![0u8; data.len()];
    std::fs::File::open(&ro)
        .unwrap()
        .read_exact(&mut back)
        .unwrap();
    assert!(back == data);
    assert!(std::fs::OpenOptions::new()
        .write(true)
        .open(&ro)
        .and_then(|mut f| f.write_all(&[0u8; 512]).and_then(|_| f.sync_all()))
        .is_err());
    fx.unpublish(&id, &ro).await.unwrap();
    fx.remove(&id, &staging, &rw).await;
    assert!(fx.volume_loops().is_empty());
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_unpublish_unstage_succeed_when_mounts_vanished() {
    let mut fx = fixture("xfs", &[]).await;
    let mounts_before = fx.all_mounts();
    let (id, cap, staging, target) = fx.volume_in_use("pvc-vanish", 64 * MIB, ext4()).await;
    // Without a restart: the mounts vanish under a running driver.
    umount(&target);
    umount(&staging);
    fx.unpublish(&id, &target).await.unwrap();
    assert!(!target.exists());
    fx.unstage(&id, &staging).await.unwrap();
    assert!(fx.volume_loops().is_empty(), "the loop device is detached");
    // And after a reboot with the devices gone too.
    fx.c.stage_and_publish(&id, &staging, &target, &cap).await;
    simulate_reboot(&mut fx, &[&target, &staging]).await;
    fx.remove(&id, &staging, &target).await;
    assert!(fx.volume_loops().is_empty());
    assert_eq!(fx.all_mounts(), mounts_before);
}

// ---------------------------------------------------------------- info, ephemeral crashes, orphans

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_node_info_and_capabilities() {
    let mut fx = fixture("xfs", &["--max-volumes-per-node=7"]).await;
    let info =
        fx.c.node
            .node_get_info(csi::NodeGetInfoRequest::default())
            .await
            .unwrap()
            .into_inner();
    assert_eq!(info.node_id, "test-node");
    assert_eq!(info.max_volumes_per_node, 7);
    let topo = info.accessible_topology.unwrap().segments;
    assert_eq!(
        topo.get("topology.example.csi/node").map(String::as_str),
        Some("test-node")
    );
    // The capabilities by their names in the CSI spec.
    use csi::node_service_capability::{rpc::Type, Type::Rpc};
    let resp =
        fx.c.node
            .node_get_capabilities(csi::NodeGetCapabilitiesRequest {});
    let caps: Vec<&str> = resp
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(Rpc(r)) => Type::try_from(r.r#type).ok().map(|t| t.as_str_name()),
            _ => None,
        })
        .collect();
    let expected = "STAGE_UNSTAGE_VOLUME GET_VOLUME_STATS EXPAND_VOLUME SINGLE_NODE_MULTI_WRITER \
                    VOLUME_MOUNT_GROUP GET_VOLUME_HEALTH GET_STORAGE_HEALTH";
    for t in expected.split_whitespace() {
        assert!(caps.contains(&t), "{t} advertised: {caps:?}");
    }
}

/// A crash inside an ephemeral volume's publish or unpublish: the retry
/// completes it and nothing is left after the unpublish.
async fn ephemeral_crash(point: &str, during_publish: bool) {
    let mut fx = fixture("xfs", &[]).await;
    let mounts_before = fx.all_mounts();
    let target = fx.pool.scratch("pods").join("inline");
    let req = ephemeral_req(
        "csi-ephemeral-crash",
        &target,
        mount_cap("", writer()),
        &[("size", "64Mi")],
    );
    let eph = fx.pool.path.join("ephemeral");
    if !during_publish {
        fx.c.node.node_publish_volume(req.clone()).await.unwrap();
        write_synced(&target.join("x"), b"scratch");
    }
    fx.respawn(&[(FAILPOINTS, point)]).await;
    let r = if during_publish {
        fx.c.node.node_publish_volume(req.clone()).await.map(drop)
    } else {
        fx.unpublish("csi-ephemeral-crash", &target).await
    };
    assert!(r.is_err(), "{point} was not reached");
    assert!(
        fx.driver.wait_exit(30).is_some(),
        "{point}: the driver did not die"
    );
    fx.respawn(&[]).await;
    if during_publish {
        fx.c.node.node_publish_volume(req.clone()).await.unwrap();
        assert_eq!(mount_count(&target), 1);
        assert_eq!(fx.volume_loops().len(), 1);
        write_synced(&target.join("x"), b"scratch");
    }
    fx.unpublish("csi-ephemeral-crash", &target).await.unwrap();
    fx.unpublish("csi-ephemeral-crash", &target).await.unwrap();
    assert!(!target.exists(), "{point}");
    assert!(
        fx.volume_loops().is_empty(),
        "{point}: {:?}",
        fx.volume_loops()
    );
    assert_eq!(std::fs::read_dir(&eph).unwrap().count(), 0, "{point}");
    assert_eq!(fx.all_mounts(), mounts_before, "{point}");
}

root_cases! {
    root_crash_ephemeral_after_reserve: ephemeral_crash("ephemeral.after-reserve", true);
    root_crash_ephemeral_after_create: ephemeral_crash("ephemeral.after-create", true);
    root_crash_ephemeral_publish_after_mount: ephemeral_crash("stage.after-mount", true);
    root_crash_ephemeral_after_unstage: ephemeral_crash("ephemeral.after-unstage", false);
    root_crash_ephemeral_unpublish_after_unmount: ephemeral_crash("unpublish.after-unmount", false);
}

#[tokio::test]
#[ignore = "needs root: loop devices and mounts"]
async fn root_start_reports_loop_devices_and_mounts_no_volume_accounts_for() {
    let mut fx = fixture("xfs", &[]).await;
    let (id, cap, staging, _) = fx.volume("pvc-orphan", 64 * MIB, ext4()).await;
    fx.stage(&id, &staging, &cap).await.unwrap();
    // The driver forgets the volume was staged (its node state is lost) while
    // the device and mount stay: the next start reports both.
    fx.driver.kill9();
    let node_state = fx.driver.state.join("node");
    if node_state.exists() {
        std::fs::remove_dir_all(&node_state).unwrap();
        std::fs::create_dir(&node_state).unwrap();
    }
    fx.respawn(&[]).await;
    std::thread::sleep(Duration::from_millis(300));
    let log = fx.driver.log_text();
    assert!(
        log.contains("no staged volume accounts for"),
        "the orphan loop device is reported: {log}"
    );
    assert!(
        log.contains("mount of a pool volume that no staged volume accounts for"),
        "the orphan mount is reported"
    );
    // Kubelet's retry brings the record back; the volume then leaves cleanly.
    fx.stage(&id, &staging, &cap).await.unwrap();
    fx.unstage(&id, &staging).await.unwrap();
    fx.delete(&id).await;
    assert!(fx.volume_loops().is_empty());
}
