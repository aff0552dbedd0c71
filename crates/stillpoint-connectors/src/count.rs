//! A keyed counter: the aggregation of the word count.

use stillpoint::{CachedState, EngineError, KeyedState, Operator, Record};

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
        let count = match state.get_cached(COUNTS, &record.key, &[])? {
            None => 0,
            Some(bytes) => count_in(COUNTS, &bytes)?,
        } + 1;
        state.put(COUNTS, &record.key, &[], &count.to_be_bytes())?;
        out.push(Record::new(record.key, count.to_string()));
        Ok(())
    }
}
