//! A deterministic simulator of the cluster protocol: one coordinator process running
//! [`ClusterCoordinator`], nodes running [`ClusterNode`], TCP connections between
//! them (in order until they break), and a store.
//!
//! A seeded scheduler moves time in milliseconds. Nodes crash and restart (their
//! connection's loss may reach the coordinator after the new incarnation connected),
//! connections break while both ends live, the coordinator process crashes and a new
//! one takes over, checkpoints turn out corrupt at restore, builds and tasks fail.
//! A running generation completes checkpoints while every node runs it, and the
//! job's input is covered once its sources' offset reaches the input's length.
//!
//! Checked on every run (a failure is a [`ClusterViolation`] naming its seed):
//! - a node starts generations in increasing order on one connection, and runs at
//!   most one generation at a time;
//! - when the coordinator runs generation `g`, every node it reaches runs `g`;
//! - no restore uses a checkpoint a node found corrupt;
//! - the finish is recorded only once every node published its sinks' output up to
//!   the newest committed checkpoint (the final commits of exactly-once sinks);
//! - a node is told to exit, or exits on its own, only after the finish is recorded;
//! - liveness: with no more faults than the failover budget, the coordinator ends
//!   successfully, every node exits, and the final checkpoint covers the whole input
//!   within the simulated time limit.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use stillpoint_wire::{CheckpointId, NodeId, TaskId};

use super::SimRng;
use crate::{
    ClusterAction, ClusterConfig, ClusterCoordinator, ClusterError, ClusterNode, NodeAction,
    NodeReport, Order, RunEnd, Time,
};

/// How hostile the simulated cluster is.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterFaults {
    /// Probability per millisecond that some node crashes (it restarts 20–300 ms later).
    pub node_crash_per_ms: f64,
    /// Probability per millisecond that some node's connection breaks.
    pub disconnect_per_ms: f64,
    /// Probability per millisecond that the coordinator process crashes (a new one
    /// starts 20–300 ms later).
    pub coordinator_crash_per_ms: f64,
    /// Probability per millisecond that a task of a running generation fails.
    pub task_failure_per_ms: f64,
    /// Probability a committed checkpoint is found corrupt when restored.
    pub corrupt: f64,
    /// Probability a node cannot build a generation (a task does not start).
    pub build_failure: f64,
    /// At most this many crashes, breaks and failures per run.
    pub max_faults: u32,
}

impl ClusterFaults {
    /// A perfect world.
    #[must_use]
    pub fn none() -> Self {
        Self {
            node_crash_per_ms: 0.0,
            disconnect_per_ms: 0.0,
            coordinator_crash_per_ms: 0.0,
            task_failure_per_ms: 0.0,
            corrupt: 0.0,
            build_failure: 0.0,
            max_faults: 0,
        }
    }

    /// One of four profiles, picked by the seed: none; broken connections; node
    /// crashes and corrupt checkpoints; everything at once, the coordinator included.
    #[must_use]
    pub fn for_seed(seed: u64) -> Self {
        let none = Self::none();
        match seed % 4 {
            0 => none,
            1 => Self {
                disconnect_per_ms: 0.004,
                max_faults: 4,
                ..none
            },
            2 => Self {
                node_crash_per_ms: 0.004,
                corrupt: 0.1,
                max_faults: 4,
                ..none
            },
            _ => Self {
                node_crash_per_ms: 0.002,
                disconnect_per_ms: 0.002,
                coordinator_crash_per_ms: 0.001,
                task_failure_per_ms: 0.001,
                corrupt: 0.1,
                build_failure: 0.05,
                max_faults: 6,
            },
        }
    }
}

/// One simulated cluster run.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterSimConfig {
    /// The seed: the same seed replays the same run.
    pub seed: u64,
    /// Nodes in the cluster (1–5, picked by the seed unless set).
    pub nodes: u32,
    /// The faults.
    pub faults: ClusterFaults,
    /// Milliseconds of input the sources hold.
    pub input_ms: u64,
    /// A checkpoint every this many milliseconds while a generation runs.
    pub checkpoint_every_ms: u64,
    /// Keep a trace of events for the violation report.
    pub trace: bool,
}

impl ClusterSimConfig {
    /// The run of `seed`: its fault profile, 1–5 nodes.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            nodes: 1 + u32::try_from(SimRng::new(seed ^ 0x5eed).below(5)).unwrap_or(0),
            faults: ClusterFaults::for_seed(seed),
            input_ms: 400,
            checkpoint_every_ms: 50,
            trace: false,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterOutcome {
    /// Simulated events handled.
    pub events: u64,
    /// Generations started (over every coordinator incarnation).
    pub generations: u64,
    /// Checkpoints committed.
    pub checkpoints: u64,
    /// Faults injected.
    pub faults: u32,
    /// Restores that fell back past a corrupt checkpoint.
    pub fell_back: u32,
    /// Simulated milliseconds until every process was done.
    pub elapsed_ms: u64,
    /// The coordinator gave up after more failovers than its budget (allowed only
    /// when more faults than that were injected).
    pub gave_up: bool,
}

/// A broken invariant, with the seed that replays it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterViolation {
    /// The seed.
    pub seed: u64,
    /// Simulated milliseconds.
    pub at_ms: u64,
    /// What went wrong.
    pub what: String,
    /// With [`ClusterSimConfig::trace`]: the events before the violation.
    pub trace: Vec<String>,
}

impl fmt::Display for ClusterViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cluster seed {} at {} ms: {}\n  replay: cargo xtask sim --cluster --seed {}",
            self.seed, self.at_ms, self.what, self.seed
        )?;
        for line in &self.trace {
            write!(f, "\n    {line}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ClusterViolation {}

/// Simulated time after which a run that has not ended is a liveness violation.
const TIME_LIMIT_MS: u64 = 120_000;

/// Runs one cluster simulation.
pub fn run_cluster(config: &ClusterSimConfig) -> Result<ClusterOutcome, ClusterViolation> {
    let mut world = World::new(config);
    match world.run() {
        Ok(()) => Ok(world.outcome),
        Err(what) => Err(ClusterViolation {
            seed: config.seed,
            at_ms: world.now,
            what,
            trace: world.trace,
        }),
    }
}

/// What travels from the coordinator to a node.
#[derive(Clone, Debug)]
enum ToNode {
    Order(Order),
    /// A checkpoint of `generation` completed: the node's sinks publish it.
    Complete {
        generation: u64,
        checkpoint: CheckpointId,
    },
}

#[derive(Clone, Debug)]
enum Event {
    /// A connection's handshake is done on both ends.
    Connected {
        conn: u64,
    },
    ToNode {
        conn: u64,
        message: ToNode,
    },
    ToCoordinator {
        conn: u64,
        report: NodeReport,
    },
    /// The coordinator notices `conn` broke.
    CoordinatorSeesLost {
        conn: u64,
    },
    /// The node notices `conn` broke.
    NodeSeesLost {
        conn: u64,
    },
    /// A node process (re)starts or retries its connection.
    NodeConnects {
        node: NodeId,
        incarnation: u64,
    },
    NodeBuilt {
        node: NodeId,
        incarnation: u64,
        generation: u64,
    },
    NodeEnded {
        node: NodeId,
        incarnation: u64,
        generation: u64,
    },
    CoordinatorStarts,
    RestoreChosen {
        incarnation: u64,
    },
    FinishRecorded {
        incarnation: u64,
    },
}

struct Conn {
    node: NodeId,
    node_incarnation: u64,
    coordinator_incarnation: u64,
    open: bool,
    /// Last delivery time each way (TCP keeps order).
    to_node_at: u64,
    to_coordinator_at: u64,
    /// Highest generation started on this connection.
    started: u64,
}

struct NodeProc {
    incarnation: u64,
    /// `None` while the process is down or after it exited.
    machine: Option<ClusterNode>,
    conn: Option<u64>,
    exited: bool,
    /// The checkpoint the generation being built restores.
    restoring: BTreeMap<u64, Option<CheckpointId>>,
    /// Newest checkpoint whose output this node's sinks published.
    published: CheckpointId,
    /// Completes received per running generation (published at its final commits).
    completes: BTreeMap<u64, CheckpointId>,
}

struct Running {
    generation: u64,
    offset: u64,
    progress: bool,
    /// The offset this run's newest checkpoint covers.
    covered: Option<u64>,
    next_checkpoint_ms: u64,
}

struct CoordinatorProc {
    incarnation: u64,
    machine: Option<ClusterCoordinator>,
    done: Option<Result<(), ClusterError>>,
    running: Option<Running>,
    last_exclude: BTreeSet<CheckpointId>,
    /// Checkpoints a node told this incarnation are corrupt.
    found_corrupt: BTreeSet<CheckpointId>,
}

struct Committed {
    id: CheckpointId,
    offset: u64,
    corrupt: bool,
}

struct World {
    config: ClusterSimConfig,
    rng: SimRng,
    now: u64,
    seq: u64,
    events: BTreeMap<(u64, u64), Event>,
    conns: BTreeMap<u64, Conn>,
    next_conn: u64,
    nodes: BTreeMap<NodeId, NodeProc>,
    coordinator: CoordinatorProc,
    store: Vec<Committed>,
    finished: Option<CheckpointId>,
    faults: u32,
    outcome: ClusterOutcome,
    trace: Vec<String>,
}

impl World {
    fn new(config: &ClusterSimConfig) -> Self {
        let mut world = Self {
            config: config.clone(),
            rng: SimRng::new(config.seed),
            now: 0,
            seq: 0,
            events: BTreeMap::new(),
            conns: BTreeMap::new(),
            next_conn: 1,
            nodes: BTreeMap::new(),
            coordinator: CoordinatorProc {
                incarnation: 0,
                machine: None,
                done: None,
                running: None,
                last_exclude: BTreeSet::new(),
                found_corrupt: BTreeSet::new(),
            },
            store: Vec::new(),
            finished: None,
            faults: 0,
            outcome: ClusterOutcome::default(),
            trace: Vec::new(),
        };
        world.at(0, Event::CoordinatorStarts);
        for n in 1..=config.nodes {
            let node = NodeId(n);
            world.nodes.insert(
                node,
                NodeProc {
                    incarnation: 1,
                    machine: Some(ClusterNode::new(node)),
                    conn: None,
                    exited: false,
                    restoring: BTreeMap::new(),
                    published: CheckpointId(0),
                    completes: BTreeMap::new(),
                },
            );
            let delay = world.rng.below(30);
            world.at(
                delay,
                Event::NodeConnects {
                    node,
                    incarnation: 1,
                },
            );
        }
        world
    }

    fn at(&mut self, delay_ms: u64, event: Event) {
        self.seq += 1;
        self.events.insert((self.now + delay_ms, self.seq), event);
    }

    fn note(&mut self, line: impl FnOnce() -> String) {
        if self.config.trace {
            let line = format!("{:>6} ms {}", self.now, line());
            self.trace.push(line);
        }
    }

    fn time(&self) -> Time {
        Time::from_millis(self.now)
    }

    fn newest(&self) -> Option<&Committed> {
        self.store.last()
    }

    fn all_done(&self) -> bool {
        self.coordinator.done.is_some() && self.nodes.values().all(|n| n.exited)
    }

    fn run(&mut self) -> Result<(), String> {
        while !self.all_done() {
            if self.now > TIME_LIMIT_MS {
                return Err(format!(
                    "not done after {TIME_LIMIT_MS} ms (coordinator done: {:?}, nodes exited: {:?})",
                    self.coordinator.done,
                    self.nodes
                        .iter()
                        .map(|(n, p)| (n.get(), p.exited))
                        .collect::<Vec<_>>()
                ));
            }
            if matches!(self.coordinator.done, Some(Err(_))) {
                break;
            }
            // Everything due now, then the world's tick.
            while let Some((&(at, seq), _)) = self.events.first_key_value() {
                if at > self.now {
                    break;
                }
                let Some(event) = self.events.remove(&(at, seq)) else {
                    break;
                };
                self.outcome.events += 1;
                self.handle(event)?;
            }
            self.tick()?;
            self.now += 1;
        }
        match &self.coordinator.done {
            Some(Ok(())) => {
                let newest = self.newest().map(|c| (c.id, c.offset));
                if self.finished.is_none() || self.finished != newest.map(|n| n.0) {
                    return Err(format!(
                        "the coordinator ended without recording the finish at the newest checkpoint ({:?} vs {newest:?})",
                        self.finished
                    ));
                }
                if newest.map(|n| n.1) != Some(self.config.input_ms) {
                    return Err(format!(
                        "the final checkpoint does not cover the input: {newest:?}"
                    ));
                }
            }
            Some(Err(ClusterError::TooManyFailovers { .. })) if self.faults > self.budget() => {
                self.outcome.gave_up = true;
            }
            other => return Err(format!("the coordinator ended with {other:?}")),
        }
        self.outcome.faults = self.faults;
        self.outcome.elapsed_ms = self.now;
        Ok(())
    }

    fn budget(&self) -> u32 {
        ClusterConfig::new(self.config.nodes).max_failovers_without_progress
    }

    /// Injects faults and moves a running generation on.
    fn tick(&mut self) -> Result<(), String> {
        let faults = self.config.faults.clone();
        let room = self.faults < faults.max_faults;
        if room && self.rng.chance(faults.node_crash_per_ms) {
            let node = self.random_node();
            self.crash_node(node);
        }
        if room && self.rng.chance(faults.disconnect_per_ms) {
            let open: Vec<u64> = self
                .conns
                .iter()
                .filter(|(_, c)| c.open)
                .map(|(id, _)| *id)
                .collect();
            let pick = self.rng.index(open.len());
            if let Some(&conn) = open.get(pick) {
                self.faults += 1;
                self.note(|| format!("connection {conn} breaks"));
                self.break_conn(conn);
            }
        }
        if room
            && self.coordinator.machine.is_some()
            && self.rng.chance(faults.coordinator_crash_per_ms)
        {
            self.faults += 1;
            self.note(|| "the coordinator crashes".to_owned());
            self.coordinator_exits();
            let delay = 20 + self.rng.below(280);
            self.at(delay, Event::CoordinatorStarts);
        }
        if room && self.rng.chance(faults.task_failure_per_ms) {
            let node = self.random_node();
            let now = self.time();
            if let Some(proc_) = self.nodes.get_mut(&node)
                && let Some(machine) = &mut proc_.machine
                && let Some(generation) = machine.current()
            {
                self.faults += 1;
                machine.handle_task_failed(now, generation, TaskId(node.get()), "injected".into());
                self.note(|| format!("{node}: a task of generation {generation} fails"));
                self.node_actions(node)?;
            }
        }
        self.advance_run()
    }

    /// The coordinator process ends (crashed or done): its connections break.
    fn coordinator_exits(&mut self) {
        self.coordinator.machine = None;
        self.coordinator.running = None;
        let incarnation = self.coordinator.incarnation;
        let open: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.open && c.coordinator_incarnation == incarnation)
            .map(|(id, _)| *id)
            .collect();
        for conn in open {
            self.break_conn(conn);
        }
    }

    /// One of the nodes, uniformly.
    fn random_node(&mut self) -> NodeId {
        let index = self.rng.below(u64::from(self.config.nodes));
        NodeId(1 + u32::try_from(index).unwrap_or(0))
    }

    fn crash_node(&mut self, node: NodeId) {
        let Some(proc_) = self.nodes.get_mut(&node) else {
            return;
        };
        if proc_.machine.is_none() || proc_.exited {
            return;
        }
        self.faults += 1;
        proc_.machine = None;
        proc_.incarnation += 1;
        proc_.restoring.clear();
        proc_.completes.clear();
        let incarnation = proc_.incarnation;
        let conn = proc_.conn.take();
        self.note(|| format!("{node} crashes"));
        if let Some(conn) = conn {
            self.break_conn(conn);
        }
        let delay = 20 + self.rng.below(280);
        self.at(delay, Event::NodeConnects { node, incarnation });
    }

    /// Both ends notice a broken connection, each after its own delay: a node may
    /// connect anew before the coordinator notices its old connection is gone.
    fn break_conn(&mut self, conn: u64) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if !c.open {
            return;
        }
        c.open = false;
        let (to_coordinator, to_node) = (c.to_coordinator_at, c.to_node_at);
        let seen_by_coordinator = to_coordinator.saturating_sub(self.now) + 1 + self.rng.below(400);
        let seen_by_node = to_node.saturating_sub(self.now) + 1 + self.rng.below(50);
        self.at(seen_by_coordinator, Event::CoordinatorSeesLost { conn });
        self.at(seen_by_node, Event::NodeSeesLost { conn });
    }

    fn send_to_node(&mut self, node: NodeId, message: ToNode) {
        let delay = 1 + self.rng.below(10);
        let now = self.now;
        // The connection the coordinator knows the node by (its writer).
        let Some(conn) = self
            .coordinator
            .machine
            .as_ref()
            .and_then(|m| m.connection(node))
        else {
            return;
        };
        let Some(c) = self.conns.get_mut(&conn).filter(|c| c.open) else {
            return;
        };
        let at = (now + delay).max(c.to_node_at);
        c.to_node_at = at;
        self.at(at - now, Event::ToNode { conn, message });
    }

    fn send_to_coordinator(&mut self, conn: u64, report: NodeReport) {
        let delay = 1 + self.rng.below(10);
        let now = self.now;
        let Some(c) = self.conns.get_mut(&conn).filter(|c| c.open) else {
            return;
        };
        let at = (now + delay).max(c.to_coordinator_at);
        c.to_coordinator_at = at;
        self.at(at - now, Event::ToCoordinator { conn, report });
    }

    fn handle(&mut self, event: Event) -> Result<(), String> {
        let now = self.time();
        match event {
            Event::CoordinatorStarts => {
                self.coordinator.incarnation += 1;
                self.coordinator.running = None;
                self.coordinator.found_corrupt.clear();
                // A coordinator restarted after the finish was recorded: nothing to do.
                if self.finished.is_some() && self.finished == self.newest().map(|c| c.id) {
                    self.note(|| "a coordinator finds the job finished".to_owned());
                    self.coordinator.done = Some(Ok(()));
                    return Ok(());
                }
                self.note(|| "a coordinator starts".to_owned());
                let machine = ClusterCoordinator::new(ClusterConfig {
                    start_timeout: Duration::from_secs(2),
                    exit_timeout: Duration::from_secs(1),
                    ..ClusterConfig::new(self.config.nodes)
                })
                .map_err(|e| e.to_string())?;
                self.coordinator.machine = Some(machine);
            }
            Event::NodeConnects { node, incarnation } => {
                let finished =
                    self.finished.is_some() && self.finished == self.newest().map(|c| c.id);
                let coordinator_up = self.coordinator.machine.is_some();
                let Some(proc_) = self.nodes.get_mut(&node) else {
                    return Ok(());
                };
                if proc_.incarnation != incarnation || proc_.exited || proc_.conn.is_some() {
                    return Ok(());
                }
                if proc_.machine.is_none() {
                    proc_.machine = Some(ClusterNode::new(node));
                }
                if !coordinator_up {
                    // No coordinator: a node that finds the job finished exits,
                    // otherwise it retries.
                    if finished {
                        proc_.exited = true;
                        proc_.machine = None;
                        self.note(|| format!("{node} finds the job finished and exits"));
                        return self.check_exit(node);
                    }
                    let delay = 50;
                    self.at(delay, Event::NodeConnects { node, incarnation });
                    return Ok(());
                }
                let conn = self.next_conn;
                self.next_conn += 1;
                proc_.conn = Some(conn);
                self.conns.insert(
                    conn,
                    Conn {
                        node,
                        node_incarnation: incarnation,
                        coordinator_incarnation: self.coordinator.incarnation,
                        open: true,
                        to_node_at: self.now,
                        to_coordinator_at: self.now,
                        started: 0,
                    },
                );
                let delay = 1 + self.rng.below(5);
                self.at(delay, Event::Connected { conn });
            }
            Event::Connected { conn } => {
                let Some(c) = self.conns.get(&conn).filter(|c| c.open) else {
                    return Ok(());
                };
                let (node, coordinator_incarnation) = (c.node, c.coordinator_incarnation);
                if coordinator_incarnation != self.coordinator.incarnation {
                    return Ok(());
                }
                self.note(|| format!("{node} connected on {conn}"));
                if let Some(machine) = &mut self.coordinator.machine {
                    machine.handle_connected(now, node, conn);
                }
                self.coordinator_actions()?;
            }
            Event::CoordinatorSeesLost { conn } => {
                let Some(c) = self.conns.get(&conn) else {
                    return Ok(());
                };
                if c.coordinator_incarnation != self.coordinator.incarnation {
                    return Ok(());
                }
                let node = c.node;
                self.note(|| format!("the coordinator sees {node}'s connection {conn} lost"));
                if let Some(machine) = &mut self.coordinator.machine {
                    machine.handle_lost(now, node, conn, "broken");
                }
                self.coordinator_actions()?;
            }
            Event::NodeSeesLost { conn } => {
                let Some(c) = self.conns.get(&conn) else {
                    return Ok(());
                };
                let (node, incarnation) = (c.node, c.node_incarnation);
                if self
                    .nodes
                    .get(&node)
                    .is_none_or(|p| p.incarnation != incarnation || p.conn != Some(conn))
                {
                    return Ok(());
                }
                self.note(|| format!("{node} sees its connection {conn} lost"));
                let Some(proc_) = self.nodes.get_mut(&node) else {
                    return Ok(());
                };
                proc_.conn = None;
                if let Some(machine) = &mut proc_.machine {
                    machine.handle_lost(now);
                }
                self.node_actions(node)?;
            }
            Event::ToNode { conn, message } => {
                let Some(c) = self.conns.get(&conn) else {
                    return Ok(());
                };
                let (node, incarnation, open) = (c.node, c.node_incarnation, c.open);
                if !open {
                    return Ok(());
                }
                let Some(proc_) = self.nodes.get_mut(&node) else {
                    return Ok(());
                };
                if proc_.incarnation != incarnation || proc_.conn != Some(conn) {
                    return Ok(());
                }
                let Some(machine) = &mut proc_.machine else {
                    return Ok(());
                };
                match message {
                    ToNode::Complete {
                        generation,
                        checkpoint,
                    } => {
                        if machine.accepts(generation) {
                            proc_.completes.insert(generation, checkpoint);
                            // Sinks publish on a complete.
                            proc_.published = proc_.published.max(checkpoint);
                        }
                    }
                    ToNode::Order(order) => {
                        if let Order::Start { generation, .. } = &order {
                            let started = self.conns.get(&conn).map_or(0, |c| c.started);
                            if *generation <= started {
                                return Err(format!(
                                    "{node} told to start generation {generation} after {started} on connection {conn}"
                                ));
                            }
                            if let Some(c) = self.conns.get_mut(&conn) {
                                c.started = *generation;
                            }
                        }
                        if matches!(order, Order::Exit) && self.finished.is_none() {
                            return Err(format!(
                                "{node} told to exit before the finish was recorded"
                            ));
                        }
                        self.note(|| format!("{node} gets {order:?}"));
                        if let Some(machine) =
                            self.nodes.get_mut(&node).and_then(|p| p.machine.as_mut())
                        {
                            machine.handle_order(now, order);
                        }
                        self.node_actions(node)?;
                    }
                }
            }
            Event::ToCoordinator { conn, report } => {
                let Some(c) = self.conns.get(&conn) else {
                    return Ok(());
                };
                if c.coordinator_incarnation != self.coordinator.incarnation {
                    return Ok(());
                }
                let node = c.node;
                self.note(|| format!("the coordinator hears {node}: {report:?}"));
                // While a generation runs, its driver takes task failures (and ends the
                // run); other node reports wait for the machine.
                let current = self
                    .coordinator
                    .machine
                    .as_ref()
                    .and_then(|m| m.connection(node))
                    == Some(conn);
                if let (Some(running), NodeReport::TaskFailed { generation, .. }) =
                    (&self.coordinator.running, &report)
                    && running.generation == *generation
                    && current
                {
                    let progress = running.progress;
                    return self.end_run(RunEnd::Failed {
                        reason: format!("{node}: a task failed"),
                        progress,
                    });
                }
                if let NodeReport::RestoreFailed {
                    checkpoint,
                    corrupt: true,
                    ..
                } = &report
                {
                    self.coordinator.found_corrupt.insert(*checkpoint);
                }
                if let Some(machine) = &mut self.coordinator.machine {
                    machine.handle_report(now, node, conn, report);
                }
                self.coordinator_actions()?;
            }
            Event::NodeBuilt {
                node,
                incarnation,
                generation,
            } => {
                let failure = self.rng.chance(self.config.faults.build_failure)
                    && self.faults < self.config.faults.max_faults;
                let Some(proc_) = self.nodes.get_mut(&node) else {
                    return Ok(());
                };
                if proc_.incarnation != incarnation {
                    return Ok(());
                }
                let restoring = proc_.restoring.remove(&generation).flatten();
                let Some(machine) = &mut proc_.machine else {
                    return Ok(());
                };
                let corrupt = restoring
                    .and_then(|id| self.store.iter().find(|c| c.id == id))
                    .is_some_and(|c| c.corrupt);
                let built = if corrupt {
                    Err(NodeReport::RestoreFailed {
                        generation,
                        checkpoint: restoring.unwrap_or(CheckpointId(0)),
                        problem: "a snapshot file does not match its checksum".into(),
                        corrupt: true,
                    })
                } else if failure {
                    self.faults += 1;
                    Err(NodeReport::TaskFailed {
                        generation,
                        task: TaskId(node.get()),
                        error: "a task did not start".into(),
                    })
                } else {
                    // Restored sinks publish what the restored checkpoint holds.
                    if let Some(id) = restoring {
                        proc_.published = proc_.published.max(id);
                    }
                    Ok(())
                };
                machine.handle_built(now, generation, built);
                self.node_actions(node)?;
            }
            Event::NodeEnded {
                node,
                incarnation,
                generation,
            } => {
                let Some(proc_) = self.nodes.get_mut(&node) else {
                    return Ok(());
                };
                if proc_.incarnation != incarnation {
                    return Ok(());
                }
                // The final commits: everything completed in the generation.
                if let Some(id) = proc_.completes.remove(&generation) {
                    proc_.published = proc_.published.max(id);
                }
                if let Some(machine) = &mut proc_.machine {
                    machine.handle_ended(now, generation, Ok(()));
                }
                self.node_actions(node)?;
            }
            Event::RestoreChosen { incarnation } => {
                if incarnation != self.coordinator.incarnation {
                    return Ok(());
                }
                let exclude = self.coordinator.last_exclude.clone();
                let chosen = self
                    .store
                    .iter()
                    .rev()
                    .find(|c| !exclude.contains(&c.id))
                    .map(|c| c.id);
                if let Some(machine) = &mut self.coordinator.machine {
                    let before = machine.generation();
                    machine.handle_restore_chosen(now, Ok(chosen));
                    self.outcome.generations += machine.generation() - before;
                }
                self.coordinator_actions()?;
            }
            Event::FinishRecorded { incarnation } => {
                if incarnation != self.coordinator.incarnation {
                    return Ok(());
                }
                self.finished = self.newest().map(|c| c.id);
                let finished = self.finished;
                self.note(|| format!("finish recorded at {finished:?}"));
                if let Some(machine) = &mut self.coordinator.machine {
                    machine.handle_finished_recorded(now, Ok(()));
                }
                self.coordinator_actions()?;
            }
        }
        Ok(())
    }

    /// A running generation takes checkpoints while every node runs it.
    fn advance_run(&mut self) -> Result<(), String> {
        if let Some(machine) = &mut self.coordinator.machine
            && machine
                .poll_timeout()
                .is_some_and(|t| t <= Time::from_millis(self.now))
        {
            machine.handle_timeout(Time::from_millis(self.now));
            self.coordinator_actions()?;
        }
        let Some(running) = &self.coordinator.running else {
            return Ok(());
        };
        let generation = running.generation;
        let all_run = self.nodes.values().all(|p| {
            p.machine
                .as_ref()
                .is_some_and(|m| m.current() == Some(generation))
                && !p.restoring.contains_key(&generation)
        });
        if !all_run {
            return Ok(());
        }
        let input = self.config.input_ms;
        let every = self.config.checkpoint_every_ms;
        let now = self.now;
        let Some(running) = &mut self.coordinator.running else {
            return Ok(());
        };
        running.offset = (running.offset + 1).min(input);
        if now < running.next_checkpoint_ms && running.offset < input {
            return Ok(());
        }
        running.next_checkpoint_ms = now + every;
        let offset = running.offset;
        if running.covered == Some(input) {
            // This run's final checkpoint covers the input: the job is done.
            return self.end_run(RunEnd::Done);
        }
        let id = CheckpointId(self.store.last().map_or(1, |c| c.id.get() + 1));
        let corrupt = self.rng.chance(self.config.faults.corrupt);
        self.store.push(Committed {
            id,
            offset,
            corrupt,
        });
        self.outcome.checkpoints += 1;
        if let Some(running) = &mut self.coordinator.running {
            running.progress = true;
            running.covered = Some(offset);
        }
        self.note(|| format!("checkpoint {id} at offset {offset} committed"));
        for node in self.nodes.keys().copied().collect::<Vec<_>>() {
            self.send_to_node(
                node,
                ToNode::Complete {
                    generation,
                    checkpoint: id,
                },
            );
        }
        Ok(())
    }

    fn end_run(&mut self, end: RunEnd) -> Result<(), String> {
        let Some(running) = self.coordinator.running.take() else {
            return Ok(());
        };
        self.note(|| format!("generation {} ends: {end:?}", running.generation));
        let now = self.time();
        if let Some(machine) = &mut self.coordinator.machine {
            machine.handle_run_ended(now, running.generation, end);
        }
        self.coordinator_actions()
    }

    fn coordinator_actions(&mut self) -> Result<(), String> {
        loop {
            let Some(action) = self
                .coordinator
                .machine
                .as_mut()
                .and_then(ClusterCoordinator::poll_action)
            else {
                return Ok(());
            };
            self.note(|| format!("coordinator: {action:?}"));
            match action {
                ClusterAction::ChooseRestore { exclude } => {
                    self.coordinator.last_exclude = exclude;
                    let delay = 1 + self.rng.below(20);
                    let incarnation = self.coordinator.incarnation;
                    self.at(delay, Event::RestoreChosen { incarnation });
                }
                ClusterAction::Order { node, order } => {
                    if let Order::Start {
                        generation,
                        checkpoint: Some(checkpoint),
                    } = &order
                        && self.coordinator.found_corrupt.contains(checkpoint)
                    {
                        return Err(format!(
                            "generation {generation} restores {checkpoint}, which a node found corrupt"
                        ));
                    }
                    self.send_to_node(node, ToNode::Order(order));
                }
                ClusterAction::Run {
                    generation,
                    checkpoint,
                } => {
                    self.check_all_run(generation)?;
                    let offset = checkpoint
                        .and_then(|id| self.store.iter().find(|c| c.id == id))
                        .map_or(0, |c| c.offset);
                    self.coordinator.running = Some(Running {
                        generation,
                        offset,
                        progress: false,
                        covered: None,
                        next_checkpoint_ms: self.now + self.config.checkpoint_every_ms,
                    });
                }
                ClusterAction::AbortRun { reason, .. } => {
                    let progress = self
                        .coordinator
                        .running
                        .as_ref()
                        .is_some_and(|r| r.progress);
                    self.end_run(RunEnd::Failed { reason, progress })?;
                }
                ClusterAction::FellBack { .. } => self.outcome.fell_back += 1,
                ClusterAction::RecordFinished { .. } => {
                    let newest = self.newest().map(|c| c.id).unwrap_or(CheckpointId(0));
                    for (node, proc_) in &self.nodes {
                        if proc_.published < newest {
                            return Err(format!(
                                "the finish is recorded at {newest} but {node} published only up to {}",
                                proc_.published
                            ));
                        }
                    }
                    let delay = 1 + self.rng.below(20);
                    let incarnation = self.coordinator.incarnation;
                    self.at(delay, Event::FinishRecorded { incarnation });
                }
                ClusterAction::Done(outcome) => {
                    self.coordinator_exits();
                    self.coordinator.done = Some(outcome);
                    return Ok(());
                }
            }
        }
    }

    /// When the coordinator runs `generation`, every node it still reaches runs it.
    fn check_all_run(&self, generation: u64) -> Result<(), String> {
        let machine = self.coordinator.machine.as_ref();
        for (node, proc_) in &self.nodes {
            let reached = machine
                .and_then(|m| m.connection(*node))
                .is_some_and(|conn| {
                    self.conns.get(&conn).is_some_and(|c| c.open) && proc_.conn == Some(conn)
                });
            let runs = proc_.machine.as_ref().and_then(ClusterNode::current) == Some(generation);
            if reached && !runs {
                return Err(format!(
                    "the coordinator runs generation {generation} but {node} runs {:?}",
                    proc_.machine.as_ref().and_then(ClusterNode::current)
                ));
            }
        }
        Ok(())
    }

    fn check_exit(&self, node: NodeId) -> Result<(), String> {
        let newest = self.newest().map(|c| c.id);
        if self.finished.is_none() || self.finished != newest {
            return Err(format!(
                "{node} exited with the job not finished (finished {:?}, newest {newest:?})",
                self.finished
            ));
        }
        Ok(())
    }

    fn node_actions(&mut self, node: NodeId) -> Result<(), String> {
        loop {
            let Some(proc_) = self.nodes.get_mut(&node) else {
                return Ok(());
            };
            let Some(action) = proc_.machine.as_mut().and_then(ClusterNode::poll_action) else {
                return Ok(());
            };
            let incarnation = proc_.incarnation;
            self.note(|| format!("{node}: {action:?}"));
            let Some(proc_) = self.nodes.get_mut(&node) else {
                return Ok(());
            };
            match action {
                NodeAction::Build {
                    generation,
                    checkpoint,
                } => {
                    if proc_.restoring.keys().any(|g| *g != generation) {
                        return Err(format!(
                            "{node} builds generation {generation} while another is being built"
                        ));
                    }
                    proc_.restoring.insert(generation, checkpoint);
                    let delay = 5 + self.rng.below(60);
                    self.at(
                        delay,
                        Event::NodeBuilt {
                            node,
                            incarnation,
                            generation,
                        },
                    );
                }
                NodeAction::End {
                    generation,
                    graceful,
                } => {
                    proc_.restoring.remove(&generation);
                    if graceful {
                        let delay = 1 + self.rng.below(30);
                        self.at(
                            delay,
                            Event::NodeEnded {
                                node,
                                incarnation,
                                generation,
                            },
                        );
                    } else {
                        proc_.completes.remove(&generation);
                    }
                }
                NodeAction::Tell(report) => {
                    if let Some(conn) = proc_.conn {
                        self.send_to_coordinator(conn, report);
                    }
                }
                NodeAction::Reconnect => {
                    let delay = 10 + self.rng.below(100);
                    self.at(delay, Event::NodeConnects { node, incarnation });
                }
                NodeAction::Exit => {
                    proc_.exited = true;
                    proc_.machine = None;
                    let conn = proc_.conn.take();
                    if let Some(conn) = conn {
                        self.break_conn(conn);
                    }
                    return self.check_exit(node);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_perfect_world_finishes_in_one_generation() {
        let mut config = ClusterSimConfig::new(0);
        config.nodes = 3;
        let outcome = run_cluster(&config).unwrap();
        assert_eq!(outcome.generations, 1, "{outcome:?}");
        assert_eq!(outcome.faults, 0);
        assert!(outcome.checkpoints >= 8, "{outcome:?}");
    }

    #[test]
    fn a_seed_replays_bit_for_bit() {
        for seed in [3, 7, 11] {
            let config = ClusterSimConfig::new(seed);
            assert_eq!(run_cluster(&config), run_cluster(&config));
        }
    }
}
