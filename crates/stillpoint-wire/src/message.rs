//! The messages of the checkpoint protocol (DESIGN §2), one struct per message kind.
//!
//! Naming: `upstream` and `downstream` always name the two ends of a dataflow edge,
//! whichever way a message travels on it. A `Barrier` goes from `upstream` to
//! `downstream`; its `BarrierAck` goes back, with the same two fields.

use std::fmt;

use bytes::Bytes;

use crate::{
    CheckpointId, CheckpointKind, NodeId, RelativePath, Sha256Digest, SourceOffset, StreamId,
    TaskId, TransId,
};

/// The kind byte of a frame. The numeric values are part of the wire format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum MessageKind {
    /// [`CheckpointSource`].
    CheckpointSource = 1,
    /// [`CheckpointSourceRsp`].
    CheckpointSourceRsp = 2,
    /// [`Barrier`].
    Barrier = 3,
    /// [`BarrierAck`].
    BarrierAck = 4,
    /// [`CheckpointReady`].
    CheckpointReady = 5,
    /// [`CheckpointReadyAck`].
    CheckpointReadyAck = 6,
    /// [`RetrieveBarrier`].
    RetrieveBarrier = 7,
    /// [`RetrieveBarrierRsp`].
    RetrieveBarrierRsp = 8,
    /// [`CheckpointReport`].
    CheckpointReport = 9,
    /// [`CheckpointComplete`].
    CheckpointComplete = 10,
    /// [`CheckpointAbort`].
    CheckpointAbort = 11,
    /// [`Data`].
    Data = 12,
    /// [`EndOfInput`].
    EndOfInput = 13,
    /// [`Watermark`].
    Watermark = 14,
}

impl MessageKind {
    /// Every kind, in wire-code order.
    pub const ALL: [Self; 14] = [
        Self::CheckpointSource,
        Self::CheckpointSourceRsp,
        Self::Barrier,
        Self::BarrierAck,
        Self::CheckpointReady,
        Self::CheckpointReadyAck,
        Self::RetrieveBarrier,
        Self::RetrieveBarrierRsp,
        Self::CheckpointReport,
        Self::CheckpointComplete,
        Self::CheckpointAbort,
        Self::Data,
        Self::EndOfInput,
        Self::Watermark,
    ];

    /// The kind with wire code `code`, if there is one.
    #[must_use]
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.code() == code)
    }

    /// The wire code.
    #[must_use]
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The message name, as in DESIGN §2.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::CheckpointSource => "CheckpointSource",
            Self::CheckpointSourceRsp => "CheckpointSourceRsp",
            Self::Barrier => "Barrier",
            Self::BarrierAck => "BarrierAck",
            Self::CheckpointReady => "CheckpointReady",
            Self::CheckpointReadyAck => "CheckpointReadyAck",
            Self::RetrieveBarrier => "RetrieveBarrier",
            Self::RetrieveBarrierRsp => "RetrieveBarrierRsp",
            Self::CheckpointReport => "CheckpointReport",
            Self::CheckpointComplete => "CheckpointComplete",
            Self::CheckpointAbort => "CheckpointAbort",
            Self::Data => "Data",
            Self::EndOfInput => "EndOfInput",
            Self::Watermark => "Watermark",
        }
    }
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Coordinator → source task: start checkpoint `checkpoint` in transaction `trans`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointSource {
    /// The stream.
    pub stream: StreamId,
    /// The source task asked to checkpoint.
    pub task: TaskId,
    /// The checkpoint to start.
    pub checkpoint: CheckpointId,
    /// The coordinator's transaction for this attempt.
    pub trans: TransId,
    /// Checkpoint or savepoint.
    pub kind: CheckpointKind,
}

/// Source → coordinator: the source and everything downstream of it finished `checkpoint`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointSourceRsp {
    /// The stream.
    pub stream: StreamId,
    /// The responding source task.
    pub task: TaskId,
    /// The node hosting it.
    pub node: NodeId,
    /// The finished checkpoint.
    pub checkpoint: CheckpointId,
    /// Its transaction.
    pub trans: TransId,
}

/// Upstream → downstream, in-band with data: every record before it belongs to `checkpoint`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Barrier {
    /// The stream.
    pub stream: StreamId,
    /// The sending task.
    pub upstream: TaskId,
    /// The receiving task.
    pub downstream: TaskId,
    /// The checkpoint this barrier delimits.
    pub checkpoint: CheckpointId,
    /// Its transaction.
    pub trans: TransId,
    /// Checkpoint or savepoint.
    pub kind: CheckpointKind,
}

/// Downstream → upstream: the barrier for `checkpoint` arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BarrierAck {
    /// The stream.
    pub stream: StreamId,
    /// The task that sent the barrier (receives this ack).
    pub upstream: TaskId,
    /// The task that received the barrier (sends this ack).
    pub downstream: TaskId,
    /// The barrier's checkpoint.
    pub checkpoint: CheckpointId,
}

/// Downstream → upstream: the downstream task has built `checkpoint`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointReady {
    /// The stream.
    pub stream: StreamId,
    /// The receiving task.
    pub upstream: TaskId,
    /// The task that built the checkpoint.
    pub downstream: TaskId,
    /// The node hosting `downstream`.
    pub downstream_node: NodeId,
    /// The built checkpoint.
    pub checkpoint: CheckpointId,
    /// Its transaction.
    pub trans: TransId,
}

/// Upstream → downstream: the [`CheckpointReady`] arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointReadyAck {
    /// The stream.
    pub stream: StreamId,
    /// The task that received the ready message (sends this ack).
    pub upstream: TaskId,
    /// The task that sent it (receives this ack).
    pub downstream: TaskId,
    /// The checkpoint.
    pub checkpoint: CheckpointId,
}

/// Downstream → upstream: "I have not seen your barrier for `checkpoint`".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetrieveBarrier {
    /// The stream.
    pub stream: StreamId,
    /// The task whose barrier is missing.
    pub upstream: TaskId,
    /// The task waiting for it.
    pub downstream: TaskId,
    /// The node hosting `downstream`.
    pub downstream_node: NodeId,
    /// The checkpoint being aligned.
    pub checkpoint: CheckpointId,
}

/// The upstream's answer to a [`RetrieveBarrier`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetrieveAnswer {
    /// The upstream has not reached the barrier yet; the downstream keeps waiting.
    NotYetSent,
    /// The upstream already put the barrier on the data channel, behind the records
    /// sent before it. The answer does not stand in for the barrier: only the in-band
    /// barrier proves those records were applied (see `docs/state-machines.md`).
    AlreadySent {
        /// The barrier's transaction.
        trans: TransId,
        /// The barrier's kind.
        kind: CheckpointKind,
    },
}

/// Upstream → downstream: the answer to a [`RetrieveBarrier`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetrieveBarrierRsp {
    /// The stream.
    pub stream: StreamId,
    /// The answering task.
    pub upstream: TaskId,
    /// The task that asked.
    pub downstream: TaskId,
    /// The checkpoint asked about.
    pub checkpoint: CheckpointId,
    /// Sent or not yet.
    pub answer: RetrieveAnswer,
}

/// What a task built for a checkpoint: where its snapshot manifest is, how big, how long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotReport {
    /// The task's snapshot manifest, relative to the job's root in the store.
    pub manifest: RelativePath,
    /// SHA-256 of that manifest file, copied into the global manifest.
    pub manifest_sha256: Sha256Digest,
    /// Full size of the task's state in this checkpoint.
    pub state_bytes: u64,
    /// Bytes actually uploaded for this checkpoint (the rest was shared).
    pub uploaded_bytes: u64,
    /// Files in the snapshot.
    pub files: u32,
    /// Files uploaded for this checkpoint.
    pub uploaded_files: u32,
    /// Time from the first to the last barrier (inputs blocked), microseconds.
    pub alignment_micros: u64,
    /// Synchronous part of the snapshot (the task was stalled), microseconds.
    pub sync_micros: u64,
    /// Asynchronous part of the snapshot (flush, export, upload), microseconds.
    pub async_micros: u64,
    /// For a source task, the offset it resumes from when restored from this checkpoint.
    pub source_offset: Option<SourceOffset>,
}

/// Built or failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReportOutcome {
    /// The task's snapshot is durable in the store.
    Built(SnapshotReport),
    /// The task could not build the checkpoint.
    Failed {
        /// Human-readable cause (at most 65 535 bytes of UTF-8 on the wire).
        reason: String,
    },
}

/// Task → coordinator: the task built `checkpoint`, or failed to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointReport {
    /// The stream.
    pub stream: StreamId,
    /// The reporting task.
    pub task: TaskId,
    /// The node hosting it.
    pub node: NodeId,
    /// The checkpoint.
    pub checkpoint: CheckpointId,
    /// Its transaction.
    pub trans: TransId,
    /// Built or failed.
    pub outcome: ReportOutcome,
}

/// Coordinator → task: `checkpoint` is globally complete; commit and move on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointComplete {
    /// The stream.
    pub stream: StreamId,
    /// The task told.
    pub task: TaskId,
    /// The completed checkpoint.
    pub checkpoint: CheckpointId,
    /// Its transaction.
    pub trans: TransId,
    /// When the global manifest was committed, milliseconds since the Unix epoch.
    pub completed_at_millis: u64,
    /// For a source task, the offset recorded for it (the checkpoint version).
    pub source_offset: Option<SourceOffset>,
}

/// Why the coordinator gave up a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortReason {
    /// Not complete within the checkpoint timeout.
    Timeout,
    /// This task reported a failure.
    TaskFailed(TaskId),
    /// The connection to this node was lost.
    ConnectionLost(NodeId),
    /// The store refused the upload or the global manifest.
    StoreFailed,
    /// A user or a shutdown cancelled it.
    Cancelled,
}

/// Coordinator → task: drop checkpoint `checkpoint`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointAbort {
    /// The stream.
    pub stream: StreamId,
    /// The task told.
    pub task: TaskId,
    /// The aborted checkpoint.
    pub checkpoint: CheckpointId,
    /// Its transaction.
    pub trans: TransId,
    /// Why.
    pub reason: AbortReason,
}

/// Upstream → downstream: a block of records, opaque to the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Data {
    /// The stream.
    pub stream: StreamId,
    /// The sending task.
    pub upstream: TaskId,
    /// The receiving task.
    pub downstream: TaskId,
    /// How many records `payload` holds (for metrics; the protocol does not look inside).
    pub records: u32,
    /// The records; a decoded `Data` shares the receive buffer (no copy).
    pub payload: Bytes,
}

/// Upstream → downstream, in-band after its last `Data`: the upstream's input has
/// ended and it sends no more records (barriers may follow). A task whose upstreams
/// have all ended has ended too, and says so downstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndOfInput {
    /// The stream.
    pub stream: StreamId,
    /// The task whose input ended.
    pub upstream: TaskId,
    /// The receiving task.
    pub downstream: TaskId,
}

/// Upstream → downstream, in-band with data: event time has reached `time` on this
/// edge — no record with an earlier event time follows (those that do anyway are
/// late). `idle`: the upstream has no input for now and is left out of its
/// downstream's watermark until it sends a watermark that is not idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watermark {
    /// The stream.
    pub stream: StreamId,
    /// The sending task.
    pub upstream: TaskId,
    /// The receiving task.
    pub downstream: TaskId,
    /// The event time reached, in milliseconds.
    pub time: i64,
    /// Whether the upstream is idle.
    pub idle: bool,
}

/// Any protocol message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)] // each variant is documented by its struct
pub enum Message {
    CheckpointSource(CheckpointSource),
    CheckpointSourceRsp(CheckpointSourceRsp),
    Barrier(Barrier),
    BarrierAck(BarrierAck),
    CheckpointReady(CheckpointReady),
    CheckpointReadyAck(CheckpointReadyAck),
    RetrieveBarrier(RetrieveBarrier),
    RetrieveBarrierRsp(RetrieveBarrierRsp),
    CheckpointReport(CheckpointReport),
    CheckpointComplete(CheckpointComplete),
    CheckpointAbort(CheckpointAbort),
    Data(Data),
    EndOfInput(EndOfInput),
    Watermark(Watermark),
}

impl Message {
    /// The frame kind this message is carried in.
    #[must_use]
    pub const fn kind(&self) -> MessageKind {
        match self {
            Self::CheckpointSource(_) => MessageKind::CheckpointSource,
            Self::CheckpointSourceRsp(_) => MessageKind::CheckpointSourceRsp,
            Self::Barrier(_) => MessageKind::Barrier,
            Self::BarrierAck(_) => MessageKind::BarrierAck,
            Self::CheckpointReady(_) => MessageKind::CheckpointReady,
            Self::CheckpointReadyAck(_) => MessageKind::CheckpointReadyAck,
            Self::RetrieveBarrier(_) => MessageKind::RetrieveBarrier,
            Self::RetrieveBarrierRsp(_) => MessageKind::RetrieveBarrierRsp,
            Self::CheckpointReport(_) => MessageKind::CheckpointReport,
            Self::CheckpointComplete(_) => MessageKind::CheckpointComplete,
            Self::CheckpointAbort(_) => MessageKind::CheckpointAbort,
            Self::Data(_) => MessageKind::Data,
            Self::EndOfInput(_) => MessageKind::EndOfInput,
            Self::Watermark(_) => MessageKind::Watermark,
        }
    }

    /// The stream the message belongs to.
    #[must_use]
    pub const fn stream(&self) -> StreamId {
        match self {
            Self::CheckpointSource(m) => m.stream,
            Self::CheckpointSourceRsp(m) => m.stream,
            Self::Barrier(m) => m.stream,
            Self::BarrierAck(m) => m.stream,
            Self::CheckpointReady(m) => m.stream,
            Self::CheckpointReadyAck(m) => m.stream,
            Self::RetrieveBarrier(m) => m.stream,
            Self::RetrieveBarrierRsp(m) => m.stream,
            Self::CheckpointReport(m) => m.stream,
            Self::CheckpointComplete(m) => m.stream,
            Self::CheckpointAbort(m) => m.stream,
            Self::Data(m) => m.stream,
            Self::EndOfInput(m) => m.stream,
            Self::Watermark(m) => m.stream,
        }
    }

    /// Where the message travels: along one edge (which way), from the coordinator to
    /// a task, or from a task to the coordinator.
    #[must_use]
    pub const fn route(&self) -> Route {
        let (upstream, downstream, to_downstream) = match self {
            Self::CheckpointSource(m) => return Route::ToTask(m.task),
            Self::CheckpointComplete(m) => return Route::ToTask(m.task),
            Self::CheckpointAbort(m) => return Route::ToTask(m.task),
            Self::CheckpointSourceRsp(m) => return Route::ToCoordinator(m.task),
            Self::CheckpointReport(m) => return Route::ToCoordinator(m.task),
            Self::Data(m) => (m.upstream, m.downstream, true),
            Self::EndOfInput(m) => (m.upstream, m.downstream, true),
            Self::Watermark(m) => (m.upstream, m.downstream, true),
            Self::Barrier(m) => (m.upstream, m.downstream, true),
            Self::CheckpointReadyAck(m) => (m.upstream, m.downstream, true),
            Self::RetrieveBarrierRsp(m) => (m.upstream, m.downstream, true),
            Self::BarrierAck(m) => (m.upstream, m.downstream, false),
            Self::CheckpointReady(m) => (m.upstream, m.downstream, false),
            Self::RetrieveBarrier(m) => (m.upstream, m.downstream, false),
        };
        Route::Edge {
            upstream,
            downstream,
            to_downstream,
        }
    }

    /// The task the message is for; `None` when it is for the coordinator.
    #[must_use]
    pub const fn recipient(&self) -> Option<TaskId> {
        match self.route() {
            Route::ToTask(task) => Some(task),
            Route::ToCoordinator(_) => None,
            Route::Edge {
                downstream,
                to_downstream: true,
                ..
            } => Some(downstream),
            Route::Edge { upstream, .. } => Some(upstream),
        }
    }

    /// The checkpoint a control message is about; `None` for [`Data`],
    /// [`EndOfInput`] and [`Watermark`].
    #[must_use]
    pub const fn checkpoint(&self) -> Option<CheckpointId> {
        match self {
            Self::CheckpointSource(m) => Some(m.checkpoint),
            Self::CheckpointSourceRsp(m) => Some(m.checkpoint),
            Self::Barrier(m) => Some(m.checkpoint),
            Self::BarrierAck(m) => Some(m.checkpoint),
            Self::CheckpointReady(m) => Some(m.checkpoint),
            Self::CheckpointReadyAck(m) => Some(m.checkpoint),
            Self::RetrieveBarrier(m) => Some(m.checkpoint),
            Self::RetrieveBarrierRsp(m) => Some(m.checkpoint),
            Self::CheckpointReport(m) => Some(m.checkpoint),
            Self::CheckpointComplete(m) => Some(m.checkpoint),
            Self::CheckpointAbort(m) => Some(m.checkpoint),
            Self::Data(_) | Self::EndOfInput(_) | Self::Watermark(_) => None,
        }
    }
}

/// Where a [`Message`] travels ([`Message::route`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Between the two tasks of one edge.
    Edge {
        /// The edge's upstream task.
        upstream: TaskId,
        /// The edge's downstream task.
        downstream: TaskId,
        /// Whether it flows downstream (records, barriers and the answers to the
        /// downstream's requests) or upstream (acknowledgements and requests).
        to_downstream: bool,
    },
    /// From the coordinator to this task.
    ToTask(TaskId),
    /// From this task to the coordinator.
    ToCoordinator(TaskId),
}

macro_rules! into_message {
    ($($name:ident),* $(,)?) => {
        $(impl From<$name> for Message {
            fn from(message: $name) -> Self {
                Self::$name(message)
            }
        })*
    };
}

into_message!(
    CheckpointSource,
    CheckpointSourceRsp,
    Barrier,
    BarrierAck,
    CheckpointReady,
    CheckpointReadyAck,
    RetrieveBarrier,
    RetrieveBarrierRsp,
    CheckpointReport,
    CheckpointComplete,
    CheckpointAbort,
    Data,
    EndOfInput,
    Watermark,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_codes_are_dense_and_round_trip() {
        for (index, kind) in MessageKind::ALL.into_iter().enumerate() {
            assert_eq!(usize::from(kind.code()), index + 1);
            assert_eq!(MessageKind::from_code(kind.code()), Some(kind));
        }
        assert_eq!(MessageKind::from_code(0), None);
        assert_eq!(MessageKind::from_code(15), None);
    }
}
