//! Per-object locks. A second call for an object while one is running gets ABORTED
//! at once, as the CSI spec allows, rather than queueing behind it; calls for
//! different objects never wait for each other.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

#[derive(Default, Clone)]
pub struct Locks {
    held: Arc<Mutex<HashSet<String>>>,
}

#[must_use]
pub struct Guard {
    held: Arc<Mutex<HashSet<String>>>,
    keys: Vec<String>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        for k in &self.keys {
            held.remove(k);
        }
    }
}

impl Locks {
    /// Takes every key or none: ABORTED naming the first key that is busy.
    pub fn try_lock<I, S>(&self, keys: I) -> Result<Guard>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut keys: Vec<String> = keys.into_iter().map(Into::into).collect();
        keys.sort();
        keys.dedup();
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(busy) = keys.iter().find(|k| held.contains(*k)) {
            return Err(Error::Aborted(format!(
                "an operation on {busy} is already in progress; retry later"
            )));
        }
        for k in &keys {
            held.insert(k.clone());
        }
        Ok(Guard {
            held: self.held.clone(),
            keys,
        })
    }

    #[cfg(test)]
    pub fn is_held(&self, key: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_caller_is_aborted_and_release_frees() {
        let locks = Locks::default();
        let g = locks.try_lock(["vol:a"]).unwrap();
        assert!(matches!(locks.try_lock(["vol:a"]), Err(Error::Aborted(_))));
        assert!(locks.try_lock(["vol:b"]).is_ok());
        // all-or-nothing: a set with one busy key takes none of them
        assert!(locks.try_lock(["vol:c", "vol:a"]).is_err());
        assert!(!locks.is_held("vol:c"));
        drop(g);
        assert!(locks.try_lock(["vol:a"]).is_ok());
    }
}
