//! Directory entries and what `stat` says of a path: listing a folder, moving
//! and removing entries, reading small files whole, resolving a path.
//!
//! The domain decides what to do with the pools and the state directory from
//! these answers; the changes they make are recorded for the power-loss model
//! (`fsrecord`), and a move is durable before it returns, because the domain
//! goes on as if it were.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{Result, SysError};
use crate::file::{fsync_dir, parent_dir};
use crate::fsrecord::{note, FsOp};

/// What a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    /// A device node, a fifo or a socket.
    Special,
}

/// What `stat` (or `lstat`) says of a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inode {
    pub kind: Kind,
    /// Length in bytes.
    pub len: u64,
    /// The device number of a device node (0 for anything else).
    pub rdev: u64,
    pub modified: SystemTime,
}

impl Inode {
    fn of(m: &fs::Metadata) -> Inode {
        let ft = m.file_type();
        let kind = if ft.is_symlink() {
            Kind::Symlink
        } else if ft.is_dir() {
            Kind::Dir
        } else if ft.is_file() {
            Kind::File
        } else {
            Kind::Special
        };
        Inode {
            kind,
            len: m.len(),
            rdev: if ft.is_block_device() || ft.is_char_device() {
                m.rdev()
            } else {
                0
            },
            modified: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        }
    }

    pub fn is_dir(&self) -> bool {
        self.kind == Kind::Dir
    }

    pub fn is_file(&self) -> bool {
        self.kind == Kind::File
    }

    pub fn is_symlink(&self) -> bool {
        self.kind == Kind::Symlink
    }

    /// (major, minor) of a device node.
    pub fn device_numbers(&self) -> (u32, u32) {
        let rdev = self.rdev;
        let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
        let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
        (major as u32, minor as u32)
    }
}

fn absent_or(op: &'static str, path: &Path, r: io::Result<fs::Metadata>) -> Result<Option<Inode>> {
    match r {
        Ok(m) => Ok(Some(Inode::of(&m))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(SysError::io(op, path, e)),
    }
}

/// `stat` of `path`, following symlinks; None when nothing is there.
pub fn stat(path: &Path) -> Result<Option<Inode>> {
    absent_or("stat", path, fs::metadata(path))
}

/// `lstat` of `path` (a symlink is reported, not followed); None when nothing
/// is there.
pub fn lstat(path: &Path) -> Result<Option<Inode>> {
    absent_or("stat", path, fs::symlink_metadata(path))
}

/// Whether `path` leads to anything (following symlinks); an error reads as no.
pub fn exists(path: &Path) -> bool {
    matches!(stat(path), Ok(Some(_)))
}

/// Whether `path` leads to a directory (following symlinks).
pub fn is_dir(path: &Path) -> bool {
    matches!(stat(path), Ok(Some(i)) if i.is_dir())
}

/// Whether `path` leads to a regular file (following symlinks).
pub fn is_file(path: &Path) -> bool {
    matches!(stat(path), Ok(Some(i)) if i.is_file())
}

/// The absolute path `path` leads to, every symlink resolved.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    fs::canonicalize(path).map_err(|e| SysError::io("resolve", path, e))
}

/// Whether `rel` (a relative path without `..`) leads to a place beneath the
/// directory `root` once every symbolic link on the way is followed, as the
/// filesystem is now. The deepest part of `rel` that exists is opened beneath
/// `root`'s descriptor with `openat2(RESOLVE_BENEATH)`, so the kernel itself
/// refuses a link that leads out of `root` (or an absolute one); a part that
/// does not exist yet leads nowhere. `root` itself is trusted (its own links are
/// followed): it is the operator's.
pub fn leads_beneath(root: &Path, rel: &Path) -> Result<bool> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    use rustix::io::Errno;
    let root_fd = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| SysError::io("open", root, e.into()))?;
    let how = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    let mut probe = rel.to_path_buf();
    // EAGAIN: a rename elsewhere on the filesystem raced the lookup; the kernel
    // asks for a retry, and a bounded number of them is enough.
    let mut retries = 16;
    while !probe.as_os_str().is_empty() {
        match rustix::fs::openat2(
            &root_fd,
            &probe,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            how,
        ) {
            Ok(_) => return Ok(true),
            Err(Errno::NOENT) | Err(Errno::NOTDIR) => {
                probe.pop();
            }
            Err(Errno::XDEV) | Err(Errno::LOOP) => return Ok(false),
            Err(Errno::AGAIN) if retries > 0 => retries -= 1,
            Err(e) => return Err(SysError::io("open", root.join(&probe), e.into())),
        }
    }
    Ok(true)
}

/// One entry of a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The entry's name (not valid UTF-8 parts replaced).
    pub name: String,
    pub path: PathBuf,
}

impl Entry {
    /// A dot file: a temporary or hidden entry, never a record.
    pub fn is_hidden(&self) -> bool {
        self.name.starts_with('.')
    }
}

/// The entries of `dir`, in no order. A missing `dir` is an error that
/// [`SysError::is_not_found`] recognises.
pub fn list(dir: &Path) -> Result<Vec<Entry>> {
    names(dir)?
        .map(|name| {
            name.map(|name| Entry {
                path: dir.join(&name),
                name,
            })
        })
        .collect()
}

/// The names of `dir`'s entries, in no order, read as they are asked for: a
/// folder of many entries is walked without a list of them all (and without a
/// path for each) in memory. A missing `dir` is an error that
/// [`SysError::is_not_found`] recognises; so is each entry that cannot be read.
pub fn names(dir: &Path) -> Result<impl Iterator<Item = Result<String>> + '_> {
    let entries = fs::read_dir(dir).map_err(|e| SysError::io("list", dir, e))?;
    Ok(entries.map(move |entry| {
        entry
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .map_err(|e| SysError::io("list", dir, e))
    }))
}

/// The entries of `dir`; none when it is missing.
pub fn list_if_exists(dir: &Path) -> Result<Vec<Entry>> {
    match list(dir) {
        Err(e) if e.is_not_found() => Ok(Vec::new()),
        other => other,
    }
}

/// Renames `from` to `to` (replacing a file there) and makes the move durable:
/// the folder of `to`, and the folder of `from` when it is another one, are
/// synced before this returns.
pub fn rename_durably(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).map_err(|e| SysError::io("rename to", to, e))?;
    note(|| FsOp::Rename {
        from: from.into(),
        to: to.into(),
    });
    let (old, new) = (parent_dir(from), parent_dir(to));
    fsync_dir(new)?;
    if old != new {
        fsync_dir(old)?;
    }
    Ok(())
}

/// Makes a directory (its parent must exist), not synced: a mount point that
/// lives no longer than what is mounted on it. AlreadyExists when `path` exists.
pub fn create_unsynced(path: &Path) -> Result<()> {
    fs::create_dir(path).map_err(|e| SysError::io("create directory", path, e))?;
    note(|| FsOp::Mkdir { path: path.into() });
    Ok(())
}

/// Removes an empty directory; a missing one is Ok(false). Not synced: the
/// caller syncs the parent where the removal must last.
pub fn remove_empty_dir(path: &Path) -> Result<bool> {
    match fs::remove_dir(path) {
        Ok(()) => {
            note(|| FsOp::Unlink { path: path.into() });
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(SysError::io("remove directory", path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stream_every_entry_and_a_missing_folder_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["a.img", ".tmp", "b"] {
            std::fs::write(dir.path().join(n), b"").unwrap();
        }
        let mut got: Vec<String> = names(dir.path()).unwrap().map(|n| n.unwrap()).collect();
        got.sort();
        assert_eq!(got, [".tmp", "a.img", "b"]);
        let e = names(&dir.path().join("none")).err().expect("missing");
        assert!(e.is_not_found(), "{e}");
    }

    #[test]
    fn stat_tells_kinds_and_absence_apart() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"four").unwrap();
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        assert_eq!(stat(&f).unwrap().unwrap().len, 4);
        assert!(stat(&link).unwrap().unwrap().is_file());
        assert!(lstat(&link).unwrap().unwrap().is_symlink());
        assert!(lstat(dir.path()).unwrap().unwrap().is_dir());
        assert_eq!(lstat(&dir.path().join("none")).unwrap(), None);
        assert!(is_file(&f) && !is_dir(&f) && exists(&link));
        assert!(!exists(&dir.path().join("none")));
        let e = stat(&f.join("below-a-file")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTDIR), "{e}");
    }

    #[test]
    fn a_path_leads_beneath_its_root_only_through_links_that_stay_inside() {
        let dir = tempfile::tempdir().unwrap();
        let (root, outside) = (dir.path().join("root"), dir.path().join("outside"));
        std::fs::create_dir_all(root.join("pods/a")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let link = |target: &Path, name: &str| {
            std::os::unix::fs::symlink(target, root.join("pods").join(name)).unwrap()
        };
        link(&outside, "absolute-out");
        link(Path::new("../../outside"), "relative-out");
        link(Path::new("../../outside/none"), "dangling-out");
        link(Path::new("a"), "inside");
        link(&root.join("pods/a"), "absolute-inside");
        link(Path::new("loop"), "loop");
        let beneath = |rel: &str| leads_beneath(&root, Path::new(rel)).unwrap();
        for inside in [
            "pods/a",
            "pods/a/new/deeper",
            "pods/new",
            "pods/inside/x",
            "pods/inside",
        ] {
            assert!(beneath(inside), "{inside}");
        }
        for out in [
            "pods/absolute-out",
            "pods/absolute-out/new",
            "pods/relative-out/x",
            "pods/dangling-out/x",
            // An absolute link is refused even where it names a place inside:
            // what it leads to depends on the namespace looking at it.
            "pods/absolute-inside/x",
            "pods/loop/x",
        ] {
            assert!(!beneath(out), "{out}");
        }
        let missing = dir.path().join("no-root");
        assert!(leads_beneath(&missing, Path::new("x")).is_err());
    }

    #[test]
    fn a_listing_names_entries_and_a_missing_folder_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), b"").unwrap();
        std::fs::write(dir.path().join(".a.tmp"), b"").unwrap();
        let mut names: Vec<_> = list(dir.path())
            .unwrap()
            .into_iter()
            .map(|e| (e.name.clone(), e.is_hidden()))
            .collect();
        names.sort();
        assert_eq!(names, vec![(".a.tmp".into(), true), ("a".into(), false)]);
        let missing = dir.path().join("missing");
        assert!(list(&missing).unwrap_err().is_not_found());
        assert!(list_if_exists(&missing).unwrap().is_empty());
    }

    #[test]
    fn a_durable_rename_across_folders_is_recorded_with_both_syncs() {
        let dir = tempfile::tempdir().unwrap();
        #[cfg(feature = "fs-recording")]
        let rec = crate::fsrecord::Recording::start(dir.path());
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        crate::file::mkdir_p_mode(&a, 0o700).unwrap();
        crate::file::mkdir_p_mode(&b, 0o700).unwrap();
        std::fs::write(a.join("x"), b"x").unwrap();
        rename_durably(&a.join("x"), &b.join("x")).unwrap();
        assert!(is_file(&b.join("x")) && !exists(&a.join("x")));
        assert!(remove_empty_dir(&a).unwrap());
        assert!(!remove_empty_dir(&a).unwrap());
        let e = remove_empty_dir(&b).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY), "{e}");
        #[cfg(feature = "fs-recording")]
        {
            let ops = rec.ops();
            let at = ops
                .iter()
                .position(|op| matches!(op, FsOp::Rename { .. }))
                .expect("the rename is recorded");
            assert_eq!(
                ops[at + 1..at + 3],
                [
                    FsOp::Fsync { path: b.clone() },
                    FsOp::Fsync { path: a.clone() }
                ]
            );
            assert!(ops.contains(&FsOp::Unlink { path: a.clone() }));
        }
    }
}
