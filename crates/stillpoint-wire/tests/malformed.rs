//! Malformed input, table-driven: each frame or manifest with the exact error expected.
//!
//! Frames are built here by hand from `docs/wire-format.md` (not with the crate's
//! encoder), so these tests also pin the byte layout.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use bytes::{Bytes, BytesMut};
use stillpoint_wire::*;

const STREAM: [u8; 8] = 1_u64.to_le_bytes();
const TASK_A: [u8; 4] = 2_u32.to_le_bytes();
const TASK_B: [u8; 4] = 3_u32.to_le_bytes();
const NODE: [u8; 4] = 4_u32.to_le_bytes();
const CKPT: [u8; 8] = 5_u64.to_le_bytes();
const TRANS: [u8; 4] = 6_u32.to_le_bytes();

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// A frame with a correct checksum around `payload`, with header fields as given.
fn frame_with(magic: &[u8; 4], version: u8, kind: u8, flags: u16, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(magic);
    frame.push(version);
    frame.push(kind);
    frame.extend_from_slice(&flags.to_le_bytes());
    frame.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&frame), payload);
    frame.extend_from_slice(&crc.to_le_bytes());
    frame.extend_from_slice(payload);
    frame
}

fn frame(kind: MessageKind, payload: &[u8]) -> Vec<u8> {
    frame_with(b"SPNT", 1, kind.code(), 0, payload)
}

fn barrier_payload() -> Vec<u8> {
    cat(&[&STREAM, &TASK_A, &TASK_B, &CKPT, &TRANS, &[0]])
}

fn report_prefix() -> Vec<u8> {
    cat(&[&STREAM, &TASK_A, &NODE, &CKPT, &TRANS])
}

fn built_report(path: &[u8], path_len: u16) -> Vec<u8> {
    cat(&[
        &report_prefix(),
        &[0],
        &path_len.to_le_bytes(),
        path,
        &[0xaa; 32],
        &[0; 8 + 8 + 4 + 4 + 8 + 8 + 8],
        &[0],
    ])
}

/// `(name, decoder, input, expected)`.
type FrameCase = (
    &'static str,
    FrameDecoder,
    Vec<u8>,
    Result<Message, FrameError>,
);

fn malformed(kind: MessageKind, field: &'static str, problem: FieldProblem) -> FrameError {
    FrameError::MalformedField {
        kind,
        field,
        problem,
    }
}

fn check(name: &str, decoder: FrameDecoder, input: Vec<u8>, expected: Result<Message, FrameError>) {
    let actual = decoder.decode_exact(Bytes::from(input));
    assert_eq!(actual, expected, "case {name:?}");
}

#[test]
fn malformed_frames_give_exact_errors() {
    use FieldProblem::*;
    use MessageKind as K;

    let good = frame(K::Barrier, &barrier_payload());
    let good_crc = u32::from_le_bytes(good[12..16].try_into().unwrap());
    let mut flipped = good.clone();
    *flipped.last_mut().unwrap() ^= 0x01;
    let flipped_crc = crc32c::crc32c_append(crc32c::crc32c(&flipped[..12]), &flipped[16..]);
    let d = FrameDecoder::default();
    let small = FrameDecoder::new(1024);

    let barrier = Message::Barrier(Barrier {
        stream: StreamId(1),
        upstream: TaskId(2),
        downstream: TaskId(3),
        checkpoint: CheckpointId(5),
        trans: TransId(6),
        kind: CheckpointKind::Checkpoint,
    });
    #[rustfmt::skip]
    let cases: Vec<FrameCase> = vec![
        ("well-formed barrier", d, good.clone(), Ok(barrier)),
        ("empty input", d, vec![], Err(FrameError::Truncated { needed: 16, available: 0 })),
        ("header cut short", d, good[..10].to_vec(), Err(FrameError::Truncated { needed: 16, available: 10 })),
        ("payload cut short", d, good[..30].to_vec(), Err(FrameError::Truncated { needed: 16 + 29, available: 30 })),
        ("bad magic", d, frame_with(b"HTTP", 1, 3, 0, &barrier_payload()), Err(FrameError::BadMagic { found: *b"HTTP" })),
        ("future version", d, frame_with(b"SPNT", 2, 3, 0, &barrier_payload()), Err(FrameError::UnsupportedVersion { found: 2, supported: 1 })),
        ("version zero", d, frame_with(b"SPNT", 0, 3, 0, &barrier_payload()), Err(FrameError::UnsupportedVersion { found: 0, supported: 1 })),
        ("kind zero", d, frame_with(b"SPNT", 1, 0, 0, &[]), Err(FrameError::UnknownKind { found: 0 })),
        ("kind past the last", d, frame_with(b"SPNT", 1, 15, 0, &[]), Err(FrameError::UnknownKind { found: 15 })),
        ("kind 255", d, frame_with(b"SPNT", 1, 255, 0, &[]), Err(FrameError::UnknownKind { found: 255 })),
        ("undefined flag", d, frame_with(b"SPNT", 1, 3, 0x8000, &barrier_payload()), Err(FrameError::UnsupportedFlags { kind: K::Barrier, flags: 0x8000 })),
        ("length over configured max", small, frame(K::Data, &[0; 1025]), Err(FrameError::FrameTooLarge { kind: K::Data, length: 1025, max: 1024 })),
        ("header claims 4 GiB", d, cat(&[b"SPNT", &[1, 12, 0, 0], &u32::MAX.to_le_bytes(), &[0; 4]]), Err(FrameError::FrameTooLarge { kind: K::Data, length: u32::MAX, max: DEFAULT_MAX_PAYLOAD_LEN })),
        ("payload bit flipped", d, flipped, Err(FrameError::ChecksumMismatch { kind: K::Barrier, expected: good_crc, computed: flipped_crc })),
        ("checkpoint kind 2", d, frame(K::Barrier, &cat(&[&STREAM, &TASK_A, &TASK_B, &CKPT, &TRANS, &[2]])), Err(malformed(K::Barrier, "kind", InvalidTag(2)))),
        ("source request missing kind", d, frame(K::CheckpointSource, &cat(&[&STREAM, &TASK_A, &CKPT, &TRANS])), Err(malformed(K::CheckpointSource, "kind", Truncated { needed: 1, available: 0 }))),
        ("empty barrier ack", d, frame(K::BarrierAck, &[]), Err(malformed(K::BarrierAck, "stream", Truncated { needed: 8, available: 0 }))),
        ("ack with trailing byte", d, frame(K::BarrierAck, &cat(&[&STREAM, &TASK_A, &TASK_B, &CKPT, &[9]])), Err(FrameError::TrailingBytes { kind: K::BarrierAck, count: 1 })),
        ("frame followed by garbage", d, cat(&[&good, &[0, 0, 0]]), Err(FrameError::TrailingBytes { kind: K::Barrier, count: 3 })),
        ("retrieve answer tag 2", d, frame(K::RetrieveBarrierRsp, &cat(&[&STREAM, &TASK_A, &TASK_B, &CKPT, &[2]])), Err(malformed(K::RetrieveBarrierRsp, "answer", InvalidTag(2)))),
        ("retrieve already-sent without trans", d, frame(K::RetrieveBarrierRsp, &cat(&[&STREAM, &TASK_A, &TASK_B, &CKPT, &[1]])), Err(malformed(K::RetrieveBarrierRsp, "trans", Truncated { needed: 4, available: 0 }))),
        ("report outcome tag 7", d, frame(K::CheckpointReport, &cat(&[&report_prefix(), &[7]])), Err(malformed(K::CheckpointReport, "outcome", InvalidTag(7)))),
        ("failure reason not UTF-8", d, frame(K::CheckpointReport, &cat(&[&report_prefix(), &[1], &2_u16.to_le_bytes(), &[0xc3, 0x28]])), Err(malformed(K::CheckpointReport, "reason", InvalidUtf8))),
        ("failure reason longer than payload", d, frame(K::CheckpointReport, &cat(&[&report_prefix(), &[1], &100_u16.to_le_bytes(), b"disk"])), Err(malformed(K::CheckpointReport, "reason", Truncated { needed: 100, available: 4 }))),
        ("manifest path with ..", d, frame(K::CheckpointReport, &built_report(b"../../etc/passwd", 16)), Err(malformed(K::CheckpointReport, "manifest", InvalidPath(PathProblem::ParentComponent)))),
        ("absolute manifest path", d, frame(K::CheckpointReport, &built_report(b"/etc/passwd", 11)), Err(malformed(K::CheckpointReport, "manifest", InvalidPath(PathProblem::Absolute)))),
        ("empty manifest path", d, frame(K::CheckpointReport, &built_report(b"", 0)), Err(malformed(K::CheckpointReport, "manifest", InvalidPath(PathProblem::Empty)))),
        ("manifest path over its limit", d, frame(K::CheckpointReport, &built_report(&[b'a'; 2000], 2000)), Err(malformed(K::CheckpointReport, "manifest", TooLong { len: 2000, max: 1024 }))),
        ("offset tag 3", d, frame(K::CheckpointComplete, &cat(&[&STREAM, &TASK_A, &CKPT, &TRANS, &[0; 8], &[3]])), Err(malformed(K::CheckpointComplete, "source_offset", InvalidTag(3)))),
        ("offset over 4096 bytes", d, frame(K::CheckpointComplete, &cat(&[&STREAM, &TASK_A, &CKPT, &TRANS, &[0; 8], &[1], &5000_u16.to_le_bytes(), &[0; 5000]])), Err(malformed(K::CheckpointComplete, "source_offset", TooLong { len: 5000, max: 4096 }))),
        ("abort reason tag 9", d, frame(K::CheckpointAbort, &cat(&[&STREAM, &TASK_A, &CKPT, &TRANS, &[9]])), Err(malformed(K::CheckpointAbort, "reason", InvalidTag(9)))),
        ("abort for failed task without its id", d, frame(K::CheckpointAbort, &cat(&[&STREAM, &TASK_A, &CKPT, &TRANS, &[1], &[0, 0]])), Err(malformed(K::CheckpointAbort, "reason_task", Truncated { needed: 4, available: 2 }))),
        ("data shorter than its fixed fields", d, frame(K::Data, &cat(&[&STREAM, &TASK_A, &TASK_B, &[1, 0]])), Err(malformed(K::Data, "records", Truncated { needed: 4, available: 2 }))),
    ];
    for (name, decoder, input, expected) in cases {
        check(name, decoder, input, expected);
    }
}

#[test]
fn incremental_decoder_waits_for_bytes_then_fails_early() {
    let decoder = FrameDecoder::new(1024);

    // Fewer than four bytes: nothing to judge yet.
    let mut buf = BytesMut::from(&b"SP"[..]);
    assert_eq!(decoder.decode(&mut buf), Ok(None));
    assert_eq!(decoder.bytes_needed(&buf), 14);

    // A wrong magic is refused as soon as four bytes are there.
    let mut buf = BytesMut::from(&b"GET "[..]);
    assert_eq!(
        decoder.decode(&mut buf),
        Err(FrameError::BadMagic { found: *b"GET " })
    );

    // A header claiming 4 GiB is refused before any payload arrives, and nothing asks
    // the caller to read more than the configured maximum.
    let huge = cat(&[b"SPNT", &[1, 12, 0, 0], &u32::MAX.to_le_bytes(), &[0; 4]]);
    let mut buf = BytesMut::from(&huge[..]);
    let err = FrameError::FrameTooLarge {
        kind: MessageKind::Data,
        length: u32::MAX,
        max: 1024,
    };
    assert_eq!(decoder.decode(&mut buf), Err(err.clone()));
    assert_eq!(decoder.bytes_needed(&buf), 0);
    assert_eq!(decoder.finish(&buf), Err(err));
    assert_eq!(buf.len(), 16, "a header error consumes nothing");

    // A complete header with a short payload: wait, and say exactly how much is missing.
    let good = frame(MessageKind::Barrier, &barrier_payload());
    let mut buf = BytesMut::from(&good[..20]);
    assert_eq!(decoder.decode(&mut buf), Ok(None));
    assert_eq!(decoder.bytes_needed(&buf), good.len() - 20);
    assert_eq!(
        decoder.finish(&buf),
        Err(FrameError::Truncated {
            needed: good.len(),
            available: 20
        })
    );
    buf.extend_from_slice(&good[20..]);
    assert!(matches!(
        decoder.decode(&mut buf),
        Ok(Some(Message::Barrier(_)))
    ));
    assert_eq!(decoder.finish(&buf), Ok(()));
}

#[test]
fn encoder_refuses_what_a_frame_cannot_carry() {
    let long_reason = Message::CheckpointReport(CheckpointReport {
        stream: StreamId(1),
        task: TaskId(1),
        node: NodeId(1),
        checkpoint: CheckpointId(1),
        trans: TransId(1),
        outcome: ReportOutcome::Failed {
            reason: "x".repeat(70_000),
        },
    });
    let mut buf = BytesMut::new();
    assert_eq!(
        encode(&long_reason, &mut buf),
        Err(EncodeError::FieldTooLong {
            kind: MessageKind::CheckpointReport,
            field: "reason",
            len: 70_000,
            max: MAX_TEXT_LEN
        })
    );
    assert!(buf.is_empty(), "nothing written on error");

    let data = Message::Data(Data {
        stream: StreamId(1),
        upstream: TaskId(1),
        downstream: TaskId(2),
        records: 1,
        payload: Bytes::from(vec![0; 2000]),
    });
    assert_eq!(
        encode_with_limit(&data, &mut buf, 1024),
        Err(EncodeError::FrameTooLarge {
            kind: MessageKind::Data,
            length: 2020,
            max: 1024
        })
    );
    let mut fixed = [0_u8; 32];
    assert_eq!(
        encode(&data, &mut &mut fixed[..]),
        Err(EncodeError::BufferTooSmall {
            needed: 2036,
            available: 32
        })
    );
    assert_eq!(fixed, [0; 32], "nothing written on error");
}

// ---------------------------------------------------------------------------------------
// Manifests

fn seal(format: &str, version: u32, body: &str) -> Vec<u8> {
    let sha = Sha256Digest::of(body.as_bytes());
    format!(r#"{{"format":"{format}","version":{version},"sha256":"{sha}","body":{body}}}"#)
        .into_bytes()
}

const SNAP: &str = "stillpoint/snapshot-manifest";
const CKPT_FORMAT: &str = "stillpoint/checkpoint-manifest";
const DIGEST: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

fn snapshot_body(files: &str, key_groups: &str) -> String {
    format!(
        r#"{{"stream":1,"task":2,"checkpoint":3,"max_parallelism":128,"key_groups":{key_groups},"backend":{{"kind":"rocksdb","version":"10.2"}},"files":[{files}]}}"#
    )
}

fn with_changelog(body: &str, segments: &str) -> String {
    format!(r#"{},"changelog":[{segments}]}}"#, &body[..body.len() - 1])
}

fn file(path: &str) -> String {
    format!(r#"{{"path":"{path}","size":10,"sha256":"{DIGEST}","shared":false}}"#)
}

fn checkpoint_body(tasks: &str, sources: &str) -> String {
    format!(
        r#"{{"stream":1,"checkpoint":3,"trans":4,"kind":"checkpoint","created_at_millis":5,"max_parallelism":128,"tasks":[{tasks}],"sources":[{sources}]}}"#
    )
}

/// `body` with the dataflow's stages recorded.
fn with_stages(body: &str, stages: &str) -> String {
    let open = body.strip_suffix('}').unwrap();
    format!(r#"{open},"stages":{stages}}}"#)
}

fn task_ref(task: u32, manifest: &str) -> String {
    format!(
        r#"{{"task":{task},"node":1,"manifest":"{manifest}","sha256":"{DIGEST}","state_bytes":10}}"#
    )
}

/// The 1-based column serde_json reports for an error in the value ending with `needle`.
fn column_after(body: &str, needle: &str) -> usize {
    body.find(needle).unwrap() + needle.len()
}

fn check_snapshot(name: &str, input: Vec<u8>, expected: Result<(), ManifestError>) {
    assert_eq!(
        SnapshotManifest::parse(&input).map(|_| ()),
        expected,
        "case {name:?}"
    );
}

fn check_checkpoint(name: &str, input: Vec<u8>, expected: Result<(), ManifestError>) {
    assert_eq!(
        CheckpointManifest::parse(&input).map(|_| ()),
        expected,
        "case {name:?}"
    );
}

fn bad_path(field: &str, path: &str, problem: PathProblem) -> Result<(), ManifestError> {
    Err(ManifestError::InvalidPath {
        field: field.into(),
        path: path.into(),
        problem,
    })
}

#[test]
fn malformed_snapshot_manifests_give_exact_errors() {
    let kg = r#"{"start":0,"end":64}"#;
    let good_body = snapshot_body(&file("000012.sst"), kg);
    let mut tampered = seal(SNAP, 1, &good_body);
    let at = tampered.len() - 30;
    tampered[at] = b'9';
    let tampered_body_digest = {
        let text = String::from_utf8(tampered.clone()).unwrap();
        let body = &text[text.find(r#""body":"#).unwrap() + 7..text.len() - 1];
        Sha256Digest::of(body.as_bytes())
    };

    let short_digest = snapshot_body(&file("a.sst").replace(DIGEST, "abc"), kg);

    #[rustfmt::skip]
    let cases: Vec<(&str, Vec<u8>, Result<(), ManifestError>)> = vec![
        ("well-formed", seal(SNAP, 1, &good_body), Ok(())),
        ("not JSON", b"SPNT\x01".to_vec(), Err(ManifestError::Malformed { part: "envelope", line: 1, column: 1, message: "expected value".into() })),
        ("empty", vec![], Err(ManifestError::Malformed { part: "envelope", line: 1, column: 0, message: "EOF while parsing a value".into() })),
        ("envelope field missing", br#"{"format":"stillpoint/snapshot-manifest","version":1,"body":{}}"#.to_vec(), Err(ManifestError::Malformed { part: "envelope", line: 1, column: 63, message: "missing field `sha256`".into() })),
        ("checkpoint manifest given", seal(CKPT_FORMAT, 1, &good_body), Err(ManifestError::WrongFormat { expected: SNAP, found: CKPT_FORMAT.into() })),
        ("future version", seal(SNAP, 2, &good_body), Err(ManifestError::UnsupportedVersion { found: 2, supported: 1 })),
        ("checksum not hex", format!(r#"{{"format":"{SNAP}","version":1,"sha256":"xyz","body":{good_body}}}"#).into_bytes(), Err(ManifestError::InvalidChecksum(DigestParseError::WrongLength(3)))),
        ("body changed after sealing", tampered, Err(ManifestError::ChecksumMismatch { expected: Sha256Digest::of(good_body.as_bytes()), computed: tampered_body_digest })),
        ("unknown body field", seal(SNAP, 1, &good_body.replacen('{', r#"{"extra":1,"#, 1)), Err(ManifestError::Malformed { part: "body", line: 1, column: 8, message: "unknown field `extra`, expected one of `stream`, `task`, `checkpoint`, `max_parallelism`, `key_groups`, `backend`, `files`, `changelog`".into() })),
        ("file digest too short", seal(SNAP, 1, &short_digest), Err(ManifestError::Malformed { part: "body", line: 1, column: column_after(&short_digest, r#""abc""#), message: "a SHA-256 digest is 64 hex characters, found 3".into() })),
        ("parent path", seal(SNAP, 1, &snapshot_body(&format!("{},{}", file("a.sst"), file("../../etc/cron.d/x")), kg)), bad_path("files[1].path", "../../etc/cron.d/x", PathProblem::ParentComponent)),
        ("absolute path", seal(SNAP, 1, &snapshot_body(&file("/etc/passwd"), kg)), bad_path("files[0].path", "/etc/passwd", PathProblem::Absolute)),
        ("path with backslash", seal(SNAP, 1, &snapshot_body(&file(r"..\\x"), kg)), bad_path("files[0].path", r"..\x", PathProblem::Backslash)),
        ("drive path", seal(SNAP, 1, &snapshot_body(&file("C:/x"), kg)), bad_path("files[0].path", "C:/x", PathProblem::DrivePrefix)),
        ("file listed twice", seal(SNAP, 1, &snapshot_body(&format!("{},{}", file("a.sst"), file("a.sst")), kg)), Err(ManifestError::DuplicatePath(RelativePath::new("a.sst").unwrap()))),
        ("changelog segment that is a file", seal(SNAP, 1, &with_changelog(&snapshot_body(&format!("{},{}", file("a.sst"), file("changelog-1.seg")), kg), r#""changelog-1.seg""#)), Ok(())),
        ("changelog segment not among the files", seal(SNAP, 1, &with_changelog(&good_body, r#""changelog-1.seg""#)), Err(ManifestError::BadChangelog(RelativePath::new("changelog-1.seg").unwrap()))),
        ("changelog segment listed twice", seal(SNAP, 1, &with_changelog(&snapshot_body(&file("changelog-1.seg"), kg), r#""changelog-1.seg","changelog-1.seg""#)), Err(ManifestError::BadChangelog(RelativePath::new("changelog-1.seg").unwrap()))),
        ("changelog segment outside the snapshot", seal(SNAP, 1, &with_changelog(&good_body, r#""../x.seg""#)), bad_path("changelog[0]", "../x.seg", PathProblem::ParentComponent)),
        ("reversed key groups", seal(SNAP, 1, &snapshot_body(&file("a.sst"), r#"{"start":9,"end":3}"#)), Err(ManifestError::InvalidKeyGroups { start: 9, end: 3, max_parallelism: 128 })),
        ("key groups past max parallelism", seal(SNAP, 1, &snapshot_body(&file("a.sst"), r#"{"start":0,"end":129}"#)), Err(ManifestError::InvalidKeyGroups { start: 0, end: 129, max_parallelism: 128 })),
        ("over the size limit", vec![b' '; MAX_MANIFEST_LEN + 1], Err(ManifestError::TooLarge { len: MAX_MANIFEST_LEN + 1, max: MAX_MANIFEST_LEN })),
    ];
    for (name, input, expected) in cases {
        check_snapshot(name, input, expected);
    }
}

#[test]
fn malformed_checkpoint_manifests_give_exact_errors() {
    let t1 = task_ref(1, "tasks/1/ckpt-3.manifest");
    let t2 = task_ref(2, "tasks/2/ckpt-3.manifest");
    let tasks = format!("{t1},{t2}");
    let not_hex = checkpoint_body(&tasks, r#"{"task":1,"offset":"zz"}"#);
    #[rustfmt::skip]
    let cases: Vec<(&str, Vec<u8>, Result<(), ManifestError>)> = vec![
        ("well-formed", seal(CKPT_FORMAT, 1, &checkpoint_body(&tasks, r#"{"task":1,"offset":"0a00000000000000"}"#)), Ok(())),
        ("snapshot manifest given", seal(SNAP, 1, &checkpoint_body(&tasks, "")), Err(ManifestError::WrongFormat { expected: CKPT_FORMAT, found: SNAP.into() })),
        ("task manifest path escapes", seal(CKPT_FORMAT, 1, &checkpoint_body(&format!("{t1},{}", task_ref(2, "tasks/../../x")), "")), bad_path("tasks[1].manifest", "tasks/../../x", PathProblem::ParentComponent)),
        ("task listed twice", seal(CKPT_FORMAT, 1, &checkpoint_body(&format!("{t1},{t1}"), "")), Err(ManifestError::DuplicateTask(TaskId(1)))),
        ("source offset twice", seal(CKPT_FORMAT, 1, &checkpoint_body(&tasks, r#"{"task":1,"offset":""},{"task":1,"offset":"00"}"#)), Err(ManifestError::DuplicateSource(TaskId(1)))),
        ("offset for unknown task", seal(CKPT_FORMAT, 1, &checkpoint_body(&tasks, r#"{"task":7,"offset":"00"}"#)), Err(ManifestError::UnknownSource(TaskId(7)))),
        ("offset not hex", seal(CKPT_FORMAT, 1, &not_hex), Err(ManifestError::Malformed { part: "body", line: 1, column: column_after(&not_hex, r#""zz"}"#), message: "invalid hex character 'z' at index 0".into() })),
        ("unknown checkpoint kind", seal(CKPT_FORMAT, 1, &checkpoint_body(&tasks, "").replace(r#""checkpoint","#, r#""snapshot","#)), Err(ManifestError::Malformed { part: "body", line: 1, column: 54, message: "unknown variant `snapshot`, expected `checkpoint` or `savepoint`".into() })),
        ("zero max parallelism", seal(CKPT_FORMAT, 1, &checkpoint_body(&tasks, "").replace(r#""max_parallelism":128"#, r#""max_parallelism":0"#)), Err(ManifestError::InvalidKeyGroups { start: 0, end: 0, max_parallelism: 0 })),
        ("stages recorded", seal(CKPT_FORMAT, 1, &with_stages(&checkpoint_body(&tasks, ""), "[1,1]")), Ok(())),
        ("task beyond the stages", seal(CKPT_FORMAT, 1, &with_stages(&checkpoint_body(&tasks, ""), "[1]")), Err(ManifestError::OutsideStages { task: TaskId(2), stages: vec![1], total: 1 })),
        ("empty stage", seal(CKPT_FORMAT, 1, &with_stages(&checkpoint_body(&tasks, ""), "[2,0]")), Err(ManifestError::OutsideStages { task: TaskId(0), stages: vec![2, 0], total: 2 })),
    ];
    for (name, input, expected) in cases {
        check_checkpoint(name, input, expected);
    }
}
