//! The simulator's model of changelog snapshots (stillpoint-state's default): an
//! aggregate's durable snapshot is its last materialization plus the segments written
//! since that materialization *began*; a materialization runs in the background and,
//! when it finishes, holds every segment written until then — possibly more than it
//! covers. Restore replays the listed segments over the materialization. Because a
//! segment holds absolute values, the result must equal the state at the barrier;
//! the simulator's exactly-once check fails if it does not (a segment dropped that
//! the materialization did not hold, say).

use std::collections::BTreeMap;
use std::time::Duration;

use stillpoint_wire::TaskId;

use super::SimRng;
use crate::Time;

/// An aggregate's state: records applied per upstream.
pub(super) type Applied = BTreeMap<TaskId, u64>;

/// A durable changelog snapshot: a materialization and the segments to replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Changelogged {
    base: Applied,
    segments: Vec<Applied>,
}

impl Changelogged {
    /// The state a restore builds: the materialization, then each segment in order.
    pub(super) fn replayed(&self) -> Applied {
        let mut state = self.base.clone();
        for segment in &self.segments {
            state.extend(segment.iter().map(|(k, v)| (*k, *v)));
        }
        state
    }
}

/// One aggregate task's changelog.
#[derive(Debug, Default)]
pub(super) struct ChangelogModel {
    /// What the segments so far add up to (the state at the last barrier).
    logged: Applied,
    segments: Vec<(u64, Applied)>,
    next: u64,
    /// The installed materialization and the last segment it is known to hold.
    base: Option<(Applied, u64)>,
    /// A materialization running: the segment it began after, and when it is done.
    running: Option<(u64, Time)>,
}

impl ChangelogModel {
    /// The snapshot at a barrier with `live` state: a segment of what changed since
    /// the last barrier (absolute values), a finished materialization installed, one
    /// started now and then.
    pub(super) fn snapshot(&mut self, live: &Applied, now: Time, rng: &mut SimRng) -> Changelogged {
        let changed: Applied = live
            .iter()
            .filter(|(k, v)| self.logged.get(k) != Some(v))
            .map(|(k, v)| (*k, *v))
            .collect();
        if !changed.is_empty() {
            self.next += 1;
            self.segments.push((self.next, changed));
            self.logged.clone_from(live);
        }
        if let Some((covers, done)) = self.running
            && done <= now
        {
            self.running = None;
            // It holds every segment written until it finished: all of them so far.
            self.install(self.logged.clone(), covers);
        }
        if self.base.is_none() {
            self.install(self.logged.clone(), self.next);
        } else if self.running.is_none() && rng.chance(0.3) {
            let done = now + Duration::from_millis(rng.below(40));
            self.running = Some((self.next, done));
        }
        let (base, covers) = self.base.clone().unwrap_or_default();
        Changelogged {
            base,
            segments: self
                .segments
                .iter()
                .filter(|(ordinal, _)| *ordinal > covers)
                .map(|(_, segment)| segment.clone())
                .collect(),
        }
    }

    fn install(&mut self, state: Applied, covers: u64) {
        self.segments.retain(|(ordinal, _)| *ordinal > covers);
        self.base = Some((state, covers));
    }
}
