//! The checkpoint coordinator: triggers checkpoints and savepoints, collects source
//! responses and task reports, has the global manifest written, then completes or
//! aborts, counting consecutive failures.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use stillpoint_wire::{
    AbortReason, CheckpointAbort, CheckpointComplete, CheckpointId, CheckpointKind,
    CheckpointReport, CheckpointSource, Message, MessageKind, NodeId, ReportOutcome,
    SnapshotReport, StreamId, TaskId, TransId,
};

use crate::Time;

/// How the coordinator schedules and judges checkpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// The stream.
    pub stream: StreamId,
    /// The source tasks (they receive `CheckpointSource`).
    pub sources: Vec<TaskId>,
    /// Every task, sources included (each must report).
    pub tasks: Vec<TaskId>,
    /// Time between checkpoint triggers.
    pub interval: Duration,
    /// Least time between the end of one checkpoint and the start of the next.
    pub min_pause: Duration,
    /// Checkpoints in flight at once.
    pub max_concurrent: usize,
    /// A checkpoint not complete this long after its trigger is aborted.
    pub timeout: Duration,
    /// Consecutive failed checkpoints tolerated; one more fails the job.
    pub tolerable_failures: u32,
    /// How often unanswered `CheckpointSource` requests are re-sent.
    pub resend_interval: Duration,
}

impl CoordinatorConfig {
    /// Defaults: a checkpoint every second (as RisingWave), no minimum pause, one at a
    /// time, 60 s timeout, 3 tolerable consecutive failures, re-sends every second.
    #[must_use]
    pub fn new(stream: StreamId, sources: Vec<TaskId>, tasks: Vec<TaskId>) -> Self {
        Self {
            stream,
            sources,
            tasks,
            interval: Duration::from_secs(1),
            min_pause: Duration::ZERO,
            max_concurrent: 1,
            timeout: Duration::from_secs(60),
            tolerable_failures: 3,
            resend_interval: Duration::from_secs(1),
        }
    }

    fn check(&self) -> Result<(), CoordinatorError> {
        if self.sources.is_empty() {
            return Err(CoordinatorError::NoSources);
        }
        if let Some(source) = self.sources.iter().find(|s| !self.tasks.contains(s)) {
            return Err(CoordinatorError::SourceNotATask(*source));
        }
        if self.max_concurrent == 0
            || self.interval.is_zero()
            || self.resend_interval.is_zero()
            || self.timeout.is_zero()
        {
            return Err(CoordinatorError::ZeroSetting);
        }
        Ok(())
    }
}

/// A coordinator configuration or input that cannot be taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoordinatorError {
    /// No source task: nothing could start a checkpoint.
    NoSources,
    /// A source missing from the task list.
    SourceNotATask(TaskId),
    /// `max_concurrent`, `interval`, `timeout` or `resend_interval` is zero.
    ZeroSetting,
    /// A message for another stream.
    WrongStream {
        /// The coordinator's stream.
        expected: StreamId,
        /// The message's stream.
        found: StreamId,
    },
    /// A message kind the coordinator never receives.
    UnexpectedKind(MessageKind),
    /// From a task that is not part of the stream.
    UnknownTask(TaskId),
    /// A savepoint is already requested and not yet triggered.
    SavepointPending,
    /// Failover while a global manifest write is in flight: its outcome decides which
    /// checkpoint to restore from, so wait for it.
    ManifestWriteInFlight(CheckpointId),
}

impl fmt::Display for CoordinatorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoSources => f.write_str("the stream has no source task"),
            Self::SourceNotATask(task) => write!(f, "source {task} is not in the task list"),
            Self::ZeroSetting => f.write_str(
                "max_concurrent, interval, timeout and resend_interval must be positive",
            ),
            Self::WrongStream { expected, found } => {
                write!(f, "message for {found}, coordinator of {expected}")
            }
            Self::UnexpectedKind(kind) => {
                write!(f, "the coordinator does not take {kind} messages")
            }
            Self::UnknownTask(task) => write!(f, "{task} is not a task of this stream"),
            Self::SavepointPending => f.write_str("a savepoint is already requested"),
            Self::ManifestWriteInFlight(id) => {
                write!(f, "the global manifest of {id} is being written")
            }
        }
    }
}

impl std::error::Error for CoordinatorError {}

/// One task's part of a checkpoint, as it reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskReport {
    /// The task.
    pub task: TaskId,
    /// The node that ran it.
    pub node: NodeId,
    /// What it built.
    pub report: SnapshotReport,
}

/// Everything needed to write a checkpoint's global manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestRequest {
    /// The checkpoint.
    pub checkpoint: CheckpointId,
    /// Its transaction.
    pub trans: TransId,
    /// Checkpoint or savepoint.
    pub kind: CheckpointKind,
    /// Every task's report, in task order.
    pub tasks: Vec<TaskReport>,
}

/// A checkpoint that completed, for statistics, retention and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletedCheckpoint {
    /// The checkpoint.
    pub checkpoint: CheckpointId,
    /// Checkpoint or savepoint.
    pub kind: CheckpointKind,
    /// From trigger to the manifest commit.
    pub duration: Duration,
    /// Sum of the tasks' state sizes.
    pub state_bytes: u64,
    /// Sum of the bytes uploaded for it.
    pub uploaded_bytes: u64,
    /// Longest alignment of any task, microseconds.
    pub max_alignment_micros: u64,
    /// Longest synchronous snapshot of any task, microseconds.
    pub max_sync_micros: u64,
    /// Each task's report, in task order: its alignment, synchronous and
    /// asynchronous times and its bytes.
    pub tasks: Vec<(TaskId, SnapshotReport)>,
}

/// Something the coordinator's driver must do. Drain with
/// [`Coordinator::poll_action`] after every call, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoordinatorAction {
    /// Send to a task: `CheckpointSource`, `CheckpointComplete` or `CheckpointAbort`.
    Send(Message),
    /// Write the global manifest (last, after every task's files are in the store),
    /// then call [`Coordinator::handle_manifest_written`] with the outcome. Only its
    /// success completes the checkpoint.
    WriteManifest(ManifestRequest),
    /// The checkpoint is complete (its manifest is committed and completes are sent).
    Completed(CompletedCheckpoint),
    /// The checkpoint was aborted (tasks were told).
    Aborted {
        /// The checkpoint.
        checkpoint: CheckpointId,
        /// Why.
        reason: AbortReason,
    },
    /// More consecutive checkpoints failed than tolerated: fail the job over.
    FailJob {
        /// Consecutive failures so far.
        consecutive_failures: u32,
        /// The last failure.
        last: AbortReason,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Collecting,
    WritingManifest,
}

#[derive(Clone, Debug)]
struct Pending {
    trans: TransId,
    kind: CheckpointKind,
    triggered: Time,
    phase: Phase,
    responded: BTreeSet<TaskId>,
    reports: BTreeMap<TaskId, (NodeId, SnapshotReport)>,
    resend_due: Time,
}

/// How many aborted ids are remembered to answer late reports.
const ABORTED_MEMORY: usize = 256;

/// The checkpoint coordinator of one stream (DESIGN §3), without I/O.
///
/// Calling order: construct with [`Coordinator::new`] (after a restart, with the
/// newest verified checkpoint); call [`Coordinator::handle_timeout`] at
/// [`Coordinator::poll_timeout`]; feed `CheckpointSourceRsp` and `CheckpointReport`
/// with [`Coordinator::handle_message`], the manifest outcome with
/// [`Coordinator::handle_manifest_written`], user savepoints with
/// [`Coordinator::request_savepoint`], and a job failover with
/// [`Coordinator::handle_failover`]. Drain [`Coordinator::poll_action`] after each.
#[derive(Clone, Debug)]
pub struct Coordinator {
    config: CoordinatorConfig,
    next_id: CheckpointId,
    next_trans: u32,
    next_trigger: Time,
    last_finished: Option<Time>,
    pending: BTreeMap<CheckpointId, Pending>,
    last_completed: Option<CheckpointId>,
    /// Offsets of the last completed checkpoint's sources, for re-sent completes.
    last_offsets: BTreeMap<TaskId, SnapshotReport>,
    last_completed_at_millis: u64,
    last_trans: TransId,
    aborted: VecDeque<CheckpointId>,
    consecutive_failures: u32,
    savepoint_requested: bool,
    /// `FailJob` was emitted: nothing new starts until the failover is handled.
    failing: bool,
    actions: VecDeque<CoordinatorAction>,
}

impl Coordinator {
    /// A coordinator whose first checkpoint is triggered one interval after `now`.
    ///
    /// `latest` is the newest verified checkpoint in the store (recovery), and
    /// `next_at_least` a floor for the next id (e.g. one past the highest id any
    /// task manifest in the store carries), so an id is never reused for a new
    /// attempt after a restart.
    pub fn new(
        config: CoordinatorConfig,
        now: Time,
        latest: Option<CheckpointId>,
        next_at_least: CheckpointId,
    ) -> Result<Self, CoordinatorError> {
        config.check()?;
        let after_latest = latest
            .and_then(CheckpointId::next)
            .unwrap_or(CheckpointId(1));
        Ok(Self {
            next_trigger: now + config.interval,
            config,
            next_id: after_latest.max(next_at_least).max(CheckpointId(1)),
            next_trans: 1,
            last_finished: None,
            pending: BTreeMap::new(),
            last_completed: latest,
            last_offsets: BTreeMap::new(),
            last_completed_at_millis: 0,
            last_trans: TransId(0),
            aborted: VecDeque::new(),
            consecutive_failures: 0,
            savepoint_requested: false,
            failing: false,
            actions: VecDeque::new(),
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    /// The newest completed checkpoint.
    #[must_use]
    pub fn last_completed(&self) -> Option<CheckpointId> {
        self.last_completed
    }

    /// Checkpoints in flight.
    pub fn in_flight(&self) -> impl Iterator<Item = CheckpointId> + '_ {
        self.pending.keys().copied()
    }

    /// Whether a requested savepoint has not been triggered yet.
    #[must_use]
    pub fn savepoint_pending(&self) -> bool {
        self.savepoint_requested
    }

    /// Consecutive failed checkpoints.
    #[must_use]
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// The next action, in order.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<CoordinatorAction> {
        self.actions.pop_front()
    }

    /// When [`Coordinator::handle_timeout`] must next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        let trigger = self.may_trigger().then(|| self.trigger_time());
        let pending = self
            .pending
            .values()
            .filter(|p| p.phase == Phase::Collecting)
            .flat_map(|p| {
                let deadline = p.triggered + self.config.timeout;
                let resend =
                    (p.responded.len() < self.config.sources.len()).then_some(p.resend_due);
                [Some(deadline), resend]
            });
        trigger.into_iter().chain(pending.flatten()).min()
    }

    fn may_trigger(&self) -> bool {
        !self.failing && self.pending.len() < self.config.max_concurrent
    }

    fn trigger_time(&self) -> Time {
        if self.savepoint_requested {
            return Time::ZERO;
        }
        let after_pause = self
            .last_finished
            .map_or(Time::ZERO, |t| t + self.config.min_pause);
        self.next_trigger.max(after_pause)
    }

    /// Ask for a savepoint: triggered as soon as fewer than `max_concurrent`
    /// checkpoints are in flight, regardless of the interval.
    pub fn request_savepoint(&mut self, now: Time) -> Result<(), CoordinatorError> {
        if self.savepoint_requested {
            return Err(CoordinatorError::SavepointPending);
        }
        self.savepoint_requested = true;
        self.handle_timeout(now);
        Ok(())
    }

    /// Ask for a periodic checkpoint now instead of at the next interval (as Flink's
    /// trigger-checkpoint call or RisingWave's `FLUSH`): triggered as soon as fewer
    /// than `max_concurrent` are in flight and the minimum pause has passed; the
    /// interval then restarts from it. An engine uses it when a bounded input has
    /// ended, so the final checkpoint does not wait out the interval.
    pub fn request_checkpoint(&mut self, now: Time) {
        self.next_trigger = self.next_trigger.min(now);
        self.handle_timeout(now);
    }

    /// Timers: triggers, timeouts, re-sends.
    pub fn handle_timeout(&mut self, now: Time) {
        let timed_out: Vec<CheckpointId> = self
            .pending
            .iter()
            .filter(|(_, p)| {
                p.phase == Phase::Collecting && p.triggered + self.config.timeout <= now
            })
            .map(|(id, _)| *id)
            .collect();
        for id in timed_out {
            self.abort(now, id, AbortReason::Timeout);
        }
        let resend: Vec<CheckpointId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.phase == Phase::Collecting && p.resend_due <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in resend {
            self.send_source_requests(now, id);
        }
        if self.may_trigger() && self.trigger_time() <= now {
            self.trigger(now);
        }
    }

    fn trigger(&mut self, now: Time) {
        let checkpoint = self.next_id;
        let Some(next) = checkpoint.next() else {
            return; // id space exhausted: never reuse an id
        };
        self.next_id = next;
        let trans = TransId(self.next_trans);
        self.next_trans = self.next_trans.wrapping_add(1).max(1);
        let kind = if std::mem::take(&mut self.savepoint_requested) {
            CheckpointKind::Savepoint
        } else {
            CheckpointKind::Checkpoint
        };
        self.next_trigger = now + self.config.interval;
        tracing::debug!(%checkpoint, %trans, %kind, "trigger");
        self.pending.insert(
            checkpoint,
            Pending {
                trans,
                kind,
                triggered: now,
                phase: Phase::Collecting,
                responded: BTreeSet::new(),
                reports: BTreeMap::new(),
                resend_due: now,
            },
        );
        self.send_source_requests(now, checkpoint);
    }

    fn send_source_requests(&mut self, now: Time, checkpoint: CheckpointId) {
        let Some(pending) = self.pending.get_mut(&checkpoint) else {
            return;
        };
        pending.resend_due = now + self.config.resend_interval;
        let (trans, kind) = (pending.trans, pending.kind);
        let waiting: Vec<TaskId> = self
            .config
            .sources
            .iter()
            .filter(|s| !pending.responded.contains(s))
            .copied()
            .collect();
        for task in waiting {
            self.actions.push_back(CoordinatorAction::Send(
                CheckpointSource {
                    stream: self.config.stream,
                    task,
                    checkpoint,
                    trans,
                    kind,
                }
                .into(),
            ));
        }
    }

    /// A `CheckpointSourceRsp` or `CheckpointReport`.
    pub fn handle_message(&mut self, now: Time, message: &Message) -> Result<(), CoordinatorError> {
        if message.stream() != self.config.stream {
            return Err(CoordinatorError::WrongStream {
                expected: self.config.stream,
                found: message.stream(),
            });
        }
        match message {
            Message::CheckpointSourceRsp(m) => {
                if !self.config.sources.contains(&m.task) {
                    return Err(CoordinatorError::UnknownTask(m.task));
                }
                if let Some(pending) = self
                    .pending
                    .get_mut(&m.checkpoint)
                    .filter(|p| p.trans == m.trans)
                {
                    pending.responded.insert(m.task);
                    self.try_complete(m.checkpoint);
                }
                Ok(())
            }
            Message::CheckpointReport(m) => {
                if !self.config.tasks.contains(&m.task) {
                    return Err(CoordinatorError::UnknownTask(m.task));
                }
                self.on_report(now, m);
                Ok(())
            }
            other => Err(CoordinatorError::UnexpectedKind(other.kind())),
        }
    }

    fn on_report(&mut self, now: Time, m: &CheckpointReport) {
        if let Some(pending) = self.pending.get_mut(&m.checkpoint) {
            if pending.trans != m.trans || pending.phase != Phase::Collecting {
                return; // an older attempt's report, or already complete
            }
            match &m.outcome {
                ReportOutcome::Built(report) => {
                    pending.reports.insert(m.task, (m.node, report.clone()));
                    self.try_complete(m.checkpoint);
                }
                ReportOutcome::Failed { reason } => {
                    tracing::warn!(task = %m.task, checkpoint = %m.checkpoint, %reason, "task failed checkpoint");
                    self.abort(now, m.checkpoint, AbortReason::TaskFailed(m.task));
                }
            }
            return;
        }
        // A report for a checkpoint already decided: the task missed the verdict.
        if self.last_completed == Some(m.checkpoint) {
            let complete = self.complete_message(m.task, m.checkpoint);
            self.actions
                .push_back(CoordinatorAction::Send(complete.into()));
        } else if self.aborted.contains(&m.checkpoint)
            || self.last_completed.is_some_and(|done| m.checkpoint < done)
        {
            self.actions.push_back(CoordinatorAction::Send(
                CheckpointAbort {
                    stream: self.config.stream,
                    task: m.task,
                    checkpoint: m.checkpoint,
                    trans: m.trans,
                    reason: AbortReason::Cancelled,
                }
                .into(),
            ));
        }
    }

    fn try_complete(&mut self, checkpoint: CheckpointId) {
        let Some(pending) = self.pending.get_mut(&checkpoint) else {
            return;
        };
        let all_sources = self
            .config
            .sources
            .iter()
            .all(|s| pending.responded.contains(s));
        let all_reports = self
            .config
            .tasks
            .iter()
            .all(|t| pending.reports.contains_key(t));
        if pending.phase != Phase::Collecting || !all_sources || !all_reports {
            return;
        }
        pending.phase = Phase::WritingManifest;
        let tasks = pending
            .reports
            .iter()
            .map(|(task, (node, report))| TaskReport {
                task: *task,
                node: *node,
                report: report.clone(),
            })
            .collect();
        self.actions
            .push_back(CoordinatorAction::WriteManifest(ManifestRequest {
                checkpoint,
                trans: pending.trans,
                kind: pending.kind,
                tasks,
            }));
    }

    /// The outcome of a [`CoordinatorAction::WriteManifest`]: `Ok` with the commit
    /// time (milliseconds since the Unix epoch), or `Err` with why it failed.
    pub fn handle_manifest_written(
        &mut self,
        now: Time,
        checkpoint: CheckpointId,
        outcome: Result<u64, String>,
    ) {
        let writing = self
            .pending
            .get(&checkpoint)
            .is_some_and(|p| p.phase == Phase::WritingManifest);
        if !writing {
            return;
        }
        let committed_at = match outcome {
            Ok(millis) => millis,
            Err(reason) => {
                tracing::warn!(%checkpoint, %reason, "global manifest not written");
                self.abort(now, checkpoint, AbortReason::StoreFailed);
                return;
            }
        };
        let Some(pending) = self.pending.remove(&checkpoint) else {
            return;
        };
        self.last_completed = Some(checkpoint);
        self.last_completed_at_millis = committed_at;
        self.last_trans = pending.trans;
        self.last_offsets = pending
            .reports
            .iter()
            .map(|(t, (_, r))| (*t, r.clone()))
            .collect();
        self.last_finished = Some(now);
        self.consecutive_failures = 0;
        for task in self.config.tasks.clone() {
            let complete = self.complete_message(task, checkpoint);
            self.actions
                .push_back(CoordinatorAction::Send(complete.into()));
        }
        let tasks: Vec<(TaskId, SnapshotReport)> = pending
            .reports
            .iter()
            .map(|(task, (_, report))| (*task, report.clone()))
            .collect();
        let reports = pending.reports.values().map(|(_, r)| r);
        let completed = CompletedCheckpoint {
            checkpoint,
            kind: pending.kind,
            duration: now.saturating_since(pending.triggered),
            state_bytes: reports.clone().map(|r| r.state_bytes).sum(),
            uploaded_bytes: reports.clone().map(|r| r.uploaded_bytes).sum(),
            max_alignment_micros: reports
                .clone()
                .map(|r| r.alignment_micros)
                .max()
                .unwrap_or(0),
            max_sync_micros: reports.map(|r| r.sync_micros).max().unwrap_or(0),
            tasks,
        };
        tracing::info!(%checkpoint, duration = ?completed.duration, "checkpoint complete");
        self.actions
            .push_back(CoordinatorAction::Completed(completed));
        // Older checkpoints still in flight are subsumed by this one.
        let older: Vec<CheckpointId> = self
            .pending
            .range(..checkpoint)
            .map(|(id, _)| *id)
            .collect();
        for id in older {
            self.pending.remove(&id);
            self.remember_aborted(id);
            self.actions.push_back(CoordinatorAction::Aborted {
                checkpoint: id,
                reason: AbortReason::Cancelled,
            });
        }
    }

    fn complete_message(&self, task: TaskId, checkpoint: CheckpointId) -> CheckpointComplete {
        CheckpointComplete {
            stream: self.config.stream,
            task,
            checkpoint,
            trans: self.last_trans,
            completed_at_millis: self.last_completed_at_millis,
            source_offset: self
                .last_offsets
                .get(&task)
                .and_then(|r| r.source_offset.clone()),
        }
    }

    fn remember_aborted(&mut self, checkpoint: CheckpointId) {
        if self.aborted.len() == ABORTED_MEMORY {
            self.aborted.pop_front();
        }
        self.aborted.push_back(checkpoint);
    }

    fn abort(&mut self, now: Time, checkpoint: CheckpointId, reason: AbortReason) {
        let Some(pending) = self.pending.remove(&checkpoint) else {
            return;
        };
        tracing::warn!(%checkpoint, ?reason, "checkpoint aborted");
        self.remember_aborted(checkpoint);
        self.last_finished = Some(now);
        for task in self.config.tasks.clone() {
            self.actions.push_back(CoordinatorAction::Send(
                CheckpointAbort {
                    stream: self.config.stream,
                    task,
                    checkpoint,
                    trans: pending.trans,
                    reason,
                }
                .into(),
            ));
        }
        self.actions
            .push_back(CoordinatorAction::Aborted { checkpoint, reason });
        if reason != AbortReason::Cancelled {
            self.consecutive_failures += 1;
            if self.consecutive_failures > self.config.tolerable_failures && !self.failing {
                self.failing = true;
                self.actions.push_back(CoordinatorAction::FailJob {
                    consecutive_failures: self.consecutive_failures,
                    last: reason,
                });
            }
        }
    }

    /// The job failed over: every task is being restored from the last completed
    /// checkpoint. Checkpoints in flight are dropped, and so are messages to tasks not
    /// yet drained (the tasks they address are restarting); the failure count resets,
    /// and the next checkpoint is triggered one interval from now, with a fresh id.
    pub fn handle_failover(&mut self, now: Time) -> Result<(), CoordinatorError> {
        if let Some((id, _)) = self
            .pending
            .iter()
            .find(|(_, p)| p.phase == Phase::WritingManifest)
        {
            return Err(CoordinatorError::ManifestWriteInFlight(*id));
        }
        self.actions
            .retain(|a| !matches!(a, CoordinatorAction::Send(_)));
        self.failing = false;
        for (checkpoint, _) in std::mem::take(&mut self.pending) {
            self.remember_aborted(checkpoint);
            self.actions.push_back(CoordinatorAction::Aborted {
                checkpoint,
                reason: AbortReason::Cancelled,
            });
        }
        self.consecutive_failures = 0;
        self.next_trigger = now + self.config.interval;
        self.last_finished = Some(now);
        Ok(())
    }
}
