//! A job: the dataflow built from its description, recovery from the store, one
//! driver thread (plus an export thread) per task, and the coordinator driver that
//! triggers checkpoints, commits global manifests, applies retention and decides when
//! a bounded job is done.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use serde::{Deserialize, Serialize};
use stillpoint_backup::{
    GcBackoff, Lease, LeaseConfig, Retention, Store, StoreError, StoreOptions, SystemClock,
    VerifyDepth, gc,
};
use stillpoint_state::{CachedState, KeyGroups, RocksStateBackend, StateConfig, StateOwner};
use stillpoint_task::{
    CompletedCheckpoint, Coordinator, CoordinatorAction, CoordinatorConfig, ManifestRequest,
    RestoredCheckpoint, TaskConfig, TaskLevel, TaskMachine, Time,
};
use stillpoint_wire::{
    CheckpointId, CheckpointManifest, NodeId, SnapshotManifest, SourceOffset, SourcePosition,
    StreamId, TaskId, TaskSnapshotRef,
};

use crate::driver::{ExportJob, ExportOutcome, Partitioner, Role, TaskDriver, export_loop};
use crate::metrics::Metrics;
use crate::transport::{CoordinatorInput, Links, Signals};
use crate::{EngineError, GeneratedWords, KeyedCount, Source, TransactionalFileSink};

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

/// The built-in keyed word count: `sources` replayable sources → hash by key group →
/// `aggregators` keyed counters → one exactly-once file sink per counter.
#[derive(Clone, Debug)]
pub struct WordCount {
    /// Source parallelism.
    pub sources: u32,
    /// Counter (and sink) parallelism.
    pub aggregators: u32,
    /// What the sources read.
    pub input: WordInput,
    /// Where the sinks publish their output.
    pub output: PathBuf,
}

/// What the word count's sources read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WordInput {
    /// Deterministic generated words ([`GeneratedWords`]); bounded.
    Generated {
        /// Words each source generates before it ends.
        words_per_source: u64,
        /// Distinct words.
        vocabulary: u32,
        /// Seed of the generated words.
        seed: u64,
    },
    /// One text file per source ([`crate::FileLines`]); bounded.
    Files {
        /// The files, one per source.
        paths: Vec<PathBuf>,
    },
    /// One append-only log directory per source ([`crate::LogDir`]); unbounded: the
    /// job runs until it is stopped.
    Log {
        /// The directories, one per source.
        dirs: Vec<PathBuf>,
    },
}

impl WordCount {
    /// A word count over generated words (1,000 distinct words, seed 42).
    #[must_use]
    pub fn generated(
        sources: u32,
        aggregators: u32,
        words_per_source: u64,
        output: impl Into<PathBuf>,
    ) -> Self {
        Self {
            sources,
            aggregators,
            input: WordInput::Generated {
                words_per_source,
                vocabulary: 1_000,
                seed: 42,
            },
            output: output.into(),
        }
    }

    /// The source of task index `index`.
    fn source(&self, index: u32) -> Result<Box<dyn Source>, EngineError> {
        let pick = |list: &[PathBuf], what: &str| {
            list.get(index as usize).cloned().ok_or_else(|| {
                EngineError::Invalid(format!(
                    "source {index} has no {what}: the input lists {} for {} sources",
                    list.len(),
                    self.sources
                ))
            })
        };
        Ok(match &self.input {
            WordInput::Generated {
                words_per_source,
                vocabulary,
                seed,
            } => Box::new(GeneratedWords::new(
                *seed,
                index,
                *words_per_source,
                *vocabulary,
            )),
            WordInput::Files { paths } => Box::new(crate::FileLines::new(pick(paths, "file")?)),
            WordInput::Log { dirs } => Box::new(crate::LogDir::new(pick(dirs, "log directory")?)),
        })
    }
}

/// Asks a running job to stop: it takes one more checkpoint, publishes it and returns.
/// Clone it into a signal handler.
#[derive(Clone, Debug, Default)]
pub struct StopHandle(Arc<AtomicBool>);

impl StopHandle {
    /// A handle nobody has pulled yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests the stop (idempotent).
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether a stop was requested.
    #[must_use]
    pub fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

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
}

struct Topology {
    sources: Vec<TaskId>,
    aggregators: Vec<TaskId>,
    sinks: Vec<TaskId>,
}

impl Topology {
    fn of(job: &WordCount) -> Self {
        let ids = |from: u32, n: u32| (from..from + n).map(TaskId).collect::<Vec<_>>();
        Self {
            sources: ids(1, job.sources),
            aggregators: ids(1 + job.sources, job.aggregators),
            sinks: ids(1 + job.sources + job.aggregators, job.aggregators),
        }
    }

    fn all(&self) -> Vec<TaskId> {
        self.sources
            .iter()
            .chain(&self.aggregators)
            .chain(&self.sinks)
            .copied()
            .collect()
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
    job: &WordCount,
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
/// first.
pub fn run(
    config: &JobConfig,
    job: &WordCount,
    mut options: RunOptions,
) -> Result<JobReport, EngineError> {
    let crash_after = options.crash_after;
    if job.sources == 0 || job.aggregators == 0 {
        return Err(EngineError::Invalid(
            "a word count needs at least one source and one counter".to_owned(),
        ));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| EngineError::io("start", "tokio runtime", &e))?;
    let store = Store::open(&config.store_uri(), config.store_options.clone())?;
    let lease_config = LeaseConfig {
        ttl: config.lease_ttl,
        settle: Duration::from_millis(50),
        reclaim_own: true,
        ..LeaseConfig::default()
    };
    let lease = runtime.block_on(Lease::acquire_job(
        &store,
        lease_config,
        Arc::new(SystemClock),
    ))?;

    let mut report = JobReport::default();
    let (restored, mut downloads) =
        match runtime.block_on(restore_point(&store, &config.work_dir, &mut report))? {
            Some((manifest, downloads)) => (Some(manifest), downloads),
            None => (None, BTreeMap::new()),
        };
    report.restored_from = restored.as_ref().map(|m| m.checkpoint);
    let highest_seen = runtime
        .block_on(store.checkpoints())?
        .iter()
        .map(|l| l.id)
        .max()
        .unwrap_or(CheckpointId(0));

    let topology = Topology::of(job);
    let groups = KeyGroups::new(config.max_parallelism)?;
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
    let mut data_rx: BTreeMap<TaskId, Vec<(TaskId, Receiver<stillpoint_wire::Message>)>> =
        BTreeMap::new();
    let mut data_tx: BTreeMap<TaskId, BTreeMap<TaskId, crossbeam_channel::Sender<_>>> =
        BTreeMap::new();
    let mut edge = |from: TaskId, to: TaskId| {
        let (tx, rx) = crossbeam_channel::bounded(64);
        data_tx.entry(from).or_default().insert(to, tx);
        data_rx.entry(to).or_default().push((from, rx));
    };
    for source in &topology.sources {
        for aggregator in &topology.aggregators {
            edge(*source, *aggregator);
        }
    }
    for (aggregator, sink) in topology.aggregators.iter().zip(&topology.sinks) {
        edge(*aggregator, *sink);
    }
    let mut control_rx = BTreeMap::new();
    let mut control_tx = BTreeMap::new();
    for task in topology.all() {
        let (tx, rx) = crossbeam_channel::unbounded();
        control_tx.insert(task, tx);
        control_rx.insert(task, rx);
    }
    let control_tx = Arc::new(control_tx);
    let (coordinator_tx, coordinator_rx) = crossbeam_channel::unbounded();

    // Local directories: live databases and snapshots start empty each run; restore
    // downloads are kept, so files that still verify are not fetched again.
    for dir in ["db", "snapshots"] {
        let path = config.work_dir.join(dir);
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(EngineError::io("clear", &path, &e)),
        }
    }

    let mut threads = Vec::new();
    for task in topology.all() {
        let level = if topology.sources.contains(&task) {
            TaskLevel::Source
        } else if topology.aggregators.contains(&task) {
            TaskLevel::Aggregate
        } else {
            TaskLevel::Sink
        };
        let index = |list: &[TaskId]| {
            u32::try_from(list.iter().position(|t| *t == task).unwrap_or(0)).unwrap_or(0)
        };
        let (range, downstreams, partitioner) = match level {
            TaskLevel::Source => (
                groups.all(),
                topology.aggregators.clone(),
                Partitioner::by_key_group(groups, job.aggregators)?,
            ),
            TaskLevel::Aggregate => {
                let i = index(&topology.aggregators);
                let sink = topology.sinks.get(i as usize).copied().unwrap_or(task);
                (
                    groups.range_of(job.aggregators, i)?,
                    vec![sink],
                    Partitioner::Forward,
                )
            }
            TaskLevel::Sink => {
                let i = index(&topology.sinks);
                (
                    groups.range_of(job.aggregators, i)?,
                    Vec::new(),
                    Partitioner::Forward,
                )
            }
        };
        let upstreams: Vec<TaskId> = data_rx
            .get(&task)
            .map(|inputs| inputs.iter().map(|(u, _)| *u).collect())
            .unwrap_or_default();
        let owner = StateOwner {
            stream: config.stream,
            task,
        };
        let db_dir = config
            .work_dir
            .join("db")
            .join(format!("task-{}", task.get()));
        let backend = match downloads.remove(&task) {
            Some((snapshot, download)) => RocksStateBackend::restore(
                &download,
                &snapshot,
                &db_dir,
                config.state.clone(),
                groups,
                owner,
            )?,
            None => RocksStateBackend::open(&db_dir, config.state.clone(), groups, range, owner)?,
        };
        let state = CachedState::new(backend);
        let restored_checkpoint = restored.as_ref().map(|m| RestoredCheckpoint {
            checkpoint: m.checkpoint,
            trans: m.trans,
            kind: m.kind,
            source_offset: m.source_offset(task).cloned(),
        });
        let role = match level {
            TaskLevel::Source => {
                let mut source = job.source(index(&topology.sources))?;
                source.seek(
                    restored_checkpoint
                        .as_ref()
                        .and_then(|r| r.source_offset.as_ref()),
                )?;
                Role::Source(source)
            }
            TaskLevel::Aggregate => Role::Operator(Box::new(KeyedCount)),
            TaskLevel::Sink => {
                let mut sink = TransactionalFileSink::new(&job.output, task);
                crate::Sink::recover(
                    &mut sink,
                    restored_checkpoint.as_ref().map(|r| r.checkpoint),
                )?;
                Role::Sink(Box::new(sink))
            }
        };
        let task_config = TaskConfig::new(config.stream, task, NODE, level)
            .upstreams(upstreams)
            .downstreams(downstreams.clone());
        let machine = TaskMachine::new(task_config, restored_checkpoint)?;
        let links = Links {
            data: data_tx.remove(&task).unwrap_or_default(),
            control: Arc::clone(&control_tx),
            coordinator: coordinator_tx.clone(),
            signals: Arc::clone(&signals),
        };
        let (export_tx, export_rx) = crossbeam_channel::unbounded::<ExportJob>();
        let (exported_tx, exported_rx) = crossbeam_channel::unbounded::<ExportOutcome>();
        let exporter = {
            let store = store.clone();
            let handle = runtime.handle().clone();
            std::thread::Builder::new()
                .name(format!("export-{}", task.get()))
                .spawn(move || export_loop(export_rx, exported_tx, store, handle, NODE))
                .map_err(|e| EngineError::io("spawn", "export thread", &e))?
        };
        let mut driver = TaskDriver::new(
            config.stream,
            task,
            machine,
            role,
            state,
            data_rx.remove(&task).unwrap_or_default(),
            control_rx
                .remove(&task)
                .ok_or_else(|| EngineError::Invalid(format!("{task} has no control channel")))?,
            export_tx,
            exported_rx,
            links,
            downstreams,
            partitioner,
            config
                .work_dir
                .join("snapshots")
                .join(format!("task-{}", task.get())),
            epoch,
        );
        driver.records = metrics.records_of(task);
        let failures = coordinator_tx.clone();
        let worker = std::thread::Builder::new()
            .name(format!("task-{}", task.get()))
            .spawn(move || {
                let outcome = driver.run();
                if let Err(error) = &outcome {
                    if !matches!(error, EngineError::Crashed(_) | EngineError::Stopped(_)) {
                        let _closed = failures.send(CoordinatorInput::TaskFailed {
                            task,
                            error: error.to_string(),
                        });
                    }
                }
                outcome
            })
            .map_err(|e| EngineError::io("spawn", "task thread", &e))?;
        threads.push((task, worker, exporter));
    }
    drop(coordinator_tx);

    if let Some(after) = crash_after {
        let signals = Arc::clone(&signals);
        std::thread::spawn(move || {
            std::thread::sleep(after);
            signals.crash();
        });
    }

    let coordinator = Coordinator::new(
        CoordinatorConfig {
            interval: config.checkpoint_interval,
            timeout: config.checkpoint_timeout,
            tolerable_failures: config.tolerable_failures,
            ..CoordinatorConfig::new(config.stream, topology.sources.clone(), topology.all())
        },
        Time::ZERO,
        restored.as_ref().map(|m| m.checkpoint),
        CheckpointId(highest_seen.get() + 1),
    )?;
    let mut driver = CoordinatorDriver {
        coordinator,
        store: store.clone(),
        lease,
        runtime: &runtime,
        control: Arc::clone(&control_tx),
        inputs: coordinator_rx,
        signals: Arc::clone(&signals),
        epoch,
        config,
        sources: topology.sources.clone(),
        finished: BTreeMap::new(),
        offsets: BTreeMap::new(),
        backoff: GcBackoff::new(Duration::from_secs(1), Duration::from_secs(60)),
        report: &mut report,
        metrics: Arc::clone(&metrics),
        stop: options.stop.clone(),
        stop_after: None,
        on_checkpoint: options.on_checkpoint.take(),
    };
    let outcome = driver.run();
    let lease = driver.lease;
    if outcome.is_ok() {
        signals.stop();
    } else {
        signals.crash();
    }
    let mut first_error = None;
    for (task, worker, exporter) in threads {
        match worker.join() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                if !matches!(error, EngineError::Crashed(_) | EngineError::Stopped(_)) {
                    tracing::error!(%task, %error, "task failed");
                    first_error.get_or_insert(error);
                }
            }
            Err(_) => {
                first_error.get_or_insert(EngineError::Stopped(format!("{task} panicked")));
            }
        }
        let _joined = exporter.join();
    }
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

/// Finds the checkpoint to restore: the newest committed one whose files are all
/// present and whose every task snapshot downloads and verifies (into
/// `work_dir/restore/task-N`, reusing local files that match). A newer checkpoint
/// that fails is recorded in `report.fell_back_from` and logged; an unreachable store
/// is an error, never a reason to fall back.
async fn restore_point(
    store: &Store,
    work_dir: &std::path::Path,
    report: &mut JobReport,
) -> Result<Option<RestorePoint>, EngineError> {
    for id in store.committed_ids().await?.into_iter().rev() {
        match try_restore_point(store, work_dir, id).await {
            Ok(point) => {
                tracing::info!(checkpoint = %id, "restoring");
                return Ok(Some(point));
            }
            Err(error) if error.is_unavailable() => return Err(error.into()),
            Err(error) => {
                tracing::warn!(checkpoint = %id, %error, "checkpoint does not verify; falling back to an older one");
                report.fell_back_from.push(FallBack {
                    checkpoint: id,
                    problem: error.to_string(),
                });
            }
        }
    }
    Ok(None)
}

type RestorePoint = (
    CheckpointManifest,
    BTreeMap<TaskId, (SnapshotManifest, PathBuf)>,
);

async fn try_restore_point(
    store: &Store,
    work_dir: &std::path::Path,
    id: CheckpointId,
) -> Result<RestorePoint, StoreError> {
    let verified = store.verify(id, VerifyDepth::Presence, &()).await?;
    if let Some(problem) = verified.problems.first() {
        return Err(StoreError::Corrupt {
            path: problem.object.clone(),
            problem: format!("{problem} ({} problem(s) in all)", verified.problems.len()),
        });
    }
    let manifest = store.checkpoint(id).await?;
    let mut downloads = BTreeMap::new();
    for reference in &manifest.tasks {
        let snapshot = store.task_manifest(reference).await?;
        let dir = work_dir
            .join("restore")
            .join(format!("task-{}", reference.task.get()));
        // Anything left there from another checkpoint is replaced.
        if dir.exists() {
            clear_extra_files(&dir, &snapshot)?;
        }
        store.download_snapshot(&snapshot, &dir, &()).await?;
        downloads.insert(reference.task, (snapshot, dir));
    }
    Ok((manifest, downloads))
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

/// Removes files of a previous restore that the snapshot about to be downloaded does
/// not list (a restore directory must hold exactly the snapshot's files).
fn clear_extra_files(dir: &std::path::Path, snapshot: &SnapshotManifest) -> Result<(), StoreError> {
    let local =
        |operation: &'static str, path: &std::path::Path, e: &std::io::Error| StoreError::Local {
            operation,
            path: path.to_path_buf(),
            message: e.to_string(),
            kind: e.kind(),
        };
    let keep: std::collections::BTreeSet<&str> =
        snapshot.files.iter().map(|f| f.path.as_str()).collect();
    let entries = std::fs::read_dir(dir).map_err(|e| local("list", dir, &e))?;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !keep.contains(name.as_str()) {
            let path = entry.path();
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            removed.map_err(|e| local("remove", &path, &e))?;
        }
    }
    Ok(())
}

struct CoordinatorDriver<'a> {
    coordinator: Coordinator,
    store: Store,
    lease: Lease,
    runtime: &'a tokio::runtime::Runtime,
    control: Arc<BTreeMap<TaskId, crossbeam_channel::Sender<stillpoint_wire::Message>>>,
    inputs: Receiver<CoordinatorInput>,
    signals: Arc<Signals>,
    epoch: Instant,
    config: &'a JobConfig,
    sources: Vec<TaskId>,
    finished: BTreeMap<TaskId, SourceOffset>,
    offsets: BTreeMap<CheckpointId, BTreeMap<TaskId, SourceOffset>>,
    backoff: GcBackoff,
    report: &'a mut JobReport,
    metrics: Arc<Metrics>,
    stop: StopHandle,
    /// Once a stop was requested: the newest checkpoint already triggered then; the
    /// job ends when a later one completes.
    stop_after: Option<CheckpointId>,
    on_checkpoint: Option<CheckpointCallback>,
}

impl CoordinatorDriver<'_> {
    fn now(&self) -> Time {
        Time::from_duration(self.epoch.elapsed())
    }

    fn run(&mut self) -> Result<(), EngineError> {
        let span = tracing::info_span!("coordinator", stream = %self.config.stream);
        let _entered = span.enter();
        loop {
            if self.signals.crashed() {
                return Err(EngineError::Crashed("coordinator".to_owned()));
            }
            let now = self.now();
            let wait = self
                .coordinator
                .poll_timeout()
                .map_or(Duration::from_millis(20), |t| {
                    t.saturating_since(now).min(Duration::from_millis(20))
                });
            match self.inputs.recv_timeout(wait) {
                Ok(CoordinatorInput::Message(message)) => {
                    if let Err(error) = self.coordinator.handle_message(self.now(), &message) {
                        tracing::warn!(%error, "coordinator refused a message");
                    }
                }
                Ok(CoordinatorInput::SourceFinished { task, offset }) => {
                    self.finished.insert(task, offset);
                }
                Ok(CoordinatorInput::TaskFailed { task, error }) => {
                    return Err(EngineError::Failed(format!("{task}: {error}")));
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    if self.signals.crashed() {
                        return Err(EngineError::Crashed("coordinator".to_owned()));
                    }
                    return Err(EngineError::Stopped("every task".to_owned()));
                }
            }
            if self.stop_after.is_none() && self.stop.requested() {
                let newest = self
                    .coordinator
                    .in_flight()
                    .max()
                    .or(self.coordinator.last_completed())
                    .unwrap_or(CheckpointId(0));
                tracing::info!(after = %newest, "stop requested: one more checkpoint, then stop");
                self.stop_after = Some(newest);
            }
            let now = self.now();
            if self.coordinator.poll_timeout().is_some_and(|t| t <= now) {
                self.coordinator.handle_timeout(now);
            }
            if self.apply()? {
                return Ok(());
            }
            if self.lease.needs_refresh() {
                self.runtime.block_on(self.lease.refresh())?;
            }
        }
    }

    /// Carries out the coordinator's actions; `true` once the job is done.
    fn apply(&mut self) -> Result<bool, EngineError> {
        let mut done = false;
        while let Some(action) = self.coordinator.poll_action() {
            match action {
                CoordinatorAction::Send(message) => {
                    let task = match &message {
                        stillpoint_wire::Message::CheckpointSource(m) => m.task,
                        stillpoint_wire::Message::CheckpointComplete(m) => m.task,
                        stillpoint_wire::Message::CheckpointAbort(m) => m.task,
                        other => {
                            tracing::warn!(kind = ?other.kind(), "coordinator sent an unexpected message");
                            continue;
                        }
                    };
                    if let Some(channel) = self.control.get(&task) {
                        let _closed = channel.send(message);
                    }
                }
                CoordinatorAction::WriteManifest(request) => {
                    let checkpoint = request.checkpoint;
                    let outcome = self.commit(&request);
                    let now = self.now();
                    match outcome {
                        Ok(millis) => {
                            self.coordinator
                                .handle_manifest_written(now, checkpoint, Ok(millis))
                        }
                        Err(error) => {
                            tracing::warn!(%checkpoint, %error, "global manifest not written");
                            if matches!(
                                error,
                                EngineError::Store(stillpoint_backup::StoreError::LeaseLost { .. })
                            ) {
                                return Err(error);
                            }
                            self.coordinator.handle_manifest_written(
                                now,
                                checkpoint,
                                Err(error.to_string()),
                            );
                        }
                    }
                }
                CoordinatorAction::Completed(completed) => {
                    let stats = CheckpointStats::from(&completed);
                    tracing::info!(
                        checkpoint = %completed.checkpoint,
                        duration_ms = stats.duration_millis,
                        stall_us = stats.max_sync_micros,
                        uploaded = stats.uploaded_bytes,
                        state = stats.state_bytes,
                        "checkpoint complete"
                    );
                    if let Err(error) = self
                        .runtime
                        .block_on(self.store.put_stats(completed.checkpoint, &stats))
                    {
                        tracing::warn!(%error, "checkpoint statistics not stored");
                    }
                    self.metrics.checkpoint_completed(&stats);
                    if let Some(tell) = &mut self.on_checkpoint {
                        tell(&stats);
                    }
                    self.report.checkpoints.push(stats);
                    self.collect_garbage();
                    done |= self
                        .stop_after
                        .is_some_and(|after| completed.checkpoint > after);
                    let covered = self.offsets.get(&completed.checkpoint);
                    done |= self.finished.len() == self.sources.len()
                        && covered.is_some_and(|offsets| *offsets == self.finished);
                    self.offsets.retain(|id, _| *id > completed.checkpoint);
                }
                CoordinatorAction::Aborted { checkpoint, reason } => {
                    self.metrics.checkpoint_aborted();
                    tracing::warn!(%checkpoint, ?reason, "checkpoint aborted");
                }
                CoordinatorAction::FailJob {
                    consecutive_failures,
                    last,
                } => {
                    return Err(EngineError::Failed(format!(
                        "{consecutive_failures} consecutive checkpoints failed, the last: {last:?}"
                    )));
                }
            }
        }
        Ok(done)
    }

    /// Writes the global manifest; the commit time on success.
    fn commit(&mut self, request: &ManifestRequest) -> Result<u64, EngineError> {
        let created_at_millis = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let manifest = CheckpointManifest {
            stream: self.config.stream,
            checkpoint: request.checkpoint,
            trans: request.trans,
            kind: request.kind,
            created_at_millis,
            max_parallelism: self.config.max_parallelism,
            tasks: request
                .tasks
                .iter()
                .map(|t| TaskSnapshotRef {
                    task: t.task,
                    node: t.node,
                    manifest: t.report.manifest.clone(),
                    sha256: t.report.manifest_sha256,
                    state_bytes: t.report.state_bytes,
                })
                .collect(),
            sources: request
                .tasks
                .iter()
                .filter_map(|t| {
                    t.report.source_offset.clone().map(|offset| SourcePosition {
                        task: t.task,
                        offset,
                    })
                })
                .collect(),
        };
        self.runtime
            .block_on(self.store.commit(&manifest, &self.lease))?;
        self.offsets.insert(
            request.checkpoint,
            manifest
                .sources
                .iter()
                .map(|s| (s.task, s.offset.clone()))
                .collect(),
        );
        Ok(created_at_millis)
    }

    fn collect_garbage(&mut self) {
        let now_millis = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        if !self.backoff.ready(now_millis) {
            return;
        }
        let run = gc::collect(
            &self.store,
            &self.config.retention,
            &self.lease,
            SystemTime::now(),
        );
        match self.runtime.block_on(run) {
            Ok(report) => {
                self.backoff.succeeded();
                if !report.plan.is_empty() {
                    tracing::debug!(
                        expired = report.plan.expired.len(),
                        orphans = report.orphans_deleted,
                        "retention applied"
                    );
                }
            }
            Err(error) => {
                let wait = self.backoff.failed(now_millis);
                tracing::warn!(%error, ?wait, "garbage collection failed; backing off");
            }
        }
    }
}
