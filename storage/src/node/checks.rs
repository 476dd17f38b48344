//! What every request to the node is checked for before anything is done: the
//! volume id, the paths the CO gives (absolute, no `..`, outside the driver's
//! directories and the system's, no symbolic link) and the capability.

use std::path::{Component, Path, PathBuf};

use super::Node;
use crate::data::shorten;
use crate::error::{Error, Result};
use crate::model::*;
use crate::pool::Located;

/// Directories no volume may ever be published onto.
const FORBIDDEN: [&str; 12] = [
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/root",
    "/run/secrets",
];

impl Node {
    /// What every stage and publish request is checked for first, in this order:
    /// a volume id, the path (see [`Self::check_path`]), a capability.
    pub(super) fn check_request(
        &self,
        volume_id: &str,
        what: &str,
        path: &str,
        has_capability: bool,
    ) -> Result<PathBuf> {
        if volume_id.is_empty() {
            return Err(Error::invalid("volume_id is required"));
        }
        let path = self.check_path(what, path)?;
        if !has_capability {
            return Err(Error::invalid("volume_capability is required"));
        }
        Ok(path)
    }

    /// Checks a path given by the CO: absolute, no `..`, no NUL, outside the
    /// driver's own directories and the system's.
    pub(super) fn check_path(&self, what: &str, p: &str) -> Result<PathBuf> {
        if p.is_empty() {
            return Err(Error::invalid(format!("{what} is required")));
        }
        if p.contains('\0') {
            return Err(Error::invalid(format!("{what} contains a NUL byte")));
        }
        let path = PathBuf::from(p);
        if !path.is_absolute() {
            return Err(Error::invalid(format!("{what} {p:?} is not absolute")));
        }
        if path.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(Error::invalid(format!("{what} {p:?} contains '..'")));
        }
        if path.parent().is_none() {
            return Err(Error::invalid(format!("{what} may not be /")));
        }
        // Judge where the path really leads: a symlinked parent may point anywhere.
        let real_parent = path
            .parent()
            .and_then(|d| std::fs::canonicalize(d).ok())
            .unwrap_or_else(|| path.parent().unwrap_or(Path::new("/")).to_path_buf());
        let real = real_parent.join(path.file_name().unwrap_or_default());
        for candidate in [&path, &real] {
            if self.is_internal_path(candidate) {
                return Err(Error::invalid(format!(
                    "{what} {p:?} lies inside the driver's pools or state directory"
                )));
            }
            if FORBIDDEN.iter().any(|f| candidate.starts_with(f)) {
                return Err(Error::invalid(format!(
                    "{what} {p:?} lies in a system directory"
                )));
            }
        }
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(Error::invalid(format!("{what} {p:?} is a symbolic link")));
        }
        Ok(path)
    }

    pub(super) fn check_capability(cap: Option<&Capability>, loc: &Located) -> Result<Capability> {
        let cap = cap
            .cloned()
            .ok_or_else(|| Error::invalid("volume_capability is required"))?;
        if let Some(why) = cap.unsupported_reason() {
            return Err(Error::invalid(why));
        }
        if cap.is_block() && loc.backing != Backing::Image {
            return Err(Error::invalid(
                "block access is not possible on a kind=dir volume",
            ));
        }
        if let Access::Mount {
            volume_mount_group, ..
        } = &cap.access
        {
            if !volume_mount_group.is_empty() && volume_mount_group.parse::<u32>().is_err() {
                return Err(Error::invalid(format!(
                    "volume_mount_group {:?} is not a numeric group id",
                    shorten(volume_mount_group)
                )));
            }
        }
        Ok(cap)
    }
}
