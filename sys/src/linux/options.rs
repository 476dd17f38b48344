//! Mount option strings (`noatime`, `nodev,nosuid`, `discard`, `commit=30`) split
//! into the per-mount flags of mount(2) and the filesystem's data string. The
//! flags are `sys-mount`'s; `sys-mount` parses no option strings, so this does.
//! A value in double quotes is one option whatever commas it holds, as an
//! SELinux context's categories do (`context="system_u:object_r:t:s0:c0,c1"`).

use sys_mount::MountFlags;

use crate::error::{Result, SysError};
use crate::MountOptions;

/// MS_LAZYTIME, which `sys-mount` has no name for.
pub const LAZYTIME: MountFlags = MountFlags::from_bits_retain(libc::MS_LAZYTIME);

/// Mount options split into mount flags and the filesystem's data string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitOptions {
    pub flags: MountFlags,
    /// Comma-separated filesystem options (`discard`, `nouuid`, `key=value`).
    pub data: String,
}

/// What an option does to the flags: the flags it sets and those it clears.
type Effect = (MountFlags, MountFlags);

/// The options that are mount flags, with their effect; any other option is data.
fn flag_effect(opt: &str) -> Option<Effect> {
    use MountFlags as F;
    let none = F::empty();
    Some(match opt {
        "defaults" => (none, none),
        "ro" => (F::RDONLY, none),
        "rw" => (none, F::RDONLY),
        "noatime" => (F::NOATIME, F::RELATIME | F::STRICTATIME),
        "atime" => (none, F::NOATIME),
        "relatime" => (F::RELATIME, F::NOATIME | F::STRICTATIME),
        "norelatime" => (none, F::RELATIME),
        "strictatime" => (F::STRICTATIME, F::NOATIME | F::RELATIME),
        "nodiratime" => (F::NODIRATIME, none),
        "diratime" => (none, F::NODIRATIME),
        "nodev" => (F::NODEV, none),
        "dev" => (none, F::NODEV),
        "nosuid" => (F::NOSUID, none),
        "suid" => (none, F::NOSUID),
        "noexec" => (F::NOEXEC, none),
        "exec" => (none, F::NOEXEC),
        "sync" => (F::SYNCHRONOUS, none),
        "async" => (none, F::SYNCHRONOUS),
        "dirsync" => (F::DIRSYNC, none),
        "lazytime" => (LAZYTIME, none),
        "nolazytime" => (none, LAZYTIME),
        "silent" => (F::SILENT, none),
        "loud" => (none, F::SILENT),
        _ => return None,
    })
}

/// Options that change what kind of mount this is; each has its own operation.
const MOUNT_KINDS: [&str; 13] = [
    "bind",
    "rbind",
    "remount",
    "move",
    "loop",
    "shared",
    "rshared",
    "slave",
    "rslave",
    "private",
    "rprivate",
    "unbindable",
    "runbindable",
];

/// The options of a comma-separated list, a quoted value kept whole; None when
/// a quote is not closed.
pub fn list_options(raw: &str) -> Option<Vec<&str>> {
    let mut out = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in raw.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(raw[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if quoted {
        return None;
    }
    out.push(raw[start..].trim());
    out.retain(|o| !o.is_empty());
    Some(out)
}

/// Split [`MountOptions`] into mount flags and the data string. Each entry of
/// `flags` may itself be a comma-separated list. `read_only` wins over an `rw`
/// flag. Flags that change what kind of mount this is (bind, remount, move,
/// propagation, loop) and flags containing a NUL byte are rejected.
pub fn split_options(opts: &MountOptions) -> Result<SplitOptions> {
    let mut flags = MountFlags::empty();
    let mut data: Vec<&str> = Vec::new();
    for raw in &opts.flags {
        if raw.contains('\0') {
            return Err(SysError::InvalidArgument {
                what: format!("mount flag {raw:?} contains a NUL byte"),
            });
        }
        let Some(list) = list_options(raw) else {
            return Err(SysError::InvalidArgument {
                what: format!("mount flag {raw:?} opens a quote it does not close"),
            });
        };
        for opt in list {
            if MOUNT_KINDS.contains(&opt) {
                return Err(SysError::InvalidArgument {
                    what: format!(
                        "mount flag {opt:?} is not allowed here (binds, remounts, propagation and loop devices have their own operations)"
                    ),
                });
            }
            match flag_effect(opt) {
                Some((set, clear)) => {
                    flags.remove(clear);
                    flags.insert(set);
                }
                None => data.push(opt),
            }
        }
    }
    if opts.read_only {
        flags.insert(MountFlags::RDONLY);
    }
    Ok(SplitOptions {
        flags,
        data: data.join(","),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(read_only: bool, flags: &[&str]) -> MountOptions {
        MountOptions {
            read_only,
            flags: flags.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn splits_flags_and_data() {
        let s = split_options(&opts(
            false,
            &["noatime", "nodev,nosuid", "discard", "nouuid", "commit=30"],
        ))
        .unwrap();
        assert_eq!(
            s.flags,
            MountFlags::NOATIME | MountFlags::NODEV | MountFlags::NOSUID
        );
        assert_eq!(s.data, "discard,nouuid,commit=30");

        let s = split_options(&opts(true, &["rw", "defaults", ""])).unwrap();
        assert_eq!(s.flags, MountFlags::RDONLY);
        assert_eq!(s.data, "");

        let s = split_options(&opts(false, &["ro", "rw", "relatime", "noatime"])).unwrap();
        assert_eq!(s.flags, MountFlags::NOATIME);

        let s = split_options(&opts(false, &["lazytime", "sync"])).unwrap();
        assert_eq!(s.flags, LAZYTIME | MountFlags::SYNCHRONOUS);
        assert_eq!(LAZYTIME.bits(), nix::mount::MsFlags::MS_LAZYTIME.bits());
    }

    #[test]
    fn a_quoted_value_is_one_option() {
        let context = r#"context="system_u:object_r:container_file_t:s0:c0,c1""#;
        let s = split_options(&opts(false, &[&format!("noatime,{context}"), "discard"])).unwrap();
        assert_eq!(s.flags, MountFlags::NOATIME);
        assert_eq!(s.data, format!("{context},discard"));
        assert_eq!(
            list_options(&format!("{context},nodev")),
            Some(vec![context, "nodev"])
        );
        assert!(split_options(&opts(false, &[r#"context="a,b"#]))
            .unwrap_err()
            .is_invalid_argument());
    }

    #[test]
    fn rejects_nul_and_mount_kind_flags() {
        assert!(split_options(&opts(false, &["a\0b"]))
            .unwrap_err()
            .is_invalid_argument());
        assert!(split_options(&opts(false, &["bind"]))
            .unwrap_err()
            .is_invalid_argument());
        assert!(split_options(&opts(false, &["noatime,remount"]))
            .unwrap_err()
            .is_invalid_argument());
    }
}
