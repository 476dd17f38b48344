//! The settings of loop devices (direct I/O, read-ahead): applied at stage, read
//! and changed on live devices when ModifyVolume asks, put back when a change
//! fails part way.

use std::path::Path;

use csi_sys::LoopDevice;

use super::Node;
use crate::error::{Context, Error, Result};
use crate::failpoint;
use crate::ids::VolumeId;
use crate::settings::{DevicesBefore, LiveDevices, LoopSettings};

impl Node {
    /// Gives a loop device the settings that are set; the others stay as they are.
    pub(super) fn apply_settings(&self, device: &Path, s: LoopSettings) -> Result<()> {
        if let Some(on) = s.direct_io {
            if let Err(e) = self.sys.loops.set_direct_io(device, on) {
                let context = format!(
                    "turning direct I/O {} on {}",
                    if on { "on" } else { "off" },
                    device.display()
                );
                return Err(if on && e.is_refused_by_kernel() {
                    // Permanent: the backing file's filesystem or block size
                    // does not allow it.
                    Error::invalid(format!(
                        "{context}: the kernel refused it ({e}); directIO=true is not \
                         possible for this volume's image on the 512-byte sectors it is \
                         staged on (on an xfs pool, an image that shares blocks with a \
                         snapshot, a clone or a template takes it only in 4096-byte units). \
                         Recorded while the volume is not staged, it applies at the next \
                         stage, on 4096-byte sectors where the volume's filesystem allows"
                    ))
                } else {
                    Error::System { context, source: e }
                });
            }
        }
        if let Some(kib) = s.read_ahead_kib {
            failpoint::fail("loop.set-read-ahead")
                .and_then(|()| self.sys.loops.set_read_ahead_kib(device, kib))
                .context(|| {
                    format!(
                        "setting the read-ahead of {} to {kib} KiB",
                        device.display()
                    )
                })?;
        }
        Ok(())
    }

    /// The settings a loop device has now.
    fn current_settings(&self, device: &LoopDevice) -> Result<LoopSettings> {
        let kib = self
            .sys
            .loops
            .read_ahead_kib(&device.device)
            .context(|| format!("reading the read-ahead of {}", device.device.display()))?;
        Ok(LoopSettings {
            direct_io: Some(device.direct_io),
            read_ahead_kib: Some(kib),
        })
    }
}

impl LiveDevices for Node {
    fn apply_live(&self, image: &Path, wanted: LoopSettings) -> Result<DevicesBefore> {
        let mut before = Vec::new();
        let rec = image
            .file_stem()
            .and_then(|s| VolumeId::parse(&s.to_string_lossy()))
            .and_then(|id| self.node_records.get(id));
        for d in self.image_devices(image, rec.as_ref())? {
            before.push((d.device.clone(), self.current_settings(&d)?));
        }
        match before
            .iter()
            .try_for_each(|(dev, _)| self.apply_settings(dev, wanted))
        {
            Ok(()) => Ok(before),
            Err(e) => Err(e.with_cleanup(self.restore_live(&before))),
        }
    }

    fn restore_live(&self, before: &DevicesBefore) -> Result<()> {
        let mut result = Ok(());
        for (dev, settings) in before {
            result = result.and(self.apply_settings(dev, *settings));
        }
        result
    }
}
