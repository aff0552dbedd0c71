//! Manifests: the per-task `SnapshotManifest` and the global `CheckpointManifest`.
//!
//! Both are stored as one JSON document, an envelope that names the format and version
//! and carries the SHA-256 of the body exactly as its bytes appear in the file:
//!
//! ```json
//! {"format":"stillpoint/snapshot-manifest","version":1,"sha256":"…","body":{…}}
//! ```
//!
//! Parsing checks, in order: size, envelope syntax, format, version, checksum, body
//! syntax, then every path and cross-field rule. The first failure is returned as a
//! typed [`ManifestError`]; nothing half-parsed escapes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::{
    CheckpointId, CheckpointKind, DigestParseError, NodeId, PathProblem, RelativePath,
    Sha256Digest, SourceOffset, StreamId, TaskId, TransId,
};

/// The manifest format version this crate writes and reads.
pub const MANIFEST_VERSION: u32 = 1;
/// The largest manifest document accepted, in bytes (64 MiB: about 300 000 files).
pub const MAX_MANIFEST_LEN: usize = 64 * 1024 * 1024;

const SNAPSHOT_FORMAT: &str = "stillpoint/snapshot-manifest";
const CHECKPOINT_FORMAT: &str = "stillpoint/checkpoint-manifest";

/// A manifest that could not be parsed or written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// Over [`MAX_MANIFEST_LEN`] bytes.
    #[error("manifest is {len} bytes, more than the maximum of {max}")]
    TooLarge {
        /// The document's length.
        len: usize,
        /// [`MAX_MANIFEST_LEN`].
        max: usize,
    },
    /// Not well-formed JSON, or a field of the wrong type, missing or unknown.
    #[error("manifest {part} is malformed at line {line} column {column}: {message}")]
    Malformed {
        /// `"envelope"` or `"body"` (line and column count from the body's start).
        part: &'static str,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What the JSON parser said.
        message: String,
    },
    /// A manifest of another kind (a checkpoint manifest where a snapshot manifest was
    /// expected, or something else entirely).
    #[error("expected a {expected} document, found format {found:?}")]
    WrongFormat {
        /// The format expected.
        expected: &'static str,
        /// The format found.
        found: String,
    },
    /// A version this crate does not read.
    #[error("unsupported manifest version {found} (this build reads {supported})")]
    UnsupportedVersion {
        /// The version found.
        found: u32,
        /// [`MANIFEST_VERSION`].
        supported: u32,
    },
    /// The envelope's `sha256` is not a digest.
    #[error("manifest checksum field is invalid: {0}")]
    InvalidChecksum(DigestParseError),
    /// The body does not match the envelope's checksum.
    #[error("manifest checksum mismatch: envelope says {expected}, body hashes to {computed}")]
    ChecksumMismatch {
        /// The digest in the envelope.
        expected: Sha256Digest,
        /// The digest of the body.
        computed: Sha256Digest,
    },
    /// A path that could escape its root.
    #[error("{field} = {path:?}: {problem}")]
    InvalidPath {
        /// Where in the body, e.g. `files[3].path`.
        field: String,
        /// The rejected path, truncated to 200 bytes.
        path: String,
        /// Why it was rejected.
        problem: PathProblem,
    },
    /// Two files with the same path.
    #[error("file {0} is listed twice")]
    DuplicatePath(RelativePath),
    /// A changelog segment that is not among the files, or listed twice.
    #[error("changelog segment {0} is not a file of the snapshot, or is listed twice")]
    BadChangelog(RelativePath),
    /// Two entries for the same task.
    #[error("{0} is listed twice")]
    DuplicateTask(TaskId),
    /// Two source offsets for the same task.
    #[error("source {0} has two offsets")]
    DuplicateSource(TaskId),
    /// A source offset for a task the manifest does not list.
    #[error("source {0} has an offset but no task snapshot")]
    UnknownSource(TaskId),
    /// A task outside the recorded stages, or a stage without tasks.
    #[error("{task} does not fit the recorded stages {stages:?} (tasks 1..={total})")]
    OutsideStages {
        /// The task that does not fit (task 0 when a stage has parallelism 0).
        task: TaskId,
        /// The recorded parallelism per stage.
        stages: Vec<u32>,
        /// How many tasks those stages have.
        total: u64,
    },
    /// The document could not be serialized (a bug: these types always serialize).
    #[error("manifest could not be serialized: {0}")]
    Encode(String),
    /// A key-group range that is reversed or beyond the maximum parallelism.
    #[error("key groups {start}..{end} do not fit a maximum parallelism of {max_parallelism}")]
    InvalidKeyGroups {
        /// First key group.
        start: u32,
        /// One past the last key group.
        end: u32,
        /// The stream's number of key groups.
        max_parallelism: u32,
    },
}

/// A half-open range of key groups `start..end`, owned by one task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct KeyGroupRange {
    /// First key group.
    pub start: u32,
    /// One past the last key group.
    pub end: u32,
}

impl KeyGroupRange {
    /// Number of key groups in the range.
    #[must_use]
    pub const fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    /// Whether the range holds no key group.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `group` is in the range.
    #[must_use]
    pub const fn contains(&self, group: u32) -> bool {
        self.start <= group && group < self.end
    }

    /// The contiguous range task `index` of `parallelism` owns out of
    /// `max_parallelism` key groups (as Flink splits them: sizes differ by at most
    /// one); `None` when the task or parallelism does not fit.
    #[must_use]
    pub fn of_task(max_parallelism: u32, parallelism: u32, index: u32) -> Option<Self> {
        if parallelism == 0 || parallelism > max_parallelism || index >= parallelism {
            return None;
        }
        let (max, par, i) = (
            u64::from(max_parallelism),
            u64::from(parallelism),
            u64::from(index),
        );
        Some(Self {
            start: u32::try_from((i * max).div_ceil(par)).ok()?,
            end: u32::try_from(((i + 1) * max).div_ceil(par)).ok()?,
        })
    }

    /// The key groups in both ranges, if any.
    #[must_use]
    pub fn intersection(&self, other: &Self) -> Option<Self> {
        let start = self.start.max(other.start);
        let end = self.end.min(other.end);
        (start < end).then_some(Self { start, end })
    }

    fn check(&self, max_parallelism: u32) -> Result<(), ManifestError> {
        if self.start <= self.end && self.end <= max_parallelism && max_parallelism > 0 {
            Ok(())
        } else {
            Err(ManifestError::InvalidKeyGroups {
                start: self.start,
                end: self.end,
                max_parallelism,
            })
        }
    }
}

impl fmt::Display for KeyGroupRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// Which state backend wrote a snapshot, so a restore can refuse one it cannot read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendInfo {
    /// Backend name, e.g. `rocksdb`.
    pub kind: String,
    /// Backend format or library version.
    pub version: String,
    /// Anything else a restore needs to know (column families, compression, ...).
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

/// One file of a task's snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SnapshotFile {
    /// Path inside the snapshot directory.
    pub path: RelativePath,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the contents.
    pub sha256: Sha256Digest,
    /// The file was already part of the previous snapshot of this task (an immutable
    /// SST file), so an incremental upload can skip it.
    pub shared: bool,
}

/// What one task's snapshot of one checkpoint holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SnapshotManifest {
    /// The stream.
    pub stream: StreamId,
    /// The task.
    pub task: TaskId,
    /// The checkpoint.
    pub checkpoint: CheckpointId,
    /// The stream's number of key groups, fixed at job creation.
    pub max_parallelism: u32,
    /// The key groups whose state the snapshot holds.
    pub key_groups: KeyGroupRange,
    /// The backend that wrote it.
    pub backend: BackendInfo,
    /// Every file, each path at most once.
    pub files: Vec<SnapshotFile>,
    /// Changelog segments (each also in `files`), oldest first: a restore opens the
    /// other files as the materialized database, then replays these in order.
    /// Empty for a snapshot that is a database alone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changelog: Vec<RelativePath>,
}

/// Where one task's snapshot manifest of a checkpoint is, and how to check it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TaskSnapshotRef {
    /// The task.
    pub task: TaskId,
    /// The node that ran it.
    pub node: NodeId,
    /// Path of its [`SnapshotManifest`] relative to the job's root in the store.
    pub manifest: RelativePath,
    /// SHA-256 of that manifest document.
    pub sha256: Sha256Digest,
    /// Full size of the task's state.
    pub state_bytes: u64,
}

/// The offset a source resumes from when restored from a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourcePosition {
    /// The source task.
    pub task: TaskId,
    /// Its offset.
    pub offset: SourceOffset,
}

/// The global manifest of one checkpoint. Written last: its presence in the store is
/// the commit of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CheckpointManifest {
    /// The stream.
    pub stream: StreamId,
    /// The checkpoint.
    pub checkpoint: CheckpointId,
    /// The coordinator transaction that completed it.
    pub trans: TransId,
    /// Checkpoint or savepoint.
    pub kind: CheckpointKind,
    /// When it completed, milliseconds since the Unix epoch.
    pub created_at_millis: u64,
    /// The stream's number of key groups.
    pub max_parallelism: u32,
    /// Every task's snapshot, each task at most once.
    pub tasks: Vec<TaskSnapshotRef>,
    /// Every source's offset, each source a listed task.
    pub sources: Vec<SourcePosition>,
    /// The dataflow's parallelism per stage, in stage order (its tasks are numbered
    /// from 1 stage by stage): what a restore with other parallelisms maps the old
    /// tasks by. Empty when the writer recorded none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<u32>,
}

// ---------------------------------------------------------------------------------------
// Documents as parsed: paths still strings, so a bad one is reported with its location.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope<'a> {
    #[serde(borrow)]
    format: std::borrow::Cow<'a, str>,
    version: u32,
    #[serde(borrow)]
    sha256: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    body: &'a RawValue,
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    format: &'static str,
    version: u32,
    sha256: Sha256Digest,
    body: &'a RawValue,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotFileDoc {
    path: String,
    size: u64,
    sha256: Sha256Digest,
    shared: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotManifestDoc {
    stream: StreamId,
    task: TaskId,
    checkpoint: CheckpointId,
    max_parallelism: u32,
    key_groups: KeyGroupRange,
    backend: BackendInfo,
    files: Vec<SnapshotFileDoc>,
    #[serde(default)]
    changelog: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskSnapshotRefDoc {
    task: TaskId,
    node: NodeId,
    manifest: String,
    sha256: Sha256Digest,
    state_bytes: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckpointManifestDoc {
    stream: StreamId,
    checkpoint: CheckpointId,
    trans: TransId,
    kind: CheckpointKind,
    created_at_millis: u64,
    max_parallelism: u32,
    tasks: Vec<TaskSnapshotRefDoc>,
    sources: Vec<SourcePosition>,
    #[serde(default)]
    stages: Vec<u32>,
}

fn malformed(part: &'static str, error: &serde_json::Error) -> ManifestError {
    // serde_json appends " at line L column C" to its messages; keep only the cause.
    let message = error.to_string();
    let message = message
        .rsplit_once(" at line ")
        .map_or(message.as_str(), |(cause, _)| cause)
        .to_owned();
    ManifestError::Malformed {
        part,
        line: error.line(),
        column: error.column(),
        message,
    }
}

fn parse_path(field: impl FnOnce() -> String, path: String) -> Result<RelativePath, ManifestError> {
    RelativePath::new(path.as_str()).map_err(|problem| {
        let mut shown = path;
        if shown.len() > 200 {
            let cut = (0..=200)
                .rev()
                .find(|i| shown.is_char_boundary(*i))
                .unwrap_or(0);
            shown.truncate(cut);
        }
        ManifestError::InvalidPath {
            field: field(),
            path: shown,
            problem,
        }
    })
}

/// Checks size, envelope, format, version and checksum; returns the body's text.
fn open_envelope<'a>(input: &'a [u8], expected: &'static str) -> Result<&'a str, ManifestError> {
    if input.len() > MAX_MANIFEST_LEN {
        return Err(ManifestError::TooLarge {
            len: input.len(),
            max: MAX_MANIFEST_LEN,
        });
    }
    let envelope: Envelope<'a> =
        serde_json::from_slice(input).map_err(|e| malformed("envelope", &e))?;
    if envelope.format != expected {
        return Err(ManifestError::WrongFormat {
            expected,
            found: envelope.format.chars().take(100).collect(),
        });
    }
    if envelope.version != MANIFEST_VERSION {
        return Err(ManifestError::UnsupportedVersion {
            found: envelope.version,
            supported: MANIFEST_VERSION,
        });
    }
    let expected_digest =
        Sha256Digest::from_hex(&envelope.sha256).map_err(ManifestError::InvalidChecksum)?;
    let body = envelope.body.get();
    let computed = Sha256Digest::of(body.as_bytes());
    if computed != expected_digest {
        return Err(ManifestError::ChecksumMismatch {
            expected: expected_digest,
            computed,
        });
    }
    Ok(body)
}

fn seal(format: &'static str, body: &impl Serialize) -> Result<Vec<u8>, ManifestError> {
    let encode = |e: serde_json::Error| ManifestError::Encode(e.to_string());
    let body = serde_json::to_string_pretty(body).map_err(encode)?;
    let sha256 = Sha256Digest::of(body.as_bytes());
    let body = RawValue::from_string(body).map_err(encode)?;
    let envelope = EnvelopeOut {
        format,
        version: MANIFEST_VERSION,
        sha256,
        body: &body,
    };
    let mut out = serde_json::to_vec(&envelope).map_err(encode)?;
    out.push(b'\n');
    Ok(out)
}

impl SnapshotManifest {
    /// Parses and verifies a snapshot manifest document.
    pub fn parse(input: &[u8]) -> Result<Self, ManifestError> {
        let body = open_envelope(input, SNAPSHOT_FORMAT)?;
        let doc: SnapshotManifestDoc =
            serde_json::from_str(body).map_err(|e| malformed("body", &e))?;
        let files = doc
            .files
            .into_iter()
            .enumerate()
            .map(|(index, file)| {
                Ok(SnapshotFile {
                    path: parse_path(|| format!("files[{index}].path"), file.path)?,
                    size: file.size,
                    sha256: file.sha256,
                    shared: file.shared,
                })
            })
            .collect::<Result<_, ManifestError>>()?;
        let changelog = doc
            .changelog
            .into_iter()
            .enumerate()
            .map(|(index, path)| parse_path(|| format!("changelog[{index}]"), path))
            .collect::<Result<_, ManifestError>>()?;
        let manifest = Self {
            stream: doc.stream,
            task: doc.task,
            checkpoint: doc.checkpoint,
            max_parallelism: doc.max_parallelism,
            key_groups: doc.key_groups,
            backend: doc.backend,
            files,
            changelog,
        };
        manifest.validate()?;
        Ok(manifest)
    }

    /// Checks the rules a parsed manifest obeys: key groups within the maximum
    /// parallelism, no file listed twice, every changelog segment one of the files
    /// and listed once.
    pub fn validate(&self) -> Result<(), ManifestError> {
        self.key_groups.check(self.max_parallelism)?;
        let mut seen = BTreeSet::new();
        for file in &self.files {
            if !seen.insert(&file.path) {
                return Err(ManifestError::DuplicatePath(file.path.clone()));
            }
        }
        for segment in &self.changelog {
            // Each one taken out of `seen` once: a second mention is not found.
            if !seen.remove(segment) {
                return Err(ManifestError::BadChangelog(segment.clone()));
            }
        }
        Ok(())
    }

    /// The document, after [`Self::validate`].
    pub fn to_bytes(&self) -> Result<Vec<u8>, ManifestError> {
        self.validate()?;
        seal(SNAPSHOT_FORMAT, self)
    }

    /// Sum of the file sizes: the task's full state size.
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|file| file.size).sum()
    }

    /// Sum of the sizes of files not shared with the previous snapshot.
    #[must_use]
    pub fn new_bytes(&self) -> u64 {
        self.files
            .iter()
            .filter(|f| !f.shared)
            .map(|f| f.size)
            .sum()
    }
}

impl CheckpointManifest {
    /// Parses and verifies a global checkpoint manifest document.
    pub fn parse(input: &[u8]) -> Result<Self, ManifestError> {
        let body = open_envelope(input, CHECKPOINT_FORMAT)?;
        let doc: CheckpointManifestDoc =
            serde_json::from_str(body).map_err(|e| malformed("body", &e))?;
        let tasks = doc
            .tasks
            .into_iter()
            .enumerate()
            .map(|(index, task)| {
                Ok(TaskSnapshotRef {
                    task: task.task,
                    node: task.node,
                    manifest: parse_path(|| format!("tasks[{index}].manifest"), task.manifest)?,
                    sha256: task.sha256,
                    state_bytes: task.state_bytes,
                })
            })
            .collect::<Result<_, ManifestError>>()?;
        let manifest = Self {
            stream: doc.stream,
            checkpoint: doc.checkpoint,
            trans: doc.trans,
            kind: doc.kind,
            created_at_millis: doc.created_at_millis,
            max_parallelism: doc.max_parallelism,
            tasks,
            sources: doc.sources,
            stages: doc.stages,
        };
        manifest.validate()?;
        Ok(manifest)
    }

    /// Checks the rules a parsed manifest obeys: each task listed once, each source
    /// offset once and for a listed task, a non-zero maximum parallelism, and — when
    /// stages are recorded — no empty stage and every task within them.
    pub fn validate(&self) -> Result<(), ManifestError> {
        KeyGroupRange { start: 0, end: 0 }.check(self.max_parallelism)?;
        let total: u64 = self.stages.iter().map(|p| u64::from(*p)).sum();
        let outside = |task| ManifestError::OutsideStages {
            task,
            stages: self.stages.clone(),
            total,
        };
        if self.stages.contains(&0) {
            return Err(outside(TaskId(0)));
        }
        let mut tasks = BTreeSet::new();
        for task in &self.tasks {
            if !tasks.insert(task.task) {
                return Err(ManifestError::DuplicateTask(task.task));
            }
            if !self.stages.is_empty()
                && (task.task.get() == 0 || u64::from(task.task.get()) > total)
            {
                return Err(outside(task.task));
            }
        }
        let mut sources = BTreeSet::new();
        for source in &self.sources {
            if !sources.insert(source.task) {
                return Err(ManifestError::DuplicateSource(source.task));
            }
            if !tasks.contains(&source.task) {
                return Err(ManifestError::UnknownSource(source.task));
            }
        }
        Ok(())
    }

    /// The document, after [`Self::validate`].
    pub fn to_bytes(&self) -> Result<Vec<u8>, ManifestError> {
        self.validate()?;
        seal(CHECKPOINT_FORMAT, self)
    }

    /// Sum of the tasks' state sizes.
    #[must_use]
    pub fn state_bytes(&self) -> u64 {
        self.tasks.iter().map(|task| task.state_bytes).sum()
    }

    /// The stage of each task and its index within the stage, from [`Self::stages`]
    /// (`None` when none were recorded).
    #[must_use]
    pub fn stage_of(&self, task: TaskId) -> Option<(usize, u32)> {
        let mut first = 1_u64;
        for (stage, parallelism) in self.stages.iter().enumerate() {
            let id = u64::from(task.get());
            if (first..first + u64::from(*parallelism)).contains(&id) {
                return Some((stage, u32::try_from(id - first).ok()?));
            }
            first += u64::from(*parallelism);
        }
        None
    }

    /// The recorded offset of source `task`.
    #[must_use]
    pub fn source_offset(&self, task: TaskId) -> Option<&SourceOffset> {
        self.sources
            .iter()
            .find(|source| source.task == task)
            .map(|source| &source.offset)
    }
}
