//! Event time, sans-IO: the watermarks a source generates from the event times it
//! reads (bounded out-of-orderness, idleness), and the watermark a task has reached
//! over all its inputs (the minimum, idle and ended inputs left out, never going
//! back).
//!
//! Time is in milliseconds (`i64`). A watermark `w` says: no record with an event time
//! `<= w` follows; a record that comes anyway is *late*. An event-time timer at `t`
//! fires once the watermark is `>= t`.

use std::collections::BTreeMap;
use std::time::Duration;

use stillpoint_wire::TaskId;

use crate::Time;

/// How a source derives watermarks from the event times it reads, like Flink's
/// `WatermarkStrategy.forBoundedOutOfOrderness(..).withIdleness(..)`: the watermark
/// trails the largest event time read by `out_of_orderness` (so records up to that
/// much out of order are not late), and a source that reads nothing for `idle_after`
/// is idle — left out of its downstreams' watermark until it reads again, so one
/// quiet partition does not hold back every window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatermarkStrategy {
    /// How far out of order event times may arrive.
    pub out_of_orderness: Duration,
    /// After how long without input the source is idle; `None`: never.
    pub idle_after: Option<Duration>,
}

impl WatermarkStrategy {
    /// Watermarks trailing the largest event time by `out_of_orderness`, never idle.
    #[must_use]
    pub const fn bounded(out_of_orderness: Duration) -> Self {
        Self {
            out_of_orderness,
            idle_after: None,
        }
    }

    /// The same, idle after `after` without input.
    #[must_use]
    pub const fn idle_after(mut self, after: Duration) -> Self {
        self.idle_after = Some(after);
        self
    }
}

/// What a source (or a task) tells its downstreams about event time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventTimeUpdate {
    /// The watermark advanced to this time.
    Advanced(i64),
    /// No input for now: leave this sender out until it advances again.
    Idle,
}

/// A source's watermark generator ([`WatermarkStrategy`]).
#[derive(Clone, Debug)]
pub struct WatermarkGenerator {
    strategy: WatermarkStrategy,
    /// The largest event time read.
    largest: Option<i64>,
    /// The last watermark sent.
    sent: Option<i64>,
    /// Since when nothing was read (`None`: input is flowing).
    quiet_since: Option<Time>,
    idle: bool,
}

impl WatermarkGenerator {
    /// A generator that has seen nothing.
    #[must_use]
    pub const fn new(strategy: WatermarkStrategy) -> Self {
        Self {
            strategy,
            largest: None,
            sent: None,
            quiet_since: None,
            idle: false,
        }
    }

    /// The source read records with these event times (records without one do not
    /// move event time); returns what to send downstream, if anything changed.
    pub fn on_records(
        &mut self,
        times: impl IntoIterator<Item = Option<i64>>,
    ) -> Option<EventTimeUpdate> {
        self.quiet_since = None;
        let was_idle = std::mem::replace(&mut self.idle, false);
        if let Some(largest) = times.into_iter().flatten().max() {
            self.largest = Some(self.largest.map_or(largest, |l| l.max(largest)));
        }
        let bound = i64::try_from(self.strategy.out_of_orderness.as_millis()).unwrap_or(i64::MAX);
        let watermark = self.largest?.saturating_sub(bound).saturating_sub(1);
        if was_idle || self.sent.is_none_or(|sent| watermark > sent) {
            let watermark = self.sent.map_or(watermark, |sent| sent.max(watermark));
            self.sent = Some(watermark);
            return Some(EventTimeUpdate::Advanced(watermark));
        }
        None
    }

    /// The source read nothing at `now`; returns [`EventTimeUpdate::Idle`] once it has
    /// read nothing for the strategy's `idle_after`.
    pub fn on_nothing(&mut self, now: Time) -> Option<EventTimeUpdate> {
        let after = self.strategy.idle_after?;
        let since = *self.quiet_since.get_or_insert(now);
        if self.idle || now.saturating_since(since) < after {
            return None;
        }
        self.idle = true;
        Some(EventTimeUpdate::Idle)
    }
}

/// What one input last said about event time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InputTime {
    At(i64),
    Idle(i64),
    Ended,
}

/// The watermark a task has reached: the minimum of its inputs' watermarks, idle
/// inputs left out and ended ones at `i64::MAX`; it never goes back. Every input starts at
/// `i64::MIN` (a restored task too: its sources send their watermarks again as they
/// replay), so one input that never sends a watermark holds the task at `i64::MIN`.
#[derive(Clone, Debug)]
pub struct EventClock {
    inputs: BTreeMap<TaskId, InputTime>,
    current: i64,
    idle: bool,
}

impl EventClock {
    /// A clock over `inputs`, all at `i64::MIN`.
    pub fn new(inputs: impl IntoIterator<Item = TaskId>) -> Self {
        Self {
            inputs: inputs
                .into_iter()
                .map(|input| (input, InputTime::At(i64::MIN)))
                .collect(),
            current: i64::MIN,
            idle: false,
        }
    }

    /// The watermark reached.
    #[must_use]
    pub const fn current(&self) -> i64 {
        self.current
    }

    /// Input `from` sent a watermark (`idle`: it is idle, at `time`); returns what
    /// to tell downstream if this task's watermark advanced or it became idle. A
    /// watermark from an unknown or ended input changes nothing.
    pub fn on_watermark(&mut self, from: TaskId, time: i64, idle: bool) -> Option<EventTimeUpdate> {
        let input = self.inputs.get_mut(&from)?;
        let time = match *input {
            InputTime::Ended => return None,
            InputTime::At(before) | InputTime::Idle(before) => before.max(time),
        };
        *input = if idle {
            InputTime::Idle(time)
        } else {
            InputTime::At(time)
        };
        self.update()
    }

    /// Input `from` ended: it holds nothing back any more. Once every input has
    /// ended (or the others are idle) the watermark is `i64::MAX`: every event-time
    /// timer fires.
    pub fn on_end(&mut self, from: TaskId) -> Option<EventTimeUpdate> {
        *self.inputs.get_mut(&from)? = InputTime::Ended;
        self.update()
    }

    fn update(&mut self) -> Option<EventTimeUpdate> {
        // An ended input is at the end of time (as in Flink): it holds nothing back,
        // and with only idle inputs beside it, time runs to the end.
        let active = self.inputs.values().filter_map(|input| match input {
            InputTime::At(time) => Some(*time),
            InputTime::Ended => Some(i64::MAX),
            InputTime::Idle(_) => None,
        });
        let Some(reached) = active.min() else {
            let became_idle = !std::mem::replace(&mut self.idle, true);
            return became_idle.then_some(EventTimeUpdate::Idle);
        };
        let was_idle = std::mem::replace(&mut self.idle, false);
        if reached > self.current || was_idle {
            self.current = self.current.max(reached);
            return Some(EventTimeUpdate::Advanced(self.current));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use EventTimeUpdate::{Advanced, Idle};

    const A: TaskId = TaskId(1);
    const B: TaskId = TaskId(2);

    #[test]
    fn a_source_trails_its_largest_event_time_and_goes_idle() {
        let strategy = WatermarkStrategy::bounded(Duration::from_millis(100))
            .idle_after(Duration::from_millis(50));
        let mut generator = WatermarkGenerator::new(strategy);
        let t = Time::from_millis;
        assert_eq!(generator.on_records([None]), None);
        assert_eq!(
            generator.on_records([Some(1_000), Some(900)]),
            Some(Advanced(899))
        );
        // Out of order but not past the largest: no change.
        assert_eq!(generator.on_records([Some(950)]), None);
        assert_eq!(generator.on_records([Some(1_200)]), Some(Advanced(1_099)));
        assert_eq!(generator.on_nothing(t(10)), None);
        assert_eq!(generator.on_nothing(t(59)), None);
        assert_eq!(generator.on_nothing(t(60)), Some(Idle));
        assert_eq!(generator.on_nothing(t(100)), None);
        // Active again: says where it is, even without a larger time.
        assert_eq!(generator.on_records([Some(5)]), Some(Advanced(1_099)));
        let mut never_idle = WatermarkGenerator::new(WatermarkStrategy::bounded(Duration::ZERO));
        assert_eq!(never_idle.on_nothing(t(0)), None);
        assert_eq!(never_idle.on_nothing(t(1_000_000)), None);
    }

    #[test]
    fn a_task_takes_the_minimum_over_active_inputs() {
        let mut clock = EventClock::new([A, B]);
        assert_eq!(clock.on_watermark(A, 100, false), None, "B still at MIN");
        assert_eq!(clock.on_watermark(B, 50, false), Some(Advanced(50)));
        assert_eq!(clock.on_watermark(B, 150, false), Some(Advanced(100)));
        // Watermarks never go back, per input or overall.
        assert_eq!(clock.on_watermark(A, 10, false), None);
        assert_eq!(clock.current(), 100);
        assert_eq!(
            clock.on_watermark(TaskId(9), 1_000, false),
            None,
            "not an input"
        );
    }

    #[test]
    fn an_idle_input_does_not_hold_the_watermark_back() {
        let mut clock = EventClock::new([A, B]);
        assert_eq!(clock.on_watermark(A, 500, false), None);
        assert_eq!(clock.on_watermark(B, 0, true), Some(Advanced(500)));
        assert_eq!(clock.on_watermark(A, 700, false), Some(Advanced(700)));
        // B wakes up behind: the watermark stays where it is until B catches up.
        assert_eq!(clock.on_watermark(B, 600, false), None);
        assert_eq!(clock.current(), 700);
        assert_eq!(clock.on_watermark(A, 900, false), None);
        assert_eq!(clock.on_watermark(B, 800, false), Some(Advanced(800)));
        // Both idle: the task is idle, once.
        assert_eq!(clock.on_watermark(A, 900, true), None);
        assert_eq!(clock.on_watermark(B, 800, true), Some(Idle));
        assert_eq!(clock.on_watermark(B, 800, true), None);
        assert_eq!(clock.on_watermark(A, 950, false), Some(Advanced(950)));
    }

    #[test]
    fn ended_inputs_leave_the_minimum_and_all_ended_is_the_end_of_time() {
        let mut clock = EventClock::new([A, B]);
        assert_eq!(clock.on_watermark(A, 300, false), None);
        assert_eq!(clock.on_end(B), Some(Advanced(300)));
        assert_eq!(clock.on_watermark(B, 1_000, false), None, "B ended");
        assert_eq!(clock.on_end(A), Some(Advanced(i64::MAX)));
        assert_eq!(clock.on_end(A), None);
        let no_inputs = EventClock::new([]);
        assert_eq!(no_inputs.current(), i64::MIN);
        // One input ended, the other idle: nothing holds time back.
        let mut clock = EventClock::new([A, B]);
        assert_eq!(clock.on_watermark(B, 0, true), None, "A still at MIN");
        assert_eq!(clock.on_end(A), Some(Advanced(i64::MAX)));
    }
}
