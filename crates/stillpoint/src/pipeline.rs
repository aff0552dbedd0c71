//! The operator API — replayable sources, keyed operators, two-phase sinks — and the
//! built-in pieces of the word count: a deterministic generated source, a keyed
//! counter and a transactional file sink.

use std::path::{Path, PathBuf};

use stillpoint_state::{CachedState, KeyedState};
use stillpoint_wire::{CheckpointId, SourceOffset, TaskId};

use crate::{EngineError, Record};

/// What a poll of a source produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourcePoll {
    /// Records were appended.
    Records,
    /// Nothing now; poll again later.
    Idle,
    /// The input is exhausted (a bounded source).
    Finished,
}

/// A replayable source: it can be positioned at any offset it reported.
pub trait Source: Send {
    /// Positions the source at `offset` (`None`: the beginning).
    fn seek(&mut self, offset: Option<&SourceOffset>) -> Result<(), EngineError>;
    /// Appends at most `max` records to `out`.
    fn poll(&mut self, max: usize, out: &mut Vec<Record>) -> Result<SourcePoll, EngineError>;
    /// The offset just after the last record returned: where a restore resumes.
    fn offset(&self) -> SourceOffset;
}

/// A keyed operator: each record is processed with the task's keyed state (whose key
/// groups are the task's own; records arrive partitioned by the key group of their
/// key). State must be keyed by the record's key bytes: the key group of a state key
/// is computed from those bytes, so a typed state (`ValueState<K, _>`, which keys by
/// the postcard encoding of `K`) only fits when that encoding is the record key.
pub trait Operator: Send {
    /// Processes one record, appending outputs to `out`.
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError>;
}

/// The durable half of a pre-commit, run on the task's export thread: the task never
/// waits for the disk at a barrier, and the checkpoint cannot complete before it has
/// run. If it fails the transaction's records are gone from memory, so the task fails
/// and the job restores (they are replayed), never a silent loss.
pub type Persist = Box<dyn FnOnce() -> Result<(), EngineError> + Send>;

/// An exactly-once sink: output is written into a transaction per checkpoint,
/// pre-committed (made durable but invisible) at the barrier and committed when the
/// checkpoint completes.
pub trait Sink: Send {
    /// Adds a record to the open transaction.
    fn write(&mut self, record: Record) -> Result<(), EngineError>;
    /// Closes the open transaction as transaction `checkpoint` (still invisible) and
    /// opens the next one; returns the work that makes it durable ([`Persist`]), or
    /// `None` when closing it already did. An error here fails the checkpoint and
    /// keeps the records in the open transaction.
    fn pre_commit(&mut self, checkpoint: CheckpointId) -> Result<Option<Persist>, EngineError>;
    /// Publishes every pre-committed transaction up to and including `checkpoint`.
    /// Idempotent.
    fn commit(&mut self, checkpoint: CheckpointId) -> Result<(), EngineError>;
    /// After a restart: publishes what `restored` covers and rolls back every later
    /// pre-committed transaction (its records will be replayed).
    fn recover(&mut self, restored: Option<CheckpointId>) -> Result<(), EngineError>;
}

/// A deterministic bounded source of words: record `i` of source `index` is a word
/// drawn from a vocabulary by a hash of `(seed, index, i)`. Offsets are positions.
#[derive(Clone, Debug)]
pub struct GeneratedWords {
    seed: u64,
    index: u32,
    total: u64,
    vocabulary: u32,
    position: u64,
}

impl GeneratedWords {
    /// `total` words over `vocabulary` distinct ones.
    #[must_use]
    pub fn new(seed: u64, index: u32, total: u64, vocabulary: u32) -> Self {
        Self {
            seed,
            index,
            total,
            vocabulary: vocabulary.max(1),
            position: 0,
        }
    }

    /// The word at `position`.
    #[must_use]
    pub fn word(&self, position: u64) -> String {
        // SplitMix64 of the triple: stable across platforms and releases.
        let mut z = self
            .seed
            .wrapping_add(u64::from(self.index).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_add(position.wrapping_mul(0xBF58_476D_1CE4_E5B9));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        format!("w{:05}", z % u64::from(self.vocabulary))
    }
}

impl Source for GeneratedWords {
    fn seek(&mut self, offset: Option<&SourceOffset>) -> Result<(), EngineError> {
        self.position = match offset {
            None => 0,
            Some(offset) => offset.as_u64().ok_or_else(|| {
                EngineError::Invalid("a generated source's offset is a position".to_owned())
            })?,
        };
        if self.position > self.total {
            return Err(EngineError::Invalid(format!(
                "offset {} is past the end of a source of {} records",
                self.position, self.total
            )));
        }
        Ok(())
    }

    fn poll(&mut self, max: usize, out: &mut Vec<Record>) -> Result<SourcePoll, EngineError> {
        if self.position >= self.total {
            return Ok(SourcePoll::Finished);
        }
        let end = self.total.min(self.position + max as u64);
        for position in self.position..end {
            out.push(Record::new(self.word(position), bytes::Bytes::new()));
        }
        self.position = end;
        Ok(SourcePoll::Records)
    }

    fn offset(&self) -> SourceOffset {
        SourceOffset::from_u64(self.position)
    }
}

/// Counts records per key in keyed state (column family `counts`, the record's key
/// as the state key, the count as 8 bytes big-endian); emits `(key, count)` after
/// each update.
#[derive(Debug, Default)]
pub struct KeyedCount;

/// The column family of [`KeyedCount`].
pub const COUNTS: &str = "counts";

impl Operator for KeyedCount {
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        let count = match state.get_cached(COUNTS, &record.key, &[])? {
            None => 0,
            Some(bytes) => u64::from_be_bytes(bytes.as_slice().try_into().map_err(|_| {
                EngineError::Invalid(format!(
                    "a count in state `{COUNTS}` is {} bytes, not 8",
                    bytes.len()
                ))
            })?),
        } + 1;
        state.put(COUNTS, &record.key, &[], &count.to_be_bytes())?;
        out.push(Record::new(record.key, count.to_string()));
        Ok(())
    }
}

/// An exactly-once file sink. Each task writes its open transaction to
/// `DIR/pending/<checkpoint>-task-<t>.txt` at pre-commit (fsynced, then renamed into
/// place) and publishes it by renaming it to `DIR/committed/…` when the checkpoint
/// completes. Lines are `key<TAB>value`.
#[derive(Debug)]
pub struct TransactionalFileSink {
    dir: PathBuf,
    task: TaskId,
    open: Vec<u8>,
}

/// The sink stage of [`TransactionalFileSink`]s under one directory: each task its
/// own sink; a restore with another parallelism settles every old task's
/// transactions first ([`recover_transactions`]).
#[derive(Clone, Debug)]
pub struct FileSinkFactory {
    dir: PathBuf,
}

impl crate::SinkFactory for FileSinkFactory {
    fn create(&self, task: TaskId) -> Result<Box<dyn Sink>, EngineError> {
        Ok(Box::new(TransactionalFileSink::new(&self.dir, task)))
    }

    fn settle(&self, restored: CheckpointId) -> Result<(), EngineError> {
        recover_transactions(&self.dir, restored)
    }

    /// The published transactions (`committed/`) of checkpoints after `restored`, and
    /// their lines.
    fn published_after(
        &self,
        restored: Option<CheckpointId>,
    ) -> Result<Option<crate::Published>, EngineError> {
        let mut published = crate::Published::default();
        for (file, path) in list_transactions(&self.dir.join("committed"))? {
            let PendingFile::Transaction(id, _) = file else {
                continue;
            };
            if restored.is_some_and(|r| id <= r) {
                continue;
            }
            published.checkpoints.push(id);
            published.records += count_lines(&path)?;
        }
        published.checkpoints.sort_unstable();
        published.checkpoints.dedup();
        Ok(Some(published))
    }
}

/// The lines of a published transaction, read in blocks.
fn count_lines(path: &Path) -> Result<u64, EngineError> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| EngineError::io("open", path, &e))?;
    let mut buf = vec![0u8; 1 << 16];
    let mut lines = 0u64;
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| EngineError::io("read", path, &e))?;
        if n == 0 {
            return Ok(lines);
        }
        lines += buf
            .get(..n)
            .unwrap_or_default()
            .iter()
            .filter(|b| **b == b'\n')
            .count() as u64;
    }
}

impl TransactionalFileSink {
    /// The sink stage writing under `dir`.
    #[must_use]
    pub fn factory(dir: impl Into<PathBuf>) -> FileSinkFactory {
        FileSinkFactory { dir: dir.into() }
    }

    /// A sink of task `task` writing under `dir`.
    #[must_use]
    pub fn new(dir: impl Into<PathBuf>, task: TaskId) -> Self {
        Self {
            dir: dir.into(),
            task,
            open: Vec::new(),
        }
    }

    fn name(&self, checkpoint: CheckpointId) -> String {
        transaction_name(checkpoint, self.task)
    }

    /// This task's pre-committed transactions, oldest first.
    fn pending(&self) -> Result<Vec<(CheckpointId, PathBuf)>, EngineError> {
        let mut own: Vec<_> = list_pending(&self.dir)?
            .into_iter()
            .filter_map(|(file, path)| match file {
                PendingFile::Transaction(id, task) if task == self.task => Some((id, path)),
                _ => None,
            })
            .collect();
        own.sort();
        Ok(own)
    }

    /// Publishes `transactions` (renames them into `committed/`, then syncs it).
    fn publish(
        &self,
        transactions: impl IntoIterator<Item = (CheckpointId, PathBuf)>,
    ) -> Result<(), EngineError> {
        let committed = self.dir.join("committed");
        std::fs::create_dir_all(&committed)
            .map_err(|e| EngineError::io("create", &committed, &e))?;
        let mut moved = false;
        for (id, path) in transactions {
            let target = committed.join(self.name(id));
            std::fs::rename(&path, &target).map_err(|e| EngineError::io("rename", &path, &e))?;
            moved = true;
        }
        if moved {
            sync_dir(&committed)?;
        }
        Ok(())
    }
}

/// The file name of `task`'s transaction for `checkpoint`, pending or published.
fn transaction_name(checkpoint: CheckpointId, task: TaskId) -> String {
    format!("{:020}-task-{}.txt", checkpoint.get(), task.get())
}

/// A file of a sink directory's `pending/`, known by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PendingFile {
    /// `<checkpoint:020>-task-<t>.txt`: a pre-committed transaction.
    Transaction(CheckpointId, TaskId),
    /// `.<checkpoint:020>-task-<t>.txt.tmp`: a pre-commit a crash cut off before its
    /// rename. It was never pre-committed: its records are replayed from the restored
    /// checkpoint, so recovery removes it.
    Staging(TaskId),
}

impl PendingFile {
    fn parse(name: &str) -> Option<Self> {
        if let Some(staged) = name.strip_prefix('.') {
            let (_, task) = staged.strip_suffix(".txt.tmp")?.split_once("-task-")?;
            return Some(Self::Staging(TaskId(task.parse().ok()?)));
        }
        let (id, task) = name.strip_suffix(".txt")?.split_once("-task-")?;
        Some(Self::Transaction(
            CheckpointId(id.parse().ok()?),
            TaskId(task.parse().ok()?),
        ))
    }
}

/// Every file of `dir/pending` [`PendingFile`] knows, with its path (none if the
/// directory does not exist).
fn list_pending(dir: &Path) -> Result<Vec<(PendingFile, PathBuf)>, EngineError> {
    list_transactions(&dir.join("pending"))
}

/// Every file of `dir` whose name [`PendingFile`] knows (`pending/` or
/// `committed/`), with its path; none if the directory does not exist.
fn list_transactions(dir: &Path) -> Result<Vec<(PendingFile, PathBuf)>, EngineError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(EngineError::io("list", dir, &e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| EngineError::io("list", dir, &e))?;
        if let Some(file) = PendingFile::parse(&entry.file_name().to_string_lossy()) {
            out.push((file, entry.path()));
        }
    }
    Ok(out)
}

/// Removes a file; one already gone (another process recovering the same
/// directory) is not an error.
fn remove_if_present(path: &Path) -> Result<(), EngineError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(EngineError::io("remove", path, &e)),
    }
}

fn sync_dir(dir: &Path) -> Result<(), EngineError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| EngineError::io("sync", dir, &e))
}

impl Sink for TransactionalFileSink {
    fn write(&mut self, record: Record) -> Result<(), EngineError> {
        self.open.extend_from_slice(&record.key);
        self.open.push(b'\t');
        self.open.extend_from_slice(&record.value);
        self.open.push(b'\n');
        Ok(())
    }

    fn pre_commit(&mut self, checkpoint: CheckpointId) -> Result<Option<Persist>, EngineError> {
        let dir = self.dir.join("pending");
        let target = dir.join(self.name(checkpoint));
        let staging = dir.join(format!(".{}.tmp", self.name(checkpoint)));
        let contents = std::mem::take(&mut self.open);
        Ok(Some(Box::new(move || {
            use std::io::Write;
            std::fs::create_dir_all(&dir).map_err(|e| EngineError::io("create", &dir, &e))?;
            let mut file = std::fs::File::create(&staging)
                .map_err(|e| EngineError::io("create", &staging, &e))?;
            file.write_all(&contents)
                .and_then(|()| file.sync_all())
                .map_err(|e| EngineError::io("write", &staging, &e))?;
            std::fs::rename(&staging, &target)
                .map_err(|e| EngineError::io("rename", &staging, &e))?;
            sync_dir(&dir)
        })))
    }

    fn commit(&mut self, checkpoint: CheckpointId) -> Result<(), EngineError> {
        let due = self
            .pending()?
            .into_iter()
            .take_while(|(id, _)| *id <= checkpoint);
        self.publish(due)
    }

    /// One pass over `pending/`: this task's interrupted pre-commits are removed, its
    /// transactions up to `restored` published and later ones rolled back.
    fn recover(&mut self, restored: Option<CheckpointId>) -> Result<(), EngineError> {
        self.open.clear();
        let mut due = Vec::new();
        for (file, path) in list_pending(&self.dir)? {
            match file {
                PendingFile::Staging(task) if task == self.task => remove_if_present(&path)?,
                PendingFile::Transaction(id, task) if task == self.task => {
                    if restored.is_some_and(|r| id <= r) {
                        due.push((id, path));
                    } else {
                        remove_if_present(&path)?;
                    }
                }
                PendingFile::Staging(_) | PendingFile::Transaction(..) => {}
            }
        }
        due.sort();
        self.publish(due)
    }
}

/// After a restore that changed the sinks (a rescale): publishes every task's
/// pre-committed transactions up to `restored` and rolls back every later one,
/// whichever task wrote them, and removes every interrupted pre-commit's staging file.
pub fn recover_transactions(dir: &Path, restored: CheckpointId) -> Result<(), EngineError> {
    let files = list_pending(dir)?;
    if files.is_empty() {
        return Ok(());
    }
    let committed = dir.join("committed");
    std::fs::create_dir_all(&committed).map_err(|e| EngineError::io("create", &committed, &e))?;
    for (file, path) in files {
        match file {
            PendingFile::Transaction(id, task) if id <= restored => {
                let target = committed.join(transaction_name(id, task));
                match std::fs::rename(&path, &target) {
                    Ok(()) => {}
                    // Another process recovering the same directory got there first.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(EngineError::io("recover", &path, &e)),
                }
            }
            PendingFile::Transaction(..) | PendingFile::Staging(_) => remove_if_present(&path)?,
        }
    }
    sync_dir(&committed)
}

/// Every line a [`TransactionalFileSink`] published under `dir`, as `(key, value)`.
pub fn read_committed(dir: &Path) -> Result<Vec<(String, String)>, EngineError> {
    let committed = dir.join("committed");
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&committed) {
        Ok(entries) => entries.filter_map(Result::ok).map(|e| e.path()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(EngineError::io("list", &committed, &e)),
    };
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text =
            std::fs::read_to_string(&file).map_err(|e| EngineError::io("read", &file, &e))?;
        for line in text.lines() {
            let (key, value) = line.split_once('\t').unwrap_or((line, ""));
            out.push((key.to_owned(), value.to_owned()));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// A pre-commit of checkpoint `id` by `task` that a crash cut off before its
    /// rename, and one that completed.
    fn interrupted(dir: &Path, task: u32, id: u64) {
        let pending = dir.join("pending");
        std::fs::create_dir_all(&pending).unwrap();
        let name = format!("{id:020}-task-{task}.txt");
        std::fs::write(pending.join(format!(".{name}.tmp")), "half\n").unwrap();
    }

    fn pre_committed(dir: &Path, task: u32, id: u64, line: &str) {
        let mut sink = TransactionalFileSink::new(dir, TaskId(task));
        sink.write(Record::new(line.to_owned(), "1")).unwrap();
        let persist = sink.pre_commit(CheckpointId(id)).unwrap().unwrap();
        persist().unwrap();
    }

    #[test]
    fn pending_names_are_recognised_and_nothing_else() {
        for (name, file) in [
            (
                ".00000000000000000002-task-7.txt.tmp",
                Some(PendingFile::Staging(TaskId(7))),
            ),
            (
                "00000000000000000002-task-7.txt",
                Some(PendingFile::Transaction(CheckpointId(2), TaskId(7))),
            ),
            (".00000000000000000002-task-x.txt.tmp", None),
            ("00000000000000000002-task-7.txt.tmp", None),
            ("x-task-7.txt", None),
            (".notes.tmp", None),
        ] {
            assert_eq!(PendingFile::parse(name), file, "{name}");
        }
    }

    #[test]
    fn a_sink_recovering_removes_its_interrupted_pre_commits_only() {
        let dir = tempfile::tempdir().unwrap();
        pre_committed(dir.path(), 1, 1, "a");
        interrupted(dir.path(), 1, 2);
        interrupted(dir.path(), 2, 2);
        let mut sink = TransactionalFileSink::new(dir.path(), TaskId(1));
        sink.recover(Some(CheckpointId(1))).unwrap();
        assert_eq!(
            names(&dir.path().join("pending")),
            [".00000000000000000002-task-2.txt.tmp"]
        );
        assert_eq!(
            read_committed(dir.path()).unwrap(),
            [("a".to_owned(), "1".to_owned())]
        );
    }

    #[test]
    fn settling_a_rescaled_sink_stage_leaves_nothing_pending() {
        let dir = tempfile::tempdir().unwrap();
        pre_committed(dir.path(), 6, 2, "kept");
        pre_committed(dir.path(), 7, 3, "rolled back");
        interrupted(dir.path(), 7, 3);
        recover_transactions(dir.path(), CheckpointId(2)).unwrap();
        assert!(names(&dir.path().join("pending")).is_empty());
        assert_eq!(
            read_committed(dir.path()).unwrap(),
            [("kept".to_owned(), "1".to_owned())]
        );
    }
}
