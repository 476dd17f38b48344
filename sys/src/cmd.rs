//! Running external commands (mkfs, fsck, blkid, btrfs, ...).
//!
//! Commands run from an argument vector, never through a shell, with stdin closed,
//! `LC_ALL=C` (their output is parsed) and a PATH that includes the sbin folders
//! where the filesystem tools live. Every run has a deadline: a command that hangs
//! (a wedged device, a tool waiting for input) is killed with SIGKILL together with
//! its process group and reaped, so that no RPC hangs forever. A command dies
//! with the driver's process (the parent-death signal), never outliving it.

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::error::{Result, SysError};

/// Deadline for commands that may take a while (mkfs, fsck, resize).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Deadline for commands that only read a little (blkid, dumpe2fs -h, qgroup show).
pub const SHORT_TIMEOUT: Duration = Duration::from_secs(30);

/// Folders searched after the process's own PATH: the filesystem tools are in sbin,
/// which a container's PATH does not always include.
const EXTRA_PATH: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// The search path used for commands: the process's PATH followed by the sbin/bin
/// folders it lacks.
pub fn search_path() -> OsString {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for extra in EXTRA_PATH {
        if !dirs.iter().any(|d| d == Path::new(extra)) {
            dirs.push(PathBuf::from(extra));
        }
    }
    // join_paths fails only on a folder containing ':', which PATH cannot hold.
    std::env::join_paths(dirs).unwrap_or_else(|_| OsString::from(EXTRA_PATH.join(":")))
}

/// Resolve `program` on the search path (a name with a `/` is taken as it is).
pub fn which(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        return is_executable(&p).then_some(p);
    }
    std::env::split_paths(&search_path())
        .map(|d| d.join(program))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The command line as text, for messages and logs.
pub fn display<S: AsRef<OsStr>>(program: &str, args: &[S]) -> String {
    let mut s = program.to_string();
    for a in args {
        s.push(' ');
        let a = a.as_ref().to_string_lossy();
        if a.is_empty() || a.contains(char::is_whitespace) {
            s.push('\'');
            s.push_str(&a);
            s.push('\'');
        } else {
            s.push_str(&a);
        }
    }
    s
}

/// Run `program args...` and wait for it at most `timeout`. A non-zero exit is an
/// error ([`SysError::Command`] with the trimmed stderr); see [`run_unchecked`] for
/// commands whose exit codes carry meaning.
pub fn run<S: AsRef<OsStr>>(program: &str, args: &[S], timeout: Duration) -> Result<Output> {
    let out = run_unchecked(program, args, timeout)?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(command_error(program, args, &out))
    }
}

/// The [`SysError::Command`] for a finished command: its exit code and its stderr
/// (or stdout when stderr is empty, as some tools report errors there).
pub fn command_error<S: AsRef<OsStr>>(program: &str, args: &[S], out: &Output) -> SysError {
    let mut text = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if text.is_empty() {
        text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    }
    // Some tools (xfs_repair) print pages of progress; the end says what failed.
    const KEEP: usize = 4000;
    if text.len() > KEEP {
        let mut cut = text.len() - KEEP;
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        text = format!("...{}", &text[cut..]);
    }
    SysError::Command {
        command: display(program, args),
        status: out.status.code(),
        stderr: text,
    }
}

/// The command that runs `exe` with `args`: a known PATH and locale, no
/// input, its output piped, in a process group of its own, dying with the
/// driver.
fn command<S: AsRef<OsStr>>(exe: &Path, args: &[S]) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env("PATH", search_path())
        .env("LC_ALL", "C")
        // libblkid keeps a cache of every block device it scanned in
        // /run/blkid/blkid.tab, written by tools that look a filesystem up by a
        // path they cannot place (`btrfs filesystem show` on a path that is not
        // a btrfs mount scans all devices): the driver writes nothing outside its
        // pools and what it was asked to publish to, and its tools probe devices
        // afresh anyway.
        .env("BLKID_FILE", "/dev/null")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so that a timeout kills helpers it started too
        // (they would otherwise keep our pipes open).
        .process_group(0);
    // A command dies with the driver: one killed while mkfs runs must not leave
    // it writing into a file the next start removes or reuses. The thread that
    // spawns the command waits for it to end, so the signal never comes early.
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the child between fork and exec and makes
    // only async-signal-safe system calls (prctl, getppid), allocating nothing.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The driver died before the signal was asked for.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
            }
            Ok(())
        });
    }
    cmd
}

/// Run `program args...` like [`run`] but return its output whatever its exit
/// status. Errors only when it cannot be started or does not finish in time.
pub fn run_unchecked<S: AsRef<OsStr>>(
    program: &str,
    args: &[S],
    timeout: Duration,
) -> Result<Output> {
    let line = display(program, args);
    let exe = which(program).ok_or_else(|| SysError::NotFound {
        what: format!(
            "command {program} (searched {})",
            search_path().to_string_lossy()
        ),
    })?;
    let mut cmd = command(&exe, args);
    tracing::debug!(command = %line, "running");
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| SysError::io("spawn", &exe, e))?;

    // Drain both pipes on threads: a command that writes more than a pipe buffer
    // would otherwise block forever while we wait for it.
    let stdout = child.stdout.take().map(reader_thread);
    let stderr = child.stderr.take().map(reader_thread);

    let deadline = started + timeout;
    let mut pause = Duration::from_millis(1);
    let status: ExitStatus = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => {
                kill_group(&mut child);
                return Err(SysError::io("wait for", &exe, e));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            kill_group(&mut child);
            // Reap, so no zombie is left behind.
            let _ = child.wait();
            let _ = stdout.map(|h| h.join());
            let _ = stderr.map(|h| h.join());
            tracing::warn!(command = %line, ?timeout, "command timed out and was killed");
            return Err(SysError::Timeout {
                command: line,
                seconds: timeout.as_secs().max(1),
            });
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(50));
    };
    let stdout = stdout.and_then(|h| h.join().ok()).unwrap_or_default();
    let stderr = stderr.and_then(|h| h.join().ok()).unwrap_or_default();
    tracing::debug!(
        command = %line,
        code = status.code().or(status.signal().map(|s| 128 + s)),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "finished"
    );
    Ok(Output {
        status,
        stdout,
        stderr,
    })
}

fn reader_thread<R: Read + Send + 'static>(mut r: R) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

fn kill_group(child: &mut std::process::Child) {
    // The child leads its own process group (process_group(0)), so its pid is the
    // group id. Kill the group first, then the child itself in case the group kill
    // raced with its exit.
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let _ = child.kill();
}

/// The standard output as text, for parsing.
pub fn stdout_text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_with_an_argument_vector() {
        let out = run("printf", &["%s|", "a b", "$HOME;ls"], SHORT_TIMEOUT).unwrap();
        assert_eq!(stdout_text(&out), "a b|$HOME;ls|");
    }

    #[test]
    fn commands_keep_no_blkid_cache() {
        let out = run("sh", &["-c", "printf %s \"$BLKID_FILE\""], SHORT_TIMEOUT).unwrap();
        assert_eq!(stdout_text(&out), "/dev/null");
    }

    #[test]
    fn non_zero_exit_is_a_command_error_with_stderr() {
        let err = run("sh", &["-c", "echo oops >&2; exit 3"], SHORT_TIMEOUT).unwrap_err();
        match &err {
            SysError::Command {
                command,
                status,
                stderr,
            } => {
                assert_eq!(*status, Some(3));
                assert_eq!(stderr, "oops");
                assert!(command.starts_with("sh -c"), "{command}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let out = run_unchecked("sh", &["-c", "exit 2"], SHORT_TIMEOUT).unwrap();
        assert_eq!(out.status.code(), Some(2));
    }

    #[test]
    fn timeout_kills_the_command_and_its_children() {
        let started = Instant::now();
        let err = run(
            "sh",
            &["-c", "sleep 30 & sleep 30; echo never"],
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(err.is_timeout(), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn missing_command_is_not_found() {
        let err = run("no-such-command-csi", &[] as &[&str], SHORT_TIMEOUT).unwrap_err();
        assert!(err.is_not_found(), "{err:?}");
        assert!(err.to_string().contains("no-such-command-csi"));
    }

    #[test]
    fn search_path_has_sbin() {
        let p = search_path();
        let dirs: Vec<_> = std::env::split_paths(&p).collect();
        assert!(dirs.contains(&PathBuf::from("/usr/sbin")));
        assert!(dirs.contains(&PathBuf::from("/sbin")));
    }

    #[test]
    fn large_output_does_not_block() {
        let out = run("sh", &["-c", "head -c 1000000 /dev/zero"], SHORT_TIMEOUT).unwrap();
        assert_eq!(out.stdout.len(), 1_000_000);
    }
}
