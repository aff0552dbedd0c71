//! A job's task graph: the tasks of a chain of stages, numbered from 1 stage by
//! stage, the data edges between them, the key groups each task owns, and which old
//! tasks' snapshots each task restores from when a checkpoint taken at other
//! parallelisms is restored (rescale by key group, as Flink does).

use std::collections::BTreeSet;
use std::fmt;

use stillpoint_wire::{CheckpointId, CheckpointManifest, KeyGroupRange, TaskId};

use crate::TaskLevel;

/// How a stage's input is spread over its tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Partitioning {
    /// Task `i` of the upstream stage feeds task `i` (both stages have the same
    /// parallelism); a keyed stage keeps its upstream's key groups.
    Forward,
    /// By the key group of the record's key: each task owns a contiguous range of key
    /// groups, and keyed state is rescaled by those ranges.
    Hash,
    /// Every record to every task (each task sees the whole input, e.g. rules or a
    /// small table). Every task owns every key group; a rescaled broadcast stage
    /// restores the state of the old stage's first task into each of its tasks.
    Broadcast,
}

/// Why a checkpoint cannot be restored into a task graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GraphError {
    /// The checkpoint was taken with another number of stages.
    Stages {
        /// The checkpoint.
        checkpoint: CheckpointId,
        /// Its stages.
        recorded: usize,
        /// The graph's.
        now: usize,
    },
    /// The checkpoint was taken with another number of source tasks (a source's
    /// offsets are per task: a source stage cannot be rescaled).
    Sources {
        /// The checkpoint.
        checkpoint: CheckpointId,
        /// Its source tasks.
        recorded: usize,
        /// The graph's.
        now: usize,
    },
    /// A stage's parallelism exceeds the number of key groups.
    KeyGroups {
        /// The stage's parallelism.
        parallelism: u32,
        /// The number of key groups.
        max_parallelism: u32,
    },
}

impl fmt::Display for GraphError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Stages {
                checkpoint,
                recorded,
                now,
            } => write!(
                f,
                "checkpoint {checkpoint} was taken with {recorded} stages, the dataflow has {now}: a restore may change parallelisms, not the stages"
            ),
            Self::Sources {
                checkpoint,
                recorded,
                now,
            } => write!(
                f,
                "checkpoint {checkpoint} was taken with {recorded} sources, the job has {now}: a source stage's parallelism cannot change on restore (its offsets are per task)"
            ),
            Self::KeyGroups {
                parallelism,
                max_parallelism,
            } => write!(
                f,
                "a stage of parallelism {parallelism} cannot split {max_parallelism} key groups"
            ),
        }
    }
}

impl std::error::Error for GraphError {}

/// A stage as [`check_stages`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageShape<'a> {
    /// Its name, unique in the chain.
    pub name: &'a str,
    /// What its tasks are: the sources, a keyed operator ([`TaskLevel::Aggregate`]),
    /// or the sinks.
    pub level: TaskLevel,
    /// Its tasks.
    pub parallelism: u32,
    /// How the stage before feeds it (the first stage's is ignored).
    pub input: Partitioning,
    /// With a combiner on its output: the records it holds at most.
    pub combine: Option<usize>,
}

/// Why a chain of stages cannot run ([`check_stages`]); each names the stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StageError {
    /// Two stages share a name.
    DuplicateName {
        /// The name.
        stage: String,
    },
    /// A stage has no tasks.
    NoTasks {
        /// The stage.
        stage: String,
    },
    /// A source stage that is not the first, a sink stage that is not the last, or
    /// an operator stage first or last.
    Misplaced {
        /// The stage.
        stage: String,
        /// What its tasks are.
        level: TaskLevel,
    },
    /// A combiner on the sink stage, which has no output.
    CombineOnSink {
        /// The stage.
        stage: String,
    },
    /// A combiner that holds no record.
    CombineNothing {
        /// The stage.
        stage: String,
    },
    /// A forward edge between stages of different parallelisms.
    ForwardParallelism {
        /// The stage fed forward.
        stage: String,
        /// Its parallelism.
        parallelism: u32,
        /// The stage feeding it.
        previous: String,
        /// Its parallelism.
        previous_parallelism: u32,
    },
    /// Fewer than two stages: a chain needs a source and a sink stage.
    TooFew,
}

impl fmt::Display for StageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DuplicateName { stage } => write!(f, "two stages are called {stage:?}"),
            Self::NoTasks { stage } => write!(f, "stage {stage:?} has parallelism 0"),
            Self::Misplaced { stage, level } => match level {
                TaskLevel::Source => write!(f, "source stage {stage:?} is not the first stage"),
                TaskLevel::Sink => write!(f, "sink stage {stage:?} is not the last stage"),
                TaskLevel::Aggregate => write!(
                    f,
                    "operator stage {stage:?} must come after the source and before the sink"
                ),
            },
            Self::CombineOnSink { stage } => {
                write!(f, "sink stage {stage:?} has no output to combine")
            }
            Self::CombineNothing { stage } => write!(
                f,
                "the combiner of stage {stage:?} flushes after 0 records; it needs at least 1"
            ),
            Self::ForwardParallelism {
                stage,
                parallelism,
                previous,
                previous_parallelism,
            } => write!(
                f,
                "stage {stage:?} (parallelism {parallelism}) is fed forward by {previous:?} (parallelism {previous_parallelism}): forward needs equal parallelism; use hash or broadcast"
            ),
            Self::TooFew => write!(f, "it needs a source stage and a sink stage"),
        }
    }
}

impl std::error::Error for StageError {}

/// Refuses a chain of stages that cannot run, saying why and naming the stage: it
/// must start with its only source stage and end with its only sink stage, every
/// stage needs at least one task, names are unique, a forward edge joins stages of
/// equal parallelism, and a combiner sits on a stage with output and holds at least
/// one record.
///
/// # Errors
/// The first rule broken ([`StageError`]).
pub fn check_stages(stages: &[StageShape<'_>]) -> Result<(), StageError> {
    let last = stages.len().saturating_sub(1);
    let mut names = BTreeSet::new();
    for (index, stage) in stages.iter().enumerate() {
        let name = || stage.name.to_owned();
        if !names.insert(stage.name) {
            return Err(StageError::DuplicateName { stage: name() });
        }
        if stage.parallelism == 0 {
            return Err(StageError::NoTasks { stage: name() });
        }
        let placed = match stage.level {
            TaskLevel::Source => index == 0,
            TaskLevel::Sink => index == last && index > 0,
            TaskLevel::Aggregate => index > 0 && index < last,
        };
        if !placed {
            return Err(StageError::Misplaced {
                stage: name(),
                level: stage.level,
            });
        }
        match stage.combine {
            Some(_) if stage.level == TaskLevel::Sink => {
                return Err(StageError::CombineOnSink { stage: name() });
            }
            Some(0) => return Err(StageError::CombineNothing { stage: name() }),
            _ => {}
        }
        if let Some(previous) = index.checked_sub(1).and_then(|i| stages.get(i))
            && stage.input == Partitioning::Forward
            && stage.parallelism != previous.parallelism
        {
            return Err(StageError::ForwardParallelism {
                stage: name(),
                parallelism: stage.parallelism,
                previous: previous.name.to_owned(),
                previous_parallelism: previous.parallelism,
            });
        }
    }
    if stages.len() < 2 {
        return Err(StageError::TooFew);
    }
    Ok(())
}

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

/// A chain of stages' tasks, numbered from 1 stage by stage, and its edges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskGraph {
    stages: Vec<StageTasks>,
    sources: Vec<TaskId>,
}

impl TaskGraph {
    /// Stages of these parallelisms fed through these partitionings (the first
    /// stage's is ignored): the first stage is the sources, the last the sinks.
    #[must_use]
    pub fn new(parallelisms: &[u32], inputs: &[Partitioning]) -> Self {
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

    /// The graph a checkpoint was taken with: its recorded stages with this graph's
    /// partitionings (a restore may change parallelisms, not the chain), or for a
    /// checkpoint that recorded none, the word count's three stages.
    pub fn of_checkpoint(&self, manifest: &CheckpointManifest) -> Result<Self, GraphError> {
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
            return Err(GraphError::Stages {
                checkpoint: manifest.checkpoint,
                recorded: stages.len(),
                now: inputs.len(),
            });
        }
        Ok(Self::new(&stages, &inputs))
    }

    /// The source tasks.
    #[must_use]
    pub fn sources(&self) -> &[TaskId] {
        &self.sources
    }

    /// The parallelism of each stage.
    #[must_use]
    pub fn parallelisms(&self) -> Vec<u32> {
        self.stages.iter().map(|s| s.parallelism).collect()
    }

    /// Every task, stage by stage.
    #[must_use]
    pub fn all(&self) -> Vec<TaskId> {
        self.stages.iter().flat_map(StageTasks::tasks).collect()
    }

    /// The stage of `task` and its index within the stage.
    #[must_use]
    pub fn position(&self, task: TaskId) -> Option<(usize, u32)> {
        self.stages.iter().enumerate().find_map(|(stage, tasks)| {
            let index = task.get().checked_sub(tasks.first)?;
            (index < tasks.parallelism).then_some((stage, index))
        })
    }

    /// The downstreams of `task`, with how its output is spread over them and their
    /// stage's parallelism (`None` for a sink).
    #[must_use]
    pub fn downstreams(&self, task: TaskId) -> Option<(Vec<TaskId>, Partitioning, u32)> {
        let (stage, index) = self.position(task)?;
        let next = self.stages.get(stage + 1)?;
        let tasks = match next.input {
            Partitioning::Forward => next.task(index).into_iter().collect(),
            Partitioning::Hash | Partitioning::Broadcast => next.tasks().collect(),
        };
        Some((tasks, next.input, next.parallelism))
    }

    /// Every data edge `(upstream, downstream)`.
    #[must_use]
    pub fn edges(&self) -> Vec<(TaskId, TaskId)> {
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

    /// The task's level (an unknown task is treated as a sink).
    #[must_use]
    pub fn level(&self, task: TaskId) -> TaskLevel {
        self.position(task)
            .and_then(|(stage, _)| self.stages.get(stage))
            .map_or(TaskLevel::Sink, |s| s.level)
    }

    /// The key groups `task` owns of `max_parallelism`: all for sources and broadcast
    /// stages, its share of a hash-fed stage, its upstream's for a forward-fed one.
    pub fn key_groups(
        &self,
        max_parallelism: u32,
        task: TaskId,
    ) -> Result<KeyGroupRange, GraphError> {
        let all = KeyGroupRange {
            start: 0,
            end: max_parallelism,
        };
        let Some((mut stage, index)) = self.position(task) else {
            return Ok(all);
        };
        loop {
            let Some(tasks) = self.stages.get(stage) else {
                return Ok(all);
            };
            match (stage, tasks.input) {
                (0, _) | (_, Partitioning::Broadcast) => return Ok(all),
                (_, Partitioning::Hash) => {
                    return KeyGroupRange::of_task(max_parallelism, tasks.parallelism, index)
                        .ok_or(GraphError::KeyGroups {
                            parallelism: tasks.parallelism,
                            max_parallelism,
                        });
                }
                (_, Partitioning::Forward) => stage -= 1,
            }
        }
    }

    /// Whether `manifest`'s checkpoint was taken with these parallelisms (every task
    /// restores its own snapshot); otherwise keyed stages are rescaled by key group.
    #[must_use]
    pub fn same_shape(&self, manifest: &CheckpointManifest) -> bool {
        self.of_checkpoint(manifest)
            .is_ok_and(|old| old.parallelisms() == self.parallelisms())
    }

    /// The old tasks (of `old`, this graph as a checkpoint recorded it) whose
    /// snapshots `task` restores from: a source its own (sources cannot be rescaled:
    /// their offsets are per task), a keyed task every old task of its stage whose
    /// key groups overlap its own, a broadcast task the old stage's first task.
    pub fn restores_from(
        &self,
        old: &Self,
        max_parallelism: u32,
        task: TaskId,
    ) -> Result<Vec<TaskId>, GraphError> {
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
        let range = self.key_groups(max_parallelism, task)?;
        let mut from = Vec::new();
        for old_task in old_stage.tasks() {
            if old
                .key_groups(max_parallelism, old_task)?
                .intersection(&range)
                .is_some()
            {
                from.push(old_task);
            }
        }
        Ok(from)
    }

    /// The old tasks whose snapshots `tasks` need to restore from `manifest`.
    pub fn snapshots_needed(
        &self,
        manifest: &CheckpointManifest,
        tasks: &[TaskId],
        max_parallelism: u32,
    ) -> Result<Vec<TaskId>, GraphError> {
        let old = self.of_checkpoint(manifest)?;
        if old.sources.len() != self.sources.len() {
            return Err(GraphError::Sources {
                checkpoint: manifest.checkpoint,
                recorded: old.sources.len(),
                now: self.sources.len(),
            });
        }
        if old.parallelisms() == self.parallelisms() {
            return Ok(tasks.to_vec());
        }
        let mut needed = BTreeSet::new();
        for task in tasks {
            needed.extend(self.restores_from(&old, max_parallelism, *task)?);
        }
        Ok(needed.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAIN: [Partitioning; 4] = [
        Partitioning::Forward,
        Partitioning::Hash,
        Partitioning::Broadcast,
        Partitioning::Forward,
    ];

    #[test]
    fn stages_number_their_tasks_and_join_by_their_partitioning() {
        let t = TaskGraph::new(&[2, 3, 2, 2], &CHAIN);
        assert_eq!(t.all(), (1..=9).map(TaskId).collect::<Vec<_>>());
        assert_eq!(t.sources(), &[TaskId(1), TaskId(2)]);
        let edges = t.edges();
        // Hash and broadcast are all-to-all, forward is one-to-one.
        assert_eq!(edges.len(), 2 * 3 + 3 * 2 + 2);
        assert!(edges.contains(&(TaskId(6), TaskId(8))));
        assert!(edges.contains(&(TaskId(7), TaskId(9))));
        assert!(!edges.contains(&(TaskId(6), TaskId(9))));
        assert_eq!(t.level(TaskId(2)), TaskLevel::Source);
        assert_eq!(t.level(TaskId(6)), TaskLevel::Aggregate);
        assert_eq!(t.level(TaskId(9)), TaskLevel::Sink);
        let (down, partitioning, _) = t.downstreams(TaskId(4)).unwrap();
        assert_eq!(down, vec![TaskId(6), TaskId(7)]);
        assert_eq!(partitioning, Partitioning::Broadcast);
        let (down, _, _) = t.downstreams(TaskId(7)).unwrap();
        assert_eq!(down, vec![TaskId(9)]);
        assert!(t.downstreams(TaskId(9)).is_none());
    }

    #[test]
    fn key_groups_follow_the_input_and_rescale_restores_by_overlap() {
        let max = 12;
        let share = |parallelism, index| KeyGroupRange::of_task(max, parallelism, index).unwrap();
        let all = KeyGroupRange { start: 0, end: max };
        // words ×2 → hash → count ×3 → forward → merge ×3 → broadcast → rules ×2 → sink
        let inputs = [
            Partitioning::Forward,
            Partitioning::Hash,
            Partitioning::Forward,
            Partitioning::Broadcast,
            Partitioning::Forward,
        ];
        let old = TaskGraph::new(&[2, 3, 3, 2, 2], &inputs);
        let range = |t: &TaskGraph, task| t.key_groups(max, TaskId(task)).unwrap();
        assert_eq!(range(&old, 1), all);
        assert_eq!(range(&old, 4), share(3, 1));
        // Forward keeps the upstream's groups; broadcast owns all of them.
        assert_eq!(range(&old, 7), share(3, 1));
        assert_eq!(range(&old, 9), all);
        let new = TaskGraph::new(&[2, 2, 2, 3, 3], &inputs);
        // New count task 3 (index 0: groups 0..6) overlaps old counts 3 (0..4), 4 (4..8).
        assert_eq!(
            new.restores_from(&old, max, TaskId(3)).unwrap(),
            vec![TaskId(3), TaskId(4)]
        );
        // Its forward-fed merge task 5 restores from the old merges of those groups.
        assert_eq!(
            new.restores_from(&old, max, TaskId(5)).unwrap(),
            vec![TaskId(6), TaskId(7)]
        );
        // A broadcast task restores the old stage's first task.
        assert_eq!(
            new.restores_from(&old, max, TaskId(9)).unwrap(),
            vec![TaskId(9)]
        );
        assert_eq!(
            new.restores_from(&old, max, TaskId(2)).unwrap(),
            vec![TaskId(2)]
        );
    }

    #[test]
    fn a_chain_that_cannot_run_is_refused_with_a_typed_error_naming_the_stage() {
        let shape = |name, level, parallelism, input| StageShape {
            name,
            level,
            parallelism,
            input,
            combine: None,
        };
        let source = shape("words", TaskLevel::Source, 2, Partitioning::Forward);
        let count = shape("count", TaskLevel::Aggregate, 3, Partitioning::Hash);
        let sink = shape("publish", TaskLevel::Sink, 2, Partitioning::Forward);
        assert_eq!(
            check_stages(&[source.clone(), count.clone(), sink.clone()]),
            Err(StageError::ForwardParallelism {
                stage: "publish".into(),
                parallelism: 2,
                previous: "count".into(),
                previous_parallelism: 3,
            })
        );
        assert_eq!(
            check_stages(&[count.clone(), source.clone(), sink.clone()]),
            Err(StageError::Misplaced {
                stage: "count".into(),
                level: TaskLevel::Aggregate,
            })
        );
        assert_eq!(
            check_stages(std::slice::from_ref(&source)),
            Err(StageError::TooFew)
        );
        let fitting = StageShape {
            parallelism: 3,
            ..sink
        };
        assert_eq!(check_stages(&[source, count, fitting]), Ok(()));
    }
}
