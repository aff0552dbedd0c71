//! Who may talk to a cluster: every connection — a node to the coordinator, one node
//! to another for an edge — proves both ways that it knows the cluster secret, by
//! HMAC-SHA256 over a challenge–response bound to what the connection claims to be.
//!
//! 1. The accepting side sends a `Challenge` (32 random bytes).
//! 2. The connecting side answers with its hello — `Hello` (a node) or `EdgeHello`
//!    (an edge of one generation, carrying that generation's token in its proof) —
//!    with a nonce of its own and `HMAC(secret, "hello" · claim · challenge · nonce ·
//!    token)`.
//! 3. The accepting side checks it (in constant time) and answers `Welcome` with
//!    `HMAC(secret, "welcome" · claim · nonce · challenge · token)`, which the
//!    connecting side checks before it trusts anything it reads.
//!
//! A replayed hello fails (the challenge is fresh), a hello for one edge cannot be
//! used for another (the claim is in the proof), and an edge of an old generation
//! fails (the token is the generation's). Secrets and proofs are never logged.

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use stillpoint_wire::FrameDecoder;
use zeroize::Zeroizing;

use stillpoint::EngineError;
use stillpoint_wire::{EngineMessage, Envelope, read_envelope, write_envelope};

/// Shortest cluster secret accepted.
pub const MIN_SECRET_BYTES: usize = 16;

/// The shared secret of a cluster's processes; wiped from memory when dropped, never
/// shown by `Debug`.
#[derive(Clone)]
pub struct ClusterSecret(Zeroizing<Vec<u8>>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(<hidden>)")
    }
}

impl PartialEq for ClusterSecret {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Eq for ClusterSecret {}

impl ClusterSecret {
    /// A secret of at least [`MIN_SECRET_BYTES`] bytes.
    pub fn new(bytes: &[u8]) -> Result<Self, EngineError> {
        let bytes = Zeroizing::new(bytes.to_vec());
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(EngineError::Invalid(format!(
                "the cluster secret is {} bytes; at least {MIN_SECRET_BYTES} are needed",
                bytes.len()
            )));
        }
        Ok(Self(bytes))
    }

    /// The secret in the file at `path`, without a trailing newline.
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        use std::io::Read;
        let mut bytes = Zeroizing::new(Vec::new());
        std::fs::File::open(path)
            .and_then(|file| file.take(64 * 1024).read_to_end(&mut bytes))
            .map_err(|e| EngineError::io("read the cluster secret", path, &e))?;
        while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            bytes.pop();
        }
        Self::new(&bytes).map_err(|e| EngineError::Invalid(format!("{}: {e}", path.display())))
    }

    fn mac(&self, purpose: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
        // Any key length is accepted by HMAC; the error cannot happen.
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable_hmac());
        for part in std::iter::once(purpose.as_bytes()).chain(parts.iter().copied()) {
            // Length-prefixed: no two different transcripts share their bytes.
            mac.update(&u64::try_from(part.len()).unwrap_or(u64::MAX).to_be_bytes());
            mac.update(part);
        }
        mac
    }

    /// The MAC of one step of a handshake claiming `claim` (the two nonces in the
    /// order the step's author saw them: a welcome cannot pass for a hello).
    fn step_mac(
        &self,
        step: Step,
        claim: &str,
        challenge: &Nonce,
        nonce: &Nonce,
        token: &[u8],
    ) -> Hmac<Sha256> {
        match step {
            Step::Hello => self.mac(
                "stillpoint hello 1",
                &[claim.as_bytes(), challenge, nonce, token],
            ),
            Step::Welcome => self.mac(
                "stillpoint welcome 1",
                &[claim.as_bytes(), nonce, challenge, token],
            ),
        }
    }

    /// The proof of `step` of a handshake claiming `claim` that answered `challenge`
    /// with `nonce`, hex.
    pub(crate) fn proof(
        &self,
        step: Step,
        claim: &str,
        challenge: &Nonce,
        nonce: &Nonce,
        token: &[u8],
    ) -> String {
        let mac = self.step_mac(step, claim, challenge, nonce, token);
        stillpoint_wire::encode_hex(&mac.finalize().into_bytes())
    }

    /// Whether `proof` is that proof (compared in constant time).
    pub(crate) fn check(
        &self,
        step: Step,
        claim: &str,
        (challenge, nonce): (&Nonce, &Nonce),
        token: &[u8],
        proof: &str,
    ) -> bool {
        let Ok(proof) = stillpoint_wire::decode_hex(proof) else {
            return false;
        };
        self.step_mac(step, claim, challenge, nonce, token)
            .verify_slice(&proof)
            .is_ok()
    }
}

/// The two proven steps of a handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// The connecting side's hello.
    Hello,
    /// The accepting side's answer.
    Welcome,
}

#[cold]
fn unreachable_hmac() -> Hmac<Sha256> {
    // HMAC takes keys of any length; this is never reached.
    #[allow(clippy::expect_used)]
    <Hmac<Sha256> as Mac>::new_from_slice(&[0u8; 32]).expect("HMAC accepts any key length")
}

/// A fresh random challenge or nonce.
pub(crate) type Nonce = [u8; 32];

/// 32 bytes from the operating system's generator.
pub(crate) fn nonce() -> Nonce {
    let mut nonce = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut nonce);
    nonce
}

/// A nonce from its hex form, or why not.
pub(crate) fn parse_nonce(text: &str) -> Result<Nonce, String> {
    let bytes = stillpoint_wire::decode_hex(text).map_err(|e| format!("a nonce: {e}"))?;
    Nonce::try_from(bytes.as_slice())
        .map_err(|_| format!("a nonce of {} bytes, not 32", bytes.len()))
}

/// What a node connection claims: to be node `node`.
pub(crate) fn node_claim(node: u32) -> String {
    format!("node {node}")
}

/// What an edge connection claims: to carry `upstream → downstream` of `generation`.
pub(crate) fn edge_claim(generation: u64, upstream: u32, downstream: u32) -> String {
    format!("edge {generation} {upstream} {downstream}")
}

/// How long a peer has for each step of a handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection's reads, each within what is left of one deadline: a peer dripping
/// bytes cannot hold a handshake open past it.
struct ByDeadline<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl std::io::Read for ByDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        std::io::Read::read(&mut self.stream, buf)
    }
}

/// Reads one engine message within `timeout`.
fn read_engine(
    stream: &TcpStream,
    timeout: Duration,
    what: &str,
) -> Result<EngineMessage, EngineError> {
    let started = Instant::now();
    let mut reader = ByDeadline {
        stream,
        deadline: started + timeout,
    };
    let envelope = read_envelope(&mut reader, FrameDecoder::default()).map_err(|error| {
        if started.elapsed() >= timeout {
            EngineError::Net(format!("no {what} within {timeout:?}"))
        } else {
            EngineError::Net(format!("waiting for the {what}: {error}"))
        }
    })?;
    stream
        .set_read_timeout(None)
        .map_err(|e| EngineError::Net(format!("handshake: {e}")))?;
    match envelope {
        Envelope::Engine(message) => Ok(message),
        Envelope::Wire { .. } => Err(EngineError::Net(format!(
            "a protocol message instead of the {what}"
        ))),
    }
}

fn send(stream: &TcpStream, message: EngineMessage) -> Result<(), EngineError> {
    let mut bytes = Vec::new();
    write_envelope(&mut bytes, &Envelope::Engine(message))?;
    (&mut &*stream)
        .write_all(&bytes)
        .map_err(|e| EngineError::Net(format!("handshake: {e}")))
}

/// The accepting side of a handshake: challenges, reads the hello within the
/// handshake timeout, checks its proof against its claim and the token `token_for`
/// gives for it (an error there refuses the hello, naming why), and welcomes it.
/// The hello when it holds; a refused peer is told so and the connection is closed.
pub(crate) fn accept(
    stream: &TcpStream,
    secret: &ClusterSecret,
    token_for: impl FnOnce(&EngineMessage) -> Result<Vec<u8>, String>,
) -> Result<EngineMessage, EngineError> {
    let challenge = nonce();
    send(
        stream,
        EngineMessage::Challenge {
            nonce: stillpoint_wire::encode_hex(&challenge),
        },
    )?;
    let hello = read_engine(stream, HANDSHAKE_TIMEOUT, "hello")?;
    let checked = (|| {
        let (claim, nonce, proof) = match &hello {
            EngineMessage::Hello { node, nonce, proof } => (node_claim(*node), nonce, proof),
            EngineMessage::EdgeHello {
                generation,
                upstream,
                downstream,
                nonce,
                proof,
            } => (
                edge_claim(*generation, *upstream, *downstream),
                nonce,
                proof,
            ),
            other => return Err(format!("it began with {}, not a hello", other.name())),
        };
        let nonce = parse_nonce(nonce)?;
        let token = token_for(&hello)?;
        if !secret.check(Step::Hello, &claim, (&challenge, &nonce), &token, proof) {
            return Err(format!(
                "the proof of its hello ({claim}) does not hold: it does not know the cluster secret{}",
                if token.is_empty() {
                    ""
                } else {
                    " or the generation's token"
                }
            ));
        }
        Ok(secret.proof(Step::Welcome, &claim, &challenge, &nonce, &token))
    })();
    match checked {
        Ok(proof) => {
            send(stream, EngineMessage::Welcome { proof })?;
            Ok(hello)
        }
        Err(reason) => {
            let _told = send(
                stream,
                EngineMessage::Refused {
                    reason: reason.clone(),
                },
            );
            let _closed = stream.shutdown(std::net::Shutdown::Both);
            Err(EngineError::Net(reason))
        }
    }
}

/// Why a connecting side's handshake did not complete.
#[derive(Debug)]
pub(crate) enum Rejected {
    /// The peer refused the hello (it says why): the secrets differ, or the claim
    /// is not one it accepts.
    Refused(String),
    /// The connection failed or the peer is not who it should be.
    Failed(EngineError),
}

/// The connecting side of a handshake: reads the challenge, sends the hello that
/// `hello(nonce, proof)` builds for `claim` (and `token`), and checks the welcome:
/// the peer knows the secret too.
pub(crate) fn connect(
    stream: &TcpStream,
    secret: &ClusterSecret,
    claim: &str,
    token: &[u8],
    hello: impl FnOnce(String, String) -> EngineMessage,
) -> Result<(), Rejected> {
    let challenge =
        match read_engine(stream, HANDSHAKE_TIMEOUT, "challenge").map_err(Rejected::Failed)? {
            EngineMessage::Challenge { nonce } => parse_nonce(&nonce)
                .map_err(|e| Rejected::Failed(EngineError::Net(format!("the challenge: {e}"))))?,
            other => {
                return Err(Rejected::Failed(EngineError::Net(format!(
                    "the peer began with {}, not a challenge",
                    other.name()
                ))));
            }
        };
    let nonce = nonce();
    let proof = secret.proof(Step::Hello, claim, &challenge, &nonce, token);
    send(stream, hello(stillpoint_wire::encode_hex(&nonce), proof)).map_err(Rejected::Failed)?;
    match read_engine(stream, HANDSHAKE_TIMEOUT, "welcome").map_err(Rejected::Failed)? {
        EngineMessage::Welcome { proof }
            if secret.check(Step::Welcome, claim, (&challenge, &nonce), token, &proof) =>
        {
            Ok(())
        }
        EngineMessage::Welcome { .. } => Err(Rejected::Failed(EngineError::Net(
            "the peer's welcome does not hold: it does not know the cluster secret".to_owned(),
        ))),
        EngineMessage::Refused { reason } => Err(Rejected::Refused(reason)),
        other => Err(Rejected::Failed(EngineError::Net(format!(
            "the peer answered with {}, not a welcome",
            other.name()
        )))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_only_for_its_secret_claim_challenge_and_token() {
        let secret = ClusterSecret::new(b"0123456789abcdef0123").unwrap();
        let other = ClusterSecret::new(b"0123456789abcdef0124").unwrap();
        let (challenge, nonce) = (nonce(), nonce());
        let claim = edge_claim(3, 1, 4);
        let nonces = (&challenge, &nonce);
        let proof = secret.proof(Step::Hello, &claim, &challenge, &nonce, b"token");
        assert!(secret.check(Step::Hello, &claim, nonces, b"token", &proof));
        assert!(!other.check(Step::Hello, &claim, nonces, b"token", &proof));
        assert!(!secret.check(Step::Hello, &edge_claim(3, 1, 5), nonces, b"token", &proof));
        assert!(!secret.check(
            Step::Hello,
            &claim,
            (&super::nonce(), &nonce),
            b"token",
            &proof
        ));
        assert!(!secret.check(Step::Hello, &claim, nonces, b"old token", &proof));
        assert!(!secret.check(Step::Hello, &claim, nonces, b"token", "zz"));
        // A welcome is not a hello (and the other way round).
        let welcome = secret.proof(Step::Welcome, &claim, &challenge, &nonce, b"token");
        assert!(secret.check(Step::Welcome, &claim, nonces, b"token", &welcome));
        assert!(!secret.check(Step::Hello, &claim, nonces, b"token", &welcome));
        assert!(!secret.check(Step::Welcome, &claim, nonces, b"token", &proof));
    }

    #[test]
    fn a_short_secret_is_refused_and_never_shown() {
        let error = ClusterSecret::new(b"short").unwrap_err().to_string();
        assert!(
            error.contains("5 bytes") && !error.contains("short"),
            "{error}"
        );
        let secret = ClusterSecret::new(b"a secret of enough length").unwrap();
        assert_eq!(format!("{secret:?}"), "ClusterSecret(<hidden>)");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "a secret of enough length\n").unwrap();
        let from_file = ClusterSecret::from_file(&path).unwrap();
        let (c, n) = (nonce(), nonce());
        let proof = secret.proof(Step::Hello, "node 1", &c, &n, &[]);
        assert!(from_file.check(Step::Hello, "node 1", (&c, &n), &[], &proof));
    }
}
