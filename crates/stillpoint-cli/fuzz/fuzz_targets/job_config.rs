//! Fuzz target: the job-file parser (`Job::from_toml`) on arbitrary text.
//!
//! Beyond "no panic": every refusal is one line naming the file, and any job that
//! parses holds the invariants the engine relies on (positive interval, key groups
//! in range, at least one source and counter, counters within the key groups).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stillpoint_cli::Job;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Job::from_toml(text, "fuzz.toml") {
        Ok(job) => {
            assert!(!job.config.checkpoint_interval.is_zero());
            assert!((1..=32_768).contains(&job.config.max_parallelism));
            assert!(job.pipeline.sources >= 1);
            assert!(
                (1..=job.config.max_parallelism).contains(&job.pipeline.aggregators)
            );
            assert!(job.config.store_options.parallelism >= 1);
            assert!(job.config.retention.keep_last >= 1);
        }
        Err(error) => {
            let message = error.to_string();
            assert!(message.starts_with("fuzz.toml"), "{message}");
            assert!(!message.contains('\n'), "{message}");
        }
    }
});
