//! Codec benchmarks: control-message encode+decode rate, and `Data` frame decode
//! throughput next to a memcpy + CRC32C baseline measured in the same run.
//!
//! Besides criterion's own report, prints `FIGURE name = value unit` lines that
//! `cargo xtask bench` collects; the ratio comes from interleaved A/B rounds in this
//! process, so machine noise hits both sides alike.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group};
use stillpoint_wire::*;

const DATA_PAYLOAD: usize = 64 * 1024;

fn barrier() -> Message {
    Barrier {
        stream: StreamId(1),
        upstream: TaskId(2),
        downstream: TaskId(3),
        checkpoint: CheckpointId(4),
        trans: TransId(5),
        kind: CheckpointKind::Checkpoint,
    }
    .into()
}

fn report() -> Message {
    CheckpointReport {
        stream: StreamId(1),
        task: TaskId(2),
        node: NodeId(1),
        checkpoint: CheckpointId(4),
        trans: TransId(5),
        outcome: ReportOutcome::Built(SnapshotReport {
            manifest: RelativePath::new("tasks/task-2/ckpt-4.manifest").unwrap(),
            manifest_sha256: Sha256Digest([7; 32]),
            state_bytes: 1 << 30,
            uploaded_bytes: 1 << 24,
            files: 12,
            uploaded_files: 2,
            alignment_micros: 100,
            sync_micros: 20,
            async_micros: 9000,
            source_offset: None,
        }),
    }
    .into()
}

fn data_frame() -> Bytes {
    let payload: Vec<u8> = (0..DATA_PAYLOAD).map(|i| (i * 31 % 251) as u8).collect();
    let message = Data {
        stream: StreamId(1),
        upstream: TaskId(2),
        downstream: TaskId(3),
        records: 1024,
        payload: Bytes::from(payload),
    };
    encode_to_bytes(&message.into()).unwrap()
}

fn encode_decode(message: &Message, buf: &mut BytesMut, decoder: &FrameDecoder) -> Message {
    encode(message, buf).unwrap();
    decoder.decode(buf).unwrap().unwrap()
}

fn decode_data(frame: &Bytes, decoder: &FrameDecoder) -> usize {
    match decoder.decode_exact(frame.clone()).unwrap() {
        Message::Data(data) => data.payload.len(),
        _ => unreachable!(),
    }
}

fn encode_data(message: &Message, out: &mut BytesMut) -> usize {
    out.clear();
    encode(message, out).unwrap()
}

/// What any receiver must do at least once per byte: copy it out and checksum it.
fn memcpy_crc(frame: &Bytes, scratch: &mut [u8]) -> u32 {
    scratch.copy_from_slice(&frame[HEADER_LEN + 20..]);
    crc32c::crc32c(scratch)
}

fn criterion_benches(c: &mut Criterion) {
    let decoder = FrameDecoder::default();
    let mut group = c.benchmark_group("control");
    group.throughput(Throughput::Elements(1));
    for (name, message) in [("barrier", barrier()), ("report", report())] {
        let mut buf = BytesMut::with_capacity(4096);
        group.bench_function(format!("{name}_encode_decode"), |b| {
            b.iter(|| encode_decode(black_box(&message), &mut buf, &decoder));
        });
    }
    group.finish();

    let frame = data_frame();
    let mut group = c.benchmark_group("data");
    group.throughput(Throughput::Bytes(DATA_PAYLOAD as u64));
    group.bench_function("decode_64k", |b| {
        b.iter(|| decode_data(black_box(&frame), &decoder))
    });
    let mut scratch = vec![0_u8; DATA_PAYLOAD];
    group.bench_function("baseline_memcpy_crc32c_64k", |b| {
        b.iter(|| memcpy_crc(black_box(&frame), &mut scratch));
    });
    let message = decoder.decode_exact(frame.clone()).unwrap();
    let mut out = BytesMut::with_capacity(DATA_PAYLOAD + 64);
    group.bench_function("encode_64k", |b| {
        b.iter(|| encode_data(black_box(&message), &mut out));
    });
    group.finish();
}

/// Runs `f` `iters` times and returns the time per call.
fn time_per_call(iters: u32, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed() / iters
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Without `--bench` (how `cargo test` runs bench targets) the figures are produced
/// at tiny sizes, so CI checks each is still printed without timing anything.
fn smoke() -> bool {
    !std::env::args().any(|arg| arg == "--bench")
}

/// Interleaved A/B rounds; prints the figures `cargo xtask bench` reads.
fn ratios() {
    let decoder = FrameDecoder::default();
    let frame = data_frame();
    let mut scratch = vec![0_u8; DATA_PAYLOAD];
    let data = decoder.decode_exact(frame.clone()).unwrap();
    let mut out = BytesMut::with_capacity(DATA_PAYLOAD + 64);
    let message = barrier();
    let mut buf = BytesMut::with_capacity(4096);

    let (mut decode_ratio, mut encode_ratio) = (Vec::new(), Vec::new());
    let (mut decode_gbps, mut msgs) = (Vec::new(), Vec::new());
    let (rounds, iters) = if smoke() { (1, 20) } else { (15, 2000) };
    for _ in 0..rounds {
        let decode = time_per_call(iters, || {
            black_box(decode_data(black_box(&frame), &decoder));
        });
        let encode = time_per_call(iters, || {
            black_box(encode_data(black_box(&data), &mut out));
        });
        let baseline = time_per_call(iters, || {
            black_box(memcpy_crc(black_box(&frame), &mut scratch));
        });
        let control = time_per_call(iters * 100, || {
            black_box(encode_decode(black_box(&message), &mut buf, &decoder));
        });
        decode_ratio.push(baseline.as_secs_f64() / decode.as_secs_f64());
        encode_ratio.push(baseline.as_secs_f64() / encode.as_secs_f64());
        decode_gbps.push(DATA_PAYLOAD as f64 / decode.as_secs_f64() / 1e9);
        msgs.push(1.0 / control.as_secs_f64());
    }
    println!(
        "FIGURE wire.control_encode_decode = {:.0} messages/s goal >= 1000000 (a Barrier encoded and decoded)",
        median(msgs)
    );
    println!(
        "FIGURE wire.data_decode_throughput = {:.2} GB/s (64 KiB Data frames, CRC checked)",
        median(decode_gbps)
    );
    println!(
        "FIGURE wire.data_decode_vs_memcpy_crc32c = {:.2} ratio goal >= 1.0 (decode speed ÷ memcpy+CRC32C speed in the same run: zero-copy decode costs no more than one copy)",
        median(decode_ratio)
    );
    println!(
        "FIGURE wire.data_encode_vs_memcpy_crc32c = {:.2} ratio goal >= 0.8 (encode speed ÷ memcpy+CRC32C speed in the same run: one CRC pass and one copy)",
        median(encode_ratio)
    );
}

criterion_group!(benches, criterion_benches);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // `cargo test --benches` runs each benchmark once and the A/B rounds at a tiny
    // size (every figure still printed); `cargo bench` at full size.
    ratios();
}
