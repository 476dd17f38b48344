//! fsGroup for a CO that leaves it to the driver (VOLUME_MOUNT_GROUP): the
//! volume's files are given to the pod's group, the way a kubelet would have done.

use std::path::Path;

use csi_sys::file;

use crate::error::{Context, Error, Result};

/// Gives the volume mounted at `root` to `group`. When the root already
/// belongs to it (the usual case: the same pod, or one with the same fsGroup,
/// staged again) nothing else is looked at. Otherwise every file below is given
/// to the group first and the root last, so that a stage cut short leaves the
/// root as it was and the next stage walks the tree again.
pub(super) fn apply_mount_group(root: &Path, group: &str) -> Result<()> {
    let gid: u32 = group.parse().map_err(|_| {
        Error::invalid(format!(
            "volume_mount_group {group:?} is not a numeric group id"
        ))
    })?;
    let given = || format!("giving {} to group {gid}", root.display());
    if !file::is_shared_with_group(root, gid).context(given)? {
        file::share_contents_with_group(root, gid).context(given)?;
    }
    file::share_with_group(root, gid).context(given)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    fn gid(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().gid()
    }

    /// A group this process may give files to: the one its new files get.
    fn own_group() -> u32 {
        let dir = tempfile::tempdir().unwrap();
        gid(dir.path())
    }

    #[test]
    fn the_tree_takes_the_group_bits_when_the_root_lacks_them() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::set_permissions(root, fs::Permissions::from_mode(0o755)).unwrap();
        fs::create_dir(root.join("sub")).unwrap();
        fs::set_permissions(root.join("sub"), fs::Permissions::from_mode(0o700)).unwrap();
        fs::write(root.join("sub/file"), b"x").unwrap();
        fs::set_permissions(root.join("sub/file"), fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink("/nonexistent", root.join("link")).unwrap();
        let g = own_group();
        apply_mount_group(root, &g.to_string()).unwrap();
        assert_eq!(mode(root), 0o2775);
        assert_eq!(mode(&root.join("sub")), 0o2770);
        assert_eq!(mode(&root.join("sub/file")), 0o660);
        assert_eq!(gid(&root.join("sub/file")), g);
        assert_eq!(gid(&root.join("link")), g);
    }

    #[test]
    fn a_root_that_already_has_the_group_leaves_the_files_alone() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::set_permissions(root, fs::Permissions::from_mode(0o2775)).unwrap();
        fs::write(root.join("file"), b"x").unwrap();
        fs::set_permissions(root.join("file"), fs::Permissions::from_mode(0o600)).unwrap();
        apply_mount_group(root, &own_group().to_string()).unwrap();
        assert_eq!(
            mode(&root.join("file")),
            0o600,
            "no walk when the root matches"
        );
    }

    #[test]
    #[ignore = "needs root: gives files to a group the process is not in"]
    fn root_files_of_an_earlier_group_take_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir(root.join("sub")).unwrap();
        fs::write(root.join("sub/file"), b"x").unwrap();
        apply_mount_group(root, "1000").unwrap();
        assert_eq!(gid(&root.join("sub/file")), 1000);
        apply_mount_group(root, "2000").unwrap();
        assert_eq!(gid(root), 2000);
        assert_eq!(gid(&root.join("sub")), 2000);
        assert_eq!(gid(&root.join("sub/file")), 2000);
        assert_eq!(mode(&root.join("sub")) & 0o2070, 0o2070);
    }

    #[test]
    fn a_group_that_is_not_a_number_is_invalid() {
        let dir = tempfile::tempdir().unwrap();
        let e = apply_mount_group(dir.path(), "staff").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
}
