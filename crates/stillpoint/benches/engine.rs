//! End-to-end figures of the engine, printed as `FIGURE` lines for `cargo xtask bench`
//! (see `docs/performance.md`). Every ratio compares runs made here, one after the
//! other, alternating, so a shared machine's noise falls on both sides.
//!
//! - P1 `engine.throughput_ckpt_1s_vs_off`: the keyed word count's throughput with a
//!   checkpoint every second ÷ with checkpoints off (an interval longer than the run;
//!   the final checkpoint of a bounded job is taken either way);
//! - P2 `engine.stall_p99`: per checkpoint, the longest alignment plus the longest
//!   synchronous snapshot of any task, on the large state a load built and the run
//!   restored (404 MiB stored, LZ4, at full size: `load_words` per source over `load_vocabulary`);
//! - P3 `engine.upload_vs_state_1pct`: bytes uploaded per checkpoint ÷ the state's
//!   size, once the state is loaded and only 1 % of its keys keep changing;
//! - `engine.checkpoint_duration_p99_{4,16,64}_tasks`: trigger → commit;
//! - P10 `engine.shortest_sustained_interval`: with 16 tasks on the loaded state
//!   (restored rescaled to 7 counters), the shortest interval of
//!   1000, 500, 250, 100, 50 ms at which every checkpoint commits before the next
//!   trigger and throughput stays ≥ 0.95 of checkpoints off.
//! - `engine.windowed_count_vs_plain_ckpt_1s`: an event-time windowed count (1 s
//!   tumbling windows over event times 1 ms apart, up to 100 ms out of order) ÷ the
//!   plain keyed count of the same words, both checkpointing every second, same
//!   sources, sink and parallelism (2 → 3 → 3).
//!
//! Without `--bench` (how `cargo test` runs bench targets) it is a smoke run at tiny
//! sizes that checks every figure is produced; `--quick` (`cargo xtask bench --quick`)
//! uses smaller inputs than the full run. `STILLPOINT_BENCH_ENGINE_WORDS` overrides the
//! words per source; `STILLPOINT_BENCH_ENGINE_ONLY=p1,p2,peer,p3,durations,p10,windows` runs a subset;
//! `STILLPOINT_BENCH_SNAPSHOTS=rocksdb-checkpoint` runs it without changelog checkpoints.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use stillpoint::{
    CheckpointStats, Dataflow, JobConfig, Operator, Partitioning, RunOptions, Source,
};
use stillpoint_connectors::{
    CountAggregate, GeneratedWords, KeyedCount, TransactionalFileSink, WindowOperator, WindowSpec,
    WordCount, WordInput,
};

// What the `stillpoint` binary runs on (see docs/performance.md: glibc's malloc stalls
// a task for a long time after a large frozen map is freed).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Smoke,
    Quick,
    Full,
}

struct Sizes {
    /// Words per source of the throughput runs.
    words: u64,
    /// Distinct words of the throughput runs.
    vocabulary: u32,
    /// Runs per side of P1.
    repeats: usize,
    /// Runs of each setting of the job the peers run (the peers' settings run 3
    /// times each and their medians are compared).
    peer_repeats: usize,
    /// Keys of the 1 % run, and records per source after the load.
    p3_keys: u32,
    p3_updates: u64,
    /// The interval standing for "every second" (shorter in the smoke run).
    interval: Duration,
    /// Words per source and distinct words of the load that builds the large state
    /// P2 and P10 run on.
    load_words: u64,
    load_vocabulary: u32,
}

impl Sizes {
    fn of(mode: Mode) -> Self {
        let words = std::env::var("STILLPOINT_BENCH_ENGINE_WORDS")
            .ok()
            .and_then(|v| v.parse().ok());
        match mode {
            Mode::Smoke => Self {
                words: words.unwrap_or(20_000),
                vocabulary: 2_000,
                repeats: 1,
                peer_repeats: 1,
                p3_keys: 20_000,
                p3_updates: 20_000,
                interval: Duration::from_millis(100),
                load_words: 20_000,
                load_vocabulary: 40_000,
            },
            Mode::Quick => Self {
                words: words.unwrap_or(3_000_000),
                vocabulary: 1_000_000,
                repeats: 2,
                peer_repeats: 3,
                p3_keys: 2_000_000,
                p3_updates: 3_000_000,
                interval: Duration::from_secs(1),
                load_words: 5_000_000,
                load_vocabulary: 10_000_000,
            },
            Mode::Full => Self {
                words: words.unwrap_or(10_000_000),
                vocabulary: 5_000_000,
                repeats: 3,
                peer_repeats: 3,
                p3_keys: 10_000_000,
                p3_updates: 10_000_000,
                interval: Duration::from_secs(1),
                load_words: 40_000_000,
                load_vocabulary: 80_000_000,
            },
        }
    }
}

/// A job's configuration in `dir`. `STILLPOINT_BENCH_SNAPSHOTS=rocksdb-checkpoint`
/// turns changelog checkpoints off, for the before/after table of
/// docs/performance-figures.md.
fn job_config(dir: &Path) -> JobConfig {
    let mut config = JobConfig::new(dir.join("work"));
    if std::env::var("STILLPOINT_BENCH_SNAPSHOTS").as_deref() == Ok("rocksdb-checkpoint") {
        config.state.changelog = None;
    }
    config
}

/// One finished run: records per second and the checkpoints it completed.
struct Run {
    rate: f64,
    /// The rate up to the end-of-input checkpoint (its trigger → commit left out), as
    /// the peers are measured: they wait for no checkpoint once their input ends.
    rate_before_final: f64,
    checkpoints: Vec<CheckpointStats>,
}

impl Run {
    fn of(records: u64, elapsed: f64, checkpoints: Vec<CheckpointStats>) -> Self {
        let last = checkpoints
            .last()
            .map_or(0.0, |c| c.duration_millis as f64 / 1e3);
        Self {
            rate: records as f64 / elapsed,
            rate_before_final: records as f64 / (elapsed - last).max(1e-9),
            checkpoints,
        }
    }
}

fn run(dir: &Path, job: &WordCount, interval: Duration, records: u64) -> Run {
    run_tuned(dir, job, interval, records, |_| {})
}

/// [`run`] with the job's configuration changed by `tune`.
fn run_tuned(
    dir: &Path,
    job: &WordCount,
    interval: Duration,
    records: u64,
    tune: impl Fn(&mut JobConfig),
) -> Run {
    if dir.exists() {
        std::fs::remove_dir_all(dir).unwrap();
    }
    let mut config = job_config(dir);
    config.checkpoint_interval = interval;
    tune(&mut config);
    let job = WordCount {
        output: dir.join("out"),
        ..job.clone()
    };
    let started = Instant::now();
    let report = stillpoint::run(&config, &job, RunOptions::default()).unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(dir).unwrap();
    Run::of(records, elapsed, report.checkpoints)
}

fn generated(aggregators: u32, words: u64, vocabulary: u32) -> WordCount {
    WordCount {
        sources: 2,
        aggregators,
        input: WordInput::Generated {
            words_per_source: words,
            vocabulary,
            seed: 42,
        },
        output: PathBuf::new(),
        combine: false,
    }
}

const OFF: Duration = Duration::from_secs(3600);

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn percentile(values: &[f64], p: usize) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return 0.0;
    }
    let at = (sorted.len() * p).div_ceil(100).saturating_sub(1);
    sorted.get(at.min(sorted.len() - 1)).copied().unwrap_or(0.0)
}

fn figure(line: &str) {
    println!("FIGURE {line}");
    std::io::stdout().flush().unwrap();
}

/// The periodic checkpoints of a run (the bounded job's final one comes at the end of
/// input, not on the interval).
fn periodic(checkpoints: &[CheckpointStats]) -> &[CheckpointStats] {
    checkpoints.split_last().map_or(&[], |(_, rest)| rest)
}

fn p1(dir: &Path, sizes: &Sizes) {
    let job = generated(3, sizes.words, sizes.vocabulary);
    let records = 2 * sizes.words;
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for _ in 0..sizes.repeats {
        off.push(run(dir, &job, OFF, records).rate);
        on.push(run(dir, &job, sizes.interval, records).rate);
    }
    let (on, off) = (median(on), median(off));
    figure(&format!(
        "engine.throughput_ckpt_1s_vs_off = {:.3} ratio goal >= 0.97 (word count 2 → 3 → 3 tasks, {} words, checkpoint every {} ms: {:.0} records/s, off: {:.0} records/s)",
        on / off,
        records,
        sizes.interval.as_millis(),
        on,
        off
    ));
}

/// A store holding the word count's final checkpoint after a load of `load_words`
/// draws per source over `load_vocabulary` words (3 counters): the large state P2
/// and P10 start from (404 MiB stored, LZ4, at full size; 92 MiB at `--quick`).
struct Loaded {
    store: PathBuf,
    state_bytes: u64,
}

fn load(dir: &Path, sizes: &Sizes) -> Loaded {
    if dir.exists() {
        std::fs::remove_dir_all(dir).unwrap();
    }
    let mut config = job_config(dir);
    config.checkpoint_interval = OFF;
    let job = loaded_job(3, sizes, 0, dir);
    let report = stillpoint::run(&config, &job, RunOptions::default()).unwrap();
    Loaded {
        store: dir.join("work/store"),
        state_bytes: report.checkpoints.last().map_or(0, |c| c.state_bytes),
    }
}

/// The loaded word count continued for `words` more words per source.
fn loaded_job(aggregators: u32, sizes: &Sizes, words: u64, dir: &Path) -> WordCount {
    WordCount {
        sources: 2,
        aggregators,
        input: WordInput::Generated {
            words_per_source: sizes.load_words + words,
            vocabulary: sizes.load_vocabulary,
            seed: 42,
        },
        output: dir.join("out"),
        combine: false,
    }
}

/// Copies a store; snapshot files (immutable) are hard-linked.
fn copy_store(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type().unwrap().is_dir() {
            copy_store(&source, &target);
        } else if source.components().any(|c| c.as_os_str() == "shared") {
            std::fs::hard_link(&source, &target).unwrap();
        } else if entry.file_name() != "finished.json" {
            std::fs::copy(&source, &target).unwrap();
        }
    }
}

/// Restores the loaded state (rescaled to `aggregators` counters) and runs `words`
/// more words per source; the rate counts from the end of the restore.
fn run_loaded(
    dir: &Path,
    loaded: &Loaded,
    sizes: &Sizes,
    aggregators: u32,
    interval: Duration,
    words: u64,
) -> Run {
    if dir.exists() {
        std::fs::remove_dir_all(dir).unwrap();
    }
    copy_store(&loaded.store, &dir.join("store"));
    let mut config = job_config(dir);
    config.store = Some(format!("file://{}", dir.join("store").display()));
    config.checkpoint_interval = interval;
    let job = loaded_job(aggregators, sizes, words, dir);
    let restored = std::sync::Arc::new(std::sync::Mutex::new(None));
    let mark = std::sync::Arc::clone(&restored);
    let options = RunOptions {
        on_start: Some(Box::new(move |report| {
            assert!(
                report.restored_from.is_some(),
                "the loaded state was not restored"
            );
            *mark.lock().unwrap() = Some(Instant::now());
        })),
        ..RunOptions::default()
    };
    let report = stillpoint::run(&config, &job, options).unwrap();
    let started = restored.lock().unwrap().unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(dir).unwrap();
    Run::of(2 * words, elapsed, report.checkpoints)
}

fn p2(dir: &Path, sizes: &Sizes, loaded: &Loaded) {
    let (mut stalls, mut alignments, mut syncs) = (Vec::new(), Vec::new(), Vec::new());
    // One run: tens of checkpoints, each over the whole loaded state.
    let result = run_loaded(dir, loaded, sizes, 3, sizes.interval, sizes.words);
    for c in periodic(&result.checkpoints) {
        stalls.push((c.max_alignment_micros + c.max_sync_micros) as f64 / 1e3);
        alignments.push(c.max_alignment_micros as f64 / 1e3);
        syncs.push(c.max_sync_micros as f64 / 1e3);
    }
    figure(&format!(
        "engine.stall_p99 = {:.2} ms goal <= 10 (alignment + synchronous snapshot, longest task per checkpoint, {} checkpoints, p50 {:.2} ms; alignment p99 {:.2} ms, synchronous part p99 {:.2} ms; word count 2 → 3 → 3 tasks on {:.1} MiB of restored state)",
        percentile(&stalls, 99),
        stalls.len(),
        percentile(&stalls, 50),
        percentile(&alignments, 99),
        percentile(&syncs, 99),
        loaded.state_bytes as f64 / f64::from(1 << 20)
    ));
}

/// Opens one source's input file of P3 for appending, 16 words to a line.
fn p3_writer(path: &Path) -> std::io::BufWriter<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    std::io::BufWriter::new(file)
}

/// Appends one word and its separator: a line break after every 16th.
fn p3_word(out: &mut impl std::io::Write, key: u64, nth: u64) {
    write!(out, "k{key:09}").unwrap();
    out.write_all(if nth % 16 == 15 { b"\n" } else { b" " })
        .unwrap();
}

/// Appends the load of source `index` (of 2): its half of `keys` distinct words, once.
fn p3_load_input(path: &Path, index: u32, keys: u32) {
    let mut out = p3_writer(path);
    for (nth, key) in (index..keys).step_by(2).enumerate() {
        p3_word(&mut out, u64::from(key), nth as u64);
    }
    out.write_all(b"\n").unwrap();
}

/// Appends the updates of source `index`: `updates` words drawn from the first 1 % of
/// `keys`.
fn p3_update_input(path: &Path, index: u32, keys: u32, updates: u64) {
    let mut out = p3_writer(path);
    let hot = (keys / 100).max(1);
    let mut z = u64::from(index) + 1;
    for nth in 0..updates {
        z = z
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        p3_word(&mut out, (z >> 33) % u64::from(hot), nth);
    }
    out.write_all(b"\n").unwrap();
}

/// P3 in two runs of one job: the load alone (no periodic checkpoint, its
/// end-of-input checkpoint keeps it), then — its inputs appended — a restore of it
/// and only the updates, so every periodic checkpoint of the second run comes after
/// the load. (Picking the checkpoints "after the load" out of one run by the state's
/// size counted the load's tail whenever the updates ran fast enough to leave only a
/// checkpoint or two.)
fn p3(dir: &Path, sizes: &Sizes) {
    let inputs = dir.join("p3-input");
    let work = dir.join("p3");
    for stale in [&inputs, &work] {
        if stale.exists() {
            std::fs::remove_dir_all(stale).unwrap();
        }
    }
    std::fs::create_dir_all(&inputs).unwrap();
    let paths: Vec<PathBuf> = (0..2).map(|i| inputs.join(format!("{i}.txt"))).collect();
    for (i, path) in paths.iter().enumerate() {
        p3_load_input(path, i as u32, sizes.p3_keys);
    }
    let job = WordCount {
        sources: 2,
        aggregators: 3,
        input: WordInput::Files {
            paths: paths.clone(),
        },
        output: work.join("out"),
        combine: false,
    };
    let mut config = job_config(&work);
    config.checkpoint_interval = OFF;
    stillpoint::run(&config, &job, RunOptions::default()).unwrap();
    for (i, path) in paths.iter().enumerate() {
        p3_update_input(path, i as u32, sizes.p3_keys, sizes.p3_updates);
    }
    // A quarter of the interval: the updates touch 1 % of the keys however long a
    // checkpoint's stretch is, and a fast machine still takes several checkpoints.
    let interval = sizes.interval / 4;
    config.checkpoint_interval = interval;
    let report = stillpoint::run(&config, &job, RunOptions::default()).unwrap();
    assert!(report.restored_from.is_some(), "P3's load was not restored");
    std::fs::remove_dir_all(&inputs).unwrap();
    std::fs::remove_dir_all(&work).unwrap();
    let updates = periodic(&report.checkpoints);
    let ratios: Vec<f64> = updates
        .iter()
        .map(|c| c.uploaded_bytes as f64 / c.state_bytes.max(1) as f64)
        .collect();
    let state = updates.iter().map(|c| c.state_bytes).max().unwrap_or(0);
    figure(&format!(
        "engine.upload_vs_state_1pct = {:.4} ratio goal <= 0.05 (median over {} checkpoints every {} ms after the load of {} keys, restored; up to {:.1} MiB of state; p99 {:.4})",
        median(ratios.clone()),
        ratios.len(),
        interval.as_millis(),
        sizes.p3_keys,
        state as f64 / f64::from(1 << 20),
        percentile(&ratios, 99)
    ));
}

fn durations(dir: &Path, sizes: &Sizes) {
    for (tasks, aggregators) in [(4, 1), (16, 7), (64, 31)] {
        let job = generated(aggregators, sizes.words / 2, sizes.vocabulary);
        let interval = sizes.interval / 4;
        let result = run(dir, &job, interval, sizes.words);
        let millis: Vec<f64> = result
            .checkpoints
            .iter()
            .map(|c| c.duration_millis as f64)
            .collect();
        figure(&format!(
            "engine.checkpoint_duration_p99_{tasks}_tasks = {:.0} ms (trigger → commit, {} checkpoints every {} ms, p50 {:.0} ms, {:.0} records/s)",
            percentile(&millis, 99),
            millis.len(),
            interval.as_millis(),
            percentile(&millis, 50),
            result.rate
        ));
    }
}

fn p10(dir: &Path, sizes: &Sizes, loaded: &Loaded) {
    // 16 tasks: 2 sources, 7 counters, 7 sinks, on the loaded state rescaled to 7.
    let words = sizes.words / 2;
    let off = run_loaded(dir, loaded, sizes, 7, OFF, words).rate;
    let mut shortest = None;
    let mut tried = Vec::new();
    for millis in [1000u64, 500, 250, 100, 50] {
        let interval = Duration::from_millis(millis);
        let result = run_loaded(dir, loaded, sizes, 7, interval, words);
        let periodic = periodic(&result.checkpoints);
        let late = periodic
            .iter()
            .filter(|c| c.duration_millis >= millis)
            .count();
        let ratio = result.rate / off;
        tried.push(format!(
            "{millis} ms: {} checkpoints, {late} late, {ratio:.2}×",
            periodic.len()
        ));
        if late > 0 || ratio < 0.95 || periodic.is_empty() {
            break;
        }
        shortest = Some(millis);
    }
    figure(&format!(
        "engine.shortest_sustained_interval = {} ms goal <= 100 (16 tasks, file://, {:.1} MiB of restored state; {})",
        shortest.map_or(f64::INFINITY, |m| m as f64),
        loaded.state_bytes as f64 / f64::from(1 << 20),
        tried.join("; ")
    ));
}

/// The keyed count the peers run too (`cargo xtask bench` runs Flink and Bytewax on
/// it and divides): 1,000 distinct words, a checkpoint every second.
fn peer_job(dir: &Path, sizes: &Sizes) {
    let job = generated(3, sizes.words, 1_000);
    let records = 2 * sizes.words;
    let mut rates = Vec::new();
    let mut millis = Vec::new();
    for _ in 0..sizes.peer_repeats {
        let result = run(dir, &job, sizes.interval, records);
        rates.push(result.rate_before_final);
        millis.extend(
            periodic(&result.checkpoints)
                .iter()
                .map(|c| c.duration_millis as f64),
        );
    }
    let rate = median(rates);
    figure(&format!(
        "engine.keyed_count_1000_keys = {:.0} records/s (word count 2 → 3 → 3 tasks, {} words, checkpoint every {} ms, median of {}; up to the end-of-input checkpoint, as the peers)",
        rate,
        records,
        sizes.interval.as_millis(),
        sizes.peer_repeats
    ));
    figure(&format!(
        "engine.keyed_count_1000_keys_checkpoint_p99 = {:.0} ms (trigger → commit, {} checkpoints, p50 {:.0} ms)",
        percentile(&millis, 99),
        millis.len(),
        percentile(&millis, 50)
    ));
    // The same job with its counts combined per word on the sources before the
    // shuffle (at most 5,000 words or 200 ms between flushes): what Flink's
    // mini-batch (two-phase) aggregation does, so the figure "÷ Flink tuned" uses.
    let combined = WordCount {
        combine: true,
        ..job.clone()
    };
    let combined: Vec<f64> = (0..sizes.peer_repeats)
        .map(|_| run(dir, &combined, sizes.interval, records).rate_before_final)
        .collect();
    let combined = median(combined);
    figure(&format!(
        "engine.keyed_count_1000_keys_combined = {combined:.0} records/s (the same job with `combine`: a CountCombiner per source, flushed at 5,000 words, 200 ms and every barrier; {:.2}× the plain count)",
        combined / rate
    ));
    // The same job tuned for throughput (`batch_records = 1024`, `channel_batches =
    // 1`): fewer, larger hand-offs between tasks, at the price of alignment time.
    let tuned: Vec<f64> = (0..sizes.peer_repeats)
        .map(|_| {
            run_tuned(dir, &job, sizes.interval, records, |config| {
                config.batch_records = 1024;
                config.channel_batches = 1;
            })
            .rate
        })
        .collect();
    let tuned = median(tuned);
    figure(&format!(
        "engine.keyed_count_1000_keys_batch_1024x1 = {tuned:.0} records/s (the same job with batch_records = 1024, channel_batches = 1: {:.2}× the default 256 × 4)",
        tuned / rate
    ));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = if !args.iter().any(|a| a == "--bench") {
        Mode::Smoke
    } else if args.iter().any(|a| a == "--quick") {
        Mode::Quick
    } else {
        Mode::Full
    };
    let sizes = Sizes::of(mode);
    let dir = tempfile::tempdir().unwrap();
    let scratch = dir.path().join("run");
    // `STILLPOINT_BENCH_ENGINE_ONLY=p1,p2,peer,p3,durations,p10,windows` runs a subset.
    let only = std::env::var("STILLPOINT_BENCH_ENGINE_ONLY").unwrap_or_default();
    let wanted = |name: &str| only.is_empty() || only.split(',').any(|n| n == name);
    if wanted("p1") {
        p1(&scratch, &sizes);
    }
    if wanted("p2") || wanted("p10") {
        let loaded = load(&dir.path().join("load"), &sizes);
        if wanted("p2") {
            p2(&scratch, &sizes, &loaded);
        }
        if wanted("p10") {
            p10(&scratch, &sizes, &loaded);
        }
    }
    if wanted("peer") {
        peer_job(&scratch, &sizes);
    }
    if wanted("p3") {
        p3(dir.path(), &sizes);
    }
    if wanted("durations") {
        durations(&scratch, &sizes);
    }
    if wanted("windows") {
        windowed(&scratch, &sizes);
    }
}

/// The windowed count and the plain count, alternating, each the median of
/// `repeats` runs.
fn windowed(dir: &Path, sizes: &Sizes) {
    let words = sizes.words;
    let vocabulary = sizes.vocabulary;
    let flow = |windows: bool, out: PathBuf| {
        Dataflow::source("words", 2, move |index| {
            let source = GeneratedWords::new(42, index, words, vocabulary);
            Ok(Box::new(if windows {
                source.with_event_times(Duration::from_millis(1), Duration::from_millis(100))
            } else {
                source
            }) as Box<dyn Source>)
        })
        .operator("count", 3, Partitioning::Hash, move |_| {
            Ok(if windows {
                let spec = WindowSpec::tumbling(Duration::from_secs(1))?;
                Box::new(WindowOperator::new(spec, CountAggregate)) as Box<dyn Operator>
            } else {
                Box::new(KeyedCount)
            })
        })
        .sink(
            "publish",
            3,
            Partitioning::Forward,
            TransactionalFileSink::factory(out),
        )
    };
    let rate = |windows: bool| {
        if dir.exists() {
            std::fs::remove_dir_all(dir).unwrap();
        }
        let mut config = job_config(dir);
        config.checkpoint_interval = sizes.interval;
        let started = Instant::now();
        stillpoint::run(
            &config,
            &flow(windows, dir.join("out")),
            RunOptions::default(),
        )
        .unwrap();
        (2 * words) as f64 / started.elapsed().as_secs_f64()
    };
    let (mut windowed, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..sizes.repeats {
        plain.push(rate(false));
        windowed.push(rate(true));
    }
    let (windowed, plain) = (median(windowed), median(plain));
    figure(&format!(
        "engine.windowed_count_vs_plain_ckpt_1s = {:.3} ratio (2 → 3 → 3 tasks, {} words, checkpoint every {} ms: windowed {:.0} records/s, plain count {:.0} records/s)",
        windowed / plain,
        2 * words,
        sizes.interval.as_millis(),
        windowed,
        plain
    ));
}
