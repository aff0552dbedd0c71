//! Progress of long transfers, reported through a callback (the CLI draws bars).

/// What a transfer is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferKind {
    /// Local snapshot → store.
    Upload,
    /// Store → local directory.
    Download,
    /// Reading stored files to check them.
    Verify,
}

/// One step of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferEvent<'a> {
    /// A transfer of `files` files, `bytes` bytes in all, begins.
    Started {
        /// Upload, download or verify.
        kind: TransferKind,
        /// Files in the transfer.
        files: usize,
        /// Their total size.
        bytes: u64,
    },
    /// One file is done.
    File {
        /// Upload, download or verify.
        kind: TransferKind,
        /// Its path (snapshot-relative for uploads and downloads, the object for verify).
        path: &'a str,
        /// Its size.
        bytes: u64,
        /// `false` when nothing had to move: already stored (upload) or a local file
        /// that already matched (download).
        moved: bool,
    },
    /// The transfer is over.
    Finished {
        /// Upload, download or verify.
        kind: TransferKind,
    },
}

/// Receives [`TransferEvent`]s. Implemented for every `Fn(&TransferEvent)`; `&()`
/// ignores them.
pub trait Progress: Send + Sync {
    /// Called once per event, from the transferring task.
    fn on_event(&self, event: &TransferEvent<'_>);
}

impl Progress for () {
    fn on_event(&self, _event: &TransferEvent<'_>) {}
}

impl<F> Progress for F
where
    F: Fn(&TransferEvent<'_>) + Send + Sync,
{
    fn on_event(&self, event: &TransferEvent<'_>) {
        self(event);
    }
}
