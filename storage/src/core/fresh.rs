//! The mark of an image made from a template: it holds a filesystem (of the type
//! the mark names) that has never been mounted and already has its own UUID (the
//! one the mark names). The controller sets it when it makes the image; the node
//! reads it at the first stage, and then skips what a filesystem of unknown
//! history needs (the probe, the check, the growth, `nouuid`), and clears it
//! before the first mount.
//!
//! The copy is not made durable when it is made: its first stage syncs it before
//! attaching it. A power loss before that may keep the copy and its mark but only
//! some of the writes that gave it its UUID; the first stage then finds the UUID
//! incomplete and, as nothing was ever written to that filesystem, empties the
//! image, which is then formatted as a blank one.

use std::path::Path;

use csi_sys::{fresh as sysfresh, xattr};

use crate::error::{Context, Result};
use crate::settings::attr_name;

const MARK: &str = "freshFilesystem";

/// The xattr name and value that mark an image as holding a fresh `fs_type`
/// with the filesystem UUID `uuid`.
pub(crate) fn mark(fs_type: &str, uuid: [u8; 16]) -> (String, Vec<u8>) {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    (attr_name(MARK), format!("{fs_type} {hex}").into_bytes())
}

/// The filesystem type and UUID a mark names; images marked by earlier versions
/// name no UUID.
fn parse(value: &[u8]) -> Option<(String, Option<[u8; 16]>)> {
    let text = std::str::from_utf8(value).ok()?;
    let Some((fs_type, hex)) = text.split_once(' ') else {
        return Some((text.to_string(), None));
    };
    let uuid = uuid::Uuid::try_parse(hex).ok()?;
    Some((fs_type.to_string(), Some(*uuid.as_bytes())))
}

fn read_mark(image: &Path) -> Option<(String, Option<[u8; 16]>)> {
    parse(&xattr::get(image, &attr_name(MARK)).ok()??)
}

/// The filesystem type of a fresh image; None when it is not marked (or the
/// mark cannot be read: the image is then treated as one of unknown history).
pub(crate) fn fresh_filesystem(image: &Path) -> Option<String> {
    read_mark(image).map(|(fs_type, _)| fs_type)
}

/// Before a marked image is first attached: one whose UUID a power loss kept
/// only in part is emptied and unmarked, to be formatted as a blank image.
pub(crate) fn settle(image: &Path) -> Result<()> {
    let Some((fs_type, Some(uuid))) = read_mark(image) else {
        return Ok(());
    };
    let at = || format!("checking the fresh filesystem of {}", image.display());
    if sysfresh::carries_uuid(image, &fs_type, uuid).context(at)? {
        return Ok(());
    }
    tracing::warn!(image = %image.display(), fs_type,
        "a power loss kept part of a new filesystem's UUID; the image is formatted anew");
    sysfresh::discard(image).context(at)?;
    clear(image)
}

/// Clears the mark of an image that will be grown before its first stage. The
/// stage then checks its filesystem as any other and no longer looks at the
/// UUID, so the copy is settled and made durable first.
pub(crate) fn unmark(image: &Path) -> Result<()> {
    if read_mark(image).is_none() {
        return Ok(());
    }
    settle(image)?;
    crate::core::blank::make_durable(image)?;
    clear(image)
}

/// Clears the mark, before the filesystem is first mounted: a later stage checks
/// it as any other.
pub(crate) fn clear(image: &Path) -> Result<()> {
    xattr::remove(image, &attr_name(MARK))
        .context(|| format!("clearing the fresh mark of {}", image.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_names_its_filesystem_and_uuid_and_earlier_marks_are_read() {
        let uuid = *uuid::Uuid::new_v4().as_bytes();
        let (_, value) = mark("xfs", uuid);
        assert_eq!(parse(&value), Some(("xfs".to_string(), Some(uuid))));
        assert_eq!(parse(b"ext4"), Some(("ext4".to_string(), None)));
        assert_eq!(parse(b"ext4 not-a-uuid"), None);
        assert_eq!(parse(&[0xff, 0xfe]), None);
    }
}
