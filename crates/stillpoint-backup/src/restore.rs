//! Restore of a whole checkpoint to a local directory: parallel, verified, and
//! resumable through a progress journal in the store.

use std::path::Path;
use std::sync::Arc;

use stillpoint_wire::CheckpointId;

use crate::journal::{self, Journal, JournalConfig, Resumed};
use crate::lease::Clock;
use crate::{DownloadReport, Progress, Store, StoreError, layout};

/// Downloads every task of committed checkpoint `id` into `dir/task-<id>/` and its
/// global manifest to `dir/_checkpoint.json`.
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
) -> Result<DownloadReport, StoreError> {
    let manifest = store.checkpoint(id).await?;
    let name = format!("restore/{:020}", id.get());
    let resumed: Resumed<u32, String, ()> = journal::resume(store, &name).await?;
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
        let target = dir.join(layout::COMMIT_FILE);
        tokio::fs::write(&target, document)
            .await
            .map_err(|e| StoreError::local("write", &target, &e))?;
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
