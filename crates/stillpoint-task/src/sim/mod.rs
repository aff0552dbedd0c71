//! A deterministic simulator of a whole dataflow running the checkpoint protocol.
//!
//! Every task runs a [`TaskMachine`], one [`Coordinator`] drives checkpoints, and a
//! seeded scheduler moves time in 1 ms ticks: records and barriers travel on FIFO
//! data channels (reliable, as a TCP connection is until it breaks), control messages
//! are delayed, lost, duplicated and reordered, snapshot exports and manifest writes
//! fail, and tasks crash — a crash fails the whole job over: channels reset, every
//! task restores from the newest complete checkpoint, sources rewind to its offsets,
//! sinks commit its pre-committed transactions and drop later ones.
//!
//! Checked on every run (a failure is a [`Violation`] that prints its seed; the same
//! seed replays bit for bit):
//! - each task snapshots strictly increasing checkpoint ids, so never one twice;
//! - no record a task received after an upstream's barrier `n` is applied before that
//!   task's snapshot `n` (alignment);
//! - a global manifest lists only tasks whose snapshot is durable;
//! - every checkpoint completes or aborts within its timeout (no deadlock), and the
//!   job finishes its input;
//! - exactly once: the sinks' committed output and the aggregates' state equal those
//!   of a failure-free run — the aggregates' snapshots being changelog ones (a
//!   materialization finishing in the background plus segments replayed over it,
//!   [`changelog`]), so a restore that lost or misordered a segment fails it.

mod changelog;
mod cluster;
mod rng;
mod topology;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::fmt;
use std::time::Duration;

use stillpoint_wire::{
    CheckpointId, Message, NodeId, RelativePath, Sha256Digest, SnapshotReport, SourceOffset,
    StreamId, TaskId,
};

pub use cluster::{ClusterFaults, ClusterOutcome, ClusterSimConfig, ClusterViolation, run_cluster};
pub use rng::SimRng;
pub use topology::{Expected, Graph, Node, Record, Topology};

use crate::{
    Coordinator, CoordinatorAction, CoordinatorConfig, RestoredCheckpoint, TaskAction, TaskConfig,
    TaskLevel, TaskMachine, Time,
};

/// How hostile the simulated world is.
#[derive(Clone, Debug, PartialEq)]
pub struct Faults {
    /// Probability a control message is lost.
    pub drop: f64,
    /// Probability a control message is delivered twice.
    pub duplicate: f64,
    /// Control messages and data are delayed uniformly up to this many milliseconds
    /// (control messages may overtake each other; data stays in order).
    pub max_delay_ms: u64,
    /// Probability per millisecond that some task crashes.
    pub crash_per_ms: f64,
    /// At most this many crashes per run.
    pub max_crashes: u32,
    /// Probability a snapshot export fails.
    pub export_failure: f64,
    /// Probability a global manifest write fails.
    pub manifest_failure: f64,
    /// Checkpoints in flight at once.
    pub max_concurrent: usize,
}

impl Faults {
    /// A perfect world.
    #[must_use]
    pub fn none() -> Self {
        Self {
            drop: 0.0,
            duplicate: 0.0,
            max_delay_ms: 1,
            crash_per_ms: 0.0,
            max_crashes: 0,
            export_failure: 0.0,
            manifest_failure: 0.0,
            max_concurrent: 1,
        }
    }

    /// One of four fault profiles, picked by the seed: none; lossy control traffic;
    /// crashes; everything at once with two checkpoints in flight.
    #[must_use]
    pub fn for_seed(seed: u64) -> Self {
        let none = Self::none();
        match seed % 4 {
            0 => none,
            1 => Self {
                drop: 0.1,
                duplicate: 0.1,
                max_delay_ms: 20,
                ..none
            },
            2 => Self {
                drop: 0.05,
                duplicate: 0.05,
                max_delay_ms: 10,
                crash_per_ms: 0.004,
                max_crashes: 2,
                ..none
            },
            _ => Self {
                drop: 0.15,
                duplicate: 0.15,
                max_delay_ms: 30,
                crash_per_ms: 0.002,
                max_crashes: 2,
                export_failure: 0.05,
                manifest_failure: 0.05,
                max_concurrent: 2,
            },
        }
    }
}

/// One simulated run.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// The seed: the same seed replays the same run.
    pub seed: u64,
    /// The dataflow.
    pub topology: Topology,
    /// Records each source reads before its input ends.
    pub records_per_source: u64,
    /// The faults.
    pub faults: Faults,
    /// Keep a log of every delivery and action (for replaying a failing seed).
    pub trace: bool,
}

impl SimConfig {
    /// The standard run for `seed`: faults picked by [`Faults::for_seed`], 120 records
    /// per source.
    #[must_use]
    pub fn new(seed: u64, topology: Topology) -> Self {
        Self {
            seed,
            topology,
            records_per_source: 120,
            faults: Faults::for_seed(seed),
            trace: false,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimOutcome {
    /// Checkpoints completed.
    pub completed: u32,
    /// Checkpoints aborted.
    pub aborted: u32,
    /// Job failovers (crashes and too many failed checkpoints).
    pub failovers: u32,
    /// Inputs handled by the state machines.
    pub events: u64,
    /// Simulated time until the input was committed.
    pub virtual_millis: u64,
}

/// A broken invariant, with what is needed to replay it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The seed.
    pub seed: u64,
    /// The dataflow.
    pub topology: Topology,
    /// Simulated time of the violation.
    pub at: Time,
    /// What went wrong.
    pub what: String,
    /// With [`SimConfig::trace`]: the last events before the violation.
    pub trace: Vec<String>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {} ({}) at {}: {}\n  replay: cargo xtask sim --seed {} --topology {}",
            self.seed, self.topology, self.at, self.what, self.seed, self.topology
        )?;
        for line in &self.trace {
            write!(f, "\n    {line}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Violation {}

/// Runs one simulation.
pub fn run(config: &SimConfig) -> Result<SimOutcome, Violation> {
    let mut world = World::new(config);
    world.run().map_err(|(at, what)| Violation {
        seed: config.seed,
        topology: config.topology,
        at,
        what,
        trace: world.log.iter().cloned().collect(),
    })?;
    Ok(world.outcome)
}

// ---------------------------------------------------------------------------------------

const STREAM: StreamId = StreamId(1);
const TICK: Duration = Duration::from_millis(1);
const TIME_LIMIT: Time = Time::from_millis(120_000);
const TIMEOUT: Duration = Duration::from_millis(400);
/// Records a data channel holds before its sender must wait (backpressure). Barriers
/// are never held back.
const CHANNEL_CAPACITY: usize = 16;

type Fail = (Time, String);

#[derive(Clone, Debug)]
enum Item {
    /// A record, tagged with the last barrier its sender had sent on this channel.
    Record(Record, u64),
    Barrier(stillpoint_wire::Barrier),
}

#[derive(Clone, Copy, Debug)]
enum SourceItem {
    Record(u64),
    Marker(CheckpointId),
}

/// What a snapshot holds, by level.
#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Source {
        offset: u64,
    },
    /// An aggregate's snapshot is a changelog one: see [`changelog`].
    Aggregate(changelog::Changelogged),
    Sink,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Dest {
    Task(TaskId),
    Coordinator,
}

/// A snapshot export finishing at a time: `(at, seq, task, checkpoint, succeeds)`.
type Export = (Time, u64, TaskId, CheckpointId, bool);

struct SimTask {
    machine: TaskMachine,
    level: TaskLevel,
    blocked: BTreeSet<TaskId>,
    // Operator state.
    offset: u64,
    input: VecDeque<SourceItem>,
    applied: BTreeMap<TaskId, u64>,
    changelog: changelog::ChangelogModel,
    sink_buffer: Vec<Record>,
    // Invariant bookkeeping.
    last_barrier_sent: u64,
    max_tag_since_snapshot: u64,
}

struct World {
    rng: SimRng,
    faults: Faults,
    graph: Graph,
    records_per_source: u64,
    expected: Expected,
    now: Time,
    seq: u64,
    tasks: BTreeMap<TaskId, SimTask>,
    channels: BTreeMap<(TaskId, TaskId), VecDeque<(Time, Item)>>,
    control: BinaryHeap<Reverse<(Time, u64, Dest, MessageBox)>>,
    exports: BinaryHeap<Reverse<Export>>,
    coordinator: Coordinator,
    /// Snapshots taken, not yet exported (lost on failover).
    local_snapshots: BTreeMap<(TaskId, CheckpointId), State>,
    // The durable world: the store and the sinks' external system.
    snapshots: BTreeMap<(TaskId, CheckpointId), State>,
    completed: Vec<CheckpointId>,
    sink_txns: BTreeMap<TaskId, BTreeMap<CheckpointId, Vec<Record>>>,
    committed: BTreeMap<TaskId, Vec<Record>>,
    // Run-wide invariant bookkeeping.
    snapshot_history: BTreeMap<TaskId, CheckpointId>,
    triggered: BTreeMap<CheckpointId, Time>,
    crashes: u32,
    outcome: SimOutcome,
    trace: bool,
    log: VecDeque<String>,
}

/// A message in the control queue (ordered by the queue's time and sequence only).
#[derive(Clone, Debug)]
struct MessageBox(Message);

impl PartialEq for MessageBox {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for MessageBox {}
impl PartialOrd for MessageBox {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for MessageBox {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

fn task_config(task: TaskId, node: &Node) -> TaskConfig {
    let mut config = TaskConfig::new(
        STREAM,
        task,
        NodeId(task.0 % 3),
        node.level.unwrap_or(TaskLevel::Aggregate),
    )
    .upstreams(node.upstreams.iter().copied())
    .downstreams(node.downstreams.iter().copied());
    config.barrier_wait = Duration::from_millis(100);
    config.resend_interval = Duration::from_millis(20);
    config
}

impl World {
    fn new(config: &SimConfig) -> Self {
        let graph = config.topology.graph();
        let mut rng = SimRng::new(config.seed);
        let sources = graph.sources();
        let tasks: Vec<TaskId> = graph.nodes.keys().copied().collect();
        let mut coordinator_config = CoordinatorConfig::new(STREAM, sources, tasks);
        coordinator_config.interval = Duration::from_millis(20 + rng.below(40));
        coordinator_config.min_pause = Duration::from_millis(rng.below(10));
        coordinator_config.max_concurrent = config.faults.max_concurrent;
        coordinator_config.timeout = TIMEOUT;
        coordinator_config.tolerable_failures = 5;
        coordinator_config.resend_interval = Duration::from_millis(20);
        let coordinator = Coordinator::new(coordinator_config, Time::ZERO, None, CheckpointId(1))
            .unwrap_or_else(|e| unreachable!("simulator coordinator config is valid: {e}"));
        let mut world = Self {
            rng,
            faults: config.faults.clone(),
            expected: graph.expected(config.records_per_source),
            graph,
            records_per_source: config.records_per_source,
            now: Time::ZERO,
            seq: 0,
            tasks: BTreeMap::new(),
            channels: BTreeMap::new(),
            control: BinaryHeap::new(),
            exports: BinaryHeap::new(),
            coordinator,
            local_snapshots: BTreeMap::new(),
            snapshots: BTreeMap::new(),
            completed: Vec::new(),
            sink_txns: BTreeMap::new(),
            committed: BTreeMap::new(),
            snapshot_history: BTreeMap::new(),
            triggered: BTreeMap::new(),
            crashes: 0,
            outcome: SimOutcome::default(),
            trace: config.trace,
            log: VecDeque::new(),
        };
        // A fresh start has no snapshot to miss and sends nothing: it cannot fail.
        let _ = world.start_tasks(None);
        world
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if self.trace {
            if self.log.len() == 400 {
                self.log.pop_front();
            }
            let line = format!("{} {}", self.now, line());
            self.log.push_back(line);
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// (Re)creates every task, restored from `restore` if given.
    fn start_tasks(&mut self, restore: Option<CheckpointId>) -> Result<(), Fail> {
        self.tasks.clear();
        self.local_snapshots.clear();
        self.channels.clear();
        self.control.clear();
        self.exports.clear();
        let nodes: Vec<(TaskId, Node)> = self
            .graph
            .nodes
            .iter()
            .map(|(t, n)| (*t, n.clone()))
            .collect();
        for (task, node) in nodes {
            let level = node.level.unwrap_or(TaskLevel::Aggregate);
            let state = restore.and_then(|c| self.snapshots.get(&(task, c)).cloned());
            if let (Some(c), None) = (restore, &state) {
                return Err((
                    self.now,
                    format!("restore from {c}: {task} has no durable snapshot"),
                ));
            }
            let restored = restore.map(|checkpoint| RestoredCheckpoint {
                checkpoint,
                trans: stillpoint_wire::TransId(0),
                kind: stillpoint_wire::CheckpointKind::Checkpoint,
                source_offset: match &state {
                    Some(State::Source { offset }) => Some(SourceOffset::from_u64(*offset)),
                    _ => None,
                },
            });
            let machine = TaskMachine::new(task_config(task, &node), restored)
                .unwrap_or_else(|e| unreachable!("simulator task config is valid: {e}"));
            for up in &node.upstreams {
                self.channels.insert((*up, task), VecDeque::new());
            }
            let (offset, applied) = match state {
                Some(State::Source { offset }) => (offset, BTreeMap::new()),
                Some(State::Aggregate(snapshot)) => (0, snapshot.replayed()),
                _ => (0, BTreeMap::new()),
            };
            if level == TaskLevel::Sink {
                // Pre-commits of checkpoints after the restored one are rolled back:
                // their records will be replayed.
                let txns = self.sink_txns.entry(task).or_default();
                match restore {
                    Some(c) => txns.retain(|id, _| *id <= c),
                    None => txns.clear(),
                }
            }
            self.tasks.insert(
                task,
                SimTask {
                    machine,
                    level,
                    blocked: BTreeSet::new(),
                    offset,
                    input: VecDeque::new(),
                    applied,
                    changelog: changelog::ChangelogModel::default(),
                    sink_buffer: Vec::new(),
                    last_barrier_sent: 0,
                    max_tag_since_snapshot: 0,
                },
            );
        }
        let ids: Vec<TaskId> = self.tasks.keys().copied().collect();
        for task in ids {
            self.drain_task(task)?;
        }
        Ok(())
    }

    fn run(&mut self) -> Result<(), Fail> {
        loop {
            self.now = self.now + TICK;
            if self.now > TIME_LIMIT {
                let exhausted = self.tasks.values().all(|t| {
                    t.level != TaskLevel::Source
                        || (t.offset == self.records_per_source && t.input.is_empty())
                });
                if exhausted {
                    // Name the lost or duplicated records, if that is what happened.
                    self.check_final()?;
                }
                return Err(self.fail(format!(
                    "did not finish: {} of {} records committed",
                    self.committed.values().map(Vec::len).sum::<usize>(),
                    self.expected
                        .committed
                        .values()
                        .map(Vec::len)
                        .sum::<usize>()
                )));
            }
            self.deliver_control()?;
            self.finish_exports()?;
            self.step_tasks()?;
            self.fire_timers()?;
            if self.crashes < self.faults.max_crashes && self.rng.chance(self.faults.crash_per_ms) {
                self.crashes += 1;
                self.failover()?;
            }
            self.check_deadlines()?;
            if self.finished() {
                return self.check_final();
            }
        }
    }

    fn fail(&self, what: String) -> Fail {
        (self.now, what)
    }

    fn finished(&self) -> bool {
        let total: usize = self.committed.values().map(Vec::len).sum();
        let expected: usize = self.expected.committed.values().map(Vec::len).sum();
        total >= expected
    }

    // --- delivery ---------------------------------------------------------------------

    fn send_control(&mut self, dest: Dest, message: Message) {
        if self.rng.chance(self.faults.drop) {
            return;
        }
        let copies = if self.rng.chance(self.faults.duplicate) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = self.now + Duration::from_millis(self.rng.below(self.faults.max_delay_ms + 1));
            let seq = self.next_seq();
            self.control
                .push(Reverse((at, seq, dest, MessageBox(message.clone()))));
        }
    }

    fn has_room(&self, from: TaskId, record: Record) -> bool {
        self.graph
            .route(from, record)
            .and_then(|to| self.channels.get(&(from, to)))
            .is_none_or(|channel| channel.len() < CHANNEL_CAPACITY)
    }

    fn send_data(&mut self, from: TaskId, to: TaskId, item: Item) {
        let delay = Duration::from_millis(self.rng.below(self.faults.max_delay_ms / 4 + 1));
        let now = self.now;
        if let Some(channel) = self.channels.get_mut(&(from, to)) {
            let at = channel
                .back()
                .map_or(now + delay, |(last, _)| (*last).max(now + delay));
            channel.push_back((at, item));
        }
    }

    fn deliver_control(&mut self) -> Result<(), Fail> {
        while self
            .control
            .peek()
            .is_some_and(|Reverse((at, ..))| *at <= self.now)
        {
            let Some(Reverse((_, _, dest, MessageBox(message)))) = self.control.pop() else {
                break;
            };
            self.outcome.events += 1;
            self.log(|| format!("deliver to {dest:?}: {message:?}"));
            match dest {
                Dest::Coordinator => {
                    self.coordinator
                        .handle_message(self.now, &message)
                        .map_err(|e| {
                            self.fail(format!("coordinator refused {}: {e}", message.kind()))
                        })?;
                    self.drain_coordinator()?;
                }
                Dest::Task(task) => {
                    let now = self.now;
                    let sim = self
                        .tasks
                        .get_mut(&task)
                        .ok_or_else(|| (now, format!("no {task}")))?;
                    sim.machine
                        .handle_message(now, &message)
                        .map_err(|e| (now, format!("{task} refused {}: {e}", message.kind())))?;
                    self.drain_task(task)?;
                }
            }
        }
        Ok(())
    }

    fn finish_exports(&mut self) -> Result<(), Fail> {
        while self
            .exports
            .peek()
            .is_some_and(|Reverse((at, ..))| *at <= self.now)
        {
            let Some(Reverse((_, _, task, checkpoint, ok))) = self.exports.pop() else {
                break;
            };
            let now = self.now;
            self.outcome.events += 1;
            let Some(sim) = self.tasks.get_mut(&task) else {
                continue;
            };
            if ok {
                // The export made the snapshot durable in the store.
                if let Some(state) = self.local_snapshots.remove(&(task, checkpoint)) {
                    self.snapshots.insert((task, checkpoint), state);
                }
                let report = SnapshotReport {
                    manifest: RelativePath::new(format!("tasks/{task}/{checkpoint}.manifest"))
                        .map_err(|e| (now, e.to_string()))?,
                    manifest_sha256: Sha256Digest([0; 32]),
                    state_bytes: 100,
                    uploaded_bytes: 10,
                    files: 1,
                    uploaded_files: 1,
                    alignment_micros: 0,
                    sync_micros: 1,
                    async_micros: 1000,
                    source_offset: match self.snapshots.get(&(task, checkpoint)) {
                        Some(State::Source { offset }) => Some(SourceOffset::from_u64(*offset)),
                        _ => None,
                    },
                };
                sim.machine
                    .handle_snapshot_exported(now, checkpoint, report);
            } else {
                sim.machine
                    .handle_snapshot_failed(now, checkpoint, "simulated export failure");
            }
            self.drain_task(task)?;
        }
        Ok(())
    }

    // --- task processing --------------------------------------------------------------

    fn step_tasks(&mut self) -> Result<(), Fail> {
        let mut order: Vec<TaskId> = self.tasks.keys().copied().collect();
        for i in (1..order.len()).rev() {
            order.swap(i, self.rng.index(i + 1));
        }
        for task in order {
            for _ in 0..=self.rng.below(3) {
                if !self.step(task)? {
                    break;
                }
            }
        }
        Ok(())
    }

    /// One unit of work; false when the task had nothing to do.
    fn step(&mut self, task: TaskId) -> Result<bool, Fail> {
        let Some(sim) = self.tasks.get_mut(&task) else {
            return Ok(false);
        };
        if sim.level == TaskLevel::Source {
            // Accept input ahead of processing, so barriers queue behind it.
            while sim.input.len() < 3 && sim.offset < self.records_per_source {
                sim.input.push_back(SourceItem::Record(sim.offset));
                sim.offset += 1;
            }
            if let Some(SourceItem::Record(seq)) = sim.input.front() {
                let record = Record {
                    source: task,
                    seq: *seq,
                };
                if !self.has_room(task, record) {
                    return Ok(false);
                }
            }
            let Some(sim) = self.tasks.get_mut(&task) else {
                return Ok(false);
            };
            let Some(item) = sim.input.pop_front() else {
                return Ok(false);
            };
            match item {
                SourceItem::Record(seq) => {
                    let tag = sim.last_barrier_sent;
                    let record = Record { source: task, seq };
                    if let Some(next) = self.graph.route(task, record) {
                        self.send_data(task, next, Item::Record(record, tag));
                    }
                }
                SourceItem::Marker(checkpoint) => {
                    self.outcome.events += 1;
                    sim.machine.handle_source_barrier(self.now, checkpoint);
                    self.log(|| format!("{task} reaches marker {checkpoint}"));
                    self.drain_task(task)?;
                }
            }
            return Ok(true);
        }
        let now = self.now;
        let blocked = sim.blocked.clone();
        let ready: Vec<TaskId> = self
            .graph
            .nodes
            .get(&task)
            .map(|n| n.upstreams.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|u| !blocked.contains(u))
            .filter(
                |u| match self.channels.get(&(*u, task)).and_then(VecDeque::front) {
                    Some((at, Item::Record(record, _))) => {
                        *at <= now && self.has_room(task, *record)
                    }
                    Some((at, Item::Barrier(_))) => *at <= now,
                    None => false,
                },
            )
            .collect();
        if ready.is_empty() {
            return Ok(false);
        }
        let Some(&from) = ready.get(self.rng.index(ready.len())) else {
            return Ok(false);
        };
        let Some((_, item)) = self
            .channels
            .get_mut(&(from, task))
            .and_then(VecDeque::pop_front)
        else {
            return Ok(false);
        };
        match item {
            Item::Barrier(barrier) => {
                self.outcome.events += 1;
                self.log(|| format!("{task} takes barrier {} from {from}", barrier.checkpoint));
                if let Some(sim) = self.tasks.get_mut(&task) {
                    sim.machine
                        .handle_message(now, &Message::Barrier(barrier))
                        .map_err(|e| (now, format!("{task} refused a barrier: {e}")))?;
                }
                self.drain_task(task)?;
            }
            Item::Record(record, tag) => self.apply(task, record, tag),
        }
        Ok(true)
    }

    fn apply(&mut self, task: TaskId, record: Record, tag: u64) {
        let Some(sim) = self.tasks.get_mut(&task) else {
            return;
        };
        sim.max_tag_since_snapshot = sim.max_tag_since_snapshot.max(tag);
        match sim.level {
            TaskLevel::Aggregate => {
                *sim.applied.entry(record.source).or_default() += 1;
                let tag = sim.last_barrier_sent;
                if let Some(next) = self.graph.route(task, record) {
                    self.send_data(task, next, Item::Record(record, tag));
                }
            }
            TaskLevel::Sink => sim.sink_buffer.push(record),
            TaskLevel::Source => {}
        }
    }

    fn drain_task(&mut self, task: TaskId) -> Result<(), Fail> {
        loop {
            let Some(action) = self
                .tasks
                .get_mut(&task)
                .and_then(|t| t.machine.poll_action())
            else {
                return Ok(());
            };
            self.execute(task, action)?;
        }
    }

    fn execute(&mut self, task: TaskId, action: TaskAction) -> Result<(), Fail> {
        self.log(|| format!("{task} does {action:?}"));
        let now = self.now;
        let Some(sim) = self.tasks.get_mut(&task) else {
            return Ok(());
        };
        match action {
            TaskAction::QueueBarrier { checkpoint } => {
                sim.input.push_back(SourceItem::Marker(checkpoint))
            }
            TaskAction::FlushOutput { .. } => {} // simulated operators buffer nothing
            TaskAction::Snapshot { checkpoint, .. } => {
                if let Some(previous) = self
                    .snapshot_history
                    .get(&task)
                    .filter(|p| **p >= checkpoint)
                {
                    return Err((
                        now,
                        format!("{task} snapshotted {checkpoint} after {previous}"),
                    ));
                }
                if sim.max_tag_since_snapshot >= checkpoint.0 {
                    return Err((
                        now,
                        format!(
                            "{task} applied a record sent after barrier ckpt-{} before its snapshot {checkpoint}",
                            sim.max_tag_since_snapshot
                        ),
                    ));
                }
                self.snapshot_history.insert(task, checkpoint);
                sim.max_tag_since_snapshot = 0;
                let state = match sim.level {
                    TaskLevel::Source => {
                        let queued = sim
                            .input
                            .iter()
                            .filter(|i| matches!(i, SourceItem::Record(_)))
                            .count() as u64;
                        State::Source {
                            offset: sim.offset - queued,
                        }
                    }
                    TaskLevel::Aggregate => {
                        State::Aggregate(sim.changelog.snapshot(&sim.applied, now, &mut self.rng))
                    }
                    TaskLevel::Sink => {
                        let records = std::mem::take(&mut sim.sink_buffer);
                        self.sink_txns
                            .entry(task)
                            .or_default()
                            .insert(checkpoint, records);
                        State::Sink
                    }
                };
                self.local_snapshots.insert((task, checkpoint), state);
                let at = now + Duration::from_millis(1 + self.rng.below(15));
                let ok = !self.rng.chance(self.faults.export_failure);
                let seq = self.next_seq();
                self.exports.push(Reverse((at, seq, task, checkpoint, ok)));
            }
            TaskAction::BlockInput(upstream) => {
                sim.blocked.insert(upstream);
            }
            TaskAction::OpenInput(upstream) => {
                sim.blocked.remove(&upstream);
            }
            TaskAction::Send(Message::Barrier(barrier)) => {
                sim.last_barrier_sent = barrier.checkpoint.0;
                self.send_data(task, barrier.downstream, Item::Barrier(barrier));
            }
            TaskAction::Send(message) => {
                let dest = match &message {
                    Message::CheckpointReport(_) | Message::CheckpointSourceRsp(_) => {
                        Dest::Coordinator
                    }
                    Message::BarrierAck(m) => Dest::Task(m.upstream),
                    Message::CheckpointReady(m) => Dest::Task(m.upstream),
                    Message::CheckpointReadyAck(m) => Dest::Task(m.downstream),
                    Message::RetrieveBarrier(m) => Dest::Task(m.upstream),
                    Message::RetrieveBarrierRsp(m) => Dest::Task(m.downstream),
                    other => {
                        return Err((now, format!("{task} sent an unexpected {}", other.kind())));
                    }
                };
                self.send_control(dest, message);
            }
            TaskAction::Commit { checkpoint, .. } => {
                if sim.level == TaskLevel::Sink {
                    let txns = self.sink_txns.entry(task).or_default();
                    let ready: Vec<CheckpointId> =
                        txns.range(..=checkpoint).map(|(id, _)| *id).collect();
                    for id in ready {
                        if let Some(records) = txns.remove(&id) {
                            self.committed.entry(task).or_default().extend(records);
                        }
                    }
                }
            }
            TaskAction::Discard { .. } => {} // a sink keeps its pre-commit; nothing else is local
        }
        Ok(())
    }

    // --- coordinator ------------------------------------------------------------------

    fn drain_coordinator(&mut self) -> Result<(), Fail> {
        while let Some(action) = self.coordinator.poll_action() {
            match action {
                CoordinatorAction::Send(message) => {
                    if let Message::CheckpointSource(m) = &message {
                        self.triggered.entry(m.checkpoint).or_insert(self.now);
                    }
                    let task = match &message {
                        Message::CheckpointSource(m) => m.task,
                        Message::CheckpointComplete(m) => m.task,
                        Message::CheckpointAbort(m) => m.task,
                        other => {
                            return Err(self.fail(format!("coordinator sent {}", other.kind())));
                        }
                    };
                    self.send_control(Dest::Task(task), message);
                }
                CoordinatorAction::WriteManifest(request) => {
                    if request.tasks.len() != self.graph.nodes.len() {
                        return Err(self.fail(format!(
                            "manifest of {} lists {} of {} tasks",
                            request.checkpoint,
                            request.tasks.len(),
                            self.graph.nodes.len()
                        )));
                    }
                    for entry in &request.tasks {
                        if !self
                            .snapshots
                            .contains_key(&(entry.task, request.checkpoint))
                        {
                            return Err(self.fail(format!(
                                "manifest of {} lists {} without a durable snapshot",
                                request.checkpoint, entry.task
                            )));
                        }
                    }
                    let outcome = if self.rng.chance(self.faults.manifest_failure) {
                        Err("simulated store failure".to_owned())
                    } else {
                        self.completed.push(request.checkpoint);
                        Ok(self.now.as_micros() / 1000)
                    };
                    self.outcome.events += 1;
                    self.coordinator
                        .handle_manifest_written(self.now, request.checkpoint, outcome);
                }
                CoordinatorAction::Completed(done) => {
                    self.outcome.completed += 1;
                    self.triggered.remove(&done.checkpoint);
                }
                CoordinatorAction::Aborted { checkpoint, .. } => {
                    self.outcome.aborted += 1;
                    self.triggered.remove(&checkpoint);
                }
                CoordinatorAction::FailJob { .. } => self.failover()?,
            }
        }
        Ok(())
    }

    fn fire_timers(&mut self) -> Result<(), Fail> {
        let due: Vec<TaskId> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.machine.poll_timeout().is_some_and(|at| at <= self.now))
            .map(|(id, _)| *id)
            .collect();
        for task in due {
            self.outcome.events += 1;
            if let Some(sim) = self.tasks.get_mut(&task) {
                sim.machine.handle_timeout(self.now);
            }
            self.drain_task(task)?;
        }
        if self
            .coordinator
            .poll_timeout()
            .is_some_and(|at| at <= self.now)
        {
            self.outcome.events += 1;
            self.coordinator.handle_timeout(self.now);
            self.drain_coordinator()?;
        }
        Ok(())
    }

    /// A task crashed (or too many checkpoints failed): restart the whole job from the
    /// newest complete checkpoint.
    fn failover(&mut self) -> Result<(), Fail> {
        self.outcome.failovers += 1;
        let restore = self.completed.last().copied();
        self.log(|| format!("FAILOVER to {restore:?}"));
        self.coordinator
            .handle_failover(self.now)
            .map_err(|e| self.fail(format!("failover refused: {e}")))?;
        self.start_tasks(restore)?;
        self.drain_coordinator()
    }

    // --- checks -----------------------------------------------------------------------

    fn check_deadlines(&self) -> Result<(), Fail> {
        // Resolution may trail the timeout by the tick and the message that reports it.
        let slack = TIMEOUT + Duration::from_millis(2);
        match self
            .triggered
            .iter()
            .find(|(_, at)| **at + slack < self.now)
        {
            Some((id, at)) => Err(self.fail(format!(
                "{id} triggered at {at} neither completed nor aborted"
            ))),
            None => Ok(()),
        }
    }

    fn check_final(&mut self) -> Result<(), Fail> {
        for (sink, expected) in &self.expected.committed {
            let mut got = self.committed.get(sink).cloned().unwrap_or_default();
            got.sort_unstable();
            if &got != expected {
                let dup = got.windows(2).find_map(|w| match w {
                    [a, b] if a == b => Some(*a),
                    _ => None,
                });
                let missing = expected.iter().find(|r| got.binary_search(r).is_err());
                return Err(self.fail(format!(
                    "{sink} committed {} records, expected {} (duplicate {dup:?}, missing {missing:?})",
                    got.len(),
                    expected.len()
                )));
            }
        }
        for (aggregate, expected) in &self.expected.applied {
            let got = self
                .tasks
                .get(aggregate)
                .map(|t| t.applied.clone())
                .unwrap_or_default();
            if &got != expected {
                return Err(self.fail(format!("{aggregate} state {got:?}, expected {expected:?}")));
            }
        }
        self.outcome.virtual_millis = self.now.as_micros() / 1000;
        Ok(())
    }
}
