//! The wire protocol of stillpoint: identifiers, the checkpoint messages, a checksummed
//! frame codec and the snapshot and checkpoint manifests.
//!
//! ```
//! use bytes::BytesMut;
//! use stillpoint_wire::{
//!     encode, Barrier, CheckpointId, CheckpointKind, FrameDecoder, Message, StreamId, TaskId,
//!     TransId,
//! };
//!
//! // An upstream task puts a barrier on the wire, in-band with its data...
//! let barrier = Message::Barrier(Barrier {
//!     stream: StreamId(1),
//!     upstream: TaskId(10),
//!     downstream: TaskId(20),
//!     checkpoint: CheckpointId(7),
//!     trans: TransId(3),
//!     kind: CheckpointKind::Checkpoint,
//! });
//! let mut wire = BytesMut::new();
//! encode(&barrier, &mut wire)?;
//!
//! // ...and the downstream decodes it incrementally, as bytes arrive.
//! let decoder = FrameDecoder::default();
//! let mut received = wire.split_to(10);
//! assert_eq!(decoder.decode(&mut received)?, None); // need more bytes
//! received.unsplit(wire);
//! assert_eq!(decoder.decode(&mut received)?, Some(barrier));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! - [`Message`] and its twelve kinds are the protocol of DESIGN §2; `Data` carries a
//!   zero-copy [`bytes::Bytes`] payload.
//! - [`encode`] and [`FrameDecoder`] are the frame codec; every malformed input is a
//!   [`FrameError`] naming what was wrong, never a panic, and the decoder never asks
//!   for more than its configured maximum frame.
//! - [`SnapshotManifest`] and [`CheckpointManifest`] are the versioned, checksummed
//!   manifests; [`RelativePath`] makes an absolute or `..` path unrepresentable.
//! - [`encode_segment`] and [`decode_segment`] are the changelog segments a task's
//!   state backend writes at each checkpoint; a damaged one is a [`SegmentError`].
//!
//! The byte-level format is specified in `docs/wire-format.md` of the repository.

mod batch;
mod codec;
mod digest;
mod envelope;
mod hex;
mod ids;
mod manifest;
mod message;
mod offset;
mod path;
mod segment;

pub use batch::{BatchError, Record, decode_batch, encode_batch};
pub use codec::{
    DEFAULT_MAX_PAYLOAD_LEN, EncodeError, FORMAT_VERSION, FieldProblem, FrameDecoder, FrameError,
    HEADER_LEN, MAGIC, MAX_TEXT_LEN, encode, encode_to_bytes, encode_with_limit,
};
pub use digest::{DigestParseError, Sha256Digest};
pub use envelope::{EngineMessage, Envelope, EnvelopeError, read_envelope, write_envelope};
pub use hex::{HexError, decode as decode_hex, encode as encode_hex};
pub use ids::{CheckpointId, CheckpointKind, NodeId, StreamId, TaskId, TransId};
pub use manifest::{
    BackendInfo, CheckpointManifest, KeyGroupRange, MANIFEST_VERSION, MAX_MANIFEST_LEN,
    ManifestError, SnapshotFile, SnapshotManifest, SourcePosition, TaskSnapshotRef,
};
pub use message::{
    AbortReason, Barrier, BarrierAck, CheckpointAbort, CheckpointComplete, CheckpointReady,
    CheckpointReadyAck, CheckpointReport, CheckpointSource, CheckpointSourceRsp, Data, EndOfInput,
    Message, MessageKind, ReportOutcome, RetrieveAnswer, RetrieveBarrier, RetrieveBarrierRsp,
    Route, SnapshotReport, Watermark,
};
pub use offset::{OffsetTooLong, SourceOffset};
pub use path::{PathProblem, RelativePath};
pub use segment::{SegmentEntry, SegmentError, SegmentWrite, decode_segment, encode_segment};

/// The crate README's example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctest;
