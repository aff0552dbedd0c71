//! The built-in count combiner and the count of partial counts, on real RocksDB
//! state: partial counts add up to what the plain count stores, and a value that is
//! no partial count (or a count that would overflow) is refused, changing nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use stillpoint::{CachedState, Combiner, Operator, Record};
use stillpoint_connectors::{COUNTS, CombinedCount, CountCombiner, KeyedCount};
use stillpoint_state::{KeyGroups, RocksStateBackend, StateConfig, StateOwner};
use stillpoint_wire::{StreamId, TaskId};

fn state(dir: &std::path::Path) -> CachedState {
    let groups = KeyGroups::new(8).unwrap();
    let owner = StateOwner {
        stream: StreamId(1),
        task: TaskId(1),
    };
    let backend =
        RocksStateBackend::open(dir, StateConfig::default(), groups, groups.all(), owner).unwrap();
    CachedState::new(backend)
}

fn counted(out: &[Record]) -> Vec<(String, String)> {
    let mut lines: Vec<_> = out
        .iter()
        .map(|r| {
            (
                String::from_utf8(r.key.to_vec()).unwrap(),
                String::from_utf8(r.value.to_vec()).unwrap(),
            )
        })
        .collect();
    lines.sort();
    lines
}

#[test]
fn combined_partial_counts_add_up_to_what_the_plain_count_publishes_last() {
    let dir = tempfile::tempdir().unwrap();
    let words = ["a", "b", "a", "c", "a", "b"];
    let mut plain = state(&dir.path().join("plain"));
    let mut plain_out = Vec::new();
    for word in words {
        KeyedCount
            .process(Record::new(word, ""), &mut plain, &mut plain_out)
            .unwrap();
    }
    // Two flushes: the first three words, then the rest.
    let mut combined = state(&dir.path().join("combined"));
    let (mut combiner, mut out) = (CountCombiner::default(), Vec::new());
    for chunk in words.chunks(3) {
        let mut partials = Vec::new();
        for word in chunk {
            combiner.add(Record::new(*word, "")).unwrap();
        }
        combiner.flush(&mut partials).unwrap();
        let mut again = Vec::new();
        combiner.flush(&mut again).unwrap();
        assert!(again.is_empty(), "a flush forgets what it emitted");
        for partial in partials {
            CombinedCount
                .process(partial, &mut combined, &mut out)
                .unwrap();
        }
    }
    assert_eq!(
        counted(&out),
        [("a", "2"), ("a", "3"), ("b", "1"), ("b", "2"), ("c", "1")]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
    );
    // The same state as the plain count's.
    for word in ["a", "b", "c"] {
        assert_eq!(
            combined.get_cached(COUNTS, word.as_bytes(), &[]).unwrap(),
            plain.get_cached(COUNTS, word.as_bytes(), &[]).unwrap()
        );
    }
}

#[test]
fn a_value_that_is_no_partial_count_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = state(dir.path());
    let mut out = Vec::new();
    let error = CombinedCount
        .process(Record::new("a", "seven"), &mut state, &mut out)
        .unwrap_err()
        .to_string();
    assert!(error.contains("5 bytes, not 8"), "{error}");
    assert!(error.contains("CountCombiner"), "{error}");
    assert!(out.is_empty());
    assert_eq!(state.get_cached(COUNTS, b"a", &[]).unwrap(), None);
    // A count that would overflow is refused too, the stored count kept.
    let max = Record::new("a", Bytes::copy_from_slice(&u64::MAX.to_be_bytes()));
    CombinedCount
        .process(max.clone(), &mut state, &mut out)
        .unwrap();
    let error = CombinedCount
        .process(max, &mut state, &mut out)
        .unwrap_err()
        .to_string();
    assert!(error.contains("overflows"), "{error}");
    assert_eq!(
        state.get_cached(COUNTS, b"a", &[]).unwrap().as_deref(),
        Some(&u64::MAX.to_be_bytes()[..])
    );
}
