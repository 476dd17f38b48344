//! Filesystem templates: a formatted image per (filesystem, size, mkfs options)
//! in a hidden folder of each pool that can reflink, so that a new image volume
//! gets its filesystem as a reflink of one, with its own UUID, instead of a mkfs
//! at its first stage (mkfs is most of a first stage's time). CreateVolume only
//! marks the new image; its first stage makes the reflink (see `core::fresh`).
//!
//! ```text
//! <pool>/.templates/<fs>-<size>-f<format>.img    a finished template
//! <pool>/.templates/.<name>.tmp                  one being made; removed at start
//! ```
//!
//! A template is made off the caller's path, by one background thread, the first
//! time a volume of its filesystem and size is asked for (a volume whose first
//! stage comes before the template is formatted, as without templates); it is
//! made under its temporary name, fsynced, renamed and its folder fsynced, so a
//! finished name always holds a whole template. At start the temporary files are
//! removed and each template is checked; one that fails is removed, never
//! reflinked. At most [`PER_POOL`] templates are kept per pool (the least
//! recently used goes), none is made in a pool without room for the volume it
//! serves, and all of a pool's go when a volume needs their space. Their space is
//! the pool's, so GetCapacity (statvfs) counts it as used.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use csi_sys::fresh::{self as sysfresh, TEMPLATE_FORMAT};
use csi_sys::{dir, file};

use crate::error::{Context, Result};
use crate::failpoint;
use crate::fresh;
use crate::pool::Pool;

/// Templates kept per pool.
pub const PER_POOL: usize = 4;

/// Requests waiting for the worker; more are dropped (the next create asks again).
const QUEUE: usize = 8;

/// One template to make: in which folder, of which filesystem and size.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Job {
    dir: PathBuf,
    fs_type: String,
    size: u64,
    /// How long its mkfs may run.
    timeout: Duration,
}

#[derive(Default)]
pub(crate) struct Templates {
    queue: Mutex<Option<SyncSender<Job>>>,
    /// Jobs queued or being made, so one template is asked for once.
    pending: Arc<Mutex<BTreeSet<Job>>>,
}

pub use crate::fresh::templates_dir;
use crate::fresh::{file_name, serves, template_path};

impl Templates {
    /// Makes the new image `dst` of a volume of `fs_type` and `size` from the
    /// matching template, with its own UUID and the fresh mark. False when there is
    /// none (then one is asked for, and the caller makes a blank image) or it could
    /// not be used (then it is removed, to be made again).
    /// `attrs` are written on the copy within the same sync; `timeout` bounds
    /// the mkfs of a template asked for.
    pub(crate) fn fill(
        &self,
        pool: &Pool,
        (fs_type, size): (&str, u64),
        dst: &Path,
        attrs: &[(String, Vec<u8>)],
        timeout: Duration,
    ) -> bool {
        let Some(template) = self.lookup(pool, fs_type, size, timeout) else {
            return false;
        };
        let uuid = *uuid::Uuid::new_v4().as_bytes();
        let (name, value) = fresh::mark(fs_type, uuid);
        let all: Vec<(&str, &[u8])> = std::iter::once((name.as_str(), value.as_slice()))
            .chain(attrs.iter().map(|(n, v)| (n.as_str(), v.as_slice())))
            .collect();
        match sysfresh::clone_template(&template, dst, fs_type, uuid, &all) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(template = %template.display(), error = %e,
                    "template not usable; removed, the volume is made blank");
                let _ = file::remove_file_if_exists(&template);
                false
            }
        }
    }

    /// Asks for the template of `fs_type` and `size` in `pool` when templates
    /// serve them and there is none yet, so that first stages find it. Never waits.
    pub(crate) fn want(&self, pool: &Pool, fs_type: &str, size: u64, timeout: Duration) {
        self.lookup(pool, fs_type, size, timeout);
    }

    /// The finished template of `fs_type` and `size` in `pool`; None when
    /// templates do not serve them or there is none yet (then it is asked for).
    fn lookup(&self, pool: &Pool, fs_type: &str, size: u64, timeout: Duration) -> Option<PathBuf> {
        if !serves(pool, fs_type) {
            return None;
        }
        let template = template_path(pool, fs_type, size);
        if dir::is_file(&template) {
            return Some(template);
        }
        self.request(Job {
            dir: templates_dir(pool),
            fs_type: fs_type.to_string(),
            size,
            timeout,
        });
        None
    }

    /// The pool's free and total bytes; when `size` does not fit in what is free,
    /// the pool's templates are removed first, as a volume comes before them
    /// (not for a size the pool could never hold: that request is refused).
    pub(crate) fn space_for(&self, pool: &Pool, size: u64) -> Result<(u64, u64)> {
        let (available, total) = pool.space()?;
        if size <= available || size > total || list(&templates_dir(pool)).is_empty() {
            return Ok((available, total));
        }
        for (path, _) in list(&templates_dir(pool)) {
            tracing::info!(template = %path.display(), "removing a template: the pool is full");
            file::remove_file_if_exists(&path)
                .context(|| format!("removing template {}", path.display()))?;
        }
        pool.space()
    }

    /// Start-up: removes what a crash left half-made and any template that is
    /// not whole, of another format, or of an unknown name.
    pub(crate) fn recover(&self, pool: &Pool) {
        let Ok(entries) = dir::list(&templates_dir(pool)) else {
            return;
        };
        for entry in entries {
            let hidden = entry.is_hidden();
            let (name, path) = (entry.name, entry.path);
            let why = if hidden {
                Some("left half-made".to_string())
            } else {
                match parse_name(&name) {
                    None => Some("not a template of this version".into()),
                    Some((fs_type, size)) => {
                        let len = file::file_len(&path).unwrap_or(0);
                        sysfresh::check_template(&path, &fs_type)
                            .err()
                            .map(|e| e.to_string())
                            .or_else(|| (len != size).then(|| format!("{len} bytes, not {size}")))
                    }
                }
            };
            if let Some(why) = why {
                tracing::warn!(template = %path.display(), why, "removing a template");
                if let Err(e) = crate::data::remove_data(&path) {
                    tracing::warn!(template = %path.display(), error = %e,
                        "could not remove a template");
                }
            }
        }
    }

    /// Queues a template, starting the worker the first time. Never waits.
    fn request(&self, job: Job) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.contains(&job) {
            return;
        }
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let tx = queue.get_or_insert_with(|| spawn_worker(self.pending.clone()));
        match tx.try_send(job.clone()) {
            Ok(()) => {
                pending.insert(job);
            }
            Err(TrySendError::Full(_)) => {}
            Err(TrySendError::Disconnected(_)) => *queue = None,
        }
    }
}

fn spawn_worker(pending: Arc<Mutex<BTreeSet<Job>>>) -> SyncSender<Job> {
    let (tx, rx) = sync_channel::<Job>(QUEUE);
    let spawned = std::thread::Builder::new()
        .name("templates".into())
        .spawn(move || {
            for job in rx {
                if let Err(e) = make(&job) {
                    tracing::warn!(dir = %job.dir.display(), fs = %job.fs_type, size = job.size,
                        error = %e, "could not make a template; volumes are formatted at stage");
                }
                pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&job);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the template worker");
    }
    tx
}

/// Makes one template crash-safely, then trims the folder to [`PER_POOL`].
fn make(job: &Job) -> Result<()> {
    let at = || format!("making template {} of {} bytes", job.fs_type, job.size);
    let path = job.dir.join(file_name(&job.fs_type, job.size));
    if dir::is_file(&path) {
        return Ok(());
    }
    let space = file::statvfs(job.dir.parent().unwrap_or(&job.dir)).context(at)?;
    if space.available_bytes < job.size {
        tracing::info!(dir = %job.dir.display(), "no template made: the pool has no room");
        return Ok(());
    }
    file::mkdir_p_mode(&job.dir, 0o700).context(at)?;
    let tmp = Pool::tmp_path(&path);
    let _ = file::remove_file_if_exists(&tmp);
    let made = file::create_sparse(&tmp, job.size)
        .and_then(|()| sysfresh::format_template(&tmp, &job.fs_type, job.timeout))
        .and_then(|()| file::sync_path(&tmp))
        .context(at);
    if let Err(e) = made {
        let _ = file::remove_file_if_exists(&tmp);
        return Err(e);
    }
    failpoint::hit("template.before-rename");
    dir::rename_durably(&tmp, &path).context(at)?;
    tracing::info!(template = %path.display(), "template made");
    let mut all = list(&job.dir);
    while all.len() > PER_POOL {
        let (old, _) = all.remove(0);
        tracing::info!(template = %old.display(), "removing the least recently used template");
        file::remove_file_if_exists(&old).context(at)?;
    }
    Ok(())
}

/// The finished templates in `dir`, least recently used first.
fn list(folder: &Path) -> Vec<(PathBuf, std::time::SystemTime)> {
    let mut out: Vec<_> = dir::list(folder)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| !e.is_hidden())
        .filter_map(|e| Some((e.path.clone(), dir::stat(&e.path).ok()??.modified)))
        .collect();
    out.sort_by_key(|(_, t)| *t);
    out
}

/// (filesystem, size) of a template's file name of this format.
fn parse_name(name: &str) -> Option<(String, u64)> {
    let stem = name.strip_suffix(&format!("-f{TEMPLATE_FORMAT}.img"))?;
    let (fs_type, size) = stem.rsplit_once('-')?;
    let size = size.parse().ok()?;
    sysfresh::FS_TYPES
        .contains(&fs_type)
        .then(|| (fs_type.to_string(), size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_refused() {
        let name = file_name("xfs", 1 << 30);
        assert_eq!(parse_name(&name), Some(("xfs".into(), 1 << 30)));
        assert_eq!(parse_name("vfat-1024-f1.img"), None);
        assert_eq!(
            parse_name(&format!("ext4-1024-f{}.img", TEMPLATE_FORMAT + 1)),
            None
        );
        assert_eq!(parse_name("ext4-x-f1.img"), None);
    }

    fn pool(reflink: bool) -> Pool {
        Pool {
            name: "p".into(),
            root: PathBuf::from("/nonexistent"),
            fs_type: "xfs".into(),
            reflink,
        }
    }

    #[test]
    fn only_reflink_pools_and_known_filesystems_are_served() {
        assert!(serves(&pool(true), "ext4"));
        assert!(serves(&pool(true), "btrfs"));
        assert!(!serves(&pool(false), "xfs"));
        assert!(!serves(&pool(true), "vfat"));
        // Not served: no template is asked for, and the volume is made blank.
        let t = Templates::default();
        assert!(!t.fill(
            &pool(false),
            ("xfs", 1 << 30),
            Path::new("/nonexistent/v.img"),
            &[],
            csi_sys::cmd::DEFAULT_TIMEOUT
        ));
        assert!(t.pending.lock().unwrap().is_empty());
    }
}
