use super::compaction::SMALL_STORE;
use super::format::{image_identity, log_name, snapshot_name, write_snapshot};
use super::*;
use crate::failpoint;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
struct Tid(u32);
impl Display for Tid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "r{:04}", self.0)
    }
}
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Rec {
    id: Tid,
    v: String,
}
impl Record for Rec {
    type Id = Tid;
    const PACKED_LAYOUT: u32 = 1;
    fn id(&self) -> Tid {
        self.id
    }
    fn parse_id(s: &str) -> Option<Tid> {
        s.strip_prefix('r')?.parse().ok().map(Tid)
    }
    fn settled(&self) -> bool {
        !self.v.starts_with("pending")
    }
}
fn rec(i: u32, v: &str) -> Rec {
    Rec {
        id: Tid(i),
        v: v.to_string(),
    }
}

const SMALL: Tuning = Tuning {
    compact_at: 2048,
    inline: true,
};

/// Compacts only when a test says (`compact_now`).
const MANUAL: Tuning = Tuning {
    compact_at: u64::MAX,
    inline: true,
};

fn open(dir: &Path) -> Store<Rec> {
    Store::open_with(dir, SMALL).unwrap()
}

fn compact_now<R: Record>(s: &Store<R>) {
    s.inner.lock().compacting = true;
    s.inner.run_compaction();
}

fn contents(s: &Store<Rec>) -> BTreeMap<u32, String> {
    s.all().into_iter().map(|r| (r.id.0, r.v)).collect()
}

fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// The changes of step `i` of the crash workload, and the model of them.
fn step(s: &Store<Rec>, model: &mut BTreeMap<u32, String>, i: u32) -> Result<()> {
    if i % 3 == 2 {
        model.remove(&(i / 3));
        s.remove(Tid(i / 3))
    } else {
        let v = format!("value {i} {}", "x".repeat(i as usize % 40));
        model.insert(i, v.clone());
        s.put(&rec(i, &v))
    }
}

/// A compaction writes the records in memory a chunk at a time: changes
/// made between two chunks (a record of a written chunk changed, one of a
/// later chunk removed, records made on both sides) are in memory and in
/// the new journal, and a reopen reads back exactly what memory held.
#[test]
fn changes_between_the_chunks_of_a_compaction_are_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..2000 {
        let v = format!("v{i}");
        s.put(&rec(i * 2, &v)).unwrap();
        model.insert(i * 2, v);
    }
    let during = s.clone();
    let hooked = Arc::new(Mutex::new(0));
    let calls = hooked.clone();
    *s.inner.chunk_hook.lock().unwrap() = Some(Box::new(move |chunk| {
        *calls.lock().unwrap() += 1;
        if chunk == 0 {
            during.put(&rec(10, "changed after its chunk")).unwrap();
            during.remove(Tid(3000)).unwrap();
            during.put(&rec(11, "made behind the writer")).unwrap();
            during.put(&rec(3001, "made ahead of the writer")).unwrap();
        }
    }));
    compact_now(&s);
    assert!(
        *hooked.lock().unwrap() >= 4,
        "2000 records are several chunks"
    );
    model.insert(10, "changed after its chunk".into());
    model.remove(&3000);
    model.insert(11, "made behind the writer".into());
    model.insert(3001, "made ahead of the writer".into());
    assert_eq!(contents(&s), model);
    *s.inner.chunk_hook.lock().unwrap() = None;
    drop(s);
    let files = names(tmp.path());
    assert!(
        files.contains("snapshot.1") && files.contains("log.1"),
        "{files:?}"
    );
    assert!(!files.contains("log.0"), "{files:?}");
    let reopened = open(tmp.path());
    assert_eq!(contents(&reopened), model);
    // Both records made meanwhile are known as made by the journal (whose
    // barrier has not run for them), also the one the snapshot holds.
    assert_eq!(reopened.created_in_journal(), vec![Tid(11), Tid(3001)]);
}

/// When the last handle on a store goes (the driver stops), a compaction
/// running then gives up at its next step instead of holding the stop until
/// it has written everything; the journals it would have folded are kept,
/// so nothing is lost, and the next compaction does the work.
#[test]
fn a_closing_store_gives_up_its_compaction_and_keeps_every_record() {
    let tmp = tempfile::tempdir().unwrap();
    let background = Tuning {
        compact_at: u64::MAX,
        inline: false,
    };
    let s = Store::<Rec>::open_with(tmp.path(), background).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..2000 {
        let v = format!("v{i}");
        s.put(&rec(i, &v)).unwrap();
        model.insert(i, v);
    }
    let other = s.clone();
    drop(other);
    assert!(!s.inner.is_closing(), "another handle is still open");
    // The compaction waits after its first chunk until the store closes.
    let inner = Arc::downgrade(&s.inner);
    let (reached, at_chunk) = std::sync::mpsc::channel();
    let chunks = Arc::new(AtomicUsize::new(0));
    let seen = chunks.clone();
    *s.inner.chunk_hook.lock().unwrap() = Some(Box::new(move |_| {
        seen.fetch_add(1, Ordering::SeqCst);
        let _ = reached.send(());
        // Bounded, so that a store that never tells closes the test fails
        // on what the compaction then does rather than hanging.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !inner.upgrade().is_some_and(|i| i.is_closing())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }));
    s.inner.lock().compacting = true;
    s.inner.start_compaction();
    at_chunk.recv().unwrap();
    drop(s);
    assert_eq!(
        chunks.load(Ordering::SeqCst),
        1,
        "2000 records are several chunks"
    );
    let files = names(tmp.path());
    assert!(!files.contains("snapshot.1"), "{files:?}");
    let reopened = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
    assert_eq!(contents(&reopened), model);
    compact_now(&reopened);
    assert!(
        names(tmp.path()).contains("snapshot.2"),
        "{:?}",
        names(tmp.path())
    );
    drop(reopened);
    assert_eq!(contents(&open(tmp.path())), model);
}

/// A start takes the records of a compaction's packed image, with the
/// unsettled ones known without decoding the rest; when the image is
/// damaged or sealed by another build or layout, the snapshot is parsed
/// instead, to the same records, and the image removed.
#[test]
fn a_start_takes_the_packed_image_or_else_the_snapshot_to_the_same_records() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..2000 {
        let v = if i % 7 == 0 {
            format!("pending {i}")
        } else {
            format!("v{i}")
        };
        s.put(&rec(i, &v)).unwrap();
        model.insert(i, v);
    }
    compact_now(&s);
    // After the snapshot: one settles, one is made pending, one pending goes.
    s.put(&rec(7, "done")).unwrap();
    s.put(&rec(8, "pending again")).unwrap();
    s.remove(Tid(14)).unwrap();
    model.insert(7, "done".into());
    model.insert(8, "pending again".into());
    model.remove(&14);
    let pending: Vec<u32> = model
        .iter()
        .filter(|(_, v)| v.starts_with("pending"))
        .map(|(k, _)| *k)
        .collect();
    let unsettled = |s: &Store<Rec>| s.unsettled().iter().map(|r| r.id.0).collect::<Vec<_>>();
    assert_eq!(unsettled(&s), pending);
    drop(s);
    let image = tmp.path().join("packed.1");
    let whole = std::fs::read(&image).unwrap();

    let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
    assert!(s.inner.from_image, "the image is read");
    assert_eq!(contents(&s), model);
    assert_eq!(unsettled(&s), pending);
    drop(s);

    // Damaged in the middle of a record.
    let mut damaged = whole.clone();
    damaged[whole.len() / 2] ^= 0x40;
    // Sealed by another build.
    let scan = frame::scan(&whole, false);
    let mut other = Vec::new();
    for e in &scan.entries[..scan.entries.len() - 1] {
        frame::encode(&mut other, 0, false, e.kind, e.id, e.payload);
    }
    let snapshot_len = std::fs::metadata(tmp.path().join("snapshot.1"))
        .unwrap()
        .len();
    let seal =
        image_identity::<Rec>(snapshot_len).replace(env!("CARGO_PKG_VERSION"), "0.0.0-other");
    frame::encode(&mut other, 0, false, Kind::Put, "", seal.as_bytes());
    frame::encode(&mut other, 0, true, Kind::End, "", b"");
    // Cut short.
    let cut = whole[..whole.len() - 30].to_vec();
    for (what, bytes) in [
        ("damaged", damaged),
        ("another build's", other),
        ("cut", cut),
    ] {
        std::fs::write(&image, &bytes).unwrap();
        let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
        assert!(!s.inner.from_image, "a {what} image is not read");
        assert_eq!(contents(&s), model, "{what}");
        assert_eq!(unsettled(&s), pending, "{what}");
        assert!(!image.exists(), "a {what} image is removed");
        assert!(
            !names(tmp.path()).iter().any(|n| n.ends_with(".corrupt")),
            "an image is not set aside"
        );
        drop(s);
    }
}

/// The barrier is given the records the folded journals made and that still
/// exist: not those they only changed, not those removed since; after a
/// reopen too, where the journal it appends to was made before it.
#[test]
fn the_barrier_is_given_what_the_folded_journals_made() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
    for i in 0..10 {
        s.put(&rec(i, "first")).unwrap();
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let into = seen.clone();
    s.set_compaction_barrier(Box::new(move |ids: &[String]| {
        into.lock().unwrap().push(ids.to_vec());
        Ok(())
    }));
    compact_now(&s);
    let made: Vec<String> = (0..10).map(|i| Tid(i).to_string()).collect();
    assert_eq!(seen.lock().unwrap().pop(), Some(made));
    // In journal 1: 0 changed, 1 removed, 20 and 21 made, 21 removed.
    s.put(&rec(0, "second")).unwrap();
    s.remove(Tid(1)).unwrap();
    s.put(&rec(20, "new")).unwrap();
    s.put(&rec(21, "gone")).unwrap();
    s.remove(Tid(21)).unwrap();
    drop(s);
    // Reopened: what journal 1 made is known from it.
    let s = Store::<Rec>::open_with(tmp.path(), MANUAL).unwrap();
    let into = seen.clone();
    s.set_compaction_barrier(Box::new(move |ids: &[String]| {
        into.lock().unwrap().push(ids.to_vec());
        Ok(())
    }));
    s.put(&rec(30, "after the reopen")).unwrap();
    compact_now(&s);
    assert_eq!(
        seen.lock().unwrap().pop(),
        Some(vec![Tid(20).to_string(), Tid(30).to_string()])
    );
}

#[test]
fn changes_survive_a_reopen_and_start_up_reads_one_snapshot_and_one_journal() {
    let tmp = tempfile::tempdir().unwrap();
    let s = open(tmp.path());
    let mut model = BTreeMap::new();
    for i in 0..300 {
        step(&s, &mut model, i).unwrap();
    }
    assert_eq!(contents(&s), model);
    drop(s);
    let files = names(tmp.path());
    let snaps: Vec<_> = files
        .iter()
        .filter(|n| n.starts_with("snapshot."))
        .collect();
    let logs: Vec<_> = files.iter().filter(|n| n.starts_with("log.")).collect();
    assert_eq!((snaps.len(), logs.len()), (1, 1), "{files:?}");
    assert_eq!(snaps[0][9..], logs[0][4..], "{files:?}");
    let s = open(tmp.path());
    assert_eq!(contents(&s), model);
    // Made by the journal since the snapshot: what start-up checks the data of.
    let made: BTreeSet<u32> = s.created_in_journal().into_iter().map(|t| t.0).collect();
    assert!(!made.is_empty() && made.iter().all(|i| model.contains_key(i)));
    assert!(
        made.len() < model.len(),
        "the snapshot's records are not in it"
    );
    assert!(!s.is_quarantined("r0001"));
}

#[test]
fn a_torn_end_is_cut_and_nothing_acknowledged_is_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let s = open(tmp.path());
    let mut model = BTreeMap::new();
    for i in 0..4 {
        step(&s, &mut model, i).unwrap();
    }
    drop(s);
    let log = tmp.path().join("log.0");
    let mut whole = std::fs::read(&log).unwrap();
    // The batches, without the zeros of the journal's room for appends.
    whole.truncate(frame::scan(&whole, true).valid_len);
    // A batch of two whose write reached the disk only in part.
    let mut next = Vec::new();
    frame::encode(
        &mut next,
        99,
        false,
        Kind::Put,
        "r0050",
        b"{\"id\":50,\"v\":\"a\"}",
    );
    frame::encode(&mut next, 99, true, Kind::Remove, "r0000", b"");
    for cut in [1, 10, 30, next.len() / 2, next.len() - 1] {
        let mut torn = whole.clone();
        torn.extend_from_slice(&next[..cut]);
        std::fs::write(&log, &torn).unwrap();
        let s = open(tmp.path());
        assert_eq!(contents(&s), model, "cut {cut}");
        assert!(!s.is_quarantined("r0050"), "cut {cut}");
        drop(s);
        assert_eq!(std::fs::read(&log).unwrap(), whole, "cut {cut}: cut back");
        assert!(!names(tmp.path()).iter().any(|n| n.ends_with(".corrupt")));
    }
    // And the journal takes new batches after it.
    let s = open(tmp.path());
    step(&s, &mut model, 4).unwrap();
    drop(s);
    assert_eq!(contents(&open(tmp.path())), model);
}

/// The journal is written with zeros ahead of its appends, so that most
/// appends leave its length alone: a start keeps those zeros as the room
/// they are, and cuts a torn write within them.
#[test]
fn the_journal_keeps_room_for_appends_across_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("log.0");
    let s = open(tmp.path());
    let mut model = BTreeMap::new();
    step(&s, &mut model, 0).unwrap();
    let room = std::fs::metadata(&log).unwrap().len();
    assert_eq!(room % csi_sys::file::APPEND_ROOM, 0);
    for i in 1..4 {
        step(&s, &mut model, i).unwrap();
    }
    assert_eq!(
        std::fs::metadata(&log).unwrap().len(),
        room,
        "appends within the room"
    );
    drop(s);
    let bytes = std::fs::read(&log).unwrap();
    let end = frame::scan(&bytes, true).valid_len;
    assert!(end > 0 && bytes[end..].iter().all(|&b| b == 0));
    let s = open(tmp.path());
    assert_eq!(contents(&s), model);
    assert_eq!(std::fs::read(&log).unwrap(), bytes, "the room is kept");
    step(&s, &mut model, 4).unwrap();
    drop(s);
    assert_eq!(contents(&open(tmp.path())), model);
    // A write cut short within the room: cut off, and appends go on.
    let bytes = std::fs::read(&log).unwrap();
    let end = frame::scan(&bytes, true).valid_len;
    let mut torn = bytes.clone();
    let mut next = Vec::new();
    frame::encode(&mut next, 99, true, Kind::Remove, "r0000", b"");
    torn[end..end + next.len() / 2].copy_from_slice(&next[..next.len() / 2]);
    std::fs::write(&log, &torn).unwrap();
    let s = open(tmp.path());
    assert_eq!(contents(&s), model);
    assert_eq!(std::fs::read(&log).unwrap(), bytes[..end], "cut back");
    step(&s, &mut model, 5).unwrap();
    drop(s);
    assert_eq!(contents(&open(tmp.path())), model);
}

/// A store of three records, one batch each, with the byte `at(frame size)`
/// of its journal damaged.
fn three_with_damage(at: impl Fn(usize) -> usize) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let s = open(tmp.path());
    for i in 1..=3 {
        s.put(&rec(i, "v")).unwrap();
    }
    drop(s);
    let log = tmp.path().join("log.0");
    let mut bytes = std::fs::read(&log).unwrap();
    let i = at(frame::scan(&bytes, true).valid_len / 3);
    bytes[i] ^= 0x55;
    std::fs::write(&log, &bytes).unwrap();
    tmp
}

#[test]
fn removals_are_compacted_away_before_a_start_parses_more_than_twice_the_live_records() {
    let tmp = tempfile::tempdir().unwrap();
    // Far from the journal's byte threshold: only the removals can make it due.
    let tuning = Tuning {
        compact_at: 1 << 40,
        inline: true,
    };
    let s = Store::<Rec>::open_with(tmp.path(), tuning).unwrap();
    for i in 0..3000 {
        s.put(&rec(i, "v")).unwrap();
    }
    let parsed = |s: &Store<Rec>| {
        let st = s.inner.lock();
        st.snapshot_entries + st.entries
    };
    assert_eq!(parsed(&s), 3000, "no compaction while records are added");
    for i in 0..3000 {
        s.remove(Tid(i)).unwrap();
        let live = 3000 - u64::from(i) - 1;
        assert!(
            parsed(&s) <= 2 * live + SMALL_STORE + 1,
            "after {i} removals"
        );
    }
    drop(s);
    let s = Store::<Rec>::open_with(tmp.path(), tuning).unwrap();
    assert!(contents(&s).is_empty());
    assert!(parsed(&s) <= SMALL_STORE, "a start parses {}", parsed(&s));
}

#[test]
fn a_damaged_entry_is_reported_and_its_record_quarantined_not_lost() {
    // The last byte of r0002's payload: its header still names it.
    let tmp = three_with_damage(|frame| 2 * frame - 2);
    let s = open(tmp.path());
    assert_eq!(contents(&s).keys().copied().collect::<Vec<_>>(), [1, 3]);
    assert!(s.is_quarantined("r0002") && !s.is_quarantined("r0001"));
    assert!(tmp.path().join("log.0.corrupt").is_file());
    // Compacted away, the damaged journal still keeps the record's data safe.
    for i in 10..60 {
        s.put(&rec(i, &"y".repeat(60))).unwrap();
    }
    drop(s);
    assert!(!tmp.path().join("log.0").exists(), "compacted");
    let s = open(tmp.path());
    assert!(s.is_quarantined("r0002") && !s.is_quarantined("r0003"));
    // Put again, it is known once more.
    s.put(&rec(2, "again")).unwrap();
    drop(s);
    assert!(!open(tmp.path()).is_quarantined("r0002"));

    // A header damaged: which record it held is unknown, so every stem is
    // treated as one that may be.
    let tmp = three_with_damage(|frame| frame + 5);
    let s = open(tmp.path());
    assert_eq!(contents(&s).keys().copied().collect::<Vec<_>>(), [1, 3]);
    assert!(s.is_quarantined("anything"));
}

#[test]
fn writers_at_once_share_one_write_and_one_sync() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Arc::new(open(tmp.path()));
    s.set_gate(false);
    let writers: Vec<_> = (0..16)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || s.put(&rec(i, "v")))
        })
        .collect();
    // The first leader holds its batch of one; the other fifteen queue behind it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while s.progress() != (15, true, 0) {
        assert!(std::time::Instant::now() < deadline, "{:?}", s.progress());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    s.set_gate(true);
    for w in writers {
        w.join().unwrap().unwrap();
    }
    assert_eq!(
        s.progress(),
        (0, false, 2),
        "two writes for sixteen changes"
    );
    assert_eq!(s.len(), 16);
    drop(s);
    assert_eq!(open(tmp.path()).len(), 16);
}

#[test]
fn every_queued_change_is_led_when_batches_hand_over() {
    // Each batch's leader hands the next batch to the first caller queued
    // behind it; a change left without a leader would keep its caller
    // waiting. Each writer is a new thread with one change, so nothing but
    // the hand-over can wake it.
    let tmp = tempfile::tempdir().unwrap();
    let s = Arc::new(open(tmp.path()));
    for round in 0..20u32 {
        let (tx, rx) = std::sync::mpsc::channel();
        for t in 0..16u32 {
            let (s, tx) = (s.clone(), tx.clone());
            std::thread::spawn(move || {
                let id = round * 100 + t;
                let _ = tx.send(s.put(&rec(id, "v")).and_then(|()| match t % 4 {
                    3 => s.remove(Tid(id)),
                    _ => Ok(()),
                }));
            });
        }
        for _ in 0..16 {
            rx.recv_timeout(std::time::Duration::from_secs(20))
                .expect("a writer's change was never written")
                .unwrap();
        }
    }
    let (queued, writing, _) = s.progress();
    assert_eq!((queued, writing), (0, false));
    assert_eq!(s.len(), 20 * 12);
    drop(s);
    assert_eq!(open(tmp.path()).len(), 20 * 12);
}

#[test]
fn a_large_snapshot_loads_on_every_core_and_its_journal_replays_over_it() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // Enough records for the parse to be split among threads, one of them
    // with a payload that checks out but does not parse, one naming another id.
    let mut model = BTreeMap::new();
    let mut snap = Vec::new();
    for i in 0..3000 {
        let r = rec(i, &format!("s{i}"));
        let payload = match i {
            1500 => b"{\"id\":1500,\"v\":".to_vec(),
            2500 => serde_json::to_vec(&rec(7, "other")).unwrap(),
            _ => {
                model.insert(i, r.v.clone());
                serde_json::to_vec(&r).unwrap()
            }
        };
        snap.push((r.id.to_string(), payload));
    }
    write_snapshot(
        &d.join(snapshot_name(4)),
        snap.iter().map(|(id, p)| Ok((id.as_str(), p.as_slice()))),
    )
    .unwrap();
    // The journal: a change, a removal, a new record, and the record that did
    // not parse written again.
    let mut log = Vec::new();
    let changes: [(u32, Option<&str>); 4] = [
        (10, Some("changed")),
        (11, None),
        (5000, Some("new")),
        (1500, Some("again")),
    ];
    for (batch, (i, v)) in changes.iter().enumerate() {
        let (kind, payload) = match v {
            Some(v) => {
                model.insert(*i, v.to_string());
                (Kind::Put, serde_json::to_vec(&rec(*i, v)).unwrap())
            }
            None => {
                model.remove(i);
                (Kind::Remove, Vec::new())
            }
        };
        frame::encode(
            &mut log,
            batch as u64 + 1,
            true,
            kind,
            &Tid(*i).to_string(),
            &payload,
        );
    }
    std::fs::write(d.join(log_name(4)), &log).unwrap();
    let s = open(d);
    assert_eq!(contents(&s), model);
    let made: Vec<u32> = s.created_in_journal().into_iter().map(|t| t.0).collect();
    assert_eq!(made, [1500, 5000], "only what the journal made");
    assert!(s.is_quarantined("r2500") && !s.is_quarantined("r1500"));
    assert!(!s.is_quarantined("r0010") && !s.is_quarantined("r0011"));
    // The next batch follows the journal's last one.
    s.put(&rec(6000, "after")).unwrap();
    model.insert(6000, "after".into());
    drop(s);
    assert_eq!(contents(&open(d)), model);
}

#[test]
fn a_store_of_the_older_layout_is_converted_once() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for i in 1..=2 {
        std::fs::write(
            d.join(format!("r{i:04}.json")),
            serde_json::to_vec(&rec(i, "old")).unwrap(),
        )
        .unwrap();
    }
    std::fs::write(d.join("r0003.json"), b"{ half a rec").unwrap();
    std::fs::write(d.join(".r0004.json.tmp"), b"{}").unwrap();
    let s = open(d);
    assert_eq!(contents(&s).keys().copied().collect::<Vec<_>>(), [1, 2]);
    assert!(s.is_quarantined("r0003"));
    s.remove(Tid(1)).unwrap();
    drop(s);
    assert_eq!(
        names(d),
        ["log.1", "r0003.corrupt", "snapshot.1"]
            .map(String::from)
            .into()
    );
    let s = open(d);
    assert_eq!(contents(&s).keys().copied().collect::<Vec<_>>(), [2]);
    assert!(s.is_quarantined("r0003"));
    let raw = read_raw(d).unwrap();
    assert_eq!(raw.keys().collect::<Vec<_>>(), ["r0002"]);
    write_raw(d, "r0002", None).unwrap();
    write_raw(
        d,
        "r0005",
        Some(&serde_json::to_vec(&rec(5, "raw")).unwrap()),
    )
    .unwrap();
    assert_eq!(contents(&open(d)), [(5, "raw".to_string())].into());
}

const CHILD: &str = "STORE_CRASH_CHILD";

/// In a child process (this test, run again): the workload, until the
/// failpoint armed there ends the process. Prints each acknowledged step.
fn child(dir: &Path, what: &str) {
    let mut model = BTreeMap::new();
    if what == "migrate" {
        let _ = open(dir);
        println!("opened");
        return;
    }
    let s = open(dir);
    for i in 0..400 {
        step(&s, &mut model, i).unwrap();
        println!("acked {i}");
    }
}

#[test]
fn a_crash_at_each_step_of_a_compaction_or_a_conversion_loses_nothing() {
    if let Ok(dir) = std::env::var(CHILD) {
        let what = std::env::var("STORE_CRASH_WHAT").unwrap();
        return child(Path::new(&dir), &what);
    }
    let me =
        "core::store::tests::a_crash_at_each_step_of_a_compaction_or_a_conversion_loses_nothing";
    for fp in [
        "store.compact.after-new-log",
        "store.compact.after-rotate",
        "store.compact.after-snapshot",
        "store.migrate.after-snapshot",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let what = fp.split('.').nth(1).unwrap();
        let mut legacy = BTreeMap::new();
        if what == "migrate" {
            for i in 0..50 {
                let r = rec(i, "old");
                let bytes = serde_json::to_vec(&r).unwrap();
                std::fs::write(tmp.path().join(format!("{}.json", r.id)), bytes).unwrap();
                legacy.insert(i, r.v);
            }
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([me, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, tmp.path())
            .env("STORE_CRASH_WHAT", what)
            .env(failpoint::ENV, fp)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGABRT),
            "{fp}: the child must die there\n{stdout}\n{stderr}"
        );
        assert!(
            stderr.contains(&format!("failpoint {fp} reached")),
            "{stderr}"
        );
        let mut model = if what == "migrate" {
            legacy
        } else {
            // Every step acknowledged, and the one whose batch started the
            // compaction: it was durable before the compaction began.
            // (The harness may print the test's name on the first line's start.)
            let acked = stdout
                .lines()
                .filter_map(|l| l.split("acked ").nth(1)?.trim().parse::<u32>().ok())
                .max()
                .map_or(0, |last| last + 1);
            let (mut model, scratch) = (BTreeMap::new(), tempfile::tempdir().unwrap());
            let replay = open(scratch.path());
            for i in 0..=acked {
                step(&replay, &mut model, i).unwrap();
            }
            model
        };
        let s = open(tmp.path());
        assert_eq!(contents(&s), model, "{fp}: after the crash");
        assert!(!s.is_quarantined("r0001"), "{fp}");
        // It goes on, compacts again, and reads back the same.
        for i in 1000..1100 {
            step(&s, &mut model, i).unwrap();
        }
        drop(s);
        assert_eq!(contents(&open(tmp.path())), model, "{fp}: after more");
        let files = names(tmp.path());
        assert!(
            !files
                .iter()
                .any(|n| n.starts_with('.') || n.ends_with(".json")),
            "{fp}: {files:?}"
        );
    }
}

/// A listing reads volume records through `VolumeView`, which mirrors the
/// record's fields in their packed form: it must read each record's packed
/// bytes to their end, to the same values as the record's own.
#[test]
fn a_volume_view_reads_every_record_as_the_record_does() {
    use crate::model::VolumeView;
    let (volumes, ..) = every_kind();
    assert!(volumes.iter().any(|v| !v.published.is_empty()));
    for v in &volumes {
        let packed = postcard::to_allocvec(v).unwrap();
        let (view, rest) = postcard::take_from_bytes::<VolumeView>(&packed).unwrap();
        assert!(rest.is_empty(), "{} bytes left unread", rest.len());
        assert_eq!(view, v.view());
        assert_eq!(unpack::<VolumeView>(&packed), Some(v.view()));
    }
    // A view is a view of its own record only.
    let mut other = volumes[0].clone();
    other.pending_size = other.pending_size.map_or(Some(1), |s| Some(s + 1));
    assert_ne!(other.view(), volumes[0].view());
}

/// Every record kind, with every field set (and with the optional ones
/// unset), reads back from memory as it was put, and from the files after a
/// restart: memory's form knows fields by their order alone.
#[test]
fn records_of_every_kind_read_back_whole() {
    fn check<R: Record + PartialEq + std::fmt::Debug>(dir: &Path, records: &[R]) {
        let store = Store::<R>::open(dir).unwrap();
        for r in records {
            store.put(r).unwrap();
            assert_eq!(store.get(r.id()).as_ref(), Some(r));
        }
        drop(store);
        let store = Store::<R>::open(dir).unwrap();
        let mut want = records.to_vec();
        want.sort_by_key(|r| r.id());
        assert_eq!(store.all(), want);
        // And from a snapshot's packed image.
        compact_now(&store);
        drop(store);
        let store = Store::<R>::open(dir).unwrap();
        assert!(store.inner.from_image);
        assert_eq!(store.all(), want);
    }

    let tmp = tempfile::tempdir().unwrap();
    let (volumes, snapshots, groups, staged) = every_kind();
    check(&tmp.path().join("volumes"), &volumes);
    check(&tmp.path().join("snapshots"), &snapshots);
    check(&tmp.path().join("groups"), &groups);
    check(&tmp.path().join("staged"), &staged);
}

/// The packed form of every record kind, with every field set and unset, is
/// what the layouts pinned here say. When this fails, the records' fields
/// changed: raise the kind's PACKED_LAYOUT (in the `record!` line) and pin
/// the new checksum, so that no start reads an image of the older fields.
#[test]
fn packed_forms_are_pinned() {
    fn form<R: Record>(records: &[R]) -> (u32, u32) {
        let mut bytes = Vec::new();
        for r in records {
            bytes.extend_from_slice(&Packed::of(r).unwrap().0);
        }
        (R::PACKED_LAYOUT, crc32fast::hash(&bytes))
    }
    let (volumes, snapshots, groups, staged) = every_kind();
    assert_eq!(form(&volumes), (1, PINNED[0]), "volume records");
    assert_eq!(form(&snapshots), (1, PINNED[1]), "snapshot records");
    assert_eq!(form(&groups), (1, PINNED[2]), "group snapshot records");
    assert_eq!(form(&staged), (1, PINNED[3]), "node records");
}

const PINNED: [u32; 4] = [1_714_172_006, 3_478_877_198, 1_404_644_243, 1_544_629_552];

/// Records of every kind, with every field set and unset.
#[allow(clippy::type_complexity)]
fn every_kind() -> (
    Vec<crate::model::VolumeRecord>,
    Vec<crate::model::SnapshotRecord>,
    Vec<crate::model::GroupSnapshotRecord>,
    Vec<crate::node::NodeRecord>,
) {
    use crate::ids::{GroupSnapshotId, SnapshotId, VolumeId};
    use crate::model::*;
    use crate::node::{NodeRecord, Target};

    let map = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>()
    };
    let full = VolumeRecord {
        id: VolumeId::for_name("full"),
        name: "full".into(),
        pool: "ssd".into(),
        backing: Backing::Image,
        size: 5 << 30,
        fs_type: Some("xfs".into()),
        capabilities: vec![
            Capability {
                access: Access::Mount {
                    fs_type: "xfs".into(),
                    mount_flags: vec!["noatime".into(), "nodev".into()],
                    volume_mount_group: "1000".into(),
                },
                mode: AccessMode::SingleNodeMultiWriter,
            },
            Capability {
                access: Access::Block,
                mode: AccessMode::Unknown,
            },
        ],
        parameters: map(&[("kind", "image"), ("pool", "ssd")]),
        mutable_parameters: map(&[("iops", "100")]),
        source: Some(ContentSource::Snapshot(SnapshotId::for_name("s"))),
        created: Timestamp {
            seconds: -5,
            nanos: 999_999_999,
        },
        state: RecordState::Deleting,
        pending_size: Some(6 << 30),
        published: [
            (
                "node-a".to_string(),
                Publication {
                    read_only: true,
                    block: true,
                },
            ),
            (
                "node-b".to_string(),
                Publication {
                    read_only: false,
                    block: false,
                },
            ),
        ]
        .into(),
        ephemeral: true,
        requested: Some(1),
    };
    let bare = VolumeRecord {
        id: VolumeId::for_name("bare"),
        name: String::new(),
        fs_type: None,
        capabilities: vec![],
        parameters: BTreeMap::new(),
        mutable_parameters: BTreeMap::new(),
        source: Some(ContentSource::Volume(VolumeId::for_name("v"))),
        pending_size: None,
        published: BTreeMap::new(),
        ephemeral: false,
        requested: None,
        ..full.clone()
    };
    let volumes = vec![full, bare];

    let snapshot = SnapshotRecord {
        id: SnapshotId::for_name("snap"),
        name: "snap".into(),
        source_volume: VolumeId::for_name("full"),
        pool: "ssd".into(),
        backing: Backing::Subvolume,
        size: u64::MAX,
        fs_type: Some("btrfs".into()),
        created: Timestamp {
            seconds: 1_700_000_000,
            nanos: 5,
        },
        state: RecordState::Creating,
        group: Some(GroupSnapshotId::for_name("g")),
        requested: Some(7),
    };
    let plain = SnapshotRecord {
        id: SnapshotId::for_name("plain"),
        fs_type: None,
        group: None,
        requested: None,
        ..snapshot.clone()
    };
    let snapshots = vec![snapshot, plain];

    let group = GroupSnapshotRecord {
        id: GroupSnapshotId::for_name("g"),
        name: "g".into(),
        source_volumes: vec![VolumeId::for_name("a"), VolumeId::for_name("b")],
        members: vec![SnapshotId::for_name("a"), SnapshotId::for_name("b")],
        created: Timestamp {
            seconds: 1_700_000_001,
            nanos: 0,
        },
        state: RecordState::Ready,
    };

    let staged = NodeRecord {
        id: VolumeId::for_name("staged"),
        volume_id: "kubelet-id".into(),
        data: "/pool/a.img".into(),
        backing: Backing::Directory,
        staging_path: Some("/var/lib/kubelet/staging/x".into()),
        block: true,
        fs_type: Some("ext4".into()),
        mode: AccessMode::SingleNodeReaderOnly,
        targets: [(
            PathBuf::from("/target/one"),
            Target {
                read_only: true,
                block: false,
                ro_device: Some("/dev/loop7".into()),
            },
        )]
        .into(),
        ephemeral: true,
        loop_devices: Some(vec!["/dev/loop7".into(), "/dev/loop8".into()]),
    };
    let unstaged = NodeRecord {
        id: VolumeId::for_name("unstaged"),
        staging_path: None,
        fs_type: None,
        targets: BTreeMap::new(),
        loop_devices: None,
        ..staged.clone()
    };
    (volumes, snapshots, vec![group], vec![staged, unstaged])
}
