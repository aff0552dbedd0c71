//! `StateError`: everything the state backend can fail with, each naming what failed.

use std::path::PathBuf;

use stillpoint_wire::{KeyGroupRange, ManifestError};

/// A state backend failure.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// RocksDB refused an operation.
    #[error("rocksdb: {context}: {message}")]
    Rocks {
        /// What was being done.
        context: &'static str,
        /// RocksDB's message.
        message: String,
    },
    /// A file system operation failed.
    #[error("{context} {path}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A typed value could not be encoded or decoded.
    #[error("state `{state}`: value codec: {message}")]
    Codec {
        /// The state.
        state: String,
        /// The codec's message.
        message: String,
    },
    /// Another process works in this directory (two nodes with one `--node`, or two
    /// runs of one job file): sharing it would wipe each other's state.
    #[error(
        "work directory {path} is in use by another process{holder}; stop it, or give this one its own work_dir (or --node)"
    )]
    WorkDirInUse {
        /// The directory.
        path: PathBuf,
        /// `" (pid N)"` as the holder recorded it, or empty.
        holder: String,
    },
    /// A snapshot file listed in the manifest is missing.
    #[error("snapshot file {file} is missing from {dir}")]
    MissingFile {
        /// The snapshot directory.
        dir: PathBuf,
        /// The file, relative to it.
        file: String,
    },
    /// A snapshot file has another size than its manifest says.
    #[error("snapshot file {file} is {found} bytes, the manifest says {expected}")]
    SizeMismatch {
        /// The file.
        file: String,
        /// Size in the manifest.
        expected: u64,
        /// Size on disk.
        found: u64,
    },
    /// A snapshot file's SHA-256 differs from its manifest's.
    #[error("snapshot file {file} is corrupt: SHA-256 {found}, the manifest says {expected}")]
    ChecksumMismatch {
        /// The file.
        file: String,
        /// Digest in the manifest.
        expected: String,
        /// Digest of the file.
        found: String,
    },
    /// A file in the snapshot directory that the manifest does not list.
    #[error("snapshot directory holds {file}, which its manifest does not list")]
    UnexpectedFile {
        /// The file.
        file: String,
    },
    /// A changelog segment that does not decode: wrong magic, a length past its end, a
    /// state name that is not UTF-8, or a checksum mismatch.
    #[error("changelog segment {file} is corrupt: {problem}")]
    CorruptSegment {
        /// The segment file.
        file: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// The manifest was written by another backend or for other key groups.
    #[error("snapshot cannot be restored here: {0}")]
    Incompatible(String),
    /// A key-group range that does not fit the stream's maximum parallelism.
    #[error("key groups {range} do not fit a maximum parallelism of {max_parallelism}")]
    KeyGroups {
        /// The range.
        range: KeyGroupRange,
        /// The maximum parallelism.
        max_parallelism: u32,
    },
    /// A key that belongs to a key group this backend does not own.
    #[error("key of key group {group} written to a backend owning {range}")]
    ForeignKeyGroup {
        /// The key's group.
        group: u32,
        /// The groups this backend owns.
        range: KeyGroupRange,
    },
    /// The manifest itself is malformed.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// A snapshot job failed earlier; the state is no longer consistent with its
    /// checkpoints and must be restored.
    #[error("an earlier snapshot export failed: {0}")]
    Poisoned(String),
}

impl StateError {
    pub(crate) fn rocks(context: &'static str) -> impl FnOnce(rocksdb::Error) -> Self {
        move |e| Self::Rocks {
            context,
            message: e.into_string(),
        }
    }

    pub(crate) fn io(
        context: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io {
            context,
            path,
            source,
        }
    }
}
