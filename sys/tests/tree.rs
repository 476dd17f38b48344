//! The walks of a tree a tenant changes while it is walked (copy of a live
//! directory volume, fsGroup walk): nothing outside the tree is read, written or
//! changed, whatever the tenant swaps and whenever.
//!
//! The windows are forced with the walk's failpoints (`tree.entry-listed`
//! between listing a name and opening it, `tree.entry-opened` between opening
//! it and using it): the hook swaps entries for symbolic links to a canary
//! outside the tree exactly there. The `*_while_a_tenant_swaps` tests add the
//! free-running race, thousands of swaps, on /tmp and (as root) on xfs and btrfs
//! pools.

mod common;

use std::cell::RefCell;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::{require_root, LoopMountedPool, MIB};
use csi_sys::tree;

const CANARY: &[u8] = b"CANARY: a file outside the volume";

/// An action at a failpoint.
type Action = Box<dyn FnMut(&str)>;

thread_local! {
    /// What the failpoint hook does on this thread: the walk runs on the
    /// test's own thread, so tests running in parallel do not see each
    /// other's actions.
    static ON_POINT: RefCell<Option<Action>> = const { RefCell::new(None) };
}

fn hook(name: &str) {
    ON_POINT.with(|a| {
        if let Some(f) = a.borrow_mut().as_mut() {
            f(name)
        }
    })
}

/// Runs `f` with `action` called at every failpoint the walks reach.
fn at_points<T>(action: impl FnMut(&str) + 'static, f: impl FnOnce() -> T) -> T {
    csi_sys::set_failpoint_hook(hook);
    ON_POINT.with(|a| *a.borrow_mut() = Some(Box::new(action)));
    let out = f();
    ON_POINT.with(|a| *a.borrow_mut() = None);
    out
}

/// A tenant's tree and, beside it, what it must never reach.
struct Scene {
    _tmp: Option<tempfile::TempDir>,
    base: PathBuf,
}

impl Scene {
    fn new() -> Scene {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().to_path_buf();
        Scene::build(Some(tmp), base)
    }

    /// A scene built in `base` (a pool).
    fn in_dir(base: &Path) -> Scene {
        Scene::build(None, base.to_path_buf())
    }

    /// The scene already built in `base`, for the tenant's hands.
    fn at(base: &Path) -> Scene {
        Scene {
            _tmp: None,
            base: base.to_path_buf(),
        }
    }

    fn build(tmp: Option<tempfile::TempDir>, base: PathBuf) -> Scene {
        let outside = base.join("outside");
        fs::create_dir_all(outside.join("secrets")).unwrap();
        fs::write(outside.join("secret"), CANARY).unwrap();
        fs::write(outside.join("secrets/token"), CANARY).unwrap();
        fs::set_permissions(outside.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();
        fs::set_permissions(outside.join("secrets"), fs::Permissions::from_mode(0o700)).unwrap();
        let vol = base.join("vol");
        for i in 0..4 {
            let d = vol.join(format!("d{i}"));
            fs::create_dir_all(d.join("deeper")).unwrap();
            fs::write(d.join("f"), format!("inside d{i}")).unwrap();
            fs::write(d.join("deeper/g"), b"inside deeper").unwrap();
            fs::write(vol.join(format!("f{i}")), format!("inside f{i}")).unwrap();
        }
        Scene { _tmp: tmp, base }
    }

    fn vol(&self) -> PathBuf {
        self.base.join("vol")
    }

    fn outside(&self) -> PathBuf {
        self.base.join("outside")
    }

    /// The tenant's move: `name` (a directory or a file of the volume's root)
    /// becomes a symbolic link to the outside, its content kept under
    /// `name.real`. False when it is already swapped.
    fn swap(&self, name: &str) -> bool {
        let p = self.vol().join(name);
        let real = self.vol().join(format!("{name}.real"));
        if fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
            return false;
        }
        let target = match p.is_dir() {
            true => self.outside(),
            false => self.outside().join("secret"),
        };
        fs::rename(&p, &real).unwrap();
        std::os::unix::fs::symlink(&target, &p).unwrap();
        true
    }

    /// Undoes [`Scene::swap`].
    fn unswap(&self, name: &str) {
        let p = self.vol().join(name);
        let real = self.vol().join(format!("{name}.real"));
        if fs::symlink_metadata(&real).is_ok() {
            fs::remove_file(&p).unwrap();
            fs::rename(&real, &p).unwrap();
        }
    }

    /// The outside, as it must stay: every file's bytes, owner and mode.
    fn outside_state(&self) -> Vec<(PathBuf, Vec<u8>, u32, u32)> {
        let mut out = Vec::new();
        for p in [
            self.outside(),
            self.outside().join("secret"),
            self.outside().join("secrets"),
            self.outside().join("secrets/token"),
        ] {
            let m = fs::symlink_metadata(&p).unwrap();
            let bytes = if m.is_file() {
                fs::read(&p).unwrap()
            } else {
                vec![]
            };
            out.push((p, bytes, m.gid(), m.mode()));
        }
        out
    }
}

/// Every regular file below `dir`, links not followed: none may hold the canary.
fn assert_no_canary(dir: &Path) -> usize {
    let mut files = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p);
            } else if m.is_file() {
                files += 1;
                assert_ne!(
                    fs::read(&p).unwrap(),
                    CANARY,
                    "{} holds the canary",
                    p.display()
                );
            }
        }
    }
    files
}

#[test]
fn a_swap_between_listing_and_opening_copies_the_link_never_its_target() {
    let s = Scene::new();
    let dst = s.base.join("copy");
    let base = s.base.clone();
    let report = at_points(
        move |point| {
            if point == "tree.entry-listed" {
                // Whatever name the walk is about to open, it is a link now.
                let s = Scene::at(&base);
                for n in ["d0", "d1", "f0", "f1"] {
                    s.swap(n);
                }
            }
        },
        || tree::copy_tree(&s.vol(), &dst).unwrap(),
    );
    assert_no_canary(&dst);
    for n in ["d0", "d1", "f0", "f1"] {
        let m = fs::symlink_metadata(dst.join(n));
        // Either copied as the link it had become, or listed after its swap
        // under its new name only (getdents may or may not show it again).
        if let Ok(m) = m {
            assert!(m.file_type().is_symlink(), "{n} copied as {m:?}");
        }
    }
    assert!(report.entries > 0);
}

#[test]
fn a_swap_between_opening_and_reading_copies_what_was_opened() {
    let s = Scene::new();
    let dst = s.base.join("copy");
    let base = s.base.clone();
    let swaps = Arc::new(AtomicU64::new(0));
    let n = swaps.clone();
    at_points(
        move |point| {
            if point == "tree.entry-opened" {
                // The walk holds the entry: swapping its name now must not
                // change what is read or listed through it.
                let s = Scene::at(&base);
                for name in ["d0", "d1", "d2", "d3", "f0", "f1", "f2", "f3"] {
                    if s.swap(name) {
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        },
        || tree::copy_tree(&s.vol(), &dst).unwrap(),
    );
    assert!(swaps.load(Ordering::Relaxed) >= 8);
    assert_no_canary(&dst);
    // The first entry opened was a real one, and its copy holds its own data.
    let copied_real = (0..4).any(|i| {
        fs::read(dst.join(format!("d{i}/f"))).ok() == Some(format!("inside d{i}").into_bytes())
            || fs::read(dst.join(format!("f{i}"))).ok() == Some(format!("inside f{i}").into_bytes())
    });
    assert!(
        copied_real,
        "no entry was copied through its opened descriptor"
    );
}

#[test]
fn the_group_walk_never_changes_what_a_swapped_link_leads_to() {
    for point in ["tree.entry-listed", "tree.entry-opened"] {
        let s = Scene::new();
        let before = s.outside_state();
        let base = s.base.clone();
        let report = at_points(
            move |p| {
                if p == point {
                    let s = Scene::at(&base);
                    for name in ["d0", "d1", "d2", "d3", "f0", "f1", "f2", "f3"] {
                        s.swap(name);
                    }
                }
            },
            || tree::share_contents_with_group(&s.vol(), 4242).unwrap(),
        );
        assert_eq!(s.outside_state(), before, "{point}: the outside changed");
        assert!(report.entries > 0, "{point}");
        // The walk acted on what it held: a link as itself, an entry opened
        // before its swap as that entry.
        let given = fs::read_dir(s.vol())
            .unwrap()
            .map(|e| fs::symlink_metadata(e.unwrap().path()).unwrap())
            .any(|m| m.gid() == 4242);
        assert!(given, "{point}: nothing was given to the group");
    }
}

#[test]
fn entries_that_vanish_during_a_copy_are_skipped_and_counted() {
    let s = Scene::new();
    let dst = s.base.join("copy");
    let vol = s.vol();
    let report = at_points(
        move |point| {
            if point == "tree.entry-listed" {
                // A workload deleting and renaming as the walk goes.
                for i in 0..4 {
                    let _ = fs::remove_file(vol.join(format!("f{i}")));
                    let _ = fs::rename(vol.join(format!("d{i}")), vol.join(format!("moved{i}")));
                }
            }
        },
        || tree::copy_tree(&s.vol(), &dst).unwrap(),
    );
    assert!(report.vanished >= 1, "{report:?}");
    // Everything copied holds its own bytes.
    assert_no_canary(&dst);
    for e in fs::read_dir(&dst).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        if name.starts_with('f') {
            assert_eq!(
                fs::read(e.path()).unwrap(),
                format!("inside {name}").into_bytes()
            );
        }
    }
}

#[test]
fn a_tree_deeper_than_the_limit_is_refused_with_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("vol");
    fs::create_dir(&root).unwrap();
    // Built through a descriptor per level: the path gets too long for the
    // kernel to take at once.
    let mut dir = fs::File::open(&root).unwrap();
    for _ in 0..tree::MAX_DEPTH + 1 {
        nix::sys::stat::mkdirat(&dir, "d", nix::sys::stat::Mode::from_bits_truncate(0o700))
            .unwrap();
        let fd = nix::fcntl::openat(
            &dir,
            "d",
            nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
            nix::sys::stat::Mode::empty(),
        )
        .unwrap();
        dir = fs::File::from(fd);
    }
    let err = tree::copy_tree(&root, &tmp.path().join("copy")).unwrap_err();
    assert!(err.is_invalid_argument(), "{err:?}");
    assert!(err.to_string().contains("directories deep"), "{err}");
    let err = tree::share_contents_with_group(&root, 4242).unwrap_err();
    assert!(err.is_invalid_argument(), "{err:?}");
    // Removing it needs no path either.
    let _ = std::process::Command::new("rm")
        .arg("-rf")
        .arg(&root)
        .status();
}

#[test]
#[ignore = "needs root: bind mounts"]
fn root_a_mount_inside_the_tree_is_neither_copied_nor_changed() {
    require_root();
    let s = Scene::new();
    let inner = s.vol().join("d0/mnt");
    fs::create_dir(&inner).unwrap();
    common::sh(
        "mount",
        &[
            "--bind",
            s.outside().to_str().unwrap(),
            inner.to_str().unwrap(),
        ],
    );
    let before = s.outside_state();
    let dst = s.base.join("copy");
    let copied = tree::copy_tree(&s.vol(), &dst);
    let shared = tree::share_contents_with_group(&s.vol(), 4242);
    common::sh("umount", &[inner.to_str().unwrap()]);
    let copied = copied.unwrap();
    assert_eq!(copied.mounts_skipped, 1);
    assert_eq!(shared.unwrap().mounts_skipped, 1);
    assert!(!dst.join("d0/mnt").exists());
    assert_no_canary(&dst);
    assert_eq!(s.outside_state(), before);
}

/// The free-running race: a tenant thread swapping every entry of the volume's
/// root for links to the outside and back, as fast as it can, while the walks
/// run again and again. Returns (swaps, copies, files checked).
fn race(s: &Scene, copies_dir: &Path, rounds: usize) -> (u64, usize, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let tenant = {
        let (stop, swaps, base) = (stop.clone(), swaps.clone(), s.base.clone());
        std::thread::spawn(move || {
            let s = Scene::at(&base);
            let names = ["d0", "d1", "d2", "d3", "f0", "f1", "f2", "f3"];
            while !stop.load(Ordering::Relaxed) {
                for n in names {
                    if s.swap(n) {
                        swaps.fetch_add(1, Ordering::Relaxed);
                    }
                }
                for n in names {
                    s.unswap(n);
                }
            }
            for n in names {
                s.unswap(n);
            }
        })
    };
    let before = s.outside_state();
    let mut files = 0;
    fs::create_dir_all(copies_dir).unwrap();
    for i in 0..rounds {
        let dst = copies_dir.join(format!("copy-{i}"));
        tree::copy_tree(&s.vol(), &dst).unwrap();
        files += assert_no_canary(&dst);
        tree::share_contents_with_group(&s.vol(), 4000 + i as u32 % 7).unwrap();
        assert_eq!(s.outside_state(), before, "round {i}: the outside changed");
        fs::remove_dir_all(&dst).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    tenant.join().unwrap();
    (swaps.load(Ordering::Relaxed), rounds, files)
}

#[test]
fn copies_and_group_walks_while_a_tenant_swaps() {
    let s = Scene::new();
    let (swaps, copies, files) = race(&s, &s.base.join("copies"), 300);
    eprintln!("/tmp: {swaps} swaps during {copies} copies and group walks, {files} files checked");
    assert!(swaps >= 1000, "only {swaps} swaps: the race did not run");
}

#[test]
#[ignore = "needs root: loop-mounted xfs and btrfs pools"]
fn root_copies_and_group_walks_while_a_tenant_swaps_on_xfs_and_btrfs() {
    require_root();
    for (fstype, size) in [("xfs", 512 * MIB), ("btrfs", 256 * MIB)] {
        let pool = LoopMountedPool::new(fstype, size);
        let s = Scene::in_dir(pool.path());
        let (swaps, copies, files) = race(&s, &pool.path().join("copies"), 300);
        eprintln!(
            "{fstype}: {swaps} swaps during {copies} copies and group walks, {files} files checked"
        );
        assert!(
            swaps >= 1000,
            "{fstype}: only {swaps} swaps: the race did not run"
        );
    }
}
