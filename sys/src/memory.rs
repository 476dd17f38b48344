//! Handing memory the process freed back to the system.

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
