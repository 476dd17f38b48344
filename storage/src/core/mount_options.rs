//! Which mount options a caller (a StorageClass's mountOptions, a PV's) may
//! ask for, per filesystem, and the flags every mount gets unless asked
//! otherwise. Options reach the kernel as they are written, and some name
//! other devices or files of the host (`logdev=`, `journal_path=`, `device=`)
//! or change what the host does on an error (`errors=panic`): only options
//! known to act on the volume's own filesystem are taken, and an operator may
//! add others.

use crate::model::{Access, Capability};

/// Options of any mount (bind mounts of directory volumes included): per-mount
/// flags that only narrow what the mount allows, or tune timestamps and syncing.
const ANY_FS: [&str; 12] = [
    "ro",
    "rw",
    "noatime",
    "relatime",
    "strictatime",
    "nodiratime",
    "lazytime",
    "nodev",
    "nosuid",
    "noexec",
    "sync",
    "dirsync",
];

/// Options of one filesystem that act on that filesystem alone. `name=` takes
/// any plain value (letters, digits, `.`, `_`, `-`, `:`).
const EXT4: [&str; 14] = [
    "discard",
    "nodiscard",
    "commit=",
    "data=",
    "barrier",
    "nobarrier",
    "delalloc",
    "nodelalloc",
    "auto_da_alloc",
    "noauto_da_alloc",
    "journal_checksum",
    "nojournal_checksum",
    "init_itable=",
    "noinit_itable",
];
const XFS: [&str; 10] = [
    "discard",
    "nodiscard",
    "inode32",
    "inode64",
    "largeio",
    "nolargeio",
    "allocsize=",
    "logbufs=",
    "logbsize=",
    "wsync",
];
const BTRFS: [&str; 15] = [
    "discard",
    "discard=",
    "nodiscard",
    "compress=",
    "compress-force=",
    "autodefrag",
    "noautodefrag",
    "ssd",
    "nossd",
    "ssd_spread",
    "commit=",
    "flushoncommit",
    "noflushoncommit",
    "datacow",
    "datasum",
];

/// The flags a mount gets unless its request says otherwise.
pub const DEFAULT_MOUNT_FLAGS: [&str; 2] = ["nodev", "nosuid"];

/// Options allowed per filesystem, and the default flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptionPolicy {
    /// (filesystem or "*" for any, option or `name=`) added by the operator.
    extra: Vec<(String, String)>,
    /// Flags every mount volume gets unless its request names the opposite.
    pub default_flags: Vec<String>,
}

impl Default for MountOptionPolicy {
    fn default() -> Self {
        MountOptionPolicy {
            extra: Vec::new(),
            default_flags: DEFAULT_MOUNT_FLAGS.iter().map(|s| s.to_string()).collect(),
        }
    }
}

/// The option that undoes `flag`, for the flags that have one.
fn opposite(flag: &str) -> Option<&'static str> {
    Some(match flag {
        "nodev" => "dev",
        "dev" => "nodev",
        "nosuid" => "suid",
        "suid" => "nosuid",
        "noexec" => "exec",
        "exec" => "noexec",
        "ro" => "rw",
        "rw" => "ro",
        "noatime" => "atime",
        "atime" => "noatime",
        _ => return None,
    })
}

fn plain_value(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 64
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'))
}

/// Whether `option` is `entry`: the same word, or `name=` and a plain value.
fn matches(entry: &str, option: &str) -> bool {
    match entry.strip_suffix('=') {
        Some(key) => option
            .strip_prefix(key)
            .and_then(|rest| rest.strip_prefix('='))
            .is_some_and(plain_value),
        None => entry == option,
    }
}

/// `context="user:role:type:level"`, the kubelet's SELinux context (CSIDriver
/// seLinuxMount), which labels the whole filesystem at its stage. Taken only
/// when it is exactly a context, so that nothing else reaches the mount.
fn selinux_context_flag(option: &str) -> bool {
    option
        .strip_prefix("context=\"")
        .and_then(|c| c.strip_suffix('"'))
        .is_some_and(selinux_context)
}

/// `user:role:type:level`, the level a sensitivity (`s0`, `s0-s3`) with
/// categories (`c0,c1`, `c0.c255`): no other character.
fn selinux_context(context: &str) -> bool {
    let word = |w: &str| !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    let numbered = |w: &str, prefix: char| {
        w.strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let range = |w: &str, prefix: char| {
        let mut ends = w.splitn(2, if prefix == 's' { '-' } else { '.' });
        ends.all(|e| numbered(e, prefix))
    };
    let parts: Vec<&str> = context.splitn(5, ':').collect();
    match parts.as_slice() {
        [user, role, kind, sensitivity, rest @ ..] => {
            word(user)
                && word(role)
                && word(kind)
                && range(sensitivity, 's')
                && rest
                    .first()
                    .is_none_or(|cats| cats.split(',').all(|c| range(c, 'c')))
        }
        _ => false,
    }
}

impl MountOptionPolicy {
    /// A policy with the operator's additions (`FS=OPTION`, FS one of ext4,
    /// xfs, btrfs or `*`; OPTION a word or `name=`) and default flags.
    pub fn new(extra: &[String], default_flags: &[String]) -> Result<Self, String> {
        let mut p = MountOptionPolicy {
            extra: Vec::new(),
            default_flags: Vec::new(),
        };
        for e in extra.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            let (fs, option) = e
                .split_once('=')
                .filter(|(fs, _)| ["ext4", "xfs", "btrfs", "*"].contains(fs))
                .ok_or_else(|| {
                    format!("{e:?} is not FS=OPTION with FS one of ext4, xfs, btrfs or *")
                })?;
            let word = option.strip_suffix('=').unwrap_or(option);
            if !plain_value(word) {
                return Err(format!(
                    "{e:?}: the option must be a word (letters, digits, . _ -), or name= for any value"
                ));
            }
            p.extra.push((fs.to_string(), option.to_string()));
        }
        for f in default_flags
            .iter()
            .map(|f| f.trim())
            .filter(|f| !f.is_empty())
        {
            if !ANY_FS.contains(&f) {
                return Err(format!(
                    "default mount flag {f:?} is not one of {}",
                    ANY_FS.join(", ")
                ));
            }
            p.default_flags.push(f.to_string());
        }
        Ok(p)
    }

    /// Whether a mount of `fs` may take `option`.
    pub fn allows(&self, fs: &str, option: &str) -> bool {
        let own: &[&str] = match fs {
            "ext4" => &EXT4,
            "xfs" => &XFS,
            "btrfs" => &BTRFS,
            _ => &[],
        };
        ANY_FS.contains(&option)
            || selinux_context_flag(option)
            || own.iter().any(|e| matches(e, option))
            || self
                .extra
                .iter()
                .any(|(f, e)| (f == "*" || f == fs) && matches(e, option))
    }

    /// Why the mount flags of `cap` are refused (`default_fs` for a capability
    /// that names no filesystem); None when every one is allowed.
    pub fn refused(&self, cap: &Capability, default_fs: &str) -> Option<String> {
        let Access::Mount { mount_flags, .. } = &cap.access else {
            return None;
        };
        let fs = cap.fs_type().unwrap_or(default_fs);
        let bad = mount_flags.iter().find(|f| !self.allows(fs, f))?;
        Some(format!(
            "mount option {:?} is not accepted for {fs} (options that name other devices or \
             files of the node, or change what it does on an error, are refused; an operator \
             may allow more with --allow-mount-option)",
            crate::data::shorten(bad)
        ))
    }

    /// `flags` with the default flags added, but for those the request
    /// overrides with their opposite.
    pub fn with_defaults(&self, flags: &[String]) -> Vec<String> {
        let mut out = flags.to_vec();
        for d in &self.default_flags {
            let overridden = opposite(d).is_some_and(|o| flags.iter().any(|f| f == o));
            if !overridden && !flags.contains(d) {
                out.push(d.clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::AccessMode;

    fn cap(fs: &str, flags: &[&str]) -> Capability {
        let mut c = Capability::mount(fs, AccessMode::SingleNodeWriter);
        if let Access::Mount { mount_flags, .. } = &mut c.access {
            *mount_flags = flags.iter().map(|s| s.to_string()).collect();
        }
        c
    }

    #[test]
    fn options_naming_the_host_are_refused_and_the_filesystems_own_allowed() {
        let p = MountOptionPolicy::default();
        for (fs, ok) in [
            ("ext4", "commit=30"),
            ("ext4", "data=ordered"),
            ("xfs", "inode64"),
            ("xfs", "logbsize=256k"),
            ("btrfs", "compress=zstd"),
            ("btrfs", "discard=async"),
            ("xfs", "noatime"),
        ] {
            assert_eq!(p.refused(&cap(fs, &[ok]), "ext4"), None, "{fs} {ok}");
        }
        for (fs, bad) in [
            ("ext4", "journal_path=/dev/sda"),
            ("ext4", "journal_dev=8"),
            ("ext4", "errors=panic"),
            ("xfs", "logdev=/dev/sda"),
            ("xfs", "rtdev=/dev/sdb"),
            ("btrfs", "device=/dev/sda"),
            ("btrfs", "subvol=/"),
            ("xfs", "commit=5"),
            ("ext4", "suid"),
            ("ext4", "dev"),
            ("ext4", "noatime,dev"),
            ("ext4", "data=a,b"),
        ] {
            let why = p.refused(&cap(fs, &[bad]), "ext4");
            assert!(
                why.as_deref().is_some_and(|w| w.contains(fs)),
                "{fs} {bad}: {why:?}"
            );
        }
        // No filesystem named: the default one's options.
        assert!(p.refused(&cap("", &["commit=5"]), "ext4").is_none());
        assert!(p.refused(&cap("", &["commit=5"]), "xfs").is_some());
    }

    #[test]
    fn an_operator_extends_the_list_per_filesystem() {
        let p = MountOptionPolicy::new(
            &[
                "ext4=journal_async_commit".into(),
                "*=suid".into(),
                "xfs=swalloc".into(),
            ],
            &["nodev".into()],
        )
        .unwrap();
        assert!(p.allows("ext4", "journal_async_commit"));
        assert!(!p.allows("xfs", "journal_async_commit"));
        assert!(p.allows("btrfs", "suid"));
        assert!(p.allows("xfs", "swalloc"));
        for bad in ["ext4", "zfs=x", "ext4=a,b", "ext4=/dev/x", "ext4="] {
            assert!(MountOptionPolicy::new(&[bad.into()], &[]).is_err(), "{bad}");
        }
        assert!(MountOptionPolicy::new(&[], &["suid".into()]).is_err());
    }

    #[test]
    fn default_flags_apply_unless_the_request_says_otherwise() {
        let p = MountOptionPolicy::default();
        let v = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(p.with_defaults(&[]), v(&["nodev", "nosuid"]));
        assert_eq!(
            p.with_defaults(&v(&["noatime", "nodev"])),
            v(&["noatime", "nodev", "nosuid"])
        );
        assert_eq!(p.with_defaults(&v(&["suid"])), v(&["suid", "nodev"]));
        let none = MountOptionPolicy::new(&[], &[]).unwrap();
        assert_eq!(none.with_defaults(&v(&["noatime"])), v(&["noatime"]));
    }
}
