//! The stillpoint engine: a stream-processing runtime with in-band aligned barriers,
//! RocksDB keyed state with a write-back cache, incremental checkpoints to any
//! object store through OpenDAL, and exactly-once recovery. It composes
//! `stillpoint-task` (the protocol machines), `stillpoint-state` (keyed state) and
//! `stillpoint-backup` (the checkpoint store) into running jobs.
//!
//! ```
//! use stillpoint::{JobConfig, run_word_count};
//! use stillpoint_connectors::{WordCount, read_committed};
//!
//! let dir = tempfile::tempdir()?;
//! let mut config = JobConfig::new(dir.path().join("work"));
//! config.checkpoint_interval = std::time::Duration::from_millis(50);
//! let job = WordCount::generated(2, 3, 2_000, dir.path().join("out"));
//! // Runs until both sources are exhausted and a checkpoint covers everything.
//! let report = run_word_count(&config, &job, None)?;
//! assert!(!report.checkpoints.is_empty());
//! // Every word was counted exactly once: 4,000 updates published.
//! assert_eq!(read_committed(&job.output)?.len(), 4_000);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A run started on a store that holds a complete checkpoint restores from the newest
//! one that verifies (falling back past any that do not), rewinds its sources to the
//! recorded offsets and continues; sinks publish each checkpoint's output when it
//! completes, so a crash at any moment loses and duplicates nothing.

mod build;
mod config;
mod coordinator;
mod dataflow;
mod driver;
mod engine;
mod error;
mod job;
mod pipeline;
mod transport;

pub use config::{
    CheckpointCallback, FallBack, JobConfig, JobReport, Replayed, RunOptions, StartCallback,
    StopHandle,
};
pub use coordinator::{CheckpointRun, RunEnded};
pub use dataflow::{
    Bounds, CombinerFactory, Dataflow, OperatorFactory, Partitioning, Published, SinkFactory,
    SourceFactory, ToDataflow,
};
pub use engine::{
    EdgeData, Engine, InProcess, RemoteEdge, RestoreChoice, TaskStart, Tasks, Transport,
};
pub use error::EngineError;
pub use job::{checkpoint_history, run, run_word_count};
pub use pipeline::{Combine, Combiner, Operator, Persist, Sink, Source, SourcePoll};
/// The job's lease as [`Engine::lease`] takes it (refreshed by a task beside its
/// holder).
pub use stillpoint_backup::KeptLease;
/// The local snapshots a restart restores from ([`Engine::fetch_restore`]).
pub use stillpoint_backup::LocalRestore;
/// Checkpoint statistics and the job's metrics, with their endpoint.
pub use stillpoint_metrics::{
    CheckpointStats, ListenError, Metrics, MetricsServer, TaskCheckpointStats, TaskProgress,
};
/// A process's hold on its work directory ([`Engine::lock_work_dir`]).
pub use stillpoint_state::WorkDir;
/// The keyed state an [`Operator`] works on, and the timers it keeps there.
pub use stillpoint_state::{
    CachedState, KeyedState, MapState, TimeDomain, Timer, ValueState, processing_time,
};
/// The fewest records a data message is cut to by buffer debloating
/// ([`JobConfig::debloat_target`]).
pub use stillpoint_task::MIN_RECORDS_PER_MESSAGE;
/// How a [`Source`] derives watermarks from event times.
pub use stillpoint_task::WatermarkStrategy;
pub use stillpoint_wire::{BatchError, Record, decode_batch, encode_batch};
pub use stillpoint_wire::{EngineMessage, Envelope, EnvelopeError, read_envelope, write_envelope};
pub use transport::{CoordinatorInput, Signals};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctest;
