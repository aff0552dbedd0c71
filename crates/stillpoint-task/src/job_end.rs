//! When a job is done, sans-IO: the coordinator driver's bookkeeping of one run —
//! which sources reached the end of their input and where, which committed
//! checkpoint covers which source offsets, a requested stop, and a replay up to
//! published output — and the verdict on each completed checkpoint.

use std::collections::{BTreeMap, BTreeSet};

use stillpoint_wire::{
    CheckpointId, CheckpointKind, CheckpointManifest, SourceOffset, SourcePosition, StreamId,
    TaskId, TaskSnapshotRef,
};

use crate::ManifestRequest;

/// One run's progress towards its end.
///
/// The job is done when a completed checkpoint covers the end of every source's
/// input — its offsets are the sources' final ones *and* it was triggered after the
/// last source ended (an earlier one's barrier may have left a source at its last
/// offset but before its end of input, so before the operators' end-of-input output
/// such as the last windows) — or, after a stop was requested, when a checkpoint
/// triggered after the request completes (a savepoint, if one was asked for).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobEnd {
    sources: usize,
    finished: BTreeMap<TaskId, SourceOffset>,
    ended_after: Option<CheckpointId>,
    offsets: BTreeMap<CheckpointId, BTreeMap<TaskId, SourceOffset>>,
    stop_after: Option<CheckpointId>,
    stop_on_savepoint: bool,
    replaying: BTreeSet<TaskId>,
}

impl JobEnd {
    /// A run of `sources` source tasks; those in `replaying` replay up to published
    /// output first (no checkpoint may be triggered until all of them are there).
    #[must_use]
    pub fn new(sources: usize, replaying: impl IntoIterator<Item = TaskId>) -> Self {
        Self {
            sources,
            replaying: replaying.into_iter().collect(),
            ..Self::default()
        }
    }

    /// Source `task` reached the end of its input at `offset`; `newest_triggered` is
    /// the newest checkpoint triggered so far (only a later one covers the end).
    pub fn source_finished(
        &mut self,
        task: TaskId,
        offset: SourceOffset,
        newest_triggered: CheckpointId,
    ) {
        self.finished.insert(task, offset);
        if self.all_sources_finished() && self.ended_after.is_none() {
            self.ended_after = Some(newest_triggered);
        }
    }

    /// Whether every source has reported the end of its input.
    #[must_use]
    pub fn all_sources_finished(&self) -> bool {
        self.finished.len() == self.sources
    }

    /// Replaying source `task` reached its bound: `true` when it was the last one,
    /// so the checkpoint exactly there is due now.
    pub fn source_at_bound(&mut self, task: TaskId) -> bool {
        self.replaying.remove(&task) && self.replaying.is_empty()
    }

    /// Whether sources still replay up to published output (nothing is triggered).
    #[must_use]
    pub fn replaying(&self) -> bool {
        !self.replaying.is_empty()
    }

    /// A stop was requested when `newest_triggered` was the newest checkpoint: the
    /// job ends once a later one completes — a savepoint, if `savepoint`. `false` if
    /// a stop was requested before (the first request holds).
    pub fn stop_requested(&mut self, newest_triggered: CheckpointId, savepoint: bool) -> bool {
        if self.stop_after.is_some() {
            return false;
        }
        self.stop_after = Some(newest_triggered);
        self.stop_on_savepoint = savepoint;
        true
    }

    /// Whether the stop waits for a savepoint.
    #[must_use]
    pub fn stop_on_savepoint(&self) -> bool {
        self.stop_on_savepoint
    }

    /// Checkpoint `checkpoint` was committed covering these source offsets.
    pub fn committed(&mut self, checkpoint: CheckpointId, sources: &[SourcePosition]) {
        let offsets = sources.iter().map(|s| (s.task, s.offset.clone())).collect();
        self.offsets.insert(checkpoint, offsets);
    }

    /// Checkpoint `checkpoint` (of `kind`) completed: whether the job is done.
    pub fn completed(&mut self, checkpoint: CheckpointId, kind: CheckpointKind) -> bool {
        let wanted = !self.stop_on_savepoint || kind == CheckpointKind::Savepoint;
        let stopped = wanted && self.stop_after.is_some_and(|after| checkpoint > after);
        let after_end = self.ended_after.is_some_and(|after| checkpoint > after);
        let covers_end = after_end
            && (self.offsets.get(&checkpoint)).is_some_and(|offsets| *offsets == self.finished);
        self.offsets.retain(|id, _| *id > checkpoint);
        stopped || covers_end
    }
}

impl ManifestRequest {
    /// The global manifest this request commits, created at `created_at_millis`
    /// (Unix time) by a job of `stream` with `max_parallelism` key groups and these
    /// per-stage parallelisms.
    #[must_use]
    pub fn manifest(
        &self,
        stream: StreamId,
        max_parallelism: u32,
        stages: Vec<u32>,
        created_at_millis: u64,
    ) -> CheckpointManifest {
        CheckpointManifest {
            stream,
            checkpoint: self.checkpoint,
            trans: self.trans,
            kind: self.kind,
            created_at_millis,
            max_parallelism,
            tasks: (self.tasks.iter())
                .map(|t| TaskSnapshotRef {
                    task: t.task,
                    node: t.node,
                    manifest: t.report.manifest.clone(),
                    sha256: t.report.manifest_sha256,
                    state_bytes: t.report.state_bytes,
                })
                .collect(),
            sources: (self.tasks.iter())
                .filter_map(|t| {
                    let offset = t.report.source_offset.clone()?;
                    Some(SourcePosition {
                        task: t.task,
                        offset,
                    })
                })
                .collect(),
            stages,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(task: u32, offset: u64) -> SourcePosition {
        SourcePosition {
            task: TaskId(task),
            offset: SourceOffset::from_u64(offset),
        }
    }

    #[test]
    fn only_a_checkpoint_triggered_after_the_last_end_and_at_the_final_offsets_ends_the_job() {
        let mut end = JobEnd::new(2, []);
        end.committed(CheckpointId(4), &[at(1, 10), at(2, 5)]);
        end.source_finished(TaskId(1), SourceOffset::from_u64(10), CheckpointId(4));
        assert!(!end.all_sources_finished());
        end.source_finished(TaskId(2), SourceOffset::from_u64(20), CheckpointId(5));
        assert!(end.all_sources_finished());
        // 4 was triggered before the last source ended; 5 is not after it either,
        // even at the final offsets (its barrier may precede an end of input).
        assert!(!end.completed(CheckpointId(4), CheckpointKind::Checkpoint));
        end.committed(CheckpointId(5), &[at(1, 10), at(2, 20)]);
        assert!(!end.completed(CheckpointId(5), CheckpointKind::Checkpoint));
        // 6 after the end but short of a final offset: not done.
        end.committed(CheckpointId(6), &[at(1, 10), at(2, 19)]);
        assert!(!end.completed(CheckpointId(6), CheckpointKind::Checkpoint));
        end.committed(CheckpointId(7), &[at(1, 10), at(2, 20)]);
        assert!(end.completed(CheckpointId(7), CheckpointKind::Checkpoint));
    }

    #[test]
    fn a_stop_ends_after_a_later_checkpoint_or_savepoint_and_the_first_request_holds() {
        let mut end = JobEnd::new(1, []);
        assert!(end.stop_requested(CheckpointId(3), false));
        assert!(
            !end.stop_requested(CheckpointId(9), true),
            "the first holds"
        );
        assert!(!end.completed(CheckpointId(3), CheckpointKind::Checkpoint));
        assert!(end.completed(CheckpointId(4), CheckpointKind::Checkpoint));

        let mut end = JobEnd::new(1, []);
        assert!(end.stop_requested(CheckpointId(3), true));
        assert!(end.stop_on_savepoint());
        assert!(!end.completed(CheckpointId(4), CheckpointKind::Checkpoint));
        assert!(end.completed(CheckpointId(5), CheckpointKind::Savepoint));
    }

    #[test]
    fn a_replay_waits_for_every_source_at_its_bound() {
        let mut end = JobEnd::new(2, [TaskId(1), TaskId(2)]);
        assert!(end.replaying());
        assert!(!end.source_at_bound(TaskId(1)));
        assert!(!end.source_at_bound(TaskId(1)), "twice is once");
        assert!(end.source_at_bound(TaskId(2)));
        assert!(!end.replaying());
        assert!(
            !end.source_at_bound(TaskId(2)),
            "only the last arrival says so"
        );
    }
}
