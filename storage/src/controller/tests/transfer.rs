//! Transfers between two nodes, each a world of its own, the target reading
//! the source's hold in-process (the mesh stands between them in a
//! deployment): what arrives equals what was held, holes stay holes, a cut
//! transfer goes on from its checkpoint, a restart of the target finds it
//! again, a hostile source is refused, a second transfer of the same volume
//! sends only what changed, and a delete stops all of it.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::controller::transfer::{
    ArrivingFrom, HoldSource, Piece, Received, Source, Sources, Sum, TransferStatus, CELL,
};
use crate::error::{Error, Result};
use crate::ids::VolumeId;
use crate::model::*;
use crate::testkit::*;
use crate::volumes::{CreateVolume, MIB};
use crate::Controller;

/// How a test source misbehaves.
#[derive(Default)]
struct Faults {
    /// Fails the stream after this many pieces, once.
    cut_after: Option<usize>,
    /// Changes a byte of every piece of data (after its digest).
    corrupt: bool,
    /// Sends the pieces but no trailer.
    no_trailer: bool,
    /// Waits this long before each piece.
    delay: Option<Duration>,
    /// Releases that fail (the source down), before one lands.
    release_failures: usize,
    /// A source of a release before checksums: its pieces carry BLAKE3
    /// digests, whatever the target asks.
    blake3_only: bool,
}

/// What the sources of a test saw.
#[derive(Default)]
struct Seen {
    reads_from: Mutex<Vec<u64>>,
    pieces: AtomicUsize,
    data_bytes: AtomicU64,
    released: Mutex<Vec<bool>>,
    incremental: AtomicBool,
    /// Pieces sent as patches of a cell.
    patches: AtomicUsize,
    /// Pieces of data whose digest is BLAKE3's (XXH3 leaves the last 16
    /// bytes zero).
    blake3_digests: AtomicUsize,
}

struct TestSource {
    from: Arc<Controller>,
    peer: String,
    transfer: String,
    token: String,
    faults: Arc<Mutex<Faults>>,
    seen: Arc<Seen>,
}

impl Source for TestSource {
    fn read<'a>(
        &'a mut self,
        from: u64,
        base: Option<&str>,
        _stop: &'a AtomicBool,
    ) -> Result<Box<dyn Iterator<Item = Result<Received>> + 'a>> {
        self.seen.reads_from.lock().unwrap().push(from);
        let sum = match self.faults.lock().unwrap().blake3_only {
            true => Sum::Blake3,
            false => Sum::Xxh3,
        };
        let peer = self.peer.clone();
        let stream = self
            .from
            .hold_stream(
                &self.transfer,
                &move |n: &str| n == peer,
                &self.token,
                from,
                base,
                base.is_some(),
            )?
            .summed(sum);
        let faults = self.faults.clone();
        let seen = self.seen.clone();
        let mut sent = 0usize;
        Ok(Box::new(stream.filter_map(move |item| {
            let delay = faults.lock().unwrap().delay;
            if let Some(d) = delay {
                std::thread::sleep(d);
            }
            let mut f = faults.lock().unwrap();
            match item {
                Ok(Received::Piece(mut p)) => {
                    if f.cut_after == Some(sent) {
                        f.cut_after = None;
                        return Some(Err(Error::Aborted("the network was cut".into())));
                    }
                    sent += 1;
                    seen.pieces.fetch_add(1, Ordering::Relaxed);
                    if p.is_patch() {
                        seen.patches.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Piece::Data { data, digest, .. } | Piece::Patch { data, digest, .. } =
                        &mut p
                    {
                        if Sum::of_digest(digest) == Sum::Blake3 {
                            seen.blake3_digests.fetch_add(1, Ordering::Relaxed);
                        }
                        seen.data_bytes
                            .fetch_add(data.len() as u64, Ordering::Relaxed);
                        if f.corrupt {
                            let mut bad = data.to_vec();
                            bad[0] ^= 1;
                            *data = bad.into();
                        }
                    }
                    Some(Ok(Received::Piece(p)))
                }
                Ok(Received::Trailer(t)) if f.no_trailer => {
                    let _ = t;
                    None
                }
                Ok(Received::Trailer(t)) => {
                    seen.incremental.store(t.incremental, Ordering::Relaxed);
                    Some(Ok(Received::Trailer(t)))
                }
                Err(e) => Some(Err(e)),
            }
        })))
    }

    fn release(&mut self, keep_as_base: bool) -> Result<()> {
        self.seen.released.lock().unwrap().push(keep_as_base);
        let mut f = self.faults.lock().unwrap();
        if f.release_failures > 0 {
            f.release_failures -= 1;
            return Err(Error::Aborted("node node-1 is down".into()));
        }
        drop(f);
        self.from.release_hold(&self.transfer, keep_as_base)
    }
}

/// Two nodes: `a` holds the data, `b` receives it.
struct Pair {
    a: World,
    b: World,
    faults: Arc<Mutex<Faults>>,
    seen: Arc<Seen>,
}

fn pair() -> Pair {
    let a = World::new();
    let b = World::with(|cfg| cfg.node_id = "node-2".into());
    let p = Pair {
        a,
        b,
        faults: Arc::new(Mutex::new(Faults::default())),
        seen: Arc::new(Seen::default()),
    };
    p.connect();
    p
}

impl Pair {
    fn ca(&self) -> Arc<Controller> {
        self.a.d().controller().unwrap().clone()
    }

    fn cb(&self) -> Arc<Controller> {
        self.b.d().controller().unwrap().clone()
    }

    /// Gives `b` its way to `a` (as the mesh does at start).
    fn connect(&self) {
        let (from, faults, seen) = (self.ca(), self.faults.clone(), self.seen.clone());
        let sources: Sources = Arc::new(move |node: &str, transfer: &str, token: &str| {
            assert_eq!(node, "node-1");
            Box::new(TestSource {
                from: from.clone(),
                peer: "node-2".into(),
                transfer: transfer.into(),
                token: token.into(),
                faults: faults.clone(),
                seen: seen.clone(),
            }) as Box<dyn Source>
        });
        self.cb().start_transfers(sources);
    }

    /// Holds volume `vol` of `a` for `b` and makes `name` on `b` from it.
    fn send(&self, vol: &str, transfer: &str, name: &str) -> VolumeRecord {
        let hold = self
            .ca()
            .hold(
                transfer,
                "node-2",
                HoldSource::Volume(VolumeId::parse(vol).unwrap()),
            )
            .unwrap();
        let req = CreateVolume {
            name: name.into(),
            capacity: CapacityRange::at_least(hold.size as i64),
            capabilities: vec![ext4()],
            ..Default::default()
        };
        self.cb()
            .create_arriving_volume(
                req,
                ArrivingFrom {
                    node: "node-1".into(),
                    transfer_id: transfer.into(),
                    size: hold.size,
                    fs_type: hold.fs_type,
                    requested: hold.requested,
                    source_volume: vol.into(),
                    claim: Some(("ns".into(), "claim".into())),
                    read_token: hold.read_token,
                    tree: hold.tree,
                },
            )
            .unwrap()
    }

    /// Sends `vol` (whose image is `src`) to `b` as "pvc-copy" and waits until
    /// it is there, whole and no longer marked arriving; its record and image.
    fn copy_whole(&self, vol: &str, src: &std::path::Path) -> (VolumeRecord, std::path::PathBuf) {
        let rec = self.send(vol, "t1@node-2", "pvc-copy");
        assert!(
            self.settle(Duration::from_secs(20)).is_empty(),
            "the transfer ended"
        );
        let dst = self.b.image(&rec.id.to_string());
        assert!(!arriving(&dst), "the mark is cleared");
        same_bytes(src, &dst);
        (rec, dst)
    }

    /// Waits until `b` has no transfer running; its statuses at the end.
    fn settle(&self, within: Duration) -> Vec<TransferStatus> {
        let end = Instant::now() + within;
        loop {
            let running: Vec<_> = self
                .cb()
                .transfers()
                .into_iter()
                .filter(|t| t.role == "arriving" && t.state != "done")
                .collect();
            if running.is_empty() || Instant::now() > end {
                return running;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn write_at(path: &std::path::Path, offset: u64, data: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, offset).unwrap();
    f.sync_all().unwrap();
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// A volume of `a` with data at a few places and holes between.
fn volume_with_data(p: &Pair, name: &str) -> (String, std::path::PathBuf) {
    let id = p.a.create(name, ext4());
    let img = p.a.image(&id);
    write_at(&img, 0, &pattern(8192, 1));
    write_at(&img, 3 * CELL + 4096, &pattern(CELL as usize, 2));
    write_at(&img, 40 * MIB, &pattern(100_000, 3));
    (id, img)
}

fn same_bytes(a: &std::path::Path, b: &std::path::Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(x.len(), y.len(), "lengths");
    assert!(x == y, "{} and {} differ", a.display(), b.display());
}

fn arriving(img: &std::path::Path) -> bool {
    crate::core::arrival::arriving_from(img).unwrap().is_some()
}

#[test]
fn a_volume_arrives_whole_and_holes_stay_holes() {
    let p = pair();
    let (vol, src) = volume_with_data(&p, "pvc-src");
    let (rec, dst) = p.copy_whole(&vol, &src);
    // Only the cells with data were sent, and the copy is as sparse as them.
    // (what was written, each cell's part from its first to its last block)
    let written = 8192 + CELL + 100_000u64.next_multiple_of(4096);
    let sent = p.seen.data_bytes.load(Ordering::Relaxed);
    assert!(
        (written..written + 64 * 1024).contains(&sent),
        "{sent} bytes sent for {written}"
    );
    let allocated = std::fs::metadata(&dst).unwrap().blocks() * 512;
    assert!(allocated < 4 * MIB, "{allocated} bytes allocated");
    assert_eq!(
        p.seen.blake3_digests.load(Ordering::Relaxed),
        0,
        "XXH3 sums"
    );
    // The source keeps its hold as the base of the next transfer.
    assert_eq!(*p.seen.released.lock().unwrap(), vec![true]);
    assert!(p.ca().holds().iter().all(|h| h.base));
    // A retry of the create finds the same volume.
    let again = p.send(&vol, "t1@node-2", "pvc-copy");
    assert_eq!(again.id, rec.id);
}

#[test]
fn a_source_of_an_earlier_release_sends_blake3_digests_and_its_volume_arrives_whole() {
    let p = pair();
    p.faults.lock().unwrap().blake3_only = true;
    let (vol, src) = volume_with_data(&p, "pvc-src");
    p.copy_whole(&vol, &src);
    assert!(p.seen.blake3_digests.load(Ordering::Relaxed) >= 2);
}

#[test]
fn a_cut_transfer_goes_on_from_its_checkpoint() {
    let p = pair();
    let (vol, src) = volume_with_data(&p, "pvc-src");
    p.faults.lock().unwrap().cut_after = Some(2);
    let rec = p.send(&vol, "t2@node-2", "pvc-copy");
    assert!(p.settle(Duration::from_secs(30)).is_empty());
    same_bytes(&src, &p.b.image(&rec.id.to_string()));
    let reads = p.seen.reads_from.lock().unwrap().clone();
    assert_eq!(reads.len(), 2, "{reads:?}");
    assert_eq!(reads[0], 0);
    assert!(reads[1] > 0, "the second read resumed: {reads:?}");
}

#[test]
fn a_restarted_target_finds_its_arrival_and_ends_it() {
    let mut p = pair();
    let (vol, src) = volume_with_data(&p, "pvc-src");
    // No trailer: the transfer never ends while the target runs.
    p.faults.lock().unwrap().no_trailer = true;
    let rec = p.send(&vol, "t3@node-2", "pvc-copy");
    let img = p.b.image(&rec.id.to_string());
    std::thread::sleep(Duration::from_millis(500));
    assert!(arriving(&img));
    // A stage of a volume still arriving is refused, and retryable.
    let e = p.b.stage(&rec.id.to_string(), &ext4()).unwrap_err();
    assert!(matches!(e, Error::Aborted(_)), "{e:?}");
    p.b.reopen_with(|cfg| cfg.node_id = "node-2".into());
    p.faults.lock().unwrap().no_trailer = false;
    p.connect();
    assert!(p.settle(Duration::from_secs(30)).is_empty());
    assert!(!arriving(&img));
    same_bytes(&src, &img);
    // Once ended, it is still listed done after another restart.
    let listed = |p: &Pair| {
        p.cb()
            .transfers()
            .into_iter()
            .find(|t| t.transfer_id == "t3@node-2" && t.role == "arriving")
    };
    let done = listed(&p).unwrap();
    assert_eq!(done.state, "done");
    assert!(done.ended_seconds > 0 && done.resumed == 1, "{done:?}");
    p.b.reopen_with(|cfg| cfg.node_id = "node-2".into());
    p.connect();
    assert_eq!(listed(&p), Some(done));
}

#[test]
fn what_a_transfer_shows_done_is_where_a_restart_goes_on() {
    let mut p = pair();
    let (vol, src) = volume_with_data(&p, "pvc-src");
    // Slow pieces: the target stops between two checkpoints, pieces written
    // but not yet made durable, as a kill would find it.
    p.faults.lock().unwrap().delay = Some(Duration::from_millis(300));
    let rec = p.send(&vol, "t5@node-2", "pvc-copy");
    std::thread::sleep(Duration::from_millis(700));
    let shown = p
        .cb()
        .transfers()
        .into_iter()
        .find(|t| t.role == "arriving")
        .map(|t| t.bytes_done)
        .unwrap();
    let reads_before = p.seen.reads_from.lock().unwrap().len();
    p.b.reopen_with(|cfg| cfg.node_id = "node-2".into());
    p.faults.lock().unwrap().delay = None;
    p.connect();
    assert!(p.settle(Duration::from_secs(30)).is_empty());
    let after = p.seen.reads_from.lock().unwrap()[reads_before..].to_vec();
    assert!(
        !after.is_empty() && after.iter().all(|&r| r >= shown),
        "shown {shown} done before the restart, read from {after:?} after it"
    );
    same_bytes(&src, &p.b.image(&rec.id.to_string()));
}

#[test]
fn a_hostile_source_is_refused_and_a_delete_stops_the_transfer() {
    let p = pair();
    let (vol, _) = volume_with_data(&p, "pvc-src");
    p.faults.lock().unwrap().corrupt = true;
    let rec = p.send(&vol, "t4@node-2", "pvc-copy");
    std::thread::sleep(Duration::from_millis(800));
    let status = p.cb().transfers();
    let mine = status
        .iter()
        .find(|t| t.role == "arriving")
        .expect("still arriving");
    assert_eq!(mine.state, "waiting", "{mine:?}");
    assert!(mine.message.contains("digest"), "{}", mine.message);
    let img = p.b.image(&rec.id.to_string());
    assert!(arriving(&img));
    // Nothing of the forged data went in: the image holds no data.
    let f = std::fs::File::open(&img).unwrap();
    let data = csi_sys::extents::data_ranges(&f, &img, 0, rec.size).unwrap();
    assert!(data.is_empty(), "{data:?}");
    p.cb().delete_volume(&rec.id.to_string()).unwrap();
    assert!(p.settle(Duration::from_secs(15)).is_empty());
    assert!(!img.exists());
    // The source was told to let its hold go.
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.ca().holds().iter().any(|h| h.transfer_id == "t4@node-2") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(p.ca().holds().is_empty(), "{:?}", p.ca().holds());
    assert!(p.b.pool_files("volumes").is_empty());
}

/// Waits up to `secs` for `done`.
fn eventually(secs: u64, done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[test]
fn a_release_the_source_missed_is_noted_and_retried_until_it_lands() {
    let p = pair();
    let (vol, src) = volume_with_data(&p, "pvc-src");
    let notes = p.b.state_dir().join("controller/releases");
    // The source is down as the transfer ends, and at the first retry.
    p.faults.lock().unwrap().release_failures = 2;
    let rec = p.send(&vol, "t40@node-2", "pvc-copy");
    assert!(p.settle(Duration::from_secs(20)).is_empty());
    same_bytes(&src, &p.b.image(&rec.id.to_string()));
    let hold = || {
        p.ca()
            .holds()
            .into_iter()
            .find(|h| h.transfer_id == "t40@node-2")
    };
    assert!(
        hold().is_some_and(|h| !h.base),
        "not yet released: {:?}",
        hold()
    );
    assert_eq!(
        std::fs::read_dir(&notes).unwrap().count(),
        1,
        "the release is noted"
    );
    // Retried after 1 s, then 2 s: kept as the base, the note gone.
    assert!(
        eventually(10, || hold().is_some_and(|h| h.base)),
        "{:?}",
        hold()
    );
    assert!(eventually(2, || std::fs::read_dir(&notes).unwrap().count() == 0));
    assert_eq!(*p.seen.released.lock().unwrap(), vec![true, true, true]);

    // A volume deleted while its data arrives, the source down then: its
    // hold goes once the source is back.
    p.faults.lock().unwrap().delay = Some(Duration::from_millis(300));
    p.faults.lock().unwrap().release_failures = 1;
    let copy = p.send(&vol, "t41@node-2", "pvc-copy-2");
    std::thread::sleep(Duration::from_millis(400));
    p.cb().delete_volume(&copy.id.to_string()).unwrap();
    let gone = || !p.ca().holds().iter().any(|h| h.transfer_id == "t41@node-2");
    assert!(eventually(10, gone), "{:?}", p.ca().holds());
    assert!(eventually(2, || std::fs::read_dir(&notes).unwrap().count() == 0));
}

#[test]
fn a_second_transfer_of_a_volume_sends_only_what_changed() {
    let p = pair();
    let (vol, src) = volume_with_data(&p, "pvc-src");
    let first = p.send(&vol, "t5@node-2", "pvc-first");
    assert!(p.settle(Duration::from_secs(20)).is_empty());
    let full = p.seen.data_bytes.load(Ordering::Relaxed);
    // One cell changes, another is emptied.
    write_at(&src, 40 * MIB + 10, b"changed");
    csi_sys::image_io::ImageWriter::open(&src)
        .unwrap()
        .punch(3 * CELL, CELL)
        .unwrap();
    p.seen.data_bytes.store(0, Ordering::Relaxed);
    let second = p.send(&vol, "t6@node-2", "pvc-second");
    assert!(p.settle(Duration::from_secs(20)).is_empty());
    same_bytes(&src, &p.b.image(&second.id.to_string()));
    // The first copy is its own: untouched by the second.
    assert_ne!(
        std::fs::read(p.b.image(&first.id.to_string())).unwrap(),
        std::fs::read(&src).unwrap()
    );
    let delta = p.seen.data_bytes.load(Ordering::Relaxed);
    let pool_reflinks = p.cb().pools.values().all(|p| p.reflink);
    if pool_reflinks {
        assert!(p.seen.incremental.load(Ordering::Relaxed));
        // The changed block, not its cell; the emptied cell is named only.
        assert!(
            delta <= 2 * 4096,
            "{delta} bytes sent for 7 bytes changed (of {full})"
        );
        assert!(p.seen.patches.load(Ordering::Relaxed) >= 2);
    } else {
        // Without reflinks no replica is kept: the second transfer sends all.
        assert!(!p.seen.incremental.load(Ordering::Relaxed));
    }
}

/// The names in folder `dir` of `c`'s pools, sorted.
fn names_in(c: &Controller, dir: &str) -> Vec<String> {
    let mut out: Vec<String> = c
        .pools
        .values()
        .flat_map(|p| std::fs::read_dir(p.root.join(dir)).into_iter().flatten())
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

#[test]
fn what_the_next_transfer_replaces_goes_after_it_and_a_crash_leftover_at_start() {
    let p = pair();
    let (vol, src) = volume_with_data(&p, "pvc-src");
    let mut last = None;
    for (i, name) in ["pvc-1", "pvc-2", "pvc-3"].into_iter().enumerate() {
        write_at(&src, (i as u64) * CELL + 5, name.as_bytes());
        last = Some(p.send(&vol, &format!("t{}@node-2", 20 + i), name));
        assert!(p.settle(Duration::from_secs(20)).is_empty());
    }
    same_bytes(&src, &p.b.image(&last.unwrap().id.to_string()));
    // The base and replica each transfer replaced are removed on a thread
    // of their own once it is done: one base (image and description) is
    // left on the source, one replica on the target (where it reflinks).
    let reflink = p.cb().pools.values().all(|p| p.reflink);
    let replicas_kept = if reflink { 2 } else { 0 };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (holds, replicas) = (names_in(&p.ca(), ".holds"), names_in(&p.cb(), ".replicas"));
        if holds.len() == 2 && replicas.len() == replicas_kept {
            break;
        }
        assert!(Instant::now() < deadline, "left: {holds:?} {replicas:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let holds = p.ca().holds();
    assert_eq!(holds.len(), 1, "{holds:?}");
    assert!(holds[0].base && holds[0].transfer_id == "t22@node-2");
    // A replica set aside and not yet removed by a crash, an image whose
    // description a crash never wrote and a temporary file go at the next
    // start; the replica kept stays, and the next transfer still starts
    // from it.
    let dir = p.cb().pools.values().next().unwrap().root.join(".replicas");
    std::fs::create_dir_all(&dir).unwrap();
    for stray in [
        "gone-0123456789abcdef.img",
        "0123456789abcdef.img",
        ".x.json.tmp",
    ] {
        std::fs::write(dir.join(stray), b"left by a crash").unwrap();
    }
    p.cb().recover_arrivals();
    assert_eq!(names_in(&p.cb(), ".replicas").len(), replicas_kept);
    if !reflink {
        return;
    }
    write_at(&src, 5, b"changed once more");
    p.seen.data_bytes.store(0, Ordering::Relaxed);
    let next = p.send(&vol, "t30@node-2", "pvc-4");
    assert!(p.settle(Duration::from_secs(20)).is_empty());
    same_bytes(&src, &p.b.image(&next.id.to_string()));
    assert!(p.seen.incremental.load(Ordering::Relaxed));
    assert!(p.seen.data_bytes.load(Ordering::Relaxed) <= 2 * 4096);
}

/// The replicas kept in `c`'s pools.
fn replicas(c: &Controller) -> usize {
    c.pools
        .values()
        .flat_map(|p| {
            std::fs::read_dir(p.root.join(".replicas"))
                .into_iter()
                .flatten()
        })
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .count()
}

#[test]
fn what_transfers_keep_goes_with_the_volumes_they_kept_it_for() {
    let p = pair();
    let (vol, _) = volume_with_data(&p, "pvc-src");
    let copy = p.send(&vol, "t7@node-2", "pvc-copy");
    assert!(p.settle(Duration::from_secs(20)).is_empty());
    assert!(p.ca().holds().iter().any(|h| h.base));
    let reflink = p.cb().pools.values().all(|p| p.reflink);
    assert_eq!(replicas(&p.cb()), usize::from(reflink));

    // The copy deleted: the replica kept of its arrival goes; the source's
    // base stays (its volume is there, and may move again).
    p.cb().delete_volume(&copy.id.to_string()).unwrap();
    assert_eq!(replicas(&p.cb()), 0);
    assert!(p.ca().holds().iter().any(|h| h.base));

    // The source deleted: its base goes.
    p.ca().delete_volume(&vol).unwrap();
    assert!(p.ca().holds().is_empty(), "{:?}", p.ca().holds());

    // What a crash left past its volume goes at the next start: a base
    // whose volume is gone.
    let (vol2, _) = volume_with_data(&p, "pvc-src-2");
    p.send(&vol2, "t8@node-2", "pvc-copy-2");
    assert!(p.settle(Duration::from_secs(20)).is_empty());
    let holds = p.ca().holds();
    assert!(holds.iter().any(|h| h.base), "{holds:?}");
    let pool = p.ca().pools.values().next().unwrap().root.clone();
    let kept = std::fs::read_dir(pool.join(".holds")).unwrap().count();
    assert!(kept >= 2, "the base's image and description");
    // The volume's record goes as a crash right after DeleteVolume's commit
    // would leave it: data and base still there.
    p.ca()
        .volumes
        .remove(crate::ids::VolumeId::parse(&vol2).unwrap())
        .unwrap();
    // The sweep a start runs (the other node's source holds this driver
    // open, so it is not reopened here).
    p.ca().recover_holds();
    assert!(p.ca().holds().is_empty(), "{:?}", p.ca().holds());
    let left: Vec<_> = std::fs::read_dir(pool.join(".holds"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
