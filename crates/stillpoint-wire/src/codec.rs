//! The frame codec: a 16-byte header (magic, version, kind, flags, length, CRC32C) and
//! a little-endian payload per message kind. `docs/wire-format.md` is its byte-level spec.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::message::{
    AbortReason, Barrier, BarrierAck, CheckpointAbort, CheckpointComplete, CheckpointReady,
    CheckpointReadyAck, CheckpointReport, CheckpointSource, CheckpointSourceRsp, Data, EndOfInput,
    Message, MessageKind, ReportOutcome, RetrieveAnswer, RetrieveBarrier, RetrieveBarrierRsp,
    SnapshotReport, Watermark,
};
use crate::{
    CheckpointId, CheckpointKind, NodeId, PathProblem, RelativePath, Sha256Digest, SourceOffset,
    StreamId, TaskId, TransId,
};

/// The first four bytes of every frame: `SPNT`.
pub const MAGIC: [u8; 4] = *b"SPNT";
/// The format version this crate writes and reads.
pub const FORMAT_VERSION: u8 = 1;
/// Length of the fixed frame header.
pub const HEADER_LEN: usize = 16;
/// The default largest payload a decoder accepts: 16 MiB.
pub const DEFAULT_MAX_PAYLOAD_LEN: u32 = 16 * 1024 * 1024;
/// The longest text field (a failure reason), in bytes.
pub const MAX_TEXT_LEN: usize = u16::MAX as usize;

/// A frame that could not be decoded. Every variant is permanent: the byte stream is
/// no longer in sync, so the connection that carried it must be closed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The input ended inside a frame (only from [`FrameDecoder::decode_exact`] and
    /// [`FrameDecoder::finish`]; the incremental decoder waits for more bytes instead).
    #[error("input ended after {available} bytes of a {needed}-byte frame")]
    Truncated {
        /// Bytes the frame needs (the header alone when the header is incomplete).
        needed: usize,
        /// Bytes there were.
        available: usize,
    },
    /// The frame does not start with [`MAGIC`].
    #[error("bad magic {found:02x?}: not a stillpoint frame")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A format version this decoder does not speak.
    #[error("unsupported format version {found} (this decoder speaks {supported})")]
    UnsupportedVersion {
        /// The version byte.
        found: u8,
        /// [`FORMAT_VERSION`].
        supported: u8,
    },
    /// A kind byte that names no message.
    #[error("unknown message kind {found}")]
    UnknownKind {
        /// The kind byte.
        found: u8,
    },
    /// Flag bits this version does not define.
    #[error("{kind} frame has unsupported flags {flags:#06x}")]
    UnsupportedFlags {
        /// The frame's kind.
        kind: MessageKind,
        /// The flags field.
        flags: u16,
    },
    /// A payload longer than the decoder's configured maximum.
    #[error("{kind} frame claims a {length}-byte payload, more than the maximum of {max}")]
    FrameTooLarge {
        /// The frame's kind.
        kind: MessageKind,
        /// The claimed payload length.
        length: u32,
        /// The configured maximum.
        max: u32,
    },
    /// The CRC32C in the header does not match the header and payload.
    #[error(
        "{kind} frame checksum mismatch: header says {expected:#010x}, bytes give {computed:#010x}"
    )]
    ChecksumMismatch {
        /// The frame's kind.
        kind: MessageKind,
        /// The CRC in the header.
        expected: u32,
        /// The CRC of the bytes received.
        computed: u32,
    },
    /// A payload field that could not be decoded.
    #[error("{kind} frame: field `{field}`: {problem}")]
    MalformedField {
        /// The frame's kind.
        kind: MessageKind,
        /// The field's name, as in `docs/wire-format.md`.
        field: &'static str,
        /// What was wrong with it.
        problem: FieldProblem,
    },
    /// Bytes left over after a complete message.
    #[error("{count} trailing bytes after a {kind} message")]
    TrailingBytes {
        /// The message's kind.
        kind: MessageKind,
        /// How many bytes were left.
        count: usize,
    },
}

/// What was wrong with a payload field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FieldProblem {
    /// The payload ended inside the field.
    #[error("payload ends inside the field: needs {needed} bytes, {available} left")]
    Truncated {
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the payload.
        available: usize,
    },
    /// An enumeration or option tag with no meaning.
    #[error("invalid tag {0}")]
    InvalidTag(u8),
    /// Text that is not UTF-8.
    #[error("not valid UTF-8")]
    InvalidUtf8,
    /// A path that could escape its root.
    #[error("invalid path: {0}")]
    InvalidPath(PathProblem),
    /// A length prefix over the field's limit.
    #[error("length {len} is over the limit of {max}")]
    TooLong {
        /// The length prefix.
        len: usize,
        /// The field's limit.
        max: usize,
    },
}

/// A message that could not be encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The payload would be longer than a frame can say (or than the configured maximum).
    #[error("{kind} payload of {length} bytes is over the maximum of {max}")]
    FrameTooLarge {
        /// The message's kind.
        kind: MessageKind,
        /// The payload length it would need.
        length: usize,
        /// The maximum.
        max: usize,
    },
    /// A variable-length field over its limit.
    #[error("{kind} field `{field}` is {len} bytes, over the limit of {max}")]
    FieldTooLong {
        /// The message's kind.
        kind: MessageKind,
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// Its limit.
        max: usize,
    },
    /// The destination buffer cannot hold the frame.
    #[error("destination has room for {available} bytes, the frame needs {needed}")]
    BufferTooSmall {
        /// Bytes the frame needs.
        needed: usize,
        /// Room left in the destination.
        available: usize,
    },
}

// ---------------------------------------------------------------------------------------
// Encoding

/// Where payload fields go: a length pass, a checksum pass, then the destination
/// buffer. The same field code drives all three, so they cannot disagree. (Three
/// passes over a few dozen bytes beat one pass plus `crc32c_combine`, whose GF(2)
/// matrix work costs microseconds; for `Data` the payload is read once for the CRC
/// and once for the copy, as any encoder must.)
trait FieldSink {
    fn put(&mut self, bytes: &[u8]);
}

struct Length(usize);

impl FieldSink for Length {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }
}

struct Crc(u32);

impl FieldSink for Crc {
    fn put(&mut self, bytes: &[u8]) {
        self.0 = crc32c::crc32c_append(self.0, bytes);
    }
}

struct Emit<'a, B: BufMut>(&'a mut B);

impl<B: BufMut> FieldSink for Emit<'_, B> {
    fn put(&mut self, bytes: &[u8]) {
        self.0.put_slice(bytes);
    }
}

struct FieldWriter<'a, S: FieldSink> {
    sink: &'a mut S,
    kind: MessageKind,
}

impl<S: FieldSink> FieldWriter<'_, S> {
    fn u8(&mut self, value: u8) {
        self.sink.put(&[value]);
    }
    fn u16(&mut self, value: u16) {
        self.sink.put(&value.to_le_bytes());
    }
    fn u32(&mut self, value: u32) {
        self.sink.put(&value.to_le_bytes());
    }
    fn u64(&mut self, value: u64) {
        self.sink.put(&value.to_le_bytes());
    }
    fn stream(&mut self, id: StreamId) {
        self.u64(id.0);
    }
    fn task(&mut self, id: TaskId) {
        self.u32(id.0);
    }
    fn node(&mut self, id: NodeId) {
        self.u32(id.0);
    }
    fn checkpoint(&mut self, id: CheckpointId) {
        self.u64(id.0);
    }
    fn trans(&mut self, id: TransId) {
        self.u32(id.0);
    }
    fn kind(&mut self, kind: CheckpointKind) {
        self.u8(kind.to_wire());
    }
    fn short_bytes(
        &mut self,
        field: &'static str,
        bytes: &[u8],
        max: usize,
    ) -> Result<(), EncodeError> {
        let len = u16::try_from(bytes.len())
            .ok()
            .filter(|len| usize::from(*len) <= max)
            .ok_or(EncodeError::FieldTooLong {
                kind: self.kind,
                field,
                len: bytes.len(),
                max,
            })?;
        self.u16(len);
        self.sink.put(bytes);
        Ok(())
    }
    fn offset(&mut self, offset: Option<&SourceOffset>) -> Result<(), EncodeError> {
        match offset {
            None => self.u8(0),
            Some(offset) => {
                self.u8(1);
                self.short_bytes("source_offset", offset.as_bytes(), SourceOffset::MAX_LEN)?;
            }
        }
        Ok(())
    }
}

fn write_payload<S: FieldSink>(message: &Message, sink: &mut S) -> Result<(), EncodeError> {
    let mut w = FieldWriter {
        sink,
        kind: message.kind(),
    };
    match message {
        Message::CheckpointSource(m) => {
            w.stream(m.stream);
            w.task(m.task);
            w.checkpoint(m.checkpoint);
            w.trans(m.trans);
            w.kind(m.kind);
        }
        Message::CheckpointSourceRsp(m) => {
            w.stream(m.stream);
            w.task(m.task);
            w.node(m.node);
            w.checkpoint(m.checkpoint);
            w.trans(m.trans);
        }
        Message::Barrier(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
            w.checkpoint(m.checkpoint);
            w.trans(m.trans);
            w.kind(m.kind);
        }
        Message::BarrierAck(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
            w.checkpoint(m.checkpoint);
        }
        Message::CheckpointReady(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
            w.node(m.downstream_node);
            w.checkpoint(m.checkpoint);
            w.trans(m.trans);
        }
        Message::CheckpointReadyAck(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
            w.checkpoint(m.checkpoint);
        }
        Message::RetrieveBarrier(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
            w.node(m.downstream_node);
            w.checkpoint(m.checkpoint);
        }
        Message::RetrieveBarrierRsp(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
            w.checkpoint(m.checkpoint);
            match m.answer {
                RetrieveAnswer::NotYetSent => w.u8(0),
                RetrieveAnswer::AlreadySent { trans, kind } => {
                    w.u8(1);
                    w.trans(trans);
                    w.kind(kind);
                }
            }
        }
        Message::CheckpointReport(m) => {
            w.stream(m.stream);
            w.task(m.task);
            w.node(m.node);
            w.checkpoint(m.checkpoint);
            w.trans(m.trans);
            match &m.outcome {
                ReportOutcome::Built(r) => {
                    w.u8(0);
                    w.short_bytes(
                        "manifest",
                        r.manifest.as_str().as_bytes(),
                        RelativePath::MAX_LEN,
                    )?;
                    w.sink.put(&r.manifest_sha256.0);
                    w.u64(r.state_bytes);
                    w.u64(r.uploaded_bytes);
                    w.u32(r.files);
                    w.u32(r.uploaded_files);
                    w.u64(r.alignment_micros);
                    w.u64(r.sync_micros);
                    w.u64(r.async_micros);
                    w.offset(r.source_offset.as_ref())?;
                }
                ReportOutcome::Failed { reason } => {
                    w.u8(1);
                    w.short_bytes("reason", reason.as_bytes(), MAX_TEXT_LEN)?;
                }
            }
        }
        Message::CheckpointComplete(m) => {
            w.stream(m.stream);
            w.task(m.task);
            w.checkpoint(m.checkpoint);
            w.trans(m.trans);
            w.u64(m.completed_at_millis);
            w.offset(m.source_offset.as_ref())?;
        }
        Message::CheckpointAbort(m) => {
            w.stream(m.stream);
            w.task(m.task);
            w.checkpoint(m.checkpoint);
            w.trans(m.trans);
            match m.reason {
                AbortReason::Timeout => w.u8(0),
                AbortReason::TaskFailed(task) => {
                    w.u8(1);
                    w.task(task);
                }
                AbortReason::ConnectionLost(node) => {
                    w.u8(2);
                    w.node(node);
                }
                AbortReason::StoreFailed => w.u8(3),
                AbortReason::Cancelled => w.u8(4),
            }
        }
        Message::Data(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
            w.u32(m.records);
            w.sink.put(&m.payload);
        }
        Message::EndOfInput(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
        }
        Message::Watermark(m) => {
            w.stream(m.stream);
            w.task(m.upstream);
            w.task(m.downstream);
            w.sink.put(&m.time.to_le_bytes());
            w.u8(u8::from(m.idle));
        }
    }
    Ok(())
}

/// Encodes `message` as one frame into `dst`, returning the frame's length.
///
/// Nothing is written unless the whole frame fits: a too-long field, a payload over
/// `u32::MAX` bytes or a destination without room is an error and `dst` is untouched.
pub fn encode(message: &Message, dst: &mut impl BufMut) -> Result<usize, EncodeError> {
    encode_with_limit(message, dst, u32::MAX)
}

/// [`encode`], refusing payloads longer than `max_payload_len` (the peer's decoder limit).
pub fn encode_with_limit(
    message: &Message,
    dst: &mut impl BufMut,
    max_payload_len: u32,
) -> Result<usize, EncodeError> {
    let kind = message.kind();
    let mut length = Length(0);
    write_payload(message, &mut length)?;
    let payload_len = length.0;
    let length = u32::try_from(payload_len)
        .ok()
        .filter(|length| *length <= max_payload_len)
        .ok_or(EncodeError::FrameTooLarge {
            kind,
            length: payload_len,
            max: max_payload_len as usize,
        })?;
    let frame_len = HEADER_LEN + payload_len;
    if dst.remaining_mut() < frame_len {
        return Err(EncodeError::BufferTooSmall {
            needed: frame_len,
            available: dst.remaining_mut(),
        });
    }
    let mut header = [0_u8; HEADER_LEN];
    header[..4].copy_from_slice(&MAGIC);
    header[4] = FORMAT_VERSION;
    header[5] = kind.code();
    // header[6..8]: flags, none defined in version 1.
    header[8..12].copy_from_slice(&length.to_le_bytes());
    let mut crc = Crc(crc32c::crc32c(&header[..12]));
    write_payload(message, &mut crc)?;
    header[12..16].copy_from_slice(&crc.0.to_le_bytes());
    dst.put_slice(&header);
    write_payload(message, &mut Emit(dst))?;
    Ok(frame_len)
}

/// [`encode`] into a fresh buffer.
pub fn encode_to_bytes(message: &Message) -> Result<Bytes, EncodeError> {
    let mut buf = BytesMut::new();
    encode(message, &mut buf)?;
    Ok(buf.freeze())
}

// ---------------------------------------------------------------------------------------
// Decoding

/// A validated frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    kind: MessageKind,
    length: u32,
    crc: u32,
}

/// Decodes frames, incrementally or from complete buffers.
///
/// The decoder holds no buffer of its own: the caller reads bytes into a `BytesMut` and
/// calls [`FrameDecoder::decode`] until it returns `Ok(None)` ("need more bytes",
/// [`FrameDecoder::bytes_needed`] says how many). It never allocates, and it tells the
/// caller to read at most `HEADER_LEN + max_payload_len` bytes for one frame, whatever
/// a header claims. Header fields are checked in the order magic, version, kind, flags,
/// length as soon as the header is complete, so a stream of garbage is refused before
/// its claimed payload is read; the checksum and then the fields are checked once the
/// whole frame is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameDecoder {
    max_payload_len: u32,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_PAYLOAD_LEN)
    }
}

impl FrameDecoder {
    /// A decoder refusing payloads longer than `max_payload_len` bytes.
    #[must_use]
    pub const fn new(max_payload_len: u32) -> Self {
        Self { max_payload_len }
    }

    /// The configured maximum payload length.
    #[must_use]
    pub const fn max_payload_len(&self) -> u32 {
        self.max_payload_len
    }

    fn header(&self, buf: &[u8]) -> Result<Option<Header>, FrameError> {
        let Some(header) = buf.first_chunk::<HEADER_LEN>() else {
            // Refuse a wrong magic as soon as it is visible, not after 16 bytes.
            if let Some(prefix) = buf.first_chunk::<4>() {
                check_magic(*prefix)?;
            }
            return Ok(None);
        };
        let (magic, mut bytes) = split_magic(header);
        check_magic(magic)?;
        let version = bytes.get_u8();
        if version != FORMAT_VERSION {
            return Err(FrameError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let code = bytes.get_u8();
        let kind = MessageKind::from_code(code).ok_or(FrameError::UnknownKind { found: code })?;
        let flags = bytes.get_u16_le();
        if flags != 0 {
            return Err(FrameError::UnsupportedFlags { kind, flags });
        }
        let length = bytes.get_u32_le();
        if length > self.max_payload_len {
            return Err(FrameError::FrameTooLarge {
                kind,
                length,
                max: self.max_payload_len,
            });
        }
        let crc = bytes.get_u32_le();
        Ok(Some(Header { kind, length, crc }))
    }

    /// How many more bytes `buf` needs before [`FrameDecoder::decode`] can return a
    /// message (0 when it can return one or an error now). Never more than the
    /// configured maximum frame size.
    #[must_use]
    pub fn bytes_needed(&self, buf: &[u8]) -> usize {
        match self.header(buf) {
            Ok(Some(header)) => (HEADER_LEN + header.length as usize).saturating_sub(buf.len()),
            Ok(None) => HEADER_LEN - buf.len(),
            Err(_) => 0,
        }
    }

    /// Decodes the next message from the front of `buf`, removing its bytes.
    ///
    /// `Ok(None)`: `buf` holds only part of a frame (nothing is consumed). A header or
    /// checksum error consumes nothing; a malformed payload consumes its frame. Either
    /// way the stream cannot be trusted after an error: close the connection.
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Message>, FrameError> {
        let Some(header) = self.header(buf)? else {
            return Ok(None);
        };
        let frame_len = HEADER_LEN + header.length as usize;
        if buf.len() < frame_len {
            return Ok(None);
        }
        verify_crc(header, buf.get(..frame_len).unwrap_or_default())?;
        let frame = buf.split_to(frame_len).freeze();
        decode_payload(header.kind, frame.slice(HEADER_LEN..)).map(Some)
    }

    /// Decodes `input`, which must hold exactly one frame: a short input is
    /// [`FrameError::Truncated`], a longer one [`FrameError::TrailingBytes`].
    pub fn decode_exact(&self, input: Bytes) -> Result<Message, FrameError> {
        let header = self.header(&input)?.ok_or(FrameError::Truncated {
            needed: HEADER_LEN,
            available: input.len(),
        })?;
        let frame_len = HEADER_LEN + header.length as usize;
        let frame = input.get(..frame_len).ok_or(FrameError::Truncated {
            needed: frame_len,
            available: input.len(),
        })?;
        verify_crc(header, frame)?;
        let message = decode_payload(header.kind, input.slice(HEADER_LEN..frame_len))?;
        if input.len() > frame_len {
            return Err(FrameError::TrailingBytes {
                kind: header.kind,
                count: input.len() - frame_len,
            });
        }
        Ok(message)
    }

    /// Call at end of input: bytes left in `buf` are a frame cut short.
    pub fn finish(&self, buf: &BytesMut) -> Result<(), FrameError> {
        if buf.is_empty() {
            return Ok(());
        }
        let needed = match self.header(buf)? {
            Some(header) => HEADER_LEN + header.length as usize,
            None => HEADER_LEN,
        };
        Err(FrameError::Truncated {
            needed,
            available: buf.len(),
        })
    }
}

fn split_magic(header: &[u8; HEADER_LEN]) -> ([u8; 4], &[u8]) {
    let [a, b, c, d, rest @ ..] = header;
    ([*a, *b, *c, *d], rest)
}

fn check_magic(found: [u8; 4]) -> Result<(), FrameError> {
    if found == MAGIC {
        Ok(())
    } else {
        Err(FrameError::BadMagic { found })
    }
}

/// `frame` is a whole frame whose header [`FrameDecoder::header`] accepted.
fn verify_crc(header: Header, frame: &[u8]) -> Result<(), FrameError> {
    let (head, payload) = frame.split_at_checked(HEADER_LEN).unwrap_or_default();
    let crc_input = head.get(..12).unwrap_or_default();
    let computed = crc32c::crc32c_append(crc32c::crc32c(crc_input), payload);
    if computed == header.crc {
        Ok(())
    } else {
        Err(FrameError::ChecksumMismatch {
            kind: header.kind,
            expected: header.crc,
            computed,
        })
    }
}

/// Reads payload fields front to back, naming the field in every error. Fixed-size
/// fields are copied out of the payload; only byte strings that outlive the decode
/// (a `Data` payload, a source offset) share it as `Bytes`.
struct FieldReader {
    payload: Bytes,
    pos: usize,
    kind: MessageKind,
}

impl FieldReader {
    fn malformed(&self, field: &'static str, problem: FieldProblem) -> FrameError {
        FrameError::MalformedField {
            kind: self.kind,
            field,
            problem,
        }
    }

    fn remaining(&self) -> usize {
        self.payload.len() - self.pos
    }

    /// The next `len` bytes, or a truncation error naming `field`.
    fn take(&mut self, field: &'static str, len: usize) -> Result<&[u8], FrameError> {
        let start = self.pos;
        let Some(bytes) = self.payload.get(start..start.saturating_add(len)) else {
            return Err(self.malformed(
                field,
                FieldProblem::Truncated {
                    needed: len,
                    available: self.remaining(),
                },
            ));
        };
        self.pos += len;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], FrameError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(field, N)?);
        Ok(out)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, FrameError> {
        Ok(self.array::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    fn stream(&mut self) -> Result<StreamId, FrameError> {
        self.u64("stream").map(StreamId)
    }
    fn task(&mut self, field: &'static str) -> Result<TaskId, FrameError> {
        self.u32(field).map(TaskId)
    }
    fn node(&mut self, field: &'static str) -> Result<NodeId, FrameError> {
        self.u32(field).map(NodeId)
    }
    fn checkpoint(&mut self) -> Result<CheckpointId, FrameError> {
        self.u64("checkpoint").map(CheckpointId)
    }
    fn trans(&mut self) -> Result<TransId, FrameError> {
        self.u32("trans").map(TransId)
    }
    fn kind(&mut self) -> Result<CheckpointKind, FrameError> {
        let raw = self.u8("kind")?;
        CheckpointKind::from_wire(raw)
            .ok_or_else(|| self.malformed("kind", FieldProblem::InvalidTag(raw)))
    }
    fn tag(&mut self, field: &'static str, max: u8) -> Result<u8, FrameError> {
        let raw = self.u8(field)?;
        if raw > max {
            return Err(self.malformed(field, FieldProblem::InvalidTag(raw)));
        }
        Ok(raw)
    }
    fn short_len(&mut self, field: &'static str, max: usize) -> Result<usize, FrameError> {
        let len = usize::from(self.u16(field)?);
        if len > max {
            return Err(self.malformed(field, FieldProblem::TooLong { len, max }));
        }
        Ok(len)
    }
    fn text(&mut self, field: &'static str, max: usize) -> Result<String, FrameError> {
        let len = self.short_len(field, max)?;
        let kind = self.kind;
        match std::str::from_utf8(self.take(field, len)?) {
            Ok(text) => Ok(text.to_owned()),
            Err(_) => Err(FrameError::MalformedField {
                kind,
                field,
                problem: FieldProblem::InvalidUtf8,
            }),
        }
    }
    fn path(&mut self, field: &'static str) -> Result<RelativePath, FrameError> {
        let text = self.text(field, RelativePath::MAX_LEN)?;
        RelativePath::new(text)
            .map_err(|problem| self.malformed(field, FieldProblem::InvalidPath(problem)))
    }
    fn offset(&mut self) -> Result<Option<SourceOffset>, FrameError> {
        if self.tag("source_offset", 1)? == 0 {
            return Ok(None);
        }
        let len = self.short_len("source_offset", SourceOffset::MAX_LEN)?;
        self.take("source_offset", len)?;
        let bytes = self.payload.slice(self.pos - len..self.pos);
        // The length was checked against the same limit just above.
        Ok(SourceOffset::new(bytes).ok())
    }
    fn rest(&mut self) -> Bytes {
        let rest = self.payload.slice(self.pos..);
        self.pos = self.payload.len();
        rest
    }
    fn finish(self, message: Message) -> Result<Message, FrameError> {
        match self.remaining() {
            0 => Ok(message),
            count => Err(FrameError::TrailingBytes {
                kind: self.kind,
                count,
            }),
        }
    }
}

fn decode_payload(kind: MessageKind, payload: Bytes) -> Result<Message, FrameError> {
    let mut r = FieldReader {
        payload,
        pos: 0,
        kind,
    };
    let message = match kind {
        MessageKind::CheckpointSource => CheckpointSource {
            stream: r.stream()?,
            task: r.task("task")?,
            checkpoint: r.checkpoint()?,
            trans: r.trans()?,
            kind: r.kind()?,
        }
        .into(),
        MessageKind::CheckpointSourceRsp => CheckpointSourceRsp {
            stream: r.stream()?,
            task: r.task("task")?,
            node: r.node("node")?,
            checkpoint: r.checkpoint()?,
            trans: r.trans()?,
        }
        .into(),
        MessageKind::Barrier => Barrier {
            stream: r.stream()?,
            upstream: r.task("upstream")?,
            downstream: r.task("downstream")?,
            checkpoint: r.checkpoint()?,
            trans: r.trans()?,
            kind: r.kind()?,
        }
        .into(),
        MessageKind::BarrierAck => BarrierAck {
            stream: r.stream()?,
            upstream: r.task("upstream")?,
            downstream: r.task("downstream")?,
            checkpoint: r.checkpoint()?,
        }
        .into(),
        MessageKind::CheckpointReady => CheckpointReady {
            stream: r.stream()?,
            upstream: r.task("upstream")?,
            downstream: r.task("downstream")?,
            downstream_node: r.node("downstream_node")?,
            checkpoint: r.checkpoint()?,
            trans: r.trans()?,
        }
        .into(),
        MessageKind::CheckpointReadyAck => CheckpointReadyAck {
            stream: r.stream()?,
            upstream: r.task("upstream")?,
            downstream: r.task("downstream")?,
            checkpoint: r.checkpoint()?,
        }
        .into(),
        MessageKind::RetrieveBarrier => RetrieveBarrier {
            stream: r.stream()?,
            upstream: r.task("upstream")?,
            downstream: r.task("downstream")?,
            downstream_node: r.node("downstream_node")?,
            checkpoint: r.checkpoint()?,
        }
        .into(),
        MessageKind::RetrieveBarrierRsp => RetrieveBarrierRsp {
            stream: r.stream()?,
            upstream: r.task("upstream")?,
            downstream: r.task("downstream")?,
            checkpoint: r.checkpoint()?,
            answer: match r.tag("answer", 1)? {
                0 => RetrieveAnswer::NotYetSent,
                _ => RetrieveAnswer::AlreadySent {
                    trans: r.trans()?,
                    kind: r.kind()?,
                },
            },
        }
        .into(),
        MessageKind::CheckpointReport => CheckpointReport {
            stream: r.stream()?,
            task: r.task("task")?,
            node: r.node("node")?,
            checkpoint: r.checkpoint()?,
            trans: r.trans()?,
            outcome: match r.tag("outcome", 1)? {
                0 => ReportOutcome::Built(SnapshotReport {
                    manifest: r.path("manifest")?,
                    manifest_sha256: Sha256Digest(r.array("manifest_sha256")?),
                    state_bytes: r.u64("state_bytes")?,
                    uploaded_bytes: r.u64("uploaded_bytes")?,
                    files: r.u32("files")?,
                    uploaded_files: r.u32("uploaded_files")?,
                    alignment_micros: r.u64("alignment_micros")?,
                    sync_micros: r.u64("sync_micros")?,
                    async_micros: r.u64("async_micros")?,
                    source_offset: r.offset()?,
                }),
                _ => ReportOutcome::Failed {
                    reason: r.text("reason", MAX_TEXT_LEN)?,
                },
            },
        }
        .into(),
        MessageKind::CheckpointComplete => CheckpointComplete {
            stream: r.stream()?,
            task: r.task("task")?,
            checkpoint: r.checkpoint()?,
            trans: r.trans()?,
            completed_at_millis: r.u64("completed_at_millis")?,
            source_offset: r.offset()?,
        }
        .into(),
        MessageKind::CheckpointAbort => CheckpointAbort {
            stream: r.stream()?,
            task: r.task("task")?,
            checkpoint: r.checkpoint()?,
            trans: r.trans()?,
            reason: match r.tag("reason", 4)? {
                0 => AbortReason::Timeout,
                1 => AbortReason::TaskFailed(r.task("reason_task")?),
                2 => AbortReason::ConnectionLost(r.node("reason_node")?),
                3 => AbortReason::StoreFailed,
                _ => AbortReason::Cancelled,
            },
        }
        .into(),
        MessageKind::Data => {
            let stream = r.stream()?;
            let upstream = r.task("upstream")?;
            let downstream = r.task("downstream")?;
            let records = r.u32("records")?;
            let payload = r.rest();
            Data {
                stream,
                upstream,
                downstream,
                records,
                payload,
            }
            .into()
        }
        MessageKind::EndOfInput => EndOfInput {
            stream: r.stream()?,
            upstream: r.task("upstream")?,
            downstream: r.task("downstream")?,
        }
        .into(),
        MessageKind::Watermark => Watermark {
            stream: r.stream()?,
            upstream: r.task("upstream")?,
            downstream: r.task("downstream")?,
            time: i64::from_le_bytes(r.array("time")?),
            idle: r.tag("idle", 1)? == 1,
        }
        .into(),
    };
    r.finish(message)
}
