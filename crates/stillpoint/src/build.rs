//! Building a job's tasks: the word count's topology and where each task runs, the
//! restore point's snapshots a set of tasks needs (rescaled when the parallelism
//! changed), and spawning one task — state restored or opened, source positioned,
//! sink recovered — with its driver and export threads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use stillpoint_backup::{Store, StoreError, VerifyDepth};
use stillpoint_state::{CachedState, KeyGroups, RocksStateBackend, StateOwner};
use stillpoint_task::{RestoredCheckpoint, TaskConfig, TaskLevel, TaskMachine};
use stillpoint_wire::{
    CheckpointId, CheckpointManifest, Message, NodeId, SnapshotManifest, TaskId,
};

use crate::driver::{ExportJob, ExportOutcome, Partitioner, Role, TaskDriver, export_loop};
use crate::metrics::Metrics;
use crate::transport::{CoordinatorInput, Links};
use crate::{EngineError, JobConfig, KeyedCount, TransactionalFileSink, WordCount};

/// The word count's tasks: sources `1..=s`, counters next, then one sink per counter.
#[derive(Clone, Debug)]
pub(crate) struct Topology {
    pub(crate) sources: Vec<TaskId>,
    pub(crate) aggregators: Vec<TaskId>,
    pub(crate) sinks: Vec<TaskId>,
}

impl Topology {
    pub(crate) fn new(sources: u32, aggregators: u32) -> Self {
        let ids = |from: u32, n: u32| (from..from + n).map(TaskId).collect::<Vec<_>>();
        Self {
            sources: ids(1, sources),
            aggregators: ids(1 + sources, aggregators),
            sinks: ids(1 + sources + aggregators, aggregators),
        }
    }

    pub(crate) fn of(job: &WordCount) -> Self {
        Self::new(job.sources, job.aggregators)
    }

    /// The topology a checkpoint was taken with (its task and source counts).
    fn of_checkpoint(manifest: &CheckpointManifest) -> Self {
        let sources = u32::try_from(manifest.sources.len()).unwrap_or(u32::MAX);
        let rest = u32::try_from(manifest.tasks.len()).unwrap_or(u32::MAX);
        Self::new(sources, rest.saturating_sub(sources) / 2)
    }

    pub(crate) fn all(&self) -> Vec<TaskId> {
        self.sources
            .iter()
            .chain(&self.aggregators)
            .chain(&self.sinks)
            .copied()
            .collect()
    }

    /// Every data edge `(upstream, downstream)`: sources to every counter (hash by key
    /// group), each counter to its sink (forward).
    pub(crate) fn edges(&self) -> Vec<(TaskId, TaskId)> {
        let mut edges = Vec::new();
        for source in &self.sources {
            for aggregator in &self.aggregators {
                edges.push((*source, *aggregator));
            }
        }
        for (aggregator, sink) in self.aggregators.iter().zip(&self.sinks) {
            edges.push((*aggregator, *sink));
        }
        edges
    }

    pub(crate) fn level(&self, task: TaskId) -> TaskLevel {
        if self.sources.contains(&task) {
            TaskLevel::Source
        } else if self.aggregators.contains(&task) {
            TaskLevel::Aggregate
        } else {
            TaskLevel::Sink
        }
    }

    /// The task's index within its stage.
    fn index(&self, task: TaskId) -> u32 {
        let stage = match self.level(task) {
            TaskLevel::Source => &self.sources,
            TaskLevel::Aggregate => &self.aggregators,
            TaskLevel::Sink => &self.sinks,
        };
        u32::try_from(stage.iter().position(|t| *t == task).unwrap_or(0)).unwrap_or(0)
    }

    /// The node a task runs on, of `nodes` (round robin by task id, so every stage
    /// spreads over the nodes and most edges cross them).
    pub(crate) fn node_of(task: TaskId, nodes: u32) -> NodeId {
        NodeId((task.get().saturating_sub(1)) % nodes.max(1) + 1)
    }

    fn key_group_range(
        &self,
        groups: KeyGroups,
        task: TaskId,
    ) -> Result<stillpoint_wire::KeyGroupRange, EngineError> {
        let parallelism = u32::try_from(self.aggregators.len()).unwrap_or(u32::MAX);
        Ok(match self.level(task) {
            TaskLevel::Source => groups.all(),
            TaskLevel::Aggregate | TaskLevel::Sink => {
                groups.range_of(parallelism, self.index(task))?
            }
        })
    }
}

/// The checkpoint a job restores from, and the local copies of the snapshots the
/// tasks of this process need.
#[derive(Debug)]
pub(crate) struct Restore {
    pub(crate) manifest: CheckpointManifest,
    /// Old task → its snapshot's manifest and local directory.
    pub(crate) downloads: BTreeMap<TaskId, (SnapshotManifest, PathBuf)>,
}

impl Restore {
    /// Whether the checkpoint was taken with this topology (every task restores its
    /// own snapshot); otherwise the counters are rescaled by key group.
    pub(crate) fn same_shape(&self, topology: &Topology) -> bool {
        let old = Topology::of_checkpoint(&self.manifest);
        old.sources.len() == topology.sources.len()
            && old.aggregators.len() == topology.aggregators.len()
    }
}

/// The old tasks whose snapshots `tasks` need to restore from `manifest`.
pub(crate) fn snapshots_needed(
    manifest: &CheckpointManifest,
    topology: &Topology,
    tasks: &[TaskId],
    groups: KeyGroups,
) -> Result<Vec<TaskId>, EngineError> {
    let old = Topology::of_checkpoint(manifest);
    if old.sources.len() != topology.sources.len() {
        return Err(EngineError::Invalid(format!(
            "checkpoint {} was taken with {} sources, the job has {}: only the counters' parallelism can change on restore",
            manifest.checkpoint,
            old.sources.len(),
            topology.sources.len()
        )));
    }
    if old.aggregators.len() == topology.aggregators.len() {
        return Ok(tasks.to_vec());
    }
    // Rescale: counters restore from every old counter whose key groups overlap.
    let mut needed = BTreeSet::new();
    for task in tasks {
        match topology.level(*task) {
            TaskLevel::Source => {
                needed.insert(*task);
            }
            TaskLevel::Aggregate => {
                let range = topology.key_group_range(groups, *task)?;
                for reference in &manifest.tasks {
                    if old.aggregators.contains(&reference.task) {
                        let old_range = old.key_group_range(groups, reference.task)?;
                        if old_range.intersection(&range).is_some() {
                            needed.insert(reference.task);
                        }
                    }
                }
            }
            // Sinks keep no keyed state: they start empty.
            TaskLevel::Sink => {}
        }
    }
    Ok(needed.into_iter().collect())
}

/// Verifies that every file of checkpoint `id` is present, then downloads (verified,
/// reusing matching local files) the snapshots of `wanted` old tasks (all when
/// `None`) into `work_dir/restore/task-N`.
pub(crate) async fn fetch_restore(
    store: &Store,
    work_dir: &Path,
    id: CheckpointId,
    wanted: impl Fn(&CheckpointManifest) -> Result<Vec<TaskId>, EngineError>,
) -> Result<Restore, EngineError> {
    let verified = store.verify(id, VerifyDepth::Presence, &()).await?;
    if let Some(problem) = verified.problems.first() {
        return Err(StoreError::Corrupt {
            path: problem.object.clone(),
            problem: format!("{problem} ({} problem(s) in all)", verified.problems.len()),
        }
        .into());
    }
    let manifest = store.checkpoint(id).await?;
    let wanted = wanted(&manifest)?;
    let mut downloads = BTreeMap::new();
    for reference in manifest.tasks.iter().filter(|r| wanted.contains(&r.task)) {
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
    Ok(Restore {
        manifest,
        downloads,
    })
}

/// Whether a restore failure means the checkpoint is bad (fall back to an older one)
/// rather than the store being unreachable or the job invalid (give up).
pub(crate) fn is_corrupt_checkpoint(error: &EngineError) -> bool {
    match error {
        EngineError::Store(error) => !error.is_unavailable(),
        EngineError::State(_) => true,
        _ => false,
    }
}

/// Removes files of a previous restore that the snapshot about to be downloaded does
/// not list (a restore directory must hold exactly the snapshot's files).
fn clear_extra_files(dir: &Path, snapshot: &SnapshotManifest) -> Result<(), StoreError> {
    let local = |operation: &'static str, path: &Path, e: &std::io::Error| StoreError::Local {
        operation,
        path: path.to_path_buf(),
        message: e.to_string(),
        kind: e.kind(),
    };
    let keep: BTreeSet<&str> = snapshot.files.iter().map(|f| f.path.as_str()).collect();
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

/// Live databases and snapshots start empty each run; restore downloads are kept, so
/// files that still verify are not fetched again.
pub(crate) fn clear_live_dirs(work_dir: &Path) -> Result<(), EngineError> {
    for dir in ["db", "snapshots"] {
        let path = work_dir.join(dir);
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(EngineError::io("clear", &path, &e)),
        }
    }
    Ok(())
}

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
    pub(crate) job: &'a WordCount,
    pub(crate) topology: &'a Topology,
    pub(crate) groups: KeyGroups,
    pub(crate) store: &'a Store,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) epoch: Instant,
    pub(crate) node: NodeId,
    pub(crate) metrics: &'a Metrics,
    pub(crate) restore: Option<&'a Restore>,
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
        let range = self.topology.key_group_range(self.groups, task)?;
        let state = self.config.state.clone();
        let fresh = |state| RocksStateBackend::open(&db_dir, state, self.groups, range, owner);
        let Some(restore) = self.restore else {
            return Ok(fresh(state)?);
        };
        if restore.same_shape(self.topology) {
            return match restore.downloads.get(&task) {
                Some((snapshot, dir)) => Ok(RocksStateBackend::restore(
                    dir,
                    snapshot,
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
        let sources: Vec<(PathBuf, SnapshotManifest)> = match self.topology.level(task) {
            TaskLevel::Sink => Vec::new(),
            TaskLevel::Source => restore
                .downloads
                .get(&task)
                .map(|(m, d)| (d.clone(), m.clone()))
                .into_iter()
                .collect(),
            TaskLevel::Aggregate => {
                let old_counters = Topology::of_checkpoint(&restore.manifest).aggregators;
                restore
                    .downloads
                    .iter()
                    .filter(|(old, (m, _))| {
                        old_counters.contains(old) && m.key_groups.intersection(&range).is_some()
                    })
                    .map(|(_, (m, d))| (d.clone(), m.clone()))
                    .collect()
            }
        };
        if sources.is_empty() {
            return Ok(fresh(state)?);
        }
        Ok(RocksStateBackend::restore_rescaled(
            &sources,
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
        let (downstreams, partitioner) = match level {
            TaskLevel::Source => (
                self.topology.aggregators.clone(),
                Partitioner::by_key_group(self.groups, self.job.aggregators)?,
            ),
            TaskLevel::Aggregate => (
                self.topology
                    .sinks
                    .get(self.topology.index(task) as usize)
                    .copied()
                    .into_iter()
                    .collect(),
                Partitioner::Forward,
            ),
            TaskLevel::Sink => (Vec::new(), Partitioner::Forward),
        };
        let upstreams: Vec<TaskId> = wiring.inputs.iter().map(|(u, _)| *u).collect();
        let state = CachedState::new(self.state(task)?);
        let restored = self.restore.map(|r| RestoredCheckpoint {
            checkpoint: r.manifest.checkpoint,
            trans: r.manifest.trans,
            kind: r.manifest.kind,
            source_offset: r.manifest.source_offset(task).cloned(),
        });
        let role = match level {
            TaskLevel::Source => {
                let mut source = self.job.source(self.topology.index(task))?;
                source.seek(restored.as_ref().and_then(|r| r.source_offset.as_ref()))?;
                Role::Source(source)
            }
            TaskLevel::Aggregate => Role::Operator(Box::new(KeyedCount)),
            TaskLevel::Sink => {
                let mut sink = TransactionalFileSink::new(&self.job.output, task);
                crate::Sink::recover(&mut sink, restored.as_ref().map(|r| r.checkpoint))?;
                Role::Sink(Box::new(sink))
            }
        };
        let task_config = TaskConfig::new(self.config.stream, task, self.node, level)
            .upstreams(upstreams)
            .downstreams(downstreams.clone());
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
        let mut driver = TaskDriver::new(
            self.config.stream,
            task,
            machine,
            role,
            state,
            wiring.inputs,
            wiring.control,
            export_tx,
            exported_rx,
            wiring.links,
            downstreams,
            partitioner,
            self.config
                .work_dir
                .join("snapshots")
                .join(format!("task-{}", task.get())),
            self.epoch,
        );
        driver.records = self.metrics.records_of(task);
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

/// Shared control channels of the tasks in one process.
pub(crate) type ControlMap = Arc<BTreeMap<TaskId, Sender<Message>>>;
