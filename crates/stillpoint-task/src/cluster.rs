//! The cluster protocol: membership, generations, failover, restore choice and the
//! job's finish, as two sans-IO machines — [`ClusterCoordinator`] in the coordinator
//! process and [`ClusterNode`] in every node process.
//!
//! A *generation* is one attempt at running the whole dataflow: the coordinator waits
//! until every node is connected, asks its driver for the restore point, tells every
//! node to start generation `g` from it, and once every node reported ready it runs
//! checkpoints (the [`crate::Coordinator`] machine, driven by the caller) until the job
//! is done or the generation fails. A lost or restarted node, a failed task or a
//! start that does not finish in time ends the generation: every node is told to
//! reset, and a new generation restores the newest complete checkpoint. A node
//! reporting a corrupt checkpoint makes the next choice skip it.
//!
//! The finish is two-phase: `Finish(g)` lets each node carry out its final commits
//! and say `Finished(g)` — only the incarnation that ran `g` can, a node restarted
//! since says nothing — then the driver records the job finished in the store, and
//! only then are nodes told to exit. A node lost before its final commits makes the
//! coordinator restore the final checkpoint once more, so its sinks publish it.
//!
//! ```
//! use std::time::Duration;
//! use stillpoint_task::{ClusterAction, ClusterConfig, ClusterCoordinator, ClusterNode,
//!     NodeAction, NodeReport, Order, RunEnd, Time};
//! use stillpoint_wire::NodeId;
//!
//! let mut coordinator = ClusterCoordinator::new(ClusterConfig::new(1))?;
//! let mut node = ClusterNode::new(NodeId(1));
//! let now = Time::ZERO;
//! coordinator.handle_connected(now, NodeId(1), 1);
//! assert!(matches!(coordinator.poll_action(), Some(ClusterAction::ChooseRestore { .. })));
//! coordinator.handle_restore_chosen(now, Ok(None));
//! let Some(ClusterAction::Order { order: Order::Start { generation, .. }, .. }) =
//!     coordinator.poll_action() else { panic!() };
//! node.handle_order(now, Order::Start { generation, checkpoint: None });
//! assert_eq!(node.poll_action(), Some(NodeAction::Build { generation, checkpoint: None }));
//! node.handle_built(now, generation, Ok(()));
//! let Some(NodeAction::Tell(report)) = node.poll_action() else { panic!() };
//! coordinator.handle_report(now, NodeId(1), 1, report);
//! assert!(matches!(coordinator.poll_action(), Some(ClusterAction::Run { .. })));
//! // ... checkpoints run until the input is covered ...
//! coordinator.handle_run_ended(now, generation, RunEnd::Done);
//! let Some(ClusterAction::Order { order, .. }) = coordinator.poll_action() else { panic!() };
//! node.handle_order(now, order);
//! assert_eq!(node.poll_action(), Some(NodeAction::End { generation, graceful: true }));
//! node.handle_ended(now, generation, Ok(()));
//! assert_eq!(node.poll_action(), Some(NodeAction::Tell(NodeReport::Finished { generation })));
//! coordinator.handle_report(now, NodeId(1), 1, NodeReport::Finished { generation });
//! assert_eq!(coordinator.poll_action(), Some(ClusterAction::RecordFinished { generation }));
//! coordinator.handle_finished_recorded(now, Ok(()));
//! let Some(ClusterAction::Order { order: Order::Exit, .. }) = coordinator.poll_action()
//!     else { panic!() };
//! node.handle_order(now, Order::Exit);
//! assert_eq!(node.poll_action(), Some(NodeAction::Exit));
//! coordinator.handle_lost(now, NodeId(1), 1, "closed");
//! assert_eq!(coordinator.poll_action(), Some(ClusterAction::Done(Ok(()))));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use stillpoint_wire::{CheckpointId, NodeId, TaskId};

use crate::Time;

/// How the cluster coordinator behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// Nodes `1..=nodes` make up the cluster.
    pub nodes: u32,
    /// How long every node gets to restore and report ready, or to carry out its final
    /// commits, before the attempt is given up and retried (default 120 s).
    pub start_timeout: Duration,
    /// How long the coordinator waits for nodes to close their connections after it
    /// told them to exit (default 60 s).
    pub exit_timeout: Duration,
    /// Failed generations tolerated in a row without a checkpoint completing in
    /// between, before the job fails (default 20).
    pub max_failovers_without_progress: u32,
}

impl ClusterConfig {
    /// A cluster of `nodes` nodes with the default timeouts.
    #[must_use]
    pub fn new(nodes: u32) -> Self {
        Self {
            nodes,
            start_timeout: Duration::from_secs(120),
            exit_timeout: Duration::from_secs(60),
            max_failovers_without_progress: 20,
        }
    }
}

/// Why a cluster configuration or the job failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterError {
    /// The configuration names no nodes.
    NoNodes,
    /// The coordinator was asked to stop before every node had connected.
    Stopped,
    /// A node could not restore for a reason other than a corrupt checkpoint.
    RestoreFailed {
        /// The node.
        node: NodeId,
        /// What it said.
        problem: String,
    },
    /// Generations failed over and over without a checkpoint completing.
    TooManyFailovers {
        /// Failed generations in a row.
        count: u32,
        /// The last one's reason.
        last: String,
    },
    /// The driver failed for good (the restore choice, the store, the lease).
    Fatal(String),
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoNodes => f.write_str("the cluster lists no nodes"),
            Self::Stopped => f.write_str("stopped while waiting for nodes"),
            Self::RestoreFailed { node, problem } => write!(f, "{node}: {problem}"),
            Self::TooManyFailovers { count, last } => write!(
                f,
                "{count} failovers in a row without a completed checkpoint, the last: {last}"
            ),
            Self::Fatal(reason) => f.write_str(reason),
        }
    }
}

impl std::error::Error for ClusterError {}

/// What the coordinator tells a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Order {
    /// Tear down whatever runs and start generation `generation`, restoring
    /// `checkpoint` (none: a fresh start).
    Start {
        /// The generation.
        generation: u64,
        /// The restore point.
        checkpoint: Option<CheckpointId>,
    },
    /// Tear generation `generation` down (it failed elsewhere).
    Reset {
        /// The generation.
        generation: u64,
    },
    /// The job is done: let generation `generation`'s tasks carry out their final
    /// commits, then stop them and say [`NodeReport::Finished`].
    Finish {
        /// The generation.
        generation: u64,
    },
    /// The job is finished and recorded: exit.
    Exit,
}

/// What a node tells the coordinator about a generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeReport {
    /// Its tasks of `generation` are restored, connected and running.
    Ready {
        /// The generation.
        generation: u64,
    },
    /// It could not restore `checkpoint`.
    RestoreFailed {
        /// The generation.
        generation: u64,
        /// The checkpoint.
        checkpoint: CheckpointId,
        /// What went wrong.
        problem: String,
        /// The checkpoint's files are damaged or missing (fall back to an older
        /// one); otherwise the node cannot restore at all.
        corrupt: bool,
    },
    /// A task of `generation` failed (also: the generation could not be built).
    TaskFailed {
        /// The generation.
        generation: u64,
        /// The task.
        task: TaskId,
        /// What went wrong.
        error: String,
    },
    /// Its tasks of `generation` carried out their final commits and stopped.
    Finished {
        /// The generation.
        generation: u64,
    },
}

impl NodeReport {
    /// The generation the report is about.
    #[must_use]
    pub fn generation(&self) -> u64 {
        match self {
            Self::Ready { generation }
            | Self::RestoreFailed { generation, .. }
            | Self::TaskFailed { generation, .. }
            | Self::Finished { generation } => *generation,
        }
    }
}

/// How a running generation ended, as its driver saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// The job is done: its input is covered by a final checkpoint, or a requested
    /// stop got its last checkpoint.
    Done,
    /// The generation failed (a node lost or restarted, a task failed);
    /// `progress`: a checkpoint completed during it.
    Failed {
        /// Why.
        reason: String,
        /// A checkpoint completed during the generation.
        progress: bool,
    },
    /// The driver cannot go on (the lease is lost, the store refuses).
    Fatal(String),
}

/// What the cluster coordinator asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterAction {
    /// Find the restore point: the newest committed checkpoint not in `exclude`
    /// whose files are all present (none: a fresh start), and answer with
    /// [`ClusterCoordinator::handle_restore_chosen`].
    ChooseRestore {
        /// Checkpoints a node found damaged.
        exclude: BTreeSet<CheckpointId>,
    },
    /// Send `order` to `node` on its current connection.
    Order {
        /// The node.
        node: NodeId,
        /// The order.
        order: Order,
    },
    /// Every node runs generation `generation`: run checkpoints until the job is
    /// done or the generation fails, then call
    /// [`ClusterCoordinator::handle_run_ended`].
    Run {
        /// The generation.
        generation: u64,
        /// What it restored.
        checkpoint: Option<CheckpointId>,
    },
    /// A node left while generation `generation` ran: stop running checkpoints (in
    /// flight ones are aborted) and report the end.
    AbortRun {
        /// The generation.
        generation: u64,
        /// Why.
        reason: String,
    },
    /// `checkpoint` could not be restored and is skipped from now on.
    FellBack {
        /// The checkpoint.
        checkpoint: CheckpointId,
        /// Why.
        problem: String,
    },
    /// Every node finished generation `generation`: record the job finished at the
    /// newest committed checkpoint, then call
    /// [`ClusterCoordinator::handle_finished_recorded`].
    RecordFinished {
        /// The generation.
        generation: u64,
    },
    /// The coordinator is done (every node exited or the exit timed out), or the
    /// job failed.
    Done(Result<(), ClusterError>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting until every node is connected.
    Gathering,
    /// Waiting for the driver's restore choice.
    Choosing,
    /// Generation `g` was started; these nodes reported ready.
    Starting {
        generation: u64,
        checkpoint: Option<CheckpointId>,
        ready: BTreeSet<NodeId>,
        deadline: Time,
    },
    /// Generation `g` runs checkpoints; `aborted` once the driver was told to stop.
    Running { generation: u64, aborted: bool },
    /// Generation `g` was told to finish; these nodes did.
    Finishing {
        generation: u64,
        finished: BTreeSet<NodeId>,
        deadline: Time,
    },
    /// Waiting for the driver to record the finish.
    Recording,
    /// Nodes were told to exit.
    Exiting { deadline: Time },
    /// Done.
    Done,
}

/// The coordinator's side of the cluster protocol (see the module docs).
#[derive(Clone, Debug)]
pub struct ClusterCoordinator {
    config: ClusterConfig,
    /// Each connected node's current connection.
    members: BTreeMap<NodeId, u64>,
    phase: Phase,
    generation: u64,
    /// Checkpoints a node found damaged.
    bad: BTreeSet<CheckpointId>,
    failovers_without_progress: u32,
    actions: VecDeque<ClusterAction>,
}

impl ClusterCoordinator {
    /// A coordinator waiting for its nodes.
    pub fn new(config: ClusterConfig) -> Result<Self, ClusterError> {
        if config.nodes == 0 {
            return Err(ClusterError::NoNodes);
        }
        Ok(Self {
            config,
            members: BTreeMap::new(),
            phase: Phase::Gathering,
            generation: 0,
            bad: BTreeSet::new(),
            failovers_without_progress: 0,
            actions: VecDeque::new(),
        })
    }

    /// The newest generation started.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Nodes not connected now.
    #[must_use]
    pub fn missing(&self) -> Vec<NodeId> {
        (1..=self.config.nodes)
            .map(NodeId)
            .filter(|n| !self.members.contains_key(n))
            .collect()
    }

    /// `node`'s current connection, if it is connected.
    #[must_use]
    pub fn connection(&self, node: NodeId) -> Option<u64> {
        self.members.get(&node).copied()
    }

    /// Whether a generation is running checkpoints.
    #[must_use]
    pub fn running(&self) -> Option<u64> {
        match self.phase {
            Phase::Running { generation, .. } => Some(generation),
            _ => None,
        }
    }

    /// The next action, in order.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<ClusterAction> {
        self.actions.pop_front()
    }

    /// When [`ClusterCoordinator::handle_timeout`] must next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        match &self.phase {
            Phase::Starting { deadline, .. }
            | Phase::Finishing { deadline, .. }
            | Phase::Exiting { deadline } => Some(*deadline),
            _ => None,
        }
    }

    /// `node` connected on connection `connection` (ids grow with every
    /// connection). A node connecting anew while a generation starts, runs or
    /// finishes was restarted: its earlier self and its tasks are gone.
    pub fn handle_connected(&mut self, _now: Time, node: NodeId, connection: u64) {
        if node.get() == 0 || node.get() > self.config.nodes || self.phase == Phase::Done {
            return;
        }
        let earlier = self.members.insert(node, connection);
        if let Phase::Exiting { .. } = self.phase {
            // Restarted after the finish was recorded: it has nothing to do.
            self.actions.push_back(ClusterAction::Order {
                node,
                order: Order::Exit,
            });
        } else if earlier.is_some() {
            self.membership_broke(&format!("{node} restarted"));
        } else if matches!(self.phase, Phase::Gathering) {
            self.gather();
        } else {
            self.membership_broke(&format!("{node} reconnected"));
        }
    }

    /// `node`'s connection `connection` broke. The loss of a connection the node has
    /// already replaced changes nothing.
    pub fn handle_lost(&mut self, _now: Time, node: NodeId, connection: u64, reason: &str) {
        if self.members.get(&node) != Some(&connection) {
            return;
        }
        self.members.remove(&node);
        if let Phase::Exiting { .. } = self.phase {
            if self.members.is_empty() {
                self.done(Ok(()));
            }
            return;
        }
        self.membership_broke(&format!("{node} lost: {reason}"));
    }

    /// The coordinator was asked to stop. While nodes are still missing that ends it;
    /// once a generation runs, its driver takes the last checkpoint and reports
    /// [`RunEnd::Done`].
    pub fn handle_stop(&mut self, _now: Time) {
        if matches!(self.phase, Phase::Gathering | Phase::Choosing) {
            self.done(Err(ClusterError::Stopped));
        }
    }

    /// The driver's answer to [`ClusterAction::ChooseRestore`]: the restore point, or
    /// why there is none to be had (the driver cannot go on).
    pub fn handle_restore_chosen(
        &mut self,
        now: Time,
        chosen: Result<Option<CheckpointId>, String>,
    ) {
        if self.phase != Phase::Choosing {
            return;
        }
        let checkpoint = match chosen {
            Ok(checkpoint) => checkpoint,
            Err(reason) => return self.done(Err(ClusterError::Fatal(reason))),
        };
        if !self.missing().is_empty() {
            self.phase = Phase::Gathering;
            return;
        }
        if checkpoint.is_some_and(|id| self.bad.contains(&id)) {
            // A node found it damaged while the driver was choosing: choose again.
            self.gather();
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        self.phase = Phase::Starting {
            generation,
            checkpoint,
            ready: BTreeSet::new(),
            deadline: now + self.config.start_timeout,
        };
        self.order_all(&Order::Start {
            generation,
            checkpoint,
        });
    }

    /// What `node` said on its connection `connection`; a report about another
    /// generation than the current one, or on a connection the node has replaced,
    /// is stale and changes nothing.
    pub fn handle_report(&mut self, _now: Time, node: NodeId, connection: u64, report: NodeReport) {
        let generation = report.generation();
        if self.members.get(&node) != Some(&connection) {
            return;
        }
        // A damaged checkpoint stays damaged: whatever generation the node restored
        // it for, the next choice skips it.
        if let NodeReport::RestoreFailed {
            checkpoint,
            problem,
            corrupt: true,
            ..
        } = &report
            && self.bad.insert(*checkpoint)
        {
            self.actions.push_back(ClusterAction::FellBack {
                checkpoint: *checkpoint,
                problem: format!("{node}: {problem}"),
            });
        }
        if generation != self.generation {
            return;
        }
        match (&mut self.phase, report) {
            (Phase::Starting { ready, .. }, NodeReport::Ready { .. }) => {
                ready.insert(node);
                self.maybe_run();
            }
            (
                Phase::Starting { .. },
                NodeReport::RestoreFailed {
                    checkpoint,
                    problem,
                    corrupt,
                    ..
                },
            ) => {
                if !corrupt {
                    return self.done(Err(ClusterError::RestoreFailed {
                        node,
                        problem: format!("{problem} (restoring {checkpoint})"),
                    }));
                }
                self.reset_all();
                self.gather();
            }
            (Phase::Starting { .. }, NodeReport::TaskFailed { task, error, .. }) => {
                self.retry(&format!("{task} failed: {error}"));
            }
            (Phase::Finishing { finished, .. }, NodeReport::Finished { .. }) => {
                finished.insert(node);
                if finished.len() == self.config.nodes as usize {
                    self.phase = Phase::Recording;
                    self.actions
                        .push_back(ClusterAction::RecordFinished { generation });
                }
            }
            (Phase::Finishing { .. }, NodeReport::TaskFailed { task, error, .. }) => {
                self.final_commits_lost(&format!("{task} failed in its final commits: {error}"));
            }
            _ => {}
        }
    }

    /// How the running generation ended.
    pub fn handle_run_ended(&mut self, now: Time, generation: u64, end: RunEnd) {
        if !matches!(self.phase, Phase::Running { generation: g, .. } if g == generation) {
            return;
        }
        match end {
            RunEnd::Done => {
                self.phase = Phase::Finishing {
                    generation,
                    finished: BTreeSet::new(),
                    deadline: now + self.config.start_timeout,
                };
                self.order_all(&Order::Finish { generation });
            }
            RunEnd::Failed { reason, progress } => {
                if progress {
                    self.failovers_without_progress = 0;
                }
                self.retry(&reason);
            }
            RunEnd::Fatal(reason) => self.done(Err(ClusterError::Fatal(reason))),
        }
    }

    /// The driver recorded the finish (or could not).
    pub fn handle_finished_recorded(&mut self, now: Time, recorded: Result<(), String>) {
        if self.phase != Phase::Recording {
            return;
        }
        if let Err(reason) = recorded {
            return self.done(Err(ClusterError::Fatal(reason)));
        }
        self.phase = Phase::Exiting {
            deadline: now + self.config.exit_timeout,
        };
        self.order_all(&Order::Exit);
        if self.members.is_empty() {
            self.done(Ok(()));
        }
    }

    /// Time passed: a start or finish not done by its deadline is given up, an exit
    /// not acknowledged by its deadline is taken as done.
    pub fn handle_timeout(&mut self, now: Time) {
        match &self.phase {
            Phase::Starting { deadline, .. } if now >= *deadline => {
                self.retry("nodes did not get ready in time");
            }
            Phase::Finishing { deadline, .. } if now >= *deadline => {
                self.final_commits_lost("nodes did not finish in time");
            }
            Phase::Exiting { deadline } if now >= *deadline => self.done(Ok(())),
            _ => {}
        }
    }

    fn membership_broke(&mut self, reason: &str) {
        match &mut self.phase {
            Phase::Gathering | Phase::Done | Phase::Exiting { .. } => {}
            // The choice is answered first; a node missing then sends us back.
            Phase::Choosing => {}
            // The final commits may be done already; the finish is recorded once
            // every node said so, and nodes reconnecting meanwhile change nothing.
            Phase::Recording => {}
            Phase::Starting { .. } => self.retry(reason),
            Phase::Running {
                generation,
                aborted,
            } => {
                if !*aborted {
                    *aborted = true;
                    let generation = *generation;
                    self.actions.push_back(ClusterAction::AbortRun {
                        generation,
                        reason: reason.to_owned(),
                    });
                }
            }
            Phase::Finishing { .. } => self.final_commits_lost(reason),
        }
    }

    /// A node may have gone before its final commits: restore the final checkpoint
    /// once more so its sinks publish what they hold.
    fn final_commits_lost(&mut self, reason: &str) {
        tracing::warn!(
            generation = self.generation,
            reason,
            "final commits not confirmed; restoring the final checkpoint again"
        );
        self.reset_all();
        self.gather();
    }

    /// Gives the current generation up and, within the failover budget, starts
    /// another.
    fn retry(&mut self, reason: &str) {
        self.failovers_without_progress += 1;
        tracing::warn!(generation = self.generation, reason, "failing over");
        if self.failovers_without_progress > self.config.max_failovers_without_progress {
            return self.done(Err(ClusterError::TooManyFailovers {
                count: self.failovers_without_progress,
                last: reason.to_owned(),
            }));
        }
        self.reset_all();
        self.gather();
    }

    /// Back to waiting for nodes; at once to choosing when every node is here.
    fn gather(&mut self) {
        self.phase = Phase::Gathering;
        if self.missing().is_empty() {
            self.phase = Phase::Choosing;
            self.actions.push_back(ClusterAction::ChooseRestore {
                exclude: self.bad.clone(),
            });
        }
    }

    fn maybe_run(&mut self) {
        if let Phase::Starting {
            generation,
            checkpoint,
            ready,
            ..
        } = &self.phase
            && ready.len() == self.config.nodes as usize
        {
            let (generation, checkpoint) = (*generation, *checkpoint);
            self.phase = Phase::Running {
                generation,
                aborted: false,
            };
            self.actions.push_back(ClusterAction::Run {
                generation,
                checkpoint,
            });
        }
    }

    fn reset_all(&mut self) {
        let generation = self.generation;
        self.order_all(&Order::Reset { generation });
    }

    fn order_all(&mut self, order: &Order) {
        for node in self.members.keys() {
            self.actions.push_back(ClusterAction::Order {
                node: *node,
                order: order.clone(),
            });
        }
    }

    fn done(&mut self, outcome: Result<(), ClusterError>) {
        if self.phase != Phase::Done {
            self.phase = Phase::Done;
            self.actions.push_back(ClusterAction::Done(outcome));
        }
    }
}

/// What a node's machine asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeAction {
    /// Restore `checkpoint` (none: fresh) and start this node's tasks of
    /// `generation`, then call [`ClusterNode::handle_built`].
    Build {
        /// The generation.
        generation: u64,
        /// The restore point.
        checkpoint: Option<CheckpointId>,
    },
    /// Stop generation `generation`'s tasks: `graceful` lets them carry out what
    /// they hold (the final commits) and then call [`ClusterNode::handle_ended`];
    /// otherwise they stop where they are, as in a crash.
    End {
        /// The generation.
        generation: u64,
        /// Final commits first.
        graceful: bool,
    },
    /// Send this report to the coordinator.
    Tell(NodeReport),
    /// The connection to the coordinator is gone: connect again.
    Reconnect,
    /// The job is finished: exit successfully.
    Exit,
}

/// A node's side of the cluster protocol: which generation runs here, and what to
/// say about it.
#[derive(Clone, Debug)]
pub struct ClusterNode {
    node: NodeId,
    /// The generation whose tasks run here (built or being built).
    current: Option<u64>,
    /// A graceful end of this generation is in progress.
    finishing: Option<u64>,
    exited: bool,
    actions: VecDeque<NodeAction>,
}

impl ClusterNode {
    /// Node `node`, running nothing.
    #[must_use]
    pub fn new(node: NodeId) -> Self {
        Self {
            node,
            current: None,
            finishing: None,
            exited: false,
            actions: VecDeque::new(),
        }
    }

    /// The node.
    #[must_use]
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The generation whose tasks run here.
    #[must_use]
    pub fn current(&self) -> Option<u64> {
        self.current
    }

    /// Whether a message of `generation` is for the tasks running here; anything of
    /// another generation belongs to a torn-down one or to nobody.
    #[must_use]
    pub fn accepts(&self, generation: u64) -> bool {
        self.current == Some(generation)
    }

    /// The next action, in order.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<NodeAction> {
        self.actions.pop_front()
    }

    /// The connection to the coordinator broke, or its handshake failed: what runs
    /// here is torn down (the coordinator fails the generation over) and the node
    /// connects again.
    pub fn handle_lost(&mut self, _now: Time) {
        if self.exited {
            return;
        }
        self.end_current(false);
        self.actions.push_back(NodeAction::Reconnect);
    }

    /// An order from the coordinator.
    pub fn handle_order(&mut self, _now: Time, order: Order) {
        if self.exited {
            return;
        }
        match order {
            Order::Start {
                generation,
                checkpoint,
            } => {
                self.end_current(false);
                self.current = Some(generation);
                self.actions.push_back(NodeAction::Build {
                    generation,
                    checkpoint,
                });
            }
            Order::Reset { generation } => {
                if self.current == Some(generation) {
                    self.end_current(false);
                }
            }
            Order::Finish { generation } => {
                // Only the incarnation that ran the generation can vouch for its
                // commits; one restarted since says nothing (the coordinator, which
                // saw it reconnect, restores again).
                if self.current == Some(generation) && self.finishing != Some(generation) {
                    self.finishing = Some(generation);
                    self.actions.push_back(NodeAction::End {
                        generation,
                        graceful: true,
                    });
                } else {
                    self.end_current(false);
                }
            }
            Order::Exit => {
                self.end_current(false);
                self.exited = true;
                self.actions.push_back(NodeAction::Exit);
            }
        }
    }

    /// The driver built generation `generation` (or could not: the report says why).
    pub fn handle_built(&mut self, _now: Time, generation: u64, built: Result<(), NodeReport>) {
        if self.current != Some(generation) {
            return;
        }
        match built {
            Ok(()) => self
                .actions
                .push_back(NodeAction::Tell(NodeReport::Ready { generation })),
            Err(report) => {
                self.current = None;
                self.actions.push_back(NodeAction::Tell(report));
            }
        }
    }

    /// A task of the running generation failed.
    pub fn handle_task_failed(&mut self, _now: Time, generation: u64, task: TaskId, error: String) {
        if self.current == Some(generation) {
            self.actions
                .push_back(NodeAction::Tell(NodeReport::TaskFailed {
                    generation,
                    task,
                    error,
                }));
        }
    }

    /// The graceful end of `generation` is over: its final commits are done, or
    /// one failed.
    pub fn handle_ended(&mut self, _now: Time, generation: u64, ended: Result<(), String>) {
        if self.finishing != Some(generation) {
            return;
        }
        self.finishing = None;
        if self.current == Some(generation) {
            self.current = None;
        }
        let report = match ended {
            Ok(()) => NodeReport::Finished { generation },
            Err(error) => NodeReport::TaskFailed {
                generation,
                task: TaskId(0),
                error,
            },
        };
        self.actions.push_back(NodeAction::Tell(report));
    }

    fn end_current(&mut self, graceful: bool) {
        if self.current.is_some() && self.current == self.finishing {
            // Its graceful end is under way; the driver reports when it is over.
            return;
        }
        if let Some(generation) = self.current.take() {
            self.actions.push_back(NodeAction::End {
                generation,
                graceful,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(c: &mut ClusterCoordinator) -> Vec<ClusterAction> {
        std::iter::from_fn(|| c.poll_action()).collect()
    }

    fn started(nodes: u32) -> ClusterCoordinator {
        let mut c = ClusterCoordinator::new(ClusterConfig::new(nodes)).unwrap();
        for n in 1..=nodes {
            c.handle_connected(Time::ZERO, NodeId(n), u64::from(n));
        }
        c.handle_restore_chosen(Time::ZERO, Ok(Some(CheckpointId(4))));
        drain(&mut c);
        c
    }

    #[test]
    fn nothing_starts_until_every_node_is_connected() {
        let mut c = ClusterCoordinator::new(ClusterConfig::new(2)).unwrap();
        c.handle_connected(Time::ZERO, NodeId(1), 1);
        assert!(drain(&mut c).is_empty());
        assert_eq!(c.missing(), vec![NodeId(2)]);
        c.handle_connected(Time::ZERO, NodeId(2), 2);
        assert!(matches!(
            drain(&mut c)[..],
            [ClusterAction::ChooseRestore { .. }]
        ));
    }

    #[test]
    fn a_corrupt_checkpoint_is_excluded_from_the_next_choice() {
        let mut c = started(2);
        let g = c.generation();
        c.handle_report(
            Time::ZERO,
            NodeId(2),
            2,
            NodeReport::RestoreFailed {
                generation: g,
                checkpoint: CheckpointId(4),
                problem: "sha mismatch".into(),
                corrupt: true,
            },
        );
        let actions = drain(&mut c);
        assert!(actions.contains(&ClusterAction::FellBack {
            checkpoint: CheckpointId(4),
            problem: "node-2: sha mismatch".into()
        }));
        assert!(actions.contains(&ClusterAction::ChooseRestore {
            exclude: [CheckpointId(4)].into()
        }));
    }

    #[test]
    fn a_stale_loss_of_a_replaced_connection_changes_nothing() {
        let mut c = started(2);
        c.handle_lost(Time::ZERO, NodeId(1), 99, "old");
        assert!(drain(&mut c).is_empty());
        assert_eq!(c.connection(NodeId(1)), Some(1));
    }

    #[test]
    fn a_node_restarting_while_running_aborts_the_run_once() {
        let mut c = started(1);
        let g = c.generation();
        c.handle_report(
            Time::ZERO,
            NodeId(1),
            1,
            NodeReport::Ready { generation: g },
        );
        assert!(matches!(drain(&mut c)[..], [ClusterAction::Run { .. }]));
        c.handle_connected(Time::ZERO, NodeId(1), 7);
        c.handle_lost(Time::ZERO, NodeId(1), 7, "gone");
        let actions = drain(&mut c);
        assert_eq!(actions.len(), 1, "{actions:?}");
        assert!(matches!(actions[0], ClusterAction::AbortRun { .. }));
    }

    #[test]
    fn failovers_without_progress_are_bounded() {
        let mut config = ClusterConfig::new(1);
        config.max_failovers_without_progress = 2;
        let mut c = ClusterCoordinator::new(config).unwrap();
        c.handle_connected(Time::ZERO, NodeId(1), 1);
        let mut outcome = None;
        for round in 0..10 {
            c.handle_restore_chosen(Time::ZERO, Ok(None));
            let g = c.generation();
            c.handle_report(
                Time::ZERO,
                NodeId(1),
                1,
                NodeReport::TaskFailed {
                    generation: g,
                    task: TaskId(1),
                    error: format!("boom {round}"),
                },
            );
            if let Some(ClusterAction::Done(result)) = drain(&mut c).pop() {
                outcome = Some(result);
                break;
            }
        }
        assert!(matches!(
            outcome,
            Some(Err(ClusterError::TooManyFailovers { count: 3, .. }))
        ));
    }

    #[test]
    fn a_node_restarted_since_says_nothing_on_finish() {
        let mut n = ClusterNode::new(NodeId(1));
        n.handle_order(Time::ZERO, Order::Finish { generation: 3 });
        assert_eq!(n.poll_action(), None);
        n.handle_order(
            Time::ZERO,
            Order::Start {
                generation: 4,
                checkpoint: None,
            },
        );
        n.handle_order(Time::ZERO, Order::Finish { generation: 3 });
        let actions: Vec<_> = std::iter::from_fn(|| n.poll_action()).collect();
        assert_eq!(
            actions,
            vec![
                NodeAction::Build {
                    generation: 4,
                    checkpoint: None
                },
                NodeAction::End {
                    generation: 4,
                    graceful: false
                }
            ]
        );
    }
}
