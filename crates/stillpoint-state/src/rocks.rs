//! `KeyedState`, the storage trait (no RocksDB types), and `RocksStateBackend`, its
//! RocksDB implementation: one database per task, one column family per operator
//! state, every key prefixed with its key group.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rocksdb::{
    DB, Direction, IngestExternalFileOptions, IteratorMode, ReadOptions, SstFileWriter, WriteBatch,
    WriteOptions,
};
use stillpoint_wire::{KeyGroupRange, StreamId, TaskId};

use crate::keygroup::prefix;
use crate::{KeyGroups, StateConfig, StateError};

/// One change of a [`StateBatch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateWrite {
    /// The operator state (column family).
    pub state: String,
    /// The key (its key group decides which task owns it).
    pub key: Vec<u8>,
    /// The field within the key (empty for plain values).
    pub field: Vec<u8>,
    /// The new value, or `None` to delete.
    pub value: Option<Vec<u8>>,
}

/// Changes applied atomically: all or none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateBatch {
    /// The changes, applied in order.
    pub writes: Vec<StateWrite>,
}

impl StateBatch {
    /// Sets `field` of `key`.
    pub fn put(&mut self, state: &str, key: &[u8], field: &[u8], value: &[u8]) -> &mut Self {
        self.writes.push(StateWrite {
            state: state.into(),
            key: key.into(),
            field: field.into(),
            value: Some(value.into()),
        });
        self
    }

    /// Deletes `field` of `key`.
    pub fn delete(&mut self, state: &str, key: &[u8], field: &[u8]) -> &mut Self {
        self.writes.push(StateWrite {
            state: state.into(),
            key: key.into(),
            field: field.into(),
            value: None,
        });
        self
    }
}

/// The `(field, value)` pairs of one key, in field order.
pub type FieldValues = Vec<(Vec<u8>, Vec<u8>)>;

/// Called with `(key, field, value)` for each entry of a scan; returns false to stop.
pub type ScanVisitor<'a> = dyn FnMut(&[u8], &[u8], &[u8]) -> bool + 'a;

/// One encoded change: `(state, stored key, value or None to delete)`.
pub(crate) type StoredWrite<'a> = (&'a str, &'a [u8], Option<&'a [u8]>);

/// Keyed operator state, free of any storage engine's types.
///
/// A value is addressed by `(state, key, field)`: `state` names the operator state,
/// `key` is the partitioning key (its key group decides which task owns it), and
/// `field` addresses an entry within the key (map state); plain values use an empty
/// field. [`KeyedState::fields`] is the prefix scan over one key's fields;
/// [`KeyedState::scan`] walks whole key groups.
pub trait KeyedState {
    /// The value, if set.
    fn get(&self, state: &str, key: &[u8], field: &[u8]) -> Result<Option<Vec<u8>>, StateError>;

    /// Applies `batch` atomically.
    fn write(&mut self, batch: StateBatch) -> Result<(), StateError>;

    /// Every `(field, value)` of `key`, in field order.
    fn fields(&self, state: &str, key: &[u8]) -> Result<FieldValues, StateError>;

    /// Visits every `(key, field, value)` of `state` in key groups `groups`, in key
    /// group then key order, until `visit` returns false.
    fn scan(
        &self,
        state: &str,
        groups: KeyGroupRange,
        visit: &mut ScanVisitor<'_>,
    ) -> Result<(), StateError>;

    /// Sets one value.
    fn put(
        &mut self,
        state: &str,
        key: &[u8],
        field: &[u8],
        value: &[u8],
    ) -> Result<(), StateError> {
        let mut batch = StateBatch::default();
        batch.put(state, key, field, value);
        self.write(batch)
    }

    /// Deletes one value.
    fn delete(&mut self, state: &str, key: &[u8], field: &[u8]) -> Result<(), StateError> {
        let mut batch = StateBatch::default();
        batch.delete(state, key, field);
        self.write(batch)
    }
}

/// Stored key: key group (2 bytes, big-endian) · key length (4 bytes, big-endian) ·
/// key · field. The length keeps `fields` of key `a` from seeing key `ab`.
pub(crate) fn encode_key(group: u32, key: &[u8], field: &[u8]) -> Vec<u8> {
    let mut out = key_prefix(group, key);
    out.extend_from_slice(field);
    out
}

pub(crate) fn key_prefix(group: u32, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(6 + key.len());
    out.extend_from_slice(&prefix(group));
    out.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(key);
    out
}

/// `(group, key, field)` of a stored key, or `None` if it is not one of ours.
pub(crate) fn decode_key(stored: &[u8]) -> Option<(u32, &[u8], &[u8])> {
    let (group, rest) = stored.split_first_chunk::<2>()?;
    let (len, rest) = rest.split_first_chunk::<4>()?;
    let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
    let (key, field) = rest.split_at_checked(len)?;
    Some((u32::from(u16::from_be_bytes(*group)), key, field))
}

/// The stored-key bounds of key groups `groups`.
pub(crate) fn group_bounds(groups: KeyGroupRange) -> (Vec<u8>, Vec<u8>) {
    (prefix(groups.start).to_vec(), prefix(groups.end).to_vec())
}

/// Who owns a database: written into its snapshot manifests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateOwner {
    /// The stream.
    pub stream: StreamId,
    /// The task.
    pub task: TaskId,
}

/// The RocksDB state of one task.
pub struct RocksStateBackend {
    pub(crate) db: Arc<DB>,
    pub(crate) path: PathBuf,
    pub(crate) config: StateConfig,
    pub(crate) key_groups: KeyGroups,
    pub(crate) range: KeyGroupRange,
    pub(crate) owner: StateOwner,
    /// Built once: every column family shares its block cache.
    pub(crate) options: rocksdb::Options,
}

impl std::fmt::Debug for RocksStateBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStateBackend")
            .field("path", &self.path)
            .field("owner", &self.owner)
            .field("range", &self.range)
            .finish_non_exhaustive()
    }
}

/// Whether RocksDB's automatic compactions run in a database being opened.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compactions {
    Run,
    /// Held until [`RocksStateBackend::resume_compactions`]: a restore's. A restored
    /// materialization often opens with enough L0 files for RocksDB to start a
    /// compaction at once, which took a core from the replay and the ingestions that
    /// come next (half of a 2-core restore's CPU samples).
    Held,
}

pub(crate) fn write_options() -> WriteOptions {
    let mut options = WriteOptions::default();
    options.disable_wal(true);
    options
}

impl RocksStateBackend {
    /// Opens (or creates) the database at `path` for `owner`, owning key groups
    /// `range` of `key_groups`.
    pub fn open(
        path: impl AsRef<Path>,
        config: StateConfig,
        key_groups: KeyGroups,
        range: KeyGroupRange,
        owner: StateOwner,
    ) -> Result<Self, StateError> {
        Self::open_with(path, config, key_groups, range, owner, Compactions::Run)
    }

    /// [`open`](Self::open) with RocksDB's automatic compactions running or held
    /// (`Compactions::Held`, a restore's) until
    /// [`resume_compactions`](Self::resume_compactions).
    pub(crate) fn open_with(
        path: impl AsRef<Path>,
        config: StateConfig,
        key_groups: KeyGroups,
        range: KeyGroupRange,
        owner: StateOwner,
        compactions: Compactions,
    ) -> Result<Self, StateError> {
        key_groups.check(range)?;
        let path = path.as_ref().to_path_buf();
        let options = config.rocks_options();
        let families = if path.join("CURRENT").is_file() {
            DB::list_cf(&options, &path).map_err(StateError::rocks("listing column families"))?
        } else {
            vec!["default".to_owned()]
        };
        let mut family_options = options.clone();
        family_options.set_disable_auto_compactions(compactions == Compactions::Held);
        // Every column family with the tuned options: `DB::open_cf` would open the
        // existing ones with RocksDB's defaults (no bloom filters, no shared block
        // cache, another index), so a restored task — whose states all exist — ran
        // untuned, and every point read searched a data block of every file.
        let db = DB::open_cf_with_opts(
            &options,
            &path,
            families
                .into_iter()
                .map(|name| (name, family_options.clone())),
        )
        .map_err(StateError::rocks("opening the database"))?;
        Ok(Self {
            db: Arc::new(db),
            path,
            config,
            key_groups,
            range,
            owner,
            options,
        })
    }

    /// The database directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key groups this task owns.
    #[must_use]
    pub fn key_group_range(&self) -> KeyGroupRange {
        self.range
    }

    /// The stream's key groups.
    #[must_use]
    pub fn key_groups(&self) -> KeyGroups {
        self.key_groups
    }

    /// Lets RocksDB compact every column family again after a restore opened them
    /// held ([`Compactions::Held`]; a family created since was never held); RocksDB
    /// schedules what is due at once.
    pub(crate) fn resume_compactions(&self) -> Result<(), StateError> {
        let names = DB::list_cf(&self.options, &self.path)
            .map_err(StateError::rocks("listing column families"))?;
        for name in names {
            let Some(cf) = self.db.cf_handle(&name) else {
                continue;
            };
            self.db
                .set_options_cf(&cf, &[("disable_auto_compactions", "false")])
                .map_err(StateError::rocks("resuming compactions"))?;
        }
        Ok(())
    }

    /// The operator states (column families) that exist.
    #[must_use]
    pub fn states(&self) -> Vec<String> {
        DB::list_cf(&self.options, &self.path)
            .unwrap_or_default()
            .into_iter()
            .filter(|name| name != "default")
            .collect()
    }

    /// The key group of `key`, checked against the range this task owns.
    pub(crate) fn owned_group(&self, key: &[u8]) -> Result<u32, StateError> {
        let group = self.key_groups.of(key);
        if self.range.contains(group) {
            Ok(group)
        } else {
            Err(StateError::ForeignKeyGroup {
                group,
                range: self.range,
            })
        }
    }

    pub(crate) fn get_stored(
        &self,
        state: &str,
        stored: &[u8],
    ) -> Result<Option<Vec<u8>>, StateError> {
        let Some(cf) = self.db.cf_handle(state) else {
            return Ok(None);
        };
        self.db
            .get_cf(&cf, stored)
            .map_err(StateError::rocks("get"))
    }

    /// Writes already-encoded `(state, stored key, value)` changes in one batch.
    pub(crate) fn write_stored<'a>(
        &self,
        writes: impl IntoIterator<Item = StoredWrite<'a>>,
    ) -> Result<(), StateError> {
        write_stored(&self.db, &self.options, writes)
    }

    /// Visits stored `(key, value)` pairs of `state` with `lower <= key < upper`.
    pub(crate) fn scan_stored(
        &self,
        state: &str,
        lower: &[u8],
        upper: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StateError> {
        let Some(cf) = self.db.cf_handle(state) else {
            return Ok(());
        };
        let mut options = ReadOptions::default();
        options.set_iterate_lower_bound(lower.to_vec());
        options.set_iterate_upper_bound(upper.to_vec());
        for item in
            self.db
                .iterator_cf_opt(&cf, options, IteratorMode::From(lower, Direction::Forward))
        {
            let (key, value) = item.map_err(StateError::rocks("scan"))?;
            if !visit(&key, &value) {
                break;
            }
        }
        Ok(())
    }
}

/// The column family of `state`, created with `options` if it does not exist yet.
pub(crate) fn column_family<'a>(
    db: &'a DB,
    options: &rocksdb::Options,
    state: &str,
) -> Result<Arc<rocksdb::BoundColumnFamily<'a>>, StateError> {
    if let Some(cf) = db.cf_handle(state) {
        return Ok(cf);
    }
    db.create_cf(state, options)
        .map_err(StateError::rocks("creating a column family"))?;
    db.cf_handle(state).ok_or_else(|| StateError::Rocks {
        context: "column family",
        message: format!("`{state}` was created but cannot be found"),
    })
}

/// Writes encoded `(state, stored key, value)` changes to `db` as one atomic batch,
/// without the write-ahead log.
pub(crate) fn write_stored<'a>(
    db: &DB,
    options: &rocksdb::Options,
    writes: impl IntoIterator<Item = StoredWrite<'a>>,
) -> Result<(), StateError> {
    let mut batch = WriteBatch::default();
    for (state, stored, value) in writes {
        let cf = column_family(db, options, state)?;
        match value {
            Some(value) => batch.put_cf(&cf, stored, value),
            None => batch.delete_cf(&cf, stored),
        }
    }
    db.write_opt(batch, &write_options())
        .map_err(StateError::rocks("write batch"))
}

/// Where a database's SSTs are built before they are ingested: inside its directory
/// (RocksDB ignores what it did not name, and a checkpoint links only its own files),
/// so the ingest's move is a rename on one file system.
pub(crate) fn ingest_dir(db: &DB) -> PathBuf {
    db.path().join("stillpoint-ingest")
}

/// Writes encoded `(state, stored key, value)` changes — sorted by state, then stored
/// key, each key once — by building one SST per state and ingesting it (the file is
/// moved in), without the memtable: what a flush would write, minus inserting every
/// entry into a skip list first and sorting it there again. The states are ingested
/// one after the other; a caller that needs them visible together keeps serving the
/// changes from memory until this returns (the write-back cache does). The SSTs are
/// built with [`sst_writer_options`].
pub(crate) fn ingest_stored<'a>(
    db: &DB,
    options: &rocksdb::Options,
    compression: crate::Compression,
    writes: impl IntoIterator<Item = StoredWrite<'a>>,
) -> Result<(), StateError> {
    let writer_options = sst_writer_options(options, compression);
    let dir = ingest_dir(db);
    std::fs::create_dir_all(&dir).map_err(StateError::io("creating", &dir))?;
    let mut writes = writes.into_iter().peekable();
    while let Some(&(state, _, _)) = writes.peek() {
        let cf = column_family(db, options, state)?;
        let leading = std::iter::from_fn(|| writes.next_if(|w| w.0 == state).map(|w| (w.1, w.2)));
        let path = build_sst(&writer_options, &dir, leading)?;
        ingest_files(db, &cf, vec![path])?;
    }
    Ok(())
}

/// The options an SST to be ingested is built with: compressed as flushed ones are
/// (`compression`), where a writer would otherwise take the bottommost level's (Zstd
/// by default, several times LZ4's CPU), since an ingested file may land there.
pub(crate) fn sst_writer_options(
    options: &rocksdb::Options,
    compression: crate::Compression,
) -> rocksdb::Options {
    let mut writer_options = options.clone();
    writer_options.set_bottommost_compression_type(compression.rocks());
    writer_options
}

/// A new file name in `dir` (from [`ingest_dir`]) for an SST to be ingested, unique
/// in the process (state names need not be file names).
fn ingest_path(dir: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    dir.join(format!("{}.sst", NEXT.fetch_add(1, Ordering::Relaxed)))
}

/// Builds an SST to be ingested at a new path in `dir` (from [`ingest_dir`]) from
/// `(stored key, value)` writes in key order, each key once (`None`: a delete), and
/// returns the path; a build that fails leaves no file behind.
pub(crate) fn build_sst<'a>(
    options: &rocksdb::Options,
    dir: &Path,
    writes: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
) -> Result<PathBuf, StateError> {
    let path = ingest_path(dir);
    match write_sst(options, &path, writes) {
        Ok(()) => Ok(path),
        Err(error) => {
            remove_unused(std::slice::from_ref(&path));
            Err(error)
        }
    }
}

fn write_sst<'a>(
    options: &rocksdb::Options,
    path: &Path,
    writes: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
) -> Result<(), StateError> {
    let mut writer = SstFileWriter::create(options);
    writer
        .open(path)
        .map_err(StateError::rocks("creating an SST"))?;
    for (stored, value) in writes {
        match value {
            Some(value) => writer.put(stored, value),
            None => writer.delete(stored),
        }
        .map_err(StateError::rocks("writing an SST"))?;
    }
    writer
        .finish()
        .map_err(StateError::rocks("finishing an SST"))
}

/// Removes built SSTs that were never ingested: nothing refers to them (a file
/// already gone is no error).
pub(crate) fn remove_unused(paths: &[PathBuf]) {
    for path in paths {
        let _gone = std::fs::remove_file(path);
    }
}

/// Ingests the built SSTs at `paths` — key ranges that do not overlap — into the
/// column family `cf` in one step (the files are moved in). The files are removed
/// when they could not be ingested.
pub(crate) fn ingest_files(
    db: &DB,
    cf: &Arc<rocksdb::BoundColumnFamily<'_>>,
    paths: Vec<PathBuf>,
) -> Result<(), StateError> {
    let mut ingest = IngestExternalFileOptions::default();
    ingest.set_move_files(true);
    let result = db
        .ingest_external_file_cf_opts(cf, &ingest, paths.iter().collect())
        .map_err(StateError::rocks("ingesting an SST"));
    if result.is_err() {
        remove_unused(&paths);
    }
    result
}

/// The exclusive upper bound of every key starting with `prefix`.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    vec![u8::MAX; prefix.len() + 1]
}

impl KeyedState for RocksStateBackend {
    fn get(&self, state: &str, key: &[u8], field: &[u8]) -> Result<Option<Vec<u8>>, StateError> {
        let group = self.owned_group(key)?;
        self.get_stored(state, &encode_key(group, key, field))
    }

    fn write(&mut self, batch: StateBatch) -> Result<(), StateError> {
        let encoded = batch
            .writes
            .iter()
            .map(|w| {
                Ok((
                    w.state.as_str(),
                    encode_key(self.owned_group(&w.key)?, &w.key, &w.field),
                    w.value.as_deref(),
                ))
            })
            .collect::<Result<Vec<_>, StateError>>()?;
        self.write_stored(encoded.iter().map(|(s, k, v)| (*s, k.as_slice(), *v)))
    }

    fn fields(&self, state: &str, key: &[u8]) -> Result<FieldValues, StateError> {
        let lower = key_prefix(self.owned_group(key)?, key);
        let upper = prefix_end(&lower);
        let mut out = Vec::new();
        self.scan_stored(state, &lower, &upper, &mut |stored, value| {
            if let Some(field) = stored.get(lower.len()..) {
                out.push((field.to_vec(), value.to_vec()));
            }
            true
        })?;
        Ok(out)
    }

    fn scan(
        &self,
        state: &str,
        groups: KeyGroupRange,
        visit: &mut ScanVisitor<'_>,
    ) -> Result<(), StateError> {
        let (lower, upper) = group_bounds(groups);
        self.scan_stored(
            state,
            &lower,
            &upper,
            &mut |stored, value| match decode_key(stored) {
                Some((_, key, field)) => visit(key, field, value),
                None => true,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_keys_round_trip_and_sort_by_group() {
        let stored = encode_key(7, b"user", b"field");
        assert_eq!(decode_key(&stored), Some((7, &b"user"[..], &b"field"[..])));
        assert!(encode_key(1, b"zzz", b"") < encode_key(2, b"a", b""));
        assert_eq!(decode_key(b"\x00"), None);
        assert_eq!(prefix_end(&[1, 2, 0xff]), vec![1, 3]);
    }

    fn level0_files(backend: &RocksStateBackend) -> u64 {
        backend
            .db
            .property_int_value("rocksdb.num-files-at-level0")
            .unwrap()
            .unwrap()
    }

    /// A database opened for a restore compacts nothing, however many L0 files it
    /// has, until `resume_compactions`; then RocksDB compacts them on its own.
    #[test]
    fn a_restoring_database_holds_its_compactions_until_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let groups = KeyGroups::new(128).unwrap();
        let owner = StateOwner {
            stream: StreamId(1),
            task: TaskId(1),
        };
        let config = crate::StateConfig::default();
        let held = Compactions::Held;
        let backend =
            RocksStateBackend::open_with(dir.path(), config, groups, groups.all(), owner, held)
                .unwrap();
        // Twice RocksDB's default trigger of an L0 compaction (4 files).
        for round in 0..8_u8 {
            backend.db.put([round], [round]).unwrap();
            backend.db.flush().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(level0_files(&backend), 8, "a compaction ran while held");
        backend.resume_compactions().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while level0_files(&backend) >= 4 {
            assert!(
                std::time::Instant::now() < deadline,
                "no compaction after resuming"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Writes of several states, in any order, land each in its own state's column
    /// family (created on first use), and within one batch a later write of a key
    /// wins, deletes included.
    #[test]
    fn write_stored_puts_each_write_in_its_own_states_family() {
        let dir = tempfile::tempdir().unwrap();
        let options = crate::StateConfig::default().rocks_options();
        let db = DB::open(&options, dir.path().join("db")).unwrap();
        let put = |state, key: &'static [u8], value: &'static [u8]| (state, key, Some(value));
        let writes: Vec<StoredWrite<'_>> = vec![
            put("a", b"k1", b"a1"),
            put("a", b"k2", b"a2"),
            put("b", b"k1", b"b1"),
            put("a", b"k3", b"a3"),
            put("b", b"k2", b"b2"),
            ("b", b"k2", None),
        ];
        write_stored(&db, &options, writes).unwrap();
        let read = |state: &str, key: &[u8]| {
            let cf = db.cf_handle(state).unwrap();
            db.get_cf(&cf, key).unwrap()
        };
        assert_eq!(read("a", b"k1"), Some(b"a1".to_vec()));
        assert_eq!(read("a", b"k2"), Some(b"a2".to_vec()));
        assert_eq!(read("a", b"k3"), Some(b"a3".to_vec()));
        assert_eq!(read("b", b"k1"), Some(b"b1".to_vec()));
        assert_eq!(
            read("b", b"k2"),
            None,
            "the later delete wins within the batch"
        );
        assert_eq!(read("b", b"k3"), None);
    }
}
