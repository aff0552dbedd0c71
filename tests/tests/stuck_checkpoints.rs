//! End to end: a stuck checkpoint made visible. One source stalls for 2 s in the
//! middle of its input (a slow read), so the counters downstream align on a
//! checkpoint with one barrier in and one missing. While it lasts, the metrics
//! endpoint shows each such task's missing barriers and snapshots in flight; once the
//! checkpoint completes, its statistics name every task's alignment, sync and async
//! times, and the stalled alignment is there.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use stillpoint::{
    Dataflow, EngineError, Operator, Partitioning, Record, RunOptions, Source, SourcePoll,
    checkpoint_history, run,
};
use stillpoint_connectors::{GeneratedWords, KeyedCount, TransactionalFileSink};
use stillpoint_wire::SourceOffset;
use support::config;

const STALL: Duration = Duration::from_secs(2);

/// Generated words; source 0 stalls once, `STALL` long, at position 5,000.
struct Stalling {
    words: GeneratedWords,
    stall_at: Option<u64>,
}

impl Source for Stalling {
    fn seek(&mut self, offset: Option<&SourceOffset>) -> Result<(), EngineError> {
        self.words.seek(offset)
    }
    fn poll(&mut self, max: usize, out: &mut Vec<Record>) -> Result<SourcePoll, EngineError> {
        let position = self.words.offset().as_u64().unwrap_or(0);
        if self.stall_at.is_some_and(|at| position >= at) {
            self.stall_at = None;
            std::thread::sleep(STALL);
        }
        self.words.poll(max, out)
    }
    fn offset(&self) -> SourceOffset {
        self.words.offset()
    }
}

/// The metrics text, or nothing once the job (and its endpoint) has ended.
fn get(address: SocketAddr) -> Option<String> {
    let mut stream = TcpStream::connect(address).ok()?;
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

/// The value of the first sample of `metric` that is not zero, if any.
fn nonzero(text: &str, metric: &str) -> Option<String> {
    text.lines()
        .filter(|l| l.starts_with(metric))
        .find(|l| !l.ends_with(" 0"))
        .map(str::to_owned)
}

#[test]
fn a_stalled_alignment_shows_in_the_metrics_and_the_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let flow = Dataflow::source("words", 2, |index| {
        Ok(Box::new(Stalling {
            words: GeneratedWords::new(5, index, 20_000, 300),
            stall_at: (index == 0).then_some(5_000),
        }) as Box<dyn Source>)
    })
    .operator("count", 2, Partitioning::Hash, |_| {
        Ok(Box::new(KeyedCount) as Box<dyn Operator>)
    })
    .sink(
        "publish",
        2,
        Partitioning::Forward,
        TransactionalFileSink::factory(dir.path().join("out")),
    );
    let mut config = config(dir.path());
    config.barrier_wait = Duration::from_millis(200);
    // A checkpoint is triggered during the stall even if the one before it is slow to
    // complete (on a loaded machine the first, which materializes, once took the whole
    // stall, so none aligned across it).
    config.max_concurrent_checkpoints = 4;
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let (address_tx, address_rx) = mpsc::channel();
    let options = RunOptions {
        on_metrics: Some(Box::new(move |address| {
            let _ = address_tx.send(address);
        })),
        ..RunOptions::default()
    };
    // Watch the endpoint while the job runs: the stall shows as a missing barrier.
    let watcher = std::thread::spawn(move || {
        let address = address_rx.recv().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let text = get(address)?;
            // A counter (task 3 or 4) waiting for the stalled source's barrier (task
            // 1's) with the other source's in: which input it waits for is shown.
            for task in [3, 4] {
                let awaiting = |upstream: u32, value: u32| {
                    format!(
                        "stillpoint_task_awaiting_barrier{{task=\"{task}\",upstream=\"{upstream}\"}} {value}\n"
                    )
                };
                let missing = format!("stillpoint_task_missing_barriers{{task=\"{task}\"}} 1\n");
                if text.contains(&awaiting(1, 1))
                    && text.contains(&awaiting(2, 0))
                    && text.contains(&missing)
                {
                    return Some((task, text));
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    });
    run(&config, &flow, options).unwrap();
    let (task, text) = watcher
        .join()
        .unwrap()
        .expect("no counter was ever shown waiting for the stalled source's barrier");
    // Read back as `stillpoint checkpoints stats` reads a running job's endpoint.
    let shown = stillpoint_metrics::in_flight(&text);
    let counter = shown
        .iter()
        .find(|t| t.task == task)
        .unwrap_or_else(|| panic!("task {task} not shown: {shown:?}"));
    assert_eq!(counter.awaiting, vec![1], "{shown:?}");
    assert!(
        counter
            .state()
            .contains("waiting for the barrier of task 1"),
        "{}",
        counter.state()
    );
    let aligning = format!("stillpoint_task_aligning_checkpoint{{task=\"{task}\"}} ");
    assert!(
        text.lines()
            .find_map(|l| l.strip_prefix(aligning.as_str()))
            .is_some_and(|id| id.parse::<u64>().unwrap() > 0),
        "{text}"
    );
    assert!(
        nonzero(&text, "stillpoint_task_snapshots_in_flight").is_some(),
        "the aligned source's snapshot is in flight meanwhile: {text}"
    );
    // Every completed checkpoint names each of the 6 tasks' times; the one that
    // waited for the stalled source aligned for most of the stall.
    let history = checkpoint_history(&config).unwrap();
    assert!(history.iter().all(|s| s.tasks.len() == 6), "{history:?}");
    let stalled = history
        .iter()
        .max_by_key(|s| s.max_alignment_micros)
        .unwrap();
    assert!(
        stalled.max_alignment_micros >= 1_000_000,
        "the longest alignment was {} µs",
        stalled.max_alignment_micros
    );
    let per_task_max = stalled.tasks.iter().map(|t| t.alignment_micros).max();
    assert_eq!(per_task_max, Some(stalled.max_alignment_micros));
    assert!(
        stalled.tasks.iter().any(|t| t.async_micros > 0),
        "{stalled:?}"
    );
}
