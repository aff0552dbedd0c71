//! The TCP transport: the threads of connections carrying envelopes (their format is
//! the wire crate's: `stillpoint_wire::Envelope`, `docs/wire-format.md`).
//!
//! Each data edge between tasks on different nodes is its own connection, opened by
//! the upstream's node: data and barriers flow downstream in order (the in-band
//! barrier needs exactly that), control flows both ways. One connection per edge keeps
//! backpressure per edge: a downstream that blocks one input for alignment stalls only
//! that connection, never the barriers of its other inputs.

use std::io::{BufReader, BufWriter, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};
use stillpoint_wire::{
    Envelope, EnvelopeError, FrameDecoder, Message, Route, TaskId, read_envelope, write_envelope,
};

use stillpoint::{EngineError, Signals};

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
                .map_err(|e| EnvelopeError::Write(format!("flush: {e}")))
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
            .and_then(|()| out.flush().map_err(|e| EnvelopeError::Write(e.to_string())))
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
/// into `control`, the control channel of the edge's task on this side. A message that does not
/// belong to this edge, this direction and this generation closes the connection
/// (the generation then fails over). Ends when the connection breaks or the
/// generation halts; dropping `data` then tells the task its input is gone.
pub(crate) fn edge_receiver(
    stream: TcpStream,
    end: EdgeEnd,
    data: Option<Sender<Message>>,
    control: Sender<Message>,
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
            (
                Message::Data(_)
                | Message::Barrier(_)
                | Message::EndOfInput(_)
                | Message::Watermark(_),
                Some(data),
            ) => {
                if !send_bounded(data, message, &signals) {
                    return;
                }
            }
            // A task that stopped no longer hears; the protocol tolerates it.
            _ => {
                let _closed = control.send(message);
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
    use bytes::Bytes;
    use stillpoint_wire::{Barrier, CheckpointId, CheckpointKind, StreamId, TransId};

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
