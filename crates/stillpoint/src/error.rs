//! The engine's error type.

use std::path::PathBuf;

/// Everything a job can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Keyed state failed.
    #[error("state: {0}")]
    State(#[from] stillpoint_state::StateError),
    /// The checkpoint store failed.
    #[error("store: {0}")]
    Store(#[from] stillpoint_backup::StoreError),
    /// A task machine refused a message.
    #[error("task protocol: {0}")]
    Task(#[from] stillpoint_task::TaskError),
    /// The coordinator machine refused a message or setting.
    #[error("coordinator: {0}")]
    Coordinator(#[from] stillpoint_task::CoordinatorError),
    /// A task's configuration is invalid.
    #[error("task configuration: {0}")]
    TaskConfig(#[from] stillpoint_task::ConfigError),
    /// A `Data` payload did not decode.
    #[error("records: {0}")]
    Batch(#[from] stillpoint_wire::BatchError),
    /// A local file operation failed.
    #[error("{operation} {path}: {message}")]
    Io {
        /// What was being done.
        operation: &'static str,
        /// The file.
        path: PathBuf,
        /// The system's message.
        message: String,
    },
    /// A checkpoint cannot be restored into the job's task graph.
    #[error("invalid job: {0}")]
    Graph(#[from] stillpoint_task::GraphError),
    /// The job description cannot run.
    #[error("invalid job: {0}")]
    Invalid(String),
    /// An injected crash stopped the job (tests and `xtask torture`).
    #[error("the job was crashed on purpose ({0})")]
    Crashed(String),
    /// A task or the coordinator stopped unexpectedly.
    #[error("{0} stopped unexpectedly")]
    Stopped(String),
    /// A node of a cluster job was lost (its connection broke).
    #[error("node lost: {0}")]
    NodeLost(String),
    /// A network connection failed (cluster mode).
    #[error("network: {0}")]
    Net(String),
    /// The metrics endpoint could not listen where asked.
    #[error("{0}")]
    Metrics(#[from] stillpoint_metrics::ListenError),
    /// The store has committed checkpoints but none of them can be restored. Starting
    /// from scratch instead would publish the sinks' output a second time, so the job
    /// refuses to start.
    #[error(
        "none of the {committed} committed checkpoint(s) in the store can be restored (newest: {newest}); refusing to start from scratch, which would publish the output again: repair the store (see `stillpoint checkpoints verify`) or point the job at an empty one"
    )]
    NothingRestorable {
        /// How many committed checkpoints there are.
        committed: usize,
        /// Why the newest one cannot be restored.
        newest: String,
    },
    /// The sinks already published output newer than the restore point (the newer
    /// checkpoints are damaged, uncommitted or gone): a restart from it would publish
    /// those records again.
    #[error(
        "restoring {restored} would publish again what sink stage {stage:?} already published: {published}; the store no longer has a checkpoint that covers it (see `stillpoint checkpoints verify`) and it cannot be replayed exactly: {why}. Repair or restore the store, or accept the duplicates with --allow-duplicates ([job] allow_duplicates = true)"
    )]
    WouldRepublish {
        /// The restore point, as words (`checkpoint 3`, `from scratch`).
        restored: String,
        /// The sink stage.
        stage: String,
        /// What it published after the restore point (checkpoints and records).
        published: String,
        /// Why no exact replay is possible.
        why: String,
    },
    /// Too many consecutive checkpoints failed.
    #[error("the job failed: {0}")]
    Failed(String),
}

impl EngineError {
    /// Whether a restore failure means the checkpoint is bad (fall back to an older
    /// one) rather than the store being unreachable or the job invalid (give up).
    #[must_use]
    pub fn is_corrupt_checkpoint(&self) -> bool {
        match self {
            Self::Store(error) => !error.is_unavailable(),
            Self::State(_) => true,
            _ => false,
        }
    }

    /// Refuses a fresh start when the store has `committed` checkpoints and none was
    /// restored (the reasons in `fell_back`, newest first); `Ok` when it has none.
    pub(crate) fn refuse_fresh_start(
        committed: usize,
        fell_back: &[crate::FallBack],
    ) -> Result<(), Self> {
        if committed == 0 {
            return Ok(());
        }
        Err(Self::NothingRestorable {
            committed,
            newest: fell_back.first().map_or_else(
                || "skipped".to_owned(),
                |f| format!("checkpoint {}: {}", f.checkpoint.get(), f.problem),
            ),
        })
    }

    /// An I/O error naming the operation and the path (for connectors).
    #[must_use]
    pub fn io(operation: &'static str, path: impl Into<PathBuf>, error: &std::io::Error) -> Self {
        Self::Io {
            operation,
            path: path.into(),
            message: error.to_string(),
        }
    }
}

impl From<stillpoint_wire::EnvelopeError> for EngineError {
    fn from(error: stillpoint_wire::EnvelopeError) -> Self {
        Self::Net(error.to_string())
    }
}
