//! Building a job's tasks: spawning one task — state restored or opened, source positioned,
//! sink recovered — with its driver and export threads.

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use stillpoint_backup::{LocalRestore, Store};
use stillpoint_state::{
    CachedState, DigestCheck, KeyGroups, Partitioner, RocksStateBackend, SnapshotDirs, StateOwner,
};
use stillpoint_task::{
    CombineClock, EventClock, RestoredCheckpoint, TaskConfig, TaskGraph, TaskMachine,
    WatermarkGenerator,
};
use stillpoint_wire::{Message, NodeId, SnapshotManifest, TaskId};

use crate::dataflow::StageKind;
use crate::driver::{Combining, ExportJob, ExportOutcome, Progress, Role, TaskDriver, export_loop};
use crate::transport::{CoordinatorInput, Links};
use crate::{Dataflow, EngineError, JobConfig, Partitioning};
use stillpoint_metrics::Metrics;
use stillpoint_task::{Bounds, Debloater, ReplayRole};

/// A task's connections: its inputs (one bounded channel per upstream), its control
/// channel and where its messages go.
pub(crate) struct Wiring {
    pub(crate) inputs: Vec<(TaskId, Receiver<Message>)>,
    pub(crate) control: Receiver<Message>,
    pub(crate) links: Links,
}

/// A running task's threads.
pub(crate) struct Spawned {
    pub(crate) task: TaskId,
    pub(crate) worker: JoinHandle<Result<(), EngineError>>,
    pub(crate) exporter: JoinHandle<()>,
}

/// What every task of one process is built from.
pub(crate) struct Builder<'a> {
    pub(crate) config: &'a JobConfig,
    pub(crate) flow: &'a Dataflow,
    pub(crate) topology: &'a TaskGraph,
    pub(crate) groups: KeyGroups,
    pub(crate) store: &'a Store,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) epoch: Instant,
    pub(crate) node: NodeId,
    pub(crate) metrics: &'a Metrics,
    pub(crate) restore: Option<&'a LocalRestore>,
    /// Where each source stops, when the restore replays up to published output.
    pub(crate) replay: Option<&'a Bounds>,
}

impl Builder<'_> {
    /// Opens or restores the task's state: its own snapshot when the shape is
    /// unchanged, the overlapping old counters' snapshots when rescaled.
    fn state(&self, task: TaskId) -> Result<RocksStateBackend, EngineError> {
        let owner = StateOwner {
            stream: self.config.stream,
            task,
        };
        let db_dir = self
            .config
            .work_dir
            .join("db")
            .join(format!("task-{}", task.get()));
        let range = self
            .topology
            .key_groups(self.groups.max_parallelism(), task)?;
        let state = self.config.state.clone();
        let fresh = |state| RocksStateBackend::open(&db_dir, state, self.groups, range, owner);
        let Some(restore) = self.restore else {
            return Ok(fresh(state)?);
        };
        if self.topology.same_shape(&restore.manifest) {
            return match restore.downloads.get(&task) {
                // The store's download checked every byte against its digest.
                Some((snapshot, dir)) => Ok(RocksStateBackend::restore_checked(
                    dir,
                    snapshot,
                    DigestCheck::AlreadyHashed,
                    &db_dir,
                    state,
                    self.groups,
                    owner,
                )?),
                None => Err(EngineError::Invalid(format!(
                    "checkpoint {} has no snapshot of {task}",
                    restore.manifest.checkpoint
                ))),
            };
        }
        let old = self.topology.of_checkpoint(&restore.manifest)?;
        let sources: Vec<(PathBuf, SnapshotManifest)> = self
            .topology
            .restores_from(&old, self.groups.max_parallelism(), task)?
            .iter()
            .filter_map(|old_task| restore.downloads.get(old_task))
            .map(|(m, d)| (d.clone(), m.clone()))
            .collect();
        if sources.is_empty() {
            return Ok(fresh(state)?);
        }
        Ok(RocksStateBackend::restore_rescaled_checked(
            &sources,
            DigestCheck::AlreadyHashed,
            &db_dir,
            state,
            self.groups,
            range,
            owner,
        )?)
    }

    /// Builds and starts `task`; a task that fails reports it through `failures`.
    pub(crate) fn spawn(
        &self,
        task: TaskId,
        wiring: Wiring,
        failures: Sender<CoordinatorInput>,
    ) -> Result<Spawned, EngineError> {
        let level = self.topology.level(task);
        let (downstreams, partitioner) = match self.topology.downstreams(task) {
            None => (Vec::new(), Partitioner::Forward),
            Some((tasks, Partitioning::Forward, _)) => (tasks, Partitioner::Forward),
            Some((tasks, Partitioning::Broadcast, _)) => (tasks, Partitioner::Broadcast),
            Some((tasks, Partitioning::Hash, parallelism)) => (
                tasks,
                Partitioner::KeyGroups(self.groups.router(parallelism)?),
            ),
        };
        let upstreams: Vec<TaskId> = wiring.inputs.iter().map(|(u, _)| *u).collect();
        let clock = EventClock::new(upstreams.iter().copied());
        let state = CachedState::new(self.state(task)?);
        let restored = self.restore.map(|r| RestoredCheckpoint {
            checkpoint: r.manifest.checkpoint,
            trans: r.manifest.trans,
            kind: r.manifest.kind,
            source_offset: r.manifest.source_offset(task).cloned(),
        });
        let (stage, index) = self
            .topology
            .position(task)
            .and_then(|(stage, index)| Some((self.flow.stages.get(stage)?, index)))
            .ok_or_else(|| {
                EngineError::Invalid(format!("{task} is in no stage of the dataflow"))
            })?;
        let role = match &stage.kind {
            StageKind::Source(factory) => {
                let mut source = factory(index)?;
                source.seek(restored.as_ref().and_then(|r| r.source_offset.as_ref()))?;
                Role::Source(source)
            }
            StageKind::Operator(factory) => Role::Operator(factory(index)?),
            StageKind::Sink(factory) => {
                let mut sink = factory.create(task)?;
                sink.recover(restored.as_ref().map(|r| r.checkpoint))?;
                Role::Sink(sink)
            }
        };
        let mut task_config = TaskConfig::new(self.config.stream, task, self.node, level)
            .upstreams(upstreams)
            .downstreams(downstreams.clone());
        task_config.barrier_wait = self.config.barrier_wait;
        let machine = TaskMachine::new(task_config, restored)?;
        let (export_tx, export_rx) = crossbeam_channel::unbounded::<ExportJob>();
        let (exported_tx, exported_rx) = crossbeam_channel::unbounded::<ExportOutcome>();
        let exporter = {
            let store = self.store.clone();
            let handle = self.runtime.clone();
            let node = self.node;
            std::thread::Builder::new()
                .name(format!("export-{}", task.get()))
                .spawn(move || export_loop(export_rx, exported_tx, store, handle, node))
                .map_err(|e| EngineError::io("spawn", "export thread", &e))?
        };
        let replay = ReplayRole::of(self.replay, level, task)
            .map_err(|t| EngineError::Invalid(format!("{t} has no bound in the replay")))?;
        let combiner: Option<Combining> = match &stage.combiner {
            Some((when, factory)) => Some((factory(index)?, CombineClock::new(*when))),
            None => None,
        };
        let driver = TaskDriver {
            stream: self.config.stream,
            task,
            machine,
            state,
            inputs: wiring.inputs,
            control: wiring.control,
            exports: export_tx,
            exported: exported_rx,
            links: wiring.links,
            downstreams,
            partitioner,
            snapshots: SnapshotDirs::of_task(&self.config.work_dir, task),
            epoch: self.epoch,
            batch: self.config.batch_records.max(1),
            records: self.metrics.records_of(task),
            gauges: self.metrics.progress_of(task),
            replay,
            progress: Progress::default(),
            watermarks: match &role {
                Role::Source(source) => source.watermarks().map(WatermarkGenerator::new),
                Role::Operator(_) | Role::Sink(_) => None,
            },
            debloat: match (&role, self.config.debloat_target) {
                (Role::Source(_), _) | (_, None) => None,
                (Role::Operator(_) | Role::Sink(_), Some(target)) => Some(Debloater::new(
                    target,
                    self.config.channel_batches,
                    self.config.batch_records,
                )),
            },
            role,
            clock,
            combiner,
        };
        let worker = std::thread::Builder::new()
            .name(format!("task-{}", task.get()))
            .spawn(move || {
                let outcome = driver.run();
                if let Err(error) = &outcome
                    && !matches!(error, EngineError::Crashed(_) | EngineError::Stopped(_))
                {
                    let _closed = failures.send(CoordinatorInput::TaskFailed {
                        task,
                        error: error.to_string(),
                    });
                }
                outcome
            })
            .map_err(|e| EngineError::io("spawn", "task thread", &e))?;
        Ok(Spawned {
            task,
            worker,
            exporter,
        })
    }
}

/// Joins every task; the first real failure (not a crash or a stop) is returned.
pub(crate) fn join_all(spawned: Vec<Spawned>) -> Option<EngineError> {
    let mut first_error = None;
    for Spawned {
        task,
        worker,
        exporter,
    } in spawned
    {
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
    first_error
}
