//! The coordinator driver: runs the coordinator machine (stillpoint-task), carries out
//! its actions — requests and verdicts to the tasks, global manifests through the
//! store under the job's lease, per-checkpoint statistics, retention and garbage
//! collection — and decides when the job is done.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use stillpoint_backup::{BackgroundGc, KeptLease, Store};
use stillpoint_task::{
    Coordinator, CoordinatorAction, CoordinatorConfig, JobEnd, ManifestRequest, Time,
};
use stillpoint_wire::{CheckpointId, Message, TaskId};

use crate::transport::{CoordinatorInput, Signals};
use crate::{
    CheckpointCallback, CheckpointStats, Dataflow, Engine, EngineError, JobConfig, JobReport,
    RestoreChoice, RunOptions, StopHandle,
};
use stillpoint_metrics::Metrics;

struct CoordinatorDriver<'a, E> {
    coordinator: Coordinator,
    store: Store,
    lease: KeptLease,
    runtime: &'a tokio::runtime::Runtime,
    /// Delivers a message to a task (through whatever transport reaches it).
    control: Box<dyn Fn(TaskId, Message) + 'a>,
    inputs: Receiver<CoordinatorInput<E>>,
    signals: Arc<Signals>,
    on_pause: Option<Box<dyn FnMut(bool) + 'a>>,
    epoch: Instant,
    config: &'a JobConfig,
    /// The dataflow: its sinks record each commit before they publish it.
    flow: &'a Dataflow,
    /// The dataflow's parallelism per stage, recorded in every checkpoint.
    stages: Vec<u32>,
    /// When this run's job is done.
    end: JobEnd,
    gc: BackgroundGc,
    /// Statistics documents being written.
    stats_writes: Vec<tokio::task::JoinHandle<()>>,
    report: &'a mut JobReport,
    metrics: Arc<Metrics>,
    stop: StopHandle,
    on_checkpoint: Option<CheckpointCallback>,
    /// The process's events that ended the run, for the caller.
    handed_back: Vec<E>,
}

/// One run of the coordinator driver: the checkpoints of one generation, from its
/// restore until the job is done, stopped, or the generation fails.
pub struct CheckpointRun<'a, E> {
    /// The job's lease (handed back in [`RunEnded`]).
    pub lease: KeptLease,
    /// The restore the generation started from.
    pub choice: &'a RestoreChoice,
    /// Delivers a message to a task, through whatever transport reaches it.
    pub route: Box<dyn Fn(TaskId, Message) + 'a>,
    /// What the tasks (and the process around the driver) report.
    pub inputs: Receiver<CoordinatorInput<E>>,
    /// A crash of these stops the driver where it is; a pause of the run's stop
    /// handle is set on them.
    pub signals: Arc<Signals>,
    /// Told each change of the stop handle's pause, for sources the signals do not
    /// reach (a cluster's nodes).
    pub on_pause: Option<Box<dyn FnMut(bool) + 'a>>,
    /// Where completed and aborted checkpoints are counted.
    pub metrics: Arc<Metrics>,
    /// The completed checkpoints are added to it.
    pub report: &'a mut JobReport,
    /// The stop handle and the checkpoint callback of the run.
    pub options: &'a mut RunOptions,
}

impl<E> std::fmt::Debug for CheckpointRun<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointRun")
            .field("choice", self.choice)
            .finish_non_exhaustive()
    }
}

/// How a [`CheckpointRun`] ended.
#[derive(Debug)]
pub struct RunEnded<E> {
    /// `Ok` once the job is done (its input covered by a checkpoint, or stopped
    /// after a final one); otherwise why the generation cannot go on.
    pub result: Result<(), EngineError>,
    /// The job's lease, back.
    pub lease: KeptLease,
    /// The process's events that ended the run ([`CoordinatorInput::Process`]).
    pub handed_back: Vec<E>,
}

impl Engine {
    /// Runs the coordinator driver over one generation: triggers checkpoints,
    /// commits their global manifests under the lease, tells the tasks, applies
    /// retention and decides when the job is done. Checkpoint ids continue above
    /// every id the store or the sinks have seen.
    pub fn run_checkpoints<E>(&self, run: CheckpointRun<'_, E>) -> RunEnded<E> {
        let published = run.choice.plan.newest_published.unwrap_or(CheckpointId(0));
        let machine = self.highest_checkpoint().and_then(|highest| {
            self.coordinator_machine(run.choice.checkpoint, highest.max(published))
        });
        let coordinator = match machine {
            Ok(machine) => machine,
            Err(error) => {
                return RunEnded {
                    result: Err(error),
                    lease: run.lease,
                    handed_back: Vec::new(),
                };
            }
        };
        // Retention runs beside the checkpoints, never in their way.
        let gc = BackgroundGc::new(
            self.store.clone(),
            self.config.retention.clone(),
            run.lease.shared(),
            self.runtime.handle().clone(),
        );
        let mut driver = CoordinatorDriver {
            coordinator,
            store: self.store.clone(),
            lease: run.lease,
            runtime: &self.runtime,
            control: run.route,
            inputs: run.inputs,
            signals: run.signals,
            on_pause: run.on_pause,
            epoch: Instant::now(),
            config: &self.config,
            flow: &self.flow,
            stages: self.topology.parallelisms(),
            end: JobEnd::new(
                self.topology.sources().len(),
                (run.choice.plan.replay.iter()).flat_map(|r| r.bounds.keys().copied()),
            ),
            gc,
            stats_writes: Vec::new(),
            report: run.report,
            metrics: run.metrics,
            stop: run.options.stop.clone(),
            on_checkpoint: run.options.on_checkpoint.take(),
            handed_back: Vec::new(),
        };
        let result = driver.run();
        driver.gc.finish();
        for write in driver.stats_writes.drain(..) {
            let _ = self.runtime.block_on(write);
        }
        run.options.on_checkpoint = driver.on_checkpoint.take();
        RunEnded {
            result,
            lease: driver.lease,
            handed_back: driver.handed_back,
        }
    }

    /// The highest checkpoint id the store has seen (committed or not): new ids
    /// start above it, so an id is never reused.
    fn highest_checkpoint(&self) -> Result<CheckpointId, EngineError> {
        Ok(self
            .runtime
            .block_on(self.store.checkpoints())?
            .iter()
            .map(|l| l.id)
            .max()
            .unwrap_or(CheckpointId(0)))
    }

    fn coordinator_machine(
        &self,
        restored: Option<CheckpointId>,
        highest_seen: CheckpointId,
    ) -> Result<Coordinator, EngineError> {
        let config = &self.config;
        let sources = self.topology.sources().to_vec();
        Ok(Coordinator::new(
            CoordinatorConfig {
                interval: config.checkpoint_interval,
                timeout: config.checkpoint_timeout,
                max_concurrent: config.max_concurrent_checkpoints,
                min_pause: config.min_pause,
                tolerable_failures: config.tolerable_failures,
                ..CoordinatorConfig::new(config.stream, sources, self.topology.all())
            },
            Time::ZERO,
            restored,
            CheckpointId(highest_seen.get() + 1),
        )?)
    }
}

impl<E> CoordinatorDriver<'_, E> {
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

    fn run(&mut self) -> Result<(), EngineError> {
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
                    let newest = self.newest_triggered();
                    self.end.source_finished(task, offset, newest);
                }
                Ok(CoordinatorInput::SourceAtBound { task }) => {
                    if self.end.source_at_bound(task) {
                        tracing::info!(
                            "every source replayed up to the published output: a checkpoint there"
                        );
                        self.coordinator.request_checkpoint(self.now());
                    }
                }
                Ok(CoordinatorInput::TaskFailed { task, error }) => {
                    return Err(EngineError::Failed(format!("{task}: {error}")));
                }
                Ok(CoordinatorInput::Process {
                    event,
                    ends_run: Some(error),
                }) => {
                    self.abort_in_flight(&error.to_string());
                    self.handed_back.push(event);
                    return Err(error);
                }
                Ok(CoordinatorInput::Process { .. }) => {}
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    if self.signals.crashed() {
                        return Err(EngineError::Crashed("coordinator".to_owned()));
                    }
                    return Err(EngineError::Stopped("every task".to_owned()));
                }
            }
            let paused = self.stop.paused();
            if paused != self.signals.paused() {
                self.signals.set_paused(paused);
                if let Some(tell) = &mut self.on_pause {
                    tell(paused);
                }
            }
            if self.stop.requested() {
                let (newest, savepoint) =
                    (self.newest_triggered(), self.stop.savepoint_requested());
                if self.end.stop_requested(newest, savepoint) {
                    let then = if savepoint {
                        "a savepoint"
                    } else {
                        "one more checkpoint"
                    };
                    tracing::info!(after = %newest, "stop requested: {then}, then stop");
                }
            }
            // While sources replay up to published output nothing is triggered: the
            // first checkpoint must be taken at their bounds.
            let replaying = self.end.replaying();
            if self.end.stop_on_savepoint() && !replaying {
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
            if self.end.all_sources_finished() && self.coordinator.in_flight().next().is_none() {
                // (Also after one in flight at the end completed: it did not count.)
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

    /// The newest checkpoint triggered so far (in flight or completed).
    fn newest_triggered(&self) -> CheckpointId {
        let in_flight = self.coordinator.in_flight().max();
        (in_flight.or(self.coordinator.last_completed())).unwrap_or(CheckpointId(0))
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
                    // Written beside the next checkpoints; the run waits for them at its end.
                    let (store, id, doc) =
                        (self.store.clone(), completed.checkpoint, stats.clone());
                    self.stats_writes.retain(|w| !w.is_finished());
                    self.stats_writes.push(self.runtime.spawn(async move {
                        if let Err(error) = store.put_stats(id, &doc).await {
                            tracing::warn!(%error, "checkpoint statistics not stored");
                        }
                    }));
                    self.metrics.checkpoint_completed(&stats);
                    if let Some(tell) = &mut self.on_checkpoint {
                        tell(&stats);
                    }
                    self.report.checkpoints.push(stats);
                    self.gc.after_checkpoint();
                    done |= self.end.completed(completed.checkpoint, completed.kind);
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
        let (stream, max_parallelism) = (self.config.stream, self.config.max_parallelism);
        let manifest = request.manifest(
            stream,
            max_parallelism,
            self.stages.clone(),
            created_at_millis,
        );
        self.runtime
            .block_on(self.store.commit(&manifest, &self.lease))?;
        // Next to the output, before any sink is told to publish: a fallback past this
        // checkpoint replays exactly up to these offsets.
        self.flow
            .record_commit(request.checkpoint, &manifest.sources)?;
        self.end.committed(request.checkpoint, &manifest.sources);
        Ok(created_at_millis)
    }
}
