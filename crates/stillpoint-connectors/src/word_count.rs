//! The built-in keyed word count: what `stillpoint run` runs without a job file, and
//! the job of the examples, tests and benchmarks.

use std::path::PathBuf;

use stillpoint::{
    Combine, Combiner, Dataflow, EngineError, Operator, Partitioning, Source, ToDataflow,
};

use crate::{
    CombinedCount, CountCombiner, FileLines, GeneratedWords, KeyedCount, LogDir,
    TransactionalFileSink,
};

/// The built-in keyed word count: `sources` replayable sources → hash by key group →
/// `aggregators` keyed counters → one exactly-once file sink per counter.
#[derive(Clone, Debug)]
pub struct WordCount {
    /// Source parallelism.
    pub sources: u32,
    /// Counter (and sink) parallelism.
    pub aggregators: u32,
    /// What the sources read.
    pub input: WordInput,
    /// Where the sinks publish their output.
    pub output: PathBuf,
    /// Counts each source's words per key before the shuffle ([`CountCombiner`], with
    /// [`Combine::default`]: at most 5,000 words or 200 ms between flushes) and adds
    /// the partial counts up on the counters ([`CombinedCount`]). The final counts
    /// are the same; the counters, the network and the sinks see one update per key
    /// per flush instead of one per word. Off by default.
    pub combine: bool,
}

/// What the word count's sources read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WordInput {
    /// Deterministic generated words ([`GeneratedWords`]); bounded.
    Generated {
        /// Words each source generates before it ends.
        words_per_source: u64,
        /// Distinct words.
        vocabulary: u32,
        /// Seed of the generated words.
        seed: u64,
    },
    /// One text file per source ([`FileLines`]); bounded.
    Files {
        /// The files, one per source.
        paths: Vec<PathBuf>,
    },
    /// One append-only log directory per source ([`LogDir`]); unbounded: the
    /// job runs until it is stopped.
    Log {
        /// The directories, one per source.
        dirs: Vec<PathBuf>,
    },
}

impl WordCount {
    /// A word count over generated words (1,000 distinct words, seed 42).
    #[must_use]
    pub fn generated(
        sources: u32,
        aggregators: u32,
        words_per_source: u64,
        output: impl Into<PathBuf>,
    ) -> Self {
        Self {
            sources,
            aggregators,
            input: WordInput::Generated {
                words_per_source,
                vocabulary: 1_000,
                seed: 42,
            },
            output: output.into(),
            combine: false,
        }
    }

    /// Refuses a word count that cannot run.
    ///
    /// # Errors
    /// None of sources or counters.
    pub fn check(&self) -> Result<(), EngineError> {
        if self.sources == 0 || self.aggregators == 0 {
            return Err(EngineError::Invalid(
                "a word count needs at least one source and one counter".to_owned(),
            ));
        }
        Ok(())
    }

    /// The source of task index `index`.
    pub fn source(&self, index: u32) -> Result<Box<dyn Source>, EngineError> {
        let pick = |list: &[PathBuf], what: &str| {
            list.get(index as usize).cloned().ok_or_else(|| {
                EngineError::Invalid(format!(
                    "source {index} has no {what}: the input lists {} for {} sources",
                    list.len(),
                    self.sources
                ))
            })
        };
        Ok(match &self.input {
            WordInput::Generated {
                words_per_source,
                vocabulary,
                seed,
            } => Box::new(GeneratedWords::new(
                *seed,
                index,
                *words_per_source,
                *vocabulary,
            )),
            WordInput::Files { paths } => Box::new(FileLines::new(pick(paths, "file")?)),
            WordInput::Log { dirs } => Box::new(LogDir::new(pick(dirs, "log directory")?)),
        })
    }
}

impl ToDataflow for WordCount {
    /// `sources` word sources → hash by key group → `aggregators` [`KeyedCount`]s →
    /// forward → one [`TransactionalFileSink`] per counter under `output`; with
    /// `combine`, a [`CountCombiner`] on each source and [`CombinedCount`]s instead.
    fn to_dataflow(&self) -> Result<Dataflow, EngineError> {
        self.check()?;
        let job = self.clone();
        let words = Dataflow::source("words", self.sources, move |index| job.source(index));
        let counted = if self.combine {
            words
                .combine(Combine::default(), |_| {
                    Ok(Box::new(CountCombiner::default()) as Box<dyn Combiner>)
                })
                .operator("count", self.aggregators, Partitioning::Hash, |_| {
                    Ok(Box::new(CombinedCount) as Box<dyn Operator>)
                })
        } else {
            words.operator("count", self.aggregators, Partitioning::Hash, |_| {
                Ok(Box::new(KeyedCount) as Box<dyn Operator>)
            })
        };
        Ok(counted.sink(
            "publish",
            self.aggregators,
            Partitioning::Forward,
            TransactionalFileSink::factory(&self.output),
        ))
    }
}
