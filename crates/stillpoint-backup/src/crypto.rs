//! Encryption at rest: AES-256-GCM per object, a fresh nonce per write, the object's
//! path as associated data.
//!
//! Sealed object: `SPX1` · nonce (12 bytes) · ciphertext · tag (16 bytes). Binding the
//! path means an object copied or renamed inside the store no longer opens.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::StoreError;

const MAGIC: &[u8; 4] = b"SPX1";
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;

/// The environment variable [`EncryptionKey::from_env`] reads.
pub const KEY_ENV: &str = "STILLPOINT_ENCRYPTION_KEY";

/// A 256-bit key. Its `Debug` shows only a fingerprint; the key is never logged,
/// and its bytes are wiped from memory when it is dropped.
#[derive(Clone)]
pub struct EncryptionKey([u8; 32]);

impl Drop for EncryptionKey {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

impl EncryptionKey {
    /// A key from its 64 hexadecimal digits.
    pub fn from_hex(text: &str) -> Result<Self, StoreError> {
        Self::parse(text, "configuration")
    }

    /// A key from [`KEY_ENV`]; `Ok(None)` when the variable is unset.
    pub fn from_env() -> Result<Option<Self>, StoreError> {
        match std::env::var(KEY_ENV) {
            Ok(text) => Self::parse(&text, KEY_ENV).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(StoreError::InvalidKey {
                origin: KEY_ENV.to_owned(),
                reason: "not valid UTF-8",
            }),
        }
    }

    /// A key from raw bytes.
    #[must_use]
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// A fresh random key (from the operating system's generator).
    #[must_use]
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        Self(bytes)
    }

    /// The key as 64 hexadecimal digits (to hand to a user once, at creation).
    #[must_use]
    pub fn to_hex(&self) -> String {
        stillpoint_wire::encode_hex(&self.0)
    }

    /// The first 8 bytes of SHA-256 of the key, in hex: safe to log and compare.
    #[must_use]
    pub fn fingerprint(&self) -> String {
        let digest = Sha256::digest(self.0);
        stillpoint_wire::encode_hex(digest.get(..8).unwrap_or_default())
    }

    fn parse(text: &str, origin: &str) -> Result<Self, StoreError> {
        let invalid = |reason| StoreError::InvalidKey {
            origin: origin.to_owned(),
            reason,
        };
        let text = text.trim();
        if text.len() != 64 {
            return Err(invalid("expected 64 hexadecimal digits (32 bytes)"));
        }
        // Upper-case digits are accepted (keys are typed and pasted by people).
        let lower = zeroize::Zeroizing::new(text.to_ascii_lowercase());
        let decoded = zeroize::Zeroizing::new(
            stillpoint_wire::decode_hex(&lower).map_err(|_| invalid("not hexadecimal"))?,
        );
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(
            decoded
                .get(..32)
                .ok_or_else(|| invalid("not hexadecimal"))?,
        );
        Ok(Self(bytes))
    }
}

impl std::fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EncryptionKey(fingerprint {})", self.fingerprint())
    }
}

/// Seals and opens objects with one key.
#[derive(Clone)]
pub(crate) struct Cipher {
    aead: Aes256Gcm,
}

impl std::fmt::Debug for Cipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cipher(AES-256-GCM)")
    }
}

impl Cipher {
    pub(crate) fn new(key: &EncryptionKey) -> Self {
        Self {
            aead: Aes256Gcm::new(&key.0.into()),
        }
    }

    /// The sealed form of `plain`, bound to `path`.
    pub(crate) fn seal(&self, path: &str, plain: &[u8]) -> Result<Vec<u8>, StoreError> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let sealed = self
            .aead
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: plain,
                    aad: path.as_bytes(),
                },
            )
            .map_err(|_| StoreError::Corrupt {
                path: path.to_owned(),
                problem: "object too large to encrypt".to_owned(),
            })?;
        let mut out = Vec::with_capacity(MAGIC.len() + NONCE_LEN + sealed.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// The plaintext of a sealed object stored at `path`.
    pub(crate) fn open(&self, path: &str, sealed: &[u8]) -> Result<Vec<u8>, StoreError> {
        let Some(rest) = sealed.strip_prefix(MAGIC.as_slice()) else {
            return Err(StoreError::NotEncrypted {
                path: path.to_owned(),
            });
        };
        if rest.len() < NONCE_LEN + TAG_LEN {
            return Err(StoreError::Corrupt {
                path: path.to_owned(),
                problem: format!(
                    "encrypted object is {} bytes, shorter than its header",
                    sealed.len()
                ),
            });
        }
        let (nonce, body) = rest.split_at(NONCE_LEN);
        self.aead
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: body,
                    aad: path.as_bytes(),
                },
            )
            .map_err(|_| StoreError::Decrypt {
                path: path.to_owned(),
            })
    }
}

/// Whether stored bytes carry the sealed-object header.
pub(crate) fn looks_sealed(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

/// How many bytes a sealed object of `plain_len` plaintext bytes takes.
pub(crate) const fn sealed_len(plain_len: u64) -> u64 {
    plain_len + (MAGIC.len() + NONCE_LEN + TAG_LEN) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_objects_open_only_with_the_same_key_and_path() {
        let key = EncryptionKey::generate();
        let cipher = Cipher::new(&key);
        let sealed = cipher.seal("shared/ab/abcd", b"hello state").unwrap();
        assert_eq!(sealed.len() as u64, sealed_len(11));
        assert!(looks_sealed(&sealed));
        assert_eq!(
            cipher.open("shared/ab/abcd", &sealed).unwrap(),
            b"hello state"
        );
        assert!(matches!(
            cipher.open("shared/ab/other", &sealed),
            Err(StoreError::Decrypt { .. })
        ));
        let other = Cipher::new(&EncryptionKey::generate());
        assert!(matches!(
            other.open("shared/ab/abcd", &sealed),
            Err(StoreError::Decrypt { .. })
        ));
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(
            cipher.open("shared/ab/abcd", &flipped),
            Err(StoreError::Decrypt { .. })
        ));
        assert!(matches!(
            cipher.open("p", b"plain bytes"),
            Err(StoreError::NotEncrypted { .. })
        ));
        assert!(matches!(
            cipher.open("p", b"SPX1short"),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn keys_parse_from_hex_and_never_print() {
        let key = EncryptionKey::generate();
        let parsed = EncryptionKey::from_hex(&key.to_hex()).unwrap();
        assert_eq!(parsed.0, key.0);
        let shown = format!("{parsed:?}");
        assert!(!shown.contains(&key.to_hex()));
        assert!(shown.contains(&key.fingerprint()));
        for bad in ["", "00", &"g".repeat(64), &"0".repeat(63)] {
            assert!(matches!(
                EncryptionKey::from_hex(bad),
                Err(StoreError::InvalidKey { .. })
            ));
        }
    }
}
