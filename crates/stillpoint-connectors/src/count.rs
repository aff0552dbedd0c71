//! A keyed counter: the aggregation of the word count.

use std::collections::HashMap;

use bytes::Bytes;
use stillpoint::{CachedState, Combiner, EngineError, Operator, Record};

/// Counts records per key in keyed state (column family `counts`, the record's key
/// as the state key, the count as 8 bytes big-endian); emits `(key, count)` after
/// each update.
#[derive(Debug, Default)]
pub struct KeyedCount;

/// A count kept in state `state` (8 bytes, big-endian); anything else is an error
/// naming the state.
pub(crate) fn count_in(state: &str, bytes: &[u8]) -> Result<u64, EngineError> {
    let count: [u8; 8] = bytes.try_into().map_err(|_| {
        EngineError::Invalid(format!(
            "a count in state `{state}` is {} bytes, not 8",
            bytes.len()
        ))
    })?;
    Ok(u64::from_be_bytes(count))
}

/// The column family of [`KeyedCount`].
pub const COUNTS: &str = "counts";

impl Operator for KeyedCount {
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        add_to_count(record.key, 1, state, out)
    }
}

/// Adds `by` to the count of `key` in state and emits `(key, count)`.
fn add_to_count(
    key: Bytes,
    by: u64,
    state: &mut CachedState,
    out: &mut Vec<Record>,
) -> Result<(), EngineError> {
    let mut count = 0;
    state.update_cached(COUNTS, &key, &[], |old| {
        count = match old {
            None => 0,
            Some(bytes) => count_in(COUNTS, bytes)?,
        }
        .checked_add(by)
        .ok_or_else(|| EngineError::Invalid(format!("the count of key {key:?} overflows")))?;
        Ok::<_, EngineError>(Some(count.to_be_bytes().to_vec()))
    })?;
    // The count in decimal, in a buffer of exactly its length (one allocation; the
    // formatting machinery of `to_string` and the word source's `format!` took
    // about a tenth of the 1,000-key count bench's CPU under `perf`).
    let decimal = Bytes::copy_from_slice(itoa::Buffer::new().format(count).as_bytes());
    out.push(Record::new(key, decimal));
    Ok(())
}

/// The combiner of a count ([`stillpoint::Dataflow::combine`]): counts the records of
/// each key until a flush, then emits `(key, partial count)` — the count as 8 bytes
/// big-endian — once per key, for a [`CombinedCount`] to add up. Memory: one entry
/// per distinct key between two flushes (at most `Combine::max_records`).
#[derive(Debug, Default)]
pub struct CountCombiner {
    counts: HashMap<Bytes, u64>,
}

impl Combiner for CountCombiner {
    fn add(&mut self, record: Record) -> Result<(), EngineError> {
        let count = self.counts.entry(record.key).or_insert(0);
        *count = count.saturating_add(1);
        Ok(())
    }

    fn flush(&mut self, out: &mut Vec<Record>) -> Result<(), EngineError> {
        out.reserve(self.counts.len());
        out.extend(
            self.counts
                .drain()
                .map(|(key, count)| Record::new(key, Bytes::copy_from_slice(&count.to_be_bytes()))),
        );
        Ok(())
    }
}

/// The keyed count of partial counts from a [`CountCombiner`]: adds each record's
/// partial count (8 bytes big-endian) to its key's count — the same state as
/// [`KeyedCount`]'s, so a job can switch between the two across a restore — and
/// emits `(key, count)` after each update. A value that is not a partial count is a
/// typed error naming it, never a wrong count.
#[derive(Debug, Default)]
pub struct CombinedCount;

impl Operator for CombinedCount {
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        let partial: [u8; 8] = record.value.as_ref().try_into().map_err(|_| {
            EngineError::Invalid(format!(
                "a partial count for key {:?} is {} bytes, not 8: is the stage before a CountCombiner?",
                record.key,
                record.value.len()
            ))
        })?;
        add_to_count(record.key, u64::from_be_bytes(partial), state, out)
    }
}
