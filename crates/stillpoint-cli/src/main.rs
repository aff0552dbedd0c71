//! `stillpoint`: runs checkpointed stream jobs — on the embedded default (RocksDB
//! state and a `file://` store under `./stillpoint-data`) or across processes — and
//! inspects, verifies, restores and garbage-collects checkpoint stores.
//!
//! ```text
//! stillpoint run [JOB.toml]                  the job (default: the built-in word count)
//! stillpoint pause | resume [JOB.toml]       pause or resume its sources
//! stillpoint coordinator JOB.toml            a cluster job's coordinator process
//! stillpoint node JOB.toml --node N          one of its node processes
//! stillpoint checkpoints list | show ID | verify [ID] | restore ID DIR | gc [--dry-run]
//!                        | stats [--plot FILE.svg]      [--store URI | --job JOB.toml]
//! ```

// A command-line tool's output is its interface.
#![allow(clippy::print_stdout, clippy::print_stderr)]

/// `println!` that ends the process quietly when stdout is closed (`stillpoint
/// checkpoints list | head`): a closed pipe is the reader saying it has seen enough,
/// not a reason to panic, which std's `println!` does. Shadows std's in every module.
macro_rules! println {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(error) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(&error)
        }
    }};
}

// jemalloc, as TiKV and RisingWave use: glibc's malloc stalls a task for hundreds
// of milliseconds when the fastbins of a freed multi-million-entry frozen state map
// are consolidated (docs/performance.md, the barrier-stall figure).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod checkpoints;
mod plot;
mod progress;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use stillpoint::{CheckpointStats, JobReport, RunOptions, StopHandle};
use stillpoint_cli::Job;
use stillpoint_cluster::ClusterConfig;
use stillpoint_connectors::WordInput;
use stillpoint_wire::NodeId;

#[derive(Debug, Parser)]
#[command(
    name = "stillpoint",
    version,
    about = "Checkpointed stream jobs with exactly-once results, and the stores that keep their checkpoints."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log filter for messages on stderr (`warn`, `info`, `stillpoint=debug`, …).
    #[arg(long, global = true, env = "STILLPOINT_LOG", default_value = "warn")]
    log: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs a job with periodic checkpoints; with no file, the built-in keyed word
    /// count over generated words in ./stillpoint-data. Rerunning resumes from the
    /// last checkpoint; Ctrl-C stops after a final one.
    Run {
        /// The job file (TOML); see examples/.
        job: Option<PathBuf>,
        /// Work under this directory instead of the job's `work_dir`.
        #[arg(long)]
        data: Option<PathBuf>,
        /// On Ctrl-C, stop with a savepoint instead of a checkpoint: it is kept until
        /// deleted, and a later run may restore it with other parallelisms.
        #[arg(long)]
        savepoint_on_stop: bool,
        /// Restore even when the sinks already published output newer than the
        /// restore point (the newer checkpoints are damaged or gone), publishing it
        /// again; without it such a run is refused.
        #[arg(long)]
        allow_duplicates: bool,
    },
    /// Pauses the sources of the job running (or next run) in the job's work
    /// directory: they read nothing until `resume`, while checkpoints go on. The
    /// pause lasts across restarts until resumed.
    Pause {
        /// The job file (default: the built-in word count).
        job: Option<PathBuf>,
        /// The work directory, if `run` was given `--data`.
        #[arg(long)]
        data: Option<PathBuf>,
    },
    /// Resumes the sources of a paused job.
    Resume {
        /// The job file (default: the built-in word count).
        job: Option<PathBuf>,
        /// The work directory, if `run` was given `--data`.
        #[arg(long)]
        data: Option<PathBuf>,
    },
    /// Runs the coordinator of a cluster job (`[cluster]` in the job file).
    Coordinator {
        /// The job file.
        job: PathBuf,
        /// On Ctrl-C, stop with a savepoint instead of a checkpoint.
        #[arg(long)]
        savepoint_on_stop: bool,
        /// Restore even past output the sinks already published (see `run`).
        #[arg(long)]
        allow_duplicates: bool,
    },
    /// Runs one node of a cluster job.
    Node {
        /// The job file.
        job: PathBuf,
        /// Which node (1-based, as listed in `[cluster] nodes`).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        node: u32,
    },
    /// Inspects and manages a checkpoint store.
    Checkpoints(checkpoints::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match dispatch(cli.command) {
        Ok(code) => code,
        Err(error) => {
            if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
                eprintln!("stillpoint: error: {error:?}");
            } else {
                eprintln!("stillpoint: error: {}", one_line(&error));
            }
            ExitCode::FAILURE
        }
    }
}

/// Stdout cannot be written: a closed pipe exits as a shell reports a process ended
/// by SIGPIPE (141), silently; anything else is said on stderr.
fn stdout_failed(error: &std::io::Error) -> ! {
    if error.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(141);
    }
    eprintln!("stillpoint: error: cannot write to stdout: {error}");
    std::process::exit(1);
}

fn dispatch(command: Command) -> Result<ExitCode> {
    match command {
        Command::Run {
            job,
            data,
            savepoint_on_stop,
            allow_duplicates,
        } => run(job.as_deref(), data, savepoint_on_stop, allow_duplicates),
        Command::Pause { job, data } => pause(job.as_deref(), data, true),
        Command::Resume { job, data } => pause(job.as_deref(), data, false),
        Command::Coordinator {
            job,
            savepoint_on_stop,
            allow_duplicates,
        } => coordinator(&job, savepoint_on_stop, allow_duplicates),
        Command::Node { job, node } => {
            let loaded = Job::load(&job)?;
            let cluster = cluster_of(&loaded)?;
            stillpoint_cluster::run_node(&loaded.config, cluster, &loaded.pipeline, NodeId(node))
                .with_context(|| format!("node {node}"))?;
            print_faults(&loaded);
            Ok(ExitCode::SUCCESS)
        }
        Command::Checkpoints(args) => checkpoints::run(args),
    }
}

fn load(job: Option<&Path>, data: Option<PathBuf>) -> Result<Job> {
    let mut loaded = match job {
        Some(path) => Job::load(path)?,
        None => Job::embedded_default(),
    };
    if let Some(data) = data {
        // The store and the output follow the data directory unless set explicitly.
        if loaded.pipeline.output == loaded.config.work_dir.join("output") {
            loaded.pipeline.output = data.join("output");
        }
        loaded.config.work_dir = data;
    }
    Ok(loaded)
}

fn describe(job: &Job) -> String {
    let input = match &job.pipeline.input {
        WordInput::Generated {
            words_per_source, ..
        } => format!("{words_per_source} generated words each"),
        WordInput::Files { paths } => format!("{} files", paths.len()),
        WordInput::Log { dirs } => format!("{} logs", dirs.len()),
    };
    format!(
        "keyed word count: {} sources ({input}) → {} counters → exactly-once file sinks; state in {}, checkpoints to {}",
        job.pipeline.sources,
        job.pipeline.aggregators,
        job.config.work_dir.display(),
        job.config.store_uri()
    )
}

/// Ctrl-C (or SIGTERM) pulls the stop once (with a savepoint if `savepoint`); a second
/// one exits at once.
fn stop_on_signal(stop: StopHandle, savepoint: bool) -> Result<()> {
    let pulled = Arc::new(AtomicBool::new(false));
    ctrlc::set_handler(move || {
        if pulled.swap(true, Ordering::SeqCst) {
            eprintln!("stillpoint: stopping now; the next run resumes from the last checkpoint");
            std::process::exit(130);
        }
        if savepoint {
            eprintln!("stillpoint: stopping after a savepoint (Ctrl-C again to stop now)");
            stop.stop_with_savepoint();
        } else {
            eprintln!("stillpoint: stopping after a final checkpoint (Ctrl-C again to stop now)");
            stop.stop();
        }
    })
    .context("cannot install the Ctrl-C handler")
}

fn print_start(report: &JobReport, store: &str) {
    for fallback in &report.fell_back_from {
        println!(
            "checkpoint {} does not verify, skipped: {}",
            fallback.checkpoint.get(),
            fallback.problem
        );
    }
    match report.restored_from {
        Some(id) => println!("resuming from checkpoint {} in {store}", id.get()),
        None => println!("starting fresh: no checkpoint in {store}"),
    }
    if let Some(replay) = report.replayed {
        println!(
            "replaying exactly to the end of the published output of checkpoint {}: its {} records are not published again",
            replay.through.get(),
            replay.records
        );
    }
}

fn print_checkpoint(stats: &CheckpointStats) {
    println!(
        "{:<10} {:>5}  took {:>6} ms  stall {:>7.2} ms  uploaded {:>9} of {:>9}",
        stats.kind,
        stats.checkpoint,
        stats.duration_millis,
        stats.max_sync_micros as f64 / 1e3,
        progress::bytes(stats.uploaded_bytes),
        progress::bytes(stats.state_bytes)
    );
}

/// Describes the job, stops it on Ctrl-C (with a savepoint if `savepoint`), and prints
/// its start and each checkpoint.
fn announce(job: &Job, savepoint: bool) -> Result<RunOptions> {
    println!("{}", describe(job));
    let stop = StopHandle::new();
    stop_on_signal(stop.clone(), savepoint)?;
    let store = job.config.store_uri();
    Ok(RunOptions {
        stop,
        on_start: Some(Box::new(move |report| print_start(report, &store))),
        on_checkpoint: Some(Box::new(print_checkpoint)),
        ..RunOptions::default()
    })
}

/// One line a person can act on: the chain of causes, each said once (library errors
/// often show their source in their own message too), no trace.
fn one_line(error: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in error.chain() {
        let text = cause.to_string().replace('\n', " ");
        if !message.contains(&text) {
            if !message.is_empty() {
                message.push_str(": ");
            }
            message.push_str(&text);
        }
    }
    message
}

/// With `[store] fault_ratio` set, how many store operations this process failed on
/// purpose (so a chaos run shows the faults really happened).
fn print_faults(job: &Job) {
    if let Some(faults) = &job.config.store_options.faults {
        println!(
            "chaos: {} store operation(s) failed on purpose (fault_ratio {})",
            faults.injected(),
            faults.error_ratio
        );
    }
}

fn run(
    job: Option<&Path>,
    data: Option<PathBuf>,
    savepoint: bool,
    allow_duplicates: bool,
) -> Result<ExitCode> {
    let mut job = load(job, data)?;
    job.config.allow_duplicates |= allow_duplicates;
    if job.cluster.is_some() {
        anyhow::bail!(
            "the job has a [cluster] section: start `stillpoint coordinator` and one `stillpoint node` per node instead"
        );
    }
    let options = RunOptions {
        on_metrics: Some(Box::new(|address| {
            println!("metrics at http://{address}/metrics");
        })),
        ..announce(&job, savepoint)?
    };
    follow_pause_marker(job.config.work_dir.join(PAUSE_MARKER), options.stop.clone());
    let report = stillpoint::run(&job.config, &job.pipeline, options)?;
    println!(
        "done: {} checkpoint(s) this run; committed output in {}",
        report.checkpoints.len(),
        job.pipeline.output.join("committed").display()
    );
    print_faults(&job);
    Ok(ExitCode::SUCCESS)
}

/// The file in a job's work directory that says its sources are paused.
const PAUSE_MARKER: &str = "PAUSED";

/// `stillpoint pause` / `resume`: creates or removes the pause marker that a run in
/// that work directory follows.
fn pause(job: Option<&Path>, data: Option<PathBuf>, paused: bool) -> Result<ExitCode> {
    let job = load(job, data)?;
    let work_dir = &job.config.work_dir;
    let marker = work_dir.join(PAUSE_MARKER);
    if paused {
        std::fs::create_dir_all(work_dir)
            .with_context(|| format!("cannot create {}", work_dir.display()))?;
        std::fs::write(&marker, b"paused by `stillpoint pause`\n")
            .with_context(|| format!("cannot write {}", marker.display()))?;
        println!(
            "paused: the sources of the job in {} stop reading within a second; checkpoints go on; `stillpoint resume` lets them read again",
            work_dir.display()
        );
    } else {
        match std::fs::remove_file(&marker) {
            Ok(()) => println!(
                "resumed: the sources of the job in {} read again",
                work_dir.display()
            ),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                println!("not paused: nothing to resume in {}", work_dir.display());
            }
            Err(error) => {
                return Err(error).with_context(|| format!("cannot remove {}", marker.display()));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Pauses and resumes `stop`'s job as `marker` appears and goes (checked every
/// 200 ms, from a thread that ends with the process).
fn follow_pause_marker(marker: PathBuf, stop: StopHandle) {
    let follow = move || {
        loop {
            let paused = marker.exists();
            if paused != stop.paused() {
                if paused {
                    stop.pause();
                    println!("paused: sources read nothing until `stillpoint resume`");
                } else {
                    stop.resume();
                    println!("resumed");
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    if let Err(error) = std::thread::Builder::new()
        .name("pause".into())
        .spawn(follow)
    {
        tracing::warn!(%error, "cannot follow the pause marker: pause and resume do nothing");
    }
}

/// The job's `[cluster]` section, which the coordinator and node commands need.
fn cluster_of(job: &Job) -> Result<&ClusterConfig> {
    job.cluster.as_ref().context(
        "the job has no [cluster] section: run it with `stillpoint run`, or add [cluster] to run it across processes",
    )
}

fn coordinator(path: &Path, savepoint: bool, allow_duplicates: bool) -> Result<ExitCode> {
    let mut job = Job::load(path)?;
    job.config.allow_duplicates |= allow_duplicates;
    let options = announce(&job, savepoint)?;
    // The coordinator follows the marker and tells the nodes, whose sources pause.
    follow_pause_marker(job.config.work_dir.join(PAUSE_MARKER), options.stop.clone());
    let cluster = cluster_of(&job)?;
    let report = stillpoint_cluster::run_coordinator(&job.config, cluster, &job.pipeline, options)?;
    println!("done: {} checkpoint(s) this run", report.checkpoints.len());
    print_faults(&job);
    Ok(ExitCode::SUCCESS)
}
