//! End to end: event-time windows. Two sources give their words event times out of
//! order by up to 40 ms (watermarks trailing by as much, so no record is late); a
//! window operator counts each word per window on event-time timers kept in keyed
//! state; the transactional sink publishes each window once. Crashed at random and
//! rescaled mid-run, the job publishes exactly the windows of a failure-free run.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stderr
)]

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use stillpoint::{
    Dataflow, EngineError, Operator, Partitioning, Record, RunOptions, Source, SourcePoll,
    WatermarkStrategy, run, run_word_count,
};
use stillpoint_connectors::{
    CountAggregate, GeneratedWords, TransactionalFileSink, WindowOperator, WindowSpec,
    read_committed,
};
use stillpoint_wire::SourceOffset;
use support::{config, crash_once_checkpointed, crash_rounds};

const SEED: u64 = 31;
const VOCABULARY: u32 = 40;
const STEP: Duration = Duration::from_millis(1);
const DISORDER: Duration = Duration::from_millis(40);

fn tumbling() -> WindowSpec {
    WindowSpec::tumbling(Duration::from_millis(100)).unwrap()
}

fn sliding() -> WindowSpec {
    WindowSpec::sliding(Duration::from_millis(100), Duration::from_millis(50)).unwrap()
}

fn source(index: u32, words: u64) -> GeneratedWords {
    GeneratedWords::new(SEED, index, words, VOCABULARY).with_event_times(STEP, DISORDER)
}

fn flow(dir: &Path, words: u64, spec: WindowSpec, windows: u32) -> Dataflow {
    Dataflow::source("events", 2, move |index| {
        Ok(Box::new(source(index, words)) as Box<dyn Source>)
    })
    .operator("window", windows, Partitioning::Hash, move |_| {
        Ok(Box::new(WindowOperator::new(spec, CountAggregate)) as Box<dyn Operator>)
    })
    .sink(
        "publish",
        windows,
        Partitioning::Forward,
        TransactionalFileSink::factory(dir.join("out")),
    )
}

/// The windows a failure-free run publishes: each (word, window) once with its count.
fn expected(words: u64, spec: WindowSpec) -> Vec<(String, String)> {
    let mut counts: BTreeMap<(String, i64, i64), u64> = BTreeMap::new();
    for index in 0..2 {
        let source = source(index, words);
        for position in 0..words {
            let time = source.time(position).unwrap();
            for window in spec.windows_of(time) {
                *counts
                    .entry((source.word(position), window.start, window.end))
                    .or_default() += 1;
            }
        }
    }
    let mut lines: Vec<(String, String)> = counts
        .into_iter()
        .map(|((word, start, end), n)| (word, format!("{start} {end} {n}")))
        .collect();
    lines.sort();
    lines
}

/// Fails naming the first lines `published` lacks and has in excess of `expected`.
fn assert_windows(published: &[(String, String)], expected: &[(String, String)], what: &str) {
    if published == expected {
        return;
    }
    let missing: Vec<_> = expected
        .iter()
        .filter(|l| !published.contains(l))
        .take(10)
        .collect();
    let extra: Vec<_> = published
        .iter()
        .filter(|l| !expected.contains(l))
        .take(10)
        .collect();
    panic!(
        "{what}: {} lines published, {} expected; missing {missing:?}; extra {extra:?}",
        published.len(),
        expected.len()
    );
}

fn published(dir: &Path) -> Vec<(String, String)> {
    let mut lines = read_committed(&dir.join("out")).unwrap();
    lines.sort();
    lines
}

#[test]
fn a_windowed_count_publishes_every_window_once() {
    for spec in [tumbling(), sliding()] {
        let dir = tempfile::tempdir().unwrap();
        let words = 3_000;
        run_word_count(&config(dir.path()), &flow(dir.path(), words, spec, 3), None).unwrap();
        let expected = expected(words, spec);
        assert!(expected.len() > 100, "{} windows", expected.len());
        assert_windows(&published(dir.path()), &expected, &format!("{spec:?}"));
    }
}

#[test]
fn twenty_random_crashes_publish_exactly_the_failure_free_windows() {
    let crashes: u32 = std::env::var("STILLPOINT_E2E_CRASHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let words = 30_000;
    let (seen, round) = crash_rounds(
        crashes,
        1,
        |dir, _| (config(dir), flow(dir, words, tumbling(), 3)),
        |dir, _, round, _| {
            assert_eq!(published(dir), expected(words, tumbling()), "round {round}");
        },
    );
    assert!(seen.restored > 0, "no run restored: {seen:?}");
    eprintln!(
        "windows: {round} rounds, {} crashes, {} restores, {} checkpoints, {:.1} s",
        seen.crashes,
        seen.restored,
        seen.checkpoints,
        seen.elapsed.as_secs_f64()
    );
}

#[test]
fn a_rescale_from_three_to_five_tasks_keeps_windows_and_timers() {
    let dir = tempfile::tempdir().unwrap();
    let words = 200_000;
    let config = config(dir.path());
    // Crash the 3-task job once it has checkpointed (open windows and their timers
    // are in that checkpoint), then finish it with 5 tasks.
    let first = flow(dir.path(), words, sliding(), 3);
    crash_once_checkpointed(&config, &first);
    let report = run_word_count(&config, &flow(dir.path(), words, sliding(), 5), None).unwrap();
    assert!(report.restored_from.is_some(), "{report:?}");
    assert_windows(
        &published(dir.path()),
        &expected(words, sliding()),
        "rescaled",
    );
}

/// A source with no input for now and never an end (a quiet partition): it tells
/// its downstreams it is idle.
struct Quiet;

impl Source for Quiet {
    fn seek(&mut self, _offset: Option<&SourceOffset>) -> Result<(), EngineError> {
        Ok(())
    }
    fn poll(&mut self, _max: usize, _out: &mut Vec<Record>) -> Result<SourcePoll, EngineError> {
        Ok(SourcePoll::Idle)
    }
    fn offset(&self) -> SourceOffset {
        SourceOffset::from_u64(0)
    }
    fn watermarks(&self) -> Option<WatermarkStrategy> {
        Some(WatermarkStrategy::bounded(DISORDER).idle_after(Duration::from_millis(50)))
    }
}

#[test]
fn an_idle_input_does_not_hold_back_the_windows_of_the_others() {
    // Source 0 reads its words and ends; source 1 never reads anything and never
    // ends. Without idleness the window tasks' event time would stay at its start
    // (source 1 sent no watermark) and no window would ever fire.
    let dir = tempfile::tempdir().unwrap();
    let words = 2_000;
    let flow = Dataflow::source("events", 2, move |index| {
        Ok(if index == 0 {
            Box::new(source(0, words)) as Box<dyn Source>
        } else {
            Box::new(Quiet)
        })
    })
    .operator("window", 2, Partitioning::Hash, |_| {
        Ok(Box::new(WindowOperator::new(tumbling(), CountAggregate)) as Box<dyn Operator>)
    })
    .sink(
        "publish",
        2,
        Partitioning::Forward,
        TransactionalFileSink::factory(dir.path().join("out")),
    );
    let mut expected_lines: BTreeMap<(String, i64), u64> = BTreeMap::new();
    let only = source(0, words);
    for position in 0..words {
        let window = tumbling()
            .windows_of(only.time(position).unwrap())
            .next()
            .unwrap();
        *expected_lines
            .entry((only.word(position), window.start))
            .or_default() += 1;
    }
    let mut expected: Vec<(String, String)> = expected_lines
        .into_iter()
        .map(|((word, start), n)| (word, format!("{start} {} {n}", start + 100)))
        .collect();
    expected.sort();
    let options = RunOptions::default();
    let stop = options.stop.clone();
    let out = dir.path().to_path_buf();
    let watcher = std::thread::spawn(move || {
        // Every window is published (checkpoints commit them) while source 1 is still
        // running, idle; then the job is stopped.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = Vec::new();
        while Instant::now() < deadline {
            last = read_committed(&out.join("out")).unwrap_or_default();
            last.sort();
            if last.len() >= expected.len() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.stop();
        (last, expected)
    });
    run(&config(dir.path()), &flow, options).unwrap();
    let (published, expected) = watcher.join().unwrap();
    assert_windows(&published, &expected, "idle");
}

/// One key's records at fixed event times, one per poll (so a watermark follows each:
/// bounded out-of-orderness 0, the watermark is the largest time so far minus 1).
struct Scripted {
    times: Vec<i64>,
    position: usize,
}

impl Source for Scripted {
    fn seek(&mut self, offset: Option<&SourceOffset>) -> Result<(), EngineError> {
        let position = offset.and_then(SourceOffset::as_u64).unwrap_or(0);
        self.position = usize::try_from(position).unwrap_or(usize::MAX);
        Ok(())
    }
    fn poll(&mut self, _max: usize, out: &mut Vec<Record>) -> Result<SourcePoll, EngineError> {
        let Some(time) = self.times.get(self.position) else {
            return Ok(SourcePoll::Finished);
        };
        out.push(Record::new("k", "").at(*time));
        self.position += 1;
        Ok(SourcePoll::Records)
    }
    fn offset(&self) -> SourceOffset {
        SourceOffset::from_u64(self.position as u64)
    }
    fn watermarks(&self) -> Option<WatermarkStrategy> {
        Some(WatermarkStrategy::bounded(Duration::ZERO))
    }
}

#[test]
fn a_record_within_the_allowed_lateness_fires_its_window_again_and_a_later_one_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let flow = Dataflow::source("scripted", 1, |_| {
        // 12 moves the watermark to 11 (window [0, 10) fires with 2); 3 is late but
        // within the 10 ms lateness (fires it again with 3); 25 moves it to 24 (fires
        // [10, 20), and [0, 10) is dropped: its lateness ended at 19); 4 is too late.
        Ok(Box::new(Scripted {
            times: vec![0, 5, 12, 3, 25, 4],
            position: 0,
        }) as Box<dyn Source>)
    })
    .operator("window", 1, Partitioning::Hash, |_| {
        let spec = WindowSpec::tumbling(Duration::from_millis(10))?;
        Ok(Box::new(
            WindowOperator::new(spec, CountAggregate).allowed_lateness(Duration::from_millis(10)),
        ) as Box<dyn Operator>)
    })
    .sink(
        "publish",
        1,
        Partitioning::Forward,
        TransactionalFileSink::factory(dir.path().join("out")),
    );
    run_word_count(&config(dir.path()), &flow, None).unwrap();
    let lines: Vec<String> = read_committed(&dir.path().join("out"))
        .unwrap()
        .into_iter()
        .map(|(_, value)| value)
        .collect();
    assert_eq!(lines, ["0 10 2", "0 10 3", "10 20 1", "20 30 1"]);
}
