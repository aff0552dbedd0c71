//! The store's error type: what went wrong, on which object, and whether retrying helps.

use std::path::PathBuf;
use std::sync::Arc;

use stillpoint_wire::{CheckpointId, ManifestError, Sha256Digest};

/// Everything the checkpoint store can fail with.
///
/// Errors are `Clone` so that a background loop's first failure can be handed to
/// every later caller (the journal does this). [`StoreError::is_temporary`] says
/// whether the same call may succeed when retried.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The store URI could not be understood.
    #[error("invalid store URI {uri:?}: {reason}")]
    InvalidUri {
        /// The URI as given (credentials are never part of it).
        uri: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A store that needs credentials was given none.
    #[error("missing credentials for {uri}: {hint}")]
    MissingCredentials {
        /// The store.
        uri: String,
        /// Where credentials are looked for.
        hint: &'static str,
    },
    /// The store can be read but not written (its service lacks what writers need).
    #[error("store {store} is read-only: {reason}")]
    ReadOnly {
        /// The store.
        store: String,
        /// What its service lacks.
        reason: &'static str,
    },
    /// An option has a value that cannot work.
    #[error("invalid store option {option}: {reason}")]
    InvalidOption {
        /// The option's name.
        option: &'static str,
        /// Why.
        reason: String,
    },
    /// The object store failed an operation.
    #[error("store {operation} of {path:?} failed: {source}")]
    Backend {
        /// `read`, `write`, `stat`, `list` or `delete`.
        operation: &'static str,
        /// The object's path inside the store.
        path: String,
        /// OpenDAL's error (its kind says whether it is temporary).
        #[source]
        source: Arc<opendal::Error>,
    },
    /// An object that must exist does not.
    #[error("{path:?} is missing from the store")]
    NotFound {
        /// The object's path inside the store.
        path: String,
    },
    /// An object exists but its bytes are not what its manifest says.
    #[error("{path:?} is corrupt: {problem}")]
    Corrupt {
        /// The object's path inside the store.
        path: String,
        /// What did not match.
        problem: String,
    },
    /// A manifest stored under `path` did not parse or verify.
    #[error("manifest {path:?} is invalid: {source}")]
    Manifest {
        /// The manifest's path inside the store.
        path: String,
        /// The parser's verdict.
        #[source]
        source: ManifestError,
    },
    /// An encrypted object could not be authenticated: the key is wrong, or the
    /// object was tampered with or moved.
    #[error("{path:?} could not be decrypted: wrong encryption key, or the object was altered")]
    Decrypt {
        /// The object's path inside the store.
        path: String,
    },
    /// An object is encrypted but the store was opened without a key.
    #[error("{path:?} is encrypted, but no encryption key was configured")]
    KeyRequired {
        /// The object's path inside the store.
        path: String,
    },
    /// An object is not encrypted but the store was opened with a key.
    #[error("{path:?} is not encrypted, but the store was opened with an encryption key")]
    NotEncrypted {
        /// The object's path inside the store.
        path: String,
    },
    /// The encryption key given is not 32 bytes of hex.
    #[error("invalid encryption key from {origin}: {reason}")]
    InvalidKey {
        /// Where the key came from (never the key itself).
        origin: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Another writer holds the lease.
    #[error(
        "the store is leased to {holder} (owner {owner}) until {expires_at}; wait for it to expire or stop that process"
    )]
    LeaseHeld {
        /// Who holds it, as that writer described itself (host and process).
        holder: String,
        /// Its owner id.
        owner: u64,
        /// Expiry, RFC 3339 UTC.
        expires_at: String,
    },
    /// This writer's lease was taken over, or expired: it must stop writing.
    #[error("lease of owner {owner} was lost: {reason}")]
    LeaseLost {
        /// Our owner id.
        owner: u64,
        /// What was found instead.
        reason: String,
    },
    /// An object that is written once (a task manifest, a checkpoint's statistics)
    /// already exists with other content: another writer got there first.
    #[error("{path:?} was already written by another writer")]
    AlreadyWritten {
        /// The object's path inside the store.
        path: String,
    },
    /// A restore's target directory holds files that are not an interrupted restore
    /// of the same checkpoint.
    #[error(
        "restore target {path} is not empty; restore into an empty directory, or overwrite it on purpose (--force)"
    )]
    TargetNotEmpty {
        /// The directory.
        path: PathBuf,
    },
    /// A checkpoint with this id is already committed.
    #[error("{0} is already committed")]
    AlreadyCommitted(CheckpointId),
    /// No committed checkpoint with this id.
    #[error("{0} is not a committed checkpoint of this store")]
    NoSuchCheckpoint(CheckpointId),
    /// A local file is not what its manifest says (changed after the snapshot).
    #[error("local file {path} does not match its manifest: {problem}")]
    LocalMismatch {
        /// The local file.
        path: PathBuf,
        /// What did not match.
        problem: String,
    },
    /// A local file system operation failed.
    #[error("{operation} {path}: {message}")]
    Local {
        /// What was being done.
        operation: &'static str,
        /// The local path.
        path: PathBuf,
        /// The operating system's message.
        message: String,
        /// The I/O error kind.
        kind: std::io::ErrorKind,
    },
    /// A journal file was rejected.
    #[error("journal file {path:?} is invalid: {problem}")]
    Journal {
        /// The journal file's path inside the store.
        path: String,
        /// Why.
        problem: String,
    },
    /// The journal has finished (or its background loop has stopped).
    #[error("the progress journal {0:?} is closed")]
    JournalClosed(String),
    /// Deleting gave up after too many failures.
    #[error("gave up deleting after {failed} failures (first: {first})")]
    TooManyDeleteFailures {
        /// How many deletes failed.
        failed: usize,
        /// The first failure.
        first: Box<StoreError>,
    },
    /// A file that is referenced has a digest that does not name a stored object.
    #[error("{digest} is referenced by {manifest:?} but not stored")]
    MissingShared {
        /// The task manifest that references it.
        manifest: String,
        /// The file's digest.
        digest: Sha256Digest,
    },
}

impl StoreError {
    /// Whether retrying the same call may succeed (a network hiccup, a throttled
    /// request, a timeout) rather than failing again the same way.
    #[must_use]
    pub fn is_temporary(&self) -> bool {
        match self {
            Self::Backend { source, .. } => source.is_temporary(),
            Self::Local { kind, .. } => matches!(
                kind,
                std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::WouldBlock
            ),
            _ => false,
        }
    }

    /// Whether the store (or the local disk) could not be reached or read, as opposed
    /// to an object that was read and found missing, corrupt or undecryptable.
    ///
    /// Decisions about checkpoints hinge on this: an unavailable store must never make
    /// a checkpoint look corrupt (recovery would fall back to an older one for
    /// nothing), so listing and verification stop and return such errors. Errors
    /// whose retries ran out are unavailable even though no longer temporary.
    #[must_use]
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Backend { .. } | Self::Local { .. })
    }

    /// Whether the error says that an object does not exist.
    #[must_use]
    pub fn is_not_found(&self) -> bool {
        match self {
            Self::NotFound { .. } => true,
            Self::Backend { source, .. } => source.kind() == opendal::ErrorKind::NotFound,
            _ => false,
        }
    }

    pub(crate) fn backend(operation: &'static str, path: &str, source: opendal::Error) -> Self {
        if source.kind() == opendal::ErrorKind::NotFound {
            return Self::NotFound {
                path: path.to_owned(),
            };
        }
        Self::Backend {
            operation,
            path: path.to_owned(),
            source: Arc::new(source),
        }
    }

    pub(crate) fn local(
        operation: &'static str,
        path: impl Into<PathBuf>,
        error: &std::io::Error,
    ) -> Self {
        Self::Local {
            operation,
            path: path.into(),
            message: error.to_string(),
            kind: error.kind(),
        }
    }
}
