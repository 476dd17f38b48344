//! ControllerModifyVolume and the mutable parameters: checked for the kind of
//! volume, recorded on its data, and given at once to the loop devices of an
//! image staged here, all or nothing.

use std::collections::BTreeMap;
use std::path::Path;

use csi_sys::{file, xattr};

use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::locks::LockKey;
use crate::model::*;
use crate::settings::{attr_name, parse_settings};
use crate::Controller;

impl Controller {
    pub(crate) fn check_mutable(&self, m: &BTreeMap<String, String>) -> Result<()> {
        for (k, v) in m {
            if !self.cfg.mutable_parameters.iter().any(|a| a == k) {
                return Err(Error::invalid(format!(
                    "unknown mutable parameter {k:?}; accepted: {}",
                    self.cfg.mutable_parameters.join(", ")
                )));
            }
            let ok = match k.as_str() {
                "directIO" => v == "true" || v == "false",
                "readAheadKiB" => v.parse::<u32>().is_ok_and(|n| n <= 65536),
                "compression" => ["zstd", "lzo", "zlib", "none"].contains(&v.as_str()),
                crate::TRANSFER_BANDWIDTH => crate::size::parse_size(v).is_ok(),
                _ => false,
            };
            if !ok {
                return Err(Error::invalid(format!(
                    "mutable parameter {k}={v:?} is invalid (directIO: true|false; \
                     readAheadKiB: 0..65536; compression: zstd|lzo|zlib|none; \
                     transferBandwidth: bytes per second, e.g. 100Mi, 0 for no cap)"
                )));
            }
        }
        Ok(())
    }

    /// Checks that every mutable parameter means something for this kind of volume.
    pub(crate) fn check_mutable_applies(
        backing: Backing,
        m: &BTreeMap<String, String>,
    ) -> Result<()> {
        for k in m.keys() {
            // Any volume's data may come from another node.
            if k == crate::TRANSFER_BANDWIDTH {
                continue;
            }
            let applies = match backing {
                Backing::Image => k == "directIO" || k == "readAheadKiB",
                Backing::Subvolume => k == "compression",
                Backing::Directory => false,
            };
            if !applies {
                return Err(Error::invalid(format!(
                    "mutable parameter {k} does not apply to a {} volume (image volumes take \
                     directIO and readAheadKiB; kind=dir volumes on btrfs take compression; \
                     every volume takes transferBandwidth)",
                    match backing {
                        Backing::Image => "kind=image",
                        Backing::Subvolume => "kind=dir (btrfs subvolume)",
                        Backing::Directory => "kind=dir on a non-btrfs pool",
                    }
                )));
            }
        }
        Ok(())
    }

    /// ControllerModifyVolume: validates every parameter before changing anything,
    /// then changes all or nothing. An image volume staged here gets the new values
    /// on its loop devices at once (elsewhere at its next stage); when they cannot
    /// be applied, the call fails and the volume keeps its old ones. Only the node
    /// domain reaches loop devices: a controller process without it asks the node
    /// plugin's process through the hand-off socket, and refuses to change an image
    /// volume the node has staged when that plugin cannot be reached, rather than
    /// answer for a change the volume does not have.
    pub fn modify_volume(&self, volume_id: &str, m: &BTreeMap<String, String>) -> Result<()> {
        let id = VolumeId::parse_existing(volume_id)?;
        self.check_mutable(m)?;
        let _guard = self.locks.try_lock([LockKey::Volume(id)])?;
        // The volume's lock too: a stage running now could attach with the values
        // it read before this change. Only for a volume that exists: a call about
        // another leaves no lock file.
        let mut rec = self.existing_volume(volume_id)?;
        let volume = self.state.lock_volume(id)?;
        Self::check_mutable_applies(rec.backing, m)?;
        let pool = self.pool(&rec.pool)?.clone();
        let path = pool.volume_path(id, rec.backing, false);
        // What the data carries changes there first; the record keeps all.
        let on_data = crate::settings::carried_by_data(m);
        let undo = match rec.backing {
            _ if on_data.is_empty() => None,
            Backing::Image => {
                Some(self.change_image_settings(&path, &on_data, volume.is_staged())?)
            }
            _ => {
                self.write_attributes(&path, rec.backing, &on_data)?;
                None
            }
        };
        failpoint::hit("modify-volume.after-attributes");
        for (k, v) in m {
            rec.mutable_parameters.insert(k.clone(), v.clone());
        }
        if let Err(e) = self.volumes.put(&rec) {
            return Err(match undo {
                Some(u) => e.with_cleanup(self.restore_image_settings(&u)),
                None => e,
            });
        }
        failpoint::hit("modify-volume.after-commit");
        Ok(())
    }

    /// Records new values of an image volume's mutable attributes on its file and
    /// gives them to the loop devices serving it now, through the node domain of
    /// this process. All or nothing: when a step fails, what the steps before it
    /// changed is put back, and the error tells what failed.
    fn change_image_settings(
        &self,
        image: &Path,
        values: &BTreeMap<String, String>,
        staged: bool,
    ) -> Result<ImageSettingsBefore> {
        let wanted = parse_settings(values)?;
        // Whether a loop device serves the image, without a look at every device;
        // the node finds which from its record.
        let attached = self
            .sys
            .loops
            .may_serve(image)
            .context(|| format!("finding the loop devices of {}", image.display()))?;
        let live = self.live_devices();
        if (staged || attached) && live.is_none() {
            return Err(Error::precondition(format!(
                "the volume is staged on node {}, and this controller process cannot change \
                 the loop device serving it (only the node plugin can); nothing was changed: \
                 change it while it is not staged, or run the driver with --mode all",
                self.cfg.node_id
            )));
        }
        let mut attributes = Vec::new();
        for key in values.keys() {
            let old = xattr::get(image, &attr_name(key))
                .context(|| format!("reading the {key} attribute of {}", image.display()))?;
            attributes.push((key.clone(), old));
        }
        let mut before = ImageSettingsBefore {
            image: image.to_path_buf(),
            attributes,
            devices: Vec::new(),
        };
        let recorded = values
            .iter()
            .try_for_each(|(key, v)| {
                xattr::set(image, &attr_name(key), v.as_bytes())
                    .context(|| format!("recording {key}={v} on {}", image.display()))
            })
            // Durable before the record that names them is written.
            .and_then(|()| {
                file::sync_path(image).context(|| format!("syncing {}", image.display()))
            });
        let applied = recorded.and_then(|()| match live {
            Some(live) if attached => live.apply_live(image, wanted),
            _ => Ok(Vec::new()),
        });
        match applied {
            Ok(devices) => {
                before.devices = devices;
                Ok(before)
            }
            Err(e) => Err(e.with_cleanup(self.restore_image_settings(&before))),
        }
    }

    /// Puts an image's attributes and its loop devices' settings back as they were.
    /// Every step is tried; the first failure is returned.
    fn restore_image_settings(&self, before: &ImageSettingsBefore) -> Result<()> {
        let mut result = Ok(());
        // No device changed, nothing to ask of the node (which may be unreachable).
        if let Some(live) = self.live_devices().filter(|_| !before.devices.is_empty()) {
            result = result.and(live.restore_live(&before.devices));
        }
        for (key, old) in &before.attributes {
            let name = attr_name(key);
            let put = match old {
                Some(v) => xattr::set(&before.image, &name, v),
                None => xattr::remove(&before.image, &name),
            };
            result = result
                .and(put.context(|| format!("putting {key} back on {}", before.image.display())));
        }
        result
    }
}

/// An image's attributes and its loop devices' settings before a change.
struct ImageSettingsBefore {
    image: std::path::PathBuf,
    attributes: Vec<(String, Option<Vec<u8>>)>,
    devices: crate::settings::DevicesBefore,
}
