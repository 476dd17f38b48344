//! Releases of a source's hold that did not reach it. When a transfer ends
//! (its data whole, or its volume deleted), the target tells the source it
//! is done with the hold: kept there as the base of the next transfer, or
//! removed. A source down at that moment, or a target that dies in between,
//! would leave the hold, and the space its data takes, until it expires a
//! day later. So the target notes each release durably before the record of
//! the transfer goes, removes the note once the source answered, and retries
//! a noted release until it does: soon, then less and less often, and again
//! at each start.

use std::path::PathBuf;
use std::time::Duration;

use csi_sys::{dir, file};
use serde::{Deserialize, Serialize};

use super::arrive::{ArrivalRecord, Sources};
use super::hold::{age, HOLD_AGE};
use super::Source;
use crate::error::{Context, Error, Result};
use crate::model::Timestamp;
use crate::state::Domain;
use crate::Controller;

/// The wait before the first retry of a release, doubled after each.
const FIRST_RETRY: Duration = Duration::from_secs(1);
const LONGEST_WAIT: Duration = Duration::from_secs(60);

/// A release the source is to be told of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Release {
    source_node: String,
    transfer_id: String,
    read_token: String,
    keep_as_base: bool,
    created: Timestamp,
}

impl Controller {
    fn releases_dir(&self) -> PathBuf {
        self.state.domain(Domain::Controller).join("releases")
    }

    fn release_note(&self, transfer_id: &str) -> PathBuf {
        let key = blake3::hash(transfer_id.as_bytes()).to_hex();
        self.releases_dir().join(format!("{}.json", &key[..32]))
    }

    /// Notes durably that `rec`'s source is to be told the transfer is done
    /// with its hold: before the transfer's record goes.
    pub(super) fn note_release(&self, rec: &ArrivalRecord, keep_as_base: bool) -> Result<Release> {
        let note = Release {
            source_node: rec.source_node.clone(),
            transfer_id: rec.transfer_id.clone(),
            read_token: rec.read_token.clone(),
            keep_as_base,
            created: Timestamp::now(),
        };
        let at = || format!("noting the release of transfer {}", rec.transfer_id);
        let json = serde_json::to_vec(&note).map_err(|e| Error::internal(e.to_string()))?;
        file::mkdir_p_mode(&self.releases_dir(), 0o700).context(at)?;
        file::write_atomic(&self.release_note(&rec.transfer_id), &json).context(at)?;
        Ok(note)
    }

    /// Tells the source of `note` (through `source`, else as the mesh
    /// reaches it); the note goes once it answered, else a thread of its own
    /// retries.
    pub(super) fn tell_release(&self, note: Release, source: Option<&mut dyn Source>) {
        let path = self.release_note(&note.transfer_id);
        let sources = self.arrivals.sources.get().cloned();
        let told = match (source, &sources) {
            (Some(s), _) => s.release(note.keep_as_base),
            (None, Some(sources)) => {
                sources(&note.source_node, &note.transfer_id, &note.read_token)
                    .release(note.keep_as_base)
            }
            (None, None) => Err(Error::internal("no mesh to reach the source through")),
        };
        match (told, sources) {
            (Ok(()), _) => drop_note(&path),
            (Err(e), Some(sources)) => {
                tracing::info!(transfer = %note.transfer_id, source = %note.source_node,
                    error = %e, "the source's hold could not be released yet; retried until it is");
                retry(sources, path, note);
            }
            (Err(e), None) => tracing::warn!(transfer = %note.transfer_id, error = %e,
                "the source's hold could not be released; retried at the next start"),
        }
    }

    /// At start, once the mesh is reachable: every release noted and not yet
    /// told is retried.
    pub(super) fn retry_noted_releases(&self) {
        let Some(sources) = self.arrivals.sources.get() else {
            return;
        };
        let folder = self.releases_dir();
        for e in dir::list_if_exists(&folder).unwrap_or_default() {
            let path = folder.join(&e.name);
            let note = file::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Release>(&b).ok());
            match note {
                Some(note) if e.name.ends_with(".json") => retry(sources.clone(), path, note),
                // A temporary file of a note, or one that cannot be read.
                _ => drop_note(&path),
            }
        }
    }
}

fn drop_note(path: &std::path::Path) {
    if let Err(e) = file::remove_file_if_exists(path) {
        tracing::warn!(error = %e, "cannot remove the note of a release told");
    }
}

/// Tells the source of `note` again, soon, then less and less often, until
/// it answers or its hold has expired there by itself.
fn retry(sources: Sources, path: PathBuf, note: Release) {
    let spawned = std::thread::Builder::new()
        .name("release-retry".into())
        .spawn(move || {
            let mut wait = FIRST_RETRY;
            while age(note.created) < HOLD_AGE && path.exists() {
                std::thread::sleep(wait);
                let mut source = sources(&note.source_node, &note.transfer_id, &note.read_token);
                match source.release(note.keep_as_base) {
                    Ok(()) => {
                        tracing::info!(transfer = %note.transfer_id, source = %note.source_node,
                            "the source's hold released");
                        break;
                    }
                    Err(e) => tracing::debug!(transfer = %note.transfer_id, error = %e,
                        "the source's hold still cannot be released"),
                }
                wait = (wait * 2).min(LONGEST_WAIT);
            }
            drop_note(&path);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no thread to retry a release; the next start does");
    }
}
