//! Changelog checkpoints (the idea of Flink's changelog state backend): at a barrier
//! the frozen change set is written as one sorted, checksummed *segment* and goes to
//! RocksDB's memtable — no flush, no SST per checkpoint, nothing for compaction to
//! merge. The checkpoint is the last *materialization* (a RocksDB checkpoint, taken
//! in the background every [`ChangelogConfig::materialize_interval`] or once the
//! segments since the last one pass [`ChangelogConfig::materialize_bytes`]) plus the
//! segments written after it began. Restore opens the materialization and replays the
//! segments in order.
//!
//! Segments hold absolute values (a put of the key's value, or its delete), never
//! deltas, so replaying one whose changes the materialization already holds changes
//! nothing: a materialization may run while later segments go on being written, and
//! covers at least every segment written before it began.
//!
//! The segment format and its decoder are `stillpoint_wire`'s ([`encode_segment`],
//! [`decode_segment`]): a file format, fuzzed there without RocksDB.

use std::collections::binary_heap::PeekMut;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rocksdb::DB;
use stillpoint_wire::{
    KeyGroupRange, RelativePath, SegmentEntry, Sha256Digest, SnapshotFile, decode_segment,
    encode_segment,
};

use crate::StateError;
use crate::rocks::{
    StoredWrite, build_sst, column_family, ingest_dir, ingest_files, remove_unused,
    sst_writer_options, write_stored,
};
use crate::snapshot::{SharedDigests, create_checkpoint, flush_all, hash_files};
use crate::threads::{each_on_threads, on_threads, threads};

/// When a task's changelog is materialized (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChangelogConfig {
    /// Start a materialization at least this long after the last one started.
    /// Default 60 s: a restore replays at most about this much of changes.
    pub materialize_interval: Duration,
    /// ... or once the segments not yet materialized hold this many bytes. Default
    /// 256 MiB. A changelog also materializes once 64 segments wait (each snapshot
    /// lists them all).
    pub materialize_bytes: u64,
    /// ... or once the segments not yet materialized hold this percentage of the
    /// last materialization's bytes (and at least 4 MiB). Default 100: a restore
    /// reads at most about twice the state. Lower it for faster restores (replaying
    /// a segment costs several times what fetching and opening as many bytes of a
    /// materialization does) at the price of more materializations, which cost a
    /// busy job throughput; docs/performance.md has the measured trade-off.
    pub materialize_percent: u32,
}

impl Default for ChangelogConfig {
    fn default() -> Self {
        Self {
            materialize_interval: Duration::from_secs(60),
            materialize_bytes: 256 << 20,
            materialize_percent: 100,
        }
    }
}

/// Replayed entries from which an SST is built and ingested rather than written.
const INGEST_AT: usize = 65_536;
/// The least changelog a materialization is due at for its size relative to the
/// last one ([`ChangelogConfig::materialize_percent`]).
const OUTGROWN_FLOOR: u64 = 4 << 20;
/// Segments a snapshot lists at most before a materialization is due: each snapshot
/// links and lists every segment since the materialization, so their number is the
/// per-checkpoint cost that grows between materializations.
const MAX_SEGMENTS: usize = 64;

/// The directory of a database's changelog: inside it, where RocksDB ignores what it
/// did not name and a RocksDB checkpoint links only its own files.
pub(crate) fn changelog_dir(db_path: &Path) -> PathBuf {
    db_path.join("stillpoint-changelog")
}

/// A decoded entry of one state: stored key, value (`None`: deleted).
pub(crate) type Entry = SegmentEntry;

/// One segment's entries of each state it holds.
type Blocks = Vec<(String, Vec<Entry>)>;

/// Decodes the segment at `path` (checksum first, then the whole segment): each state
/// with its entries whose key group is in `keep`.
pub(crate) fn read_segment(path: &Path, keep: KeyGroupRange) -> Result<Blocks, StateError> {
    // One read: the segment's size was verified against the manifest.
    let file = std::fs::read(path).map_err(StateError::io("reading", path))?;
    decode_segment(Bytes::from(file), keep).map_err(|error| StateError::CorruptSegment {
        file: path.to_path_buf(),
        problem: error.problem,
    })
}

/// Replays the segments at `paths` (oldest first) into `db`, keeping the key groups
/// `keep`. Each segment is a sorted run of each state it holds; the runs are merged
/// walking each in order (a k-way merge: memory is read in sequence, not at random),
/// the newest value of each key winning, so each key is written once however many
/// segments changed it. When there are many entries, each state's keys are cut into
/// one key range per core, and each range is merged and built into an SST on a
/// thread of its own; a state's SSTs are ingested together (no memtable). Few entries
/// are written as one batch (an ingestion's fixed cost — file syncs, a memtable flush
/// — is more than a few thousand memtable inserts). The segments are decoded on as
/// many threads. The memory is the changelog's entries, bounded by what triggers a
/// materialization. Returns the entries written.
pub(crate) fn replay_segments(
    db: &DB,
    options: &rocksdb::Options,
    compression: crate::Compression,
    paths: &[PathBuf],
    keep: KeyGroupRange,
) -> Result<u64, StateError> {
    let cores = threads();
    // Each state's sorted runs, one per segment holding it, oldest first.
    let mut runs: BTreeMap<String, Vec<Vec<Entry>>> = BTreeMap::new();
    for blocks in decode_segments(paths, keep, cores)? {
        for (state, batch) in blocks {
            runs.entry(state).or_default().push(batch);
        }
    }
    let replayed: usize = runs.values().flatten().map(Vec::len).sum();
    if replayed < INGEST_AT {
        let mut writes: Vec<StoredWrite<'_>> = Vec::new();
        for (state, state_runs) in &runs {
            let runs: Vec<&[Entry]> = state_runs.iter().map(Vec::as_slice).collect();
            writes.extend(Newest::new(runs).map(|(key, value)| (state.as_str(), key, value)));
        }
        if !writes.is_empty() {
            write_stored(db, options, writes.iter().copied())?;
        }
        return Ok(u64::try_from(writes.len()).unwrap_or(u64::MAX));
    }
    let writer_options = sst_writer_options(options, compression);
    let dir = ingest_dir(db);
    std::fs::create_dir_all(&dir).map_err(StateError::io("creating", &dir))?;
    let mut written = 0_usize;
    for (state, state_runs) in &runs {
        let cf = column_family(db, options, state)?;
        let built = on_threads(key_ranges(state_runs, cores), |range| {
            let mut count = 0_usize;
            let writes = Newest::new(range).inspect(|_| count += 1);
            build_sst(&writer_options, &dir, writes).map(|path| (path, count))
        });
        let mut files = Vec::new();
        let mut failed = None;
        for result in built {
            match result {
                Ok((path, count)) => {
                    files.push(path);
                    written += count;
                }
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        if let Some(error) = failed {
            remove_unused(&files);
            return Err(error);
        }
        if !files.is_empty() {
            ingest_files(db, &cf, files)?;
        }
    }
    Ok(u64::try_from(written).unwrap_or(u64::MAX))
}

/// The segments at `paths` decoded, in their order, on up to `threads` threads (each
/// a run of consecutive segments).
fn decode_segments(
    paths: &[PathBuf],
    keep: KeyGroupRange,
    threads: usize,
) -> Result<Vec<Blocks>, StateError> {
    each_on_threads(paths, threads, |path| read_segment(path, keep))
        .into_iter()
        .collect()
}

/// The sorted `runs` cut into at most `parts` key ranges, in key order, none empty:
/// each range holds, of every run, the entries whose keys fall in it (cut at
/// quantiles of a sample of the keys, so each key is in one range).
fn key_ranges(runs: &[Vec<Entry>], parts: usize) -> Vec<Vec<&[Entry]>> {
    let whole: Vec<&[Entry]> = runs.iter().map(Vec::as_slice).collect();
    let total: usize = runs.iter().map(Vec::len).sum();
    let step = (total / parts.saturating_mul(64).max(1)).max(1);
    let mut sample: Vec<&[u8]> = whole
        .iter()
        .flat_map(|run| run.iter().step_by(step).map(|entry| entry.0.as_ref()))
        .collect();
    sample.sort_unstable();
    let mut cuts: Vec<&[u8]> = (1..parts.max(1))
        .filter_map(|j| sample.get(j * sample.len() / parts).copied())
        .collect();
    cuts.dedup();
    // Where each range starts and ends in each run: at the first entry not below the
    // cut.
    let bounds: Vec<Vec<usize>> = whole
        .iter()
        .map(|run| {
            let inner = cuts
                .iter()
                .map(|cut| run.partition_point(|e| e.0.as_ref() < *cut));
            std::iter::once(0).chain(inner).chain([run.len()]).collect()
        })
        .collect();
    (0..=cuts.len())
        .map(|range| -> Vec<&[Entry]> {
            whole
                .iter()
                .zip(&bounds)
                .filter_map(|(run, at)| run.get(*at.get(range)?..*at.get(range + 1)?))
                .filter(|part| !part.is_empty())
                .collect()
        })
        .filter(|range| !range.is_empty())
        .collect()
}

/// Sorted runs (oldest first) merged: each key once, in key order, with its value
/// from the newest run holding it (`None`: deleted). Each run is read in order.
struct Newest<'a> {
    runs: Vec<&'a [Entry]>,
    heads: BinaryHeap<Head<'a>>,
}

/// The next entry of one run.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Head<'a> {
    key: &'a [u8],
    run: usize,
    at: usize,
}

impl Ord for Head<'_> {
    /// The heap's greatest is the smallest key and, among equal keys, the newest run.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.key.cmp(self.key).then(self.run.cmp(&other.run))
    }
}

impl PartialOrd for Head<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<'a> Newest<'a> {
    fn new(runs: Vec<&'a [Entry]>) -> Self {
        let heads = runs
            .iter()
            .enumerate()
            .filter_map(|(run, entries)| {
                let key = entries.first()?.0.as_ref();
                Some(Head { key, run, at: 0 })
            })
            .collect();
        Self { runs, heads }
    }
}

impl<'a> Iterator for Newest<'a> {
    type Item = (&'a [u8], Option<&'a [u8]>);

    fn next(&mut self) -> Option<Self::Item> {
        let newest = *self.heads.peek()?;
        // Every run at this key moves past it: the newest first, then the older ones.
        while let Some(mut head) = self.heads.peek_mut() {
            if head.key != newest.key {
                break;
            }
            match self.runs.get(head.run).and_then(|run| run.get(head.at + 1)) {
                Some(entry) => {
                    head.at += 1;
                    head.key = entry.0.as_ref();
                }
                None => {
                    PeekMut::pop(head);
                }
            }
        }
        let (key, value) = self.runs.get(newest.run)?.get(newest.at)?;
        Some((key.as_ref(), value.as_deref()))
    }
}

/// A segment written since the materialization.
#[derive(Clone, Debug)]
struct Segment {
    ordinal: u64,
    name: String,
    size: u64,
    sha256: Sha256Digest,
}

/// A materialization: a RocksDB checkpoint holding every segment up to `covers`.
#[derive(Debug)]
pub(crate) struct Base {
    dir: PathBuf,
    covers: u64,
    files: Vec<(String, u64, Sha256Digest)>,
}

/// One task's changelog: its segments since the materialization, the
/// materialization, and the one running in the background.
#[derive(Debug)]
pub(crate) struct Changelog {
    config: ChangelogConfig,
    dir: PathBuf,
    next: u64,
    base: Option<Base>,
    segments: Vec<Segment>,
    running: Option<Receiver<Result<Base, StateError>>>,
    last_started: Instant,
    /// The files of the last snapshot built, for `shared`.
    previous: BTreeSet<String>,
    /// Materializations installed, for the tests and the logs.
    pub(crate) materializations: u64,
}

/// What a snapshot in changelog mode lists.
pub(crate) struct LinkedSnapshot {
    pub(crate) files: Vec<SnapshotFile>,
    pub(crate) changelog: Vec<RelativePath>,
}

impl Changelog {
    /// A changelog for the database at `db_path` (any earlier one there is gone:
    /// the database it described was not restored from it).
    pub(crate) fn new(config: ChangelogConfig, db_path: &Path) -> Self {
        let dir = changelog_dir(db_path);
        let _gone = std::fs::remove_dir_all(&dir);
        Self {
            config,
            dir,
            next: 1,
            base: None,
            segments: Vec::new(),
            running: None,
            last_started: Instant::now(),
            previous: BTreeSet::new(),
            materializations: 0,
        }
    }

    fn unmaterialized_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.size).sum()
    }

    /// Writes `writes` as the next segment, then into RocksDB (its memtable).
    pub(crate) fn append(
        &mut self,
        db: &DB,
        options: &rocksdb::Options,
        writes: &[StoredWrite<'_>],
    ) -> Result<(), StateError> {
        if writes.is_empty() {
            return Ok(());
        }
        std::fs::create_dir_all(&self.dir).map_err(StateError::io("creating", &self.dir))?;
        let ordinal = self.next;
        let name = format!("changelog-{ordinal:020}.seg");
        let encoded = encode_segment(writes);
        let path = self.dir.join(&name);
        std::fs::write(&path, &encoded).map_err(StateError::io("writing", &path))?;
        write_stored(db, options, writes.iter().copied())?;
        self.next += 1;
        self.segments.push(Segment {
            ordinal,
            name,
            size: u64::try_from(encoded.len()).unwrap_or(u64::MAX),
            sha256: Sha256Digest::of(&encoded),
        });
        Ok(())
    }

    /// Installs a finished materialization; starts one when due (in the calling
    /// thread when there is none yet: a snapshot needs one to stand on).
    pub(crate) fn materialize(
        &mut self,
        db: &Arc<DB>,
        names: &[String],
        digests: &SharedDigests,
    ) -> Result<(), StateError> {
        self.collect();
        if self.running.is_some() {
            return Ok(());
        }
        let covers = self.segments.last().map_or(self.next - 1, |s| s.ordinal);
        let dir = self.dir.join(format!("base-{covers:020}"));
        if self.base.is_none() {
            self.last_started = Instant::now();
            let base = build_base(db, names, dir, covers, digests)?;
            self.install(base);
            return Ok(());
        }
        let pending = self.unmaterialized_bytes();
        let base_bytes: u64 = self.base.iter().flat_map(|b| &b.files).map(|f| f.1).sum();
        let due = self.last_started.elapsed() >= self.config.materialize_interval
            || pending >= self.config.materialize_bytes
            || pending
                >= (base_bytes.saturating_mul(u64::from(self.config.materialize_percent)) / 100)
                    .max(OUTGROWN_FLOOR)
            || self.segments.len() >= MAX_SEGMENTS;
        if !due || self.segments.is_empty() {
            return Ok(());
        }
        self.last_started = Instant::now();
        let (done, running) = mpsc::channel();
        let (db, names, digests) = (Arc::clone(db), names.to_vec(), Arc::clone(digests));
        let spawned = std::thread::Builder::new()
            .name("stillpoint-materialize".into())
            .spawn(move || {
                let _sent = done.send(build_base(&db, &names, dir, covers, &digests));
            });
        match spawned {
            Ok(_) => self.running = Some(running),
            Err(error) => tracing::warn!(%error, "could not start a materialization"),
        }
        Ok(())
    }

    /// Installs a materialization that finished; logs and forgets one that failed
    /// (the next snapshot starts another).
    fn collect(&mut self) {
        let Some(running) = &self.running else {
            return;
        };
        match running.try_recv() {
            Err(TryRecvError::Empty) => {}
            Err(TryRecvError::Disconnected) => self.running = None,
            Ok(result) => {
                self.running = None;
                self.finish(result);
            }
        }
    }

    /// Waits for a running materialization and installs it.
    pub(crate) fn settle(&mut self) {
        if let Some(Ok(result)) = self.running.take().map(|running| running.recv()) {
            self.finish(result);
        }
    }

    /// Installs a materialization that finished, or logs one that failed (the
    /// changelog grows until the next one).
    fn finish(&mut self, result: Result<Base, StateError>) {
        match result {
            Ok(base) => self.install(base),
            Err(error) => {
                tracing::warn!(%error, "materialization failed; the changelog grows until the next one");
            }
        }
    }

    fn install(&mut self, base: Base) {
        let covered = base.covers;
        for segment in self.segments.iter().filter(|s| s.ordinal <= covered) {
            let _gone = std::fs::remove_file(self.dir.join(&segment.name));
        }
        self.segments.retain(|s| s.ordinal > covered);
        if let Some(old) = self.base.replace(base) {
            // Snapshots that listed its files hold their own links.
            let _gone = std::fs::remove_dir_all(&old.dir);
        }
        self.materializations += 1;
        tracing::debug!(
            covers = covered,
            segments_left = self.segments.len(),
            "materialization installed"
        );
    }

    /// Links the materialization's files and the segments after it into `dir` (new):
    /// a snapshot directory, listed as the manifest lists it.
    pub(crate) fn link_into(&mut self, dir: &Path) -> Result<LinkedSnapshot, StateError> {
        let Some(base) = &self.base else {
            return Err(StateError::Incompatible(
                "a changelog snapshot without a materialization".into(),
            ));
        };
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent).map_err(StateError::io("creating", parent))?;
        }
        // A new directory: one left by an aborted checkpoint is not reused.
        std::fs::create_dir(dir).map_err(StateError::io("creating", dir))?;
        let link = |from: &Path, name: &str| -> Result<(), StateError> {
            let to = dir.join(name);
            if std::fs::hard_link(from, &to).is_err() {
                std::fs::copy(from, &to).map_err(StateError::io("copying", from))?;
            }
            Ok(())
        };
        let mut listed = Vec::with_capacity(base.files.len() + self.segments.len());
        for (name, size, sha256) in &base.files {
            link(&base.dir.join(name), name)?;
            listed.push((name.clone(), *size, *sha256));
        }
        let mut changelog = Vec::with_capacity(self.segments.len());
        for segment in &self.segments {
            link(&self.dir.join(&segment.name), &segment.name)?;
            listed.push((segment.name.clone(), segment.size, segment.sha256));
            changelog.push(relative(&segment.name)?);
        }
        let files = listed
            .into_iter()
            .map(|(name, size, sha256)| {
                Ok(SnapshotFile {
                    shared: self.previous.contains(&name),
                    path: relative(&name)?,
                    size,
                    sha256,
                })
            })
            .collect::<Result<Vec<_>, StateError>>()?;
        self.previous = files.iter().map(|f| f.path.as_str().to_owned()).collect();
        Ok(LinkedSnapshot { files, changelog })
    }
}

impl Drop for Changelog {
    fn drop(&mut self) {
        // A materialization still running holds the database open: wait for it, so
        // whoever opens the directory next finds it closed.
        if let Some(running) = self.running.take() {
            let _finished = running.recv();
        }
    }
}

fn relative(name: &str) -> Result<RelativePath, StateError> {
    RelativePath::new(name)
        .map_err(|problem| StateError::Incompatible(format!("file name {name:?}: {problem}")))
}

/// Flushes and checkpoints `db` into `dir`: every change written before the call is
/// in it (and possibly some written during it).
fn build_base(
    db: &DB,
    names: &[String],
    dir: PathBuf,
    covers: u64,
    digests: &SharedDigests,
) -> Result<Base, StateError> {
    let started = Instant::now();
    flush_all(db, names)?;
    create_checkpoint(db, &dir)?;
    let files = hash_files(&dir, digests)?;
    tracing::debug!(
        covers,
        files = files.len(),
        elapsed_ms = started.elapsed().as_millis(),
        "materialized"
    );
    Ok(Base { dir, covers, files })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Merging sorted runs keeps each key's value from the latest run that has it,
        /// in key order, whole or cut into key ranges — keys shorter than the 16-byte prefix, keys that are zero
        /// bytes, keys sharing a long prefix and keys longer than it included.
        #[test]
        fn the_merge_keeps_each_keys_newest_value_in_key_order(
            runs in proptest::collection::vec(
                proptest::collection::btree_set(
                    prop_oneof![
                        proptest::collection::vec(prop_oneof![Just(0_u8), any::<u8>()], 0..6),
                        // Long keys sharing their first 14 bytes, differing after.
                        (14..20_usize, any::<u8>(), 0..4_usize).prop_map(|(len, b, at)| {
                            let mut long = vec![7_u8; len];
                            if let Some(slot) = long.get_mut(14 + at) {
                                *slot = b;
                            }
                            long
                        }),
                    ],
                    0..30,
                ),
                0..6,
            )
        ) {
            let mut model = BTreeMap::new();
            for (run, keys) in runs.iter().enumerate() {
                for key in keys {
                    model.insert(key.clone(), run);
                }
            }
            let model: Vec<(Vec<u8>, usize)> = model.into_iter().collect();
            let runs: Vec<Vec<Entry>> = runs
                .iter()
                .enumerate()
                .map(|(run, keys)| {
                    let value = Bytes::from(vec![u8::try_from(run).unwrap()]);
                    keys.iter()
                        .map(|key| (Bytes::from(key.clone()), Some(value.clone())))
                        .collect()
                })
                .collect();
            // Whole, and cut into key ranges as a parallel replay cuts it: the ranges
            // in order make the same merge.
            for parts in 1..=4 {
                let ranges = key_ranges(&runs, parts);
                prop_assert!(ranges.len() <= parts);
                let merged: Vec<(Vec<u8>, usize)> = ranges
                    .into_iter()
                    .flat_map(Newest::new)
                    .map(|(key, value)| (key.to_vec(), usize::from(value.unwrap()[0])))
                    .collect();
                prop_assert_eq!(&merged, &model, "{} key ranges", parts);
            }
        }
    }

    /// A replay large enough to be built into SSTs (on as many threads as there are
    /// cores, each a key range) leaves each key with its newest value or deleted,
    /// every key of every segment checked against a model.
    #[test]
    fn a_large_replay_leaves_each_key_as_its_last_segment_left_it() {
        let dir = tempfile::tempdir().unwrap();
        let options = crate::StateConfig::default().rocks_options();
        let db = DB::open(&options, dir.path().join("db")).unwrap();
        let mut model: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut paths = Vec::new();
        for segment in 0..3_u64 {
            // 30,000 of 50,000 keys each, overlapping; every 7th of them a delete.
            let mut changes: Vec<(Vec<u8>, Option<Vec<u8>>)> = (0..30_000_u64)
                .map(|i| {
                    let n = (i * 7 + segment * 9_973) % 50_000;
                    let group = u16::try_from(n % 128).unwrap();
                    let key = [&group.to_be_bytes()[..], &n.to_be_bytes()].concat();
                    let value = (i % 7 != 0).then(|| format!("{segment}:{n}").into_bytes());
                    (key, value)
                })
                .collect();
            changes.sort();
            changes.dedup_by(|a, b| a.0 == b.0);
            let writes: Vec<StoredWrite<'_>> = changes
                .iter()
                .map(|(key, value)| ("counts", key.as_slice(), value.as_deref()))
                .collect();
            let path = dir.path().join(format!("{segment}.seg"));
            std::fs::write(&path, encode_segment(&writes)).unwrap();
            paths.push(path);
            model.extend(changes);
        }
        let all_groups = KeyGroupRange { start: 0, end: 128 };
        let written =
            replay_segments(&db, &options, crate::Compression::Lz4, &paths, all_groups).unwrap();
        assert_eq!(written, u64::try_from(model.len()).unwrap());
        let cf = db.cf_handle("counts").unwrap();
        for (key, value) in &model {
            assert_eq!(&db.get_cf(&cf, key).unwrap(), value, "key {key:?}");
        }
        let ingested = std::fs::read_dir(ingest_dir(&db)).unwrap().count();
        assert_eq!(ingested, 0, "every built SST was moved into the database");
    }

    /// A segment file reads back through the wire decoder, filtered by key group; a
    /// damaged one is refused naming the file and the damage.
    /// (The decoder's every case, and its fuzz target, are in `stillpoint_wire`.)
    #[test]
    fn a_segment_file_is_read_whole_or_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let writes: Vec<StoredWrite<'_>> = vec![
            ("counts", b"\x00\x01key-a", Some(b"1")),
            ("counts", b"\x00\x02key-b", None),
            ("sums", b"\x00\x03key-c", Some(b"22")),
        ];
        let good = encode_segment(&writes);
        let path = dir.path().join("good.seg");
        std::fs::write(&path, &good).unwrap();
        let read = read_segment(&path, KeyGroupRange { start: 2, end: 4 }).unwrap();
        assert_eq!(
            read,
            vec![
                (
                    "counts".to_owned(),
                    vec![(Bytes::from_static(b"\x00\x02key-b"), None)]
                ),
                (
                    "sums".to_owned(),
                    vec![(
                        Bytes::from_static(b"\x00\x03key-c"),
                        Some(Bytes::from_static(b"22"))
                    )]
                ),
            ]
        );
        let mut flipped = good;
        flipped[20] ^= 0x40;
        let path = dir.path().join("flipped.seg");
        std::fs::write(&path, &flipped).unwrap();
        let error = read_segment(&path, KeyGroupRange { start: 0, end: 128 }).unwrap_err();
        assert!(
            matches!(&error, StateError::CorruptSegment { file, problem } if file == &path && problem.contains("CRC32C")),
            "{error}"
        );
    }
}
