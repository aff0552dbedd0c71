//! Job files: TOML with documented defaults. Every section and field may be left
//! out; an unknown field is an error naming its line.
//!
//! ```toml
//! [job]
//! work_dir = "./stillpoint-data"    # live state, snapshots, restore downloads
//! stream = 1
//! checkpoint_interval = "1s"        # durations: "250ms", "1s", "5m", …
//! checkpoint_timeout = "60s"
//! max_concurrent_checkpoints = 1    # in flight at once (1..=16)
//! min_pause = "0s"                  # least time from one checkpoint's end to the next trigger
//! barrier_wait = "10s"              # aligning longer: ask the missing upstreams, log them
//! tolerable_failures = 3            # consecutive failed checkpoints before the job fails
//! max_parallelism = 128             # key groups; fixed for the life of the job
//! lease_ttl = "60s"
//! batch_records = 256               # records a source reads into one data message
//! channel_batches = 4               # messages queued per edge: what a barrier waits behind
//! debloat_target = "1ms"            # messages cut so a full edge drains in this ("0s": off)
//! allow_duplicates = false          # restore even past output the sinks already published
//!
//! [store]
//! uri = "file://./stillpoint-data/store"   # or s3://BUCKET/PREFIX?endpoint=…&region=…, memory://,
//!                                          # gcs://, azblob://, sftp://HOST:PORT/DIR, … (README)
//! # access_key_id / secret_access_key: S3 credentials (default: the AWS_* variables)
//! # options = { user = "backup", key = "/etc/stillpoint/id_ed25519" }   # other services' settings
//! # encryption_key: 64 hex digits (default: STILLPOINT_ENCRYPTION_KEY, else none)
//! parallelism = 8                   # files transferred at once
//! part_size_mib = 8
//! timeout = "60s"
//! io_timeout = "120s"
//! fault_ratio = 0.0                 # chaos testing: fail this fraction of store operations
//! fault_seed = 1                    #   with temporary errors, below the retries (default off)
//!
//! [retention]
//! keep_last = 3                     # periodic checkpoints kept; savepoints always are
//! grace = "10m"                     # objects younger than this are never deleted
//! history = 100                    # checkpoint statistics kept for `checkpoints stats`
//!
//! [state]
//! compression = "lz4"               # none | lz4 | zstd
//! bottommost_compression = "zstd"
//! block_cache_mib = 256
//! write_buffer_mib = 64
//! cache_budget_mib = 256            # the write-back cache's memory
//! bloom_bits_per_key = 10
//! background_jobs = 2
//! changelog = true                  # snapshots = materialization + changelog segments
//! materialize_interval = "60s"      # (changelog) materialize at least this often
//! materialize_mib = 256             # ... or once this much changelog piles up
//! materialize_percent = 100         # ... or this % of the state (lower: faster restores)
//!
//! [metrics]
//! listen = "127.0.0.1:9464"         # Prometheus text at /metrics; default: off
//!                                   # (in a cluster: the coordinator's, checkpoints)
//! # nodes = ["127.0.0.1:9465", "127.0.0.1:9466"]  # a cluster's nodes, their tasks
//!
//! [cluster]                         # run across processes; default: one process
//! coordinator = "127.0.0.1:7600"    # `stillpoint coordinator JOB.toml` listens here
//! nodes = ["127.0.0.1:7601", "127.0.0.1:7602"]   # `stillpoint node JOB.toml --node N`
//! connect_timeout = "60s"
//! secret = "change me: 16 bytes or more"  # every connection proves it knows this;
//!                                   # better: secret_file = "PATH" (the file's bytes)
//!
//! [pipeline]                        # the built-in keyed word count
//! sources = 2
//! aggregators = 3                   # counters, each with its exactly-once file sink
//! output = "./stillpoint-data/output"
//! input = { kind = "generated", words_per_source = 1000000, vocabulary = 1000, seed = 42 }
//! # input = { kind = "files", paths = ["a.txt", "b.txt"] }      # one file per source
//! # input = { kind = "log", dirs = ["log-0", "log-1"] }         # one log dir per source
//! combine = false                   # count per word on each source before the shuffle
//!                                   # (≤ 5,000 words or 200 ms); same final counts
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use stillpoint_backup::{EncryptionKey, FaultConfig, Retention, S3Credentials, StoreOptions};
use stillpoint_state::{ChangelogConfig, Compression, StateConfig};
use stillpoint_wire::StreamId;

use stillpoint::{EngineError, JobConfig};
use stillpoint_cluster::{ClusterConfig, ClusterSecret};
use stillpoint_connectors::{WordCount, WordInput};

/// A job file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read job file {path}: {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's message.
        message: String,
    },
    /// The TOML does not parse or has a wrong or unknown field (the message names
    /// the line and column).
    #[error("{source_name}: {message}")]
    Parse {
        /// The file (or `<string>`).
        source_name: String,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A value parses but cannot be used.
    #[error("{source_name}: `{field}` {reason}")]
    Invalid {
        /// The file (or `<string>`).
        source_name: String,
        /// The field, as `section.name`.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

/// A job to run: where and how it checkpoints, and its pipeline.
#[derive(Clone, Debug)]
pub struct Job {
    /// Where and how the job runs and checkpoints.
    pub config: JobConfig,
    /// The pipeline (the built-in keyed word count).
    pub pipeline: WordCount,
    /// Its processes when it runs as a cluster (`[cluster]`; `None`: one process).
    pub cluster: Option<ClusterConfig>,
}

impl Job {
    /// The defaults: a generated word count under `./stillpoint-data`.
    #[must_use]
    pub fn embedded_default() -> Self {
        // An empty file is the defaults; it always parses.
        Self::from_toml("", "<defaults>").unwrap_or_else(|_| Self {
            config: JobConfig::new("./stillpoint-data"),
            pipeline: WordCount::generated(2, 3, 1_000_000, "./stillpoint-data/output"),
            cluster: None,
        })
    }

    /// Reads a job file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Parses a job file's text; `source_name` names it in errors.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        let file: JobFile = toml::from_str(text).map_err(|e| ConfigError::Parse {
            source_name: source_name.to_owned(),
            message: parse_message(text, &e),
        })?;
        file.into_job(source_name)
    }
}

/// An engine error as the reason a field is refused (without its kind's prefix).
fn reason(error: EngineError) -> String {
    match error {
        EngineError::Invalid(reason) => reason,
        other => other.to_string(),
    }
}

/// Fields whose values are secrets: never repeated in an error.
const SECRET_FIELDS: [&str; 4] = [
    "encryption_key",
    "secret_access_key",
    "session_token",
    "secret",
];

/// A parse error as line, column and the parser's message — never toml's snippet of
/// the offending line, which would echo a mistyped secret to the terminal; and when
/// the offending line sets a secret, not even the message (serde's can quote the
/// value).
fn parse_message(text: &str, error: &toml::de::Error) -> String {
    let message = error.message().trim_end().replace('\n', " ");
    let Some(at) = error.span().map(|span| span.start.min(text.len())) else {
        return message;
    };
    let before = text.get(..at).unwrap_or_default();
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before.get(line_start..).map_or(0, |l| l.chars().count()) + 1;
    let line_text = text
        .get(line_start..)
        .and_then(|rest| rest.lines().next())
        .unwrap_or_default();
    let key = line_text
        .split('=')
        .next()
        .unwrap_or_default()
        .trim()
        .trim_matches('"');
    if SECRET_FIELDS.contains(&key) {
        return format!(
            "line {line}, column {column}: `{key}` does not parse (its value is a secret and is not shown)"
        );
    }
    format!("line {line}, column {column}: {message}")
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobFile {
    #[serde(default)]
    job: JobSection,
    #[serde(default)]
    store: StoreSection,
    #[serde(default)]
    retention: RetentionSection,
    #[serde(default)]
    state: StateSection,
    #[serde(default)]
    metrics: MetricsSection,
    #[serde(default)]
    cluster: Option<ClusterSection>,
    #[serde(default)]
    pipeline: PipelineSection,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterSection {
    coordinator: std::net::SocketAddr,
    nodes: Vec<std::net::SocketAddr>,
    /// A file holding the cluster secret (relative to the job file's directory).
    secret_file: Option<PathBuf>,
    /// The cluster secret itself (prefer `secret_file`).
    secret: Option<String>,
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    connect_timeout: Duration,
}

const fn default_connect_timeout() -> Duration {
    Duration::from_secs(60)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct JobSection {
    work_dir: PathBuf,
    stream: u64,
    #[serde(with = "humantime_serde")]
    checkpoint_interval: Duration,
    #[serde(with = "humantime_serde")]
    checkpoint_timeout: Duration,
    max_concurrent_checkpoints: usize,
    #[serde(with = "humantime_serde")]
    min_pause: Duration,
    #[serde(with = "humantime_serde")]
    barrier_wait: Duration,
    tolerable_failures: u32,
    max_parallelism: u32,
    #[serde(with = "humantime_serde")]
    lease_ttl: Duration,
    batch_records: usize,
    channel_batches: usize,
    #[serde(with = "humantime_serde")]
    debloat_target: Duration,
    allow_duplicates: bool,
}

impl Default for JobSection {
    fn default() -> Self {
        let defaults = JobConfig::new("./stillpoint-data");
        Self {
            work_dir: defaults.work_dir,
            stream: defaults.stream.get(),
            checkpoint_interval: defaults.checkpoint_interval,
            checkpoint_timeout: defaults.checkpoint_timeout,
            max_concurrent_checkpoints: defaults.max_concurrent_checkpoints,
            min_pause: defaults.min_pause,
            barrier_wait: defaults.barrier_wait,
            tolerable_failures: defaults.tolerable_failures,
            max_parallelism: defaults.max_parallelism,
            lease_ttl: defaults.lease_ttl,
            batch_records: defaults.batch_records,
            channel_batches: defaults.channel_batches,
            debloat_target: defaults.debloat_target.unwrap_or(Duration::ZERO),
            allow_duplicates: defaults.allow_duplicates,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct StoreSection {
    uri: Option<String>,
    access_key_id: Option<String>,
    secret_access_key: Option<String>,
    encryption_key: Option<String>,
    /// OpenDAL settings of services other than file, memory and S3 (may be secrets).
    options: std::collections::BTreeMap<String, String>,
    parallelism: usize,
    part_size_mib: usize,
    #[serde(with = "humantime_serde")]
    timeout: Duration,
    #[serde(with = "humantime_serde")]
    io_timeout: Duration,
    fault_ratio: f64,
    fault_seed: u64,
}

impl Default for StoreSection {
    fn default() -> Self {
        let defaults = StoreOptions::default();
        Self {
            uri: None,
            access_key_id: None,
            secret_access_key: None,
            encryption_key: None,
            options: std::collections::BTreeMap::new(),
            parallelism: defaults.parallelism,
            part_size_mib: defaults.part_size >> 20,
            timeout: defaults.timeout,
            io_timeout: defaults.io_timeout,
            fault_ratio: 0.0,
            fault_seed: 1,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RetentionSection {
    keep_last: usize,
    #[serde(with = "humantime_serde")]
    grace: Duration,
    history: usize,
}

impl Default for RetentionSection {
    fn default() -> Self {
        let defaults = Retention::default();
        Self {
            keep_last: defaults.keep_last,
            grace: defaults.grace,
            history: defaults.history,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum CompressionName {
    None,
    Lz4,
    Zstd,
}

impl From<CompressionName> for Compression {
    fn from(name: CompressionName) -> Self {
        match name {
            CompressionName::None => Self::None,
            CompressionName::Lz4 => Self::Lz4,
            CompressionName::Zstd => Self::Zstd,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct StateSection {
    compression: CompressionName,
    bottommost_compression: CompressionName,
    block_cache_mib: usize,
    write_buffer_mib: usize,
    cache_budget_mib: usize,
    bloom_bits_per_key: u32,
    background_jobs: i32,
    changelog: bool,
    #[serde(with = "humantime_serde")]
    materialize_interval: Duration,
    materialize_mib: u64,
    materialize_percent: u32,
}

impl Default for StateSection {
    fn default() -> Self {
        let defaults = StateConfig::default();
        let changelog = defaults.changelog.unwrap_or_default();
        Self {
            changelog: defaults.changelog.is_some(),
            materialize_interval: changelog.materialize_interval,
            materialize_mib: changelog.materialize_bytes >> 20,
            materialize_percent: changelog.materialize_percent,
            compression: CompressionName::Lz4,
            bottommost_compression: CompressionName::Zstd,
            block_cache_mib: defaults.block_cache_bytes >> 20,
            write_buffer_mib: defaults.write_buffer_bytes >> 20,
            cache_budget_mib: defaults.cache_budget_bytes >> 20,
            bloom_bits_per_key: defaults.bloom_bits_per_key,
            background_jobs: defaults.background_jobs,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct MetricsSection {
    listen: Option<SocketAddr>,
    nodes: Vec<SocketAddr>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct PipelineSection {
    sources: u32,
    aggregators: u32,
    output: Option<PathBuf>,
    input: InputSection,
    combine: bool,
}

impl Default for PipelineSection {
    fn default() -> Self {
        Self {
            sources: 2,
            aggregators: 3,
            output: None,
            combine: false,
            input: InputSection::Generated {
                words_per_source: default_words(),
                vocabulary: default_vocabulary(),
                seed: default_seed(),
            },
        }
    }
}

const fn default_words() -> u64 {
    1_000_000
}
const fn default_vocabulary() -> u32 {
    1_000
}
const fn default_seed() -> u64 {
    42
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "lowercase")]
enum InputSection {
    Generated {
        #[serde(default = "default_words")]
        words_per_source: u64,
        #[serde(default = "default_vocabulary")]
        vocabulary: u32,
        #[serde(default = "default_seed")]
        seed: u64,
    },
    Files {
        paths: Vec<PathBuf>,
    },
    Log {
        dirs: Vec<PathBuf>,
    },
}

impl JobFile {
    fn into_job(self, source_name: &str) -> Result<Job, ConfigError> {
        let invalid = |field: &'static str, reason: &str| ConfigError::Invalid {
            source_name: source_name.to_owned(),
            field,
            reason: reason.to_owned(),
        };
        let Self {
            job,
            store,
            retention,
            state,
            metrics,
            cluster,
            pipeline,
        } = self;
        if cluster.as_ref().is_some_and(|c| c.nodes.is_empty()) {
            return Err(invalid("cluster.nodes", "must list at least one node"));
        }
        // Two listeners on one address: the second process would fail to start, or
        // (with SO_REUSEPORT elsewhere) two nodes would share one's connections.
        let listeners = metrics
            .listen
            .iter()
            .map(|a| ("metrics.listen", *a))
            .chain(cluster.iter().flat_map(|c| {
                std::iter::once(("cluster.coordinator", c.coordinator))
                    .chain(c.nodes.iter().map(|a| ("cluster.nodes", *a)))
            }))
            .chain(metrics.nodes.iter().map(|a| ("metrics.nodes", *a)));
        let mut seen: Vec<(&'static str, SocketAddr)> = Vec::new();
        for (field, address) in listeners {
            if let Some((first, _)) = seen
                .iter()
                .find(|(_, a)| *a == address && address.port() != 0)
            {
                return Err(invalid(
                    field,
                    &format!(
                        "lists {address}, which `{first}` already uses (every process listens on its own address)"
                    ),
                ));
            }
            seen.push((field, address));
        }
        if retention.grace < job.checkpoint_timeout {
            return Err(invalid(
                "retention.grace",
                &format!(
                    "is {}, shorter than job.checkpoint_timeout ({}): files of a checkpoint still uploading could be collected",
                    humantime_serde::re::humantime::format_duration(retention.grace),
                    humantime_serde::re::humantime::format_duration(job.checkpoint_timeout)
                ),
            ));
        }
        let secret = match cluster.as_ref().map(|c| (&c.secret_file, &c.secret)) {
            None => None,
            Some((Some(path), None)) => Some(
                ClusterSecret::from_file(path)
                    .map_err(|e| invalid("cluster.secret_file", &reason(e)))?,
            ),
            Some((None, Some(text))) => Some(
                ClusterSecret::new(zeroize::Zeroizing::new(text.clone()).as_bytes())
                    .map_err(|e| invalid("cluster.secret", &reason(e)))?,
            ),
            Some((None, None)) => {
                return Err(invalid(
                    "cluster.secret_file",
                    "is required: every connection of a cluster proves it knows the cluster secret (a file of at least 16 bytes, the same for every process; or cluster.secret)",
                ));
            }
            Some((Some(_), Some(_))) => {
                return Err(invalid(
                    "cluster.secret",
                    "and cluster.secret_file exclude each other",
                ));
            }
        };
        if job.checkpoint_interval.is_zero() {
            return Err(invalid("job.checkpoint_interval", "must be positive"));
        }
        if job.barrier_wait.is_zero() {
            return Err(invalid("job.barrier_wait", "must be positive"));
        }
        if !(1..=16).contains(&job.max_concurrent_checkpoints) {
            return Err(invalid(
                "job.max_concurrent_checkpoints",
                "must be in 1..=16",
            ));
        }
        if job.max_parallelism == 0 || job.max_parallelism > 32_768 {
            return Err(invalid("job.max_parallelism", "must be in 1..=32768"));
        }
        if !(1..=65_536).contains(&job.batch_records) {
            return Err(invalid("job.batch_records", "must be in 1..=65536"));
        }
        if !(1..=1_024).contains(&job.channel_batches) {
            return Err(invalid("job.channel_batches", "must be in 1..=1024"));
        }
        if job.debloat_target > Duration::from_secs(10) {
            return Err(invalid(
                "job.debloat_target",
                "must be at most 10s (\"0s\" turns debloating off)",
            ));
        }
        if store.parallelism == 0 {
            return Err(invalid("store.parallelism", "must be at least 1"));
        }
        if store.part_size_mib < 5 {
            return Err(invalid(
                "store.part_size_mib",
                "must be at least 5 (S3 parts are at least 5 MiB)",
            ));
        }
        if !(0.0..1.0).contains(&store.fault_ratio) {
            return Err(invalid("store.fault_ratio", "must be in 0.0..1.0"));
        }
        if retention.keep_last == 0 {
            return Err(invalid("retention.keep_last", "must be at least 1"));
        }
        if pipeline.sources == 0 {
            return Err(invalid("pipeline.sources", "must be at least 1"));
        }
        if pipeline.aggregators == 0 || pipeline.aggregators > job.max_parallelism {
            return Err(invalid(
                "pipeline.aggregators",
                "must be in 1..=job.max_parallelism",
            ));
        }
        let s3_credentials = match (store.access_key_id, store.secret_access_key) {
            (None, None) => None,
            (Some(access_key_id), Some(secret_access_key)) => Some(S3Credentials {
                access_key_id,
                secret_access_key,
                session_token: None,
            }),
            _ => {
                return Err(invalid(
                    "store.access_key_id",
                    "and `store.secret_access_key` go together",
                ));
            }
        };
        let encryption = match store.encryption_key {
            Some(hex) => Some(
                EncryptionKey::from_hex(&hex).map_err(|e| ConfigError::Invalid {
                    source_name: source_name.to_owned(),
                    field: "store.encryption_key",
                    reason: e.to_string(),
                })?,
            ),
            None => EncryptionKey::from_env().map_err(|e| ConfigError::Invalid {
                source_name: source_name.to_owned(),
                field: "store.encryption_key",
                reason: e.to_string(),
            })?,
        };
        let input = match pipeline.input {
            InputSection::Generated {
                words_per_source,
                vocabulary,
                seed,
            } => {
                if vocabulary == 0 {
                    return Err(invalid("pipeline.input.vocabulary", "must be at least 1"));
                }
                WordInput::Generated {
                    words_per_source,
                    vocabulary,
                    seed,
                }
            }
            InputSection::Files { paths } => {
                if paths.len() != pipeline.sources as usize {
                    return Err(invalid(
                        "pipeline.input.paths",
                        &format!(
                            "lists {} files for {} sources (one file per source)",
                            paths.len(),
                            pipeline.sources
                        ),
                    ));
                }
                WordInput::Files { paths }
            }
            InputSection::Log { dirs } => {
                if dirs.len() != pipeline.sources as usize {
                    return Err(invalid(
                        "pipeline.input.dirs",
                        &format!(
                            "lists {} directories for {} sources (one log per source)",
                            dirs.len(),
                            pipeline.sources
                        ),
                    ));
                }
                WordInput::Log { dirs }
            }
        };
        let mut config = JobConfig::new(&job.work_dir);
        config.stream = StreamId(job.stream);
        config.store = store.uri;
        config.store_options = StoreOptions {
            s3_credentials,
            service_options: store.options.into_iter().collect(),
            encryption,
            parallelism: store.parallelism,
            part_size: store.part_size_mib << 20,
            timeout: store.timeout,
            io_timeout: store.io_timeout,
            faults: (store.fault_ratio > 0.0)
                .then(|| FaultConfig::new(store.fault_ratio, store.fault_seed)),
            ..StoreOptions::default()
        };
        config.checkpoint_interval = job.checkpoint_interval;
        config.checkpoint_timeout = job.checkpoint_timeout;
        config.max_concurrent_checkpoints = job.max_concurrent_checkpoints;
        config.min_pause = job.min_pause;
        config.barrier_wait = job.barrier_wait;
        config.tolerable_failures = job.tolerable_failures;
        config.batch_records = job.batch_records;
        config.channel_batches = job.channel_batches;
        config.debloat_target = (!job.debloat_target.is_zero()).then_some(job.debloat_target);
        config.allow_duplicates = job.allow_duplicates;
        config.retention = Retention {
            keep_last: retention.keep_last,
            grace: retention.grace,
            history: retention.history,
            ..Retention::default()
        };
        config.max_parallelism = job.max_parallelism;
        config.state = StateConfig {
            compression: state.compression.into(),
            bottommost_compression: state.bottommost_compression.into(),
            block_cache_bytes: state.block_cache_mib << 20,
            write_buffer_bytes: state.write_buffer_mib << 20,
            cache_budget_bytes: state.cache_budget_mib << 20,
            bloom_bits_per_key: state.bloom_bits_per_key,
            background_jobs: state.background_jobs,
            changelog: state.changelog.then_some(ChangelogConfig {
                materialize_interval: state.materialize_interval,
                materialize_bytes: state.materialize_mib << 20,
                materialize_percent: state.materialize_percent,
            }),
        };
        config.lease_ttl = job.lease_ttl;
        config.metrics_listen = metrics.listen;
        if cluster.is_none() && !metrics.nodes.is_empty() {
            return Err(invalid(
                "metrics.nodes",
                "is for the nodes of a cluster job; this job has no [cluster] section",
            ));
        }
        if let Some(c) = &cluster
            && !metrics.nodes.is_empty()
            && metrics.nodes.len() != c.nodes.len()
        {
            return Err(invalid(
                "metrics.nodes",
                &format!(
                    "lists {} addresses for {} nodes (one per node, in cluster.nodes' order)",
                    metrics.nodes.len(),
                    c.nodes.len()
                ),
            ));
        }
        let cluster = cluster.zip(secret).map(|(c, secret)| ClusterConfig {
            coordinator: c.coordinator,
            nodes: c.nodes,
            connect_timeout: c.connect_timeout,
            node_metrics: metrics.nodes,
            secret,
        });
        let output = pipeline
            .output
            .unwrap_or_else(|| job.work_dir.join("output"));
        if let Some(reason) = output_clash(
            &output,
            &job.work_dir,
            config.store.as_deref().unwrap_or_default(),
        ) {
            return Err(invalid("pipeline.output", &reason));
        }
        let pipeline = WordCount {
            sources: pipeline.sources,
            aggregators: pipeline.aggregators,
            input,
            output,
            combine: pipeline.combine,
        };
        Ok(Job {
            config,
            pipeline,
            cluster,
        })
    }
}

/// What the engine keeps in its work directory (beside the sinks' default `output`).
const ENGINE_ENTRIES: [&str; 5] = ["db", "snapshots", "restore", "store", "node-"];

/// Why `output` cannot be the sinks' directory, if it cannot: it is the work directory
/// or holds it, lies inside something the engine keeps there (live state, snapshots,
/// restores, a node's directory, the default store) or inside a `file://` store —
/// places the engine deletes and rewrites, or whose files it would take for its own.
fn output_clash(output: &Path, work_dir: &Path, store: &str) -> Option<String> {
    let output = lexical_absolute(output);
    let work_dir = lexical_absolute(work_dir);
    if work_dir.starts_with(&output) {
        return Some(format!(
            "{} is (or holds) the work directory {}; give the sinks a directory of their own",
            output.display(),
            work_dir.display()
        ));
    }
    if let Ok(inside) = output.strip_prefix(&work_dir)
        && let Some(first) = inside.components().next()
        && let Some(entry) = ENGINE_ENTRIES.iter().find(|entry| {
            let name = first.as_os_str().to_string_lossy();
            if entry.ends_with('-') {
                name.starts_with(*entry)
            } else {
                name == **entry
            }
        })
    {
        return Some(format!(
            "{} lies inside the engine's {entry}… in the work directory, which it deletes and rewrites",
            output.display()
        ));
    }
    if let Some(root) = store.strip_prefix("file://") {
        let root = lexical_absolute(Path::new(root));
        if output.starts_with(&root) || root.starts_with(&output) {
            return Some(format!(
                "{} overlaps the checkpoint store {}",
                output.display(),
                root.display()
            ));
        }
    }
    None
}

/// `path` made absolute against the working directory, with `.` and `..` resolved
/// lexically (the directories need not exist yet).
fn lexical_absolute(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut out = PathBuf::new();
    for component in absolute.components() {
        match component {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_the_documented_defaults() {
        let job = Job::from_toml("", "t").unwrap();
        assert_eq!(job.config.work_dir, PathBuf::from("./stillpoint-data"));
        assert_eq!(job.config.checkpoint_interval, Duration::from_secs(1));
        assert_eq!(
            (job.config.batch_records, job.config.channel_batches),
            (256, 4)
        );
        assert_eq!(job.config.debloat_target, Some(Duration::from_millis(1)));
        assert_eq!(job.config.max_parallelism, 128);
        assert_eq!(job.config.state, StateConfig::default());
        assert_eq!(job.config.retention.keep_last, 3);
        assert_eq!(job.config.metrics_listen, None);
        assert!(job.config.store_options.faults.is_none());
        assert_eq!(job.pipeline.sources, 2);
        assert_eq!(job.pipeline.aggregators, 3);
        assert!(!job.pipeline.combine);
        assert_eq!(
            job.pipeline.output,
            PathBuf::from("./stillpoint-data/output")
        );
        assert!(matches!(
            job.pipeline.input,
            WordInput::Generated {
                words_per_source: 1_000_000,
                vocabulary: 1_000,
                seed: 42
            }
        ));
    }

    #[test]
    fn every_section_is_read() {
        let job = Job::from_toml(
            r#"
[job]
work_dir = "/tmp/x"
checkpoint_interval = "250ms"
max_parallelism = 64
batch_records = 1024
channel_batches = 1
debloat_target = "0s"
[store]
uri = "s3://bucket/jobs?endpoint=http://127.0.0.1:8333"
access_key_id = "id"
secret_access_key = "secret"
part_size_mib = 16
fault_ratio = 0.1
fault_seed = 9
[retention]
keep_last = 5
[state]
compression = "none"
cache_budget_mib = 32
materialize_percent = 25
[metrics]
listen = "127.0.0.1:9464"
[cluster]
coordinator = "127.0.0.1:7600"
nodes = ["127.0.0.1:7601", "127.0.0.1:7602"]
secret = "a cluster secret of some length"
[pipeline]
sources = 1
aggregators = 4
input = { kind = "files", paths = ["in.txt"] }
combine = true
"#,
            "t",
        )
        .unwrap();
        assert_eq!(job.config.checkpoint_interval, Duration::from_millis(250));
        assert_eq!(job.config.max_parallelism, 64);
        assert_eq!(
            (job.config.batch_records, job.config.channel_batches),
            (1024, 1)
        );
        assert_eq!(job.config.debloat_target, None, "\"0s\" is off");
        assert_eq!(job.config.store_options.part_size, 16 << 20);
        assert!(job.config.store_options.s3_credentials.is_some());
        let faults = job.config.store_options.faults.as_ref().unwrap();
        assert_eq!((faults.error_ratio, faults.seed), (0.1, 9));
        assert_eq!(job.config.retention.keep_last, 5);
        assert_eq!(job.config.state.compression, Compression::None);
        assert_eq!(job.config.state.cache_budget_bytes, 32 << 20);
        assert_eq!(
            job.config.state.changelog.map(|c| c.materialize_percent),
            Some(25)
        );
        assert_eq!(
            job.config.metrics_listen,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert_eq!(job.pipeline.output, PathBuf::from("/tmp/x/output"));
        assert!(matches!(job.pipeline.input, WordInput::Files { .. }));
        assert!(job.pipeline.combine);
        let cluster = job.cluster.unwrap();
        assert_eq!(cluster.nodes.len(), 2);
        assert_eq!(cluster.connect_timeout, Duration::from_secs(60));
    }

    #[test]
    fn a_parse_error_never_echoes_a_secret() {
        let secret = "s3cr3t-Value-0123456789";
        for text in [
            format!("[store]\nsecret_access_key = \"{secret}\nregion = \"x\"\n"),
            format!("[store]\nencryption_key = {secret}\n"),
            format!("[store]\nencryption_key = [\"{secret}\"]\n"),
            format!("[store]\nsecret_access_key = '{secret}\n"),
            format!("[store]\nsecret_access_key = \"{secret}\"\nfrobnicate = 1\n"),
            format!(
                "[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\"]\nsecret = {secret}\n"
            ),
            format!(
                "[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\"]\nsecret = [\"{secret}\"]\n"
            ),
        ] {
            let error = Job::from_toml(&text, "job.toml").unwrap_err().to_string();
            assert!(!error.contains(secret), "{error}");
            assert!(!error.contains("s3cr3t"), "{error}");
            assert!(error.contains("line "), "{error}");
        }
        let error = Job::from_toml(&format!("[store]\nencryption_key = {secret}\n"), "job.toml")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("line 2") && error.contains("not shown"),
            "{error}"
        );
    }

    #[test]
    fn bad_files_are_refused_naming_the_line_or_field() {
        let cases = [
            ("[job]\nwork_dir = \"a\"\nfrobnicate = 1\n", "line 3"),
            ("[job]\ncheckpoint_interval = \"soon\"\n", "line 2"),
            ("[jobs]\n", "unknown field `jobs`"),
            (
                "[job]\ncheckpoint_interval = \"0s\"\n",
                "job.checkpoint_interval",
            ),
            ("[store]\naccess_key_id = \"x\"\n", "store.access_key_id"),
            (
                "[store]\nencryption_key = \"abc\"\n",
                "store.encryption_key",
            ),
            ("[retention]\nkeep_last = 0\n", "retention.keep_last"),
            (
                "[job]\nmax_concurrent_checkpoints = 0\n",
                "`job.max_concurrent_checkpoints` must be in 1..=16",
            ),
            (
                "[retention]\ngrace = \"0s\"\n",
                "`retention.grace` is 0s, shorter than job.checkpoint_timeout (1m)",
            ),
            (
                "[job]\nwork_dir = \"/tmp/w\"\n[pipeline]\noutput = \"/tmp/w/db/out\"\n",
                "`pipeline.output` /tmp/w/db/out lies inside the engine's db",
            ),
            (
                "[job]\nwork_dir = \"/tmp/w/x\"\n[pipeline]\noutput = \"/tmp/w\"\n",
                "is (or holds) the work directory",
            ),
            (
                "[job]\nwork_dir = \"/tmp/w\"\n[pipeline]\noutput = \"/tmp/w/./node-2/../snapshots\"\n",
                "inside the engine's snapshots",
            ),
            (
                "[store]\nuri = \"file:///tmp/s\"\n[pipeline]\noutput = \"/tmp/s/out\"\n",
                "overlaps the checkpoint store /tmp/s",
            ),
            (
                "[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\", \"127.0.0.1:2\"]\nsecret = \"sixteen bytes or more\"\n",
                "`cluster.nodes` lists 127.0.0.1:2, which `cluster.nodes` already uses",
            ),
            (
                "[metrics]\nlisten = \"127.0.0.1:1\"\n[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\"]\nsecret = \"sixteen bytes or more\"\n",
                "`cluster.coordinator` lists 127.0.0.1:1, which `metrics.listen` already uses",
            ),
            ("[job]\nbatch_records = 0\n", "job.batch_records"),
            ("[job]\nbarrier_wait = \"0s\"\n", "job.barrier_wait"),
            ("[job]\nchannel_batches = 100000\n", "job.channel_batches"),
            ("[job]\ndebloat_target = \"1m\"\n", "job.debloat_target"),
            ("[store]\nfault_ratio = 1.5\n", "store.fault_ratio"),
            ("[store]\nfault_ratio = nan\n", "store.fault_ratio"),
            (
                "[pipeline]\nsources = 2\ninput = { kind = \"files\", paths = [\"a\"] }\n",
                "one file per source",
            ),
            (
                "[pipeline]\ninput = { kind = \"kafka\" }\n",
                "unknown variant `kafka`",
            ),
            ("[state]\ncompression = \"brotli\"\n", "line 2"),
            ("[pipeline]\naggregators = 1000\n", "pipeline.aggregators"),
            (
                "[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = []\n",
                "cluster.nodes",
            ),
            (
                "[cluster]\ncoordinator = \"nowhere\"\nnodes = []\n",
                "line 2",
            ),
            (
                "[metrics]\nnodes = [\"127.0.0.1:9465\"]\n",
                "`metrics.nodes` is for the nodes of a cluster job",
            ),
            (
                "[metrics]\nnodes = [\"127.0.0.1:9465\"]\n[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\", \"127.0.0.1:3\"]\nsecret = \"sixteen bytes or more\"\n",
                "lists 1 addresses for 2 nodes",
            ),
            (
                "[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\"]\n",
                "`cluster.secret_file` is required",
            ),
            (
                "[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\"]\nsecret = \"tiny-secret\"\n",
                "`cluster.secret` the cluster secret is 11 bytes; at least 16 are needed",
            ),
            (
                "[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\"]\nsecret = \"sixteen bytes or more\"\nsecret_file = \"x\"\n",
                "exclude each other",
            ),
            (
                "[cluster]\ncoordinator = \"127.0.0.1:1\"\nnodes = [\"127.0.0.1:2\"]\nsecret_file = \"/nonexistent/cluster.secret\"\n",
                "/nonexistent/cluster.secret",
            ),
        ];
        for (text, expected) in cases {
            let error = Job::from_toml(text, "job.toml").unwrap_err().to_string();
            assert!(
                error.contains(expected) && error.starts_with("job.toml"),
                "{text:?}: {error}"
            );
            assert!(!error.contains('\n'), "one line: {error}");
        }
    }

    /// The bounded form of the `job_config` fuzz target (`cargo xtask fuzz`): the
    /// documented example cut at every character, with every line dropped in turn and
    /// with every byte replaced by a quote, parses or is refused on one line naming
    /// the file; never a panic.
    #[test]
    fn every_cut_and_mangled_example_parses_or_is_one_line() {
        let documented: String = include_str!("job_file.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! ").or(l.strip_prefix("//!")))
            .skip_while(|l| !l.starts_with("```toml"))
            .skip(1)
            .take_while(|l| !l.starts_with("```"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(Job::from_toml(&documented, "doc.toml").is_ok());
        let lines: Vec<&str> = documented.lines().collect();
        let mut variants: Vec<String> = documented
            .char_indices()
            .map(|(at, _)| documented[..at].to_owned())
            .collect();
        variants.extend((0..lines.len()).map(|skip| {
            lines
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != skip)
                .map(|(_, l)| format!("{l}\n"))
                .collect()
        }));
        variants.extend(documented.char_indices().map(|(at, c)| {
            format!(
                "{}\"{}",
                &documented[..at],
                &documented[at + c.len_utf8()..]
            )
        }));
        for text in &variants {
            if let Err(error) = Job::from_toml(text, "cut.toml") {
                let message = error.to_string();
                assert!(
                    message.starts_with("cut.toml") && !message.contains('\n'),
                    "{message}"
                );
            }
        }
    }

    #[test]
    fn a_missing_file_is_a_read_error_naming_it() {
        let error = Job::load(Path::new("/nonexistent/job.toml")).unwrap_err();
        assert!(
            error.to_string().contains("/nonexistent/job.toml"),
            "{error}"
        );
    }
}
