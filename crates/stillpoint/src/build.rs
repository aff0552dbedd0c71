//! Building a job's tasks: the dataflow's topology and where each task runs, the
//! restore point's snapshots a set of tasks needs (rescaled when the parallelism
//! changed), and spawning one task — state restored or opened, source positioned,
//! sink recovered — with its driver and export threads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use stillpoint_backup::{Store, StoreError, VerifyDepth};
use stillpoint_state::{CachedState, KeyGroups, RocksStateBackend, StateOwner};
use stillpoint_task::{RestoredCheckpoint, TaskConfig, TaskLevel, TaskMachine};
use stillpoint_wire::{
    CheckpointId, CheckpointManifest, Message, NodeId, SnapshotManifest, TaskId,
};

use crate::dataflow::{Bounds, StageKind};
use crate::driver::{
    ExportJob, ExportOutcome, Partitioner, ReplayRole, Role, TaskDriver, export_loop,
};
use crate::metrics::Metrics;
use crate::transport::{CoordinatorInput, Links};
use crate::{Dataflow, EngineError, JobConfig, Partitioning};

/// One stage's tasks: ids `first..first + parallelism`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct StageTasks {
    first: u32,
    parallelism: u32,
    input: Partitioning,
    level: TaskLevel,
}

impl StageTasks {
    fn tasks(&self) -> impl Iterator<Item = TaskId> + '_ {
        (self.first..self.first + self.parallelism).map(TaskId)
    }

    fn task(&self, index: u32) -> Option<TaskId> {
        (index < self.parallelism).then(|| TaskId(self.first + index))
    }
}

/// A dataflow's tasks, numbered from 1 stage by stage, and its edges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Topology {
    stages: Vec<StageTasks>,
    pub(crate) sources: Vec<TaskId>,
}

impl Topology {
    /// Stages of these parallelisms fed through these partitionings (the first
    /// stage's is ignored).
    fn from_shape(parallelisms: &[u32], inputs: &[Partitioning]) -> Self {
        let last = parallelisms.len().saturating_sub(1);
        let mut first = 1;
        let mut stages = Vec::new();
        for (index, (parallelism, input)) in parallelisms.iter().zip(inputs).enumerate() {
            let level = match index {
                0 => TaskLevel::Source,
                i if i == last => TaskLevel::Sink,
                _ => TaskLevel::Aggregate,
            };
            stages.push(StageTasks {
                first,
                parallelism: *parallelism,
                input: *input,
                level,
            });
            first += parallelism;
        }
        let sources = stages
            .first()
            .map(|s| s.tasks().collect())
            .unwrap_or_default();
        Self { stages, sources }
    }

    pub(crate) fn of(flow: &Dataflow) -> Self {
        let inputs: Vec<Partitioning> = flow.stages.iter().map(|s| s.input).collect();
        Self::from_shape(&flow.parallelisms(), &inputs)
    }

    /// The topology a checkpoint was taken with: its recorded stages with this
    /// dataflow's partitionings (a restore may change parallelisms, not the chain),
    /// or for a checkpoint that recorded none, the word count's three stages.
    fn of_checkpoint(&self, manifest: &CheckpointManifest) -> Result<Self, EngineError> {
        let inputs: Vec<Partitioning> = self.stages.iter().map(|s| s.input).collect();
        let stages = if manifest.stages.is_empty() {
            let sources = u32::try_from(manifest.sources.len()).unwrap_or(u32::MAX);
            let rest = u32::try_from(manifest.tasks.len()).unwrap_or(u32::MAX);
            let counters = rest.saturating_sub(sources) / 2;
            vec![sources, counters, counters]
        } else {
            manifest.stages.clone()
        };
        if stages.len() != inputs.len() {
            return Err(EngineError::Invalid(format!(
                "checkpoint {} was taken with {} stages, the dataflow has {}: a restore may change parallelisms, not the stages",
                manifest.checkpoint,
                stages.len(),
                inputs.len()
            )));
        }
        Ok(Self::from_shape(&stages, &inputs))
    }

    /// The parallelism of each stage.
    pub(crate) fn parallelisms(&self) -> Vec<u32> {
        self.stages.iter().map(|s| s.parallelism).collect()
    }

    pub(crate) fn all(&self) -> Vec<TaskId> {
        self.stages.iter().flat_map(StageTasks::tasks).collect()
    }

    /// The stage of `task` and its index within the stage.
    pub(crate) fn position(&self, task: TaskId) -> Option<(usize, u32)> {
        self.stages.iter().enumerate().find_map(|(stage, tasks)| {
            let index = task.get().checked_sub(tasks.first)?;
            (index < tasks.parallelism).then_some((stage, index))
        })
    }

    /// The downstreams of `task` and how its output is spread over them.
    pub(crate) fn downstreams(
        &self,
        task: TaskId,
        groups: KeyGroups,
    ) -> Result<(Vec<TaskId>, Partitioner), EngineError> {
        let Some((stage, index)) = self.position(task) else {
            return Ok((Vec::new(), Partitioner::Forward));
        };
        let Some(next) = self.stages.get(stage + 1) else {
            return Ok((Vec::new(), Partitioner::Forward));
        };
        Ok(match next.input {
            Partitioning::Forward => (next.task(index).into_iter().collect(), Partitioner::Forward),
            Partitioning::Hash => (
                next.tasks().collect(),
                Partitioner::by_key_group(groups, next.parallelism)?,
            ),
            Partitioning::Broadcast => (next.tasks().collect(), Partitioner::Broadcast),
        })
    }

    /// Every data edge `(upstream, downstream)`.
    pub(crate) fn edges(&self) -> Vec<(TaskId, TaskId)> {
        let mut edges = Vec::new();
        for pair in self.stages.windows(2) {
            let [up, down] = pair else { continue };
            match down.input {
                Partitioning::Forward => edges.extend(up.tasks().zip(down.tasks())),
                Partitioning::Hash | Partitioning::Broadcast => {
                    for from in up.tasks() {
                        edges.extend(down.tasks().map(|to| (from, to)));
                    }
                }
            }
        }
        edges
    }

    pub(crate) fn level(&self, task: TaskId) -> TaskLevel {
        self.position(task)
            .and_then(|(stage, _)| self.stages.get(stage))
            .map_or(TaskLevel::Sink, |s| s.level)
    }

    /// The task's index within its stage.
    fn index(&self, task: TaskId) -> u32 {
        self.position(task).map_or(0, |(_, index)| index)
    }

    /// The node a task runs on, of `nodes` (round robin by task id, so every stage
    /// spreads over the nodes and most edges cross them).
    pub(crate) fn node_of(task: TaskId, nodes: u32) -> NodeId {
        NodeId((task.get().saturating_sub(1)) % nodes.max(1) + 1)
    }

    /// The key groups `task` owns: all for sources and broadcast stages, its share
    /// of a hash-fed stage, its upstream's for a forward-fed one.
    fn key_group_range(
        &self,
        groups: KeyGroups,
        task: TaskId,
    ) -> Result<stillpoint_wire::KeyGroupRange, EngineError> {
        let Some((mut stage, index)) = self.position(task) else {
            return Ok(groups.all());
        };
        loop {
            let Some(tasks) = self.stages.get(stage) else {
                return Ok(groups.all());
            };
            match (stage, tasks.input) {
                (0, _) | (_, Partitioning::Broadcast) => return Ok(groups.all()),
                (_, Partitioning::Hash) => return Ok(groups.range_of(tasks.parallelism, index)?),
                (_, Partitioning::Forward) => stage -= 1,
            }
        }
    }

    /// The old tasks (of `old`, this dataflow as a checkpoint recorded it) whose
    /// snapshots `task` restores from: a source its own (sources cannot be rescaled:
    /// their offsets are per task), a keyed task every old task of its stage whose
    /// key groups overlap its own, a broadcast task the old stage's first task.
    fn restores_from(
        &self,
        old: &Self,
        groups: KeyGroups,
        task: TaskId,
    ) -> Result<Vec<TaskId>, EngineError> {
        let Some((stage, _)) = self.position(task) else {
            return Ok(Vec::new());
        };
        let (Some(new_stage), Some(old_stage)) = (self.stages.get(stage), old.stages.get(stage))
        else {
            return Ok(Vec::new());
        };
        if stage == 0 {
            return Ok(vec![task]);
        }
        if new_stage.input == Partitioning::Broadcast {
            return Ok(old_stage.task(0).into_iter().collect());
        }
        let range = self.key_group_range(groups, task)?;
        let mut from = Vec::new();
        for old_task in old_stage.tasks() {
            if old
                .key_group_range(groups, old_task)?
                .intersection(&range)
                .is_some()
            {
                from.push(old_task);
            }
        }
        Ok(from)
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
    /// Whether the checkpoint was taken with this topology's parallelisms (every task
    /// restores its own snapshot); otherwise keyed stages are rescaled by key group.
    pub(crate) fn same_shape(&self, topology: &Topology) -> bool {
        topology
            .of_checkpoint(&self.manifest)
            .is_ok_and(|old| old.parallelisms() == topology.parallelisms())
    }
}

/// The old tasks whose snapshots `tasks` need to restore from `manifest`.
pub(crate) fn snapshots_needed(
    manifest: &CheckpointManifest,
    topology: &Topology,
    tasks: &[TaskId],
    groups: KeyGroups,
) -> Result<Vec<TaskId>, EngineError> {
    let old = topology.of_checkpoint(manifest)?;
    if old.sources.len() != topology.sources.len() {
        return Err(EngineError::Invalid(format!(
            "checkpoint {} was taken with {} sources, the job has {}: a source stage's parallelism cannot change on restore (its offsets are per task)",
            manifest.checkpoint,
            old.sources.len(),
            topology.sources.len()
        )));
    }
    if old.parallelisms() == topology.parallelisms() {
        return Ok(tasks.to_vec());
    }
    let mut needed = BTreeSet::new();
    for task in tasks {
        needed.extend(topology.restores_from(&old, groups, *task)?);
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

/// A process's exclusive hold on a work directory, released when dropped (or when
/// the process dies: the kernel drops the lock with the file).
#[derive(Debug)]
pub(crate) struct WorkDirLock {
    _file: std::fs::File,
}

/// Locks `work_dir` (creating it) for this process: a second process — or a second
/// run in this one — asking for the same directory is refused while the first holds
/// it, instead of wiping its live databases.
pub(crate) fn lock_work_dir(work_dir: &Path) -> Result<WorkDirLock, EngineError> {
    use std::io::{Read, Seek, Write};
    std::fs::create_dir_all(work_dir).map_err(|e| EngineError::io("create", work_dir, &e))?;
    let path = work_dir.join(".lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| EngineError::io("open", &path, &e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut recorded = String::new();
            // Best effort: the pid is only there to name the holder.
            let _read = file.read_to_string(&mut recorded);
            let holder = recorded
                .trim()
                .parse::<u32>()
                .map_or_else(|_| String::new(), |pid| format!(" (pid {pid})"));
            return Err(EngineError::WorkDirInUse {
                path: work_dir.to_owned(),
                holder,
            });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(EngineError::io("lock", &path, &e)),
    }
    let recorded = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| write!(file, "{}", std::process::id()));
    recorded.map_err(|e| EngineError::io("write", &path, &e))?;
    Ok(WorkDirLock { _file: file })
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
    pub(crate) flow: &'a Dataflow,
    pub(crate) topology: &'a Topology,
    pub(crate) groups: KeyGroups,
    pub(crate) store: &'a Store,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) epoch: Instant,
    pub(crate) node: NodeId,
    pub(crate) metrics: &'a Metrics,
    pub(crate) restore: Option<&'a Restore>,
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
        let old = self.topology.of_checkpoint(&restore.manifest)?;
        let sources: Vec<(PathBuf, SnapshotManifest)> = self
            .topology
            .restores_from(&old, self.groups, task)?
            .iter()
            .filter_map(|old_task| restore.downloads.get(old_task))
            .map(|(m, d)| (d.clone(), m.clone()))
            .collect();
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
        let (downstreams, partitioner) = self.topology.downstreams(task, self.groups)?;
        let upstreams: Vec<TaskId> = wiring.inputs.iter().map(|(u, _)| *u).collect();
        let state = CachedState::new(self.state(task)?);
        let restored = self.restore.map(|r| RestoredCheckpoint {
            checkpoint: r.manifest.checkpoint,
            trans: r.manifest.trans,
            kind: r.manifest.kind,
            source_offset: r.manifest.source_offset(task).cloned(),
        });
        let index = self.topology.index(task);
        let stage = self
            .topology
            .position(task)
            .and_then(|(stage, _)| self.flow.stages.get(stage))
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
        driver.replay = match (self.replay, &stage.kind) {
            (Some(replay), StageKind::Source(_)) => ReplayRole::Source {
                bound: replay.get(&task).cloned().ok_or_else(|| {
                    EngineError::Invalid(format!("{task} has no bound in the replay"))
                })?,
                reported: false,
                at: None,
            },
            (Some(_), StageKind::Sink(_)) => ReplayRole::Sink { dropped: 0 },
            _ => ReplayRole::None,
        };
        driver.batch = self.config.batch_records.max(1);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn topology(parallelisms: &[u32], inputs: &[Partitioning]) -> Topology {
        Topology::from_shape(parallelisms, inputs)
    }

    const CHAIN: [Partitioning; 4] = [
        Partitioning::Forward,
        Partitioning::Hash,
        Partitioning::Broadcast,
        Partitioning::Forward,
    ];

    #[test]
    fn stages_number_their_tasks_and_join_by_their_partitioning() {
        let t = topology(&[2, 3, 2, 2], &CHAIN);
        assert_eq!(t.all(), (1..=9).map(TaskId).collect::<Vec<_>>());
        assert_eq!(t.sources, vec![TaskId(1), TaskId(2)]);
        let edges = t.edges();
        // Hash and broadcast are all-to-all, forward is one-to-one.
        assert_eq!(edges.len(), 2 * 3 + 3 * 2 + 2);
        assert!(edges.contains(&(TaskId(6), TaskId(8))));
        assert!(edges.contains(&(TaskId(7), TaskId(9))));
        assert!(!edges.contains(&(TaskId(6), TaskId(9))));
        assert_eq!(t.level(TaskId(2)), TaskLevel::Source);
        assert_eq!(t.level(TaskId(6)), TaskLevel::Aggregate);
        assert_eq!(t.level(TaskId(9)), TaskLevel::Sink);
        let groups = KeyGroups::new(12).unwrap();
        let (down, partitioner) = t.downstreams(TaskId(4), groups).unwrap();
        assert_eq!(down, vec![TaskId(6), TaskId(7)]);
        assert!(matches!(partitioner, Partitioner::Broadcast));
        let (down, _) = t.downstreams(TaskId(7), groups).unwrap();
        assert_eq!(down, vec![TaskId(9)]);
        assert!(t.downstreams(TaskId(9), groups).unwrap().0.is_empty());
    }

    #[test]
    fn key_groups_follow_the_input_and_rescale_restores_by_overlap() {
        let groups = KeyGroups::new(12).unwrap();
        // words ×2 → hash → count ×3 → forward → merge ×3 → broadcast → rules ×2 → sink
        let inputs = [
            Partitioning::Forward,
            Partitioning::Hash,
            Partitioning::Forward,
            Partitioning::Broadcast,
            Partitioning::Forward,
        ];
        let old = topology(&[2, 3, 3, 2, 2], &inputs);
        let range = |t: &Topology, task| t.key_group_range(groups, TaskId(task)).unwrap();
        assert_eq!(range(&old, 1), groups.all());
        assert_eq!(range(&old, 4), groups.range_of(3, 1).unwrap());
        // Forward keeps the upstream's groups; broadcast owns all of them.
        assert_eq!(range(&old, 7), groups.range_of(3, 1).unwrap());
        assert_eq!(range(&old, 9), groups.all());
        let new = topology(&[2, 2, 2, 3, 3], &inputs);
        // New count task 3 (index 0: groups 0..6) overlaps old counts 3 (0..4), 4 (4..8).
        assert_eq!(
            new.restores_from(&old, groups, TaskId(3)).unwrap(),
            vec![TaskId(3), TaskId(4)]
        );
        // Its forward-fed merge task 5 restores from the old merges of those groups.
        assert_eq!(
            new.restores_from(&old, groups, TaskId(5)).unwrap(),
            vec![TaskId(6), TaskId(7)]
        );
        // A broadcast task restores the old stage's first task.
        assert_eq!(
            new.restores_from(&old, groups, TaskId(9)).unwrap(),
            vec![TaskId(9)]
        );
        assert_eq!(
            new.restores_from(&old, groups, TaskId(2)).unwrap(),
            vec![TaskId(2)]
        );
    }

    #[test]
    fn a_work_directory_is_held_by_one_process_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("node-1");
        let held = lock_work_dir(&work).unwrap();
        // A second holder — another process, or another run in this one — is refused
        // naming the first one's pid, and the directory is left as it was.
        std::fs::create_dir_all(work.join("db")).unwrap();
        let refused = lock_work_dir(&work).unwrap_err();
        let message = refused.to_string();
        assert!(
            matches!(&refused, EngineError::WorkDirInUse { path, .. } if *path == work),
            "{message}"
        );
        assert!(
            message.contains(&format!("pid {}", std::process::id())),
            "{message}"
        );
        assert!(work.join("db").is_dir());
        drop(held);
        let _again = lock_work_dir(&work).unwrap();
    }
}
