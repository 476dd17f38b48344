//! The Linux implementation of [`Mounter`](crate::Mounter), [`Loops`](crate::Loops)
//! and [`Filesystems`](crate::Filesystems), one room per kind of object:
//!
//! - [`options`]: mount option strings split into flags and filesystem data;
//! - [`mount`]: mount(2) and umount2(2) through `sys-mount` (no mount(8), no lazy
//!   unmount);
//! - [`block`]: the block-device ioctls (size, read-ahead, read-only);
//! - [`loops`]: loop devices through the loop ioctls on /dev/loop-control and
//!   /dev/loopN, creating missing device nodes since there may be no udev; their
//!   state is read back from sysfs;
//! - [`fs`]: filesystems made, checked, measured and grown with the usual tools
//!   (mkfs.*, e2fsck, xfs_repair, resize2fs, xfs_growfs, btrfs) through
//!   [`crate::cmd`], and frozen with FIFREEZE/FITHAW.
//!
//! Every ioctl is declared with nix's ioctl macros in the room that uses it.

pub mod block;
pub mod fs;
pub mod loops;
pub mod mount;
pub mod options;

pub use fs::LinuxFilesystems;
pub(crate) use loops::backing_identity;
pub use loops::LinuxLoops;
pub use mount::LinuxMounter;
pub use options::{list_options, split_options, SplitOptions};
