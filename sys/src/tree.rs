//! Walks of directory trees that a tenant may change while they are walked: the
//! copy of a live directory volume (snapshot, clone) and the fsGroup walk of a
//! staged volume.
//!
//! The walks never resolve a path twice. Each directory is held open, and each
//! entry is opened by its single name beneath that descriptor with `openat2` and
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`, as an `O_PATH`
//! descriptor that follows nothing. What the entry is comes from `fstat` of that
//! descriptor, and everything done to it (reading a file's data, listing a
//! directory, reading a link, chown, chmod) goes through it. So a tenant that
//! swaps a directory or a file for a symbolic link, or mounts something, while
//! the walk runs gets at most its own swapped entry copied as the link it is; no
//! path outside the tree is read, written or changed.
//!
//! An entry that vanishes between its listing and its opening is skipped and
//! counted: a copy of a live tree is the tree as each entry was when it was
//! reached, like what a running program sees, not one instant of it. Special
//! files (devices, fifos) are never opened; a device node is copied as a node.

use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Dir, FileType, Gid, Mode, OFlags, ResolveFlags, Stat, Timestamps, Uid};
use rustix::io::Errno;

use crate::error::{Result, SysError};
use crate::fsrecord::{note, FsOp};

mod pack;
pub use pack::{pack_tree, unpack_tree, Packed};

/// How deep a walk goes. Each level holds a descriptor or two open; a tree
/// deeper than this is refused rather than risking the process's descriptors.
/// Paths are limited to 4096 bytes, so ordinary programs cannot use much deeper
/// trees either.
pub const MAX_DEPTH: usize = 1024;

/// What a walk found besides what it handled.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WalkReport {
    /// Regular files, directories (the root excluded), symbolic links and special
    /// files handled.
    pub entries: u64,
    /// Entries listed that were gone (or replaced by another kind of entry) when
    /// they were opened: changed by the tree's user during the walk.
    pub vanished: u64,
    /// Mount points inside the tree: another filesystem, not the tree's data.
    pub mounts_skipped: u64,
    /// Sockets: meaningful only to the process that bound them.
    pub sockets_skipped: u64,
}

/// An entry opened beneath its directory, following nothing.
struct Opened {
    fd: OwnedFd,
    stat: Stat,
}

enum Lookup {
    Found(Opened),
    Vanished,
    MountPoint,
}

fn resolve_beneath() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV
}

/// Opens the entry `name` of `dir` as an O_PATH descriptor. A symbolic link is
/// opened as itself; a name that is gone is Vanished; a mount point is refused by
/// the kernel (EXDEV) and reported as such.
fn open_entry(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Lookup> {
    let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    match rustix::fs::openat2(dir, name, flags, Mode::empty(), resolve_beneath()) {
        Ok(fd) => {
            let stat = rustix::fs::fstat(&fd)?;
            Ok(Lookup::Found(Opened { fd, stat }))
        }
        Err(Errno::NOENT) => Ok(Lookup::Vanished),
        Err(Errno::XDEV) => Ok(Lookup::MountPoint),
        Err(e) => Err(e.into()),
    }
}

/// [`open_entry`] for a walk: an entry that vanished or is a mount point is
/// counted in `report` and None. The failpoints mark the two windows a tenant
/// may race: after the listing, and after the opening.
fn open_counted(
    dir: BorrowedFd<'_>,
    name: &CStr,
    at: &Path,
    report: &mut WalkReport,
) -> Result<Option<Opened>> {
    crate::failpoint("tree.entry-listed");
    match open_entry(dir, name).map_err(|e| SysError::io("open", at, e))? {
        Lookup::Found(o) => {
            crate::failpoint("tree.entry-opened");
            Ok(Some(o))
        }
        Lookup::Vanished => {
            report.vanished += 1;
            Ok(None)
        }
        Lookup::MountPoint => {
            report.mounts_skipped += 1;
            Ok(None)
        }
    }
}

/// Opens the root of a walk: a directory, whose own path is the caller's (the
/// pool's folders, or a staging path the kubelet gave), its last component not
/// followed.
fn open_root(path: &Path) -> Result<Opened> {
    crate::file::check_path(path)?;
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::open(path, flags, Mode::empty())
        .map_err(|e| SysError::io("open directory", path, e.into()))?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| SysError::io("stat", path, e.into()))?;
    Ok(Opened { fd, stat })
}

fn file_type(stat: &Stat) -> FileType {
    FileType::from_raw_mode(stat.st_mode as _)
}

fn same_inode(a: &Stat, b: &Stat) -> bool {
    a.st_dev == b.st_dev && a.st_ino == b.st_ino
}

/// Lists the directory held by `o` (an O_PATH descriptor): "." opened beneath it
/// reads the very same directory.
fn list(o: &Opened) -> io::Result<Dir> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(&o.fd, c".", flags, Mode::empty())?;
    Ok(Dir::new(fd)?)
}

/// A readable descriptor of the regular file held by `o`, through the
/// descriptor's own entry in /proc (so the file is the one examined, whatever
/// its name leads to now). Never used on devices or fifos: opening those can do
/// something.
fn reopen_file(o: &Opened) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    let magic = format!("/proc/self/fd/{}", o.fd.as_raw_fd());
    let flags = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK;
    let fd = rustix::fs::open(magic.as_str(), flags, Mode::empty())?;
    let stat = rustix::fs::fstat(&fd)?;
    if !same_inode(&stat, &o.stat) {
        return Err(io::Error::other("the reopened file is another file"));
    }
    Ok(File::from(fd))
}

/// The directory entries to handle: everything but "." and "..".
fn next_name(dir: &mut Dir, at: &Path) -> Result<Option<CString>> {
    loop {
        match dir.read() {
            None => return Ok(None),
            Some(Err(e)) => return Err(SysError::io("list", at, e.into())),
            Some(Ok(e)) => {
                let name = e.file_name();
                if name != c"." && name != c".." {
                    return Ok(Some(name.to_owned()));
                }
            }
        }
    }
}

fn os(name: &CStr) -> &OsStr {
    OsStr::from_bytes(name.to_bytes())
}

fn too_deep(at: &Path) -> SysError {
    SysError::InvalidArgument {
        what: format!(
            "{} is more than {MAX_DEPTH} directories deep; the walk stops there",
            at.display()
        ),
    }
}

/// What a walk keeps of an entry besides its data: kind and permission bits,
/// owner, and times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Meta {
    /// `st_mode`: the kind of the entry and its permission bits.
    mode: u32,
    uid: u32,
    gid: u32,
    atime: (i64, u32),
    mtime: (i64, u32),
}

impl Meta {
    fn of(stat: &Stat) -> Meta {
        Meta {
            mode: stat.st_mode as _,
            uid: stat.st_uid as _,
            gid: stat.st_gid as _,
            atime: (stat.st_atime as _, stat.st_atime_nsec as _),
            mtime: (stat.st_mtime as _, stat.st_mtime_nsec as _),
        }
    }

    fn kind(&self) -> FileType {
        FileType::from_raw_mode(self.mode as _)
    }

    fn timestamps(&self) -> Timestamps {
        let at = |(s, ns): (i64, u32)| rustix::fs::Timespec {
            tv_sec: s as _,
            tv_nsec: ns as _,
        };
        Timestamps {
            last_access: at(self.atime),
            last_modification: at(self.mtime),
        }
    }

    fn owner(&self) -> (Option<Uid>, Option<Gid>) {
        (
            Some(Uid::from_raw(self.uid as _)),
            Some(Gid::from_raw(self.gid as _)),
        )
    }

    fn permissions(&self) -> Mode {
        Mode::from_raw_mode(self.mode as _) & Mode::from_bits_truncate(0o7777)
    }
}

/// Owner, then mode (chown clears setuid bits), then times of a file or
/// directory this walk made, through its descriptor.
fn apply_metadata_fd(fd: BorrowedFd<'_>, meta: &Meta, at: &Path) -> Result<()> {
    let (uid, gid) = meta.owner();
    rustix::fs::fchown(fd, uid, gid).map_err(|e| SysError::io("chown", at, e.into()))?;
    rustix::fs::fchmod(fd, meta.permissions()).map_err(|e| SysError::io("chmod", at, e.into()))?;
    rustix::fs::futimens(fd, &meta.timestamps())
        .map_err(|e| SysError::io("set times of", at, e.into()))
}

/// Owner, mode (not of a link: links have none) and times of the entry `name`
/// this walk made in `dir`, without following it.
fn apply_metadata_at(dir: BorrowedFd<'_>, name: &CStr, meta: &Meta, at: &Path) -> Result<()> {
    let (uid, gid) = meta.owner();
    rustix::fs::chownat(dir, name, uid, gid, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| SysError::io("chown", at, e.into()))?;
    if meta.kind() != FileType::Symlink {
        rustix::fs::chmodat(dir, name, meta.permissions(), AtFlags::empty())
            .map_err(|e| SysError::io("chmod", at, e.into()))?;
    }
    rustix::fs::utimensat(dir, name, &meta.timestamps(), AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| SysError::io("set times of", at, e.into()))
}

/// One directory of a copy: the source listed, the copy made, and where both
/// are (for messages and the power-loss record).
struct CopyFrame {
    src: Dir,
    src_dir: Opened,
    dst: OwnedFd,
    src_path: PathBuf,
    dst_path: PathBuf,
}

/// Copy the directory tree `src_dir` into `dst_dir` (created when missing; its
/// entries must not exist yet). Regular files are reflinked where the
/// filesystem can, else copied sparsely; symbolic links are recreated, never
/// followed; fifos and device nodes are recreated with mknod, never opened;
/// sockets and mount points inside the tree are skipped. Owner, mode and
/// atime/mtime are kept; extended attributes, ACLs and hard links are not (a
/// hard-linked file becomes separate copies). `dst_dir` may not lie inside
/// `src_dir`. The source may change while it is copied (module doc): entries
/// that vanish are skipped and counted. The copy is durable when this returns.
pub fn copy_tree(src_dir: &Path, dst_dir: &Path) -> Result<WalkReport> {
    let root = open_root(src_dir)?;
    let dst = open_copy_destination(src_dir, dst_dir)?;
    let mut report = WalkReport::default();
    let mut stack = vec![CopyFrame {
        src: list(&root).map_err(|e| SysError::io("list", src_dir, e))?,
        src_dir: root,
        dst,
        src_path: src_dir.to_path_buf(),
        dst_path: dst_dir.to_path_buf(),
    }];
    loop {
        let depth = stack.len();
        let Some(frame) = stack.last_mut() else {
            break;
        };
        let Some(name) = next_name(&mut frame.src, &frame.src_path)? else {
            // A directory gets its metadata once its contents are in place
            // (adding entries changes its mtime).
            let done = stack.pop().expect("the frame just looked at");
            apply_metadata_fd(
                done.dst.as_fd(),
                &Meta::of(&done.src_dir.stat),
                &done.dst_path,
            )?;
            continue;
        };
        let src_path = frame.src_path.join(os(&name));
        let dst_path = frame.dst_path.join(os(&name));
        let Some(entry) = open_counted(frame.src_dir.fd.as_fd(), &name, &src_path, &mut report)?
        else {
            continue;
        };
        let at = EntryAt {
            dst_dir: frame.dst.as_fd(),
            name: &name,
            src_path,
            dst_path,
        };
        match copy_entry(entry, at, depth, &mut report)? {
            Copied::Directory(frame) => stack.push(*frame),
            Copied::Entry => {}
            Copied::Skipped => continue,
        }
        report.entries += 1;
    }
    if report.vanished + report.mounts_skipped > 0 {
        tracing::info!(
            src = %src_dir.display(),
            vanished = report.vanished,
            mounts_skipped = report.mounts_skipped,
            "copied a tree that changed while it was copied"
        );
    }
    // One syncfs makes the whole copy durable, cheaper than an fsync per file.
    crate::file::syncfs(dst_dir)?;
    Ok(report)
}

/// The destination of a copy, made and opened: refused when it lies inside
/// its source.
fn open_copy_destination(src_dir: &Path, dst_dir: &Path) -> Result<OwnedFd> {
    let src_real =
        std::fs::canonicalize(src_dir).map_err(|e| SysError::io("resolve", src_dir, e))?;
    if crate::file::resolve_maybe_missing(dst_dir)?.starts_with(&src_real) {
        return Err(SysError::InvalidArgument {
            what: format!(
                "copy_tree destination {} lies inside its source {}",
                dst_dir.display(),
                src_dir.display()
            ),
        });
    }
    crate::file::make_dir(dst_dir)?;
    rustix::fs::open(
        dst_dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| SysError::io("open directory", dst_dir, e.into()))
}

/// Where one entry of a copy goes: its name in the destination directory.
struct EntryAt<'a> {
    dst_dir: BorrowedFd<'a>,
    name: &'a CStr,
    src_path: PathBuf,
    dst_path: PathBuf,
}

/// What copying one entry did.
enum Copied {
    /// A directory made: its contents are copied next.
    Directory(Box<CopyFrame>),
    Entry,
    /// Gone before it could be read, or a socket: not copied.
    Skipped,
}

/// Copies one opened entry of the source (at depth `depth`) to its place.
fn copy_entry(
    entry: Opened,
    at: EntryAt<'_>,
    depth: usize,
    report: &mut WalkReport,
) -> Result<Copied> {
    let EntryAt {
        dst_dir,
        name,
        src_path,
        dst_path,
    } = at;
    match file_type(&entry.stat) {
        FileType::Directory => {
            if depth >= MAX_DEPTH {
                return Err(too_deep(&src_path));
            }
            let listed = match list(&entry) {
                Ok(d) => d,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    report.vanished += 1;
                    return Ok(Copied::Skipped);
                }
                Err(e) => return Err(SysError::io("list", &src_path, e)),
            };
            let made = make_dir_at(dst_dir, name, &dst_path)?;
            Ok(Copied::Directory(Box::new(CopyFrame {
                src: listed,
                src_dir: entry,
                dst: made,
                src_path,
                dst_path,
            })))
        }
        FileType::RegularFile => {
            let src = match reopen_file(&entry) {
                Ok(f) => f,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    report.vanished += 1;
                    return Ok(Copied::Skipped);
                }
                Err(e) => return Err(SysError::io("open", &src_path, e)),
            };
            copy_file_at(&src, &entry.stat, &src_path, dst_dir, name, &dst_path)?;
            Ok(Copied::Entry)
        }
        FileType::Symlink | FileType::Fifo | FileType::CharacterDevice | FileType::BlockDevice => {
            copy_special(&entry, dst_dir, name, &src_path, &dst_path)?;
            Ok(Copied::Entry)
        }
        _ => {
            report.sockets_skipped += 1;
            Ok(Copied::Skipped)
        }
    }
}

/// Recreates a symbolic link (the link the descriptor holds, not whatever the
/// name is now), a fifo or a device node: never followed, never opened.
fn copy_special(
    entry: &Opened,
    dst_dir: BorrowedFd<'_>,
    name: &CStr,
    src_path: &Path,
    dst_path: &Path,
) -> Result<()> {
    let kind = file_type(&entry.stat);
    if kind == FileType::Symlink {
        let target = rustix::fs::readlinkat(&entry.fd, c"", Vec::new())
            .map_err(|e| SysError::io("read link", src_path, e.into()))?;
        rustix::fs::symlinkat(target.as_c_str(), dst_dir, name)
            .map_err(|e| SysError::io("create symlink", dst_path, e.into()))?;
        note(|| FsOp::Other {
            what: "a symlink",
            path: dst_path.to_path_buf(),
        });
    } else {
        rustix::fs::mknodat(
            dst_dir,
            name,
            kind,
            Meta::of(&entry.stat).permissions(),
            entry.stat.st_rdev as _,
        )
        .map_err(|e| SysError::io("mknod", dst_path, e.into()))?;
        note(|| FsOp::Other {
            what: "a device node",
            path: dst_path.to_path_buf(),
        });
    }
    apply_metadata_at(dst_dir, name, &Meta::of(&entry.stat), dst_path)
}

/// A new directory `name` in `dir` (mode 0700 until its own mode is copied onto
/// it), opened.
fn make_dir_at(dir: BorrowedFd<'_>, name: &CStr, at: &Path) -> Result<OwnedFd> {
    rustix::fs::mkdirat(dir, name, Mode::from_bits_truncate(0o700))
        .map_err(|e| SysError::io("create directory", at, e.into()))?;
    note(|| FsOp::Mkdir { path: at.into() });
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    rustix::fs::openat(dir, name, flags, Mode::empty())
        .map_err(|e| SysError::io("open directory", at, e.into()))
}

/// Copies the open file `src` (whose metadata, before it was read, is `stat`)
/// to the new file `name` in `dir`: a reflink where
/// the filesystem can, else a sparse copy. Not synced: the caller syncs the
/// whole copy at once. A half-made file is removed.
fn copy_file_at(
    src: &File,
    stat: &Stat,
    src_path: &Path,
    dir: BorrowedFd<'_>,
    name: &CStr,
    dst_path: &Path,
) -> Result<()> {
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(dir, name, flags, Mode::from_bits_truncate(0o600))
        .map_err(|e| SysError::io("create", dst_path, e.into()))?;
    note(|| FsOp::Create {
        path: dst_path.into(),
        truncate: false,
    });
    let dst = File::from(fd);
    // `stat` was taken before the copy read the file (and moved its atime).
    let copied = crate::copy::copy_open_file(src, src_path, &dst, dst_path)
        .and_then(|()| apply_metadata_fd(dst.as_fd(), &Meta::of(stat), dst_path));
    if copied.is_err() {
        drop(dst);
        let _ = rustix::fs::unlinkat(dir, name, AtFlags::empty());
    }
    copied
}

/// Visits every entry below `root` on its filesystem, parents before their
/// contents, with its path and its O_PATH descriptor. The walk follows no link
/// and does not cross into other mounts (module doc); `root` itself is not
/// visited. `visit` answering ENOENT counts the entry as vanished.
fn walk<F>(root: &Path, mut visit: F) -> Result<WalkReport>
where
    F: FnMut(&Path, &Opened) -> io::Result<()>,
{
    let top = open_root(root)?;
    let listed = list(&top).map_err(|e| SysError::io("list", root, e))?;
    let mut report = WalkReport::default();
    let mut stack = vec![(listed, top, root.to_path_buf())];
    while let Some((dir, opened, at)) = stack.last_mut() {
        let Some(name) = next_name(dir, at)? else {
            stack.pop();
            continue;
        };
        let path = at.join(os(&name));
        let Some(entry) = open_counted(opened.fd.as_fd(), &name, &path, &mut report)? else {
            continue;
        };
        match visit(&path, &entry) {
            Ok(()) => report.entries += 1,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                report.vanished += 1;
                continue;
            }
            Err(e) => return Err(SysError::io("walk", &path, e)),
        }
        if file_type(&entry.stat) == FileType::Directory {
            if stack.len() >= MAX_DEPTH {
                return Err(too_deep(&path));
            }
            match list(&entry) {
                Ok(d) => stack.push((d, entry, path)),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => report.vanished += 1,
                Err(e) => return Err(SysError::io("list", &path, e)),
            }
        }
    }
    Ok(report)
}

/// Gives every file and directory below `root` on its filesystem to group `gid`
/// (files group read/write, directories also search and setgid; symbolic links
/// only change group, as themselves). `root` itself is left as it is.
pub fn share_contents_with_group(root: &Path, gid: u32) -> Result<WalkReport> {
    walk(root, |_, entry| give_to_group(entry, gid))
}

/// The directories below `root` whose inode number is `ino`, parents before
/// children (btrfs subvolume roots have inode 256).
pub fn directories_with_inode(root: &Path, ino: u64) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    walk(root, |path, entry| {
        if file_type(&entry.stat) == FileType::Directory && entry.stat.st_ino == ino {
            found.push(path.to_path_buf());
        }
        Ok(())
    })?;
    Ok(found)
}

/// chown and chmod of the entry held by `o`, through its descriptor: chown with
/// AT_EMPTY_PATH acts on the descriptor's own inode (a link as itself), and
/// chmod through the descriptor's entry in /proc reaches the same inode without
/// opening it (opening a device can do something).
fn give_to_group(o: &Opened, gid: u32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let stat = &o.stat;
    if stat.st_gid != gid {
        rustix::fs::chownat(
            &o.fd,
            c"",
            None,
            Some(Gid::from_raw(gid)),
            AtFlags::EMPTY_PATH,
        )?;
    }
    let kind = file_type(stat);
    if kind == FileType::Symlink {
        return Ok(());
    }
    let bits = match kind {
        FileType::Directory => crate::file::GROUP_DIR_BITS,
        _ => crate::file::GROUP_FILE_BITS,
    };
    // chown clears a file's setuid/setgid bits: the mode is set after it, from
    // what it was before.
    let mode = stat.st_mode & 0o7777 | bits;
    if stat.st_gid != gid || mode != stat.st_mode & 0o7777 {
        let magic = format!("/proc/self/fd/{}", o.fd.as_raw_fd());
        rustix::fs::chmod(magic.as_str(), Mode::from_bits_truncate(mode))?;
    }
    Ok(())
}
