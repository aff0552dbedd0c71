//! A checkpoint message exchange on a three-task dataflow, encoded, sent as one byte
//! stream through the incremental decoder, and printed with each frame's bytes.
//!
//! `source (task 1) → aggregate (task 2) → sink (task 3)`, one coordinator:
//! checkpoint 1 completes; checkpoint 2 times out while the aggregate waits for a
//! barrier and is aborted.
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use bytes::{Bytes, BytesMut};
use stillpoint_wire::*;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let stream = StreamId(1);
    let (source, aggregate, sink) = (TaskId(1), TaskId(2), TaskId(3));
    let node = NodeId(1);
    let trans = TransId(1);
    let ckpt = CheckpointId(1);
    let built = |task: u32, state_bytes, uploaded_bytes, offset: Option<u64>| {
        ReportOutcome::Built(SnapshotReport {
            manifest: RelativePath::new(format!("tasks/task-{task}/ckpt-1.manifest")).unwrap(),
            manifest_sha256: Sha256Digest::of(format!("manifest of task {task}").as_bytes()),
            state_bytes,
            uploaded_bytes,
            files: 4,
            uploaded_files: 1,
            alignment_micros: 120,
            sync_micros: 35,
            async_micros: 8_400,
            source_offset: offset.map(SourceOffset::from_u64),
        })
    };
    let complete = |task, offset: Option<u64>| CheckpointComplete {
        stream,
        task,
        checkpoint: ckpt,
        trans,
        completed_at_millis: 1_764_633_600_000,
        source_offset: offset.map(SourceOffset::from_u64),
    };

    let exchange: Vec<(&str, &str, Message)> = vec![
        (
            "coordinator",
            "task-1",
            CheckpointSource {
                stream,
                task: source,
                checkpoint: ckpt,
                trans,
                kind: CheckpointKind::Checkpoint,
            }
            .into(),
        ),
        (
            "task-1",
            "task-2",
            Data {
                stream,
                upstream: source,
                downstream: aggregate,
                records: 2,
                payload: Bytes::from_static(b"the\nquick\n"),
            }
            .into(),
        ),
        (
            "task-1",
            "task-2",
            Watermark {
                stream,
                upstream: source,
                downstream: aggregate,
                time: 1_000,
                idle: false,
            }
            .into(),
        ),
        (
            "task-1",
            "task-2",
            EndOfInput {
                stream,
                upstream: source,
                downstream: aggregate,
            }
            .into(),
        ),
        (
            "task-1",
            "task-2",
            Barrier {
                stream,
                upstream: source,
                downstream: aggregate,
                checkpoint: ckpt,
                trans,
                kind: CheckpointKind::Checkpoint,
            }
            .into(),
        ),
        (
            "task-2",
            "task-1",
            BarrierAck {
                stream,
                upstream: source,
                downstream: aggregate,
                checkpoint: ckpt,
            }
            .into(),
        ),
        (
            "task-2",
            "task-3",
            Barrier {
                stream,
                upstream: aggregate,
                downstream: sink,
                checkpoint: ckpt,
                trans,
                kind: CheckpointKind::Checkpoint,
            }
            .into(),
        ),
        (
            "task-3",
            "task-2",
            BarrierAck {
                stream,
                upstream: aggregate,
                downstream: sink,
                checkpoint: ckpt,
            }
            .into(),
        ),
        (
            "task-3",
            "coordinator",
            CheckpointReport {
                stream,
                task: sink,
                node,
                checkpoint: ckpt,
                trans,
                outcome: built(3, 4_096, 4_096, None),
            }
            .into(),
        ),
        (
            "task-3",
            "task-2",
            CheckpointReady {
                stream,
                upstream: aggregate,
                downstream: sink,
                downstream_node: node,
                checkpoint: ckpt,
                trans,
            }
            .into(),
        ),
        (
            "task-2",
            "task-3",
            CheckpointReadyAck {
                stream,
                upstream: aggregate,
                downstream: sink,
                checkpoint: ckpt,
            }
            .into(),
        ),
        (
            "task-2",
            "coordinator",
            CheckpointReport {
                stream,
                task: aggregate,
                node,
                checkpoint: ckpt,
                trans,
                outcome: built(2, 1 << 30, 10 << 20, None),
            }
            .into(),
        ),
        (
            "task-2",
            "task-1",
            CheckpointReady {
                stream,
                upstream: source,
                downstream: aggregate,
                downstream_node: node,
                checkpoint: ckpt,
                trans,
            }
            .into(),
        ),
        (
            "task-1",
            "task-2",
            CheckpointReadyAck {
                stream,
                upstream: source,
                downstream: aggregate,
                checkpoint: ckpt,
            }
            .into(),
        ),
        (
            "task-1",
            "coordinator",
            CheckpointReport {
                stream,
                task: source,
                node,
                checkpoint: ckpt,
                trans,
                outcome: built(1, 512, 512, Some(2)),
            }
            .into(),
        ),
        (
            "task-1",
            "coordinator",
            CheckpointSourceRsp {
                stream,
                task: source,
                node,
                checkpoint: ckpt,
                trans,
            }
            .into(),
        ),
        ("coordinator", "task-1", complete(source, Some(2)).into()),
        ("coordinator", "task-2", complete(aggregate, None).into()),
        ("coordinator", "task-3", complete(sink, None).into()),
        // Checkpoint 2: the aggregate's barrier monitor asks for a missing barrier, the
        // source has not sent it yet, a task fails, and the coordinator aborts.
        (
            "task-2",
            "task-1",
            RetrieveBarrier {
                stream,
                upstream: source,
                downstream: aggregate,
                downstream_node: node,
                checkpoint: CheckpointId(2),
            }
            .into(),
        ),
        (
            "task-1",
            "task-2",
            RetrieveBarrierRsp {
                stream,
                upstream: source,
                downstream: aggregate,
                checkpoint: CheckpointId(2),
                answer: RetrieveAnswer::NotYetSent,
            }
            .into(),
        ),
        (
            "task-3",
            "coordinator",
            CheckpointReport {
                stream,
                task: sink,
                node,
                checkpoint: CheckpointId(2),
                trans: TransId(2),
                outcome: ReportOutcome::Failed {
                    reason: "disk full".into(),
                },
            }
            .into(),
        ),
        (
            "coordinator",
            "task-2",
            CheckpointAbort {
                stream,
                task: aggregate,
                checkpoint: CheckpointId(2),
                trans: TransId(2),
                reason: AbortReason::TaskFailed(sink),
            }
            .into(),
        ),
    ];

    // Encode the whole exchange into one byte stream, as a connection would carry it.
    let mut wire = BytesMut::new();
    let mut lengths = Vec::new();
    for (_, _, message) in &exchange {
        lengths.push(encode(message, &mut wire)?);
    }
    println!(
        "{} messages, {} bytes on the wire\n",
        exchange.len(),
        wire.len()
    );

    // Receive it in 7-byte reads through the incremental decoder.
    let decoder = FrameDecoder::default();
    let mut received = BytesMut::new();
    let mut decoded = Vec::new();
    let mut wire = wire.freeze();
    while !wire.is_empty() {
        received.extend_from_slice(&wire.split_to(wire.len().min(7)));
        while let Some(message) = decoder.decode(&mut received)? {
            decoded.push(message);
        }
    }
    decoder.finish(&received)?;

    for (((from, to, sent), got), len) in exchange.iter().zip(&decoded).zip(&lengths) {
        assert_eq!(sent, got, "decoded message differs");
        let checkpoint = got
            .checkpoint()
            .map_or_else(String::new, |c| format!(" {c}"));
        println!(
            "{from:>11} → {to:<11} {:<19}{checkpoint} ({len} bytes)",
            got.kind()
        );
        println!("    {}", hex(&encode_to_bytes(got)?));
    }
    println!("\nall {} messages decoded intact", decoded.len());
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}
