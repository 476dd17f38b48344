//! btrfs subvolumes, snapshots and qgroups, for directory volumes on a btrfs pool.
//!
//! Subvolume creation, snapshots, deletion and quotas go through the `btrfs`
//! command (its error messages are clear and its behaviour is stable across
//! kernels); the subvolume id is read with the BTRFS_IOC_INO_LOOKUP ioctl, which
//! needs no process and no privilege.
//!
//! Capacity of a directory volume is enforced with the qgroup `0/<subvolume id>`:
//! writes past its limit fail with EDQUOT. Deleting a subvolume leaves its qgroup
//! behind until the kernel has cleaned the subvolume; that stale qgroup holds no
//! data and is harmless.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use nix::errno::Errno;

use crate::cmd::{self, DEFAULT_TIMEOUT, SHORT_TIMEOUT};
use crate::error::{Result, SysError};

/// The inode number of the root directory of every btrfs subvolume.
const SUBVOL_ROOT_INO: u64 = 256;

/// The ioctl type of btrfs's requests.
const BTRFS_IOCTL_MAGIC: u8 = 0x94;

/// struct btrfs_ioctl_ino_lookup_args of <linux/btrfs.h>.
#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

nix::ioctl_readwrite!(btrfs_ioc_ino_lookup, BTRFS_IOCTL_MAGIC, 18, InoLookupArgs);

/// True when `path` is the root of a btrfs subvolume (a directory with inode 256
/// on btrfs). Any error answers false.
pub fn is_subvolume(path: &Path) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() && m.ino() == SUBVOL_ROOT_INO => crate::file::fs_type_name(path)
            .map(|t| t == "btrfs")
            .unwrap_or(false),
        _ => false,
    }
}

/// The id of the subvolume that holds `path` (5 for the top level).
pub fn subvolume_id(path: &Path) -> Result<u64> {
    let f = std::fs::File::open(path).map_err(|e| SysError::io("open", path, e))?;
    let mut args = InoLookupArgs {
        treeid: 0,
        objectid: SUBVOL_ROOT_INO,
        name: [0; 4080],
    };
    // SAFETY: args is a btrfs_ioctl_ino_lookup_args, laid out as the kernel's, that
    // lives across the call.
    match unsafe { btrfs_ioc_ino_lookup(f.as_raw_fd(), &mut args) } {
        Ok(_) => Ok(args.treeid),
        Err(e @ (Errno::ENOTTY | Errno::EINVAL | Errno::EOPNOTSUPP)) => {
            Err(SysError::Unsupported {
                what: format!("{} is not on btrfs: {}", path.display(), io::Error::from(e)),
            })
        }
        Err(e) => Err(SysError::io("look up subvolume of", path, e.into())),
    }
}

fn btrfs(args: &[&std::ffi::OsStr], timeout: std::time::Duration) -> Result<std::process::Output> {
    cmd::run("btrfs", args, timeout)
}

/// Create the subvolume `path` (its parent must exist and be on btrfs).
pub fn subvolume_create(path: &Path) -> Result<()> {
    btrfs(
        &["subvolume".as_ref(), "create".as_ref(), path.as_os_str()],
        SHORT_TIMEOUT,
    )
    .map(|_| ())
}

/// Delete the subvolume `path` with everything in it, read-only snapshots too.
/// Subvolumes nested inside it are deleted first (the kernel refuses to delete a
/// subvolume that contains another). A missing path is Ok. The space is freed by
/// the kernel in the background.
pub fn subvolume_delete(path: &Path) -> Result<()> {
    if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == io::ErrorKind::NotFound) {
        return Ok(());
    }
    if !is_subvolume(path) {
        return Err(SysError::InvalidArgument {
            what: format!("{} is not a btrfs subvolume", path.display()),
        });
    }
    match delete_one(path) {
        Err(SysError::Command { stderr, .. }) if stderr.to_lowercase().contains("not empty") => {
            // The kernel refuses to delete a subvolume that holds another (a pod may
            // create them inside its volume). Only then walk the tree: most
            // volumes have none and the walk costs a stat per directory.
            let mut nested = Vec::new();
            find_nested_subvolumes(path, &mut nested)?;
            for sub in nested.iter().rev() {
                delete_one(sub)?;
            }
            delete_one(path)
        }
        other => other,
    }
}

fn delete_one(path: &Path) -> Result<()> {
    btrfs(
        &["subvolume".as_ref(), "delete".as_ref(), path.as_os_str()],
        DEFAULT_TIMEOUT,
    )
    .map(|_| ())
}

/// Collect subvolume roots strictly below `dir`, parents before children. A
/// subvolume root shows as a directory with inode 256; the placeholder a
/// snapshot leaves for a nested subvolume is an ordinary empty directory and is
/// not collected.
fn find_nested_subvolumes(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    // The walk follows no link a pod may have left in its volume.
    out.extend(crate::tree::directories_with_inode(dir, SUBVOL_ROOT_INO)?);
    Ok(())
}

/// Snapshot the subvolume `src` as the new subvolume `dst` (read-only when asked).
/// A snapshot is not recursive: subvolumes nested in `src` show up as empty folders.
pub fn subvolume_snapshot(src: &Path, dst: &Path, read_only: bool) -> Result<()> {
    let mut args: Vec<&std::ffi::OsStr> = vec!["subvolume".as_ref(), "snapshot".as_ref()];
    if read_only {
        args.push("-r".as_ref());
    }
    args.push(src.as_os_str());
    args.push(dst.as_os_str());
    btrfs(&args, DEFAULT_TIMEOUT).map(|_| ())
}

/// Turn quotas on for the btrfs filesystem holding `pool_path`. Idempotent: when
/// quotas are already on nothing is done; when they are turned on here, the initial
/// rescan is awaited so that usage figures are right from the start.
pub fn quota_enable(pool_path: &Path) -> Result<()> {
    if quota_enabled(pool_path)? {
        return Ok(());
    }
    btrfs(
        &["quota".as_ref(), "enable".as_ref(), pool_path.as_os_str()],
        DEFAULT_TIMEOUT,
    )?;
    btrfs(
        &[
            "quota".as_ref(),
            "rescan".as_ref(),
            "-w".as_ref(),
            pool_path.as_os_str(),
        ],
        DEFAULT_TIMEOUT,
    )?;
    Ok(())
}

/// Whether quotas are on for the btrfs filesystem holding `path`.
pub fn quota_enabled(path: &Path) -> Result<bool> {
    let args: [&std::ffi::OsStr; 4] = [
        "qgroup".as_ref(),
        "show".as_ref(),
        "--raw".as_ref(),
        path.as_os_str(),
    ];
    let out = cmd::run_unchecked("btrfs", &args, SHORT_TIMEOUT)?;
    if out.status.success() {
        return Ok(true);
    }
    let text = String::from_utf8_lossy(&out.stderr).to_lowercase();
    if text.contains("quotas not enabled") || text.contains("quota not enabled") {
        return Ok(false);
    }
    Err(cmd::command_error("btrfs", &args, &out))
}

/// Limit the referenced bytes of the subvolume `subvol_path` (its qgroup 0/<id>).
/// `bytes == 0` removes the limit. Quotas must be on ([`quota_enable`]).
pub fn qgroup_limit(subvol_path: &Path, bytes: u64) -> Result<()> {
    let limit = if bytes == 0 {
        "none".to_string()
    } else {
        bytes.to_string()
    };
    btrfs(
        &[
            "qgroup".as_ref(),
            "limit".as_ref(),
            limit.as_ref(),
            subvol_path.as_os_str(),
        ],
        SHORT_TIMEOUT,
    )
    .map(|_| ())
}

/// Sets the compression of new writes in a subvolume (`zstd`, `lzo`, `zlib`, or
/// `none` to turn it off); data already written keeps its form.
pub fn set_compression(subvol_path: &Path, algorithm: &str) -> Result<()> {
    // The property takes an empty value for "no compression".
    let value = if algorithm == "none" { "" } else { algorithm };
    btrfs(
        &[
            "property".as_ref(),
            "set".as_ref(),
            subvol_path.as_os_str(),
            "compression".as_ref(),
            value.as_ref(),
        ],
        SHORT_TIMEOUT,
    )
    .map(|_| ())
}

/// The figures of the qgroup 0/<id> of a subvolume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QgroupInfo {
    pub id: u64,
    /// Bytes referenced by the subvolume (shared extents included).
    pub referenced: u64,
    /// Bytes only this subvolume references.
    pub exclusive: u64,
    /// The referenced limit, None when unlimited.
    pub max_referenced: Option<u64>,
}

/// The qgroup figures of the subvolume `subvol_path`. The filesystem is synced
/// first, since qgroup numbers are only updated when a transaction commits.
pub fn qgroup_info(subvol_path: &Path) -> Result<QgroupInfo> {
    let id = subvolume_id(subvol_path)?;
    crate::file::syncfs(subvol_path)?;
    let args: [&std::ffi::OsStr; 6] = [
        "qgroup".as_ref(),
        "show".as_ref(),
        "--raw".as_ref(),
        "-r".as_ref(),
        "-f".as_ref(),
        subvol_path.as_os_str(),
    ];
    let out = cmd::run("btrfs", &args, SHORT_TIMEOUT)?;
    parse_qgroup_show(&cmd::stdout_text(&out), id).ok_or_else(|| SysError::NotFound {
        what: format!(
            "qgroup 0/{id} of {} in the output of `{}`",
            subvol_path.display(),
            cmd::display("btrfs", &args)
        ),
    })
}

/// Parse `btrfs qgroup show --raw -r` text. Columns are found by their header
/// (Qgroupid, Referenced/Rfer, Exclusive/Excl, Max referenced/Max_rfer), which
/// differs between btrfs-progs versions.
fn parse_qgroup_show(text: &str, id: u64) -> Option<QgroupInfo> {
    let mut lines = text.lines();
    let header = lines.find(|l| l.to_lowercase().starts_with("qgroupid"))?;
    let cols = header_columns(header);
    let col = |names: &[&str]| cols.iter().position(|c| names.contains(&c.as_str()));
    let c_ref = col(&["referenced", "rfer"])?;
    let c_excl = col(&["exclusive", "excl"]);
    let c_max = col(&["max referenced", "max_rfer", "max rfer"]);
    let want = format!("0/{id}");
    for line in lines {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.first() != Some(&want.as_str()) {
            continue;
        }
        let num = |i: Option<usize>| {
            i.and_then(|i| fields.get(i))
                .and_then(|f| f.parse::<u64>().ok())
        };
        let referenced = num(Some(c_ref))?;
        return Some(QgroupInfo {
            id,
            referenced,
            exclusive: num(c_excl).unwrap_or(0),
            // "none" (or a missing column) means no limit.
            max_referenced: num(c_max),
        });
    }
    None
}

/// Split a header line into column names. Names may contain one space ("Max
/// referenced") while columns are separated by two or more, so split on runs of
/// two spaces and then on single spaces only where that keeps known names whole.
fn header_columns(header: &str) -> Vec<String> {
    let mut cols = Vec::new();
    for chunk in header.split("  ").map(str::trim).filter(|c| !c.is_empty()) {
        let lower = chunk.to_lowercase();
        if lower.starts_with("max ") {
            cols.push(lower);
        } else {
            cols.extend(lower.split_whitespace().map(str::to_string));
        }
    }
    cols
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qgroup_show_v6() {
        let text = "\
Qgroupid    Referenced    Exclusive  Max referenced   Path 
--------    ----------    ---------  --------------   ---- 
0/5              16384        16384            none   <toplevel>
0/256          5259264      5259264       104857600   sv
0/257            16384        16384            none   other
";
        let q = parse_qgroup_show(text, 256).unwrap();
        assert_eq!(q.referenced, 5259264);
        assert_eq!(q.exclusive, 5259264);
        assert_eq!(q.max_referenced, Some(104857600));
        let q = parse_qgroup_show(text, 257).unwrap();
        assert_eq!(q.max_referenced, None);
        assert!(parse_qgroup_show(text, 300).is_none());
    }

    #[test]
    fn parses_qgroup_show_old_layout() {
        let text = "\
qgroupid         rfer         excl     max_rfer
--------         ----         ----     --------
0/258         1048576        4096      2097152
";
        let q = parse_qgroup_show(text, 258).unwrap();
        assert_eq!(q.referenced, 1048576);
        assert_eq!(q.exclusive, 4096);
        assert_eq!(q.max_referenced, Some(2097152));
    }

    #[test]
    fn garbage_is_none() {
        assert!(parse_qgroup_show("", 256).is_none());
        assert!(parse_qgroup_show("ERROR: something", 256).is_none());
        assert!(parse_qgroup_show("Qgroupid Referenced\n0/256 lots\n", 256).is_none());
    }
}
