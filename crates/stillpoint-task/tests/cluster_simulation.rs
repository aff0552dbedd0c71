//! The cluster protocol's simulator in CI: 10,000 seeded runs of a coordinator and
//! 1–5 nodes with node and coordinator crashes, broken connections, corrupt
//! checkpoints and failing tasks per the seed's fault profile, every invariant
//! checked. `cargo xtask sim --cluster --seeds N` runs more.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use stillpoint_task::sim::{ClusterFaults, ClusterSimConfig, run_cluster};

const SEEDS: u64 = 10_000;

#[test]
fn ten_thousand_cluster_runs_keep_every_invariant() {
    let (mut faults, mut generations, mut fell_back) = (0_u64, 0_u64, 0_u64);
    for seed in 0..SEEDS {
        match run_cluster(&ClusterSimConfig::new(seed)) {
            Ok(outcome) => {
                faults += u64::from(outcome.faults);
                generations += outcome.generations;
                fell_back += u64::from(outcome.fell_back);
            }
            Err(violation) => panic!("{violation}"),
        }
    }
    // The campaign is only worth its time if it exercised what it claims to.
    assert!(faults > SEEDS, "{faults} faults injected");
    assert!(generations > SEEDS * 2, "{generations} generations");
    assert!(
        fell_back > SEEDS / 100,
        "{fell_back} fallbacks past corrupt checkpoints"
    );
}

#[test]
fn a_cluster_seed_replays_bit_for_bit() {
    for seed in [5, 7, 11, 15] {
        let mut config = ClusterSimConfig::new(seed);
        config.trace = true;
        let (a, b) = (run_cluster(&config), run_cluster(&config));
        assert_eq!(a, b);
    }
}

/// Far more faults than the failover budget: every run still ends — finished, or
/// failed saying it failed over too often — and never hangs.
#[test]
fn a_fault_storm_ends_every_run() {
    let mut gave_up = 0;
    for seed in 0..300 {
        let mut config = ClusterSimConfig::new(seed);
        config.faults = ClusterFaults {
            node_crash_per_ms: 0.02,
            disconnect_per_ms: 0.02,
            coordinator_crash_per_ms: 0.002,
            task_failure_per_ms: 0.01,
            corrupt: 0.2,
            build_failure: 0.2,
            max_faults: 200,
        };
        let outcome = run_cluster(&config).unwrap_or_else(|v| panic!("{v}"));
        gave_up += u32::from(outcome.gave_up);
    }
    assert!(gave_up > 0, "the storm never exhausted the failover budget");
}
