//! A job: the dataflow built from its description, recovery from the store, one
//! driver thread (plus an export thread) per task, and the coordinator driver that
//! triggers checkpoints, commits global manifests, applies retention and decides when
//! a bounded job is done.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use serde::{Deserialize, Serialize};
use stillpoint_backup::{
    GcBackoff, KeptLease, Lease, LeaseConfig, Retention, Store, StoreOptions, SystemClock,
};
use stillpoint_state::{KeyGroups, StateConfig};
use stillpoint_task::{CompletedCheckpoint, Coordinator, CoordinatorConfig, Time};
use stillpoint_wire::{CheckpointId, CheckpointManifest, Message, NodeId, StreamId, TaskId};

use crate::build::{
    Builder, Restore, Topology, Wiring, clear_live_dirs, fetch_restore, is_corrupt_checkpoint,
    join_all, lock_work_dir, snapshots_needed,
};
use crate::coordinator::{CoordinatorDriver, Seen};
use crate::metrics::Metrics;
use crate::transport::{ControlMap, Links, Signals};
use crate::{EngineError, ToDataflow};

/// Where and how a job runs and checkpoints. Every field has a default.
#[derive(Clone, Debug)]
pub struct JobConfig {
    /// The stream's id (default 1).
    pub stream: StreamId,
    /// Local working directory: live databases, snapshots, restore downloads.
    pub work_dir: PathBuf,
    /// The checkpoint store URI (default `file://` + `work_dir/store`).
    pub store: Option<String>,
    /// How the store is opened.
    pub store_options: StoreOptions,
    /// Checkpoint interval (default 1 s).
    pub checkpoint_interval: Duration,
    /// A checkpoint not complete after this is aborted (default 60 s).
    pub checkpoint_timeout: Duration,
    /// Consecutive failed checkpoints tolerated before the job fails (default 3).
    pub tolerable_failures: u32,
    /// What retention keeps.
    pub retention: Retention,
    /// Number of key groups, fixed for the life of the job (default 128).
    pub max_parallelism: u32,
    /// RocksDB and cache tuning of every task.
    pub state: StateConfig,
    /// The job lease's time to live (default 60 s).
    pub lease_ttl: Duration,
    /// Where the Prometheus metrics endpoint listens (default: off).
    pub metrics_listen: Option<SocketAddr>,
    /// The processes of a cluster job (default: none — the job runs in one process).
    pub cluster: Option<crate::ClusterConfig>,
    /// Records a source reads into one data message (default 256).
    pub batch_records: usize,
    /// Data messages buffered per edge before the sender blocks (default 4). With
    /// `batch_records` this is the latency/throughput dial: a barrier waits behind
    /// everything queued on its edge (the alignment stall; Flink's buffer debloating
    /// reasons the same way), while every message costs a channel hand-off and often
    /// a thread wake-up. Measured in the engine bench (docs/performance.md): 1024 × 1
    /// runs the 1,000-key count ≈ 20 % faster than 256 × 4 but doubles the stall p50
    /// on a large restored state.
    pub channel_batches: usize,
    /// Restore even when the sinks already published output newer than the restore
    /// point — a fallback past damaged checkpoints, a store that lost its newest
    /// ones — accepting that it is published again (default false: such a run is
    /// refused, naming the checkpoints and the number of records).
    pub allow_duplicates: bool,
}

impl JobConfig {
    /// The defaults, working under `work_dir`.
    #[must_use]
    pub fn new(work_dir: impl Into<PathBuf>) -> Self {
        Self {
            stream: StreamId(1),
            work_dir: work_dir.into(),
            store: None,
            store_options: StoreOptions::default(),
            checkpoint_interval: Duration::from_secs(1),
            checkpoint_timeout: Duration::from_secs(60),
            tolerable_failures: 3,
            retention: Retention::default(),
            max_parallelism: 128,
            state: StateConfig::default(),
            lease_ttl: Duration::from_secs(60),
            metrics_listen: None,
            cluster: None,
            batch_records: 256,
            channel_batches: 4,
            allow_duplicates: false,
        }
    }

    /// The store URI this job checkpoints to.
    #[must_use]
    pub fn store_uri(&self) -> String {
        self.store
            .clone()
            .unwrap_or_else(|| format!("file://{}", self.work_dir.join("store").display()))
    }
}

/// Asks a running job to stop: it takes one more checkpoint, publishes it and returns.
/// [`StopHandle::stop_with_savepoint`] makes that last one a savepoint (Flink's
/// stop-with-savepoint): kept by retention until deleted by hand, and restorable
/// with other parallelisms like any checkpoint. Clone it into a signal handler.
#[derive(Clone, Debug, Default)]
pub struct StopHandle(Arc<StopFlags>);

#[derive(Debug, Default)]
struct StopFlags {
    stop: AtomicBool,
    savepoint: AtomicBool,
}

impl StopHandle {
    /// A handle nobody has pulled yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests the stop (idempotent).
    pub fn stop(&self) {
        self.0.stop.store(true, Ordering::SeqCst);
    }

    /// Requests the stop after a savepoint (idempotent; wins over a plain stop not
    /// yet acted on).
    pub fn stop_with_savepoint(&self) {
        self.0.savepoint.store(true, Ordering::SeqCst);
        self.stop();
    }

    /// Whether a stop was requested.
    #[must_use]
    pub fn requested(&self) -> bool {
        self.0.stop.load(Ordering::SeqCst)
    }

    /// Whether the stop asks for a savepoint.
    #[must_use]
    pub fn savepoint_requested(&self) -> bool {
        self.0.savepoint.load(Ordering::SeqCst)
    }
}

/// What [`RunOptions::on_start`] calls.
pub type StartCallback = Box<dyn FnOnce(&JobReport) + Send>;

/// What [`RunOptions::on_checkpoint`] calls.
pub type CheckpointCallback = Box<dyn FnMut(&CheckpointStats) + Send>;

/// How one run is driven from outside.
#[derive(Default)]
pub struct RunOptions {
    /// Crash the whole job at this moment (fault injection): threads stop where they
    /// are, nothing is flushed or released, and `EngineError::Crashed` is returned.
    pub crash_after: Option<Duration>,
    /// Stops the job after a final checkpoint.
    pub stop: StopHandle,
    /// Called on the coordinator's thread for each completed checkpoint.
    pub on_checkpoint: Option<CheckpointCallback>,
    /// Called once the metrics endpoint listens, with its address.
    pub on_metrics: Option<Box<dyn FnOnce(SocketAddr) + Send>>,
    /// Called once the restore point is chosen (before any task runs), with the
    /// report so far: what the run restores from and what it fell back past.
    pub on_start: Option<StartCallback>,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("crash_after", &self.crash_after)
            .field("stop", &self.stop)
            .finish_non_exhaustive()
    }
}

/// Statistics of one completed checkpoint, kept in the store next to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointStats {
    /// The checkpoint.
    pub checkpoint: u64,
    /// `checkpoint` or `savepoint`.
    pub kind: String,
    /// Trigger to commit, milliseconds.
    pub duration_millis: u64,
    /// Longest alignment of any task, microseconds.
    pub max_alignment_micros: u64,
    /// Longest synchronous snapshot (the task's stall), microseconds.
    pub max_sync_micros: u64,
    /// Full state size.
    pub state_bytes: u64,
    /// Bytes uploaded for this checkpoint.
    pub uploaded_bytes: u64,
}

impl From<&CompletedCheckpoint> for CheckpointStats {
    fn from(done: &CompletedCheckpoint) -> Self {
        Self {
            checkpoint: done.checkpoint.get(),
            kind: done.kind.to_string(),
            duration_millis: u64::try_from(done.duration.as_millis()).unwrap_or(u64::MAX),
            max_alignment_micros: done.max_alignment_micros,
            max_sync_micros: done.max_sync_micros,
            state_bytes: done.state_bytes,
            uploaded_bytes: done.uploaded_bytes,
        }
    }
}

/// A committed checkpoint recovery skipped because it did not verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FallBack {
    /// The checkpoint.
    pub checkpoint: CheckpointId,
    /// What was wrong with it (naming the file).
    pub problem: String,
}

/// What a finished run did.
#[derive(Clone, Debug, Default)]
pub struct JobReport {
    /// The checkpoint the run restored from, if any.
    pub restored_from: Option<CheckpointId>,
    /// Newer committed checkpoints that failed verification and were skipped, newest
    /// first.
    pub fell_back_from: Vec<FallBack>,
    /// Checkpoints completed during the run.
    pub checkpoints: Vec<CheckpointStats>,
    /// The sinks had published output after the restored checkpoint (a fallback past
    /// a damaged one): the run replayed exactly up to its end and dropped that
    /// output instead of publishing it again.
    pub replayed: Option<Replayed>,
}

/// An exact replay up to the end of output published after the restore point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replayed {
    /// The newest checkpoint whose output was published.
    pub through: CheckpointId,
    /// The published records the replay reproduced and dropped.
    pub records: u64,
}

impl From<&crate::dataflow::Replay> for Replayed {
    fn from(replay: &crate::dataflow::Replay) -> Self {
        Self {
            through: replay.through,
            records: replay.records,
        }
    }
}

const NODE: NodeId = NodeId(1);

/// Runs the word count until every source is exhausted and a checkpoint covering all
/// of it has completed, restoring from the store's newest verified checkpoint first.
/// `crash_after` crashes the whole job at that moment (fault injection): threads stop
/// where they are, nothing is flushed or released, and `EngineError::Crashed` is
/// returned — run it again to recover.
pub fn run_word_count(
    config: &JobConfig,
    job: &impl ToDataflow,
    crash_after: Option<Duration>,
) -> Result<JobReport, EngineError> {
    run(
        config,
        job,
        RunOptions {
            crash_after,
            ..RunOptions::default()
        },
    )
}

/// Runs the word count until its bounded sources are exhausted and a checkpoint
/// covering all of it has completed, or until `options.stop` is pulled and one more
/// checkpoint has completed; restores from the store's newest verified checkpoint
/// first (falling back past any that do not verify, and rescaling the counters when
/// their parallelism changed).
pub fn run(
    config: &JobConfig,
    job: &impl ToDataflow,
    mut options: RunOptions,
) -> Result<JobReport, EngineError> {
    let flow = job.to_dataflow()?;
    flow.check()?;
    let _work_dir = lock_work_dir(&config.work_dir)?;
    let runtime = runtime()?;
    let (store, lease) = open_leased_store(&runtime, config)?;

    let topology = Topology::of(&flow);
    let groups = KeyGroups::new(config.max_parallelism)?;
    let mut report = JobReport::default();
    let restore = runtime.block_on(restore_point(
        &store,
        &config.work_dir,
        &mut report,
        &BTreeSet::new(),
        |manifest| snapshots_needed(manifest, &topology, &topology.all(), groups),
    ))?;
    report.restored_from = restore.as_ref().map(|r| r.manifest.checkpoint);
    let plan = flow.plan_restore(
        report.restored_from,
        !report.fell_back_from.is_empty(),
        config.allow_duplicates,
        &topology.sources,
    )?;
    report.replayed = plan.replay.as_ref().map(Replayed::from);
    if let Some(tell) = options.on_start.take() {
        tell(&report);
    }
    let highest_seen =
        highest_checkpoint(&runtime, &store)?.max(plan.newest_published.unwrap_or(CheckpointId(0)));

    let signals = Arc::new(Signals::default());
    let epoch = Instant::now();
    let metrics = Arc::new(Metrics::new(&topology.all()));
    if let Some(id) = report.restored_from {
        metrics.restored(id.get());
    }
    let metrics_thread = match config.metrics_listen {
        Some(listen) => {
            let (address, handle) =
                crate::metrics::serve(listen, Arc::clone(&metrics), Arc::clone(&signals))?;
            if let Some(tell) = options.on_metrics.take() {
                tell(address);
            }
            Some(handle)
        }
        None => None,
    };

    // Channels: data per edge (bounded: backpressure), control per task.
    let mut inputs: BTreeMap<TaskId, Vec<(TaskId, Receiver<Message>)>> = BTreeMap::new();
    let mut outputs: BTreeMap<TaskId, BTreeMap<TaskId, Sender<Message>>> = BTreeMap::new();
    for (from, to) in topology.edges() {
        let (tx, rx) = data_channel(config);
        outputs.entry(from).or_default().insert(to, tx);
        inputs.entry(to).or_default().push((from, rx));
    }
    let mut control_rx = BTreeMap::new();
    let mut control_tx = BTreeMap::new();
    for task in topology.all() {
        let (tx, rx) = crossbeam_channel::unbounded();
        control_tx.insert(task, tx);
        control_rx.insert(task, rx);
    }
    let control_tx: ControlMap = Arc::new(control_tx);
    let (coordinator_tx, coordinator_rx) = crossbeam_channel::unbounded();

    clear_live_dirs(&config.work_dir)?;
    if let Some(restore) = &restore
        && !restore.same_shape(&topology)
    {
        flow.settle_sinks(restore.manifest.checkpoint)?;
    }
    let builder = Builder {
        config,
        flow: &flow,
        topology: &topology,
        groups,
        store: &store,
        runtime: runtime.handle().clone(),
        epoch,
        node: NODE,
        metrics: &metrics,
        restore: restore.as_ref(),
        replay: plan.replay.as_ref().map(|r| &r.bounds),
    };
    let mut spawned = Vec::new();
    for task in topology.all() {
        let wiring = Wiring {
            inputs: inputs.remove(&task).unwrap_or_default(),
            control: control_rx
                .remove(&task)
                .ok_or_else(|| EngineError::Invalid(format!("{task} has no control channel")))?,
            links: Links {
                data: outputs.remove(&task).unwrap_or_default(),
                control: Arc::clone(&control_tx),
                coordinator: coordinator_tx.clone(),
                signals: Arc::clone(&signals),
            },
        };
        spawned.push(builder.spawn(task, wiring, coordinator_tx.clone())?);
    }
    drop(coordinator_tx);

    if let Some(after) = options.crash_after {
        let signals = Arc::clone(&signals);
        std::thread::spawn(move || {
            std::thread::sleep(after);
            signals.crash();
        });
    }

    let routes = Arc::clone(&control_tx);
    let (outcome, lease) = {
        let mut driver = CoordinatorDriver {
            coordinator: coordinator_machine(
                config,
                &topology,
                report.restored_from,
                highest_seen,
            )?,
            store: store.clone(),
            lease,
            runtime: &runtime,
            control: Box::new(move |task, message| {
                if let Some(channel) = routes.get(&task) {
                    let _closed = channel.send(message);
                }
            }),
            inputs: coordinator_rx,
            signals: Arc::clone(&signals),
            epoch,
            config,
            flow: &flow,
            sources: topology.sources.clone(),
            stages: topology.parallelisms(),
            seen: Seen::replaying(plan.replay.as_ref().map(|r| &r.bounds)),
            backoff: gc_backoff(),
            report: &mut report,
            metrics: Arc::clone(&metrics),
            stop: options.stop.clone(),
            on_checkpoint: options.on_checkpoint.take(),
        };
        let outcome = driver.run();
        (outcome, driver.lease)
    };
    if outcome.is_ok() {
        signals.stop();
    } else {
        signals.crash();
    }
    let first_error = join_all(spawned);
    if let Some(handle) = metrics_thread {
        let _joined = handle.join();
    }
    outcome?;
    if signals.crashed() {
        // The injected crash came while the job was stopping: some tasks left without
        // carrying out the last commit. Like any crash, the next run finishes it.
        return Err(EngineError::Crashed(
            "the job while it was stopping".to_owned(),
        ));
    }
    if let Some(error) = first_error {
        return Err(error);
    }
    runtime.block_on(lease.release())?;
    Ok(report)
}

/// One data edge's bounded channel: `channel_batches` messages (backpressure).
pub(crate) fn data_channel(config: &JobConfig) -> (Sender<Message>, Receiver<Message>) {
    crossbeam_channel::bounded(config.channel_batches)
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, EngineError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| EngineError::io("start", "tokio runtime", &e))
}

/// Opens the job's store, takes its lease (kept fresh by a task on `runtime`) and
/// fences the store with it: once the lease is lost, or close to lapsing without a
/// refresh (a paused process), nothing more of this run lands in the store — not
/// even an export thread's upload.
pub(crate) fn open_leased_store(
    runtime: &tokio::runtime::Runtime,
    config: &JobConfig,
) -> Result<(Store, KeptLease), EngineError> {
    let store = Store::open(&config.store_uri(), config.store_options.clone())?;
    let lease = runtime
        .block_on(Lease::acquire_job(
            &store,
            lease_config(config),
            Arc::new(SystemClock),
        ))?
        .keep(runtime.handle());
    Ok((store.fenced(lease.fence()), lease))
}

fn lease_config(config: &JobConfig) -> LeaseConfig {
    LeaseConfig {
        ttl: config.lease_ttl,
        settle: Duration::from_millis(50),
        reclaim_own: true,
        ..LeaseConfig::default()
    }
}

pub(crate) fn gc_backoff() -> GcBackoff {
    GcBackoff::new(Duration::from_secs(1), Duration::from_secs(60))
}

/// The highest checkpoint id the store has seen (committed or not): new ids start
/// above it, so an id is never reused.
pub(crate) fn highest_checkpoint(
    runtime: &tokio::runtime::Runtime,
    store: &Store,
) -> Result<CheckpointId, EngineError> {
    Ok(runtime
        .block_on(store.checkpoints())?
        .iter()
        .map(|l| l.id)
        .max()
        .unwrap_or(CheckpointId(0)))
}

pub(crate) fn coordinator_machine(
    config: &JobConfig,
    topology: &Topology,
    restored: Option<CheckpointId>,
    highest_seen: CheckpointId,
) -> Result<Coordinator, EngineError> {
    Ok(Coordinator::new(
        CoordinatorConfig {
            interval: config.checkpoint_interval,
            timeout: config.checkpoint_timeout,
            tolerable_failures: config.tolerable_failures,
            ..CoordinatorConfig::new(config.stream, topology.sources.clone(), topology.all())
        },
        Time::ZERO,
        restored,
        CheckpointId(highest_seen.get() + 1),
    )?)
}

/// Finds the checkpoint to restore: the newest committed one (not in `skip`) whose
/// files are all present and whose snapshots `wanted` download and verify. A newer
/// checkpoint that fails is recorded in `report.fell_back_from` and logged; an
/// unreachable store or an impossible restore is an error, never a reason to fall
/// back; committed checkpoints none of which restores are an error too (a fresh
/// start would publish the output again).
pub(crate) async fn restore_point(
    store: &Store,
    work_dir: &std::path::Path,
    report: &mut JobReport,
    skip: &BTreeSet<CheckpointId>,
    wanted: impl Fn(&CheckpointManifest) -> Result<Vec<TaskId>, EngineError>,
) -> Result<Option<Restore>, EngineError> {
    let committed = store.committed_ids().await?;
    for id in committed.iter().copied().rev() {
        if skip.contains(&id) {
            continue;
        }
        match fetch_restore(store, work_dir, id, &wanted).await {
            Ok(restore) => {
                tracing::info!(checkpoint = %id, "restoring");
                return Ok(Some(restore));
            }
            Err(error) if !is_corrupt_checkpoint(&error) => return Err(error),
            Err(error) => {
                tracing::warn!(checkpoint = %id, %error, "checkpoint does not verify; falling back to an older one");
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

/// The statistics of every checkpoint the job's store has kept, oldest first.
pub fn checkpoint_history(config: &JobConfig) -> Result<Vec<CheckpointStats>, EngineError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| EngineError::io("start", "tokio runtime", &e))?;
    let store = Store::open(&config.store_uri(), config.store_options.clone())?;
    let stats = runtime.block_on(store.stats::<CheckpointStats>())?;
    Ok(stats.into_iter().map(|(_, s)| s).collect())
}
