//! Named failpoints between the steps of every multi-step operation, for the crash
//! tests: when `EXAMPLE_CSI_FAILPOINTS` names a point (comma-separated), reaching it
//! ends the process at once, as a SIGKILL would: no destructor, no cleanup, no
//! flush. A point named as `NAME=fail` instead makes [`fail`] there return an error
//! the first time it is reached, for the tests of how an operation undoes its
//! earlier steps when a later one fails (the undo itself, and the retry, pass). Only
//! debug builds and builds with the `failpoints` feature read the
//! variable; a release binary ignores it.

use std::sync::{Mutex, OnceLock};

use csi_sys::SysError;

pub const ENV: &str = "EXAMPLE_CSI_FAILPOINTS";

fn armed() -> &'static [String] {
    static ARMED: OnceLock<Vec<String>> = OnceLock::new();
    ARMED.get_or_init(|| {
        if !(cfg!(debug_assertions) || cfg!(feature = "failpoints")) {
            return Vec::new();
        }
        std::env::var(ENV)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Crashes the process here if `name` is armed.
pub fn hit(name: &str) {
    if armed().iter().any(|a| a == name) {
        eprintln!("failpoint {name} reached: aborting");
        std::process::abort();
    }
}

/// An error, as the system layer would return it, the first time this is reached
/// with `name` armed as `NAME=fail`.
pub fn fail(name: &str) -> csi_sys::Result<()> {
    static FIRED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    if !armed()
        .iter()
        .any(|a| a.strip_suffix("=fail") == Some(name))
    {
        return Ok(());
    }
    let mut fired = FIRED.lock().unwrap_or_else(|p| p.into_inner());
    if !fired.iter().any(|f| f == name) {
        fired.push(name.to_string());
        eprintln!("failpoint {name} reached: failing once");
        return Err(SysError::Syscall {
            what: format!("failpoint {name}"),
            source: std::io::Error::other("injected failure"),
        });
    }
    Ok(())
}
