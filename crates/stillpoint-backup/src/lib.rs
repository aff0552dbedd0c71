//! The checkpoint store of stillpoint, over Apache OpenDAL: incremental
//! content-addressed upload of snapshots, a global manifest written last as the
//! commit, SHA-256 verification, optional AES-256-GCM encryption at rest, a lease
//! with fencing, retention and garbage collection, verified resumable restore, and a
//! progress journal for long jobs.
//!
//! ```
//! use std::sync::Arc;
//! use stillpoint_backup::{Lease, LeaseConfig, Store, StoreOptions, SystemClock, VerifyDepth};
//! use stillpoint_wire::*;
//!
//! # tokio::runtime::Runtime::new()?.block_on(async {
//! let dir = tempfile::tempdir()?;
//! // A local snapshot: one file and its manifest (stillpoint-state writes these).
//! std::fs::write(dir.path().join("000007.sst"), b"sorted strings")?;
//! let snapshot = SnapshotManifest {
//!     stream: StreamId(1), task: TaskId(1), checkpoint: CheckpointId(1),
//!     max_parallelism: 128, key_groups: KeyGroupRange { start: 0, end: 128 },
//!     backend: BackendInfo { kind: "rocksdb".into(), version: "11".into(), options: Default::default() },
//!     files: vec![SnapshotFile {
//!         path: RelativePath::new("000007.sst")?, size: 14,
//!         sha256: Sha256Digest::of(b"sorted strings"), shared: false,
//!     }],
//!     changelog: vec![],
//! };
//!
//! let store = Store::open(&format!("file://{}", dir.path().join("store").display()), StoreOptions::default())?;
//! let lease = Lease::acquire_job(&store, LeaseConfig { settle: std::time::Duration::ZERO, ..LeaseConfig::default() }, Arc::new(SystemClock)).await?;
//! let uploaded = store.upload_snapshot(dir.path(), &snapshot, NodeId(1), &()).await?;
//! store.commit(&CheckpointManifest {
//!     stream: StreamId(1), checkpoint: CheckpointId(1), trans: TransId(1),
//!     kind: CheckpointKind::Checkpoint, created_at_millis: 0, max_parallelism: 128,
//!     tasks: vec![uploaded.reference], sources: vec![], stages: vec![],
//! }, &lease).await?;
//!
//! let latest = store.latest_verified(VerifyDepth::Content).await?.expect("one checkpoint");
//! assert_eq!(latest.manifest.checkpoint, CheckpointId(1));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Every method is `async` on Tokio. The layout of a store is in [`layout`]'s docs
//! and `docs/store-layout.md`; the journal's file format in [`journal`].

mod crypto;
mod durable_fs;
mod error;
mod faults;
mod forward;
pub mod gc;
pub mod journal;
pub mod layout;
mod lease;
mod progress;
mod restore;
mod store;
mod uri;

pub use crypto::{EncryptionKey, KEY_ENV};
pub use error::StoreError;
pub use faults::{FaultConfig, FaultOperations};
pub use gc::{BackgroundGc, GcBackoff, GcPlan, GcReport, Retention};
pub use journal::{Journal, JournalConfig, Resumed};
pub use lease::{
    Clock, Fence, KeptLease, Lease, LeaseConfig, LeaseRecord, ManualClock, SystemClock,
    lease_holder,
};
pub use progress::{Progress, TransferEvent, TransferKind};
pub use restore::{
    LocalRestore, RestoreReport, fetch_for_restart, restore_checkpoint, restore_journal,
    restore_journal_dir,
};
pub use store::{
    CheckpointListing, DownloadReport, LatestVerified, ListingStatus, Problem, Restorable, Store,
    UploadedSnapshot, VerifyDepth, VerifyReport, task_manifest_path,
};
pub use uri::{
    RetryPolicy, S3Credentials, SERVICES, Service, ServiceOptions, StoreOptions, StoreUri,
};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctest;
