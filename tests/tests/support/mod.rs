//! Shared pieces of the end-to-end tests: the expected word-count output and a crash
//! loop that runs a job to the end through injected crashes.
#![allow(dead_code)]

mod rng;
pub(crate) use rng::Rng;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use stillpoint::{EngineError, JobConfig, RunOptions, StopHandle, checkpoint_history, run};
use stillpoint_connectors::{GeneratedWords, WordCount, WordInput, read_committed};

/// How often each word occurs in the word count's whole input.
pub(crate) fn totals(job: &WordCount) -> BTreeMap<String, u64> {
    let mut totals: BTreeMap<String, u64> = BTreeMap::new();
    match &job.input {
        WordInput::Generated {
            words_per_source,
            vocabulary,
            seed,
        } => totals = word_totals(*seed, job.sources, *words_per_source, *vocabulary),
        WordInput::Files { paths } => {
            for path in paths {
                for word in std::fs::read_to_string(path).unwrap().split_whitespace() {
                    *totals.entry(word.to_owned()).or_default() += 1;
                }
            }
        }
        WordInput::Log { dirs } => {
            for dir in dirs {
                let mut segments: Vec<_> = std::fs::read_dir(dir)
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .collect();
                segments.sort();
                for segment in segments {
                    for word in std::fs::read_to_string(segment).unwrap().split_whitespace() {
                        *totals.entry(word.to_owned()).or_default() += 1;
                    }
                }
            }
        }
    }
    totals
}

/// What an exactly-once word count publishes, whatever happened during the run: for a
/// word seen `n` times in total, the lines `(word, 1) … (word, n)`, each once.
pub(crate) fn expected_output(job: &WordCount) -> Vec<(String, String)> {
    let totals = totals(job);
    let mut out: Vec<(String, String)> = totals
        .into_iter()
        .flat_map(|(word, n)| (1..=n).map(move |k| (word.clone(), k.to_string())))
        .collect();
    out.sort();
    out
}

/// How many lines of `expected` (sorted) `output` (sorted) lacks, counting repeats: a
/// merge walk, linear in both.
pub(crate) fn missing_from(output: &[(String, String)], expected: &[(String, String)]) -> usize {
    let mut have = output.iter().peekable();
    let mut missing = 0;
    for line in expected {
        while have.next_if(|seen| *seen < line).is_some() {}
        if have.next_if(|seen| *seen == line).is_none() {
            missing += 1;
        }
    }
    missing
}

/// Lines the sinks committed for checkpoint `checkpoint`.
pub(crate) fn committed_lines_of(job: &WordCount, checkpoint: u64) -> usize {
    let prefix = format!("{checkpoint:020}-task-");
    std::fs::read_dir(job.output.join("committed"))
        .map(|entries| {
            entries
                .map(|e| e.unwrap().path())
                .filter(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with(&prefix)
                })
                .map(|p| std::fs::read_to_string(p).unwrap().lines().count())
                .sum()
        })
        .unwrap_or(0)
}

/// The committed output, sorted.
pub(crate) fn committed_output(job: &WordCount) -> Vec<(String, String)> {
    let mut out = read_committed(&job.output).unwrap();
    out.sort();
    out
}

/// How often each word occurs in `sources` generated sources of `words` words.
pub(crate) fn word_totals(
    seed: u64,
    sources: u32,
    words: u64,
    vocabulary: u32,
) -> BTreeMap<String, u64> {
    let mut totals = BTreeMap::new();
    for index in 0..sources {
        let source = GeneratedWords::new(seed, index, words, vocabulary);
        for position in 0..words {
            *totals.entry(source.word(position)).or_default() += 1;
        }
    }
    totals
}

/// Runs `job` and crashes it once a checkpoint was committed, so that a restore has
/// something to start from. The job pauses its sources at its first committed
/// checkpoint (records in flight still flow, checkpoints go on), so once that
/// checkpoint is in it cannot finish before its crash (crashing at fixed moments let
/// a fast machine finish first); the crash moment only has to come after that
/// checkpoint, so it quadruples, from 1 s, until one did. The job must outlast its
/// first checkpoint (≈ 100 ms here for a fresh job): a 30,000-word job once did
/// not, in CI.
pub(crate) fn crash_once_checkpointed(config: &JobConfig, job: &impl stillpoint::ToDataflow) {
    for crash_ms in [1_000, 4_000, 16_000] {
        let stop = StopHandle::new();
        let pause = stop.clone();
        let options = RunOptions {
            crash_after: Some(Duration::from_millis(crash_ms)),
            stop,
            on_checkpoint: Some(Box::new(move |_| pause.pause())),
            ..RunOptions::default()
        };
        match run(config, job, options) {
            Err(EngineError::Crashed(_)) => {
                if !checkpoint_history(config).unwrap().is_empty() {
                    return;
                }
            }
            Ok(_) => panic!("the job finished before its first checkpoint: make it longer"),
            Err(error) => panic!("{error}"),
        }
    }
    panic!("no checkpoint within 16 s");
}

/// The end-to-end tests' job settings: work under `dir/work`, a checkpoint every
/// 30 ms, a short lease so a crashed run's successor is never kept waiting long.
pub(crate) fn config(dir: &std::path::Path) -> JobConfig {
    let mut config = JobConfig::new(dir.join("work"));
    config.checkpoint_interval = Duration::from_millis(30);
    config.lease_ttl = Duration::from_secs(5);
    config
}

/// What a crash loop saw.
#[derive(Debug, Default)]
pub(crate) struct CrashLoop {
    pub(crate) crashes: u32,
    /// Runs (crashed ones included) that started from a restored checkpoint.
    pub(crate) restored: u32,
    pub(crate) checkpoints: usize,
    pub(crate) durations_millis: Vec<u64>,
    pub(crate) stalls_micros: Vec<u64>,
    pub(crate) elapsed: Duration,
}

/// Runs `job` crashing it at uniformly random moments in `0..window` until it was
/// crashed `crashes` times or finished before its crash moment, then (if needed) once
/// more without a crash to the end.
pub(crate) fn crash_loop(
    config: &JobConfig,
    job: &impl stillpoint::ToDataflow,
    crashes: u32,
    window: Duration,
    seed: u64,
) -> CrashLoop {
    let started = Instant::now();
    let mut rng = Rng(seed);
    let mut seen = CrashLoop::default();
    let window_micros = u64::try_from(window.as_micros()).unwrap();
    let restored = Arc::new(AtomicU32::new(0));
    loop {
        let crash =
            (seen.crashes < crashes).then(|| Duration::from_micros(rng.below(window_micros)));
        let counter = Arc::clone(&restored);
        let options = RunOptions {
            crash_after: crash,
            on_start: Some(Box::new(move |report| {
                if report.restored_from.is_some() {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })),
            ..RunOptions::default()
        };
        match run(config, job, options) {
            Err(EngineError::Crashed(_)) => seen.crashes += 1,
            Ok(_) => break,
            Err(error) => panic!("run after {} crashes failed: {error}", seen.crashes),
        }
    }
    seen.restored = restored.load(Ordering::Relaxed);
    // Every checkpoint committed across the runs, crashed ones included.
    for stats in checkpoint_history(config).unwrap() {
        seen.checkpoints += 1;
        seen.durations_millis.push(stats.duration_millis);
        seen.stalls_micros.push(stats.max_sync_micros);
    }
    seen.elapsed = started.elapsed();
    seen
}

/// Crash loops on fresh directories until `crashes` crashes were made in all, with
/// crash moments uniform over the job's life: a first run, failure-free in a
/// directory of its own, measures how long the job runs (from its start, past
/// opening the store) here and now (machines and
/// their load differ several times over; a fixed window let a fast machine finish
/// before every crash moment, a slow one crash before any checkpoint). Each round
/// builds its job and settings in a new directory with `setup` (given the directory
/// and the round's number; 0 is the measuring run), runs it to the end through
/// `crash_loop` (round `r` seeded `first_seed + r - 1`) and hands it to `check`
/// with the round's number and figures. A round whose job outran its crash moments
/// made no crash (still checked: a failure-free run must be exact too) and narrows
/// the window to two thirds: the measured span includes starting the tasks, which a
/// crash moment does not. After ten such rounds in a row the test says so instead
/// of looping forever.
pub(crate) fn crash_rounds<J: stillpoint::ToDataflow>(
    crashes: u32,
    first_seed: u64,
    mut setup: impl FnMut(&Path, u64) -> (JobConfig, J),
    mut check: impl FnMut(&Path, &J, u64, &CrashLoop),
) -> (CrashLoop, u64) {
    let mut window = {
        let dir = tempfile::tempdir().unwrap();
        let (config, job) = setup(dir.path(), 0);
        // From the restore point's choice, near where a crash moment counts from
        // (once the tasks started), to the end: opening the store, taking the lease
        // and closing took four times the records' processing here.
        let started = Arc::new(std::sync::Mutex::new(Instant::now()));
        let mark = Arc::clone(&started);
        let options = RunOptions {
            on_start: Some(Box::new(move |_| *mark.lock().unwrap() = Instant::now())),
            ..RunOptions::default()
        };
        run(&config, &job, options).unwrap();
        let started = *started.lock().unwrap();
        started.elapsed()
    };
    let mut seen = CrashLoop::default();
    let mut round = 0;
    let mut idle_rounds = 0;
    while seen.crashes < crashes {
        round += 1;
        let dir = tempfile::tempdir().unwrap();
        let (config, job) = setup(dir.path(), round);
        let this = crash_loop(
            &config,
            &job,
            crashes - seen.crashes,
            window,
            first_seed + round - 1,
        );
        check(dir.path(), &job, round, &this);
        if this.crashes == 0 {
            // The run outran the window, which counts from before the tasks started.
            idle_rounds += 1;
            window = window * 2 / 3;
        } else {
            idle_rounds = 0;
        }
        assert!(
            idle_rounds < 10,
            "ten rounds in a row finished before their first crash moment (the window narrowed to {window:?}); {this:?}"
        );
        seen.merge(this);
    }
    (seen, round)
}

impl CrashLoop {
    /// Adds another loop's figures to these.
    pub(crate) fn merge(&mut self, other: Self) {
        self.crashes += other.crashes;
        self.restored += other.restored;
        self.checkpoints += other.checkpoints;
        self.durations_millis.extend(other.durations_millis);
        self.stalls_micros.extend(other.stalls_micros);
        self.elapsed += other.elapsed;
    }
}

/// The `p`-th percentile of `values` (nearest rank).
pub(crate) fn percentile(values: &[u64], p: usize) -> u64 {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len()).div_ceil(100);
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The sink's files, `pending/…` and `committed/…`, for failure messages.
pub(crate) fn sink_files(job: &WordCount) -> Vec<String> {
    let mut out = Vec::new();
    for kind in ["pending", "committed"] {
        if let Ok(entries) = std::fs::read_dir(job.output.join(kind)) {
            for entry in entries.flatten() {
                out.push(format!("{kind}/{}", entry.file_name().to_string_lossy()));
            }
        }
    }
    out.sort();
    out
}

/// The metrics exposition of the endpoint at `address`, or `None` once it has closed
/// (the job ended).
pub(crate) fn scrape_metrics(address: std::net::SocketAddr) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).ok()?;
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

/// Exactly once for a job that publishes each word's running total: the words
/// published are the words counted, and each word's published totals rise strictly
/// (one published twice was republished; one never published was lost) to its total.
pub(crate) fn assert_totals_rise_once(
    published: &BTreeMap<String, Vec<u64>>,
    totals: &BTreeMap<String, u64>,
) {
    assert_eq!(
        published.keys().collect::<Vec<_>>(),
        totals.keys().collect::<Vec<_>>(),
        "words published"
    );
    for (word, total) in totals {
        let seen = &published[word];
        assert!(
            seen.windows(2).all(|pair| pair[0] < pair[1]),
            "{word}: totals {seen:?} do not rise strictly (published twice)"
        );
        assert_eq!(seen.last(), Some(total), "{word}: final total");
    }
}
