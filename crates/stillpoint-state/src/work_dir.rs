//! A task process's local working directory: held by one process at a time, its
//! live databases and snapshots started empty each run, its restore downloads kept.

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use stillpoint_wire::{CheckpointId, TaskId};

use crate::StateError;

/// A process's exclusive hold on a work directory, released when dropped (or when
/// the process dies: the kernel drops the lock with the file).
#[derive(Debug)]
pub struct WorkDir {
    path: PathBuf,
    _lock: std::fs::File,
}

impl WorkDir {
    /// Locks `path` (creating it) for this process: a second process — or a second
    /// holder in this one — asking for the same directory is refused with
    /// [`StateError::WorkDirInUse`] (naming the holder's pid) while the first holds
    /// it, instead of wiping its live databases.
    pub fn lock(path: &Path) -> Result<Self, StateError> {
        std::fs::create_dir_all(path).map_err(StateError::io("create", path))?;
        let lock_path = path.join(".lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(StateError::io("open", &lock_path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut recorded = String::new();
                // Best effort: the pid is only there to name the holder.
                let _read = file.read_to_string(&mut recorded);
                let holder = recorded
                    .trim()
                    .parse::<u32>()
                    .map_or_else(|_| String::new(), |pid| format!(" (pid {pid})"));
                return Err(StateError::WorkDirInUse {
                    path: path.to_owned(),
                    holder,
                });
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(StateError::io("lock", &lock_path)(e));
            }
        }
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| write!(file, "{}", std::process::id()))
            .map_err(StateError::io("write", &lock_path))?;
        Ok(Self {
            path: path.to_owned(),
            _lock: file,
        })
    }

    /// The directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Empties the live databases and snapshots for a new run; restore downloads are
    /// kept, so files that still verify are not fetched again.
    pub fn clear_live(&self) -> Result<(), StateError> {
        for dir in ["db", "snapshots"] {
            let path = self.path.join(dir);
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(StateError::io("clear", &path)(e)),
            }
        }
        Ok(())
    }
}

/// A task's local snapshots in a work directory: `snapshots/task-<task>/ckpt-<id>`
/// (the id in 20 digits, so names sort as ids), one RocksDB checkpoint each, kept
/// until a newer checkpoint completes.
#[derive(Clone, Debug)]
pub struct SnapshotDirs {
    root: PathBuf,
}

impl SnapshotDirs {
    /// Task `task`'s snapshots under `work_dir`.
    #[must_use]
    pub fn of_task(work_dir: &Path, task: TaskId) -> Self {
        Self {
            root: work_dir
                .join("snapshots")
                .join(format!("task-{}", task.get())),
        }
    }

    /// Where the snapshot of `checkpoint` goes.
    #[must_use]
    pub fn dir(&self, checkpoint: CheckpointId) -> PathBuf {
        self.root.join(format!("ckpt-{:020}", checkpoint.get()))
    }

    /// Removes the snapshot of `checkpoint` (aborted), if there; best effort.
    pub fn discard(&self, checkpoint: CheckpointId) {
        let dir = self.dir(checkpoint);
        if let Err(error) = std::fs::remove_dir_all(&dir)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::debug!(%error, dir = %dir.display(), "discarding a snapshot");
        }
    }

    /// Removes every snapshot older than `checkpoint` (completed: the store holds
    /// what a restore needs); best effort.
    pub fn drop_before(&self, checkpoint: CheckpointId) {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return;
        };
        let keep = self.dir(checkpoint);
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            if entry.file_name().to_string_lossy().starts_with("ckpt-") && path < keep {
                let _removed = std::fs::remove_dir_all(path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_dirs_sort_by_checkpoint_and_older_ones_go() {
        let dir = tempfile::tempdir().unwrap();
        let snapshots = SnapshotDirs::of_task(dir.path(), TaskId(3));
        // 9 and 10 would sort the wrong way round without the padding.
        for id in [2, 9, 10, 11] {
            std::fs::create_dir_all(snapshots.dir(CheckpointId(id))).unwrap();
        }
        std::fs::write(snapshots.root.join("keep-me"), b"").unwrap();
        assert!(snapshots.dir(CheckpointId(9)) < snapshots.dir(CheckpointId(10)));
        snapshots.drop_before(CheckpointId(10));
        snapshots.discard(CheckpointId(11));
        snapshots.discard(CheckpointId(12)); // absent: nothing to do
        let mut left: Vec<String> = std::fs::read_dir(&snapshots.root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, [format!("ckpt-{:020}", 10), "keep-me".to_owned()]);
        assert!(snapshots.root.ends_with("snapshots/task-3"));
    }

    #[test]
    fn a_work_directory_is_held_by_one_process_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("node-1");
        let held = WorkDir::lock(&work).unwrap();
        // A second holder — another process, or another run in this one — is refused
        // naming the first one's pid, and the directory is left as it was.
        std::fs::create_dir_all(work.join("db")).unwrap();
        let refused = WorkDir::lock(&work).unwrap_err();
        let message = refused.to_string();
        assert!(
            matches!(&refused, StateError::WorkDirInUse { path, .. } if *path == work),
            "{message}"
        );
        assert!(
            message.contains(&format!("pid {}", std::process::id())),
            "{message}"
        );
        assert!(work.join("db").is_dir());
        drop(held);
        let _again = WorkDir::lock(&work).unwrap();
    }
}
