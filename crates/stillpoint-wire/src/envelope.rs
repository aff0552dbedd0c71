//! The envelope: how protocol frames and engine messages share one TCP connection
//! between the processes of a cluster (`docs/wire-format.md`, "Envelope").
//!
//! An envelope is `tag (u8) · length (u32 LE) · payload`. Tag 0 carries a protocol
//! message: `generation (u64 LE) · frame` (the checksummed frame of [`crate::encode`]);
//! tag 1 an engine message (JSON): the handshakes and the generation changes between
//! nodes and the coordinator. Every length is checked against a maximum before
//! anything is read, and a payload is read as its bytes arrive — never allocated up
//! front from the announced length.

use std::io::{Read, Write};

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::{FrameDecoder, Message, SourcePosition, encode_to_bytes};

/// Engine messages between nodes and the coordinator (and the edge handshake).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EngineMessage {
    /// The accepting side of a connection, first: answer with a hello proving you
    /// know the cluster secret (`crate::auth`).
    Challenge {
        /// 32 random bytes, hex.
        nonce: String,
    },
    /// Node → coordinator, answering the challenge.
    Hello {
        /// The node.
        node: u32,
        /// The node's own 32 random bytes, hex.
        nonce: String,
        /// HMAC-SHA256 over the claim, the challenge and the nonce, hex.
        proof: String,
    },
    /// The accepting side: the hello holds; here is the proof that it knows the
    /// secret too.
    Welcome {
        /// HMAC-SHA256 over the claim, the nonce and the challenge, hex.
        proof: String,
    },
    /// The accepting side: the hello does not hold (why); the connection closes.
    Refused {
        /// Why, never naming a secret.
        reason: String,
    },
    /// Coordinator → node: build your tasks for `generation`, restored from
    /// `checkpoint` (none: a fresh start).
    Start {
        /// The generation.
        generation: u64,
        /// The generation's token (16 random bytes, hex): each edge connection of the
        /// generation proves it knows it.
        token: String,
        /// The checkpoint to restore.
        checkpoint: Option<u64>,
        /// A replay up to the end of output the sinks published after `checkpoint`
        /// (a fallback past a damaged one): where each source task stops until a
        /// checkpoint taken there completes; the sinks drop what comes before it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replay: Option<Vec<SourcePosition>>,
    },
    /// Node → coordinator: every task of the generation runs and its edges are up.
    Ready {
        /// The generation.
        generation: u64,
    },
    /// Node → coordinator: a snapshot of the checkpoint did not download or verify.
    RestoreFailed {
        /// The generation.
        generation: u64,
        /// The checkpoint.
        checkpoint: u64,
        /// What was wrong (naming the file).
        problem: String,
        /// Whether the checkpoint itself is bad (else the store or job is).
        corrupt: bool,
    },
    /// Node → coordinator: a bounded source reached its end.
    SourceFinished {
        /// The generation.
        generation: u64,
        /// The source task.
        task: u32,
        /// Its final offset.
        offset: Vec<u8>,
    },
    /// Node → coordinator: a replaying source reached its bound.
    SourceAtBound {
        /// The generation.
        generation: u64,
        /// The source task.
        task: u32,
    },
    /// Node → coordinator: a task failed.
    TaskFailed {
        /// The generation.
        generation: u64,
        /// The task.
        task: u32,
        /// Why.
        error: String,
    },
    /// Coordinator → node: tear the generation's tasks down (a failover).
    Reset {
        /// The generation.
        generation: u64,
    },
    /// Coordinator → node: the job is done; carry out the last commits, then say
    /// `Finished` and wait for `Exit`.
    Finish {
        /// The generation.
        generation: u64,
    },
    /// Node → coordinator: every task of the generation has carried out its final
    /// commits (the sinks published). Until every node has said this, the job is not
    /// done: a node lost before it may hold pre-committed output, so the coordinator
    /// restores another generation from the final checkpoint to publish it.
    Finished {
        /// The generation.
        generation: u64,
    },
    /// Coordinator → node: the generation's sources stop reading (`paused`) or read
    /// again; checkpoints go on either way (`stillpoint pause`, `StopHandle::pause`).
    Pause {
        /// The generation.
        generation: u64,
        /// Whether the sources are paused from now on.
        paused: bool,
    },
    /// Coordinator → node: every node finished; exit.
    Exit,
    /// Node → node, answering the challenge of an edge connection.
    EdgeHello {
        /// The generation.
        generation: u64,
        /// The upstream task.
        upstream: u32,
        /// The downstream task.
        downstream: u32,
        /// The upstream node's own 32 random bytes, hex.
        nonce: String,
        /// HMAC-SHA256 over the claim, the challenge, the nonce and the generation's
        /// token, hex.
        proof: String,
    },
}

impl EngineMessage {
    /// The message's type, for logs (never its fields: some are proofs or tokens).
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Self::Challenge { .. } => "challenge",
            Self::Hello { .. } => "hello",
            Self::Welcome { .. } => "welcome",
            Self::Refused { .. } => "refused",
            Self::Start { .. } => "start",
            Self::Ready { .. } => "ready",
            Self::RestoreFailed { .. } => "restore_failed",
            Self::SourceFinished { .. } => "source_finished",
            Self::SourceAtBound { .. } => "source_at_bound",
            Self::TaskFailed { .. } => "task_failed",
            Self::Reset { .. } => "reset",
            Self::Finish { .. } => "finish",
            Self::Finished { .. } => "finished",
            Self::Pause { .. } => "pause",
            Self::Exit => "exit",
            Self::EdgeHello { .. } => "edge_hello",
        }
    }
}

/// One unit on a connection.
#[derive(Clone, Debug)]
pub enum Envelope {
    /// A protocol message of a generation.
    Wire {
        /// The generation it belongs to.
        generation: u64,
        /// The message.
        message: Message,
    },
    /// An engine message.
    Engine(EngineMessage),
}

const TAG_WIRE: u8 = 0;
const TAG_ENGINE: u8 = 1;
/// What an envelope's payload is read in, at most, per step.
const READ_CHUNK: usize = 64 * 1024;
/// Longest engine message accepted.
const MAX_ENGINE_LEN: u32 = 64 * 1024;

/// Why an envelope cannot be written, or a connection not read any more.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    /// The message cannot be encoded (or the connection not written).
    #[error("cannot write an envelope: {0}")]
    Write(String),
    /// The peer closed the connection or it broke.
    #[error("connection closed: {0}")]
    Closed(String),
    /// The peer sent something that is not an envelope.
    #[error("malformed envelope: {0}")]
    Malformed(String),
}

/// Writes one envelope (buffered; the caller flushes).
pub fn write_envelope(out: &mut impl Write, envelope: &Envelope) -> Result<(), EnvelopeError> {
    let (tag, payload): (u8, Bytes) = match envelope {
        Envelope::Wire {
            generation,
            message,
        } => {
            let frame = encode_to_bytes(message).map_err(|e| {
                EnvelopeError::Write(format!("cannot encode {:?}: {e}", message.kind()))
            })?;
            let mut payload = BytesMut::with_capacity(8 + frame.len());
            payload.extend_from_slice(&generation.to_le_bytes());
            payload.extend_from_slice(&frame);
            (TAG_WIRE, payload.freeze())
        }
        Envelope::Engine(message) => (
            TAG_ENGINE,
            Bytes::from(
                serde_json::to_vec(message)
                    .map_err(|e| EnvelopeError::Write(format!("cannot encode {message:?}: {e}")))?,
            ),
        ),
    };
    let length = u32::try_from(payload.len())
        .map_err(|_| EnvelopeError::Write("envelope longer than 4 GiB".to_owned()))?;
    let mut header = [0u8; 5];
    header[0] = tag;
    header[1..].copy_from_slice(&length.to_le_bytes());
    out.write_all(&header)
        .and_then(|()| out.write_all(&payload))
        .map_err(|e| EnvelopeError::Write(format!("write: {e}")))
}

/// Reads one envelope; a frame or engine message longer than the maximum is refused
/// before its payload is read.
pub fn read_envelope(
    input: &mut impl Read,
    decoder: FrameDecoder,
) -> Result<Envelope, EnvelopeError> {
    let mut header = [0u8; 5];
    input
        .read_exact(&mut header)
        .map_err(|e| EnvelopeError::Closed(e.to_string()))?;
    let tag = header[0];
    let length = u32::from_le_bytes([header[1], header[2], header[3], header[4]]);
    let max = match tag {
        TAG_WIRE => decoder
            .max_payload_len()
            .saturating_add(8 + u32::try_from(crate::HEADER_LEN).unwrap_or(u32::MAX)),
        TAG_ENGINE => MAX_ENGINE_LEN,
        other => {
            return Err(EnvelopeError::Malformed(format!(
                "unknown envelope tag {other}"
            )));
        }
    };
    if length > max {
        return Err(EnvelopeError::Malformed(format!(
            "envelope of {length} bytes, at most {max} allowed"
        )));
    }
    // Read as the bytes arrive, never allocated up front from the claimed length: a
    // peer that announces a large envelope and stops costs only what it sent.
    let mut payload = BytesMut::with_capacity((length as usize).min(READ_CHUNK));
    let mut left = length as usize;
    while left > 0 {
        let start = payload.len();
        let chunk = left.min(READ_CHUNK);
        payload.resize(start + chunk, 0);
        let slot = payload.get_mut(start..).unwrap_or_default();
        input
            .read_exact(slot)
            .map_err(|e| EnvelopeError::Closed(e.to_string()))?;
        left -= chunk;
    }
    let payload = payload.freeze();
    if tag == TAG_ENGINE {
        return serde_json::from_slice(&payload)
            .map(Envelope::Engine)
            .map_err(|e| EnvelopeError::Malformed(format!("engine message: {e}")));
    }
    let Some((generation, _frame)) = payload.split_first_chunk::<8>() else {
        return Err(EnvelopeError::Malformed(
            "wire envelope without generation".to_owned(),
        ));
    };
    let generation = u64::from_le_bytes(*generation);
    let message = decoder
        .decode_exact(payload.slice(8..))
        .map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
    Ok(Envelope::Wire {
        generation,
        message,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

    use super::*;
    use crate::{Barrier, CheckpointId, CheckpointKind, StreamId, TaskId, TransId};

    #[test]
    fn envelopes_round_trip_and_oversized_ones_are_refused_unread() {
        let barrier = Message::Barrier(Barrier {
            stream: StreamId(1),
            checkpoint: CheckpointId(3),
            upstream: TaskId(1),
            downstream: TaskId(2),
            trans: TransId(1),
            kind: CheckpointKind::Checkpoint,
        });
        let mut bytes = Vec::new();
        write_envelope(
            &mut bytes,
            &Envelope::Wire {
                generation: 7,
                message: barrier.clone(),
            },
        )
        .unwrap();
        write_envelope(
            &mut bytes,
            &Envelope::Engine(EngineMessage::Ready { generation: 7 }),
        )
        .unwrap();
        let mut input = bytes.as_slice();
        let decoder = FrameDecoder::default();
        match read_envelope(&mut input, decoder).unwrap() {
            Envelope::Wire {
                generation,
                message,
            } => {
                assert_eq!(generation, 7);
                assert_eq!(message, barrier);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            read_envelope(&mut input, decoder).unwrap(),
            Envelope::Engine(EngineMessage::Ready { generation: 7 })
        ));
        assert!(matches!(
            read_envelope(&mut input, decoder),
            Err(EnvelopeError::Closed(_))
        ));
        // A header claiming 4 GiB is refused before anything is allocated or read.
        let huge = [TAG_WIRE, 0xff, 0xff, 0xff, 0xff];
        let error = read_envelope(&mut huge.as_slice(), decoder).unwrap_err();
        assert!(error.to_string().contains("at most"), "{error}");
        let unknown = [9u8, 0, 0, 0, 0];
        assert!(matches!(
            read_envelope(&mut unknown.as_slice(), decoder),
            Err(EnvelopeError::Malformed(_))
        ));
        // A flipped byte in the frame is caught by its checksum.
        let mut corrupt = bytes.clone();
        let last_of_frame = 5 + 8 + 10;
        corrupt[last_of_frame] ^= 1;
        assert!(matches!(
            read_envelope(&mut corrupt.as_slice(), decoder),
            Err(EnvelopeError::Malformed(_))
        ));
        let garbage = [TAG_ENGINE, 2, 0, 0, 0, b'{', b'x'];
        assert!(matches!(
            read_envelope(&mut garbage.as_slice(), decoder),
            Err(EnvelopeError::Malformed(_))
        ));
    }
}
