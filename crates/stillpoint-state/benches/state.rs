//! State benches, each a ratio measured in the same run:
//! - keyed read-modify-write with 1,000 hot keys: write-back cache ÷ raw RocksDB
//!   get+put (goal ≥ 5), and with uniformly random keys over a large key space
//!   (goal ≥ 0.9);
//! - the task's stall at a barrier (the O(1) freeze) p99, next to what a synchronous
//!   flush of the same dirty data costs;
//! - snapshot export (write frozen batch + flush + checkpoint) at 1× and 8× the state
//!   with the same changed data (goal ratio ≤ 1.5);
//! - manifest time of a second snapshot after 1% of keys changed;
//! - restore of the snapshot with the longest changelog after a long run of
//!   checkpoints (1,000, each changing 1 % of at most 1 M keys) ÷ restore of a
//!   snapshot standing on a fresh materialization (goal ≤ 2).
//!
//! Sizes: `STILLPOINT_BENCH_KEYS` keys of 100-byte values for the large state
//! (default 10,000,000 ≈ 1 GiB; `cargo xtask bench --quick` sets 1,000,000).
//! `STILLPOINT_BENCH_STATE_ONLY=restore` runs the restore figure alone;
//! `STILLPOINT_BENCH_MATERIALIZE_PERCENT` runs it at another `materialize_percent`.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation
)]

use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group};
use rocksdb::{DB, Options, WriteOptions};
use stillpoint_state::*;
use stillpoint_wire::{CheckpointId, StreamId, TaskId};

// With glibc's malloc the task stalls for hundreds of milliseconds now and then: a
// multi-million-entry frozen map freed on the snapshot thread fills the fastbins,
// and the task thread's next allocation consolidates them (p99 810 ms at 2 M keys;
// 0.015 ms with `GLIBC_TUNABLES=glibc.malloc.mxfast=0`). The `stillpoint` binary
// runs on jemalloc, as TiKV and RisingWave do; so does this bench.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const OWNER: StateOwner = StateOwner {
    stream: StreamId(1),
    task: TaskId(1),
};

/// Without `--bench` (how `cargo test` runs bench targets) the figures are produced
/// at tiny sizes, so CI checks each is still printed without timing anything.
fn smoke() -> bool {
    !std::env::args().any(|arg| arg == "--bench")
}

fn keys() -> u64 {
    std::env::var("STILLPOINT_BENCH_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if smoke() { 10_000 } else { 10_000_000 })
}

fn cached(dir: &Path, budget: usize) -> CachedState {
    cached_with(
        dir,
        StateConfig {
            cache_budget_bytes: budget,
            ..StateConfig::default()
        },
    )
}

fn cached_with(dir: &Path, config: StateConfig) -> CachedState {
    let groups = KeyGroups::new(128).unwrap();
    CachedState::new(RocksStateBackend::open(dir, config, groups, groups.all(), OWNER).unwrap())
}

struct Raw {
    db: DB,
    write: WriteOptions,
}

fn raw(dir: &Path) -> Raw {
    let mut options = Options::default();
    options.create_if_missing(true);
    options.set_compression_type(rocksdb::DBCompressionType::Lz4);
    let mut table = rocksdb::BlockBasedOptions::default();
    table.set_block_cache(&rocksdb::Cache::new_lru_cache(256 << 20));
    table.set_bloom_filter(10.0, false);
    options.set_block_based_table_factory(&table);
    let mut write = WriteOptions::default();
    write.disable_wal(true);
    Raw {
        db: DB::open(&options, dir).unwrap(),
        write,
    }
}

/// xorshift: the key sequence, identical for both sides.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn rmw_cached(state: &mut CachedState, key: u64) {
    let k = key.to_le_bytes();
    let count = state
        .get_cached("counts", &k, b"")
        .unwrap()
        .map_or(0, |v| u64::from_le_bytes(v[..8].try_into().unwrap()));
    state
        .put("counts", &k, b"", &(count + 1).to_le_bytes())
        .unwrap();
}

fn rmw_raw(raw: &Raw, key: u64) {
    let k = key.to_le_bytes();
    let count = raw
        .db
        .get(k)
        .unwrap()
        .map_or(0, |v| u64::from_le_bytes(v[..8].try_into().unwrap()));
    raw.db
        .put_opt(k, (count + 1).to_le_bytes(), &raw.write)
        .unwrap();
}

fn rate(ops: u64, mut f: impl FnMut(u64)) -> f64 {
    let start = Instant::now();
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    for _ in 0..ops {
        f(next(&mut x));
    }
    ops as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn criterion_benches(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut state = cached(&dir.path().join("cached"), 256 << 20);
    let raw_db = raw(&dir.path().join("raw"));
    let mut group = c.benchmark_group("state");
    group.throughput(Throughput::Elements(1));
    let mut x = 1_u64;
    group.bench_function("rmw_hot_1000_cached", |b| {
        b.iter(|| rmw_cached(&mut state, black_box(next(&mut x) % 1000)))
    });
    group.bench_function("rmw_hot_1000_raw_rocksdb", |b| {
        b.iter(|| rmw_raw(&raw_db, black_box(next(&mut x) % 1000)))
    });
    group.bench_function("barrier_freeze", |b| {
        let mut n = 0_u64;
        b.iter(|| {
            n += 1;
            state.put("counts", &n.to_le_bytes(), b"", b"x").unwrap();
            let job = state.snapshot(CheckpointId(n), dir.path().join(format!("freeze-{n}")));
            job.discard().unwrap();
        });
    });
    group.finish();
}

fn load(state: &mut CachedState, raw: Option<&Raw>, n: u64) {
    let value = [5_u8; 100];
    for i in 0..n {
        state.put("s", &i.to_le_bytes(), b"", &value).unwrap();
        if let Some(raw) = raw {
            raw.db.put_opt(i.to_le_bytes(), value, &raw.write).unwrap();
        }
    }
}

fn figures() {
    let n = keys();
    let (ops, rounds) = if smoke() { (2_000, 3) } else { (200_000, 20) };
    let dir = tempfile::tempdir().unwrap();
    // 1,000 checkpoints is several materialization cycles at any size: the longest
    // changelog no longer grows with more (it is bounded by the state's own size).
    let restore_rounds = if smoke() { 30 } else { 1_000 };
    if std::env::var("STILLPOINT_BENCH_STATE_ONLY").as_deref() == Ok("restore") {
        restore_figure(
            &dir.path().join("restore"),
            n.min(1_000_000),
            restore_rounds,
        );
        return;
    }

    // Hot keys: interleaved rounds.
    let mut state = cached(&dir.path().join("hot-cached"), 256 << 20);
    let raw_db = raw(&dir.path().join("hot-raw"));
    let mut hot = Vec::new();
    for _ in 0..5 {
        let c = rate(ops, |k| rmw_cached(&mut state, k % 1000));
        let r = rate(ops, |k| rmw_raw(&raw_db, k % 1000));
        hot.push(c / r);
    }
    println!(
        "FIGURE state.rmw_hot_1000_cached_vs_raw = {:.2} ratio goal >= 5 (write-back cache ÷ raw RocksDB get+put, 1,000 hot keys)",
        median(hot)
    );
    drop(state);

    // Uniform keys over n keys, both preloaded with the same data.
    let mut state = cached(&dir.path().join("uni-cached"), 256 << 20);
    let raw_db = raw(&dir.path().join("uni-raw"));
    load(&mut state, Some(&raw_db), n);
    let mut uniform = Vec::new();
    for _ in 0..3 {
        let c = rate(ops, |k| rmw_cached(&mut state, k % n));
        let r = rate(ops, |k| rmw_raw(&raw_db, k % n));
        uniform.push(c / r);
    }
    println!(
        "FIGURE state.rmw_uniform_cached_vs_raw = {:.2} ratio goal >= 0.9 (uniform keys over {n} keys)",
        median(uniform)
    );
    drop(state);
    drop(raw_db);

    // Stall at the barrier with n keys of state, 1% changed per checkpoint.
    let (stalls, exports) = barrier_rounds(&dir.path().join("stall"), n, n / 100, rounds);
    let flush = median(
        exports
            .iter()
            .map(|e| (e.write + e.flush).as_secs_f64())
            .collect(),
    );
    println!(
        "FIGURE state.barrier_stall_p99 = {:.3} ms goal <= 1 (O(1) freeze with {n} keys, 1% changed, {} barriers, p50 {:.3} ms; a synchronous write+flush of the same data takes {:.1} ms here)",
        percentile(&stalls, 99) * 1e3,
        stalls.len(),
        percentile(&stalls, 50) * 1e3,
        flush * 1e3
    );
    let manifest = median(
        exports
            .iter()
            .map(|e| e.manifest_time.as_secs_f64())
            .collect(),
    );
    println!(
        "FIGURE state.second_snapshot_manifest = {:.1} ms (listing and hashing only new SSTs after 1% changed)",
        manifest * 1e3
    );

    // 8× the state with the same changed data: the export and the synchronous part.
    let (big_stalls, big_exports) = barrier_rounds(&dir.path().join("big"), n * 8, n / 100, rounds);
    let export = |exports: &[ExportedSnapshot]| {
        median(
            exports
                .iter()
                .map(|e| (e.write + e.flush + e.checkpoint_time).as_secs_f64())
                .collect(),
        )
    };
    let export_small = export(&exports);
    println!(
        "FIGURE state.export_8x_vs_1x = {:.2} ratio goal <= 1.5 (write frozen batch + flush + checkpoint, same changed data; 1×: {:.1} ms)",
        export(&big_exports) / export_small,
        export_small * 1e3
    );
    // P9: what the task waits for at a barrier, at 8× ÷ 1× the state.
    let (sync_small, sync_big) = (percentile(&stalls, 50), percentile(&big_stalls, 50));
    restore_figure(
        &dir.path().join("restore"),
        n.min(1_000_000),
        restore_rounds,
    );
    println!(
        "FIGURE state.sync_snapshot_8x_vs_1x = {:.2} ratio goal <= 1.5 (P9: the barrier's synchronous snapshot, median of {} barriers each, {} keys {:.3} ms vs {n} keys {:.3} ms)",
        sync_big / sync_small.max(1e-9),
        stalls.len(),
        n * 8,
        sync_big * 1e3,
        sync_small * 1e3
    );
}

/// Puts `snapshot` in `slot`, removing the directory of the one it replaces unless
/// `other` still holds it.
fn keep_in(
    slot: &mut Option<ExportedSnapshot>,
    snapshot: &ExportedSnapshot,
    other: Option<&ExportedSnapshot>,
) {
    if let Some(old) = slot.replace(snapshot.clone())
        && other.is_none_or(|o| o.dir != old.dir)
    {
        std::fs::remove_dir_all(&old.dir).unwrap();
    }
}

/// Restore after a long run of changelog checkpoints ÷ restore from a fresh
/// materialization: `rounds` checkpoints each changing 1 % of `keys` random keys, with
/// no time- or size-limit but the changelog's own `materialize_percent` of its
/// materialization;
/// the snapshot whose changelog is the largest of the run is restored, and so is the
/// one with the smallest in the run's second half — taken right after a
/// materialization was installed (median of 5 alternating restores each, with the
/// loaded database closed).
fn restore_figure(dir: &Path, keys: u64, rounds: u64) {
    // The default unless `STILLPOINT_BENCH_MATERIALIZE_PERCENT` says otherwise.
    let percent = std::env::var("STILLPOINT_BENCH_MATERIALIZE_PERCENT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ChangelogConfig::default().materialize_percent);
    let config = StateConfig {
        cache_budget_bytes: 1 << 30,
        changelog: Some(ChangelogConfig {
            materialize_interval: std::time::Duration::MAX,
            materialize_bytes: u64::MAX,
            materialize_percent: percent,
        }),
        ..StateConfig::default()
    };
    let mut state = cached_with(&dir.join("db"), config);
    load(&mut state, None, keys);
    let mut x = 11_u64;
    let mut longest: Option<ExportedSnapshot> = None;
    // The snapshot with the shortest changelog in the second half of the run: one
    // taken right after a materialization was installed, of the same state at the
    // same age as the longest.
    let mut fresh: Option<ExportedSnapshot> = None;
    let changelog_bytes = |e: &ExportedSnapshot| -> u64 {
        e.manifest
            .files
            .iter()
            .filter(|f| e.manifest.changelog.contains(&f.path))
            .map(|f| f.size)
            .sum()
    };
    // Checkpoints every 100 ms, as the goal states it (a round that takes longer is
    // followed at once by the next).
    let started = Instant::now();
    for round in 0..rounds {
        let due = started + std::time::Duration::from_millis(100) * u32::try_from(round).unwrap();
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        if round > 0 {
            for _ in 0..keys / 100 {
                let value = next(&mut x).to_le_bytes().repeat(12);
                state
                    .put("s", &(next(&mut x) % keys).to_le_bytes(), b"", &value)
                    .unwrap();
            }
        }
        let exported = state
            .snapshot(CheckpointId(round + 1), dir.join(format!("ckpt-{round}")))
            .run()
            .unwrap();
        let bytes = changelog_bytes(&exported);
        let mut kept = false;
        if longest.as_ref().is_none_or(|l| bytes > changelog_bytes(l)) {
            keep_in(&mut longest, &exported, fresh.as_ref());
            kept = true;
        }
        if round >= rounds / 2
            && bytes > 0
            && fresh.as_ref().is_none_or(|f| bytes < changelog_bytes(f))
        {
            keep_in(&mut fresh, &exported, longest.as_ref());
            kept = true;
        }
        if !kept {
            std::fs::remove_dir_all(&exported.dir).unwrap();
        }
    }
    let fresh = fresh.unwrap();
    let longest = longest.unwrap();
    let materializations = state.materializations().unwrap_or(0);
    // Closed before the timed restores: its background flushes and compactions would
    // otherwise run beside them (the live database of a recovered task is gone too).
    drop(state);
    let groups = KeyGroups::new(128).unwrap();
    // What a recovery does: fetch every file (here a copy from the snapshot, as the
    // `file://` store's download copies), verify, link, open, replay.
    let restore = |snapshot: &ExportedSnapshot, target: &Path| {
        let fetched = target.with_extension("fetched");
        let started = Instant::now();
        std::fs::create_dir_all(&fetched).unwrap();
        for file in &snapshot.manifest.files {
            std::fs::copy(
                snapshot.dir.join(file.path.as_str()),
                fetched.join(file.path.as_str()),
            )
            .unwrap();
        }
        let restored = RocksStateBackend::restore(
            &fetched,
            &snapshot.manifest,
            target,
            StateConfig::default(),
            groups,
            OWNER,
        )
        .unwrap();
        let elapsed = started.elapsed().as_secs_f64();
        drop(restored);
        std::fs::remove_dir_all(target).unwrap();
        std::fs::remove_dir_all(&fetched).unwrap();
        elapsed
    };
    let (mut long_times, mut fresh_times) = (Vec::new(), Vec::new());
    for i in 0..5 {
        long_times.push(restore(&longest, &dir.join(format!("r-long-{i}"))));
        fresh_times.push(restore(&fresh, &dir.join(format!("r-fresh-{i}"))));
    }
    let (long, fresh_time) = (median(long_times), median(fresh_times));
    // The SHA-256 pass over every file that a restore of files whose digests were
    // already checked skips (the engine's: the store's download hashes every byte).
    let hash_pass = median(
        (0..5)
            .map(|_| {
                let started = Instant::now();
                verify_snapshot(&longest.dir, &longest.manifest).unwrap();
                started.elapsed().as_secs_f64()
            })
            .collect(),
    );
    println!(
        "FIGURE state.restore_changelog_vs_materialized = {:.2} ratio goal <= 2 ({rounds} checkpoints of 1% of {keys} keys every 100 ms, materialize_percent {percent}: {} materializations; the longest changelog: {} segments, {:.1} MiB beside {:.1} MiB of state, restored in {:.1} ms; from a fresh materialization {:.1} ms; fetch (copy) + verify + link + open + replay)",
        long / fresh_time.max(1e-9),
        materializations,
        longest.manifest.changelog.len(),
        changelog_bytes(&longest) as f64 / f64::from(1 << 20),
        (longest.manifest.total_bytes() - changelog_bytes(&longest)) as f64 / f64::from(1 << 20),
        long * 1e3,
        fresh_time * 1e3
    );
    println!(
        "FIGURE state.restore_hash_pass = {:.1} ms (verify_snapshot of the longest changelog's snapshot, {:.1} MiB: the second SHA-256 pass the engine's restore no longer makes, its download having hashed every byte)",
        hash_pass * 1e3,
        longest.manifest.total_bytes() as f64 / f64::from(1 << 20),
    );
}

/// Loads `keys` keys into a fresh cached state in `dir`, snapshots it once, then for
/// each of `rounds` barriers changes `changed` random keys and snapshots again: the
/// synchronous part (seconds) of each barrier and what each export reports.
fn barrier_rounds(
    dir: &Path,
    keys: u64,
    changed: u64,
    rounds: u64,
) -> (Vec<f64>, Vec<ExportedSnapshot>) {
    let mut state = cached(&dir.join("db"), 1 << 30);
    load(&mut state, None, keys);
    state
        .snapshot(CheckpointId(1), dir.join("snapshot-1"))
        .run()
        .unwrap();
    let mut stalls = Vec::new();
    let mut exports = Vec::new();
    let mut x = 7_u64;
    for round in 0..rounds {
        for _ in 0..changed {
            state
                .put("s", &(next(&mut x) % keys).to_le_bytes(), b"", &[6; 100])
                .unwrap();
        }
        let started = Instant::now();
        let job = state.snapshot(
            CheckpointId(round + 2),
            dir.join(format!("snapshot-{}", round + 2)),
        );
        stalls.push(started.elapsed().as_secs_f64());
        // Exported off the task's thread, as the engine does.
        exports.push(
            std::thread::spawn(move || job.run().unwrap())
                .join()
                .unwrap(),
        );
    }
    (stalls, exports)
}

/// The `p`-th percentile (nearest rank) of `values`.
fn percentile(values: &[f64], p: usize) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = (sorted.len() * p).div_ceil(100).saturating_sub(1);
    sorted.get(at).copied().unwrap_or(0.0)
}

criterion_group!(benches, criterion_benches);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    figures();
}
