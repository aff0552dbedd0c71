//! RocksDB keyed state for stillpoint tasks: key groups, a write-back cache whose
//! barrier stall is an O(1) swap, incremental snapshot export as RocksDB checkpoints
//! with a [`stillpoint_wire::SnapshotManifest`], verified restore, and rescale.
//!
//! ```
//! use stillpoint_state::{CachedState, KeyGroups, RocksStateBackend, StateConfig, StateOwner, ValueState};
//! use stillpoint_wire::{CheckpointId, StreamId, TaskId};
//!
//! let dir = tempfile::tempdir()?;
//! let groups = KeyGroups::new(128)?;
//! let owner = StateOwner { stream: StreamId(1), task: TaskId(1) };
//! let backend = RocksStateBackend::open(dir.path().join("db"), StateConfig::default(), groups, groups.all(), owner)?;
//! let mut state = CachedState::new(backend);
//! let counts: ValueState<String, u64> = ValueState::new("counts");
//!
//! counts.put(&mut state, &"word".to_owned(), &1)?;
//! // The barrier: freeze in O(1); the task goes on while the job exports.
//! let job = state.snapshot(CheckpointId(1), dir.path().join("ckpt-1"));
//! counts.put(&mut state, &"word".to_owned(), &2)?;
//! let exported = job.run()?; // on another thread in the engine
//! assert_eq!(counts.get(&state, &"word".to_owned())?, Some(2));
//! assert!(exported.manifest.files.iter().any(|f| f.path.as_str().ends_with(".sst")));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The storage trait, [`KeyedState`], has no RocksDB types; [`RocksStateBackend`] is
//! RocksDB, [`CachedState`] the write-back cache over it. The write-ahead log is off:
//! checkpoints are the durability boundary (see [`StateConfig`]).

mod cache;
mod changelog;
mod config;
mod error;
mod keygroup;
mod rocks;
mod snapshot;
mod threads;
mod timers;
mod typed;
mod work_dir;

pub use cache::{CachedState, ExportedSnapshot, SnapshotJob};
pub use changelog::ChangelogConfig;
pub use config::{Compression, StateConfig};
pub use error::StateError;
pub use keygroup::{KeyGroupRouter, KeyGroups, MAX_KEY_GROUPS, Partitioner};
pub use rocks::{
    FieldValues, KeyedState, RocksStateBackend, ScanVisitor, StateBatch, StateOwner, StateWrite,
};
pub use snapshot::{DigestCheck, LOCAL_MANIFEST, verify_snapshot};
pub use timers::{TIMER_STATE, TimeDomain, Timer, processing_time};
pub use typed::{MapState, ValueState};
pub use work_dir::{SnapshotDirs, WorkDir};

/// The crate README's example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctest;
