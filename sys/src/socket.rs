//! Unix sockets the driver serves itself.

use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixListener;

/// Shuts a listening socket down: an `accept` blocked on it (in another thread,
/// on a handle of the same socket) returns with an error at once, whatever
/// became of the socket's file.
pub fn stop_listening(listener: &UnixListener) {
    let _ = nix::sys::socket::shutdown(listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
}
