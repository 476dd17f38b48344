//! The mark of an image made from a template: it holds a filesystem (of the type
//! the mark names) that has never been mounted and already has its own UUID. The
//! controller sets it when it makes the image; the node reads it at the first
//! stage, and then skips what a filesystem of unknown history needs (the probe,
//! the check, the growth, `nouuid`), and clears it before the first mount.

use std::path::Path;

use csi_sys::xattr;

use crate::error::{Context, Result};
use crate::settings::attr_name;

const MARK: &str = "freshFilesystem";

/// The xattr name and value that mark `image` as holding a fresh `fs_type`.
pub(crate) fn mark(fs_type: &str) -> (String, Vec<u8>) {
    (attr_name(MARK), fs_type.as_bytes().to_vec())
}

/// The filesystem type of a fresh image; None when it is not marked (or the
/// mark cannot be read: the image is then treated as one of unknown history).
pub(crate) fn fresh_filesystem(image: &Path) -> Option<String> {
    let raw = xattr::get(image, &attr_name(MARK)).ok()??;
    String::from_utf8(raw).ok()
}

/// Clears the mark, before the filesystem is first mounted: a later stage checks
/// it as any other.
pub(crate) fn clear(image: &Path) -> Result<()> {
    xattr::remove(image, &attr_name(MARK))
        .context(|| format!("clearing the fresh mark of {}", image.display()))
}
