//! The state directory. Each domain owns a subdirectory whose records it alone
//! writes, guarded by an owner lock that a second process of the same domain
//! cannot take. What the two domains must agree on (who acts on a volume now,
//! whether the node has it staged, which filesystems a copy keeps frozen) lives
//! in `shared/`, one small file per volume or freeze, and changes only under the
//! volume's lock. All of it goes through the filesystem and `flock`, never
//! through memory, so it holds whether the domains run in one process
//! (`--mode all`) or in two (the central deployment).
//!
//! ```text
//! <state>/controller/owner.lock       held by the one process of the controller domain
//! <state>/controller/volumes/ snapshots/ groups/
//! <state>/node/owner.lock             held by the one process of the node domain
//! <state>/node/staged/ ephemeral/ ephemeral-staging/
//! <state>/shared/locks/<volume-id>    held by whoever acts on the volume right now
//! <state>/shared/locks/.spare-*       files of removed locks, for the next new volumes
//! <state>/shared/staged/<volume-id>   present while the node has the volume staged
//! <state>/shared/frozen/<id>.json     a freeze in progress, naming its owner
//! <state>/format                      the format of all of it (STATE_FORMAT)
//! <state>/format.lock                 held while a new state is marked
//! ```
//!
//! An older layout kept every store at the top (`volumes/`, `node/*.json`, ...);
//! each domain moves its own records once, when it first claims the new layout.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use serde::{Deserialize, Serialize};

use csi_sys::flock::{LockDir, LockFile};
use csi_sys::{dir, file};

use crate::error::{Context, Error, Result};
use crate::ids::VolumeId;

/// The two owners of state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Domain {
    Controller,
    Node,
}

impl Domain {
    pub fn name(self) -> &'static str {
        match self {
            Domain::Controller => "controller",
            Domain::Node => "node",
        }
    }
}

#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
    sweep: Arc<SweepWatch>,
    locks: Arc<LockDir>,
}

/// What the start-up sweep of lock files holds, so that a call finding a lock
/// busy because of the sweep waits the moment it takes, rather than answering
/// ABORTED as it does for another operation.
#[derive(Debug, Default)]
struct SweepWatch {
    state: Mutex<Sweeping>,
    released: Condvar,
}

#[derive(Debug, Default)]
struct Sweeping {
    /// The volume whose lock the sweep holds now.
    now: Option<VolumeId>,
    /// Every volume whose lock it has tried (only volumes found gone).
    tried: BTreeSet<VolumeId>,
    /// Calls waiting now for the sweep to let a lock go.
    waiting: usize,
}

/// The sweep's claim on one volume's lock: released on drop.
struct SweepClaim<'a> {
    watch: &'a SweepWatch,
}

/// A volume's lock the start-up sweep holds. The lock goes before the claim
/// (fields drop in order), so a call waiting on the claim finds the lock free.
pub struct SweptLock<'a> {
    lock: VolumeLock,
    _claim: SweepClaim<'a>,
}

impl SweptLock<'_> {
    pub fn is_staged(&self) -> bool {
        self.lock.is_staged()
    }

    /// Removes the lock file of a volume that is gone.
    pub fn remove(self) -> Result<()> {
        let SweptLock { lock, _claim } = self;
        lock.remove()
    }
}

impl Drop for SweepClaim<'_> {
    fn drop(&mut self) {
        let mut st = self.watch.state.lock().unwrap_or_else(|p| p.into_inner());
        st.now = None;
        self.watch.released.notify_all();
    }
}

/// A domain's claim on its part of the state: held for the life of the process.
#[derive(Debug)]
pub struct OwnerLock {
    _lock: LockFile,
}

/// A freeze in progress: which filesystems, for which volumes, and who froze them
/// (only that domain, or its next start, thaws them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeMarker {
    pub owner: Domain,
    pub pid: u32,
    pub volumes: Vec<VolumeId>,
    pub mountpoints: Vec<PathBuf>,
    /// The freezing process raised the kernel's switch of expedited grace
    /// periods for it: a start after a crash puts the switch back.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expedited: bool,
}

const SHARED: &str = "shared";

/// The format of the state directory this build reads and writes. Raised by
/// a change that earlier builds could not read (and the build that raises it
/// converts the older format); a build refuses to open a state of a later
/// format than its own rather than misread it. Records within a format carry
/// versions of their own (`store`).
pub const STATE_FORMAT: u32 = 1;
const FORMAT_FILE: &str = "format";
/// Held while the format is written.
const FORMAT_LOCK: &str = "format.lock";
const FORMAT_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a start waits for a domain's lock whose recorded holder has ended
/// (see [`LockFile::try_exclusive_after_ended_holder`]): a restart at once after
/// a crash would otherwise find the state locked by nobody.
const ORPHANED_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Refuses a state of a later format than this build's, or one whose format
/// cannot be read; marks a new (or unmarked, older) state with this build's.
fn check_format(root: &Path) -> Result<()> {
    let path = root.join(FORMAT_FILE);
    if refuse_format(root, &path)? {
        return Ok(());
    }
    // Unmarked: the mark is written under a lock, so that the two modes'
    // processes starting at once on a new state do not write it together.
    file::mkdir_p_mode(root, 0o700).context(|| format!("making {}", root.display()))?;
    let lock_path = root.join(FORMAT_LOCK);
    let deadline = std::time::Instant::now() + FORMAT_LOCK_WAIT;
    let _lock = loop {
        if let Some(l) = LockFile::try_exclusive(&lock_path)
            .context(|| format!("locking {}", lock_path.display()))?
        {
            break l;
        }
        if std::time::Instant::now() >= deadline {
            return Err(Error::StateInUse(format!(
                "{} is held by another process for longer than {}s",
                lock_path.display(),
                FORMAT_LOCK_WAIT.as_secs()
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    if refuse_format(root, &path)? {
        return Ok(());
    }
    file::write_atomic(&path, format!("{STATE_FORMAT}\n").as_bytes())
        .context(|| format!("writing {}", path.display()))
}

/// Whether the state is marked with this build's format (true), or not marked
/// (false); an error when it is marked with another this build cannot read.
fn refuse_format(root: &Path, path: &Path) -> Result<bool> {
    let bytes = match file::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.is_not_found() => return Ok(false),
        Err(e) => return Err(e).context(|| format!("reading {}", path.display())),
    };
    let text = String::from_utf8_lossy(&bytes);
    let format = text.trim().parse::<u32>().map_err(|_| {
        Error::StateInUse(format!(
            "{} says {:?}, not a state format this csi-driver ({}) knows: \
             it reads formats up to {STATE_FORMAT}",
            path.display(),
            text.trim(),
            env!("CARGO_PKG_VERSION")
        ))
    })?;
    if format > STATE_FORMAT {
        return Err(Error::StateInUse(format!(
            "the state directory {} is of format {format}, written by a later csi-driver; \
             this one ({}) reads formats up to {STATE_FORMAT} and changes nothing: run \
             the later version, or go back to the state saved before the upgrade",
            root.display(),
            env!("CARGO_PKG_VERSION")
        )));
    }
    Ok(format == STATE_FORMAT)
}

impl StateDir {
    pub fn open(root: &Path) -> Result<StateDir> {
        check_format(root)?;
        let s = StateDir {
            root: root.to_path_buf(),
            sweep: Arc::default(),
            locks: Arc::new(LockDir::open(&root.join(SHARED).join("locks"))),
        };
        for dir in [s.locks.dir().to_path_buf(), s.staged_dir(), s.frozen_dir()] {
            file::mkdir_p_mode(&dir, 0o700).context(|| format!("making {}", dir.display()))?;
        }
        Ok(s)
    }

    /// The directory a domain alone writes.
    pub fn domain(&self, d: Domain) -> PathBuf {
        self.root.join(d.name())
    }

    fn shared(&self) -> PathBuf {
        self.root.join(SHARED)
    }
    fn staged_dir(&self) -> PathBuf {
        self.shared().join("staged")
    }
    /// Where the node plugin takes the controller's changes of staged volumes.
    pub(crate) fn handoff_socket(&self) -> PathBuf {
        self.shared().join("node.sock")
    }
    pub(crate) fn frozen_dir(&self) -> PathBuf {
        self.shared().join("frozen")
    }

    /// Takes a domain's part of the state for this process, or refuses when
    /// another process holds it; then moves the domain's records of the old
    /// layout into place.
    pub fn claim(&self, d: Domain) -> Result<OwnerLock> {
        let dir = self.domain(d);
        file::mkdir_p_mode(&dir, 0o700).context(|| format!("making {}", dir.display()))?;
        let path = dir.join("owner.lock");
        let mut lock = LockFile::try_exclusive_after_ended_holder(&path, ORPHANED_LOCK_WAIT)
            .context(|| format!("locking {}", path.display()))?
            .ok_or_else(|| {
                let holder = LockFile::holder(&path)
                    .map(|h| format!(" ({h})"))
                    .unwrap_or_default();
                Error::StateInUse(format!(
                    "another csi-driver process{holder} serves the {} of state dir {}; \
                     one process per mode and state dir",
                    d.name(),
                    self.root.display()
                ))
            })?;
        lock.set_holder_process(&format!("--mode {}", d.name()))
            .context(|| format!("writing {}", path.display()))?;
        self.migrate(d)?;
        self.remove_interrupted_writes(d);
        Ok(OwnerLock { _lock: lock })
    }

    /// Removes the temporary files of shared marks whose write a crash cut short:
    /// only in the folder whose marks this domain alone writes (the node its staged
    /// marks, the controller its freeze markers), so a write of the other process
    /// is never cut.
    fn remove_interrupted_writes(&self, d: Domain) {
        let dir = match d {
            Domain::Node => self.staged_dir(),
            Domain::Controller => self.frozen_dir(),
        };
        for entry in dir::list(&dir).unwrap_or_default() {
            if entry.is_hidden() && entry.name.ends_with(".tmp") {
                let _ = file::remove_file_if_exists(&entry.path);
                tracing::info!(path = %entry.path.display(), "removed an interrupted mark write");
            }
        }
    }

    /// Takes a volume's lock, for the time of one operation; ABORTED when another
    /// operation, in this process or the other, holds it.
    pub fn lock_volume(&self, id: VolumeId) -> Result<VolumeLock> {
        if let Some(lock) = self.try_lock_volume(id)? {
            return Ok(lock);
        }
        if self.wait_for_sweep(id) {
            if let Some(lock) = self.try_lock_volume(id)? {
                return Ok(lock);
            }
        }
        Err(Error::Aborted(format!(
            "an operation on volume {id} is already in progress; retry later"
        )))
    }

    fn try_lock_volume(&self, id: VolumeId) -> Result<Option<VolumeLock>> {
        let lock = self
            .locks
            .try_exclusive(&id.to_string())
            .context(|| format!("locking volume {id}"))?;
        Ok(lock.map(|lock| VolumeLock {
            lock,
            dir: self.locks.clone(),
            staged: self.staged_dir().join(id.to_string()),
        }))
    }

    /// The start-up sweep's try of a gone volume's lock (None: an operation
    /// holds it). A call that meets the lock meanwhile waits for the claim's end.
    pub(crate) fn sweep_lock_volume(&self, id: VolumeId) -> Result<Option<SweptLock<'_>>> {
        {
            let mut st = self.sweep.state.lock().unwrap_or_else(|p| p.into_inner());
            st.now = Some(id);
            st.tried.insert(id);
        }
        let claim = SweepClaim { watch: &self.sweep };
        Ok(self.try_lock_volume(id)?.map(|lock| SweptLock {
            lock,
            _claim: claim,
        }))
    }

    /// Whether the sweep may have been what held `id`'s lock; waits (briefly:
    /// the sweep holds a lock for a check and an unlink) until it lets it go.
    fn wait_for_sweep(&self, id: VolumeId) -> bool {
        let mut st = self.sweep.state.lock().unwrap_or_else(|p| p.into_inner());
        if !st.tried.contains(&id) {
            return false;
        }
        st.waiting += 1;
        let (mut st, _) = self
            .sweep
            .released
            .wait_timeout_while(st, std::time::Duration::from_secs(1), |st| {
                st.now == Some(id)
            })
            .unwrap_or_else(|p| p.into_inner());
        st.waiting -= 1;
        true
    }

    /// How many calls wait now for the sweep to let a lock go (for the tests that
    /// order a call against the sweep).
    #[cfg(test)]
    pub(crate) fn sweep_waiters(&self) -> usize {
        self.sweep
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiting
    }

    /// Whether `d`'s state was last looked over for what a power loss takes
    /// during boot `boot_id`, the one running: then no power loss came since,
    /// and whatever the state's files say was written is there, synced or not.
    pub fn looked_over_in(&self, d: Domain, boot_id: &str) -> bool {
        file::read_to_string(&self.boot_mark(d)).is_ok_and(|b| b == boot_id)
    }

    /// Notes that `d`'s state was looked over during boot `boot_id`.
    pub fn note_looked_over_in(&self, d: Domain, boot_id: &str) -> Result<()> {
        let path = self.boot_mark(d);
        file::write_atomic(&path, boot_id.as_bytes())
            .context(|| format!("writing {}", path.display()))
    }

    fn boot_mark(&self, d: Domain) -> PathBuf {
        self.domain(d).join("looked-over-in-boot")
    }

    /// Ids with a lock file (for the sweep of locks of volumes that are gone).
    pub fn locked_ids(&self) -> Vec<VolumeId> {
        match self.locks.list() {
            Ok(names) => names.iter().filter_map(|n| VolumeId::parse(n)).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "could not list the volume locks");
                Vec::new()
            }
        }
    }

    /// Ids the node has staged.
    pub fn staged_ids(&self) -> Vec<VolumeId> {
        list_ids(&self.staged_dir())
    }

    /// Every freeze marker, with its path. An unreadable one (only a power loss,
    /// which also ended its freeze, leaves one: see [`Self::write_freeze_marker`])
    /// is passed over.
    pub fn freeze_markers(&self) -> Vec<(PathBuf, FreezeMarker)> {
        self.read_freeze_markers().0
    }

    /// The freeze markers, and apart the paths of the unreadable ones.
    pub(crate) fn read_freeze_markers(&self) -> (Vec<(PathBuf, FreezeMarker)>, Vec<PathBuf>) {
        let (mut out, mut unreadable) = (Vec::new(), Vec::new());
        let Ok(entries) = dir::list(&self.frozen_dir()) else {
            return (out, unreadable);
        };
        for entry in entries {
            if entry.is_hidden() {
                continue;
            }
            let path = entry.path;
            match file::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
            {
                Some(m) => out.push((path, m)),
                None => unreadable.push(path),
            }
        }
        (out, unreadable)
    }

    /// A freeze of `id` in progress, or left by a process that died frozen.
    pub fn freeze_of(&self, id: VolumeId) -> Option<FreezeMarker> {
        self.freeze_markers()
            .into_iter()
            .map(|(_, m)| m)
            .find(|m| m.volumes.contains(&id))
    }

    /// Moves a domain's records of the old layout (every store at the top of the
    /// state dir) into its own directory.
    fn migrate(&self, d: Domain) -> Result<()> {
        let own = self.domain(d);
        match d {
            Domain::Controller => {
                for name in ["volumes", "snapshots", "groups"] {
                    move_dir(&self.root.join(name), &own.join(name))?;
                }
                self.migrate_freeze_markers()?;
            }
            Domain::Node => {
                // The old node records lay directly in <state>/node, now the domain's
                // own directory.
                let staged = own.join("staged");
                for entry in dir::list(&own).unwrap_or_default() {
                    let name = entry.name;
                    if name.ends_with(".json") || name.ends_with(".corrupt") {
                        file::mkdir_p_mode(&staged, 0o700)
                            .context(|| format!("making {}", staged.display()))?;
                        rename(&entry.path, &staged.join(&name))?;
                    }
                }
                for name in ["ephemeral", "ephemeral-staging"] {
                    move_dir(&self.root.join(name), &own.join(name))?;
                }
            }
        }
        Ok(())
    }

    /// Markers of the old layout listed only mount points: they were the
    /// controller's (only copies freeze), and become its markers.
    fn migrate_freeze_markers(&self) -> Result<()> {
        let old = self.root.join("frozen");
        let Ok(entries) = dir::list(&old) else {
            return Ok(());
        };
        for entry in entries {
            let (path, name) = (entry.path, entry.name);
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            let mountpoints: Vec<PathBuf> = file::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            let marker = FreezeMarker {
                owner: Domain::Controller,
                pid: 0,
                volumes: VolumeId::parse(stem).into_iter().collect(),
                mountpoints,
                expedited: false,
            };
            self.write_freeze_marker(&self.frozen_dir().join(&name), &marker)?;
            let _ = file::remove_file_if_exists(&path);
        }
        let _ = dir::remove_empty_dir(&old);
        Ok(())
    }

    /// A freeze lasts no longer than the running kernel, so its marker is not
    /// synced: a process started after a crash finds it whole (it is renamed into
    /// place), and after a power loss, which ended the freeze, it may be missing
    /// or unreadable ([`StateDir::freeze_markers`] leaves those to the
    /// controller's start, which removes them).
    pub(crate) fn write_freeze_marker(&self, path: &Path, m: &FreezeMarker) -> Result<()> {
        let body = serde_json::to_vec(m).unwrap_or_default();
        file::write_atomic_unsynced(path, &body).context(|| "writing the freeze marker".into())
    }
}

/// One volume's lock. While it is held, whether the node has the volume staged
/// can be read and changed without a race.
#[derive(Debug)]
pub struct VolumeLock {
    lock: LockFile,
    dir: Arc<LockDir>,
    staged: PathBuf,
}

impl VolumeLock {
    pub fn is_staged(&self) -> bool {
        dir::exists(&self.staged)
    }

    /// Records that the node has (or no longer has) the volume staged.
    pub fn set_staged(&self, staged: bool) -> Result<()> {
        let at = || format!("marking {} staged={staged}", self.staged.display());
        if staged {
            if !dir::exists(&self.staged) {
                return file::write_atomic(&self.staged, b"").context(at);
            }
        } else {
            file::remove_file_if_exists(&self.staged).context(at)?;
        }
        // Also when there was nothing to change: an earlier attempt that died
        // before its sync may have made the change.
        if let Some(dir) = self.staged.parent() {
            file::fsync_dir(dir).context(at)?;
        }
        Ok(())
    }

    /// Removes the lock file of a volume that is gone.
    pub fn remove(self) -> Result<()> {
        let path = self.lock.path().to_path_buf();
        self.dir
            .remove(self.lock)
            .context(|| format!("removing {}", path.display()))
    }
}

fn list_ids(folder: &Path) -> Vec<VolumeId> {
    dir::list(folder)
        .unwrap_or_default()
        .iter()
        .filter_map(|e| VolumeId::parse(&e.name))
        .collect()
}

/// Moves a record of the old layout, durably: a power loss must not bring it
/// back beside its moved copy.
fn rename(from: &Path, to: &Path) -> Result<()> {
    dir::rename_durably(from, to)
        .context(|| format!("moving {} to {}", from.display(), to.display()))
}

/// Moves a directory of the old layout to its new place: whole when the new one
/// does not exist yet, else entry by entry.
fn move_dir(old: &Path, new: &Path) -> Result<()> {
    if !dir::is_dir(old) {
        return Ok(());
    }
    tracing::info!(from = %old.display(), to = %new.display(), "moving records of the old state layout");
    if !dir::exists(new) {
        rename(old, new)?;
    } else {
        for entry in dir::list(old).unwrap_or_default() {
            let to = new.join(&entry.name);
            if !dir::exists(&to) {
                rename(&entry.path, &to)?;
            }
        }
        let _ = dir::remove_empty_dir(old);
    }
    for dir in [old.parent(), new.parent()].into_iter().flatten() {
        file::fsync_dir(dir).context(|| format!("syncing {}", dir.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The format a state's format file says, if it can be read.
    fn read_format(path: &Path) -> Option<u32> {
        let bytes = file::read(path).ok()?;
        String::from_utf8_lossy(&bytes).trim().parse().ok()
    }

    #[test]
    fn a_state_of_a_later_format_is_refused_and_left_as_it_is() {
        let tmp = tempfile::tempdir().unwrap();
        StateDir::open(tmp.path()).unwrap();
        let format = tmp.path().join(FORMAT_FILE);
        assert_eq!(
            std::fs::read_to_string(&format).unwrap(),
            format!("{STATE_FORMAT}\n")
        );
        StateDir::open(tmp.path()).expect("its own format opens again");

        for later in [format!("{}\n", STATE_FORMAT + 1), "two\n".to_string()] {
            let other = tempfile::tempdir().unwrap();
            let path = other.path().join(FORMAT_FILE);
            std::fs::write(&path, &later).unwrap();
            let e = StateDir::open(other.path()).unwrap_err();
            assert!(matches!(e, Error::StateInUse(_)), "{e}");
            assert!(
                e.to_string().contains(&format!("up to {STATE_FORMAT}")),
                "{e}"
            );
            assert_eq!(std::fs::read_to_string(&path).unwrap(), later);
            let made: Vec<_> = std::fs::read_dir(other.path()).unwrap().flatten().collect();
            assert_eq!(made.len(), 1, "nothing but the format file: {made:?}");
        }

        // A state made before formats were written gets this build's.
        let unmarked = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(unmarked.path().join("controller")).unwrap();
        StateDir::open(unmarked.path()).unwrap();
        assert!(unmarked.path().join(FORMAT_FILE).exists());
    }

    #[test]
    fn processes_starting_together_on_a_new_state_agree_on_its_format() {
        for _ in 0..20 {
            let tmp = tempfile::tempdir().unwrap();
            let root = tmp.path().join("state");
            let opened: Vec<_> = (0..4)
                .map(|_| {
                    let root = root.clone();
                    std::thread::spawn(move || StateDir::open(&root).map(drop))
                })
                .collect();
            for t in opened {
                t.join()
                    .unwrap()
                    .expect("every process opens the new state");
            }
            assert_eq!(read_format(&root.join(FORMAT_FILE)), Some(STATE_FORMAT));
        }
    }

    #[test]
    fn a_domain_is_claimed_once() {
        let tmp = tempfile::tempdir().unwrap();
        let s = StateDir::open(tmp.path()).unwrap();
        let c = s.claim(Domain::Controller).unwrap();
        let n = s.claim(Domain::Node).expect("the other domain is free");
        let again = s.claim(Domain::Controller).unwrap_err();
        assert!(matches!(again, Error::StateInUse(_)), "{again}");
        assert!(again.to_string().contains("--mode controller"), "{again}");
        drop(c);
        drop(n);
        s.claim(Domain::Controller).expect("free again once let go");
    }

    #[test]
    fn a_volume_lock_excludes_and_carries_the_staged_mark() {
        let tmp = tempfile::tempdir().unwrap();
        let s = StateDir::open(tmp.path()).unwrap();
        let id = VolumeId::for_name("v");
        let l = s.lock_volume(id).unwrap();
        assert!(matches!(s.lock_volume(id), Err(Error::Aborted(_))));
        assert!(!l.is_staged());
        l.set_staged(true).unwrap();
        drop(l);
        let l = s.lock_volume(id).unwrap();
        assert!(l.is_staged());
        assert_eq!(s.staged_ids(), vec![id]);
        l.set_staged(false).unwrap();
        l.remove().unwrap();
        assert!(s.locked_ids().is_empty() && s.staged_ids().is_empty());
    }

    #[test]
    fn old_layout_records_move_to_their_domain() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let id = VolumeId::for_name("v");
        std::fs::create_dir_all(root.join("volumes")).unwrap();
        std::fs::write(root.join("volumes").join(format!("{id}.json")), "{}").unwrap();
        std::fs::create_dir_all(root.join("node")).unwrap();
        std::fs::write(root.join("node").join(format!("{id}.json")), "{}").unwrap();
        std::fs::create_dir_all(root.join("frozen")).unwrap();
        std::fs::write(
            root.join("frozen").join(format!("{id}.json")),
            "[\"/mnt/x\"]",
        )
        .unwrap();
        let s = StateDir::open(root).unwrap();
        let _c = s.claim(Domain::Controller).unwrap();
        let _n = s.claim(Domain::Node).unwrap();
        assert!(root.join(format!("controller/volumes/{id}.json")).is_file());
        assert!(!root.join("volumes").exists());
        assert!(root.join(format!("node/staged/{id}.json")).is_file());
        assert!(!root.join(format!("node/{id}.json")).exists());
        let m = s
            .freeze_of(id)
            .expect("the old marker, now the controller's");
        assert_eq!(m.owner, Domain::Controller);
        assert_eq!(m.mountpoints, vec![PathBuf::from("/mnt/x")]);
    }

    #[test]
    fn each_moved_record_of_the_old_layout_is_synced_in_both_folders() {
        use csi_sys::fsrecord::{FsOp, Recording};
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let id = VolumeId::for_name("v");
        std::fs::create_dir_all(root.join("node")).unwrap();
        std::fs::write(root.join("node").join(format!("{id}.json")), "{}").unwrap();
        let rec = Recording::start(root);
        let s = StateDir::open(root).unwrap();
        let _n = s.claim(Domain::Node).unwrap();
        let ops = rec.ops();
        let (from, to) = (
            root.join(format!("node/{id}.json")),
            root.join(format!("node/staged/{id}.json")),
        );
        let at = ops
            .iter()
            .position(|op| {
                *op == FsOp::Rename {
                    from: from.clone(),
                    to: to.clone(),
                }
            })
            .unwrap_or_else(|| panic!("the move is recorded: {ops:?}"));
        // A power loss must neither bring the record back in its old place nor
        // take it from both.
        assert_eq!(
            ops[at + 1..at + 3],
            [
                FsOp::Fsync {
                    path: root.join("node/staged")
                },
                FsOp::Fsync {
                    path: root.join("node")
                }
            ]
        );
    }
}
