//! Restore of a whole checkpoint to a local directory (parallel, verified, and
//! resumable through a progress journal in the store), and the fetch of the
//! snapshots a restarting process needs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use stillpoint_wire::{CheckpointId, CheckpointManifest, SnapshotManifest, TaskId};

use crate::durable_fs::sync_path;
use crate::journal::{self, Journal, JournalConfig, Resumed};
use crate::lease::Clock;
use crate::{DownloadReport, Progress, Store, StoreError, VerifyDepth, layout};

/// Downloads every task of committed checkpoint `id` into `dir/task-<id>/` and its
/// global manifest to `dir/_checkpoint.json`.
///
/// `dir` must be empty (or missing), or hold an interrupted restore of this same
/// checkpoint (its journal has records); anything else is
/// [`StoreError::TargetNotEmpty`] unless `overwrite` is set. The marker
/// `_checkpoint.json` is removed first and written last — after every restored file
/// and directory was synced, through a synced temporary file renamed into place — so
/// a directory holding it is a complete restore, even after a power loss.
///
/// Each finished file is recorded in the journal `restore/<id>`; a restore that was
/// interrupted resumes from it: local files that already hash to their manifest's
/// digest are kept, so only what is missing or damaged moves again. Every downloaded
/// byte is checked against its SHA-256, and no local file is ever trusted unhashed (a
/// crash may leave a restored file short: restored files are not fsynced, the store
/// is the durable copy). The journal is removed once the restore is
/// complete; on failure it is flushed so that the next attempt resumes.
pub async fn restore_checkpoint(
    store: &Store,
    id: CheckpointId,
    dir: &Path,
    progress: &dyn Progress,
    config: JournalConfig,
    clock: Arc<dyn Clock>,
    overwrite: bool,
) -> Result<DownloadReport, StoreError> {
    let manifest = store.checkpoint(id).await?;
    let name = format!("restore/{:020}", id.get());
    let resumed: Resumed<u32, String, ()> = journal::resume(store, &name).await?;
    if !overwrite && resumed.records.is_empty() && holds_anything(dir)? {
        return Err(StoreError::TargetNotEmpty {
            path: dir.to_owned(),
        });
    }
    let marker = dir.join(layout::COMMIT_FILE);
    match std::fs::remove_file(&marker) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(StoreError::local("remove", &marker, &e)),
    }
    if !resumed.records.is_empty() {
        tracing::info!(
            checkpoint = %id,
            files = resumed.records.values().map(Vec::len).sum::<usize>(),
            "resuming an interrupted restore"
        );
    }
    let lease = config.lease.clone();
    let journal: Journal<u32, String> =
        Journal::start(store, &name, config, Arc::clone(&clock), resumed.elapsed).await?;
    let outcome: Result<DownloadReport, StoreError> = async {
        let mut total = DownloadReport::default();
        for task in &manifest.tasks {
            let snapshot = store.task_manifest(task).await?;
            let target = dir.join(format!("task-{}", task.task.get()));
            let report = store
                .download_snapshot_with(&snapshot, &target, progress, Some(&journal))
                .await?;
            total.files_downloaded += report.files_downloaded;
            total.bytes_downloaded += report.bytes_downloaded;
            total.files_reused += report.files_reused;
        }
        let document = manifest.to_bytes().map_err(|source| StoreError::Manifest {
            path: layout::commit_object(id),
            source,
        })?;
        let (dir, tasks) = (dir.to_owned(), manifest.tasks.len());
        tokio::task::spawn_blocking(move || seal_restore(&dir, tasks, &document))
            .await
            .map_err(|e| StoreError::Local {
                operation: "finish restore",
                path: PathBuf::new(),
                message: e.to_string(),
                kind: std::io::ErrorKind::Other,
            })??;
        Ok(total)
    }
    .await;
    match outcome {
        Ok(report) => {
            journal.finish(false).await?;
            journal::remove(store, &name, lease, clock, 16).await?;
            Ok(report)
        }
        Err(error) => {
            if let Err(flush) = journal.finish(true).await {
                tracing::warn!(%flush, "could not flush restore progress");
            }
            Err(error)
        }
    }
}

/// The local copies of the snapshots a restarting process needs from one
/// checkpoint.
#[derive(Debug)]
pub struct LocalRestore {
    /// The checkpoint's global manifest.
    pub manifest: CheckpointManifest,
    /// Task (as the checkpoint recorded it) → its snapshot's manifest and local
    /// directory.
    pub downloads: BTreeMap<TaskId, (SnapshotManifest, PathBuf)>,
}

/// Fetches what a restart needs from committed checkpoint `id`: every file of the
/// checkpoint is checked present first (a damaged checkpoint fails as
/// [`StoreError::Corrupt`] naming its first problem, before anything is downloaded),
/// then the snapshots of the tasks `wanted` picks from its manifest are downloaded
/// into `dir/task-N` — every byte checked against its digest, local files that
/// already match kept, files the snapshot does not list removed.
pub async fn fetch_for_restart<E: From<StoreError>>(
    store: &Store,
    id: CheckpointId,
    dir: &Path,
    wanted: impl FnOnce(&CheckpointManifest) -> Result<Vec<TaskId>, E>,
) -> Result<LocalRestore, E> {
    let verified = store.verify(id, VerifyDepth::Presence, &()).await?;
    if let Some(problem) = verified.problems.first() {
        return Err(StoreError::Corrupt {
            path: problem.object.clone(),
            problem: format!("{problem} ({} problem(s) in all)", verified.problems.len()),
        }
        .into());
    }
    let manifest = store.checkpoint(id).await?;
    let wanted = wanted(&manifest)?;
    let mut downloads = BTreeMap::new();
    for reference in manifest.tasks.iter().filter(|r| wanted.contains(&r.task)) {
        let snapshot = store.task_manifest(reference).await?;
        let target = dir.join(format!("task-{}", reference.task.get()));
        // Anything left there from another checkpoint is replaced.
        if target.exists() {
            remove_unlisted(&target, &snapshot)?;
        }
        store.download_snapshot(&snapshot, &target, &()).await?;
        downloads.insert(reference.task, (snapshot, target));
    }
    Ok(LocalRestore {
        manifest,
        downloads,
    })
}

/// Removes files of a previous restore that `snapshot` does not list (a restore
/// directory must hold exactly the snapshot's files).
fn remove_unlisted(dir: &Path, snapshot: &SnapshotManifest) -> Result<(), StoreError> {
    let keep: BTreeSet<&str> = snapshot.files.iter().map(|f| f.path.as_str()).collect();
    let entries = std::fs::read_dir(dir).map_err(|e| StoreError::local("list", dir, &e))?;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !keep.contains(name.as_str()) {
            let path = entry.path();
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            removed.map_err(|e| StoreError::local("remove", &path, &e))?;
        }
    }
    Ok(())
}

/// Whether `dir` exists and holds any entry.
fn holds_anything(dir: &Path) -> Result<bool, StoreError> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => Ok(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(StoreError::local("list", dir, &e)),
    }
}

/// Syncs every restored file and directory under `dir`, then writes the marker
/// `document` atomically: a synced temporary file renamed into place, the directory
/// synced after it.
fn seal_restore(dir: &Path, tasks: usize, document: &[u8]) -> Result<(), StoreError> {
    fn sync_tree(path: &Path) -> Result<(), StoreError> {
        if path.is_dir() {
            for entry in std::fs::read_dir(path).map_err(|e| StoreError::local("list", path, &e))? {
                let entry = entry.map_err(|e| StoreError::local("list", path, &e))?;
                sync_tree(&entry.path())?;
            }
        }
        sync_path(path).map_err(|e| StoreError::local("sync", path, &e))
    }
    tracing::debug!(dir = %dir.display(), tasks, "syncing the restored files");
    sync_tree(dir)?;
    let marker = dir.join(layout::COMMIT_FILE);
    let partial = dir.join(format!("{}.partial", layout::COMMIT_FILE));
    let written = std::fs::File::create(&partial).and_then(|mut file| {
        std::io::Write::write_all(&mut file, document)?;
        file.sync_all()
    });
    written.map_err(|e| StoreError::local("write", &partial, &e))?;
    std::fs::rename(&partial, &marker).map_err(|e| StoreError::local("rename", &partial, &e))?;
    sync_path(dir).map_err(|e| StoreError::local("sync", dir, &e))
}
