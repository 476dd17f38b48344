//! Consistent copies of live volumes: the filesystems of the volumes being copied
//! are frozen (FIFREEZE) for the copy and always thawed afterwards, on error too.
//! Before a freeze the controller writes a marker naming itself into the shared
//! state, so that a freeze left by a crash is thawed when the controller starts
//! again, and only then: the node leaves a volume with a marker alone.
//!
//! Every copy of a live volume holds the volume's lock, frozen or not, so the
//! node cannot stage, unmount or detach it meanwhile. The controller freezes the
//! mounts it can see. A controller process without the node domain (the central
//! deployment, whose controller container is unprivileged and has its own mount
//! namespace) sees none of the node's mounts: it asks nothing of the kernel, and
//! its copy of a staged volume is crash-consistent (as after a power cut at that
//! instant: the filesystem's journal makes it mountable, but data the
//! application had not flushed is not in it).
//!
//! A freeze never lasts without bound. Frozen, a filesystem stalls every writer
//! of the volume (the application, and anything waiting on it), so each freeze
//! has a deadline: `--freeze-timeout` past the copy's expected time (nothing for a
//! reflink, the data at [`COPY_BYTES_PER_SEC`] for a plain copy). A watchdog
//! thread thaws the filesystems when the deadline passes, or as soon as the
//! caller cancels or its own deadline passes (see `cancel`), even while the copy
//! is still inside a system call that nothing can interrupt. The copy, once it
//! returns, is then thrown away: it was made partly unfrozen and may be torn. The
//! operation fails with ABORTED, and its usual error path removes the snapshot's
//! file and record (or the new volume), so nothing half-made remains and a retry
//! starts clean. ABORTED rather than DEADLINE_EXCEEDED: nothing of the call
//! remains, the state is as before it, and ABORTED is what CSI callers retry with
//! backoff; DEADLINE_EXCEEDED speaks of the caller's own deadline, after which the
//! outcome is unknown.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use csi_sys::{file, Filesystems};

use crate::cancel::{self, Token};
use crate::data::reachable_mount_of;
use crate::error::{Context, Error, Result};
use crate::ids::VolumeId;
use crate::state::{Domain, FreezeMarker};
use crate::Controller;

/// Bytes per second a plain (not reflinked) copy is expected to make at least,
/// for the deadline of its freeze.
pub const COPY_BYTES_PER_SEC: u64 = 32 << 20;

/// What ended a freeze before its copy did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    Deadline,
    Cancelled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Frozen (or freezing) for the copy.
    Open,
    /// Thawed after the copy.
    Closed,
    /// Thawed by the watchdog before the copy ended.
    Cut(Cut),
}

struct WindowState {
    phase: Phase,
    /// The mount points frozen and not yet thawed, in freezing order.
    frozen: Vec<PathBuf>,
    /// A thaw failed: the marker stays, so that the next start thaws again.
    thaw_failed: bool,
}

/// The state of one freeze, shared by the copying thread and its watchdog. Every
/// freeze and thaw happens under its lock, so the two never disagree on what is
/// frozen.
struct Window {
    state: Mutex<WindowState>,
    cv: Condvar,
}

impl Window {
    fn lock(&self) -> MutexGuard<'_, WindowState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Thaws every mount point still frozen, the last frozen first. A thaw is tried
/// a few times: a filesystem left frozen stalls its writers until someone thaws it.
fn thaw_all(fs: &dyn Filesystems, st: &mut WindowState) {
    while let Some(mp) = st.frozen.pop() {
        let mut attempt = 0;
        loop {
            match fs.thaw(&mp) {
                Ok(()) => break,
                Err(e) if attempt < 3 => {
                    tracing::warn!(path = %mp.display(), error = %e, attempt, "thaw failed; trying again");
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    tracing::error!(path = %mp.display(), error = %e,
                        "thaw failed; the marker stays for the next start");
                    st.thaw_failed = true;
                    break;
                }
            }
        }
    }
}

/// Ends a freeze, also on an early return or a panic: thaws what is still frozen,
/// stops the watchdog and removes the marker.
struct Freeze {
    window: Arc<Window>,
    fs: Arc<dyn Filesystems>,
    marker: PathBuf,
    watchdog: Option<std::thread::JoinHandle<()>>,
    started: Instant,
    /// Closed already: the drop after [`Freeze::close`] has nothing to do.
    closed: bool,
}

impl Freeze {
    /// Closes the window; what cut it short, if anything did.
    fn close(&mut self) -> Option<Cut> {
        self.closed = true;
        let cut = {
            let mut st = self.window.lock();
            let cut = match st.phase {
                Phase::Cut(c) => Some(c),
                Phase::Open | Phase::Closed => None,
            };
            thaw_all(&*self.fs, &mut st);
            if st.phase == Phase::Open {
                st.phase = Phase::Closed;
            }
            if !st.thaw_failed {
                let _ = file::remove_file_if_exists(&self.marker);
            }
            cut
        };
        self.window.cv.notify_all();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        tracing::debug!(
            frozen_ms = self.started.elapsed().as_millis() as u64,
            ?cut,
            "thawed"
        );
        cut
    }
}

impl Drop for Freeze {
    fn drop(&mut self) {
        if !self.closed {
            self.close();
        }
    }
}

/// Watches one freeze: thaws it when `deadline` passes or the call is cancelled.
fn watch(window: Arc<Window>, fs: Arc<dyn Filesystems>, token: Token, deadline: Instant) {
    let mut st = window.lock();
    while st.phase == Phase::Open {
        let now = Instant::now();
        let cut = if token.is_cancelled() {
            Cut::Cancelled
        } else if now >= deadline {
            Cut::Deadline
        } else {
            let wait = (deadline - now).min(cancel::TICK);
            st = window
                .cv
                .wait_timeout(st, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        };
        tracing::warn!(?cut, mountpoints = ?st.frozen, "freeze cut short: thawing before the copy ends");
        thaw_all(&*fs, &mut st);
        st.phase = Phase::Cut(cut);
    }
}

impl Controller {
    /// How long the filesystems of `images` may stay frozen for their copy.
    fn freeze_budget(&self, images: &[(VolumeId, PathBuf)]) -> Duration {
        let copied: u64 = images
            .iter()
            .filter(|(_, path)| !self.pools.values().any(|p| p.contains(path) && p.reflink))
            .map(|(_, path)| file::allocated_bytes(path).unwrap_or(0))
            .sum();
        self.cfg.freeze_timeout + Duration::from_secs(copied / COPY_BYTES_PER_SEC)
    }

    /// Runs `f` with the filesystem of every staged image among `images` frozen,
    /// for at most the freeze's budget: past it, or when the call is cancelled, the
    /// filesystems are thawed and the result of `f` is an error (ABORTED or
    /// Cancelled), whatever `f` itself returned.
    pub(crate) fn with_frozen<T>(
        &self,
        images: &[(VolumeId, PathBuf)],
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        // The lock of every volume, in this process or the node's: an unpublish or
        // unstage cannot unmount a filesystem while it is frozen (the thaw would
        // then find no mount point, and the filesystem would stay frozen), nor a
        // stage make one while it is copied.
        let mut ids: Vec<VolumeId> = images.iter().map(|(id, _)| *id).collect();
        ids.sort();
        ids.dedup();
        let held = ids
            .iter()
            .map(|id| self.state.lock_volume(*id))
            .collect::<Result<Vec<_>>>()?;
        crate::failpoint::hit("freeze.after-volume-lock");
        cancel::check()?;
        let mountpoints = self.mountpoints_of(images)?;
        if mountpoints.is_empty() {
            if held.iter().any(|v| v.is_staged()) {
                tracing::info!(volumes = ?ids,
                    "copying a volume the node has staged without freezing it: its mounts are \
                     not visible to this process; the copy is crash-consistent");
            }
            return f();
        }
        let budget = self.freeze_budget(images);
        let key = images
            .first()
            .map(|(id, _)| id.to_string())
            .unwrap_or_default();
        let marker = self.state.frozen_dir().join(format!("{key}.json"));
        // The marker says first whether the kernel's switch of expedited grace
        // periods is to be raised: a crash before it is put back leaves it to the
        // next start.
        let expedite = self.expediter.join();
        self.state.write_freeze_marker(
            &marker,
            &FreezeMarker {
                owner: Domain::Controller,
                pid: std::process::id(),
                volumes: ids.clone(),
                mountpoints: mountpoints.clone(),
                expedited: expedite.raises(),
            },
        )?;
        let (window, mut guard) = self.open_window(marker, budget)?;
        expedite.raise();
        crate::failpoint::hit("freeze.before-fifreeze");
        let frozen = self.freeze_each(&window, &mountpoints);
        // Only FIFREEZE waits for grace periods; the copy and the thaw do not.
        drop(expedite);
        frozen?;
        crate::failpoint::hit("freeze.after-freeze");
        let out = if window.lock().phase == Phase::Open {
            Some(f())
        } else {
            None
        };
        match guard.close() {
            None => out.unwrap_or_else(|| Err(Error::internal("freeze closed without a copy"))),
            Some(Cut::Cancelled) => Err(cancel::cancelled()),
            Some(Cut::Deadline) => Err(Error::Aborted(format!(
                "the copy of volume {key} kept its filesystem frozen longer than {} s \
                 (--freeze-timeout plus the copy's expected time); the filesystem was thawed \
                 and the copy undone; retry",
                budget.as_secs()
            ))),
        }
    }

    /// The mount points of the staged images among `images`.
    fn mountpoints_of(&self, images: &[(VolumeId, PathBuf)]) -> Result<Vec<PathBuf>> {
        let mounts = self
            .sys
            .mounter
            .mounts()
            .context(|| "reading the mount table".into())?;
        // Only a loop device mounted here can need a freeze: each of those is
        // asked whether it serves one of the images, rather than every loop
        // device of the node (hundreds on a busy one) being looked at.
        let mut mounted: Vec<&Path> = mounts
            .iter()
            .filter(|m| m.source.starts_with("/dev/loop"))
            .map(|m| Path::new(&m.source))
            .collect();
        mounted.sort();
        mounted.dedup();
        let mut mountpoints = Vec::new();
        for (_, image) in images {
            if csi_sys::dir::is_dir(image) {
                continue;
            }
            for dev in &mounted {
                let serves = self
                    .sys
                    .loops
                    .serving(dev, image)
                    .context(|| format!("reading loop device {}", dev.display()))?;
                if serves.is_none() {
                    continue;
                }
                // Frozen through a path that leads to its mount: one covered by a
                // later mount would freeze that other filesystem instead.
                if let Some(m) = reachable_mount_of(self.sys.mounter.as_ref(), &mounts, dev) {
                    if !mountpoints.contains(&m.mount_point) {
                        mountpoints.push(m.mount_point.clone());
                    }
                }
            }
        }
        Ok(mountpoints)
    }

    /// Opens the freeze's window and starts its watchdog, which closes it at the
    /// end of `budget` or when the call is cancelled. The guard thaws and removes
    /// `marker` when it goes.
    fn open_window(&self, marker: PathBuf, budget: Duration) -> Result<(Arc<Window>, Freeze)> {
        let window = Arc::new(Window {
            state: Mutex::new(WindowState {
                phase: Phase::Open,
                frozen: Vec::new(),
                thaw_failed: false,
            }),
            cv: Condvar::new(),
        });
        // The clock starts before the first FIFREEZE: the freeze's own sync already
        // stalls the volume's writers.
        let started = Instant::now();
        let mut guard = Freeze {
            window: window.clone(),
            fs: self.sys.fs.clone(),
            marker,
            watchdog: None,
            started,
            closed: false,
        };
        let watchdog = {
            let (window, fs, token) = (window.clone(), self.sys.fs.clone(), cancel::current());
            std::thread::Builder::new()
                .name("freeze-watchdog".into())
                .spawn(move || watch(window, fs, token, started + budget))
                .map_err(|e| Error::internal(format!("starting the freeze watchdog: {e}")))?
        };
        guard.watchdog = Some(watchdog);
        Ok((window, guard))
    }

    /// Freezes every mount point while the window is open, all at once: each
    /// FIFREEZE waits out the kernel's grace periods, and those of different
    /// filesystems overlap, so a group's freeze takes about as long as one
    /// volume's. What froze is thawed by the window's close, also when another
    /// failed.
    fn freeze_each(&self, window: &Window, mountpoints: &[PathBuf]) -> Result<()> {
        if window.lock().phase != Phase::Open {
            return Ok(());
        }
        let fs = &*self.sys.fs;
        let results: Vec<csi_sys::Result<()>> = match mountpoints {
            [one] => vec![fs.freeze(one)],
            _ => std::thread::scope(|s| {
                let running: Vec<_> = mountpoints
                    .iter()
                    .map(|mp| {
                        std::thread::Builder::new()
                            .name("freeze".into())
                            .spawn_scoped(s, move || fs.freeze(mp))
                            .map_err(|_| mp)
                    })
                    .collect();
                running
                    .into_iter()
                    .map(|r| match r {
                        Ok(h) => h.join().unwrap_or_else(|_| {
                            Err(csi_sys::SysError::Busy {
                                what: "a freezing thread ended abnormally".into(),
                            })
                        }),
                        // No thread to spare: frozen from here.
                        Err(mp) => fs.freeze(mp),
                    })
                    .collect()
            }),
        };
        let mut st = window.lock();
        let mut failed = None;
        for (mp, r) in mountpoints.iter().zip(results) {
            match r {
                Ok(()) => st.frozen.push(mp.clone()),
                Err(e) => {
                    failed.get_or_insert((mp, e));
                }
            }
        }
        // Cut while FIFREEZE ran: the watchdog has thawed what it knew of.
        if st.phase != Phase::Open {
            thaw_all(fs, &mut st);
        }
        drop(st);
        match failed {
            Some((mp, e)) => Err(e).context(|| format!("freezing {}", mp.display())),
            None => Ok(()),
        }
    }

    /// Thaws what a crash of this domain left frozen; the markers of another
    /// owner are its own to thaw.
    pub(crate) fn thaw_left_frozen(&self) {
        let (markers, unreadable) = self.state.read_freeze_markers();
        for path in unreadable {
            // Torn by a power loss, which also ended the freeze it was for.
            tracing::warn!(path = %path.display(), "removed an unreadable freeze marker");
            let _ = file::remove_file_if_exists(&path);
        }
        for (path, marker) in markers {
            if marker.owner != Domain::Controller {
                continue;
            }
            if marker.expedited && self.expediter.put_back() {
                tracing::warn!(
                    "put back the kernel's expedited grace periods a crash during a freeze left raised"
                );
            }
            for mp in &marker.mountpoints {
                match self.sys.fs.thaw(mp) {
                    Ok(()) => {
                        tracing::warn!(path = %mp.display(), "thawed a filesystem a crash left frozen")
                    }
                    Err(e) => tracing::debug!(path = %mp.display(), error = %e, "thaw at start"),
                }
            }
            let _ = file::remove_file_if_exists(&path);
        }
    }
}
