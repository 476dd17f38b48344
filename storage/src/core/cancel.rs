//! Cancellation of the work of one RPC.
//!
//! tonic drops a handler's future when the client's deadline (`grpc-timeout`)
//! passes or the client cancels the call or goes away. The domain call that the
//! future started on a blocking thread cannot be dropped like that: it keeps
//! running. So the edge (the glue's `call`) gives every call a [`Token`], trips it
//! when its future is dropped, and the domain looks at it at its safe points:
//!
//! - before the work starts: a call that waited for a blocking thread after its
//!   client left never begins;
//! - while it waits for a heavy-operation slot;
//! - while a filesystem is frozen: the freeze's watchdog thaws it at once, and the
//!   copy made under that freeze is thrown away.
//!
//! At each of them the work returns [`Error::Cancelled`], and the error path that
//! every operation already has undoes what it made (the snapshot's file and
//! record, the new volume, a first stage). Work past its last safe point finishes
//! and commits; a retry then finds it done, as after any lost answer.
//!
//! Until the work has returned it keeps its per-object locks: they are guards held
//! on the blocking thread, not by the dropped future. A retry that arrives while
//! the abandoned work is still unwinding is answered ABORTED, never run beside it.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};

/// How often a wait (for a heavy slot, for a freeze's end) looks at the token: a
/// cancelled call stops within this.
pub(crate) const TICK: Duration = Duration::from_millis(20);

/// Tripped once the caller no longer waits for the answer.
#[derive(Clone, Default, Debug)]
pub struct Token(Arc<AtomicBool>);

thread_local! {
    static CURRENT: RefCell<Option<Token>> = const { RefCell::new(None) };
}

impl Token {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Runs `f` on this thread with this token as the current one.
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        struct Restore(Option<Token>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                CURRENT.with(|c| *c.borrow_mut() = previous);
            }
        }
        let previous = CURRENT.with(|c| c.borrow_mut().replace(self.clone()));
        let _restore = Restore(previous);
        f()
    }
}

/// The token of the call running on this thread; outside any call, one that is
/// never tripped.
pub fn current() -> Token {
    CURRENT.with(|c| c.borrow().clone()).unwrap_or_default()
}

/// A safe point: Cancelled when the caller has gone.
pub fn check() -> Result<()> {
    if current().is_cancelled() {
        return Err(cancelled());
    }
    Ok(())
}

pub(crate) fn cancelled() -> Error {
    Error::Cancelled(
        "the caller cancelled the call or its deadline passed; what the call had begun is undone"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_sees_the_token_of_the_running_call_only() {
        assert!(check().is_ok(), "outside a call nothing is cancelled");
        let t = Token::new();
        t.run(|| assert!(check().is_ok()));
        t.cancel();
        t.run(|| {
            assert!(matches!(check(), Err(Error::Cancelled(_))));
            // A nested call with its own token sees its own.
            Token::new().run(|| assert!(check().is_ok()));
            assert!(check().is_err(), "the outer token is back");
        });
        assert!(check().is_ok(), "the token ends with its call");
    }
}
