//! Handing back to the system the memory large answers and busy spells leave
//! behind.

use std::sync::atomic::{AtomicU64, Ordering};
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

/// How often the driver looks whether it has gone idle.
const IDLE_LOOK: Duration = Duration::from_secs(2);

static CALLS: Calls = Calls::new();

/// Calls begun and calls ended since the start.
struct Calls {
    begun: AtomicU64,
    ended: AtomicU64,
}

impl Calls {
    const fn new() -> Self {
        Calls {
            begun: AtomicU64::new(0),
            ended: AtomicU64::new(0),
        }
    }

    /// Calls begun so far and whether one is under way.
    fn read(&self) -> (u64, bool) {
        // `ended` first: a call that ends between the two reads is then still
        // seen as under way, never the other way round.
        let ended = self.ended.load(Ordering::Acquire);
        let begun = self.begun.load(Ordering::Acquire);
        (begun, begun != ended)
    }
}

/// A call under way, from its start until its work has ended (or was dropped
/// unrun): the driver is not idle while one lives.
#[must_use]
pub struct Busy(());

/// Marks the start of a call's work; the call is over when the guard drops.
pub fn busy() -> Busy {
    CALLS.begun.fetch_add(1, Ordering::AcqRel);
    Busy(())
}

impl Drop for Busy {
    fn drop(&mut self) {
        CALLS.ended.fetch_add(1, Ordering::AcqRel);
    }
}

/// Hands back the memory a busy spell leaves behind once the driver has been
/// idle (no call under way, none begun) for `after`. A burst of concurrent calls
/// grows the allocator's arenas (connections' buffers, each blocking thread's
/// cache of freed blocks) and glibc keeps that free memory for the next burst; a
/// node plugin that served a burst an hour ago should not hold it. `after` should
/// outlast the runtime's idle blocking threads: each hands its cache back only as
/// it ends, and until then its blocks keep the pages around them from being
/// returned. Once per idle spell, so an idle driver does nothing. Runs until the
/// runtime stops.
pub async fn release_when_idle(after: Duration) {
    let mut idle = Idle::default();
    loop {
        tokio::time::sleep(IDLE_LOOK).await;
        let (begun, running) = CALLS.read();
        if idle.look(begun, running, Instant::now(), after) {
            let started = Instant::now();
            if tokio::task::spawn_blocking(csi_storage::release_free_memory)
                .await
                .is_ok()
            {
                tracing::debug!(
                    took_ms = started.elapsed().as_secs_f64() * 1000.0,
                    "idle: free memory handed back"
                );
            }
        }
    }
}

/// What the idle look decides from.
#[derive(Default)]
struct Idle {
    /// Calls begun as of the previous look.
    seen: u64,
    /// Since when no call has been under way or begun, as far as the looks tell.
    quiet_since: Option<Instant>,
    /// Calls begun as of the last release.
    released: u64,
}

impl Idle {
    /// Whether to release now, given the calls begun so far, whether one is under
    /// way, the time, and how long the driver must have been idle.
    fn look(&mut self, begun: u64, running: bool, now: Instant, after: Duration) -> bool {
        if running || begun != self.seen {
            // A call ran since the last look: the quiet starts at the earliest now.
            self.seen = begun;
            self.quiet_since = (!running).then_some(now);
            return false;
        }
        let since = *self.quiet_since.get_or_insert(now);
        let due = now.duration_since(since) >= after && begun != self.released;
        if due {
            self.released = begun;
        }
        due
    }
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
        csi_storage::release_free_memory();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_handed_back_once_after_a_busy_spell_when_idle_long_enough() {
        let after = Duration::from_secs(10);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut idle = Idle::default();
        assert!(!idle.look(0, false, at(0), after));
        assert!(
            !idle.look(0, false, at(20), after),
            "a driver that served nothing has nothing to hand back"
        );
        assert!(!idle.look(5, true, at(22), after), "calls under way");
        assert!(
            !idle.look(9, false, at(24), after),
            "calls began since the last look"
        );
        assert!(!idle.look(9, false, at(26), after), "idle for 2 s only");
        assert!(!idle.look(9, false, at(33), after), "idle for 9 s only");
        assert!(idle.look(9, false, at(34), after), "idle for 10 s");
        assert!(!idle.look(9, false, at(36), after), "once per idle spell");
        assert!(!idle.look(9, false, at(90), after), "still once");
        assert!(
            !idle.look(10, false, at(92), after),
            "a call began and ended since the last look"
        );
        assert!(
            !idle.look(10, true, at(100), after),
            "one is under way, though none began"
        );
        assert!(
            !idle.look(10, false, at(102), after),
            "it ended: the quiet starts again"
        );
        assert!(
            idle.look(10, false, at(112), after),
            "idle again long enough"
        );
    }

    #[test]
    fn a_call_counts_as_under_way_until_its_guard_drops() {
        let (before, _) = CALLS.read();
        let guard = busy();
        let (during, running) = CALLS.read();
        assert!(during > before && running);
        drop(guard);
        // Other tests of this binary may run calls meanwhile: only the count is
        // certain.
        assert!(CALLS.read().0 >= during);
    }

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
