//! The one error type of the system layer.
//!
//! Every failure of a syscall or an external command becomes a [`SysError`] that
//! names what was attempted (the operation, the path, the command line). Errno values
//! the domain must react to get their own variants (no space, permission denied,
//! busy, reflink unsupported, not mounted) so that callers match on kinds instead of
//! parsing messages; anything else keeps its `std::io::Error` as the source.

use std::io;
use std::path::{Path, PathBuf};

pub type Result<T> = std::result::Result<T, SysError>;

#[derive(Debug, thiserror::Error)]
pub enum SysError {
    /// Something the caller named does not exist (a device, a command, a qgroup).
    #[error("not found: {what}")]
    NotFound { what: String },

    /// `path` is not a mount point (unmount, freeze of an unmounted path).
    #[error("{} is not mounted", path.display())]
    NotMounted { path: PathBuf },

    /// The filesystem or kernel cannot do this (FICLONE on ext4, online grow of an
    /// unmounted xfs, an unknown filesystem type).
    #[error("unsupported: {what}")]
    Unsupported { what: String },

    /// The object is in use (EBUSY): a mounted device, a loop device still open.
    #[error("busy: {what}")]
    Busy { what: String },

    /// An external command did not finish in time; it was killed.
    #[error("command `{command}` did not finish within {seconds} s and was killed")]
    Timeout { command: String, seconds: u64 },

    /// An external command failed (non-zero exit or killed by a signal).
    #[error("command `{command}` failed ({}): {stderr}", exit_text(*status))]
    Command {
        command: String,
        /// The exit code, None when the command was killed by a signal.
        status: Option<i32>,
        /// The command's standard error (or, when that is empty, its standard
        /// output), trimmed.
        stderr: String,
    },

    /// A syscall on `path` failed with an errno that has no variant of its own.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// ENOSPC or EDQUOT: the pool or the qgroup is full.
    #[error("no space left for {}", path.display())]
    NoSpace { path: PathBuf },

    /// EPERM or EACCES. Note: on machines that withhold CAP_SYS_RESOURCE, online
    /// `resize2fs` of ext4 ends here.
    #[error("{}", permission_text(op, path))]
    PermissionDenied { op: String, path: PathBuf },

    /// A syscall failed; `what` says which and on what (e.g. "mount /dev/loop3
    /// (xfs) at /staging"). Used where a path alone would not say enough.
    #[error("{what}: {source}")]
    Syscall {
        what: String,
        #[source]
        source: io::Error,
    },

    /// The caller passed something malformed (a mount flag with a NUL byte, ...).
    #[error("invalid argument: {what}")]
    InvalidArgument { what: String },
}

/// "<op> <path>: permission denied", without repeating a path that `op` names.
fn permission_text(op: &str, path: &Path) -> String {
    let p = path.display().to_string();
    if op.contains(&p) {
        format!("{op}: permission denied")
    } else {
        format!("{op} {p}: permission denied")
    }
}

fn exit_text(status: Option<i32>) -> String {
    match status {
        Some(code) => format!("exit status {code}"),
        None => "killed by a signal".to_string(),
    }
}

impl SysError {
    /// Map an `io::Error` of operation `op` on `path` to the variant the domain can
    /// act on: ENOSPC/EDQUOT -> NoSpace, EPERM/EACCES -> PermissionDenied,
    /// EBUSY -> Busy; everything else (also ENOENT and EEXIST, so that the io kind
    /// stays visible) -> Io.
    pub fn io(op: &'static str, path: impl AsRef<Path>, source: io::Error) -> SysError {
        let path = path.as_ref().to_path_buf();
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => SysError::NoSpace { path },
            Some(libc::EPERM) | Some(libc::EACCES) => SysError::PermissionDenied {
                op: op.to_string(),
                path,
            },
            Some(libc::EBUSY) => SysError::Busy {
                what: format!("{op} {}: {source}", path.display()),
            },
            _ => SysError::Io { op, path, source },
        }
    }

    /// Same as [`SysError::io`] for an errno returned by nix or libc.
    pub fn errno(op: &'static str, path: impl AsRef<Path>, errno: i32) -> SysError {
        SysError::io(op, path, io::Error::from_raw_os_error(errno))
    }

    /// Like [`SysError::errno`] for a syscall described by `what` (which names the
    /// objects involved); `path` is the main object, used by NoSpace and
    /// PermissionDenied.
    pub fn syscall(what: String, path: impl AsRef<Path>, errno: i32) -> SysError {
        let path = path.as_ref().to_path_buf();
        let source = io::Error::from_raw_os_error(errno);
        match errno {
            libc::ENOSPC | libc::EDQUOT => SysError::NoSpace { path },
            libc::EPERM | libc::EACCES => SysError::PermissionDenied { op: what, path },
            libc::EBUSY => SysError::Busy {
                what: format!("{what}: {source}"),
            },
            _ => SysError::Syscall { what, source },
        }
    }

    /// The errno behind this error, when there is one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            SysError::Io { source, .. } | SysError::Syscall { source, .. } => source.raw_os_error(),
            SysError::NoSpace { .. } => Some(libc::ENOSPC),
            SysError::Busy { .. } => Some(libc::EBUSY),
            _ => None,
        }
    }

    /// The io kind for Io errors (e.g. `AlreadyExists` from create_sparse).
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            SysError::Io { source, .. } | SysError::Syscall { source, .. } => Some(source.kind()),
            _ => None,
        }
    }

    /// NotFound, or an Io error whose kind is NotFound (ENOENT).
    pub fn is_not_found(&self) -> bool {
        matches!(self, SysError::NotFound { .. }) || self.io_kind() == Some(io::ErrorKind::NotFound)
    }

    /// An Io error whose kind is AlreadyExists (EEXIST).
    pub fn is_already_exists(&self) -> bool {
        self.io_kind() == Some(io::ErrorKind::AlreadyExists)
    }

    pub fn is_not_mounted(&self) -> bool {
        matches!(self, SysError::NotMounted { .. })
    }

    pub fn is_unsupported(&self) -> bool {
        matches!(self, SysError::Unsupported { .. })
    }

    pub fn is_busy(&self) -> bool {
        matches!(self, SysError::Busy { .. })
    }

    pub fn is_timeout(&self) -> bool {
        matches!(self, SysError::Timeout { .. })
    }

    pub fn is_no_space(&self) -> bool {
        matches!(self, SysError::NoSpace { .. })
    }

    pub fn is_permission_denied(&self) -> bool {
        matches!(self, SysError::PermissionDenied { .. })
    }

    pub fn is_invalid_argument(&self) -> bool {
        matches!(self, SysError::InvalidArgument { .. })
    }

    /// The kernel answered EINVAL: it refuses the request as such (a setting
    /// the device or filesystem does not allow), not a malformed argument of ours.
    pub fn is_refused_by_kernel(&self) -> bool {
        self.raw_os_error() == Some(libc::EINVAL)
    }

    /// EIO: the disk, or a filesystem that has shut down, fails the I/O.
    pub fn is_io_failure(&self) -> bool {
        self.raw_os_error() == Some(libc::EIO)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping() {
        assert!(SysError::errno("write", "/p", libc::ENOSPC).is_no_space());
        assert!(SysError::errno("write", "/p", libc::EDQUOT).is_no_space());
        assert!(SysError::errno("resize", "/p", libc::EPERM).is_permission_denied());
        assert!(SysError::errno("open", "/p", libc::EACCES).is_permission_denied());
        assert!(SysError::errno("umount", "/p", libc::EBUSY).is_busy());
        assert!(SysError::errno("open", "/p", libc::ENOENT).is_not_found());
        assert!(SysError::errno("open", "/p", libc::EEXIST).is_already_exists());
        assert_eq!(
            SysError::errno("open", "/p", libc::EIO).raw_os_error(),
            Some(libc::EIO)
        );
    }

    #[test]
    fn messages_name_paths_and_commands() {
        let e = SysError::errno("open", "/var/lib/x.img", libc::EIO);
        assert!(e.to_string().contains("open /var/lib/x.img"), "{e}");
        let e = SysError::Command {
            command: "mkfs.xfs -f /dev/loop3".into(),
            status: Some(1),
            stderr: "too small".into(),
        };
        assert_eq!(
            e.to_string(),
            "command `mkfs.xfs -f /dev/loop3` failed (exit status 1): too small"
        );
        let e = SysError::Timeout {
            command: "sleep 10".into(),
            seconds: 1,
        };
        assert!(e.to_string().contains("sleep 10"));
        let e = SysError::errno("open", "/dev/loop1", libc::EACCES);
        assert_eq!(e.to_string(), "open /dev/loop1: permission denied");
        let e = SysError::syscall("mount /dev/loop1 at /m".into(), "/m", libc::EPERM);
        assert_eq!(e.to_string(), "mount /dev/loop1 at /m: permission denied");
        let e = SysError::syscall("mount /dev/loop1 at /m".into(), "/m", libc::EINVAL);
        assert!(
            e.to_string()
                .starts_with("mount /dev/loop1 at /m: Invalid argument"),
            "{e}"
        );
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        let e = SysError::NotMounted {
            path: "/mnt/a b".into(),
        };
        assert_eq!(e.to_string(), "/mnt/a b is not mounted");
    }
}
