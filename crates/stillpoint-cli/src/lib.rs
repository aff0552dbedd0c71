//! The job-file format of the `stillpoint` binary: a TOML file that says where a job
//! runs and checkpoints, what it reads and where it publishes, parsed into the
//! engine's domain configuration (`stillpoint::JobConfig`, `stillpoint::ClusterConfig`)
//! and the built-in word count (`stillpoint_connectors::WordCount`).
//!
//! ```
//! let job = stillpoint_cli::Job::from_toml(
//!     "[job]\nwork_dir = \"./data\"\ncheckpoint_interval = \"500ms\"\n[pipeline]\nsources = 2\naggregators = 4\n",
//!     "job.toml",
//! )?;
//! assert_eq!(job.pipeline.aggregators, 4);
//! assert_eq!(job.config.checkpoint_interval, std::time::Duration::from_millis(500));
//! # Ok::<(), stillpoint_cli::ConfigError>(())
//! ```
mod job_file;

pub use job_file::{ConfigError, Job};
