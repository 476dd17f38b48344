//! Storage pools: directories on the node that hold volumes and snapshots. Each
//! pool is probed at start for its filesystem and whether it can reflink, which
//! decides how snapshots and clones are made.
//!
//! Layout of a pool:
//! ```text
//! <pool>/volumes/<volume-id>.img     image volumes
//! <pool>/volumes/<volume-id>/        directory volumes (btrfs subvolumes on btrfs)
//! <pool>/snapshots/<snapshot-id>.img|/
//! <pool>/ephemeral/<volume-id>.img   ephemeral inline volumes (owned by the node)
//! <pool>/**/.<name>.tmp              work in progress; removed at start
//! ```

use std::path::{Path, PathBuf};

use csi_sys::{btrfs, dir, file};

use crate::error::{Context, Error, Result};
use crate::ids::{SnapshotId, VolumeId};
use crate::model::Backing;

pub const DEFAULT_POOL: &str = "default";

#[derive(Debug, Clone)]
pub struct Pool {
    pub name: String,
    pub root: PathBuf,
    pub fs_type: String,
    pub reflink: bool,
}

/// Where a volume's data lives, found by looking at the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub pool: String,
    pub path: PathBuf,
    pub backing: Backing,
    pub ephemeral: bool,
}

impl Pool {
    /// Checks and probes a pool directory, making its subdirectories.
    pub fn open(name: &str, root: &Path) -> Result<Pool> {
        let meta = match dir::stat(root) {
            Ok(Some(m)) => m,
            Ok(None) => {
                return Err(Error::invalid(format!(
                    "pool {name}: {} does not exist",
                    root.display()
                )))
            }
            Err(e) => return Err(Error::invalid(format!("pool {name}: {e}"))),
        };
        if !meta.is_dir() {
            return Err(Error::invalid(format!(
                "pool {name}: {} is not a directory",
                root.display()
            )));
        }
        let root = dir::resolve(root).context(|| format!("pool {name}"))?;
        for sub in ["volumes", "snapshots", "ephemeral"] {
            file::mkdir_p_mode(&root.join(sub), 0o700)
                .context(|| format!("pool {name}: making {sub}/"))?;
        }
        let fs_type =
            file::fs_type_name(&root).context(|| format!("pool {name}: probing filesystem"))?;
        let reflink = file::probe_reflink(&root.join("volumes"));
        Ok(Pool {
            name: name.to_string(),
            root,
            fs_type,
            reflink,
        })
    }

    pub fn is_btrfs(&self) -> bool {
        self.fs_type == "btrfs"
    }

    pub fn volumes_dir(&self) -> PathBuf {
        self.root.join("volumes")
    }
    pub fn snapshots_dir(&self) -> PathBuf {
        self.root.join("snapshots")
    }
    pub fn ephemeral_dir(&self) -> PathBuf {
        self.root.join("ephemeral")
    }

    pub fn volume_path(&self, id: VolumeId, backing: Backing, ephemeral: bool) -> PathBuf {
        let dir = if ephemeral {
            self.ephemeral_dir()
        } else {
            self.volumes_dir()
        };
        match backing {
            Backing::Image => dir.join(format!("{id}.img")),
            Backing::Directory | Backing::Subvolume => dir.join(id.to_string()),
        }
    }

    pub fn snapshot_path(&self, id: SnapshotId, backing: Backing) -> PathBuf {
        match backing {
            Backing::Image => self.snapshots_dir().join(format!("{id}.img")),
            Backing::Directory | Backing::Subvolume => self.snapshots_dir().join(id.to_string()),
        }
    }

    /// The work-in-progress name of `final_path`: a dot file beside it, which
    /// listings skip and start-up removes.
    pub fn tmp_path(final_path: &Path) -> PathBuf {
        let name = final_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        final_path.with_file_name(format!(".{name}.tmp"))
    }

    /// Finds a volume's data in this pool by its id.
    pub fn locate(&self, id: VolumeId) -> Option<Located> {
        for ephemeral in [false, true] {
            let img = self.volume_path(id, Backing::Image, ephemeral);
            if dir::is_file(&img) {
                return Some(self.located(img, Backing::Image, ephemeral));
            }
            let folder = self.volume_path(id, Backing::Directory, ephemeral);
            if dir::is_dir(&folder) {
                let backing = if btrfs::is_subvolume(&folder) {
                    Backing::Subvolume
                } else {
                    Backing::Directory
                };
                return Some(self.located(folder, backing, ephemeral));
            }
        }
        None
    }

    fn located(&self, path: PathBuf, backing: Backing, ephemeral: bool) -> Located {
        Located {
            pool: self.name.clone(),
            path,
            backing,
            ephemeral,
        }
    }

    /// Free and total bytes of the pool's filesystem.
    pub fn space(&self) -> Result<(u64, u64)> {
        let s = file::statvfs(&self.root).context(|| format!("pool {}: statvfs", self.name))?;
        Ok((s.available_bytes, s.total_bytes))
    }

    /// Whether `path` lies inside this pool.
    pub fn contains(&self, path: &Path) -> bool {
        path.starts_with(&self.root)
    }
}
