//! End to end over file inputs: a word count over text files crashed and restarted;
//! an unbounded word count over append-only logs stopped on request (after a final
//! checkpoint), resumed, and watched through its metrics endpoint.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stderr
)]

mod support;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use stillpoint::{JobConfig, RunOptions, StopHandle, run};
use stillpoint_connectors::{WordCount, WordInput};
use support::{Rng, committed_output, config, crash_loop, expected_output, scrape_metrics};

fn text(seed: u64, lines: usize) -> String {
    let mut rng = Rng(seed);
    let mut out = String::new();
    for _ in 0..lines {
        for _ in 0..rng.below(6) {
            out.push_str(&format!("w{} ", rng.below(300)));
        }
        out.push('\n');
    }
    out
}

#[test]
fn a_file_word_count_survives_crashes_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let paths: Vec<_> = (0..2)
        .map(|i| {
            let path = dir.path().join(format!("in-{i}.txt"));
            std::fs::write(&path, text(i, 250_000)).unwrap();
            path
        })
        .collect();
    let job = WordCount {
        sources: 2,
        aggregators: 3,
        input: WordInput::Files { paths },
        output: dir.path().join("out"),
        combine: false,
    };
    let seen = crash_loop(&config(dir.path()), &job, 8, Duration::from_millis(1200), 3);
    assert!(seen.crashes >= 4, "{seen:?}");
    assert!(seen.restored > 0, "{seen:?}");
    assert_eq!(committed_output(&job), expected_output(&job));
}

/// Runs the log word count until the committed output holds `expected` lines, then
/// pulls the stop and returns the run's report and the metrics seen while it ran.
fn run_until_caught_up(
    config: &JobConfig,
    job: &WordCount,
    expected: usize,
) -> (stillpoint::JobReport, String) {
    let stop = StopHandle::new();
    let (address_tx, address_rx) = mpsc::channel();
    let options = RunOptions {
        stop: stop.clone(),
        on_metrics: Some(Box::new(move |address| {
            let _sent = address_tx.send(address);
        })),
        ..RunOptions::default()
    };
    let (config_c, job_c) = (config.clone(), job.clone());
    let runner = std::thread::spawn(move || run(&config_c, &job_c, options));
    let address = address_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while committed_output(job).len() < expected {
        assert!(
            Instant::now() < deadline,
            "the log was not consumed in 120 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let metrics = scrape_metrics(address).expect("the metrics endpoint answers while the job runs");
    stop.stop();
    let report = runner.join().unwrap().unwrap();
    (report, metrics)
}

#[test]
fn a_log_word_count_stops_on_request_and_resumes_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let dirs: Vec<_> = (0..2)
        .map(|i| {
            let log = dir.path().join(format!("log-{i}"));
            std::fs::create_dir_all(&log).unwrap();
            std::fs::write(log.join("0001.log"), text(10 + i, 5_000)).unwrap();
            log
        })
        .collect();
    let job = WordCount {
        sources: 2,
        aggregators: 3,
        input: WordInput::Log { dirs: dirs.clone() },
        output: dir.path().join("out"),
        combine: false,
    };
    let mut config = config(dir.path());
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());

    let (first, metrics) = run_until_caught_up(&config, &job, expected_output(&job).len());
    assert_eq!(first.restored_from, None);
    assert_eq!(committed_output(&job), expected_output(&job));
    assert!(
        metrics.contains("stillpoint_checkpoints_completed_total")
            && metrics.contains("stillpoint_task_records_total{task=\"1\"}"),
        "{metrics}"
    );

    // More lines in new segments; the next run resumes from the final checkpoint of
    // the first and adds exactly their counts.
    for (i, log) in dirs.iter().enumerate() {
        std::fs::write(log.join("0002.log"), text(20 + i as u64, 3_000)).unwrap();
    }
    let expected = expected_output(&job);
    let (second, metrics) = run_until_caught_up(&config, &job, expected.len());
    assert_eq!(
        second.restored_from.map(|c| c.get()),
        first.checkpoints.last().map(|c| c.checkpoint),
        "resumes from the stop's final checkpoint"
    );
    assert!(
        metrics.contains(&format!(
            "stillpoint_restored_from_checkpoint {}",
            second.restored_from.unwrap().get()
        )),
        "{metrics}"
    );
    assert_eq!(committed_output(&job), expected);
}
