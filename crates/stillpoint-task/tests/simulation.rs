//! The protocol simulator in CI: 2,000 seeds per topology (10,000 runs), each with
//! lost, duplicated and reordered control messages, crashes and failing exports per
//! its fault profile, every invariant checked. `cargo xtask sim --seeds N` runs more.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use stillpoint_task::sim::{self, Faults, SimConfig, Topology};

const SEEDS_PER_TOPOLOGY: u64 = 2_000;

fn campaign(topology: Topology) {
    let mut completed: u64 = 0;
    for seed in 0..SEEDS_PER_TOPOLOGY {
        match sim::run(&SimConfig::new(seed, topology)) {
            Ok(outcome) => completed += u64::from(outcome.completed),
            Err(violation) => panic!("{violation}"),
        }
    }
    assert!(
        completed >= SEEDS_PER_TOPOLOGY,
        "{topology}: checkpoints must complete"
    );
}

#[test]
fn chain() {
    campaign(Topology::Chain);
}

#[test]
fn diamond() {
    campaign(Topology::Diamond);
}

#[test]
fn fan_in_8() {
    campaign(Topology::FanIn8);
}

#[test]
fn fan_out_8() {
    campaign(Topology::FanOut8);
}

#[test]
fn mixed_3_levels() {
    campaign(Topology::Mixed3);
}

#[test]
fn wide_64_tasks() {
    for seed in 0..20 {
        sim::run(&SimConfig::new(seed, Topology::Wide64)).unwrap_or_else(|v| panic!("{v}"));
    }
}

#[test]
fn a_seed_replays_bit_for_bit() {
    for seed in [3, 7, 11] {
        let mut config = SimConfig::new(seed, Topology::Mixed3);
        config.trace = true;
        assert_eq!(sim::run(&config), sim::run(&config), "seed {seed}");
    }
}

#[test]
fn a_fault_free_run_aborts_nothing() {
    for topology in Topology::CI {
        for seed in 0..50 {
            let config = SimConfig {
                faults: Faults::none(),
                ..SimConfig::new(seed, topology)
            };
            let outcome = sim::run(&config).unwrap_or_else(|v| panic!("{v}"));
            assert_eq!(
                (outcome.aborted, outcome.failovers),
                (0, 0),
                "{topology} seed {seed}"
            );
            assert!(outcome.completed >= 1);
        }
    }
}

#[test]
fn crashes_really_happen_and_are_survived() {
    let failovers: u32 = (0..200)
        .filter(|seed| seed % 4 == 2)
        .map(|seed| {
            sim::run(&SimConfig::new(seed, Topology::Chain))
                .unwrap_or_else(|v| panic!("{v}"))
                .failovers
        })
        .sum();
    assert!(
        failovers > 20,
        "the crash profile must exercise recovery, got {failovers} failovers"
    );
}
