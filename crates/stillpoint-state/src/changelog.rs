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
//! Segment format (little-endian): the magic `SPCHLOG1`; per state, `0x01`, the
//! state's name (u64 length, UTF-8), its entry count (u64), then each entry in stored
//! key order: the stored key (u64 length, bytes), `0x01` and the value (u64 length,
//! bytes) for a put or `0x00` for a delete; then `0x00`; then the CRC32C of every
//! byte before it (u32).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rocksdb::DB;
use stillpoint_wire::{KeyGroupRange, RelativePath, Sha256Digest, SnapshotFile};

use crate::StateError;
use crate::cache::be_prefix;
use crate::rocks::{StoredWrite, ingest_stored, write_stored};
use crate::snapshot::{SharedDigests, create_checkpoint, flush_all, hash_files};

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

const MAGIC: &[u8; 8] = b"SPCHLOG1";
const STATE_BLOCK: u8 = 1;
const END: u8 = 0;
const PUT: u8 = 1;
const DELETE: u8 = 0;
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

fn len_bytes(len: usize) -> [u8; 8] {
    u64::try_from(len).unwrap_or(u64::MAX).to_le_bytes()
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&len_bytes(bytes.len()));
    out.extend_from_slice(bytes);
}

/// Encodes `writes` — sorted by state, then stored key, each key once — as a segment.
pub(crate) fn encode_segment(writes: &[StoredWrite<'_>]) -> Vec<u8> {
    let payload: usize = writes
        .iter()
        .map(|(_, key, value)| 17 + key.len() + value.map_or(0, <[u8]>::len))
        .sum();
    let mut out = Vec::with_capacity(payload + 64);
    out.extend_from_slice(MAGIC);
    let mut current: Option<(&str, usize, u64)> = None;
    let patch = |out: &mut Vec<u8>, at: usize, count: u64| {
        if let Some(slot) = out.get_mut(at..at + 8) {
            slot.copy_from_slice(&count.to_le_bytes());
        }
    };
    for &(state, key, value) in writes {
        match &mut current {
            Some((name, _, count)) if *name == state => *count += 1,
            _ => {
                if let Some((_, at, count)) = current {
                    patch(&mut out, at, count);
                }
                out.push(STATE_BLOCK);
                put_bytes(&mut out, state.as_bytes());
                current = Some((state, out.len(), 1));
                out.extend_from_slice(&0_u64.to_le_bytes());
            }
        }
        put_bytes(&mut out, key);
        match value {
            Some(value) => {
                out.push(PUT);
                put_bytes(&mut out, value);
            }
            None => out.push(DELETE),
        }
    }
    if let Some((_, at, count)) = current {
        patch(&mut out, at, count);
    }
    out.push(END);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Reads a segment's body (in memory), never past its end. Lengths and tags are read
/// from the bytes in place; keys and values are ranges of the body, cut into `Bytes`
/// only when kept (a reference count each, no copy).
struct SegmentReader<'p> {
    body: Bytes,
    at: usize,
    path: &'p Path,
}

impl SegmentReader<'_> {
    fn corrupt(&self, problem: impl Into<String>) -> StateError {
        StateError::CorruptSegment {
            file: self.path.to_path_buf(),
            problem: problem.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.body.len().saturating_sub(self.at)
    }

    /// The range of the next `n` bytes, which are consumed.
    fn take(&mut self, n: u64, what: &str) -> Result<std::ops::Range<usize>, StateError> {
        let left = self.remaining();
        let end = usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .map(|n| self.at + n)
            .ok_or_else(|| {
                self.corrupt(format!(
                    "{what} of {n} bytes runs past the end ({left} bytes left)"
                ))
            })?;
        let range = self.at..end;
        self.at = end;
        Ok(range)
    }

    fn slice(&self, range: std::ops::Range<usize>) -> &[u8] {
        self.body.get(range).unwrap_or_default()
    }

    fn byte(&mut self, what: &str) -> Result<u8, StateError> {
        let range = self.take(1, what)?;
        Ok(self.slice(range).first().copied().unwrap_or_default())
    }

    fn u64(&mut self, what: &str) -> Result<u64, StateError> {
        let range = self.take(8, what)?;
        let bytes = self.slice(range).first_chunk::<8>().copied();
        Ok(u64::from_le_bytes(bytes.unwrap_or_default()))
    }

    /// A length-prefixed field: its range.
    fn field(&mut self, what: &str) -> Result<std::ops::Range<usize>, StateError> {
        let len = self.u64(what)?;
        self.take(len, what)
    }
}

/// Reads a segment whole (one read: its size was verified against the manifest) and
/// checks its CRC32C; returns the body, the checksum cut off.
fn load_segment(path: &Path) -> Result<Bytes, StateError> {
    let corrupt = |problem: String| StateError::CorruptSegment {
        file: path.to_path_buf(),
        problem,
    };
    let mut file = Bytes::from(std::fs::read(path).map_err(StateError::io("reading", path))?);
    let minimum = MAGIC.len() + 1 + 4;
    if file.len() < minimum {
        return Err(corrupt(format!(
            "{} bytes, shorter than an empty segment",
            file.len()
        )));
    }
    let stored = file.split_off(file.len() - 4);
    let stored = u32::from_le_bytes(stored.first_chunk::<4>().copied().unwrap_or_default());
    let crc = crc32c::crc32c(&file);
    if stored != crc {
        return Err(corrupt(format!(
            "CRC32C {crc:08x}, the segment says {stored:08x}"
        )));
    }
    Ok(file)
}

/// A decoded entry of one state: stored key, value (`None`: deleted).
pub(crate) type Entry = (Bytes, Option<Bytes>);

/// What [`read_segment`] hands each state's entries to.
pub(crate) type Apply<'a> = dyn FnMut(&str, Vec<Entry>) -> Result<(), StateError> + 'a;

/// Decodes the segment at `path` (checksum first, then the whole segment), then calls
/// `apply` with each state and its entries whose key group is in `keep`. Returns the
/// entries applied.
pub(crate) fn read_segment(
    path: &Path,
    keep: KeyGroupRange,
    apply: &mut Apply<'_>,
) -> Result<u64, StateError> {
    let mut reader = SegmentReader {
        body: load_segment(path)?,
        at: 0,
        path,
    };
    let magic = reader.take(8, "magic")?;
    if reader.slice(magic) != MAGIC.as_slice() {
        return Err(reader.corrupt("not a changelog segment (wrong magic)"));
    }
    // Decoded whole before anything is applied: a segment is at most one
    // checkpoint's changes (or a spill's), and a damaged one changes nothing.
    let mut blocks: Vec<(String, Vec<Entry>)> = Vec::new();
    loop {
        match reader.byte("block tag")? {
            END => break,
            STATE_BLOCK => {}
            other => return Err(reader.corrupt(format!("unknown block tag {other}"))),
        }
        let name = reader.field("state name")?;
        let name = String::from_utf8(reader.slice(name).to_vec())
            .map_err(|_| reader.corrupt("a state name is not UTF-8"))?;
        let count = reader.u64("entry count")?;
        // The count is the file's word: capacity for at most 64 Ki entries up front.
        let mut batch = Vec::with_capacity(usize::try_from(count.min(1 << 16)).unwrap_or(0));
        let mut previous: Option<std::ops::Range<usize>> = None;
        for _ in 0..count {
            let key = reader.field("key")?;
            let value = match reader.byte("entry kind")? {
                PUT => Some(reader.field("value")?),
                DELETE => None,
                other => return Err(reader.corrupt(format!("unknown entry kind {other}"))),
            };
            let bytes = reader.slice(key.clone());
            // Sorted, each key once: a replay in any other order could be wrong.
            if previous
                .as_ref()
                .is_some_and(|last| reader.slice(last.clone()) >= bytes)
            {
                return Err(reader.corrupt(format!("state `{name}`: keys out of order")));
            }
            let Some(group) = bytes
                .first_chunk::<2>()
                .map(|g| u32::from(u16::from_be_bytes(*g)))
            else {
                return Err(reader.corrupt(format!("state `{name}`: a key shorter than its group")));
            };
            previous = Some(key.clone());
            if keep.contains(group) {
                batch.push((
                    reader.body.slice(key),
                    value.map(|value| reader.body.slice(value)),
                ));
            }
        }
        blocks.push((name, batch));
    }
    if reader.remaining() != 0 {
        return Err(reader.corrupt(format!("{} bytes after the end marker", reader.remaining())));
    }
    let mut applied = 0_u64;
    for (name, batch) in blocks {
        applied += u64::try_from(batch.len()).unwrap_or(0);
        apply(&name, batch)?;
    }
    Ok(applied)
}

/// Replays the segments at `paths` (oldest first) into `db`, keeping the key groups
/// `keep`: merged in memory, the newest value of each key winning, so each key is
/// written once however many segments changed it; then, when there are many, built
/// into one SST per state in key order and ingested (no memtable), else written as
/// one batch (an ingestion's fixed cost — file syncs, a memtable flush — is more
/// than a few thousand memtable inserts). The memory is the changelog's distinct
/// keys, bounded by what triggers a materialization. Returns the entries written.
pub(crate) fn replay_segments(
    db: &DB,
    options: &rocksdb::Options,
    compression: crate::Compression,
    paths: &[PathBuf],
    keep: KeyGroupRange,
) -> Result<u64, StateError> {
    let mut merged: BTreeMap<String, Vec<Entry>> = BTreeMap::new();
    for path in paths {
        read_segment(path, keep, &mut |state, batch| {
            match merged.get_mut(state) {
                Some(entries) => entries.extend(batch),
                None => {
                    merged.insert(state.to_owned(), batch);
                }
            }
            Ok(())
        })?;
    }
    let merged: Vec<(String, Vec<Entry>, Vec<usize>)> = merged
        .into_iter()
        .map(|(state, entries)| {
            let newest = newest_in_key_order(&entries);
            (state, entries, newest)
        })
        .collect();
    let count: usize = merged.iter().map(|(_, _, newest)| newest.len()).sum();
    let writes = merged.iter().flat_map(|(state, entries, newest)| {
        newest.iter().filter_map(move |&i| {
            let (key, value) = entries.get(i)?;
            Some((state.as_str(), key.as_ref(), value.as_deref()))
        })
    });
    if count >= INGEST_AT {
        ingest_stored(db, options, compression, writes)?;
    } else if count > 0 {
        write_stored(db, options, writes)?;
    }
    Ok(u64::try_from(count).unwrap_or(u64::MAX))
}

/// The indices of `entries` — sorted runs, one per segment, in replay order — that
/// hold each key's newest value, in key order. A stable sort of (prefix, index)
/// pairs merges the runs (equal keys stay in replay order) comparing numbers held
/// inline; only equal prefixes look at the keys, which live in the segments'
/// buffers (comparing those directly was a cache miss per comparison).
fn newest_in_key_order(entries: &[Entry]) -> Vec<usize> {
    let key = |i: usize| entries.get(i).map_or(&[][..], |entry| entry.0.as_ref());
    let mut order: Vec<(u128, usize)> = entries
        .iter()
        .enumerate()
        .map(|(i, entry)| (be_prefix(entry.0.iter()), i))
        .collect();
    order.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| key(a.1).cmp(key(b.1))));
    let mut newest: Vec<usize> = Vec::with_capacity(order.len());
    let mut last_prefix = None;
    for (prefix, i) in order {
        match newest.last_mut() {
            // Equal keys come in replay order: a later one is newer.
            Some(last) if last_prefix == Some(prefix) && key(*last) == key(i) => *last = i,
            _ => newest.push(i),
        }
        last_prefix = Some(prefix);
    }
    newest
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

    fn decode(path: &Path, keep: KeyGroupRange) -> Result<Vec<Decoded>, StateError> {
        let mut out = Vec::new();
        read_segment(path, keep, &mut |state, batch| {
            out.extend(
                batch
                    .into_iter()
                    .map(|(k, v)| (state.to_owned(), k.to_vec(), v.map(|v| v.to_vec()))),
            );
            Ok(())
        })?;
        Ok(out)
    }

    type Decoded = (String, Vec<u8>, Option<Vec<u8>>);

    const ALL: KeyGroupRange = KeyGroupRange { start: 0, end: 128 };

    proptest! {
        /// What is encoded decodes to exactly the same writes, in order.
        #[test]
        fn a_segment_decodes_to_what_was_encoded(
            entries in proptest::collection::btree_map(
                (0_u8..3, 0_u16..128, proptest::collection::vec(any::<u8>(), 0..12)),
                proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
                0..100,
            )
        ) {
            let dir = tempfile::tempdir().unwrap();
            let names = ["a", "b", "c"];
            let owned: Vec<Decoded> = entries
                .iter()
                .map(|((state, group, key), value)| {
                    let mut stored = group.to_be_bytes().to_vec();
                    stored.extend_from_slice(key);
                    (names[usize::from(*state)].to_owned(), stored, value.clone())
                })
                .collect();
            let writes: Vec<StoredWrite<'_>> = owned
                .iter()
                .map(|(s, k, v)| (s.as_str(), k.as_slice(), v.as_deref()))
                .collect();
            let path = dir.path().join("s.seg");
            std::fs::write(&path, encode_segment(&writes)).unwrap();
            prop_assert_eq!(decode(&path, ALL).unwrap(), owned.clone());
            // A key-group filter keeps exactly the keys of its groups.
            let half = KeyGroupRange { start: 0, end: 64 };
            let kept: Vec<_> = owned.into_iter().filter(|(_, k, _)| u16::from_be_bytes([k[0], k[1]]) < 64).collect();
            prop_assert_eq!(decode(&path, half).unwrap(), kept);
        }

        /// Merging sorted runs keeps each key's value from the latest run that has it,
        /// in key order — keys shorter than the 16-byte prefix, keys that are zero
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
            let mut entries: Vec<Entry> = Vec::new();
            let mut model = BTreeMap::new();
            for (run, keys) in runs.iter().enumerate() {
                for key in keys {
                    let value = Bytes::from(vec![u8::try_from(run).unwrap()]);
                    entries.push((Bytes::from(key.clone()), Some(value)));
                    model.insert(key.clone(), run);
                }
            }
            let merged: Vec<(Vec<u8>, usize)> = newest_in_key_order(&entries)
                .into_iter()
                .map(|i| {
                    let (key, value) = &entries[i];
                    (key.to_vec(), usize::from(value.as_ref().unwrap()[0]))
                })
                .collect();
            prop_assert_eq!(merged, model.into_iter().collect::<Vec<_>>());
        }

        /// A segment damaged anywhere — bytes changed, cut or inserted, then resealed
        /// with a matching CRC so the decoder reads past the checksum — decodes to a
        /// typed error with nothing applied, or (when the damage happens to be a
        /// well-formed segment) to entries still in key order; never a panic, never
        /// an allocation sized by a damaged count or length.
        #[test]
        fn a_damaged_but_resealed_segment_never_panics_or_applies_part(
            edits in proptest::collection::vec((0_u8..3, any::<prop::sample::Index>(), any::<u8>()), 1..6)
        ) {
            let dir = tempfile::tempdir().unwrap();
            let writes: Vec<StoredWrite<'_>> = vec![
                ("counts", b"\x00\x01key-a", Some(b"1")),
                ("counts", b"\x00\x02key-b", None),
                ("counts", b"\x00\x02key-c", Some(b"333")),
                ("sums", b"\x00\x03key-c", Some(b"22")),
            ];
            let mut body = encode_segment(&writes);
            body.truncate(body.len() - 4);
            for (kind, at, byte) in edits {
                let at = at.index(body.len() + 1);
                match kind {
                    0 if at < body.len() => body[at] = byte,
                    1 => body.truncate(at),
                    _ => body.insert(at, byte),
                }
            }
            let crc = crc32c::crc32c(&body);
            body.extend_from_slice(&crc.to_le_bytes());
            let path = dir.path().join("damaged.seg");
            std::fs::write(&path, &body).unwrap();
            let mut applied = Vec::new();
            match read_segment(&path, ALL, &mut |state, batch| {
                applied.push((state.to_owned(), batch));
                Ok(())
            }) {
                Err(error) => {
                    prop_assert!(matches!(error, StateError::CorruptSegment { .. }), "{}", error);
                    prop_assert!(applied.is_empty(), "applied part of a damaged segment");
                }
                Ok(_) => {
                    for (_, batch) in &applied {
                        prop_assert!(batch.windows(2).all(|w| w[0].0 < w[1].0), "keys out of order");
                    }
                }
            }
        }
    }

    /// Every kind of damage is refused with what is wrong, before anything is applied.
    #[test]
    fn a_damaged_segment_is_refused_naming_the_damage() {
        let dir = tempfile::tempdir().unwrap();
        let writes: Vec<StoredWrite<'_>> = vec![
            ("counts", b"\x00\x01key-a", Some(b"1")),
            ("counts", b"\x00\x02key-b", None),
            ("sums", b"\x00\x03key-c", Some(b"22")),
        ];
        let good = encode_segment(&writes);
        let reseal = |mut body: Vec<u8>| {
            let crc = crc32c::crc32c(&body);
            body.extend_from_slice(&crc.to_le_bytes());
            body
        };
        let body = good[..good.len() - 4].to_vec();
        let mut flipped = good.clone();
        flipped[20] ^= 0x40;
        let mut wrong_magic = body.clone();
        wrong_magic[0] = b'X';
        let mut unsorted: Vec<StoredWrite<'_>> = writes.clone();
        unsorted.swap(0, 1);
        let unsorted = encode_segment(&unsorted);
        let mut huge_len = body.clone();
        // The first state name's length: 9 bytes in (magic, tag).
        huge_len[9..17].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut trailing = body.clone();
        trailing.push(0);
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("bit flip", flipped, "CRC32C"),
            ("truncated", good[..good.len() / 2].to_vec(), "CRC32C"),
            (
                "too short",
                b"SPC".to_vec(),
                "shorter than an empty segment",
            ),
            ("wrong magic", reseal(wrong_magic), "wrong magic"),
            ("length past the end", reseal(huge_len), "runs past the end"),
            ("keys out of order", unsorted, "out of order"),
            (
                "bytes after the end",
                reseal(trailing),
                "after the end marker",
            ),
        ];
        for (name, bytes, expected) in cases {
            let path = dir.path().join(format!("{name}.seg"));
            std::fs::write(&path, bytes).unwrap();
            let mut applied = 0;
            let error = read_segment(&path, ALL, &mut |_, batch| {
                applied += batch.len();
                Ok(())
            })
            .unwrap_err();
            assert!(
                matches!(error, StateError::CorruptSegment { .. }),
                "case {name}: {error}"
            );
            assert!(error.to_string().contains(expected), "case {name}: {error}");
            assert_eq!(
                applied, 0,
                "case {name}: nothing is applied from a bad segment"
            );
        }
    }
}
