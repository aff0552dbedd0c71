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
use support::{CrashLoop, committed_output, crash_loop, expected_output, percentile};

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
    let crashes = 10;
    let mut seen = CrashLoop::default();
    let mut round: u32 = 0;
    // Rounds on fresh prefixes and directories until the job was crashed often
    // enough: once a round has restored close to the end of its input, a run can
    // finish before its crash moment (one CI run saw 4 crashes in a round), so a
    // single round cannot promise the count. Each round is checked on its own.
    while seen.crashes < crashes {
        round += 1;
        let dir = tempfile::tempdir().unwrap();
        let uri = format!("s3://{BUCKET}/word-count-{round}?endpoint={ENDPOINT}&region=us-east-1");
        wait_until_ready(&uri);
        let mut config = JobConfig::new(dir.path().join("work"));
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
            output: dir.path().join("out"),
            combine: false,
        };
        // A checkpoint to S3 takes 200-500 ms here; crash moments up to 1.5 s let most
        // runs complete one, so later runs restore (a 400 ms window once crashed every
        // run before its first checkpoint on a loaded machine).
        let this = crash_loop(
            &config,
            &job,
            crashes - seen.crashes,
            Duration::from_millis(1500),
            6 + u64::from(round),
        );
        assert_eq!(
            committed_output(&job),
            expected_output(&job),
            "round {round}: {this:?}"
        );
        seen.merge(this);
    }
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
