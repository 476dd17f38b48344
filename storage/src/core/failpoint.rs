//! Named failpoints between the steps of every multi-step operation, for the crash
//! and timing tests. `EXAMPLE_CSI_FAILPOINTS` is a comma-separated list of entries:
//!
//! - `NAME`: reaching the point ends the process at once, as a SIGKILL would: no
//!   destructor, no cleanup, no flush;
//! - `NAME=sleep(MS)`: the thread pauses MS milliseconds there each time, so a test
//!   can hold an operation in a window (a copy under a freeze, say);
//! - `NAME=N*sleep(MS)`: the same, the first N times only, so that a retry runs
//!   through;
//! - `NAME=fail`: [`fail`] there returns an error the first time it is reached, for
//!   the tests of how an operation undoes its earlier steps when a later one fails
//!   (the undo itself, and the retry, pass).
//!
//! Only debug builds and builds with the `failpoints` feature read the variable; a
//! release binary ignores it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use csi_sys::SysError;

pub const ENV: &str = "EXAMPLE_CSI_FAILPOINTS";

enum Action {
    Abort,
    Sleep {
        ms: u64,
        /// Pauses left; None for every time.
        left: Option<AtomicU64>,
    },
    /// [`fail`] returns an error once.
    Fail {
        fired: AtomicBool,
    },
}

struct Point {
    name: String,
    action: Action,
}

/// `NAME`, `NAME=sleep(MS)`, `NAME=N*sleep(MS)` or `NAME=fail`; None for anything
/// else.
fn parse(entry: &str) -> Option<Point> {
    let (name, action) = match entry.split_once('=') {
        None => (entry, Action::Abort),
        Some((name, spec)) if spec.trim() == "fail" => (
            name,
            Action::Fail {
                fired: AtomicBool::new(false),
            },
        ),
        Some((name, spec)) => {
            let (count, call) = match spec.split_once('*') {
                Some((n, call)) => (Some(n.trim().parse().ok()?), call),
                None => (None, spec),
            };
            let ms = call
                .trim()
                .strip_prefix("sleep(")?
                .strip_suffix(')')?
                .parse()
                .ok()?;
            let left = count.map(AtomicU64::new);
            (name, Action::Sleep { ms, left })
        }
    };
    let name = name.trim();
    (!name.is_empty()).then(|| Point {
        name: name.to_string(),
        action,
    })
}

fn armed() -> &'static [Point] {
    static ARMED: OnceLock<Vec<Point>> = OnceLock::new();
    ARMED.get_or_init(|| {
        if !(cfg!(debug_assertions) || cfg!(feature = "failpoints")) {
            return Vec::new();
        }
        let value = std::env::var(ENV).unwrap_or_default();
        value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .filter_map(|entry| {
                let point = parse(entry);
                if point.is_none() {
                    eprintln!(
                        "{ENV}: ignoring {entry:?}: not NAME, NAME=sleep(MS), NAME=N*sleep(MS) or NAME=fail"
                    );
                }
                point
            })
            .collect()
    })
}

/// Crashes the process here if `name` is armed to, or pauses if armed so.
pub fn hit(name: &str) {
    for point in armed().iter().filter(|p| p.name == name) {
        match &point.action {
            Action::Abort => {
                eprintln!("failpoint {name} reached: aborting");
                std::process::abort();
            }
            Action::Sleep { ms, left } => {
                let take = |n: u64| n.checked_sub(1);
                if left.as_ref().is_some_and(|l| {
                    l.fetch_update(Ordering::SeqCst, Ordering::SeqCst, take)
                        .is_err()
                }) {
                    continue;
                }
                eprintln!("failpoint {name} reached: sleeping {ms} ms");
                std::thread::sleep(Duration::from_millis(*ms));
            }
            Action::Fail { .. } => {}
        }
    }
}

/// An error, as the system layer would return it, the first time this is reached
/// with `name` armed as `NAME=fail`.
pub fn fail(name: &str) -> csi_sys::Result<()> {
    for point in armed().iter().filter(|p| p.name == name) {
        if let Action::Fail { fired } = &point.action {
            if !fired.swap(true, Ordering::SeqCst) {
                eprintln!("failpoint {name} reached: failing once");
                return Err(SysError::Syscall {
                    what: format!("failpoint {name}"),
                    source: std::io::Error::other("injected failure"),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_into_actions() {
        assert!(matches!(parse("a.b").unwrap().action, Action::Abort));
        match parse("a.b=sleep(250)").unwrap().action {
            Action::Sleep { ms, left } => assert_eq!((ms, left.is_none()), (250, true)),
            _ => panic!("not a sleep"),
        }
        match parse(" a.b = 2*sleep(7) ").unwrap() {
            Point {
                name,
                action: Action::Sleep { ms, left: Some(l) },
            } => assert_eq!((name.as_str(), ms, l.into_inner()), ("a.b", 7, 2)),
            _ => panic!("not a counted sleep"),
        }
        assert!(matches!(
            parse("a.b=fail").unwrap().action,
            Action::Fail { .. }
        ));
        for bad in [
            "a=sleep",
            "a=sleep(x)",
            "a=x*sleep(1)",
            "a=crash",
            "=sleep(1)",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
    }
}
