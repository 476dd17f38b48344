//! The mark of a volume whose data is still arriving from another node: an
//! extended attribute on its image (or directory), set before the volume
//! exists and cleared only once every byte is durable here. The node refuses
//! to stage a marked volume, so no pod ever sees a volume half-arrived; the
//! controller sets and clears the mark (see `controller::transfer`).

use std::path::Path;

use csi_sys::{file, xattr};

use crate::error::{Context, Error, Result};
use crate::settings::attr_name;

const ARRIVING: &str = "arriving";

/// Marks `image` as arriving from `node`, durably.
pub(crate) fn mark(image: &Path, node: &str) -> Result<()> {
    let at = || format!("marking {} as arriving", image.display());
    xattr::set(image, &attr_name(ARRIVING), node.as_bytes()).context(at)?;
    file::sync_path(image).context(at)
}

/// The node an image is arriving from; None when all of it is here.
pub(crate) fn arriving_from(image: &Path) -> Result<Option<String>> {
    let v = xattr::get(image, &attr_name(ARRIVING))
        .context(|| format!("reading the marks of {}", image.display()))?;
    Ok(v.map(|v| String::from_utf8_lossy(&v).into_owned()))
}

/// Clears the mark, durably: the volume is whole.
pub(crate) fn clear(image: &Path) -> Result<()> {
    let at = || format!("clearing the arriving mark of {}", image.display());
    xattr::remove(image, &attr_name(ARRIVING)).context(at)?;
    file::sync_path(image).context(at)
}

/// Refuses the use of an image still arriving (ABORTED: a retry succeeds once
/// it is whole).
pub(crate) fn refuse_while_arriving(image: &Path, what: &str) -> Result<()> {
    // No volume: nothing arrives there, and the step that reads it says why.
    if !csi_sys::dir::is_file(image) && !csi_sys::dir::is_dir(image) {
        return Ok(());
    }
    match arriving_from(image)? {
        None => Ok(()),
        Some(node) => Err(Error::Aborted(format!(
            "{what}: the volume's data is still arriving from node {node}; it can be used \
             once all of it is here"
        ))),
    }
}
