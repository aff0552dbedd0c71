//! An exactly-once file sink: transactions pre-committed under `pending/`, published
//! by renaming them into `committed/`, and each commit recorded with the source
//! offsets it covers under `commits/` (what lets a fallback replay exactly).

use std::path::{Path, PathBuf};

use stillpoint::{EngineError, Persist, Published, Record, Sink, SinkFactory};
use stillpoint_wire::{CheckpointId, SourcePosition, TaskId};

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

impl SinkFactory for FileSinkFactory {
    fn create(&self, task: TaskId) -> Result<Box<dyn Sink>, EngineError> {
        Ok(Box::new(TransactionalFileSink::new(&self.dir, task)))
    }

    fn settle(&self, restored: CheckpointId) -> Result<(), EngineError> {
        recover_transactions(&self.dir, restored)
    }

    /// Records the commit in `DIR/commits/` ([`write_commit_record`]).
    fn record_commit(
        &self,
        checkpoint: CheckpointId,
        sources: &[SourcePosition],
    ) -> Result<(), EngineError> {
        write_commit_record(&self.dir, checkpoint, sources)
    }

    /// The transactions of checkpoints after `restored` that are published
    /// (`committed/`) or will be on recovery (pending, but the newest commit record
    /// covers them), their lines, and the offsets of that record when it covers
    /// every one of them.
    fn published_after(
        &self,
        restored: Option<CheckpointId>,
    ) -> Result<Option<Published>, EngineError> {
        let newest = newest_commit_record(&self.dir)?;
        let settled = settled_through(restored, newest.as_ref());
        let after = |id: CheckpointId| restored.is_none_or(|r| id > r);
        let mut published = Published::default();
        let pending = list_pending(&self.dir)?
            .into_iter()
            .filter(|(file, _)| {
                matches!(file, PendingFile::Transaction(id, _) if settled.is_some_and(|s| *id <= s))
            });
        for (file, path) in list_transactions(&self.dir.join("committed"))?
            .into_iter()
            .chain(pending)
        {
            let PendingFile::Transaction(id, _) = file else {
                continue;
            };
            if after(id) {
                published.checkpoints.push(id);
                published.records += count_lines(&path)?;
            }
        }
        published.checkpoints.sort_unstable();
        published.checkpoints.dedup();
        published.covers = newest
            .filter(|record| {
                published
                    .checkpoints
                    .last()
                    .is_some_and(|last| *last <= record.checkpoint)
                    && after(record.checkpoint)
            })
            .map(|record| record.sources);
        Ok(Some(published))
    }
}

/// A sink directory's record that a checkpoint committed, with the source offsets it
/// covers: `DIR/commits/<checkpoint:020>.json`, written durably before any task of
/// the stage is told to publish the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CommitRecord {
    checkpoint: CheckpointId,
    sources: Vec<SourcePosition>,
}

/// The directory of a sink directory's commit records.
const COMMITS: &str = "commits";
/// Commit records kept: recovery reads only the newest.
const KEEP_COMMIT_RECORDS: usize = 4;
/// The largest commit record read (one offset per source task).
const MAX_COMMIT_RECORD_BYTES: u64 = 1 << 20;

/// The commit records under `dir`, oldest first.
fn commit_records(dir: &Path) -> Result<Vec<(CheckpointId, PathBuf)>, EngineError> {
    let commits = dir.join(COMMITS);
    let entries = match std::fs::read_dir(&commits) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(EngineError::io("list", &commits, &e)),
    };
    let mut records = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| EngineError::io("list", &commits, &e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(id) = name.strip_suffix(".json").and_then(|id| id.parse().ok()) {
            records.push((CheckpointId(id), entry.path()));
        }
    }
    records.sort();
    Ok(records)
}

/// The newest commit record under `dir`; a damaged one is an error naming the file
/// (it cannot be told apart from a record of an older commit).
fn newest_commit_record(dir: &Path) -> Result<Option<CommitRecord>, EngineError> {
    use std::io::Read;
    let Some((id, path)) = commit_records(dir)?.pop() else {
        return Ok(None);
    };
    let mut text = Vec::new();
    std::fs::File::open(&path)
        .and_then(|file| {
            file.take(MAX_COMMIT_RECORD_BYTES + 1)
                .read_to_end(&mut text)
        })
        .map_err(|e| EngineError::io("read", &path, &e))?;
    let damaged = |why: String| {
        EngineError::Invalid(format!("{}: not a commit record: {why}", path.display()))
    };
    if text.len() as u64 > MAX_COMMIT_RECORD_BYTES {
        return Err(damaged(format!(
            "longer than {MAX_COMMIT_RECORD_BYTES} bytes"
        )));
    }
    let record: CommitRecord = serde_json::from_slice(&text).map_err(|e| damaged(e.to_string()))?;
    if record.checkpoint != id {
        return Err(damaged(format!(
            "it names checkpoint {}",
            record.checkpoint.get()
        )));
    }
    Ok(Some(record))
}

/// Writes `dir`'s commit record of `checkpoint` durably (synced, renamed into place,
/// directory synced) and drops all but the newest few.
pub(crate) fn write_commit_record(
    dir: &Path,
    checkpoint: CheckpointId,
    sources: &[SourcePosition],
) -> Result<(), EngineError> {
    use std::io::Write;
    let commits = dir.join(COMMITS);
    std::fs::create_dir_all(&commits).map_err(|e| EngineError::io("create", &commits, &e))?;
    let name = format!("{:020}.json", checkpoint.get());
    let staging = commits.join(format!(".{name}.tmp"));
    let record = CommitRecord {
        checkpoint,
        sources: sources.to_vec(),
    };
    let bytes = serde_json::to_vec(&record)
        .map_err(|e| EngineError::Invalid(format!("a commit record: {e}")))?;
    let mut file =
        std::fs::File::create(&staging).map_err(|e| EngineError::io("create", &staging, &e))?;
    file.write_all(&bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| EngineError::io("write", &staging, &e))?;
    let target = commits.join(&name);
    std::fs::rename(&staging, &target).map_err(|e| EngineError::io("rename", &staging, &e))?;
    sync_dir(&commits)?;
    let records = commit_records(dir)?;
    let old = records.len().saturating_sub(KEEP_COMMIT_RECORDS);
    for (_, path) in records.into_iter().take(old) {
        remove_if_present(&path)?;
    }
    Ok(())
}

/// The newest checkpoint whose transactions are committed: `restored`, or the newest
/// commit record when newer (a fallback restores an older checkpoint, but what the
/// sinks were told to publish stays published).
fn settled_through(
    restored: Option<CheckpointId>,
    newest: Option<&CommitRecord>,
) -> Option<CheckpointId> {
    restored.max(newest.map(|record| record.checkpoint))
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
        // The next transaction starts with room for as much as this one held (up to
        // 16 MiB): it does not regrow from nothing, copying as it goes, on the task's
        // thread.
        let room = self.open.len().min(16 << 20);
        let contents = std::mem::replace(&mut self.open, Vec::with_capacity(room));
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
    /// transactions up to `restored` — or up to the newest commit record, when newer —
    /// published and later ones rolled back.
    fn recover(&mut self, restored: Option<CheckpointId>) -> Result<(), EngineError> {
        self.open.clear();
        let restored = settled_through(restored, newest_commit_record(&self.dir)?.as_ref());
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
/// pre-committed transactions up to `restored` (or up to the newest commit record,
/// when newer) and rolls back every later one, whichever task wrote them, and
/// removes every interrupted pre-commit's staging file.
pub fn recover_transactions(dir: &Path, restored: CheckpointId) -> Result<(), EngineError> {
    let files = list_pending(dir)?;
    if files.is_empty() {
        return Ok(());
    }
    let restored =
        settled_through(Some(restored), newest_commit_record(dir)?.as_ref()).unwrap_or(restored);
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
    use stillpoint_wire::SourceOffset;

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

    fn positions(offsets: &[u64]) -> Vec<SourcePosition> {
        offsets
            .iter()
            .enumerate()
            .map(|(i, o)| SourcePosition {
                task: TaskId(u32::try_from(i).unwrap() + 1),
                offset: SourceOffset::from_u64(*o),
            })
            .collect()
    }

    /// What the commit records change: a recovering sink publishes what the newest
    /// record covers even when an older checkpoint is restored, `published_after`
    /// counts it and hands out the record's offsets, and only the newest few are kept.
    #[test]
    fn commit_records_settle_what_was_told_to_publish_and_give_its_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let factory = TransactionalFileSink::factory(dir.path());
        pre_committed(dir.path(), 1, 1, "one");
        pre_committed(dir.path(), 1, 2, "two");
        pre_committed(dir.path(), 1, 3, "three");
        factory
            .record_commit(CheckpointId(1), &positions(&[10]))
            .unwrap();
        factory
            .record_commit(CheckpointId(2), &positions(&[20]))
            .unwrap();
        let mut sink = TransactionalFileSink::new(dir.path(), TaskId(1));
        sink.commit(CheckpointId(1)).unwrap();
        // Checkpoint 2 is recorded (its commit was told), its transaction not yet
        // published; 3 was never committed. A fallback to 1:
        let published = factory
            .published_after(Some(CheckpointId(1)))
            .unwrap()
            .unwrap();
        assert_eq!(published.checkpoints, [CheckpointId(2)]);
        assert_eq!(published.records, 1);
        assert_eq!(published.covers, Some(positions(&[20])));
        sink.recover(Some(CheckpointId(1))).unwrap();
        assert_eq!(
            read_committed(dir.path()).unwrap(),
            [
                ("one".to_owned(), "1".to_owned()),
                ("two".to_owned(), "1".to_owned())
            ]
        );
        assert!(
            names(&dir.path().join("pending")).is_empty(),
            "3 rolled back"
        );
        // From scratch (a store lost): both published, covered by the newest record.
        let all = factory.published_after(None).unwrap().unwrap();
        assert_eq!(all.checkpoints, [CheckpointId(1), CheckpointId(2)]);
        assert_eq!(all.covers, Some(positions(&[20])));
        // Restored at the newest record: nothing to replay.
        let none = factory
            .published_after(Some(CheckpointId(2)))
            .unwrap()
            .unwrap();
        assert!(
            none.checkpoints.is_empty() && none.covers.is_none(),
            "{none:?}"
        );
        for id in 3..10 {
            factory
                .record_commit(CheckpointId(id), &positions(&[id * 10]))
                .unwrap();
        }
        assert_eq!(
            names(&dir.path().join(COMMITS)),
            (6..10)
                .map(|id| format!("{id:020}.json"))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_damaged_commit_record_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let factory = TransactionalFileSink::factory(dir.path());
        factory
            .record_commit(CheckpointId(4), &positions(&[1, 2]))
            .unwrap();
        let record = dir.path().join(COMMITS).join(format!("{:020}.json", 4));
        for (bytes, why) in [
            (
                b"{\"checkpoint\":5,\"sources\":[]}".to_vec(),
                "it names checkpoint 5",
            ),
            (b"{\"checkpoint\":4".to_vec(), "not a commit record"),
            (
                vec![b' '; usize::try_from(MAX_COMMIT_RECORD_BYTES + 1).unwrap()],
                "longer than",
            ),
        ] {
            std::fs::write(&record, bytes).unwrap();
            let error = factory.published_after(None).unwrap_err().to_string();
            assert!(
                error.contains(why) && error.contains("00000000000000000004.json"),
                "{error}"
            );
            let error = TransactionalFileSink::new(dir.path(), TaskId(1))
                .recover(None)
                .unwrap_err()
                .to_string();
            assert!(error.contains(why), "{error}");
        }
    }
}
