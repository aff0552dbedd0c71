//! Lower-case hexadecimal, the text form of digests and source offsets in manifests.

use std::fmt::Write as _;

/// Why a hex string did not decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HexError {
    /// The string has an odd number of characters.
    #[error("hex string has odd length {0}")]
    OddLength(usize),
    /// A character other than `0-9`, `a-f` (upper case is refused so text forms stay canonical).
    #[error("invalid hex character {found:?} at index {index}")]
    InvalidChar {
        /// The offending character.
        found: char,
        /// Its byte index in the string.
        index: usize,
    },
}

/// `bytes` as lower-case hexadecimal.
#[must_use]
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        // Writing into a String cannot fail.
        let _ = write!(out, "{byte:02x}");
    }
    out
}

fn nibble(text: &str, index: usize) -> Result<u8, HexError> {
    let byte = text.as_bytes().get(index).copied().unwrap_or(0);
    match byte {
        b'0'..=b'9' => Ok(byte - b'0'),
        b'a'..=b'f' => Ok(byte - b'a' + 10),
        _ => Err(HexError::InvalidChar {
            // Every earlier character was ASCII, so `index` is a character boundary.
            found: text
                .get(index..)
                .and_then(|rest| rest.chars().next())
                .unwrap_or('\0'),
            index,
        }),
    }
}

/// The bytes of lower-case hexadecimal `text`.
pub fn decode(text: &str) -> Result<Vec<u8>, HexError> {
    if !text.len().is_multiple_of(2) {
        return Err(HexError::OddLength(text.len()));
    }
    (0..text.len())
        .step_by(2)
        .map(|i| Ok(nibble(text, i)? << 4 | nibble(text, i + 1)?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_bad_text() {
        assert_eq!(encode(&[0x00, 0xab, 0xff]), "00abff");
        assert_eq!(decode("00abff"), Ok(vec![0x00, 0xab, 0xff]));
        assert_eq!(decode("abc"), Err(HexError::OddLength(3)));
        assert_eq!(
            decode("0g"),
            Err(HexError::InvalidChar {
                found: 'g',
                index: 1
            })
        );
        assert_eq!(
            decode("AB"),
            Err(HexError::InvalidChar {
                found: 'A',
                index: 0
            })
        );
        assert_eq!(
            decode("aéb"),
            Err(HexError::InvalidChar {
                found: 'é',
                index: 1
            })
        );
    }
}
