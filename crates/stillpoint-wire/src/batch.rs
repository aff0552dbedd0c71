//! Records and the payload of a `Data` message: a batch of key/value records
//! (`docs/wire-format.md`, "Record batch").
//!
//! Payload: per record, key length (u32 LE) · key · value length (u32 LE) · value.
//! Decoding never trusts a length past the bytes present, and shares the payload's
//! buffer (no copy).

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// One record: a key (what partitioning and keyed state use) and a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Record {
    /// The key.
    pub key: Bytes,
    /// The value.
    pub value: Bytes,
}

impl Record {
    /// A record from anything that becomes bytes.
    pub fn new(key: impl Into<Bytes>, value: impl Into<Bytes>) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
        }
    }
}

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
        .map(|r| 8 + r.key.len() + r.value.len())
        .sum();
    let mut out = BytesMut::with_capacity(size);
    for record in records {
        for part in [&record.key, &record.value] {
            // Record parts are far below 4 GiB: keys and values come from batches that
            // themselves fit a frame.
            out.put_u32_le(u32::try_from(part.len()).unwrap_or(u32::MAX));
            out.put_slice(part);
        }
    }
    out.freeze()
}

/// Decodes a payload, zero-copy (the records share the payload's buffer).
pub fn decode_batch(payload: &Bytes) -> Result<Vec<Record>, BatchError> {
    let mut rest = payload.clone();
    let mut records = Vec::new();
    let total = payload.len();
    let part = |rest: &mut Bytes| -> Result<Bytes, BatchError> {
        let offset = total - rest.len();
        if rest.remaining() < 4 {
            return Err(BatchError {
                offset,
                problem: "truncated length",
            });
        }
        let len = usize::try_from(rest.get_u32_le()).unwrap_or(usize::MAX);
        if rest.remaining() < len {
            return Err(BatchError {
                offset,
                problem: "length past the end of the payload",
            });
        }
        Ok(rest.split_to(len))
    };
    while rest.has_remaining() {
        let key = part(&mut rest)?;
        let value = part(&mut rest)?;
        records.push(Record { key, value });
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
        // A length claiming 4 GiB allocates nothing.
        let huge = Bytes::from_static(&[0xff, 0xff, 0xff, 0xff, 1]);
        assert!(decode_batch(&huge).is_err());
    }
}
