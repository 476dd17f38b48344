//! A record of the file-system operations the helpers of [`crate::file`],
//! [`crate::flock`] and [`crate::xattr`] issue, and a model of what a power loss
//! could leave of them on disk.
//!
//! Only tests turn it on (cargo feature `fs-recording`); without the feature every
//! `note` compiles to nothing. A test records a workload under one directory,
//! then asks the [`Model`] for every on-disk state a power loss at each operation
//! boundary could leave, rebuilds each state and starts the driver's recovery on it.
//!
//! The model's rules (docs/reliability.md repeats them):
//! 1. A file's data, length and extended attributes reach the disk at an fsync of
//!    that file. Until then a crash leaves the state of its last fsync (empty for a
//!    file never synced), the current state, or the current length with the data
//!    written since the fsync missing (the old bytes, zeros beyond them).
//! 2. A directory's entries (create, mkdir, rename, unlink) reach the disk at an
//!    fsync of that directory, never by the fsync of a file in it. Until then a crash
//!    leaves the changes since its last fsync applied up to some point, in order
//!    (the journals of ext4 and xfs keep the order; a rename within a directory is
//!    atomic).
//! 3. A directory whose own entry did not reach the disk takes its contents with it.
//! 4. syncfs makes everything durable.
//! 5. `fdatasync` makes a file's data and length durable, not its extended
//!    attributes.
//! 6. Appends since a file's last sync may reach the disk in part: each one cut
//!    short (one byte of it, or half of it) after the earlier ones whole.
//! 7. A write with `RWF_DSYNC` (or to a file opened `O_DSYNC`) is durable when it
//!    returns, with whatever is needed to read it back (the length it reaches);
//!    the file's other writes since its last sync are not. Until it returns it is
//!    an ordinary write (rules 1 and 6).

use std::path::PathBuf;

/// One operation, with the path it was issued on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsOp {
    /// open with O_CREAT: a new empty file when absent; emptied when `truncate`.
    Create {
        path: PathBuf,
        truncate: bool,
    },
    Write {
        path: PathBuf,
        offset: u64,
        data: Vec<u8>,
    },
    SetLen {
        path: PathBuf,
        len: u64,
    },
    /// `dst`'s data becomes `src`'s (a reflink or a copy).
    CopyData {
        src: PathBuf,
        dst: PathBuf,
    },
    SetXattr {
        path: PathBuf,
        name: String,
        value: Vec<u8>,
    },
    RemoveXattr {
        path: PathBuf,
        name: String,
    },
    /// fsync of a file or a directory.
    Fsync {
        path: PathBuf,
    },
    /// fdatasync of a file: its data and length, not its attributes.
    SyncData {
        path: PathBuf,
    },
    /// The end of a write made with `RWF_DSYNC`: that range of the file (written
    /// just before) and the length it reaches are durable.
    SyncRange {
        path: PathBuf,
        offset: u64,
        len: u64,
    },
    Rename {
        from: PathBuf,
        to: PathBuf,
    },
    Unlink {
        path: PathBuf,
    },
    Mkdir {
        path: PathBuf,
    },
    RemoveTree {
        path: PathBuf,
    },
    SyncFs {
        path: PathBuf,
    },
    /// Anything the model does not know (a symlink, a device node): a recording
    /// holding one cannot be replayed.
    Other {
        what: &'static str,
        path: PathBuf,
    },
    /// A point the test marks between operations (an acknowledged call).
    Mark(String),
}

#[cfg(feature = "fs-recording")]
impl FsOp {
    /// The path the operation changes (a rename's destination); None for a mark.
    pub fn path(&self) -> Option<&std::path::Path> {
        match self {
            FsOp::Create { path, .. }
            | FsOp::Write { path, .. }
            | FsOp::SetLen { path, .. }
            | FsOp::SetXattr { path, .. }
            | FsOp::RemoveXattr { path, .. }
            | FsOp::Fsync { path }
            | FsOp::SyncData { path }
            | FsOp::SyncRange { path, .. }
            | FsOp::Unlink { path }
            | FsOp::Mkdir { path }
            | FsOp::RemoveTree { path }
            | FsOp::SyncFs { path }
            | FsOp::Other { path, .. } => Some(path),
            FsOp::CopyData { dst, .. } => Some(dst),
            FsOp::Rename { to, .. } => Some(to),
            FsOp::Mark(_) => None,
        }
    }
}

#[cfg(not(feature = "fs-recording"))]
#[inline(always)]
pub(crate) fn note(_op: impl FnOnce() -> FsOp) {}

#[cfg(feature = "fs-recording")]
pub(crate) use recording::note;
#[cfg(feature = "fs-recording")]
pub use recording::{read_tree, Data, Model, Recording, Tree};

#[cfg(feature = "fs-recording")]
mod recording {
    use std::collections::{BTreeMap, BTreeSet};
    use std::ffi::OsString;
    use std::fs;
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::Mutex;

    use super::FsOp;

    static ACTIVE: AtomicUsize = AtomicUsize::new(0);
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static LOGS: Mutex<Vec<(u64, PathBuf, Vec<FsOp>)>> = Mutex::new(Vec::new());

    fn logs() -> std::sync::MutexGuard<'static, Vec<(u64, PathBuf, Vec<FsOp>)>> {
        LOGS.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn note(op: impl FnOnce() -> FsOp) {
        if ACTIVE.load(Ordering::Acquire) == 0 {
            return;
        }
        let op = op();
        let Some(path) = op.path() else { return };
        for (_, root, ops) in logs().iter_mut() {
            if path.starts_with(root) {
                ops.push(op.clone());
            }
        }
    }

    /// The operations issued below one directory while it lives.
    pub struct Recording {
        id: u64,
        root: PathBuf,
    }

    impl Recording {
        pub fn start(root: &Path) -> Recording {
            let id = NEXT.fetch_add(1, Ordering::Relaxed);
            logs().push((id, root.to_path_buf(), Vec::new()));
            ACTIVE.fetch_add(1, Ordering::Release);
            Recording {
                id,
                root: root.to_path_buf(),
            }
        }

        pub fn mark(&self, label: &str) {
            self.with(|ops| ops.push(FsOp::Mark(label.to_string())));
        }

        /// Writes `data` into an existing file and fsyncs it, as a user of a
        /// volume would, recording both.
        pub fn write_durably(&self, path: &Path, offset: u64, data: &[u8]) {
            let f = fs::OpenOptions::new().write(true).open(path).unwrap();
            f.write_all_at(data, offset).unwrap();
            f.sync_all().unwrap();
            self.with(|ops| {
                ops.push(FsOp::Write {
                    path: path.to_path_buf(),
                    offset,
                    data: data.to_vec(),
                });
                ops.push(FsOp::Fsync {
                    path: path.to_path_buf(),
                });
            });
        }

        pub fn ops(&self) -> Vec<FsOp> {
            let mut out = Vec::new();
            self.with(|ops| out = ops.clone());
            out
        }

        pub fn root(&self) -> &Path {
            &self.root
        }

        fn with(&self, f: impl FnOnce(&mut Vec<FsOp>)) {
            if let Some((_, _, ops)) = logs().iter_mut().find(|(id, _, _)| *id == self.id) {
                f(ops);
            }
        }
    }

    impl Drop for Recording {
        fn drop(&mut self) {
            logs().retain(|(id, _, _)| *id != self.id);
            ACTIVE.fetch_sub(1, Ordering::Release);
        }
    }

    /// A file's content as the model knows it: the first bytes, the length (the
    /// rest reads as zeros) and the extended attributes.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub struct Data {
        pub bytes: Vec<u8>,
        pub len: u64,
        pub xattrs: BTreeMap<String, Vec<u8>>,
    }

    /// A whole tree below the root: relative path to a file's data, or None for a
    /// directory.
    pub type Tree = BTreeMap<PathBuf, Option<Data>>;

    type Ino = usize;

    #[derive(Debug, Clone)]
    enum Change {
        Put(OsString, Ino),
        Del(OsString),
        Move(OsString, OsString, Ino),
    }

    #[derive(Debug, Clone, Default)]
    struct Dir {
        entries: BTreeMap<OsString, Ino>,
        durable: BTreeMap<OsString, Ino>,
        pending: Vec<Change>,
    }

    /// The writes (offset, bytes) to a file since its last sync, when nothing
    /// else changed it: what a crash may leave of them in part (rule 6).
    type Writes = Option<Vec<(u64, Vec<u8>)>>;

    #[derive(Debug, Clone)]
    enum Inode {
        File {
            cur: Data,
            synced: Data,
            writes: Writes,
        },
        Dir(Dir),
    }

    fn new_file(cur: Data, synced: Data) -> Inode {
        Inode::File {
            cur,
            synced,
            writes: Some(Vec::new()),
        }
    }

    /// The files below a root, as the operations left them and as the disk has them.
    #[derive(Debug, Clone)]
    pub struct Model {
        root: PathBuf,
        inodes: Vec<Inode>,
    }

    /// More states than this at one crash point means the workload is too large
    /// for an exhaustive check.
    const MAX_STATES: usize = 100_000;

    impl Model {
        /// The tree below `root` as it is now, taken as durable.
        pub fn scan(root: &Path) -> Model {
            let mut m = Model {
                root: root.to_path_buf(),
                inodes: Vec::new(),
            };
            m.scan_dir(root);
            m
        }

        fn scan_dir(&mut self, dir: &Path) -> Ino {
            let ino = self.inodes.len();
            self.inodes.push(Inode::Dir(Dir::default()));
            let mut entries = BTreeMap::new();
            for e in fs::read_dir(dir).unwrap().flatten() {
                let path = e.path();
                let child = if e.file_type().unwrap().is_dir() {
                    self.scan_dir(&path)
                } else {
                    let data = read_data(&path);
                    self.inodes.push(new_file(data.clone(), data));
                    self.inodes.len() - 1
                };
                entries.insert(e.file_name(), child);
            }
            self.inodes[ino] = Inode::Dir(Dir {
                durable: entries.clone(),
                entries,
                pending: Vec::new(),
            });
            ino
        }

        fn lookup(&self, path: &Path) -> Option<Ino> {
            let rel = path.strip_prefix(&self.root).ok()?;
            let mut ino = 0;
            for c in rel.components() {
                match &self.inodes[ino] {
                    Inode::Dir(d) => ino = *d.entries.get(c.as_os_str())?,
                    Inode::File { .. } => return None,
                }
            }
            Some(ino)
        }

        fn parent(&self, path: &Path) -> (Ino, OsString) {
            let parent = path.parent().expect("a path with a parent");
            let ino = self.lookup(parent).unwrap_or_else(|| {
                panic!(
                    "recording incomplete: {} does not exist in the model",
                    parent.display()
                )
            });
            (ino, path.file_name().unwrap().to_os_string())
        }

        fn dir(&mut self, ino: Ino) -> &mut Dir {
            match &mut self.inodes[ino] {
                Inode::Dir(d) => d,
                Inode::File { .. } => panic!("not a directory in the model"),
            }
        }

        /// A file's current data, changed by something other than a write.
        fn file(&mut self, path: &Path) -> &mut Data {
            let (cur, writes) = self.file_and_writes(path);
            *writes = None;
            cur
        }

        fn file_and_writes(&mut self, path: &Path) -> (&mut Data, &mut Writes) {
            let ino = self.lookup(path).unwrap_or_else(|| {
                panic!(
                    "recording incomplete: {} does not exist in the model",
                    path.display()
                )
            });
            match &mut self.inodes[ino] {
                Inode::File { cur, writes, .. } => (cur, writes),
                Inode::Dir(_) => panic!("{} is a directory in the model", path.display()),
            }
        }

        fn add(&mut self, path: &Path, inode: Inode) {
            let (p, name) = self.parent(path);
            let ino = self.inodes.len();
            self.inodes.push(inode);
            let d = self.dir(p);
            d.entries.insert(name.clone(), ino);
            d.pending.push(Change::Put(name, ino));
        }

        fn sync(&mut self, ino: Ino) {
            match &mut self.inodes[ino] {
                Inode::File {
                    cur,
                    synced,
                    writes,
                } => {
                    *synced = cur.clone();
                    *writes = Some(Vec::new());
                }
                Inode::Dir(d) => {
                    d.durable = d.entries.clone();
                    d.pending.clear();
                }
            }
        }

        /// Applies one operation (paths outside the root are ignored).
        pub fn apply(&mut self, op: &FsOp) {
            if op.path().is_none_or(|p| !p.starts_with(&self.root)) {
                return;
            }
            match op {
                FsOp::Create { path, truncate } => self.create(path, *truncate),
                FsOp::Write { path, offset, data } => self.write(path, *offset, data),
                FsOp::SetLen { path, len } => {
                    let d = self.file(path);
                    d.len = *len;
                    d.bytes.truncate(*len as usize);
                }
                FsOp::CopyData { src, dst } => {
                    let s = self.file(src).clone();
                    let d = self.file(dst);
                    d.bytes = s.bytes;
                    d.len = s.len;
                }
                FsOp::SetXattr { path, name, value } => {
                    self.file(path).xattrs.insert(name.clone(), value.clone());
                }
                FsOp::RemoveXattr { path, name } => {
                    self.file(path).xattrs.remove(name);
                }
                FsOp::Fsync { path } => {
                    let ino = self.lookup(path).expect("fsync of a path the model knows");
                    self.sync(ino);
                }
                FsOp::SyncData { path } => self.sync_data(path),
                FsOp::SyncRange { path, offset, len } => self.sync_range(path, *offset, *len),
                FsOp::Rename { from, to } => self.rename(from, to),
                FsOp::Unlink { path } | FsOp::RemoveTree { path } => self.unlink(path),
                FsOp::Mkdir { path } => self.add(path, Inode::Dir(Dir::default())),
                FsOp::SyncFs { .. } => {
                    for ino in 0..self.inodes.len() {
                        self.sync(ino);
                    }
                }
                FsOp::Other { what, path } => {
                    panic!("the model does not know {what} (at {})", path.display())
                }
                FsOp::Mark(_) => {}
            }
        }

        fn create(&mut self, path: &Path, truncate: bool) {
            match self.lookup(path) {
                Some(_) if truncate => {
                    let d = self.file(path);
                    d.bytes.clear();
                    d.len = 0;
                }
                Some(_) => {}
                None => self.add(path, new_file(Data::default(), Data::default())),
            }
        }

        fn write(&mut self, path: &Path, offset: u64, data: &[u8]) {
            let (d, writes) = self.file_and_writes(path);
            write_into(d, offset, data);
            if let Some(w) = writes {
                w.push((offset, data.to_vec()));
            }
        }

        /// fdatasync: the data and length become durable, the attributes do not.
        fn sync_data(&mut self, path: &Path) {
            let ino = self
                .lookup(path)
                .expect("fdatasync of a path the model knows");
            if let Inode::File {
                cur,
                synced,
                writes,
            } = &mut self.inodes[ino]
            {
                let xattrs = std::mem::take(&mut synced.xattrs);
                *synced = Data {
                    xattrs,
                    ..cur.clone()
                };
                *writes = Some(Vec::new());
            }
        }

        /// RWF_DSYNC's end: the range and the length it reaches become durable;
        /// the file's other writes since its last sync stay as they were.
        fn sync_range(&mut self, path: &Path, offset: u64, len: u64) {
            let ino = self
                .lookup(path)
                .expect("a synced write to a path the model knows");
            if let Inode::File {
                cur,
                synced,
                writes,
            } = &mut self.inodes[ino]
            {
                let end = (offset + len) as usize;
                let range = cur.bytes[offset as usize..end].to_vec();
                write_into(synced, offset, &range);
                if let Some(w) = writes {
                    if let Some(i) = w
                        .iter()
                        .rposition(|(o, d)| *o == offset && d.len() as u64 == len)
                    {
                        w.remove(i);
                    }
                }
            }
        }

        /// A rename within one directory is one atomic change of it; across two,
        /// a removal from one and an addition to the other.
        fn rename(&mut self, from: &Path, to: &Path) {
            let (fp, fname) = self.parent(from);
            let (tp, tname) = self.parent(to);
            let ino = self
                .dir(fp)
                .entries
                .remove(&fname)
                .expect("rename of a path the model knows");
            if fp == tp {
                let d = self.dir(fp);
                d.entries.insert(tname.clone(), ino);
                d.pending.push(Change::Move(fname, tname, ino));
            } else {
                self.dir(fp).pending.push(Change::Del(fname));
                let d = self.dir(tp);
                d.entries.insert(tname.clone(), ino);
                d.pending.push(Change::Put(tname, ino));
            }
        }

        fn unlink(&mut self, path: &Path) {
            let (p, name) = self.parent(path);
            let d = self.dir(p);
            if d.entries.remove(&name).is_some() {
                d.pending.push(Change::Del(name));
            }
        }

        /// The tree as the operations left it (what a reader sees before a crash).
        pub fn current(&self) -> Tree {
            let mut out = Tree::new();
            self.walk_current(0, PathBuf::new(), &mut out);
            out
        }

        fn walk_current(&self, ino: Ino, at: PathBuf, out: &mut Tree) {
            match &self.inodes[ino] {
                Inode::File { cur, .. } => {
                    out.insert(at, Some(cur.clone()));
                }
                Inode::Dir(d) => {
                    if !at.as_os_str().is_empty() {
                        out.insert(at.clone(), None);
                    }
                    for (name, child) in &d.entries {
                        self.walk_current(*child, at.join(name), out);
                    }
                }
            }
        }

        /// Every distinct tree a power loss now could leave on disk.
        pub fn crash_states(&self) -> Vec<Tree> {
            let mut seen = BTreeSet::new();
            self.states_of(0, &PathBuf::new(), &mut Vec::new())
                .into_iter()
                .filter(|t| seen.insert(t.clone()))
                .collect()
        }

        /// The trees the directory `ino` at `at` could leave; `open` holds the
        /// directories above it, so that a cycle can never recurse.
        fn states_of(&self, ino: Ino, at: &Path, open: &mut Vec<Ino>) -> Vec<Tree> {
            let Inode::Dir(d) = &self.inodes[ino] else {
                unreachable!("states_of a file");
            };
            let mut listings: Vec<BTreeMap<OsString, Ino>> = Vec::new();
            let mut entries = d.durable.clone();
            listings.push(entries.clone());
            for change in &d.pending {
                match change {
                    Change::Put(name, ino) => {
                        entries.insert(name.clone(), *ino);
                    }
                    Change::Del(name) => {
                        entries.remove(name);
                    }
                    Change::Move(from, to, ino) => {
                        entries.remove(from);
                        entries.insert(to.clone(), *ino);
                    }
                }
                if !listings.contains(&entries) {
                    listings.push(entries.clone());
                }
            }
            open.push(ino);
            let mut out = Vec::new();
            for listing in listings {
                let mut trees = vec![Tree::new()];
                if !at.as_os_str().is_empty() {
                    trees[0].insert(at.to_path_buf(), None);
                }
                for (name, child) in &listing {
                    let path = at.join(name);
                    let options: Vec<Tree> = match &self.inodes[*child] {
                        _ if open.contains(child) => continue,
                        Inode::File {
                            cur,
                            synced,
                            writes,
                        } => file_variants(cur, synced, writes.as_deref())
                            .into_iter()
                            .map(|d| Tree::from([(path.clone(), Some(d))]))
                            .collect(),
                        Inode::Dir(_) => self.states_of(*child, &path, open),
                    };
                    let mut next = Vec::with_capacity(trees.len() * options.len());
                    for t in &trees {
                        for o in &options {
                            let mut t = t.clone();
                            t.extend(o.iter().map(|(k, v)| (k.clone(), v.clone())));
                            next.push(t);
                        }
                    }
                    assert!(
                        next.len() <= MAX_STATES,
                        "more than {MAX_STATES} crash states below {}",
                        at.display()
                    );
                    trees = next;
                }
                out.extend(trees);
            }
            open.pop();
            out
        }
    }

    fn write_into(d: &mut Data, offset: u64, data: &[u8]) {
        let end = offset as usize + data.len();
        if d.bytes.len() < end {
            d.bytes.resize(end, 0);
        }
        d.bytes[offset as usize..end].copy_from_slice(data);
        d.len = d.len.max(end as u64);
    }

    /// Rules 1 and 6: what a crash may leave of a file.
    fn file_variants(cur: &Data, synced: &Data, writes: Option<&[(u64, Vec<u8>)]>) -> Vec<Data> {
        if cur == synced {
            return vec![cur.clone()];
        }
        let mut bytes = synced.bytes.clone();
        bytes.truncate(cur.len as usize);
        let lost_data = Data {
            bytes,
            len: cur.len,
            xattrs: synced.xattrs.clone(),
        };
        let mut v = vec![synced.clone(), cur.clone()];
        let push = |d: Data, v: &mut Vec<Data>| {
            if !v.contains(&d) {
                v.push(d);
            }
        };
        push(lost_data, &mut v);
        // The writes in order, the last of them cut short.
        let mut whole = Data {
            xattrs: synced.xattrs.clone(),
            ..synced.clone()
        };
        for (offset, data) in writes.unwrap_or_default() {
            // Only an append: a write inside the file (a pod's, into its image) is
            // not the driver's to order.
            let append = *offset >= whole.len;
            for cut in [1, data.len() / 2] {
                if append && cut > 0 && cut < data.len() {
                    let mut torn = whole.clone();
                    write_into(&mut torn, *offset, &data[..cut]);
                    push(torn, &mut v);
                }
            }
            write_into(&mut whole, *offset, data);
            push(whole.clone(), &mut v);
        }
        v
    }

    /// Makes `tree` real below `root`, which must be empty.
    pub fn materialize(root: &Path, tree: &Tree) {
        for (rel, data) in tree {
            let path = root.join(rel);
            match data {
                None => fs::create_dir(&path).unwrap(),
                Some(d) => {
                    let f = fs::File::create(&path).unwrap();
                    f.write_all_at(&d.bytes, 0).unwrap();
                    f.set_len(d.len).unwrap();
                    for (k, v) in &d.xattrs {
                        crate::xattr::set(&path, k, v).unwrap();
                    }
                }
            }
        }
    }

    /// Reads the tree below `root` as it is on disk, in the model's terms: the
    /// bytes up to the last one that is not zero (at most the first MiB).
    pub fn read_tree(root: &Path) -> Tree {
        let mut out = Tree::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in fs::read_dir(&dir).unwrap().flatten() {
                let path = e.path();
                let rel = path.strip_prefix(root).unwrap().to_path_buf();
                if e.file_type().unwrap().is_dir() {
                    out.insert(rel, None);
                    stack.push(path);
                } else {
                    out.insert(rel, Some(read_data(&path)));
                }
            }
        }
        out
    }

    fn read_data(path: &Path) -> Data {
        let f = fs::File::open(path).unwrap();
        let len = f.metadata().unwrap().len();
        let mut bytes = Vec::new();
        f.take(1 << 20).read_to_end(&mut bytes).unwrap();
        Data {
            bytes,
            len,
            xattrs: user_xattrs(path),
        }
    }

    /// The `user.` extended attributes of a file, without the prefix.
    fn user_xattrs(path: &Path) -> BTreeMap<String, Vec<u8>> {
        let mut out = BTreeMap::new();
        for short in crate::xattr::list_user(path).unwrap_or_default() {
            if let Ok(Some(v)) = crate::xattr::get(path, &short) {
                out.insert(short, v);
            }
        }
        out
    }

    impl Data {
        /// The same content, with the trailing zeros of `bytes` dropped, so that
        /// "written as zeros" and "never written" compare equal.
        pub fn normalized(&self) -> Data {
            let mut d = self.clone();
            while d.bytes.last() == Some(&0) {
                d.bytes.pop();
            }
            d
        }
    }

    impl Model {
        /// Makes `tree` real below the root (emptied first).
        pub fn rebuild(&self, tree: &Tree) {
            if self.root.exists() {
                fs::remove_dir_all(&self.root).unwrap();
            }
            fs::create_dir(&self.root).unwrap();
            materialize(&self.root, tree);
        }
    }
}
