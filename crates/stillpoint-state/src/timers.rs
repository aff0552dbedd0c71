//! Per-key timers, kept in keyed state: a timer is an entry of the reserved state
//! [`TIMER_STATE`] under the key it belongs to, so it is in every checkpoint and moves
//! with its key group on a rescale. An in-memory index ordered by time (built from
//! one scan of the task's key groups on first use) finds the due ones without a scan.
//!
//! The task's event time (its watermark) is kept beside them: operators read it to
//! tell late records and set event-time timers; the engine advances it.

use std::collections::BTreeSet;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::{CachedState, KeyedState, StateError};

/// The state holding every timer; operators must not use this name.
pub const TIMER_STATE: &str = "stillpoint.timers";

/// Which clock a timer follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TimeDomain {
    /// The task's watermark: fires once the watermark is at or past the timer's time.
    EventTime,
    /// The wall clock ([`processing_time`]): fires once it is at or past the time.
    ProcessingTime,
}

impl TimeDomain {
    const fn code(self) -> u8 {
        match self {
            Self::EventTime => 0,
            Self::ProcessingTime => 1,
        }
    }
}

/// A due timer, handed to the operator that set it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timer {
    /// Its clock.
    pub domain: TimeDomain,
    /// When it was set to fire, in milliseconds.
    pub time: i64,
    /// The key it was set for.
    pub key: Bytes,
}

/// The wall clock, in milliseconds since the Unix epoch: the processing time timers
/// follow.
#[must_use]
pub fn processing_time() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        })
}

/// The timers' in-memory index and the task's event time.
#[derive(Debug)]
pub(crate) struct TimerIndex {
    loaded: bool,
    due: BTreeSet<(TimeDomain, i64, Bytes)>,
    watermark: i64,
}

impl Default for TimerIndex {
    fn default() -> Self {
        Self {
            loaded: false,
            due: BTreeSet::new(),
            watermark: i64::MIN,
        }
    }
}

/// A timer's field under its key: the domain, then the time with its sign bit
/// flipped, big-endian (so fields sort by time).
fn field(domain: TimeDomain, time: i64) -> [u8; 9] {
    let mut out = [0; 9];
    out[0] = domain.code();
    out[1..].copy_from_slice(&(u64::from_be_bytes(time.to_be_bytes()) ^ (1 << 63)).to_be_bytes());
    out
}

fn parse_field(field: &[u8]) -> Option<(TimeDomain, i64)> {
    let (code, time) = field.split_first()?;
    let domain = match code {
        0 => TimeDomain::EventTime,
        1 => TimeDomain::ProcessingTime,
        _ => return None,
    };
    let time = u64::from_be_bytes(time.try_into().ok()?) ^ (1 << 63);
    Some((domain, i64::from_be_bytes(time.to_be_bytes())))
}

impl CachedState {
    /// Sets a timer for `key` at `time` (milliseconds) on `domain`'s clock; setting
    /// one that is set already changes nothing. It fires once (the operator's
    /// `on_timer`), unless deleted first.
    pub fn register_timer(
        &mut self,
        domain: TimeDomain,
        key: &[u8],
        time: i64,
    ) -> Result<(), StateError> {
        self.load_timers()?;
        self.put(TIMER_STATE, key, &field(domain, time), &[])?;
        self.timers
            .due
            .insert((domain, time, Bytes::copy_from_slice(key)));
        Ok(())
    }

    /// Deletes a timer, if set.
    pub fn delete_timer(
        &mut self,
        domain: TimeDomain,
        key: &[u8],
        time: i64,
    ) -> Result<(), StateError> {
        self.load_timers()?;
        self.delete(TIMER_STATE, key, &field(domain, time))?;
        self.timers
            .due
            .remove(&(domain, time, Bytes::copy_from_slice(key)));
        Ok(())
    }

    /// The time of the earliest timer on `domain`'s clock.
    pub fn next_timer(&mut self, domain: TimeDomain) -> Result<Option<i64>, StateError> {
        Ok(self.earliest(domain)?.map(|(_, time, _)| time))
    }

    fn earliest(
        &mut self,
        domain: TimeDomain,
    ) -> Result<Option<(TimeDomain, i64, Bytes)>, StateError> {
        self.load_timers()?;
        Ok(self
            .timers
            .due
            .range((domain, i64::MIN, Bytes::new())..)
            .next()
            .filter(|(d, _, _)| *d == domain)
            .cloned())
    }

    /// Removes and returns the earliest timer on `domain`'s clock set at or before
    /// `now`: the caller fires it. Timers come out in time order, then key order.
    pub fn pop_timer(&mut self, domain: TimeDomain, now: i64) -> Result<Option<Timer>, StateError> {
        let Some(entry) = self.earliest(domain)?.filter(|(_, time, _)| *time <= now) else {
            return Ok(None);
        };
        self.timers.due.remove(&entry);
        let (domain, time, key) = entry;
        self.delete(TIMER_STATE, &key, &field(domain, time))?;
        Ok(Some(Timer { domain, time, key }))
    }

    /// The task's event time: its watermark (`i64::MIN` until its inputs send one).
    #[must_use]
    pub const fn watermark(&self) -> i64 {
        self.timers.watermark
    }

    /// Advances the task's event time (the engine does, as watermarks arrive); it
    /// never goes back.
    pub fn advance_watermark(&mut self, watermark: i64) {
        self.timers.watermark = self.timers.watermark.max(watermark);
    }

    /// Builds the index from the timers in state, once.
    fn load_timers(&mut self) -> Result<(), StateError> {
        if self.timers.loaded {
            return Ok(());
        }
        let mut due = BTreeSet::new();
        let groups = self.backend().key_group_range();
        self.scan(TIMER_STATE, groups, &mut |key, field, _| {
            if let Some((domain, time)) = parse_field(field) {
                due.insert((domain, time, Bytes::copy_from_slice(key)));
            }
            true
        })?;
        self.timers.due = due;
        self.timers.loaded = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_sort_by_time_and_round_trip() {
        let times = [i64::MIN, -5, -1, 0, 1, 1_700_000_000_000, i64::MAX];
        for pair in times.windows(2) {
            assert!(field(TimeDomain::EventTime, pair[0]) < field(TimeDomain::EventTime, pair[1]));
        }
        for time in times {
            for domain in [TimeDomain::EventTime, TimeDomain::ProcessingTime] {
                assert_eq!(parse_field(&field(domain, time)), Some((domain, time)));
            }
        }
        assert_eq!(parse_field(&[2; 9]), None);
        assert_eq!(parse_field(&[0; 5]), None);
        assert!(processing_time() > 1_700_000_000_000);
    }
}
