//! The per-task checkpoint machine: barrier queueing at sources, alignment at
//! multi-input tasks, snapshot and fan-out, ready fan-in, build, report, complete,
//! abort, the barrier monitor, and the task's lifecycle.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use stillpoint_wire::{
    AbortReason, Barrier, BarrierAck, CheckpointAbort, CheckpointComplete, CheckpointId,
    CheckpointKind, CheckpointReady, CheckpointReadyAck, CheckpointReport, CheckpointSource,
    CheckpointSourceRsp, Message, MessageKind, NodeId, ReportOutcome, RetrieveAnswer,
    RetrieveBarrier, RetrieveBarrierRsp, SnapshotReport, SourceOffset, StreamId, TaskId, TransId,
};

use crate::Time;

/// Where a task sits in the dataflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskLevel {
    /// Reads a replayable input; no upstreams; receives `CheckpointSource`.
    Source,
    /// Has upstreams and downstreams; aligns barriers and forwards them.
    Aggregate,
    /// Has upstreams, no downstreams; pre-commits its output at the barrier.
    Sink,
}

/// What the task is doing, as DESIGN §3 names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaskStatus {
    /// Running, no checkpoint in progress.
    Ready,
    /// Running, with a checkpoint queued, aligning or building.
    Checkpointing,
    /// Not processing input and not starting checkpoints (e.g. during a rescale).
    Halted,
    /// Not processing input (a user paused it); checkpoints in progress continue.
    Paused,
    /// Being removed: everything in progress was dropped; only `stop` is accepted.
    Dropping,
    /// Stopped for good; every input is ignored.
    Stopped,
}

/// A task's place in the dataflow and its timers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskConfig {
    /// The stream.
    pub stream: StreamId,
    /// This task.
    pub task: TaskId,
    /// The node hosting it.
    pub node: NodeId,
    /// Source, aggregate or sink.
    pub level: TaskLevel,
    /// Tasks whose output this task reads (none for a source).
    pub upstreams: Vec<TaskId>,
    /// Tasks reading this task's output (none for a sink).
    pub downstreams: Vec<TaskId>,
    /// How long a barrier may be missing during alignment before the barrier monitor
    /// asks its upstream with `RetrieveBarrier` (and again every such period).
    pub barrier_wait: Duration,
    /// How often unacknowledged ready messages and unanswered reports are re-sent.
    pub resend_interval: Duration,
}

impl TaskConfig {
    /// A task with no edges yet, the monitor at 10 s and re-sends every second.
    #[must_use]
    pub fn new(stream: StreamId, task: TaskId, node: NodeId, level: TaskLevel) -> Self {
        Self {
            stream,
            task,
            node,
            level,
            upstreams: Vec::new(),
            downstreams: Vec::new(),
            barrier_wait: Duration::from_secs(10),
            resend_interval: Duration::from_secs(1),
        }
    }

    /// With these upstreams.
    #[must_use]
    pub fn upstreams(mut self, upstreams: impl IntoIterator<Item = TaskId>) -> Self {
        self.upstreams = upstreams.into_iter().collect();
        self
    }

    /// With these downstreams.
    #[must_use]
    pub fn downstreams(mut self, downstreams: impl IntoIterator<Item = TaskId>) -> Self {
        self.downstreams = downstreams.into_iter().collect();
        self
    }

    fn check(&self) -> Result<(), ConfigError> {
        let (needs_up, needs_down) = match self.level {
            TaskLevel::Source => (false, true),
            TaskLevel::Aggregate => (true, true),
            TaskLevel::Sink => (true, false),
        };
        if needs_up == self.upstreams.is_empty() {
            return Err(ConfigError::Upstreams {
                level: self.level,
                count: self.upstreams.len(),
            });
        }
        if !needs_down && !self.downstreams.is_empty() {
            return Err(ConfigError::Downstreams {
                level: self.level,
                count: self.downstreams.len(),
            });
        }
        for list in [&self.upstreams, &self.downstreams] {
            let mut seen = BTreeSet::new();
            if let Some(dup) = list.iter().find(|t| !seen.insert(**t)) {
                return Err(ConfigError::DuplicatePeer(*dup));
            }
            if list.contains(&self.task) {
                return Err(ConfigError::SelfEdge(self.task));
            }
        }
        if self.barrier_wait.is_zero() || self.resend_interval.is_zero() {
            return Err(ConfigError::ZeroInterval);
        }
        Ok(())
    }
}

/// A task configuration that describes no valid task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigError {
    /// A source with upstreams, or an aggregate or sink without.
    Upstreams {
        /// The level.
        level: TaskLevel,
        /// How many were given.
        count: usize,
    },
    /// A sink with downstreams. (A source or aggregate without downstreams is allowed:
    /// it builds without waiting for anyone.)
    Downstreams {
        /// The level.
        level: TaskLevel,
        /// How many were given.
        count: usize,
    },
    /// A peer listed twice.
    DuplicatePeer(TaskId),
    /// The task listed as its own peer.
    SelfEdge(TaskId),
    /// A zero monitor or re-send interval (it would spin).
    ZeroInterval,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Upstreams { level, count } => {
                write!(f, "a {level:?} task cannot have {count} upstreams")
            }
            Self::Downstreams { level, count } => {
                write!(f, "a {level:?} task cannot have {count} downstreams")
            }
            Self::DuplicatePeer(task) => write!(f, "{task} is listed twice"),
            Self::SelfEdge(task) => write!(f, "{task} is listed as its own peer"),
            Self::ZeroInterval => f.write_str("barrier_wait and resend_interval must be positive"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A message a task cannot take. The machine's state is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskError {
    /// For another stream.
    WrongStream {
        /// This task's stream.
        expected: StreamId,
        /// The message's stream.
        found: StreamId,
    },
    /// Addressed to another task.
    WrongTask {
        /// The message kind.
        kind: MessageKind,
        /// The addressee.
        to: TaskId,
        /// This task.
        this: TaskId,
    },
    /// From a task that is not a peer in the needed direction.
    UnknownPeer {
        /// The message kind.
        kind: MessageKind,
        /// The sender.
        from: TaskId,
        /// `"upstream"` or `"downstream"`.
        direction: &'static str,
    },
    /// A kind this machine never receives (data, reports, ...).
    UnexpectedKind(MessageKind),
    /// `CheckpointSource` at a task that is not a source.
    NotASource(TaskId),
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WrongStream { expected, found } => {
                write!(f, "message for {found}, this task is in {expected}")
            }
            Self::WrongTask { kind, to, this } => {
                write!(f, "{kind} addressed to {to}, this is {this}")
            }
            Self::UnknownPeer {
                kind,
                from,
                direction,
            } => {
                write!(
                    f,
                    "{kind} from {from}, which is not an {direction} of this task"
                )
            }
            Self::UnexpectedKind(kind) => write!(f, "a task machine does not take {kind} messages"),
            Self::NotASource(task) => write!(f, "{task} is not a source task"),
        }
    }
}

impl std::error::Error for TaskError {}

/// Something the driver must do. Drain with [`TaskMachine::poll_action`] after every
/// `handle_*` call and carry the actions out **in order** before feeding the task more
/// input: the order is what keeps the snapshot consistent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskAction {
    /// Source only: put a barrier marker in the input queue behind every record
    /// already accepted; when processing reaches it, call
    /// [`TaskMachine::handle_source_barrier`].
    QueueBarrier {
        /// The checkpoint.
        checkpoint: CheckpointId,
    },
    /// Emit whatever the operator buffers into its output now, so it lands before the
    /// barrier.
    FlushOutput {
        /// The checkpoint about to be snapshotted.
        checkpoint: CheckpointId,
    },
    /// Take the synchronous part of the local snapshot now (an O(1) freeze of the
    /// state; a source includes its offset; a sink pre-commits its pending output as
    /// transaction `checkpoint`). Then export it asynchronously and call
    /// [`TaskMachine::handle_snapshot_exported`] or
    /// [`TaskMachine::handle_snapshot_failed`].
    Snapshot {
        /// The checkpoint.
        checkpoint: CheckpointId,
        /// Its transaction.
        trans: TransId,
        /// Checkpoint or savepoint.
        kind: CheckpointKind,
    },
    /// Stop taking records from this upstream (alignment).
    BlockInput(TaskId),
    /// Take records from this upstream again.
    OpenInput(TaskId),
    /// Send this message. A [`Barrier`] goes on the data channel to its downstream,
    /// behind every record sent before it; everything else is control traffic.
    Send(Message),
    /// `checkpoint` is globally complete: a sink commits every pre-committed
    /// transaction up to and including it; every task records it (with the source
    /// offset, for a source) as the one to restore from, and may drop older local
    /// snapshots.
    Commit {
        /// The completed checkpoint.
        checkpoint: CheckpointId,
        /// The offset recorded for this source.
        source_offset: Option<SourceOffset>,
    },
    /// Drop the local snapshot of `checkpoint` (it was aborted or failed). A sink keeps
    /// its pre-committed output: those records precede every later barrier, so the
    /// next `Commit` covers them.
    Discard {
        /// The checkpoint.
        checkpoint: CheckpointId,
    },
}

/// The checkpoint a task was restored from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoredCheckpoint {
    /// Its id.
    pub checkpoint: CheckpointId,
    /// Its transaction.
    pub trans: TransId,
    /// Checkpoint or savepoint.
    pub kind: CheckpointKind,
    /// For a source, the offset it resumes from.
    pub source_offset: Option<SourceOffset>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lifecycle {
    Running,
    Paused,
    Halted,
    Dropping,
    Stopped,
}

/// Barriers are arriving for one checkpoint; inputs whose barrier is in are blocked.
#[derive(Clone, Debug)]
struct Alignment {
    checkpoint: CheckpointId,
    trans: TransId,
    kind: CheckpointKind,
    started: Time,
    arrived: BTreeSet<TaskId>,
    monitor_due: Time,
    answers: BTreeMap<TaskId, RetrieveAnswer>,
}

/// A checkpoint whose local snapshot is taken: exporting, waiting for downstreams to
/// be ready, or built and waiting for the coordinator's verdict.
#[derive(Clone, Debug)]
struct Build {
    trans: TransId,
    kind: CheckpointKind,
    alignment_micros: u64,
    /// Per downstream: when the barrier was sent, and whether it was acknowledged.
    barrier_sent: BTreeMap<TaskId, (Time, bool)>,
    ready_from: BTreeSet<TaskId>,
    exported: Option<SnapshotReport>,
    built: bool,
    /// Upstreams that acknowledged our ready message.
    ready_acked: BTreeSet<TaskId>,
    resend_due: Time,
}

/// The checkpoint protocol of one task (DESIGN §3), without I/O.
///
/// Calling order: construct with [`TaskMachine::new`]; feed every protocol message
/// with [`TaskMachine::handle_message`] (barriers in order with the data of their
/// channel), the driver's own events with the other `handle_*` methods, and call
/// [`TaskMachine::handle_timeout`] when [`TaskMachine::poll_timeout`]'s time has
/// come. After each call, drain [`TaskMachine::poll_action`] and carry the actions
/// out in order. The same inputs always give the same actions.
#[derive(Clone, Debug)]
pub struct TaskMachine {
    config: TaskConfig,
    lifecycle: Lifecycle,
    /// Source: barriers queued behind accepted input, oldest first.
    queued: VecDeque<(CheckpointId, TransId, CheckpointKind)>,
    alignment: Option<Alignment>,
    blocked: BTreeSet<TaskId>,
    builds: BTreeMap<CheckpointId, Build>,
    /// Newest checkpoint this task snapshotted (ids strictly increase).
    last_snapshot: Option<CheckpointId>,
    last_completed: Option<(CheckpointId, TransId, CheckpointKind)>,
    failed: Option<CheckpointId>,
    actions: VecDeque<TaskAction>,
}

impl TaskMachine {
    /// A task starting fresh (`restored = None`) or restored from a completed
    /// checkpoint. A restored task first emits `Commit` for that checkpoint, so a sink
    /// commits transactions that were pre-committed but not yet committed when the
    /// job failed (commits are idempotent).
    pub fn new(
        config: TaskConfig,
        restored: Option<RestoredCheckpoint>,
    ) -> Result<Self, ConfigError> {
        config.check()?;
        let mut machine = Self {
            config,
            lifecycle: Lifecycle::Running,
            queued: VecDeque::new(),
            alignment: None,
            blocked: BTreeSet::new(),
            builds: BTreeMap::new(),
            last_snapshot: None,
            last_completed: None,
            failed: None,
            actions: VecDeque::new(),
        };
        if let Some(restored) = restored {
            machine.last_snapshot = Some(restored.checkpoint);
            machine.last_completed = Some((restored.checkpoint, restored.trans, restored.kind));
            machine.actions.push_back(TaskAction::Commit {
                checkpoint: restored.checkpoint,
                source_offset: restored.source_offset,
            });
        }
        Ok(machine)
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &TaskConfig {
        &self.config
    }

    /// The status of DESIGN §3.
    #[must_use]
    pub fn status(&self) -> TaskStatus {
        match self.lifecycle {
            Lifecycle::Stopped => TaskStatus::Stopped,
            Lifecycle::Dropping => TaskStatus::Dropping,
            Lifecycle::Halted => TaskStatus::Halted,
            Lifecycle::Paused => TaskStatus::Paused,
            Lifecycle::Running if self.checkpointing() => TaskStatus::Checkpointing,
            Lifecycle::Running => TaskStatus::Ready,
        }
    }

    fn checkpointing(&self) -> bool {
        !self.queued.is_empty() || self.alignment.is_some() || !self.builds.is_empty()
    }

    /// The newest globally complete checkpoint this task knows of.
    #[must_use]
    pub fn last_completed(&self) -> Option<CheckpointId> {
        self.last_completed.map(|(id, _, _)| id)
    }

    /// The last checkpoint whose snapshot or export failed here.
    #[must_use]
    pub fn failed_checkpoint(&self) -> Option<CheckpointId> {
        self.failed
    }

    /// The checkpoint being aligned, with the upstreams whose barrier is in.
    #[must_use]
    pub fn aligning(&self) -> Option<(CheckpointId, &BTreeSet<TaskId>)> {
        self.alignment.as_ref().map(|a| (a.checkpoint, &a.arrived))
    }

    /// While aligning: how many upstreams' barriers have not arrived (0 otherwise).
    #[must_use]
    pub fn missing_barriers(&self) -> usize {
        self.alignment.as_ref().map_or(0, |a| {
            (self.config.upstreams.iter())
                .filter(|u| !a.arrived.contains(u))
                .count()
        })
    }

    /// The last answer each upstream gave the barrier monitor, for diagnostics.
    #[must_use]
    pub fn retrieve_answers(&self) -> Option<&BTreeMap<TaskId, RetrieveAnswer>> {
        self.alignment.as_ref().map(|a| &a.answers)
    }

    /// Upstreams whose input is blocked.
    #[must_use]
    pub fn blocked_inputs(&self) -> &BTreeSet<TaskId> {
        &self.blocked
    }

    /// Checkpoints snapshotted here and not yet completed or aborted.
    pub fn building(&self) -> impl Iterator<Item = CheckpointId> + '_ {
        self.builds.keys().copied()
    }

    /// The next action, in order.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<TaskAction> {
        self.actions.pop_front()
    }

    /// When [`TaskMachine::handle_timeout`] must next be called, if ever.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        if matches!(self.lifecycle, Lifecycle::Stopped | Lifecycle::Dropping) {
            return None;
        }
        let monitor = self.alignment.as_ref().map(|a| a.monitor_due);
        let resend = self
            .builds
            .values()
            .filter(|b| b.built)
            .map(|b| b.resend_due)
            .min();
        monitor.into_iter().chain(resend).min()
    }

    fn accepts_protocol(&self) -> bool {
        !matches!(self.lifecycle, Lifecycle::Stopped | Lifecycle::Dropping)
    }

    fn send(&mut self, message: impl Into<Message>) {
        self.actions.push_back(TaskAction::Send(message.into()));
    }

    fn open(&mut self, upstream: TaskId) {
        if self.blocked.remove(&upstream) {
            self.actions.push_back(TaskAction::OpenInput(upstream));
        }
    }

    fn open_all(&mut self) {
        for upstream in std::mem::take(&mut self.blocked) {
            self.actions.push_back(TaskAction::OpenInput(upstream));
        }
    }

    fn is_completed(&self, id: CheckpointId) -> bool {
        self.last_completed().is_some_and(|done| id <= done)
    }

    /// Whether `id` is older than or equal to something this task already snapshotted.
    fn is_stale(&self, id: CheckpointId) -> bool {
        self.last_snapshot.is_some_and(|snap| id <= snap)
    }

    fn report(&mut self, checkpoint: CheckpointId, trans: TransId, outcome: ReportOutcome) {
        let message = CheckpointReport {
            stream: self.config.stream,
            task: self.config.task,
            node: self.config.node,
            checkpoint,
            trans,
            outcome,
        };
        self.send(message);
    }

    fn fail(&mut self, checkpoint: CheckpointId, trans: TransId, reason: impl Into<String>) {
        let reason = reason.into();
        tracing::warn!(task = %self.config.task, %checkpoint, %reason, "checkpoint failed");
        self.failed = Some(checkpoint);
        self.report(checkpoint, trans, ReportOutcome::Failed { reason });
    }

    // -----------------------------------------------------------------------------
    // Inputs

    /// Any protocol message addressed to this task. `Barrier`s must be passed in order
    /// with the records of their channel: after every record sent before them, before
    /// any record sent after.
    pub fn handle_message(&mut self, now: Time, message: &Message) -> Result<(), TaskError> {
        if message.stream() != self.config.stream {
            return Err(TaskError::WrongStream {
                expected: self.config.stream,
                found: message.stream(),
            });
        }
        let this = self.config.task;
        let kind = message.kind();
        let wrong = |to: TaskId| TaskError::WrongTask { kind, to, this };
        match message {
            Message::CheckpointSource(m) if m.task != this => Err(wrong(m.task)),
            Message::CheckpointSource(m) => self.on_checkpoint_source(m),
            Message::Barrier(m) if m.downstream != this => Err(wrong(m.downstream)),
            Message::Barrier(m) => {
                self.check_upstream(kind, m.upstream)?;
                self.on_barrier(now, m);
                Ok(())
            }
            Message::BarrierAck(m) if m.upstream != this => Err(wrong(m.upstream)),
            Message::BarrierAck(m) => {
                self.check_downstream(kind, m.downstream)?;
                if let Some(sent) = self
                    .builds
                    .get_mut(&m.checkpoint)
                    .and_then(|b| b.barrier_sent.get_mut(&m.downstream))
                {
                    sent.1 = true;
                }
                Ok(())
            }
            Message::CheckpointReady(m) if m.upstream != this => Err(wrong(m.upstream)),
            Message::CheckpointReady(m) => {
                self.check_downstream(kind, m.downstream)?;
                self.on_ready(now, m);
                Ok(())
            }
            Message::CheckpointReadyAck(m) if m.downstream != this => Err(wrong(m.downstream)),
            Message::CheckpointReadyAck(m) => {
                self.check_upstream(kind, m.upstream)?;
                if let Some(build) = self.builds.get_mut(&m.checkpoint) {
                    build.ready_acked.insert(m.upstream);
                }
                Ok(())
            }
            Message::RetrieveBarrier(m) if m.upstream != this => Err(wrong(m.upstream)),
            Message::RetrieveBarrier(m) => {
                self.check_downstream(kind, m.downstream)?;
                self.on_retrieve(m);
                Ok(())
            }
            Message::RetrieveBarrierRsp(m) if m.downstream != this => Err(wrong(m.downstream)),
            Message::RetrieveBarrierRsp(m) => {
                self.check_upstream(kind, m.upstream)?;
                if let Some(alignment) = self
                    .alignment
                    .as_mut()
                    .filter(|a| a.checkpoint == m.checkpoint)
                {
                    alignment.answers.insert(m.upstream, m.answer);
                }
                Ok(())
            }
            Message::CheckpointComplete(m) if m.task != this => Err(wrong(m.task)),
            Message::CheckpointComplete(m) => {
                self.on_complete(m);
                Ok(())
            }
            Message::CheckpointAbort(m) if m.task != this => Err(wrong(m.task)),
            Message::CheckpointAbort(m) => {
                self.on_abort(m);
                Ok(())
            }
            Message::CheckpointSourceRsp(_)
            | Message::CheckpointReport(_)
            | Message::Data(_)
            | Message::EndOfInput(_)
            | Message::Watermark(_) => Err(TaskError::UnexpectedKind(kind)),
        }
    }

    fn check_upstream(&self, kind: MessageKind, from: TaskId) -> Result<(), TaskError> {
        if self.config.upstreams.contains(&from) {
            Ok(())
        } else {
            Err(TaskError::UnknownPeer {
                kind,
                from,
                direction: "upstream",
            })
        }
    }

    fn check_downstream(&self, kind: MessageKind, from: TaskId) -> Result<(), TaskError> {
        if self.config.downstreams.contains(&from) {
            Ok(())
        } else {
            Err(TaskError::UnknownPeer {
                kind,
                from,
                direction: "downstream",
            })
        }
    }

    fn on_checkpoint_source(&mut self, m: &CheckpointSource) -> Result<(), TaskError> {
        if self.config.level != TaskLevel::Source {
            return Err(TaskError::NotASource(self.config.task));
        }
        if !self.accepts_protocol() || self.is_completed(m.checkpoint) {
            return Ok(());
        }
        if self.lifecycle == Lifecycle::Halted {
            self.fail(m.checkpoint, m.trans, "task is halted");
            return Ok(());
        }
        if self.failed == Some(m.checkpoint) {
            // The coordinator re-sent the request: our failure report was lost.
            self.fail(m.checkpoint, m.trans, "snapshot failed");
            return Ok(());
        }
        if let Some(build) = self.builds.get(&m.checkpoint) {
            if build.built {
                // Already done: our response was lost; say it again.
                self.resend_build(m.checkpoint);
            }
            return Ok(());
        }
        let newest_queued = self.queued.back().map(|q| q.0);
        if self.is_stale(m.checkpoint) || newest_queued.is_some_and(|q| m.checkpoint <= q) {
            return Ok(()); // duplicate or older than what is already under way
        }
        self.queued.push_back((m.checkpoint, m.trans, m.kind));
        self.actions.push_back(TaskAction::QueueBarrier {
            checkpoint: m.checkpoint,
        });
        Ok(())
    }

    /// Source only: processing reached the barrier marker queued by
    /// [`TaskAction::QueueBarrier`]. A marker whose checkpoint was aborted meanwhile is
    /// ignored (nothing is snapshotted).
    pub fn handle_source_barrier(&mut self, now: Time, checkpoint: CheckpointId) {
        let Some(position) = self.queued.iter().position(|q| q.0 == checkpoint) else {
            return;
        };
        // Markers are reached in queue order; anything queued before this one was
        // dropped from the input by the driver and can no longer be snapshotted.
        let mut taken = self.queued.drain(..=position).collect::<Vec<_>>();
        let Some((_, trans, kind)) = taken.pop() else {
            return;
        };
        if !self.accepts_protocol() || self.lifecycle == Lifecycle::Halted {
            return;
        }
        self.snapshot_and_forward(now, checkpoint, trans, kind, 0);
    }

    fn on_barrier(&mut self, now: Time, m: &Barrier) {
        let (id, from) = (m.checkpoint, m.upstream);
        if !self.accepts_protocol() {
            return;
        }
        if let Some(done) = self.last_completed() {
            if id == done {
                // The upstream never saw our ready message for a checkpoint that has
                // completed since: say it again, and make sure its input is open.
                self.send_ready(id, m.trans, from);
                self.open(from);
                return;
            }
            if id < done {
                return; // expired
            }
        }
        if self.failed == Some(id) || self.is_stale(id) {
            return; // failed here, or already snapshotted (all barriers were in)
        }
        if self.lifecycle == Lifecycle::Halted {
            self.fail(id, m.trans, "task is halted");
            return;
        }
        match &self.alignment {
            Some(a) if a.checkpoint == id && a.arrived.contains(&from) => return, // duplicate
            Some(a) if a.checkpoint > id => return, // older than the one being aligned
            Some(a) if a.checkpoint < id => {
                // `from` sent a newer barrier without the one being aligned, so that
                // checkpoint was aborted upstream and can never complete: drop it.
                let old = a.checkpoint;
                tracing::debug!(task = %self.config.task, %old, new = %id, "alignment superseded");
                self.alignment = None;
                self.open_all();
            }
            _ => {}
        }
        let wait = self.config.barrier_wait;
        let alignment = self.alignment.get_or_insert_with(|| Alignment {
            checkpoint: id,
            trans: m.trans,
            kind: m.kind,
            started: now,
            arrived: BTreeSet::new(),
            monitor_due: now + wait,
            answers: BTreeMap::new(),
        });
        alignment.arrived.insert(from);
        let aligned = alignment.arrived.len() == self.config.upstreams.len();
        let (trans, kind, started) = (alignment.trans, alignment.kind, alignment.started);
        self.send(BarrierAck {
            stream: self.config.stream,
            upstream: from,
            downstream: self.config.task,
            checkpoint: id,
        });
        if aligned {
            self.alignment = None;
            self.snapshot_and_forward(now, id, trans, kind, now.micros_since(started));
        } else if self.blocked.insert(from) {
            self.actions.push_back(TaskAction::BlockInput(from));
        }
    }

    /// Aligned (or a source reached its barrier): flush, snapshot, forward the barrier,
    /// reopen inputs. The blocking window ends here; the build continues without it.
    fn snapshot_and_forward(
        &mut self,
        now: Time,
        checkpoint: CheckpointId,
        trans: TransId,
        kind: CheckpointKind,
        alignment_micros: u64,
    ) {
        if self.config.level != TaskLevel::Sink {
            self.actions
                .push_back(TaskAction::FlushOutput { checkpoint });
        }
        self.actions.push_back(TaskAction::Snapshot {
            checkpoint,
            trans,
            kind,
        });
        self.last_snapshot = Some(checkpoint);
        let mut barrier_sent = BTreeMap::new();
        for downstream in self.config.downstreams.clone() {
            self.send(Barrier {
                stream: self.config.stream,
                upstream: self.config.task,
                downstream,
                checkpoint,
                trans,
                kind,
            });
            barrier_sent.insert(downstream, (now, false));
        }
        self.open_all();
        self.builds.insert(
            checkpoint,
            Build {
                trans,
                kind,
                alignment_micros,
                barrier_sent,
                ready_from: BTreeSet::new(),
                exported: None,
                built: false,
                ready_acked: BTreeSet::new(),
                resend_due: now,
            },
        );
    }

    fn on_ready(&mut self, now: Time, m: &CheckpointReady) {
        if !self.accepts_protocol() {
            return;
        }
        let known = self.is_completed(m.checkpoint) || self.builds.contains_key(&m.checkpoint);
        if !known {
            return; // not checkpointing this id (aborted, failed or stale): discard
        }
        self.send(CheckpointReadyAck {
            stream: self.config.stream,
            upstream: self.config.task,
            downstream: m.downstream,
            checkpoint: m.checkpoint,
        });
        if let Some(build) = self.builds.get_mut(&m.checkpoint) {
            build.ready_from.insert(m.downstream);
            self.try_build(now, m.checkpoint);
        }
    }

    /// The asynchronous export of `checkpoint`'s snapshot finished. The driver fills in
    /// the manifest reference, sizes, snapshot timings and (sources) the offset; the
    /// machine adds the alignment time.
    pub fn handle_snapshot_exported(
        &mut self,
        now: Time,
        checkpoint: CheckpointId,
        report: SnapshotReport,
    ) {
        match self.builds.get_mut(&checkpoint) {
            Some(build) if build.exported.is_none() && self.lifecycle != Lifecycle::Stopped => {
                build.exported = Some(SnapshotReport {
                    alignment_micros: build.alignment_micros,
                    ..report
                });
                self.try_build(now, checkpoint);
            }
            Some(_) => {}
            // Aborted or completed past while exporting: nobody needs it.
            None => self.actions.push_back(TaskAction::Discard { checkpoint }),
        }
    }

    /// The snapshot or export of `checkpoint` failed: drop it, report the failure,
    /// remember the id as failed.
    pub fn handle_snapshot_failed(&mut self, _now: Time, checkpoint: CheckpointId, reason: &str) {
        if let Some(build) = self.builds.remove(&checkpoint) {
            self.actions.push_back(TaskAction::Discard { checkpoint });
            self.fail(checkpoint, build.trans, reason);
        }
    }

    fn try_build(&mut self, now: Time, checkpoint: CheckpointId) {
        let downstreams = self.config.downstreams.len();
        let Some(build) = self.builds.get_mut(&checkpoint) else {
            return;
        };
        if build.built || build.exported.is_none() || build.ready_from.len() < downstreams {
            return;
        }
        build.built = true;
        build.resend_due = now + self.config.resend_interval;
        tracing::debug!(task = %self.config.task, %checkpoint, "built");
        self.resend_build(checkpoint);
    }

    /// Sends everything a built checkpoint owes: the source response, the report, and
    /// ready messages to upstreams that have not acknowledged them.
    fn resend_build(&mut self, checkpoint: CheckpointId) {
        let Some(build) = self.builds.get(&checkpoint) else {
            return;
        };
        let (trans, exported) = (build.trans, build.exported.clone());
        let unacked: Vec<TaskId> = self
            .config
            .upstreams
            .iter()
            .filter(|u| !build.ready_acked.contains(u))
            .copied()
            .collect();
        if self.config.level == TaskLevel::Source {
            self.send(CheckpointSourceRsp {
                stream: self.config.stream,
                task: self.config.task,
                node: self.config.node,
                checkpoint,
                trans,
            });
        }
        if let Some(report) = exported {
            self.report(checkpoint, trans, ReportOutcome::Built(report));
        }
        for upstream in unacked {
            self.send_ready(checkpoint, trans, upstream);
        }
    }

    fn send_ready(&mut self, checkpoint: CheckpointId, trans: TransId, upstream: TaskId) {
        self.send(CheckpointReady {
            stream: self.config.stream,
            upstream,
            downstream: self.config.task,
            downstream_node: self.config.node,
            checkpoint,
            trans,
        });
    }

    fn on_retrieve(&mut self, m: &RetrieveBarrier) {
        if !self.accepts_protocol() {
            return;
        }
        let sent = self
            .builds
            .get(&m.checkpoint)
            .filter(|b| b.barrier_sent.contains_key(&m.downstream))
            .map(|b| (b.trans, b.kind))
            .or_else(|| {
                self.last_completed
                    .filter(|(id, _, _)| *id == m.checkpoint)
                    .map(|(_, trans, kind)| (trans, kind))
            });
        let answer = match sent {
            Some((trans, kind)) => RetrieveAnswer::AlreadySent { trans, kind },
            None => RetrieveAnswer::NotYetSent,
        };
        self.send(RetrieveBarrierRsp {
            stream: self.config.stream,
            upstream: self.config.task,
            downstream: m.downstream,
            checkpoint: m.checkpoint,
            answer,
        });
    }

    fn on_complete(&mut self, m: &CheckpointComplete) {
        if !self.accepts_protocol() || self.is_completed(m.checkpoint) {
            return;
        }
        let trans_kind = self
            .builds
            .get(&m.checkpoint)
            .map_or((m.trans, CheckpointKind::Checkpoint), |b| (b.trans, b.kind));
        self.last_completed = Some((m.checkpoint, trans_kind.0, trans_kind.1));
        if self.last_snapshot < Some(m.checkpoint) {
            self.last_snapshot = Some(m.checkpoint);
        }
        // Everything up to the completed id is settled: the completed build is done,
        // older ones are subsumed (their sink output is covered by this commit).
        let settled: Vec<CheckpointId> = self
            .builds
            .range(..=m.checkpoint)
            .map(|(id, _)| *id)
            .collect();
        for id in settled {
            self.builds.remove(&id);
            if id != m.checkpoint {
                self.actions
                    .push_back(TaskAction::Discard { checkpoint: id });
            }
        }
        if self
            .alignment
            .as_ref()
            .is_some_and(|a| a.checkpoint <= m.checkpoint)
        {
            self.alignment = None;
            self.open_all();
        }
        self.queued.retain(|q| q.0 > m.checkpoint);
        self.actions.push_back(TaskAction::Commit {
            checkpoint: m.checkpoint,
            source_offset: m.source_offset.clone(),
        });
    }

    fn on_abort(&mut self, m: &CheckpointAbort) {
        if !self.accepts_protocol() || self.is_completed(m.checkpoint) {
            return;
        }
        if self.builds.remove(&m.checkpoint).is_some() {
            self.actions.push_back(TaskAction::Discard {
                checkpoint: m.checkpoint,
            });
        }
        if self
            .alignment
            .as_ref()
            .is_some_and(|a| a.checkpoint == m.checkpoint)
        {
            self.alignment = None;
            self.open_all();
        }
        self.queued.retain(|q| q.0 != m.checkpoint);
        if m.reason != AbortReason::Cancelled {
            tracing::debug!(task = %self.config.task, checkpoint = %m.checkpoint, reason = ?m.reason, "aborted");
        }
    }

    /// Timers: the barrier monitor and re-sends of ready messages and reports.
    pub fn handle_timeout(&mut self, now: Time) {
        if !self.accepts_protocol() {
            return;
        }
        let wait = self.config.barrier_wait;
        if let Some(alignment) = self.alignment.as_mut().filter(|a| a.monitor_due <= now) {
            alignment.monitor_due = now + wait;
            let checkpoint = alignment.checkpoint;
            let missing: Vec<TaskId> = self
                .config
                .upstreams
                .iter()
                .filter(|u| !alignment.arrived.contains(u))
                .copied()
                .collect();
            // What a stuck checkpoint looks like from here: who is missing, and what
            // they answered the last time they were asked.
            tracing::warn!(
                task = %self.config.task,
                %checkpoint,
                aligning_for = ?now.saturating_since(alignment.started),
                missing = ?missing,
                answers = ?alignment.answers,
                "aligning longer than barrier_wait: asking the missing upstreams for their barrier"
            );
            for upstream in missing {
                // Make sure the input we are waiting on can deliver the barrier.
                self.open(upstream);
                self.send(RetrieveBarrier {
                    stream: self.config.stream,
                    upstream,
                    downstream: self.config.task,
                    downstream_node: self.config.node,
                    checkpoint,
                });
            }
        }
        let interval = self.config.resend_interval;
        let due: Vec<CheckpointId> = self
            .builds
            .iter_mut()
            .filter(|(_, b)| b.built && b.resend_due <= now)
            .map(|(id, b)| {
                b.resend_due = now + interval;
                *id
            })
            .collect();
        for checkpoint in due {
            self.resend_build(checkpoint);
        }
    }

    // -----------------------------------------------------------------------------
    // Lifecycle

    /// Stop processing input; checkpoint traffic continues. No action.
    pub fn handle_pause(&mut self, _now: Time) {
        if self.lifecycle == Lifecycle::Running {
            self.lifecycle = Lifecycle::Paused;
        }
    }

    /// Back to running from paused or halted.
    pub fn handle_resume(&mut self, _now: Time) {
        if matches!(self.lifecycle, Lifecycle::Paused | Lifecycle::Halted) {
            self.lifecycle = Lifecycle::Running;
        }
    }

    /// Halt: checkpoints not yet snapshotted fail (reported), inputs reopen, and new
    /// checkpoints are refused until [`TaskMachine::handle_resume`]. Snapshots already
    /// taken keep building.
    pub fn handle_halt(&mut self, _now: Time) {
        if !matches!(self.lifecycle, Lifecycle::Running | Lifecycle::Paused) {
            return;
        }
        self.lifecycle = Lifecycle::Halted;
        if let Some(alignment) = self.alignment.take() {
            self.open_all();
            self.fail(
                alignment.checkpoint,
                alignment.trans,
                "task halted during alignment",
            );
        }
        for (checkpoint, trans, _) in std::mem::take(&mut self.queued) {
            self.fail(checkpoint, trans, "task halted before its barrier");
        }
    }

    /// Dropping: everything in progress is discarded and inputs reopen; afterwards
    /// only [`TaskMachine::handle_stop`] does anything.
    pub fn handle_drop(&mut self, _now: Time) {
        if matches!(self.lifecycle, Lifecycle::Dropping | Lifecycle::Stopped) {
            return;
        }
        self.lifecycle = Lifecycle::Dropping;
        self.alignment = None;
        self.queued.clear();
        self.open_all();
        for checkpoint in std::mem::take(&mut self.builds).into_keys() {
            self.actions.push_back(TaskAction::Discard { checkpoint });
        }
    }

    /// Stopped for good. Snapshots in progress are discarded.
    pub fn handle_stop(&mut self, now: Time) {
        self.handle_drop(now);
        self.lifecycle = Lifecycle::Stopped;
    }
}
