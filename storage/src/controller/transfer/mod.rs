//! Volumes whose data moves between nodes: a restore or clone made on one node
//! from a snapshot or volume of another.
//!
//! The source node first takes a *hold* (`hold`): a copy of the snapshot, or
//! of the volume frozen while copied (a reflink where the pool can), that no
//! one changes while it is sent. The target node makes the volume at once,
//! marked as arriving (`core::arrival`), and pulls the hold's data in the
//! background (`arrive`): only what is allocated, in pieces of at most one
//! cell (1 MiB) that never cross a cell's boundary, each with its BLAKE3
//! digest; a run of empty cells travels as one piece of zeros and stays a
//! hole. The target writes each piece, and at each checkpoint makes what it
//! wrote durable and records how far it got, so that a transfer cut by a crash
//! of either node, or by the network, goes on from there; a checkpoint runs on
//! a thread of its own while the next pieces are written, and records only
//! what was written before its flush began. The source asks the disk for the
//! next pieces' data ahead of reading them. The last message
//! carries the digest of the whole transfer's ledger (every piece's offset,
//! length and digest, from the start), which the target compares with its own
//! before it clears the mark.
//!
//! A hold kept after its transfer is the *base* of the next transfer of the
//! same volume to the same node, which then sends only what changed since
//! (the two holds share their unchanged extents, `metadata`): as *patches*,
//! the changed ranges of each cell only, the rest of the cell kept as the
//! target's copy of the base holds it.

mod arrive;
mod hold;
mod pieces;
mod receive;
mod releases;
mod replica;
mod target;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

pub(crate) use arrive::Arrivals;
pub use arrive::{ArrivingFrom, Sources, TransferStatus};
pub use hold::{HoldInfo, HoldSource, HoldStream};
pub use pieces::{Entry, Piece, Sum, Trailer, CELL};

use crate::error::Result;

/// What a transfer's source sends: pieces in ascending order, then the
/// trailer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    Piece(Piece),
    Trailer(Trailer),
}

/// The hold of a transfer as its target reaches it: through the mesh, from
/// another node's agent.
pub trait Source: Send {
    /// The pieces of the hold from `from` (a cell boundary) on, then the
    /// trailer; only what differs from the hold `base` when it is given, as
    /// patches of cells where the source can (the source may send every cell
    /// whole when it no longer has that base, or does not send patches).
    /// Stops soon after `stop` is set.
    fn read<'a>(
        &'a mut self,
        from: u64,
        base: Option<&str>,
        stop: &'a AtomicBool,
    ) -> Result<Box<dyn Iterator<Item = Result<Received>> + 'a>>;

    /// The target is done with the hold: it is removed, or kept as the base
    /// of the next transfer.
    fn release(&mut self, keep_as_base: bool) -> Result<()>;
}

/// Removes an image that nothing describes any more on a thread of its own:
/// freeing the extents it shares with other images takes tens of
/// milliseconds a GiB, which the transfer that replaced it does not wait
/// for. A crash before leaves an orphan, which the next start removes.
pub(crate) fn remove_later(image: PathBuf) {
    let remove = |image: &std::path::Path| {
        if let Err(e) = csi_sys::file::remove_file_if_exists(image) {
            tracing::warn!(error = %e, "cannot remove an image no longer needed; the next start does");
        }
    };
    let path = image.clone();
    let spawned = std::thread::Builder::new()
        .name("remove-image".into())
        .spawn(move || remove(&path));
    if spawned.is_err() {
        remove(&image);
    }
}
