//! The built-in connectors and jobs of stillpoint: replayable sources (generated words,
//! text files, append-only log directories), a keyed counter, an exactly-once file
//! sink, and the word count that composes them. Each is written against the public
//! operator API of the `stillpoint` crate only, as a connector of your own would be.
//!
//! ```
//! use stillpoint::{Dataflow, JobConfig, Partitioning, run};
//! use stillpoint_connectors::{GeneratedWords, KeyedCount, TransactionalFileSink, read_committed};
//!
//! let dir = tempfile::tempdir()?;
//! let out = dir.path().join("out");
//! let flow = Dataflow::source("words", 2, |index| {
//!     Ok(Box::new(GeneratedWords::new(7, index, 500, 50)) as _)
//! })
//! .operator("count", 2, Partitioning::Hash, |_| Ok(Box::new(KeyedCount) as _))
//! .sink("publish", 2, Partitioning::Forward, TransactionalFileSink::factory(&out));
//! let mut config = JobConfig::new(dir.path().join("work"));
//! config.checkpoint_interval = std::time::Duration::from_millis(20);
//! run(&config, &flow, Default::default())?;
//! assert_eq!(read_committed(&out)?.len(), 1_000);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
mod count;
mod file_sink;
mod files;
mod generated;
mod windows;
mod word_count;

pub use count::{COUNTS, CombinedCount, CountCombiner, KeyedCount};
pub use file_sink::{FileSinkFactory, TransactionalFileSink, read_committed, recover_transactions};
pub use files::{FileLines, LogDir, MAX_LINE_BYTES};
pub use generated::GeneratedWords;
pub use windows::{Aggregate, CountAggregate, WINDOWS, Window, WindowOperator, WindowSpec};
pub use word_count::{WordCount, WordInput};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctest;
