//! Event-time windows as a keyed operator, built on the engine's timers: tumbling and
//! sliding windows with an aggregate function and allowed lateness, like Flink's
//! `window(..).allowedLateness(..).aggregate(..)`.
//!
//! Per key, each window's accumulator is an entry of keyed state (state
//! [`WINDOWS`], the field the window's start), and an event-time timer at the
//! window's last millisecond fires it: the aggregate's result goes out, and the
//! accumulator is dropped once the watermark passes the end plus the allowed
//! lateness (a record arriving within the lateness fires the window again, with the
//! record counted). A record later than that is dropped and counted.
//!
//! Accumulators and timers are keyed state, so windows survive a restore and move
//! with their key on a rescale. With event times no more out of order than the
//! source's watermark strategy allows, no record is late and the published windows
//! are exactly those of a failure-free run.

use std::time::Duration;

use bytes::Bytes;
use stillpoint::{CachedState, EngineError, KeyedState, Operator, Record, TimeDomain, Timer};

/// The state holding the window accumulators.
pub const WINDOWS: &str = "windows";

/// One window: event times `start <= t < end`, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Window {
    /// The first millisecond in the window.
    pub start: i64,
    /// The first millisecond after it.
    pub end: i64,
}

impl Window {
    /// The last millisecond in the window: its results carry this event time, and it
    /// fires once the watermark reaches it.
    #[must_use]
    pub const fn last(self) -> i64 {
        self.end.saturating_sub(1)
    }
}

/// Which windows a record belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowSpec {
    size: i64,
    slide: i64,
}

fn millis(duration: Duration, what: &str) -> Result<i64, EngineError> {
    match i64::try_from(duration.as_millis()) {
        Ok(ms) if ms > 0 => Ok(ms),
        _ => Err(EngineError::Invalid(format!(
            "a window's {what} must be between 1 ms and i64::MAX ms, not {duration:?}"
        ))),
    }
}

impl WindowSpec {
    /// Back-to-back windows of `size`: each record is in exactly one.
    pub fn tumbling(size: Duration) -> Result<Self, EngineError> {
        let size = millis(size, "size")?;
        Ok(Self { size, slide: size })
    }

    /// Windows of `size` starting every `slide`: a record is in `size / slide` of
    /// them (rounded up). `slide` must not exceed `size`.
    pub fn sliding(size: Duration, slide: Duration) -> Result<Self, EngineError> {
        let (size, slide) = (millis(size, "size")?, millis(slide, "slide")?);
        if slide > size {
            return Err(EngineError::Invalid(format!(
                "a sliding window's slide ({slide} ms) is larger than its size ({size} ms): records would fall between windows"
            )));
        }
        Ok(Self { size, slide })
    }

    /// The windows holding event time `time`, latest first.
    pub fn windows_of(self, time: i64) -> impl Iterator<Item = Window> {
        let last_start = time.saturating_sub(time.rem_euclid(self.slide));
        (0..)
            .map(move |i: i64| last_start.saturating_sub(i.saturating_mul(self.slide)))
            .take_while(move |start| time.saturating_sub(*start) < self.size)
            .map(move |start| Window {
                start,
                end: start.saturating_add(self.size),
            })
    }
}

/// What a window computes over its records.
pub trait Aggregate: Send {
    /// Folds `record` into the accumulator (`None` for a window's first record).
    fn add(&self, accumulator: Option<&[u8]>, record: &Record) -> Result<Vec<u8>, EngineError>;
    /// The value a window of `key` emits from its accumulator.
    fn result(&self, key: &Bytes, window: Window, accumulator: &[u8])
    -> Result<Bytes, EngineError>;
}

/// Counts a window's records; emits `"<start> <end> <count>"`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CountAggregate;

fn count_of(accumulator: &[u8]) -> Result<u64, EngineError> {
    crate::count::count_in(WINDOWS, accumulator)
}

impl Aggregate for CountAggregate {
    fn add(&self, accumulator: Option<&[u8]>, _record: &Record) -> Result<Vec<u8>, EngineError> {
        let count = accumulator.map_or(Ok(0), count_of)?;
        Ok((count + 1).to_be_bytes().to_vec())
    }

    fn result(
        &self,
        _key: &Bytes,
        window: Window,
        accumulator: &[u8],
    ) -> Result<Bytes, EngineError> {
        let count = count_of(accumulator)?;
        Ok(format!("{} {} {count}", window.start, window.end).into())
    }
}

/// The window operator; see the module docs.
pub struct WindowOperator<A> {
    spec: WindowSpec,
    lateness: i64,
    aggregate: A,
    dropped: u64,
}

impl<A: Aggregate> WindowOperator<A> {
    /// Windows `spec` aggregated by `aggregate`, no allowed lateness.
    pub const fn new(spec: WindowSpec, aggregate: A) -> Self {
        Self {
            spec,
            lateness: 0,
            aggregate,
            dropped: 0,
        }
    }

    /// Keeps each window `lateness` past its end: a record arriving that late still
    /// counts and fires the window again.
    #[must_use]
    pub fn allowed_lateness(mut self, lateness: Duration) -> Self {
        self.lateness = i64::try_from(lateness.as_millis()).unwrap_or(i64::MAX);
        self
    }

    /// Records dropped as too late (since this operator was created).
    #[must_use]
    pub const fn dropped(&self) -> u64 {
        self.dropped
    }

    /// When a window's accumulator goes: the watermark past its end plus lateness.
    const fn cleanup(&self, window: Window) -> i64 {
        window.last().saturating_add(self.lateness)
    }

    fn emit(&self, key: &Bytes, window: Window, accumulator: &[u8]) -> Result<Record, EngineError> {
        let value = self.aggregate.result(key, window, accumulator)?;
        Ok(Record::new(key.clone(), value).at(window.last()))
    }
}

/// A window's field under its key: the start, sign bit flipped, big-endian.
fn field(start: i64) -> [u8; 8] {
    (u64::from_be_bytes(start.to_be_bytes()) ^ (1 << 63)).to_be_bytes()
}

impl<A: Aggregate> Operator for WindowOperator<A> {
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        let time = record.time.ok_or_else(|| {
            EngineError::Invalid(format!(
                "a record of key {:?} reached an event-time window without an event time (the source must set Record::time)",
                String::from_utf8_lossy(&record.key)
            ))
        })?;
        let watermark = state.watermark();
        for window in self.spec.windows_of(time) {
            if self.cleanup(window) <= watermark {
                self.dropped += 1;
                tracing::debug!(
                    time,
                    watermark,
                    "a record later than its window's allowed lateness was dropped"
                );
                continue;
            }
            let field = field(window.start);
            let (mut opened, mut accumulator) = (false, Vec::new());
            state.update_cached(WINDOWS, &record.key, &field, |before| {
                opened = before.is_none();
                accumulator = self.aggregate.add(before, &record)?;
                Ok::<_, EngineError>(Some(accumulator.clone()))
            })?;
            if window.last() <= watermark {
                // Late but within the lateness: the window fires again, updated.
                out.push(self.emit(&record.key, window, &accumulator)?);
            } else if opened {
                state.register_timer(TimeDomain::EventTime, &record.key, window.last())?;
            }
            if opened && self.lateness > 0 {
                state.register_timer(TimeDomain::EventTime, &record.key, self.cleanup(window))?;
            }
        }
        Ok(())
    }

    fn on_timer(
        &mut self,
        timer: Timer,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        // A timer at `t` fires the window whose last millisecond is `t` and drops the
        // one whose allowed lateness ends at `t`; both starts follow from `t`, so each
        // is one lookup, not a scan of every window of the key.
        let fires = Window {
            start: timer.time.saturating_add(1).saturating_sub(self.spec.size),
            end: timer.time.saturating_add(1),
        };
        if let Some(accumulator) = state.get_cached(WINDOWS, &timer.key, &field(fires.start))? {
            out.push(self.emit(&timer.key, fires, &accumulator)?);
        }
        let ends = field(fires.start.saturating_sub(self.lateness));
        if state.get_cached(WINDOWS, &timer.key, &ends)?.is_some() {
            state.delete(WINDOWS, &timer.key, &ends)?;
        }
        Ok(())
    }

    /// Which windows fire before a barrier depends on how watermarks interleave with
    /// records, so a replay up to published output cannot reproduce it exactly.
    fn deterministic(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn starts(spec: WindowSpec, time: i64) -> Vec<i64> {
        spec.windows_of(time).map(|w| w.start).collect()
    }

    #[test]
    fn records_fall_into_their_windows() {
        let tumbling = WindowSpec::tumbling(Duration::from_millis(10)).unwrap();
        assert_eq!(starts(tumbling, 0), [0]);
        assert_eq!(starts(tumbling, 9), [0]);
        assert_eq!(starts(tumbling, 10), [10]);
        assert_eq!(starts(tumbling, -1), [-10]);
        let sliding =
            WindowSpec::sliding(Duration::from_millis(10), Duration::from_millis(5)).unwrap();
        assert_eq!(starts(sliding, 12), [10, 5]);
        assert_eq!(starts(sliding, 10), [10, 5]);
        assert_eq!(starts(sliding, 4), [0, -5]);
        let uneven =
            WindowSpec::sliding(Duration::from_millis(10), Duration::from_millis(3)).unwrap();
        assert_eq!(starts(uneven, 10), [9, 6, 3]);
        assert_eq!(Window { start: 0, end: 10 }.last(), 9);
    }

    #[test]
    fn bad_window_shapes_are_refused_naming_the_field() {
        let zero = WindowSpec::tumbling(Duration::ZERO)
            .unwrap_err()
            .to_string();
        assert!(zero.contains("size"), "{zero}");
        let gap = WindowSpec::sliding(Duration::from_millis(5), Duration::from_millis(10))
            .unwrap_err()
            .to_string();
        assert!(
            gap.contains("slide (10 ms) is larger than its size (5 ms)"),
            "{gap}"
        );
        let sub_ms = WindowSpec::sliding(Duration::from_millis(5), Duration::from_micros(10))
            .unwrap_err()
            .to_string();
        assert!(sub_ms.contains("slide"), "{sub_ms}");
    }

    #[test]
    fn fields_sort_by_start() {
        for pair in [i64::MIN, -1, 0, 1, i64::MAX].windows(2) {
            assert!(field(pair[0]) < field(pair[1]));
        }
        let short = count_of(&[1]).unwrap_err().to_string();
        assert!(short.contains("is 1 bytes, not 8"), "{short}");
    }
}
