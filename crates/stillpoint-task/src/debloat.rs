//! Buffer debloating: how many records one data message should carry so that a task
//! drains a full input edge within a target time (Flink's buffer debloating, sized in
//! records per message instead of bytes per network buffer).
//!
//! A barrier waits behind everything queued on its edge, so a task aligning on a
//! checkpoint waits for its slowest input's queue to drain. A queue of fixed size in
//! messages holds a fixed number of records; when each record is expensive (a read of
//! a key absent from memory on a large state costs ≈ 10 µs) the same queue holds tens
//! of milliseconds of work, and that is the alignment. The receiving task measures
//! how long its records take and asks its senders for messages that small: the
//! channel's `slots` messages then hold about `target` of work whatever a record
//! costs. A cheap record keeps the full configured size. Sans-IO: the caller
//! measures and passes the time.

use std::time::Duration;

/// The fewest records a message is cut to: below it the per-message hand-off would
/// cost more than the records.
pub const MIN_RECORDS_PER_MESSAGE: u32 = 8;

/// One receiving task's estimate of the message size its upstreams should send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Debloater {
    /// Target time of one message: the edge's target over its slots, nanoseconds.
    per_message_nanos: u128,
    /// The configured (largest) size.
    ceiling: u32,
    /// Moving average of the time one record takes, nanoseconds, once measured.
    per_record_nanos: Option<u128>,
}

/// The newest measurement weighs 1/`SMOOTHING` in the moving average: a change of
/// record cost (a state warming up, a spill) shows within a few messages.
const SMOOTHING: i128 = 4;

impl Debloater {
    /// A task whose input edges hold `slots` messages each, which should drain a full
    /// edge within `target`, with messages of at most `ceiling` records (the
    /// configured batch). Until it has measured, it asks for `ceiling`.
    #[must_use]
    pub fn new(target: Duration, slots: usize, ceiling: usize) -> Self {
        let slots = u128::try_from(slots.max(1)).unwrap_or(u128::MAX);
        Self {
            per_message_nanos: target.as_nanos() / slots,
            ceiling: u32::try_from(ceiling)
                .unwrap_or(u32::MAX)
                .max(MIN_RECORDS_PER_MESSAGE),
            per_record_nanos: None,
        }
    }

    /// The task took `busy` to process a message of `records` records (and send what
    /// it made of them); returns the records per message it now asks for.
    pub fn observe(&mut self, records: usize, busy: Duration) -> u32 {
        if let Ok(records @ 1..) = u128::try_from(records) {
            let sample = busy.as_nanos() / records;
            self.per_record_nanos = Some(match self.per_record_nanos {
                // Both are at most `Duration::MAX` in nanoseconds (< 2^94): no overflow.
                Some(average) => {
                    let (average, sample) = (average as i128, sample as i128);
                    (average + (sample - average) / SMOOTHING).unsigned_abs()
                }
                None => sample,
            });
        }
        self.records_per_message()
    }

    /// The records per message this task asks its upstreams for: what its measured
    /// record cost fits in the target, between [`MIN_RECORDS_PER_MESSAGE`] and the
    /// configured size.
    #[must_use]
    pub fn records_per_message(&self) -> u32 {
        match self.per_record_nanos {
            Some(per_record @ 1..) => u32::try_from(self.per_message_nanos / per_record)
                .unwrap_or(u32::MAX)
                .clamp(MIN_RECORDS_PER_MESSAGE, self.ceiling),
            _ => self.ceiling,
        }
    }
}

/// Records a sender reads at once so that each downstream gets about one message of
/// the size it asks for: the smallest asked size times the downstreams its records
/// spread over (`spread`: their number when records are partitioned by key, 1 when
/// each goes to one or every downstream), at most `batch` per downstream (so a
/// keyed edge's messages carry up to `batch` records each, not `batch ÷ spread`:
/// every message is a hand-off and often a thread wake-up), at least 1. A source's
/// barrier goes out only after all it read, so reading more would hold it back.
pub fn records_to_read(
    asked: impl IntoIterator<Item = usize>,
    spread: usize,
    batch: usize,
) -> usize {
    let spread = spread.max(1);
    let smallest = asked.into_iter().min().unwrap_or(usize::MAX);
    smallest
        .saturating_mul(spread)
        .clamp(1, batch.max(1).saturating_mul(spread))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn micros(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn asks_for_the_configured_size_until_it_has_measured() {
        let mut debloater = Debloater::new(micros(1000), 4, 256);
        assert_eq!(debloater.records_per_message(), 256);
        assert_eq!(
            debloater.observe(0, micros(5)),
            256,
            "an empty message says nothing"
        );
    }

    #[test]
    fn expensive_records_shrink_the_messages_to_the_target() {
        let mut debloater = Debloater::new(micros(1000), 4, 256);
        // 10 µs a record: a quarter of 1 ms holds 25 records.
        assert_eq!(debloater.observe(100, micros(1000)), 25);
        // A full edge (4 messages) then drains in 1 ms.
        assert_eq!(4 * 25 * 10, 1000);
    }

    #[test]
    fn cheap_records_keep_the_configured_size() {
        let mut debloater = Debloater::new(micros(1000), 4, 256);
        assert_eq!(debloater.observe(256, micros(128)), 256);
    }

    #[test]
    fn the_size_never_falls_below_the_floor_nor_rises_above_the_ceiling() {
        let mut debloater = Debloater::new(micros(1000), 4, 256);
        assert_eq!(
            debloater.observe(1, Duration::from_secs(1)),
            MIN_RECORDS_PER_MESSAGE
        );
        let mut tiny = Debloater::new(micros(1000), 4, 2);
        assert_eq!(
            tiny.records_per_message(),
            MIN_RECORDS_PER_MESSAGE,
            "a ceiling below the floor is raised to it"
        );
        assert_eq!(tiny.observe(2, Duration::ZERO), MIN_RECORDS_PER_MESSAGE);
        let mut free = Debloater::new(micros(1000), 4, 256);
        assert_eq!(
            free.observe(100, Duration::ZERO),
            256,
            "no cost measured: full size"
        );
    }

    #[test]
    fn the_estimate_follows_a_change_of_record_cost_within_a_few_messages() {
        let mut debloater = Debloater::new(micros(1000), 4, 256);
        debloater.observe(100, micros(100)); // 1 µs a record
        assert_eq!(debloater.records_per_message(), 250);
        let sizes: Vec<u32> = (0..8)
            .map(|_| debloater.observe(100, micros(2000))) // 20 µs a record
            .collect();
        assert!(
            sizes.windows(2).all(|w| w[1] <= w[0]),
            "shrinks monotonically: {sizes:?}"
        );
        assert!(sizes[0] < 250 && sizes[7] <= 15, "{sizes:?}");
        // And back (the average approaches 1 µs again).
        let back: Vec<u32> = (0..20)
            .map(|_| debloater.observe(100, micros(100)))
            .collect();
        assert!(back.windows(2).all(|w| w[1] >= w[0]), "{back:?}");
        assert!(back[19] >= 200, "{back:?}");
    }

    #[test]
    fn a_sender_reads_what_fills_one_asked_message_per_downstream() {
        assert_eq!(
            records_to_read([8, 30, 256], 3, 256),
            24,
            "the smallest, spread"
        );
        assert_eq!(records_to_read([8, 30], 1, 256), 8, "forward or broadcast");
        assert_eq!(
            records_to_read([256, 256, 256], 3, 256),
            768,
            "a full message each"
        );
        assert_eq!(
            records_to_read([usize::MAX, 300], 2, 256),
            512,
            "at most the batch per downstream"
        );
        assert_eq!(records_to_read([], 1, 256), 256, "no downstream: the batch");
        assert_eq!(
            records_to_read([], 3, 256),
            768,
            "none asks (other processes): the batch each"
        );
        assert_eq!(records_to_read([0], 0, 0), 1, "at least one");
    }

    #[test]
    fn slots_share_the_target() {
        let mut one = Debloater::new(micros(1000), 1, 1000);
        let mut four = Debloater::new(micros(1000), 4, 1000);
        assert_eq!(one.observe(10, micros(100)), 100);
        assert_eq!(four.observe(10, micros(100)), 25);
        let mut zero = Debloater::new(micros(1000), 0, 1000);
        assert_eq!(zero.observe(10, micros(100)), 100, "no slots counts as one");
    }
}
