//! End to end: the keyed word count (2 generated sources → 3 keyed counters → 3
//! exactly-once file sinks) on RocksDB state and a `file://` store, crashed at random
//! moments and restarted; the published output must equal the failure-free output.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stderr
)]

mod support;

use std::time::Duration;

use stillpoint::{RunOptions, StopHandle, WordCount, WordInput, run_word_count};
use support::{committed_output, config, crash_loop, expected_output, percentile};

fn job(dir: &std::path::Path, words_per_source: u64) -> WordCount {
    WordCount {
        sources: 2,
        aggregators: 3,
        input: WordInput::Generated {
            words_per_source,
            vocabulary: 500,
            seed: 42,
        },
        output: dir.join("out"),
    }
}

#[test]
fn a_failure_free_run_publishes_every_count_once() {
    let dir = tempfile::tempdir().unwrap();
    let job = job(dir.path(), 20_000);
    let report = run_word_count(&config(dir.path()), &job, None).unwrap();
    assert_eq!(report.restored_from, None);
    assert!(!report.checkpoints.is_empty());
    assert_eq!(committed_output(&job), expected_output(&job));
    // A second run on the finished store restores the final checkpoint and adds nothing.
    let again = run_word_count(&config(dir.path()), &job, None).unwrap();
    assert!(again.restored_from.is_some());
    assert_eq!(committed_output(&job), expected_output(&job));
}

#[test]
fn fifty_random_crashes_lose_and_duplicate_nothing() {
    let crashes: u32 = std::env::var("STILLPOINT_E2E_CRASHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let mut seen = support::CrashLoop::default();
    let mut round = 0;
    // Rounds on fresh directories until the job was crashed often enough: each round
    // runs its input to the end and is checked on its own.
    while seen.crashes < crashes {
        round += 1;
        let dir = tempfile::tempdir().unwrap();
        let job = job(dir.path(), 100_000);
        let this = crash_loop(
            &config(dir.path()),
            &job,
            crashes - seen.crashes,
            Duration::from_millis(300),
            round,
        );
        let output = committed_output(&job);
        let expected = expected_output(&job);
        assert_eq!(
            output.len(),
            expected.len(),
            "round {round}: lost or duplicated records; sink files: {:?}",
            support::sink_files(&job)
        );
        assert_eq!(output, expected, "round {round}");
        seen.merge(this);
    }
    assert!(
        seen.restored > 0,
        "no run ever restored: the crashes came too early"
    );
    eprintln!(
        "e2e: {round} rounds, {} crashes, {} restores, {} checkpoints, duration p50 {} ms p99 {} ms, stall p50 {} µs p99 {} µs, {:.1} s",
        seen.crashes,
        seen.restored,
        seen.checkpoints,
        percentile(&seen.durations_millis, 50),
        percentile(&seen.durations_millis, 99),
        percentile(&seen.stalls_micros, 50),
        percentile(&seen.stalls_micros, 99),
        seen.elapsed.as_secs_f64()
    );
}

#[test]
fn recovery_falls_back_past_a_corrupt_checkpoint_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let job = job(dir.path(), 100_000);
    let config = config(dir.path());
    let store_dir = dir.path().join("work/store");
    let committed = || {
        let store = stillpoint_backup::Store::open(
            &format!("file://{}", store_dir.display()),
            stillpoint_backup::StoreOptions::default(),
        )
        .unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let ids = runtime.block_on(store.committed_ids()).unwrap();
        let newest = ids
            .last()
            .map(|id| runtime.block_on(store.checkpoint(*id)).unwrap());
        (ids, newest)
    };
    // A complete run leaves several retained checkpoints (30 ms interval, 3 kept).
    run_word_count(&config, &job, None).unwrap();
    assert!(committed().0.len() >= 2, "{:?}", committed().0);
    let (ids, newest) = committed();
    let newest = newest.unwrap();
    // Flip a byte of one task manifest of the newest checkpoint.
    let victim = store_dir.join(newest.tasks[0].manifest.as_str());
    let mut bytes = std::fs::read(&victim).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&victim, bytes).unwrap();

    // The sinks published the newest checkpoint's output: restoring the one before
    // would publish it again, so the run is refused, naming both.
    let refused = run_word_count(&config, &job, None).unwrap_err();
    let stillpoint::EngineError::WouldRepublish {
        restored,
        published,
        ..
    } = &refused
    else {
        panic!("{refused}");
    };
    assert_eq!(
        *restored,
        format!("checkpoint {}", ids[ids.len() - 2].get())
    );
    assert!(
        published.starts_with(&format!(
            "the output of checkpoint(s) {} (",
            newest.checkpoint.get()
        )),
        "{published}"
    );
    let named: usize = published
        .rsplit_once('(')
        .and_then(|(_, n)| n.strip_suffix(" records)")?.parse().ok())
        .unwrap();
    let mut config = config;
    config.allow_duplicates = true;
    let report = run_word_count(&config, &job, None).unwrap();
    assert_eq!(report.fell_back_from.len(), 1, "{report:?}");
    assert_eq!(report.fell_back_from[0].checkpoint, newest.checkpoint);
    assert!(
        report.fell_back_from[0]
            .problem
            .contains(newest.tasks[0].manifest.as_str()),
        "the problem names the file: {}",
        report.fell_back_from[0].problem
    );
    assert_eq!(report.restored_from, Some(ids[ids.len() - 2]));
    // Nothing is lost. Output the sinks published for the skipped checkpoint is
    // published again by the replay, exactly the records the refusal named
    // (duplicates allowed: a published transaction is never taken back).
    let output = committed_output(&job);
    let expected = expected_output(&job);
    let missing = support::missing_from(&output, &expected);
    assert_eq!(missing, 0, "{missing} lines lost");
    assert_eq!(output.len(), expected.len() + named);
}

#[test]
fn a_restore_with_other_counter_parallelism_rescales_by_key_group() {
    for (before, after) in [(3, 2), (2, 4)] {
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path());
        let mut job = job(dir.path(), 150_000);
        job.aggregators = before;
        // Crash once a checkpoint is committed, then go on with another parallelism.
        let mut crash = Duration::from_millis(250);
        loop {
            match run_word_count(&config, &job, Some(crash)) {
                Err(stillpoint::EngineError::Crashed(_)) => {}
                other => panic!("the run should have been crashed: {other:?}"),
            }
            if !stillpoint::checkpoint_history(&config).unwrap().is_empty() {
                break;
            }
            crash *= 2;
        }
        job.aggregators = after;
        let report = run_word_count(&config, &job, None).unwrap();
        assert!(report.restored_from.is_some(), "{report:?}");
        assert_eq!(
            committed_output(&job),
            expected_output(&job),
            "{before} → {after} counters"
        );
    }
}

/// Stop with a savepoint (`StopHandle::stop_with_savepoint`, the CLI's
/// `--savepoint-on-stop`): the run ends on a savepoint before its input does;
/// retention keeps it past newer checkpoints; a run with another counter parallelism
/// restores it and publishes exactly the failure-free output.
#[test]
fn a_stop_with_savepoint_ends_on_a_savepoint_that_restores_rescaled() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path());
    let mut job = job(dir.path(), 400_000);
    let stop = StopHandle::new();
    let pull = stop.clone();
    let options = RunOptions {
        stop,
        on_checkpoint: Some(Box::new(move |stats| {
            if stats.checkpoint >= 2 {
                pull.stop_with_savepoint();
            }
        })),
        ..RunOptions::default()
    };
    let report = stillpoint::run(&config, &job, options).unwrap();
    let last = report.checkpoints.last().unwrap();
    assert_eq!(last.kind, "savepoint", "{report:?}");
    assert!(
        report
            .checkpoints
            .iter()
            .rev()
            .skip(1)
            .all(|c| c.kind == "checkpoint"),
        "one savepoint, the last: {report:?}"
    );
    assert!(
        committed_output(&job).len() < expected_output(&job).len(),
        "the run was to stop before its input ended"
    );

    job.aggregators = 2;
    let report = run_word_count(&config, &job, None).unwrap();
    assert_eq!(
        report.restored_from.map(|id| id.get()),
        Some(last.checkpoint)
    );
    assert!(report.checkpoints.len() > config.retention.keep_last);
    assert_eq!(committed_output(&job), expected_output(&job));
    let committed = |id: u64| {
        dir.path()
            .join(format!("work/store/checkpoints/{id:020}/_checkpoint.json"))
            .exists()
    };
    assert!(!committed(1), "retention kept an old periodic checkpoint");
    assert!(
        committed(last.checkpoint),
        "retention deleted the savepoint"
    );
}
