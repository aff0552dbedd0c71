//! A task's part in a replay up to the end of published output ([`crate::Replay`],
//! planned by [`crate::plan_restore`]): a source reads exactly up to its bound,
//! injects barriers only there, and reads on once the checkpoint taken there has
//! completed; a sink drops every record before its first snapshot (the sinks
//! published those already). Sans-IO: the engine's task driver asks and obeys.

use stillpoint_wire::{CheckpointId, SourceOffset, TaskId};

use crate::{Bounds, TaskLevel};

/// What a task does differently while a replay lasts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ReplayRole {
    /// No replay (or this task's part is over).
    #[default]
    None,
    /// A source: read up to `bound`, say so once, inject barriers only there, and read
    /// on only once a checkpoint taken there (`at`, the first injected) has completed.
    Source {
        /// Where its published output ends.
        bound: SourceOffset,
        /// Whether it said it got there.
        reported: bool,
        /// The first checkpoint whose barrier it injected at the bound.
        at: Option<CheckpointId>,
    },
    /// A sink: every record before its first snapshot is published output already;
    /// drop it, counting it.
    Sink {
        /// Records dropped so far.
        dropped: u64,
    },
}

/// What a source may do now ([`ReplayRole::gate`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceGate {
    /// Read and inject barriers as usual: no replay, or its part is over.
    Free,
    /// Replaying: read only up to this offset, inject no barrier before it.
    UpTo(SourceOffset),
    /// Replaying and at its bound: inject barriers, read nothing. `first`: the first
    /// time it is found here (the coordinator is to be told).
    AtBound {
        /// Whether this is the first time.
        first: bool,
    },
}

impl ReplayRole {
    /// `task`'s part, at `level`, in a replay up to `bounds` (`None`: no replay). A
    /// source the bounds do not name is refused with its id.
    pub fn of(bounds: Option<&Bounds>, level: TaskLevel, task: TaskId) -> Result<Self, TaskId> {
        Ok(match (bounds, level) {
            (Some(bounds), TaskLevel::Source) => Self::Source {
                bound: bounds.get(&task).cloned().ok_or(task)?,
                reported: false,
                at: None,
            },
            (Some(_), TaskLevel::Sink) => Self::Sink { dropped: 0 },
            _ => Self::None,
        })
    }

    /// Whether this is a source's part in a replay still going on.
    #[must_use]
    pub const fn is_source(&self) -> bool {
        matches!(self, Self::Source { .. })
    }

    /// A source at `offset`: what it may do.
    pub fn gate(&mut self, offset: &SourceOffset) -> SourceGate {
        match self {
            Self::Source {
                bound, reported, ..
            } if offset == bound => SourceGate::AtBound {
                first: !std::mem::replace(reported, true),
            },
            Self::Source { bound, .. } => SourceGate::UpTo(bound.clone()),
            Self::None | Self::Sink { .. } => SourceGate::Free,
        }
    }

    /// A source injected the barrier of `checkpoint` (the first one injected at its
    /// bound is the one whose completion ends its replay).
    pub fn barrier_injected(&mut self, checkpoint: CheckpointId) {
        if let Self::Source { at, .. } = self {
            at.get_or_insert(checkpoint);
        }
    }

    /// `checkpoint` completed: whether that ends a source's replay (it reads on).
    pub fn completed(&mut self, checkpoint: CheckpointId) -> bool {
        let ends = matches!(self, Self::Source { at: Some(at), .. } if checkpoint >= *at);
        if ends {
            *self = Self::None;
        }
        ends
    }

    /// A sink received `records`: whether it must drop them (published already).
    pub fn drops(&mut self, records: usize) -> bool {
        let Self::Sink { dropped } = self else {
            return false;
        };
        *dropped = dropped.saturating_add(records as u64);
        true
    }

    /// A sink takes a snapshot: the records it dropped when that ends its replay
    /// (every transaction from here on is new output).
    pub fn sink_snapshot(&mut self) -> Option<u64> {
        let Self::Sink { dropped } = *self else {
            return None;
        };
        *self = Self::None;
        Some(dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offset(n: u64) -> SourceOffset {
        SourceOffset::new(n.to_be_bytes().to_vec()).unwrap()
    }

    #[test]
    fn a_replaying_source_reads_to_its_bound_then_waits_for_the_checkpoint_there() {
        let bounds = Bounds::from([(TaskId(1), offset(10))]);
        let mut role = ReplayRole::of(Some(&bounds), TaskLevel::Source, TaskId(1)).unwrap();
        assert!(role.is_source());
        assert_eq!(role.gate(&offset(3)), SourceGate::UpTo(offset(10)));
        assert_eq!(role.gate(&offset(10)), SourceGate::AtBound { first: true });
        assert_eq!(role.gate(&offset(10)), SourceGate::AtBound { first: false });
        assert!(
            !role.completed(CheckpointId(4)),
            "no barrier at the bound yet"
        );
        role.barrier_injected(CheckpointId(5));
        role.barrier_injected(CheckpointId(6));
        assert!(!role.completed(CheckpointId(4)), "an older checkpoint");
        assert!(
            role.completed(CheckpointId(5)),
            "the first barrier at the bound"
        );
        assert_eq!(role, ReplayRole::None);
        assert_eq!(role.gate(&offset(10)), SourceGate::Free);
        assert!(!role.completed(CheckpointId(6)));
    }

    #[test]
    fn a_replaying_sink_drops_until_its_first_snapshot() {
        let bounds = Bounds::new();
        let mut role = ReplayRole::of(Some(&bounds), TaskLevel::Sink, TaskId(3)).unwrap();
        assert!(role.drops(5) && role.drops(2));
        assert_eq!(role.sink_snapshot(), Some(7));
        assert!(!role.drops(1), "new output after the first snapshot");
        assert_eq!(role.sink_snapshot(), None);
    }

    #[test]
    fn no_replay_changes_nothing_and_a_source_without_a_bound_is_refused() {
        let mut none = ReplayRole::of(None, TaskLevel::Source, TaskId(1)).unwrap();
        assert_eq!(none.gate(&offset(1)), SourceGate::Free);
        assert!(!none.drops(1) && none.sink_snapshot().is_none());
        let aggregate = ReplayRole::of(Some(&Bounds::new()), TaskLevel::Aggregate, TaskId(2));
        assert_eq!(aggregate, Ok(ReplayRole::None));
        assert_eq!(
            ReplayRole::of(Some(&Bounds::new()), TaskLevel::Source, TaskId(9)),
            Err(TaskId(9))
        );
    }
}
