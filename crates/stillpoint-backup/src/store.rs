//! The checkpoint store: objects over OpenDAL, encryption, incremental upload of
//! snapshots, the commit, listing, verification and verified download.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use opendal::layers::{LoggingLayer, RetryLayer, TimeoutLayer};
use opendal::{ErrorKind, Operator};
use sha2::{Digest, Sha256};
use stillpoint_wire::{
    CheckpointId, CheckpointManifest, RelativePath, Sha256Digest, SnapshotFile, SnapshotManifest,
    TaskSnapshotRef,
};
use tokio::io::AsyncWriteExt;

use crate::crypto::{Cipher, looks_sealed, sealed_len};
use crate::durable_fs::{DurableFsLayer, create_dirs_durably, sync_path};
use crate::faults::FaultLayer;
use crate::layout;
use crate::lease::{Fence, Lease};
use crate::{Progress, StoreError, StoreOptions, StoreUri, TransferEvent, TransferKind};

/// One job's checkpoint store. Cheap to clone; clones share one connection pool.
///
/// Every method is `async` and needs a Tokio runtime. Callers on plain threads hold a
/// runtime and `block_on` (the engine does).
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<Inner>,
    /// When set, every write and delete first checks that the lease behind it may
    /// still write ([`Store::fenced`]).
    fence: Option<Fence>,
    /// What writes go through: the shared operator, or — for a fenced `file://`
    /// store — one whose writes check the fence again right before they are
    /// published (after the slow part: the staging file's and directories' syncs).
    writes: Operator,
}

#[derive(Debug)]
struct Inner {
    op: Operator,
    uri: StoreUri,
    cipher: Option<Cipher>,
    options: StoreOptions,
    /// Digests this handle has seen stored (uploaded or found): a file marked `shared`
    /// whose digest is here is not even looked up again.
    known: Mutex<HashSet<Sha256Digest>>,
}

/// An object found by a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Listed {
    pub(crate) path: String,
    pub(crate) size: u64,
    pub(crate) modified: Option<SystemTime>,
}

/// What [`Store::upload_snapshot`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UploadedSnapshot {
    /// The reference the global manifest lists for this task.
    pub reference: TaskSnapshotRef,
    /// Files written to the store.
    pub files_uploaded: usize,
    /// Their plaintext bytes.
    pub bytes_uploaded: u64,
    /// Files the store already had.
    pub files_reused: usize,
    /// The task's full state size (all files).
    pub state_bytes: u64,
}

/// What [`Store::download_snapshot`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DownloadReport {
    /// Files fetched from the store.
    pub files_downloaded: usize,
    /// Their bytes.
    pub bytes_downloaded: u64,
    /// Local files whose checksum already matched and were kept.
    pub files_reused: usize,
    /// Local files a restore's journal recorded as finished (synced, then recorded),
    /// kept without hashing them again.
    pub files_trusted: usize,
}

/// A checkpoint found in the store.
#[derive(Clone, Debug)]
pub struct CheckpointListing {
    /// Its id.
    pub id: CheckpointId,
    /// Whether it is committed.
    pub status: ListingStatus,
}

/// The state of a listed checkpoint.
#[derive(Clone, Debug)]
pub enum ListingStatus {
    /// The global manifest is there and verifies: the checkpoint is complete.
    Committed(CheckpointManifest),
    /// A global manifest is there but does not parse or verify.
    Corrupt(StoreError),
    /// Task manifests but no global manifest: in flight, or abandoned.
    Incomplete {
        /// Task manifests present.
        task_manifests: usize,
    },
}

/// How deep [`Store::verify`] looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyDepth {
    /// Every manifest is read and verified; every file exists with the right size.
    Presence,
    /// As `Presence`, and every file is read and its SHA-256 compared.
    Content,
}

/// One thing wrong with a checkpoint.
#[derive(Clone, Debug)]
pub struct Problem {
    /// The object at fault.
    pub object: String,
    /// What it holds for the snapshot (`task-3: 000012.sst`), when it is a file.
    pub file: Option<String>,
    /// What is wrong.
    pub error: StoreError,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.file {
            Some(file) => write!(f, "{file} ({}): {}", self.object, self.error),
            None => write!(f, "{}: {}", self.object, self.error),
        }
    }
}

/// The outcome of [`Store::verify`].
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// The checkpoint.
    pub id: CheckpointId,
    /// Distinct stored files checked.
    pub files_checked: usize,
    /// Their bytes.
    pub bytes_checked: u64,
    /// Everything wrong; empty when the checkpoint is intact.
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    /// Whether nothing is wrong.
    #[must_use]
    pub fn is_intact(&self) -> bool {
        self.problems.is_empty()
    }
}

/// The newest checkpoint that verifies, and the newer ones that did not.
#[derive(Clone, Debug)]
pub struct LatestVerified {
    /// The checkpoint to restore.
    pub manifest: CheckpointManifest,
    /// Newer committed checkpoints that failed verification, newest first.
    pub rejected: Vec<VerifyReport>,
}

/// What [`Store::restorable`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restorable {
    /// The checkpoint to restore; `None` when no committed one qualifies.
    pub checkpoint: Option<CheckpointId>,
    /// Newer committed checkpoints that did not verify, newest first, with the first
    /// problem of each.
    pub rejected: Vec<(CheckpointId, String)>,
    /// How many checkpoints are committed.
    pub committed: usize,
}

impl Store {
    /// Opens the store at `uri` (see [`StoreUri::parse`]).
    pub fn open(uri: &str, options: StoreOptions) -> Result<Self, StoreError> {
        Self::open_uri(StoreUri::parse(uri)?, options)
    }

    /// Opens the store at a parsed URI.
    pub fn open_uri(uri: StoreUri, options: StoreOptions) -> Result<Self, StoreError> {
        options.check()?;
        let op = build_operator(&uri, &options, None)?;
        Ok(Self::with_operator(op, uri, options))
    }

    /// Opens a store on an operator the caller built (any OpenDAL service, configured
    /// any way): the store adds its retry, timeout, logging and fault layers on top.
    /// The service must write objects atomically; without create-if-absent the store
    /// is read-only (see [`Store::can_write`]). A local file system is better opened
    /// as `file://`, which adds durable, crash-atomic writes.
    pub fn from_operator(op: Operator, options: StoreOptions) -> Result<Self, StoreError> {
        options.check()?;
        let info = op.info();
        let uri = StoreUri::Service {
            scheme: info.scheme().to_owned(),
            location: format!("{}://{}{}", info.scheme(), info.name(), info.root()),
            options: BTreeMap::new(),
        };
        let op = with_layers(op, &options);
        Ok(Self::with_operator(op, uri, options))
    }

    fn with_operator(op: Operator, uri: StoreUri, options: StoreOptions) -> Self {
        let cipher = options.encryption.as_ref().map(Cipher::new);
        if let Some(key) = &options.encryption {
            tracing::debug!(store = %uri, key = %key.fingerprint(), "store opened with encryption");
        }
        Self {
            writes: op.clone(),
            inner: Arc::new(Inner {
                op,
                uri,
                cipher,
                options,
                known: Mutex::new(HashSet::new()),
            }),
            fence: None,
        }
    }

    /// Whether the store's service can create an object only if it is absent — what
    /// a lease and every commit need. One that cannot (WebDAV, HDFS) is read-only:
    /// checkpoints can be listed, verified and restored from it, not written to it.
    #[must_use]
    pub fn can_write(&self) -> bool {
        self.writes.info().capability().write_with_if_not_exists
    }

    /// A handle on the same store whose every write and delete first checks `fence`:
    /// once the lease behind it is lost, or too close to expiry for a write to finish
    /// before another writer may take over, nothing more is written through it.
    /// Give it to everything that writes on the lease holder's behalf (the export
    /// threads, the coordinator).
    ///
    /// On `file://` the fence is checked again inside each write, right before the
    /// synced staging file is linked or renamed into place: a writer paused in the
    /// middle of a write (a stopped process) publishes nothing when it resumes after
    /// losing its lease.
    #[must_use]
    pub fn fenced(&self, fence: Fence) -> Self {
        if self.fence.as_ref().is_some_and(|f| f.same(&fence)) {
            return self.clone();
        }
        let writes = match &self.inner.uri {
            StoreUri::File { .. } => {
                match build_operator(&self.inner.uri, &self.inner.options, Some(&fence)) {
                    Ok(op) => op,
                    Err(error) => {
                        // The same URI and options built the shared operator.
                        tracing::warn!(%error, "no fenced writer; the fence is checked before each write only");
                        self.inner.op.clone()
                    }
                }
            }
            _ => self.inner.op.clone(),
        };
        Self {
            inner: Arc::clone(&self.inner),
            fence: Some(fence),
            writes,
        }
    }

    /// The same store without a fence.
    #[must_use]
    pub fn unfenced(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            fence: None,
            writes: self.inner.op.clone(),
        }
    }

    /// The fence's verdict when it is closed, else `error`: a write the fence
    /// stopped half-way says so.
    fn fenced_error(&self, error: StoreError) -> StoreError {
        match self.check_fence() {
            Err(lost) => lost,
            Ok(()) => error,
        }
    }

    fn check_fence(&self) -> Result<(), StoreError> {
        match &self.fence {
            Some(fence) => fence.check(),
            None => Ok(()),
        }
    }

    /// Where the store lives (no credentials).
    #[must_use]
    pub fn uri(&self) -> &StoreUri {
        &self.inner.uri
    }

    /// The raw OpenDAL operator (with the retry, timeout and logging layers), for
    /// tools and tests that need to reach objects directly. Not part of the stable
    /// API: writing through it bypasses encryption, checksums and fencing.
    #[doc(hidden)]
    #[must_use]
    pub fn raw_operator(&self) -> &Operator {
        &self.inner.op
    }

    /// Whether objects are encrypted at rest.
    #[must_use]
    pub fn is_encrypted(&self) -> bool {
        self.inner.cipher.is_some()
    }

    // -----------------------------------------------------------------------------------
    // Objects.

    /// Writes an object (sealed when the store is encrypted), replacing any old one.
    pub(crate) async fn put(&self, path: &str, plain: Vec<u8>) -> Result<(), StoreError> {
        let bytes = self.seal(path, plain)?;
        self.put_raw(path, bytes, false).await.map(|_| ())
    }

    /// Writes an object only if none exists; `Ok(false)` when one did.
    pub(crate) async fn put_new(&self, path: &str, plain: Vec<u8>) -> Result<bool, StoreError> {
        let bytes = self.seal(path, plain)?;
        self.put_raw(path, bytes, true).await
    }

    /// Writes bytes as they are (the lease is never encrypted: anyone must be able to
    /// read who holds it).
    ///
    /// A conditional create (`if_not_exists`) that finds the object holding exactly
    /// `bytes` counts as created: that is its own earlier attempt, applied by the
    /// store while the reply was lost and the request retried. (Every conditionally
    /// created object of the store is unique to its writer — a lease claim carries a
    /// random nonce, a manifest its owner and times — so equal bytes mean "ours".)
    pub(crate) async fn put_raw(
        &self,
        path: &str,
        bytes: Vec<u8>,
        if_not_exists: bool,
    ) -> Result<bool, StoreError> {
        if !if_not_exists {
            self.check_fence()?;
            return match self.writes.write(path, bytes).await {
                Ok(_) => Ok(true),
                Err(e) => Err(self.fenced_error(StoreError::backend("write", path, e))),
            };
        }
        Ok(self.create(path, bytes).await?.is_none())
    }

    /// Refuses a store whose service cannot do what writers need, before anything
    /// else is asked of it (a held lease must not hide that the store is read-only).
    pub(crate) fn require_writable(&self) -> Result<(), StoreError> {
        if self.can_write() {
            return Ok(());
        }
        Err(StoreError::ReadOnly {
            store: self.inner.uri.to_string(),
            reason: "its service cannot create an object only if it is absent, which the lease and every commit need",
        })
    }

    /// Creates an object only if none exists: `None` when created, else the bytes
    /// found (read back once, for the caller to judge).
    async fn create(&self, path: &str, bytes: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        self.require_writable()?;
        self.check_fence()?;
        let bytes = Bytes::from(bytes);
        match self
            .writes
            .write_with(path, bytes.clone())
            .if_not_exists(true)
            .await
        {
            Ok(_) => Ok(None),
            Err(e) if e.kind() == ErrorKind::ConditionNotMatch => match self.get_raw(path).await {
                Ok(found) if found == bytes => {
                    tracing::debug!(path, "a retried create found its own earlier write");
                    Ok(None)
                }
                Ok(found) => Ok(Some(found)),
                // Gone again (deleted): what was there is unknown, and not ours.
                Err(error) if error.is_not_found() => Ok(Some(Vec::new())),
                Err(error) => Err(error),
            },
            Err(e) => Err(self.fenced_error(StoreError::backend("write", path, e))),
        }
    }

    /// Creates an object that is written once; one holding the same plaintext
    /// already is fine, one holding other content is [`StoreError::AlreadyWritten`].
    pub(crate) async fn put_once(&self, path: &str, plain: Vec<u8>) -> Result<(), StoreError> {
        let expected = Sha256Digest::of(&plain);
        let Some(found) = self.create(path, self.seal(path, plain)?).await? else {
            return Ok(());
        };
        // Sealed bytes differ between two writes of the same plaintext (a random
        // nonce): compare what they open to.
        let same = self
            .open_sealed(path, found)
            .is_ok_and(|plain| Sha256Digest::of(&plain) == expected);
        if same {
            Ok(())
        } else {
            Err(StoreError::AlreadyWritten {
                path: path.to_owned(),
            })
        }
    }

    /// Reads an object and opens it when the store is encrypted.
    pub(crate) async fn get(&self, path: &str) -> Result<Vec<u8>, StoreError> {
        let bytes = self.get_raw(path).await?;
        self.open_sealed(path, bytes)
    }

    pub(crate) async fn get_raw(&self, path: &str) -> Result<Vec<u8>, StoreError> {
        self.inner
            .op
            .read(path)
            .await
            .map(|buffer| buffer.to_vec())
            .map_err(|e| StoreError::backend("read", path, e))
    }

    /// Size of an object, `None` when it does not exist.
    pub(crate) async fn size_of(&self, path: &str) -> Result<Option<u64>, StoreError> {
        match self.inner.op.stat(path).await {
            Ok(meta) => Ok(Some(meta.content_length())),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::backend("stat", path, e)),
        }
    }

    /// Every object under `prefix`, recursively, in lexicographic order.
    pub(crate) async fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        let entries = match self.inner.op.list_with(prefix).recursive(true).await {
            Ok(entries) => entries,
            Err(e) if e.kind() == ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(StoreError::backend("list", prefix, e)),
        };
        let mut listed: Vec<Listed> = entries
            .into_iter()
            .filter(|entry| entry.metadata().is_file())
            .map(|entry| Listed {
                path: entry.path().to_owned(),
                size: entry.metadata().content_length(),
                modified: entry.metadata().last_modified().map(SystemTime::from),
            })
            .collect();
        listed.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(listed)
    }

    /// When an object was last written (a stat when the listing did not say).
    pub(crate) async fn modified(&self, object: &Listed) -> Result<Option<SystemTime>, StoreError> {
        if object.modified.is_some() {
            return Ok(object.modified);
        }
        match self.inner.op.stat(&object.path).await {
            Ok(meta) => Ok(meta.last_modified().map(SystemTime::from)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::backend("stat", &object.path, e)),
        }
    }

    /// Deletes objects, `parallelism` at a time; not-found is success. Gives up once
    /// `max_failures` deletes have failed.
    pub(crate) async fn delete_all(
        &self,
        paths: Vec<String>,
        max_failures: usize,
    ) -> Result<usize, StoreError> {
        self.check_fence()?;
        let failures: Mutex<Vec<StoreError>> = Mutex::new(Vec::new());
        let deleted = futures::stream::iter(paths)
            .map(|path| {
                let failures = &failures;
                async move {
                    match self.inner.op.delete(&path).await {
                        Ok(()) => Ok(1usize),
                        Err(e) if e.kind() == ErrorKind::NotFound => Ok(1),
                        Err(e) => {
                            let error = StoreError::backend("delete", &path, e);
                            tracing::warn!(%error, "delete failed");
                            let mut all = failures
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner);
                            all.push(error);
                            if all.len() >= max_failures {
                                Err(())
                            } else {
                                Ok(0)
                            }
                        }
                    }
                }
            })
            .buffer_unordered(self.inner.options.parallelism)
            .try_fold(0usize, |sum, n| async move { Ok(sum + n) })
            .await;
        let failures = failures
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match (deleted, failures.into_iter().next()) {
            (Err(()), Some(first)) => Err(StoreError::TooManyDeleteFailures {
                failed: max_failures,
                first: Box::new(first),
            }),
            (Ok(deleted), _) => Ok(deleted),
            (Err(()), None) => Ok(0),
        }
    }

    fn seal(&self, path: &str, plain: Vec<u8>) -> Result<Vec<u8>, StoreError> {
        match &self.inner.cipher {
            Some(cipher) => cipher.seal(path, &plain),
            None => Ok(plain),
        }
    }

    fn open_sealed(&self, path: &str, bytes: Vec<u8>) -> Result<Vec<u8>, StoreError> {
        match &self.inner.cipher {
            Some(cipher) => cipher.open(path, &bytes),
            None if looks_sealed(&bytes) => Err(StoreError::KeyRequired {
                path: path.to_owned(),
            }),
            None => Ok(bytes),
        }
    }

    fn stored_len(&self, plain_len: u64) -> u64 {
        if self.is_encrypted() {
            sealed_len(plain_len)
        } else {
            plain_len
        }
    }

    // -----------------------------------------------------------------------------------
    // Upload and commit.

    /// Uploads a local snapshot directory: every file of `manifest` the store does not
    /// already hold (incremental), `parallelism` files at a time, large files in parts;
    /// each file's SHA-256 is checked against the manifest while it is read. The task
    /// manifest is written after all its files, and the checkpoint stays invisible
    /// until [`Store::commit`].
    pub async fn upload_snapshot(
        &self,
        dir: &Path,
        manifest: &SnapshotManifest,
        node: stillpoint_wire::NodeId,
        progress: &dyn Progress,
    ) -> Result<UploadedSnapshot, StoreError> {
        let document = manifest.to_bytes().map_err(|source| StoreError::Manifest {
            path: layout::task_manifest(manifest.checkpoint, manifest.task)
                .as_str()
                .to_owned(),
            source,
        })?;
        progress.on_event(&TransferEvent::Started {
            kind: TransferKind::Upload,
            files: manifest.files.len(),
            bytes: manifest.total_bytes(),
        });
        let moved: Vec<bool> = futures::stream::iter(&manifest.files)
            .map(|file| async move {
                let moved = self.upload_file(dir, file).await?;
                progress.on_event(&TransferEvent::File {
                    kind: TransferKind::Upload,
                    path: file.path.as_str(),
                    bytes: file.size,
                    moved,
                });
                Ok::<_, StoreError>(moved)
            })
            .buffer_unordered(self.inner.options.parallelism)
            .try_collect()
            .await?;
        let path = layout::task_manifest(manifest.checkpoint, manifest.task);
        let sha256 = Sha256Digest::of(&document);
        // Created once: a committed checkpoint's task manifests can never be replaced,
        // not even by a paused former owner that resumes with the same checkpoint id.
        self.put_once(path.as_str(), document).await?;
        progress.on_event(&TransferEvent::Finished {
            kind: TransferKind::Upload,
        });
        let files_uploaded = moved.iter().filter(|m| **m).count();
        let bytes_uploaded = manifest
            .files
            .iter()
            .zip(&moved)
            .filter(|(_, m)| **m)
            .map(|(f, _)| f.size)
            .sum();
        tracing::debug!(
            checkpoint = %manifest.checkpoint,
            task = %manifest.task,
            files_uploaded,
            bytes_uploaded,
            "snapshot uploaded"
        );
        Ok(UploadedSnapshot {
            reference: TaskSnapshotRef {
                task: manifest.task,
                node,
                manifest: path,
                sha256,
                state_bytes: manifest.total_bytes(),
            },
            files_uploaded,
            bytes_uploaded,
            files_reused: moved.len() - files_uploaded,
            state_bytes: manifest.total_bytes(),
        })
    }

    fn is_known(&self, digest: &Sha256Digest) -> bool {
        self.inner
            .known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(digest)
    }

    fn remember(&self, digest: Sha256Digest) {
        self.inner
            .known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(digest);
    }

    /// Uploads one file unless stored; `Ok(true)` when bytes moved.
    async fn upload_file(&self, dir: &Path, file: &SnapshotFile) -> Result<bool, StoreError> {
        if file.shared && self.is_known(&file.sha256) {
            return Ok(false);
        }
        let object = layout::shared_object(&file.sha256);
        if self.size_of(&object).await? == Some(self.stored_len(file.size)) {
            self.remember(file.sha256);
            return Ok(false);
        }
        let local = dir.join(file.path.as_str());
        let meta = tokio::fs::metadata(&local)
            .await
            .map_err(|e| StoreError::local("stat", &local, &e))?;
        if meta.len() != file.size {
            return Err(StoreError::LocalMismatch {
                path: local,
                problem: format!("{} bytes, manifest says {}", meta.len(), file.size),
            });
        }
        self.check_fence()?;
        if let Some((root, target)) = self.linkable(&file.path, &object) {
            match link_verified(root, local.clone(), target, file.sha256, self.fence.clone()).await
            {
                Ok(()) => {
                    self.remember(file.sha256);
                    return Ok(true);
                }
                Err(error @ StoreError::LocalMismatch { .. }) => return Err(error),
                // Another file system, or links unsupported: copy instead.
                Err(error) => tracing::debug!(%error, "hard link into the store failed; copying"),
            }
        }
        let part = self.inner.options.part_size;
        if self.is_encrypted() || file.size <= part as u64 {
            let plain = tokio::fs::read(&local)
                .await
                .map_err(|e| StoreError::local("read", &local, &e))?;
            check_local(&local, &plain, file)?;
            self.put(&object, plain).await?;
        } else {
            self.upload_in_parts(&local, &object, file).await?;
        }
        self.remember(file.sha256);
        Ok(true)
    }

    async fn upload_in_parts(
        &self,
        local: &Path,
        object: &str,
        file: &SnapshotFile,
    ) -> Result<(), StoreError> {
        use tokio::io::AsyncReadExt;
        let options = &self.inner.options;
        let mut reader = tokio::fs::File::open(local)
            .await
            .map_err(|e| StoreError::local("open", local, &e))?;
        let mut writer = self
            .writes
            .writer_with(object)
            .chunk(options.part_size)
            .concurrent(options.part_concurrency)
            .await
            .map_err(|e| StoreError::backend("write", object, e))?;
        let mut hasher = Sha256::new();
        let mut left = file.size;
        let result: Result<(), StoreError> = async {
            while left > 0 {
                let want = usize::try_from(left.min(options.part_size as u64))
                    .unwrap_or(options.part_size);
                let mut buf = vec![0u8; want];
                reader
                    .read_exact(&mut buf)
                    .await
                    .map_err(|e| StoreError::local("read", local, &e))?;
                hasher.update(&buf);
                writer
                    .write(Bytes::from(buf))
                    .await
                    .map_err(|e| StoreError::backend("write", object, e))?;
                left -= want as u64;
            }
            let digest = Sha256Digest(hasher.finalize().into());
            if digest != file.sha256 {
                return Err(StoreError::LocalMismatch {
                    path: local.to_owned(),
                    problem: format!("SHA-256 is {digest}, manifest says {}", file.sha256),
                });
            }
            Ok(())
        }
        .await;
        let result = result.and_then(|()| self.check_fence());
        match result {
            Ok(()) => writer
                .close()
                .await
                .map(|_| ())
                .map_err(|e| self.fenced_error(StoreError::backend("write", object, e))),
            Err(error) => {
                // The upload is abandoned; an aborted multipart upload is never visible.
                if let Err(abort) = writer.abort().await {
                    tracing::debug!(%abort, object, "abort of a failed upload failed");
                }
                Err(error)
            }
        }
    }

    /// Commits a checkpoint: checks that every task manifest it lists is stored and
    /// matches its digest, checks that `lease` is still held (fencing: a writer that
    /// lost its lease cannot commit), then writes the global manifest if no manifest
    /// for that id exists. Its presence is the commit.
    pub async fn commit(
        &self,
        manifest: &CheckpointManifest,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let path = layout::commit_object(manifest.checkpoint);
        let document = manifest.to_bytes().map_err(|source| StoreError::Manifest {
            path: path.clone(),
            source,
        })?;
        futures::stream::iter(&manifest.tasks)
            .map(|task| self.task_manifest(task))
            .buffer_unordered(self.inner.options.parallelism)
            .try_for_each(|_| async { Ok(()) })
            .await?;
        lease.check().await?;
        // The commit must land while the lease is certainly ours: its write starts
        // only if it can finish before the lease's write deadline (which ends well
        // before the lease may be taken over), and is given up at that deadline.
        let fence = lease.fence();
        let deadline = fence.time_left();
        let store = self.fenced(fence);
        let created = tokio::time::timeout(deadline, store.put_new(&path, document))
            .await
            .map_err(|_| StoreError::LeaseLost {
                owner: lease.owner(),
                reason: format!(
                    "the commit of {} did not finish within the lease's remaining {} ms",
                    manifest.checkpoint,
                    deadline.as_millis()
                ),
            })??;
        if !created {
            return Err(StoreError::AlreadyCommitted(manifest.checkpoint));
        }
        tracing::info!(checkpoint = %manifest.checkpoint, tasks = manifest.tasks.len(), "checkpoint committed");
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // Reading checkpoints.

    /// Every checkpoint in the store, oldest first: committed, corrupt or incomplete.
    pub async fn checkpoints(&self) -> Result<Vec<CheckpointListing>, StoreError> {
        let mut ids: BTreeMap<CheckpointId, (bool, usize)> = BTreeMap::new();
        for object in self.list(layout::CHECKPOINTS).await? {
            let Some(id) = layout::checkpoint_of(&object.path) else {
                continue;
            };
            let entry = ids.entry(id).or_default();
            if object.path.ends_with(layout::COMMIT_FILE) {
                entry.0 = true;
            } else {
                entry.1 += 1;
            }
        }
        let mut out = Vec::with_capacity(ids.len());
        for (id, (committed, task_manifests)) in ids {
            let status = if committed {
                match self.checkpoint(id).await {
                    Ok(manifest) => ListingStatus::Committed(manifest),
                    Err(error) if error.is_unavailable() => return Err(error),
                    Err(error) => ListingStatus::Corrupt(error),
                }
            } else {
                ListingStatus::Incomplete { task_manifests }
            };
            out.push(CheckpointListing { id, status });
        }
        Ok(out)
    }

    /// Ids of committed checkpoints (the global manifest exists), oldest first, without
    /// reading them.
    pub async fn committed_ids(&self) -> Result<Vec<CheckpointId>, StoreError> {
        Ok(self
            .list(layout::CHECKPOINTS)
            .await?
            .iter()
            .filter(|o| o.path.ends_with(layout::COMMIT_FILE))
            .filter_map(|o| layout::checkpoint_of(&o.path))
            .collect())
    }

    /// The global manifest of a committed checkpoint, verified.
    pub async fn checkpoint(&self, id: CheckpointId) -> Result<CheckpointManifest, StoreError> {
        let path = layout::commit_object(id);
        let bytes = self.get(&path).await.map_err(|e| match e {
            StoreError::NotFound { .. } => StoreError::NoSuchCheckpoint(id),
            other => other,
        })?;
        let manifest =
            CheckpointManifest::parse(&bytes).map_err(|source| StoreError::Manifest {
                path: path.clone(),
                source,
            })?;
        if manifest.checkpoint != id {
            return Err(StoreError::Corrupt {
                path,
                problem: format!("the manifest is for {}", manifest.checkpoint),
            });
        }
        Ok(manifest)
    }

    /// The newest committed checkpoint whose global manifest verifies, if any (no
    /// file is read: use [`Store::latest_verified`] before restoring).
    pub async fn latest(&self) -> Result<Option<CheckpointManifest>, StoreError> {
        for id in self.committed_ids().await?.into_iter().rev() {
            match self.checkpoint(id).await {
                Ok(manifest) => return Ok(Some(manifest)),
                Err(e) if e.is_unavailable() => return Err(e),
                Err(e) => {
                    tracing::warn!(checkpoint = %id, error = %e, "skipping a corrupt checkpoint")
                }
            }
        }
        Ok(None)
    }

    /// A task's snapshot manifest, checked against the digest its reference records.
    pub async fn task_manifest(
        &self,
        reference: &TaskSnapshotRef,
    ) -> Result<SnapshotManifest, StoreError> {
        let path = reference.manifest.as_str();
        let bytes = self.get(path).await?;
        let digest = Sha256Digest::of(&bytes);
        if digest != reference.sha256 {
            return Err(StoreError::Corrupt {
                path: path.to_owned(),
                problem: format!(
                    "SHA-256 is {digest}, the checkpoint manifest says {}",
                    reference.sha256
                ),
            });
        }
        let manifest = SnapshotManifest::parse(&bytes).map_err(|source| StoreError::Manifest {
            path: path.to_owned(),
            source,
        })?;
        if manifest.task != reference.task {
            return Err(StoreError::Corrupt {
                path: path.to_owned(),
                problem: format!(
                    "the manifest is of {}, not {}",
                    manifest.task, reference.task
                ),
            });
        }
        Ok(manifest)
    }

    /// Checks a committed checkpoint: its manifests, and every file's presence and size
    /// (or, at [`VerifyDepth::Content`], its SHA-256). Every problem is reported, each
    /// naming its object; an error is returned only when the store cannot be read.
    pub async fn verify(
        &self,
        id: CheckpointId,
        depth: VerifyDepth,
        progress: &dyn Progress,
    ) -> Result<VerifyReport, StoreError> {
        let mut report = VerifyReport {
            id,
            files_checked: 0,
            bytes_checked: 0,
            problems: Vec::new(),
        };
        let manifest = match self.checkpoint(id).await {
            Ok(manifest) => manifest,
            Err(error) if error.is_unavailable() => return Err(error),
            Err(error) => {
                report.problems.push(Problem {
                    object: layout::commit_object(id),
                    file: None,
                    error,
                });
                return Ok(report);
            }
        };
        // Each stored object once, with the first snapshot file that names it.
        let mut objects: BTreeMap<String, (String, u64, Sha256Digest)> = BTreeMap::new();
        let mut snapshots = Vec::new();
        for task in &manifest.tasks {
            match self.task_manifest(task).await {
                Ok(snapshot) => snapshots.push(snapshot),
                Err(error) if error.is_unavailable() => return Err(error),
                Err(error) => report.problems.push(Problem {
                    object: task.manifest.as_str().to_owned(),
                    file: None,
                    error,
                }),
            }
        }
        for snapshot in &snapshots {
            for file in &snapshot.files {
                objects
                    .entry(layout::shared_object(&file.sha256))
                    .or_insert_with(|| {
                        (
                            format!("{}: {}", snapshot.task, file.path),
                            file.size,
                            file.sha256,
                        )
                    });
            }
        }
        progress.on_event(&TransferEvent::Started {
            kind: TransferKind::Verify,
            files: objects.len(),
            bytes: objects.values().map(|(_, size, _)| size).sum(),
        });
        let results: Vec<(String, String, u64, Result<(), StoreError>)> =
            futures::stream::iter(objects)
                .map(|(object, (file, size, digest))| async move {
                    let outcome = self.check_object(&object, size, &digest, depth).await;
                    progress.on_event(&TransferEvent::File {
                        kind: TransferKind::Verify,
                        path: &object,
                        bytes: size,
                        moved: true,
                    });
                    (object, file, size, outcome)
                })
                .buffer_unordered(self.inner.options.parallelism)
                .collect()
                .await;
        for (object, file, size, outcome) in results {
            report.files_checked += 1;
            report.bytes_checked += size;
            match outcome {
                Ok(()) => {}
                Err(error) if error.is_unavailable() => return Err(error),
                Err(error) => report.problems.push(Problem {
                    object,
                    file: Some(file),
                    error,
                }),
            }
        }
        report.problems.sort_by(|a, b| a.object.cmp(&b.object));
        progress.on_event(&TransferEvent::Finished {
            kind: TransferKind::Verify,
        });
        Ok(report)
    }

    async fn check_object(
        &self,
        object: &str,
        size: u64,
        digest: &Sha256Digest,
        depth: VerifyDepth,
    ) -> Result<(), StoreError> {
        let stored = self
            .size_of(object)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                path: object.to_owned(),
            })?;
        let expected = self.stored_len(size);
        if stored != expected {
            return Err(StoreError::Corrupt {
                path: object.to_owned(),
                problem: format!("{stored} bytes stored, expected {expected}"),
            });
        }
        if depth == VerifyDepth::Content {
            let plain = self.get(object).await?;
            let computed = Sha256Digest::of(&plain);
            if computed != *digest {
                return Err(StoreError::Corrupt {
                    path: object.to_owned(),
                    problem: format!("SHA-256 is {computed}, expected {digest}"),
                });
            }
        }
        Ok(())
    }

    /// Walks back from the newest committed checkpoint to the first one that verifies
    /// at `depth`; the newer ones that did not are returned with their problems.
    pub async fn latest_verified(
        &self,
        depth: VerifyDepth,
    ) -> Result<Option<LatestVerified>, StoreError> {
        let mut rejected = Vec::new();
        for id in self.committed_ids().await?.into_iter().rev() {
            let report = self.verify(id, depth, &()).await?;
            if report.is_intact() {
                let manifest = self.checkpoint(id).await?;
                return Ok(Some(LatestVerified { manifest, rejected }));
            }
            tracing::warn!(
                checkpoint = %id,
                problems = report.problems.len(),
                first = %report.problems.first().map(ToString::to_string).unwrap_or_default(),
                "checkpoint does not verify; falling back to an older one"
            );
            rejected.push(report);
        }
        Ok(None)
    }

    /// What a restart restores: the newest committed checkpoint not in `exclude` that
    /// verifies at `depth`, the newer ones that did not (newest first, each with its
    /// first problem) and how many are committed. A verification the store could not
    /// carry out is an error; any other failure is that checkpoint's problem.
    pub async fn restorable(
        &self,
        exclude: &std::collections::BTreeSet<CheckpointId>,
        depth: VerifyDepth,
    ) -> Result<Restorable, StoreError> {
        let committed = self.committed_ids().await?;
        let mut found = Restorable {
            checkpoint: None,
            rejected: Vec::new(),
            committed: committed.len(),
        };
        for id in committed
            .into_iter()
            .rev()
            .filter(|id| !exclude.contains(id))
        {
            let problem = match self.verify(id, depth, &()).await {
                Ok(report) => match report.problems.first() {
                    None => {
                        found.checkpoint = Some(id);
                        break;
                    }
                    Some(problem) => problem.to_string(),
                },
                Err(error) if error.is_unavailable() => return Err(error),
                Err(error) => error.to_string(),
            };
            tracing::warn!(checkpoint = %id, problem, "checkpoint incomplete; falling back");
            found.rejected.push((id, problem));
        }
        Ok(found)
    }

    // -----------------------------------------------------------------------------------
    // Download.

    /// Downloads a task's snapshot into `dir` (created if missing), `parallelism` files
    /// at a time. Every file is checked against its SHA-256 while it is written to a
    /// `.partial` file, which is renamed into place only when it matches; local files
    /// that already match are kept (local recovery), so an interrupted download resumes
    /// where it stopped.
    pub async fn download_snapshot(
        &self,
        manifest: &SnapshotManifest,
        dir: &Path,
        progress: &dyn Progress,
    ) -> Result<DownloadReport, StoreError> {
        self.download_snapshot_with(manifest, dir, progress, None)
            .await
    }

    /// [`Store::download_snapshot`], recording each finished file in `journal`
    /// (group: task id, item: the file's path).
    pub(crate) async fn download_snapshot_with(
        &self,
        manifest: &SnapshotManifest,
        dir: &Path,
        progress: &dyn Progress,
        journal: Option<(&crate::Journal<u32, String>, &BTreeSet<String>)>,
    ) -> Result<DownloadReport, StoreError> {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| StoreError::local("create directory", dir, &e))?;
        progress.on_event(&TransferEvent::Started {
            kind: TransferKind::Download,
            files: manifest.files.len(),
            bytes: manifest.total_bytes(),
        });
        let mut report = DownloadReport::default();
        let mut done = futures::stream::iter(&manifest.files)
            .map(|file| async move {
                let recorded = journal.is_some_and(|(_, done)| done.contains(file.path.as_str()));
                if recorded && local_has_size(&dir.join(file.path.as_str()), file.size).await? {
                    return Ok::<_, StoreError>((file, Fetched::Trusted));
                }
                let moved = self.download_file(file, dir, journal.is_some()).await?;
                Ok((
                    file,
                    if moved {
                        Fetched::Moved
                    } else {
                        Fetched::Reused
                    },
                ))
            })
            .buffer_unordered(self.inner.options.parallelism);
        while let Some(outcome) = done.next().await {
            let (file, fetched) = outcome?;
            if let Some((journal, _)) = journal
                && fetched != Fetched::Trusted
            {
                journal
                    .append(manifest.task.get(), vec![file.path.as_str().to_owned()])
                    .await?;
            }
            let moved = fetched == Fetched::Moved;
            match fetched {
                Fetched::Moved => {
                    report.files_downloaded += 1;
                    report.bytes_downloaded += file.size;
                }
                Fetched::Reused => report.files_reused += 1,
                Fetched::Trusted => report.files_trusted += 1,
            }
            progress.on_event(&TransferEvent::File {
                kind: TransferKind::Download,
                path: file.path.as_str(),
                bytes: file.size,
                moved,
            });
        }
        progress.on_event(&TransferEvent::Finished {
            kind: TransferKind::Download,
        });
        Ok(report)
    }

    /// Fetches one file into `dir` unless a local copy already hashes right; with
    /// `durable`, the file is synced before it is renamed into place and its directory
    /// after, so that a journal may record it as finished.
    async fn download_file(
        &self,
        file: &SnapshotFile,
        dir: &Path,
        durable: bool,
    ) -> Result<bool, StoreError> {
        let dest = dir.join(file.path.as_str());
        if local_matches(&dest, file).await? {
            if durable {
                sync_local(&dest).await?;
            }
            return Ok(false);
        }
        if let Some(parent) = dest.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| StoreError::local("create directory", parent, &e))?;
        }
        let object = layout::shared_object(&file.sha256);
        let partial = partial_path(&dest);
        let result = match self.local_object(&object) {
            Some(source) => {
                copy_verified(source, object.clone(), file.clone(), partial.clone()).await
            }
            None => self.fetch_into(&object, file, &partial).await,
        };
        let result = match result {
            Ok(()) if durable => sync_local(&partial).await,
            other => other,
        };
        if let Err(error) = result {
            // Best effort: a stale partial file is overwritten by the next attempt.
            let _removed = tokio::fs::remove_file(&partial).await;
            return Err(error);
        }
        tokio::fs::rename(&partial, &dest)
            .await
            .map_err(|e| StoreError::local("rename", &partial, &e))?;
        if durable && let Some(parent) = dest.parent() {
            sync_local(parent).await?;
        }
        Ok(true)
    }

    /// The store's path of `object` when a snapshot file may be hard-linked into the
    /// store instead of copied: a `file://` store without encryption or fault
    /// injection, and a file RocksDB never modifies after writing (and syncing) it —
    /// SST and blob files. Downloads always copy, so a restored database never shares
    /// an inode with the store.
    fn linkable(&self, file: &RelativePath, object: &str) -> Option<(PathBuf, PathBuf)> {
        let immutable = [".sst", ".blob"]
            .iter()
            .any(|suffix| file.file_name().ends_with(suffix));
        let StoreUri::File { root } = &self.inner.uri else {
            return None;
        };
        self.local_object(object)
            .filter(|_| immutable)
            .map(|target| (root.clone(), target))
    }

    /// Where `object` lies on the local file system, when the store is a `file://`
    /// store whose objects are stored as they are (no encryption, no fault injection).
    fn local_object(&self, object: &str) -> Option<PathBuf> {
        let StoreUri::File { root } = &self.inner.uri else {
            return None;
        };
        (self.inner.cipher.is_none() && self.inner.options.faults.is_none())
            .then(|| root.join(object))
    }

    async fn fetch_into(
        &self,
        object: &str,
        file: &SnapshotFile,
        partial: &Path,
    ) -> Result<(), StoreError> {
        let mut out = tokio::fs::File::create(partial)
            .await
            .map_err(|e| StoreError::local("create", partial, &e))?;
        let mut hasher = Sha256::new();
        let mut written = 0u64;
        if self.is_encrypted() || file.size <= self.inner.options.part_size as u64 {
            let plain = self.get(object).await?;
            hasher.update(&plain);
            written = plain.len() as u64;
            out.write_all(&plain)
                .await
                .map_err(|e| StoreError::local("write", partial, &e))?;
        } else {
            let options = &self.inner.options;
            let reader = self
                .inner
                .op
                .reader_with(object)
                .chunk(options.part_size)
                .concurrent(options.part_concurrency)
                .await
                .map_err(|e| StoreError::backend("read", object, e))?;
            let mut stream = reader
                .into_bytes_stream(0..file.size)
                .await
                .map_err(|e| StoreError::backend("read", object, e))?;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| {
                    StoreError::backend(
                        "read",
                        object,
                        opendal::Error::new(ErrorKind::Unexpected, e.to_string()).set_temporary(),
                    )
                })?;
                hasher.update(&chunk);
                written += chunk.len() as u64;
                out.write_all(&chunk)
                    .await
                    .map_err(|e| StoreError::local("write", partial, &e))?;
            }
        }
        if written != file.size {
            return Err(StoreError::Corrupt {
                path: object.to_owned(),
                problem: format!("{written} bytes, manifest says {}", file.size),
            });
        }
        let digest = Sha256Digest(hasher.finalize().into());
        if digest != file.sha256 {
            return Err(StoreError::Corrupt {
                path: object.to_owned(),
                problem: format!("SHA-256 is {digest}, manifest says {}", file.sha256),
            });
        }
        // No fsync: a restored directory is a cache of the store. Every local file is
        // hashed before it is reused, so a file a crash left short or empty is fetched
        // again rather than trusted.
        out.flush()
            .await
            .map_err(|e| StoreError::local("write", partial, &e))?;
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // Statistics and deletion.

    /// Stores a statistics document for a checkpoint (the engine's per-checkpoint
    /// figures). It is written once: statistics of another writer for the same id are
    /// [`StoreError::AlreadyWritten`].
    pub async fn put_stats<T: serde::Serialize>(
        &self,
        id: CheckpointId,
        stats: &T,
    ) -> Result<(), StoreError> {
        let path = layout::stats_object(id);
        let bytes = serde_json::to_vec(stats).map_err(|e| StoreError::Corrupt {
            path: path.clone(),
            problem: format!("statistics could not be encoded: {e}"),
        })?;
        self.put_once(&path, bytes).await
    }

    /// Records that the job ended at committed checkpoint `id`: its bounded input was
    /// consumed and every sink published (`job/finished.json`). A coordinator
    /// restarted after telling its nodes to exit reads it instead of waiting for
    /// nodes that are gone.
    pub async fn mark_finished(&self, id: CheckpointId) -> Result<(), StoreError> {
        self.put(layout::FINISHED, id.get().to_string().into_bytes())
            .await
    }

    /// The checkpoint the job was marked finished at, if it was.
    pub async fn finished(&self) -> Result<Option<CheckpointId>, StoreError> {
        let bytes = match self.get(layout::FINISHED).await {
            Ok(bytes) => bytes,
            Err(error) if error.is_not_found() => return Ok(None),
            Err(error) => return Err(error),
        };
        let text = String::from_utf8_lossy(&bytes);
        text.trim()
            .parse()
            .map(|id| Some(CheckpointId(id)))
            .map_err(|_| StoreError::Corrupt {
                path: layout::FINISHED.to_owned(),
                problem: format!("not a checkpoint id: {:?}", text.trim()),
            })
    }

    /// Every statistics document, oldest checkpoint first; undecodable ones are skipped
    /// with a warning.
    pub async fn stats<T: serde::de::DeserializeOwned>(
        &self,
    ) -> Result<Vec<(CheckpointId, T)>, StoreError> {
        let mut out = Vec::new();
        for id in self.stats_ids().await? {
            let path = layout::stats_object(id);
            let bytes = self.get(&path).await?;
            match serde_json::from_slice(&bytes) {
                Ok(stats) => out.push((id, stats)),
                Err(e) => {
                    tracing::warn!(path, error = %e, "skipping undecodable statistics")
                }
            }
        }
        Ok(out)
    }

    /// The checkpoints that have a statistics document, oldest first.
    pub(crate) async fn stats_ids(&self) -> Result<Vec<CheckpointId>, StoreError> {
        let mut ids: Vec<CheckpointId> = self
            .list(layout::STATS)
            .await?
            .iter()
            .filter_map(|object| {
                object
                    .path
                    .strip_prefix(layout::STATS)
                    .and_then(|name| name.strip_suffix(".json"))
                    .and_then(|digits| digits.parse().ok())
                    .map(CheckpointId)
            })
            .collect();
        ids.sort_unstable();
        Ok(ids)
    }

    /// Deletes a checkpoint's manifests (global manifest first, so it stops being
    /// complete before anything it references goes). Its statistics stay for the
    /// history window ([`crate::gc::Retention::history`]); shared files are left to
    /// [`crate::gc`].
    pub async fn delete_checkpoint(&self, id: CheckpointId) -> Result<(), StoreError> {
        let commit = layout::commit_object(id);
        self.delete_all(vec![commit.clone()], 1).await?;
        let rest: Vec<String> = self
            .list(&layout::checkpoint_dir(id))
            .await?
            .into_iter()
            .map(|o| o.path)
            .filter(|p| *p != commit)
            .collect();
        self.delete_all(rest, 16).await.map(|_| ())
    }
}

fn check_local(local: &Path, plain: &[u8], file: &SnapshotFile) -> Result<(), StoreError> {
    if plain.len() as u64 != file.size {
        return Err(StoreError::LocalMismatch {
            path: local.to_owned(),
            problem: format!("{} bytes, manifest says {}", plain.len(), file.size),
        });
    }
    let digest = Sha256Digest::of(plain);
    if digest != file.sha256 {
        return Err(StoreError::LocalMismatch {
            path: local.to_owned(),
            problem: format!("SHA-256 is {digest}, manifest says {}", file.sha256),
        });
    }
    Ok(())
}

fn partial_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_owned();
    name.push(".partial");
    dest.with_file_name(name)
}

/// How a file of a download came to be in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fetched {
    /// Fetched from the store.
    Moved,
    /// A local copy hashed to its digest.
    Reused,
    /// Recorded as finished by a restore's journal, with its size.
    Trusted,
}

/// Whether `path` is a file of `size` bytes.
async fn local_has_size(path: &Path, size: u64) -> Result<bool, StoreError> {
    match tokio::fs::metadata(path).await {
        Ok(meta) => Ok(meta.is_file() && meta.len() == size),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(StoreError::local("stat", path, &e)),
    }
}

/// Syncs a local file or directory to disk.
async fn sync_local(path: &Path) -> Result<(), StoreError> {
    on_blocking_pool("sync", path, crate::durable_fs::sync_path)
        .await?
        .map_err(|e| StoreError::local("sync", path, &e))
}

/// Whether a local file exists with the manifest's size and SHA-256.
pub(crate) async fn local_matches(path: &Path, file: &SnapshotFile) -> Result<bool, StoreError> {
    if !local_has_size(path, file.size).await? {
        return Ok(false);
    }
    let digest = on_blocking_pool("hash", path, hash_file).await??;
    Ok(digest == file.sha256)
}

/// Runs `work` on `path` on the blocking pool; a job that panicked or was cancelled
/// is a local error of `operation`.
async fn on_blocking_pool<T: Send + 'static>(
    operation: &'static str,
    path: &Path,
    work: impl FnOnce(&Path) -> T + Send + 'static,
) -> Result<T, StoreError> {
    let owned = path.to_owned();
    tokio::task::spawn_blocking(move || work(&owned))
        .await
        .map_err(|e| StoreError::Local {
            operation,
            path: path.to_owned(),
            message: e.to_string(),
            kind: std::io::ErrorKind::Other,
        })
}

/// Copies a `file://` store's object to `partial` with the kernel's copy, then checks
/// the copy's size and SHA-256 (hashing what was written, from the page cache).
async fn copy_verified(
    source: PathBuf,
    object: String,
    file: SnapshotFile,
    partial: PathBuf,
) -> Result<(), StoreError> {
    tokio::task::spawn_blocking(move || {
        let copied = match std::fs::copy(&source, &partial) {
            Ok(copied) => copied,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !source.exists() => {
                return Err(StoreError::NotFound { path: object });
            }
            Err(e) => return Err(StoreError::local("copy", &partial, &e)),
        };
        if copied != file.size {
            return Err(StoreError::Corrupt {
                path: object,
                problem: format!("{copied} bytes, manifest says {}", file.size),
            });
        }
        let digest = hash_file(&partial)?;
        if digest != file.sha256 {
            return Err(StoreError::Corrupt {
                path: object,
                problem: format!("SHA-256 is {digest}, manifest says {}", file.sha256),
            });
        }
        Ok(())
    })
    .await
    .map_err(|e| StoreError::Local {
        operation: "copy",
        path: PathBuf::new(),
        message: e.to_string(),
        kind: std::io::ErrorKind::Other,
    })?
}

/// Checks that `from` hashes to `digest`, hard-links it at `to` (creating `to`'s
/// directory) and syncs that directory, so the new name survives a crash. An existing
/// `to` is kept: the store is content-addressed, so it already holds the same bytes.
async fn link_verified(
    root: PathBuf,
    from: PathBuf,
    to: PathBuf,
    digest: Sha256Digest,
    fence: Option<Fence>,
) -> Result<(), StoreError> {
    tokio::task::spawn_blocking(move || {
        let computed = hash_file(&from)?;
        if computed != digest {
            return Err(StoreError::LocalMismatch {
                path: from,
                problem: format!("SHA-256 is {computed}, manifest says {digest}"),
            });
        }
        let parent = to.parent().unwrap_or_else(|| Path::new("."));
        create_dirs_durably(&root, parent)
            .map_err(|e| StoreError::local("create directory", parent, &e))?;
        // After the hashing: a writer paused in it and fenced since links nothing.
        if let Some(fence) = &fence {
            fence.check()?;
        }
        match std::fs::hard_link(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
            Err(e) => return Err(StoreError::local("link", &to, &e)),
        }
        sync_path(parent).map_err(|e| StoreError::local("sync", parent, &e))
    })
    .await
    .map_err(|e| StoreError::Local {
        operation: "link",
        path: PathBuf::new(),
        message: e.to_string(),
        kind: std::io::ErrorKind::Other,
    })?
}

fn hash_file(path: &Path) -> Result<Sha256Digest, StoreError> {
    let file = std::fs::File::open(path).map_err(|e| StoreError::local("open", path, &e))?;
    Sha256Digest::of_reader(file).map_err(|e| StoreError::local("read", path, &e))
}

fn build_operator(
    uri: &StoreUri,
    options: &StoreOptions,
    fence: Option<&Fence>,
) -> Result<Operator, StoreError> {
    // OpenDAL's configuration errors may quote the configuration: no secret option's
    // value is repeated.
    let config_error = |e: opendal::Error| StoreError::InvalidUri {
        uri: uri.to_string(),
        reason: options
            .service_options
            .iter()
            .filter(|(key, value)| {
                crate::uri::secret_option(&key.to_ascii_lowercase()) && !value.is_empty()
            })
            .fold(e.to_string(), |reason, (_, value)| {
                reason.replace(value.as_str(), "***")
            }),
    };
    let op = match uri {
        StoreUri::File { root } => {
            // Writes are staged in `.tmp/`, synced and published by one link or
            // rename, their directories synced (see `durable_fs`): a crash never leaves
            // a partial object under its final name, a conditional create has one
            // winner, and a write that returned survives a power loss.
            let staging = root.join(".tmp");
            std::fs::create_dir_all(&staging)
                .map_err(|e| StoreError::local("create directory", &staging, &e))?;
            let builder = opendal::services::Fs::default().root(&root.to_string_lossy());
            Operator::new(builder)
                .map_err(config_error)?
                .layer(DurableFsLayer::new(root.clone(), staging, fence.cloned()))
        }
        StoreUri::Memory { name: None } => {
            Operator::new(opendal::services::Memory::default()).map_err(config_error)?
        }
        StoreUri::Memory { name: Some(name) } => shared_memory(name).map_err(config_error)?,
        StoreUri::Service {
            scheme,
            location,
            options: query,
        } => {
            let (location, endpoint) = ssh_destination(scheme, location);
            let config = query
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .chain(options.service_options.iter())
                .chain(endpoint.map(|e| ("endpoint".to_owned(), e)));
            let parsed = opendal::OperatorUri::new(&location, config).map_err(config_error)?;
            Operator::from_uri(parsed).map_err(config_error)?
        }
        #[cfg(not(feature = "s3"))]
        StoreUri::S3 { .. } => {
            return Err(StoreError::InvalidUri {
                uri: uri.to_string(),
                reason: "this build has no s3 service: build with `--features s3`".to_owned(),
            });
        }
        #[cfg(feature = "s3")]
        StoreUri::S3 {
            bucket,
            prefix,
            endpoint,
            region,
        } => {
            let credentials = options
                .s3_credentials
                .clone()
                .or_else(crate::uri::S3Credentials::from_env)
                .ok_or_else(|| StoreError::MissingCredentials {
                    uri: uri.to_string(),
                    hint: "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or pass S3Credentials)",
                })?;
            let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
            let region = region
                .clone()
                .or_else(|| env("AWS_REGION"))
                .or_else(|| env("AWS_DEFAULT_REGION"))
                .unwrap_or_else(|| "us-east-1".to_owned());
            let mut builder = opendal::services::S3::default()
                .bucket(bucket)
                .root(&format!("/{prefix}"))
                .region(&region)
                // Explicit and hermetic: only these credentials, no ~/.aws files, no
                // instance metadata probes.
                .credential_provider_chain(
                    reqsign_core::ProvideCredentialChain::new()
                        .push(RedactedCredentials::new(&credentials)),
                )
                .disable_config_load()
                .disable_ec2_metadata();
            if let Some(endpoint) = endpoint.clone().or_else(|| env("AWS_ENDPOINT_URL")) {
                builder = builder.endpoint(&endpoint);
            }
            Operator::new(builder).map_err(config_error)?
        }
    };
    Ok(with_layers(op, options))
}

/// OpenDAL's SFTP service hands a URI's authority to `ssh` as the host name, which
/// `ssh` cannot parse with a port (`127.0.0.1:2222`); `ssh://HOST:PORT` it can. So an
/// `sftp://HOST[:PORT]/DIR` becomes `sftp:///DIR` with that endpoint; any other
/// location is passed on as it is.
fn ssh_destination(scheme: &str, location: &str) -> (String, Option<String>) {
    let rest = location
        .strip_prefix("sftp://")
        .filter(|_| scheme == "sftp");
    match rest.map(|rest| rest.split_once('/').unwrap_or((rest, ""))) {
        Some((authority, dir)) if !authority.is_empty() => {
            (format!("sftp:///{dir}"), Some(format!("ssh://{authority}")))
        }
        _ => (location.to_owned(), None),
    }
}

/// The layers every store operator gets: fault injection (tests), deadlines,
/// retries of temporary errors, and logging.
fn with_layers(op: Operator, options: &StoreOptions) -> Operator {
    let op = match &options.faults {
        Some(faults) => op.layer(FaultLayer::new(faults)),
        None => op,
    };
    let retry = &options.retry;
    op.layer(
        TimeoutLayer::new()
            .with_timeout(options.timeout)
            .with_io_timeout(options.io_timeout),
    )
    .layer(
        RetryLayer::new()
            .with_jitter()
            .with_max_times(retry.max_retries)
            .with_min_delay(retry.min_delay)
            .with_max_delay(retry.max_delay)
            .with_notify(log_retry),
    )
    .layer(LoggingLayer::new(StoreLog))
}

#[cfg(feature = "s3")]
/// Static S3 credentials for the request signer, with a `Debug` that hides the
/// secret: reqsign logs every credential provider it tries at `debug`, and its own
/// static provider prints the secret key there.
struct RedactedCredentials {
    access_key_id: String,
    inner: reqsign_aws_v4::StaticCredentialProvider,
}

#[cfg(feature = "s3")]
impl RedactedCredentials {
    fn new(credentials: &crate::uri::S3Credentials) -> Self {
        let inner = reqsign_aws_v4::StaticCredentialProvider::new(
            &credentials.access_key_id,
            &credentials.secret_access_key,
        );
        Self {
            access_key_id: credentials.access_key_id.clone(),
            inner: match &credentials.session_token {
                Some(token) => inner.with_session_token(token),
                None => inner,
            },
        }
    }
}

#[cfg(feature = "s3")]
impl std::fmt::Debug for RedactedCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .finish()
    }
}

#[cfg(feature = "s3")]
impl reqsign_core::ProvideCredential for RedactedCredentials {
    type Credential = reqsign_aws_v4::Credential;

    async fn provide_credential(
        &self,
        ctx: &reqsign_core::Context,
    ) -> reqsign_core::Result<Option<Self::Credential>> {
        self.inner.provide_credential(ctx).await
    }
}

/// One line per retried temporary failure (OpenDAL's default prints the error's
/// multi-line debug form, with a backtrace when one was captured).
fn log_retry(event: opendal::layers::RetryEvent<'_>) {
    tracing::warn!(
        operation = %event.op,
        attempt = event.attempt,
        "retrying in {} ms after a temporary failure: {}",
        event.retry_after.as_millis(),
        event.err
    );
}

/// OpenDAL's operation log through `tracing`, at levels a person running a job can
/// live with: a missing object or a lost conditional write is how the store asks
/// "is this already uploaded?" and "did someone else commit?", so those are `debug`,
/// not the default layer's `warn` on every deduplicated file; other failures (each
/// one retried below) are `warn`, unexpected ones `error`. Paths are logged,
/// credentials never are: the context holds only the operation's path and ranges.
#[derive(Debug, Clone, Copy)]
struct StoreLog;

impl opendal::layers::LoggingInterceptor for StoreLog {
    fn log(
        &self,
        info: &opendal::raw::ServiceInfo,
        operation: opendal::raw::Operation,
        context: &[(&str, &str)],
        message: &str,
        err: Option<&opendal::Error>,
    ) {
        let path = context
            .iter()
            .find(|(key, _)| *key == "path")
            .map_or("", |(_, value)| *value);
        let scheme = info.scheme();
        let Some(error) = err else {
            tracing::trace!(scheme, path, %operation, "{message}");
            return;
        };
        match error.kind() {
            ErrorKind::NotFound | ErrorKind::ConditionNotMatch | ErrorKind::AlreadyExists => {
                tracing::debug!(scheme, path, %operation, %error, "{message}");
            }
            ErrorKind::Unexpected => {
                tracing::error!(scheme, path, %operation, %error, "{message}");
            }
            _ => tracing::warn!(scheme, path, %operation, %error, "{message}"),
        }
    }
}

/// The process-wide memory store called `name` (the bare operator; layers are added
/// per open).
fn shared_memory(name: &str) -> opendal::Result<Operator> {
    static STORES: std::sync::OnceLock<Mutex<BTreeMap<String, Operator>>> =
        std::sync::OnceLock::new();
    let mut stores = STORES
        .get_or_init(|| Mutex::new(BTreeMap::new()))
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(op) = stores.get(name) {
        return Ok(op.clone());
    }
    let op = Operator::new(opendal::services::Memory::default())?;
    stores.insert(name.to_owned(), op.clone());
    Ok(op)
}

/// Relative path helper for callers that build task manifest paths themselves.
#[must_use]
pub fn task_manifest_path(id: CheckpointId, task: stillpoint_wire::TaskId) -> RelativePath {
    layout::task_manifest(id, task)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FaultConfig;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn an_sftp_authority_becomes_an_ssh_destination() {
        let case = |scheme: &str, location: &str| ssh_destination(scheme, location);
        assert_eq!(
            case("sftp", "sftp://127.0.0.1:2222/srv/backups"),
            (
                "sftp:///srv/backups".to_owned(),
                Some("ssh://127.0.0.1:2222".to_owned())
            )
        );
        assert_eq!(
            case("sftp", "sftp://backup-host"),
            ("sftp:///".to_owned(), Some("ssh://backup-host".to_owned()))
        );
        // No authority: the endpoint option (if any) stands.
        assert_eq!(
            case("sftp", "sftp:///srv"),
            ("sftp:///srv".to_owned(), None)
        );
        assert_eq!(
            case("webdav", "webdav:///dav"),
            ("webdav:///dav".to_owned(), None)
        );
    }

    #[test]
    fn deletes_give_up_after_the_failure_bound_and_report_the_first() {
        runtime().block_on(async {
            let options = StoreOptions {
                faults: Some(FaultConfig::new(1.0, 1)),
                retry: crate::RetryPolicy {
                    max_retries: 0,
                    ..crate::RetryPolicy::default()
                },
                ..StoreOptions::default()
            };
            let store = Store::open("memory://", options).unwrap();
            let paths: Vec<String> = (0..20).map(|i| format!("shared/x/{i}")).collect();
            let error = store.delete_all(paths, 3).await.unwrap_err();
            let StoreError::TooManyDeleteFailures { failed, first } = error else {
                panic!("{error}");
            };
            assert_eq!(failed, 3);
            assert!(first.is_unavailable(), "{first}");
        });
    }

    #[test]
    fn deleting_what_does_not_exist_succeeds() {
        runtime().block_on(async {
            let store = Store::open("memory://", StoreOptions::default()).unwrap();
            let deleted = store
                .delete_all(vec!["a".into(), "b/c".into()], 1)
                .await
                .unwrap();
            assert_eq!(deleted, 2);
        });
    }
}
