//! Mounts, binds and unmounts through mount(2) and umount2(2), called by
//! `sys-mount`'s builder. Never lazily: an unmount that cannot happen now fails.

use std::io;
use std::path::Path;

use sys_mount::{Mount, MountFlags, UnmountFlags};

use super::options::split_options;
use crate::error::{Result, SysError};
use crate::file::check_path;
use crate::{MountEntry, MountOptions, Mounter};

/// Mounts through mount(2) and umount2(2).
#[derive(Debug, Clone, Copy, Default)]
pub struct LinuxMounter;

/// The per-mount flags a bind must be remounted with to take effect (the kernel
/// ignores them on the first MS_BIND call).
const BIND_REMOUNT_FLAGS: MountFlags = MountFlags::RDONLY
    .union(MountFlags::NODEV)
    .union(MountFlags::NOSUID)
    .union(MountFlags::NOEXEC)
    .union(MountFlags::NOATIME)
    .union(MountFlags::NODIRATIME)
    .union(MountFlags::RELATIME)
    .union(MountFlags::STRICTATIME);

/// The filesystem type given with a bind or a remount, which the kernel ignores.
const NO_FSTYPE: &str = "none";

/// A failed mount(2) or umount2(2) as a [`SysError`] kind.
fn mount_error(what: String, target: &Path, e: io::Error) -> SysError {
    match e.raw_os_error() {
        Some(errno) => SysError::syscall(what, target, errno),
        None => SysError::Syscall { what, source: e },
    }
}

/// A filesystem type mount(2) can be given: not empty, no NUL byte.
pub(crate) fn valid_fstype(fstype: &str, source: &Path) -> Result<()> {
    if fstype.is_empty() || fstype.contains('\0') {
        return Err(SysError::InvalidArgument {
            what: format!(
                "filesystem type {fstype:?} for mounting {}",
                source.display()
            ),
        });
    }
    Ok(())
}

/// Unmount `target`, mapping "not a mount point" (EINVAL) and "no such path"
/// (ENOENT) to NotMounted.
fn unmount_now(target: &Path) -> Result<()> {
    check_path(target)?;
    match sys_mount::unmount(target, UnmountFlags::empty()) {
        Ok(()) => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOENT)) => {
            Err(SysError::NotMounted {
                path: target.to_path_buf(),
            })
        }
        Err(e) => Err(mount_error(
            format!("unmount {}", target.display()),
            target,
            e,
        )),
    }
}

/// Remount the bind at `target` with `extra` (per-mount flags); on failure the
/// bind is undone, so that no writable bind is left where read-only was asked for.
fn remount_bind(source: &Path, target: &Path, extra: MountFlags) -> Result<()> {
    let flags = MountFlags::REMOUNT | MountFlags::BIND | extra;
    let res = Mount::builder()
        .fstype(NO_FSTYPE)
        .flags(flags)
        .mount("", target);
    if let Err(e) = res {
        if let Err(undo) = unmount_now(target) {
            tracing::error!(target = %target.display(), error = %undo, "could not undo a bind mount whose remount failed");
        }
        return Err(mount_error(
            format!(
                "remount bind of {} at {} with {extra:?}",
                source.display(),
                target.display()
            ),
            target,
            e,
        ));
    }
    Ok(())
}

impl Mounter for LinuxMounter {
    fn mounts(&self) -> Result<Vec<MountEntry>> {
        crate::mountinfo::read()
    }

    fn reachable(&self, m: &MountEntry) -> bool {
        m.reachable()
    }

    fn mount(&self, source: &Path, target: &Path, fstype: &str, opts: &MountOptions) -> Result<()> {
        let split = split_options(opts)?;
        valid_fstype(fstype, source)?;
        check_path(source)?;
        check_path(target)?;
        let data = (!split.data.is_empty()).then_some(split.data.as_str());
        tracing::debug!(source = %source.display(), target = %target.display(), fstype, flags = ?split.flags, data = ?data, "mount");
        let mut builder = Mount::builder().fstype(fstype).flags(split.flags);
        if let Some(d) = data {
            builder = builder.data(d);
        }
        builder.mount(source, target).map(drop).map_err(|e| {
            mount_error(
                format!(
                    "mount {} ({fstype}{}{}) at {}",
                    source.display(),
                    if data.is_some() { ", " } else { "" },
                    data.unwrap_or(""),
                    target.display()
                ),
                target,
                e,
            )
        })
    }

    fn bind(&self, source: &Path, target: &Path, opts: &MountOptions) -> Result<()> {
        let split = split_options(opts)?;
        check_path(source)?;
        check_path(target)?;
        if !split.data.is_empty() {
            // A bind shares the mounted filesystem; its options were set when it
            // was mounted. Ignoring them lets callers pass a volume's mount flags
            // to stage and publish alike.
            tracing::debug!(data = %split.data, target = %target.display(), "ignoring filesystem options on a bind mount");
        }
        Mount::builder()
            .fstype(NO_FSTYPE)
            .flags(MountFlags::BIND)
            .mount(source, target)
            .map_err(|e| {
                mount_error(
                    format!("bind-mount {} at {}", source.display(), target.display()),
                    target,
                    e,
                )
            })?;
        let extra = split.flags & BIND_REMOUNT_FLAGS;
        if extra.is_empty() {
            return Ok(());
        }
        remount_bind(source, target, extra)
    }

    fn unmount(&self, target: &Path) -> Result<()> {
        unmount_now(target)
    }
}
