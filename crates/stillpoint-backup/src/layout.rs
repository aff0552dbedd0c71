//! Where every object lives inside a job's store (see `docs/store-layout.md`).
//!
//! ```text
//! shared/ab/abcdef…64 hex         content-addressed snapshot files (SHA-256 of the plaintext)
//! checkpoints/<id:020>/tasks/task-<t>.json   one snapshot manifest per task
//! checkpoints/<id:020>/_checkpoint.json      the global manifest: its presence is the commit
//! lease/current.json              who may write, until when
//! lease/claims/<owner:020>.json   one per owner id ever taken (created if-not-exists)
//! journal/<name>/…                progress journals (same lease scheme under journal/<name>/lease/)
//! stats/<id:020>.json             per-checkpoint statistics written by the engine
//! ```
//!
//! Checkpoint ids are zero-padded to 20 digits so that lexicographic order (the order
//! object stores list in) is numeric order.

use stillpoint_wire::{CheckpointId, RelativePath, Sha256Digest, TaskId};

pub(crate) const SHARED: &str = "shared/";
pub(crate) const CHECKPOINTS: &str = "checkpoints/";
pub(crate) const COMMIT_FILE: &str = "_checkpoint.json";
pub(crate) const STATS: &str = "stats/";
pub(crate) const JOURNALS: &str = "journal/";
/// The job's lease scope.
pub(crate) const JOB_LEASE: &str = "lease/";
/// Written when a bounded job has ended: the checkpoint it ended at.
pub(crate) const FINISHED: &str = "job/finished.json";

/// The stored object of a snapshot file with this digest.
pub(crate) fn shared_object(digest: &Sha256Digest) -> String {
    let hex = digest.to_hex();
    let fan = hex.get(..2).unwrap_or("00");
    format!("{SHARED}{fan}/{hex}")
}

/// The digest named by a shared object path, if it is one.
pub(crate) fn digest_of_shared(path: &str) -> Option<Sha256Digest> {
    let rest = path.strip_prefix(SHARED)?;
    let (fan, hex) = rest.split_once('/')?;
    let digest = Sha256Digest::from_hex(hex).ok()?;
    (hex.get(..2) == Some(fan)).then_some(digest)
}

pub(crate) fn checkpoint_dir(id: CheckpointId) -> String {
    format!("{CHECKPOINTS}{:020}/", id.get())
}

/// The global manifest of checkpoint `id`, whose presence is its commit.
#[must_use]
pub fn commit_object(id: CheckpointId) -> String {
    format!("{}{COMMIT_FILE}", checkpoint_dir(id))
}

pub(crate) fn stats_object(id: CheckpointId) -> String {
    format!("{STATS}{:020}.json", id.get())
}

/// The path (relative to the store root) of a task's snapshot manifest.
#[allow(clippy::expect_used)]
pub(crate) fn task_manifest(id: CheckpointId, task: TaskId) -> RelativePath {
    // The invariant is local: digits, `/`, `-`, `.` and fixed ASCII words, well under
    // the length limit, is always a valid relative path (a unit test pins it).
    RelativePath::new(format!(
        "{}tasks/task-{}.json",
        checkpoint_dir(id),
        task.get()
    ))
    .expect("a checkpoint id and task id always form a valid relative path")
}

/// The checkpoint id of an object under `checkpoints/`, if it is one.
pub(crate) fn checkpoint_of(path: &str) -> Option<CheckpointId> {
    let rest = path.strip_prefix(CHECKPOINTS)?;
    let (digits, _) = rest.split_once('/')?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().map(CheckpointId)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_round_trip_through_their_paths() {
        let digest = Sha256Digest::of(b"sst");
        let object = shared_object(&digest);
        assert!(object.starts_with("shared/"));
        assert_eq!(digest_of_shared(&object), Some(digest));
        assert_eq!(digest_of_shared("shared/zz/notahash"), None);
        let id = CheckpointId(42);
        assert_eq!(
            commit_object(id),
            "checkpoints/00000000000000000042/_checkpoint.json"
        );
        assert_eq!(checkpoint_of(&commit_object(id)), Some(id));
        assert_eq!(
            checkpoint_of(task_manifest(id, TaskId(3)).as_str()),
            Some(id)
        );
        assert_eq!(checkpoint_of("checkpoints/42/_checkpoint.json"), None);
        assert!(
            checkpoint_dir(CheckpointId(9)) < checkpoint_dir(CheckpointId(10)),
            "lexicographic order is numeric order"
        );
    }
}
