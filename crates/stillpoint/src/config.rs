//! What a job is configured with and what a run reports: the job's configuration,
//! the options that drive one run from outside, and the statistics and report it
//! returns.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use stillpoint_backup::{Retention, StoreOptions};
use stillpoint_metrics::CheckpointStats;
use stillpoint_state::StateConfig;
use stillpoint_wire::{CheckpointId, StreamId};

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
    /// How long a task may align on a checkpoint (some inputs' barriers in, others
    /// not) before it asks the missing upstreams where their barrier is and logs a
    /// warning naming them and their answers; again every such period (default 10 s).
    pub barrier_wait: Duration,
    /// Checkpoints in flight at once (default 1, as Flink's
    /// `execution.checkpointing.max-concurrent-checkpoints`): with more, a slow upload
    /// does not hold back the next trigger.
    pub max_concurrent_checkpoints: usize,
    /// Least time from the end of one checkpoint to the trigger of the next (default
    /// 0), so slow checkpoints cannot take all the time.
    pub min_pause: Duration,
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
    /// Records one data message carries at most (default 256); a keyed source reads
    /// this many per downstream at once.
    pub batch_records: usize,
    /// Data messages buffered per edge before the sender blocks (default 4). With
    /// `batch_records` this is the latency/throughput dial: a barrier waits behind
    /// everything queued on its edge (the alignment stall; Flink's buffer debloating
    /// reasons the same way), while every message costs a channel hand-off and often
    /// a thread wake-up. Measured in the engine bench (docs/performance.md): 1024 × 1
    /// runs the 1,000-key count ≈ 20 % faster than 256 × 4 but doubles the stall p50
    /// on a large restored state.
    pub channel_batches: usize,
    /// Buffer debloating (default 1 ms; `None`: off): each task measures what its
    /// records cost and asks its upstreams in this process for data messages small
    /// enough that a full input edge (`channel_batches` messages) drains within this
    /// time — so a barrier waits behind about this much work on any edge, however
    /// expensive a record is (Flink's `taskmanager.network.memory.buffer-debloat`).
    /// Cheap records keep `batch_records` per message; a source reads no more at once
    /// than fills one asked message per downstream. Edges to other processes keep the
    /// full size.
    pub debloat_target: Option<Duration>,
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
            barrier_wait: Duration::from_secs(10),
            max_concurrent_checkpoints: 1,
            min_pause: Duration::ZERO,
            tolerable_failures: 3,
            retention: Retention::default(),
            max_parallelism: 128,
            state: StateConfig::default(),
            lease_ttl: Duration::from_secs(60),
            metrics_listen: None,
            batch_records: 256,
            channel_batches: 4,
            debloat_target: Some(Duration::from_millis(1)),
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
    paused: AtomicBool,
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

    /// Pauses the job's sources: they read nothing until [`StopHandle::resume`],
    /// while records already read flow on and checkpoints go on (barriers still
    /// flow), so a paused job can take a savepoint or stop. Idempotent.
    pub fn pause(&self) {
        self.0.paused.store(true, Ordering::SeqCst);
    }

    /// Lets paused sources read again (idempotent).
    pub fn resume(&self) {
        self.0.paused.store(false, Ordering::SeqCst);
    }

    /// Whether the sources are asked to pause.
    #[must_use]
    pub fn paused(&self) -> bool {
        self.0.paused.load(Ordering::SeqCst)
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
