//! Filesystems from templates (see `controller::templates`), and the marks that
//! say where an image stands.
//!
//! A new empty image of a pool whose templates serve its filesystem carries the
//! pending mark, naming that filesystem: CreateVolume makes nothing more (a
//! reflink and the UUID's writes cost more than the rest of a create). At the
//! first stage, before the image is first attached, the node fills it from the
//! template of the filesystem that stage asks for (the one CreateVolume chose,
//! unless the stage names another) and of the image's length, when there is
//! one, with a UUID of its own, sets the fresh mark and clears the pending one;
//! without a template the image stays blank and the stage formats it. The
//! pending mark is cleared last, so a crash or a power loss before that leaves it
//! to be filled again: a reflink replaces whatever a cut-short fill left.
//!
//! The fresh mark says that the image holds a filesystem (of the type the mark
//! names) that has never been mounted and already has its own UUID (the one the
//! mark names). The stage that set it then skips what a filesystem of unknown
//! history needs (the probe, the check, the growth, `nouuid`), and clears it
//! before the first mount. A stage that asks for another filesystem formats
//! the image with it instead: nothing was ever written to the fresh one.
//!
//! The fill is not made durable when it is made: the stage syncs the image before
//! attaching it. A power loss before that may keep the fill and its mark but only
//! some of the writes that gave it its UUID; the next stage then finds the UUID
//! incomplete and, as nothing was ever written to that filesystem, empties the
//! image, which is then formatted as a blank one.

use std::path::{Path, PathBuf};

use csi_sys::fresh::{self as sysfresh, TEMPLATE_FORMAT};
use csi_sys::{file, xattr};

use crate::error::{Context, Result};
use crate::failpoint;
use crate::pool::Pool;
use crate::settings::attr_name;

const MARK: &str = "freshFilesystem";
/// The mark of a new image to be filled from a template at its first stage.
const PENDING: &str = "fromTemplate";

/// The folder of a pool's templates.
pub fn templates_dir(pool: &Pool) -> PathBuf {
    pool.root.join(".templates")
}

/// The file name of the template of `fs_type` and `size`.
pub(crate) fn file_name(fs_type: &str, size: u64) -> String {
    format!("{fs_type}-{size}-f{TEMPLATE_FORMAT}.img")
}

/// Where the template of `fs_type` and `size` in `pool` is, when it is made.
pub(crate) fn template_path(pool: &Pool, fs_type: &str, size: u64) -> PathBuf {
    templates_dir(pool).join(file_name(fs_type, size))
}

/// Whether templates serve volumes of this pool and filesystem.
pub(crate) fn serves(pool: &Pool, fs_type: &str) -> bool {
    pool.reflink && sysfresh::FS_TYPES.contains(&fs_type)
}

/// The xattr name and value that mark a new image of `pool` to be filled from
/// the template of `fs_type` at its first stage; None when templates do not
/// serve it.
pub(crate) fn pending_mark(pool: &Pool, fs_type: Option<&str>) -> Option<(String, Vec<u8>)> {
    let fs_type = fs_type.filter(|fs| serves(pool, fs))?;
    Some((attr_name(PENDING), fs_type.as_bytes().to_vec()))
}

/// The filesystem a pending mark names (the one CreateVolume chose); None when
/// there is no mark.
fn read_pending(image: &Path) -> Result<Option<String>> {
    let value = xattr::get(image, &attr_name(PENDING))
        .context(|| format!("reading the marks of {}", image.display()))?;
    Ok(value.map(|v| String::from_utf8_lossy(&v).into_owned()))
}

/// Before an image is first attached: when it carries the pending mark, fills it
/// from the template in `pool` of its filesystem and length, then clears the
/// mark. Its filesystem is the one the stage names (`named`), else the one
/// CreateVolume chose, which the mark names. The image is left blank instead
/// when there is no such template, when the template cannot be used, or for a
/// stage for `block` access.
pub(crate) fn fill_pending(
    pool: &Pool,
    image: &Path,
    block: bool,
    named: Option<&str>,
) -> Result<()> {
    let Some(chosen) = read_pending(image)? else {
        return Ok(());
    };
    let at = || format!("filling {} from a template", image.display());
    let len = file::file_len(image).context(at)?;
    let usable = Some(named.unwrap_or(&chosen))
        .filter(|fs| !block && serves(pool, fs))
        .map(|fs| (fs, template_path(pool, fs, len)))
        .filter(|(_, template)| csi_sys::dir::is_file(template));
    let filled =
        usable.is_some_and(
            |(fs_type, template)| match fill_from(&template, image, fs_type) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(image = %image.display(), error = %e,
                    "could not fill the image from its template; it is formatted instead");
                    false
                }
            },
        );
    if !filled {
        // Blank, whatever a fill cut short left: the stage formats it.
        sysfresh::discard(image).context(at)?;
        clear(image)?;
    }
    failpoint::hit("stage.before-unmark");
    xattr::remove(image, &attr_name(PENDING)).context(at)?;
    failpoint::hit("stage.after-fill");
    Ok(())
}

/// Fills `image` from `template` with a new UUID, and marks it fresh with it.
fn fill_from(template: &Path, image: &Path, fs_type: &str) -> Result<()> {
    let at = || format!("filling {} from {}", image.display(), template.display());
    let uuid = *uuid::Uuid::new_v4().as_bytes();
    let (name, value) = mark(fs_type, uuid);
    sysfresh::fill_from_template(template, image, fs_type, uuid).context(at)?;
    xattr::set(image, &name, &value).context(at)
}

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
