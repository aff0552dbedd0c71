//! Runs the protocol simulator over many seeds: `cargo xtask sim --seeds N` (or one
//! seed: `--seed S [--topology NAME]`). Prints totals, or the first violation with
//! the command that replays it; exits non-zero on a violation.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;
use std::time::Instant;

use stillpoint_task::sim::{self, SimConfig, Topology};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let seeds: u64 = value("--seeds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let first: u64 = value("--first").and_then(|v| v.parse().ok()).unwrap_or(0);
    let single: Option<u64> = value("--seed").and_then(|v| v.parse().ok());
    if args.iter().any(|a| a == "--cluster") {
        return cluster(first, seeds, single);
    }
    let topologies: Vec<Topology> = match value("--topology").map(|t| t.parse::<Topology>()) {
        Some(Ok(t)) => vec![t],
        Some(Err(e)) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        None => Topology::CI.to_vec(),
    };
    let range = match single {
        Some(seed) => seed..seed + 1,
        None => first..first + seeds,
    };
    let started = Instant::now();
    let (mut runs, mut events, mut completed, mut aborted, mut failovers) =
        (0_u64, 0_u64, 0_u64, 0_u64, 0_u64);
    for seed in range {
        for &topology in &topologies {
            let mut config = SimConfig::new(seed, topology);
            config.trace = single.is_some();
            match sim::run(&config) {
                Ok(outcome) => {
                    runs += 1;
                    events += outcome.events;
                    completed += u64::from(outcome.completed);
                    aborted += u64::from(outcome.aborted);
                    failovers += u64::from(outcome.failovers);
                    if single.is_some() {
                        println!("{outcome:?}");
                    }
                }
                Err(violation) => {
                    eprintln!("VIOLATION {violation}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{runs} runs, 0 violations: {completed} checkpoints completed, {aborted} aborted, {failovers} failovers, {events} machine events in {secs:.1} s ({:.0} events/s)",
        events as f64 / secs
    );
    ExitCode::SUCCESS
}

/// The cluster protocol's simulator (`--cluster`).
fn cluster(first: u64, seeds: u64, single: Option<u64>) -> ExitCode {
    let range = match single {
        Some(seed) => seed..seed + 1,
        None => first..first + seeds,
    };
    let started = Instant::now();
    let (mut runs, mut events, mut generations, mut faults, mut fell_back, mut checkpoints) =
        (0_u64, 0_u64, 0_u64, 0_u64, 0_u64, 0_u64);
    for seed in range {
        let mut config = sim::ClusterSimConfig::new(seed);
        config.trace = single.is_some();
        match sim::run_cluster(&config) {
            Ok(outcome) => {
                runs += 1;
                events += outcome.events;
                generations += outcome.generations;
                faults += u64::from(outcome.faults);
                fell_back += u64::from(outcome.fell_back);
                checkpoints += outcome.checkpoints;
                if single.is_some() {
                    println!("{outcome:?}");
                }
            }
            Err(violation) => {
                eprintln!("VIOLATION {violation}");
                return ExitCode::FAILURE;
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{runs} cluster runs, 0 violations: {faults} faults injected, {generations} generations, {fell_back} fallbacks past corrupt checkpoints, {checkpoints} checkpoints, {events} events in {secs:.1} s"
    );
    ExitCode::SUCCESS
}
