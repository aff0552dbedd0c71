//! A deterministic bounded source of generated words, for tests, benchmarks and the
//! embedded default job.

use std::time::Duration;

use stillpoint::{EngineError, Record, Source, SourcePoll, WatermarkStrategy};
use stillpoint_wire::SourceOffset;

/// The position a source that counts records or bytes reports as its offset.
pub(crate) fn position_of(offset: &SourceOffset, what: &str) -> Result<u64, EngineError> {
    offset
        .as_u64()
        .ok_or_else(|| EngineError::Invalid(format!("{what}'s offset is a position")))
}

/// The digits a generated word's number is zero-padded to.
const WORD_DIGITS: usize = 5;

/// A deterministic bounded source of words: record `i` of source `index` is a word
/// drawn from a vocabulary by a hash of `(seed, index, i)`. Offsets are positions.
#[derive(Clone, Debug)]
pub struct GeneratedWords {
    seed: u64,
    index: u32,
    total: u64,
    vocabulary: u32,
    position: u64,
    /// `(step, disorder)` in milliseconds: see [`GeneratedWords::with_event_times`].
    times: Option<(i64, i64)>,
}

impl GeneratedWords {
    /// `total` words over `vocabulary` distinct ones.
    #[must_use]
    pub fn new(seed: u64, index: u32, total: u64, vocabulary: u32) -> Self {
        Self {
            seed,
            index,
            total,
            vocabulary: vocabulary.max(1),
            position: 0,
            times: None,
        }
    }

    /// Gives record `i` the event time `i × step` minus up to `disorder` (drawn from
    /// the same hash), so times arrive out of order by at most `disorder`; the
    /// source's watermarks trail by `disorder`, so no record is ever late. It is
    /// never idle: a pause (waiting at a replay's bound) must not let other sources
    /// move event time past records it has yet to read.
    #[must_use]
    pub fn with_event_times(mut self, step: Duration, disorder: Duration) -> Self {
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        self.times = Some((ms(step), ms(disorder)));
        self
    }

    /// The event time of the record at `position`, if the source gives times.
    #[must_use]
    pub fn time(&self, position: u64) -> Option<i64> {
        let (step, disorder) = self.times?;
        let jitter =
            (self.mix(position) >> 32) % u64::try_from(disorder).unwrap_or(0).saturating_add(1);
        let position = i64::try_from(position).unwrap_or(i64::MAX);
        Some(
            position
                .saturating_mul(step)
                .saturating_sub(i64::try_from(jitter).unwrap_or(0)),
        )
    }

    /// The word at `position`: `w` and the word's number, zero-padded to 5 digits
    /// (`w00042`). Spelled into a string of exactly its length, without the
    /// formatting machinery: a source makes one per record, and a `Bytes` made from
    /// a full `String` takes its buffer without a second allocation.
    #[must_use]
    pub fn word(&self, position: u64) -> String {
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(self.mix(position) % u64::from(self.vocabulary));
        let zeros = WORD_DIGITS.saturating_sub(digits.len());
        let mut word = String::with_capacity(1 + zeros + digits.len());
        word.push('w');
        word.extend(std::iter::repeat_n('0', zeros));
        word.push_str(digits);
        word
    }

    /// SplitMix64 of `(seed, index, position)`: stable across platforms and releases.
    fn mix(&self, position: u64) -> u64 {
        let mut z = self
            .seed
            .wrapping_add(u64::from(self.index).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_add(position.wrapping_mul(0xBF58_476D_1CE4_E5B9));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl Source for GeneratedWords {
    fn seek(&mut self, offset: Option<&SourceOffset>) -> Result<(), EngineError> {
        self.position = match offset {
            None => 0,
            Some(offset) => position_of(offset, "a generated source")?,
        };
        if self.position > self.total {
            return Err(EngineError::Invalid(format!(
                "offset {} is past the end of a source of {} records",
                self.position, self.total
            )));
        }
        Ok(())
    }

    fn poll(&mut self, max: usize, out: &mut Vec<Record>) -> Result<SourcePoll, EngineError> {
        Ok(self.generate(self.total, max, out))
    }

    fn offset(&self) -> SourceOffset {
        SourceOffset::from_u64(self.position)
    }

    fn stops_at_offsets(&self) -> bool {
        true
    }

    fn watermarks(&self) -> Option<WatermarkStrategy> {
        let (_, disorder) = self.times?;
        let disorder = Duration::from_millis(u64::try_from(disorder).unwrap_or(0));
        Some(WatermarkStrategy::bounded(disorder))
    }

    fn poll_until(
        &mut self,
        max: usize,
        bound: &SourceOffset,
        out: &mut Vec<Record>,
    ) -> Result<SourcePoll, EngineError> {
        let bound = position_of(bound, "a generated source")?;
        if bound > self.total || bound < self.position {
            return Err(EngineError::Invalid(format!(
                "a generated source of {} records at {} cannot stop at {bound}",
                self.total, self.position
            )));
        }
        Ok(self.generate(bound, max, out))
    }
}

impl GeneratedWords {
    /// Appends the words from the position up to `end` (at most `max` of them).
    fn generate(&mut self, end: u64, max: usize, out: &mut Vec<Record>) -> SourcePoll {
        if self.position >= self.total {
            return SourcePoll::Finished;
        }
        let end = end.min(self.position.saturating_add(max as u64));
        if self.position >= end {
            return SourcePoll::Idle;
        }
        for position in self.position..end {
            let record = Record::new(self.word(position), bytes::Bytes::new());
            out.push(match self.time(position) {
                Some(time) => record.at(time),
                None => record,
            });
        }
        self.position = end;
        SourcePoll::Records
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn words_are_their_number_zero_padded_to_five_digits() {
        for vocabulary in [1, 7, 100_000, 1_000_000, u32::MAX] {
            let source = GeneratedWords::new(3, 1, 1_000, vocabulary);
            for position in 0..1_000 {
                let number = source.mix(position) % u64::from(vocabulary);
                let word = source.word(position);
                assert_eq!(word, format!("w{number:05}"));
                assert_eq!(word.capacity(), word.len(), "{word}");
            }
        }
    }

    #[test]
    fn a_generated_source_stops_exactly_at_a_recorded_offset() {
        let mut source = GeneratedWords::new(1, 0, 10, 5);
        assert!(source.stops_at_offsets());
        let bound = SourceOffset::from_u64(7);
        let mut out = Vec::new();
        while source.offset() != bound {
            assert_eq!(
                source.poll_until(3, &bound, &mut out).unwrap(),
                SourcePoll::Records
            );
        }
        assert_eq!(out.len(), 7);
        assert_eq!(
            source.poll_until(3, &bound, &mut out).unwrap(),
            SourcePoll::Idle
        );
        for past in [11, 6] {
            let error = source
                .poll_until(3, &SourceOffset::from_u64(past), &mut out)
                .unwrap_err();
            assert!(
                error
                    .to_string()
                    .contains(&format!("at 7 cannot stop at {past}")),
                "{error}"
            );
        }
    }
}
