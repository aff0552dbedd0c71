//! A node process of a cluster job: follows the coordinator's orders through the
//! node's cluster machine, and runs each generation's tasks with the TCP transport
//! (one authenticated connection per data edge that crosses nodes).

use std::io::BufReader;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use stillpoint::{
    Bounds, CoordinatorInput, EdgeData, Engine, EngineError, JobConfig, LocalRestore, Metrics,
    RemoteEdge, TaskStart, Tasks, ToDataflow, Transport, WorkDir,
};
use stillpoint_task::{ClusterNode, NodeAction, NodeReport, Order, Time};
use stillpoint_wire::{
    CheckpointId, EngineMessage, Envelope, FrameDecoder, NodeId, TaskId, read_envelope,
};

use crate::auth;
use crate::net::{EdgeEnd, connect_retrying, edge_receiver, edge_sender, writer_loop};
use crate::{ClusterConfig, accept_loop, finished_at, io_net, node_of};

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

/// One generation's tasks on a node.
struct Generation {
    generation: u64,
    tasks: Tasks,
}

/// Runs node `node` of a cluster job until the coordinator says the job is done.
/// The node's local directories live under `work_dir/node-N`; a lost coordinator is
/// waited for (up to the connect timeout) and the node rejoins it.
pub fn run_node(
    config: &JobConfig,
    cluster: &ClusterConfig,
    job: &impl ToDataflow,
    node: NodeId,
) -> Result<(), EngineError> {
    cluster.check()?;
    let own_address = cluster.node_address(node)?;
    let mut local = config.clone();
    local.store = Some(config.store_uri());
    local.work_dir = config.work_dir.join(format!("node-{}", node.get()));
    let engine = Engine::open(&local, job)?;
    let work_dir = engine.lock_work_dir()?;
    let local_tasks: Vec<TaskId> = engine
        .tasks()
        .into_iter()
        .filter(|t| node_of(*t, cluster.node_count()) == node)
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
                } if node_of(TaskId(*downstream), nodes) == node => {
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
        engine: &engine,
        work_dir: &work_dir,
        cluster,
        node,
        local: local_tasks.clone(),
        edges: edges_rx,
        tokens,
        early_edges: Arc::new(Mutex::new(Vec::new())),
        metrics: Arc::new(Metrics::for_node(node, &local_tasks)),
        machine: ClusterNode::new(node),
        epoch: Instant::now(),
    };
    let _metrics = engine.serve_metrics(
        cluster.node_metrics_address(node)?,
        &node_state.metrics,
        None,
    )?;
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
    engine: &'a Engine,
    work_dir: &'a WorkDir,
    cluster: &'a ClusterConfig,
    node: NodeId,
    /// The tasks this node runs.
    local: Vec<TaskId>,
    edges: Receiver<(EdgeArrival, TcpStream)>,
    /// The token of the newest generation the coordinator started here.
    tokens: Arc<GenerationTokens>,
    /// Edge connections of a generation this node has not started yet.
    early_edges: EarlyEdges,
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
                match finished_at(self.engine) {
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
                    {
                        live.tasks.deliver(message);
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
                        // Not a change of membership: straight to the live tasks.
                        EngineMessage::Pause { generation, paused } => {
                            if let Some(live) =
                                current.as_ref().filter(|c| c.generation == generation)
                            {
                                tracing::info!(node = %self.node, generation, paused, "sources paused or resumed by the coordinator");
                                live.tasks.signals().set_paused(paused);
                            }
                            continue;
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
                        let error = live.tasks.end(graceful);
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
                            live.tasks.end(false);
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
        let restore = match checkpoint {
            None => None,
            Some(id) => match self.engine.fetch_restore(id, &self.local) {
                Ok(restore) => Some(restore),
                Err(error) => {
                    tracing::warn!(checkpoint = %id, %error, "restore failed");
                    return Err(NodeReport::RestoreFailed {
                        generation: g,
                        checkpoint: id,
                        problem: error.to_string(),
                        corrupt: error.is_corrupt_checkpoint(),
                    });
                }
            },
        };
        match self.build(g, restore.as_ref(), (replay, token), links) {
            Ok(tasks) => {
                tracing::info!(node = %self.node, generation = g, tasks = self.local.len(), "generation running");
                Ok(Generation {
                    generation: g,
                    tasks,
                })
            }
            Err(error) => {
                tracing::warn!(generation = g, %error, "generation could not start");
                Err(NodeReport::TaskFailed {
                    generation: g,
                    task: self.local.first().copied().unwrap_or(TaskId(0)),
                    error: error.to_string(),
                })
            }
        }
    }

    /// The tasks of generation `g` on this node, their edges to other nodes carried
    /// by the TCP transport (a rescaled restore settles the old sinks' transactions
    /// first: every node does, idempotently, before it reports ready).
    fn build(
        &mut self,
        g: u64,
        restore: Option<&LocalRestore>,
        (replay, token): (Option<&Bounds>, &[u8]),
        (writer, to_self): (&Sender<Envelope>, &Sender<NodeEvent>),
    ) -> Result<Tasks, EngineError> {
        let transport = TcpTransport::new(
            g,
            token.to_vec(),
            self.cluster.clone(),
            (self.edges.clone(), Arc::clone(&self.early_edges)),
            (writer.clone(), to_self.clone()),
        );
        let start = TaskStart {
            work_dir: self.work_dir,
            tasks: &self.local,
            node: self.node,
            restore,
            replay,
            metrics: &self.metrics,
        };
        self.engine.start_tasks(&start, Box::new(transport))
    }
}

/// Edge connections that arrived for a generation this node has not started yet.
type EarlyEdges = Arc<Mutex<Vec<(EdgeArrival, TcpStream)>>>;

/// The TCP transport of one generation on a node: each data edge to a task on
/// another node is its own authenticated connection, opened by the upstream's node;
/// what the tasks tell the coordinator goes up the node's connection to it, tagged
/// with the generation.
struct TcpTransport {
    generation: u64,
    token: Vec<u8>,
    cluster: ClusterConfig,
    /// Authenticated edge connections as the node's listener hands them over.
    edges: Receiver<(EdgeArrival, TcpStream)>,
    early: EarlyEdges,
    /// Connections of this generation that arrived before their edge was wanted.
    arrived: Vec<(EdgeArrival, TcpStream)>,
    /// When the incoming edges must all be there.
    deadline: Option<Instant>,
    to_coordinator: Sender<Envelope>,
    to_self: Sender<NodeEvent>,
    streams: Vec<TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

impl TcpTransport {
    fn new(
        generation: u64,
        token: Vec<u8>,
        cluster: ClusterConfig,
        (edges, early): (Receiver<(EdgeArrival, TcpStream)>, EarlyEdges),
        (to_coordinator, to_self): (Sender<Envelope>, Sender<NodeEvent>),
    ) -> Self {
        // Connections that came early for this generation are its now; older ones
        // are dropped.
        let mut arrived = Vec::new();
        if let Ok(mut early) = early.lock() {
            for (arrival, stream) in std::mem::take(&mut *early) {
                match arrival.generation.cmp(&generation) {
                    std::cmp::Ordering::Equal => arrived.push((arrival, stream)),
                    std::cmp::Ordering::Greater => early.push((arrival, stream)),
                    std::cmp::Ordering::Less => {}
                }
            }
        }
        Self {
            generation,
            token,
            cluster,
            edges,
            early,
            arrived,
            deadline: None,
            to_coordinator,
            to_self,
            streams: Vec::new(),
            threads: Vec::new(),
        }
    }

    fn spawn(
        &mut self,
        name: String,
        f: impl FnOnce() + Send + 'static,
    ) -> Result<(), EngineError> {
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(f)
            .map_err(|e| EngineError::io("spawn", "edge thread", &e))?;
        self.threads.push(thread);
        Ok(())
    }

    /// Opens the edge `up → down` to the downstream's node and proves the generation.
    fn open(&self, up: TaskId, down: TaskId) -> Result<TcpStream, EngineError> {
        let g = self.generation;
        let address = self
            .cluster
            .node_address(node_of(down, self.cluster.node_count()))?;
        let deadline = Instant::now() + self.cluster.connect_timeout;
        let stream = connect_retrying(address, deadline, &|| false)?;
        let claim = auth::edge_claim(g, up.get(), down.get());
        auth::connect(
            &stream,
            &self.cluster.secret,
            &claim,
            &self.token,
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
        Ok(stream)
    }

    /// Waits for the upstream's node to open edge `up → down` of this generation.
    fn arrival(&mut self, up: TaskId, down: TaskId) -> Result<TcpStream, EngineError> {
        let g = self.generation;
        let wanted = EdgeArrival {
            generation: g,
            upstream: up,
            downstream: down,
        };
        let deadline = *self
            .deadline
            .get_or_insert_with(|| Instant::now() + self.cluster.connect_timeout);
        loop {
            if let Some(at) = self.arrived.iter().position(|(a, _)| *a == wanted) {
                return Ok(self.arrived.swap_remove(at).1);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(EngineError::Net(format!(
                    "edge connection {up}→{down} of generation {g} did not arrive"
                )));
            }
            let Ok((arrival, stream)) = self
                .edges
                .recv_timeout(left.min(Duration::from_millis(200)))
            else {
                continue;
            };
            match arrival.generation.cmp(&g) {
                std::cmp::Ordering::Equal => self.arrived.push((arrival, stream)),
                std::cmp::Ordering::Greater => {
                    if let Ok(mut early) = self.early.lock() {
                        early.push((arrival, stream));
                    }
                }
                std::cmp::Ordering::Less => {}
            }
        }
    }
}

impl Transport for TcpTransport {
    fn connect(&mut self, edge: RemoteEdge) -> Result<(), EngineError> {
        let (g, up, down) = (self.generation, edge.upstream, edge.downstream);
        let downstream_side = matches!(edge.data, EdgeData::Incoming(_));
        let stream = if downstream_side {
            self.arrival(up, down)?
        } else {
            self.open(up, down)?
        };
        let send_half = stream.try_clone().map_err(|e| io_net("edge", &e))?;
        let read_half = stream.try_clone().map_err(|e| io_net("edge", &e))?;
        self.streams.push(stream);
        let end = EdgeEnd {
            generation: g,
            upstream: up,
            downstream: down,
            downstream_side,
        };
        let RemoteEdge {
            data,
            control_out,
            control_in,
            signals,
            ..
        } = edge;
        let (data_out, data_in) = match data {
            EdgeData::Outgoing(out) => (out, None),
            EdgeData::Incoming(into) => (crossbeam_channel::never(), Some(into)),
        };
        let s = Arc::clone(&signals);
        let side = if downstream_side { "in" } else { "out" };
        self.spawn(format!("edge-{up}-{down}-{side}-tx"), move || {
            edge_sender(send_half, data_out, control_out, g, s);
        })?;
        self.spawn(format!("edge-{up}-{down}-{side}-rx"), move || {
            edge_receiver(read_half, end, data_in, control_in, signals);
        })
    }

    fn coordinator(&mut self) -> Result<Sender<CoordinatorInput>, EngineError> {
        let g = self.generation;
        let (tx, rx) = crossbeam_channel::unbounded::<CoordinatorInput>();
        let (to_coordinator, to_self) = (self.to_coordinator.clone(), self.to_self.clone());
        self.spawn("forward".into(), move || {
            for input in rx {
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
                    CoordinatorInput::Process { .. } => continue,
                };
                if to_coordinator.send(envelope).is_err() {
                    return;
                }
            }
        })?;
        Ok(tx)
    }

    fn close(&mut self) {
        for stream in &self.streams {
            let _shut = stream.shutdown(std::net::Shutdown::Both);
        }
        for thread in self.threads.drain(..) {
            let _joined = thread.join();
        }
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
