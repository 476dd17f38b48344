//! What every request to the node is checked for before anything is done: the
//! volume id, the paths the CO gives (absolute, no `..`, below a directory the
//! kubelet uses for volumes and leading nowhere else through a symbolic link,
//! outside the driver's own directories) and the capability.

use std::path::{Component, Path, PathBuf};

use super::Node;
use crate::data::shorten;
use crate::error::{Error, Result};
use crate::model::*;
use crate::pool::Located;

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

    /// Checks a path given by the CO: absolute, no `..`, no NUL, strictly below
    /// one of the allowed roots (the kubelet's volume directories) also on the
    /// filesystem as it is now (no symbolic link on the way leads out), not a
    /// symbolic link itself, and outside the driver's pools and state.
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
        let roots = &self.cfg.allowed_path_roots;
        let allowed = || {
            let names: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
            format!(
                "the allowed roots are {} (--kubelet-dir, --allowed-path-root)",
                names.join(", ")
            )
        };
        let Some((root, rel)) = roots.iter().find_map(|r| {
            let rel = path.strip_prefix(r).ok()?;
            (rel.components().next().is_some()).then_some((r, rel))
        }) else {
            return Err(Error::invalid(format!(
                "{what} {p:?} is not below an allowed root; {}",
                allowed()
            )));
        };
        match csi_sys::dir::leads_beneath(root, rel) {
            Ok(true) => {}
            Ok(false) => {
                return Err(Error::invalid(format!(
                    "{what} {p:?} leads out of {} through a symbolic link; {}",
                    root.display(),
                    allowed()
                )))
            }
            Err(e) => {
                return Err(Error::invalid(format!(
                    "{what} {p:?}: the allowed root {} cannot be opened ({e}); {}",
                    root.display(),
                    allowed()
                )))
            }
        }
        // The pools and the state may lie below an allowed root (tests do so):
        // judge where the path really leads, the links of its parent followed.
        let real_parent = path
            .parent()
            .and_then(|d| csi_sys::dir::resolve(d).ok())
            .unwrap_or_else(|| path.parent().unwrap_or(Path::new("/")).to_path_buf());
        let real = real_parent.join(path.file_name().unwrap_or_default());
        if self.is_internal_path(&path) || self.is_internal_path(&real) {
            return Err(Error::invalid(format!(
                "{what} {p:?} lies inside the driver's pools or state directory"
            )));
        }
        if csi_sys::dir::lstat(&path).is_ok_and(|m| m.is_some_and(|m| m.is_symlink())) {
            return Err(Error::invalid(format!("{what} {p:?} is a symbolic link")));
        }
        Ok(path)
    }

    pub(super) fn check_capability(
        &self,
        cap: Option<&Capability>,
        loc: &Located,
    ) -> Result<Capability> {
        let cap = cap
            .cloned()
            .ok_or_else(|| Error::invalid("volume_capability is required"))?;
        if let Some(why) = self.cfg.unsupported(&cap) {
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
