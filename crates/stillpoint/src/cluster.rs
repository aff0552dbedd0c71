//! Cluster mode: the word count split across OS processes — one coordinator process
//! and one process per node — over TCP.
//!
//! Every node connects to the coordinator and says who it is. The coordinator, which
//! holds the store's lease, waits for all nodes, picks the checkpoint to restore and
//! starts a *generation*: each node restores its tasks (downloading their snapshots
//! from the store), opens one connection per data edge that leaves it, and reports
//! ready; then checkpoints run as in one process, with protocol messages carried as
//! wire frames. A node whose connection breaks (it crashed, was killed, or its
//! machine went away) ends the generation: the in-flight checkpoint is aborted, every
//! other node tears its tasks down, and once the node is back a new generation
//! restores from the newest complete checkpoint. Messages carry their generation, so
//! nothing from a torn-down generation reaches the next one.

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use stillpoint_backup::{KeptLease, Store, StoreError};
use stillpoint_state::KeyGroups;
use stillpoint_task::{
    ClusterAction, ClusterCoordinator, ClusterNode, NodeAction, NodeReport, Order, RunEnd, Time,
};
use stillpoint_wire::{
    CheckpointId, EngineMessage, Envelope, FrameDecoder, Message, NodeId, SourceOffset,
    SourcePosition, TaskId, read_envelope,
};

use crate::auth::{self, ClusterSecret};
use crate::build::{
    Builder, Restore, Spawned, Topology, Wiring, clear_live_dirs, fetch_restore,
    is_corrupt_checkpoint, join_all, lock_work_dir, snapshots_needed,
};
use crate::coordinator::{CoordinatorDriver, Seen};
use crate::dataflow::{Bounds, RestorePlan};
use crate::job::{
    coordinator_machine, data_channel, gc_backoff, highest_checkpoint, open_leased_store, runtime,
};
use crate::metrics::{Metrics, Served};
use crate::net::{EdgeEnd, connect_retrying, edge_receiver, edge_sender, writer_loop};
use crate::transport::{ControlMap, CoordinatorInput, Links, Signals};
use crate::{Dataflow, EngineError, FallBack, JobConfig, JobReport, RunOptions, ToDataflow};

/// Where the processes of a cluster job listen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// The coordinator's address; nodes connect to it.
    pub coordinator: SocketAddr,
    /// Node `i + 1` listens at `nodes[i]` for the edge connections of other nodes.
    pub nodes: Vec<SocketAddr>,
    /// How long a node keeps trying to reach the coordinator or a peer (default 60 s).
    pub connect_timeout: Duration,
    /// Node `i + 1` serves its tasks' Prometheus metrics at `node_metrics[i]` (empty:
    /// none; the coordinator serves the checkpoints' at `JobConfig::metrics_listen`).
    pub node_metrics: Vec<SocketAddr>,
    /// What every process of the cluster knows and proves on every connection.
    pub secret: ClusterSecret,
}

impl ClusterConfig {
    /// Where node `node` serves its metrics, if anywhere.
    fn node_metrics_address(&self, node: NodeId) -> Result<Option<SocketAddr>, EngineError> {
        if self.node_metrics.is_empty() {
            return Ok(None);
        }
        if self.node_metrics.len() != self.nodes.len() {
            return Err(EngineError::Invalid(format!(
                "[metrics] nodes lists {} addresses for {} nodes: one per node, in [cluster] nodes' order",
                self.node_metrics.len(),
                self.nodes.len()
            )));
        }
        self.node_address(node)?;
        Ok(self
            .node_metrics
            .get(node.get().saturating_sub(1) as usize)
            .copied())
    }

    fn node_address(&self, node: NodeId) -> Result<SocketAddr, EngineError> {
        self.nodes
            .get(node.get().saturating_sub(1) as usize)
            .copied()
            .ok_or_else(|| {
                EngineError::Invalid(format!(
                    "{node} is not in the cluster (it has {} nodes)",
                    self.nodes.len()
                ))
            })
    }

    fn node_count(&self) -> u32 {
        u32::try_from(self.nodes.len()).unwrap_or(u32::MAX)
    }
}

fn cluster_of(config: &JobConfig) -> Result<ClusterConfig, EngineError> {
    let cluster = config.cluster.clone().ok_or_else(|| {
        EngineError::Invalid("the job has no [cluster] section: run it in one process".into())
    })?;
    if cluster.nodes.is_empty() {
        return Err(EngineError::Invalid("[cluster] lists no nodes".into()));
    }
    Ok(cluster)
}

fn io_net(what: &str, error: &std::io::Error) -> EngineError {
    EngineError::Net(format!("{what}: {error}"))
}

/// Handshakes in progress at most: a further connection is closed at once.
const MAX_HANDSHAKES: usize = 16;

/// Accepts connections on `listener` until `halt`, handing each to `on_accept` on
/// its own short-lived handshake thread, at most [`MAX_HANDSHAKES`] at a time.
fn accept_loop(
    listener: TcpListener,
    halt: Arc<AtomicBool>,
    on_accept: impl Fn(TcpStream, SocketAddr) + Send + Sync + 'static,
) -> Result<JoinHandle<()>, EngineError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| io_net("listen", &e))?;
    let on_accept = Arc::new(on_accept);
    let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("accept".into())
        .spawn(move || {
            while !halt.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        if busy.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
                            busy.fetch_sub(1, Ordering::SeqCst);
                            tracing::warn!(%peer, "refused a connection: {MAX_HANDSHAKES} handshakes are in progress");
                            continue;
                        }
                        let (on_accept, busy) = (Arc::clone(&on_accept), Arc::clone(&busy));
                        let spawned = std::thread::Builder::new()
                            .name("handshake".into())
                            .spawn(move || {
                                if stream.set_nonblocking(false).is_ok()
                                    && stream.set_nodelay(true).is_ok()
                                {
                                    on_accept(stream, peer);
                                }
                                busy.fetch_sub(1, Ordering::SeqCst);
                            });
                        if spawned.is_err() {
                            tracing::warn!(%peer, "refused a connection: no thread for its handshake");
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
        .map_err(|e| EngineError::io("spawn", "accept thread", &e))
}

// ---------------------------------------------------------------------------------
// The coordinator process.

/// A node's live connection, as the coordinator sees it.
struct NodeLink {
    connection: u64,
    writer: Sender<Envelope>,
}

/// Runs the coordinator of a cluster job: waits for every node, drives the
/// generations and their checkpoints, fails over when a node is lost, and returns
/// once the job is done (its bounded input consumed and covered by a checkpoint, or
/// `options.stop` pulled and a final checkpoint taken) and every node has finished.
pub fn run_coordinator(
    config: &JobConfig,
    job: &impl ToDataflow,
    mut options: RunOptions,
) -> Result<JobReport, EngineError> {
    let flow = job.to_dataflow()?;
    flow.check()?;
    let cluster = cluster_of(config)?;
    let runtime = runtime()?;
    let (store, lease) = open_leased_store(&runtime, config)?;
    // A coordinator restarted after it told the nodes to exit: the job is done.
    if let Some(id) = already_finished(&runtime, &store)? {
        let report = JobReport {
            restored_from: Some(id),
            ..JobReport::default()
        };
        if let Some(tell) = options.on_start.take() {
            tell(&report);
        }
        runtime.block_on(lease.release())?;
        return Ok(report);
    }
    let topology = Topology::of(&flow);
    // The coordinator reports checkpoints; each node its own tasks' records.
    let metrics = Arc::new(Metrics::new(&[]));
    let served = config
        .metrics_listen
        .map(|listen| Served::start(listen, Arc::clone(&metrics)))
        .transpose()?;
    if let (Some(served), Some(tell)) = (&served, options.on_metrics.take()) {
        tell(served.address);
    }
    let generation = Arc::new(AtomicU64::new(0));
    let (inputs_tx, inputs_rx) = crossbeam_channel::unbounded::<CoordinatorInput>();
    let listener = TcpListener::bind(cluster.coordinator)
        .map_err(|e| EngineError::io("listen on", cluster.coordinator.to_string(), &e))?;
    let halt = Arc::new(AtomicBool::new(false));
    let connections = Arc::new(AtomicU64::new(0));
    let acceptor = {
        let (inputs, generation, connections) = (
            inputs_tx.clone(),
            Arc::clone(&generation),
            Arc::clone(&connections),
        );
        let (secret, nodes) = (cluster.secret.clone(), cluster.node_count());
        accept_loop(listener, Arc::clone(&halt), move |stream, peer| {
            accept_node(
                stream,
                peer,
                (&secret, nodes),
                &inputs,
                &generation,
                &connections,
            );
        })?
    };
    tracing::info!(address = %cluster.coordinator, nodes = cluster.nodes.len(), "coordinator listening");

    let mut report = JobReport::default();
    let mut machine = ClusterCoordinator::new(stillpoint_task::ClusterConfig {
        nodes: cluster.node_count(),
        start_timeout: cluster.connect_timeout * 2,
        exit_timeout: Duration::from_secs(60),
        max_failovers_without_progress: MAX_FAILOVERS_WITHOUT_PROGRESS,
    })
    .map_err(|e| EngineError::Invalid(e.to_string()))?;
    let mut process = CoordinatorProcess {
        config,
        flow: &flow,
        topology: &topology,
        runtime: &runtime,
        store: &store,
        lease: Some(lease),
        epoch: Instant::now(),
        nodes: cluster.node_count(),
        metrics: &metrics,
        inputs: (&inputs_tx, &inputs_rx),
        generation: &generation,
        links: BTreeMap::new(),
        plan: None,
        token: (0, String::new()),
        early: Vec::new(),
        fatal: None,
        report: &mut report,
        options: &mut options,
    };
    let outcome = process.drive(&mut machine);
    let lease = process.lease.take();
    halt.store(true, Ordering::SeqCst);
    let _joined = acceptor.join();
    outcome?;
    if let Some(lease) = lease {
        runtime.block_on(lease.release())?;
    }
    Ok(report)
}

/// Failovers tolerated in a row without a checkpoint completing in between.
const MAX_FAILOVERS_WITHOUT_PROGRESS: u32 = 20;

/// The coordinator process: carries out the cluster machine's actions over the
/// nodes' connections and the store, and runs the checkpoints of each generation.
struct CoordinatorProcess<'a> {
    config: &'a JobConfig,
    flow: &'a Dataflow,
    topology: &'a Topology,
    runtime: &'a tokio::runtime::Runtime,
    store: &'a Store,
    /// The job's lease (lent to the coordinator driver while a generation runs).
    lease: Option<KeptLease>,
    epoch: Instant,
    nodes: u32,
    metrics: &'a Arc<Metrics>,
    inputs: (&'a Sender<CoordinatorInput>, &'a Receiver<CoordinatorInput>),
    /// The generation whose task traffic the connection readers let through.
    generation: &'a AtomicU64,
    links: BTreeMap<NodeId, NodeLink>,
    /// The restore chosen for the next generation.
    plan: Option<(Option<CheckpointId>, RestorePlan)>,
    /// The newest generation's token, hex.
    token: (u64, String),
    /// Task traffic of a starting generation (a restored source already finished),
    /// handed to its run.
    early: Vec<CoordinatorInput>,
    /// The error behind a fatal end, kept whole for the caller.
    fatal: Option<EngineError>,
    report: &'a mut JobReport,
    options: &'a mut RunOptions,
}

impl CoordinatorProcess<'_> {
    fn now(&self) -> Time {
        Time::from_duration(self.epoch.elapsed())
    }

    fn drive(&mut self, machine: &mut ClusterCoordinator) -> Result<(), EngineError> {
        let mut logged = Instant::now();
        loop {
            while let Some(action) = machine.poll_action() {
                if let Some(outcome) = self.act(machine, action)? {
                    return outcome;
                }
            }
            if self.options.stop.requested() {
                machine.handle_stop(self.now());
            }
            // The lease's keeper refreshes it; a lease found lost ends the run.
            if let Some(lease) = &self.lease {
                lease.fence().check_held()?;
            }
            let missing = machine.missing();
            if !missing.is_empty() && logged.elapsed() > Duration::from_secs(5) {
                let missing: Vec<String> = missing.iter().map(ToString::to_string).collect();
                tracing::info!(missing = missing.join(", "), "waiting for nodes");
                logged = Instant::now();
            }
            let wait = machine
                .poll_timeout()
                .map_or(Duration::from_millis(100), |t| {
                    t.saturating_since(self.now())
                        .min(Duration::from_millis(100))
                });
            match self.inputs.1.recv_timeout(wait) {
                Ok(input) => self.apply(machine, input),
                Err(RecvTimeoutError::Timeout) => machine.handle_timeout(self.now()),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(EngineError::Stopped("the accept thread".into()));
                }
            }
        }
    }

    /// Hands what a connection brought to the machine.
    fn apply(&mut self, machine: &mut ClusterCoordinator, input: CoordinatorInput) {
        let now = self.now();
        match input {
            CoordinatorInput::Connected {
                node,
                connection,
                writer,
            } => {
                tracing::info!(%node, "node connected");
                self.links.insert(node, NodeLink { connection, writer });
                machine.handle_connected(now, node, connection);
            }
            CoordinatorInput::NodeLost {
                node,
                connection,
                reason,
            } => {
                if self
                    .links
                    .get(&node)
                    .is_some_and(|l| l.connection == connection)
                {
                    tracing::warn!(%node, reason, "node lost");
                    self.links.remove(&node);
                }
                machine.handle_lost(now, node, connection, &reason);
            }
            CoordinatorInput::Node {
                node,
                connection,
                message,
            } => {
                if let Some(report) = node_report(message) {
                    machine.handle_report(now, node, connection, report);
                }
            }
            other => self.early.push(other),
        }
    }

    /// Carries out one action; `Some` once the coordinator is done.
    fn act(
        &mut self,
        machine: &mut ClusterCoordinator,
        action: ClusterAction,
    ) -> Result<Option<Result<(), EngineError>>, EngineError> {
        let now = self.now();
        match action {
            ClusterAction::ChooseRestore { exclude } => {
                let chosen = choose_restore(self.runtime, self.store, &exclude, self.report)
                    .and_then(|id| {
                        // Before any node starts: a restore that would publish again
                        // what the sinks already published is refused (unless
                        // duplicates are allowed); an exact replay up to it where
                        // possible.
                        let plan = self.flow.plan_restore(
                            id,
                            !self.report.fell_back_from.is_empty(),
                            self.config.allow_duplicates,
                            &self.topology.sources,
                        )?;
                        Ok((id, plan))
                    });
                match chosen {
                    Ok((id, plan)) => {
                        self.plan = Some((id, plan));
                        machine.handle_restore_chosen(now, Ok(id));
                    }
                    Err(error) => {
                        machine.handle_restore_chosen(now, Err(error.to_string()));
                        self.fatal = Some(error);
                    }
                }
            }
            ClusterAction::Order { node, order } => self.order(node, order),
            ClusterAction::Run {
                generation,
                checkpoint,
            } => {
                let end = self.run(generation, checkpoint, machine)?;
                machine.handle_run_ended(self.now(), generation, end);
            }
            // The coordinator driver stops by itself on any change of membership.
            ClusterAction::AbortRun { .. } => {}
            ClusterAction::FellBack {
                checkpoint,
                problem,
            } => {
                tracing::warn!(%checkpoint, problem, "checkpoint does not verify; falling back to an older one");
                self.report.fell_back_from.push(FallBack {
                    checkpoint,
                    problem,
                });
            }
            ClusterAction::RecordFinished { .. } => {
                // Recorded before the nodes exit, so a coordinator restarted from here
                // on does not wait for them.
                let recorded = self.runtime.block_on(record_finished(self.store));
                let answer = recorded.as_ref().map(|_| ()).map_err(ToString::to_string);
                if let Err(error) = recorded {
                    self.fatal = Some(error.into());
                }
                machine.handle_finished_recorded(now, answer);
            }
            ClusterAction::Done(outcome) => {
                return Ok(Some(outcome.map_err(|error| {
                    self.fatal.take().unwrap_or_else(|| match error {
                        stillpoint_task::ClusterError::Stopped => EngineError::Stopped(
                            "the coordinator, stopped while waiting for nodes".into(),
                        ),
                        other => EngineError::Failed(other.to_string()),
                    })
                })));
            }
        }
        Ok(None)
    }

    /// Sends an order on the node's current connection.
    fn order(&mut self, node: NodeId, order: Order) {
        let message = match order {
            Order::Start {
                generation,
                checkpoint,
            } => {
                if self.token.0 != generation {
                    // A fresh token per generation: only the nodes told to start it
                    // can open its edges.
                    self.token = (
                        generation,
                        stillpoint_wire::encode_hex(&auth::nonce()[..16]),
                    );
                    self.generation.store(generation, Ordering::SeqCst);
                    self.early.clear();
                    tracing::info!(generation, ?checkpoint, "starting a generation");
                }
                let bounds = self
                    .plan
                    .as_ref()
                    .and_then(|(_, plan)| plan.replay.as_ref())
                    .map(|replay| {
                        replay
                            .bounds
                            .iter()
                            .map(|(task, offset)| SourcePosition {
                                task: *task,
                                offset: offset.clone(),
                            })
                            .collect::<Vec<_>>()
                    });
                EngineMessage::Start {
                    generation,
                    token: self.token.1.clone(),
                    checkpoint: checkpoint.map(CheckpointId::get),
                    replay: bounds,
                }
            }
            Order::Reset { generation } => EngineMessage::Reset { generation },
            Order::Finish { generation } => EngineMessage::Finish { generation },
            Order::Exit => EngineMessage::Exit,
        };
        if let Some(link) = self.links.get(&node) {
            let _closed = link.writer.send(Envelope::Engine(message));
        }
    }

    /// Runs generation `g`'s checkpoints until the job is done or it fails.
    fn run(
        &mut self,
        g: u64,
        restore_id: Option<CheckpointId>,
        machine: &mut ClusterCoordinator,
    ) -> Result<RunEnd, EngineError> {
        let plan = self
            .plan
            .as_ref()
            .map(|(_, plan)| plan.clone())
            .unwrap_or_default();
        self.report.restored_from = restore_id;
        self.report.replayed = plan.replay.as_ref().map(crate::Replayed::from);
        if let Some(tell) = self.options.on_start.take() {
            tell(self.report);
        }
        if let Some(id) = restore_id {
            self.metrics.restored(id.get());
        }
        for input in self.early.drain(..) {
            let _sent = self.inputs.0.send(input);
        }
        let coordinator = match highest_checkpoint(self.runtime, self.store).and_then(|id| {
            let highest_seen = id.max(plan.newest_published.unwrap_or(CheckpointId(0)));
            coordinator_machine(self.config, self.topology, restore_id, highest_seen)
        }) {
            Ok(machine) => machine,
            Err(error) => return Ok(self.fatal(error)),
        };
        let routes: BTreeMap<NodeId, Sender<Envelope>> = self
            .links
            .iter()
            .map(|(node, link)| (*node, link.writer.clone()))
            .collect();
        let node_count = self.nodes;
        let completed_before = self.report.checkpoints.len();
        let Some(lease) = self.lease.take() else {
            return Err(EngineError::Invalid("the lease is gone".into()));
        };
        let (result, stashed) = {
            let mut driver = CoordinatorDriver {
                coordinator,
                store: self.store.clone(),
                lease,
                runtime: self.runtime,
                control: Box::new(move |task, message| {
                    if let Some(writer) = routes.get(&Topology::node_of(task, node_count)) {
                        let _closed = writer.send(Envelope::Wire {
                            generation: g,
                            message,
                        });
                    }
                }),
                inputs: self.inputs.1.clone(),
                signals: Arc::new(Signals::default()),
                epoch: Instant::now(),
                config: self.config,
                flow: self.flow,
                sources: self.topology.sources.clone(),
                stages: self.topology.parallelisms(),
                seen: Seen::replaying(plan.replay.as_ref().map(|r| &r.bounds)),
                backoff: gc_backoff(),
                report: self.report,
                metrics: Arc::clone(self.metrics),
                stop: self.options.stop.clone(),
                on_checkpoint: self.options.on_checkpoint.take(),
            };
            let result = driver.run();
            self.options.on_checkpoint = driver.on_checkpoint.take();
            self.lease = Some(driver.lease);
            (result, std::mem::take(&mut driver.seen.stash))
        };
        // The change of membership that ended the run, for the machine.
        for input in stashed {
            self.apply(machine, input);
        }
        Ok(match result {
            Ok(()) => RunEnd::Done,
            Err(
                error @ (EngineError::NodeLost(_)
                | EngineError::Failed(_)
                | EngineError::Stopped(_)
                | EngineError::Net(_)),
            ) => RunEnd::Failed {
                reason: error.to_string(),
                progress: self.report.checkpoints.len() > completed_before,
            },
            Err(error) => self.fatal(error),
        })
    }

    /// Keeps `error` for the caller; the machine hears why the run cannot go on.
    fn fatal(&mut self, error: EngineError) -> RunEnd {
        let reason = error.to_string();
        self.fatal = Some(error);
        RunEnd::Fatal(reason)
    }
}

/// A node machine's report as the engine message that carries it.
fn engine_message(report: NodeReport) -> EngineMessage {
    match report {
        NodeReport::Ready { generation } => EngineMessage::Ready { generation },
        NodeReport::Finished { generation } => EngineMessage::Finished { generation },
        NodeReport::RestoreFailed {
            generation,
            checkpoint,
            problem,
            corrupt,
        } => EngineMessage::RestoreFailed {
            generation,
            checkpoint: checkpoint.get(),
            problem,
            corrupt,
        },
        NodeReport::TaskFailed {
            generation,
            task,
            error,
        } => EngineMessage::TaskFailed {
            generation,
            task: task.get(),
            error,
        },
    }
}

/// A node's engine message as the cluster machine's report.
fn node_report(message: EngineMessage) -> Option<NodeReport> {
    Some(match message {
        EngineMessage::Ready { generation } => NodeReport::Ready { generation },
        EngineMessage::Finished { generation } => NodeReport::Finished { generation },
        EngineMessage::RestoreFailed {
            generation,
            checkpoint,
            problem,
            corrupt,
        } => NodeReport::RestoreFailed {
            generation,
            checkpoint: CheckpointId(checkpoint),
            problem,
            corrupt,
        },
        EngineMessage::TaskFailed {
            generation,
            task,
            error,
        } => NodeReport::TaskFailed {
            generation,
            task: TaskId(task),
            error,
        },
        _ => return None,
    })
}

/// Handshake of a node connection on the coordinator: its hello, then a writer and a
/// reader thread; the reader turns what the node sends into coordinator inputs,
/// dropping whatever belongs to another generation.
fn accept_node(
    stream: TcpStream,
    peer: SocketAddr,
    (secret, nodes): (&ClusterSecret, u32),
    inputs: &Sender<CoordinatorInput>,
    generation: &Arc<AtomicU64>,
    connections: &AtomicU64,
) {
    let hello = auth::accept(&stream, secret, |hello| match hello {
        EngineMessage::Hello { node, .. } if (1..=nodes).contains(node) => Ok(Vec::new()),
        EngineMessage::Hello { node, .. } => Err(format!(
            "it claims to be node {node}; the cluster has nodes 1 to {nodes}"
        )),
        other => Err(format!("{} is not a node's hello", other.name())),
    });
    let node = match hello {
        Ok(EngineMessage::Hello { node, .. }) => NodeId(node),
        Ok(_) => return,
        Err(error) => {
            tracing::warn!(%peer, %error, "refused a connection to the coordinator");
            return;
        }
    };
    let connection = connections.fetch_add(1, Ordering::SeqCst) + 1;
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let (writer, envelopes) = crossbeam_channel::unbounded();
    let spawned_writer = std::thread::Builder::new()
        .name(format!("to-{node}"))
        .spawn(move || writer_loop(write_half, envelopes, format!("to {node}")));
    if spawned_writer.is_err() {
        return;
    }
    let _sent = inputs.send(CoordinatorInput::Connected {
        node,
        connection,
        writer,
    });
    let inputs = inputs.clone();
    let generation = Arc::clone(generation);
    let _reader = std::thread::Builder::new()
        .name(format!("from-{node}"))
        .spawn(move || {
            let mut input = BufReader::with_capacity(64 * 1024, stream);
            loop {
                let envelope = match read_envelope(&mut input, FrameDecoder::default()) {
                    Ok(envelope) => envelope,
                    Err(error) => {
                        let _sent = inputs.send(CoordinatorInput::NodeLost {
                            node,
                            connection,
                            reason: error.to_string(),
                        });
                        return;
                    }
                };
                let current = generation.load(Ordering::SeqCst);
                let input = match envelope {
                    Envelope::Wire {
                        generation: g,
                        message,
                    } if g == current => CoordinatorInput::Message(message),
                    Envelope::Engine(EngineMessage::SourceFinished {
                        generation: g,
                        task,
                        offset,
                    }) if g == current => match SourceOffset::new(offset) {
                        Ok(offset) => CoordinatorInput::SourceFinished {
                            task: TaskId(task),
                            offset,
                        },
                        Err(error) => CoordinatorInput::TaskFailed {
                            task: TaskId(task),
                            error: error.to_string(),
                        },
                    },
                    Envelope::Engine(EngineMessage::SourceAtBound {
                        generation: g,
                        task,
                    }) if g == current => CoordinatorInput::SourceAtBound { task: TaskId(task) },
                    // Node reports go to the cluster machine (a task failure to the
                    // running generation's driver too), which judges their generation.
                    Envelope::Engine(
                        message @ (EngineMessage::Ready { .. }
                        | EngineMessage::RestoreFailed { .. }
                        | EngineMessage::TaskFailed { .. }
                        | EngineMessage::Finished { .. }),
                    ) => CoordinatorInput::Node {
                        node,
                        connection,
                        message,
                    },
                    // Anything else belongs to another generation or to nobody.
                    _ => continue,
                };
                if inputs.send(input).is_err() {
                    return;
                }
            }
        });
}

/// Marks the job finished at its newest committed checkpoint (the final one).
async fn record_finished(store: &Store) -> Result<(), StoreError> {
    match store.committed_ids().await?.last() {
        Some(id) => store.mark_finished(*id).await,
        None => Ok(()),
    }
}

/// The checkpoint the job finished at, when that is still the newest committed one
/// (a newer checkpoint means the job was run again since); says so when it is.
fn already_finished(
    runtime: &tokio::runtime::Runtime,
    store: &Store,
) -> Result<Option<CheckpointId>, EngineError> {
    let Some(finished) = runtime.block_on(store.finished())? else {
        return Ok(None);
    };
    let newest = runtime.block_on(store.committed_ids())?.last().copied();
    let done = (newest == Some(finished)).then_some(finished);
    if let Some(id) = done {
        tracing::info!(checkpoint = %id, "the job already finished at this checkpoint (job/finished.json in the store); nothing to do");
    }
    Ok(done)
}

fn choose_restore(
    runtime: &tokio::runtime::Runtime,
    store: &Store,
    bad: &BTreeSet<CheckpointId>,
    report: &mut JobReport,
) -> Result<Option<CheckpointId>, EngineError> {
    let committed = runtime.block_on(store.committed_ids())?;
    for id in committed.iter().copied().rev() {
        if bad.contains(&id) {
            continue;
        }
        let verified =
            runtime.block_on(store.verify(id, stillpoint_backup::VerifyDepth::Presence, &()));
        match verified {
            Ok(verified) if verified.problems.is_empty() => return Ok(Some(id)),
            Ok(verified) => {
                let problem = verified
                    .problems
                    .first()
                    .map(ToString::to_string)
                    .unwrap_or_default();
                tracing::warn!(checkpoint = %id, problem, "checkpoint incomplete; falling back");
                report.fell_back_from.push(FallBack {
                    checkpoint: id,
                    problem,
                });
            }
            Err(error) if error.is_unavailable() => return Err(error.into()),
            Err(error) => {
                report.fell_back_from.push(FallBack {
                    checkpoint: id,
                    problem: error.to_string(),
                });
            }
        }
    }
    EngineError::refuse_fresh_start(committed.len(), &report.fell_back_from)?;
    Ok(None)
}

// ---------------------------------------------------------------------------------
// A node process.

/// What a node's main loop hears.
enum NodeEvent {
    FromCoordinator(Envelope),
    CoordinatorLost(String),
    /// A task of the running generation failed.
    TaskFailed {
        generation: u64,
        task: TaskId,
        error: String,
    },
}

/// One generation's tasks and connections on a node.
struct Generation {
    generation: u64,
    signals: Arc<Signals>,
    spawned: Vec<Spawned>,
    control: ControlMap,
    streams: Vec<TcpStream>,
    threads: Vec<JoinHandle<()>>,
    forwarder: Option<JoinHandle<()>>,
}

impl Generation {
    /// Ends the generation: `graceful` lets the tasks carry out what their control
    /// channels hold (the final commit) before they stop; otherwise they stop where
    /// they are, as in a crash.
    fn end(self, graceful: bool) -> Option<EngineError> {
        if graceful {
            self.signals.stop();
        } else {
            self.signals.crash();
        }
        let error = join_all(self.spawned);
        for stream in &self.streams {
            let _shut = stream.shutdown(std::net::Shutdown::Both);
        }
        for thread in self.threads {
            let _joined = thread.join();
        }
        if let Some(forwarder) = self.forwarder {
            let _joined = forwarder.join();
        }
        error
    }
}

/// Runs node `node` of a cluster job until the coordinator says the job is done.
/// The node's local directories live under `work_dir/node-N`; a lost coordinator is
/// waited for (up to the connect timeout) and the node rejoins it.
pub fn run_node(
    config: &JobConfig,
    job: &impl ToDataflow,
    node: NodeId,
) -> Result<(), EngineError> {
    let flow = job.to_dataflow()?;
    flow.check()?;
    let cluster = cluster_of(config)?;
    let own_address = cluster.node_address(node)?;
    let mut local = config.clone();
    local.store = Some(config.store_uri());
    local.work_dir = config.work_dir.join(format!("node-{}", node.get()));
    let _work_dir = lock_work_dir(&local.work_dir)?;
    let runtime = runtime()?;
    let store = Store::open(&local.store_uri(), local.store_options.clone())?;
    let topology = Topology::of(&flow);
    let groups = KeyGroups::new(local.max_parallelism)?;
    let local_tasks: Vec<TaskId> = topology
        .all()
        .into_iter()
        .filter(|t| Topology::node_of(*t, cluster.node_count()) == node)
        .collect();

    let listener = TcpListener::bind(own_address)
        .map_err(|e| EngineError::io("listen on", own_address.to_string(), &e))?;
    let halt = Arc::new(AtomicBool::new(false));
    let (edges_tx, edges_rx) = crossbeam_channel::unbounded::<(EdgeArrival, TcpStream)>();
    let tokens = Arc::new(GenerationTokens::default());
    let acceptor = {
        let (secret, tokens) = (cluster.secret.clone(), Arc::clone(&tokens));
        let nodes = cluster.node_count();
        accept_loop(listener, Arc::clone(&halt), move |stream, peer| {
            let hello = auth::accept(&stream, &secret, |hello| match hello {
                EngineMessage::EdgeHello {
                    generation,
                    downstream,
                    ..
                } if Topology::node_of(TaskId(*downstream), nodes) == node => {
                    tokens.wait_for(*generation, auth::HANDSHAKE_TIMEOUT)
                }
                EngineMessage::EdgeHello { downstream, .. } => Err(format!(
                    "its edge ends at task {downstream}, which this node does not run"
                )),
                other => Err(format!("{} is not an edge's hello", other.name())),
            });
            match hello {
                Ok(EngineMessage::EdgeHello {
                    generation,
                    upstream,
                    downstream,
                    ..
                }) => {
                    let arrival = EdgeArrival {
                        generation,
                        upstream: TaskId(upstream),
                        downstream: TaskId(downstream),
                    };
                    let _sent = edges_tx.send((arrival, stream));
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(%peer, %error, "refused an edge connection"),
            }
        })?
    };
    let mut node_state = NodeState {
        config: &local,
        flow: &flow,
        cluster: &cluster,
        node,
        topology: &topology,
        groups,
        store: &store,
        runtime: &runtime,
        edges: edges_rx,
        tokens,
        early_edges: Vec::new(),
        metrics: Arc::new(Metrics::for_node(node, &local_tasks)),
        machine: ClusterNode::new(node),
        epoch: Instant::now(),
    };
    let _metrics = cluster
        .node_metrics_address(node)?
        .map(|listen| Served::start(listen, Arc::clone(&node_state.metrics)))
        .transpose()?;
    let outcome = node_state.serve();
    halt.store(true, Ordering::SeqCst);
    let _joined = acceptor.join();
    outcome
}

/// An authenticated edge connection: `upstream → downstream` of `generation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct EdgeArrival {
    generation: u64,
    upstream: TaskId,
    downstream: TaskId,
}

/// The newest generation a node was told to start, with its token: what the edge
/// handshakes of that generation prove they know.
#[derive(Default)]
struct GenerationTokens {
    current: std::sync::Mutex<(u64, Vec<u8>)>,
    changed: std::sync::Condvar,
}

impl GenerationTokens {
    fn set(&self, generation: u64, token: Vec<u8>) {
        if let Ok(mut current) = self.current.lock() {
            *current = (generation, token);
        }
        self.changed.notify_all();
    }

    /// The token of `generation`, waiting up to `timeout` for the coordinator's start
    /// of it to arrive here (an upstream node may have started it a moment sooner).
    fn wait_for(&self, generation: u64, timeout: Duration) -> Result<Vec<u8>, String> {
        let deadline = Instant::now() + timeout;
        let mut current = self
            .current
            .lock()
            .map_err(|_| "a poisoned lock".to_owned())?;
        loop {
            match current.0.cmp(&generation) {
                std::cmp::Ordering::Equal => return Ok(current.1.clone()),
                std::cmp::Ordering::Greater => {
                    return Err(format!(
                        "its generation {generation} is over (this node runs {})",
                        current.0
                    ));
                }
                std::cmp::Ordering::Less => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "this node was not told to start generation {generation} within {timeout:?}"
                ));
            }
            current = self
                .changed
                .wait_timeout(current, left)
                .map_err(|_| "a poisoned lock".to_owned())?
                .0;
        }
    }
}

struct NodeState<'a> {
    config: &'a JobConfig,
    flow: &'a Dataflow,
    cluster: &'a ClusterConfig,
    node: NodeId,
    topology: &'a Topology,
    groups: KeyGroups,
    store: &'a Store,
    runtime: &'a tokio::runtime::Runtime,
    edges: Receiver<(EdgeArrival, TcpStream)>,
    /// The token of the newest generation the coordinator started here.
    tokens: Arc<GenerationTokens>,
    /// Edge connections of a generation this node has not started yet.
    early_edges: Vec<(EdgeArrival, TcpStream)>,
    metrics: Arc<Metrics>,
    /// The node's side of the cluster protocol.
    machine: ClusterNode,
    epoch: Instant,
}

impl NodeState<'_> {
    fn now(&self) -> Time {
        Time::from_duration(self.epoch.elapsed())
    }

    fn serve(&mut self) -> Result<(), EngineError> {
        loop {
            let Some(stream) = self.connect_unless_finished()? else {
                return Ok(());
            };
            let node = self.node.get();
            let claim = auth::node_claim(node);
            let proved = auth::connect(
                &stream,
                &self.cluster.secret,
                &claim,
                &[],
                |nonce, proof| EngineMessage::Hello { node, nonce, proof },
            );
            match proved {
                Ok(()) => {}
                Err(auth::Rejected::Refused(reason)) => {
                    return Err(EngineError::Net(format!(
                        "the coordinator refused node {node}: {reason} (is the cluster secret the same for every process?)"
                    )));
                }
                Err(auth::Rejected::Failed(error)) => {
                    tracing::warn!(node = %self.node, %error, "handshake with the coordinator failed; reconnecting");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            }
            tracing::info!(node = %self.node, coordinator = %self.cluster.coordinator, "connected");
            let (writer, envelopes) = crossbeam_channel::unbounded();
            let write_half = stream.try_clone().map_err(|e| io_net("coordinator", &e))?;
            let writer_thread = std::thread::Builder::new()
                .name("to-coordinator".into())
                .spawn(move || writer_loop(write_half, envelopes, "to the coordinator".into()))
                .map_err(|e| EngineError::io("spawn", "writer thread", &e))?;
            let (events_tx, events) = crossbeam_channel::unbounded();
            let to_self = events_tx.clone();
            let read_half = stream.try_clone().map_err(|e| io_net("coordinator", &e))?;
            let reader_thread = std::thread::Builder::new()
                .name("from-coordinator".into())
                .spawn(move || {
                    let mut input = BufReader::with_capacity(64 * 1024, read_half);
                    loop {
                        match read_envelope(&mut input, FrameDecoder::default()) {
                            Ok(envelope) => {
                                if events_tx
                                    .send(NodeEvent::FromCoordinator(envelope))
                                    .is_err()
                                {
                                    return;
                                }
                            }
                            Err(error) => {
                                let _sent =
                                    events_tx.send(NodeEvent::CoordinatorLost(error.to_string()));
                                return;
                            }
                        }
                    }
                })
                .map_err(|e| EngineError::io("spawn", "reader thread", &e))?;
            let finished = self.follow(&events, (&writer, &to_self));
            // Everything queued for the coordinator is written before the connection
            // closes.
            drop(writer);
            let _joined = writer_thread.join();
            let _shut = stream.shutdown(std::net::Shutdown::Both);
            let _joined = reader_thread.join();
            match finished {
                Ok(true) => return Ok(()),
                Ok(false) => {
                    tracing::warn!(node = %self.node, "coordinator lost; reconnecting");
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Connects to the coordinator, retrying up to the connect timeout; `None` when
    /// the store says the job has finished meanwhile (`job/finished.json` at the
    /// newest checkpoint: every node's final commits are done and the coordinator has
    /// exited or is exiting), so a node restarted after the end — by a supervisor, or
    /// one that lost the coordinator as it exited — ends successfully instead of
    /// waiting for a coordinator that will not come back.
    fn connect_unless_finished(&self) -> Result<Option<TcpStream>, EngineError> {
        let deadline = Instant::now() + self.cluster.connect_timeout;
        let finished = std::cell::Cell::new(None);
        let next_look = std::cell::Cell::new(Instant::now());
        let give_up = || {
            if Instant::now() >= next_look.get() {
                next_look.set(Instant::now() + Duration::from_secs(1));
                match already_finished(self.runtime, self.store) {
                    Ok(id) => finished.set(id),
                    Err(error) => {
                        tracing::debug!(%error, "cannot tell whether the job has finished");
                    }
                }
            }
            finished.get().is_some()
        };
        match connect_retrying(self.cluster.coordinator, deadline, &give_up) {
            Ok(stream) => Ok(Some(stream)),
            Err(error) if finished.get().is_some() => {
                tracing::debug!(node = %self.node, %error, "no coordinator: the job is done");
                Ok(None)
            }
            Err(error) => Err(error),
        }
    }

    /// Follows the coordinator's orders on one connection, through the node's
    /// cluster machine: `Ok(true)` when the job finished, `Ok(false)` when the
    /// coordinator was lost.
    fn follow(
        &mut self,
        events: &Receiver<NodeEvent>,
        (writer, to_self): (&Sender<Envelope>, &Sender<NodeEvent>),
    ) -> Result<bool, EngineError> {
        let mut current: Option<Generation> = None;
        // What the newest start brought besides its generation: replay bounds, token.
        let mut start: Option<(u64, Option<Bounds>, Vec<u8>)> = None;
        let mut events = events.iter();
        loop {
            let now = self.now();
            match events.next() {
                None => self.machine.handle_lost(now),
                Some(NodeEvent::CoordinatorLost(reason)) => {
                    tracing::warn!(reason, "connection to the coordinator lost");
                    self.machine.handle_lost(now);
                }
                Some(NodeEvent::TaskFailed {
                    generation,
                    task,
                    error,
                }) => self
                    .machine
                    .handle_task_failed(now, generation, task, error),
                Some(NodeEvent::FromCoordinator(Envelope::Wire {
                    generation,
                    message,
                })) => {
                    if let Some(live) = current
                        .as_ref()
                        .filter(|c| c.generation == generation && self.machine.accepts(generation))
                        && let Some(channel) =
                            message.recipient().and_then(|t| live.control.get(&t))
                    {
                        let _closed = channel.send(message);
                    }
                }
                Some(NodeEvent::FromCoordinator(Envelope::Engine(message))) => {
                    let order = match message {
                        EngineMessage::Start {
                            generation,
                            token,
                            checkpoint,
                            replay,
                        } => {
                            let Ok(token) = stillpoint_wire::decode_hex(&token) else {
                                tracing::warn!(generation, "a start without a valid token ignored");
                                continue;
                            };
                            self.tokens.set(generation, token.clone());
                            let bounds: Option<Bounds> = replay.map(|bounds| {
                                bounds.into_iter().map(|p| (p.task, p.offset)).collect()
                            });
                            start = Some((generation, bounds, token));
                            Order::Start {
                                generation,
                                checkpoint: checkpoint.map(CheckpointId),
                            }
                        }
                        EngineMessage::Reset { generation } => Order::Reset { generation },
                        EngineMessage::Finish { generation } => Order::Finish { generation },
                        EngineMessage::Exit => Order::Exit,
                        other => {
                            tracing::warn!(?other, "unexpected message from the coordinator");
                            continue;
                        }
                    };
                    self.machine.handle_order(now, order);
                }
            }
            while let Some(action) = self.machine.poll_action() {
                match action {
                    NodeAction::Build {
                        generation,
                        checkpoint,
                    } => {
                        let (bounds, token) = start
                            .take()
                            .filter(|(g, ..)| *g == generation)
                            .map(|(_, bounds, token)| (bounds, token))
                            .unwrap_or_default();
                        let built = self.start(
                            generation,
                            checkpoint,
                            (bounds.as_ref(), &token),
                            (writer, to_self),
                        );
                        let built = built.map(|live| current = Some(live));
                        self.machine.handle_built(self.now(), generation, built);
                    }
                    NodeAction::End {
                        generation,
                        graceful,
                    } => {
                        let Some(live) = current.take_if(|c| c.generation == generation) else {
                            continue;
                        };
                        let error = live.end(graceful);
                        if graceful {
                            if error.is_none() {
                                tracing::info!(node = %self.node, "final commits done");
                            }
                            let ended = error.map_or(Ok(()), |e| Err(e.to_string()));
                            self.machine.handle_ended(self.now(), generation, ended);
                        }
                    }
                    NodeAction::Tell(report) => {
                        let _closed = writer.send(Envelope::Engine(engine_message(report)));
                    }
                    NodeAction::Reconnect => {
                        if let Some(live) = current.take() {
                            live.end(false);
                        }
                        return Ok(false);
                    }
                    NodeAction::Exit => {
                        tracing::info!(node = %self.node, "job finished");
                        return Ok(true);
                    }
                }
            }
        }
    }

    /// Builds generation `g`; what to tell the coordinator when it cannot start.
    fn start(
        &mut self,
        g: u64,
        checkpoint: Option<CheckpointId>,
        (replay, token): (Option<&Bounds>, &[u8]),
        links: (&Sender<Envelope>, &Sender<NodeEvent>),
    ) -> Result<Generation, NodeReport> {
        let local: Vec<TaskId> = self
            .topology
            .all()
            .into_iter()
            .filter(|t| Topology::node_of(*t, self.cluster.node_count()) == self.node)
            .collect();
        let restore = match checkpoint {
            None => None,
            Some(id) => {
                let fetched = self.runtime.block_on(fetch_restore(
                    self.store,
                    &self.config.work_dir,
                    id,
                    |manifest| snapshots_needed(manifest, self.topology, &local, self.groups),
                ));
                match fetched {
                    Ok(restore) => Some(restore),
                    Err(error) => {
                        tracing::warn!(checkpoint = %id, %error, "restore failed");
                        return Err(NodeReport::RestoreFailed {
                            generation: g,
                            checkpoint: id,
                            problem: error.to_string(),
                            corrupt: is_corrupt_checkpoint(&error),
                        });
                    }
                }
            }
        };
        // A rescaled restore settles the old sinks' transactions first; every node
        // does (idempotently) before it reports ready, so before any new checkpoint.
        let settled = match &restore {
            Some(restore) if !restore.same_shape(self.topology) => {
                self.flow.settle_sinks(restore.manifest.checkpoint)
            }
            _ => Ok(()),
        };
        match settled.and_then(|()| self.build(g, &local, (restore.as_ref(), replay, token), links))
        {
            Ok(generation) => {
                tracing::info!(node = %self.node, generation = g, tasks = local.len(), "generation running");
                Ok(generation)
            }
            Err(error) => {
                tracing::warn!(generation = g, %error, "generation could not start");
                Err(NodeReport::TaskFailed {
                    generation: g,
                    task: local.first().copied().unwrap_or(TaskId(0)),
                    error: error.to_string(),
                })
            }
        }
    }

    /// Channels, edge connections and tasks of generation `g` on this node; on an
    /// error whatever was started is torn down again.
    fn build(
        &mut self,
        g: u64,
        local: &[TaskId],
        restore: (Option<&Restore>, Option<&Bounds>, &[u8]),
        links: (&Sender<Envelope>, &Sender<NodeEvent>),
    ) -> Result<Generation, EngineError> {
        let mut generation = Generation {
            generation: g,
            signals: Arc::new(Signals::default()),
            spawned: Vec::new(),
            control: Arc::new(BTreeMap::new()),
            streams: Vec::new(),
            threads: Vec::new(),
            forwarder: None,
        };
        match self.build_into(&mut generation, local, restore, links) {
            Ok(()) => Ok(generation),
            Err(error) => {
                generation.end(false);
                Err(error)
            }
        }
    }

    fn build_into(
        &mut self,
        generation: &mut Generation,
        local: &[TaskId],
        (restore, replay, token): (Option<&Restore>, Option<&Bounds>, &[u8]),
        (writer, to_self): (&Sender<Envelope>, &Sender<NodeEvent>),
    ) -> Result<(), EngineError> {
        let g = generation.generation;
        let signals = Arc::clone(&generation.signals);
        let nodes = self.cluster.node_count();
        let is_local = |t: TaskId| Topology::node_of(t, nodes) == self.node;
        let mut control_rx = BTreeMap::new();
        let mut control_tx = BTreeMap::new();
        for task in local {
            let (tx, rx) = crossbeam_channel::unbounded();
            control_tx.insert(*task, tx);
            control_rx.insert(*task, rx);
        }
        let local_control: ControlMap = Arc::new(control_tx);
        generation.control = Arc::clone(&local_control);
        let mut remote_control: BTreeMap<TaskId, BTreeMap<TaskId, Sender<Message>>> =
            BTreeMap::new();
        let mut inputs: BTreeMap<TaskId, Vec<(TaskId, Receiver<Message>)>> = BTreeMap::new();
        let mut outputs: BTreeMap<TaskId, BTreeMap<TaskId, Sender<Message>>> = BTreeMap::new();
        let mut incoming = BTreeSet::new();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| EngineError::io("spawn", "edge thread", &e))
        };
        for (up, down) in self.topology.edges() {
            match (is_local(up), is_local(down)) {
                (true, true) => {
                    let (tx, rx) = data_channel(self.config);
                    outputs.entry(up).or_default().insert(down, tx);
                    inputs.entry(down).or_default().push((up, rx));
                }
                (true, false) => {
                    let address = self.cluster.node_address(Topology::node_of(down, nodes))?;
                    let deadline = Instant::now() + self.cluster.connect_timeout;
                    let stream = connect_retrying(address, deadline, &|| false)?;
                    let claim = auth::edge_claim(g, up.get(), down.get());
                    auth::connect(
                        &stream,
                        &self.cluster.secret,
                        &claim,
                        token,
                        |nonce, proof| EngineMessage::EdgeHello {
                            generation: g,
                            upstream: up.get(),
                            downstream: down.get(),
                            nonce,
                            proof,
                        },
                    )
                    .map_err(|rejected| match rejected {
                        auth::Rejected::Refused(reason) => EngineError::Net(format!(
                            "the node of {down} refused edge {up}→{down}: {reason}"
                        )),
                        auth::Rejected::Failed(error) => error,
                    })?;
                    let (data_tx, data_rx) = data_channel(self.config);
                    let (ctl_tx, ctl_rx) = crossbeam_channel::unbounded();
                    outputs.entry(up).or_default().insert(down, data_tx);
                    remote_control.entry(up).or_default().insert(down, ctl_tx);
                    let send_half = stream.try_clone().map_err(|e| io_net("edge", &e))?;
                    let read_half = stream.try_clone().map_err(|e| io_net("edge", &e))?;
                    let s = Arc::clone(&signals);
                    generation.threads.push(spawn(
                        format!("edge-{up}-{down}-out"),
                        Box::new(move || edge_sender(send_half, data_rx, ctl_rx, g, s)),
                    )?);
                    let (c, s) = (Arc::clone(&local_control), Arc::clone(&signals));
                    generation.threads.push(spawn(
                        format!("edge-{up}-{down}-in"),
                        Box::new(move || {
                            let end = EdgeEnd {
                                generation: g,
                                upstream: up,
                                downstream: down,
                                downstream_side: false,
                            };
                            edge_receiver(read_half, end, None, c, s);
                        }),
                    )?);
                    generation.streams.push(stream);
                }
                (false, true) => {
                    incoming.insert((up, down));
                }
                (false, false) => {}
            }
        }
        // Incoming edges: opened by the upstreams' nodes.
        let deadline = Instant::now() + self.cluster.connect_timeout;
        let mut pending = std::mem::take(&mut self.early_edges);
        while !incoming.is_empty() {
            let next = match pending.pop() {
                Some(next) => next,
                None => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(EngineError::Net(format!(
                            "{} edge connection(s) did not arrive, e.g. {:?}",
                            incoming.len(),
                            incoming.first()
                        )));
                    }
                    match self
                        .edges
                        .recv_timeout(left.min(Duration::from_millis(200)))
                    {
                        Ok(next) => next,
                        Err(_) => continue,
                    }
                }
            };
            let (arrival, stream) = next;
            if arrival.generation > g {
                self.early_edges.push((arrival, stream));
                continue;
            }
            let (up, down) = (arrival.upstream, arrival.downstream);
            if arrival.generation < g || !incoming.remove(&(up, down)) {
                continue;
            }
            let (data_tx, data_rx) = data_channel(self.config);
            let (ctl_tx, ctl_rx) = crossbeam_channel::unbounded();
            inputs.entry(down).or_default().push((up, data_rx));
            remote_control.entry(down).or_default().insert(up, ctl_tx);
            let send_half = stream.try_clone().map_err(|e| io_net("edge", &e))?;
            let read_half = stream.try_clone().map_err(|e| io_net("edge", &e))?;
            let s = Arc::clone(&signals);
            generation.threads.push(spawn(
                format!("edge-{up}-{down}-ctl"),
                Box::new(move || {
                    edge_sender(send_half, crossbeam_channel::never(), ctl_rx, g, s);
                }),
            )?);
            let (c, s) = (Arc::clone(&local_control), Arc::clone(&signals));
            generation.threads.push(spawn(
                format!("edge-{up}-{down}-data"),
                Box::new(move || {
                    let end = EdgeEnd {
                        generation: g,
                        upstream: up,
                        downstream: down,
                        downstream_side: true,
                    };
                    edge_receiver(read_half, end, Some(data_tx), c, s);
                }),
            )?);
            generation.streams.push(stream);
        }
        // Inputs in the topology's order of upstreams, whichever connected first.
        for list in inputs.values_mut() {
            list.sort_by_key(|(up, _)| *up);
        }

        // What the tasks send the coordinator, tagged with the generation.
        let (coordinator_tx, coordinator_rx) = crossbeam_channel::unbounded::<CoordinatorInput>();
        let (to_coordinator, to_self) = (writer.clone(), to_self.clone());
        let forwarder = std::thread::Builder::new()
            .name("forward".into())
            .spawn(move || {
                for input in coordinator_rx {
                    let envelope = match input {
                        CoordinatorInput::Message(message) => Envelope::Wire {
                            generation: g,
                            message,
                        },
                        CoordinatorInput::SourceFinished { task, offset } => {
                            Envelope::Engine(EngineMessage::SourceFinished {
                                generation: g,
                                task: task.get(),
                                offset: offset.as_bytes().to_vec(),
                            })
                        }
                        CoordinatorInput::SourceAtBound { task } => {
                            Envelope::Engine(EngineMessage::SourceAtBound {
                                generation: g,
                                task: task.get(),
                            })
                        }
                        // A task failure is the node machine's to report.
                        CoordinatorInput::TaskFailed { task, error } => {
                            let _closed = to_self.send(NodeEvent::TaskFailed {
                                generation: g,
                                task,
                                error,
                            });
                            continue;
                        }
                        _ => continue,
                    };
                    if to_coordinator.send(envelope).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| EngineError::io("spawn", "forwarder thread", &e))?;
        generation.forwarder = Some(forwarder);

        clear_live_dirs(&self.config.work_dir)?;
        let builder = Builder {
            config: self.config,
            flow: self.flow,
            topology: self.topology,
            groups: self.groups,
            store: self.store,
            runtime: self.runtime.handle().clone(),
            epoch: Instant::now(),
            node: self.node,
            metrics: &self.metrics,
            restore,
            replay,
        };
        for task in local {
            let mut control: BTreeMap<TaskId, Sender<Message>> = (*local_control).clone();
            control.extend(remote_control.remove(task).unwrap_or_default());
            let Some(control_rx) = control_rx.remove(task) else {
                continue;
            };
            let wiring = Wiring {
                inputs: inputs.remove(task).unwrap_or_default(),
                control: control_rx,
                links: Links {
                    data: outputs.remove(task).unwrap_or_default(),
                    control: Arc::new(control),
                    coordinator: coordinator_tx.clone(),
                    signals: Arc::clone(&signals),
                },
            };
            generation
                .spawned
                .push(builder.spawn(*task, wiring, coordinator_tx.clone())?);
        }
        Ok(())
    }
}
