//! `CachedState`: the write-back cache in front of RocksDB (DESIGN §4).
//!
//! Writes land in a dirty map. At a barrier, [`CachedState::snapshot`] swaps the
//! dirty map for an empty one — O(1), the task's whole stall — and returns a
//! [`SnapshotJob`] that exports it wherever the caller runs it (the engine: another
//! thread). In changelog mode (the default, [`crate::ChangelogConfig`]) the job writes
//! the frozen map as a changelog segment and into the memtable, and links the last
//! materialization and the segments since into the snapshot directory; otherwise it
//! writes the map into RocksDB (one SST per state, built in key order and ingested: no
//! memtable), flushes whatever a spill left in the memtables and creates the RocksDB
//! checkpoint.
//!
//! Reads are one hash probe: beside the dirty map (what changed since the last
//! barrier, what the export writes and what scans merge) the cache keeps one hash map
//! of current values — every value written, or read from RocksDB, since it was last
//! evicted. A read that misses it walks dirty → frozen (newest first) → RocksDB, so it
//! sees the latest write at every moment, and the checkpoint of `n` is exactly the
//! state at barrier `n`. Keeping the current values apart from the per-checkpoint
//! change set is what makes a barrier cost nothing on the read path: a checkpoints-off
//! run and a checkpointing one serve the same reads from the same map.
//!
//! The cache shares the database and the frozen maps with the job (`Arc`), and a
//! spill waits on a condition variable for in-flight jobs to create their
//! checkpoints, so no post-barrier write can leak into an earlier checkpoint (in
//! changelog mode a spill is a segment too). The only thread this crate starts is a
//! changelog's background materialization.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use foldhash::HashMap;
use rocksdb::DB;
use stillpoint_wire::{CheckpointId, KeyGroupRange, SnapshotManifest};

use crate::changelog::Changelog;
use crate::rocks::{
    FieldValues, ScanVisitor, StoredWrite, decode_key, encode_key, group_bounds, ingest_stored,
    key_prefix, prefix_end,
};
use crate::snapshot::{
    DigestCache, ManifestContext, SharedDigests, build_manifest, create_checkpoint, flush_all,
    write_manifest,
};
use crate::{KeyedState, RocksStateBackend, StateBatch, StateError};

type CacheKey = (u32, Vec<u8>);

/// Bytes an entry of a `key_len`-byte stored key is charged for (key, value and map
/// overhead).
fn cost(key_len: usize, value: Option<&Vec<u8>>) -> usize {
    key_len + value.map_or(0, Vec::len) + 64
}

type Value = Option<Vec<u8>>;

/// Changes to keyed state not yet in RocksDB. Plain values (an empty field) are
/// hashed: a keyed aggregate's read-modify-write is two probes, never a walk of an
/// ordered map comparing long shared key prefixes. Map entries (a non-empty field)
/// stay ordered, so one key's fields are one range.
#[derive(Debug, Default)]
struct Changes {
    values: HashMap<CacheKey, Value>,
    entries: BTreeMap<CacheKey, Value>,
}

/// The first 16 of `bytes`, zero-padded, as one big-endian number: ordered as byte
/// strings are wherever two prefixes differ (a string shorter than 16 bytes pads with
/// zeros, which sorts it before every longer string it begins), so a sort compares
/// numbers held inline and only equal prefixes need the strings themselves.
pub(crate) fn be_prefix<'a>(bytes: impl IntoIterator<Item = &'a u8>) -> u128 {
    let mut prefix = [0u8; 16];
    for (slot, byte) in prefix.iter_mut().zip(bytes) {
        *slot = *byte;
    }
    u128::from_be_bytes(prefix)
}

/// A key's state id and the first 12 bytes of its stored key, as [`be_prefix`].
fn sort_prefix(key: &CacheKey) -> u128 {
    be_prefix(key.0.to_be_bytes().iter().chain(&key.1))
}

/// Whether a stored key addresses a plain value: its field (what follows the key
/// prefix, see `encode_key`) is empty.
fn is_plain(stored: &[u8]) -> bool {
    stored
        .get(2..6)
        .and_then(|len| <[u8; 4]>::try_from(len).ok())
        .is_some_and(|len| (u32::from_be_bytes(len) as usize).checked_add(6) == Some(stored.len()))
}

/// The stored keys [`CachedState::merged`] overlays.
#[derive(Clone, Copy)]
enum Span<'a> {
    /// Every field of one key: the key prefix and where its fields end.
    Fields(&'a [u8], &'a [u8]),
    /// Whole key groups: `lower..upper`.
    Groups(&'a [u8], &'a [u8]),
}

impl Changes {
    fn get(&self, key: &CacheKey) -> Option<&Value> {
        if is_plain(&key.1) {
            self.values.get(key)
        } else {
            self.entries.get(key)
        }
    }

    fn get_mut(&mut self, key: &CacheKey) -> Option<&mut Value> {
        if is_plain(&key.1) {
            self.values.get_mut(key)
        } else {
            self.entries.get_mut(key)
        }
    }

    fn insert(&mut self, key: CacheKey, value: Value) -> Option<Value> {
        if is_plain(&key.1) {
            self.values.insert(key, value)
        } else {
            self.entries.insert(key, value)
        }
    }

    fn len(&self) -> usize {
        self.values.len() + self.entries.len()
    }

    /// Every change in key order: what an SST is written in, and what RocksDB's
    /// memtable inserts fastest (a spill; its skip list reuses the previous insert's
    /// position), several times faster than hash order for millions of keys.
    ///
    /// The sort compares a 16-byte prefix held inline (the state id and the first 12
    /// bytes of the stored key) before the keys themselves: comparing the heap-held
    /// keys of a million entries directly was a cache miss per comparison and most of
    /// an export thread's time.
    ///
    /// Plain values and map entries are merged into one order (by state, then stored
    /// key), as an SST is written.
    fn sorted(&self) -> impl Iterator<Item = (&CacheKey, &Value)> {
        let mut plain: Vec<_> = self
            .values
            .iter()
            .map(|(key, value)| (sort_prefix(key), key, value))
            .collect();
        plain.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(b.1)));
        let mut plain = plain
            .into_iter()
            .map(|(_, key, value)| (key, value))
            .peekable();
        let mut entries = self.entries.iter().peekable();
        std::iter::from_fn(move || match (plain.peek(), entries.peek()) {
            (Some(p), Some(e)) if e.0 < p.0 => entries.next(),
            (Some(_), _) => plain.next(),
            (None, _) => entries.next(),
        })
    }

    /// Overlays this layer's changes of state `id` within `span` on `merged`. A key's
    /// fields are a range of the ordered entries plus at most its plain value; whole
    /// key groups also filter every plain value (a scan reads its range of RocksDB
    /// too, so it is never cheaper than the changes it walks).
    fn overlay_on(&self, id: u32, span: Span<'_>, merged: &mut BTreeMap<Vec<u8>, Value>) {
        let (lower, upper) = match span {
            Span::Fields(prefix, end) => {
                if let Some(value) = self.values.get(&(id, prefix.to_vec())) {
                    merged.insert(prefix.to_vec(), value.clone());
                }
                (prefix, end)
            }
            Span::Groups(lower, upper) => {
                for ((state, stored), value) in &self.values {
                    if *state == id && (lower..upper).contains(&stored.as_slice()) {
                        merged.insert(stored.clone(), value.clone());
                    }
                }
                (lower, upper)
            }
        };
        for ((_, stored), value) in self
            .entries
            .range((id, lower.to_vec())..(id, upper.to_vec()))
        {
            merged.insert(stored.clone(), value.clone());
        }
    }
}

#[derive(Debug)]
struct Frozen {
    seq: u64,
    entries: Changes,
    bytes: usize,
}

/// How far snapshot jobs have come; shared between the cache and its jobs.
#[derive(Debug, Default)]
struct Progress {
    /// Highest job sequence whose batch is in RocksDB.
    written: AtomicU64,
    /// Highest job sequence whose checkpoint exists (or that finished without one).
    checkpointed: Mutex<(u64, Option<String>)>,
    changed: Condvar,
}

impl Progress {
    /// Waits until every job before `seq` has its checkpoint; fails if one failed.
    fn wait_checkpointed(&self, seq: u64) -> Result<(), StateError> {
        let mut guard = self
            .checkpointed
            .lock()
            .map_err(|_| StateError::Poisoned("progress lock".into()))?;
        loop {
            if let Some(reason) = &guard.1 {
                return Err(StateError::Poisoned(reason.clone()));
            }
            if guard.0 >= seq {
                return Ok(());
            }
            guard = self
                .changed
                .wait(guard)
                .map_err(|_| StateError::Poisoned("progress lock".into()))?;
        }
    }

    fn mark_checkpointed(&self, seq: u64) {
        if let Ok(mut guard) = self.checkpointed.lock() {
            guard.0 = guard.0.max(seq);
        }
        self.changed.notify_all();
    }

    fn mark_failed(&self, reason: String) {
        if let Ok(mut guard) = self.checkpointed.lock() {
            guard.1.get_or_insert(reason);
        }
        self.changed.notify_all();
    }
}

/// What the cache has let go of and the next snapshot job frees, off the task's path:
/// dropping a map of millions of entries takes hundreds of milliseconds.
#[derive(Debug, Default)]
struct Garbage {
    frozen: Vec<Arc<Frozen>>,
    /// Evicted maps of current values; at most one waits when no job runs.
    current: Option<HashMap<CacheKey, Option<Vec<u8>>>>,
}

/// A frozen map of plain values, emptied by a snapshot job and kept for the cache's
/// next dirty set: a dirty set that starts empty at every barrier and regrows to
/// millions of keys paid for rehashing at every doubling and for faulting fresh pages
/// in (a quarter of a counter's time in a 1 M-key word count checkpointing every
/// second). At most one waits; the cache takes it at the next barrier.
type Spare = Arc<Mutex<Option<HashMap<CacheKey, Value>>>>;

impl Garbage {
    /// Frees what was let go of; the largest frozen map of plain values no one else
    /// holds is emptied (its allocation kept) into `spare` instead.
    fn free(self, spare: &Spare) {
        for frozen in self.frozen {
            let Ok(frozen) = Arc::try_unwrap(frozen) else {
                continue;
            };
            let mut values = frozen.entries.values;
            values.clear();
            if let Ok(mut slot) = spare.lock()
                && slot
                    .as_ref()
                    .is_none_or(|s| s.capacity() < values.capacity())
            {
                *slot = Some(values);
            }
        }
    }
}

/// Keyed state with a write-back cache; see the module docs.
#[derive(Debug)]
pub struct CachedState {
    backend: RocksStateBackend,
    ids: BTreeMap<String, u32>,
    names: Vec<String>,
    dirty: Changes,
    dirty_bytes: usize,
    /// Frozen maps whose batch is not yet known to be in RocksDB, oldest first.
    frozen: VecDeque<Arc<Frozen>>,
    retired: Garbage,
    /// The current value of every key it holds (`None` = deleted or absent); see the
    /// module docs. Evicted whole when the budget is exceeded.
    current: HashMap<CacheKey, Option<Vec<u8>>>,
    current_bytes: usize,
    budget: usize,
    next_seq: u64,
    progress: Arc<Progress>,
    digests: SharedDigests,
    spare: Spare,
    spills: u64,
    pub(crate) timers: crate::timers::TimerIndex,
    /// In changelog mode ([`crate::StateConfig::changelog`]), the task's changelog.
    changelog: Option<SharedChangelog>,
}

type SharedChangelog = Arc<Mutex<Changelog>>;

fn lock_changelog(
    log: &SharedChangelog,
) -> Result<std::sync::MutexGuard<'_, Changelog>, StateError> {
    log.lock()
        .map_err(|_| StateError::Poisoned("the changelog's lock was poisoned".into()))
}

/// The result of a [`SnapshotJob`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedSnapshot {
    /// The checkpoint.
    pub checkpoint: CheckpointId,
    /// The snapshot directory (a RocksDB checkpoint plus its local manifest).
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: SnapshotManifest,
    /// Writing the frozen changes (sorting, building and ingesting the SSTs).
    pub write: Duration,
    /// Flushing memtables (what spills left there; usually nothing).
    pub flush: Duration,
    /// Creating the RocksDB checkpoint (hard links).
    pub checkpoint_time: Duration,
    /// Listing and hashing files (new SSTs only) into the manifest.
    pub manifest_time: Duration,
}

/// The asynchronous part of a snapshot: run it anywhere (another thread), exactly
/// once, in the order the cache created the jobs. A job dropped without running still
/// writes its frozen batch (the data must reach RocksDB whatever the checkpoint's fate).
pub struct SnapshotJob {
    db: Arc<DB>,
    options: rocksdb::Options,
    compression: crate::Compression,
    frozen: Arc<Frozen>,
    names: Vec<String>,
    dir: PathBuf,
    checkpoint: CheckpointId,
    context: ManifestContext,
    progress: Arc<Progress>,
    digests: SharedDigests,
    /// What the cache let go of, freed here, off the task's path.
    retired: Garbage,
    spare: Spare,
    changelog: Option<SharedChangelog>,
    done: bool,
}

impl CachedState {
    /// A cache over `backend`, holding at most `backend`'s configured budget.
    #[must_use]
    pub fn new(backend: RocksStateBackend) -> Self {
        let budget = backend.config.cache_budget_bytes;
        let mut cache = Self {
            backend,
            ids: BTreeMap::new(),
            names: Vec::new(),
            dirty: Changes::default(),
            dirty_bytes: 0,
            frozen: VecDeque::new(),
            retired: Garbage::default(),
            current: HashMap::default(),
            current_bytes: 0,
            budget,
            next_seq: 1,
            progress: Arc::new(Progress::default()),
            digests: Arc::new(Mutex::new(DigestCache::default())),
            spare: Spare::default(),
            spills: 0,
            timers: crate::timers::TimerIndex::default(),
            changelog: None,
        };
        cache.changelog = cache
            .backend
            .config
            .changelog
            .map(|config| Arc::new(Mutex::new(Changelog::new(config, &cache.backend.path))));
        for state in cache.backend.states() {
            cache.id(&state);
        }
        cache
    }

    /// The backend underneath.
    #[must_use]
    pub fn backend(&self) -> &RocksStateBackend {
        &self.backend
    }

    /// Bytes held in memory (dirty, frozen and current values, and what waits to be
    /// freed).
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.dirty_bytes
            + self
                .frozen
                .iter()
                .chain(&self.retired.frozen)
                .map(|f| f.bytes)
                .sum::<usize>()
            + self.current_bytes
    }

    /// How many times the dirty set spilled to RocksDB between checkpoints.
    #[must_use]
    pub fn spills(&self) -> u64 {
        self.spills
    }

    fn id(&mut self, state: &str) -> u32 {
        if let Some(id) = self.ids.get(state) {
            return *id;
        }
        let id = u32::try_from(self.names.len()).unwrap_or(u32::MAX);
        self.names.push(state.to_owned());
        self.ids.insert(state.to_owned(), id);
        id
    }

    fn name(&self, id: u32) -> &str {
        self.names.get(id as usize).map_or("", String::as_str)
    }

    /// Lets go of the frozen maps whose batch is in RocksDB: a read that misses the
    /// current values finds theirs (or newer) in RocksDB.
    fn release_frozen(&mut self) {
        let written = self.progress.written.load(Ordering::Acquire);
        while self.frozen.front().is_some_and(|f| f.seq <= written) {
            if let Some(frozen) = self.frozen.pop_front() {
                self.retired.frozen.push(frozen);
            }
        }
    }

    /// Evicts every current value (an O(1) swap; the map is freed by the next job).
    /// When no job has run since the last eviction, that older map is freed here.
    fn evict_current(&mut self) {
        let evicted = std::mem::take(&mut self.current);
        self.current_bytes = 0;
        drop(self.retired.current.replace(evicted));
    }

    /// Remembers `value` as the current value of `key`; a key held already is
    /// updated in place (key and value buffers are copied only when new).
    fn remember(&mut self, key: &CacheKey, value: &Value) {
        let len = key.1.len();
        let added = cost(len, value.as_ref());
        match self.current.get_mut(key) {
            Some(slot) => {
                self.current_bytes = self.current_bytes + added - cost(len, slot.as_ref());
                slot.clone_from(value);
            }
            None => {
                self.current_bytes += added;
                self.current.insert(key.clone(), value.clone());
            }
        }
    }

    /// Sets `key` to `value` (`None` deletes) among the current values and the
    /// changes. A key either map holds already is updated in place: a keyed
    /// aggregate's write to a key it keeps changing allocates nothing but the value.
    fn set(&mut self, key: CacheKey, value: Value) {
        let len = key.1.len();
        let added = cost(len, value.as_ref());
        self.remember(&key, &value);
        match self.dirty.get_mut(&key) {
            Some(slot) => {
                self.dirty_bytes = self.dirty_bytes + added - cost(len, slot.as_ref());
                *slot = value;
            }
            None => {
                self.dirty_bytes += added;
                self.dirty.insert(key, value);
            }
        }
    }

    /// The value of `key` in the changes not yet in RocksDB (dirty, then frozen maps
    /// newest first), if one of them has it.
    fn overlay(&self, key: &CacheKey) -> Option<Option<Vec<u8>>> {
        if let Some(value) = self.dirty.get(key) {
            return Some(value.clone());
        }
        self.frozen
            .iter()
            .rev()
            .find_map(|f| f.entries.get(key).cloned())
    }

    fn over_budget(&self) -> bool {
        self.memory_bytes() > self.budget
    }

    /// Evicts the current values, then spills the dirty set if it alone is over half
    /// the budget. A spill first waits for in-flight snapshot jobs to create their
    /// checkpoints: the spilled writes come after their barriers.
    fn make_room(&mut self) -> Result<(), StateError> {
        self.release_frozen();
        if !self.over_budget() {
            return Ok(());
        }
        self.evict_current();
        if self.dirty_bytes <= self.budget / 2 {
            return Ok(());
        }
        let last_frozen = self.next_seq - 1;
        self.progress.wait_checkpointed(last_frozen)?;
        self.release_frozen();
        let dirty = std::mem::take(&mut self.dirty);
        self.dirty_bytes = 0;
        let writes: Vec<StoredWrite<'_>> = dirty
            .sorted()
            .map(|((id, key), value)| (self.name(*id), key.as_slice(), value.as_deref()))
            .collect();
        match &self.changelog {
            Some(log) => {
                lock_changelog(log)?.append(&self.backend.db, &self.backend.options, &writes)?;
            }
            None => self.backend.write_stored(writes)?,
        }
        // The next dirty set reuses the spilled one's allocation.
        let mut values = dirty.values;
        values.clear();
        self.dirty.values = values;
        self.spills += 1;
        tracing::debug!(spills = self.spills, "write-back cache spilled to RocksDB");
        Ok(())
    }

    /// The synchronous part of a snapshot at barrier `checkpoint`: freeze the dirty set
    /// (an O(1) swap) and return the job that exports it into `dir` (which must not
    /// exist yet).
    pub fn snapshot(&mut self, checkpoint: CheckpointId, dir: impl AsRef<Path>) -> SnapshotJob {
        self.release_frozen();
        let seq = self.next_seq;
        self.next_seq += 1;
        let fresh = self.fresh_changes();
        let entries = std::mem::replace(&mut self.dirty, fresh);
        let frozen = Arc::new(Frozen {
            seq,
            entries,
            bytes: self.dirty_bytes,
        });
        self.dirty_bytes = 0;
        self.frozen.push_back(Arc::clone(&frozen));
        SnapshotJob {
            db: Arc::clone(&self.backend.db),
            options: self.backend.options.clone(),
            compression: self.backend.config.compression,
            frozen,
            names: self.names.clone(),
            dir: dir.as_ref().to_path_buf(),
            checkpoint,
            context: ManifestContext {
                owner: self.backend.owner,
                key_groups: self.backend.key_groups,
                range: self.backend.range,
                options: self.backend.config.describe(),
            },
            progress: Arc::clone(&self.progress),
            digests: Arc::clone(&self.digests),
            retired: std::mem::take(&mut self.retired),
            spare: Arc::clone(&self.spare),
            changelog: self.changelog.clone(),
            done: false,
        }
    }

    /// One write (`None` deletes), checked for the key's group first.
    fn write_one(
        &mut self,
        state: &str,
        key: &[u8],
        field: &[u8],
        value: Value,
    ) -> Result<(), StateError> {
        let stored = encode_key(self.backend.owned_group(key)?, key, field);
        let id = self.id(state);
        self.set((id, stored), value);
        self.make_room()
    }

    /// An empty dirty set for after a barrier: the spare map a job emptied, else one
    /// sized for as many plain values as the last (allocating is cheap; the pages are
    /// faulted in as it fills).
    fn fresh_changes(&self) -> Changes {
        let spare = self.spare.lock().ok().and_then(|mut slot| slot.take());
        Changes {
            values: spare.unwrap_or_else(|| {
                HashMap::with_capacity_and_hasher(self.dirty.values.len(), Default::default())
            }),
            entries: BTreeMap::new(),
        }
    }

    /// Stored keys of `state` within `span` with their current values: RocksDB,
    /// overlaid by the frozen maps (oldest first) and the dirty map; `None` = deleted.
    fn merged(&self, state: &str, span: Span<'_>) -> Result<BTreeMap<Vec<u8>, Value>, StateError> {
        let (Span::Fields(lower, upper) | Span::Groups(lower, upper)) = span;
        let mut merged = BTreeMap::new();
        self.backend
            .scan_stored(state, lower, upper, &mut |stored, value| {
                merged.insert(stored.to_vec(), Some(value.to_vec()));
                true
            })?;
        if let Some(id) = self.ids.get(state) {
            for layer in self
                .frozen
                .iter()
                .map(|f| &f.entries)
                .chain(std::iter::once(&self.dirty))
            {
                layer.overlay_on(*id, span, &mut merged);
            }
        }
        Ok(merged)
    }

    /// Waits for every snapshot job created so far to finish its checkpoint.
    pub fn wait_for_snapshots(&self) -> Result<(), StateError> {
        self.progress.wait_checkpointed(self.next_seq - 1)
    }

    /// In changelog mode, how many materializations have been installed (the first
    /// snapshot's included); `None` otherwise.
    #[must_use]
    pub fn materializations(&self) -> Option<u64> {
        let log = self.changelog.as_ref()?;
        lock_changelog(log).ok().map(|log| log.materializations)
    }

    /// In changelog mode, waits for a materialization running in the background and
    /// installs it, so the next snapshot stands on it.
    pub fn settle_materialization(&self) -> Result<(), StateError> {
        if let Some(log) = &self.changelog {
            lock_changelog(log)?.settle();
        }
        Ok(())
    }
}

impl KeyedState for CachedState {
    fn get(&self, state: &str, key: &[u8], field: &[u8]) -> Result<Option<Vec<u8>>, StateError> {
        match self.lookup(state, key, field)? {
            Lookup::Current(value) | Lookup::Changed(_, value) => Ok(value),
            Lookup::Miss(cache_key) => self.backend.get_stored(state, &cache_key.1),
        }
    }

    fn write(&mut self, batch: StateBatch) -> Result<(), StateError> {
        // Check every key before changing anything: the batch is all or nothing.
        let mut encoded = Vec::with_capacity(batch.writes.len());
        for w in &batch.writes {
            encoded.push(encode_key(
                self.backend.owned_group(&w.key)?,
                &w.key,
                &w.field,
            ));
        }
        for (w, stored) in batch.writes.into_iter().zip(encoded) {
            let key = (self.id(&w.state), stored);
            self.set(key, w.value);
        }
        self.make_room()
    }

    /// One write without building a batch (a keyed aggregate's per-record path).
    fn put(
        &mut self,
        state: &str,
        key: &[u8],
        field: &[u8],
        value: &[u8],
    ) -> Result<(), StateError> {
        self.write_one(state, key, field, Some(value.to_vec()))
    }

    fn delete(&mut self, state: &str, key: &[u8], field: &[u8]) -> Result<(), StateError> {
        self.write_one(state, key, field, None)
    }

    fn fields(&self, state: &str, key: &[u8]) -> Result<FieldValues, StateError> {
        let lower = key_prefix(self.backend.owned_group(key)?, key);
        let upper = prefix_end(&lower);
        Ok(self
            .merged(state, Span::Fields(&lower, &upper))?
            .into_iter()
            .filter_map(|(stored, value)| Some((stored.get(lower.len()..)?.to_vec(), value?)))
            .collect())
    }

    fn scan(
        &self,
        state: &str,
        groups: KeyGroupRange,
        visit: &mut ScanVisitor<'_>,
    ) -> Result<(), StateError> {
        let (lower, upper) = group_bounds(groups);
        for (stored, value) in self.merged(state, Span::Groups(&lower, &upper))? {
            if let (Some((_, key, field)), Some(value)) = (decode_key(&stored), value)
                && !visit(key, field, &value)
            {
                break;
            }
        }
        Ok(())
    }
}

impl CachedState {
    /// [`KeyedState::get`], remembering a value it had to look for (in the changes
    /// or in RocksDB) among the current values, so the next read is one hash probe.
    pub fn get_cached(
        &mut self,
        state: &str,
        key: &[u8],
        field: &[u8],
    ) -> Result<Option<Vec<u8>>, StateError> {
        let (cache_key, value) = match self.lookup(state, key, field)? {
            Lookup::Current(value) => return Ok(value),
            Lookup::Changed(cache_key, value) => (cache_key, value),
            Lookup::Miss(cache_key) => {
                let value = self.backend.get_stored(state, &cache_key.1)?;
                (cache_key, value)
            }
        };
        self.remember(&cache_key, &value);
        if self.over_budget() {
            self.make_room()?;
        }
        Ok(value)
    }

    /// Reads `key`'s value (`None` = absent) and sets it to what `change` makes of
    /// it (`None` deletes): a keyed aggregate's read-modify-write, finding the key's
    /// key group, state id and stored key once where [`CachedState::get_cached`]
    /// and [`KeyedState::put`] each would, and lending the old value rather than
    /// copying it. An error from `change` leaves the state as it was.
    ///
    /// # Errors
    /// A key outside the task's key groups or a failed RocksDB read
    /// ([`StateError`]), or `change`'s own error.
    pub fn update_cached<E: From<StateError>>(
        &mut self,
        state: &str,
        key: &[u8],
        field: &[u8],
        change: impl FnOnce(Option<&[u8]>) -> Result<Option<Vec<u8>>, E>,
    ) -> Result<(), E> {
        let (cache_key, new) = match self.cache_key(state, key, field)? {
            // A state never written has no values; the write gives it an id.
            None => {
                let new = change(None)?;
                let group = self.backend.owned_group(key)?;
                ((self.id(state), encode_key(group, key, field)), new)
            }
            Some(cache_key) => {
                let new = match self.current.get(&cache_key) {
                    Some(value) => change(value.as_deref())?,
                    None => {
                        let value = match self.overlay(&cache_key) {
                            Some(value) => value,
                            None => self.backend.get_stored(state, &cache_key.1)?,
                        };
                        change(value.as_deref())?
                    }
                };
                (cache_key, new)
            }
        };
        self.set(cache_key, new);
        Ok(self.make_room()?)
    }

    /// The cache's key for `key`'s `field` in `state` (the key's group checked), or
    /// `None` for a state never written, which has no values.
    fn cache_key(
        &self,
        state: &str,
        key: &[u8],
        field: &[u8],
    ) -> Result<Option<CacheKey>, StateError> {
        let group = self.backend.owned_group(key)?;
        Ok(self
            .ids
            .get(state)
            .map(|id| (*id, encode_key(group, key, field))))
    }

    /// A read served from memory, or the key to read from RocksDB.
    fn lookup(&self, state: &str, key: &[u8], field: &[u8]) -> Result<Lookup, StateError> {
        let Some(cache_key) = self.cache_key(state, key, field)? else {
            return Ok(Lookup::Current(None));
        };
        if let Some(value) = self.current.get(&cache_key) {
            return Ok(Lookup::Current(value.clone()));
        }
        Ok(match self.overlay(&cache_key) {
            Some(value) => Lookup::Changed(cache_key, value),
            None => Lookup::Miss(cache_key),
        })
    }
}

/// Where a read found its value.
enum Lookup {
    /// Among the current values.
    Current(Option<Vec<u8>>),
    /// In a change not yet in RocksDB (the current values had been evicted).
    Changed(CacheKey, Option<Vec<u8>>),
    /// Nowhere in memory: RocksDB has it.
    Miss(CacheKey),
}

impl std::fmt::Debug for SnapshotJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotJob")
            .field("checkpoint", &self.checkpoint)
            .field("dir", &self.dir)
            .field("entries", &self.frozen.entries.len())
            .finish_non_exhaustive()
    }
}

impl SnapshotJob {
    /// The checkpoint this job exports.
    #[must_use]
    pub fn checkpoint(&self) -> CheckpointId {
        self.checkpoint
    }

    fn write_batch(&self) -> Result<Duration, StateError> {
        let started = Instant::now();
        let writes = self.frozen.entries.sorted().map(|((id, stored), value)| {
            (
                self.names.get(*id as usize).map_or("", String::as_str),
                stored.as_slice(),
                value.as_deref(),
            )
        });
        match &self.changelog {
            // A segment, then the memtable: no SST per checkpoint for compaction.
            Some(log) => {
                let writes: Vec<StoredWrite<'_>> = writes.collect();
                lock_changelog(log)?.append(&self.db, &self.options, &writes)?;
            }
            None => ingest_stored(&self.db, &self.options, self.compression, writes)?,
        }
        self.progress
            .written
            .fetch_max(self.frozen.seq, Ordering::AcqRel);
        Ok(started.elapsed())
    }

    fn flush(&self) -> Result<Duration, StateError> {
        let started = Instant::now();
        flush_all(&self.db, &self.names)?;
        Ok(started.elapsed())
    }

    /// Waits for the previous job's checkpoint, writes the frozen changes, flushes,
    /// creates the RocksDB checkpoint in the job's directory and builds its manifest.
    pub fn run(mut self) -> Result<ExportedSnapshot, StateError> {
        self.done = true;
        let seq = self.frozen.seq;
        let result = self.export(seq);
        // Free what the cache let go of here, on the exporting thread.
        std::mem::take(&mut self.retired).free(&self.spare);
        if let Err(e) = &result {
            if self.progress.written.load(Ordering::Acquire) >= seq {
                // The changes are in RocksDB; only this checkpoint's directory or
                // manifest failed (its directory removed under it when the checkpoint
                // was aborted, say). Later snapshots go on.
                self.progress.mark_checkpointed(seq);
            } else {
                self.progress
                    .mark_failed(format!("{}: {e}", self.checkpoint));
            }
        }
        result
    }

    /// The export: the frozen changes into RocksDB (and, in changelog mode, a
    /// segment); then either the materialization installed or started and it and the
    /// segments since linked into the directory, or a flush and a RocksDB checkpoint
    /// there; then the manifest.
    fn export(&self, seq: u64) -> Result<ExportedSnapshot, StateError> {
        self.progress.wait_checkpointed(seq - 1)?;
        let write = self.write_batch()?;
        let started = Instant::now();
        let (flush, checkpoint_time, linked) = match &self.changelog {
            Some(log) => {
                let mut log = lock_changelog(log)?;
                log.materialize(&self.db, &self.names, &self.digests)?;
                let flush = started.elapsed();
                let started = Instant::now();
                let linked = log.link_into(&self.dir)?;
                (flush, started.elapsed(), Some(linked))
            }
            None => {
                let flush = self.flush()?;
                let started = Instant::now();
                create_checkpoint(&self.db, &self.dir)?;
                (flush, started.elapsed(), None)
            }
        };
        self.progress.mark_checkpointed(seq);
        let started = Instant::now();
        let manifest = match linked {
            Some(linked) => write_manifest(
                &self.dir,
                self.checkpoint,
                &self.context,
                linked.files,
                linked.changelog,
            )?,
            None => build_manifest(&self.dir, self.checkpoint, &self.context, &self.digests)?,
        };
        Ok(ExportedSnapshot {
            checkpoint: self.checkpoint,
            dir: self.dir.clone(),
            manifest,
            write,
            flush,
            checkpoint_time,
            manifest_time: started.elapsed(),
        })
    }

    /// Writes the frozen batch without creating a checkpoint (the checkpoint was
    /// aborted before its export started). The data still reaches RocksDB.
    pub fn discard(mut self) -> Result<(), StateError> {
        self.done = true;
        std::mem::take(&mut self.retired).free(&self.spare);
        self.write_without_checkpoint()
    }

    fn write_without_checkpoint(&self) -> Result<(), StateError> {
        let seq = self.frozen.seq;
        let result = self
            .progress
            .wait_checkpointed(seq - 1)
            .and_then(|()| self.write_batch());
        match result {
            Ok(_) => {
                self.progress.mark_checkpointed(seq);
                Ok(())
            }
            Err(e) => {
                self.progress
                    .mark_failed(format!("{}: {e}", self.checkpoint));
                Err(e)
            }
        }
    }
}

impl Drop for SnapshotJob {
    fn drop(&mut self) {
        if !self.done {
            // Never lose the frozen writes; an error poisons the cache, which reports it.
            let _ = self.write_without_checkpoint();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The inline prefix never reorders keys, and the hashed plain values and
        /// the ordered map entries merge into one order: `sorted` yields exactly the
        /// keys' order (short keys, zero bytes and long shared prefixes included).
        #[test]
        fn sorted_is_key_order(keys in proptest::collection::btree_set(
            (0u32..3, proptest::collection::vec(prop_oneof![Just(0u8), Just(1u8), any::<u8>()], 0..20)),
            0..200,
        )) {
            let mut changes = Changes::default();
            // Into either map whatever their shape (odd lengths into the ordered one).
            for key in &keys {
                if key.1.len() % 2 == 1 {
                    changes.entries.insert(key.clone(), None);
                } else {
                    changes.values.insert(key.clone(), None);
                }
            }
            let got: Vec<_> = changes.sorted().map(|(key, _)| key.clone()).collect();
            let want: Vec<_> = keys.into_iter().collect();
            prop_assert_eq!(got, want);
        }
    }
}
