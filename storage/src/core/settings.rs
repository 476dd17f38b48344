//! The mutable attributes of an image volume (directIO, readAheadKiB): the
//! controller records them on the image file as extended attributes, and the
//! node gives them to the loop devices that serve it.

use std::collections::BTreeMap;
use std::path::Path;

use csi_sys::{file, xattr};

use crate::error::{Context, Error, Result};

/// The mutable attributes of an image volume that its loop devices carry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoopSettings {
    pub direct_io: Option<bool>,
    pub read_ahead_kib: Option<u32>,
}

pub const DIRECT_IO: &str = "directIO";
pub const READ_AHEAD: &str = "readAheadKiB";

/// The xattr (in the user namespace) that keeps a mutable attribute on an image.
pub(crate) fn attr_name(key: &str) -> String {
    format!("example-csi.{key}")
}

/// The mutable parameters a volume's data carries (as attributes of its image
/// or directory, or a subvolume's property): all but `transferBandwidth`, which
/// only its record keeps.
pub(crate) fn carried_by_data(m: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    m.iter()
        .filter(|(k, _)| k.as_str() != crate::TRANSFER_BANDWIDTH)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

pub fn parse_settings(values: &BTreeMap<String, String>) -> Result<LoopSettings> {
    let direct_io = match values.get(DIRECT_IO).map(String::as_str) {
        None => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(v) => {
            return Err(Error::invalid(format!(
                "directIO={v:?} is not true or false"
            )))
        }
    };
    let read_ahead_kib = match values.get(READ_AHEAD) {
        None => None,
        Some(v) => Some(
            v.parse::<u32>()
                .map_err(|_| Error::invalid(format!("readAheadKiB={v:?} is not a number")))?,
        ),
    };
    Ok(LoopSettings {
        direct_io,
        read_ahead_kib,
    })
}

/// The settings recorded on an image. An attribute that cannot be read, or holds
/// nonsense, is an error: taken for "not set", the volume would be served without
/// what was asked for it.
pub fn recorded_settings(image: &Path) -> Result<LoopSettings> {
    let mut values = BTreeMap::new();
    for key in [DIRECT_IO, READ_AHEAD] {
        let raw = xattr::get(image, &attr_name(key))
            .context(|| format!("reading the {key} attribute of {}", image.display()))?;
        if let Some(raw) = raw {
            let text = String::from_utf8(raw).map_err(|_| {
                Error::internal(format!(
                    "the {key} attribute of {} is not text",
                    image.display()
                ))
            })?;
            values.insert(key.to_string(), text);
        }
    }
    parse_settings(&values).map_err(|e| {
        Error::internal(format!(
            "the attributes of {} are damaged: {e}",
            image.display()
        ))
    })
}

/// The attribute that tells the node a plain directory volume's size, which
/// nothing else on the node knows (an image has its length, a subvolume its
/// qgroup limit).
const SIZE: &str = "size";

/// Records a plain directory volume's size on it.
pub fn record_size(dir: &Path, size: u64) -> Result<()> {
    xattr::set(dir, &attr_name(SIZE), size.to_string().as_bytes())
        .and_then(|()| file::sync_path(dir))
        .context(|| format!("recording the size of {}", dir.display()))
}

/// The size recorded on a plain directory volume, if any.
pub fn recorded_size(dir: &Path) -> Option<u64> {
    let raw = xattr::get(dir, &attr_name(SIZE)).ok()??;
    String::from_utf8(raw).ok()?.parse().ok()
}

/// The loop devices serving an image and their settings before a change.
pub type DevicesBefore = Vec<(std::path::PathBuf, LoopSettings)>;

/// What the node domain does, in the same process, for the controller's change of
/// a staged image volume's settings: only the node domain reaches loop devices.
pub trait LiveDevices: Send + Sync {
    /// Gives every loop device serving `image` the settings that are set; all or
    /// nothing. Returns each device's settings before the change.
    fn apply_live(&self, image: &Path, s: LoopSettings) -> Result<DevicesBefore>;
    /// Puts devices back as they were; every one is tried, the first failure returned.
    fn restore_live(&self, before: &DevicesBefore) -> Result<()>;
}
