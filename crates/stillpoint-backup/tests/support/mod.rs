//! Shared helpers of the store's integration tests: local snapshot fixtures, commits,
//! and a real S3-compatible server (SeaweedFS) for the S3 tests.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::cast_possible_truncation,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

pub mod s3;
pub mod sftp;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use stillpoint_backup::{Lease, LeaseConfig, ManualClock, Store, StoreOptions, UploadedSnapshot};
use stillpoint_wire::{
    BackendInfo, CheckpointId, CheckpointKind, CheckpointManifest, KeyGroupRange, NodeId,
    RelativePath, Sha256Digest, SnapshotFile, SnapshotManifest, SourceOffset, SourcePosition,
    StreamId, TaskId, TransId,
};

/// Which store a contract case runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    File,
    Memory,
    S3,
    /// OpenDAL's SFTP service against the server of [`sftp::SftpServer`], whose
    /// client key and data directory are given in [`SFTP`].
    Sftp,
}

/// The running SFTP server's login user, client key and data directory.
pub static SFTP: std::sync::OnceLock<(String, std::path::PathBuf, std::path::PathBuf)> =
    std::sync::OnceLock::new();

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One case's world: a local scratch directory and stores of one backend, each name
/// its own store (re-opening a name reaches the same objects).
pub struct Env {
    pub backend: Backend,
    pub dir: tempfile::TempDir,
    pub namespace: String,
}

impl Env {
    pub fn new(backend: Backend) -> Self {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            backend,
            dir: tempfile::tempdir().unwrap(),
            namespace: format!("case-{}-{n}", std::process::id()),
        }
    }

    /// The scratch directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Opens store `name` with `options`.
    pub fn store(&self, name: &str, options: StoreOptions) -> Store {
        match self.backend {
            Backend::File => file_store(&self.dir.path().join("stores").join(name), options),
            Backend::Memory => {
                Store::open(&format!("memory://{}-{name}", self.namespace), options).unwrap()
            }
            Backend::S3 => {
                let options = StoreOptions {
                    s3_credentials: options.s3_credentials.clone().or(Some(
                        stillpoint_backup::S3Credentials {
                            access_key_id: s3::ACCESS_KEY.into(),
                            secret_access_key: s3::SECRET_KEY.into(),
                            session_token: None,
                        },
                    )),
                    ..options
                };
                Store::open(
                    &format!(
                        "s3://{}/{}/{name}?endpoint={}&region=us-east-1",
                        s3::BUCKET,
                        self.namespace,
                        s3::ENDPOINT
                    ),
                    options,
                )
                .unwrap()
            }
            Backend::Sftp => {
                let (user, key, data) = SFTP.get().expect("the SFTP server runs");
                let options = StoreOptions {
                    service_options: options
                        .service_options
                        .clone()
                        .with("user", user)
                        .with("key", key.to_string_lossy())
                        .with("known_hosts_strategy", "accept"),
                    ..options
                };
                let root = data.join(&self.namespace).join(name);
                Store::open(
                    &format!("sftp://127.0.0.1:{}{}", sftp::PORT, root.display()),
                    options,
                )
                .unwrap()
            }
        }
    }
}

/// Every object path of a store under `prefix`, bypassing the store's API.
pub async fn raw_list(store: &Store, prefix: &str) -> Vec<String> {
    let mut paths: Vec<String> = store
        .raw_operator()
        .list_with(prefix)
        .recursive(true)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.metadata().is_file())
        .map(|e| e.path().to_owned())
        .filter(|p| !p.starts_with(".tmp/"))
        .collect();
    paths.sort();
    paths
}

/// An object's stored bytes, bypassing decryption and checks.
pub async fn raw_read(store: &Store, path: &str) -> Vec<u8> {
    store.raw_operator().read(path).await.unwrap().to_vec()
}

/// Overwrites an object's stored bytes.
pub async fn raw_write(store: &Store, path: &str, bytes: Vec<u8>) {
    store.raw_operator().write(path, bytes).await.unwrap();
}

/// Deletes an object.
pub async fn raw_delete(store: &Store, path: &str) {
    store.raw_operator().delete(path).await.unwrap();
}

/// A tokio runtime for one test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Deterministic pseudo-random bytes (xorshift), so file contents differ per seed.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Writes `files` into `dir` and returns their snapshot manifest; a file is `shared`
/// when `previous` lists the same path with the same digest (as RocksDB's immutable
/// SSTs are).
pub fn snapshot(
    dir: &Path,
    task: TaskId,
    checkpoint: CheckpointId,
    files: &[(&str, Vec<u8>)],
    previous: Option<&SnapshotManifest>,
) -> SnapshotManifest {
    std::fs::create_dir_all(dir).unwrap();
    let files = files
        .iter()
        .map(|(name, content)| {
            let path = dir.join(name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).unwrap();
            }
            std::fs::write(&path, content).unwrap();
            let sha256 = Sha256Digest::of(content);
            let shared = previous.is_some_and(|p| {
                p.files
                    .iter()
                    .any(|f| f.path.as_str() == *name && f.sha256 == sha256)
            });
            SnapshotFile {
                path: RelativePath::new(*name).unwrap(),
                size: content.len() as u64,
                sha256,
                shared,
            }
        })
        .collect();
    SnapshotManifest {
        stream: StreamId(1),
        task,
        checkpoint,
        max_parallelism: 128,
        key_groups: KeyGroupRange { start: 0, end: 128 },
        backend: BackendInfo {
            kind: "test".into(),
            version: "1".into(),
            options: Default::default(),
        },
        files,
        changelog: Vec::new(),
    }
}

/// The global manifest of `id` listing `uploaded`, every task a source at offset `id`.
pub fn checkpoint_manifest(
    id: CheckpointId,
    kind: CheckpointKind,
    uploaded: &[UploadedSnapshot],
) -> CheckpointManifest {
    CheckpointManifest {
        stream: StreamId(1),
        checkpoint: id,
        trans: TransId(1),
        kind,
        created_at_millis: 1_700_000_000_000 + id.get(),
        max_parallelism: 128,
        tasks: uploaded.iter().map(|u| u.reference.clone()).collect(),
        sources: uploaded
            .iter()
            .map(|u| SourcePosition {
                task: u.reference.task,
                offset: SourceOffset::from_u64(id.get() * 100),
            })
            .collect(),
        stages: Vec::new(),
    }
}

/// A lease config with no settle wait, for tests.
pub fn quick_lease(holder: &str) -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(60),
        settle: Duration::ZERO,
        holder: holder.to_owned(),
        reclaim_own: false,
        reclaim_dead_local: true,
    }
}

/// Takes the job lease on a manual clock.
pub async fn job_lease(store: &Store, holder: &str, clock: &Arc<ManualClock>) -> Lease {
    Lease::acquire_job(store, quick_lease(holder), Arc::clone(clock) as _)
        .await
        .unwrap()
}

/// Uploads one task's snapshot of `files` and commits checkpoint `id` with it.
pub async fn checkpoint_with(
    store: &Store,
    lease: &Lease,
    dir: &Path,
    id: CheckpointId,
    kind: CheckpointKind,
    files: &[(&str, Vec<u8>)],
    previous: Option<&SnapshotManifest>,
) -> (SnapshotManifest, UploadedSnapshot) {
    let local = dir.join(format!("local-{}", id.get()));
    let manifest = snapshot(&local, TaskId(1), id, files, previous);
    let uploaded = store
        .upload_snapshot(&local, &manifest, NodeId(1), &())
        .await
        .unwrap();
    store
        .commit(
            &checkpoint_manifest(id, kind, std::slice::from_ref(&uploaded)),
            lease,
        )
        .await
        .unwrap();
    (manifest, uploaded)
}

/// A `file://` store in `dir`.
pub fn file_store(dir: &Path, options: StoreOptions) -> Store {
    Store::open(&format!("file://{}", dir.display()), options).unwrap()
}

/// Every regular file under `dir`, recursively.
pub fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}
