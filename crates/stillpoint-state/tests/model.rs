//! Property test of the write-back cache against a model map: reads during in-flight
//! snapshots always see the latest write, and every snapshot, restored, equals the
//! model at its barrier — with a budget small enough to force spills.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::thread::JoinHandle;

use proptest::prelude::*;
use stillpoint_state::*;
use stillpoint_wire::{CheckpointId, StreamId, TaskId};

#[derive(Clone, Debug)]
enum Op {
    Put(u8, u8, u16),
    Delete(u8, u8),
    Get(u8, u8),
    GetCached(u8, u8),
    /// `update_cached` lent the old value; `Some(v)` writes a value made from it and
    /// `v`, `None` deletes. `Fail` makes the change return an error instead.
    Update(u8, u8, Option<u16>),
    Fail(u8, u8),
    Fields(u8),
    Barrier,
    Join,
}

/// Few enough keys that reads, field listings and rewrites meet earlier writes often;
/// enough (with long keys and values) to overflow the tiny budget and spill.
const KEYS: std::ops::Range<u8> = 0..32;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (KEYS, 0..3_u8, any::<u16>()).prop_map(|(k, f, v)| Op::Put(k, f, v)),
        2 => (KEYS, 0..3_u8).prop_map(|(k, f)| Op::Delete(k, f)),
        2 => (KEYS, 0..3_u8).prop_map(|(k, f)| Op::Get(k, f)),
        2 => (KEYS, 0..3_u8).prop_map(|(k, f)| Op::GetCached(k, f)),
        4 => (KEYS, 0..3_u8, prop::option::weighted(0.8, any::<u16>())).prop_map(|(k, f, v)| Op::Update(k, f, v)),
        1 => (KEYS, 0..3_u8).prop_map(|(k, f)| Op::Fail(k, f)),
        1 => KEYS.prop_map(Op::Fields),
        1 => Just(Op::Barrier),
        1 => Just(Op::Join),
    ]
}

type Model = BTreeMap<(Vec<u8>, Vec<u8>), Vec<u8>>;

fn key(k: u8) -> Vec<u8> {
    // Long keys make the tiny budget spill often.
    vec![k; 40]
}

/// Field 0 is the empty field: a plain value, which the cache keeps apart from map
/// entries; a key may have both.
fn field(f: u8) -> Vec<u8> {
    if f == 0 { Vec::new() } else { vec![f] }
}

fn value(v: u16) -> Vec<u8> {
    let mut out = v.to_le_bytes().to_vec();
    out.resize(200, 0);
    out
}

fn dump(store: &impl KeyedState, groups: stillpoint_wire::KeyGroupRange) -> Model {
    let mut out = Model::new();
    store
        .scan("s", groups, &mut |k, f, v| {
            out.insert((k.to_vec(), f.to_vec()), v.to_vec());
            true
        })
        .unwrap();
    out
}

type Pending = (JoinHandle<Result<ExportedSnapshot, StateError>>, Model);

fn check_exported(root: &std::path::Path, pending: Pending, n: usize) {
    let (handle, expected) = pending;
    let exported = handle.join().unwrap().unwrap();
    let groups = KeyGroups::new(16).unwrap();
    let owner = StateOwner {
        stream: StreamId(1),
        task: TaskId(1),
    };
    let restored = RocksStateBackend::restore(
        &exported.dir,
        &exported.manifest,
        root.join(format!("restored-{n}")),
        StateConfig::default(),
        groups,
        owner,
    )
    .unwrap();
    assert_eq!(
        dump(&restored, groups.all()),
        expected,
        "snapshot {} differs from the model at its barrier",
        exported.checkpoint
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(36))]

    #[test]
    /// `mode`: 0 every snapshot a RocksDB checkpoint; 1 changelog snapshots (one
    /// materialization, then segments); 2 changelog snapshots with a background
    /// materialization started at every snapshot, racing later segments and spills.
    fn cache_matches_the_model_and_snapshots_match_their_barrier(mode in 0_u8..3, ops in prop::collection::vec(op(), 1..300)) {
        let root = tempfile::tempdir().unwrap();
        let groups = KeyGroups::new(16).unwrap();
        let owner = StateOwner { stream: StreamId(1), task: TaskId(1) };
        let changelog = match mode {
            0 => None,
            1 => Some(ChangelogConfig::default()),
            _ => Some(ChangelogConfig { materialize_interval: std::time::Duration::ZERO, materialize_bytes: 0, ..ChangelogConfig::default() }),
        };
        let config = StateConfig { cache_budget_bytes: 16 << 10, block_cache_bytes: 1 << 20, write_buffer_bytes: 1 << 20, changelog, ..StateConfig::default() };
        let backend = RocksStateBackend::open(root.path().join("db"), config, groups, groups.all(), owner).unwrap();
        let mut state = CachedState::new(backend);
        let mut model = Model::new();
        let mut pending: Vec<Pending> = Vec::new();
        let mut checkpoint = 0_u64;
        let mut restored = 0;
        for op in ops {
            match op {
                Op::Put(k, f, v) => {
                    state.put("s", &key(k), &field(f), &value(v)).unwrap();
                    model.insert((key(k), field(f)), value(v));
                }
                Op::Delete(k, f) => {
                    state.delete("s", &key(k), &field(f)).unwrap();
                    model.remove(&(key(k), field(f)));
                }
                Op::Get(k, f) => {
                    prop_assert_eq!(state.get("s", &key(k), &field(f)).unwrap(), model.get(&(key(k), field(f))).cloned());
                }
                Op::GetCached(k, f) => {
                    prop_assert_eq!(state.get_cached("s", &key(k), &field(f)).unwrap(), model.get(&(key(k), field(f))).cloned());
                }
                Op::Update(k, f, v) => {
                    let at = (key(k), field(f));
                    let old = model.get(&at).cloned();
                    // The new value depends on the old one, as an aggregate's does.
                    let new = v.map(|v| {
                        let mut new = value(v);
                        new.push(old.as_ref().map_or(0, |o| o[0]));
                        new
                    });
                    let mut lent = None;
                    state.update_cached::<StateError>("s", &at.0, &at.1, |value| {
                        lent = Some(value.map(<[u8]>::to_vec));
                        Ok(new.clone())
                    }).unwrap();
                    prop_assert_eq!(lent, Some(old));
                    match new {
                        Some(new) => model.insert(at, new),
                        None => model.remove(&at),
                    };
                }
                Op::Fail(k, f) => {
                    let at = (key(k), field(f));
                    let failed = state.update_cached("s", &at.0, &at.1, |_| {
                        Err(StateError::Poisoned("the change refused".into()))
                    });
                    prop_assert!(matches!(failed, Err(StateError::Poisoned(_))));
                    prop_assert_eq!(state.get("s", &at.0, &at.1).unwrap(), model.get(&at).cloned());
                }
                Op::Fields(k) => {
                    let expected: Vec<(Vec<u8>, Vec<u8>)> = model
                        .iter()
                        .filter(|((mk, _), _)| *mk == key(k))
                        .map(|((_, f), v)| (f.clone(), v.clone()))
                        .collect();
                    prop_assert_eq!(state.fields("s", &key(k)).unwrap(), expected);
                }
                Op::Barrier => {
                    checkpoint += 1;
                    let job = state.snapshot(CheckpointId(checkpoint), root.path().join(format!("ckpt-{checkpoint}")));
                    pending.push((std::thread::spawn(move || job.run()), model.clone()));
                }
                Op::Join => {
                    if !pending.is_empty() {
                        check_exported(root.path(), pending.remove(0), restored);
                        restored += 1;
                    }
                }
            }
        }
        prop_assert_eq!(dump(&state, groups.all()), model);
        for p in pending {
            check_exported(root.path(), p, restored);
            restored += 1;
        }
    }
}
