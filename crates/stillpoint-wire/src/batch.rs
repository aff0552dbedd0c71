//! Records and the payload of a `Data` message: a batch of key/value records
//! (`docs/wire-format.md`, "Record batch").
//!
//! Payload: per record, key length (u32 LE; bit 31 set: an event time follows) ·
//! [event time (i64 LE)] · key · value length (u32 LE) · value. Decoding never trusts
//! a length past the bytes present, and shares the payload's buffer (no copy).

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// One record: a key (what partitioning and keyed state use), a value, and the
/// event time it carries, if any (milliseconds; what event-time operators and
/// watermarks measure).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Record {
    /// The key.
    pub key: Bytes,
    /// The value.
    pub value: Bytes,
    /// The event time, in milliseconds (by convention since the Unix epoch).
    pub time: Option<i64>,
}

impl Record {
    /// A record without an event time, from anything that becomes bytes.
    pub fn new(key: impl Into<Bytes>, value: impl Into<Bytes>) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
            time: None,
        }
    }

    /// This record with event time `time` (milliseconds).
    #[must_use]
    pub const fn at(mut self, time: i64) -> Self {
        self.time = Some(time);
        self
    }
}

/// Bit 31 of a record's key length: an event time follows the length.
const TIMED: u32 = 1 << 31;

/// A `Data` payload that is not a batch of records.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed record batch at byte {offset}: {problem}")]
pub struct BatchError {
    /// Where decoding stopped.
    pub offset: usize,
    /// What was wrong.
    pub problem: &'static str,
}

/// Encodes records into one payload.
#[must_use]
pub fn encode_batch(records: &[Record]) -> Bytes {
    let size: usize = records
        .iter()
        .map(|r| 16 + r.key.len() + r.value.len())
        .sum();
    let mut out = BytesMut::with_capacity(size);
    // Record parts are far below 2 GiB: keys and values come from batches that
    // themselves fit a frame.
    let len = |part: &Bytes| u32::try_from(part.len()).unwrap_or(u32::MAX) & !TIMED;
    for record in records {
        match record.time {
            Some(time) => {
                out.put_u32_le(len(&record.key) | TIMED);
                out.put_i64_le(time);
            }
            None => out.put_u32_le(len(&record.key)),
        }
        out.put_slice(&record.key);
        out.put_u32_le(len(&record.value));
        out.put_slice(&record.value);
    }
    out.freeze()
}

/// Decodes a payload, zero-copy (the records share the payload's buffer).
pub fn decode_batch(payload: &Bytes) -> Result<Vec<Record>, BatchError> {
    let mut rest = payload.clone();
    let mut records = Vec::new();
    let total = payload.len();
    // A length field: where it starts and what it says.
    let length = |rest: &mut Bytes| -> Result<(usize, u32), BatchError> {
        let offset = total - rest.len();
        if rest.remaining() < 4 {
            return Err(BatchError {
                offset,
                problem: "truncated length",
            });
        }
        Ok((offset, rest.get_u32_le()))
    };
    let part = |rest: &mut Bytes, (offset, len): (usize, u32)| -> Result<Bytes, BatchError> {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if rest.remaining() < len {
            return Err(BatchError {
                offset,
                problem: "length past the end of the payload",
            });
        }
        Ok(rest.split_to(len))
    };
    while rest.has_remaining() {
        let (at, key_length) = length(&mut rest)?;
        let time = if key_length & TIMED == 0 {
            None
        } else if rest.remaining() < 8 {
            return Err(BatchError {
                offset: total - rest.len(),
                problem: "truncated event time",
            });
        } else {
            Some(rest.get_i64_le())
        };
        let key = part(&mut rest, (at, key_length & !TIMED))?;
        let value_length = length(&mut rest)?;
        let value = part(&mut rest, value_length)?;
        records.push(Record { key, value, time });
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_round_trip_and_reject_bad_lengths() {
        let records = vec![
            Record::new("a", "1"),
            Record::new("", ""),
            Record::new("late", "x").at(-5),
            Record::new("", "").at(i64::MAX),
            Record::new("key", vec![0u8; 300]),
        ];
        let payload = encode_batch(&records);
        assert_eq!(decode_batch(&payload).unwrap(), records);
        assert_eq!(decode_batch(&Bytes::new()).unwrap(), vec![]);
        let cut = payload.slice(..payload.len() - 1);
        assert_eq!(
            decode_batch(&cut).unwrap_err().problem,
            "length past the end of the payload"
        );
        assert_eq!(
            decode_batch(&Bytes::from_static(&[0, 0])).unwrap_err(),
            BatchError {
                offset: 0,
                problem: "truncated length"
            }
        );
        // A length claiming 2 GiB (and a time) allocates nothing.
        let huge = Bytes::from_static(&[0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(
            decode_batch(&huge).unwrap_err().problem,
            "length past the end of the payload"
        );
        // The time flag with fewer than 8 bytes after it.
        let cut_time = Bytes::from_static(&[0, 0, 0, 0x80, 1, 2]);
        assert_eq!(
            decode_batch(&cut_time).unwrap_err(),
            BatchError {
                offset: 4,
                problem: "truncated event time"
            }
        );
    }
}
