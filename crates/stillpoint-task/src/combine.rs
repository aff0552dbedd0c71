//! When a stage's combiner flushes — the engine's pre-aggregation before the shuffle
//! (Flink's local aggregation of two-phase aggregates). Sans-IO like the rest: the
//! caller passes `now`. Besides what [`CombineClock`] decides, the engine flushes
//! before every barrier, watermark and end of input, and whenever a task is idle.

use std::time::Duration;

use crate::Time;

/// How much a combiner may hold: a flush once `max_records` records were added since
/// the last one (so it never holds more distinct keys) or once the first of them has
/// waited `max_delay`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Combine {
    /// Records added since the last flush at which it flushes.
    pub max_records: usize,
    /// How long the first record added since the last flush may wait.
    pub max_delay: Duration,
}

impl Default for Combine {
    /// 5,000 records or 200 ms: Flink's `table.exec.mini-batch.size` and
    /// `allow-latency` in stillpoint's peer comparison.
    fn default() -> Self {
        Self {
            max_records: 5_000,
            max_delay: Duration::from_millis(200),
        }
    }
}

/// What a combiner holds, counted: records since the last flush and when the first of
/// them came.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineClock {
    when: Combine,
    added: usize,
    since: Option<Time>,
}

impl CombineClock {
    /// Nothing held yet.
    #[must_use]
    pub const fn new(when: Combine) -> Self {
        Self {
            when,
            added: 0,
            since: None,
        }
    }

    /// `records` more were added at `now`: whether to flush now.
    pub fn add(&mut self, records: usize, now: Time) -> bool {
        if records > 0 {
            self.added = self.added.saturating_add(records);
            self.since.get_or_insert(now);
        }
        self.added >= self.when.max_records || self.late(now)
    }

    /// Whether the first record held has waited `max_delay` by `now`.
    #[must_use]
    pub fn late(&self, now: Time) -> bool {
        self.since
            .is_some_and(|since| now.saturating_since(since) >= self.when.max_delay)
    }

    /// Whether it holds nothing.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.added == 0
    }

    /// The combiner flushed: nothing held.
    pub fn flushed(&mut self) {
        self.added = 0;
        self.since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_flushes_at_the_record_bound_or_once_the_first_record_is_late() {
        let when = Combine {
            max_records: 10,
            max_delay: Duration::from_millis(200),
        };
        let mut clock = CombineClock::new(when);
        assert!(clock.is_empty());
        assert!(
            !clock.late(Time::from_millis(10_000)),
            "nothing held is never late"
        );
        assert!(!clock.add(4, Time::from_millis(100)));
        assert!(!clock.add(5, Time::from_millis(250)));
        assert!(!clock.is_empty());
        assert!(clock.add(1, Time::from_millis(260)), "10 records");
        clock.flushed();
        assert!(clock.is_empty());
        assert!(!clock.add(1, Time::from_millis(300)));
        assert!(!clock.late(Time::from_millis(499)));
        assert!(clock.late(Time::from_millis(500)), "200 ms after the first");
        assert!(clock.add(0, Time::from_millis(500)));
    }
}
