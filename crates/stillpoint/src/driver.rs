//! One driver per task: feeds the task's state machine (stillpoint-task) and carries
//! out its actions — processing records, blocking and reopening inputs, the
//! synchronous snapshot, handing the export to a second thread, committing sinks.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, Sender};
use stillpoint_backup::Store;
use stillpoint_state::{
    CachedState, Partitioner, SnapshotDirs, SnapshotJob, TimeDomain, processing_time,
};
use stillpoint_task::{
    CombineClock, Debloater, EventClock, EventTimeUpdate, ReplayRole, SourceGate, TaskAction,
    TaskMachine, TaskStatus, Time, WatermarkGenerator, records_to_read,
};
use stillpoint_wire::{
    CheckpointId, Data, EndOfInput, Message, NodeId, SnapshotReport, SourceOffset, StreamId,
    TaskId, Watermark, decode_batch, encode_batch,
};

use crate::transport::{CoordinatorInput, Links};
use crate::{Combiner, EngineError, Operator, Record, Sink, Source, SourcePoll};

/// What a task does with records.
pub(crate) enum Role {
    Source(Box<dyn Source>),
    Operator(Box<dyn Operator>),
    Sink(Box<dyn Sink>),
}

/// A stage's [`Combiner`] on one of its tasks, and what decides its next flush.
pub(crate) type Combining = (Box<dyn Combiner>, CombineClock);

/// A synchronous snapshot handed to the export thread.
pub(crate) struct ExportJob {
    pub(crate) job: SnapshotJob,
    pub(crate) checkpoint: CheckpointId,
    pub(crate) source_offset: Option<SourceOffset>,
    pub(crate) sync_micros: u64,
    pub(crate) alignment_micros: u64,
    pub(crate) started: Instant,
    /// A sink's pre-commit, made durable before the snapshot is reported.
    pub(crate) persist: Option<crate::Persist>,
}

/// The export thread's verdict.
pub(crate) enum ExportOutcome {
    Done(CheckpointId, SnapshotReport),
    Failed(CheckpointId, String),
    /// The sink's transaction could not be made durable: its records are lost to
    /// this run, so the task must fail (the job restores and replays them).
    PersistFailed(CheckpointId, String),
}

/// Runs export jobs: the RocksDB write of the frozen set, flush, checkpoint and the
/// upload, off the task's thread.
pub(crate) fn export_loop(
    jobs: Receiver<ExportJob>,
    results: Sender<ExportOutcome>,
    store: Store,
    runtime: tokio::runtime::Handle,
    node: NodeId,
) {
    for mut job in jobs {
        let checkpoint = job.checkpoint;
        if let Some(persist) = job.persist.take()
            && let Err(error) = persist()
        {
            tracing::error!(%checkpoint, %error, "the sink's pre-commit could not be made durable");
            // The state export still writes its frozen batch when dropped.
            drop(job);
            if results
                .send(ExportOutcome::PersistFailed(checkpoint, error.to_string()))
                .is_err()
            {
                return;
            }
            continue;
        }
        let outcome = (|| -> Result<SnapshotReport, EngineError> {
            let exported = job.job.run()?;
            let uploaded = runtime.block_on(store.upload_snapshot(
                &exported.dir,
                &exported.manifest,
                node,
                &(),
            ))?;
            Ok(SnapshotReport {
                manifest: uploaded.reference.manifest,
                manifest_sha256: uploaded.reference.sha256,
                state_bytes: uploaded.state_bytes,
                uploaded_bytes: uploaded.bytes_uploaded,
                files: u32::try_from(exported.manifest.files.len()).unwrap_or(u32::MAX),
                uploaded_files: u32::try_from(uploaded.files_uploaded).unwrap_or(u32::MAX),
                alignment_micros: job.alignment_micros,
                sync_micros: job.sync_micros,
                async_micros: micros(job.started.elapsed()),
                source_offset: job.source_offset,
            })
        })();
        let verdict = match outcome {
            Ok(report) => ExportOutcome::Done(checkpoint, report),
            Err(error) => {
                tracing::warn!(%checkpoint, %error, "snapshot export failed");
                ExportOutcome::Failed(checkpoint, error.to_string())
            }
        };
        if results.send(verdict).is_err() {
            return;
        }
    }
}

fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}

/// What one wait for input produced.
enum Got {
    Control(Message),
    Export(ExportOutcome),
    Data(Message),
}

/// Everything one task's thread owns.
pub(crate) struct TaskDriver {
    pub(crate) stream: StreamId,
    pub(crate) task: TaskId,
    pub(crate) machine: TaskMachine,
    pub(crate) role: Role,
    pub(crate) state: CachedState,
    pub(crate) inputs: Vec<(TaskId, Receiver<Message>)>,
    pub(crate) control: Receiver<Message>,
    pub(crate) exports: Sender<ExportJob>,
    pub(crate) exported: Receiver<ExportOutcome>,
    pub(crate) links: Links,
    pub(crate) downstreams: Vec<TaskId>,
    pub(crate) partitioner: Partitioner,
    pub(crate) snapshots: SnapshotDirs,
    pub(crate) epoch: Instant,
    pub(crate) batch: usize,
    /// Records this task took in (read or received), for the metrics.
    pub(crate) records: stillpoint_metrics::Counter,
    /// A replay up to published output ([`Replay`]): what this task does until it.
    pub(crate) replay: ReplayRole,
    pub(crate) progress: Progress,
    /// Event time over the inputs, and a source's watermark generator.
    pub(crate) clock: EventClock,
    pub(crate) watermarks: Option<WatermarkGenerator>,
    /// What it is doing for checkpoints, for the metrics endpoint.
    pub(crate) gauges: stillpoint_metrics::TaskProgress,
    /// The stage's combiner, which its output goes through before partitioning.
    pub(crate) combiner: Option<Combining>,
    /// Buffer debloating: what this task's records cost, hence the message size it
    /// asks its upstreams for (`None`: off, or a source).
    pub(crate) debloat: Option<Debloater>,
}

/// What a task's driver keeps track of as it goes.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// Inputs blocked while the task aligns on a barrier.
    blocked: BTreeSet<TaskId>,
    /// A source's barriers waiting to be injected behind the records it read.
    queued_barriers: VecDeque<CheckpointId>,
    aligning_since: Option<Instant>,
    finished_reported: bool,
    /// The upstreams whose input has ended ([`Message::EndOfInput`]).
    ended: BTreeSet<TaskId>,
}

impl TaskDriver {
    fn now(&self) -> Time {
        Time::from_duration(self.epoch.elapsed())
    }

    /// The task's loop, until the job stops or crashes.
    pub(crate) fn run(mut self) -> Result<(), EngineError> {
        let span = tracing::info_span!("task", task = %self.task);
        let _entered = span.enter();
        if let Role::Operator(operator) = &mut self.role {
            operator.open(&mut self.state)?;
        }
        // A restored task first commits what its checkpoint covers.
        self.apply_actions()?;
        loop {
            if self.links.signals.crashed() {
                return Err(EngineError::Crashed(format!(
                    "{} stopped mid-flight",
                    self.task
                )));
            }
            if self.links.signals.stopping() {
                // The coordinator sends the final `CheckpointComplete` before it stops
                // the job: carry it out (the sinks publish) before leaving.
                self.drain_control()?;
                self.machine.handle_stop(self.now());
                if let Role::Operator(operator) = &mut self.role {
                    operator.close()?;
                }
                return Ok(());
            }
            self.drain_control()?;
            self.drain_exports()?;
            self.fire_timers(TimeDomain::ProcessingTime, processing_time())?;
            self.gauges.show(&self.machine);
            let now = self.now();
            if self
                .combiner
                .as_ref()
                .is_some_and(|(_, clock)| clock.late(now))
            {
                self.flush_combiner()?;
            }
            if self.machine.poll_timeout().is_some_and(|t| t <= now) {
                self.machine.handle_timeout(now);
                self.apply_actions()?;
            }
            let step = if matches!(self.role, Role::Source(_)) {
                self.source_step()
            } else {
                self.wait(true, Duration::from_millis(20))
            };
            match step {
                // When the job stops, upstream tasks leave first and their channels
                // close: that is the stop, not a failure — go round to carry out the
                // last control messages.
                Err(EngineError::Stopped(_)) if self.links.signals.stopping() => {}
                other => other?,
            }
        }
    }

    fn drain_control(&mut self) -> Result<(), EngineError> {
        while let Ok(message) = self.control.try_recv() {
            self.on_control(&message)?;
        }
        Ok(())
    }

    fn on_control(&mut self, message: &Message) -> Result<(), EngineError> {
        if let Err(error) = self.machine.handle_message(self.now(), message) {
            tracing::warn!(%error, "message refused");
        }
        self.apply_actions()
    }

    fn drain_exports(&mut self) -> Result<(), EngineError> {
        while let Ok(outcome) = self.exported.try_recv() {
            self.on_export(outcome)?;
        }
        Ok(())
    }

    fn on_export(&mut self, outcome: ExportOutcome) -> Result<(), EngineError> {
        let now = self.now();
        match outcome {
            ExportOutcome::Done(checkpoint, report) => {
                self.machine
                    .handle_snapshot_exported(now, checkpoint, report);
            }
            ExportOutcome::Failed(checkpoint, reason) => {
                self.machine
                    .handle_snapshot_failed(now, checkpoint, &reason);
            }
            ExportOutcome::PersistFailed(checkpoint, reason) => {
                return Err(EngineError::Failed(format!(
                    "{}: the pre-commit of {checkpoint} could not be made durable ({reason}); its records are replayed from the last checkpoint",
                    self.task
                )));
            }
        }
        self.apply_actions()
    }

    /// One step of a source: inject a queued barrier, or read a batch. A source
    /// replaying up to published output reads only up to its bound, injects barriers
    /// only there (saying once that it got there), and then waits for the checkpoint
    /// taken there to complete.
    fn source_step(&mut self) -> Result<(), EngineError> {
        let paused = self.links.signals.paused();
        if paused != (self.machine.status() == TaskStatus::Paused) {
            tracing::info!(task = %self.task, paused, "source paused or resumed");
            if paused {
                self.machine.handle_pause(self.now());
            } else {
                self.machine.handle_resume(self.now());
            }
        }
        let batch = self.poll_size();
        let Role::Source(source) = &mut self.role else {
            return Ok(());
        };
        let replaying = self.replay.is_source();
        let bound = match self.replay.gate(&source.offset()) {
            SourceGate::UpTo(bound) => Some(bound),
            SourceGate::AtBound { first } => {
                if first {
                    tracing::info!(task = %self.task, "replayed up to the published output");
                    let _closed = self
                        .links
                        .coordinator
                        .send(CoordinatorInput::SourceAtBound { task: self.task });
                }
                None
            }
            SourceGate::Free => None,
        };
        // Every record read so far has been processed and sent: a barrier injected now
        // is behind all accepted input (a replaying source's, exactly at its bound).
        if bound.is_none()
            && let Some(checkpoint) = self.progress.queued_barriers.pop_front()
        {
            self.replay.barrier_injected(checkpoint);
            self.machine.handle_source_barrier(self.now(), checkpoint);
            return self.apply_actions();
        }
        // Paused: barriers go on (above), reading does not; not idle either, or
        // event time could pass records this source is still to read.
        if paused || (replaying && bound.is_none()) {
            self.flush_combiner()?;
            return self.wait(false, Duration::from_millis(5));
        }
        let mut records = Vec::with_capacity(batch);
        let polled = match bound {
            Some(bound) => source.poll_until(batch, &bound, &mut records)?,
            None => source.poll(batch, &mut records)?,
        };
        match polled {
            SourcePoll::Records => {
                self.records.inc_by(records.len() as u64);
                let times = records.iter().map(|r| r.time);
                let update = self.watermarks.as_mut().and_then(|w| w.on_records(times));
                self.emit(records)?;
                self.on_event_time(update)
            }
            SourcePoll::Idle => {
                // Nothing to read now: what the combiner holds goes on at once.
                self.flush_combiner()?;
                let now = self.now();
                let update = self.watermarks.as_mut().and_then(|w| w.on_nothing(now));
                self.on_event_time(update)?;
                self.wait(false, Duration::from_millis(1))
            }
            SourcePoll::Finished if replaying => Err(EngineError::Invalid(format!(
                "{}: the input ended before the offset its published output covers: it changed after that output was published",
                self.task
            ))),
            SourcePoll::Finished => {
                if !self.progress.finished_reported {
                    self.progress.finished_reported = true;
                    let offset = source.offset();
                    self.end_input()?;
                    let _closed = self
                        .links
                        .coordinator
                        .send(CoordinatorInput::SourceFinished {
                            task: self.task,
                            offset,
                        });
                }
                self.wait(false, Duration::from_millis(5))
            }
        }
    }

    /// Records a source reads at once: `batch_records`, or fewer when its downstreams
    /// ask for small messages (a barrier is injected only once all it read is sent).
    fn poll_size(&self) -> usize {
        let asked = self.downstreams.iter();
        let keyed = matches!(self.partitioner, Partitioner::KeyGroups(_));
        records_to_read(
            asked.map(|to| self.links.records_per_message(*to)),
            if keyed { self.downstreams.len() } else { 1 },
            self.batch,
        )
    }

    fn timeout_within(&self, at_most: Duration) -> Duration {
        let now = self.now();
        self.machine
            .poll_timeout()
            .map_or(at_most, |t| t.saturating_since(now).min(at_most))
    }

    /// Waits for control traffic, an export result, data on an input not blocked by
    /// an alignment (with `data`) or a timeout, and handles what came.
    fn wait(&mut self, data: bool, at_most: Duration) -> Result<(), EngineError> {
        let wait = self.timeout_within(at_most);
        let open: Vec<usize> = self
            .inputs
            .iter()
            .enumerate()
            .filter(|(_, (upstream, _))| data && !self.progress.blocked.contains(upstream))
            .map(|(i, _)| i)
            .collect();
        let got = {
            let mut select = Select::new();
            let control = select.recv(&self.control);
            let exported = select.recv(&self.exported);
            let mut data = BTreeMap::new();
            for &i in &open {
                if let Some((_, rx)) = self.inputs.get(i) {
                    data.insert(select.recv(rx), i);
                }
            }
            let Ok(operation) = select.select_timeout(wait) else {
                // No input for a while: what the combiner holds goes on.
                return self.flush_combiner();
            };
            let index = operation.index();
            if index == control {
                Got::Control(operation.recv(&self.control).map_err(|_| {
                    EngineError::Stopped(format!("the control channel of {}", self.task))
                })?)
            } else if index == exported {
                Got::Export(operation.recv(&self.exported).map_err(|_| {
                    EngineError::Stopped(format!("the export thread of {}", self.task))
                })?)
            } else {
                let Some((upstream, rx)) = data.get(&index).and_then(|i| self.inputs.get(*i))
                else {
                    return Ok(());
                };
                let upstream = *upstream;
                Got::Data(operation.recv(rx).map_err(|_| {
                    EngineError::Stopped(format!("the data channel from {upstream}"))
                })?)
            }
        };
        let message = match got {
            Got::Control(message) => return self.on_control(&message),
            Got::Export(outcome) => return self.on_export(outcome),
            Got::Data(message) => message,
        };
        match message {
            Message::Data(data) => self.process(&data),
            Message::EndOfInput(end) => self.on_end_of_input(end.upstream),
            Message::Watermark(mark) => {
                let update = self.clock.on_watermark(mark.upstream, mark.time, mark.idle);
                self.on_event_time(update)
            }
            Message::Barrier(_) => {
                if let Err(error) = self.machine.handle_message(self.now(), &message) {
                    tracing::warn!(%error, "barrier refused");
                }
                self.apply_actions()
            }
            other => self.on_control(&other),
        }
    }

    fn process(&mut self, data: &Data) -> Result<(), EngineError> {
        let started = Instant::now();
        let records = decode_batch(&data.payload)?;
        let count = records.len();
        self.records.inc_by(count as u64);
        match &mut self.role {
            Role::Operator(operator) => {
                let mut out = Vec::with_capacity(count);
                for record in records {
                    operator.process(record, &mut self.state, &mut out)?;
                }
                self.emit(out)?;
            }
            Role::Sink(sink) => {
                if self.replay.drops(count) {
                    return Ok(());
                }
                for record in records {
                    sink.write(record)?;
                }
            }
            Role::Source(_) => return Ok(()),
        }
        // What the message cost, sending its output included (a task held back by its
        // downstreams drains its inputs that much slower).
        if let Some(debloat) = &mut self.debloat {
            let size = debloat.observe(count, started.elapsed());
            if let Some(asked) = self.links.sizes.get(&self.task)
                && asked.swap(size, Ordering::Relaxed) != size
            {
                self.gauges.message_records.set(i64::from(size));
            }
        }
        Ok(())
    }

    /// Upstream `upstream`'s input ended; once every upstream's has, event time
    /// ends (every event-time timer fires), the operator's last output goes out and
    /// this task's input has ended too.
    fn on_end_of_input(&mut self, upstream: TaskId) -> Result<(), EngineError> {
        let known = self.inputs.iter().any(|(up, _)| *up == upstream);
        if !known || !self.progress.ended.insert(upstream) {
            return Ok(());
        }
        let update = self.clock.on_end(upstream);
        self.on_event_time(update)?;
        if self.progress.ended.len() < self.inputs.len() {
            return Ok(());
        }
        tracing::debug!(task = %self.task, "every input has ended");
        if let Role::Operator(operator) = &mut self.role {
            let mut out = Vec::new();
            operator.on_end_of_input(&mut self.state, &mut out)?;
            self.emit(out)?;
        }
        self.end_input()
    }

    /// Tells every downstream that this task's input has ended (after its last record,
    /// the combiner's included).
    fn end_input(&mut self) -> Result<(), EngineError> {
        self.flush_combiner()?;
        let (stream, upstream) = (self.stream, self.task);
        self.broadcast(|downstream| {
            EndOfInput {
                stream,
                upstream,
                downstream,
            }
            .into()
        })
    }

    /// This task's event time advanced (or went idle): due event-time timers fire,
    /// their output goes out, then the watermark goes to every downstream.
    fn on_event_time(&mut self, update: Option<EventTimeUpdate>) -> Result<(), EngineError> {
        let (time, idle) = match update {
            None => return Ok(()),
            Some(EventTimeUpdate::Idle) => (self.state.watermark(), true),
            Some(EventTimeUpdate::Advanced(time)) => {
                self.state.advance_watermark(time);
                self.fire_timers(TimeDomain::EventTime, time)?;
                (time, false)
            }
        };
        // A record folded before the watermark goes before it.
        self.flush_combiner()?;
        let (stream, upstream) = (self.stream, self.task);
        self.broadcast(|downstream| {
            Watermark {
                stream,
                upstream,
                downstream,
                time,
                idle,
            }
            .into()
        })
    }

    /// Fires an operator's timers on `domain`'s clock due at `now`, in time order.
    fn fire_timers(&mut self, domain: TimeDomain, now: i64) -> Result<(), EngineError> {
        let Role::Operator(operator) = &mut self.role else {
            return Ok(());
        };
        let mut out = Vec::new();
        while let Some(timer) = self.state.pop_timer(domain, now)? {
            operator.on_timer(timer, &mut self.state, &mut out)?;
        }
        self.emit(out)
    }

    /// Sends one message to every downstream.
    fn broadcast(&mut self, message: impl Fn(TaskId) -> Message) -> Result<(), EngineError> {
        for downstream in self.downstreams.clone() {
            self.links.route(message(downstream))?;
        }
        Ok(())
    }

    /// Sends output on: through the stage's combiner when it has one (which flushes
    /// when its [`CombineClock`] says), else straight to the downstreams.
    fn emit(&mut self, records: Vec<Record>) -> Result<(), EngineError> {
        let Some((combiner, _)) = &mut self.combiner else {
            return self.send(records);
        };
        let added = records.len();
        for record in records {
            combiner.add(record)?;
        }
        // The clock is read only with a combiner.
        let now = self.now();
        if let Some((_, clock)) = &mut self.combiner
            && clock.add(added, now)
        {
            self.flush_combiner()?;
        }
        Ok(())
    }

    /// Sends on everything the combiner holds (nothing without one): before a
    /// barrier, a watermark, the end of input, when the task has nothing to do, and
    /// when its clock says.
    fn flush_combiner(&mut self) -> Result<(), EngineError> {
        let mut out = Vec::new();
        match &mut self.combiner {
            Some((combiner, clock)) if !clock.is_empty() => {
                clock.flushed();
                combiner.flush(&mut out)?;
            }
            _ => return Ok(()),
        }
        self.send(out)
    }

    /// Partitions records over the downstreams and sends them.
    fn send(&mut self, records: Vec<Record>) -> Result<(), EngineError> {
        if records.is_empty() || self.downstreams.is_empty() {
            return Ok(());
        }
        let per = self.partitioner.split(records, self.downstreams.len());
        for (downstream, bucket) in self.downstreams.clone().into_iter().zip(per) {
            // In messages of the size the downstream asks for (buffer debloating).
            for chunk in bucket.chunks(self.links.records_per_message(downstream).max(1)) {
                let message = Message::Data(Data {
                    stream: self.stream,
                    upstream: self.task,
                    downstream,
                    records: u32::try_from(chunk.len()).unwrap_or(u32::MAX),
                    payload: encode_batch(chunk),
                });
                self.links.route(message)?;
            }
        }
        Ok(())
    }

    fn apply_actions(&mut self) -> Result<(), EngineError> {
        while let Some(action) = self.machine.poll_action() {
            match action {
                TaskAction::QueueBarrier { checkpoint } => {
                    self.progress.queued_barriers.push_back(checkpoint)
                }
                TaskAction::FlushOutput { checkpoint } => {
                    if let Role::Operator(operator) = &mut self.role {
                        let mut out = Vec::new();
                        operator.on_barrier(checkpoint, &mut self.state, &mut out)?;
                        self.emit(out)?;
                    }
                    // Nothing of a checkpoint is inside a combiner.
                    self.flush_combiner()?;
                }
                TaskAction::Snapshot { checkpoint, .. } => self.snapshot(checkpoint)?,
                TaskAction::BlockInput(upstream) => {
                    self.progress
                        .aligning_since
                        .get_or_insert_with(Instant::now);
                    self.progress.blocked.insert(upstream);
                }
                TaskAction::OpenInput(upstream) => {
                    self.progress.blocked.remove(&upstream);
                }
                TaskAction::Send(message) => self.links.route(message)?,
                TaskAction::Commit { checkpoint, .. } => {
                    if let Role::Sink(sink) = &mut self.role {
                        sink.commit(checkpoint)?;
                    }
                    if self.replay.completed(checkpoint) {
                        tracing::info!(task = %self.task, %checkpoint, "the checkpoint at the end of the published output completed; reading on");
                    }
                    self.snapshots.drop_before(checkpoint);
                }
                TaskAction::Discard { checkpoint } => self.snapshots.discard(checkpoint),
            }
        }
        Ok(())
    }

    /// The synchronous part: freeze the state (O(1)), record the source offset or
    /// pre-commit the sink; the rest runs on the export thread.
    fn snapshot(&mut self, checkpoint: CheckpointId) -> Result<(), EngineError> {
        let started = Instant::now();
        let alignment_micros = self
            .progress
            .aligning_since
            .take()
            .map_or(0, |since| micros(since.elapsed()));
        let mut source_offset = None;
        let mut persist = None;
        if let Some(dropped) = self.replay.sink_snapshot() {
            // Every record before the first barrier was published already (and
            // dropped): the transactions from here on are new output.
            tracing::info!(task = %self.task, %checkpoint, dropped, "dropped the replayed output, published already");
        }
        match &mut self.role {
            Role::Source(source) => source_offset = Some(source.offset()),
            Role::Sink(sink) => match sink.pre_commit(checkpoint) {
                Ok(durable) => persist = durable,
                Err(error) => {
                    tracing::warn!(%checkpoint, %error, "pre-commit failed");
                    self.machine
                        .handle_snapshot_failed(self.now(), checkpoint, &error.to_string());
                    return Ok(());
                }
            },
            Role::Operator(_) => {}
        }
        let job = self
            .state
            .snapshot(checkpoint, self.snapshots.dir(checkpoint));
        let sync_micros = micros(started.elapsed());
        self.exports
            .send(ExportJob {
                job,
                checkpoint,
                source_offset,
                sync_micros,
                alignment_micros,
                started,
                persist,
            })
            .map_err(|_| EngineError::Stopped(format!("the export thread of {}", self.task)))
    }
}
