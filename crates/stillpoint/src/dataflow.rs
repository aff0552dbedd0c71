//! A dataflow: a chain of stages — one source stage, any number of keyed operator
//! stages, one sink stage — each with its own parallelism, every stage fed by the one
//! before it through forward, hash (by key group) or broadcast partitioning.
//!
//! ```
//! use stillpoint::{Dataflow, Partitioning};
//! use stillpoint_connectors::{GeneratedWords, KeyedCount, TransactionalFileSink};
//!
//! let out = std::path::PathBuf::from("out");
//! let flow = Dataflow::source("words", 2, |index| {
//!     Ok(Box::new(GeneratedWords::new(42, index, 1_000, 100)) as _)
//! })
//! .operator("count", 3, Partitioning::Hash, |_| Ok(Box::new(KeyedCount) as _))
//! .sink("publish", 3, Partitioning::Forward, TransactionalFileSink::factory(out));
//! assert_eq!(flow.parallelisms(), vec![2, 3, 3]);
//! flow.check()?;
//! # Ok::<(), stillpoint::EngineError>(())
//! ```

use std::sync::Arc;

/// How a stage's input is spread over its tasks.
pub use stillpoint_task::Partitioning;
use stillpoint_task::{
    Replay, RestorePlan, RestoreQuestion, StageShape, TaskGraph, TaskLevel, check_stages,
};
use stillpoint_wire::{CheckpointId, SourcePosition, TaskId};

use crate::{Combine, Combiner, EngineError, Operator, Sink, Source};

/// Creates the source of a source stage's task `index`.
pub type SourceFactory = Arc<dyn Fn(u32) -> Result<Box<dyn Source>, EngineError> + Send + Sync>;

/// Creates the operator of an operator stage's task `index`.
pub type OperatorFactory = Arc<dyn Fn(u32) -> Result<Box<dyn Operator>, EngineError> + Send + Sync>;

/// Creates the [`Combiner`] of a stage's task `index` ([`Dataflow::combine`]).
pub type CombinerFactory = Arc<dyn Fn(u32) -> Result<Box<dyn Combiner>, EngineError> + Send + Sync>;

/// Creates a sink stage's sinks and settles what a changed sink parallelism leaves.
pub trait SinkFactory: Send + Sync {
    /// The sink of task `task`; the engine calls [`Sink::recover`] on it next.
    fn create(&self, task: TaskId) -> Result<Box<dyn Sink>, EngineError>;

    /// Before any task starts on a restore of `restored` with another parallelism than
    /// the checkpoint's: publishes every transaction of the old tasks that `restored`
    /// covers and rolls back the later ones (their tasks may no longer exist to do
    /// it). The default does nothing: right for idempotent sinks.
    fn settle(&self, restored: CheckpointId) -> Result<(), EngineError> {
        let _ = restored;
        Ok(())
    }

    /// Records durably, next to the output, that `checkpoint` committed and covers the
    /// sources up to `sources`. The coordinator calls it once the checkpoint's commit
    /// marker is in the store and before any task of the stage is told to publish it:
    /// what lets a later fallback past a damaged checkpoint replay exactly up to the
    /// published output ([`Published::covers`]). An error fails the checkpoint. The
    /// default records nothing.
    fn record_commit(
        &self,
        checkpoint: CheckpointId,
        sources: &[SourcePosition],
    ) -> Result<(), EngineError> {
        let _ = (checkpoint, sources);
        Ok(())
    }

    /// What this stage has published for checkpoints newer than `restored` (every
    /// checkpoint when `None`) — or will publish when its sinks recover: output a
    /// restart from `restored` would publish again. `Ok(None)` — the default — when
    /// the sink cannot tell; the engine then refuses to fall back past a checkpoint
    /// that did not verify (it cannot rule out republishing) unless duplicates are
    /// allowed.
    fn published_after(
        &self,
        restored: Option<CheckpointId>,
    ) -> Result<Option<Published>, EngineError> {
        let _ = restored;
        Ok(None)
    }
}

/// Transactions a sink stage has published, from [`SinkFactory::published_after`];
/// where each source task stops in a replay up to the end of published output.
pub use stillpoint_task::{Bounds, Published};

impl From<&Replay> for crate::Replayed {
    fn from(replay: &Replay) -> Self {
        Self {
            through: replay.through,
            records: replay.records,
        }
    }
}

impl<F> SinkFactory for F
where
    F: Fn(TaskId) -> Result<Box<dyn Sink>, EngineError> + Send + Sync,
{
    fn create(&self, task: TaskId) -> Result<Box<dyn Sink>, EngineError> {
        self(task)
    }
}

/// What a stage's tasks run.
#[derive(Clone)]
pub(crate) enum StageKind {
    Source(SourceFactory),
    Operator(OperatorFactory),
    Sink(Arc<dyn SinkFactory>),
}

/// One stage of a [`Dataflow`].
#[derive(Clone)]
pub(crate) struct Stage {
    pub(crate) name: String,
    pub(crate) parallelism: u32,
    /// How the previous stage's output reaches this one (unused for the source).
    pub(crate) input: Partitioning,
    pub(crate) kind: StageKind,
    /// The combiner its output goes through before the next stage's partitioning.
    pub(crate) combiner: Option<(Combine, CombinerFactory)>,
}

/// A dataflow; see the module docs. Build it with [`Dataflow::source`], then
/// [`Dataflow::operator`] for each keyed stage and [`Dataflow::sink`] last.
#[derive(Clone)]
pub struct Dataflow {
    pub(crate) stages: Vec<Stage>,
}

impl std::fmt::Debug for Dataflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.shapes()).finish()
    }
}

impl Dataflow {
    /// A dataflow starting with a source stage of `parallelism` tasks, each reading
    /// what `factory(index)` returns.
    pub fn source(
        name: impl Into<String>,
        parallelism: u32,
        factory: impl Fn(u32) -> Result<Box<dyn Source>, EngineError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            stages: vec![Stage {
                name: name.into(),
                parallelism,
                input: Partitioning::Forward,
                kind: StageKind::Source(Arc::new(factory)),
                combiner: None,
            }],
        }
    }

    /// Adds a keyed operator stage fed by the previous stage through `input`.
    #[must_use]
    pub fn operator(
        mut self,
        name: impl Into<String>,
        parallelism: u32,
        input: Partitioning,
        factory: impl Fn(u32) -> Result<Box<dyn Operator>, EngineError> + Send + Sync + 'static,
    ) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            parallelism,
            input,
            kind: StageKind::Operator(Arc::new(factory)),
            combiner: None,
        });
        self
    }

    /// Adds the sink stage fed by the previous stage through `input`.
    #[must_use]
    pub fn sink(
        mut self,
        name: impl Into<String>,
        parallelism: u32,
        input: Partitioning,
        factory: impl SinkFactory + 'static,
    ) -> Self {
        self.stages.push(Stage {
            name: name.into(),
            parallelism,
            input,
            kind: StageKind::Sink(Arc::new(factory)),
            combiner: None,
        });
        self
    }

    /// Folds the output of the stage added last with a [`Combiner`] per task before
    /// it is partitioned to the next stage — pre-aggregation before the shuffle, so
    /// the next (keyed) stage receives one partial aggregate per key per flush instead
    /// of every record; `when` says when it flushes besides barriers, watermarks, the
    /// end of input and an idle task. [`Dataflow::check`] refuses it on a sink stage
    /// and with `when.max_records == 0`.
    #[must_use]
    pub fn combine(
        mut self,
        when: Combine,
        factory: impl Fn(u32) -> Result<Box<dyn Combiner>, EngineError> + Send + Sync + 'static,
    ) -> Self {
        if let Some(stage) = self.stages.last_mut() {
            stage.combiner = Some((when, Arc::new(factory)));
        }
        self
    }

    /// Settles the sink stage's old transactions before a rescaled restore of
    /// `restored` ([`SinkFactory::settle`]).
    pub(crate) fn settle_sinks(&self, restored: CheckpointId) -> Result<(), EngineError> {
        for stage in &self.stages {
            if let StageKind::Sink(factory) = &stage.kind {
                factory.settle(restored)?;
            }
        }
        Ok(())
    }

    /// Records a commit with every sink stage ([`SinkFactory::record_commit`]).
    pub(crate) fn record_commit(
        &self,
        checkpoint: CheckpointId,
        sources: &[SourcePosition],
    ) -> Result<(), EngineError> {
        for stage in &self.stages {
            if let StageKind::Sink(factory) = &stage.kind {
                factory.record_commit(checkpoint, sources)?;
            }
        }
        Ok(())
    }

    /// How a restore avoids publishing again what the sinks published after it
    /// ([`stillpoint_task::plan_restore`]): an exact replay up to the offsets the
    /// newest published transaction covers, when the sinks recorded them and every
    /// source can stop there and every operator is deterministic; otherwise
    /// [`EngineError::WouldRepublish`] unless duplicates are allowed.
    pub(crate) fn plan_restore(
        &self,
        question: &RestoreQuestion<'_>,
    ) -> Result<RestorePlan, EngineError> {
        let mut sinks = Vec::new();
        for stage in &self.stages {
            if let StageKind::Sink(factory) = &stage.kind {
                sinks.push((
                    stage.name.clone(),
                    factory.published_after(question.restored)?,
                ));
            }
        }
        let planned = stillpoint_task::plan_restore(question, sinks, || self.replay_blocker())?;
        planned.map_err(|r| EngineError::WouldRepublish {
            restored: r.restored,
            stage: r.stage,
            published: r.published,
            why: r.why,
        })
    }

    /// Why this dataflow cannot replay up to an offset at all, if it cannot.
    fn replay_blocker(&self) -> Result<Option<String>, EngineError> {
        for stage in &self.stages {
            for index in 0..stage.parallelism {
                let why = match &stage.kind {
                    StageKind::Source(factory) if !factory(index)?.stops_at_offsets() => {
                        "cannot stop at an offset"
                    }
                    StageKind::Operator(factory) if !factory(index)?.deterministic() => {
                        "is not deterministic"
                    }
                    _ => continue,
                };
                return Ok(Some(format!("stage {:?} {why}", stage.name)));
            }
        }
        Ok(None)
    }

    /// The dataflow's tasks and edges.
    pub(crate) fn graph(&self) -> TaskGraph {
        let inputs: Vec<Partitioning> = self.stages.iter().map(|s| s.input).collect();
        TaskGraph::new(&self.parallelisms(), &inputs)
    }

    /// The parallelism of each stage.
    #[must_use]
    pub fn parallelisms(&self) -> Vec<u32> {
        self.stages.iter().map(|s| s.parallelism).collect()
    }

    /// Refuses a dataflow that cannot run, naming the stage
    /// ([`stillpoint_task::check_stages`]: the source stage first, the sink stage
    /// last, no empty stage, unique names, forward edges between equal parallelisms,
    /// combiners only where there is output).
    pub fn check(&self) -> Result<(), EngineError> {
        check_stages(&self.shapes()).map_err(|why| EngineError::Invalid(format!("dataflow: {why}")))
    }

    fn shapes<'a>(&'a self) -> Vec<StageShape<'a>> {
        let shape = |stage: &'a Stage| StageShape {
            name: &stage.name,
            level: match stage.kind {
                StageKind::Source(_) => TaskLevel::Source,
                StageKind::Operator(_) => TaskLevel::Aggregate,
                StageKind::Sink(_) => TaskLevel::Sink,
            },
            parallelism: stage.parallelism,
            input: stage.input,
            combine: stage.combiner.as_ref().map(|(when, _)| when.max_records),
        };
        self.stages.iter().map(shape).collect()
    }
}

/// What the engine runs: a [`Dataflow`], or a description that builds one (the
/// built-in word count of `stillpoint-connectors`).
pub trait ToDataflow {
    /// The dataflow.
    fn to_dataflow(&self) -> Result<Dataflow, EngineError>;
}

impl ToDataflow for Dataflow {
    fn to_dataflow(&self) -> Result<Dataflow, EngineError> {
        Ok(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Persist, Record, SourcePoll};
    use stillpoint_wire::SourceOffset;

    /// A source, operator and sink that do nothing: only the shape is checked here.
    struct Nothing;

    impl Source for Nothing {
        fn seek(&mut self, _: Option<&SourceOffset>) -> Result<(), EngineError> {
            Ok(())
        }

        fn poll(&mut self, _: usize, _: &mut Vec<Record>) -> Result<SourcePoll, EngineError> {
            Ok(SourcePoll::Finished)
        }

        fn offset(&self) -> SourceOffset {
            SourceOffset::from_u64(0)
        }
    }

    impl Operator for Nothing {
        fn process(
            &mut self,
            _: Record,
            _: &mut stillpoint_state::CachedState,
            _: &mut Vec<Record>,
        ) -> Result<(), EngineError> {
            Ok(())
        }
    }

    impl Combiner for Nothing {
        fn add(&mut self, _: Record) -> Result<(), EngineError> {
            Ok(())
        }

        fn flush(&mut self, _: &mut Vec<Record>) -> Result<(), EngineError> {
            Ok(())
        }
    }

    impl Sink for Nothing {
        fn write(&mut self, _: Record) -> Result<(), EngineError> {
            Ok(())
        }

        fn pre_commit(&mut self, _: CheckpointId) -> Result<Option<Persist>, EngineError> {
            Ok(None)
        }

        fn commit(&mut self, _: CheckpointId) -> Result<(), EngineError> {
            Ok(())
        }

        fn recover(&mut self, _: Option<CheckpointId>) -> Result<(), EngineError> {
            Ok(())
        }
    }

    fn source(parallelism: u32) -> Dataflow {
        Dataflow::source("words", parallelism, |_| {
            Ok(Box::new(Nothing) as Box<dyn Source>)
        })
    }

    fn count(flow: Dataflow, name: &str, parallelism: u32, input: Partitioning) -> Dataflow {
        flow.operator(name, parallelism, input, |_| {
            Ok(Box::new(Nothing) as Box<dyn Operator>)
        })
    }

    fn sink(flow: Dataflow, parallelism: u32, input: Partitioning) -> Dataflow {
        flow.sink("publish", parallelism, input, |_: TaskId| {
            Ok(Box::new(Nothing) as Box<dyn Sink>)
        })
    }

    fn refused(flow: &Dataflow) -> String {
        match flow.check() {
            Err(EngineError::Invalid(message)) => message,
            other => panic!("{flow:?} should be refused, got {other:?}"),
        }
    }

    #[test]
    fn a_dataflow_that_cannot_run_is_refused_naming_its_stage() {
        let ok = sink(
            count(source(2), "count", 3, Partitioning::Hash),
            3,
            Partitioning::Forward,
        );
        ok.check().unwrap();
        assert_eq!(ok.parallelisms(), vec![2, 3, 3]);
        let cases = [
            (
                sink(
                    count(source(2), "count", 3, Partitioning::Hash),
                    2,
                    Partitioning::Forward,
                ),
                "stage \"publish\" (parallelism 2) is fed forward by \"count\" (parallelism 3)",
            ),
            (
                sink(
                    count(source(0), "count", 3, Partitioning::Hash),
                    3,
                    Partitioning::Forward,
                ),
                "stage \"words\" has parallelism 0",
            ),
            (
                sink(
                    count(source(1), "words", 3, Partitioning::Hash),
                    3,
                    Partitioning::Forward,
                ),
                "two stages are called \"words\"",
            ),
            (
                count(
                    sink(source(1), 1, Partitioning::Hash),
                    "count",
                    1,
                    Partitioning::Hash,
                ),
                "sink stage \"publish\" is not the last stage",
            ),
            (
                count(source(1), "count", 1, Partitioning::Hash),
                "operator stage \"count\" must come after the source and before the sink",
            ),
            (source(1), "it needs a source stage and a sink stage"),
            (
                sink(
                    count(source(2), "count", 3, Partitioning::Hash),
                    3,
                    Partitioning::Forward,
                )
                .combine(Combine::default(), |_| Ok(Box::new(Nothing) as _)),
                "sink stage \"publish\" has no output to combine",
            ),
            (
                sink(
                    count(
                        source(2).combine(
                            Combine {
                                max_records: 0,
                                ..Combine::default()
                            },
                            |_| Ok(Box::new(Nothing) as _),
                        ),
                        "count",
                        3,
                        Partitioning::Hash,
                    ),
                    3,
                    Partitioning::Forward,
                ),
                "the combiner of stage \"words\" flushes after 0 records",
            ),
        ];
        for (flow, expected) in cases {
            let message = refused(&flow);
            assert!(message.contains(expected), "{message:?} lacks {expected:?}");
        }
    }
}
