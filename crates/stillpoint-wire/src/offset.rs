//! `SourceOffset`: the replay position a source records in a checkpoint.

use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::hex;

/// The position from which a replayable source resumes after a restore.
///
/// Opaque bytes to everything but the source that wrote them (a byte offset into a
/// file, a log segment and position, one offset per partition, ...). Bounded by
/// [`SourceOffset::MAX_LEN`] so a manifest or message can never claim an unbounded one.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct SourceOffset(Bytes);

/// A source offset longer than [`SourceOffset::MAX_LEN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("source offset is {len} bytes, more than the maximum of {max}")]
pub struct OffsetTooLong {
    /// Length of the rejected offset.
    pub len: usize,
    /// [`SourceOffset::MAX_LEN`].
    pub max: usize,
}

impl SourceOffset {
    /// The longest offset a message or manifest may carry, in bytes.
    pub const MAX_LEN: usize = 4096;

    /// An offset made of `bytes`, if it is at most [`Self::MAX_LEN`] long.
    pub fn new(bytes: impl Into<Bytes>) -> Result<Self, OffsetTooLong> {
        let bytes = bytes.into();
        if bytes.len() > Self::MAX_LEN {
            return Err(OffsetTooLong {
                len: bytes.len(),
                max: Self::MAX_LEN,
            });
        }
        Ok(Self(bytes))
    }

    /// The common case of a single position: eight little-endian bytes.
    #[must_use]
    pub fn from_u64(position: u64) -> Self {
        Self(Bytes::copy_from_slice(&position.to_le_bytes()))
    }

    /// The position stored by [`Self::from_u64`], or `None` if this offset is not eight bytes.
    #[must_use]
    pub fn as_u64(&self) -> Option<u64> {
        let raw: [u8; 8] = self.0.as_ref().try_into().ok()?;
        Some(u64::from_le_bytes(raw))
    }

    /// The raw bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }
}

impl fmt::Display for SourceOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_u64() {
            Some(position) => write!(f, "{position}"),
            None => f.write_str(&hex::encode(&self.0)),
        }
    }
}

impl Serialize for SourceOffset {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&hex::encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for SourceOffset {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        if text.len() > 2 * Self::MAX_LEN {
            return Err(serde::de::Error::custom(OffsetTooLong {
                len: text.len() / 2,
                max: Self::MAX_LEN,
            }));
        }
        let bytes = hex::decode(&text).map_err(serde::de::Error::custom)?;
        Self::new(bytes).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u64_offsets_round_trip_and_print_as_numbers() {
        let offset = SourceOffset::from_u64(1234);
        assert_eq!(offset.as_u64(), Some(1234));
        assert_eq!(offset.to_string(), "1234");
        assert_eq!(
            SourceOffset::new(vec![1, 2, 3]).map(|o| o.to_string()),
            Ok("010203".into())
        );
    }

    #[test]
    fn oversized_offsets_are_refused() {
        let err = SourceOffset::new(vec![0; SourceOffset::MAX_LEN + 1]);
        assert_eq!(
            err,
            Err(OffsetTooLong {
                len: SourceOffset::MAX_LEN + 1,
                max: SourceOffset::MAX_LEN
            })
        );
    }
}
