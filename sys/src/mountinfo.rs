//! The mount table, read from `/proc/self/mountinfo`.
//!
//! The node decides idempotency from this table (is the staging path mounted? by
//! which device?), so the parser is strict about the format and lenient about
//! content: octal escapes (`\040` for a space, ...) are decoded, optional fields
//! (`shared:N`, `master:N`) are kept, and a malformed line is skipped rather than
//! failing the whole read.
//!
//! Note for matching: btrfs mounts have an anonymous MAJ:MIN (0:NN), so match them by
//! `source`; a bind mount of a directory shows the bound directory in `root`.

use std::path::{Path, PathBuf};

use crate::error::{Result, SysError};

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    pub parent_id: u32,
    pub major: u32,
    pub minor: u32,
    /// The path inside the filesystem that is mounted (`/` unless a bind of a subtree).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options, e.g. `rw`, `noatime`, `nosuid`.
    pub options: Vec<String>,
    /// Optional fields such as `shared:1` or `master:2` (propagation).
    pub optional_fields: Vec<String>,
    pub fs_type: String,
    /// The mount source, e.g. `/dev/loop3`, `tmpfs`.
    pub source: String,
    /// Per-superblock options, e.g. `rw,attr2,inode64`.
    pub super_options: Vec<String>,
}

impl MountEntry {
    /// True when this mount is read-only (the per-mount `ro` option).
    pub fn read_only(&self) -> bool {
        self.has_option("ro")
    }

    /// True when the per-mount options contain `opt` exactly.
    pub fn has_option(&self, opt: &str) -> bool {
        self.options.iter().any(|o| o == opt)
    }

    /// True when the per-superblock options contain `opt` exactly.
    pub fn has_super_option(&self, opt: &str) -> bool {
        self.super_options.iter().any(|o| o == opt)
    }

    /// True when this mount's path leads to it: not hidden under a later mount at
    /// or above its path (whose filesystem that path then reaches), not gone.
    /// Tools that take a mount point (xfs_growfs, btrfs) must be given one.
    pub fn reachable(&self) -> bool {
        mount_id_at(&self.mount_point) == Some(self.mount_id)
    }
}

/// The id of the mount that `path` leads to (the `mnt_id` the kernel shows for a
/// descriptor of it; device numbers would not do: a btrfs mount's differs from
/// what its files report).
pub fn mount_id_at(path: &Path) -> Option<u32> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", f.as_raw_fd())).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))?
        .trim()
        .parse()
        .ok()
}

/// Path of the mount table of the calling process.
pub const MOUNTINFO: &str = "/proc/self/mountinfo";

/// Read and parse `/proc/self/mountinfo`.
pub fn read() -> Result<Vec<MountEntry>> {
    let text =
        std::fs::read_to_string(MOUNTINFO).map_err(|e| SysError::io("read", MOUNTINFO, e))?;
    Ok(parse(&text))
}

/// Parse the text of a mountinfo file. Lines that do not follow the format are
/// skipped (logged at debug level).
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|line| {
            let entry = parse_line(line);
            if entry.is_none() {
                tracing::debug!(line, "skipping malformed mountinfo line");
            }
            entry
        })
        .collect()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    // Fields are separated by single spaces; an empty source shows up as an empty
    // field, so split on ' ' rather than on runs of whitespace.
    let mut fields = line.split(' ');
    let mount_id = fields.next()?.parse().ok()?;
    let parent_id = fields.next()?.parse().ok()?;
    let (major, minor) = fields.next()?.split_once(':')?;
    let major = major.parse().ok()?;
    let minor = minor.parse().ok()?;
    let root = PathBuf::from(unescape(fields.next()?));
    let mount_point = PathBuf::from(unescape(fields.next()?));
    let options = split_options(fields.next()?);
    let mut optional_fields = Vec::new();
    loop {
        let f = fields.next()?;
        if f == "-" {
            break;
        }
        if !f.is_empty() {
            optional_fields.push(f.to_string());
        }
    }
    let fs_type = unescape(fields.next()?);
    let source = unescape(fields.next()?);
    // Older kernels end the line after the source; treat a missing field as empty.
    let super_options = fields.next().map(split_options).unwrap_or_default();
    Some(MountEntry {
        mount_id,
        parent_id,
        major,
        minor,
        root,
        mount_point,
        options,
        optional_fields,
        fs_type,
        source,
        super_options,
    })
}

fn split_options(s: &str) -> Vec<String> {
    s.split(',')
        .filter(|o| !o.is_empty())
        .map(unescape)
        .collect()
}

/// Decode the kernel's octal escapes (`\040` space, `\011` tab, `\012` newline,
/// `\134` backslash). A backslash not followed by three octal digits is kept as is.
pub fn unescape(s: &str) -> String {
    if !s.contains('\\') {
        return s.to_string();
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() && is_octal_escape(&bytes[i + 1..i + 4]) {
            let v = (bytes[i + 1] - b'0') as u32 * 64
                + (bytes[i + 2] - b'0') as u32 * 8
                + (bytes[i + 3] - b'0') as u32;
            // Three octal digits can encode up to 511; only bytes are meaningful.
            if let Ok(b) = u8::try_from(v) {
                out.push(b);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    // Paths are bytes on Linux; mount points that are not UTF-8 are lossily decoded.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn is_octal_escape(d: &[u8]) -> bool {
    d.len() == 3 && d.iter().all(|c| (b'0'..=b'7').contains(c))
}

/// The entries mounted exactly at `path`, oldest first (the last one is visible).
pub fn mounts_at<'a>(entries: &'a [MountEntry], path: &Path) -> Vec<&'a MountEntry> {
    entries.iter().filter(|e| e.mount_point == path).collect()
}

/// The visible mount at `path` (the last one stacked there), if any.
pub fn mount_at<'a>(entries: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    entries.iter().rev().find(|e| e.mount_point == path)
}

/// The entries whose source is `source` (e.g. every mount of `/dev/loop3`).
pub fn mounts_of_source<'a>(entries: &'a [MountEntry], source: &Path) -> Vec<&'a MountEntry> {
    entries
        .iter()
        .filter(|e| Path::new(&e.source) == source)
        .collect()
}

/// The mount points at or below `path` (to refuse removing a tree with mounts in it).
pub fn mounts_under<'a>(entries: &'a [MountEntry], path: &Path) -> Vec<&'a MountEntry> {
    entries
        .iter()
        .filter(|e| e.mount_point.starts_with(path))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_leads_to_the_mount_the_table_names_for_it() {
        let table = read().unwrap();
        let proc_mount = table
            .iter()
            .rev()
            .find(|e| e.mount_point == Path::new("/proc"))
            .expect("/proc is mounted");
        assert_eq!(mount_id_at(Path::new("/proc")), Some(proc_mount.mount_id));
        assert!(proc_mount.reachable());
        // A path inside /proc that is no mount point leads to /proc's mount.
        assert_eq!(
            mount_id_at(Path::new("/proc/self")),
            Some(proc_mount.mount_id)
        );
        assert_eq!(mount_id_at(Path::new("/no/such/path")), None);
        let gone = MountEntry {
            mount_point: "/no/such/path".into(),
            ..proc_mount.clone()
        };
        assert!(!gone.reachable());
    }

    const SAMPLE: &str = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
36 22 98:0 /mnt1 /mnt/parent rw,noatime master:1 shared:7 - ext3 /dev/root rw,errors=continue
40 22 7:3 / /var/lib/kubelet/pods/x/volumes/my\\040vol ro,nosuid,nodev - xfs /dev/loop3 ro,attr2,inode64
41 22 0:45 /vols/a\\011b /mnt/tab\\012nl\\134back rw - btrfs /dev/loop4 rw,space_cache=v2,subvolid=256,subvol=/vols/a
42 22 0:46 / /run/empty rw - tmpfs  rw,size=4k
";

    #[test]
    fn parses_fields_and_optional_fields() {
        let m = parse(SAMPLE);
        assert_eq!(m.len(), 5);
        assert_eq!(m[0].mount_id, 22);
        assert_eq!(m[0].parent_id, 1);
        assert_eq!((m[0].major, m[0].minor), (254, 0));
        assert_eq!(m[0].optional_fields, vec!["shared:1"]);
        assert_eq!(m[0].fs_type, "ext4");
        assert_eq!(m[0].source, "/dev/vda");
        assert_eq!(m[0].super_options, vec!["rw", "discard"]);

        assert_eq!(m[1].root, PathBuf::from("/mnt1"));
        assert_eq!(m[1].optional_fields, vec!["master:1", "shared:7"]);
        assert_eq!(m[1].options, vec!["rw", "noatime"]);
        assert!(!m[1].read_only());
        assert!(m[1].has_option("noatime"));
        assert!(m[1].has_super_option("errors=continue"));
    }

    #[test]
    fn decodes_octal_escapes() {
        let m = parse(SAMPLE);
        assert_eq!(
            m[2].mount_point,
            PathBuf::from("/var/lib/kubelet/pods/x/volumes/my vol")
        );
        assert!(m[2].read_only());
        assert!(m[2].optional_fields.is_empty());
        assert_eq!(m[3].root, PathBuf::from("/vols/a\tb"));
        assert_eq!(m[3].mount_point, PathBuf::from("/mnt/tab\nnl\\back"));
        assert_eq!(unescape("a\\b\\0"), "a\\b\\0");
        assert_eq!(unescape("end\\04"), "end\\04");
        assert_eq!(unescape("\\777x"), "\\777x");
    }

    #[test]
    fn empty_source_and_malformed_lines() {
        let m = parse(SAMPLE);
        assert_eq!(m[4].source, "");
        assert_eq!(m[4].fs_type, "tmpfs");
        let bad = "garbage\n1 2 3\n22 1 254:0 / / rw shared:1 ext4 /dev/vda rw\n";
        assert!(parse(bad).is_empty());
        let no_super = "5 1 0:1 / /x rw - proc proc\n";
        assert_eq!(parse(no_super)[0].super_options, Vec::<String>::new());
    }

    #[test]
    fn lookups() {
        let m = parse(SAMPLE);
        assert_eq!(mount_at(&m, Path::new("/mnt/parent")).unwrap().mount_id, 36);
        assert_eq!(mounts_of_source(&m, Path::new("/dev/loop3")).len(), 1);
        assert_eq!(mounts_under(&m, Path::new("/var/lib/kubelet")).len(), 1);
        assert!(mount_at(&m, Path::new("/nope")).is_none());
    }

    #[test]
    fn reads_own_table() {
        let m = read().unwrap();
        assert!(m.iter().any(|e| e.mount_point == Path::new("/")));
    }
}
