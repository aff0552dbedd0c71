//! `cargo xtask`: the workspace's developer tasks, so that no shell script is needed.
//!
//! ```text
//! cargo xtask setup              check (and where permitted install) build prerequisites
//! cargo xtask run                setup, then run the main job
//! cargo xtask test               setup, then every test of the workspace
//! cargo xtask lint               rustfmt --check and clippy -D warnings
//! cargo xtask ci                 lint, then test
//! cargo xtask tidy               the repository rules (also part of `test`)
//! cargo xtask bench [--quick] [--no-peers]   criterion benches and peers; figures to target/bench/report.{md,json}
//! cargo xtask fuzz [SECS] [TARGET...]   libFuzzer campaigns, SECS each (default 60)
//! cargo xtask sim [--cluster] [--seeds N] [--first F] [--seed S] [--topology T]   protocol simulators
//! cargo xtask torture [--runs N] [--procs 1|3] [--seed S] [--faults R]   SIGKILL crash loop of the binary
//! cargo xtask release [--dry-run] VERSION   bump, changelog, package, publish dry run
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bench;
mod fuzz;
mod peers;
mod release;
mod setup;
mod util;

use std::process::ExitCode;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, workspace_root};

const USAGE: &str = "usage: cargo xtask <setup | run | test | lint | ci | tidy | bench [--quick] [--no-peers] | fuzz [SECS] [TARGET...] | sim [--cluster] [--seeds N] [--first F] [--seed S] [--topology T] | torture [--runs N] [--procs 1|3] [--seed S] [--faults R] | release [--dry-run] VERSION>";

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<String>) -> Result<()> {
    let root = workspace_root()?;
    std::env::set_current_dir(&root)
        .with_context(|| format!("cannot enter the workspace at {}", root.display()))?;
    let (task, rest) = args
        .split_first()
        .map_or(("", &[][..]), |(t, r)| (t.as_str(), r));
    match task {
        "setup" => setup::run(),
        "run" => {
            setup::run()?;
            main_job(rest)
        }
        "test" => {
            setup::run()?;
            setup::test_services()?;
            test()
        }
        "lint" => lint(),
        "ci" => {
            setup::run()?;
            setup::test_services()?;
            lint()?;
            test()
        }
        "tidy" => cargo(&["test", "--package", "xtask", "--test", "tidy"]),
        "bench" => bench::run(rest),
        "fuzz" => fuzz::run(rest),
        "sim" => sim(rest),
        "torture" => torture(rest),
        "release" => release::run(rest),
        "" | "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task `{other}`\n{USAGE}"),
    }
}

/// The README's first command: `stillpoint run` on the embedded default (the
/// built-in keyed word count, RocksDB state and a `file://` store under
/// `./stillpoint-data`), built in the dev profile so it shares the test build. Extra
/// arguments go to `stillpoint run` (a job file, `--data DIR`).
fn main_job(args: &[String]) -> Result<()> {
    let built = util::target_dir()?.join("debug/stillpoint").is_file();
    let plan = MainJob::plan(built, args);
    eprintln!("xtask: run: {}", plan.notice);
    cargo(&plan.build)?;
    cargo(&plan.run)
}

/// What `cargo xtask run` says and runs: the build first, on its own and with cargo's
/// progress shown (a first build compiles RocksDB from C++ and would otherwise be
/// silent for many minutes), then the quiet run of the built binary.
struct MainJob<'a> {
    notice: &'static str,
    build: Vec<&'a str>,
    run: Vec<&'a str>,
}

impl<'a> MainJob<'a> {
    fn plan(built: bool, args: &'a [String]) -> Self {
        let notice = if built {
            "building stillpoint (debug profile)"
        } else {
            "first build of stillpoint — cargo compiles RocksDB from C++ source, \
             about 25 minutes on 2 cores (seconds once built); its progress follows"
        };
        let build = vec![
            "build",
            "--package",
            "stillpoint-cli",
            "--bin",
            "stillpoint",
        ];
        let mut run = vec!["run", "--quiet", "--package", "stillpoint-cli", "--", "run"];
        run.extend(args.iter().map(String::as_str));
        Self { notice, build, run }
    }
}

/// The protocol simulators of `stillpoint-task` over many seeds — the checkpoint
/// protocol's, or with `--cluster` the cluster protocol's (CI runs 10,000 runs of each;
/// this runs as many as asked). Built in the dev profile, which optimizes the protocol
/// crate, so it shares the test build.
fn sim(args: &[String]) -> Result<()> {
    let mut command = vec![
        "run",
        "--quiet",
        "--package",
        "stillpoint-task",
        "--features",
        "sim",
        "--example",
        "simulate",
        "--",
    ];
    command.extend(args.iter().map(String::as_str));
    cargo(&command)
}

/// The crash loop of `crates/stillpoint-cli/tests/torture.rs` at full size: at least
/// N SIGKILLs (default 200) of `stillpoint run`, and of a coordinator and two node
/// processes, at uniformly random times, each round's output checked exactly once.
/// The dev profile, so it shares the test build.
fn torture(args: &[String]) -> Result<()> {
    let mut runs = "200".to_owned();
    let mut procs = None;
    let mut seed = "1".to_owned();
    let mut faults = None;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let mut value = |name: &str| {
            rest.next()
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))
        };
        match arg.as_str() {
            "--runs" => runs = value("--runs")?,
            "--procs" => procs = Some(value("--procs")?),
            "--seed" => seed = value("--seed")?,
            "--faults" => faults = Some(value("--faults")?),
            other => bail!("unknown torture option `{other}`\n{USAGE}"),
        }
    }
    for (name, value) in [("--runs", &runs), ("--seed", &seed)] {
        if value.parse::<u64>().is_err() {
            bail!("{name} takes a number, not `{value}`");
        }
    }
    if procs.as_deref().is_some_and(|p| p != "1" && p != "3") {
        bail!("--procs is 1 or 3");
    }
    let mut command = std::process::Command::new(util::cargo_bin());
    command
        .args([
            "test",
            "--locked",
            "--package",
            "stillpoint-cli",
            "--test",
            "torture",
        ])
        .args(["--", "--nocapture", "--test-threads", "1"])
        .env("STILLPOINT_TORTURE_KILLS", &runs)
        .env("STILLPOINT_TORTURE_SEED", &seed);
    if let Some(procs) = procs {
        command.env("STILLPOINT_TORTURE_PROCS", procs);
    }
    if let Some(faults) = faults {
        if !faults.parse::<f64>().is_ok_and(|r| (0.0..1.0).contains(&r)) {
            bail!("--faults takes a ratio in 0.0..1.0, not `{faults}`");
        }
        command.env("STILLPOINT_TORTURE_FAULTS", faults);
    }
    util::run_command(&mut command)
}

/// Every test of the workspace, built once (dev profile): unit, integration, example,
/// bench smoke tests (which must print every figure of the bench report), then
/// doctests.
fn test() -> Result<()> {
    let figures = bench::collect(std::process::Command::new(util::cargo_bin()).args([
        "test",
        "--workspace",
        "--all-targets",
        "--locked",
    ]))?;
    let missing = bench::missing(&figures);
    if !missing.is_empty() {
        bail!(
            "the bench smoke runs printed no figure {}",
            missing.join(", ")
        );
    }
    cargo(&["test", "--workspace", "--doc", "--locked"])
}

fn lint() -> Result<()> {
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ])
}

#[cfg(test)]
mod tests {
    use super::MainJob;

    #[test]
    fn the_first_run_says_it_builds_rocksdb_and_shows_cargos_progress() {
        let args = vec!["job.toml".to_owned()];
        let first = MainJob::plan(false, &args);
        assert!(first.notice.contains("RocksDB") && first.notice.contains("25 minutes"));
        // The build is its own step and not `--quiet`: cargo's progress is what the
        // user sees for those minutes; only the run of the built binary is quiet.
        assert_eq!(first.build.first(), Some(&"build"));
        assert!(!first.build.contains(&"--quiet"), "{:?}", first.build);
        assert!(first.run.contains(&"--quiet"));
        assert_eq!(first.run.last(), Some(&"job.toml"));
        let later = MainJob::plan(true, &args);
        assert!(!later.notice.contains("RocksDB"), "{}", later.notice);
        assert_eq!(later.build, first.build);
    }
}
