//! Restore of a whole checkpoint to a local directory: parallel, verified, and
//! resumable through a progress journal in the store.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use stillpoint_wire::CheckpointId;

use crate::durable_fs::sync_path;
use crate::journal::{self, Journal, JournalConfig, Resumed};
use crate::lease::Clock;
use crate::{DownloadReport, Progress, Store, StoreError, layout};

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
