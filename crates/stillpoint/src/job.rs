//! A job run in one process: the engine opened on the dataflow, recovery from the
//! store, the tasks started over in-process channels, and the coordinator driver
//! until the job is done or stopped.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use stillpoint_backup::{LocalRestore, Store};
use stillpoint_wire::NodeId;

use crate::{
    CheckpointRun, CheckpointStats, Engine, EngineError, FallBack, InProcess, JobConfig, JobReport,
    RestoreChoice, RunOptions, TaskStart, ToDataflow,
};
use stillpoint_metrics::Metrics;

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
    let mut engine = Engine::open(config, job)?;
    let work_dir = engine.lock_work_dir()?;
    let tasks = engine.tasks();
    let metrics = Arc::new(Metrics::new(&tasks));
    // Listening first: a taken address fails the run before the store is touched.
    let _served =
        engine.serve_metrics(config.metrics_listen, &metrics, options.on_metrics.take())?;
    let lease = engine.lease()?;
    let mut report = JobReport::default();
    let (restore, choice) = restore_point(&engine, &mut report)?;
    report.restored_from = choice.checkpoint;
    report.replayed = choice.replayed();
    if let Some(tell) = options.on_start.take() {
        tell(&report);
    }
    if let Some(id) = report.restored_from {
        metrics.restored(id.get());
    }
    let (transport, inputs) = InProcess::new();
    let start = TaskStart {
        work_dir: &work_dir,
        tasks: &tasks,
        node: NODE,
        restore: restore.as_ref(),
        replay: choice.replay(),
        metrics: &metrics,
    };
    let mut running = engine.start_tasks(&start, Box::new(transport))?;
    let signals = Arc::clone(running.signals());
    if let Some(after) = options.crash_after {
        let signals = Arc::clone(&signals);
        std::thread::spawn(move || {
            std::thread::sleep(after);
            signals.crash();
        });
    }
    let ended = engine.run_checkpoints(CheckpointRun {
        lease,
        choice: &choice,
        route: Box::new(running.router()),
        inputs,
        signals: Arc::clone(&signals),
        on_pause: None,
        metrics,
        report: &mut report,
        options: &mut options,
    });
    if ended.result.is_ok() {
        signals.stop();
    } else {
        signals.crash();
    }
    let first_error = running.join();
    ended.result?;
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
    engine.release(ended.lease)?;
    Ok(report)
}

/// Finds the checkpoint to restore ([`Engine::choose_restore`]) and downloads its
/// snapshots; one whose snapshots do not download and verify is recorded in
/// `report.fell_back_from`, logged, and the next older one chosen. An unreachable
/// store or an impossible restore is an error, never a reason to fall back.
fn restore_point(
    engine: &Engine,
    report: &mut JobReport,
) -> Result<(Option<LocalRestore>, RestoreChoice), EngineError> {
    let all = engine.tasks();
    let mut exclude = BTreeSet::new();
    loop {
        let choice = engine.choose_restore(&exclude, report)?;
        let Some(id) = choice.checkpoint else {
            return Ok((None, choice));
        };
        match engine.fetch_restore(id, &all) {
            Ok(restore) => {
                tracing::info!(checkpoint = %id, "restoring");
                return Ok((Some(restore), choice));
            }
            Err(error) if !error.is_corrupt_checkpoint() => return Err(error),
            Err(error) => {
                tracing::warn!(checkpoint = %id, %error, "checkpoint does not verify; falling back to an older one");
                report.fell_back_from.push(FallBack {
                    checkpoint: id,
                    problem: error.to_string(),
                });
                exclude.insert(id);
            }
        }
    }
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
