//! The progress journal of a long job (the BR seed's checkpoint runner, generalized):
//! appended records are flushed on an interval to checksummed (optionally encrypted)
//! files in the store, per-group summaries on a second interval; a rerun resumes from
//! what the files hold.
//!
//! File format (all integers big-endian), specified so other tools can read it:
//!
//! ```text
//! 0   4  magic "SPJR"
//! 4   2  format version (1)
//! 6   1  kind: 1 = records, 2 = summaries
//! 7   1  flags (0; others are rejected)
//! 8   8  elapsed milliseconds of the job, accumulated across runs, at the flush
//! 16  4  body length N (at most MAX_JOURNAL_BODY)
//! 20 32  SHA-256 of bytes 0..20 followed by the body (so the header is covered too)
//! 52  N  body: JSON, records [[group, [item, …]], …] or summaries [[group, summary], …]
//! ```
//!
//! With encryption on, the whole file is sealed by the store like every object.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use stillpoint_wire::{RelativePath, Sha256Digest};
use tokio::sync::{mpsc, oneshot};

use crate::lease::{Clock, Lease, LeaseConfig};
use crate::{Store, StoreError, layout};

const MAGIC: &[u8; 4] = b"SPJR";
const VERSION: u16 = 1;
const HEADER_LEN: usize = 52;
/// The largest journal file body accepted, in bytes.
pub const MAX_JOURNAL_BODY: usize = 64 * 1024 * 1024;

/// What a journal file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalFileKind {
    /// Appended records.
    Records,
    /// Per-group summaries (checksums, counts).
    Summaries,
}

/// A parsed journal file: its header checked, its body verified against its digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalFile<'a> {
    /// Records or summaries.
    pub kind: JournalFileKind,
    /// Elapsed job time recorded at the flush.
    pub elapsed: Duration,
    /// The verified JSON body.
    pub body: &'a [u8],
}

/// Why bytes are not a journal file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JournalFileError {
    /// Fewer bytes than the header, or than the header says.
    #[error("truncated: {len} bytes, need {need}")]
    Truncated {
        /// Bytes present.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Not a journal file.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A format this build does not read.
    #[error("unsupported version {0}")]
    UnsupportedVersion(u16),
    /// An unknown kind byte.
    #[error("unknown kind {0}")]
    UnknownKind(u8),
    /// Flags this build does not understand.
    #[error("unsupported flags {0:#04x}")]
    UnsupportedFlags(u8),
    /// A body over [`MAX_JOURNAL_BODY`].
    #[error("body of {len} bytes is over the maximum of {max}")]
    TooLarge {
        /// The claimed length.
        len: u64,
        /// [`MAX_JOURNAL_BODY`].
        max: usize,
    },
    /// Bytes after the body.
    #[error("{0} trailing bytes after the body")]
    TrailingBytes(usize),
    /// The header and body do not hash to the header's digest.
    #[error("checksum mismatch: header says {expected}, body hashes to {computed}")]
    ChecksumMismatch {
        /// The header's digest.
        expected: Sha256Digest,
        /// The body's digest.
        computed: Sha256Digest,
    },
}

impl<'a> JournalFile<'a> {
    /// Parses and verifies a journal file. Never panics, never allocates.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, JournalFileError> {
        let header = bytes.get(..HEADER_LEN).ok_or(JournalFileError::Truncated {
            len: bytes.len(),
            need: HEADER_LEN,
        })?;
        let field = |start: usize, end: usize| header.get(start..end).unwrap_or_default();
        let magic: [u8; 4] = field(0, 4).try_into().unwrap_or_default();
        if &magic != MAGIC {
            return Err(JournalFileError::BadMagic(magic));
        }
        let version = u16::from_be_bytes(field(4, 6).try_into().unwrap_or_default());
        if version != VERSION {
            return Err(JournalFileError::UnsupportedVersion(version));
        }
        let kind = match header.get(6).copied().unwrap_or(0) {
            1 => JournalFileKind::Records,
            2 => JournalFileKind::Summaries,
            other => return Err(JournalFileError::UnknownKind(other)),
        };
        let flags = header.get(7).copied().unwrap_or(0);
        if flags != 0 {
            return Err(JournalFileError::UnsupportedFlags(flags));
        }
        let elapsed = u64::from_be_bytes(field(8, 16).try_into().unwrap_or_default());
        let body_len = u32::from_be_bytes(field(16, 20).try_into().unwrap_or_default());
        let body_len = usize::try_from(body_len).unwrap_or(usize::MAX);
        if body_len > MAX_JOURNAL_BODY {
            return Err(JournalFileError::TooLarge {
                len: body_len as u64,
                max: MAX_JOURNAL_BODY,
            });
        }
        let expected = Sha256Digest(field(20, 52).try_into().unwrap_or_default());
        let rest = bytes.get(HEADER_LEN..).unwrap_or_default();
        let body = rest.get(..body_len).ok_or(JournalFileError::Truncated {
            len: bytes.len(),
            need: HEADER_LEN + body_len,
        })?;
        if rest.len() > body_len {
            return Err(JournalFileError::TrailingBytes(rest.len() - body_len));
        }
        let computed = digest_of(field(0, 20), body);
        if computed != expected {
            return Err(JournalFileError::ChecksumMismatch { expected, computed });
        }
        Ok(Self {
            kind,
            elapsed: Duration::from_millis(elapsed),
            body,
        })
    }

    /// The file's bytes.
    #[must_use]
    pub fn encode(kind: JournalFileKind, elapsed: Duration, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_be_bytes());
        out.push(match kind {
            JournalFileKind::Records => 1,
            JournalFileKind::Summaries => 2,
        });
        out.push(0);
        let millis = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        out.extend_from_slice(&millis.to_be_bytes());
        // Bodies are bounded by MAX_JOURNAL_BODY before they get here.
        out.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes());
        let digest = digest_of(&out, body);
        out.extend_from_slice(&digest.0);
        out.extend_from_slice(body);
        out
    }
}

fn digest_of(header: &[u8], body: &[u8]) -> Sha256Digest {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(header);
    hasher.update(body);
    Sha256Digest(hasher.finalize().into())
}

/// How a journal flushes.
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// Records are flushed this often (default 30 s, as the seed).
    pub flush_interval: Duration,
    /// Summaries are flushed this often (default 5 s).
    pub summary_interval: Duration,
    /// The journal's own lease (refreshed every third of its TTL).
    pub lease: LeaseConfig,
    /// Appends buffered before `append` waits for the background loop (default 1024).
    pub capacity: usize,
}

impl Default for JournalConfig {
    fn default() -> Self {
        Self {
            flush_interval: Duration::from_secs(30),
            summary_interval: Duration::from_secs(5),
            lease: LeaseConfig::default(),
            capacity: 1024,
        }
    }
}

/// What a journal group key, item or summary must be.
pub trait JournalValue: Serialize + DeserializeOwned + Send + Sync + 'static {}
impl<T: Serialize + DeserializeOwned + Send + Sync + 'static> JournalValue for T {}

/// What [`resume`] found.
#[derive(Clone, Debug)]
pub struct Resumed<K: Ord, V, S> {
    /// Every record, by group, in append order.
    pub records: BTreeMap<K, Vec<V>>,
    /// The latest summary of each group.
    pub summaries: BTreeMap<K, S>,
    /// Job time accumulated over all earlier runs.
    pub elapsed: Duration,
    /// Files skipped because they were corrupt, each with why.
    pub skipped: Vec<(String, String)>,
}

impl<K: Ord, V, S> Default for Resumed<K, V, S> {
    fn default() -> Self {
        Self {
            records: BTreeMap::new(),
            summaries: BTreeMap::new(),
            elapsed: Duration::ZERO,
            skipped: Vec::new(),
        }
    }
}

enum Command<K, V, S> {
    Append(K, Vec<V>),
    Summary(K, S),
    Finish(bool, oneshot::Sender<Result<(), StoreError>>),
}

/// A running journal: append from anywhere, flushed in the background.
///
/// The first error of the background loop (a failed flush, a lost lease) is returned
/// by every later call.
pub struct Journal<K, V, S = ()> {
    name: String,
    commands: mpsc::Sender<Command<K, V, S>>,
    error: Arc<Mutex<Option<StoreError>>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl<K, V, S> std::fmt::Debug for Journal<K, V, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn root(name: &str) -> Result<String, StoreError> {
    let checked = RelativePath::new(name).map_err(|problem| StoreError::InvalidOption {
        option: "journal name",
        reason: problem.to_string(),
    })?;
    Ok(format!("{}{}/", layout::JOURNALS, checked.as_str()))
}

impl<K, V, S> Journal<K, V, S>
where
    K: JournalValue + Ord + Clone,
    V: JournalValue,
    S: JournalValue,
{
    /// Takes the journal's lease and starts its background loop on the current Tokio
    /// runtime. `previous` is the elapsed time [`resume`] returned (zero for a new job).
    pub async fn start(
        store: &Store,
        name: &str,
        config: JournalConfig,
        clock: Arc<dyn Clock>,
        previous: Duration,
    ) -> Result<Self, StoreError> {
        let root = root(name)?;
        for (option, value) in [
            ("journal.flush_interval", config.flush_interval),
            ("journal.summary_interval", config.summary_interval),
        ] {
            if value.is_zero() {
                return Err(StoreError::InvalidOption {
                    option,
                    reason: "must be above zero".to_owned(),
                });
            }
        }
        let lease =
            Lease::acquire(store, &format!("{root}lease/"), config.lease.clone(), clock).await?;
        let (commands, receiver) = mpsc::channel(config.capacity.max(1));
        let error = Arc::new(Mutex::new(None));
        let runner = Runner {
            store: store.clone(),
            root,
            lease: Some(lease),
            records: BTreeMap::new(),
            summaries: Vec::new(),
            sequence: 0,
            started: tokio::time::Instant::now(),
            previous,
        };
        let task = tokio::spawn(runner.run(receiver, config, Arc::clone(&error)));
        Ok(Self {
            name: name.to_owned(),
            commands,
            error,
            task: Some(task),
        })
    }

    fn failure(&self) -> Option<StoreError> {
        self.error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    async fn send(&self, command: Command<K, V, S>) -> Result<(), StoreError> {
        if let Some(error) = self.failure() {
            return Err(error);
        }
        if self.commands.send(command).await.is_err() {
            return Err(self
                .failure()
                .unwrap_or_else(|| StoreError::JournalClosed(self.name.clone())));
        }
        Ok(())
    }

    /// Appends items of a group; they reach the store at the next flush.
    pub async fn append(&self, group: K, items: Vec<V>) -> Result<(), StoreError> {
        self.send(Command::Append(group, items)).await
    }

    /// Records the latest summary of a group (checksum, counts); flushed on the
    /// summary interval.
    pub async fn summarize(&self, group: K, summary: S) -> Result<(), StoreError> {
        self.send(Command::Summary(group, summary)).await
    }

    /// Stops the loop — after flushing what is pending if `flush` — and releases the
    /// lease. Returns the loop's first error, if it had one.
    pub async fn finish(mut self, flush: bool) -> Result<(), StoreError> {
        if let Some(error) = self.failure() {
            return Err(error);
        }
        let (done, outcome) = oneshot::channel();
        let sent = self.commands.send(Command::Finish(flush, done)).await;
        let result = match sent {
            Ok(()) => outcome
                .await
                .unwrap_or_else(|_| Err(StoreError::JournalClosed(self.name.clone()))),
            Err(_) => Err(StoreError::JournalClosed(self.name.clone())),
        };
        if let Some(task) = self.task.take() {
            let _joined = task.await;
        }
        match self.failure() {
            Some(error) => Err(error),
            None => result,
        }
    }
}

impl<K, V, S> Drop for Journal<K, V, S> {
    fn drop(&mut self) {
        // Dropped without `finish`: stop the loop; its lease lapses after its TTL.
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

struct Runner<K, V, S> {
    store: Store,
    root: String,
    lease: Option<Lease>,
    records: BTreeMap<K, Vec<V>>,
    summaries: Vec<(K, S)>,
    sequence: u64,
    started: tokio::time::Instant,
    previous: Duration,
}

impl<K, V, S> Runner<K, V, S>
where
    K: JournalValue + Ord + Clone,
    V: JournalValue,
    S: JournalValue,
{
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command<K, V, S>>,
        config: JournalConfig,
        error: Arc<Mutex<Option<StoreError>>>,
    ) {
        let start = tokio::time::Instant::now();
        let mut flush =
            tokio::time::interval_at(start + config.flush_interval, config.flush_interval);
        let mut summary =
            tokio::time::interval_at(start + config.summary_interval, config.summary_interval);
        let refresh_every = (config.lease.ttl / 3).max(Duration::from_millis(1));
        let mut refresh = tokio::time::interval_at(start + refresh_every, refresh_every);
        for timer in [&mut flush, &mut summary, &mut refresh] {
            timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        let fail = |e: StoreError| {
            tracing::error!(error = %e, "progress journal stopped");
            let mut slot = error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            slot.get_or_insert(e);
        };
        loop {
            let step = tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Append(group, items)) => {
                        self.records.entry(group).or_default().extend(items);
                        Ok(())
                    }
                    Some(Command::Summary(group, value)) => {
                        self.summaries.push((group, value));
                        Ok(())
                    }
                    Some(Command::Finish(do_flush, done)) => {
                        let result = self.finish(do_flush).await;
                        if let Err(e) = &result {
                            fail(e.clone());
                        }
                        let _delivered = done.send(result);
                        return;
                    }
                    // Every handle is gone: stop without flushing.
                    None => return,
                },
                _ = flush.tick() => self.flush_records().await,
                _ = summary.tick() => self.flush_summaries().await,
                _ = refresh.tick() => match &self.lease {
                    Some(lease) => lease.refresh().await,
                    None => Ok(()),
                },
            };
            if let Err(e) = step {
                fail(e);
                return;
            }
        }
    }

    async fn finish(&mut self, flush: bool) -> Result<(), StoreError> {
        if flush {
            self.flush_records().await?;
            self.flush_summaries().await?;
        }
        match self.lease.take() {
            Some(lease) => lease.release().await,
            None => Ok(()),
        }
    }

    fn elapsed(&self) -> Duration {
        self.previous + self.started.elapsed()
    }

    async fn write(&mut self, kind: JournalFileKind, body: Vec<u8>) -> Result<(), StoreError> {
        let (dir, what) = match kind {
            JournalFileKind::Records => ("records", "records"),
            JournalFileKind::Summaries => ("summaries", "summaries"),
        };
        if body.len() > MAX_JOURNAL_BODY {
            return Err(StoreError::Journal {
                path: format!("{}{dir}/", self.root),
                problem: format!("{} bytes of {what} exceed one file's maximum", body.len()),
            });
        }
        if let Some(lease) = &self.lease {
            lease.check().await?;
        }
        let owner = self.lease.as_ref().map_or(0, Lease::owner);
        self.sequence += 1;
        let path = format!("{}{dir}/{owner:020}-{:010}.spj", self.root, self.sequence);
        let file = JournalFile::encode(kind, self.elapsed(), &body);
        self.store.put(&path, file).await
    }

    async fn flush_records(&mut self) -> Result<(), StoreError> {
        if self.records.is_empty() {
            return Ok(());
        }
        let records = std::mem::take(&mut self.records);
        let body = encode_json(&self.root, &records.iter().collect::<Vec<_>>())?;
        self.write(JournalFileKind::Records, body).await
    }

    async fn flush_summaries(&mut self) -> Result<(), StoreError> {
        if self.summaries.is_empty() {
            return Ok(());
        }
        let summaries = std::mem::take(&mut self.summaries);
        let body = encode_json(&self.root, &summaries)?;
        self.write(JournalFileKind::Summaries, body).await
    }
}

fn encode_json<T: Serialize>(root: &str, value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|e| StoreError::Journal {
        path: root.to_owned(),
        problem: format!("records could not be encoded: {e}"),
    })
}

/// Reads a journal back: walks its files in order, verifies each, skips (and
/// reports) corrupt ones, and returns the records, the latest summary per group and
/// the elapsed time accumulated across runs.
///
/// A file that does not decrypt is skipped like a corrupt one — unless no file
/// decrypts at all, which means the key is wrong: that is an error.
pub async fn resume<K, V, S>(store: &Store, name: &str) -> Result<Resumed<K, V, S>, StoreError>
where
    K: JournalValue + Ord,
    V: JournalValue,
    S: JournalValue,
{
    let root = root(name)?;
    let mut resumed = Resumed::default();
    let mut opened = 0usize;
    let mut first_decrypt_error = None;
    for dir in ["records/", "summaries/"] {
        for object in store.list(&format!("{root}{dir}")).await? {
            if !object.path.ends_with(".spj") {
                continue;
            }
            let bytes = match store.get(&object.path).await {
                Ok(bytes) => bytes,
                Err(e @ (StoreError::Decrypt { .. } | StoreError::KeyRequired { .. })) => {
                    resumed.skipped.push((object.path.clone(), e.to_string()));
                    first_decrypt_error.get_or_insert(e);
                    continue;
                }
                Err(e) => return Err(e),
            };
            opened += 1;
            let skip = |resumed: &mut Resumed<K, V, S>, problem: String| {
                tracing::warn!(
                    path = object.path,
                    problem,
                    "skipping a corrupt journal file"
                );
                resumed.skipped.push((object.path.clone(), problem));
            };
            let file = match JournalFile::parse(&bytes) {
                Ok(file) => file,
                Err(e) => {
                    skip(&mut resumed, e.to_string());
                    continue;
                }
            };
            match file.kind {
                JournalFileKind::Records => {
                    match serde_json::from_slice::<Vec<(K, Vec<V>)>>(file.body) {
                        Ok(groups) => {
                            for (group, items) in groups {
                                resumed.records.entry(group).or_default().extend(items);
                            }
                        }
                        Err(e) => {
                            skip(&mut resumed, format!("records do not decode: {e}"));
                            continue;
                        }
                    }
                }
                JournalFileKind::Summaries => {
                    match serde_json::from_slice::<Vec<(K, S)>>(file.body) {
                        Ok(summaries) => resumed.summaries.extend(summaries),
                        Err(e) => {
                            skip(&mut resumed, format!("summaries do not decode: {e}"));
                            continue;
                        }
                    }
                }
            }
            resumed.elapsed = resumed.elapsed.max(file.elapsed);
        }
    }
    if opened == 0
        && let Some(error) = first_decrypt_error
    {
        return Err(error);
    }
    Ok(resumed)
}

/// Deletes a journal — files, summaries and lease — in parallel, after taking its
/// lease (so a running journal is never removed underneath its writer). Gives up
/// after `max_failures` failed deletes.
pub async fn remove(
    store: &Store,
    name: &str,
    lease: LeaseConfig,
    clock: Arc<dyn Clock>,
    max_failures: usize,
) -> Result<usize, StoreError> {
    let root = root(name)?;
    let objects = store.list(&root).await?;
    if objects.is_empty() {
        return Ok(0);
    }
    let held = Lease::acquire(store, &format!("{root}lease/"), lease, clock).await?;
    held.check().await?;
    let paths: Vec<String> = objects.into_iter().map(|o| o.path).collect();
    let deleted = store.delete_all(paths, max_failures.max(1)).await?;
    // Anything written since the listing (our own lease files) goes too.
    let rest: Vec<String> = store
        .list(&root)
        .await?
        .into_iter()
        .map(|o| o.path)
        .collect();
    let deleted = deleted + store.delete_all(rest, max_failures.max(1)).await?;
    tracing::info!(journal = name, deleted, "journal removed");
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The bounded form of the `journal_parser` fuzz target (`cargo xtask fuzz`):
        /// arbitrary bytes never panic and a file that parses re-encodes to its bytes;
        /// any body sealed by `encode` parses back unchanged.
        #[test]
        fn arbitrary_bytes_never_panic_and_any_body_round_trips(
            data in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
            summaries in proptest::bool::ANY,
            millis in 0u64..u64::MAX / 2,
        ) {
            if let Ok(file) = JournalFile::parse(&data) {
                proptest::prop_assert_eq!(JournalFile::encode(file.kind, file.elapsed, file.body), data.clone());
            }
            let kind = if summaries { JournalFileKind::Summaries } else { JournalFileKind::Records };
            let elapsed = Duration::from_millis(millis);
            let sealed = JournalFile::encode(kind, elapsed, &data);
            let file = JournalFile::parse(&sealed);
            proptest::prop_assert_eq!(file, Ok(JournalFile { kind, elapsed, body: &data }));
            // Any single flipped byte of a sealed file is refused.
            let at = usize::try_from(millis).unwrap_or(0) % sealed.len();
            let mut flipped = sealed.clone();
            if let Some(byte) = flipped.get_mut(at) {
                *byte ^= 0x01;
            }
            proptest::prop_assert!(JournalFile::parse(&flipped).is_err());
        }
    }

    fn check(bytes: &[u8], expected: Result<(), JournalFileError>) {
        assert_eq!(JournalFile::parse(bytes).map(|_| ()), expected);
    }

    #[test]
    fn journal_files_round_trip_and_reject_every_malformation() {
        let good =
            JournalFile::encode(JournalFileKind::Records, Duration::from_millis(1234), b"[]");
        let file = JournalFile::parse(&good).unwrap();
        assert_eq!(file.kind, JournalFileKind::Records);
        assert_eq!(file.elapsed, Duration::from_millis(1234));
        assert_eq!(file.body, b"[]");

        check(
            &good[..10],
            Err(JournalFileError::Truncated { len: 10, need: 52 }),
        );
        check(
            &good[..53],
            Err(JournalFileError::Truncated { len: 53, need: 54 }),
        );
        let mut bad = good.clone();
        bad[0] = b'X';
        check(&bad, Err(JournalFileError::BadMagic(*b"XPJR")));
        let mut bad = good.clone();
        bad[5] = 9;
        check(&bad, Err(JournalFileError::UnsupportedVersion(9)));
        let mut bad = good.clone();
        bad[6] = 7;
        check(&bad, Err(JournalFileError::UnknownKind(7)));
        let mut bad = good.clone();
        bad[7] = 1;
        check(&bad, Err(JournalFileError::UnsupportedFlags(1)));
        let mut bad = good.clone();
        bad[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
        check(
            &bad,
            Err(JournalFileError::TooLarge {
                len: u64::from(u32::MAX),
                max: MAX_JOURNAL_BODY,
            }),
        );
        let mut bad = good.clone();
        bad.push(0);
        check(&bad, Err(JournalFileError::TrailingBytes(1)));
        let mut bad = good.clone();
        *bad.last_mut().unwrap() = b'}';
        assert!(matches!(
            JournalFile::parse(&bad),
            Err(JournalFileError::ChecksumMismatch { .. })
        ));
        // Every single-bit flip anywhere is caught.
        for index in 0..good.len() * 8 {
            let mut flipped = good.clone();
            flipped[index / 8] ^= 1 << (index % 8);
            assert!(
                JournalFile::parse(&flipped).is_err(),
                "bit {index} flipped went unnoticed"
            );
        }
    }

    #[test]
    fn journal_names_cannot_escape_the_journal_directory() {
        assert!(root("restore/ckpt-1").is_ok());
        for bad in ["../x", "/abs", "", "a/../../b"] {
            assert!(
                matches!(root(bad), Err(StoreError::InvalidOption { .. })),
                "{bad}"
            );
        }
    }
}
