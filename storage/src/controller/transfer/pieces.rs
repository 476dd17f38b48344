//! The pieces of a transfer, their ledger, and the checks a target makes of
//! what a source sends before it writes anything.

use bytes::Bytes;

use crate::error::{Error, Result};

/// How a source sums a piece's data.
///
/// A sum checks that what a target writes is what the source read: nothing
/// lost, moved or changed between the source's disk and the target's by the
/// software on the way. It need not be a cryptographic hash. The channel is
/// mutual TLS, whose AEAD already refuses any byte a stranger changes, and a
/// source node is trusted for what it sends: no digest could keep it from
/// sending other data with that data's own digest. The ledger's digest over
/// every entry (BLAKE3) stays the check of the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sum {
    /// XXH3-128 of the bytes, little-endian, in the first 16 of the 32 bytes
    /// a digest takes, the rest zero (a third of BLAKE3's time). A target asks
    /// for it.
    Xxh3,
    /// BLAKE3 of the bytes: what a target that does not ask gets, as from
    /// releases that knew no other.
    Blake3,
}

impl Sum {
    pub fn of(self, data: &[u8]) -> [u8; 32] {
        match self {
            Sum::Xxh3 => {
                let mut out = [0u8; 32];
                out[..16].copy_from_slice(&twox_hash::XxHash3_128::oneshot(data).to_le_bytes());
                out
            }
            Sum::Blake3 => *blake3::hash(data).as_bytes(),
        }
    }

    /// The kind of a digest a source sent: its last 16 bytes are zero only
    /// for XXH3 (for a BLAKE3 digest, once in 2^128).
    pub(crate) fn of_digest(digest: &[u8; 32]) -> Sum {
        match digest[16..].iter().all(|b| *b == 0) {
            true => Sum::Xxh3,
            false => Sum::Blake3,
        }
    }
}

/// The grid of a transfer: no piece of data crosses a multiple of this.
pub const CELL: u64 = 1 << 20;

/// What a source says of a range of the volume.
#[derive(Clone, PartialEq, Eq)]
pub enum Piece {
    /// The cell holding `offset` reads as zeros except for `data` at `offset`.
    Data {
        offset: u64,
        data: Bytes,
        digest: [u8; 32],
    },
    /// Whole cells of zeros: `[offset, offset + length)`.
    Zero { offset: u64, length: u64 },
    /// Of an incremental transfer to a target that takes patches: `data`
    /// replaces the bytes at `offset`, within one cell, and the rest of the
    /// cell keeps what the target holds (the base's data).
    Patch {
        offset: u64,
        data: Bytes,
        digest: [u8; 32],
    },
    /// Of the same: `[offset, offset + length)`, within one cell, reads as
    /// zeros; the rest of the cell keeps what the target holds.
    Clear { offset: u64, length: u64 },
}

impl std::fmt::Debug for Piece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Piece::Data { offset, data, .. } => write!(f, "Data({offset}+{})", data.len()),
            Piece::Zero { offset, length } => write!(f, "Zero({offset}+{length})"),
            Piece::Patch { offset, data, .. } => write!(f, "Patch({offset}+{})", data.len()),
            Piece::Clear { offset, length } => write!(f, "Clear({offset}+{length})"),
        }
    }
}

impl Piece {
    /// A piece of data, with its digest.
    pub fn data(offset: u64, data: impl Into<Bytes>) -> Piece {
        Piece::data_summed(offset, data, Sum::Xxh3)
    }

    /// A piece of data, with its digest of kind `sum`.
    pub fn data_summed(offset: u64, data: impl Into<Bytes>, sum: Sum) -> Piece {
        let data = data.into();
        let digest = sum.of(&data);
        Piece::Data {
            offset,
            data,
            digest,
        }
    }

    /// A patch of data, with its digest.
    pub fn patch(offset: u64, data: impl Into<Bytes>) -> Piece {
        Piece::patch_summed(offset, data, Sum::Xxh3)
    }

    /// A patch of data, with its digest of kind `sum`.
    pub fn patch_summed(offset: u64, data: impl Into<Bytes>, sum: Sum) -> Piece {
        let data = data.into();
        let digest = sum.of(&data);
        Piece::Patch {
            offset,
            data,
            digest,
        }
    }

    pub fn offset(&self) -> u64 {
        match self {
            Piece::Data { offset, .. }
            | Piece::Zero { offset, .. }
            | Piece::Patch { offset, .. }
            | Piece::Clear { offset, .. } => *offset,
        }
    }

    pub fn length(&self) -> u64 {
        match self {
            Piece::Data { data, .. } | Piece::Patch { data, .. } => data.len() as u64,
            Piece::Zero { length, .. } | Piece::Clear { length, .. } => *length,
        }
    }

    /// The bytes of data it carries: a run of zeros is named, not sent.
    pub fn data_len(&self) -> u64 {
        match self {
            Piece::Data { data, .. } | Piece::Patch { data, .. } => data.len() as u64,
            Piece::Zero { .. } | Piece::Clear { .. } => 0,
        }
    }

    /// Whether it changes part of a cell only (the rest keeps the base's).
    pub fn is_patch(&self) -> bool {
        matches!(self, Piece::Patch { .. } | Piece::Clear { .. })
    }

    /// The cells it covers, as a range of offsets.
    pub fn cells(&self) -> (u64, u64) {
        let start = self.offset() / CELL * CELL;
        let end = (self.offset() + self.length()).next_multiple_of(CELL);
        (start, end)
    }

    pub fn entry(&self) -> Entry {
        let patch = self.is_patch();
        match self {
            Piece::Data {
                offset,
                data,
                digest,
            }
            | Piece::Patch {
                offset,
                data,
                digest,
            } => Entry {
                offset: *offset,
                length: data.len() as u64,
                zero: false,
                patch,
                digest: *digest,
            },
            Piece::Zero { offset, length } | Piece::Clear { offset, length } => Entry {
                offset: *offset,
                length: *length,
                zero: true,
                patch,
                digest: [0; 32],
            },
        }
    }
}

/// One line of a transfer's ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub offset: u64,
    pub length: u64,
    pub zero: bool,
    /// A patch (the rest of its cell kept), not a whole cell.
    pub patch: bool,
    pub digest: [u8; 32],
}

impl Entry {
    /// Bytes of an entry as kept and hashed.
    pub const BYTES: usize = 49;

    pub fn encode(&self) -> [u8; Entry::BYTES] {
        let mut out = [0u8; Entry::BYTES];
        out[..8].copy_from_slice(&self.offset.to_le_bytes());
        out[8..16].copy_from_slice(&self.length.to_le_bytes());
        out[16] = self.zero as u8 | (self.patch as u8) << 1;
        out[17..].copy_from_slice(&self.digest);
        out
    }

    pub fn decode(b: &[u8]) -> Option<Entry> {
        if b.len() != Entry::BYTES || b[16] > 3 {
            return None;
        }
        Some(Entry {
            offset: u64::from_le_bytes(b[..8].try_into().ok()?),
            length: u64::from_le_bytes(b[8..16].try_into().ok()?),
            zero: b[16] & 1 == 1,
            patch: b[16] & 2 == 2,
            digest: b[17..].try_into().ok()?,
        })
    }
}

/// The running digest of a ledger.
#[derive(Default, Clone)]
pub struct Ledger {
    hasher: blake3::Hasher,
    pub pieces: u64,
    pub data_bytes: u64,
}

impl Ledger {
    pub fn add(&mut self, e: &Entry) {
        self.hasher.update(&e.encode());
        self.pieces += 1;
        if !e.zero {
            self.data_bytes += e.length;
        }
    }

    pub fn digest(&self) -> [u8; 32] {
        *self.hasher.finalize().as_bytes()
    }
}

/// The end of a transfer: what the whole of it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trailer {
    pub digest: [u8; 32],
    pub pieces: u64,
    pub data_bytes: u64,
    /// Whether only what changed since a base was sent.
    pub incremental: bool,
}

/// What a target checks of each piece before it writes it: in order after the
/// last, within the volume, whole cells of zeros, data and patches within one
/// cell, patches only where the target asked for them, and the data matching
/// its digest. A source that breaks any of these is not believed for anything.
pub struct Checker {
    /// The end of the last piece: the next must start at or after it.
    next: u64,
    size: u64,
    patches: bool,
}

impl Checker {
    /// From `from` on, in a volume of `size` bytes, taking patches or not.
    pub fn new(from: u64, size: u64, patches: bool) -> Checker {
        Checker {
            next: from,
            size,
            patches,
        }
    }

    pub fn check(&mut self, p: &Piece) -> Result<()> {
        let bad = |why: String| Err(Error::invalid(format!("the source sent {p:?}: {why}")));
        let (offset, length) = (p.offset(), p.length());
        if offset < self.next {
            return bad(format!(
                "it overlaps what came before (up to {})",
                self.next
            ));
        }
        let Some(end) = offset.checked_add(length) else {
            return bad("its end is past any volume".into());
        };
        if length == 0 || end > self.size {
            return bad(format!("the volume holds {} bytes", self.size));
        }
        match p {
            Piece::Zero { .. } => {
                if offset % CELL != 0 || (end % CELL != 0 && end != self.size) {
                    return bad("zeros come in whole cells".into());
                }
            }
            Piece::Data { data, digest, .. } | Piece::Patch { data, digest, .. } => {
                if offset / CELL != (end - 1) / CELL {
                    return bad("data crosses a cell's boundary".into());
                }
                if Sum::of_digest(digest).of(data) != *digest {
                    return bad("its digest does not match its data".into());
                }
            }
            Piece::Clear { .. } => {
                if offset / CELL != (end - 1) / CELL {
                    return bad("a cleared range crosses a cell's boundary".into());
                }
            }
        }
        if p.is_patch() && !self.patches {
            return bad(
                "patches go only to a target that holds the base and asked for them".into(),
            );
        }
        // The rest of a whole cell's piece is zeros by definition: nothing
        // may come for it. A patch leaves the rest of its cell as it was:
        // more patches may follow in it.
        self.next = if p.is_patch() {
            end
        } else {
            p.cells().1.min(self.size).max(end)
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same bytes with the first one changed (its digest no longer
    /// matches).
    fn flip_first(data: &Bytes) -> Bytes {
        let mut changed = data.to_vec();
        changed[0] ^= 3;
        changed.into()
    }

    #[test]
    fn a_checksum_takes_every_byte_and_its_place() {
        let checksum = |d: &[u8]| Sum::Xxh3.of(d);
        let data = vec![7u8; CELL as usize];
        let sum = checksum(&data);
        assert_eq!(sum[16..], [0u8; 16]);
        assert_ne!(sum[..16], [0u8; 16]);
        for at in [0, 4095, CELL as usize - 1] {
            let mut changed = data.clone();
            changed[at] ^= 1;
            assert_ne!(checksum(&changed), sum, "a byte changed at {at}");
        }
        let mut here = data.clone();
        here[0] = 1;
        let mut there = data.clone();
        there[1] = 1;
        assert_ne!(checksum(&here), checksum(&there), "the same byte elsewhere");
        assert_ne!(checksum(&data[1..]), sum, "one byte fewer");
        assert_ne!(Sum::Blake3.of(&data)[16..], [0u8; 16]);
    }

    #[test]
    fn a_target_checks_the_digests_of_a_source_that_knows_no_checksum() {
        let mut c = Checker::new(0, 4 * CELL, false);
        c.check(&Piece::data_summed(0, vec![1; 100], Sum::Blake3))
            .unwrap();
        c.check(&Piece::data_summed(CELL, vec![2; 100], Sum::Xxh3))
            .unwrap();
        for (i, sum) in [Sum::Blake3, Sum::Xxh3].into_iter().enumerate() {
            let mut forged = Piece::data_summed((2 + i as u64) * CELL, vec![3; 100], sum);
            if let Piece::Data { data, .. } = &mut forged {
                *data = flip_first(data);
            }
            let e = c.check(&forged).unwrap_err();
            assert!(e.to_string().contains("does not match"), "{sum:?}: {e}");
        }
    }

    #[test]
    fn entries_encode_and_decode() {
        let e = Piece::data(3 * CELL + 5, vec![1, 2, 3]).entry();
        assert_eq!(Entry::decode(&e.encode()), Some(e));
        let z = Piece::Zero {
            offset: 0,
            length: 4 * CELL,
        }
        .entry();
        assert!(z.zero);
        assert_eq!(Entry::decode(&z.encode()), Some(z));
        assert_eq!(Entry::decode(&[0u8; 10]), None);
    }

    #[test]
    fn the_ledger_digest_depends_on_every_entry_and_its_order() {
        let a = Piece::data(0, vec![1; 10]).entry();
        let b = Piece::Zero {
            offset: CELL,
            length: CELL,
        }
        .entry();
        let digest = |es: &[Entry]| {
            let mut l = Ledger::default();
            es.iter().for_each(|e| l.add(e));
            l.digest()
        };
        assert_eq!(digest(&[a, b]), digest(&[a, b]));
        assert_ne!(digest(&[a, b]), digest(&[b, a]));
        assert_ne!(digest(&[a, b]), digest(&[a]));
        let mut moved = a;
        moved.offset += 1;
        assert_ne!(digest(&[a, b]), digest(&[moved, b]));
    }

    #[test]
    fn a_target_refuses_what_a_hostile_source_could_send() {
        let size = 10 * CELL;
        let ok = |c: &mut Checker, p: Piece| c.check(&p).unwrap();
        let bad = |c: &mut Checker, p: Piece| {
            let e = c.check(&p).unwrap_err();
            assert!(e.to_string().contains("the source sent"), "{e}");
        };
        let mut c = Checker::new(0, size, false);
        ok(&mut c, Piece::data(10, vec![1; 100]));
        // The rest of cell 0 was zeros: nothing more for it.
        bad(&mut c, Piece::data(500, vec![1; 10]));
        ok(
            &mut c,
            Piece::Zero {
                offset: CELL,
                length: 2 * CELL,
            },
        );
        bad(&mut c, Piece::data(2 * CELL, vec![1; 10]));
        bad(&mut c, Piece::data(4 * CELL - 5, vec![1; 10]));
        bad(
            &mut c,
            Piece::Zero {
                offset: 4 * CELL + 1,
                length: CELL,
            },
        );
        bad(&mut c, Piece::data(size, vec![1]));
        bad(
            &mut c,
            Piece::Zero {
                offset: 5 * CELL,
                length: u64::MAX - CELL,
            },
        );
        let mut forged = Piece::data(6 * CELL, vec![1; 10]);
        if let Piece::Data { data, .. } = &mut forged {
            *data = flip_first(data);
        }
        bad(&mut c, forged);
        ok(&mut c, Piece::data(9 * CELL, vec![7; 10]));
        // No patches where none were asked for.
        bad(&mut c, Piece::patch(9 * CELL + 20, vec![7; 10]));
        // A zero run may end at the volume's end, off the grid.
        let mut c = Checker::new(0, CELL + 4096, false);
        ok(
            &mut c,
            Piece::Zero {
                offset: 0,
                length: CELL + 4096,
            },
        );
    }

    #[test]
    fn patches_follow_each_other_within_a_cell_and_never_cross_it() {
        let size = 4 * CELL;
        let ok = |c: &mut Checker, p: Piece| c.check(&p).unwrap();
        let bad = |c: &mut Checker, p: Piece| {
            let e = c.check(&p).unwrap_err();
            assert!(e.to_string().contains("the source sent"), "{e}");
        };
        let mut c = Checker::new(0, size, true);
        ok(&mut c, Piece::patch(4096, vec![1; 4096]));
        // The rest of the cell is the base's: more of it may follow.
        ok(
            &mut c,
            Piece::Clear {
                offset: 3 * 4096,
                length: 4096,
            },
        );
        ok(&mut c, Piece::patch(5 * 4096, vec![2; 100]));
        bad(&mut c, Piece::patch(4096, vec![1; 10]));
        bad(&mut c, Piece::patch(2 * CELL - 10, vec![1; 20]));
        bad(
            &mut c,
            Piece::Clear {
                offset: 2 * CELL - 10,
                length: 20,
            },
        );
        let mut forged = Piece::patch(3 * CELL, vec![1; 10]);
        if let Piece::Patch { data, .. } = &mut forged {
            *data = flip_first(data);
        }
        bad(&mut c, forged);
        ok(&mut c, Piece::patch(3 * CELL + 8192, vec![3; 10]));
    }

    #[test]
    fn a_patch_and_a_whole_cell_of_the_same_bytes_are_different_entries() {
        let cell = Piece::data(CELL, vec![5; 4096]).entry();
        let patch = Piece::patch(CELL, vec![5; 4096]).entry();
        assert_ne!(cell.encode(), patch.encode());
        assert_eq!(Entry::decode(&patch.encode()), Some(patch));
        let clear = Piece::Clear {
            offset: CELL + 4096,
            length: 4096,
        }
        .entry();
        assert!(clear.zero && clear.patch);
        assert_eq!(Entry::decode(&clear.encode()), Some(clear));
        let mut b = clear.encode();
        b[16] = 4;
        assert_eq!(Entry::decode(&b), None);
    }
}
