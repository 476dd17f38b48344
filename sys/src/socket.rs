//! Unix sockets the driver serves itself, carrying one line of text each way per
//! connection: the listening side (made private to root, a stale socket file
//! replaced) and the connecting side, both with bounded waits.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Result, SysError};

/// A socket listening at a path.
#[derive(Debug)]
pub struct Listener {
    path: PathBuf,
    socket: UnixListener,
}

impl Listener {
    /// Listens at `path`, mode 0600; a socket file left there by an earlier run
    /// is replaced (the caller knows no other process serves it).
    pub fn bind_private(path: &Path) -> Result<Listener> {
        crate::file::remove_file_if_exists(path)?;
        let socket = UnixListener::bind(path).map_err(|e| SysError::io("listen on", path, e))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| SysError::io("chmod", path, e))?;
        Ok(Listener {
            path: path.to_path_buf(),
            socket,
        })
    }

    /// A second handle of the same socket, for [`Listener::stop`] from another
    /// thread than the one blocked in [`Listener::accept`].
    pub fn handle(&self) -> Result<Listener> {
        Ok(Listener {
            path: self.path.clone(),
            socket: self
                .socket
                .try_clone()
                .map_err(|e| SysError::io("keep a handle of", &self.path, e))?,
        })
    }

    /// Waits for the next connection; each waits at most `timeout` for a line
    /// to read or room to write.
    pub fn accept(&self, timeout: Duration) -> Result<Connection> {
        let (stream, _) = self
            .socket
            .accept()
            .map_err(|e| SysError::io("accept on", &self.path, e))?;
        Connection::with_timeout(stream, &self.path, timeout)
    }

    /// Shuts the socket down: an `accept` blocked on it (in another thread, on
    /// another handle) returns with an error at once, whatever became of the
    /// socket's file.
    pub fn stop(&self) {
        let _ =
            nix::sys::socket::shutdown(self.socket.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }

    /// Removes the socket's file (already gone is fine).
    pub fn remove_file(&self) {
        let _ = crate::file::remove_file_if_exists(&self.path);
    }
}

/// One connection: lines of text each way.
#[derive(Debug)]
pub struct Connection {
    path: PathBuf,
    stream: UnixStream,
}

impl Connection {
    /// Connects to the socket at `path`; reads and writes wait at most `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Connection> {
        let stream = UnixStream::connect(path).map_err(|e| SysError::io("connect to", path, e))?;
        Connection::with_timeout(stream, path, timeout)
    }

    fn with_timeout(stream: UnixStream, path: &Path, timeout: Duration) -> Result<Connection> {
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| SysError::io("set the timeouts of", path, e))?;
        Ok(Connection {
            path: path.to_path_buf(),
            stream,
        })
    }

    /// Reads one line (without more than `max` bytes); what the other side sent
    /// before it closed when no newline came.
    pub fn read_line(&self, max: u64) -> Result<String> {
        let mut line = String::new();
        BufReader::new((&self.stream).take(max))
            .read_line(&mut line)
            .map_err(|e| SysError::io("read from", &self.path, e))?;
        Ok(line)
    }

    /// Writes `line` and a newline.
    pub fn write_line(&self, line: &[u8]) -> Result<()> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line);
        bytes.push(b'\n');
        (&self.stream)
            .write_all(&bytes)
            .map_err(|e| SysError::io("write to", &self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_goes_each_way_and_a_stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        drop(UnixListener::bind(&path).unwrap());
        let listener = Listener::bind_private(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let t = Duration::from_secs(5);
        let server = std::thread::spawn(move || {
            let c = listener.accept(t).unwrap();
            let got = c.read_line(1024).unwrap();
            c.write_line(got.trim_end().to_uppercase().as_bytes())
                .unwrap();
        });
        let c = Connection::connect(&path, t).unwrap();
        c.write_line(b"ping").unwrap();
        assert_eq!(c.read_line(1024).unwrap(), "PING\n");
        server.join().unwrap();
    }

    #[test]
    fn stopping_wakes_a_blocked_accept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = Listener::bind_private(&path).unwrap();
        let handle = listener.handle().unwrap();
        let waiter = std::thread::spawn(move || listener.accept(Duration::from_secs(1)).is_err());
        std::thread::sleep(Duration::from_millis(50));
        handle.stop();
        assert!(waiter.join().unwrap(), "the accept failed once stopped");
        let e = Connection::connect(&dir.path().join("none"), Duration::from_secs(1)).unwrap_err();
        assert!(e.is_not_found(), "{e}");
    }
}
