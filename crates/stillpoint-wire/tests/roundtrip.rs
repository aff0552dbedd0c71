//! Property tests: every message and manifest survives encode → decode unchanged,
//! whole or split at any byte, and decoding arbitrary bytes never panics.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use stillpoint_wire::*;

fn kind() -> impl Strategy<Value = CheckpointKind> {
    prop_oneof![
        Just(CheckpointKind::Checkpoint),
        Just(CheckpointKind::Savepoint)
    ]
}

fn offset() -> impl Strategy<Value = SourceOffset> {
    prop::collection::vec(any::<u8>(), 0..64).prop_map(|bytes| SourceOffset::new(bytes).unwrap())
}

fn path() -> impl Strategy<Value = RelativePath> {
    prop::collection::vec("[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,12}", 1..4)
        .prop_filter_map("`.`/`..` components", |parts| {
            RelativePath::new(parts.join("/")).ok()
        })
}

fn digest() -> impl Strategy<Value = Sha256Digest> {
    any::<[u8; 32]>().prop_map(Sha256Digest)
}

prop_compose! {
    fn snapshot_report()(
        manifest in path(),
        manifest_sha256 in digest(),
        state_bytes in any::<u64>(),
        uploaded_bytes in any::<u64>(),
        files in any::<u32>(),
        uploaded_files in any::<u32>(),
        alignment_micros in any::<u64>(),
        sync_micros in any::<u64>(),
        async_micros in any::<u64>(),
        source_offset in prop::option::of(offset()),
    ) -> SnapshotReport {
        SnapshotReport {
            manifest, manifest_sha256, state_bytes, uploaded_bytes, files, uploaded_files,
            alignment_micros, sync_micros, async_micros, source_offset,
        }
    }
}

fn abort_reason() -> impl Strategy<Value = AbortReason> {
    prop_oneof![
        Just(AbortReason::Timeout),
        any::<u32>().prop_map(|t| AbortReason::TaskFailed(TaskId(t))),
        any::<u32>().prop_map(|n| AbortReason::ConnectionLost(NodeId(n))),
        Just(AbortReason::StoreFailed),
        Just(AbortReason::Cancelled),
    ]
}

/// Every message kind, with arbitrary field values.
fn message() -> impl Strategy<Value = Message> {
    let s = any::<u64>().prop_map(StreamId);
    let t = || any::<u32>().prop_map(TaskId);
    let n = || any::<u32>().prop_map(NodeId);
    let c = || any::<u64>().prop_map(CheckpointId);
    let x = || any::<u32>().prop_map(TransId);
    prop_oneof![
        (s.clone(), t(), c(), x(), kind()).prop_map(|(stream, task, checkpoint, trans, kind)| {
            CheckpointSource {
                stream,
                task,
                checkpoint,
                trans,
                kind,
            }
            .into()
        }),
        (s.clone(), t(), n(), c(), x()).prop_map(|(stream, task, node, checkpoint, trans)| {
            CheckpointSourceRsp {
                stream,
                task,
                node,
                checkpoint,
                trans,
            }
            .into()
        }),
        (s.clone(), t(), t(), c(), x(), kind()).prop_map(
            |(stream, upstream, downstream, checkpoint, trans, kind)| {
                Barrier {
                    stream,
                    upstream,
                    downstream,
                    checkpoint,
                    trans,
                    kind,
                }
                .into()
            }
        ),
        (s.clone(), t(), t(), c()).prop_map(|(stream, upstream, downstream, checkpoint)| {
            BarrierAck {
                stream,
                upstream,
                downstream,
                checkpoint,
            }
            .into()
        }),
        (s.clone(), t(), t(), n(), c(), x()).prop_map(
            |(stream, upstream, downstream, downstream_node, checkpoint, trans)| {
                CheckpointReady {
                    stream,
                    upstream,
                    downstream,
                    downstream_node,
                    checkpoint,
                    trans,
                }
                .into()
            }
        ),
        (s.clone(), t(), t(), c()).prop_map(|(stream, upstream, downstream, checkpoint)| {
            CheckpointReadyAck {
                stream,
                upstream,
                downstream,
                checkpoint,
            }
            .into()
        }),
        (s.clone(), t(), t(), n(), c()).prop_map(
            |(stream, upstream, downstream, downstream_node, checkpoint)| {
                RetrieveBarrier {
                    stream,
                    upstream,
                    downstream,
                    downstream_node,
                    checkpoint,
                }
                .into()
            }
        ),
        (
            s.clone(),
            t(),
            t(),
            c(),
            prop_oneof![
                Just(RetrieveAnswer::NotYetSent),
                (x(), kind()).prop_map(|(trans, kind)| RetrieveAnswer::AlreadySent { trans, kind }),
            ]
        )
            .prop_map(|(stream, upstream, downstream, checkpoint, answer)| {
                RetrieveBarrierRsp {
                    stream,
                    upstream,
                    downstream,
                    checkpoint,
                    answer,
                }
                .into()
            }),
        (
            s.clone(),
            t(),
            n(),
            c(),
            x(),
            prop_oneof![
                snapshot_report().prop_map(ReportOutcome::Built),
                ".{0,80}".prop_map(|reason| ReportOutcome::Failed { reason }),
            ]
        )
            .prop_map(|(stream, task, node, checkpoint, trans, outcome)| {
                CheckpointReport {
                    stream,
                    task,
                    node,
                    checkpoint,
                    trans,
                    outcome,
                }
                .into()
            }),
        (
            s.clone(),
            t(),
            c(),
            x(),
            any::<u64>(),
            prop::option::of(offset())
        )
            .prop_map(
                |(stream, task, checkpoint, trans, completed_at_millis, source_offset)| {
                    CheckpointComplete {
                        stream,
                        task,
                        checkpoint,
                        trans,
                        completed_at_millis,
                        source_offset,
                    }
                    .into()
                }
            ),
        (s.clone(), t(), c(), x(), abort_reason()).prop_map(
            |(stream, task, checkpoint, trans, reason)| {
                CheckpointAbort {
                    stream,
                    task,
                    checkpoint,
                    trans,
                    reason,
                }
                .into()
            }
        ),
        (
            s,
            t(),
            t(),
            any::<u32>(),
            prop::collection::vec(any::<u8>(), 0..512)
        )
            .prop_map(|(stream, upstream, downstream, records, payload)| {
                Data {
                    stream,
                    upstream,
                    downstream,
                    records,
                    payload: Bytes::from(payload),
                }
                .into()
            }),
    ]
}

fn snapshot_manifest() -> impl Strategy<Value = SnapshotManifest> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        1..=32_768_u32,
        any::<(u32, u32)>(),
        "[a-z]{1,10}",
        "[0-9.]{1,8}",
        prop::collection::btree_map("[a-z_]{1,8}", ".{0,12}", 0..3),
        prop::collection::btree_map(path(), (any::<u64>(), digest(), any::<bool>()), 0..8),
    )
        .prop_map(
            |(stream, task, checkpoint, max, (a, b), kind, version, options, files)| {
                let (start, end) = (a % (max + 1), b % (max + 1));
                // Some files are changelog segments: those not shared, in path order.
                let changelog = files
                    .iter()
                    .filter(|(_, (_, _, shared))| !*shared)
                    .map(|(path, _)| path.clone())
                    .collect();
                SnapshotManifest {
                    stream: StreamId(stream),
                    task: TaskId(task),
                    checkpoint: CheckpointId(checkpoint),
                    max_parallelism: max,
                    key_groups: KeyGroupRange {
                        start: start.min(end),
                        end: start.max(end),
                    },
                    backend: BackendInfo {
                        kind,
                        version,
                        options,
                    },
                    files: files
                        .into_iter()
                        .map(|(path, (size, sha256, shared))| SnapshotFile {
                            path,
                            size,
                            sha256,
                            shared,
                        })
                        .collect(),
                    changelog,
                }
            },
        )
}

fn checkpoint_manifest() -> impl Strategy<Value = CheckpointManifest> {
    (
        any::<(u64, u64, u32, u64)>(),
        kind(),
        1..=32_768_u32,
        prop::collection::btree_map(
            any::<u32>(),
            (any::<u32>(), path(), digest(), any::<u64>()),
            0..8,
        ),
        prop::collection::vec((any::<bool>(), offset()), 0..8),
    )
        .prop_map(
            |((stream, checkpoint, trans, created), kind, max, tasks, offsets)| {
                let tasks: Vec<TaskSnapshotRef> = tasks
                    .into_iter()
                    .map(
                        |(task, (node, manifest, sha256, state_bytes))| TaskSnapshotRef {
                            task: TaskId(task),
                            node: NodeId(node),
                            manifest,
                            sha256,
                            state_bytes,
                        },
                    )
                    .collect();
                // Sources are a subset of the tasks, each at most once.
                let sources = tasks
                    .iter()
                    .zip(offsets)
                    .filter(|(_, (is_source, _))| *is_source)
                    .map(|(task, (_, offset))| SourcePosition {
                        task: task.task,
                        offset,
                    })
                    .collect();
                CheckpointManifest {
                    stream: StreamId(stream),
                    checkpoint: CheckpointId(checkpoint),
                    trans: TransId(trans),
                    kind,
                    created_at_millis: created,
                    max_parallelism: max,
                    tasks,
                    sources,
                    stages: Vec::new(),
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_message_round_trips(message in message()) {
        let frame = encode_to_bytes(&message).unwrap();
        prop_assert_eq!(frame.len(), HEADER_LEN + u32::from_le_bytes(frame[8..12].try_into().unwrap()) as usize);
        let decoder = FrameDecoder::default();
        prop_assert_eq!(decoder.decode_exact(frame.clone()).unwrap(), message.clone());
        let mut buf = BytesMut::from(&frame[..]);
        prop_assert_eq!(decoder.decode(&mut buf).unwrap(), Some(message));
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn a_stream_split_anywhere_decodes_the_same(
        messages in prop::collection::vec(message(), 1..6),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let mut wire = BytesMut::new();
        for message in &messages {
            encode(message, &mut wire).unwrap();
        }
        let wire = wire.freeze();
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
        cuts.push(wire.len());
        cuts.sort_unstable();

        let decoder = FrameDecoder::default();
        let mut buf = BytesMut::new();
        let mut decoded = Vec::new();
        let mut from = 0;
        for cut in cuts {
            buf.extend_from_slice(&wire[from..cut]);
            from = cut;
            while let Some(message) = decoder.decode(&mut buf).unwrap() {
                decoded.push(message);
            }
            prop_assert!(decoder.bytes_needed(&buf) > 0 || buf.is_empty());
        }
        decoder.finish(&buf).unwrap();
        prop_assert_eq!(decoded, messages);
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_never_ask_past_the_limit(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let decoder = FrameDecoder::new(1024);
        prop_assert!(decoder.bytes_needed(&bytes) <= HEADER_LEN + 1024);
        let mut buf = BytesMut::from(&bytes[..]);
        while let Ok(Some(_)) = decoder.decode(&mut buf) {}
        let _ = decoder.decode_exact(Bytes::from(bytes));
    }

    #[test]
    fn snapshot_manifests_round_trip(manifest in snapshot_manifest()) {
        let bytes = manifest.to_bytes().unwrap();
        prop_assert_eq!(SnapshotManifest::parse(&bytes).unwrap(), manifest);
    }

    #[test]
    fn checkpoint_manifests_round_trip(manifest in checkpoint_manifest()) {
        let bytes = manifest.to_bytes().unwrap();
        prop_assert_eq!(CheckpointManifest::parse(&bytes).unwrap(), manifest);
    }

    #[test]
    fn any_single_byte_flip_in_a_manifest_is_caught(manifest in snapshot_manifest(), at in any::<prop::sample::Index>(), bit in 0..8_u8) {
        let mut bytes = manifest.to_bytes().unwrap();
        let at = at.index(bytes.len());
        bytes[at] ^= 1 << bit;
        // The envelope has no insignificant whitespace and the body is checksummed
        // byte for byte, so no single-bit change goes unnoticed.
        prop_assert!(SnapshotManifest::parse(&bytes).is_err(), "flip at {} accepted", at);
    }
}

#[test]
fn data_payload_shares_the_receive_buffer() {
    let payload = Bytes::from(vec![7_u8; 4096]);
    let message = Message::Data(Data {
        stream: StreamId(1),
        upstream: TaskId(2),
        downstream: TaskId(3),
        records: 64,
        payload,
    });
    let mut buf = BytesMut::new();
    encode(&message, &mut buf).unwrap();
    let received = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
    let Some(Message::Data(data)) = FrameDecoder::default().decode(&mut buf).unwrap() else {
        panic!("expected data");
    };
    assert!(
        received.contains(&(data.payload.as_ptr() as usize)),
        "payload was copied"
    );
    assert_eq!(data.payload.len(), 4096);
}
