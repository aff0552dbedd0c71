//! Restore of a whole checkpoint to a local directory (parallel, verified, and
//! resumable through a progress journal beside the directory: the store is only
//! read), and the fetch of the snapshots a restarting process needs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use stillpoint_wire::{CheckpointId, CheckpointManifest, SnapshotManifest, TaskId};

use crate::durable_fs::sync_path;
use crate::journal::{self, Journal, JournalConfig, Resumed};
use crate::lease::Clock;
use crate::{
    DownloadReport, Progress, Store, StoreError, StoreOptions, StoreUri, VerifyDepth, layout,
};

/// What [`restore_checkpoint`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Files fetched, reused after hashing, or trusted from the journal.
    pub download: DownloadReport,
    /// Whether an interrupted restore was resumed from its journal.
    pub resumed: bool,
    /// Time spent restoring, summed over every interrupted run and this one.
    pub elapsed: Duration,
}

/// Where the journal of a restore into `dir` lives: beside it, as
/// `.<name>.restore-journal` in its parent directory — never in the checkpoint store,
/// so a restore needs only read access to the store, and restores of one checkpoint
/// into two directories never share (or wait for) a journal.
#[must_use]
pub fn restore_journal_dir(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map_or_else(|| "restore".into(), |n| n.to_string_lossy().into_owned());
    dir.with_file_name(format!(".{name}.restore-journal"))
}

/// The local store holding the journal of a restore into `dir` (see
/// [`restore_journal_dir`]).
pub fn restore_journal(dir: &Path) -> Result<Store, StoreError> {
    Store::open_uri(
        StoreUri::File {
            root: std::path::absolute(restore_journal_dir(dir))
                .map_err(|e| StoreError::local("resolve", dir, &e))?,
        },
        StoreOptions::default(),
    )
}

/// Downloads every task of committed checkpoint `id` into `dir/task-<id>/` and its
/// global manifest to `dir/_checkpoint.json`. The store is only read.
///
/// `dir` must be empty (or missing), or hold an interrupted restore of this same
/// checkpoint (its journal has records); anything else is
/// [`StoreError::TargetNotEmpty`] unless `overwrite` is set. The marker
/// `_checkpoint.json` is removed first and written last — after every restored file
/// and directory was synced, through a synced temporary file renamed into place — so
/// a directory holding it is a complete restore, even after a power loss.
///
/// Each finished file is synced, then recorded in a journal beside `dir` (see
/// [`restore_journal_dir`]; its lease keeps two restores out of one directory). A
/// restore that was interrupted resumes from the journal's records: a recorded file
/// of the right size is kept as it is; an unrecorded local file is kept only if it
/// hashes to its digest; everything else is fetched again, every byte checked
/// against its SHA-256. The time spent is summed across interrupted runs. The
/// journal is removed once the restore is complete; on failure it is flushed so that
/// the next attempt resumes.
pub async fn restore_checkpoint(
    store: &Store,
    id: CheckpointId,
    dir: &Path,
    progress: &dyn Progress,
    config: JournalConfig,
    clock: Arc<dyn Clock>,
    overwrite: bool,
) -> Result<RestoreReport, StoreError> {
    let manifest = store.checkpoint(id).await?;
    if !overwrite && !restore_journal_dir(dir).exists() && holds_anything(dir)? {
        return Err(StoreError::TargetNotEmpty {
            path: dir.to_owned(),
        });
    }
    let journals = restore_journal(dir)?;
    let name = format!("restore/{:020}", id.get());
    let resumed: Resumed<u32, String, ()> = journal::resume(&journals, &name).await?;
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
    let was_resumed = !resumed.records.is_empty();
    if was_resumed {
        tracing::info!(
            checkpoint = %id,
            files = resumed.records.values().map(Vec::len).sum::<usize>(),
            earlier = ?resumed.elapsed,
            "resuming an interrupted restore"
        );
    }
    let started = tokio::time::Instant::now();
    let lease = config.lease.clone();
    let journal: Journal<u32, String> = Journal::start(
        &journals,
        &name,
        config,
        Arc::clone(&clock),
        resumed.elapsed,
    )
    .await?;
    let outcome: Result<DownloadReport, StoreError> = async {
        let mut total = DownloadReport::default();
        for task in &manifest.tasks {
            let snapshot = store.task_manifest(task).await?;
            let target = dir.join(format!("task-{}", task.task.get()));
            let recorded: BTreeSet<String> = resumed
                .records
                .get(&task.task.get())
                .map(|files| files.iter().cloned().collect())
                .unwrap_or_default();
            let report = store
                .download_snapshot_with(&snapshot, &target, progress, Some((&journal, &recorded)))
                .await?;
            total.files_downloaded += report.files_downloaded;
            total.bytes_downloaded += report.bytes_downloaded;
            total.files_reused += report.files_reused;
            total.files_trusted += report.files_trusted;
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
        Ok(download) => {
            journal.finish(false).await?;
            journal::remove(&journals, &name, lease, clock, 16).await?;
            let root = restore_journal_dir(dir);
            if let Err(error) = std::fs::remove_dir_all(&root) {
                tracing::warn!(%error, dir = %root.display(), "could not remove the finished restore's journal");
            }
            Ok(RestoreReport {
                download,
                resumed: was_resumed,
                elapsed: resumed.elapsed + started.elapsed(),
            })
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
