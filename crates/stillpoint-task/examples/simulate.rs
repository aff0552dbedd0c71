//! Runs the protocol simulators over many seeds: `cargo xtask sim --seeds N` (or one
//! seed: `--seed S [--topology NAME]`), and with `--cluster` the cluster protocol's.
//! Prints totals, or the first violation with the command that replays it; exits
//! non-zero on a violation.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::fmt::{Debug, Display};
use std::process::ExitCode;
use std::time::Instant;

use stillpoint_task::sim::{self, ClusterSimConfig, SimConfig, Topology};

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
    let range = match single {
        Some(seed) => seed..seed + 1,
        None => first..first + seeds,
    };
    let trace = single.is_some();
    if args.iter().any(|a| a == "--cluster") {
        let (mut faults, mut generations, mut fell_back, mut checkpoints, mut events) =
            (0_u64, 0_u64, 0_u64, 0_u64, 0_u64);
        let configs = range.map(|seed| ClusterSimConfig {
            trace,
            ..ClusterSimConfig::new(seed)
        });
        let Some((runs, secs)) = campaign(configs, sim::run_cluster, trace, |outcome| {
            faults += u64::from(outcome.faults);
            generations += outcome.generations;
            fell_back += u64::from(outcome.fell_back);
            checkpoints += outcome.checkpoints;
            events += outcome.events;
        }) else {
            return ExitCode::FAILURE;
        };
        println!(
            "{runs} cluster runs, 0 violations: {faults} faults injected, {generations} generations, {fell_back} fallbacks past corrupt checkpoints, {checkpoints} checkpoints, {events} events in {secs:.1} s"
        );
        return ExitCode::SUCCESS;
    }
    let topologies: Vec<Topology> = match value("--topology").map(|t| t.parse::<Topology>()) {
        Some(Ok(t)) => vec![t],
        Some(Err(e)) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        None => Topology::CI.to_vec(),
    };
    let (mut events, mut completed, mut aborted, mut failovers) = (0_u64, 0_u64, 0_u64, 0_u64);
    let configs = range.flat_map(|seed| {
        topologies.iter().map(move |&topology| SimConfig {
            trace,
            ..SimConfig::new(seed, topology)
        })
    });
    let Some((runs, secs)) = campaign(configs, sim::run, trace, |outcome| {
        events += outcome.events;
        completed += u64::from(outcome.completed);
        aborted += u64::from(outcome.aborted);
        failovers += u64::from(outcome.failovers);
    }) else {
        return ExitCode::FAILURE;
    };
    println!(
        "{runs} runs, 0 violations: {completed} checkpoints completed, {aborted} aborted, {failovers} failovers, {events} machine events in {secs:.1} s ({:.0} events/s)",
        events as f64 / secs
    );
    ExitCode::SUCCESS
}

/// Runs every configuration, tallying each outcome (printed too when `verbose`);
/// the runs and seconds taken, or `None` after printing the first violation.
fn campaign<C, O: Debug, E: Display>(
    configs: impl Iterator<Item = C>,
    run: impl Fn(&C) -> Result<O, E>,
    verbose: bool,
    mut tally: impl FnMut(&O),
) -> Option<(u64, f64)> {
    let started = Instant::now();
    let mut runs = 0_u64;
    for config in configs {
        match run(&config) {
            Ok(outcome) => {
                runs += 1;
                tally(&outcome);
                if verbose {
                    println!("{outcome:?}");
                }
            }
            Err(violation) => {
                eprintln!("VIOLATION {violation}");
                return None;
            }
        }
    }
    Some((runs, started.elapsed().as_secs_f64()))
}
