//! File operations on the pools: sparse images, directory tree copies, removal,
//! folders made durably, sharing with a group; and, from rooms of their own
//! re-exported here, reflinks and sparse-aware copies (`copy`), crash-safe
//! writes (`durable`) and filesystem figures (`fsinfo`).
//!
//! These work on real files only (no trait, no fake): the tests run them on real
//! filesystems. Every function that creates a file makes it durable (fsync of the
//! file and of its directory) before it returns, because the domain records the
//! outcome right after and a crash must not leave a record pointing at nothing.
//! Files are created with O_EXCL so that a retry never silently overwrites data.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Result, SysError};
use crate::fsrecord::{note, FsOp};

pub(crate) use crate::copy::clone_into;
pub use crate::copy::{
    copy_file, copy_file_unsynced, make_new_file_durable, probe_reflink, reflink, reflink_unsynced,
    sparse_copy,
};
pub use crate::durable::{
    temp_path_for, write_atomic, write_atomic_unsynced, write_atomic_with, AppendFile, Replacement,
    APPEND_ROOM,
};
pub use crate::fsinfo::{fs_type_name, statvfs};

/// A path with a NUL byte cannot reach the kernel; say so clearly instead of
/// letting the call fail with EINVAL.
pub(crate) fn check_path(path: &Path) -> Result<()> {
    if path.as_os_str().as_bytes().contains(&0) {
        return Err(SysError::InvalidArgument {
            what: format!("path {} contains a NUL byte", path.display()),
        });
    }
    Ok(())
}

pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Open a new file with O_EXCL and `mode`: an existing file is an Io error of kind
/// AlreadyExists.
pub(crate) fn create_new(path: &Path, mode: u32) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| SysError::io("create", path, e))
        .inspect(|_| {
            note(|| FsOp::Create {
                path: path.into(),
                truncate: false,
            })
        })
}

pub(crate) fn fsync(file: &File, path: &Path) -> Result<()> {
    file.sync_all()
        .map_err(|e| SysError::io("fsync", path, e))?;
    note(|| FsOp::Fsync { path: path.into() });
    Ok(())
}

pub(crate) fn set_len(file: &File, path: &Path, len: u64) -> Result<()> {
    file.set_len(len)
        .map_err(|e| SysError::io("set size of", path, e))?;
    note(|| FsOp::SetLen {
        path: path.into(),
        len,
    });
    Ok(())
}

pub(crate) fn open_read(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| SysError::io("open", path, e))
}

/// Run `fill` on a freshly created file and make it durable; on any failure remove
/// the file again so that no half-written copy is left for a retry to trip over.
pub(crate) fn create_with<F>(path: &Path, mode: u32, fill: F) -> Result<()>
where
    F: FnOnce(&File) -> Result<()>,
{
    create_unsynced_with(path, mode, |file| {
        fill(file)
            .and_then(|()| fsync(file, path))
            .and_then(|()| fsync_dir(parent_dir(path)))
    })
}

/// [`create_with`] without making anything durable.
pub(crate) fn create_unsynced_with<F>(path: &Path, mode: u32, fill: F) -> Result<()>
where
    F: FnOnce(&File) -> Result<()>,
{
    let file = create_new(path, mode)?;
    let res = fill(&file);
    if res.is_err() {
        drop(file);
        let _ = remove_file_if_exists(path);
    }
    res
}

/// The whole content of a small file (a record, a marker).
pub fn read(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| SysError::io("read", path, e))
}

/// The whole content of a small text file.
pub fn read_to_string(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|e| SysError::io("read", path, e))
}

/// Makes a new empty file (mode 0644), not synced: a place to bind a device
/// node onto. An Io error of kind AlreadyExists when `path` exists.
pub fn create_empty_unsynced(path: &Path) -> Result<()> {
    create_unsynced_with(path, 0o644, |_| Ok(()))
}

/// Create a new sparse file of `size` bytes (mode 0600). Fails with an Io error of
/// kind AlreadyExists when `path` exists.
pub fn create_sparse(path: &Path, size: u64) -> Result<()> {
    create_with(path, 0o600, |f| set_len(f, path, size))
}

/// Grow the file at `path` to `size` bytes; a file already that large is left as
/// it is (never shrunk).
pub fn grow(path: &Path, size: u64) -> Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| SysError::io("open", path, e))?;
    let len = f
        .metadata()
        .map_err(|e| SysError::io("stat", path, e))?
        .len();
    if len >= size {
        return Ok(());
    }
    set_len(&f, path, size)?;
    fsync(&f, path)
}

pub use crate::tree::{copy_tree, share_contents_with_group};

/// syncfs of the filesystem holding `path`: everything written to it so far,
/// data and metadata of every file, is durable (and a writeback error of that
/// filesystem that no caller has been told of yet is reported).
pub fn syncfs(path: &Path) -> Result<()> {
    let f = open_read(path)?;
    nix::unistd::syncfs(&f).map_err(|e| SysError::io("syncfs", path, e.into()))?;
    note(|| FsOp::SyncFs { path: path.into() });
    Ok(())
}

/// The absolute, symlink-resolved form of a path whose last components may not
/// exist yet.
pub(crate) fn resolve_maybe_missing(path: &Path) -> Result<PathBuf> {
    let mut missing = Vec::new();
    let mut cur = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| SysError::io("get current directory for", path, e))?
            .join(path)
    };
    loop {
        match fs::canonicalize(&cur) {
            Ok(real) => {
                return Ok(missing
                    .iter()
                    .rev()
                    .fold(real, |p, c: &std::ffi::OsString| p.join(c)));
            }
            Err(_) => match (cur.file_name(), cur.parent()) {
                (Some(name), Some(parent)) => {
                    missing.push(name.to_os_string());
                    cur = parent.to_path_buf();
                }
                _ => return Ok(cur),
            },
        }
    }
}

pub(crate) fn make_dir(path: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {
            note(|| FsOp::Mkdir { path: path.into() });
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) => Err(SysError::io("create directory", path, e)),
    }
}

/// Creates a new sparse file of `size` bytes (mode 0600) without making it
/// durable: for data that recovery can make again from its record when a power
/// loss takes it. AlreadyExists when `path` exists.
pub fn create_sparse_unsynced(path: &Path, size: u64) -> Result<()> {
    let f = create_new(path, 0o600)?;
    if let Err(e) = set_len(&f, path, size) {
        drop(f);
        let _ = remove_file_if_exists(path);
        return Err(e);
    }
    Ok(())
}

/// fsync a file by its path, making its data and attributes (xattrs) durable.
pub fn sync_path(path: &Path) -> Result<()> {
    fsync(&open_read(path)?, path)
}

/// fsync a directory, making the creation, removal or rename of its entries durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let d = open_read(dir)?;
    d.sync_all()
        .map_err(|e| SysError::io("fsync directory", dir, e))?;
    note(|| FsOp::Fsync { path: dir.into() });
    Ok(())
}

/// Remove a file (or symlink); a missing one is Ok(false).
pub fn remove_file_if_exists(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            note(|| FsOp::Unlink { path: path.into() });
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(SysError::io("remove", path, e)),
    }
}

/// Remove `path` and, when it is a directory, everything below it. Symlinks are
/// removed, never followed. A missing path is Ok. Refuses (Busy) when anything is
/// mounted at or below `path`, so that a forgotten mount does not lose the data of
/// the filesystem mounted there.
pub fn remove_tree(path: &Path) -> Result<()> {
    let m = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(SysError::io("stat", path, e)),
    };
    if !m.is_dir() {
        return remove_file_if_exists(path).map(|_| ());
    }
    let real = fs::canonicalize(path).map_err(|e| SysError::io("resolve", path, e))?;
    let table = crate::mountinfo::read()?;
    if let Some(busy) = crate::mountinfo::mounts_under(&table, &real).first() {
        return Err(SysError::Busy {
            what: format!(
                "will not remove {}: {} is mounted at {}",
                path.display(),
                busy.source,
                busy.mount_point.display()
            ),
        });
    }
    // std's remove_dir_all does not follow symlinks (it removes the link).
    match fs::remove_dir_all(path) {
        Ok(()) => {
            note(|| FsOp::RemoveTree { path: path.into() });
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SysError::io("remove tree", path, e)),
    }
}

/// Bytes allocated on disk for the file (st_blocks * 512), less than its length
/// when it is sparse.
pub fn allocated_bytes(path: &Path) -> Result<u64> {
    let m = fs::metadata(path).map_err(|e| SysError::io("stat", path, e))?;
    Ok(m.blocks().saturating_mul(512))
}

/// The length of the file in bytes.
pub fn file_len(path: &Path) -> Result<u64> {
    let m = fs::metadata(path).map_err(|e| SysError::io("stat", path, e))?;
    Ok(m.len())
}

/// Create `path` and its missing parents, durably; each folder created here gets
/// exactly `mode` (whatever the umask). Existing folders are left as they are.
pub fn mkdir_p_mode(path: &Path, mode: u32) -> Result<()> {
    let mut missing = Vec::new();
    let mut cur = path;
    loop {
        match fs::symlink_metadata(cur) {
            Ok(m) if m.is_dir() => break,
            Ok(_) if fs::metadata(cur).map(|m| m.is_dir()).unwrap_or(false) => break,
            Ok(_) => {
                return Err(SysError::Io {
                    op: "create directory",
                    path: cur.to_path_buf(),
                    source: io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "exists and is not a directory",
                    ),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                missing.push(cur);
                match cur.parent() {
                    Some(p) if !p.as_os_str().is_empty() => cur = p,
                    _ => break,
                }
            }
            Err(e) => return Err(SysError::io("stat", cur, e)),
        }
    }
    for dir in missing.into_iter().rev() {
        match fs::DirBuilder::new().mode(mode).create(dir) {
            Ok(()) => {
                note(|| FsOp::Mkdir { path: dir.into() });
                fs::set_permissions(dir, fs::Permissions::from_mode(mode))
                    .map_err(|e| SysError::io("chmod", dir, e))?
            }
            // Another thread made it meanwhile: fine.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(SysError::io("create directory", dir, e)),
        }
        // The new entry is durable only once its parent is synced; without this a
        // power loss can take the folder, and every record later synced inside it.
        fsync_dir(parent_dir(dir))?;
    }
    Ok(())
}

/// Group read/write, search, and setgid (so new files inherit the group): what a
/// directory shared with a group has.
pub(crate) const GROUP_DIR_BITS: u32 = 0o2070;
/// Group read/write: what a file shared with a group has.
pub(crate) const GROUP_FILE_BITS: u32 = 0o060;

/// Gives a directory to group `gid` with group read/write/search and the setgid bit,
/// so that files made in it inherit the group.
pub fn share_with_group(dir: &Path, gid: u32) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = fs::metadata(dir).map_err(|e| SysError::io("stat", dir, e))?;
    if meta.gid() != gid {
        std::os::unix::fs::chown(dir, None, Some(gid))
            .map_err(|e| SysError::io("chown", dir, e))?;
    }
    let mode = meta.permissions().mode() | GROUP_DIR_BITS;
    fs::set_permissions(dir, fs::Permissions::from_mode(mode))
        .map_err(|e| SysError::io("chmod", dir, e))
}

/// Whether `dir` is shared with group `gid` as [`share_with_group`] leaves it.
pub fn is_shared_with_group(dir: &Path, gid: u32) -> Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(dir).map_err(|e| SysError::io("stat", dir, e))?;
    Ok(meta.gid() == gid && meta.mode() & GROUP_DIR_BITS == GROUP_DIR_BITS)
}
