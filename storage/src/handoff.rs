//! The controller's change of a staged volume's loop devices, handed to the node
//! plugin when the two run as separate processes on one node: the node domain
//! listens on a Unix socket in the shared part of the state dir, and the
//! controller domain asks it, one request per connection (a JSON line each way),
//! to apply or put back settings. The controller holds the volume's lock for the
//! whole exchange, so no stage or unstage runs meanwhile.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use csi_sys::socket::{Connection, Listener};
use serde::{Deserialize, Serialize};

use crate::core::settings::{DevicesBefore, LiveDevices, LoopSettings};
use crate::error::{Context, Error, Result};

/// How long either side waits for the other. A loop device's settings change in
/// milliseconds; a node plugin that does not answer within this is stuck, and the
/// controller's caller has a deadline of its own.
const TIMEOUT: Duration = Duration::from_secs(10);
/// A request is a path and a few numbers: anything longer is not one.
const MAX_LINE: u64 = 1 << 20;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    Apply {
        image: PathBuf,
        settings: LoopSettings,
    },
    Restore {
        before: DevicesBefore,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Answer {
    Applied(DevicesBefore),
    Restored,
    Failed { code: Code, message: String },
}

/// What the controller needs to answer with the right code.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Code {
    InvalidArgument,
    NotFound,
    FailedPrecondition,
    Aborted,
    Internal,
}

impl Code {
    fn of(e: &Error) -> Code {
        match e {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Aborted(_) => Code::Aborted,
            Error::Cleanup { first, .. } => Code::of(first),
            _ => Code::Internal,
        }
    }

    fn error(self, message: String) -> Error {
        match self {
            Code::InvalidArgument => Error::InvalidArgument(message),
            Code::NotFound => Error::NotFound(message),
            Code::FailedPrecondition => Error::FailedPrecondition(message),
            Code::Aborted => Error::Aborted(message),
            Code::Internal => Error::Internal(message),
        }
    }
}

/// The node side: answers the controller's requests with this process's node
/// domain until dropped.
pub struct Server {
    /// A handle of the listening socket, kept to shut it down: that ends the
    /// thread's accept whatever became of the socket's file.
    listening: Listener,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Listens at `path` (a socket left by an earlier run of this node plugin is
    /// replaced: the node domain's owner lock says no other is running).
    pub fn start(path: &Path, node: Arc<dyn LiveDevices>) -> Result<Server> {
        let at = || format!("serving the hand-off socket {}", path.display());
        let listener = Listener::bind_private(path).context(at)?;
        let listening = listener.handle().context(at)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("handoff".into())
            .spawn(move || loop {
                let conn = listener.accept(TIMEOUT);
                if stopped.load(Ordering::Acquire) {
                    break;
                }
                match conn {
                    Ok(conn) => serve_one(&conn, node.as_ref()),
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a hand-off connection");
                        // Not a busy loop on a socket that keeps failing.
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })
            .map_err(|e| Error::internal(format!("{}: starting its thread: {e}", at())))?;
        tracing::info!(socket = %path.display(), "serving the controller's changes of staged volumes");
        Ok(Server {
            listening,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept (it fails from now on); the thread sees the flag and ends.
        self.listening.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.listening.remove_file();
    }
}

fn serve_one(conn: &Connection, node: &dyn LiveDevices) {
    let answer = match read_line::<Request>(conn) {
        Ok(Request::Apply { image, settings }) => {
            tracing::info!(image = %image.display(), ?settings, "controller changes a staged volume's loop devices");
            node.apply_live(&image, settings).map(Answer::Applied)
        }
        Ok(Request::Restore { before }) => node.restore_live(&before).map(|()| Answer::Restored),
        Err(e) => Err(e),
    };
    let answer = answer.unwrap_or_else(|e| Answer::Failed {
        code: Code::of(&e),
        message: e.to_string(),
    });
    if let Err(e) = write_line(conn, &answer) {
        tracing::warn!(error = %e, "answering the controller");
    }
}

fn read_line<T: for<'de> Deserialize<'de>>(conn: &Connection) -> Result<T> {
    let line = conn
        .read_line(MAX_LINE)
        .context(|| "reading the hand-off socket".into())?;
    serde_json::from_str(&line)
        .map_err(|e| Error::internal(format!("unreadable message on the hand-off socket: {e}")))
}

fn write_line<T: Serialize>(conn: &Connection, value: &T) -> Result<()> {
    let bytes = serde_json::to_vec(value)
        .map_err(|e| Error::internal(format!("encoding a hand-off message: {e}")))?;
    conn.write_line(&bytes)
        .context(|| "writing the hand-off socket".into())
}

/// The controller side: the node plugin of this node, reached through its socket.
pub struct Remote {
    path: PathBuf,
}

impl Remote {
    pub fn new(path: &Path) -> Remote {
        Remote {
            path: path.to_path_buf(),
        }
    }

    fn ask(&self, request: &Request) -> Result<Answer> {
        let conn = Connection::connect(&self.path, TIMEOUT).map_err(|e| {
            Error::precondition(format!(
                "the volume is staged on this node, and its node plugin cannot be reached \
                 to change the loop device serving it ({e}); nothing was changed"
            ))
        })?;
        write_line(&conn, request)?;
        match read_line::<Answer>(&conn)? {
            Answer::Failed { code, message } => Err(code.error(format!("node plugin: {message}"))),
            a => Ok(a),
        }
    }
}

impl LiveDevices for Remote {
    fn apply_live(&self, image: &Path, settings: LoopSettings) -> Result<DevicesBefore> {
        match self.ask(&Request::Apply {
            image: image.to_path_buf(),
            settings,
        })? {
            Answer::Applied(before) => Ok(before),
            other => Err(Error::internal(format!(
                "node plugin answered {other:?} to apply"
            ))),
        }
    }

    fn restore_live(&self, before: &DevicesBefore) -> Result<()> {
        match self.ask(&Request::Restore {
            before: before.clone(),
        })? {
            Answer::Restored => Ok(()),
            other => Err(Error::internal(format!(
                "node plugin answered {other:?} to restore"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records what it is asked; fails images named `busy`.
    #[derive(Default)]
    struct Devices {
        calls: Mutex<Vec<String>>,
    }

    impl LiveDevices for Devices {
        fn apply_live(&self, image: &Path, s: LoopSettings) -> Result<DevicesBefore> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("apply {} {s:?}", image.display()));
            if image.ends_with("busy") {
                return Err(Error::Aborted("busy".into()));
            }
            Ok(vec![("/dev/loop7".into(), LoopSettings::default())])
        }
        fn restore_live(&self, before: &DevicesBefore) -> Result<()> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("restore {}", before.len()));
            Ok(())
        }
    }

    #[test]
    fn the_controller_side_gets_the_node_side_answers_and_codes() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("node.sock");
        let devices = Arc::new(Devices::default());
        let server = Server::start(&socket, devices.clone()).unwrap();
        let remote = Remote::new(&socket);
        let wanted = LoopSettings {
            direct_io: Some(true),
            read_ahead_kib: Some(512),
        };
        let before = remote.apply_live(Path::new("/pool/v.img"), wanted).unwrap();
        assert_eq!(before, vec![("/dev/loop7".into(), LoopSettings::default())]);
        remote.restore_live(&before).unwrap();
        let e = remote
            .apply_live(Path::new("/pool/busy"), wanted)
            .unwrap_err();
        assert!(
            matches!(e, Error::Aborted(ref m) if m.contains("busy")),
            "{e:?}"
        );

        // A client that sends nonsense gets an error, and the server goes on.
        let raw = Connection::connect(&socket, TIMEOUT).unwrap();
        raw.write_line(b"{\"op\":\"format_everything\"}").unwrap();
        let answer: Answer = read_line(&raw).unwrap();
        assert!(
            matches!(
                answer,
                Answer::Failed {
                    code: Code::Internal,
                    ..
                }
            ),
            "{answer:?}"
        );
        remote.apply_live(Path::new("/pool/v.img"), wanted).unwrap();
        assert_eq!(devices.calls.lock().unwrap().len(), 4);

        drop(server);
        assert!(!socket.exists(), "the socket goes with the server");
        let e = remote
            .apply_live(Path::new("/pool/v.img"), wanted)
            .unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    }

    #[test]
    fn the_server_stops_when_its_socket_file_is_already_gone() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("node.sock");
        let server = Server::start(&socket, Arc::new(Devices::default())).unwrap();
        std::fs::remove_file(&socket).unwrap();
        let (done, stopped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(server);
            let _ = done.send(());
        });
        stopped
            .recv_timeout(Duration::from_secs(5))
            .expect("the server stopped");
    }

    #[test]
    fn a_socket_left_by_an_earlier_run_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("node.sock");
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        assert!(socket.exists());
        let _server = Server::start(&socket, Arc::new(Devices::default())).unwrap();
        Remote::new(&socket)
            .restore_live(&Vec::new())
            .expect("the new server answers");
    }
}
