//! The CSI endpoint: parsing `unix://` and bare paths, refusing TCP unless allowed,
//! and a socket that is never wider than 0660, is cleaned when stale and removed on
//! a clean stop.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use std::os::fd::AsRawFd;

use nix::fcntl::{AtFlags, AT_FDCWD};
use nix::sys::socket::{
    bind as bind_fd, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr,
};
use nix::sys::stat::{fchmod, Mode};
use nix::unistd::{fchownat, Gid};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

pub fn parse(s: &str, allow_tcp: bool) -> Result<Endpoint, String> {
    if let Some(rest) = s.strip_prefix("unix://") {
        let path = if rest.starts_with('/') {
            rest.to_string()
        } else {
            format!("/{rest}")
        };
        return unix(&path, s);
    }
    if let Some(addr) = s.strip_prefix("tcp://") {
        if !allow_tcp {
            return Err(format!(
                "endpoint {s:?} is TCP: the CSI API is root-equivalent, so only a unix socket \
                 is served unless --allow-tcp is given"
            ));
        }
        if addr.parse::<std::net::SocketAddr>().is_err() {
            return Err(format!("endpoint {s:?} is not tcp://ADDRESS:PORT"));
        }
        return Ok(Endpoint::Tcp(addr.to_string()));
    }
    if s.starts_with('/') {
        return unix(s, s);
    }
    Err(format!(
        "endpoint {s:?} is not unix:///path/to/socket, a bare absolute path, or tcp://ADDRESS:PORT"
    ))
}

fn unix(path: &str, original: &str) -> Result<Endpoint, String> {
    let p = PathBuf::from(path);
    if path.contains('\0') || p.file_name().is_none() || path.ends_with('/') {
        return Err(format!("endpoint {original:?} does not name a socket file"));
    }
    // sun_path holds 108 bytes with its terminating NUL.
    if path.len() > 107 {
        return Err(format!(
            "endpoint {original:?} is longer than a unix socket path may be"
        ));
    }
    Ok(Endpoint::Unix(p))
}

/// Makes way for a new socket: removes a stale one left by a crash, refuses to
/// replace anything that is not a socket or a socket that still answers.
pub fn prepare(path: &Path) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Err(_) => Ok(()),
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(format!(
                    "{} is in use by a running process; is another driver serving it?",
                    path.display()
                ));
            }
            std::fs::remove_file(path)
                .map_err(|e| format!("cannot remove stale {}: {e}", path.display()))?;
            tracing::info!(path = %path.display(), "removed a stale socket");
            Ok(())
        }
        Ok(_) => Err(format!(
            "{} exists and is not a socket; it is left alone",
            path.display()
        )),
    }
}

/// How many connections may wait to be accepted (the kernel caps it at somaxconn).
const BACKLOG: i32 = 1024;

/// Binds a socket that is 0660 (or stricter, by the umask) from its first
/// moment: the kernel gives the new socket file the mode of the socket's inode,
/// so that mode is set before the bind, and the process's umask, shared by every
/// thread, is never changed. With a `group`, the socket file is then given to
/// that group (until then it is the process's own group's: never wider) and made
/// 0660 whatever the umask, so that a client running as another user in that
/// group can connect.
pub fn bind(path: &Path, group: Option<u32>) -> std::io::Result<tokio::net::UnixListener> {
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    fchmod(&fd, Mode::from_bits_truncate(0o660))?;
    bind_fd(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    if let Some(gid) = group {
        fchownat(
            AT_FDCWD,
            path,
            None,
            Some(Gid::from_raw(gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )?;
        // The group must be able to write (connect), whatever the umask took
        // away at the bind: a container's usual 022 leaves 0640.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    }
    listen(&fd, Backlog::new(BACKLOG)?)?;
    tokio::net::UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            parse("unix:///csi/csi.sock", false),
            Ok(Endpoint::Unix("/csi/csi.sock".into()))
        );
        assert_eq!(
            parse("unix://csi/csi.sock", false),
            Ok(Endpoint::Unix("/csi/csi.sock".into()))
        );
        assert_eq!(
            parse("/tmp/x.sock", false),
            Ok(Endpoint::Unix("/tmp/x.sock".into()))
        );
        assert!(parse("tcp://127.0.0.1:10000", false).is_err());
        assert_eq!(
            parse("tcp://127.0.0.1:10000", true),
            Ok(Endpoint::Tcp("127.0.0.1:10000".into()))
        );
        for bad in [
            "",
            "csi.sock",
            "http://x",
            "unix://",
            "unix:///",
            "tcp://nope",
            &format!("/{}", "a".repeat(200)),
        ] {
            assert!(parse(bad, true).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stale_socket_is_removed_but_a_file_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        assert!(sock.exists());
        prepare(&sock).unwrap();
        assert!(!sock.exists());
        let file = dir.path().join("f");
        std::fs::write(&file, b"keep").unwrap();
        assert!(prepare(&file).is_err());
        assert_eq!(std::fs::read(&file).unwrap(), b"keep");
    }

    /// The process's umask, read without setting it (setting it, even back,
    /// would race with the other tests' files).
    fn umask_now() -> u32 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
        u32::from_str_radix(line["Umask:".len()..].trim(), 8).unwrap()
    }

    #[tokio::test]
    async fn a_bound_socket_is_0660_under_any_umask_and_the_umask_is_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let before = umask_now();
        let listener = bind(&sock, None).unwrap();
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & !0o660, 0, "{mode:o} is wider than 0660");
        assert_eq!(mode, 0o660 & !before, "{mode:o}");
        assert_eq!(umask_now(), before, "bind changed the umask");
        let client = tokio::net::UnixStream::connect(&sock).await;
        assert!(client.is_ok(), "{client:?}");
        assert!(listener.accept().await.is_ok());
    }

    #[tokio::test]
    async fn a_socket_group_owns_the_socket_and_its_mode_stays_0660() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        // Root may give a file to any group; anyone else to a group he is in.
        let gid = nix::unistd::getegid().as_raw();
        let other = if nix::unistd::geteuid().is_root() {
            65532
        } else {
            nix::unistd::getgroups()
                .unwrap_or_default()
                .into_iter()
                .map(|g| g.as_raw())
                .find(|g| *g != gid)
                .unwrap_or(gid)
        };
        let _listener = bind(&sock, Some(other)).unwrap();
        let meta = std::fs::metadata(&sock).unwrap();
        assert_eq!(meta.gid(), other);
        // 0660 exactly, whatever the umask (the tests' is usually 022).
        assert_eq!(meta.permissions().mode() & 0o7777, 0o660);
    }
}
