//! Expedited RCU grace periods for the length of a filesystem freeze.
//!
//! FIFREEZE waits for three RCU grace periods, one per level of the superblock's
//! writers (`freeze_super`: write, page fault, filesystem). A normal grace period
//! lasts several milliseconds on a kernel with a low tick rate and lazy RCU (about
//! 8 ms each on a 250 Hz kernel), so an idle filesystem takes 20–30 ms to freeze
//! whatever its size. Expedited, a grace period ends well within a millisecond,
//! at the price of an interrupt to every CPU.
//!
//! The kernel's switch, `/sys/kernel/rcu_expedited`, is global. An [`Expediter`]
//! raises it only when it reads 0 (a 1 is someone else's and is left alone), keeps
//! it raised while any freeze of the process needs it, and puts it back to 0 when
//! the last one ends. What raised it and crashed before putting it back is
//! undone by [`Expediter::put_back`] at the next start (the freeze's marker says so).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// The kernel's switch.
pub const KNOB: &str = "/sys/kernel/rcu_expedited";

/// The switch as read: Some(true) raised, Some(false) normal, None unreadable.
fn read(knob: &Path) -> Option<bool> {
    let text = std::fs::read_to_string(knob).ok()?;
    text.trim().parse::<i64>().ok().map(|n| n != 0)
}

fn write(knob: &Path, on: bool) -> std::io::Result<()> {
    std::fs::write(knob, if on { "1" } else { "0" })
}

#[derive(Debug, Default)]
struct State {
    /// Freezes in the window now.
    holders: usize,
    /// The switch read 0 when the window opened: it is this process's to raise.
    ours: bool,
    /// Raised by this process and not yet put back.
    raised: bool,
    /// A failure to write the switch was logged already (once is enough).
    warned: bool,
}

/// Raises the switch for the freezes of one process; see the module's comment.
#[derive(Debug)]
pub struct Expediter {
    knob: PathBuf,
    enabled: bool,
    state: Mutex<State>,
}

impl Expediter {
    /// An expediter of `knob` ([`KNOB`] outside tests); when not `enabled` it
    /// never touches it.
    pub fn new(knob: &Path, enabled: bool) -> Self {
        Expediter {
            knob: knob.to_path_buf(),
            enabled,
            state: Mutex::new(State::default()),
        }
    }

    /// Puts the switch back to 0 after a crash of a process that had raised it
    /// (nothing when it reads 0 already), enabled or not. Whether it was written.
    pub fn put_back(&self) -> bool {
        read(&self.knob) == Some(true) && write(&self.knob, false).is_ok()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins the window; the switch is not raised yet ([`Window::raise`]), so
    /// that the caller can first record that it will be ([`Window::raises`]).
    pub fn join(&self) -> Window<'_> {
        if !self.enabled {
            return Window { exp: None };
        }
        let mut st = self.lock();
        if st.holders == 0 {
            st.ours = read(&self.knob) == Some(false);
        }
        st.holders += 1;
        Window { exp: Some(self) }
    }

    fn fail(&self, st: &mut State, what: &str, e: std::io::Error) {
        if !st.warned {
            st.warned = true;
            tracing::warn!(knob = %self.knob.display(), error = %e,
                "{what} the kernel's expedited grace periods failed; freezes take their normal time");
        }
    }
}

/// One freeze's part of the expedited window; leaving it (drop) puts the switch
/// back when it is the last.
#[derive(Debug)]
pub struct Window<'a> {
    exp: Option<&'a Expediter>,
}

impl Window<'_> {
    /// Whether the switch is this process's to raise (and so to put back).
    pub fn raises(&self) -> bool {
        self.exp.is_some_and(|e| e.lock().ours)
    }

    /// Raises the switch unless it is up already or not this process's.
    pub fn raise(&self) {
        let Some(e) = self.exp else { return };
        let mut st = e.lock();
        if !st.ours || st.raised {
            return;
        }
        match write(&e.knob, true) {
            Ok(()) => st.raised = true,
            Err(err) => {
                st.ours = false;
                e.fail(&mut st, "raising", err);
            }
        }
    }
}

impl Drop for Window<'_> {
    fn drop(&mut self) {
        let Some(e) = self.exp else { return };
        let mut st = e.lock();
        st.holders -= 1;
        if st.holders > 0 || !st.raised {
            return;
        }
        st.raised = false;
        if let Err(err) = write(&e.knob, false) {
            e.fail(&mut st, "putting back", err);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn knob(value: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rcu_expedited");
        std::fs::write(&path, value).unwrap();
        (dir, path)
    }

    fn value(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap().trim().to_string()
    }

    #[test]
    fn a_window_raises_the_switch_and_the_last_one_out_puts_it_back() {
        let (_d, path) = knob("0\n");
        let e = Expediter::new(&path, true);
        let a = e.join();
        assert!(a.raises());
        assert_eq!(value(&path), "0", "joining alone changes nothing");
        a.raise();
        assert_eq!(value(&path), "1");
        let b = e.join();
        assert!(b.raises(), "a second freeze shares the raised switch");
        b.raise();
        drop(a);
        assert_eq!(value(&path), "1", "still held by the second freeze");
        drop(b);
        assert_eq!(value(&path), "0");
        // A window after that raises it again.
        let c = e.join();
        c.raise();
        assert_eq!(value(&path), "1");
        drop(c);
        assert_eq!(value(&path), "0");
    }

    #[test]
    fn a_switch_raised_by_someone_else_is_left_alone() {
        let (_d, path) = knob("1\n");
        let e = Expediter::new(&path, true);
        let w = e.join();
        assert!(!w.raises());
        w.raise();
        drop(w);
        assert_eq!(value(&path), "1");
    }

    #[test]
    fn a_disabled_expediter_touches_nothing() {
        let (_d, path) = knob("0\n");
        let e = Expediter::new(&path, false);
        let w = e.join();
        assert!(!w.raises());
        w.raise();
        assert_eq!(value(&path), "0");
        drop(w);
        assert_eq!(value(&path), "0");
    }

    #[test]
    fn an_unwritable_or_missing_switch_is_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none");
        let e = Expediter::new(&missing, true);
        let w = e.join();
        assert!(!w.raises(), "an unreadable switch is not ours");
        w.raise();
        drop(w);
        assert!(!missing.exists());
        // Read as 0, then not writable (a directory in its place): given up on.
        let (_d, path) = knob("0");
        let e = Expediter::new(&path, true);
        let w = e.join();
        assert!(w.raises());
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        w.raise();
        assert!(
            !w.raises(),
            "a switch that cannot be raised is not ours to put back"
        );
        drop(w);
        assert!(path.is_dir());
    }

    #[test]
    fn put_back_lowers_a_raised_switch_only() {
        let (_d, path) = knob("1");
        let e = Expediter::new(&path, false);
        assert!(e.put_back());
        assert_eq!(value(&path), "0");
        assert!(!e.put_back());
        assert_eq!(value(&path), "0");
    }
}
