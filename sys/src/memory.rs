//! Handing memory the process freed back to the system, and bounding what the
//! allocator keeps.

/// Asks the C allocator to give back to the system the free memory of all its
/// arenas. glibc keeps what a thread frees in that thread's arena (up to eight
/// per core), so a large answer built on one blocking thread after another
/// leaves its size behind in each of them. Cheap next to such an answer: it
/// walks the free lists. Does nothing with other C libraries.
pub fn release_free() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer and only rearranges the allocator's
    // own free memory; it is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The environment variable with which an operator sets glibc's arena limit
/// himself; [`limit_arenas`] leaves it alone then.
pub const ARENA_MAX_ENV: &str = "MALLOC_ARENA_MAX";

/// Limits the C allocator to `arenas` arenas unless the environment names a
/// limit ([`ARENA_MAX_ENV`]); returns the limit set, if any. To be called before
/// the process starts threads.
///
/// glibc gives a thread that finds every arena busy a new one, up to eight per
/// core. Each keeps the blocks freed in it, and a block still in use near the
/// top of an arena keeps the free pages below it from being handed back; over a
/// long busy spell (many blocking threads, each with its own arena) that
/// scattering, not anything in use, is what a driver gone idle still holds. The
/// driver's calls spend their time in system calls and child processes, not in
/// the allocator, so one arena per core costs them no measurable contention.
pub fn limit_arenas(arenas: usize) -> Option<usize> {
    if std::env::var_os(ARENA_MAX_ENV).is_some() || arenas == 0 {
        return None;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let n = libc::c_int::try_from(arenas).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt takes two integers and only changes the allocator's
        // own settings; M_ARENA_MAX is a setting glibc documents.
        if unsafe { libc::mallopt(libc::M_ARENA_MAX, n) } == 1 {
            return Some(arenas);
        }
    }
    None
}
