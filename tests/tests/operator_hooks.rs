//! End to end: the operator hooks. A mini-batch counter keeps each word's total in
//! keyed state but emits nothing while it processes: the words it touched wait in
//! memory and go out in `on_barrier` (before the barrier, so in that checkpoint), and
//! a per-task summary goes out in `on_end_of_input`. Memory is not checkpointed, so
//! only hooks carried out at the right moment publish every total exactly once
//! through crashes; and `open`/`close` bracket each task's life.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stderr
)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use bytes::Bytes;
use stillpoint::{
    CachedState, Dataflow, EngineError, KeyedState, Operator, Partitioning, Record, Source,
    run_word_count,
};
use stillpoint_connectors::{GeneratedWords, TransactionalFileSink, read_committed};
use stillpoint_wire::CheckpointId;
use support::{
    assert_totals_rise_once, config, crash_once_checkpointed, crash_rounds, word_totals,
};

const SEED: u64 = 21;
const VOCABULARY: u32 = 200;
/// The key of a task's end-of-input summary line (not a generated word).
const SUMMARY: &str = "#records";

fn read_u64(state: &mut CachedState, name: &str, key: &[u8]) -> u64 {
    state
        .get_cached(name, key, &[])
        .unwrap()
        .map_or(0, |b| u64::from_be_bytes(b.as_slice().try_into().unwrap()))
}

/// Totals per word in state; the words touched since the last barrier in memory only.
#[derive(Default)]
struct MiniBatchCount {
    dirty: BTreeSet<Bytes>,
    opened: bool,
    hooks: Arc<Hooks>,
}

#[derive(Default)]
struct Hooks {
    opened: AtomicU32,
    closed: AtomicU32,
    barriers: AtomicU32,
}

impl Operator for MiniBatchCount {
    fn open(&mut self, state: &mut CachedState) -> Result<(), EngineError> {
        // The state is open (restored) already: its key groups are the task's.
        assert!(!state.backend().key_group_range().is_empty());
        self.opened = true;
        self.hooks.opened.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        _out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        assert!(self.opened, "a record before open");
        let total = read_u64(state, "total", &record.key) + 1;
        state.put("total", &record.key, &[], &total.to_be_bytes())?;
        // The summary's count is not keyed by a record key: keep it under the record's
        // key too, so it moves with the key group on a rescale.
        let records = read_u64(state, "records", &record.key) + 1;
        state.put("records", &record.key, &[], &records.to_be_bytes())?;
        self.dirty.insert(record.key);
        Ok(())
    }

    fn on_barrier(
        &mut self,
        _checkpoint: CheckpointId,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        self.hooks.barriers.fetch_add(1, Ordering::SeqCst);
        for key in std::mem::take(&mut self.dirty) {
            let total = read_u64(state, "total", &key);
            out.push(Record::new(key, total.to_string()));
        }
        Ok(())
    }

    fn on_end_of_input(
        &mut self,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        // Emit from state and clear what was emitted: a second call (after a restore
        // from a checkpoint taken past the end) emits nothing again.
        let mut counted = Vec::new();
        let groups = state.backend().key_group_range();
        state.scan("records", groups, &mut |key, _field, value| {
            let value: [u8; 8] = value.try_into().unwrap();
            counted.push((key.to_vec(), u64::from_be_bytes(value)));
            true
        })?;
        let mut records = 0;
        for (key, count) in counted {
            records += count;
            state.delete("records", &key, &[])?;
        }
        if records > 0 {
            out.push(Record::new(
                Bytes::from_static(SUMMARY.as_bytes()),
                records.to_string(),
            ));
        }
        Ok(())
    }

    fn close(&mut self) -> Result<(), EngineError> {
        assert!(self.dirty.is_empty(), "closed with unpublished totals");
        self.hooks.closed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn flow(dir: &Path, words: u64, counters: u32, hooks: &Arc<Hooks>) -> Dataflow {
    let hooks = Arc::clone(hooks);
    Dataflow::source("words", 2, move |index| {
        Ok(Box::new(GeneratedWords::new(SEED, index, words, VOCABULARY)) as Box<dyn Source>)
    })
    .operator("mini-batch", counters, Partitioning::Hash, move |_| {
        Ok(Box::new(MiniBatchCount {
            hooks: Arc::clone(&hooks),
            ..MiniBatchCount::default()
        }) as Box<dyn Operator>)
    })
    .sink(
        "publish",
        counters,
        Partitioning::Forward,
        TransactionalFileSink::factory(dir.join("out")),
    )
}

/// Exactly once: each word's published totals rise strictly (a total published twice
/// was republished; one never published was lost at a barrier) and end at the word's
/// count; the summaries add up to every record, one per operator task at most.
fn check(dir: &Path, words: u64, counters: u32) {
    let totals = word_totals(SEED, 2, words, VOCABULARY);
    let mut published: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut summaries = Vec::new();
    for (key, value) in read_committed(&dir.join("out")).unwrap() {
        let value: u64 = value.parse().unwrap();
        if key == SUMMARY {
            summaries.push(value);
        } else {
            published.entry(key).or_default().push(value);
        }
    }
    assert_totals_rise_once(&published, &totals);
    assert!(
        summaries.len() <= counters as usize,
        "one summary per task at most: {summaries:?}"
    );
    assert_eq!(
        summaries.iter().sum::<u64>(),
        2 * words,
        "the end-of-input summaries cover every record once: {summaries:?}"
    );
}

#[test]
fn hooks_run_once_each_and_output_emitted_at_barriers_and_the_end_is_published() {
    let dir = tempfile::tempdir().unwrap();
    let hooks = Arc::new(Hooks::default());
    let words = 5_000;
    let job = flow(dir.path(), words, 3, &hooks);
    let report = run_word_count(&config(dir.path()), &job, None).unwrap();
    check(dir.path(), words, 3);
    assert_eq!(hooks.opened.load(Ordering::SeqCst), 3, "open once per task");
    assert_eq!(
        hooks.closed.load(Ordering::SeqCst),
        3,
        "close once per task"
    );
    // Each of the 3 tasks flushed at every checkpoint's barrier.
    let barriers = hooks.barriers.load(Ordering::SeqCst);
    assert_eq!(
        barriers as usize,
        3 * report.checkpoints.len(),
        "on_barrier once per task and checkpoint ({} checkpoints)",
        report.checkpoints.len()
    );
}

#[test]
fn output_emitted_at_barriers_and_the_end_is_published_exactly_once_through_crashes() {
    let words = 40_000;
    let (seen, rounds) = crash_rounds(
        10,
        5,
        |dir, _| {
            let hooks = Arc::new(Hooks::default());
            (config(dir), flow(dir, words, 3, &hooks))
        },
        |dir, _, _, _| check(dir, words, 3),
    );
    eprintln!(
        "operator hooks: {rounds} rounds, {} crashes, {} restores, {} checkpoints",
        seen.crashes, seen.restored, seen.checkpoints
    );
}

#[test]
fn a_rescaled_restore_keeps_the_totals_and_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let hooks = Arc::new(Hooks::default());
    let words = 200_000;
    let config = config(dir.path());
    // Crash the 2-task job once it has checkpointed, then finish it with 4 tasks.
    let first = flow(dir.path(), words, 2, &hooks);
    crash_once_checkpointed(&config, &first);
    let report = run_word_count(&config, &flow(dir.path(), words, 4, &hooks), None).unwrap();
    assert!(report.restored_from.is_some());
    // Totals are per word: the strictly rising check holds across the rescale; the
    // summaries now come from up to 4 tasks.
    check(dir.path(), words, 4);
}
