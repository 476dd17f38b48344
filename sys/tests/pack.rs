//! A directory tree packed into one stream and made again from it (how a
//! directory volume travels to another node): everything the copy of a tree
//! keeps arrives equal, holes stay holes, and a stream that breaks a rule is
//! refused without anything made outside the directory it is unpacked into.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::{require_root, MIB};
use csi_sys::tree;

/// What a tree holds, entry by entry: kind, mode, owner, mtime, length, data
/// (digest) or link target.
fn describe(root: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let ft = m.file_type();
            let what = if ft.is_dir() {
                todo.push(p.clone());
                "dir".to_string()
            } else if ft.is_symlink() {
                format!("link {}", fs::read_link(&p).unwrap().display())
            } else if ft.is_file() {
                {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    fs::read(&p).unwrap().hash(&mut h);
                    format!("file {:x}", h.finish())
                }
            } else if ft.is_fifo() {
                "fifo".to_string()
            } else {
                format!("node {}", m.rdev())
            };
            let mtime = if ft.is_symlink() { 0 } else { m.mtime() };
            out.insert(
                p.strip_prefix(root).unwrap().to_path_buf(),
                format!(
                    "{what} mode {:o} owner {}:{} mtime {mtime} len {}",
                    m.mode(),
                    m.uid(),
                    m.gid(),
                    if ft.is_dir() { 0 } else { m.len() }
                ),
            );
        }
    }
    out
}

fn write_at(path: &Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap();
    f.write_all_at(data, offset).unwrap();
}

/// A tree with one of everything a volume may hold.
fn sample_tree(root: &Path) {
    fs::create_dir_all(root.join("a/b/c")).unwrap();
    fs::write(root.join("empty"), b"").unwrap();
    fs::write(root.join("a/small"), b"hello, other node\n").unwrap();
    let big: Vec<u8> = (0..3 * MIB as usize + 12_345)
        .map(|i| (i * 31 % 251) as u8)
        .collect();
    fs::write(root.join("a/b/big"), &big).unwrap();
    // 64 MiB long, two islands of data: the rest stays holes.
    let sparse = root.join("a/b/c/sparse");
    write_at(&sparse, 5 * MIB, b"island one");
    write_at(&sparse, 40 * MIB + 17, &[7u8; 200_000]);
    fs::OpenOptions::new()
        .write(true)
        .open(&sparse)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    std::os::unix::fs::symlink("/etc/shadow", root.join("a/outside-link")).unwrap();
    std::os::unix::fs::symlink("../small", root.join("a/b/relative-link")).unwrap();
    nix::unistd::mkfifo(
        &root.join("a/fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o640),
    )
    .unwrap();
    fs::set_permissions(root.join("a/small"), fs::Permissions::from_mode(0o4751)).unwrap();
    std::os::unix::fs::chown(root.join("a/b/big"), Some(1234), Some(5678)).unwrap();
    std::os::unix::fs::lchown(root.join("a/outside-link"), Some(42), Some(43)).unwrap();
    std::os::unix::fs::chown(root.join("a/b"), Some(1000), Some(1000)).unwrap();
    fs::set_permissions(root.join("a/b/c"), fs::Permissions::from_mode(0o2770)).unwrap();
    fs::set_permissions(root, fs::Permissions::from_mode(0o775)).unwrap();
}

#[test]
#[ignore = "needs root: entries of other owners and a device node"]
fn root_a_packed_tree_arrives_equal_with_its_holes() {
    require_root();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    sample_tree(&src);
    nix::sys::stat::mknod(
        &src.join("a/null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    let stream = tmp.path().join("tree.pack");
    let packed = tree::pack_tree(&src, &stream).unwrap();
    assert_eq!(packed.report.entries, 11, "{packed:?}");
    assert_eq!(packed.bytes, fs::metadata(&stream).unwrap().len());
    // Only data travels: the 64 MiB sparse file costs its islands.
    // (the islands of the sparse file as whole blocks of the filesystem)
    let written = 18 + 3 * MIB + 12_345 + 10 + 200_000;
    assert!(
        (written..written + 16 * 1024).contains(&packed.data),
        "{packed:?}"
    );
    let data = packed.data;
    assert!(packed.bytes < data + 4096, "{packed:?}");

    let dst = tmp.path().join("dst");
    fs::create_dir(&dst).unwrap();
    let report = tree::unpack_tree(&stream, &dst, data).unwrap();
    assert_eq!(report.entries, 11);
    assert_eq!(describe(&src), describe(&dst));
    let root = fs::metadata(&dst).unwrap();
    assert_eq!(root.mode() & 0o7777, 0o775);
    let sparse = fs::metadata(dst.join("a/b/c/sparse")).unwrap();
    assert_eq!(sparse.len(), 64 * MIB);
    assert!(
        sparse.blocks() * 512 < 2 * MIB,
        "holes stay holes: {} bytes allocated",
        sparse.blocks() * 512
    );
    // A byte less of data allowed: refused.
    let again = tmp.path().join("again");
    fs::create_dir(&again).unwrap();
    let e = tree::unpack_tree(&stream, &again, data - 1).unwrap_err();
    assert!(e.is_invalid_argument(), "{e}");
    // Into a directory that holds anything: refused.
    let e = tree::unpack_tree(&stream, &dst, data).unwrap_err();
    assert!(e.is_invalid_argument(), "{e}");
}

/// A hand-made stream, record by record.
#[derive(Default)]
struct Stream(Vec<u8>);

const DIR_MODE: u32 = 0o040755;
const FILE_MODE: u32 = 0o100644;
const LINK_MODE: u32 = 0o120777;

impl Stream {
    fn new() -> Stream {
        Stream(b"example-csi tree v1\n".to_vec())
    }
    fn tag(mut self, t: u8) -> Self {
        self.0.push(t);
        self
    }
    fn name(mut self, n: &[u8]) -> Self {
        self.0.extend_from_slice(&(n.len() as u16).to_le_bytes());
        self.0.extend_from_slice(n);
        self
    }
    fn meta(mut self, mode: u32) -> Self {
        self.0.extend_from_slice(&mode.to_le_bytes());
        self.0.extend_from_slice(&[0u8; 8]);
        self.0.extend_from_slice(&[0u8; 24]);
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn piece(mut self, offset: u64, data: &[u8]) -> Self {
        self.0.extend_from_slice(&offset.to_le_bytes());
        self.0.extend_from_slice(&(data.len() as u32).to_le_bytes());
        self.0.extend_from_slice(data);
        self
    }
    fn file(self, name: &[u8], len: u64, pieces: &[(u64, &[u8])]) -> Self {
        let mut s = self.tag(3).name(name).meta(FILE_MODE).u64(len);
        for (o, d) in pieces {
            s = s.piece(*o, d);
        }
        s.piece(0, b"")
    }
    fn end(self, entries: u64) -> Self {
        self.tag(6).meta(DIR_MODE).u64(entries)
    }
}

#[test]
#[ignore = "needs root: the unpack sets owners"]
fn root_a_stream_that_breaks_a_rule_is_refused_and_nothing_outside_changes() {
    require_root();
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("secret"), b"untouched").unwrap();
    let ok = Stream::new().file(b"f", 4, &[(0, b"data")]).end(1);
    let cases: Vec<(&str, Stream)> = vec![
        (
            "a name of two dots",
            Stream::new()
                .tag(1)
                .name(b"..")
                .meta(DIR_MODE)
                .tag(2)
                .end(1),
        ),
        (
            "a name with a slash",
            Stream::new()
                .file(b"../outside/secret", 1, &[(0, b"x")])
                .end(1),
        ),
        (
            "an empty name",
            Stream::new().file(b"", 1, &[(0, b"x")]).end(1),
        ),
        (
            "a NUL in a name",
            Stream::new().file(b"a\0b", 1, &[(0, b"x")]).end(1),
        ),
        (
            "a piece past the length",
            Stream::new().file(b"f", 2, &[(0, b"abc")]).end(1),
        ),
        (
            "pieces out of order",
            Stream::new()
                .file(b"f", 10, &[(4, b"ab"), (0, b"cd")])
                .end(1),
        ),
        (
            "more data than allowed",
            Stream::new().file(b"f", 64, &[(0, &[1u8; 33])]).end(1),
        ),
        ("a link then a file through it", {
            let s = Stream::new()
                .tag(4)
                .name(b"l")
                .meta(LINK_MODE)
                .name(outside.as_os_str().as_encoded_bytes());
            s.tag(1)
                .name(b"l")
                .meta(DIR_MODE)
                .file(b"secret", 3, &[(0, b"bad")])
                .tag(2)
                .end(3)
        }),
        ("a file over a link of the same name", {
            let target = outside.join("secret");
            let s = Stream::new()
                .tag(4)
                .name(b"l")
                .meta(LINK_MODE)
                .name(target.as_os_str().as_encoded_bytes());
            s.file(b"l", 3, &[(0, b"bad")]).end(2)
        }),
        (
            "a mode of another kind",
            Stream::new()
                .tag(3)
                .name(b"f")
                .meta(DIR_MODE)
                .u64(0)
                .piece(0, b"")
                .end(1),
        ),
        ("an UP without its DIR", Stream::new().tag(2).end(0)),
        (
            "an end inside a directory",
            Stream::new().tag(1).name(b"d").meta(DIR_MODE).end(1),
        ),
        (
            "a wrong count",
            Stream::new().file(b"f", 4, &[(0, b"data")]).end(7),
        ),
        (
            "bytes after the end",
            Stream::new().file(b"f", 4, &[(0, b"data")]).end(1).tag(1),
        ),
        ("a cut stream", {
            let mut s = ok.0.clone();
            s.truncate(s.len() - 3);
            Stream(s)
        }),
        ("an unknown record", Stream::new().tag(9).end(0)),
        (
            "another format",
            Stream(b"something else entirely".to_vec()),
        ),
    ];
    let run = |name: &str, s: &Stream| {
        let dst = tmp.path().join(format!("dst-{}", name.replace(' ', "-")));
        fs::create_dir(&dst).unwrap();
        let stream = tmp.path().join("hostile.pack");
        let mut f = fs::File::create(&stream).unwrap();
        f.write_all(&s.0).unwrap();
        drop(f);
        tree::unpack_tree(&stream, &dst, 32)
    };
    run("fine", &ok).expect("the well-made stream is taken");
    for (name, s) in &cases {
        let e = run(name, s).expect_err(name);
        assert!(
            e.is_invalid_argument() || e.to_string().contains("exists"),
            "{name}: {e}"
        );
        let names: Vec<_> = fs::read_dir(&outside)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("secret")], "{name}");
        assert_eq!(
            fs::read(outside.join("secret")).unwrap(),
            b"untouched",
            "{name}"
        );
    }
}
