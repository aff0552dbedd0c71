//! `Sha256Digest`: the checksum of every stored file and manifest.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

use crate::hex;

/// A SHA-256 digest. Printed and serialized as 64 lower-case hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256Digest(pub [u8; 32]);

/// Why a string is not a SHA-256 digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DigestParseError {
    /// Not 64 characters long.
    #[error("a SHA-256 digest is 64 hex characters, found {0}")]
    WrongLength(usize),
    /// Not lower-case hex.
    #[error(transparent)]
    Hex(#[from] hex::HexError),
}

impl Sha256Digest {
    /// The digest of `data`.
    #[must_use]
    pub fn of(data: &[u8]) -> Self {
        Self(Sha256::digest(data).into())
    }

    /// Parses 64 lower-case hex characters.
    /// The SHA-256 of everything `reader` yields, read in 1 MiB blocks (the one
    /// file-hash helper of the workspace: state snapshots and the store use it).
    pub fn of_reader(mut reader: impl std::io::Read) -> std::io::Result<Self> {
        let mut hasher = Sha256::new();
        let mut buf = vec![0_u8; 1 << 20];
        loop {
            let n = reader.read(&mut buf)?;
            if n == 0 {
                return Ok(Self(hasher.finalize().into()));
            }
            hasher.update(buf.get(..n).unwrap_or_default());
        }
    }

    /// A digest from its 64 lower-case hexadecimal digits.
    pub fn from_hex(text: &str) -> Result<Self, DigestParseError> {
        if text.len() != 64 {
            return Err(DigestParseError::WrongLength(text.len()));
        }
        let bytes = hex::decode(text)?;
        let mut raw = [0; 32];
        raw.copy_from_slice(&bytes);
        Ok(Self(raw))
    }

    /// 64 lower-case hex characters.
    #[must_use]
    pub fn to_hex(&self) -> String {
        hex::encode(&self.0)
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256Digest({})", self.to_hex())
    }
}

impl std::str::FromStr for Sha256Digest {
    type Err = DigestParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::from_hex(text)
    }
}

impl Serialize for Sha256Digest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Sha256Digest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Self::from_hex(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_of_known_input() {
        assert_eq!(
            Sha256Digest::of(b"abc").to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn parse_rejects_wrong_length_and_case() {
        assert_eq!(
            Sha256Digest::from_hex("abc"),
            Err(DigestParseError::WrongLength(3))
        );
        let upper = "BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD";
        assert!(matches!(
            Sha256Digest::from_hex(upper),
            Err(DigestParseError::Hex(_))
        ));
    }
}
