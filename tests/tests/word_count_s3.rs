//! End to end against a real S3-compatible server (SeaweedFS on loopback, signatures
//! checked): the keyed word count checkpoints to `s3://`, is crashed at random moments
//! and restarted, and publishes exactly the failure-free output.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stderr
)]

#[allow(unreachable_pub)]
#[path = "../../crates/stillpoint-backup/tests/support/s3.rs"]
mod s3;
mod support;

use std::time::{Duration, Instant};

use s3::{ACCESS_KEY, BUCKET, ENDPOINT, S3Server, SECRET_KEY};
use stillpoint::JobConfig;
use stillpoint_backup::{S3Credentials, Store, StoreOptions};
use stillpoint_connectors::{WordCount, WordInput};
use support::{committed_output, crash_rounds, expected_output, percentile};

fn options() -> StoreOptions {
    StoreOptions {
        s3_credentials: Some(S3Credentials {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: SECRET_KEY.into(),
            session_token: None,
        }),
        ..StoreOptions::default()
    }
}

fn wait_until_ready(uri: &str) {
    let store = Store::open(uri, options()).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(error) = runtime.block_on(store.checkpoints()) {
        assert!(
            Instant::now() < deadline,
            "S3 server not ready within 60 s: {error}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn crashes_against_a_real_s3_store_lose_and_duplicate_nothing() {
    let _server = S3Server::start();
    // Rounds on fresh prefixes and directories until the job was crashed often
    // enough: once a round has restored close to the end of its input, a run can
    // finish before its crash moment (one CI run saw 4 crashes in a round), so a
    // single round cannot promise the count. Each round is checked on its own.
    let (seen, round) = crash_rounds(
        10,
        7,
        |dir, round| {
            let uri =
                format!("s3://{BUCKET}/word-count-{round}?endpoint={ENDPOINT}&region=us-east-1");
            wait_until_ready(&uri);
            let mut config = JobConfig::new(dir.join("work"));
            config.store = Some(uri);
            config.store_options = options();
            config.checkpoint_interval = Duration::from_millis(50);
            config.lease_ttl = Duration::from_secs(5);
            let job = WordCount {
                sources: 2,
                aggregators: 3,
                input: WordInput::Generated {
                    words_per_source: 300_000,
                    vocabulary: 500,
                    seed: 9,
                },
                output: dir.join("out"),
                combine: false,
            };
            (config, job)
        },
        |_, job, round, this| {
            assert_eq!(
                committed_output(job),
                expected_output(job),
                "round {round}: {this:?}"
            );
        },
    );
    assert!(seen.restored > 0, "{seen:?}");
    assert!(seen.checkpoints > 0, "{seen:?}");
    eprintln!(
        "e2e s3: {round} rounds, {} crashes, {} restores, {} checkpoints, duration p50 {} ms p99 {} ms, stall p99 {} µs, {:.1} s",
        seen.crashes,
        seen.restored,
        seen.checkpoints,
        percentile(&seen.durations_millis, 50),
        percentile(&seen.durations_millis, 99),
        percentile(&seen.stalls_micros, 99),
        seen.elapsed.as_secs_f64()
    );
}
