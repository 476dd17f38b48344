//! The on-disk form of a record store: frames, each one entry (a record put, an
//! id removed, the end of a snapshot), checked by CRC32. A journal file takes
//! whole batches of frames, one write and one `fdatasync` each; a snapshot file
//! holds every live record and ends with an end frame.
//!
//! ```text
//! 0   u32 magic          "CSJ1"
//! 4   u32 payload length
//! 8   u64 batch          the group commit that wrote the frame
//! 16  u8  kind           1 put, 2 remove, 3 end
//! 17  u8  flags          1: the last frame of its batch; 2: a put that made its
//!                        record (none was there before it)
//! 18  u16 id length
//! 20  u32 payload CRC
//! 24  id, then u32 CRC of bytes 0..24+id, then the payload (JSON of the record)
//! ```
//!
//! The header has its own checksum, so an entry whose payload is damaged still
//! names its record, which is then set aside rather than lost silently.
//!
//! Reading tells a torn end from damage. A batch is written only once the one
//! before it is durable, so damage followed by frames of a later batch cannot be a
//! write a power loss cut short: it is reported. Damage followed only by frames of
//! the batch it belongs to is the end of a batch that was never acknowledged, and
//! is cut off.

const MAGIC: u32 = u32::from_le_bytes(*b"CSJ1");
const FIXED: usize = 24;
/// No record comes near this: a larger length is damage, not a frame.
const MAX_PAYLOAD: usize = 64 << 20;
const LAST: u8 = 1;
const MADE: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Put,
    Remove,
    /// The end of a snapshot: a snapshot without it was cut short.
    End,
    /// An entry whose header is whole and whose payload is not: its record is
    /// unknown.
    Unreadable,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Put => 1,
            Kind::Remove => 2,
            Kind::End | Kind::Unreadable => 3,
        }
    }
}

/// One entry read back.
#[derive(Debug, Clone)]
pub(crate) struct Entry<'a> {
    pub batch: u64,
    pub kind: Kind,
    pub id: &'a str,
    pub payload: &'a [u8],
    /// A put that made its record: whatever a snapshot read with this journal
    /// holds of the record, its data is as new as this entry.
    pub made: bool,
}

/// Appends one frame to `out`.
pub(crate) fn encode(
    out: &mut Vec<u8>,
    batch: u64,
    last: bool,
    kind: Kind,
    id: &str,
    payload: &[u8],
) {
    encode_frame(out, batch, last, false, kind, id, payload)
}

/// [`encode`], also saying whether a put made its record.
pub(crate) fn encode_frame(
    out: &mut Vec<u8>,
    batch: u64,
    last: bool,
    made: bool,
    kind: Kind,
    id: &str,
    payload: &[u8],
) {
    let start = out.len();
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&batch.to_le_bytes());
    out.push(kind.code());
    out.push(if last { LAST } else { 0 } | if made { MADE } else { 0 });
    out.extend_from_slice(&(id.len() as u16).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(id.as_bytes());
    let header_crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&header_crc.to_le_bytes());
    out.extend_from_slice(payload);
}

/// What one position of a file holds.
enum Parsed<'a> {
    Frame {
        entry: Entry<'a>,
        last: bool,
        end: usize,
    },
    /// The header is whole, the payload is not.
    BadPayload {
        entry: Entry<'a>,
        last: bool,
        end: usize,
    },
    /// No frame starts here.
    NoFrame,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default())
}

fn parse(b: &[u8], at: usize) -> Parsed<'_> {
    let rest = &b[at..];
    if rest.len() < FIXED + 4 || u32_at(rest, 0) != MAGIC {
        return Parsed::NoFrame;
    }
    let payload_len = u32_at(rest, 4) as usize;
    let id_len = u16::from_le_bytes([rest[18], rest[19]]) as usize;
    let header_end = FIXED + id_len;
    if rest.len() < header_end + 4
        || crc32fast::hash(&rest[..header_end]) != u32_at(rest, header_end)
    {
        return Parsed::NoFrame;
    }
    let Ok(id) = std::str::from_utf8(&rest[FIXED..header_end]) else {
        return Parsed::NoFrame;
    };
    let kind = match rest[16] {
        1 => Kind::Put,
        2 => Kind::Remove,
        3 => Kind::End,
        _ => return Parsed::NoFrame,
    };
    let batch = u64::from_le_bytes(rest[8..16].try_into().unwrap_or_default());
    let last = rest[17] & LAST != 0;
    let made = rest[17] & MADE != 0;
    let start = header_end + 4;
    if payload_len > MAX_PAYLOAD || rest.len() < start + payload_len {
        // A whole header with its payload cut short: the end of a write.
        return Parsed::BadPayload {
            entry: Entry {
                batch,
                kind: Kind::Unreadable,
                id,
                payload: &[],
                made: false,
            },
            last,
            end: b.len(),
        };
    }
    let payload = &rest[start..start + payload_len];
    let entry = Entry {
        batch,
        kind,
        id,
        payload,
        made,
    };
    let end = at + start + payload_len;
    if crc32fast::hash(payload) != u32_at(rest, 20) {
        return Parsed::BadPayload {
            entry: Entry {
                kind: Kind::Unreadable,
                payload: &[],
                made: false,
                ..entry
            },
            last,
            end,
        };
    }
    Parsed::Frame { entry, last, end }
}

/// The next position after `at` where a whole header starts.
fn resync(b: &[u8], at: usize) -> Option<usize> {
    let magic = MAGIC.to_le_bytes();
    (at + 1..b.len().saturating_sub(3))
        .filter(|&i| b[i..i + 4] == magic)
        .find(|&i| !matches!(parse(b, i), Parsed::NoFrame))
}

enum Item<'a> {
    Good {
        entry: Entry<'a>,
        last: bool,
        end: usize,
    },
    /// Damage at `at`: an entry with its record unknown, or (None) bytes where no
    /// frame starts, up to the next frame.
    Bad {
        at: usize,
        entry: Option<(Entry<'a>, bool)>,
        end: usize,
    },
}

/// A file read back.
#[derive(Debug, Default)]
pub(crate) struct Scan<'a> {
    /// The entries to replay, in order; damaged ones as [`Kind::Unreadable`].
    pub entries: Vec<Entry<'a>>,
    /// Where the file's good content ends: a torn end beyond it is dropped.
    pub valid_len: usize,
    /// Whether only zeros follow `valid_len` (a journal's room for appends).
    pub zero_tail: bool,
    /// Damage that is not a torn end, said for people.
    pub damage: Vec<String>,
    /// Records were lost whose ids are unknown: any data may be theirs.
    pub blind: bool,
}

/// The frames of a file in order, whole or damaged.
fn frames(b: &[u8]) -> Vec<Item<'_>> {
    let mut items = Vec::new();
    let mut at = 0;
    while at < b.len() {
        match parse(b, at) {
            Parsed::Frame { entry, last, end } => {
                items.push(Item::Good { entry, last, end });
                at = end;
            }
            Parsed::BadPayload { entry, last, end } => {
                items.push(Item::Bad {
                    at,
                    entry: Some((entry, last)),
                    end,
                });
                at = end;
            }
            // Zeros to the end: the room a journal keeps for its next appends.
            Parsed::NoFrame if b[at..].iter().all(|&x| x == 0) => break,
            Parsed::NoFrame => {
                let end = resync(b, at).unwrap_or(b.len());
                items.push(Item::Bad {
                    at,
                    entry: None,
                    end,
                });
                at = end;
            }
        }
    }
    items
}

/// Reads a file's frames. `journal`: its end may be a batch cut short, which is
/// dropped whole (a snapshot is written whole, so any damage in it is damage, and
/// it must end with an end frame).
pub(crate) fn scan(b: &[u8], journal: bool) -> Scan<'_> {
    let items = frames(b);
    let mut out = Scan::default();
    // The end of the last whole batch, and the entries up to it.
    let mut committed = (0, 0);
    // The batch the next frame belongs to, from the frame before it.
    let mut expected: Option<u64> = None;
    for (i, item) in items.iter().enumerate() {
        match item {
            Item::Good { entry, last, end } => {
                expected = Some(entry.batch + u64::from(*last));
                out.entries.push(entry.clone());
                if *last {
                    committed = (*end, out.entries.len());
                }
            }
            Item::Bad { at, entry, end } => {
                let later: Vec<u64> = items[i + 1..]
                    .iter()
                    .filter_map(|it| match it {
                        Item::Good { entry, .. } => Some(entry.batch),
                        Item::Bad { entry, .. } => entry.as_ref().map(|(e, _)| e.batch),
                    })
                    .collect();
                let batch = expected
                    .or(entry.as_ref().map(|(e, _)| e.batch))
                    .or(later.first().copied());
                if journal && later.iter().all(|b| Some(*b) == batch) {
                    // The batch never acknowledged: it ends the file.
                    break;
                }
                match entry {
                    Some((e, last)) => {
                        out.damage
                            .push(format!("the entry of {} at byte {at} is damaged", e.id));
                        out.entries.push(e.clone());
                        expected = Some(e.batch + u64::from(*last));
                        if *last {
                            committed = (*end, out.entries.len());
                        }
                    }
                    None => {
                        out.damage
                            .push(format!("no readable entry at byte {at}, records lost"));
                        out.blind = true;
                        expected = None;
                    }
                }
            }
        }
    }
    if journal {
        // Whatever follows the last whole batch was never acknowledged.
        out.valid_len = committed.0;
        out.entries.truncate(committed.1);
        out.zero_tail = b[committed.0..].iter().all(|&x| x == 0);
    } else {
        out.valid_len = b.len();
        match out.entries.last() {
            Some(e) if e.kind == Kind::End => {
                out.entries.pop();
            }
            _ => {
                out.damage.push("the snapshot is cut short".into());
                out.blind = true;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(out: &mut Vec<u8>, no: u64, ids: &[&str]) {
        for (i, id) in ids.iter().enumerate() {
            encode(out, no, i + 1 == ids.len(), Kind::Put, id, id.as_bytes());
        }
    }

    fn ids<'a>(s: &Scan<'a>) -> Vec<(&'a str, Kind)> {
        s.entries.iter().map(|e| (e.id, e.kind)).collect()
    }

    #[test]
    fn a_batch_cut_anywhere_is_dropped_whole_and_nothing_else() {
        let mut b = Vec::new();
        batch(&mut b, 1, &["a", "b"]);
        let whole = b.len();
        batch(&mut b, 2, &["c", "d"]);
        for cut in whole..b.len() {
            for zeros in [false, true] {
                let mut t = b[..cut].to_vec();
                if zeros {
                    t.resize(b.len(), 0);
                }
                let s = scan(&t, true);
                assert_eq!(ids(&s), [("a", Kind::Put), ("b", Kind::Put)], "cut {cut}");
                assert_eq!((s.valid_len, s.blind), (whole, false), "cut {cut}");
                assert!(s.damage.is_empty(), "cut {cut}: {:?}", s.damage);
            }
        }
        // Its second frame whole, its first one not: still the unacknowledged end.
        let mut t = b.clone();
        t[whole + 5] ^= 0xff;
        let s = scan(&t, true);
        assert_eq!((s.entries.len(), s.valid_len), (2, whole));
    }

    #[test]
    fn damage_before_a_later_batch_is_reported_with_the_id_it_hides() {
        let mut b = Vec::new();
        batch(&mut b, 1, &["a"]);
        let second = b.len();
        batch(&mut b, 2, &["bb"]);
        batch(&mut b, 3, &["c"]);
        // The payload of "bb": its header still names it.
        let mut t = b.clone();
        let last = t.len();
        t[second + FIXED + 2 + 4] ^= 1;
        let s = scan(&t, true);
        assert_eq!(
            ids(&s),
            [("a", Kind::Put), ("bb", Kind::Unreadable), ("c", Kind::Put)]
        );
        assert_eq!((s.valid_len, s.blind, s.damage.len()), (last, false, 1));
        // Its header: the id is lost with it.
        let mut t = b.clone();
        t[second + 5] ^= 1;
        let s = scan(&t, true);
        assert_eq!(ids(&s), [("a", Kind::Put), ("c", Kind::Put)]);
        assert!(s.blind && s.damage.len() == 1, "{s:?}");
    }

    #[test]
    fn a_snapshot_must_end_with_its_end_frame() {
        let mut b = Vec::new();
        encode(&mut b, 0, false, Kind::Put, "a", b"x");
        let cut = b.len();
        encode(&mut b, 0, true, Kind::End, "", b"");
        let s = scan(&b, false);
        assert_eq!((ids(&s), s.blind), (vec![("a", Kind::Put)], false));
        let s = scan(&b[..cut], false);
        assert!(s.blind, "{s:?}");
        assert!(scan(&[], false).blind);
    }
}
