//! One process's share of a job: [`Engine`] (the job opened here — its dataflow and
//! shape, its store and runtime), the tasks of one generation started through a
//! [`Transport`], and runs of the coordinator driver. The single-process [`crate::run`]
//! and the processes of a cluster (`stillpoint-cluster`) are both built from these.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use stillpoint_backup::{
    KeptLease, Lease, LeaseConfig, LocalRestore, Store, StoreError, SystemClock, VerifyDepth,
    fetch_for_restart,
};
use stillpoint_state::{KeyGroups, WorkDir};
use stillpoint_task::TaskGraph;
use stillpoint_wire::{CheckpointId, Message, NodeId, SourcePosition, TaskId};

use crate::build::{Builder, Spawned, Wiring, join_all};
use stillpoint_task::{Bounds, RestorePlan, RestoreQuestion};

use crate::transport::{ControlMap, CoordinatorInput, Links, MessageSizes, Signals};
use crate::{Dataflow, EngineError, FallBack, JobConfig, JobReport, Replayed, ToDataflow};
use stillpoint_metrics::{Metrics, MetricsServer};

/// A job opened by one process: what every task, restore and coordinator run of
/// this process is built from.
pub struct Engine {
    pub(crate) config: JobConfig,
    pub(crate) flow: Dataflow,
    pub(crate) topology: TaskGraph,
    pub(crate) groups: KeyGroups,
    pub(crate) runtime: tokio::runtime::Runtime,
    pub(crate) store: Store,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("flow", &self.flow)
            .field("store", &self.config.store_uri())
            .finish_non_exhaustive()
    }
}

/// The checkpoint a restore starts from and how it deals with output the sinks
/// published after it.
#[derive(Clone, Debug, Default)]
pub struct RestoreChoice {
    /// The checkpoint (`None`: a fresh start).
    pub checkpoint: Option<CheckpointId>,
    pub(crate) plan: RestorePlan,
}

impl RestoreChoice {
    /// Where each source stops when the restore replays exactly up to published
    /// output (`None`: no replay).
    #[must_use]
    pub fn replay(&self) -> Option<&Bounds> {
        self.plan.replay.as_ref().map(|r| &r.bounds)
    }

    /// What the replay reproduces, for the job's report.
    #[must_use]
    pub fn replayed(&self) -> Option<Replayed> {
        self.plan.replay.as_ref().map(Replayed::from)
    }

    /// [`RestoreChoice::replay`] as the wire's source positions.
    #[must_use]
    pub fn replay_bounds(&self) -> Option<Vec<SourcePosition>> {
        self.plan.replay.as_ref().map(|replay| {
            replay
                .bounds
                .iter()
                .map(|(task, offset)| SourcePosition {
                    task: *task,
                    offset: offset.clone(),
                })
                .collect()
        })
    }
}

impl Engine {
    /// Opens `job` under `config`: its dataflow checked, a runtime started and its
    /// store opened (not yet leased).
    pub fn open(config: &JobConfig, job: &impl ToDataflow) -> Result<Self, EngineError> {
        let flow = job.to_dataflow()?;
        flow.check()?;
        let runtime = runtime()?;
        let store = Store::open(&config.store_uri(), config.store_options.clone())?;
        Ok(Self {
            topology: flow.graph(),
            groups: KeyGroups::new(config.max_parallelism)?,
            config: config.clone(),
            flow,
            runtime,
            store,
        })
    }

    /// The job's configuration.
    #[must_use]
    pub fn config(&self) -> &JobConfig {
        &self.config
    }

    /// Every task of the dataflow, stage by stage.
    #[must_use]
    pub fn tasks(&self) -> Vec<TaskId> {
        self.topology.all()
    }

    /// Locks the work directory for this process (see
    /// [`StateError::WorkDirInUse`](stillpoint_state::StateError::WorkDirInUse)).
    pub fn lock_work_dir(&self) -> Result<WorkDir, EngineError> {
        Ok(WorkDir::lock(&self.config.work_dir)?)
    }

    /// Takes the job's lease, kept fresh by a task on this engine's runtime, and
    /// fences the store with it: once it is lost nothing of this process lands.
    /// Once the lease is lost, or close to lapsing without a refresh (a paused
    /// process), nothing more lands — not even an export thread's upload.
    pub fn lease(&mut self) -> Result<KeptLease, EngineError> {
        let config = LeaseConfig {
            ttl: self.config.lease_ttl,
            settle: Duration::from_millis(50),
            reclaim_own: true,
            ..LeaseConfig::default()
        };
        let lease = self
            .runtime
            .block_on(Lease::acquire_job(
                &self.store,
                config,
                Arc::new(SystemClock),
            ))?
            .keep(self.runtime.handle());
        self.store = self.store.fenced(lease.fence());
        Ok(lease)
    }

    /// Serves `metrics` at `listen`, if set, on this engine's runtime (see
    /// [`MetricsServer`]), and tells `tell` the address it took.
    pub fn serve_metrics(
        &self,
        listen: Option<SocketAddr>,
        metrics: &Arc<Metrics>,
        tell: Option<Box<dyn FnOnce(SocketAddr) + Send>>,
    ) -> Result<Option<MetricsServer>, EngineError> {
        let handle = self.runtime.handle();
        let served = listen.map(|at| MetricsServer::start(at, Arc::clone(metrics), handle));
        let served = served.transpose()?;
        if let (Some(served), Some(tell)) = (&served, tell) {
            tell(served.address);
        }
        Ok(served)
    }

    /// Releases the lease (a successor takes over at once).
    pub fn release(&self, lease: KeptLease) -> Result<(), EngineError> {
        Ok(self.runtime.block_on(lease.release())?)
    }

    /// The checkpoint the job finished at, when that is still the newest committed
    /// one (a newer checkpoint means the job was run again since).
    pub fn finished_at(&self) -> Result<Option<CheckpointId>, EngineError> {
        let Some(finished) = self.runtime.block_on(self.store.finished())? else {
            return Ok(None);
        };
        let newest = self
            .runtime
            .block_on(self.store.committed_ids())?
            .last()
            .copied();
        Ok((newest == Some(finished)).then_some(finished))
    }

    /// Marks the job finished at its newest committed checkpoint (the final one).
    pub fn record_finished(&self) -> Result<(), EngineError> {
        let store = &self.store;
        let recorded = self.runtime.block_on(async {
            match store.committed_ids().await?.last() {
                Some(id) => store.mark_finished(*id).await,
                None => Ok::<(), StoreError>(()),
            }
        });
        Ok(recorded?)
    }

    /// Chooses what to restore: the newest committed checkpoint not in `exclude`
    /// whose files are all present (a newer one that is not is recorded in
    /// `report.fell_back_from`), and how its restore avoids publishing output again.
    /// Committed checkpoints none of which qualifies are an error: a fresh start
    /// would publish the output again.
    pub fn choose_restore(
        &self,
        exclude: &BTreeSet<CheckpointId>,
        report: &mut JobReport,
    ) -> Result<RestoreChoice, EngineError> {
        let found =
            (self.runtime).block_on(self.store.restorable(exclude, VerifyDepth::Presence))?;
        for (checkpoint, problem) in found.rejected {
            report.fell_back_from.push(FallBack {
                checkpoint,
                problem,
            });
        }
        let chosen = found.checkpoint;
        if chosen.is_none() {
            EngineError::refuse_fresh_start(found.committed, &report.fell_back_from)?;
        }
        let plan = self.flow.plan_restore(&RestoreQuestion {
            restored: chosen,
            fell_back: !report.fell_back_from.is_empty(),
            allow: self.config.allow_duplicates,
            sources: self.topology.sources(),
        })?;
        Ok(RestoreChoice {
            checkpoint: chosen,
            plan,
        })
    }

    /// Verifies checkpoint `id` and downloads the snapshots the tasks `local` restore
    /// from into this process's work directory. A failure for which
    /// [`EngineError::is_corrupt_checkpoint`] holds means the checkpoint is bad.
    pub fn fetch_restore(
        &self,
        id: CheckpointId,
        local: &[TaskId],
    ) -> Result<LocalRestore, EngineError> {
        self.runtime.block_on(fetch_for_restart(
            &self.store,
            id,
            &self.config.work_dir.join("restore"),
            |manifest| {
                let max_parallelism = self.groups.max_parallelism();
                Ok::<_, EngineError>(self.topology.snapshots_needed(
                    manifest,
                    local,
                    max_parallelism,
                )?)
            },
        ))
    }

    /// Starts the tasks of one generation that run in this process: a rescaled
    /// restore settles the old sinks' transactions first; then each task's state is
    /// restored or opened, its source positioned and its sink recovered. Edges
    /// between two local tasks are bounded channels; an edge whose other task runs
    /// elsewhere is handed to `transport`, outgoing edges before incoming ones (so
    /// two processes opening each other's edges never wait on each other).
    pub fn start_tasks(
        &self,
        start: &TaskStart<'_>,
        mut transport: Box<dyn Transport>,
    ) -> Result<Tasks, EngineError> {
        let local: BTreeSet<TaskId> = start.tasks.iter().copied().collect();
        if let Some(restore) = start.restore
            && !self.topology.same_shape(&restore.manifest)
        {
            self.flow.settle_sinks(restore.manifest.checkpoint)?;
        }
        start.work_dir.clear_live()?;
        let signals = Arc::new(Signals::default());
        let mut control_rx = BTreeMap::new();
        let mut control_tx = BTreeMap::new();
        for task in &local {
            let (tx, rx) = crossbeam_channel::unbounded();
            control_tx.insert(*task, tx);
            control_rx.insert(*task, rx);
        }
        let local_control: ControlMap = Arc::new(control_tx);
        let mut tasks = Tasks {
            signals: Arc::clone(&signals),
            spawned: Vec::new(),
            control: Arc::clone(&local_control),
            transport: None,
        };
        let mut remote_control: BTreeMap<TaskId, BTreeMap<TaskId, Sender<Message>>> =
            BTreeMap::new();
        let mut inputs: BTreeMap<TaskId, Vec<(TaskId, Receiver<Message>)>> = BTreeMap::new();
        let mut outputs: BTreeMap<TaskId, BTreeMap<TaskId, Sender<Message>>> = BTreeMap::new();
        let mut incoming = Vec::new();
        let mut outgoing = Vec::new();
        for (up, down) in self.topology.edges() {
            match (local.contains(&up), local.contains(&down)) {
                (true, true) => {
                    let (tx, rx) = data_channel(&self.config);
                    outputs.entry(up).or_default().insert(down, tx);
                    inputs.entry(down).or_default().push((up, rx));
                }
                (true, false) => outgoing.push((up, down)),
                (false, true) => incoming.push((up, down)),
                (false, false) => {}
            }
        }
        let mut remote = |up: TaskId, down: TaskId, here: TaskId, data: EdgeData| {
            let (ctl_tx, ctl_rx) = crossbeam_channel::unbounded();
            let there = if here == up { down } else { up };
            remote_control
                .entry(here)
                .or_default()
                .insert(there, ctl_tx);
            let control_in = local_control
                .get(&here)
                .cloned()
                .ok_or_else(|| EngineError::Invalid(format!("{here} has no control channel")))?;
            transport.connect(RemoteEdge {
                upstream: up,
                downstream: down,
                data,
                control_out: ctl_rx,
                control_in,
                signals: Arc::clone(&signals),
            })
        };
        let connected = (|| {
            for (up, down) in outgoing {
                let (tx, rx) = data_channel(&self.config);
                outputs.entry(up).or_default().insert(down, tx);
                remote(up, down, up, EdgeData::Outgoing(rx))?;
            }
            for (up, down) in incoming {
                let (tx, rx) = data_channel(&self.config);
                inputs.entry(down).or_default().push((up, rx));
                remote(up, down, down, EdgeData::Incoming(tx))?;
            }
            Ok::<(), EngineError>(())
        })();
        let coordinator = connected.and_then(|()| transport.coordinator());
        tasks.transport = Some(transport);
        let coordinator = match coordinator {
            Ok(coordinator) => coordinator,
            Err(error) => {
                tasks.end(false);
                return Err(error);
            }
        };
        // Inputs in the topology's order of upstreams.
        for list in inputs.values_mut() {
            list.sort_by_key(|(up, _)| *up);
        }
        // Every local task asks for full messages until it has measured its records.
        let full = u32::try_from(self.config.batch_records.max(1)).unwrap_or(u32::MAX);
        let sizes: MessageSizes = Arc::new(
            local
                .iter()
                .map(|task| (*task, Arc::new(AtomicU32::new(full))))
                .collect(),
        );
        let builder = Builder {
            config: &self.config,
            flow: &self.flow,
            topology: &self.topology,
            groups: self.groups,
            store: &self.store,
            runtime: self.runtime.handle().clone(),
            epoch: Instant::now(),
            node: start.node,
            metrics: start.metrics,
            restore: start.restore,
            replay: start.replay,
        };
        for task in &local {
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
                    coordinator: coordinator.clone(),
                    signals: Arc::clone(&signals),
                    sizes: Arc::clone(&sizes),
                },
            };
            match builder.spawn(*task, wiring, coordinator.clone()) {
                Ok(spawned) => tasks.spawned.push(spawned),
                Err(error) => {
                    // The transport's coordinator link closes once every sender is gone.
                    drop(coordinator);
                    tasks.end(false);
                    return Err(error);
                }
            }
        }
        Ok(tasks)
    }
}

/// What [`Engine::start_tasks`] starts.
#[derive(Debug)]
pub struct TaskStart<'a> {
    /// The process's work directory ([`Engine::lock_work_dir`]): the tasks' live
    /// databases and snapshots under it start empty.
    pub work_dir: &'a WorkDir,
    /// The tasks that run in this process.
    pub tasks: &'a [TaskId],
    /// The process's node (recorded in each snapshot).
    pub node: NodeId,
    /// The restored checkpoint's local snapshots ([`Engine::fetch_restore`]).
    pub restore: Option<&'a LocalRestore>,
    /// Where each source stops when the restore replays up to published output
    /// ([`RestoreChoice::replay`]).
    pub replay: Option<&'a Bounds>,
    /// Where the tasks count their records.
    pub metrics: &'a Metrics,
}

/// The data side of a [`RemoteEdge`].
#[derive(Debug)]
pub enum EdgeData {
    /// The upstream task runs here: its data and barriers, in order, to carry out.
    Outgoing(Receiver<Message>),
    /// The downstream task runs here: its bounded input, for what arrives (wait for
    /// room, giving up when the generation halts: that is the backpressure).
    Incoming(Sender<Message>),
}

/// An edge between a task of this process and one elsewhere, as the engine hands it
/// to a [`Transport`].
#[derive(Debug)]
pub struct RemoteEdge {
    /// The edge's upstream task.
    pub upstream: TaskId,
    /// The edge's downstream task.
    pub downstream: TaskId,
    /// Data and barriers: leaving or arriving.
    pub data: EdgeData,
    /// Control messages the local task of the edge sends to the remote one.
    pub control_out: Receiver<Message>,
    /// The local task's control channel, for the control messages that arrive.
    pub control_in: Sender<Message>,
    /// The generation's signals: a transport's threads leave once they halt.
    pub signals: Arc<Signals>,
}

/// How the tasks of one process reach tasks in other processes and the
/// coordinator. The in-process implementation is [`InProcess`]; the TCP transport
/// of `stillpoint-cluster` is the other (an engine embedded in a system with its own
/// RPC layer carries the same frames over that).
pub trait Transport: Send {
    /// Carries `edge`, whose other task runs in another process.
    fn connect(&mut self, edge: RemoteEdge) -> Result<(), EngineError>;

    /// Where the local tasks' reports to the coordinator go.
    fn coordinator(&mut self) -> Result<Sender<CoordinatorInput>, EngineError>;

    /// The local tasks have stopped: close what this transport opened.
    fn close(&mut self) {}
}

/// The in-process transport: every task runs in this process, next to the
/// coordinator driver, which reads what the tasks report from the receiver
/// [`InProcess::new`] returns.
#[derive(Debug)]
pub struct InProcess {
    coordinator: Option<Sender<CoordinatorInput>>,
}

impl InProcess {
    /// The transport and the coordinator driver's end of it (it disconnects once
    /// every task has stopped).
    #[must_use]
    pub fn new() -> (Self, Receiver<CoordinatorInput>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        (
            Self {
                coordinator: Some(tx),
            },
            rx,
        )
    }
}

impl Transport for InProcess {
    fn connect(&mut self, edge: RemoteEdge) -> Result<(), EngineError> {
        Err(EngineError::Invalid(format!(
            "edge {}→{} leaves the process, and the in-process transport reaches no other",
            edge.upstream, edge.downstream
        )))
    }

    fn coordinator(&mut self) -> Result<Sender<CoordinatorInput>, EngineError> {
        self.coordinator
            .take()
            .ok_or_else(|| EngineError::Invalid("the in-process transport is in use".into()))
    }
}

/// The running tasks of one generation in this process.
pub struct Tasks {
    signals: Arc<Signals>,
    spawned: Vec<Spawned>,
    control: ControlMap,
    transport: Option<Box<dyn Transport>>,
}

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tasks")
            .field("tasks", &self.control.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Tasks {
    /// The generation's signals (a crash of them stops every task where it is).
    #[must_use]
    pub fn signals(&self) -> &Arc<Signals> {
        &self.signals
    }

    /// Hands a control message (from the coordinator) to the local task it is for;
    /// `false` when no local task is (or it has stopped).
    pub fn deliver(&self, message: Message) -> bool {
        message
            .recipient()
            .and_then(|task| self.control.get(&task))
            .is_some_and(|channel| channel.send(message).is_ok())
    }

    /// A sender of control messages to every local task, for a coordinator driver in
    /// this process.
    pub fn router(&self) -> impl Fn(TaskId, Message) + use<> {
        let control = Arc::clone(&self.control);
        move |task, message| {
            if let Some(channel) = control.get(&task) {
                // A task that stopped no longer hears; the protocol tolerates it.
                let _closed = channel.send(message);
            }
        }
    }

    /// Ends the generation: `graceful` lets the tasks carry out what their control
    /// channels hold (the final commit) before they stop; otherwise they stop where
    /// they are, as in a crash. The first real task failure, if any.
    pub fn end(mut self, graceful: bool) -> Option<EngineError> {
        if graceful {
            self.signals.stop();
        } else {
            self.signals.crash();
        }
        self.join()
    }

    /// Waits for the tasks to stop (after a stop or crash of their signals) and
    /// closes the transport.
    pub(crate) fn join(&mut self) -> Option<EngineError> {
        let error = join_all(std::mem::take(&mut self.spawned));
        if let Some(transport) = &mut self.transport {
            transport.close();
        }
        error
    }
}

/// One data edge's bounded channel: `channel_batches` messages (backpressure).
fn data_channel(config: &JobConfig) -> (Sender<Message>, Receiver<Message>) {
    crossbeam_channel::bounded(config.channel_batches)
}

fn runtime() -> Result<tokio::runtime::Runtime, EngineError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| EngineError::io("start", "tokio runtime", &e))
}
