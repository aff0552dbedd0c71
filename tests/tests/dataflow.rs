//! End to end: a general dataflow with a stage of each kind of edge — 2 generated
//! sources → hash → keyed counters → broadcast → stateful witnesses → forward →
//! exactly-once file sinks — crashed at random moments and restarted, and restored
//! with other parallelisms of its hash-fed and broadcast stages.
//!
//! Every witness sees every count update and counts, in its own keyed state, the
//! updates of each word it has seen; it publishes `count:seen`. Exactly once through
//! crashes and rescales means every published line has `seen == count` (no update
//! lost or seen twice by any witness's state), and every update is published once per
//! witness.
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
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use stillpoint::{
    CachedState, Dataflow, EngineError, KeyedState, Operator, Partitioning, Persist, Record, Sink,
    Source, run_word_count,
};
use stillpoint_connectors::{GeneratedWords, KeyedCount, TransactionalFileSink, read_committed};
use support::{config, crash_rounds};

const SEED: u64 = 7;
const VOCABULARY: u32 = 300;

/// Counts, per word, the updates this task has seen; emits `count:seen`.
struct Witness;

impl Operator for Witness {
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        let seen = state
            .get_cached("seen", &record.key, &[])?
            .map_or(0, |b| u64::from_be_bytes(b.as_slice().try_into().unwrap()))
            + 1;
        state.put("seen", &record.key, &[], &seen.to_be_bytes())?;
        let count = String::from_utf8(record.value.to_vec()).unwrap();
        out.push(Record::new(record.key, format!("{count}:{seen}")));
        Ok(())
    }
}

fn flow(dir: &Path, words: u64, counters: u32, witnesses: u32) -> Dataflow {
    Dataflow::source("words", 2, move |index| {
        Ok(Box::new(GeneratedWords::new(SEED, index, words, VOCABULARY)) as Box<dyn Source>)
    })
    .operator("count", counters, Partitioning::Hash, |_| {
        Ok(Box::new(KeyedCount) as Box<dyn Operator>)
    })
    .operator("witness", witnesses, Partitioning::Broadcast, |_| {
        Ok(Box::new(Witness) as Box<dyn Operator>)
    })
    .sink(
        "publish",
        witnesses,
        Partitioning::Forward,
        TransactionalFileSink::factory(dir.join("out")),
    )
}

/// How often each word occurs in the whole input.
fn totals(words: u64) -> BTreeMap<String, u64> {
    support::word_totals(SEED, 2, words, VOCABULARY)
}

/// The published lines: word → count → (seen values, one per witness that published).
fn published(dir: &Path) -> BTreeMap<String, BTreeMap<u64, Vec<u64>>> {
    let mut out: BTreeMap<String, BTreeMap<u64, Vec<u64>>> = BTreeMap::new();
    for (word, value) in read_committed(&dir.join("out")).unwrap() {
        let (count, seen) = value.split_once(':').unwrap();
        out.entry(word)
            .or_default()
            .entry(count.parse().unwrap())
            .or_default()
            .push(seen.parse().unwrap());
    }
    out
}

/// Checks the published output against the input: every update `1..=total` of every
/// word, each published by `before` witnesses up to some update and by `after` from
/// then on (the restore point; `before == after` without a rescale), every line with
/// `seen == count`.
fn check(dir: &Path, words: u64, before: usize, after: usize) {
    let totals = totals(words);
    let published = published(dir);
    assert_eq!(
        published.keys().collect::<Vec<_>>(),
        totals.keys().collect::<Vec<_>>(),
        "words published"
    );
    for (word, total) in &totals {
        let updates = &published[word];
        assert_eq!(
            updates.keys().copied().collect::<Vec<_>>(),
            (1..=*total).collect::<Vec<_>>(),
            "{word}: updates lost or invented"
        );
        let mut rescaled = false;
        for (count, seen) in updates {
            assert!(
                seen.iter().all(|s| s == count),
                "{word} update {count}: witnesses saw {seen:?} (lost or repeated)"
            );
            rescaled |= before != after && seen.len() == after;
            let expected = if rescaled { after } else { before };
            assert_eq!(
                seen.len(),
                expected,
                "{word} update {count}: published {} times (lines {seen:?})",
                seen.len()
            );
        }
    }
}

#[test]
fn hash_broadcast_and_forward_edges_survive_random_crashes_exactly_once() {
    let words = 60_000;
    let (seen, rounds) = crash_rounds(
        12,
        11,
        |dir, _| (config(dir), flow(dir, words, 3, 2)),
        |dir, _, _, _| check(dir, words, 2, 2),
    );
    assert!(
        seen.checkpoints > 1,
        "too few checkpoints to restore from: {seen:?}"
    );
    eprintln!(
        "dataflow: {rounds} rounds, {} crashes, {} restores, {} checkpoints, {:.1} s",
        seen.crashes,
        seen.restored,
        seen.checkpoints,
        seen.elapsed.as_secs_f64()
    );
}

#[test]
fn a_restore_rescales_the_hash_fed_and_the_broadcast_stages() {
    for (counters, witnesses) in [((3, 4), (2, 3)), ((2, 1), (3, 1))] {
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path());
        let words = 60_000;
        let before = flow(dir.path(), words, counters.0, witnesses.0);
        let mut crash = Duration::from_millis(200);
        loop {
            match run_word_count(&config, &before, Some(crash)) {
                Err(EngineError::Crashed(_)) => {}
                other => panic!("the run should have been crashed: {other:?}"),
            }
            if !stillpoint::checkpoint_history(&config).unwrap().is_empty() {
                break;
            }
            crash *= 2;
        }
        let after = flow(dir.path(), words, counters.1, witnesses.1);
        let report = run_word_count(&config, &after, None).unwrap();
        assert!(report.restored_from.is_some(), "{report:?}");
        check(
            dir.path(),
            words,
            witnesses.0 as usize,
            witnesses.1 as usize,
        );
        // The old sinks' transactions were settled, whatever their task ids now are.
        let pending: Vec<_> = std::fs::read_dir(dir.path().join("out/pending"))
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(pending.is_empty(), "left pending: {pending:?}");
    }
}

#[test]
fn a_restore_cannot_change_the_stages_or_the_sources() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path());
    let words = 2_000;
    run_word_count(&config, &flow(dir.path(), words, 2, 2), None).unwrap();
    let fewer_stages = Dataflow::source("words", 2, move |index| {
        Ok(Box::new(GeneratedWords::new(SEED, index, words, VOCABULARY)) as Box<dyn Source>)
    })
    .sink(
        "publish",
        2,
        Partitioning::Hash,
        TransactionalFileSink::factory(dir.path().join("out2")),
    );
    let error = run_word_count(&config, &fewer_stages, None).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("taken with 4 stages, the dataflow has 2"),
        "{error}"
    );
    let wider_sources = Dataflow::source("words", 3, move |index| {
        Ok(Box::new(GeneratedWords::new(SEED, index, words, VOCABULARY)) as Box<dyn Source>)
    })
    .operator("count", 2, Partitioning::Hash, |_| {
        Ok(Box::new(KeyedCount) as Box<dyn Operator>)
    })
    .operator("witness", 2, Partitioning::Broadcast, |_| {
        Ok(Box::new(Witness) as Box<dyn Operator>)
    })
    .sink(
        "publish",
        2,
        Partitioning::Forward,
        TransactionalFileSink::factory(dir.path().join("out")),
    );
    let error = run_word_count(&config, &wider_sources, None).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("taken with 2 sources, the job has 3"),
        "{error}"
    );
}

/// A sink whose first pre-commit (across the stage: the first task to see `fail`
/// set) fails: its transaction cannot be made durable (a full disk, say), or, with
/// `refuse`, the pre-commit itself refuses, which aborts the checkpoint.
struct FailsOnce {
    inner: TransactionalFileSink,
    fail: Arc<AtomicBool>,
    refuse: bool,
}

impl Sink for FailsOnce {
    fn write(&mut self, record: Record) -> Result<(), EngineError> {
        self.inner.write(record)
    }

    fn pre_commit(
        &mut self,
        checkpoint: stillpoint_wire::CheckpointId,
    ) -> Result<Option<Persist>, EngineError> {
        if self.refuse && self.fail.swap(false, Ordering::SeqCst) {
            return Err(EngineError::Invalid("injected: pre-commit refused".into()));
        }
        let persist = self.inner.pre_commit(checkpoint)?;
        if !self.refuse && self.fail.swap(false, Ordering::SeqCst) {
            return Ok(Some(Box::new(|| {
                Err(EngineError::Invalid("injected: no space left".into()))
            })));
        }
        Ok(persist)
    }

    fn commit(&mut self, checkpoint: stillpoint_wire::CheckpointId) -> Result<(), EngineError> {
        self.inner.commit(checkpoint)
    }

    fn recover(
        &mut self,
        restored: Option<stillpoint_wire::CheckpointId>,
    ) -> Result<(), EngineError> {
        self.inner.recover(restored)
    }
}

/// 2 sources → 2 counters → 2 [`FailsOnce`] sinks (refusing or failing to persist).
fn failing_flow(out: &Path, words: u64, fail: &Arc<AtomicBool>, refuse: bool) -> Dataflow {
    let (fail, out) = (Arc::clone(fail), out.to_path_buf());
    Dataflow::source("words", 2, move |index| {
        Ok(Box::new(GeneratedWords::new(SEED, index, words, VOCABULARY)) as Box<dyn Source>)
    })
    .operator("count", 2, Partitioning::Hash, |_| {
        Ok(Box::new(KeyedCount) as Box<dyn Operator>)
    })
    .sink("publish", 2, Partitioning::Forward, move |task| {
        Ok(Box::new(FailsOnce {
            inner: TransactionalFileSink::new(&out, task),
            fail: Arc::clone(&fail),
            refuse,
        }) as Box<dyn Sink>)
    })
}

/// The published counts under `out` are exactly the failure-free run's.
fn assert_published_exactly(out: &Path, words: u64) {
    let mut published = read_committed(out).unwrap();
    published.sort();
    let mut expected: Vec<(String, String)> = totals(words)
        .into_iter()
        .flat_map(|(word, n)| (1..=n).map(move |k| (word.clone(), k.to_string())))
        .collect();
    expected.sort();
    assert_eq!(published.len(), expected.len(), "lost or duplicated");
    assert_eq!(published, expected);
}

#[test]
fn a_pre_commit_that_cannot_be_made_durable_fails_the_job_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path());
    let words = 20_000;
    let fail = Arc::new(AtomicBool::new(true));
    let out = dir.path().join("out");
    let flow = failing_flow(&out, words, &fail, false);
    let error = run_word_count(&config, &flow, None).unwrap_err();
    assert!(
        error.to_string().contains("could not be made durable")
            && error.to_string().contains("injected: no space left"),
        "{error}"
    );
    run_word_count(&config, &flow, None).unwrap();
    assert_published_exactly(&out, words);
}

/// Stop with a savepoint whose first attempt is aborted (a sink refuses its
/// pre-commit): the job asks for the savepoint again and ends on the second one, and
/// a restart from it publishes exactly the failure-free output. No periodic
/// checkpoint runs (an hour's interval), so checkpoint 1 is the aborted savepoint.
#[test]
fn an_aborted_stop_savepoint_is_taken_again_and_the_job_ends_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.checkpoint_interval = Duration::from_secs(3600);
    let words = 600_000;
    let fail = Arc::new(AtomicBool::new(false));
    let out = dir.path().join("out");
    let flow = failing_flow(&out, words, &fail, true);
    let stop = stillpoint::StopHandle::new();
    let (pull, arm) = (stop.clone(), Arc::clone(&fail));
    let options = stillpoint::RunOptions {
        stop,
        on_start: Some(Box::new(move |_| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                arm.store(true, Ordering::SeqCst);
                pull.stop_with_savepoint();
            });
        })),
        ..stillpoint::RunOptions::default()
    };
    let report = stillpoint::run(&config, &flow, options).unwrap();
    assert!(!fail.load(Ordering::SeqCst), "no pre-commit was refused");
    let ids: Vec<_> = report
        .checkpoints
        .iter()
        .map(|c| (c.checkpoint, c.kind.as_str()))
        .collect();
    assert_eq!(
        ids,
        [(2, "savepoint")],
        "savepoint 1 aborted, savepoint 2 ends the job"
    );
    let published = read_committed(&out).unwrap().len();
    let total: u64 = totals(words).values().sum();
    assert!(
        (published as u64) < total,
        "the job was to stop before its input ended"
    );
    let again = run_word_count(&config, &flow, None).unwrap();
    assert_eq!(again.restored_from.map(|id| id.get()), Some(2));
    assert_published_exactly(&out, words);
}

/// A sink that cannot say what it published (its factory is a closure:
/// `SinkFactory::published_after` is unknown): a fallback past a damaged newest
/// checkpoint cannot rule out publishing that checkpoint's output again, so the run
/// is refused naming the restore point and the stage; with duplicates allowed it
/// restores the older checkpoint, and nothing is lost.
#[test]
fn a_fallback_is_refused_for_a_sink_that_cannot_say_what_it_published() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    let words = 20_000;
    let out = dir.path().join("out");
    let flow = failing_flow(&out, words, &Arc::new(AtomicBool::new(false)), false);
    let first = run_word_count(&config, &flow, None).unwrap();
    let newest = first.checkpoints.last().unwrap().checkpoint;
    assert!(
        first.checkpoints.len() >= 2,
        "{:?}",
        first.checkpoints.len()
    );
    let manifest = config
        .work_dir
        .join("store/checkpoints")
        .join(format!("{newest:020}"))
        .join("tasks/task-1.json");
    let mut bytes = std::fs::read(&manifest).unwrap();
    bytes[10] ^= 0x20;
    std::fs::write(&manifest, bytes).unwrap();

    let error = run_word_count(&config, &flow, None).unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, EngineError::WouldRepublish { .. })
            && message.contains("sink stage \"publish\"")
            && message.contains("cannot say what it published")
            && message.contains("--allow-duplicates"),
        "{message}"
    );
    config.allow_duplicates = true;
    let second = run_word_count(&config, &flow, None).unwrap();
    assert!(second.restored_from.is_some_and(|r| r.get() < newest));
    assert_eq!(
        second.fell_back_from.first().map(|f| f.checkpoint.get()),
        Some(newest)
    );
    // At least once: every count is there; the replayed stretch is there twice
    // (it is empty when the newest checkpoint only covered the end of the input).
    let published = read_committed(&out).unwrap();
    let expected: u64 = totals(words).values().sum();
    assert!(
        published.len() as u64 >= expected,
        "{} of {expected}",
        published.len()
    );
    let distinct: std::collections::BTreeSet<_> = published.into_iter().collect();
    assert_eq!(distinct.len() as u64, expected, "every count once at least");
}

/// A sink stage that says what it published but records no source offsets with it.
struct Unrecorded(stillpoint_connectors::FileSinkFactory);

impl stillpoint::SinkFactory for Unrecorded {
    fn create(&self, task: stillpoint_wire::TaskId) -> Result<Box<dyn Sink>, EngineError> {
        self.0.create(task)
    }

    fn published_after(
        &self,
        restored: Option<stillpoint_wire::CheckpointId>,
    ) -> Result<Option<stillpoint::Published>, EngineError> {
        self.0.published_after(restored)
    }
}

/// A keyed count documented as non-deterministic.
struct NonDeterministic(KeyedCount);

impl Operator for NonDeterministic {
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        self.0.process(record, state, out)
    }

    fn deterministic(&self) -> bool {
        false
    }
}

/// A generated source that cannot stop at an offset.
struct Unstoppable(GeneratedWords);

impl Source for Unstoppable {
    fn seek(&mut self, offset: Option<&stillpoint_wire::SourceOffset>) -> Result<(), EngineError> {
        self.0.seek(offset)
    }

    fn poll(
        &mut self,
        max: usize,
        out: &mut Vec<Record>,
    ) -> Result<stillpoint::SourcePoll, EngineError> {
        self.0.poll(max, out)
    }

    fn offset(&self) -> stillpoint_wire::SourceOffset {
        self.0.offset()
    }
}

/// Where a fallback past published output cannot be replayed exactly — an operator
/// documented as non-deterministic, a sink that recorded no source offsets, a source
/// that cannot stop at one — the run is refused,
/// naming the restore point, the checkpoints, the records and why; allowed, it
/// publishes exactly those records again and loses nothing.
#[test]
fn a_fallback_that_cannot_be_replayed_exactly_is_refused_saying_why() {
    type Flow = fn(&Path, u64) -> Dataflow;
    let cases: [(&str, Flow); 3] = [
        ("stage \"count\" is not deterministic", |out, words| {
            Dataflow::source("words", 2, move |index| {
                Ok(
                    Box::new(GeneratedWords::new(SEED, index, words, VOCABULARY))
                        as Box<dyn Source>,
                )
            })
            .operator("count", 2, Partitioning::Hash, |_| {
                Ok(Box::new(NonDeterministic(KeyedCount)) as Box<dyn Operator>)
            })
            .sink(
                "publish",
                2,
                Partitioning::Forward,
                TransactionalFileSink::factory(out),
            )
        }),
        (
            "the sink did not record the source offsets",
            |out, words| {
                Dataflow::source("words", 2, move |index| {
                    Ok(
                        Box::new(GeneratedWords::new(SEED, index, words, VOCABULARY))
                            as Box<dyn Source>,
                    )
                })
                .operator("count", 2, Partitioning::Hash, |_| {
                    Ok(Box::new(KeyedCount) as Box<dyn Operator>)
                })
                .sink(
                    "publish",
                    2,
                    Partitioning::Forward,
                    Unrecorded(TransactionalFileSink::factory(out)),
                )
            },
        ),
        ("stage \"words\" cannot stop at an offset", |out, words| {
            Dataflow::source("words", 2, move |index| {
                Ok(Box::new(Unstoppable(GeneratedWords::new(
                    SEED, index, words, VOCABULARY,
                ))) as Box<dyn Source>)
            })
            .operator("count", 2, Partitioning::Hash, |_| {
                Ok(Box::new(KeyedCount) as Box<dyn Operator>)
            })
            .sink(
                "publish",
                2,
                Partitioning::Forward,
                TransactionalFileSink::factory(out),
            )
        }),
    ];
    for (why, flow) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut config = config(dir.path());
        let words = 20_000;
        let out = dir.path().join("out");
        let flow = flow(&out, words);
        let first = run_word_count(&config, &flow, None).unwrap();
        let newest = first.checkpoints.last().unwrap().checkpoint;
        assert!(first.checkpoints.len() >= 2, "{why}");
        let commit = config
            .work_dir
            .join("store/checkpoints")
            .join(format!("{newest:020}"))
            .join("_checkpoint.json");
        std::fs::write(&commit, b"damaged").unwrap();

        let error = run_word_count(&config, &flow, None).unwrap_err();
        let message = error.to_string();
        assert!(
            matches!(error, EngineError::WouldRepublish { .. })
                && message.contains("sink stage \"publish\"")
                && message.contains(&format!("the output of checkpoint(s) {newest} ("))
                && message.contains(&format!("cannot be replayed exactly: {why}"))
                && message.contains("--allow-duplicates"),
            "{message}"
        );
        let named: usize = message
            .split_once(" records)")
            .and_then(|(before, _)| before.rsplit_once('(')?.1.parse().ok())
            .unwrap_or_else(|| panic!("{message}"));
        // (0 when the newest checkpoint only covered the end of the input: refused
        // all the same — the engine does not yet tell an empty published output.)
        config.allow_duplicates = true;
        let second = run_word_count(&config, &flow, None).unwrap();
        assert_eq!(second.replayed, None, "{why}");
        let published = read_committed(&out).unwrap();
        let expected: u64 = totals(words).values().sum();
        assert_eq!(published.len() as u64, expected + named as u64, "{why}");
        let distinct: std::collections::BTreeSet<_> = published.into_iter().collect();
        assert_eq!(
            distinct.len() as u64,
            expected,
            "{why}: every count once at least"
        );
    }
}
