//! Per-object locks. A second call for an object while one is running gets ABORTED
//! at once, as the CSI spec allows, rather than queueing behind it; calls for
//! different objects never wait for each other. Readers of an object that does not
//! change (a snapshot being restored) share it, so many volumes can be restored from
//! one snapshot at once, while a delete of that snapshot waits its turn.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::ids::{GroupSnapshotId, SnapshotId, VolumeId};

/// What a lock is taken on: one object of one kind. The controller's hold of a
/// volume and the node's are kept apart: the two domains act on a volume
/// independently (the controller's cross-process hold is the state dir's
/// volume lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LockKey {
    /// A group snapshot.
    Group(GroupSnapshotId),
    /// A volume as the node stages, publishes or expands it.
    Node(VolumeId),
    Snapshot(SnapshotId),
    /// A volume as the controller creates, changes or deletes it.
    Volume(VolumeId),
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockKey::Group(id) => write!(f, "group:{id}"),
            LockKey::Node(id) => write!(f, "node:{id}"),
            LockKey::Snapshot(id) => write!(f, "snapshot:{id}"),
            LockKey::Volume(id) => write!(f, "volume:{id}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Exclusive,
    Shared(usize),
}

type Table = Arc<Mutex<HashMap<LockKey, Hold>>>;

#[derive(Default, Clone)]
pub struct Locks {
    held: Table,
}

#[must_use]
pub struct Guard {
    held: Table,
    keys: Vec<(LockKey, bool)>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        for (k, shared) in &self.keys {
            match (held.get(k).copied(), shared) {
                (Some(Hold::Shared(n)), true) if n > 1 => {
                    held.insert(*k, Hold::Shared(n - 1));
                }
                _ => {
                    held.remove(k);
                }
            }
        }
    }
}

impl Locks {
    /// Takes every key exclusively, or none: ABORTED naming the first busy key.
    pub fn try_lock(&self, keys: impl IntoIterator<Item = LockKey>) -> Result<Guard> {
        self.try_lock_with(keys, [])
    }

    /// Takes `exclusive` keys alone and `shared` keys alongside other sharers; all or
    /// none.
    pub fn try_lock_with(
        &self,
        exclusive: impl IntoIterator<Item = LockKey>,
        shared: impl IntoIterator<Item = LockKey>,
    ) -> Result<Guard> {
        let mut keys: Vec<(LockKey, bool)> = exclusive
            .into_iter()
            .map(|k| (k, false))
            .chain(shared.into_iter().map(|k| (k, true)))
            .collect();
        keys.sort();
        keys.dedup_by(|a, b| a.0 == b.0);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let busy = keys.iter().find(|(k, shared)| match held.get(k) {
            None => false,
            Some(Hold::Shared(_)) => !shared,
            Some(Hold::Exclusive) => true,
        });
        if let Some((busy, _)) = busy {
            return Err(Error::Aborted(format!(
                "an operation on {busy} is already in progress; retry later"
            )));
        }
        for (k, shared) in &keys {
            let next = match (held.get(k), shared) {
                (Some(Hold::Shared(n)), true) => Hold::Shared(n + 1),
                (_, true) => Hold::Shared(1),
                (_, false) => Hold::Exclusive,
            };
            held.insert(*k, next);
        }
        Ok(Guard {
            held: self.held.clone(),
            keys,
        })
    }

    #[cfg(test)]
    pub fn is_held(&self, key: LockKey) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(name: &str) -> LockKey {
        LockKey::Volume(VolumeId::for_name(name))
    }

    fn snap(name: &str) -> LockKey {
        LockKey::Snapshot(SnapshotId::for_name(name))
    }

    #[test]
    fn second_caller_is_aborted_and_release_frees() {
        let locks = Locks::default();
        let g = locks.try_lock([vol("a")]).unwrap();
        assert!(matches!(locks.try_lock([vol("a")]), Err(Error::Aborted(_))));
        assert!(locks.try_lock([vol("b")]).is_ok());
        // all-or-nothing: a set with one busy key takes none of them
        assert!(locks.try_lock([vol("c"), vol("a")]).is_err());
        assert!(!locks.is_held(vol("c")));
        drop(g);
        assert!(locks.try_lock([vol("a")]).is_ok());
    }

    #[test]
    fn sharers_coexist_and_keep_writers_out() {
        let locks = Locks::default();
        let none: [LockKey; 0] = [];
        let r1 = locks.try_lock_with([vol("x")], [snap("s")]).unwrap();
        let r2 = locks.try_lock_with([vol("y")], [snap("s")]).unwrap();
        assert!(
            locks.try_lock([snap("s")]).is_err(),
            "a writer waits for readers"
        );
        drop(r1);
        assert!(
            locks.try_lock([snap("s")]).is_err(),
            "one reader is still there"
        );
        drop(r2);
        let w = locks.try_lock([snap("s")]).unwrap();
        assert!(
            locks.try_lock_with(none, [snap("s")]).is_err(),
            "a reader waits for the writer"
        );
        drop(w);
        assert!(!locks.is_held(snap("s")));
    }

    #[test]
    fn the_node_and_the_controller_hold_a_volume_apart_and_a_refusal_names_the_key() {
        let locks = Locks::default();
        let id = VolumeId::for_name("v");
        let _controller = locks.try_lock([LockKey::Volume(id)]).unwrap();
        let _node = locks
            .try_lock([LockKey::Node(id)])
            .expect("another kind of key");
        let e = locks.try_lock([LockKey::Node(id)]).err().unwrap();
        assert!(e.to_string().contains(&format!("node:{id}")), "{e}");
    }
}
