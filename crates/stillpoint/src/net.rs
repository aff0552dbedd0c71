//! The TCP transport: envelopes on a socket, and the threads of one edge connection.
//!
//! An envelope is `tag (u8) · length (u32 BE) · payload`. Tag 0 carries a protocol
//! message: `generation (u64 BE) · wire frame` (the frame format of
//! `stillpoint-wire`, checksummed); tag 1 an engine message (JSON): the handshakes and
//! the generation changes between nodes and the coordinator. Every length is checked
//! against a maximum before anything is allocated.
//!
//! Each data edge between tasks on different nodes is its own connection, opened by
//! the upstream's node: data and barriers flow downstream in order (the in-band
//! barrier needs exactly that), control flows both ways. One connection per edge keeps
//! backpressure per edge: a downstream that blocks one input for alignment stalls only
//! that connection, never the barriers of its other inputs.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};
use serde::{Deserialize, Serialize};
use stillpoint_wire::{FrameDecoder, Message, Route, SourcePosition, TaskId, encode_to_bytes};

use crate::EngineError;
use crate::build::ControlMap;
use crate::transport::Signals;

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

/// Why a connection cannot be read any more.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The peer closed the connection or it broke.
    #[error("connection closed: {0}")]
    Closed(String),
    /// The peer sent something that is not an envelope.
    #[error("malformed envelope: {0}")]
    Malformed(String),
}

impl From<NetError> for EngineError {
    fn from(error: NetError) -> Self {
        Self::Net(error.to_string())
    }
}

/// Writes one envelope (buffered; the caller flushes).
pub fn write_envelope(out: &mut impl Write, envelope: &Envelope) -> Result<(), EngineError> {
    let (tag, payload): (u8, Bytes) = match envelope {
        Envelope::Wire {
            generation,
            message,
        } => {
            let frame = encode_to_bytes(message).map_err(|e| {
                EngineError::Net(format!("cannot encode {:?}: {e}", message.kind()))
            })?;
            let mut payload = BytesMut::with_capacity(8 + frame.len());
            payload.extend_from_slice(&generation.to_be_bytes());
            payload.extend_from_slice(&frame);
            (TAG_WIRE, payload.freeze())
        }
        Envelope::Engine(message) => (
            TAG_ENGINE,
            Bytes::from(
                serde_json::to_vec(message)
                    .map_err(|e| EngineError::Net(format!("cannot encode {message:?}: {e}")))?,
            ),
        ),
    };
    let length = u32::try_from(payload.len())
        .map_err(|_| EngineError::Net("envelope longer than 4 GiB".to_owned()))?;
    let mut header = [0u8; 5];
    header[0] = tag;
    header[1..].copy_from_slice(&length.to_be_bytes());
    out.write_all(&header)
        .and_then(|()| out.write_all(&payload))
        .map_err(|e| EngineError::Net(format!("write: {e}")))
}

/// Reads one envelope; a frame or engine message longer than the maximum is refused
/// before its payload is read.
pub fn read_envelope(input: &mut impl Read, decoder: FrameDecoder) -> Result<Envelope, NetError> {
    let mut header = [0u8; 5];
    input
        .read_exact(&mut header)
        .map_err(|e| NetError::Closed(e.to_string()))?;
    let tag = header[0];
    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    let max = match tag {
        TAG_WIRE => decoder
            .max_payload_len()
            .saturating_add(8 + u32::try_from(stillpoint_wire::HEADER_LEN).unwrap_or(u32::MAX)),
        TAG_ENGINE => MAX_ENGINE_LEN,
        other => return Err(NetError::Malformed(format!("unknown envelope tag {other}"))),
    };
    if length > max {
        return Err(NetError::Malformed(format!(
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
            .map_err(|e| NetError::Closed(e.to_string()))?;
        left -= chunk;
    }
    let payload = payload.freeze();
    if tag == TAG_ENGINE {
        return serde_json::from_slice(&payload)
            .map(Envelope::Engine)
            .map_err(|e| NetError::Malformed(format!("engine message: {e}")));
    }
    let Some((generation, _frame)) = payload.split_first_chunk::<8>() else {
        return Err(NetError::Malformed(
            "wire envelope without generation".to_owned(),
        ));
    };
    let generation = u64::from_be_bytes(*generation);
    let message = decoder
        .decode_exact(payload.slice(8..))
        .map_err(|e| NetError::Malformed(e.to_string()))?;
    Ok(Envelope::Wire {
        generation,
        message,
    })
}

/// A connection's writing half: envelopes from a channel, flushed whenever the
/// channel is momentarily empty. Ends when every sender is gone or a write fails.
pub(crate) fn writer_loop(stream: TcpStream, envelopes: Receiver<Envelope>, what: String) {
    let mut out = BufWriter::with_capacity(256 * 1024, stream);
    for envelope in &envelopes {
        let mut result = write_envelope(&mut out, &envelope);
        while result.is_ok() {
            match envelopes.try_recv() {
                Ok(next) => result = write_envelope(&mut out, &next),
                Err(_) => break,
            }
        }
        if let Err(error) = result.and_then(|()| {
            out.flush()
                .map_err(|e| EngineError::Net(format!("flush: {e}")))
        }) {
            tracing::debug!(%error, connection = what, "connection writer stopped");
            return;
        }
    }
    let _flushed = out.flush();
}

/// Sends on a bounded channel, giving up when the generation halts.
fn send_bounded(channel: &Sender<Message>, message: Message, signals: &Signals) -> bool {
    let mut message = message;
    loop {
        match channel.send_timeout(message, Duration::from_millis(20)) {
            Ok(()) => return true,
            Err(SendTimeoutError::Timeout(back)) => {
                if signals.halted() {
                    return false;
                }
                message = back;
            }
            Err(SendTimeoutError::Disconnected(_)) => return false,
        }
    }
}

/// The sending side of an edge on the upstream's node: data and barriers from the
/// upstream task's bounded channel and control for the downstream, multiplexed onto
/// the connection in the order they are taken. Ends when the task is gone (its
/// channels close), the generation halts or the connection breaks.
pub(crate) fn edge_sender(
    stream: TcpStream,
    data: Receiver<Message>,
    control: Receiver<Message>,
    generation: u64,
    signals: Arc<Signals>,
) {
    let mut out = BufWriter::with_capacity(256 * 1024, stream);
    let mut data_open = true;
    loop {
        if signals.halted() {
            return;
        }
        let next = if data_open {
            crossbeam_channel::select! {
                recv(data) -> m => match m {
                    Ok(m) => Some(m),
                    Err(_) => { data_open = false; None }
                },
                recv(control) -> m => match m {
                    Ok(m) => Some(m),
                    Err(_) => return,
                },
                default(Duration::from_millis(50)) => None,
            }
        } else {
            match control.recv_timeout(Duration::from_millis(50)) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        };
        let Some(message) = next else {
            continue;
        };
        let mut result = write_envelope(
            &mut out,
            &Envelope::Wire {
                generation,
                message,
            },
        );
        // Drain what is already queued before flushing.
        while result.is_ok() {
            let queued = data.try_recv().or_else(|_| control.try_recv());
            match queued {
                Ok(message) => {
                    result = write_envelope(
                        &mut out,
                        &Envelope::Wire {
                            generation,
                            message,
                        },
                    );
                }
                Err(_) => break,
            }
        }
        if result
            .and_then(|()| out.flush().map_err(|e| EngineError::Net(e.to_string())))
            .is_err()
        {
            tracing::debug!("edge connection closed while sending");
            return;
        }
    }
}

/// One edge connection as its receiving side knows it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EdgeEnd {
    /// The generation the connection was opened for.
    pub(crate) generation: u64,
    /// The edge's upstream task.
    pub(crate) upstream: TaskId,
    /// The edge's downstream task.
    pub(crate) downstream: TaskId,
    /// Whether this side is the downstream's (it receives records, barriers and the
    /// answers to its requests) or the upstream's (acknowledgements and requests).
    pub(crate) downstream_side: bool,
}

impl EdgeEnd {
    /// Whether `message` may arrive on this side of this edge: only messages between
    /// its two tasks, flowing this way, of its generation. Anything else — a barrier
    /// for another task, a `CheckpointComplete` (only the coordinator sends those) —
    /// is refused.
    fn admits(&self, generation: u64, message: &Message) -> bool {
        generation == self.generation
            && message.route()
                == Route::Edge {
                    upstream: self.upstream,
                    downstream: self.downstream,
                    to_downstream: self.downstream_side,
                }
    }
}

/// The receiving side of an edge connection: data and barriers into `data` (the
/// bounded input of the downstream task, on the downstream's side), control messages
/// into the control channel of the edge's task on this side. A message that does not
/// belong to this edge, this direction and this generation closes the connection
/// (the generation then fails over). Ends when the connection breaks or the
/// generation halts; dropping `data` then tells the task its input is gone.
pub(crate) fn edge_receiver(
    stream: TcpStream,
    end: EdgeEnd,
    data: Option<Sender<Message>>,
    control: ControlMap,
    signals: Arc<Signals>,
) {
    let mut input = BufReader::with_capacity(256 * 1024, stream);
    let decoder = FrameDecoder::default();
    loop {
        let envelope = match read_envelope(&mut input, decoder) {
            Ok(envelope) => envelope,
            Err(error) => {
                tracing::debug!(%error, "edge connection closed");
                return;
            }
        };
        let Envelope::Wire {
            generation,
            message,
        } = envelope
        else {
            tracing::warn!(edge = ?end, "an engine message on an edge connection: closing it");
            return;
        };
        if !end.admits(generation, &message) {
            tracing::warn!(
                edge = ?end,
                generation,
                kind = ?message.kind(),
                route = ?message.route(),
                "refused a message that does not belong to this edge: closing it"
            );
            return;
        }
        match (&message, &data) {
            (Message::Data(_) | Message::Barrier(_), Some(data)) => {
                if !send_bounded(data, message, &signals) {
                    return;
                }
            }
            _ => {
                let target = if end.downstream_side {
                    end.downstream
                } else {
                    end.upstream
                };
                if let Some(channel) = control.get(&target) {
                    let _closed = channel.send(message);
                }
            }
        }
    }
}

/// Connects to `address`, retrying until `deadline` or until `give_up` says so.
pub(crate) fn connect_retrying(
    address: std::net::SocketAddr,
    deadline: std::time::Instant,
    give_up: &dyn Fn() -> bool,
) -> Result<TcpStream, EngineError> {
    loop {
        match TcpStream::connect_timeout(&address, Duration::from_secs(1)) {
            Ok(stream) => {
                stream
                    .set_nodelay(true)
                    .map_err(|e| EngineError::Net(format!("{address}: {e}")))?;
                return Ok(stream);
            }
            Err(error) => {
                if std::time::Instant::now() >= deadline || give_up() {
                    return Err(EngineError::Net(format!(
                        "cannot connect to {address}: {error}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stillpoint_wire::{Barrier, CheckpointId, CheckpointKind, StreamId, TaskId, TransId};

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
            Err(NetError::Closed(_))
        ));
        // A header claiming 4 GiB is refused before anything is allocated or read.
        let huge = [TAG_WIRE, 0xff, 0xff, 0xff, 0xff];
        let error = read_envelope(&mut huge.as_slice(), decoder).unwrap_err();
        assert!(error.to_string().contains("at most"), "{error}");
        let unknown = [9u8, 0, 0, 0, 0];
        assert!(matches!(
            read_envelope(&mut unknown.as_slice(), decoder),
            Err(NetError::Malformed(_))
        ));
        // A flipped byte in the frame is caught by its checksum.
        let mut corrupt = bytes.clone();
        let last_of_frame = 5 + 8 + 10;
        corrupt[last_of_frame] ^= 1;
        assert!(matches!(
            read_envelope(&mut corrupt.as_slice(), decoder),
            Err(NetError::Malformed(_))
        ));
        let garbage = [TAG_ENGINE, 0, 0, 0, 2, b'{', b'x'];
        assert!(matches!(
            read_envelope(&mut garbage.as_slice(), decoder),
            Err(NetError::Malformed(_))
        ));
    }

    /// An edge admits only messages between its two tasks, flowing its way, of its
    /// generation: no peer can inject a barrier for another task or tell a sink a
    /// checkpoint completed.
    #[test]
    fn an_edge_admits_only_its_own_pair_direction_and_generation() {
        use stillpoint_wire::{BarrierAck, CheckpointComplete, Data};
        let end = EdgeEnd {
            generation: 4,
            upstream: TaskId(1),
            downstream: TaskId(3),
            downstream_side: true,
        };
        let data = |upstream: u32, downstream: u32| {
            Message::Data(Data {
                stream: StreamId(1),
                upstream: TaskId(upstream),
                downstream: TaskId(downstream),
                records: 0,
                payload: Bytes::new(),
            })
        };
        let barrier = |downstream: u32| {
            Message::Barrier(Barrier {
                stream: StreamId(1),
                checkpoint: CheckpointId(3),
                upstream: TaskId(1),
                downstream: TaskId(downstream),
                trans: TransId(1),
                kind: CheckpointKind::Checkpoint,
            })
        };
        let ack = Message::BarrierAck(BarrierAck {
            stream: StreamId(1),
            upstream: TaskId(1),
            downstream: TaskId(3),
            checkpoint: CheckpointId(3),
        });
        let complete = Message::CheckpointComplete(CheckpointComplete {
            stream: StreamId(1),
            task: TaskId(3),
            checkpoint: CheckpointId(3),
            trans: TransId(1),
            completed_at_millis: 0,
            source_offset: None,
        });
        assert!(end.admits(4, &data(1, 3)));
        assert!(end.admits(4, &barrier(3)));
        assert!(!end.admits(5, &data(1, 3)), "another generation");
        assert!(!end.admits(4, &data(2, 3)), "another upstream");
        assert!(!end.admits(4, &barrier(4)), "a barrier for another task");
        assert!(
            !end.admits(4, &ack),
            "upstream-bound, on the downstream's side"
        );
        assert!(!end.admits(4, &complete), "only the coordinator completes");
        let upstream_side = EdgeEnd {
            downstream_side: false,
            ..end
        };
        assert!(upstream_side.admits(4, &ack));
        assert!(!upstream_side.admits(4, &data(1, 3)));
        assert!(!upstream_side.admits(4, &complete));
    }
}
