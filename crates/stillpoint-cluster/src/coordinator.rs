//! The coordinator process of a cluster job: holds the store's lease, carries out
//! the cluster machine's actions over the nodes' connections and runs each
//! generation's checkpoints through the engine's coordinator driver.

use std::collections::BTreeMap;
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use stillpoint::{
    CheckpointRun, CoordinatorInput, Engine, EngineError, FallBack, JobConfig, JobReport,
    KeptLease, Metrics, RestoreChoice, RunOptions, Signals, ToDataflow,
};
use stillpoint_task::{ClusterAction, ClusterCoordinator, NodeReport, Order, RunEnd, Time};
use stillpoint_wire::{
    CheckpointId, EngineMessage, Envelope, FrameDecoder, NodeId, SourceOffset, TaskId,
    read_envelope,
};

use crate::auth::{self, ClusterSecret};
use crate::net::writer_loop;
use crate::{ClusterConfig, accept_loop, finished_at, node_of};

/// What a node's connection brings the coordinator besides its tasks' traffic.
#[derive(Debug)]
enum ClusterEvent {
    /// A node connected; `writer` reaches it.
    Connected {
        node: NodeId,
        connection: u64,
        writer: Sender<Envelope>,
    },
    /// A node's connection broke.
    Lost {
        node: NodeId,
        connection: u64,
        reason: String,
    },
    /// A node's report on its connection `connection`.
    Report {
        node: NodeId,
        connection: u64,
        message: EngineMessage,
    },
}

type Input = CoordinatorInput<ClusterEvent>;

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
    cluster: &ClusterConfig,
    job: &impl ToDataflow,
    mut options: RunOptions,
) -> Result<JobReport, EngineError> {
    cluster.check()?;
    let mut engine = Engine::open(config, job)?;
    // The coordinator reports checkpoints; each node its own tasks' records. Listening
    // first: a taken address fails the run before the store is touched.
    let metrics = Arc::new(Metrics::new(&[]));
    let _served =
        engine.serve_metrics(config.metrics_listen, &metrics, options.on_metrics.take())?;
    let lease = engine.lease()?;
    // A coordinator restarted after it told the nodes to exit: the job is done.
    if let Some(id) = finished_at(&engine)? {
        let report = JobReport {
            restored_from: Some(id),
            ..JobReport::default()
        };
        if let Some(tell) = options.on_start.take() {
            tell(&report);
        }
        engine.release(lease)?;
        return Ok(report);
    }
    let generation = Arc::new(AtomicU64::new(0));
    let (inputs_tx, inputs_rx) = crossbeam_channel::unbounded::<Input>();
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
        engine: &engine,
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
        engine.release(lease)?;
    }
    Ok(report)
}

/// Failovers tolerated in a row without a checkpoint completing in between.
const MAX_FAILOVERS_WITHOUT_PROGRESS: u32 = 20;

/// The coordinator process: carries out the cluster machine's actions over the
/// nodes' connections and the store, and runs the checkpoints of each generation.
struct CoordinatorProcess<'a> {
    engine: &'a Engine,
    /// The job's lease (lent to the coordinator driver while a generation runs).
    lease: Option<KeptLease>,
    epoch: Instant,
    nodes: u32,
    metrics: &'a Arc<Metrics>,
    inputs: (&'a Sender<Input>, &'a Receiver<Input>),
    /// The generation whose task traffic the connection readers let through.
    generation: &'a AtomicU64,
    links: BTreeMap<NodeId, NodeLink>,
    /// The restore chosen for the next generation.
    plan: Option<RestoreChoice>,
    /// The newest generation's token, hex.
    token: (u64, String),
    /// Task traffic of a starting generation (a restored source already finished),
    /// handed to its run.
    early: Vec<Input>,
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
    fn apply(&mut self, machine: &mut ClusterCoordinator, input: Input) {
        match input {
            CoordinatorInput::Process { event, .. } => self.apply_event(machine, event),
            other => self.early.push(other),
        }
    }

    fn apply_event(&mut self, machine: &mut ClusterCoordinator, event: ClusterEvent) {
        let now = self.now();
        match event {
            ClusterEvent::Connected {
                node,
                connection,
                writer,
            } => {
                tracing::info!(%node, "node connected");
                self.links.insert(node, NodeLink { connection, writer });
                machine.handle_connected(now, node, connection);
            }
            ClusterEvent::Lost {
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
            ClusterEvent::Report {
                node,
                connection,
                message,
            } => {
                if let Some(report) = node_report(message) {
                    machine.handle_report(now, node, connection, report);
                }
            }
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
                // Before any node starts: a restore that would publish again what the
                // sinks already published is refused (unless duplicates are allowed);
                // an exact replay up to it where possible.
                match self.engine.choose_restore(&exclude, self.report) {
                    Ok(choice) => {
                        let id = choice.checkpoint;
                        self.plan = Some(choice);
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
                let recorded = self.engine.record_finished();
                let answer = recorded.as_ref().map(|_| ()).map_err(ToString::to_string);
                if let Err(error) = recorded {
                    self.fatal = Some(error);
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
                let bounds = self.plan.as_ref().and_then(RestoreChoice::replay_bounds);
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
        let mut choice = self.plan.clone().unwrap_or_default();
        choice.checkpoint = restore_id;
        self.report.restored_from = restore_id;
        self.report.replayed = choice.replayed();
        if let Some(tell) = self.options.on_start.take() {
            tell(self.report);
        }
        if let Some(id) = restore_id {
            self.metrics.restored(id.get());
        }
        for input in self.early.drain(..) {
            let _sent = self.inputs.0.send(input);
        }
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
        // The sources run on the nodes: a pause of this process reaches them.
        let writers: Vec<Sender<Envelope>> = routes.values().cloned().collect();
        let tell_pause = move |paused| {
            tracing::info!(generation = g, paused, "telling the nodes");
            for node in &writers {
                let pause = EngineMessage::Pause {
                    generation: g,
                    paused,
                };
                let _closed = node.send(Envelope::Engine(pause));
            }
        };
        let ended = self.engine.run_checkpoints(CheckpointRun {
            lease,
            choice: &choice,
            route: Box::new(move |task, message| {
                if let Some(writer) = routes.get(&node_of(task, node_count)) {
                    let _closed = writer.send(Envelope::Wire {
                        generation: g,
                        message,
                    });
                }
            }),
            inputs: self.inputs.1.clone(),
            signals: Arc::new(Signals::default()),
            on_pause: Some(Box::new(tell_pause)),
            metrics: Arc::clone(self.metrics),
            report: self.report,
            options: self.options,
        });
        self.lease = Some(ended.lease);
        // The change of membership that ended the run, for the machine (a node's
        // task failure reached it as the run's end).
        for event in ended.handed_back {
            if !matches!(event, ClusterEvent::Report { .. }) {
                self.apply_event(machine, event);
            }
        }
        Ok(match ended.result {
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
    inputs: &Sender<Input>,
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
    // A node connecting while a generation runs is back from a restart: its old
    // process is gone.
    let _sent = inputs.send(CoordinatorInput::Process {
        event: ClusterEvent::Connected {
            node,
            connection,
            writer,
        },
        ends_run: Some(EngineError::NodeLost(format!("{node} restarted"))),
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
                        let reason = error.to_string();
                        let _sent = inputs.send(CoordinatorInput::Process {
                            ends_run: Some(EngineError::NodeLost(format!("{node}: {reason}"))),
                            event: ClusterEvent::Lost {
                                node,
                                connection,
                                reason,
                            },
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
                    // Node reports go to the cluster machine, which judges their
                    // generation; a task failure ends the running generation too.
                    Envelope::Engine(
                        message @ (EngineMessage::Ready { .. }
                        | EngineMessage::RestoreFailed { .. }
                        | EngineMessage::TaskFailed { .. }
                        | EngineMessage::Finished { .. }),
                    ) => CoordinatorInput::Process {
                        ends_run: match &message {
                            EngineMessage::TaskFailed { task, error, .. } => {
                                Some(EngineError::Failed(format!(
                                    "{}: {error} (on {node})",
                                    TaskId(*task)
                                )))
                            }
                            _ => None,
                        },
                        event: ClusterEvent::Report {
                            node,
                            connection,
                            message,
                        },
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
