//! Writes of a `file://` store that are atomic, race-free and durable: an OpenDAL
//! layer over the fs service that replaces its writer.
//!
//! OpenDAL's fs writer checks `if_not_exists` when the writer is created and renames
//! its temporary file over the target at close, so two writers can both "create" the
//! same object (two owners of one lease claim, two commits of one checkpoint), and it
//! never syncs the directories it creates or renames into, so after a power loss a
//! committed checkpoint can vanish while the output it let sinks publish stays. Here
//! every write goes to a fresh staging file under the root's `.tmp/`, is synced, and
//! is then published by one system call:
//!
//! - a conditional create (`if_not_exists`) hard-links the staging file at the target:
//!   `link(2)` fails with `EEXIST` when the name exists, atomically, so of any number
//!   of racing writers — threads or processes — exactly one wins;
//! - any other write renames it over the target (readers see the old or the new
//!   object, never a part).
//!
//! Every directory the write created is synced into its parent, and the target's
//! directory is synced after the new name is in it, before `close` returns: once a
//! write (a task manifest, the commit marker) has returned, it survives a power loss.

use std::io::Write as _;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use opendal::raw::*;
use opendal::{Buffer, Capability, Error, ErrorKind, Metadata, OperationContext, Result};

use crate::forward::forward_to_inner;
use crate::lease::Fence;

/// The layer: writes under `root` are staged in `staging` (on the same file system).
#[derive(Clone, Debug)]
pub(crate) struct DurableFsLayer {
    paths: Arc<Paths>,
    /// Checked right before a write is published: a writer whose lease was lost
    /// while it was inside a write publishes nothing.
    fence: Option<Fence>,
}

#[derive(Debug)]
struct Paths {
    root: PathBuf,
    staging: PathBuf,
    /// Staging file names are unique within the process; the pid and a random
    /// prefix make them unique across processes sharing the store.
    prefix: String,
    next: AtomicU64,
}

impl DurableFsLayer {
    pub(crate) fn new(root: PathBuf, staging: PathBuf, fence: Option<Fence>) -> Self {
        let prefix = format!("{}-{:016x}", std::process::id(), rand::random::<u64>());
        Self {
            paths: Arc::new(Paths {
                root,
                staging,
                prefix,
                next: AtomicU64::new(0),
            }),
            fence,
        }
    }
}

impl Layer for DurableFsLayer {
    fn apply_service(&self, inner: Servicer) -> Servicer {
        Arc::new(DurableFsService {
            inner,
            paths: Arc::clone(&self.paths),
            fence: self.fence.clone(),
        })
    }
}

#[derive(Debug)]
struct DurableFsService {
    inner: Servicer,
    paths: Arc<Paths>,
    fence: Option<Fence>,
}

impl Service for DurableFsService {
    type Reader = oio::Reader;
    type Writer = DurableWriter;
    type Lister = oio::Lister;
    type Deleter = oio::Deleter;
    type Copier = oio::Copier;
    type Composer = oio::Composer;

    forward_to_inner!(
        info, compose, create_dir, stat, read, copy, list, delete, rename, restore, presign,
    );

    fn capability(&self) -> Capability {
        let mut capability = self.inner.capability();
        // The writer below is sequential and does not append.
        capability.write_can_append = false;
        capability.write_can_copy_from = false;
        capability.write_with_if_not_exists = true;
        capability
    }

    fn write(&self, _ctx: &OperationContext, path: &str, args: OpWrite) -> Result<Self::Writer> {
        if args.append() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "the store's file writes do not append",
            ));
        }
        let target = confined(&self.paths.root, path)?;
        let n = self.paths.next.fetch_add(1, Ordering::Relaxed);
        let staged = self
            .paths
            .staging
            .join(format!("{}-{n}.part", self.paths.prefix));
        Ok(DurableWriter {
            root: self.paths.root.clone(),
            target,
            staged,
            if_not_exists: args.if_not_exists(),
            fence: self.fence.clone(),
            stage: Stage::Open(None),
        })
    }
}

/// `root` joined with an object path that must stay inside it.
fn confined(root: &Path, path: &str) -> Result<PathBuf> {
    let relative = Path::new(path.trim_start_matches('/'));
    let inside = relative
        .components()
        .all(|c| matches!(c, Component::Normal(_)));
    if !inside || relative.as_os_str().is_empty() {
        return Err(Error::new(
            ErrorKind::NotFound,
            "an object path must name a file inside the store's root",
        )
        .with_context("path", path));
    }
    Ok(root.join(relative))
}

/// A write staged in a file of its own and published at `close`.
struct DurableWriter {
    root: PathBuf,
    target: PathBuf,
    staged: PathBuf,
    if_not_exists: bool,
    fence: Option<Fence>,
    stage: Stage,
}

/// Where a [`DurableWriter`] is.
enum Stage {
    /// Taking bytes; the staging file is created by the first write.
    Open(Option<std::fs::File>),
    /// Published, this long: a second `close` (a retry) answers the same instead of
    /// publishing an empty file.
    Published(u64),
    /// Failed or aborted: nothing is staged any more.
    Ended,
}

impl DurableWriter {
    fn create_staged(&self) -> Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&self.staged)
            .map_err(|e| io_error(e, "create a staging file", &self.staged))
    }
}

impl oio::Write for DurableWriter {
    async fn write(&mut self, bs: Buffer) -> Result<()> {
        // Writes of a store object are small or already on a blocking-friendly path
        // (the store hands its large files over in parts of a few MiB); a write to
        // the page cache does not block for long.
        if let Stage::Open(None) = self.stage {
            self.stage = Stage::Open(Some(self.create_staged()?));
        }
        let Stage::Open(Some(file)) = &mut self.stage else {
            return Err(Error::new(ErrorKind::Unexpected, "the write was closed"));
        };
        for chunk in bs {
            file.write_all(&chunk)
                .map_err(|e| io_error(e, "write a staging file", &self.staged))?;
        }
        Ok(())
    }

    async fn close(&mut self) -> Result<Metadata> {
        let file = match std::mem::replace(&mut self.stage, Stage::Ended) {
            Stage::Open(Some(file)) => file,
            Stage::Open(None) => self.create_staged()?,
            Stage::Published(length) => {
                self.stage = Stage::Published(length);
                return Ok(opendal::MetadataBuilder::file(length).build());
            }
            Stage::Ended => {
                return Err(Error::new(ErrorKind::Unexpected, "the write was aborted"));
            }
        };
        let (root, staged, target, if_not_exists, fence) = (
            self.root.clone(),
            self.staged.clone(),
            self.target.clone(),
            self.if_not_exists,
            self.fence.clone(),
        );
        let length = tokio::task::spawn_blocking(move || {
            publish(&root, file, &staged, &target, if_not_exists, fence.as_ref())
        })
        .await
        .map_err(|e| {
            Error::new(ErrorKind::Unexpected, "a file write's thread failed").set_source(e)
        })??;
        self.stage = Stage::Published(length);
        Ok(opendal::MetadataBuilder::file(length).build())
    }

    async fn abort(&mut self) -> Result<()> {
        self.stage = Stage::Ended;
        remove_if_present(&self.staged)
    }
}

impl Drop for DurableWriter {
    fn drop(&mut self) {
        if let Stage::Open(file) = &mut self.stage {
            drop(file.take());
            if let Err(error) = remove_if_present(&self.staged) {
                tracing::debug!(%error, "removing an abandoned staging file failed");
            }
        }
    }
}

/// Syncs the staged file, publishes it at `target` and syncs every directory the
/// new name depends on. Returns the object's length.
fn publish(
    root: &Path,
    file: std::fs::File,
    staged: &Path,
    target: &Path,
    if_not_exists: bool,
    fence: Option<&Fence>,
) -> Result<u64> {
    let result = (|| {
        file.sync_all()
            .map_err(|e| io_error(e, "sync a staging file", staged))?;
        let length = file
            .metadata()
            .map_err(|e| io_error(e, "stat a staging file", staged))?
            .len();
        drop(file);
        let parent = target.parent().unwrap_or(root);
        create_dirs_durably(root, parent).map_err(|e| io_error(e, "create directory", parent))?;
        // The last moment to stop: after the syncs, before the name appears.
        if let Some(fence) = fence {
            fence.check().map_err(|lost| {
                Error::new(ErrorKind::PermissionDenied, "the writer's lease is lost")
                    .with_context("reason", lost.to_string())
            })?;
        }
        if if_not_exists {
            match std::fs::hard_link(staged, target) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    return Err(Error::new(
                        ErrorKind::ConditionNotMatch,
                        "the object already exists (if_not_exists)",
                    ));
                }
                Err(e) => return Err(io_error(e, "link", target)),
            }
            remove_if_present(staged)?;
        } else {
            std::fs::rename(staged, target).map_err(|e| io_error(e, "rename", target))?;
        }
        sync_path(parent).map_err(|e| io_error(e, "sync directory", parent))?;
        Ok(length)
    })();
    if result.is_err() {
        // Best effort: a staging file left behind is garbage in `.tmp/`, never an object.
        let _ignored = std::fs::remove_file(staged);
    }
    result
}

/// Creates `dir` and its missing ancestors below `root`, syncing each new directory
/// into its parent so the path survives a power loss.
pub(crate) fn create_dirs_durably(root: &Path, dir: &Path) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut at = dir;
    while at != root && !at.is_dir() {
        missing.push(at.to_owned());
        match at.parent() {
            Some(parent) => at = parent,
            None => break,
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    for created in missing.iter().rev() {
        if let Some(parent) = created.parent() {
            sync_path(parent)?;
        }
    }
    Ok(())
}

/// Syncs a file, or a directory's entries, to disk.
pub(crate) fn sync_path(path: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    tests::synced(path);
    std::fs::File::open(path).and_then(|f| f.sync_all())
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error(e, "remove", path)),
    }
}

fn io_error(error: std::io::Error, what: &'static str, path: &Path) -> Error {
    let kind = match error.kind() {
        std::io::ErrorKind::NotFound => ErrorKind::NotFound,
        std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
        std::io::ErrorKind::AlreadyExists => ErrorKind::AlreadyExists,
        _ => ErrorKind::Unexpected,
    };
    let mut out = Error::new(kind, what).with_context("path", path.display().to_string());
    if matches!(
        error.kind(),
        std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
    ) {
        out = out.set_temporary();
    }
    out.set_source(error)
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    use crate::{Store, StoreOptions};

    static SYNCED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    pub(super) fn synced(dir: &Path) {
        SYNCED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(dir.to_owned());
    }

    fn synced_under(root: &Path) -> Vec<PathBuf> {
        SYNCED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|d| d.starts_with(root))
            .cloned()
            .collect()
    }

    /// A `file://` store at `dir/store`, and a runtime to drive it.
    fn file_store(dir: &Path) -> (PathBuf, Store, tokio::runtime::Runtime) {
        let root = dir.join("store");
        let store = Store::open(
            &format!("file://{}", root.display()),
            StoreOptions::default(),
        )
        .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        (root, store, runtime)
    }

    #[test]
    fn a_write_that_returned_has_synced_every_directory_its_name_depends_on() {
        let dir = tempfile::tempdir().unwrap();
        let (root, store, runtime) = file_store(dir.path());
        let path = "checkpoints/00000000000000000001/tasks/task-1.json";
        runtime
            .block_on(store.put(path, b"manifest".to_vec()))
            .unwrap();
        let synced = synced_under(&root);
        // Each new directory into its parent, and the object's directory after the
        // name was linked or renamed into it.
        for needed in [
            root.clone(),
            root.join("checkpoints"),
            root.join("checkpoints/00000000000000000001"),
            root.join("checkpoints/00000000000000000001/tasks"),
        ] {
            assert!(
                synced.contains(&needed),
                "{} not synced: {synced:?}",
                needed.display()
            );
        }
        assert_eq!(std::fs::read(root.join(path)).unwrap(), b"manifest");
        // Nothing is left staged.
        assert_eq!(std::fs::read_dir(root.join(".tmp")).unwrap().count(), 0);

        // A conditional create of the same name loses, atomically, and leaves the
        // object as it was; a plain write replaces it.
        let created = runtime
            .block_on(store.put_raw(path, b"other".to_vec(), true))
            .unwrap();
        assert!(!created);
        assert_eq!(std::fs::read(root.join(path)).unwrap(), b"manifest");
        runtime
            .block_on(store.put_raw(path, b"replaced".to_vec(), false))
            .unwrap();
        assert_eq!(std::fs::read(root.join(path)).unwrap(), b"replaced");
        assert_eq!(std::fs::read_dir(root.join(".tmp")).unwrap().count(), 0);
    }

    #[test]
    fn a_path_outside_the_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_root, store, runtime) = file_store(dir.path());
        let escaped =
            runtime.block_on(store.raw_operator().write("../escaped.json", b"x".to_vec()));
        assert!(escaped.is_err());
        assert!(!dir.path().join("escaped.json").exists());
    }
}
