//! Handing back to the system the memory large answers leave behind.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Entries of a listing page from which the memory its work freed is handed
/// back to the system.
const LARGE_PAGE: usize = 256;

/// The shortest time between two releases while a listing goes on.
const AT_MOST_EVERY: Duration = Duration::from_secs(1);

static AFTER_LISTINGS: Releases = Releases::new();

/// Notes that a listing page of `entries` entries was served (its records
/// already dropped), the last of its listing or not. Each large page leaves
/// its records' memory in the arena of the blocking thread that served it
/// (glibc keeps what a thread frees for that thread's arena): a listing of
/// 100,000 volumes a thousand at a time kept about 30 MiB. It is handed back
/// once the listing ends, and at most once a second while a listing goes on
/// (each release walks every arena).
pub fn listing_page_served(entries: usize, last_page: bool) {
    AFTER_LISTINGS.page_served(entries, last_page);
}

struct Releases(Mutex<State>);

struct State {
    /// A large page was served since the last release.
    pending: bool,
    last: Option<Instant>,
}

impl Releases {
    const fn new() -> Self {
        Releases(Mutex::new(State {
            pending: false,
            last: None,
        }))
    }

    /// Returns whether the memory was handed back.
    fn page_served(&self, entries: usize, last_page: bool) -> bool {
        let mut st = self.0.lock().unwrap_or_else(|p| p.into_inner());
        st.pending |= entries >= LARGE_PAGE;
        let due = st.pending && (last_page || st.last.is_none_or(|t| t.elapsed() >= AT_MOST_EVERY));
        if !due {
            return false;
        }
        st.pending = false;
        st.last = Some(Instant::now());
        drop(st);
        csi_sys::memory::release_free();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_handed_back_when_a_large_listing_ends_and_at_most_once_a_second_before() {
        let (small, large) = (1, LARGE_PAGE);
        let r = Releases::new();
        assert!(
            !r.page_served(small, true),
            "small listings hand nothing back"
        );
        assert!(r.page_served(large, false), "the first large page does");
        assert!(
            !r.page_served(large, false),
            "another within a second does not"
        );
        assert!(r.page_served(small, true), "the listing's end does");
        assert!(!r.page_served(small, true), "nothing is pending after it");
        r.0.lock().unwrap().last = Some(Instant::now() - 2 * AT_MOST_EVERY);
        assert!(
            r.page_served(large, false),
            "a second later a large page does again"
        );
    }
}
