//! The coordinator driver: runs the coordinator machine (stillpoint-task), carries out
//! its actions — requests and verdicts to the tasks, global manifests through the
//! store under the job's lease, per-checkpoint statistics, retention and garbage
//! collection — and decides when the job is done.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use stillpoint_backup::{GcBackoff, KeptLease, Store, gc};
use stillpoint_task::{Coordinator, CoordinatorAction, ManifestRequest, Time};
use stillpoint_wire::{
    CheckpointId, CheckpointKind, CheckpointManifest, Message, SourceOffset, SourcePosition,
    TaskId, TaskSnapshotRef,
};

use crate::metrics::Metrics;
use crate::transport::{CoordinatorInput, Signals};
use crate::{
    CheckpointCallback, CheckpointStats, Dataflow, EngineError, JobConfig, JobReport, StopHandle,
};

pub(crate) struct CoordinatorDriver<'a> {
    pub(crate) coordinator: Coordinator,
    pub(crate) store: Store,
    pub(crate) lease: KeptLease,
    pub(crate) runtime: &'a tokio::runtime::Runtime,
    /// Delivers a message to a task (through whatever transport reaches it).
    pub(crate) control: Box<dyn Fn(TaskId, Message) + 'a>,
    pub(crate) inputs: Receiver<CoordinatorInput>,
    pub(crate) signals: Arc<Signals>,
    pub(crate) epoch: Instant,
    pub(crate) config: &'a JobConfig,
    /// The dataflow: its sinks record each commit before they publish it.
    pub(crate) flow: &'a Dataflow,
    pub(crate) sources: Vec<TaskId>,
    /// The dataflow's parallelism per stage, recorded in every checkpoint.
    pub(crate) stages: Vec<u32>,
    /// What this run has learnt so far (starts empty).
    pub(crate) seen: Seen,
    pub(crate) backoff: GcBackoff,
    pub(crate) report: &'a mut JobReport,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) stop: StopHandle,
    pub(crate) on_checkpoint: Option<CheckpointCallback>,
}

/// The coordinator driver's own bookkeeping of one run.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// Sources that reached their end, at these offsets.
    pub(crate) finished: BTreeMap<TaskId, SourceOffset>,
    /// The source offsets each committed, not yet completed checkpoint covers.
    pub(crate) offsets: BTreeMap<CheckpointId, BTreeMap<TaskId, SourceOffset>>,
    /// Once a stop was requested: the newest checkpoint already triggered then; the
    /// job ends when a later one completes (a savepoint, if `stop_on_savepoint`).
    pub(crate) stop_after: Option<CheckpointId>,
    /// The stop asked for a savepoint.
    pub(crate) stop_on_savepoint: bool,
    /// Inputs the driver stopped at that its caller must apply (cluster mode).
    pub(crate) stash: Vec<CoordinatorInput>,
    /// A replay up to published output: the sources not yet at their bound. No
    /// checkpoint is triggered until every one is; then one is, at once, exactly
    /// there.
    pub(crate) replaying: BTreeSet<TaskId>,
}

impl Seen {
    /// A run's bookkeeping at its start: with the sources of `bounds` replaying.
    pub(crate) fn replaying(bounds: Option<&crate::dataflow::Bounds>) -> Self {
        Self {
            replaying: bounds
                .map(|b| b.keys().copied().collect())
                .unwrap_or_default(),
            ..Self::default()
        }
    }
}

impl CoordinatorDriver<'_> {
    /// Counts and logs the checkpoints a failover abandons.
    fn abort_in_flight(&self, reason: &str) {
        for checkpoint in self.coordinator.in_flight() {
            self.metrics.checkpoint_aborted();
            tracing::warn!(%checkpoint, reason, "checkpoint aborted");
        }
    }

    fn now(&self) -> Time {
        Time::from_duration(self.epoch.elapsed())
    }

    pub(crate) fn run(&mut self) -> Result<(), EngineError> {
        let span = tracing::info_span!("coordinator", stream = %self.config.stream);
        let _entered = span.enter();
        loop {
            if self.signals.crashed() {
                return Err(EngineError::Crashed("coordinator".to_owned()));
            }
            let now = self.now();
            let wait = self
                .coordinator
                .poll_timeout()
                .map_or(Duration::from_millis(20), |t| {
                    t.saturating_since(now).min(Duration::from_millis(20))
                });
            match self.inputs.recv_timeout(wait) {
                Ok(CoordinatorInput::Message(message)) => {
                    if let Err(error) = self.coordinator.handle_message(self.now(), &message) {
                        tracing::warn!(%error, "coordinator refused a message");
                    }
                }
                Ok(CoordinatorInput::SourceFinished { task, offset }) => {
                    self.seen.finished.insert(task, offset);
                }
                Ok(CoordinatorInput::SourceAtBound { task }) => {
                    if self.seen.replaying.remove(&task) && self.seen.replaying.is_empty() {
                        tracing::info!(
                            "every source replayed up to the published output: a checkpoint there"
                        );
                        self.coordinator.request_checkpoint(self.now());
                    }
                }
                Ok(CoordinatorInput::TaskFailed { task, error }) => {
                    return Err(EngineError::Failed(format!("{task}: {error}")));
                }
                Ok(input @ CoordinatorInput::NodeLost { .. }) => {
                    let CoordinatorInput::NodeLost { node, reason, .. } = &input else {
                        continue;
                    };
                    let reason = format!("{node}: {reason}");
                    self.abort_in_flight(&reason);
                    // The cluster driver applies the loss to its node table.
                    self.seen.stash.push(input);
                    return Err(EngineError::NodeLost(reason));
                }
                Ok(input @ CoordinatorInput::Connected { .. }) => {
                    // A node connected again while the generation ran: its old
                    // process is gone.
                    let CoordinatorInput::Connected { node, .. } = &input else {
                        continue;
                    };
                    let reason = format!("{node} restarted");
                    self.abort_in_flight(&reason);
                    self.seen.stash.push(input);
                    return Err(EngineError::NodeLost(reason));
                }
                Ok(CoordinatorInput::Node {
                    node,
                    message: stillpoint_wire::EngineMessage::TaskFailed { task, error, .. },
                    ..
                }) => {
                    let reason = format!("{}: {error} (on {node})", TaskId(task));
                    self.abort_in_flight(&reason);
                    return Err(EngineError::Failed(reason));
                }
                Ok(CoordinatorInput::Node { node, message, .. }) => {
                    tracing::debug!(%node, ?message, "node message ignored while running");
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    if self.signals.crashed() {
                        return Err(EngineError::Crashed("coordinator".to_owned()));
                    }
                    return Err(EngineError::Stopped("every task".to_owned()));
                }
            }
            if self.seen.stop_after.is_none() && self.stop.requested() {
                let newest = self
                    .coordinator
                    .in_flight()
                    .max()
                    .or(self.coordinator.last_completed())
                    .unwrap_or(CheckpointId(0));
                self.seen.stop_after = Some(newest);
                if self.stop.savepoint_requested() {
                    tracing::info!(after = %newest, "stop requested: a savepoint, then stop");
                    self.seen.stop_on_savepoint = true;
                } else {
                    tracing::info!(after = %newest, "stop requested: one more checkpoint, then stop");
                }
            }
            // While sources replay up to published output nothing is triggered: the
            // first checkpoint must be taken at their bounds.
            let replaying = !self.seen.replaying.is_empty();
            if self.seen.stop_on_savepoint && !replaying {
                self.request_savepoint();
            }
            let now = self.now();
            if !replaying && self.coordinator.poll_timeout().is_some_and(|t| t <= now) {
                self.coordinator.handle_timeout(now);
            }
            if self.apply()? {
                return Ok(());
            }
            // Every source has ended: the checkpoint covering the end of the input
            // comes now, not at the next interval.
            if self.all_sources_finished() && self.coordinator.in_flight().next().is_none() {
                self.coordinator.request_checkpoint(self.now());
                if self.apply()? {
                    return Ok(());
                }
            }
            // The lease's keeper refreshes it; a lease found lost ends the run.
            self.lease.fence().check_held()?;
        }
    }

    /// Asks the machine for a savepoint unless one is asked for or in flight. The
    /// stop waits for a savepoint: one aborted, or lost with a failover, is asked for
    /// again (this runs every turn of the loop while the stop waits).
    fn request_savepoint(&mut self) {
        if self.coordinator.savepoint_pending() || self.coordinator.in_flight().next().is_some() {
            return;
        }
        if let Err(error) = self.coordinator.request_savepoint(self.now()) {
            tracing::debug!(%error, "savepoint not requested");
        }
    }

    /// Whether every source has reported the end of its input.
    fn all_sources_finished(&self) -> bool {
        self.seen.finished.len() == self.sources.len()
    }

    /// Carries out the coordinator's actions; `true` once the job is done.
    fn apply(&mut self) -> Result<bool, EngineError> {
        let mut done = false;
        while let Some(action) = self.coordinator.poll_action() {
            match action {
                CoordinatorAction::Send(message) => {
                    let stillpoint_wire::Route::ToTask(task) = message.route() else {
                        tracing::warn!(kind = ?message.kind(), "coordinator sent an unexpected message");
                        continue;
                    };
                    (self.control)(task, message);
                }
                CoordinatorAction::WriteManifest(request) => {
                    let checkpoint = request.checkpoint;
                    let outcome = self.commit(&request);
                    let now = self.now();
                    match outcome {
                        Ok(millis) => {
                            self.coordinator
                                .handle_manifest_written(now, checkpoint, Ok(millis))
                        }
                        Err(error) => {
                            tracing::warn!(%checkpoint, %error, "global manifest not written");
                            if matches!(
                                error,
                                EngineError::Store(stillpoint_backup::StoreError::LeaseLost { .. })
                            ) {
                                return Err(error);
                            }
                            self.coordinator.handle_manifest_written(
                                now,
                                checkpoint,
                                Err(error.to_string()),
                            );
                        }
                    }
                }
                CoordinatorAction::Completed(completed) => {
                    let stats = CheckpointStats::from(&completed);
                    tracing::info!(
                        checkpoint = %completed.checkpoint,
                        duration_ms = stats.duration_millis,
                        stall_us = stats.max_sync_micros,
                        uploaded = stats.uploaded_bytes,
                        state = stats.state_bytes,
                        "checkpoint complete"
                    );
                    if let Err(error) = self
                        .runtime
                        .block_on(self.store.put_stats(completed.checkpoint, &stats))
                    {
                        tracing::warn!(%error, "checkpoint statistics not stored");
                    }
                    self.metrics.checkpoint_completed(&stats);
                    if let Some(tell) = &mut self.on_checkpoint {
                        tell(&stats);
                    }
                    self.report.checkpoints.push(stats);
                    self.collect_garbage();
                    let wanted =
                        !self.seen.stop_on_savepoint || completed.kind == CheckpointKind::Savepoint;
                    done |= wanted
                        && self
                            .seen
                            .stop_after
                            .is_some_and(|after| completed.checkpoint > after);
                    let covered = self.seen.offsets.get(&completed.checkpoint);
                    done |= self.all_sources_finished()
                        && covered.is_some_and(|offsets| *offsets == self.seen.finished);
                    self.seen.offsets.retain(|id, _| *id > completed.checkpoint);
                }
                CoordinatorAction::Aborted { checkpoint, reason } => {
                    self.metrics.checkpoint_aborted();
                    tracing::warn!(%checkpoint, ?reason, "checkpoint aborted");
                }
                CoordinatorAction::FailJob {
                    consecutive_failures,
                    last,
                } => {
                    return Err(EngineError::Failed(format!(
                        "{consecutive_failures} consecutive checkpoints failed, the last: {last:?}"
                    )));
                }
            }
        }
        Ok(done)
    }

    /// Writes the global manifest; the commit time on success.
    fn commit(&mut self, request: &ManifestRequest) -> Result<u64, EngineError> {
        let created_at_millis = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let manifest = CheckpointManifest {
            stream: self.config.stream,
            checkpoint: request.checkpoint,
            trans: request.trans,
            kind: request.kind,
            created_at_millis,
            max_parallelism: self.config.max_parallelism,
            tasks: request
                .tasks
                .iter()
                .map(|t| TaskSnapshotRef {
                    task: t.task,
                    node: t.node,
                    manifest: t.report.manifest.clone(),
                    sha256: t.report.manifest_sha256,
                    state_bytes: t.report.state_bytes,
                })
                .collect(),
            sources: request
                .tasks
                .iter()
                .filter_map(|t| {
                    t.report.source_offset.clone().map(|offset| SourcePosition {
                        task: t.task,
                        offset,
                    })
                })
                .collect(),
            stages: self.stages.clone(),
        };
        self.runtime
            .block_on(self.store.commit(&manifest, &self.lease))?;
        // Next to the output, before any sink is told to publish: a fallback past this
        // checkpoint replays exactly up to these offsets.
        self.flow
            .record_commit(request.checkpoint, &manifest.sources)?;
        self.seen.offsets.insert(
            request.checkpoint,
            manifest
                .sources
                .iter()
                .map(|s| (s.task, s.offset.clone()))
                .collect(),
        );
        Ok(created_at_millis)
    }

    fn collect_garbage(&mut self) {
        let now_millis = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        if !self.backoff.ready(now_millis) {
            return;
        }
        let run = gc::collect(
            &self.store,
            &self.config.retention,
            &self.lease,
            SystemTime::now(),
        );
        match self.runtime.block_on(run) {
            Ok(report) => {
                self.backoff.succeeded();
                if !report.plan.is_empty() {
                    tracing::debug!(
                        expired = report.plan.expired.len(),
                        orphans = report.orphans_deleted,
                        "retention applied"
                    );
                }
            }
            Err(error) => {
                let wait = self.backoff.failed(now_millis);
                tracing::warn!(%error, ?wait, "garbage collection failed; backing off");
            }
        }
    }
}
