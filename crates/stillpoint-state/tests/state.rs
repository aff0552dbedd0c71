//! API-level tests of the state backend: keyed operations, snapshots under concurrent
//! writes, incremental manifests, corruption, restore and rescale.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use stillpoint_state::*;
use stillpoint_wire::{CheckpointId, KeyGroupRange, SnapshotManifest, StreamId, TaskId};

const OWNER: StateOwner = StateOwner {
    stream: StreamId(1),
    task: TaskId(1),
};

fn small_config() -> StateConfig {
    StateConfig {
        block_cache_bytes: 8 << 20,
        write_buffer_bytes: 4 << 20,
        cache_budget_bytes: 1 << 20,
        ..StateConfig::default()
    }
}

/// Every snapshot a RocksDB checkpoint of its own (no changelog).
fn checkpoint_config() -> StateConfig {
    StateConfig {
        changelog: None,
        ..small_config()
    }
}

fn open(dir: &Path, range: KeyGroupRange) -> RocksStateBackend {
    open_with(dir, range, small_config())
}

fn open_with(dir: &Path, range: KeyGroupRange, config: StateConfig) -> RocksStateBackend {
    RocksStateBackend::open(dir, config, KeyGroups::new(128).unwrap(), range, OWNER).unwrap()
}

fn all() -> KeyGroupRange {
    KeyGroups::new(128).unwrap().all()
}

/// Every (key, field) → value of `state` in `store`.
fn dump(
    store: &impl KeyedState,
    state: &str,
    groups: KeyGroupRange,
) -> BTreeMap<(Vec<u8>, Vec<u8>), Vec<u8>> {
    let mut out = BTreeMap::new();
    store
        .scan(state, groups, &mut |k, f, v| {
            out.insert((k.to_vec(), f.to_vec()), v.to_vec());
            true
        })
        .unwrap();
    out
}

#[test]
fn keyed_operations_fields_and_scans() {
    let dir = tempfile::tempdir().unwrap();
    let mut db = open(&dir.path().join("db"), all());
    db.put("counts", b"a", b"", b"1").unwrap();
    db.put("windows", b"a", b"w1", b"x").unwrap();
    db.put("windows", b"a", b"w2", b"y").unwrap();
    db.put("windows", b"ab", b"w1", b"z").unwrap(); // a longer key must not leak into `a`
    assert_eq!(db.get("counts", b"a", b"").unwrap(), Some(b"1".to_vec()));
    assert_eq!(db.get("counts", b"missing", b"").unwrap(), None);
    assert_eq!(db.get("no-such-state", b"a", b"").unwrap(), None);
    assert_eq!(
        db.fields("windows", b"a").unwrap(),
        vec![
            (b"w1".to_vec(), b"x".to_vec()),
            (b"w2".to_vec(), b"y".to_vec())
        ]
    );
    db.delete("windows", b"a", b"w1").unwrap();
    assert_eq!(db.fields("windows", b"a").unwrap().len(), 1);
    assert_eq!(dump(&db, "windows", all()).len(), 2);
    let mut states = db.states();
    states.sort();
    assert_eq!(states, vec!["counts".to_owned(), "windows".to_owned()]);
}

#[test]
fn a_batch_with_a_foreign_key_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let groups = KeyGroups::new(128).unwrap();
    let range = groups.range_of(2, 0).unwrap();
    let mut db = open(&dir.path().join("db"), range);
    let mine = (0..100_u32)
        .map(|i| i.to_le_bytes())
        .find(|k| range.contains(groups.of(k)))
        .unwrap();
    let foreign = (0..100_u32)
        .map(|i| i.to_le_bytes())
        .find(|k| !range.contains(groups.of(k)))
        .unwrap();
    let mut batch = StateBatch::default();
    batch
        .put("s", &mine, b"", b"1")
        .put("s", &foreign, b"", b"2");
    let err = db.write(batch).unwrap_err();
    assert!(
        matches!(err, StateError::ForeignKeyGroup { range: r, .. } if r == range),
        "{err}"
    );
    assert_eq!(db.get("s", &mine, b"").unwrap(), None, "all or nothing");
    let mut cached = CachedState::new(open(&dir.path().join("db2"), range));
    let mut batch = StateBatch::default();
    batch
        .put("s", &mine, b"", b"1")
        .put("s", &foreign, b"", b"2");
    assert!(cached.write(batch).is_err());
    assert_eq!(
        cached.get("s", &mine, b"").unwrap(),
        None,
        "all or nothing through the cache too"
    );
}

#[test]
fn typed_value_and_map_state() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = CachedState::new(open(&dir.path().join("db"), all()));
    let counts: ValueState<String, u64> = ValueState::new("counts");
    let windows: MapState<String, u64, Vec<u32>> = MapState::new("windows");
    counts.put(&mut state, &"fox".into(), &3).unwrap();
    windows
        .put(&mut state, &"fox".into(), &10, &vec![1, 2])
        .unwrap();
    windows
        .put(&mut state, &"fox".into(), &20, &vec![3])
        .unwrap();
    assert_eq!(counts.get(&state, &"fox".into()).unwrap(), Some(3));
    assert_eq!(
        windows.entries(&state, &"fox".into()).unwrap(),
        vec![(10, vec![1, 2]), (20, vec![3])]
    );
    windows.delete(&mut state, &"fox".into(), &10).unwrap();
    assert_eq!(windows.get(&state, &"fox".into(), &10).unwrap(), None);
    // Bytes that are not a valid encoding are a typed error, not a panic.
    state
        .put("counts", &postcard_key("bad"), b"", &[0xff; 11])
        .unwrap();
    assert!(matches!(
        counts.get(&state, &"bad".into()),
        Err(StateError::Codec { .. })
    ));
}

fn postcard_key(s: &str) -> Vec<u8> {
    // postcard encodes a String as varint length + bytes.
    let mut out = vec![u8::try_from(s.len()).unwrap()];
    out.extend_from_slice(s.as_bytes());
    out
}

#[test]
fn snapshot_is_exactly_the_state_at_the_barrier_while_writes_continue() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = CachedState::new(open(&dir.path().join("db"), all()));
    for i in 0..5_000_u32 {
        state
            .put("s", &i.to_le_bytes(), b"", &i.to_le_bytes())
            .unwrap();
    }
    let expected = dump(&state, "s", all());
    let job = state.snapshot(CheckpointId(1), dir.path().join("ckpt-1"));
    // The export runs on another thread while the task keeps writing.
    let exporter = std::thread::spawn(move || job.run());
    for i in 0..5_000_u32 {
        state.put("s", &i.to_le_bytes(), b"", b"after").unwrap();
        assert_eq!(
            state.get("s", &i.to_le_bytes(), b"").unwrap(),
            Some(b"after".to_vec()),
            "reads see the latest write"
        );
    }
    let exported = exporter.join().unwrap().unwrap();
    let restored = RocksStateBackend::restore(
        &exported.dir,
        &exported.manifest,
        dir.path().join("restored"),
        small_config(),
        KeyGroups::new(128).unwrap(),
        OWNER,
    )
    .unwrap();
    assert_eq!(dump(&restored, "s", all()), expected);
}

#[test]
fn second_snapshot_shares_unchanged_ssts_and_lists_only_new_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = CachedState::new(open(&dir.path().join("db"), all()));
    for i in 0..20_000_u32 {
        state.put("s", &i.to_le_bytes(), b"", &[7; 100]).unwrap();
    }
    let first = state
        .snapshot(CheckpointId(1), dir.path().join("ckpt-1"))
        .run()
        .unwrap();
    assert!(first.manifest.files.iter().all(|f| !f.shared));
    state
        .put("s", &1_u32.to_le_bytes(), b"", b"changed")
        .unwrap();
    let second = state
        .snapshot(CheckpointId(2), dir.path().join("ckpt-2"))
        .run()
        .unwrap();
    let shared: Vec<_> = second.manifest.files.iter().filter(|f| f.shared).collect();
    assert!(!shared.is_empty(), "the first snapshot's SSTs are shared");
    for file in &shared {
        let before = first
            .manifest
            .files
            .iter()
            .find(|f| f.path == file.path)
            .unwrap();
        assert_eq!(before.sha256, file.sha256);
    }
    assert!(
        second.manifest.new_bytes() < first.manifest.total_bytes() / 2,
        "incremental"
    );
    assert_eq!(second.manifest.checkpoint, CheckpointId(2));
    // The local manifest in the directory is the same document.
    let local = std::fs::read(second.dir.join(LOCAL_MANIFEST)).unwrap();
    assert_eq!(SnapshotManifest::parse(&local).unwrap(), second.manifest);
}

/// A snapshot directory with its manifest.
type Snapshot = (PathBuf, SnapshotManifest);

fn snapshot_of(dir: &Path, keys: u32) -> Snapshot {
    let mut state = CachedState::new(open(&dir.join("db"), all()));
    for i in 0..keys {
        state.put("s", &i.to_le_bytes(), b"", &[1; 64]).unwrap();
    }
    let exported = state
        .snapshot(CheckpointId(1), dir.join("ckpt"))
        .run()
        .unwrap();
    (exported.dir, exported.manifest)
}

/// The name of the first SST a snapshot lists.
fn first_sst(manifest: &SnapshotManifest) -> String {
    let file = manifest
        .files
        .iter()
        .find(|f| f.path.as_str().ends_with(".sst"));
    file.unwrap().path.as_str().to_owned()
}

fn restore(
    dir: &Path,
    snapshot: &(PathBuf, SnapshotManifest),
    target: &str,
) -> Result<RocksStateBackend, StateError> {
    RocksStateBackend::restore(
        &snapshot.0,
        &snapshot.1,
        dir.join(target),
        small_config(),
        KeyGroups::new(128).unwrap(),
        OWNER,
    )
}

/// A restore told the files' digests were already checked (the engine's, after the
/// store's download hashed every byte) skips only the hashing: a file missing, cut
/// short or not in the manifest is still refused before anything is opened, and an
/// intact snapshot restores the same state as a hashed restore.
#[test]
fn a_restore_of_already_hashed_files_still_checks_the_listing_and_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = snapshot_of(dir.path(), 2_000);
    let checked = |target: &str| {
        RocksStateBackend::restore_checked(
            &snapshot.0,
            &snapshot.1,
            DigestCheck::AlreadyHashed,
            dir.path().join(target),
            small_config(),
            KeyGroups::new(128).unwrap(),
            OWNER,
        )
    };
    let hashed = restore(dir.path(), &snapshot, "hashed").unwrap();
    let restored = checked("checked").unwrap();
    assert_eq!(dump(&restored, "s", all()), dump(&hashed, "s", all()));
    assert_eq!(dump(&restored, "s", all()).len(), 2_000);
    let sst = first_sst(&snapshot.1);
    let path = snapshot.0.join(&sst);
    let original = std::fs::read(&path).unwrap();
    std::fs::write(&path, &original[..original.len() - 1]).unwrap();
    let err = checked("r1").unwrap_err();
    assert!(
        matches!(&err, StateError::SizeMismatch { file, .. } if *file == sst),
        "{err}"
    );
    std::fs::remove_file(&path).unwrap();
    let err = checked("r2").unwrap_err();
    assert!(
        matches!(&err, StateError::MissingFile { file, .. } if *file == sst),
        "{err}"
    );
    std::fs::write(&path, &original).unwrap();
    std::fs::write(snapshot.0.join("000999.sst"), b"planted").unwrap();
    let err = checked("r3").unwrap_err();
    assert!(
        matches!(&err, StateError::UnexpectedFile { file } if file == "000999.sst"),
        "{err}"
    );
    for target in ["r1", "r2", "r3"] {
        assert!(
            !dir.path().join(target).exists(),
            "{target}: nothing opened or created"
        );
    }
}

#[test]
fn corrupt_snapshots_are_refused_naming_the_file_and_never_opened() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = snapshot_of(dir.path(), 2_000);
    let sst = first_sst(&snapshot.1);
    let path = snapshot.0.join(&sst);
    let original = std::fs::read(&path).unwrap();

    // A flipped byte.
    let mut flipped = original.clone();
    flipped[original.len() / 2] ^= 1;
    std::fs::write(&path, &flipped).unwrap();
    let err = restore(dir.path(), &snapshot, "r1").unwrap_err();
    assert!(
        matches!(&err, StateError::ChecksumMismatch { file, .. } if *file == sst),
        "{err}"
    );
    assert!(!dir.path().join("r1").exists(), "nothing opened or created");

    // Truncated.
    std::fs::write(&path, &original[..original.len() - 1]).unwrap();
    let err = restore(dir.path(), &snapshot, "r2").unwrap_err();
    assert!(
        matches!(&err, StateError::SizeMismatch { file, expected, found } if *file == sst && *expected == original.len() as u64 && *found + 1 == *expected),
        "{err}"
    );

    // Missing.
    std::fs::remove_file(&path).unwrap();
    let err = restore(dir.path(), &snapshot, "r3").unwrap_err();
    assert!(
        matches!(&err, StateError::MissingFile { file, .. } if *file == sst),
        "{err}"
    );

    // An extra file.
    std::fs::write(&path, &original).unwrap();
    std::fs::write(snapshot.0.join("000999.sst"), b"planted").unwrap();
    let err = restore(dir.path(), &snapshot, "r4").unwrap_err();
    assert!(
        matches!(&err, StateError::UnexpectedFile { file } if file == "000999.sst"),
        "{err}"
    );
    std::fs::remove_file(snapshot.0.join("000999.sst")).unwrap();

    // Intact again: restores; restoring into an existing directory is refused.
    restore(dir.path(), &snapshot, "r5").unwrap();
    assert!(matches!(
        restore(dir.path(), &snapshot, "r5"),
        Err(StateError::Io { .. })
    ));
}

#[test]
fn a_snapshot_of_another_stream_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = snapshot_of(dir.path(), 10);
    let err = RocksStateBackend::restore(
        &snapshot.0,
        &snapshot.1,
        dir.path().join("r"),
        small_config(),
        KeyGroups::new(64).unwrap(),
        OWNER,
    )
    .unwrap_err();
    assert!(matches!(err, StateError::Incompatible(_)), "{err}");
}

/// Writes `keys` keys across `parallelism` tasks (each its own key-group range) and
/// snapshots each; returns the snapshots and the model of all keys.
fn parallel_snapshots(
    dir: &Path,
    parallelism: u32,
    keys: u32,
) -> (Vec<Snapshot>, BTreeMap<Vec<u8>, Vec<u8>>) {
    let groups = KeyGroups::new(128).unwrap();
    let mut model = BTreeMap::new();
    let mut snapshots = Vec::new();
    for index in 0..parallelism {
        let range = groups.range_of(parallelism, index).unwrap();
        let mut state = CachedState::new(open(&dir.join(format!("old-{index}")), range));
        let owned = |i: &u32| range.contains(groups.of(&i.to_le_bytes()));
        for i in (0..keys / 2).filter(owned) {
            let key = i.to_le_bytes();
            let value = format!("v{i}").into_bytes();
            state.put("s", &key, b"", &value).unwrap();
            state.put("t", &key, b"f", b"x").unwrap();
            model.insert(key.to_vec(), value);
        }
        // The first snapshot materializes; the second is that plus a changelog
        // segment of new keys, overwrites and deletes.
        state
            .snapshot(CheckpointId(2), dir.join(format!("first-{index}")))
            .run()
            .unwrap();
        for i in (keys / 2..keys).filter(owned) {
            let key = i.to_le_bytes();
            let value = format!("v{i}").into_bytes();
            state.put("s", &key, b"", &value).unwrap();
            state.put("t", &key, b"f", b"x").unwrap();
            model.insert(key.to_vec(), value);
        }
        for i in (0..keys / 2).filter(owned) {
            let key = i.to_le_bytes();
            if i % 7 == 0 {
                state.delete("s", &key, b"").unwrap();
                model.remove(key.as_slice());
            } else if i % 5 == 0 {
                let value = format!("w{i}").into_bytes();
                state.put("s", &key, b"", &value).unwrap();
                model.insert(key.to_vec(), value);
            }
        }
        let exported = state
            .snapshot(CheckpointId(3), dir.join(format!("ckpt-{index}")))
            .run()
            .unwrap();
        assert!(
            !exported.manifest.changelog.is_empty(),
            "the rescaled snapshot replays a changelog"
        );
        snapshots.push((exported.dir, exported.manifest));
    }
    (snapshots, model)
}

fn check_rescale(from: u32, to: u32) {
    let dir = tempfile::tempdir().unwrap();
    let groups = KeyGroups::new(128).unwrap();
    let (snapshots, model) = parallel_snapshots(dir.path(), from, 3_000);
    let mut seen: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for index in 0..to {
        let range = groups.range_of(to, index).unwrap();
        let restored = RocksStateBackend::restore_rescaled(
            &snapshots,
            dir.path().join(format!("new-{index}")),
            small_config(),
            groups,
            range,
            OWNER,
        )
        .unwrap();
        let contents = dump(&restored, "s", all());
        for ((key, _), value) in contents {
            assert!(
                range.contains(groups.of(&key)),
                "{from}→{to}: task {index} holds a key of another task"
            );
            assert!(
                seen.insert(key, value).is_none(),
                "{from}→{to}: a key landed in two tasks"
            );
        }
        assert_eq!(
            dump(&restored, "t", all()).len(),
            dump(&restored, "t", range).len()
        );
    }
    assert_eq!(
        seen, model,
        "{from}→{to}: every key lands in exactly one task, unchanged"
    );
}

#[test]
fn rescale_two_to_three() {
    check_rescale(2, 3);
}

#[test]
fn rescale_four_to_two() {
    check_rescale(4, 2);
}

#[test]
fn rescale_to_one_and_restore_unchanged_parallelism() {
    check_rescale(3, 1);
    check_rescale(2, 2);
}

#[test]
fn memory_stays_within_budget_by_spilling_between_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = CachedState::new(open(&dir.path().join("db"), all()));
    for i in 0..50_000_u32 {
        state.put("s", &i.to_le_bytes(), b"", &[3; 100]).unwrap();
        assert!(
            state.memory_bytes() <= 1 << 20,
            "over budget at {i}: {}",
            state.memory_bytes()
        );
    }
    assert!(state.spills() > 0);
    for i in (0..50_000_u32).step_by(997) {
        assert_eq!(
            state.get("s", &i.to_le_bytes(), b"").unwrap(),
            Some(vec![3; 100])
        );
    }
    let exported = state
        .snapshot(CheckpointId(1), dir.path().join("ckpt"))
        .run()
        .unwrap();
    let restored = restore(dir.path(), &(exported.dir, exported.manifest), "r").unwrap();
    assert_eq!(dump(&restored, "s", all()).len(), 50_000);
}

#[test]
fn a_job_dropped_unrun_still_writes_its_batch() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = CachedState::new(open(&dir.path().join("db"), all()));
    state.put("s", b"k", b"", b"v1").unwrap();
    drop(state.snapshot(CheckpointId(1), dir.path().join("ckpt-1")));
    state.put("s", b"k2", b"", b"v2").unwrap();
    let exported = state
        .snapshot(CheckpointId(2), dir.path().join("ckpt-2"))
        .run()
        .unwrap();
    let restored = restore(dir.path(), &(exported.dir, exported.manifest), "r").unwrap();
    assert_eq!(restored.get("s", b"k", b"").unwrap(), Some(b"v1".to_vec()));
    assert_eq!(restored.get("s", b"k2", b"").unwrap(), Some(b"v2".to_vec()));
}

#[test]
fn an_export_ingests_its_changes_and_leaves_no_file_behind() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = CachedState::new(open_with(
        &dir.path().join("db"),
        all(),
        checkpoint_config(),
    ));
    for i in 0..3_000_u32 {
        state.put("a", &i.to_le_bytes(), b"", &[1; 40]).unwrap();
        state.put("b", &i.to_le_bytes(), b"f1", b"x").unwrap();
        state.put("b", &i.to_le_bytes(), b"", b"plain").unwrap();
    }
    let first = state
        .snapshot(CheckpointId(1), dir.path().join("ckpt-1"))
        .run()
        .unwrap();
    // Deletes become tombstones in the next ingested SSTs.
    for i in (0..3_000_u32).step_by(3) {
        state.delete("a", &i.to_le_bytes(), b"").unwrap();
        state.delete("b", &i.to_le_bytes(), b"f1").unwrap();
    }
    let expected = (dump(&state, "a", all()), dump(&state, "b", all()));
    let second = state
        .snapshot(CheckpointId(2), dir.path().join("ckpt-2"))
        .run()
        .unwrap();
    let staging = dir.path().join("db/stillpoint-ingest");
    assert_eq!(
        std::fs::read_dir(&staging).unwrap().count(),
        0,
        "every built SST was moved into the database"
    );
    for snapshot in [&first, &second] {
        assert!(
            snapshot
                .manifest
                .files
                .iter()
                .all(|f| !f.path.as_str().contains("stillpoint-ingest")),
            "{:?}",
            snapshot.manifest.files
        );
    }
    let restored = restore(dir.path(), &(second.dir, second.manifest), "r").unwrap();
    assert_eq!(
        (dump(&restored, "a", all()), dump(&restored, "b", all())),
        expected
    );
}

/// The table options RocksDB recorded for column family `state` in the newest
/// OPTIONS file of the database at `db`.
fn recorded_table_options(db: &Path, state: &str) -> String {
    recorded_options(db, &format!("[TableOptions/BlockBasedTable \"{state}\"]"))
}

/// The section `header` of the newest OPTIONS file RocksDB wrote in `db`.
fn recorded_options(db: &Path, header: &str) -> String {
    let newest = std::fs::read_dir(db)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("OPTIONS-"))
        .max_by_key(|n| n.trim_start_matches("OPTIONS-").parse::<u64>().unwrap())
        .unwrap();
    let text = std::fs::read_to_string(db.join(newest)).unwrap();
    let section = text.split(header).nth(1).unwrap_or_default();
    section.split("\n[").next().unwrap_or_default().to_owned()
}

#[test]
fn restored_and_reopened_states_keep_the_tuned_options() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = snapshot_of(dir.path(), 1_000);
    let fresh = recorded_table_options(&dir.path().join("db"), "s");
    assert!(fresh.contains("kTwoLevelIndexSearch"), "{fresh}");
    // A restore opens a database whose states already exist.
    let restored = restore(dir.path(), &snapshot, "r").unwrap();
    let options = recorded_table_options(restored.path(), "s");
    for wanted in [
        "index_type=kTwoLevelIndexSearch",
        "partition_filters=true",
        "filter_policy=bloomfilter",
    ] {
        assert!(options.contains(wanted), "{wanted} missing:\n{options}");
    }
    // The memtable's whole-key bloom filter (a read of a key absent from the memtable
    // skips its skip list).
    let memtable = recorded_options(restored.path(), "[CFOptions \"s\"]");
    for wanted in [
        "memtable_whole_key_filtering=true",
        "memtable_prefix_bloom_size_ratio=0.05",
    ] {
        assert!(memtable.contains(wanted), "{wanted} missing:\n{memtable}");
    }
    // And a rescaled restore (the old snapshot is read to build the new one).
    let groups = KeyGroups::new(128).unwrap();
    let rescaled = RocksStateBackend::restore_rescaled(
        std::slice::from_ref(&snapshot),
        dir.path().join("rescaled"),
        small_config(),
        groups,
        groups.range_of(2, 0).unwrap(),
        OWNER,
    )
    .unwrap();
    let options = recorded_table_options(rescaled.path(), "s");
    assert!(options.contains("filter_policy=bloomfilter"), "{options}");
}

#[test]
fn a_failed_checkpoint_directory_fails_that_snapshot_only() {
    for config in [checkpoint_config(), small_config()] {
        a_failed_checkpoint_directory_fails_that_snapshot_only_with(config);
    }
}

fn a_failed_checkpoint_directory_fails_that_snapshot_only_with(config: StateConfig) {
    let changelog = config.changelog.is_some();
    let dir = tempfile::tempdir().unwrap();
    let mut state = CachedState::new(open_with(&dir.path().join("db"), all(), config));
    if changelog {
        // A materialization exists: the failure is the snapshot's directory alone.
        state.put("s", b"z", b"", b"0").unwrap();
        state
            .snapshot(CheckpointId(0), dir.path().join("ckpt-0"))
            .run()
            .unwrap();
    }
    state.put("s", b"a", b"", b"1").unwrap();
    // The directory exists already (an aborted checkpoint's, being removed, say):
    // RocksDB cannot create the checkpoint there, nor the changelog link into it.
    std::fs::create_dir_all(dir.path().join("ckpt-1/in-the-way")).unwrap();
    let error = state
        .snapshot(CheckpointId(1), dir.path().join("ckpt-1"))
        .run()
        .unwrap_err();
    if changelog {
        assert!(
            matches!(&error, StateError::Io { path, .. } if path.ends_with("ckpt-1")),
            "{error}"
        );
    } else {
        assert!(matches!(error, StateError::Rocks { .. }), "{error}");
    }
    // The changes reached RocksDB: the next snapshot holds them, nothing is poisoned.
    state.put("s", b"b", b"", b"2").unwrap();
    let exported = state
        .snapshot(CheckpointId(2), dir.path().join("ckpt-2"))
        .run()
        .unwrap();
    let restored = restore(dir.path(), &(exported.dir, exported.manifest), "r").unwrap();
    assert_eq!(restored.get("s", b"a", b"").unwrap(), Some(b"1".to_vec()));
    assert_eq!(restored.get("s", b"b", b"").unwrap(), Some(b"2".to_vec()));
}

/// Changelog mode end to end: every snapshot restores to exactly the state at its
/// barrier while materializations start at every checkpoint (interval zero) and finish
/// in the background, and a snapshot taken after one is installed replays only the
/// segments written after it began.
#[test]
fn changelog_snapshots_restore_their_barrier_across_background_materializations() {
    let dir = tempfile::tempdir().unwrap();
    let config = StateConfig {
        changelog: Some(ChangelogConfig {
            materialize_interval: Duration::ZERO,
            materialize_bytes: u64::MAX,
            ..ChangelogConfig::default()
        }),
        ..small_config()
    };
    let mut state = CachedState::new(open_with(&dir.path().join("db"), all(), config));
    let mut longest_changelog = 0;
    for round in 0..24_u32 {
        for i in 0..400_u32 {
            let key = (i * 7 + round * 13) % 1_000;
            if (i + round) % 9 == 0 {
                state.delete("s", &key.to_le_bytes(), b"").unwrap();
            } else {
                state
                    .put(
                        "s",
                        &key.to_le_bytes(),
                        b"",
                        format!("{round}-{i}").as_bytes(),
                    )
                    .unwrap();
            }
            state
                .put("m", &(key % 50).to_le_bytes(), &i.to_le_bytes(), b"f")
                .unwrap();
        }
        if round % 6 == 5 {
            state.settle_materialization().unwrap();
        }
        let expected = (dump(&state, "s", all()), dump(&state, "m", all()));
        let exported = state
            .snapshot(
                CheckpointId(u64::from(round) + 1),
                dir.path().join(format!("ckpt-{round}")),
            )
            .run()
            .unwrap();
        if round % 6 == 5 {
            assert_eq!(
                exported.manifest.changelog.len(),
                1,
                "after a settled materialization only the newest segment is replayed"
            );
        }
        longest_changelog = longest_changelog.max(exported.manifest.changelog.len());
        // Writes after the barrier never reach the snapshot.
        state.put("s", b"late", b"", b"after the barrier").unwrap();
        state.delete("s", b"late", b"").unwrap();
        let restored = restore(
            dir.path(),
            &(exported.dir, exported.manifest),
            &format!("r-{round}"),
        )
        .unwrap();
        assert_eq!(
            (dump(&restored, "s", all()), dump(&restored, "m", all())),
            expected,
            "round {round}"
        );
    }
    assert!(
        state.materializations().unwrap() >= 4,
        "materializations: {:?}",
        state.materializations()
    );
    assert!(
        longest_changelog >= 1,
        "some snapshots replayed a changelog"
    );
}

/// A changelog segment damaged after the snapshot was taken is refused by the
/// verified restore, naming the segment, before anything is opened.
#[test]
fn a_damaged_changelog_segment_is_refused_at_restore() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = CachedState::new(open(&dir.path().join("db"), all()));
    state.put("s", b"a", b"", b"1").unwrap();
    state
        .snapshot(CheckpointId(1), dir.path().join("ckpt-1"))
        .run()
        .unwrap();
    state.put("s", b"b", b"", b"2").unwrap();
    let exported = state
        .snapshot(CheckpointId(2), dir.path().join("ckpt-2"))
        .run()
        .unwrap();
    let segment = exported.manifest.changelog[0].as_str().to_owned();
    let path = exported.dir.join(&segment);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::remove_file(&path).unwrap(); // a hard link: leave the original alone
    std::fs::write(&path, bytes).unwrap();
    let error = restore(dir.path(), &(exported.dir, exported.manifest), "r").unwrap_err();
    assert!(
        matches!(&error, StateError::ChecksumMismatch { file, .. } if *file == segment),
        "{error}"
    );
    assert!(!dir.path().join("r").exists(), "nothing opened");
}

/// Changes that cannot be written — the SSTs' staging directory, or in changelog mode
/// the segment's, is a file — fail the export naming where, leave no snapshot
/// directory, and poison the cache: the changes are in neither RocksDB nor a
/// changelog, so no later snapshot may stand without them.
#[test]
fn an_export_that_cannot_write_its_changes_fails_naming_the_directory_and_poisons() {
    for (config, blocked) in [
        (checkpoint_config(), "stillpoint-ingest"),
        (small_config(), "stillpoint-changelog"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut state = CachedState::new(open_with(&dir.path().join("db"), all(), config));
        state.put("s", b"k", b"", b"v").unwrap();
        std::fs::write(dir.path().join("db").join(blocked), b"in the way").unwrap();
        let error = state
            .snapshot(CheckpointId(1), dir.path().join("ckpt-1"))
            .run()
            .unwrap_err();
        assert!(
            matches!(&error, StateError::Io { path, .. } if path.ends_with(blocked)),
            "{error}"
        );
        assert!(
            !dir.path().join("ckpt-1").exists(),
            "{blocked}: no partial snapshot directory"
        );
        let next = state
            .snapshot(CheckpointId(2), dir.path().join("ckpt-2"))
            .run()
            .unwrap_err();
        assert!(matches!(next, StateError::Poisoned(_)), "{blocked}: {next}");
    }
}

/// A changelog too large for one write batch is replayed through ingested SSTs:
/// overwrites and deletes of keys the materialization holds (tombstones in the
/// ingested files) restore exactly.
#[test]
fn a_large_changelog_is_replayed_through_ingested_ssts() {
    let dir = tempfile::tempdir().unwrap();
    let config = StateConfig {
        cache_budget_bytes: 64 << 20,
        ..small_config()
    };
    let mut state = CachedState::new(open_with(&dir.path().join("db"), all(), config));
    for i in 0..90_000_u32 {
        state.put("s", &i.to_le_bytes(), b"", b"first").unwrap();
    }
    state
        .snapshot(CheckpointId(1), dir.path().join("ckpt-1"))
        .run()
        .unwrap();
    for i in 0..90_000_u32 {
        if i % 3 == 0 {
            state.delete("s", &i.to_le_bytes(), b"").unwrap();
        } else {
            state.put("s", &i.to_le_bytes(), b"", b"second").unwrap();
        }
    }
    let expected = dump(&state, "s", all());
    let exported = state
        .snapshot(CheckpointId(2), dir.path().join("ckpt-2"))
        .run()
        .unwrap();
    assert_eq!(exported.manifest.changelog.len(), 1);
    let restored = restore(dir.path(), &(exported.dir, exported.manifest), "r").unwrap();
    assert_eq!(dump(&restored, "s", all()), expected);
    assert_eq!(expected.len(), 60_000);
}
