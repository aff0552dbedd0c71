//! Changelog segments: one checkpoint's changes to a task's keyed state, as the
//! changelog state backend writes and uploads them (`docs/store-layout.md`,
//! "Changelog snapshots").
//!
//! Format (little-endian): the magic `SPCHLOG1`; per state (each state once, with at
//! least one entry), `0x01`, the state's name (u64 length, UTF-8), its entry count
//! (u64), then each entry in stored key order, each key once: the stored key (u64 length, bytes; it begins with its key group,
//! u16 big-endian), `0x01` and the value (u64 length, bytes) for a put or `0x00` for
//! a delete; then `0x00`; then the CRC32C of every byte before it (u32).
//!
//! Decoding checks the checksum first, then decodes the whole segment before it
//! returns anything: a damaged segment is a [`SegmentError`] naming what was wrong,
//! never a panic, a partial result or an allocation the bytes present do not bound.

use std::collections::BTreeSet;
use std::ops::Range;

use bytes::Bytes;

use crate::KeyGroupRange;

const MAGIC: &[u8; 8] = b"SPCHLOG1";
const STATE_BLOCK: u8 = 1;
const END: u8 = 0;
const PUT: u8 = 1;
const DELETE: u8 = 0;
/// The magic, the end marker and the checksum: the least a segment holds.
const MINIMUM: usize = MAGIC.len() + 1 + 4;

/// One change as a segment holds it: the state's name, the stored key and the new
/// value (`None`: deleted).
pub type SegmentWrite<'a> = (&'a str, &'a [u8], Option<&'a [u8]>);

/// A decoded change of one state: the stored key and its value (`None`: deleted),
/// both sharing the segment's buffer.
pub type SegmentEntry = (Bytes, Option<Bytes>);

/// Bytes that are not a valid changelog segment.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("corrupt changelog segment: {problem}")]
pub struct SegmentError {
    /// What was wrong.
    pub problem: String,
}

impl SegmentError {
    fn new(problem: impl Into<String>) -> Self {
        Self {
            problem: problem.into(),
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u64::try_from(bytes.len()).unwrap_or(u64::MAX).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Encodes `writes` — sorted by state, then stored key, each key once — as a segment.
#[must_use]
pub fn encode_segment(writes: &[SegmentWrite<'_>]) -> Vec<u8> {
    let payload: usize = writes
        .iter()
        .map(|(_, key, value)| 17 + key.len() + value.map_or(0, <[u8]>::len))
        .sum();
    let mut out = Vec::with_capacity(payload + 64);
    out.extend_from_slice(MAGIC);
    // The state being written, where its count goes, and the count so far.
    let mut current: Option<(&str, usize, u64)> = None;
    let patch = |out: &mut Vec<u8>, at: usize, count: u64| {
        if let Some(slot) = out.get_mut(at..at + 8) {
            slot.copy_from_slice(&count.to_le_bytes());
        }
    };
    for &(state, key, value) in writes {
        match &mut current {
            Some((name, _, count)) if *name == state => *count += 1,
            _ => {
                if let Some((_, at, count)) = current {
                    patch(&mut out, at, count);
                }
                out.push(STATE_BLOCK);
                put_bytes(&mut out, state.as_bytes());
                current = Some((state, out.len(), 1));
                out.extend_from_slice(&0_u64.to_le_bytes());
            }
        }
        put_bytes(&mut out, key);
        match value {
            Some(value) => {
                out.push(PUT);
                put_bytes(&mut out, value);
            }
            None => out.push(DELETE),
        }
    }
    if let Some((_, at, count)) = current {
        patch(&mut out, at, count);
    }
    out.push(END);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Reads a segment's body, never past its end. Lengths and tags are read from the
/// bytes in place; keys and values are ranges of the body, cut into `Bytes` only
/// when kept (a reference count each, no copy).
struct Reader {
    body: Bytes,
    at: usize,
}

impl Reader {
    fn remaining(&self) -> usize {
        self.body.len().saturating_sub(self.at)
    }

    /// The range of the next `n` bytes, which are consumed.
    fn take(&mut self, n: u64, what: &str) -> Result<Range<usize>, SegmentError> {
        let left = self.remaining();
        let end = usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .map(|n| self.at + n)
            .ok_or_else(|| {
                SegmentError::new(format!(
                    "{what} of {n} bytes runs past the end ({left} bytes left)"
                ))
            })?;
        let range = self.at..end;
        self.at = end;
        Ok(range)
    }

    fn slice(&self, range: Range<usize>) -> &[u8] {
        self.body.get(range).unwrap_or_default()
    }

    fn byte(&mut self, what: &str) -> Result<u8, SegmentError> {
        let range = self.take(1, what)?;
        Ok(self.slice(range).first().copied().unwrap_or_default())
    }

    fn u64(&mut self, what: &str) -> Result<u64, SegmentError> {
        let range = self.take(8, what)?;
        let bytes = self.slice(range).first_chunk::<8>().copied();
        Ok(u64::from_le_bytes(bytes.unwrap_or_default()))
    }

    /// A length-prefixed field: its range.
    fn field(&mut self, what: &str) -> Result<Range<usize>, SegmentError> {
        let len = self.u64(what)?;
        self.take(len, what)
    }
}

/// Checks a whole segment's CRC32C; returns the body, the checksum cut off.
fn checked_body(mut file: Bytes) -> Result<Bytes, SegmentError> {
    if file.len() < MINIMUM {
        return Err(SegmentError::new(format!(
            "{} bytes, shorter than an empty segment",
            file.len()
        )));
    }
    let stored = file.split_off(file.len() - 4);
    let stored = u32::from_le_bytes(stored.first_chunk::<4>().copied().unwrap_or_default());
    let crc = crc32c::crc32c(&file);
    if stored != crc {
        return Err(SegmentError::new(format!(
            "CRC32C {crc:08x}, the segment says {stored:08x}"
        )));
    }
    Ok(file)
}

/// Decodes the segment `file` (checksum first, then the whole segment) into each
/// state's entries, in the segment's order, keeping only the keys whose group is in
/// `keep` (a state whose keys are all elsewhere comes back empty). Entries share
/// `file`'s buffer.
///
/// # Errors
///
/// A [`SegmentError`] when the checksum does not match, the magic is wrong, a length
/// runs past the end, a tag is unknown, a state's name is not UTF-8, a state appears
/// twice or with no entries, a key is shorter than its key group or keys are not
/// strictly increasing within a state, or bytes follow the end marker. So a segment
/// that decodes is in the encoder's one form: it re-encodes to the same bytes.
pub fn decode_segment(
    file: Bytes,
    keep: KeyGroupRange,
) -> Result<Vec<(String, Vec<SegmentEntry>)>, SegmentError> {
    let mut reader = Reader {
        body: checked_body(file)?,
        at: 0,
    };
    let magic = reader.take(8, "magic")?;
    if reader.slice(magic) != MAGIC.as_slice() {
        return Err(SegmentError::new("not a changelog segment (wrong magic)"));
    }
    let mut blocks: Vec<(String, Vec<SegmentEntry>)> = Vec::new();
    let mut names = BTreeSet::new();
    loop {
        match reader.byte("block tag")? {
            END => break,
            STATE_BLOCK => {}
            other => return Err(SegmentError::new(format!("unknown block tag {other}"))),
        }
        let name = reader.field("state name")?;
        let name = String::from_utf8(reader.slice(name).to_vec())
            .map_err(|_| SegmentError::new("a state name is not UTF-8"))?;
        if !names.insert(name.clone()) {
            return Err(SegmentError::new(format!(
                "state `{name}` appears twice (a segment holds each state once)"
            )));
        }
        let count = reader.u64("entry count")?;
        if count == 0 {
            return Err(SegmentError::new(format!("state `{name}` has no entries")));
        }
        // The count is the file's word: capacity for at most 64 Ki entries up front.
        let mut batch = Vec::with_capacity(usize::try_from(count.min(1 << 16)).unwrap_or(0));
        let mut previous: Option<Range<usize>> = None;
        for _ in 0..count {
            let key = reader.field("key")?;
            let value = match reader.byte("entry kind")? {
                PUT => Some(reader.field("value")?),
                DELETE => None,
                other => {
                    return Err(SegmentError::new(format!("unknown entry kind {other}")));
                }
            };
            let bytes = reader.slice(key.clone());
            // Sorted, each key once: a replay in any other order could be wrong.
            if previous
                .as_ref()
                .is_some_and(|last| reader.slice(last.clone()) >= bytes)
            {
                return Err(SegmentError::new(format!(
                    "state `{name}`: keys out of order"
                )));
            }
            let Some(group) = bytes
                .first_chunk::<2>()
                .map(|g| u32::from(u16::from_be_bytes(*g)))
            else {
                return Err(SegmentError::new(format!(
                    "state `{name}`: a key shorter than its group"
                )));
            };
            previous = Some(key.clone());
            if keep.contains(group) {
                batch.push((
                    reader.body.slice(key),
                    value.map(|value| reader.body.slice(value)),
                ));
            }
        }
        blocks.push((name, batch));
    }
    if reader.remaining() != 0 {
        return Err(SegmentError::new(format!(
            "{} bytes after the end marker",
            reader.remaining()
        )));
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use proptest::prelude::*;

    const ALL: KeyGroupRange = KeyGroupRange {
        start: 0,
        end: 65_536,
    };

    fn sample() -> Vec<u8> {
        encode_segment(&[
            ("a", b"\x00\x01k1", Some(b"v1")),
            ("a", b"\x00\x02k2", None),
            ("b", b"\x00\x05k", Some(b"")),
        ])
    }

    #[test]
    fn a_segment_decodes_to_what_was_encoded() {
        let blocks = decode_segment(Bytes::from(sample()), ALL).unwrap();
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0].0, "a");
        assert_eq!(
            blocks[0].1,
            vec![
                (
                    Bytes::from_static(b"\x00\x01k1"),
                    Some(Bytes::from_static(b"v1"))
                ),
                (Bytes::from_static(b"\x00\x02k2"), None),
            ]
        );
        assert_eq!(blocks[1].0, "b");
        assert_eq!(
            blocks[1].1,
            vec![(Bytes::from_static(b"\x00\x05k"), Some(Bytes::new()))]
        );
        let empty = decode_segment(Bytes::from(encode_segment(&[])), ALL).unwrap();
        assert!(empty.is_empty());
    }

    #[test]
    fn only_the_kept_key_groups_come_back() {
        let keep = KeyGroupRange { start: 2, end: 4 };
        let blocks = decode_segment(Bytes::from(sample()), keep).unwrap();
        assert_eq!(blocks[0].1, vec![(Bytes::from_static(b"\x00\x02k2"), None)]);
        assert!(blocks[1].1.is_empty());
    }

    /// Replaces the body's checksum so the decoder looks past it.
    fn resealed(mut body: Vec<u8>) -> Bytes {
        let crc = crc32c::crc32c(&body);
        body.extend_from_slice(&crc.to_le_bytes());
        Bytes::from(body)
    }

    fn problem(file: Bytes) -> String {
        decode_segment(file, ALL).unwrap_err().problem
    }

    #[test]
    fn every_kind_of_damage_is_named() {
        let good = sample();
        let body = good[..good.len() - 4].to_vec();
        assert!(problem(Bytes::from_static(b"short")).contains("shorter than an empty"));
        let mut flipped = good.clone();
        flipped[12] ^= 1;
        assert!(problem(Bytes::from(flipped)).contains("CRC32C"));
        let mut magic = body.clone();
        magic[0] = b'X';
        assert!(problem(resealed(magic)).contains("wrong magic"));
        let mut tag = body.clone();
        tag[8] = 7;
        assert!(problem(resealed(tag)).contains("unknown block tag 7"));
        let mut long = body.clone();
        long[9] = 0xff;
        assert!(problem(resealed(long)).contains("runs past the end"));
        let mut trailing = body.clone();
        trailing.push(0);
        assert!(problem(resealed(trailing)).contains("after the end marker"));
        let unsorted = encode_segment(&[("a", b"\x00\x02", None), ("a", b"\x00\x01", None)]);
        assert!(problem(Bytes::from(unsorted)).contains("out of order"));
        let twice = encode_segment(&[("a", b"\x00\x02", None), ("a", b"\x00\x02", None)]);
        assert!(problem(Bytes::from(twice)).contains("out of order"));
        let short_key = encode_segment(&[("a", b"\x00", None)]);
        assert!(problem(Bytes::from(short_key)).contains("shorter than its group"));
        let kind = encode_segment(&[("a", b"\x00\x01", None)]);
        let mut kind = kind[..kind.len() - 4].to_vec();
        let at = kind.len() - 2;
        kind[at] = 9;
        assert!(problem(resealed(kind)).contains("unknown entry kind 9"));
        // A state twice: two one-entry segments of `a`, the second's block appended.
        let one = encode_segment(&[("a", b"\x00\x01", None)]);
        let block = &one[8..one.len() - 5];
        let mut twice = one[..one.len() - 5].to_vec();
        twice.extend_from_slice(block);
        twice.push(0);
        assert!(problem(resealed(twice)).contains("appears twice"));
        let mut empty = one[..one.len() - 5].to_vec();
        // The count after the magic, the tag and the 1-byte name with its length.
        empty[18..26].copy_from_slice(&0_u64.to_le_bytes());
        empty.truncate(26);
        empty.push(0);
        assert!(problem(resealed(empty)).contains("no entries"));
        let not_utf8 = encode_segment(&[("\u{e9}", b"\x00\x01", None)]);
        let mut not_utf8 = not_utf8[..not_utf8.len() - 4].to_vec();
        not_utf8[17] = 0xff;
        assert!(problem(resealed(not_utf8)).contains("not UTF-8"));
    }

    #[test]
    fn a_huge_entry_count_allocates_only_what_the_bytes_bound() {
        let good = encode_segment(&[("a", b"\x00\x01", None)]);
        let mut body = good[..good.len() - 4].to_vec();
        // The count sits after the magic, the tag and the 1-byte name with its length.
        let at = 8 + 1 + 8 + 1;
        body[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(problem(resealed(body)).contains("runs past the end"));
    }

    type Decoded = (String, Vec<u8>, Option<Vec<u8>>);

    fn flat(blocks: Vec<(String, Vec<SegmentEntry>)>) -> Vec<Decoded> {
        blocks
            .into_iter()
            .flat_map(|(state, batch)| {
                batch
                    .into_iter()
                    .map(move |(k, v)| (state.clone(), k.to_vec(), v.map(|v| v.to_vec())))
            })
            .collect()
    }

    proptest! {
        /// What is encoded decodes to exactly the same writes, in order; a key-group
        /// filter keeps exactly the keys of its groups.
        #[test]
        fn any_segment_decodes_to_what_was_encoded(
            entries in proptest::collection::btree_map(
                (0_u8..3, 0_u16..128, proptest::collection::vec(any::<u8>(), 0..12)),
                proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
                0..100,
            )
        ) {
            let names = ["a", "b", "c"];
            let owned: Vec<Decoded> = entries
                .iter()
                .map(|((state, group, key), value)| {
                    let mut stored = group.to_be_bytes().to_vec();
                    stored.extend_from_slice(key);
                    (names[usize::from(*state)].to_owned(), stored, value.clone())
                })
                .collect();
            let writes: Vec<SegmentWrite<'_>> = owned
                .iter()
                .map(|(s, k, v)| (s.as_str(), k.as_slice(), v.as_deref()))
                .collect();
            let file = Bytes::from(encode_segment(&writes));
            prop_assert_eq!(flat(decode_segment(file.clone(), ALL).unwrap()), owned.clone());
            let half = KeyGroupRange { start: 0, end: 64 };
            let kept: Vec<_> = owned
                .into_iter()
                .filter(|(_, k, _)| u16::from_be_bytes([k[0], k[1]]) < 64)
                .collect();
            prop_assert_eq!(flat(decode_segment(file, half).unwrap()), kept);
        }

        /// A segment damaged anywhere — bytes changed, cut or inserted, then resealed
        /// with a matching CRC so the decoder reads past the checksum — decodes to a
        /// typed error, or (when the damage happens to be a well-formed segment) to
        /// entries still in strictly increasing key order; never a panic, never an
        /// allocation sized by a damaged count or length.
        #[test]
        fn a_damaged_but_resealed_segment_never_panics_or_decodes_disorder(
            edits in proptest::collection::vec(
                (0_u8..3, any::<prop::sample::Index>(), any::<u8>()),
                1..6,
            )
        ) {
            let writes: Vec<SegmentWrite<'_>> = vec![
                ("counts", b"\x00\x01key-a", Some(b"1")),
                ("counts", b"\x00\x02key-b", None),
                ("counts", b"\x00\x02key-c", Some(b"333")),
                ("sums", b"\x00\x03key-c", Some(b"22")),
            ];
            let mut body = encode_segment(&writes);
            body.truncate(body.len() - 4);
            for (kind, at, byte) in edits {
                let at = at.index(body.len() + 1);
                match kind {
                    0 if at < body.len() => body[at] = byte,
                    1 => body.truncate(at),
                    _ => body.insert(at, byte),
                }
            }
            if let Ok(blocks) = decode_segment(resealed(body), ALL) {
                for (_, batch) in &blocks {
                    prop_assert!(batch.windows(2).all(|w| w[0].0 < w[1].0), "keys out of order");
                }
            }
        }
    }
}
