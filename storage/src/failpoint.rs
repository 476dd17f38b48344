//! Named failpoints between the steps of every multi-step operation, for the crash
//! tests: when `EXAMPLE_CSI_FAILPOINTS` names a point (comma-separated), reaching it
//! ends the process at once, as a SIGKILL would: no destructor, no cleanup, no
//! flush. Only debug builds and builds with the `failpoints` feature read the
//! variable; a release binary ignores it.

use std::sync::OnceLock;

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
