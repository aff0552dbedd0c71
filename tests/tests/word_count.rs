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

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stillpoint::{RunOptions, StopHandle, run, run_word_count};
use stillpoint_connectors::{WordCount, WordInput};
use support::{committed_output, config, crash_rounds, expected_output, percentile};

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
        combine: false,
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
    let (seen, round) = crash_rounds(
        crashes,
        1,
        |dir, _| (config(dir), job(dir, 100_000)),
        |_, job, round, _| {
            let output = committed_output(job);
            let expected = expected_output(job);
            assert_eq!(
                output.len(),
                expected.len(),
                "round {round}: lost or duplicated records; sink files: {:?}",
                support::sink_files(job)
            );
            assert_eq!(output, expected, "round {round}");
        },
    );
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

/// The published updates of a combined word count (one per word per flush) against
/// the failure-free totals: for every word its counts are distinct (a transaction
/// published twice would repeat them) and the last is its total (a lost or replayed
/// partial count would miss or overshoot it). Returns how many updates there were.
fn check_combined(job: &WordCount, round: u64) -> usize {
    let totals = support::totals(job);
    let mut published: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let output = committed_output(job);
    for (word, count) in &output {
        published
            .entry(word.clone())
            .or_default()
            .push(count.parse().unwrap());
    }
    assert_eq!(
        published.keys().collect::<Vec<_>>(),
        totals.keys().collect::<Vec<_>>(),
        "round {round}: the words published"
    );
    for (word, mut counts) in published {
        counts.sort_unstable();
        let updates = counts.len();
        counts.dedup();
        assert_eq!(
            counts.len(),
            updates,
            "round {round}: `{word}` published a count twice"
        );
        assert_eq!(
            counts.last(),
            totals.get(&word),
            "round {round}: `{word}`'s last count is not its total"
        );
    }
    output.len()
}

#[test]
fn a_combined_count_publishes_the_same_totals_in_fewer_updates() {
    let dir = tempfile::tempdir().unwrap();
    let job = WordCount {
        combine: true,
        ..job(dir.path(), 20_000)
    };
    run_word_count(&config(dir.path()), &job, None).unwrap();
    let updates = check_combined(&job, 0);
    // 40,000 words over 500 keys: at most 5,000 words between two flushes (or a
    // barrier, every 30 ms), so far fewer updates than words.
    assert!(updates < 20_000, "{updates} updates for 40,000 words");
}

#[test]
fn a_combined_count_survives_random_crashes_exactly_once() {
    let (seen, _) = crash_rounds(
        15,
        1,
        |dir, _| {
            let job = WordCount {
                combine: true,
                ..job(dir, 100_000)
            };
            (config(dir), job)
        },
        |_, job, round, _| {
            check_combined(job, round);
        },
    );
    assert!(
        seen.restored > 0,
        "no run ever restored: the crashes came too early"
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

    // The sinks published the newest checkpoint's output and recorded the source
    // offsets it covers: the run restores the one before, replays exactly up to
    // those offsets, drops what it reproduces there and goes on. A crash inside the
    // replay (before its checkpoint completed) replays again on the next run. The
    // first crash comes 10 ms after the tasks start (the rest of the job took 80 to
    // 160 ms here, so a crash at 40 ms was one fast machine away from never firing).
    let mut crash = Some(Duration::from_millis(10));
    let mut crashes = 0;
    let report = loop {
        match run_word_count(&config, &job, crash) {
            Err(stillpoint::EngineError::Crashed(_)) => {
                crashes += 1;
                crash = crash
                    .map(|after| after * 2)
                    .filter(|after| after.as_millis() < 400);
            }
            Ok(report) => break report,
            Err(error) => panic!("{error}"),
        }
    };
    // The last run fell back too, unless a crashed one completed the replay's
    // checkpoint (then it restored that one).
    assert!(crashes >= 1, "no run was crashed");
    eprintln!(
        "fallback with crashes: {crashes} crashed runs, then {:?} restored, replayed {:?}",
        report.restored_from, report.replayed
    );
    if let Some(fallback) = report.fell_back_from.first() {
        assert_eq!(report.restored_from, Some(ids[ids.len() - 2]));
        assert_eq!(fallback.checkpoint, newest.checkpoint);
        assert!(
            fallback.problem.contains(newest.tasks[0].manifest.as_str()),
            "the problem names the file: {}",
            fallback.problem
        );
    }
    // Exactly the failure-free output: nothing lost, nothing published twice.
    let output = committed_output(&job);
    let expected = expected_output(&job);
    assert_eq!(support::missing_from(&output, &expected), 0, "lines lost");
    assert_eq!(output.len(), expected.len(), "lines published twice");
    assert_eq!(output, expected);
}

/// The replay itself, with no crash: the report says what it reproduced, and the
/// sinks published each of the failure-free lines once.
#[test]
fn a_fallback_past_published_output_replays_it_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let job = job(dir.path(), 60_000);
    let config = config(dir.path());
    run_word_count(&config, &job, None).unwrap();
    let store_dir = dir.path().join("work/store");
    let mut commits: Vec<_> = std::fs::read_dir(store_dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("_checkpoint.json").exists())
        .collect();
    commits.sort();
    assert!(commits.len() >= 2, "{commits:?}");
    // Damage the newest checkpoints back to the newest that published records (the
    // last one may only have covered the end of the input, publishing nothing).
    let id_of = |path: &std::path::Path| -> u64 {
        path.file_name().unwrap().to_str().unwrap().parse().unwrap()
    };
    let newest_id = id_of(commits.last().unwrap());
    loop {
        let damaged = commits.pop().unwrap();
        std::fs::write(damaged.join("_checkpoint.json"), b"{ not a manifest").unwrap();
        if support::committed_lines_of(&job, id_of(&damaged)) > 0 {
            break;
        }
    }
    assert!(!commits.is_empty(), "no intact checkpoint left to restore");
    let report = run_word_count(&config, &job, None).unwrap();
    let replayed = report.replayed.expect("a replay");
    assert_eq!(replayed.through.get(), newest_id);
    assert!(replayed.records > 0, "{replayed:?}");
    assert!(
        report.checkpoints.iter().all(|c| c.checkpoint > newest_id),
        "new checkpoint ids continue after the published ones: {:?}",
        report
            .checkpoints
            .iter()
            .map(|c| c.checkpoint)
            .collect::<Vec<_>>()
    );
    assert_eq!(committed_output(&job), expected_output(&job));
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

/// Up to three checkpoints in flight at once, triggered every 10 ms with a 5 ms
/// minimum pause (so most overlap: one takes tens of ms here), crashed at random:
/// the job still publishes exactly the failure-free output.
#[test]
fn concurrent_checkpoints_through_crashes_lose_and_duplicate_nothing() {
    let (seen, round) = crash_rounds(
        10,
        101,
        |dir, _| {
            let mut config = config(dir);
            config.checkpoint_interval = Duration::from_millis(10);
            config.max_concurrent_checkpoints = 3;
            config.min_pause = Duration::from_millis(5);
            (config, job(dir, 100_000))
        },
        |_, job, round, this| {
            assert_eq!(
                committed_output(job),
                expected_output(job),
                "round {round}: {this:?}"
            );
        },
    );
    assert!(seen.restored > 0, "{seen:?}");
    eprintln!(
        "e2e concurrent: {round} rounds, {} crashes, {} restores, {} checkpoints, duration p50 {} ms (interval 10 ms, up to 3 at once)",
        seen.crashes,
        seen.restored,
        seen.checkpoints,
        percentile(&seen.durations_millis, 50),
    );
}

/// Paused, the sources read nothing while checkpoints go on; resumed, the job
/// finishes exactly once.
#[test]
fn a_paused_job_reads_nothing_while_checkpoints_go_on_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let job = job(dir.path(), 20_000);
    let stop = StopHandle::new();
    stop.pause();
    // (checkpoint, committed lines) at checkpoints 3 and 8, both taken while paused.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let on_checkpoint = {
        let (stop, seen, job) = (stop.clone(), Arc::clone(&seen), job.clone());
        move |stats: &stillpoint::CheckpointStats| {
            if stop.paused() && matches!(stats.checkpoint, 3 | 8) {
                let lines = stillpoint_connectors::read_committed(&job.output)
                    .map_or(0, |lines| lines.len());
                seen.lock().unwrap().push((stats.checkpoint, lines));
                if stats.checkpoint == 8 {
                    stop.resume();
                }
            }
        }
    };
    let options = RunOptions {
        stop: stop.clone(),
        on_checkpoint: Some(Box::new(on_checkpoint)),
        ..RunOptions::default()
    };
    let report = run(&config(dir.path()), &job, options).unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "checkpoints 3 and 8 while paused: {seen:?}");
    assert_eq!(
        seen[0].1, seen[1].1,
        "output grew between checkpoints 3 and 8 while paused: {seen:?}"
    );
    assert!(
        seen[1].1 < 40_000,
        "the job finished while paused: {seen:?}"
    );
    assert!(report.checkpoints.len() > 8, "{}", report.checkpoints.len());
    assert_eq!(committed_output(&job), expected_output(&job));
}
