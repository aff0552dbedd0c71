//! Retention and garbage collection: keep the newest N checkpoints plus every
//! savepoint, delete what nothing retained references, never anything younger than
//! the grace period, and back off when collection keeps failing.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, SystemTime};

use stillpoint_wire::{CheckpointId, CheckpointKind, Sha256Digest, SnapshotManifest};

use crate::store::Listed;
use crate::{Lease, ListingStatus, Store, StoreError, layout};

/// What retention keeps.
#[derive(Clone, Debug)]
pub struct Retention {
    /// Committed periodic checkpoints kept, newest first (default 3, at least 1).
    /// Savepoints are always kept.
    pub keep_last: usize,
    /// Objects younger than this are never deleted: an upload may be in flight
    /// (default 10 minutes).
    pub grace: Duration,
    /// Deletes that may fail before a run gives up (default 16).
    pub max_delete_failures: usize,
    /// Per-checkpoint statistics documents kept, newest first (default 100), so the
    /// history outlives the checkpoints themselves — as Flink's checkpoint history
    /// does. A retained checkpoint's statistics are always kept.
    pub history: usize,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            keep_last: 3,
            grace: Duration::from_secs(600),
            max_delete_failures: 16,
            history: 100,
        }
    }
}

/// What a collection would delete, and what it keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcPlan {
    /// Committed checkpoints retained (newest N and savepoints), oldest first.
    pub retained: Vec<CheckpointId>,
    /// Committed checkpoints past retention: their manifests go.
    pub expired: Vec<CheckpointId>,
    /// Checkpoints that never committed, older than the newest commit and the grace
    /// period: their task manifests go.
    pub abandoned: Vec<CheckpointId>,
    /// Checkpoints in flight, or whose manifest is corrupt: left alone.
    pub untouched: Vec<CheckpointId>,
    /// Shared files no kept manifest references and older than the grace period.
    pub orphans: Vec<String>,
    /// Their bytes.
    pub orphan_bytes: u64,
    /// Unreferenced shared files kept because they are younger than the grace period.
    pub young: usize,
    /// Statistics documents past the history window (of checkpoints not retained).
    pub stats_expired: Vec<CheckpointId>,
}

impl GcPlan {
    /// Whether the plan deletes nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.expired.is_empty()
            && self.abandoned.is_empty()
            && self.orphans.is_empty()
            && self.stats_expired.is_empty()
    }
}

/// Works out what to delete. Reads every kept task manifest; if one cannot be read
/// the plan fails rather than risk deleting what it references.
pub async fn plan(
    store: &Store,
    retention: &Retention,
    now: SystemTime,
) -> Result<GcPlan, StoreError> {
    if retention.keep_last == 0 {
        return Err(StoreError::InvalidOption {
            option: "retention.keep_last",
            reason: "at least one checkpoint must be kept".to_owned(),
        });
    }
    let listing = store.checkpoints().await?;
    let newest_commit = listing
        .iter()
        .filter(|l| matches!(l.status, ListingStatus::Committed(_)))
        .map(|l| l.id)
        .max();
    let mut periodic: Vec<CheckpointId> = listing
        .iter()
        .filter_map(|l| match &l.status {
            ListingStatus::Committed(m) if m.kind == CheckpointKind::Checkpoint => Some(l.id),
            _ => None,
        })
        .collect();
    periodic.sort_unstable();
    let keep_from = periodic.len().saturating_sub(retention.keep_last);
    let kept_periodic: BTreeSet<CheckpointId> = periodic.iter().skip(keep_from).copied().collect();

    let mut plan = GcPlan::default();
    // Directories whose task manifests protect the files they reference.
    let mut protected_dirs = Vec::new();
    for entry in &listing {
        match &entry.status {
            ListingStatus::Committed(m)
                if m.kind == CheckpointKind::Savepoint || kept_periodic.contains(&entry.id) =>
            {
                plan.retained.push(entry.id);
                protected_dirs.push(entry.id);
            }
            ListingStatus::Committed(_) => plan.expired.push(entry.id),
            ListingStatus::Incomplete { .. }
                if newest_commit.is_some_and(|newest| entry.id < newest)
                    && older_than_grace(store, entry.id, retention.grace, now).await? =>
            {
                plan.abandoned.push(entry.id);
            }
            ListingStatus::Incomplete { .. } | ListingStatus::Corrupt(_) => {
                plan.untouched.push(entry.id);
                protected_dirs.push(entry.id);
            }
        }
    }

    let mut referenced: HashSet<Sha256Digest> = HashSet::new();
    for id in protected_dirs {
        for object in store.list(&layout::checkpoint_dir(id)).await? {
            if object.path.ends_with(layout::COMMIT_FILE) {
                continue;
            }
            let bytes = store.get(&object.path).await?;
            let manifest =
                SnapshotManifest::parse(&bytes).map_err(|source| StoreError::Manifest {
                    path: object.path.clone(),
                    source,
                })?;
            referenced.extend(manifest.files.iter().map(|f| f.sha256));
        }
    }

    for object in store.list(layout::SHARED).await? {
        let Some(digest) = layout::digest_of_shared(&object.path) else {
            continue; // not ours: never delete what we did not write
        };
        if referenced.contains(&digest) {
            continue;
        }
        if is_older(store, &object, retention.grace, now).await? {
            plan.orphan_bytes += object.size;
            plan.orphans.push(object.path);
        } else {
            plan.young += 1;
        }
    }

    let with_stats = store.stats_ids().await?; // oldest first
    let window_from = with_stats.len().saturating_sub(retention.history);
    plan.stats_expired = with_stats
        .into_iter()
        .take(window_from)
        .filter(|id| !plan.retained.contains(id))
        .collect();
    Ok(plan)
}

/// What a collection deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcReport {
    /// The plan that was carried out.
    pub plan: GcPlan,
    /// Shared files deleted (not-found counts as deleted).
    pub orphans_deleted: usize,
}

/// Plans and carries out a collection. `lease` must be the job's: it is checked
/// before anything is deleted. Global manifests go first, so a half-finished run
/// never leaves a checkpoint listed as complete with files missing; deletes are
/// idempotent and run `parallelism` at a time.
pub async fn collect(
    store: &Store,
    retention: &Retention,
    lease: &Lease,
    now: SystemTime,
) -> Result<GcReport, StoreError> {
    let plan = plan(store, retention, now).await?;
    if plan.is_empty() {
        return Ok(GcReport {
            plan,
            orphans_deleted: 0,
        });
    }
    lease.check().await?;
    for id in plan.expired.iter().chain(&plan.abandoned) {
        store.delete_checkpoint(*id).await?;
    }
    let orphans_deleted = store
        .delete_all(plan.orphans.clone(), retention.max_delete_failures)
        .await?;
    store
        .delete_all(
            plan.stats_expired
                .iter()
                .map(|id| layout::stats_object(*id))
                .collect(),
            retention.max_delete_failures,
        )
        .await?;
    tracing::info!(
        expired = plan.expired.len(),
        abandoned = plan.abandoned.len(),
        orphans = orphans_deleted,
        bytes = plan.orphan_bytes,
        "garbage collected"
    );
    Ok(GcReport {
        plan,
        orphans_deleted,
    })
}

async fn is_older(
    store: &Store,
    object: &Listed,
    grace: Duration,
    now: SystemTime,
) -> Result<bool, StoreError> {
    // An object whose age the store cannot tell is kept.
    Ok(store
        .modified(object)
        .await?
        .and_then(|at| now.duration_since(at).ok())
        .is_some_and(|age| age >= grace))
}

async fn older_than_grace(
    store: &Store,
    id: CheckpointId,
    grace: Duration,
    now: SystemTime,
) -> Result<bool, StoreError> {
    for object in store.list(&layout::checkpoint_dir(id)).await? {
        if !is_older(store, &object, grace, now).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// When collection may run next: after each consecutive failure the wait doubles,
/// from `base` up to `max`, so a failing store is not hammered and collection never
/// crowds out checkpoints. Time is passed in (milliseconds), so this is testable
/// without a clock.
#[derive(Clone, Debug)]
pub struct GcBackoff {
    base: Duration,
    max: Duration,
    failures: u32,
    not_before_millis: u64,
}

impl GcBackoff {
    /// Backoff from `base` doubling up to `max`.
    #[must_use]
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max: max.max(base),
            failures: 0,
            not_before_millis: 0,
        }
    }

    /// Whether a collection may start at `now_millis`.
    #[must_use]
    pub fn ready(&self, now_millis: u64) -> bool {
        now_millis >= self.not_before_millis
    }

    /// Consecutive failures so far.
    #[must_use]
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Records a successful run: the next may start at once.
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.not_before_millis = 0;
    }

    /// Records a failed run at `now_millis`; returns how long to wait.
    pub fn failed(&mut self, now_millis: u64) -> Duration {
        let exponent = self.failures.min(20);
        self.failures = self.failures.saturating_add(1);
        let wait = self.base.saturating_mul(1u32 << exponent).min(self.max);
        self.not_before_millis =
            now_millis.saturating_add(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX));
        wait
    }
}

/// Retention applied in the background, as a job's coordinator needs it: after each
/// completed checkpoint [`BackgroundGc::after_checkpoint`] starts a collection on the
/// runtime and returns at once — unless one still runs or the backoff holds — so the
/// listing and manifest reads of a collection never delay the next checkpoint.
/// [`BackgroundGc::finish`] waits for the one running (the end of a run).
#[derive(Debug)]
pub struct BackgroundGc {
    store: Store,
    retention: Retention,
    lease: std::sync::Arc<Lease>,
    runtime: tokio::runtime::Handle,
    backoff: GcBackoff,
    epoch: std::time::Instant,
    running: Option<tokio::task::JoinHandle<Result<GcReport, StoreError>>>,
}

impl BackgroundGc {
    /// Collections of `store` under `lease` on `runtime`, backing off from 1 s up to
    /// 60 s while they fail.
    #[must_use]
    pub fn new(
        store: Store,
        retention: Retention,
        lease: std::sync::Arc<Lease>,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        Self {
            store,
            retention,
            lease,
            runtime,
            backoff: GcBackoff::new(Duration::from_secs(1), Duration::from_secs(60)),
            epoch: std::time::Instant::now(),
            running: None,
        }
    }

    /// Starts a collection unless one is running or a failure's backoff holds; never
    /// waits for one.
    pub fn after_checkpoint(&mut self) {
        if self.running.as_ref().is_some_and(|r| !r.is_finished()) {
            return;
        }
        if let Some(done) = self.running.take() {
            self.settle(self.runtime.block_on(done));
        }
        if !self.backoff.ready(self.now_millis()) {
            return;
        }
        let (store, retention, lease) = (
            self.store.clone(),
            self.retention.clone(),
            std::sync::Arc::clone(&self.lease),
        );
        self.running =
            Some(self.runtime.spawn(async move {
                collect(&store, &retention, &lease, SystemTime::now()).await
            }));
    }

    /// Waits for the running collection, if any (a run ends; the lease is still held).
    pub fn finish(&mut self) {
        if let Some(running) = self.running.take() {
            let done = self.runtime.block_on(running);
            self.settle(done);
        }
    }

    /// Consecutive failed collections.
    #[must_use]
    pub fn failures(&self) -> u32 {
        self.backoff.failures()
    }

    fn settle(&mut self, done: Result<Result<GcReport, StoreError>, tokio::task::JoinError>) {
        let error = match done {
            Ok(Ok(report)) => {
                self.backoff.succeeded();
                if !report.plan.is_empty() {
                    tracing::debug!(
                        expired = report.plan.expired.len(),
                        orphans = report.orphans_deleted,
                        "retention applied"
                    );
                }
                return;
            }
            Ok(Err(error)) => error.to_string(),
            Err(error) => format!("it did not finish: {error}"),
        };
        let wait = self.backoff.failed(self.now_millis());
        tracing::warn!(error, ?wait, "garbage collection failed; backing off");
    }

    fn now_millis(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets_on_success() {
        let mut backoff = GcBackoff::new(Duration::from_secs(1), Duration::from_secs(10));
        assert!(backoff.ready(0));
        assert_eq!(backoff.failed(1_000), Duration::from_secs(1));
        assert!(!backoff.ready(1_999));
        assert!(backoff.ready(2_000));
        assert_eq!(backoff.failed(2_000), Duration::from_secs(2));
        assert_eq!(backoff.failed(4_000), Duration::from_secs(4));
        assert_eq!(backoff.failed(8_000), Duration::from_secs(8));
        assert_eq!(backoff.failed(16_000), Duration::from_secs(10));
        for _ in 0..100 {
            assert_eq!(backoff.failed(0), Duration::from_secs(10));
        }
        backoff.succeeded();
        assert!(backoff.ready(0));
        assert_eq!(backoff.failures(), 0);
    }
}
