//! End to end: buffer debloating. A stage whose records are expensive asks its
//! upstreams for small data messages — down to the fewest records a message is cut
//! to, which its metrics gauge shows while the job runs — and the job's output stays
//! exactly once; with debloating off the message size never changes.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use stillpoint::{
    CachedState, Dataflow, EngineError, JobConfig, MIN_RECORDS_PER_MESSAGE, Operator, Partitioning,
    Record, RunOptions, Source, run,
};
use stillpoint_connectors::{GeneratedWords, KeyedCount, TransactionalFileSink, read_committed};
use support::{assert_totals_rise_once, config, scrape_metrics, word_totals};

const SEED: u64 = 5;
const VOCABULARY: u32 = 100;
const WORDS: u64 = 2_000;
/// The counters of the flow below (after the two sources).
const COUNTERS: [u32; 2] = [3, 4];

/// A keyed count whose every record costs at least 200 µs (a read that misses every
/// cache, a call to a slow service).
struct SlowCount;

impl Operator for SlowCount {
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        std::thread::sleep(Duration::from_micros(200));
        KeyedCount.process(record, state, out)
    }
}

fn flow(dir: &Path) -> Dataflow {
    Dataflow::source("words", 2, move |index| {
        Ok(Box::new(GeneratedWords::new(SEED, index, WORDS, VOCABULARY)) as Box<dyn Source>)
    })
    .operator("slow-count", 2, Partitioning::Hash, |_| {
        Ok(Box::new(SlowCount) as Box<dyn Operator>)
    })
    .sink(
        "publish",
        2,
        Partitioning::Forward,
        TransactionalFileSink::factory(dir.join("out")),
    )
}

/// The message size each counter asked for, as a scrape shows it (0: unchanged).
fn asked(metrics: &str) -> BTreeMap<u32, i64> {
    COUNTERS
        .iter()
        .map(|task| {
            let prefix = format!("stillpoint_task_message_records{{task=\"{task}\"}} ");
            let value = metrics
                .lines()
                .find_map(|line| line.strip_prefix(&prefix))
                .map_or(0, |v| v.trim().parse().unwrap());
            (*task, value)
        })
        .collect()
}

/// Runs the flow, scraping its metrics until `enough` holds for a scrape or the job
/// ends; returns every scrape's view of the counters.
fn run_scraping(
    config: JobConfig,
    dir: &Path,
    enough: impl Fn(&BTreeMap<u32, i64>) -> bool,
) -> Vec<BTreeMap<u32, i64>> {
    let (address_tx, address_rx) = mpsc::channel();
    let options = RunOptions {
        on_metrics: Some(Box::new(move |address| {
            let _sent = address_tx.send(address);
        })),
        ..RunOptions::default()
    };
    let job = flow(dir);
    let runner = std::thread::spawn(move || run(&config, &job, options));
    let address = address_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    let mut seen = Vec::new();
    while !runner.is_finished() {
        let Some(metrics) = scrape_metrics(address) else {
            break;
        };
        let view = asked(&metrics);
        let done = enough(&view);
        seen.push(view);
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    runner.join().unwrap().unwrap();
    seen
}

/// Every word's published counts rise strictly to its total: nothing lost, nothing
/// published twice.
fn check_output(dir: &Path) {
    let mut published: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (key, value) in read_committed(&dir.join("out")).unwrap() {
        published
            .entry(key)
            .or_default()
            .push(value.parse().unwrap());
    }
    assert_totals_rise_once(&published, &word_totals(SEED, 2, WORDS, VOCABULARY));
}

#[test]
fn expensive_records_shrink_the_messages_to_the_floor_and_the_output_stays_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    // 200 µs a record against 1 ms over 4 messages (250 µs each): one record fits, so
    // every counter asks for the floor.
    config.debloat_target = Some(Duration::from_millis(1));
    config.channel_batches = 4;
    let floor = i64::from(MIN_RECORDS_PER_MESSAGE);
    let seen = run_scraping(config, dir.path(), |view| {
        view.values().all(|v| *v == floor)
    });
    let last = seen.last().expect("no scrape while the job ran");
    assert!(
        last.values().all(|v| *v == floor),
        "the counters asked for {last:?}, not {floor} records per message ({} scrapes)",
        seen.len()
    );
    check_output(dir.path());
}

#[test]
fn with_debloating_off_the_message_size_never_changes() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    config.debloat_target = None;
    let seen = run_scraping(config, dir.path(), |_| false);
    assert!(
        seen.len() >= 10,
        "the job outran the scrapes: {}",
        seen.len()
    );
    assert!(
        seen.iter().all(|view| view.values().all(|v| *v == 0)),
        "a message size changed with debloating off: {seen:?}"
    );
    check_output(dir.path());
}
