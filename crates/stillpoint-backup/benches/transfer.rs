//! Transfer benches of the store on `file://`, each a ratio measured in the same run:
//! - upload of a snapshot directory ÷ `std::fs::copy` of the same files (goal ≥ 0.8);
//! - restore download ÷ the same copy (goal ≥ 0.8);
//! - bytes sent by a second upload after 1% of the files changed ÷ the full size
//!   (goal ≤ 0.05).
//!
//! Size: `STILLPOINT_BENCH_SNAPSHOT_MIB` MiB in 100 files (default 1024; `cargo xtask
//! bench --quick` sets 128). Upload and download are durable (`fsync` before the
//! rename into place); the copy baseline is plain `std::fs::copy`, as the goal says —
//! the copy + `fsync` figure is printed beside it.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss
)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use stillpoint_backup::{Store, StoreOptions};
use stillpoint_wire::{
    BackendInfo, CheckpointId, KeyGroupRange, NodeId, RelativePath, Sha256Digest, SnapshotFile,
    SnapshotManifest, StreamId, TaskId,
};

const FILES: usize = 100;

/// Without `--bench` (how `cargo test` runs bench targets) the figures are produced
/// at tiny sizes, so CI checks each is still printed without timing anything.
fn smoke() -> bool {
    !std::env::args().any(|arg| arg == "--bench")
}

fn snapshot_mib() -> usize {
    std::env::var("STILLPOINT_BENCH_SNAPSHOT_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if smoke() { 4 } else { 1024 })
}

fn fill(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes `FILES` files totalling `total` bytes; returns their manifest.
fn write_snapshot(
    dir: &Path,
    total: usize,
    checkpoint: u64,
    previous: Option<&SnapshotManifest>,
    changed: &[usize],
) -> SnapshotManifest {
    std::fs::create_dir_all(dir).unwrap();
    let each = total / FILES;
    let files = (0..FILES)
        .map(|i| {
            let seed = if changed.contains(&i) {
                1_000_000 + checkpoint * 1000 + i as u64
            } else {
                i as u64
            };
            let content = fill(seed, each);
            let name = format!("{:06}.sst", i + 1);
            std::fs::write(dir.join(&name), &content).unwrap();
            let sha256 = Sha256Digest::of(&content);
            let shared = previous.is_some_and(|p| {
                p.files
                    .iter()
                    .any(|f| f.path.as_str() == name && f.sha256 == sha256)
            });
            SnapshotFile {
                path: RelativePath::new(name).unwrap(),
                size: each as u64,
                sha256,
                shared,
            }
        })
        .collect();
    SnapshotManifest {
        stream: StreamId(1),
        task: TaskId(1),
        checkpoint: CheckpointId(checkpoint),
        max_parallelism: 128,
        key_groups: KeyGroupRange { start: 0, end: 128 },
        backend: BackendInfo {
            kind: "bench".into(),
            version: "1".into(),
            options: Default::default(),
        },
        files,
        changelog: Vec::new(),
    }
}

fn copy_all(from: &Path, to: &Path, manifest: &SnapshotManifest, sync: bool) -> Duration {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    let start = Instant::now();
    for file in &manifest.files {
        let target = to.join(file.path.as_str());
        std::fs::copy(from.join(file.path.as_str()), &target).unwrap();
        if sync {
            std::fs::File::open(&target).unwrap().sync_all().unwrap();
        }
    }
    start.elapsed()
}

fn fresh_store(root: &Path) -> Store {
    let _ = std::fs::remove_dir_all(root);
    Store::open(
        &format!("file://{}", root.display()),
        StoreOptions::default(),
    )
    .unwrap()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn figures() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let work = tempfile::tempdir().unwrap();
    let mib = snapshot_mib();
    let total = mib * 1024 * 1024;
    let local: PathBuf = work.path().join("snapshot");
    let manifest = write_snapshot(&local, total, 1, None, &[]);

    let mut upload_ratios = Vec::new();
    let mut download_ratios = Vec::new();
    let mut copies = Vec::new();
    let mut synced = Vec::new();
    let mut uploads = Vec::new();
    for round in 0..3 {
        let copy = copy_all(&local, &work.path().join("copy"), &manifest, false);
        let copy_sync = copy_all(&local, &work.path().join("copy-sync"), &manifest, true);
        let store = fresh_store(&work.path().join(format!("store-{round}")));
        let start = Instant::now();
        let uploaded = rt
            .block_on(store.upload_snapshot(&local, &manifest, NodeId(1), &()))
            .unwrap();
        let upload = start.elapsed();
        assert_eq!(uploaded.files_uploaded, FILES);
        let target = work.path().join("restore");
        let _ = std::fs::remove_dir_all(&target);
        let start = Instant::now();
        let downloaded = rt
            .block_on(store.download_snapshot(&manifest, &target, &()))
            .unwrap();
        let download = start.elapsed();
        assert_eq!(downloaded.files_downloaded, FILES);
        upload_ratios.push(copy.as_secs_f64() / upload.as_secs_f64());
        download_ratios.push(copy.as_secs_f64() / download.as_secs_f64());
        copies.push(copy.as_secs_f64());
        synced.push(copy_sync.as_secs_f64());
        uploads.push(upload.as_secs_f64());
        let _ = std::fs::remove_dir_all(work.path().join(format!("store-{round}")));
    }
    let gib_per_s = |secs: f64| total as f64 / secs / (1u64 << 30) as f64;
    println!(
        "FIGURE backup.upload_vs_copy = {:.2} ratio goal >= 0.8 (upload of {mib} MiB in {FILES} files to file:// ÷ std::fs::copy, median of 3; copy {:.2} GiB/s, copy+fsync {:.2} GiB/s, upload {:.2} GiB/s: SSTs are SHA-256-checked and hard-linked, the directory fsynced)",
        median(upload_ratios),
        gib_per_s(median(copies)),
        gib_per_s(median(synced)),
        gib_per_s(median(uploads)),
    );
    println!(
        "FIGURE backup.download_vs_copy = {:.2} ratio goal >= 0.8 (verified restore download of {mib} MiB ÷ std::fs::copy, median of 3; every byte SHA-256-checked, no fsync: the store is the durable copy)",
        median(download_ratios)
    );

    // Second upload after 1% of the files changed.
    let store = fresh_store(&work.path().join("incremental"));
    rt.block_on(store.upload_snapshot(&local, &manifest, NodeId(1), &()))
        .unwrap();
    let second_dir = work.path().join("second");
    let second = write_snapshot(&second_dir, total, 2, Some(&manifest), &[FILES / 2]);
    let uploaded = rt
        .block_on(store.upload_snapshot(&second_dir, &second, NodeId(1), &()))
        .unwrap();
    println!(
        "FIGURE backup.second_upload_bytes_ratio = {:.4} ratio goal <= 0.05 (bytes sent ÷ full size after 1 of {FILES} files changed; {} of {} files sent)",
        uploaded.bytes_uploaded as f64 / second.total_bytes() as f64,
        uploaded.files_uploaded,
        second.files.len()
    );
}

fn criterion_benches(c: &mut Criterion) {
    // The per-checkpoint cost of an upload in which nothing changed: 100 files the
    // store already holds (the incremental fast path).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let work = tempfile::tempdir().unwrap();
    let local = work.path().join("snapshot");
    let manifest = write_snapshot(&local, FILES * 4096, 1, None, &[]);
    let store = fresh_store(&work.path().join("store"));
    rt.block_on(store.upload_snapshot(&local, &manifest, NodeId(1), &()))
        .unwrap();
    let mut unchanged = manifest.clone();
    for file in &mut unchanged.files {
        file.shared = true;
    }
    // Each iteration is the next checkpoint (a task manifest is written once).
    let mut next = manifest.checkpoint.get();
    c.bench_function("upload_100_unchanged_files", |b| {
        b.iter(|| {
            next += 1;
            unchanged.checkpoint = stillpoint_wire::CheckpointId(next);
            rt.block_on(store.upload_snapshot(&local, &unchanged, NodeId(1), &()))
                .unwrap()
        });
    });
}

criterion_group!(benches, criterion_benches);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    figures();
}
